"""Exceptions and Python control flow in and around the model: what the user's own code raises and handles must
never be reported as a crash (or as the step's fault), an exception that really ends the run is reported at its
module and step, watching changes no bit of the training, and an fp16 failure in these settings is still named at its
producer (probe_harness.Producer, the first module whose output is non-finite from finite inputs).

Model: embed Linear(8, 32) -> blocks (two residual Blocks: x + relu(fc(x))) -> head Linear(32, 1); `blocks.1.fc`
has a x40 gain, so a x3000 batch overflows it in fp16 (the oracle checks that; embed and blocks.0 stay finite).
AdamW + GradScaler("cpu", init_scale=1024), fp16 CPU autocast. Steps are the optimizer's (CONTRACT: "the optimizer
step (0-based)"): an iteration whose batch the user skips before backward is no step, so the oracle counts completed
scaler.update() calls, not iterations. Every case also runs unwatched: losses and final weights bitwise equal.

 1. fused_fallback_healthy: each Block tries a "fused" submodule that raises RuntimeError (no kernel for CPU/Half)
    on every call and falls back to the slow path inside its own forward. A healthy run: quiet, no crash.
 2. fused_fallback_overflow: the same, a x3000 batch at step 6: overflow named at the fallback's `blocks.1.fc`.
 3. generator_loader_epochs: the batches come from a generator, pulled by next(); its StopIteration ends each of
    two epochs (caught, a new epoch's generator made); the overflow at global step 7 (epoch 2) is named there.
 4. oom_caught_healthy: `blocks.1` raises RuntimeError("CUDA out of memory ...") for a too-large batch at
    iteration 3; the loop catches it, empties nothing, skips the batch. Healthy otherwise: no crash, no error.
 5. oom_caught_then_overflow: the same, then the x3000 batch at iteration 7 = optimizer step 6: named at
    (`blocks.1.fc`, 6) -- the skipped iteration must not shift the step.
 6. value_error_suppressed_mid_run: the model's own input check raises ValueError("bad batch shape") at iteration 7
    (of 10); the loop body runs under `contextlib.suppress(ValueError)`. README is silent on a forward exception the
    caller handles ("A run that dies is still recorded" is about uncaught ones): a finding saying that the step
    raised would be arguable; asserted only: no crash, no `error` finding.
 7. value_error_caught_last_iteration: the same check fails on the LAST iteration, caught; the script then ends
    normally (w.close()). Asserted: no crash (the run did not die), no `error` finding.
 8. uncaught_raise_from_step5: `blocks.1.table` (an index lookup) raises IndexError at step 5; `blocks.1` catches
    it and raises RuntimeError("bad token id ...") from it; nothing catches that. Crash: RuntimeError, step 5,
    module `blocks.1` (the module whose exception ended the run; `blocks.1.table`, its cause, is accepted too),
    the message the outer one.
 9. except_block_loop_crash: the loop runs inside `except ImportError:` (a fallback); a caught OOM skips iteration
    2; a batch one column too wide at iteration 6 = step 5 makes `embed` raise an uncaught shape error: crash
    RuntimeError at `embed`, step 5 --
    not the ImportError the caller was handling.
10. keyboard_interrupt_checkpoint: Ctrl-C (KeyboardInterrupt) in `blocks.0`'s forward at step 9; the loop catches
    it, saves a checkpoint, re-raises. Crash KeyboardInterrupt at step 9; the checkpoint bitwise equal to the
    unwatched twin's. (torch runs no always_call hook for a BaseException, so the module is arguable: `blocks.0` or
    None accepted.)
11. autograd_backward_raises_caught: `blocks.0` applies a custom autograd Function (a straight-through clamp)
    whose backward raises RuntimeError at iteration 4; the loop catches it around backward, zero_grads and goes on.
    No crash, no error (README: such a crash is not attributed to a module; here it is handled).
12. user_hook_raises_caught: the user's own forward hook on `blocks.0` raises ValueError ("activation check") at
    iteration 5; the loop catches it and skips the batch; then the x3000 batch at iteration 8 = step 7 is named
    at `blocks.1.fc`.

Result when written (torch 2.13 CPU): 8 pass, 4 strict xfail (WrongAnswer); all 12 pass since (1-2: an exception a
submodule raises and the model catches no longer stays on the step, record/modulehooks.py; 5: a forward that only
raised takes a capture kind of its own, record/autocapture.py; 7: an exception the script caught before closing the
watch is no crash, Watch._close and rules/steps.crash). What was wrong:
 - 1: a healthy run whose Blocks catch their fused submodule's RuntimeError: "[error] overflow at head aten::mm
   step 0 ... produced ±inf from finite inputs" (the verdict); truth: no forward was ever non-finite (steps 0-2 are
   GradScaler's backward backoff). The handled exception of `blocks.*.fused` marks each step's forward as failed.
 - 2: the same with an overflow: "Crashed at step 9: RuntimeError: fused_mlp ... in `blocks.0.fused`" plus
   "[error] overflow at head step 0"; truth: no crash, overflow at blocks.1.fc step 6.
 - 5: one caught OOM at step 3 and the overflow at step 6 is "nan_origin at (run) step 6: ... a step without
   per-layer statistics"; truth: blocks.1.fc step 6 (named so in the same run without the caught OOM). (Step
   numbers are right; the location is lost.)
 - 7: a ValueError caught on the last iteration, the script ending normally: "Crashed at step 9: ValueError: bad
   batch shape ... in `(root)`" (a caught OOM in the last step does the same: "crash step 8").
 Right: 3, 4 and 6 (Healthy verdicts), 8 (crash RuntimeError at blocks.1, step 5, the outer message), 9 (crash
 RuntimeError at embed step 5, not the ImportError), 10 (KeyboardInterrupt at blocks.0 step 9; checkpoints
 equal), 11, 12; every case bitwise identical to its unwatched twin.

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_model_exceptions.py
"""
from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer
from scenarios import lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FWD = ("overflow", "nan_origin")
W_TRUE = torch.randn(8, 1, generator=torch.Generator().manual_seed(99)) * 0.5
OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.90 GiB already "
       "allocated; 1.12 GiB free)")


