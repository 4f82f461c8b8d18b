"""The module buffers that training writes (running statistics, EMA codebooks, normalisers): are they still finite?

An inf/NaN in a buffer can be silent: a normaliser's `x * rsqrt(inf)` is 0, so the module's output stays finite
while the features it scales are dead for the rest of the run. Buffers finite when the watch began and written
since (their version moved; noticed on sampled steps) are read every step, with the step's one transfer (one
multi-tensor abs-max per dtype); the first step where one of them turns non-finite is reported
(`StepRecord.bad_buffer`). Buffers that never change (masks, position tables) cost nothing.
"""
from __future__ import annotations

import math

import torch

from ..tensors import local
from .params import norms

__all__ = ["BufferWatch"]

LEAD = 1 << 20
"""Elements read of a larger buffer (a MoCo queue of 65536 keys is 32 MB a step on a CPU): its leading ones."""


def _lead(b: torch.Tensor) -> torch.Tensor:
    t = local(b.detach())
    return t.reshape(-1)[:LEAD] if t.numel() > LEAD and t.is_contiguous() else t


class BufferWatch:
    """The floating-point buffers of one model, which of them training writes, and whether each was finite."""

    def __init__(self, model: torch.nn.Module):
        self.bufs = [(name, b, b._version) for name, b in model.named_buffers()
                     if b.is_floating_point() and b.layout == torch.strided and local(b).numel()]
        self.live: list[int] = []      # indices into bufs: written since the watch began
        self.sent: list[int] = []      # the indices of the values part() queued last
        self.finite: dict[int, bool] = {}  # index -> finite at its last read (at the start: all of them, once)
        self.l2: dict[int, float] = {}      # index -> its L2 norm at the start (a kernel's in-place write of running
        #                                     statistics, e.g. batch_norm's, does not move the version counter)
        if self.bufs:
            try:
                ts = [_lead(b) for _, b, _ in self.bufs]
                vals = norms(ts, math.inf).tolist()
                self.finite = {i: math.isfinite(v) for i, v in enumerate(vals)}
                self.l2 = dict(enumerate(norms(ts, 2).tolist()))
            except (RuntimeError, NotImplementedError, TypeError):  # buffers without data yet (meta, lazy init)
                self.bufs, self.finite, self.l2 = [], {}, {}

    def refresh(self) -> None:
        """On a sampled step, after its forward: the buffers written since the watch began (their version counter
        moved, or their norm did: one read of the others, on sampled steps only); routine steps read these."""
        if not self.bufs:
            return
        live = {i for i, (_, b, v) in enumerate(self.bufs) if b._version != v and self.finite.get(i)}
        rest = [i for i in range(len(self.bufs)) if i not in live and self.finite.get(i) and i in self.l2]
        if rest:
            now = norms([_lead(self.bufs[i][1]) for i in rest], 2).tolist()
            live.update(i for i, v in zip(rest, now) if v != self.l2[i])
        self.live = sorted(live)

    def part(self) -> torch.Tensor | None:
        """The written buffers' abs-maxes (NaN-propagating), queued for the step's transfer; None when none."""
        self.sent = list(self.live)
        if not self.live:
            return None
        return norms([_lead(self.bufs[i][1]) for i in self.live], math.inf)

    def read(self, vals: list[float] | None) -> dict | None:
        """The first buffer that was finite at its last read and is not now: `{"module", "buffer", "kind"}`."""
        if not vals:
            return None
        first = None
        for i, v in zip(self.sent, vals):
            ok = math.isfinite(v)
            if not ok and self.finite.get(i) and first is None:
                mod, _, buf = self.bufs[i][0].rpartition(".")
                first = {"module": mod, "buffer": buf, "kind": "nan" if v != v else "inf"}
            self.finite[i] = ok
        self.live = [i for i in self.live if self.finite[i]]  # a dead buffer is reported once
        return first
