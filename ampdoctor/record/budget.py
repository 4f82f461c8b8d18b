"""Which routine steps carry the headroom series when `WatchConfig.headroom == "auto"`: as many as fit in
`headroom_budget` of the step time, measured on the run itself.

Each routine step is timed from its beginning (the root's forward, zero_grad or scaler.scale) to its end (the
optimizer's step: with a GradScaler, after the scaler's own synchronisation, so the device's work is in it), plus
what ampdoctor does for it at the next iteration's start (its record finalised, the series read back, the hooks
parked): the training step itself, not what the loop does between steps (data loading, logging, evaluation).
Each timed step with the series is compared with the timed step without it next to it (before or after): the
median of the recent differences is what the series costs a step, the median of those steps without it the plain
step, and the stride (one step in `stride` carries it) is the smallest that keeps the average cost within the
budget. Neighbours, not each kind's own recent median: at stride 1 a step without the series comes only every
REFRESH steps, and a median of those reached back hundreds of steps, to a warm-up (torch.compile, the allocator)
whose slow steps made the series look free. Until a few such pairs are timed the stride is 2, so both kinds are
measured; at stride 1 a step without the series now and then keeps the comparison current. Sampled steps (full
statistics) and the observed step (every hook on, see Headroom.plan) are not timed.

A cost of a few percent of a short step can hide in its noise: a host whose step time jumps by milliseconds from one
step to the next gave neighbour pairs whose median was negative for a series costing 3-5% (the H200's compiled
nanoGPT step, read off steps forced to alternate). So the series' own bulk work timed on the host (its flushes,
staging and read-back: `Headroom.spent`, no per-value hook) is a floor under the measured cost: what the step cannot
have saved, whatever the pairs say. The hooks' own cost and the device's are the pairs' to find.
"""
from __future__ import annotations

import math
import time
from collections import deque
from statistics import median

__all__ = ["HeadroomBudget"]

SAMPLES = 9        # recent pairs of neighbouring steps with and without the series whose medians are compared
MIN_SAMPLES = 4    # ... needed before the stride follows the measurement (6 timed steps, 3 of each kind)
MAX_STRIDE = 32    # the series at least every this many routine steps
REFRESH = 32       # at stride 1, one step in this many goes without the series (to keep measuring its cost)
ALERT_ABSMAX = 256.0  # an fp16 output this large (8 bits from the max: rules/headroomseries.MAX_BITS) ...
ALERT_RISE = 0.2      # ... that rose by this many bits over its last ALERT_POINTS points of the series ...
ALERT_POINTS = 3
ALERT_STEPS = 24      # ... has the series on every routine step for this many steps (two trend windows)


