"""Loop misuse probes, third unseen set: GradScaler / optimizer / clipping call-order mistakes as they appear in
framework-style code (a fastai-like callback Learner, the PyTorch DQN tutorial's in-place gradient clamp, DINO's
per-parameter `clip_gradients` switched on after a warm-up, a custom autograd "gradient clip layer", a CleanRL-style
PPO update, a "skip batches with NaN gradients" guard), shapes that tests/test_loop_misuse2-9.py,
test_loop_misuse_unseen.py / unseen2.py, test_integrations*.py and test_misuse_onset.py do not build. Each misuse has
a correct twin (the same loop, the mistake fixed) that must be quiet. Everything runs probe_harness.misuse_net (or a
variant with a clamp layer) under fp16 CPU autocast + torch.amp.GradScaler("cpu"), one intra-op thread, watched
through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=...)`, default settings, `w.close()`,
`w.report()`).

Every case runs twice, watched and unwatched, and the losses must be bitwise the same (probe_harness.same_losses).
The truth is proven first without ampdoctor: the loop's own event log (the order its calls ran in), the norm a clip
returned vs the true norm of a copy of the model, the gradients an optimizer stepped on vs the true ones, torch's own
exception, the scaler's scale history, weights that never move (a failing oracle is a plain failure). Then the
CONTRACT rule among the first three findings, at the step where the mistake first happens and, where a call of the
user's is the mistake, at that call's `# @tag` line (probe_harness.misuse_named; scaler_misorder with its call
sequence). A wrong report raises WrongAnswer: a strict xfail `wrong(...)` quoting what ampdoctor said.

Misuse (twin):
 M1. a fastai-like Learner whose callbacks run sorted by `order`: the user's GradientClip callback keeps the default
     order 0, so its `before_step` clips BEFORE the MixedPrecision callback's (order 10) `before_step` unscales.
     Truth: the event log reads clip, unscale; the clip returned 1024x the true norm (true 1.6 < max_norm 5: nothing
     should be clipped) and cut the total norm to max_norm/1024. clip_before_unscale, error, step 0, at the
     callback's clip line.
     (T1: `GradientClip.order = MixedPrecision.order + 1`, as fastai itself sets it.)
 M2. the PyTorch DQN tutorial's `for p in net.parameters(): p.grad.data.clamp_(-1, 1)` left between
     `scaler.scale(loss).backward()` and `scaler.step(opt)` (no unscale_). Truth: every stepped gradient element is
     at most 1/1024 while the true gradients reach far above it. clip_before_unscale, error, step 0, at the clamp
     line.                                                           (T2: `scaler.unscale_(opt)` before the clamp)
 M3. DINO's hand-written per-parameter `clip_gradients(model, clip)` (p.grad.data.norm(2), then mul_(clip_coef)),
     switched on after a warm-up (`if it >= WARMUP:`, WARMUP = 30) and called before any unscale_. Truth: from
     iteration 30 the per-parameter norms it reads are 1024x the true ones (all below `clip`, so nothing should be
     clipped) and it shrinks them to clip/1024. clip_before_unscale, error, step 30, at its norm or mul_ line.
                                                          (T3: `scaler.unscale_(opt)` before clip_gradients, as DINO)
 M4. a custom autograd Function "gradient clip layer" (`GradClamp.apply(h, 1.0)`: identity forward, grad_output
     clamped to +-1 in backward) between the body and the head, a safety bound the true gradients never reach. Under
     `scaler.scale(loss).backward()` it clamps the SCALED grad_output: 65-87% of its elements are clamped each step
     (true: none), and the body's stepped gradients are ~12x too small. clip_before_unscale, error, step 0 (no
     clipping API is called: no line asked).          (T4: the bound given in scaled units, `1.0 * scaler.get_scale()`)
 M5. a CleanRL-style PPO update converted to AMP: for each rollout, 2 epochs x 2 minibatches of scale().backward,
     unscale_, clip_grad_norm_(0.5), scaler.step(opt), and ONE `scaler.update()` after the epochs ("once per
     rollout, like the lr anneal"). Truth: the second minibatch's unscale_ raises "unscale_() is being called after
     step()" at rollout 0. missing_scaler_update, error, step 0, at the scaler.step line.
                                                       (T5: update() after every scaler.step)
 M6. a "skip batches with NaN/inf gradients" guard right after the scaled backward (`if not all(isfinite(p.grad)):
     zero_grad(); continue`), before unscale_/step/update, with the default init_scale 2**16 and a sum-reduced loss
     whose scaled backward overflows at that scale. Truth: every iteration is skipped by the guard, update() never
     runs, so the scale never backs off (65536 to the end) and the weights never move. scaler_misorder,
     skipped_steps or loss_scale_collapse, error, step 0.      (T6: no guard: scaler.step skips, update() backs off)
Healthy: H7. a BYOL/MoCo-style momentum (EMA) target network updated from the online weights AFTER unscale_ + clip
     and BEFORE scaler.step on every iteration (the target lags one step; not an AMP fault): quiet, and it trains.

Result when written: 9 pass, 4 xfail (strict; each reason quotes ampdoctor's answer).
 - M2 (DQN clamp_ of p.grad before scaler.step): an empty report (no finding at all). A hand-written in-place clamp of
   the scaled gradients is not seen; should be clip_before_unscale, error, step 0, at the clamp line. Fixed since
   (forty-first session; the line is no longer asked: an in-place clamp is no recorded call): the tensor-hook clamp
   test (rules/clipscaled._hook_clamped) also takes three or more parameters, half of all, whose largest gradient
   times the loss scale is one round bound: '[error] clip_before_unscale ... step 0: The gradients were clamped while
   still multiplied by the loss scale ... the largest gradient of 4 of the 4 parameters with gradients is the same
   value, 0.000977 = 1 / the loss scale 1024'.
 - M3 (DINO clip_gradients from step 30, before unscale_): an empty report. The per-parameter `p.grad.data.norm(2)`
   read and `mul_(clip_coef)` on scaled gradients are not seen; should be clip_before_unscale, error, step 30, at
   the norm or the mul_ line.
 - M4 (GradClamp autograd Function under the scaled backward): an empty report. Should be clip_before_unscale,
   error, step 0.
 - M6 (NaN guard before unscale_): only "[error] overflow at (run) step 0: The gradient reaching the model's output
   was already inf at step 0, with a finite loss: the loss computation's own backward, outside the watched model,
   overflowed (at loss scale 65536: a loss summed over many values, or its gradient cast to fp16)." That overflow is
   GradScaler's ordinary opening search (T6, the same loop without the guard, backs off in 6 steps and is quiet);
   the cause is that the guard skips update(), so the scale is pinned at 65536 and no step is ever taken: should
   be scaler_misorder (or skipped_steps / loss_scale_collapse), error, step 0. Fixed since (the same session): the
   recorder counts a zero_grad that clears inf/NaN scaled gradients before any unscale_/step as a thrown-away
   iteration with a GradScaler too (record/optsink.discards_iteration), and rules/ownscale.py `guard_skips` says
   `[error] skipped_steps at step 0: The loop threw away 12 of 12 iterations from step 0 on, behind GradScaler's
   back ... scaler.update() never lowered the loss scale (it stayed at 65536)`, first.
Right: M1 (clip_before_unscale, step 0, at the callback's clip line), M5 (missing_scaler_update, step 0, at the
scaler.step line), and every twin T1-T6 and H7 quiet.
"""
import copy
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import one_thread
from probe_harness import (gnorm, keep_stepped, learned, misuse_batch, misuse_both, misuse_loss, misuse_named,
                           misuse_net, misuse_quiet, misuse_run, misuse_scaler, misuse_true_grads, misuse_weights, near,
                           ratio, wrong)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
