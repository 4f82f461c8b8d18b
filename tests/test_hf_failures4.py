"""Probe, fourth set: failures of Hugging Face model classes that tests/test_hf_failures2.py,
tests/test_hf_failures3.py, tests/test_hf_models.py and tests/test_integrations_hf.py do not build (Gemma, Gemma2,
Qwen3, Mixtral, Whisper, DeBERTa-v2, RoBERTa, ModernBERT, ALBERT, ConvNeXt-V2, Mistral with activation
checkpointing, Qwen2 through the Trainer's label smoother), all from tiny configs (no downloads), trained on the CPU
with fp16 autocast + GradScaler: a plain loop under a default `ampdoctor.watch(model, optimizer=opt,
scaler=scaler)` (and `every=1` where noted), or `transformers.Trainer` + `AmpDoctorCallback` with the fp16
attributes accelerate sets for CUDA given to its Accelerator, as tests/test_integrations_hf.py does.

Every failure is first checked to be real in the loop itself (the loss goes non-finite or the scaler skips, at the
expected step and not before) and an oracle of forward hooks on every module (the first, innermost module whose
output is non-finite while its inputs and own parameters are finite) names the module the test then asks ampdoctor
for, among `rep.findings[:3]`, with the rule of docs/CONTRACT.md and the step. Exceptions, said where they occur:
12 runs the oracle on an identical twin without checkpointing; 13's producer is a backward one, found with tensor
hooks on a run without a watch; 14's NaN is made outside the model, where the oracle sees nothing.

Scenarios (failures):
1. GemmaForCausalLM (tied embeddings, embedding scaled by sqrt(hidden), RMSNorm `(1 + w)` in float32): a bad update
   writes the embedding row of a token that never appears in the data (x3e5) at step 2. The token's own lookup never
   runs; the tied `lm_head` computes its logit every step and overflows -> overflow at `lm_head`, step 2. Default
   and every=1.
2. Qwen3ForCausalLM (eager attention): the QK-norm gains of layer 1 (`q_norm.weight`, `k_norm.weight`) x100 at step 3.
   Qwen3RMSNorm returns `weight(fp32) * x.to(fp16)`, float32 and finite (~300); the scores matmul inside
   `model.layers.1.self_attn` overflows (the CPU sdpa kernel accumulates in float32 and does not). Default and every=1.
3. MixtralForCausalLM: the router (`model.layers.1.mlp.gate`, MixtralTopKRouter) weight x1e6 at step 2: the router
   logits overflow in its F.linear, its softmax makes NaN -> overflow/nan_origin at the gate, step 2. (The experts run
   through transformers' grouped_mm, which casts to the fp32 weights: they cannot overflow fp16.)
4. Mixtral through the Trainer (output_router_logits=True, i.e. the load-balancing loss; gradient_accumulation_steps
   =2): the same router blow-up in layer 0, written by a TrainerCallback at global step 2 -> the gate, step 2.
5. WhisperForConditionalGeneration fed a power mel spectrogram (no log10/normalisation as WhisperFeatureExtractor
   does); at step 3 one clip is loud (power > 65504): `model.encoder.conv1`'s autocast cast makes +inf, step 3; the
   steps after are finite again.
6. Whisper through the Trainer (sequential sampler, gradient_accumulation_steps=2, batch 2): the loud example is in
   the SECOND micro-batch of optimizer step 2 -> conv1, step 2.
7. DebertaV2ForSequenceClassification with disentangled relative attention (c2p + p2c, share_att_key=False): layer
   1's `query_proj` and `pos_key_proj` x1000 at step 2. The content->content scores divide k by sqrt(3d) before the
   bmm; the content->position bmm `query @ pos_key^T` is scaled only after it -> overflow in
   `deberta.encoder.layer.1.attention.self`, step 2.
8. RobertaForMaskedLM (post-LN): `roberta.encoder.layer.1.attention.output.LayerNorm.weight` x1e5 at step 2. The
   LayerNorm runs in float32 under autocast and its output (~3e5) is finite; the next Linear,
   `roberta.encoder.layer.1.intermediate.dense`, casts it to fp16 -> overflow there, not at the norm. Default and
   every=1.
9. ModernBertForMaskedLM (eager): the q and k rows of layer 1's fused `Wqkv` (a sliding-window layer) x1000 at
   step 3: the scores overflow in `model.layers.1.attn`, not in `Wqkv` (finite).
10. AlbertForMaskedLM (eager): one shared layer applied 3 times per forward; its q/k x1000 at step 2. The first
   application (input: the 16->32 embedding projection, |x| ~ 0.3) stays finite, the second (input: a LayerNorm
   output, |x| ~ 3) overflows: overflow at `...albert_layers.0.attention`, step 2, a module called three times.
11. ConvNextV2ForImageClassification: stage 0's `pwconv1` x1e5 at step 2: every activation is finite (< 65504), but
   GRN's spatial L2 norm over 16x16 positions is not: `torch.linalg.vector_norm` gives +inf in fp16 and inf/inf is
   NaN -> overflow/nan_origin at `...stages.0.layers.0.grn`, step 2 (not `pwconv1`, not `act`). Default and every=1.
12. MistralForCausalLM with activation checkpointing (`activation_checkpointing_enable`, non-reentrant): the MLP of
   layer 1 x300 at step 2 -> `model.layers.1.mlp.down_proj`, step 2, through the recomputed forward.
13. Gemma2ForCausalLM (final_logit_softcapping=30): the tied embedding row of an unseen token x3e5 at step 2.
   `lm_head` emits +-inf from step 2 on, but the softcap's tanh absorbs it (the same +-30 as in float32: absorbed,
   the loss stays finite, steps 2-3 are applied). From step 4 the loss-scaled BACKWARD overflows: the gradient into
   layer 1's `post_feedforward_layernorm` output is finite (fp16, ~2.2e4) and the one it sends to its input (the
   fp32 -> fp16 cast of the RMSNorm's input gradient) is not (checked with tensor hooks, no watch); the scaler skips
   steps 4-7. Right answer: overflow, backward, at `model.layers.1.post_feedforward_layernorm`, step 4; no forward
   error at `lm_head`. Default and every=1.
14. Qwen2ForCausalLM through the Trainer with `label_smoothing_factor=0.1` (SFT, loss on the completion only): the
   batch of step 2 holds prompts truncated before any completion token. The Trainer's LabelSmoother (outside the
   model) divides by num_items_in_batch = 0: NaN loss at step 2, model outputs finite, gradients zero (no skip) ->
   nan_origin with module None (outside the model), step 2.

Healthy runs (no warning/error; finite losses that fall): MambaForCausalLM (the CPU slow path: the selective scan in
a Python loop, its state in float32 inside autocast), CLIPModel's contrastive loss (logit_scale at its init),
BartForConditionalGeneration with encoder padding and ignored labels, Mixtral with the load-balancing loss and router
jitter, PatchTSTForPrediction (Student-t NLL) on raw series around 2e5 (above fp16's max: the model's own std scaler
normalises them in float32), Gemma2 with its softcapping.

ampdoctor got wrong (strict xfails; fixed since: the replay fold skips ops whose inf a later op absorbed and gives
an unlocated finding the replay's first op of its own phase, and a forward inf whose every step was skipped for a
backward producer elsewhere counts as absorbed):
- 13, default watch: the report is `[error] overflow at lm_head aten::mm step 4` (twice, phase forward) and
  `[error] skipped_steps at lm_head ... the forward pass itself was non-finite, which no loss scale can fix`; the
  backward overflow at `model.layers.1.post_feedforward_layernorm` is nowhere in the report, though the watch
  recorded it as the backward producer of sampled steps 5-7 (every=1 reports it right: `[error] overflow at
  model.layers.1.post_feedforward_layernorm aten::_to_copy step 4`, and lm_head's forward inf as info, absorbed).
  Where (read, not changed): ampdoctor/analysis/replayfold.py fold_replay() -- the backward finding, seen at sampled
  step 5 with its onset at the captured step 4, counts as `unlocated` and is then replaced by the replay's first op
  event of ANY phase (`o.get("phase") == g.phase or unlocated`): lm_head's forward mm; and
  ampdoctor/rules/steps.py absorbed() -- lm_head's forward group holds only the sampled steps 5-7, all skipped, so
  "at least one step was stepped with finite gradients" fails and an inf the softcap absorbed on every step (loss
  and outputs finite) becomes an error; the unsampled steps 2-3 that were stepped are not in the group.
All the other failures are named with the right rule at the producing module and step among the first three
findings, and the healthy runs are quiet.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
T = pytest.importorskip("transformers")

from probe_harness import (Producer, at_top3 as _at, falls as _falls, first_bad_log as _first_bad,  # noqa: E402
                           fp16_accelerator, hf_train as _train, quiet_report)
from scenarios import lines, no_error_at, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

F16 = torch.float16
LINEAR = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::_to_copy")
SCORES = ("aten::bmm", "aten::matmul", "aten::baddbmm")
CONV = ("aten::convolution", "aten::_convolution", "aten::conv1d", "aten::_to_copy")
EVERY = [pytest.param(None, id="default"), pytest.param(1, id="every1")]


# ---------------------------------------------------------------------------------------------------- models

def _ids(seed=0, b=4, s=16, hi=120):
    return torch.randint(1, hi, (b, s), generator=torch.Generator().manual_seed(seed))


def _lm(k, hi=120):
    x = _ids(k, hi=hi)
    return {"input_ids": x, "labels": x}


def _mlm(k):
    """Every 4th token masked (id 4) and predicted; the rest ignored."""
    x = _ids(k) + 4
    lab = torch.full_like(x, -100)
    lab[:, 3::4] = x[:, 3::4]
    inp = x.clone()
    inp[:, 3::4] = 4
    return {"input_ids": inp, "labels": lab}


def _decoder(**kw):
    return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, **kw)


def gemma(**kw):
    return T.GemmaForCausalLM(T.GemmaConfig(**_decoder(**kw)))


def gemma2(**kw):
    return T.Gemma2ForCausalLM(T.Gemma2Config(**_decoder(sliding_window=8, attn_implementation="eager", **kw)))


def qwen3(**kw):
    return T.Qwen3ForCausalLM(T.Qwen3Config(**_decoder(**kw)))


def mistral(**kw):
    return T.MistralForCausalLM(T.MistralConfig(**_decoder(**kw)))


def mixtral(**kw):
    cfg = _decoder(num_local_experts=4, num_experts_per_tok=2, **kw)
    cfg["intermediate_size"] = 64
    return T.MixtralForCausalLM(T.MixtralConfig(**cfg))


def qwen2(**kw):
    return T.Qwen2ForCausalLM(T.Qwen2Config(**_decoder(**kw)))


def whisper():
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=128, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None))


def _mel(seed, loud=False):
    """A power mel spectrogram (16 bins x 32 frames), not log10-compressed; `loud`: frames 8..23 of a loud clip."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(16, 32, generator=g) ** 4 * 3000
    if loud:
        p[:, 8:24] = 2e5 * torch.rand(16, 16, generator=g) ** 2
    return p, torch.randint(3, 128, (8,), generator=g)


