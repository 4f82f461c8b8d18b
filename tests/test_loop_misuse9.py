"""Loop misuse probes, ninth set: GradScaler / optimizer / clipping call-order misuses that BEGIN ON A LATER STEP
(5-10, steps ampdoctor's default sampling does not sample) of a realistic loop, after the loop ran correctly from
step 0: a phase switch (an auxiliary / perceptual loss switched on, a head unfrozen with its own optimizer, a
SAM-style second pass), a resume from a checkpoint whose restored counter is off by one, an epoch-end flush, a
logging step. Several of them make the same KINDS of calls each step as the steps before (ampdoctor keeps a routine
step's call events only when one of them is flagged): what changes is the tensor a call gets, or which optimizer.

Each misuse is first checked in the test itself (a step pre-hook on the optimizer keeps the gradients it stepped on,
compared with the true gradients recomputed on a copy of the model; the norm a clip returned; torch's own exception);
then: the rule among the first three findings, at the onset step and at the user's wrong call's `# @tag` line, a
scaler_misorder finding with its call sequence (probe_harness.expect). Each twin is checked to train and must be quiet.

Misuse (twin):
 A1. from step AUX_START an auxiliary loss is added, and its branch backpropagates the raw loss: `scaled =
     scaler.scale(loss)` is computed for nothing, `loss.backward()`: scaler.step divides gradients that were never
     multiplied (every update scale x too small): scaler_misorder at step AUX_START.   (T: `scaled.backward()`)
 A2. from step AUX_START the phase-2 branch hands `scaler.scale(total)` to a `backward(loss)` helper that scales
     `loss / accum` again: the gradients carry scale^2, unscale_ divides once (AdamW hides it: silent):
     scaler_misorder at step AUX_START, at the branch's scale or the helper's.        (T: the raw loss to the helper)
 A3. 2-way accumulation over an epoch of 11 micro-batches; the leftover micro-batch is flushed at the epoch end by
     a fallback branch with `optimizer.step()` on the still-scaled gradients (step 5): scaler_misorder at step 5,
     at the flush's optimizer.step line.                          (T: the flush through unscale_/scaler.step/update)
 A4. the head is unfrozen at step UNFREEZE with a second optimizer on the same scaler; the loop's `scaler.update()`
     sits inside `for opt in optimizers:` (harmless with one optimizer): update() resets the scaler's per-optimizer
     state, so the head's scaler.step unscales its already unscaled gradients again (head updates scale x too
     small): scaler_misorder at step UNFREEZE, at the update line.            (T: update() after the loop)
 A5. 4-way accumulation resumed from a checkpoint at optimizer step RESUME whose restored micro-batch counter is
     one ahead: unscale_ (+ clip) now runs after the 3rd micro-batch, before the 4th's scaled backward: the step
     applies the last micro-batch's gradient x scale: scaler_misorder at step RESUME, at the unscale_ line.
                                                                                        (T: the counter restored right)
 A6. logging steps (every 10th, step 10 first) take the clip + norm for the log BEFORE unscale_: the scaled norm is
     clipped: clip_before_unscale at step 10, at the logging clip line.           (T: unscale_ first on them too)
 A7. a try/except around clip(error_if_nonfinite=True) + scaler.step + scaler.update: on the non-finite norm of an
     outlier batch (step BAD) it skips the update too, and the next unscale_ raises "unscale_() has already been
     called": missing_scaler_update at step BAD. (T: update() after the try, as torch's docs recommend: the scaler
     backs off and skips that step: quiet)
 A8. a SAM-style second pass from step SAM_START: `scaler.step(opt, closure)` with the closure re-running the forward
     and the scaled backward (positional, so GradScaler passes it to optimizer.step after its unscale_ and inf
     check): the optimizer steps on scaled gradients: scaler_misorder at step SAM_START, at the step line.
 A9. the head is unfrozen at step UNFREEZE and its optimizer REBUILT (new lr), but the list the loop unscales from
     still holds the old optimizer object over the same parameters: unscale_(old) divides the head's gradients,
     scaler.step(new) divides them again (head updates scale x too small); the calls' kinds are those of the step
     before: scaler_misorder at step UNFREEZE, at the step line of the new optimizer or the stale unscale_.
                                                                                      (T: the list updated too)
 A10. logging steps (every 10th, step 10 first) call `scaler.unscale_(opt)` AFTER scaler.step "to log the true
     norm": torch raises 'unscale_() is being called after step()' at iteration 10: scaler_misorder at step 10, at
     the late unscale_ line.                       (T: the norm read without unscale_: the gradients are unscaled)

What ampdoctor got wrong (strict xfails, 4 of 19 when written; 3 fixed since, each reason gave what it reported):
 - A1 (fixed): was nothing at the default sampling; the "scaled loss never backpropagated" check ran on sampled steps
   only. It now runs every step (a node pre-hook on each scaled loss).
 - A2 (fixed): was nothing (any sampling); a second scale() of a tensor derived from the scaled loss (`loss / accum`
   in the helper) now counts as scaling twice (the scaled loss's node within 16 nodes of the new one's).
 - A9 (fixed): was nothing (any sampling): the head's gradients divided twice (a stale optimizer object's unscale_ +
   the new one's scaler.step) on a step whose call kinds repeat the step before; the recorder now notes a
   scaler.step() that will unscale gradients another optimizer object already unscaled (record/monitorsink.py).
 - A10 (fixed): was missing_scaler_update at the scaler.step line ("an iteration ended without update()") for an
   unscale_ after step() in the same iteration; a step alone between two unscale_s is the same iteration now.
Right: A3 (optimizer.step on scaled gradients at step 5), A4 (update between the two optimizers' steps at step 6),
A5 (unscale_ before the last micro-batch's backward at step 6), A6 (clip_before_unscale at step 10), A7
(missing_scaler_update at step 8), A8 (the closure at step 6), each at the right line; every twin quiet.
"""
import copy
import os
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor  # noqa: F401  (the public API, through probe_harness.run_misuse)
from scenarios import one_thread
from probe_harness import (expect as _expect, learned as _learned, quiet_report, run_misuse, gnorm, keep_stepped,
                           misuse_net, misuse_batch, near, ratio)


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
SCALE = 1024.0
quiet = quiet_report
run = run_misuse
learned = partial(_learned, k=3, factor=0.8)

