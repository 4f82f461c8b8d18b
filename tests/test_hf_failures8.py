"""Probe, eighth set: fp16 failures of Hugging Face architectures no other HF failure file builds (Pegasus, CodeGen,
GPT-Neo, Data2Vec-Audio, Time Series Transformer), all from tiny configs (no downloads), trained on the CPU with fp16
autocast + `torch.amp.GradScaler("cpu")` (scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update)
under a DEFAULT `ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")` (full statistics on
step 0 and every 200th: every failure below starts on an unsampled step, 6-8), public API only.

Every failure is first proven by the test's own oracle, independent of ampdoctor, and a failing oracle is a plain
failure: probe_harness.Producer (forward hooks on every module, keyword inputs included: the first, innermost module
whose output is non-finite while its inputs are finite, and at which step), the steps whose loss is non-finite and
the steps the scaler skipped (none before the failure but the scaler's first backoffs at steps 0-2), and what the
failure is made of (peaks, dtypes). The same batch with the weights that step's forward ran with, run in float32 (a
fresh model, no autocast, eval mode: the configs have no dropout), stays finite: each is an fp16 failure. Only then
must the report name `overflow` (docs/CONTRACT.md) at the PRODUCER among `rep.findings[:3]`, at the step, an error,
with no error at the modules that only passed the inf on; a wrong report raises WrongAnswer naming ampdoctor's top
three (rule@module step [severity]), and such a case is a strict xfail accepting only WrongAnswer.

Scenarios (failures):
 1. PegasusForConditionalGeneration: the T5-style feed-forward overflow (transformers #9295/#10830/#14189; Pegasus,
    like T5, was pretrained on TPUs in bf16): a checkpoint whose encoder layer 1 FF runs hot (`fc2` peaks ~2.8e3 at
    step 0), fine-tuned with a too-high LR that keeps growing `fc1` (emulated: x1.5 per step from step 1). `fc2`'s
    peak rises every step (4.6e4 at step 7) and passes 65504 at step 8, its input (GELU(fc1)) finite -> overflow at
    `model.encoder.layers.1.fc2`, step 8.
 2. CodeGenForCausalLM: `_attn` upcasts q and k to float32 "to avoid overflow issues" but under autocast the matmul
    runs in fp16 anyway, and the 1/sqrt(d) scale is applied AFTER it. Layer 1's fused `qkv_proj` (hot in the
    checkpoint, x20) jumps x30 at step 6 (attention-logit growth after warm-up, Dehghani et al. 2023) -> the q.k^T
    matmul overflows inside `transformer.h.1.attn` (its submodules' outputs, qkv_proj's included, finite), step 6.
 3. GPTNeoForCausalLM: GPT-Neo's attention has NO 1/sqrt(d) scale at all (q.k^T in fp16 under autocast). Layer 1
    (local attention) `q_proj`/`k_proj` hot in the checkpoint (x5) jump x100 at step 7 -> overflow at
    `transformer.h.1.attn.attention`, step 7 (q_proj/k_proj finite).
 4. Data2VecAudioForSequenceClassification: the loader feeds float waveforms in [-1, 1]; at step 7 a batch of loud
    (full-scale) clips from a shard decoded as raw int16 PCM (the `/ 32768` forgotten) arrives: every sample
    (|x| <= 32767) is representable in fp16, the first conv of the feature encoder (kernel 10) is not: overflow at
    `data2vec_audio.feature_extractor.conv_layers.0.conv` (the conv, not a cast), step 7; the next batches are fine.
 5. TimeSeriesTransformerForPrediction with a static real feature (the store's catchment population): the feature
    pipeline standardises it, but at step 7 a new region's file arrives raw (1.2e5-9e5 people). The encoder's
    `value_embedding.value_projection` (nn.Linear) casts it to fp16: +inf (float32: the feature is finite, the
    projection ~1e4). The NaN distribution parameters then make the model's own StudentT raise `ValueError:
    Expected parameter df ... GreaterThan(lower_bound=0.0)` in the forward (torch distributions validate by
    default): the script dies at step 7 -> overflow at `model.encoder.value_embedding.value_projection`, step 7.

Healthy twins (the fix applied; every loss finite and falling, no non-finite forward, no skip but the scaler's first
backoffs, no warning or error, and the weights after training BITWISE identical to the same loop without a watch):
 H1. Data2Vec-Audio with every shard's int16 PCM divided by 32768 (the fix of 4).
 H2. Time Series Transformer with the population standardised in every batch (the fix of 5).

What ampdoctor says (torch 2.13 CPU, transformers 5.25; 7 of 7 right; 5 was wrong when written, fixed since):
- right: 1 overflow at model.encoder.layers.1.fc2 step 8; 2 overflow at transformer.h.1.attn step 6; 3 overflow at
  transformer.h.1.attn.attention step 7; 4 overflow at data2vec_audio.feature_extractor.conv_layers.0.conv step 7;
  H1 and H2 quiet, their weights bitwise identical to the unwatched loop's.
- 5 (Time Series Transformer), wrong when written (a strict xfail then). Top three: `overflow@parameter_projection.proj.1
  step 0 [info]` (the scaler's first backward backoff), `skipped_steps@(run) step 0 [info]`; nothing more. Expected:
  `overflow@model.encoder.value_embedding.value_projection step 7 [error]` (forward). The summary does hold the crash
  (`Crashed at step 7: ValueError: Expected parameter df ...` in the root, exit code 1) and step 7's record holds
  headroom.fwd = Infinity for value_embedding / value_projection, but `forward_producer` is null (an unsampled step
  whose forward never returned) and no rule turns that inf headroom of a crashed step into an overflow finding. The
  close-time replay of captures/7 does not help: replay/__init__.py `_replay` re-raises the model's own ValueError as
  `BadInput("replaying the capture failed in the model: ...")` (the same forward raises again: the replay never
  gets to name the op whose output went inf first), and Watch._close / analysis.replaychoice keep no finding of it.
  Fixed since: a model exception that follows an op the traced forward saw make inf/NaN is the step's failure, not a
  model that does not fit (replay/__init__.py; the dtype what-if and fp32 shadow take it as a failed run), and a
  report with nothing wrong replays the crashed step's capture (analysis/replaychoice.crashed): now `[error]
  overflow at model.encoder.value_embedding.value_projection aten::_to_copy step 7` first.

Run: .venv/bin/python -m pytest -n 0 tests/test_hf_failures8.py -q -p no:cacheprovider (about 15 s)
"""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
T = pytest.importorskip("transformers")

