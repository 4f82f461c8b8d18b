"""Healthy runs at ampdoctor's DEFAULT settings (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`, nothing else:
headroom="auto", the default sampling, the headroom_trend early warning) in training styles the earlier probe files
(tests/test_healthy*.py) do not cover: DQN with a target network and a replay buffer, a Lookahead wrapper over Adam,
an optimizer swap Adam -> SGD midway with a new scaler and a new watch, a U-Net segmenter on dice + BCE, Glow
(ActNorm, invertible 1x1 conv with slogdet, affine couplings), a neural ODE integrated with fixed-step RK4, denoising
score matching over log-uniform noise levels, a masked autoencoder (random masking by argsort/gather, loss on masked
patches), prototypical networks on episodes, Barlow Twins, VICReg, DINO (centering, teacher temperature 0.04, EMA
teacher), SwAV's Sinkhorn-Knopp in fp32, matrix factorisation with a BPR loss, PatchTST-style forecasting with RevIN
on raw series around 100, SIREN (sin(30 Wx)) fitting a signal, NeRF-style Fourier features with volume rendering
(cumprod transmittance), a PINN through autograd.grad with create_graph (the AMP gradient-penalty recipe), a
hypernetwork generating a target net's weights, a Gumbel-softmax discrete VAE with temperature annealing, a mixture
density network (logsumexp NLL), FiLM conditioning, heteroscedastic Gaussian NLL, quantile (pinball) regression,
Poisson NLL on counts, RAdam/NAdam/Adamax, a PixelCNN with masked convolutions, Transformer-XL segment memory, deep
supervision with auxiliary heads, a growing batch size, non-reentrant checkpointing together with gradient
accumulation, a pairwise margin-ranking loss and a set transformer (pooling by multihead attention).

Each run is an ordinary loop on the CPU (fp16 autocast with a real torch.amp.GradScaler("cpu"), bf16 without one where
said), first asserted healthy (every loss finite; the loss falls; the scaler backs off only at the start), then
judged: the report must hold no warning and no error (info is fine). A false alarm keeps its assertion under a strict
xfail that names the finding."""
import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16


def alarms(rep):
    return [f.one_line() for f in rep.findings if f.severity in ("warning", "error")]


def quiet(w):
    rep = w.report()
    assert not alarms(rep), [f.one_line() for f in rep.findings]


