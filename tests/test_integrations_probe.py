"""Probes: ampdoctor driven through the integrations the way a user drives them (README "Where you train"), on
the CPU, with real libraries and no mocks.

- Hugging Face `Trainer` + `AmpDoctorCallback` (tiny GPT-2 / BERT / T5 from configs; gradient accumulation 4,
  `max_grad_norm`, warmup schedulers): healthy runs must be quiet; failures injected mid-run by this test's own
  code (a layer's weight multiplied at optimizer step K from a `TrainerCallback`, a growing input, NaN in one
  batch of the dataset) must give the right rule at the producing module at the right *optimizer* step (the
  Trainer's `global_step`, not the micro-batch index) among the first three findings;
- Lightning + `AmpDoctorLightningCallback`: automatic optimization (gradient_clip_val, accumulate_grad_batches=2)
  and manual optimization, healthy and with a weight blown up at step K;
- a plain loop with `accelerate.Accelerator` and `ampdoctor.watch`;
- the callback's run directory through `ampdoctor report RUN_DIR`.

fp16 on CPU: accelerate refuses `fp16=True` without a GPU, so (as tests/test_integrations_hf.py does) the fp16
probes give the Accelerator the three attributes `Accelerator.__init__` sets for CUDA fp16 (a
`GradScaler("cpu")`, `native_amp`, `mixed_precision="fp16"`); everything after is accelerate's own code.
Lightning: `MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))`, Lightning's own plugin.

Every injected failure is checked to be real by this test's own forward hooks (independent of ampdoctor): the
module really turns finite inputs into inf/NaN, first at the step the probe expects.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import ampdoctor  # noqa: E402
from scenarios import one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

K = 6  # the optimizer step (0-based) at which injected failures start
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- helpers ------------------------------------------------------------------------------------------------

def alarms(rep):
    return [(f.rule, f.severity, f.module, f.step, f.message) for f in rep.findings
            if f.severity in ("error", "warning")]


def top3(rep):
    return [(f.rule, f.module, f.step) for f in rep.findings[:3]]


def lines(rep):
    return [f.one_line() for f in rep.findings[:6]] + [f.message for f in rep.findings[:3]]


def run_quietly(fn):
    """Run `fn()`; return the ampdoctor warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "ampdoctor" in str(w.message).lower()]


class FirstBad:
    """This test's own check that a failure is real: a forward hook on `module` noting the steps (`step()`) at
    which it turned finite floating inputs (positional and keyword) into a non-finite output (inf only for
    `kind="inf"`, NaN only for "nan")."""

    def __init__(self, module, step, kind="nonfinite"):
        self.steps = []
        self.kind = kind
        self.step = step
        self.h = module.register_forward_hook(self, with_kwargs=True)

    def __call__(self, m, args, kwargs, out):
        if not m.training:
            return
        outs = [t for t in _tensors(out) if t.is_floating_point()]
        ins = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        if not outs or not all(torch.isfinite(t).all() for t in ins):
            return
        test = {"inf": torch.isinf, "nan": torch.isnan}.get(self.kind, lambda t: ~torch.isfinite(t))
        if any(test(t).any() for t in outs):
            self.steps.append(self.step())

    @property
    def first(self):
        return self.steps[0] if self.steps else None


def _tensors(x):
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict) or hasattr(x, "values") and hasattr(x, "keys"):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def no_module_made_it(model, step, k):
    """FirstBad on every module: none turned finite inputs into NaN/inf up to step k (the data did)."""
    return [FirstBad(m, step) for m in model.modules()], lambda fbs: all(
        fb.first is None or fb.first > k for fb in fbs)


# -- Hugging Face Trainer -------------------------------------------------------------------------------------

def _hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")


