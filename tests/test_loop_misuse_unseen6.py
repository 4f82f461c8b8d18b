"""Loop misuse probes, sixth unseen set: GradScaler / optimizer / clipping call-order mistakes inside hand-written
framework-style helpers (an accelerate-like `MiniAccelerator` wrapper with backward / clip_grad_norm_ / step and an
`_unscaled` flag, a `contextlib.contextmanager` `amp_step()` helper), shapes that tests/test_loop_misuse2-9.py and
test_loop_misuse_unseen.py .. unseen5.py do not build. Each misuse has a correct twin (the same loop, the mistake
fixed) that must be quiet. Everything runs probe_harness.misuse_net under fp16 CPU autocast +
torch.amp.GradScaler("cpu"), one intra-op thread, watched through the public API only (`ampdoctor.watch(model,
optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")`, default settings, `w.close()`, `w.report()`).

Every case runs twice, watched and unwatched, and the losses must be bitwise the same (probe_harness.same_losses).
The truth is proven first without ampdoctor: the norm the wrapper's clip returned vs the true norm of a copy of the
model, the gradients the optimizer stepped on (a step pre-hook) vs the true ones, the scaler's scale history, torch's
own exception and where it came from (a failing oracle is a plain failure). Then the CONTRACT rule among the first
three findings at the step of the first misuse (0-based optimizer step; a skipped step counts) and at the offending
call's `# @tag` line (probe_harness.misuse_named; scaler_misorder with its call sequence). A wrong report raises
WrongAnswer: a strict xfail `wrong(...)` quoting what ampdoctor said.

Misuse (twin):
 A1. `MiniAccelerator` (accelerate's shape: `backward(loss)` scales, `clip_grad_norm_()` unscales once per step,
     guarded by `self._unscaled`, `step()` does scaler.step + update and resets the flag) whose flag is initialised
     True in __init__ ("prepare() already unscaled"): the first call of clip_grad_norm_ skips its unscale_ and clips
     the scaled gradients (norm 1024x the true one, max_norm 1.0: the stepped gradients are ~1/1000 of the true
     ones); every later step is right. clip_before_unscale, error, step 0, at the wrapper's clip line.
                                                                           (T1: the flag initialised False)
 A2. the same wrapper, correct at start, whose step() returns early when the scaler skipped the step ("nothing
     happened, keep the state") BEFORE resetting `_unscaled`: GradScaler(2**16, growth_interval 5) grows to 2**17 after
     step 4, step 5's scaled backward overflows and is skipped, so step 6's clip skips unscale_ and clips gradients
     multiplied by 65536 (stepped ~1/65536 of the true ones); step 7 on is right again. clip_before_unscale, error,
     step 6, at the wrapper's clip line.                    (T2: the flag reset whether or not the step was skipped)
 A3. the wrapper's step() does scaler.step + update (as accelerate's AcceleratedOptimizer.step does), and the loop,
     ported from a plain AMP script, still calls `scaler.update()` after `accelerator.step()`: the second update finds
     no inf checks and GradScaler asserts "No inf checks were recorded prior to update." at iteration 0.
     scaler_misorder, error, step 0, at the loop's update line.                (T3: the loop's update() deleted)
 B1. a `@contextlib.contextmanager` `amp_step(opt, scaler)`: zero_grad before the yield, `scaler.step(opt)` +
     `scaler.update()` after it; the user's block (copied from the plain loop) ALSO calls `scaler.step(opt)` after
     unscale_ + clip: the optimizer steps, then the helper's scaler.step raises "step() has already been called since
     the last update()" at iteration 0 (from the generator's exit). scaler_misorder, error, step 0, at the user's
     scaler.step line or the helper's.                             (T4: the block ends at the clip; the helper steps)

 A4. the wrapper's step() reads scaler.step()'s return value as "skipped" (`if scaler.step(opt) is None: return`,
     before update() and the flag reset); SGD.step() returns None, so no step is ever updated: iteration 1's clip
     skips unscale_ (flag still set) and its scaler.step raises "step() has already been called since the last
     update()". missing_scaler_update, error, step 0, at the wrapper's scaler.step line.
                                                              (T5: update() whatever step() returned)
 A5. a resume at step 7 rebuilds the wrapper from a checkpoint written by an on_before_optimizer_step callback
     between the clip and the step, so `_unscaled=True` is restored: step 7's clip reads 1024x the true norm (max_norm
     1.0: stepped ~1/1000 of the true gradients). clip_before_unscale, error, step 7, at the wrapper's clip line.
                                                              (T7: the checkpoint does not carry the mid-step flag)
 A6. the wrapper's step() calls update() only when `scaler._found_inf_per_device(opt)` found no inf ("nothing to
     adapt"): step 5 (the growth probe at 2**17) overflows, is skipped and not updated; iteration 6's unscale_ raises
     "unscale_() is being called after step()". missing_scaler_update (or scaler_misorder), error, step 5, at the
     wrapper's scaler.step line.                                                   (T8: update() always)
 B2. the user's block inside amp_step() ends with the plain loop's `optimizer.zero_grad(set_to_none=False)` (after
     the scaled backward, before the helper's scaler.step): SGD steps on zeros, the weights never move (silent).
     scaler_misorder, error, step 0, at that zero_grad line.                  (T6: no zero_grad in the block)
Healthy wrapper shapes that look odd (quiet):
 H1. the wrapper's clip_grad_norm_ drops the gradients (`optimizer.zero_grad(set_to_none=True)`) when the norm it
     read after unscale_ is non-finite: unscale_ already recorded the inf, so scaler.step skips and update() backs off
     exactly as without the drop (bitwise the same losses and weights as T2's loop). Only the scaler's info.
 H2. a norm-logging call of the wrapper's clip_grad_norm_(inf) before the Trainer's clip: the flag makes the second
     call skip unscale_ (right: already unscaled); both read the true norm.
 H3. a fairseq-style step(): on a non-finite clip norm, skip scaler.step and only update() the scaler: bitwise the
     same training as the plain wrapper (scaler.step would have skipped too).

Not built here (already built): a GradScaler recreated every epoch / warm restart (test_loop_misuse6 M7/T7b: the
contract's skipped_steps, "the first few backoffs alone are info": a rebuilt scaler whose search costs a step or
two per epoch is healthy, one whose repeated searches throw away most steps is skipped_steps), a scaled backward
after unscale_ (test_loop_misuse_unseen2 N6, unseen4 S1, test_loop_misuse6 M6), scaler.step every micro-batch
with zero_grad every 4th (test_loop_misuse8 M3), a class context manager whose __exit__ updates
(test_loop_misuse_unseen U4).

Oracle numbers when written: A1 the clip returned ~1024x the true norm at step 0, the true norm at every other step,
step 0 stepped <1% of the true gradient; A2 the clip at step 6 returned ~65536x the true norm; A5 the same as A1 at
step 7.

Result when written (torch 2.13 CPU, default watch with run_dir): 18 pass, 1 xfail (strict; the reason quotes
ampdoctor's answer). Fixed since (the same session; XPASSed, then unmarked): H1, a zero_grad after this optimizer's
unscale_ on a step the scaler then skipped, is no discarded step (rules/callorder._dropped_after_inf).
First findings (F = this file):
 - A1 '[error] clip_before_unscale at (run) torch.nn.utils.clip_grad_norm_ step 0: `clip_grad_norm_` at F:LINE(a-clip)
   ran on gradients still multiplied by the loss scale (1024)'. A2 the same at step 6 (65536), then '[info]
   skipped_steps ... step 5'. A5 the same at step 7.
 - A3 '[error] scaler_misorder at (run) GradScaler.update step 0: `scaler.update()` at F:LINE(a3-loop-update) ran a
   second time right after `scaler.update()` at F:LINE(a-wrapper-update)'.
 - A4 '[error] missing_scaler_update at (run) GradScaler.step step 0: `scaler.step()` at F:LINE(a4-step) ran again
   without `scaler.update()` since the previous step'. A6 '[error] missing_scaler_update ... step 5: An iteration
   ended without `scaler.update()` ... after `scaler.step()` at F:LINE(a6-step)'.
 - B1 '[error] missing_scaler_update at (run) GradScaler.step step 0: `scaler.step()` at F:LINE(b-helper-step) ran
   again without `scaler.update()` since the previous step (at F:LINE(b-user-step), step 0)' (step() twice without
   update() between: either rule accepted, as test_loop_misuse6 M4). B2 '[error] scaler_misorder ... step 0:
   `zero_grad()` at F:LINE(b2-zero) ran between the scaled backward and `scaler.step()`'.
 - twins T1-T8 and H2, H3 quiet (H3: '[info] skipped_steps ... step 5 ... a normal rate').
 - H1 (xfail, a false alarm on a healthy loop): '[error] scaler_misorder at (run) GradScaler.zero_grad step 5:
   `zero_grad()` at F:LINE(h1-drop) ran between the scaled backward and `scaler.step()` at F:LINE(a-step): the
   iteration's gradients are discarded before the step, so it applies zero gradients and the model does not learn'.
   The zero_grad ran AFTER unscale_ had recorded the inf, so scaler.step skipped as it would have anyway (bitwise the
   same training as without the drop). Should be quiet (info skipped_steps at most). Likely cause:
   ampdoctor/rules/callorder.py, the `_zeroed_after_backward(since_update, e)` branch for a `step` does not ask
   whether an unscale_ between the backward and the zero_grad already recorded found_inf (then the step skips and
   nothing is lost).
"""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from scenarios import one_thread
from probe_harness import (gnorm, keep_stepped, learned, misuse_both, misuse_loss, misuse_named, misuse_net,
                           misuse_quiet, misuse_scaler, misuse_true_grads, near, ratio)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

