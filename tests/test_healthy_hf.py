"""Healthy fine-tuning of real Hugging Face architectures at ampdoctor's defaults.

Tiny, randomly initialised `transformers` models built from their configs (no downloads: hidden 32-64, 2 layers,
vocabulary 128), trained on the CPU for 40-100 optimizer steps on small learnable tasks (arithmetic token sequences,
per-row token windows, colour-channel images, band-coded "speech"), with fp16 autocast + `GradScaler("cpu")` at its
defaults or with bf16 autocast (no scaler). Each run is watched the way a user would: `ampdoctor.watch(model,
optimizer=opt, scaler=scaler)` around the user's own loop (`every=1` as well where noted), or
`ampdoctor.integrations.AmpDoctorCallback()` at its defaults inside a real `transformers.Trainer`. For fp16 in the
Trainer on a CPU (accelerate refuses `fp16=True` without a GPU) the Trainer's Accelerator is given the three
attributes `Accelerator.__init__` sets for CUDA fp16 (a default `GradScaler`, `native_amp`, mixed precision "fp16"),
as tests/test_integrations_hf.py and tests/test_hf_failures4.py do; everything after that is accelerate's own code.

The oracle (the test's own measurements, before ampdoctor is judged): every loss finite; the mean loss of the last
tenth of the run below 0.75x that of the first tenth (0.85x for BERT's MLM, which sits on the usual ln(V) plateau
longer); the scaler (its scale after each update, read by the loop or by a TrainerCallback) skipped no step beyond its
normal first search (at most 4 skips, all in the first 4 steps; in fact none of these runs skipped at all). A few
structural checks make sure the feature under test is really in force (tied embeddings share one Parameter,
Mistral's window hides token 0 from position 12, Gemma2's final logits stay within the softcap of 30, only the LoRA
adapters and the head are trainable, the Trainer's LabelSmoother is on, the fp16 Trainer stepped a GradScaler).
Then ampdoctor is judged: no finding of severity warning or error, exit code 0, no internal error (info is fine).

Cases (AdamW wd 0.01, lr 3e-3 unless said, clip 1.0 after `unscale_`):
 1. [default, every=1] LlamaForCausalLM (RoPE, RMSNorm, SwiGLU, grouped-query attention), fp16, a plain loop,
    60 steps;
 2. MistralForCausalLM with `sliding_window=4` on 16-token sequences, fp16, gradient accumulation over 4
    micro-batches (loss / 4 per micro-batch, one unscale_/clip/step/update per optimizer step), 50 steps;
 3. Qwen2ForCausalLM (qkv bias), bf16 autocast (no scaler), `get_linear_schedule_with_warmup` (10 warmup steps,
    linear decay to 0 at step 60);
 4. GPTNeoXForCausalLM (rotary_pct 0.25, parallel residual), fp16, ragged right-padded batches (lengths 6-16) with
    an attention mask and labels -100 on the padding, 60 steps;
 5. PhiForCausalLM (partial rotary, LayerNorm, parallel attention/MLP) through the Trainer, fp16, `lr_scheduler_type=
    "linear"` with 6 warmup steps, 60 steps, AmpDoctorCallback();
 6. GPT2LMHeadModel with tied input/output embeddings through the Trainer, `bf16=True` (CPU autocast, no scaler),
    `gradient_accumulation_steps=2`, cosine schedule with warmup, 50 steps;
 7. [default, every=1] Gemma2ForCausalLM (eager attention, attention softcap 50, final logit softcap 30, sandwich
    norms, sliding window 8, embeddings scaled by sqrt(hidden)), fp16, 60 steps;
 8. BertForMaskedLM (post-LN), fp16, ragged padded batches of 32 with 15% of the real tokens masked (labels only
    there), 100 steps;
 9. RobertaForSequenceClassification, frozen base with hand-written LoRA adapters (rank 4, alpha 8, A kaiming, B
    zero; on every layer's query and value) plus the trainable head, `F.cross_entropy(..., label_smoothing=0.1)`,
    ragged padded batches (pad id 1), fp16, lr 5e-3, 60 steps (the usual plateau while B grows from zero, then
    down to the smoothing floor);
10. T5ForConditionalGeneration (gated-gelu, relative position buckets, T5's RMS LayerNorm), seq2seq continuation
    (8 tokens in, the next 8 out), fp16, gradient accumulation over 2, 40 steps;
11. BartForConditionalGeneration (post-LN, learned positions, tied embeddings) through the Trainer, fp16,
    `label_smoothing_factor=0.1` (the Trainer's LabelSmoother computes the loss on the logits; the items carry
    their shifted decoder_input_ids as DataCollatorForSeq2Seq makes them), 60 steps;
12. [default, every=1] ViTForImageClassification (16x16 images, 4x4 patches), fp16, 40 steps;
13. WhisperForConditionalGeneration (conv1/conv2 front end on 16 mel bins x 32 frames, encoder-decoder), fp16,
    40 steps.

Results: 16 runs (13 designs; every=1 also for 1, 7 and 12), all quiet: no xfails. ampdoctor got nothing wrong here.
(An observation from building case 9, not a test: with adapters on all six Linear layers of each RoBERTa layer the
same run backs the scale off 65536 -> 8192 at steps 40-43, a real overflow of the scaled backward; ampdoctor called
it info (`overflow` at `roberta.encoder.layer.1.attention.self.value.A`, "skipped them and lowered the scale, as
designed", and `skipped_steps` info: 3 of 60). That run is left out since it fails this file's own no-skips oracle.)
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

import ampdoctor  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

F16, BF16 = torch.float16, torch.bfloat16
V = 128  # vocabulary; 0 = pad, 1 = bos/cls, 2 = eos/sep, 3 = mask
EVERY = pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])


# --- the oracle ---------------------------------------------------------------------------------------------------

def assert_trained(losses, scales, fall=0.75, search=4):
    """The run was healthy by the test's own measurements: every loss finite; the mean of the last tenth below
    `fall` x the mean of the first tenth; the scaler (fp16) skipped no step after its first `search` steps (the
    normal first search for a scale) and at most `search` in all (a skip = the scale went down at an update)."""
    assert losses and all(map(math.isfinite, losses)), losses
    k = max(3, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < fall * first, (first, last, losses[:k], losses[-k:])
    skips = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]
    assert len(skips) <= search and all(i < search for i in skips), (skips, scales)


def quiet(rep):
    """ampdoctor's judgement: no warning, no error (info is fine), exit code 0, no internal error."""
    summary = rep.to_dict()["summary"]
    assert not alarms(rep.findings) and rep.exit_code == 0 and not summary.get("internal_error"), \
        [f.one_line() for f in rep.findings] + [summary.get("internal_error")]
    return rep


