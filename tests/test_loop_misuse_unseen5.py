"""Loop misuse probes, fifth unseen set: GradScaler / optimizer / clipping call-order mistakes in code shapes that
tests/test_loop_misuse2-9.py, test_loop_misuse_unseen.py .. unseen4.py, test_scaler_*.py, test_gan_call_order.py and
test_multi_opt_hostile.py do not build: a Trainer whose clipping is switched on mid-run by a callback and runs in a
helper before the Trainer's own unscale_, `scaler.update()` moved into an optimizer step POST-hook ("can't be
forgotten"), a `optimizer.step()` left in after `scaler.step(optimizer)` was added, a gradient-norm spike guard
(skip the update when the norm is too large) that reads the norm before unscale_, timm's adaptive gradient clipping
(AGC, NFNets) called on the scaled gradients, and a scale-logging optimizer step PRE-hook that calls
`scaler.update()`. Each misuse has a correct twin (the same loop, the mistake fixed) that must be quiet. Everything
runs probe_harness.misuse_net under fp16 CPU autocast + torch.amp.GradScaler("cpu"), one intra-op thread, watched
through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")`,
default settings, `w.close()`, `w.report()`).

Every case runs twice, watched and unwatched, and the losses must be bitwise the same (probe_harness.same_losses).
The truth is proven first without ampdoctor: the gradients the optimizer stepped on (a step pre-hook) vs the true
unscaled gradients recomputed on a copy of the model, the norm a clip returned, the number of optimizer steps per
iteration, torch's own exception and where it came from, weights that stop moving or turn non-finite (a failing
oracle is a plain failure). Then the CONTRACT rule among the first three findings at the step of the first misuse
(0-based optimizer step) and, where a call of the user's is the mistake, at that call's `# @tag` line
(probe_harness.misuse_named; scaler_misorder with its call sequence). A wrong report raises WrongAnswer: a strict
xfail `wrong(...)` quoting what ampdoctor said.

Misuse (twin):
 L1. a Trainer with a callback list; a `ClipAfterWarmup` callback sets `trainer.max_grad_norm = 5.0` at global step 7
     (clipping off during warm-up), and the Trainer's `optimizer_step()` calls its `_clip_gradients()` helper BEFORE
     `self.scaler.unscale_(self.optimizer)` (which is there for the norm log). Truth: steps 0-6 step on the true
     gradients; from step 7 the clip returns ~1024x the true norm (true ~1, below 5: nothing should be clipped) and
     cuts the stepped gradients to ~5/1024 of their norm. clip_before_unscale, error, step 7, at the helper's clip line.
                                                             (T1: the helper called after the unscale_)
 L2. `scaler.update()` moved into an optimizer step POST-hook (`AutoScalerUpdate`: "every optimizer step updates the
     scaler, nobody can forget it"); the loop never calls update(). While no step overflows this is the usual order
     (update runs inside scaler.step, after optimizer.step). GradScaler(init 2**16, growth_interval 5) grows to 2**17
     at the end of step 4 and step 5's scaled backward overflows: scaler.step skips optimizer.step, so its post-hooks
     (and the update) never run; iteration 6's unscale_ raises "unscale_() is being called after step()".
     missing_scaler_update (or scaler_misorder), error, at step 5 (the iteration without an update; step 0 is
     accepted for scaler_misorder: the update ran inside scaler.step from the start), at the scaler.step line or the
     hook's update line.                                    (T2: update() after scaler.step in the loop)
 L3. an fp32 loop converted to AMP: `scaler.step(optimizer)` added, the old `optimizer.step()` left on the next line.
     (a) init_scale 2**20: step 0's scaled backward overflows, scaler.step skips, the leftover optimizer.step applies
     the inf/NaN gradients: every weight is non-finite after iteration 0. (b) init_scale 1024 (no overflow): AdamW
     silently steps twice per iteration. scaler_misorder, error, step 0, at the leftover optimizer.step line.
                                                             (T3: the leftover line deleted)
 L4. a gradient-norm spike guard, switched on after a 5-step warm-up: `norm = clip_grad_norm_(params, inf)` right
     after the scaled backward, `if norm > 100: zero_grad(); continue` (skip the update), then unscale_ + clip +
     step + update. The norm read is 1024x the true one (true ~1), so from step 5 every iteration is skipped and the
     weights never move again. clip_before_unscale (a norm read while scaled: warning or error), step 5, at the
     guard's clip_grad_norm_ line.       (T4: unscale_ before the guard's norm; its skip path calls update())
 L5. timm's `adaptive_clip_grad` (AGC: clip each unit's gradient to clip_factor x its weight's norm) over the body
     (the head left out, as NFNets do) called right after the scaled backward, no unscale_ before it (scaler.step
     unscales). Truth: on the true gradients AGC at clip_factor 1.0 clips no unit; on the scaled ones 97-100% (all
     but dead ReLU units), and the body's stepped gradients are ~0.006x the true ones. clip_before_unscale, error,
     step 0 (hand-written clipping: no line asked).
                                                             (T5: scaler.unscale_ before adaptive_clip_grad)
 L6. a `ScaleLogger` callback registered with `optimizer.register_step_pre_hook` that calls `scaler.update()` "so the
     logged scale is this step's", while the loop calls update() too: the hook's update runs inside scaler.step,
     before the optimizer's step, and resets the scaler; the loop's update() then asserts "No inf checks were recorded
     prior to update." at iteration 0. scaler_misorder, error, step 0, at the hook's update line or the loop's.
                                                             (T6: the hook only reads scaler.get_scale())

Oracle numbers when written: L1 the clip returned 906-1191 at steps 7-11 for true norms 0.88-1.16 (1024x); L4 the
guard read 846-1260 for true norms 0.83-1.23, every iteration from 5 skipped, the weights frozen from then on; L5
97-100% of the body's units clipped (true: 0%), stepped/true 0.0058-0.0069.

Result when written (torch 2.13 CPU, default watch with run_dir): 9 pass, 5 xfail (strict; each reason quotes
ampdoctor's answer).
 - L2 (scaler.update() in an optimizer step post-hook, no update in the loop; step 5 skipped, so no update; iteration
   6's unscale_ raised): '[error] missing_scaler_update at (run) GradScaler.step step 0: An iteration ended without
   `scaler.update()` ... after `scaler.step()` at :LINE(l2-step)'. Step 0 did update (inside scaler.step, from the
   post-hook); the recorded sequence holds no update at all: an update() inside scaler.step is taken for GradScaler's
   own call (record/monitorsink.py: `ev.internal = st.in_scaler_step > 0`). Should be missing_scaler_update at step
   5 (or scaler_misorder at the hook's update line).
 - L3a (a leftover optimizer.step() after scaler.step(), init 2**20: step 0 overflowed, scaler.step skipped, the
   leftover applied inf/NaN): '[error] nan_origin at body step 0: The weights of `body` (Linear) were already NaN when
   step 1 began: step 0's update with non-finite gradients wrote them', '[error] skipped_steps at (run) step 1:
   GradScaler skipped 8 of 8 steps'. No scaler_misorder: rules/callorder.py names a second optimizer.step only when
   the first went through (callseq._stepped_again), and a direct step after unscale_ only when no scaler.step came
   (`not any(p.kind == "step" ...)`); a scaler.step that SKIPPED followed by optimizer.step falls between them.
   Should be scaler_misorder at step 0 at the leftover line (L3b, the same loop without the overflow, gets it).
 - L4 (spike guard reading clip_grad_norm_(inf) before unscale_ from step 5; every later iteration skipped): an empty
   report, summary 'Healthy: no problems found in 5 step(s)' for 12 iterations: the iterations from 5 end no
   optimizer step, so the open step (with its scaled-norm read) is never recorded. Should be clip_before_unscale at
   step 5 at the guard's norm line.
 - L5 (timm AGC before unscale_): an empty report (hand-written clipping on scaled gradients is not seen, as the DQN
   clamp_ of test_loop_misuse_unseen3 M2). Should be clip_before_unscale, error, step 0.
 - L6 (scaler.update() in an optimizer step PRE-hook, the loop updating too; the loop's update asserted at iteration
   0): '[error] scaler_misorder at (run) GradScaler.update step 0: `scaler.update()` at :LINE(l6-loop-update) ran
   before `scaler.step()` in this iteration'. Right rule and step, but the call it names ran after scaler.step and
   only raised; the offending update() (the hook's, inside scaler.step) is not recorded (same cause as L2). Should
   be scaler_misorder at the hook's update line (or the scaler.step line it ran inside).
Fixed since (the same session; each XPASSed, then was unmarked):
 - L2 and L6: an update() inside scaler.step is recorded as the user's (GradScaler.step never updates;
   record/monitorsink.py), and rules/callorder.py says '[error] scaler_misorder ... step 0: `scaler.update()` at
   :LINE(hook) ran inside `scaler.step()` (from an optimizer step hook ...)' at the hook's line, first (L2 then also
   'missing_scaler_update ... step 5' at the skipped step's scaler.step).
 - L3a: callseq._stepped_again also takes a `scaler.step` of the same optimizer that stepped nothing (skipped) before
   a direct optimizer.step: '[error] scaler_misorder ... step 0: `optimizer.step()` at :LINE(l3-leftover) ran after
   `scaler.step()` ... GradScaler skipped that step (its gradients held inf/NaN) and this call applied them anyway'.
 - L4: an open step that read the gradients' norm while scaled is kept at close (record/stepends.py), and
   clip_before_unscale says '[error] ... step 5: `clip_grad_norm_` at :LINE(l4-norm) ran on gradients still
   multiplied by the loss scale (1024) — the norm it read is scale× too large; from step 5 on the loop stepped no
   optimizer in its last 7 iterations ...'.
Right: L1 ('[error] clip_before_unscale at (run) torch.nn.utils.clip_grad_norm_ step 7 ... seen on 5 step(s)' at the
helper's clip line), L3b ('[error] scaler_misorder ... step 0: `optimizer.step()` ran twice in one iteration on the
same gradients' at the leftover line), and every twin T1-T6 quiet (T3 at both init scales).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from scenarios import one_thread
from probe_harness import (gnorm, keep_stepped, learned, misuse_batch, misuse_both, misuse_loss, misuse_named,
                           misuse_net, misuse_quiet, misuse_scaler, misuse_true_grads, misuse_weights, near, ratio,
                           wrong, WrongAnswer)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = __file__
SCALE = 1024.0
ERR = ("error",)

net = misuse_net
batch = misuse_batch


scaler, fwd_loss, true_grads, weights = misuse_scaler, misuse_loss, misuse_true_grads, misuse_weights


def both(make, steps, tmp_path):
    return misuse_both(make, steps, tmp_path / "run")


def named(rep, rule, step, tags=None, severity=ERR):
    return misuse_named(rep, rule, step, tags, severity, src=HERE)


quiet = misuse_quiet


# ======================================================================================================================
# L1. a Trainer whose clipping a callback switches on at step 7, clipping in a helper before the Trainer's unscale_
# ======================================================================================================================
CLIP_FROM = 7
MAX_NORM = 5.0


class ClipAfterWarmup:
    """Switches gradient clipping on once the warm-up is over."""

    def __init__(self, at, max_norm):
        self.at, self.max_norm = at, max_norm

    def on_step_begin(self, trainer):
        if trainer.global_step == self.at:
            trainer.max_grad_norm = self.max_norm


class CallbackTrainer:
    def __init__(self, model, optimizer, scaler, callbacks, clip_after_unscale):
        self.model, self.optimizer, self.scaler, self.callbacks = model, optimizer, scaler, callbacks
        self.clip_after_unscale = clip_after_unscale
        self.max_grad_norm, self.global_step, self.clip_norms, self.logged = None, 0, {}, []

    def _call(self, event):
        for cb in self.callbacks:
            getattr(cb, event, lambda t: None)(self)

    def _clip_gradients(self):
        n = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)  # @l1-clip
        self.clip_norms[self.global_step] = float(n)

    def optimizer_step(self):
        if self.max_grad_norm is not None and not self.clip_after_unscale:
            self._clip_gradients()
        self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None and self.clip_after_unscale:
            self._clip_gradients()
        self.logged.append(gnorm([p.grad for p in self.model.parameters()]))
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def training_step(self, i):
        self._call("on_step_begin")
        self.optimizer.zero_grad(set_to_none=True)
        loss = fwd_loss(self.model, i)
        self.scaler.scale(loss).backward()
        self.optimizer_step()
        self.global_step += 1
        return loss.item()


def make_trainer(clip_after_unscale):
    def make():
        c = SimpleNamespace(m=net(), want=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler()
        c.trainer = CallbackTrainer(c.m, c.opt, c.sc, [ClipAfterWarmup(CLIP_FROM, MAX_NORM)], clip_after_unscale)
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
            return c.trainer.training_step(i)
        c.body = body
        return c
    return make


def test_l1_trainer_clip_switched_on_at_step_7_before_unscale(tmp_path):
    a, b = both(make_trainer(clip_after_unscale=False), 12, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: before step 7 no clip and the true gradients are stepped; from 7 the clip saw ~1024x the true norm (true
    # below MAX_NORM: nothing to clip) and the stepped gradients are the true ones cut to MAX_NORM / scaled norm
    assert sorted(b.trainer.clip_norms) == list(range(CLIP_FROM, 12)), b.trainer.clip_norms
    assert all(near(s, w) for s, w in zip(b.stepped[:CLIP_FROM], b.want[:CLIP_FROM]))
    for k, n in b.trainer.clip_norms.items():
        t = gnorm(b.want[k])
        assert t < MAX_NORM and abs(n / (SCALE * t) - 1) < 0.02, (k, n, t)
        assert near(b.stepped[k], b.want[k], factor=MAX_NORM / n), (k, ratio(b.stepped[k], b.want[k]))
    named(a.rep, "clip_before_unscale", CLIP_FROM, "l1-clip")


def test_t1_trainer_clip_switched_on_after_unscale(tmp_path):
    a, b = both(make_trainer(clip_after_unscale=True), 12, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(abs(n / gnorm(b.want[k]) - 1) < 0.02 for k, n in b.trainer.clip_norms.items()), b.trainer.clip_norms
    assert all(near(s, w) for s, w in zip(b.stepped, b.want)), [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# L2. scaler.update() in an optimizer step post-hook: a skipped step runs no post-hook, so no update
# ======================================================================================================================
GROW_SKIP = 5      # growth_interval 5 from 2**16: the scale doubles after step 4 and step 5's backward overflows


class AutoScalerUpdate:
    """'Every optimizer step updates the scaler': a step post-hook calling scaler.update()."""

    def __init__(self, optimizer, scaler):
        self.scaler, self.calls = scaler, 0
        optimizer.register_step_post_hook(self.after_step)

    def after_step(self, optimizer, args, kwargs):
        self.calls += 1
        self.scaler.update()  # @l2-hook-update


def make_post_hook_update(update_in_loop):
    def make():
        c = SimpleNamespace(m=net(), scales=[], found=[])
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler(2.0 ** 16, growth_interval=GROW_SKIP)
        c.auto = None if update_in_loop else AutoScalerUpdate(c.opt, c.sc)

        def body(i):
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            c.sc.unscale_(c.opt)
            c.found.append(not math.isfinite(float(torch.nn.utils.clip_grad_norm_(c.m.parameters(), 5.0))))
            c.scales.append(c.sc.get_scale())
            c.sc.step(c.opt)  # @l2-step
            if update_in_loop:
                c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


def test_l2_scaler_update_in_step_post_hook_skipped_with_the_step(tmp_path):
    a, b = both(make_post_hook_update(update_in_loop=False), 12, tmp_path)
    # truth: steps 0-4 were updated by the hook; step 5 overflowed at 2**17, scaler.step skipped optimizer.step and
    # its post-hook, so no update(); iteration 6's unscale_ raised
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == GROW_SKIP + 1, c.raised
        assert "unscale_() is being called after step()" in c.raised[1], c.raised
        assert c.found == [False] * GROW_SKIP + [True], c.found
        assert c.scales[GROW_SKIP] == 2.0 ** 17 and c.auto.calls == GROW_SKIP, (c.scales, c.auto.calls)
    f = named(a.rep, ("missing_scaler_update", "scaler_misorder"), (0, GROW_SKIP), ("l2-step", "l2-hook-update"))
    if f.rule == "missing_scaler_update" and f.step != GROW_SKIP:
        raise WrongAnswer(f"missing_scaler_update dated {f.step}, the iteration without update() is {GROW_SKIP}: "
                          f"{f.one_line()}")


def test_t2_scaler_update_in_the_loop(tmp_path):
    a, b = both(make_post_hook_update(update_in_loop=True), 12, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # the same growth probe overflows at step 5 and is skipped; the scaler backs off and training goes on
    assert a.found[GROW_SKIP] and sum(a.found) == 1, a.found
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# L3. the fp32 loop's optimizer.step() left in after scaler.step(optimizer)
# ======================================================================================================================
def make_leftover_step(leftover, init):
    def make():
        c = SimpleNamespace(m=net(), steps_per_it=[], nonfinite=[])
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler(init)
        c.n = 0

        def count(o, a, k):
            c.n += 1
        c.opt.register_step_pre_hook(count)

        def body(i):
            c.n = 0
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 5.0)
            c.sc.step(c.opt)
            if leftover:
                c.opt.step()  # @l3-leftover
            c.sc.update()
            c.steps_per_it.append(c.n)
            c.nonfinite.append(not all(bool(torch.isfinite(p).all()) for p in c.m.parameters()))
            return loss.item()
        c.body = body
        return c
    return make


def test_l3a_leftover_optimizer_step_applies_the_overflowed_gradients(tmp_path):
    a, b = both(make_leftover_step(leftover=True, init=2.0 ** 20), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: step 0 overflowed (scaler.step skipped: one optimizer step, the leftover one), and the weights are
    # non-finite from iteration 0 on
    assert b.steps_per_it[0] == 1 and b.nonfinite[0] and all(b.nonfinite), (b.steps_per_it, b.nonfinite)
    named(a.rep, "scaler_misorder", 0, "l3-leftover")


def test_l3b_leftover_optimizer_step_steps_twice(tmp_path):
    a, b = both(make_leftover_step(leftover=True, init=SCALE), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: no overflow, two AdamW steps on every iteration
    assert b.steps_per_it == [2] * 8 and not any(b.nonfinite), (b.steps_per_it, b.nonfinite)
    named(a.rep, "scaler_misorder", 0, "l3-leftover")


@pytest.mark.parametrize("init", [2.0 ** 20, SCALE])
def test_t3_leftover_line_deleted(tmp_path, init):
    a, b = both(make_leftover_step(leftover=False, init=init), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(n <= 1 for n in b.steps_per_it) and not any(b.nonfinite), (b.steps_per_it, b.nonfinite)
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# L4. a gradient-norm spike guard that reads the norm before unscale_
# ======================================================================================================================
GUARD_FROM = 5
SKIP_NORM = 100.0


def make_spike_guard(unscale_first):
    def make():
        c = SimpleNamespace(m=net(), want=[], guard_norms={}, skipped=[], moved=[])
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler()

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
            before = weights(c.m)
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            if unscale_first:
                c.sc.unscale_(c.opt)
            if i >= GUARD_FROM:
                norm = float(torch.nn.utils.clip_grad_norm_(c.m.parameters(), float("inf")))  # @l4-norm
                c.guard_norms[i] = norm
                if norm > SKIP_NORM:
                    c.skipped.append(i)
                    c.opt.zero_grad(set_to_none=True)
                    if unscale_first:
                        c.sc.update()
                    c.moved.append(any(not torch.equal(p, q) for p, q in zip(before, c.m.parameters())))
                    return loss.item()
            if not unscale_first:
                c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 5.0)
            c.sc.step(c.opt)
            c.sc.update()
            c.moved.append(any(not torch.equal(p, q) for p, q in zip(before, c.m.parameters())))
            return loss.item()
        c.body = body
        return c
    return make


def test_l4_spike_guard_reads_the_scaled_norm(tmp_path):
    a, b = both(make_spike_guard(unscale_first=False), 12, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the true norms are far below SKIP_NORM; the guard read ~1024x them and skipped every iteration from 5
    for k, n in b.guard_norms.items():
        t = gnorm(b.want[k])
        assert t < SKIP_NORM / 10 and abs(n / (SCALE * t) - 1) < 0.02, (k, n, t)
    assert b.skipped == list(range(GUARD_FROM, 12)), b.skipped
    assert b.moved == [True] * GUARD_FROM + [False] * (12 - GUARD_FROM), b.moved
    named(a.rep, "clip_before_unscale", GUARD_FROM, "l4-norm", severity=("warning", "error"))


def test_t4_spike_guard_after_unscale(tmp_path):
    a, b = both(make_spike_guard(unscale_first=True), 12, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert not b.skipped and all(b.moved), (b.skipped, b.moved)
    assert all(abs(n / gnorm(b.want[k]) - 1) < 0.02 for k, n in b.guard_norms.items()), b.guard_norms
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# L5. timm's adaptive gradient clipping (AGC) on the scaled gradients
# ======================================================================================================================
AGC_FACTOR = 1.0


def unitwise_norm(x, norm_type=2.0):
    """timm/utils/agc.py"""
    if x.ndim <= 1:
        return x.norm(norm_type)
    return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0, clipped=None):
    """timm/utils/agc.py's adaptive_clip_grad (plus a count of the units it clipped)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for p in parameters:
        if p.grad is None:
            continue
        p_data = p.detach()
        g_data = p.grad.detach()
        max_norm = unitwise_norm(p_data, norm_type=norm_type).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data, norm_type=norm_type)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        if clipped is not None:
            clipped.append(float((grad_norm >= max_norm).float().mean()))
        p.grad.detach().copy_(new_grads)


