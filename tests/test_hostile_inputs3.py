"""A hostile tester's third round at the command line (real `python -m ampdoctor` subprocesses, as the README's
"Command line" documents it) and at run directories and captures written by a real `ampdoctor.watch(run_dir=...)`
run of a tiny MLP whose first Linear overflows fp16 at step 4 (its capture: `captures/4`).

The standard (docs/CONTRACT.md "CLI", README "Command line"): bad input gets ONE clear `ampdoctor: ...` line on stderr
(warnings aside), no traceback, exit code 2; nothing that existed is lost or overwritten; a capture never runs code on
load. Every probe checks the exit code, the stderr lines and that the files that were there before are byte-identical
afterwards. The CLI calls of this module run once, on a small pool (module fixture `cli`); the tests read the results.
What test_hostile_capture.py, test_hostile_cli2.py, test_hostile_rundir.py, test_capture_fuzz.py, test_cli*.py and
test_replay_workflows.py already probe is not repeated here.

Run directories (`ampdoctor report RUN_DIR`):
 1. a records line that is valid JSON but a list, not an object: one line naming steps.jsonl and the line.
 2. a record whose step number is a string ("2"), reported with --json/--out/--tensorboard under directories that do
    not exist yet: one line, and none of those directories is created (the refusal comes after the output checks).
 3. a record whose step is a NaN literal (Python's json writes and reads it), with --tensorboard.
 4. a record whose grad_norm is a non-numeric string, with --tensorboard.
 5. a record whose step is an Infinity literal, with the HTML report.
 6. one flipped byte (a non-UTF-8 byte) inside the bad step's complete record, followed by the run's end line (bit
    rot, not a torn write): the run directory still holds that step's capture and the saved replay's overflow; the
    report must not call the run healthy.
 7. `--json ""` (an unset shell variable): a usage error, not a silently missing JSON report.
 8. `--out ""`: a usage error, not a report written somewhere else (./reports/<name>/).
 9. `--json` naming a hard link to another of the user's files: the other name keeps its bytes.
10. `report --model` with a factory that raises (a two-line message): one line, the first.
11. a 15,000-step run without a GradScaler (bf16-style, every step routine) is diagnosed in linear time: no more
    than 3x (+2 s) the time of the same records from a watch that saw a disabled GradScaler (in-process,
    `ampdoctor.diagnose`, the public API).
Captures (`ampdoctor replay CAPTURE`):
12. the capture's tensors saved as a legacy (non-zip) torch.save pickle `tensors.pt` whose payload runs a command when
    unpickled: refused by torch.load(weights_only=True), one line, the command never runs; the same file holding
    plain tensors replays (so the .pt path is really reached).
13. a capture whose scaler state holds an infinite loss scale (a finite forward, a backward that overflows at it).
14. a capture whose CPU RNG state is a 1-D uint8 tensor of the wrong size.
15. `--model` whose factory builds a module with the capture's parameters but a forward that takes two arguments.
Controls: the intact run dir reports the overflow at `0`, step 4 (exit 1); the intact capture replays it (exit 1).

What ampdoctor got wrong (strict xfails; all fixed since: records.StepRecord.from_dict checks its scalar fields' types
(a step of "2", NaN or Infinity, a grad_norm of "x" are one line, exit 2); rundir.read_run reads a complete line
with a byte that is not UTF-8 (replaced) instead of dropping it as torn; cli refuses an empty --json/--out/
--tensorboard path; RunData.has_scaler keeps its scan; capture.load_capture checks a CPU RNG state with torch's own
generator and the manifest's scaler numbers):
 3. step NaN + --tensorboard: a ValueError traceback from torch's SummaryWriter (`cannot convert float NaN to integer`),
    exit 1 (Python's crash code), a partial events file left behind. ampdoctor/cli.py _cmd_report wraps
    report/tensorboard.py write_tensorboard in `except OSError` only; read_run/StepRecord.from_dict accept any JSON
    value as `step`, and diagnose_run_dir's own guard (analysis/merging.py) ends before the reporters run.
 4. grad_norm "x" + --tensorboard: ValueError traceback from report/tensorboard.py step_scalars (`float(v)` on
    rec.grad_norm), the same unguarded call in cli._cmd_report.
 5. step Infinity + HTML: ValueError traceback from report/plots.py _timeline (`int(r["step"])` on the report's
    "inf"), reached through report/html.py write_html -> _plots -> plots.render, which cli._write calls outside any
    guard but `except OSError` (only the separate PNG files, write_plots, are guarded); the --json file was already
    written when it crashed.
 6. the flipped byte: "Healthy: no problems found in 4 step(s)", exit 0. rundir.read_run skips a line that fails to
    decode (`except (ValueError, UnicodeDecodeError, RecursionError): bad += 1; continue`) like a torn one, refuses
    only when no line is readable, and the count of skipped lines reaches no report; with step 4's record gone
    analysis/merging.py _with_saved_replay drops the saved replay (pick_capture finds no step naming captures/4).
 7. `--json ""`: exit 1, no JSON written, nothing said: cli.py tests `if getattr(args, "json", None)` and
    `if args.json:`, so an empty path counts as "not given".
 8. `--out ""`: the report is written to ./reports/run/: cli._write uses `args.out or _default_out(src)` (and
    _check_outputs the same), so an empty path silently becomes the default.
11. the 15,000 scaler-less steps take tens of seconds against under one for the disabled-scaler twin (quadratic):
    rules/registry.py RunData.has_scaler is a property that, when meta.scaler is empty, scans every step
    (`any(r.scale is not None for r in self.steps)`), and rules/underflow.py underflow and rules/outside.py unlocated
    read it inside their per-step loops: 2·N² generator steps (450 M at 15k steps; 10k took 16 s and 20k 62 s here,
    so a 100k-step bf16 run would take hours to report).
13. scale Infinity: an OverflowError traceback from replay/searches.py _scaler_search (`math.ceil(math.log(scale) /
    -math.log(backoff))`); _scale accepts any positive float (inf included) and capturecheck._check_manifest does not
    look inside `scaler`.
14. wrong-size RNG state: exit 0, "healthy: No mixed-precision problems found", the replay's summary headline
    "Healthy: the replayed step is finite" with `finite: false`, one info replay_error ("Expected a
    CPUGeneratorImplState of size 5056 ..."). capture.load_capture checks only that an RNG state is 1-D uint8;
    replay/modelio.py set_rng's RuntimeError is raised inside run_step, which replay/__init__.py _replay catches as
    a `forward_error` (a model that raised) instead of a corrupt capture.
"""
import hashlib
import json
import os
import shutil
import signal
import time

