"""Where an inf/NaN came from: the `producers` rule (overflow, nan_origin) over the module-level producers of
each bad step, and the origins that are not a module's forward or backward: the loss computed outside the model,
the loss's own backward, weights an earlier update wrote, and a bad step without per-layer statistics."""
from __future__ import annotations

import math

from ..findings import Finding
from ..records import ACCUMULATING, ModuleCall, StepRecord
from .registry import RuleConfig, RunData, register
from ..fixes import fp32_snippet
from .steps import absorbed, benign_backoff, onset_step


def autocast_device(run: RunData) -> str:
    """The autocast device of the run ("cuda" unless it ran on the CPU)."""
    ac = next((r.autocast for r in run.steps if r.autocast), None)
    return ac.split(":")[0] if ac else ("cpu" if (run.meta.env or {}).get("device", "cpu") == "cpu" else "cuda")


def _call(rec: StepRecord, module: str, call: int) -> ModuleCall | None:
    return next((c for c in rec.modules if c.module == module and c.call == call), None)


def where(module: str | None) -> str:
    """A module as a message names it: `name`, `(root)` for the model itself, "outside the model" for None."""
    return "outside the model" if module is None else f"`{module}`" if module else "`(root)`"


def _what_inf(s) -> str:
    """The non-finite values a TensorStats holds, in words: +inf, -inf, ±inf, NaN."""
    if s is None:
        return "inf/NaN"
    if s.posinf and s.neginf:
        return "±inf"
    if s.posinf or s.neginf:
        return "+inf" if s.posinf else "-inf"
    return "NaN" if s.nan else "inf/NaN"


def _evidence(c: ModuleCall | None, phase: str, rec: StepRecord) -> dict:
    ev: dict = {"call": c.call if c else None, "type": c.type if c else None}
    if c is None:
        return ev
    a, b = (c.inp, c.out) if phase == "forward" else (c.gout, c.gin)
    if a is not None:
        ev["absmax_in"] = a.absmax
        ev["nonfinite_in"] = a.nonfinite
    if b is not None:
        ev["absmax_out_finite"] = b.absmax
        ev.update({"nan_out": b.nan, "posinf_out": b.posinf, "neginf_out": b.neginf, "numel_out": b.numel,
                   "dtype_out": b.dtype, "ref": b.ref})
    if c.autocast:
        ev["autocast"] = c.autocast
    if phase == "backward" and rec.scale:
        ev["loss_scale"] = rec.scale
    return ev


def _inside(module: str, name: str) -> bool:
    return name != module and (module == "" or name.startswith(module + "."))


def _kind(r: StepRecord, p) -> str:
    """The producer's kind, 'nan' read as 'inf' where the NaN was made from an inf this module itself made: a
    module inside it already received ±inf (forward: as an input; backward: as its incoming gradient), e.g. a
    custom autograd Function's backward overflowing before a Linear's backward turned the inf into inf - inf."""
    if p.kind != "nan" or p.module is None:
        return p.kind
    for c in r.modules:
        if _inside(p.module, c.module):
            s = c.inp if p.phase == "forward" else c.gout
            if s is not None and (s.posinf or s.neginf):
                return "inf"
    return p.kind


