"""Tests of ampdoctor/integrations/hf.py: AmpDoctorCallback inside a real transformers.Trainer (CPU, offline).

fp16 on CPU: accelerate refuses `fp16=True` without a GPU ("fp16 mixed precision requires a device in ..."),
so the healthy-run tests use two CPU set-ups that exercise the real Trainer/accelerate code:
- `bf16=True, use_cpu=True`: what a CPU user gets (bf16 autocast, no GradScaler);
- the fp16 path of a GPU run, forced on CPU: after the Trainer is built, its Accelerator is given a
  `GradScaler("cpu")` and fp16 mixed precision (CPU autocast supports float16), exactly the three attributes
  `Accelerator.__init__` sets for CUDA fp16. Everything after that (prepare, backward, `clip_grad_norm_` with
  its `unscale_gradients`, `AcceleratedOptimizer.step` -> `scaler.step`/`update`) is accelerate's own code.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ampdoctor  # noqa: E402
from ampdoctor.integrations import AmpDoctorCallback  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

STEPS = 4


class TokenData(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def make_trainer(tmp_path, cb, **kw):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=4,
                             max_steps=STEPS, logging_steps=2, report_to=[], max_grad_norm=1.0,
                             save_strategy="no", disable_tqdm=True, **kw)
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[cb])


@pytest.fixture()
def fp16_on_cpu(monkeypatch):
    """Give a Trainer's Accelerator what Accelerator.__init__ gives it for CUDA fp16, on CPU."""
    def force(trainer, init_scale=2.0 ** 12):
        acc = trainer.accelerator
        monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu", init_scale=init_scale))
        monkeypatch.setattr(acc, "native_amp", True)
        monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")  # shared state: restored after the test
        return acc
    return force


