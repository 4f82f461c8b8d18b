"""Turn what a replay observed (op events, constant events, shadow rows, fix search) into ranked Findings.

Order: constants that caused the failure, then the origin op, then warnings. Ops that only pass the problem
on (the first NaN after an overflow, the gradients of non-finite activations) are consequences: they are listed
under their origin (`evidence["consequences"]`), never as findings of their own; a backward producer whose
inputs were finite while the forward failed elsewhere in another way stays an origin of its own. A backward
overflow that a lower loss scale removes is GradScaler's normal search (`info`, `evidence["scaler_search"]`).
A replay that could not run (the forward raised, no constant explains it) is one `replay_error` (`info`).
Fix texts are keyed by op and evidence (attention scores = a matmul whose output a softmax normalises), never
by module name; every snippet comes from `ampdoctor.fixes`. `evidence["rank_hint"]` keeps the order.
"""
from __future__ import annotations

import math

from ..findings import Finding
from ..fixes import fp32_snippet, module_label, modules_related
from .constants import is_mask_like
from .opevent import OpEvent

__all__ = ["needs_fp32_check", "build_findings", "chain"]

_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addmv", "mv", "_scaled_dot_product_attention_math",
           "_scaled_dot_product_flash_attention_for_cpu", "convolution", "_convolution", "einsum"}
_POLES = {"log", "log1p", "log2", "log10", "div", "reciprocal", "rsqrt", "pow", "digamma", "atanh"}
_MASK_CAPABLE = {"add", "sub", "rsub", "_to_copy", "where", "copy_", "masked_fill", "cat", "mul"}
_MAX = {"float16": 65504.0, "bfloat16": 3.39e38, "float32": 3.4e38}


def _where(module: str | None) -> str:
    return "the model" if module is None else f"`{module_label(module)}`"


def attention_scores(ev: OpEvent, softmax_inputs: list) -> bool:
    """Evidence that `ev` computed attention scores: a forward matmul whose output shape is what a later forward
    softmax normalised (q @ kᵀ → softmax), or an op inside F.scaled_dot_product_attention."""
    if ev.phase != "forward" or ev.op.split("::")[-1] not in _MATMUL:
        return False
    if ev.in_sdpa:
        return True
    return any(seq > ev.seq and list(shape) == list(ev.out_shape) for seq, _, shape in softmax_inputs)


def _at_pole(ev: OpEvent) -> bool:
    """A forward op whose inputs sat at its singular point (log/div/rsqrt of 0, log1p of -1)."""
    return ev.phase == "forward" and ev.op.split("::")[-1] in _POLES and ev.in_zeros > 0


def _inf_sign(ev: OpEvent) -> str:
    """"+inf", "-inf" or "±inf" as the op's output had them (the words follow the values)."""
    pos, neg = ev.out_posinf > 0, ev.out_neginf > 0
    return "+inf" if pos and not neg else "-inf" if neg and not pos else "±inf"


