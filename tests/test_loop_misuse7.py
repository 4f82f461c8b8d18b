"""Loop misuse probes, seventh set: GradScaler / optimizer misuse in training-loop shapes that
tests/test_loop_misuse2..6.py (and test_unseen_variants5/13/22.py) do not build, each with its correct twin, watched
through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=...)` around an fp16 autocast +
torch.amp.GradScaler("cpu") loop on a tiny model, then `w.report()`) at ampdoctor's default settings. Every misuse
first checks in the test itself that it happened as designed and did harm (torch's exception at the expected
iteration, the norm a clip returned vs the true unscaled norm of a copy, the applied SGD update vs `lr * true
gradient`), recorded by the test's own code (no patching of torch or ampdoctor). Then: the rule among the first
three findings, error, at the step of the first misuse and, for call-order rules, the line of the user's wrong call
in `finding.evidence`.

Misuse:
 M1. an accelerate-style `Accel.clip_grad_norm_()` that unscales inside `try: ... except RuntimeError: pass` ("already
     unscaled is fine") and is called after EVERY micro-batch of a 4-way accumulation (the `if sync_gradients:` guard
     forgotten): micro-batches 2-4 raise (swallowed) and the clip then runs on gradients of which 3/4 are still
     x1024; scaler.step applies them undivided. scaler_misorder (unscale_ twice) or clip_before_unscale, error, step
     0, at the helper's unscale_ or clip line.
 M2. the gradient norm logged every 4th iteration with `scaler.unscale_(opt)` placed AFTER `scaler.update()` (the
     logging block at the end of the loop body); the loop itself never unscales (no clip): the stale UNSCALED state
     makes the next `scaler.step` skip its unscale_, so step 4 applies gradients x1024 (SGD: update 1024x too large,
     silent). scaler_misorder at step 3 or 4 at the logging unscale_ line.
M2b. the same logging block in a loop that clips (unscale_ + clip every iteration): step 4's unscale_ raises
     "unscale_() has already been called on this optimizer since the last update()". Every iteration DID call
     update(), so the cause is the logging unscale_ after update(): scaler_misorder at step 3 or 4 at that line, not
     missing_scaler_update.
 M3. a fairseq-style port that unscales by hand (`p.grad.mul_(1 / scaler.get_scale())`, fairseq's multiply_grads),
     clips, then calls `scaler.step(opt)`, which divides by the scale again: SGD updates 1024x too small, silently
     (the clip saw the true norm). scaler_misorder (unscale twice) at step 0.
 M4. a two-phase research script: from step 3 the fine-tuning phase calls a helper copied from the fp32 code,
     `compute_and_backward()`, which runs `loss.backward()` itself, while the loop still does unscale_ + clip +
     scaler.step + update. No iteration from 3 on calls scaler.scale(), so every update is 1024x too small
     (silent). scaler_misorder at step 3 (a scaler.step with no scale() since the previous update is a recorded-call
     fact, unlike a raw backward among scaled ones).
 M5. a detection-style loop whose batch can have no targets (loss None, at step 3): the backward is skipped but
     `unscale_` / `scaler.step` still run on gradients zeroed to None; GradScaler asserts "No inf checks were
     recorded for this optimizer.": scaler_misorder at step 3 at the scaler.step line.

Correct twins (no warning, no error; each checked to train): T1 the helper guarded by `sync_gradients` (unscale_ +
clip at the 4th micro-batch only); T2 the norm logged after update() WITHOUT unscale_ (scaler.step already unscaled
the gradients: the read norm is the true one); T3 the port with `scaler.unscale_(opt)` instead of the hand division;
T4 the helper returns the loss and the loop backpropagates `scaler.scale(loss)`; T5 the empty batch skipped
(`continue`) before any scaler call; T6 a hand-written Lookahead wrapper (duck-typed, not a
torch.optim.Optimizer) given to GradScaler and to watch(); T7 HF Trainer's `optimizer_was_run = scale_before <=
scale_after` (scheduler stepped only on applied steps) with init_scale 2**20, whose first steps the scaler skips
(info only).

What ampdoctor got wrong (strict xfails, 1 of 13; fixed since: M2, M2b and M4 were not named - M2 gave only infos,
M2b "missing_scaler_update" though every iteration updated, M4 an empty report; rules/callorder.py now names an
unscale_/scaler.step with no scale() since the last update() as scaler_misorder at that call, and the unscale_ that
raises after it is not read as a missing update):
 - M3: '[error] clip_before_unscale step 0 ... the scaled norm was clipped', but the clip saw the true norm; the
   double division by scaler.step is not named (and the suggested fix would not cure it). Should be
   scaler_misorder, error, step 0.

Right: M1 (scaler_misorder at step 0 at the helper's unscale_ line, with the sequence), M2, M2b and M4
(scaler_misorder at the logging unscale_ / at step 3), M5 (scaler_misorder at step 3
at the scaler.step line), and every twin T1-T7 quiet.
"""
import copy
import math
import os
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import lines, one_thread
from probe_harness import (expect as _expect, learned as _learned, quiet_report, run_misuse, tag_line, xf, gnorm,
                           misuse_net, misuse_batch)


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
SCALE = 1024.0
line_of = partial(tag_line, __file__)
quiet = quiet_report


