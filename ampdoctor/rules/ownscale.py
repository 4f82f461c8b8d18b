"""A loss scale the training loop keeps itself (fairseq's DynamicLossScaler, Megatron's, apex's FP16_Optimizer; no
GradScaler): the iterations it throws away. Such a loop skips the optimizer step when its gradients hold inf/NaN and
zeroes them; the recorder counts each in the step that comes (`StepRecord.discarded`). Its opening search (the first
step) is GradScaler's opening backoffs in another form (rules/backoff.loop_opening_search); a scale that grows back
every few iterations throws one away now and then, as GradScaler's growth probes do. A loop that throws away a
quarter of its iterations or more after that trains on the rest only: `skipped_steps`.

A loop with a GradScaler that throws iterations away itself (a guard that zeroes inf/NaN gradients after the scaled
backward, before unscale_/step) hides them from the scaler: update() never runs for them, the scale never backs off,
and the same scale overflows again (`guard_skips`)."""
from __future__ import annotations

from ..findings import Finding
from .registry import RuleConfig, RunData, register

THROWN_SHARE = 0.25
"""The share of the iterations after the opening search thrown away that is no healthy scale's doing: a scale that
grows after every 8 clean iterations (a short window) throws away about one in nine (11%)."""


def _thrown(steps: list, later: list, n: int, iterations: int, cfg: RuleConfig) -> tuple | None:
    """(share, tail) of the thrown-away iterations when they make a finding: a quarter of the iterations or more
    (and at least `cfg.skipped_min`), or the run's last ones in a row (`tail`: the run ended in a streak it threw
    away, its last step never reached an update); None otherwise."""
    share = n / max(iterations, 1)
    tail = steps[-1] is later[-1] and steps[-1].discarded >= cfg.skipped_min
    if not tail and (n < cfg.skipped_min or share < THROWN_SHARE):
        return None
    return share, tail


@register("own_scale_skips", emits=("skipped_steps",))
def own_scale_skips(run: RunData, cfg: RuleConfig) -> list[Finding]:
    steps = run.steps
    if run.has_scaler or not steps or not any(r.discarded for r in steps[1:]):
        return []
    later = [r for r in steps[1:] if r.discarded]
    n = sum(r.discarded for r in later)
    last = steps[-1]
    iterations = sum(1 + r.discarded for r in steps[1:])  # (each step: its thrown-away iterations and its own)
    judged = _thrown(steps, later, n, iterations, cfg)
    if judged is None:
        return []
    share, tail = judged
    first = last.step if tail else later[0].step
    return [Finding(
        "skipped_steps", "error" if share >= 0.5 or tail else "warning", "scaler", None, None, first,
        f"The loop threw away {n} of {iterations} iterations after its first update ({share:.0%}), "
        + (f"the last {last.discarded} in a row from step {first} on" if tail else f"from step {first} on")
        + ": it zeroed their inf/NaN gradients without an optimizer step (its own loss scale backing off, or a "
        "guard that skips bad batches; no GradScaler). " + (
            "Every iteration since then was thrown away: lowering the scale did not make the gradients finite."
            if tail else "Those batches did not train the model."),
        "If the loop's scale grows back after a few clean iterations, lengthen its window (fairseq's "
        "`--fp16-scale-window`, Megatron's `loss_scale_window`: ~1000-2000); if the gradients overflow at every "
        "scale, find the layer that overflows (the findings above, or replay the capture) and keep it in fp32, or "
        "use torch.amp.GradScaler.",
        {"thrown_away": n, "iterations": iterations, "share": share,
         "steps": [r.step for r in later][:100], "per_step": [r.discarded for r in later][:100], "rank_hint": 70})]


@register("guard_skips", emits=("skipped_steps",))
def guard_skips(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Iterations a GradScaler loop threw away behind the scaler's back (StepRecord.discarded with a scaler: their
    inf/NaN gradients zeroed after the scaled backward, before unscale_/step), a quarter of them or more, or the
    run's last ones in a row, while the scale never came down from where it was at the first of them."""
    steps = run.steps
    if not run.has_scaler or not any(r.discarded for r in steps):
        return []
    at = next(i for i, r in enumerate(steps) if r.discarded)
    later = [r for r in steps[at:] if r.discarded]
    since = [r.scale for r in steps[at:] if r.scale is not None]
    if since and min(since) < since[0]:
        # the scaler backed off after them: it saw the overflows itself (the iterations went on to its step: PCGrad
        # zeroing the gradients between tasks, a diagnostic backward before the real one), nothing hid them
        return []
    n = sum(r.discarded for r in later)
    # each record: its thrown-away iterations, and its own when the loop reached the scaler's step in it
    iterations = sum(r.discarded + (r.discarded == 0 or any(e.kind in ("step", "optimizer.step") for e in r.events)
                                    or r.skipped) for r in steps)
    judged = _thrown(steps, later, n, iterations, cfg)
    if judged is None:
        return []
    share, tail = judged
    first = later[0].step
    scales = sorted({r.scale for r in later if r.scale is not None})
    held = f" (it stayed at {scales[0]:g})" if len(scales) == 1 else ""
    return [Finding(
        "skipped_steps", "error" if share >= 0.5 or tail else "warning", "scaler", None, None, first,
        f"The loop threw away {n} of {iterations} iterations from step {first} on, behind GradScaler's back: it "
        "zeroed their inf/NaN gradients after the scaled backward, before `scaler.unscale_()` / `scaler.step()`, so "
        f"the scaler never saw them and `scaler.update()` never lowered the loss scale{held}. "
        + ("Every iteration since then was thrown away: at an unchanged scale the same gradients overflow again, and "
           "the model stopped training." if tail else "Those batches did not train the model."),
        "Let GradScaler handle inf/NaN gradients: call `scaler.step(optimizer)` and `scaler.update()` every "
        "iteration (step() skips the update itself when the gradients hold inf/NaN, and update() lowers the scale). "
        "A guard that must skip a batch should still call `scaler.update()` (after `scaler.unscale_()`, so that the "
        "scaler has recorded the inf), or check the loss before the backward instead.",
        {"thrown_away": n, "iterations": iterations, "share": share, "scales": scales[:10],
         "steps": [r.step for r in later][:100], "per_step": [r.discarded for r in later][:100], "rank_hint": 9})]
