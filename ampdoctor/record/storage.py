"""Where finished StepRecords go: the run directory and `Watch.steps` (a `StepStore`), with long runs bounded.

Every step is kept and counted: its loss, scale, skipped flag, finiteness checks (the trip-wire), gradient
norm and producers are written to the run directory and stay in `Watch.steps`, for any number of steps. What is
thinned is detail only:

- routine steps (not sampled, not bad, the usual call sequence) keep no call events (they repeat the last ones),
  nor do thinned sampled steps whose call sequence repeats;
- per-module and per-parameter statistics (`modules`, `params`) of sampled steps are kept for the first
  1,000 sampled steps, then for 1 in 10 up to 10,000, 1 in 100 up to 100,000 and 1 in 1,000 after that —
  always for step 0, bad steps, steps with a capture and the 8 steps after a bad one.

`StepStore` holds the newest records in memory and spills older ones to an unnamed temporary file (the run-dir
line already written for the record, else the record's dict in `marshal` form, plus an 8-byte offset), so a watch's
memory stays flat in the number of steps. (marshal, not JSON, for a record no run directory wrote: an `every=1`
record of a 12-layer GPT encodes in 0.4 ms instead of 2.9; the file is this process's own, unnamed, and read back
only by it.) In memory it holds at most MEMORY_STEPS records and MEMORY_OBJECTS of their detail objects (a module call's record and its four
statistics, a parameter's): with `every=1` on GPT-2 a record holds ~1,000, and Python's full garbage collections,
which walk every object the process holds, took ~150 ms each with 256 such records kept.
"""
from __future__ import annotations

import dataclasses
import json
import marshal
import struct
import tempfile
from array import array
from collections.abc import Sequence

from ..records import StepRecord

__all__ = ["store", "folded", "StepStore", "keeps_detail", "MEMORY_STEPS", "MEMORY_OBJECTS", "FULL_DETAIL_STEPS",
           "FOLLOWUP_STEPS"]

MEMORY_STEPS = 256          # newest records held in memory; older ones live in the spill file
MEMORY_OBJECTS = 16384      # ... and at most this many of their detail objects (see _weight)
FULL_DETAIL_STEPS = 1000    # sampled steps that all keep their module/parameter statistics
FOLLOWUP_STEPS = 8          # steps after a bad one that keep their detail


def _stride(sampled_seen: int) -> int:
    if sampled_seen < FULL_DETAIL_STEPS:
        return 1
    return 10 if sampled_seen < 10_000 else 100 if sampled_seen < 100_000 else 1000


def keeps_detail(sampled_seen: int, since_bad: int | None, rec: StepRecord) -> bool:
    """Whether a record keeps its per-module/per-parameter statistics (the thinning rule in the docstring)."""
    if rec.step == 0 or rec.bad or rec.capture:
        return True
    if since_bad is not None and since_bad <= FOLLOWUP_STEPS:
        return True
    return sampled_seen % _stride(sampled_seen) == 0


def _weight(rec: StepRecord) -> int:
    """The objects a record holds in memory, roughly: itself, a module call's record with its four statistics, a
    parameter's record."""
    return 1 + 5 * len(rec.modules) + len(rec.params)


def _slim(rec: StepRecord, drop_events: bool = False) -> StepRecord:
    """The record without its detail: module/parameter statistics, and its call events when they repeat."""
    if rec.modules or rec.params or (drop_events and rec.events):
        return dataclasses.replace(rec, modules=[], params=[], events=[] if drop_events else rec.events)
    return rec