SCALE = 1024.0
ERR = ("error",)

net = misuse_net
batch = misuse_batch


scaler, fwd_loss, true_grads, weights = misuse_scaler, misuse_loss, misuse_true_grads, misuse_weights


run, both = misuse_run, misuse_both


def named(rep, rule, step, tags=None, severity=ERR):
    return misuse_named(rep, rule, step, tags, severity, src=HERE)


quiet = misuse_quiet


# ======================================================================================================================
# M1. fastai-like Learner: callbacks sorted by `order`, the clip callback before MixedPrecision's unscale_
# ======================================================================================================================
class Callback:
    order = 0


class MixedPrecision(Callback):
    order = 10

    def __init__(self, scaler):
        self.scaler = scaler

    def before_fit(self):
        self.learn.step_fn = lambda: self.scaler.step(self.learn.opt)

    def before_backward(self):
        self.learn.loss_grad = self.scaler.scale(self.learn.loss_grad)

    def before_step(self):
        self.learn.events.append("unscale")
        self.scaler.unscale_(self.learn.opt)

    def after_step(self):
        self.scaler.update()


class GradientClip(Callback):
    def __init__(self, max_norm=1.0, order=0):
        self.max_norm, self.order, self.norms = max_norm, order, []

    def before_step(self):
        self.learn.events.append("clip")
        params = self.learn.model.parameters()
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, self.max_norm)))  # @m1-clip