class LMData(torch.utils.data.Dataset):
    def __init__(self, n, seq=16, vocab=100):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(2, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class ClsData(torch.utils.data.Dataset):
    """Token classification data with real padding: the last few positions of every other sample are masked."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(2, 100, (16,), generator=torch.Generator().manual_seed(i))
        mask = torch.ones(16, dtype=torch.long)
        if i % 2:
            mask[-5:] = 0
            ids[-5:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": int(ids[0] % 2)}


class RegressionStream(torch.utils.data.IterableDataset):
    """BERT regression samples in order (an IterableDataset: the Trainer does not shuffle it); sample number
    `nan_at` carries NaN in its `field` ("labels" or "inputs_embeds")."""

    def __init__(self, n, nan_at=None, field="labels"):
        self.n, self.nan_at, self.field = n, nan_at, field

    def __iter__(self):
        for i in range(self.n):
            g = torch.Generator().manual_seed(i)
            emb = torch.randn(16, 32, generator=g) * 0.5
            y = torch.randn((), generator=g)
            if i == self.nan_at:
                if self.field == "labels":
                    y = torch.tensor(float("nan"))
                else:
                    emb[3, 5] = float("nan")
            yield {"inputs_embeds": emb, "labels": y}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


def tiny_bert(num_labels=2):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=num_labels)
    if num_labels == 1:
        cfg.problem_type = "regression"
    return BertForSequenceClassification(cfg)


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return T5ForConditionalGeneration(cfg)


def trainer(tmp_path, model, data, cb, *, steps, precision="bf16", accum=4, callbacks=(), eval_dataset=None, **kw):
    from transformers import Trainer, TrainingArguments
    opts = dict(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=2,
                gradient_accumulation_steps=accum, max_steps=steps, learning_rate=5e-4, max_grad_norm=1.0,
                warmup_steps=5, lr_scheduler_type="cosine", logging_steps=5, save_strategy="no", report_to=[],
                disable_tqdm=True, seed=0)
    opts.update(kw)
    args = TrainingArguments(bf16=precision == "bf16", **opts)
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=eval_dataset, callbacks=[cb, *callbacks])


@pytest.fixture()
def fp16_on_cpu(monkeypatch):
    """Give a Trainer's Accelerator what Accelerator.__init__ gives it for CUDA fp16, on CPU (default
    GradScaler settings, as accelerate builds it)."""
    def force(acc, **scaler_kw):
        monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu", **scaler_kw))
        monkeypatch.setattr(acc, "native_amp", True)
        monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")
        return acc
    return force


def blow_up_at(step_k, name, factor):
    """A TrainerCallback multiplying `name`'s weight by `factor` at the beginning of optimizer step `step_k`."""
    from transformers import TrainerCallback

    class BlowUp(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step == step_k:
                with torch.no_grad():
                    model.get_submodule(name).weight.mul_(factor)
    return BlowUp()


def assert_quiet_run(rep, steps, warned):
    assert warned == []
    assert alarms(rep) == []
    assert rep.exit_code == 0
    assert rep.summary["bad_steps"] == 0
    assert [r["step"] for r in rep.data["timeline"]] == list(range(steps))  # optimizer steps, not micro-batches


def test_hf_gpt2_bf16_accum4_clip_cosine_warmup_is_quiet(tmp_path):
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_gpt2(), LMData(400), cb, steps=24)
    warned = run_quietly(tr.train)
    assert tr.state.global_step == 24
    assert_quiet_run(cb.report, 24, warned)
    assert alarms(ampdoctor.diagnose(tmp_path / "out" / "ampdoctor")) == []


def test_hf_gpt2_bf16_gradient_checkpointing_is_quiet(tmp_path):
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    import dataclasses
    from transformers import TrainingArguments
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    flag = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    cb = AmpDoctorCallback(every=2)
    tr = trainer(tmp_path, tiny_gpt2(), LMData(200), cb, steps=12, accum=2, **{flag: True})
    warned = run_quietly(tr.train)
    assert getattr(tr.model, "is_activation_checkpointing", None) or tr.model.is_gradient_checkpointing
    assert_quiet_run(cb.report, 12, warned)