# --- data: small learnable tasks ----------------------------------------------------------------------------------

def lm_ids(i, B=8, L=16, stride=3):
    """Arithmetic token sequences (x[t+1] = x[t] + stride over tokens 4..V-1) from a random start: a bigram a
    2-layer model learns in a few dozen steps."""
    s = torch.randint(0, V - 4, (B, 1), generator=gen(i))
    return 4 + (s + stride * torch.arange(L)) % (V - 4)


def ragged(i, B=8, L=16, lo=6):
    """Right-padded rows of lengths lo..L (pad 0): (input_ids, attention_mask)."""
    x = lm_ids(i, B, L)
    n = torch.randint(lo, L + 1, (B,), generator=gen(10_000 + i))
    n[0] = L
    mask = (torch.arange(L) < n[:, None]).long()
    return x * mask, mask


def cls_batch(i, B=16, L=12):
    """Sequence classification: `<s>` then L tokens, all from ids 4..19 (label 0) or all from ids 20..35 (label 1),
    right-padded to ragged lengths (pad 1, RoBERTa's): (input_ids, attention_mask, y)."""
    y = torch.randint(0, 2, (B,), generator=gen(20_000 + i))
    x = 4 + 16 * y[:, None] + torch.randint(0, 16, (B, L), generator=gen(i))
    n = torch.randint(4, L + 1, (B,), generator=gen(10_000 + i))
    mask = (torch.arange(L) < n[:, None]).long()
    x = torch.cat([torch.zeros(B, 1, dtype=torch.long), x.masked_fill(mask == 0, 1)], 1)
    return x, torch.cat([torch.ones(B, 1, dtype=torch.long), mask], 1), y


def _decoder(**kw):
    return dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, **kw)


# --- the loop -----------------------------------------------------------------------------------------------------

