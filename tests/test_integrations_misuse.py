"""Framework misuse probes: mixed-precision MISCONFIGURATION or MISUSE inside accelerate, Lightning and the
Hugging Face Trainer (and a few plain-torch set-ups around them), each with its correct twin, all on the CPU.

How the frameworks run fp16 on the CPU here (as tests/test_integrations_hf.py / _probe.py do):
- accelerate refuses fp16 without a GPU, so the Accelerator (`Accelerator(cpu=True)`) is given the three attributes
  `Accelerator.__init__` sets for CUDA fp16: `scaler = GradScaler("cpu")`, `native_amp = True`,
  `state._mixed_precision = "fp16"`. Everything after (prepare, `backward` -> `scaler.scale(loss).backward()`,
  `clip_grad_norm_` -> `unscale_gradients` -> `scaler.unscale_`, `AcceleratedOptimizer.step` -> `scaler.step` +
  `update`) is accelerate's own code; autocast is the user's `torch.autocast("cpu", float16)`. The plain loops are
  watched with `ampdoctor.watch(model, optimizer=opt, scaler=acc.scaler)`; the Trainer with `AmpDoctorCallback`
  (its Accelerator forced to fp16 the same way after the Trainer is built).
- Lightning: `MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))`, Lightning's own plugin, watched by
  `AmpDoctorLightningCallback`. Checked in lightning/pytorch/plugins/precision/{amp,precision}.py: `on_after_backward`
  runs inside the closure's backward (precision.post_backward), BEFORE `MixedPrecision.optimizer_step` calls
  `scaler.unscale_`; `on_before_optimizer_step` and `configure_gradient_clipping` run in `_after_closure`, AFTER it.
  In manual optimization `opt.step()` runs the same `optimizer_step` (closure -> unscale_ -> scaler.step -> update).
- transformers: `Trainer.training_step` ends in `self.accelerator.backward(loss)`; at every sync step the Trainer
  calls `accelerator.clip_grad_norm_` (max_grad_norm > 0) or, with max_grad_norm=0, `_get_grad_norm` ->
  `accelerator.clip_grad_norm_(..., inf)`: either way the gradients are unscaled before `on_pre_optimizer_step`.

Misuse (the expected rule among the first three findings, with its severity and, for call-order rules, the file/line
of the user's wrong call in `finding.evidence`):
 A1. accelerate fp16: `torch.nn.utils.clip_grad_norm_` called directly instead of `accelerator.clip_grad_norm_`
     (nothing unscales first): clip_before_unscale error at the clip line.
 A2. accelerate fp16: `loss.backward()` instead of `accelerator.backward(loss)`: the loss is never scaled, but
     `accelerator.clip_grad_norm_` still unscales; the scaler never scaled, so torch asserts "Attempted unscale_ but
     _scale is None" (after a scale() elsewhere it would silently divide every gradient by the scale): scaler_misorder.
 A3. accelerate fp16 with `accelerator.accumulate` (2 micro-batches) and a manual `torch.nn.utils.clip_grad_norm_`
     at every micro-step: clip_before_unscale error at that line.
 A4. accelerate fp16: `accelerator.clip_grad_norm_` called twice per step (once with max_norm=inf to log the norm, once
     to clip): the second `unscale_gradients` raises "unscale_() has already been called": scaler_misorder.
 A5. accelerate fp16: the optimizer was not passed to `accelerator.prepare` (`model = accelerator.prepare(model)`), so
     `opt.step()` is the raw torch step on gradients `accelerator.backward` scaled: scaler_misorder at opt.step().
 L1. Lightning 16-mixed, automatic optimization: `torch.nn.utils.clip_grad_norm_` in `on_after_backward` (runs before
     Lightning's unscale_): clip_before_unscale error at the hook's clip line.
 L2. Lightning 16-mixed, manual optimization: `loss.backward()` instead of `self.manual_backward(loss)`, then
     `opt.step()` (which unscales gradients that were never scaled; torch asserts "_scale is None"): scaler_misorder.
 L3. Lightning 16-mixed, manual optimization: `torch.nn.utils.clip_grad_norm_` between manual_backward and opt.step()
     (the unscale_ happens inside opt.step()): clip_before_unscale error at that line.
 L4. Lightning 16-mixed, manual optimization: the user unscales by hand
     (`self.trainer.precision_plugin.scaler.unscale_(opt)`) before clipping, then `opt.step()` unscales again and
     torch raises "unscale_() has already been called": scaler_misorder.
 L5. Lightning 16-mixed, manual optimization with `self.optimizers(use_pl_optimizer=False)`: `opt.step()` is the raw
     torch step on scaled gradients (Lightning's scaler never steps): scaler_misorder at the opt.step() line.
 H1. HF Trainer fp16: a `training_step` override calling `loss.backward()` instead of `self.accelerator.backward(loss)`:
     never scaled, then unscaled by the Trainer's clip (torch asserts "_scale is None"): scaler_misorder.
 H2. HF Trainer fp16: a `training_step` override adding `torch.nn.utils.clip_grad_norm_` right after
     `self.accelerator.backward(loss)` (before the Trainer's own unscaling clip): clip_before_unscale at that line.
 P1. plain torch: the model converted with `.half()` while also using autocast + GradScaler (GradScaler raises
     "Attempting to unscale FP16 gradients."): fp16_master_weights error.
 P2. plain torch: a new `GradScaler` created every iteration in the step function (the watch cannot be handed it),
     on a loss whose scaled gradients overflow at the default 65536: every step is skipped and the scale never backs
     off, so nothing trains. No contract rule names "a new scaler per step"; the symptom rules fit: skipped_steps or
     loss_scale_collapse (error).
 P3. plain torch: two models, one GradScaler, one optimizer each, only the first model watched; the second model's
     clip helper unscales its optimizer a second time (torch raises): scaler_misorder.

Every misuse has a correct twin (no warning, no error; L4 shares L3's twin, clipping in on_before_optimizer_step, and
L5 shares L2's, the LightningOptimizer's step). Healthy set-ups besides (no warning, no error):
 L6. Lightning 16-mixed: a `configure_gradient_clipping` override calling `torch.nn.utils.clip_grad_norm_` directly
     (it runs after Lightning's unscale_).
 H3. HF Trainer fp16 with `max_grad_norm=0` and a callback reading the gradient norm in `on_pre_optimizer_step`
     (the Trainer's `_get_grad_norm` unscaled first).
 H4. HF Trainer fp16 with a custom optimizer (`optimizers=(SGD(momentum), None)`) and `max_grad_norm=1.0`.
 P4. plain torch: `torch.autocast` only around the loss, the model's forward outside it (autocast has no effect on the
     model; numerically plain fp32 training — no contract rule, ampdoctor must not alarm).
 P5. plain torch: bf16 autocast with a GradScaler (unneeded but harmless).

Dropped: an HF `compute_loss` returning an fp16 loss divided by a large number: not a real failure under a
GradScaler (the gradient of `loss / c` is scale / c, e.g. 65536 / 1e5 = 0.66 in fp16: normal), only the logged loss
value is subnormal, and ampdoctor's underflow rule is about module values, not the loss scalar.
`Accelerator(mixed_precision="fp16", cpu=True)` itself cannot run on the CPU (accelerate raises), hence the forcing.

ampdoctor got wrong (strict xfails, each reason says what it reported instead):
 - P2 (a new GradScaler every iteration; fixed since: a scaler not given to watch is found and adopted): only `overflow` (error, module None, step 0: "the gradient reaching the
   model's output was already inf ... e.g. a hand-made loss scale too large for fp16"); the per-iteration scalers are
   not watched, no optimizer.step ever runs (all iterations fold into step 0), and the every-step skipping is not
   reported (no skipped_steps / loss_scale_collapse / scaler_misorder). The run does end with an error finding.

Found here and fixed (strict xfails first): A2, L2, H1 (the loss backpropagated without `scaler.scale`, then the
framework's `unscale_` asserting "Attempted unscale_ but _scale is None") were an empty report; they are
`scaler_misorder` at the call that found no scale.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import ampdoctor  # noqa: E402
from scenarios import alarms, lines, one_thread, randn  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
_SRC = open(__file__).read().splitlines()


def line_of(tag):
    """The line of this file that ends with the marker comment `# @tag`."""
    hits = [i + 1 for i, ln in enumerate(_SRC) if ln.rstrip().endswith(f"# @{tag}")]
    assert len(hits) == 1, (tag, hits)
    return hits[0]


def expect(rep, rule, severity=("warning", "error"), tag=None, here=False):
    """`rule` among the first three findings, with `severity`; with `tag`, at this file's marked line (with `here`,
    at some line of this file)."""
    f = next((f for f in rep.findings[:3] if f.rule in ((rule,) if isinstance(rule, str) else rule)), None)
    assert f is not None, lines(rep)
    assert f.severity in severity, f.one_line()
    if tag is not None or here:
        ev = f.evidence
        assert ev.get("file") and os.path.abspath(ev["file"]) == HERE, (ev.get("file"), ev.get("line"), f.one_line())
        if tag is not None:
            assert ev.get("line") == line_of(tag), (ev.get("line"), line_of(tag), f.one_line())
    return f


def quiet(rep):
    assert not alarms(rep.findings), lines(rep)
    assert rep.summary["steps"] >= 1, rep.summary  # the watch really saw the run


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


# ======================================================================================================================
# accelerate
# ======================================================================================================================
@pytest.fixture()
def acc16(monkeypatch):
    """A fresh CPU Accelerator given what Accelerator.__init__ gives it for CUDA fp16."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    def make(**kw):
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = accelerate.Accelerator(cpu=True, **kw)
        monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu"))
        monkeypatch.setattr(acc, "native_amp", True)
        monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")
        return acc
    yield make
    AcceleratorState._reset_state(reset_partial_state=True)