import pytest
import torch

import ampdoctor
from probe_harness import (case_registry, copy, edit_manifest, edit_record, error_line, load_models, no_traceback,
                           one_line_or_report, overflow_run, records_raw, run_cases, strict_json, write_raw)

MODELS = "ad_h3_models"

MODELS_SRC = '''
import torch
import torch.nn as nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def scalar_loss(out, *args, **kwargs):
    return out.float().pow(2).mean()


def raises():
    raise RuntimeError("the factory exploded\\nsecond line of the factory's error")


class TwoArgs(nn.Sequential):
    """mlp's parameters (0.weight, 0.bias, 2.weight, 2.bias), but forward(x, y)."""

    def forward(self, x, y):
        return super().forward(x) + y


def two_args():
    return TwoArgs(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
'''


class _Evil:
    """Unpickled, it runs a shell command that leaves a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


# ------------------------------------------------------------------------------------------------ helpers
def file_entry(path):
    with open(path, "rb") as f:
        return {"name": os.path.basename(path), "bytes": os.path.getsize(path),
                "sha256": hashlib.sha256(f.read()).hexdigest()}


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("h3helpers")
    return {"dir": str(d), "models": load_models(d, MODELS, MODELS_SRC)}


@pytest.fixture(scope="module")
def base_run(helpers, tmp_path_factory):
    """A real watch, no GradScaler: the MLP's first Linear overflows fp16 at step 4 (its input x 1e5); the watch
    writes captures/4 and replays it at close (replay-0.json)."""
    rd = overflow_run(helpers["models"], str(tmp_path_factory.mktemp("h3run") / "run"))
    assert os.path.isfile(os.path.join(rd, "replay-0.json"))
    return rd


CASES, case = case_registry()


@pytest.fixture(scope="module")
def cli(helpers, base_run, tmp_path_factory):
    """Every CLI call of this module, set up by the `case` builders below and run on a pool of 3; {name: ctx} with
    ctx["p"] the CompletedProcess, ctx["before"] the snapshot of what the case guards, ctx["cwd"] an empty cwd."""
    return run_cases(CASES, helpers, base_run, tmp_path_factory.mktemp("h3cli"))


# ------------------------------------------------------------------------------------------------ the cases
@case
def intact_report(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", d / "r.json"]}


@case
def intact_replay(helpers, base_run, d, ctx):
    cap = copy(os.path.join(base_run, "captures", "4"), d / "cap")
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:mlp", "--quick", "--no-html", "--json",
                                     d / "r.json"]}


@case
def list_line(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    lines = records_raw(rd)
    assert json.loads(lines[2])["step"] == 2
    lines[2] = b"[1, 2, 3]\n"
    write_raw(rd, lines)
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", d / "r.json"]}


@case
def step_string(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    edit_record(rd, 2, step="2")
    new = d / "cwd" / "new"
    return {"guard": [rd], "new": new,
            "argv": ["report", rd, "--json", new / "a" / "r.json", "--out", new / "html", "--tensorboard", new / "tb"]}


@case
def step_nan_tensorboard(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    edit_record(rd, 2, step=float("nan"))
    assert b'"step": NaN' in b"".join(records_raw(rd))
    return {"guard": [rd], "outs": [d / "tb", d / "r.json"],
            "argv": ["report", rd, "--no-html", "--json", d / "r.json", "--tensorboard", d / "tb"]}


@case
def grad_norm_string_tensorboard(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    edit_record(rd, 0, grad_norm="x")
    return {"guard": [rd], "outs": [d / "tb", d / "r.json"],
            "argv": ["report", rd, "--no-html", "--json", d / "r.json", "--tensorboard", d / "tb"]}


@case
def step_inf_html(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    edit_record(rd, 2, step=float("inf"))
    assert b'"step": Infinity' in b"".join(records_raw(rd))
    return {"guard": [rd], "outs": [d / "html" / "index.html", d / "r.json"],
            "argv": ["report", rd, "--out", d / "html", "--json", d / "r.json"]}


@case
def bit_flip(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    lines = records_raw(rd)
    rec = json.loads(lines[4])
    assert rec["step"] == 4 and rec["capture"] and json.loads(lines[5]) == {"run": 0, "end": True}
    key = b'"autocast":"cpu:float16"'
    assert lines[4].count(key) == 1 and lines[4].endswith(b"\n")
    lines[4] = lines[4].replace(key, b'"autocast":"cpu:float16\xff"')
    with pytest.raises(UnicodeDecodeError):
        lines[4].decode("utf-8")
    assert json.loads(lines[4].replace(b"\xff", b""))["capture"] == rec["capture"]   # one byte from a good record
    write_raw(rd, lines)
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", d / "r.json"]}


@case
def json_empty(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", ""]}


@case
def out_empty(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    return {"guard": [rd], "argv": ["report", rd, "--out", ""]}


@case
def json_hard_link(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    precious = d / "precious.txt"
    precious.write_text("the user's notes, also reachable as r.json\n")
    os.link(precious, d / "r.json")
    assert os.stat(precious).st_nlink == 2
    return {"guard": [rd], "precious": precious, "argv": ["report", rd, "--no-html", "--json", d / "r.json"]}


@case
def report_model_raises(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    os.unlink(os.path.join(rd, "replay-0.json"))
    return {"guard": [rd, d / "cwd"], "argv": ["report", rd, "--model", f"{MODELS}:raises", "--no-html", "--json",
                                               d / "r.json"]}


def _tensors_pt(base_run, d, name, evil_marker=None):
    """A copy of captures/4 whose tensors live in a legacy (non-zip) torch.save file `tensors.pt`."""
    from safetensors.torch import load as st_load
    cap = copy(os.path.join(base_run, "captures", "4"), d / name)
    with open(os.path.join(cap, "tensors.safetensors"), "rb") as f:
        tensors = st_load(f.read())
    obj = dict(tensors)
    if evil_marker is not None:
        obj["payload"] = _Evil(evil_marker)
    pt = os.path.join(cap, "tensors.pt")
    torch.save(obj, pt, _use_new_zipfile_serialization=False)
    os.unlink(os.path.join(cap, "tensors.safetensors"))
    with open(os.path.join(cap, "manifest.json")) as f:
        files = json.load(f)["files"]
    files["tensors"] = file_entry(pt)
    edit_manifest(cap, files=files)
    return cap


@case
def pickle_payload(helpers, base_run, d, ctx):
    marker = d / "PWNED"
    probe = d / "probe"
    torch.save({"x": _Evil(probe)}, d / "probe.pt", _use_new_zipfile_serialization=False)
    torch.load(d / "probe.pt", weights_only=False)
    assert probe.exists()                         # the payload really runs code when unpickled unprotected
    cap = _tensors_pt(base_run, d, "cap", marker)
    return {"guard": [cap], "marker": marker,
            "argv": ["replay", cap, "--model", f"{MODELS}:mlp", "--quick", "--no-html", "--json", d / "r.json"]}


@case
def plain_tensors_pt(helpers, base_run, d, ctx):
    cap = _tensors_pt(base_run, d, "cap")
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:mlp", "--quick", "--no-html", "--json",
                                     d / "r.json"]}


@case
def scale_inf(helpers, base_run, d, ctx):
    torch.manual_seed(1)
    m = helpers["models"].mlp()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        out = m(x)
        cap = ampdoctor.save_batch(d / "cap", m, x)
    assert bool(torch.isfinite(out).all())                      # the forward is finite; only the scale is not
    edit_manifest(cap, scaler={"scale": float("inf"), "growth_factor": 2.0, "backoff_factor": 0.5})
    with open(os.path.join(cap, "manifest.json")) as f:
        assert '"scale": Infinity' in f.read()
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:mlp", "--loss", f"{MODELS}:scalar_loss",
                                     "--quick", "--no-html", "--json", d / "r.json"]}


@case
def rng_wrong_size(helpers, base_run, d, ctx):
    from safetensors.torch import load as st_load, save as st_save
    cap = copy(os.path.join(base_run, "captures", "4"), d / "cap")
    fp = os.path.join(cap, "tensors.safetensors")
    with open(fp, "rb") as f:
        tensors = st_load(f.read())
    assert tensors["rng/cpu"].numel() == torch.get_rng_state().numel() != 16
    tensors["rng/cpu"] = torch.zeros(16, dtype=torch.uint8)        # 1-D uint8, as load_capture checks
    with open(fp, "wb") as f:
        f.write(st_save(tensors))
    with open(os.path.join(cap, "manifest.json")) as f:
        files = json.load(f)["files"]
    files["tensors"] = file_entry(fp)
    edit_manifest(cap, files=files)
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:mlp", "--quick", "--no-html", "--json",
                                     d / "r.json"]}


@case
def forward_signature(helpers, base_run, d, ctx):
    cap = copy(os.path.join(base_run, "captures", "4"), d / "cap")
    names = set(helpers["models"].two_args().state_dict())
    assert names == set(helpers["models"].mlp().state_dict())     # the weights load; the forward does not fit
    return {"guard": [cap], "argv": ["replay", cap, "--model", f"{MODELS}:two_args", "--quick", "--no-html", "--json",
                                     d / "r.json"]}


# ======================================================================================== controls
def test_controls_intact_run_and_capture_name_the_overflow(cli):
    for name in ("intact_report", "intact_replay"):
        ctx = cli[name]
        p = ctx["p"]
        assert p.returncode == 1 and "Traceback" not in p.stderr, (name, p.stderr[-2000:])
        f0 = strict_json(ctx["dir"] / "r.json")["findings"][0]
        assert (f0["rule"], f0["module"], f0["step"]) == ("overflow", "0", 4), (name, f0)
        assert ctx["after"] == ctx["before"]


# ======================================================================================== run directories
def test_01_record_that_is_a_json_list(cli):
    ctx = cli["list_line"]
    line = error_line(ctx["p"])
    assert "steps.jsonl" in line and ":3" in line, line
    assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()


def test_02_string_step_refused_before_any_output_directory_is_made(cli):
    ctx = cli["step_string"]
    line = error_line(ctx["p"])
    assert str(ctx["dir"] / "run") in line, line
    assert not ctx["new"].exists(), os.listdir(ctx["new"])
    assert os.listdir(ctx["cwd"]) == []
    assert ctx["after"] == ctx["before"]


def test_03_nan_step_with_tensorboard(cli):
    ctx = cli["step_nan_tensorboard"]
    assert ctx["after"] == ctx["before"]
    one_line_or_report(ctx["p"], ctx["outs"])


def test_04_non_numeric_grad_norm_with_tensorboard(cli):
    ctx = cli["grad_norm_string_tensorboard"]
    assert ctx["after"] == ctx["before"]
    one_line_or_report(ctx["p"], ctx["outs"])


def test_05_infinite_step_with_the_html_report(cli):
    ctx = cli["step_inf_html"]
    assert ctx["after"] == ctx["before"]
    one_line_or_report(ctx["p"], ctx["outs"])


def test_06_a_flipped_byte_in_the_bad_steps_record_is_not_healthy(cli):
    ctx = cli["bit_flip"]
    p = ctx["p"]
    assert ctx["after"] == ctx["before"]
    no_traceback(p)
    assert os.path.isdir(ctx["dir"] / "run" / "captures" / "4")      # the evidence is still in the run dir
    if p.returncode == 2:
        line = error_line(p)
        assert "steps.jsonl" in line, line
        return
    assert p.returncode == 1, (p.returncode, p.stdout[-1500:])
    assert "healthy" not in p.stdout.lower(), p.stdout[-1500:]


def test_07_empty_json_path_is_a_usage_error(cli):
    ctx = cli["json_empty"]
    assert ctx["after"] == ctx["before"] and os.listdir(ctx["cwd"]) == []
    line = error_line(ctx["p"])
    assert "--json" in line, line


def test_08_empty_out_path_is_a_usage_error(cli):
    ctx = cli["out_empty"]
    assert ctx["after"] == ctx["before"]
    assert os.listdir(ctx["cwd"]) == [], sorted(os.listdir(ctx["cwd"]))
    line = error_line(ctx["p"])
    assert "--out" in line, line


def test_09_json_onto_a_hard_link_leaves_the_other_name_alone(cli):
    ctx = cli["json_hard_link"]
    p = ctx["p"]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert ctx["precious"].read_text() == "the user's notes, also reachable as r.json\n"
    assert strict_json(ctx["dir"] / "r.json")["findings"][0]["rule"] == "overflow"
    assert ctx["after"] == ctx["before"]


def test_10_report_model_factory_that_raises(cli):
    ctx = cli["report_model_raises"]
    line = error_line(ctx["p"])
    assert "raises" in line and "exploded" in line and "second line" not in line, line
    assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()


def _long_run(base_run, rd, n, scaler_meta=None):
    """base_run's records, its routine step 1 repeated as steps 1..n-1 (what a long run without a GradScaler, e.g.
    bf16, writes between sampled steps), then the end line; `scaler_meta` replaces the run meta's (empty) scaler."""
    shutil.copytree(base_run, rd)
    lines = records_raw(rd)
    r0, r1 = json.loads(lines[0]), json.loads(lines[1])
    assert r0["step"] == 0 and r1["step"] == 1 and not r1["sampled"] and r1["scale"] is None
    r1.pop("headroom", None)
    a, b = json.dumps(r1, separators=(",", ":")).split('"step":1,')
    body = "".join(f'{a}"step":{i},{b}\n' for i in range(1, n))
    with open(os.path.join(rd, "steps.jsonl"), "w") as f:
        f.write(lines[0].decode() + body + json.dumps({"run": 0, "end": True}) + "\n")
    mp = os.path.join(rd, "manifest.json")
    with open(mp) as f:
        man = json.load(f)
    assert not man["runs"][0]["meta"]["scaler"]                    # base_run had no GradScaler
    if scaler_meta is not None:
        man["runs"][0]["meta"]["scaler"] = scaler_meta
        with open(mp, "w") as f:
            json.dump(man, f)
    return rd


