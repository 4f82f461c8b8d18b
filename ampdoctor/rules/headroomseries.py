"""The headroom series of one module and its maths (rules/headroom.py's headroom_trend reads them): the series from
the records (`series`: log2(dtype max / abs-max) per step, backward values unscaled), its robust trend (`trend`: a
Theil-Sen slope over the last `WINDOW` points, or on a dense series the last `LONG_SPAN` steps (`windows`), and how
steady it is), the first point worth a warning
(`first_warning`: close, falling steadily and significantly, not settling, below anything the layer showed before,
forecast to reach zero within the horizon and not refuted by what the run did next) and the predicate that tells
the model's own output fitting its targets (`fitting_predicate`). Pure functions of records and lists of points."""
from __future__ import annotations

import math
from collections.abc import Callable

from ..records import DTYPE_LIMITS
from .registry import RuleConfig, RunData

__all__ = ["WINDOW", "LONG_SPAN", "MIN_RATE", "MAX_BITS", "HORIZON", "STEADY", "series", "trend", "windows",
           "first_warning", "rate_at", "bits_at", "fitting_predicate", "median", "dtype_name"]

WINDOW = 12          # points in the trend window
MIN_RATE = 0.03      # bits/step: slower declines are drift, not a trend
MAX_BITS = 8.0       # warn only this close to the max (fp16: abs-max >= 256)
HORIZON = 100        # ... and when the forecast overflow is this many steps away at most (a forecast further out
#                      is rarely actionable, and slow drifts that a user renormalises or a fit settles read like one)
STEADY = 0.75        # share of the window's slopes that must be negative
_MAX = {"h": DTYPE_LIMITS["float16"][0], "b": DTYPE_LIMITS["bfloat16"][0]}
_NAME = {"h": "float16", "b": "bfloat16"}


def dtype_name(code: str) -> str:
    """The dtype a series' code stands for ("h": float16, "b": bfloat16)."""
    return _NAME.get(code, "float16")


def series(run: RunData, slot: int, phase: str) -> list[tuple[int, float, str]]:
    """(step, headroom bits, dtype code) of one module's low-precision values, up to the first non-finite one
    (the overflow itself ends the series). Backward values are unscaled by the step's loss scale."""
    out = []
    key = "fwd" if phase == "forward" else "bwd"
    for r in run.steps:
        h = r.headroom
        if not h or slot >= len(h.get(key) or ()):
            continue
        dt = (h.get("dtype") or "")[slot:slot + 1]
        v = h[key][slot]
        if dt not in _MAX or v is None:
            continue
        if not math.isfinite(v):
            break
        if phase == "backward" and run.has_scaler and r.scale:
            v = v / r.scale
        if v > 0:
            out.append((r.step, math.log2(_MAX[dt] / v), dt))
    return out


def trend(pts: list[tuple[int, float, str]], k: int, window: int = WINDOW) -> tuple[float, float] | None:
    """(slope in bits/step, share of negative pair slopes) over the `window` points ending at index k."""
    if k + 1 < window:
        return None
    w = pts[k + 1 - window:k + 1]
    half = window // 2
    slopes = sorted((w[j + half][1] - w[j][1]) / max(w[j + half][0] - w[j][0], 1) for j in range(half))
    mid = len(slopes) // 2
    slope = slopes[mid] if len(slopes) % 2 else 0.5 * (slopes[mid - 1] + slopes[mid])
    # steadiness over every pair at least half a window apart (21 pairs for 12 points), not only the 6 that set
    # the slope: a noisy series with no trend (heavy-tailed batches) has 5 of 6 pairs falling by chance about one
    # window in nine; 16 of 21 far less often, while a real decline falls across all of them
    far = [w[b][1] - w[a][1] for a in range(len(w)) for b in range(a + half, len(w))]
    return slope, sum(1 for d in far if d < 0) / len(far)


LONG_SPAN = 48
"""Steps a trend window spans at least, in points up to 4 x WINDOW, when the 12 points of `WINDOW` span fewer (a
dense series: every=1, or the series on every step while a layer creeps towards the max): 12 steps of a slow
runaway (0.036 bits/step) fall by less than its batch-to-batch noise, 48 steps by 4 times it (see `windows`)."""


