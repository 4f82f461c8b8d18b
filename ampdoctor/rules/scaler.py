"""GradScaler rules from the loss-scale timeline: loss_scale_collapse, skipped_steps; scaler_misorder across ranks
(ranks_diverged); the recipe the scaler rules' fixes quote (ORDER). Gradients read while still scaled
(clip_before_unscale) are rules/clipscaled.py's; the order of the scaler/optimizer calls within a step is
rules/callorder.py's."""
from __future__ import annotations

from ..findings import Finding
from ..records import CallEvent, StepRecord
from .registry import RuleConfig, RunData, register
from .lossorigin import output_grad_nonfinite
from .backoff import BACKOFF_MIN_SCALE, LATER_SKIPS_SHORT, benign_backoff, recurring, scale_restarts

ORDER = ("scaler.scale(loss).backward()\n"
         "scaler.unscale_(optimizer)                      # before anything reads the gradients\n"
         "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
         "scaler.step(optimizer)\n"
         "scaler.update()                                  # every iteration, also when the step was skipped\n"
         "optimizer.zero_grad()")


def _loc(ev: CallEvent) -> str:
    return f"{ev.file}:{ev.line}" if ev.file else "an unknown line"


def _seq(events: list[CallEvent]) -> list[str]:
    return [e.kind + ("!" if e.error else "") for e in events if not e.internal]


def scale_after(r: StepRecord, scaler: dict) -> float | None:
    """The loss scale after step r's update (what `scaler.get_scale()` returns then): recorded, or derived from
    the scale the step used (a skipped step multiplies it by the backoff factor)."""
    if r.next_scale is not None:
        return r.next_scale
    if r.scale is None:
        return None
    return r.scale * (scaler.get("backoff_factor") or 0.5) if r.skipped else r.scale


def _longest_run(steps) -> tuple[int, int | None]:
    """The longest run of consecutive skipped steps: (length, its first step)."""
    longest = cur = 0
    start = longest_start = None
    prev = None
    for r in steps:
        if r.skipped and prev is not None and prev.skipped and r.step == prev.step + 1:
            cur += 1
        elif r.skipped:
            cur, start = 1, r.step
        else:
            cur = 0
        if cur > longest:
            longest, longest_start = cur, start
        prev = r
    return longest, longest_start


def _pinned_streak(steps, at_least: int = 4) -> tuple[int, int, float] | None:
    """The first run of `at_least` or more consecutive skipped steps that all used one loss scale: (its first step,
    its length, the scale). A dynamic GradScaler backs off after every skip, so the scale cannot stay unless
    `update(new_scale)` or a backoff_factor of 1 keeps it."""
    run: list = []
    for r in steps:
        if r.skipped and r.scale and run and r.step == run[-1].step + 1 and r.scale == run[-1].scale:
            run.append(r)
        else:
            if len(run) >= at_least:
                break
            run = [r] if r.skipped and r.scale else []
    return (run[0].step, len(run), run[0].scale) if len(run) >= at_least else None