HERE = __file__
SCALE = 1024.0
ERR = ("error",)
net, scaler, fwd_loss, true_grads, quiet = misuse_net, misuse_scaler, misuse_loss, misuse_true_grads, misuse_quiet


def both(make, steps, tmp_path):
    return misuse_both(make, steps, tmp_path / "run")


def named(rep, rule, step, tags=None, severity=ERR):
    return misuse_named(rep, rule, step, tags, severity, src=HERE)


# ======================================================================================================================
# A. an accelerate-like wrapper with an `_unscaled` flag
# ======================================================================================================================
class MiniAccelerator:
    """backward(loss) scales; clip_grad_norm_ unscales once per step (the `_unscaled` flag); step() steps, updates
    and resets the flag. `flag0`: the flag's initial value (the A1 bug: True); `keep_on_skip`: step() returns before
    the reset when the scaler skipped (the A2 bug)."""

    def __init__(self, model, optimizer, scaler, flag0=False, keep_on_skip=False):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self._unscaled = flag0
        self.keep_on_skip = keep_on_skip
        self.step_was_skipped = False

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def clip_grad_norm_(self, parameters, max_norm):
        if not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)  # @a-clip

    def step(self):
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)  # @a-step
        self.scaler.update()  # @a-wrapper-update
        self.step_was_skipped = self.scaler.get_scale() < before
        if self.step_was_skipped and self.keep_on_skip:
            return  # "nothing happened: keep the state"
        self._unscaled = False