def deberta():
    return T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16,
        max_relative_positions=-1, share_att_key=False, norm_rel_ebd="layer_norm", num_labels=2))


def roberta():
    return T.RobertaForMaskedLM(T.RobertaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2))


def modernbert():
    return T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2, mask_token_id=3, attn_implementation="eager"))


def albert():
    return T.AlbertForMaskedLM(T.AlbertConfig(
        vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0, attn_implementation="eager"))


def convnextv2():
    return T.ConvNextV2ForImageClassification(T.ConvNextV2Config(
        num_channels=3, image_size=64, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
        num_labels=3))


def mamba():
    return T.MambaForCausalLM(T.MambaConfig(
        vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2, intermediate_size=64, conv_kernel=4,
        time_step_rank=4, use_mambapy=False))


def clip():
    return T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2),
        projection_dim=16))


def bart():
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))


def patchtst():
    return T.PatchTSTForPrediction(T.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, prediction_length=8, d_model=32,
        num_attention_heads=2, num_hidden_layers=2, ffn_dim=64, loss="nll", distribution_output="student_t"))


# ------------------------------------------------------------------------------------------- Trainer (fp16 on CPU)

fp16_on_cpu = pytest.fixture(name="fp16_on_cpu")(fp16_accelerator)


def _trainer(tmp_path, model, data, steps, cls=None, **kw):
    from ampdoctor.integrations import AmpDoctorCallback

    cb = AmpDoctorCallback()
    args = T.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=steps,
                               lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                               report_to=[], disable_tqdm=True, seed=0,
                               **{"per_device_train_batch_size": 4, "learning_rate": 1e-4, **kw})
    tr = (cls or T.Trainer)(model=model, args=args, train_dataset=data, callbacks=[cb])
    return tr, cb


