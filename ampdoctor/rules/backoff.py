"""GradScaler's dynamic loss scaling as designed, over a run's StepRecords: which skipped steps its searches and
probes explain (`benign_backoff`), where a scaler started again (`scale_restarts`), and the losses its scale itself
made non-finite (`scaled_loss_steps`). A skip none of these explains is a failure for the other rules.

Pure functions of records; no import of anything above `records` (rules and analysis both import this).
"""
from __future__ import annotations

from ..records import BACKOFF_MAX_STREAK, DTYPE_LIMITS, StepRecord

__all__ = ["BACKOFF_MAX_STREAK", "BACKOFF_MIN_SCALE", "LATER_SKIPS_MAX", "LATER_SKIPS_SHORT", "PROBE_SHARE", "SCALED_LOSS_MIN_SCALE",
           "benign_backoff", "recurring", "scale_restarts", "scaled_loss_steps"]

BACKOFF_MIN_SCALE = 1.0
"""Below this loss scale a skipped step is no longer the scaler searching: gradients overflow unscaled."""


def _streaks(steps: list[StepRecord]) -> list[list[StepRecord]]:
    out: list[list[StepRecord]] = []
    prev = None
    for r in steps:
        if r.skipped:
            if out and prev is not None and prev.skipped and r.step == prev.step + 1:
                out[-1].append(r)
            else:
                out.append([r])
        prev = r
    return out


def _descent(steps: list[StepRecord], first_good: int | None, settle_min: int = 10) -> set[int]:
    """The skips after the first applied update that only lowered the scale to follow gradients that grew (early
    training, a larger batch: activations and gradients grow, and GradScaler halves once per doubling): the
    longest run of later skips, from the first, each at a scale no step had gone above since (the lowest so far),
    that then settled: at least `settle_min` clean steps after its last skip, and half again as many as the longest
    gap between its skips. Later skips outside it (a harmless outlier afterwards) count as usual (_later_probes);
    intermittent overflows that go on through the run, or a scale that keeps falling, settle nowhere."""
    if first_good is None:
        return set()
    low = None
    skips: list[int] = []
    for r in steps:
        if r.scale is None:
            continue
        if r.skipped and r.step > first_good:
            if low is not None and r.scale > low:
                break  # a probe above a working scale: not a descent (nor anything after it)
            skips.append(r.step)
        low = r.scale if low is None else min(low, r.scale)
    if not skips:
        return set()
    all_later = [r.step for r in steps if r.skipped and r.step > first_good]
    last = max(r.step for r in steps)
    best = 0
    gap = 0
    prev = first_good
    for k, s in enumerate(skips, 1):
        gap = max(gap, s - prev)
        prev = s
        nxt = next((t for t in all_later if t > s), last + 1)  # the next later skip, or past the run's end
        if nxt - 1 - s >= max(settle_min, 1.5 * gap):
            best = k
    return set(skips[:best])


LATER_SKIPS_MAX = 0.2
"""The share of the steps after the first applied update that skipped steps may take and still be GradScaler's
ordinary searches and probes (benign_backoff): a growth_interval of 10 at the default growth_factor skips ~9%."""
LATER_SKIPS_SHORT = 0.4
"""... and in a run too short for `later_min` skips, three or more skips in two or more separate streaks (`recurring`:
the run recovered and skipped again) that take this share of the steps after the first applied update (a
growth_interval of 1: every good step grows the scale into the next overflow; one streak is a search for a lower
scale, however long)."""


def recurring(skipped: list[int]) -> int:
    """How many separate streaks (runs of consecutive steps) the skipped steps `skipped` (sorted) make."""
    return sum(1 for i, s in enumerate(skipped) if i == 0 or skipped[i - 1] != s - 1)
PROBE_SHARE = 0.125
"""GradScaler's probes of a scale it just grew (one skip per growth at most, the scale back where it was) are the
design's price, paid at most once per `growth_interval` + 1 steps: benign up to this share of the steps (a
growth_interval of 7 or more), whatever `later_share` says of the other skips."""