def windows(pts, k: int) -> list[int]:
    """The trend windows (in points) tried at index k: WINDOW, then, where WINDOW's points span fewer than
    LONG_SPAN steps, the points of the last LONG_SPAN steps (at most 4 x WINDOW) as a second, longer look."""
    out = [WINDOW]
    if k + 1 > WINDOW and pts[k][0] - pts[k + 1 - WINDOW][0] < LONG_SPAN:
        n = sum(1 for j in range(max(0, k + 1 - 4 * WINDOW), k + 1) if pts[k][0] - pts[j][0] < LONG_SPAN)
        if n > WINDOW and k + 1 >= n:
            out.append(n)
    return out


def first_warning(pts, cfg: RuleConfig, fitting=None):
    """The first point where the series is close, falling steadily and forecast to reach zero in time
    (`fitting(window)`: the window's values are the model's output growing towards what the loss asks for). Each
    point is judged over `windows`: its 12 points, and on a dense series the last LONG_SPAN steps as well."""
    lows = [math.inf]  # lows[j]: the lowest headroom of the points before index j (the history of a window at j)
    levels = [math.inf]  # levels[j]: the same of the medians of 5 consecutive points (see `_warning`)
    for i, p in enumerate(pts):
        lows.append(min(lows[-1], p[1]))
        levels.append(min(levels[-1], median([q[1] for q in pts[i - 4:i + 1]])) if i >= 4 else math.inf)
    floor = math.inf  # after a refuted forecast: warn again only a bit below where it was refuted
    for k in range(len(pts)):
        bits = pts[k][1]
        if bits >= floor or bits > cfg.headroom_max_bits:
            continue
        if fitting is not None and k + 1 >= WINDOW and fitting(pts[k + 1 - WINDOW:k + 1]):
            continue  # the recent points are a fit (a longer window may reach back past a change of targets)
        refuted = None
        for win in windows(pts, k):
            w = _warning(pts, k, win, cfg, fitting, (lows if win == WINDOW else levels)[max(k + 1 - win, 0)])
            if w is None:
                continue
            if not _refuted(pts, k, w["forecast"], min(w["bits"], bits), w["rate"]):
                return w
            # a 12-point slope steepened by noise forecasts too early and is refuted; the longer window's may not be
            refuted = w if refuted is None else refuted
        if refuted is not None:
            floor = min(refuted["bits"], bits) - 1.0  # the same fall seen from the next points is refuted too
    return None


def _warning(pts, k: int, win: int, cfg: RuleConfig, fitting, low: float) -> dict | None:
    """The warning the `win` points ending at index k give (before `_refuted` looks at what came after), or None:
    falling steadily, significantly, not settling nor by one jump, the trend line's level below the layer's history
    (`low`: the lowest point before the window; for a longer window, the lowest median of 5 consecutive points, so
    that one outlier batch long ago — a heavy-tailed input that dipped the headroom by bits for a step — does not
    set the bar) and the forecast within the horizon."""
    t = trend(pts, k, win)
    if t is None or win > WINDOW and fitting is not None and fitting(pts[k + 1 - win:k + 1]):
        return None
    slope, steady = t
    if slope > -cfg.headroom_min_rate or steady < STEADY or not _significant(pts, k, slope, win) \
            or _settling(pts, k, slope, win) or _jump(pts, k, win):
        return None
    # the level the window's trend line gives at this step (the median of its points carried along the slope):
    # one batch of outliers — heavy-tailed inputs — dips a single point, not the line
    step = pts[k][0]
    level = median([b + slope * (step - s) for s, b, _ in pts[k + 1 - win:k + 1]])
    if _turned(pts, k, slope, win, level):
        return None
    if level > cfg.headroom_max_bits or low < math.inf and level >= low - _noise(pts, k + 1 - win):
        # ... and below anything the layer showed before the window, by more than its step-to-step noise: a layer
        # that has sat near the max for a long time (a stable hot unit, a level it reached early) shows chance runs
        # of rising values, and now and then a new low by a hair; a layer running out of range goes where it has
        # never been
        return None
    bits = max(pts[k][1], level)
    left = max(bits, 0.0) / -slope
    if left > cfg.headroom_horizon:
        return None
    return {"step": step, "bits": bits, "rate": slope, "forecast": step + math.ceil(left), "dtype": pts[k][2]}


