"""Probe, seventh set: fp16 failures of Hugging Face model classes as users hit them in fine-tuning (mT5, Switch
Transformers, Decision Transformer, Llama, ELECTRA, WavLM, DistilBERT, Qwen2), all from tiny configs (no downloads),
trained on the CPU with fp16 autocast + `torch.amp.GradScaler("cpu")` (scale(loss).backward -> unscale_ ->
clip_grad_norm_ -> step -> update) under a DEFAULT `ampdoctor.watch(model, optimizer=opt, scaler=scaler,
run_dir=tmp_path / "run")` (full statistics on step 0 and every 200th: every failure below starts on an unsampled
step, 6-9), public API only.

Every failure is first proven by the test's own oracle, independent of ampdoctor, and a failing oracle is a plain
failure: probe_harness.Producer (forward hooks on every module, keyword inputs included: the first, innermost
module whose output is non-finite while its inputs and own parameters are finite, and at which step; for 5, whose
inputs carry an additive -inf mask, the first module whose output holds NaN while its inputs hold none), the steps
whose loss is non-finite and the steps the scaler skipped (not before the failure, the scaler's first backoffs at
steps 0-2 aside), and what the failure is made of (peaks, sums, positions, dtypes, the crash). Where the failure is
an fp16 one, the same batch with the weights that step's forward ran with, run in float32 (a fresh model, no
autocast), stays finite and holds the value fp16 cannot (> 65504); where it is not (6, 7), float32 fails the same
way. Only then must the report name the rule of docs/CONTRACT.md at the PRODUCER among `rep.findings[:3]`, at the
step, an error (run-level rules: module null or "" (root)); a wrong report raises WrongAnswer naming ampdoctor's
top three (rule@module step [severity]), and such a case is a strict xfail accepting only WrongAnswer.

Scenarios (failures):
 1. MT5ForConditionalGeneration (gated-GELU FF, the known T5/mT5 fp16 problem, transformers #9295/#10830/#14189):
    a checkpoint pretrained in bf16 whose encoder block 1 `wo` already peaks at ~2.3e3 (1/28 of fp16's max),
    fine-tuned with a too-high LR that keeps growing `wi_1` (emulated: x1.5 per step from step 1).
    `wo`'s peak rises every step (5.0e4 at step 8) and passes 65504 at step 9 (9.0e4 in float32; its input, the
    gated product, ~236): overflow at `encoder.block.1.layer.1.DenseReluDense.wo`, step 9, forward.
 2. SwitchTransformersForConditionalGeneration with output_router_logits (router z-loss): the router keeps
    `router_dtype="float32"` but under autocast its nn.Linear returns fp16 logits, and router_z_loss_func sums
    logsumexp(logits)^2 over ALL tokens of the batch in fp16 (z^2 ~ 38-43 per token at init). 8 x 64-token batches
    sum to 19-22k; at step 8 the loader's longest length bucket (8 x 512 tokens) sums to ~1.6e5: the root's own
    forward (the loss code) makes +inf from finite router logits. The loss the model returns (and the user logs, or
    a NaN guard / ReduceLROnPlateau reads) is +inf; its gradient is finite (d sum = 1), so the scaler does not skip
    -> overflow at the root "", step 8, forward.
 3. DecisionTransformerModel (offline RL): returns-to-go are divided by the env's return scale (1e4 points) in the
    loader; at step 9 a batch from a shard whose scale entry is missing arrives raw, a high-scoring episode's
    return-to-go at 93,000 points: `embed_return` (Linear(1, hidden)) casts it to fp16 -> +inf (its float32
    output is only ~3.6e3: the cast is the overflow) -> overflow at `embed_return`, step 9.
 4. LlamaForCausalLM with a "massive activation" (Sun et al. 2024) as a bf16-pretrained checkpoint has one: the BOS
    token drives one unit of layer 1's MLP hard and `down_proj` writes it into one residual channel (~1.4e5 for BOS,
    < 17k for every other token). The first batches come from a source tokenized without BOS; from step 8 a second
    source adds it: the gated product is finite (~2.3e3), `down_proj`'s mm is not -> overflow at
    `model.layers.1.mlp.down_proj`, step 8.
 5. ElectraForTokenClassification (NER) given the user's own 4D additive mask `(1 - am[:, None, None, :].half()) *
    -1e9` (-1e9 is -inf in fp16: the constant overflows; harmless while every row keeps a visible key). The epoch's
    last batch (step 7) is padded to the fixed batch size with empty rows (attention mask all 0, labels -100): the
    softmax of an all -inf row is NaN in layer 0's self-attention. The NaN sits only in ignored rows, so the LOSS IS
    FINITE; the backward carries the NaN into the weight gradients and the scaler skips step 7 -> nan_origin (or
    mask_value_overflow) at `electra.encoder.layer.0.attention.self` (mask_value_overflow also with module null/""),
    step 7.
 6. WavLMForCTC (ctc_zero_infinity=False, the default): at step 7 one utterance is mis-segmented, 90 labels for 79
    frames: no CTC alignment exists, the CTC loss in the root's forward is +inf from finite log-probs (float32
    gives +inf too: a data failure, not an fp16 one) -> overflow at the root "", step 7, forward.
 7. DistilBertForQuestionAnswering: the user's own preprocessing keeps answer positions that fall past the 32-token
    window (HF's prepare_train_features points them at CLS); at step 6 every answer in the batch does: the model
    clamps them all to `ignored_index`, the mean cross-entropy over zero positions is 0/0 = NaN (float32 too). The
    gradients are zero, finite: the scaler does NOT skip, the NaN is only in the loss -> nan_origin at the root
    ("" or null), step 6.
 8. Qwen2ForCausalLM: an evaluation callback runs `model.half()` at step 6 for a faster eval and never casts back;
    nn.Module.half() swaps every parameter's data in place, so the optimizer now steps fp16 parameters (no fp32
    master copy). (a) with the GradScaler: step 6's `scaler.unscale_` raises "Attempting to unscale FP16
    gradients"; (b) the same loop without a GradScaler (autocast alone): step 6's AdamW raises on its fp32 moments
    against the fp16 gradients. Both: fp16_master_weights at the root ("" or null), step 6, an error (the run
    crashed of it).

Healthy twins (the fix applied; every loss finite and falling, no non-finite forward, no skip but the scaler's first
backoffs (and in H2 one benign backward backoff), no warning or error):
 H1. Decision Transformer, every batch scaled (the fix of 3).
 H2. WavLMForCTC with ctc_zero_infinity=True on the same data (the fix of 6): the infeasible utterance's loss is
    zeroed.

What ampdoctor says (torch 2.13 CPU, transformers 5.25; 11 of 11 right; when written 9 of 11, the two below strict
xfails, fixed since):
- right: 1 `[error] overflow at encoder.block.1.layer.1.DenseReluDense.wo aten::mm step 9` first; 2 `[error] overflow
  at (root) aten::sum step 8` first; 3 `[error] overflow at embed_return aten::_to_copy step 9` first; 4 `[error]
  overflow at model.layers.1.mlp.down_proj aten::mm step 8` first; 5 `[error] nan_origin at
  electra.encoder.layer.0.attention.self aten::_softmax step 7` first; 6 `[error] overflow at (root) aten::_ctc_loss
  step 7` first; 7 `[error] nan_origin at (root) aten::nll_loss_forward step 6`, the only finding; 8a `[error]
  fp16_master_weights at (root) GradScaler.unscale_ step 6`; H1 quiet.
- wrong when written (strict xfails, fixed since):
  8b (autocast without a GradScaler): top three `underflow@model.layers.1.mlp.up_proj step 0 [error]` (true: with no
  loss scaling 53% of the nonzero fp16 gradients reaching up_proj are below 2^-14) and
  `fp16_master_weights@(root) step 6 [warning]`: the cause of the crash at step 6 is only a warning. Cause:
  ampdoctor/rules/weights.py fp16_master_weights() makes the finding an error without a scaler only where the fp16
  parameters' updates already round away (`rounds`) or an eps vanishes; the one crash it looks for is GradScaler's
  "Attempting to unscale FP16 gradients" event (_FP16_GRADS); the optimizer step that raised on the fp16
  parameters (AdamW's lerp of its fp32 moments with fp16 gradients, recorded as the run's crash at step 6) does
  not count, so `sev = "warning"`. Now a crash whose message names the dtype (Half/float16/dtype), at or after the
  step the parameters became fp16, makes it an error too: `[error] fp16_master_weights at (root) step 6`.
  H2 (WavLM CTC, ctc_zero_infinity=True): `[error] overflow at wavlm.encoder.layers.0.attention aten::log step 8` ("hit
  its singular point ... produced -inf") and `[error] underflow at wavlm.encoder.layers.0.attention aten::log step
  8` ("the zeros ... are not zero in fp32 ... (in float16: 79 zero inputs)"). Step 8 is one benign backward backoff
  at a scale steps 3-7 applied, so the step is replayed; WavLM's `_relative_positions_bucket` takes
  `torch.log(relative_positions.float() / max_exact)` of the 79 zero distances on the diagonal in FLOAT32 on every
  step (-inf by design, cast to long and discarded by `torch.where(is_small, ...)`). replay/optrace.py
  OpTracer.check_output() records it as a forward origin (finite inputs at the pole); replay/explain.py
  _pole_underflow() then credits the fp32 fix search (which only cured the step's real, scale-sized backward
  overflow) to those zeros and names their dtype "float16" by default (`dt = ... or "float16"`: the op's inputs are
  float32, where the zeros are zero too), and both findings are folded into a healthy run as errors. Now a forward
  op computing in full precision whose inf/NaN never left its module is no failure of the step
  (replay/__init__.py _fp32_absorbed: not an origin, and the scale search runs), and _pole_underflow says nothing
  of zeros that were fp32 already: only the info findings of GradScaler's search are left.

Run: .venv/bin/python -m pytest -n 0 tests/test_hf_failures7.py -q -p no:cacheprovider (about 20 s)
"""
from __future__ import annotations