class _Scales(T.TrainerCallback):
    """This test's own record of the run: the scaler's scale after each optimizer step, the logged losses, and the
    oracle's optimizer step."""

    def __init__(self, acc, prod=None):
        self.acc, self.prod, self.scales, self.losses = acc, prod, [], []

    def on_step_begin(self, args, state, control, **kw):
        if self.prod is not None:
            self.prod.step = state.global_step

    def on_step_end(self, args, state, control, **kw):
        self.scales.append(self.acc.scaler.get_scale())

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


class _Inject(T.TrainerCallback):
    """A bad update, once: `fn(model)` under no_grad at the start of optimizer step `k`."""

    def __init__(self, k, fn):
        self.k, self.fn, self.done = k, fn, False

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step == self.k and not self.done:
            self.done = True
            with torch.no_grad():
                self.fn(model)


class _Data(torch.utils.data.Dataset):
    def __init__(self, item, n=64):
        self.item, self.n = item, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.item(i)


def _lm_item(i):
    x = torch.randint(1, 120, (16,), generator=torch.Generator().manual_seed(i))
    return {"input_ids": x, "labels": x}


# ==================================================================================================== failures

@pytest.mark.parametrize("every", EVERY)
def test_gemma_tied_embedding_row_of_an_unseen_token_overflows_lm_head(every):
    """A bad update writes row 125 of Gemma's tied embedding (x3e5); token 125 never occurs in the data, so the
    embedding lookup never returns it, but the tied lm_head computes its logit at every position: lm_head's mm
    overflows at step 2."""
    torch.manual_seed(0)
    m = gemma()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    rep, log, first = _train(m, _lm(0), 5, lambda k, m: k == 2 and m.model.embed_tokens.weight[125].mul_(3e5),
                             every=every)
    assert _first_bad(log) == (2, 2) and first == ("lm_head", 2)
    _at(rep, "overflow", "lm_head", 2, "forward", LINEAR)
    no_error_at(rep, {"model.embed_tokens", "model.norm", "model"})


