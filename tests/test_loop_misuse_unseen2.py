"""Loop misuse probes, second unseen set: GradScaler / optimizer misuses in shapes that tests/test_loop_misuse2-9.py,
test_loop_misuse_unseen.py, test_scaler_found.py and benchmarks/realworld/loops.py MISUSES do not build, beside
correct loops that look unusual. Each runs probe_harness.misuse_net for 6-16 iterations under fp16 CPU autocast +
torch.amp.GradScaler("cpu"), watched through the public API only (`ampdoctor.watch(model, optimizer=...,
scaler=...)`, default settings, `w.close()`, `w.report()`).

Every misuse first checks that its harm is real, by the test's own measurement (the gradients an optimizer stepped on
vs the true gradients recomputed on a copy, weights that never move or turn non-finite, the scaler's own skips,
torch's own exception); then the CONTRACT rule among the first three findings, at the stated severity and step and,
for call-order rules, at the user's wrong call's `# @tag` line (probe_harness.expect; scaler_misorder with its call
sequence). A wrong report raises WrongAnswer (a strict xfail `wrong(...)` quoting ampdoctor's answer).

Misuse:
 N1. `scaler = torch.amp.GradScaler("cpu")` written INSIDE the loop body (a new scaler every iteration, default
     init_scale 2**16) on a sum-reduced loss whose scaled backward overflows at 2**16: every step is skipped and the
     scale never gets to back off (weights never move): skipped_steps or loss_scale_collapse, error.
 N2. `scaler.unscale_(opt)` at the TOP of the iteration, right after `zero_grad(set_to_none=False)` and before the
     scaled backward ("unscale once the gradients are reset"). warm=0 (from the first iteration): torch raises
     "Attempted unscale_ but _scale is None" at iteration 0; warm=2 (a refactored train_step from step 2, the
     scaler already scaling): the zeros are unscaled, the scaled gradients arrive after, and scaler.step applies
     them x1024 (SGD, silent). Both: scaler_misorder, error, at step `warm`, at the unscale_ line.
 N3. unscale_ + clip, then `optimizer.step()` instead of `scaler.step(optimizer)` (update() still called): the inf
     gradients of the opening overflow (init_scale 2**24) are stepped on and the weights turn non-finite at step 0:
     scaler_misorder, error, step 0, at the optimizer.step() line.
 N4. the loss scaled by a helper's OWN GradScaler (`LossHelper.backward`) while unscale_/step/update go through the
     loop's scaler (the one watched), which therefore never scaled anything: its unscale_ raises "Attempted unscale_
     but _scale is None" at iteration 0: scaler_misorder, error, step 0, at the helper's scale or the unscale_ line.
 N5. `optimizer.zero_grad(set_to_none=False)` moved between unscale_ + clip and scaler.step ("clear right after
     clipping"): scaler.step steps on zeros, SGD never trains: scaler_misorder, error, step 0, at that line.
 N6. an L2 penalty backpropagated AFTER unscale_ + clip ("so the clip doesn't touch it"): `scaler.scale(pen)
     .backward()` adds scaled gradients that scaler.step will not unscale again (penalty gradient x1024):
     scaler_misorder, error, step 0, at the penalty's backward line or the unscale_ that ran before it.
 N7. `if scaler.step(opt) is not None: scaler.update()` ("update only after a real step"; optimizer.step returns
     None, so update() never runs): iteration 1's unscale_ raises "unscale_() is being called after step()":
     missing_scaler_update, error, step 0, at the scaler.step line.
 N8. `GradScaler(init_scale=2**24, backoff_factor=0.9)` ("a gentle backoff"): from 2**24 the scale needs ~50 skips
     to get below fp16's overflow; every one of the 16 steps is skipped: skipped_steps or loss_scale_collapse, error.

Healthy (no warning, no error; each checked to train):
 H1. `GradScaler("cpu", enabled=False)` under fp16 autocast (every scaler call a no-op pass-through).
 H2. `scheduler.step()` at the TOP of the iteration, before the optimizer's step (torch's own UserWarning on order;
     not an AMP fault).
 H3. a deferred step: backward + unscale_ + clip at the end of iteration i, scaler.step + update + zero_grad at the
     start of iteration i+1 (the order the scaler sees is the usual one).
 H4. N3's careful twin: unscale_ + clip, `if math.isfinite(norm): optimizer.step()`, then update() (the skip the
     scaler would do, done by hand; unscale_ recorded the infs, so update() backs off as usual).
 H5. the whole iteration (backward, unscale_, clip, step, update) written inside the `with torch.autocast(...)`
     block.

Result when written (14 tests, N2 run twice: 13 pass, 1 strict xfail; ~2.5 s of tests, ~4.5 s in all):
 - H4 (isfinite-guarded optimizer.step after unscale_, then update()) drew '[error] scaler_misorder ...
   `optimizer.step()` at ...:LINE was called directly after `scaler.unscale_()`: GradScaler's inf check is
   bypassed'; the loop's own `if math.isfinite(norm)` is that check (steps 0 and 3 overflowed and were skipped).
   Fixed since (the same session): rules/callseq._guards_direct_steps - a step whose unscale_ found inf and that
   has no optimizer step at all, and no direct step on a step that found inf, is the loop guarding its own steps;
   quiet now. (N3, the same call without the guard, stays this error at its line: its step 0 stepped on inf.)
Right: N1 and N8 (skipped_steps / loss_scale_collapse error), N2 (both variants: scaler_misorder at the top-of-loop
unscale_ line, step 0 / step 2), N3 (scaler_misorder at the optimizer.step() line), N4 (scaler_misorder at step 0),
N5 (scaler_misorder at the zero_grad line), N6 (scaler_misorder at step 0: the finding names the unscale_ that ran
before the penalty's scaled backward), N7 (missing_scaler_update at the scaler.step line), H1, H2, H3, H5 quiet.
"""
import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F

