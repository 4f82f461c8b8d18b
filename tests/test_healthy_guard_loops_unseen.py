"""Healthy GradScaler loops WITH GUARDS AND EXTRA zero_grad CALLS, at ampdoctor's DEFAULT watch and at `every=1`:
can the `guard_skips` rule (rules/ownscale.py; optsink.discards_iteration: a zero_grad that clears inf/NaN
gradients after a scaled backward and before any unscale_/step of that iteration) or any other rule be made to give
a false warning/error on a loop that is correct?

Each case is a correct loop that zeroes gradients, or skips work, around a scaled backward; `ampdoctor.watch(model,
optimizer=..., scaler=..., run_dir=tmp_path / "run")` at the default sampling and again with `every=1`; CPU fp16
autocast with `torch.amp.GradScaler("cpu")` at its default init_scale 2**16 (so that the opening backoffs really
happen where a case says so), fixed seeds, one intra-op thread, 60-80 optimizer steps. Every case runs three times:
once UNWATCHED (shared by both modes) and once under each watch.

- The unwatched run carries the oracle, independent of ampdoctor (`healthy`; a failure is a plain failure): every
  loss finite but the NaN batches the case planted (which its own guard must have skipped: the weights did not
  change at them), the mean of the last 5 finite losses <= 0.9 x the first 5's, the scaler skipped only opening
  steps (every skip before step 8; `opening` > 0 where a case needs them: the skips really happened), every final
  weight finite.
- The watched run must train bitwise identically (probe_harness.same_run): the losses, the skipped steps, every
  final weight.
- Then w.report() after close() holds no warning and no error (probe_harness.quiet_healthy), exit code 0, and no
  `ampdoctor...` Python warning; otherwise WrongAnswer, a strict xfail (probe_harness.wrong) quoting ampdoctor.

The cases:
 1. nan_batches_guard_before_backward: a data pipeline whose batches 17 and 50 (of 80) hold a NaN; the loop checks
    `torch.isfinite(loss)` BEFORE the backward, calls `opt.zero_grad()` and skips the batch (no scaled backward).
 2. documented_guard_after_unscale: backward -> unscale_ -> if any gradient is inf/NaN: zero_grad, skip
    scaler.step but still call scaler.update() (the documented pattern); the opening backoffs hit the guard.
 3. grad_accum_4_zero_after_step: 4 micro-batches, each loss / 4 scaled and backwarded, zero_grad only after
    step/update; the opening micro-batches overflow.
 4. pcgrad_five_tasks: PCGrad (Yu et al.) on a shared trunk with five regression heads, 40 steps: each task's
    scaled loss backwarded (retain_graph), its gradients copied, zero_grad between tasks, the conflicting components
    projected out (random task order), the sum written back to `.grad`, then unscale_ -> clip -> step -> update.
    The opening iterations' task gradients overflow (steps 0-3: 5, 5, 4, 2 of the task backwards); their copies
    carry the inf into the written-back sum, so unscale_ finds it, scaler.step skips and update() backs off: the
    scaler saw every one of them.
 5. grad_noise_diagnostic: every 10 steps a scaled backward of a 2-sample batch for a gradient-noise-scale
    estimate (its gradient norm read / scale by hand), then zero_grad before the real step; the first diagnostic
    overflows at the opening scale.
 6. gan_one_scaler: a 2-D GAN (G: noise -> point, D: point -> logit) on one GradScaler: D step (scale -> backward
    -> scaler.step(optD)), then optG.zero_grad() and the G step (scale -> backward -> scaler.step(optG)), one
    update(); the watch gets the ModuleDict of both and optD. The real data sits far from the origin, so that D's
    opening gradients overflow and the scaler skips them.
 7. sam_two_updates: SAM (Foret et al., rho 0.05) with a GradScaler: scaled backward -> unscale_ -> (if not
    finite: zero_grad, update, skip) ascend to w + e(w) -> zero_grad -> update() -> scaled backward at the
    perturbed point -> restore w -> unscale_ -> clip -> step -> update: two backwards, two updates per step, an
    unscale_ in between; the opening backoffs hit the first half.
 8. opening_search_zero_at_start: the plain loop, zero_grad(set_to_none=False) at the iteration's start and again
    after update(), a loss large enough for several opening backoffs that scaler.step skips.

Result when written: 12 pass, 4 strict xfail (8 cases x {default, every=1}; now 16 pass: both fixed);
~10 s. Every watched run is bitwise identical to the unwatched one; the six other cases give info findings only
(overflow / skipped_steps "GradScaler skipped k of n steps; a normal rate"). The false findings (both modes alike):

- nan_batches_guard_before_backward: `[error] nan_origin at (run) step 17: The batch of step 17 already held 1 NaN
  (model input argument 0, 128 float32 values) when the model received it: the data, not a layer, brought the
  non-finite values; ...` (exit code 1). The fact is right, the verdict is not: the loop's own guard saw the NaN
  loss before any backward and skipped both planted batches (the weights did not change at 17 or 50, asserted),
  the run trained to 0.04; a handled bad batch is no error of the run (an info at most). Fixed since (the same
  session): with a GradScaler, a bad batch whose loss no scale() took (the loop scaled later micro-batches' losses
  and never this one's: record/readback.resolve, `bad_input["unscaled"]`) is an info finding that says the loop
  skipped it (rules/outside.bad_data_finding).
- pcgrad_five_tasks: `[warning] skipped_steps at (run) step 0: The loop threw away 16 of 56 iterations from step 0
  on, behind GradScaler's back: it zeroed their inf/NaN gradients after the scaled backward, before
  scaler.unscale_() / scaler.step(), so the scaler never saw them and scaler.update() never lowered the loss
  scale. ...`. False on every count: the 16 are PCGrad's per-task zero_grads in 4 iterations (not 16 iterations;
  there were 40, not 56), the copied gradients carried the inf into `.grad`, unscale_ found it, scaler.step
  skipped those 4 steps and update() lowered the scale 4 times (the same report's info says "GradScaler skipped
  4 of 40 steps"). optsink.discards_iteration counts any zero_grad that clears inf/NaN before unscale_, even when
  the iteration goes on to the scaler (it does not ask whether that iteration reaches unscale_/step), and counts
  one "iteration" per zero_grad. Fixed since (the same session): a GradScaler loop's thrown-away iteration is
  counted once per forward (record/optsink.discards_iteration), and rules/ownscale.py guard_skips says nothing when
  the scale came down after the first of them (the scaler saw the overflows itself).

Not false-alarmed (but worth knowing): grad_noise_diagnostic's 2-sample diagnostic backwards that overflow (steps
0, 20, 60) are counted as `discarded` too (3 < 5, so below the rule's floor; a diagnostic every step or two would
cross it); sam_two_updates' summary counts 117 "steps" for 60 iterations (one per update()), info only.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace as ns

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import HealthyLoop, healthy_run, quiet_healthy, same_run, wrong  # noqa: E402
from scenarios import lines, one_thread, randn  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
DEBUG = os.environ.get("HG_DEBUG") == "1"
CASES: dict = {}
XFAIL: dict[tuple[str, str], str] = {}
MODES = {"default": {}, "every1": {"every": 1}}
OPENING = 8


def case(steps, opening=False, planted=()):
    """Register a builder: `steps` iterations; `opening`: the scaler must really back off at the opening;
    `planted`: the iterations whose batch holds a NaN (their loss is NaN; the loop's guard skips them)."""
    def reg(fn):
        CASES[fn.__name__] = ns(build=fn, steps=steps, opening=opening, planted=tuple(planted))
        return fn
    return reg


def mlp(d_in, d_out, hid=32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hid), nn.Tanh(), nn.Linear(hid, d_out))


