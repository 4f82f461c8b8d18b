"""Tests of ampdoctor/integrations/lightning.py: AmpDoctorLightningCallback inside a real Lightning Trainer (CPU).

Precision on CPU: "bf16-mixed" works as on a GPU (autocast, no scaler). `precision="16-mixed"` with
`accelerator="cpu"` is rewritten by Lightning to "bf16-mixed" (with a warning), so the fp16 + GradScaler path
is exercised by passing Lightning's own plugin explicitly, `MixedPrecision("16-mixed", "cpu", scaler=...)`:
the same plugin class "16-mixed" builds on a GPU, with CPU autocast in float16 and `GradScaler("cpu")`.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.optim.optimizer as _optim

L = pytest.importorskip("lightning.pytorch")

import ampdoctor  # noqa: E402
from ampdoctor.integrations import AmpDoctorLightningCallback  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

STEPS = 4


class Regressor(L.LightningModule):
    """training_step calls a submodule, not self(...): the watched root's forward never runs."""

    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        return F.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def fit(tmp_path, cb, module=None, **kw):
    torch.manual_seed(0)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[cb], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(tmp_path), gradient_clip_val=1.0, **kw)
    module = module or Regressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.fit(module, loader())
    assert [str(w.message) for w in caught if "ampdoctor" in str(w.message)] == []
    return tr, module


def fp16_plugin(init_scale=2.0 ** 8):
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def assert_healthy(rep):
    assert [(f.rule, f.message) for f in rep.findings if f.severity in ("error", "warning")] == []
    assert not any(f.rule == "clip_before_unscale" for f in rep.findings)


def assert_unhooked(module):
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())
    assert not _optim._global_optimizer_pre_hooks


def test_bf16_mixed_healthy(tmp_path):
    cb = AmpDoctorLightningCallback(every=1)
    tr, module = fit(tmp_path, cb, precision="bf16-mixed")
    rep = cb.report
    assert_healthy(rep)
    tl = rep.data["timeline"]
    # one record per optimizer step, each with its own loss and gradients: Lightning's step(closure) runs
    # forward/backward inside the optimizer step, and the callback keeps them in the step they belong to
    assert [r["step"] for r in tl] == list(range(STEPS))
    assert all(r["loss"] is not None and r["grad_norm"] is not None and r["scale"] is None for r in tl)
    net2 = next(x for x in rep.data["layers"] if x["module"] == "net.2")
    assert net2["calls"] == STEPS and net2["absmax_out"] > 0 and net2["absmax_grad"] > 0
    assert (tmp_path / "ampdoctor" / "report.json").exists()
    assert [f.rule for f in ampdoctor.diagnose(tmp_path / "ampdoctor").findings] == [f.rule for f in rep.findings]
    assert tr.logged_metrics["ampdoctor/skipped_steps"] == 0 and "ampdoctor/loss_scale" not in tr.logged_metrics
    assert_unhooked(module)


def test_16_mixed_string_on_cpu_becomes_bf16(tmp_path):
    cb = AmpDoctorLightningCallback()
    tr, _ = fit(tmp_path, cb, precision="16-mixed")
    assert tr.precision == "bf16-mixed"  # Lightning's choice on CPU; no GradScaler to watch
    assert cb.report is not None and cb.report.data["timeline"][0]["scale"] is None


def test_fp16_plugin_healthy_unscale_before_clip(tmp_path):
    cb = AmpDoctorLightningCallback(run_dir=tmp_path / "ad", every=1)
    tr, module = fit(tmp_path, cb, plugins=[fp16_plugin()])
    rep = cb.report
    assert_healthy(rep)
    tl = rep.data["timeline"]
    assert [r["scale"] for r in tl] == [256.0] * STEPS and not any(r["skipped"] for r in tl)
    calls = [(c["kind"], c["stage"]) for c in rep.data["calls"] if c["step"] == 1 and not c["internal"]]
    assert calls == [("zero_grad", None), ("scale", None), ("unscale_", "READY"), ("clip_grad_norm_", "UNSCALED"),
                     ("step", "UNSCALED"), ("optimizer.step", "UNSCALED"), ("update", None)]
    assert json.loads((tmp_path / "ad" / "report.json").read_text())["summary"]["steps"] == STEPS
    assert tr.logged_metrics["ampdoctor/loss_scale"] == 256.0
    assert_unhooked(module)


def test_fp16_plugin_overflow_is_logged(tmp_path):
    cb = AmpDoctorLightningCallback(every=1)
    tr, _ = fit(tmp_path, cb, plugins=[fp16_plugin(init_scale=2.0 ** 40)])
    tl = cb.report.data["timeline"]
    assert tl[0]["skipped"] and tl[0]["scale"] == 2.0 ** 40
    assert tr.logged_metrics["ampdoctor/skipped_steps"] >= 1
    assert tr.logged_metrics["ampdoctor/loss_scale"] < 2.0 ** 40


def test_exception_still_writes_the_report(tmp_path):
    cb = AmpDoctorLightningCallback(every=1)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, cb, module=Regressor(fail_at=2), precision="bf16-mixed")
    assert cb.watch is None and (tmp_path / "ampdoctor" / "report.json").exists()
    assert cb.report.summary["steps"] == 2


def test_fp16_plugin_forward_overflow_is_named_at_the_layer(tmp_path):
    """A layer whose fp16 output overflows, in a module whose training_step calls a submodule: the callback's
    report names that layer."""
    cb = AmpDoctorLightningCallback(every=1)
    module = Regressor()
    with torch.no_grad():
        module.net[0].weight.mul_(1e5)
    fit(tmp_path, cb, module=module, plugins=[fp16_plugin()])
    top = [(f.rule, f.module) for f in cb.report.findings[:3]]
    assert ("overflow", "net.0") in top, [f.one_line() for f in cb.report.findings]


def test_headroom_every_step_through_the_callback(tmp_path):
    cb = AmpDoctorLightningCallback(headroom=True)
    tr, module = fit(tmp_path, cb, precision="bf16-mixed")
    assert_healthy(cb.report)
    from ampdoctor.rundir import read_run
    steps = read_run(str(tmp_path / "ampdoctor"))[1]
    routine = [r for r in steps if not r.sampled]
    assert routine and all(r.headroom and any(v is not None for v in r.headroom["fwd"]) for r in routine)
    assert_unhooked(module)
