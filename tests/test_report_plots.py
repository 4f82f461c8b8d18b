"""Plots reporter: each panel becomes a standalone PNG; missing panels are left out; large runs stay sharp."""
from __future__ import annotations

import os

import report_samples as rs
from ampdoctor.findings import Report
from ampdoctor.report.plots import PLOT_FILES, render_plots, write_plots


def _png_shape(path):
    import matplotlib.image as mpimg
    return mpimg.imread(path).shape


def test_write_plots_all_panels(tmp_path):
    paths = write_plots(rs.overflow_report(), tmp_path)
    assert sorted(os.path.basename(p) for p in paths) == sorted(PLOT_FILES.values())
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        h, w, _ = _png_shape(p)
        assert w >= 800 and h >= 250


def test_missing_panels_are_skipped(tmp_path):
    assert write_plots(Report(), tmp_path) == []
    assert list(render_plots(rs.replay_only_report())) == []
    only_tl = Report(data={"timeline": rs.overflow_report().data["timeline"]})
    assert list(render_plots(only_tl)) == [PLOT_FILES["timeline"]]


def test_non_finite_and_string_values_do_not_break_plots():
    d = rs.overflow_report().to_dict()          # JSON form: "inf"/"nan"/"-inf" strings, None gaps
    d["timeline"][5]["scale"] = "nan"
    d["grad_norms"]["values"][0] = ["nan"] * len(d["grad_norms"]["steps"])
    out = render_plots(d)
    assert len(out) == 3 and all(len(b) > 5000 for b in out.values())


def test_heatmap_figure_height_is_bounded_for_large_runs():
    rep = rs.large_report(n_layers=300, n_steps=600, worst=(10, 20))
    png = render_plots(Report(data={"heatmap": rep.data["heatmap"]}))[PLOT_FILES["heatmap"]]
    assert len(png) < 1_500_000


def test_timeline_without_scaler():
    tl = [{"step": s, "loss": 1.0 / (s + 1), "scale": None, "skipped": False} for s in range(10)]
    assert list(render_plots(Report(data={"timeline": tl}))) == [PLOT_FILES["timeline"]]
    empty = [{"step": s, "loss": None, "scale": None, "skipped": False} for s in range(10)]
    assert render_plots(Report(data={"timeline": empty})) == {}


def test_nothing_finite_to_draw_is_a_sentence_not_a_warning():
    """All gradient norms NaN: no plot (an empty axis with a legend and no lines), no matplotlib warning, and
    one sentence saying why."""
    import warnings
    from ampdoctor.report import panels
    d = rs.overflow_report().to_dict()
    d["grad_norms"]["values"] = [["nan"] * len(d["grad_norms"]["steps"]) for _ in d["grad_norms"]["values"]]
    for r in d["timeline"]:
        r["loss"] = "nan"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = render_plots(d)
    assert PLOT_FILES["grad_norms"] not in out and PLOT_FILES["timeline"] in out
    assert "inf/NaN" in panels.empty_reasons(d)["grad_norms"]


def test_one_sampled_step_is_a_sentence():
    d = rs.overflow_report().to_dict()
    hm, gn = d["heatmap"], d["grad_norms"]
    hm["steps"], hm["headroom"] = hm["steps"][:1], [r[:1] for r in hm["headroom"]]
    gn["steps"], gn["values"] = gn["steps"][:1], [v[:1] for v in gn["values"]]
    d["summary"]["every"] = 200
    out = render_plots(d)
    assert PLOT_FILES["heatmap"] not in out and PLOT_FILES["grad_norms"] not in out
    from ampdoctor.report import panels
    reasons = panels.empty_reasons(d)
    assert "every=1" in reasons["heatmap"] and "every 200 steps" in reasons["grad_norms"]
