"""headroom_trend at a FIXED stride of the headroom series (1, 3, 8, 32): deterministic versions of the auto-sampled
runs whose series' points depend on the machine's load.

headroom="auto" puts the series on one routine step in `stride`, the stride chosen from timing (record/budget.py).
Here the stride is pinned: `budget.MAX_STRIDE = k` with `headroom_budget=1e-9` (any measured cost of the series is
over budget, so after the calibration at stride 2 the stride is the cap, k), and `headroom=True` for stride 1. The
budget's timing is made deterministic too (see _timed_ended: with the real clock a momentary cost <= 0 gives stride
1 for a step). The series' actual stride is asserted from the records, so a test never silently runs at another.

(1) HEALTHY runs whose activations legitimately grow or jump (each asserted healthy first: finite, falling or
bounded losses, no late skipped steps): no warning or error at any stride.
(2) REAL FAILURES that overflow fp16: the overflow is asserted to happen in the loop; `headroom_trend` must name the
growing layer (or its producer chain) >= 10 steps before the first inf at strides 1 and 3; at 8 and 32 only the
overflow itself must be reported at the right layer (a warning may come too late there: what happens is recorded).

Strict xfails mark what ampdoctor gets wrong at a stride (HEALTHY_XFAIL / FAILURE_XFAIL give what it reported);
two false headroom_trend warnings were (a one-time input jump at stride 8, a regression head following a one-time
change of the targets' units at stride 3) and are fixed. Every failure is forecast >= 10 steps before its first non-finite loss at
strides 1 and 3; at 8 and 32 the small GPT's warning does not come at all (the overflow itself is reported).
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
import ampdoctor.record.budget
from ampdoctor.config import WatchConfig

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import TinyGPT, alarms, gen, one_thread, randn  # noqa: E402
import stride_sweep  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16
STRIDES = [1, 3, 8, 32]


# --- the loop -------------------------------------------------------------------------------------------------

def _timed_ended(self):
    """HeadroomBudget.ended with a fixed measurement: a step carrying the series takes 2 units, one without it 1
    (the series costs 100%, over any budget). The real clock made the stride flaky even at headroom_budget=1e-9:
    a window where the steps with the series measured no slower than those without (cost <= 0) gives stride 1
    for a step, and the series at stride 32 came at gaps of 6, 1 and 4."""
    self.add(self.timed, None if self.timed is None or self.t0 is None else 2.0 if self.timed else 1.0)


def pin_stride(stride, monkeypatch):
    """watch() keywords that give the headroom series on every `stride`-th routine step."""
    if stride == 1:
        return {"headroom": True}
    monkeypatch.setattr(ampdoctor.record.budget, "MAX_STRIDE", stride)
    monkeypatch.setattr(ampdoctor.record.budget.HeadroomBudget, "ended", _timed_ended)
    return {"config": WatchConfig(headroom_budget=1e-9)}


class Run:
    def __init__(self, w, losses, scales, skipped, first_inf):
        self.w, self.losses, self.scales, self.skipped, self.first_inf = w, losses, scales, skipped, first_inf
        self.rep = w.report(replay=False)

    def trend(self):
        return [f for f in self.rep.findings if f.rule == "headroom_trend"]

    def lines(self):
        return [f.one_line() for f in self.rep.findings]


def fit(model, batch, loss_fn, *, stride, monkeypatch, steps, dtype=FP16, opt=None, lr=1e-3, sched=None, clip=1.0,
        init_scale=65536.0, after=None, extra=None, stop_after_inf=12):
    """zero_grad -> forward+loss under autocast(dtype) -> scale(loss).backward -> unscale_ -> clip -> step ->
    update -> sched.step -> after(i) (no_grad) -> extra(i), watched at a pinned stride. bf16: no scaler. The loop
    stops `stop_after_inf` steps after the first non-finite loss (the failure runs)."""
    torch.manual_seed(0)
    opt = opt(model) if callable(opt) else torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched) if sched else None
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == FP16 else None
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, **pin_stride(stride, monkeypatch))
    losses, scales, first_inf = [], [], None
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        args = batch(i)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, *args)
        (sc.scale(loss) if sc else loss).backward()
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
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
        if extra:
            extra(i)
        losses.append(loss.item())
        scales.append(sc.get_scale() if sc else 1.0)
        if first_inf is None and not math.isfinite(losses[-1]):
            first_inf = i
        if first_inf is not None and i >= first_inf + stop_after_inf:
            break
    w.close()
    skipped = [r.step for r in w.steps if r.skipped]
    check_stride(w, stride)
    return Run(w, losses, scales, skipped, first_inf)


def check_stride(w, stride):
    """The series really ran at `stride`: after the calibration (stride 2 up to step 7), two routine steps
    carrying it with only routine steps between them are `stride` apart (a sampled or bad step records everything
    and restarts the count; the routine step after it always carries the series)."""
    gaps = stride_sweep.series_gaps(w)
    on = [r.step for r in w.steps if r.headroom]
    if stride == 1:
        assert gaps <= {1}, on
    else:  # (or every step while an fp16 output near the max kept rising: record/budget.py `creep`)
        assert gaps and max(gaps) <= stride and (stride in gaps or w.machine.hr_hooks.budget.alerts), (stride, on)


def healthy(r, *, fall=None, bounded=None, first=20, max_late_skips=2):
    """The run was healthy: every loss finite; the mean loss of the last tenth below `fall` x that of the first
    tenth, or (with `bounded`) every loss after `first` steps below `bounded`; the scaler skipped no more than
    `max_late_skips` steps after its first `first` (its search for a scale) and its scale stayed >= 1."""
    losses = r.losses
    assert r.first_inf is None and all(map(math.isfinite, losses)), losses
    assert min(r.scales[first:]) >= 1.0, r.scales[first::10]
    k = max(1, len(losses) // 10)
    if fall is not None:
        assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, (losses[:k], losses[-k:])
    if bounded is not None:
        assert max(losses[first:]) < bounded, max(losses[first:])
    late = [s for s in r.skipped if s >= first]
    assert len(late) <= max_late_skips, r.skipped


def silent(r):
    assert alarms(r.rep.findings) == [] and r.rep.exit_code == 0, r.lines()


def huber(m, x, y, beta=100.0):
    return F.smooth_l1_loss(m(x).float().squeeze(-1), y, beta=beta)


def xf(stride, reason):
    return pytest.param(stride, marks=pytest.mark.xfail(strict=True, reason=reason))


def strides(**xfails):
    """STRIDES as parameters, `s3="..."` marking stride 3 a strict xfail with that reason."""
    return [xf(s, xfails[f"s{s}"]) if f"s{s}" in xfails else s for s in STRIDES]


def warmup_cosine(warm, total, floor=0.0):
    def f(s):
        if s < warm:
            return (s + 1) / warm
        p = min(1.0, (s - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def mlp(d_in, h, out, act=nn.GELU, norm=False):
    return nn.Sequential(nn.Linear(d_in, h), *([nn.LayerNorm(h)] if norm else []), act(), nn.Linear(h, h), act(),
                         nn.Linear(h, out))


W8 = randn(8, seed=71)
W84 = randn(8, 4, seed=72)


# --- (1) healthy runs ------------------------------------------------------------------------------------------

class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.price, self.volume = nn.Linear(64, 1), nn.Linear(64, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.price(h), self.volume(h)


def scenario(name, stride, mp):
    torch.manual_seed(0)
    return globals()["run_" + name](stride, mp)


def run_two_heads(stride, mp):
    """Two regression heads on raw targets: `price` ~ 300 +- 150 under an MSE, `volume` ~ 3000 +- 2000 under an L1;
    the heads at lr 0.1 (warmup 20 steps, cosine) grow from ~1 to their targets over the first ~50 steps, then fit."""
    def batch(i):
        x = torch.randn(64, 8, generator=gen(i))
        t = torch.tanh(x @ W8 / 3)
        return x, 300 + 150 * t, 3000 + 2000 * t

    def loss(m, x, yp, yv):
        p, v = m(x)
        return F.mse_loss(p.float().squeeze(-1), yp) / 100 + F.l1_loss(v.float().squeeze(-1), yv)
    m = TwoHeads()

    def opt(m):
        return torch.optim.AdamW([{"params": m.trunk.parameters(), "lr": 3e-3},
                                  {"params": [*m.price.parameters(), *m.volume.parameters()], "lr": 0.1}],
                                 weight_decay=0.0)
    return fit(m, batch, loss, stride=stride, monkeypatch=mp, steps=160, opt=opt, clip=None, init_scale=1024.0,
               sched=warmup_cosine(20, 160, 0.1))


def run_value_head(stride, mp):
    """A critic's value head following returns that grow as the policy improves (50 -> 2500 over ~100 steps,
    then a plateau): Adam, the head at lr 1 after a 50-step warmup, a Huber loss."""
    wv = randn(8, seed=5)

    def batch(i):
        x = torch.randn(48, 8, generator=gen(1000 + i))
        ret = 50 + 2450 * (1 - math.exp(-i / 35))
        return x, ret * (1 + 0.2 * torch.tanh(x @ wv))
    m = mlp(8, 48, 1, act=nn.Tanh, norm=True)

    def opt(m):
        return torch.optim.Adam([{"params": m[:-1].parameters(), "lr": 3e-3},
                                 {"params": m[-1].parameters(), "lr": 1.0}])
    return fit(m, batch, lambda m, x, y: huber(m, x, y, beta=50.0), stride=stride, monkeypatch=mp, steps=180,
               opt=opt, sched=lambda s: min(1.0, (s + 1) / 50), clip=None, init_scale=256.0)


def run_gain_fixed_point(stride, mp):
    """A learnable output gain (a bias-free Linear(1, 1) from 50) at lr 60 after a 20-step warmup, decaying by 0.97
    a step: it travels ~1500 in geometrically shrinking steps towards targets of ~1500 and stops there (a fixed
    point)."""
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1), nn.Tanh(), nn.Linear(1, 1, bias=False))
    nn.init.constant_(m[4].weight, 50.0)

    def batch(i):
        x = torch.randn(64, 8, generator=gen(2000 + i))
        return x, 1500 * torch.tanh(x @ W8 / 2)

    def opt(m):
        return torch.optim.Adam([{"params": m[:4].parameters(), "lr": 1e-2}, {"params": m[4].parameters(), "lr": 60.0}])
    return fit(m, batch, lambda m, x, y: huber(m, x, y, beta=50.0), stride=stride, monkeypatch=mp, steps=160,
               opt=opt, sched=lambda s: min(1.0, (s + 1) / 20) * 0.97 ** s, clip=None, init_scale=256.0)


def sensor_batch(jump_at, factor, n=64, d=8):
    """Raw sensor readings whose units change once (x `factor` from step `jump_at` on): 4 classes from the
    readings' direction, so the task is the same before and after."""
    def batch(i):
        z = torch.randn(n, d, generator=gen(3000 + i))
        y = (z[:, :8] @ W84).argmax(1)
        return z * (3.0 if i < jump_at else 3.0 * factor), y
    return batch


