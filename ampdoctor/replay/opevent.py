"""What one op's inf/NaN is made of, for the op-level tracer (replay/optrace.py): `OpEvent`, the record of an op that
turned finite values into inf/NaN, and the reads of an op's arguments that fill it in and that the tracer's checks
rest on: which inputs sit at the op's singular point (a division's divisor, a negative power's base), a power's
number base or exponent, a lone extreme value among the inputs, a NaN or inf given as a Python number, and which
arguments an op only writes (`out=` buffers, the `self` that copy_/fill_ overwrite).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..tensors import flatten_tensors

__all__ = ["OpEvent", "RESULT_OUTPUTS", "absmin", "floats", "has_pole", "is_lone", "nonfinite_number", "pole_inputs",
           "read_args", "scalar_base", "scalar_exponent"]


def has_pole(func, args) -> bool:
    """Whether a zero input is the op's singular point: always for log/div/rsqrt (explain._POLES), for pow only
    with a negative exponent (x ** 2 at 0 is 0, not inf)."""
    if func._schema.name not in ("aten::pow", "aten::pow_"):
        return True
    if len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return False
    e = args[1]
    if isinstance(e, torch.Tensor):
        return bool((e < 0).any()) if e.numel() else False
    return isinstance(e, (int, float)) and e < 0


_DIVISIONS = {"div", "divide", "true_divide", "floor_divide"}


def pole_inputs(func, args, ins: list) -> list:
    """The inputs whose zeros are the op's singular point: a division's divisor (zeros in the numerator give 0, and a
    quotient that overflows by a small nonzero divisor is no pole), pow's base, a unary op's one input."""
    base = func._schema.name.split("::")[-1].rstrip("_")
    if base in _DIVISIONS:
        d = args[1] if len(args) > 1 else None
        if isinstance(d, torch.Tensor):
            return [d] if d.is_floating_point() else [d.double()]
        return [torch.zeros(1)] if isinstance(d, (int, float)) and d == 0 else []
    if base == "pow":
        return [args[0]] if args and isinstance(args[0], torch.Tensor) else []
    return ins


@dataclass
class OpEvent:
    """One op whose output held inf/NaN that its inputs did not (`kind`: overflow or nan_origin)."""

    seq: int
    phase: str
    module: str | None
    op: str
    kind: str
    line: str | None = None
    autograd_node: str | None = None
    out_dtype: str | None = None
    out_nan: int = 0
    out_posinf: int = 0
    out_neginf: int = 0
    out_numel: int = 0
    absmax_in: float = 0.0
    in_dtypes: list = field(default_factory=list)
    in_has_inf: bool = False
    in_zeros: int = 0
    """inputs at the op's singular point: == 0 (== -1 for log1p)"""
    out_shape: list = field(default_factory=list)
    """shape of the first non-finite output"""
    in_sdpa: bool = False
    """the op ran inside F.scaled_dot_product_attention (its math kernel)"""
    in_param: bool = False
    """an input is one of the model's trainable weights (a leaf that requires grad): no mask constant"""
    mask_operand: bool = False
    """mul: every tensor operand holds only 0s and 1s (a 0/1 mask times a constant, not an activation)"""
    lone_extreme: bool = False
    """overflow: the inputs' abs-max, a round number (1e5), is held by one value among other nonzero values (a data
    outlier, e.g. a sensor glitch cast to fp16), not by the many positions, or the 0/constant tensor, of a fill"""
    grad_off: bool = False
    """a forward op that ran with autograd off: inside a custom torch.autograd.Function's forward (or no_grad)"""
    absorbed: bool = False
    """a forward op whose module still returned finite values (NewGELU's x**3 overflowing inside a tanh that
    saturates it): not what made the step's inf/NaN when another module's output went non-finite"""
    scalar_base: float | None = None
    """pow with a number as its base and the tensor as the exponent (`10 ** (db / 20)`, `2 ** x`): that number. It
    overflows as an exp does, not as a square"""
    scalar_exponent: float | None = None
    """pow with a tensor base and a number as the exponent (`x ** 2`, `sigma ** -2.0`): that number"""
    absmin_in: float | None = None
    """a negative power's smallest nonzero |input| (it overflows at the small values, not the large)"""

    def to_dict(self) -> dict:
        return asdict(self)


def is_lone(ins: list, absmax: float) -> bool:
    """One value among the inputs has magnitude `absmax`, in a tensor that holds other nonzero values."""
    with torch.no_grad():
        hits = [int((t.detach().abs() == absmax).sum()) for t in ins]
        if sum(hits) != 1:
            return False
        t = ins[hits.index(1)].detach()
        return int((t != 0).sum()) > 1


def floats(tree) -> list[torch.Tensor]:
    return [t for t in flatten_tensors(tree, []) if t.is_floating_point() and t.numel()]


def nonfinite_number(args, kwargs) -> str | None:
    """"nan" or "inf" when a Python float NaN / ±inf is among an ATen op's arguments (flat, or one list deep)."""
    found = None
    for a in list(args) + list(kwargs.values()):
        for v in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(v, float):
                if v != v:
                    return "nan"
                if abs(v) == float("inf"):
                    found = "inf"
    return found


# ops whose later outputs are saved for their backward, not results: only the first n are judged
RESULT_OUTPUTS = {"aten::_ctc_loss": 1, "aten::_cudnn_ctc_loss": 1}

# in-place ops that overwrite all of `self` without reading it: its old values are not an input of the op
_OVERWRITE_SELF = {"aten::copy_", "aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_",
                   "aten::bernoulli_", "aten::exponential_", "aten::geometric_", "aten::log_normal_",
                   "aten::cauchy_", "aten::random_"}


def read_args(func, args, kwargs) -> tuple[tuple, dict]:
    """An op's arguments less those it only writes: `out=` buffers, and `self` of an op that overwrites it all
    (copy_, fill_, zero_...). A buffer's old contents (a NaN-filled or uninitialised workspace) are not what the
    op turned into inf/NaN."""
    try:
        schema = func._schema
        if not schema.is_mutable:
            return args, kwargs
        drop = {a.name for a in schema.arguments if a.is_out}
        if schema.name in _OVERWRITE_SELF and schema.arguments and schema.arguments[0].name == "self":
            drop.add("self")
        if not drop:
            return args, kwargs
        names = [a.name for a in schema.arguments]
        return (tuple(v for i, v in enumerate(args) if i >= len(names) or names[i] not in drop),
                {k: v for k, v in kwargs.items() if k not in drop})
    except Exception:
        return args, kwargs


def scalar_exponent(func, args) -> float | None:
    """The number a tensor is raised to, when `func` is aten::pow with a scalar exponent (pow.Tensor_Scalar)."""
    if func._schema.name != "aten::pow" or len(args) < 2 or not isinstance(args[0], torch.Tensor) \
            or isinstance(args[1], torch.Tensor):
        return None
    try:
        return float(args[1])
    except (TypeError, ValueError):
        return None


def absmin(ins: list) -> float | None:
    """The smallest nonzero finite |value| among the inputs (None when there is none)."""
    with torch.no_grad():
        vals = [t.detach().abs()[torch.isfinite(t) & (t != 0)] for t in ins]
        return min((float(v.min()) for v in vals if v.numel()), default=None)


def scalar_base(func, args) -> float | None:
    """The number `func` raised to a tensor, when it is aten::pow with a scalar base (pow.Scalar: `c ** x`)."""
    if func._schema.name != "aten::pow" or not args or isinstance(args[0], torch.Tensor):
        return None
    try:
        return float(args[0])
    except (TypeError, ValueError):
        return None