def healthy(losses, scales=(), fall=0.9, k=5, max_backoffs=5, drop=None):
    """Every loss finite; the mean of the last k below `fall` x the mean of the first k (or, with `drop`, at least
    `drop` below it: for losses that go negative); at most `max_backoffs` scale decreases, at most one of them after
    the first quarter of the run."""
    assert all(map(math.isfinite, losses)), losses
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if drop is not None:
        assert last < first - drop, losses
    else:
        assert last < fall * first, losses
    drops = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]
    assert len(drops) <= max_backoffs, scales
    assert sum(i >= max(6, len(scales) // 4) for i in drops) <= 1, (drops, scales)


def fit(model, step_loss, *, steps, opt=None, lr=1e-3, dtype=FP16, sched=None, clip=1.0, after=None, watched=None,
        init_scale=65536.0):
    """zero_grad -> forward under autocast(dtype) (`step_loss(i)` -> scalar) -> scale(loss).backward -> unscale_ ->
    clip_grad_norm_ -> step -> update -> sched.step -> after(i) under no_grad, under a default watch of `watched`
    (default the model). Returns (watch, losses, scales)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == FP16 else None
    w = ampdoctor.watch(watched or model, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = step_loss(i)
        (sc.scale(loss) if sc else loss).backward()
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        if sched:
            sched.step()
        if after:
            with torch.no_grad():
                after(i)
        losses.append(loss.item())
        scales.append(sc.get_scale() if sc else 1.0)
    w.close()
    return w, losses, scales


def mlp(*dims, act=nn.GELU):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def ring_data(n, seed):
    g = gen(seed)
    k = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    return torch.stack([2 * k.cos(), 2 * k.sin()], 1) + 0.05 * torch.randn(n, 2, generator=g)


def clusters(n, seed, k=8, d=16, spread=0.5):
    """n points of k gaussian clusters in d dims (fixed centres), with labels."""
    centres = torch.randn(k, d, generator=gen(999)) * 2
    g = gen(seed)
    y = torch.randint(0, k, (n,), generator=g)
    return centres[y] + spread * torch.randn(n, d, generator=g), y


# -- reinforcement learning --------------------------------------------------------------------------------------------
def test_dqn_target_network_synced_every_10_steps_huber_replay_buffer():
    """Q-learning on a chain of 8 states (left/right, +1 at the right end, gamma 0.9) from a replay buffer of random
    transitions; the target network is a deepcopy synced every 10 steps; Huber TD loss. The Q error to the true
    values (value iteration) falls."""
    torch.manual_seed(0)
    L, gamma = 8, 0.9
    q = mlp(L, 64, 64, 2, act=nn.ReLU)
    target = copy.deepcopy(q)
    qstar = torch.zeros(L, 2)
    for _ in range(200):
        v = qstar.max(1).values
        for s in range(L):
            for a in range(2):
                s2 = min(max(s + 2 * a - 1, 0), L - 1)
                qstar[s, a] = 1.0 if s2 == L - 1 else gamma * v[s2]
    g = gen(1)
    s = torch.randint(0, L - 1, (4096,), generator=g)
    a = torch.randint(0, 2, (4096,), generator=g)
    s2 = (s + 2 * a - 1).clamp(0, L - 1)
    r, done = (s2 == L - 1).float(), (s2 == L - 1).float()
    eye = torch.eye(L)

    def err():
        with torch.no_grad():
            return (q(eye)[:L - 1] - qstar[:L - 1]).abs().mean().item()

    def step_loss(i):
        idx = torch.randint(0, 4096, (128,), generator=gen(100 + i))
        with torch.no_grad():
            y = r[idx] + gamma * (1 - done[idx]) * target(eye[s2[idx]]).float().max(1).values
        pred = q(eye[s[idx]]).float().gather(1, a[idx, None]).squeeze(1)
        return F.smooth_l1_loss(pred, y)

    def after(i):
        if (i + 1) % 10 == 0:
            target.load_state_dict(q.state_dict())

    e0 = err()
    w, losses, scales = fit(q, step_loss, steps=120, lr=3e-3, after=after)
    assert all(map(math.isfinite, losses)) and err() < 0.5 * e0, (e0, err(), losses)
    healthy(losses[10:], scales, fall=1.5)
    quiet(w)


# -- optimizers ------------------------------------------------------------------------------------------------------
class Lookahead:
    """Lookahead (k=5, alpha=0.5) over an inner optimizer: every k steps the fast weights are pulled halfway back to
    the slow weights by hand. Exposes the inner optimizer's param_groups/state so GradScaler can drive it."""

    def __init__(self, inner, k=5, alpha=0.5):
        self.inner, self.k, self.alpha, self.n = inner, k, alpha, 0
        self.param_groups, self.state = inner.param_groups, inner.state
        self.defaults = inner.defaults
        self.slow = [[p.detach().clone() for p in g["params"]] for g in inner.param_groups]

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    @torch.no_grad()
    def step(self, closure=None):
        out = self.inner.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            for g, slow in zip(self.param_groups, self.slow):
                for p, s in zip(g["params"], slow):
                    s.add_(p - s, alpha=self.alpha)
                    p.copy_(s)
        return out


def test_lookahead_wrapper_over_adam_pulls_fast_weights_back_every_5_steps():
    torch.manual_seed(1)
    model = mlp(16, 64, 64, 8)
    opt = Lookahead(torch.optim.Adam(model.parameters(), lr=3e-3))

    def step_loss(i):
        x, y = clusters(128, i, spread=1.5)
        return F.cross_entropy(model(x).float(), y)

    w, losses, scales = fit(model, step_loss, steps=60, opt=opt)
    healthy(losses, scales)
    quiet(w)


def test_optimizer_swap_adam_to_sgd_midway_with_a_new_scaler_and_a_new_watch():
    """The first 40 steps under Adam (one watch, one scaler), then the watch is closed and the same model trains on
    under SGD with momentum, a fresh GradScaler and a fresh watch (the usual way to switch optimizers)."""
    torch.manual_seed(2)
    model = mlp(16, 64, 64, 8)

    def step_loss(i):
        x, y = clusters(128, i, spread=1.5)
        return F.cross_entropy(model(x).float(), y)

    w1, l1, s1 = fit(model, step_loss, steps=40, opt=torch.optim.Adam(model.parameters(), lr=2e-3))
    w2, l2, s2 = fit(model, lambda i: step_loss(40 + i), steps=40,
                     opt=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    healthy(l1, s1)
    healthy(l1 + l2, s2, fall=0.5)
    assert max(l2[-10:]) < 1.5 * max(l1[-10:]), (l1, l2)
    quiet(w1)
    quiet(w2)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.RAdam(p, lr=3e-3, weight_decay=1e-2, decoupled_weight_decay=True),
    lambda p: torch.optim.NAdam(p, lr=2e-3, momentum_decay=4e-3),
    lambda p: torch.optim.Adamax(p, lr=3e-3),
], ids=["radam_decoupled_wd", "nadam", "adamax"])
def test_radam_nadam_adamax(make):
    torch.manual_seed(3)
    model = mlp(16, 64, 64, 8)

    def step_loss(i):
        x, y = clusters(128, i, spread=1.5)
        return F.cross_entropy(model(x).float(), y)

    w, losses, scales = fit(model, step_loss, steps=50, opt=make(model.parameters()))
    healthy(losses, scales)
    quiet(w)


# -- dense prediction ------------------------------------------------------------------------------------------------
class UNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()

        def block(a, b):
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(inplace=True),
                                 nn.Conv2d(b, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(inplace=True))
        self.d1, self.d2, self.mid = block(1, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.up2, self.u2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2), block(4 * c, 2 * c)
        self.up1, self.u1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2), block(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        m = self.mid(F.max_pool2d(b, 2))
        b = self.u2(torch.cat([self.up2(m), b], 1))
        return self.out(self.u1(torch.cat([self.up1(b), a], 1)))


def discs(n, seed, S=32):
    g = gen(seed)
    c = torch.rand(n, 2, generator=g) * (S - 12) + 6
    rad = torch.rand(n, generator=g) * 4 + 3
    yy, xx = torch.meshgrid(torch.arange(S).float(), torch.arange(S).float(), indexing="ij")
    mask = ((yy - c[:, 0, None, None]) ** 2 + (xx - c[:, 1, None, None]) ** 2 < rad[:, None, None] ** 2).float()
    return (mask + 0.3 * torch.randn(n, S, S, generator=g))[:, None], mask[:, None]


def test_unet_segmentation_soft_dice_plus_bce_in_fp32_bf16():
    """bf16 without a scaler (fp16 convolutions are very slow on the CPU)."""
    torch.manual_seed(4)
    model = UNet()

    def step_loss(i):
        x, m = discs(16, i)
        logits = model(x).float()
        p = torch.sigmoid(logits)
        inter = (p * m).sum((1, 2, 3))
        dice = 1 - (2 * inter + 1) / (p.sum((1, 2, 3)) + m.sum((1, 2, 3)) + 1)
        return dice.mean() + F.binary_cross_entropy_with_logits(logits, m)

    w, losses, scales = fit(model, step_loss, steps=60, lr=3e-3, dtype=BF16)
    healthy(losses, scales, fall=0.75)
    quiet(w)


# -- flows, ODEs, score models ---------------------------------------------------------------------------------------
class GlowStep(nn.Module):
    """ActNorm (data-dependent init on the first batch) -> invertible 1x1 'conv' (a DxD matrix, log|det| by slogdet in
    fp32) -> affine coupling with tanh-bounded log-scales."""

    def __init__(self, d=8):
        super().__init__()
        self.loc, self.logs = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d))
        self.inited = False
        self.W = nn.Parameter(torch.linalg.qr(torch.randn(d, d))[0])
        self.net = mlp(d // 2, 64, d, act=nn.ReLU)
        self.d = d

    def forward(self, x):
        if not self.inited:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.logs.copy_(-torch.log(x.std(0) + 1e-6))
            self.inited = True
        x = (x + self.loc) * self.logs.exp()
        ld = self.logs.sum().expand(x.shape[0])
        x = x @ self.W.float().T
        ld = ld + torch.linalg.slogdet(self.W.float())[1]
        a, b = x.chunk(2, 1)
        h = self.net(a).float()
        logs, t = torch.tanh(h[:, : self.d // 2]), h[:, self.d // 2:]
        b = b * logs.exp() + t
        return torch.cat([a, b], 1), ld + logs.sum(1)


class Glow(nn.Module):
    def __init__(self, d=8, n=3):
        super().__init__()
        self.steps = nn.ModuleList(GlowStep(d) for _ in range(n))

    def forward(self, x):
        ld = torch.zeros(x.shape[0])
        for s in self.steps:
            x, l = s(x)
            ld = ld + l
        return x, ld


def test_glow_actnorm_invertible_1x1_slogdet_affine_coupling_nll():
    torch.manual_seed(5)
    d = 8
    A = torch.randn(d, d, generator=gen(55)) * 0.7
    model = Glow(d)

    def data(i):
        z = torch.randn(256, d, generator=gen(i))
        return torch.tanh(z @ A.T) * 3 + 1 + 0.1 * z

    def step_loss(i):
        z, ld = model(data(i).float())
        return (0.5 * z.float().pow(2).sum(1) - ld).mean() / d

    w, losses, scales = fit(model, step_loss, steps=60, lr=2e-3)
    healthy(losses, scales, drop=0.3)
    quiet(w)


def test_neural_ode_vector_field_integrated_by_fixed_step_rk4():
    """A vector field MLP integrated with 8 RK4 steps under autocast, fitting the trajectories of a damped rotation."""
    torch.manual_seed(6)
    f = mlp(2, 64, 64, 2, act=nn.Tanh)
    M = torch.tensor([[-0.1, -2.0], [2.0, -0.1]])
    dt, n = 0.1, 8

    def rk4(fn, x):
        xs = []
        for _ in range(n):
            k1 = fn(x)
            k2 = fn(x + dt / 2 * k1)
            k3 = fn(x + dt / 2 * k2)
            k4 = fn(x + dt * k3)
            x = x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            xs.append(x)
        return torch.stack(xs)

    def step_loss(i):
        x0 = torch.randn(64, 2, generator=gen(i))
        with torch.no_grad():
            tgt = rk4(lambda x: x @ M.T, x0)
        return F.mse_loss(rk4(lambda x: f(x).float(), x0), tgt)

    w, losses, scales = fit(f, step_loss, steps=50, lr=3e-3)
    healthy(losses, scales, fall=0.5)
    quiet(w)


class ScoreNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(2 + 16, 128, 128, 2, act=nn.SiLU)
        self.register_buffer("freqs", torch.arange(8).float())

    def forward(self, x, sigma):
        ang = torch.log(sigma)[:, None] * self.freqs
        return self.net(torch.cat([x, ang.sin(), ang.cos()], 1)) / sigma[:, None]   # NCSNv2: s(x, sigma) = net / sigma


def test_denoising_score_matching_log_uniform_sigmas_0_1_to_2():
    """Scores up to 1/sigma = 10 (the output divided by sigma), the loss weighted by sigma^2."""
    torch.manual_seed(7)
    model = ScoreNet()

    def step_loss(i):
        x = ring_data(256, i)
        sigma = torch.exp(torch.empty(256).uniform_(math.log(0.1), math.log(2.0), generator=gen(50_000 + i)))
        z = torch.randn(256, 2, generator=gen(60_000 + i))
        s = model(x + sigma[:, None] * z, sigma).float()
        return 0.5 * (sigma[:, None] * s + z).pow(2).sum(1).mean()

    w, losses, scales = fit(model, step_loss, steps=120, lr=3e-3)
    healthy(losses, scales, fall=0.92)
    quiet(w)


# -- self-supervised ----------------------------------------------------------------------------------------------------
class MAE(nn.Module):
    """Patches of 4x4 from 16x16 images (16 patches), 75% masked by argsort of noise; encoder on the visible ones,
    decoder with a mask token; loss on the masked patches' pixels (a random brightness the visible ones reveal)."""

    def __init__(self, d=48):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.02)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True,
                                                                    norm_first=True), 2, enable_nested_tensor=False)
        self.mask_token = nn.Parameter(torch.zeros(d))
        self.dec = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True,
                                                                    norm_first=True), 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, 16)

    def forward(self, patches, noise):
        B, N, _ = patches.shape
        keep = N // 4
        ids = noise.argsort(1)
        restore = ids.argsort(1)
        x = self.embed(patches) + self.pos
        vis = torch.gather(x, 1, ids[:, :keep, None].expand(-1, -1, x.shape[-1]))
        h = self.enc(vis)
        full = torch.cat([h, self.mask_token.to(h.dtype).expand(B, N - keep, -1)], 1)
        full = torch.gather(full, 1, restore[..., None].expand(-1, -1, h.shape[-1])) + self.pos
        pred = self.head(self.dec(full))
        mask = (restore >= keep).float()
        return pred, mask


