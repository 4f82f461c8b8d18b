"""Loop misuse probes, fifth set: GradScaler / optimizer / clipping misuse in loop shapes that
tests/test_loop_misuse2/3/4.py, tests/test_integrations_misuse.py, test_unseen_variants5/8/13.py and
test_scaler_found.py do not build, each watched through the public API only (`ampdoctor.watch(model, optimizer=...,
scaler=...)` around an ordinary fp16 autocast + torch.amp.GradScaler("cpu") loop on a tiny model, then
`w.report()`) at ampdoctor's default settings. Every misuse first checks in the test itself that it happened as
designed (torch's exception at the expected iteration, a norm / update / gradient ~1024x off, weights that did not
move, the scaler's own growth tracker), recorded by the test's own code (hooks and wrappers around its own
functions; torch and ampdoctor are not patched). Then: the rule among the first three findings, error, at the step
of the first misuse, and for call-order rules `evidence.sequence` and the line of the user's wrong call.

Misuse:
 M1. a training "engine" (backward / step / update) whose step() does [unscale_ + clip +] scaler.step and whose
     update() the user's eval branch `continue`s past every 4th iteration (first at step 3): torch raises at step 4
     (unscale_ after step / step twice): missing_scaler_update at step 3 (the iteration without update()), with and
     without the engine's clip.
 M2. a grad-norm logger that unscales on its logging steps and sets `logger.unscaled`, which the loop reads to skip
     its own unscale_; the flag is never reset, so from step 3 every clip runs on scaled gradients (norm 1024x):
     clip_before_unscale at step 3 at the clip line.
 M3. clip_grad_value_ in a project utils module (a real file imported as a module), switched on from step 2 and
     called before unscale_ (every element clipped to 0.5/1024): clip_before_unscale at step 2 at the utils line.
 M4. a WGAN loop (3 critic steps per generator step, one scaler): the critic through scaler.step, the generator
     (first at iteration 2) through optG.step() on scaled gradients (updates 1024x): scaler_misorder at that line;
     M4b: and no false missing_scaler_update (update() runs every iteration).
 M5. `s_main, s_aux = scaler.scale([main, aux])` (GradScaler takes iterables) and the raw `aux.backward()` (the aux
     gradient arrives / 1024), from step 0 and from step 3: scaler_misorder at that step.
 M6. a saliency-map callback (every 4th step, first at 3) cleaning up with `model.zero_grad()` between the scaled
     backward and scaler.step: set_to_none (GradScaler asserts 'No inf checks') and set_to_none=False (a step on
     zeros; SGD does not move): scaler_misorder at step 3.
 M7. a retry on a transient optimizer failure at step 3 (an OOM raised by the user's step pre-hook) whose handler
     calls `scaler.update()` before retrying scaler.step: the retry unscales again (gradients / 1024^2):
     scaler_misorder at step 3.
 M8. a PINN fit: AdamW + scaler for 4 steps, then L-BFGS with a closure that backpropagates `scaler.scale(loss)`
     (gradients 1024x the loss's), (a) followed by scaler.update() (asserts), (b) alone: scaler_misorder at step 4.
 M9. the optimizer fused into the backward (a per-parameter SGD stepped in post-accumulate-grad hooks, torch's
     tutorial) under scaler.scale(loss).backward(): updates 1024x: scaler_misorder at step 0 at the hook's step.
M10. encoder/decoder optimizers on one scaler stepped in `for o in opts:` with `scaler.update()` inside the loop
     (the growth tracker counts 2 per iteration): scaler_misorder at step 0 at that update.

Correct twins (no warning, no error; each checked to train): T1 engine.update() before the eval branch (with and
without clip); T2 the logger's flag reset every iteration; T3 the utils clip after unscale_; T4 the generator
through scaler.step; T5 both scaled losses backpropagated; T6 the saliency map from a copy of the model; T7 the retry
without update() (GradScaler keeps the optimizer UNSCALED: one unscale_); T8 the L-BFGS phase in fp32 without the
scaler; T9 the fused optimizer under bf16 autocast without a scaler; T10 one update() after both optimizers; T11 the
step deferred to the top of the next iteration (scale().backward(), then next iteration unscale_ + clip + step +
update + zero_grad; a flush after the loop).

What ampdoctor got wrong (strict xfails, 3 of 27 runs left; each reason gives what it reported instead and the cause).
Fixed since (rules/callorder.py): M1 without clip was dated at the step that raised (now the iteration that lacked
update()); M4b's false missing_scaler_update (a direct optimizer.step of another optimizer now continues the
iteration in _updated_later); T7's two false errors on a correct retry (a scaler.step that raised, and the
optimizer.step it began, record/monitorsink.py failed(), step nothing); M10's update() inside the per-optimizer loop
(_other_step_after: another optimizer's scaler.step after an update with no scaled backward between).
 - M5 (both): empty report: record/monitorsink.py handles scale() of a single tensor only (a list result gets no
   backward pre-hook, so transfer.py never marks extra['backward'] = False); the check runs on sampled steps only.
 - M6 set_to_none=False: empty report: nn.Module.zero_grad is not recorded (only the optimizers' zero_grad), so
   _zeroed_after_backward has nothing to find, and zeros raise nothing.
"""
from __future__ import annotations

