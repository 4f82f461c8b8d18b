"""Capture + replay as a user drives them, end to end: small models trained for real under CPU fp16 autocast with
`torch.amp.GradScaler("cpu", init_scale=1024)` and `ampdoctor.watch(model, optimizer=opt, scaler=scaler,
run_dir=DIR)`; one batch (step 3, step 4 for the pole) is made bad, the watch writes its capture on its own
(`DIR/captures/<step>/`), and that capture is re-run with `ampdoctor.replay(...)` and with `python -m ampdoctor
replay CAPTURE ...` in subprocesses. Held to shared/CONTRACT.md and README ("replay", "Capture", "Command line").

The models live in one helper module written into tmp (`rwf_models`), imported here and named by `--model` /
`--loss` in the CLI calls, so the Python and the CLI side replay the same classes.

Scenarios:
 1. attribution, for each model: exactly one capture, at the bad step; the watch's first error finding and
    `ampdoctor.replay`'s first error finding name the same (rule, module, op, step, phase), and that is the real
    producer:
      mlp   an MLP whose fc2 matmul overflows (then LayerNorm, head): overflow `fc2` aten::addmm
      exp   an exp in a custom loss module inside the model: overflow `crit` aten::exp
      attn  softmax-free (linear) attention, q @ kᵀ overflows: overflow `attn` aten::bmm
      kw    dict batches (input_ids, features, attention_mask) as kwargs, tuple output (logits, hidden): `ff`
      tied  tied embedding / lm head: overflow `head` aten::mm
      bn    BatchNorm model fed raw features beyond fp16's range: the cast in `fc1` (aten::_to_copy)
      drop  dropout before the overflowing fc2: `fc2` aten::addmm
      hf    HF-style forward(x, labels) -> {"loss", "logits"}, no loss_fn: `proj` aten::addmm
 2. backward-only NaN: sqrt of a row norm at 0 behind a clamp(min=0) that does nothing for the gradient; the
    forward is finite. The replay names `norm`, backward, SqrtBackward0, as an error (no loss scale fixes it).
 3. ... and the watch's own report of that run agrees with the replay of its capture.
 4. fp32 shadow: per-module error vs fp32 for every module; small before the overflow, non-finite at it.
 5. fix search ("fewest modules to keep in fp32") for mlp, attn, tied: the set it returns, run in fp32 by this
    test's own code (autocast off around those modules, inputs cast up) on the user's weights and batch at the bad
    step, at the step's loss scale, makes loss and every gradient finite; without it the step is not finite;
    dropping any module of the set breaks it again; the reported output error vs fp32 is small and matches ours.
 6. the capture holds what the step ran on: weights equal to the model at the start of the bad step, kwargs batch
    (keys and tensors), the step's loss scale.
 7. tied embeddings: replay keeps the tie (same Parameter object) and the user's model bitwise unchanged.
 8. BatchNorm: the live model (running stats turned NaN by the bad step, training went on) is bitwise unchanged by
    a replay (bytes of every buffer, num_batches_tracked, train/eval flags, parameter objects), and the RNG too.
 9. dropout: the replay re-draws the step's own dropout mask: the overflowing op's ±inf counts equal those of the
    original training step's output; two replays (different global RNG before each) give the same report.
10. replay twice in a row (API) gives the same report, byte for byte in JSON.
11. CLI `replay CAP --model --loss --json --out` on the mlp capture: exit 1, strict JSON whose findings match the
    contract's schema (rule ids, severities, phases, module names of the model, int steps) and equal the API's;
    HTML under --out; the run dir byte-identical afterwards; a second CLI replay gives the same JSON findings.
12. CLI on the kwargs/tuple-output capture (`--loss` picks the logits) and on the HF-style capture without
    `--loss`: exit 1, the same producer as the API.
13. bad input, CLI (each on its own copy; exit 2, exactly one `ampdoctor: ...` line on stderr, no traceback, no
    --json/--out written, every file of the capture byte-identical): a capture from another model (shapes; other
    names), a truncated state file, corrupted tensor bytes, a foreign file as CAPTURE (a .pt holding a pickle that
    would run code, a zip, a text file), a directory of foreign files, a manifest naming `os.system` or a module
    of ours that leaves a marker when imported (never imported), a missing path, an unknown flag.
14. ... the manifest naming that module is ignored when the user names the model: replay works (exit 1), the
    module is still never imported.
15. bad input, Python API: the same captures raise `BadInput` with a one-line message, and the user's model passed
    to a mismatching replay is left unchanged.

What ampdoctor got wrong (fixed since: `replaychoice.unexplained_skip`):
 - 3: the sqrt-at-0 backward NaN. The watch took the capture of step 4 but its report has no error: its only
   finding is `[info] skipped_steps ... a normal rate for dynamic loss scaling`, and it never replays the capture
   it took (analysis/replaychoice.pick_capture replays only when the report already has an error or a warning).
   `ampdoctor.replay` of that very capture says `[error] overflow` at `norm` (aten::div, SqrtBackward0), finite at
   no loss scale.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field

import pytest
import torch

import ampdoctor
from ampdoctor.capture import load_capture
from ampdoctor.errors import BadInput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = 3          # the bad step of every run but the pole's
POLE_BAD = 4

CONTRACT_RULES = {
    "overflow", "nan_origin", "overflow_risk", "underflow", "loss_scale_collapse", "skipped_steps",
    "clip_before_unscale", "scaler_misorder", "missing_scaler_update", "update_underflow", "fp16_master_weights",
    "mask_value_overflow", "eps_underflow", "precision_loss", "env_tf32", "headroom_trend", "update_spike",
    "deprecated_api", "replay_error"}
SEVERITIES = {"error", "warning", "info"}
PHASES = {"forward", "backward", "optimizer", "scaler", "env", None}
FIELDS = {"rule", "severity", "phase", "module", "op", "step", "message", "fix", "evidence"}

MODELS_SRC = r'''
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """fc2's weights are large: at 20x the usual input its matmul overflows fp16; LayerNorm brings it back."""
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            self.fc2.weight.mul_(3e4)

    def forward(self, x):
        return self.head(self.norm(self.fc2(self.act(self.fc1(x)))))