import math
import os
import traceback

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
T = pytest.importorskip("transformers")

import ampdoctor  # noqa: E402
from probe_harness import Producer, WrongAnswer, finite  # noqa: E402
from scenarios import alarms, gen, lines, no_error_at, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

F16 = torch.float16
FP16_MAX = torch.finfo(F16).max
ROOT = ("", None)


# ======================================================================================================================
# the oracle, the loop and the checks
# ======================================================================================================================
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


class MaskProducer(Producer):
    """Producer for inputs that carry an additive -inf mask: the first (module, step) whose output holds NaN while its
    inputs (keyword ones too) and own parameters hold none, or +-inf while they are all finite."""

    def __init__(self, m):
        super().__init__(m, with_kwargs=True)

    def _fwd(self, n):
        def f(mod, args, kwargs, out):
            if self.first is not None:
                return
            ins = _flat(args, []) + _flat(kwargs, []) + list(mod.parameters(recurse=False))
            outs = _flat(out, [])
            nan_in = any(bool(torch.isnan(t).any()) for t in ins)
            nan_out = any(bool(torch.isnan(t).any()) for t in outs)
            if nan_out and not nan_in or not finite(outs) and finite(ins):
                self.first = (n, self.step)
        return f


def _train(model, batch, steps, run_dir, *, inject=None, lr=1e-4, loss_fn=None, oracle=None, snap_at=None):
    """The user's ordinary loop under a default watch with a run_dir: [inject(k, model) under no_grad] -> zero_grad ->
    forward under fp16 CPU autocast -> loss (out.loss, or loss_fn(out, batch)) -> scaler.scale(loss).backward() ->
    unscale_ -> clip_grad_norm_(1.0) -> step -> update. `batch(k)` gives step k's kwargs. Returns a dict: rep, losses,
    bad_loss (steps with a non-finite loss), skipped (steps the scaler skipped), scales (the scale each step ran at),
    first (the oracle's producer, default probe_harness.Producer with keyword inputs), sd (the state dict the forward
    of step `snap_at` ran with)."""
    torch.manual_seed(123)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu")
    prod = (oracle or (lambda m: Producer(m, with_kwargs=True)))(model)
    r = dict(losses=[], bad_loss=[], skipped=[], scales=[], sd=None)
    try:
        with ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir) as w:
            for k in range(steps):
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
                loss = out.loss if loss_fn is None else loss_fn(out, b)
                r["losses"].append(loss.item())
                if not math.isfinite(loss.item()):
                    r["bad_loss"].append(k)
                s0 = sc.get_scale()
                r["scales"].append(s0)
                sc.scale(loss).backward()
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(opt)
                sc.update()
                if sc.get_scale() < s0:
                    r["skipped"].append(k)
            prod.remove()        # (before close(), whose replay of a capture runs the model again)
    finally:
        prod.remove()
    r["rep"] = w.report()
    r["first"] = prod.first
    return r


