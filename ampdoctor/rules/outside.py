"""Origins of an inf/NaN that are not a module's forward or backward: a buffer the training writes, a batch that
already held inf/NaN (or a state the model returned and the loop fed back: `carried`), weights an earlier update
wrote, a bad step without per-layer statistics (an fp16 .grad summed over micro-batches: `_accumulated`), and an
inf that later ops absorbed on such a step, seen only by the always-on series (the `producers` rule,
ampdoctor/rules/origins.py, calls these; the loss computed outside the model is rules/lossorigin.py's)."""
from __future__ import annotations

import math

from ..findings import Finding
from ..fixes import fp32_snippet
from ..records import StepRecord
from .registry import RunData
from .backoff import benign_backoff
from .lossorigin import nan_made_by_inf

__all__ = ["bad_buffers", "bad_data", "bad_data_finding", "bad_weights", "captured_weights_finding", "weights_found_bad",
           "unlocated", "absorbed_unsampled"]


def bad_buffers(run: RunData) -> list[Finding]:
    """A buffer the training writes (a running statistic, an EMA) that turned non-finite: its module's own in-place
    update produced it. Silent when the module's output stays finite (`x * rsqrt(inf)` is 0): the features it
    scales are dead from then on, and nothing else in the run goes non-finite."""
    r = next((r for r in run.steps if r.bad_buffer), None)
    if r is None:
        return []
    b = r.bad_buffer
    module, kind = b.get("module", ""), "NaN" if b.get("kind") == "nan" else "inf"
    typ = next((m[1] for m in run.meta.modules if m[0] == module), "?")
    silent = not r.bad
    dead = (" while its output stayed finite, so nothing else saw it — the features it scales are dead from here on"
            if silent else "")
    return [Finding(
        "nan_origin" if kind == "NaN" else "overflow", "error", "forward", module, None, r.step,
        f"The buffer `{b.get('buffer')}` of `{module or '(root)'}` ({typ}) became {kind} at step {r.step}: the "
        f"module's own update of it overflowed{dead}.",
        "Keep running statistics in fp32: register the buffer as float32 and update it from `x.float()` (e.g. "
        "`self.sq.mul_(m).add_((1 - m) * x.float().pow(2).mean(0))`), or clamp what is accumulated.",
        {"buffer": b.get("buffer"), "kind": b.get("kind"), "silent": silent, "type": typ, "rank_hint": 11})]


def weights_found_bad(r: StepRecord, order: dict) -> list[tuple]:
    """(module, NaN?, forward order, type) of the modules whose own weights step `r` found non-finite: a sampled
    step's module calls (`ModuleCall.par`), a routine step that went bad its `bad_weights` (`order`: module ->
    (forward order, type), from RunMeta.modules)."""
    bad = [(c.module, bool(c.par.nan), c.seq, c.type) for c in r.modules if c.par is not None and not c.par.finite]
    if not bad and r.bad_weights and not r.modules:
        bad = [(mod, k == "nan", *order.get(mod, (len(order), "?"))) for mod, k in r.bad_weights.items()]
    return bad