import importlib.util
import math
import os
import textwrap
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
SCALE = 1024.0


line_of = partial(tag_line, __file__)


def expect(rep, rule, severity=("error",), step=None, tag=None, tags=None, file=HERE, line=None):
    """probe_harness.expect at this file's `# @tag` lines (or `line`) of `file`, scaler_misorder with its sequence."""
    return _expect(rep, rule, severity, step, tag, tags, src=HERE, file=file, line=line, sequence=True)


quiet = quiet_report


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(i):
    return randn(16, 8, seed=i), randn(16, 1, seed=100 + i)


def fwd_loss(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        return F.mse_loss(m(x).float(), y)


def grads(m):
    return [p.grad for p in m.parameters() if p.grad is not None]


def gnorm(gs):
    """The total gradient norm, by hand (no clipping API: ampdoctor records those calls)."""
    return float(torch.stack([g.detach().float().norm() for g in gs]).norm()) if gs else 0.0


def true_norm(m, i):
    """The unscaled gradient norm of batch i at m's current weights (a copy; m is untouched)."""
    import copy
    c = copy.deepcopy(m)
    c.zero_grad(set_to_none=True)
    fwd_loss(c, i).backward()
    return gnorm(grads(c))


def scaler(init=SCALE, **kw):
    return torch.amp.GradScaler("cpu", init_scale=init, **kw)


def run(m, body, steps=8, **wkw):
    """watch(m, **wkw) -> body(i) for each step -> close; a RuntimeError/AssertionError raised by torch stops the loop
    (recorded as (iteration, message)). Returns (report, raised)."""
    w = ampdoctor.watch(m, **wkw)
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
# M1 / T1. A training "engine" whose step() steps the scaler and whose update() the eval branch `continue`s past
# ======================================================================================================================
class Engine:
    """A home-grown engine (DeepSpeed-like API): backward(), step() (unscale_ + clip when configured, scaler.step,
    zero_grad), update() (scaler.update + the lr schedule)."""

    def __init__(self, model, clip):
        self.model, self.clip = model, clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 4, 0.5)
        self.scaler = scaler()

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        if self.clip:
            self.scaler.unscale_(self.opt)  # @engine-unscale
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)  # @engine-step
        self.opt.zero_grad()

    def update(self):
        self.scaler.update()
        self.sched.step()


def evaluate(m):
    with torch.no_grad(), torch.autocast(**FP16):
        return float(F.mse_loss(m(batch(99)[0]).float(), batch(99)[1]))


def engine_body(eng, ok, evals):
    def body(i):
        with torch.autocast(**FP16):
            loss = F.mse_loss(eng.model(batch(i)[0]).float(), batch(i)[1])
        eng.backward(loss)
        eng.step()
        if ok:
            eng.update()
        if (i + 1) % 4 == 0:  # evaluate every 4 steps (first after step 3)
            evals.append(evaluate(eng.model))
            return  # the loop's `continue`
        if not ok:
            eng.update()  # (skipped on eval steps)
    return body


@pytest.mark.parametrize("clip", [True, False],
    ids=["with_clip", "no_clip"])
def test_m1_engine_update_skipped_by_the_eval_branch_is_missing_scaler_update_at_step_3(clip):
    eng = Engine(net(), clip)
    evals = []
    rep, raised = run(eng.model, engine_body(eng, False, evals), optimizer=eng.opt, scaler=eng.scaler)
    # real: step 3 ended without update(); torch raises at the next iteration's unscale_ / step
    msg = "unscale_() is being called after step()" if clip else "step() has already been called since the last"
    assert raised is not None and raised[0] == 4 and msg in raised[1] and len(evals) == 1, raised
    expect(rep, "missing_scaler_update", step=3, tag="engine-step")