def test_hf_t5_bf16_every1_linear_warmup_is_quiet(tmp_path):
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    cb = AmpDoctorCallback(every=1)
    tr = trainer(tmp_path, tiny_t5(), LMData(200), cb, steps=16, accum=2, lr_scheduler_type="linear")
    warned = run_quietly(tr.train)
    assert_quiet_run(cb.report, 16, warned)


def test_hf_bert_fp16_scaler_accum4_padding_is_quiet(tmp_path, fp16_on_cpu):
    """fp16 autocast + accelerate's GradScaler (default init scale 2**16), padded attention masks, accumulation
    4, clipping, warmup: no warning, no error (the scaler's first backoffs, if any, are info)."""
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_bert(), ClsData(400), cb, steps=20, precision="fp16", learning_rate=1e-3,
                 lr_scheduler_type="linear")
    fp16_on_cpu(tr.accelerator)
    warned = run_quietly(tr.train)
    rep = cb.report
    assert warned == [] and alarms(rep) == [], lines(rep)
    assert [r["step"] for r in rep.data["timeline"]] == list(range(20))
    assert all(r["scale"] is not None for r in rep.data["timeline"])


@pytest.mark.parametrize("every,evals", [(None, False), (1, False), (None, True)])
def test_hf_gpt2_fp16_weight_blown_up_at_step_k_accum4(tmp_path, fp16_on_cpu, every, evals):
    """A TrainerCallback multiplies transformer.h.1.mlp.c_proj's weight by 3e6 at optimizer step K (each step is
    4 micro-batches): its fp16 output overflows from then on. overflow@c_proj@K (K, not 4K). With `evals`, the
    Trainer also evaluates every 4 steps (eval forwards under autocast between the optimizer steps)."""
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    name = "transformer.h.1.mlp.c_proj"
    cb = AmpDoctorCallback(every=every)
    ev = dict(eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=4, eval_dataset=LMData(8)) if evals \
        else {}
    tr = trainer(tmp_path, tiny_gpt2(), LMData(400), cb, steps=12, precision="fp16",
                 callbacks=[blow_up_at(K, name, 3e6)], **ev)
    fp16_on_cpu(tr.accelerator)
    real = FirstBad(tr.model.get_submodule(name), lambda: tr.state.global_step)
    run_quietly(tr.train)
    assert real.first == K  # the failure is real, and starts at optimizer step K
    if evals:
        assert [h["step"] for h in tr.state.log_history if "eval_loss" in h] == [4, 8, 12]
    rep = cb.report
    assert rep.exit_code == 1 and rep.summary["first_bad_step"] == K, lines(rep)
    assert ("overflow", name, K) in top3(rep), lines(rep)


def test_hf_t5_fp16_ff_weight_blown_up_at_step_k(tmp_path, fp16_on_cpu):
    """T5's feed-forward output projection (the classic fp16 T5 overflow) made large at step K, accumulation 2.
    (torch's CPU fp16 matmul returns NaN, not inf, when its sums pass 65504: overflow or nan_origin, at wo.)"""
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    name = "encoder.block.1.layer.1.DenseReluDense.wo"
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_t5(), LMData(200), cb, steps=10, accum=2, precision="fp16",
                 callbacks=[blow_up_at(K, name, 3e6)])
    fp16_on_cpu(tr.accelerator)
    real = FirstBad(tr.model.get_submodule(name), lambda: tr.state.global_step)
    run_quietly(tr.train)
    assert real.first == K
    rep = cb.report
    assert rep.exit_code == 1, lines(rep)
    assert {("overflow", name, K), ("nan_origin", name, K)} & set(top3(rep)), lines(rep)


