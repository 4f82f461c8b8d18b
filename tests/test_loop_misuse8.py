"""Loop misuse probes, eighth set: GradScaler / optimizer call-order misuse as it appears in REAL training-loop
structures (a Trainer class with hooks and a callback list, gradient-accumulation loops, an evaluation helper run in
the middle of an iteration, a checkpoint branch, a closure-driven loop, two models with two scalers), watched through
the public API only (`ampdoctor.watch(model, optimizer=..., scaler=...)` around an fp16 CPU autocast +
torch.amp.GradScaler("cpu") loop on a tiny model, 8-20 steps, then `w.report()`) at ampdoctor's default settings.

Every misuse first checks in the test itself that it happened and did what torch's documented semantics say it does
(torch's own exception at the expected iteration, the norm a clip returned vs the true unscaled norm computed on a
copy, the gradient the optimizer stepped on vs the micro-batch gradients, the applied SGD update vs `lr * true
gradient`); then: the rule among the first three findings, at the step of the first misuse and, for call-order rules,
at the line of the user's wrong call in `finding.evidence` (file, line). Every correct loop is checked to train and
must be quiet (no warning, no error).

Misuse:
 M1. a Trainer whose `training_step` does the scaled backward and whose `optimizer_step` runs a callback list
     (`on_before_optimizer_step`: a GradClip callback) BEFORE `scaler.unscale_`: clip_before_unscale, error,
     step 0, at the callback's clip line.                          (twin T1: unscale_ before the callbacks: quiet)
 M2. 4-way accumulation with `scaler.step` only at the boundary but `scaler.update()` after every micro-batch:
     GradScaler asserts "No inf checks were recorded prior to update." at micro-batch 0: scaler_misorder, step 0,
     at the update line.
 M3. accumulation turned into "step every micro-batch" (scaler.step + update every micro-batch) while zero_grad runs
     only every 4th: each backward adds scaled gradients onto gradients the previous scaler.step already unscaled
     in place, so the next step divides those a second time (the retained micro-batches vanish): scaler_misorder,
     step 1, at the scaled backward or the step line.          (twin T3: step + update + zero_grad at the boundary)
 M4. an `evaluate()` helper run every 4th iteration BETWEEN the scaled backward and scaler.step frees memory with
     `optimizer.zero_grad()`: GradScaler asserts "No inf checks were recorded for this optimizer." at iteration 3:
     scaler_misorder, step 3, at the zero_grad or the step line.
 M5. a checkpoint branch (every 4th iteration) that steps "so the saved weights are current", then the common path
     steps again: torch raises "step() has already been called since the last update()." at iteration 3:
     scaler_misorder or missing_scaler_update, step 3, at either step line.
 M8. a two-phase loop whose second phase (from step 3) is ported from `optimizer.step(closure)`: zero_grad, then
     `scaler.step(opt, closure)` with the closure doing zero_grad + forward + scaled backward and nothing before it:
     GradScaler.step unscales (and inf-checks) BEFORE it calls optimizer.step(closure), finds no gradients and asserts
     "No inf checks were recorded for this optimizer." (its docs: "Closure use is not currently supported"; at step 0
     it would fail earlier still, on a scale never set): scaler_misorder, step 3, at the step line.
 M9. two models with two GradScalers; the loop unscales model A's optimizer with scaler B: scA.step(optA) then
     unscales it again (scB's unscale_ is not scA's state), so every A update is scale x too small (silent):
     scaler_misorder, step 0, at the wrong unscale_ or at scA.step, in the report of either watch.

Correct (quiet, each checked to train): T1 the Trainer unscaling before its callbacks; T2 update() at the
accumulation boundary; T3 step + update + zero_grad at the boundary (each step applies the sum of its 4 micro-batch
gradients); T4 evaluate() after update(); T5 the checkpoint taken after the single step; T6 unscale_, then
`clip_grad_value_` over ONE sub-module's parameters (the head); T7 unscale_, then `clip_grad_norm_(...,
foreach=True, error_if_nonfinite=False)`; T9 each scaler unscaling its own optimizer (two watches, both quiet).

What ampdoctor got wrong (strict xfails, 2 of 15; each reason gives what it reported instead):
 - M3 (fixed): was an empty report; a scaled backward onto gradients scaler.step already unscaled in place is
   now scaler_misorder at the next scaler.step.
 - M9: '[error] clip_before_unscale ... the scaled norm was clipped' at A's clip, which saw the TRUE norm (scaler B
   had unscaled A's gradients); the second division by scaler A's step is not named.
Right: M1 (clip_before_unscale at the callback's clip line), M2, M4, M5, M8 (scaler_misorder / for M5 also
missing_scaler_update at the right step and line), and every twin quiet.
"""
import copy
import os
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import lines, one_thread
from probe_harness import (expect as _expect, learned as _learned, quiet_report, run_misuse, xf, gnorm,
                           misuse_net, misuse_batch)


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
SCALE = 1024.0
quiet = quiet_report
run = run_misuse
learned = partial(_learned, k=3, factor=0.8)