# ---------------------------------------------------------------------------------------------------- the model
class Fused(nn.Module):
    """A 'fused kernel' wrapper that is not available here: it raises on every call."""

    def forward(self, x):
        raise RuntimeError("fused_mlp: no kernel for device 'cpu' and dtype Half")


class Table(nn.Module):
    """A lookup whose index goes out of range for a bad batch (IndexError)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ids", torch.arange(4))
        self.bad = False

    def forward(self, x):
        return x * (1.0 + 0.0 * self.ids[7 if self.bad else 0])


class Clamp(torch.autograd.Function):
    """A straight-through clamp; its backward raises when `Clamp.trap` is set (a user's custom op failing)."""
    trap = False

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1e4, 1e4)

    @staticmethod
    def backward(ctx, g):
        if Clamp.trap:
            raise RuntimeError("clamp_backward: unsupported layout")
        return g


class Block(nn.Module):
    def __init__(self, fused=False, oom=False, table=False, clamp=False):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.fused = Fused() if fused else None
        self.table = Table() if table else None
        self.oom, self.clamp, self.interrupt = oom, clamp, False

    def forward(self, x):
        if self.fused is not None:
            try:
                return self.fused(x)
            except RuntimeError:
                pass                                        # the slow path below
        if self.oom and x.shape[0] > 32:
            raise RuntimeError(OOM)
        if self.interrupt:
            raise KeyboardInterrupt
        if self.table is not None:
            try:
                x = self.table(x)
            except IndexError as e:
                raise RuntimeError("bad token id in batch: index 7 out of range for a table of 4") from e
        if self.clamp:
            x = Clamp.apply(x)
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.Sequential(Block(**kw.get("b0", {})), Block(**kw.get("b1", {})))
        self.head = nn.Linear(32, 1)
        self.check_shape = False

    def forward(self, x):
        if self.check_shape and x.shape[-1] != 8:
            raise ValueError(f"bad batch shape {tuple(x.shape)}: expected (*, 8)")
        h = self.blocks(self.embed(x))
        return self.head(h[..., :32])