def _fp32(build, sd, b, loss_fn=None, watch_module=None):
    """The same batch, the weights a step's forward ran with, in float32: a fresh model, no autocast, eval mode (the
    configs have no dropout). Returns (loss, (abs-max of `watch_module`'s input, of its output) or None)."""
    m = build()
    m.load_state_dict(sd)
    m.eval()
    peak = []
    h = None if watch_module is None else _peaks(m.get_submodule(watch_module), peak)
    with torch.no_grad():
        out = m(**b)
    if h is not None:
        h.remove()
    loss = out.loss if loss_fn is None else loss_fn(out, b)
    return float(loss), (peak[0] if peak else None)


def _failed_at(r, step, skip=True, loss=True):
    """The failure shows at `step` and not before: (loss) the loss is non-finite there first and (skip) the scaler
    skips it, with only its first backoffs (steps 0-2) before."""
    if loss:
        assert r["bad_loss"] and r["bad_loss"][0] == step, r["bad_loss"]
    if skip:
        assert step in r["skipped"] and all(s < 3 for s in r["skipped"] if s < step), r["skipped"]


def top3(rep):
    return [f"{f.rule}@{'(run)' if f.module is None else f.module or '(root)'} step {f.step} [{f.severity}]"
            for f in rep.findings[:3]]


