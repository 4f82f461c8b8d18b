"""The loss computation outside the watched model as the producer of a step's inf/NaN: the loss went non-finite
while every module's output was finite (forward), or the gradient reaching the model's output was already
non-finite with a finite loss (backward: the loss's own backward, or the backward of the loss the model computes
itself). What the loss's own autograd ops say (StepRecord.loss_ops, loss_low, loss_consts) decides between an op
that overflowed and an operand from outside the model (a target, a loss weight) that held the inf/NaN. The
`producers` rule (ampdoctor/rules/origins.py) calls these."""
from __future__ import annotations

import math

from ..findings import Finding
from ..records import StepRecord
from .registry import RunData
from .backoff import benign_backoff
from .steps import onset_step

__all__ = ["nan_made_by_inf", "output_grad_nonfinite", "outside_model"]


def _only_neginf(s) -> bool:
    """-inf and finite values only, as a mask leaves them (every value -inf is no mask: s - log(inf))."""
    return s.neginf > 0 and s.posinf == 0 and s.nan == 0 and not (s.numel and s.neginf >= s.numel)


def output_grad_nonfinite(r: StepRecord) -> bool:
    """The gradient arriving at the model's output is non-finite although the forward ended finite, and no module
    inside the model made it: an output the model also consumes itself (a flow field returned and fed to the
    model's own smoothness term) gathers that module's backward inf/NaN into its gradient."""
    root = next((c for c in r.modules if c.depth == 0), None)
    if not (root is not None and root.gout is not None and not root.gout.finite and r.loss_finite is not False
            and r.output_finite is not False and (root.out is None or root.out.finite) and not r.forward_bad):
        return False
    p = r.backward_producer
    inner = p is not None and p.module and next(
        (c for c in r.modules if c.module == p.module and c.gout is not None and c.gout.finite), None)
    return not inner


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
        "Diagonal", "Trace", "Flip", "Roll", "Repeat", "Softplus", "Prod", "Cumprod"))


# ... and of those, the ones that can make an inf from finite values (a product, an exp, a sum of many)
_INF_FROM_FINITE = frozenset(
    f"{n}Backward" for n in ("Add", "Sub", "Rsub", "Mul", "Exp", "Exp2", "Expm1", "Sum", "Cumsum", "Mm", "Bmm",
                             "Addmm", "Dot", "Prod", "Cumprod"))


def _nan_through_inf(r: StepRecord) -> bool:
    """A NaN loss computed outside the model, from finite outputs, by ops none of which makes NaN from finite
    values (StepRecord.loss_ops), one of which can make inf."""
    return (r.loss is not None and math.isnan(r.loss) and bool(r.loss_ops)
            and all(op in _NO_NAN_FROM_FINITE for op in r.loss_ops)
            and any(op in _INF_FROM_FINITE for op in r.loss_ops))


def nan_made_by_inf(r: StepRecord) -> bool:
    """`_nan_through_inf` with every operand made in the graph: an inf came first — the loss computation
    overflowed."""
    return r.loss_consts is not True and _nan_through_inf(r)


def _nan_inf_or_operand(r: StepRecord) -> bool:
    """`_nan_through_inf`, but one of the ops took a tensor that needs no gradient (StepRecord.loss_consts): that
    value may have brought the NaN (an advantage normalised by a std of 0 whose eps vanished in fp16: 0 / 0), or
    an op overflowed first; the graph cannot tell which."""
    return r.loss_consts is True and _nan_through_inf(r)


_OP_HINTS = (("ExpBackward", "exp (past 11.09)"), ("PowBackward", "a power (a square past 255.9)"),
             ("LogBackward", "log (of a value that rounded to 0)"), ("DivBackward", "a division (by one that rounded "
                                                                                   "to 0)"),
             ("SumBackward", "sum (of many values)"), ("ProdBackward", "a product (of several values, e.g. losses)"),
             ("CumprodBackward", "a running product"))


def _ops_hint(r: StepRecord) -> str:
    """The loss computation's own ops, as autograd recorded them on this step (StepRecord.loss_ops), and those of
    them that make inf from finite fp16 values, unless the record says they all ran in fp32: where to look in the
    user's loss code."""
    if not r.loss_ops:
        return ""
    shown = r.loss_ops[:10]
    risky = [t for k, t in _OP_HINTS if k in shown] if r.loss_low is not False else []
    return (f" (its ops: {', '.join(o.removesuffix('Backward') for o in shown)}"
            + ("; of those, in fp16: " + ", ".join(risky) if risky else "") + ")")


_CONST_FIX = ("Compute the values the loss takes from the data in fp32 — advantages, normalisations, weights: "
              "`a = g.float(); adv = (a - a.mean()) / (a.std() + 1e-8)` (an eps of 1e-8 is 0 in fp16, and a std of 0 "
              "then gives 0 / 0) — check them with `torch.isfinite(adv).all()`, and compute the loss from "
              "`out.float()`.")


def _nan_from_operand(r: StepRecord) -> bool:
    """A NaN loss from finite outputs through ops that can neither make NaN nor inf from finite values (a cast,
    F.mse_loss, F.l1_loss): an operand from outside the model (a target, a weight) held NaN/inf."""
    return (r.loss is not None and math.isnan(r.loss) and bool(r.loss_ops)
            and all(op in _NO_NAN_FROM_FINITE for op in r.loss_ops)
            and not any(op in _INF_FROM_FINITE for op in r.loss_ops))


