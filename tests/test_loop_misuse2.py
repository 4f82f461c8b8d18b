"""Loop misuse probes, second set: GradScaler / optimizer / clipping misuse written in loop STYLES the other test files
do not build, each with its correct twin, watched through the public API only (watch -> an ordinary fp16 autocast +
torch.amp.GradScaler("cpu") loop on a tiny model -> w.close() -> w.report()) at ampdoctor's default settings.

Misuse (the expected rule among the first three findings, with its severity, its step and, for call-order rules, the
file/line of the user's wrong call in `finding.evidence`):
 1. clip_grad_norm_ before unscale_ two helper levels down (_train_step -> _after_backward -> _clip_for_logging);
    the line must be the clip call inside the innermost helper.
 2. optimizer.step(closure) (SGD, not LBFGS) whose closure runs the scaled backward; no scaler.step/update at all:
    scaler_misorder at the opt.step(closure) line.
 3. clip_grad_norm_ inside a closure before unscale_ (closure called by hand, then scaler.step/update).
 4. a GAN with two optimizers on one scaler: the discriminator is unscaled + clipped, then a shared
    `clip_all(...)` helper unscales both optimizers again (the discriminator twice): scaler_misorder at that line.
 5. gradient accumulation over 4 micro-batches, clipping only at the 4th micro-step, before unscale_.
 6. clipping only every 10th step (`(i + 1) % 10 == 0`, first at step 9) before unscale_, with a LambdaLR
    scheduler.step() between scaler.step and scaler.update.
 7. `clip_grad_norm_` bound by `from torch.nn.utils import clip_grad_norm_` at this module's import, BEFORE
    `import ampdoctor` and before watch(), called before unscale_.
 8. `torch.nn.utils.clip_grad.clip_grad_norm_` before unscale_, over model.parameters() / a list made before
    watch() / opt.param_groups[0]["params"] (three runs).
 9. `get_total_norm` + `clip_grads_with_norm_` (the two-step clipping API) before unscale_: gradients really
    clipped while scaled, so an error (not the warning of a norm only read).
10. a tiny `AmpHelper` wrapper (.backward(loss), .step()) whose .step() clips, then scaler.step/update, never
    unscale_: the line is the clip inside AmpHelper.step.
11. gradient accumulation calling scaler.step(opt) at every micro-batch and update() only after the 4th: the
    second micro-batch's step() raises ("step() has already been called since the last update()").
12. a Lightning-like manual loop object whose `on_after_optimizer_step` hook unscales for a grad-norm log AFTER
    scaler.step (torch raises "unscale_() is being called after step()"): scaler_misorder at the hook's line.
13. `scaler.unscale_(opt)` then clip then `opt.step()` directly (not scaler.step): the inf check is bypassed, and
    with init_scale=2**24 the first backward overflows, so the inf gradients are applied (weights NaN).
14. update() before step() with `zero_grad(set_to_none=False)` and a scheduler.step() between them (GradScaler
    asserts "No inf checks were recorded prior to update."): scaler_misorder at the update() line.
15. `if not isfinite(norm): continue` after unscale_ that skips scaler.update() too: the next iteration's
    unscale_ raises: missing_scaler_update.
16. a Lightning-like module whose optimizer is built in configure_optimizers() before `model.half()` (pure fp16,
    no scaler; SGD with momentum): fp16_master_weights.
17. only the head converted with `.half()` and trained by SGD at lr 1e-5 (its fp16 updates round away):
    update_underflow at `head`.
18. YOLOv5's `from torch.cuda import amp` alias: `amp.GradScaler(enabled=False)` on the CPU: deprecated_api info.
19. the legacy CPU autocast through an alias (`from torch.cpu import amp as cpu_amp; cpu_amp.autocast(bfloat16)`):
    deprecated_api info.

Correct twins (no warning, no error): 1 (unscale_ first in the helper), 2 (closure called by hand with unscale_ +
clip inside, then scaler.step/update), 4 (both optimizers unscaled once, each clipped, one update), 5 (unscale_ +
clip at the 4th micro-step), 6 (unscale_ + clip every 10th step, scheduler between step and update), 7 (the
early-bound clip after unscale_), 8 (clip_grad.clip_grad_norm_ over param_groups after unscale_), 9
(get_total_norm + clip_grads_with_norm_ after unscale_), 10 (AmpHelper with unscale_), 12 (the Lightning-like
loop logging the norm after unscale_, before step), 13 (scaler.step with init_scale=2**24: the first steps are
skipped, info only), 14 (set_to_none=False, scheduler between step and update), 15 (skip by hand but still
update()), 16 (the Lightning-like module in fp32 + autocast + GradScaler).

(This file deliberately never spells the legacy APIs' dotted names: ampdoctor also scans the calling script's
source for them, which would make 18/19 pass whatever the runtime saw.)

ampdoctor got wrong (strict xfails, each reason says what it reported instead):
 - 19: the legacy CPU autocast through a module alias: an empty report, no deprecated_api.

Found here and fixed (each a strict xfail first): 7 (a clip_grad_norm_ bound at import is seen through the
`_clip_grads_with_norm_` it calls, torch >= 2.6), 9 (clip_grads_with_norm_ is watched; a clip in the step makes
clip_before_unscale an error at the first call on scaled gradients), 13 (scaler_misorder at the opt.step() line
that bypassed the inf check), 15's twin (an update() with no step after unscale_ ends the iteration as a skipped
step: no misorder, the 2**24 search is info).
"""
from __future__ import annotations

