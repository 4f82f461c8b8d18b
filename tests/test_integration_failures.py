"""Failures diagnosed through the framework integrations: fp16 failures (and healthy twins) driven through a real
Hugging Face `transformers.Trainer` with `AmpDoctorCallback` and a real Lightning `Trainer` with
`AmpDoctorLightningCallback`, on the CPU, at the callbacks' default settings (ampdoctor's default sampling).

How fp16 runs on the CPU here (as tests/test_integrations_hf.py, tests/test_integrations_lightning.py and
tests/test_hf_failures4.py do):
- Trainer: accelerate refuses `fp16=True` without a GPU, so after the Trainer is built its Accelerator gets the three
  attributes `Accelerator.__init__` sets for CUDA fp16 (`scaler = GradScaler("cpu")` with accelerate's default
  settings, `native_amp = True`, `state._mixed_precision = "fp16"`); everything after (prepare's autocast-wrapped
  forward with fp32 outputs, `accelerator.backward` -> `scaler.scale(loss).backward()`, `clip_grad_norm_` ->
  `unscale_`, `AcceleratedOptimizer.step` -> `scaler.step` + `update`) is accelerate's own code.
- Lightning: Lightning's own plugin `MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))` (`precision=
  "16-mixed"` on a CPU is rewritten to bf16).

Step numbering: the contract's `Finding.step` is ampdoctor's OPTIMIZER step, 0-based. The Trainer's
`state.global_step` read in `on_step_begin` is the number of optimizer steps already taken, i.e. the same 0-based
index (a step the GradScaler skips still counts in both; with gradient accumulation one step is 4 micro-batches, and
the index is the optimizer step, not the micro-batch). Lightning's `trainer.global_step` read in
`on_train_batch_start` is the same index. Every case's expected step is the one this test's oracle measured in
those terms.

Failures (the rule expected among the first three findings, at the producing module, at the step):
 1. Trainer, tiny LlamaForCausalLM: a TrainerCallback (a "bad update" / a weight surgery gone wrong) multiplies layer
    1's MLP (gate/up/down_proj) by 300 at optimizer step 3; the SwiGLU product (~1e4) is finite, `down_proj`'s mm is
    not -> overflow at `model.layers.1.mlp.down_proj`, step 3.
 2. Trainer, tiny GPT2LMHeadModel with gradient_accumulation_steps=2: layer 0's MLP `c_fc` (a Conv1D, addmm)
    multiplied by 1e6 at optimizer step 2 -> overflow at `transformer.h.0.mlp.c_fc`, step 2 (the optimizer step,
    not micro-batch 4).
 3. Trainer, tiny Llama SFT with `label_smoothing_factor=0.1` and completion-only labels (TRL's
    DataCollatorForCompletionOnlyLM sets every label of an example to -100 when the response template was
    truncated away: "Could not find response key ... This instance will be ignored in loss calculation"); the batch
    of step 3 is two such examples. The Trainer's LabelSmoother (outside the model) divides by 0 active tokens: NaN
    loss at step 3, the model's outputs finite, its gradients zero (no skip) -> nan_origin with module None, step 3.
 4. Trainer with gradient_accumulation_steps=4 on a tabular regressor (a plain nn.Module returning {"loss"}), one
    bad micro-batch: example 37 (micro-batch 1 of optimizer step 2, sequential sampler) has an un-normalised column
    (2e5, a raw income field the preprocessing missed); the fp16 cast in the first Linear makes +inf -> overflow at
    `net.0`, step 2; the scaler skips step 2 only.
 5. Trainer with max_grad_norm=1.0 and a custom `compute_loss` (a hand-written binary cross-entropy
    `-(y log p + (1 - y) log(1 - p))` on `sigmoid(logit)`, the classic copy of the formula): as the classifier
    grows confident a positive example's logit passes ~17, sigmoid rounds to exactly 1.0 in float32, log(1 - p) is
    log(0) = -inf and 0 * -inf = NaN; the model's outputs are finite -> nan_origin with module None at the first
    step this happens (measured by the oracle; a natural onset, mid-run).
 6. Lightning automatic optimization with gradient_clip_val=1.0: a self-attention block that forgot the 1/sqrt(d)
    scale (`q @ k^T` in fp16); a Lightning Callback multiplies its q/k projections by 300 at step 3 -> overflow at
    `attn` (the scores matmul inside it; q and k themselves finite), step 3.
 7. Lightning manual optimization (`self.manual_backward`): from step 3 (after a warm-up phase) the user clips with
    `self.clip_gradients(opt, 0.5, "value")` between manual_backward and `opt.step()`; under 16-mixed the unscale_
    happens inside `opt.step()`, so the clip reads (and clamps) gradients still multiplied by the loss scale ->
    clip_before_unscale, step 3.
 8. Lightning manual optimization where the user steps the torch optimizer directly (`opt.optimizer.step()`, the one
    inside the LightningOptimizer) after `self.manual_backward(loss)`: SGD applies the scaled gradients, the scaler
    never steps or updates -> scaler_misorder, step 0 (a code-structure bug, present from the first step).

Healthy twins (no warning and no error; finite losses that fall):
 H1. the Llama of 1 and 3 through the Trainer with label smoothing and completion tokens in every batch;
 H2. the tabular regressor of 4 with accumulation 4 and the column normalised;
 H3. the attention block of 6 (scaled by 1/sqrt(d)) through Lightning with gradient_clip_val, no blow-up;
 H4. the manual optimization of 7 with the value clip moved into `on_before_optimizer_step` (after Lightning's
     unscale_).

The oracles (independent of ampdoctor): forward hooks on every module (with kwargs) note the first (module, step) whose
output is non-finite while its inputs and own parameters were finite (hooks fire children first, so the first hit is
the innermost producer); this test's own callbacks record the scale after each optimizer step (a skip shows as a
backoff) and every micro-batch's loss; for the clip cases the GradScaler's per-optimizer stage at the clip and the
size of the gradients clipped; for the raw step, the gradients the optimizer applied compared with the loss scale.

ampdoctor got wrong: nothing here (no xfail). Every failure is named at the producer (or, for the NaN made in the
loss outside the model and for the call-order rules, with module None as the contract says), with the right rule,
severity error and step, first in the report; the healthy twins are quiet. Noted only: the clip_before_unscale
message for a VALUE clip (`clip_grad_value_`) speaks of "the scaled norm was clipped".
"""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
T = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
L = pytest.importorskip("lightning.pytorch")