def test_hf_gpt2_fp16_default_scaler_accum4_is_quiet(tmp_path, fp16_on_cpu):
    """fp16 GPT-2 with accelerate's default GradScaler (init 2**16), accumulation 4, clipping, cosine warmup."""
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_gpt2(), LMData(400), cb, steps=24, precision="fp16")
    fp16_on_cpu(tr.accelerator)
    warned = run_quietly(tr.train)
    rep = cb.report
    assert warned == [] and alarms(rep) == [], lines(rep)
    assert [r["step"] for r in rep.data["timeline"]] == list(range(24))


class _BoostGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1e9  # an fp16 gradient: +-inf


# (was a strict xfail: the Function applied by c_fc's own forward hook was attributed to the next module, act)
def test_hf_gpt2_fp16_backward_overflow_in_a_layer_at_step_k(tmp_path, fp16_on_cpu):
    """From optimizer step K, transformer.h.1.mlp.c_fc's backward multiplies its fp16 output gradient by 1e9
    (a forward hook wraps its output in a custom Function): the gradient leaving c_fc becomes inf while the one
    reaching it is finite. overflow@c_fc@K (backward)."""
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    name = "transformer.h.1.mlp.c_fc"
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_gpt2(), LMData(400), cb, steps=12, precision="fp16")
    fp16_on_cpu(tr.accelerator)
    layer = tr.model.get_submodule(name)
    layer.register_forward_hook(
        lambda m, i, out: _BoostGrad.apply(out) if m.training and tr.state.global_step >= K else None)
    real = []

    def bw(m, gin, gout):
        if all(torch.isfinite(g).all() for g in gout if g is not None) and \
                any(not torch.isfinite(g).all() for g in gin if g is not None):
            real.append(tr.state.global_step)
    layer.register_full_backward_hook(bw)
    run_quietly(tr.train)
    assert real[:1] == [K]
    rep = cb.report
    assert rep.exit_code == 1 and ("overflow", name, K) in top3(rep), lines(rep)


def test_hf_gpt2_fp16_weight_growing_each_step(tmp_path, fp16_on_cpu):
    """A TrainerCallback multiplies c_proj's weight by 4 at every optimizer step from step 2 (a runaway layer):
    the first step whose fp16 output overflows (found by this test's hook) is the one to name."""
    _hf()
    from transformers import TrainerCallback
    from ampdoctor.integrations import AmpDoctorCallback
    name = "transformer.h.0.mlp.c_proj"

    class Grow(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step >= 2:
                with torch.no_grad():
                    model.get_submodule(name).weight.mul_(4.0)
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_gpt2(), LMData(400), cb, steps=14, precision="fp16", callbacks=[Grow()])
    fp16_on_cpu(tr.accelerator)
    real = FirstBad(tr.model.get_submodule(name), lambda: tr.state.global_step)
    run_quietly(tr.train)
    k = real.first
    assert k is not None and 4 <= k < 13
    rep = cb.report
    assert rep.summary["first_bad_step"] == k, lines(rep)
    assert ("overflow", name, k) in top3(rep), lines(rep)