from torch.nn.utils import clip_grad_norm_  # bound before ampdoctor is imported and before any watch (scenario 7)

import math
import os
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cpu import amp as cpu_amp  # scenario 19: the legacy CPU autocast through an alias
from torch.cuda import amp  # scenario 18: YOLOv5's spelling

import ampdoctor
from scenarios import alarms, lines, one_thread, randn
from probe_harness import expect as _expect, quiet_report, tag_line


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)


line_of = partial(tag_line, __file__)


def expect(rep, rule, severity=("warning", "error"), step=None, tag=None, module=...):
    """probe_harness.expect at this file's `# @tag` lines."""
    return _expect(rep, rule, severity, step, tag, src=__file__, module=module)


quiet = partial(quiet_report, saw_steps=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h.to(self.head.weight.dtype))


def net():
    torch.manual_seed(0)
    return Net()


def batch(i):
    return randn(16, 8, seed=i), randn(16, 1, seed=100 + i)


def fwd_loss(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        return F.mse_loss(m(x).float(), y)


def setup(init_scale=1024.0, opt="adamw", lr=1e-3):
    m = net()
    o = (torch.optim.AdamW(m.parameters(), lr=lr) if opt == "adamw" else torch.optim.SGD(m.parameters(), lr=lr))
    return m, o, torch.amp.GradScaler("cpu", init_scale=init_scale)


def run(m, opt, sc, body, steps=6):
    """watch -> body(i) for each step -> close; a RuntimeError/AssertionError raised by torch in the loop stops it
    (recorded as (step, message)). Returns (report, raised)."""
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    raised = None
    try:
        for i in range(steps):
            body(i)
    except (RuntimeError, AssertionError) as e:
        raised = (i, str(e))
    finally:
        w.close()
    return w.report(), raised


# ======================================================================================================================
# 1. clip before unscale_, two helper levels down
# ======================================================================================================================
def _clip_for_logging(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # @nested-clip


def _after_backward(model, opt, sc, ok):
    if ok:
        sc.unscale_(opt)
        return _clip_for_logging(model)
    norm = _clip_for_logging(model)
    sc.unscale_(opt)  # too late: the clip above saw the scaled gradients
    return norm


def _train_step(m, opt, sc, i, ok, norms):
    opt.zero_grad()
    sc.scale(fwd_loss(m, i)).backward()
    norms.append(float(_after_backward(m, opt, sc, ok)))
    sc.step(opt)
    sc.update()


def test_clip_before_unscale_two_helpers_down_names_the_inner_clip_line():
    m, opt, sc = setup()
    norms = []
    rep, raised = run(m, opt, sc, lambda i: _train_step(m, opt, sc, i, False, norms))
    assert raised is None and norms[0] > 100, norms  # real: the scaled norm (x1024) was clipped
    expect(rep, "clip_before_unscale", ("error",), step=0, tag="nested-clip")


def test_twin_unscale_first_in_the_nested_helper_is_quiet():
    m, opt, sc = setup()
    norms = []
    rep, raised = run(m, opt, sc, lambda i: _train_step(m, opt, sc, i, True, norms))
    assert raised is None and norms[0] < 10, norms
    quiet(rep)


# ======================================================================================================================
# 2./3. closures passed to (or called like) optimizer.step(closure)
# ======================================================================================================================
def test_optimizer_step_with_a_closure_bypasses_the_scaler():
    m, opt, sc = setup(opt="sgd", lr=1e-5)
    w0 = m.head.weight.detach().clone()

    def body(i):
        def closure():
            opt.zero_grad()
            loss = fwd_loss(m, i)
            sc.scale(loss).backward()  # scaled gradients; nothing ever unscales them
            return loss
        opt.step(closure)  # @closure-step

    rep, raised = run(m, opt, sc, body, steps=4)
    assert raised is None
    assert (m.head.weight - w0).abs().max().item() > 1e-3  # real: lr 1e-5 moved the weights ~1024x too far
    expect(rep, "scaler_misorder", ("error",), step=0, tag="closure-step")


def _closure_body(m, opt, sc, i, clip_first):
    def closure():
        opt.zero_grad()
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        if clip_first:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # @closure-clip
        sc.unscale_(opt)
        if not clip_first:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        return loss
    closure()
    sc.step(opt)
    sc.update()


def test_clip_inside_a_closure_before_unscale():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, lambda i: _closure_body(m, opt, sc, i, True))
    assert raised is None
    expect(rep, "clip_before_unscale", ("error",), step=0, tag="closure-clip")


def test_twin_closure_with_unscale_and_clip_then_scaler_step_is_quiet():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, lambda i: _closure_body(m, opt, sc, i, False))
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# 4. a GAN: two optimizers on one scaler, only the discriminator misordered (unscaled twice)
# ======================================================================================================================
class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def clip_all(sc, opts, models):
    """A project's helper meant for the end of the iteration: unscale every optimizer, clip every model."""
    for o in opts:
        sc.unscale_(o)  # @gan-unscale
    for mm in models:
        torch.nn.utils.clip_grad_norm_(mm.parameters(), 1.0)