@pytest.mark.parametrize("every", EVERY)
def test_qwen3_qk_norm_gain_blowup_overflows_the_scores_not_the_norms(every):
    """Layer 1's q_norm/k_norm gains x100 at step 3 (eager attention): the norms' outputs are float32 (fp32 weight x
    fp16 input) and finite (~300); the matmul q @ k^T (fp16 under autocast) overflows before the 1/sqrt(d) scale."""
    torch.manual_seed(0)
    m = qwen3(attn_implementation="eager")

    def inject(k, m):
        if k == 3:
            a = m.model.layers[1].self_attn
            a.q_norm.weight.mul_(100)
            a.k_norm.weight.mul_(100)
    rep, log, first = _train(m, _lm(0), 6, inject, every=every)
    assert _first_bad(log) == (3, 3) and first == ("model.layers.1.self_attn", 3)
    _at(rep, "overflow", "model.layers.1.self_attn", 3, "forward", SCORES)
    no_error_at(rep, {"model.layers.1.self_attn.q_norm", "model.layers.1.self_attn.k_norm",
                      "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"})


def test_mixtral_router_logits_overflow_in_the_gate():
    """MixtralTopKRouter's weight x1e6 at step 2 (layer 1): F.linear's router logits overflow fp16 and its own
    softmax turns them into NaN; the gate (not the experts, nor the MoE block) is the producer."""
    torch.manual_seed(0)
    m = mixtral()
    rep, log, first = _train(m, _lm(0), 5, lambda k, m: k == 2 and m.model.layers[1].mlp.gate.weight.mul_(1e6))
    gate = "model.layers.1.mlp.gate"
    assert _first_bad(log) == (2, 2) and first == (gate, 2)
    _at(rep, ("overflow", "nan_origin"), gate, 2, "forward", LINEAR)
    no_error_at(rep, {"model.layers.1.mlp", "model.layers.1.mlp.experts", "model.layers.1.post_attention_layernorm"})


def test_mixtral_trainer_with_accumulation_router_blowup_is_named_at_the_gate(tmp_path, fp16_on_cpu):
    """Through the Trainer (fp16, output_router_logits=True: the load-balancing loss is added;
    gradient_accumulation_steps=2): a callback writes layer 0's router weight x1e6 at global step 2. Both
    micro-batches of step 2 overflow in the gate; the scaler skips steps 2, 3, 4."""
    torch.manual_seed(0)
    m = mixtral(output_router_logits=True)
    tr, cb = _trainer(tmp_path, m, _Data(_lm_item), 5, gradient_accumulation_steps=2)
    acc = fp16_on_cpu(tr.accelerator)
    prod = Producer(m, own_params=False, with_kwargs=True)
    rec = _Scales(acc, prod)
    tr.add_callback(rec)
    tr.add_callback(_Inject(2, lambda m: m.model.layers[0].mlp.gate.weight.mul_(1e6)))
    try:
        tr.train()
    finally:
        prod.remove()
    gate = "model.layers.0.mlp.gate"
    assert prod.first == (gate, 2)
    assert rec.scales == [65536.0, 65536.0, 32768.0, 16384.0, 8192.0], rec.scales
    _at(cb.report, ("overflow", "nan_origin"), gate, 2, "forward", LINEAR)


