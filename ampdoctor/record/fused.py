"""The CUDA fast path (Triton kernels) of the full statistics: every statistic of many tensors in one launch
(`StatBuffer`, for `stats.full_stats` on sampled steps). The always-on headroom's abs-max of many tensors in one
launch is record/absmax.py's; both send their tables through record/tables.py's `MetaRing`.

A hook hands `StatBuffer.add` a tensor and gets its row at once; the arithmetic waits until `FLUSH_TENSORS`
tensors (or `FLUSH_BYTES_FORWARD` of a forward's values, `FLUSH_BYTES` of gradients) are pending, and the root's
forward flushes when it returns; then one kernel per (stream, dtype, thresholds, size class), their tables uploaded
in one copy, reads them all through a table of (address, numel, row) and adds each program's counts (NaN, ±inf, zeros,
near-max, below-normal, would-overflow-in-ref) and extremes (finite abs-max, smallest nonzero) into the tensor's
row. A hook's cost is an append, not a launch (a Triton launch is ~25-55 µs of host time; GPT-2 at every=1 measures
~360 tensors a step). Measuring late is only right for a value nobody writes in place in between (a ReLU(inplace)
after a norm, `out += identity`): `DeferPlan` learns, on the first sampled step (everything measured at once, the
versions compared at the flush), which (module, call, slot) values are written later, and those are measured at
once from then on; a late write the plan did not foresee is learned the same way. A value that is not one dense
16-byte-aligned block, an expanded one, or one of another dtype gets its own launch at once (the per-tensor kernel).
The eager `stats.full_stats` is the reference: `tests/test_fused.py` checks that both give identical numbers (on a
GPU). Import is lazy and guarded: without CUDA or Triton, `available()` is False and callers use the eager path.
"""
from __future__ import annotations

import math

import torch

from .hostcopy import current_stream
from .tables import MetaRing, is_dense, triton_cdiv

__all__ = ["available", "StatBuffer", "DeferPlan"]

_KERNEL = None
_BLOCK = 1024          # values per program and iteration
_MAX_PROGRAMS = 1024   # grid cap (a few waves on an H100/H200's 132 SMs)
_T_BLOCK = 1024        # the table kernel's values per program and iteration
_T_ITERS = 8           # the table kernel: a program reads at least this many blocks of its tensor ...
_T_MAX_PROGRAMS = 512  # ... and a tensor gets this many programs at most
_T_WARPS = 4           # the table kernel's warps per program (Triton's default)
FLUSH_TENSORS = 128    # pending tensors that trigger one batched pass
FLUSH_BYTES = 256 << 20  # ... or pending bytes of gradients (only the reference keeps them alive), of values of a
#                          forward without grad, and of anything pending once the backward began
FLUSH_BYTES_FORWARD = 512 << 20  # ... or of a grad-enabled forward's values: most are saved for the backward anyway,
#                                  and the root's forward flushes them all when it returns (StatBuffer.forward_done)


def available(t: torch.Tensor) -> bool:
    if t.device.type != "cuda" or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return _kernel() is not None


def _kernel():
    """(per-tensor kernel, table kernel), built on first use; None where Triton cannot compile."""
    global _KERNEL
    if _KERNEL is None:
        try:
            _KERNEL = _build()
        except Exception:  # no Triton, or it cannot compile here: the eager path serves
            _KERNEL = False
    return _KERNEL or None


def _off() -> None:
    """A kernel failed to compile or launch: the fused statistics are off from now on (`available` is False; the
    callers' eager path serves; a buffer's pending rows are filled with torch ops)."""
    global _KERNEL
    _KERNEL = False


def _build():
    from . import fusedkernels
    return fusedkernels.stats_kernel, fusedkernels.stats_table_kernel


class DeferPlan:
    """Which of a watch's measured values may be read late (see the module docstring), learned from the first
    sampled step on: keys (module, call, slot, position) of values written in place between their hook and the
    flush. Kept by the StepMachine for the watch's lifetime."""

    __slots__ = ("learned", "volatile", "rings")

    def __init__(self):
        self.learned = False   # a flush compared versions: from the next step on, values not volatile wait
        self.volatile: set = set()
        self.rings: dict = {}  # device -> MetaRing: the table kernel's tables, kept across steps

    def ring(self, device: torch.device) -> "MetaRing":
        """The device's MetaRing, its buffers free to be written from the start (a step's first use)."""
        r = self.rings.get(device)
        if r is None:
            r = self.rings[device] = MetaRing(device)
        r.reset()
        return r


