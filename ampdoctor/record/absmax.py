"""Many tensors' abs-max in one Triton launch, for the always-on headroom (ampdoctor/record/headroom.py):
`AbsMaxTable` reads a table of (address, numel, row) of one step's fp16/bf16 values on one device. Built on first
use and guarded: without CUDA or Triton (or when it fails to compile or launch, `disable_absmax`), the headroom
uses torch._foreach_norm instead."""
from __future__ import annotations

import torch

from .tables import MetaRing, is_dense, triton_cdiv

__all__ = ["AbsMaxTable", "absmax_available", "absmax_kernel_ready", "disable_absmax"]

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

    Host cost per `add` is what the always-on headroom pays per flush, so the tables go through a MetaRing kept
    across steps (its reset waits for the step's last copy, long done by then since the step's transfer has
    synchronised), and the abs-maxes and the NaN flags are one int32 buffer (the first half read as float32),
    zeroed with one kernel per step. A pinned block per add from the caching host allocator cost a
    device-synchronising `cudaHostAlloc` whenever the host ran ahead of the GPU (GPT-2: 1.07x -> 1.11x)."""

    def __init__(self, device: torch.device, rows: int = 512):
        self.device = device
        self.n = 0
        self._alloc(rows)
        self.ring = MetaRing(device)

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
        meta = self.ring.put([(t.data_ptr() - b) // size for t in tensors] + ns + list(range(first, first + T)))
        P = max(1, min(_AM_MAX_PROGRAMS, triton_cdiv(big, _AM_BLOCK * _AM_ITERS)))
        _absmax_kernel()[(T, P)](base, meta, T, self.out, self.nan, BLOCK=_AM_BLOCK)
        return first

    def vector(self) -> torch.Tensor:
        """The step's abs-maxes, NaN where a tensor held a NaN; marks the step's copies (see reset)."""
        self.ring.mark()
        return torch.where(self.nan[:self.n] > 0, torch.nan, self.out[:self.n])

    def reset(self) -> None:
        if self.n:
            self.buf.zero_()
        self.ring.reset()
        self.n = 0