def expect(rep, rule, step, tag, severity=("error",)):
    """probe_harness.expect at this file's `# @tag` line(s), scaler_misorder with its call sequence."""
    return _expect(rep, rule, severity, step, tag, src=HERE, sequence=True)


net = misuse_net  # (probe_harness: the loop-misuse files' model and data)
batch = misuse_batch


def fwd_loss(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        return F.mse_loss(m(x).float(), y)


def true_grads(m, i):
    """The unscaled gradients of fwd_loss(batch i) at m's current weights, on a copy (m is untouched)."""
    c = copy.deepcopy(m)
    c.zero_grad(set_to_none=True)
    fwd_loss(c, i).backward()
    return [p.grad.detach().clone() for p in c.parameters()]


def scaler(init=SCALE):
    return torch.amp.GradScaler("cpu", init_scale=init)


# ======================================================================================================================
# M1 / T1. A Trainer: training_step backward, optimizer_step runs the callback list, then (too late) unscale_
# ======================================================================================================================
class GradClip:
    """A callback: clip the gradient norm before the optimizer step; keeps the norms it saw."""

    def __init__(self, max_norm):
        self.max_norm, self.seen = max_norm, []

    def on_before_optimizer_step(self, trainer):
        n = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), self.max_norm)  # @cb-clip
        self.seen.append(float(n))


class LrLogger:
    """A callback that only reads the learning rate."""

    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer):
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


class Trainer:
    def __init__(self, model, callbacks, unscale_first):
        self.model, self.callbacks, self.unscale_first = model, callbacks, unscale_first
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scaler = scaler()
        self.losses, self.true_norms = [], []

    def _call(self, hook):
        for cb in self.callbacks:
            getattr(cb, hook, lambda t: None)(self)

    def training_step(self, i):
        self.true_norms.append(gnorm(true_grads(self.model, i)))
        loss = fwd_loss(self.model, i)
        self.scaler.scale(loss).backward()
        return loss.detach()

    def optimizer_step(self):
        if self.unscale_first:
            self.scaler.unscale_(self.optimizer)
        self._call("on_before_optimizer_step")
        if not self.unscale_first:
            self.scaler.unscale_(self.optimizer)  # "unscale right before the step"
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def fit_step(self, i):
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(self.training_step(i).item())
        self.optimizer_step()


def trainer_run(unscale_first):
    clip = GradClip(max_norm=1e3)  # (a large max_norm: only scaled gradients get clipped)
    tr = Trainer(net(), [LrLogger(), clip], unscale_first)
    rep, raised = run(tr.model, tr.fit_step, steps=12, optimizer=tr.optimizer, scaler=tr.scaler)
    return rep, raised, tr, clip


def test_m1_trainer_callback_clips_before_the_unscale_in_optimizer_step():
    rep, raised, tr, clip = trainer_run(unscale_first=False)
    # real: the callback's clip saw the gradient norm x1024 (torch's AMP docs: unscale_ before inspecting or
    # clipping .grad), so it clipped gradients that were not too large
    assert raised is None
    assert all(n > 500 * t for n, t in zip(clip.seen, tr.true_norms)), (clip.seen, tr.true_norms)
    expect(rep, "clip_before_unscale", 0, "cb-clip")


def test_t1_twin_trainer_unscales_before_the_callbacks_is_quiet():
    rep, raised, tr, clip = trainer_run(unscale_first=True)
    assert raised is None
    assert all(abs(n / t - 1) < 0.05 for n, t in zip(clip.seen, tr.true_norms)), (clip.seen, tr.true_norms)
    learned(tr.losses)
    quiet(rep)


