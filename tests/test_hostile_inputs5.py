"""A hostile tester's fifth round: bad input at the command line (real `python -m ampdoctor` subprocesses, run from an
empty cwd) and at the Python API, on a run directory and a capture written by a real `ampdoctor.watch(run_dir=...)`
run of a tiny MLP whose first Linear overflows fp16 at step 4 (its input x 1e5; an independent forward hook sees `0`'s
output turn non-finite at that step only; its capture: `captures/4`), and on a quiet run of the same MLP (seed 0, no
bad batch; its own report has no finding at all).

The standard (docs/CONTRACT.md "CLI", README "Command line" and "Formats"): bad input (a corrupt or foreign capture or
run dir, a model or loss that does not fit the capture, bad flags) gets ONE `ampdoctor: ...` line on stderr, exit 2,
no traceback; input that is valid gets a correct report; nothing that existed is lost or overwritten (every case
hashes what it guards before and after); nothing a capture names is imported or called. What test_hostile_cli2.py,
test_hostile_capture.py, test_hostile_rundir.py, test_hostile_inputs3.py, test_hostile_inputs4.py, test_capture*.py,
test_cli*.py and test_replay_workflows.py already probe is not repeated here. The CLI calls run once, on a pool of 3
(module fixture `cli`); a failed check of ampdoctor's answer raises WrongAnswer (a strict xfail via `wrong`), a
failed set-up check is a plain failure.

Models and losses that do not fit the capture (`replay CAPTURE --model ... --loss ...`):
 1. a factory that builds its model on the meta device (`with torch.device("meta"): ...`, the big-model idiom),
    expecting the capture's weights to fill it: one line, or the weights loaded and the overflow named at `0`,
    step 4. Twin (the fix: `.to_empty(device="cpu")` first): the overflow at `0`, step 4.
 2. a factory returning a registry's abstract base class (`EncoderBase`: it builds the capture's exact layers, its
    forward raises NotImplementedError; the subclass `MLPEncoder` implements it): one line, never "healthy".
    Twin (the subclass): the overflow at `0`, step 4.
 3. a model whose forward asserts its input's rank (`assert x.dim() == 3`, nanoGPT-style shape asserts; the same
    parameters as the capture's MLP) on the capture's 2-D batch: one line, no traceback.
 4. a `--loss` written as loss(output, target) that asserts the shapes agree (the contract passes the model's
    inputs, not a target): one line, no traceback. Twin: a loss that fits, `scalar_loss` (the control).
 5. `--model` specs: a factory with a required argument; `--loss` naming a float constant; `--model` naming an
    nn.Module instance built at import (used as is: a report); a factory returning the model wrapped in
    nn.DataParallel (every name `module.`-prefixed: one line naming the mismatch).
Captures:
 6. a capture taken on CUDA (manifest autocast and batch device "cuda", a 16-byte CUDA RNG state `rng/cuda:0`
    beside the CPU one, the files' sizes and hashes updated), replayed on this CPU-only machine: a correct report
    (overflow at `0`, step 4), and a fix the user can apply: the snippet must not tell a CUDA run to disable
    `device_type="cpu"` autocast (which leaves CUDA autocast on). Twin: the CPU capture's fix says "cpu".
 7. the weights as a torch.save zip `state.pt` (allowed by the README) holding two extra members whose pickles run
    a shell command (`state/evil.pkl`, `state/data/99`): the replay reads only what data.pkl names (a report, the
    overflow at `0`, step 4) and the command never runs.
Run directories (`report RUN_DIR`):
 8. steps.jsonl holding the lines of the failing run and of the quiet run, both `"run": 0`, interleaved line by
    line (two writers that both believed they were run 0: a run dir copied between machines, an NFS mount where
    flock is a no-op): one line, or a report that still names the overflow at `0`, step 4 — never "healthy".
    Twin: the same lines appended one run after the other (`cat b >> a`): the overflow at `0`, step 4.
 9. the bad step's record renumbered to step 10**9 (a valid integer, below 2**53), with --out, --json and
    --tensorboard: a report naming the overflow at `0`, step 10**9, every output written.
Flags:
10. `--json OUT/index.html` together with `--out OUT`: the JSON report is announced ("json: ...") but must still be
    there, or the flags refused with one line. Twin: `--json` beside the --out directory: both written.
The Python API:
11. `ampdoctor.watch(..., run_dir=X)` where X is a capture directory, or a data directory holding the user's own
    `manifest.json`: every file that was there is byte-identical afterwards, training is bitwise what it is
    unwatched, and the capture still replays the overflow at `0`, step 4.
Control: the intact capture replays the overflow at `0`, step 4 (exit 1, `--loss scalar_loss`).

What ampdoctor got wrong (strict xfails via `wrong`; the first lines of what it said):
 1. meta factory: exit 0, "healthy: No mixed-precision problems found", one info replay_error ("the replayed forward
    raised User specified an unsupported autocast device_type 'meta'"), summary device "meta", finite false; torch's
    UserWarning "copying from a non-meta parameter in the checkpoint to a meta parameter ... is a no-op": the
    capture's weights were never loaded. replay/modelio.py load_weights calls load_state_dict (no assign=True, and
    strict=False because the model holds meta tensors) into meta parameters; replay/__init__.py replay takes the
    replay device from the model's first parameter (`meta`); the RuntimeError becomes a `forward_error`.
    Should be: one line (the model holds no storage for the capture's weights), or the weights assigned and
    `overflow` at `0`, step 4, as the `.to_empty()` twin gets.
 2. abstract base: exit 0, "healthy: No mixed-precision problems found", one info replay_error ("...raised
    EncoderBase is abstract: build MLPEncoder"). replay/__init__.py _replay catches the NotImplementedError (a
    RuntimeError) raised before any op ran as the step's `forward_error` instead of a model that does not fit the
    capture. Should be: one line, exit 2.
 3. forward assert: `Traceback ... AssertionError: expected (batch, time, features), got (4, 8)`, exit 1. _replay
    catches RuntimeError and (TypeError, ValueError, AttributeError, KeyError, IndexError) only, and cli.main only
    BadInput. (`report RUN --model ad_h5_models:seq_mlp` does give one line: merge_capture_replay(strict=True).)
    Should be: one line, exit 2.
 4. loss assert: `Traceback ... AssertionError: output (4, 1) vs target (4, 8)`, exit 1; the same cause.
 6b. CUDA capture: the report is right (`overflow` at `0` aten::_to_copy step 4, exit 1), but its fix reads
    `with torch.autocast(device_type="cpu", enabled=False): out = self[0](x.float())`, which in a CUDA run leaves
    CUDA autocast on. replay/__init__.py passes the replay's device (`dev.type`) to build_findings /
    explain.fp32_snippet, not the capture's autocast device. Should be: device_type="cuda" (the capture's).
 8. interleaved runs: exit 0, "Healthy: no problems found in 6 step(s)", no finding at all. rundir.read_run takes a
    record of the same step right after another as that step written again whole (`steps[-1] = rec`, for
    record/storage.folded), so each quiet record replaces the failing run's, the bad step 4 included (and with no
    record left naming captures/4, the saved replay is not folded in). Should be: one line (two records of step N
    in run 0 that are not one step rewritten), or the overflow at `0`, step 4, as the appended twin gets.
10. `--json OUT/index.html --out OUT`: exit 1, stdout "json: OUT/index.html" then "report: OUT/index.html"; the
    file holds the HTML report, the JSON is gone. cli._check_outputs checks each path alone; cli._write saves the
    JSON, then save_html replaces it. Should be: one line refusing --json inside --out's report files (or never
    letting the HTML replace it).
Passed: the control; 1's, 2's, 8's and 10's twins; 5 (one line naming `hidden`, `not callable`, `module.0.weight`;
the module instance used as the model: overflow at `0`, step 4); 6a (overflow at `0`, step 4); 7 (a report, the
pickles never ran); 9 (overflow at `0`, step 1000000000, HTML, JSON and TensorBoard written); 11 (the files kept,
training bitwise equal, a RuntimeWarning that the directory is not a run directory, the capture still replays).

Result when written (torch 2.13 CPU, default watch): 15 pass, 7 xfail (two runs, identical).
Fixed since (the same session; each XPASSed, then was unmarked): a model whose capture-held tensors are on the meta
device is refused in one line (replay/modelio.load_weights); a NotImplementedError or AssertionError raised before
any op of the forward ran, or outside every module (a loss's shape check), is a model/loss that does not fit the
capture: one line, exit 2 (replay/__init__._replay); the fix's code names the capture's autocast device
(replay/searches.code_device); a second record of a step that does not continue the first is refused
(rundir._written_again); `--json` naming a file the HTML report writes into `--out` is refused (cli._check_outputs).
"""
import contextlib
import hashlib
import json
import os
import pickle
import warnings
import zipfile

