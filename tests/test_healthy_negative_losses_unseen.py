"""HEALTHY training whose LOSS IS NEGATIVE for much of the run (or whose model returns an output no gradient
reaches), with the model's returned output within 8 bits of the fp16 maximum (abs-max 2^8 .. 2^14.5), must stay
QUIET (no warning or error): ampdoctor watching every step (`every=1`) and the default watch (its headroom series'
stride pinned at 1 and 8 too: tests/stride_sweep.py; the default's stride follows the machine's load).

The probe for headroom_trend's "fit towards targets" exemption since it changed: a loss below zero over the recent
window is never such a fit (an unbounded -score has no target), and a model output no gradient reaches is never
such a fit. Its risk: false alarms on healthy training whose returned output grows early then settles near the max
while the loss is negative, or whose returned output carries no gradient.

Small realistic CPU runs, each on noisy batches (random batch sizes, per-batch scales), fp16 autocast on the CPU,
GradScaler("cpu"), the loop zero_grad -> forward+loss under autocast -> scale(loss).backward -> unscale_ ->
clip_grad_norm_ -> step -> update (-> scheduler); the watched/hot tensor is the model's RETURNED output:

1. gauss_nll: heteroscedastic Gaussian NLL regression (F.gaussian_nll_loss, full=False) on targets in the hundreds;
   the model returns (mu, logvar), mu = Y_MEAN + Y_STD * head(x) in raw units (2^9.4-2^10.1), the NLL taken in
   standardized units; it goes below 0 from step ~40 as the predicted variance shrinks, then plateaus (~-0.36).
2. wgan_gp: a WGAN-GP critic (loss = D(fake) - D(real) + 10 * GP, the GP through GradScaler as PyTorch's AMP
   examples do) on raw readings in the hundreds against a fixed generator's samples; the critic's scores grow from
   ~2^4 to ~2^10.3 over the first ~100 steps and the loss is negative from step ~14. Its GradScaler starts at
   init_scale=2^7: at the default 2^16 the GP's grad overflows at step 0 and the last Linear's fp16 weight gradient
   (hidden activations in the hundreds x the scale) overflowed again at steps 11, 39, 82 (scale 1024 -> 128), real
   skips that the oracle forbids after step 10; 2^7 is where the default run's scale ends up.
3. pg_value: a contextual bandit trained by policy gradient (-A * logp, normalized advantages) with a value head
   on returns in the thousands (value = 1000 * head(h), loss 0.5 * ((V - R) / 1000)^2); the value output grows
   from 2^9.5 to 2^11.3 over the first ~50 steps, flat after; the loss is negative from step ~38.
4. detached_stat: a regressor that returns (prediction, its input normalizer's running mean as fp16, detached): an
   EMA (momentum 0.05) of raw readings in the thousands, 2^7 at step 0, 2^11.3 by step 50, then stable (2^11.4).
5. simsiam: SimSiam's negative cosine loss (predictor p vs the stop-gradient projector output z) on raw inputs in
   the thousands; the projector (no BN) output z grows from 2^8.4 to 2^9.6 by step 100, then 2^9.6-2^9.9.

First an UNWATCHED oracle run (same seed, its own forward hook on the model's returned output) asserts the run
healthy: every loss finite, the loss falls, no skipped step after step 10, the returned near-max output fp16, finite
on every step and within 2^8 .. 2^14.5 over the last 100 steps (and the negative-loss cases: the loss below zero on
at least half the steps; detached_stat: that output needs no gradient). Then the watched run must give bitwise the
oracle's losses and no finding of severity warning or error. A false alarm is a strict xfail (`wrong`) with
ampdoctor's words and the output's numbers.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import WrongAnswer, same_losses, wrong  # noqa: E402
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
# gauss_nll's LambdaLR steps after a step the GradScaler skipped (step 0): torch's warning, expected here
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")

FP16_MAX = 65504.0
LO, HI = 2.0 ** 8, 2.0 ** 14.5
TAIL = 100        # the oracle's range check: the last TAIL steps
NO_SKIP_AFTER = 10


def bits(v):
    return math.log2(FP16_MAX / v) if 0 < v < math.inf else -math.inf


def noisy_size(g, lo=8, hi=48):
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def lognormal(g, sigma=0.3):
    return math.exp(sigma * float(torch.randn(1, generator=g)))


# --- 1. heteroscedastic Gaussian NLL on raw targets -----------------------------------------------------------------

Y_MEAN, Y_STD = 600.0, 100.0
W_REG = torch.randn(8, generator=gen(11)) / math.sqrt(8)


class HeteroReg(nn.Module):
    """mu in raw units (the target standardization folded into the model), log-variance from a small MLP."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(8, 1)
        self.var = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x):
        mu = Y_MEAN + Y_STD * self.mean(x).squeeze(-1)
        return mu, self.var(x).squeeze(-1)


