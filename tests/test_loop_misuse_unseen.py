"""Loop misuse probes, unseen set: GradScaler / optimizer / clipping misuses written as practitioners write them, in
shapes the other loop-misuse files (test_loop_misuse2-9) do not build, plus healthy loops that look unusual but are
correct. Each runs a tiny model (probe_harness.misuse_net, or a small multi-task net) for 6-12 iterations under
fp16 CPU autocast + torch.amp.GradScaler("cpu"), watched through the public API only (`ampdoctor.watch(model,
optimizer=..., scaler=...)`, default settings, `w.close()`, `w.report()`).

Every misuse is the loop's own code; the test first checks that its harm is real (torch's own exception at the
expected iteration, the gradients an optimizer stepped on vs the true gradients recomputed on a copy, the norm a clip
saw, the dtype of the parameters, the scaler's skips); where torch raises, the report of what ran is checked. Then:
the CONTRACT rule among the first three findings, warning/error as stated, at the stated step and, for call-order
rules, at the user's wrong call's `# @tag` line (probe_harness.expect; scaler_misorder with its call sequence). A
wrong report raises WrongAnswer (a strict xfail `wrong(...)` quoting ampdoctor's answer); a failing oracle or a crash
is a plain failure.

Misuse:
 U1. 3-way gradient accumulation that clips after EVERY micro-batch's scaled backward, over
     `itertools.chain(*(g["params"] for g in opt.param_groups))`, and never calls unscale_ (scaler.step unscales):
     clip_before_unscale, error, step 0, at the per-micro-batch clip line.
 U2. accumulation switched on from step 3 (1 micro-batch for steps 0-2, then 2) with a `log_grad_norm()` helper
     called after every micro-batch that does `scaler.unscale_(opt)` + get_total_norm: harmless while accum is 1;
     torch raises "unscale_() has already been called" at iteration 3's 2nd micro-batch: scaler_misorder, error,
     step 3, at the helper's unscale_ line.
 U3. weights and biases split into two optimizers ("no weight decay on biases"): AdamW(weights) through
     scaler.unscale_/scaler.step, SGD(biases) stepped directly with `opt_b.step()` (bias updates x1024, silent);
     watch given the AdamW: scaler_misorder, error, step 0, at the opt_b.step() line.
 U4. an `AmpStep` context manager whose `__exit__` does unscale_ + clip + scaler.update(), the loop calling
     scaler.step(opt) AFTER the with block: update() resets the scaler, scaler.step unscales again (step-0 update
     /1024, silent), and iteration 1's unscale_ raises "unscale_() is being called after step()": scaler_misorder,
     error, step 0, at the update or the step line.
 U5. `scaler.scale(loss).item()` used only for the metrics dict, then `loss.backward()` of the raw loss, then
     unscale_ + clip + step + update (every update /1024, silent): scaler_misorder, error, step 0, at the scale, the
     backward or the step line.
 U6. "clipping through the learning rate": the norm from torch.nn.utils.get_total_norm read BEFORE unscale_ sets
     lr = base_lr * min(1, max_norm / norm); the scaled norm makes every lr ~1000x too small: clip_before_unscale
     (warning or error: a norm read), step 0, at the get_total_norm line.
 U7. the forum recipe "clip as gradients arrive": `p.register_hook(lambda g: g.clamp(-c, c))` on every parameter,
     under `scaler.scale(loss).backward()`: every scaled gradient element is clamped to c, i.e. c/1024 after
     unscale_: clip_before_unscale, error, step 0 (no line asked: no clipping API is called).
 U8. `from torch.nn.utils import clip_grad_value_` at this module's import (bound before watch()), called right
     after the scaled backward, no unscale_ anywhere: clip_before_unscale, error, step 0, at that line.
 U9. the typo `scaler.update` (no parentheses; nothing flags it) after scaler.step: iteration 1's unscale_ raises
     "unscale_() is being called after step()": missing_scaler_update, error, step 0, at the scaler.step line.
U10. `torch.set_default_dtype(torch.float16)` around the model's construction ("halve the weights' memory"), then an
     AdamW + GradScaler loop: the optimizer holds fp16 parameters and unscale_ raises "Attempting to unscale FP16
     gradients." at iteration 0: fp16_master_weights, error, step 0.
U11. a gradient penalty computed from `torch.autograd.grad(scaler.scale(loss), params, create_graph=True)` WITHOUT
     the AMP recipe's division by the scale: the penalty is scale^2 x the true one: clip_before_unscale (the
     gradients' norm read while scaled) or scaler_misorder, warning or error, step 0.
U12. `GradScaler(init_scale=2**16, growth_interval=1)` ("recover the scale at once") on a sum-reduced regression
     loss: after the opening search (4 skips, 65536 -> 4096) the scale doubles after every good step into an overflow
     and backs off again, so half of the remaining steps are skipped too (8 of 12 in all): skipped_steps (or
     loss_scale_collapse), warning or error.

Healthy (no warning, no error at all; each checked to train):
 H1. OneCycleLR's scheduler.step() placed between unscale_ + clip and scaler.step (torch's own UserWarning on
     order; not an AMP fault).
 H2. a multi-task net: three heads' losses each `scaler.scale(l_k).backward(retain_graph=k < 2)`, then one
     unscale_ + clip + step + update.
 H3. 4-way accumulation dividing AFTER scale, in place: `scaler.scale(loss).div_(4).backward()`, unscale_ + clip
     at the boundary.
 H4. a checkpoint round-trip at step 5 (model / optimizer / scaler state dicts through torch.save into a buffer and
     loaded back into the same objects) and an EMA AveragedModel updated after every update().
 H5. one `torch.autograd.backward(scaler.scale([main, aux]))` on the list GradScaler.scale returns.

Result when written: 13 pass, 4 xfail (strict; each reason gives what ampdoctor reported instead); U12, U8 and U11
fixed since, and U7 (17 pass):
 - U7 (tensor-hook clamp; fixed since: a sampled step records which parameters the user hooks, and their largest
   gradients at one round bound times the scale are clip_before_unscale, tests/test_hook_clamp_scaled.py): empty
   report. Should be clip_before_unscale, error, step 0.
 - U8 (clip_grad_value_ bound at import; fixed since: record/monitor.py sees it where it groups the gradients,
   tests/test_clip_value_early_bound.py): empty report. The same loop calling `torch.nn.utils.clip_grad_value_`
   through the module attribute gives '[error] clip_before_unscale ... step 0' at the right line, so the early
   binding is what hides it (clip_grad_value_ has no inner clipping function that a watch could see instead).
 - U11 (gradient penalty on scaled gradients; fixed since: the scaled loss's node hook sees a backward with
   create_graph and ScalerPatch counts get_scale() reads, so a loss built from those gradients and scaled again with
   no read between is clip_before_unscale, tests/test_gradient_penalty_scaled.py): only '[info] skipped_steps at (run)
   step 0: GradScaler skipped 2 of 8 steps; a normal rate'. Should be clip_before_unscale (norm read while scaled) or
   scaler_misorder.
  - U12 (growth_interval=1; fixed since): '[info] overflow at head step 1 ... GradScaler skipped them and lowered the scale, as
   designed' and '[info] skipped_steps at (run) step 0: GradScaler skipped 8 of 12 steps; a normal rate'. 4 of the
   8 steps after the opening search skipped is not a normal rate (the mean-reduced loss, whose search is shorter,
   does get '[error] skipped_steps ... 6 of 12 steps after warm-up (50%)'). Should be skipped_steps, warning/error.
Right: U1 (clip_before_unscale at the per-micro-batch clip), U2 (scaler_misorder at step 3 at the helper's unscale_),
U3 (scaler_misorder at the opt_b.step() line), U4 (scaler_misorder at step 0), U5 (scaler_misorder at step 0), U6
(clip_before_unscale at the get_total_norm line), U9 (missing_scaler_update at step 0 at the scaler.step line), U10
(fp16_master_weights at step 0), and every healthy loop H1-H5 quiet.
"""
import copy
import io
import itertools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_value_  # (U8: bound at import, before any watch)