def test_masked_autoencoder_random_masking_argsort_gather_loss_on_masked_patches():
    torch.manual_seed(8)
    model = MAE()
    yy, xx = torch.meshgrid(torch.arange(16).float(), torch.arange(16).float(), indexing="ij")

    def images(i):
        g = gen(i)
        f = torch.rand(32, 2, 1, 1, generator=g) * 0.6 + 0.2
        ph = torch.rand(32, 1, 1, generator=g) * 6
        b = torch.rand(32, 1, 1, generator=g) * 2 - 1
        return b + torch.sin(f[:, 0] * xx + ph) * torch.cos(f[:, 1] * yy)

    def step_loss(i):
        im = images(i)
        p = im.unfold(1, 4, 4).unfold(2, 4, 4).reshape(32, 16, 16)
        pred, mask = model(p, torch.rand(32, 16, generator=gen(70_000 + i)))
        err = (pred.float() - p).pow(2).mean(-1)
        return (err * mask).sum() / mask.sum()

    w, losses, scales = fit(model, step_loss, steps=80, lr=3e-3)
    healthy(losses, scales)
    quiet(w)


def test_prototypical_networks_5_way_5_shot_episodes_squared_euclidean():
    torch.manual_seed(9)
    enc = mlp(16, 64, 64, 32, act=nn.ReLU)
    centres = torch.randn(40, 16, generator=gen(99)) * 1.2

    def step_loss(i):
        g = gen(i)
        cls = torch.randperm(40, generator=g)[:5]
        x = centres[cls][:, None] + torch.randn(5, 15, 16, generator=g)
        z = enc(x.flatten(0, 1)).float().view(5, 15, -1)
        proto = z[:, :5].mean(1)
        q = z[:, 5:].flatten(0, 1)
        d = torch.cdist(q, proto).pow(2)
        return F.cross_entropy(-d, torch.arange(5).repeat_interleave(10))

    w, losses, scales = fit(enc, step_loss, steps=60, lr=1e-3)
    healthy(losses, scales)
    quiet(w)