@pytest.mark.parametrize("clip", [True, False], ids=["with_clip", "no_clip"])
def test_t1_twin_engine_update_before_the_eval_branch_is_quiet(clip):
    eng = Engine(net(), clip)
    evals = []
    w0 = eng.model.head.weight.detach().clone()
    rep, raised = run(eng.model, engine_body(eng, True, evals), optimizer=eng.opt, scaler=eng.scaler)
    assert raised is None and len(evals) == 2 and all(map(math.isfinite, evals)), (raised, evals)
    assert not torch.equal(w0, eng.model.head.weight), "the twin must train"
    quiet(rep)


# ======================================================================================================================
# M2 / T2. A grad-norm logger that unscales on its logging steps, and a loop guard `if not logger.unscaled` whose flag
# is never reset: from the step after the first log on, every clip runs on scaled gradients
# ======================================================================================================================
class GradNormLogger:
    """Logs the true gradient norm every `every` steps; it unscales first and tells the loop so (a flag), because
    a second unscale_ raises."""

    def __init__(self, sc, opt, every, reset):
        self.sc, self.opt, self.every, self.reset = sc, opt, every, reset
        self.unscaled, self.norms = False, []

    def begin_step(self):
        if self.reset:
            self.unscaled = False

    def maybe_log(self, i, m):
        if (i + 1) % self.every == 0:
            self.sc.unscale_(self.opt)
            self.unscaled = True
            self.norms.append((i, float(torch.nn.utils.get_total_norm(grads(m)))))


def flag_body(m, opt, sc, logger, clipped):
    def body(i):
        logger.begin_step()
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        logger.maybe_log(i, m)
        if not logger.unscaled:
            sc.unscale_(opt)
        t = true_norm(m, i)
        clipped.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)) / t)  # @flag-clip
        sc.step(opt)
        sc.update()
    return body


def test_m2_stale_unscaled_flag_of_a_grad_logger_clips_scaled_gradients_from_step_3():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = scaler()
    logger = GradNormLogger(sc, opt, every=3, reset=False)
    clipped = []
    rep, raised = run(m, flag_body(m, opt, sc, logger, clipped), optimizer=opt, scaler=sc)
    assert raised is None and logger.norms[0][0] == 2, (raised, logger.norms)
    # real: the clipped norm is the true one up to step 2, ~1024x it from step 3 on (the logger's flag stayed True),
    # except on the logger's own steps (5)
    r = clipped
    assert all(abs(x - 1) < 0.05 for x in r[:3] + r[5:6]) and all(abs(x / SCALE - 1) < 0.05 for x in r[3:5] + r[6:]), r
    expect(rep, "clip_before_unscale", step=3, tag="flag-clip")


def test_t2_twin_grad_logger_flag_reset_every_step_is_quiet():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = scaler()
    logger = GradNormLogger(sc, opt, every=3, reset=True)
    clipped = []
    rep, raised = run(m, flag_body(m, opt, sc, logger, clipped), optimizer=opt, scaler=sc)
    assert raised is None and len(logger.norms) == 2 and all(abs(r - 1) < 0.05 for r in clipped), (raised, clipped)
    quiet(rep)


# ======================================================================================================================
# M3 / T3. clip_grad_value_ in a project's utils module (a real file, imported as a module), switched on after a
# warmup of 2 steps and called before unscale_
# ======================================================================================================================
UTILS = '''
"""train_utils: the project's gradient helpers."""
import torch


def apply_grad_clipping(model, cfg, step):
    if step >= cfg["clip_from"]:
        torch.nn.utils.clip_grad_value_(model.parameters(), cfg["clip_value"])  # @utils-clip
'''


