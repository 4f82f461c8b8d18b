"""The command line: exit codes 0/1/2, one-line errors, nothing overwritten, reports written where asked."""
import json
import os
import subprocess
import sys

import pytest
import torch

from scenarios import TinyGPT, gpt_batch, hf_loss, mse_to_zero, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ampdoctor", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd or ROOT)


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


def test_report_healthy_exit_0_writes_json_html_tensorboard(healthy_run, tmp_path):
    p = cli("report", healthy_run, "--out", tmp_path / "html", "--json", tmp_path / "r.json",
            "--tensorboard", tmp_path / "tb")
    assert p.returncode == 0, p.stderr
    assert "Healthy" in p.stdout or "healthy" in p.stdout
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["findings"] == [] or all(f["severity"] == "info" for f in d["findings"])
    assert (tmp_path / "html" / "index.html").exists()
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "tb"))


def test_report_broken_exit_1_names_the_producer(broken_run, tmp_path):
    p = cli("report", broken_run, "--json", tmp_path / "r.json", "--no-html")
    assert p.returncode == 1, p.stderr
    d = json.loads((tmp_path / "r.json").read_text())
    assert (d["findings"][0]["rule"], d["findings"][0]["module"]) == ("overflow", "1")
    assert set(d) >= {"findings", "summary", "timeline"}


@pytest.mark.parametrize("args,needle", [
    (("report", "/nonexistent/run"), "no such run directory"),
    (("replay", "/nonexistent/cap"), "no such capture"),
    (("report",), "required"),
    (("frobnicate",), "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    p = cli(*args)
    assert p.returncode == 2
    assert needle in p.stderr and p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr


def test_unknown_rule_and_foreign_dir(healthy_run, tmp_path):
    p = cli("report", healthy_run, "--rules", "overflow,not_a_rule", "--no-html")
    assert p.returncode == 2 and "unknown rule" in p.stderr
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    p = cli("report", tmp_path / "foreign")
    assert p.returncode == 2 and "not an ampdoctor run directory" in p.stderr
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_out_never_deletes_user_files(healthy_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    assert cli("report", healthy_run, "--out", out).returncode == 0
    assert (out / "keep.txt").read_text() == "user data" and (out / "index.html").exists()


def test_replay_fixture_with_factory(tmp_path):
    p = cli("replay", "fixtures/captures/t5_ffn_overflow", "--model", "fixtures.models:t5_block", "--out",
            tmp_path / "rep", "--json", tmp_path / "rep.json")
    assert p.returncode == 1, p.stderr
    d = json.loads((tmp_path / "rep.json").read_text())
    assert (d["findings"][0]["rule"], d["findings"][0]["module"]) == ("overflow", "ff.wo")
    p = cli("replay", "fixtures/captures/t5_ffn_overflow", "--model", "fixtures.models:nope")
    assert p.returncode == 2 and "cannot import" in p.stderr


def test_doctor_and_help(tmp_path):
    p = cli("doctor")
    assert p.returncode == 0 and "CPU" in p.stdout
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 1e-4},
                               "bf16": {"enabled": True}}))
    p = cli("doctor", "--deepspeed", cfg, "--json", tmp_path / "d.json")
    assert p.returncode == 1
    msgs = " ".join(f["message"] for f in json.loads((tmp_path / "d.json").read_text())["findings"])
    assert "Both fp16 and bf16" in msgs and "static loss scale" in msgs and "min_loss_scale" in msgs
    (tmp_path / "bad.json").write_text("{")
    assert cli("doctor", "--deepspeed", tmp_path / "bad.json").returncode == 2
    assert cli("--help").returncode == 0


def test_report_with_model_replays_the_capture_to_name_the_op(tmp_path):
    """A transient overflow on an unsampled step, no scaler: on disk the layer is unknown; with --model the
    capture is replayed and the finding names the layer and the op."""
    import ampdoctor
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
    p = cli("report", rd, "--json", tmp_path / "plain.json", "--no-html")
    assert p.returncode == 1
    assert json.loads((tmp_path / "plain.json").read_text())["findings"][0]["module"] is None
    p = cli("report", rd, "--model", "fixtures.models:mlp", "--json", tmp_path / "r.json", "--no-html")
    assert p.returncode == 1, p.stderr
    f = json.loads((tmp_path / "r.json").read_text())["findings"][0]
    assert (f["rule"], f["module"], f["step"]) == ("overflow", "0", 4) and f["op"]
    p = cli("report", rd, "--model", "fixtures.models:t5_block", "--no-html")
    assert p.returncode == 2 and ("does not match" in p.stderr or "replaying" in p.stderr), p.stderr
    assert p.stderr.strip().count("\n") == 0
