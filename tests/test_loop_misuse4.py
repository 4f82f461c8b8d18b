"""Loop misuse probes, fourth set: GradScaler / optimizer / clipping misuse that tests/test_loop_misuse2.py,
tests/test_loop_misuse3.py and test_unseen_variants5/13.py do not build, each watched through the public API only
(`ampdoctor.watch(model, optimizer=opt, scaler=sc)` around an ordinary fp16 autocast + torch.amp.GradScaler("cpu")
loop on a tiny model, then `w.report()`), at ampdoctor's default settings. Every misuse first checks in the test
itself that the harm is real (torch's exception, a norm or an update ~scale x off, two optimizer steps per
iteration, NaN weights, a scale that never moves); then the rule among the first three findings, its severity and
its step (the optimizer step of the first misuse, 0-based) and, for call-order rules, the line of the user's wrong
call in `finding.evidence`.

Misuse:
 M1. `clip_grad_norm_(params, max_norm=1.0, norm_type=inf, foreach=True)` (keywords only) before unscale_:
     clip_before_unscale error at step 0.
 M2. `clip_grad_norm_(..., error_if_nonfinite=True)` before unscale_: at init_scale 1024 it silently clips the
     scaled norm; at init_scale 2**24 the scaled gradients are inf and the clip RAISES at step 0 ("non-finite"),
     where GradScaler would have skipped the step. Both: clip_before_unscale error at step 0 (also from the crash).
     (After unscale_ an inf stays inf, so error_if_nonfinite=True raises there too while the scaler searches: the
     twin runs at 1024.)
 M3. unscale_ -> clip -> scaler.step every iteration but `scaler.update()` only on even iterations: step 1 ends
     without update(), step 2's unscale_ raises ("unscale_() is being called after step()"): missing_scaler_update error
     at step 1 (the iteration that lacked its update).
 M4. step + update twice per iteration (a Trainer helper `finish()` does scaler.step + update, the loop still does
     both too): torch says nothing, the second scaler.step unscales the already unscaled gradients again and
     AdamW takes two steps per iteration: scaler_misorder error at step 0 at the loop's second scaler.step.
 M5. an encoder/decoder with one optimizer each (one scaler): only the encoder's optimizer is unscaled before a
     clip over model.parameters(); the decoder's still-scaled gradients dominate the norm and the encoder's
     gradients are clipped ~1000x: clip_before_unscale error at step 0 (watch given either optimizer).
 M6. two towers, one optimizer each: the loop unscales the image tower's optimizer but clips the TEXT tower's
     parameters (a copy-paste slip): clip_before_unscale error at step 0 (watch given either optimizer).
 M7. the loss scaled twice (`scaler.scale(scaler.scale(loss)).backward()`, a helper that scales a loss the caller
     already scaled): the first steps overflow at scale^2, then every unscale_ leaves gradients `scale` x too large:
     scaler_misorder error at step 0 at that line.
 M8. `scaler.update(scaler.get_scale())` ("keep the scale constant") with init_scale 2**24: the scale never backs
     off and every step is skipped, the weights never move: skipped_steps error at step 0 (not loss_scale_collapse:
     the scale did not back off at all).
 M9. `optimizer.step(closure)` whose closure runs the scaled backward, unscale_ and clip_grad_norm_; then
     scaler.update(): GradScaler's inf check is bypassed; with init_scale 2**24 the step-0 inf/NaN gradients are
     applied (weights NaN): scaler_misorder error at step 0 at the optimizer.step line.
M10. the optimizer rebuilt at step 3 (a new lr phase) while a gradient-clipping callback keeps the OLD optimizer:
     `scaler.unscale_(old_opt)` divides the same parameters' gradients, then `scaler.step(new_opt)` divides them
     again: the step-3 update is ~1024x too small, silently: scaler_misorder error at step 3.
M11. update() twice per iteration (the helper updates, the loop updates again): GradScaler asserts "No inf checks
     were recorded prior to update." at step 0: scaler_misorder error at step 0 at the loop's update line.
M12. a fused AdamW (`fused=True`, whose kernel unscales inside scaler.step) with `clip_grad_norm_` before
     scaler.step and no unscale_: the scaled norm is clipped: clip_before_unscale error at step 0.
M13. "deferred" `scaler.update()` written inside the micro-batch loop of a gradient-accumulation step (4 micro-
     batches, update before each backward from step 1 on): the second update of step 1 asserts "No inf checks":
     scaler_misorder error at step 1 at that line.
M14. an auxiliary loss backpropagated AFTER unscale_ + clip (`scaler.scale(aux).backward()` appended below the
     clip): its gradients are still multiplied by the scale when scaler.step applies them: scaler_misorder error
     at step 0 (the unscale_ that came too early, or the aux backward's line).

Correct twins (no warning, no error): T1 the foreach inf-norm clip after unscale_; T2 error_if_nonfinite=True
after unscale_ (init 1024); T3 update every iteration; T4 the helper alone steps and updates; T5 both optimizers
unscaled before the clip over every parameter; T6 the text tower's own optimizer unscaled before its clip; T7 the
loss scaled once, and gradient accumulation that divides AFTER scaler.scale (`(scaler.scale(loss) / 4).backward()`,
the same gradients); T8 plain update() with init_scale 2**24 (the first steps skipped: info); T9 the closure called
by hand, then scaler.step (init 2**24: info); T10 the callback rebound to the new optimizer; T12 the fused AdamW
with unscale_ + clip, and without any clip; T13 the deferred update once per step, before the micro-batch loop;
T14 the auxiliary loss backpropagated before unscale_; T15 `scaler.step(opt); opt.zero_grad(); scaler.update()`
(zero_grad between step and update: the same iteration, nothing reads the scale in between). Also, no AMP warning
or error:
 - an LR scheduler stepped after every scaler.step although GradScaler skipped the first ones (init_scale 2**24):
   torch warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`"; this is the expected backoff
   (CONTRACT.md has no rule for it; skipped_steps info is what a tool should say, and ampdoctor's skipped_steps
   info already explains the warning);
 - GradScaler(enabled=False) with bf16 autocast and a clip without unscale_ (nothing is scaled).

What ampdoctor got wrong (strict xfails, 7 of 37 runs; each reason says what it reported instead). Fixed since: M3 (dated
at the scaler.step whose iteration lacked its update), M4 (a second optimizer.step of the same optimizer with no
scaled backward or zero_grad between, across an update: rules/callorder.py _stepped_again), M7 (a scale() of the
previous scale()'s output is noted by record/monitorsink.py), M8 (rules/scaler.py _pinned_streak: skips at one
unchanging scale are skipped_steps, named at the update(new_scale) call), T13 and T15 (a zero_grad after
scaler.step and before its update no longer begins the next step record: MonitorCallbacks._awaits_update);
M11's message now says update() ran twice. M10 since: the recorder notes a scaler.step() that will unscale
gradients another optimizer object holding the same parameters already unscaled (record/monitorsink.py).
 - M3: missing_scaler_update is dated step 2 (the unscale_ that raised), not step 1 (the iteration that ended
   without update()): rules/callorder.py call_order, the unscale_ branch's `new_iter` case, hands the failing
   unscale_ event to add() instead of the scaler.step() whose iteration lacked its update.
 - M4: empty report. call_order cuts `since_update` at every update(), so step, update, step, update with no
   scale() between the two steps reads as two clean iterations; no branch checks that a scaler.step() had a scaled
   backward since the same optimizer's previous step (the watch itself counts 6 steps for 6 iterations).
 - M7: only info (overflow at head, skipped_steps 3 of 10). record/monitorsink.py MonitorCallbacks.before('scale')
   records each scale() alone (both "backwards ran"); call_order has no branch for a scale() of a scale() output.
 - M8: '[error] loss_scale_collapse ... the scale fell from 1.67772e+07 to 8.39e+06' (after an overflow error at
   the root) instead of skipped_steps: StepRecord.next_scale (records.py) is declared but never written by the
   recorder, so rules/scaler.py scale_after() derives scale * backoff_factor for a skipped last step although
   update(new_scale) pinned it at 2**24 (the finding's own timeline shows 2**24 on all 12 steps), and
   scale_timeline takes the collapse branch for any streak >= collapse_consecutive (10) without checking that the
   scale actually backed off.
 - M10: empty report. call_order skips unscale_/step events of another optimizer (`p.opt != e.opt`, the GAN
   pattern), so unscale_(old optimizer) + step(new optimizer) over the SAME parameters (divided twice) is two
   optimizers each handled once; their parameter sets are never compared.
 - T13 and T15 (false errors on correct loops): '[error] missing_scaler_update step 0 ... called scaler.step() but
   never scaler.update()' whenever opt.zero_grad() runs between scaler.step() and scaler.update() (the deferred
   update of T13 after an accumulation step that zeroes at its end; T15's plain step -> zero_grad -> update).
   record/monitorsink.py MonitorCallbacks.zero_grad calls StepMachine.begin(), which finalizes the ENDED step, so
   the update() lands in the next step record; rules/callorder.py _updated_later then returns `p.step == e.step`,
   False.

Seen but not asserted: M11's scaler_misorder (right rule, step and line) says "`scaler.update()` ... ran before
`scaler.step()` in this iteration", but it ran twice, after the step; M7's run trains on with gradients 128x too
large once the scale settles at 128 (128^2 fits fp16), reported as benign info.
"""
from __future__ import annotations

