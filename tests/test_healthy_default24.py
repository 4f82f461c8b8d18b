"""Healthy runs at ampdoctor's DEFAULT watch, twenty-fourth set: REAL Hugging Face `transformers` models (5.x),
built from tiny configs (no downloads: hidden 32-64, 2 layers, vocabulary 128, sequences 10-24, batches 4-16), trained
the way people fine-tune them. `ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")` and
nothing else; none of these runs may give a warning or an error (info is fine): checked on `w.report()` after
`w.close()` (every finding listed in the assertion message), which must also have exit code 0, no internal error
(a watch that switched itself off is quiet for nothing) and as many steps as the loop made scaler updates.

tests/test_healthy_hf.py already trains Llama, Mistral, Qwen2, GPT-NeoX, Phi, GPT-2, Gemma2, BERT, RoBERTa, T5, BART,
ViT and Whisper; this set takes the architectures the other HF tests use least (none or once): Qwen3, Gemma3, OPT,
BLOOM, Falcon, Starcoder2, ALBERT, Swin, mBART, and Llama with llama3 RoPE scaling, wav2vec2 CTC. (DeBERTa v1 was tried
for the classification run and refuses CPU fp16 autocast in this transformers: its attention masks the fp16 scores
with `finfo(query_layer.dtype).min` (float32's, it seems) and `masked_fill` raises "value cannot be converted to type
c10::Half without overflow"; ALBERT took its place. Pegasus and Marian were tried for the seq2seq run and did not
learn in 80 steps at this size, likely because their fixed sinusoidal positions (amplitude 1) drown the token
embeddings (std 0.02 x sqrt(64)); mBART took their place.)

The loop (`fit`), the same for every run: CPU fp16 autocast with a real `torch.amp.GradScaler("cpu")` at its
defaults; AdamW (betas 0.9/0.98) over two parameter groups, weight decay 0.01 on the matrices and none on biases and
norm weights; transformers' `get_cosine_schedule_with_warmup` (a tenth of the run warming up, down to 0 at the end);
`accum` micro-batches per optimizer step (loss / accum each); `scaler.unscale_` then `clip_grad_norm_(1.0)`, then
`scaler.step`, `scaler.update`, `scheduler.step`. Fixed seeds, one intra-op thread, dropout on (0.1) everywhere.

The oracle, independent of ampdoctor (`healthy`): every loss finite and the mean of the last tenth below 0.75x that
of the first tenth (0.6x for the CTC run); GradScaler's early backoffs only (at most 4, all in the first 10 steps;
in fact none of the 11 runs skipped a step); inf/NaN gradients after unscale_ only on steps it skipped;
probe_harness.Producer's forward hooks (no module made inf/NaN from finite inputs); every parameter finite at the
end; plus a check that each case's feature is really in force:

 1. LlamaForCausalLM with llama3 RoPE scaling (factor 4, original context 16 < the 24-token rows; the lowest inverse
    frequency is 1/4 of the plain one), attention dropout, gradient accumulation over 4 micro-batches of 4 ragged
    right-padded rows (attention mask, labels -100 on the padding), the loss written by hand with label smoothing
    0.1, 60 steps;
 2. Qwen3ForCausalLM (q/k RMSNorm) "pretrained" unwatched for 60 fp32 steps on strides {1, 3}, then frozen, with
    hand-written LoRA adapters (rank 8, alpha 16, lora dropout 0.05, B zero) on all 7 projections of both layers,
    fine-tuned on strides {2, 4} (the loss starts at 6.2, above ln V, and falls to 1.7), lr 5e-3, 60 steps (only
    the 28 adapter matrices trainable; the base weights bitwise unchanged after the run);
 3. Gemma3ForCausalLM (eager attention, attention softcap 50, final logit softcap 30, a sliding-window layer (8)
    then a global one, q/k norm, sqrt(hidden) embedding scale, tied input/output embeddings), accumulation 2, label
    smoothing, 60 steps (the logits stay within the softcap after training);
 4. OPTForCausalLM (learned positions with OPT's offset of 2 read from the attention mask, ReLU MLP, pre-LN, tied
    embeddings), its own `labels=` loss on ragged rows of 8, 60 steps;
 5. BloomForCausalLM (ALiBi: no position parameters at all; embedding LayerNorm; tied embeddings), its own loss,
    accumulation 2 on ragged rows, 60 steps;
 6. FalconForCausalLM (the new decoder architecture: grouped-query attention, parallel attention/MLP, rotary) with
    `model.gradient_checkpointing_enable()` (transformers' non-reentrant default; the attention runs twice per step,
    forward and recompute), hidden and attention dropout, accumulation 2, label smoothing, 60 steps;
 7. AlbertForSequenceClassification (one layer's weights shared by both layers, embeddings 32 projected to 64),
    [CLS] + ragged rows whose tokens lean to the class's own id range, `F.cross_entropy(..., label_smoothing=0.1)`,
    60 steps;
 8. SwinForImageClassification (4x4 patches of 32x32 images, window 4 with shifted windows in stage 1, patch merging,
    drop path 0.1), stripes in 4 orientations under noise (translation-invariant, as a pooled model needs), label
    smoothing, batches of 16, lr 2e-3, 80 steps;
 9. Wav2Vec2ForCTC (conv feature encoder with LayerNorm, convolutional positions, stable-layer-norm transformer,
    SpecAugment time masks, CTC mean reduction, blank 0) on ragged "speech" (5-9 tone segments of 20 samples, each
    frequency a character; attention mask; labels padded with -100), lr 5e-3, 120 steps (the loss leaves CTC's
    blank plateau: 2.95 -> 1.2);
10. MBartForConditionalGeneration (pre-LN with embedding/final LayerNorms, learned positions, tied embeddings),
    seq2seq continuation with ragged targets (2-10 tokens + eos, labels -100 after it, decoder inputs shifted by
    hand, decoder attention mask), label smoothing on the logits, lr 5e-3, 80 steps;
11. Starcoder2ForCausalLM (sliding window 8 < the 24-token rows, biases, LayerNorm, GELU MLP, embedding and
    residual dropout), accumulation 2, label smoothing, 60 steps (the window is in force: changing token 0 leaves
    the logits from position 16 on bitwise unchanged);
12. "watching must not change training": case 9's wav2vec2 with gradient checkpointing on as well (dropout,
    SpecAugment), on utterances of 80-sample characters whose first steps overflow the scaled backward at 2**16
    (GradScaler skips steps 0, 1 and 3: the steps where a watch records in full and writes a capture), 30 steps
    with and without the watch from the same torch and numpy seeds: every loss, every scale, every final weight and
    buffer bitwise identical.

What ampdoctor says: all 11 runs quiet, and in fact without any finding at all (not even info); no xfail, no false
alarm in this set. Run 12's watched run (not judged for quietness; it is the identity check) reports only info:
`overflow` at lm_head step 0 ("... GradScaler skipped them and lowered the scale, as designed") and `skipped_steps`
("GradScaler skipped 3 of 30 steps; a normal rate for dynamic loss scaling"); with and without the watch the runs are
bitwise identical. The whole file takes ~45 s on 2 CPU cores.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

import ampdoctor  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import Producer, finite  # noqa: E402
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step"),   # after a skipped step
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")]
F16 = torch.float16
V = 128  # vocabulary: 0 = pad, 1 = bos/cls, 2 = eos/sep, 3 = mask/unk; tokens 4..V-1
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


def dbg(*a):
    if DEBUG:
        print(*a, flush=True)


# ------------------------------------------------------------------------------------------------------ the loop
def param_groups(model, wd=0.01):
    """The usual fine-tuning groups: weight decay on the matrices (embeddings included), none on biases and norm
    weights (LayerNorm / RMSNorm / GroupNorm); only trainable parameters (a tied weight counted once)."""
    decay, plain = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (plain if p.ndim < 2 or "norm" in n.lower() or n.endswith("bias") else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]


class Run:
    """What one run of `fit` saw, independent of ampdoctor."""

    def __init__(self):
        self.losses, self.scales, self.skipped, self.bad_grads, self.lrs = [], [], [], [], []
        self.first = None          # Producer: the first (module, step) making inf/NaN from finite inputs
        self.w = self.rep = None
        self.updates = 0
        self.seconds = 0.0


def fit(model, micro, steps, tmp_path=None, *, lr=3e-3, warmup=None, accum=1, clip=1.0, watched=True, oracle=True,
        betas=(0.9, 0.98)):
    """The user's ordinary fp16 fine-tuning loop: AdamW over `param_groups`, transformers'
    get_cosine_schedule_with_warmup (`warmup` steps, default a tenth), `accum` micro-batches per optimizer step
    (`micro(step, j)` -> the micro-batch's loss, computed under fp16 autocast, divided by `accum` here), scaled
    backward, unscale_, clip_grad_norm_, scaler.step, update, scheduler.step. `watched`: under
    `ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")` (closed at the end; the report is
    built after close). `oracle`: probe_harness.Producer's forward hooks on every module."""
    r = Run()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(param_groups(model), lr=lr, betas=betas)
    sch = T.get_cosine_schedule_with_warmup(opt, max(1, steps // 10) if warmup is None else warmup, steps)
    sc = torch.amp.GradScaler("cpu")
    prod = Producer(model) if oracle else None
    if watched:
        r.w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
    t0 = time.perf_counter()
    model.train()
    try:
        for k in range(steps):
            if prod is not None:
                prod.new_step(k)
            opt.zero_grad(set_to_none=True)
            tot = 0.0
            for j in range(accum):
                with torch.autocast("cpu", dtype=F16):
                    loss = micro(k, j)
                sc.scale(loss / accum).backward()
                tot += loss.item() / accum
            sc.unscale_(opt)
            if not all(finite(p.grad) for p in params if p.grad is not None):
                r.bad_grads.append(k)
            nn.utils.clip_grad_norm_(params, clip)
            before = sc.get_scale()
            sc.step(opt)
            sc.update()
            r.updates += 1
            r.lrs.append(opt.param_groups[0]["lr"])
            sch.step()
            if sc.get_scale() < before:
                r.skipped.append(k)
            r.losses.append(tot)
            r.scales.append(sc.get_scale())
    finally:
        r.seconds = time.perf_counter() - t0
        if r.w is not None:
            r.w.close()
        if prod is not None:
            prod.remove()
            r.first = prod.first
    if r.w is not None:
        r.rep = r.w.report()
    r.model = model
    peak = max(r.lrs)                        # the schedule in force: a warmup up to lr, a cosine down to ~0
    assert r.lrs[0] < peak and math.isclose(peak, lr, rel_tol=0.05) and r.lrs[-1] < 0.01 * lr, r.lrs
    dbg(type(model).__name__, f"{r.seconds:.1f}s", "loss", [round(v, 3) for v in r.losses[::max(1, steps // 12)]],
        "last", round(r.losses[-1], 3), "skipped", r.skipped, "scale", r.scales[-1])
    if r.rep is not None:
        for f in r.rep.findings:
            dbg("  ", f.one_line())
    return r


def healthy(r, fall=0.75):
    """The run was healthy by the test's own measurements: every loss finite, the mean of the last tenth below `fall`
    x that of the first tenth; GradScaler's early backoffs only (at most 4, all in the first 10 steps), inf/NaN
    gradients only on the steps it skipped; no module made inf/NaN from finite inputs (Producer); every parameter
    finite at the end."""
    ls = r.losses
    assert ls and all(map(math.isfinite, ls)), ls
    k = max(3, len(ls) // 10)
    first, last = sum(ls[:k]) / k, sum(ls[-k:]) / k
    assert last < fall * first, (first, last, ls)
    assert len(r.skipped) <= 4 and all(s < 10 for s in r.skipped), (r.skipped, r.scales)
    assert set(r.bad_grads) <= set(r.skipped), (r.bad_grads, r.skipped)
    assert r.first is None, r.first
    assert all(torch.isfinite(p).all() for p in r.model.parameters())


def quiet(r):
    """ampdoctor's judgement of the run (w.report() after w.close()): no finding of severity warning or error (info
    is fine; every finding listed in the message), exit code 0, no internal error, every scaler update seen."""
    rep = r.rep
    summary = rep.to_dict()["summary"]
    assert not alarms(rep.findings), [f.one_line() for f in rep.findings]
    assert rep.exit_code == 0 and not summary.get("internal_error"), summary
    assert summary["steps"] == r.updates, (summary["steps"], r.updates)
    return rep


# ------------------------------------------------------------------------------------------------------ data
def seq_ids(i, B=8, L=24, strides=(1, 3)):
    """Strided token sequences over tokens 4..V-1 (x[t+1] = x[t] + d, wrapping), each row from a random start with
    its own stride d from `strides`: after the first two tokens the rest follows from the last two."""
    g = gen(i)
    s = torch.randint(0, V - 4, (B, 1), generator=g)
    d = torch.tensor(strides)[torch.randint(0, len(strides), (B, 1), generator=g)]
    return 4 + (s + d * torch.arange(L)) % (V - 4)


def ragged(i, B=8, L=24, lo=8, strides=(1, 3)):
    """Right-padded rows of lengths lo..L (pad 0; the first row full): (input_ids, attention_mask, labels with
    -100 on the padding)."""
    x = seq_ids(i, B, L, strides)
    n = torch.randint(lo, L + 1, (B,), generator=gen(10_000 + i))
    n[0] = L
    mask = (torch.arange(L) < n[:, None]).long()
    return x.masked_fill(mask == 0, 0), mask, x.masked_fill(mask == 0, -100)


def lm_loss(logits, labels, smoothing=0.1):
    """The causal LM loss the way a fine-tuning script writes it when it wants label smoothing: shifted by one, fp32
    logits, ignore_index -100."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, label_smoothing=smoothing)


def _decoder(**kw):
    return dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, **kw)


def causal_micro(m, B=4, smoothing=0.1, own_loss=False):
    """A causal-LM micro-batch: ragged rows, the model's own `labels=` loss (`own_loss`) or `lm_loss` with label
    smoothing."""
    def micro(k, j):
        x, mask, y = ragged(100 * k + j, B=B)
        if own_loss:
            return m(input_ids=x, attention_mask=mask, labels=y).loss
        return lm_loss(m(input_ids=x, attention_mask=mask).logits, y, smoothing)
    return micro


# ------------------------------------------------------------------ 1. Llama: llama3 RoPE scaling, accumulation 4
def test_llama_llama3_rope_scaling_accumulation_ragged(tmp_path):
    torch.manual_seed(1)
    m = T.LlamaForCausalLM(T.LlamaConfig(**_decoder(attention_dropout=0.1, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})))
    # the scaling is in force: the lowest frequency (wavelength > 16 positions) divided by the factor
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    inv = m.model.rotary_emb.inv_freq
    assert torch.allclose(inv[-1], plain[-1] / 4) and (inv <= plain).all() and not torch.allclose(inv, plain)
    r = fit(m, causal_micro(m), 60, tmp_path, accum=4)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 2. Qwen3: hand-written LoRA on a frozen base
class LoRA(nn.Module):
    """y = base(x) + (alpha / r) * B(A(dropout(x))); base frozen, A kaiming, B zero (the LoRA paper's init, PEFT's
    lora_dropout)."""

    def __init__(self, base: nn.Linear, r=8, alpha=16, dropout=0.05):
        super().__init__()
        self.base, self.scale, self.drop = base, alpha / r, nn.Dropout(dropout)
        self.A = nn.Linear(base.in_features, r, bias=False)
        self.B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.B.weight)

    def forward(self, x):
        return self.base(x) + self.scale * self.B(self.A(self.drop(x)))


def test_qwen3_lora_adapters_on_pretrained_frozen_base(tmp_path):
    torch.manual_seed(2)
    m = T.Qwen3ForCausalLM(T.Qwen3Config(**_decoder(attention_dropout=0.1)))
    # "pretrained": 60 fp32 steps (unwatched) on strides 1 and 3
    pre = torch.optim.AdamW(m.parameters(), lr=3e-3)
    m.train()
    for k in range(60):
        x, mask, y = ragged(5000 + k)
        pre.zero_grad()
        m(input_ids=x, attention_mask=mask, labels=y).loss.backward()
        pre.step()
    m.requires_grad_(False)
    for layer in m.model.layers:
        for mod, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                           (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                setattr(mod, n, LoRA(getattr(mod, n)))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2 and all(n.endswith((".A.weight", ".B.weight")) for n in trainable)
    base = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}

    def micro(k, j):                     # the new task: strides 2 and 4
        x, mask, y = ragged(k, strides=(2, 4))
        return m(input_ids=x, attention_mask=mask, labels=y).loss
    r = fit(m, micro, 60, tmp_path, lr=5e-3)
    healthy(r)
    assert all(torch.equal(p, base[n]) for n, p in m.named_parameters() if not p.requires_grad)
    quiet(r)


# ------------------------------------------------------------------ 3. Gemma3: logit softcapping, tied, sliding
def test_gemma3_softcapping_tied_sliding_window(tmp_path):
    torch.manual_seed(3)
    m = T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_decoder(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, attention_dropout=0.1, tie_word_embeddings=True, attn_implementation="eager")))
    assert m.lm_head.weight is m.model.embed_tokens.weight
    r = fit(m, causal_micro(m), 60, tmp_path, accum=2)
    healthy(r)
    with torch.no_grad(), torch.autocast("cpu", dtype=F16):
        assert m(input_ids=seq_ids(999)).logits.abs().max() <= 30.0      # the final softcap is in force
    quiet(r)


# ------------------------------------------------------------------ 4. OPT: tied, learned positions, dropout
def test_opt_tied_embeddings_dropout(tmp_path):
    torch.manual_seed(4)
    m = T.OPTForCausalLM(T.OPTConfig(
        vocab_size=V, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
        do_layer_norm_before=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True))
    assert m.lm_head.weight is m.model.decoder.embed_tokens.weight
    r = fit(m, causal_micro(m, B=8, own_loss=True), 60, tmp_path)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 5. BLOOM: ALiBi, ragged padding
def test_bloom_alibi_ragged_padding(tmp_path):
    torch.manual_seed(5)
    m = T.BloomForCausalLM(T.BloomConfig(
        vocab_size=V, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.1, attention_dropout=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    assert not any("position" in n for n, _ in m.named_parameters())     # positions only through ALiBi
    r = fit(m, causal_micro(m, own_loss=True), 60, tmp_path, accum=2)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 6. Falcon: gradient checkpointing + dropout
def falcon(seed=6):
    """FalconForCausalLM (the new decoder architecture: grouped-query attention, parallel attention/MLP, two
    LayerNorms, rotary), dropout 0.1, `gradient_checkpointing_enable()` (transformers' default: non-reentrant)."""
    torch.manual_seed(seed)
    m = T.FalconForCausalLM(T.FalconConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False, ffn_hidden_size=128,
        hidden_dropout=0.1, attention_dropout=0.1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))
    m.gradient_checkpointing_enable()
    m.config.use_cache = False
    assert m.is_gradient_checkpointing
    return m


def test_falcon_gradient_checkpointing_dropout(tmp_path):
    m = falcon()
    calls = []              # checkpointing is in force: a layer's attention runs twice per step (forward, recompute)
    h = m.transformer.h[0].self_attention.register_forward_hook(lambda *a: calls.append(1))
    m.train()
    x, mask, y = ragged(0, B=2)
    m(input_ids=x, attention_mask=mask, labels=y).loss.backward()
    h.remove()
    m.zero_grad(set_to_none=True)
    assert len(calls) == 2
    r = fit(m, causal_micro(m), 60, tmp_path, accum=2)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 7. ALBERT: one shared layer, label smoothing
def topic_batch(i, B=8, L=24, n_cls=3):
    """Sequence classification: [CLS] (1) then L tokens, each from the class's own range of 16 ids with probability
    0.5 (else any id), right-padded to ragged lengths 8..L: (input_ids, attention_mask, y)."""
    g = gen(i)
    y = torch.randint(0, n_cls, (B,), generator=g)
    own = 4 + 16 * y[:, None] + torch.randint(0, 16, (B, L), generator=g)
    x = torch.where(torch.rand(B, L, generator=g) < 0.5, own, torch.randint(4, V, (B, L), generator=g))
    n = torch.randint(8, L + 1, (B,), generator=g)
    mask = (torch.arange(L) < n[:, None]).long()
    x = torch.cat([torch.ones(B, 1, dtype=torch.long), x.masked_fill(mask == 0, 0)], 1)
    return x, torch.cat([torch.ones(B, 1, dtype=torch.long), mask], 1), y


def test_albert_shared_layer_seqcls_label_smoothing(tmp_path):
    torch.manual_seed(7)
    m = T.AlbertForSequenceClassification(T.AlbertConfig(
        vocab_size=V, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_hidden_groups=1,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, classifier_dropout_prob=0.1, pad_token_id=0, num_labels=3))
    assert len(m.albert.encoder.albert_layer_groups) == 1          # one layer's weights, run twice

    def micro(k, j):
        x, mask, y = topic_batch(k)
        return F.cross_entropy(m(input_ids=x, attention_mask=mask).logits.float(), y, label_smoothing=0.1)
    r = fit(m, micro, 60, tmp_path)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 8. Swin: shifted windows, drop path
def stripes(i, B=16, n=32):
    """32x32 RGB images of stripes of period 4 in one of 4 orientations (horizontal, vertical, the two diagonals),
    random phase and colour, under N(0, 1) noise: the label is the orientation (translation-invariant, which a
    window-attention model with average pooling can see; a location would not be)."""
    g = gen(i)
    y = torch.randint(0, 4, (B,), generator=g)
    r, c = torch.meshgrid(torch.arange(n).float(), torch.arange(n).float(), indexing="ij")
    dirs = torch.stack([r, c, r + c, r - c])
    wave = torch.sin(2 * math.pi * dirs[y] / 4 + torch.rand(B, 1, 1, generator=g) * 2 * math.pi)
    colour = 1.0 + 2.0 * torch.rand(B, 3, 1, 1, generator=g)
    return colour * wave[:, None] + torch.randn(B, 3, n, n, generator=g), y


def test_swin_shifted_windows_drop_path(tmp_path):
    torch.manual_seed(8)
    m = T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, num_channels=3, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4,
        mlp_ratio=2.0, drop_path_rate=0.1, hidden_dropout_prob=0.1, num_labels=4))

    def micro(k, j):
        x, y = stripes(k)
        return F.cross_entropy(m(pixel_values=x).logits.float(), y, label_smoothing=0.1)
    r = fit(m, micro, 80, tmp_path, lr=2e-3)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 9. wav2vec2 CTC on ragged audio
FREQS = torch.linspace(0.04, 0.4, 10)  # cycles per sample of characters 1..10 (0 is CTC's blank)


def tones(i, B=8, seg=20, lo=5, hi=9):
    """"Speech": lo..hi segments of `seg` samples, each a tone whose frequency spells one of 10 characters (never
    the same twice in a row), random phase, noise; right-padded (zeros) with an attention mask; labels padded with
    -100: (input_values, attention_mask, labels)."""
    g = gen(i)
    n = torch.randint(lo, hi + 1, (B,), generator=g)
    n[0] = hi
    x = torch.zeros(B, hi * seg)
    labels = torch.full((B, hi), -100)
    t = torch.arange(seg)
    for b in range(B):
        prev = -1
        for s in range(int(n[b])):
            c = int(torch.randint(1, 11, (1,), generator=g))
            c = c if c != prev else c % 10 + 1
            prev = labels[b, s] = c
            phase = float(torch.rand(1, generator=g)) * 2 * math.pi
            x[b, s * seg:(s + 1) * seg] = torch.sin(2 * math.pi * FREQS[c - 1] * t + phase)
    mask = (torch.arange(hi * seg) < n[:, None] * seg).long()
    return (x + 0.1 * torch.randn(x.shape, generator=g)) * mask, mask, labels


def wav2vec2():
    """Wav2Vec2ForCTC: a 2-layer conv feature encoder (kernel 10/3, stride 5/2, LayerNorm), the convolutional
    positional embedding, stable-layer-norm transformer, every dropout 0.1, SpecAugment time masks (p 0.05), CTC
    with mean reduction, blank = pad = 0; 10 characters."""
    return T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=11, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(32, 32), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, feat_extract_norm="layer", do_stable_layer_norm=True,
        hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, feat_proj_dropout=0.1, final_dropout=0.1,
        mask_time_prob=0.05, mask_time_length=2, ctc_loss_reduction="mean", pad_token_id=0))


def test_wav2vec2_ctc_ragged_audio(tmp_path):
    np = pytest.importorskip("numpy")
    torch.manual_seed(9)
    np.random.seed(9)                                 # (SpecAugment's time masks are drawn by numpy)
    m = wav2vec2()

    def micro(k, j):
        x, mask, y = tones(k)
        return m(input_values=x, attention_mask=mask, labels=y).loss
    r = fit(m, micro, 120, tmp_path, lr=5e-3)
    healthy(r, fall=0.6)
    quiet(r)


# ------------------------------------------------------------------ 10. mBART: seq2seq, label smoothing
def s2s(i, B=8, src=10, tgt=10):
    """Seq2seq continuation: the source is the first `src` tokens of a strided sequence, the target its next 2..`tgt`
    tokens then eos (2); labels -100 after the eos: (input_ids, labels)."""
    x = seq_ids(i, B, src + tgt)
    n = torch.randint(2, tgt + 1, (B,), generator=gen(20_000 + i))
    n[0] = tgt
    lab = torch.full((B, tgt + 1), -100)
    for b in range(B):
        lab[b, :n[b]] = x[b, src:src + n[b]]
        lab[b, n[b]] = 2
    return x[:, :src].contiguous(), lab


def test_mbart_seq2seq_label_smoothing_ragged_targets(tmp_path):
    torch.manual_seed(10)
    m = T.MBartForConditionalGeneration(T.MBartConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        dropout=0.1, attention_dropout=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0,
        forced_eos_token_id=None))
    assert m.lm_head.weight is m.model.shared.weight

    def micro(k, j):
        src, lab = s2s(k)
        dec = torch.cat([torch.zeros(len(lab), 1, dtype=torch.long), lab[:, :-1].clamp(min=0)], 1)
        logits = m(input_ids=src, decoder_input_ids=dec, decoder_attention_mask=(lab != -100).long()).logits
        return F.cross_entropy(logits.float().reshape(-1, V), lab.reshape(-1), ignore_index=-100, label_smoothing=0.1)
    r = fit(m, micro, 80, tmp_path, lr=5e-3)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 11. Starcoder2: sliding window, biases
def test_starcoder2_sliding_window_biases(tmp_path):
    torch.manual_seed(11)
    m = T.Starcoder2ForCausalLM(T.Starcoder2Config(**_decoder(
        sliding_window=8, use_bias=True, residual_dropout=0.1, embedding_dropout=0.1, attention_dropout=0.1)))
    m.eval()
    with torch.no_grad():           # the window is in force: 2 layers of window 8 reach 14 tokens back, not 20
        x = seq_ids(999, B=1)
        z = x.clone()
        z[0, 0] = 5 if x[0, 0] != 5 else 6
        a, b = m(input_ids=x).logits[0], m(input_ids=z).logits[0]
        assert torch.equal(a[16:], b[16:]) and not torch.allclose(a[:4], b[:4])
    r = fit(m, causal_micro(m), 60, tmp_path, accum=2)
    healthy(r)
    quiet(r)


# ------------------------------------------------------------------ 12. watching does not change training
def bits(t):
    return t.detach().contiguous().view(torch.uint8)


def test_watch_leaves_training_bitwise_identical_wav2vec2_checkpointing_dropout(tmp_path):
    """Case 9's wav2vec2 CTC model with gradient checkpointing on (dropout, SpecAugment and the random time masks
    on), on utterances 4x longer (80 samples a character), whose first steps overflow the scaled backward at 2**16:
    GradScaler's early backoffs, the steps where a watch records in full and writes a capture. 30 steps with and
    without the watch, from the same seeds (torch and numpy): every loss, every scale and every final weight and
    buffer bitwise identical."""
    np = pytest.importorskip("numpy")
    runs = []
    for watched in (True, False):
        torch.manual_seed(12)
        np.random.seed(12)
        m = wav2vec2()
        m.gradient_checkpointing_enable()
        assert m.is_gradient_checkpointing

        def micro(k, j, m=m):
            x, mask, y = tones(k, seg=80)
            return m(input_values=x, attention_mask=mask, labels=y).loss
        runs.append(fit(m, micro, 30, tmp_path, lr=5e-3, watched=watched, oracle=False))
    rw, ru = runs
    assert rw.rep is not None and ru.rep is None
    assert ru.skipped and all(math.isfinite(v) for v in ru.losses), (ru.skipped, ru.losses)  # the backoffs happened
    assert rw.losses == ru.losses, [(k, a, b) for k, (a, b) in enumerate(zip(rw.losses, ru.losses)) if a != b][:3]
    assert rw.scales == ru.scales, (rw.scales, ru.scales)
    sw, su = rw.model.state_dict(), ru.model.state_dict()
    assert sw.keys() == su.keys()
    diff = [k for k in sw if not torch.equal(bits(sw[k]), bits(su[k]))]
    assert not diff, diff