import pytest
import torch

import ampdoctor
from probe_harness import (WrongAnswer, case_registry, copy, edit_manifest, edit_record, error_line, finite_oracle,
                           load_models, no_traceback, one_line_or_report, overflow_run, records_raw, run_cases,
                           snapshot, strict_json, train_overflow, write_raw)

MODELS = "ad_h5_models"

MODELS_SRC = '''
import torch
import torch.nn as nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def scalar_loss(out, *args, **kwargs):
    return out.float().pow(2).mean()


def on_meta():
    with torch.device("meta"):
        return mlp()


def materialized():
    return on_meta().to_empty(device="cpu")


class EncoderBase(nn.Sequential):
    """A registry's base class: builds the layers from the config; subclasses implement forward."""

    def __init__(self):
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        raise NotImplementedError(f"{type(self).__name__} is abstract: build MLPEncoder")


class MLPEncoder(EncoderBase):
    def forward(self, x):
        return nn.Sequential.forward(self, x)


def encoder_base():
    return EncoderBase()


def mlp_encoder():
    return MLPEncoder()


class SeqMLP(nn.Sequential):
    """mlp's parameters; its forward checks for a (batch, time, features) input."""

    def forward(self, x):
        assert x.dim() == 3, f"expected (batch, time, features), got {tuple(x.shape)}"
        return super().forward(x)


def seq_mlp():
    return SeqMLP(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def shape_checked_loss(out, target):
    assert out.shape == target.shape, f"output {tuple(out.shape)} vs target {tuple(target.shape)}"
    return (out.float() - target).pow(2).mean()


def needs_args(hidden):
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))


LOSS_WEIGHT = 0.5
MODEL = mlp()


def data_parallel():
    return nn.DataParallel(mlp())
'''