def test_whisper_power_mel_of_a_loud_clip_overflows_conv1():
    """Whisper fed a power mel spectrogram (the log10 + clamp + rescale of WhisperFeatureExtractor left out): values
    up to 3e3 are finite in fp16; at step 3 a loud clip reaches 2e5 and conv1's autocast cast makes +inf. One
    batch: the steps after are finite again."""
    torch.manual_seed(0)
    m = whisper()

    def batch(k):
        mel, lab = zip(*(_mel(10 * k + i, loud=(k == 3 and i == 1)) for i in range(4)))
        return {"input_features": torch.stack(mel), "labels": torch.stack(lab)}
    rep, log, first = _train(m, batch, 6)
    assert _first_bad(log) == (3, 3) and first == ("model.encoder.conv1", 3)
    assert log[4][0] and log[5][0] and not log[4][1]
    _at(rep, "overflow", "model.encoder.conv1", 3, "forward", CONV)
    no_error_at(rep, {"model.encoder.conv2", "model.encoder", "model.encoder.layers.0.self_attn_layer_norm"})


def test_whisper_trainer_loud_clip_in_the_second_micro_batch_is_named_at_its_step(tmp_path, fp16_on_cpu):
    """Through the Trainer (sequential sampler, batch 2, gradient_accumulation_steps=2): example 10 is the loud
    clip, in the second micro-batch of optimizer step 2 (examples 8-11). conv1 overflows at step 2, only there."""
    torch.manual_seed(0)
    m = whisper()

    def item(i):
        mel, lab = _mel(i, loud=(i == 10))
        return {"input_features": mel, "labels": lab}
    tr, cb = _trainer(tmp_path, m, _Data(item), 5, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      train_sampling_strategy="sequential")
    acc = fp16_on_cpu(tr.accelerator)
    prod = Producer(m, own_params=False, with_kwargs=True)
    rec = _Scales(acc, prod)
    tr.add_callback(rec)
    try:
        tr.train()
    finally:
        prod.remove()
    assert prod.first == ("model.encoder.conv1", 2)
    assert rec.scales == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0], rec.scales  # one skip, at step 2
    _at(cb.report, "overflow", "model.encoder.conv1", 2, "forward", CONV)


def test_deberta_v2_content_to_position_scores_overflow_in_the_attention():
    """DeBERTa-v2's disentangled attention: c2c = q @ (k / sqrt(3d)), but c2p = q @ pos_k^T is divided only after
    the bmm. Layer 1's query_proj and pos_key_proj x1000 at step 2: q and pos_k (~500) are finite, c2p is not."""
    torch.manual_seed(0)
    m = deberta()

    def inject(k, m):
        if k == 2:
            a = m.deberta.encoder.layer[1].attention.self
            a.query_proj.weight.mul_(1000)
            a.pos_key_proj.weight.mul_(1000)
    rep, log, first = _train(m, lambda k: {"input_ids": _ids(k), "labels": torch.tensor([0, 1, 0, 1])}, 5, inject)
    att = "deberta.encoder.layer.1.attention.self"
    assert _first_bad(log) == (2, 2) and first == (att, 2)
    _at(rep, "overflow", att, 2, "forward", SCORES)
    no_error_at(rep, {att + ".query_proj", att + ".pos_key_proj", att + ".key_proj"})


@pytest.mark.parametrize("every", EVERY)
def test_roberta_layernorm_weight_blowup_overflows_the_next_linear_not_the_norm(every):
    """Post-LN RoBERTa: layer 1's attention-output LayerNorm weight x1e5 at step 2. LayerNorm runs in float32 under
    autocast (output ~3e5, finite); `intermediate.dense` casts it to fp16: the Linear is the producer."""
    torch.manual_seed(0)
    m = roberta()
    ln = "roberta.encoder.layer.1.attention.output.LayerNorm"
    rep, log, first = _train(m, _mlm, 5, lambda k, m: k == 2 and m.get_submodule(ln).weight.mul_(1e5), every=every)
    dense = "roberta.encoder.layer.1.intermediate.dense"
    assert _first_bad(log) == (2, 2) and first == (dense, 2)
    _at(rep, "overflow", dense, 2, "forward", LINEAR)
    no_error_at(rep, {ln, "roberta.encoder.layer.1.attention.output", "roberta.encoder.layer.1.attention"})


