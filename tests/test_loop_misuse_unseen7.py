"""Loop misuse probes, seventh unseen set: GradScaler / optimizer / clipping mistakes that live in the user's OWN
optimizer or scaler classes, where GradScaler's fused-optimizer path (`_step_supports_amp_scaling`: scaler.step does
no unscale_ of its own and hands the optimizer `grad_scale` / `found_inf` instead) or a GradScaler subclass changes
what "after unscale_" means. Shapes that tests/test_loop_misuse2-9.py and test_loop_misuse_unseen.py .. unseen6.py
do not build (their fused case, test_loop_misuse4 M12, clips in the loop before scaler.step; here the clip is inside
the optimizer's or the scaler's own step). Each misuse has a correct twin (the same loop, the mistake fixed) that
must be quiet. Everything runs probe_harness.misuse_net under fp16 CPU autocast + torch.amp.GradScaler("cpu") (or a
subclass), one intra-op thread, watched through the public API only (`ampdoctor.watch(model, optimizer=opt,
scaler=scaler, run_dir=tmp_path / "run")`, default settings, `w.close()`, `w.report()`).

Every case runs twice, watched and unwatched, and the losses must be bitwise the same (probe_harness.same_losses).
The truth is proven first without ampdoctor, in the unwatched run: the norm the clip returned vs the true norm of a
copy of the model, and the update the optimizer really applied (weights after minus before, over -lr) vs the true
unscaled gradients (a failing oracle is a plain failure). Then the CONTRACT rule among the first three findings at
the step of the first misuse (0-based optimizer step) and, where a call of the user's is the mistake, at that call's
`# @tag` line (probe_harness.misuse_named; scaler_misorder with its call sequence). A wrong report raises
WrongAnswer: a strict xfail `wrong(...)` quoting what ampdoctor said.

Misuse (twin):
 F1. `ClippedSGD(torch.optim.SGD)`: an optimizer subclass whose step() clips (`clip_grad_norm_(self._params,
     max_norm)`) before `super().step()` ("the optimizer owns its clipping": safe under scaler.step, which unscales
     first), switched to `fused=True` for speed. A fused SGD declares `_step_supports_amp_scaling`: scaler.step no
     longer unscales before calling step(), the kernel divides by `grad_scale` inside super().step(), so the clip in
     step() reads the scaled gradients. Truth: the clip returns ~1024x the true norm (true ~1, max_norm 5: nothing
     should be clipped) and the applied update is ~5/1024 of the true one. clip_before_unscale, error, step 0, at
     the subclass's clip line.                                   (T1: the same subclass, fused=False)
 F2. a hand-written `FusedMomentumSGD` (torch._foreach_* kernels) that sets `_step_supports_amp_scaling = True`
     ("so GradScaler skips its separate unscale pass", copied from apex's fused optimizers) but whose step() never
     reads `self.grad_scale` / `self.found_inf`: every update is on the scaled gradients (x1024), no step is ever
     skipped. Truth: step 0's update is 1024x the true gradients, the loss explodes. scaler_misorder (an optimizer
     step on scaled gradients), error, step 0.
                        (T2: the step divides by grad_scale and returns when found_inf is set, as apex's do)
 F3. `ClippingGradScaler(torch.amp.GradScaler)`: a scaler subclass whose step(optimizer) clips
     (`clip_grad_norm_(self.params, max_norm)`) and then calls `super().step(optimizer)` ("the scaler clips for
     us"); the unscale_ happens inside super().step, after the clip. Truth: the clip returns ~1024x the true norm and
     the applied update is ~5/1024 of the true one. clip_before_unscale, error, step 0, at the subclass's clip line.
                                                 (T3: `self.unscale_(optimizer)` before the clip in the subclass)
 F4. an `OptimizerWithLR` convenience wrapper (lr schedule + `__getattr__` delegating everything else to the inner
     optimizer, a common pattern) around `SGD(fused=True)`, handed to scaler.step. GradScaler reads
     `_step_supports_amp_scaling` through the delegation (True), so it does not unscale, and sets `grad_scale` /
     `found_inf` on the WRAPPER; the inner fused SGD never sees them and steps on the scaled gradients without an inf
     check. Truth: step 0's update is 1024x the true gradients. scaler_misorder, error, step 0.
                   (T4: the wrapper hands grad_scale / found_inf to the inner optimizer for its step)

Oracle numbers when written: F1 and F3 the clip returned exactly 1024x the true norm at every step (true 1.19-1.62,
below MAX_NORM 5), step 0's applied update 0.0030x the true gradient (same direction); F2 and F4 step 0's applied
update 1024.0x the true gradient, loss 0.877 -> 5.6e5 at iteration 1, NaN from 2 (the inf gradients of the later
steps are applied too: these optimizers never skip).

Result when written (torch 2.13 CPU, default watch with run_dir): 6 pass, 2 xfail (strict; each reason quotes
ampdoctor's answer). F = this file.
 - F1 right: '[error] clip_before_unscale at (run) torch.nn.utils.clip_grad_norm_ step 0: `clip_grad_norm_` at
   F:LINE(f1-clip) ran on gradients still multiplied by the loss scale (1024) ...'. F3 right: the same at
   F:LINE(f3-clip).
 - F2 (xfail; a custom optimizer declaring `_step_supports_amp_scaling` that ignores grad_scale / found_inf):
   '[error] update_spike at head step 0: The optimizer update at step 0 multiplied the weights of `head` x1.57e+03
   ... Usual causes: a learning rate too high for these weights (lr=0.05 ...); no warmup ...; no gradient clipping',
   '[error] overflow at body step 1: The weights of `body` (Linear) were already inf when step 2 began: step 1's
   update wrote them', '[error] skipped_steps at (run) step 2: GradScaler skipped 5 of 6 steps' (none was skipped:
   the optimizer applied every one). Should be scaler_misorder, error, step 0 (an optimizer step on scaled
   gradients). Likely cause: ampdoctor/record/optsink.py `_opt_pre` takes a step through scaler.step of an optimizer
   with `_step_supports_amp_scaling` as unscaling by itself (`scaled and not via`), never checking that the applied
   update matches the unscaled gradient (update / lr ~ scale x grad) or that a step with found_inf set left the
   weights unchanged.
 - F4 (xfail; a `__getattr__`-delegating wrapper around SGD(fused=True)): the same three findings as F2, word for
   word. Should be scaler_misorder, error, step 0. Same likely cause (the flag read through the wrapper; the
   grad_scale / found_inf GradScaler sets on the wrapper never reach the inner optimizer).
 - twins T1-T4 quiet.
"""
from types import SimpleNamespace