import ampdoctor  # noqa: E402,F401
from ampdoctor.integrations import AmpDoctorCallback, AmpDoctorLightningCallback  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from probe_harness import at_top3, falls, finite, quiet_report  # noqa: E402
from scenarios import lines, no_error_at, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


# ---------------------------------------------------------------------------------------------------- the oracle

class Producer:
    """Forward hooks on every module: the first (module, step) whose output is non-finite while its inputs
    (positional and keyword) and its own parameters were finite; `step` is set by the caller (the optimizer step).
    `nonfinite_out`: the steps at which any module's output was non-finite."""

    def __init__(self, m):
        self.step, self.first, self.nonfinite_out = 0, None, set()
        self.hs = [mod.register_forward_hook(self._hook(n), with_kwargs=True) for n, mod in m.named_modules()]

    def _hook(self, n):
        def f(mod, args, kwargs, out):
            if not mod.training:
                return
            if not finite(out):
                self.nonfinite_out.add(self.step)
                if (self.first is None and finite(args) and finite(kwargs)
                        and all(torch.isfinite(p).all() for p in mod.parameters(recurse=False))):
                    self.first = (n, self.step)
        return f

    def remove(self):
        for h in self.hs:
            h.remove()


# ------------------------------------------------------------------------------------ Trainer (fp16 on CPU)

@pytest.fixture()
def fp16_on_cpu(monkeypatch):
    """Give a Trainer's Accelerator what Accelerator.__init__ gives it for CUDA fp16, on CPU (accelerate's default
    GradScaler settings); everything after is accelerate's own code."""
    def force(acc):
        monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu"))
        monkeypatch.setattr(acc, "native_amp", True)
        monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")
        return acc
    return force


class _Rec(T.TrainerCallback):
    """This test's record of a Trainer run: the scale after each optimizer step; the oracle's step."""

    def __init__(self, acc, prod=None):
        self.acc, self.prod, self.scales = acc, prod, []

    def on_step_begin(self, args, state, control, **kw):
        if self.prod is not None:
            self.prod.step = state.global_step

    def on_step_end(self, args, state, control, **kw):
        self.scales.append(self.acc.scaler.get_scale())


