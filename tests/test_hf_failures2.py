"""Probe: failures injected into tiny Hugging Face models (built from configs, no downloads), trained with CPU fp16
autocast + GradScaler under a default `watch` (and `every=1` where it matters).

Each test first checks that the failure really happens in the run (the loss or the scaler goes bad at the expected
step, and not before), then asks for what a correct tool must say among `rep.findings[:3]`: the rule of the
contract, the *producing* module (the one whose own op first made inf/NaN, checked with forward hooks and
gradient hooks while writing these tests) and the step. Expectations that today's ampdoctor misses are
`xfail(strict=True)` with what it says instead.

Not covered again here: weight spikes x1e4 in an MLP/FFN projection (tests/test_hf_models.py,
benchmarks/realworld/cases.py).
"""
import math

import pytest
import torch

import ampdoctor

T = pytest.importorskip("transformers")

F16 = torch.float16


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only fight over the shared cores
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------------- models

def _ids(seed=0, b=4, s=16):
    return torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def gpt2(**kw):
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, **kw))


def bert(**kw):
    return T.BertForSequenceClassification(T.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, **kw))


def t5(**kw):
    return T.T5ForConditionalGeneration(T.T5Config(
        num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=100, decoder_start_token_id=0,
        pad_token_id=0, **kw))


def _decoder_cfg(**kw):
    return dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, **kw)


def llama(**kw):
    return T.LlamaForCausalLM(T.LlamaConfig(**_decoder_cfg(**kw)))


def mistral(**kw):
    return T.MistralForCausalLM(T.MistralConfig(**_decoder_cfg(**kw)))


def qwen2(**kw):
    return T.Qwen2ForCausalLM(T.Qwen2Config(**_decoder_cfg(**kw)))


def vit(**kw):
    return T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, **kw))


def bart(**kw):
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **kw))


def opt350m_style(**kw):
    """OPT with word_embed_proj_dim < hidden_size (as opt-350m): embeddings go straight into `project_in`."""
    return T.OPTForCausalLM(T.OPTConfig(
        vocab_size=100, hidden_size=32, word_embed_proj_dim=16, num_hidden_layers=2, ffn_dim=64,
        num_attention_heads=2, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        tie_word_embeddings=False, **kw))


def clip():
    return T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2),
        projection_dim=16))


# ---------------------------------------------------------------------------------------------------- the loop

def _train(model, batch, steps, inject=None, every=None, lr=1e-4):
    """The user's ordinary loop: fp16 CPU autocast, GradScaler, unscale_ + clip, step, update. `batch(k)` gives
    step k's kwargs; `inject(k, model, opt)` runs before step k's forward. Returns the report and, per step,
    (loss finite, scaler skipped the step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu")
    kw = {} if every is None else {"every": every}
    log = []
    with ampdoctor.watch(model, optimizer=opt, scaler=sc, **kw) as w:
        for k in range(steps):
            if inject is not None:
                inject(k, model, opt)
            b = batch(k) if callable(batch) else batch
            opt.zero_grad()
            with torch.autocast("cpu", dtype=F16):
                out = model(**b)
            loss = out.loss
            s0 = sc.get_scale()
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            log.append((math.isfinite(loss.item()), sc.get_scale() < s0))
    return w.report(), log


def _at_step(k, fn):
    def inject(step, model, opt):
        if step == k:
            with torch.no_grad():
                fn(model)
    return inject


def _first_bad(log):
    """(first step with a non-finite loss, first step the scaler skipped)."""
    nf = next((k for k, (fin, _) in enumerate(log) if not fin), None)
    sk = next((k for k, (_, skip) in enumerate(log) if skip), None)
    return nf, sk


def _top3(rep):
    return [f.one_line() for f in rep.findings[:3]]


def _match(rep, rules, module, steps, phase=None, ops=None):
    rules = (rules,) if isinstance(rules, str) else rules
    steps = (steps,) if isinstance(steps, int) or steps is None else steps
    for f in rep.findings[:3]:
        if (f.rule in rules and f.module == module and (None in steps or f.step in steps)
                and (phase is None or f.phase == phase) and (ops is None or f.op in ops)):
            return f
    return None


def _expect(rep, rules, module, steps, phase=None, ops=None):
    f = _match(rep, rules, module, steps, phase, ops)
    assert f is not None, (f"want {rules} at {module!r} step {steps} phase {phase} op {ops} in the top 3", _top3(rep))
    return f


LINEAR = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::_to_copy")
SCORES = ("aten::bmm", "aten::matmul", "aten::baddbmm")

EVERY = [pytest.param(None, id="default"), pytest.param(1, id="every1")]


# ---------------------------------------------------------------------------------------------------- attention

def test_llama_eager_attention_scores_overflow_in_the_attention_not_q_proj():
    """q_proj and k_proj weights x600 at step 3 (eager attention): q and k stay finite (|q| ~ 400), q @ k^T inside
    LlamaAttention.forward overflows before the 1/sqrt(d) scale. The producer is `self_attn` (op: matmul/bmm),
    not q_proj/k_proj, whose outputs are finite."""
    torch.manual_seed(0)
    m = llama(attn_implementation="eager")

    def fn(m):
        a = m.model.layers[0].self_attn
        a.q_proj.weight.mul_(600)
        a.k_proj.weight.mul_(600)
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 6, _at_step(3, fn))
    assert _first_bad(log) == (3, 3)
    _expect(rep, "overflow", "model.layers.0.self_attn", 3, "forward", SCORES)
    assert not _match(rep, "overflow", "model.layers.0.self_attn.q_proj", None)


def test_gpt2_without_attention_scaling_scores_overflow_in_layer_1():
    """GPT2Config(scale_attn_weights=False) and c_attn's q/k columns x800 at step 3 in layer 1: the scores matmul
    in `transformer.h.1.attn` overflows; c_attn's own output is finite."""
    torch.manual_seed(0)
    m = gpt2(scale_attn_weights=False, attn_implementation="eager")
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 6,
                      _at_step(3, lambda m: m.transformer.h[1].attn.c_attn.weight[:, :64].mul_(800)))
    assert _first_bad(log) == (3, 3)
    _expect(rep, "overflow", "transformer.h.1.attn", 3, "forward", SCORES)


