"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`; a few also at
`headroom=True`, the early-warning series on every step), fifteenth set: TRAINING DYNAMICS that look alarming to
trend- and skip-based rules but are normal. Learning rates that jump back up by design, data that gets harder in
the middle of the run, inputs whose size grows in stages, a loss scale that grows and backs off every ~20 steps,
gradients that shrink near convergence, weight decay pulling a layer down, fp32 statistics that grow without
bound, a GAN whose losses oscillate. `update_spike`, `headroom_trend`, `skipped_steps`, `underflow` and
`loss_scale_collapse` must all stay silent (no warning, no error; info is fine).

Tiny models (widths 16-64), 150-300 steps each, fixed seeds, one intra-op thread, CPU fp16 autocast +
`torch.amp.GradScaler("cpu", ...)`. Not covered by tests/test_healthy_long.py, test_healthy_trend3.py,
test_healthy_skips.py, test_healthy_headroom_long.py or test_early_warning*.py (checked): their lr schedules are
warmup+cosine, step decays, a triangular cycle and one OneCycle on a transformer; their data shifts are a single
input x100 jump, a drift with renormalisation and a sequence length under a sum pool; their GradScaler growth runs
have one optimizer and no accumulation.

Every run goes through one loop (`fit`): zero_grad -> `accum` micro-batches, each forward under autocast and
`scaler.scale(loss / accum).backward()` -> unscale_ -> clip_grad_norm_ (where said) -> scaler.step -> update ->
sched.step(). The test's own oracle (`Probe`: forward hooks on every leaf module, a tensor hook on each output for
its gradient) records per step the abs-max of every module's output (any dtype) and of the UNSCALED gradient into
it, and the share of the nonzero fp16 gradient elements below fp16's normal range (6.1e-5, at the scale used).
Each run is first asserted healthy (`Result.healthy`): every loss finite; the mean of the last k losses below a
stated factor of the first k (the data-shift run: recovered below half its jump); every skipped step (the
scale went down at that update) is in GradScaler's first search (no step applied yet, at most 6 halvings unless
said), or a single PROBE (a skip at a scale a growth had just reached, held for fewer than growth_interval clean
steps, after which the scale is back at the proven one: GradScaler's design), or one of the few single ordinary
backoffs allowed per case (none unless said); never two skips running after the first search; every parameter finite at the end; the largest module output
over the run stays below a stated bound, giving the margin to 65504 (asserted per case, >= 3 bits); plus what
makes the case what it is (below). Then the report must have no warning and no error, exit code 0, and ampdoctor
did not switch itself off (`summary.internal_error`).

Cases (11 tests, 12 runs; the bound asserted on every module output is 4096 (4 bits below 65504) unless said):
 1. warm_restarts_adamw: an MLP regressor on raw features of scale 150 (first layer abs-max > 256, inside the
    early warning's 8 bits), AdamW (lr 3e-3, wd 0.01), `CosineAnnealingWarmRestarts(T_0=50)`: the lr jumps back
    up >= 300x at steps 50, 100, 150, 200 (SGDR, Loshchilov & Hutter 2017); 250 steps;
 2. warm_restarts_sgd_tmult: a BatchNorm conv net on 8x8 bar images, SGD nesterov momentum 0.9 lr 0.1, wd 5e-4,
    `CosineAnnealingWarmRestarts(T_0=20, T_mult=2)` (restarts, >= 20x, at 20, 60, 140), 150 steps (SGD: the
    Adam bound on an update's size in update_spike does not apply);
 3. onecycle_sgd_25x: an MLP classifier with BatchNorm, SGD under `OneCycleLR(max_lr=0.4, div_factor=25,
    pct_start=0.3)` (cycling momentum 0.95 -> 0.85; the super-convergence recipe): the lr rises 25x over 60
    steps, then anneals; 200 steps;
 4. swa_lr_jump: AdamW under cosine decay to 1e-5 by step 150, then `torch.optim.swa_utils.SWALR(swa_lr=1e-3)`
    raising it >= 50x within 10 steps while an `AveragedModel` (not watched) averages the weights (torchvision's
    SWA recipe); 220 steps;
 5. curriculum_harder_data_at_100 [default and headroom=True]: regression on raw sensor-scale inputs (x200); at
    step 100 the data switches to a harder distribution (inputs x2, plus a 5x higher-frequency target term): the
    loss jumps > 3x (0.47 -> 1.75) and the first layer's abs-max 1.6-2.5x in one step (above 256 before it), then
    the loss recovers below half its jump by the end (250 steps); bound 8192 (3 bits);
 6. deepsets_growing_set_size: a DeepSets regressor (phi MLP, SUM pooling, rho MLP; Zaheer et al. 2017)
    predicting a set's total mass, with a set-size curriculum 16 -> 32 -> 64 points at steps 80 and 160: the
    pooled features (rho's first layer), the targets and the gradients grow step-wise (>= 1.5x per stage); the
    default GradScaler backs off singly as they grow (skips after the first search, measured: 5, 12, 20, 94,
    162; <= 8 single backoffs asserted, the scale >= 256); 240 steps; bound 8192;
 7. gradscaler_growth_20_accum: GradScaler(growth_interval=20) with 2-way gradient accumulation and clip 1.0,
    300 steps: the scale doubles every 20 clean steps to 2**20, then a probe skip every ~21 steps (>= 6 probes:
    a single skip at a scale a growth just reached, the scale back to the proven one) and <= 3 single ordinary
    backoffs (measured skips 81, 102, 125, 146, 151, 177, 219, 240, 261, 268);
 8. finetune_near_convergence: a checkpoint near its optimum (a realisable teacher's weights perturbed by ~10%),
    fine-tuned in fp16 with GradScaler(init_scale=2**12, growth_interval=25) under Adam lr 1e-3 cosine: the loss
    falls >= 20x to ~7e-6, the unscaled gradient into the hidden layer shrinks >= 3x (~4x) while the scale grows
    without a skip to >= 2**20, keeping the fp16 gradients representable (subnormal share of nonzero elements
    < 5% on every step; measured max 3.3%, < 1% late); 250 steps;
 9. weight_decay_shrinks_layer: a hand-initialised MLP (weights `torch.randn`, no fan-in scaling: a layer at
    ~3.3e3) under AdamW lr 5e-3 wd 1.5: the first layer's abs-max shrinks >= 4x (~175 -> ~33) over 250 steps
    while the loss falls; GradScaler's first search takes 8 halvings (<= 10 asserted); bound 8192;
10. fp32_running_stats [headroom=True]: an RL-style observation normaliser (RunningMeanStd: count, mean, M2 in
    fp32/fp64 buffers, Welford's update) on raw observations ~500 +- 200, plus a step-counter buffer feeding an
    fp32 time feature, plus an fp32 buffer accumulating the squared gradient norm (x1e6) after each step: M2 grows
    past 1e8, the count to 19200 and the accumulator past 65504, all fp32-only; the fp16 layers stay < 100;
11. gan_one_scaler_growth_20: a GAN on a 2-D ring, D then G, two Adam optimizers, ONE GradScaler
    (growth_interval=20) updated once per iteration, the whole GAN watched with D's optimizer: the
    discriminator's loss oscillates (std over the last 150 iterations > 0.05, max < 3), G's samples reach the ring
    (mean distance halves); >= 5 probes, <= 3 single backoffs; 300 iterations.
Tried and not kept: a learnable per-feature input gain meant to grow during a 100-step warmup and then settle
(Adam moved it down instead: no growth to test).

Results: every run quiet, the same on the default oneDNN ISA and with ONEDNN_MAX_CPU_ISA=AVX2 /
AVX512_CORE_BF16 (~13-16 s in all). The growth-interval runs (7, 11) get one `info` skipped_steps ("a normal rate
for dynamic loss scaling"; the GAN's counts both optimizers' steps: 21 of 600).

What ampdoctor got wrong: nothing here; no xfails.

Right: lr jumps by design (SGDR restarts x1000 under AdamW and x20+ under SGD, OneCycle's 25x rise, SWALR's 100x
rise after a cosine decay) are no update_spike; a mid-run switch to harder data (loss x3.7, activations x2 in one
step) and a set-size curriculum doubling sum-pooled features are no headroom_trend (also at headroom=True); the
scaler's periodic probes with gradient accumulation or two optimizers, and single backoffs at curriculum stage
switches, are no skipped_steps/loss_scale_collapse warning; gradients shrinking near convergence under a growing
scale are no underflow; a layer shrinking under weight decay, fp32 statistics far above 65504, and an oscillating
GAN loss are silent.
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

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, lines, one_thread, quiet_watch  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = torch.float16
TINY = 2.0 ** -14  # fp16's smallest normal


# -- the test's own oracle ------------------------------------------------------------------------------------------

class Probe:
    """Forward hooks on every leaf module: per step, the abs-max of its output (any float dtype), and, through a
    tensor hook on that output, the abs-max of the unscaled gradient into it and the share of subnormal nonzero
    elements of the fp16 gradient (as the backward saw it: scaled)."""

    def __init__(self, model):
        self.step, self.scale = 0, 1.0
        self.out: dict[str, dict[int, float]] = {}
        self.grad: dict[str, dict[int, float]] = {}
        self.sub: dict[int, float] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules()
                        if not list(m.children())]

    def _hook(self, name):
        def f(mod, args, out):
            if not (torch.is_tensor(out) and out.is_floating_point()):
                return
            a = out.detach().abs().max().item() if out.numel() else 0.0
            d = self.out.setdefault(name, {})
            d[self.step] = max(d.get(self.step, 0.0), a)
            if out.requires_grad:
                out.register_hook(self._ghook(name))
        return f

    def _ghook(self, name):
        def g(grad):
            s, step = self.scale, self.step
            a = grad.detach().abs().max().item() / s
            d = self.grad.setdefault(name, {})
            d[step] = max(d.get(step, 0.0), a)
            if grad.dtype == FP16:
                nz = grad != 0
                n = int(nz.sum())
                if n:
                    share = float((nz & (grad.abs() < TINY)).sum()) / n
                    self.sub[step] = max(self.sub.get(step, 0.0), share)
        return g

    def close(self):
        for h in self.handles:
            h.remove()

    def series(self, name, kind="out"):
        d = (self.out if kind == "out" else self.grad)[name]
        return [d.get(i, float("nan")) for i in range(max(d) + 1)]

    def overall_max(self):
        return max(v for d in self.out.values() for v in d.values())


class Result:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def skips(self):
        return [i for i, (u, a) in enumerate(zip(self.used, self.after)) if a < u]

    def designed_skips(self, growth_interval=None):
        """Sorts the skips after GradScaler's first search (before any applied step) into PROBES (a single skip at
        a scale a growth just reached, held for fewer than growth_interval clean steps, the scale then back at the
        proven one) and ordinary BACKOFFS (a single skip, the scale halved, the next step applied). Two skips in
        a row after the first search are neither (asserted). Returns (probes, backoffs)."""
        first_good = next(i for i, (u, a) in enumerate(zip(self.used, self.after)) if a >= u)
        skips = self.skips()
        probes, backoffs = [], []
        for i in skips:
            if i < first_good:
                continue
            assert i + 1 not in skips, (i, skips)  # a single skip
            j = i
            while j > 0 and self.used[j - 1] == self.used[i]:
                j -= 1
            if (growth_interval and j > first_good and self.used[j] > self.used[j - 1] and i - j < growth_interval
                    and self.after[i] == self.used[j - 1]):
                probes.append(i)
            else:
                backoffs.append(i)
        return probes, backoffs

    def healthy(self, *, k=20, fall=0.5, bound=4096.0, growth_interval=None, max_first=6, max_backoffs=0):
        """Finite losses, the loss fell (last k below `fall` x first k), GradScaler's first search took at most
        `max_first` halvings, after it only probes (with `growth_interval`) and at most `max_backoffs` single
        ordinary backoffs, the scale never below 1, every parameter finite, every module output below `bound`."""
        assert all(map(math.isfinite, self.losses)), self.losses
        first, last = sum(self.losses[:k]) / k, sum(self.losses[-k:]) / k
        assert last < fall * first, (first, last)
        first_good = next(i for i, (u, a) in enumerate(zip(self.used, self.after)) if a >= u)
        assert first_good <= max_first, self.used[:10]
        assert min(self.used) >= 1.0
        self.probes, self.backoffs = self.designed_skips(growth_interval)
        assert len(self.backoffs) <= max_backoffs, (self.backoffs, self.probes)
        assert all(torch.isfinite(p).all() for p in self.model.parameters())
        top = self.probe.overall_max()
        assert top < bound, (top, bound)   # margin to 65504: log2(65504 / bound) bits at least
        return self


def fit(model, batch, loss_fn, *, steps, opt, sched=None, scaler_kw=None, clip=None, accum=1, headroom=None,
        per_step=None):
    """The loop; `batch(i, j)` gives step i's micro-batch j; `per_step(i)` runs after sched.step() (no_grad).
    Returns a Result with the watch, its report, losses, the scale used at each step and the scale after it."""
    torch.manual_seed(0)
    sc = torch.amp.GradScaler("cpu", **(scaler_kw or {}))
    probe = Probe(model)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, headroom=headroom)
    losses, used, after, lrs = [], [], [], []
    for i in range(steps):
        probe.step, probe.scale = i, sc.get_scale()
        opt.zero_grad(set_to_none=True)
        tot = 0.0
        for j in range(accum):
            args = batch(i, j)
            with torch.autocast("cpu", dtype=FP16):
                loss = loss_fn(model, *args)
            sc.scale(loss / accum).backward()
            tot += loss.item() / accum
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lrs.append(opt.param_groups[0]["lr"])
        used.append(sc.get_scale())
        sc.step(opt)
        sc.update()
        after.append(sc.get_scale())
        if sched is not None:
            sched.step()
        if per_step is not None:
            with torch.no_grad():
                per_step(i)
        losses.append(tot)
    w.close()
    probe.close()
    return Result(model=model, w=w, probe=probe, losses=losses, used=used, after=after, lrs=lrs, scaler=sc)


def judge(res):
    """No warning or error, exit code 0, ampdoctor watched the whole run and counted every step."""
    rep = quiet_watch(res.w, internal=True)
    assert rep.exit_code == 0, lines(rep)
    assert len(res.w.steps) == len(res.losses)
    return rep


def mlp(*sizes, act=nn.GELU, bn=False):
    layers = []
    for a, b in zip(sizes[:-2], sizes[1:-1]):
        layers += [nn.Linear(a, b)] + ([nn.BatchNorm1d(b)] if bn else []) + [act()]
    return nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1]))


def huber(beta):
    return lambda m, x, y: F.smooth_l1_loss(m(x).float(), y, beta=beta)


def ce(m, x, y):
    return F.cross_entropy(m(x).float(), y)


def teacher(d_in, d_out=1, seed=1, scale=1.0):
    torch.manual_seed(seed)
    t = mlp(d_in, 32, d_out, act=nn.Tanh)
    return lambda x: t(x / scale).detach()


# -- 1-4. lr schedules that raise the lr by design ------------------------------------------------------------------

def test_cosine_warm_restarts_adamw_lr_jumps_x1000_every_50_steps():
    torch.manual_seed(0)
    model = mlp(12, 48, 48, 1)
    t = teacher(12, scale=150.0)

    def batch(i, j):
        x = 150.0 * torch.randn(64, 12, generator=gen(i % 40))  # 40 batches, reshuffled-epoch style repeats
        return x, 3.0 * t(x)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=50)
    res = fit(model, batch, huber(1.0), steps=250, opt=opt, sched=sched, clip=1.0).healthy(fall=0.3)
    for s in (50, 100, 150, 200):
        assert res.lrs[s] > 300 * res.lrs[s - 1], (s, res.lrs[s - 1], res.lrs[s])
    assert res.probe.overall_max() > 256  # inside the early warning's 8 bits
    judge(res)


class SmallConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.f(x))