def gan_run(ok, steps=5):
    gan = GAN()
    oD = torch.optim.AdamW(gan.D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    oG = torch.optim.AdamW(gan.G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def body(i):
        real = randn(16, 8, seed=i)
        z = randn(16, 4, seed=50 + i)
        oD.zero_grad()
        with torch.autocast(**FP16):
            fake = gan.G(z)
            d_loss = (F.softplus(-gan.D(real).float()).mean() + F.softplus(gan.D(fake.detach()).float()).mean())
        sc.scale(d_loss).backward()
        if ok:
            sc.unscale_(oD)
            torch.nn.utils.clip_grad_norm_(gan.D.parameters(), 1.0)
        else:
            sc.unscale_(oD)  # the discriminator's own clip, correctly unscaled ...
            torch.nn.utils.clip_grad_norm_(gan.D.parameters(), 1.0)
        oG.zero_grad()
        with torch.autocast(**FP16):
            g_loss = F.softplus(-gan.D(fake).float()).mean()
        sc.scale(g_loss).backward(inputs=list(gan.G.parameters()))
        if ok:
            sc.unscale_(oG)
            torch.nn.utils.clip_grad_norm_(gan.G.parameters(), 1.0)
        else:
            clip_all(sc, [oD, oG], [gan.D, gan.G])  # ... then unscaled again here
        sc.step(oD)
        sc.step(oG)
        sc.update()

    return run(gan, oD, sc, body, steps=steps)


def test_gan_shared_helper_unscales_the_discriminator_twice():
    rep, raised = gan_run(False)
    assert raised is not None and raised[0] == 0 and "unscale_() has already been called" in raised[1], raised
    expect(rep, "scaler_misorder", ("error",), step=0, tag="gan-unscale")


def test_twin_gan_each_optimizer_unscaled_once_is_quiet():
    rep, raised = gan_run(True)
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# 5. gradient accumulation: clip only at every 4th micro-step
# ======================================================================================================================
def accum_body(m, opt, sc, ok):
    def body(i):  # i counts micro-batches; an optimizer step every 4th
        sc.scale(fwd_loss(m, i) / 4).backward()
        if i % 4 == 3:
            if ok:
                sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # @accum-clip
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    return body


def test_accumulation_clipping_at_every_4th_micro_step_before_unscale():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, accum_body(m, opt, sc, False), steps=12)
    assert raised is None
    expect(rep, "clip_before_unscale", ("error",), step=0, tag="accum-clip")


def test_twin_accumulation_unscale_and_clip_at_every_4th_micro_step_is_quiet():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, accum_body(m, opt, sc, True), steps=12)
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# 6. clipping only every 10th step, a scheduler between scaler.step and scaler.update
# ======================================================================================================================
def every10_body(m, opt, sc, sched, ok):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        if (i + 1) % 10 == 0:  # a periodic "safety" clip
            if ok:
                sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)  # @every10-clip
        sc.step(opt)
        sched.step()
        sc.update()
    return body