class StepStore(Sequence):
    """A sequence of StepRecords: the newest `hot` in memory, the rest in a spill file read back on access."""

    def __init__(self, initial=(), hot: int = MEMORY_STEPS, objects: int = MEMORY_OBJECTS):
        self._hot: list[StepRecord] = []
        self._weights: list[int] = []        # per hot record: _weight of what it holds in memory
        self._objects_max = max(int(objects), 1)
        self._held = 0                       # sum of _weights
        self._slim: list = []                # per hot record: the thinned record to spill, or None (keep it)
        self._lines: list = []               # per hot record: the run-dir line written for it (the same record), or None
        self._hot_max = max(int(hot), 1)
        self._offsets = array("q")
        self._spill = None
        self._sampled = 0                    # sampled records seen (for the detail stride)
        self._since_bad: int | None = None   # steps since the last bad one
        self._last_seq: tuple = ()
        self.routine = 0                     # routine steps stored
        for r in initial:
            self.add(r)

    # ---------------------------------------------------------------------------------------------- writing
    def _repeats(self, rec: StepRecord) -> bool:
        """The same call sequence as the step before, nothing wrong in it (no call `flagged`), no capture: its
        events say nothing new."""
        evs = rec.events
        seq = tuple([e.kind for e in evs])
        if rec.bad or rec.capture or seq != self._last_seq or any(e.flagged() for e in evs):
            self._last_seq = seq
            return False
        return True

    def add(self, rec: StepRecord, writer=None) -> None:
        """Keep `rec` (events dropped when routine), write it (thinned) to `writer`, spill old records."""
        repeats = self._repeats(rec)
        if repeats and not rec.sampled:   # a routine step
            rec.events = []
            self.routine += 1
        self._since_bad = 0 if rec.bad else (None if self._since_bad is None else self._since_bad + 1)
        keep = True
        if rec.modules or rec.params:
            keep = keeps_detail(self._sampled, self._since_bad, rec)
            self._sampled += bool(rec.sampled)
        slim = None if keep else _slim(rec, repeats)
        line = writer.append(slim or rec) if writer is not None else None
        self._hot.append(rec)
        self._slim.append(slim)
        self._lines.append(line)
        self._weights.append(_weight(rec))
        self._held += self._weights[-1]
        if len(self._hot) > self._hot_max:
            self._spill_oldest(max(self._hot_max // 4, 1))
        if self._held > self._objects_max and len(self._hot) > 1:  # the oldest records down to 3/4 of the limit
            n, held = 0, self._held
            while n < len(self._hot) - 1 and held > self._objects_max * 3 // 4:
                held -= self._weights[n]
                n += 1
            self._spill_oldest(n)

    append = add

    def drop_last(self) -> None:
        """Forget the newest record (held in memory: a record is spilled only once newer ones came), for `store`'s
        replace."""
        if not self._hot:
            return
        self._held -= self._weights.pop()
        del self._hot[-1], self._slim[-1], self._lines[-1]

    def _spill_oldest(self, n: int) -> None:
        if self._spill is None:
            self._spill = tempfile.TemporaryFile(prefix="ampdoctor-steps-")
        f = self._spill
        f.seek(0, 2)
        for rec, slim, line in zip(self._hot[:n], self._slim[:n], self._lines[:n]):
            self._offsets.append(f.tell())
            # the run-dir line of the same record when there is one (its "run" key is ignored on reading)
            f.write(line if line is not None else _packed((slim or rec).to_dict()))
        self._held -= sum(self._weights[:n])
        del self._hot[:n], self._slim[:n], self._lines[:n], self._weights[:n]

    # ---------------------------------------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self._offsets) + len(self._hot)

    def _read(self, i: int) -> StepRecord:
        f = self._spill
        f.seek(self._offsets[i])
        return StepRecord.from_dict(_unpack(f))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("step record index out of range")
        k = len(self._offsets)
        return self._read(i) if i < k else self._hot[i - k]

    def __iter__(self):
        k, pos = len(self._offsets), 0
        for _ in range(k):   # seek each time: another reader of the same store may have moved the file
            f = self._spill
            f.seek(pos)
            d = _unpack(f)
            pos = f.tell()
            yield StepRecord.from_dict(d)
        yield from list(self._hot[: len(self) - k])

    def __repr__(self) -> str:
        return f"StepStore({len(self)} records, {len(self._hot)} in memory)"

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None
            self._offsets = array("q")


_MARSHAL = b"\x00"  # a spilled record in marshal form: this byte, its length (8 bytes), the data; a JSON line starts "{"
_LEN = struct.Struct("<q")


def _packed(d: dict) -> bytes:
    try:
        data = marshal.dumps(d)
    except ValueError:  # a value marshal does not take (a namedtuple in a call's details): a JSON line
        return json.dumps(d, separators=(",", ":")).encode() + b"\n"
    return _MARSHAL + _LEN.pack(len(data)) + data


def _unpack(f) -> dict:
    """The record dict at the spill file's position (a run-dir JSON line, or a `_packed` one), the position left after
    it."""
    head = f.read(1)
    if head == _MARSHAL:
        (n,) = _LEN.unpack(f.read(_LEN.size))
        return marshal.loads(f.read(n))
    return json.loads(head + f.readline())


def store(m, rec: StepRecord, replace: bool = False) -> None:
    """Store a finished step of machine `m`: into `m.records` (a StepStore) and its run-directory writer.
    `replace`: `rec` is the newest record's step again, whole (`folded`): it takes that record's place, and the run
    directory gets a second line for the step, which rundir.read_run reads over the first."""
    if not isinstance(m.records, StepStore):   # a machine that started with a plain list
        m.records = StepStore(m.records)
    if replace:
        m.records.drop_last()
    m.records.add(rec, m.writer)


_LATER = ("scale", "next_scale", "found_inf", "grad_finite", "grad_norm", "backward_producer")


def folded(first: StepRecord, rest: StepRecord) -> StepRecord:
    """One record of a step recorded in two parts: `first` as a mid-run report found it (its forward went
    non-finite before its optimizer step) and `rest`, the remainder of its iteration (backward, the scaler's step
    and update). The end of the step (scale, found_inf, gradients, the backward's producer) is the rest's where it
    has one; the calls, module statistics and micro-batches add up; anything else is the first part's, else the
    rest's."""
    out = {}
    for f in dataclasses.fields(StepRecord):
        a, b = getattr(first, f.name), getattr(rest, f.name)
        if f.name in ("events", "modules"):
            out[f.name] = list(a) + list(b)
        elif f.name == "micro_batches":
            out[f.name] = a + b
        elif f.name in ("skipped", "sampled"):
            out[f.name] = a or b
        elif f.name in _LATER:
            out[f.name] = b if b is not None else a
        else:
            out[f.name] = a if a is not None and a != [] and a != {} else b
    out["step"] = first.step
    return StepRecord(**out)