def named(rep, rules, modules, step, phase=None, severity="error"):
    """The report check: one of `rules` at one of `modules`, at `step`, in `phase` (where given), with `severity`,
    among the first three findings. A failure is a WrongAnswer naming ampdoctor's top three."""
    rules = (rules,) if isinstance(rules, str) else rules
    modules = (modules,) if isinstance(modules, str) else modules
    for f in rep.findings[:3]:
        if (f.rule in rules and f.module in modules and f.step == step and f.severity == severity
                and (phase is None or f.phase == phase)):
            return f
    raise WrongAnswer(f"top3={top3(rep)}; wanted {'/'.join(rules)} at {modules} step {step} phase {phase} "
                      f"[{severity}]; all: {lines(rep)[:6]}")


def quiet(rep):
    """The healthy twins' report check: no warning or error and exit code 0 (else WrongAnswer)."""
    bad = alarms(rep.findings)
    if bad or rep.exit_code != 0:
        raise WrongAnswer(f"top3={top3(rep)}; a healthy run reported: {bad}")


def _peaks(module, store):
    """A forward hook keeping (abs-max of the input, abs-max of the output) of `module` per call."""
    return module.register_forward_hook(lambda m, a, o: store.append(
        (float(a[0].detach().float().abs().max()), float(o.detach().float().abs().max()))))


def _ids(seed, b=4, s=16, lo=3, hi=120):
    return torch.randint(lo, hi, (b, s), generator=gen(seed))


# ======================================================================================================================
# 1. mT5: the encoder FF `wo` of a bf16-pretrained checkpoint grows past 65504
# ======================================================================================================================
WO = "encoder.block.1.layer.1.DenseReluDense.wo"
MT5_AT = 9


def mt5():
    torch.manual_seed(0)
    m = T.MT5ForConditionalGeneration(T.MT5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        tie_word_embeddings=False))
    with torch.no_grad():           # the bf16-pretrained checkpoint: block 1's wo runs large from the start
        m.get_submodule(WO).weight.mul_(700.0)
    return m


def _s2s(k):
    g = gen(k % 3)
    return {"input_ids": torch.randint(2, 128, (4, 16), generator=g),
            "labels": torch.randint(2, 128, (4, 8), generator=g)}


def _grow(k, m):
    """Fine-tuning with a too-high LR and no weight decay grows the gated FF's linear branch (emulated: x1.5 a step)."""
    if k >= 1:
        m.get_submodule("encoder.block.1.layer.1.DenseReluDense.wi_1").weight.mul_(1.5)


def test_mt5_gated_ff_wo_grows_past_fp16_max_mid_run(tmp_path):
    m = mt5()
    seen = []
    h = _peaks(m.get_submodule(WO), seen)
    try:
        r = _train(m, _s2s, 12, tmp_path / "run", inject=_grow, snap_at=MT5_AT)
    finally:
        h.remove()
    # truth: wo's peak rises step after step and passes fp16's max at MT5_AT, its input (the gated product) finite
    outs = [o for _, o in seen[:12]]
    assert all(math.isfinite(o) for o in outs[:MT5_AT]) and outs[MT5_AT] == math.inf, outs
    assert all(a < b for a, b in zip(outs[1:MT5_AT], outs[2:MT5_AT])), outs
    assert outs[MT5_AT - 1] < 0.9 * FP16_MAX and math.isfinite(seen[MT5_AT][0]), seen[MT5_AT]
    assert r["first"] == (WO, MT5_AT), r["first"]
    _failed_at(r, MT5_AT)
    loss32, (in32, out32) = _fp32(mt5, r["sd"], _s2s(MT5_AT), watch_module=WO)
    assert math.isfinite(loss32) and in32 < FP16_MAX < out32 < 1e7, (loss32, in32, out32)
    named(r["rep"], "overflow", WO, MT5_AT, "forward")
    no_error_at(r["rep"], {"encoder.block.1.layer.1.dropout", "encoder.block.1.layer.1", "encoder.final_layer_norm",
                           "encoder.block.1.layer.1.DenseReluDense"})


# ======================================================================================================================
# 2. Switch Transformers: the router z-loss sums token z^2 in fp16 and overflows on the longest batch
# ======================================================================================================================
SWITCH_AT = 8