from scenarios import one_thread
from probe_harness import (gnorm, keep_stepped, learned, misuse_batch, misuse_named, misuse_net,
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


def fwd_loss(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        out = m(x)
    return F.mse_loss(out.float(), y)


def true_grads(m, idx, div=1.0):
    """The unscaled gradients of the summed fwd_loss over batches `idx` (each / div) at m's weights, on a copy."""
    c = copy.deepcopy(m)
    c.zero_grad(set_to_none=True)
    for i in idx:
        (fwd_loss(c, i) / div).backward()
    return [p.grad.detach().clone() for p in c.parameters()]


def named(rep, rule, step, tags=None, severity=ERR):
    return misuse_named(rep, rule, step, tags, severity, src=HERE)


quiet = misuse_quiet


# ======================================================================================================================
# U1. clip after every micro-batch of an accumulation loop, over the optimizer's param groups, no unscale_
# ======================================================================================================================
def test_u1_clip_every_microbatch_over_param_groups_no_unscale():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    ACC = 3
    seen, want0 = [], true_grads(m, [0])

    def body(i):
        for k in range(ACC):
            sc.scale(fwd_loss(m, ACC * i + k) / ACC).backward()
            group_params = itertools.chain(*(g["params"] for g in opt.param_groups))
            seen.append(float(torch.nn.utils.clip_grad_norm_(group_params, 5.0)))  # @u1-clip
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: the first clip saw the scaled norm of micro-batch 0 (its true norm / 3 x 1024), above max_norm 5
    true0 = gnorm(want0) / ACC
    assert true0 < 5.0 and abs(seen[0] / (SCALE * true0) - 1) < 0.02, (seen[0], true0)
    named(rep, "clip_before_unscale", 0, "u1-clip")


# ======================================================================================================================
# U2. a grad-norm logging helper unscales after every micro-batch; accumulation switched on at step 3
# ======================================================================================================================
def log_grad_norm(sc, opt, params):
    sc.unscale_(opt)  # @u2-unscale
    return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))