def test_qwen2_qk_bias_blowup_overflows_the_scores():
    """Qwen2's q/k projections carry biases; both set to 100 at step 3: each q, k is ~100 in every channel, the
    16-channel dot product (~1.6e5) overflows in `model.layers.1.self_attn` (eager)."""
    torch.manual_seed(0)
    m = qwen2(attn_implementation="eager")

    def fn(m):
        a = m.model.layers[1].self_attn
        a.q_proj.bias.fill_(100.0)
        a.k_proj.bias.fill_(100.0)
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 6, _at_step(3, fn))
    assert _first_bad(log) == (3, 3)
    _expect(rep, "overflow", "model.layers.1.self_attn", 3, "forward", SCORES)


def test_bart_cross_attention_scores_overflow_in_encoder_attn():
    """The decoder's cross-attention (encoder_attn) q/k x1000 at step 3: the producer is
    `model.decoder.layers.1.encoder_attn`, not the self-attention or the encoder."""
    torch.manual_seed(0)
    m = bart(attn_implementation="eager")

    def fn(m):
        a = m.model.decoder.layers[1].encoder_attn
        a.q_proj.weight.mul_(1000)
        a.k_proj.weight.mul_(1000)
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 6, _at_step(3, fn))
    assert _first_bad(log) == (3, 3)
    _expect(rep, "overflow", "model.decoder.layers.1.encoder_attn", 3, "forward", SCORES)


def test_mistral_attention_output_projection_overflows():
    """v_proj x1000 and o_proj x3000 at step 3: the attention output (|x| ~ 450) is finite, o_proj's mm is not."""
    torch.manual_seed(0)
    m = mistral()

    def fn(m):
        a = m.model.layers[1].self_attn
        a.v_proj.weight.mul_(1000)
        a.o_proj.weight.mul_(3000)
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 6, _at_step(3, fn))
    assert _first_bad(log) == (3, 3)
    _expect(rep, "overflow", "model.layers.1.self_attn.o_proj", 3, "forward", LINEAR)


@pytest.mark.parametrize("every", [pytest.param(None, id="default"), pytest.param(1, id="every1")])
def test_bert_fp16_extended_mask_with_float32_min_nans_on_a_fully_padded_row(every):
    # (the default watch blamed the data: an input whose only non-finite values are -inf is a mask, not bad data)
    """A hand-built additive mask `(1 - am.half()) * finfo(float32).min` is -inf in fp16 (the constant overflows).
    Harmless while every row keeps one visible key; at step 2 the batch holds an all-padding example, the
    softmax of an all -inf row is NaN. The producer of the NaN is `bert.encoder.layer.0.attention.self`
    (its inputs carry -inf, no NaN); the root cause is the mask constant. Either is right."""
    torch.manual_seed(0)
    m = bert(attn_implementation="eager")

    def batch(k):
        am = torch.ones(4, 16, dtype=torch.long)
        am[1, 12:] = 0
        if k == 2:
            am[3, :] = 0
        ext = (1.0 - am[:, None, None, :].to(F16)) * torch.finfo(torch.float32).min
        return {"input_ids": _ids(k), "attention_mask": ext, "labels": torch.tensor([0, 1, 0, 1])}
    assert torch.isinf(batch(0)["attention_mask"]).sum() == 4  # the constant is -inf from step 0 on
    rep, log = _train(m, batch, 5, every=every)
    assert _first_bad(log) == (2, 2)
    assert (_match(rep, "nan_origin", "bert.encoder.layer.0.attention.self", 2)
            or any(f.rule == "mask_value_overflow" and f.step in (0, 2)
                   and f.module in (None, "", "bert.encoder.layer.0.attention.self") for f in rep.findings[:3])), \
        _top3(rep)