@register("producers", emits=("overflow", "nan_origin"))
def producers(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """The first inf/NaN producer of each bad step, grouped by (phase, module, kind)."""
    groups: dict[tuple, list[StepRecord]] = {}
    for r in run.steps:
        for p in (r.forward_producer, r.backward_producer):
            if p is None or (p.phase == "backward" and (r.loss_finite is False or r.output_finite is False
                                                        or _output_grad_nonfinite(r))):
                continue  # the backward of a non-finite loss/output/output gradient: a consequence
            groups.setdefault((p.phase, p.module, _kind(r, p)), []).append(r)
    # NaN in the backward from a module whose backward made inf at or before that step: inf - inf / 0 * inf of
    # its own overflow, the same cause (one finding, not an overflow and a later nan_origin)
    for (phase, module, kind) in [k for k in groups if k[2] == "nan" and k[0] == "backward"]:
        inf = groups.get((phase, module, "inf"))
        if inf and inf[0].step <= groups[(phase, module, kind)][0].step:
            del groups[(phase, module, kind)]
    out = []
    outside = _outside_model(run)
    benign = benign_backoff(run.steps, run.has_scaler)
    dev = autocast_device(run)
    for (phase, module, kind), recs in groups.items():
        r0 = recs[0]
        p = r0.forward_producer if phase == "forward" else r0.backward_producer
        c = _call(r0, module, p.call)
        steps = [r.step for r in recs]
        rule = "overflow" if kind == "inf" else "nan_origin"
        if kind == "nan" and phase == "forward" and c is not None and c.type in ACCUMULATING \
                and c.inp is not None and c.inp.finite:
            rule = "overflow"  # a matmul/conv of finite values makes NaN only as inf - inf: its sums overflowed
        ev = _evidence(c, phase, r0)
        ev.update({"steps": steps[:50], "occurrences": len(steps), "rank_hint": 10 if phase == "forward" else 12})
        step = onset_step(run.steps, r0.step, phase)  # the first bad step, when only the trip-wire saw it
        if step != r0.step:
            ev["observed_step"] = r0.step
        at = where(module)
        typ = c.type if c else p.detail.get("type", "?")
        vals = _what_inf(c.out if c and phase == "forward" else c.gin if c else None)
        if kind == "inf" and vals == "NaN":
            vals = "±inf (NaN by the time it left)"
        if vals == "inf/NaN":
            vals = "±inf" if kind == "inf" else "NaN"
        sev = "error"
        if phase == "forward" and (absorbed(recs) or p.detail.get("mask_like") and outside):
            sev = "info"
            ev["rank_hint"] = 40
            ev["absorbed"] = True
            msg = (f"{at} ({typ}) emits {'-inf' if p.detail.get('mask_like') else vals} "
                   f"from finite inputs (first at step {r0.step}), but later ops absorb it: the loss and the "
                   "outputs stayed finite" + (" — an additive -inf mask before a softmax does this "
                                                        "by design." if p.detail.get("mask_like") else "."))
            fix = ("Nothing to do while the loss stays finite. A row that is masked entirely turns softmax into NaN; "
                   "a large finite negative value representable in the dtype (torch.finfo(dtype).min) avoids that.")
        elif phase == "backward" and all(s in benign for s in steps):
            sev = "info"
            ev["rank_hint"] = 40
            ev["benign_backoff"] = True
            msg = (f"The loss-scaled backward overflowed in {at} on {len(steps)} step(s) while the loss scale was "
                   "high; GradScaler skipped them and lowered the scale, as designed.")
            fix = "Nothing to do: a few skipped steps while the loss scale settles are normal."
        elif phase == "forward":
            what = (f"turned finite inputs into {vals}" if kind == "inf" else
                    "produced NaN from finite inputs — its sums of products overflowed (inf - inf = NaN)"
                    if rule == "overflow" else "produced NaN from NaN-free inputs")
            seen = f" (seen on sampled step {r0.step})" if step != r0.step else ""
            msg = (f"{at} ({typ}) {what} in the forward pass at step {step}{seen}"
                   f"{' (' + c.autocast + ' autocast)' if c and c.autocast else ''}; everything after it only "
                   "passed the non-finite values on.")
            fix = ("Keep this module in fp32 or rescale before the operation that overflows, e.g.\n"
                   + fp32_snippet(module, dev)
                   + ("\nRun `ampdoctor replay` on the capture to see the exact op."
                      if any(r.capture for r in run.steps)
                      else "\nTo see the exact op, save a failing batch (`ampdoctor.save_batch`) and replay it.")
                   + " bf16 has fp32's range.")
        else:
            what = f"turned a finite incoming gradient into {vals}" if kind == "inf" else \
                "produced NaN gradients from a NaN-free incoming gradient"
            msg = (f"In the backward pass {at} ({typ}) {what} at step {step}"
                   f"{', on every step' if len(steps) > 2 else ''}; the forward was finite.")
            fix = ("Find the op whose derivative is unbounded here (log/log1p/sqrt/div/pow near 0, norms of tiny "
                   "vectors) and guard it with an epsilon representable in the working dtype, or run the module "
                   "in fp32:\n" + fp32_snippet(module, dev))
        out.append(Finding(rule, sev, phase, module, None, step, msg, fix, ev))
    out.extend(outside)
    data = _bad_data(run)
    out.extend(data)
    if not groups and not out:
        out.extend(_bad_weights(run) or _unlocated(run))
    return out


def _bad_weights(run: RunData) -> list[Finding]:
    """Weights that were already non-finite when a step began: no module of the step produced the inf/NaN (a
    module holding bad weights is not blamed for its output); the optimizer step before wrote them."""
    prev = None
    for r in run.steps:
        bad = [c for c in r.modules if c.par is not None and not c.par.finite]
        if bad:
            # inf weights before NaN ones (an inf update makes NaN downstream on the next step, not the reverse),
            # then the first in forward order
            c = min(bad, key=lambda c: (bool(c.par.nan), c.seq))
            kind = "NaN" if c.par.nan else "inf"
            made = _applied_bad_gradients(prev, {b.module for b in bad}, kind)
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
                "nan_origin" if kind == "NaN" else "overflow", "error", "optimizer", c.module, None, r.step,
                f"The weights of `{c.module}` ({c.type}) were already {kind} when step {r.step} began: "
                f"{before}{grads} wrote them. The modules after it only passed the values on.",
                "Look at that update: a NaN/inf gradient stepped without a GradScaler (use "
                "`clip_grad_norm_(..., error_if_nonfinite=True)` or skip such steps), a learning rate that "
                "overflows fp16 weights, or Adam's eps vanishing in fp16 parameters (keep fp32 master weights).",
                {"type": c.type, "weights": "nan" if c.par.nan else "inf", "modules": [b.module for b in bad][:20],
                 "previous_step": prev.step if prev is not None else None, "rank_hint": 12})]
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