JUMP_BITS = 1.0
"""A single change between two points of a window that falls at least this far, and as far as the rest of the
window's fall together, is a step change (see _jump)."""


def _jump(pts, k: int, window: int = WINDOW) -> bool:
    """Whether the window's fall is one step change, not a trend: a single change between consecutive points of at
    least JUMP_BITS beyond what the rest of the window's rate gives over its steps, and half the window's fall or
    more (a layer's scale that jumped once, by an injected or restored weight or a curriculum stage's inputs, and
    then stayed: the points before and after it make a steep Theil-Sen slope; a layer running out of range falls
    point after point, and across a gap in the series — sparse points, then every step — by its rate times the
    gap). Over a longer window than WINDOW, a fall that the next points undo (one outlier batch) or that only ends a
    rise the points before it did not have (a spike's end) is no step change either: a noisy series has such pairs
    in any 48 points."""
    w = pts[k + 1 - window:k + 1]
    total = w[0][1] - w[-1][1]
    pairs = list(zip(w, w[1:]))
    rates = [(a[1] - b[1]) / max(b[0] - a[0], 1) for a, b in pairs]  # falls per step
    for j, (a, b) in enumerate(pairs):
        drop = a[1] - b[1]
        if drop < JUMP_BITS or drop < 0.5 * total or window > WINDOW and _passing(w, j, drop):
            continue
        rest = median(rates[:j] + rates[j + 1:])
        excess = drop - max(rest, 0.0) * (b[0] - a[0] - 1)
        if excess >= JUMP_BITS and excess >= 0.5 * total:
            return True
    return False


def _passing(w, j: int, drop: float) -> bool:
    """Whether the fall of `drop` between points j and j + 1 of window `w` does not stay: the next (up to 3) points
    come back over half of it, or the (up to 3) points before j sit over half of it below point j."""
    after = [p[1] for p in w[j + 2:j + 5]]
    before = [p[1] for p in w[max(0, j - 3):j]]
    return bool(after) and median(after) > w[j + 1][1] + 0.5 * drop \
        or bool(before) and median(before) < w[j][1] - 0.5 * drop


REFUTED_BITS = 2.0
"""A forecast of overflow is refuted when the layer still had this much headroom (4x) at the forecast step."""


REFUTED_SPAN = 20
"""Steps of series after a warning over which a fall that stopped refutes it (with WINDOW // 2 points at least)."""


PLATEAU_BITS = 1.0
"""A fall that stopped at this much headroom (2x) or more, and stayed stopped, refutes its warning (see _refuted)."""


def _refuted(pts, k: int, forecast: int, bits: float, rate: float) -> bool:
    """What the run did after the warning shows the fall it extrapolated stopped or slowed (a fit reaching its
    targets, a one-time jump in the inputs' scale, sampled sparsely): the run went past the forecast step with
    `REFUTED_BITS` left or never came a bit closer to the max; or, over at least `REFUTED_SPAN` steps and half a
    window of points, it fell at under a quarter of the warned rate and never came a bit closer; or it came closer,
    stopped at `PLATEAU_BITS` or more and stayed there as long (before or past the forecast step). A layer that did
    run out keeps falling to its overflow, where its series ends; a warning at the end of a run stays."""
    later = pts[k + 1:]
    if not later:
        return False
    closest = min(p[1] for p in later)
    if later[-1][0] >= forecast:
        at = next(p[1] for p in later if p[0] >= forecast)
        if closest >= bits - 1.0 or at >= REFUTED_BITS:
            return True
        # past the forecast step under REFUTED_BITS: refuted still when the fall stopped at PLATEAU_BITS or more
        # and stayed there (below); an early point of a fit's rise, warned at whatever point the stride put there,
        # forecasts the step at which the fit levels off under 2 bits
    elif len(later) < WINDOW // 2 or later[-1][0] - later[0][0] < REFUTED_SPAN:
        return False
    if closest < bits - 1.0:
        # it came closer than warned, then stopped: refuted when the run went on `REFUTED_SPAN` steps and half a
        # window of points past its closest approach, at PLATEAU_BITS or more, without coming closer (a fit
        # reaching a new target's scale); a layer running out keeps falling, and its closest point is its last
        after = later[min(range(len(later)), key=lambda j: later[j][1]):]
        return closest >= PLATEAU_BITS and len(after) > WINDOW // 2 and after[-1][0] - after[0][0] >= REFUTED_SPAN
    slopes = [(b[1] - a[1]) / max(b[0] - a[0], 1) for i, a in enumerate(later) for b in later[i + 1:]]
    return median(slopes) > rate / 4