class Growing(torch.nn.Module):
    """A small regressor trained by the Trainer (a plain nn.Module returning {"loss": ...})."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(64, 32)
        with torch.no_grad():
            self.proj.weight.uniform_(0.4, 0.6)
            self.proj.bias.zero_()
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x, labels=None):
        out = self.head(self.norm(self.proj(x))).squeeze(-1)
        return {"loss": F.mse_loss(out.float(), labels), "logits": out}


class GrowingStream(torch.utils.data.IterableDataset):
    """Samples in order whose magnitude doubles every `per_step` samples (one optimizer step): 4 * 2**s at step s.
    proj's output is ~33.6x the input: fp16's 65504 is passed first at step 9 (inputs ~2048, still finite)."""

    def __init__(self, per_step, steps):
        self.per_step, self.steps = per_step, steps

    def __iter__(self):
        for i in range(self.per_step * self.steps):
            g = torch.Generator().manual_seed(i)
            scale = 4.0 * 2.0 ** (i // self.per_step)
            yield {"x": scale * (1 + 0.1 * torch.rand(64, generator=g)), "labels": torch.randn((), generator=g)}


def test_hf_fp16_growing_input_overflows_at_the_first_layer(tmp_path, fp16_on_cpu):
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    cb = AmpDoctorCallback()
    model = Growing()
    tr = trainer(tmp_path, model, GrowingStream(8, 12), cb, steps=12, precision="fp16", learning_rate=1e-4)
    fp16_on_cpu(tr.accelerator)
    real = FirstBad(model.proj, lambda: tr.state.global_step)
    run_quietly(tr.train)
    assert real.first == 9
    rep = cb.report
    assert ("overflow", "proj", 9) in top3(rep), lines(rep)


@pytest.mark.parametrize("precision,field", [("bf16", "labels"), ("fp16", "labels"), ("bf16", "inputs_embeds")])
def test_hf_bert_nan_in_one_batch_is_the_data(tmp_path, fp16_on_cpu, precision, field):
    """One sample of the dataset (in optimizer step K's third micro-batch) holds NaN: the data, not a layer —
    nan_origin with module null (the contract's bad batch) at step K."""
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    cb = AmpDoctorCallback()
    per_step = 2 * 4
    data = RegressionStream(per_step * 12, nan_at=K * per_step + 5, field=field)
    tr = trainer(tmp_path, tiny_bert(num_labels=1), data, cb, steps=12, precision=precision)
    if precision == "fp16":
        fp16_on_cpu(tr.accelerator)
    fbs, clean = no_module_made_it(tr.model, lambda: tr.state.global_step, K)
    nan_loss = []
    tr.model.register_forward_hook(
        lambda m, i, out: nan_loss.append(tr.state.global_step) if not torch.isfinite(out.loss) else None)
    run_quietly(tr.train)
    assert nan_loss[:1] == [K] and clean(fbs)  # the loss went NaN at step K, and no layer made the NaN
    rep = cb.report
    assert rep.summary["first_bad_step"] == K, lines(rep)
    assert ("nan_origin", None, K) in top3(rep), lines(rep)
    assert not any(f.module and f.rule in ("nan_origin", "overflow") and f.step == K for f in rep.findings[:1]), \
        lines(rep)


# -- the CLI on a Trainer's run directory ----------------------------------------------------------------------

def cli_report(run_dir, tmp_path):
    out = tmp_path / "html"
    js = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(run_dir), "--out", str(out), "--json",
                        str(js)], capture_output=True, text=True, cwd=REPO, timeout=120)
    return p, (json.loads(js.read_text()) if js.exists() else None), out


def test_cli_report_on_a_healthy_trainer_run(tmp_path):
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_gpt2(), LMData(200), cb, steps=8, accum=2)
    tr.train()
    p, js, out = cli_report(tmp_path / "out" / "ampdoctor", tmp_path)
    assert p.returncode == 0, p.stderr
    assert [f for f in js["findings"] if f["severity"] in ("error", "warning")] == []
    assert js["summary"]["steps"] == 8
    assert (out / "index.html").exists()


def test_cli_report_on_a_failing_trainer_run(tmp_path, fp16_on_cpu):
    _hf()
    from ampdoctor.integrations import AmpDoctorCallback
    name = "transformer.h.0.mlp.c_proj"
    cb = AmpDoctorCallback()
    tr = trainer(tmp_path, tiny_gpt2(), LMData(200), cb, steps=9, accum=2, precision="fp16",
                 callbacks=[blow_up_at(K, name, 3e6)])
    fp16_on_cpu(tr.accelerator)
    real = FirstBad(tr.model.get_submodule(name), lambda: tr.state.global_step)
    tr.train()
    assert real.first == K
    run_dir = tmp_path / "out" / "ampdoctor"
    assert any((run_dir / "captures").iterdir())  # the bad step's capture
    p, js, out = cli_report(run_dir, tmp_path)
    assert p.returncode == 1, p.stderr
    assert ("overflow", name, K) in [(f["rule"], f["module"], f["step"]) for f in js["findings"][:3]], \
        [(f["rule"], f["module"], f["step"]) for f in js["findings"][:5]]
    assert (out / "index.html").exists()


