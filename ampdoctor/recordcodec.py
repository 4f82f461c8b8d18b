"""How the records cross to and from disk (ampdoctor/records.py owns the record types): `plain`, a fast
`dataclasses.asdict`, and the checks that a record read back from a run directory has the types it claims (a record
from disk is a stranger's data)."""
from __future__ import annotations

import math
import numbers
from dataclasses import fields

_STEP_INTS = ("step", "micro_batches", "discarded")
_STEP_FLOATS = ("loss", "scale", "next_scale", "grad_norm")
_STEP_BOOLS = ("sampled", "loss_finite", "found_inf", "skipped", "grad_finite", "output_finite", "loss_in_model",
               "loss_low", "loss_consts")
_STEP_STRS = ("autocast", "capture")


_MAX_INT = 2 ** 53
"""A JSON integer at or beyond this is no step, count or measurement ampdoctor wrote (json reads any size of integer:
10**400 would reach float() and TensorBoard's int64 steps)."""


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:20] + f"... ({len(r)} characters)"


def _check_scalars(d: dict) -> None:
    """A step record's scalar fields have their types (a record from disk is a stranger's data: a step of "2",
    NaN or 1e999 would reach the reporters' int()/float() calls). Raises ValueError naming the field."""
    for k in _STEP_INTS:
        v = d.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= _MAX_INT:
            raise ValueError(f"{k} must be a non-negative integer below 2**53, not {_short(v)}"[:120])
    for k in _STEP_FLOATS:
        v = d.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or isinstance(v, int) and abs(v) >= _MAX_INT):
            raise ValueError(f"{k} must be a number within float range, not {_short(v)}"[:120])
    for k in _STEP_BOOLS:
        v = d.get(k)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{k} must be true/false, not {v!r}"[:120])
    for k in _STEP_STRS:
        v = d.get(k)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{k} must be a string, not {v!r}"[:120])


_NAMES: dict = {}


def _fromd(cls, d: dict):
    """cls(**d) with the keys cls has no field for left out (a newer writer's, or a stranger's)."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = frozenset(f.name for f in fields(cls))
    if names.issuperset(d):
        return cls(**d)
    return cls(**{k: v for k, v in d.items() if k in names})


_FIELDS: dict = {}


def plain(obj):
    """`dataclasses.asdict` for the records: nested dataclasses, lists, tuples and dicts rebuilt (nothing mutable
    shared with the record), primitives as they are. asdict deep-copies every value through a generic recursion;
    a sampled step (~80 module calls) took 12 ms that way, and each is written to the run dir and the spill file."""
    t = type(obj)
    if t in _PRIMITIVE:
        return obj
    names = _FIELDS.get(t)
    if names is None:
        if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
            names = _FIELDS[t] = tuple(f.name for f in fields(obj))
        elif isinstance(obj, list):
            return [v if type(v) in _PRIMITIVE else plain(v) for v in obj]
        elif isinstance(obj, dict):
            return {k: v if type(v) in _PRIMITIVE else plain(v) for k, v in obj.items()}
        elif isinstance(obj, tuple):  # a namedtuple keeps its type, as with asdict
            return t(*(plain(v) for v in obj)) if hasattr(obj, "_fields") else t(plain(v) for v in obj)
        else:
            return _builtin(obj)
    d = getattr(obj, "__dict__", None)
    if d is not None and len(d) == len(names):  # the fields themselves, in their order (set by __init__): copied
        d = d.copy()                            # in one move, nested values rebuilt (0.6x of getattr per field)
        for k, v in d.items():
            if type(v) not in _PRIMITIVE:
                d[k] = plain(v)
        return d
    d = {}
    for k in names:
        v = getattr(obj, k)
        d[k] = v if type(v) in _PRIMITIVE else plain(v)
    return d


_PRIMITIVE = frozenset({int, float, str, bool, type(None)})


def _builtin(obj):
    """A number or string of another type (numpy's float64, a `str` Enum) as the built-in value JSON writes for it,
    so that every writer of a record (the run directory's JSON, the spill file's marshal: record/storage.py) reads
    back the same value; anything else as it is."""
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, numbers.Integral):  # (a bool is a _PRIMITIVE: it never comes here)
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    return obj


def _int_inputs(v) -> list:
    """StepRecord.int_inputs from disk: a list of {"module": str, "type": str, "dtype": str, numbers...}."""
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ValueError(f"int_inputs must be a list of objects, not {_short(v)}"[:120])
    for x in v:
        if not isinstance(x.get("module"), str) or not isinstance(x.get("type", ""), str) \
                or not isinstance(x.get("dtype", ""), str):
            raise ValueError(f"int_inputs entries need string module/type/dtype, not {_short(x)}"[:120])
        for k in ("max", "exact_up_to", "rounds_products_from"):
            n = x.get(k, 0)
            if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
                raise ValueError(f"int_inputs {k} must be a finite number, not {_short(n)}"[:120])
    return v