def bad_weights(run: RunData) -> list[Finding]:
    """Weights that were already non-finite when a step began: no module of the step produced the inf/NaN (a
    module holding bad weights is not blamed for its output); the optimizer step before wrote them."""
    prev = None
    order = {m[0]: (i, m[1]) for i, m in enumerate(run.meta.modules)}
    for r in run.steps:
        bad = weights_found_bad(r, order)
        if bad:
            # inf weights before NaN ones (an inf update makes NaN downstream on the next step, not the reverse),
            # then the first in forward order
            module, nan, _, typ = min(bad, key=lambda b: (b[1], b[2]))
            kind = "NaN" if nan else "inf"
            made = _applied_bad_gradients(prev, {b[0] for b in bad}, kind)
            if made is not None:
                return made
            if prev is not None and prev.forward_bad:
                # the update before applied the gradients of a step that had already gone bad (e.g. an unsampled
                # step's NaN loss, stepped without a scaler): those weights are its consequence, and its origin
                # is that step's (unlocated here: the replay of its capture names the op)
                return []
            before = f"step {prev.step}'s update" if prev is not None else "an update before the watch began"
            grads = ("" if prev is None or prev.grad_finite is None else
                     " with finite gradients" if prev.grad_finite else " with non-finite gradients")
            return [Finding(
                # dated at the update that wrote them (the step before); the step that found them is in the text
                "nan_origin" if kind == "NaN" else "overflow", "error", "optimizer", module, None,
                prev.step if prev is not None else r.step,
                f"The weights of `{module}` ({typ}) were already {kind} when step {r.step} began: "
                f"{before}{grads} wrote them. The modules after it only passed the values on.",
                "Look at that update: a NaN/inf gradient stepped without a GradScaler (use "
                "`clip_grad_norm_(..., error_if_nonfinite=True)` or skip such steps), a learning rate that "
                "overflows fp16 weights, Adam's eps vanishing in fp16 parameters (keep fp32 master weights), or a "
                "hand-written update dividing by a zero norm.",
                {"type": typ, "weights": "nan" if nan else "inf", "modules": [b[0] for b in bad][:20],
                 "previous_step": prev.step if prev is not None else None,
                 # (after non-finite gradients were applied, what made them - a backward producer, a replay's op -
                 # is the origin and ranks first at the same step)
                 "rank_hint": 14 if prev is not None and prev.grad_finite is False else 12})]
        prev = r
    return []


def _applied_bad_gradients(prev: StepRecord | None, bad_modules: set[str], kind: str) -> list[Finding] | None:
    """The weights went bad because the step before applied non-finite gradients that its finite forward's
    backward made (no GradScaler skipped it; e.g. micro-batches summed into fp16 `.grad` past 65504): the
    producer is that backward, at that step, in the layer whose gradients they were (a routine step records
    every parameter whose gradient was non-finite). None when that is not what the records show."""
    if prev is None or prev.grad_finite is not False or prev.skipped or prev.loss_finite is False \
            or prev.output_finite is False or prev.exception:
        return None
    grads = [p for p in prev.params if p.grad_nonfinite]
    if not grads:
        return None
    p = next((p for p in grads if p.module in bad_modules), grads[0])
    nan = p.grad_absmax is not None and p.grad_absmax != p.grad_absmax
    acc = prev.micro_batches > 1
    return [Finding(
        "nan_origin" if nan else "overflow", "error", "backward", p.module, None, prev.step,
        f"The gradient of `{p.name}` was {'NaN' if nan else 'inf'} at step {prev.step} although the forward was "
        f"finite{f' (summed over {prev.micro_batches} micro-batches into .grad)' if acc else ''}; the optimizer "
        f"applied it, and from step {prev.step + 1} on the weights of `{p.module}` are {kind}.",
        ("Accumulate gradients in fp32: keep fp32 master weights (train in autocast instead of `.half()`), or scale "
         "each micro-batch's loss down (divide by the number of micro-batches) and use torch.amp.GradScaler, "
         "which skips a step whose gradients overflowed." if acc else
         "Use torch.amp.GradScaler (it skips a step whose gradients overflowed and lowers the scale) with fp32 "
         "master weights, or `clip_grad_norm_(..., error_if_nonfinite=True)` to stop before the update."),
        {"param": p.name, "grad_absmax": p.grad_absmax, "micro_batches": prev.micro_batches,
         "weights_bad_from": prev.step + 1, "modules": sorted(bad_modules)[:20], "rank_hint": 12})]


def bad_data(run: RunData, device: str = "cuda") -> list[Finding]:
    """The first step whose batch already held inf/NaN when the model received it: no module produced it — unless
    a module's output held them on the steps just before, with their losses finite (`carried`)."""
    r = next((r for r in run.steps if r.bad_input), None)
    if r is None:
        return []
    return carried(run, r, device) or [bad_data_finding(r.bad_input, r.step, r.capture)]