def bars(i, n=32, size=8, scale=1.0):
    """Images of a bar in one of 4 orientations plus noise; label = orientation."""
    g = gen(10_000 + i)
    y = torch.randint(0, 4, (n,), generator=g)
    img = 0.3 * torch.randn(n, 1, size, size, generator=g)
    c = size // 2
    for k in range(n):
        o = int(y[k])
        if o == 0:
            img[k, 0, c, :] += 1
        elif o == 1:
            img[k, 0, :, c] += 1
        elif o == 2:
            img[k, 0].diagonal().add_(1)
        else:
            img[k, 0].flip(0).diagonal().add_(1)
    return img * scale, y


def test_sgd_warm_restarts_t_mult_2_conv_bn():
    torch.manual_seed(0)
    model = SmallConv()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=20, T_mult=2)
    data = [bars(i, n=16) for i in range(50)]
    res = fit(model, lambda i, j: data[i % 50], ce, steps=150, opt=opt, sched=sched).healthy(fall=0.3)
    for s in (20, 60, 140):
        assert res.lrs[s] > 20 * res.lrs[s - 1], (s, res.lrs[s - 1], res.lrs[s])
    judge(res)


def test_onecycle_sgd_lr_rises_25x_then_anneals():
    torch.manual_seed(0)
    model = mlp(16, 64, 64, 5, act=nn.ReLU, bn=True)
    t = teacher(16, 5, seed=3)

    def batch(i, j):
        x = torch.randn(64, 16, generator=gen(20_000 + i % 60))
        return x, t(x).argmax(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.4, total_steps=200, pct_start=0.3, div_factor=25)
    res = fit(model, batch, ce, steps=200, opt=opt, sched=sched).healthy(fall=0.3)
    assert max(res.lrs) > 24 * res.lrs[0] and res.lrs.index(max(res.lrs)) in range(55, 65), res.lrs[::10]
    judge(res)


