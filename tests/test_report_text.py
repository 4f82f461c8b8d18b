"""Text reporter: verdict, findings root cause first with the fix indented, then counts; short when healthy."""
from __future__ import annotations

import report_samples as rs
from ampdoctor.findings import Report
from ampdoctor.report.text import render_text


def test_problem_run():
    rep = rs.overflow_report()
    out = rep.text()
    lines = out.splitlines()
    assert lines[0].startswith("ampdoctor · T5ForConditionalGeneration · 40 steps · first bad step 23")
    assert lines[1].startswith("verdict: " + rs.ROOT_MODULE)
    first = next(i for i, ln in enumerate(lines) if ln.strip().startswith("1."))
    assert lines[first].strip() == "1. " + rep.findings[0].one_line()
    assert lines[first + 1].startswith("      fix: Keep the feed-forward")
    assert lines[first + 2].startswith("               with torch.autocast")    # code keeps its indentation
    order = [out.index(f"] {f.rule} at") for f in rep.findings]
    assert order == sorted(order)
    assert lines[-1] == "2 errors, 3 warnings, 2 info · 19 skipped steps"


def test_healthy_is_short():
    out = render_text(rs.healthy_report())
    assert len(out.splitlines()) <= 3
    assert "healthy" in out and "0 errors, 0 warnings, 1 info" in out


def test_dict_and_empty_input():
    assert render_text(rs.overflow_report().to_dict()) == rs.overflow_report().text()
    assert render_text(Report()).splitlines()[0] == "ampdoctor"
    assert "healthy" in render_text(Report())
