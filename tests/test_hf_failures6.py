"""Probe, sixth set: fp16 failures of Hugging Face architectures that no other test builds (BLOOM, GPT-J, XLNet,
DINOv2 with SwiGLU, Longformer, SegFormer, M2M100, Swin-V2, ELECTRA), all from tiny configs (no downloads), trained
on the CPU with fp16 autocast + `torch.amp.GradScaler("cpu")` (unscale_ + clip_grad_norm_ + step + update) under a
default `ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")`, public API only.

Every failure starts mid-run, at a known step, and is first proven by an oracle independent of ampdoctor: the loss
(or the scaler) shows it at that step and not before, and probe_harness's `Producer` (forward hooks on every
module, keyword inputs included: the first, innermost module whose output is non-finite while its inputs and own
parameters are finite) names the module the test then asks ampdoctor for, with the rule of docs/CONTRACT.md and the
step, among `rep.findings[:3]`. Case 9 has no module-level producer (the loss computed in the root's own forward
makes the first inf, in the backward): its oracle is a tensor hook on the logits' gradient, the loss gradient
recomputed by hand in fp32, and `Producer(backward=True)` finding no module whose backward made it; it runs once
(a module-scoped fixture) for two tests, the oracle's (must pass) and ampdoctor's (strict xfail), so the xfail
cannot pass or fail for a reason of the oracle's. The producers overflow in ops that are fp16 under CUDA autocast
too (mm, addmm, bmm, baddbmm, einsum, conv, the product of two fp16 tensors, an fp16 cast), except 8, said there.

Scenarios (failures):
 1. BloomForCausalLM (ALiBi): a LoRA merged with the wrong alpha/r into layer 1's fused `query_key_value` scales
    its q and k rows x2000 at step 5. The fp16 `alibi.baddbmm(q, k^T, alpha=1/sqrt(d))` overflows -> overflow at
    `transformer.h.1.self_attention`, step 5 (not `query_key_value`, whose output is finite).
 2. GPTJForCausalLM (eager): `eager_attention_forward` upcasts q and k to float32 before `torch.matmul`, but under
    autocast the matmul runs in fp16 anyway. q_proj/k_proj of layer 1 x1000 at step 4 -> overflow at
    `transformer.h.1.attn`, step 4.
 3. XLNetLMHeadModel: the relative attention's own Parameters `q` and `k` (used through torch.einsum, no
    nn.Linear) of layer 1 x1500 at step 4 -> the content-score einsum overflows: overflow at
    `transformer.layer.1.rel_attn`, step 4.
 4. Dinov2ForImageClassification with the SwiGLU FFN: `gate_proj` and `up_proj` of layer 1 x3000 at step 4. Both
    outputs stay finite (~1e3), their fp16 product `silu(gate) * up` in the FFN's own forward does not ->
    overflow at `dinov2.encoder.layer.1.mlp` (aten::mul), step 4; not at gate_proj/up_proj/down_proj.
 5. LongformerForMaskedLM (sliding-window chunked attention): layer 1's query/key x3000 at step 4 -> the chunked
    q.k einsum overflows in `longformer.encoder.layer.1.attention.self`, step 4.
 6. SegformerForSemanticSegmentation fed 16-bit images: the pipeline scales every image but the one batch at step
    6, a 16-bit capture passed raw (values up to 65535; saturated pixels = 65535, above fp16's max): the
    overlapping patch-embedding conv's autocast cast makes +inf -> overflow at
    `segformer.stages.0.patch_embeddings.proj`, step 6; the steps after are finite again (transient).
 7. M2M100ForConditionalGeneration fed precomputed `encoder_outputs` (features of an external fp32 encoder): at
    step 5 the features arrive unnormalised (x1e5). The decoder's cross-attention `k_proj` (the first module that
    reads them) overflows in its cast -> overflow at `model.decoder.layers.0.encoder_attn.k_proj`, step 5.
 8. Swinv2ForImageClassification: at step 5 a batch of 36x36 images (not a multiple of window x patch): Swin pads
    the feature map with zeros; SwinV2's key projection has no bias, so the padded tokens' keys are exactly 0 and
    the cosine attention's `F.normalize(key, eps=1e-12)` divides 0 by max(0, 1e-12 -> 0 in fp16) -> NaN ->
    eps_underflow (or nan_origin) at `swinv2.encoder.layers.0.blocks.0.attention.self`, step 5. CPU autocast
    only: CUDA autocast runs `norm` in fp32, where the eps exists.
 9. ElectraForSequenceClassification, num_labels=1 (regression with the model's own MSELoss): from step 5 the
    targets come from a shard in another unit (x1e5). Forward and loss stay finite (fp32 MSE, ~1e9); in the
    backward the MSE's gradient w.r.t. the logits (fp32, ~1.6e9 at scale 65536) is cast to the fp16 logits: inf,
    made by the loss computation in the root's own forward; `classifier.out_proj` only receives that inf and passes
    it on (as NaN). GradScaler then skips 15 steps in a row (65536 -> 1). Right answer: overflow, backward, at the
    root "", step 5, an error; no error at `classifier.out_proj`.

Healthy runs (the fix applied; no warning or error, every loss finite and falling):
 H1. SegFormer on the same 16-bit captures, every one divided by 65535 before normalising (the fix of 6).
 H2. ELECTRA regression with every target in one unit (the fix of 9).

Fixed since (a strict xfail here first) -- 9 (ELECTRA regression, targets in the wrong unit): the first three were
`[error] nan_origin at classifier.out_proj aten::mm step 5` (backward), `[error] loss_scale_collapse at (root) step
5`, `[info] overflow at (root) aten::_to_copy step 5: GradScaler's normal search ... finite at 1 (16 backoffs)`.
Two defects: the replay called a step finite only after 16 backoffs GradScaler's normal search (a streak of
records.BACKOFF_MAX_STREAK skips is a collapse: replay/explain.py `normal_search`, used by the replay, its findings
and the fold); and the fold dated a records' finding of a later step (out_proj's own weight gradient overflowing at
step 19, at a scale near 1) to the captured step through a replay op that had only received the inf
(analysis/replayfold.py: an op whose inputs held inf refines no finding). Now: `[error] overflow at (root)
aten::_to_copy step 5` (backward) first.
All the other failures are named with the right rule at the producing module and step among the first three
findings, and the healthy runs are quiet.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
T = pytest.importorskip("transformers")

import ampdoctor  # noqa: E402
from probe_harness import (Producer, at_top3 as _at, falls as _falls, first_bad_log as _first_bad,  # noqa: E402
                           quiet_report)
from scenarios import no_error_at, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

F16 = torch.float16
FP16_MAX = torch.finfo(F16).max
LINEAR = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::_to_copy")
SCORES = ("aten::bmm", "aten::matmul", "aten::baddbmm", "aten::einsum")
CONV = ("aten::convolution", "aten::_convolution", "aten::conv2d", "aten::_to_copy")


# ---------------------------------------------------------------------------------------------------- the loop

def _train(model, batch, steps, tmp_path, *, inject=None, lr=1e-4, backward=False, on_out=None):
    """The user's ordinary loop under a default watch with a run_dir: zero_grad -> forward under fp16 CPU autocast
    -> scaler.scale(loss).backward() -> unscale_ -> clip_grad_norm_(1.0) -> step -> update. `batch(k)` gives step
    k's kwargs; `inject(k, model)` runs under no_grad before step k; `on_out(k, out, kwargs)` sees each output.
    Returns (report, per step (loss finite, skipped, loss), the Producer oracle)."""
    torch.manual_seed(123)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu")
    prod = Producer(model, backward=backward, with_kwargs=True)
    log = []
    try:
        with ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path / "run") as w:
            for k in range(steps):
                prod.new_step(k)
                if inject is not None:
                    with torch.no_grad():
                        inject(k, model)
                b = batch(k)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=F16):
                    out = model(**b)
                if on_out is not None:
                    on_out(k, out, b)
                loss = out.loss
                s0 = sc.get_scale()
                sc.scale(loss).backward()
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(opt)
                sc.update()
                log.append((math.isfinite(loss.item()), sc.get_scale() < s0, loss.item()))
    finally:
        prod.remove()
    return w.report(), log, prod


def _max_out(module, store):
    """A forward hook keeping the abs-max of `module`'s output per call (for 'this module stayed finite')."""
    return module.register_forward_hook(lambda m, a, o: store.append(float(o.detach().float().abs().max())))


