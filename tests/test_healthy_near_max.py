"""HEALTHY fp16 runs whose module outputs sit in, or pass through, the range 256..30000 (within 8 bits of fp16's max
65504): the range where record/budget.py `creep` switches the headroom series to every routine step for 24 steps
once a layer rose at each of its last 3 points (by 0.2 bits in all). That densifies the series exactly where a layer
is near the max; `headroom_trend` (README.md, "Early warning before the overflow") — and every other rule — must stay
quiet on these runs: no warning and no error. fp16 autocast on the CPU, GradScaler("cpu"), one intra-op thread.

Each scenario is first run UNWATCHED (the twin) with the test's own forward hooks (every module's fp16 output
abs-max, every step): every loss finite, the loss falling, at most 2 scaler backoffs after its opening search (the
first 20 steps), and the largest fp16 output in [256, 32768) — the run really reaches the near-max range and never
comes close to overflowing. Then it is run WATCHED, at the default watch (headroom="auto", stride unpinned) and
with the stride pinned at 1, 8 and 32 (tests/stride_sweep.py through monkeypatch, as test_trend_strides.py and
test_early_warning3.py do): the losses and final parameters must be bitwise those of the twin, and the report must
carry no warning, no error and no `headroom_trend` finding of any severity.

Scenarios (fixed seeds; 200-320 steps of tiny models; the fp16 output abs-max of the named module in the twin):
 1. learned_gain: a regression in raw units (8e3 x tanh(.)) through a learned output gain exp(g) (Adam on g at
    0.06, decaying after step 60): `gain` 370 -> 1.5e4 (step ~60) -> a plateau ~0.9e4..1.1e4;
 2. heavy_tailed: raw heavy-tailed inputs (Student-t, 3 dof, clamped at 12, x2500) into a Linear followed by a
    LayerNorm: `0` a noisy 1.05e4..2.1e4 on every step for 300 steps;
 3. staircase: a target whose scale steps x4 twice (500 -> 2e3 -> 8e3 at steps 80, 160) under a step lr halving
    every 20 steps within each stage: `gain` climbs to each level, then flat (210 -> 1.5e4 peak, ~1.1e4 at the end);
 4. cyclic: a seasonal target whose amplitude swings 1e3 <-> 1e4 (period 80) under a triangular cyclic lr:
    `gain` oscillates 450..2.3e4 for 320 steps;
 5. raw_regression: an MLP predicting house-price-like targets 5e3 + 800 z (MSE on /5e3, lr 5e-2 then 1.5e-2):
    the head `2` grows from ~1 through the near-max range to ~7.5e3 (peak 9.6e3) and fits;
 6. sqrt_d_embedding: Embedding(512, 1024) (std 2.5) x sqrt(1024) cast to fp16, AdamW (lr 5e-2, wd 0.01):
    `embed` ~3.3e2..3.7e2 throughout;
 7. curriculum: raw inputs whose scale doubles three times (x60 -> x480 at steps 40, 80, 120) then stays: `0`
    steps up 170 -> 1.4e3 and stays (two ordinary scaler backoffs after step 120);
 8. raw_pixels: a small CNN on unnormalised 0..255 pixels: the first conv's output ~290 falling to ~210;
 9. attention_logits: cosine attention scores of a frozen (identity) encoder over 32 nearly collinear keys, with
    a learned temperature exp(t) (Adam 0.1 under a 40-step linear warmup, label smoothing 0.1): `scores`
    40 -> 5e3 (step ~60) -> stable ~3.2e3;
10. rise_and_settle: a learned gain under SGD with momentum 0.9: `gain` 160 -> 1.5e4 (overshoot) and settling
    at ~6e3..8e3;
11. settle_near_2e4: a learned gain (Adam 0.03, decaying after step 90) toward 1.4e4 x tanh(.): `gain` 1.6e3 ->
    ~2e4 over ~65 steps (rising ~0.06 bits/step), then 240 steps at 1.3..2 bits from the max (peak 2.7e4).
record/budget.py `creep` switched the series to every step at least once in 9 of the 11 at the default watch
(not 6 and 8: nothing rises by 0.2 bits there), e.g. 3 times in staircase and cyclic.

Result when written: 44 pass, 0 xfail (11 scenarios x default/stride 1/8/32; ~30 s on one thread). ampdoctor was
quiet on every one (no finding of rule headroom_trend at any severity). Seen while building these (not kept): the
settle_near_2e4 recipe with a 2.6e4 target, whose `gain` overshoots to 4.9e4 and stays at 3.5e4..4.9e4 (0.4..0.9
bits from the max, outside this file's range), gets `[warning] headroom_trend at gain step 15` at stride 1 only
(the forecast step passes with under 2 bits left, so it is not dropped).
"""
from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
import stride_sweep  # noqa: E402
from probe_harness import WrongAnswer, wrong  # noqa: E402
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = torch.float16
NEAR = 256.0        # 8 bits from fp16's max: record/budget.py ALERT_ABSMAX
CEIL = 32768.0      # the twin's fp16 outputs stay below this (1 bit of margin)
FIRST = 20          # the scaler's opening search
MAX_BACKOFFS = 2    # after it