def test_u2_unscale_every_microbatch_once_accumulation_starts():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    norms, seen_iters = [], []

    def body(i):
        accum = 1 if i < 3 else 2
        seen_iters.append(i)
        for k in range(accum):
            sc.scale(fwd_loss(m, 2 * i + k) / accum).backward()
            norms.append(log_grad_norm(sc, opt, list(m.parameters())))
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is not None and raised[0] == 3 and "unscale_() has already been called" in raised[1], raised
    assert len(norms) == 4, norms          # steps 0-2, then the first micro-batch of step 3
    named(rep, "scaler_misorder", 3, "u2-unscale")


# ======================================================================================================================
# U3. weights via the scaler, biases via a second optimizer stepped directly
# ======================================================================================================================
def test_u3_bias_optimizer_stepped_directly_beside_scaler_step():
    m = net()
    weights = [m.body.weight, m.head.weight]
    biases = [m.body.bias, m.head.bias]
    opt_w = torch.optim.AdamW(weights, lr=1e-2, weight_decay=0.01)
    opt_b = torch.optim.SGD(biases, lr=1e-4)
    sc = scaler()
    stepped_b = keep_stepped(opt_b, biases)
    want = []

    def body(i):
        opt_w.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
        want.append(true_grads(m, [i]))
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt_w)
        torch.nn.utils.clip_grad_norm_(weights, 10.0)
        sc.step(opt_w)
        opt_b.step()  # @u3-step
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt_w, scaler=sc)
    assert raised is None, raised
    # real: the bias optimizer stepped on the scaled bias gradients (x1024)
    bias_want = [[w[1], w[3]] for w in want]
    assert all(near(s, b, SCALE) for s, b in zip(stepped_b, bias_want)), \
        [ratio(s, b) for s, b in zip(stepped_b, bias_want)]
    named(rep, "scaler_misorder", 0, "u3-step")