import pytest
import torch

from scenarios import one_thread
from probe_harness import (gnorm, learned, misuse_both, misuse_loss, misuse_named, misuse_net, misuse_quiet,
                           misuse_scaler, misuse_true_grads, misuse_weights, near, ratio, wrong)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

HERE = __file__
SCALE = 1024.0
ERR = ("error",)
MAX_NORM = 5.0
LR = 0.05
net, scaler, fwd_loss, true_grads, weights, quiet = (misuse_net, misuse_scaler, misuse_loss, misuse_true_grads,
                                                     misuse_weights, misuse_quiet)


def both(make, steps, tmp_path):
    return misuse_both(make, steps, tmp_path / "run")


def named(rep, rule, step, tags=None, severity=ERR):
    return misuse_named(rep, rule, step, tags, severity, src=HERE)


def applied(before, after, lr=LR):
    """The gradient a plain SGD step applied: (before - after) / lr."""
    return [(b - a) / lr for b, a in zip(before, after)]


def plain_iteration(c, i):
    """zero_grad, the scaled backward, scaler.step, update; in the unwatched run the true gradients and the update
    actually applied are kept."""
    if not c.watched:
        c.want.append(true_grads(c.m, [i]))
        w0 = weights(c.m)
    c.opt.zero_grad(set_to_none=True)
    loss = fwd_loss(c.m, i)
    c.sc.scale(loss).backward()
    c.sc.step(c.opt)  # @step
    c.sc.update()
    if not c.watched:
        c.got.append(applied(w0, weights(c.m)))
    return loss.item()


# ======================================================================================================================
# F1. an optimizer subclass that clips in step(), made fused
# ======================================================================================================================
class ClippedSGD(torch.optim.SGD):
    """SGD that clips the global gradient norm itself before every step."""

    def __init__(self, params, max_norm, norms, **kw):
        params = list(params)
        super().__init__(params, **kw)
        self._params, self.max_norm, self.norms = params, max_norm, norms

    def step(self, closure=None):
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self._params, self.max_norm)))  # @f1-clip
        return super().step(closure)