def _probe_skips(steps: list[StepRecord], first_good: int | None) -> set[int]:
    """The later skips that are a single probe of a scale GradScaler grew after clean steps: a skip above the scale
    that earned the latest growth (as in _later_probes), not followed by another skip, and sooner after the growth
    than the clean steps that earned it (a scale that lasted that long would have grown again: a skip there is an
    overflow at a scale the run had settled at, not a probe)."""
    if first_good is None:
        return set()
    out = set()
    rs = [r for r in steps if r.scale]
    base = prev = earned = None
    clean = 0  # clean steps since the last skip or growth
    for i, r in enumerate(rs):
        if prev is not None and r.scale > prev:
            base, earned, clean = prev, clean, 0  # GradScaler grew the scale: `prev` earned it in `clean` steps
        if r.skipped:
            nxt = rs[i + 1] if i + 1 < len(rs) else None
            if (r.step > first_good and base is not None and r.scale > base and earned and clean < earned
                    and (nxt is None or not nxt.skipped)):
                out.add(r.step)
            clean = 0
        else:
            clean += 1
        prev = r.scale
    return out


def _later_probes(steps: list[StepRecord], first_good: int | None, exclude: set[int] = frozenset()) -> int:
    """How many times GradScaler backed off after the first applied update, counting the skips of one probe once:
    a probe is the scale above the last one that earned a growth (the scale before GradScaler's latest increase),
    from that growth until the scale is back at or below it. With `growth_factor=4` one growth above a working
    scale costs two halvings (a skip at 4x, perhaps later one at 2x), and is still one probe, as one skip is with
    the default factor 2. A skip at or below the scale that earned the growth counts on its own."""
    if first_good is None:
        return 0
    n = 0
    base = prev = None
    probe = 0
    counted: set[int] = set()
    for r in steps:
        if r.scale is None:
            continue
        if prev is not None and r.scale > prev:
            base, probe = prev, probe + 1  # GradScaler grew the scale: `prev` earned it
        if r.skipped and r.step > first_good and r.step not in exclude:
            if base is not None and r.scale > base:
                if probe not in counted:
                    counted.add(probe)
                    n += 1
            else:
                n += 1
        prev = r.scale
    return n


SCALED_LOSS_MIN_SCALE = 2.0 ** 14
"""At or above this loss scale a loss built from a gradient of a scaled value can overflow fp16 by the scale alone."""


def scaled_loss_steps(steps: list[StepRecord]) -> set[int]:
    """Steps of GradScaler's first search whose loss went non-finite through the loss scale itself. PyTorch's AMP
    recipe for a gradient penalty takes `autograd.grad` of a *scaled* value (scaler.scale called more than once in
    the step) and builds the loss from that gradient: at a scale too high for fp16 the penalty term is inf, and
    GradScaler backs off exactly as for overflowing gradients. Only when every module's output was finite (no
    producer but a mask, no crash, no bad batch), the scale was still high, the step came before the first applied
    update and was skipped, and no forward went non-finite after that update."""
    first_good = next((r.step for r in steps if not r.skipped and (r.found_inf is not None or r.scale)), None)
    if first_good is None or any(r.forward_bad for r in steps if r.step > first_good):
        return set()
    out = set()
    for r in steps:
        if r.step >= first_good:
            break
        p = r.forward_producer
        if (r.skipped and r.loss_finite is False and r.output_finite is not False and not r.exception
                and not r.bad_input and (p is None or p.detail.get("mask_like"))
                and (r.scale is None or r.scale >= SCALED_LOSS_MIN_SCALE)
                and sum(1 for e in r.events if e.kind == "scale" and not e.internal) >= 2):
            out.add(r.step)
    return out


def _output_grad_overflowed(r: StepRecord) -> bool:
    """The gradient arriving at the model's output was already non-finite (a sampled step's root call)."""
    root = next((c for c in r.modules if c.depth == 0), None)
    return root is not None and root.gout is not None and not root.gout.finite


_SMALL_GRAD_BITS = 8  # a gradient this many bits below its dtype's max does not overflow in one module's backward