import ampdoctor  # noqa: E402
from probe_harness import Producer, WrongAnswer  # noqa: E402
from scenarios import alarms, gen, lines, no_error_at, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

F16 = torch.float16
FP16_MAX = torch.finfo(F16).max


# ======================================================================================================================
# the loop and the checks
# ======================================================================================================================
def _train(build, batch, steps, run_dir, *, inject=None, lr=1e-4, snap_at=None, watch=True, catch=()):
    """The user's ordinary loop on `build()`: [inject(k, model) under no_grad] -> zero_grad -> forward under fp16 CPU
    autocast -> out.loss -> scaler.scale(loss).backward() -> unscale_ -> clip_grad_norm_(1.0) -> step -> update,
    under a default watch with a run_dir used as `with watch:` (`watch=False`: the same loop unwatched, no oracle).
    `catch`: exceptions that end the script: they leave the `with` block (as an uncaught one does) and are kept as
    (step, exception) in `crash`. Returns a dict: rep, losses, bad_loss, skipped,
    first (the Producer oracle's), sd (the state dict step `snap_at`'s forward ran with), weights (after training),
    crash."""
    model = build()
    torch.manual_seed(123)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu")
    prod = Producer(model, own_params=False, with_kwargs=True) if watch else None
    r = dict(losses=[], bad_loss=[], skipped=[], sd=None, crash=None, rep=None, first=None)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir) if watch else None
    try:
        with w if w is not None else contextlib.nullcontext():
            try:
                _loop(model, opt, sc, prod, batch, steps, inject, snap_at, r)
            finally:
                if prod is not None:
                    prod.remove()    # (before close(), whose replay of a capture runs the model again)
    except catch as e:               # the script dies of it: the exception leaves the `with watch` block
        r["crash"] = (len(r["losses"]), e)
    if w is not None:
        r["rep"] = w.report()
        r["first"] = prod.first
    r["weights"] = {n: v.detach().clone() for n, v in model.state_dict().items()}
    return r