def two_views(i, n=128):
    x, _ = clusters(n, i, spread=0.7)
    g = gen(80_000 + i)
    return (x * (1 + 0.2 * torch.randn(n, 16, generator=g)) + 0.2 * torch.randn(n, 16, generator=g),
            x * (1 + 0.2 * torch.randn(n, 16, generator=g)) + 0.2 * torch.randn(n, 16, generator=g))


def test_barlow_twins_cross_correlation_of_batchnormed_projections_lambda_5e_3():
    torch.manual_seed(10)
    model = nn.Sequential(mlp(16, 64, 64, act=nn.ReLU), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                          nn.ReLU(), nn.Linear(64, 32))
    bn = nn.BatchNorm1d(32, affine=False)

    def step_loss(i):
        a, b = two_views(i)
        z1, z2 = model(a).float(), model(b).float()
        c = bn(z1).T @ bn(z2) / a.shape[0]
        on = (torch.diagonal(c) - 1).pow(2).sum()
        off = (c - torch.diag(torch.diagonal(c))).pow(2).sum()
        return on + 5e-3 * off

    w, losses, scales = fit(model, step_loss, steps=50, lr=2e-3)
    healthy(losses, scales)
    quiet(w)


def test_vicreg_variance_invariance_covariance_in_fp32():
    torch.manual_seed(11)
    model = nn.Sequential(mlp(16, 64, 64, act=nn.ReLU), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                          nn.ReLU(), nn.Linear(64, 32))

    def vc(z):
        z = z - z.mean(0)
        std = torch.sqrt(z.var(0) + 1e-4)
        cov = z.T @ z / (z.shape[0] - 1)
        off = cov - torch.diag(torch.diagonal(cov))
        return F.relu(1 - std).mean(), off.pow(2).sum() / z.shape[1]

    def step_loss(i):
        a, b = two_views(i)
        z1, z2 = model(a).float(), model(b).float()
        (v1, c1), (v2, c2) = vc(z1), vc(z2)
        return 25 * F.mse_loss(z1, z2) + 25 * (v1 + v2) / 2 + (c1 + c2)

    w, losses, scales = fit(model, step_loss, steps=50, lr=2e-3)
    healthy(losses, scales)
    quiet(w)