def load_utils(tmp_path):
    path = tmp_path / "train_utils.py"
    path.write_text(textwrap.dedent(UTILS))
    spec = importlib.util.spec_from_file_location("train_utils_misuse5", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    line = 1 + next(k for k, ln in enumerate(path.read_text().splitlines()) if ln.rstrip().endswith("# @utils-clip"))
    return mod, str(path), line


def value_body(m, opt, sc, utils, ok, seen):
    cfg = {"clip_from": 2, "clip_value": 0.5}

    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        t = max(g.abs().max().item() for g in grads(m)) / sc.get_scale()  # the largest true gradient element
        if ok:
            sc.unscale_(opt)
        utils.apply_grad_clipping(m, cfg, i)
        if not ok:
            sc.unscale_(opt)
        seen.append((t, max(g.abs().max().item() for g in grads(m))))  # after the clip, unscaled
        sc.step(opt)
        sc.update()
    return body


def test_m3_clip_grad_value_in_a_utils_module_before_unscale_from_step_2(tmp_path):
    utils, path, line = load_utils(tmp_path)
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = scaler()
    seen = []
    rep, raised = run(m, value_body(m, opt, sc, utils, False, seen), optimizer=opt, scaler=sc)
    # real: steps 0-1 unclipped; from step 2 every element is clipped to 0.5 / 1024 (the true largest are 0.1-1.4)
    assert raised is None and all(abs(a / b - 1) < 1e-2 for a, b in seen[:2]), seen
    assert all(a > 0.1 and abs(b * SCALE / 0.5 - 1) < 1e-2 for a, b in seen[2:]), seen
    expect(rep, "clip_before_unscale", step=2, file=path, line=line)


def test_t3_twin_clip_grad_value_in_a_utils_module_after_unscale_is_quiet(tmp_path):
    utils, _, _ = load_utils(tmp_path)
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = scaler()
    seen = []
    rep, raised = run(m, value_body(m, opt, sc, utils, True, seen), optimizer=opt, scaler=sc)
    assert raised is None and all(abs(b - (a if i < 2 else min(a, 0.5))) < 1e-3 for i, (a, b) in enumerate(seen)), seen
    quiet(rep)


# ======================================================================================================================
# M4 / T4. A WGAN-style loop (3 critic steps per generator step, one GradScaler): the critic steps through the
# scaler, the generator branch (first run at iteration 2) calls optG.step() directly on scaled gradients
# ======================================================================================================================
class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def gan_body(gan, optD, optG, sc, ok, g_moves):
    def body(i):
        real, z = randn(16, 8, seed=i), randn(16, 4, seed=50 + i)
        optD.zero_grad()
        with torch.autocast(**FP16):
            d_loss = (gan.D(gan.G(z).detach()).float().mean() - gan.D(real).float().mean())
        sc.scale(d_loss).backward()
        sc.step(optD)
        if i % 3 == 2:  # one generator step per 3 critic steps
            optG.zero_grad()
            with torch.autocast(**FP16):
                g_loss = -gan.D(gan.G(z)).float().mean()
            sc.scale(g_loss).backward()
            g0 = gan.G[2].weight.detach().clone()
            true = gan.G[2].weight.grad.detach().float() / sc.get_scale()
            if ok:
                sc.step(optG)
            else:
                optG.step()  # @gan-g-step
            g_moves.append(float((gan.G[2].weight.detach() - g0).norm() / (1e-3 * true.norm())))  # / lr * |true g|
        sc.update()
    return body


def gan_setup():
    gan = GAN()
    optD = torch.optim.SGD(gan.D.parameters(), lr=1e-3)
    optG = torch.optim.SGD(gan.G.parameters(), lr=1e-3)
    return gan, optD, optG, scaler()


def test_m4_wgan_generator_stepped_with_optimizer_step_on_scaled_gradients():
    gan, optD, optG, sc = gan_setup()
    moves = []
    rep, raised = run(gan, gan_body(gan, optD, optG, sc, False, moves), steps=6, optimizer=optD, scaler=sc)
    # real: each generator update is ~1024x the SGD step its true gradient gives
    assert raised is None and len(moves) == 2 and all(abs(x / SCALE - 1) < 0.05 for x in moves), (raised, moves)
    # the generator's first step is at iteration 2; the watch counts every optimizer step (D's 0-2, then G's: 3)
    f = expect(rep, "scaler_misorder", tag="gan-g-step")
    assert f.step in (2, 3), f.one_line()


def test_m4b_wgan_direct_generator_step_gives_no_false_missing_scaler_update():
    gan, optD, optG, sc = gan_setup()
    rep, raised = run(gan, gan_body(gan, optD, optG, sc, False, []), steps=6, optimizer=optD, scaler=sc)
    assert raised is None
    assert not [f.one_line() for f in rep.findings if f.rule == "missing_scaler_update"], lines(rep)


def test_t4_twin_wgan_generator_through_the_scaler_is_quiet():
    gan, optD, optG, sc = gan_setup()
    moves = []
    rep, raised = run(gan, gan_body(gan, optD, optG, sc, True, moves), steps=6, optimizer=optD, scaler=sc)
    assert raised is None and len(moves) == 2 and all(abs(x - 1) < 0.05 for x in moves), (raised, moves)
    quiet(rep)


# ======================================================================================================================
# M5 / T5. Two losses scaled in one call, `scaler.scale([main, aux])` (GradScaler takes iterables), from step 3 when
# the auxiliary loss is switched on; the aux backward runs on the RAW aux loss (the unpacked name slipped)
# ======================================================================================================================
def tuple_body(m, opt, sc, ok, aux_from, ratios):
    def body(i):
        opt.zero_grad()
        x, y = batch(i)
        with torch.autocast(**FP16):
            out = m(x).float()
            main = F.mse_loss(out, y)
            aux = 0.5 * out.abs().mean()  # an activation penalty, switched on after a warmup
        if i >= aux_from:
            g_aux = torch.autograd.grad(aux, m.head.weight, retain_graph=True)[0]
            s_main, s_aux = sc.scale([main, aux])  # @tuple-scale
            s_main.backward(retain_graph=True)
            g_main = m.head.weight.grad.detach().clone()
            (s_aux if ok else aux).backward()  # @tuple-aux-backward
            sc.unscale_(opt)
            # how much of the aux gradient arrived, after unscale_ (1: all of it; 1/1024: the raw aux backward)
            got = m.head.weight.grad - g_main / sc.get_scale()
            ratios.append(float(got.norm() / g_aux.norm()))
        else:
            sc.scale(main).backward()
            sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    return body


_M5 = ("empty report. record/monitorsink.py MonitorCallbacks.before/after('scale') handle a scale() whose argument "
       "and result are single tensors only: for `scaler.scale([main, aux])` the result is a list, so no pre-hook notes "
       "whether each scaled output's backward ran (st.scaled_outs), transfer.py never sets extra['backward'] = False, and "
       "rules/callorder.py call_order's 'scaled loss never backpropagated' branch has nothing to read")


@pytest.mark.parametrize("aux_from", [
    pytest.param(0, marks=pytest.mark.xfail(strict=True, reason=_M5)),
    pytest.param(3, marks=pytest.mark.xfail(strict=True, reason=_M5 + "; besides, that check runs on sampled steps only "
                                            "(`st.sampled` in MonitorCallbacks.after), and step 3 is not sampled"))],
    ids=["from_step_0", "from_step_3"])
def test_m5_scaled_loss_list_with_one_raw_backward_is_scaler_misorder(aux_from):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = scaler()
    ratios = []
    rep, raised = run(m, tuple_body(m, opt, sc, False, aux_from, ratios), optimizer=opt, scaler=sc)
    # real: the aux gradient arrives divided by the scale
    assert raised is None and ratios and all(abs(r * SCALE - 1) < 0.05 for r in ratios), (raised, ratios)
    expect(rep, "scaler_misorder", step=aux_from, tags=("tuple-scale", "tuple-aux-backward"))


def test_t5_twin_scaled_loss_list_both_backpropagated_is_quiet():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = scaler()
    ratios = []
    rep, raised = run(m, tuple_body(m, opt, sc, True, 3, ratios), optimizer=opt, scaler=sc)
    assert raised is None and ratios and all(abs(r - 1) < 0.05 for r in ratios), (raised, ratios)
    quiet(rep)


# ======================================================================================================================
# M6 / T6. A saliency-map callback (every 4th step, first at step 3) runs its own backward for an input-gradient
# map and cleans up with `model.zero_grad()` (the MODULE's zero_grad, not the optimizer's) between the training
# backward and scaler.step: the iteration's gradients are wiped
# ======================================================================================================================
def saliency(m, x, set_to_none, clean):
    x = x[:4].clone().requires_grad_(True)
    m(x).sum().backward()
    sal = x.grad.abs().mean(0)
    if clean:
        m.zero_grad(set_to_none=set_to_none)  # @saliency-zero
    return sal


def saliency_body(m, opt, sc, set_to_none, clean, moves, maps):
    def body(i):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = batch(i)
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        if (i + 1) % 4 == 0:
            if clean:
                maps.append(saliency(m, x, set_to_none, clean))
            else:  # the twin: the map from a copy of the model, the training gradients untouched
                import copy
                maps.append(saliency(copy.deepcopy(m), x, set_to_none, clean))
        w0 = m.head.weight.detach().clone()
        sc.step(opt)  # @saliency-step
        sc.update()
        moves.append(float((m.head.weight.detach() - w0).abs().max()))
    return body


@pytest.mark.parametrize("set_to_none", [True, pytest.param(False, marks=pytest.mark.xfail(strict=True, reason=(
    "empty report: `model.zero_grad()` (nn.Module's) is not a recorded call (record/monitor.py wraps only the "
    "watched optimizers' zero_grad), so rules/callorder.py _zeroed_after_backward finds no zero_grad event between "
    "the scaled backward and scaler.step; with set_to_none=False GradScaler finds finite zeros, so no error and no "
    "skip is recorded either (the set_to_none case is caught only through the step's 'No inf checks' error)")))],
    ids=["set_to_none", "zeros"])
def test_m6_module_zero_grad_in_a_saliency_callback_before_scaler_step_at_step_3(set_to_none):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = scaler()
    moves, maps = [], []
    rep, raised = run(m, saliency_body(m, opt, sc, set_to_none, True, moves, maps), optimizer=opt, scaler=sc)
    if set_to_none:  # real: GradScaler finds no gradients at step 3
        assert raised is not None and raised[0] == 3 and "No inf checks were recorded" in raised[1], raised
    else:  # real: step 3 applies zero gradients (plain SGD: the weights do not move), the others train
        assert raised is None and moves[3] == 0 and min(moves[:3] + moves[4:7]) > 0, (raised, moves)
    expect(rep, "scaler_misorder", step=3, tags=("saliency-zero", "saliency-step"))


def test_t6_twin_saliency_from_a_copy_is_quiet():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = scaler()
    moves, maps = [], []
    rep, raised = run(m, saliency_body(m, opt, sc, True, False, moves, maps), optimizer=opt, scaler=sc)
    assert raised is None and len(maps) == 2 and min(moves) > 0, (raised, moves)
    quiet(rep)


# ======================================================================================================================
# M7 / T7. Retry on a transient optimizer failure (an allocator error inside optimizer.step at step 3, simulated by
# the user's own step pre-hook): the handler "resets" the scaler with update() before retrying scaler.step, so the
# retry unscales the already unscaled gradients a second time
# ======================================================================================================================
class TransientFailure:
    """An optimizer step pre-hook (torch's public register_step_pre_hook) that fails once, at call `at`, as an
    out-of-memory error in the optimizer would; it records the gradient norm each call sees."""

    def __init__(self, m, at):
        self.m, self.at, self.calls, self.norms = m, at, 0, []

    def __call__(self, opt, args, kwargs):
        self.calls += 1
        self.norms.append(gnorm(grads(self.m)))
        if self.calls == self.at + 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 64.00 MiB (simulated)")


def retry_body(m, opt, sc, reset, trues):
    def body(i):
        opt.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        trues.append(true_norm(m, i))
        try:
            sc.step(opt)
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            if reset:  # "reset the scaler's state" before the retry
                sc.update()  # @retry-update
            sc.step(opt)  # @retry-step
        sc.update()
    return body


def retry_setup():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    hook = TransientFailure(m, at=3)
    opt.register_step_pre_hook(hook)
    return m, opt, scaler(), hook


def test_m7_retry_after_update_unscales_twice_at_step_3():
    m, opt, sc, hook = retry_setup()
    trues = []
    rep, raised = run(m, retry_body(m, opt, sc, True, trues), optimizer=opt, scaler=sc)
    # real: 9 optimizer calls for 8 iterations; the retry at step 3 steps on gradients divided by the scale twice
    r = [n / t for n, t in zip(hook.norms, trues[:4] + trues[3:])]
    assert raised is None and hook.calls == 9 and all(abs(x - 1) < 0.02 for x in r[:4] + r[5:]), (raised, r)
    assert abs(r[4] * SCALE - 1) < 0.02, r
    expect(rep, "scaler_misorder", step=3, tags=("retry-update", "retry-step"))


def test_t7_twin_retry_without_update_is_quiet():
    m, opt, sc, hook = retry_setup()
    trues = []
    rep, raised = run(m, retry_body(m, opt, sc, False, trues), optimizer=opt, scaler=sc)
    r = [n / t for n, t in zip(hook.norms, trues[:4] + trues[3:])]
    assert raised is None and hook.calls == 9 and all(abs(x - 1) < 0.02 for x in r), (raised, r)  # one unscale_
    quiet(rep)


# ======================================================================================================================
# M8 / T8. A physics-informed fit: AdamW through the GradScaler for 4 steps, then the usual switch to L-BFGS (step 4
# on), keeping the AMP loop: the closure backpropagates `scaler.scale(loss)`, L-BFGS steps on the scaled gradients
# (a) followed by the loop's `scaler.update()` (GradScaler asserts: no inf checks), (b) with no scaler call after it
# ======================================================================================================================
class PINN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, t):
        return self.net(t)