import math
import os
import warnings
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, lines, one_thread, randn
from probe_harness import expect as _expect, quiet_report, tag_line


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
BIG = 2.0 ** 24  # an init_scale whose first backward overflows fp16 (checked where it matters)


line_of = partial(tag_line, __file__)


def expect(rep, rule, severity=("error",), step=None, tag=None, tags=None):
    """probe_harness.expect at this file's `# @tag` lines."""
    return _expect(rep, rule, severity, step, tag, tags, src=HERE)


quiet = quiet_report


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class TwoPart(nn.Module):
    """Two parts trained by two optimizers (an encoder/decoder, or two towers) on one loss."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.dec = nn.Linear(16, 1)

    def forward(self, x):
        return self.dec(self.enc(x))


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Linear(8, 8)
        self.txt = nn.Linear(6, 8)

    def forward(self, x, t):
        return (self.img(x) * self.txt(t)).sum(-1, keepdim=True)


def net():
    torch.manual_seed(0)
    return Net()


def batch(i):
    return randn(16, 8, seed=i), randn(16, 1, seed=100 + i)


def fwd_loss(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        return F.mse_loss(m(x).float(), y)


def setup(init_scale=1024.0, opt="adamw", lr=1e-3, **okw):
    m = net()
    o = (torch.optim.AdamW(m.parameters(), lr=lr, **okw) if opt == "adamw"
         else torch.optim.SGD(m.parameters(), lr=lr, **okw))
    return m, o, torch.amp.GradScaler("cpu", init_scale=init_scale)


def run(m, opt, sc, body, steps=6, after=None):
    """watch -> body(i) for each step -> (after()) -> close; a RuntimeError/AssertionError raised by torch in the
    loop stops it (recorded as (step, message)). Returns (report, raised)."""
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    raised = None
    try:
        for i in range(steps):
            body(i)
        if after is not None:
            after()
    except (RuntimeError, AssertionError) as e:
        raised = (i, str(e))
    finally:
        w.close()
    return w.report(), raised


def grad_norm(params):
    return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))


def true_norm(i):
    """The unscaled fp16-autocast gradient norm of batch i on a fresh net (what a correct unscale_ gives)."""
    m = net()
    fwd_loss(m, i).backward()
    return grad_norm(m.parameters())


# ======================================================================================================================
# M1 / T1. clip_grad_norm_ with keywords only: max_norm=, norm_type=inf, foreach=True
# ======================================================================================================================
def foreach_body(m, opt, sc, ok, norms):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        if ok:
            sc.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            m.parameters(), max_norm=1.0, norm_type=float("inf"), foreach=True)))  # @foreach-clip
        if not ok:
            sc.unscale_(opt)
        sc.step(opt)
        sc.update()
    return body


def test_m1_foreach_inf_norm_clip_with_keywords_before_unscale():
    m, opt, sc = setup()
    norms, ref = [], []
    rep, raised = run(m, opt, sc, foreach_body(m, opt, sc, False, norms))
    m2, opt2, sc2 = setup()
    foreach_body(m2, opt2, sc2, True, ref)(0)
    assert raised is None and abs(norms[0] / ref[0] - 1024) < 2 and ref[0] > 0.05, (norms, ref)  # real: x1024
    expect(rep, "clip_before_unscale", step=0)


def test_t1_twin_foreach_inf_norm_clip_after_unscale_is_quiet():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, foreach_body(m, opt, sc, True, []))
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# M2 / T2. clip_grad_norm_(error_if_nonfinite=True) before unscale_
# ======================================================================================================================
def nonfinite_body(m, opt, sc, ok, norms):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        if ok:
            sc.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)))  # @nf-clip
        if not ok:
            sc.unscale_(opt)
        sc.step(opt)
        sc.update()
    return body


@pytest.mark.parametrize("init_scale", [1024.0, BIG], ids=["silent_1024", "raises_2e24"])
def test_m2_error_if_nonfinite_clip_before_unscale(init_scale):
    m, opt, sc = setup(init_scale=init_scale)
    norms = []
    rep, raised = run(m, opt, sc, nonfinite_body(m, opt, sc, False, norms))
    if init_scale == BIG:
        # real: the scaled gradients are inf and the clip raises (GradScaler would have skipped this step)
        assert raised is not None and raised[0] == 0 and "non-finite" in raised[1] and not norms, raised
    else:
        assert raised is None and norms[0] > 50 * true_norm(0), norms  # real: the scaled norm was clipped
    expect(rep, "clip_before_unscale", step=0, tag="nf-clip")


def test_t2_twin_error_if_nonfinite_clip_after_unscale_is_quiet():
    m, opt, sc = setup()
    norms = []
    rep, raised = run(m, opt, sc, nonfinite_body(m, opt, sc, True, norms))
    assert raised is None and abs(norms[0] / true_norm(0) - 1) < 0.05, norms
    quiet(rep)


# ======================================================================================================================
# M3 / T3. unscale_ -> clip -> step every iteration, update() only on even iterations
# ======================================================================================================================
def even_body(m, opt, sc, ok):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)  # @even-unscale
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)  # @even-step
        if ok or i % 2 == 0:
            sc.update()
    return body


def test_m3_update_only_on_even_iterations_is_missing_scaler_update_at_step_1():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, even_body(m, opt, sc, False))
    assert raised is not None and raised[0] == 2 and "unscale_() is being called after step()" in raised[1], raised
    expect(rep, "missing_scaler_update", step=1)


def test_t3_twin_update_every_iteration_is_quiet():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, even_body(m, opt, sc, True))
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# M4 / M11 / T4. a Trainer helper that steps and updates, and a loop that repeats step and/or update
# ======================================================================================================================
class Finisher:
    """A project's helper for the end of an iteration: scaler.step + scaler.update."""

    def __init__(self, opt, sc):
        self.opt, self.sc = opt, sc

    def finish(self):
        self.sc.step(self.opt)
        self.sc.update()