class _Evil:
    """Unpickled, it runs a shell command that leaves a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


# ------------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def answer():
    """Checks of ampdoctor's answer: a failed one is its wrong answer (WrongAnswer), not a broken probe."""
    try:
        yield
    except WrongAnswer:
        raise
    except AssertionError as e:
        raise WrongAnswer(str(e)[:2000]) from None


def findings(path):
    return [(f["rule"], f["module"], f["step"], f["severity"]) for f in strict_json(path)["findings"]]


def first_finding(path):
    return findings(path)[0][:3]


def _file_entry(path):
    with open(path, "rb") as f:
        raw = f.read()
    return {"name": os.path.basename(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def _manifest(cap):
    with open(os.path.join(cap, "manifest.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("h5helpers")
    return {"dir": str(d), "models": load_models(d, MODELS, MODELS_SRC)}


@pytest.fixture(scope="module")
def base_run(helpers, tmp_path_factory):
    """A real watch, no GradScaler: the MLP's first Linear overflows fp16 at step 4; the watch writes captures/4."""
    return overflow_run(helpers["models"], str(tmp_path_factory.mktemp("h5run") / "run"))


@pytest.fixture(scope="module")
def quiet_run(helpers, tmp_path_factory):
    """The same MLP and loop, seed 0, no bad batch: finite throughout, and its own report has no finding."""
    rd = str(tmp_path_factory.mktemp("h5quiet") / "run")
    torch.manual_seed(0)
    m = helpers["models"].mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    finite, hook = finite_oracle(m[0])
    with ampdoctor.watch(m, opt, run_dir=rd) as w:
        train_overflow(m, opt, bad_step=-1, steps=6)
        hook.remove()
    assert finite == [True] * 6
    rep = w.report()
    assert rep.findings == [] and rep.exit_code == 0, [f.one_line() for f in rep.findings]
    helpers["quiet_run"] = rd
    return rd


CASES, case = case_registry()


@pytest.fixture(scope="module")
def cli(helpers, base_run, quiet_run, tmp_path_factory):
    """Every CLI call of this module, set up by the `case` builders below and run on a pool of 3; {name: ctx} with
    ctx["p"] the CompletedProcess, ctx["before"]/ctx["after"] the snapshots of what the case guards."""
    return run_cases(CASES, helpers, base_run, tmp_path_factory.mktemp("h5cli"))


def _cap(base_run, d, name="cap"):
    return copy(os.path.join(base_run, "captures", "4"), d / name)


def _replay(cap, d, model, loss=None, *extra):
    argv = ["replay", cap, "--model", f"{MODELS}:{model}"]
    if loss:
        argv += ["--loss", f"{MODELS}:{loss}"]
    return argv + ["--quick", "--no-html", "--json", d / "r.json", *extra]


# ------------------------------------------------------------------------------------------------ the CLI cases
@case
def control(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "mlp", "scalar_loss")}


@case
def meta_factory(helpers, base_run, d, ctx):
    m = helpers["models"].on_meta()
    assert all(t.is_meta for t in m.state_dict().values())
    assert set(m.state_dict()) == set(helpers["models"].mlp().state_dict())
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "on_meta", "scalar_loss")}


@case
def meta_factory_twin(helpers, base_run, d, ctx):
    assert not any(t.is_meta for t in helpers["models"].materialized().state_dict().values())
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "materialized", "scalar_loss")}


