"""Ranking and the Report: run the rules over a run's records, rank the findings (root cause first, in
`Finding.sort_key`'s order) and put them with the summary and the data panels into a Report."""
from __future__ import annotations

from ..findings import Finding, Report
from ..records import RunMeta, StepRecord
from ..rules import RuleConfig, RunData, run_rules
from ..summary import summarize
from .panels import build_panels

__all__ = ["build_report", "rank"]


def rank(findings: list[Finding]) -> list[Finding]:
    """Most important first, in the one order of findings (`Finding.sort_key`)."""
    return sorted(findings, key=Finding.sort_key)


def build_report(meta: RunMeta, steps: list[StepRecord], *, run_dir: str | None = None,
                 config: RuleConfig | None = None) -> Report:
    run = RunData(meta, steps)
    findings = rank(run_rules(run, config))
    return Report(findings, summarize(meta, steps, findings, run_dir, run.has_scaler),
                  build_panels(meta, steps, findings))
