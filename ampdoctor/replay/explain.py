"""Turn what a replay observed (op events, constant events, shadow rows, fix search) into ranked Findings.

Order: constants that caused the failure, then the origin op, then the first NaN and the first backward
producer (propagators), then warnings. `evidence["rank_hint"]` keeps that order under `Finding.sort_key`.
"""
from __future__ import annotations

from ..findings import Finding
from .constants import is_mask_like
from .optrace import OpEvent

__all__ = ["build_findings", "chain"]

_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addmv", "mv", "_scaled_dot_product_attention_math",
           "_scaled_dot_product_flash_attention_for_cpu", "convolution", "_convolution", "einsum"}
_POLES = {"log", "log1p", "log2", "log10", "div", "reciprocal", "rsqrt", "pow", "digamma", "atanh"}
_MASK_CAPABLE = {"add", "sub", "rsub", "_to_copy", "where", "copy_", "masked_fill", "cat", "mul"}
_MAX = {"float16": 65504.0, "bfloat16": 3.39e38, "float32": 3.4e38}


def _related(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    return a == b or a == "" or b == "" or a.startswith(b + ".") or b.startswith(a + ".")


def _autocast_snippet(module: str | None, device: str) -> str:
    attr = f"self.{module.split('.')[-1]}" if module else "module"
    return (f"with torch.autocast(\"{device}\", enabled=False):\n    out = {attr}(x.float())   # "
            f"run `{module or '(root)'}` in fp32")


def _op_text(ev: OpEvent, device: str) -> tuple[str, str]:
    short = ev.op.split("::")[-1]
    where = f"`{ev.module}`" if ev.module else "the model"
    inf = "NaN" if ev.kind == "nan_origin" else "±inf"
    lim = _MAX.get(ev.out_dtype or "", 65504.0)
    if ev.phase == "backward":
        node = ev.autograd_node or ev.op
        msg = (f"the backward of {node} in {where} ({ev.op}) produced {inf} from finite gradients: the gradient "
               f"of this op is not finite at the values the forward produced")
        fix = ("guard the forward op's singular point in a way that survives the low-precision dtype (an eps/clamp "
               "that is representable in it, e.g. `p.clamp(max=1 - torch.finfo(p.dtype).eps)`), or compute this "
               "op in fp32:\n" + _autocast_snippet(ev.module, device))
        return msg, fix
    if ev.kind == "overflow" and short in _MATMUL:
        msg = (f"{ev.op} in {where} overflowed {ev.out_dtype}: finite inputs (max |x| = {ev.absmax_in:.4g}) gave "
               f"±inf (max {lim:g})")
        if short in ("bmm", "baddbmm", "matmul") or "attn" in (ev.module or "") or "attention" in (ev.module or ""):
            fix = ("scale q by 1/sqrt(d) before q @ k^T (or use F.scaled_dot_product_attention), or run the "
                   "attention scores in fp32:\n" + _autocast_snippet(ev.module, device))
        else:
            fix = ("run this layer in fp32 (its output exceeds the fp16 range), use bf16, or clamp as HF T5 does "
                   "(`x = torch.clamp(x, -65504 + 1000, 65504 - 1000)`):\n" + _autocast_snippet(ev.module, device))
        return msg, fix
    if ev.kind == "overflow" and short == "pow":
        msg = (f"{ev.op} in {where} overflowed {ev.out_dtype} (input up to {ev.absmax_in:.4g}; in fp16 x**2 is inf "
               "for |x| > 255.9) — a variance or norm computed in fp16")
        fix = ("compute the statistic in fp32, as HF's RMSNorm does: `var = x.float().pow(2).mean(-1, keepdim=True)`,"
               " or run the module in fp32:\n" + _autocast_snippet(ev.module, device))
        return msg, fix
    if ev.kind == "overflow" and short in ("exp", "exp2", "expm1", "sinh", "cosh"):
        msg = f"{ev.op} in {where} overflowed {ev.out_dtype} (input up to {ev.absmax_in:.4g}; fp16 exp(x) is inf for x > 11.09)"
        fix = ("compute it stably: torch.logsumexp(x, dim) instead of log(sum(exp(x))), F.log_softmax / "
               "F.cross_entropy for losses, or subtract the max before exp; or run it in fp32: "
               "`torch.exp(x.float())`")
        return msg, fix
    if short in _POLES and ev.in_zeros:
        msg = f"{ev.op} in {where} hit its singular point (an input is 0 / -1) and produced {inf}"
        fix = ("keep the argument away from the singularity with an eps that exists in the working dtype "
               "(fp16's smallest normal is 6.1e-5), or compute this op in fp32:\n" + _autocast_snippet(ev.module, device))
        return msg, fix
    msg = f"{ev.op} in {where} produced {inf} from {'finite' if ev.kind == 'overflow' else 'NaN-free'} inputs"
    fix = "compute this op in fp32, or remove the source of the inf upstream:\n" + _autocast_snippet(ev.module, device)
    return msg, fix


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


def build_findings(*, events: list[OpEvent], consts: list[dict], step_bad: bool, step: int | None, device: str,
                   forward_error: str | None, fix: dict | None, suspects: list[dict], dtype: str,
                   error_module: str | None = None) -> list[Finding]:
    found: list[Finding] = []
    rank = iter(range(10, 1000))
    # constants first: they are the root cause when they fed the failure
    for c in consts:
        later = [e for e in events if e.seq >= c["seq"] and (_related(e.module, c["module"]) or e.phase == "backward")]
        raised = bool(forward_error and "overflow" in forward_error and c["rule"] == "mask_value_overflow")
        contributed = step_bad and (raised or bool(later) or c["rule"] == "mask_value_overflow")
        where = f"`{c['module']}`" if c["module"] else "the model"
        if c["rule"] == "mask_value_overflow":
            msg = (f"{c['op']} in {where} uses the constant {c['value']:g}, outside the {c['dtype']} range: "
                   + ("it raised \"value cannot be converted ... without overflow\"" if raised else "it becomes ±inf"))
            fx = (f"use a dtype-aware constant: `torch.finfo(scores.dtype).min` (not {c['value']:g} / "
                  "finfo(float32).min), or do the masking in fp32: `scores.float().masked_fill(mask, -1e9)`")
        else:
            v = c["value"]
            what = (f"the bound {v!r} (1 - {1 - abs(v):.0e})" if abs(abs(v) - 1) < 1e-2 else f"eps {v!r}")
            msg = f"{c['op']} in {where} uses {what}, which {c['detail'].split(' ', 1)[1]}: the guard does nothing"
            fx = ("use an eps that exists in the working dtype (e.g. `torch.finfo(x.dtype).eps`, or ≥ 6.1e-5 for "
                  "fp16), or compute this in fp32 (e.g. `F.normalize(x.float(), dim=-1).to(x.dtype)`)")
        ev = {k: c[k] for k in ("value", "rounded", "dtype", "arg", "line", "count", "detail")}
        ev.update(rank_hint=next(rank) if contributed else 500 + next(rank))
        found.append(Finding(c["rule"], "error" if contributed else "warning", "forward", c["module"], c["op"], step,
                             msg, fx, ev))
    # op events: the origin, the first NaN, the first backward producer
    picked: list[OpEvent] = []
    fwd = any(e.phase == "forward" for e in events)
    for pred in (lambda e: True, lambda e: e.out_nan > 0 and e.phase == "forward",
                 lambda e: e.phase == "backward" and (not fwd or not e.in_has_inf)):
        e = next((x for x in events if pred(x)), None)
        if e is not None and e not in picked:
            picked.append(e)
    for i, e in enumerate(picked):
        rule = e.kind
        if rule == "overflow" and e.op.split("::")[-1] in _MASK_CAPABLE and is_mask_like(e.absmax_in):
            rule = "mask_value_overflow"
        msg, fx = _op_text(e, device)
        if i > 0 and (e.in_has_inf or e.phase == picked[0].phase):
            o = picked[0]
            msg += f" (a consequence of the {o.kind} at {o.op} in `{o.module}`)"
            fx = f"fix the origin ({o.op} in `{o.module}`, above); this op only propagates it"
        if i == 0 and fix and fix.get("found"):
            fx += f"\n\nSmallest set of modules that makes this step finite in fp32 (ampdoctor fix search):\n{fix['snippet']}"
        evidence = {"absmax_in": e.absmax_in, "out_nan": e.out_nan, "out_posinf": e.out_posinf,
                    "out_neginf": e.out_neginf, "out_numel": e.out_numel, "out_dtype": e.out_dtype,
                    "in_dtypes": e.in_dtypes, "line": e.line, "autograd_node": e.autograd_node,
                    "role": "origin" if i == 0 else "propagator", "rank_hint": next(rank) + (0 if step_bad else 500)}
        found.append(Finding(rule, "error" if step_bad else "info", e.phase, e.module, e.op, step, msg, fx, evidence))
    if forward_error and not any(f.severity == "error" for f in found):
        found.append(Finding("overflow" if "overflow" in forward_error else "nan_origin", "error", "forward", error_module,
                             None, step, f"the replayed forward raised: {forward_error}",
                             "see the traceback of the original run; run the failing module in fp32",
                             {"rank_hint": next(rank)}))
    for s in suspects:
        found.append(Finding(
            "precision_loss", "warning", "forward", s["module"], None, step,
            f"`{s['module']}` in {dtype} is {s['rel_err']:.3g} away from fp32 (relative) although its inputs were "
            f"within {s['in_rel_err'] or 0.0:.2g}" + (f"; {s['rel_err'] / max(s['median'], 1e-12):.0f}× the median "
                                                      "module" if s["rel_err"] >= 2 * s["median"] else "") +
            " (e.g. large positions or timesteps rounded in low precision)",
            "run this module in fp32 (autocast off) or use bf16 / a more stable formulation:\n"
            + _autocast_snippet(s["module"], device),
            {"rel_err": s["rel_err"], "median_rel_err": s["median"], "in_rel_err": s["in_rel_err"],
             "rank_hint": 600 + next(rank)}))
    return sorted(found, key=lambda f: f.sort_key())

