"""Entry modules (ampdoctor/record/entries.py): a watched model whose own forward the loop never calls.

A Lightning-style container whose training step calls `self.net(x)` (and keeps its loss function as a module), and a
two-stage pipeline calling `self.head(self.body(x))`: the modules called at top level take the root's part, so a
failure on an unsampled step is captured (the manifest's `extra.entry` names the module the batch went into) and the
replay runs that module of the model, with the watched model's module names. Each failing case has its own oracle
(forward hooks: the first module whose output is non-finite from finite inputs, at which step) and a twin that calls
the root's forward; the healthy run is quiet and bitwise identical with and without the watch. The CLI replays the
capture from disk with the user's factory, and refuses (one line, exit 2) a model that lacks the entry module.

Written failing first: without entries.py the uncalled container's report was `nan_origin at (run) step 7` (no
capture, no module).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import ampdoctor
from probe_harness import finite, load_models, run_cli, stderr_lines

BAD = 7
SRC = '''
import torch
from torch import nn


class Lit(nn.Module):
    """A Lightning-style container: the network, its loss as a module, a forward the training step never calls."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x):
        return self.net(x)


class Stages(nn.Module):
    """Two stages the loop chains itself: head(body(x))."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.head(self.body(x))


class NoNet(nn.Module):
    """A model without the entry module the capture names."""

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(16, 4)

    def forward(self, x):
        return self.other(x)


def lit():
    torch.manual_seed(0)
    return Lit()


def stages():
    torch.manual_seed(0)
    return Stages()


def nonet():
    torch.manual_seed(0)
    return NoNet()
'''


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("entry_models")
    return {"dir": str(d), "mod": load_models(d, "entry_models", SRC)}


def _first_bad(model):
    """The oracle: forward hooks noting the first (module, step) whose output is non-finite from finite inputs."""
    state = {"step": 0, "first": None}

    def hook(name):
        def h(mod, args, out):
            if state["first"] is None and finite(args) and not finite(out):
                state["first"] = (name, state["step"])
        return h
    hs = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    return state, hs


def _train(model, kind, steps, run_dir=None, bad=BAD, oracle=False):
    """The loop: fp16 autocast + GradScaler; `kind` says what the step calls: "child" (model.net and the loss
    module), "chain" (model.head(model.body(x))), "root" (model(x))."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir) if run_dir is not None else None
    st, hs = _first_bad(model) if oracle else ({}, [])
    g = torch.Generator().manual_seed(0)
    losses, skipped = [], []
    for i in range(steps):
        st["step"] = i
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        if i == bad:
            x = x * 60000  # raw sensor units: past fp16's range at the first Linear's input cast
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            if kind == "child":
                loss = model.loss_fn(model.net(x).float(), y)
            elif kind == "chain":
                loss = nn.functional.cross_entropy(model.head(model.body(x)).float(), y)
            else:
                loss = nn.functional.cross_entropy(model(x).float(), y)
        s0 = sc.get_scale()
        sc.scale(loss).backward()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        if sc.get_scale() < s0:
            skipped.append(i)
    for h in hs:
        h.remove()
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return {"rep": rep, "losses": losses, "skipped": skipped, "first": st.get("first"), "w": w,
            "weights": [p.detach().clone() for p in model.parameters()]}


def _top3(rep):
    return [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]


@pytest.mark.parametrize("kind,producer", [("child", "net.0"), ("chain", "body.0"), ("root", "net.0")])
def test_failure_on_an_unsampled_step_is_located_through_the_called_modules(tmp_path, helpers, kind, producer):
    model = (helpers["mod"].stages if kind == "chain" else helpers["mod"].lit)()
    orc = _train((helpers["mod"].stages if kind == "chain" else helpers["mod"].lit)(), kind, 12, oracle=True)
    assert orc["first"] == (producer, BAD), orc["first"]  # the oracle: the first Linear's input cast overflows
    assert BAD in orc["skipped"] and not math.isfinite(orc["losses"][BAD]), orc
    r = _train(model, kind, 12, run_dir=tmp_path / "run")
    assert ("overflow", producer, BAD, "error") in _top3(r["rep"]), _top3(r["rep"])
    errs = [(f.rule, f.module) for f in r["rep"].findings if f.severity == "error" and f.module not in (None,)]
    assert all(m == producer for _, m in errs), errs  # nothing blamed on the container or the later layers
    caps = sorted((tmp_path / "run").glob("captures/*/manifest.json"))
    assert len(caps) == 1, caps
    extra = json.loads(caps[0].read_text())["extra"]
    want = {"child": "net", "chain": "body", "root": None}[kind]
    assert extra.get("entry") == want, extra  # the batch the net received, not the loss module's


def test_healthy_run_through_the_called_modules_is_quiet_and_unchanged(tmp_path, helpers):
    plain = _train(helpers["mod"].lit(), "child", 30, bad=-1)
    watched = _train(helpers["mod"].lit(), "child", 30, run_dir=tmp_path / "run", bad=-1)
    assert plain["losses"] == watched["losses"]  # bitwise
    assert all(torch.equal(a, b) for a, b in zip(plain["weights"], watched["weights"]))
    assert watched["losses"][-1] < watched["losses"][0]
    bad = [f.one_line() for f in watched["rep"].findings if f.severity in ("warning", "error")]
    assert bad == [], bad
    assert watched["w"].machine.entries and set(watched["w"].machine.entries.values()) == {"net"}
    assert not list((tmp_path / "run").glob("captures/*/manifest.json"))  # nothing went bad: no capture


def test_cli_replays_the_entry_capture_and_refuses_a_model_without_it(tmp_path, helpers):
    r = _train(helpers["mod"].lit(), "child", 12, run_dir=tmp_path / "run")
    cap = next((tmp_path / "run").glob("captures/*/manifest.json")).parent
    p = run_cli(helpers, "replay", cap, "--model", "entry_models:lit", "--json", tmp_path / "r.json", "--no-html")
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    found = json.loads((tmp_path / "r.json").read_text())["findings"]
    assert any(f["rule"] == "overflow" and f["module"] == "net.0" and f["severity"] == "error" for f in found[:3]), \
        [(f["rule"], f["module"]) for f in found[:3]]
    before = sorted(p.name for p in cap.iterdir())
    p = run_cli(helpers, "replay", cap, "--model", "entry_models:nonet", "--no-html")
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = stderr_lines(p)
    assert len(lines) == 1 and "'net'" in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert sorted(p.name for p in cap.iterdir()) == before
    assert r["rep"] is not None


@pytest.mark.parametrize("entry", [5, ["net"], "", "net/../x", "net." * 300 + "x"])
def test_a_capture_naming_no_module_name_is_refused_in_one_line(tmp_path, helpers, entry):
    from probe_harness import edit_manifest
    _train(helpers["mod"].lit(), "child", 12, run_dir=tmp_path / "run")
    cap = next((tmp_path / "run").glob("captures/*/manifest.json")).parent
    extra = json.loads((cap / "manifest.json").read_text())["extra"]
    edit_manifest(cap, extra=dict(extra, entry=entry))
    before = {p.name: p.read_bytes() for p in cap.iterdir()}
    p = run_cli(helpers, "replay", cap, "--model", "entry_models:lit", "--no-html")
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = stderr_lines(p)
    assert len(lines) == 1 and "entry" in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert {p.name: p.read_bytes() for p in cap.iterdir()} == before
