"""Always-on headroom: every step, every module, the abs-max of its forward output and of the gradient flowing
into that output, with inf/NaN showing through (an abs-max that is not finite).

The hooks only keep a reference: a module's forward post-hook appends its output tensor and the module's slot
(its index in `RunMeta.modules`, fixed at watch start) to a pending list, and puts a tensor hook on the output
that does the same with its gradient. Every `FLUSH_TENSORS` tensors (or `FLUSH_BYTES` of them, so the references
never hold much memory alive) one multi-tensor kernel per (device, dtype) group, `torch._foreach_norm(ord=inf)`,
turns the pending tensors into a small vector of abs-maxes on the device (NaN and inf propagate, so "not finite"
falls out of the same number). At the step's one transfer (ampdoctor/sync.py `presync`) those vectors go to the
host with the step's other values; `host_series` folds them into one value per module.

Only values that can meet a low-precision op are read: fp16/bf16 tensors, and fp32 ones inside an autocast
region (a watch on an fp32 run without autocast reads nothing). On sampled steps the full statistics hooks measure the same tensors, and the series comes from those records
(`from_calls`), so there is one definition of a step's headroom either way.
"""
from __future__ import annotations

import math

import torch

from . import cpustats
from .modulehooks import InertHook
from .tensors import flatten_tensors

__all__ = ["Headroom", "HeadroomHook", "DTYPE_CODES", "from_calls", "encode"]

FLUSH_TENSORS = 64           # pending tensors that trigger one batched reduction
FLUSH_BYTES = 64 << 20       # ... or pending bytes: references must not keep large tensors alive for long
DTYPE_CODES = {torch.float16: "h", torch.bfloat16: "b", torch.float32: "f", torch.float64: "d"}
_CODE_OF_NAME = {"float16": "h", "bfloat16": "b", "float32": "f", "float64": "d"}
_Tensor = torch.Tensor
_INF = math.inf
_LOW = (torch.float16, torch.bfloat16)


class Headroom:
    """The pending tensors and reduced abs-max vectors of the open step (owned by the StepMachine)."""

    __slots__ = ("on", "wide", "n", "ft", "fs", "bt", "bs", "nbytes", "done", "alias", "last", "last_slot", "dtypes")

    def __init__(self, n_slots: int):
        self.on = False            # recording (routine steps); off on sampled steps, when disabled or suspended
        self.wide = False          # fp32/fp64 values too: only inside an autocast region, where they may be cast
        #                            down (set at the root's forward); outside one nothing low-precision meets them
        self.n = n_slots
        self.dtypes: list[str] = ["-"] * n_slots
        self.reset()

    def reset(self) -> None:
        self.ft, self.fs, self.bt, self.bs = [], [], [], []
        self.nbytes = 0
        self.done: list[tuple[str, torch.Tensor, list[int]]] = []  # (phase, abs-max vector, slots)
        self.alias: list[tuple[int, int]] = []                     # (slot, slot whose tensor it returned)
        self.last = None
        self.last_slot = -1
        self.dtypes = ["-"] * self.n

    # -- hot path (called by the hooks) -----------------------------------------------------------------
    def forward(self, slot: int, out, tap) -> None:
        if isinstance(out, _Tensor):
            if out is self.last:          # a container returning its child's output: measured once
                self.alias.append((slot, self.last_slot))
                self.last_slot = slot
                return
            tensors = (out,)
        else:
            tensors = flatten_tensors(out, [])
        for t in tensors:
            if t.dtype not in _LOW and (not self.wide or not t.is_floating_point()) or t.layout != torch.strided:
                continue
            self.ft.append(t)  # not detached (no allocation): flush reduces under no_grad
            self.fs.append(slot)
            self.nbytes += t.nbytes
            if t.requires_grad and not t.is_leaf:
                t.register_hook(tap)
            self.last, self.last_slot = t, slot
        if len(self.ft) + len(self.bt) >= FLUSH_TENSORS or self.nbytes >= FLUSH_BYTES:
            self.flush()

    def grad(self, slot: int, g) -> None:
        self.bt.append(g)
        self.bs.append(slot)
        self.nbytes += g.nbytes
        if len(self.ft) + len(self.bt) >= FLUSH_TENSORS or self.nbytes >= FLUSH_BYTES:
            self.flush()

    # -- batched reduction ------------------------------------------------------------------------------
    def flush(self) -> None:
        with torch.no_grad():
            self._reduce()
        self.ft, self.fs, self.bt, self.bs = [], [], [], []
        self.nbytes = 0
        self.last = None

    def _reduce(self) -> None:
        for phase, ts, ss in (("f", self.ft, self.fs), ("b", self.bt, self.bs)):
            if not ts:
                continue
            groups: dict = {}
            for t, s in zip(ts, ss):
                g = groups.get((t.device, t.dtype))
                if g is None:
                    g = groups[(t.device, t.dtype)] = ([], [])
                g[0].append(t)
                g[1].append(s)
            for (dev, dt), (gt, gs) in groups.items():
                if dev.type == "cpu" and cpustats.available() and all(cpustats.supports(t) for t in gt):
                    v = _cpu_absmax(gt)
                else:  # one multi-tensor kernel: NaN and inf propagate into the abs-max
                    v = torch.stack(torch._foreach_norm(gt, _INF))
                self.done.append((phase, v if dt in (torch.float32, torch.float64) else v.float(), gs))
                code = DTYPE_CODES.get(dt, "f")
                for s in gs:
                    self.dtypes[s] = code

    def parts(self) -> list[tuple[str, torch.Tensor]]:
        """The reduced vectors for the step's one transfer, keyed `hr:<i>`."""
        self.flush()
        return [(f"hr:{i}", v) for i, (_, v, _) in enumerate(self.done)]

    def host_series(self, host: dict) -> dict | None:
        """The step's series from the values read back: `{"fwd": [...], "bwd": [...], "dtype": "..."}` (see
        `encode`); None when nothing was recorded."""
        if not self.done:
            self.reset()
            return None
        fwd: list = [None] * self.n
        bwd: list = [None] * self.n
        for i, (phase, _, slots) in enumerate(self.done):
            vals = host.get(f"hr:{i}")
            if vals is None:
                continue
            dst = fwd if phase == "f" else bwd
            for s, v in zip(slots, vals):
                dst[s] = _merge(dst[s], v)
        for slot, src in self.alias:
            fwd[slot] = _merge(fwd[slot], fwd[src])
            bwd[slot] = _merge(bwd[slot], bwd[src])
            if self.dtypes[slot] == "-":
                self.dtypes[slot] = self.dtypes[src]
        out = encode(fwd, bwd, "".join(self.dtypes))
        self.reset()
        return out