@pytest.mark.parametrize("ok", [False, True], ids=["misuse", "twin"])
def test_clip_every_10th_step_before_unscale_is_named_at_step_9(ok):
    m, opt, sc = setup()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    rep, raised = run(m, opt, sc, every10_body(m, opt, sc, sched, ok), steps=12)
    assert raised is None
    if ok:
        quiet(rep)
    else:
        expect(rep, "clip_before_unscale", ("error",), step=9, tag="every10-clip")


# ======================================================================================================================
# 7. clip_grad_norm_ bound at this module's import, before ampdoctor and before watch()
# ======================================================================================================================
def early_body(m, opt, sc, ok):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        if ok:
            sc.unscale_(opt)
        clip_grad_norm_(m.parameters(), 1.0)  # @early-clip
        sc.step(opt)
        sc.update()
    return body


def test_clip_bound_at_import_before_ampdoctor_is_still_seen():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, early_body(m, opt, sc, False))
    assert raised is None
    expect(rep, "clip_before_unscale", ("error",), step=0, tag="early-clip")


def test_twin_clip_bound_at_import_after_unscale_is_quiet():
    m, opt, sc = setup()
    rep, raised = run(m, opt, sc, early_body(m, opt, sc, True))
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# 8. torch.nn.utils.clip_grad.clip_grad_norm_ over three kinds of parameter collections
# ======================================================================================================================
@pytest.mark.parametrize("params", ["model.parameters()", "list", "param_groups"])
def test_clip_grad_module_path_before_unscale_with_each_parameter_collection(params):
    m, opt, sc = setup()
    plist = list(m.parameters())  # made before watch()

    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        ps = {"model.parameters()": m.parameters(), "list": plist, "param_groups": opt.param_groups[0]["params"]}
        torch.nn.utils.clip_grad.clip_grad_norm_(ps[params], 1.0)  # @clipgrad-path
        sc.unscale_(opt)
        sc.step(opt)
        sc.update()

    rep, raised = run(m, opt, sc, body)
    assert raised is None
    expect(rep, "clip_before_unscale", ("error",), step=0, tag="clipgrad-path")


def test_twin_clip_grad_module_path_over_param_groups_after_unscale_is_quiet():
    m, opt, sc = setup()

    def body(i):
        opt.zero_grad(set_to_none=False)
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
        sc.step(opt)
        sc.update()

    rep, raised = run(m, opt, sc, body)
    assert raised is None
    quiet(rep)


# ======================================================================================================================
# 9. the two-step clipping API: get_total_norm + clip_grads_with_norm_
# ======================================================================================================================
def two_step_body(m, opt, sc, ok, norms):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        if ok:
            sc.unscale_(opt)
        ps = [p for p in m.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in ps])  # @two-step-norm
        torch.nn.utils.clip_grads_with_norm_(ps, 1.0, total)
        norms.append(float(total))
        sc.step(opt)
        sc.update()
    return body