def test_swa_lr_raises_the_lr_100x_after_cosine_decay():
    torch.manual_seed(0)
    model = mlp(12, 48, 48, 1)
    t = teacher(12, scale=20.0)

    def batch(i, j):
        x = 20.0 * torch.randn(64, 12, generator=gen(30_000 + i % 40))
        return x, 2.0 * t(x)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=150, eta_min=1e-5)
    swa_model = torch.optim.swa_utils.AveragedModel(model)
    swa_sched = torch.optim.swa_utils.SWALR(opt, swa_lr=1e-3, anneal_epochs=5, anneal_strategy="linear")

    class Sched:  # torchvision's SWA recipe: the base schedule, then SWALR + averaging from swa_start
        def step(self, i=[0]):
            i[0] += 1
            if i[0] < 150:
                cos.step()
            else:
                swa_model.update_parameters(model)
                swa_sched.step()
    res = fit(model, batch, huber(1.0), steps=220, opt=opt, sched=Sched(), clip=1.0).healthy(fall=0.3)
    assert res.lrs[160] > 50 * res.lrs[149], (res.lrs[149], res.lrs[160])
    assert swa_model.n_averaged.item() >= 60
    judge(res)


# -- 5-6. data that changes mid-run ---------------------------------------------------------------------------------

@pytest.mark.parametrize("headroom", [None, True], ids=["default", "headroom"])
def test_curriculum_switch_to_harder_data_at_step_100(headroom):
    torch.manual_seed(0)
    model = mlp(8, 48, 48, 1)
    easy, hard = teacher(8, seed=5, scale=200.0), teacher(8, seed=6, scale=50.0)

    def batch(i, j):
        g = gen(40_000 + i)
        if i < 100:
            x = 200.0 * torch.randn(64, 8, generator=g)
            return x, easy(x)
        x = 400.0 * torch.randn(64, 8, generator=g)
        return x, easy(x) + 5.0 * hard(x)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    res = fit(model, batch, huber(1.0), steps=250, opt=opt, clip=1.0, headroom=headroom)
    L = res.losses
    pre, jump, end = sum(L[90:100]) / 10, sum(L[100:105]) / 5, sum(L[-20:]) / 20
    assert pre < 0.3 * sum(L[:10]) / 10 and jump > 3 * pre and end < 0.5 * jump, (pre, jump, end)
    a = res.probe.series("0")
    assert 1.6 < (sum(a[100:110]) / 10) / (sum(a[90:100]) / 10) < 2.5, (a[90:100], a[100:110])
    res.healthy(fall=1.0, bound=8192.0)  # the loss recovered (asserted above); skips, finiteness, bound
    assert a[99] > 256
    judge(res)