def finish_body(m, opt, sc, repeat, steps_taken):
    helper = Finisher(opt, sc)

    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        n0 = float(opt.state_dict()["state"].get(0, {}).get("step", 0))  # (a tensor AdamW bumps in place)
        helper.finish()
        if repeat == "step_and_update":
            sc.step(opt)  # @again-step
            sc.update()
        elif repeat == "update":
            sc.update()  # @again-update
        steps_taken.append(float(opt.state_dict()["state"][0]["step"]) - n0)
    return body


def test_m4_scaler_step_and_update_twice_per_iteration_is_silent_and_named():
    m, opt, sc = setup()
    steps_taken = []
    rep, raised = run(m, opt, sc, finish_body(m, opt, sc, "step_and_update", steps_taken))
    assert raised is None and steps_taken[0] == 2, steps_taken  # real: two AdamW steps per iteration, torch silent
    expect(rep, "scaler_misorder", step=0, tag="again-step")


def test_m11_update_twice_per_iteration_asserts_and_is_named():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, finish_body(m, opt, sc, "update", []))
    assert raised is not None and raised[0] == 0 and "No inf checks" in raised[1], raised
    expect(rep, "scaler_misorder", step=0, tag="again-update")


def test_t4_twin_the_helper_alone_steps_and_updates_is_quiet():
    m, opt, sc = setup()
    steps_taken = []
    rep, raised = run(m, opt, sc, finish_body(m, opt, sc, None, steps_taken))
    assert raised is None and steps_taken == [1.0] * 6, steps_taken
    quiet(rep)