def build(**kw):
    torch.manual_seed(0)
    m = Net(**kw)
    with torch.no_grad():
        m.blocks[1].fc.weight.mul_(40.0)
    return m


def batch(i, scale=1.0, n=16, cols=8):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(n, 8, generator=g)
    y = x @ W_TRUE
    x = x * scale
    if cols != 8:
        x = torch.cat([x, torch.zeros(n, cols - 8)], -1)
    return x, y


# ---------------------------------------------------------------------------------------------------- the harness
class Loop:
    """The user's training state: model, AdamW, GradScaler, the oracle; `step` counts completed optimizer steps."""

    def __init__(self, m, oracle):
        self.m, self.oracle = m, oracle
        self.opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        self.sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
        self.step, self.losses, self.skipped, self.ckpt = 0, [], [], None

    def forward(self, x, y):
        if self.oracle is not None:
            self.oracle.step = self.step
        self.opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = self.m(x)
        return F.mse_loss(out.float(), y)

    def backward_step(self, loss):
        self.losses.append(loss.item())
        s0 = self.sc.get_scale()
        self.sc.scale(loss).backward()
        self.sc.step(self.opt)
        self.sc.update()
        if self.sc.get_scale() < s0:
            self.skipped.append(self.step)
        self.step += 1

    def train(self, x, y):
        self.backward_step(self.forward(x, y))


def run(build_fn, body, watch=True):
    """body(loop) under `with ampdoctor.watch(...)` (or unwatched); an exception leaving it is kept (as pytest would
    catch a script's). Returns (loop, report or None, the exception or None)."""
    m = build_fn()
    orc = Producer(m) if watch else None
    lp = Loop(m, orc)
    raised, w = None, None
    try:
        if watch:
            with ampdoctor.watch(m, optimizer=lp.opt, scaler=lp.sc) as w:
                body(lp)
        else:
            body(lp)
    except BaseException as e:                              # (KeyboardInterrupt included: case 10)
        raised = e
    if orc is not None:
        orc.remove()
    return lp, (w.report() if w is not None else None), raised


def twin(build_fn, body):
    """The watched run and its unwatched twin: the same losses, exception, checkpoint and final weights, bitwise."""
    lp, rep, raised = run(build_fn, body)
    lp0, _, raised0 = run(build_fn, body, watch=False)
    assert [repr(v) for v in lp.losses] == [repr(v) for v in lp0.losses], (lp.losses, lp0.losses)
    assert type(raised) is type(raised0), (raised, raised0)
    a, b = lp.m.state_dict(), lp0.m.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ"
    if lp.ckpt is not None or lp0.ckpt is not None:
        c, c0 = (torch.load(io.BytesIO(v), weights_only=True) for v in (lp.ckpt, lp0.ckpt))
        assert c["step"] == c0["step"] and all(torch.equal(c["model"][k], c0["model"][k]) for k in c0["model"]), \
            "checkpoints differ"
    return lp, rep, raised


def say(rep):
    s = rep.summary
    return f"{lines(rep)[:4]} | crash={s.get('crash')} | verdict={s.get('verdict')!r}"


def no_crash(rep):
    """The run ended normally: no crash in the summary, a verdict that does not say it crashed."""
    if rep.summary.get("crash") is not None or str(rep.summary.get("verdict") or "").startswith("Crashed"):
        raise WrongAnswer(f"a run that ended normally reported as crashed -- {say(rep)}")


def no_error(rep):
    bad = [f.one_line() for f in rep.findings if f.severity == "error"]
    if bad:
        raise WrongAnswer(f"error findings for a handled exception: {bad} -- {say(rep)}")