def ce(m, x, y):
    return F.cross_entropy(m(x).float(), y)


def run_sensor_units(stride, mp, dtype=FP16, factor=100.0):
    """A sensor's units change once at step 60 (metres -> centimetres: x100) and stay: the first Linear's output
    jumps ~6.6 bits in one step, to ~1e3, and sits there while the model adapts."""
    return fit(mlp(8, 64, 4), sensor_batch(60, factor), ce, stride=stride, monkeypatch=mp, steps=160, dtype=dtype,
               lr=2e-3)


def run_gpt_warmup_cosine(stride, mp):
    """A small transformer, positional embeddings initialised large (std 40) and LayerNorm gains of 50, lr warmup to 1e-2 over 25 steps then
    cosine decay: its projections' outputs grow while the lr rises, then settle."""
    m = TinyGPT(vocab=48, d=32, n=2, T=16)
    with torch.no_grad():
        m.pos.weight.mul_(40.0)
        for b in m.blocks:
            b.ln1.weight.fill_(50.0)
            b.ln2.weight.fill_(50.0)
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, 48, (16, 17), generator=g)

    def batch(i):
        rows = data[(torch.arange(4) + 4 * i) % 16]
        return rows[:, :-1], rows[:, 1:]
    return fit(m, batch, lambda m, x, y: m(x, y)["loss"], stride=stride, monkeypatch=mp, steps=150, lr=1e-2,
               sched=warmup_cosine(25, 150, 0.05), init_scale=1024.0)