def fit(model, micro, steps, *, dtype=F16, every=None, lr=3e-3, accum=1, sched=None, clip=1.0, params=None):
    """The user's ordinary loop under `ampdoctor.watch(model, optimizer=opt, scaler=sc[, every=])`: AdamW, autocast
    (fp16 with GradScaler("cpu") at its defaults; bf16 without a scaler), `accum` micro-batches per optimizer step
    (`micro(step, j)` -> the micro-batch's loss under autocast, divided by `accum` here), unscale_ + clip, step,
    update, scheduler. Returns (report, per-step losses, per-step scales)."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sch = sched(opt) if sched else None
    sc = torch.amp.GradScaler("cpu") if dtype == F16 else None
    losses, scales = [], []
    model.train()
    with ampdoctor.watch(model, optimizer=opt, scaler=sc, **({} if every is None else {"every": every})) as w:
        for k in range(steps):
            opt.zero_grad(set_to_none=True)
            tot = 0.0
            for j in range(accum):
                with torch.autocast("cpu", dtype=dtype):
                    loss = micro(k, j) / accum
                (sc.scale(loss) if sc else loss).backward()
                tot += loss.item()
            if sc:
                sc.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            if sc:
                sc.step(opt)
                sc.update()
            else:
                opt.step()
            if sch:
                sch.step()
            losses.append(tot)
            scales.append(sc.get_scale() if sc else 1.0)
    return w.report(), losses, scales


def warmup_linear(warm, total):
    return lambda opt: T.get_linear_schedule_with_warmup(opt, warm, total)


# --- 1. Llama (RoPE, RMSNorm, SwiGLU, GQA): plain loop ------------------------------------------------------------

@EVERY
def test_llama_plain_loop(every):
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(**_decoder()))
    rep, losses, scales = fit(m, lambda k, j: m(input_ids=(x := lm_ids(k)), labels=x).loss, 60, every=every)
    assert_trained(losses, scales)
    quiet(rep)


# --- 2. Mistral (sliding window 4 < sequence 16): gradient accumulation ---------------------------------------------

def test_mistral_sliding_window_grad_accumulation():
    torch.manual_seed(0)
    m = T.MistralForCausalLM(T.MistralConfig(**_decoder(sliding_window=4)))
    m.eval()
    with torch.no_grad():  # the window is in force: 2 layers of window 4 see 6 tokens back, not 12
        x = lm_ids(999, B=1)
        y = x.clone()
        y[0, 0] = 5 if x[0, 0] != 5 else 6
        a, b = m(input_ids=x).logits[0], m(input_ids=y).logits[0]
        assert torch.equal(a[12:], b[12:]) and not torch.allclose(a[:4], b[:4])

    def micro(k, j):
        x = lm_ids(100 * k + j, B=4)
        return m(input_ids=x, labels=x).loss
    rep, losses, scales = fit(m, micro, 50, accum=4)
    assert_trained(losses, scales)
    quiet(rep)


# --- 3. Qwen2 (qkv bias): bf16 autocast, warmup + linear decay -------------------------------------------------------

def test_qwen2_bf16_warmup_linear_decay():
    torch.manual_seed(0)
    m = T.Qwen2ForCausalLM(T.Qwen2Config(**_decoder()))
    rep, losses, scales = fit(m, lambda k, j: m(input_ids=(x := lm_ids(k)), labels=x).loss, 60, dtype=BF16,
                              sched=warmup_linear(10, 60))
    assert_trained(losses, scales)
    quiet(rep)


# --- 4. GPT-NeoX (partial rotary, parallel residual): ragged right-padded batches ------------------------------------

def test_gpt_neox_ragged_padding():
    torch.manual_seed(0)
    m = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))

    def micro(k, j):
        x, mask = ragged(k)
        return m(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss
    rep, losses, scales = fit(m, micro, 60)
    assert_trained(losses, scales)
    quiet(rep)


# --- 5./6. the transformers Trainer + AmpDoctorCallback -------------------------------------------------------------

class _Record(T.TrainerCallback):
    """The test's own record of a Trainer run: the scaler's scale after each optimizer step and every logged loss."""

    def __init__(self, acc=None):
        self.acc, self.scales, self.losses = acc, [], []

    def on_step_end(self, args, state, control, **kw):
        sc = getattr(self.acc, "scaler", None)
        self.scales.append(sc.get_scale() if sc is not None else 1.0)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


class _Items(torch.utils.data.Dataset):
    def __init__(self, item, n):
        self.item, self.n = item, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.item(i)


@pytest.fixture()
def fp16_on_cpu(monkeypatch):
    """Give a Trainer's Accelerator what Accelerator.__init__ gives it for CUDA fp16, on CPU (a default
    GradScaler, as accelerate builds it); everything after is accelerate's own code (as in
    tests/test_integrations_hf.py)."""
    pytest.importorskip("accelerate")

    def force(acc):
        monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu"))
        monkeypatch.setattr(acc, "native_amp", True)
        monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")
        return acc
    return force


def trainer(tmp_path, model, data, steps, **kw):
    """A Trainer with AmpDoctorCallback() at its defaults (run_dir: output_dir/ampdoctor)."""
    pytest.importorskip("accelerate")
    from ampdoctor.integrations import AmpDoctorCallback

    cb = AmpDoctorCallback()
    args = T.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=steps, max_grad_norm=1.0,
                               logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                               **{"per_device_train_batch_size": 8, "learning_rate": 3e-3, **kw})
    return T.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]), cb


def _lm_item(i):
    x = lm_ids(i, B=1)[0]
    return {"input_ids": x, "labels": x}


def test_phi_trainer_fp16_warmup_linear(tmp_path, fp16_on_cpu):
    """PhiForCausalLM (partial rotary, LayerNorm, parallel attention/MLP, GELU) through the Trainer with fp16 and
    a warmup + linear decay schedule."""
    torch.manual_seed(0)
    m = T.PhiForCausalLM(T.PhiConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        partial_rotary_factor=0.5, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    tr, cb = trainer(tmp_path, m, _Items(_lm_item, 8 * 60), 60, lr_scheduler_type="linear", warmup_steps=6)
    rec = _Record(fp16_on_cpu(tr.accelerator))
    tr.add_callback(rec)
    tr.train()
    assert len(rec.scales) == 60 and rec.scales[0] == 65536.0  # the fp16 path: a scaler stepped every step
    assert_trained(rec.losses, rec.scales)
    quiet(cb.report)


def test_gpt2_tied_trainer_bf16_accumulation(tmp_path):
    """GPT2LMHeadModel with tied input/output embeddings (one Parameter) through the Trainer with bf16=True (CPU
    autocast, no scaler), gradient_accumulation_steps=2, cosine schedule with warmup."""
    torch.manual_seed(0)
    m = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=64,
                                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=True))
    assert m.lm_head.weight is m.transformer.wte.weight
    tr, cb = trainer(tmp_path, m, _Items(_lm_item, 4 * 2 * 50), 50, bf16=True, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=5)
    rec = _Record()
    tr.add_callback(rec)
    tr.train()
    assert len(rec.scales) == 50
    assert_trained(rec.losses, rec.scales)
    quiet(cb.report)


# --- 7. Gemma2 (logit softcapping, sandwich norms, sliding window, sqrt(hidden) embedding scale) ---------------------

@EVERY
def test_gemma2_softcapping_fp16(every):
    torch.manual_seed(0)
    m = T.Gemma2ForCausalLM(T.Gemma2Config(**_decoder(
        sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attn_implementation="eager")))
    rep, losses, scales = fit(m, lambda k, j: m(input_ids=(x := lm_ids(k)), labels=x).loss, 60, every=every)
    assert_trained(losses, scales)
    with torch.no_grad(), torch.autocast("cpu", dtype=F16):
        assert m(input_ids=lm_ids(999)).logits.abs().max() <= 30.0  # the final softcap is in force
    quiet(rep)


# --- 8. BERT masked LM: 15% masking, ragged padding ----------------------------------------------------------------

def topic(i, B, L=16):
    """Each row draws its tokens from its own window of 4 consecutive ids: a masked token is predictable from the
    row's other tokens (attention over the row), not from its position."""
    s = torch.randint(4, V - 4, (B, 1), generator=gen(i))
    return s + torch.randint(0, 4, (B, L), generator=gen(40_000 + i))