# ======================================================================================================================
# M5 / M6 / T5 / T6. two optimizers on one scaler, only one unscaled before a clip
# ======================================================================================================================
def two_part_run(mode, watched="dec"):
    """mode: 'enc_only' (M5: clip over every parameter, only the encoder's optimizer unscaled), 'both' (T5);
    watched: the optimizer given to watch() (the other one is found at its first step)."""
    torch.manual_seed(0)
    m = TwoPart()
    o_enc = torch.optim.AdamW(m.enc.parameters(), lr=1e-3)
    o_dec = torch.optim.AdamW(m.dec.parameters(), lr=3e-4)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    enc_norms = []

    def body(i):
        x, y = batch(i)
        o_enc.zero_grad()
        o_dec.zero_grad()
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(o_enc)
        if mode == "both":
            sc.unscale_(o_dec)
        before = grad_norm(m.enc.parameters())
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # @two-part-clip
        enc_norms.append((before, grad_norm(m.enc.parameters())))
        sc.step(o_enc)
        sc.step(o_dec)
        sc.update()

    rep, raised = run(m, o_dec if watched == "dec" else o_enc, sc, body)
    return rep, raised, enc_norms


@pytest.mark.parametrize("watched", ["dec", "enc"])
def test_m5_only_the_encoder_unscaled_before_a_clip_over_every_parameter(watched):
    rep, raised, enc_norms = two_part_run("enc_only", watched)
    before, after = enc_norms[0]
    # real: the encoder's unscaled gradients (norm < 1, nothing to clip) were shrunk by the decoder's scaled norm
    assert raised is None and before < 1.0 and after < before / 100, enc_norms[:2]
    expect(rep, "clip_before_unscale", step=0, tag="two-part-clip")