class EmbedClassifier(nn.Module):
    def __init__(self, vocab=96, d=32, classes=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        nn.init.normal_(self.emb.weight, std=3.0)
        self.fc = nn.Linear(d, 64)
        self.head = nn.Linear(64, classes)

    def forward(self, idx):
        return self.head(F.gelu(self.fc(self.emb(idx).sum(1))))


def run_embedding_norm_wd(stride, mp):
    """Bag-of-tokens classifier (a sum over 32 tokens): the embedding norms grow under AdamW (lr 2e-2) and saturate
    where weight decay 0.1 balances the loss: the `fc` output grows slowly to ~1e2-1e3 and levels off."""
    g = torch.Generator().manual_seed(12)
    data = torch.randint(0, 96, (256, 32), generator=g)
    labels = data[:, :4].sum(1) % 8

    def batch(i):
        sel = torch.randint(0, 256, (32,), generator=gen(4000 + i))
        return data[sel], labels[sel]

    def opt(m):
        return torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
    return fit(EmbedClassifier(), batch, ce, stride=stride, monkeypatch=mp, steps=160, opt=opt)


def run_gan_discriminator(stride, mp):
    """A GAN on raw 2-d data around (600, -400): the watched discriminator's logits grow while it wins, then settle
    as the generator (fp32, its own optimizer, a step after each D step) catches up."""
    D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    og = torch.optim.Adam(G.parameters(), lr=2e-2, betas=(0.5, 0.999))
    centre = torch.tensor([600.0, -400.0])

    def batch(i):
        real = centre + 30 * torch.randn(64, 2, generator=gen(5000 + i))
        with torch.no_grad():
            fake = G(torch.randn(64, 4, generator=gen(6000 + i)))
        return real, fake

    def d_loss(D, real, fake):
        lr_, lf = D(real).float(), D(fake).float()
        return F.binary_cross_entropy_with_logits(lr_, torch.ones_like(lr_)) + \
            F.binary_cross_entropy_with_logits(lf, torch.zeros_like(lf))

    def g_step(i):
        og.zero_grad(set_to_none=True)
        out = D(G(torch.randn(64, 4, generator=gen(7000 + i))))
        F.binary_cross_entropy_with_logits(out, torch.ones_like(out)).backward()
        og.step()
        D.zero_grad(set_to_none=True)

    def opt(D):
        return torch.optim.Adam(D.parameters(), lr=5e-3, betas=(0.5, 0.999))
    return fit(D, batch, d_loss, stride=stride, monkeypatch=mp, steps=160, opt=opt, extra=g_step)


def run_normaliser_jump(stride, mp):
    """Linear -> LayerNorm -> ...: the Linear's input jumps x300 once at step 50 (a preprocessing change); its
    output jumps to ~1e3 and stays; the LayerNorm (fp32 under autocast) absorbs it."""
    return fit(mlp(8, 64, 4, norm=True), sensor_batch(50, 300.0), ce, stride=stride, monkeypatch=mp, steps=150,
               lr=2e-3)


class ResBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h):
        return h + self.f(h)   # the block's output is the (fp16) residual stream