def _cpu_absmax(ts: list) -> torch.Tensor:
    """On the CPU, `_foreach_norm(ord=inf)` is a slow per-tensor loop (several times a plain pass): the one-pass C
    statistics (ampdoctor/cpustats.py) give the finite abs-max and the NaN/inf counts, folded into one number."""
    rows = torch.stack([cpustats.stats(t, t.dtype) for t in ts])   # records.STAT_FIELDS order
    v = rows[:, 5].clone()
    v[(rows[:, 2] + rows[:, 3]) > 0] = _INF
    v[rows[:, 1] > 0] = math.nan
    return v


def _merge(a, b):
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


def encode(fwd: list, bwd: list, dtype: str) -> dict:
    """The compact per-step record (StepRecord.headroom): per module, in `RunMeta.modules` order, the forward
    output's abs-max and the abs-max of the gradient into it (as autograd saw it: scaled by the step's loss
    scale), 3 significant digits; `Infinity`/`NaN` when the values were not finite; null when not measured.
    `dtype`: one character per module, the output's dtype (h float16, b bfloat16, f float32, d float64, - none)."""
    return {"fwd": [_round(v) for v in fwd], "bwd": [_round(v) for v in bwd], "dtype": dtype}


def from_calls(calls, slots: dict[str, int], n: int) -> dict | None:
    """The same series on a sampled step, from its ModuleCall records (the full statistics)."""
    if not calls:
        return None
    fwd: list = [None] * n
    bwd: list = [None] * n
    dts = ["-"] * n
    for c in calls:
        s = slots.get(c.module)
        if s is None or c.out is None or not (c.autocast or c.out.dtype in ("float16", "bfloat16")):
            continue  # as on routine steps: fp32 values outside autocast meet no low-precision op
        for dst, st in ((fwd, c.out), (bwd, c.gout)):
            if st is None:
                continue
            v = math.nan if st.nan else _INF if (st.posinf or st.neginf) else st.absmax
            dst[s] = _merge(dst[s], v)
        if c.out is not None and dts[s] == "-":
            dts[s] = _CODE_OF_NAME.get(c.out.dtype, "f")
    return encode(fwd, bwd, "".join(dts))


class _GradTap:
    """Tensor hook on a module's output: keep the gradient flowing into it (see Headroom.grad)."""
    __slots__ = ("hr", "slot")

    def __init__(self, hr: Headroom, slot: int):
        self.hr, self.slot = hr, slot

    def __call__(self, g):
        hr = self.hr
        if hr.on and g is not None:
            try:
                hr.grad(self.slot, g)
            except Exception:  # never break the user's backward; the step just lacks this value
                pass
        return None


class HeadroomHook:
    """The forward post-hook (without kwargs) on every module below the root: hands its output to Headroom.

    Compile-safe and copy-safe like modulehooks.ModuleHook: under torch.compile it compiles away (checked first,
    so no watch state is guarded), and a copied or pickled model carries an InertHook instead."""
    __slots__ = ("hr", "slot", "tap", "fail")

    def __init__(self, hr: Headroom, slot: int, fail):
        self.hr, self.slot, self.tap, self.fail = hr, slot, _GradTap(hr, slot), fail

    def register(self, module: torch.nn.Module):
        return module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if torch.compiler.is_compiling():
            return None
        hr = self.hr
        if hr.on:
            try:
                hr.forward(self.slot, output, self.tap)
            except Exception as e:  # never break the user's model
                self.fail(e)
        return None

    def __deepcopy__(self, memo):
        return InertHook("post")

    def __copy__(self):
        return InertHook("post")

    def __reduce__(self):
        return (InertHook, ("post",))