T_COLL = torch.linspace(0, 1, 64).unsqueeze(1)


def pinn_loss(m, amp=True):
    with torch.autocast(**FP16, enabled=amp):
        u = m(T_COLL).float()
    return F.mse_loss(u, torch.sin(3 * T_COLL))


def pinn_body(m, adam, lbfgs, sc, mode, seen):
    """mode: 'update' (closure scaled, then scaler.update()), 'bare' (closure scaled, no scaler call), 'fp32' (the
    twin: the L-BFGS phase in fp32, no autocast, no scaler)."""
    def body(i):
        if i < 4:
            adam.zero_grad()
            sc.scale(pinn_loss(m)).backward()
            sc.unscale_(adam)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(adam)
            sc.update()
            return

        def closure():
            lbfgs.zero_grad()
            loss = pinn_loss(m, amp=mode != "fp32")
            if mode == "fp32":
                loss.backward()
            else:
                true = torch.autograd.grad(loss, m.net[4].weight, retain_graph=True)[0]
                sc.scale(loss).backward()
                seen.append(float(m.net[4].weight.grad.norm() / true.norm()))
            return loss

        lbfgs.step(closure)  # @lbfgs-step
        if mode == "update":
            sc.update()  # @lbfgs-update
        with torch.no_grad():
            seen.append(float(pinn_loss(m)))
    return body