def make_accel(flag0=False, keep_on_skip=False, init=SCALE, growth_interval=2000, max_norm=1.0, loop_update=False):
    def make():
        c = SimpleNamespace(m=net(), want=[], norms=[], scales=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler(init, growth_interval=growth_interval)
        c.acc = MiniAccelerator(c.m, c.opt, c.sc, flag0=flag0, keep_on_skip=keep_on_skip)
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.acc.backward(loss)
            c.scales.append(c.sc.get_scale())
            c.norms.append(float(c.acc.clip_grad_norm_(c.m.parameters(), max_norm)))
            c.acc.step()
            if loop_update:
                c.sc.update()  # @a3-loop-update
            return loss.item()
        c.body = body
        return c
    return make


def test_a1_unscaled_flag_initialised_true(tmp_path):
    a, b = both(make_accel(flag0=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: step 0's clip read ~1024x the true norm (and cut the gradients), every later clip read the true norm
    t = [gnorm(w) for w in b.want]
    assert abs(b.norms[0] / (SCALE * t[0]) - 1) < 0.02 and max(t) < 1.0 * 4, (b.norms[0], t)
    assert all(abs(n / tt - 1) < 0.02 for n, tt in zip(b.norms[1:], t[1:])), list(zip(b.norms, t))
    assert ratio(b.stepped[0], b.want[0])[0] < 0.01, ratio(b.stepped[0], b.want[0])
    named(a.rep, "clip_before_unscale", 0, "a-clip")


def test_t1_unscaled_flag_initialised_false(tmp_path):
    a, b = both(make_accel(flag0=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    t = [gnorm(w) for w in b.want]
    assert all(abs(n / tt - 1) < 0.02 for n, tt in zip(b.norms, t)), list(zip(b.norms, t))
    learned(a.losses)
    quiet(a.rep)


GROW_SKIP = 5      # growth_interval 5 from 2**16: the scale doubles after step 4 and step 5's backward overflows


def test_a2_unscaled_flag_kept_after_a_skipped_step(tmp_path):
    a, b = both(make_accel(keep_on_skip=True, init=2.0 ** 16, growth_interval=GROW_SKIP, max_norm=5.0), 12,
                tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: step 5 overflowed at 2**17 (its norm non-finite, skipped); step 6's clip ran on gradients x65536
    t = [gnorm(w) for w in b.want]
    assert b.scales[GROW_SKIP] == 2.0 ** 17 and not math.isfinite(b.norms[GROW_SKIP]), (b.scales, b.norms)
    s6 = b.scales[GROW_SKIP + 1]
    assert s6 == 2.0 ** 16 and abs(b.norms[GROW_SKIP + 1] / (s6 * t[GROW_SKIP + 1]) - 1) < 0.02, (s6, b.norms, t)
    ok = [k for k in range(12) if k not in (GROW_SKIP, GROW_SKIP + 1)]
    assert all(abs(b.norms[k] / t[k] - 1) < 0.02 for k in ok), list(zip(b.norms, t))
    # the skipped step stepped nothing: 11 optimizer steps; the 6th (iteration 6) on gradients ~1/65536 of the true
    assert len(b.stepped) == 11 and ratio(b.stepped[GROW_SKIP], b.want[GROW_SKIP + 1])[0] < 1e-3, len(b.stepped)
    named(a.rep, "clip_before_unscale", GROW_SKIP + 1, "a-clip")


def test_t2_unscaled_flag_reset_after_a_skipped_step(tmp_path):
    a, b = both(make_accel(keep_on_skip=False, init=2.0 ** 16, growth_interval=GROW_SKIP, max_norm=5.0), 12,
                tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    t = [gnorm(w) for w in b.want]
    assert not math.isfinite(b.norms[GROW_SKIP]) and sum(not math.isfinite(n) for n in b.norms) == 1, b.norms
    ok = [k for k in range(12) if k != GROW_SKIP]
    assert all(abs(b.norms[k] / t[k] - 1) < 0.02 for k in ok), list(zip(b.norms, t))
    learned(a.losses)
    quiet(a.rep)


def test_a3_loop_updates_after_the_wrappers_update(tmp_path):
    a, b = both(make_accel(loop_update=True, max_norm=5.0), 8, tmp_path)
    # truth: the wrapper's update ran, then the loop's update asserted at iteration 0 (not inside the wrapper)
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == 0, c.raised
        assert "No inf checks were recorded prior to update." in c.raised[1], c.raised
        assert c.raised[2][-1] == "update" and "step" not in c.raised[2], c.raised[2]
        assert len(c.stepped) == 1, len(c.stepped)
    named(a.rep, "scaler_misorder", 0, "a3-loop-update")


def test_t3_loop_update_deleted(tmp_path):
    a, b = both(make_accel(loop_update=False, max_norm=5.0), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert len(b.stepped) == 8 and all(near(s, w) for s, w in zip(b.stepped, b.want)), \
        [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# B. a contextmanager amp_step() that steps and updates after the yield; the user's block steps too
# ======================================================================================================================
@contextlib.contextmanager
def amp_step(optimizer, scaler):
    optimizer.zero_grad(set_to_none=True)
    yield
    scaler.step(optimizer)  # @b-helper-step
    scaler.update()


def make_amp_step(user_steps):
    def make():
        c = SimpleNamespace(m=net(), want=[])
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler()
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
            with amp_step(c.opt, c.sc):
                loss = fwd_loss(c.m, i)
                c.sc.scale(loss).backward()
                c.sc.unscale_(c.opt)
                torch.nn.utils.clip_grad_norm_(c.m.parameters(), 5.0)
                if user_steps:
                    c.sc.step(c.opt)  # @b-user-step
            return loss.item()
        c.body = body
        return c
    return make


def test_b1_user_steps_inside_amp_step(tmp_path):
    a, b = both(make_amp_step(user_steps=True), 8, tmp_path)
    # truth: the user's scaler.step stepped the optimizer once; the helper's raised at iteration 0 on the exit
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == 0, c.raised
        assert "step() has already been called since the last update()" in c.raised[1], c.raised
        assert "amp_step" in c.raised[2] and c.raised[2][-1] == "step", c.raised[2]
        assert len(c.stepped) == 1, len(c.stepped)
    # step() twice without update() between: scaler_misorder or missing_scaler_update (as test_loop_misuse6 M4)
    named(a.rep, ("scaler_misorder", "missing_scaler_update"), 0, ("b-user-step", "b-helper-step"))


def test_t4_amp_step_steps_once(tmp_path):
    a, b = both(make_amp_step(user_steps=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert len(b.stepped) == 10 and all(near(s, w) for s, w in zip(b.stepped, b.want)), \
        [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# A4. the wrapper reads scaler.step()'s return value as "skipped" (it is the optimizer's step() return: None for SGD)
# ======================================================================================================================
class ReturnCheckAccelerator(MiniAccelerator):
    """step(): `if scaler.step(opt) is None: return` ("GradScaler returns None when it skipped the step"), the
    update after it; SGD.step() without a closure returns None too, so update() never runs (A4). `fixed`: update()
    runs whatever step() returned (T5)."""

    def __init__(self, *a, fixed=False, **k):
        super().__init__(*a, **k)
        self.fixed, self.skips = fixed, 0

    def step(self):
        if self.scaler.step(self.optimizer) is None:  # @a4-step
            self.skips += 1
            if not self.fixed:
                return
        self.scaler.update()
        self._unscaled = False


def make_return_check(fixed):
    def make():
        c = make_accel(max_norm=5.0)()
        c.acc = ReturnCheckAccelerator(c.m, c.opt, c.sc, fixed=fixed)
        return c
    return make


def test_a4_step_return_value_taken_for_skipped(tmp_path):
    a, b = both(make_return_check(fixed=False), 8, tmp_path)
    # truth: step 0 stepped (SGD returned None), no update() (and no flag reset: iteration 1's clip skipped
    # unscale_); iteration 1's scaler.step raised
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == 1, c.raised
        assert "step() has already been called since the last update()" in c.raised[1], c.raised
        assert c.raised[2][-1] == "step" and "step" in c.raised[2][:-1], c.raised[2]
        assert len(c.stepped) == 1 and c.acc.skips == 1, (len(c.stepped), c.acc.skips)
    named(a.rep, "missing_scaler_update", 0, ("a4-step",))


def test_t5_update_whatever_step_returned(tmp_path):
    a, b = both(make_return_check(fixed=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert len(b.stepped) == 10 and all(near(s, w) for s, w in zip(b.stepped, b.want)), \
        [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# H1 / H2. healthy wrapper shapes that look odd
# ======================================================================================================================
class DropNonFiniteAccelerator(MiniAccelerator):
    """H1: clip_grad_norm_ unscales, clips, and on a non-finite norm drops the gradients with
    `optimizer.zero_grad(set_to_none=True)` before the step ("don't step on garbage"). Harmless: unscale_ already
    recorded the inf, so scaler.step skips and update() backs off as usual."""

    def clip_grad_norm_(self, parameters, max_norm):
        norm = super().clip_grad_norm_(parameters, max_norm)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)  # @h1-drop
        return norm


def make_drop_nonfinite():
    def make():
        c = make_accel(init=2.0 ** 16, growth_interval=GROW_SKIP, max_norm=5.0)()
        c.acc = DropNonFiniteAccelerator(c.m, c.opt, c.sc)
        return c
    return make


def test_h1_drop_nonfinite_gradients_after_unscale_is_healthy(tmp_path):
    a, b = both(make_drop_nonfinite(), 12, tmp_path)
    # truth: bitwise the same training as the same wrapper without the drop (T2's loop)
    plain = misuse_both(make_accel(init=2.0 ** 16, growth_interval=GROW_SKIP, max_norm=5.0), 12)[1]
    assert plain.losses == b.losses and all(torch.equal(p, q) for p, q in zip(plain.m.parameters(),
                                                                              b.m.parameters())), plain.losses
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the one growth probe (step 5) overflowed and was skipped (11 optimizer steps), every other step stepped
    # the true gradients
    assert b.scales[GROW_SKIP] == 2.0 ** 17 and sum(not math.isfinite(n) for n in b.norms) == 1, (b.scales, b.norms)
    want = b.want[:GROW_SKIP] + b.want[GROW_SKIP + 1:]
    assert len(b.stepped) == 11 and all(near(s, w) for s, w in zip(b.stepped, want)), \
        [ratio(s, w) for s, w in zip(b.stepped, want)]
    learned(a.losses)
    quiet(a.rep)


def make_norm_then_clip():
    def make():
        c = make_accel(max_norm=5.0)()
        c.logged = []
        inner = c.body

        def body(i):
            # a norm-logging callback reads the norm through the same wrapper method before the Trainer clips: the
            # flag makes the second call skip unscale_ (right: the gradients are already unscaled)
            orig = c.acc.clip_grad_norm_

            def logged_clip(params, max_norm):
                c.logged.append(float(orig(c.m.parameters(), float("inf"))))
                c.acc.clip_grad_norm_ = orig
                return orig(params, max_norm)
            c.acc.clip_grad_norm_ = logged_clip
            return inner(i)
        c.body = body
        return c
    return make


def test_h2_norm_read_then_clip_through_the_flag_is_healthy(tmp_path):
    a, b = both(make_norm_then_clip(), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    t = [gnorm(w) for w in b.want]
    assert all(abs(n / tt - 1) < 0.02 for n, tt in zip(b.logged, t)), list(zip(b.logged, t))
    assert len(b.stepped) == 10 and all(near(s, w) for s, w in zip(b.stepped, b.want)), \
        [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


class SkipOnInfAccelerator(MiniAccelerator):
    """H3 (a fairseq-style port): step() skips scaler.step when the clip's norm was non-finite and only updates the
    scaler ("the scaler would skip it anyway"). Harmless: unscale_ recorded the inf, update() backs off the same."""

    def step(self, norm=None):
        if norm is not None and not math.isfinite(norm):
            self.scaler.update()  # @h3-update
            self._unscaled = False
            return
        super().step()


def make_skip_on_inf():
    def make():
        c = make_accel(init=2.0 ** 16, growth_interval=GROW_SKIP, max_norm=5.0)()
        c.acc = SkipOnInfAccelerator(c.m, c.opt, c.sc)

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.acc.backward(loss)
            c.scales.append(c.sc.get_scale())
            c.norms.append(float(c.acc.clip_grad_norm_(c.m.parameters(), 5.0)))
            c.acc.step(c.norms[-1])
            return loss.item()
        c.body = body
        return c
    return make


def test_h3_skip_step_on_inf_norm_update_only_is_healthy(tmp_path):
    a, b = both(make_skip_on_inf(), 12, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    plain = misuse_both(make_accel(init=2.0 ** 16, growth_interval=GROW_SKIP, max_norm=5.0), 12)[1]
    # truth: bitwise the same training as the plain wrapper (scaler.step would have skipped step 5 too)
    assert sum(not math.isfinite(n) for n in b.norms) == 1 and plain.losses == b.losses, (b.norms, plain.losses)
    assert all(torch.equal(p, q) for p, q in zip(plain.m.parameters(), b.m.parameters()))
    assert b.sc.get_scale() == plain.sc.get_scale(), (b.sc.get_scale(), plain.sc.get_scale())
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# B2. the user's block inside amp_step() ends with the plain loop's `optimizer.zero_grad(set_to_none=False)`
# ======================================================================================================================
def make_amp_step_cleanup(cleanup):
    def make():
        c = SimpleNamespace(m=net(), want=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler()
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))
        c.w0 = [p.detach().clone() for p in c.m.parameters()]

        def body(i):
            with amp_step(c.opt, c.sc):
                loss = fwd_loss(c.m, i)
                c.sc.scale(loss).backward()
                if cleanup:
                    c.opt.zero_grad(set_to_none=False)  # @b2-zero
            return loss.item()
        c.body = body
        return c
    return make


def test_b2_zero_grad_at_the_end_of_the_amp_step_block(tmp_path):
    a, b = both(make_amp_step_cleanup(cleanup=True), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: every step stepped on zeros; the weights never moved
    assert len(b.stepped) == 8 and all(gnorm(s) == 0.0 for s in b.stepped), [gnorm(s) for s in b.stepped]
    assert all(torch.equal(p, q) for p, q in zip(b.w0, b.m.parameters()))
    named(a.rep, "scaler_misorder", 0, "b2-zero")


def test_t6_amp_step_block_without_cleanup(tmp_path):
    a, b = both(make_amp_step_cleanup(cleanup=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(gnorm(s) > 0 for s in b.stepped), [gnorm(s) for s in b.stepped]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# A5. the wrapper's state saved between clip and step (a mid-step checkpoint callback) and restored at a resume
# ======================================================================================================================
RESUME = 7


def make_resume(save_flag):
    def make():
        c = make_accel(max_norm=1.0)()
        c.saved = None
        inner_clip = MiniAccelerator.clip_grad_norm_

        def body(i):
            if i == RESUME:
                # "resume": a new wrapper on the same model/optimizer/scaler, its state from the checkpoint
                c.acc = MiniAccelerator(c.m, c.opt, c.sc)
                c.acc.__dict__.update(c.saved)
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.acc.backward(loss)
            c.norms.append(float(inner_clip(c.acc, c.m.parameters(), 1.0)))
            if i == RESUME - 1:
                # the checkpoint callback (on_before_optimizer_step) saves the wrapper's state
                c.saved = {"_unscaled": c.acc._unscaled if save_flag else False,
                           "step_was_skipped": c.acc.step_was_skipped}
            c.acc.step()
            return loss.item()
        c.body = body
        return c
    return make


def test_a5_resume_restores_the_unscaled_flag(tmp_path):
    a, b = both(make_resume(save_flag=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the resumed wrapper believed the gradients unscaled: step 7's clip read ~1024x the true norm and cut
    # them; every other step's clip read the true norm
    t = [gnorm(w) for w in b.want]
    assert abs(b.norms[RESUME] / (SCALE * t[RESUME]) - 1) < 0.02, (b.norms, t)
    ok = [k for k in range(10) if k != RESUME]
    assert all(abs(b.norms[k] / t[k] - 1) < 0.02 for k in ok), list(zip(b.norms, t))
    assert ratio(b.stepped[RESUME], b.want[RESUME])[0] < 0.01, ratio(b.stepped[RESUME], b.want[RESUME])
    named(a.rep, "clip_before_unscale", RESUME, "a-clip")


def test_t7_resume_without_the_mid_step_flag(tmp_path):
    a, b = both(make_resume(save_flag=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    t = [gnorm(w) for w in b.want]
    assert all(abs(n / tt - 1) < 0.02 for n, tt in zip(b.norms, t)), list(zip(b.norms, t))
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# A6. the wrapper updates the scaler only when the step was not skipped ("nothing to adapt")
# ======================================================================================================================
class UpdateIfSteppedAccelerator(MiniAccelerator):
    """step(): scaler.step, then update() only when no inf was found (`scaler._found_inf_per_device(opt)`, the
    skip test some trainers use): a skipped step is never updated, so the scale never backs off (A6). `fixed`:
    update() always (T8)."""

    def __init__(self, *a, fixed=False, **k):
        super().__init__(*a, **k)
        self.fixed, self.skipped = fixed, []

    def step(self):
        self.scaler.step(self.optimizer)  # @a6-step
        found = sum(v.item() for v in self.scaler._found_inf_per_device(self.optimizer).values())
        self.skipped.append(bool(found))
        if self.fixed or not found:
            self.scaler.update()
        self._unscaled = False


def make_update_if_stepped(fixed):
    def make():
        c = make_accel(init=2.0 ** 16, growth_interval=GROW_SKIP, max_norm=5.0)()
        c.acc = UpdateIfSteppedAccelerator(c.m, c.opt, c.sc, fixed=fixed)
        return c
    return make


def test_a6_update_only_when_stepped(tmp_path):
    a, b = both(make_update_if_stepped(fixed=False), 12, tmp_path)
    # truth: step 5 overflowed at 2**17 and was skipped without update(); iteration 6's unscale_ raised
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == GROW_SKIP + 1, c.raised
        assert "unscale_() is being called after step()" in c.raised[1], c.raised
        assert c.acc.skipped == [False] * GROW_SKIP + [True], c.acc.skipped
        assert c.scales[GROW_SKIP] == 2.0 ** 17 and len(c.stepped) == GROW_SKIP, (c.scales, len(c.stepped))
    named(a.rep, ("missing_scaler_update", "scaler_misorder"), GROW_SKIP, "a6-step")


def test_t8_update_always(tmp_path):
    a, b = both(make_update_if_stepped(fixed=True), 12, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert b.acc.skipped == [False] * GROW_SKIP + [True] + [False] * 6, b.acc.skipped
    learned(a.losses)
    quiet(a.rep)