# ======================================================================================================================
# M2. 4-way accumulation: scaler.step at the boundary only, scaler.update() after every micro-batch
# ======================================================================================================================
def accum_update_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    losses = []

    def body(i):  # i counts micro-batches
        loss = fwd_loss(m, i)
        sc.scale(loss / 4).backward()
        losses.append(loss.item())
        if i % 4 == 3:
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            if ok:
                sc.update()
            opt.zero_grad(set_to_none=True)
        if not ok:
            sc.update()  # @accum-update

    rep, raised = run(m, body, steps=16, optimizer=opt, scaler=sc)
    return rep, raised, losses


def test_m2_accumulation_update_every_micro_batch_step_every_4th():
    rep, raised, _ = accum_update_run(ok=False)
    # real: GradScaler.update needs the inf checks of a step (or unscale_) since the last update: it asserts at the
    # first micro-batch, before any optimizer step (so step 0)
    assert raised is not None and raised[0] == 0 and "No inf checks were recorded prior to update" in raised[1], raised
    expect(rep, "scaler_misorder", 0, "accum-update")


def test_t2_twin_accumulation_update_at_the_boundary_is_quiet():
    rep, raised, losses = accum_update_run(ok=True)
    # correct: torch's AMP accumulation recipe (unscale_/step/update once per 4 micro-batches)
    assert raised is None
    learned([sum(losses[j:j + 4]) for j in range(0, 16, 4)], k=1)
    quiet(rep)


# ======================================================================================================================
# M3 / T3. scaler.step + update every micro-batch, zero_grad only every 4th
# ======================================================================================================================
def step_every_micro_run(ok):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = scaler()
    stepped, micro_true, losses = [], [], []  # the gradient each optimizer.step saw; each micro-batch's own
    opt.register_step_pre_hook(lambda o, a, k: stepped.append([p.grad.detach().clone() for p in m.parameters()]))

    def body(i):  # i counts micro-batches
        micro_true.append([g / 4 for g in true_grads(m, i)])
        loss = fwd_loss(m, i)
        sc.scale(loss / 4).backward()  # @sm-backward
        losses.append(loss.item())
        if ok and i % 4 != 3:
            return
        sc.step(opt)  # @sm-step
        sc.update()
        if i % 4 == 3:
            opt.zero_grad(set_to_none=True)

    rep, raised = run(m, body, steps=16, optimizer=opt, scaler=sc)
    return rep, raised, stepped, micro_true, losses


def test_m3_step_and_update_every_micro_batch_but_zero_grad_every_4th():
    rep, raised, stepped, micro_true, _ = step_every_micro_run(ok=False)
    assert raised is None and len(stepped) == 16
    # real: step 0 applies micro-batch 0's gradient; step 1 should (without a scaler: plain accumulation since the last
    # zero_grad) apply g0 + g1, but g0 had been unscaled in place by scaler.step 0, the new backward added g1 x1024 on
    # top, and scaler.step 1 divided the sum again: what remains of g0 is g0 / 1024 (the retained micro-batch vanished)
    rest = gnorm([s - t for s, t in zip(stepped[1], micro_true[1])])
    assert gnorm([s - t for s, t in zip(stepped[0], micro_true[0])]) < 0.02 * gnorm(micro_true[0])
    assert rest < 0.01 * gnorm(micro_true[0]), (rest, gnorm(micro_true[0]))
    expect(rep, "scaler_misorder", 1, ("sm-backward", "sm-step"), severity=("warning", "error"))


def test_t3_twin_step_update_and_zero_grad_at_the_boundary_is_quiet():
    rep, raised, stepped, micro_true, losses = step_every_micro_run(ok=True)
    assert raised is None and len(stepped) == 4
    # healthy: each step applies the sum of its 4 micro-batches' gradients
    for k, s in enumerate(stepped):
        want = [sum(gs) for gs in zip(*micro_true[4 * k:4 * k + 4])]
        assert gnorm([a - b for a, b in zip(s, want)]) < 0.05 * gnorm(want), k
    learned([sum(losses[j:j + 4]) for j in range(0, 16, 4)], k=1)
    quiet(rep)


# ======================================================================================================================
# M4. evaluate() between the scaled backward and scaler.step frees memory with optimizer.zero_grad()
# ======================================================================================================================
def evaluate(m, opt):
    """Validation every few iterations; "free the gradient memory first"."""
    opt.zero_grad()  # @eval-zero-grad
    with torch.no_grad():
        return float(fwd_loss(m, 99))