class PreLN(nn.Module):
    def __init__(self, d=32, n=8):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(ResBlock(d) for _ in range(n))
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(self.ln(h))


def run_residual_preln(stride, mp):
    """A deep pre-LN MLP stack (8 blocks) at lr 1e-2: the residual stream grows with depth and over the first
    steps as every block adds its update, then levels off (the final LayerNorm makes the scale free)."""
    return fit(PreLN(), sensor_batch(0, 30.0), ce, stride=stride, monkeypatch=mp, steps=150, lr=1e-2,
               sched=warmup_cosine(10, 150, 0.1))


def run_single_head_mse(stride, mp):
    """One regression head on raw targets 100-500 under a plain MSE (scaled by 1/100), Adam lr 3e-2."""
    def batch(i):
        x = torch.randn(64, 8, generator=gen(8000 + i))
        return x, 300 + 200 * torch.tanh(x @ W8 / 3)
    return fit(mlp(8, 64, 1), batch, lambda m, x, y: F.mse_loss(m(x).float().squeeze(-1), y) / 100, stride=stride,
               monkeypatch=mp, steps=150, lr=3e-2, init_scale=1024.0)


def run_target_units_staircase(stride, mp):
    """A regression whose target units change twice (x2 at step 50, x2 again at 100: 800 -> 1600 -> 3200), a
    learnable head at lr 0.1 following each step (Huber)."""
    def batch(i):
        x = torch.randn(64, 8, generator=gen(9000 + i))
        return x, (800.0 * 2 ** (i // 50)) * (1 + 0.3 * torch.tanh(x @ W8 / 3))
    m = mlp(8, 64, 1, norm=True)

    def opt(m):
        return torch.optim.AdamW([{"params": m[:-1].parameters(), "lr": 3e-3},
                                  {"params": m[-1].parameters(), "lr": 0.1}], weight_decay=0.0)
    return fit(m, batch, huber, stride=stride, monkeypatch=mp, steps=150, opt=opt, clip=None, init_scale=256.0)


def run_sensor_units_bf16(stride, mp):
    """The sensor's units change (x100) in bf16: far from bf16's max, nothing to warn about."""
    return run_sensor_units(stride, mp, dtype=BF16, factor=100.0)


# --- (2) real failures -----------------------------------------------------------------------------------------

def run_grow_15(stride, mp):
    """A bug multiplies `body.2`'s weights by 1.15 after every step (0.2 bits/step): its output (and everything
    after it) climbs from ~4 to fp16's max in ~70 steps."""
    m = mlp(16, 64, 4)

    def after(i):
        m[2].weight.mul_(1.15)
    return fit(m, sensor_batch(10 ** 9, 1.0, d=16), ce, stride=stride, monkeypatch=mp, steps=200, lr=1e-3,
               after=after, init_scale=1024.0)


def run_gpt_lr_too_high(stride, mp):
    """A small GPT at lr 0.05 (Adam, no warmup, no clipping): its weights grow by ~lr a step and the activations
    climb until fp16 overflows."""
    m = TinyGPT(vocab=48, d=32, n=2, T=16)
    g = torch.Generator().manual_seed(13)
    data = torch.randint(0, 48, (16, 17), generator=g)
    peaks: list = []  # the blocks' largest output per forward (the climb the test's precondition asks for)
    for b in m.blocks:
        b.register_forward_hook(lambda mod, i, o: peaks.append(float(o.detach().abs().max())))

    def batch(i):
        rows = data[(torch.arange(4) + 4 * i) % 16]
        return rows[:, :-1], rows[:, 1:]
    r = fit(m, batch, lambda m, x, y: m(x, y)["loss"], stride=stride, monkeypatch=mp, steps=200, lr=0.2,
            clip=None, init_scale=1024.0)
    n = len(m.blocks)
    before = peaks[:n * r.first_inf] if r.first_inf is not None else peaks
    CLIMBED[("gpt_lr_too_high", stride)] = max((v for v in before if math.isfinite(v)), default=0.0)
    return r


CLIMBED: dict = {}  # scenario -> the largest finite block output before the first non-finite loss


class GainHead(nn.Module):
    """A learnable output scale: exp(log_gain) times its input (fp16 in, fp16 out)."""

    def __init__(self):
        super().__init__()
        self.log_gain = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x * self.log_gain.exp()


def run_regression_2e5(stride, mp):
    """A regression toward targets of ~2e5 (beyond fp16's 65504): a normalised body and a learnable output scale
    that Adam raises by ~lr a step (exponential growth of the output, 0.14 bits/step) until it overflows."""
    m = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1), GainHead())

    def batch(i):
        x = torch.randn(64, 8, generator=gen(11000 + i))
        return x, 2e5 * (1 + 0.1 * torch.tanh(x @ W8 / 3))

    def opt(m):
        return torch.optim.Adam([{"params": m[:4].parameters(), "lr": 1e-3}, {"params": m[4].parameters(), "lr": 0.1}])
    return fit(m, batch, lambda m, x, y: F.l1_loss(m(x).float().squeeze(-1), y), stride=stride, monkeypatch=mp,
               steps=200, opt=opt, clip=None, init_scale=256.0)