W_TRUE = randn(8, 6, seed=101)


def reg_batch(i, b=8, k=2, gain=3.0, cycle=8, seed=0):
    """A regression batch: y = gain * x @ W_TRUE[:, :k] (`cycle` distinct batches)."""
    x = randn(b, 8, seed=seed * 1000 + i % cycle)
    return x, gain * x @ W_TRUE[:, :k]


def mse(out, y):
    return F.mse_loss(out.float(), y)


def finite_grads(params):
    return all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)


# ------------------------------------------------------------------ 1. NaN batches, guard before the backward
@case(80, planted=(17, 50))
def nan_batches_guard_before_backward():
    m = mlp(8, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")

    def step(i):
        opt.zero_grad(set_to_none=True)
        x, y = reg_batch(i, b=16, gain=1.0)
        if i in (17, 50):
            x = x.clone()
            x[3, 2] = float("nan")           # a corrupt sample from the pipeline
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = mse(out, y)
        if not torch.isfinite(loss):         # the guard: before any scaled backward
            opt.zero_grad(set_to_none=True)
            return loss.item()
        sc.scale(loss).backward()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return loss.item()
    return HealthyLoop(m, opt, sc, step)


# ------------------------------------------------------------------ 2. the documented guard after unscale_
@case(80, opening=True)
def documented_guard_after_unscale():
    m = mlp(8, 2, seed=1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")

    def step(i):
        opt.zero_grad(set_to_none=True)
        x, y = reg_batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = mse(out, y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if not finite_grads(m.parameters()):  # skip the step, but let the scaler back off
            opt.zero_grad(set_to_none=True)
            sc.update()
            return loss.item()
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return loss.item()
    return HealthyLoop(m, opt, sc, step)


# ------------------------------------------------------------------ 3. gradient accumulation
@case(60, opening=True)
def grad_accum_4_zero_after_step():
    m = mlp(8, 2, seed=2)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")

    def step(i):
        tot = 0.0
        for k in range(4):
            x, y = reg_batch(4 * i + k, b=4, gain=3.0, cycle=32)
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
            loss = mse(out, y) / 4
            sc.scale(loss).backward()
            tot += loss.item()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)
        return tot
    return HealthyLoop(m, opt, sc, step)


# ------------------------------------------------------------------ 4. PCGrad
class MultiTask(nn.Module):
    def __init__(self, tasks=5):
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.heads = nn.ModuleList(nn.Linear(32, 2) for _ in range(tasks))

    def forward(self, x):
        h = self.trunk(x)
        return [hd(h) for hd in self.heads]


@case(40, opening=True)
def pcgrad_five_tasks():
    m = MultiTask()
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=3e-2)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(7)
    signs = [1.0, -0.5, 0.7, 1.5, -1.2]

    def step(i):
        opt.zero_grad(set_to_none=True)
        x, y = reg_batch(i, b=8, k=2, gain=4.0)
        with torch.autocast("cpu", dtype=torch.float16):
            outs = m(x)
        losses = [mse(o, s * y + t) for t, (o, s) in enumerate(zip(outs, signs))]
        flat = []
        for t, lt in enumerate(losses):
            sc.scale(lt).backward(retain_graph=t < len(losses) - 1)
            flat.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                   for p in params]).clone())
            opt.zero_grad(set_to_none=True)   # between tasks: each task's gradient on its own
        proj = []
        for a in range(len(flat)):
            gi = flat[a].clone()
            for b in torch.randperm(len(flat), generator=g).tolist():
                if b == a:
                    continue
                dot = gi @ flat[b]
                if dot < 0:
                    gi = gi - dot / (flat[b] @ flat[b]) * flat[b]
            proj.append(gi)
        total, off = torch.stack(proj).sum(0), 0
        for p in params:
            p.grad = total[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(params, 1.0)
        sc.step(opt)
        sc.update()
        return sum(lt.item() for lt in losses)
    return HealthyLoop(m, opt, sc, step)


# ------------------------------------------------------------------ 5. gradient-noise-scale diagnostic
@case(80, opening=True)
def grad_noise_diagnostic():
    m = mlp(8, 2, seed=4)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    est = []

    def gsq():
        return sum(float(p.grad.float().pow(2).sum()) for p in m.parameters() if p.grad is not None)

    def step(i):
        x, y = reg_batch(i, b=8, gain=3.0)
        small = None
        if i % 10 == 0:                      # B_small = 2: a scaled backward for the diagnostic only
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                ls = mse(m(x[:2]), y[:2])
            sc.scale(ls).backward()
            small = gsq() / sc.get_scale() ** 2
            opt.zero_grad(set_to_none=True)  # before the real backward
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = mse(out, y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if small is not None:
            big = gsq()
            est.append((small - big) / max(big, 1e-12) if math.isfinite(small) and math.isfinite(big) else None)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return loss.item()
    return HealthyLoop(m, opt, sc, step)


# ------------------------------------------------------------------ 6. GAN on one GradScaler
@case(80, opening=True)
def gan_one_scaler():
    torch.manual_seed(5)
    gd = nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2)),
                        "D": nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))})
    G, D = gd["G"], gd["D"]
    optD = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optG = torch.optim.Adam(G.parameters(), lr=5e-4, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler("cpu")
    center = torch.tensor([-60.0, 45.0])

    def step(i):
        real = center + 8 * randn(32, 2, seed=10_000 + i)
        z = randn(32, 4, seed=20_000 + i)
        optD.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            lr_, lf = D(real), D(fake.detach())
        lossD = (F.binary_cross_entropy_with_logits(lr_.float(), torch.ones_like(lr_, dtype=torch.float32))
                 + F.binary_cross_entropy_with_logits(lf.float(), torch.zeros_like(lf, dtype=torch.float32)))
        sc.scale(lossD).backward()
        sc.step(optD)
        optG.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            lg = D(fake)
        lossG = F.binary_cross_entropy_with_logits(lg.float(), torch.ones_like(lg, dtype=torch.float32))
        sc.scale(lossG).backward()
        sc.step(optG)
        sc.update()
        return lossD.item()
    return HealthyLoop(gd, optD, sc, step)


# ------------------------------------------------------------------ 7. SAM
@case(60, opening=True)
def sam_two_updates():
    m = mlp(8, 2, seed=6)
    params = list(m.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    sc = torch.amp.GradScaler("cpu")
    rho = 0.05

    def step(i):
        x, y = reg_batch(i, b=8, gain=3.0)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(m(x), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if not finite_grads(params):         # first half overflowed: skip the iteration, back off
            opt.zero_grad(set_to_none=True)
            sc.update()
            return loss.item()
        with torch.no_grad():
            gn = torch.stack([p.grad.norm() for p in params]).norm()
            eps = [rho * p.grad / (gn + 1e-12) for p in params]
            for p, e in zip(params, eps):
                p.add_(e)                    # ascend to w + e(w)
        opt.zero_grad(set_to_none=True)
        sc.update()
        with torch.autocast("cpu", dtype=torch.float16):
            loss2 = mse(m(x), y)
        sc.scale(loss2).backward()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)                    # back to w; step with the sharpness-aware gradient
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(params, 1.0)
        sc.step(opt)
        sc.update()
        return loss.item()
    return HealthyLoop(m, opt, sc, step)


# ------------------------------------------------------------------ 8. opening search skipped by scaler.step
@case(60, opening=True)
def opening_search_zero_at_start():
    m = mlp(8, 4, seed=8)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")

    def step(i):
        opt.zero_grad(set_to_none=False)
        x, y = reg_batch(i, b=4, k=4, gain=6.0)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = mse(out, y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=False)
        return loss.item()
    return HealthyLoop(m, opt, sc, step)


# ------------------------------------------------------------------ the runner and the checks
def run(name, mode=None, run_dir=None):
    """The case's loop: unwatched (mode None) or watched with MODES[mode]. Keeps whether the weights were the same
    before and after each planted iteration."""
    cs = CASES[name]
    planted_same = []

    def around(i, loop, step):
        before = [p.detach().clone() for p in loop.model.parameters()] if i in cs.planted else None
        loss = step(i)
        if before is not None:
            planted_same.append(all(torch.equal(a, p) for a, p in zip(before, loop.model.parameters())))
        return loss
    r = healthy_run(cs.build(), cs.steps, None if mode is None else MODES[mode], run_dir, around=around)
    r.planted_same = planted_same
    return r


@functools.lru_cache(maxsize=None)
def unwatched(name):
    return run(name)


def healthy(r, cs):
    """The run's own oracle: finite losses but the planted ones (NaN, and the weights unchanged there), falling
    (last-5 mean of the finite ones <= 0.9 x the first-5), skips only at the opening (and some, where the case
    needs them), finite final weights."""
    bad = [i for i, v in enumerate(r.losses) if not math.isfinite(v)]
    assert bad == list(cs.planted), (bad, cs.planted)
    assert all(r.planted_same), r.planted_same
    ls = [v for v in r.losses if math.isfinite(v)]
    assert sum(ls[-5:]) / 5 <= 0.9 * sum(ls[:5]) / 5, (ls[:5], ls[-5:])
    assert all(s < OPENING for s in r.skipped), r.skipped
    if cs.opening:
        assert r.skipped, "no opening backoff happened"
    assert all(torch.isfinite(v).all() for v in r.weights.values() if v.is_floating_point())


@pytest.mark.parametrize("name,mode", [pytest.param(n, m, marks=wrong(XFAIL[n, m]) if (n, m) in XFAIL else ())
                                       for n in CASES for m in MODES])
def test_healthy_guard_loop(name, mode, tmp_path):
    ru = unwatched(name)
    if DEBUG:
        ls = ru.losses
        print(name, "skipped", ru.skipped, "loss", [round(v, 4) for v in ls[::max(1, len(ls) // 8)]], ls[-1])
    healthy(ru, CASES[name])
    rw = run(name, mode, tmp_path / "run")
    if DEBUG:
        print(name, mode, lines(rw.rep))
    same_run(rw, ru)
    quiet_healthy(rw)