# ---------------------------------------------------------------------------------------------------- norms, embeddings, inputs

@pytest.mark.parametrize("every", EVERY)
def test_llama_rmsnorm_weight_blowup_overflows_at_q_proj_cast(every):
    """input_layernorm.weight x1e5 at step 2: LlamaRMSNorm returns float32 (weight fp32 * hidden), ~3.7e5 and
    finite; q_proj's autocast cast to fp16 makes inf. The producer is q_proj (first of q/k/v), not the norm."""
    torch.manual_seed(0)
    m = llama()
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 6,
                      _at_step(2, lambda m: m.model.layers[1].input_layernorm.weight.mul_(1e5)), every=every)
    assert _first_bad(log) == (2, 2)
    _expect(rep, "overflow", "model.layers.1.self_attn.q_proj", 2, "forward", LINEAR)


def test_opt_embedding_row_of_a_rare_token_overflows_project_in_when_it_first_appears():
    """OPT (opt-350m style: word_embed_proj_dim < hidden) feeds embeddings straight into `project_in`. Token 99's
    embedding row is ~1e6 (a corrupted / badly initialised added token); it first appears in the batch of step 4.
    The embedding lookup is finite (fp32); project_in's cast/mm makes inf."""
    torch.manual_seed(0)
    m = opt350m_style()
    with torch.no_grad():
        m.model.decoder.embed_tokens.weight[99] = torch.randn(16) * 1e6

    def batch(k):
        x = torch.randint(3, 99, (4, 16), generator=torch.Generator().manual_seed(k))
        if k == 4:
            x[2, 7] = 99
        return {"input_ids": x, "labels": x}
    rep, log = _train(m, batch, 7)
    assert _first_bad(log) == (4, 4)
    _expect(rep, "overflow", "model.decoder.project_in", 4, "forward", LINEAR)


def test_vit_unnormalised_uint16_image_overflows_the_patch_embedding():
    """Raw 16-bit images (0..65535) fed without normalisation; the batch of step 3 holds saturated pixels (65535
    > 65504). The pixel tensor is finite fp32; the patch-embedding conv's autocast cast makes +inf."""
    torch.manual_seed(0)
    m = vit()

    def batch(k):
        x = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(k)) * 40000
        if k == 3:
            x[1, :, 4:8, 4:8] = 65535.0
        return {"pixel_values": x, "labels": torch.tensor([0, 1, 2, 0])}
    rep, log = _train(m, batch, 6)
    assert _first_bad(log) == (3, 3)
    _expect(rep, "overflow", "vit.embeddings.patch_embeddings.projection", 3, "forward",
            ("aten::_to_copy", "aten::convolution", "aten::conv2d", "aten::_convolution"))


# ---------------------------------------------------------------------------------------------------- feed-forward

@pytest.mark.parametrize("every", [pytest.param(None, id="default"), pytest.param(1, id="every1")])
def test_t5_gated_gelu_decoder_wo_overflow_not_the_absorbed_gelu_pow(every):
    # (the default watch's replay named the activation's pow: an op whose module still returned finite values
    # now ranks after the ops whose values got out)
    """mT5/T5v1.1-style gated-gelu FF (the real fp16 failure: transformers #10830): wi_0, wi_1, wo x30 at step 3 in
    the decoder's last FF. NewGELU computes pow(x, 3) which overflows to +-inf for |x| > 40, but tanh saturates it
    to +-1 and the activation's output stays finite (its backward too: tanh' = 0). The first non-finite module
    output is `wo` (checked with forward hooks): the producer is wo, op mm."""
    torch.manual_seed(0)
    m = t5(feed_forward_proj="gated-gelu")

    def fn(m):
        ff = m.decoder.block[1].layer[2].DenseReluDense
        ff.wi_0.weight.mul_(30)
        ff.wi_1.weight.mul_(30)
        ff.wo.weight.mul_(30)
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 6, _at_step(3, fn), every=every)
    assert _first_bad(log) == (3, 3)
    _expect(rep, "overflow", "decoder.block.1.layer.2.DenseReluDense.wo", 3, "forward", LINEAR)