class ExpLoss(nn.Module):
    def forward(self, logits):
        return torch.exp(logits).mean()


class ExpModel(nn.Module):
    """A custom loss inside the model: exp of fp16 logits (inf past 11.09)."""
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.crit = ExpLoss()

    def forward(self, x):
        return self.crit(self.enc(x))


class LinearAttn(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)       # no softmax, no 1/sqrt(d)
        return (s @ self.v(x)) / x.shape[1]


class AttnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.attn = LinearAttn()
        self.ln = nn.LayerNorm(32)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(self.ln(self.attn(self.inp(x))))


class RowNorm(nn.Module):
    def forward(self, h):
        return torch.sqrt(torch.clamp((h * h).sum(-1), min=0.0))   # the clamp does nothing for the gradient


class PoleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.norm = RowNorm()

    def forward(self, x):
        return self.norm(self.proj(x)).float().mean()


class KwModel(nn.Module):
    """Dict batches (input_ids, features, attention_mask) as kwargs; returns a tuple (logits, hidden)."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.feat = nn.Linear(4, 32)
        self.ff = nn.Linear(32, 32)
        self.lm = nn.Linear(32, 50)
        with torch.no_grad():
            self.ff.weight.mul_(300.0)

    def forward(self, input_ids, features=None, attention_mask=None):
        h = self.emb(input_ids)
        if features is not None:
            h = h + self.feat(features)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        h = self.ff(h)
        return self.lm(h), h


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            self.mix.weight.mul_(50.0)

    def forward(self, ids, gain):
        return self.head(self.mix(self.emb(ids) * gain))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x)))


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(64, 16)
        with torch.no_grad():
            self.fc2.weight.mul_(100.0)

    def forward(self, x):
        return self.fc2(self.drop(self.fc1(x)))


class HFStyle(nn.Module):
    """forward(x, labels) -> {"loss", "logits"}, as a Hugging Face model does."""
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 4)
        with torch.no_grad():
            self.proj.weight.mul_(300.0)

    def forward(self, x, labels=None):
        logits = self.proj(torch.relu(self.body(x)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


def mlp():
    return MLP()


def kw_model():
    return KwModel()


def hf_style():
    return HFStyle()


def wide_mlp():                  # MLP's names, other shapes
    m = MLP()
    m.fc2 = nn.Linear(64, 128)
    m.norm = nn.LayerNorm(128)
    m.head = nn.Linear(128, 1)
    return m


def other():                     # another model altogether
    return nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))


def mean_loss(out, *args, **kwargs):
    return out.float().mean()


def first_mean(out, *args, **kwargs):
    return out[0].float().mean()
'''

EVIL_SRC = '''
import os
os.makedirs(os.path.join(os.environ["RWF_MARKERS"], "imported"), exist_ok=True)


class Boom:
    def __init__(self, *a, **k):
        os.makedirs(os.path.join(os.environ["RWF_MARKERS"], "called"), exist_ok=True)
'''


class Evil:
    """Unpickling this creates a directory: a .pt that runs code when loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


# ------------------------------------------------------------------------------------------------ helpers
def _digest(p):
    if os.path.islink(p):
        return ("link", os.readlink(p))
    if os.path.isdir(p):
        return ("dir",)
    with open(p, "rb") as f:
        return ("file", hashlib.sha256(f.read()).hexdigest())