def carried(run: RunData, r: StepRecord, device: str) -> list[Finding]:
    """Step `r`'s batch held inf/NaN, and on a step just before it (every step between with a finite loss) the
    always-on headroom saw a module's output hold inf/NaN first (`first_bad`; a module whose output was finite on an
    earlier step, not a mask's -inf): the model made them and returned them (a recurrent memory, a truncated-BPTT
    state, a cache) and the loop fed them back as an input. Named at that module, on that step."""
    mods = run.meta.modules or []
    before = [q for q in run.steps if q.step < r.step]
    for i in range(len(before) - 1, -1, -1):
        q = before[i]
        if q.loss_finite is False or q.bad_input:
            return []
        h = q.headroom or {}
        fwd, slot = h.get("fwd") or (), h.get("first_bad")
        if not (isinstance(slot, int) and 0 <= slot < min(len(fwd), len(mods))):
            continue
        if not any(isinstance(v, (int, float)) and math.isfinite(v)
                   for v in (x.headroom_of(slot)[0] for x in before[:i])):
            return []  # (never finite before: a mask module's -inf)
        module, typ = mods[slot][0], mods[slot][1] if len(mods[slot]) > 1 else "?"
        v = fwd[slot]
        nan = v != v
        b = r.bad_input
        arg = b.get("arg")
        name = f"argument {arg}" if isinstance(arg, int) else f"`{arg}`"
        at = f"`{module}`" if module else "`(root)`"
        return [Finding(
            "nan_origin" if nan else "overflow", "error", "forward", module, None, q.step,
            f"{at} ({typ}) was the first module whose output held {'NaN' if nan else '±inf'} at step {q.step}, while "
            f"that step's loss stayed finite; the model returned the values (a recurrent memory or state, a cache) and "
            f"the loop fed them back: the batch of step {r.step} held them (model input {name}) and the loss went "
            "non-finite there. The data did not bring them.",
            "Keep the carried state in fp32 (accumulate the memory with `.float()`), or bound or renormalise it "
            "before it is returned:\n" + fp32_snippet(module, device),
            {"carried": True, "input": arg, "fed_back_at": r.step, "type": typ, "source": "headroom",
             "capture": r.capture, "rank_hint": 9})]
    return []


def bad_data_finding(b: dict, step: int | None, capture: str | None) -> Finding:
    """nan_origin (overflow for ±inf only) outside the model: input `b` (tensors.nonfinite_input) of a batch."""
    nan = b.get("nan", 0)
    arg = b.get("arg")
    name = f"argument {arg}" if isinstance(arg, int) else f"`{arg}`"
    vals = ", ".join(f"{n} {w}" for n, w in ((nan, "NaN"), (b.get("posinf", 0), "+inf"), (b.get("neginf", 0), "-inf"))
                     if n)
    skipped = bool(b.get("unscaled"))
    return Finding(
        "nan_origin" if nan else "overflow", "info" if skipped else "error", "forward", None, None, step,
        f"The batch of step {step} already held {vals} (model input {name}, {b.get('numel')} {b.get('dtype')} "
        "values) when the model received it: the data, not a layer, brought the non-finite values; every module "
        "after it only passed them on." + (
            " The loop skipped this batch before its backward (no scaled loss came from it), so it trained nothing; "
            "the data pipeline still has a bad sample." if skipped else ""),
        "Find the bad sample in the data pipeline (a division by a zero std in normalisation, a corrupt record, an "
        "fp16 cast of values past 65504) and filter or repair it; a guard in the loop: "
        "`assert torch.isfinite(x).all(), idx`.",
        {"input": arg, "nan": nan, "posinf": b.get("posinf", 0), "neginf": b.get("neginf", 0),
         "numel": b.get("numel"), "dtype": b.get("dtype"), "capture": capture, "skipped_by_loop": skipped,
         "rank_hint": 9})