def quiet(rep):
    no_crash(rep)
    bad = [f.one_line() for f in rep.findings if f.severity in ("warning", "error")]
    if bad:
        raise WrongAnswer(f"a healthy run with alarms: {bad} -- {say(rep)}")
    assert rep.summary["steps"] >= 1, rep.summary


def named(rep, lp, module, step):
    """The oracle saw the overflow at (module, step) and the scaler skipped it; ampdoctor names it in its top 3."""
    assert lp.oracle.first == (module, step), lp.oracle.first
    assert step in lp.skipped, lp.skipped
    top = [(f.rule, f.module, f.step) for f in rep.findings[:3] if f.severity == "error"]
    if not any(r in FWD and mo == module and s == step for r, mo, s in top):
        raise WrongAnswer(f"overflow at ({module}, {step}) not in the top 3 -- {say(rep)}")


def crashed(rep, typ, step, modules, msg=None):
    c = rep.summary.get("crash")
    if not isinstance(c, dict):
        raise WrongAnswer(f"no crash -- {say(rep)}")
    if c.get("type") != typ or c.get("step") != step or c.get("module") not in modules:
        raise WrongAnswer(f"crash {c.get('type')} at ({c.get('module')!r}, step {c.get('step')}), want {typ} at "
                          f"({modules[0]!r}, step {step}) -- {say(rep)}")
    if msg is not None and msg not in str(c.get("message") or ""):
        raise WrongAnswer(f"crash message {c.get('message')!r}, want {msg!r}")
    if rep.exit_code != 1:
        raise WrongAnswer(f"exit code {rep.exit_code} for a crashed run")


# ---------------------------------------------------------------------------------------------------- the cases
def fused_body(bad=None, steps=10):
    def body(lp):
        for i in range(steps):
            lp.train(*batch(i, 3000.0 if i == bad else 1.0))
    return body


def test_fused_fallback_healthy_is_quiet():
    lp, rep, raised = twin(lambda: build(b0=dict(fused=True), b1=dict(fused=True)), fused_body())
    assert raised is None and all(map(math.isfinite, lp.losses)), (raised, lp.losses)
    assert lp.oracle.first is None                          # (the early skips: GradScaler's search, backward only)
    quiet(rep)


def test_fused_fallback_overflow_named_at_producer():
    lp, rep, raised = twin(lambda: build(b0=dict(fused=True), b1=dict(fused=True)), fused_body(bad=6))
    assert raised is None
    no_crash(rep)
    named(rep, lp, "blocks.1.fc", 6)


def test_generator_loader_stopiteration_between_epochs():
    def epoch(e):
        for j in range(5):
            i = 5 * e + j
            yield batch(i, 3000.0 if i == 7 else 1.0)

    def body(lp):
        for e in range(2):
            it = epoch(e)
            while True:
                try:
                    x, y = next(it)
                except StopIteration:
                    break
                lp.train(x, y)
    lp, rep, raised = twin(build, body)
    assert raised is None and lp.step == 10
    no_crash(rep)
    named(rep, lp, "blocks.1.fc", 7)


def oom_body(bad=None, oom_at=3, steps=10):
    def body(lp):
        for i in range(steps):
            x, y = batch(i, 3000.0 if i == bad else 1.0, n=64 if i == oom_at else 16)
            try:
                loss = lp.forward(x, y)
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                continue                                    # skip the batch, as OOM-tolerant loops do
            lp.backward_step(loss)
    return body


def test_oom_caught_and_skipped_is_not_a_crash():
    lp, rep, raised = twin(lambda: build(b1=dict(oom=True)), oom_body())
    assert raised is None and lp.step == 9 and all(map(math.isfinite, lp.losses)) and lp.oracle.first is None
    no_crash(rep)
    no_error(rep)


def test_oom_caught_then_overflow_keeps_step_numbers():
    lp, rep, raised = twin(lambda: build(b1=dict(oom=True)), oom_body(bad=7))
    assert raised is None and lp.step == 9
    no_crash(rep)
    named(rep, lp, "blocks.1.fc", 6)


