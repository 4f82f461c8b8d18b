"""benchmarks/overhead.py runs end to end on a tiny CPU model (no timing assertions)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "overhead.py")


def _load():
    spec = importlib.util.spec_from_file_location("ampdoctor_bench_overhead", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_overhead_main_tiny_cpu(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "res.json"
    res = bench.main(["--model", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                      "--variants", "plain,default,every1,anomaly", "--json", str(out)])
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"plain", "default", "every1", "anomaly"}
    for r in rows.values():
        assert r["error"] is None and r["steps"] == 2 and r["median_ms"] > 0
    assert rows["plain"]["ratio"] == pytest.approx(1.0)
    assert json.loads(out.read_text())["rows"][0]["variant"] == "plain"
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("| anomaly |")  # the table comes last
    # every hook was removed again: a fresh watch on another copy is allowed and nothing is left behind
    import ampdoctor
    model, _, _ = bench.build("tiny", torch.device("cpu"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with ampdoctor.watch(model):
        pass


def test_bitwise_check_cpu_short():
    bench = _load()
    res = bench.bitwise_check(torch.device("cpu"), steps=3, log=lambda *a: None)
    assert res["control_identical"]
    assert res["identical"], res["comparisons"]


def test_a_baseline_checkouts_watch_runs_beside_this_one(tmp_path):
    """`--baseline DIR` loads DIR's ampdoctor as a second package (ampdoctor_base) and runs `<variant>@base` with it,
    interleaved with this checkout's watch (in a subprocess: the second package's process-wide patches stay there)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(_PATH))
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, _PATH, "--model", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                        "--baseline", root, "--variants", "plain,default,default@base,every1@base", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "default", "default@base", "every1@base"}
    assert all(row["error"] is None and row["steps"] == 2 for row in rows.values()), rows
    assert [rows[v]["package"] for v in ("plain", "default", "default@base", "every1@base")] == \
        [None, "ampdoctor", "ampdoctor_base", "ampdoctor_base"]
    bad = subprocess.run([sys.executable, _PATH, "--model", "tiny", "--device", "cpu",
                          "--variants", "plain,default@base"], capture_output=True, text=True, timeout=300, cwd=root)
    assert bad.returncode != 0 and "needs --baseline" in bad.stderr, bad.stderr[-500:]


def test_graph_holders_runs_on_cpu_and_finds_nothing_held():
    """benchmarks/graph_holders.py end to end on the CPU (where the step's values are read inside scaler.step):
    every iteration's graph is gone once the loop deleted its loss, and nothing in the watch holds one."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "graph_holders.py"), "--device", "cpu",
                        "--steps", "3"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("iteration ")]
    assert len(lines) == 3, p.stdout
    assert all("graph alive False" in ln and ln.endswith("held by []") for ln in lines), p.stdout
