"""The terminal reporter: `render_text(report)` gives the verdict, the findings root cause first, then counts.

A crashed run says so on the line after the header. The verdict line is the root finding's short headline
(prose.headline); its message follows once, in finding 1. One line per finding (`Finding.one_line()`), its fix
indented below; a replay that computed no loss says that its backward was not run; a healthy run gets two lines.
"""
from __future__ import annotations

import textwrap

from ..summary import counts as counts_of
from . import prose

__all__ = ["render_text"]

_INDENT = "      "


def _fix_lines(fix: str, width: int) -> list[str]:
    lines = []
    for i, raw in enumerate((fix or "").strip().splitlines()):
        # Code keeps its own layout; prose wraps to the terminal width.
        if raw.startswith((" ", "\t")) or len(raw) <= width:
            lines.append(raw.rstrip())
        else:
            lines.extend(textwrap.wrap(raw, width) or [""])
    if not lines:
        return []
    return [f"{_INDENT}fix: {lines[0]}"] + [f"{_INDENT}     {ln}" for ln in lines[1:]]


def render_text(report, width: int = 100) -> str:
    """A readable summary for a terminal; `report` is a Report (or its `to_dict()`)."""
    from ..findings import Report

    if isinstance(report, dict):
        report = Report.from_dict(report)
    s = report.summary or {}
    n = {sev: sum(f.severity == sev for f in report.findings) for sev in ("error", "warning", "info")}
    problems = n["error"] + n["warning"]
    head = "ampdoctor"
    if s.get("model_class"):
        head += f" · {s['model_class']}"
    if s.get("steps"):
        head += f" · {s['steps']} steps"
    if s.get("first_bad_step") is not None:
        head += f" · first bad step {s['first_bad_step']}"
    out = [head]
    crash = s.get("crash") if isinstance(s.get("crash"), dict) else None
    if crash:
        out.append(f"CRASHED: {prose.crash_line(crash)}")
    errors = counts_of(report.findings, crash)["errors"]  # (as the summary counts: a crash no finding explains is one)
    counts = f"{_count(errors, 'error')}, {_count(n['warning'], 'warning')}, {n['info']} info"
    if s.get("skipped_steps"):
        counts += f" · {s['skipped_steps']} skipped steps"
    if not problems:
        verdict = s.get("verdict") or "No mixed-precision problems found."
        if crash:
            out.append(f"verdict: {verdict}")
            out.append(counts)
            return "\n".join(out) + "\n"
        out.append(f"healthy: no problems found. {verdict}".rstrip() if "no " not in verdict.lower()
                   else f"healthy: {verdict}")
        out.append(counts)
        return "\n".join(out) + "\n"
    root = next(f for f in report.findings if f.severity in ("error", "warning"))
    out.append(f"verdict: {prose.headline(root.to_dict(), s.get('verdict') or root.message)}")
    chain = (report.data.get("replay") or {}).get("chain") or []
    if any(c.get("stage") == "loss" and c.get("finite") is None for c in chain) and \
            not any(c.get("stage") == "exception" for c in chain):
        out.append("replay: " + prose.NO_LOSS_TEXT)
    out.append("")
    out.append("findings (root cause first):")
    for i, f in enumerate(report.findings, 1):
        out.append(f"  {i:>2}. {f.one_line()}")
        out.extend(_fix_lines(f.fix, width - len(_INDENT) - 5))
    out.append("")
    out.append(counts)
    return "\n".join(out) + "\n"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