def _op_text(ev: OpEvent, device: str, softmax_inputs: list = (), sdpa_used: bool = False) -> tuple[str, str]:
    short = ev.op.split("::")[-1]
    where = _where(ev.module)
    inf = "NaN" if ev.kind == "nan_origin" else _inf_sign(ev)
    lim = _MAX.get(ev.out_dtype or "", 65504.0)
    snip = fp32_snippet(ev.module, device)
    if ev.phase == "backward" and ev.kind == "overflow" and (short in _MATMUL or short == "convolution_backward"):
        node = ev.autograd_node or ev.op
        msg = (f"the backward of {node} in {where} ({ev.op}) overflowed {ev.out_dtype}: finite values (max |x| = "
               f"{ev.absmax_in:.4g}) gave {inf} (max {lim:g}) - a product of this layer's inputs and the gradient "
               "from above, summed over the batch (its weight gradient) or over its outputs (its input gradient), "
               "at this loss scale")
        fix = ("GradScaler backs off from such an overflow by itself; when it persists at every scale, the values "
               "entering this layer are too large: scale the data or put a norm layer before it, average the loss "
               "rather than summing it, or run this layer in fp32:\n" + snip)
        return msg, fix
    if ev.phase == "backward":
        node = ev.autograd_node or ev.op
        msg = (f"the backward of {node} in {where} ({ev.op}) produced {inf} from finite gradients: the gradient "
               f"of this op is not finite at the values the forward produced")
        fix = ("guard the forward op's singular point in a way that survives the low-precision dtype (an eps/clamp "
               "that is representable in it, e.g. `p.clamp(max=1 - torch.finfo(p.dtype).eps)`), or compute this "
               "op in fp32:\n" + snip)
        return msg, fix
    if ev.kind == "overflow" and short in _MATMUL:
        msg = (f"{ev.op} in {where} overflowed {ev.out_dtype}: finite inputs (max |x| = {ev.absmax_in:.4g}) gave "
               f"{inf} (max {lim:g})")
        if ev.in_sdpa:
            msg += " inside F.scaled_dot_product_attention"
            fix = ("the attention scores exceed the dtype's range even with SDPA's own 1/sqrt(d) scaling: check the "
                   "size of q and k (a wrong `scale=`, q/k norms that grew), use bf16, or run the attention in fp32 "
                   "(cast q, k, v with `.float()` and the output back):\n" + snip)
        elif attention_scores(ev, softmax_inputs):
            fix = ("these are attention scores (a softmax normalises them next): scale q by 1/sqrt(d) before q @ kᵀ"
                   + ("" if sdpa_used else " (or use F.scaled_dot_product_attention, which scales inside)")
                   + ", or compute the scores and softmax in fp32:\n" + snip)
        else:
            fix = (f"this layer's output exceeds the {ev.out_dtype} range: run it in fp32, use bf16, or rescale its "
                   "input or weights (a weight or activation that grew: check the learning rate and warmup); HF T5 "
                   "clamps such outputs (`x = torch.clamp(x, -65504 + 1000, 65504 - 1000)`):\n" + snip)
        return msg, fix
    low = ("float16", "bfloat16")
    if ev.kind == "overflow" and short == "_to_copy" and ev.out_dtype in low and ev.in_dtypes \
            and not any(d in low for d in ev.in_dtypes) and not is_mask_like(ev.absmax_in):
        # a value made in fp32 (an fp32 op under autocast, a learned scale's exp) cast into a low-precision op's
        # input: autocast's cast (or a .half()/.to()) is where it turns inf (a mask constant's cast: the mask text)
        msg = (f"{ev.op} in {where} cast finite {'/'.join(ev.in_dtypes)} values (max |x| = {ev.absmax_in:.4g}) to "
               f"{ev.out_dtype}, whose max is {lim:g}: they became {inf}. The value was computed in fp32 and is too "
               "large for the low-precision op it feeds (autocast casts that op's inputs; .half()/.to() does the same)")
        fix = ("bound or rescale the value before that op (a learned scale or temperature: clamp it, as CLIP clamps "
               "`logit_scale.exp()` at 100; normalise what it multiplies), or run the op that takes it in fp32:\n"
               + snip)
        return msg, fix
    if ev.kind == "overflow" and short == "pow" and ev.scalar_base is not None and abs(ev.scalar_base) > 1:
        # c ** x: an exponential written as a power (decibels to amplitude, 2 ** x, mu-law's (1 + mu) ** |y|)
        c = ev.scalar_base
        edge = math.log(lim) / math.log(abs(c))  # (lim: the dtype's max, _MAX)
        msg = (f"{ev.op} in {where} overflowed {ev.out_dtype}: {c:g} ** x with x up to {ev.absmax_in:.4g} "
               f"({ev.out_dtype} holds {c:g} ** x only for x < {edge:.3g}) — an exponential written as a power")
        fix = (f"compute it in fp32 (`torch.pow({c:g}, x.float())`), keep the exponent in its range (`x.clamp(max="
               f"{edge:.3g})`), or stay in the log domain (decibels, log-amplitudes) until the value is needed:\n"
               + snip)
        return msg, fix
    e = ev.scalar_exponent
    if ev.kind == "overflow" and short == "pow" and e is not None and e < 0 and not _at_pole(ev) \
            and ev.absmin_in is not None:
        # x ** -p: the small values overflow (an inverse weight, 1 / sigma**2, 1 / snr)
        edge = lim ** (1.0 / e)
        msg = (f"{ev.op} in {where} overflowed {ev.out_dtype}: x ** {e:g} with |x| down to {ev.absmin_in:.3g} "
               f"({ev.out_dtype} holds |x| ** {e:g} only for |x| > {edge:.3g}) — a negative power of a small value "
               "(an inverse weight such as 1 / sigma**2)")
        fix = (f"take the power in fp32 (`x.float() ** {e:g}`) and bound it: clamp x from below "
               f"(`x.clamp(min={edge:.2g})`) or clamp the weight it makes; or run the module in fp32:\n" + snip)
        return msg, fix
    if ev.kind == "overflow" and short == "pow" and not _at_pole(ev):  # (x ** -0.5 at 0: the pole text below)
        p = e if e is not None and e > 0 else 2.0
        ps = f"{p:g}"
        edge = lim ** (1.0 / p)
        sq = f"in {'bf16' if str(ev.out_dtype) == 'bfloat16' else 'fp16'} x**{ps} is inf for |x| > {edge:.4g}"
        msg = (f"{ev.op} in {where} overflowed {ev.out_dtype} (input up to {ev.absmax_in:.4g}; {sq})"
               + (" — a variance or norm computed in low precision" if p == 2.0 else ""))
        fix = ("compute the statistic in fp32, as HF's RMSNorm does: `var = x.float().pow(2).mean(-1, keepdim=True)`,"
               " or run the module in fp32:\n" + snip)
        return msg, fix
    if ev.kind == "overflow" and short in ("exp", "exp2", "expm1", "sinh", "cosh"):
        lim = {"bfloat16": ("bf16", 88.7), "float32": ("fp32", 88.7)}.get(str(ev.out_dtype), ("fp16", 11.09))
        msg = (f"{ev.op} in {where} overflowed {ev.out_dtype} (input up to {ev.absmax_in:.4g}; {lim[0]} exp(x) is inf "
               f"for x > {lim[1]})")
        fix = ("compute it stably: torch.logsumexp(x, dim) instead of log(sum(exp(x))), F.log_softmax / "
               "F.cross_entropy for losses, or subtract the max before exp; or run it in fp32: "
               "`torch.exp(x.float())`")
        return msg, fix
    if _at_pole(ev):
        msg = f"{ev.op} in {where} hit its singular point (an input is 0 / -1) and produced {inf}"
        fix = ("keep the argument away from the singularity with an eps that exists in the working dtype "
               "(fp16's smallest normal is 6.1e-5), or compute this op in fp32:\n" + snip)
        return msg, fix
    msg = f"{ev.op} in {where} produced {inf} from {'finite' if ev.kind == 'overflow' else 'NaN-free'} inputs"
    fix = "compute this op in fp32, or remove the source of the inf upstream:\n" + snip
    return msg, fix