class Learner:
    def __init__(self, model, opt, cbs):
        self.model, self.opt, self.events = model, opt, []
        self.cbs = sorted(cbs, key=lambda cb: cb.order)
        self.step_fn = opt.step
        for cb in self.cbs:
            cb.learn = self
        self("before_fit")

    def __call__(self, event):
        for cb in self.cbs:
            f = getattr(cb, event, None)
            if f is not None:
                f()

    def one_batch(self, i):
        x, y = batch(i)
        with torch.autocast(**FP16):
            pred = self.model(x)
        self.loss = self.loss_grad = F.mse_loss(pred.float(), y)
        self("before_backward")
        self.loss_grad.backward()
        self("before_step")
        self.step_fn()
        self("after_step")
        self.opt.zero_grad(set_to_none=True)
        return self.loss.item()


def make_learner(clip_order):
    def make():
        c = SimpleNamespace(m=net(), true_norms=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler()
        c.clip = GradientClip(max_norm=5.0, order=clip_order)
        c.learn = Learner(c.m, c.opt, [c.clip, MixedPrecision(c.sc)])

        def body(i):
            if not c.watched:
                c.true_norms.append(gnorm(true_grads(c.m, [i])))
            return c.learn.one_batch(i)
        c.body = body
        return c
    return make


def test_m1_fastai_like_clip_callback_ordered_before_mixed_precision():
    a, b = both(make_learner(clip_order=0), steps=8)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the clip ran before unscale_ every iteration and saw 1024x the true norm (which is below max_norm)
    assert a.learn.events[:4] == ["clip", "unscale", "clip", "unscale"], a.learn.events[:4]
    assert b.true_norms[0] < 5.0 and abs(b.clip.norms[0] / (SCALE * b.true_norms[0]) - 1) < 0.02, \
        (b.clip.norms[0], b.true_norms[0])
    named(a.rep, "clip_before_unscale", 0, "m1-clip")


def test_t1_fastai_like_clip_callback_after_mixed_precision():
    a, b = both(make_learner(clip_order=MixedPrecision.order + 1), steps=10)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert a.learn.events[:4] == ["unscale", "clip", "unscale", "clip"], a.learn.events[:4]
    assert all(abs(n / t - 1) < 0.02 for n, t in zip(b.clip.norms, b.true_norms)), (b.clip.norms, b.true_norms)
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# M2. the DQN tutorial's in-place gradient clamp between the scaled backward and scaler.step
# ======================================================================================================================
def huber(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        q = m(x)
    return F.smooth_l1_loss(q.float(), y)


def make_dqn(unscale_first):
    def make():
        c = SimpleNamespace(m=net(), want=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler()
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i], loss=huber))
            c.opt.zero_grad(set_to_none=True)
            loss = huber(c.m, i)
            c.sc.scale(loss).backward()
            if unscale_first:
                c.sc.unscale_(c.opt)
            for p in c.m.parameters():
                p.grad.data.clamp_(-1, 1)  # @m2-clamp
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


def test_m2_dqn_tutorial_grad_clamp_before_scaler_step():
    a, b = both(make_dqn(unscale_first=False), steps=8)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: every stepped element is at most 1/1024, while the true gradients reach far above that
    top = max(float(g.abs().max()) for g in b.stepped[0])
    assert top <= 1.0 / SCALE * 1.001 and max(float(g.abs().max()) for g in b.want[0]) > 20 / SCALE, top
    # (an in-place clamp is no recorded call: the finding has no line, and says what it saw)
    f = named(a.rep, "clip_before_unscale", 0)
    assert f.evidence.get("bound_scaled") == 1.0 and f.evidence.get("api") == "torch.Tensor.clamp_", f.evidence


def test_t2_dqn_tutorial_grad_clamp_after_unscale():
    a, b = both(make_dqn(unscale_first=True), steps=10)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    want = [[g.clamp(-1, 1) for g in w] for w in b.want]
    assert all(near(s, w) for s, w in zip(b.stepped, want)), [ratio(s, w) for s, w in zip(b.stepped, want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# M3. DINO's per-parameter clip_gradients switched on after a warm-up, before unscale_
# ======================================================================================================================
WARMUP, CLIP = 30, 3.0


def clip_gradients(model, clip):
    norms = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)  # @m3-norm
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)  # @m3-mul
    return norms


