"""The always-on headroom series' per-step record (StepRecord.headroom): its encoding, and the same series built
from a sampled step's full statistics (`from_calls`), so that a step's headroom has one definition whichever
recorder measured it. The live reducer that fills it on routine steps is ampdoctor/record/headroom.py."""
from __future__ import annotations

import math

__all__ = ["encode", "from_calls", "merge"]

_INF = math.inf
_CODE_OF_NAME = {"float16": "h", "bfloat16": "b", "float32": "f", "float64": "d"}


def merge(a, b):
    """The larger abs-max of two calls; NaN wins over inf wins over finite; None is 'not measured'."""
    if a is None:
        return b
    if b is None:
        return a
    if a != a or b != b:
        return math.nan
    return a if a >= b else b


def _round(v):
    if v is None or v != v or v in (_INF, -_INF) or v == 0:
        return v
    return float(f"{v:.3g}")


def encode(fwd: list, bwd: list, dtype: str, first_bad: int | None = None) -> dict:
    """The compact per-step record (StepRecord.headroom): per module, in `RunMeta.modules` order, the forward
    output's abs-max and the abs-max of the gradient into it (as autograd saw it: scaled by the step's loss
    scale), 3 significant digits; `Infinity`/`NaN` when the values were not finite; null when not measured.
    `dtype`: one character per module, the output's dtype (h float16, b bfloat16, f float32, d float64, - none).
    `first_bad` (key "first_bad", only when set): the module whose forward output was the first, in the order the
    forward made them, that held inf/NaN (a routine step's series: where the forward first went non-finite)."""
    out = {"fwd": [_round(v) for v in fwd], "bwd": [_round(v) for v in bwd], "dtype": dtype}
    if first_bad is not None:
        out["first_bad"] = first_bad
    return out


def from_calls(calls, slots: dict[str, int], n: int, skip=frozenset()) -> dict | None:
    """The same series on a sampled step, from its ModuleCall records (the full statistics); `skip`: the slots
    of modules that pass their input's range on (`passes_on`), not read on routine steps either."""
    if not calls:
        return None
    fwd: list = [None] * n
    bwd: list = [None] * n
    dts = ["-"] * n
    for c in calls:
        s = slots.get(c.module)
        if s is None or s in skip or c.out is None or c.out.dtype not in ("float16", "bfloat16"):
            continue  # as on routine steps: only low-precision values
        for dst, st in ((fwd, c.out), (bwd, c.gout)):
            if st is None:
                continue
            v = math.nan if st.nan else _INF if (st.posinf or st.neginf) else st.absmax
            dst[s] = merge(dst[s], v)
        if c.out is not None and dts[s] == "-":
            dts[s] = _CODE_OF_NAME.get(c.out.dtype, "f")
    return encode(fwd, bwd, "".join(dts))