def _custom_fn_hint(device: str) -> str:
    """The op ran with autograd off inside the forward: most often a custom torch.autograd.Function, which
    autocast hands low-precision inputs unless its forward says otherwise."""
    return ("\n\nThis op ran with autograd off inside the forward — inside a custom `torch.autograd.Function` (or "
            "a `no_grad` block). Autocast hands such a Function low-precision inputs; declare what it needs:\n"
            f"@torch.amp.custom_fwd(device_type=\"{device}\", cast_inputs=torch.float32)\n"
            "def forward(ctx, x): ...\n"
            f"@torch.amp.custom_bwd(device_type=\"{device}\")\n"
            "def backward(ctx, grad): ...")


def needs_fp32_check(findings: list[Finding]) -> bool:
    """A forward origin at a singular point (log/div/rsqrt of zeros): only a run in fp32 (the fix search) tells
    an underflow to zero from a real zero."""
    return any(f.phase == "forward" and f.rule == "overflow" and f.evidence.get("pole_zeros_in") for f in findings)


def _pole_underflow(e: OpEvent, fix: dict | None, device: str, step, severity: str, rank_hint: int) -> Finding | None:
    """The zeros a forward log/div/rsqrt turned into inf were values that underflowed (or rounded) to exactly 0
    in the low-precision dtype — a saturated sigmoid's 1 - p, a softmax probability below fp16's smallest
    subnormal — when the fix search made the step finite in fp32 (in fp32 they are not zero). An `underflow`
    finding beside the op's own: shared/FP16.md lists these under underflow."""
    if not _at_pole(e):
        return None
    if not (fix and fix.get("found")):
        return None  # zero in fp32 too: a real singular point, not a precision effect
    dt = next((d for d in (e.in_dtypes or []) if d in ("float16", "bfloat16")), None)
    if dt is None and e.in_dtypes:
        return None  # the op's inputs were fp32 already: its zeros are zeros in fp32 (the fix search cured another op)
    dt = dt or "float16"
    mods = ", ".join(f"`{module_label(m)}`" for m in fix.get("modules") or []) or _where(e.module)
    msg = (f"the zeros that {e.op} in {_where(e.module)} turned into {_inf_sign(e)} are not zero in fp32 (running "
           f"{mods} in fp32 keeps the step finite): they underflowed or rounded to exactly 0 in low precision — a "
           f"saturated sigmoid gives 1 - p == 0 (fp16 sigmoid is exactly 1.0 from ~8.3), a softmax probability "
           f"below 6e-8 becomes 0 (in {dt}: {e.in_zeros} zero input{'s' if e.in_zeros != 1 else ''})")
    fx = ("use the fused, stable form that never meets the zero: `F.logsigmoid(x)` / "
          "`F.binary_cross_entropy_with_logits(logits, y)` instead of log(sigmoid(x)) / log(1 - sigmoid(x)), "
          "`F.log_softmax(x, -1)` instead of log(softmax(x)); or clamp with an eps that exists in the dtype "
          "(`p.clamp(torch.finfo(p.dtype).tiny, 1 - torch.finfo(p.dtype).eps)`); or run it in fp32:\n"
          + fp32_snippet(e.module, device))
    return Finding("underflow", severity, "forward", e.module, e.op, step, msg, fx,
                   {"zeros_in": e.in_zeros, "in_dtypes": e.in_dtypes, "line": e.line, "fp32_finite_with": fix.get("modules"),
                    "role": "cause of the origin", "rank_hint": rank_hint})


