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
- gradients of an fp16 model trained through fp32 master copies without a GradScaler (fairseq's FP16Optimizer,
  apex O2, Megatron: a hand-made dynamic loss scaler doubles the scale every N clean steps): the scale is not
  recorded, so the gradients cannot be unscaled and their growth is the scale's; the backward is not judged;
  nor is it in a loop that throws overflowing iterations away itself (fairseq's DynamicLossScaler on an fp32 model
  under autocast: `loss * scale` backward, no GradScaler): the scale is in the gradients, and their overflow is the
  loop's to handle;
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

The series and their maths (the trend, the first warning and the tests it must pass) are rules/headroomseries.py's;
this file owns the rule: which layers warn, the chain and its producer, and the finding.
"""
from __future__ import annotations

from ..findings import Finding
from .headroomseries import bits_at, dtype_name, first_warning, fitting_predicate, rate_at, series
from .registry import RuleConfig, RunData, register
from ..fixes import fp32_snippet
from .origins import autocast_device
from .steps import real_bad_steps

__all__ = ["headroom_trend"]

CHAIN_BITS = 4.0
"""A layer joins a warned layer's chain only within this many bits (x16) of its headroom."""


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

    def own_scale() -> bool:
        # fp16 weights with fp32 masters, or iterations the loop threw away itself (its inf/NaN gradients zeroed
        # without an optimizer step: StepRecord.discarded)
        return bool((run.meta.optimizer or {}).get("masters")) or any(r.discarded for r in run.steps)
    out: list[Finding] = []
    root = next((i for i, m in enumerate(mods) if m[0] == ""), None)
    owners = {p[1] for p in run.meta.params}  # the modules with weights of their own
    # every module's series, read once: the forward phase asks which outputs had a gradient at all
    both = {phase: {i: series(run, i, phase) for i in range(len(mods))} for phase in ("forward", "backward")}
    for phase in ("forward", "backward"):
        if phase == "backward" and not run.has_scaler and own_scale():
            continue  # scaled by a loss scaler of the loop's own, which the records do not hold (see above)
        pts = both[phase]
        fitting = fitting_predicate(run, pts[root]) if phase == "forward" and root is not None and pts[root] else None
        # a root whose output is not read (fp32: `.float()` logits, a returned loss): the model's prediction is
        # the last module in forward order that has a series, its own reference
        last = None if fitting is not None or phase != "forward" else max(
            (i for i, p in pts.items() if p), key=lambda i: order.get(mods[i][0], -1), default=None)
        fits = {i: fitting for i in pts} if last is None else {last: fitting_predicate(run, pts[last])}
        if phase == "forward":
            # an output no gradient reached (an EMA teacher's, a detached target's) fits nothing the loss asks
            # for, though the model returns it: where gradients were recorded, such a module is not exempt
            grads = {i for i, p in both["backward"].items() if p}
            if grads:
                fits = {i: f for i, f in fits.items() if i in grads}
        warn = {i: w for i, p in pts.items() if (w := first_warning(p, cfg, fits.get(i))) is not None}
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
            near = bits_at(pts[i], w["step"]) + CHAIN_BITS
            chain = [j for j, p in pts.items() if j not in named and not _inside(mods[i][0], mods[j][0])
                     and (r := rate_at(p, w["step"])) is not None and 0.5 <= r / w["rate"] <= 2.0
                     and bits_at(p, w["step"]) <= near]
            chain = [j for j in chain if not any(o != j and _inside(mods[o][0], mods[j][0]) for o in chain)]
            if i not in chain:
                chain.append(i)
            prod = min(chain, key=lambda j: order.get(mods[j][0], 0))
            first = min(chain, key=lambda j: bits_at(pts[j], w["step"]))
            if mods[prod][0] not in owners and not any(_inside(o, mods[prod][0]) for o in owners):
                # (weightless all the way down: a module whose children hold weights grows by them)
                factors = _factors(pts, mods, order, prod, w, named, owners)
                if factors:  # a product of growing inputs (q @ k^T): its growth is theirs
                    chain += factors
                    prod = min(factors, key=lambda j: order.get(mods[j][0], 0))
            named.update(chain)
            named.update(j for j in warn if any(_inside(mods[j][0], mods[c][0]) or j == c for c in chain))
            names = [mods[j][0] for j in chain] + [mods[first][0]]
            if _failed_by(bad_steps(), names, w["step"], phase):
                continue  # reached only after these layers had already overflowed: no early warning (that finding says it)
            out.append(_finding(run, phase, mods[prod], pts[prod], w, mods[first][0], w["step"],
                                _came_true(run, w, names, bad()), own=prod == i))
    # a module warned at the same step and phase as one inside it says the same thing (its output is that one's,
    # passed on): the inner one stands for both
    return [f for f in out if not any(g is not f and g.phase == f.phase and g.step == f.step and g.severity ==
                                      f.severity and g.module is not None and f.module is not None
                                      and _inside(g.module, f.module) for g in out)]


FACTOR_SHARE = 0.25
"""A weightless producer's input layer is a factor of its growth when it falls at this share of its rate or more."""


def _factors(pts: dict, mods: list, order: dict, prod: int, w: dict, named: set, owners: set) -> list[int]:
    """A warned producer with no weights of its own that multiplies its inputs (q @ k^T, a gate times a value): the
    layers with weights, before it in forward order, whose outputs fall steadily at FACTOR_SHARE of its rate or
    more, and whose rates add up to about its own (a product's bits fall by the sum of its factors'). Their weights
    grow; the product only reaches the max first. [] when no such set explains its rate."""
    name, at = mods[prod][0], order.get(mods[prod][0], 0)
    out, total = [], 0.0
    for j, p in pts.items():
        n = mods[j][0]
        if j in named or j == prod or n not in owners or order.get(n, at) >= at or _inside(n, name) \
                or _inside(name, n):
            continue
        r = rate_at(p, w["step"])
        if r is not None and r / w["rate"] >= FACTOR_SHARE:
            out.append(j)
            total += r
    return out if out and 0.5 <= total / w["rate"] <= 1.5 else []


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


def _finding(run, phase, mod, pts, w, first_name: str, step: int, came: dict | None = None,
             own: bool = False) -> Finding:
    """`own`: the warning `w` is this module's own series' (its rate is the one its forecast was made with);
    otherwise the producer's rate is read from its series at the step."""
    name, typ = mod[0], mod[1]
    cur = [p for p in pts if p[0] <= step]
    bits = cur[-1][1] if cur else w["bits"]
    rate = w["rate"] if own else rate_at(pts, step) or w["rate"]
    dt = dtype_name(w["dtype"])
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