def test_dino_centering_sharpening_teacher_temp_0_04_ema_teacher():
    """Student temperature 0.1, teacher 0.04 with a centre (EMA 0.9) subtracted, the teacher an EMA (0.99) of the
    student updated after each step; cross-entropy from the teacher's softmax to the student's log-softmax over 64
    prototypes, two views crossed. The teacher/student agreement improves (the loss falls)."""
    torch.manual_seed(12)
    student = nn.Sequential(mlp(16, 64, 64, act=nn.GELU), nn.GELU(), nn.Linear(64, 64))
    teacher = copy.deepcopy(student).requires_grad_(False)
    center = torch.zeros(64)

    def step_loss(i):
        nonlocal center
        a, b = two_views(i)
        with torch.no_grad():
            t = teacher(torch.cat([a, b])).float()
            pt = F.softmax((t - center) / 0.04, -1).chunk(2)
            center = 0.9 * center + 0.1 * t.mean(0)
        ls = F.log_softmax(student(torch.cat([a, b])).float() / 0.1, -1).chunk(2)
        return -((pt[0] * ls[1]).sum(-1).mean() + (pt[1] * ls[0]).sum(-1).mean()) / 2

    def after(i):
        for pt_, ps in zip(teacher.parameters(), student.parameters()):
            pt_.mul_(0.99).add_(ps, alpha=0.01)

    w, losses, scales = fit(student, step_loss, steps=60, lr=1e-3, after=after)
    healthy(losses, scales)
    quiet(w)