# ---------------------------------------------------------------------------------------------------- data

def _ids(seed, b=4, s=16, lo=1, hi=120):
    return torch.randint(lo, hi, (b, s), generator=torch.Generator().manual_seed(seed))


def _lm(k):
    x = _ids(k % 3)
    return {"input_ids": x, "labels": x}


def _mlm(k, s=16):
    """Every 4th token masked (id 3) and predicted; the rest ignored."""
    x = _ids(k % 3, s=s) + 4
    lab = torch.full_like(x, -100)
    lab[:, 3::4] = x[:, 3::4]
    inp = x.clone()
    inp[:, 3::4] = 3
    return {"input_ids": inp, "labels": lab}


def _images(k, size=16, n=4, labels=3):
    g = torch.Generator().manual_seed(k % 3)
    return {"pixel_values": torch.randn(n, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (n,), generator=g)}


# ---------------------------------------------------------------------------------------------------- models

def bloom():
    return T.BloomForCausalLM(T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4))


def gptj():
    return T.GPTJForCausalLM(T.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                          n_positions=64, attn_implementation="eager"))


def xlnet():
    return T.XLNetLMHeadModel(T.XLNetConfig(vocab_size=128, d_model=32, n_layer=2, n_head=2, d_inner=64,
                                            mem_len=None))


