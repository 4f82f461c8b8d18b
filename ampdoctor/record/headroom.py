"""Always-on headroom: every step, every module, the abs-max of its fp16/bf16 forward output and of the gradient
flowing into that output, with inf/NaN showing through (an abs-max that is not finite).

The hooks only keep a reference: a module's forward post-hook appends its output tensor and the module's slot
(its index in `RunMeta.modules`, fixed at watch start) to a pending list, and puts a pre-hook on the autograd
node that made the output (hooks.GradTap), which does the same with the gradient flowing into it. Every `FLUSH_TENSORS` tensors (or `FLUSH_BYTES_*` of them, so that the
references never hold much memory alive; gradients, which nothing else keeps, sooner) one multi-tensor kernel
per (device, dtype) group, `torch._foreach_norm(ord=inf, dtype=float32)`, turns the pending tensors into 0-d
abs-maxes on the device (NaN and inf propagate, so "not finite" falls out of the same number). At the step's
one transfer (ampdoctor/record/transfer.py `presync`) they are stacked into one vector per device and go to the host with
the step's other values; `host_series` folds them into one value per module, in the record format of
ampdoctor/record/series.py.

Only fp16/bf16 values are read: an fp32 value has no low-precision range to lose (when an op casts it down,
that op's own low-precision output shows it), and the `headroom_trend` rule reads nothing else. On sampled
steps the full statistics hooks measure the same tensors, and the series comes from those records
(`from_calls`), so there is one definition of a step's headroom either way.
"""
from __future__ import annotations

import math
from time import perf_counter as _now

import torch

from . import absmax, cpustats
from .series import encode, merge
from .tables import is_dense
from .stats import is_wrapped
from ..tensors import flatten_tensors

__all__ = ["Headroom", "DTYPE_CODES"]

FLUSH_TENSORS = 128                 # pending tensors that trigger one batched reduction
FLUSH_BYTES_FORWARD = 512 << 20     # ... or pending bytes of forward outputs (most are saved for the backward anyway;
#                                     the root's forward flushes them all when it returns: forward_done)
FLUSH_BYTES_BACKWARD = 256 << 20    # ... or of gradients, which only these references keep alive (the backward
#                                     frees the saved activations meanwhile; its peak is where it begins)
READ_BYTES = 64 << 20               # of a larger value, its leading whole rows up to this size are read (see _lead)
DTYPE_CODES = {torch.float16: "h", torch.bfloat16: "b", torch.float32: "f", torch.float64: "d"}
_Tensor = torch.Tensor
_INF = math.inf
_LOW = (torch.float16, torch.bfloat16)
_STRIDED = torch.strided
_F32 = torch.float32


