"""Probe, fifth set: failures and healthy runs of Hugging Face model classes that tests/test_hf_failures2.py,
tests/test_hf_failures3.py, tests/test_hf_failures4.py and tests/test_hf_models.py build little or not at all
(BertForMaskedLM, FalconForCausalLM with parallel attention, Wav2Vec2ForCTC with the GroupNorm feature extractor,
GPTNeoXForCausalLM, MobileBertForMaskedLM, RobertaForSequenceClassification, Qwen2ForCausalLM in bf16,
ViTForImageClassification, MistralForCausalLM), all from tiny configs (no downloads), trained on the CPU with fp16
autocast + `torch.amp.GradScaler("cpu")` (bf16 autocast, or pure bf16 weights, where the pattern is a bf16 one)
under a default `ampdoctor.watch(model, optimizer=opt, scaler=scaler)` (and `every=1` where noted), public API only.

Every failure is first checked to be real in the loop itself (the loss goes non-finite or the scaler skips, at the
expected step and not before; or the weights really stop moving; or the run really raised) and an oracle of forward
hooks on every module (the first, innermost module whose output holds NaN while its inputs and own parameters hold
none, or +-inf while they are all finite) names the module the test then asks ampdoctor for, among
`rep.findings[:3]`, with the rule of docs/CONTRACT.md and the step. Injections run under `torch.no_grad()` at a step
k > 0, mid-run.

Scenarios (failures):
 1. BertForMaskedLM: `bert.encoder.layer[1].intermediate.dense.weight *= 1e6` at step 2 (a bad update in one
    submodule). Its fp16 addmm overflows -> overflow at `bert.encoder.layer.1.intermediate.dense`, step 2; not its
    GELU, not `output.dense`, not the post-LN. Default and every=1.
 2. FalconForCausalLM, parallel attention (bias-free FalconLinear: both branch outputs fp16): layer 1's
    `self_attention.dense` and `mlp.dense_4h_to_h` x6e5 at step 2. Each branch output is finite (~5e4 each),
    Falcon's IN-PLACE `mlp_output += attention_output` (fp16) is not -> overflow at `transformer.h.1` (aten::add_),
    step 2; no error at the two dense modules. Default and every=1.
 3. Wav2Vec2ForCTC (feat_extract_norm="group"): the weight-norm gain (`parametrizations.weight.original0`) of the
    positional conv embedding x3e5 at step 2: the parametrization's weight is finite fp32, the fp16 grouped conv
    overflows -> overflow at `wav2vec2.encoder.pos_conv_embed.conv`, step 2 (the skips at steps 0-1 are the
    scaler's first backoffs: a CTC loss of ~30).
 4. GPTNeoXForCausalLM (eager) given the user's own 4D additive mask built as
    `(1 - allowed.half()) * torch.finfo(torch.float32).min` (-inf in fp16). From step 2 the batches are left-padded:
    the padding query rows see no key, the softmax of an all -inf row is NaN -> nan_origin (or mask_value_overflow)
    at `gpt_neox.layers.0.attention`, step 2. Default and every=1.
 5. MobileBertForMaskedLM given inputs_embeds (its trigram projection `embedding_transformation` runs on them before
    any norm; NoNorm normalises nothing): at step 3 one position carries an unnormalised fp32 feature (~1e6): the
    Linear's autocast cast makes +inf -> overflow at `mobilebert.embeddings.embedding_transformation`, step 3.
 6. RobertaForSequenceClassification with a LambdaLR whose factor jumps to 1e5 at step 4 (lr 1e-4 -> 10, a unit
    bug): step 4's AdamW update multiplies every weight matrix ~x250; the forward overflows a few steps later and the
    scaler skips from then on -> update_spike (error) at step 4 among the first three. Default and every=1.
 7. GPTNeoXForCausalLM `.half()` (the "load in float16 and train" mistake) with SGD(momentum), no autocast, no
    scaler: most updates of step 0 round away (checked in the test) -> fp16_master_weights at the root among the
    first three. Default and every=1.
 8. BertForMaskedLM with a label id out of range (130 >= vocab 128, a tokenizer with added tokens) at step 3: the
    run crashes (IndexError). A crashed run must not be reported healthy: summary["crash"] at step 3, exit code 1,
    a verdict that is not "Healthy". Two ways: the labels given to the model (its own loss raises), and the user's
    own cross-entropy on the logits (outside the model, inside the `with ampdoctor.watch(...)` block).
 9. Qwen2ForCausalLM in pure bf16 (`.to(torch.bfloat16)`, AdamW lr 1e-5): most updates round away from step 0
    (checked per parameter in the test) -> update_underflow at step 0, at a module whose updates the test saw round
    away.
10. ViTForImageClassification `.half()` with a GradScaler: `scaler.unscale_` raises "Attempting to unscale FP16
    gradients" at step 0 -> fp16_master_weights (error) at the root, step 0.

Healthy runs (no warning, no error; every loss finite, the loss falls; "twin": the same loop also runs unwatched on
a deep copy made before the watch, same seeds (torch and numpy), and the losses, scales, final gradients and final
weights must be bitwise identical):
 H1. BertForMaskedLM, dropout 0.1 (twin).
 H2. Falcon with parallel attention (the in-place fp16 add), dropout 0.1 (twin; default and every=1).
 H3. GPT-NeoX on left-padded batches with its own 2D attention mask (transformers' mask in float32) (twin).
 H4. Wav2Vec2ForCTC with SpecAugment (numpy RNG) and dropout: the CTC gradients grow as it learns and GradScaler
    skips a step at a scale an earlier step used (a gradient spike it handles by backing off) (twin).
 H5. MistralForCausalLM given fp32 inputs_embeds of ~1e5 (above fp16's max): RMSNorm runs in float32 and the
    residual stream stays float32, nothing casts them: healthy (the twin of 5).
 H6. ViTForImageClassification under bf16 autocast, no scaler (twin).
 H7. RobertaForSequenceClassification with a sane linear warmup (twin of 6).
 H8. Qwen2 with fp32 weights under bf16 autocast (the twin of 9) (twin).

What ampdoctor got wrong (strict xfails; all fixed since: fp16_master_weights is an error without a scaler when the
fp16 parameters' updates already round away, and ranks above the update_underflow it causes; Watch.__exit__ records
an exception raised inside the with-block on the open step; the replay judges only _ctc_loss's loss output, not the
log_alpha it saves for its backward):
 - 7 (fp16 `.half()` + SGD, no scaler): the first three findings are `update_underflow` errors at
   `gpt_neox.layers.0.input_layernorm`, `...post_attention_layernorm`, `...attention.query_key_value` (one per
   module, 7 of them); the root cause, `fp16_master_weights` at the root, is last, a warning. Cause:
   ampdoctor/rules/weights.py fp16_master_weights() sets `sev = "error" if run.has_scaler else "warning"` (without a
   GradScaler the missing master copy is only a warning), while update_underflow() emits an "error" per module for
   the same cause, and findings.py Finding.sort_key() orders by severity before rank_hint (6 vs 7): any three
   modules whose updates round away push the cause out of the first three.
 - 8, crash outside the model: the report is "Healthy: no problems found in 3 step(s)." with exit code 0 although
   the loop raised IndexError at step 3 inside the `with` block. Cause: ampdoctor/watch.py Watch.__exit__(*exc)
   calls self.close() and drops the exception: only an exception raised inside a watched module's forward is
   recorded (record/modulehooks.py exception_info via the forward hook), and _record_fatal() runs only from
   exits.py's atexit hook for an uncaught exception; an exception leaving the `with` block (the user's loss, the
   backward, the scaler) is never put on the open step, so summary.crash() finds none.
 - H4 (CTC): `[error] overflow at (root) aten::_ctc_loss step N: aten::_ctc_loss in (root) produced -inf from
   finite inputs` (out_dtype float32, in_dtypes float32). The skip at a scale an earlier step applied is an
   `unexplained_skip` (analysis/replayfold.py), so the step is replayed; replay/optrace.py OpTracer.check_output()
   checks every floating output of every op, and aten::_ctc_loss's second output (log_alpha, float32, log(0) = -inf
   for unreachable alignments by design) reads as an op that made -inf from finite inputs; that forward event then
   makes replay/__init__.py _replay() skip the scaler search (`... and not fwd_events`) that would have shown the
   step finite at a lower scale, and replay/explain.py gives it `severity = "error" if step_bad` (the gradients
   overflowed at the captured scale), which fold_replay() puts into the healthy report.
All the other failures are named with the right rule at the producing module and step among the first three
findings, and the other healthy runs are quiet and bitwise identical with and without the watch.
"""
from __future__ import annotations

