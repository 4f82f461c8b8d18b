"""A hostile tester's fourth round: bad input at the command line (real `python -m ampdoctor` subprocesses) and at the
Python API (`ampdoctor.diagnose`, `replay`, `save_batch`, `watch`), on a run directory and a capture written by a real
`ampdoctor.watch(run_dir=...)` run of a tiny MLP whose first Linear overflows fp16 at step 4 (its input x 1e5; an
independent forward hook sees `0`'s output turn non-finite at that step only; its capture: `captures/4`).

The standard (docs/CONTRACT.md "CLI"): bad input (a corrupt or foreign capture or run dir, a model that does not match
the capture, an unusable output path) gets ONE `ampdoctor: ...` line on stderr, exit code 2, no traceback; nothing that
existed is lost or overwritten (every probe hashes what was there before and after). What test_hostile_cli2.py,
test_hostile_capture.py, test_hostile_rundir.py, test_hostile_inputs3.py, test_capture*.py, test_cli*.py and
test_watch*.py already probe is not repeated here. The CLI calls run once, on a pool of 3 (module fixture `cli`).

Captures and run directories (`ampdoctor replay CAPTURE` / `ampdoctor report RUN_DIR`):
 1. CAPTURE / RUN_DIR given as a symbolic-link loop (a -> b -> a): one line naming the path, nothing written.
 2. a capture whose tensors.safetensors was cut in half (a copy that died mid-way), replayed with --json onto the
    user's previous report file and --out into the directory of an earlier ampdoctor report: one line naming the
    file; the previous JSON and HTML report stay byte-identical.
 3. steps.jsonl whose first three records are intact and whose tail is 4 KiB of NUL bytes (what a journaling file
    system leaves of data blocks allocated but never written before a power cut; the manifest's writer process is one
    that started before the reboot, i.e. gone): a report of the 3 readable steps that does not call the run healthy,
    or one line.
 4. a record of a future schema (`"schema": 2`, its `modules` a dict keyed by module name instead of a list; step 0,
    a sampled step), the other records intact: one line, or the report of the intact records (the overflow at `0`, step 4).
 5. huge integers, valid JSON that Python reads exactly: a record whose step is 2**64, reported with --tensorboard;
    a record whose loss is 10**400, reported with the HTML report.
 6. `--json` whose file name is 300 bytes long (ENAMETOOLONG): one line naming --json.
 7. `--json` under a dangling symbolic link (`dangling/sub/r.json`, dangling -> a path that does not exist): one line;
    no directory is made at the link's target.
 8. `--out` naming a directory that holds nothing but a `.git/` (looks empty to `ls`): refused, pointing at --force.
 9. `--out DIR --force` where DIR holds the user's notes.txt and plots/mine.png: the report is written, the user's
    files (ones ampdoctor does not write) are kept byte-identical.
Models and losses (`replay CAPTURE --model ... --loss ...`, `ampdoctor.replay(model=...)`):
10. a model factory returning `torch.jit.script(mlp())` (same parameter names as the capture), through the CLI and
    through `ampdoctor.replay(model=...)`: one line / BadInput (watch() itself refuses a scripted root, see
    test_watch_safety.py).
11. a model factory whose model has one extra buffer (`0.calib`) the capture does not hold: one line naming it.
12. `--loss` returning `(loss, {"mse": ...})` (a common pattern of losses that also log): one line saying a scalar is
    needed.
13. a model factory that raises SystemExit(0) when called (not at import: test_hostile_capture.py has that): one line
    and exit 2, never the 0 that means "no errors".
The Python API, live:
14. `ampdoctor.diagnose(run_dir)` in the training process while its watch is still writing that run dir: the steps
    recorded so far, the bad step an error once its record is on disk, no word of a crash, the run dir untouched by the
    reading, and the watch's own report afterwards still names the overflow at `0`, step 3.
15. `watch()` on a model whose submodule is already watched by another open watch: refused with one line, or both
    watches report the overflow at their own names for the layer (`0` / `0.0`) and closing both leaves no hook.
16. `ampdoctor.save_batch(run_dir, ...)`: the user named the run directory instead of a capture path: refused (or an
    OSError), the run dir's files unchanged and still diagnosable.
Control: the intact capture replays the overflow at `0`, step 4 (`ampdoctor.replay`); the intact run dir's CLI report
(case 9) names it too (exit 1).

What ampdoctor got wrong (strict xfails first, fixed since):
 5. a step of 2**64 (+ --tensorboard: a ValueError traceback from SummaryWriter's int64 step) and a loss of 10**400
    (+ HTML: an OverflowError traceback from float()) passed records._check_scalars: integers at or beyond 2**53 are
    now refused as a corrupt record (one line, exit 2).
10. a scripted model: a RuntimeError traceback from replay/optrace.py's module hooks (`register_forward_pre_hook is
    not supported on ScriptModules`); replay/modelio.py build_model now refuses a ScriptModule (or one holding one)
    with BadInput.
16. save_batch(run_dir) replaced the run's manifest.json with a capture manifest (the run was lost): save_batch now
    writes only into a new or empty directory or over an earlier capture.
"""
import json
import os