def test_get_total_norm_then_clip_grads_with_norm_before_unscale_is_an_error():
    m, opt, sc = setup()
    norms = []
    rep, raised = run(m, opt, sc, two_step_body(m, opt, sc, False, norms))
    assert raised is None and norms[0] > 100, norms  # real: the scaled norm, and the gradients clipped by it
    expect(rep, "clip_before_unscale", ("error",), step=0, tag="two-step-norm")


def test_twin_get_total_norm_then_clip_grads_with_norm_after_unscale_is_quiet():
    m, opt, sc = setup()
    norms = []
    rep, raised = run(m, opt, sc, two_step_body(m, opt, sc, True, norms))
    assert raised is None and norms[0] < 10, norms
    quiet(rep)


# ======================================================================================================================
# 10. a tiny AmpHelper wrapper around the scaler
# ======================================================================================================================
class AmpHelper:
    def __init__(self, model, opt, unscale=True, max_norm=1.0):
        self.model, self.opt, self.unscale, self.max_norm = model, opt, unscale, max_norm
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        if self.unscale:
            self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)  # @amphelper-clip
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        return norm


@pytest.mark.parametrize("ok", [False, True], ids=["misuse", "twin"])
def test_amp_helper_wrapper_clipping_without_unscale(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    helper = AmpHelper(m, opt, unscale=ok)

    def body(i):
        helper.backward(fwd_loss(m, i))
        helper.step()

    rep, raised = run(m, opt, helper.scaler, body)
    assert raised is None
    if ok:
        quiet(rep)
    else:
        expect(rep, "clip_before_unscale", ("error",), step=0, tag="amphelper-clip")


# ======================================================================================================================
# 11. gradient accumulation with scaler.step at every micro-batch, update only after the 4th
# ======================================================================================================================
def test_scaler_step_at_every_micro_batch_raises_at_the_second_and_is_named():
    m, opt, sc = setup()

    def body(i):
        sc.scale(fwd_loss(m, i) / 4).backward()
        sc.step(opt)  # @microstep-step
        if i % 4 == 3:
            sc.update()
            opt.zero_grad()

    rep, raised = run(m, opt, sc, body, steps=8)
    assert raised is not None and raised[0] == 1 and "step() has already been called" in raised[1], raised
    # scaler.step twice without update(): CONTRACT.md's missing_scaler_update ("step() without update()") or
    # scaler_misorder ("step twice"); either must name the second step() call
    f = next((f for f in rep.findings[:3] if f.rule in ("missing_scaler_update", "scaler_misorder")), None)
    assert f is not None, lines(rep)
    assert f.severity == "error" and f.evidence.get("line") == line_of("microstep-step"), f.one_line()
    assert os.path.abspath(f.evidence.get("file") or "") == os.path.abspath(__file__), f.evidence


# ======================================================================================================================
# 12. a Lightning-like manual loop object with an on_after_optimizer_step hook
# ======================================================================================================================
class LitLike:
    """A Lightning-style module in manual optimisation: the loop calls training_step; hooks run around the step."""

    def __init__(self, log_after_step):
        self.model = net()
        self.log_after_step = log_after_step
        self.opt = self.configure_optimizers()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        self.logged = []

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def manual_backward(self, loss):
        self.scaler.scale(loss).backward()

    def log_grad_norm(self):
        self.scaler.unscale_(self.opt)  # @lit-unscale
        self.logged.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))))

    def on_before_optimizer_step(self):
        if not self.log_after_step:
            self.log_grad_norm()

    def on_after_optimizer_step(self):
        if self.log_after_step:
            self.log_grad_norm()

    def training_step(self, i):
        self.opt.zero_grad()
        self.manual_backward(fwd_loss(self.model, i))
        self.on_before_optimizer_step()
        self.scaler.step(self.opt)
        self.on_after_optimizer_step()
        self.scaler.update()