class StatBuffer:
    """Rows of counts (int64 x 7) and extremes (float32 x 2: abs-max, min-nonzero) for one step's tensors."""

    def __init__(self, device: torch.device, rows: int = 256, plan: DeferPlan | None = None):
        self.device = device
        self.cnt = torch.zeros((rows, 7), dtype=torch.int64, device=device)
        self.ext = torch.zeros((rows, 2), dtype=torch.float32, device=device)
        self.ext[:, 1] = math.inf
        self.numel: list[int] = []
        self.factor: list[int] = []
        self.plan = plan
        self.learning = plan is not None and not plan.learned
        # pending (tensor, row, version, key, deferred, address, numel), grouped by (stream, dtype, thresholds), and
        # their bytes
        self.pending: dict = {}
        self.n_pending = 0
        self.bytes = 0
        self.backward = False  # a value other than a grad-enabled forward's is pending: FLUSH_BYTES applies
        self.ring = plan.ring(device) if plan is not None else None

    def _grow(self) -> None:
        r = self.cnt.shape[0]
        cnt = torch.zeros((2 * r, 7), dtype=torch.int64, device=self.device)
        ext = torch.zeros((2 * r, 2), dtype=torch.float32, device=self.device)
        ext[:, 1] = math.inf
        cnt[:r] = self.cnt
        ext[:r] = self.ext
        self.cnt, self.ext = cnt, ext

    def add(self, x: torch.Tensor, thresholds: tuple[float, float, float], key=None, forward: bool = False) -> int:
        """Queue the statistics of x (contiguous or not); returns its row. With a plan, a dense aligned value
        waits for the next flush unless the plan knows `key` (module, call, slot, position) as volatile.
        `forward`: x is a value of a grad-enabled forward (its pending bytes count against FLUSH_BYTES_FORWARD)."""
        row = len(self.numel)
        if row >= self.cnt.shape[0]:
            self._grow()
        n = x.numel()  # (x itself, not a detached alias: only its memory is read, by the kernels)
        self.numel.append(n)
        version = _version(x) if self.plan is not None and n else None
        if version is not None and (ptr := x.data_ptr()) % 16 == 0 and (x.is_contiguous() or is_dense(x)):
            self.factor.append(1)
            deferred = not self.learning and key not in self.plan.volatile
            if not deferred:
                self._launch(x, n, row, thresholds)
            group = (current_stream(self.device), x.dtype, thresholds)
            self.pending.setdefault(group, []).append((x, row, version, key, deferred, ptr, n))
            self.n_pending += 1
            self.bytes += x.nbytes
            if not forward:
                self.backward = True
            if self.n_pending >= FLUSH_TENSORS or self.bytes >= (FLUSH_BYTES if self.backward else FLUSH_BYTES_FORWARD):
                self.flush()
            return row
        x = x.detach()  # (the views below must make no autograd node)
        factor = 1
        if n and not x.is_contiguous():
            # Order does not matter for these statistics: read a dense tensor's memory as it lies; measure an
            # expanded (stride-0) tensor once and count its values as often as they repeat. No full-size copy.
            if any(st == 0 and sz > 1 for sz, st in zip(x.shape, x.stride())):
                base = x[tuple(slice(0, 1) if st == 0 and sz > 1 else slice(None)
                               for sz, st in zip(x.shape, x.stride()))]
                factor = n // max(base.numel(), 1)
                x = base
            if is_dense(x):
                x = x.as_strided((x.numel(),), (1,), x.storage_offset())
            else:
                x = x.contiguous()
        self.factor.append(factor)
        if n:  # (an expanded tensor's own values: `base`'s count, not n)
            self._launch(x, x.numel(), row, thresholds)
        return row

    def _launch(self, x: torch.Tensor, n: int, row: int, thresholds) -> None:
        """The per-tensor kernel, now (x dense: read as it lies in memory)."""
        if not x.is_contiguous():
            x = x.detach().as_strided((n,), (1,), x.storage_offset())
        near, tiny, ovf = thresholds
        blocks = triton_cdiv(n, _BLOCK)
        grid = min(blocks, _MAX_PROGRAMS)
        k = _kernel()
        try:
            if k is None:
                raise RuntimeError("the fused statistics kernel is off")
            k[0][(grid,)](x, n, triton_cdiv(blocks, grid), self.cnt[row], self.ext[row], tiny, near, ovf,
                          BLOCK=_BLOCK)
        except Exception:  # a Triton that cannot compile or launch this here: the same numbers with torch ops
            _off()
            self._eager(x, row, thresholds)

    def _eager(self, x: torch.Tensor, row: int, thresholds) -> None:
        """What the kernels add into a row, with torch ops (the values compared as fp32, as the kernels do)."""
        near, tiny, ovf = thresholds
        v = x.detach().reshape(-1).float()
        a = v.abs()
        fin = torch.isfinite(v)
        af = torch.where(fin, a, torch.zeros((), device=v.device))
        cnt = torch.stack([torch.isnan(v).sum(), (v == math.inf).sum(), (v == -math.inf).sum(), (fin & (af == 0)).sum(),
                           (fin & (af >= near)).sum(), (fin & (af > 0) & (af < tiny)).sum(), (fin & (af >= ovf)).sum()])
        self.cnt[row] += cnt
        amin = torch.where(fin & (af > 0), af, torch.full((), math.inf, device=v.device)).amin() if v.numel() else \
            torch.full((), math.inf, device=v.device)
        self.ext[row, 0] = torch.maximum(self.ext[row, 0], af.amax() if v.numel() else self.ext[row, 0])
        self.ext[row, 1] = torch.minimum(self.ext[row, 1], amin)

    def flush(self) -> None:
        """Measure the pending values that wait (one table launch per group and size class, the tables uploaded in
        one copy), and compare every pending value's version with the one it had at its hook: a value written since
        is volatile from now on."""
        if not self.n_pending:
            return
        plan = self.plan
        launches = []
        for (stream, _, thresholds), entries in self.pending.items():
            late = [e for e in entries if e[4]]
            for x, _, version, key, *_ in entries:
                if x._version != version:
                    plan.volatile.add(key)
            if late:
                launches.extend((stream, thresholds, cls) for cls in _size_classes(late))
        if launches:
            self._tables(launches)
        self.pending = {}
        self.n_pending = 0
        self.bytes = 0
        self.backward = False
        if self.learning:
            plan.learned = True

    def forward_done(self) -> None:
        """The root's forward returned: its values are measured now, so that none is held into the backward."""
        if self.n_pending:
            self.flush()

    def _tables(self, launches: list) -> None:
        """One table launch per (stream, thresholds, size class); all their tables go to the device in one copy."""
        values: list = []
        spans = []
        for _, _, cls in launches:
            b, size = cls[0][5], cls[0][0].element_size()
            spans.append(len(values))
            values += [(e[5] - b) // size for e in cls]
            values += [e[6] for e in cls]
            values += [e[1] for e in cls]
        meta = self.ring.put(values)
        here = current_stream(self.device)
        for (stream, thresholds, cls), at in zip(launches, spans):
            m = meta[at:at + 3 * len(cls)]
            if stream is here:
                self._table(cls, m, thresholds)
            else:  # a value measured on a side stream: read there, after what made it
                with torch.cuda.stream(stream):
                    self._table(cls, m, thresholds)

    def _table(self, cls: list, meta: torch.Tensor, thresholds) -> None:
        """One launch of the table kernel over one size class (`meta`: its offsets, sizes and rows, on the device)."""
        near, tiny, ovf = thresholds
        base = cls[0][0]
        span = _T_BLOCK * _T_ITERS
        P = max(1, min(_T_MAX_PROGRAMS, triton_cdiv(max(e[6] for e in cls), span)))
        k = _kernel()
        try:
            if k is None:
                raise RuntimeError("the fused statistics kernel is off")
            k[1][(len(cls), P)](base, meta, len(cls), self.cnt, self.ext, tiny, near, ovf, BLOCK=_T_BLOCK,
                                ALIGN=16 // base.element_size(), num_warps=_T_WARPS)
        except Exception:  # (see _launch)
            _off()
            for e in cls:
                self._eager(e[0], e[1], thresholds)

    def vectors(self) -> torch.Tensor:
        """All rows as float64 vectors laid out like records.STAT_FIELDS (one small kernel chain per step)."""
        self.flush()
        k = len(self.numel)
        pinned = torch.cuda.is_available()
        host = torch.tensor([self.numel, self.factor], dtype=torch.float64, pin_memory=pinned)
        nf = host.to(self.device, non_blocking=True)  # from pinned memory: no synchronisation
        n = nf[0]
        c = self.cnt[:k].to(torch.float64) * nf[1][:, None]
        e = self.ext[:k].to(torch.float64)
        if self.ring is not None:
            self.ring.mark()
        # fields: numel nan posinf neginf zeros absmax min_nonzero near_max subnormal overflow_as_ref
        return torch.stack([n, c[:, 0], c[:, 1], c[:, 2], c[:, 3], e[:, 0], e[:, 1], c[:, 4], c[:, 5], c[:, 6]],
                           dim=1)


def _size_classes(entries: list) -> list:
    """Pending entries grouped by size class: a tensor needs cdiv(n, BLOCK * ITERS) programs (capped); one launch
    per power of two of that, so that few of a launch's programs find nothing to read."""
    classes: dict = {}
    span = _T_BLOCK * _T_ITERS
    for e in entries:
        need = min(_T_MAX_PROGRAMS, triton_cdiv(e[6], span))
        classes.setdefault(need.bit_length(), []).append(e)
    return list(classes.values())


def _version(x: torch.Tensor) -> int | None:
    """x's version counter; None for an inference tensor (it has none, and cannot be written in place later)."""
    try:
        return x._version
    except RuntimeError:
        return None