def train(trainer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [w for w in caught if "ampdoctor" in str(w.message)]


def assert_healthy(rep):
    bad = [(f.rule, f.severity, f.message) for f in rep.findings if f.severity in ("error", "warning")]
    assert bad == []
    assert not any(f.rule == "clip_before_unscale" for f in rep.findings)


def test_bf16_cpu_healthy(tmp_path):
    cb = AmpDoctorCallback(every=1)
    tr = make_trainer(tmp_path, cb, bf16=True)
    assert train(tr) == []
    run_dir = tmp_path / "out" / "ampdoctor"  # the default: args.output_dir/ampdoctor
    assert (run_dir / "manifest.json").exists() and (run_dir / "report.json").exists()
    rep = cb.report
    assert_healthy(rep)
    tl = rep.data["timeline"]
    assert [r["step"] for r in tl] == list(range(STEPS))
    assert all(r["loss"] is not None and r["scale"] is None for r in tl)  # bf16: no scaler
    assert any(L["module"] == "transformer.h.1.attn" for L in rep.data["layers"])
    assert cb.watch is None and tr.model._forward_hooks == {} and tr.model.transformer.h[0]._forward_pre_hooks == {}
    saved = json.loads((run_dir / "report.json").read_text())
    assert saved["summary"]["steps"] == STEPS
    assert [f.rule for f in ampdoctor.diagnose(run_dir).findings] == [f.rule for f in rep.findings]
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged and all(h["ampdoctor/skipped_steps"] == 0 and h["ampdoctor/bad_steps"] == 0 for h in logged)
    assert "ampdoctor/loss_scale" not in logged[0]


def test_fp16_scaler_healthy_unscale_before_clip(tmp_path, fp16_on_cpu):
    cb = AmpDoctorCallback(run_dir=tmp_path / "ad", every=1)
    tr = make_trainer(tmp_path, cb)
    acc = fp16_on_cpu(tr)
    assert train(tr) == []
    assert cb.report is not None and (tmp_path / "ad" / "report.json").exists()
    rep = cb.report
    assert_healthy(rep)
    assert [r["scale"] for r in rep.data["timeline"]] == [4096.0] * STEPS
    # the gradient norm is measured right after unscale_ (before clipping): what clip_grad_norm_ saw and returned
    from ampdoctor.rundir import read_run
    # accelerate < 1.16 clips with torch's clip_grad_norm_; 1.16 with get_total_norm + clip_grads_with_norm_
    clip = next(e for e in read_run(str(tmp_path / "ad"))[1][0].events
                if e.kind in ("clip_grad_norm_", "clip_grads_with_norm_"))
    assert clip.total_norm > 1.0  # the clip (max_grad_norm=1.0) did rescale
    assert rep.data["timeline"][0]["grad_norm"] == pytest.approx(clip.total_norm, rel=1e-5)
    kinds = [(c["kind"], c["stage"]) for c in rep.data["calls"] if c["step"] == 0 and not c["internal"]]
    clips = ([("clip_grad_norm_", "UNSCALED")] if clip.kind == "clip_grad_norm_" else
             [("get_total_norm", "UNSCALED"), ("clip_grads_with_norm_", "UNSCALED")])
    assert kinds[:3 + len(clips)] == [("scale", None), ("unscale_", "READY"), *clips, ("step", "UNSCALED")]
    assert cb.watch is None and not {"scale", "unscale_", "step", "update"} & set(vars(acc.scaler))  # unpatched
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged[0]["ampdoctor/loss_scale"] == 4096.0 and logged[0]["ampdoctor/skipped_steps"] == 0


def test_fp16_clip_without_unscale_is_found(tmp_path, fp16_on_cpu, monkeypatch):
    """The control: with accelerate's unscale_gradients switched off, clipping sees scaled gradients."""
    cb = AmpDoctorCallback(every=1)
    tr = make_trainer(tmp_path, cb)
    acc = fp16_on_cpu(tr)
    monkeypatch.setattr(acc, "unscale_gradients", lambda optimizer=None: None)
    train(tr)
    f = cb.report.findings[0]
    assert f.rule == "clip_before_unscale" and f.severity == "error" and f.evidence["loss_scale"] == 4096.0


@pytest.mark.parametrize("optim", [
    "adamw_torch",
    "adamw_torch_fused",  # a fused optimizer is stepped by scaler.step even when it skips
])
def test_overflow_is_logged_and_reported(tmp_path, fp16_on_cpu, optim):
    """A huge initial scale makes the first steps overflow: the scaler skips them, the callback logs it.
    Trainer's default optimizer is adamw_torch_fused, which skips inside its own step."""
    cb = AmpDoctorCallback(every=1)
    tr = make_trainer(tmp_path, cb, optim=optim)
    fp16_on_cpu(tr, init_scale=2.0 ** 40)
    train(tr)
    first_log = next(h for h in tr.state.log_history if "loss" in h)
    assert first_log["ampdoctor/loss_scale"] < 2.0 ** 40  # read from the scaler itself: it backed off
    tl = cb.report.data["timeline"]
    assert tl[0]["scale"] == 2.0 ** 40
    assert tl[0]["skipped"] and first_log["ampdoctor/skipped_steps"] >= 1
    assert cb.report.summary["skipped_steps"] >= 1


def test_train_twice_appends_a_run(tmp_path):
    cb = AmpDoctorCallback()
    tr = make_trainer(tmp_path, cb, bf16=True)
    tr.train()
    tr.train()
    man = json.loads((tmp_path / "out" / "ampdoctor" / "manifest.json").read_text())
    assert len(man["runs"]) == 2 and cb.watch is None


def test_forward_overflow_in_a_trainer_run_is_named_at_the_layer(tmp_path, fp16_on_cpu):
    """Through the callback, a real fp16 overflow (a GPT-2 MLP projection with huge weights) is named at the
    producing layer, with the op from the replay of the captured step."""
    cb = AmpDoctorCallback(run_dir=tmp_path / "ad", every=1)
    tr = make_trainer(tmp_path, cb)
    with torch.no_grad():
        tr.model.transformer.h[1].mlp.c_proj.weight.mul_(3e6)
    fp16_on_cpu(tr)
    train(tr)
    top = [(f.rule, f.module) for f in cb.report.findings[:3]]
    assert ("overflow", "transformer.h.1.mlp.c_proj") in top, [f.one_line() for f in cb.report.findings]
    assert cb.report.exit_code == 1


def test_headroom_every_step_through_the_callback(tmp_path):
    """`AmpDoctorCallback(headroom=True)`: every step (not only sampled ones) has each layer's headroom, and the
    healthy run stays quiet."""
    cb = AmpDoctorCallback(headroom=True)
    tr = make_trainer(tmp_path, cb, bf16=True)
    assert train(tr) == []
    assert_healthy(cb.report)
    from ampdoctor.rundir import read_run
    steps = read_run(str(tmp_path / "out" / "ampdoctor"))[1]
    routine = [r for r in steps if not r.sampled]
    assert routine and all(r.headroom and any(v is not None for v in r.headroom["fwd"]) for r in routine)