# ======================================================================================================================
# U4. a context manager whose __exit__ updates the scaler; scaler.step after the with block
# ======================================================================================================================
class AmpStep:
    """`with AmpStep(...) as st: st.backward(loss)`; on exit: unscale_, clip, update."""

    def __init__(self, scaler, opt, params, max_norm=10.0):
        self.scaler, self.opt, self.params, self.max_norm = scaler, opt, params, max_norm

    def __enter__(self):
        self.opt.zero_grad(set_to_none=True)
        return self

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def __exit__(self, typ, val, tb):
        if typ is None:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
            self.scaler.update()  # @u4-update
        return False


def test_u4_context_manager_updates_before_the_step_after_it():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))
    want = []

    def body(i):
        with AmpStep(sc, opt, list(m.parameters())) as st:
            want.append(true_grads(m, [i]))
            st.backward(fwd_loss(m, i))
        sc.step(opt)  # @u4-step

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is not None and raised[0] == 1 and "unscale_() is being called after step()" in raised[1], raised
    # real: step 0 applied the true gradient divided by the scale a second time
    assert len(stepped) == 1 and near(stepped[0], want[0], 1 / SCALE), ratio(stepped[0], want[0])
    named(rep, "scaler_misorder", 0, ("u4-update", "u4-step"))


# ======================================================================================================================
# U5. the scaled loss only logged; the raw loss backpropagated
# ======================================================================================================================
def test_u5_scaled_loss_logged_raw_loss_backpropagated():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))
    want, log = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        want.append(true_grads(m, [i]))
        loss = fwd_loss(m, i)
        metrics = {"loss": sc.scale(loss).item() / sc.get_scale(), "scale": sc.get_scale()}  # @u5-scale
        loss.backward()  # @u5-backward
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        sc.step(opt)  # @u5-step
        sc.update()
        log.append(metrics)

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    assert all(near(s, w, 1 / SCALE) for s, w in zip(stepped, want)), [ratio(s, w) for s, w in zip(stepped, want)]
    named(rep, "scaler_misorder", 0, ("u5-scale", "u5-backward", "u5-step"))


# ======================================================================================================================
# U6. "clipping through the learning rate" from the norm read before unscale_
# ======================================================================================================================
def test_u6_lr_clipping_from_the_scaled_total_norm():
    m = net()
    BASE_LR, MAX_NORM = 0.05, 5.0
    opt = torch.optim.SGD(m.parameters(), lr=BASE_LR)
    sc = scaler()
    lrs, true_norms = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        true_norms.append(gnorm(true_grads(m, [i])))
        sc.scale(fwd_loss(m, i)).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])  # @u6-norm
        for g in opt.param_groups:
            g["lr"] = BASE_LR * min(1.0, MAX_NORM / (float(norm) + 1e-6))
        lrs.append(opt.param_groups[0]["lr"])
        sc.step(opt)
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: every true norm is below MAX_NORM (the lr should stay BASE_LR), but the lr was cut >100x
    assert max(true_norms) < MAX_NORM and max(lrs) < BASE_LR / 100, (true_norms, lrs)
    named(rep, "clip_before_unscale", 0, "u6-norm", severity=ALARM)


# ======================================================================================================================
# U7. gradient clamping in tensor hooks during the scaled backward
# ======================================================================================================================
def test_u7_tensor_hook_clamp_during_scaled_backward():
    m = net()
    CLIP = 0.5
    want0 = true_grads(m, [0])       # (before the hooks)
    for p in m.parameters():
        p.register_hook(lambda g: g.clamp(-CLIP, CLIP))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))

    def body(i):
        opt.zero_grad(set_to_none=True)
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        sc.step(opt)
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: every stepped element is at most CLIP / 1024, while the true gradients reach far above it
    top = max(float(g.abs().max()) for g in stepped[0])
    assert top <= CLIP / SCALE * 1.001 and max(float(g.abs().max()) for g in want0) > 20 * CLIP / SCALE, top
    named(rep, "clip_before_unscale", 0)