@pytest.mark.parametrize("watched", ["dec", "enc"])
def test_t5_twin_both_optimizers_unscaled_before_the_clip_is_quiet(watched):
    rep, raised, enc_norms = two_part_run("both", watched)
    assert raised is None
    quiet(rep)


def towers_run(ok, watched="img"):
    torch.manual_seed(0)
    m = Towers()
    o_img = torch.optim.AdamW(m.img.parameters(), lr=1e-3)
    o_txt = torch.optim.AdamW(m.txt.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    norms = []

    def body(i):
        x, y = batch(i)
        t = randn(16, 6, seed=200 + i)
        o_img.zero_grad()
        o_txt.zero_grad()
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x, t).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(o_img)
        torch.nn.utils.clip_grad_norm_(m.img.parameters(), 1.0)
        if ok:
            sc.unscale_(o_txt)  # (the misuse unscales o_img only, above)
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.txt.parameters(), 1.0)))  # @txt-clip
        sc.step(o_img)
        sc.step(o_txt)
        sc.update()

    rep, raised = run(m, o_img if watched == "img" else o_txt, sc, body)
    return rep, raised, norms


@pytest.mark.parametrize("watched", ["img", "txt"])
def test_m6_the_text_towers_parameters_clipped_after_unscaling_the_image_optimizer(watched):
    rep, raised, norms = towers_run(False, watched)
    _, _, ref = towers_run(True)
    assert raised is None and abs(norms[0] / ref[0] - 1024) < 2, (norms[:1], ref[:1])  # real: the scaled norm
    expect(rep, "clip_before_unscale", step=0, tag="txt-clip")


@pytest.mark.parametrize("watched", ["img", "txt"])
def test_t6_twin_each_tower_unscaled_before_its_clip_is_quiet(watched):
    rep, raised, _ = towers_run(True, watched)
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# M7 / T7. the loss scaled twice; gradient accumulation dividing after scaler.scale
# ======================================================================================================================
def double_body(m, opt, sc, twice, norms, scales):
    def body(i):
        opt.zero_grad()
        loss = fwd_loss(m, i)
        scales.append(sc.get_scale())
        if twice:
            sc.scale(sc.scale(loss)).backward()  # @double-scale
        else:
            sc.scale(loss).backward()
        sc.unscale_(opt)
        norms.append(grad_norm(m.parameters()))
        sc.step(opt)
        sc.update()
    return body