def expect(rep, rule, step=None, tag=None, steps=None):
    """probe_harness.expect at this file's `# @tag` lines, scaler_misorder with its sequence; `steps`: accepted steps."""
    f = _expect(rep, rule, ("error",), step, tag, src=HERE, sequence=True)
    if steps is not None:
        assert f.step in steps, (f.one_line(), lines(rep))
    return f


net = misuse_net  # (probe_harness: the loop-misuse files' model and data)
batch = partial(misuse_batch, cycle=None)


def fwd_loss(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        return F.mse_loss(m(x).float(), y)


def true_grads(m, idx):
    """The unscaled gradients of the mean of fwd_loss over batches `idx` (each divided by len(idx)) at m's current
    weights, on a copy (m is untouched)."""
    c = copy.deepcopy(m)
    c.zero_grad(set_to_none=True)
    for i in idx:
        (fwd_loss(c, i) / len(idx)).backward()
    return [p.grad.detach().clone() for p in c.parameters()]


def scaler(init=SCALE, **kw):
    return torch.amp.GradScaler("cpu", init_scale=init, **kw)


run = run_misuse


learned = partial(_learned, k=3, factor=0.8)


def sgd_ratio(m, before, grads, lr):
    """|applied update| / |lr * true gradient| over all parameters."""
    d = [p.detach() - b for p, b in zip(m.parameters(), before)]
    return gnorm(d) / (lr * gnorm(grads))


# ======================================================================================================================
# M1 / T1. An accelerate-style wrapper whose clip_grad_norm_ swallows "already unscaled", called on every micro-batch
# ======================================================================================================================
class Accel:
    """A home-grown accelerate: backward(loss) scales, clip_grad_norm_ unscales first (once per step, it hopes)."""

    def __init__(self, opt, accum=4):
        self.opt, self.scaler, self.accum, self.micro = opt, scaler(), accum, 0
        self.swallowed = []

    @property
    def sync_gradients(self):
        return self.micro % self.accum == 0

    def backward(self, loss):
        self.micro += 1
        self.scaler.scale(loss / self.accum).backward()

    def clip_grad_norm_(self, params, max_norm):
        try:
            self.scaler.unscale_(self.opt)  # @accel-unscale
        except RuntimeError as e:  # "unscale_() has already been called ..." -- "then it is unscaled already"
            self.swallowed.append((self.micro, str(e)))
        return torch.nn.utils.clip_grad_norm_(params, max_norm)  # @accel-clip

    def step(self):
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


def accel_run(guarded):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    acc = Accel(opt)
    seen, losses = [], []  # (micro-batch, the norm the clip returned, the true norm of the grads so far)

    def body(i):
        tot = 0.0
        for k in range(4):
            idx = [4 * (i % 3) + j for j in range(k + 1)]
            true = gnorm(true_grads(m, idx)) * (k + 1) / 4  # what the accumulated .grad holds, unscaled
            loss = fwd_loss(m, idx[-1])
            acc.backward(loss)
            tot += loss.item() / 4
            if guarded and not acc.sync_gradients:
                continue
            n = acc.clip_grad_norm_(m.parameters(), 1e3)  # (a large max_norm: clipping engages only when scaled)
            seen.append((acc.micro, float(n), true))
        acc.step()
        losses.append(tot)

    rep, raised = run(m, body, steps=9, optimizer=opt, scaler=acc.scaler)
    return rep, raised, acc, seen, losses


def test_m1_accelerate_style_clip_on_every_micro_batch_swallowing_the_second_unscale():
    rep, raised, acc, seen, _ = accel_run(guarded=False)
    # real: micro-batches 2, 3, 4 of step 0 raised "already been called" (swallowed); from the 2nd the clip saw a
    # norm hundreds of times the true one (the new micro-batch's gradients are still x1024)
    assert raised is None
    assert [s[0] for s in acc.swallowed[:3]] == [2, 3, 4] and "already been called" in acc.swallowed[0][1], acc.swallowed
    assert abs(seen[0][1] / seen[0][2] - 1) < 0.05, seen[0]
    assert seen[1][1] > 200 * seen[1][2], seen[1]
    expect(rep, ("scaler_misorder", "clip_before_unscale"), step=0, tag=("accel-unscale", "accel-clip"))


def test_t1_twin_accelerate_style_clip_guarded_by_sync_gradients_is_quiet():
    rep, raised, acc, seen, losses = accel_run(guarded=True)
    assert raised is None and acc.swallowed == []
    assert all(abs(n / t - 1) < 0.05 for _, n, t in seen), seen
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# M2 / M2b / T2. The gradient norm logged every 4th iteration by a block at the END of the loop body, after update()
# ======================================================================================================================
LR2 = 5e-2


def log_after_update_run(variant):
    """variant: 'unscale' (the logging block unscales; the loop never does), 'unscale+clip' (the loop also unscales +
    clips every iteration), 'read' (the twin: the block reads the norm after update() without unscale_)."""
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=LR2)
    sc = scaler()
    ratios, logged, losses = {}, {}, []

    def body(i):
        opt.zero_grad(set_to_none=True)
        grads = true_grads(m, [i % 4])
        loss = fwd_loss(m, i % 4)
        sc.scale(loss).backward()
        if variant == "unscale+clip":
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e3)
        before = [p.detach().clone() for p in m.parameters()]
        sc.step(opt)
        sc.update()
        ratios[i] = sgd_ratio(m, before, grads, LR2)
        losses.append(loss.item())
        if i % 4 == 3:  # the logging block
            if variant != "read":
                sc.unscale_(opt)  # @log-unscale
            logged[i] = (gnorm(p.grad for p in m.parameters()), gnorm(grads))

    rep, raised = run(m, body, steps=8, optimizer=opt, scaler=sc)
    return rep, raised, ratios, logged, losses


