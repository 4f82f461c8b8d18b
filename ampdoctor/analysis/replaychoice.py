"""Which capture a report replays: the top error's step's for a report with something wrong; for one with nothing
wrong, the captures of skips that no loss scale explains and of steps whose loss or output went non-finite, tried
in turn until one proves an error (`choose_replay`). The replay itself and its folding are replayfold.py's."""
from __future__ import annotations

import math
import re

from ..findings import Report
from ..records import StepRecord
from ..rules.backoff import benign_backoff

__all__ = ["choose_replay", "candidates", "pick_capture", "alarming", "unexplained_skip", "unexplained_skips",
           "unexplained_nonfinite", "crashed"]


def choose_replay(rep: Report, steps: list[StepRecord], replayed) -> tuple[str | None, Report | None]:
    """(capture, its replay) that a report folds in, `replayed(capture)` giving a replay (or None). A report with
    something wrong replays `pick_capture`'s; one with nothing wrong tries the captures `candidates` gives in order
    and takes the first whose replay finds an error (a harmless skip's capture says nothing; a later one, of a
    NaN at any loss scale, may), else the first replay."""
    caps = candidates(rep, steps)
    first: tuple = (None, None)
    for cap in caps:
        rr = replayed(cap)
        if rr is None:
            continue
        if first[1] is None:
            first = (cap, rr)
        if alarming(rep) or any(f.severity == "error" for f in rr.findings):
            return cap, rr
    return first


def candidates(rep: Report, steps: list[StepRecord]) -> list[str]:
    """The captures a report may replay, in order. One with something wrong: the capture of its top error's step,
    else the first. One with nothing wrong: every capture of a skipped step its loss scale does not explain
    (`unexplained_skips`), then that of a step whose loss or output went non-finite (`unexplained_nonfinite`), then
    that of the step the run crashed in (`crashed`: e.g. a model's own check refusing an inf it had just made), whose
    replay then adds only an error it proves (`fold_replay`); none otherwise (e.g. GradScaler's normal backoff: a
    replay could only add advisory constants to a healthy run)."""
    if alarming(rep):
        caps = rep.summary.get("captures") or []
        top = next((f for f in rep.findings if f.severity == "error"), None)
        by_step = {r.step: r.capture for r in steps if r.capture}
        cap = by_step.get(top.step) if top is not None and top.step in by_step else (caps[0] if caps else None)
        return [cap] if cap is not None else []
    out = unexplained_skips(steps)
    for cap in (unexplained_nonfinite(steps), crashed(steps)):
        if cap is not None and cap not in out:
            out.append(cap)
    return out


def alarming(rep: Report) -> bool:
    """The report has a warning or an error."""
    return any(f.severity in ("error", "warning") for f in rep.findings)


def pick_capture(rep: Report, steps: list[StepRecord]) -> str | None:
    """The first capture a report's replay would re-run (`candidates`), or None."""
    caps = candidates(rep, steps)
    return caps[0] if caps else None


def unexplained_skip(steps: list[StepRecord]) -> str | None:
    """The capture of a step the scaler skipped at a loss scale that an earlier step already stepped with: the
    scale had not grown past what works, so the inf/NaN came from the batch or the model (e.g. a sqrt at 0 in the
    backward on one batch), which only a replay of the step tells apart from a gradient spike."""
    caps = unexplained_skips(steps)
    return caps[0] if caps else None


def unexplained_skips(steps: list[StepRecord]) -> list[str]:
    """Every such capture, in step order (a watch captures a skip again after the run recovered:
    autocapture.CapturePolicy)."""
    worked = None  # the largest scale an applied update has used so far
    out = []
    for r in steps:
        if r.skipped and r.capture and r.scale is not None and worked is not None and r.scale <= worked:
            out.append(r.capture)
        if not r.skipped and r.scale is not None and r.grad_finite is not False:
            worked = r.scale if worked is None else max(worked, r.scale)
    return out


def unexplained_nonfinite(steps: list[StepRecord]) -> str | None:
    """The capture of a step whose loss or model output went non-finite, in a report with nothing wrong: the
    records put it down to something harmless (a module's -inf that the later sampled steps absorbed, dated back
    to this unsampled step), which a non-finite loss contradicts; only the step's replay says what made it."""
    # (not a loss the scale made non-finite in GradScaler's search, which benign_backoff counts: rules/backoff.py)
    benign = benign_backoff(steps, any(r.scale is not None for r in steps))
    return next((r.capture for r in steps if r.capture and (r.output_finite is False or r.loss_finite is False
                                                             and r.step not in benign)), None)


def crashed(steps: list[StepRecord]) -> str | None:
    """The capture of the step the run died in (its record holds the exception), in a report with nothing wrong,
    when the step shows an inf/NaN: a forward that raised before its outputs came back (a distribution's argument
    check on the NaN an overflow made) leaves the records no producer; the replay of the step names the op. A crash
    with no sign of one (a label out of range) is not replayed: the replay would only raise it again."""
    return next((r.capture for r in steps if r.capture and r.exception is not None and _nonfinite_sign(r)), None)


_NONFINITE_WORD = re.compile(r"\b(nan|inf|infinity|non-finite|nonfinite)\b", re.IGNORECASE)


def _nonfinite_sign(r: StepRecord) -> bool:
    """The step's headroom series holds a non-finite abs-max, or its exception speaks of one."""
    h = r.headroom or {}
    if any(v is not None and not math.isfinite(v) for key in ("fwd", "bwd") for v in (h.get(key) or ())):
        return True
    return bool(_NONFINITE_WORD.search(str((r.exception or {}).get("message") or "")))
