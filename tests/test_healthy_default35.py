"""Healthy runs at ampdoctor's DEFAULT watch, thirty-fifth set: MORE TRAINING RECIPES NOT PROBED BY THE EARLIER FILES.

Each case is a realistic recipe that could provoke a false alarm; `ampdoctor.watch(model, optimizer=...,
scaler=..., run_dir=tmp_path / "run")` and nothing else; CPU fp16 autocast with a real `torch.amp.GradScaler("cpu")`,
fixed seeds, one intra-op thread, 60-80 optimizer steps each. The harness is tests/codebase_harness.py
(test_healthy_default28-34's): every case runs twice,

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite; the case learned
  (the mean loss of the last fifth below `fall` x the first fifth's, or the case's own measure); probe_harness.
  Producer's forward hooks saw no module make inf/NaN from finite inputs; the gradients finite after every step
  that was not skipped; every weight finite at the end; skipped steps only the scaler's opening search and at most
  two isolated later ones;
- the WATCHED run must train bitwise identically (`identical`): losses, scales, skips, every step's gradients, the
  extras, every final weight and buffer, the optimizer's state_dict and the final scale; then (`judge`) w.report()
  after close() and ampdoctor.diagnose(run_dir) hold no warning and no error, exit code 0, one recorded step per
  optimizer step, and no `ampdoctor: ...` Python warning. A false alarm is a strict xfail (probe_harness.wrong:
  WrongAnswer only) whose reason quotes ampdoctor's one_line(); a failing oracle or a difference in training is a
  plain failure.

Left out (grep of tests/test_healthy*.py): add_param_group, optimizer/scaler load_state_dict, foreach, set_to_none=
False, clip_grad_value_, in-loop validation, dict-of-heads / unused parameters, growth_interval tuning, SparseAdam,
tied embeddings + label smoothing, a constant loss offset, schedule-free optimizers (all already there);
Adam(capturable=True) raises on CPU parameters ("params and state_steps must be on supported devices") and
ZeroRedundancyOptimizer needs an initialised process group, so neither can run here. New here (0-1 hits in those
files): an EMA codebook updated in forward, Adadelta, GaussianNLLLoss, MarginRankingLoss, MultiLabelSoftMarginLoss,
MultiMarginLoss, nn.RNN, ConvTranspose1d + ReflectionPad1d, RReLU / FractionalMaxPool2d, a scaler with
growth_factor 4 / backoff_factor 0.25 from init_scale 2**8, Adam(maximize=True), annealed gradient noise after
unscale_, nn.Bilinear + SoftMarginLoss, HingeEmbeddingLoss,
ReplicationPad2d / LPPool2d / AdaptiveMaxPool2d.

The cases (x ~ N(0, 1) in 16-D unless said; a fixed random linear "teacher" gives the labels):
 1. vqvae_ema_codebook: a VQ-VAE whose codebook is not a parameter but buffers (embed, cluster_size, embed_avg)
    updated in forward by exponential moving averages (decay 0.9, Laplace-smoothed counts, van den Oord et al.
    / VQ-VAE-2), a straight-through estimator and a 0.25 commitment loss, on a mixture of 16 Gaussian clusters;
 2. adadelta_tanh_regression: Adadelta(lr 1.0, rho 0.9) on a tanh MLP regressing a smooth target;
 3. gaussian_nll_heteroscedastic: a two-headed net predicting mean and variance (softplus + 1e-3) trained with
    GaussianNLLLoss on fp32 casts on data whose noise grows with |x0|; the loss goes negative (learned: it falls
    by 0.3);
 4. margin_ranking_pairwise: a scoring MLP trained on pairs with MarginRankingLoss(margin 0.1) towards a linear
    utility's order;
 5. multilabel_softmargin: 6 independent labels (thresholded linear projections), MultiLabelSoftMarginLoss;
 6. multimargin_squared_hinge: a multi-class SVM head (MultiMarginLoss p=2, margin 1) with SGD momentum + weight
    decay;
 7. elman_rnn_fibonacci_mod10: nn.RNN (tanh, 2 layers) next-token prediction of Fibonacci sequences mod 10 from
    random seeds, log_softmax + NLLLoss, grads unscaled and clipped at 1;
 8. conv1d_reflect_transpose_ae: a waveform autoencoder, ReflectionPad1d + strided Conv1d down, ConvTranspose1d
    up, L1Loss;
 9. rrelu_fractional_maxpool: a conv classifier of gratings with RReLU (random slopes in training; on the fp32
    cast, CPU RReLU has no Half kernel) and FractionalMaxPool2d (random pooling regions), both drawing from the
    global RNG every forward;
10. scaler_growth4_backoff_quarter: GradScaler(init_scale 2**8, growth_factor 4, backoff_factor 0.25,
    growth_interval 10): the scale climbs 2**8 -> 2**18 by x4 jumps;
11. adam_maximize_loglik: Adam(maximize=True) on the log-likelihood (the negated cross-entropy, scaled and
    backpropagated as it is, negative); learned: the logged cross-entropy falls;
12. gradient_noise_annealed: Neelakantan et al.'s annealed Gaussian gradient noise (variance 0.01 / (1 + t)^0.55)
    added to the unscaled gradients between scaler.unscale_ and scaler.step;
13. bilinear_soft_margin: nn.Bilinear(8, 8, 16) -> tanh -> Linear on (a, b) pairs, labels +-1 from sign(a^T M b),
    SoftMarginLoss;
14. siamese_hinge_embedding: a Siamese embedding MLP, F.pairwise_distance of fp32 casts, HingeEmbeddingLoss
    (margin 2) with +1 for pairs of the same teacher class, -1 otherwise;
15. replication_pad_lppool_adaptive_max: ReplicationPad2d -> conv -> ReLU -> LPPool2d(2, 2) (a square root of
    pooled squares, whose gradient is large where a window is nearly all zero) -> conv -> AdaptiveMaxPool2d, on
    gratings; the scaler skips steps 0, 1, 2 and 13 (2**16 -> 2**13 in the opening search, 2**12 at step 13: the
    LPPool2d backward overflows fp16 at the high scale; ordinary dynamic scaling, every loss finite, 1.42 -> 0.01;
    ampdoctor reports it as info).

Result when written: 15 pass, 0 strict xfail: every case quiet (no warning, no error, no `ampdoctor: ...` Python
warning) and every run bitwise identical with and without the watch. Cases 1-14 leave no finding at all (none of
them skips a step); the only findings in the file are info, in replication_pad_lppool_adaptive_max:
`overflow at f.3 step 0: The loss-scaled backward overflowed in `f.3` on 2 step(s) while the loss scale was high;
GradScaler skipped them and lowered the scale, as designed.` and `skipped_steps at (run) step 0: GradScaler skipped
4 of 60 steps; a normal rate for dynamic loss scaling.` XFAIL is empty. The file takes ~10 s.
"""
from __future__ import annotations

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
from codebase_harness import DEBUG, Rec, fall_by, healthy, identical, judge, ns, registrar, run  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
F16 = torch.float16
CASES: dict = {}
XFAIL: dict[str, str] = {}