def reg_batch(i, seed=1):
    g = gen(seed * 100003 + i)
    b = noisy_size(g, 32, 64)
    x = torch.randn(b, 8, generator=g) * lognormal(g, 0.2)
    sd = 30.0 + 15.0 * x[:, 0].abs()                                       # heteroscedastic noise
    return (x,), Y_MEAN + Y_STD * (x @ W_REG) + sd * torch.randn(b, generator=g)


def nll_loss(m, x, y, ctx):
    mu, logvar = m(x)                                                      # the NLL in standardized units
    return F.gaussian_nll_loss((mu.float() - Y_MEAN) / Y_STD, (y - Y_MEAN) / Y_STD, logvar.float().exp())


# --- 2. WGAN-GP critic ----------------------------------------------------------------------------------------------

class Critic(nn.Module):
    def __init__(self, d=8, h=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.LeakyReLU(0.2), nn.Linear(h, h), nn.LeakyReLU(0.2),
                                 nn.Linear(h, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


MU_REAL = 150.0 + 20.0 * torch.rand(8, generator=gen(21))
MU_FAKE = MU_REAL - 15.0 + 10.0 * torch.rand(8, generator=gen(22))


def gan_batch(i, seed=2):
    g = gen(seed * 100003 + i)
    b = noisy_size(g, 8, 32)
    real = MU_REAL + 20.0 * lognormal(g, 0.2) * torch.randn(b, 8, generator=g)
    fake = MU_FAKE + 25.0 * torch.randn(b, 8, generator=g)                 # a fixed generator's samples
    alpha = torch.rand(b, 1, generator=g)
    return (real, fake, alpha), None


def wgan_loss(m, real, fake, alpha, y, ctx):
    scaler = ctx["scaler"]
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    d_int = m(interp)
    scaled = torch.autograd.grad(scaler.scale(d_int.float().sum()), interp, create_graph=True)[0]
    grad = scaled / scaler.get_scale()
    gp = (grad.norm(2, dim=1) - 1).pow(2).mean()
    return m(fake).float().mean() - m(real).float().mean() + 10.0 * gp


# --- 3. policy gradient with a value head on raw returns ------------------------------------------------------------

RET_SCALE = 1000.0
N_ACT = 4
W_BEST = torch.randn(8, N_ACT, generator=gen(31))


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.Tanh())
        self.pi, self.v = nn.Linear(64, N_ACT), nn.Linear(64, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), RET_SCALE * self.v(h).squeeze(-1)                # value in raw return units


def pg_batch(i, seed=3):
    g = gen(seed * 100003 + i)
    b = noisy_size(g, 16, 64)
    obs = torch.randn(b, 8, generator=g)
    return (obs,), g


def pg_loss(m, obs, g, ctx):
    logits, value = m(obs)
    logp_all = F.log_softmax(logits.float(), -1)
    act = torch.multinomial(logp_all.detach().exp(), 1, generator=g).squeeze(-1)
    best = (obs @ W_BEST).argmax(-1)
    ret = 2000.0 + 300.0 * (act == best).float() + 60.0 * torch.randn(len(act), generator=g)
    adv = ret - value.detach().float()
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg = -(adv * logp_all.gather(1, act[:, None]).squeeze(1)).mean()
    return pg + 0.5 * ((value.float() - ret) / RET_SCALE).pow(2).mean()


# --- 4. a returned detached running statistic -----------------------------------------------------------------------

class NormRegressor(nn.Module):
    """An input normalizer's running mean (EMA, updated in training) on raw readings in the thousands; the forward
    returns it beside the prediction (as the batch dtype: the caller logs / stacks it), detached."""

    def __init__(self, d=12, momentum=0.05):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("running_var", torch.ones(d))
        self.momentum = momentum
        self.net = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.lerp_(x.mean(0), self.momentum)
                self.running_var.lerp_(x.var(0), self.momentum)
        z = (x - self.running_mean) / (self.running_var + 1e-5).sqrt()
        pred = self.net(z).squeeze(-1)
        return pred, self.running_mean.detach().to(pred.dtype)


LEVELS = 1500.0 + 1500.0 * torch.rand(12, generator=gen(41))
W_NORM = torch.randn(12, generator=gen(42))


def norm_batch(i, seed=4):
    g = gen(seed * 100003 + i)
    b = noisy_size(g)
    u = torch.randn(b, 12, generator=g)
    x = LEVELS * (1 + 0.1 * u) * lognormal(g, 0.05)
    return (x,), torch.tanh(u @ W_NORM / 3) + 0.05 * torch.randn(b, generator=g)


def norm_loss(m, x, y, ctx):
    pred, _stat = m(x)
    return F.mse_loss(pred.float(), y)


# --- 5. SimSiam ---------------------------------------------------------------------------------------------------

class SimSiam(nn.Module):
    def __init__(self, d=16, h=64, z=32):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.projector = nn.Linear(h, z)                                   # no BN: z in raw units
        self.predictor = nn.Sequential(nn.Linear(z, 16), nn.ReLU(), nn.Linear(16, z))

    def forward(self, x1, x2):
        z1, z2 = self.projector(self.encoder(x1)), self.projector(self.encoder(x2))
        return self.predictor(z1), self.predictor(z2), z1, z2


PROTO_SS = 2500.0 * torch.rand(6, 16, generator=gen(51))


def ss_batch(i, seed=5):
    g = gen(seed * 100003 + i)
    b = noisy_size(g, 16, 64)
    c = torch.randint(0, 6, (b,), generator=g)
    base = PROTO_SS[c] + 180.0 * torch.randn(b, 16, generator=g)

    def view():
        return base * (0.8 + 0.4 * torch.rand(b, 1, generator=g)) + 120.0 * torch.randn(b, 16, generator=g)
    return (view(), view()), None


def simsiam_loss(m, x1, x2, y, ctx):
    p1, p2, z1, z2 = m(x1, x2)
    cos = F.cosine_similarity
    return -(cos(p1.float(), z2.detach().float()).mean() + cos(p2.float(), z1.detach().float()).mean()) / 2


# --- the scenario runner --------------------------------------------------------------------------------------------

class Scenario:
    def __init__(self, *, build, batch, loss, hot, steps, opt, sched=None, seed=0, drop=0.5, neg=True,
                 nograd=False, init_scale=None):
        self.build, self.batch, self.loss, self.hot, self.steps = build, batch, loss, hot, steps
        self.opt, self.sched, self.seed, self.drop, self.neg, self.nograd = opt, sched, seed, drop, neg, nograd
        self.init_scale = init_scale


def adamw(lr=1e-3, wd=0.01, betas=(0.9, 0.999)):
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, betas=betas)