@register("scale_timeline", emits=("loss_scale_collapse", "skipped_steps"))
def scale_timeline(run: RunData, cfg: RuleConfig) -> list[Finding]:
    if not run.has_scaler or not run.steps:
        return []
    if run.meta.scaler.get("dynamic") is False:
        return []  # a static scale (DeepSpeed's loss_scale) never backs off: rules/deepspeed.py reads its skips
    steps = run.steps
    skipped = [r.step for r in steps if r.skipped]
    if not skipped:
        return []
    init = run.meta.scaler.get("init_scale") or next((r.scale for r in steps if r.scale), None)
    # the scale after the last update (what scaler.get_scale() returns at the end), else the last one used
    last = next((r for r in reversed(steps) if r.next_scale is not None or r.scale is not None), None)
    last_scale = None if last is None else scale_after(last, run.meta.scaler)
    longest = cur = 0
    streak_start = longest_start = None
    for r in steps:
        if r.skipped:
            streak_start = r.step if cur == 0 else streak_start
            cur += 1
        else:
            cur = 0
        if cur > longest:
            longest, longest_start = cur, streak_start
    first_good = next((r.step for r in steps if not r.skipped and (r.found_inf is not None or r.scale)), None)
    initial = [s for s in skipped if first_good is None or s < first_good]
    later = [s for s in skipped if first_good is not None and s > first_good]
    out = []
    benign = benign_backoff(steps, True, max_streak=cfg.collapse_consecutive, later_min=cfg.skipped_min,
                            growth_factor=run.growth_factor,
                            later_share=cfg.skipped_share)
    # (a loss the scale itself made non-finite in the first search is the search: steps.scaled_loss_steps)
    forward_bad = [r.step for r in steps if r.skipped and r.forward_bad and r.step not in benign]
    ev = {"skipped": len(skipped), "steps": len(steps), "longest_streak": longest, "init_scale": init,
          "last_scale": last_scale, "skipped_steps": skipped[:100],
          "timeline": [[r.step, r.scale, bool(r.skipped)] for r in steps][:400]}
    if longest >= cfg.collapse_consecutive and benign:
        # the first search for a working scale, ended in updates, is no collapse however long (steps.benign_backoff):
        # the longest run of the other skips decides
        longest, longest_start = _longest_run([r for r in steps if not (r.skipped and r.step in benign)])
    pinned = _pinned_streak(steps)
    if pinned is not None:
        first, n, scale = pinned
        upd = next((e for r in steps for e in r.events if e.kind == "update" and e.new_scale is not None), None)
        made = _made_each_step(steps, first, n) if upd is None else None
        how = (f"`scaler.update({upd.new_scale:g})` at {_loc(upd)} sets the scale itself every iteration"
               if upd is not None else
               f"a new GradScaler every iteration (its first call at {_loc(made)} is a new scaler's each time): each "
               "starts at init_scale, backs off after its first skipped step and is thrown away" if made is not None
               else "the scaler's backoff_factor leaves it where it is")
        fix = ("Create the GradScaler once, before the loop (`scaler = torch.amp.GradScaler()` above `for ...:`), "
               "and use that one every iteration." if made is not None else
               "Let the scaler adapt: call `scaler.update()` without an argument (and keep backoff_factor < 1); to "
               "start lower, pass `init_scale=` when creating the GradScaler.")
        out.append(Finding(
            "skipped_steps", "error", "scaler", None, None, first,
            f"GradScaler skipped {len(skipped)} of {len(steps)} steps ({n} in a row from step {first}) and the loss "
            f"scale stayed at {scale:g} through them: {how}, so the scale never backs off to one whose gradients "
            "are finite, and every one of these steps is thrown away.", fix,
            dict(ev, api="GradScaler.update", pinned_scale=scale, rank_hint=55,
                 **({"file": upd.file, "line": upd.line} if upd is not None else
                    {"file": made.file, "line": made.line, "new_scaler_each_step": True} if made is not None else {}))))
        return out
    collapse = longest >= cfg.collapse_consecutive or (last_scale is not None and last_scale < cfg.collapse_min_scale)
    # skips at a scale below 1: the gradients overflow fp16 even unscaled, whatever the rate of skips
    unscaled = [r for r in steps if r.skipped and r.scale is not None and r.scale < BACKOFF_MIN_SCALE]
    if unscaled and not collapse:
        first = unscaled[0]
        out.append(Finding(
            "loss_scale_collapse", "error", "scaler", None, None, first.step,
            f"GradScaler's scale fell from {init:g} to {first.scale:.3g} and it still skipped steps there "
            f"({len(unscaled)} skipped at a scale below 1, {len(skipped)} of {len(steps)} in all): the gradients "
            "overflow fp16 even unscaled, so they have grown far beyond what the model should produce.",
            "Find why the gradients keep growing (learning rate too high, no warmup, a loss that grows without "
            "bound: see the findings above); a GradScaler cannot fix gradients that overflow at scale 1.",
            dict(ev, below_one=[r.step for r in unscaled][:50], rank_hint=60)))
        return out
    if collapse:
        # the persistent cause: a forward producer first, then NaN made in backward, then any producer
        cause = (next((r for r in steps if r.skipped and r.forward_bad and r.forward_producer), None)
                 or next((r for r in steps if r.skipped and r.backward_producer
                          and r.backward_producer.kind == "nan"), None)
                 or next((r for r in steps if r.skipped and (r.backward_producer or r.loss_finite is False)), None))
        why = ""
        cause_module = None
        if cause is not None:
            p = (cause.forward_producer if cause.forward_bad else None) or cause.backward_producer
            cause_module = p.module if p else None
            why = (f" The inf/NaN is not transient: it comes from `{p.module or '(root)'}` ({p.phase})." if p else
                   " The loss itself is non-finite on these steps.")
            if not cause.forward_bad and output_grad_nonfinite(cause):
                # the gradient was already inf/NaN where it entered the model: the loss computation's backward
                # (the root's own when the model computed the loss), not the module that passed it on
                cause_module = "" if cause.loss_in_model else None
                why = (" The inf/NaN is not transient: it enters with the gradient of the model's outputs (the "
                       "loss computation's backward).")
        out.append(Finding(
            "loss_scale_collapse", "error", "scaler", cause_module, None,
            # the collapse began with its longest run of skips (not at GradScaler's first, benign backoff)
            longest_start if longest >= cfg.collapse_consecutive and longest_start is not None else skipped[0],
            f"GradScaler skipped {longest} steps in a row and the scale fell from {init:g} to "
            f"{last_scale:.3g}: every step has inf/NaN gradients, so the model has stopped learning.{why}",
            "Fix the source of the persistent inf/NaN (see the nan_origin/overflow finding above); lowering the "
            "scale cannot help a NaN that every step produces.",
            dict(ev, rank_hint=60)))
        return out
    if forward_bad:
        fp = next((r.forward_producer for r in steps if r.forward_bad and r.forward_producer), None)
        # (the model's output finite and only the loss non-finite: the loss computation, not the forward pass)
        bad = set(forward_bad)
        what = "the loss itself" if all(r.output_finite is not False and r.forward_producer is None
                                        and not r.exception for r in steps if r.step in bad) \
            else "the forward pass itself"
        out.append(Finding(
            "skipped_steps", "error", "scaler", fp.module if fp else None, None, forward_bad[0],
            f"GradScaler skipped {len(skipped)} of {len(steps)} steps; on {len(forward_bad)} of them {what} was "
            "non-finite, which no loss scale can fix.",
            "Fix the forward inf/NaN (see the overflow/nan_origin finding); those steps train nothing.",
            dict(ev, rank_hint=70)))
        return out
    # a scale that rises right after a skip (or by more than one growth step) is a GradScaler started again: made
    # anew (e.g. each epoch) or reloaded; each restart searches from init_scale again and skips those steps
    gf = (run.meta.scaler or {}).get("growth_factor") or 2.0
    restarts = scale_restarts(steps, gf)
    resets = len(restarts)
    if resets >= 2 and len(skipped) >= cfg.skipped_min and len(skipped) >= 0.5 * len(steps):
        # dated where a restart first cost a step: the first search (from the run's start) is the normal one
        lost = next((k for k in skipped if k >= restarts[0]), skipped[0])
        out.append(Finding(
            "skipped_steps", "warning", "scaler", None, None, lost,
            f"GradScaler skipped {len(skipped)} of {len(steps)} steps, and its scale went back up to where it started "
            f"{resets} times: the GradScaler is created anew (e.g. inside the epoch loop) or its state reloaded, so "
            "every restart searches for a working scale again and skips those steps.",
            "Create the GradScaler once, outside the epoch loop, and save/restore `scaler.state_dict()` with your "
            "checkpoints.", dict(ev, resets=resets, rank_hint=70)))
        return out
    if set(skipped) <= benign:
        out.append(Finding(
            "skipped_steps", "info", "scaler", None, None, skipped[0],
            f"GradScaler skipped {len(skipped)} of {len(steps)} steps; a normal rate for dynamic loss scaling.",
            "Nothing to do.", dict(ev, rank_hint=90, benign_backoff=True)))
        return out
    recovered = first_good is not None and first_good > skipped[0] or bool(later)
    nan_made = any(r.skipped and r.backward_producer is not None and r.backward_producer.kind == "nan"
                   for r in steps)
    if not recovered and len(skipped) >= 3 and (nan_made or (last_scale is not None and last_scale < 1.0)):
        out.append(Finding(
            "skipped_steps", "error", "scaler", None, None, skipped[0],
            f"GradScaler skipped every step since step {skipped[0]} ({len(skipped)} in a row, scale {init:g} -> "
            f"{last_scale:g}): lowering the scale did not help, so the inf/NaN is not a scale problem.",
            "Fix the producer of the inf/NaN (see the findings above); these steps train nothing.",
            dict(ev, rank_hint=70)))
        return out
    if initial and not later and set(initial) <= benign:
        out.append(Finding(
            "skipped_steps", "info", "scaler", None, None, initial[0],
            f"GradScaler skipped the first {len(initial)} step(s) while searching for a loss scale "
            f"({init:g} -> {last_scale:g}); this is expected.",
            "Nothing to do. (If the LR scheduler warns about stepping before the optimizer, that is this.)",
            dict(ev, rank_hint=90, benign_backoff=True)))
        return out
    n_later = len(later)
    share = n_later / max(len(steps) - len(initial), 1)
    if n_later >= cfg.skipped_min and share >= cfg.skipped_share or \
            n_later >= 3 and recurring(later) >= 2 and share >= LATER_SKIPS_SHORT:
        # (a run too short for skipped_min later skips: three or more that take most of it)
        out.append(Finding(
            "skipped_steps", "error" if share >= 0.5 else "warning", "scaler", None, None, later[0],
            f"GradScaler skipped {n_later} of {len(steps) - len(initial)} steps after warm-up ({share:.0%}); "
            "those batches did not train the model.",
            "Find which layer overflows on those steps (replay the capture); consider bf16 or keeping that "
            "layer in fp32, and check `growth_interval` is not too short.",
            dict(ev, share=share, rank_hint=70)))
    else:
        out.append(Finding(
            "skipped_steps", "info", "scaler", None, None, skipped[0],
            f"GradScaler skipped {len(skipped)} of {len(steps)} steps; a normal rate for dynamic loss scaling.",
            "Nothing to do.", dict(ev, rank_hint=90)))
    return out