case = registrar(CASES)


# ------------------------------------------------------------------------------------------------------ data, model
W_T = torch.randn(16, 4, generator=gen(3500))
U_T = torch.randn(16, generator=gen(3501))
V_T = torch.randn(16, 6, generator=gen(3502))


def teacher(seed, n=64, d=16):
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, d, generator=g)
        return x, (x @ W_T).argmax(1)
    return batch


def plain_mlp(h=64, d_in=16, d_out=4, act=nn.ReLU):
    return nn.Sequential(nn.Linear(d_in, h), act(), nn.Linear(h, h), act(), nn.Linear(h, d_out))


def amp_step(model, optimizer, scaler, rec, loss_fn, clip=None, after_unscale=None):
    """The plain torch.amp recipe: autocast forward (`loss_fn()` -> (loss, logged)), scale(loss).backward(),
    [unscale_ + clip_grad_norm_ / after_unscale()], step, update, zero_grad(set_to_none=True)."""
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
    optimizer.zero_grad(set_to_none=True)
    return logged


def simple(model, optimizer, scaler, rec, loss_fn, **kw):
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i), **kw))


def extra_fell(key, fall=0.8):
    def check(r):
        v = [float(t) for t in r.c.extra[key]]
        assert all(map(math.isfinite, v)), v
        k = max(3, len(v) // 5)
        assert sum(v[-k:]) / k < fall * sum(v[:k]) / k, (v[:k], v[-k:])
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


# ----------------------------------------------------------------------- 1. VQ-VAE with an EMA codebook (buffers)
class VQEMA(nn.Module):
    def __init__(self, K=16, d=8, decay=0.9, eps=1e-5):
        super().__init__()
        self.K, self.decay, self.eps = K, decay, eps
        e = torch.randn(K, d)
        self.register_buffer("embed", e)
        self.register_buffer("cluster_size", torch.ones(K))
        self.register_buffer("embed_avg", e.clone())

    def forward(self, z):
        zf = z.float()
        with torch.autocast("cpu", enabled=False):
            dist = (zf ** 2).sum(1, keepdim=True) - 2 * zf @ self.embed.t() + (self.embed ** 2).sum(1)
        idx = dist.argmin(1)
        q = self.embed[idx]
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.K).float()
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ zf.detach(), alpha=1 - self.decay)
                n = self.cluster_size.sum()
                cs = (self.cluster_size + self.eps) / (n + self.K * self.eps) * n
                self.embed.copy_(self.embed_avg / cs[:, None])
        commit = F.mse_loss(zf, q.detach())
        return zf + (q - zf).detach(), commit


class VQVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
        self.vq = VQEMA()
        self.dec = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x):
        q, commit = self.vq(self.enc(x))
        return self.dec(q), commit


@case(80, fall=0.7)
def vqvae_ema_codebook():
    torch.manual_seed(1)
    model = VQVAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    centres = 2 * torch.randn(16, 16, generator=gen(1_000))

    def loss_fn(i):
        g = gen(1_000_000 + i)
        x = centres[torch.randint(0, 16, (64,), generator=g)] + 0.2 * torch.randn(64, 16, generator=g)
        out, commit = model(x)
        loss = F.mse_loss(out.float(), x) + 0.25 * commit
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 2. Adadelta
@case(60, fall=0.6)
def adadelta_tanh_regression():
    torch.manual_seed(2)
    model = plain_mlp(h=64, d_out=1, act=nn.Tanh)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0, rho=0.9)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        g = gen(2_000_000 + i)
        x = torch.randn(64, 16, generator=g)
        y = torch.sin(x @ U_T / 4)[:, None]
        loss = F.mse_loss(model(x).float(), y)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 3. heteroscedastic Gaussian NLL
class MeanVar(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.mu, self.var = nn.Linear(64, 1), nn.Linear(64, 1)

    def forward(self, x):
        h = self.body(x)
        return self.mu(h), F.softplus(self.var(h).float()) + 1e-3


@case(80, learned=fall_by(0.3))
def gaussian_nll_heteroscedastic():
    torch.manual_seed(3)
    model = MeanVar()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    nll = nn.GaussianNLLLoss(eps=1e-6)

    def loss_fn(i):
        g = gen(3_000_000 + i)
        x = torch.randn(128, 16, generator=g)
        y = (torch.tanh(x @ U_T / 4) + (0.05 + 0.3 * x[:, 0].abs()) * torch.randn(128, generator=g))[:, None]
        mu, var = model(x)
        loss = nll(mu.float(), y, var)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 4. pairwise ranking, MarginRankingLoss
@case(60, fall=0.6)
def margin_ranking_pairwise():
    torch.manual_seed(4)
    model = plain_mlp(h=32, d_out=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    crit = nn.MarginRankingLoss(margin=0.1)

    def loss_fn(i):
        g = gen(4_000_000 + i)
        a, b = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
        t = torch.sign(a @ U_T - b @ U_T)
        loss = crit(model(a).float().squeeze(1), model(b).float().squeeze(1), t)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 5. multi-label soft margin
@case(60, fall=0.7)
def multilabel_softmargin():
    torch.manual_seed(5)
    model = plain_mlp(h=64, d_out=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    crit = nn.MultiLabelSoftMarginLoss()

    def loss_fn(i):
        g = gen(5_000_000 + i)
        x = torch.randn(64, 16, generator=g)
        y = (x @ V_T > 0.3).float()
        loss = crit(model(x).float(), y)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 6. multi-class squared hinge
@case(60, fall=0.6)
def multimargin_squared_hinge():
    torch.manual_seed(6)
    model = plain_mlp(h=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    crit = nn.MultiMarginLoss(p=2, margin=1.0)
    data = teacher(6)

    def loss_fn(i):
        x, y = data(i)
        loss = crit(model(x).float(), y)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 7. Elman RNN, NLLLoss
class CharRNN(nn.Module):
    def __init__(self, v=10, e=16, h=64):
        super().__init__()
        self.emb = nn.Embedding(v, e)
        self.rnn = nn.RNN(e, h, num_layers=2, nonlinearity="tanh", batch_first=True)
        self.out = nn.Linear(h, v)

    def forward(self, t):
        h, _ = self.rnn(self.emb(t))
        return self.out(h)


@case(80, fall=0.7)
def elman_rnn_fibonacci_mod10():
    torch.manual_seed(7)
    model = CharRNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        g = gen(7_000_000 + i)
        s = [torch.randint(0, 10, (32,), generator=g), torch.randint(0, 10, (32,), generator=g)]
        for _ in range(14):
            s.append((s[-1] + s[-2]) % 10)
        seq = torch.stack(s, 1)
        logp = model(seq[:, :-1]).float().log_softmax(-1)
        loss = F.nll_loss(logp[:, 1:].reshape(-1, 10), seq[:, 2:].reshape(-1))
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn, clip=1.0)


# ----------------------------------------------------------------------- 8. Conv1d / ConvTranspose1d autoencoder
class WaveAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.ReflectionPad1d(2), nn.Conv1d(1, 16, 5, stride=2), nn.GELU(),
                                 nn.ReflectionPad1d(2), nn.Conv1d(16, 16, 5, stride=2), nn.GELU())
        self.dec = nn.Sequential(nn.ConvTranspose1d(16, 16, 4, stride=2, padding=1), nn.GELU(),
                                 nn.ConvTranspose1d(16, 1, 4, stride=2, padding=1))

    def forward(self, x):
        return self.dec(self.enc(x))


@case(60, fall=0.7)
def conv1d_reflect_transpose_ae():
    torch.manual_seed(8)
    model = WaveAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    tt = torch.arange(64).float()
    crit = nn.L1Loss()

    def loss_fn(i):
        g = gen(8_000_000 + i)
        f = 0.05 + 0.3 * torch.rand(16, 2, 1, generator=g)
        x = torch.sin(f * tt + 6 * torch.rand(16, 2, 1, generator=g)).sum(1, keepdim=True) / 2
        loss = crit(model(x).float(), x)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 9. RReLU + FractionalMaxPool2d
class RReLU32(nn.RReLU):
    """RReLU has no Half kernel on the CPU ("rrelu_with_noise_out_cpu" not implemented for 'Half'): run on the fp32
    cast and hand back the input's dtype, as a user porting an fp32 model to autocast would."""

    def forward(self, x):
        return super().forward(x.float()).to(x.dtype)


class RandConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), RReLU32(), nn.FractionalMaxPool2d(2, output_ratio=0.7),
                               nn.Conv2d(8, 16, 3, padding=1), RReLU32(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                               nn.Linear(16, 4))

    def forward(self, x):
        return self.f(x)


@case(60, fall=0.8)
def rrelu_fractional_maxpool():
    torch.manual_seed(9)
    model = RandConv()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = gratings(9, n=16)

    def loss_fn(i):
        x, y = data(i)
        loss = F.cross_entropy(model(x), y)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 10. scaler: x4 growth, /4 backoff
@case(60)
def scaler_growth4_backoff_quarter():
    torch.manual_seed(10)
    model = plain_mlp(h=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_factor=4.0, backoff_factor=0.25,
                                  growth_interval=10)
    rec = Rec(model)
    data = teacher(10)

    def loss_fn(i):
        x, y = data(i)
        loss = F.cross_entropy(model(x), y)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 11. Adam(maximize=True) on log-likelihood
@case(60, learned=extra_fell("ce", 0.8))
def adam_maximize_loglik():
    torch.manual_seed(11)
    model = plain_mlp(h=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3, maximize=True)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(11)
    extra = {"ce": []}

    def loss_fn(i):
        x, y = data(i)
        ll = model(x).float().log_softmax(-1).gather(1, y[:, None]).mean()
        extra["ce"].append(-ll.item())
        return ll, ll.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)),
              extra)