@pytest.mark.parametrize("after", [True, False], ids=["misuse", "twin"])
def test_lightning_like_hook_unscaling_after_the_step(after):
    lit = LitLike(after)
    rep, raised = run(lit.model, lit.opt, lit.scaler, lit.training_step)
    if not after:
        assert raised is None
        quiet(rep)
        return
    assert raised is not None and raised[0] == 0 and "after step()" in raised[1], raised
    expect(rep, "scaler_misorder", ("error",), step=0, tag="lit-unscale")


# ======================================================================================================================
# 13. optimizer.step() directly after unscale_: the inf check is bypassed
# ======================================================================================================================
def direct_body(m, opt, sc, via_scaler):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        if via_scaler:
            sc.step(opt)
        else:
            opt.step()  # @direct-step
        sc.update()
    return body


@pytest.mark.parametrize("where", [
    "rule",
    "line",
])
def test_optimizer_step_after_unscale_bypasses_the_inf_check(where):
    m, opt, sc = setup(init_scale=2.0 ** 24)
    rep, raised = run(m, opt, sc, direct_body(m, opt, sc, False))
    assert raised is None
    assert not torch.isfinite(m.body.weight).all()  # real: the step-0 inf gradients were applied
    expect(rep, "scaler_misorder", ("error",), step=0, tag="direct-step" if where == "line" else None)


def test_twin_scaler_step_after_unscale_with_a_huge_init_scale_is_quiet():
    m, opt, sc = setup(init_scale=2.0 ** 24)
    rep, raised = run(m, opt, sc, direct_body(m, opt, sc, True), steps=10)
    assert raised is None
    assert torch.isfinite(m.body.weight).all() and sc.get_scale() < 2.0 ** 24  # the first steps were skipped
    quiet(rep)


# ======================================================================================================================
# 14. update() before step(), zero_grad(set_to_none=False), a scheduler between
# ======================================================================================================================
def sched_body(m, opt, sc, sched, ok):
    def body(i):
        opt.zero_grad(set_to_none=False)
        sc.scale(fwd_loss(m, i)).backward()
        if ok:
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sched.step()
            sc.update()
        else:
            sc.update()  # @sched-update
            sched.step()
            sc.step(opt)
    return body


@pytest.mark.parametrize("ok", [False, True], ids=["misuse", "twin"])
def test_update_before_step_with_a_scheduler_between_and_set_to_none_false(ok):
    m, opt, sc = setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    rep, raised = run(m, opt, sc, sched_body(m, opt, sc, sched, ok))
    if ok:
        assert raised is None
        quiet(rep)
        return
    assert raised is not None and raised[0] == 0 and "No inf checks" in raised[1], raised
    expect(rep, "scaler_misorder", ("error",), step=0, tag="sched-update")


# ======================================================================================================================
# 15. skipping a non-finite step by hand: without update() (misuse) and with it (twin)
# ======================================================================================================================
def skip_body(m, opt, sc, ok, skipped):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        sc.unscale_(opt)  # @skip-unscale
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        if not math.isfinite(float(norm)):
            skipped.append(i)
            if ok:
                sc.update()  # the step is skipped, the scale still backs off
            return
        sc.step(opt)
        sc.update()
    return body


def test_skipping_a_nonfinite_step_without_update_is_missing_scaler_update():
    m, opt, sc = setup(init_scale=2.0 ** 24)
    skipped = []
    rep, raised = run(m, opt, sc, skip_body(m, opt, sc, False, skipped))
    assert skipped == [0] and raised is not None and raised[0] == 1 and "already been called" in raised[1], raised
    expect(rep, "missing_scaler_update", ("error",), tag="skip-unscale")


def test_twin_skipping_a_nonfinite_step_with_update_is_quiet():
    m, opt, sc = setup(init_scale=2.0 ** 24)
    skipped = []
    rep, raised = run(m, opt, sc, skip_body(m, opt, sc, True, skipped), steps=24)
    assert raised is None and skipped and skipped[-1] < 20 and torch.isfinite(m.body.weight).all(), skipped
    quiet(rep)