def test_swav_sinkhorn_knopp_in_fp32_eps_0_05_swapped_prediction():
    """L2-normalised embeddings against 32 L2-normalised prototypes (a Linear whose weight is renormalised after each
    step); codes by 3 Sinkhorn-Knopp iterations on exp(scores / 0.05) in fp32 under no_grad; swapped prediction at
    temperature 0.1."""
    torch.manual_seed(13)
    model = nn.ModuleDict({"enc": mlp(16, 64, 64, 32, act=nn.ReLU), "proto": nn.Linear(32, 32, bias=False)})

    @torch.no_grad()
    def sinkhorn(s):
        Q = torch.exp(s / 0.05).T
        Q /= Q.sum()
        K, B = Q.shape
        for _ in range(3):
            Q /= Q.sum(1, keepdim=True)
            Q /= K
            Q /= Q.sum(0, keepdim=True)
            Q /= B
        return (Q * B).T

    def after(i):
        model["proto"].weight.copy_(F.normalize(model["proto"].weight, dim=1))

    with torch.no_grad():
        after(-1)

    def step_loss(i):
        a, b = two_views(i)
        z = F.normalize(model["enc"](torch.cat([a, b])).float(), dim=1)
        s = model["proto"](z).float()
        s1, s2 = s.chunk(2)
        q1, q2 = sinkhorn(s1.detach().float()), sinkhorn(s2.detach().float())
        return -0.5 * ((q1 * F.log_softmax(s2 / 0.1, 1)).sum(1).mean() + (q2 * F.log_softmax(s1 / 0.1, 1)).sum(1).mean())

    w, losses, scales = fit(model, step_loss, steps=60, lr=2e-3, after=after)
    healthy(losses, scales, fall=0.95)
    quiet(w)