def make_clipped_sgd(fused):
    def make():
        c = SimpleNamespace(m=net(), want=[], got=[], norms=[])
        c.opt = ClippedSGD(c.m.parameters(), MAX_NORM, c.norms, lr=LR, fused=fused)
        c.sc = scaler()
        c.body = lambda i: plain_iteration(c, i)
        return c
    return make


def test_f1_fused_optimizer_subclass_clips_scaled_gradients(tmp_path):
    a, b = both(make_clipped_sgd(fused=True), 6, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert b.opt._step_supports_amp_scaling
    # truth: the clip read ~1024x the true norm (true < MAX_NORM: nothing should be clipped); the update applied is
    # the true gradient cut to MAX_NORM / (1024 |g|)
    t = [gnorm(w) for w in b.want]
    assert all(x < MAX_NORM for x in t) and all(abs(n / (SCALE * x) - 1) < 0.05 for n, x in zip(b.norms, t)), \
        (b.norms, t)
    assert near(b.got[0], b.want[0], factor=MAX_NORM / b.norms[0]), ratio(b.got[0], b.want[0])
    named(a.rep, "clip_before_unscale", 0, "f1-clip")


def test_t1_optimizer_subclass_clips_unfused(tmp_path):
    a, b = both(make_clipped_sgd(fused=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    t = [gnorm(w) for w in b.want]
    assert all(abs(n / x - 1) < 0.02 for n, x in zip(b.norms, t)), (b.norms, t)
    assert all(near(g, w) for g, w in zip(b.got, b.want)), [ratio(g, w) for g, w in zip(b.got, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# F2. a hand-written "fused" optimizer that claims _step_supports_amp_scaling but ignores grad_scale / found_inf
# ======================================================================================================================
class FusedMomentumSGD(torch.optim.Optimizer):
    """Momentum SGD on torch._foreach_* kernels. `honour_scaler`: read the grad_scale / found_inf GradScaler hands
    an optimizer that declares `_step_supports_amp_scaling` (as apex's fused optimizers do)."""

    def __init__(self, params, lr, momentum=0.0, honour_scaler=True):
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self._step_supports_amp_scaling = True  # @f2-flag
        self.honour_scaler = honour_scaler

    @torch.no_grad()
    def step(self, closure=None):
        inv = None
        if self.honour_scaler:
            found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
            if found_inf is not None and float(found_inf) != 0.0:
                return None
            if grad_scale is not None:
                inv = float(1.0 / grad_scale)
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            grads = [p.grad for p in ps]
            if inv is not None:
                grads = torch._foreach_mul(grads, inv)
            if g["momentum"]:
                bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in ps]
                torch._foreach_mul_(bufs, g["momentum"])
                torch._foreach_add_(bufs, grads)
                grads = bufs
            torch._foreach_add_(ps, grads, alpha=-g["lr"])
        return None


def make_fused_custom(honour_scaler):
    def make():
        c = SimpleNamespace(m=net(), want=[], got=[])
        c.opt = FusedMomentumSGD(c.m.parameters(), lr=LR, honour_scaler=honour_scaler)
        c.sc = scaler()
        c.body = lambda i: plain_iteration(c, i)
        return c
    return make


@wrong("'[error] update_spike at head step 0 ... Usual causes: a learning rate too high' first, then overflow at body "
       "step 1 and skipped_steps ('skipped 5 of 6 steps': none was skipped); no scaler_misorder: the fused optimizer "
       "stepped on the scaled gradients")
def test_f2_custom_fused_optimizer_ignores_grad_scale(tmp_path):
    a, b = both(make_fused_custom(honour_scaler=False), 6, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: step 0 applied the scaled gradients (x1024); the loss explodes
    assert near(b.got[0], b.want[0], factor=SCALE), ratio(b.got[0], b.want[0])
    assert not b.losses[2] < 100 * b.losses[0], b.losses
    named(a.rep, "scaler_misorder", 0)


def test_t2_custom_fused_optimizer_reads_grad_scale(tmp_path):
    a, b = both(make_fused_custom(honour_scaler=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(near(g, w) for g, w in zip(b.got, b.want)), [ratio(g, w) for g, w in zip(b.got, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# F3. a GradScaler subclass whose step() clips before super().step()
# ======================================================================================================================
class ClippingGradScaler(torch.amp.GradScaler):
    """A GradScaler that clips the gradients in step()."""

    def __init__(self, params, max_norm, unscale_first, **kw):
        super().__init__("cpu", init_scale=SCALE, **kw)
        self.params, self.max_norm, self.unscale_first, self.norms = list(params), max_norm, unscale_first, []

    def step(self, optimizer, *args, **kwargs):
        if self.unscale_first:
            self.unscale_(optimizer)
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)))  # @f3-clip
        return super().step(optimizer, *args, **kwargs)


def make_clipping_scaler(unscale_first):
    def make():
        c = SimpleNamespace(m=net(), want=[], got=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=LR)
        c.sc = ClippingGradScaler(c.m.parameters(), MAX_NORM, unscale_first)
        c.body = lambda i: plain_iteration(c, i)
        return c
    return make


def test_f3_gradscaler_subclass_clips_before_its_unscale(tmp_path):
    a, b = both(make_clipping_scaler(unscale_first=False), 6, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    t = [gnorm(w) for w in b.want]
    assert all(x < MAX_NORM for x in t) and all(abs(n / (SCALE * x) - 1) < 0.05 for n, x in zip(b.sc.norms, t)), \
        (b.sc.norms, t)
    assert near(b.got[0], b.want[0], factor=MAX_NORM / b.sc.norms[0]), ratio(b.got[0], b.want[0])
    named(a.rep, "clip_before_unscale", 0, "f3-clip")


def test_t3_gradscaler_subclass_unscales_then_clips(tmp_path):
    a, b = both(make_clipping_scaler(unscale_first=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    t = [gnorm(w) for w in b.want]
    assert all(abs(n / x - 1) < 0.02 for n, x in zip(b.sc.norms, t)), (b.sc.norms, t)
    assert all(near(g, w) for g, w in zip(b.got, b.want)), [ratio(g, w) for g, w in zip(b.got, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# F4. a __getattr__-delegating optimizer wrapper around a fused SGD
# ======================================================================================================================
class OptimizerWithLR:
    """A convenience wrapper: a per-step lr schedule, everything else delegated to the inner optimizer."""

    def __init__(self, optimizer, lr_at, forward_scaler_args):
        self.optimizer, self.lr_at, self.n = optimizer, lr_at, 0
        self.forward_scaler_args = forward_scaler_args

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def step(self, closure=None):
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr_at(self.n)
        self.n += 1
        handed = [k for k in ("grad_scale", "found_inf") if self.forward_scaler_args and k in self.__dict__]
        for k in handed:
            setattr(self.optimizer, k, self.__dict__[k])
        try:
            return self.optimizer.step(closure)
        finally:
            for k in handed:
                delattr(self.optimizer, k)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def make_wrapper(forward_scaler_args):
    def make():
        c = SimpleNamespace(m=net(), want=[], got=[])
        inner = torch.optim.SGD(c.m.parameters(), lr=LR, fused=True)
        c.opt = OptimizerWithLR(inner, lambda n: LR, forward_scaler_args)
        c.sc = scaler()
        c.body = lambda i: plain_iteration(c, i)
        return c
    return make


@wrong("'[error] update_spike at head step 0 ... Usual causes: a learning rate too high' first, then overflow at body "
       "step 1 and skipped_steps; no scaler_misorder: the wrapper's inner fused SGD stepped on the scaled gradients")
def test_f4_delegating_wrapper_hides_grad_scale_from_fused_inner(tmp_path):
    a, b = both(make_wrapper(forward_scaler_args=False), 6, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert b.opt._step_supports_amp_scaling
    assert near(b.got[0], b.want[0], factor=SCALE), ratio(b.got[0], b.want[0])
    assert not b.losses[2] < 100 * b.losses[0], b.losses
    named(a.rep, "scaler_misorder", 0)


def test_t4_delegating_wrapper_hands_grad_scale_on(tmp_path):
    a, b = both(make_wrapper(forward_scaler_args=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(near(g, w) for g, w in zip(b.got, b.want)), [ratio(g, w) for g, w in zip(b.got, b.want)]
    learned(a.losses)
    quiet(a.rep)