def test_modernbert_fused_qkv_sliding_layer_scores_overflow_in_attn_not_wqkv():
    """ModernBERT's fused Wqkv: the q and k rows (0..127) of layer 1 (a sliding-window layer) x1000 at step 3. Wqkv's
    output (~500) is finite; the eager scores matmul in `model.layers.1.attn` overflows."""
    torch.manual_seed(0)
    m = modernbert()
    assert m.config.layer_types[1] == "sliding_attention"
    rep, log, first = _train(m, _mlm, 6, lambda k, m: k == 3 and m.model.layers[1].attn.Wqkv.weight[:128].mul_(1000))
    assert _first_bad(log) == (3, 3) and first == ("model.layers.1.attn", 3)
    _at(rep, "overflow", "model.layers.1.attn", 3, "forward", SCORES)
    no_error_at(rep, {"model.layers.1.attn.Wqkv", "model.layers.1.attn_norm"})


def test_albert_shared_layer_overflows_on_its_second_application():
    """ALBERT applies one shared layer three times per forward. Its q/k x1000 at step 2: the first call (input: the
    16 -> 32 embedding projection, |x| ~ 0.3) stays finite, the second (input: the layer's own LayerNorm output,
    |x| ~ 3) overflows in the scores. The producer is the shared attention module, on its second call."""
    torch.manual_seed(0)
    m = albert()
    att = "albert.encoder.albert_layer_groups.0.albert_layers.0.attention"
    calls = []
    h = m.get_submodule(att).register_forward_hook(lambda mod, a, o: calls.append(bool(torch.isfinite(o[0]).all())))

    def inject(k, m):
        if k == 2:
            a = m.get_submodule(att)
            a.query.weight.mul_(1000)
            a.key.weight.mul_(1000)
    try:
        rep, log, first = _train(m, _mlm, 5, inject)
    finally:
        h.remove()
    assert _first_bad(log) == (2, 2) and first == (att, 2)
    assert calls[:6] == [True] * 6 and calls[6:8] == [True, False]  # steps 0-1 fine; step 2: call 1 fine, call 2 inf
    _at(rep, "overflow", att, 2, "forward", SCORES)
    no_error_at(rep, {att + ".query", att + ".key", att + ".LayerNorm",
                      "albert.encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm"})


@pytest.mark.parametrize("every", EVERY)
def test_convnextv2_grn_spatial_norm_overflows_though_every_activation_is_finite(every):
    """ConvNeXt-V2's GRN: `vector_norm(x, dim=(H, W))` in fp16 over 16x16 positions. Stage 0's pwconv1 x1e5 at
    step 2: its outputs (<= 2e4) and the GELU's are finite, their spatial L2 norm (~16x the rms) is not, and
    inf / mean(inf) is NaN. (The skip at step 0 is GradScaler's first backoff.)"""
    torch.manual_seed(0)
    m = convnextv2()
    layer = "convnextv2.encoder.stages.0.layers.0"

    def inject(k, m):
        if k == 2:
            m.get_submodule(layer + ".pwconv1").weight.mul_(1e5)
            m.get_submodule(layer + ".pwconv1").bias.mul_(1e5)

    def batch(k):
        return {"pixel_values": torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(k)),
                "labels": torch.tensor([0, 1, 2, 0])}
    rep, log, first = _train(m, batch, 5, inject, every=every)
    assert _first_bad(log) == (2, 0) and not log[1][1] and log[2][1]
    assert first == (layer + ".grn", 2)
    _at(rep, ("overflow", "nan_origin"), layer + ".grn", 2, "forward", ("aten::linalg_vector_norm", "aten::norm"))
    no_error_at(rep, {layer + ".pwconv1", layer + ".act"})