def _disabled_scaler_meta(tmp_path):
    """The run meta's `scaler` of a real watch of `GradScaler("cpu", enabled=False)` (the usual fp16/bf16 toggle)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", enabled=False)
    rd = str(tmp_path / "disabled")
    with ampdoctor.watch(m, opt, scaler=sc, run_dir=rd):
        for _ in range(2):
            opt.zero_grad()
            sc.scale(m(torch.randn(2, 4)).pow(2).mean()).backward()
            sc.step(opt)
            sc.update()
    with open(os.path.join(rd, "manifest.json")) as f:
        meta = json.load(f)["runs"][0]["meta"]["scaler"]
    assert meta and meta["enabled"] is False, meta
    return meta


def test_11_a_long_run_without_a_scaler_is_diagnosed_in_linear_time(base_run, tmp_path):
    """The same 15,000 records twice: as a run whose watch saw a disabled GradScaler (the rules take the same
    scaler-less branches) and as one that saw none. Diagnosing the second may not take 3x longer than the first."""
    n = 15_000
    twin = _long_run(base_run, str(tmp_path / "twin"), n, _disabled_scaler_meta(tmp_path))
    rd = _long_run(base_run, str(tmp_path / "long"), n)
    ampdoctor.diagnose(_long_run(base_run, str(tmp_path / "short"), 300))        # imports and caches warmed
    t = time.perf_counter()
    rep_twin = ampdoctor.diagnose(twin)
    t_twin = time.perf_counter() - t
    assert rep_twin.summary["steps"] == n, rep_twin.summary
    budget = 3 * t_twin + 2

    class TooSlow(BaseException):          # (a BaseException: no `except Exception` on the way swallows it)
        pass

    def too_slow(*a):
        raise TooSlow(f"diagnose of {n} steps without a scaler: more than {budget:.1f} s (with a disabled one "
                      f"{t_twin:.1f} s)")
    old = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, budget)
    t = time.perf_counter()
    try:
        rep = ampdoctor.diagnose(rd)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    elapsed = time.perf_counter() - t
    assert rep.summary["steps"] == n, rep.summary
    assert [f.to_dict() for f in rep.findings] == [f.to_dict() for f in rep_twin.findings]
    assert elapsed < budget, (elapsed, t_twin)


# ======================================================================================== captures
def test_12_pickle_payload_in_the_tensors_file_never_runs(cli):
    ctx = cli["pickle_payload"]
    line = error_line(ctx["p"])
    assert "weights_only" in line and "tensors.pt" in line, line
    assert not ctx["marker"].exists(), "a capture's pickle ran a command"
    assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()
    plain = cli["plain_tensors_pt"]                                 # the .pt path itself works
    assert plain["p"].returncode == 1, plain["p"].stderr[-2000:]
    f0 = strict_json(plain["dir"] / "r.json")["findings"][0]
    assert (f0["rule"], f0["module"], f0["step"]) == ("overflow", "0", 4), f0
    assert plain["after"] == plain["before"]


def test_13_infinite_loss_scale_in_a_capture(cli):
    ctx = cli["scale_inf"]
    assert ctx["after"] == ctx["before"]
    one_line_or_report(ctx["p"], [ctx["dir"] / "r.json"])


def test_14_rng_state_of_the_wrong_size_is_not_a_healthy_step(cli):
    ctx = cli["rng_wrong_size"]
    p = ctx["p"]
    assert ctx["after"] == ctx["before"]
    no_traceback(p)
    assert "healthy" not in p.stdout.lower(), p.stdout[-1500:]
    if p.returncode == 2:                                          # a corrupt capture, refused
        line = error_line(p)
        assert "rng" in line.lower(), line
        return
    assert p.returncode == 1, (p.returncode, p.stdout[-1500:])     # or replayed anyway: the overflow at `0`
    f0 = strict_json(ctx["dir"] / "r.json")["findings"][0]
    assert (f0["rule"], f0["module"], f0["step"]) == ("overflow", "0", 4), f0


def test_15_model_whose_forward_does_not_fit_the_capture(cli):
    ctx = cli["forward_signature"]
    line = error_line(ctx["p"])
    assert "forward()" in line and "'y'" in line, line
    assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()