# ======================================================================================================================
# U8. clip_grad_value_ bound at import, right after the scaled backward, no unscale_
# ======================================================================================================================
def test_u8_import_bound_clip_grad_value_before_unscale():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))

    def body(i):
        opt.zero_grad(set_to_none=True)
        sc.scale(fwd_loss(m, i)).backward()
        clip_grad_value_(m.parameters(), 0.1)  # @u8-clip
        sc.step(opt)
        sc.update()

    want0 = true_grads(m, [0])
    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    top = max(float(g.abs().max()) for g in stepped[0])
    assert top <= 0.1 / SCALE * 1.001 and max(float(g.abs().max()) for g in want0) > 20 * 0.1 / SCALE, top
    named(rep, "clip_before_unscale", 0, "u8-clip")


# ======================================================================================================================
# U9. `scaler.update` without parentheses
# ======================================================================================================================
def test_u9_update_typo_without_call():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()

    def body(i):
        opt.zero_grad(set_to_none=True)
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        sc.step(opt)  # @u9-step
        sc.update

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is not None and raised[0] == 1 and "unscale_() is being called after step()" in raised[1], raised
    named(rep, "missing_scaler_update", 0, "u9-step")


# ======================================================================================================================
# U10. the model built under torch.set_default_dtype(torch.float16)
# ======================================================================================================================
def test_u10_model_built_under_fp16_default_dtype():
    torch.set_default_dtype(torch.float16)      # "halve the weights' memory"
    try:
        m = net()
    finally:
        torch.set_default_dtype(torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = scaler()

    def body(i):
        opt.zero_grad(set_to_none=True)
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        sc.step(opt)
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert all(p.dtype == torch.float16 for p in m.parameters())
    assert raised is not None and raised[0] == 0 and "Attempting to unscale FP16 gradients" in raised[1], raised
    named(rep, "fp16_master_weights", 0)


# ======================================================================================================================
# U11. a gradient penalty from the scaled loss's gradients, not divided by the scale
# ======================================================================================================================
def test_u11_gradient_penalty_on_scaled_gradients():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = scaler()
    LAM = 1e-4
    gps, true_gps = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        params = list(m.parameters())
        true_gps.append(sum(float(g.pow(2).sum()) for g in true_grads(m, [i])))
        loss = fwd_loss(m, i)
        grads = torch.autograd.grad(sc.scale(loss), params, create_graph=True)  # @u11-grad
        gp = sum(g.pow(2).sum() for g in grads)  # @u11-gp
        gps.append(float(gp.detach()))
        sc.scale(loss + LAM * gp).backward()  # @u11-backward
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        sc.step(opt)
        sc.update()

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: the penalty is scale^2 x the true squared gradient norm
    assert abs(gps[0] / (SCALE ** 2 * true_gps[0]) - 1) < 0.02, (gps[0], true_gps[0])
    named(rep, ("clip_before_unscale", "scaler_misorder"), 0, severity=ALARM)


# ======================================================================================================================
# U12. growth_interval=1: the scale grows into an overflow after every good step
# ======================================================================================================================
def test_u12_growth_interval_one_skips_every_other_step():
    """Wrong when written (a strict xfail: '[info] skipped_steps: 8 of 12 steps; a normal rate', since 4 later skips
    were under skipped_min); fixed since: three or more later skips that take 40% of a short run are no search's
    price (rules/backoff.py LATER_SKIPS_SHORT)."""
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = scaler(init=2.0 ** 16, growth_interval=1)
    skipped, scales = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        x, y = batch(i)
        with torch.autocast(**FP16):
            out = m(x)
        loss = F.mse_loss(out.float(), y, reduction="sum")
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
        s0 = sc.get_scale()
        scales.append(s0)
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            skipped.append(i)

    rep, raised = run_misuse(m, body, steps=12, optimizer=opt, scaler=sc)
    assert raised is None, raised
    # real: after the opening search (the first 4 steps) the scale keeps doubling into an overflow: half of the
    # remaining 8 steps are skipped too, and the scale never settles
    assert len([s for s in skipped if s >= 4]) >= 4 and any(s >= 10 for s in skipped), (skipped, scales)
    named(rep, ("skipped_steps", "loss_scale_collapse"), tuple(range(12)) + (None,), severity=ALARM)


# ======================================================================================================================
# Healthy loops
# ======================================================================================================================
def test_h1_onecycle_scheduler_between_unscale_and_step():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    sc = scaler()
    losses = []

    def body(i):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        sched.step()
        sc.step(opt)
        sc.update()
        losses.append(loss.item())

    rep, raised = run_misuse(m, body, steps=10, optimizer=opt, scaler=sc)
    assert raised is None, raised
    learned(losses)
    quiet(rep)


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 32)
        self.heads = nn.ModuleList(nn.Linear(32, 1) for _ in range(3))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return [hd(h) for hd in self.heads]