AUX_START = 7
UNFREEZE = 6
RESUME = 6
BAD = 8
SAM_START = 6


def expect(rep, rule, step, tag, severity=("error",)):
    """probe_harness.expect at this file's `# @tag` line(s), scaler_misorder with its call sequence."""
    return _expect(rep, rule, severity, step, tag, src=HERE, sequence=True)


net = misuse_net  # (probe_harness: the loop-misuse files' model and data)
batch = misuse_batch


def fwd_loss(m, i, aux=False):
    """The regression loss; `aux`: plus a small penalty on the body's activations (the phase-2 term)."""
    x, y = batch(i)
    with torch.autocast(**FP16):
        h = torch.relu(m.body(x))
        loss = F.mse_loss(m.head(h).float(), y)
        if aux:
            loss = loss + 1e-3 * h.float().pow(2).mean()
    return loss


def true_grads(m, i, aux=False, params=None):
    """The unscaled gradients of fwd_loss(batch i) at m's current weights, on a copy (m is untouched); `params`: the
    names of the parameters wanted (default all, in m.parameters() order)."""
    c = copy.deepcopy(m)
    for p in c.parameters():
        p.requires_grad_(True)
    c.zero_grad(set_to_none=True)
    fwd_loss(c, i, aux).backward()
    return [p.grad.detach().clone() for n, p in c.named_parameters() if params is None or n in params]


def scaler(init=SCALE, **kw):
    return torch.amp.GradScaler("cpu", init_scale=init, **kw)


# ======================================================================================================================
# A1. the aux-loss branch computes scaler.scale(loss) and backpropagates the raw loss
# ======================================================================================================================
def aux_raw_run(ok):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))
    want, losses = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        aux = i >= AUX_START
        want.append(true_grads(m, i, aux))
        loss = fwd_loss(m, i, aux)
        if aux:  # phase 2: the activation penalty, logged with the scaled loss
            scaled = sc.scale(loss)  # @aux-scale
            (scaled if ok else loss).backward()  # @aux-backward
        else:
            sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 100.0)
        sc.step(opt)  # @aux-step
        sc.update()
        losses.append(loss.item())

    rep, raised = run(m, body, steps=14, optimizer=opt, scaler=sc)
    assert raised is None, raised
    return rep, stepped, want, losses


