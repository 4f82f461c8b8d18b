"""Tensor statistics computed on the tensor's own device, without a host synchronisation.

`full_stats(x, ref)` returns a float64 vector laid out as `records.STAT_FIELDS`; `light_stats` fills only the
counts needed to tell a producer from a propagator (numel, nan, ±inf, absmax) and leaves -1 elsewhere.
`vector_to_stats` turns a row read back on the host into a `TensorStats`. The hooks call these; the one
device->host transfer per step happens in the watch (ampdoctor/watch.py).
"""
from __future__ import annotations

import math

import torch

from ..records import DTYPE_LIMITS, STAT_FIELDS, TensorStats
from ..tensors import dt_name

__all__ = ["full_stats", "light_stats", "vector_to_stats", "ref_dtype", "is_measurable", "combine", "NSTAT",
           "integer_probe", "EXACT_INTEGERS", "PROBE_MAX_NUMEL", "integer_valued", "probe_row", "integer_input",
           "probe_name", "CAST_IN", "cast_in"]

NSTAT = len(STAT_FIELDS)
_F64 = torch.float64
_LOW = (torch.float16, torch.bfloat16)


def _thresholds(ref: torch.dtype) -> tuple[float, float, float]:
    """(near-max threshold, smallest normal, cast-overflow threshold) for a reference dtype."""
    fi = torch.finfo(ref)
    mx, tiny, near = DTYPE_LIMITS.get(str(ref).replace("torch.", ""), (fi.max, fi.tiny, fi.max / 2))
    # A wider value rounds to inf when cast to `ref` at max + half an ulp of max.
    ovf = mx + 2.0 ** (math.floor(math.log2(mx)) - (fi.bits - 1 - _exp_bits(ref)) - 1)
    return near, tiny, ovf


def _exp_bits(dt: torch.dtype) -> int:
    return {torch.float16: 5, torch.bfloat16: 8, torch.float32: 8, torch.float64: 11}.get(dt, 8)