def test_bert_masked_lm_ragged():
    torch.manual_seed(0)
    m = T.BertForMaskedLM(T.BertConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, pad_token_id=0))

    def micro(k, j):
        _, mask = ragged(k, B=32)
        x = topic(k, B=32) * mask
        pick = (torch.rand(x.shape, generator=gen(30_000 + k)) < 0.15) & (mask == 1)
        pick[:, 1] = True
        return m(input_ids=x.masked_fill(pick, 3), attention_mask=mask, labels=x.masked_fill(~pick, -100)).loss
    rep, losses, scales = fit(m, micro, 100)
    assert_trained(losses, scales, fall=0.85)  # BERT's MLM plateau: ln(128) ~ 4.85 -> ~3.7 in 100 steps
    quiet(rep)


# --- 9. RoBERTa sequence classification: frozen base + hand-written LoRA, label smoothing --------------------------

class LoRA(nn.Module):
    """y = base(x) + (alpha / r) * B(A(x)); base frozen, A kaiming, B zero (the LoRA paper's init)."""

    def __init__(self, base: nn.Linear, r=4, alpha=8):
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.A = nn.Linear(base.in_features, r, bias=False)
        self.B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.B.weight)

    def forward(self, x):
        return self.base(x) + self.scale * self.B(self.A(x))


