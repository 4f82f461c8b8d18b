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
    # the sample predates the headroom timeline panel (tested on real runs below)
    assert sorted(os.path.basename(p) for p in paths) == sorted(v for k, v in PLOT_FILES.items()
                                                                if k != "headroom_timeline")
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


# -- the per-layer headroom timeline (issue 15 item 3) -----------------------------------------------------------
def _growing_run(steps=44):
    """A real watched run: fp16 autocast + GradScaler on CPU, `fc1`'s weight multiplied by 1.15 every step."""
    import torch
    import ampdoctor

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    torch.manual_seed(0)
    m = Net()
    opt, sc = torch.optim.SGD(m.parameters(), lr=0.0), torch.amp.GradScaler("cpu", init_scale=256.0)
    x = torch.randn(8, 16)
    with torch.no_grad():
        m.fc1.weight.mul_(40.0)
    with ampdoctor.watch(m, optimizer=opt, scaler=sc, headroom=True) as w:
        for _ in range(steps):
            with torch.no_grad():
                m.fc1.weight.mul_(1.15)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    return w.report(replay=False)


def test_headroom_timeline_of_a_growing_layer(tmp_path):
    """The panel holds the warned layer with a falling series and its forecast; the PNG is drawn, no warnings."""
    import warnings
    rep = _growing_run()
    ht = rep.data["headroom_timeline"]
    assert ht["modules"][0] == "fc1" and len(ht["modules"]) <= 8
    warned = next(f for f in rep.findings if f.rule == "headroom_trend" and f.phase == "forward")
    assert ht["forecast"] == {"fc1": warned.evidence["forecast_step"]}
    assert ht["first_bad_step"] == rep.summary["first_bad_step"]
    row = ht["headroom"][0]
    assert len(ht["steps"]) == 44 and all(v is not None for v in row)
    assert row[0] > 8 and row[-1] < 2 and all(b < a for a, b in zip(row, row[1:]))
    d = rep.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_plots(d, tmp_path)
    assert str(tmp_path / PLOT_FILES["headroom_timeline"]) in paths
    h, w, _ = _png_shape(tmp_path / PLOT_FILES["headroom_timeline"])
    assert w >= 800 and h >= 250


def test_headroom_timeline_marks_non_finite_steps():
    import warnings
    from ampdoctor.report.plots import render
    ht = {"modules": ["a", "b"], "steps": [0, 1, 2, 3], "headroom": [[3.0, 2.0, 1.0, "-inf"], [9.0, None, 9.0, 9.0]],
          "forecast": {"a": 4}, "first_bad_step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = render({"headroom_timeline": ht})["headroom_timeline"]
    assert "step 3" in p.caption and "`a`" in p.caption and len(p.png) > 5000


def test_headroom_timeline_short_default_run_is_a_sentence(tmp_path):
    """A healthy run with headroom=False has headroom on step 0 only: no plot, one sentence naming what to pass."""
    import warnings
    import ampdoctor
    from ampdoctor.report.plots import headroom_timeline_empty
    rep = ampdoctor.diagnose(rs.short_healthy_run(tmp_path / "run"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = render_plots(rep)
    assert PLOT_FILES["headroom_timeline"] not in out
    why = headroom_timeline_empty(rep.to_dict())
    assert "headroom=True" in why and "every=1" in why
