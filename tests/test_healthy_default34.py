"""Healthy runs at ampdoctor's DEFAULT watch, thirty-fourth set: TRAINING RECIPES NOT PROBED BY THE EARLIER FILES.

Each case is a realistic recipe that could provoke a false alarm; `ampdoctor.watch(model, optimizer=...,
scaler=..., run_dir=tmp_path / "run")` and nothing else; CPU fp16 autocast with a real `torch.amp.GradScaler("cpu")`
(default init_scale 2**16), fixed seeds, one intra-op thread, 40-150 optimizer steps each. The harness is
tests/codebase_harness.py (test_healthy_default28-33's): every case runs twice,

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite; the case learned
  (the mean loss of the last fifth below `fall` x the first fifth's, or the case's own measure); probe_harness.
  Producer's forward hooks saw no module make inf/NaN from finite inputs; the gradients finite after every step
  that was not skipped; every weight finite at the end; skipped steps only the scaler's opening search and at most
  two isolated later ones;
- the WATCHED run must train bitwise identically (`identical`): losses, scales, skips, every step's gradients, the
  extras (learning rates, side losses, rewards), every final weight and buffer, the other modules' state (KD
  teacher, DQN target net), the optimizer's state_dict and the final scale; then (`judge`) w.report() after close()
  and ampdoctor.diagnose(run_dir) hold no warning and no error, exit code 0, one recorded step per optimizer step,
  and no `ampdoctor: ...` Python warning. A false alarm is a strict xfail (probe_harness.wrong: WrongAnswer only)
  whose reason quotes ampdoctor's one_line(); a failing oracle or a difference in training is a plain failure.

Left to earlier files (grep of tests/test_healthy*.py, test_codebase*.py): sparse Embedding + SparseAdam, no_sync
accumulation, activation checkpointing, channels_last, frozen .half() backbones, LoRA, warmup + cosine,
curriculum, GradScaler growth_interval tuning, label smoothing, tied embeddings, set_to_none=False,
clip_grad_value_, lr-0 groups, EMA / AveragedModel, in-loop validation, bf16 without a scaler (all already there).
New here (each 0-1 hits in those files): KLDivLoss(log_target), Rprop, Adamax + ChainedScheduler/ExponentialLR,
PixelShuffle, LayerScale at 1e-6, SELU/AlphaDropout, LocalResponseNorm/Dropout2d, NoisyLinear + Polyak target,
REINFORCE, gradient reversal, fast-FGSM's extra scaled backward, chamfer/cdist, gradient centralization, STFT
losses, hypernetworks, Tversky.

The cases (x ~ N(0, 1) in 16-D unless said; a fixed random linear "teacher" gives the labels):
 1. kd_kldiv_log_target: Hinton distillation from a frozen fp32 GELU teacher (confident logits, run under the same
    autocast, no_grad): 0.9 KLDivLoss(batchmean, log_target=True) at T=4 x T^2 + 0.1 CE on its argmax; the
    teacher is a separate module (compared, not watched);
 2. rprop_full_batch: torch.optim.Rprop (etas 0.5/1.2, step sizes 1e-6..1) on one fixed 256-sample regression
    batch, tanh MLP, 150 steps; the loss falls 0.34 -> 4e-5 (sign-based steps of multiplicatively growing size);
 3. adamax_chained_warmup_exponential: Adamax(lr 2e-2) under ChainedScheduler([LinearLR(0.01 -> 1 over 10),
    ExponentialLR(0.97)]), stepped each iteration, the lr logged;
 4. espcn_pixelshuffle_residual_l1: ESPCN (conv-tanh-conv-tanh-conv -> PixelShuffle(2)) predicting the residual
    over a bicubic F.interpolate of the 2x average-pooled image; L1 loss in fp32 (small: 0.08 -> 0.016);
 5. cait_layerscale_tiny_init: 3 pre-norm transformer blocks (nn.MultiheadAttention + GELU MLP) whose residual
    branches are multiplied by LayerScale gammas initialised to 1e-6 (CaiT's value for deep models), AdamW, grads
    unscaled and clipped at 1 (the gammas grow by orders of magnitude in the first steps);
 6. selu_alpha_dropout_snn: a self-normalizing net: 4 x (Linear with LeCun-normal init, SELU, AlphaDropout 0.05),
    SGD momentum;
 7. alexnet_lrn_dropout2d: AlexNet-style conv -> ReLU -> LocalResponseNorm(5, 1e-4, 0.75, k=2) -> MaxPool twice,
    Dropout2d, an FC classifier with Dropout, on 16x16 oriented gratings, SGD momentum + weight decay;
 8. noisy_dqn_polyak_target: offline double-DQN on a fixed random MDP (20 states, 4 actions): Rainbow's
    factorised-Gaussian NoisyLinear layers (noise buffers resampled from the global RNG every step, in the model
    and in its target), Huber TD loss with gamma 0.9, the target net Polyak-averaged (lerp_ tau 0.02) after each
    step, Adam(eps 1.5e-4);
 9. reinforce_bandit_baseline_entropy: REINFORCE on a contextual 4-armed bandit: actions sampled by
    torch.multinomial, advantage against an EMA baseline, an entropy bonus of 0.01; the loss goes negative (from
    0.29 to -0.34); learned: the mean reward rises by 0.3;
10. dann_gradient_reversal: DANN: a custom autograd.Function reversing and scaling the gradient into a domain
    classifier (lambda = 2/(1+exp(-10p)) - 1), source and shifted target batches through the model twice a step,
    the annealed lr of Ganin & Lempitsky; the total loss barely moves (the adversarial domain loss), learned: the
    label loss falls below 0.7x;
11. fast_fgsm_adversarial_training: Wong et al.'s fast FGSM: a first SCALED backward (scaler.scale(loss).backward())
    only for delta.grad, its parameter gradients discarded by zero_grad, delta += 1.25 eps sign(grad), clamp, then
    the ordinary step on x + delta: two scaled backwards per optimizer step;
12. pointnet_chamfer_autoencoder: PointNet encoder (Conv1d k=1, max-pool) + MLP decoder of 64 3-D points, chamfer
    distance via torch.cdist on fp32 casts, on random tilted ellipses;
13. gradient_centralization: Yong et al.: after scaler.unscale_, every conv/linear weight gradient has its mean
    over the fan-in dims subtracted in place (p.grad.sub_), BatchNorm convnet, SGD momentum;
14. multires_stft_loss_denoiser: a residual Conv1d waveform denoiser trained with L1 + ParallelWaveGAN's
    multi-resolution STFT loss (spectral convergence + log-magnitude L1 at n_fft 32/64/128, magnitudes clamped
    at 1e-7 before sqrt) on fp32 casts; the scaler skips steps 0, 21 and 42 (scale 2**16 -> 2**13: the
    log-magnitude gradient, up to 1/3e-4, overflows fp16 in the last conv's backward now and then; ordinary
    dynamic scaling, every loss finite and falling 5.9 -> 3.3; ampdoctor reports it as info);
15. hypernetwork_generated_weights: a hypernetwork (task nn.Embedding -> MLP) emitting all weights of a 16-32-1
    target MLP applied with F.linear, one of 8 tasks per step; one skipped step (step 9, an overflow of the
    hypernet's backward; info);
16. unet_bce_tversky: a two-level U-Net (BatchNorm convs, ConvTranspose2d, skip concatenation) segmenting noisy
    disks, BCE-with-logits + Tversky(alpha 0.3, beta 0.7) on fp32 sigmoids.

Result when written: 16 pass, 0 strict xfail: every case quiet (no warning, no error, no `ampdoctor: ...` Python
warning) and every run bitwise identical with and without the watch. The only findings in the file are info:
`overflow at net.4 step 0: The loss-scaled backward overflowed in `net.4` on 1 step(s) while the loss scale was
high; GradScaler skipped them and lowered the scale, as designed.` and `skipped_steps at (run) step 0: GradScaler
skipped 3 of 50 steps; a normal rate for dynamic loss scaling.` (multires_stft_loss_denoiser) and `skipped_steps at (run) step 9: GradScaler skipped 1 of 80 steps; ...`
(hypernetwork_generated_weights). XFAIL is empty. The file takes ~30 s.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import wrong  # noqa: E402
from scenarios import gen, one_thread  # noqa: E402
from codebase_harness import DEBUG, Rec, healthy, identical, judge, ns, registrar, run  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
F16 = torch.float16
CASES: dict = {}
XFAIL: dict[str, str] = {}

case = registrar(CASES)


# ------------------------------------------------------------------------------------------------------ data, model
W_T = torch.randn(16, 4, generator=gen(3400))
U_T = torch.randn(16, generator=gen(3401))


def teacher(seed, n=64, d=16, shift=0.0):
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, d, generator=g)
        return x + shift, (x @ W_T).argmax(1)
    return batch


def plain_mlp(h=64, d_out=4, act=nn.ReLU):
    return nn.Sequential(nn.Linear(16, h), act(), nn.Linear(h, h), act(), nn.Linear(h, d_out))


def amp_step(model, optimizer, scaler, rec, loss_fn, clip=None, sched=None, after_unscale=None):
    """The plain torch.amp recipe: autocast forward (`loss_fn()` -> (loss, logged)), scale(loss).backward(),
    [unscale_ + clip_grad_norm_ / after_unscale()], step, update, [sched.step()], zero_grad(set_to_none=True)."""
    with torch.autocast("cpu", dtype=F16):
        loss, logged = loss_fn()
    s = scaler.get_scale()
    scaler.scale(loss).backward()
    if clip is not None or after_unscale is not None:
        scaler.unscale_(optimizer)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if after_unscale is not None:
            after_unscale()
    scaler.step(optimizer)
    scaler.update()
    rec.after_update(scaler, s)
    if sched is not None:
        sched.step()
    optimizer.zero_grad(set_to_none=True)
    return logged


def ce_loss(model, data):
    def f(i):
        x, y = data(i)
        loss = F.cross_entropy(model(x), y)
        return loss, loss.item()
    return f


def fell(r, fall=0.8):
    ls = r.losses
    k = max(3, len(ls) // 5)
    assert sum(ls[-k:]) / k < fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)


def extra_fell(key, fall=0.8):
    def check(r):
        v = [float(t) for t in r.c.extra[key]]
        assert all(map(math.isfinite, v)), v
        k = max(3, len(v) // 5)
        assert sum(v[-k:]) / k < fall * sum(v[:k]) / k, (v[:k], v[-k:])
    return check


def extra_rose(key, by):
    def check(r):
        v = [float(t) for t in r.c.extra[key]]
        k = max(3, len(v) // 5)
        assert sum(v[-k:]) / k > sum(v[:k]) / k + by, (sum(v[:k]) / k, sum(v[-k:]) / k)
    return check


def gratings(seed, n=32, s=16):
    """4 classes of 16x16 images: a sinusoidal grating at 0/45/90/135 degrees, random phase and frequency, noise."""
    yy, xx = torch.meshgrid(torch.arange(s).float(), torch.arange(s).float(), indexing="ij")

    def batch(i):
        g = gen(seed * 100_000 + i)
        y = torch.randint(0, 4, (n,), generator=g)
        ang = y.float() * math.pi / 4
        fr = 0.6 + 0.4 * torch.rand(n, generator=g)
        ph = 2 * math.pi * torch.rand(n, generator=g)
        u = xx[None] * torch.cos(ang)[:, None, None] + yy[None] * torch.sin(ang)[:, None, None]
        img = torch.sin(fr[:, None, None] * u + ph[:, None, None]) + 0.5 * torch.randn(n, s, s, generator=g)
        return img[:, None], y
    return batch


# ----------------------------------------------------------------------- 1. knowledge distillation, KLDiv log_target
@case(60)
def kd_kldiv_log_target():
    torch.manual_seed(1)
    teach = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
    with torch.no_grad():
        teach[-1].weight.mul_(4.0)                  # confident teacher logits
    teach.eval().requires_grad_(False)
    model = plain_mlp(h=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    kl = nn.KLDivLoss(reduction="batchmean", log_target=True)
    T, a = 4.0, 0.9

    def loss_fn(i):
        x = torch.randn(64, 16, generator=gen(1_000_000 + i))
        with torch.no_grad():
            t = teach(x)
        s = model(x)
        soft = kl(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)) * T * T
        loss = a * soft + (1 - a) * F.cross_entropy(s, t.argmax(-1))
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)),
              others={"teacher": teach})


# ----------------------------------------------------------------------- 2. Rprop on a full batch
@case(150, fall=0.5)
def rprop_full_batch():
    torch.manual_seed(2)
    model = plain_mlp(h=32, d_out=1, act=nn.Tanh)
    optimizer = torch.optim.Rprop(model.parameters(), lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 1.0))
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    g = gen(2_000_000)
    x = torch.randn(256, 16, generator=g)
    y = torch.tanh(x @ U_T / 4)[:, None] + 0.05 * torch.randn(256, 1, generator=g)

    def loss_fn():
        loss = F.mse_loss(model(x).float(), y)
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, loss_fn))


# ----------------------------------------------------------------------- 3. Adamax, ChainedScheduler(warmup, exp)
@case(60)
def adamax_chained_warmup_exponential():
    torch.manual_seed(3)
    model = plain_mlp()
    optimizer = torch.optim.Adamax(model.parameters(), lr=2e-2)
    sched = torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=10),
        torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.97)])
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, teacher(3))
    extra = {"lr": []}

    def body(i):
        extra["lr"].append(optimizer.param_groups[0]["lr"])
        return amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i), sched=sched)
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 4. ESPCN super-resolution (PixelShuffle)
class ESPCN(nn.Module):
    def __init__(self, r=2):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.Tanh(), nn.Conv2d(32, 16, 3, padding=1),
                                  nn.Tanh(), nn.Conv2d(16, r * r, 3, padding=1), nn.PixelShuffle(r))

    def forward(self, lr):
        base = F.interpolate(lr, scale_factor=2, mode="bicubic", align_corners=False)
        return base + self.body(lr)


def smooth_images(g, n=16, s=16):
    yy, xx = torch.meshgrid(torch.linspace(0, 1, s), torch.linspace(0, 1, s), indexing="ij")
    f = 1 + 5 * torch.rand(n, 3, 2, generator=g)
    ph = 2 * math.pi * torch.rand(n, 3, generator=g)
    img = sum(torch.sin(f[:, k, 0, None, None] * xx * 2 + f[:, k, 1, None, None] * yy * 2 + ph[:, k, None, None])
              for k in range(3)) / 3
    return img[:, None]


@case(60)
def espcn_pixelshuffle_residual_l1():
    torch.manual_seed(4)
    model = ESPCN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        hr = smooth_images(gen(4_000_000 + i))
        lr = F.avg_pool2d(hr, 2)
        loss = F.l1_loss(model(lr).float(), hr)
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 5. CaiT LayerScale, gamma init 1e-5
class LayerScaleBlock(nn.Module):
    def __init__(self, d=32, init=1e-6):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.gamma_1 = nn.Parameter(init * torch.ones(d))
        self.gamma_2 = nn.Parameter(init * torch.ones(d))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.gamma_1 * self.attn(h, h, h, need_weights=False)[0]
        return x + self.gamma_2 * self.mlp(self.n2(x))


class TinyCaiT(nn.Module):
    def __init__(self, d=32, depth=3):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, 8, d))
        self.blocks = nn.Sequential(*[LayerScaleBlock(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x) + self.pos)).mean(1))


@case(60)
def cait_layerscale_tiny_init():
    torch.manual_seed(5)
    model = TinyCaiT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        g = gen(5_000_000 + i)
        x = torch.randn(32, 8, 16, generator=g)
        y = (x.sum(1) @ W_T).argmax(1)
        loss = F.cross_entropy(model(x), y)
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec,
              lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i), clip=1.0))


# ----------------------------------------------------------------------- 6. self-normalizing net: SELU + AlphaDropout
@case(60)
def selu_alpha_dropout_snn():
    torch.manual_seed(6)
    layers = []
    d = 16
    for h in (64, 64, 64, 64):
        lin = nn.Linear(d, h)
        nn.init.kaiming_normal_(lin.weight, nonlinearity="linear")      # LeCun normal
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.SELU(), nn.AlphaDropout(0.05)]
        d = h
    model = nn.Sequential(*layers, nn.Linear(d, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, teacher(6))
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 7. AlexNet-style LRN + Dropout2d
class LRNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0),
            nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
            nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0), nn.MaxPool2d(2), nn.Dropout2d(0.1))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16, 64), nn.ReLU(), nn.Dropout(0.2),
                                        nn.Linear(64, 4))

    def forward(self, x):
        return self.classifier(self.features(x))


@case(60)
def alexnet_lrn_dropout2d():
    torch.manual_seed(7)
    model = LRNNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, gratings(7, n=16))
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 8. NoisyNet DQN, Polyak target
class NoisyLinear(nn.Module):
    """Fortunato et al.'s factorised Gaussian NoisyLinear (Kaixhin/Rainbow's)."""

    def __init__(self, i, o, std_init=0.5):
        super().__init__()
        self.i, self.o = i, o
        self.weight_mu = nn.Parameter(torch.empty(o, i).uniform_(-1 / math.sqrt(i), 1 / math.sqrt(i)))
        self.weight_sigma = nn.Parameter(torch.full((o, i), std_init / math.sqrt(i)))
        self.bias_mu = nn.Parameter(torch.empty(o).uniform_(-1 / math.sqrt(i), 1 / math.sqrt(i)))
        self.bias_sigma = nn.Parameter(torch.full((o,), std_init / math.sqrt(o)))
        self.register_buffer("weight_epsilon", torch.zeros(o, i))
        self.register_buffer("bias_epsilon", torch.zeros(o))

    @staticmethod
    def _scale(n):
        x = torch.randn(n)
        return x.sign().mul_(x.abs().sqrt_())

    def reset_noise(self):
        ei, eo = self._scale(self.i), self._scale(self.o)
        self.weight_epsilon.copy_(eo.outer(ei))
        self.bias_epsilon.copy_(eo)

    def forward(self, x):
        if self.training:
            return F.linear(x, self.weight_mu + self.weight_sigma * self.weight_epsilon,
                            self.bias_mu + self.bias_sigma * self.bias_epsilon)
        return F.linear(x, self.weight_mu, self.bias_mu)


class NoisyQ(nn.Module):
    def __init__(self, d=16, h=64, a=4):
        super().__init__()
        self.fc = nn.Linear(d, h)
        self.n1, self.n2 = NoisyLinear(h, h), NoisyLinear(h, a)

    def forward(self, x):
        return self.n2(F.relu(self.n1(F.relu(self.fc(x)))))

    def reset_noise(self):
        self.n1.reset_noise()
        self.n2.reset_noise()


@case(80, fall=0.7)
def noisy_dqn_polyak_target():
    # offline Q-learning on a fixed random MDP (20 states, 4 actions, deterministic transitions), NoisyNet layers
    # resampled every step, a Polyak-averaged target net (tau 0.02), Huber TD loss, gamma 0.9
    torch.manual_seed(8)
    g = gen(8_000_000)
    feats = torch.randn(20, 16, generator=g)
    nxt = torch.randint(0, 20, (20, 4), generator=g)
    rew = torch.randn(20, 4, generator=g)
    model = NoisyQ()
    target = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1.5e-4)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        gb = gen(8_100_000 + i)
        s = torch.randint(0, 20, (64,), generator=gb)
        a = torch.randint(0, 4, (64,), generator=gb)
        model.reset_noise()
        target.reset_noise()
        q = model(feats[s]).float().gather(1, a[:, None]).squeeze(1)
        with torch.no_grad():
            s2 = nxt[s, a]
            a2 = model(feats[s2]).argmax(1)                          # double DQN
            tq = rew[s, a] + 0.9 * target(feats[s2]).float().gather(1, a2[:, None]).squeeze(1)
        loss = F.smooth_l1_loss(q, tq)
        return loss, loss.item()

    def body(i):
        out = amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i))
        with torch.no_grad():
            for pt, p in zip(target.parameters(), model.parameters()):
                pt.lerp_(p, 0.02)
        return out
    return ns(model, optimizer, scaler, rec, body, others={"target": target})


# ----------------------------------------------------------------------- 9. REINFORCE with baseline and entropy
@case(80, learned=extra_rose("reward", 0.3))
def reinforce_bandit_baseline_entropy():
    torch.manual_seed(9)
    model = plain_mlp(h=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    st = {"b": 0.0}
    extra = {"reward": []}

    def loss_fn(i):
        g = gen(9_000_000 + i)
        x = torch.randn(128, 16, generator=g)
        best = (x @ W_T).argmax(1)
        logits = model(x).float()
        p = logits.softmax(-1)
        a = torch.multinomial(p.detach(), 1, generator=g).squeeze(1)
        r = (a == best).float() + 0.1 * torch.randn(128, generator=g)
        adv = r - st["b"]
        st["b"] = 0.9 * st["b"] + 0.1 * float(r.mean())
        logp = logits.log_softmax(-1)
        ent = -(p * logp).sum(-1).mean()
        loss = -(logp.gather(1, a[:, None]).squeeze(1) * adv).mean() - 0.01 * ent
        extra["reward"].append(float(r.mean()))
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)),
              extra)


# ----------------------------------------------------------------------- 10. DANN gradient reversal
class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.neg() * ctx.lam, None


class DANN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.label = nn.Linear(32, 4)
        self.domain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x, lam):
        f = self.features(x)
        return self.label(f), self.domain(GradReverse.apply(f, lam))


@case(80, learned=extra_fell("label", 0.7))
def dann_gradient_reversal():
    # Ganin & Lempitsky: lambda = 2 / (1 + exp(-10 p)) - 1, lr = 0.05 / (1 + 10 p) ** 0.75 (0.01 in the paper), SGD momentum 0.9
    torch.manual_seed(10)
    model = DANN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    src, tgt = teacher(10), teacher(1010, shift=0.7)
    extra = {"label": [], "domain": []}
    n = 80

    def body(i):
        p = i / n
        lam = 2 / (1 + math.exp(-10 * p)) - 1
        for gr in optimizer.param_groups:
            gr["lr"] = 0.05 / (1 + 10 * p) ** 0.75
        xs, ys = src(i)
        xt, _ = tgt(i)

        def lf():
            ls, ds = model(xs, lam)
            _, dt = model(xt, lam)
            l_lab = F.cross_entropy(ls, ys)
            l_dom = F.cross_entropy(torch.cat([ds, dt]), torch.cat([torch.zeros(64), torch.ones(64)]).long())
            extra["label"].append(l_lab.item())
            extra["domain"].append(l_dom.item())
            loss = l_lab + l_dom
            return loss, loss.item()
        return amp_step(model, optimizer, scaler, rec, lf)
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 11. fast FGSM adversarial training
@case(60)
def fast_fgsm_adversarial_training():
    # Wong, Rice & Kolter 2020 (locuslab/fast_adversarial, train_fgsm.py): delta ~ U(-eps, eps), one scaled backward
    # for the input gradient (its parameter gradients thrown away by zero_grad), delta += alpha sign(grad), clamp,
    # then the training step on x + delta
    torch.manual_seed(11)
    model = plain_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(11)
    eps, alpha = 0.1, 0.125

    def body(i):
        x, y = data(i)
        g = gen(11_000_000 + i)
        delta = ((torch.rand(x.shape, generator=g) * 2 - 1) * eps).requires_grad_(True)
        with torch.autocast("cpu", dtype=F16):
            l0 = F.cross_entropy(model(x + delta), y)
        scaler.scale(l0).backward()
        grad = delta.grad.detach()
        delta = (delta + alpha * torch.sign(grad)).clamp(-eps, eps).detach()
        optimizer.zero_grad()

        def lf():
            loss = F.cross_entropy(model(x + delta), y)
            return loss, loss.item()
        return amp_step(model, optimizer, scaler, rec, lf)
    return ns(model, optimizer, scaler, rec, body)


# ----------------------------------------------------------------------- 12. PointNet autoencoder, chamfer distance
class PointAE(nn.Module):
    def __init__(self, n=64, z=32):
        super().__init__()
        self.n = n
        self.enc = nn.Sequential(nn.Conv1d(3, 32, 1), nn.ReLU(), nn.Conv1d(32, 64, 1), nn.ReLU(), nn.Conv1d(64, z, 1))
        self.dec = nn.Sequential(nn.Linear(z, 128), nn.ReLU(), nn.Linear(128, n * 3))

    def forward(self, pts):                         # (B, N, 3)
        z = self.enc(pts.transpose(1, 2)).amax(-1)
        return self.dec(z).view(-1, self.n, 3)


def chamfer(a, b):
    d = torch.cdist(a.float(), b.float()) ** 2
    return d.min(2).values.mean() + d.min(1).values.mean()


@case(60)
def pointnet_chamfer_autoencoder():
    torch.manual_seed(12)
    model = PointAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        g = gen(12_000_000 + i)
        t = 2 * math.pi * torch.rand(16, 64, generator=g)
        ax = 0.5 + torch.rand(16, 3, generator=g)            # ellipses of random radii, tilted in z
        pts = torch.stack([ax[:, :1] * torch.cos(t), ax[:, 1:2] * torch.sin(t), 0.3 * ax[:, 2:] * torch.cos(t)], -1)
        loss = chamfer(model(pts), pts)
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 13. gradient centralization after unscale_
class SmallConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def forward(self, x):
        return self.f(x)


@case(60)
def gradient_centralization():
    # Yong et al. 2020: every conv / linear weight gradient gets its mean over the fan-in dimensions removed
    torch.manual_seed(13)
    model = SmallConv()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, gratings(13, n=16))

    def centralize():
        for p in model.parameters():
            if p.grad is not None and p.dim() > 1:
                p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))
    return ns(model, optimizer, scaler, rec,
              lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i), after_unscale=centralize))


# ----------------------------------------------------------------------- 14. multi-resolution STFT loss
class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 16, 9, padding=4), nn.GELU(), nn.Conv1d(16, 16, 9, padding=4),
                                 nn.GELU(), nn.Conv1d(16, 1, 9, padding=4))

    def forward(self, x):
        return x + self.net(x)


def stft_loss(p, t, n_fft):
    w = torch.hann_window(n_fft)
    sp = torch.stft(p, n_fft, n_fft // 4, window=w, return_complex=True)
    st = torch.stft(t, n_fft, n_fft // 4, window=w, return_complex=True)
    mp = torch.sqrt(torch.clamp(sp.real ** 2 + sp.imag ** 2, min=1e-7))
    mt = torch.sqrt(torch.clamp(st.real ** 2 + st.imag ** 2, min=1e-7))
    sc = torch.linalg.norm(mt - mp) / torch.linalg.norm(mt)
    return sc + F.l1_loss(mp.log(), mt.log())


@case(50)
def multires_stft_loss_denoiser():
    # ParallelWaveGAN's MultiResolutionSTFTLoss (spectral convergence + log-magnitude L1, 3 resolutions), computed
    # on the fp32 cast of the fp16 output, plus a waveform L1
    torch.manual_seed(14)
    model = Denoiser()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    tt = torch.arange(256).float()

    def loss_fn(i):
        g = gen(14_000_000 + i)
        f = 0.05 + 0.4 * torch.rand(8, 3, 1, generator=g)
        clean = (torch.sin(f * tt + 6 * torch.rand(8, 3, 1, generator=g)).sum(1) / 3)
        noisy = clean + 0.3 * torch.randn(8, 256, generator=g)
        out = model(noisy[:, None]).float()[:, 0]
        loss = F.l1_loss(out, clean) + sum(stft_loss(out, clean, n) for n in (32, 64, 128)) / 3
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 15. hypernetwork generating a target net
class HyperNet(nn.Module):
    """Ha et al.-style: a task embedding -> the weights of a 16-32-1 target MLP, run with F.linear."""

    def __init__(self, tasks=8, z=8, h=32):
        super().__init__()
        self.h = h
        self.task = nn.Embedding(tasks, z)
        self.gen = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, 16 * h + h + h + 1))
        with torch.no_grad():
            self.gen[-1].weight.mul_(0.1)

    def forward(self, t, x):
        w = self.gen(self.task(t))
        h = self.h
        w1, b1 = w[: 16 * h].view(h, 16), w[16 * h: 17 * h]
        w2, b2 = w[17 * h: 18 * h].view(1, h), w[18 * h:]
        return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


@case(80)
def hypernetwork_generated_weights():
    torch.manual_seed(15)
    model = HyperNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    task_w = torch.randn(8, 16, generator=gen(15_000_000)) / 4

    def loss_fn(i):
        g = gen(15_100_000 + i)
        t = torch.tensor(i % 8)
        x = torch.randn(32, 16, generator=g)
        y = torch.tanh(x @ task_w[t])[:, None]
        loss = F.mse_loss(model(t, x).float(), y)
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 16. small U-Net, BCE + Tversky
class UNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()

        def cb(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())
        self.d1, self.d2 = cb(1, c), cb(c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.u1 = cb(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        return self.out(self.u1(torch.cat([a, self.up(b)], 1)))


def tversky(logits, t, alpha=0.3, beta=0.7, smooth=1.0):
    p = torch.sigmoid(logits.float()).flatten(1)
    t = t.flatten(1)
    tp = (p * t).sum(1)
    return (1 - (tp + smooth) / (tp + alpha * (p * (1 - t)).sum(1) + beta * ((1 - p) * t).sum(1) + smooth)).mean()


@case(40)
def unet_bce_tversky():
    torch.manual_seed(16)
    model = UNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    yy, xx = torch.meshgrid(torch.arange(16).float(), torch.arange(16).float(), indexing="ij")

    def loss_fn(i):
        g = gen(16_000_000 + i)
        c = 3 + 10 * torch.rand(8, 2, generator=g)
        r = 2 + 3 * torch.rand(8, generator=g)
        mask = (((xx - c[:, 0, None, None]) ** 2 + (yy - c[:, 1, None, None]) ** 2) < r[:, None, None] ** 2).float()
        img = mask + 0.4 * torch.randn(8, 16, 16, generator=g)
        out = model(img[:, None])
        loss = F.binary_cross_entropy_with_logits(out.float(), mask[:, None]) + tversky(out, mask[:, None])
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ---------------------------------------------------------------------------------------------------- the test
@pytest.mark.parametrize("name", [pytest.param(n, marks=wrong(XFAIL[n]) if n in XFAIL else ()) for n in CASES])
def test_recipe_healthy(name, tmp_path):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, with the oracle
    if DEBUG:
        rec = ru.c.rec
        print(name, "steps", rec.n, "skipped", rec.skipped, "scales", sorted(set(map(str, rec.scales))), "loss",
              [round(v, 4) for v in ru.losses[::max(1, len(ru.losses) // 8)]], ru.losses[-1])
    healthy(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)
    judge(rw)