def pinn_setup():
    m = PINN()
    adam = torch.optim.AdamW(m.parameters(), lr=1e-2)
    lbfgs = torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=4, history_size=5)
    return m, adam, lbfgs, scaler()


@pytest.mark.parametrize("mode", ["update", "bare"])
def test_m8_lbfgs_phase_on_scaled_gradients_from_step_4(mode):
    m, adam, lbfgs, sc = pinn_setup()
    seen = []
    rep, raised = run(m, pinn_body(m, adam, lbfgs, sc, mode, seen), steps=7, optimizer=adam, scaler=sc)
    # real: L-BFGS's closure hands it gradients 1024x the loss's
    assert seen and abs(seen[0] / SCALE - 1) < 0.01, seen
    if mode == "update":
        assert raised is not None and raised[0] == 4 and "No inf checks were recorded prior to update" in raised[1]
    else:
        assert raised is None
    expect(rep, "scaler_misorder", step=4, tags=("lbfgs-step", "lbfgs-update"))


def test_t8_twin_lbfgs_phase_in_fp32_is_quiet():
    m, adam, lbfgs, sc = pinn_setup()
    seen = []
    rep, raised = run(m, pinn_body(m, adam, lbfgs, sc, "fp32", seen), steps=7, optimizer=adam, scaler=sc)
    assert raised is None and len(seen) == 3 and all(map(math.isfinite, seen)) and seen[-1] < seen[0], seen
    quiet(rep)