def test_a1_aux_branch_backpropagates_the_raw_loss_from_step_7():
    rep, stepped, want, _ = aux_raw_run(ok=False)
    # real: before AUX_START the step applies the true gradient; from it, the true gradient / 1024 (unscale_ divided
    # gradients the raw backward never multiplied)
    assert all(near(stepped[i], want[i]) for i in range(AUX_START)), [ratio(stepped[i], want[i]) for i in range(14)]
    assert all(near(stepped[i], want[i], 1 / SCALE) for i in range(AUX_START, 14)), \
        [ratio(stepped[i], want[i]) for i in range(14)]
    expect(rep, "scaler_misorder", AUX_START, ("aux-scale", "aux-backward", "aux-step"))


def test_a1_twin_aux_branch_backpropagates_the_scaled_loss_is_quiet():
    rep, stepped, want, losses = aux_raw_run(ok=True)
    assert all(near(s, w) for s, w in zip(stepped, want)), [ratio(s, w) for s, w in zip(stepped, want)]
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# A2. phase 2 hands scaler.scale(total) to a backward helper that scales again
# ======================================================================================================================
class Trainer:
    """A small trainer whose backward helper scales (and divides by the accumulation count)."""

    def __init__(self, ok, init):
        self.ok, self.accum = ok, 1
        self.model = net()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scaler = scaler(init)
        self.stepped = keep_stepped(self.opt, list(self.model.parameters()))
        self.want, self.losses, self.scales = [], [], []

    def backward(self, loss):
        self.scaler.scale(loss / self.accum).backward()  # @helper-scale

    def fit_step(self, i):
        m, sc = self.model, self.scaler
        self.opt.zero_grad(set_to_none=True)
        aux = i >= AUX_START
        self.want.append(true_grads(m, i, aux))
        loss = fwd_loss(m, i, aux)
        if aux:  # phase 2 (copied from a loop that scaled in place)
            total = loss if self.ok else sc.scale(loss)  # @phase2-scale
            self.backward(total)
        else:
            self.backward(loss)
        sc.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e6)
        self.scales.append(sc.get_scale())
        sc.step(self.opt)
        sc.update()
        self.losses.append(loss.item())


def double_scale_run(ok):
    tr = Trainer(ok, init=128.0)
    rep, raised = run(tr.model, tr.fit_step, steps=14, optimizer=tr.opt, scaler=tr.scaler)
    assert raised is None, raised
    return rep, tr


def test_a2_phase2_scaled_loss_scaled_again_by_the_helper_from_step_7():
    rep, tr = double_scale_run(ok=False)
    # real: no step skipped (the scale never moved), and from AUX_START the step applies the true gradient x scale
    assert tr.scales == [128.0] * 14, tr.scales
    r = [ratio(s, w) for s, w in zip(tr.stepped, tr.want)]
    assert all(near(tr.stepped[i], tr.want[i]) for i in range(AUX_START)), r
    assert all(near(tr.stepped[i], tr.want[i], 128.0) for i in range(AUX_START, 14)), r
    expect(rep, "scaler_misorder", AUX_START, ("phase2-scale", "helper-scale"))


def test_a2_twin_helper_gets_the_raw_loss_is_quiet():
    rep, tr = double_scale_run(ok=True)
    assert all(near(s, w) for s, w in zip(tr.stepped, tr.want))
    learned(tr.losses)
    quiet(rep)


# ======================================================================================================================
# A3. an epoch-end flush of the leftover micro-batch with optimizer.step() on scaled gradients
# ======================================================================================================================
EPOCH = 11  # micro-batches per epoch; 2-way accumulation leaves one over


def flush_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))
    want, losses = [], []
    acc = []

    def body(i):  # i counts micro-batches (2 epochs)
        j = i % EPOCH
        acc.append(true_grads(m, i))
        loss = fwd_loss(m, i)
        sc.scale(loss / 2).backward()
        losses.append(loss.item())
        if j % 2 == 1 or j == EPOCH - 1:
            want.append([sum(gs) / 2 for gs in zip(*acc)])
            acc.clear()
            if j % 2 == 1 or ok:
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 100.0)
                sc.step(opt)
                sc.update()
            else:  # the epoch's leftover micro-batch: "just apply it"
                opt.step()  # @flush-step
            opt.zero_grad(set_to_none=True)

    rep, raised = run(m, body, steps=2 * EPOCH, optimizer=opt, scaler=sc)
    assert raised is None, raised
    return rep, stepped, want, losses


def test_a3_epoch_end_flush_steps_directly_on_scaled_gradients_at_step_5():
    rep, stepped, want, _ = flush_run(ok=False)
    # real: optimizer steps 0-4 apply the true accumulated gradient; step 5 (the flush) that gradient x 1024
    assert len(stepped) == 12
    r = [ratio(s, w) for s, w in zip(stepped, want)]
    assert all(near(stepped[i], want[i]) for i in range(5)), r
    assert near(stepped[5], want[5], SCALE), r
    expect(rep, "scaler_misorder", 5, "flush-step")