def test_m7_loss_scaled_twice():
    m, opt, sc = setup()
    norms, scales = [], []
    rep, raised = run(m, opt, sc, double_body(m, opt, sc, True, norms, scales), steps=10)
    assert raised is None
    assert not math.isfinite(norms[0]), norms  # real: 1024^2 overflowed the first backward
    k = next(j for j, n in enumerate(norms) if math.isfinite(n))
    # real: once finite, the "unscaled" gradients are still multiplied by the scale (vs. a correct run's norm)
    m2, opt2, sc2 = setup()
    ref = []
    body2 = double_body(m2, opt2, sc2, False, ref, [])
    for j in range(k + 1):
        body2(j)
    assert abs(norms[k] / ref[k] / scales[k] - 1) < 0.2, (k, norms[k], ref[k], scales[k])
    expect(rep, "scaler_misorder", step=0, tag="double-scale")


def test_t7_twin_loss_scaled_once_is_quiet():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, double_body(m, opt, sc, False, [], []), steps=10)
    assert raised is None
    quiet(rep)


def test_t7_twin_accumulation_dividing_after_scaler_scale_is_quiet():
    """`(scaler.scale(loss) / accum).backward()`: the same gradients as `scaler.scale(loss / accum)` (checked)."""
    m, opt, sc = setup()
    grads = []

    def body(i):  # 4 micro-batches per optimizer step
        (sc.scale(fwd_loss(m, i)) / 4).backward()
        if i % 4 == 3:
            sc.unscale_(opt)
            grads.append(grad_norm(m.parameters()))
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            opt.zero_grad()

    rep, raised = run(m, opt, sc, body, steps=12)
    m2, opt2, sc2 = setup()
    for i in range(4):
        sc2.scale(fwd_loss(m2, i) / 4).backward()
    sc2.unscale_(opt2)
    assert raised is None and abs(grads[0] / grad_norm(m2.parameters()) - 1) < 1e-3, grads
    quiet(rep)


# ======================================================================================================================
# M8 / T8. update(new_scale=the current scale): the scale never backs off
# ======================================================================================================================
def pinned_body(m, opt, sc, pinned, scales):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        if pinned:
            sc.update(sc.get_scale())  # @pinned-update
        else:
            sc.update()
        scales.append(sc.get_scale())
    return body


def test_m8_scale_pinned_by_update_new_scale_skips_every_step():
    m, opt, sc = setup(init_scale=BIG)
    w0 = [p.detach().clone() for p in m.parameters()]
    scales = []
    rep, raised = run(m, opt, sc, pinned_body(m, opt, sc, True, scales), steps=12)
    # real: the scale never moved and no step was applied (every one skipped)
    assert raised is None and set(scales) == {BIG} and all(torch.equal(a, b) for a, b in zip(w0, m.parameters()))
    expect(rep, "skipped_steps", step=0)


def test_t8_twin_plain_update_with_a_huge_init_scale_is_quiet():
    m, opt, sc = setup(init_scale=BIG)
    scales = []
    rep, raised = run(m, opt, sc, pinned_body(m, opt, sc, False, scales), steps=16)
    assert raised is None and scales[-1] < BIG / 8, scales  # real: the scaler backed off (the first steps skipped)
    quiet(rep)


# ======================================================================================================================
# M9 / T9. a closure with the scaled backward, unscale_ and the clip, given to optimizer.step
# ======================================================================================================================
def closure_body(m, opt, sc, via_scaler):
    def body(i):
        def closure():
            opt.zero_grad()
            loss = fwd_loss(m, i)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            return loss
        if via_scaler:
            closure()
            sc.step(opt)
        else:
            opt.step(closure)  # @closure-opt-step
        sc.update()
    return body


def test_m9_optimizer_step_with_a_closure_that_unscales_bypasses_the_inf_check():
    m, opt, sc = setup(init_scale=BIG, opt="sgd", lr=1e-3)
    rep, raised = run(m, opt, sc, closure_body(m, opt, sc, False), steps=4)
    assert raised is None and not torch.isfinite(m.body.weight).all()  # real: the step-0 inf/NaN was applied
    expect(rep, "scaler_misorder", step=0, tag="closure-opt-step")


