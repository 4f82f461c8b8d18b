"""Captures a run directory holds ahead of its records: a watch writes the capture of a bad step when it reads that
step's values, and the step's record later (with the next step's), so a run read while it is still going (or
after it was killed in between) can hold `captures/<n>` of a step `steps.jsonl` does not have yet. `pending`
turns each such capture of the run being read into a minimal StepRecord (the step, what went bad as the capture's
extra says, the capture), so that the report says the step went bad and a replay with the user's model names the
op, instead of "healthy" up to the last record. Only the manifest is read here (capture.load_capture checks the rest when the
capture is replayed); nothing in it is imported or called.
"""
from __future__ import annotations

import json
import os

from .records import StepRecord

__all__ = ["pending"]

_MAX_MANIFEST = 1 << 20
_FORMAT = "ampdoctor-capture"


def pending(run_dir: str, run_id, steps: list[StepRecord], process: dict | None,
            since: float | None) -> list[StepRecord]:
    """Records for the complete captures under `run_dir/captures` of steps after the last of `steps`, written by
    this run: named `<step>`, `<step>.run<run_id>` or `<step>.pid<pid>`, and written at or after `since` (when the
    run's entry in the run manifest was written: an earlier run's capture of the same step is older)."""
    base = os.path.join(run_dir, "captures")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    last = steps[-1].step if steps else -1
    pid = (process or {}).get("pid")
    found: dict[int, tuple[str, dict]] = {}
    for name in names:
        head, _, tail = name.partition(".")
        if not head.isdigit() or int(head) <= last or tail not in ("", f"run{run_id}", f"pid{pid}"):
            continue
        path = os.path.join(base, name)
        man = _manifest(path)
        if man is None or man.get("step") != int(head):
            continue
        try:
            if since is not None and os.stat(os.path.join(path, "manifest.json")).st_mtime < since:
                continue
        except OSError:
            continue
        if not all(isinstance(f, dict) and isinstance(f.get("name"), str) and os.path.isfile(os.path.join(
                path, os.path.basename(f["name"]))) for f in (man.get("files") or {}).values()):
            continue
        found.setdefault(int(head), (path, man))
    out = []
    for step in sorted(found)[:1]:  # (a watch captures the first bad step; later ones add nothing to say)
        path, man = found[step]
        extra = man.get("extra") if isinstance(man.get("extra"), dict) else {}
        ac = man.get("autocast") if isinstance(man.get("autocast"), dict) else {}
        lf, kind = extra.get("loss_finite"), extra.get("kind")
        rec = StepRecord(step=step, loss_finite=lf if isinstance(lf, bool) else None, capture=path,
                         micro_batches=1, autocast=f"{ac.get('device')}:{ac.get('dtype')}"
                         if ac.get("enabled") and isinstance(ac.get("device"), str) else None)
        if kind == "forward":
            rec.output_finite = False
        elif kind in ("backward", "persistent"):
            rec.grad_finite = False
            if isinstance(man.get("scaler"), dict):  # (a GradScaler skips a step whose gradients are not finite)
                rec.found_inf = rec.skipped = True
        out.append(rec)
    return out


def _manifest(path: str) -> dict | None:
    """A capture's manifest as a dict, or None (missing, too large, not JSON, not a capture's)."""
    try:
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            raw = f.read(_MAX_MANIFEST + 1)
        if len(raw) > _MAX_MANIFEST:
            return None
        d = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) and d.get("format") == _FORMAT else None
