"""The run directory: append-only, flushed each step, readable after SIGKILL, hostile input refused."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampdoctor
from ampdoctor.errors import BadInput
from ampdoctor.rundir import read_run
from scenarios import TinyGPT, gpt_batch, hf_loss, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_round_trip_and_append_new_run(tmp_path):
    rd = tmp_path / "run"
    w = train(TinyGPT(), gpt_batch(), hf_loss, steps=3, run_dir=rd)
    meta, steps = read_run(str(rd))
    assert [s.step for s in steps] == [0, 1, 2]
    assert [s.to_dict() for s in steps] == [s.to_dict() for s in w.steps]
    assert meta.model_class.endswith("TinyGPT") and meta.modules
    train(TinyGPT(), gpt_batch(), hf_loss, steps=2, run_dir=rd)  # a second run: appended, nothing overwritten
    man = json.loads((rd / "manifest.json").read_text())
    assert len(man["runs"]) == 2
    assert len(read_run(str(rd), run=0)[1]) == 3 and len(read_run(str(rd))[1]) == 2


def test_sigkill_mid_run_leaves_finished_steps_readable(tmp_path):
    rd = tmp_path / "killed"
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        import ampdoctor
        from scenarios import TinyGPT, gpt_batch, hf_loss
        m = TinyGPT(); opt = torch.optim.AdamW(m.parameters()); sc = torch.amp.GradScaler("cpu")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir={str(rd)!r}, every=1)
        b = gpt_batch()
        for i in range(100):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = hf_loss(m(*b(i)))
            sc.scale(loss).backward()
            if i == 5:
                os.kill(os.getpid(), signal.SIGKILL)   # mid-step: after backward, before the optimizer step
            sc.step(opt); sc.update()
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL
    rep = ampdoctor.diagnose(rd)
    assert rep.summary["steps"] == 5  # steps 0..4 finished (step 4 is written when step 5 begins)
    # the run never wrote its end line and its process is gone: killed after step 4, never "healthy"
    assert rep.summary["crash"]["type"] == "Killed" and rep.summary["crash"]["step"] == 4, rep.summary
    assert not rep.summary["verdict"].startswith("Healthy"), rep.summary["verdict"]
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(rd), "--no-html"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "Killed" in out.stdout, out.stdout + out.stderr


def test_torn_last_line_is_ignored(tmp_path):
    rd = tmp_path / "r"
    train(nn.Sequential(nn.Linear(4, 1)), lambda i: (torch.randn(2, 4),), lambda o, *a: o.float().pow(2).mean(),
          steps=3, run_dir=rd)
    with open(rd / "steps.jsonl", "ab") as f:
        f.write(b'{"run": 0, "step": 3, "loss": 1.')
    assert len(read_run(str(rd))[1]) == 3


def test_read_only_run_dir_degrades_to_memory(tmp_path):
    rd = tmp_path / "ro"
    rd.mkdir()
    os.chmod(rd, 0o500)
    if os.access(rd, os.W_OK):  # root ignores permissions: use a path under a file instead
        rd = tmp_path / "a_file" / "run"
        (tmp_path / "a_file").write_text("x")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        w = train(nn.Sequential(nn.Linear(4, 1)), lambda i: (torch.randn(2, 4),),
                  lambda o, *a: o.float().pow(2).mean(), steps=2, run_dir=rd)
    assert len(w.steps) == 2
    assert sum("records stay in memory" in str(r.message) for r in rec) == 1


@pytest.mark.parametrize("content,needle", [
    (b"not json", "not a readable"), (b'{"format": "other"}', "not an ampdoctor"),
    (b'{"format": "ampdoctor-run", "format_version": 99, "runs": []}', "newer ampdoctor"),
    (b'{"format": "ampdoctor-run", "format_version": 1, "runs": "x"}', "no valid 'runs'"),
])
def test_bad_manifest_is_bad_input(tmp_path, content, needle):
    (tmp_path / "manifest.json").write_bytes(content)
    with pytest.raises(BadInput, match=needle):
        ampdoctor.diagnose(tmp_path)


def test_symlinked_manifest_refused(tmp_path):
    real = tmp_path / "elsewhere.json"
    real.write_text("{}")
    rd = tmp_path / "r"
    rd.mkdir()
    os.symlink(real, rd / "manifest.json")
    with pytest.raises(BadInput, match="symbolic link"):
        ampdoctor.diagnose(rd)


_keys = st.sampled_from(["modules", "params", "optimizer", "scaler", "env", "every", "rank", "step", "loss",
                         "scale", "skipped", "events", "forward_producer", "backward_producer", "kind", "module",
                         "call", "out", "inp", "gout", "numel", "nan", "posinf", "absmax", "sampled", "seq",
                         "type", "depth", "phase", "name", "exception", "message"]) | st.text(max_size=4)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(_keys, c, max_size=5),
                     max_leaves=16)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=_json, record=_json)
def test_fuzzed_run_dirs_give_bad_input_or_a_report(tmp_path_factory, meta, record):
    rd = tmp_path_factory.mktemp("fz")
    (rd / "manifest.json").write_text(json.dumps({"format": "ampdoctor-run", "format_version": 1,
                                                  "runs": [{"run": 0, "meta": meta}]}))
    (rd / "steps.jsonl").write_text(json.dumps(record) + "\n")
    try:
        rep = ampdoctor.diagnose(rd)
    except BadInput as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(rep.to_dict(), dict)
