"""Findings and the Report that carries them: the one shape every rule emits and every reporter reads.

A `Finding` is one diagnosed cause (rule id, where, when, what to do, evidence). A `Report` is the ranked
list of findings plus the summary and the data the reporters draw (timeline, layers, calls, env, replay).
Both serialise to plain JSON (shared/CONTRACT.md, "Finding (JSON)").
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Finding", "Report", "SEVERITIES", "PHASES"]

SEVERITIES = ("error", "warning", "info")
PHASES = ("forward", "backward", "optimizer", "scaler", "env", None)
_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


def _jsonable(v: Any) -> Any:
    """Make evidence JSON-safe: non-finite floats become strings ("inf", "nan"), tuples lists."""
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (str, int, bool)):
        return v
    return str(v)


@dataclass
class Finding:
    """One diagnosed cause. Field meanings are those of shared/CONTRACT.md."""

    rule: str
    severity: str
    phase: str | None
    module: str | None
    op: str | None
    step: int | None
    message: str
    fix: str
    evidence: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["evidence"] = _jsonable(self.evidence)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(**{k: d.get(k) for k in ("rule", "severity", "phase", "module", "op", "step", "message", "fix")},
                   evidence=dict(d.get("evidence") or {}))

    def sort_key(self) -> tuple:
        """The one order of findings, most important first: severity; then the rank_hint's tens (root causes
        below 20, consequences and advice above); then the earlier step; then the exact rank_hint."""
        h = self.evidence.get("rank_hint", 50)
        return (_SEVERITY_RANK[self.severity], h // 10, self.step if self.step is not None else 1 << 60, h)

    def one_line(self) -> str:
        where = "(run)" if self.module is None else self.module or "(root)"
        call = self.op or self.evidence.get("api")  # (an ATen op, else the API call a call-order rule names)
        op = f" {call}" if call else ""
        step = f" step {self.step}" if self.step is not None else ""
        return f"[{self.severity}] {self.rule} at {where}{op}{step}: {self.message}"


@dataclass
class Report:
    """Ranked findings plus what the reporters draw.

    `data` holds the JSON-ready panels built by `ampdoctor.analysis.panels.build_panels`: `timeline` (per step),
    `layers` (per module), `calls` (scaler/optimizer sequence), `env`, `replay` (when a replay ran).
    """

    findings: list[Finding] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """1 when a finding is an error or the run crashed (summary["crash"]), else 0."""
        return 1 if any(f.severity == "error" for f in self.findings) or self.summary.get("crash") else 0

    def to_dict(self) -> dict:
        d = {"findings": [f.to_dict() for f in self.findings], "summary": _jsonable(self.summary)}
        d.update({k: _jsonable(v) for k, v in self.data.items()})
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        data = {k: v for k, v in d.items() if k not in ("findings", "summary")}
        return cls([Finding.from_dict(f) for f in d.get("findings", [])], dict(d.get("summary") or {}), data)

    def save_json(self, path: str | os.PathLike) -> str:
        from .fsutil import atomic_write_text
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    def save_html(self, path: str | os.PathLike) -> str:
        """Write a self-contained HTML report. `path` is a file (…/x.html) or a directory (→ index.html)."""
        if not os.fspath(path):
            raise ValueError("save_html: empty path; give a file (…/report.html) or a directory")
        from .report.html import write_html
        return write_html(self, path)

    def text(self) -> str:
        from .report.text import render_text
        return render_text(self)

    def __repr__(self) -> str:
        n = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        return f"Report({n['error']} errors, {n['warning']} warnings, {n['info']} info)"
