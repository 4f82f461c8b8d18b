"""Where finished StepRecords go: memory (`Watch.steps`) and the run directory, with long runs kept bounded."""
from __future__ import annotations

from .records import StepRecord

__all__ = ["store", "MEMORY_STEPS", "KEEP_DETAILED"]


# Long runs stay bounded: routine steps (not sampled, not bad, the usual call sequence) keep no call events,
# are written with a growing stride past 10k steps, and are thinned in memory past MEMORY_STEPS records.
# Sampled and bad steps are always kept; module details of old sampled steps live on disk only.
MEMORY_STEPS = 4096
KEEP_DETAILED = 32


def _routine(m, rec: StepRecord) -> bool:
    if rec.sampled or rec.bad or rec.capture:
        return False
    seq = tuple(e.kind for e in rec.events)
    if any(e.error or e.scaled for e in rec.events) or seq != m._last_seq:
        m._last_seq = seq
        return False
    return True


def store(m, rec: StepRecord) -> None:
    routine = _routine(m, rec)
    if routine:
        rec.events = []
    m._routine_count += routine
    n = m._routine_count
    stride = 1 if n < 10_000 else 10 if n < 100_000 else 100
    if m.writer is not None and (not routine or n % stride == 0):
        m.writer.append(rec)
    m.records.append(rec)
    if rec.sampled:
        m._detailed.append(rec)
        if len(m._detailed) > KEEP_DETAILED:
            old = m._detailed.pop(0)
            if not old.bad:
                old.modules = []
    if len(m.records) > MEMORY_STEPS:
        half = len(m.records) // 2
        head, tail = m.records[:half], m.records[half:]
        keep, drop = [], True
        for r in head:
            if r.sampled or r.bad or r.capture or r.events or r.step == 0:
                keep.append(r)
            else:
                drop = not drop
                if not drop:
                    keep.append(r)
        m.records[:] = keep + tail
