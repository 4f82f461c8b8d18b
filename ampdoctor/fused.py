"""The CUDA fast path for `stats.full_stats`: every statistic of a tensor in one pass (a Triton kernel).

Per tensor, one kernel reads the values once and adds its block's counts (NaN, ±inf, zeros, near-max,
below-normal, would-overflow-in-ref) and extremes (finite abs-max, smallest nonzero) into one row of a
buffer preallocated per step, so the hooks launch one kernel per tensor and allocate nothing. The eager
`stats.full_stats` is the reference: `tests/test_fused.py` checks that both give identical numbers (on a GPU).
Import is lazy and guarded: without CUDA or Triton, `available()` is False and callers use the eager path.
"""
from __future__ import annotations

import math

import torch

__all__ = ["available", "StatBuffer"]

_KERNEL = None


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
    def stats_kernel(x_ptr, n, cnt_ptr, ext_ptr, tiny, near, ovf, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        a = tl.abs(x)
        isnan = (x != x) & m
        posinf = (x == float("inf")) & m
        neginf = (x == float("-inf")) & m
        fin = m & (a < float("inf")) & (x == x)
        af = tl.where(fin, a, 0.0)
        zeros = fin & (af == 0.0)
        nearc = fin & (af >= near)
        sub = fin & (af > 0.0) & (af < tiny)
        ovfc = fin & (af >= ovf)
        tl.atomic_add(cnt_ptr + 0, tl.sum(isnan.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 1, tl.sum(posinf.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 2, tl.sum(neginf.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 3, tl.sum(zeros.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 4, tl.sum(nearc.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 5, tl.sum(sub.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 6, tl.sum(ovfc.to(tl.int64), axis=0))
        tl.atomic_max(ext_ptr + 0, tl.max(af, axis=0))
        tl.atomic_min(ext_ptr + 1, tl.min(tl.where(fin & (af > 0.0), af, float("inf")), axis=0))

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
            block = 4096
            _kernel()[(triton_cdiv(n, block),)](x, n, self.cnt[row], self.ext[row], tiny, near, ovf, BLOCK=block)
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