def test_roberta_seqcls_lora_label_smoothing():
    torch.manual_seed(0)
    m = T.RobertaForSequenceClassification(T.RobertaConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=2))
    m.requires_grad_(False)
    for layer in m.roberta.encoder.layer:
        layer.attention.self.query = LoRA(layer.attention.self.query)
        layer.attention.self.value = LoRA(layer.attention.self.value)
    m.classifier.requires_grad_(True)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(".A." in n or ".B." in n or n.startswith("classifier") for n in trainable)

    def micro(k, j):
        x, mask, y = cls_batch(k)
        return F.cross_entropy(m(input_ids=x, attention_mask=mask).logits.float(), y, label_smoothing=0.1)
    rep, losses, scales = fit(m, micro, 60, lr=5e-3)
    assert_trained(losses, scales)
    quiet(rep)


# --- 10./11. encoder-decoders: T5 (relative position buckets, no biases, RMS LayerNorm), BART through the Trainer -----

def s2s(i, B=8):
    """Seq2seq continuation: the source is the first 8 tokens of an arithmetic sequence, the target its next 8."""
    x = lm_ids(i, B=B)
    return x[:, :8].contiguous(), x[:, 8:].contiguous()


def test_t5_seq2seq_grad_accumulation():
    torch.manual_seed(0)
    m = T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, feed_forward_proj="gated-gelu"))

    def micro(k, j):
        src, tgt = s2s(100 * k + j)
        return m(input_ids=src, labels=tgt).loss
    rep, losses, scales = fit(m, micro, 40, accum=2)
    assert_trained(losses, scales)
    quiet(rep)


def _s2s_item(i):
    src, tgt = s2s(i, B=1)
    dec = torch.cat([torch.tensor([2]), tgt[0, :-1]])  # BART: decoder_start_token_id = eos
    return {"input_ids": src[0], "labels": tgt[0], "decoder_input_ids": dec}


def test_bart_trainer_fp16_label_smoothing(tmp_path, fp16_on_cpu):
    """BartForConditionalGeneration (post-LN, learned positions, tied embeddings) through the Trainer with fp16 and
    `label_smoothing_factor=0.1` (the Trainer's LabelSmoother takes the labels and computes the loss on the logits;
    the items carry their shifted `decoder_input_ids`, as DataCollatorForSeq2Seq makes them)."""
    torch.manual_seed(0)
    m = T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))
    tr, cb = trainer(tmp_path, m, _Items(_s2s_item, 8 * 60), 60, label_smoothing_factor=0.1,
                     lr_scheduler_type="constant")
    assert tr.label_smoother is not None
    rec = _Record(fp16_on_cpu(tr.accelerator))
    tr.add_callback(rec)
    tr.train()
    assert len(rec.scales) == 60 and rec.scales[0] == 65536.0
    assert_trained(rec.losses, rec.scales)
    quiet(cb.report)


# --- 12. ViT image classification -----------------------------------------------------------------------------------

def images(i, B=16):
    """16x16 RGB images, N(0, 1) noise with one colour channel raised by 0.5: the label is the channel."""
    y = torch.randint(0, 3, (B,), generator=gen(50_000 + i))
    x = torch.randn(B, 3, 16, 16, generator=gen(i))
    x[torch.arange(B), y] += 0.5
    return x, y


@EVERY
def test_vit_image_classification(every):
    torch.manual_seed(0)
    m = T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3))

    def micro(k, j):
        x, y = images(k)
        return m(pixel_values=x, labels=y).loss
    rep, losses, scales = fit(m, micro, 40, every=every)
    assert_trained(losses, scales)
    quiet(rep)


# --- 13. Whisper (conv front end, encoder-decoder) --------------------------------------------------------------------

def speech(i, B=8):
    """Normalised log-mel-like features (16 bins x 32 frames, N(0, 1)) with one bright band b of 4 bins; the
    transcript is 8 tokens counting up by 3 from 4 + 8b."""
    b = torch.randint(0, 4, (B,), generator=gen(60_000 + i))
    feats = torch.randn(B, 16, 32, generator=gen(i))
    for j in range(B):
        feats[j, 4 * int(b[j]):4 * int(b[j]) + 4] += 2.0
    return feats, 4 + (8 * b[:, None] + 3 * torch.arange(8)) % (V - 4)


def test_whisper_speech_to_text():
    torch.manual_seed(0)
    m = T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=V, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None))

    def micro(k, j):
        feats, labels = speech(k)
        return m(input_features=feats, labels=labels).loss
    rep, losses, scales = fit(m, micro, 40)
    assert_trained(losses, scales)
    quiet(rep)