def acc_run(acc, body, steps=6, accum=1, prepare_opt=True):
    """prepare -> watch -> `body(acc, model, opt, x, y)` per batch -> close. A RuntimeError raised by torch inside
    the loop stops it and is returned. Returns (report, raised, model, opt)."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = torch.utils.data.DataLoader(data(8 * steps * accum), batch_size=8)
    if prepare_opt:
        model, opt, dl = acc.prepare(model, opt, dl)
    else:
        model, dl = acc.prepare(model, dl)
    w = ampdoctor.watch(model, optimizer=opt, scaler=acc.scaler)
    raised = None
    try:
        for x, y in dl:
            body(acc, model, opt, x, y)
    except (RuntimeError, AssertionError) as e:
        raised = str(e)
    finally:
        w.close()
    return w.report(), raised, model, opt


def acc_loss(model, x, y):
    with torch.autocast(**FP16):
        return F.cross_entropy(model(x).float(), y)


# -- A1 ------------------------------------------------------------------------------------------------------------
def a1_body(ok, norms):
    def body(acc, model, opt, x, y):
        acc.backward(acc_loss(model, x, y))
        if ok:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))  # @a1-clip
        opt.step()
        opt.zero_grad()
    return body


def test_a1_accelerate_torch_clip_instead_of_accelerator_clip(acc16):
    norms = []
    rep, raised, *_ = acc_run(acc16(), a1_body(False, norms))
    assert raised is None and norms[0] > 1000, norms  # real: the clip saw gradients x65536
    expect(rep, "clip_before_unscale", ("error",), tag="a1-clip")


def test_a1_twin_accelerator_clip_grad_norm_is_quiet(acc16):
    norms = []
    rep, raised, *_ = acc_run(acc16(), a1_body(True, norms))
    assert raised is None and norms[0] < 100, norms
    quiet(rep)


# -- A2 ------------------------------------------------------------------------------------------------------------
def a2_body(ok):
    def body(acc, model, opt, x, y):
        loss = acc_loss(model, x, y)
        if ok:
            acc.backward(loss)
        else:
            loss.backward()  # @a2-backward
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return body


def test_a2_accelerate_loss_backward_instead_of_accelerator_backward(acc16):
    rep, raised, *_ = acc_run(acc16(), a2_body(False))
    assert raised and "_scale is None" in raised, raised  # real: the scaler never scaled, torch asserts at unscale_
    expect(rep, "scaler_misorder", ("error",), here=True)


def test_a2_twin_accelerator_backward_is_quiet(acc16):
    rep, raised, *_ = acc_run(acc16(), a2_body(True))
    assert raised is None
    quiet(rep)


# -- A3 ------------------------------------------------------------------------------------------------------------
def a3_body(ok):
    def body(acc, model, opt, x, y):
        with acc.accumulate(model):
            acc.backward(acc_loss(model, x, y))
            if ok:
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # @a3-clip
            opt.step()
            opt.zero_grad()
    return body


def test_a3_accelerate_accumulate_with_a_torch_clip_every_micro_step(acc16):
    rep, raised, *_ = acc_run(acc16(gradient_accumulation_steps=2), a3_body(False), accum=2)
    assert raised is None
    expect(rep, "clip_before_unscale", ("error",), tag="a3-clip")


def test_a3_twin_accumulate_clip_on_sync_steps_through_accelerator_is_quiet(acc16):
    rep, raised, *_ = acc_run(acc16(gradient_accumulation_steps=2), a3_body(True), accum=2)
    assert raised is None
    quiet(rep)


# -- A4 ------------------------------------------------------------------------------------------------------------
def a4_body(ok, norms):
    def body(acc, model, opt, x, y):
        acc.backward(acc_loss(model, x, y))
        if ok:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))  # returns the pre-clip norm
        else:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), float("inf"))))  # for the logs
            acc.clip_grad_norm_(model.parameters(), 1.0)  # @a4-second
        opt.step()
        opt.zero_grad()
    return body


def test_a4_accelerator_clip_grad_norm_twice_per_step(acc16):
    norms = []
    rep, raised, *_ = acc_run(acc16(), a4_body(False, norms))
    assert raised and "unscale_() has already been called" in raised, raised  # real: torch raises
    expect(rep, "scaler_misorder", ("error",), tag="a4-second")


def test_a4_twin_one_accelerator_clip_giving_the_norm_is_quiet(acc16):
    norms = []
    rep, raised, *_ = acc_run(acc16(), a4_body(True, norms))
    assert raised is None and len(norms) == 6
    quiet(rep)


# -- A5 ------------------------------------------------------------------------------------------------------------
def a5_body(acc, model, opt, x, y):
    acc.backward(acc_loss(model, x, y))
    opt.step()  # @a5-step
    opt.zero_grad()


def test_a5_optimizer_not_prepared_steps_on_scaled_gradients(acc16):
    rep, raised, _, opt = acc_run(acc16(), a5_body, prepare_opt=False)
    assert raised is None and not hasattr(opt, "scaler")  # real: a plain torch optimizer, no scaler in its step
    expect(rep, "scaler_misorder", ("error",), tag="a5-step")


def test_a5_twin_prepared_optimizer_is_quiet(acc16):
    rep, raised, _, opt = acc_run(acc16(), a5_body)
    assert raised is None and opt.scaler is not None
    quiet(rep)


# ======================================================================================================================
# Lightning
# ======================================================================================================================
def _L():
    return pytest.importorskip("lightning.pytorch")


def fp16_plugin():
    from lightning.pytorch.plugins import MixedPrecision
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def lit_fit(tmp_path, module, steps=6, **kw):
    """fit `module` for `steps` optimizer steps under the fp16 plugin with AmpDoctorLightningCallback; an exception
    inside fit is returned (the callback closes the watch on it). Returns (report, raised)."""
    L = _L()
    from ampdoctor.integrations import AmpDoctorLightningCallback
    cb = AmpDoctorLightningCallback(log=False)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                   callbacks=[cb], plugins=[fp16_plugin()], **kw)
    raised = None
    try:
        tr.fit(module, torch.utils.data.DataLoader(data(8 * steps), batch_size=8))
    except (RuntimeError, AssertionError) as e:
        raised = str(e)
    return cb.report, raised


def lit_module(mode, clip_at=None):
    """A LightningModule around MLP in one of the modes below; `norms` records the norms its clips saw."""
    L = _L()

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = MLP()
            self.norms = []
            if mode.startswith("manual"):
                self.automatic_optimization = False

        def loss(self, batch):
            x, y = batch
            return F.cross_entropy(self.net(x).float(), y)

        def training_step(self, batch, batch_idx):
            if mode == "auto":
                return self.loss(batch)
            opt = self.optimizers(use_pl_optimizer=mode != "manual_raw_opt")
            opt.zero_grad()
            loss = self.loss(batch)
            if mode == "manual_loss_backward":
                loss.backward()  # @l2-backward
            else:
                self.manual_backward(loss)
            if mode == "manual_clip":
                self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)))  # @l3-clip
            if mode == "manual_unscale_by_hand":
                self.trainer.precision_plugin.scaler.unscale_(opt.optimizer)
                self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            if mode == "manual_raw_opt":
                opt.step()  # @l5-step
            else:
                opt.step()  # @l-step

        def on_after_backward(self):
            if clip_at == "after_backward":
                self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)))  # @l1-clip

        def on_before_optimizer_step(self, optimizer):
            if clip_at == "before_optimizer_step":
                self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)))

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            if clip_at == "configure_gradient_clipping":
                self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)))
            else:
                super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Lit()


# -- L1 ------------------------------------------------------------------------------------------------------------
def test_l1_lightning_clip_in_on_after_backward(tmp_path):
    m = lit_module("auto", clip_at="after_backward")
    rep, raised = lit_fit(tmp_path, m)
    assert raised is None and m.norms[0] > 1000, m.norms  # real: Lightning had not unscaled yet
    expect(rep, "clip_before_unscale", ("error",), tag="l1-clip")


def test_l1_twin_lightning_clip_in_on_before_optimizer_step_is_quiet(tmp_path):
    m = lit_module("auto", clip_at="before_optimizer_step")
    rep, raised = lit_fit(tmp_path, m)
    assert raised is None and len(m.norms) == 6 and m.norms[0] < 100, m.norms
    quiet(rep)


# -- L2 ------------------------------------------------------------------------------------------------------------
def test_l2_lightning_manual_loss_backward_instead_of_manual_backward(tmp_path):
    rep, raised = lit_fit(tmp_path, lit_module("manual_loss_backward"))
    assert raised and "_scale is None" in raised, raised  # real: never scaled, torch asserts in opt.step()'s unscale_
    expect(rep, "scaler_misorder", ("error",), here=True)


def test_l2_twin_lightning_manual_backward_is_quiet(tmp_path):
    rep, raised = lit_fit(tmp_path, lit_module("manual"))
    assert raised is None
    quiet(rep)


# -- L3 ------------------------------------------------------------------------------------------------------------
def test_l3_lightning_manual_torch_clip_before_opt_step(tmp_path):
    m = lit_module("manual_clip")
    rep, raised = lit_fit(tmp_path, m)
    assert raised is None and m.norms[0] > 1000, m.norms
    expect(rep, "clip_before_unscale", ("error",), tag="l3-clip")


def test_l3_twin_lightning_manual_clip_in_on_before_optimizer_step_is_quiet(tmp_path):
    m = lit_module("manual", clip_at="before_optimizer_step")
    rep, raised = lit_fit(tmp_path, m)
    assert raised is None and len(m.norms) == 6 and m.norms[0] < 100, m.norms
    quiet(rep)


# -- L4 ------------------------------------------------------------------------------------------------------------
def test_l4_lightning_manual_unscale_by_hand_then_opt_step_unscales_again(tmp_path):
    rep, raised = lit_fit(tmp_path, lit_module("manual_unscale_by_hand"))
    assert raised and "unscale_() has already been called" in raised, raised  # real: torch raises in opt.step()
    expect(rep, "scaler_misorder", ("error",), here=True)


# (L4's twin is L3's: clipping in on_before_optimizer_step, after Lightning's own unscale_.)


# -- L5 ------------------------------------------------------------------------------------------------------------
def test_l5_lightning_manual_raw_optimizer_steps_on_scaled_gradients(tmp_path):
    m = lit_module("manual_raw_opt")
    rep, raised = lit_fit(tmp_path, m)
    assert raised is None
    expect(rep, "scaler_misorder", ("error",), tag="l5-step")


# (L5's twin is L2's: the LightningOptimizer's step.)


# -- L6 ------------------------------------------------------------------------------------------------------------
def test_l6_lightning_configure_gradient_clipping_override_is_quiet(tmp_path):
    m = lit_module("auto", clip_at="configure_gradient_clipping")
    rep, raised = lit_fit(tmp_path, m, gradient_clip_val=1.0)
    assert raised is None and len(m.norms) == 6 and m.norms[0] < 100, m.norms
    quiet(rep)


# ======================================================================================================================
# Hugging Face Trainer
# ======================================================================================================================
class TokenData(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def hf_run(tmp_path, monkeypatch, mode="plain", steps=6, optimizers=None, callbacks=(), max_grad_norm=1.0):
    """A tiny GPT-2 in a Trainer (fp16 forced on CPU, autocast from accelerate's autocast through the Trainer's
    compute_loss_context_manager) with AmpDoctorCallback. Returns the report."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from accelerate.state import AcceleratorState
    from ampdoctor.integrations import AmpDoctorCallback

    class MyTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if mode == "plain":
                return super().training_step(model, inputs, num_items_in_batch)
            model.train()
            with torch.autocast(**FP16):
                loss = self.compute_loss(model, inputs)
            if mode == "loss_backward":
                loss.backward()  # @h1-backward
            else:
                self.accelerator.backward(loss)
            if mode == "clip_in_step":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # @h2-clip
            return loss.detach()

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    if optimizers == "sgd":
        optimizers = (torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), None)
    cb = AmpDoctorCallback(run_dir=tmp_path / "ad")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=4,
                             max_steps=steps, logging_steps=100, report_to=[], max_grad_norm=max_grad_norm,
                             save_strategy="no", disable_tqdm=True, optim="adamw_torch")
    tr = MyTrainer(model=model, args=args, train_dataset=TokenData(), callbacks=[cb, *callbacks],
                   **({"optimizers": optimizers} if optimizers else {}))
    acc = tr.accelerator
    monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu"))
    monkeypatch.setattr(acc, "native_amp", True)
    monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")
    raised = None
    try:
        tr.train()
    except (RuntimeError, AssertionError) as e:
        raised = str(e)
    AcceleratorState._reset_state(reset_partial_state=True)
    rep = cb.report
    if rep is None:  # a crashed train(): transformers has no exception hook, so the callback never closed; this
        cb.watch.close()  # test's cleanup, then what a user runs on a crashed run: `ampdoctor report RUN_DIR`
        rep = ampdoctor.diagnose(tmp_path / "ad")
    return rep, tr, raised


