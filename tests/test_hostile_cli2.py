"""More hostile probes of the command line (real `python -m ampdoctor` subprocesses) and of the Python API's
bad-input handling, on run directories and captures written by a real `ampdoctor.watch(run_dir=...)` run of a
tiny model that overflows at a known step.

The standard (shared/CONTRACT.md, README "Command line"): bad input is ONE line on stderr and exit code 2, never
a traceback; nothing that existed before is lost or overwritten; a capture never makes ampdoctor import or call
code it names. Every probe checks the exit code, the stderr line and that the files that were there before are
byte-identical after. Where ampdoctor does not meet the standard today the probe is a strict xfail whose reason
says what happens instead.
"""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ampdoctor
from ampdoctor.errors import BadInput
from probe_harness import ROOT, copy, edit_manifest, load_models, overflow_run, run_cli, snapshot, strict_json

MODELS = "ad_cli2_models"          # the helper module the --model/--loss specs name (written per test module)

MODELS_SRC = '''
import torch
import torch.nn as nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def wide():                       # same names as mlp, other shapes
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def returns_none():
    return None


def returns_dict():
    return {"not": "a module"}


def vector_loss(out, *args, **kwargs):     # per-element: not the scalar the contract asks for
    return out.float().pow(2)


def scalar_loss(out, *args, **kwargs):
    return out.float().pow(2).mean()


class Tied(nn.Module):
    """A tiny LM whose output projection shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, gain):
        return self.head(self.mid(self.emb(ids) * gain))


def tied():
    return Tied()


def untied():                     # the same module tree, the head's own (different) weight
    m = Tied()
    m.head.weight = nn.Parameter(torch.randn(16, 8))
    return m
'''

BADIMPORT_SRC = 'raise ImportError("cannot import me\\nline two of the import error")\n'

EVIL_SRC = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def factory(*a, **k):
    pathlib.Path({marker!r}).write_text("called")


def loss(*a, **k):
    pathlib.Path({marker!r}).write_text("called")