def snapshot(root) -> dict:
    root = str(root)
    if os.path.isfile(root):
        return {"": _digest(root)}
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in dns + fns:
            p = os.path.join(dp, n)
            out[os.path.relpath(p, root)] = _digest(p)
    return out


def strict_json(path):
    def refuse(tok):
        raise ValueError(f"non-standard JSON token {tok}")
    with open(path, encoding="utf-8") as f:
        return json.loads(f.read(), parse_constant=refuse)


def check_finding(f: dict, modules: set) -> None:
    assert FIELDS <= set(f), f"missing fields {FIELDS - set(f)} in {f}"
    assert f["rule"] in CONTRACT_RULES, f
    assert f["severity"] in SEVERITIES, f
    assert f["phase"] in PHASES, f
    assert f["module"] is None or f["module"] in modules, f
    assert f["op"] is None or (isinstance(f["op"], str) and f["op"]), f
    assert f["step"] is None or (type(f["step"]) is int and f["step"] >= 0), f
    assert isinstance(f["message"], str) and f["message"].strip(), f
    assert isinstance(f["fix"], str), f
    assert isinstance(f["evidence"], dict), f


def error_line(p) -> str:
    """A refused call: exit 2, no traceback, exactly one `ampdoctor: ...` line on stderr."""
    assert p.returncode == 2, f"exit {p.returncode}\nstderr: {p.stderr[-3000:]}\nstdout: {p.stdout[-1500:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ampdoctor: "), p.stderr
    return lines[0]


def key(f):
    if isinstance(f, dict):
        return (f["rule"], f["module"], f["op"], f["step"], f["phase"])
    return (f.rule, f.module, f.op, f.step, f.phase)


def first_error(findings):
    errs = [f for f in findings if (f["severity"] if isinstance(f, dict) else f.severity) == "error"]
    assert errs, "no error finding in:\n" + "\n".join(
        json.dumps(f) if isinstance(f, dict) else f.one_line() for f in findings)
    return errs[0]


def listing(rep):
    return "\n".join(f.one_line() for f in rep.findings)