def test_t9_twin_closure_called_by_hand_then_scaler_step_is_quiet():
    m, opt, sc = setup(init_scale=BIG, opt="sgd", lr=1e-3)
    rep, raised = run(m, opt, sc, closure_body(m, opt, sc, True), steps=16)
    assert raised is None and torch.isfinite(m.body.weight).all() and sc.get_scale() < BIG
    quiet(rep)


# ======================================================================================================================
# M10 / T10. the optimizer rebuilt at step 3; a clipping callback still unscales the old one
# ======================================================================================================================
class ClipCallback:
    def __init__(self, sc, opt, model):
        self.sc, self.opt, self.model = sc, opt, model

    def __call__(self):
        self.sc.unscale_(self.opt)  # @callback-unscale
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)


def rebuilt_run(rebind):
    m = net()
    state = {"opt": torch.optim.SGD(m.parameters(), lr=1e-2)}
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    cb = ClipCallback(sc, state["opt"], m)
    deltas = []

    def body(i):
        if i == 3:  # a new phase: a fresh optimizer at a lower lr
            state["opt"] = torch.optim.SGD(m.parameters(), lr=5e-3)
            if rebind:
                cb.opt = state["opt"]
        opt = state["opt"]
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        cb()
        w0 = m.head.weight.detach().clone()
        sc.step(opt)  # @rebuilt-step
        sc.update()
        deltas.append(float((m.head.weight.detach() - w0).abs().max()))

    rep, raised = run(m, state["opt"], sc, body)
    return rep, raised, deltas


def test_m10_clip_callback_unscales_the_old_optimizer_after_a_rebuild():
    rep, raised, deltas = rebuilt_run(False)
    _, _, ref = rebuilt_run(True)
    # real: steps 0-2 are identical; step 3's update is ~1024x too small (the gradients divided twice)
    assert raised is None and deltas[:3] == ref[:3] and deltas[3] < ref[3] / 200, (deltas, ref)
    expect(rep, "scaler_misorder", step=3, tags=("callback-unscale", "rebuilt-step"))


def test_t10_twin_callback_rebound_to_the_new_optimizer_is_quiet():
    rep, raised, _ = rebuilt_run(True)
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# M12 / T12. a fused AdamW (the kernel unscales inside scaler.step)
# ======================================================================================================================
def fused_body(m, opt, sc, how, norms):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        if how == "unscale_clip":
            sc.unscale_(opt)
        if how in ("clip", "unscale_clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))  # @fused-clip
        sc.step(opt)
        sc.update()
    return body


def test_m12_fused_adamw_clip_before_scaler_step_without_unscale():
    m, opt, sc = setup(fused=True)
    assert getattr(opt, "_step_supports_amp_scaling", False)  # real: GradScaler hands the scale to the kernel
    norms = []
    rep, raised = run(m, opt, sc, fused_body(m, opt, sc, "clip", norms))
    assert raised is None and norms[0] > 100 * true_norm(0), norms  # real: the scaled norm was clipped
    expect(rep, "clip_before_unscale", step=0, tag="fused-clip")


@pytest.mark.parametrize("how", ["unscale_clip", "no_clip"])
def test_t12_twin_fused_adamw_is_quiet(how):
    m, opt, sc = setup(fused=True)
    norms = []
    rep, raised = run(m, opt, sc, fused_body(m, opt, sc, how, norms))
    assert raised is None
    if how == "unscale_clip":
        assert abs(norms[0] / true_norm(0) - 1) < 0.05, norms
    quiet(rep)


# ======================================================================================================================
# M13 / T13. a "deferred" update inside the micro-batch loop of gradient accumulation
# ======================================================================================================================
def deferred_body(m, opt, sc, inside):
    def body(step):
        if step > 0 and not inside:
            sc.update()  # the previous step's update, once
        for micro in range(4):
            if step > 0 and inside:
                sc.update()  # @micro-update
            sc.scale(fwd_loss(m, 4 * step + micro) / 4).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        opt.zero_grad()
    return body


def test_m13_deferred_update_inside_the_micro_batch_loop():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, deferred_body(m, opt, sc, True), steps=4)
    assert raised is not None and raised[0] == 1 and "No inf checks" in raised[1], raised
    expect(rep, "scaler_misorder", step=1, tag="micro-update")