def _nan_at_any_scale(r: StepRecord) -> bool:
    """A recorded backward producer made NaN from a finite gradient far below its dtype's max (0/0, sqrt'(0) * 0,
    inf - inf of its own making): no loss scale made it, so halving the scale does not help (a gradient the scale
    pushed past the max turns inf first, near the loss, and reaches the producer as inf)."""
    p = r.backward_producer
    if p is None or p.kind != "nan" or _output_grad_overflowed(r):
        return False
    gs = [c.gout for c in r.modules if c.module == p.module and c.gout is not None]
    if not gs or not all(g.finite for g in gs):
        return False
    mx = DTYPE_LIMITS.get(gs[0].ref, DTYPE_LIMITS["float32"])[0]
    return max(g.absmax for g in gs) <= mx * 2.0 ** -_SMALL_GRAD_BITS


def scale_restarts(steps: list[StepRecord], jump: float = 8.0) -> list[int]:
    """Steps whose loss scale is a GradScaler started again (made anew, e.g. inside the epoch loop, or reloaded):
    the scale rose right after a skipped step, or by more than `jump` at once (more than one growth step: pass the
    scaler's growth_factor where it is known; unknown, 8 leaves room for growth_factor=4)."""
    return [b.step for a, b in zip(steps, steps[1:]) if a.scale and b.scale and b.scale > a.scale
            and (a.skipped or b.scale > a.scale * jump)]


def loop_opening_search(steps: list[StepRecord], has_scaler: bool) -> set[int]:
    """Without a GradScaler: the first step, when it holds several forward and backward passes and one optimizer
    step whose gradients were finite, with a finite forward throughout. A loss scale the loop keeps itself
    (Megatron's, apex's FP16_Optimizer, a hand-written dynamic scale) searching down from a high start: the
    backward passes that overflowed were thrown away without an optimizer step (so they join the step that came),
    as GradScaler skips its opening steps. (Gradients accumulated over those passes would still hold the inf.)"""
    if has_scaler or not steps:
        return set()
    r = steps[0]
    if r.micro_batches > 1 and r.grad_finite is True and not r.forward_bad and r.exception is None \
            and any(e.kind == "optimizer.step" for e in r.events):
        return {r.step}
    return set()