class Recurrent(nn.Module):
    def __init__(self, d=16, T=8):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.cell = nn.Linear(d, d, bias=False)
        nn.init.eye_(self.cell.weight)
        self.log_gain = nn.Parameter(torch.zeros(()))
        self.head = nn.Linear(d, 4)
        self.T = T

    def forward(self, x):
        u = self.inp(x)
        h = u
        for _ in range(self.T):
            h = torch.relu(self.cell(h) * self.log_gain.exp() + u)
        return self.head(h), h


def run_recurrent_feedback(stride, mp):
    """A recurrent cell unrolled 8 times with a learnable gain, and a sign bug in an activity term (it rewards the
    state's size instead of penalising it): positive feedback raises the gain every step and the state grows as
    gain^8 until `cell` overflows."""
    def loss(m, x, y):
        logits, h = m(x)
        return F.cross_entropy(logits.float(), y) - 0.1 * h.float().abs().mean()

    def opt(m):
        return torch.optim.Adam([{"params": [p for n, p in m.named_parameters() if n != "log_gain"], "lr": 1e-3},
                                 {"params": [m.log_gain], "lr": 0.02}])
    return fit(Recurrent(), sensor_batch(10 ** 9, 1.0), loss, stride=stride, monkeypatch=mp, steps=200, opt=opt,
               init_scale=256.0)