@case
def abstract_base(helpers, base_run, d, ctx):
    models = helpers["models"]
    base = models.encoder_base()
    assert set(base.state_dict()) == set(models.mlp().state_dict())
    with pytest.raises(NotImplementedError):
        base(torch.randn(4, 8))
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "encoder_base", "scalar_loss")}


@case
def abstract_base_twin(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "mlp_encoder", "scalar_loss")}


@case
def forward_assert(helpers, base_run, d, ctx):
    models = helpers["models"]
    assert set(models.seq_mlp().state_dict()) == set(models.mlp().state_dict())
    models.seq_mlp()(torch.randn(2, 5, 8))                        # a (batch, time, features) input runs
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "seq_mlp", "scalar_loss")}


@case
def loss_assert(helpers, base_run, d, ctx):
    with pytest.raises(AssertionError):
        helpers["models"].shape_checked_loss(torch.ones(4, 1), torch.ones(4, 8))
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "mlp", "shape_checked_loss")}


@case
def spec_needs_args(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "needs_args", "scalar_loss")}


@case
def spec_loss_constant(helpers, base_run, d, ctx):
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "mlp", "LOSS_WEIGHT")}


@case
def spec_module_instance(helpers, base_run, d, ctx):
    assert isinstance(helpers["models"].MODEL, torch.nn.Module)
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "MODEL", "scalar_loss")}


@case
def spec_data_parallel(helpers, base_run, d, ctx):
    assert "module.0.weight" in helpers["models"].data_parallel().state_dict()
    cap = _cap(base_run, d)
    return {"guard": [cap], "argv": _replay(cap, d, "data_parallel", "scalar_loss")}