import pytest
import torch
import torch.nn as nn

import ampdoctor
from probe_harness import (case_registry, copy, edit_record, error_line, finite_oracle, load_models, no_traceback,
                           one_line_or_report, overflow_run, records_raw, run_cases, snapshot, strict_json,
                           train_overflow, write_raw)

MODELS = "ad_h4_models"

MODELS_SRC = '''
import torch
import torch.nn as nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def scalar_loss(out, *args, **kwargs):
    return out.float().pow(2).mean()


def tuple_loss(out, *args, **kwargs):
    loss = out.float().pow(2).mean()
    return loss, {"mse": loss.detach()}


def scripted():
    return torch.jit.script(mlp())


def with_buffer():
    m = mlp()
    m[0].register_buffer("calib", torch.ones(16))
    return m


def exits0():
    raise SystemExit(0)
'''


# ------------------------------------------------------------------------------------------------ helpers
def first_finding(path):
    f0 = strict_json(path)["findings"][0]
    return f0["rule"], f0["module"], f0["step"]


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("h4helpers")
    return {"dir": str(d), "models": load_models(d, MODELS, MODELS_SRC)}


@pytest.fixture(scope="module")
def base_run(helpers, tmp_path_factory):
    """A real watch, no GradScaler: the MLP's first Linear overflows fp16 at step 4; the watch writes captures/4."""
    return overflow_run(helpers["models"], str(tmp_path_factory.mktemp("h4run") / "run"))


CASES, case = case_registry()


@pytest.fixture(scope="module")
def cli(helpers, base_run, tmp_path_factory):
    """Every CLI call of this module, set up by the `case` builders below and run on a pool of 3; {name: ctx} with
    ctx["p"] the CompletedProcess, ctx["before"]/ctx["after"] the snapshots of what the case guards, ctx["cwd"] an
    empty cwd."""
    return run_cases(CASES, helpers, base_run, tmp_path_factory.mktemp("h4cli"), after_each=True)


def _cap(base_run, d, name="cap"):
    return copy(os.path.join(base_run, "captures", "4"), d / name)


# ------------------------------------------------------------------------------------------------ the CLI cases
def _loop(d):
    a, b = d / "loop_a", d / "loop_b"
    os.symlink(b, a)
    os.symlink(a, b)
    with pytest.raises(OSError):                                  # ELOOP: really a loop
        os.stat(a)
    return a


@case
def loop_capture(helpers, base_run, d, ctx):
    a = _loop(d)
    return {"guard": [d], "loop": a, "argv": ["replay", a, "--model", f"{MODELS}:mlp", "--quick", "--json",
                                              d / "r.json"]}


@case
def loop_run(helpers, base_run, d, ctx):
    a = _loop(d)
    return {"guard": [d], "loop": a, "argv": ["report", a, "--json", d / "r.json", "--tensorboard", d / "tb"]}


