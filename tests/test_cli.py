"""The command line: exit codes 0/1/2, one-line errors, nothing overwritten, reports written where asked.
Everything runs `ampdoctor.cli.main(argv)` in-process, except one end-to-end test of the installed command."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ampdoctor.cli import main
from ampdoctor.fsutil import OUT_MARKER
from scenarios import TinyGPT, gpt_batch, hf_loss, mse_to_zero, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(capsys, *args):
    """(exit code, stdout, stderr) of `ampdoctor ARGS`, in-process."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # --help / --version
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_2(rc, err, needle=""):
    assert rc == 2, err
    assert err.strip().count("\n") == 0 and "Traceback" not in err and needle in err, err


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    rd = tmp_path_factory.mktemp("runs") / "healthy"
    torch.manual_seed(0)
    train(TinyGPT(), gpt_batch(), hf_loss, steps=4, run_dir=rd)
    return rd


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    rd = tmp_path_factory.mktemp("runs") / "broken"
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    with torch.no_grad():
        m[1].weight.mul_(1e5)
    x = torch.randn(4, 8) * 10
    train(m, lambda i: (x,), mse_to_zero, steps=3, run_dir=rd)
    return rd


def test_report_healthy_exit_0_writes_json_html_tensorboard(capsys, healthy_run, tmp_path):
    rc, out, err = cli(capsys, "report", healthy_run, "--out", tmp_path / "html", "--json", tmp_path / "r.json",
                       "--tensorboard", tmp_path / "tb")
    assert rc == 0, err
    assert "healthy" in out.lower()
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["findings"] == [] or all(f["severity"] == "info" for f in d["findings"])
    assert (tmp_path / "html" / "index.html").exists() and (tmp_path / "html" / OUT_MARKER).exists()
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "tb"))


def test_report_broken_exit_1_names_the_producer(capsys, broken_run, tmp_path):
    rc, _, err = cli(capsys, "report", broken_run, "--json", tmp_path / "r.json", "--no-html")
    assert rc == 1, err
    d = json.loads((tmp_path / "r.json").read_text())
    assert (d["findings"][0]["rule"], d["findings"][0]["module"]) == ("overflow", "1")
    assert set(d) >= {"findings", "summary", "timeline"}


@pytest.mark.parametrize("args,needle", [
    (("report", "/nonexistent/run"), "no such run directory"),
    (("replay", "/nonexistent/cap"), "no such capture"),
    (("report",), "required"),
    (("frobnicate",), "invalid choice"),
    ((), "command is required"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, needle):
    rc, out, err = cli(capsys, *args)
    one_line_2(rc, err, needle)


def test_unknown_or_empty_rules_and_foreign_dir(capsys, broken_run, tmp_path):
    rc, _, err = cli(capsys, "report", broken_run, "--rules", "overflow,not_a_rule", "--no-html")
    one_line_2(rc, err, "unknown rule")
    for spec in (",", " , ,", ""):
        rc, _, err = cli(capsys, "report", broken_run, "--rules", spec, "--no-html")
        one_line_2(rc, err, "names no rule")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    rc, _, err = cli(capsys, "report", tmp_path / "foreign")
    one_line_2(rc, err, "not an ampdoctor run directory")
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_out_only_into_new_empty_or_own_dir(capsys, healthy_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "index.html").write_text("the user's own page")
    rc, _, err = cli(capsys, "report", healthy_run, "--out", out)
    one_line_2(rc, err, "--force")
    assert (out / "index.html").read_text() == "the user's own page"
    rc, _, err = cli(capsys, "report", healthy_run, "--out", out, "--force")
    assert rc == 0, err
    assert (out / OUT_MARKER).exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(capsys, "report", healthy_run, "--out", empty)[0] == 0
    assert cli(capsys, "report", healthy_run, "--out", empty)[0] == 0   # ampdoctor's own directory: replaced


def test_unusable_output_paths_are_one_line_exit_2(capsys, healthy_run, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "a_dir").mkdir()
    cases = [("--out", a_file, "not a directory"), ("--json", tmp_path / "a_dir", "is a directory"),
             ("--out", a_file / "sub", "not a directory"), ("--json", a_file / "r.json", "not a directory"),
             ("--tensorboard", a_file / "tb", "not a directory")]
    for flag, path, needle in cases:
        rc, _, err = cli(capsys, "report", healthy_run, flag, path, *(["--no-html"] if flag != "--out" else []))
        one_line_2(rc, err, needle)
    assert a_file.read_text() == "x"


def test_default_reports_dir_unwritable(capsys, healthy_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").write_text("a file where the reports directory would go")
    rc, _, err = cli(capsys, "report", healthy_run)
    one_line_2(rc, err, "reports")


def test_replay_fixture_with_factory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, _, err = cli(capsys, "replay", "fixtures/captures/t5_ffn_overflow", "--model", "fixtures.models:t5_block",
                     "--out", tmp_path / "rep", "--json", tmp_path / "rep.json")
    assert rc == 1, err
    d = json.loads((tmp_path / "rep.json").read_text())
    assert (d["findings"][0]["rule"], d["findings"][0]["module"]) == ("overflow", "ff.wo")
    rc, _, err = cli(capsys, "replay", "fixtures/captures/t5_ffn_overflow", "--model", "fixtures.models:nope")
    one_line_2(rc, err, "no attribute")


def test_doctor_and_help(capsys, tmp_path):
    rc, out, _ = cli(capsys, "doctor")
    assert rc == 0 and "CPU" in out
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 1e-4},
                               "bf16": {"enabled": True}}))
    assert cli(capsys, "doctor", "--deepspeed", cfg, "--json", tmp_path / "d.json")[0] == 1
    msgs = " ".join(f["message"] for f in json.loads((tmp_path / "d.json").read_text())["findings"])
    assert "Both fp16 and bf16" in msgs and "static loss scale" in msgs and "min_loss_scale" in msgs
    (tmp_path / "bad.json").write_text("{")
    assert cli(capsys, "doctor", "--deepspeed", tmp_path / "bad.json")[0] == 2
    rc, out, _ = cli(capsys, "--help")
    assert rc == 0 and "report" in out