class Headroom:
    """The pending tensors and reduced abs-maxes of the open step (owned by the StepMachine)."""

    __slots__ = ("clean", "on", "n", "ft", "fs", "bt", "bs", "fbytes", "bbytes", "norms", "vecs", "done", "alias",
                 "last", "last_slot", "staged", "tables", "reads", "observing", "called", "read", "last_pass",
                 "static_alias", "seen_alias", "spent")

    def __init__(self, n_slots: int):
        self.on = False            # recording (routine steps); off on sampled steps, when disabled or suspended
        self.n = n_slots
        self.tables: dict = {}     # device -> absmax.AbsMaxTable (CUDA, Triton): kept across steps, reset per step
        self.reads = 0             # values handed over so far (never reset: `forward` compares before and after)
        # which hooks earn their cost (see `plan`): on an observed step, the slots called and those that read a
        # value
        self.observing = False
        self.called: set[int] = set()
        self.read: set[int] = set()
        self.last_pass = -1
        self.static_alias: list[tuple[int, int]] = []  # (slot, slot) of pruned containers, applied every step
        self.seen_alias: list[tuple[int, int, int]] = []  # the observed step's (slot, source, pass-on slot or -1)
        self.clean = False  # True while nothing was handed over since the last reset
        self.spent = 0.0  # host seconds of the series' own bulk work (flushes, staging, read-back): HeadroomHooks
        #                   hands them to the budget (budget.py) as the step's floor of what the series costs
        self.reset()

    def reset(self) -> None:
        if self.clean:  # nothing was handed over since the last reset (a step without the series)
            return
        for tab in self.tables.values():
            tab.reset()
        self.ft, self.fs, self.bt, self.bs = [], [], [], []
        self.fbytes = self.bbytes = 0
        self.norms: dict = {}      # device -> 0-d fp32 abs-maxes from _foreach_norm (stacked once, in parts)
        self.vecs: dict = {}       # device -> abs-max vectors (the CPU's one-pass statistics)
        self.done: list[tuple[str, str, list[int], tuple]] = []  # (phase, dtype code, slots, where) per group
        self.alias: list[tuple[int, int]] = []                   # (slot, slot whose tensor it returned)
        self.last = None
        self.last_slot = -1
        self.last_pass = -1
        self.staged: list | None = None  # the step's parts, stacked (see stage)
        self.clean = True

    # -- hot path (called by the hooks): keep a reference, nothing else ----------------------------------
    def forward(self, slot: int, out, tap) -> None:
        if self.observing:
            self.called.add(slot)
            n0 = self.reads
            self._forward(slot, out, tap)
            if self.reads != n0:
                self.read.add(slot)
            return
        self._forward(slot, out, tap)

    def _forward(self, slot: int, out, tap) -> None:
        self.clean = False
        tensors = (out,) if isinstance(out, _Tensor) else flatten_tensors(out, [])
        last = self.last
        for t in tensors:
            if t is last:  # a container returning its child's output (or holding it: HF's logits): measured once
                self.alias.append((slot, self.last_slot))
                if self.observing:
                    self.seen_alias.append((slot, self.last_slot, self.last_pass))
                continue
            if t.dtype not in _LOW or t.layout != _STRIDED or is_wrapped(t):
                continue  # fp32 values have no fp16/bf16 range to lose; a cast into a low-precision op shows there
                #           (a torch.func transform's wrapper has no values of its own: stats.is_measurable)
            nb = t.nbytes
            self.ft.append(t if nb <= READ_BYTES else _lead(t))  # not detached: the reduction runs under no_grad
            self.fs.append(slot)
            self.fbytes += nb
            self.reads += 1
            fn = t.grad_fn
            if fn is not None:  # the gradient into this output, when the backward reaches its node
                nr = t.output_nr
                fn.register_prehook(tap if nr == 0 else tap.at(nr))
            last = t
        if last is not self.last:
            self.last, self.last_slot, self.last_pass = last, slot, -1
        elif self.alias and self.alias[-1][1] == self.last_slot:
            self.last_slot = slot
        if len(self.ft) >= FLUSH_TENSORS or self.fbytes >= FLUSH_BYTES_FORWARD:
            self.flush_forward()

    def passed(self, slot: int, args, output) -> None:
        """A module that passes its input's range on (`passes_on`) returned `output`: if its input was the last
        value read, its output stands for that value (a container returning it is an alias, not a new read)."""
        self.clean = False
        if self.observing:
            self.called.add(slot)
        if args and args[0] is self.last and isinstance(output, _Tensor):
            self.last = output
            self.last_pass = slot

    def plan(self, fixed: int = 0) -> tuple[set[int], list[tuple[int, int]]]:
        """After an observed step: the slots whose hooks cost without reading anything, and the containers among
        them that always returned one child's value (their series is that child's, filled in by `host_series`).

        A module whose every call returned only fp32 values (an fp32 residual stream, LayerNorm under CUDA
        autocast, fp32 embeddings), or one value it received from a child (nanoGPT's `mlp`, `attn`), reads
        nothing on later steps either; a pass-on module (see hooks.passes_on) is needed only while a container
        returns its output. A slot not called on the observed step keeps its hook (a branch taken later);
        `fixed` (the root's slot, read by the step machine's own hook) is never pruned."""
        src: dict[int, int] = {}
        for slot, s, _ in self.seen_alias:
            src[slot] = s if src.get(slot, s) == s else -1
        idle = set()
        static = []
        for slot in sorted(self.called - self.read - {fixed}):
            s = src.get(slot)
            if s == -1:
                continue  # aliased different children: keep reading it
            if s is not None:
                static.append((slot, s))
            idle.add(slot)
        # a pass-on module stays only where a container that keeps its hook returned its output
        idle -= {p for slot, _, p in self.seen_alias if p >= 0 and slot not in idle}
        order = {slot: i for i, (slot, _, _) in enumerate(self.seen_alias)}
        static.sort(key=lambda a: order.get(a[0], 0))  # inner containers first, as the calls came
        self.static_alias = [(slot, s) for slot, s in static if slot in idle]
        self.observing = False
        self.called, self.read, self.seen_alias = set(), set(), []
        return idle, self.static_alias

    def observe(self) -> None:
        """Record which hooks read something on the next step (see `plan`); the pruned state starts over."""
        self.observing = True
        self.static_alias = []
        self.called, self.read, self.seen_alias = set(), set(), []

    def grad(self, slot: int, g) -> None:
        self.clean = False
        nb = g.nbytes
        self.bt.append(g if nb <= READ_BYTES else _lead(g))
        self.bs.append(slot)
        self.bbytes += nb
        # a gradient is kept alive only by this reference: flushed early, so the backward's peak does not grow
        if len(self.bt) >= FLUSH_TENSORS or self.bbytes >= FLUSH_BYTES_BACKWARD:
            self.flush_backward()

    # -- batched reduction -------------------------------------------------------------------------------
    def forward_done(self) -> None:
        """The root's forward returned: nothing forward stays referenced into the backward (where the peak is)."""
        self.flush_forward()
        self.last = None

    def flush(self) -> None:
        self.flush_forward()
        self.flush_backward()
        self.last = None

    def flush_forward(self) -> None:
        if self.ft:
            t = _now()
            self._reduce("f", self.ft, self.fs)
            self.ft, self.fs, self.fbytes = [], [], 0
            self.spent += _now() - t

    def flush_backward(self) -> None:
        if self.bt:
            t = _now()
            self._reduce("b", self.bt, self.bs)
            self.bt, self.bs, self.bbytes = [], [], 0
            self.spent += _now() - t

    def _reduce(self, phase: str, ts: list, ss: list) -> None:
        self.staged = None
        if ts[0].is_cuda and ts[0].dtype in _LOW and absmax.absmax_kernel_ready():
            ts, ss = self._reduce_table(phase, ts, ss)
            if not ts:
                return
        t0 = ts[0]
        dev0, dt0 = t0.device, t0.dtype
        if all(t.dtype is dt0 and t.device == dev0 for t in ts):
            groups = {(dev0, dt0): (ts, ss)}
        else:
            groups = {}
            for t, s in zip(ts, ss):
                g = groups.get((t.device, t.dtype))
                if g is None:
                    g = groups[(t.device, t.dtype)] = ([], [])
                g[0].append(t)
                g[1].append(s)
        with torch.no_grad():
            for (dev, dt), (gt, gs) in groups.items():
                code = DTYPE_CODES.get(dt, "f")
                if dev.type == "cpu" and cpustats.available() and all(cpustats.supports(t) for t in gt):
                    self.vecs.setdefault(dev, []).append(cpustats.absmax(gt))
                    self.done.append((phase, code, gs, ("v", dev)))
                    continue
                # one multi-tensor kernel (NaN and inf propagate into the abs-max), fp32 results
                self.norms.setdefault(dev, []).extend(torch._foreach_norm(gt, _INF, dtype=_F32))
                self.done.append((phase, code, gs, ("n", dev)))

    def _reduce_table(self, phase: str, ts: list, ss: list) -> tuple[list, list]:
        """The CUDA path: the tensors of the first one's device and dtype that `absmax.AbsMaxTable` can read
        (dense, 16-byte aligned) in one Triton launch; returns the others (for _foreach_norm)."""
        t0 = ts[0]
        dt0, d0 = t0.dtype, t0.get_device()
        take, slots, rest, rest_s = [], [], [], []
        for t, s in zip(ts, ss):  # absmax.absmax_available, inlined: this loop runs for every value read
            if t.dtype is dt0 and t.get_device() == d0 and not t.data_ptr() & 15 and t.numel() and (
                    t.is_contiguous() or is_dense(t)):
                take.append(t)
                slots.append(s)
            else:
                rest.append(t)
                rest_s.append(s)
        if take:
            dev = t0.device
            tab = self.tables.get(dev)
            if tab is None:
                tab = self.tables[dev] = absmax.AbsMaxTable(dev)
            n0 = tab.n
            try:
                tab.add(take)
            except Exception:  # Triton cannot compile or launch here: _foreach_norm from now on
                tab.n = n0
                absmax.disable_absmax()
                return ts, ss
            self.done.append((phase, DTYPE_CODES.get(dt0, "f"), slots, ("t", dev)))
        return rest, rest_s

    def stage(self) -> None:
        """Reduce and stack what is pending now, at `scaler.step()`'s entry: the kernels are queued while the
        backward still runs on the GPU, before GradScaler's own synchronisation, instead of after it (when the GPU
        waits for the host)."""
        if self.on:
            self.parts()

    def parts(self) -> list[tuple[str, torch.Tensor]]:
        """The reduced values for the step's one transfer, one vector per device and kind, keyed `hr:<kind><i>`
        in `self.done`'s order of first use."""
        if self.clean:  # nothing handed over since the last reset
            return []
        self.flush()
        if self.staged is not None:
            return self.staged
        t = _now()
        out = []
        for i, (dev, ts) in enumerate(self.norms.items()):
            out.append((f"hr:n{i}", torch.stack(ts)))
        for i, (dev, vs) in enumerate(self.vecs.items()):
            out.append((f"hr:v{i}", torch.cat(vs) if len(vs) > 1 else vs[0]))
        for dev, tab in self.tables.items():
            if tab.n:
                out.append((f"hr:t:{dev}", tab.vector()))
        self.staged = out
        self.spent += _now() - t
        return out

    def host_series(self, host: dict) -> dict | None:
        """The step's series from the values read back: `{"fwd": [...], "bwd": [...], "dtype": "..."}` (see
        `encode`); None when nothing was recorded."""
        if not self.done:
            self.reset()
            return None
        t = _now()
        vals = {("n", dev): host.get(f"hr:n{i}") for i, dev in enumerate(self.norms)}
        vals.update({("v", dev): host.get(f"hr:v{i}") for i, dev in enumerate(self.vecs)})
        vals.update({("t", dev): host.get(f"hr:t:{dev}") for dev in self.tables})
        at = dict.fromkeys(vals, 0)
        fwd: list = [None] * self.n
        bwd: list = [None] * self.n
        dtypes = ["-"] * self.n
        first = None  # the first value of the forward, in the order the hooks read them, that was not finite
        for phase, code, slots, where in self.done:
            k = at[where]
            at[where] = k + len(slots)
            got = vals[where]
            if got is None:
                continue
            dst = fwd if phase == "f" else bwd
            for s, v in zip(slots, got[k:k + len(slots)]):
                dst[s] = merge(dst[s], v)
                if dtypes[s] == "-":
                    dtypes[s] = code
                if first is None and phase == "f" and (v != v or v == _INF or v == -_INF):
                    first = s
        for slot, src in self.alias + self.static_alias:
            fwd[slot] = merge(fwd[slot], fwd[src])
            bwd[slot] = merge(bwd[slot], bwd[src])
            if dtypes[slot] == "-":
                dtypes[slot] = dtypes[src]
        out = encode(fwd, bwd, "".join(dtypes), first)
        self.reset()
        self.spent += _now() - t
        return out


def _lead(t: torch.Tensor) -> torch.Tensor:
    """The leading whole rows (last dimension) of a contiguous value larger than READ_BYTES, up to that size: the
    first samples of the batch. A language model's logits (nanoGPT at B=64, T=256: 1.6 GB, and as much again for
    their gradient) otherwise cost more GPU time to read every step than the rest of the model together; a
    trend in the range of the first few hundred rows is the trend of all of them. Sampled steps read everything
    (the full statistics), and inf/NaN anywhere is still caught by the step's own checks."""
    if not t.is_contiguous() or t.dim() < 2:
        return t
    row = t.shape[-1]
    n = max(row, READ_BYTES // t.element_size() // row * row)
    return t.view(-1)[:n]