def ranks_diverged(per_rank: dict[int, list[StepRecord]]) -> list[Finding]:
    """scaler_misorder across the ranks of one run: their GradScalers disagree (scale or skipped) at a step (not at
    a step a rank's crash cut short, where its scaler never ran)."""
    by_step: dict[int, dict[int, tuple]] = {}
    cut = {s.step for steps in per_rank.values() for s in steps if s.exception}
    for r, steps in per_rank.items():
        for s in steps:
            if s.step not in cut:
                by_step.setdefault(s.step, {})[r] = (s.scale, s.skipped)
    diverged = next((st for st, d in sorted(by_step.items()) if len(set(d.values())) > 1), None)
    if diverged is None:
        return []
    d = by_step[diverged]
    return [Finding("scaler_misorder", "error", "scaler", None, None, diverged,
                    f"The ranks' GradScalers diverged at step {diverged}: "
                    + ", ".join(f"rank {r}: scale {v[0]}, skipped {v[1]}" for r, v in sorted(d.items())) +
                    ". Ranks are stepping on different iterations (uneven batches per rank?).",
                    "Give every rank the same number of iterations (drop_last=True, DistributedSampler), and call "
                    "scaler.update() on every rank every iteration.",
                    {"rank": min(d), "per_rank": {str(k): list(v) for k, v in d.items()}, "rank_hint": 8})]


def _made_each_step(steps, first: int, n: int):
    """The first call of the scaler adopted on the pinned streak's first step, when most of the streak's steps began
    with a newly adopted scaler (`extra["adopted"]`: the recorder found a GradScaler it had not seen): a scaler made
    inside the loop body. None otherwise."""
    streak = [r for r in steps if first <= r.step < first + n]
    found = [next((e for e in r.events if e.extra.get("adopted")), None) for r in streak]
    if len(streak) < 2 or sum(e is not None for e in found) * 2 <= len(streak):
        return None
    return next(e for e in found if e is not None)
