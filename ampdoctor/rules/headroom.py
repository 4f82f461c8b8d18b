"""headroom_trend: an early warning from the always-on headroom series (StepRecord.headroom, every step).

Per module and phase, headroom bits = log2(dtype max / abs-max) over the steps. A robust trend — the median of
lagged slopes over the last `window` points (a Theil–Sen estimate on half-window pairs) that must also be
steady (most of those slopes negative) — and a forecast of the step at which the headroom reaches zero. The
rule warns the first time a layer is close (`max_bits`), falling (`min_rate` bits/step) and forecast to overflow
within `horizon` steps, while there is still time to act.

Silent by construction on:
- values that never meet a low-precision op: only fp16/bf16 outputs (and the gradients into them) are read; an
  fp32 residual stream that only reaches LayerNorm in fp32 is not at risk;
- activations that grow and settle early in training: far from the max, and a settled series has no steady
  negative slope;
- gradients scaled by a GradScaler: judged unscaled (the scaler's own growth and backoff are its job);
- one batch far from the others (heavy-tailed inputs: a Student-t feature's outlier row): the closeness is read
  from the window's trend line, not from its last point alone, so a single dip is not a layer running out;
- a fall that stopped: when the run went on past the forecast step with 2 bits left, or for 20 steps at under a
  quarter of the rate, never a bit closer to the max than when it would have been warned about, the forecast was
  refuted (a report written after the fact does not repeat it; one written at the time did warn);
- the model's own output growing while the loss falls: a regression fitting unnormalised targets (an MSE on
  values in the thousands) grows its output until it matches them, then settles; the loss pulls it there, so
  its past rate forecasts nothing. Layers inside the model still warn on their own headroom.

One finding per chain, at the producer: a parent passing on its child's value is dropped for the child, and
of the layers falling at the same rate the first in forward order (the one the others take their input from)
is named; the layer forecast to overflow first is given in the evidence.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from ..findings import Finding
from ..records import DTYPE_LIMITS
from .registry import RuleConfig, RunData, register
from ..fixes import fp32_snippet
from .origins import autocast_device
from .steps import real_bad_steps

__all__ = ["headroom_trend", "trend", "series"]

WINDOW = 12          # points in the trend window
MIN_RATE = 0.03      # bits/step: slower declines are drift, not a trend
MAX_BITS = 8.0       # warn only this close to the max (fp16: abs-max >= 256)
HORIZON = 100        # ... and when the forecast overflow is this many steps away at most (a forecast further out
#                      is rarely actionable, and slow drifts that a user renormalises or a fit settles read like one)
STEADY = 0.75        # share of the window's slopes that must be negative
_MAX = {"h": DTYPE_LIMITS["float16"][0], "b": DTYPE_LIMITS["bfloat16"][0]}
_NAME = {"h": "float16", "b": "bfloat16"}


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


def _first_warning(pts, cfg: RuleConfig, fitting=None):
    """The first point where the series is close, falling steadily and forecast to reach zero in time
    (`fitting(window)`: the window's values are the model's output growing towards what the loss asks for)."""
    low = math.inf  # the lowest headroom before the current window (its history)
    floor = math.inf  # after a refuted forecast: warn again only a bit below where it was refuted
    for k in range(len(pts)):
        if k >= WINDOW:
            low = min(low, pts[k - WINDOW][1])
        bits = pts[k][1]
        if bits >= floor:
            continue
        if bits > cfg.headroom_max_bits:
            continue
        t = trend(pts, k)
        if t is None or fitting is not None and fitting(pts[k + 1 - WINDOW:k + 1]):
            continue
        slope, steady = t
        if slope > -cfg.headroom_min_rate or steady < STEADY or not _significant(pts, k, slope) \
                or _settling(pts, k, slope):
            continue
        # the level the window's trend line gives at this step (the median of its points carried along the
        # slope): one batch of outliers — heavy-tailed inputs — dips a single point, not the line
        step = pts[k][0]
        level = _median([b + slope * (step - s) for s, b, _ in pts[k + 1 - WINDOW:k + 1]])
        if level > cfg.headroom_max_bits or low < math.inf and level >= low - _noise(pts, k + 1 - WINDOW):
            # ... and below anything the layer showed before the window, by more than its step-to-step noise: a
            # layer that has sat near the max for a long time (a stable hot unit, a level it reached early)
            # shows chance runs of rising values, and now and then a new low by a hair; a layer running out of
            # range goes where it has never been
            continue
        bits = max(bits, level)
        left = max(bits, 0.0) / -slope
        if left > cfg.headroom_horizon:
            continue
        if _refuted(pts, k, pts[k][0] + math.ceil(left), min(bits, pts[k][1]), slope):
            floor = min(bits, pts[k][1]) - 1.0  # the same fall seen from the next points is refuted too
            continue
        return {"step": pts[k][0], "bits": bits, "rate": slope, "forecast": pts[k][0] + math.ceil(left),
                "dtype": pts[k][2]}
    return None


REFUTED_BITS = 2.0
"""A forecast of overflow is refuted when the layer still had this much headroom (4x) at the forecast step."""


REFUTED_SPAN = 20
"""Steps of series after a warning over which a fall that stopped refutes it (with WINDOW // 2 points at least)."""


def _refuted(pts, k: int, forecast: int, bits: float, rate: float) -> bool:
    """What the run did after the warning shows the fall it extrapolated stopped or slowed (a fit reaching its
    targets, a one-time jump in the inputs' scale, sampled sparsely): the run went past the forecast step with
    `REFUTED_BITS` left or never came a bit closer to the max; or, over at least `REFUTED_SPAN` steps and half a
    window of points, it fell at under a quarter of the warned rate and never came a bit closer. A layer that did
    run out keeps falling to its overflow, where its series ends; a warning at the end of a run stays."""
    later = pts[k + 1:]
    if not later:
        return False
    closest = min(p[1] for p in later)
    if later[-1][0] >= forecast:
        at = next(p[1] for p in later if p[0] >= forecast)
        return closest >= bits - 1.0 or at >= REFUTED_BITS
    if len(later) < WINDOW // 2 or later[-1][0] - later[0][0] < REFUTED_SPAN or closest < bits - 1.0:
        return False
    slopes = [(b[1] - a[1]) / max(b[0] - a[0], 1) for i, a in enumerate(later) for b in later[i + 1:]]
    return _median(slopes) > rate / 4


SIGNIFICANT = 3.0
"""A window's slope must be this many standard errors from zero (see _significant)."""


def _significant(pts, k: int, slope: float) -> bool:
    """Whether the window's slope stands out of its own noise: a drift of 0.02 bits/step under batch-to-batch noise
    of ~0.3 bits reads 0.04 bits/step over some 12-point windows. The noise is estimated from consecutive changes
    within the window (median |change| / 0.954 for normal noise; a steady trend adds only its rate to each change),
    the slope's standard error as for a least-squares line through the window's steps."""
    w = pts[k + 1 - WINDOW:k + 1]
    sigma = _median([abs(b[1] - a[1]) for a, b in zip(w, w[1:])]) / 0.954
    mean = sum(p[0] for p in w) / len(w)
    spread = sum((p[0] - mean) ** 2 for p in w)
    return spread > 0 and -slope >= SIGNIFICANT * sigma / math.sqrt(spread)


def _settling(pts, k: int, slope: float) -> bool:
    """Whether the window's latest half has stopped falling at its rate: the median slope over the pairs of that
    half is under a third of the window's. A layer fitting its targets falls fast, then flattens (a regression
    head reaching the targets' magnitude); over sparse points (the series on every few steps) a window can hold
    both, and its slope is the early fall's. A runaway keeps its rate or speeds up."""
    w = pts[k + 1 - WINDOW // 2:k + 1]
    rec = [(b[1] - a[1]) / max(b[0] - a[0], 1) for i, a in enumerate(w) for b in w[i + 1:]]
    return bool(rec) and _median(rec) > slope / 3


def _noise(pts, end: int, n: int = 4 * WINDOW) -> float:
    """The step-to-step noise of the series before index `end`: the median absolute change between consecutive
    points over the last `n` of them (for independent noise of deviation s, ~0.95 s; for a steady trend, its
    rate)."""
    h = [p[1] for p in pts[max(0, end - n):end]]
    return _median([abs(b - a) for a, b in zip(h, h[1:])]) if len(h) > 2 else 0.0


def _rate_at(pts, step: int) -> float | None:
    """The series' steady slope at `step` (None when it is not falling steadily there)."""
    idx = [i for i, p in enumerate(pts) if p[0] <= step]
    if not idx:
        return None
    t = trend(pts, idx[-1])
    if t is None or t[1] < STEADY or t[0] > -MIN_RATE:
        return None
    return t[0]


CHAIN_BITS = 4.0
"""A layer joins a warned layer's chain only within this many bits (x16) of its headroom."""


def _bits_at(pts, step: int) -> float:
    cur = [p[1] for p in pts if p[0] <= step]
    return cur[-1] if cur else math.inf


def _order(run: RunData) -> dict[str, int]:
    """Forward call order of the modules (from the first step with full statistics), else RunMeta order."""
    order = {m[0]: i for i, m in enumerate(run.meta.modules)}
    rec = next((r for r in run.steps if r.modules), None)
    if rec is not None:
        first: dict[str, int] = {}
        for c in rec.modules:
            first.setdefault(c.module, c.seq)
        base = len(order)
        order = {n: first.get(n, base + i) for n, i in order.items()}
    return order


def _fitting(run: RunData, root: list) -> Callable[[list], bool]:
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
        return len(before) >= half and len(recent) >= half and _median(recent) < _median(before)
    return fitting


def _median(v: list[float]) -> float:
    v = sorted(v)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


def _inside(child: str, parent: str) -> bool:
    return parent == "" and child != "" or child.startswith(parent + ".")


@register("headroom_trend", emits=("headroom_trend",))
def headroom_trend(run: RunData, cfg: RuleConfig) -> list[Finding]:
    mods = run.meta.modules
    if not mods or not any(r.headroom for r in run.steps):
        return []
    order = _order(run)
    known: list = []  # the run's real bad steps, read once when a warning needs them (a long run's records come from
    #                   the spill file): not GradScaler's search, not an absorbed mask (rules/steps.real_bad)

    def bad_steps() -> list:
        if not known:
            known.append(list(real_bad_steps(list(run.steps), run.has_scaler, run.growth_factor)))
        return known[0]

    def bad() -> int | None:
        return bad_steps()[0].step if bad_steps() else None
    out: list[Finding] = []
    root = next((i for i, m in enumerate(mods) if m[0] == ""), None)
    for phase in ("forward", "backward"):
        pts = {i: series(run, i, phase) for i in range(len(mods))}
        fitting = _fitting(run, pts[root]) if phase == "forward" and root is not None and pts[root] else None
        # a root whose output is not read (fp32: `.float()` logits, a returned loss): the model's prediction is
        # the last module in forward order that has a series, its own reference
        last = None if fitting is not None or phase != "forward" else max(
            (i for i, p in pts.items() if p), key=lambda i: order.get(mods[i][0], -1), default=None)
        fits = {i: fitting for i in pts} if last is None else {last: _fitting(run, pts[last])}
        warn = {i: w for i, p in pts.items() if (w := _first_warning(p, cfg, fits.get(i))) is not None}
        # a parent whose child warns too only passes the child's value on
        warn = {i: w for i, w in warn.items()
                if not any(j != i and _inside(mods[j][0], mods[i][0]) for j in warn)}
        named: set[int] = set()
        for i, w in sorted(warn.items(), key=lambda kv: (kv[1]["step"], order.get(mods[kv[0]][0], 0))):
            if i in named:
                continue
            # the producer: of the layers falling at about this rate at this step, the first in forward order
            # that is not an ancestor of another such layer
            # (and close to it in headroom: a layer far from the max that drifts at a similar rate — training's
            # own growth upstream — is not what carries this one towards it)
            near = _bits_at(pts[i], w["step"]) + CHAIN_BITS
            chain = [j for j, p in pts.items() if j not in named and not _inside(mods[i][0], mods[j][0])
                     and (r := _rate_at(p, w["step"])) is not None and 0.5 <= r / w["rate"] <= 2.0
                     and _bits_at(p, w["step"]) <= near]
            chain = [j for j in chain if not any(o != j and _inside(mods[o][0], mods[j][0]) for o in chain)]
            if i not in chain:
                chain.append(i)
            prod = min(chain, key=lambda j: order.get(mods[j][0], 0))
            named.update(chain)
            named.update(j for j in warn if any(_inside(mods[j][0], mods[c][0]) or j == c for c in chain))
            first = min(chain, key=lambda j: _bits_at(pts[j], w["step"]))
            names = [mods[j][0] for j in chain] + [mods[first][0]]
            if _failed_by(bad_steps(), names, w["step"], phase):
                continue  # reached only after these layers had already overflowed: no early warning (that finding says it)
            out.append(_finding(run, phase, mods[prod], pts[prod], w, mods[first][0], w["step"],
                                _came_true(run, w, names, bad())))
    # a module warned at the same step and phase as one inside it says the same thing (its output is that one's,
    # passed on): the inner one stands for both
    return [f for f in out if not any(g is not f and g.phase == f.phase and g.step == f.step and g.severity ==
                                      f.severity and g.module is not None and f.module is not None
                                      and _inside(g.module, f.module) for g in out)]


CONFIRM_STEPS = 8
"""Steps after the first bad one whose producers may tie it to the warned layers (the follow-up steps)."""


def _produced_by(p, chain: list[str], parents: set) -> bool:
    m = p.module
    if m is None:
        return "" in chain  # (a producer the run names no module for: the root's)
    return (m in chain or any(_inside(m, c) for c in chain) or m.rpartition(".")[0] in parents)


def _failed_by(bad: list, chain: list[str], step: int, phase: str) -> bool:
    """One of the warned layers (as _came_true matches them) was already the inf/NaN producer, in the warned phase,
    of a real bad step (`bad`, in order) at or before `step`, or (forward) the forward failed there on a routine
    step whose record names no producer (only the report's replay of its capture does, and it may be this layer): a
    warning reached then comes after the fact."""
    parents = {c.rpartition(".")[0] for c in chain}
    for r in bad:
        if r.step > step:
            break
        p = r.forward_producer if phase == "forward" else r.backward_producer
        if p is not None and _produced_by(p, chain, parents):
            return True
        if phase == "forward" and p is None and not r.sampled and r.forward_bad:
            return True
    return False


def _came_true(run: RunData, w: dict, chain: list[str], bad: int | None) -> dict | None:
    """The forecast overflow happened: the run's first bad step came after the warning, and its inf/NaN producer
    (on that step or the follow-up steps) is one of the warned layers, inside one, or beside one in the same
    parent (the dropout or activation right after a growing projection). None otherwise."""
    if bad is None or bad <= w["step"]:
        return None
    parents = {c.rpartition(".")[0] for c in chain}
    for r in run.steps:
        if r.step < bad or r.step > bad + CONFIRM_STEPS:
            continue
        for p in (r.forward_producer, r.backward_producer):
            if p is not None and _produced_by(p, chain, parents):
                return {"step": bad, "module": p.module}
    return None


def _finding(run, phase, mod, pts, w, first_name: str, step: int, came: dict | None = None) -> Finding:
    name, typ = mod[0], mod[1]
    cur = [p for p in pts if p[0] <= step]
    bits = cur[-1][1] if cur else w["bits"]
    rate = _rate_at(pts, step) or w["rate"]
    dt = _NAME.get(w["dtype"], "float16")
    what = "output" if phase == "forward" else "gradient (unscaled) flowing into its output"
    via = "" if first_name == name else f"; `{first_name}`, which takes its values, is the first to reach the max"
    msg = (f"`{name or '(root)'}` ({typ}) {what} is losing headroom to the {dt} maximum steadily: "
           f"{bits:.1f} bits left at step {step}, falling {-rate:.2f} bits/step, forecast to overflow around "
           f"step {w['forecast']}{via}.")
    ev = {"headroom_bits": round(bits, 3), "rate_bits_per_step": round(rate, 4), "forecast_step": w["forecast"],
          "first_to_overflow": first_name, "first_headroom_bits": round(w["bits"], 3), "dtype": dt, "rank_hint": 28}
    severity = "warning"
    if came is not None:
        # the forecast came true: the steady growth is why the run broke. An error, ranked after the overflow
        # findings themselves (root causes below 20) and before the scaler's reaction to them
        severity = "error"
        msg += f" It did: the first inf/NaN came at step {came['step']}, in `{came['module']}`."
        ev.update({"overflowed_step": came["step"], "overflowed_in": came["module"], "rank_hint": 20})
    fix = ("Act before it overflows: lower the learning rate or add warmup, clip gradients (after "
           "`scaler.unscale_`), check weight decay on this layer, or keep it in fp32:\n"
           + fp32_snippet(name, autocast_device(run)))
    return Finding("headroom_trend", severity, phase, name, None, step, msg, fix, ev)
