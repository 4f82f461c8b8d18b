"""`ampdoctor.watch(engine)` on real DeepSpeed engines (CPU accelerator, one process, gloo), and the DeepSpeed
rules on hand-made records.

The engines run in one child process (this file run as a script) so that DeepSpeed's process group and
environment never leak into the other tests; the tests read its JSON. Skipped when deepspeed is not installed
(it is not in the CI install: its first initialize on a CPU compiles a communication op for minutes).
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

from ampdoctor.findings import Finding  # noqa: F401  (the package imports without deepspeed)
from ampdoctor.records import CallEvent, RunMeta, StepRecord
from ampdoctor.rules import RunData, run_rules

HAVE_DS = importlib.util.find_spec("deepspeed") is not None


# -- the scenarios, run in a child process -----------------------------------------------------------------------

def _engine(torch, deepspeed, nn, precision, stage, loss_scale=0):
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": loss_scale, "initial_scale_power": 16, "hysteresis": 2,
                       "min_loss_scale": 1}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
            self.head = nn.Linear(32, 1)

        def forward(self, x, y):
            return (self.head(self.body(x)).float() - y).pow(2).mean()

    m = Net()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return engine


def _train(torch, engine, steps, spike_at=None):
    dt = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    losses = []
    err = None
    try:
        for i in range(steps):
            if i == spike_at:
                with torch.no_grad():
                    engine.module.body[2].weight.mul_(1e5)
            x = torch.randn(8, 16, generator=g).to(dt)
            y = torch.randn(8, 1, generator=g)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    except Exception as e:  # DeepSpeed stops a run whose scale hit min_loss_scale
        err = f"{type(e).__name__}: {e}"[:300]
    return losses, err


def _scenarios(out_path: str) -> None:
    import logging
    import tempfile
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    import deepspeed
    from deepspeed.utils import logger
    logger.setLevel(logging.ERROR)
    import ampdoctor
    res = {"deepspeed": deepspeed.__version__}

    def nhooks(model):
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                   for m in model.modules())

    def watched(name, precision, stage, steps=6, watch_module=False, **kw):
        engine = _engine(torch, deepspeed, nn, precision, stage, kw.pop("loss_scale", 0))
        rd = tempfile.mkdtemp()
        hooks = nhooks(engine.module)  # DeepSpeed's own
        w = (ampdoctor.watch(engine.module, optimizer=engine.optimizer, run_dir=rd, every=1) if watch_module
             else ampdoctor.watch(engine, run_dir=rd, every=1))
        losses, err = _train(torch, engine, steps, **kw)
        w.close()
        rep = w.report()
        again = ampdoctor.diagnose(rd)
        res[name] = {"losses": losses, "error": err, "optimizer": type(engine.optimizer).__name__,
                     "steps": [{"scale": r.scale, "skipped": r.skipped, "loss": r.loss, "grad_norm": r.grad_norm,
                                "kinds": [e.kind for e in r.events],
                                "ds_scale": next((e.extra.get("ds_scale") for e in r.events
                                                  if e.kind == "engine.step"), None)} for r in w.steps],
                     "findings": [f.to_dict() for f in rep.findings],
                     "disk_rules": [(f.rule, f.severity) for f in again.findings],
                     "meta_params": w.meta.params, "scaler": w.meta.scaler,
                     "patched_left": [k for k in ("backward", "step") if k in vars(engine)],
                     "hooks_left": nhooks(engine.module) - hooks}
        return engine

    watched("stage0_fp16", "fp16", 0)
    watched("zero1_fp16", "fp16", 1)
    watched("zero1_module", "fp16", 1, watch_module=True)
    watched("zero1_spike", "fp16", 1, steps=8, spike_at=3)
    watched("zero1_static", "fp16", 1, loss_scale=2 ** 40)
    watched("bf16", "bf16", 0)
    # watching changes nothing: the same run unwatched gives bitwise the same losses and weights
    for how in ("plain", "watched"):
        engine = _engine(torch, deepspeed, nn, "fp16", 1)
        w = ampdoctor.watch(engine, every=1) if how == "watched" else None
        losses, _ = _train(torch, engine, 5)
        if w is not None:
            w.close()
        res[f"identity_{how}"] = {"losses": losses,
                                  "weights": [p.detach().float().flatten().tolist()[:64]
                                              for p in engine.module.parameters()]}
    with open(out_path, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    if not HAVE_DS:
        pytest.skip("deepspeed is not installed (pip install deepspeed; not part of the CI install)")
    out = tmp_path_factory.mktemp("ds") / "runs.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                                   os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0 or not out.exists():
        pytest.fail(f"the DeepSpeed scenarios failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def _rules(run, sev=("error", "warning")):
    return [(f["rule"], f["module"]) for f in run["findings"] if f["severity"] in sev]


def test_every_step_recorded_with_deepspeeds_scale(ds_runs):
    run = ds_runs["zero1_fp16"]
    assert len(run["steps"]) == len(run["losses"]) == 6
    assert all(s["kinds"] == ["engine.backward", "engine.step"] for s in run["steps"])
    assert all(s["scale"] == s["ds_scale"] == 65536.0 for s in run["steps"])
    assert [s["loss"] for s in run["steps"]] == pytest.approx(run["losses"])


def test_healthy_fp16_and_bf16_engines_have_no_warnings(ds_runs):
    for name in ("zero1_fp16", "zero1_module", "bf16"):
        run = ds_runs[name]
        assert _rules(run) == [], (name, run["findings"])
        assert run["disk_rules"] == [[f["rule"], f["severity"]] for f in run["findings"]]
    # the fp16 parameters are updated through DeepSpeed's fp32 master copies: not held by the torch optimizer
    assert all(p[4] is False for p in ds_runs["zero1_fp16"]["meta_params"] if p[2] == "float16")
    assert ds_runs["zero1_fp16"]["scaler"]["dynamic"] is True
    assert ds_runs["bf16"]["scaler"] == {}


def test_watch_module_with_deepspeed_optimizer_finds_the_engine(ds_runs):
    run = ds_runs["zero1_module"]
    assert len(run["steps"]) == 6 and run["steps"][0]["scale"] == 65536.0


def test_stage0_fp16_scale_that_is_never_applied(ds_runs):
    """DeepSpeed 0.19.x, ZeRO-0 + fp16: engine.backward does not scale the loss but the optimizer divides by the
    scale (deepspeedai/DeepSpeed#8393). Named where it happens; absent where the engine applies the scale."""
    run = ds_runs["stage0_fp16"]
    unapplied = any(s["scale"] != s["ds_scale"] for s in run["steps"])
    found = [f for f in run["findings"] if f["rule"] == "scaler_misorder"]
    assert bool(found) == unapplied
    if found:
        assert found[0]["severity"] == "error" and found[0]["op"] is None \
            and found[0]["evidence"]["api"] == "engine.backward"
        assert found[0]["evidence"]["ds_scale"] == 65536.0
    assert not [f for f in run["findings"] if f["rule"] in ("fp16_master_weights", "update_underflow")]


def test_spiked_layer_is_named(ds_runs):
    run = ds_runs["zero1_spike"]
    top = run["findings"][:3]
    assert any(f["rule"] in ("overflow", "nan_origin") and (f["module"] or "").startswith("body.2")
               for f in top), top
    assert any(s["skipped"] for s in run["steps"][3:])


def test_static_loss_scale_that_overflows(ds_runs):
    run = ds_runs["zero1_static"]
    assert all(s["skipped"] for s in run["steps"])
    top = run["findings"][:3]
    f = next(f for f in top if f["rule"] == "skipped_steps")
    assert f["severity"] == "error" and "static loss_scale" in f["message"]
    assert not any(f["rule"] == "loss_scale_collapse" for f in run["findings"])


def test_close_restores_the_engine(ds_runs):
    for name in ("zero1_fp16", "stage0_fp16", "bf16"):
        assert ds_runs[name]["patched_left"] == [] and ds_runs[name]["hooks_left"] == 0


def test_watching_changes_nothing(ds_runs):
    assert ds_runs["identity_plain"] == ds_runs["identity_watched"]


# -- the rules on hand-made records (no DeepSpeed needed) ---------------------------------------------------------

def _run(scales, ds_scale, skipped=(), dynamic=True, config=None):
    meta = RunMeta(scaler={"class": "deepspeed:X", "enabled": True, "init_scale": ds_scale, "dynamic": dynamic,
                           "backoff_factor": 0.5},
                   env={"deepspeed": {"version": "0.19.8", "zero_stage": 0, "optimizer": "FP16_UnfusedOptimizer",
                                      "config": config or {}}})
    steps = [StepRecord(step=i, scale=s, skipped=i in skipped, found_inf=i in skipped,
                        events=[CallEvent("engine.backward", i, 2 * i),
                                CallEvent("engine.step", i, 2 * i + 1, extra={"boundary": True, "ds_scale": ds_scale})])
             for i, s in enumerate(scales)]
    return RunData(meta, steps)


def test_rule_unapplied_scale():
    f = [f for f in run_rules(_run([1.0] * 5, 65536.0)) if f.rule == "scaler_misorder"]
    assert len(f) == 1 and f[0].severity == "error" and "never scaled" in f[0].message
    assert not [f for f in run_rules(_run([65536.0] * 5, 65536.0)) if f.rule == "scaler_misorder"]


def test_rule_static_scale():
    fs = run_rules(_run([2.0 ** 40] * 12, 2.0 ** 40, skipped=range(12), dynamic=False))
    assert [(f.rule, f.severity) for f in fs] == [("skipped_steps", "error")]
    fs = run_rules(_run([128.0] * 12, 128.0, dynamic=False))
    assert [(f.rule, f.severity) for f in fs] == [("skipped_steps", "info")]


def test_rule_config_checks_softened_by_a_clean_run():
    fs = run_rules(_run([65536.0] * 4, 65536.0, config={"fp16": {"enabled": True, "loss_scale_window": 10}}))
    win = [f for f in fs if f.evidence.get("from_config")]
    assert len(win) == 1 and win[0].severity == "info"


if __name__ == "__main__":
    _scenarios(sys.argv[1])
