"""replay(): re-run one captured batch with op-level instrumentation and explain why it went non-finite.

Pipeline (each step in its own module): rebuild the model and load the capture's weights (modelio) → the
traced step: forward + backward under the op tracer, constant checks included (optrace, constants) → the
loss-scale search when only the backward overflowed (is it GradScaler's normal backoff?) → fp32 shadow and
dtype what-if, both with dropout off on every side (shadow) → fix search (fixsearch; the re-runs at other loss
scales and with modules in fp32 are searches.py's) → findings (explain).
A forward that raises (no constant explains it) is a `replay_error`, not a finding about the model. A model
passed in is left exactly as it was: weights, buffers, modes, grads and RNG are restored in a `finally`.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import types
from typing import Any, Callable

import torch

from ..capture import Capture, Opaque, load_capture
from ..errors import BadInput, error_line
from ..findings import Finding, Report
from ..rules.outside import bad_data_finding, captured_weights_finding
from ..tensors import nonfinite_input, tb_module
from . import explain, modelio, shadow as shadow_mod
from .optrace import OpTracer
from .skeleton import entry_view
from .searches import _backward_events, _first_line, _fix, _low_precision_first, _lowp, _scaler_search, code_device

__all__ = ["replay"]


def _opaque(*trees):
    """The first `capture.Opaque` placeholder in nested args (a value the capture could not hold), or None."""
    todo = list(trees)
    while todo:
        x = todo.pop()
        if isinstance(x, Opaque):
            return x
        if isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, types.SimpleNamespace):
            todo.extend(vars(x).values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            todo.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
    return None


def _device_of(model: torch.nn.Module) -> torch.device | None:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def _pick_dtype(cap: Capture, model: torch.nn.Module) -> tuple[torch.dtype | None, str | None]:
    ac = cap.autocast
    if ac.get("enabled"):
        return getattr(torch, ac["dtype"]), None
    if any(p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()):
        return None, None  # a pure low-precision model: every op already runs in its dtype
    return torch.float16, "the capture was taken outside autocast; replayed under float16 autocast"


def _scale(cap: Capture) -> float | None:
    s = (cap.scaler_state or {}).get("scale")
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 else None


_SHAPES = re.compile(r"shapes? cannot be multiplied|size mismatch|must match the size of tensor|Expected input "
                     r"batch_size|expected input with shape|but got input of size|Given groups=|Given normalized_shape")
"""RuntimeError messages of a shape that does not fit (torch's matmul, elementwise, conv, norm and loss checks)."""


def _as_captured(cap, e: BaseException) -> bool:
    """The step the capture holds raised this same error (its type and first line, record/autocapture.py): the
    replay reproduced the step's failure (a dtype mismatch, a shape check in the user's code), not a model that does
    not fit the capture."""
    got = ((cap.manifest or {}).get("extra") or {}).get("raised")
    return isinstance(got, dict) and got.get("type") == type(e).__name__ and \
        got.get("message") == error_line(e)


def replay(capture: str | os.PathLike | Capture, model: Any = None, loss_fn: Callable | str | None = None, *,
           device: str | None = None, shadow: bool = True, whatif: bool = True, fix_search: bool = True,
           progress: Callable[[str], None] | None = None) -> Report:
    """Re-run a capture and report the op/module/step where inf/NaN first appeared, plus fp32 comparisons."""
    say = progress or (lambda s: None)
    cap = capture if isinstance(capture, Capture) else load_capture(capture)
    held = _opaque(cap.args, cap.kwargs)
    if held is not None:
        raise BadInput(f"capture {cap.path}: the model's argument {held.where} was a {held.type}, which a capture "
                       "does not hold; its replay runs in the training process (w.report() / w.close())")
    if isinstance(loss_fn, str):
        loss_fn = modelio.resolve(loss_fn, "--loss")
    if loss_fn is not None and not callable(loss_fn):
        raise BadInput(f"loss_fn must be a callable (or a 'package.module:fn' string), got {type(loss_fn).__name__}")
    m = modelio.build_model(cap, model)
    if model is None or isinstance(model, str):
        modelio.match_capture_dtype(m, cap.state_dict)   # a model we built may take the capture's dtype
    dev = torch.device(device) if device else (_device_of(m) or torch.device("cpu"))
    if model is not None and not isinstance(model, str) and _device_of(m) not in (None, dev):
        m = copy.deepcopy(m)   # never move the caller's model
    # the batch went into one module of the model, not its own forward (record/entries.py)
    m = entry_view(m, ((cap.manifest or {}).get("extra") or {}).get("entry"))
    with modelio.preserved(m), modelio.inline_reentrant_checkpoints(), _unwatched(model):
        modelio.module_to(m, dev)
        return _replay(cap, m, loss_fn, dev, shadow, whatif, fix_search, say)


@contextlib.contextmanager
def _unwatched(model):
    """A model an open watch holds (a replay called mid-run on the training model): its watch records nothing of
    the replay's forwards and backwards (as Watch.replayed suspends it)."""
    from ..watch import watch_of
    w = watch_of(model) if isinstance(model, torch.nn.Module) else None
    with w.machine.suspend() if w is not None else contextlib.nullcontext():
        yield


def _nonfinite_weights(m: torch.nn.Module) -> list[tuple]:
    """(module, NaN?, type) of the modules whose own floating weights (parameters) are non-finite as loaded from
    the capture: inf before NaN (an inf update makes NaN downstream, not the reverse), then in definition order."""
    bad = []
    for name, mod in m.named_modules():
        ps = [p for p in mod.parameters(recurse=False) if p.is_floating_point() and p.layout == torch.strided
              and not p.is_meta and p.numel()]
        if ps and not all(bool(torch.isfinite(p).all()) for p in ps):
            bad.append((name or "(root)", any(bool(torch.isnan(p).any()) for p in ps), type(mod).__name__))
    return sorted(bad, key=lambda b: b[1])


def _replay(cap, m, loss_fn, dev, do_shadow, do_whatif, do_fix, say) -> Report:
    devtype = dev.type
    say(f"replay: loading weights from {cap.path}")
    modelio.load_weights(m, cap.state_dict)
    m.train(bool(cap.manifest.get("training", True)))
    for name in cap.manifest.get("eval_modules") or []:
        try:
            m.get_submodule(name).eval()
        except AttributeError:
            pass
    bad_weights = _nonfinite_weights(m)
    dtype, note = _pick_dtype(cap, m)
    dtype_name = str(dtype).replace("torch.", "") if dtype else str(next(
        (p.dtype for p in m.parameters() if p.is_floating_point()), torch.float16)).replace("torch.", "")
    args, kwargs = modelio.to_device((cap.args, cap.kwargs), dev)
    scale = _scale(cap)
    # the step's own backward, from the gradient its outputs received (a non-finite one came from the loss
    # computation outside the model: what the model's backward does with it is a consequence)
    grad_out = [g if g is not None and bool(torch.isfinite(g).all()) else None for g in cap.grad_out or ()]
    # (a finite loss whose scaled gradient overflowed at the output is the loss scale's doing, not the loss's)
    cap_loss_finite = ((cap.manifest or {}).get("extra") or {}).get("loss_finite")
    outside_bad = [g for g in cap.grad_out or () if g is not None and not bool(torch.isfinite(g).all())
                   and (cap_loss_finite is False or cap_loss_finite is None and bool(torch.isnan(g).any()))] \
        if loss_fn is None else []
    # the step's loss was non-finite (as the watch saw it; the replay runs the outputs' captured gradient, not the loss)
    cap_loss_bad = loss_fn is None and cap_loss_finite is False
    if loss_fn is None and any(g is not None for g in grad_out):
        loss_fn = modelio.captured_grad_loss(grad_out, scale or 1.0)

    say("replay: traced forward/backward")
    tracer = OpTracer(m)
    forward_error, out, loss, grads = None, None, None, {}
    with tracer:
        try:
            out, loss, grads = modelio.run_step(m, args, kwargs, device=devtype, dtype=dtype, rng=cap.rng,
                                                loss_fn=loss_fn, scale=scale, on_backward=tracer.backward_begins)
        except (NotImplementedError, AssertionError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # (NotImplementedError: an abstract forward; AssertionError: a model's or loss's check of the batch's
            # shape; both subclasses of what the step's own failure may raise, so asked the same way)
            ran = any(ev.phase == "forward" for ev in tracer.events)
            if isinstance(e, NotImplementedError) and (ran or str(e).startswith("Could not run")):
                forward_error = _first_line(e)  # (torch's own: an op without a kernel for a backend, e.g. sparse)
            elif (not ran or tb_module(e, {id(mod): n for n, mod in m.named_modules()}, None) is None) \
                    and not _as_captured(cap, e):
                raise BadInput(f"replaying the capture failed in the model: {type(e).__name__}: {_first_line(e)}")
            else:
                # raised inside the model's forward after an op of it had made inf/NaN: the model's own check
                # refusing it (a distribution's argument validation: "Expected parameter df ... to satisfy the
                # constraint"), the step's failure replayed as it happened, not a model that does not fit the
                # capture (nor a loss function that does not fit the outputs: that raises outside every module)
                forward_error = f"{type(e).__name__}: {_first_line(e)}"
        except RuntimeError as e:
            if _SHAPES.search(str(e)):  # shapes do not depend on values: a model that does not fit the capture
                raise BadInput(f"replaying the capture failed in the model (it does not fit the capture's batch): "
                               f"{_first_line(e)}") from None
            forward_error = _first_line(e)
    if forward_error and tracer.exception_module is not None:
        for c in tracer.constants:
            c.setdefault("raised_here", c["module"] == tracer.exception_module)
    # as the watch counts outputs (record/transfer.py): -inf alone is a mask (an RL policy's illegal actions)
    out_ok = out is None or not any(bool(torch.isnan(t).any() or torch.isposinf(t).any())
                                    for t in shadow_mod.floats(out))
    loss_finite = None if loss is None else bool(torch.isfinite(loss).all())
    grads_bad = [n for n, g in grads.items() if not bool(torch.isfinite(g).all())]
    # a non-finite loss beside finite outputs and gradients into them: the inf/NaN reached the loss another way (a
    # penalty a module keeps as an attribute); where the model made +inf/NaN from finite values itself, that op made
    # it, as a non-finite output would have (a mask's -inf is no account of a loss gone bad)
    loss_bad_aside = cap_loss_bad and any(e.phase == "forward" and not e.in_has_inf and (e.out_posinf or e.out_nan)
                                          for e in tracer.events)
    step_bad = bool(forward_error or not out_ok or loss_finite is False or grads_bad or outside_bad or loss_bad_aside)

    scaler_search = None
    tracer.events = _low_precision_first(tracer.events)
    # (an fp32 op whose inf/NaN never left its module, e.g. the log(0) of T5's and WavLM's relative-position
    # buckets, which the model casts and masks away: no failure of the step's, nor a reason to skip the scale search)
    failing = [e for e in tracer.events if not _fp32_absorbed(e)]
    fwd_events = any(e.phase == "forward" for e in failing)
    if grads_bad and scale and not forward_error and out_ok and loss_finite is not False and not fwd_events:
        say("replay: the backward overflowed alone: trying lower loss scales (GradScaler's backoff)")
        scaler_search = _scaler_search(m, args, kwargs, devtype, dtype, cap, loss_fn, scale)
    benign = bool(scaler_search and scaler_search["finite_at"])
    if scaler_search and not benign and scale and scale > 1 and any(e.phase == "backward" for e in failing):
        # no loss scale makes the backward finite: the ops that overflow at scale 1 are the failure; at the
        # capture's scale others may overflow first that only the scale made overflow (a weight gradient of
        # a large activation, ahead of a custom backward dividing by an fp16 zero)
        at_one = _backward_events(m, args, kwargs, devtype, dtype, cap, loss_fn)
        if at_one:
            tracer.events = at_one
            failing = [e for e in at_one if not _fp32_absorbed(e)]

    rows, suspects, table, ref, fix = [], [], {}, None, None
    m32 = None
    if do_shadow or do_whatif or (do_fix and step_bad):
        say("replay: fp32 shadow")
        try:
            m32 = shadow_mod.fp32_model(m)
            ref, ref_finite, _ = shadow_mod.run_dtype(m32, args, kwargs, device=devtype, dtype=None, rng=cap.rng,
                                                      loss_fn=loss_fn, cast_inputs=torch.float32, dropout=False,
                                                      selections=do_shadow)
        except (RuntimeError, ValueError) as e:
            note = (note + "; " if note else "") + f"fp32 shadow failed: {_first_line(e)}"
            ref = None
    if ref is not None and do_shadow and not forward_error:
        lo, _, _ = shadow_mod.run_dtype(m, args, kwargs, device=devtype, dtype=dtype, rng=cap.rng, loss_fn=loss_fn,
                                        scale=scale, dropout=False, selections=True)
        rows = shadow_mod.module_errors(lo, ref)
        suspects = [] if step_bad else shadow_mod.precision_suspects(
            rows, chose=shadow_mod.chose_differently(lo, ref))
    if ref is not None and do_whatif:
        say("replay: dtype what-if (fp16, bf16" + (", tf32)" if devtype == "cuda" else ")"))
        table = shadow_mod.whatif(m32, args, kwargs, device=devtype, rng=cap.rng, loss_fn=loss_fn, ref=ref,
                                  scale=scale)
    first = next((e.module for e in tracer.events), None)
    if first is None:
        first = next((c["module"] for c in tracer.constants), None)
    if do_fix and step_bad and not benign and dtype is not None and first is not None:
        say("replay: searching the smallest set of modules to run in fp32")
        fix = _fix(m, args, kwargs, devtype, dtype, cap, loss_fn, scale, first, ref)

    bad_input = nonfinite_input(cap.args, cap.kwargs)
    findings = explain.build_findings(events=failing, consts=tracer.constants, step_bad=step_bad,
                                      step=cap.step, device=code_device(cap, devtype), forward_error=forward_error,
                                      fix=fix,
                                      suspects=suspects, dtype=dtype_name, error_module=tracer.exception_module,
                                      softmax_inputs=tracer.softmax_inputs, sdpa_used=tracer.sdpa_used,
                                      scaler_search=scaler_search)
    if bad_input is not None:  # the batch itself held inf/NaN: no op of the model made it
        findings = [bad_data_finding(bad_input, cap.step, cap.path)] + [
            f for f in findings if f.rule not in ("overflow", "nan_origin")]
    elif bad_weights:  # the weights it ran with were: the update before the capture made them (first; the ops'
        # findings stay, for a watch's report to match against its records)
        findings = [captured_weights_finding(bad_weights, cap.step, cap.path)] + findings
    if outside_bad and out_ok and not forward_error and not any(
            f.rule in ("overflow", "nan_origin") and f.phase == "forward" for f in findings):
        findings.insert(0, _outside_loss_finding(outside_bad, cap.step, loss_bad=cap_loss_finite is False))
    data = {"capture": cap.path, "device": str(dev), "dtype": dtype_name, "scale": scale,
            "chain": explain.chain(tracer.events, loss_finite, grads_bad, tracer.constants,
                                   forward_error),
            "ops": [e.to_dict() for e in tracer.events[:8]],
            "constants": [{k: v for k, v in c.items() if k != "key"} for c in tracer.constants[:8]],
            "forward_error": forward_error,
            "shadow": [{"module": r["module"], "call": r["call"], "rel_err": r["rel_err"]} for r in rows],
            "whatif": table, "fix": fix or {"modules": [], "snippet": "", "found": False, "trials": [], "finite_at_scale": None},
            "scaler_search": scaler_search, "comparison_dropout": "off"}
    summary = {"replay": True, "capture": cap.path, "step": cap.step, "dtype": dtype_name, "device": str(dev),
               "finite": not step_bad, "loss": None if loss is None else float(loss.detach().float()),
               "errors": sum(f.severity == "error" for f in findings),
               "warnings": sum(f.severity == "warning" for f in findings), "note": note,
               "headline": _headline(findings, step_bad)}
    say("replay: done")
    return Report(findings, summary, {"replay": data})


def _fp32_absorbed(e) -> bool:
    """A forward op computing in full precision (inputs and output) whose inf/NaN never left its module: not a
    mixed-precision failure, and not the step's (fp32 would do the same; the module's output stayed finite)."""
    return e.phase == "forward" and e.absorbed and not _lowp(e)


def _outside_loss_finding(bad: list, step, loss_bad: bool = False) -> Finding:
    """The gradient the capture kept for the model's output was already inf/NaN, and no loss_fn was given: the loss
    computation outside the model produced it (replayed without it, the model's own backward would only pass it
    on). `loss_bad`: the step's loss value itself was not finite (the capture's `loss_finite`), so the loss's
    forward made it; otherwise its backward did."""
    nan = any(bool(torch.isnan(g).any()) for g in bad)
    made = ("the loss value itself was not finite (the capture says so): the loss computation outside the model "
            "produced it in its forward" if loss_bad else "the loss computation outside the model produced it")
    return Finding(
        "nan_origin" if nan else "overflow", "error", "forward" if loss_bad else "backward", None, None, step,
        f"The gradient this step's loss gave the model's output was already {'NaN' if nan else 'inf'} (kept in the "
        f"capture): {made}, not a module of the model.",
        "Replay with the loss function to see which op (`ampdoctor.replay(capture, loss_fn=...)`, CLI `--loss "
        "package.module:function`); compute the loss in fp32 (`logits.float()`), and keep exp/log/pow of the "
        "outputs in a safe range.",
        {"grad_out_nonfinite": len(bad), "rank_hint": 12})


def _headline(findings, step_bad: bool = False) -> str:
    top = next((f for f in findings if f.severity in ("error", "warning")), None)
    if top is None and step_bad:
        return ("The replayed step is non-finite, but no op of the model was seen to make the inf/NaN (see the "
                "op chain); nothing in the model is to blame on its own.")
    if top is None:
        return "Healthy: the replayed step is finite and close to fp32; nothing to report."
    where = f" at `{top.module}`" if top.module else ""
    op = f" ({top.op})" if top.op else ""
    return f"{top.rule}{where}{op}: {top.message}"