def cosine(total, floor=0.02):
    return lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))


SCENARIOS = {
    "gauss_nll": Scenario(build=HeteroReg, batch=reg_batch, loss=nll_loss, hot=lambda out: out[0], steps=360,
                          seed=1, opt=adamw(1e-2, 0.0), sched=cosine(360)),
    "wgan_gp": Scenario(build=Critic, batch=gan_batch, loss=wgan_loss, hot=lambda out: out, steps=300, seed=2,
                        opt=adamw(1e-3, 0.0, (0.5, 0.9)), init_scale=2.0 ** 7),
    "pg_value": Scenario(build=ActorCritic, batch=pg_batch, loss=pg_loss, hot=lambda out: out[1], steps=360,
                         seed=3, opt=adamw(3e-3)),
    "detached_stat": Scenario(build=NormRegressor, batch=norm_batch, loss=norm_loss, hot=lambda out: out[1],
                              steps=300, seed=4, opt=adamw(3e-3), neg=False, nograd=True),
    "simsiam": Scenario(build=SimSiam, batch=ss_batch, loss=simsiam_loss, hot=lambda out: out[2], steps=300,
                        seed=5, opt=adamw(1e-3, 1e-4), drop=0.3),
}


class Run:
    pass


def run(sc, watch_kw=None, run_dir=None):
    """The user's loop; `watch_kw` None: UNWATCHED with the oracle's forward hook on the model (its returned
    output), else under ampdoctor.watch(m, optimizer=, scaler=, run_dir=, **watch_kw)."""
    torch.manual_seed(sc.seed)
    m = sc.build()
    opt = sc.opt(m)
    sched = sc.sched(opt) if sc.sched else None
    scaler = torch.amp.GradScaler("cpu", **({} if sc.init_scale is None else {"init_scale": sc.init_scale}))
    r = Run()
    r.losses, r.skips, r.absmax, r.dtypes, r.grad, r.rep = [], [], {}, set(), set(), None
    cur = [0]

    def hook(mod, args, out):
        t = sc.hot(out)
        r.dtypes.add(t.dtype)
        r.grad.add(t.requires_grad)
        a = t.detach().float().abs().max().item()
        r.absmax[cur[0]] = a if not math.isfinite(a) else max(a, r.absmax.get(cur[0], 0.0))
    h = m.register_forward_hook(hook) if watch_kw is None else None
    w = ampdoctor.watch(m, optimizer=opt, scaler=scaler, run_dir=run_dir, **watch_kw) if watch_kw is not None \
        else None
    ctx = {"scaler": scaler}
    try:
        for i in range(sc.steps):
            cur[0] = i
            args, y = sc.batch(i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sc.loss(m, *args, y, ctx)
            s0 = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if sched is not None:
                sched.step()
            r.losses.append(loss.item())
            if scaler.get_scale() < s0:
                r.skips.append(i)
    finally:
        if h is not None:
            h.remove()
        if w is not None:
            w.close()
    if w is not None:
        r.rep, r.watch = w.report(), w
    return r


def slope(r, lo, hi):
    """Least-squares bits LOST per step of the oracle's headroom over [lo, hi) (positive: towards the max)."""
    pts = [(s, bits(r.absmax[s])) for s in range(lo, hi)]
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    return -sum((s - mx) * (v - my) for s, v in pts) / sum((s - mx) ** 2 for s, _ in pts)


def describe(r, n):
    """The returned output's headroom, in numbers, and the loss's course."""
    lg = [math.log2(r.absmax[s]) if r.absmax[s] > 0 else -math.inf for s in range(n)]
    peak = max(range(n), key=lambda s: lg[s])
    neg = sum(v < 0 for v in r.losses)
    first_neg = next((i for i, v in enumerate(r.losses) if v < 0), None)
    return (f"output abs-max 2^{lg[0]:.1f} at step 0, 2^{lg[min(50, n - 1)]:.1f} at 50, 2^{lg[100]:.1f} at 100, "
            f"peak 2^{lg[peak]:.1f} at step {peak}, 2^{min(lg[-TAIL:]):.1f}..2^{max(lg[-TAIL:]):.1f} over the last "
            f"{TAIL} steps; slope {slope(r, 1, 49):+.3f} bits/step over steps 1-48, {slope(r, 48, 96):+.3f} over "
            f"48-96, {slope(r, n - 48, n):+.4f} over the last 48; loss {sum(r.losses[:30]) / 30:.3g} (first 30) -> "
            f"{sum(r.losses[-30:]) / 30:.3g} (last 30), below 0 on {neg}/{n} steps from step {first_neg}")


_ORACLES: dict[str, Run] = {}


def oracle(name):
    """The unwatched run, asserted healthy and near the max (cached: the same seed gives the same run)."""
    if name in _ORACLES:
        return _ORACLES[name]
    sc = SCENARIOS[name]
    o = run(sc)
    n = sc.steps
    assert all(map(math.isfinite, o.losses)), o.losses
    k = 30
    first, last = sum(o.losses[:k]) / k, sum(o.losses[-k:]) / k
    assert first - last > sc.drop, (first, last)
    assert [s for s in o.skips if s > NO_SKIP_AFTER] == [], o.skips
    assert o.dtypes == {torch.float16}, o.dtypes
    assert len(o.absmax) == n and all(map(math.isfinite, o.absmax.values())), "returned output non-finite"
    tail = [o.absmax[s] for s in range(n - TAIL, n)]
    assert LO <= min(tail) and max(tail) <= HI, describe(o, n)
    if sc.neg:
        assert sum(v < 0 for v in o.losses) >= n // 2, describe(o, n)
    if sc.nograd:
        assert o.grad == {False}, o.grad
    _ORACLES[name] = o
    return o


def check_quiet(name, o, r):
    bad = alarms(r.rep.findings)
    if bad:
        raise WrongAnswer(f"false alarm on healthy {name} ({describe(o, SCENARIOS[name].steps)}): {bad[:4]}")


WRONG: dict[tuple, str] = {}    # (name, mode) -> ampdoctor's false alarm, when written


def cases():
    return [pytest.param(name, mode, id=f"{name}-{mode}",
                         marks=[wrong(WRONG[(name, mode)])] if (name, mode) in WRONG else [])
            for name in SCENARIOS for mode in ("every1", "default")]


@pytest.mark.parametrize("name,mode", cases())
def test_healthy_negative_loss_quiet(name, mode, tmp_path):
    o = oracle(name)
    r = run(SCENARIOS[name], {"every": 1} if mode == "every1" else {}, run_dir=tmp_path / "run")
    same_losses(o, r)
    check_quiet(name, o, r)


PINNED = tuple(SCENARIOS)


def pinned_cases():
    return [pytest.param(name, k, id=f"{name}-stride{k}",
                         marks=[wrong(WRONG[(name, f"stride{k}")])] if (name, f"stride{k}") in WRONG else [])
            for name in PINNED for k in (1, 8)]


@pytest.mark.parametrize("name,stride", pinned_cases())
def test_default_pinned_stride_quiet(name, stride, tmp_path, monkeypatch):
    """The default watch with the headroom series' stride pinned (the stride follows the machine's load)."""
    import stride_sweep
    o = oracle(name)
    stride_sweep.install(stride, patch=monkeypatch.setattr)
    r = run(SCENARIOS[name], {}, run_dir=tmp_path / "run")
    stride_sweep.check_stride(r.watch, stride)
    same_losses(o, r)
    check_quiet(name, o, r)