@case
def cuda_capture(helpers, base_run, d, ctx):
    from safetensors.torch import load_file, save_file
    cap = _cap(base_run, d)
    tp = os.path.join(cap, "tensors.safetensors")
    tensors = load_file(tp)
    assert set(tensors) == {"a.0", "rng/cpu"}, sorted(tensors)
    tensors["rng/cuda:0"] = torch.zeros(16, dtype=torch.uint8)   # a CUDA generator's state: seed + offset
    save_file(tensors, tp)
    man = _manifest(cap)
    assert man["autocast"] == {"device": "cpu", "dtype": "float16", "enabled": True}, man["autocast"]
    arg = man["structure"]["args"]["__tuple__"][0]
    assert arg["device"] == "cpu", arg
    arg["device"] = "cuda:0"
    man["files"]["tensors"] = _file_entry(tp)
    edit_manifest(cap, autocast=dict(man["autocast"], device="cuda"), rng=["cpu", "cuda:0"],
                  structure=man["structure"], files=man["files"])
    assert not torch.cuda.is_available()                         # (the point: a CPU-only machine)
    return {"guard": [cap], "argv": _replay(cap, d, "mlp", "scalar_loss")}


@case
def zip_extra_members(helpers, base_run, d, ctx):
    from safetensors.torch import load_file
    cap = _cap(base_run, d)
    marker = d / "PWNED"
    sp = os.path.join(cap, "state.safetensors")
    pt = os.path.join(cap, "state.pt")
    torch.save(load_file(sp), pt)
    with zipfile.ZipFile(pt, "a") as z:
        prefix = z.namelist()[0].split("/")[0]
        z.writestr(f"{prefix}/evil.pkl", pickle.dumps(_Evil(marker)))
        z.writestr(f"{prefix}/data/99", pickle.dumps(_Evil(marker)))
    os.unlink(sp)
    edit_manifest(cap, files=dict(_manifest(cap)["files"], state=_file_entry(pt)))
    probe = d / "probe"
    pickle.loads(pickle.dumps(_Evil(probe)))                     # the payload really runs when unpickled
    assert probe.exists()
    probe.unlink()
    return {"guard": [cap], "marker": marker, "argv": _replay(cap, d, "mlp", "scalar_loss")}


def _mixed(helpers, base_run, d, how):
    rd = copy(base_run, d / "run")
    bad, quiet = records_raw(rd), records_raw(helpers["quiet_run"])
    for lines in (bad, quiet):
        recs = [json.loads(ln) for ln in lines]
        assert all(r.get("run") == 0 for r in recs) and recs[-1] == {"run": 0, "end": True}, recs[-1]
    steps = [json.loads(ln).get("step") for ln in bad[:-1]]
    assert steps == [0, 1, 2, 3, 4], steps
    assert json.loads(bad[4])["output_finite"] is False and json.loads(bad[4])["capture"]
    if how == "interleaved":
        lines = [ln for pair in zip(bad, quiet) for ln in pair] + quiet[len(bad):]
    else:
        lines = bad + quiet
    write_raw(rd, lines)
    return {"guard": [rd], "argv": ["report", rd, "--no-html", "--json", d / "r.json"]}


@case
def runs_interleaved(helpers, base_run, d, ctx):
    return _mixed(helpers, base_run, d, "interleaved")


@case
def runs_appended(helpers, base_run, d, ctx):
    return _mixed(helpers, base_run, d, "appended")