# -- Lightning ------------------------------------------------------------------------------------------------

def _lightning():
    return pytest.importorskip("lightning.pytorch")


def lit_classes(L):
    class Net(L.LightningModule):
        """Automatic optimization; training_step calls submodules; AdamW with a warmup LambdaLR per step. From
        optimizer step `blow_at` on, body.3's weight is multiplied by `factor` (once, at that step's first
        micro-batch)."""

        def __init__(self, blow_at=None, factor=1e5):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                            torch.nn.Linear(64, 64), torch.nn.GELU())
            self.head = torch.nn.Linear(64, 4)
            self.blow_at, self.factor, self.blown = blow_at, factor, False

        def on_train_batch_start(self, batch, batch_idx):
            if self.blow_at is not None and not self.blown and self.trainer.global_step == self.blow_at:
                with torch.no_grad():
                    self.body[3].weight.mul_(self.factor)
                self.blown = True

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.head(self.body(x)).float(), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 8))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Manual(Net):
        """Manual optimization: manual_backward, optionally self.clip_gradients before opt.step()."""

        def __init__(self, blow_at=None, factor=1e5, clip=False, accum=1):
            super().__init__(blow_at, factor)
            self.automatic_optimization = False
            self.clip, self.accum = clip, accum
            self.stage_at_clip = []

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = F.cross_entropy(self.head(self.body(x)).float(), y)
            if self.accum > 1:  # manual gradient accumulation: step every `accum` batches
                self.manual_backward(loss / self.accum)
                if (batch_idx + 1) % self.accum == 0:
                    opt.step()
                    opt.zero_grad()
                    self.lr_schedulers().step()
                return
            opt.zero_grad()
            self.manual_backward(loss)
            if self.clip:
                sc = self.trainer.precision_plugin.scaler
                st = sc._per_optimizer_states[id(opt.optimizer)]["stage"] if sc is not None else None
                self.stage_at_clip.append(getattr(st, "name", st))
                self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            self.lr_schedulers().step()
            self.log("train_loss", loss)

    return Net, Manual


def lit_data(n):
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def fp16_plugin():
    from lightning.pytorch.plugins import MixedPrecision
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def lit_fit(tmp_path, cb, module, steps, **kw):
    L = _lightning()
    torch.manual_seed(0)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, log_every_n_steps=5,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(tmp_path), callbacks=[cb], **kw)
    warned = run_quietly(lambda: tr.fit(module, lit_data(8 * 2 * steps)))
    return tr, warned


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_lightning_auto_clip_accum2_is_quiet(tmp_path, precision):
    L = _lightning()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    Net, _ = lit_classes(L)
    cb = AmpDoctorLightningCallback()
    kw = {"plugins": [fp16_plugin()]} if precision == "fp16" else {"precision": "bf16-mixed"}
    tr, warned = lit_fit(tmp_path, cb, Net(), 24, gradient_clip_val=1.0, accumulate_grad_batches=2, **kw)
    assert tr.global_step == 24
    assert_quiet_run(cb.report, 24, warned)


def test_lightning_manual_fp16_is_quiet(tmp_path):
    L = _lightning()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    _, Manual = lit_classes(L)
    cb = AmpDoctorLightningCallback()
    tr, warned = lit_fit(tmp_path, cb, Manual(), 20, plugins=[fp16_plugin()])
    assert tr.global_step == 20
    assert_quiet_run(cb.report, 20, warned)