def make_dino(unscale_first):
    def make():
        c = SimpleNamespace(m=net(), norms={}, true={})
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-3)
        c.sc = scaler()

        def body(it):
            if not c.watched and it == WARMUP:
                c.true[it] = [float(g.norm()) for g in true_grads(c.m, [it])]
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, it)
            c.sc.scale(loss).backward()
            if it >= WARMUP:
                if unscale_first:
                    c.sc.unscale_(c.opt)
                c.norms[it] = clip_gradients(c.m, CLIP)
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


@wrong("an empty report; should be clip_before_unscale, error, step 30, at clip_gradients' norm or mul_ line")
def test_m3_dino_clip_gradients_after_warmup_before_unscale():
    a, b = both(make_dino(unscale_first=False), steps=WARMUP + 3)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: nothing clipped before WARMUP; at WARMUP every per-parameter norm read is 1024x the true one, every true
    # norm is below CLIP (nothing should be clipped), and the scaled ones are above it (all clipped)
    assert min(b.norms) == WARMUP, sorted(b.norms)[:3]
    got, true = b.norms[WARMUP], b.true[WARMUP]
    assert max(true) < CLIP and all(abs(g / (SCALE * t) - 1) < 0.02 for g, t in zip(got, true)), (got, true)
    assert min(got) > CLIP, got
    named(a.rep, "clip_before_unscale", WARMUP, ("m3-norm", "m3-mul"))


def test_t3_dino_clip_gradients_after_warmup_after_unscale():
    a, b = both(make_dino(unscale_first=True), steps=WARMUP + 3)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    got, true = b.norms[WARMUP], b.true[WARMUP]
    assert all(abs(g / t - 1) < 0.02 for g, t in zip(got, true)), (got, true)
    learned(a.losses, k=3)
    quiet(a.rep)


# ======================================================================================================================
# M4. a custom autograd "gradient clip layer" clamping the scaled grad_output
# ======================================================================================================================
class GradClamp(torch.autograd.Function):
    """Identity forward; backward clamps grad_output to +-bound (and records the share of elements it clamped)."""

    @staticmethod
    def forward(ctx, x, bound, log):
        ctx.bound, ctx.log = bound, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(float((g.abs() > ctx.bound).float().mean()))
        return g.clamp(-ctx.bound, ctx.bound), None, None


class ClampNet(nn.Module):
    def __init__(self, bound=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 32), nn.Linear(32, 1)
        self.bound, self.grad_scale, self.log = bound, 1.0, []

    def forward(self, x):
        h = torch.relu(self.body(x))
        h = GradClamp.apply(h, self.bound * self.grad_scale, self.log)
        return self.head(h)


def make_clamp(bound_in_scaled_units):
    def make():
        c = SimpleNamespace(m=ClampNet(1.0), want=[], true_clamped=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler()
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))

        def body(i):
            if not c.watched:
                seen = []
                c.want.append(true_grads(c.m, [i], prep=lambda k: setattr(k, "log", seen)))  # no scaler, bound 1
                c.true_clamped.extend(seen)
            c.m.grad_scale = c.sc.get_scale() if bound_in_scaled_units else 1.0
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 50.0)
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


@wrong("an empty report; should be clip_before_unscale, error, step 0 (the clamp in GradClamp.backward)")
def test_m4_custom_function_grad_clamp_under_scaled_backward():
    a, b = both(make_clamp(bound_in_scaled_units=False), steps=8)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the true grad_output is never clamped; under the scaler most elements are (65-87%), and the body's stepped
    # gradients are far below the true ones
    assert max(b.true_clamped) == 0.0 and min(b.m.log) > 0.5, (b.true_clamped, b.m.log)
    r, _ = ratio(b.stepped[0][:2], b.want[0][:2])
    assert r < 0.2, r
    named(a.rep, "clip_before_unscale", 0)