class DeepSets(nn.Module):
    def __init__(self):
        super().__init__()
        self.phi = mlp(4, 32, 32, act=nn.ReLU)
        self.rho = mlp(32, 32, 1, act=nn.ReLU)

    def forward(self, x):                       # (B, N, 4) -> (B, 1)
        return self.rho(torch.relu(self.phi(x)).sum(1))


def test_deepsets_set_size_curriculum_16_32_64_sum_pool():
    torch.manual_seed(0)
    model = DeepSets()

    def batch(i, j):
        n = 16 if i < 80 else 32 if i < 160 else 64
        g = gen(50_000 + i)
        pts = torch.randn(32, n, 4, generator=g)
        mass = 1.0 + 0.5 * torch.sigmoid(pts[..., 0] * pts[..., 1])   # each point's mass 5-8
        return pts, mass.sum(1, keepdim=True)                        # the set's total mass ~100-500
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    res = fit(model, batch, huber(1.0), steps=240, opt=opt, clip=1.0)
    rel = [l / (16 if i < 80 else 32 if i < 160 else 64) for i, l in enumerate(res.losses)]
    assert sum(rel[-20:]) / 20 < 0.3 * sum(rel[:20]) / 20, (rel[:20], rel[-20:])
    res.healthy(fall=10.0, bound=8192.0, max_backoffs=8)
    assert min(res.used) >= 256, res.used[::10]
    o = res.probe.series("rho.0")
    stage = [sum(o[s - 10:s]) / 10 for s in (80, 160, 240)]
    assert stage[1] > 1.5 * stage[0] and stage[2] > 1.5 * stage[1], stage
    judge(res)