def _loop(model, opt, sc, prod, batch, steps, inject, snap_at, r):
    for k in range(steps):
        if prod is not None:
            prod.new_step(k)
        if inject is not None:
            with torch.no_grad():
                inject(k, model)
        if k == snap_at:
            r["sd"] = {n: v.detach().clone() for n, v in model.state_dict().items()}
        b = batch(k)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=F16):
            out = model(**b)
        loss = out.loss
        r["losses"].append(loss.item())
        if not math.isfinite(loss.item()):
            r["bad_loss"].append(k)
        s0 = sc.get_scale()
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            r["skipped"].append(k)


def _fp32(build, sd, b, watch_module=None):
    """The same batch with the weights a step's forward ran with, in float32 (a fresh model, no autocast, eval mode).
    Returns (loss, abs-max of `watch_module`'s output or None)."""
    m = build()
    m.load_state_dict(sd)
    m.eval()
    peak = []
    h = None if watch_module is None else _peaks(m.get_submodule(watch_module), peak)
    with torch.no_grad():
        out = m(**b)
    if h is not None:
        h.remove()
    return float(out.loss), (peak[0][1] if peak else None)


def _peaks(module, store):
    """A forward hook keeping (abs-max of the first positional input (NaN where none), abs-max of the output) of
    `module` per call."""
    def peak(x):
        x = x if torch.is_tensor(x) else x[0] if x else None
        return math.nan if x is None else float(x.detach().float().abs().max())
    return module.register_forward_hook(lambda m, a, o: store.append((peak(a), peak(o))))


def _failed_at(r, step, skip=True):
    """The failure shows at `step` and not before: the loss is non-finite there first and (skip) the scaler skips it,
    with only its first backoffs (steps 0-2) before."""
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["bad_loss"]
    if skip:
        assert step in r["skipped"] and all(s < 3 for s in r["skipped"] if s < step), r["skipped"]


def top3(rep):
    return [f"{f.rule}@{'(run)' if f.module is None else f.module or '(root)'} step {f.step} [{f.severity}]"
            for f in rep.findings[:3]]


def named(rep, rule, module, step, phase="forward"):
    """The report check: `rule` at `module`, at `step`, in `phase`, an error, among the first three findings. A
    failure is a WrongAnswer naming ampdoctor's top three."""
    for f in rep.findings[:3]:
        if f.rule == rule and f.module == module and f.step == step and f.severity == "error" and f.phase == phase:
            return f
    raise WrongAnswer(f"top3={top3(rep)}; wanted {rule} at {module} step {step} {phase} [error]; "
                      f"all: {lines(rep)[:6]}")


def quiet(rep):
    """The healthy twins' report check: no warning or error and exit code 0 (else WrongAnswer)."""
    bad = alarms(rep.findings)
    if bad or rep.exit_code != 0:
        raise WrongAnswer(f"top3={top3(rep)}; a healthy run reported: {bad}")


def _twin_identical(a, b):
    """Training with and without the watch left bitwise-identical weights (and the same losses)."""
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    diff = [n for n in a["weights"] if not torch.equal(a["weights"][n], b["weights"][n])]
    assert not diff, diff[:5]


def _ids(seed, b=4, s=16):
    return torch.randint(3, 120, (b, s), generator=gen(seed))


def _lm(k):
    x = _ids(k % 3)
    return {"input_ids": x, "labels": x}


# ======================================================================================================================
# 1. Pegasus: the encoder FF `fc2` of a hot checkpoint grows past 65504
# ======================================================================================================================
FC2 = "model.encoder.layers.1.fc2"
PEGASUS_AT = 8