class _Inject(T.TrainerCallback):
    """A bad update, once: `fn(model)` under no_grad at the start of optimizer step `k`."""

    def __init__(self, k, fn):
        self.k, self.fn, self.done = k, fn, False

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step == self.k and not self.done:
            self.done = True
            with torch.no_grad():
                self.fn(model)


class _LossTrainer(T.Trainer):
    """The Trainer, noting each micro-batch's loss (with its optimizer step) as compute_loss returns it."""

    def compute_loss(self, model, inputs, *a, **kw):
        out = super().compute_loss(model, inputs, *a, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        self.micro = getattr(self, "micro", []) + [(self.state.global_step, float(loss.detach()))]
        return out

    def step_losses(self):
        """The mean loss of each optimizer step (NaN if any micro-batch's was)."""
        by = {}
        for k, v in self.micro:
            by.setdefault(k, []).append(v)
        return [sum(v) / len(v) for _, v in sorted(by.items())]


class _Data(torch.utils.data.Dataset):
    def __init__(self, item, n):
        self.item, self.n = item, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.item(i)


def _trainer(tmp_path, model, data, steps, cls=_LossTrainer, **kw):
    cb = AmpDoctorCallback()
    args = T.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=steps,
                               lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                               report_to=[], disable_tqdm=True, seed=0, train_sampling_strategy="sequential",
                               **{"per_device_train_batch_size": 2, "learning_rate": 1e-3, **kw})
    tr = cls(model=model, args=args, train_dataset=data, callbacks=[cb])
    return tr, cb


def _run(tr, fp16_on_cpu, inject=None):
    """Force fp16 on the Trainer's Accelerator, put the oracle on the model, train; returns (report, oracle, rec)."""
    acc = fp16_on_cpu(tr.accelerator)
    prod = Producer(tr.model)
    rec = _Rec(acc, prod)
    tr.add_callback(rec)
    if inject is not None:
        tr.add_callback(inject)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr.train()
    finally:
        prod.remove()
    cb = next(c for c in tr.callback_handler.callbacks if isinstance(c, AmpDoctorCallback))
    return cb.report, prod, rec


def llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64))


def gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                                          bos_token_id=0, eos_token_id=0))


def _lm_item(i):
    x = torch.randint(1, 120, (16,), generator=torch.Generator().manual_seed(i % 6))
    return {"input_ids": x, "labels": x}


def _sft_item(empty=()):
    """A prompt (8 tokens, labels -100) then a completion (8 tokens, learned); examples in `empty`: the response
    template was truncated away, every label -100."""
    def item(i):
        x = torch.randint(1, 120, (16,), generator=torch.Generator().manual_seed(i % 6))
        lab = x.clone()
        lab[:8] = -100
        if i in empty:
            lab[:] = -100
        return {"input_ids": x, "labels": lab}
    return item


# ==================================================================================================== 1-5: Trainer

def test_1_trainer_llama_mlp_blown_up_at_step_3_overflows_down_proj(tmp_path, fp16_on_cpu):
    def blow(m):
        mlp = m.model.layers[1].mlp
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.mul_(300)
    tr, _ = _trainer(tmp_path, llama(), _Data(_lm_item, 64), 6)
    rep, prod, rec = _run(tr, fp16_on_cpu, _Inject(3, blow))
    assert prod.first == ("model.layers.1.mlp.down_proj", 3), prod.first
    assert rec.scales[:3] == [65536.0] * 3 and rec.scales[3] < rec.scales[2], rec.scales  # real: step 3 skipped
    at_top3(rep, "overflow", "model.layers.1.mlp.down_proj", 3, severity="error")
    no_error_at(rep, {"model.layers.1.mlp", "model.layers.1", "model.norm", "lm_head"})


def test_2_trainer_gpt2_accum2_c_fc_blown_up_at_optimizer_step_2(tmp_path, fp16_on_cpu):
    tr, _ = _trainer(tmp_path, gpt2(), _Data(_lm_item, 64), 5, gradient_accumulation_steps=2)
    rep, prod, rec = _run(tr, fp16_on_cpu, _Inject(2, lambda m: m.transformer.h[0].mlp.c_fc.weight.mul_(1e6)))
    assert prod.first == ("transformer.h.0.mlp.c_fc", 2), prod.first
    assert rec.scales[:2] == [65536.0] * 2 and rec.scales[2] < rec.scales[1], rec.scales
    at_top3(rep, "overflow", "transformer.h.0.mlp.c_fc", 2, severity="error")
    no_error_at(rep, {"transformer.h.0.mlp", "transformer.h.0.mlp.act", "transformer.h.0.mlp.c_proj"})