import copy
import math
import os
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
T = pytest.importorskip("transformers")

import ampdoctor  # noqa: E402
from probe_harness import at_top3 as _at, falls as _falls, quiet_report  # noqa: E402
from scenarios import lines, no_error_at, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

F16, BF16 = torch.float16, torch.bfloat16
LINEAR = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::_to_copy")
CONV = ("aten::convolution", "aten::_convolution", "aten::conv1d", "aten::_to_copy")
EVERY = [pytest.param(None, id="default"), pytest.param(1, id="every1")]


# ---------------------------------------------------------------------------------------------------- the oracle

def _flat(x, out):
    if torch.is_tensor(x):
        if x.is_floating_point():
            out.append(x)
    elif isinstance(x, (tuple, list)):
        for t in x:
            _flat(t, out)
    elif isinstance(x, dict) or hasattr(x, "keys") and hasattr(x, "values"):  # dicts and ModelOutputs
        for t in x.values():
            _flat(t, out)
    return out


def _has_nan(ts):
    return any(bool(torch.isnan(t).any()) for t in ts)


def _all_finite(ts):
    return all(bool(torch.isfinite(t).all()) for t in ts)


class Producer:
    """Forward hooks on every module: the first (module, step) whose output holds NaN while its inputs (positional
    and keyword) and own parameters hold none, or +-inf while they are all finite (an additive -inf mask is an input
    with inf but no NaN). Hooks fire children first, so the first hit is the innermost producer."""

    def __init__(self, m):
        self.step, self.first = 0, None
        self.hs = [mod.register_forward_hook(self._hook(n), with_kwargs=True) for n, mod in m.named_modules()]

    def _hook(self, n):
        def f(mod, args, kwargs, out):
            if self.first is not None:
                return
            ins = _flat(args, []) + _flat(kwargs, []) + list(mod.parameters(recurse=False))
            outs = _flat(out, [])
            if (_has_nan(outs) and not _has_nan(ins)) or (not _all_finite(outs) and _all_finite(ins)):
                self.first = (n, self.step)
        return f

    def remove(self):
        for h in self.hs:
            h.remove()