class HeadroomBudget:
    __slots__ = ("share", "pairs", "own", "t0", "timed", "since", "stride", "off_age", "last", "done", "hot",
                 "alert_left", "alerts", "dirty")

    def __init__(self, share: float):
        self.share = share
        self.pairs: deque = deque(maxlen=SAMPLES)  # (with - without, without) seconds of neighbouring timed steps
        self.own: deque = deque(maxlen=SAMPLES)    # the series' own bulk host seconds on timed steps that carried it
        self.t0: float | None = None
        self.timed: bool | None = None  # the open step: True/False it runs with/without the series; None untimed
        self.since = 0                  # routine steps since the last one with the series
        self.stride = 2
        self.off_age = 0                # routine steps since the last one without it
        self.last: list | None = None   # [kind, seconds] of the last timed step: its tail may still come (`tail`)
        self.done: tuple | None = None  # (kind, seconds) of the timed step before it, complete
        self.hot: list = []             # the forward abs-maxes of the last ALERT_POINTS steps with the series
        self.alert_left = 0             # routine steps still to carry the series (`creep`)
        self.alerts = 0                 # how often `creep` had the series on every step
        self.dirty = False              # a pair or an own time came since the stride was last worked out (`due`)

    def begin(self) -> None:
        """A step begins now (timed as `due`/`untimed` said)."""
        self.t0 = time.perf_counter()
        self.timed = None

    def ended(self) -> None:
        """The open step reached its optimizer step: its time counts for its kind."""
        timed = self.timed is not None and self.t0 is not None
        self.add(self.timed, time.perf_counter() - self.t0 if timed else None)

    def add(self, kind: bool | None, seconds: float | None) -> None:
        """A step ended, with the series (kind True), without it (False) or untimed (None). The timed step before
        it is complete now (its tail came when this one began): paired with the one before that if their kinds
        differ."""
        prev, self.last, self.timed = self.last, None, None
        if prev is not None:
            k, secs = prev
            if self.done is not None and self.done[0] != k:
                on, off = (secs, self.done[1]) if k else (self.done[1], secs)
                self.pairs.append((on - off, off))
                self.dirty = True
            self.done = (k, secs)
        if kind is not None and seconds is not None:
            self.last = [kind, seconds]

    def tail(self, seconds: float) -> None:
        """What the last timed step cost after its optimizer step (its record finalised at the next iteration's
        start, its hooks parked): added to its time, so that the series' read-back counts against the series."""
        if self.last is not None:
            self.last[1] += seconds

    def series_time(self, seconds: float) -> None:
        """The host time the series' own bulk work took on the last timed step, if that step carried it (the floor
        of its cost, see the module docstring)."""
        if self.last is not None and self.last[0]:
            self.own.append(seconds)
            self.dirty = True

    def creep(self, fwd: list, dtype: str) -> None:
        """A step's series (its forward abs-maxes, `dtype` one code per slot): an fp16 output within 8 bits of the max
        (now, or at the next point at the rate of its last ones) that rose at each of its last ALERT_POINTS points,
        by ALERT_RISE bits in all, has the series on every routine
        step for ALERT_STEPS steps, so that its trend (rules/headroomseries.py: WINDOW points) is judged over a few
        steps, not over WINDOW strides: a layer running out of range is warned in time whatever stride the budget
        chose. Those steps are not timed (the budget's measurement stays the routine one's)."""
        hist = self.hot
        hist.append(fwd)
        del hist[:-ALERT_POINTS]
        if len(hist) < ALERT_POINTS:
            return
        first = hist[0]
        for s, v in enumerate(fwd):
            if v is None or not 0 < v < math.inf or dtype[s:s + 1] != "h":
                continue
            f = first[s] if s < len(first) else None
            if f is None or not 0 < f <= v:
                continue
            rise = math.log2(v / f)
            # in the alert range now, or at the next point at the rate of the last ones (a coarse stride: a layer
            # rising bits per point is there before its trend window fills)
            if v < ALERT_ABSMAX and v * 2.0 ** (rise / (ALERT_POINTS - 1)) < ALERT_ABSMAX:
                continue
            pts = [h[s] if s < len(h) else None for h in hist]
            if all(a is not None and b is not None and a < b for a, b in zip(pts, pts[1:])) and rise >= ALERT_RISE:
                if not self.alert_left:
                    self.alerts += 1
                self.alert_left = ALERT_STEPS
                return

    def due(self) -> bool:
        """Whether the routine step beginning now carries the series (and is timed as such)."""
        if self.alert_left > 0:  # (creep: untimed, as the observed step)
            self.alert_left -= 1
            self.untimed()
            self.off_age += 1
            return True
        if self.dirty and len(self.pairs) >= MIN_SAMPLES:  # (the stride changes only with what was measured)
            self.dirty = False
            cost = median([p[0] for p in self.pairs])
            if self.own:
                cost = max(cost, median(self.own))
            plain = median([p[1] for p in self.pairs])
            self.stride = 1 if cost <= 0 or plain <= 0 else min(MAX_STRIDE,
                                                                math.ceil(cost / (self.share * plain) - 1e-6))
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