# ======================================================================================================================
# M9 / T9. The optimizer fused into the backward (torch's memory-saving tutorial: one optimizer per parameter, stepped
# in a post-accumulate-grad hook) combined with `scaler.scale(loss).backward()`: every parameter steps on its scaled
# gradient inside the backward, before any unscale_ or inf check could run
# ======================================================================================================================
def fuse_optimizer_into_backward(m, lr):
    opts = {p: torch.optim.SGD([p], lr=lr) for p in m.parameters()}

    def hook(p):
        opts[p].step()  # @fused-step
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(hook) for p in m.parameters()]
    return opts, handles


def in_backward_body(m, sc, amp_dtype, moves):
    def body(i):
        x, y = batch(i)
        w0 = m.head.weight.detach().clone()
        with torch.autocast("cpu", dtype=amp_dtype):
            loss = F.mse_loss(m(x).float(), y)
        if sc is not None:
            sc.scale(loss).backward()
        else:
            loss.backward()
        moves.append(float((m.head.weight.detach() - w0).norm()))
    return body


def test_m9_optimizer_in_backward_with_a_grad_scaler_steps_on_scaled_gradients():
    m = net()
    opts, handles = fuse_optimizer_into_backward(m, lr=1e-4)
    sc = scaler()
    moves = []
    rep, raised = run(m, in_backward_body(m, sc, torch.float16, moves), steps=6, scaler=sc)
    for h in handles:
        h.remove()
    # real: the first update is 1024x what SGD at lr 1e-4 makes of the true gradient
    m2 = net()
    fwd_loss(m2, 0).backward()
    assert raised is None and abs(moves[0] / (1e-4 * float(m2.head.weight.grad.norm())) / SCALE - 1) < 0.02, moves
    expect(rep, "scaler_misorder", step=0, tag="fused-step")