# ---------------------------------------------------------------------------------------------------- the loop

@dataclass
class Run:
    losses: list = field(default_factory=list)
    scales: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    rep: object = None
    first: tuple | None = None


def _run(model, batch, steps, *, watch=True, every=None, dtype=F16, lr=1e-4, opt=None, sched=None, inject=None,
         oracle=True, autocast=True, scaler=None, clip=True):
    """The user's ordinary loop, seeded (torch and numpy) at its start: zero_grad -> forward under autocast(dtype) ->
    (fp16: scale(loss).backward -> unscale_ -> clip -> step -> update; else backward -> clip -> step) -> sched.step.
    `batch(k)` gives step k's kwargs, `inject(k, model)` runs under no_grad before step k; `opt`/`sched` are
    factories. Returns a Run (per-step losses, scales, skips; the last step's gradients; the report; the oracle's
    producer)."""
    torch.manual_seed(123)
    np.random.seed(123)
    model.train()
    opt = opt(model) if opt else torch.optim.AdamW(model.parameters(), lr=lr)
    sched = sched(opt) if sched else None
    if scaler is None:
        scaler = dtype == F16 and autocast
    sc = torch.amp.GradScaler("cpu") if scaler else None
    kw = {} if every is None else {"every": every}
    prod = Producer(model) if oracle else None
    r = Run()
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, **kw) if watch else None
    try:
        for k in range(steps):
            if prod is not None:
                prod.step = k
            if inject is not None:
                with torch.no_grad():
                    inject(k, model)
            b = batch(k)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                loss = model(**b).loss
            if sc is not None:
                s0 = sc.get_scale()
                sc.scale(loss).backward()
                sc.unscale_(opt)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(opt)
                sc.update()
                r.scales.append(sc.get_scale())
                r.skipped.append(sc.get_scale() < s0)
            else:
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                r.skipped.append(False)
            if sched is not None:
                sched.step()
            r.losses.append(loss.item())
    finally:
        if prod is not None:
            prod.remove()
        if w is not None:
            w.close()
    r.grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    r.rep = w.report() if w is not None else None
    r.first = prod.first if prod is not None else None
    return r