def agc_on(m, grads):
    """The share of units AGC would clip on `grads` at m's weights."""
    out = []
    for p, g in zip(m.parameters(), grads):
        max_norm = unitwise_norm(p.detach()).clamp(min=1e-3).mul(AGC_FACTOR)
        out.append(float((unitwise_norm(g) >= max_norm).float().mean()))
    return out


def make_agc(unscale_first):
    def make():
        c = SimpleNamespace(m=net(), want=[], clipped=[], true_clipped=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler()
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
                c.true_clipped.append(max(agc_on(c.m.body, c.want[-1][:2])))
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            if unscale_first:
                c.sc.unscale_(c.opt)
            got = []
            adaptive_clip_grad(c.m.body.parameters(), AGC_FACTOR, clipped=got)  # the head is not clipped (NFNets)
            c.clipped.append(got)
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


@wrong("an empty report; should be clip_before_unscale, error, step 0 (timm's adaptive_clip_grad on the scaled "
       "gradients)")
def test_l5_agc_on_scaled_gradients(tmp_path):
    a, b = both(make_agc(unscale_first=False), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: on the true gradients AGC clips no unit of the body; on the scaled ones most units (all but the dead
    # ReLU units, whose gradient is 0), and the body's stepped gradients are far below the true ones
    assert max(b.true_clipped) == 0.0 and min(min(g) for g in b.clipped) > 0.5, (b.true_clipped, b.clipped)
    assert all(ratio(s[:2], w[:2])[0] < 0.05 for s, w in zip(b.stepped, b.want)), \
        [ratio(s[:2], w[:2]) for s, w in zip(b.stepped, b.want)]
    named(a.rep, "clip_before_unscale", 0)


def test_t5_agc_after_unscale(tmp_path):
    a, b = both(make_agc(unscale_first=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert max(max(g) for g in b.clipped) == 0.0, b.clipped
    assert all(near(s, w) for s, w in zip(b.stepped, b.want)), [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# L6. a scale-logging optimizer step pre-hook that calls scaler.update(), the loop updating too
# ======================================================================================================================
class ScaleLogger:
    def __init__(self, optimizer, scaler, update):
        self.scaler, self.update, self.scales = scaler, update, []
        optimizer.register_step_pre_hook(self.before_step)

    def before_step(self, optimizer, args, kwargs):
        if self.update:
            self.scaler.update()  # @l6-hook-update
        self.scales.append(self.scaler.get_scale())


def make_scale_logger(update_in_hook):
    def make():
        c = SimpleNamespace(m=net())
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler()
        c.logger = ScaleLogger(c.opt, c.sc, update_in_hook)

        def body(i):
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 5.0)
            c.sc.step(c.opt)  # @l6-step
            c.sc.update()  # @l6-loop-update
            return loss.item()
        c.body = body
        return c
    return make


def test_l6_step_pre_hook_updates_the_scaler(tmp_path):
    a, b = both(make_scale_logger(update_in_hook=True), 8, tmp_path)
    # truth: the hook's update() ran inside scaler.step (before the optimizer's step) and reset the scaler; the loop's
    # own update() then asserted at iteration 0
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == 0, c.raised
        assert "No inf checks were recorded prior to update." in c.raised[1], c.raised
        assert c.raised[2][-1] == "update" and "before_step" not in c.raised[2], c.raised[2]
        assert len(c.logger.scales) == 1, c.logger.scales
    # the offending call is the hook's update() (inside scaler.step); the loop's update() only raised after it
    named(a.rep, "scaler_misorder", 0, ("l6-hook-update", "l6-step"))


def test_t6_step_pre_hook_reads_the_scale_only(tmp_path):
    a, b = both(make_scale_logger(update_in_hook=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert b.logger.scales == [SCALE] * 10, b.logger.scales
    learned(a.losses)
    quiet(a.rep)