def test_t4_custom_function_grad_clamp_bound_in_scaled_units():
    a, b = both(make_clamp(bound_in_scaled_units=True), steps=10)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert max(b.m.log) == 0.0, b.m.log
    assert all(near(s, w) for s, w in zip(b.stepped, b.want)), [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# M5. a CleanRL-style PPO update with one scaler.update() per rollout
# ======================================================================================================================
EPOCHS, MINIBATCHES = 2, 2


def make_ppo(update_each_step):
    def make():
        c = SimpleNamespace(m=net(), calls=[])
        c.opt = torch.optim.Adam(c.m.parameters(), lr=1e-2, eps=1e-5)
        c.sc = scaler()

        def body(rollout):
            losses = []
            for epoch in range(EPOCHS):
                for mb in range(MINIBATCHES):
                    loss = fwd_loss(c.m, rollout * MINIBATCHES + mb)
                    c.opt.zero_grad()
                    c.sc.scale(loss).backward()
                    c.calls.append("unscale_")
                    c.sc.unscale_(c.opt)
                    torch.nn.utils.clip_grad_norm_(c.m.parameters(), 0.5)
                    c.calls.append("step")
                    c.sc.step(c.opt)  # @m5-step
                    if update_each_step:
                        c.calls.append("update")
                        c.sc.update()
                    losses.append(loss.item())
            if not update_each_step:
                c.calls.append("update")
                c.sc.update()
            return losses
        c.body = body
        return c
    return make


def test_m5_ppo_update_once_per_rollout():
    a, b = both(make_ppo(update_each_step=False), steps=4)
    # truth: rollout 0's second minibatch unscales after a step with no update between; torch raises there
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == 0 and "unscale_() is being called after step()" in c.raised[1], \
            c.raised
        assert c.calls == ["unscale_", "step", "unscale_"], c.calls
    named(a.rep, "missing_scaler_update", 0, "m5-step")


def test_t5_ppo_update_after_every_step():
    a, b = both(make_ppo(update_each_step=True), steps=4)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert a.calls[:6] == ["unscale_", "step", "update"] * 2, a.calls[:6]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# M6. a "skip NaN batches" guard between the scaled backward and unscale_: update() never runs
# ======================================================================================================================
def make_guard(guard):
    def make():
        c = SimpleNamespace(m=net(), scales=[], guarded=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=1e-3)
        c.sc = torch.amp.GradScaler("cpu")      # the default init_scale, 2**16
        c.w0 = weights(c.m)

        def body(i):
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i, "sum")
            c.sc.scale(loss).backward()
            c.scales.append(c.sc.get_scale())
            if guard and not all(bool(torch.isfinite(p.grad).all()) for p in c.m.parameters()):  # @m6-guard
                c.guarded.append(i)
                c.opt.zero_grad(set_to_none=True)
                return loss.item()                      # `continue`
            c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 10.0)
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


def test_m6_nan_batch_guard_before_unscale_pins_the_scale():
    a, b = both(make_guard(guard=True), steps=12)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: every iteration was skipped by the guard, the scale never backed off, the weights never moved
    assert a.guarded == list(range(12)) and set(a.scales) == {65536.0} and a.sc.get_scale() == 65536.0, \
        (a.guarded, a.scales)
    assert all(torch.equal(p, q) for p, q in zip(weights(a.m), a.w0))
    named(a.rep, ("scaler_misorder", "skipped_steps", "loss_scale_collapse"), (0, None))


def test_t6_no_guard_scaler_skips_and_backs_off():
    a, b = both(make_guard(guard=False), steps=16)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert a.scales[0] == 65536.0 and a.sc.get_scale() < 65536.0, a.scales
    assert not all(torch.equal(p, q) for p, q in zip(weights(a.m), a.w0))
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# H7. a momentum (EMA) target network updated between clip and scaler.step
# ======================================================================================================================
def make_momentum():
    def make():
        c = SimpleNamespace(m=net())
        c.target = copy.deepcopy(c.m).requires_grad_(False)
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler()

        def body(i):
            c.opt.zero_grad(set_to_none=True)
            x, y = batch(i)
            with torch.autocast(**FP16):
                out = c.m(x)
                with torch.no_grad():
                    tgt = c.target(x)
            loss = F.mse_loss(out.float(), y) + 0.1 * F.mse_loss(out.float(), tgt.float())
            c.sc.scale(loss).backward()
            c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 5.0)
            with torch.no_grad():
                for pt, p in zip(c.target.parameters(), c.m.parameters()):
                    pt.mul_(0.9).add_(p, alpha=0.1)
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


def test_h7_momentum_target_update_before_scaler_step():
    a, b = both(make_momentum(), steps=10)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(math.isfinite(v) for v in a.losses), a.losses
    learned(a.losses)
    quiet(a.rep)