def finite_tree(out) -> bool:
    if isinstance(out, torch.Tensor):
        return not out.is_floating_point() or bool(torch.isfinite(out).all())
    if isinstance(out, dict):
        return all(finite_tree(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return all(finite_tree(v) for v in out)
    return True


def detach_tree(out):
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, dict):
        return {k: detach_tree(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(detach_tree(v) for v in out)
    return out


def state_bytes(model) -> dict:
    """Every parameter and buffer as (dtype, shape, raw bytes): NaN compared bit for bit."""
    return {k: (v.dtype, tuple(v.shape), v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, v in model.state_dict(keep_vars=True).items()}


@contextlib.contextmanager
def in_fp32(model, names):
    """The user's own way to keep modules in fp32: autocast off around their forward, floating inputs cast up."""
    def up(t):
        return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    patched = []
    try:
        for n in names:
            mod = model.get_submodule(n)
            orig = mod.forward

            def fwd(*a, _orig=orig, **k):
                with torch.autocast("cpu", enabled=False):
                    return _orig(*[up(t) for t in a], **{kk: up(v) for kk, v in k.items()})
            mod.forward = fwd
            patched.append(mod)
        yield
    finally:
        for mod in patched:
            del mod.forward


# ------------------------------------------------------------------------------------------------ the runs
@dataclass
class Run:
    name: str
    model: torch.nn.Module
    factory: type
    loss_of: object
    run_dir: str
    report: object
    caps: list
    bad: int
    state: dict = field(default_factory=dict)    # the model's state_dict at the start of the bad step
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    scale: float = 0.0
    out: object = None                            # the bad step's model output
    rng: torch.Tensor | None = None

    @property
    def cap(self):
        return os.path.join(self.run_dir, "captures", self.caps[0])


def _mean(o, *a, **k):
    return o.float().mean()


def _scalar(o, *a, **k):
    return o.float()


def _first(o, *a, **k):
    return o[0].float().mean()


def _hf_loss(o, *a, **k):
    return o["loss"]


def _train(name, factory, batch, loss_of, root, bad=BAD, steps=6):
    torch.manual_seed(1)
    model = factory()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    rd = os.path.join(root, name)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=rd)
    run = Run(name, model, factory, loss_of, rd, None, [], bad)
    for i in range(steps):
        opt.zero_grad()
        args, kwargs = batch(g, i == bad)
        if i == bad:
            run.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            run.args, run.kwargs, run.scale, run.rng = args, kwargs, sc.get_scale(), torch.get_rng_state()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(*args, **kwargs)
            loss = loss_of(out, *args, **kwargs)
        if i == bad:
            run.out = detach_tree(out)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    run.report = w.report()
    cdir = os.path.join(rd, "captures")
    run.caps = sorted(os.listdir(cdir)) if os.path.isdir(cdir) else []
    return run


def _pole_batch(g, bad):
    x = torch.randn(8, 8, generator=g)
    if bad:
        x[2] = 0.0          # a padding row: h = 0 there, sqrt(0) in the forward, 1/0 in its backward
    return (x,), {}


def _kw_batch(g, bad):
    return (), {"input_ids": torch.randint(0, 50, (4, 6), generator=g),
                "features": torch.randn(4, 6, 4, generator=g) * (300.0 if bad else 1.0),
                "attention_mask": torch.ones(4, 6)}


# name -> (class name in rwf_models, batch(g, bad) -> (args, kwargs), loss_of, bad step)
SPECS = {
    "mlp": ("MLP", lambda g, b: ((torch.randn(8, 16, generator=g) * (20.0 if b else 1.0),), {}), _mean, BAD),
    "exp": ("ExpModel", lambda g, b: ((torch.randn(8, 8, generator=g) * (20.0 if b else 1.0),), {}), _scalar, BAD),
    "attn": ("AttnModel", lambda g, b: ((torch.randn(2, 8, 32, generator=g) * (200.0 if b else 1.0),), {}), _mean,
             BAD),
    "pole": ("PoleModel", _pole_batch, lambda o, *a, **k: o, POLE_BAD),
    "kw": ("KwModel", _kw_batch, _first, BAD),
    "tied": ("TiedLM", lambda g, b: ((torch.randint(0, 40, (4, 6), generator=g),
                                      torch.tensor(300.0 if b else 1.0)), {}), _mean, BAD),
    "bn": ("BNNet", lambda g, b: ((torch.randn(16, 8, generator=g) * (1e5 if b else 1.0),), {}), _mean, BAD),
    "drop": ("DropNet", lambda g, b: ((torch.randn(8, 16, generator=g) * (2000.0 if b else 1.0),), {}), _mean, BAD),
    "hf": ("HFStyle", lambda g, b: ((torch.randn(8, 16, generator=g) * (1000.0 if b else 1.0),),
                                    {"labels": torch.randint(0, 4, (8,), generator=g)}), _hf_loss, BAD),
}

# what the replay (and the watch) must name: (rule, module, op, step, phase)
EXPECT = {
    "mlp": ("overflow", "fc2", "aten::addmm", BAD, "forward"),
    "exp": ("overflow", "crit", "aten::exp", BAD, "forward"),
    "attn": ("overflow", "attn", "aten::bmm", BAD, "forward"),
    "kw": ("overflow", "ff", "aten::addmm", BAD, "forward"),
    "tied": ("overflow", "head", "aten::mm", BAD, "forward"),
    "bn": ("overflow", "fc1", "aten::_to_copy", BAD, "forward"),   # 1e5 does not fit fp16: fc1's autocast cast
    "drop": ("overflow", "fc2", "aten::addmm", BAD, "forward"),
    "hf": ("overflow", "proj", "aten::addmm", BAD, "forward"),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    t = tmp_path_factory.mktemp("replay_workflows")
    helpers = t / "helpers"
    helpers.mkdir()
    (helpers / "rwf_models.py").write_text(MODELS_SRC)
    (helpers / "rwf_evil.py").write_text(EVIL_SRC)
    markers = t / "markers"
    markers.mkdir()
    sys.path.insert(0, str(helpers))
    models = importlib.import_module("rwf_models")
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(helpers), ROOT]), OMP_NUM_THREADS="1",
             PYTHONIOENCODING="utf-8", RWF_MARKERS=str(markers))
    yield {"t": t, "helpers": helpers, "models": models, "env": e, "markers": markers}
    sys.path.remove(str(helpers))
    sys.modules.pop("rwf_models", None)


@pytest.fixture(scope="module")
def runs(env):
    root = str(env["t"] / "runs")
    out = {}
    for name, (cls, batch, loss_of, bad) in SPECS.items():
        out[name] = _train(name, getattr(env["models"], cls), batch, loss_of, root, bad=bad)
    return out


def cli(env, *argv, cwd=None):
    cwd = str(cwd or env["t"] / "cwd")
    os.makedirs(cwd, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "ampdoctor", *map(str, argv)], cwd=cwd, env=env["env"],
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------ 1-3
@pytest.mark.parametrize("name", list(EXPECT))
def test_replay_names_the_producer_and_agrees_with_the_watch(runs, name):
    r = runs[name]
    assert r.caps == [str(BAD)], f"captures {r.caps}; watch:\n{listing(r.report)}"
    watch_first = first_error(r.report.findings)
    assert key(watch_first) == EXPECT[name], listing(r.report)
    rep = ampdoctor.replay(r.cap, model=r.model, loss_fn=None if name in ("exp", "hf") else r.loss_of)
    rf = first_error(rep.findings)
    assert key(rf) == key(watch_first), f"replay:\n{listing(rep)}\nwatch:\n{listing(r.report)}"
    assert rf.severity == "error" and rf.message.strip() and rf.fix.strip()
    assert rep.exit_code == 1 and rep.summary["finite"] is False
    assert rep.findings[0].severity == "error"
    assert rf.module in dict(r.model.named_modules())


def test_backward_only_nan_is_named_by_the_replay(runs):
    r = runs["pole"]
    assert r.caps == [str(POLE_BAD)], r.caps
    assert finite_tree(r.out)                       # the forward was finite: only the backward went bad
    rep = ampdoctor.replay(r.cap, model=r.model)
    f = first_error(rep.findings)
    assert (f.module, f.phase, f.step) == ("norm", "backward", POLE_BAD), listing(rep)
    assert f.rule in ("overflow", "nan_origin") and f.evidence.get("autograd_node") == "SqrtBackward0", listing(rep)
    assert f.op is not None and f.op.startswith("aten::"), f.op
    ss = rep.data["replay"]["scaler_search"]
    assert ss is not None and ss["finite_at"] is None     # no loss scale makes sqrt'(0) finite
    assert rep.exit_code == 1


def test_backward_only_nan_watch_agrees_with_replay(runs):
    r = runs["pole"]
    rep = ampdoctor.replay(r.cap, model=r.model)
    wf = first_error(r.report.findings)
    rf = first_error(rep.findings)
    assert (wf.module, wf.phase, wf.step) == (rf.module, rf.phase, rf.step) == ("norm", "backward", POLE_BAD)


def test_backward_only_nan_run_dir_diagnosis_agrees(runs):
    """The watch saved its replay of that capture (it found an error), so the run directory alone says the same."""
    r = runs["pole"]
    assert any(n.startswith("replay-") for n in os.listdir(r.run_dir)), os.listdir(r.run_dir)
    f = first_error(ampdoctor.diagnose(r.run_dir).findings)
    assert (f.module, f.phase, f.step) == ("norm", "backward", POLE_BAD)


# ------------------------------------------------------------------------------------------------ 4-5
def test_fp32_shadow_reports_the_error_per_module(runs):
    r = runs["mlp"]
    rep = ampdoctor.replay(r.cap, model=r.model, loss_fn=r.loss_of)
    rows = {row["module"]: row["rel_err"] for row in rep.data["replay"]["shadow"]}
    assert set(rows) == {n for n, _ in r.model.named_modules()}, rows
    for m in ("fc1", "act"):                 # before the overflow: fp16 rounding only
        assert rows[m] is not None and 0 <= rows[m] < 1e-2, rows
    assert rows["fc2"] is None or not rows["fc2"] < 1.0, rows     # the overflow: inf vs fp32's finite values
    wi = rep.data["replay"]["whatif"]
    assert wi["float16"]["finite"] is False and wi["bfloat16"]["finite"] is True, wi


def _step_finite(run, names, *, dropout_seed=None):
    """The user's step at the bad batch, the user's own weights and loss scale, `names` kept in fp32."""
    m = run.factory()
    m.load_state_dict(run.state)
    m.train()
    torch.set_rng_state(run.rng)
    with in_fp32(m, names):
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(*run.args, **run.kwargs)
            loss = run.loss_of(out, *run.args, **run.kwargs)
        (loss.float() * run.scale).backward()
    grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)
    return bool(torch.isfinite(loss).all()) and finite_tree(out) and grads_ok, out