@case
def step_1e9(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    edit_record(rd, 4, step=10 ** 9)
    assert 10 ** 9 < 2 ** 53
    outs = [d / "r.json", d / "html" / "index.html", d / "tb"]
    return {"guard": [rd], "outs": outs,
            "argv": ["report", rd, "--out", d / "html", "--json", d / "r.json", "--tensorboard", d / "tb"]}


@case
def json_is_out_index(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    out = d / "out"
    return {"guard": [rd], "out": out, "argv": ["report", rd, "--out", out, "--json", out / "index.html"]}


@case
def json_beside_out(helpers, base_run, d, ctx):
    rd = copy(base_run, d / "run")
    out = d / "out"
    return {"guard": [rd], "out": out, "argv": ["report", rd, "--out", out, "--json", d / "r.json"]}


# ======================================================================================== control
def test_control_intact_capture_replays_the_overflow(cli):
    ctx = cli["control"]
    p = ctx["p"]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)
    assert ctx["after"] == ctx["before"]


# ======================================================================================== models and losses
def test_01_factory_building_on_the_meta_device(cli):
    ctx = cli["meta_factory"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        if one_line_or_report(p) == "refused":
            return
        assert p.returncode == 1 and "healthy" not in p.stdout.lower(), p.stdout[-1500:]
        assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)


def test_01_twin_materialized_factory(cli):
    ctx = cli["meta_factory_twin"]
    p = ctx["p"]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)
    assert ctx["after"] == ctx["before"]


def test_02_abstract_base_class_with_the_captures_layers(cli):
    ctx = cli["abstract_base"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        if one_line_or_report(p) == "refused":
            return
        assert p.returncode != 0 and "healthy" not in p.stdout.lower(), p.stdout[-1500:]


def test_02_twin_the_subclass(cli):
    ctx = cli["abstract_base_twin"]
    assert ctx["p"].returncode == 1 and "Traceback" not in ctx["p"].stderr, ctx["p"].stderr[-2000:]
    assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)


def test_03_model_whose_forward_asserts_the_input_rank(cli):
    ctx = cli["forward_assert"]
    with answer():
        assert ctx["after"] == ctx["before"]
        line = error_line(ctx["p"])
        assert "expected (batch, time, features)" in line or "AssertionError" in line, line
        assert not (ctx["dir"] / "r.json").exists()


def test_04_loss_of_output_and_target_that_asserts_shapes(cli):
    ctx = cli["loss_assert"]
    with answer():
        assert ctx["after"] == ctx["before"]
        line = error_line(ctx["p"])
        assert "shape_checked_loss" in line or "AssertionError" in line or "output (4, 1)" in line, line
        assert not (ctx["dir"] / "r.json").exists()


@pytest.mark.parametrize("name,needles", [
    ("spec_needs_args", ("needs_args", "hidden")),
    ("spec_loss_constant", ("LOSS_WEIGHT", "not callable")),
    ("spec_data_parallel", ("module.0.weight",)),
])
def test_05_model_and_loss_specs_refused(cli, name, needles):
    ctx = cli[name]
    with answer():
        line = error_line(ctx["p"])
        assert all(n in line for n in needles), line
        assert ctx["after"] == ctx["before"] and not (ctx["dir"] / "r.json").exists()


def test_05_module_instance_spec_is_used_as_the_model(cli):
    ctx = cli["spec_module_instance"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        if one_line_or_report(p) == "refused":
            assert "MODEL" in error_line(p)
            return
        assert p.returncode == 1
        assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)


# ======================================================================================== captures
def test_06a_cuda_capture_on_a_cpu_only_machine(cli):
    ctx = cli["cuda_capture"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        if one_line_or_report(p) == "refused":
            assert "cuda" in error_line(p).lower()
            return
        assert p.returncode == 1
        assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)


def _fix(ctx):
    return strict_json(ctx["dir"] / "r.json")["findings"][0]["fix"] or ""


def test_06b_twin_the_cpu_captures_fix_names_cpu_autocast(cli):
    assert 'device_type="cpu"' in _fix(cli["control"])


def test_06b_cuda_captures_fix_disables_the_autocast_it_ran_under(cli):
    ctx = cli["cuda_capture"]
    if ctx["p"].returncode == 2:
        return                                                   # (refused: test_06a judged the line)
    with answer():
        fix = _fix(ctx)
        assert 'device_type="cpu"' not in fix, fix


def test_07_zip_weights_with_extra_pickle_members_never_run(cli):
    ctx = cli["zip_extra_members"]
    p = ctx["p"]
    with answer():
        assert not ctx["marker"].exists(), "a pickle inside the capture ran"
        assert ctx["after"] == ctx["before"]
        if one_line_or_report(p) == "refused":
            return
        assert p.returncode == 1
        assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)