from scenarios import one_thread
from probe_harness import (keep_stepped, learned, misuse_batch, misuse_named, misuse_net,
                           misuse_quiet, near, ratio, run_misuse)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
SCALE = 1024.0
ERR = ("error",)
ALARM = ("warning", "error")

net = misuse_net
batch = misuse_batch


def scaler(init=SCALE, **kw):
    return torch.amp.GradScaler("cpu", init_scale=init, **kw)


def fwd_loss(m, i, reduction="mean"):
    x, y = batch(i)
    with torch.autocast(**FP16):
        out = m(x)
    return F.mse_loss(out.float(), y, reduction=reduction)


def true_grads(m, idx):
    """The unscaled gradients of fwd_loss over batches `idx` at m's weights, on a copy."""
    c = copy.deepcopy(m)
    c.zero_grad(set_to_none=True)
    for i in idx:
        fwd_loss(c, i).backward()
    return [p.grad.detach().clone() for p in c.parameters()]


def weights(m):
    return [p.detach().clone() for p in m.parameters()]


def named(rep, rule, step, tags=None, severity=ERR):
    return misuse_named(rep, rule, step, tags, severity, src=HERE)


quiet = misuse_quiet


# ======================================================================================================================
# N1. a new GradScaler every iteration
# ======================================================================================================================
def test_n1_gradscaler_created_inside_the_loop_body():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    w0 = weights(m)
    skipped = []

    def body(i):
        sc = torch.amp.GradScaler("cpu")  # @n1-new
        opt.zero_grad(set_to_none=True)
        sc.scale(fwd_loss(m, i, "sum")).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        s0 = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            skipped.append(i)

    rep, raised = run_misuse(m, body, steps=10, optimizer=opt)
    assert raised is None, raised
    # real: every step skipped at 2**16, the weights never moved (a kept scaler would back off and train)
    assert skipped == list(range(10)), skipped
    assert all(torch.equal(a, b) for a, b in zip(w0, m.parameters()))
    named(rep, ("skipped_steps", "loss_scale_collapse"), None)