def switch():
    torch.manual_seed(0)
    return T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
        encoder_sparse_step=2, decoder_sparse_step=2, router_z_loss_coef=1e-3, router_aux_loss_coef=1e-3,
        router_jitter_noise=0.0, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def _buckets(k):
    """Length-bucketed batches: 8 x 64 tokens, and at SWITCH_AT the longest bucket, 8 x 512."""
    g = gen(k % 3 + (10 if k == SWITCH_AT else 0))
    s = 512 if k == SWITCH_AT else 64
    return {"input_ids": torch.randint(2, 128, (8, s), generator=g),
            "labels": torch.randint(2, 128, (8, 8), generator=g), "output_router_logits": True}


def test_switch_router_z_loss_sums_past_fp16_max_on_the_longest_batch(tmp_path):
    m = switch()
    router = "encoder.block.1.layer.1.mlp.router"
    logits = []
    h = m.get_submodule(router).register_forward_hook(lambda mod, a, o: logits.append(o[2].detach().clone()))
    try:
        r = _train(m, _buckets, 11, tmp_path / "run", snap_at=SWITCH_AT)
    finally:
        h.remove()
    # truth: the router's logits are fp16 (autocast beats router_dtype="float32"), finite, ~36 of z^2 per token; the
    # z-loss sum passes 65504 only on the 4096-token batch
    lg = logits[SWITCH_AT]
    assert lg.dtype == F16 and bool(torch.isfinite(lg).all()), lg.dtype
    zsum = [float((torch.logsumexp(x.float(), -1) ** 2).sum()) for x in logits[:11]]
    assert all(z < 0.5 * FP16_MAX for i, z in enumerate(zsum) if i != SWITCH_AT), zsum
    assert zsum[SWITCH_AT] > 1.5 * FP16_MAX, zsum
    assert r["first"] == ("", SWITCH_AT), r["first"]
    # the loss is +inf at SWITCH_AT only; its gradient (d sum = 1) is finite: the scaler applies the step
    _failed_at(r, SWITCH_AT, skip=False)
    assert r["bad_loss"] == [SWITCH_AT] and r["losses"][SWITCH_AT] == math.inf, r["losses"]
    assert all(s < 3 for s in r["skipped"]), r["skipped"]
    assert all(map(math.isfinite, r["losses"][SWITCH_AT + 1:])), r["losses"]
    loss32, _ = _fp32(switch, r["sd"], _buckets(SWITCH_AT))
    assert math.isfinite(loss32), loss32
    named(r["rep"], "overflow", "", SWITCH_AT, "forward")
    no_error_at(r["rep"], {router, router + ".classifier", "encoder.block.1.layer.1.mlp", "encoder"})


# ======================================================================================================================
# 3 / H1. Decision Transformer: returns-to-go of one shard arrive unscaled
# ======================================================================================================================
DT_AT = 9
RET_SCALE = 1e4