def test_m2_grad_norm_logging_unscales_after_update_so_the_next_step_applies_scaled_gradients():
    rep, raised, ratios, logged, _ = log_after_update_run("unscale")
    # real: steps 0-3 apply the true update; step 4 (after the logging unscale_ at 3) applies it x1024, silently;
    # the logged norm itself is 1024x too small (the gradients were already unscaled by scaler.step)
    assert raised is None
    assert all(abs(ratios[i] - 1) < 0.05 for i in range(4)), ratios
    assert ratios[4] > 500, ratios
    assert logged[3][0] < logged[3][1] / 500, logged
    expect(rep, "scaler_misorder", tag="log-unscale", steps=(3, 4))


def test_m2b_grad_norm_logging_unscales_after_update_and_the_next_unscale_raises():
    rep, raised, ratios, _, _ = log_after_update_run("unscale+clip")
    # real: every iteration called update(); step 4's own unscale_ raises because of the logging unscale_ at 3
    assert raised is not None and raised[0] == 4 and "already been called" in raised[1], raised
    assert all(abs(ratios[i] - 1) < 0.05 for i in range(4)), ratios
    expect(rep, "scaler_misorder", tag="log-unscale", steps=(3, 4))


def test_t2_twin_grad_norm_read_after_update_without_unscale_is_quiet():
    rep, raised, ratios, logged, losses = log_after_update_run("read")
    # healthy: every update is the true one, and the norm read after update() is the true norm (scaler.step
    # unscaled the gradients in place)
    assert raised is None
    assert all(abs(r - 1) < 0.05 for r in ratios.values()), ratios
    assert all(abs(a / b - 1) < 0.05 for a, b in logged.values()), logged
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# M3 / T3. A fairseq-style port that unscales by hand (multiply_grads(1 / scale)), clips, then scaler.step
# ======================================================================================================================
LR3 = 5e-2