# ----------------------------------------------------------------------- 12. annealed gradient noise after unscale_
@case(60)
def gradient_noise_annealed():
    torch.manual_seed(12)
    model = plain_mlp(h=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(12)

    def body(i):
        def noise():
            sd = math.sqrt(0.01 / (1 + i) ** 0.55)
            g = gen(12_000_000 + i)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.add_(torch.randn(p.grad.shape, generator=g) * sd)

        def lf():
            x, y = data(i)
            loss = F.cross_entropy(model(x), y)
            return loss, loss.item()
        return amp_step(model, optimizer, scaler, rec, lf, after_unscale=noise)
    return ns(model, optimizer, scaler, rec, body)


# ----------------------------------------------------------------------- 13. nn.Bilinear + SoftMarginLoss
class PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(8, 8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, a, b):
        return self.head(torch.tanh(self.bil(a, b)))


@case(80, fall=0.8)
def bilinear_soft_margin():
    torch.manual_seed(13)
    model = PairNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    M = torch.randn(8, 8, generator=gen(13_000))
    crit = nn.SoftMarginLoss()

    def loss_fn(i):
        g = gen(13_000_000 + i)
        a, b = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
        t = torch.sign(((a @ M) * b).sum(1))
        loss = crit(model(a, b).float().squeeze(1), t)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 14. Siamese net, HingeEmbeddingLoss
@case(60, fall=0.7)
def siamese_hinge_embedding():
    torch.manual_seed(14)
    model = plain_mlp(h=64, d_out=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    crit = nn.HingeEmbeddingLoss(margin=2.0)

    def loss_fn(i):
        g = gen(14_000_000 + i)
        a, b = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
        same_cls = (a @ W_T).argmax(1) == (b @ W_T).argmax(1)
        t = same_cls.float() * 2 - 1
        d = F.pairwise_distance(model(a).float(), model(b).float())
        loss = crit(d, t)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


# ----------------------------------------------------------------------- 15. ReplicationPad2d, LPPool2d, AdaptiveMaxPool2d
class PadPoolNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.ReplicationPad2d(1), nn.Conv2d(1, 8, 3), nn.ReLU(), nn.LPPool2d(2, 2),
                               nn.ReplicationPad2d(1), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.AdaptiveMaxPool2d(1),
                               nn.Flatten(), nn.Linear(16, 4))

    def forward(self, x):
        return self.f(x)


@case(60, fall=0.8)
def replication_pad_lppool_adaptive_max():
    torch.manual_seed(15)
    model = PadPoolNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = gratings(15, n=16)

    def loss_fn(i):
        x, y = data(i)
        loss = F.cross_entropy(model(x), y)
        return loss, loss.item()
    return simple(model, optimizer, scaler, rec, loss_fn)


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