def evaluate_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    val, losses = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        losses.append(loss.item())
        if i % 4 == 3 and not ok:
            val.append(evaluate(m, opt))
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)  # @eval-step
        sc.update()
        if i % 4 == 3 and ok:
            val.append(evaluate(m, opt))

    rep, raised = run(m, body, steps=12, optimizer=opt, scaler=sc)
    return rep, raised, val, losses


def test_m4_evaluate_between_backward_and_step_zeroes_the_gradients_at_step_3():
    rep, raised, _, _ = evaluate_run(ok=False)
    # real: zero_grad() (set_to_none) left no gradients: GradScaler's unscale_ records no inf check and step() asserts
    assert raised is not None and raised[0] == 3, raised
    assert "No inf checks were recorded for this optimizer" in raised[1], raised
    expect(rep, "scaler_misorder", 3, ("eval-zero-grad", "eval-step"))


def test_t4_twin_evaluate_after_update_is_quiet():
    rep, raised, val, losses = evaluate_run(ok=True)
    # correct: zero_grad after update() only clears gradients already applied
    assert raised is None and len(val) == 3
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# M5. a checkpoint branch that steps, then the common path steps again
# ======================================================================================================================
def checkpoint_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    saved, losses = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        losses.append(loss.item())
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        if i % 4 == 3 and not ok:  # checkpoint: "step first so the saved weights are current"
            sc.step(opt)  # @ckpt-step
            saved.append({k: v.clone() for k, v in m.state_dict().items()})
        sc.step(opt)  # @common-step
        sc.update()
        if i % 4 == 3 and ok:  # the twin checkpoints after the one step
            saved.append({k: v.clone() for k, v in m.state_dict().items()})

    rep, raised = run(m, body, steps=12, optimizer=opt, scaler=sc)
    return rep, raised, saved, losses


def test_m5_checkpoint_branch_and_common_path_both_step_at_step_3():
    rep, raised, saved, _ = checkpoint_run(ok=False)
    # real: GradScaler.step refuses a second step() before update(): raises at iteration 3's common-path step
    assert raised is not None and raised[0] == 3 and "step() has already been called" in raised[1], raised
    assert len(saved) == 1
    expect(rep, ("scaler_misorder", "missing_scaler_update"), 3, ("ckpt-step", "common-step"))


def test_t5_twin_checkpoint_after_the_single_step_is_quiet():
    rep, raised, saved, losses = checkpoint_run(ok=True)
    assert raised is None and len(saved) == 3
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# T6. unscale_, then clip_grad_value_ over the head's parameters only
# ======================================================================================================================
def correct_run(clip, steps=16):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    losses, scales = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        clip(m)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())

    rep, raised = run(m, body, steps=steps, optimizer=opt, scaler=sc)
    assert raised is None and scales == [SCALE] * steps, (raised, scales)  # healthy: no skipped step
    learned(losses)
    return rep


def test_t6_unscale_then_clip_grad_value_of_one_sub_module_is_quiet():
    # correct: torch's AMP recipe unscale_ -> clip -> step; clipping a subset of the parameters is allowed
    quiet(correct_run(lambda m: torch.nn.utils.clip_grad_value_(m.head.parameters(), 0.5)))


def test_t7_unscale_then_foreach_clip_grad_norm_without_error_if_nonfinite_is_quiet():
    # correct: the same recipe; foreach / error_if_nonfinite only choose the kernel and the inf policy
    quiet(correct_run(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True,
                                                               error_if_nonfinite=False)))


# ======================================================================================================================
# M8. a closure-driven loop: scaler.step(opt, closure) with the closure's backward the only one
# ======================================================================================================================
def test_m8_closure_phase_scaler_step_finds_no_gradients_at_step_3():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = scaler()
    calls = []

    def body(i):
        opt.zero_grad(set_to_none=True)
        if i < 3:  # phase 1: the ordinary AMP iteration
            sc.scale(fwd_loss(m, i)).backward()
            sc.step(opt)
            sc.update()
            return

        def closure():  # phase 2, ported from `optimizer.step(closure)`
            calls.append(i)
            opt.zero_grad()
            loss = fwd_loss(m, i)
            sc.scale(loss).backward()
            return loss
        sc.step(opt, closure)  # @closure-step
        sc.update()

    rep, raised = run(m, body, steps=8, optimizer=opt, scaler=sc)
    # real: GradScaler.step unscales and inf-checks BEFORE it hands the closure to optimizer.step; no backward ran in
    # this iteration, so it asserts (GradScaler's docs: closure use is not supported) and the closure never ran
    assert raised is not None and raised[0] == 3, raised
    assert "No inf checks were recorded for this optimizer" in raised[1], raised
    assert calls == []
    expect(rep, "scaler_misorder", 3, "closure-step")