def _bad_data(run: RunData) -> list[Finding]:
    """The first step whose batch already held inf/NaN when the model received it: no module produced it."""
    r = next((r for r in run.steps if r.bad_input), None)
    return [bad_data_finding(r.bad_input, r.step, r.capture)] if r is not None else []


def bad_data_finding(b: dict, step: int | None, capture: str | None) -> Finding:
    """nan_origin (overflow for ±inf only) outside the model: input `b` (tensors.nonfinite_input) of a batch."""
    nan = b.get("nan", 0)
    arg = b.get("arg")
    name = f"argument {arg}" if isinstance(arg, int) else f"`{arg}`"
    vals = ", ".join(f"{n} {w}" for n, w in ((nan, "NaN"), (b.get("posinf", 0), "+inf"), (b.get("neginf", 0), "-inf"))
                     if n)
    return Finding(
        "nan_origin" if nan else "overflow", "error", "forward", None, None, step,
        f"The batch of step {step} already held {vals} (model input {name}, {b.get('numel')} {b.get('dtype')} "
        "values) when the model received it: the data, not a layer, brought the non-finite values; every module "
        "after it only passed them on.",
        "Find the bad sample in the data pipeline (a division by a zero std in normalisation, a corrupt record, an "
        "fp16 cast of values past 65504) and filter or repair it; a guard in the loop: "
        "`assert torch.isfinite(x).all(), idx`.",
        {"input": arg, "nan": nan, "posinf": b.get("posinf", 0), "neginf": b.get("neginf", 0),
         "numel": b.get("numel"), "dtype": b.get("dtype"), "capture": capture, "rank_hint": 9})