# -- 7-8. GradScaler dynamics -----------------------------------------------------------------------------------------

def test_gradscaler_growth_interval_20_with_accumulation_probes_every_21_steps():
    torch.manual_seed(0)
    model = mlp(16, 64, 64, 8)
    t = teacher(16, 8, seed=7)

    def batch(i, j):
        x = torch.randn(32, 16, generator=gen(60_000 + 2 * i + j))
        return x, t(x).argmax(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    res = fit(model, batch, ce, steps=300, opt=opt, clip=1.0, accum=2,
              scaler_kw=dict(init_scale=2.0 ** 16, growth_interval=20)).healthy(fall=0.5, growth_interval=20, max_backoffs=3)
    assert len(res.probes) >= 6, (res.probes, res.used[::20])
    judge(res)


def test_finetune_near_convergence_gradients_shrink_while_the_scale_grows():
    torch.manual_seed(0)
    torch.manual_seed(9)
    tnet = mlp(8, 32, 1, act=nn.Tanh).requires_grad_(False)
    model = copy.deepcopy(tnet).requires_grad_(True)
    with torch.no_grad():                       # a checkpoint near the optimum (weights perturbed by ~10%)
        for p in model.parameters():
            p.add_(0.1 * p.abs().mean() * torch.randn(p.shape, generator=gen(5)))
    t = lambda x: tnet(x)  # noqa: E731

    def batch(i, j):
        x = torch.randn(256, 8, generator=gen(70_000 + i % 50))
        return x, t(x)
    opt = torch.optim.Adam(model.parameters(), lr=FT_LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 250)
    res = fit(model, batch, lambda m, x, y: F.mse_loss(m(x).float(), y), steps=250, opt=opt, sched=sched,
              scaler_kw=dict(init_scale=2.0 ** 12, growth_interval=25)).healthy(fall=0.5, growth_interval=25)
    g = res.probe.series("1", "grad")           # the gradient into the Tanh's output
    g0, g1 = sum(g[:10]) / 10, sum(g[-10:]) / 10
    assert g0 > 3 * g1, (g0, g1)
    assert sum(res.losses[-10:]) < sum(res.losses[:10]) / 20, (res.losses[:10], res.losses[-10:])
    assert max(res.probe.sub.values()) < 0.05, res.probe.sub
    assert res.used[-1] >= 2.0 ** 20, res.used[::25]
    judge(res)


FT_LR = 1e-3


# -- 9-11. weights and statistics that move steadily --------------------------------------------------------------

def test_weight_decay_shrinks_an_overscaled_layer_4x():
    torch.manual_seed(0)
    model = mlp(16, 64, 64, 1, act=nn.ReLU)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn_like(m.weight))   # hand-written init, no fan-in scaling
    t = teacher(16, seed=11)

    def batch(i, j):
        x = 10.0 * torch.randn(64, 16, generator=gen(80_000 + i % 50))
        return x, 100.0 * t(x / 10.0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=1.5)
    res = fit(model, batch, huber(10.0), steps=250, opt=opt, clip=10.0).healthy(fall=0.5, bound=8192.0, max_first=10)
    a = res.probe.series("0")
    assert sum(a[:10]) / 10 > 4 * sum(a[-10:]) / 10, (a[:10], a[-10:])
    judge(res)