def dinov2_swiglu():
    return T.Dinov2ForImageClassification(T.Dinov2Config(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
        use_swiglu_ffn=True, num_labels=3))


def longformer():
    return T.LongformerForMaskedLM(T.LongformerConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=80, attention_window=4, pad_token_id=1))


def segformer():
    return T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32,
        num_labels=3))


def m2m100():
    return T.M2M100ForConditionalGeneration(T.M2M100Config(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1,
        decoder_start_token_id=2, eos_token_id=2, bos_token_id=0, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))


def swinv2():
    return T.Swinv2ForImageClassification(T.Swinv2Config(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, num_labels=3))


def electra_regressor():
    return T.ElectraForSequenceClassification(T.ElectraConfig(
        vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=1))


# ==================================================================================================== failures

def test_bloom_lora_merged_with_wrong_scale_overflows_the_alibi_baddbmm(tmp_path):
    """Layer 1's fused query_key_value (per head: q, k, v rows of head_dim) gets its q and k rows x2000 at step 5
    (a LoRA merged with alpha/r mistaken); the values (~300) are finite, BLOOM's fp16 `alibi.baddbmm(q, k^T)` is not."""
    torch.manual_seed(0)
    m = bloom()
    att = "transformer.h.1.self_attention"
    qkv = m.get_submodule(att + ".query_key_value")
    seen = []
    h = _max_out(qkv, seen)

    def inject(k, m):
        if k == 5:
            qkv.weight.view(4, 3, 16, 64)[:, :2].mul_(2000.0)
    try:
        rep, log, prod = _train(m, _lm, 8, tmp_path, inject=inject)
    finally:
        h.remove()
    assert _first_bad(log) == (5, 5) and prod.first == (att, 5), (log, prod.first)
    assert seen[5] < FP16_MAX, seen
    _at(rep, "overflow", att, 5, "forward", SCORES, "error")
    no_error_at(rep, {att + ".query_key_value", att + ".dense", "transformer.h.1.input_layernorm"})


def test_gptj_fp32_upcast_of_q_and_k_is_undone_by_autocast_and_the_scores_overflow(tmp_path):
    """GPT-J's eager attention computes `torch.matmul(query.to(float32), key.to(float32).T)`; autocast casts the
    matmul back to fp16. q_proj and k_proj of layer 1 x1000 at step 4: the fp16 scores overflow."""
    torch.manual_seed(0)
    m = gptj()
    att = "transformer.h.1.attn"

    def inject(k, m):
        if k == 4:
            m.get_submodule(att + ".q_proj").weight.mul_(1000.0)
            m.get_submodule(att + ".k_proj").weight.mul_(1000.0)
    rep, log, prod = _train(m, _lm, 7, tmp_path, inject=inject)
    assert _first_bad(log) == (4, 4) and prod.first == (att, 4), (log, prod.first)
    _at(rep, "overflow", att, 4, "forward", SCORES, "error")
    no_error_at(rep, {att + ".q_proj", att + ".k_proj", att + ".out_proj", "transformer.h.1.mlp.fc_in"})