# -- recommendation, ranking, sets -----------------------------------------------------------------------------------
def test_matrix_factorisation_bpr_loss_user_item_embeddings():
    torch.manual_seed(14)
    U, I, d = 200, 300, 16
    tu, ti = torch.randn(U, 4, generator=gen(141)), torch.randn(I, 4, generator=gen(142))
    pref = tu @ ti.T
    model = nn.ModuleDict({"u": nn.Embedding(U, d), "i": nn.Embedding(I, d)})
    nn.init.normal_(model["u"].weight, std=0.1)
    nn.init.normal_(model["i"].weight, std=0.1)

    def step_loss(i):
        g = gen(i)
        u = torch.randint(0, U, (512,), generator=g)
        a, b = torch.randint(0, I, (512,), generator=g), torch.randint(0, I, (512,), generator=g)
        swap = pref[u, a] < pref[u, b]
        pos, neg = torch.where(swap, b, a), torch.where(swap, a, b)
        eu = model["u"](u)
        s = (eu * model["i"](pos)).sum(1) - (eu * model["i"](neg)).sum(1)
        return -F.logsigmoid(s.float()).mean()

    w, losses, scales = fit(model, step_loss, steps=60, lr=5e-2, clip=None)
    healthy(losses, scales)
    quiet(w)


def test_pairwise_margin_ranking_loss_learning_to_rank():
    torch.manual_seed(15)
    model = mlp(16, 64, 1, act=nn.ReLU)
    wtrue = torch.randn(16, generator=gen(151))

    def step_loss(i):
        g = gen(i)
        a, b = torch.randn(256, 16, generator=g), torch.randn(256, 16, generator=g)
        y = torch.sign(a @ wtrue - b @ wtrue)
        return F.margin_ranking_loss(model(a).float().squeeze(1), model(b).float().squeeze(1), y, margin=1.0)

    w, losses, scales = fit(model, step_loss, steps=50, lr=2e-3)
    healthy(losses, scales, fall=0.6)
    quiet(w)


class PMA(nn.Module):
    """Set transformer: self-attention blocks over the set elements, pooling by multihead attention from one learned
    seed vector."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(2, d)
        self.sab = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.seed = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.pma = nn.MultiheadAttention(d, 4, batch_first=True)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.sab(self.inp(x))
        p, _ = self.pma(self.seed.expand(x.shape[0], -1, -1).to(h.dtype), h, h)
        return self.out(p[:, 0]).squeeze(1)


def test_set_transformer_pooling_by_multihead_attention_predicts_set_spread():
    torch.manual_seed(16)
    model = PMA()

    def step_loss(i):
        g = gen(i)
        s = torch.rand(64, 1, 1, generator=g) * 2 + 0.2
        x = torch.randn(64, 20, 2, generator=g) * s
        return F.mse_loss(model(x).float(), s.flatten())

    w, losses, scales = fit(model, step_loss, steps=60, lr=2e-3)
    healthy(losses, scales, fall=0.5)
    quiet(w)