class ObsNorm(nn.Module):
    """RunningMeanStd (Welford) in fp32 buffers, as RL libraries normalise observations; plus a step counter
    and a sinusoidal time feature computed from it in fp32."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("m2", torch.zeros(d))
        self.register_buffer("t", torch.zeros(()))

    def forward(self, x):
        x = x.float()
        if self.training:
            with torch.no_grad():
                n, bm = x.shape[0], x.mean(0)
                delta = bm - self.mean
                tot = self.count + n
                self.mean += delta * n / tot.float()
                self.m2 += ((x - bm) ** 2).sum(0) + delta ** 2 * (self.count * n / tot).float()
                self.count.copy_(tot)
                self.t += 1
        var = self.m2 / self.count.clamp(min=1).float()
        z = ((x - self.mean) / (var + 1e-8).sqrt()).clamp(-10, 10)
        tf = torch.sin(self.t * 1e-3).expand(x.shape[0], 1)
        return torch.cat([z, tf], 1)


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = ObsNorm(8)
        self.body = mlp(9, 64, 64, 3, act=nn.Tanh)
        self.register_buffer("g2", torch.zeros(()))   # an EMA of the squared gradient norm (fp32 monitoring)

    def forward(self, x):
        return self.body(self.norm(x))


def test_fp32_running_statistics_grow_without_bound_headroom_every_step():
    torch.manual_seed(0)
    model = Agent()
    t = teacher(8, 3, seed=13, scale=200.0)

    def batch(i, j):
        x = 200.0 * torch.randn(64, 8, generator=gen(90_000 + i)) + 500.0
        return x, t(x - 500.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def per_step(i):  # after the step: the accumulated sum of squared (unscaled) gradients, fp32
        model.g2 += sum(p.grad.float().pow(2).sum() for p in model.body.parameters() if p.grad is not None) * 1e6
    res = fit(model, batch, lambda m, x, y: F.mse_loss(m(x).float(), y), steps=300, opt=opt, clip=1.0,
              headroom=True, per_step=per_step).healthy(fall=0.5, bound=2048.0 + 65504)
    # fp32 values far above 65504 (the raw observations' module input and the buffers); fp16 outputs small
    assert model.norm.m2.min().item() > 1e8 and model.norm.count.item() == 64 * 300
    assert model.g2.item() > 65504, model.g2.item()
    fp16_max = max(max(res.probe.out[n].values()) for n in res.probe.out if n.startswith("body"))
    assert fp16_max < 100, fp16_max
    judge(res)


# -- 12. GAN ---------------------------------------------------------------------------------------------------------

class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = mlp(8, 64, 64, 2, act=nn.ReLU)
        self.D = mlp(2, 64, 64, 1, act=lambda: nn.LeakyReLU(0.2))


def ring(n, i):
    g = gen(110_000 + i)
    a = torch.rand(n, generator=g) * 2 * math.pi
    return torch.stack([a.cos(), a.sin()], 1) * 2 + 0.05 * torch.randn(n, 2, generator=g)


def test_gan_two_optimizers_one_scaler_growth_interval_20_oscillating_d_loss():
    torch.manual_seed(0)
    gan = GAN()
    oD = torch.optim.Adam(gan.D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    oG = torch.optim.Adam(gan.G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler("cpu", growth_interval=20)
    w = ampdoctor.watch(gan, optimizer=oD, scaler=sc)
    z0 = torch.randn(512, 8, generator=gen(1))
    dist = lambda: (gan.G(z0).norm(dim=1) - 2).abs().mean().item()  # noqa: E731
    with torch.no_grad():
        d0 = dist()
    ld, lg, used, after = [], [], [], []
    for i in range(300):
        real, z = ring(128, i), torch.randn(128, 8, generator=gen(120_000 + i))
        used.append(sc.get_scale())
        oD.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = gan.G(z)
            dr, df = gan.D(real).float(), gan.D(fake.detach()).float()
            loss_d = F.binary_cross_entropy_with_logits(dr, torch.ones_like(dr)) + \
                F.binary_cross_entropy_with_logits(df, torch.zeros_like(df))
        sc.scale(loss_d).backward()
        sc.step(oD)
        oG.zero_grad()
        oD.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            dg = gan.D(fake).float()
            loss_g = F.binary_cross_entropy_with_logits(dg, torch.ones_like(dg))
        sc.scale(loss_g).backward()
        sc.step(oG)
        sc.update()
        after.append(sc.get_scale())
        ld.append(loss_d.item())
        lg.append(loss_g.item())
    w.close()
    with torch.no_grad():
        d1 = dist()
    assert all(map(math.isfinite, ld + lg))
    assert d1 < 0.5 * d0, (d0, d1)
    late = torch.tensor(ld[150:])
    assert late.std().item() > 0.05 and late.max().item() < 3.0, (late.std(), late.max())
    res = Result(used=used, after=after)
    probes, backoffs = res.designed_skips(20)
    assert len(probes) >= 5 and len(backoffs) <= 3, (probes, backoffs)
    assert all(torch.isfinite(p).all() for p in gan.parameters())
    assert used[-1] > 2.0 ** 16 or probes, used[::20]   # the scale really grew
    quiet_watch(w, internal=True)