@pytest.mark.parametrize("name,want", [("mlp", ["fc2"]), ("attn", ["attn"]), ("tied", ["head"])])
def test_fix_search_set_really_makes_the_step_finite(runs, name, want):
    r = runs[name]
    rep = ampdoctor.replay(r.cap, model=r.model, loss_fn=r.loss_of)
    fix = rep.data["replay"]["fix"]
    assert fix["found"] is True and fix["modules"], fix
    mods = fix["modules"]
    assert all(mn in fix["snippet"] for mn in mods if mn), fix["snippet"]
    ok0, _ = _step_finite(r, [])
    assert not ok0                                         # the step really is broken as it ran
    ok, _ = _step_finite(r, mods)
    assert ok, f"the fix search's set {mods} run in fp32 does not make the step finite"
    for i in range(len(mods)):                             # fewest: no module of the set can go
        assert not _step_finite(r, mods[:i] + mods[i + 1:])[0], f"{mods} is not minimal"
    assert mods == want
    # the output error vs fp32 that replay reports for the fixed step is small, and so is ours
    err = fix.get("output_rel_err_vs_fp32")
    assert err is not None and 0 <= err < 0.05, fix
    _, out_fixed = _step_finite(r, mods)
    m32 = r.factory()
    m32.load_state_dict(r.state)
    out32 = m32(*r.args, **r.kwargs).detach()
    ours = float((out_fixed.detach().float() - out32).norm() / out32.norm())
    assert ours < 0.05 and abs(ours - err) < 0.02, (ours, err)