'''


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    """A directory on the subprocesses' PYTHONPATH with the helper modules; the models module loaded here too."""
    d = tmp_path_factory.mktemp("helpers")
    mod = load_models(d, MODELS, MODELS_SRC)
    (d / "ad_cli2_badimport.py").write_text(BADIMPORT_SRC)
    marker = d / "EVIL_MARKER"
    (d / "ad_cli2_evil.py").write_text(EVIL_SRC.format(marker=str(marker)))
    return {"dir": str(d), "models": mod, "marker": marker}


def run_many(helpers, argvs):
    """Several independent CLI runs at once (the machine's cores, not one after the other)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
        return list(ex.map(lambda a: run_cli(helpers, *a), argvs))


def error_line(p) -> str:
    """The one `ampdoctor: ...` line of a refused run: exit 2, no traceback, nothing else on stderr but replay's
    progress lines (`replay: ...`; test_replay_bad_input_stderr_is_strictly_one_line is about those)."""
    assert p.returncode == 2, f"exit {p.returncode}\nstderr: {p.stderr[-3000:]}\nstdout: {p.stdout[-1500:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("replay: ")]
    assert len(lines) == 1 and lines[0].startswith("ampdoctor: "), p.stderr
    return lines[0]


def report_ok(p):
    """A report was made: exit 0 or 1, no traceback."""
    assert p.returncode in (0, 1), f"exit {p.returncode}\nstderr: {p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ real runs
def _tied_run(helpers, rd, factory):
    """A real watch of the tied-weights LM: `mid` overflows at step 3 (its input x 1e5); captures/3."""
    torch.manual_seed(0)
    m = getattr(helpers["models"], factory)()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with ampdoctor.watch(m, opt, run_dir=rd):
        for i in range(5):
            opt.zero_grad()
            ids = torch.randint(0, 16, (2, 4))
            gain = torch.tensor(1e5 if i == 3 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(ids, gain).float().pow(2).mean()
            if torch.isfinite(loss):
                loss.backward()
                opt.step()
    assert os.path.isdir(os.path.join(rd, "captures", "3"))
    return rd


@pytest.fixture(scope="module")
def mlp_run(helpers, tmp_path_factory):
    """A real watch: the MLP's first Linear overflows in fp16 at step 4 (input x 1e5); captures/4 is written."""
    return overflow_run(helpers["models"], str(tmp_path_factory.mktemp("mlp") / "run"), oracle=False)


@pytest.fixture(scope="module")
def mlp_cap(mlp_run):
    return os.path.join(mlp_run, "captures", "4")


@pytest.fixture()
def run_copy(mlp_run, tmp_path):
    return copy(mlp_run, str(tmp_path / "run"))


@pytest.fixture()
def cap_copy(mlp_cap, tmp_path):
    return copy(mlp_cap, str(tmp_path / "cap"))


def _records(rd):
    with open(os.path.join(rd, "steps.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def _write_records(rd, recs):
    with open(os.path.join(rd, "steps.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


# ======================================================================================== report RUN_DIR
def test_torn_record_of_the_bad_step_still_reports_the_steps_before_it(helpers, run_copy, tmp_path):
    """The writer died inside the last line (step 4's record): the README says a torn line is skipped, so the
    report covers steps 0..3, and reading never 'repairs' (rewrites) the records. (A writer that dies there never
    writes the run's end line; here the writing process, this one, still runs, so the run is not called killed.)
    Since the forty-second session the bad step's capture, on disk ahead of its lost record, stands for step 4
    (ampdoctor/runcaptures.py): the report says step 4 went bad instead of nothing about it."""
    sp = os.path.join(run_copy, "steps.jsonl")
    with open(sp, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    assert len(lines) == 6 and json.loads(lines[-1]) == {"run": 0, "end": True}
    lines = lines[:-1]
    with open(sp, "wb") as f:
        f.write(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    before = snapshot(run_copy)
    p = run_cli(helpers, "report", run_copy, "--no-html", "--json", tmp_path / "r.json")
    report_ok(p)
    assert p.stderr.strip().count("\n") == 0, p.stderr
    d = strict_json(tmp_path / "r.json")
    assert d["summary"]["steps"] == 5, d["summary"]
    assert any(f["step"] == 4 and f["severity"] == "error" and f["rule"] in ("overflow", "nan_origin")
               for f in d["findings"][:3]), d["findings"][:3]
    assert snapshot(run_copy) == before


def test_records_from_a_newer_writer_with_unknown_fields_are_read(helpers, run_copy, tmp_path):
    """A newer ampdoctor adds fields (top level, inside module calls and tensor stats, in the run meta): this
    one reads what it knows and gives the same diagnosis."""
    recs = _records(run_copy)
    for r in recs:
        r["future_field"] = {"x": [1, 2, 3]}
        for mc in r.get("modules") or []:
            mc["future_call_field"] = 7
            if mc.get("out"):
                mc["out"]["future_stat"] = 0.5
    _write_records(run_copy, recs)
    mp = os.path.join(run_copy, "manifest.json")
    with open(mp) as f:
        man = json.load(f)
    man["runs"][0]["meta"]["future_meta"] = {"a": 1}
    man["future_top"] = True
    with open(mp, "w") as f:
        json.dump(man, f)
    p = run_cli(helpers, "report", run_copy, "--no-html", "--json", tmp_path / "r.json")
    assert p.returncode == 1, p.stderr
    f0 = strict_json(tmp_path / "r.json")["findings"][0]
    assert (f0["rule"], f0["module"], f0["step"]) == ("overflow", "0", 4), f0


def test_wrong_types_and_nonfinite_literals_in_meta_and_records(helpers, run_copy, tmp_path):
    """Strings where numbers are, NaN/Infinity/1e999 literals (Python's json writes and reads them) in the meta
    and the records: a report or one line, never a traceback; the --json output stays standard JSON."""
    mp = os.path.join(run_copy, "manifest.json")
    with open(mp) as f:
        man = json.load(f)
    meta = man["runs"][0]["meta"]
    meta.update(every=float("inf"), rank=float("nan"), world_size="two", model_class=5)
    with open(mp, "w") as f:
        f.write(json.dumps(man).replace('"world_size": "two"', '"world_size": 1e999'))
    recs = _records(run_copy)
    recs[0]["loss"] = float("nan")
    recs[1]["loss"] = "1.5"
    recs[2]["scale"] = "65536"
    recs[2]["loss"] = float("inf")
    recs[3]["grad_norm"] = -float("inf")
    _write_records(run_copy, recs)
    out, js, tb = tmp_path / "html", tmp_path / "r.json", tmp_path / "tb"
    p = run_cli(helpers, "report", run_copy, "--out", out, "--json", js, "--tensorboard", tb)
    if p.returncode == 2:
        error_line(p)
        return
    report_ok(p)
    d = strict_json(js)                          # no NaN/Infinity tokens: any JSON parser reads it
    assert d["findings"] and d["summary"]["steps"] == 5
    assert (out / "index.html").is_file()
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tb))


@pytest.mark.parametrize("kind", ["file", "empty_dir", "empty_rank_dir"])
def test_run_dir_that_is_a_file_empty_or_has_an_empty_rank(helpers, mlp_run, tmp_path, kind):
    rd = tmp_path / "rd"
    if kind == "file":
        rd.write_text("not a run directory\n")
    elif kind == "empty_dir":
        rd.mkdir()
    else:                                   # rank 0 recorded; rank-1/ exists but its writer never got going
        rd.mkdir()
        copy(mlp_run, str(rd / "rank-0"))
        (rd / "rank-1").mkdir()
    before = snapshot(rd)
    line = error_line(run_cli(helpers, "report", rd, "--no-html", "--json", tmp_path / "r.json"))
    assert str(rd) in line
    assert snapshot(rd) == before and not (tmp_path / "r.json").exists()


def test_run_dir_with_only_a_rank_1_subdir(helpers, mlp_run, tmp_path):
    """Only rank 1 left its records (rank 0 wrote elsewhere): the report is rank 1's, and says so."""
    rd = tmp_path / "dist"
    rd.mkdir()
    copy(mlp_run, str(rd / "rank-1"))
    before = snapshot(rd)
    p = run_cli(helpers, "report", rd, "--no-html", "--json", tmp_path / "r.json")
    assert p.returncode == 1, p.stderr
    f0 = strict_json(tmp_path / "r.json")["findings"][0]
    assert (f0["rule"], f0["step"], f0["evidence"].get("rank")) == ("overflow", 4, 1), f0
    assert snapshot(rd) == before


def test_unicode_and_space_paths_everywhere(helpers, mlp_run, tmp_path):
    base = tmp_path / "dir with spaces ü"
    base.mkdir()
    rd = copy(mlp_run, str(base / "rün ✓ 1"))
    out, js, tb = base / "öut ✓", base / "r é.json", base / "tb ✓"
    p = run_cli(helpers, "report", rd, "--out", out, "--json", js, "--tensorboard", tb)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert strict_json(js)["findings"][0]["rule"] == "overflow"
    assert "<html" in (out / "index.html").read_text(encoding="utf-8").lower()
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tb))


def test_two_reports_into_the_same_out_at_once(helpers, mlp_run, tmp_path):
    out = tmp_path / "shared_out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, helpers["dir"]]))
    ps = [subprocess.Popen([sys.executable, "-m", "ampdoctor", "report", mlp_run, "--out", str(out)], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    res = [(p.communicate(timeout=240)[1], p.returncode) for p in ps]
    for err, rc in res:
        assert rc == 1 and "Traceback" not in err, err
    names = os.listdir(out)
    assert "index.html" in names and ".ampdoctor.out" in names, names
    assert not [n for n in names if n.startswith(".ampdoctor-")], names        # no temporaries left behind
    html = (out / "index.html").read_text(encoding="utf-8")
    assert html.rstrip().lower().endswith("</html>")                         # one whole report, not a mix


# (was a strict xfail until the session that fixed it; see git log)
@pytest.mark.parametrize("name", ["manifest.json", "steps.jsonl"])
def test_json_onto_the_run_dirs_own_files_is_refused(helpers, run_copy, name):
    before = snapshot(run_copy)
    p = run_cli(helpers, "report", run_copy, "--no-html", "--json", os.path.join(run_copy, name))
    assert snapshot(run_copy) == before
    error_line(p)


# (was a strict xfail until the session that fixed it; see git log)
def test_replay_json_onto_the_captures_manifest_is_refused(helpers, cap_copy):
    before = snapshot(cap_copy)
    p = run_cli(helpers, "replay", cap_copy, "--model", f"{MODELS}:mlp", "--quick", "--no-html", "--json",
                os.path.join(cap_copy, "manifest.json"))
    assert snapshot(cap_copy) == before
    error_line(p)


@pytest.mark.parametrize("link", [
    "index.html",
    ".ampdoctor.out",
])
def test_links_in_an_ampdoctor_out_dir_are_never_written_through(helpers, mlp_run, tmp_path, link):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's precious file\n")
    if link != ".ampdoctor.out":
        (out / ".ampdoctor.out").write_text("written by ampdoctor\n")
    os.symlink(victim, out / link)
    p = run_cli(helpers, "report", mlp_run, "--out", out)
    assert victim.read_text() == "the user's precious file\n"
    if p.returncode == 2:
        error_line(p)
    else:
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr


# (was a strict xfail until the session that fixed it; see git log)
def test_report_with_a_bad_loss_spec_is_refused(helpers, mlp_run):
    line = error_line(run_cli(helpers, "report", mlp_run, "--no-html", "--loss", "not a spec"))
    assert "--loss" in line


# (was a strict xfail until the session that fixed it; see git log)
def test_report_model_on_a_moved_run_dir_replays_its_own_capture(helpers, tmp_path):
    orig = overflow_run(helpers["models"], str(tmp_path / "orig"), oracle=False)
    moved = str(tmp_path / "moved")
    shutil.move(orig, moved)
    os.unlink(os.path.join(moved, "replay-0.json"))      # the saved replay gone: --model is the way to the op
    p = run_cli(helpers, "report", moved, "--model", f"{MODELS}:mlp", "--no-html", "--json", tmp_path / "r.json")
    assert p.returncode == 1, p.stderr
    f0 = strict_json(tmp_path / "r.json")["findings"][0]
    assert (f0["rule"], f0["module"], f0["step"]) == ("overflow", "0", 4) and f0["op"], f0


# (was a strict xfail until the session that fixed it; see git log)
def test_record_naming_a_capture_outside_the_run_dir_is_not_followed(helpers, run_copy, mlp_cap, tmp_path):
    shutil.rmtree(os.path.join(run_copy, "captures"))
    os.mkdir(os.path.join(run_copy, "captures"))
    os.unlink(os.path.join(run_copy, "replay-0.json"))
    outside = copy(mlp_cap, str(tmp_path / "elsewhere_cap_q7"))
    recs = _records(run_copy)
    assert recs[4]["capture"]
    recs[4]["capture"] = os.path.join(run_copy, "captures", "..", "..", "elsewhere_cap_q7")
    assert os.path.realpath(recs[4]["capture"]) == os.path.realpath(outside)
    _write_records(run_copy, recs)
    p = run_cli(helpers, "report", run_copy, "--model", f"{MODELS}:mlp", "--no-html", "--json", tmp_path / "r.json")
    if p.returncode == 2:
        error_line(p)
    else:
        report_ok(p)
        text = (tmp_path / "r.json").read_text()  # the record's own words may name it; it must not be replayed
        assert '"from_replay"' not in text and "aten::" not in text, "replayed a capture outside RUN"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("flag", [
    "--tensorboard-onto-file",
    "--out",
    "--json",  # (was a strict xfail as root: the line named ampdoctor's temporary file, not the path given)
])
def test_unusable_output_targets_are_one_line_naming_the_path(helpers, mlp_run, tmp_path, flag):
    existing = tmp_path / "existing.txt"
    existing.write_text("keep me\n")
    if flag == "--tensorboard-onto-file":
        argv, target = ["--no-html", "--tensorboard", existing], existing
    elif flag == "--out":
        argv, target = ["--out", "/proc/ad_cli2_out"], "/proc/ad_cli2_out"
    else:
        argv, target = ["--no-html", "--json", "/proc/ad_cli2.json"], "/proc/ad_cli2.json"
    before = snapshot(mlp_run, existing)
    line = error_line(run_cli(helpers, "report", mlp_run, *argv))
    assert str(target) in line, line
    assert snapshot(mlp_run, existing) == before


# ======================================================================================== replay CAPTURE
# (was a strict xfail until the session that fixed it; see git log)
def test_replay_factory_returning_none(helpers, mlp_cap):
    line = error_line(run_cli(helpers, "replay", mlp_cap, "--model", f"{MODELS}:returns_none", "--quick",
                              "--no-html"))
    assert "returns_none" in line


def test_replay_bad_model_specs_are_one_line(helpers, mlp_cap):
    cases = [(f"{MODELS}:returns_dict", "dict"),                  # a factory that returns a non-Module
             ("ad_cli2_badimport:f", "cannot import me")]          # a module that raises on import (2 lines)
    before = snapshot(mlp_cap)
    ps = run_many(helpers, [("replay", mlp_cap, "--model", spec, "--quick", "--no-html") for spec, _ in cases])
    for (spec, needle), p in zip(cases, ps):
        line = error_line(p)
        assert needle in line, (spec, line)
        assert "line two" not in line
    assert snapshot(mlp_cap) == before


@pytest.fixture(scope="module")
def mismatch(helpers, mlp_cap, tmp_path_factory):
    """`replay CAP --model wide` (same names, other shapes), with an existing --json file and an --out directory
    ampdoctor wrote before: (the process, the paths, their snapshot before)."""
    d = tmp_path_factory.mktemp("mismatch")
    js, out = d / "old.json", d / "out"
    js.write_text('{"previous": "report"}\n')
    out.mkdir()
    (out / ".ampdoctor.out").write_text("written by ampdoctor\n")
    (out / "index.html").write_text("<html>the previous report</html>\n")
    before = snapshot(mlp_cap, js, out)
    p = run_cli(helpers, "replay", mlp_cap, "--model", f"{MODELS}:wide", "--json", js, "--out", out)
    return p, (mlp_cap, js, out), before


def test_replay_model_with_mismatching_shapes(mismatch):
    """One line that names the first mismatching parameter; the previous --json and --out report untouched."""
    p, paths, before = mismatch
    line = error_line(p)
    assert "0.weight" in line and line.index("0.weight") < line.index("0.bias"), line
    assert snapshot(*paths) == before


# (was a strict xfail until the session that fixed it; see git log)
def test_replay_bad_input_stderr_is_strictly_one_line(mismatch):
    p = mismatch[0]
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0, p.stderr


# (was a strict xfail until the session that fixed it; see git log)
def test_replay_loss_that_returns_a_non_scalar(helpers, mlp_cap):
    line = error_line(run_cli(helpers, "replay", mlp_cap, "--model", f"{MODELS}:mlp", "--loss",
                              f"{MODELS}:vector_loss", "--quick", "--no-html"))
    assert "scalar" in line


def test_hostile_capture_files_are_refused(helpers, mlp_cap, mlp_run, tmp_path):
    """tensors.safetensors a link to /dev/zero; a manifest naming ../../../../etc/passwd as the state file; a
    manifest.json that links to /etc/passwd."""
    zero = copy(mlp_cap, str(tmp_path / "zero"))
    os.unlink(os.path.join(zero, "tensors.safetensors"))
    os.symlink("/dev/zero", os.path.join(zero, "tensors.safetensors"))
    trav = copy(mlp_cap, str(tmp_path / "trav"))
    with open(os.path.join(trav, "manifest.json")) as f:
        files = json.load(f)["files"]
    files["state"]["name"] = "../../../../etc/passwd"
    edit_manifest(trav, files=files)
    mlink = copy(mlp_cap, str(tmp_path / "mlink"))
    os.unlink(os.path.join(mlink, "manifest.json"))
    os.symlink("/etc/passwd", os.path.join(mlink, "manifest.json"))
    cases = [(zero, "outside the capture"), (trav, "not a plain file name"), (mlink, "outside the capture")]
    before = snapshot(tmp_path, mlp_run)
    ps = run_many(helpers, [("replay", c, "--model", f"{MODELS}:mlp", "--quick", "--no-html", "--json",
                             tmp_path / f"r{i}.json") for i, (c, _) in enumerate(cases)])
    for (c, needle), p in zip(cases, ps):
        line = error_line(p)
        assert needle in line, (c, line)
    assert snapshot(tmp_path, mlp_run) == before          # and no --json was written


def test_capture_naming_a_factory_spec_is_never_imported(helpers, cap_copy, tmp_path):
    """The manifest names an importable `module:factory` (as --model would) as its model class and in `extra`;
    without --model ampdoctor asks for one, with --model it uses the user's: the named module never loads."""
    edit_manifest(cap_copy, model_class="ad_cli2_evil:factory",
                   extra={"model": "ad_cli2_evil:factory", "loss_fn": "ad_cli2_evil:loss",
                          "factory": "ad_cli2_evil:factory"})
    marker = helpers["marker"]
    p_no, p_model = run_many(helpers, [("replay", cap_copy, "--quick", "--no-html"),
                                       ("replay", cap_copy, "--model", f"{MODELS}:mlp", "--quick", "--no-html")])
    assert "--model" in error_line(p_no)
    assert p_model.returncode == 1, p_model.stderr
    assert not marker.exists(), f"a capture made ampdoctor import/call the code it names: {marker.read_text()}"


def test_replay_out_into_a_foreign_directory_is_refused(helpers, mlp_cap, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.html").write_text("the user's own page\n")
    (out / "notes.txt").write_text("notes\n")
    before = snapshot(out, mlp_cap)
    line = error_line(run_cli(helpers, "replay", mlp_cap, "--model", f"{MODELS}:mlp", "--quick", "--out", out))
    assert "--force" in line
    assert snapshot(out, mlp_cap) == before


@pytest.fixture(scope="module")
def tied_cap(helpers, tmp_path_factory):
    return os.path.join(_tied_run(helpers, str(tmp_path_factory.mktemp("tied") / "run"), "tied"), "captures", "3")


def test_replay_of_a_capture_from_a_model_with_tied_weights(helpers, tied_cap, tmp_path):
    before = snapshot(tied_cap)
    p = run_cli(helpers, "replay", tied_cap, "--model", f"{MODELS}:tied", "--loss", f"{MODELS}:scalar_loss",
                "--quick", "--no-html", "--json", tmp_path / "r.json")
    assert p.returncode == 1, p.stderr
    f0 = strict_json(tmp_path / "r.json")["findings"][0]
    assert (f0["rule"], f0["module"], f0["step"]) == ("overflow", "mid", 3), f0
    assert snapshot(tied_cap) == before


# (was a strict xfail until the session that fixed it; see git log)
def test_untied_capture_into_a_tied_model_does_not_match(helpers, tmp_path):
    cap = os.path.join(_tied_run(helpers, str(tmp_path / "run"), "untied"), "captures", "3")
    line = error_line(run_cli(helpers, "replay", cap, "--model", f"{MODELS}:tied", "--quick", "--no-html"))
    assert "head.weight" in line or "emb.weight" in line


# ======================================================================================== the Python API
def test_api_replay_refuses_a_mismatching_model_and_leaves_it_untouched(helpers, mlp_cap):
    m = helpers["models"].wide()
    m.eval()
    for p in m.parameters():
        p.grad = torch.full_like(p, 3.0)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(BadInput) as e:
        ampdoctor.replay(mlp_cap, model=m, shadow=False, whatif=False, fix_search=False)
    msg = str(e.value)
    assert "\n" not in msg and "0.weight" in msg, msg
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())
    assert not m.training and all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in m.parameters())
    assert torch.equal(rng, torch.get_rng_state())


# (was a strict xfail until the session that fixed it; see git log)
def test_api_replay_factory_string_returning_none_names_the_factory(helpers, mlp_cap, monkeypatch):
    monkeypatch.syspath_prepend(helpers["dir"])
    with pytest.raises(BadInput) as e:
        ampdoctor.replay(mlp_cap, model=f"{MODELS}:returns_none", shadow=False, whatif=False, fix_search=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert "returns_none" in msg or "None" in msg, msg


def test_api_diagnose_of_a_file_or_a_torn_only_steps_file(run_copy, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(BadInput) as e:
        ampdoctor.diagnose(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    with open(os.path.join(run_copy, "steps.jsonl"), "wb") as fh:
        fh.write(b'{"run": 0, "step": 0, "loss": 1.')                  # the only record, torn
    try:                                                                 # a run that died in its first step:
        rep = ampdoctor.diagnose(run_copy)                               # no step, or one line
    except BadInput as e:
        assert "\n" not in str(e) and "steps.jsonl" in str(e), str(e)
    else:
        assert rep.summary["steps"] == 0 and rep.exit_code == 0


def test_api_save_json_onto_a_directory_or_under_a_file(mlp_run, tmp_path):
    rep = ampdoctor.diagnose(mlp_run)
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep.txt").write_text("keep\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    before = snapshot(tmp_path)
    for target in (d, a_file / "r.json", d / "keep.txt" / "r.json"):
        with pytest.raises((OSError, BadInput)):
            rep.save_json(target)
    for target in (a_file / "x.html", a_file / "html_dir", a_file):
        with pytest.raises((OSError, BadInput)):
            rep.save_html(target)
    assert snapshot(tmp_path) == before                  # nothing changed, no temporary left behind


def test_api_save_json_replaces_a_symlink_never_writes_through_it(mlp_run, tmp_path):
    rep = ampdoctor.diagnose(mlp_run)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "r.json"
    os.symlink(victim, link)
    rep.save_json(link)
    assert victim.read_text() == "precious\n"
    assert not link.is_symlink() and strict_json(link)["findings"][0]["rule"] == "overflow"


# (was a strict xfail until the session that fixed it; see git log)
def test_api_save_html_with_an_empty_path(mlp_run, tmp_path, monkeypatch):
    rep = ampdoctor.diagnose(mlp_run)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "index.html").write_text("the user's own page\n")
    before = snapshot(tmp_path)
    try:
        with pytest.raises((OSError, BadInput, ValueError)):
            rep.save_html("")
    finally:
        after = snapshot(tmp_path)
    assert after == before