def test_xlnet_relative_attention_own_parameters_overflow_its_einsum(tmp_path):
    """XLNet's relative attention keeps q, k, v, o, r as its own Parameters and projects with torch.einsum (no
    nn.Linear): layer 1's `q` and `k` x1500 at step 4; the content-score einsum (a bmm under autocast) overflows."""
    torch.manual_seed(0)
    m = xlnet()
    att = "transformer.layer.1.rel_attn"

    def inject(k, m):
        if k == 4:
            a = m.get_submodule(att)
            a.q.mul_(1500.0)
            a.k.mul_(1500.0)
    rep, log, prod = _train(m, _lm, 7, tmp_path, inject=inject)
    assert _first_bad(log) == (4, 4) and prod.first == (att, 4), (log, prod.first)
    assert all(bool(torch.isfinite(p).all()) and float(p.detach().abs().max()) < FP16_MAX
               for p in m.get_submodule(att).parameters(recurse=False))
    _at(rep, "overflow", att, 4, "forward", SCORES, "error")
    no_error_at(rep, {att + ".layer_norm", "transformer.layer.1.ff", "transformer.layer.1.ff.layer_1"})


def test_dinov2_swiglu_product_overflows_in_the_ffn_not_in_its_projections(tmp_path):
    """DINOv2's SwiGLU FFN: `down_proj(silu(gate_proj(x)) * up_proj(x))`. gate_proj and up_proj of layer 1 x3000 at
    step 4: each output ~1e3 (finite), their fp16 product in the FFN's own forward is not."""
    torch.manual_seed(0)
    m = dinov2_swiglu()
    mlp = "dinov2.encoder.layer.1.mlp"
    gate, up = m.get_submodule(mlp + ".gate_proj"), m.get_submodule(mlp + ".up_proj")
    g_seen, u_seen = [], []
    hs = [_max_out(gate, g_seen), _max_out(up, u_seen)]

    def inject(k, m):
        if k == 4:
            gate.weight.mul_(3000.0)
            up.weight.mul_(3000.0)
    try:
        rep, log, prod = _train(m, _images, 7, tmp_path, inject=inject)
    finally:
        for h in hs:
            h.remove()
    nf, _ = _first_bad(log)
    assert nf == 4 and all(e[0] for e in log[:4]) and prod.first == (mlp, 4), (log, prod.first)
    assert max(g_seen[4], u_seen[4]) < 0.1 * FP16_MAX, (g_seen, u_seen)  # both factors finite, with a margin
    _at(rep, "overflow", mlp, 4, "forward", ("aten::mul", "aten::mul_", "aten::silu"), "error")
    no_error_at(rep, {mlp + ".gate_proj", mlp + ".up_proj", mlp + ".down_proj", "dinov2.encoder.layer.1.norm2"})


def test_longformer_sliding_chunks_scores_overflow_in_the_self_attention(tmp_path):
    """Longformer's sliding-window attention computes q.k per chunk with torch.einsum (fp16 under autocast): layer
    1's query and key x3000 at step 4 -> the chunked scores overflow inside `attention.self`."""
    torch.manual_seed(0)
    m = longformer()
    att = "longformer.encoder.layer.1.attention.self"

    def inject(k, m):
        if k == 4:
            m.get_submodule(att + ".query").weight.mul_(3000.0)
            m.get_submodule(att + ".key").weight.mul_(3000.0)
    rep, log, prod = _train(m, lambda k: _mlm(k, s=32), 7, tmp_path, inject=inject)
    assert _first_bad(log) == (4, 4) and prod.first == (att, 4), (log, prod.first)
    _at(rep, "overflow", att, 4, "forward", SCORES, "error")
    no_error_at(rep, {att + ".query", att + ".key", att + ".value", "longformer.encoder.layer.1.attention.output"})


def _seg_batch(k, fix=False):
    """SegFormer batches: 2 images 32x32, a per-pixel label learnable from the image (the brightest channel). At
    step 6 the image is a raw 16-bit capture (0..65535, saturated pixels at 65535) that the pipeline forgot to
    scale; `fix`: it is divided by 65535 like the others before the same normalisation."""
    g = torch.Generator().manual_seed(k % 3)
    x = torch.rand(2, 3, 32, 32, generator=g)
    lab = x.argmax(1)
    if k == 6:
        raw = (x * 70000).clamp(max=65535).round()  # uint16 with saturated (clipped) pixels
        x = raw / 65535 if fix else raw
        if not fix:
            return {"pixel_values": x, "labels": lab}
    return {"pixel_values": (x - 0.45) / 0.25, "labels": lab}