@pytest.mark.parametrize("empty", [pytest.param((6, 7), id="failure"), pytest.param((), id="H1-healthy")])
def test_3_trainer_label_smoothing_all_ignored_batch_is_nan_outside_the_model(tmp_path, fp16_on_cpu, empty):
    tr, _ = _trainer(tmp_path, llama(), _Data(_sft_item(empty), 64), 6, label_smoothing_factor=0.1)
    rep, prod, rec = _run(tr, fp16_on_cpu)
    losses = tr.step_losses()
    if not empty:
        assert prod.first is None and rec.scales == [65536.0] * 6, rec.scales
        falls(losses, window=1)
        quiet_report(rep, saw_steps=False)
        return
    assert [math.isfinite(v) for v in losses] == [True, True, True, False, True, True], losses
    assert prod.first is None and not prod.nonfinite_out  # the model's outputs were finite throughout
    assert rec.scales == [65536.0] * 6, rec.scales  # zero gradients: nothing skipped
    at_top3(rep, "nan_origin", None, 3, severity="error")


def _tab_item(bad=None):
    """Tabular regression: 8 standardised columns; example `bad` has column 3 un-normalised (2e5)."""
    def item(i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        y = (x[:4].sum() - x[4:].sum()).reshape(1) * 0.5
        if i == bad:
            x[3] = 2e5
        return {"features": x, "labels": y}
    return item


class Tabular(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, features, labels=None):
        out = self.net(features)
        return {"loss": F.mse_loss(out.float(), labels), "logits": out}


@pytest.mark.parametrize("bad", [pytest.param(37, id="failure"), pytest.param(None, id="H2-healthy")])
def test_4_trainer_accum4_one_bad_micro_batch(tmp_path, fp16_on_cpu, bad):
    tr, _ = _trainer(tmp_path, Tabular(), _Data(_tab_item(bad), 4 * 4 * 12), 12, per_device_train_batch_size=4,
                     gradient_accumulation_steps=4, learning_rate=1e-2)
    rep, prod, rec = _run(tr, fp16_on_cpu)
    losses = tr.step_losses()
    if bad is None:
        assert prod.first is None and rec.scales == [65536.0] * 12, rec.scales
        falls(losses, window=1)
        quiet_report(rep, saw_steps=False)
        return
    # real: micro-batch 1 of step 2 (examples 36-39) is the only non-finite one; the scaler skips step 2 only
    assert [k for k, v in tr.micro if not math.isfinite(v)] == [2], tr.micro
    assert [i for i, (k, v) in enumerate(tr.micro) if not math.isfinite(v)] == [9]
    assert prod.first == ("net.0", 2), prod.first
    assert rec.scales == [65536.0] * 2 + [32768.0] * 10, rec.scales
    at_top3(rep, "overflow", "net.0", 2, severity="error")
    no_error_at(rep, {"net.1", "net.2", "net.4", ""})


class _BCETrainer(_LossTrainer):
    """A custom compute_loss: the binary cross-entropy written out by hand on sigmoid probabilities."""

    def compute_loss(self, model, inputs, return_outputs=False, **kw):
        y = inputs.pop("labels")
        out = model(**inputs)
        p = torch.sigmoid(out["logits"].float().squeeze(-1))
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        self.micro = getattr(self, "micro", []) + [(self.state.global_step, float(loss.detach()))]
        self.max_logit = getattr(self, "max_logit", []) + [float(out["logits"].detach().float().max())]
        self.p_one = getattr(self, "p_one", []) + [bool(((p == 1) & (y == 1)).any())]  # log(1 - p) = log(0)
        return (loss, out) if return_outputs else loss


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, features):
        return {"logits": self.net(features)}


def _cls_item(i):
    """Separable classes with a wide margin: the classifier grows confident within a few steps."""
    g = torch.Generator().manual_seed(i)
    y = float(i % 2)
    x = torch.randn(8, generator=g) * 0.5 + (2.0 if y else -2.0)
    return {"features": x, "labels": torch.tensor(y)}