# ---------------------------------------------------------------------------------------------------- heads and losses

def test_clip_logit_scale_overflow_in_the_root_forward():
    """CLIPModel multiplies the cosine similarities by logit_scale.exp() in its own forward (HF does not clamp it,
    OpenCLIP clamps at 100). logit_scale set to 13 at step 3 (exp = 4.4e5): `sims * scale` overflows in fp16 in
    the root module, op mul. (GradScaler's first two backoffs at steps 0-1 are its usual search.)"""
    torch.manual_seed(0)
    m = clip()

    def batch(k):
        g = torch.Generator().manual_seed(k)
        return {"input_ids": torch.randint(1, 100, (4, 12), generator=g),
                "pixel_values": torch.randn(4, 3, 16, 16, generator=g), "return_loss": True}
    rep, log = _train(m, batch, 6, _at_step(3, lambda m: m.logit_scale.fill_(13.0)))
    assert _first_bad(log)[0] == 3
    _expect(rep, "overflow", "", 3, "forward", ("aten::mul",))


def test_gpt2_batch_with_every_label_ignored_is_a_nan_in_the_loss():
    """At step 3 every label is -100 (a batch of pure padding/prompt tokens): the mean cross-entropy over zero
    tokens is 0/0 = NaN, made by the loss inside GPT2LMHeadModel.forward (the root module)."""
    torch.manual_seed(0)
    m = gpt2()

    def batch(k):
        x = _ids(k)
        lab = x.clone()
        if k == 3:
            lab[:] = -100
        return {"input_ids": x, "labels": lab}
    rep, log = _train(m, batch, 6)
    assert _first_bad(log)[0] == 3
    _expect(rep, "nan_origin", "", 3, "forward")


@pytest.mark.parametrize("every", EVERY)
def test_bert_regression_on_unnormalised_targets_overflows_the_loss_backward(every):
    """BertForSequenceClassification(num_labels=1, regression) on raw targets up to 3e5 (prices, not normalised).
    MSE runs in fp32 under autocast and the loss (~3e10) is finite, but its gradient wrt the fp16 logits
    (2 (y_hat - y) / n * scale >= 1.5e5 even at scale 1) is inf when cast back to fp16: every step is skipped and
    the scale collapses. The inf is made by the backward of the loss computed in the root module's forward
    (checked: d loss / d logits is inf fp16 while the loss is finite fp32). Was "outside the watched model" and a
    collapse blamed on `dropout`, which only passed the gradient on."""
    torch.manual_seed(0)
    m = bert(num_labels=1, problem_type="regression")

    def batch(k):
        g = torch.Generator().manual_seed(k)
        return {"input_ids": torch.randint(1, 100, (4, 16), generator=g), "labels": torch.rand(4, generator=g) * 3e5}
    rep, log = _train(m, batch, 12, every=every)
    assert all(fin for fin, _ in log) and all(skip for _, skip in log)
    _expect(rep, ("overflow", "loss_scale_collapse"), "", 0, None)
    assert _match(rep, "loss_scale_collapse", "", None) or _match(rep, "loss_scale_collapse", None, None), _top3(rep)


# ---------------------------------------------------------------------------------------------------- optimizer

@pytest.mark.parametrize("every", [pytest.param(None, id="default"), pytest.param(1, id="every1")])
def test_llama_learning_rate_10_from_step_4_is_an_update_spike_then_overflow(every):
    # (the default watch missed the update: a routine step now checks its updates when any optimizer's lr rises
    # 4x, and a skipped step keeps the weight norms it found)
    """A scheduler bug sets lr=10 at step 4 (AdamW: every weight moves by ~10, x~500 of its size). The update of
    step 4 is the cause (update_spike, step 4 or 5); the forward of step 5 then overflows in o_proj."""
    torch.manual_seed(0)
    m = llama()

    def inject(step, model, opt):
        if step == 4:
            for g in opt.param_groups:
                g["lr"] = 10.0
    ids = _ids()
    rep, log = _train(m, {"input_ids": ids, "labels": ids}, 9, inject, every=every)
    assert _first_bad(log) == (5, 5)
    assert any(f.rule == "update_spike" and f.step in (4, 5) for f in rep.findings[:3]), _top3(rep)
    _expect(rep, ("overflow", "nan_origin"), "model.layers.0.self_attn.o_proj", 5, "forward")