def pegasus():
    torch.manual_seed(0)
    m = T.PegasusForConditionalGeneration(T.PegasusConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    layer = m.model.encoder.layers[1]
    with torch.no_grad():           # the checkpoint: encoder layer 1's FF runs hot
        layer.final_layer_norm.weight.mul_(8.0)
        layer.fc1.weight.mul_(25.0)
        layer.fc2.weight.mul_(300.0)
    return m


def _s2s(k):
    g = gen(k % 3)
    return {"input_ids": torch.randint(2, 128, (4, 16), generator=g),
            "labels": torch.randint(2, 128, (4, 8), generator=g)}


def _grow_fc1(k, m):
    """A too-high LR keeps growing fc1 (emulated: x1.5 a step from step 1)."""
    if k >= 1:
        m.model.encoder.layers[1].fc1.weight.mul_(1.5)


def test_pegasus_encoder_ff_fc2_grows_past_fp16_max_mid_run(tmp_path):
    seen = []
    holder = {}

    def build():
        holder["m"] = m = pegasus()
        holder["h"] = _peaks(m.get_submodule(FC2), seen)
        return m
    try:
        r = _train(build, _s2s, 11, tmp_path / "run", inject=_grow_fc1, snap_at=PEGASUS_AT)
    finally:
        holder["h"].remove()
    # truth: fc2's peak rises every step and passes fp16's max at PEGASUS_AT, its input finite
    outs = [o for _, o in seen]
    assert all(a < b for a, b in zip(outs[:PEGASUS_AT - 1], outs[1:PEGASUS_AT])), outs
    assert outs[PEGASUS_AT - 1] < FP16_MAX and outs[PEGASUS_AT] == math.inf, outs
    assert math.isfinite(seen[PEGASUS_AT][0]), seen[PEGASUS_AT]
    assert r["first"] == (FC2, PEGASUS_AT), r["first"]
    _failed_at(r, PEGASUS_AT)
    loss32, out32 = _fp32(pegasus, r["sd"], _s2s(PEGASUS_AT), watch_module=FC2)
    assert math.isfinite(loss32) and FP16_MAX < out32 < 1e7, (loss32, out32)
    named(r["rep"], "overflow", FC2, PEGASUS_AT)
    no_error_at(r["rep"], {"model.encoder.layers.1", "model.encoder", "model.encoder.layer_norm", "lm_head", ""})


# ======================================================================================================================
# 2 / 3. CodeGen and GPT-Neo: attention logits past 65504 in the fp16 q.k^T (scaled after it / never scaled)
# ======================================================================================================================
CODEGEN_AT, NEO_AT = 6, 7
CG_ATTN, NEO_ATTN = "transformer.h.1.attn", "transformer.h.1.attn.attention"


def codegen():
    torch.manual_seed(0)
    m = T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                             n_positions=64, n_ctx=64, attn_implementation="eager"))
    with torch.no_grad():           # the checkpoint: layer 1's attention runs hot
        m.transformer.h[1].attn.qkv_proj.weight.mul_(20.0)
    return m


def _codegen_jump(k, m):
    if k == CODEGEN_AT:
        m.transformer.h[1].attn.qkv_proj.weight.mul_(30.0)


def gptneo():
    torch.manual_seed(0)
    m = T.GPTNeoForCausalLM(T.GPTNeoConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=8, max_position_embeddings=64, intermediate_size=128, embed_dropout=0.0, attention_dropout=0.0,
        resid_dropout=0.0))
    att = m.transformer.h[1].attn.attention
    with torch.no_grad():
        att.q_proj.weight.mul_(5.0)
        att.k_proj.weight.mul_(5.0)
    return m


def _neo_jump(k, m):
    if k == NEO_AT:
        att = m.transformer.h[1].attn.attention
        att.q_proj.weight.mul_(100.0)
        att.k_proj.weight.mul_(100.0)


ATTN_CASES = {
    "codegen": (codegen, _codegen_jump, CODEGEN_AT, CG_ATTN, "transformer.h.1.attn.qkv_proj",
                {"transformer.h.1.attn.out_proj", "transformer.h.1", "transformer.ln_f", "lm_head", ""}),
    "gptneo": (gptneo, _neo_jump, NEO_AT, NEO_ATTN, "transformer.h.1.attn.attention.k_proj",
               {"transformer.h.1.attn.attention.out_proj", "transformer.h.1.attn", "transformer.h.1",
                "transformer.ln_f", "lm_head", ""}),
}


