"""Constant rules: fill/mask values outside the working dtype's range, epsilons that vanish in it.

`check_op` is called by the tracer's dispatch mode before each forward ATen op runs. It looks only at the
arguments the op's schema types as Scalar (or a Python number passed where a Tensor goes, as `x + 1e-8` does),
and only when the op works in float16/bfloat16. It runs before the op, so a fill that raises
("value cannot be converted to type at::Half without overflow") is still recorded at its module and line.
"""
from __future__ import annotations

import math

import torch

__all__ = ["check_op", "check_setitem", "MASK_OPS", "EPS_OPS", "LOW_DTYPES", "is_mask_like"]

LOW_DTYPES = (torch.float16, torch.bfloat16)
# Ops where a huge constant is a mask/fill value (a huge constant in div, or in mul on anything but a 0/1 mask, is
# judged by the op's output).
MASK_OPS = {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full", "scalar_tensor",
            "where", "add", "add_", "sub", "sub_", "rsub", "clamp", "clamp_", "clamp_min", "clamp_max",
            "index_fill", "index_fill_", "constant_pad_nd", "fill_diagonal_", "mul", "mul_"}
# Ops where a tiny constant is an epsilon guard (or 1 - eps a saturation guard).
EPS_OPS = {"clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "add", "add_", "sub", "sub_",
           "rsub", "where", "masked_fill", "masked_fill_", "full", "fill", "fill_", "scalar_tensor", "full_like"}
_FP32_MAX = torch.finfo(torch.float32).max


def is_mask_like(v: float) -> bool:
    """A magnitude that looks like a hand-written mask constant: 1e4, 1e9, 1e30, finfo(...).max."""
    v = abs(v)
    if v < 1e4 or not math.isfinite(v):
        return False
    specials = [torch.finfo(d).max for d in (torch.float16, torch.bfloat16, torch.float32)]
    return abs(math.log10(v) - round(math.log10(v))) < 1e-6 or any(abs(v - s) <= 1e-6 * s for s in specials)


_SCALE_OPS = ("mul", "mul_")


def mask_operand(args, kwargs) -> bool:
    """Whether a product's tensor operands hold only 0s and 1s: `(1 - mask) * finfo(float32).min` is a mask; an
    activation times a huge factor (`x.mul_(1e6)`) is not (an fp16 op computes with the Python number in fp32, so
    the overflow is the product's, judged by the op's output)."""
    ts = [a for a in list(args) + list(kwargs.values())
          if isinstance(a, torch.Tensor) and a.dim() > 0 and a.numel()]
    try:
        return bool(ts) and all(bool(((t == 0) | (t == 1)).all()) for t in ts)
    except Exception:
        return True


def _working_dtype(args, kwargs) -> torch.dtype | None:
    dt = kwargs.get("dtype")
    if isinstance(dt, torch.dtype):
        return dt
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return None