# --- the models ---------------------------------------------------------------------------------------------------

class Gain(nn.Module):
    """x * exp(g), g a learned scalar, in x's dtype (an fp16 output under autocast)."""

    def __init__(self, init):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(math.log(init)))

    def forward(self, x):
        return x * self.g.exp().to(x.dtype)


class GainNet(nn.Module):
    def __init__(self, init, d=16, h=32, act=nn.Tanh):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), act(), nn.Linear(h, 1))
        self.gain = Gain(init)

    def forward(self, x):
        return self.gain(self.body(x)).squeeze(-1)


class ScaledEmbedding(nn.Module):
    def __init__(self, n, d, std):
        super().__init__()
        self.emb = nn.Embedding(n, d)
        nn.init.normal_(self.emb.weight, std=std)
        self.mult = math.sqrt(d)

    def forward(self, t):
        return (self.emb(t) * self.mult).to(FP16)


class EmbNet(nn.Module):
    def __init__(self, n=512, d=1024, k=8):
        super().__init__()
        self.embed = ScaledEmbedding(n, d, std=2.5)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, k)

    def forward(self, t):
        return self.head(self.norm(self.embed(t).mean(1)))


class Scores(nn.Module):
    """Cosine attention scores q.k^T / (|q||k|) times a learned temperature exp(t), fp16."""

    def __init__(self, init):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(math.log(init)))

    def forward(self, q, k):
        q, k = F.normalize(q, dim=-1).to(FP16), F.normalize(k, dim=-1).to(FP16)
        return (q @ k.transpose(-1, -2)) * self.t.exp().to(FP16)


class Retrieval(nn.Module):
    def __init__(self, d=16, e=16, init=40.0):
        super().__init__()
        self.q, self.k = nn.Linear(d, e), nn.Linear(d, e)
        self.scores = Scores(init)

    def forward(self, x, keys):
        return self.scores(self.q(x), self.k(keys))


# --- the scenarios: each returns (model, optimizer, lr_factor(i) or None, data(i) -> (inputs, target), loss, steps)

def _adam(groups):
    return torch.optim.Adam(groups, betas=(0.9, 0.999))


def sc_learned_gain():
    torch.manual_seed(101)
    m = GainNet(600)
    w = torch.randn(16, generator=gen(101)) / 4
    opt = _adam([{"params": m.body.parameters(), "lr": 3e-3}, {"params": m.gain.parameters(), "lr": 0.06}])

    def data(i):
        x = torch.randn(64, 16, generator=gen(1000 + i))
        return (x,), 8000 * torch.tanh(x @ w)
    return m, opt, lambda i: 1.0 if i < 60 else 0.97 ** (i - 60), data, _mse(8000), 220