def dt():
    torch.manual_seed(0)
    return T.DecisionTransformerModel(T.DecisionTransformerConfig(
        state_dim=6, act_dim=3, hidden_size=32, max_ep_len=64, n_layer=2, n_head=2, n_inner=64, n_positions=96,
        action_tanh=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _trajectories(raw_at):
    """8 trajectory windows of 10 steps (4 distinct batches, cycled; the one at DT_AT is its own, holding a
    high-scoring episode): returns-to-go in game points divided by RET_SCALE, except at `raw_at`."""
    def batch(k):
        g = gen(k % 4 if k != DT_AT else 40)
        B, L = 8, 10
        states = torch.randn(B, L, 6, generator=g)
        actions = torch.tanh(states[..., :3] * 0.7 + states[..., 3:] * 0.3)
        rewards = torch.rand(B, L, generator=g) * 800.0
        if k == DT_AT:
            rewards[0] = 9300.0                 # the high-scoring episode: 93,000 points over the window
        rtg = rewards.flip(1).cumsum(1).flip(1)[..., None]
        if k != raw_at:
            rtg = rtg / RET_SCALE
        return {"states": states, "actions": actions, "returns_to_go": rtg, "rewards": rewards[..., None],
                "timesteps": torch.arange(L)[None].repeat(B, 1), "attention_mask": torch.ones(B, L, dtype=torch.long)}
    return batch


def _action_mse(out, b):
    return F.mse_loss(out.action_preds.float(), b["actions"])


def test_decision_transformer_unscaled_returns_to_go_overflow_embed_return(tmp_path):
    batch = _trajectories(raw_at=DT_AT)
    rtg = batch(DT_AT)["returns_to_go"]
    assert rtg.dtype == torch.float32 and float(rtg.max()) > FP16_MAX and bool(torch.isfinite(rtg).all())
    assert float(batch(DT_AT - 1)["returns_to_go"].max()) < 1.0
    m = dt()
    r = _train(m, batch, 13, tmp_path / "run", lr=1e-3, loss_fn=_action_mse, snap_at=DT_AT)
    assert r["first"] == ("embed_return", DT_AT), r["first"]
    _failed_at(r, DT_AT)
    assert all(map(math.isfinite, r["losses"][DT_AT + 1:])), r["losses"]        # transient: the next batches are fine
    # float32 holds the ~9e4 input (fp16 cannot) and embed_return's output is small (~4e3): the cast is the overflow
    loss32, (in32, out32) = _fp32(dt, r["sd"], batch(DT_AT), loss_fn=_action_mse, watch_module="embed_return")
    assert math.isfinite(loss32) and FP16_MAX < in32 < 1e6 and out32 < 0.5 * FP16_MAX, (loss32, in32, out32)
    named(r["rep"], "overflow", "embed_return", DT_AT, "forward")
    no_error_at(r["rep"], {"embed_ln", "encoder", "encoder.h.0", "predict_action", ""})


def test_healthy_decision_transformer_with_every_return_scaled_is_quiet(tmp_path):
    batch = _trajectories(raw_at=None)
    r = _train(dt(), batch, 13, tmp_path / "run", lr=1e-3, loss_fn=_action_mse)
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, (ls, r["first"])
    assert all(s < 3 for s in r["skipped"]), r["skipped"]
    assert sum(ls[-3:]) < 0.8 * sum(ls[:3]), ls
    quiet(r["rep"])


# ======================================================================================================================
# 4. Llama: a massive activation on BOS in layer 1's MLP, first reached when a source adds BOS
# ======================================================================================================================
BOS, LLAMA_AT = 1, 8
DOWN = "model.layers.1.mlp.down_proj"


def llama():
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=BOS, attn_implementation="eager"))
    d = torch.randn(64, generator=gen(7))
    d /= d.norm()
    unit, ch = 5, 7
    with torch.no_grad():           # the checkpoint's massive activation: BOS -> unit 5 of layer 1's MLP -> channel 7
        m.model.embed_tokens.weight[BOS] = 4.0 * d
        mlp = m.model.layers[1].mlp
        mlp.gate_proj.weight[unit] = 6.0 * d
        mlp.up_proj.weight[unit] = 6.0 * d
        mlp.down_proj.weight[:, unit] = 0.0
        mlp.down_proj.weight[ch, unit] = 60.0
    return m


def _sources(k):
    """Causal-LM batches; from LLAMA_AT a second source whose tokenizer adds BOS."""
    x = _ids(k % 3)
    if k >= LLAMA_AT:
        x[:, 0] = BOS
    return {"input_ids": x, "labels": x}


def test_llama_massive_activation_on_bos_overflows_down_proj_when_bos_first_appears(tmp_path):
    m = llama()
    seen = []
    h = _peaks(m.get_submodule(DOWN), seen)
    try:
        r = _train(m, _sources, 11, tmp_path / "run", snap_at=LLAMA_AT)
    finally:
        h.remove()
    # truth: before BOS every down_proj output < 0.3 x fp16 max; with it the input (gated product) is finite and the
    # output is inf; the next steps with BOS fail again (every BOS batch)
    assert all(o < 0.3 * FP16_MAX for _, o in seen[:LLAMA_AT]), seen[:LLAMA_AT]
    assert math.isfinite(seen[LLAMA_AT][0]) and seen[LLAMA_AT][1] == math.inf, seen[LLAMA_AT]
    assert r["first"] == (DOWN, LLAMA_AT), r["first"]
    _failed_at(r, LLAMA_AT)
    loss32, (in32, out32) = _fp32(llama, r["sd"], _sources(LLAMA_AT), watch_module=DOWN)
    assert math.isfinite(loss32) and in32 < FP16_MAX < out32 < 1e7, (loss32, in32, out32)
    named(r["rep"], "overflow", DOWN, LLAMA_AT, "forward")
    no_error_at(r["rep"], {"model.layers.1.mlp", "model.layers.1", "model.norm", "lm_head"})


# ======================================================================================================================
# 5. ELECTRA NER: the user's -1e9 fp16 mask and the empty rows that pad the epoch's last batch
# ======================================================================================================================
ELECTRA_AT = 7
SELF_ATT = "electra.encoder.layer.0.attention.self"