def _unlocated(run: RunData) -> list[Finding]:
    """A step whose loss (or, without a scaler, whose gradients) went non-finite on a step without per-layer
    statistics: say so, so that the step's capture is replayed to locate the op."""
    for r in run.steps:
        if r.bad_input:
            continue  # the data brought it (_bad_data)
        if r.loss_finite is False or r.output_finite is False or (not run.has_scaler and r.grad_finite is False):
            inf = r.loss is not None and math.isinf(r.loss)
            where = ("loss" if r.loss_finite is False else "model's output" if r.output_finite is False
                     else "gradients")
            inf = inf or (where == "loss" and r.output_finite is not False and _nan_made_by_inf(r))
            return [Finding(
                "overflow" if inf else "nan_origin", "error", "backward" if where == "gradients" else "forward", None,
                None, r.step, f"The {where} became non-finite at step {r.step}, a step without per-layer statistics; "
                "replay its capture (`ampdoctor replay`) or watch with every=1 to name the layer.",
                "Run `w.report()` in the training process (it replays the capture), or `ampdoctor replay "
                "RUN_DIR/captures/<step> --model pkg.mod:factory`.",
                {"loss": r.loss, "capture": r.capture, "unlocated": True, "rank_hint": 11})]
    return []


def _only_neginf(s) -> bool:
    return s.neginf > 0 and s.posinf == 0 and s.nan == 0


def _output_grad_nonfinite(r: StepRecord) -> bool:
    """The gradient arriving at the model's output is non-finite although the forward ended finite."""
    root = next((c for c in r.modules if c.depth == 0), None)
    return (root is not None and root.gout is not None and not root.gout.finite and r.loss_finite is not False
            and r.output_finite is not False and (root.out is None or root.out.finite) and not r.forward_bad)


# autograd nodes (names without their trailing number) whose op cannot make NaN from finite inputs: a NaN out of a
# loss computation made of these alone came from an inf one of them made first (exp, a product, a sum overflowing;
# then inf - inf, 0 * inf or log_softmax of +inf): an overflow. div, sqrt, log, pow and unknown ops can make NaN
# from finite values, and leave the question open
_NO_NAN_FROM_FINITE = frozenset(
    f"{n}Backward" for n in (
        "Add", "Sub", "Rsub", "Mul", "Neg", "Exp", "Exp2", "Expm1", "Sum", "Mean", "Max", "Min", "Amax", "Amin",
        "ToCopy", "View", "UnsafeView", "ReshapeAlias", "T", "Transpose", "Permute", "Expand", "Squeeze",
        "Unsqueeze", "Slice", "Select", "Index", "Cat", "Stack", "Clone", "Mm", "Bmm", "Addmm", "Dot", "LogSoftmax",
        "Softmax", "NllLoss", "NllLoss2D", "MseLoss", "L1Loss", "SmoothL1Loss", "HuberLoss",
        "BinaryCrossEntropyWithLogits", "Abs", "Relu", "Gelu", "Sigmoid", "Tanh", "Silu", "Clamp", "ClampMin",
        "ClampMax", "Logsumexp", "Cumsum", "Where", "MaskedFill", "Gather", "Split", "SplitWithSizes", "Unbind",
        "Diagonal", "Trace", "Flip", "Roll", "Repeat", "Softplus"))


# ... and of those, the ones that can make an inf from finite values (a product, an exp, a sum of many)
_INF_FROM_FINITE = frozenset(
    f"{n}Backward" for n in ("Add", "Sub", "Rsub", "Mul", "Exp", "Exp2", "Expm1", "Sum", "Cumsum", "Mm", "Bmm",
                             "Addmm", "Dot"))


def _nan_made_by_inf(r: StepRecord) -> bool:
    """A NaN loss computed outside the model, from finite outputs, by ops none of which makes NaN from finite
    values (StepRecord.loss_ops), one of which can make inf: an inf came first — the loss computation overflowed."""
    return (r.loss is not None and math.isnan(r.loss) and bool(r.loss_ops)
            and all(op in _NO_NAN_FROM_FINITE for op in r.loss_ops)
            and any(op in _INF_FROM_FINITE for op in r.loss_ops))


def _nan_from_operand(r: StepRecord) -> bool:
    """A NaN loss from finite outputs through ops that can neither make NaN nor inf from finite values (a cast,
    F.mse_loss, F.l1_loss): an operand from outside the model (a target, a weight) held NaN/inf."""
    return (r.loss is not None and math.isnan(r.loss) and bool(r.loss_ops)
            and all(op in _NO_NAN_FROM_FINITE for op in r.loss_ops)
            and not any(op in _INF_FROM_FINITE for op in r.loss_ops))