def sc_heavy_tailed():
    torch.manual_seed(102)
    m = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    t = torch.distributions.StudentT(3.0)
    W = torch.randn(16, 4, generator=gen(102))

    def data(i):
        torch.manual_seed(2000 + i)
        z = t.sample((64, 16)).clamp(-12, 12)
        return (z * 2500,), (torch.sign(z) @ W).argmax(1)
    opt = _adam([{"params": m.parameters(), "lr": 3e-4}])
    return m, opt, None, data, _ce, 300


def sc_staircase():
    torch.manual_seed(103)
    m = GainNet(400)
    w = torch.randn(16, generator=gen(103)) / 4
    opt = _adam([{"params": m.body.parameters(), "lr": 3e-3}, {"params": m.gain.parameters(), "lr": 0.05}])

    def data(i):
        x = torch.randn(64, 16, generator=gen(3000 + i))
        return (x,), 500 * 4 ** min(2, i // 80) * torch.tanh(x @ w)

    def loss(out, y):
        return F.mse_loss(out.float() / y.abs().max(), y / y.abs().max())
    return m, opt, lambda i: 0.5 ** ((i % 80) // 20), data, loss, 240


def sc_cyclic():
    torch.manual_seed(104)
    m = GainNet(1000)
    w = torch.randn(16, generator=gen(104)) / 4
    opt = _adam([{"params": m.body.parameters(), "lr": 3e-3}, {"params": m.gain.parameters(), "lr": 0.08}])

    def amp(i):
        return 1000 * 10 ** (0.5 - 0.5 * math.cos(2 * math.pi * i / 80))

    def data(i):
        x = torch.randn(64, 16, generator=gen(4000 + i))
        return (x,), amp(i) * torch.tanh(x @ w)

    def loss(out, y):
        s = y.abs().max()
        return F.mse_loss(out.float() / s, y / s)
    return m, opt, lambda i: 0.5 + abs(((i % 40) / 20) - 1), data, loss, 320


def sc_raw_regression():
    torch.manual_seed(105)
    m = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 1))
    w = torch.randn(8, generator=gen(105)) / math.sqrt(8)

    def data(i):
        x = torch.randn(128, 8, generator=gen(5000 + i))
        return (x,), (5000 + 800 * (x @ w)).unsqueeze(-1)
    opt = _adam([{"params": m.parameters(), "lr": 5e-2}])
    return m, opt, lambda i: 1.0 if i < 150 else 0.3, data, _mse(5000), 260


def sc_sqrt_d_embedding():
    torch.manual_seed(106)
    m = EmbNet()
    lab = torch.randint(0, 8, (512,), generator=gen(106))

    def data(i):
        t = torch.randint(0, 512, (32, 4), generator=gen(6000 + i))
        return (t,), lab[t[:, 0]]
    opt = torch.optim.AdamW(m.parameters(), lr=5e-2, weight_decay=0.01)
    return m, opt, None, data, _ce, 200