@pytest.mark.parametrize("arch", list(ATTN_CASES))
def test_attention_logits_overflow_in_the_fp16_qk_matmul(arch, tmp_path):
    build, jump, at, attn, proj, passers = ATTN_CASES[arch]
    seen = []
    holder = {}

    def built():
        holder["m"] = m = build()
        holder["h"] = _peaks(m.get_submodule(proj), seen)
        return m
    try:
        r = _train(built, _lm, 10, tmp_path / "run", inject=jump, snap_at=at)
    finally:
        holder["h"].remove()
    # truth: the projection feeding the scores stays finite (well inside fp16) at the failing step; the attention
    # module (whose q.k^T matmul is its own code) is the first to make a non-finite output
    assert seen[at][1] < 0.1 * FP16_MAX, seen[at]
    assert r["first"] == (attn, at), r["first"]
    _failed_at(r, at)
    loss32, out32 = _fp32(build, r["sd"], _lm(at), watch_module=attn)
    assert math.isfinite(loss32) and math.isfinite(out32), (loss32, out32)
    named(r["rep"], "overflow", attn, at)
    no_error_at(r["rep"], passers)


# ======================================================================================================================
# 4 / H1. Data2Vec-Audio: one shard of raw int16 PCM (the / 32768 forgotten)
# ======================================================================================================================
PCM_AT = 7
CONV0 = "data2vec_audio.feature_extractor.conv_layers.0.conv"


def d2v():
    torch.manual_seed(0)
    return T.Data2VecAudioForSequenceClassification(T.Data2VecAudioConfig(
        num_labels=4, classifier_proj_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, layerdrop=0.0, mask_time_prob=0.0,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0))


def _clips(raw_at=PCM_AT):
    """4 loud clips of 0.1 s at 16 kHz (tones near full scale, clipped to [-1, 1]) and their class; at `raw_at` the
    shard's int16 PCM arrives raw (None: every shard divided by 32768, the fix)."""
    def batch(k):
        g = gen(k % 3)
        t = torch.arange(1600) / 16000.0
        f = torch.rand(4, 1, generator=g) * 300 + 100
        x = (torch.sin(2 * math.pi * f * t) * 0.95 + 0.05 * torch.randn(4, 1600, generator=g)).clamp(-1, 1)
        pcm = (x * 32767).round()                   # the decoded int16 samples
        x = pcm if k == raw_at else pcm / 32768.0
        return {"input_values": x, "labels": torch.randint(0, 4, (4,), generator=g)}
    return batch


def test_data2vec_audio_raw_int16_pcm_overflows_the_first_conv(tmp_path):
    batch = _clips()
    x = batch(PCM_AT)["input_values"]
    assert float(x.abs().max()) <= 32767 and bool(torch.isfinite(x.half()).all())     # the cast is not the overflow
    seen = []
    holder = {}

    def build():
        holder["m"] = m = d2v()
        holder["h"] = _peaks(m.get_submodule(CONV0), seen)
        return m
    try:
        r = _train(build, batch, 11, tmp_path / "run", lr=1e-3, snap_at=PCM_AT)
    finally:
        holder["h"].remove()
    assert all(o < 10 for _, o in seen[:PCM_AT]) and seen[PCM_AT][1] == math.inf, seen
    assert r["first"] == (CONV0, PCM_AT), r["first"]
    _failed_at(r, PCM_AT)
    assert all(map(math.isfinite, r["losses"][PCM_AT + 1:])), r["losses"]    # transient: the next batches are fine
    loss32, out32 = _fp32(d2v, r["sd"], batch(PCM_AT), watch_module=CONV0)
    assert math.isfinite(loss32) and FP16_MAX < out32 < 1e7, (loss32, out32)
    named(r["rep"], "overflow", CONV0, PCM_AT)
    no_error_at(r["rep"], {"data2vec_audio.feature_extractor.conv_layers.0.layer_norm",
                           "data2vec_audio.feature_extractor.conv_layers.0", "data2vec_audio.feature_extractor",
                           "data2vec_audio.feature_projection", "projector", "classifier", ""})


def _healthy(r, skips_before=3):
    ls = r["losses"]
    assert r["crash"] is None and all(map(math.isfinite, ls)) and r["first"] is None, (ls, r["first"], r["crash"])
    assert all(s < skips_before for s in r["skipped"]), r["skipped"]
    assert sum(ls[-3:]) < sum(ls[:3]), ls