def shape_body(bad_at, steps=10):
    def body(lp):
        lp.m.check_shape = True
        for i in range(steps):
            with contextlib.suppress(ValueError):
                lp.train(*batch(i, cols=9 if i == bad_at else 8))
    return body


def test_value_error_suppressed_mid_run_is_not_a_crash():
    lp, rep, raised = twin(build, shape_body(7))
    assert raised is None and lp.step == 9
    no_crash(rep)
    no_error(rep)


def test_value_error_caught_on_last_iteration_is_not_a_crash():
    lp, rep, raised = twin(build, shape_body(9))
    assert raised is None and lp.step == 9
    no_crash(rep)
    no_error(rep)


def test_uncaught_raise_from_in_submodule_at_step5():
    def body(lp):
        for i in range(10):
            lp.m.blocks[1].table.bad = i == 5
            lp.train(*batch(i))
    lp, rep, raised = twin(lambda: build(b1=dict(table=True)), body)
    assert isinstance(raised, RuntimeError) and isinstance(raised.__cause__, IndexError) and lp.step == 5
    crashed(rep, "RuntimeError", 5, ("blocks.1", "blocks.1.table"), msg="bad token id")


def test_loop_inside_except_block_crash_is_its_own():
    def body(lp):
        try:
            raise ImportError("No module named 'apex'")    # the fallback path the loop runs in
        except ImportError:
            for i in range(10):
                x, y = batch(i, n=64 if i == 2 else 16, cols=9 if i == 6 else 8)
                try:
                    loss = lp.forward(x, y)
                except RuntimeError as e:
                    if "out of memory" not in str(e):
                        raise
                    continue
                lp.backward_step(loss)
    lp, rep, raised = twin(lambda: build(b1=dict(oom=True)), body)
    assert isinstance(raised, RuntimeError) and "shapes" in str(raised) and lp.step == 5, raised
    crashed(rep, "RuntimeError", 5, ("embed",), msg="shapes")


def test_keyboard_interrupt_saves_checkpoint_and_reraises():
    def body(lp):
        for i in range(12):
            lp.m.blocks[0].interrupt = i == 9
            x, y = batch(i)
            try:
                lp.train(x, y)
            except KeyboardInterrupt:
                buf = io.BytesIO()
                torch.save({"model": lp.m.state_dict(), "step": lp.step}, buf)
                lp.ckpt = buf.getvalue()
                raise
    lp, rep, raised = twin(build, body)
    assert isinstance(raised, KeyboardInterrupt) and lp.step == 9 and lp.ckpt
    crashed(rep, "KeyboardInterrupt", 9, ("blocks.0", None))


def test_autograd_function_backward_raises_and_is_caught():
    def body(lp):
        for i in range(10):
            Clamp.trap = i == 4
            try:
                lp.train(*batch(i))
            except RuntimeError as e:
                if "clamp_backward" not in str(e):
                    raise
                lp.opt.zero_grad()
            finally:
                Clamp.trap = False
    lp, rep, raised = twin(lambda: build(b0=dict(clamp=True)), body)
    assert raised is None and lp.step == 9, (raised, lp.step)
    no_crash(rep)
    no_error(rep)


def test_user_forward_hook_raises_and_is_caught():
    def body(lp):
        state = {"i": 0}

        def check(mod, inp, out):
            if state["i"] == 5:
                raise ValueError("activation check failed: blocks.0 output drifted")
        h = lp.m.blocks[0].register_forward_hook(check)
        for i in range(10):
            state["i"] = i
            try:
                lp.train(*batch(i, 3000.0 if i == 8 else 1.0))
            except ValueError:
                continue
        h.remove()
    lp, rep, raised = twin(build, body)
    assert raised is None and lp.step == 9
    no_crash(rep)
    named(rep, lp, "blocks.1.fc", 7)