def test_lightning_manual_fp16_clip_gradients_before_step_clips_scaled_grads(tmp_path):
    """Lightning's manual-optimization recipe (`self.clip_gradients(opt, ...)` between manual_backward and
    opt.step()) under "16-mixed": the scaler has not unscaled yet (checked here: its stage is READY), so the clip
    reads gradients 65536x too large. That is clip_before_unscale."""
    L = _lightning()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    _, Manual = lit_classes(L)
    cb = AmpDoctorLightningCallback()
    module = Manual(clip=True)
    lit_fit(tmp_path, cb, module, 10, plugins=[fp16_plugin()])
    assert module.stage_at_clip and set(module.stage_at_clip) == {"READY"}  # real: clipping scaled gradients
    assert any(f.rule == "clip_before_unscale" for f in cb.report.findings[:3]), lines(cb.report)


def test_lightning_auto_fp16_accum2_weight_blown_up_at_step_k(tmp_path):
    L = _lightning()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    Net, _ = lit_classes(L)
    cb = AmpDoctorLightningCallback()
    module = Net(blow_at=K, factor=1e5)
    real = FirstBad(module.body[3], lambda: module.trainer.global_step)
    lit_fit(tmp_path, cb, module, 12, plugins=[fp16_plugin()], gradient_clip_val=1.0, accumulate_grad_batches=2)
    assert real.first == K
    rep = cb.report
    assert rep.exit_code == 1 and ("overflow", "body.3", K) in top3(rep), lines(rep)


@pytest.mark.parametrize("accum", [1, 2])
def test_lightning_manual_fp16_weight_blown_up_at_step_k(tmp_path, accum):
    """Manual optimization (with `accum=2`: opt.step() every second batch); body.3's weight x1e5 at the first
    batch of optimizer step K (trainer.global_step counts opt.step() calls)."""
    L = _lightning()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    _, Manual = lit_classes(L)
    cb = AmpDoctorLightningCallback()
    module = Manual(blow_at=K, factor=1e5, accum=accum)
    real = FirstBad(module.body[3], lambda: module.trainer.global_step)
    lit_fit(tmp_path, cb, module, 12, plugins=[fp16_plugin()])
    assert real.first == K
    rep = cb.report
    assert rep.exit_code == 1 and ("overflow", "body.3", K) in top3(rep), lines(rep)