def test_segformer_raw_16bit_image_overflows_the_patch_embedding_conv(tmp_path):
    b = _seg_batch(6)["pixel_values"]
    assert float(b.max()) == 65535.0 and bool(torch.isinf(b.half()).any())  # finite in fp32, +inf once cast
    torch.manual_seed(0)
    m = segformer()
    proj = "segformer.stages.0.patch_embeddings.proj"
    rep, log, prod = _train(m, _seg_batch, 9, tmp_path, lr=1e-3)
    assert _first_bad(log) == (6, 6) and prod.first == (proj, 6), (log, prod.first)
    assert all(e[0] and not e[1] for i, e in enumerate(log) if i != 6), log  # one bad batch, then healthy
    _at(rep, "overflow", proj, 6, "forward", CONV, "error")
    no_error_at(rep, {"segformer.stages.0.patch_embeddings.layer_norm", "segformer.stages.0.patch_embeddings",
                      "segformer.stages.0.blocks.0.attention.q_proj"})


_FEAT = torch.randn(20, 32, generator=torch.Generator().manual_seed(7))


def _m2m_batch(k, fix=False):
    """Precomputed encoder features (an external fp32 encoder's, 12 frames x 32) and target ids; at step 5 the
    features arrive unnormalised (x1e5); `fix`: every batch is layer-normalised first."""
    g = torch.Generator().manual_seed(k % 3)
    f = torch.randn(4, 12, 20, generator=g) @ _FEAT * 0.2
    if k == 5:
        f = f * 1e5
    if fix:
        f = F.layer_norm(f, f.shape[-1:])
    return {"encoder_outputs": (f,), "labels": torch.randint(3, 128, (4, 10), generator=g)}


def test_m2m100_unnormalised_encoder_outputs_overflow_the_first_cross_attention_projection(tmp_path):
    f = _m2m_batch(5)["encoder_outputs"][0]
    assert bool(torch.isfinite(f).all()) and float(f.abs().max()) > FP16_MAX
    torch.manual_seed(0)
    m = m2m100()
    kp = "model.decoder.layers.0.encoder_attn.k_proj"
    rep, log, prod = _train(m, _m2m_batch, 8, tmp_path, lr=1e-3)
    assert _first_bad(log) == (5, 5) and prod.first == (kp, 5), (log, prod.first)
    assert all(e[0] for i, e in enumerate(log) if i != 5), log
    _at(rep, "overflow", kp, 5, "forward", LINEAR, "error")
    no_error_at(rep, {"model.decoder.layers.0.encoder_attn", "model.decoder.layers.0",
                      "model.decoder.layers.0.encoder_attn.q_proj", "model.decoder.layers.0.self_attn"})


def test_swinv2_zero_padded_windows_make_the_cosine_attention_normalize_nan(tmp_path):
    """A 36x36 batch at step 5 (9x9 patches, window 4): Swin pads the map to 12x12 with zeros; the bias-free key
    projection maps those tokens to exact 0 keys; F.normalize's eps 1e-12 is 0 in fp16: 0/0. (CPU autocast keeps
    `norm` in fp16; CUDA autocast runs it in fp32, where the guard works.)"""
    assert torch.tensor(1e-12, dtype=F16).item() == 0.0
    torch.manual_seed(0)
    m = swinv2()
    assert m.get_submodule("swinv2.encoder.layers.0.blocks.0.attention.self.key").bias is None
    att = "swinv2.encoder.layers.0.blocks.0.attention.self"
    rep, log, prod = _train(m, lambda k: _images(k, size=36 if k == 5 else 32), 8, tmp_path, lr=1e-3)
    nf, _ = _first_bad(log)
    assert nf == 5 and prod.first == (att, 5), (log, prod.first)
    assert log[5][1] and all(e[0] for i, e in enumerate(log) if i != 5), log
    _at(rep, ("eps_underflow", "nan_origin"), att, 5, "forward", severity="error")
    no_error_at(rep, {att + ".query", att + ".key", "swinv2.embeddings"})