# ======================================================================================== run directories
def test_08_two_runs_interleaved_under_one_run_index(cli):
    ctx = cli["runs_interleaved"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        if one_line_or_report(p) == "refused":
            assert "steps.jsonl" in error_line(p)
            return
        top = findings(ctx["dir"] / "r.json")[:3]
        assert p.returncode == 1 and ("overflow", "0", 4, "error") in top, (p.returncode, top)


def test_08_twin_two_runs_appended(cli):
    ctx = cli["runs_appended"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        assert one_line_or_report(p) == "report"  # (valid input: one run after the other is no mix)
        top = findings(ctx["dir"] / "r.json")[:3]
        assert p.returncode == 1 and ("overflow", "0", 4, "error") in top, (p.returncode, top)


def test_09_step_ten_to_the_ninth(cli):
    ctx = cli["step_1e9"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        assert one_line_or_report(p, ctx["outs"]) == "report"      # valid input: a report
        assert p.returncode == 1
        assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 10 ** 9)
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(ctx["dir"] / "tb"))


# ======================================================================================== flags
def test_10_json_onto_the_out_dirs_index_html(cli):
    ctx = cli["json_is_out_index"]
    p = ctx["p"]
    with answer():
        assert ctx["after"] == ctx["before"]
        if one_line_or_report(p) == "refused":
            assert "--json" in error_line(p) and not (ctx["out"] / "index.html").exists()
            return
        try:
            d = strict_json(ctx["out"] / "index.html")
        except ValueError as e:
            raise AssertionError(f"the --json file is not the JSON report ({e}); stdout: {p.stdout[-300:]}")
        assert d["findings"][0]["rule"] == "overflow"


def test_10_twin_json_beside_the_out_dir(cli):
    ctx = cli["json_beside_out"]
    p = ctx["p"]
    no_traceback(p)
    assert p.returncode == 1
    assert first_finding(ctx["dir"] / "r.json") == ("overflow", "0", 4)
    assert "<html" in (ctx["out"] / "index.html").read_text(encoding="utf-8").lower()
    assert ctx["after"] == ctx["before"]


# ======================================================================================== the Python API
def _train(models, run_dir=None):
    torch.manual_seed(7)
    m = models.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    if run_dir is None:
        train_overflow(m, opt, bad_step=-1, steps=4)
    else:
        with ampdoctor.watch(m, opt, run_dir=run_dir):
            train_overflow(m, opt, bad_step=-1, steps=4)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("kind", ["capture", "data_dir"])
def test_11_watch_into_a_capture_or_a_data_dir_with_its_own_manifest(helpers, base_run, tmp_path, kind):
    models = helpers["models"]
    if kind == "capture":
        target = copy(os.path.join(base_run, "captures", "4"), tmp_path / "cap")
    else:
        target = tmp_path / "data"
        target.mkdir()
        (target / "manifest.json").write_text('{"files": ["a.wav", "b.wav"], "sample_rate": 16000}\n')
        (target / "a.wav").write_bytes(b"RIFF\0\0\0\0WAVE")
    before = snapshot(target)
    plain = _train(models)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        watched = _train(models, str(target))
    assert set(plain) == set(watched) and all(torch.equal(plain[k], watched[k]) for k in plain)
    after = snapshot(target)
    with answer():
        changed = sorted(k for k in before if after.get(k) != before[k])
        assert changed == [], changed                          # every file that was there is as it was
        told = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        assert any(str(target) in t for t in told), told        # and the user is told the records stay in memory
        if kind == "capture":
            rep = ampdoctor.replay(str(target), model=models.mlp(), loss_fn=models.scalar_loss, shadow=False,
                                   whatif=False, fix_search=False)
            f0 = rep.findings[0]
            assert (f0.rule, f0.module, f0.step) == ("overflow", "0", 4), f0.to_dict()