def captured_weights_finding(bad: list[tuple], step: int | None, capture: str | None) -> Finding:
    """nan_origin (overflow for ±inf only) outside the replayed batch: the capture's weights were already non-finite
    (`bad`: (module, NaN?, type) of the modules holding them, the first to blame first). The update before the
    capture wrote them; no op of the replay made the inf/NaN."""
    module, nan, typ = bad[0]
    kind = "NaN" if nan else "inf"
    return Finding(
        "nan_origin" if nan else "overflow", "error", "optimizer", module, None, step,
        f"The captured weights of `{module}` ({typ}) were already {kind} when the batch ran"
        + (f" ({len(bad)} modules' weights in all)" if len(bad) > 1 else "")
        + ": an optimizer update before the capture wrote them, not an op of this step; every module after it only "
        "passed the values on.",
        "Capture the step whose update wrote them (the step before: its gradients or its learning rate), or guard "
        "the update: a GradScaler skips steps with non-finite gradients; without one, "
        "`clip_grad_norm_(..., error_if_nonfinite=True)`.",
        {"type": typ, "weights": kind.lower(), "modules": [b[0] for b in bad][:20], "capture": capture,
         "rank_hint": 12})


def unlocated(run: RunData) -> list[Finding]:
    """A step whose loss (or, without a scaler, whose gradients) went non-finite on a step without per-layer
    statistics: say so, so that the step's capture is replayed to locate the op."""
    backoff = benign_backoff(run.steps, run.has_scaler, growth_factor=run.growth_factor)
    for r in run.steps:
        if r.bad_input:
            continue  # the data brought it (_bad_data)
        if r.step in backoff and r.output_finite is not False:
            continue  # the loss scale itself made the loss non-finite in the first search (steps.scaled_loss_steps)
        if r.loss_finite is False or r.output_finite is False or (not run.has_scaler and r.grad_finite is False):
            inf = r.loss is not None and math.isinf(r.loss)
            where = ("loss" if r.loss_finite is False else "model's output" if r.output_finite is False
                     else "gradients")
            inf = inf or (where == "loss" and r.output_finite is not False and nan_made_by_inf(r))
            ev = {"loss": r.loss, "capture": r.capture, "unlocated": True, "rank_hint": 11}
            if not r.micro_batches and not r.capture:
                # no forward of the watched model in the step: the loop ran another module (a deep copy, which
                # carries none of the watch's hooks: a meta-learning clone), so nothing can be replayed
                phase, ev["no_forward"] = "forward", True
                msg = ("but the watched model's forward did not run in this step: the loop ran another module (a copy "
                       "made with copy.deepcopy carries none of ampdoctor's hooks, e.g. a meta-learning clone), so no "
                       "layer could be named.")
                fix = ("Watch the module the loop runs (e.g. the clone, with its own `ampdoctor.watch`), or save its "
                       "failing batch with `ampdoctor.save_batch` and replay it.")
            elif where == "gradients" and (acc := _accumulated(r)) is not None:
                return [acc]
            else:
                phase = "backward" if where == "gradients" else "forward"
                msg = "a step without per-layer statistics; replay its capture (`ampdoctor replay`) or watch with " \
                      "every=1 to name the layer."
                fix = ("Run `w.report()` in the training process (it replays the capture), or `ampdoctor replay "
                       "RUN_DIR/captures/<step> --model pkg.mod:factory`.")
            return [Finding("overflow" if inf else "nan_origin", "error", phase, None, None, r.step,
                            f"The {where} became non-finite at step {r.step}, {msg}", fix, ev)]
    return []


_LOW_GRADS = ("float16", "bfloat16")