def _reg_batch(k, unit=1e5):
    """ELECTRA regression: a target learnable from the ids, around 0. From step 5 the targets come from a shard in
    another unit (x`unit`); unit=1: every target in the same unit (the fix)."""
    g = torch.Generator().manual_seed(k % 4)
    x = torch.randint(3, 128, (8, 16), generator=g)
    y = x[:, :4].float().mean(-1) / 64 - 1
    return {"input_ids": x, "labels": y * unit if k >= 5 else y}


@pytest.fixture(scope="module")
def electra_run(tmp_path_factory):
    """Case 9, run once for its two tests. The independent oracle: the loss gradient w.r.t. the logits by hand in
    fp32 (MSE mean, times the loss scale GradScaler applies: 65536 until the first skip), and the gradient that
    really reaches the fp16 logits (a tensor hook)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    grads, fp32_grads = {}, {}

    def on_out(k, out, b):
        lg = out.logits
        assert lg.dtype == F16
        if k == 5:
            d = 2 * (lg.detach().float().squeeze(-1) - b["labels"]) / lg.shape[0] * 65536.0
            fp32_grads[k] = (bool(torch.isfinite(d).all()), float(d.abs().max()))
        def note(g, k=k):
            grads.setdefault(k, (bool(torch.isfinite(g).all()), bool(torch.isinf(g).any())))
        lg.register_hook(note)
    try:
        torch.manual_seed(0)
        m = electra_regressor()
        return _train(m, _reg_batch, 24, tmp_path_factory.mktemp("electra"), lr=1e-3, backward=True,
                      on_out=on_out) + (grads, fp32_grads)
    finally:
        torch.set_num_threads(n)


def test_electra_wrong_unit_targets_really_overflow_the_loss_backward_before_any_module(electra_run):
    rep, log, prod, grads, fp32_grads = electra_run
    assert all(e[0] for e in log), log                        # forward and loss finite throughout
    # no module's backward made step 5's inf from a finite incoming gradient (out_proj's own weight gradient
    # overflows only much later, once the scale has fallen to 1: a later, separate producer)
    assert prod.first is None and (prod.first_bwd is None or prod.first_bwd[1] > 5), (prod.first, prod.first_bwd)
    assert all(grads[k][0] for k in range(5)) and grads[5] == (False, True), grads  # the logits' gradient: inf
    assert fp32_grads[5][0] and fp32_grads[5][1] > FP16_MAX, fp32_grads  # finite in fp32, past fp16's max
    skipped = [k for k, e in enumerate(log) if e[1]]
    assert skipped[0] == 5 and all(k in skipped for k in range(5, 15)), skipped   # >= 10 in a row: a collapse


def test_electra_wrong_unit_targets_are_named_at_the_root_loss_backward(electra_run):
    rep = electra_run[0]
    _at(rep, "overflow", "", 5, "backward", severity="error")
    # no error at step 5 at the modules that only received the inf (out_proj's own weight gradient overflowing
    # later, at a scale near 1, is a later producer of its own: the oracle's first_bwd)
    wrong = [f for f in rep.findings if f.severity == "error" and f.step == 5
             and f.module in ("classifier.out_proj", "classifier.dense", "classifier")]
    assert not wrong, [f"{f.rule}@{f.module}@{f.step}" for f in wrong]


# ==================================================================================================== healthy runs

def test_healthy_segformer_with_every_16bit_image_scaled_is_quiet(tmp_path):
    torch.manual_seed(0)
    rep, log, prod = _train(segformer(), lambda k: _seg_batch(k, fix=True), 12, tmp_path, lr=3e-3)
    assert prod.first is None and not any(e[1] for e in log[1:]), log
    _falls([e[2] for e in log])
    quiet_report(rep)


def test_healthy_electra_regression_with_targets_in_one_unit_is_quiet(tmp_path):
    torch.manual_seed(0)
    rep, log, prod = _train(electra_regressor(), lambda k: _reg_batch(k, unit=1.0), 24, tmp_path, lr=1e-3)
    assert prod.first is None and not any(e[1] for e in log[1:]), log
    _falls([e[2] for e in log])
    quiet_report(rep)