def test_h1_hf_training_step_override_with_loss_backward(tmp_path, monkeypatch):
    rep, tr, raised = hf_run(tmp_path, monkeypatch, "loss_backward")
    assert raised and "_scale is None" in raised, raised  # real: never scaled, torch asserts at the Trainer's unscale_
    expect(rep, "scaler_misorder", ("error",), here=True)


def test_h1_twin_training_step_override_with_accelerator_backward_is_quiet(tmp_path, monkeypatch):
    rep, tr, raised = hf_run(tmp_path, monkeypatch, "accelerator_backward")
    assert raised is None and tr.state.global_step == 6
    quiet(rep)


def test_h2_hf_training_step_override_clipping_before_the_trainer_unscales(tmp_path, monkeypatch):
    rep, _, raised = hf_run(tmp_path, monkeypatch, "clip_in_step")
    assert raised is None
    expect(rep, "clip_before_unscale", ("error",), tag="h2-clip")


def test_h2_twin_max_grad_norm_only_is_quiet(tmp_path, monkeypatch):
    rep, _, raised = hf_run(tmp_path, monkeypatch, "plain")
    assert raised is None
    quiet(rep)


def test_h3_hf_max_grad_norm_0_callback_reads_norm_in_on_pre_optimizer_step_is_quiet(tmp_path, monkeypatch):
    from transformers import TrainerCallback
    norms = []

    class NormLog(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                               if p.grad is not None])))
    rep, _, raised = hf_run(tmp_path, monkeypatch, "plain", callbacks=[NormLog()], max_grad_norm=0.0)
    assert raised is None
    assert len(norms) == 6 and norms[0] < 100, norms  # real: already unscaled by the Trainer's _get_grad_norm
    quiet(rep)