def _accumulated(r: StepRecord) -> Finding | None:
    """A step of several micro-batches whose gradients went non-finite with every loss finite, on a step without
    per-layer statistics, where the non-finite gradients are all of one module's fp16/bf16 parameters: their .grad
    is summed in that dtype, and the sum of finite micro-batch gradients passed its max (a pure fp16 model, a
    static loss scale, 32 micro-batches). A backward op that made inf would have sent it on to the modules below,
    whose parameters would hold it too."""
    if r.micro_batches < 2 or r.loss_finite is False or r.output_finite is False:
        return None
    bad = [p for p in r.params if p.grad_nonfinite]
    if not bad or any(p.dtype not in _LOW_GRADS for p in bad) or len({p.module for p in bad}) != 1:
        return None
    module, dt = bad[0].module, bad[0].dtype
    inf = all(p.grad_absmax == math.inf for p in bad)
    names = ", ".join(f"`{p.name}`" for p in bad[:4])
    return Finding(
        "overflow" if inf else "nan_origin", "error", "backward", module, None, r.step,
        f"The {dt} gradients of {names} became {'±inf' if inf else 'non-finite'} at step {r.step} while every loss "
        f"stayed finite, and no other parameter's did, over {r.micro_batches} micro-batches accumulated into "
        f"them: the sum of the micro-batches' gradients in the {dt} .grad passed {dt}'s max (a backward op that made "
        "inf would have sent it on to the layers below).",
        "Accumulate the gradients in fp32: keep fp32 master weights (`torch.autocast` with fp32 parameters and a "
        "GradScaler), or divide each micro-batch's loss by the number of micro-batches before backward (and keep the "
        "loss scale small enough for the sum), or train in bf16.",
        {"params": [p.name for p in bad][:20], "micro_batches": r.micro_batches, "dtype": dt, "accumulated": True,
         "capture": r.capture, "rank_hint": 11})


def _clean(r: StepRecord) -> bool:
    """Nothing of the step went non-finite where the loop sees it: loss, outputs, gradients, no skip, no crash."""
    return r.loss_finite is not False and r.output_finite is not False and not r.exception and not r.skipped \
        and r.grad_finite is not False


def absorbed_unsampled(run: RunData, located: set, device: str) -> list[Finding]:
    """A step without per-layer statistics whose always-on headroom series saw a module's fp16/bf16 output hold
    inf/NaN while the loss, the outputs and the gradients stayed finite and the update was applied: later ops
    absorbed it (a tanh soft-cap, a clamp). Named at the module whose output was the first of the forward to hold it
    (`first_bad` of StepRecord.headroom), once per module at its first such step; `info`, as the same event on a
    sampled step is (rules/origins.py). Not for a module whose output was never finite before (a mask module's
    -inf), nor one a sampled step already located (`located`)."""
    mods = run.meta.modules or []
    finite_before: set[int] = set()
    firsts: dict[int, list[StepRecord]] = {}
    for r in run.steps:
        h = r.headroom or {}
        fwd = h.get("fwd") or ()
        slot = h.get("first_bad")
        if isinstance(slot, int) and 0 <= slot < min(len(fwd), len(mods)) and not r.modules and _clean(r) \
                and (slot in finite_before or slot in firsts):
            firsts.setdefault(slot, []).append(r)
        for i, v in enumerate(fwd):
            if isinstance(v, (int, float)) and math.isfinite(v):
                finite_before.add(i)
    out = []
    for slot, recs in firsts.items():
        module, typ = mods[slot][0], mods[slot][1] if len(mods[slot]) > 1 else "?"
        if module in located:
            continue
        r = recs[0]
        v = r.headroom["fwd"][slot]
        nan = v != v
        dt = {"h": "float16", "b": "bfloat16"}.get((r.headroom.get("dtype") or "")[slot:slot + 1], "float16")
        at = f"`{module}`" if module else "`(root)`"
        out.append(Finding(
            "nan_origin" if nan else "overflow", "info", "forward", module, None, r.step,
            f"{at} ({typ}) was the first module whose {dt} output held {'NaN' if nan else '±inf'} at step {r.step}"
            f"{f' (and on {len(recs) - 1} later step(s))' if len(recs) > 1 else ''}, but later ops absorbed it: "
            "the loss, the outputs and the gradients stayed finite and the update was applied. The always-on "
            "headroom saw it; the step took no per-layer statistics.",
            "Nothing breaks while the loss stays finite, but the values past the dtype's max carry no gradient "
            "(a tanh or clamp after them saturates). To keep them, run the module in fp32 or rescale its input:\n"
            + fp32_snippet(module, device) + "\nTo see the exact op, save such a batch (`ampdoctor.save_batch`) "
            "and replay it, or watch with every=1.",
            {"absorbed": True, "source": "headroom", "steps": [x.step for x in recs][:50],
             "occurrences": len(recs), "type": typ, "dtype_out": dt, "rank_hint": 40}))
    return out