def chain(events: list[OpEvent], loss_finite: bool | None, grads_bad: list[str], consts: list[dict],
          forward_error: str | None) -> list[dict]:
    out = [{"stage": "constant", "rule": c["rule"], "module": c["module"], "op": c["op"], "value": c["value"],
            "line": c["line"]} for c in consts[:2] if not events or c["seq"] <= events[0].seq]
    if forward_error:
        out.append({"stage": "exception", "message": forward_error})
    if events:
        e = events[0]
        out.append({"stage": "origin", "phase": e.phase, "module": e.module, "op": e.op, "kind": e.kind, "line": e.line})
        nan = next((x for x in events if x.out_nan), None)
        if nan is not None and nan is not e:
            out.append({"stage": "first_nan", "phase": nan.phase, "module": nan.module, "op": nan.op, "line": nan.line})
    out.append({"stage": "loss", "finite": loss_finite})
    out.append({"stage": "grads", "nonfinite": grads_bad[:8], "count": len(grads_bad)})
    return out


def scaler_search_text(what: str, ss: dict) -> tuple[str, str]:
    """(message, fix) of a backward overflow `what` that the replay's scale search `ss` found finite at a smaller
    loss scale, the forward being finite: GradScaler's normal search, nothing to fix (here, and where the replay
    fold reads a records-located overflow the same way: analysis/replayfold.py)."""
    msg = (f"GradScaler's normal search for a loss scale: {what} at loss scale {ss['capture_scale']:g}, and the same "
           f"step is finite at {ss['finite_at']:g} ({ss['backoffs']} backoff{'s' if ss['backoffs'] != 1 else ''}); "
           "the forward was finite, so the scaler skips this step and lowers the scale as designed")
    fix = ("nothing to fix for this step; if the scale keeps falling (loss_scale_collapse) or most steps are "
           "skipped, fix the op above")
    return msg, fix