# ======================================================================================================================
# N2. unscale_ at the top of the iteration, before the scaled backward
# ======================================================================================================================
@pytest.mark.parametrize("warm", [0, 2])
def test_n2_unscale_before_the_scaled_backward(warm):
    """warm=0: from the first iteration (torch raises at once: the scaler has no scale yet); warm=2: after two
    iterations in the recipe's order (a refactored train_step from step 2 on): silent, the steps apply x1024."""
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-5)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))
    want = []

    def body(i):
        opt.zero_grad(set_to_none=False)
        if i >= warm:
            sc.unscale_(opt)  # @n2-unscale
        want.append(true_grads(m, [i]))
        sc.scale(fwd_loss(m, i)).backward()
        if i < warm:
            sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        sc.step(opt)
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    if warm == 0:
        assert raised is not None and raised[0] == 0 and "_scale is None" in raised[1], raised
    else:
        assert raised is None, raised
        # real: the first `warm` steps got the true gradients, every later one the still-scaled gradients (x1024)
        assert all(near(s, w, 1.0 if k < warm else SCALE) for k, (s, w) in enumerate(zip(stepped, want))), \
            [ratio(s, w) for s, w in zip(stepped, want)]
    named(rep, "scaler_misorder", warm, "n2-unscale")


# ======================================================================================================================
# N3 / H4. optimizer.step() instead of scaler.step() after unscale_ (and its isfinite-guarded twin)
# ======================================================================================================================
def direct_step_body(m, opt, sc, guarded, log):
    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0))
        if guarded:
            if math.isfinite(norm):
                opt.step()  # @h4-step
        else:
            opt.step()  # @n3-step
        sc.update()
        log.append((loss.item(), norm, sc.get_scale(), all(bool(torch.isfinite(p).all()) for p in m.parameters())))
    return body


def test_n3_optimizer_step_instead_of_scaler_step_after_unscale():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler(init=2.0 ** 24)
    log = []
    rep, raised = run_misuse(m, direct_step_body(m, opt, sc, False, log), steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: step 0's gradients overflowed (norm inf) and were stepped on: the weights are non-finite after step 0
    assert not math.isfinite(log[0][1]) and not log[0][3], log[:2]
    named(rep, "scaler_misorder", 0, "n3-step")


def test_h4_twin_optimizer_step_guarded_by_isfinite_is_quiet():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler(init=2.0 ** 18)
    log = []
    rep, raised = run_misuse(m, direct_step_body(m, opt, sc, True, log), steps=12, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: steps 0 and 3 overflowed and the guard skipped them (weights stay finite, the scale backed off)
    assert [k for k, e in enumerate(log) if not math.isfinite(e[1])] == [0, 3] and all(e[3] for e in log), log
    assert log[-1][2] < 2.0 ** 18, log
    learned([e[0] for e in log])
    quiet(rep)


# ======================================================================================================================
# N4. the loss scaled by a helper's own GradScaler, unscaled/stepped by the loop's
# ======================================================================================================================
class LossHelper:
    """A project's loss wrapper that "supports AMP" by owning a scaler."""

    def __init__(self):
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)

    def backward(self, loss):
        self.scaler.scale(loss).backward()  # @n4-scale


def test_n4_loss_scaled_by_another_gradscaler():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-5)
    sc = scaler()
    helper = LossHelper()
    stepped = keep_stepped(opt, list(m.parameters()))
    want = []

    def body(i):
        opt.zero_grad(set_to_none=True)
        want.append(true_grads(m, [i]))
        helper.backward(fwd_loss(m, i))
        sc.unscale_(opt)  # @n4-unscale
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        sc.step(opt)  # @n4-step
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    # real: the loop's scaler never scaled anything, so its unscale_ raises at iteration 0 (nothing was stepped)
    assert raised is not None and raised[0] == 0 and "_scale is None" in raised[1], raised
    assert stepped == [] and len(want) == 1
    named(rep, "scaler_misorder", 0, ("n4-scale", "n4-unscale"))


# ======================================================================================================================
# N5. zero_grad(set_to_none=False) between unscale_ + clip and scaler.step
# ======================================================================================================================
def test_n5_zero_grad_keep_between_unscale_and_step():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    w0 = weights(m)
    norms = []

    def body(i):
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)))
        opt.zero_grad(set_to_none=False)  # @n5-zero
        sc.step(opt)
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: the gradients were nonzero, but every step stepped on zeros: SGD never moved the weights
    assert min(norms) > 1e-3 and all(torch.equal(a, b) for a, b in zip(w0, m.parameters())), norms
    named(rep, "scaler_misorder", 0, "n5-zero")