# ======================================================================================================================
# 16. fp16 master weights: the optimizer built before model.half() (Lightning-like configure_optimizers)
# ======================================================================================================================
class LitFp16:
    def __init__(self, half):
        self.model = net()
        self.opt = self.configure_optimizers()  # holds the same Parameter objects .half() converts below
        self.half = half
        if half:
            self.model.half()
        self.scaler = None if half else torch.amp.GradScaler("cpu", init_scale=1024.0)

    def configure_optimizers(self):
        # SGD with momentum: no eps to vanish in fp16 (AdamW's eps=1e-8 would make this an eps_underflow run)
        return torch.optim.SGD(self.model.parameters(), lr=1e-2, momentum=0.9)

    def training_step(self, i):
        x, y = batch(i)
        self.opt.zero_grad()
        if self.half:
            loss = F.mse_loss(self.model(x.half()).float(), y)
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(fwd_loss(self.model, i)).backward()
            self.scaler.step(self.opt)
            self.scaler.update()


@pytest.mark.parametrize("half", [True, False], ids=["misuse", "twin"])
def test_optimizer_built_before_model_half_holds_fp16_params(half):
    lit = LitFp16(half)
    assert all(p.dtype == (torch.float16 if half else torch.float32) for g in lit.opt.param_groups for p in g["params"])
    rep, raised = run(lit.model, lit.opt, lit.scaler, lit.training_step)
    assert raised is None
    if half:
        expect(rep, "fp16_master_weights")
    else:
        quiet(rep)


# ======================================================================================================================
# 17. only the head in fp16, SGD at a small lr: its updates round away
# ======================================================================================================================
def test_half_head_with_small_sgd_lr_is_update_underflow_at_the_head():
    m = net()
    m.head.half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-5)
    w0 = m.head.weight.detach().clone()
    b0 = m.body.weight.detach().clone()

    def body(i):
        x, y = batch(i)
        opt.zero_grad()
        F.mse_loss(m(x).float(), y).backward()
        opt.step()

    rep, raised = run(m, opt, None, body, steps=8)
    assert raised is None
    stuck = (m.head.weight == w0).float().mean().item()
    assert stuck > 0.8 and not torch.equal(m.body.weight, b0), stuck  # real: the fp16 head's weights barely moved
    expect(rep, "update_underflow", module="head")


# ======================================================================================================================
# 18./19. legacy AMP APIs through module aliases (info only)
# ======================================================================================================================
def _deprecated(rep, name):
    f = next((f for f in rep.findings if f.rule == "deprecated_api"), None)
    assert f is not None, lines(rep)
    assert f.severity == "info" and name in (f.message + repr(f.evidence)), f.one_line()
    quiet(rep)


def test_yolov5_style_cuda_amp_alias_grad_scaler_on_the_cpu_is_deprecated_info():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with pytest.warns((FutureWarning, UserWarning)):
        sc = amp.GradScaler(enabled=False)  # YOLOv5: `scaler = amp.GradScaler(enabled=cuda)`

    def body(i):
        x, y = batch(i)
        opt.zero_grad()
        sc.scale(F.mse_loss(m(x), y)).backward()
        sc.step(opt)
        sc.update()

    rep, raised = run(m, opt, sc, body, steps=4)
    assert raised is None
    _deprecated(rep, "GradScaler")


@pytest.mark.xfail(strict=True, reason=(
    "the legacy CPU autocast used through a module alias (`from torch.cpu import amp as cpu_amp`) is not seen: "
    "ampdoctor finds deprecated autocasts only by a regex over the script's text: the report is empty "
    "(rep.findings == []), no deprecated_api"))
def test_legacy_cpu_autocast_through_an_alias_is_deprecated_info():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def body(i):
        x, y = batch(i)
        opt.zero_grad()
        with cpu_amp.autocast(dtype=torch.bfloat16):
            loss = F.mse_loss(m(x).float(), y)
        loss.backward()
        opt.step()

    with pytest.warns(FutureWarning):
        rep, raised = run(m, opt, None, body, steps=4)
    assert raised is None
    _deprecated(rep, "autocast")