def test_mistral_with_activation_checkpointing_mlp_overflow_at_down_proj():
    """activation_checkpointing_enable() (non-reentrant torch.utils.checkpoint per decoder layer): the forward of
    each layer runs again in the backward. Layer 1's MLP (gate/up/down) x300 at step 2: down_proj's mm overflows
    (its input, the SwiGLU product ~1.5e4, is finite). The oracle runs on an identical twin without checkpointing
    (its hooks break the checkpoint's recomputation check); the numbers are the same."""
    def inject(k, m):
        if k == 2:
            mlp = m.model.layers[1].mlp
            for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                lin.weight.mul_(300)
    torch.manual_seed(0)
    twin = mistral()
    _, tlog, first = _train(twin, _lm(0), 5, inject)
    torch.manual_seed(0)
    m = mistral()
    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    rep, log, _ = _train(m, _lm(0), 5, inject, oracle=False)
    assert [e[2] for e in log[:2]] == [e[2] for e in tlog[:2]]
    assert _first_bad(log) == (2, 2) and first == ("model.layers.1.mlp.down_proj", 2)
    _at(rep, "overflow", "model.layers.1.mlp.down_proj", 2, "forward", LINEAR)
    no_error_at(rep, {"model.layers.1.mlp", "model.layers.1", "model.norm"})


def _gemma2_softcap_grads(step=4, steps=5):
    """The Gemma2 scenario without a watch: at `step`, is the gradient into `post_feedforward_layernorm`'s output
    finite, and the one it sends to its input? and the one lm_head sends to its input?"""
    torch.manual_seed(0)
    m = gemma2()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cpu")
    seen = {}

    def note(key):
        def g(grad):
            seen.setdefault(key, bool(torch.isfinite(grad).all()))
        return g

    def tap(name):
        def f(mod, args, out):
            if torch.is_grad_enabled() and args[0].requires_grad:
                out.register_hook(note((name, "out")))
                args[0].register_hook(note((name, "in")))
        return f
    pff = "model.layers.1.post_feedforward_layernorm"
    hs = [m.get_submodule(n).register_forward_hook(tap(n)) for n in (pff, "lm_head")]
    out = {}
    for k in range(steps):
        if k == 2:
            with torch.no_grad():
                m.model.embed_tokens.weight[125].mul_(3e5)
        seen.clear()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=F16):
            loss = m(**_lm(0)).loss
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        out[k] = dict(seen)
    for h in hs:
        h.remove()
    return out[step], pff


@pytest.mark.parametrize("every", [
    pytest.param(None, id="default"),
    pytest.param(1, id="every1"),
])
def test_gemma2_softcapped_lm_head_inf_is_absorbed_the_backward_overflows_in_post_feedforward_norm(every):
    """Gemma2 (final_logit_softcapping=30): the tied embedding row of an unseen token x3e5 at step 2. lm_head emits
    +-inf from step 2 on, but tanh(inf / 30) * 30 = +-30, the value float32 gives too: absorbed, the loss stays
    finite (x4: the spike itself) and steps 2-3 are applied. From step 4 the loss-scaled backward overflows in
    layer 1's post_feedforward_layernorm (its input gradient, cast from fp32 to fp16, is inf while its output
    gradient is finite): the scaler skips steps 4-7. The producer of the failure is that norm's backward, step 4."""
    grads, pff = _gemma2_softcap_grads()
    torch.manual_seed(0)
    m = gemma2()
    assert m.config.final_logit_softcapping == 30.0
    rep, log, first = _train(m, _lm(0), 8, lambda k, m: k == 2 and m.model.embed_tokens.weight[125].mul_(3e5),
                             every=every)
    assert all(e[0] for e in log) and first == ("lm_head", 2)
    assert log[2][2] > 3 * log[1][2]
    if all(grads.values()):
        # Whether step 4's backward overflows depends on the CPU's fp16 kernels (on one with AVX512-FP16 it stays
        # finite and no step is skipped): then the absorbed lm_head inf alone must raise nothing.
        assert not any(e[1] for e in log)
        errs = [f.one_line() for f in rep.findings if f.severity == "error"]
        assert not errs, lines(rep)
    else:
        assert grads[(pff, "out")] and not grads[(pff, "in")] and grads[("lm_head", "in")], grads
        assert [k for k, e in enumerate(log) if e[1]] == [4, 5, 6, 7]
        _at(rep, "overflow", pff, 4, "backward")
    bad = [f.one_line() for f in rep.findings if f.module == "lm_head" and f.phase == "forward"
           and f.rule in ("overflow", "nan_origin") and f.severity == "error"]
    assert not bad, (bad, lines(rep))