def multiply_grads(params, c):
    """fairseq's optimizer.multiply_grads(c)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(c)  # @hand-unscale


def hand_unscale_run(ok):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=LR3)
    sc = scaler()
    ratios, clip_seen, losses = [], [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        grads = true_grads(m, [i % 4])
        loss = fwd_loss(m, i % 4)
        sc.scale(loss).backward()
        if ok:
            sc.unscale_(opt)
        else:
            multiply_grads(m.parameters(), 1.0 / sc.get_scale())
        n = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e3)
        clip_seen.append((float(n), gnorm(grads)))
        before = [p.detach().clone() for p in m.parameters()]
        sc.step(opt)  # @hand-step
        sc.update()
        ratios.append(sgd_ratio(m, before, grads, LR3))
        losses.append(loss.item())

    rep, raised = run(m, body, steps=10, optimizer=opt, scaler=sc)
    return rep, raised, ratios, clip_seen, losses


@xf("'[error] clip_before_unscale at (run) torch.nn.utils.clip_grad_norm_ step 0: ... ran on gradients still "
    "multiplied by the loss scale (1024) - the scaled norm was clipped', but the clip saw the TRUE norm (the "
    "gradients had been divided by hand, p.grad.mul_(1 / scale)), and its fix (unscale_ before the clip) would "
    "divide twice all the same; no finding names scaler.step dividing them a second time (every SGD update 1024x "
    "too small). Should be: scaler_misorder error at step 0 (at the hand division or the scaler.step line).")
def test_m3_hand_unscale_then_scaler_step_divides_twice():
    rep, raised, ratios, clip_seen, _ = hand_unscale_run(ok=False)
    # real: the clip saw the true norm (the hand division worked), but scaler.step divided again: every SGD update
    # is 1024x too small, silently
    assert raised is None
    assert all(abs(n / t - 1) < 0.05 for n, t in clip_seen), clip_seen
    assert all(abs(r * SCALE - 1) < 0.05 for r in ratios), ratios
    expect(rep, "scaler_misorder", step=0, tag=("hand-unscale", "hand-step"))


def test_t3_twin_scaler_unscale_instead_of_the_hand_division_is_quiet():
    rep, raised, ratios, clip_seen, losses = hand_unscale_run(ok=True)
    assert raised is None
    assert all(abs(r - 1) < 0.05 for r in ratios), ratios
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# M4 / T4. From step 3 a fine-tuning phase calls a helper from the fp32 code that runs loss.backward() itself
# ======================================================================================================================
LR4 = 5e-2


def compute_and_backward(m, i):
    """Copied from the fp32 script: forward, loss, backward; returns the loss for the logs."""
    loss = fwd_loss(m, i)
    loss.backward()  # @raw-backward
    return loss.detach()


def compute_loss(m, i):
    return fwd_loss(m, i)


def phase_run(ok):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=LR4)
    sc = scaler()
    ratios, losses = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        grads = true_grads(m, [i % 4])
        if i < 3:  # phase 1: the AMP loop
            loss = fwd_loss(m, i % 4)
            sc.scale(loss).backward()
        elif ok:
            loss = compute_loss(m, i % 4)
            sc.scale(loss).backward()
        else:  # phase 2: the fine-tuning helper
            loss = compute_and_backward(m, i % 4)
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e3)
        before = [p.detach().clone() for p in m.parameters()]
        sc.step(opt)
        sc.update()
        ratios.append(sgd_ratio(m, before, grads, LR4))
        losses.append(loss.item())

    rep, raised = run(m, body, steps=10, optimizer=opt, scaler=sc)
    return rep, raised, ratios, losses


def test_m4_phase_two_helper_backpropagates_the_raw_loss_from_step_3():
    rep, raised, ratios, _ = phase_run(ok=False)
    # real: steps 0-2 apply the true update; from 3 on every update is 1024x too small (the raw gradients divided)
    assert raised is None
    assert all(abs(r - 1) < 0.05 for r in ratios[:3]), ratios
    assert all(abs(r * SCALE - 1) < 0.05 for r in ratios[3:]), ratios
    expect(rep, "scaler_misorder", step=3)


def test_t4_twin_phase_two_helper_returns_the_loss_for_a_scaled_backward_is_quiet():
    rep, raised, ratios, losses = phase_run(ok=True)
    assert raised is None
    assert all(abs(r - 1) < 0.05 for r in ratios), ratios
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# M5 / T5. A detection-style batch with no targets (loss None) at step 3: backward skipped, the scaler calls not
# ======================================================================================================================
def detection_loss(m, i):
    if i == 3:  # no boxes in this batch
        return None
    return fwd_loss(m, i % 4)


def empty_batch_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    losses = []

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = detection_loss(m, i)
        if loss is None and ok:
            return  # (the twin: skip the whole iteration)
        if loss is not None:
            sc.scale(loss).backward()
            losses.append(loss.item())
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)  # @empty-step
        sc.update()

    rep, raised = run(m, body, steps=10, optimizer=opt, scaler=sc)
    return rep, raised, losses


def test_m5_empty_batch_skips_the_backward_but_not_scaler_step():
    rep, raised, _ = empty_batch_run(ok=False)
    assert raised is not None and raised[0] == 3 and "No inf checks were recorded for this optimizer" in raised[1], raised
    expect(rep, "scaler_misorder", step=3, tag="empty-step")


def test_t5_twin_empty_batch_skipped_before_any_scaler_call_is_quiet():
    rep, raised, losses = empty_batch_run(ok=True)
    assert raised is None
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# T6. A hand-written Lookahead (duck-typed, not a torch.optim.Optimizer) given to GradScaler and to watch()
# ======================================================================================================================
class Lookahead:
    """The usual hand-written Lookahead (Zhang et al. 2019): wraps a base optimizer, shares its param_groups."""

    def __init__(self, base, k=3, alpha=0.5):
        self.base, self.k, self.alpha, self.n = base, k, alpha, 0
        self.param_groups, self.state, self.defaults = base.param_groups, base.state, base.defaults
        self.slow = [[p.detach().clone() for p in g["params"]] for g in self.param_groups]

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            for g, slow in zip(self.param_groups, self.slow):
                for p, s in zip(g["params"], slow):
                    s.add_(p - s, alpha=self.alpha)
                    p.copy_(s)
        return loss


def test_t6_lookahead_wrapper_through_grad_scaler_is_quiet():
    m = net()
    opt = Lookahead(torch.optim.SGD(m.parameters(), lr=5e-2, momentum=0.9))
    sc = scaler()
    losses, scales = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i % 4)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())

    rep, raised = run(m, body, steps=12, optimizer=opt, scaler=sc)
    assert raised is None and opt.n == 12 and scales == [SCALE] * 12, (raised, opt.n, scales)
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# T7. HF Trainer's optimizer_was_run: the scheduler is stepped only when the scaler did not skip
# ======================================================================================================================
def test_t7_hf_optimizer_was_run_scheduler_with_initial_skips_is_quiet():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    sc = scaler(2.0 ** 20)
    losses, skipped = [], []

    def body(i):
        loss = fwd_loss(m, i % 4)  # (at 2**20 the first scaled backwards overflow fp16)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scale_before = sc.get_scale()
        sc.step(opt)
        sc.update()
        optimizer_was_run = scale_before <= sc.get_scale()
        if optimizer_was_run:
            sched.step()
        else:
            skipped.append(i)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    rep, raised = run(m, body, steps=20, optimizer=opt, scaler=sc)
    # healthy: the scaler's search skips the first steps only, then the loss falls
    assert raised is None and skipped and skipped == list(range(len(skipped))) and len(skipped) <= 8, skipped
    learned(losses[len(skipped):])
    quiet(rep)