def _outside_model(run: RunData) -> list[Finding]:
    """The loss computation outside the watched model as the producer: the loss went non-finite although every
    module's output was finite (forward), or the gradient reaching the model's output was already non-finite
    although the loss was finite (backward: the loss's own backward, e.g. a manual loss scale too large for fp16
    or an fp16 cast of the loss gradient)."""
    out_bwd = [r for r in run.steps if _output_grad_nonfinite(r)]
    benign = bool(out_bwd) and all(r.step in benign_backoff(run.steps, run.has_scaler) for r in out_bwd)
    for r in run.steps:
        p = r.forward_producer
        # every module's output finite (sampled), or, on a routine step, the model's own outputs (checked every step)
        outputs_finite = (not any(c.out is not None and not c.out.finite and not _only_neginf(c.out)
                                  for c in r.modules) if r.sampled and r.modules else
                          not r.modules and r.output_finite is True and not r.bad_input)
        if r.loss_finite is False and outputs_finite and (p is None or p.detail.get("mask_like")):
            inf = r.loss is not None and math.isinf(r.loss)
            via_inf = _nan_made_by_inf(r)
            step = onset_step(run.steps, r.step, "forward")  # the first bad step, when only the trip-wire saw it
            ev = {"loss": r.loss, "rank_hint": 11}
            if r.loss_ops:
                ev["loss_ops"] = r.loss_ops[:30]
            if step != r.step:
                ev["observed_step"] = r.step
            return [Finding("overflow" if inf or via_inf else "nan_origin", "error", "forward", None, None, step,
                            f"The loss became {'inf' if inf else 'NaN'} outside the watched model (in the loss "
                            "computation) while the model's outputs were finite" + (
                                "; none of its ops makes NaN from finite values, so one of them overflowed to inf "
                                "first (then inf - inf or 0 * inf made the NaN)." if via_inf else
                                f" ({', '.join(r.loss_ops[:3])}); these ops make neither NaN nor inf from finite "
                                "values, so an operand from outside the model — the target or a loss weight — held "
                                "NaN/inf." if _nan_from_operand(r) else "."),
                            "Compute the loss in fp32 (`loss_fn(out.float(), y)`) and use the stable form "
                            "(logsumexp, log_softmax, BCEWithLogits); sums of many fp16 values overflow.", ev)]
        if _output_grad_nonfinite(r) and not benign:
            root = next(c for c in r.modules if c.depth == 0)
            nan = root.gout.nan > 0 and root.gout.posinf + root.gout.neginf == 0
            if r.loss_in_model:  # the model computed its own loss (HF's `.loss`): that backward is the root's
                return [Finding("nan_origin" if nan else "overflow", "error", "backward", "", None, r.step,
                                f"The backward of the loss the model computes in its own forward (its `.loss`) "
                                f"made the gradient of the model's outputs {'NaN' if nan else 'inf'} at step "
                                f"{r.step}, with a finite loss ({r.loss:.4g}): at this loss scale its gradient "
                                "exceeds the fp16 range before any layer is reached (a loss summed over many "
                                "values, or targets far larger than the outputs).",
                                "Scale the targets (or the loss) down, average instead of summing, and let "
                                "GradScaler back off; compute the loss from `logits.float()` outside the model "
                                "when it must stay large.",
                                {"loss": r.loss, "loss_scale": r.scale, "nonfinite_in": root.gout.nonfinite,
                                 "loss_in_model": True, "rank_hint": 13})]
            return [Finding("nan_origin" if nan else "overflow", "error", "backward", None, None, r.step,
                            f"The gradient reaching the model's output was already {'NaN' if nan else 'inf'} at "
                            f"step {r.step}, with a finite loss: the loss computation's own backward, outside the "
                            "watched model, overflowed (e.g. a hand-made loss scale too large for fp16, or the "
                            "loss gradient cast to fp16).",
                            "Use torch.amp.GradScaler (it backs off when the scaled gradients overflow) instead of "
                            "a fixed multiplier, and compute the loss from `out.float()`.",
                            {"loss": r.loss, "loss_scale": r.scale, "nonfinite_in": root.gout.nonfinite,
                             "rank_hint": 13})]
    return []