def test_a3_twin_flush_through_the_scaler_is_quiet():
    rep, stepped, want, losses = flush_run(ok=True)
    assert len(stepped) == 12 and all(near(s, w) for s, w in zip(stepped, want))
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# A4. a second optimizer (the head, unfrozen at UNFREEZE) and scaler.update() inside the step loop
# ======================================================================================================================
def unfreeze_update_run(ok):
    m = net()
    m.head.requires_grad_(False)
    opt = torch.optim.SGD(m.body.parameters(), lr=0.05)
    sc = scaler()
    optimizers = [opt]
    head_stepped, head_want, losses = [], [], []

    def body(i):
        if i == UNFREEZE:
            m.head.requires_grad_(True)
            opt_head = torch.optim.SGD(m.head.parameters(), lr=0.05)
            opt_head.register_step_pre_hook(
                lambda o, a, k: head_stepped.append([p.grad.detach().clone() for p in m.head.parameters()]))
            optimizers.append(opt_head)
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        if i >= UNFREEZE:
            head_want.append(true_grads(m, i, params={"head.weight", "head.bias"}))
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        for o in optimizers:
            sc.unscale_(o)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 100.0)
        for o in optimizers:
            sc.step(o)
            if not ok:
                sc.update()  # @loop-update
        if ok:
            sc.update()
        losses.append(loss.item())

    rep, raised = run(m, body, steps=14, optimizer=opt, scaler=sc)
    assert raised is None, raised
    return rep, head_stepped, head_want, losses


def test_a4_update_between_the_two_optimizers_steps_from_the_unfreeze():
    rep, got, want, _ = unfreeze_update_run(ok=False)
    # real: update() reset the per-optimizer state, so scaler.step(opt_head) unscaled the head's gradients again
    assert len(got) == 14 - UNFREEZE
    assert all(near(g, w, 1 / SCALE) for g, w in zip(got, want)), [ratio(g, w) for g, w in zip(got, want)]
    expect(rep, "scaler_misorder", UNFREEZE, "loop-update")


def test_a4_twin_update_once_after_both_steps_is_quiet():
    rep, got, want, losses = unfreeze_update_run(ok=True)
    assert all(near(g, w) for g, w in zip(got, want)), [ratio(g, w) for g, w in zip(got, want)]
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# A5. accumulation resumed from a checkpoint with the sync counter one ahead: unscale_ before the last backward
# ======================================================================================================================
ACC = 4


def resume_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))
    micro, want, losses, state = [], [], [], {"sync": 0}

    def body(i):  # i counts micro-batches
        if i == RESUME * ACC:  # resume from the checkpoint taken at optimizer step RESUME
            ck = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict(),
                                "micro": i + 1})  # (saved after the counter had counted the next micro-batch)
            m.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sc.load_state_dict(ck["scaler"])
            state["sync"] = ck["micro"] - (1 if ok else 0)
        micro.append([g / ACC for g in true_grads(m, i)])
        loss = fwd_loss(m, i)
        sc.scale(loss / ACC).backward()
        losses.append(loss.item())
        if (state["sync"] + 1) % ACC == 0:  # the gradients are complete: unscale and clip
            sc.unscale_(opt)  # @acc-unscale
            torch.nn.utils.clip_grad_norm_(m.parameters(), 100.0)
        if (i + 1) % ACC == 0:
            want.append(list(micro))
            micro.clear()
            sc.step(opt)
            sc.update()
            opt.zero_grad(set_to_none=True)
        state["sync"] += 1

    rep, raised = run(m, body, steps=12 * ACC, optimizer=opt, scaler=sc)
    assert raised is None, raised
    return rep, stepped, want, losses


def test_a5_resumed_accumulation_unscales_before_the_last_micro_batch():
    rep, stepped, want, _ = resume_run(ok=False)
    assert len(stepped) == 12
    # real: before RESUME each step applies the sum of its 4 micro-batch gradients; from RESUME the first three plus
    # the last one x 1024 (its scaled backward landed on gradients unscale_ had already divided)
    for k, (s, ms) in enumerate(zip(stepped, want)):
        w = [sum(gs) for gs in zip(*ms)] if k < RESUME else [a + b + c + SCALE * d for a, b, c, d in zip(*ms)]
        assert near(s, w), (k, ratio(s, w))
    expect(rep, "scaler_misorder", RESUME, "acc-unscale")