def _first_bad(r):
    """(first step with a non-finite loss, first step the scaler skipped)."""
    nf = next((k for k, v in enumerate(r.losses) if not math.isfinite(v)), None)
    sk = next((k for k, s in enumerate(r.skipped) if s), None)
    return nf, sk


def _twin(build, batch, steps, **kw):
    """The loop unwatched on a deep copy (made before any watch) and watched on the model: losses, scales, skips,
    final gradients and final weights bitwise identical. Returns the watched Run."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    r0 = _run(ref, batch, steps, watch=False, oracle=False, **kw)
    r1 = _run(model, batch, steps, watch=True, oracle=False, **kw)
    assert r0.losses == r1.losses, [(i, a, b) for i, (a, b) in enumerate(zip(r0.losses, r1.losses)) if a != b][:5]
    assert r0.scales == r1.scales and r0.skipped == r1.skipped
    assert len(r0.grads) == len(r1.grads)
    for i, (a, b) in enumerate(zip(r0.grads, r1.grads)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), i
    s0, s1 = ref.state_dict(), model.state_dict()
    assert s0.keys() == s1.keys()
    for n in s0:
        assert torch.equal(s0[n], s1[n]), n
    return r1


# ---------------------------------------------------------------------------------------------------- models

def _ids(seed=0, b=4, s=16, lo=1, hi=120):
    return torch.randint(lo, hi, (b, s), generator=torch.Generator().manual_seed(seed))


def _mlm(k):
    """Every 4th token masked (id 4) and predicted; the rest ignored."""
    x = _ids(k) + 4
    lab = torch.full_like(x, -100)
    lab[:, 3::4] = x[:, 3::4]
    inp = x.clone()
    inp[:, 3::4] = 4
    return {"input_ids": inp, "labels": lab}


def _lm(k):
    x = _ids(k)
    return {"input_ids": x, "labels": x}


def bert_mlm():
    return T.BertForMaskedLM(T.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=64))


def falcon(**kw):
    return T.FalconForCausalLM(T.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True,
        new_decoder_architecture=False, alibi=False, multi_query=False, bias=False, max_position_embeddings=64,
        attn_implementation="eager", **kw))


def neox(**kw):
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True, attn_implementation="eager", **kw))


def w2v(**kw):
    return T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), feat_extract_norm="group",
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, do_stable_layer_norm=False, pad_token_id=0,
        ctc_loss_reduction="mean", layerdrop=0.0, **{"mask_time_prob": 0.0, **kw}))


def _audio(k):
    g = torch.Generator().manual_seed(k % 3)
    return {"input_values": torch.randn(4, 800, generator=g), "labels": torch.randint(1, 16, (4, 6), generator=g)}


def mobilebert():
    return T.MobileBertForMaskedLM(T.MobileBertConfig(
        vocab_size=128, hidden_size=64, embedding_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=2,
        normalization_type="no_norm", max_position_embeddings=64))


def mistral():
    return T.MistralForCausalLM(T.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def roberta_cls():
    return T.RobertaForSequenceClassification(T.RobertaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=1, num_labels=3))


def _cls_batch(k):
    g = torch.Generator().manual_seed(k % 4)
    x = torch.randint(3, 128, (8, 16), generator=g)
    x[:, 0] = 0
    return {"input_ids": x, "labels": torch.randint(0, 3, (8,), generator=g)}


def qwen2():
    return T.Qwen2ForCausalLM(T.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def vit(**kw):
    return T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, **kw))


def _images(k):
    g = torch.Generator().manual_seed(k % 3)
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}


# ==================================================================================================== failures

@pytest.mark.parametrize("every", EVERY)
def test_bert_mlm_intermediate_dense_blowup_mid_run_overflows_in_that_linear(every):
    """A bad update multiplies layer 1's `intermediate.dense` weight by 1e6 at step 2: its fp16 addmm overflows
    (its input, the attention output LayerNorm's, is finite); GELU, output.dense and the post-LN only pass inf on."""
    torch.manual_seed(0)
    m = bert_mlm()
    dense = "bert.encoder.layer.1.intermediate.dense"
    r = _run(m, _mlm, 5, every=every, inject=lambda k, m: k == 2 and m.get_submodule(dense).weight.mul_(1e6))
    assert _first_bad(r) == (2, 2) and r.first == (dense, 2)
    _at(r.rep, "overflow", dense, 2, "forward", LINEAR, "error")
    no_error_at(r.rep, {"bert.encoder.layer.1.intermediate.intermediate_act_fn", "bert.encoder.layer.1.output.dense",
                        "bert.encoder.layer.1.output.LayerNorm", "bert.encoder.layer.1.attention.output.LayerNorm"})


@pytest.mark.parametrize("every", EVERY)
def test_falcon_parallel_attention_in_place_residual_add_overflows_in_the_layer(every):
    """Falcon with parallel attention and bias-free FalconLinear (both branches return fp16): layer 1's attention
    output projection and MLP down projection x6e5 at step 2. Each branch is finite; `mlp_output +=
    attention_output` in the decoder layer's own forward (fp16, in place) overflows."""
    torch.manual_seed(0)
    m = falcon()
    layer = m.transformer.h[1]
    att, mlp = layer.self_attention.dense, layer.mlp.dense_4h_to_h
    seen = {}

    def note(name):
        def f(mod, args, out):
            seen.setdefault(name, []).append(float(out.detach().float().abs().max()))
        return f
    hs = [att.register_forward_hook(note("att")), mlp.register_forward_hook(note("mlp"))]

    def inject(k, m):
        if k == 2:
            att.weight.mul_(6e5)
            mlp.weight.mul_(6e5)
    try:
        r = _run(m, _lm, 4, every=every, inject=inject)
    finally:
        for h in hs:
            h.remove()
    assert _first_bad(r) == (2, 2) and r.first == ("transformer.h.1", 2)
    assert max(seen["att"][2], seen["mlp"][2]) < 0.9 * 65504, seen  # both branches finite, with a margin
    _at(r.rep, "overflow", "transformer.h.1", 2, "forward", ("aten::add_", "aten::add"), "error")
    no_error_at(r.rep, {"transformer.h.1.self_attention.dense", "transformer.h.1.mlp.dense_4h_to_h",
                        "transformer.h.1.self_attention", "transformer.h.1.mlp"})


def test_wav2vec2_weight_norm_gain_of_the_positional_conv_overflows_that_conv():
    """Wav2Vec2 (GroupNorm feature extractor) under CTC: the weight-norm gain of `pos_conv_embed.conv` x3e5 at step
    2. The parametrization recomputes the weight (fp32, finite) inside the forward; the grouped fp16 conv overflows."""
    torch.manual_seed(0)
    m = w2v()
    conv = "wav2vec2.encoder.pos_conv_embed.conv"
    assert m.config.feat_extract_norm == "group"

    def inject(k, m):
        if k == 2:
            m.get_submodule(conv).parametrizations.weight.original0.mul_(3e5)
    r = _run(m, _audio, 5, lr=1e-3, inject=inject)
    assert all(map(math.isfinite, r.losses[:2])) and _first_bad(r)[0] == 2 and r.first == (conv, 2)
    assert torch.isfinite(m.get_submodule(conv).weight).all()
    _at(r.rep, "overflow", conv, 2, "forward", CONV, "error")
    no_error_at(r.rep, {"wav2vec2.encoder.pos_conv_embed.padding", "wav2vec2.encoder.pos_conv_embed.activation",
                        "wav2vec2.encoder.layer_norm", "wav2vec2.feature_projection.projection"})


def _padded(k, user_mask):
    """Causal LM batches; from step 2 example 1 is left-padded by 5. `user_mask`: the user's own 4D fp16 additive
    mask from finfo(float32).min; else the 2D padding mask for transformers to expand."""
    x = _ids(k % 3 + 10)
    am = torch.ones(4, 16, dtype=torch.long)
    if k >= 2 or not user_mask:
        am[1, :5] = 0
    x[am == 0] = 0
    lab = x.clone()
    lab[am == 0] = -100
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    if not user_mask:
        return {"input_ids": x, "attention_mask": am, "labels": lab, "position_ids": pos}
    allowed = torch.tril(torch.ones(16, 16, dtype=torch.bool))[None, None] & am[:, None, None, :].bool()
    mask = (1.0 - allowed.half()) * torch.finfo(torch.float32).min
    return {"input_ids": x, "attention_mask": mask, "labels": lab, "position_ids": pos}


@pytest.mark.parametrize("every", EVERY)
def test_gpt_neox_user_4d_mask_from_float32_min_in_fp16_nans_the_left_padded_rows(every):
    """The user's 4D mask `(1 - allowed.half()) * finfo(float32).min` is -inf in fp16 (the constant overflows).
    From step 2 an example is left-padded: its padding query rows have every key masked, the eager softmax of an all
    -inf row is NaN in `gpt_neox.layers.0.attention`."""
    mask = _padded(2, True)["attention_mask"]
    assert mask.dtype == F16 and bool(torch.isneginf(mask).any())
    assert bool(torch.isneginf(mask[1, 0, 0]).all()) and not bool(torch.isneginf(_padded(1, True)["attention_mask"]
                                                                                  [:, 0, :, 0]).any())
    torch.manual_seed(0)
    m = neox()
    r = _run(m, lambda k: _padded(k, True), 4, every=every)
    att = "gpt_neox.layers.0.attention"
    assert _first_bad(r) == (2, 2) and r.first == (att, 2)
    _at(r.rep, ("nan_origin", "mask_value_overflow"), att, 2, "forward", severity="error")
    no_error_at(r.rep, {"gpt_neox.layers.0.attention.query_key_value", "gpt_neox.layers.0.input_layernorm",
                        "gpt_neox.final_layer_norm"})


def _embeds(m, loud_step=3):
    """MobileBERT fed its own word embeddings as inputs_embeds; at `loud_step` position 0 of every example is an
    unnormalised fp32 feature vector (~1e6: finite in fp32, above fp16's max)."""
    table = m.mobilebert.embeddings.word_embeddings.weight

    def batch(k):
        b = _mlm(k % 3)
        with torch.no_grad():
            e = table[b.pop("input_ids")].clone()
        if k == loud_step:
            e[:, 0] = torch.rand(4, e.shape[-1], generator=torch.Generator().manual_seed(9)) * 2e6
        return {"inputs_embeds": e, "labels": b["labels"]}
    return batch


def test_mobilebert_huge_inputs_embeds_overflow_the_trigram_embedding_projection():
    """MobileBERT's embeddings run `embedding_transformation` (a Linear over the trigram concatenation) on
    inputs_embeds before anything normalises them (NoNorm is an affine map). At step 3 an unnormalised ~1e6 feature
    rides in position 0: the fp32 inputs are finite, the Linear's autocast cast makes +inf."""
    torch.manual_seed(0)
    m = mobilebert()
    batch = _embeds(m)
    e = batch(3)["inputs_embeds"]
    assert e.dtype == torch.float32 and bool(torch.isfinite(e).all()) and float(e.abs().max()) > 65504
    r = _run(m, batch, 6)
    proj = "mobilebert.embeddings.embedding_transformation"
    assert _first_bad(r)[0] == 3 and r.first == (proj, 3)
    assert all(map(math.isfinite, r.losses[:3] + r.losses[4:]))
    _at(r.rep, "overflow", proj, 3, "forward", LINEAR, "error")
    no_error_at(r.rep, {"mobilebert.embeddings", "mobilebert.embeddings.LayerNorm"})


@pytest.mark.parametrize("every", EVERY)
def test_roberta_learning_rate_jump_at_step_4_is_an_update_spike_at_step_4(every):
    """A LambdaLR whose factor jumps to 1e5 at step 4 (lr 1e-4 -> 10): AdamW's step-4 update moves every weight by
    ~10, hundreds of times its size; the forward overflows a few steps later and the scaler keeps skipping."""
    torch.manual_seed(0)
    m = roberta_cls()
    norms = []
    w = m.roberta.encoder.layer[0].attention.self.query.weight

    def inject(k, m):
        norms.append(float(w.norm()))
    r = _run(m, _cls_batch, 12, every=every, inject=inject,
             sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 if s < 4 else 1e5))
    assert all(map(math.isfinite, r.losses[:5])) and not any(r.skipped[:4])
    assert norms[5] > 50 * norms[4] and norms[4] < 1.1 * norms[0], norms  # the update of step 4
    nf, _ = _first_bad(r)
    assert nf is not None and nf > 4 and r.first is not None and r.first[1] > 4
    assert sum(r.skipped) >= 4
    # every weight moved by the same lr: any module with weights of its own is the right place
    f = next((f for f in r.rep.findings[:3] if f.rule == "update_spike"), None)
    assert f is not None and f.step == 4 and f.severity == "error", lines(r.rep)
    assert any(n.rpartition(".")[0] == f.module for n, _ in m.named_parameters()), f.one_line()