class _StepLosses(T.Trainer):
    """The Trainer, noting each micro-batch's loss as compute_loss returns it (the logged loss averages them, and a
    NaN stays in its running sum)."""

    def compute_loss(self, *a, **kw):
        out = super().compute_loss(*a, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        self.step_losses = getattr(self, "step_losses", []) + [float(loss.detach())]
        return out


def test_qwen2_trainer_label_smoothing_on_a_batch_without_completion_tokens_is_nan_outside_the_model(
        tmp_path, fp16_on_cpu):
    """SFT through the Trainer with label_smoothing_factor=0.1: the loss is the Trainer's LabelSmoother on the
    model's logits (the model gets no labels), divided by num_items_in_batch. Examples 8-11 (step 2, sequential
    sampler) are prompts truncated before any completion token: 0 items, 0/0 = NaN. The model's outputs are finite,
    the gradients zero (no skip): the NaN is made outside the watched model."""
    def item(i):
        x = torch.randint(1, 120, (16,), generator=torch.Generator().manual_seed(i))
        lab = x.clone()
        lab[:10] = -100
        if 8 <= i < 12:
            lab[:] = -100
        return {"input_ids": x, "labels": lab}
    torch.manual_seed(0)
    m = qwen2()
    tr, cb = _trainer(tmp_path, m, _Data(item), 5, cls=_StepLosses, label_smoothing_factor=0.1,
                      train_sampling_strategy="sequential")
    acc = fp16_on_cpu(tr.accelerator)
    prod = Producer(m, own_params=False, with_kwargs=True)
    rec = _Scales(acc, prod)
    tr.add_callback(rec)
    try:
        tr.train()
    finally:
        prod.remove()
    assert [math.isfinite(v) for v in tr.step_losses] == [True, True, False, True, True], tr.step_losses
    assert prod.first is None and rec.scales == [65536.0] * 5
    _at(cb.report, "nan_origin", None, 2)


# ==================================================================================================== healthy runs

def _healthy(m, batch, steps=12, lr=1e-3, max_skips=0):
    rep, log, first = _train(m, batch, steps, lr=lr)
    assert first is None
    assert sum(e[1] for e in log) <= max_skips, log
    _falls([e[2] for e in log])
    quiet_report(rep, saw_steps=False)


def test_healthy_mamba_slow_path_is_quiet():
    torch.manual_seed(0)
    _healthy(mamba(), lambda k: _lm(k % 3))


def test_healthy_clip_contrastive_is_quiet():
    """(GradScaler's first two backoffs at steps 0-1 are its usual search: info.)"""
    def batch(k):
        g = torch.Generator().manual_seed(k % 3)
        return {"input_ids": torch.randint(1, 128, (4, 12), generator=g),
                "pixel_values": torch.randn(4, 3, 16, 16, generator=g), "return_loss": True}
    torch.manual_seed(0)
    _healthy(clip(), batch, max_skips=2)


def test_healthy_bart_with_padding_and_ignored_labels_is_quiet():
    def batch(k):
        x = _ids(k % 3) + 3
        am = torch.ones(4, 16, dtype=torch.long)
        am[1, 10:] = 0
        am[3, 5:] = 0
        x[am == 0] = 1
        lab = _ids(k % 3 + 7) + 3
        lab[2, 12:] = -100
        return {"input_ids": x, "attention_mask": am, "labels": lab}
    torch.manual_seed(0)
    _healthy(bart(), batch)


def test_healthy_mixtral_with_load_balancing_loss_and_router_jitter_is_quiet():
    torch.manual_seed(0)
    _healthy(mixtral(output_router_logits=True, router_jitter_noise=0.01), lambda k: _lm(k % 3))


def test_healthy_patchtst_on_raw_series_above_fp16_max_is_quiet():
    """Series around 2e5 (not normalised by the user; 3x fp16's max): PatchTST's std scaler normalises them in
    float32 before any fp16 op; the Student-t NLL is scale-aware."""
    def batch(k):
        g = torch.Generator().manual_seed(k % 4)
        t = torch.arange(40).float()
        x = (2e5 * (1 + 0.1 * torch.rand(4, 1, 3, generator=g))
             + 50 * torch.sin(t[None, :, None] / 3 + torch.rand(4, 1, 3, generator=g) * 6)
             + 5 * torch.randn(4, 40, 3, generator=g))
        return {"past_values": x[:, :32], "future_values": x[:, 32:]}
    assert batch(0)["past_values"].min() > 65504
    torch.manual_seed(0)
    _healthy(patchtst(), batch, steps=16)


def test_healthy_gemma2_softcapping_is_quiet():
    torch.manual_seed(0)
    _healthy(gemma2(), lambda k: _lm(k % 3))
