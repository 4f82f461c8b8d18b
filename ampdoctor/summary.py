"""The Report's summary: the verdict line, the step counts, the first step that went bad for a reason other
than GradScaler's benign backoff, and the crash that ended the run (if one did).

What counts as bad, benign or a crash is decided once, in ampdoctor/rules/steps.py and rules/backoff.py; this file
only words it.
"""
from __future__ import annotations

from .findings import Finding, Report
from .records import RunMeta, StepRecord
from .rules.backoff import benign_backoff
from .rules.steps import absorbed_modules, crash as crash_of, real_bad, unfinished

__all__ = ["summarize", "verdict", "crash_covered", "counts", "only_rules"]


def _where(f: Finding, rank: int | None = None) -> str:
    at = "" if f.module is None else f" at `{f.module or '(root)'}`"
    r = f" (rank {rank})" if rank is not None else ""
    op = f" ({f.op})" if f.op else ""
    st = f", step {f.step}" if f.step is not None else ""
    return f"{f.rule}{at}{r}{op}{st}: {f.message}"


def verdict(findings: list[Finding], n_steps: int, crash: dict | None = None, *, rank: int | None = None,
            benign: list[int] | None = None, internal: dict | None = None) -> str:
    """One line: ampdoctor's own failure first (what follows covers only the steps before it), then the crash
    (it ended the run), then the most important warning or error; a run with no recorded step is never called
    healthy."""
    if internal is not None:
        head = (f"ampdoctor stopped watching at step {internal['step']} after an internal error "
                f"({internal['type']}: {internal['message']}); later steps were not recorded (please report this).")
        rest = verdict(findings, n_steps, crash, rank=rank, benign=benign)
        return f"{head} Before it: {rest}"
    top = next((f for f in findings if f.severity in ("error", "warning")), None)
    if crash is not None:
        at = f" in `{crash['module'] or '(root)'}`" if crash.get("module") is not None else ""
        head = f"Crashed at step {crash['step']}: {crash['type']}: {crash['message']}{at}."
        return head + (f" {_where(top, rank)}" if top is not None else "")
    if top is not None:
        return _where(top, rank)
    if n_steps == 0:
        return ("No training step was recorded: nothing to diagnose (was the model watched before the loop ran, "
                "and did the loop call the optimizer or the scaler?).")
    back = (f" GradScaler's early backoff skipped step(s) {', '.join(map(str, benign[:8]))}"
            f"{'…' if len(benign) > 8 else ''} while it searched for a loss scale, as designed." if benign else "")
    return f"Healthy: no problems found in {n_steps} step(s).{back}"


def crash_covered(crash: dict | None, findings: list[Finding]) -> bool:
    """Whether an error finding already explains the crash (e.g. mask_value_overflow for 'value cannot be
    converted to type at::Half without overflow', a scaler_misorder for GradScaler's own assertion)."""
    if crash is None:
        return False
    msg = crash.get("message") or ""
    for f in findings:
        if f.severity != "error" or f.step != crash["step"]:
            continue
        if f.evidence.get("exception") == crash.get("type") or (msg and msg in (f.evidence.get("error") or "")):
            return True
    return False


def summarize(meta: RunMeta, steps: list[StepRecord], findings: list[Finding], run_dir: str | None,
              has_scaler: bool) -> dict:
    benign = benign_backoff(steps, has_scaler, growth_factor=(meta.scaler or {}).get("growth_factor"))
    mods = absorbed_modules(steps)
    bad = [r for r in steps if real_bad(r, benign, mods)]
    crash = crash_of(steps)
    if crash is None and getattr(meta, "closed", None) is False:  # read back from a run dir without its end line
        from .env import alive
        crash = unfinished(meta, steps, alive(meta.process) if isinstance(meta.process, dict) else None)
    internal = next(({"step": r.step, **r.internal_error} for r in steps if r.internal_error), None)
    return {"verdict": verdict(findings, len(steps), crash, benign=sorted(benign), internal=internal),
            "steps": len(steps), "internal_error": internal,
            "bad_steps": len(bad), "skipped_steps": sum(r.skipped for r in steps),
            "thrown_away_iterations": sum(r.discarded for r in steps),  # (a loop's own loss scale: rules/ownscale.py)
            "first_bad_step": bad[0].step if bad else None, "benign_backoff_steps": sorted(benign),
            "crash": crash, **counts(findings, crash), "run_dir": run_dir,
            "model_class": meta.model_class, "every": meta.every,
            "captures": [r.capture for r in steps if r.capture]}


def counts(findings: list[Finding], crash: dict | None) -> dict:
    """Errors (a crash no error finding explains counts as one), warnings and infos."""
    return {"errors": sum(f.severity == "error" for f in findings) + (crash is not None and
                                                                      not crash_covered(crash, findings)),
            "warnings": sum(f.severity == "warning" for f in findings),
            "infos": sum(f.severity == "info" for f in findings)}


def only_rules(report, ids):
    """The report narrowed to the findings of rule ids `ids` (`ampdoctor report --rules`): the diagnosis is the
    whole one (a filter does not change what a rule finds), the counts and the verdict are the kept findings'; the
    crash that ended the run stays."""
    kept = [f for f in report.findings if f.rule in ids]
    s = dict(report.summary)
    crash = s.get("crash")
    s.update(counts(kept, crash), rules=list(ids))
    v = verdict(kept, s.get("steps") or 0, crash, benign=s.get("benign_backoff_steps"),
                internal=s.get("internal_error"))
    if not any(f.severity in ("error", "warning") for f in kept) and crash is None and s.get("steps"):
        v = (f"No {', '.join(ids)} warning or error in {s['steps']} step(s) (only these rules were asked for, "
             "--rules).")
    s["verdict"] = v
    return Report(kept, s, report.data)
