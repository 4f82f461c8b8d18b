"""The scaler findings after a replay: what the records said of GradScaler (skipped_steps, loss_scale_collapse,
a backward overflow at one step) once the replay of the captured step has said where the inf/NaN came from and
whether a smaller loss scale makes the step finite. replayfold.py calls these; each edits the findings list in
place."""
from __future__ import annotations

from ..findings import Finding
from ..records import StepRecord

__all__ = ["follow_refined", "benign_backward", "applied", "replay_stayed_finite", "no_search"]


def follow_refined(findings: list[Finding], refined: set[int], before: list[str | None]) -> None:
    """The scaler findings that named a producer module (loss_scale_collapse, skipped_steps: "it comes from X")
    follow the replay where it located that producer more precisely inside X (under torch.compile the watch sees
    only the root module; the replay of the capture names the layer), or where the hooks' producer was seen on a
    later sampled step (evidence.observed_step) and the replay of the step itself named another module: the
    scaler findings took their producer from those same later steps."""
    moved: dict[str | None, str] = {}
    for i, old in enumerate(before):
        f = findings[i]
        later = f.evidence.get("observed_step") not in (None, f.step)
        if id(f) in refined and old is not None and f.module and f.module != old and (
                not old or f.module.startswith(old + ".") or later):
            moved.setdefault(old, f.module)
    for i, f in enumerate(findings):
        if f.phase == "scaler" and f.module in moved and id(f) not in refined:
            new = moved[f.module]
            msg = f.message.replace(f"`{f.module or '(root)'}`", f"`{new}`")
            findings[i] = Finding(f.rule, f.severity, f.phase, new, f.op, f.step, msg, f.fix, f.evidence)


def benign_backward(findings: list[Finding], cap_step: int, search: dict) -> None:
    """The replay of the captured step found its forward finite and its backward finite at a smaller loss scale
    (`scaler_search.finite_at`): a backward overflow the records located at that step, and at no other, is
    GradScaler's search (it skips the step and halves the scale), as the default sampling reads the same step from
    the capture alone. `info`, as there; a backward that overflows again on later steps keeps its error."""
    from ..replay.explain import scaler_search_text  # (the replay's own words for it; imported with the replay)
    for i, g in enumerate(findings):
        steps = g.evidence.get("steps") or [g.step]
        if g.severity != "error" or g.phase != "backward" or g.rule not in ("overflow", "nan_origin") or \
                g.step != cap_step or any(s != cap_step for s in steps):
            continue
        msg, fix = scaler_search_text(g.message.rstrip("."), search)
        findings[i] = Finding(g.rule, "info", g.phase, g.module, g.op, g.step, msg, fix,
                              dict(g.evidence, scaler_search=search))


def applied(rec: StepRecord | None) -> bool:
    """The step's non-finite gradients were applied: the loop stepped the optimizer itself (`optimizer.step()`, not
    `scaler.step()`) and nothing skipped the step. Its backward overflow is then no GradScaler search, whatever
    loss scale would have made it finite (rules/callorder.py names the call)."""
    return rec is not None and not rec.skipped and rec.grad_finite is False and any(
        e.kind == "optimizer.step" and not e.via_scaler and not e.error for e in rec.events)


def replay_stayed_finite(findings: list[Finding], cap_step: int | None) -> None:
    """The step's unlocated finding, when the replay of its capture made no inf/NaN at all: asking for that replay
    would send the user in a circle. The step depended on something the capture does not hold."""
    for i, g in enumerate(findings):
        if g.evidence.get("unlocated") and g.step == cap_step and cap_step is not None:
            msg = g.message.split("; replay its capture")[0]
            findings[i] = Finding(
                g.rule, g.severity, g.phase, g.module, g.op, g.step,
                msg + "; the replay of its capture (run for this report) stayed finite, so the step depended on "
                "something the capture does not hold: module state it could not keep (over 8 MiB of it, or first "
                "changed late in the run), data the loop changed after the forward, or a nondeterministic kernel.",
                "Watch with every=1 (full statistics every step) to name the layer on the step itself.",
                dict(g.evidence, replay_finite=True))


def no_search(findings: list[Finding], cap_step: int | None) -> None:
    """The replay found the captured step non-finite at every loss scale down to 1: a `skipped_steps` the records
    took for a normal rate of GradScaler's search (info) is no search; it becomes a warning that says why."""
    for j, k in enumerate(findings):
        if k.rule == "skipped_steps" and k.severity == "info" and k.evidence.get("benign_backoff"):
            findings[j] = Finding(
                k.rule, "warning", k.phase, k.module, k.op, k.step,
                f"GradScaler skipped {k.evidence.get('skipped', '?')} of {k.evidence.get('steps', '?')} "
                f"steps; the replay of step {cap_step} finds its gradients non-finite at every loss scale "
                f"down to 1, so step {cap_step}'s skip is not the scaler's search (see the finding above).",
                "Fix the producer of the inf/NaN (the finding above); no loss scale can.",
                dict(k.evidence, benign_backoff=False, rank_hint=70))