def sc_curriculum():
    torch.manual_seed(107)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    W = torch.randn(16, 4, generator=gen(107))

    def data(i):
        z = torch.randn(64, 16, generator=gen(7000 + i))
        return (z * 60 * 2 ** min(3, i // 40),), (z @ W).argmax(1)
    opt = _adam([{"params": m.parameters(), "lr": 1e-3}])
    return m, opt, None, data, _ce, 220


def sc_raw_pixels():
    torch.manual_seed(108)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                      nn.Linear(32, 4))
    proto = torch.rand(4, 3, 8, 8, generator=gen(108))

    def data(i):
        g = gen(8000 + i)
        y = torch.randint(0, 4, (32,), generator=g)
        img = (proto[y] * 0.6 + 0.4 * torch.rand(32, 3, 8, 8, generator=g)) * 255
        return (img.round(),), y
    opt = _adam([{"params": m.parameters(), "lr": 1e-3}])
    return m, opt, None, data, _ce, 200


def sc_attention_logits():
    torch.manual_seed(109)
    m = Retrieval()
    common = 4.0 * F.normalize(torch.randn(16, generator=gen(1090)), dim=0)   # keys nearly collinear
    keys = common + 0.05 * torch.randn(32, 16, generator=gen(109))

    def data(i):
        g = gen(9000 + i)
        y = torch.randint(0, 32, (64,), generator=g)
        return (keys[y] + 0.01 * torch.randn(64, 16, generator=g), keys), y

    def loss(out, y):
        return F.cross_entropy(out.float(), y, label_smoothing=0.1)
    with torch.no_grad():        # a frozen (pretrained) encoder, here the identity: only the temperature is fitted
        for lin in (m.q, m.k):
            lin.weight.copy_(torch.eye(16))
            lin.bias.zero_()
            lin.requires_grad_(False)
    opt = _adam([{"params": [m.scores.t], "lr": 0.1}])
    return m, opt, lambda i: min(1.0, (i + 1) / 40), data, loss, 200


def sc_rise_and_settle():
    torch.manual_seed(110)
    m = GainNet(300)
    w = torch.randn(16, generator=gen(110)) / 4
    opt = torch.optim.SGD([{"params": m.body.parameters(), "lr": 0.05},
                           {"params": m.gain.parameters(), "lr": 0.6}], momentum=0.9)

    def data(i):
        x = torch.randn(64, 16, generator=gen(10000 + i))
        return (x,), 6000 * torch.tanh(x @ w)
    return m, opt, None, data, _mse(6000), 240


def sc_settle_near_2e4():
    torch.manual_seed(111)
    m = GainNet(2000)
    w = torch.randn(16, generator=gen(111)) / 4
    opt = _adam([{"params": m.body.parameters(), "lr": 1e-3}, {"params": m.gain.parameters(), "lr": 0.03}])

    def data(i):
        x = torch.randn(64, 16, generator=gen(11000 + i))
        return (x,), 14000 * torch.tanh(x @ w)
    return m, opt, lambda i: 1.0 if i < 90 else 0.95 ** (i - 90), data, _mse(14000), 300


def _mse(scale):
    def loss(out, y):
        return F.mse_loss(out.float() / scale, y / scale)
    return loss


def _ce(out, y):
    return F.cross_entropy(out.float(), y)


SCENARIOS = {f.__name__[3:]: f for f in (
    sc_learned_gain, sc_heavy_tailed, sc_staircase, sc_cyclic, sc_raw_regression, sc_sqrt_d_embedding,
    sc_curriculum, sc_raw_pixels, sc_attention_logits, sc_rise_and_settle, sc_settle_near_2e4)}


# --- the loop -----------------------------------------------------------------------------------------------------

class Result:
    def __init__(self, losses, scales, params, peaks, w):
        self.losses, self.scales, self.params, self.peaks, self.w = losses, scales, params, peaks, w
        self.rep = w.report(replay=False) if w is not None else None

    def lines(self):
        return [f.one_line() for f in self.rep.findings]


def train(name, watched):
    """The scenario's loop: zero_grad -> autocast fp16 forward -> scaler.scale(loss).backward -> unscale_ -> clip ->
    scaler.step -> update -> lr. Unwatched: the test's own forward hooks note each module's fp16 output abs-max."""
    m, opt, lr_at, data, loss_fn, steps = SCENARIOS[name]()
    base = [g["lr"] for g in opt.param_groups]
    sc = torch.amp.GradScaler("cpu")
    peaks, handles = {}, []
    if not watched:
        def hook(n):
            def f(mod, args, out):
                if isinstance(out, torch.Tensor) and out.dtype == FP16:
                    peaks.setdefault(n, []).append(out.detach().abs().max().float().item())
            return f
        handles = [mod.register_forward_hook(hook(n)) for n, mod in m.named_modules() if n]
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc) if watched else None
    losses, scales = [], []
    try:
        for i in range(steps):
            if lr_at is not None:
                for g, b in zip(opt.param_groups, base):
                    g["lr"] = b * lr_at(i)
            args, y = data(i)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                loss = loss_fn(m(*args), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
    finally:
        if w is not None:
            w.close()
        for h in handles:
            h.remove()
    params = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return Result(losses, scales, params, peaks, w)


@functools.lru_cache(maxsize=None)
def twin(name):
    """The unwatched run, asserted healthy and near the max."""
    r = train(name, watched=False)
    assert all(map(math.isfinite, r.losses)), (name, r.losses)
    k = max(3, len(r.losses) // 10)
    assert sum(r.losses[-k:]) / k < 0.9 * sum(r.losses[:k]) / k, (name, r.losses[:k], r.losses[-k:])
    backoffs = [i for i, (a, b) in enumerate(zip(r.scales, r.scales[1:])) if b < a and i + 1 >= FIRST]
    assert len(backoffs) <= MAX_BACKOFFS, (name, backoffs)
    top = max(max(v) for v in r.peaks.values())
    assert NEAR <= top < CEIL, (name, {n: max(v) for n, v in r.peaks.items()})
    return r


check_stride = stride_sweep.check_stride


# Wrong reports found while writing this file: (scenario, mode) -> the reason (the exact false finding).
XFAIL: dict[tuple[str, str], str] = {}

MODES = ["default", "1", "4", "8", "32", "wander24", "wander3"]
# wanderN: the stride wandering (tests/stride_sweep.py install_wandering, seed N) as a loaded host's measurement moves
# it. CI's two-core machine, at the default watch, got `[warning] headroom_trend at gain step 28` on settle_near_2e4
# (4.1 bits left, 0.06 bits/step, forecast step 98; the gain levelled off at 1.1..2 bits for 240 steps), which
# no pinned stride reproduced; seed 24 does. The forecast step passed with 1.5 bits left, under REFUTED_BITS, so
# the warning stood (rules/headroomseries.py `_refuted` now drops a fall that stopped at PLATEAU_BITS or more and
# stayed there, past the forecast step as before it).
# stride 4: CI's two-core machine chose it by budget, and staircase then got `[warning] headroom_trend at gain
# step 174` (3.3 bits left; the climb after the x4 target stopped 1.2 bits closer and stayed there 55 steps)


def _params():
    out = []
    for n in SCENARIOS:
        for mode in MODES:
            marks = [wrong(XFAIL[(n, mode)])] if (n, mode) in XFAIL else []
            out.append(pytest.param(n, mode, marks=marks, id=f"{n}-{mode}"))
    return out


@pytest.mark.parametrize("name,mode", _params())
def test_healthy_near_max_is_quiet(name, mode, monkeypatch):
    ref = twin(name)
    if mode.startswith("wander"):
        stride_sweep.install_wandering(int(mode[6:]), patch=monkeypatch.setattr)
    elif mode != "default":
        stride_sweep.install(int(mode), patch=monkeypatch.setattr)
    r = train(name, watched=True)
    assert r.losses == ref.losses, name                              # bitwise, step by step
    assert r.params.keys() == ref.params.keys()
    for k, v in ref.params.items():
        assert torch.equal(r.params[k], v), (name, k)
    assert r.rep.summary["steps"] >= len(ref.losses) - 1, r.rep.summary
    if mode.isdigit():
        check_stride(r.w, int(mode))
    bad = alarms(r.rep.findings) + [f.one_line() for f in r.rep.findings if f.rule == "headroom_trend"]
    if bad or r.rep.exit_code != 0:
        raise WrongAnswer(f"false finding on a healthy run ({name}, stride {mode}): {bad}; all: {r.lines()}")