def _rounded_away(before, model):
    """Per parameter: the share of elements with a nonzero gradient whose value did not change in the step."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        moved = g != 0
        if int(moved.sum()) >= 16:
            out[n] = float(((p.detach() == before[n]) & moved).sum()) / float(moved.sum())
    return out


@pytest.mark.parametrize("every", [
    pytest.param(None, id="default"),
    pytest.param(1, id="every1"),
])
def test_gpt_neox_half_with_sgd_has_no_fp32_master_weights(every):
    """`model.half()` then SGD(momentum) over its parameters, no autocast, no scaler (the 'load in float16 and
    fine-tune' mistake): the optimizer steps fp16 weights, and most of step 0's updates round away (checked here)."""
    torch.manual_seed(0)
    m = neox().half()
    assert all(p.dtype == F16 for p in m.parameters())
    # the harm, measured without a watch on a copy: step 0's update rounds away for most elements of some weights
    ref = copy.deepcopy(m)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    ref(**_lm(0)).loss.backward()
    opt.step()
    share = _rounded_away(before, ref)
    assert sum(s >= 0.5 for s in share.values()) >= 3, share
    r = _run(m, _lm, 6, every=every, autocast=False, opt=lambda mm: torch.optim.SGD(mm.parameters(), lr=1e-2,
                                                                                   momentum=0.9))
    assert all(map(math.isfinite, r.losses)) and r.first is None
    _at(r.rep, "fp16_master_weights", "", severity="error")


def _bad_label(k):
    b = _mlm(k)
    if k == 3:
        b["labels"][0, 3] = 130  # >= vocab_size 128: a tokenizer with added tokens, the model not resized
    return b


@pytest.mark.parametrize("inside", [
    pytest.param(True, id="labels-to-the-model"),
    pytest.param(False, id="users-own-loss"),
])
def test_bert_mlm_label_id_out_of_range_crash_is_not_reported_healthy(inside):
    """At step 3 a label id 130 >= vocab 128: cross_entropy raises IndexError. The run crashed; its report must say
    so (summary crash at step 3, exit code 1), never 'Healthy'."""
    torch.manual_seed(0)
    m = bert_mlm()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cpu")
    done = []
    with pytest.raises(IndexError, match="out of bounds"):
        with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w:
            for k in range(6):
                b = _bad_label(k)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=F16):
                    if inside:
                        loss = m(**b).loss
                    else:
                        logits = m(input_ids=b["input_ids"]).logits
                        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), b["labels"].view(-1))
                sc.scale(loss).backward()
                sc.unscale_(opt)
                sc.step(opt)
                sc.update()
                done.append(k)
    assert done == [0, 1, 2]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rep = w.report()
    # (a crash with no inf/NaN anywhere is not replayed: the replay would only raise the IndexError again and warn
    # that the in-process replay failed; analysis/replaychoice.crashed)
    assert not [str(x.message) for x in seen if "replay" in str(x.message)], [str(x.message) for x in seen]
    crash = rep.summary.get("crash")
    assert rep.exit_code == 1, (rep.summary.get("verdict"), lines(rep))
    assert not str(rep.summary.get("verdict", "")).startswith("Healthy"), rep.summary.get("verdict")
    assert crash and crash["step"] == 3 and crash["type"] == "IndexError", rep.summary


def test_qwen2_pure_bf16_adamw_small_lr_updates_round_away():
    """Qwen2 cast to bf16 (parameters and AdamW in bf16, lr 1e-5): w + lr * m/sqrt(v) == w for most elements (bf16
    keeps 8 bits), from step 0. The first three findings name update_underflow at step 0 at a module whose
    updates the test itself saw round away."""
    torch.manual_seed(0)
    m = qwen2().to(BF16)
    ref = copy.deepcopy(m)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-5)
    ref(**_lm(0)).loss.backward()
    opt.step()
    share = _rounded_away(before, ref)
    assert sum(s >= 0.5 for s in share.values()) >= 10, share
    r = _run(m, lambda k: _lm(k % 3), 6, autocast=False, lr=1e-5)
    assert all(map(math.isfinite, r.losses)) and r.first is None
    f = next((f for f in r.rep.findings[:3] if f.rule == "update_underflow"), None)
    assert f is not None and f.step == 0 and f.severity == "error", lines(r.rep)
    mine = {n: s for n, s in share.items() if n.rpartition(".")[0] == f.module}
    assert mine and max(mine.values()) >= 0.5, (f.one_line(), share)


def test_vit_half_with_a_gradscaler_is_fp16_master_weights_at_step_0():
    """ViT `.half()` trained with a GradScaler: scaler.unscale_ raises 'Attempting to unscale FP16 gradients' at
    step 0 (a crash in the loop, outside the model): fp16_master_weights, error, at the root, step 0."""
    torch.manual_seed(0)
    m = vit().half()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w:
            for k in range(4):
                b = _images(k)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=F16):
                    loss = m(pixel_values=b["pixel_values"].half(), labels=b["labels"]).loss
                sc.scale(loss).backward()
                sc.unscale_(opt)
                sc.step(opt)
                sc.update()
    rep = w.report()
    _at(rep, "fp16_master_weights", "", 0, severity="error")
    assert rep.exit_code == 1


# ==================================================================================================== healthy runs

def _healthy(r, max_skips=0):
    assert sum(r.skipped) <= max_skips, r.skipped
    _falls(r.losses)
    quiet_report(r.rep, saw_steps=False)


def test_healthy_bert_mlm_with_dropout_is_quiet_and_bitwise_identical():
    r = _twin(bert_mlm, lambda k: _mlm(k % 3), 12, lr=1e-3)
    _healthy(r)


@pytest.mark.parametrize("every", EVERY)
def test_healthy_falcon_parallel_attention_is_quiet_and_bitwise_identical(every):
    r = _twin(lambda: falcon(hidden_dropout=0.1, attention_dropout=0.1), lambda k: _lm(k % 3), 12, lr=1e-3,
              every=every)
    _healthy(r)


def test_healthy_gpt_neox_left_padded_with_its_own_mask_is_quiet_and_bitwise_identical():
    """Every batch left-padded; transformers expands the 2D mask itself (float32, finfo(float32).min: finite, and
    the fully masked padding rows softmax to a uniform row)."""
    r = _twin(lambda: neox(hidden_dropout=0.1, attention_dropout=0.1), lambda k: _padded(k, False), 12, lr=1e-3)
    _healthy(r)


def test_healthy_wav2vec2_ctc_with_specaugment_and_a_handled_gradient_spike_is_quiet():
    """CTC on Wav2Vec2 with SpecAugment (numpy RNG) and dropout: the scaler's first backoffs, then the gradients
    grow as it learns and one step is skipped at a scale an earlier step used; every loss finite and falling."""
    r = _twin(lambda: w2v(mask_time_prob=0.2, mask_time_length=3, hidden_dropout=0.1), _audio, 14, lr=1e-3)
    assert all(map(math.isfinite, r.losses)) and min(r.scales) >= 1024, r.scales
    # a skip at a scale that an earlier applied step used: a gradient spike, handled by one backoff
    applied, late = set(), []
    for k, (s0, sk) in enumerate(zip([65536.0] + r.scales[:-1], r.skipped)):
        if sk and s0 in applied:
            late.append(k)
        if not sk:
            applied.add(s0)
    assert late, (r.scales, r.skipped)
    _healthy(r, max_skips=6)


def test_healthy_mistral_with_huge_fp32_inputs_embeds_is_quiet():
    """inputs_embeds of ~1e5 in fp32 (above fp16's max): Mistral's RMSNorm squares and normalises them in float32 and
    the residual stream stays float32; the fp16 projections only see normalised values."""
    table = torch.randn(128, 64, generator=torch.Generator().manual_seed(5)) * 1e5

    def batch(k):
        x = _ids(k % 3)
        return {"inputs_embeds": table[x], "labels": x}
    assert float(batch(0)["inputs_embeds"].abs().max()) > 65504
    torch.manual_seed(0)
    r = _run(mistral(), batch, 12, lr=1e-3)
    assert r.first is None
    _healthy(r)


def test_healthy_vit_bf16_autocast_is_quiet_and_bitwise_identical():
    r = _twin(lambda: vit(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1), _images, 12, lr=1e-3,
              dtype=BF16)
    _healthy(r)


def test_healthy_roberta_classifier_with_warmup_is_quiet_and_bitwise_identical():
    r = _twin(roberta_cls, _cls_batch, 16, lr=1e-3,
              sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4)))
    _healthy(r)


def test_healthy_qwen2_fp32_weights_under_bf16_autocast_is_quiet_and_bitwise_identical():
    r = _twin(qwen2, lambda k: _lm(k % 3), 12, lr=1e-3, dtype=BF16)
    _healthy(r)