def test_report_with_model_replays_the_capture_to_name_the_op(capsys, tmp_path, monkeypatch):
    """A transient overflow on an unsampled step, no scaler: the records alone do not know the layer. The watch
    replayed its capture at close and saved that replay in the run dir, so `report RUN_DIR` names the layer and
    the op as `w.report()` does; without the saved replay (a run dir from before it was saved), --model replays
    the capture and names them."""
    import ampdoctor
    monkeypatch.chdir(ROOT)
    torch.manual_seed(0)
    m = __import__("fixtures.models", fromlist=["mlp"]).mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    rd = tmp_path / "run"
    with ampdoctor.watch(m, opt, run_dir=rd):
        for i in range(6):
            opt.zero_grad()
            x = torch.randn(4, 8) * (1e5 if i == 4 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            if torch.isfinite(loss):
                loss.backward()
                opt.step()
    assert cli(capsys, "report", rd, "--json", tmp_path / "saved.json", "--no-html")[0] == 1
    f = json.loads((tmp_path / "saved.json").read_text())["findings"][0]
    assert (f["rule"], f["module"], f["step"]) == ("overflow", "0", 4) and f["op"]
    (rd / "replay-0.json").unlink()
    assert cli(capsys, "report", rd, "--json", tmp_path / "plain.json", "--no-html")[0] == 1
    assert json.loads((tmp_path / "plain.json").read_text())["findings"][0]["module"] is None
    rc, _, err = cli(capsys, "report", rd, "--model", "fixtures.models:mlp", "--json", tmp_path / "r.json",
                     "--no-html")
    assert rc == 1, err
    f = json.loads((tmp_path / "r.json").read_text())["findings"][0]
    assert (f["rule"], f["module"], f["step"]) == ("overflow", "0", 4) and f["op"]
    rc, _, err = cli(capsys, "report", rd, "--model", "fixtures.models:t5_block", "--no-html")
    assert rc == 2 and ("does not match" in err or "replaying" in err), err
    assert err.strip().count("\n") == 0


def test_end_to_end_command_and_closed_pipe(broken_run):
    """The real command in a shell pipeline whose reader is gone before the report is printed (`| true`, as
    `| head -3` after its lines): no BrokenPipeError traceback, and the exit code is the report's."""
    cmd = f"{sys.executable} -m ampdoctor report {broken_run} --no-html | true; exit ${{PIPESTATUS[0]}}"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.returncode == 1, p.stderr   # the report's exit code (an error finding), not a crash


def test_report_reads_a_run_without_importing_torch(broken_run, tmp_path):
    """`ampdoctor report RUN` reads JSON records: it answers without loading torch (~1.5 s of start-up on a 2-core
    machine), and still writes the JSON, the HTML and the plot PNGs beside it."""
    code = "import sys, ampdoctor.cli as c; rc = c.main(sys.argv[1:]); print('torch' in sys.modules); sys.exit(rc)"
    p = subprocess.run([sys.executable, "-c", code, "report", str(broken_run), "--json", str(tmp_path / "r.json"),
                        "--out", str(tmp_path / "html")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 1, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "False", p.stdout[-300:]
    assert json.loads((tmp_path / "r.json").read_text())["findings"][0]["module"] == "1"
    assert any(n.endswith(".png") for n in os.listdir(tmp_path / "html")), os.listdir(tmp_path / "html")