def test_t9_twin_optimizer_in_backward_with_bf16_and_no_scaler_is_quiet():
    m = net()
    opts, handles = fuse_optimizer_into_backward(m, lr=1e-2)
    moves = []
    rep, raised = run(m, in_backward_body(m, None, torch.bfloat16, moves), steps=6)
    for h in handles:
        h.remove()
    assert raised is None and min(moves) > 0, moves
    quiet(rep)


# ======================================================================================================================
# M10 / T10. An encoder and a decoder with one optimizer each on one GradScaler, stepped in a `for opt in opts:` loop
# whose body ends with `scaler.update()`: update() runs between the two optimizers' steps (and twice per iteration)
# ======================================================================================================================
def per_opt_body(m, opts, sc, inside, trackers):
    def body(i):
        for o in opts:
            o.zero_grad()
        sc.scale(fwd_loss(m, i)).backward()
        for o in opts:
            sc.unscale_(o)
            torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 1.0)
            sc.step(o)
            if inside:
                sc.update()  # @per-opt-update
        if not inside:
            sc.update()
        trackers.append(int(sc._growth_tracker))
    return body


def per_opt_setup():
    m = net()
    opts = [torch.optim.AdamW(m.body.parameters(), lr=1e-3), torch.optim.AdamW(m.head.parameters(), lr=1e-3)]
    return m, opts, scaler()


def test_m10_update_inside_the_per_optimizer_loop_is_scaler_misorder_at_step_0():
    m, opts, sc = per_opt_setup()
    trackers = []
    rep, raised = run(m, per_opt_body(m, opts, sc, True, trackers), steps=6, optimizer=opts[0], scaler=sc)
    # real: torch says nothing; GradScaler's growth tracker counts 2 per iteration (the scale would grow twice as
    # fast and back off twice per overflow; the second optimizer is unscaled by a scale its loss was not scaled with
    # whenever the first update changed it)
    assert raised is None and trackers == [2, 4, 6, 8, 10, 12], (raised, trackers)
    expect(rep, "scaler_misorder", step=0, tag="per-opt-update")


def test_t10_twin_one_update_after_both_optimizers_is_quiet():
    m, opts, sc = per_opt_setup()
    trackers = []
    rep, raised = run(m, per_opt_body(m, opts, sc, False, trackers), steps=6, optimizer=opts[0], scaler=sc)
    assert raised is None and trackers == [1, 2, 3, 4, 5, 6], (raised, trackers)
    quiet(rep)


# ======================================================================================================================
# T11. Healthy: the optimizer step deferred to the top of the next iteration (a loop that overlaps the next batch's
# data loading with the step): scale().backward() -> [next iteration] unscale_ + clip + step + update -> zero_grad,
# and the last step flushed after the loop. The same order, only rotated: no warning, no error.
# ======================================================================================================================
def test_t11_step_deferred_to_the_top_of_the_next_iteration_is_quiet():
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    losses = []

    def finish():
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        opt.zero_grad()

    def body(i):
        if i > 0:
            finish()  # the previous iteration's step
        loss = fwd_loss(m, i % 2)
        losses.append(float(loss.detach()))
        sc.scale(loss).backward()
        if i == 9:
            finish()  # the flush after the last batch

    rep, raised = run(m, body, steps=10, optimizer=opt, scaler=sc)
    assert raised is None and all(map(math.isfinite, losses)) and losses[-2] < 0.9 * losses[0], losses
    assert rep.summary["steps"] == 10, rep.summary
    quiet(rep)
