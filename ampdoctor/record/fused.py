"""The CUDA fast paths (Triton kernels): every statistic of a tensor in one pass (`StatBuffer`, for
`stats.full_stats`), and the abs-max of many tensors in one launch (`AbsMaxTable`, for the always-on headroom).

Per tensor, one kernel reads the values once and adds its block's counts (NaN, ±inf, zeros, near-max,
below-normal, would-overflow-in-ref) and extremes (finite abs-max, smallest nonzero) into one row of a
buffer preallocated per step, so the hooks launch one kernel per tensor and allocate nothing. The eager
`stats.full_stats` is the reference: `tests/test_fused.py` checks that both give identical numbers (on a GPU).
Import is lazy and guarded: without CUDA or Triton, `available()` is False and callers use the eager path.
"""
from __future__ import annotations

import math

import torch

__all__ = ["available", "StatBuffer", "AbsMaxTable", "absmax_available", "absmax_kernel_ready", "disable_absmax"]

_KERNEL = None
_BLOCK = 1024          # values per program and iteration
_MAX_PROGRAMS = 1024   # grid cap (a few waves on an H100/H200's 132 SMs)


def available(t: torch.Tensor) -> bool:
    if t.device.type != "cuda" or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return _kernel() is not None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        try:
            _KERNEL = _build()
        except Exception:  # no Triton, or it cannot compile here: the eager path serves
            _KERNEL = False
    return _KERNEL or None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(x_ptr, n, iters, cnt_ptr, ext_ptr, tiny, near, ovf, BLOCK: tl.constexpr):
        # A capped grid of programs, each striding over the tensor with per-lane accumulators: a large tensor
        # costs one read and a few atomics per program, not per block of 1024 values.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        c_nan = tl.zeros([BLOCK], tl.int32)
        c_pinf = tl.zeros([BLOCK], tl.int32)
        c_ninf = tl.zeros([BLOCK], tl.int32)
        c_zero = tl.zeros([BLOCK], tl.int32)
        c_near = tl.zeros([BLOCK], tl.int32)
        c_sub = tl.zeros([BLOCK], tl.int32)
        c_ovf = tl.zeros([BLOCK], tl.int32)
        amax = tl.zeros([BLOCK], tl.float32)
        amin = tl.full([BLOCK], float("inf"), tl.float32)
        for i in range(0, iters):
            offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            a = tl.abs(x)
            fin = m & (a < float("inf")) & (x == x)
            af = tl.where(fin, a, 0.0)
            c_nan += ((x != x) & m).to(tl.int32)
            c_pinf += ((x == float("inf")) & m).to(tl.int32)
            c_ninf += ((x == float("-inf")) & m).to(tl.int32)
            c_zero += (fin & (af == 0.0)).to(tl.int32)
            c_near += (fin & (af >= near)).to(tl.int32)
            c_sub += (fin & (af > 0.0) & (af < tiny)).to(tl.int32)
            c_ovf += (fin & (af >= ovf)).to(tl.int32)
            amax = tl.maximum(amax, af)
            amin = tl.minimum(amin, tl.where(fin & (af > 0.0), af, float("inf")))
        tl.atomic_add(cnt_ptr + 0, tl.sum(c_nan.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 1, tl.sum(c_pinf.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 2, tl.sum(c_ninf.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 3, tl.sum(c_zero.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 4, tl.sum(c_near.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 5, tl.sum(c_sub.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 6, tl.sum(c_ovf.to(tl.int64), axis=0))
        tl.atomic_max(ext_ptr + 0, tl.max(amax, axis=0))
        tl.atomic_min(ext_ptr + 1, tl.min(amin, axis=0))

    return stats_kernel


class StatBuffer:
    """Rows of counts (int64 x 7) and extremes (float32 x 2: abs-max, min-nonzero) for one step's tensors."""

    def __init__(self, device: torch.device, rows: int = 256):
        self.device = device
        self.cnt = torch.zeros((rows, 7), dtype=torch.int64, device=device)
        self.ext = torch.zeros((rows, 2), dtype=torch.float32, device=device)
        self.ext[:, 1] = math.inf
        self.numel: list[int] = []
        self.factor: list[int] = []

    def _grow(self) -> None:
        r = self.cnt.shape[0]
        cnt = torch.zeros((2 * r, 7), dtype=torch.int64, device=self.device)
        ext = torch.zeros((2 * r, 2), dtype=torch.float32, device=self.device)
        ext[:, 1] = math.inf
        cnt[:r] = self.cnt
        ext[:r] = self.ext
        self.cnt, self.ext = cnt, ext

    def add(self, x: torch.Tensor, thresholds: tuple[float, float, float]) -> int:
        """Queue the statistics of x (contiguous or not); returns its row."""
        row = len(self.numel)
        if row >= self.cnt.shape[0]:
            self._grow()
        x = x.detach()
        n = x.numel()
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
        self.numel.append(n)
        self.factor.append(factor)
        if n:
            near, tiny, ovf = thresholds
            blocks = triton_cdiv(n, _BLOCK)
            grid = min(blocks, _MAX_PROGRAMS)
            _kernel()[(grid,)](x, n, triton_cdiv(blocks, grid), self.cnt[row], self.ext[row], tiny, near, ovf,
                               BLOCK=_BLOCK)
        return row

    def vectors(self) -> torch.Tensor:
        """All rows as float64 vectors laid out like records.STAT_FIELDS (one small kernel chain per step)."""
        k = len(self.numel)
        pinned = torch.cuda.is_available()
        host = torch.tensor([self.numel, self.factor], dtype=torch.float64, pin_memory=pinned)
        nf = host.to(self.device, non_blocking=True)  # from pinned memory: no synchronisation
        n = nf[0]
        c = self.cnt[:k].to(torch.float64) * nf[1][:, None]
        e = self.ext[:k].to(torch.float64)
        # fields: numel nan posinf neginf zeros absmax min_nonzero near_max subnormal overflow_as_ref
        return torch.stack([n, c[:, 0], c[:, 1], c[:, 2], c[:, 3], e[:, 0], e[:, 1], c[:, 4], c[:, 5], c[:, 6]],
                           dim=1)


def is_dense(x: torch.Tensor) -> bool:
    """True when x's elements fill a contiguous block of memory exactly once, in some order of dimensions
    (e.g. a permuted contiguous tensor): then its memory can be read as one flat vector."""
    dims = sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# -- many tensors' abs-max in one launch (the always-on headroom, ampdoctor/record/headroom.py) ------------------
_ABSMAX = None
_AM_BLOCK = 2048        # values per program and iteration
_AM_ITERS = 16          # a program reads at least this many blocks of the largest tensor before more are added
_AM_MAX_PROGRAMS = 256  # programs per tensor at most


def disable_absmax() -> None:
    """The table kernel failed to compile or launch: callers use torch._foreach_norm from now on."""
    global _ABSMAX
    _ABSMAX = False


def absmax_kernel_ready() -> bool:
    """Whether Triton (and so `AbsMaxTable`) works here; built on first use."""
    return _absmax_kernel() is not None


def absmax_available(t: torch.Tensor) -> bool:
    """Whether `AbsMaxTable` can take this tensor: fp16/bf16 on CUDA, non-empty, its values one dense block of
    memory (contiguous, or a permutation of a contiguous tensor) starting on a 16-byte boundary."""
    if t.device.type != "cuda" or t.dtype not in (torch.float16, torch.bfloat16) or not t.numel():
        return False
    return t.data_ptr() % 16 == 0 and (t.is_contiguous() or is_dense(t))


def _absmax_kernel():
    global _ABSMAX
    if _ABSMAX is None:
        try:
            _ABSMAX = _build_absmax()
        except Exception:  # no Triton, or it cannot compile here: torch._foreach_norm serves
            _ABSMAX = False
    return _ABSMAX or None


def _build_absmax():
    import triton
    import triton.language as tl

    @triton.jit
    def absmax_kernel(base_ptr, meta_ptr, T, out_ptr, nan_ptr, BLOCK: tl.constexpr):
        # program (t, p): tensor t of the table, its p-th share of the blocks. A tensor is addressed by its
        # element offset from `base_ptr` (a multiple of 8 elements: 16-byte aligned, so loads vectorise); full
        # blocks are read unmasked, the tail by program 0 with a mask.
        t = tl.program_id(0)
        p = tl.program_id(1).to(tl.int64)
        nprog = tl.num_programs(1).to(tl.int64)
        off = tl.multiple_of(tl.load(meta_ptr + t), 8)
        n = tl.load(meta_ptr + T + t)
        row = tl.load(meta_ptr + 2 * T + t)
        full = n - n % BLOCK
        acc = tl.zeros([BLOCK], tl.float32)
        bad = tl.zeros([BLOCK], tl.int32)
        for start in range(p * BLOCK, full, nprog * BLOCK):
            start = tl.multiple_of(start, BLOCK)
            x = tl.load(base_ptr + off + start + tl.arange(0, BLOCK)).to(tl.float32)
            bad = bad | (x != x).to(tl.int32)        # NaN: max() would drop it
            acc = tl.maximum(acc, tl.abs(x))          # inf stays inf
        if p == 0:
            offs = full + tl.arange(0, BLOCK)
            x = tl.load(base_ptr + off + offs, mask=offs < n, other=0.0).to(tl.float32)
            bad = bad | (x != x).to(tl.int32)
            acc = tl.maximum(acc, tl.abs(x))
        tl.atomic_max(out_ptr + row, tl.max(acc, axis=0))
        tl.atomic_max(nan_ptr + row, tl.max(bad, axis=0))

    return absmax_kernel


class AbsMaxTable:
    """One step's abs-maxes on one device: `add(tensors)` launches one kernel over a table of (address, numel,
    row) and returns the first row; `vector()` gives them (NaN where a NaN was seen) for the step's transfer.
    The tensors must stay referenced until `add` returns (the kernel is queued on the current stream behind
    the kernels that made them; memory freed afterwards is reused only behind it).

    Host cost per `add` is what the always-on headroom pays per flush, so the tables go through one pinned
    host buffer and one device buffer kept across steps (each add writes its own region; `reset` waits for the
    step's last copy, long done by then since the step's transfer has synchronised), and the abs-maxes and the
    NaN flags are one int32 buffer (the first half read as float32), zeroed with one kernel per step. A pinned
    block per add from the caching host allocator cost a device-synchronising `cudaHostAlloc` whenever the host
    ran ahead of the GPU (GPT-2: 1.07x -> 1.11x)."""

    def __init__(self, device: torch.device, rows: int = 512):
        self.device = device
        self.n = 0
        self._alloc(rows)
        self.host = self.hnp = self.meta = self.copied = None
        self.used = 0  # table entries written this step (each add's stays intact until its kernel ran)

    def _alloc(self, rows: int) -> None:
        self.rows = rows
        self.buf = torch.zeros(2 * rows, dtype=torch.int32, device=self.device)
        self.out = self.buf[:rows].view(torch.float32)
        self.nan = self.buf[rows:]

    def _grow(self, need: int) -> None:
        r = self.rows
        while r < need:
            r *= 2
        out, nan, n = self.out, self.nan, self.n
        self._alloc(r)
        self.out[:n] = out[:n]
        self.nan[:n] = nan[:n]

    def _tables(self, need: int) -> None:
        """Host and device table buffers holding `need` entries (the old ones are freed behind their copies:
        the caching host allocator keeps a pinned block until the copy recorded on it has run)."""
        cap = max(need, 2 * (self.host.shape[0] if self.host is not None else 0), 3 * 1024)
        self.host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
        self.hnp = self.host.numpy()
        self.meta = torch.empty(cap, dtype=torch.int64, device=self.device)
        self.used = 0

    def add(self, tensors: list) -> int:
        """Queue the abs-max of each tensor (one dtype, each `absmax_available`); returns the first row (rows
        are consecutive)."""
        T = len(tensors)
        first = self.n
        if first + T > self.rows:
            self._grow(first + T)
        self.n = first + T
        if not T:
            return first
        base = tensors[0]
        b, size = base.data_ptr(), base.element_size()
        ns = [t.numel() for t in tensors]
        big = max(ns)
        if not big:
            return first
        k = self.used
        if self.host is None or k + 3 * T > self.host.shape[0]:
            self._tables(k + 3 * T)
            k = 0
        self.hnp[k:k + 3 * T] = [(t.data_ptr() - b) // size for t in tensors] + ns + list(range(first, first + T))
        meta = self.meta[k:k + 3 * T]
        meta.copy_(self.host[k:k + 3 * T], non_blocking=True)
        self.used = k + 3 * T
        self.copied = None  # an add after vector(): reset marks the last copy itself
        P = max(1, min(_AM_MAX_PROGRAMS, triton_cdiv(big, _AM_BLOCK * _AM_ITERS)))
        _absmax_kernel()[(T, P)](base, meta, T, self.out, self.nan, BLOCK=_AM_BLOCK)
        return first

    def vector(self) -> torch.Tensor:
        """The step's abs-maxes, NaN where a tensor held a NaN; marks the step's copies (see reset)."""
        k = self.n
        if self.used:
            self.copied = torch.cuda.Event()
            self.copied.record()
        return torch.where(self.nan[:k] > 0, torch.nan, self.out[:k])

    def reset(self) -> None:
        if self.n:
            self.buf.zero_()
        if self.used:  # the host table is written again from the start: its last copies must have run
            if self.copied is None:
                self.copied = torch.cuda.Event()
                self.copied.record()
            self.copied.synchronize()
        self.copied = None
        self.n = 0
        self.used = 0