def test_h4_hf_custom_sgd_optimizer_with_max_grad_norm_is_quiet(tmp_path, monkeypatch):
    rep, tr, raised = hf_run(tmp_path, monkeypatch, "plain", optimizers="sgd")
    assert raised is None
    assert isinstance(tr.optimizer.optimizer, torch.optim.SGD)
    quiet(rep)


# ======================================================================================================================
# plain torch
# ======================================================================================================================
def plain_run(model, opt, sc, body, steps=6, watch_scaler=True):
    w = ampdoctor.watch(model, optimizer=opt, **({"scaler": sc} if watch_scaler and sc is not None else {}))
    raised = None
    try:
        for i in range(steps):
            body(i)
    except (RuntimeError, ValueError, AssertionError) as e:
        raised = str(e)
    finally:
        w.close()
    return w.report(), raised


def batch(i):
    return randn(8, 16, seed=i), torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(100 + i))


# -- P1 ------------------------------------------------------------------------------------------------------------
def p1(half):
    m = MLP()
    if half:
        m = m.half()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")

    def body(i):
        x, y = batch(i)
        opt.zero_grad()
        with torch.autocast(**FP16):
            loss = F.cross_entropy(m(x.to(m.fc1.weight.dtype)).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    return plain_run(m, opt, sc, body)


def test_p1_model_half_with_autocast_and_grad_scaler():
    rep, raised = p1(True)
    assert raised and "Attempting to unscale FP16 gradients" in raised, raised  # real: GradScaler refuses
    expect(rep, "fp16_master_weights", ("error",))


def test_p1_twin_fp32_model_with_autocast_and_grad_scaler_is_quiet():
    rep, raised = p1(False)
    assert raised is None
    quiet(rep)


# -- P2 ------------------------------------------------------------------------------------------------------------
def p2(per_iteration):
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    shared = torch.amp.GradScaler("cpu")
    skipped, w0 = [], m.fc1.weight.detach().clone()

    def step(i):
        sc = torch.amp.GradScaler("cpu") if per_iteration else shared
        x, y = batch(i)
        x = torch.cat([x] * 8)
        opt.zero_grad()
        with torch.autocast(**FP16):
            out = m(x * 4)
        loss = (out.float() ** 2).sum()  # sum over 256 outputs: dloss/dout ~ 2*out; x65536 passes fp16's max
        sc.scale(loss).backward()
        before = sc.get_scale()
        sc.step(opt)
        sc.update()
        skipped.append(sc.get_scale() < before)
    rep, raised = plain_run(m, opt, None if per_iteration else shared, step, steps=10)
    return rep, raised, skipped, bool(torch.equal(w0, m.fc1.weight))


def test_p2_new_grad_scaler_every_iteration_never_backs_off():
    rep, raised, skipped, unchanged = p2(True)
    assert raised is None and all(skipped) and unchanged, skipped  # real: every step skipped, nothing trained
    expect(rep, ("skipped_steps", "loss_scale_collapse", "scaler_misorder"), ("error",))


def test_p2_twin_one_grad_scaler_backs_off_then_trains_is_quiet():
    rep, raised, skipped, unchanged = p2(False)
    assert raised is None and skipped[0] and not all(skipped) and not unchanged, skipped
    quiet(rep)


# -- P3 ------------------------------------------------------------------------------------------------------------
def p3(twice):
    a, b = MLP(), MLP()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")

    def clip_b():
        if twice:
            sc.unscale_(ob)  # @p3-second
        torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)

    def body(i):
        x, y = batch(i)
        oa.zero_grad()
        ob.zero_grad()
        with torch.autocast(**FP16):
            loss = F.cross_entropy(a(x).float(), y) + F.cross_entropy(b(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(oa)
        sc.unscale_(ob)
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
        clip_b()
        sc.step(oa)
        sc.step(ob)
        sc.update()
    return plain_run(a, oa, sc, body)


def test_p3_two_models_one_scaler_unwatched_optimizer_unscaled_twice():
    rep, raised = p3(True)
    assert raised and "unscale_() has already been called" in raised, raised
    expect(rep, "scaler_misorder", ("error",), tag="p3-second")


def test_p3_twin_two_models_one_scaler_only_one_watched_is_quiet():
    rep, raised = p3(False)
    assert raised is None
    quiet(rep)


# -- P4 / P5 ---------------------------------------------------------------------------------------------------------
def p45(where, dtype=torch.float16, scaler=True):
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    losses = []

    def body(i):
        x, y = batch(i)
        opt.zero_grad()
        if where == "loss_only":
            out = m(x)
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(out, y)
        else:
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(m(x).float(), y)
        losses.append(float(loss.detach()))
        if sc is None:
            loss.backward()
            opt.step()
            return
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    rep, raised = plain_run(m, opt, sc, body, steps=8)
    assert raised is None
    return rep


def test_p4_autocast_only_around_the_loss_is_quiet():
    quiet(p45("loss_only"))


def test_p4_twin_autocast_around_the_forward_is_quiet():
    quiet(p45("forward"))


def test_p5_bf16_autocast_with_a_grad_scaler_is_quiet():
    quiet(p45("forward", torch.bfloat16))


def test_p5_twin_bf16_autocast_without_a_scaler_is_quiet():
    quiet(p45("forward", torch.bfloat16, scaler=False))
