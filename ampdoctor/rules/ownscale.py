"""A loss scale the training loop keeps itself (fairseq's DynamicLossScaler, Megatron's, apex's FP16_Optimizer; no
GradScaler): the iterations it throws away. Such a loop skips the optimizer step when its gradients hold inf/NaN and
zeroes them; the recorder counts each in the step that comes (`StepRecord.discarded`). Its opening search (the first
step) is GradScaler's opening backoffs in another form (rules/backoff.loop_opening_search); a scale that grows back
every few iterations throws one away now and then, as GradScaler's growth probes do. A loop that throws away a
quarter of its iterations or more after that trains on the rest only: `skipped_steps`."""
from __future__ import annotations

from ..findings import Finding
from .registry import RuleConfig, RunData, register

THROWN_SHARE = 0.25
"""The share of the iterations after the opening search thrown away that is no healthy scale's doing: a scale that
grows after every 8 clean iterations (a short window) throws away about one in nine (11%)."""


@register("own_scale_skips", emits=("skipped_steps",))
def own_scale_skips(run: RunData, cfg: RuleConfig) -> list[Finding]:
    steps = run.steps
    if run.has_scaler or not steps or not any(r.discarded for r in steps[1:]):
        return []
    later = [r for r in steps[1:] if r.discarded]
    n = sum(r.discarded for r in later)
    last = steps[-1]
    iterations = sum(1 + r.discarded for r in steps[1:])  # (each step: its thrown-away iterations and its own)
    share = n / max(iterations, 1)
    # the run ended in a streak the loop threw away (the last step never reached an update): it never recovered
    tail = last is later[-1] and last.discarded >= cfg.skipped_min
    if not tail and (n < cfg.skipped_min or share < THROWN_SHARE):
        return []
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