def test_5_trainer_max_grad_norm_custom_compute_loss_log_of_zero_is_nan_outside_the_model(tmp_path, fp16_on_cpu):
    tr, _ = _trainer(tmp_path, Classifier(), _Data(_cls_item, 8 * 12), 12, cls=_BCETrainer,
                     per_device_train_batch_size=8, learning_rate=1e-1, remove_unused_columns=False)
    rep, prod, rec = _run(tr, fp16_on_cpu)
    losses = tr.step_losses()
    onset = next(k for k, v in enumerate(losses) if not math.isfinite(v))
    assert 3 <= onset <= 9, (losses, tr.max_logit)  # mid-run, from confidence the training itself built
    assert all(math.isfinite(v) for v in losses[:onset])
    assert tr.p_one.index(True) == onset and tr.max_logit[onset] > 16, (tr.p_one, tr.max_logit)  # the mechanism
    assert prod.first is None and not prod.nonfinite_out  # the logits were finite: the NaN is the loss's own
    assert rec.scales[onset] < rec.scales[onset - 1] == 65536.0, rec.scales  # the NaN gradients were skipped
    at_top3(rep, "nan_origin", None, onset, severity="error")


# ==================================================================================================== 6-8: Lightning

def fp16_plugin():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


class Attn(nn.Module):
    def __init__(self, d=32, scaled=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.scaled = scaled

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = q @ k.transpose(-1, -2)
        if self.scaled:
            s = s / math.sqrt(x.shape[-1])
        return torch.softmax(s.float(), -1).to(v.dtype) @ v


class SeqNet(L.LightningModule):
    """Embedding -> attention -> LayerNorm -> MLP head, sequence classification (automatic optimization)."""

    def __init__(self, scaled=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 32)
        self.attn = Attn(32, scaled)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3))
        self.losses = []

    def forward(self, x):
        h = self.emb(x)
        h = self.norm(h + self.attn(h))
        return self.head(h.mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _seq_data(n=8 * 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, 4, generator=g)
    y = (x[:, :, 0].sum(1) > 0).long() + (x[:, :, 1].sum(1) > 1).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class _LitOracle(L.Callback):
    """This test's Lightning callback: the oracle's step, the scale after each batch, and an optional bad update
    `fn(module)` at the start of step `k`."""

    def __init__(self, prod, k=None, fn=None):
        self.prod, self.k, self.fn, self.scales = prod, k, fn, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.prod.step = trainer.global_step
        if self.fn is not None and trainer.global_step == self.k:
            with torch.no_grad():
                self.fn(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _lit_fit(tmp_path, module, steps, data, k=None, fn=None, epochs=1, **kw):
    cb = AmpDoctorLightningCallback(log=False)
    prod = Producer(module)
    orc = _LitOracle(prod, k, fn)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=epochs, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(tmp_path), callbacks=[orc, cb], plugins=[fp16_plugin()], **kw)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr.fit(module, data)
    finally:
        prod.remove()
    return cb.report, prod, orc


def _blow_qk(m):
    m.attn.q.weight.mul_(300)
    m.attn.k.weight.mul_(300)


@pytest.mark.parametrize("scaled,fn", [pytest.param(False, _blow_qk, id="failure"),
                                       pytest.param(True, None, id="H3-healthy")])
def test_6_lightning_auto_clip_unscaled_attention_scores_overflow_at_step_3(tmp_path, scaled, fn):
    module = SeqNet(scaled)
    rep, prod, orc = _lit_fit(tmp_path, module, 8, _seq_data(), k=3, fn=fn, gradient_clip_val=1.0)
    if fn is None:
        assert prod.first is None and orc.scales == [65536.0] * 8, orc.scales
        falls(module.losses, window=1)
        quiet_report(rep, saw_steps=False)
        return
    assert prod.first == ("attn", 3), prod.first
    assert orc.scales[:3] == [65536.0] * 3 and orc.scales[3] < 65536.0, orc.scales
    at_top3(rep, "overflow", "attn", 3, severity="error")
    no_error_at(rep, {"attn.q", "attn.k", "norm", "head.0", ""})


class ManualNet(L.LightningModule):
    """Manual optimization: manual_backward, then opt.step(). `mode`:
    "clip_in_step"   -- from step 3, self.clip_gradients(opt, 0.5, "value") before opt.step() (scaled gradients);
    "clip_in_hook"   -- from step 3, the same value clip in on_before_optimizer_step (after Lightning's unscale_);
    "raw_step"       -- opt.optimizer.step(): the torch optimizer inside the LightningOptimizer, no scaler."""

    def __init__(self, mode, opt="adamw"):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.mode, self.opt_kind = mode, opt
        self.losses, self.clip_seen, self.raw_grads = [], [], []

    def _clip(self, opt):
        sc = self.trainer.precision_plugin.scaler
        st = sc._per_optimizer_states[id(opt.optimizer if hasattr(opt, "optimizer") else opt)]["stage"]
        gmax = max(float(p.grad.abs().max()) for p in self.parameters() if p.grad is not None)
        self.clip_seen.append((self.trainer.global_step, getattr(st, "name", str(st)), gmax))
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="value")

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss)
        if self.mode == "raw_step":
            sc = self.trainer.precision_plugin.scaler
            self.raw_grads.append((sc.get_scale(), max(float(p.grad.abs().max()) for p in self.parameters())))
            opt.optimizer.step()
            return
        if self.mode == "clip_in_step" and self.trainer.global_step >= 3:
            self._clip(opt)
        opt.step()

    def on_before_optimizer_step(self, optimizer):
        if self.mode == "clip_in_hook" and self.trainer.global_step >= 3:
            self._clip(optimizer)

    def configure_optimizers(self):
        if self.opt_kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _cls_data(n=8 * 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() * 2 + (x[:, 4:8].sum(1) > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize("mode", [pytest.param("clip_in_step", id="failure"),
                                  pytest.param("clip_in_hook", id="H4-healthy")])
def test_7_lightning_manual_value_clip_before_opt_step_from_step_3(tmp_path, mode):
    module = ManualNet(mode)
    rep, prod, orc = _lit_fit(tmp_path, module, 12, _cls_data(4 * 8), epochs=3)  # 4 batches, 3 epochs
    assert prod.first is None and orc.scales == [65536.0] * 12, orc.scales
    assert [s[0] for s in module.clip_seen] == list(range(3, 12)), module.clip_seen
    if mode == "clip_in_hook":
        assert {s[1] for s in module.clip_seen} == {"UNSCALED"} and max(s[2] for s in module.clip_seen) < 100
        falls(module.losses, window=1)
        quiet_report(rep, saw_steps=False)
        return
    # real: the clip ran before the scaler's unscale_ (stage READY) on gradients ~65536x too large, so clamping them
    # to 0.5 and then unscaling leaves updates of at most 0.5 / 65536
    assert {s[1] for s in module.clip_seen} == {"READY"}, module.clip_seen
    assert min(s[2] for s in module.clip_seen) > 0.5 * 100, module.clip_seen
    _call_rule(rep, "clip_before_unscale", 3)


def _call_rule(rep, rule, step):
    """A call-order rule (no module applies: the contract's module is null) among the first three, an error, at
    optimizer step `step`, its evidence pointing at the user's call in this file."""
    f = next((f for f in rep.findings[:3] if f.rule == rule), None)
    assert f is not None, lines(rep)
    assert f.severity == "error" and f.step == step and f.module is None, (f.one_line(), lines(rep))
    assert os.path.abspath(f.evidence.get("file") or "") == os.path.abspath(__file__), f.evidence
    return f


def test_8_lightning_manual_raw_optimizer_step_bypasses_the_scaler(tmp_path):
    module = ManualNet("raw_step", opt="sgd")
    rep, prod, orc = _lit_fit(tmp_path, module, 6, _cls_data(6 * 8), limit_train_batches=6)
    # real: the torch optimizer applied the scaled gradients (the scale is 65536 and stays: never updated), and
    # Lightning never counted a step
    scale0, g0 = module.raw_grads[0]
    assert scale0 == 65536.0 and g0 > 100, module.raw_grads
    assert orc.scales == [65536.0] * len(orc.scales) and len(module.raw_grads) == 6
    l0, l1 = module.losses[:2]
    assert not math.isfinite(l1) or l1 > 100 * l0, module.losses  # the 65536x too large SGD update blew it up
    _call_rule(rep, "scaler_misorder", 0)