_EXP = frozenset({"ExpBackward", "Exp2Backward", "Expm1Backward"})


def _inf_from_operand(r: StepRecord) -> bool:
    """An inf loss from finite outputs through ops computed in fp32 or wider that make no inf from finite values of
    an fp16/bf16 model's range (a cast, F.mse_loss, F.l1_loss, a mean: no exp): an operand from outside the model
    (a target, a loss weight) held inf — a log of 0 or a division by zero in the data pipeline."""
    return (r.loss is not None and math.isinf(r.loss) and r.loss_low is False and bool(r.loss_ops)
            and all(op in _NO_NAN_FROM_FINITE and op not in _EXP for op in r.loss_ops))


_OPERAND_FIX = ("Check the targets and loss weights for inf/NaN before the loss (a log of 0, a division by a zero "
                "count or std in the data pipeline): `assert torch.isfinite(y).all(), idx`, and filter or repair "
                "the sample.")


def outside_model(run: RunData) -> list[Finding]:
    """The loss computation outside the watched model as the producer: the loss went non-finite although every
    module's output was finite (forward), or the gradient reaching the model's output was already non-finite
    although the loss was finite (backward: the loss's own backward, e.g. a manual loss scale too large for fp16
    or an fp16 cast of the loss gradient)."""
    out_bwd = [r for r in run.steps if output_grad_nonfinite(r)]
    backoff = benign_backoff(run.steps, run.has_scaler, growth_factor=run.growth_factor)
    benign = bool(out_bwd) and all(r.step in backoff for r in out_bwd)
    for r in run.steps:
        p = r.forward_producer
        if r.step in backoff and r.loss_finite is False:
            continue  # the loss scale itself made the loss non-finite in the first search (steps.scaled_loss_steps)
        # every module's output finite (sampled), or, on a routine step, the model's own outputs (checked every step)
        outputs_finite = (not any(c.out is not None and not c.out.finite and not _only_neginf(c.out)
                                  for c in r.modules) if r.sampled and r.modules else
                          not r.modules and r.output_finite is True and not r.bad_input)
        if r.loss_finite is False and outputs_finite and (p is None or p.detail.get("mask_like")):
            inf = r.loss is not None and math.isinf(r.loss)
            via_inf = nan_made_by_inf(r)
            step = onset_step(run.steps, r.step, "forward")  # the first bad step, when only the trip-wire saw it
            ev = {"loss": r.loss, "rank_hint": 11}
            if r.loss_ops:
                ev["loss_ops"] = r.loss_ops[:30]
            if step != r.step:
                ev["observed_step"] = r.step
            nan_op = _nan_from_operand(r)
            operand = nan_op or _inf_from_operand(r)
            hidden = not operand and _nan_inf_or_operand(r)
            if operand or hidden:
                ev["operand"] = True if operand else "possible"
            return [Finding("overflow" if inf or via_inf else "nan_origin", "error", "forward", None, None, step,
                            f"The loss became {'inf' if inf else 'NaN'} outside the watched model (in the loss "
                            "computation) while the model's outputs were finite" + (
                                "; none of its ops makes NaN from finite values, so one of them overflowed to inf "
                                "first (then inf - inf or 0 * inf made the NaN)." if via_inf else
                                f" ({', '.join(r.loss_ops[:3])}); these ops make neither NaN nor inf from finite "
                                "values, so an operand from outside the model — the target or a loss weight — held "
                                "NaN/inf." if nan_op else
                                f" ({', '.join(r.loss_ops[:3])}); computed in fp32, these ops make no inf from "
                                "finite values of the model's range, so an operand from outside the model — the "
                                "target or a loss weight — held inf." if operand else
                                f" ({', '.join(r.loss_ops[:3])}); these ops make NaN from finite values only through "
                                "an inf, and one of them takes a tensor that needs no gradient (an advantage, a target "
                                "or a weight computed outside the model): that value may have held the NaN itself "
                                "(a 0 / 0 in its own computation, e.g. a std of 0 plus an eps that vanishes in fp16), "
                                "or an op overflowed to inf first." if hidden else _ops_hint(r) + "."),
                            _OPERAND_FIX if operand else _CONST_FIX if hidden else
                            "Compute the loss in fp32 (`loss_fn(out.float(), y)`) and use the stable form "
                            "(logsumexp, log_softmax, BCEWithLogits); sums of many fp16 values overflow.", ev)]
        if output_grad_nonfinite(r) and not benign:
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
                            "watched model, overflowed (" + (
                                f"at loss scale {r.scale:g}: a loss summed over many values, or its gradient cast "
                                "to fp16)." if r.scale else
                                "e.g. a hand-made loss scale too large for fp16, or the loss gradient cast to "
                                "fp16)."),
                            ("Keep one GradScaler for the whole run (made before the loop), so that it backs off "
                             "when the scaled gradients overflow; average the loss instead of summing it."
                             if r.scale else
                             "Use torch.amp.GradScaler (it backs off when the scaled gradients overflow) instead of "
                             "a fixed multiplier, and compute the loss from `out.float()`."),
                            {"loss": r.loss, "loss_scale": r.scale, "nonfinite_in": root.gout.nonfinite,
                             "rank_hint": 13})]
    return []