@case
def truncated_tensors(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    fp = os.path.join(cap, "tensors.safetensors")
    with open(fp, "rb") as f:
        raw = f.read()
    with open(fp, "wb") as f:
        f.write(raw[: len(raw) // 2])
    prev_json = d / "previous.json"
    prev_json.write_text('{"findings": [], "note": "yesterday\'s report"}\n')
    out = d / "out"
    out.mkdir()
    (out / ".ampdoctor.out").write_text("written by ampdoctor\n")
    (out / "index.html").write_text("<html>the previous report</html>\n")
    return {"guard": [cap, prev_json, out],
            "argv": ["replay", cap, "--model", f"{MODELS}:mlp", "--quick", "--json", prev_json, "--out", out]}


@case
def nul_tail(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    lines = records_raw(rd)
    assert [json.loads(ln)["step"] for ln in lines[:3]] == [0, 1, 2]
    write_raw(rd, lines[:3] + [b"\0" * 4096])
    mp = os.path.join(rd, "manifest.json")          # the writer is gone: its process started before the reboot
    with open(mp) as f:
        man = json.load(f)
    proc = man["runs"][0]["meta"]["process"]
    assert proc["pid"] == os.getpid() and isinstance(proc["start"], int), proc
    proc["start"] -= 1
    with open(mp, "w") as f:
        json.dump(man, f)
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", d / "r.json"]}


@case
def future_schema(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    rec = json.loads(records_raw(rd)[0])
    assert rec["step"] == 0 and isinstance(rec["modules"], list) and rec["modules"]     # (a sampled step)
    edit_record(rd, 0, schema=2, modules={mc["module"]: mc for mc in rec["modules"]})
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", d / "r.json"]}


@case
def huge_step_tensorboard(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    edit_record(rd, 2, step=2 ** 64)
    assert b'"step": 18446744073709551616' in b"".join(records_raw(rd))
    return {"guard": [rd], "outs": [d / "r.json", d / "tb"],
            "argv": ["report", rd, "--no-html", "--json", d / "r.json", "--tensorboard", d / "tb"]}


@case
def huge_loss_html(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    edit_record(rd, 2, loss=10 ** 400)
    with pytest.raises(OverflowError):
        float(json.loads(records_raw(rd)[2])["loss"])             # exact in JSON and Python, no float holds it
    return {"guard": [rd], "outs": [d / "r.json", d / "html" / "index.html"],
            "argv": ["report", rd, "--out", d / "html", "--json", d / "r.json"]}


@case
def long_json_name(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    return {"guard": [rd, d / "cwd"], "argv": ["report", rd, "--no-html", "--json", d / ("x" * 300 + ".json")]}


@case
def json_under_dangling_link(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    os.symlink(d / "nowhere", d / "dangling")
    assert os.path.islink(d / "dangling") and not os.path.exists(d / "dangling")
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", d / "dangling" / "sub" / "r.json"]}


@case
def out_dotgit_only(helpers, base_run, d, ctx):
    out = d / "site"
    (out / ".git").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert [n for n in os.listdir(out) if not n.startswith(".")] == []     # `ls` shows nothing
    return {"guard": [out, base_run], "out": out, "argv": ["report", base_run, "--out", out]}


@case
def out_force_keeps_foreign(helpers, base_run, d, ctx):
    out = d / "mine"
    (out / "plots").mkdir(parents=True)
    (out / "notes.txt").write_text("the user's notes\n")
    (out / "plots" / "mine.png").write_bytes(b"\x89PNG the user's own plot")
    return {"guard": [base_run], "out": out, "theirs": snapshot(out / "notes.txt", out / "plots" / "mine.png"),
            "argv": ["report", base_run, "--out", out, "--force", "--json", d / "r.json"]}


@case
def model_scripted(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    sm = helpers["models"].scripted()
    assert isinstance(sm, torch.jit.ScriptModule)
    assert set(sm.state_dict()) == set(helpers["models"].mlp().state_dict())   # the weights would load
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:scripted", "--quick", "--no-html",
                                     "--json", d / "r.json"]}


@case
def model_extra_buffer(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    extra = set(helpers["models"].with_buffer().state_dict()) - set(helpers["models"].mlp().state_dict())
    assert extra == {"0.calib"}
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:with_buffer", "--quick", "--no-html",
                                     "--json", d / "r.json"]}


@case
def loss_tuple(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    out = helpers["models"].tuple_loss(torch.ones(4, 1))
    assert isinstance(out, tuple) and out[0].numel() == 1             # a scalar, wrapped in a tuple
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:mlp", "--loss", f"{MODELS}:tuple_loss",
                                     "--quick", "--no-html", "--json", d / "r.json"]}


@case
def factory_exits0(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    with pytest.raises(SystemExit) as e:
        helpers["models"].exits0()
    assert e.value.code == 0
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:exits0", "--quick", "--no-html", "--json",
                                     d / "r.json"]}


# ======================================================================================== control
def test_control_intact_capture_replays_the_overflow(helpers, base_run):
    """(In-process, through the public API; test_hostile_inputs3 has the CLI replay of such a capture as its control.)"""
    cap = os.path.join(base_run, "captures", "4")
    before = snapshot(cap)
    rep = ampdoctor.replay(cap, model=helpers["models"].mlp(), loss_fn=helpers["models"].scalar_loss, shadow=False,
                           whatif=False, fix_search=False)
    f0 = rep.findings[0]
    assert (f0.rule, f0.module, f0.step, f0.severity) == ("overflow", "0", 4, "error"), f0.to_dict()
    assert snapshot(cap) == before


# ======================================================================================== captures and run dirs
@pytest.mark.parametrize("name", ["loop_capture", "loop_run"])
def test_01_symlink_loop_as_capture_or_run_dir(cli, name):
    ctx = cli[name]
    line = error_line(ctx["p"])
    assert str(ctx["loop"]) in line, line
    assert ctx["after"] == ctx["before"]                          # no r.json, no tb/, the links as they were
    assert os.listdir(ctx["cwd"]) == []


def test_02_truncated_tensors_file_keeps_the_previous_outputs(cli):
    ctx = cli["truncated_tensors"]
    line = error_line(ctx["p"])
    assert "tensors.safetensors" in line, line
    assert ctx["after"] == ctx["before"]                          # yesterday's JSON and HTML report untouched
    assert os.listdir(ctx["cwd"]) == []


def test_03_nul_filled_tail_of_the_records(cli):
    ctx = cli["nul_tail"]
    p = ctx["p"]
    assert ctx["after"] == ctx["before"]
    no_traceback(p)
    if p.returncode == 2:
        line = error_line(p)
        assert "steps.jsonl" in line, line
        return
    assert p.returncode in (0, 1), p.stderr[-2000:]
    d = strict_json(ctx["dir"] / "r.json")
    assert d["summary"]["steps"] == 3, d["summary"]
    assert "healthy" not in p.stdout.lower(), p.stdout[-1500:]   # 4 KiB of the run unreadable: not a healthy run


def test_04_record_of_a_future_schema(cli):
    ctx = cli["future_schema"]
    p = ctx["p"]
    assert ctx["after"] == ctx["before"]
    if one_line_or_report(p) == "refused":
        assert "steps.jsonl" in error_line(p)
        return
    assert p.returncode == 1, p.stdout[-1500:]
    assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)


@pytest.mark.parametrize("name", [
    "huge_step_tensorboard",
    "huge_loss_html",
])
def test_05_huge_integers_in_the_records(cli, name):
    ctx = cli[name]
    assert ctx["after"] == ctx["before"]
    one_line_or_report(ctx["p"], ctx["outs"])


def test_06_json_file_name_too_long(cli):
    ctx = cli["long_json_name"]
    line = error_line(ctx["p"])
    assert "--json" in line and "too long" in line.lower(), line
    assert ctx["after"] == ctx["before"]
    assert sorted(os.listdir(ctx["dir"])) == ["cwd", "run"]


def test_07_json_under_a_dangling_symlink(cli):
    ctx = cli["json_under_dangling_link"]
    line = error_line(ctx["p"])
    assert "--json" in line, line
    assert ctx["after"] == ctx["before"]
    assert not os.path.lexists(ctx["dir"] / "nowhere")            # nothing made at the link's target
    assert os.path.islink(ctx["dir"] / "dangling")


def test_08_out_into_a_directory_holding_only_dot_git(cli):
    ctx = cli["out_dotgit_only"]
    line = error_line(ctx["p"])
    assert "--force" in line and str(ctx["out"]) in line, line
    assert ctx["after"] == ctx["before"]


def test_09_out_force_keeps_the_users_other_files(cli):
    ctx = cli["out_force_keeps_foreign"]
    p = ctx["p"]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)       # the intact run dir's report
    out = ctx["out"]
    assert "overflow" in (out / "index.html").read_text(encoding="utf-8")
    assert snapshot(out / "notes.txt", out / "plots" / "mine.png") == ctx["theirs"]
    assert ctx["after"] == ctx["before"]


# ======================================================================================== models and losses
def test_10_scripted_model_via_the_cli(cli):
    ctx = cli["model_scripted"]
    assert ctx["after"] == ctx["before"]
    line = error_line(ctx["p"])
    assert "TorchScript" in line or "ScriptModule" in line or "script" in line.lower(), line


def test_10_scripted_model_via_the_api(helpers, base_run):
    cap = os.path.join(base_run, "captures", "4")
    before = snapshot(cap)
    sm = helpers["models"].scripted()
    from ampdoctor.errors import BadInput
    try:
        with pytest.raises(Exception) as e:
            ampdoctor.replay(cap, model=sm, shadow=False, whatif=False, fix_search=False)
    finally:
        assert snapshot(cap) == before
    assert isinstance(e.value, BadInput), repr(e.value)
    assert "\n" not in str(e.value)


def test_11_model_with_an_extra_buffer(cli):
    ctx = cli["model_extra_buffer"]
    line = error_line(ctx["p"])
    assert "0.calib" in line, line
    assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()


def test_12_loss_returning_a_tuple(cli):
    ctx = cli["loss_tuple"]
    line = error_line(ctx["p"])
    assert "tuple" in line and "scalar" in line, line
    assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()


def test_13_factory_raising_system_exit_0_is_not_a_clean_exit(cli):
    ctx = cli["factory_exits0"]
    line = error_line(ctx["p"])                                   # exit 2, not the factory's 0
    assert "exits0" in line and "SystemExit" in line, line
    assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()


# ======================================================================================== the Python API, live
def test_14_diagnose_a_run_dir_while_its_watch_is_writing(helpers, tmp_path):
    rd = str(tmp_path / "live")
    torch.manual_seed(1)
    m = helpers["models"].mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    finite, hook = finite_oracle(m[0])
    mid = {}

    def read_now(i):
        if i in (1, 5):
            before = snapshot(rd)
            rep = ampdoctor.diagnose(rd)
            assert snapshot(rd) == before                         # reading never writes into a live run dir
            mid[i] = rep

    with ampdoctor.watch(m, opt, run_dir=rd) as w:
        train_overflow(m, opt, bad_step=3, steps=7, after_step=read_now)
        hook.remove()
    assert finite == [True, True, True, False, True, True, True]  # the overflow is real, in `0`, at step 3 only
    early, late = mid[1], mid[5]
    assert 1 <= early.summary["steps"] <= 2 and early.exit_code == 0, early.summary
    assert not [f for f in early.findings if f.severity in ("warning", "error")], early.findings
    assert 4 <= late.summary["steps"] <= 6, late.summary
    assert late.exit_code == 1
    top = [f for f in late.findings[:3] if f.severity == "error"]
    assert any(f.step == 3 and f.module in ("0", None) for f in top), [f.to_dict() for f in late.findings[:3]]
    for rep in (early, late):                                     # the writer is alive: no crash, no kill
        s = json.dumps(rep.to_dict()["summary"]).lower()
        assert not rep.summary.get("crash") and "killed" not in s and "crashed" not in s, rep.summary
    for rep in (w.report(), ampdoctor.diagnose(rd)):
        f0 = rep.findings[0]
        assert (f0.rule, f0.module, f0.step, f0.severity) == ("overflow", "0", 3, "error"), f0.to_dict()


def test_15_watch_a_model_whose_submodule_is_already_watched(helpers):
    torch.manual_seed(2)
    inner = helpers["models"].mlp()
    outer = nn.Sequential(inner)
    opt = torch.optim.SGD(outer.parameters(), lr=1e-3)
    w1 = ampdoctor.watch(inner, opt)
    try:
        w2 = ampdoctor.watch(outer, opt)
    except Exception as e:                                        # refused: one line, and the first watch intact
        assert "\n" not in str(e) and str(e), repr(e)
        w2 = None
    finite, hook = finite_oracle(inner[0])
    try:
        train_overflow(outer, opt, bad_step=3, steps=6)
    finally:
        hook.remove()
        if w2 is not None:
            w2.close()
        w1.close()
    assert finite == [True, True, True, False, True, True]
    leftover = [n for n, x in outer.named_modules() if x._forward_hooks or x._forward_pre_hooks or x._backward_hooks
                or getattr(x, "_backward_pre_hooks", None)]
    assert leftover == [], leftover
    for w, name in ((w1, "0"), (w2, "0.0")):
        if w is None:
            continue
        f0 = w.report().findings[0]
        assert (f0.rule, f0.module, f0.step, f0.severity) == ("overflow", name, 3, "error"), f0.to_dict()


def test_16_save_batch_into_a_run_dir_is_refused(helpers, base_run, tmp_path):
    from ampdoctor.errors import BadInput
    rd = copy(base_run, tmp_path / "run")
    expected = [(f.rule, f.module, f.step) for f in ampdoctor.diagnose(rd).findings]
    before = snapshot(rd)
    torch.manual_seed(3)
    try:
        ampdoctor.save_batch(rd, helpers["models"].mlp(), torch.randn(4, 8))
    except (BadInput, OSError) as e:
        assert "\n" not in str(e), str(e)
    after = snapshot(rd)
    assert after == before, sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k))
    assert [(f.rule, f.module, f.step) for f in ampdoctor.diagnose(rd).findings] == expected