_THR = {dt: _thresholds(dt) for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def thresholds(dt: torch.dtype, ref: torch.dtype) -> tuple[float, float, float]:
    """(near-max, smallest normal, cast-overflow) for values of dtype `dt` judged against `ref`; the overflow
    threshold is inf when a cast to `ref` cannot overflow."""
    near, tiny, ovf = _THR.get(ref, _THR[torch.float32])
    if not (dt.itemsize > ref.itemsize or (dt == torch.float32 and ref == torch.float16)):
        ovf = math.inf
    return near, tiny, ovf


def is_measurable(x) -> bool:
    """A floating-point tensor with values of its own in memory: not a meta tensor, not one wrapped by a torch.func
    transform (a module called inside torch.vmap / torch.func.grad gets those: they have no storage)."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.layout == torch.strided and not x.is_meta \
        and not is_wrapped(x)


_functorch = getattr(torch._C, "_functorch", None)
is_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None) or (lambda x: False)
"""Whether a tensor is a torch.func transform's wrapper (BatchedTensor, GradTrackingTensor)."""


def ref_dtype(dt: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype whose limits apply: the tensor's own if low precision, else the autocast dtype if active."""
    if dt in _LOW:
        return dt
    if autocast_dtype is not None and dt == torch.float32:
        return autocast_dtype
    return dt


def full_stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    """All of STAT_FIELDS for one tensor, as a float64 vector on x's device.

    One temporary the size of x (its absolute value, reused in place); counts are int64 reductions of
    transient boolean masks, so no float64 copy of the tensor is ever made."""
    x = x.detach()
    n = x.numel()
    if n == 0:
        return torch.tensor([0.0, 0, 0, 0, 0, 0.0, math.inf, 0, 0, 0], dtype=_F64, device=x.device)
    near, tiny, ovf = _THR.get(ref, _THR[torch.float32])
    a = x.abs()
    nan = torch.isnan(a).sum()
    posinf = (x == math.inf).sum()
    neginf = (x == -math.inf).sum()
    a.nan_to_num_(nan=0.0, posinf=0.0)                         # finite magnitudes; non-finite -> 0
    zeros_all = (a == 0).sum()                                 # zeros + non-finite
    near_max = (a >= near).sum()
    below = (a < tiny).sum()                                   # zeros + non-finite + subnormal
    if x.dtype.itemsize > ref.itemsize or (x.dtype == torch.float32 and ref == torch.float16):
        ovf_n = (a >= ovf).sum()
    else:
        ovf_n = torch.zeros_like(nan)
    absmax = a.amax()
    min_nz = a.masked_fill_(a == 0, math.inf).amin()
    cnt = torch.stack([nan, posinf, neginf, zeros_all, near_max, below, ovf_n]).to(_F64)
    ext = torch.stack([absmax, min_nz]).to(_F64)
    return _row(n, cnt, ext, x.device)


def _row(n: int, cnt: torch.Tensor, ext: torch.Tensor, device) -> torch.Tensor:
    """The STAT_FIELDS vector from counts [nan, +inf, -inf, zeros incl. non-finite, near-max, below-normal incl.
    zeros, cast-overflow] and extremes [finite abs-max, min nonzero] (shared by the eager and compiled paths)."""
    nonfin = cnt[0] + cnt[1] + cnt[2]
    return torch.stack([torch.full((), n, dtype=_F64, device=device), cnt[0], cnt[1], cnt[2],
                        cnt[3] - nonfin, ext[0], ext[1], cnt[4], cnt[5] - cnt[3], cnt[6]])


def light_stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    """numel, nan, +inf, -inf, zeros and finite absmax; the other fields are -1 (not measured)."""
    x = x.detach()
    if x.numel() == 0:
        return torch.tensor([0.0, 0, 0, 0, 0, 0.0, -1, -1, -1, -1], dtype=_F64, device=x.device)
    cnt = torch.stack([(x == 0).sum(), torch.isnan(x).sum(), (x == math.inf).sum(),
                       (x == -math.inf).sum()]).to(_F64)
    absmax = torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).amax().to(_F64)
    m1 = torch.full((), -1.0, dtype=_F64, device=x.device)
    return torch.stack([torch.full((), x.numel(), dtype=_F64, device=x.device), cnt[1], cnt[2], cnt[3],
                        cnt[0], absmax, m1, m1, m1, m1])


def vector_to_stats(row, dtype: str, ref: str) -> TensorStats:
    """Host-side: a list of NSTAT floats (one row read back) -> TensorStats. -1 means not measured."""
    n, nan, pinf, ninf, zeros, absmax, mn, near, sub, ovf = row  # records.STAT_FIELDS order
    return TensorStats(dtype=dtype, ref=ref, numel=int(n) if n >= 0 else 0, nan=int(nan) if nan >= 0 else 0,
                       posinf=int(pinf) if pinf >= 0 else 0, neginf=int(ninf) if ninf >= 0 else 0,
                       zeros=int(zeros) if zeros >= 0 else 0, absmax=float(absmax),
                       min_nonzero=None if (mn < 0 or math.isinf(mn)) else float(mn),
                       near_max=int(near) if near >= 0 else 0, subnormal=int(sub) if sub >= 0 else 0,
                       overflow_as_ref=int(ovf) if ovf >= 0 else 0)


def combine(stats: list[TensorStats]) -> TensorStats | None:
    """Aggregate several tensors' statistics (counts add, absmax max, min_nonzero min)."""
    if not stats:
        return None
    if len(stats) == 1:
        return stats[0]
    s0 = stats[0]
    mins = [s.min_nonzero for s in stats if s.min_nonzero is not None]
    wide = max(stats, key=lambda s: _rank(s.ref))
    return TensorStats(dtype=s0.dtype if all(s.dtype == s0.dtype for s in stats) else "mixed", ref=wide.ref,
                       numel=sum(s.numel for s in stats), nan=sum(s.nan for s in stats),
                       posinf=sum(s.posinf for s in stats), neginf=sum(s.neginf for s in stats),
                       zeros=sum(s.zeros for s in stats), absmax=max(s.absmax for s in stats),
                       min_nonzero=min(mins) if mins else None, near_max=sum(s.near_max for s in stats),
                       subnormal=sum(s.subnormal for s in stats),
                       overflow_as_ref=sum(s.overflow_as_ref for s in stats))


def _rank(ref: str) -> int:
    # the narrowest reference wins when mixing (its limits are the ones at risk)
    return {"float16": 3, "bfloat16": 2, "float32": 1, "float64": 0}.get(ref, 0)


def _full_c(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    """`full_stats` written for torch.compile: the same numbers, counted in int32 (callers keep numel < 2**31)
    and without in-place ops, so Inductor fuses every reduction into one vectorised loop (2x faster on CPU)."""
    x = x.detach()
    n = x.numel()
    if n == 0:
        return torch.tensor([0.0, 0, 0, 0, 0, 0.0, math.inf, 0, 0, 0], dtype=_F64, device=x.device)
    near, tiny, ovf = _THR.get(ref, _THR[torch.float32])
    i32 = torch.int32
    a = x.abs()
    af = torch.nan_to_num(a, nan=0.0, posinf=0.0)
    widening = x.dtype.itemsize > ref.itemsize or (x.dtype == torch.float32 and ref == torch.float16)
    cnt = torch.stack([torch.isnan(a).to(i32).sum(dtype=i32), (x == math.inf).to(i32).sum(dtype=i32),
                       (x == -math.inf).to(i32).sum(dtype=i32), (af == 0).to(i32).sum(dtype=i32),
                       (af >= near).to(i32).sum(dtype=i32), (af < tiny).to(i32).sum(dtype=i32),
                       (af >= ovf).to(i32).sum(dtype=i32) if widening else torch.zeros((), dtype=i32)]).to(_F64)
    ext = torch.stack([af.amax(), torch.where(af == 0, math.inf, af).amin()]).to(_F64)
    return _row(n, cnt, ext, x.device)


def _light_c(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    """`light_stats` written for torch.compile (see _full_c)."""
    x = x.detach()
    if x.numel() == 0:
        return torch.tensor([0.0, 0, 0, 0, 0, 0.0, -1, -1, -1, -1], dtype=_F64, device=x.device)
    i32 = torch.int32
    cnt = torch.stack([(x == 0).to(i32).sum(dtype=i32), torch.isnan(x).to(i32).sum(dtype=i32),
                       (x == math.inf).to(i32).sum(dtype=i32), (x == -math.inf).to(i32).sum(dtype=i32)]).to(_F64)
    absmax = torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).amax().to(_F64)
    m1 = torch.full((), -1.0, dtype=_F64, device=x.device)
    return torch.stack([torch.full((), x.numel(), dtype=_F64, device=x.device), cnt[1], cnt[2], cnt[3],
                        cnt[0], absmax, m1, m1, m1, m1])


# CPU fast path: the same statistics compiled by torch.compile (_full_c/_light_c: Inductor fuses each into one
# loop over the tensor, ~5-8x faster than eager on CPU and bit-for-bit equal, see tests/test_stats.py). Compiling
# costs seconds once per process (and per dtype pair), so a watch uses it only for dense sampling (every <= 10)
# on the CPU; any failure falls back to the eager functions for good.
_COMPILED: dict = {}


def compiled(kind: str):
    """The compiled `full_stats` / `light_stats`, or the eager one when compiling is not possible here."""
    fn = _COMPILED.get(kind)
    if fn is None:
        eager = full_stats if kind == "full" else light_stats
        try:
            comp = torch.compile(_full_c if kind == "full" else _light_c, dynamic=True)
        except Exception:
            comp = None

        def fn(x, ref, _comp=comp, _eager=eager):
            if _COMPILED.get("broken") or _comp is None or x.numel() >= 2 ** 31:
                return _eager(x, ref)
            try:
                return _comp(x, ref)
            except Exception:  # no C++ toolchain, an unsupported case: eager from now on
                _COMPILED["broken"] = True
                return _eager(x, ref)
        _COMPILED[kind] = fn
    return fn


# -- integers in a low-precision dtype (positions, timesteps, labels) ---------------------------------------------
EXACT_INTEGERS = {torch.float16: 2048.0, torch.bfloat16: 256.0}
"""The largest magnitude below which a dtype holds every integer (2**(significand bits)); above it, every 2nd,
4th, ... integer: neighbouring positions or timesteps collapse into one value."""
PROBE_MAX_NUMEL = 1 << 16   # positions and timesteps are small tensors; activations are not probed


def integer_probe(x: torch.Tensor) -> torch.Tensor:
    """[finite abs-max, non-finite count, non-integer count, smallest nonzero magnitude] of a small tensor, as a
    float64 vector on its device (no synchronisation). Read with `integer_valued`."""
    x = x.detach().float()
    a = x.abs()
    fin = torch.isfinite(x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    inf = torch.full((), math.inf, dtype=x.dtype, device=x.device)
    return torch.stack([torch.where(fin, a, zero).amax(), (~fin).sum().to(x.dtype),
                        ((x != x.round()) & fin).sum().to(x.dtype),
                        torch.where(fin & (a > 0), a, inf).amin()]).to(_F64)


def integer_valued(row, dtype: str) -> dict | None:
    """From an `integer_probe` row read back: the tensor held only integers, past the point where the dtype rounds
    what is computed from them, with smaller nonzero magnitudes too (a position or timestep ramp, not a mask of 0
    and -1e4). bf16 holds every integer only up to 256; fp16 up to 2048, but past 512 any product with a fraction
    (a sinusoidal embedding's t * freq) lands on a grid 0.5 apart (`rounds_products_from`). `dtype` "float32>bfloat16":
    an fp32 input that the module computes with in bf16 (a Linear under autocast casts it: `CAST_IN`); the result
    then says `held_as` float32. "...@op": values op made in, or cast to, the dtype inside a forward (`probe_name`):
    the result says `via` op. None otherwise."""
    dtype, _, via = dtype.partition("@")
    held, _, dtype = dtype.rpartition(">")
    limit = {"float16": 2048.0, "bfloat16": 256.0}.get(dtype)
    if limit is None or row is None or len(row) < 4:
        return None
    products = 512.0 if dtype == "float16" else limit
    amax, nonfinite, nonint, amin = row[:4]
    if nonfinite or nonint or not (products < amax <= 2.0 ** 24) or not (amin < amax and amin <= products):
        return None
    out = {"dtype": dtype, "max": amax, "exact_up_to": limit, "rounds_products_from": products}
    if held:
        out["held_as"] = held
    if via:
        out["via"] = via
    return out


def probe_name(held: torch.dtype, low: torch.dtype, via: str) -> str:
    """The dtype name of a probe of values that op `via` made in, or cast to, `low` inside a forward
    (record/lowcast.py), as `integer_valued` reads it: "int64>bfloat16@add", "bfloat16@arange"."""
    return (dt_name(low) if held is low else f"{dt_name(held)}>{dt_name(low)}") + f"@{via}"


CAST_IN = frozenset({"Linear", "Bilinear", "LazyLinear", "NonDynamicallyQuantizableLinear"})
"""Module types whose forward casts an fp32 input to autocast's dtype before computing with it (a timestep fed to
`nn.Linear(1, d)` under bf16 autocast is rounded there): their small fp32 inputs are probed for integers too."""


def cast_in(module_type: str, device_type: str) -> torch.dtype | None:
    """The low dtype a module of `module_type` computes its fp32 inputs in right now (autocast on `device_type`
    with fp16/bf16, and a CAST_IN module), else None."""
    if module_type not in CAST_IN:
        return None
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        dt = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return None
    return dt if dt in EXACT_INTEGERS else None


def probe_row(probes: list, idx: int) -> list | None:
    """Row `idx` of a step's `integer_probe` values read back (four numbers each), None when it did not arrive."""
    return probes[idx * 4:idx * 4 + 4] if idx * 4 + 4 <= len(probes) else None


def integer_input(call_probes: list, probes: list) -> dict | None:
    """The first of a call's probed inputs (`[(row index, dtype name)]`) that held only integers past the point where
    its dtype rounds (`integer_valued`)."""
    for idx, dt in call_probes:
        found = integer_valued(probe_row(probes, idx), dt)
        if found is not None:
            return found
    return None