def test_h2_three_task_losses_each_scaled_and_backpropagated():
    m = MultiTask()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    losses = []

    def body(i):
        opt.zero_grad(set_to_none=True)
        x, y = batch(i)
        with torch.autocast(**FP16):
            outs = m(x)
        task = [F.mse_loss(o.float(), t) for o, t in zip(outs, (y, 2 * y, -y))]
        for k, lk in enumerate(task):
            sc.scale(lk).backward(retain_graph=k < len(task) - 1)
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        sc.step(opt)
        sc.update()
        losses.append(sum(float(v) for v in task))

    rep, raised = run_misuse(m, body, steps=10, optimizer=opt, scaler=sc)
    assert raised is None, raised
    learned(losses)
    quiet(rep)


def test_h3_accumulation_dividing_the_scaled_loss_in_place():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    ACC = 4
    stepped = keep_stepped(opt, list(m.parameters()))
    want, losses = [], []

    def body(i):
        want.append(true_grads(m, range(ACC * i, ACC * i + ACC), div=ACC))
        tot = 0.0
        for k in range(ACC):
            loss = fwd_loss(m, ACC * i + k)
            sc.scale(loss).div_(ACC).backward()
            tot += loss.item() / ACC
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 50.0)
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)
        losses.append(tot)

    rep, raised = run_misuse(m, body, steps=8, optimizer=opt, scaler=sc)
    assert raised is None, raised
    assert all(near(s, w) for s, w in zip(stepped, want)), [ratio(s, w) for s, w in zip(stepped, want)]
    learned(losses)
    quiet(rep)


def test_h4_checkpoint_roundtrip_and_ema_mid_run():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    ema = torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    losses = []

    def body(i):
        if i == 5:      # "resume test": save and load back into the same objects
            buf = io.BytesIO()
            torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict()}, buf)
            buf.seek(0)
            ck = torch.load(buf)
            m.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sc.load_state_dict(ck["scaler"])
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        sc.step(opt)
        sc.update()
        ema.update_parameters(m)
        losses.append(loss.item())

    rep, raised = run_misuse(m, body, steps=10, optimizer=opt, scaler=sc)
    assert raised is None, raised
    learned(losses)
    quiet(rep)


def test_h5_autograd_backward_on_the_scaled_list():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    stepped = keep_stepped(opt, list(m.parameters()))
    want, losses = [], []

    def body(i):
        opt.zero_grad(set_to_none=True)
        x, y = batch(i)
        c = copy.deepcopy(m)
        with torch.autocast(**FP16):
            o = c(x)
        (F.mse_loss(o.float(), y) + 1e-2 * o.float().pow(2).mean()).backward()
        want.append([p.grad.clone() for p in c.parameters()])
        with torch.autocast(**FP16):
            out = m(x)
        main = F.mse_loss(out.float(), y)
        aux = 1e-2 * out.float().pow(2).mean()
        torch.autograd.backward(sc.scale([main, aux]))
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 50.0)
        sc.step(opt)
        sc.update()
        losses.append(main.item())

    rep, raised = run_misuse(m, body, steps=10, optimizer=opt, scaler=sc)
    assert raised is None, raised
    assert all(near(s, w) for s, w in zip(stepped, want)), [ratio(s, w) for s, w in zip(stepped, want)]
    learned(losses)
    quiet(rep)