# ======================================================================================================================
# M9. two models, two GradScalers; model A's optimizer unscaled with scaler B
# ======================================================================================================================
def two_scaler_run(ok):
    a, b = net(0), net(1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=5e-2), torch.optim.SGD(b.parameters(), lr=5e-2)
    sc_a, sc_b = scaler(), scaler()
    ratios, clip_a, losses = [], [], []
    wa = ampdoctor.watch(a, optimizer=opt_a, scaler=sc_a)
    wb = ampdoctor.watch(b, optimizer=opt_b, scaler=sc_b)
    try:
        for i in range(10):
            ga = true_grads(a, i)
            for o in (opt_a, opt_b):
                o.zero_grad(set_to_none=True)
            la, lb = fwd_loss(a, i), fwd_loss(b, i + 1)
            sc_a.scale(la).backward()
            sc_b.scale(lb).backward()
            losses.append(la.item() + lb.item())
            if ok:
                sc_a.unscale_(opt_a)
            else:
                sc_b.unscale_(opt_a)  # @wrong-unscale
            clip_a.append((float(torch.nn.utils.clip_grad_norm_(a.parameters(), 1e3)), gnorm(ga)))
            sc_b.unscale_(opt_b)
            torch.nn.utils.clip_grad_norm_(b.parameters(), 1e3)
            before = [p.detach().clone() for p in a.parameters()]
            sc_a.step(opt_a)  # @a-step
            sc_b.step(opt_b)
            sc_a.update()
            sc_b.update()
            ratios.append(gnorm([p.detach() - q for p, q in zip(a.parameters(), before)]) / (5e-2 * gnorm(ga)))
    finally:
        wa.close()
        wb.close()
    return [wa.report(), wb.report()], ratios, clip_a, losses


@xf("reports '[error] clip_before_unscale at (run) torch.nn.utils.clip_grad_norm_ step 0: ... ran on gradients still "
    "multiplied by the loss scale (1024) - the scaled norm was clipped' (watch A; watch B: empty), but the clip saw "
    "the TRUE norm (scaler B's unscale_ had divided A's gradients), and its fix (unscale_ before the clip) is already "
    "there; what is wrong is that scaler A's step divides them a second time (every A update 1024x too small). "
    "Should be: scaler_misorder error at step 0, at scaler B's unscale_(opt_a) or at scaler A's step line")
def test_m9_model_a_optimizer_unscaled_by_scaler_b():
    reps, ratios, clip_a, _ = two_scaler_run(ok=False)
    # real: sc_b's unscale_ divided A's gradients by sc_b's scale (equal to sc_a's), so A's clip saw the TRUE norm; but
    # sc_a never saw that unscale_ (GradScaler keeps per-optimizer state per scaler), so sc_a.step unscales again:
    # every A update is 1/1024 of lr * grad, silently
    assert all(abs(n / t - 1) < 0.05 for n, t in clip_a), clip_a
    assert all(abs(r * SCALE - 1) < 0.05 for r in ratios), ratios
    # either watch may name it: A's optimizer gets the wrong updates, B's scaler made the wrong call
    errs = []
    for rep in reps:
        try:
            expect(rep, "scaler_misorder", 0, ("wrong-unscale", "a-step"))
            return
        except AssertionError as e:
            errs.append(str(e))
    raise AssertionError("\n".join(errs) + "\nA: " + str(lines(reps[0])) + "\nB: " + str(lines(reps[1])))


def test_t9_twin_each_scaler_unscales_its_own_optimizer_is_quiet():
    reps, ratios, clip_a, losses = two_scaler_run(ok=True)
    # correct: each model's gradients are unscaled once, by the scaler that scaled them: the true update
    assert all(abs(n / t - 1) < 0.05 for n, t in clip_a), clip_a
    assert all(abs(r - 1) < 0.05 for r in ratios), ratios
    learned(losses)
    for rep in reps:
        quiet(rep)