SIGNIFICANT = 3.0
"""A window's slope must be this many standard errors from zero (see _significant)."""


def _significant(pts, k: int, slope: float, window: int = WINDOW) -> bool:
    """Whether the window's slope stands out of its own noise: a drift of 0.02 bits/step under batch-to-batch noise
    of ~0.3 bits reads 0.04 bits/step over some 12-point windows. The noise is estimated from consecutive changes
    within the window (median |change| / 0.954 for normal noise; a steady trend adds only its rate to each change),
    the slope's standard error as for a least-squares line through the window's steps."""
    w = pts[k + 1 - window:k + 1]
    sigma = _sigma(w)
    mean = sum(p[0] for p in w) / len(w)
    spread = sum((p[0] - mean) ** 2 for p in w)
    return spread > 0 and -slope >= SIGNIFICANT * sigma / math.sqrt(spread)


def _settling(pts, k: int, slope: float, window: int = WINDOW) -> bool:
    """Whether the window's latest half has stopped falling at its rate: the median slope over the pairs of that
    half is under a third of the window's. A layer fitting its targets falls fast, then flattens (a regression
    head reaching the targets' magnitude); over sparse points (the series on every few steps) a window can hold
    both, and its slope is the early fall's. A runaway keeps its rate or speeds up."""
    w = pts[k + 1 - window // 2:k + 1]
    rec = [(b[1] - a[1]) / max(b[0] - a[0], 1) for i, a in enumerate(w) for b in w[i + 1:]]
    return bool(rec) and median(rec) > slope / 3


TURNED = 3.0
"""The window's last points sitting this many noise deviations above its trend line have turned back (see _turned)."""


def _turned(pts, k: int, slope: float, window: int, level: float) -> bool:
    """Whether the fall has turned back by the window's end: the median of its last 3 points sits TURNED noise
    deviations (as `_significant` estimates them) above the window's trend line (`level` at index k, `slope`). A
    48-step window over a fall and the start of its recovery (a cyclic target's amplitude turning, lr cycling down)
    keeps a steep slope whose line runs below the recovering points; a runaway's last points sit on its line or,
    speeding up, under it."""
    w = pts[k + 1 - window:k + 1]
    step = pts[k][0]
    resid = median([b - (level + slope * (s - step)) for s, b, _ in w[-3:]])
    return resid > TURNED * _sigma(w)


def _sigma(w) -> float:
    """A window's noise deviation from its consecutive changes: median |change| / 0.954 (normal noise; a steady
    trend adds only its rate to each change)."""
    return median([abs(b[1] - a[1]) for a, b in zip(w, w[1:])]) / 0.954


def _noise(pts, end: int, n: int = 4 * WINDOW) -> float:
    """The step-to-step noise of the series before index `end`: the median absolute change between consecutive
    points over the last `n` of them (for independent noise of deviation s, ~0.95 s; for a steady trend, its
    rate)."""
    h = [p[1] for p in pts[max(0, end - n):end]]
    return median([abs(b - a) for a, b in zip(h, h[1:])]) if len(h) > 2 else 0.0


def rate_at(pts, step: int) -> float | None:
    """The series' steady slope at `step` (None when it is not falling steadily there): its 12-point window's, unless
    on a dense series the last LONG_SPAN steps do not fall at MIN_RATE (a flat layer's 12 noisy points read a slope
    as often as not; a growth that speeds up falls faster over its last 12 points than over 48, and keeps their
    rate); then the longer window's, when it falls steadily."""
    idx = [i for i, p in enumerate(pts) if p[0] <= step]
    if not idx:
        return None
    fits = [trend(pts, idx[-1], win) for win in windows(pts, idx[-1])]
    short, longer = fits[0], fits[1] if len(fits) > 1 else None
    if short is not None and short[1] >= STEADY and short[0] <= -MIN_RATE \
            and (longer is None or longer[0] <= -MIN_RATE):
        return short[0]
    if longer is not None and longer[1] >= STEADY and longer[0] <= -MIN_RATE:
        return longer[0]
    return None


def bits_at(pts, step: int) -> float:
    cur = [p[1] for p in pts if p[0] <= step]
    return cur[-1] if cur else math.inf


def fitting_predicate(run: RunData, root: list) -> Callable[[list], bool]:
    """A predicate on a window of a forward series: its values are the root's output (the same abs-max on at least
    two thirds of the steps and never more headroom than the root's: the model's prediction, or one of its heads)
    and the loss fell: its median over the window's last half is below its median
    around the window's start (half a window either side; an overshoot at the end of the fit, the loss bouncing
    while the output still grows a few steps, is still a fit)."""
    rootv = {p[0]: p[1] for p in root}
    losses: dict = {}

    def fitting(window) -> bool:
        # the root's abs-max is the largest of its outputs': one of several heads matches it on most steps (the
        # other head may start larger) and never exceeds it
        if not rootv or any(rootv.get(p[0]) is None or rootv[p[0]] > p[1] + 1e-9 for p in window) \
                or 3 * sum(1 for p in window if rootv[p[0]] == p[1]) < 2 * len(window):
            return False
        if not losses:
            losses.update((r.step, r.loss) for r in run.steps if r.loss is not None and math.isfinite(r.loss))
        s0, s1 = window[0][0], window[-1][0]
        half = max((s1 - s0 + 1) // 2, 1)
        before = [v for s in range(s0 - half, s0 + half) if (v := losses.get(s)) is not None]
        recent = [v for s in range(s1 - half + 1, s1 + 1) if (v := losses.get(s)) is not None]
        return len(before) >= half and len(recent) >= half and median(recent) < median(before) \
            and not _fit_beyond(window, losses)
    return fitting


BEYOND = 2.0
"""A fit whose loss, carried along its fall against the output's magnitude, reaches zero only past this many times
the dtype's max is a fit towards targets the dtype cannot hold (see _fit_beyond)."""


def _fit_beyond(window, losses: dict) -> bool:
    """Whether the output grows towards targets beyond the dtype's range (raw units nobody normalised): the loss,
    as a line in the output's abs-max over the window (Theil-Sen), reaches zero only past BEYOND x the dtype's max.
    A loss that falls faster than linearly as the output nears its targets (a squared error) reaches zero on that
    line before the targets do, and a loss floor after it: a fit within range stays a fit. A loss below zero over
    the window's last half (-score, a reward) has no such floor: no fit."""
    xy = [(_MAX[dt] / 2.0 ** b, v) for s, b, dt in window if (v := losses.get(s)) is not None]
    if len(xy) < WINDOW // 2 or not all(math.isfinite(x) and x > 0 for x, _ in xy):
        return False
    if max(v for _, v in xy[len(xy) // 2:]) < 0:
        return True  # a loss below zero (an unbounded -score) has no floor at zero to reach: no target in sight
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(xy) for b in xy[i + 1:] if b[0] != a[0]]
    if not slopes:
        return False
    slope = median(slopes)  # loss per unit of output
    if not slope < 0:
        return False
    x1 = xy[-1][0]
    level = median([y + slope * (x1 - x) for x, y in xy])  # the line's loss at the window's last output
    return level > 0 and x1 + level / -slope >= BEYOND * _MAX[window[-1][2]]


def median(v: list[float]) -> float:
    v = sorted(v)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])
