"""The README's main-job command (scripts/demo.sh) rewrites the committed example report: the example directory
must be one ampdoctor is allowed to write into on a fresh clone (it carries the output marker), and the demo's
replay command must exit 1 (errors found), never 2 (refused)."""
from __future__ import annotations

import os
import shutil

from ampdoctor.cli import main
from ampdoctor.fsutil import OUT_MARKER, check_out_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "reports", "example")


def test_the_committed_example_may_be_rewritten():
    assert os.path.exists(os.path.join(EXAMPLE, OUT_MARKER))
    check_out_dir(EXAMPLE)  # raises BadInput when the demo would be refused


def test_the_demo_command_runs_into_a_copy_of_the_example(tmp_path, monkeypatch):
    out = tmp_path / "example"
    shutil.copytree(EXAMPLE, out)
    monkeypatch.chdir(ROOT)
    rc = main(["replay", "fixtures/captures/t5_ffn_overflow", "--model", "fixtures.models:t5_block",
               "--out", str(out), "--json", str(out / "report.json")])
    assert rc == 1
    assert (out / "index.html").stat().st_size > 1000