def test_a5_twin_counter_restored_right_is_quiet():
    rep, stepped, want, losses = resume_run(ok=True)
    for k, (s, ms) in enumerate(zip(stepped, want)):
        w = [sum(gs) for gs in zip(*ms)]
        assert near(s, w), (k, ratio(s, w))
    learned([sum(losses[j:j + ACC]) for j in range(0, len(losses), ACC)])
    quiet(rep)


# ======================================================================================================================
# A6. logging steps clip (and log the norm) before unscale_
# ======================================================================================================================
LOG_EVERY = 10


def log_clip_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    logged, true_norm, losses = [], [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        if i % LOG_EVERY == 0 and i > 0:  # a logging step: clip and log the norm in one go
            true_norm.append(gnorm(true_grads(m, i)))
            if ok:
                sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)  # @log-clip
            logged.append(float(gn))
            if not ok:
                sc.unscale_(opt)
        else:
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())

    rep, raised = run(m, body, steps=22, optimizer=opt, scaler=sc)
    assert raised is None, raised
    return rep, logged, true_norm, losses


def test_a6_logging_steps_clip_before_unscale_from_step_10():
    rep, logged, true_norm, _ = log_clip_run(ok=False)
    # real: on the logging steps the clip saw (and logged) the norm x 1024 and clipped gradients that were not large
    assert len(logged) == 2 and all(abs(n / (SCALE * t) - 1) < 0.05 for n, t in zip(logged, true_norm)), \
        (logged, true_norm)
    assert all(t < 5.0 for t in true_norm), true_norm
    expect(rep, "clip_before_unscale", LOG_EVERY, "log-clip")


def test_a6_twin_logging_steps_unscale_first_is_quiet():
    rep, logged, true_norm, losses = log_clip_run(ok=True)
    assert all(abs(n / t - 1) < 0.05 for n, t in zip(logged, true_norm)), (logged, true_norm)
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# A7. try/except on a non-finite norm: the step skipped, and the update with it
# ======================================================================================================================
def skip_run(ok, steps=14):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler(65536.0)
    losses, scales, skipped = [], [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        x, y = batch(i)
        if i == BAD:
            y = y * 3e3  # an outlier batch: its scaled gradients overflow fp16 in the backward
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)  # @skip-unscale
        scales.append(sc.get_scale())
        try:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
            sc.step(opt)
            if not ok:
                sc.update()  # @try-update
        except RuntimeError:  # "the total norm is non-finite": skip this batch
            skipped.append(i)
        if ok:
            sc.update()
        if i != BAD:
            losses.append(loss.item())

    rep, raised = run(m, body, steps=steps, optimizer=opt, scaler=sc)
    return rep, raised, losses, scales, skipped


def test_a7_skip_on_nonfinite_norm_skips_the_update_too():
    rep, raised, _, scales, skipped = skip_run(ok=False)
    # real: the outlier batch's norm is non-finite at BAD; the update was skipped with the step, and the next
    # iteration's unscale_ raises
    assert skipped == [BAD], skipped
    assert raised is not None and raised[0] == BAD + 1 and "unscale_() has already been called" in raised[1], raised
    expect(rep, "missing_scaler_update", BAD, ("skip-unscale", "try-update"))