# ------------------------------------------------------------------------------------------------ 6-10
def test_capture_holds_the_steps_weights_kwargs_batch_and_scale(runs):
    for name in ("mlp", "kw", "hf"):
        r = runs[name]
        c = load_capture(r.cap)
        assert c.step == BAD and c.scaler_state["scale"] == r.scale == 1024.0, (name, c.scaler_state)
        assert set(c.state_dict) == set(r.state), name
        for k, v in r.state.items():
            assert torch.equal(c.state_dict[k], v), (name, k)
        assert len(c.args) == len(r.args) and all(torch.equal(a, b) for a, b in zip(c.args, r.args)), name
        assert set(c.kwargs) == set(r.kwargs), (name, c.kwargs.keys())
        for k, v in r.kwargs.items():
            assert torch.equal(c.kwargs[k], v) and c.kwargs[k].dtype == v.dtype, (name, k)
        assert c.autocast == {"device": "cpu", "dtype": "float16", "enabled": True}


def test_tied_embeddings_stay_tied_and_untouched(runs):
    r = runs["tied"]
    m = r.model
    assert m.head.weight is m.emb.weight
    before = state_bytes(m)
    assert not torch.equal(m.mix.weight, r.state["mix.weight"])   # training went on past the capture
    ampdoctor.replay(r.cap, model=m, loss_fn=r.loss_of)
    assert m.head.weight is m.emb.weight
    assert state_bytes(m) == before


def test_batchnorm_buffers_and_model_are_bitwise_unchanged(runs):
    r = runs["bn"]
    m = r.model
    assert not bool(torch.isfinite(m.bn.running_mean).all())   # the bad step's update turned them NaN/inf
    m.bn.eval()                                                # a mixed train/eval state to keep
    before = state_bytes(m)
    flags = {n: mod.training for n, mod in m.named_modules()}
    params = [id(p) for p in m.parameters()]
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    rep = ampdoctor.replay(r.cap, model=m, loss_fn=r.loss_of)
    assert first_error(rep.findings).module == "fc1"
    assert state_bytes(m) == before, [k for k, v in state_bytes(m).items() if v != before[k]]
    assert {n: mod.training for n, mod in m.named_modules()} == flags
    assert [id(p) for p in m.parameters()] == params
    assert torch.equal(torch.get_rng_state(), rng)
    m.bn.train()


def test_dropout_replay_redraws_the_steps_mask(runs):
    r = runs["drop"]
    orig = r.out                                   # fc2's output at the bad step of the real training
    assert 0 < int(torch.isinf(orig).sum()) < orig.numel()
    torch.manual_seed(5)
    a = ampdoctor.replay(r.cap, model=r.model, loss_fn=r.loss_of)
    torch.manual_seed(6)
    b = ampdoctor.replay(r.cap, model=r.model, loss_fn=r.loss_of)
    ev = next(e for e in a.data["replay"]["ops"] if e["phase"] == "forward" and e["module"] == "fc2")
    assert ev["out_posinf"] == int(torch.isposinf(orig).sum()), (ev, int(torch.isposinf(orig).sum()))
    assert ev["out_neginf"] == int(torch.isneginf(orig).sum())
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