class _NaNAt(torch.utils.data.Dataset):
    def __init__(self, n, nan_at=None, grow=False, per_step=16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        if grow:  # positive, doubling every optimizer step (2 batches of 8)
            self.x = (1 + 0.1 * torch.rand(n, 16, generator=g)) * 4.0 * 2.0 ** (torch.arange(n) // per_step)[:, None]
        if nan_at is not None:
            self.x[nan_at, 3] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def lit_fit_data(tmp_path, cb, module, steps, data, **kw):
    L = _lightning()
    torch.manual_seed(0)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, log_every_n_steps=5,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(tmp_path), callbacks=[cb], **kw)
    run_quietly(lambda: tr.fit(module, torch.utils.data.DataLoader(data, batch_size=8)))  # in order
    return tr


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lightning_auto_nan_in_one_batch_is_the_data(tmp_path, precision):
    """One sample of step K's second micro-batch (accumulate_grad_batches=2) holds NaN: nan_origin, module null,
    step K."""
    L = _lightning()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    Net, _ = lit_classes(L)
    cb = AmpDoctorLightningCallback()
    module = Net()
    fbs, clean = no_module_made_it(module, lambda: module.trainer.global_step, K)
    nan_in = []
    module.body[0].register_forward_pre_hook(
        lambda m, i: nan_in.append(module.trainer.global_step) if not torch.isfinite(i[0]).all() else None)
    kw = {"plugins": [fp16_plugin()]} if precision == "fp16" else {"precision": "bf16-mixed"}
    lit_fit_data(tmp_path, cb, module, 12, _NaNAt(16 * 12, nan_at=16 * K + 11), gradient_clip_val=1.0,
                 accumulate_grad_batches=2, **kw)
    assert nan_in[:1] == [K] and clean(fbs)
    rep = cb.report
    assert rep.summary["first_bad_step"] == K, lines(rep)
    assert ("nan_origin", None, K) in top3(rep), lines(rep)


def test_lightning_auto_fp16_growing_input_overflows_at_the_first_layer(tmp_path):
    """Inputs doubling every optimizer step into body.0 (positive weights, output ~8.4x the input): its fp16
    output first passes 65504 at step 11 (inputs ~9000, finite)."""
    L = _lightning()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    Net, _ = lit_classes(L)
    cb = AmpDoctorLightningCallback()
    torch.manual_seed(0)
    module = Net()
    with torch.no_grad():
        module.body[0].weight.uniform_(0.4, 0.6)
        module.body[0].bias.zero_()
    real = FirstBad(module.body[0], lambda: module.trainer.global_step)
    lit_fit_data(tmp_path, cb, module, 13, _NaNAt(16 * 13, grow=True), plugins=[fp16_plugin()],
                 gradient_clip_val=1.0, accumulate_grad_batches=2)
    assert real.first == 11
    rep = cb.report
    assert ("overflow", "body.0", 11) in top3(rep), lines(rep)


# -- accelerate.Accelerator, plain loop ---------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 64)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.out(self.norm(self.fc2(self.act(self.fc1(x)))))


def accelerate_loop(acc, model, steps, accum, counter, blow_at=None):
    """The README-style accelerate loop: prepare, accumulate, backward, clip on sync steps, step, schedule.
    `counter[0]` counts the optimizer steps done; fc2's weight is multiplied by 1e5 before step `blow_at`."""
    from transformers import get_linear_schedule_with_warmup
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, 4, steps)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(8 * accum * steps, 16, generator=g),
                                        torch.randint(0, 4, (8 * accum * steps,), generator=g))
    dl = torch.utils.data.DataLoader(ds, batch_size=8)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    w = ampdoctor.watch(model, optimizer=opt, scaler=acc.scaler)
    with w:
        for x, y in dl:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x).float(), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                if acc.sync_gradients:
                    counter[0] += 1
                    if counter[0] == blow_at:
                        with torch.no_grad():
                            model.fc2.weight.mul_(1e5)
    return w.report()


def _accelerate():
    return pytest.importorskip("accelerate")


def test_accelerate_bf16_accum2_clip_is_quiet():
    accelerate = _accelerate()
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)  # a Trainer earlier in the session set it up
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    counter, out = [0], []
    warned = run_quietly(lambda: out.append(accelerate_loop(acc, MLP(), 20, 2, counter)))
    assert counter[0] == 20
    assert_quiet_run(out[0], 20, warned)


def test_accelerate_fp16_accum2_weight_blown_up_at_step_k(monkeypatch):
    accelerate = _accelerate()
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu"))
    monkeypatch.setattr(acc, "native_amp", True)
    monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")
    model, counter = MLP(), [0]
    real = FirstBad(model.fc2, lambda: counter[0])
    rep = accelerate_loop(acc, model, 12, 2, counter, blow_at=K)
    assert real.first == K
    assert rep.exit_code == 1 and ("overflow", "fc2", K) in top3(rep), lines(rep)


def test_accelerate_bf16_nan_in_one_batch_is_the_data():
    accelerate = _accelerate()
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model, counter = MLP(), [0]
    fbs, clean = no_module_made_it(model, lambda: counter[0], K)
    poisoned = [False]

    def poison(m, args):  # NaN in one sample of step K's first micro-batch: the data, not a layer
        if counter[0] == K and not poisoned[0]:
            poisoned[0] = True
            x = args[0].clone()
            x[2, 7] = float("nan")
            return (x,)
    model.register_forward_pre_hook(poison)
    rep = accelerate_loop(acc, model, 12, 2, counter)
    assert poisoned[0] and clean(fbs)
    assert rep.summary["first_bad_step"] == K, lines(rep)
    assert ("nan_origin", None, K) in top3(rep), lines(rep)
