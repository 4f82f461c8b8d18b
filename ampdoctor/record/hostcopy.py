"""How the step's values reach the host: `Pending` stages them (one concatenation and one copy per device; with a
GradScaler on CUDA the copy is asynchronous, read at the next iteration) and `HostSlots` keeps the pinned buffers
and events those copies go through for the watch's life; `cuda_scaler` says whether they are read later. What is
staged, and when, is transfer.py's; reading the values back is readback.py's.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["HostSlots", "Pending", "cuda_scaler", "current_stream"]


def cuda_scaler(scaler) -> bool:
    """A CUDA GradScaler on a machine with CUDA: the step's values are read later, without a synchronisation of their
    own (also when it is disabled, e.g. `GradScaler(enabled=False)` for bf16). On a machine without CUDA
    (`torch.cuda.amp.GradScaler()` there is disabled, the model on the CPU) they are read now, before the optimizer
    step changes the weights the CPU checks read (presync's `w_deferred`)."""
    return scaler is not None and getattr(scaler, "_device", "") == "cuda" and _cuda_here()


@functools.cache
def _cuda_here() -> bool:
    """torch.cuda.is_available(), asked once (it is read every step)."""
    return torch.cuda.is_available()



_STREAMS: dict = {}  # (stream id, device index, device type) -> its torch.cuda.Stream (streams live for the process)


def current_stream(dev: torch.device):
    """The current stream of `dev` (where its copies run), as `torch.cuda.current_stream(dev)` gives it, without its
    per-call Python (lazy init, device lookup, a new Stream object): ~10 us a step on a fast host, and the fused
    statistics ask it once per measured tensor (fused.StatBuffer.add)."""
    data = torch._C._cuda_getCurrentStream(dev.index if dev.index is not None else torch._C._cuda_getDevice())
    s = _STREAMS.get(data)
    if s is None:
        s = _STREAMS[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
    return s


class HostSlots:
    """Pinned host buffers and CUDA events kept for the watch's life, two per (slot, device, dtype) by the step's
    parity: a step's values land in one while the previous step's are read from the other. A pinned block and
    an event per step cost ~40 us of host time on an H200 (cudaHostAlloc through the caching allocator, event
    creation and destruction), on a step where every microsecond shows."""

    __slots__ = ("bufs",)

    def __init__(self):
        self.bufs: dict = {}

    def get(self, key, n: int, dtype: torch.dtype):
        got = self.bufs.get(key)
        if got is None or got[0].numel() < n:
            ev = got[1] if got is not None else torch.cuda.Event()
            got = self.bufs[key] = (torch.empty(max(n, 64), dtype=dtype, pin_memory=True), ev)
        return got[0][:n], got[1]


class Pending:
    """Values on their way to the host. With a GradScaler on CUDA the copy is asynchronous (pinned memory and an
    event): the step's one synchronisation stays GradScaler's own, and the values are read at the next iteration,
    long after they arrived. Otherwise they are read at once. `via_scaler`: staged inside scaler.step();
    `grads_scaled`: the optimizer stepped on gradients still multiplied by the loss scale. A key given several
    times reads back as its parts' values in order. `slots`/`slot`: reused host buffers (HostSlots)."""

    def __init__(self, parts: list[tuple[str, torch.Tensor]], asynchronous: bool, via_scaler: bool = False,
                 grads_scaled: bool = False, slots: HostSlots | None = None, slot=None):
        self.via_scaler, self.grads_scaled = via_scaler, grads_scaled
        by_dev: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for k, t in parts:
            by_dev.setdefault(t.device, []).append((k, t))
        self.items = []
        for dev, items in by_dev.items():
            if dev.type == "cpu":  # nothing to move: each value is read where it is (no concatenation)
                self.items.append((items, None, None))
                continue
            # (a 1-d value goes in as it is: a view per value is one more dispatch a step, ~5 us on a GPU's host)
            flat = torch.cat([t if t.dim() == 1 else t.reshape(-1) for _, t in items]) if len(items) > 1 else \
                items[0][1].reshape(-1)
            ev = None
            if asynchronous and dev.type == "cuda":
                if slots is not None:
                    host, ev = slots.get((slot, dev, flat.dtype), flat.numel(), flat.dtype)
                else:
                    host, ev = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True), torch.cuda.Event()
                host.copy_(flat, non_blocking=True)
                ev.record(current_stream(dev))
                flat = host
            self.items.append((items, flat, ev))

    def result(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for items, flat, ev in self.items:
            if flat is None:  # a key given several times reads in order
                for k, t in items:
                    d = t.dim()
                    if d == 0:
                        out.setdefault(k, []).append(t.item())
                    else:
                        out.setdefault(k, []).extend((t if d == 1 else t.reshape(-1)).tolist())
                continue
            if ev is not None:
                ev.synchronize()
            vals = flat.cpu().tolist()
            i = 0
            for k, t in items:
                n = t.numel()
                out.setdefault(k, []).extend(vals[i:i + n])
                i += n
        return out
