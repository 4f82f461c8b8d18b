"""`diagnose(run_dir)` is the same Report as `w.report()` (shared/CONTRACT.md): the watch's in-process replay of
its capture, which refines a module-level finding into the op that made the inf (overflow, not the NaN it
became in the same module), is saved in the run directory at close (`replay-<run>.json`) and folded in by
`diagnose` and `ampdoctor report RUN_DIR`. A saved replay of another capture or another run is left out; a corrupt
one is bad input (one line, exit 2); a healthy run saves none."""
import json
import subprocess
import sys

import pytest
import torch

import ampdoctor
from ampdoctor.errors import BadInput
from test_unseen_variants import Clip, loop, randn


def clip_run(run_dir, t_step=0.25):
    torch.manual_seed(0)
    m = Clip()
    a = randn(16, 16)
    b = a + 0.05 * randn(16, 16, seed=1)

    def batch(i):
        with torch.no_grad():
            m.loss.logit_scale.add_(t_step)  # 10.25, 10.5, ... past 11.09 (exp > 65504) at step 4
        return (a, b)
    return loop(m, batch, lambda out, *args: out, steps=8, clip=None, run_dir=run_dir)


def key(f):
    return (f.rule, f.module, f.op, f.step, f.phase)


def test_diagnose_of_the_run_dir_says_what_the_watch_said(tmp_path):
    rd = tmp_path / "run"
    w = clip_run(rd)
    assert (rd / "replay-0.json").is_file()  # written by close()
    live = w.report()
    disk = ampdoctor.diagnose(rd)
    assert [key(f) for f in disk.findings[:3]] == [key(f) for f in live.findings[:3]]
    assert key(disk.findings[0])[:4] == ("overflow", "loss", "aten::mul", 4)
    # without the saved replay the records alone see "finite in, NaN out" inside the loss module
    (rd / "replay-0.json").rename(tmp_path / "kept.json")
    alone = ampdoctor.diagnose(rd)
    assert key(alone.findings[0])[:2] == ("nan_origin", "loss")
    (tmp_path / "kept.json").rename(rd / "replay-0.json")
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(rd), "--json", str(tmp_path / "r.json"),
                          "--no-html"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    f = json.loads((tmp_path / "r.json").read_text())["findings"][0]
    assert (f["rule"], f["module"], f["op"], f["step"]) == ("overflow", "loss", "aten::mul", 4)


def test_report_after_close_reuses_the_replay(tmp_path, monkeypatch):
    w = clip_run(tmp_path / "run")
    import ampdoctor.analysis.replayfold as rf
    monkeypatch.setattr(rf, "run_replay", lambda *a, **k: pytest.fail("replayed twice"))
    assert key(w.report().findings[0])[:4] == ("overflow", "loss", "aten::mul", 4)


def test_a_replay_of_another_run_or_capture_is_left_out(tmp_path):
    rd = tmp_path / "run"
    clip_run(rd)
    saved = json.loads((rd / "replay-0.json").read_text())
    # the same directory, a second (healthy) run: its report must not borrow run 0's replay
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    loop(m, lambda i: (randn(4, 8, seed=i),), lambda out, *a: out.float().pow(2).mean(), steps=4, run_dir=rd)
    assert not (rd / "replay-1.json").exists()
    rep = ampdoctor.diagnose(rd)
    assert not any(f.severity in ("error", "warning") for f in rep.findings), [f.one_line() for f in rep.findings]
    # a replay file naming another capture than the one the report replays is ignored
    rd2 = tmp_path / "run2"
    clip_run(rd2)
    doc = json.loads((rd2 / "replay-0.json").read_text())
    doc["capture"] = "999"
    (rd2 / "replay-0.json").write_text(json.dumps(doc))
    assert key(ampdoctor.diagnose(rd2).findings[0])[:2] == ("nan_origin", "loss")
    assert saved["capture"] == "4"


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "ampdoctor-replay", "run": 0}),
                                     json.dumps([1, 2])])
def test_a_corrupt_saved_replay_is_bad_input(tmp_path, content):
    rd = tmp_path / "run"
    clip_run(rd)
    (rd / "replay-0.json").write_text(content)
    with pytest.raises(BadInput):
        ampdoctor.diagnose(rd)
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(rd), "--no-html"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "replay" in out.stderr, out.stderr