# ======================================================================================================================
# N6. a penalty's scaled backward after unscale_ + clip
# ======================================================================================================================
def test_n6_penalty_backward_after_unscale():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    sc = scaler()
    LAM = 1e-3
    stepped = keep_stepped(opt, list(m.parameters()))
    main, pen = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        main.append(true_grads(m, [i]))
        pen.append([2 * LAM * p.detach().clone() for p in m.parameters()])
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)  # @n6-unscale
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        l2 = LAM * sum(p.pow(2).sum() for p in m.parameters())
        sc.scale(l2).backward()  # @n6-backward
        sc.step(opt)
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: the stepped gradient is main + 1024 x the penalty's (should be main + penalty)
    extra = [[s - g for s, g in zip(st, mg)] for st, mg in zip(stepped, main)]
    assert all(near(e, p, SCALE) for e, p in zip(extra, pen)), [ratio(e, p) for e, p in zip(extra, pen)]
    named(rep, "scaler_misorder", 0, ("n6-backward", "n6-unscale"))


# ======================================================================================================================
# N7. update() only when scaler.step() returns something
# ======================================================================================================================
def test_n7_update_only_if_step_returned_something():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    rets = []

    def body(i):
        opt.zero_grad(set_to_none=True)
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        ret = sc.step(opt)  # @n7-step
        rets.append(ret)
        if ret is not None:
            sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    # real: step 0 was not skipped (scale unchanged, no inf) but returned None: update() never ran
    assert rets == [None], rets
    assert raised is not None and raised[0] == 1 and "unscale_() is being called after step()" in raised[1], raised
    named(rep, "missing_scaler_update", 0, "n7-step")


# ======================================================================================================================
# N8. backoff_factor=0.9 from 2**24: a skip storm
# ======================================================================================================================
def test_n8_gentle_backoff_factor_skips_every_step():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler(init=2.0 ** 24, backoff_factor=0.9)  # @n8-scaler
    w0 = weights(m)
    skipped = []

    def body(i):
        opt.zero_grad(set_to_none=True)
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        s0 = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            skipped.append(i)

    rep, raised = run_misuse(m, body, steps=16, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: all 16 steps skipped (the default backoff 0.5 would have needed 9), the weights never moved
    assert skipped == list(range(16)) and all(torch.equal(a, b) for a, b in zip(w0, m.parameters())), skipped
    named(rep, ("skipped_steps", "loss_scale_collapse"), None)


# ======================================================================================================================
# Healthy loops
# ======================================================================================================================
def plain_body(m, opt, sc, losses, sched=None, sched_first=False):
    def body(i):
        if sched is not None and sched_first:
            sched.step()
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    return body


def test_h1_disabled_scaler_under_fp16_autocast_is_quiet():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", enabled=False)
    losses = []
    rep, raised = run_misuse(m, plain_body(m, opt, sc, losses), steps=10, optimizer=opt, scaler=sc)
    assert raised is None and not sc.is_enabled(), raised
    learned(losses)
    quiet(rep)


def test_h2_scheduler_stepped_before_the_optimizer_is_quiet():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    sc = scaler()
    losses = []
    with pytest.warns(UserWarning, match="lr_scheduler.step"):
        rep, raised = run_misuse(m, plain_body(m, opt, sc, losses, sched, True), steps=10, optimizer=opt, scaler=sc)
    assert raised is None, raised
    learned(losses)
    quiet(rep)


def test_h3_deferred_step_at_the_next_iteration_is_quiet():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    losses = []

    def body(i):
        if i > 0:
            sc.step(opt)
            sc.update()
            opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        losses.append(loss.item())

    rep, raised = run_misuse(m, body, steps=12, optimizer=opt, scaler=sc)
    assert raised is None, raised
    learned(losses)
    quiet(rep)


def test_h5_whole_iteration_inside_the_autocast_block_is_quiet():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    losses = []

    def body(i):
        x, y = batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
            sc.step(opt)
            sc.update()
        losses.append(loss.item())

    rep, raised = run_misuse(m, body, steps=10, optimizer=opt, scaler=sc)
    assert raised is None, raised
    learned(losses)
    quiet(rep)