def electra():
    torch.manual_seed(0)
    return T.ElectraForTokenClassification(T.ElectraConfig(
        vocab_size=128, embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager"))


def _ner(dtype=F16):
    """8 x 16 tokens, two rows padded; at ELECTRA_AT the last batch, its rows 6-7 empty (mask 0, labels -100). The
    mask: the user's `(1 - am[:, None, None, :].to(dtype)) * -1e9`."""
    def batch(k):
        g = gen(k % 3)
        x = torch.randint(3, 128, (8, 16), generator=g)
        am = torch.ones(8, 16, dtype=torch.long)
        am[1, 10:] = 0
        am[5, 12:] = 0
        labels = torch.randint(0, 5, (8, 16), generator=g)
        if k == ELECTRA_AT:
            am[6:] = 0
            x[6:] = 0
        labels[am == 0] = -100
        return {"input_ids": x, "attention_mask": (1.0 - am[:, None, None, :].to(dtype)) * -1e9, "labels": labels}
    return batch


def test_electra_minus_1e9_fp16_mask_nans_the_empty_rows_and_only_the_gradients_show_it(tmp_path):
    batch = _ner()
    mask = batch(0)["attention_mask"]
    assert mask.dtype == F16 and bool(torch.isneginf(mask).any())              # -1e9 is -inf in fp16 from step 0
    assert not bool(torch.isneginf(mask).all(-1).any())                         # ... but every row keeps a key
    assert bool(torch.isneginf(batch(ELECTRA_AT)["attention_mask"][6:]).all())
    m = electra()
    r = _train(m, batch, 11, tmp_path / "run", lr=1e-3, oracle=MaskProducer, snap_at=ELECTRA_AT)
    # truth: the NaN is made in layer 0's self-attention at ELECTRA_AT; the loss stays finite (the NaN rows are
    # ignored), the scaler skips that step only (the NaN reaches the gradients)
    assert r["first"] == (SELF_ATT, ELECTRA_AT), r["first"]
    assert all(map(math.isfinite, r["losses"])), r["losses"]
    assert r["skipped"] == [ELECTRA_AT], r["skipped"]
    loss32, _ = _fp32(electra, r["sd"], _ner(torch.float32)(ELECTRA_AT))
    assert math.isfinite(loss32), loss32
    f = named(r["rep"], ("nan_origin", "mask_value_overflow"), (SELF_ATT, "", None), ELECTRA_AT)
    if f.rule == "nan_origin" and f.module != SELF_ATT:
        raise WrongAnswer(f"top3={top3(r['rep'])}; nan_origin not at the producer: {f.one_line()}")
    no_error_at(r["rep"], {"electra.encoder.layer.0.attention.output.dense", "electra.encoder.layer.0.attention",
                           "classifier"})


# ======================================================================================================================
# 6 / H2. WavLM CTC: an utterance with more labels than frames
# ======================================================================================================================
CTC_AT = 7


def wavlm(zero_inf=False):
    torch.manual_seed(0)
    return T.WavLMForCTC(T.WavLMConfig(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), feat_extract_norm="group",
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, do_stable_layer_norm=False, pad_token_id=0,
        ctc_loss_reduction="mean", ctc_zero_infinity=zero_inf, layerdrop=0.0, mask_time_prob=0.0, num_buckets=32,
        max_bucket_distance=64, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0))


def _utterances(k):
    """4 clips of 800 samples (79 frames), 6 labels each padded with -100 to 90; at CTC_AT clip 2 carries 90 labels."""
    g = gen(k % 3)
    x = torch.randn(4, 800, generator=g)
    labels = torch.full((4, 90), -100, dtype=torch.long)
    labels[:, :6] = torch.randint(1, 16, (4, 6), generator=g)
    if k == CTC_AT:
        labels[2] = torch.randint(1, 16, (90,), generator=g)
    return {"input_values": x, "labels": labels}


def test_wavlm_ctc_utterance_with_more_labels_than_frames_is_an_inf_loss_at_the_root(tmp_path):
    m = wavlm()
    frames = int(m._get_feat_extract_output_lengths(torch.tensor(800)))
    assert frames == 79 and int((_utterances(CTC_AT)["labels"][2] >= 0).sum()) == 90 > frames
    r = _train(m, _utterances, 11, tmp_path / "run", lr=1e-3, snap_at=CTC_AT)
    assert r["first"] == ("", CTC_AT), r["first"]
    assert r["losses"][CTC_AT] == math.inf, r["losses"]
    _failed_at(r, CTC_AT)
    loss32, _ = _fp32(wavlm, r["sd"], _utterances(CTC_AT))
    assert loss32 == math.inf, loss32               # a data failure: float32 has no alignment either
    named(r["rep"], "overflow", "", CTC_AT, "forward")
    no_error_at(r["rep"], {"lm_head", "wavlm.encoder", "wavlm"})


def test_healthy_wavlm_ctc_with_zero_infinity_is_quiet(tmp_path):
    r = _train(wavlm(zero_inf=True), _utterances, 11, tmp_path / "run", lr=1e-3)
    ls = r["losses"]
    # truth: every loss finite (the infeasible clip zeroed; the step-CTC_AT batch gives 3 real losses and a 0), no
    # module ever produced a non-finite forward output, the loss falls; the skips are the scaler's first backoffs and
    # at most one later backward backoff at a scale it had applied before
    assert all(map(math.isfinite, ls)) and r["first"] is None, (ls, r["first"])
    late = [s for s in r["skipped"] if s >= 3]
    assert len(late) <= 1 and all(r["scales"][s] in r["scales"][:s] for s in late), (r["skipped"], r["scales"])
    assert sum(ls[-3:]) < sum(ls[:3]), ls
    quiet(r["rep"])


# ======================================================================================================================
# 7. DistilBERT QA: every answer of a batch past the window -> clamped to ignored_index -> 0/0
# ======================================================================================================================
QA_AT = 6


def dbqa():
    torch.manual_seed(0)
    return T.DistilBertForQuestionAnswering(T.DistilBertConfig(
        vocab_size=128, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, qa_dropout=0.0))


def _squad(k):
    """8 windows of 32 tokens, answers inside; at QA_AT every answer lies past the window (positions 50-70)."""
    g = gen(k % 3)
    x = torch.randint(3, 128, (8, 32), generator=g)
    s = torch.randint(10, 28, (8,), generator=g)
    e = s + torch.randint(0, 4, (8,), generator=g)
    if k == QA_AT:
        s, e = s + 40, e + 40
    return {"input_ids": x, "start_positions": s, "end_positions": e}


def test_distilbert_qa_batch_with_every_answer_past_the_window_is_a_nan_loss_at_the_root(tmp_path):
    b = _squad(QA_AT)
    assert int(b["start_positions"].min()) >= 32
    m = dbqa()
    grads = {}

    def note(k, m):
        if k == QA_AT + 1:      # the gradients step QA_AT left behind
            grads["qa"] = m.qa_outputs.weight.grad.detach().clone()
    r = _train(m, _squad, 10, tmp_path / "run", lr=1e-3, inject=note, snap_at=QA_AT)
    # truth: the root's forward (its loss) makes NaN from finite logits; the gradients are zero, not NaN, so the
    # scaler does not skip; every other loss finite
    assert r["first"] == ("", QA_AT), r["first"]
    assert r["bad_loss"] == [QA_AT] and math.isnan(r["losses"][QA_AT]), r["losses"]
    assert all(s < 3 for s in r["skipped"]), r["skipped"]
    assert bool((grads["qa"] == 0).all()), grads["qa"].abs().max()
    loss32, _ = _fp32(dbqa, r["sd"], b)
    assert math.isnan(loss32), loss32                # a data failure: float32 divides 0 by 0 too
    named(r["rep"], "nan_origin", ROOT, QA_AT, "forward")
    no_error_at(r["rep"], {"qa_outputs", "distilbert", "distilbert.transformer"})


# ======================================================================================================================
# 8. Qwen2: an eval callback's model.half() at step 6 leaves the optimizer stepping fp16 parameters
# ======================================================================================================================
HALF_AT = 6


def qwen2():
    torch.manual_seed(0)
    return T.Qwen2ForCausalLM(T.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _lm(k):
    x = _ids(k % 3)
    return {"input_ids": x, "labels": x}


@pytest.mark.parametrize("scaler", [
    pytest.param(True, id="gradscaler"),
    pytest.param(False, id="autocast-only"),
])
def test_qwen2_eval_callback_half_leaves_the_optimizer_with_fp16_parameters(scaler, tmp_path):
    m = qwen2()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    done, err = [], None
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
    try:
        with w:
            for k in range(10):
                if k == HALF_AT:                          # the eval callback
                    m.eval()
                    m.half()
                    with torch.no_grad():
                        m(**_lm(99))
                    m.train()
                b = _lm(k)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=F16):
                    loss = m(**b).loss
                if sc is not None:
                    sc.scale(loss).backward()
                    sc.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                    sc.step(opt)
                    sc.update()
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                    opt.step()
                done.append(k)
    except (ValueError, RuntimeError) as e:
        err = e
    # truth: steps 0-5 ran; at HALF_AT every parameter the optimizer holds is fp16 (the same Parameter objects) and
    # the step raised for it: GradScaler refuses fp16 gradients, AdamW its fp32 moments against fp16 gradients
    assert done == list(range(HALF_AT)), done
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in m.parameters()} and all(p.dtype == F16 for p in held)
    if scaler:
        assert isinstance(err, ValueError) and "unscale FP16 gradients" in str(err), err
    else:
        assert isinstance(err, RuntimeError) and "Half" in str(err), err
        assert any("adam" in fr.filename for fr in traceback.extract_tb(err.__traceback__)), err
    rep = w.report()
    assert rep.summary.get("crash") and rep.summary["crash"]["step"] == HALF_AT, rep.summary.get("crash")
    named(rep, "fp16_master_weights", ROOT, HALF_AT)