def test_replay_twice_in_a_row_is_the_same(runs, tmp_path):
    r = runs["mlp"]
    a = ampdoctor.replay(r.cap, model=r.model, loss_fn=r.loss_of)
    b = ampdoctor.replay(r.cap, model=r.model, loss_fn=r.loss_of)
    a.save_json(tmp_path / "a.json")
    b.save_json(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    d = strict_json(tmp_path / "a.json")
    for f in d["findings"]:
        check_finding(f, {n for n, _ in r.model.named_modules()})


# ------------------------------------------------------------------------------------------------ CLI
def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_manifest(cap, **fields):
    mp = os.path.join(cap, "manifest.json")
    with open(mp) as f:
        man = json.load(f)
    man.update(fields)
    with open(mp, "w") as f:
        json.dump(man, f)


@pytest.fixture(scope="module")
def bad_inputs(env, runs):
    """name -> (CAPTURE path, extra argv, needle in the stderr line or None). Each on its own copy."""
    d = env["t"] / "bad"
    d.mkdir()
    src = runs["mlp"].cap
    cases = {}
    cases["other_shapes"] = (_copy(src, d / "shapes"), ["--model", "rwf_models:wide_mlp"], "fc2")
    cases["other_model"] = (_copy(src, d / "othermodel"), ["--model", "rwf_models:other"], "match")
    tr = _copy(src, d / "trunc")
    sp = os.path.join(tr, "state.safetensors")
    with open(sp, "r+b") as f:
        f.truncate(os.path.getsize(sp) // 2)
    cases["truncated"] = (tr, ["--model", "rwf_models:mlp"], None)
    co = _copy(src, d / "corrupt")
    tp = os.path.join(co, "tensors.safetensors")
    blob = bytearray(open(tp, "rb").read())
    for i in range(len(blob) - 64, len(blob) - 32):
        blob[i] ^= 0xFF
    open(tp, "wb").write(bytes(blob))
    cases["corrupt"] = (co, ["--model", "rwf_models:mlp"], None)
    pt = d / "weights.pt"
    torch.save({"w": torch.randn(3), "payload": Evil(str(env["markers"] / "unpickled"))}, pt)
    cases["pt_file"] = (str(pt), ["--model", "rwf_models:mlp"], None)
    zp = d / "capture.zip"
    with zipfile.ZipFile(zp, "w") as z:
        z.write(os.path.join(src, "manifest.json"), "manifest.json")
    cases["zip_file"] = (str(zp), ["--model", "rwf_models:mlp"], None)
    txt = d / "notes.txt"
    txt.write_text("not a capture\n")
    cases["text_file"] = (str(txt), ["--model", "rwf_models:mlp"], None)
    fd = d / "foreign_dir"
    fd.mkdir()
    shutil.copy(pt, fd / "model.pt")
    shutil.copy(txt, fd / "manifest.txt")
    cases["foreign_dir"] = (str(fd), ["--model", "rwf_models:mlp"], None)
    osys = _copy(src, d / "os_system")
    _edit_manifest(osys, model_class="os.system")
    cases["os_system"] = (osys, [], "--model")
    evil = _copy(src, d / "evil")
    _edit_manifest(evil, model_class="rwf_evil.Boom")
    cases["evil_module"] = (evil, [], "--model")
    cases["missing"] = (str(d / "no such capture"), ["--model", "rwf_models:mlp"], "no such capture")
    cases["unknown_flag"] = (_copy(src, d / "flag"), ["--model", "rwf_models:mlp", "--frobnicate"], "frobnicate")
    return d, cases


@pytest.fixture(scope="module")
def cli_results(env, runs, bad_inputs):
    """Every CLI call of this module, on a small pool; tests read the results."""
    t = env["t"]
    d, cases = bad_inputs
    before = {"run_mlp": snapshot(runs["mlp"].run_dir), "bad": snapshot(d)}
    calls = {}
    for name, (cap, extra, _) in cases.items():
        calls["bad:" + name] = ["replay", cap, *extra, "--loss", "rwf_models:mean_loss", "--json",
                                t / f"bad_{name}.json", "--out", t / f"bad_{name}_html"]
    evil_named = _copy(cases["evil_module"][0], t / "evil_named")
    before["evil_named"] = snapshot(evil_named)
    mlp = runs["mlp"].cap
    calls["evil_named"] = ["replay", evil_named, "--model", "rwf_models:mlp", "--loss", "rwf_models:mean_loss",
                           "--no-html", "--json", t / "evil_named.json"]
    calls["mlp"] = ["replay", mlp, "--model", "rwf_models:mlp", "--loss", "rwf_models:mean_loss",
                    "--out", t / "mlp out", "--json", t / "mlp.json"]
    calls["mlp2"] = ["replay", mlp, "--model", "rwf_models:mlp", "--loss", "rwf_models:mean_loss", "--no-html",
                     "--json", t / "mlp2.json"]
    calls["kw"] = ["replay", runs["kw"].cap, "--model", "rwf_models:kw_model", "--loss", "rwf_models:first_mean",
                   "--no-html", "--json", t / "kw.json"]
    calls["hf"] = ["replay", runs["hf"].cap, "--model", "rwf_models:hf_style", "--no-html", "--json", t / "hf.json"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futs = {k: pool.submit(cli, env, *argv) for k, argv in calls.items()}
        res = {k: f.result() for k, f in futs.items()}
    res["before"] = before
    res["after"] = {"run_mlp": snapshot(runs["mlp"].run_dir), "bad": snapshot(d),
                    "evil_named": snapshot(evil_named)}
    return res


def test_cli_replay_json_matches_schema_and_the_api(env, runs, cli_results):
    r = runs["mlp"]
    p = cli_results["mlp"]
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not p.stderr.strip(), p.stderr
    d = strict_json(env["t"] / "mlp.json")
    assert isinstance(d, dict) and isinstance(d["findings"], list) and isinstance(d["summary"], dict)
    modules = {n for n, _ in r.model.named_modules()}
    for f in d["findings"]:
        check_finding(f, modules)
    assert key(first_error(d["findings"])) == EXPECT["mlp"]
    assert d["findings"][0]["severity"] == "error"
    api = ampdoctor.replay(r.cap, model=r.model, loss_fn=r.loss_of).to_dict()["findings"]
    strip = [{k: f[k] for k in ("rule", "severity", "phase", "module", "op", "step")} for f in d["findings"]]
    assert strip == [{k: f[k] for k in ("rule", "severity", "phase", "module", "op", "step")} for f in api]
    html = env["t"] / "mlp out" / "index.html"
    assert html.is_file() and "fc2" in html.read_text(encoding="utf-8")
    # replaying never writes into the run dir or its capture
    assert cli_results["after"]["run_mlp"] == cli_results["before"]["run_mlp"]
    # a second CLI replay of the same capture: the same findings
    p2 = cli_results["mlp2"]
    assert p2.returncode == 1, p2.stderr[-3000:]
    assert strict_json(env["t"] / "mlp2.json")["findings"] == d["findings"]


@pytest.mark.parametrize("name", ["kw", "hf"])
def test_cli_replay_of_kwargs_and_hf_style_captures(env, runs, cli_results, name):
    p = cli_results[name]
    assert p.returncode == 1, p.stderr[-3000:]
    d = strict_json(env["t"] / f"{name}.json")
    modules = {n for n, _ in runs[name].model.named_modules()}
    for f in d["findings"]:
        check_finding(f, modules)
    assert key(first_error(d["findings"])) == EXPECT[name]


BAD_CASES = ["other_shapes", "other_model", "truncated", "corrupt", "pt_file", "zip_file", "text_file",
             "foreign_dir", "os_system", "evil_module", "missing", "unknown_flag"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_cli_bad_input_is_one_line_exit_2_and_nothing_changes(env, bad_inputs, cli_results, case):
    d, cases = bad_inputs
    p = cli_results["bad:" + case]
    line = error_line(p)
    needle = cases[case][2]
    if needle:
        assert needle in line, line
    assert not p.stdout.strip(), p.stdout[-2000:]
    assert not (env["t"] / f"bad_{case}.json").exists()
    assert not (env["t"] / f"bad_{case}_html").exists()
    path = cases[case][0]
    rel = os.path.relpath(path, d)
    b, a = cli_results["before"]["bad"], cli_results["after"]["bad"]
    mine_b = {k: v for k, v in b.items() if k == rel or k.startswith(rel + os.sep)}
    mine_a = {k: v for k, v in a.items() if k == rel or k.startswith(rel + os.sep)}
    assert mine_a == mine_b
    assert a == b                                  # nothing anywhere among the bad inputs changed
    assert not os.listdir(env["markers"]), os.listdir(env["markers"])   # nothing imported, called or unpickled


def test_cli_capture_naming_a_module_is_ignored_when_the_user_names_the_model(env, cli_results):
    p = cli_results["evil_named"]
    assert p.returncode == 1, p.stderr[-3000:]
    d = strict_json(env["t"] / "evil_named.json")
    assert key(first_error(d["findings"])) == EXPECT["mlp"]
    assert cli_results["after"]["evil_named"] == cli_results["before"]["evil_named"]
    assert not os.listdir(env["markers"]), os.listdir(env["markers"])


API_CASES = ["other_shapes", "other_model", "truncated", "corrupt", "pt_file", "zip_file", "text_file",
             "foreign_dir", "os_system", "evil_module", "missing"]


@pytest.mark.parametrize("case", API_CASES)
def test_api_bad_input_is_a_one_line_bad_input(env, runs, bad_inputs, case):
    d, cases = bad_inputs
    path, extra, needle = cases[case]
    models = env["models"]
    m = {"other_shapes": models.wide_mlp, "other_model": models.other}.get(case, models.mlp)()
    if case in ("os_system", "evil_module"):
        m = None
    before = state_bytes(m) if m is not None else None
    snap = snapshot(path) if os.path.exists(path) else None
    with pytest.raises(BadInput) as e:
        ampdoctor.replay(path, model=m, loss_fn=models.mean_loss)
    msg = str(e.value)
    assert msg.strip() and "\n" not in msg, msg
    if needle and needle != "no such capture":
        assert needle in msg, msg
    if m is not None:
        assert state_bytes(m) == before
    assert (snapshot(path) if os.path.exists(path) else None) == snap
    assert not os.listdir(env["markers"]), os.listdir(env["markers"])