def build_findings(*, events: list[OpEvent], consts: list[dict], step_bad: bool, step: int | None, device: str,
                   forward_error: str | None, fix: dict | None, suspects: list[dict], dtype: str,
                   error_module: str | None = None, softmax_inputs: list = (), sdpa_used: bool = False,
                   scaler_search: dict | None = None) -> list[Finding]:
    found: list[Finding] = []
    rank = iter(range(10, 1000))
    # constants first: they are the root cause when they fed the failure
    for c in consts:
        later = [e for e in events
                 if e.seq >= c["seq"] and (modules_related(e.module, c["module"]) or e.phase == "backward")]
        raised = bool(forward_error and "overflow" in forward_error and c["rule"] == "mask_value_overflow")
        # (an eps guard whose values never reached it, e.g. F.normalize's 1e-12 on rows none of which is zero,
        # did nothing wrong on this step, whatever failed after it in the same module)
        contributed = step_bad and (raised or c["rule"] == "mask_value_overflow" or (
            bool(later) and c.get("reached") != 0))
        where = f"`{c['module']}`" if c["module"] else "the model"
        if c["rule"] == "mask_value_overflow":
            msg = (f"{c['op']} in {where} uses the constant {c['value']:g}, outside the {c['dtype']} range: "
                   + ("it raised \"value cannot be converted ... without overflow\"" if raised else "it becomes ±inf"))
            fx = (f"use a dtype-aware constant: `torch.finfo(scores.dtype).min` (not {c['value']:g} / "
                  "finfo(float32).min), or do the masking in fp32: `scores.float().masked_fill(mask, -1e9)`")
        else:
            v = c["value"]
            d = abs(v) - 1
            what = (f"the bound {v!r} (1 {'+' if d > 0 else '-'} {abs(d):.0e})" if abs(d) < 1e-2 else f"eps {v!r}")
            msg = f"{c['op']} in {where} uses {what}, which {c['detail'].split(' ', 1)[1]}: the guard does nothing"
            fx = ("use an eps that exists in the working dtype (e.g. `torch.finfo(x.dtype).eps`, or ≥ 6.1e-5 for "
                  "fp16), or compute this in fp32 (e.g. `F.normalize(x.float(), dim=-1).to(x.dtype)`)")
        ev = {k: c.get(k) for k in ("value", "rounded", "dtype", "arg", "line", "count", "detail", "reached")}
        ev.update(rank_hint=next(rank) if contributed else 500 + next(rank))
        # a healthy step whose guarded values never came near the eps: the guard is latent, not a warning
        sev = "error" if contributed else "info" if not step_bad and c.get("reached") == 0 else "warning"
        found.append(Finding(c["rule"], sev, "forward", c["module"], c["op"], step, msg, fx, ev))
    # op events: the origin, the first NaN, the first backward producer
    picked: list[OpEvent] = []
    fwd = any(e.phase == "forward" for e in events)
    for pred in (lambda e: True, lambda e: e.out_nan > 0 and e.phase == "forward",
                 lambda e: e.phase == "backward" and (not fwd or not e.in_has_inf)):
        e = next((x for x in events if pred(x)), None)
        if e is not None and e not in picked:
            picked.append(e)
    origins = [e for i, e in enumerate(picked) if i == 0 or not (e.in_has_inf or e.phase == picked[0].phase)]
    consequences = [e for e in picked if e not in origins]
    benign = bool(scaler_search and scaler_search.get("finite_at"))
    # other forward ops that made inf/NaN from finite inputs in modules unrelated to the origin: the same defect
    # repeated in later layers (each block's own mask constant or decay) or a second one; listed with the first
    # finding, not as findings of their own (a defect repeated in every layer would fill the first three)
    also: list[OpEvent] = []
    if origins and origins[0].phase == "forward":
        for x in events:
            if len(also) >= 4:
                break
            if x.phase == "forward" and x not in picked and not x.in_has_inf and not x.absorbed and \
                    x.module is not None and not any(modules_related(x.module, y.module) for y in [origins[0], *also]):
                also.append(x)
    for i, e in enumerate(origins):
        rule = e.kind
        if rule == "overflow" and e.op.split("::")[-1] in _MASK_CAPABLE and is_mask_like(e.absmax_in) and (
                e.op.split("::")[-1] != "mul" or getattr(e, "mask_operand", True)) and not e.in_param \
                and not getattr(e, "lone_extreme", False):
            rule = "mask_value_overflow"
        msg, fx = _op_text(e, device, softmax_inputs, sdpa_used)
        if e.grad_off and e.kind == "overflow" and any(d in ("float16", "bfloat16") for d in e.in_dtypes or ()):
            fx += _custom_fn_hint(device)
        if i == 0 and fix and fix.get("found"):
            fx += f"\n\nSmallest set of modules that makes this step finite in fp32 (ampdoctor fix search):\n{fix['snippet']}"
            if fix.get("finite_at_scale"):
                fx += (f"\n(with them in fp32 the forward is finite; the backward still overflows at this step's loss "
                       f"scale and is finite at {fix['finite_at_scale']:g}: GradScaler backs off there by itself, "
                       "skipping a few steps)")
        evidence = {"absmax_in": e.absmax_in, "out_nan": e.out_nan, "out_posinf": e.out_posinf,
                    "out_neginf": e.out_neginf, "out_numel": e.out_numel, "out_dtype": e.out_dtype,
                    "in_dtypes": e.in_dtypes, "line": e.line, "autograd_node": e.autograd_node,
                    "role": "origin", "rank_hint": next(rank) + (0 if step_bad else 500)}
        if _at_pole(e):
            evidence["pole_zeros_in"] = e.in_zeros  # inputs at the op's singular point (see _pole_underflow)
        if i == 0 and also:
            evidence["also_producers"] = [{"module": x.module, "op": x.op, "kind": x.kind, "line": x.line}
                                          for x in also]
            msg += ("; the same step also made inf/NaN from finite inputs in "
                    + ", ".join(f"{x.op} in {_where(x.module)}" for x in also))
        if i == 0 and consequences:
            evidence["consequences"] = [
                {"phase": c.phase, "module": c.module, "op": c.op, "kind": c.kind, "line": c.line,
                 "autograd_node": c.autograd_node, "out_nan": c.out_nan} for c in consequences]
            msg += "; it propagates to " + ", ".join(f"{c.op} in {_where(c.module)}" for c in consequences[:3])
        severity = "error" if step_bad else "info"
        if benign and e.phase == "backward":
            severity = "info"
            evidence["scaler_search"] = scaler_search
            msg, fx = scaler_search_text(msg, scaler_search)
        found.append(Finding(rule, severity, e.phase, e.module, e.op, step, msg, fx, evidence))
        # (an eps that vanishes in the dtype, found above, is the more precise account of the same zeros)
        if i == 0 and rule == "overflow" and not any(f.rule == "eps_underflow" and modules_related(f.module, e.module)
                                                     for f in found):
            under = _pole_underflow(e, fix, device, step, severity, next(rank) + (0 if step_bad else 500))
            if under is not None:
                found.append(under)
    explained = any(f.severity == "error" for f in found)
    if forward_error and not explained:
        found.append(Finding(
            "replay_error", "info", "forward", error_module, None, step,
            f"the replay could not run: the replayed forward raised {forward_error}"
            + (f" in {_where(error_module)}" if error_module is not None else "")
            + " — this says nothing about the model's numerics",
            "check that the model and the capture match (dtype of inputs and weights under autocast), or run "
            "the step without ampdoctor to see whether it raises there too",
            {"exception": forward_error, "module": error_module, "rank_hint": 900}))
    for s in suspects:
        found.append(Finding(
            "precision_loss", "warning", "forward", s["module"], None, step,
            f"{_where(s['module'])} in {dtype} is {s['rel_err']:.3g} away from fp32 (relative) although its inputs were "
            f"within {s['in_rel_err'] or 0.0:.2g}" + (f"; {s['rel_err'] / s['median']:.0f}× the median module"
                                                      if s["median"] > 1e-9 and s["rel_err"] >= 2 * s["median"]
                                                      else "") +
            " (e.g. large positions or timesteps rounded in low precision)",
            "run this module in fp32 (autocast off) or use bf16 / a more stable formulation:\n"
            + fp32_snippet(s["module"], device),
            {"rel_err": s["rel_err"], "median_rel_err": s["median"], "in_rel_err": s["in_rel_err"],
             "dropout": "off in both runs (like with like)", "rank_hint": 600 + next(rank)}))
    return sorted(found, key=lambda f: f.sort_key())