def test_t13_twin_deferred_update_once_per_step_is_quiet():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, deferred_body(m, opt, sc, False), steps=4, after=sc.update)
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# M14 / T14. an auxiliary loss backpropagated after unscale_ + clip
# ======================================================================================================================
def aux_body(m, opt, sc, late, deltas):
    def body(i):
        x, y = batch(i)
        opt.zero_grad()
        with torch.autocast(**FP16):
            out = m(x).float()
            main, aux = F.mse_loss(out, y), 0.1 * out.pow(2).mean()
        sc.scale(main).backward(retain_graph=True)
        if not late:
            sc.scale(aux).backward()
        sc.unscale_(opt)  # @aux-unscale
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        if late:
            sc.scale(aux).backward()  # @aux-backward
        w0 = m.head.weight.detach().clone()
        sc.step(opt)
        sc.update()
        deltas.append(float((m.head.weight.detach() - w0).abs().max()))
    return body


def test_m14_auxiliary_loss_backpropagated_after_unscale_and_clip():
    m, opt, sc = setup(opt="sgd", lr=1e-3)
    deltas, ref = [], []
    rep, raised = run(m, opt, sc, aux_body(m, opt, sc, True, deltas))
    m2, opt2, sc2 = setup(opt="sgd", lr=1e-3)
    aux_body(m2, opt2, sc2, False, ref)(0)
    assert raised is None and deltas[0] > 20 * ref[0], (deltas[:1], ref)  # real: the aux gradients still x1024
    expect(rep, "scaler_misorder", step=0, tags=("aux-unscale", "aux-backward"))


def test_t14_twin_auxiliary_loss_backpropagated_before_unscale_is_quiet():
    m, opt, sc = setup(opt="sgd", lr=1e-3)
    rep, raised = run(m, opt, sc, aux_body(m, opt, sc, False, []))
    assert raised is None
    quiet(rep)


def test_t15_twin_zero_grad_between_scaler_step_and_update_is_quiet():
    """`scaler.step(opt); opt.zero_grad(); scaler.update()`: update() still follows the step in the same iteration,
    before the next scale(); zero_grad neither reads nor needs the scale."""
    m, opt, sc = setup()
    scales = []

    def body(i):
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        opt.zero_grad()
        sc.update()
        scales.append(sc.get_scale())

    rep, raised = run(m, opt, sc, body)
    assert raised is None and scales == [1024.0] * 6, scales  # real: every step applied, the scale steady
    quiet(rep)


# ======================================================================================================================
# The LR scheduler stepped on skipped steps; a disabled scaler with bf16 autocast
# ======================================================================================================================
def test_scheduler_stepped_on_the_scalers_skipped_first_steps_is_no_amp_warning():
    """torch warns that lr_scheduler.step() came before optimizer.step(): GradScaler skipped the first steps (it did
    not call optimizer.step), the usual start of dynamic loss scaling. No AMP warning or error (CONTRACT.md has no
    rule for it; at most skipped_steps info)."""
    m, opt, sc = setup(init_scale=BIG)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    scales = []

    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        sched.step()
        scales.append(sc.get_scale())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep, raised = run(m, opt, sc, body, steps=16)
    assert raised is None and scales[0] < BIG, scales  # real: step 0 was skipped
    assert any("lr_scheduler.step()" in str(c.message) for c in caught), [str(c.message) for c in caught]
    quiet(rep)
    f = next((f for f in rep.findings if f.rule == "skipped_steps"), None)
    assert f is not None and f.severity == "info", lines(rep)


def test_disabled_scaler_with_bf16_autocast_and_a_clip_without_unscale_is_quiet():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", enabled=False)

    def body(i):
        x, y = batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # nothing is scaled: no unscale_ needed
        sc.step(opt)
        sc.update()

    rep, raised = run(m, opt, sc, body)
    assert raised is None and not sc.is_enabled()
    quiet(rep)
