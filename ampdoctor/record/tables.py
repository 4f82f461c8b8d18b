"""What the batched statistics backends share about memory: whether a tensor's values are one dense block
(`is_dense`: read as a flat vector, in any order), the ring that takes the Triton kernels' tables of (offset, numel,
row) to the device without a synchronisation (`MetaRing`, used by record/fused.py and record/absmax.py), and the
grid arithmetic (`triton_cdiv`). Needs no Triton to import."""
from __future__ import annotations

import torch

__all__ = ["MetaRing", "is_dense", "triton_cdiv"]


class MetaRing:
    """A kernel's tables of int64 on their way to the device: one pinned host buffer and one device buffer, each
    `put` writing the next free region of both (a pinned block per table from the caching host allocator cost a
    device-synchronising `cudaHostAlloc` whenever the host ran ahead of the GPU). `mark` records that the step's
    last copy is queued; `reset` waits for it before the buffers are written from the start again."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = self.hnp = self.dev = self.copied = None
        self.used = 0  # entries written since the last reset (each put's stays intact until its copy ran)

    def put(self, values: list) -> torch.Tensor:
        """`values` (ints) copied into the device buffer's next region, which is returned (no synchronisation)."""
        k, need = self.used, len(values)
        if self.host is None or k + need > self.host.shape[0]:
            # the old buffers are freed behind their copies: the caching host allocator keeps a pinned block until
            # the copy recorded on it has run
            cap = max(k + need, 2 * (self.host.shape[0] if self.host is not None else 0), 3 * 1024)
            self.host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self.hnp = self.host.numpy()
            self.dev = torch.empty(cap, dtype=torch.int64, device=self.device)
            k = 0
        self.hnp[k:k + need] = values
        out = self.dev[k:k + need]
        out.copy_(self.host[k:k + need], non_blocking=True)
        self.used = k + need
        self.copied = None  # a put after mark(): reset marks the last copy itself
        return out

    def mark(self) -> None:
        if self.used:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def reset(self) -> None:
        if self.used:  # the host buffer is written again from the start: its last copies must have run
            if self.copied is None:
                self.mark()
            self.copied.synchronize()
        self.copied = None
        self.used = 0


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