def _scalars(func, args, kwargs):
    """(argument name, python number) for every Scalar-typed (or Tensor slot holding a number) argument."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu" and v.is_floating_point() \
                and v.dtype in (torch.float64, torch.float32) and not v.requires_grad:  # (a Parameter is no constant)
            v = float(v)  # a Python number reaches dispatch as a 0-dim CPU tensor (a "wrapped number")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or a.name == "alpha":
            continue
        t = str(a.type)
        if "Scalar" in t or "number" in t or t.startswith("Tensor") or t in ("float", "Optional[float]"):
            out.append((a.name, v))
    return out


def _record(tr, rule: str, func, dtype, name: str, value, rounded, detail: str, reached: int | None = None) -> None:
    from .optrace import source_line
    mod = tr.module()
    key = (rule, mod, func._schema.name, value)
    for c in tr.constants:
        if c["key"] == key:
            c["count"] += 1
            if reached is not None:
                c["reached"] = (c["reached"] or 0) + reached
            return
    tr.constants.append({"key": key, "rule": rule, "module": mod, "op": func._schema.name, "arg": name,
                         "value": value, "rounded": rounded, "dtype": str(dtype).replace("torch.", ""),
                         "line": source_line(), "seq": tr.seq, "phase": tr.phase, "detail": detail, "count": 1,
                         "reached": reached})


_GUARDED = ("clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "add", "add_", "sub", "sub_",
            "rsub")


def _reached(short: str, args, bound: bool, rounded: float) -> int | None:
    """How many values of the guarded tensor sit where the guard was meant to act but its rounded constant does not:
    zeros (|x| <= the eps that became 0) or, for a 1 - eps bound that became ±1, values at or past it on its own
    side (x >= 1 for an upper bound, x <= -1 for a lower one: `clamp(-1 + 1e-3, 1 - 1e-3)` before an acos names
    the bound the values reached). None where the op has no guarded tensor (a fill, a where)."""
    x = args[0] if args else None
    if short not in _GUARDED or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    with torch.no_grad():
        if bound:
            x = x.detach()
            return int((x >= 1.0).sum() if rounded > 0 else (x <= -1.0).sum())
        return int((x.detach().abs() <= abs(rounded)).sum())


_INDEX_PUT = torch.ops.aten.index_put_.default


def check_setitem(tr, args) -> None:
    """`t[idx] = v` with a Python number `v` past the range of `t`'s float16/bfloat16 (a mask written by indexed
    assignment: `scores[visited] = -1e9`): torch turns `v` into a tensor of `t`'s dtype (-inf) before any ATen op
    sees it, so it is read here, at the Python call (optrace's function mode), recorded as the index_put_ it runs."""
    if len(args) < 3:
        return
    t, v = args[0], args[2]
    if not isinstance(t, torch.Tensor) or t.dtype not in LOW_DTYPES or isinstance(v, bool) \
            or not isinstance(v, (int, float)):
        return
    v, fi = float(v), torch.finfo(t.dtype)
    if math.isfinite(v) and abs(v) > fi.max:
        dname = str(t.dtype).replace("torch.", "")
        _record(tr, "mask_value_overflow", _INDEX_PUT, t.dtype, "value", v, math.copysign(math.inf, v),
                f"{v:g} is outside the {dname} range (max {fi.max:g}): indexed assignment makes it "
                f"{'-inf' if v < 0 else 'inf'}")


def check_op(tr, func, args, kwargs) -> None:
    """Record mask/eps constant events for one forward op on the tracer `tr` (never raises)."""
    short = func._schema.name.split("::")[-1]
    if short not in MASK_OPS and short not in EPS_OPS:
        return
    dtype = _working_dtype(args, kwargs)
    if dtype not in LOW_DTYPES:
        return
    fi = torch.finfo(dtype)
    dname = str(dtype).replace("torch.", "")
    for name, v in _scalars(func, args, kwargs):
        v = float(v)
        if not math.isfinite(v) or v == 0.0:
            continue
        if short in MASK_OPS and abs(v) > fi.max and (short not in _SCALE_OPS or mask_operand(args, kwargs)):
            what = "raises or becomes -inf" if v < 0 else "raises or becomes inf"
            _record(tr, "mask_value_overflow", func, dtype, name, v, math.copysign(math.inf, v),
                    f"{v:g} is outside the {dname} range (max {fi.max:g}): it {what}")
        elif short in EPS_OPS and abs(v) != 1.0 and abs(abs(v) - 1.0) < 1e-2:  # (±1 itself is exact)
            r = torch.tensor(v, dtype=dtype).item()
            if abs(r) == 1.0:
                # (the spacing on v's side of 1: below 1 it is half of finfo.eps, the spacing above 1)
                gap = fi.eps / 2 if abs(v) < 1.0 else fi.eps
                _record(tr, "eps_underflow", func, dtype, name, v, r,
                        f"{v!r} rounds to exactly {r:g} in {dname} (its spacing just {'below' if abs(v) < 1 else 'above'}"
                        f" 1 is {gap:g})", _reached(short, args, True, r))
        elif short in EPS_OPS and abs(v) < 1e-3:
            r = torch.tensor(v, dtype=dtype).item()
            if r == 0.0:
                _record(tr, "eps_underflow", func, dtype, name, v, r, f"{v:g} rounds to 0 in {dname}",
                        _reached(short, args, False, r))
