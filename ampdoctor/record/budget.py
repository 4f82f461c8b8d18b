"""Which routine steps carry the headroom series when `WatchConfig.headroom == "auto"`: as many as fit in
`headroom_budget` of the step time, measured on the run itself.

Each routine step is timed from its beginning (the root's forward, zero_grad or scaler.scale) to its end (the
optimizer's step: with a GradScaler, after the scaler's own synchronisation, so the device's work is in it), plus
what ampdoctor does for it at the next iteration's start (its record finalised, the series read back, the hooks
parked): the training step itself, not what the loop does between steps (data loading, logging, evaluation).
Steps with the series and steps without it keep their own recent medians; their difference is what the series
costs a step, and the stride (one step in `stride` carries it) is the smallest that keeps the average cost within
the budget. Until both kinds have a few samples the stride is 2, so both are measured; at stride 1 a step without
the series now and then keeps the comparison current. Sampled steps (full statistics) and the observed step (every hook on, see
Headroom.plan) are not timed.
"""
from __future__ import annotations

import math
import time
from collections import deque
from statistics import median

__all__ = ["HeadroomBudget"]

SAMPLES = 9        # recent steps of each kind whose median is compared
MIN_SAMPLES = 3    # ... needed of each before the stride follows the measurement
MAX_STRIDE = 32    # the series at least every this many routine steps
REFRESH = 32       # at stride 1, one step in this many goes without the series (to keep measuring its cost)


class HeadroomBudget:
    __slots__ = ("share", "times", "t0", "timed", "since", "stride", "off_age", "last")

    def __init__(self, share: float):
        self.share = share
        self.times = {True: deque(maxlen=SAMPLES), False: deque(maxlen=SAMPLES)}
        self.t0: float | None = None
        self.timed: bool | None = None  # the open step: True/False it runs with/without the series; None untimed
        self.since = 0                  # routine steps since the last one with the series
        self.stride = 2
        self.off_age = 0                # routine steps since the last one without it
        self.last: bool | None = None   # the kind of the last timed step (its tail is added by `tail`)

    def begin(self) -> None:
        """A step begins now (timed as `due`/`untimed` said)."""
        self.t0 = time.perf_counter()
        self.timed = None

    def ended(self) -> None:
        """The open step reached its optimizer step: its time counts for its kind."""
        self.last = None
        if self.timed is not None and self.t0 is not None:
            self.times[self.timed].append(time.perf_counter() - self.t0)
            self.last = self.timed
        self.timed = None

    def tail(self, seconds: float) -> None:
        """What the last timed step cost after its optimizer step (its record finalised at the next iteration's
        start, its hooks parked): added to its time, so that the series' read-back counts against the series."""
        if self.last is not None and self.times[self.last]:
            self.times[self.last][-1] += seconds

    def due(self) -> bool:
        """Whether the routine step beginning now carries the series (and is timed as such)."""
        on, off = self.times[True], self.times[False]
        if len(on) >= MIN_SAMPLES and len(off) >= MIN_SAMPLES:
            plain = median(off)
            cost = median(on) - plain
            self.stride = 1 if cost <= 0 or plain <= 0 else min(MAX_STRIDE, math.ceil(cost / (self.share * plain) - 1e-6))
        due = self.since + 1 >= self.stride
        if due and self.stride == 1 and self.off_age + 1 >= REFRESH:
            due = False
        self.since = 0 if due else self.since + 1
        self.off_age = self.off_age + 1 if due else 0
        self.timed = due
        return due

    def untimed(self) -> None:
        """The step beginning now carries the series but is not timed (the observed step)."""
        self.since = 0
        self.timed = None