def benign_backoff(steps: list[StepRecord], has_scaler: bool, *, max_streak: int = BACKOFF_MAX_STREAK,
                   min_scale: float = BACKOFF_MIN_SCALE, later_min: int = 5, later_share: float = 0.05,
                   growth_factor: float | None = None) -> set[int]:
    """The skipped steps that GradScaler's dynamic loss scaling explains, as designed: the forward was finite
    (loss, outputs, no crash, no inf/NaN producer other than a mask), the scale was still >= `min_scale`, the
    streak of consecutive skips is shorter than `max_streak` (or it is the first search, before any update, and it
    ended in one: a loss whose gradients need a scale of 32 takes 11 halvings from 65536), and either it ended in an
    applied update or it is not NaN made in the backward three times running (halving the scale does nothing to a
    NaN). Skips after the first stepped update count only while
    they stay rare (fewer than `later_min`, or under `later_share` of the steps after it; a skip whose forward
    went non-finite is not counted: a failure, no backoff): a steady rate of skips is the `skipped_steps` rule's
    business, not a benign search. `growth_factor`: the scaler's, where known (a growth by it is no restart)."""
    if not has_scaler:
        return set()
    restarts = set(scale_restarts(steps, max(8.0, growth_factor or 0.0)))
    cuts = [i for i, r in enumerate(steps) if r.step in restarts]
    if cuts:  # a GradScaler made anew (each epoch) or reloaded: every restart's search is judged as a run of its own
        kw = dict(max_streak=max_streak, min_scale=min_scale, later_min=later_min, later_share=later_share,
                  growth_factor=growth_factor)
        return set().union(*(benign_backoff(steps[a:b], has_scaler, **kw)
                             for a, b in zip([0] + cuts, cuts + [len(steps)])))
    out: set[int] = set()
    by_step = {r.step: r for r in steps}
    first_good = next((r.step for r in steps if not r.skipped and (r.found_inf is not None or r.scale)), None)
    after = sum(1 for r in steps if first_good is not None and r.step > first_good)
    probes = _probe_skips(steps, first_good)
    if len(probes) / max(after, 1) >= PROBE_SHARE:
        probes = set()  # probes more often than a sane growth_interval pays for: they count as skips again
    scaled_loss = scaled_loss_steps(steps)
    # (a skip whose forward itself went non-finite is a failure of its own, no backoff: it does not make the
    # scaler's searches around it less ordinary)
    failed = {r.step for r in steps if r.forward_bad and r.step not in scaled_loss or r.exception}
    n_later = _later_probes(steps, first_good, _descent(steps, first_good) | probes | failed)
    later_ok = n_later < later_min or n_later / max(after, 1) < later_share
    # however they group into probes, skips that throw away this share of the steps after the first update are no
    # search's price (a growth_factor of 16 every 3 steps: four backoffs per growth, half the run skipped)
    n_skips = sum(1 for r in steps if r.skipped and first_good is not None and r.step > first_good
                  and r.step not in failed)
    later_skips = [r.step for r in steps if r.skipped and first_good is not None and r.step > first_good
                   and r.step not in failed]
    if n_skips >= later_min and n_skips / max(after, 1) >= LATER_SKIPS_MAX or \
            n_skips >= 3 and recurring(later_skips) >= 2 and n_skips / max(after, 1) >= LATER_SKIPS_SHORT:
        later_ok = False  # (a short run: fewer skips, but most of what came after the first update, again and again)
    for s in _streaks(steps):
        first_search = first_good is not None and s[-1].step < first_good
        # skips before a forward failure in the same streak can still be the search (a first-step backoff, then
        # a batch that overflows the forward); from the failure on, nothing in the streak is
        # (a loss the scale itself made non-finite is the search too: scaled_loss_steps). The length that counts
        # is the search's: a forward that stays broken for the rest of the run makes the streak long, not the search
        k = next((i for i, r in enumerate(s) if r.forward_bad and r.step not in scaled_loss or r.exception), len(s))
        nxt = by_step.get(s[-1].step + 1)
        if k < len(s) and s[-1].step not in failed and nxt is not None and not nxt.skipped \
                and nxt.grad_finite is not False:
            # ... unless the streak went on past its failures and ended in an applied update: a failed forward
            # splits the search without changing it (a skip updates no weight; the scale only halved once more),
            # so the skips around it are still the search, judged as one
            s = [r for r in s if r.step not in failed]
            ended_by_failure = False
        else:
            ended_by_failure = k < len(s)
            s = s[:k]
        if len(s) >= max_streak and not first_search:
            continue
        if not s or any(r.scale is not None and r.scale < min_scale for r in s):
            continue
        if any(_nan_at_any_scale(r) for r in s):
            continue  # NaN a module made from a small gradient: no scale's doing, wherever the streak ends
        # A streak that ended in an applied update proves the scale was the trouble (the scaler found one that
        # works), whatever the overflow turned into on the way (LayerNorm's backward makes NaN from an inf).
        # One still running at the end of the run: NaN made in the backward three times is no scale's doing.
        nxt = by_step.get(s[-1].step + 1)
        ended = nxt is not None and not nxt.skipped and nxt.grad_finite is not False and not ended_by_failure
        if len(s) >= max_streak and not ended:
            continue
        # (NaN made downstream of a gradient that reached the model's output already inf is the scaled loss
        # gradient overflowing, the search itself, not a NaN the model makes)
        made = [r.backward_producer is not None and r.backward_producer.kind == "nan"
                and not _output_grad_overflowed(r) for r in s]
        nan_made = sum(made)
        # (a streak still running at the run's end whose every recorded step made NaN, twice or more: the steps
        # between samples saw only the trip-wire, so three in a row may never all be recorded)
        recorded = [k for k, r in zip(made, s) if r.sampled]
        if not ended and (nan_made >= 3 or len(recorded) >= 2 and all(recorded)):
            continue
        if first_good is not None and s[0].step > first_good and not later_ok:
            continue
        out.update(r.step for r in s)
    return out