def test_healthy_data2vec_audio_every_shard_scaled_is_quiet_and_bitwise_unchanged(tmp_path):
    batch = _clips(raw_at=None)
    r = _train(d2v, batch, 11, tmp_path / "run", lr=1e-3)
    twin = _train(d2v, batch, 11, tmp_path / "twin", lr=1e-3, watch=False)
    _healthy(r)
    _twin_identical(r, twin)
    quiet(r["rep"])


# ======================================================================================================================
# 5 / H2. Time Series Transformer: a static real feature arrives unstandardised
# ======================================================================================================================
TS_AT = 7
VPROJ = "model.encoder.value_embedding.value_projection"


def tst():
    torch.manual_seed(0)
    return T.TimeSeriesTransformerForPrediction(T.TimeSeriesTransformerConfig(
        prediction_length=4, context_length=8, lags_sequence=[1, 2], num_time_features=1,
        num_static_real_features=1, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0))


def _series(raw_at=TS_AT):
    """8 weekly-seasonal sales series (10 past + 4 future values) with a time feature and the store's catchment
    population (people; standardised by the pipeline, raw at `raw_at`; None: always standardised)."""
    past = 8 + 2

    def batch(k):
        g = gen(k % 3)
        t = torch.arange(past + 4).float()
        base = 10 + 5 * torch.rand(8, 1, generator=g)
        y = base * (1 + 0.3 * torch.sin(t / 3)) + torch.randn(8, past + 4, generator=g)
        people = 1.2e5 + 7.8e5 * torch.rand(8, 1, generator=g)
        pop = people if k == raw_at else (people - 5e5) / 2.3e5
        tf = (t / (past + 4)).view(1, -1, 1).expand(8, -1, 1)
        return dict(past_values=y[:, :past], past_time_features=tf[:, :past], past_observed_mask=torch.ones(8, past),
                    static_real_features=pop, future_values=y[:, past:], future_time_features=tf[:, past:])
    return batch


@pytest.fixture
def validated_distributions():
    """torch.distributions' argument checks on, as in a fresh process: torch._dynamo switches them off process-wide
    the first time anything is compiled (an earlier test in the same worker), and this case's crash is that check."""
    from torch.distributions import Distribution
    was = Distribution._validate_args
    Distribution.set_default_validate_args(True)
    yield
    Distribution.set_default_validate_args(was)


def test_time_series_transformer_raw_static_feature_overflows_the_value_projection(tmp_path, validated_distributions):
    batch = _series()
    assert float(batch(TS_AT)["static_real_features"].min()) > FP16_MAX
    assert float(batch(TS_AT - 1)["static_real_features"].abs().max()) < 3
    r = _train(tst, batch, 11, tmp_path / "run", lr=1e-3, snap_at=TS_AT, catch=(ValueError,))
    # truth: steps 0..TS_AT-1 ran finite; at TS_AT the value projection makes +inf from the finite fp32 features and
    # the model's own distribution raises on the NaN parameters that follow: the script dies there
    assert r["first"] == (VPROJ, TS_AT), r["first"]
    assert r["crash"] is not None and r["crash"][0] == TS_AT and "invalid values" in str(r["crash"][1]), r["crash"]
    assert len(r["losses"]) == TS_AT and all(map(math.isfinite, r["losses"])), r["losses"]
    assert all(s < 3 for s in r["skipped"]), r["skipped"]
    loss32, out32 = _fp32(tst, r["sd"], batch(TS_AT), watch_module=VPROJ)
    assert math.isfinite(loss32) and math.isfinite(out32), (loss32, out32)
    named(r["rep"], "overflow", VPROJ, TS_AT)
    no_error_at(r["rep"], {"model.encoder.value_embedding", "model.encoder", "model", "model.encoder.layers.0",
                           "parameter_projection", ""})


def test_healthy_time_series_transformer_standardised_feature_is_quiet_and_bitwise_unchanged(tmp_path):
    batch = _series(raw_at=None)
    r = _train(tst, batch, 11, tmp_path / "run", lr=1e-3)
    twin = _train(tst, batch, 11, tmp_path / "twin", lr=1e-3, watch=False)
    _healthy(r)
    _twin_identical(r, twin)
    quiet(r["rep"])