# --- the tests -------------------------------------------------------------------------------------------------

HEALTHY = {
    # name: keywords of healthy()
    "two_heads": dict(fall=0.2, max_late_skips=1),
    "value_head": dict(bounded=2500.0, first=30),
    "gain_fixed_point": dict(fall=0.2),
    "sensor_units": dict(bounded=20.0, max_late_skips=6),   # the scaler backs off once at the jump (step 60)
    "sensor_units_bf16": dict(bounded=20.0),
    "gpt_warmup_cosine": dict(fall=0.8),
    "embedding_norm_wd": dict(fall=0.5),
    "gan_discriminator": dict(bounded=100.0),
    "normaliser_jump": dict(fall=0.5),
    "residual_preln": dict(fall=0.5, max_late_skips=1),
    "single_head_mse": dict(fall=0.1, max_late_skips=1),
    "target_units_staircase": dict(bounded=2000.0, first=30),
}
HEALTHY_XFAIL = {}  # (name, stride): what ampdoctor reported
# (were strict xfails, fixed by headroom_trend's refutation of a fall that stopped: a one-time input jump at stride
# 8, warned at step 71 with the series flat at ~5 bits to the end; a head following a one-time change of its targets'
# units at stride 3, warned at step 124 and flat at 3.9-4.1 bits after)


def healthy_params():
    out = []
    for name in HEALTHY:
        for k in STRIDES:
            reason = HEALTHY_XFAIL.get((name, k))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(name, k, marks=marks, id=f"{name}-s{k}"))
    return out


@pytest.mark.parametrize("name,stride", healthy_params())
def test_healthy_growth_or_jump_is_silent_at_every_stride(name, stride, monkeypatch):
    r = scenario(name, stride, monkeypatch)
    healthy(r, **HEALTHY[name])
    assert not r.trend(), r.lines()
    silent(r)


FAILURES = {
    # name: (modules a headroom_trend may name: the growing layer or its producer chain (module or
    #        evidence.first_to_overflow), modules where the overflow itself must be reported)
    "grow_15": ({"2", "3", "4"}, {"2", "3", "4"}),
    "gpt_lr_too_high": (("blocks.",), ("blocks.",)),
    "regression_2e5": ({"4", ""}, {"4", ""}),
    "recurrent_feedback": ({"cell"}, {"cell", ""}),   # the unrolled recurrence's `* gain + u` is the root's own code
}
FAILURE_XFAIL = {}
LEAD = 10


def _named(module, names):
    return module in names if isinstance(names, set) else any(module.startswith(p) for p in names)


def failure_params():
    out = []
    for name in FAILURES:
        for k in STRIDES:
            reason = FAILURE_XFAIL.get((name, k))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(name, k, marks=marks, id=f"{name}-s{k}"))
    return out


@pytest.mark.parametrize("name,stride", failure_params())
def test_real_failure_is_forecast_before_the_overflow(name, stride, monkeypatch):
    trend_names, where = FAILURES[name]
    r = scenario(name, stride, monkeypatch)
    assert r.first_inf is not None, r.losses            # the overflow really happened in the loop
    peak = CLIMBED.get((name, stride))
    if peak is not None and peak < 2.0 ** 14:
        # the CPU's fp16 kernels decide the trajectory: on an AVX512-BF16 EPYC the blocks' outputs plateau near 1.3e4
        # and the run goes NaN inside attention without the climb this scenario is about (its update_spike at
        # step 0 still names the learning rate); the forecast is then not what is being tested
        pytest.skip(f"this CPU's run did not climb toward the fp16 max (blocks' peak {peak:.0f} < 2^14)")
    assert r.rep.exit_code == 1, r.lines()
    assert any(f.rule in ("overflow", "nan_origin") and f.severity == "error" and _named(f.module, where)
               for f in r.rep.findings), r.lines()
    hits = [f for f in r.trend() if _named(f.module, trend_names)
            or _named(f.evidence.get("first_to_overflow"), trend_names)]
    if stride <= 3:
        assert hits, r.lines()
        assert min(f.step for f in hits) <= r.first_inf - LEAD, (r.first_inf, r.lines())