def test_a7_twin_update_after_the_try_backs_off_and_is_quiet():
    rep, raised, losses, scales, skipped = skip_run(ok=True)
    # correct (torch's AMP docs: update() every iteration): the scaler backs off once at BAD and training goes on
    assert raised is None and skipped == [BAD], (raised, skipped)
    assert scales[BAD + 1] == scales[BAD] / 2, scales
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# A8. a SAM-style second pass: scaler.step(opt, closure) with the closure's scaled backward
# ======================================================================================================================
def test_a8_second_pass_closure_steps_on_scaled_gradients_from_step_6():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    after, want = {}, {}

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        if i < SAM_START:
            sc.step(opt)
            sc.update()
            return
        want[i] = true_grads(m, i)

        def closure():  # the second pass at the same weights (scaled like the first)
            opt.zero_grad(set_to_none=True)
            l2 = fwd_loss(m, i)
            sc.scale(l2).backward()
            return l2
        sc.step(opt, closure)  # @sam-step
        after[i] = [p.grad.detach().clone() for p in m.parameters()]
        sc.update()

    rep, raised = run(m, body, steps=SAM_START + 4, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: GradScaler passed the closure on to optimizer.step, which ran it after unscale_: the gradients the step
    # used (left in .grad) are the true ones x 1024
    r = {i: ratio(after[i], want[i]) for i in after}
    assert all(near(after[i], want[i], SCALE) for i in after), r
    expect(rep, "scaler_misorder", SAM_START, "sam-step")


# ======================================================================================================================
# A9. the head's optimizer rebuilt at the unfreeze; the unscale_ list still holds the old one
# ======================================================================================================================
def rebuilt_run(ok):
    m = net()
    opt = torch.optim.SGD(m.body.parameters(), lr=0.05)
    opt_head = torch.optim.SGD(m.head.parameters(), lr=0.0)  # the head trains from UNFREEZE
    sc = scaler()
    trainer = {"opts": [opt, opt_head], "head": opt_head}
    head_stepped, head_want, losses = [], [], []

    def body(i):
        if i == UNFREEZE:  # unfreeze: a fresh optimizer for the head with its own lr
            new = torch.optim.SGD(m.head.parameters(), lr=0.05)  # @rebuild
            new.register_step_pre_hook(
                lambda o, a, k: head_stepped.append([p.grad.detach().clone() for p in m.head.parameters()]))
            trainer["head"] = new
            if ok:
                trainer["opts"] = [opt, new]
        for o in trainer["opts"]:
            o.zero_grad(set_to_none=True)
        if i >= UNFREEZE:
            head_want.append(true_grads(m, i, params={"head.weight", "head.bias"}))
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        for o in trainer["opts"]:
            sc.unscale_(o)  # @list-unscale
        torch.nn.utils.clip_grad_norm_(m.parameters(), 100.0)
        sc.step(opt)
        sc.step(trainer["head"])  # @head-step
        sc.update()
        losses.append(loss.item())

    rep, raised = run(m, body, steps=14, optimizer=opt, scaler=sc)
    assert raised is None, raised
    return rep, head_stepped, head_want, losses


def test_a9_rebuilt_head_optimizer_unscaled_through_the_stale_one():
    rep, got, want, _ = rebuilt_run(ok=False)
    # real: the old optimizer's unscale_ divided the head's gradients in place, and scaler.step(new) divided them again
    assert len(got) == 14 - UNFREEZE
    assert all(near(g, w, 1 / SCALE) for g, w in zip(got, want)), [ratio(g, w) for g, w in zip(got, want)]
    expect(rep, "scaler_misorder", UNFREEZE, ("list-unscale", "head-step"))


def test_a9_twin_the_list_holds_the_new_optimizer_is_quiet():
    rep, got, want, losses = rebuilt_run(ok=True)
    assert all(near(g, w) for g, w in zip(got, want)), [ratio(g, w) for g, w in zip(got, want)]
    learned(losses)
    quiet(rep)


# ======================================================================================================================
# A10. logging steps unscale_ after scaler.step "to log the true gradient norm"
# ======================================================================================================================
def log_after_step_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    logged, true_norm, losses = [], [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        log = i % LOG_EVERY == 0 and i > 0
        if log:
            true_norm.append(gnorm(true_grads(m, i)))
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 100.0)
        sc.step(opt)
        if log:  # a logging step: the (unscaled) gradient norm for the dashboard
            if not ok:
                sc.unscale_(opt)  # @late-unscale
            logged.append(gnorm([p.grad for p in m.parameters()]))
        sc.update()
        losses.append(loss.item())

    rep, raised = run(m, body, steps=22, optimizer=opt, scaler=sc)
    return rep, raised, logged, true_norm, losses


def test_a10_logging_step_unscales_after_the_step_at_step_10():
    rep, raised, _, _, _ = log_after_step_run(ok=False)
    # real: GradScaler refuses an unscale_ after step() ("unscale_() is being called after step()") at iteration 10
    assert raised is not None and raised[0] == LOG_EVERY and "after step()" in raised[1], raised
    expect(rep, "scaler_misorder", LOG_EVERY, "late-unscale")


def test_a10_twin_logging_step_reads_the_already_unscaled_norm_is_quiet():
    rep, raised, logged, true_norm, losses = log_after_step_run(ok=True)
    # correct: after scaler.step the gradients are the unscaled ones (what the clip saw)
    assert raised is None and len(logged) == 2, raised
    assert all(abs(n / t - 1) < 0.05 for n, t in zip(logged, true_norm)), (logged, true_norm)
    learned(losses)
    quiet(rep)
