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
    assert lines[1] == f"verdict: `{rs.ROOT_MODULE}` (aten::mm) overflowed in the forward pass at step 23"
    assert rep.findings[0].message not in lines[1]                    # said once, in finding 1
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


def test_crash_is_said_first():
    rep, err = rs.crashed_run()          # a real watched run whose forward raised
    if not rep.summary.get("crash"):     # summary["crash"] not landed yet: the documented shape, from the run
        rep.summary["crash"] = {"step": 0, "type": type(err).__name__, "message": str(err), "module": "attn",
                                "file": None, "line": None}
    lines = render_text(rep).splitlines()
    assert lines[1].startswith("CRASHED: RuntimeError at step 0 in `attn`")
    assert lines[1].endswith(str(err).splitlines()[0])
    assert "healthy" not in render_text(rep).lower()


def test_replay_without_loss_says_backward_not_run(tmp_path):
    out = render_text(rs.replay_without_loss(tmp_path / "cap"))
    line = next(ln for ln in out.splitlines() if ln.startswith("replay:"))
    assert "backward was not run" in line and "--loss" in line
    assert "LOSS not finite" not in out


def test_one_error_and_one_warning_are_singular():
    rep = rs.overflow_report()
    rep.findings = [f for f in rep.findings if f.severity == "error"][:1] + \
        [f for f in rep.findings if f.severity == "warning"][:1]
    assert render_text(rep).splitlines()[-1].startswith("1 error, 1 warning, 0 info")
