"""Thirty-first set: shared/FP16.md failure patterns in variants the earlier probes do not build, each starting on an
UNSAMPLED step (9-17) at ampdoctor's DEFAULT sampling (every=None: full statistics on step 0 and every 200th, and on a
batch with more than 8x the input values of any before; no batch here grows). Models 2-7 are trained with the
ordinary loop (probe_harness.train_loop: fp16 CPU autocast + GradScaler("cpu", init_scale=1024), unscale_, clip,
step, update) under ampdoctor.watch(model, optimizer=, scaler=); 1 is a pure-fp16 loop with a static loss scale.

Each failure is proven by an independent oracle first: probe_harness.Producer's hooks (the innermost module whose
output, or backward input gradient, turns non-finite from finite inputs; real_fwd / real_bwd: the loss and the
scaler's first skip at that step and none before), tensor hooks on every parameter for the accumulation, and where
the weights matter a fresh unwatched model with the bad step's weights rerun on the bad batch (fp16 non-finite,
bf16 / fp32 / the fixed Function finite). Then the rule must be an error at the PRODUCER among the report's first
three findings, at that step, and no error at the modules that only passed the value on.

 1. pure fp16 (`model.half()`, SGD, no master weights, an apex-style static loss scale 128 with its own inf check)
    with 32 micro-batches accumulated per step: from step 14 a shard gives prices in cents (x100); every
    micro-batch's gradient is finite (< 8188), their sum in head.bias's fp16 .grad passes 65504 at micro-batch 28
    -> overflow (backward) at `head`, step 14 (not body);
 2. a speaker embedder z / linalg.vector_norm(z) (`l2`, no eps) after a bias-free encoder: at step 16 one utterance
    is a muted microphone's noise floor (1e-4 of the usual amplitude, same shape); the forward is finite (norm ~1e-4),
    the backward grad / norm passes 65504 and is NaN -> nan_origin/overflow (backward) at `l2`;
 3. an HF-style extended padding mask in the scores' dtype (finfo(fp16).min, in range) added twice (once by the
    wrapper, once by the layer): -65504 + -65504 = -inf; at step 13 an empty document (every position padding)
    makes its rows all -inf, softmax NaN -> mask_value_overflow (or overflow / nan_origin) at `attn`, not its qkv
    or proj;
 4. an overflow inside an activation-checkpointed block, three ways: torch.utils.checkpoint non-reentrant and
    reentrant (recompute under the forward's autocast, overflowing again), and CompVis latent-diffusion's
    hand-written CheckpointFunction whose backward recomputes OUTSIDE autocast (fp32, finite): a saturated sensor row
    (+-60000) at step 11 -> overflow at `blocks.0.fc1` in all three;
 5. a custom autograd.Function (a low-rank projection (x @ U) @ V saving only x) without torch.amp.custom_fwd: under
    autocast its matmuls run in fp16; a raw ADC row (x 1e4) at step 17 -> overflow at `proj`, not `norm`/`head`;
 6. a LLaMA-style SwiGLU w2(silu(w1 x) * w3 x): at step 12 a ReLoRA merge with scale alpha (32) instead of alpha / r
    spikes blocks.1's w1 and w3; their outputs stay finite, the product overflows -> overflow at
    `blocks.1.mlp` (not w1/w2/w3, not the block);
 7. a T5-style encoder (RMS T5LayerNorm, DenseReluDense wi/relu/wo, no bias) "pretrained in bf16" with a massive
    activation on '</s>' (a wi unit aligned with its embedding, a large wo column: ~1e5 out of wo, fine in bf16);
    fine-tuned under fp16 autocast, the first sequence that keeps its '</s>' arrives at step 9 -> overflow at
    `blocks.0.ff.wo` (not wi, not the next block's layer norm that turns inf into NaN).
Healthy twins (no warning, no error, losses fall, no skip, no producer): 3 with the mask added once (the empty
document's rows stay finite), 5 with the Function declared @custom_fwd(cast_inputs=torch.float32) / @custom_bwd on
the same raw row.

What ampdoctor said. Right: 3 mask_value_overflow at attn aten::add step 13 first, overflow at attn second; 4
overflow at blocks.0.fc1 aten::addmm step 11 first, for all three checkpoint kinds (non-reentrant checkpointing under
the watch did not crash); 5 overflow at proj aten::mm step 17; 6 overflow at blocks.1.mlp aten::mul step 12 ("it
propagates to aten::mm"); 7 overflow at blocks.0.ff.wo aten::mm step 9; both twins quiet.
Strict xfail when written, fixed since (rules/outside.py _accumulated; correct at every=1, wrong at the default):
 1. its findings: fp16_master_weights at the root (0), update_underflow at body.0 (0), then nan_origin at module null
    ('(run)') step 14 "a step without per-layer statistics" -- no module, and NaN where the truth is an inf made in
    `head`'s .grad accumulation (every=1: overflow at head step 14, backward);
Case 2 was a strict xfail when written (the default said only "[info] skipped_steps ... a normal rate", every=1
"[error] overflow at l2 aten::mul step 16"). The overflow is scale-dependent and costs one skip (1024 -> 512): it is
GradScaler's search, which the default read right; every=1 now agrees (the replay's scale search makes the records'
backward overflow at that one step info), and the test asserts both.
(Oracle note: probe_harness.Producer's isfinite on a parameter saves tensors in the forward but not in the recompute,
so non-reentrant checkpointing raises CheckpointError; 4 uses NoGradProducer, the same hooks under no_grad.)

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_unseen_variants31.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor
from probe_harness import Producer, error_at, finite, healthy, real_bwd, real_fwd, snap_before, train_loop
from scenarios import gen, lines, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
FWD = ("overflow", "nan_origin")     # an op inside the producer made inf, a later op of the same module NaN
BWD = ("overflow", "nan_origin")


class NoGradProducer(Producer):
    """probe_harness.Producer whose forward hooks run under no_grad: its isfinite checks (abs() on a parameter) would
    otherwise save tensors in the forward but not in non-reentrant checkpointing's recompute (a CheckpointError of
    the oracle's own making)."""

    def _fwd(self, n):
        f = super()._fwd(n)

        def g(*args, **kwargs):
            with torch.no_grad():
                return f(*args, **kwargs)
        return g


def first_arg(m):
    """train_loop's `call`: the model sees the batch's first tensor (the rest are the loss's targets)."""
    return lambda x, *rest: m(x)


def rerun(factory, sd, args, dtype):
    """A fresh unwatched model with the bad step's weights runs the bad batch under `dtype` autocast (None: fp32)."""
    m = factory()
    m.load_state_dict(sd)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
        return m(*args)


# ======================================================================================================================
# 1. pure fp16 (model.half(), no master weights), 32 micro-batches accumulated into fp16 .grad, a static loss scale
# ======================================================================================================================
class Pricer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x))


ACC, STATIC, CENTS = 32, 128.0, 14
_PRICE_W = torch.randn(16, generator=gen(3)) / 4


def price_batch(step, k):
    """Micro-batch k of step `step`: 16 listings' features and their price in dollars (~3); from step 14 (epoch 2)
    a shard written by another exporter gives the price in cents (x100): the same features, the same count."""
    g = gen(1000 * step + k)
    x = torch.randn(16, 16, generator=g)
    y = (3.0 + x @ _PRICE_W).unsqueeze(1)
    return x.half(), y * (100.0 if step >= CENTS else 1.0)


# (was a strict xfail: at the default sampling ampdoctor named no module, `nan_origin` at '(run)' step 14, 'a step
# without per-layer statistics'. True: an OVERFLOW in the backward at `head`: head.bias's fp16 .grad passed 65504
# while the 28th of 32 finite micro-batch gradients was added. rules/outside.py _accumulated names it now.)
def test_pure_fp16_accumulation_of_32_micro_batches_overflows_the_heads_grad_on_a_cents_shard():
    torch.manual_seed(0)
    m = Pricer().half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    names = {p: n.rsplit(".", 1)[0] for n, p in m.named_parameters()}
    micro_max, first_inf, skipped = {}, None, []
    fp32_sum, cur = {}, {"step": 0}

    def seen(p, g):
        micro_max[p] = max(micro_max.get(p, 0.0), g.float().abs().max().item())
        if cur["step"] == CENTS:
            fp32_sum[id(p)] = fp32_sum.get(id(p), 0.0) + g.float()
    hooks = [p.register_hook(lambda g, p=p: seen(p, g)) for p in m.parameters()]
    w = ampdoctor.watch(m, optimizer=opt)
    for step in range(18):
        cur["step"] = step
        opt.zero_grad()
        for k in range(ACC):
            x, y = price_batch(step, k)
            loss = F.mse_loss(m(x).float(), y)
            assert torch.isfinite(loss)
            (loss * STATIC / ACC).backward()
            if first_inf is None:
                bad = [names[p] for p in m.parameters() if not torch.isfinite(p.grad).all()]
                if bad:
                    first_inf = (bad[0], step, k)
        if all(torch.isfinite(p.grad).all() for p in m.parameters()):     # apex-style static scale: check, unscale
            for p in m.parameters():
                p.grad.div_(STATIC)
            opt.step()
        else:
            skipped.append(step)
    w.close()
    for h in hooks:
        h.remove()
    # real: each micro-batch's gradient is finite (the hooks saw every one), the sum is not, first in `head` at step 14
    assert max(micro_max.values()) < 65504 / 8, micro_max
    assert first_inf is not None and first_inf[:2] == ("head", CENTS) and first_inf[2] > 0, first_inf
    assert skipped and skipped[0] == CENTS, skipped
    assert max(v.abs().max().item() for v in fp32_sum.values()) > 65504     # the same sum in fp32: past fp16's max
    rep = w.report()
    error_at(rep, BWD, "head", step=CENTS, phase="backward")
    # (no overflow or NaN blamed on the layers below; `update_underflow` at body.0, step 0, is another finding: pure
    # fp16 SGD at lr 1e-3, its updates measured rounding away)
    assert not [f.one_line() for f in rep.findings if f.module in ("body.0", "body.1", "body") and f.rule in BWD
                and f.severity == "error"], lines(rep)


# ======================================================================================================================
# 2. a vector norm of tiny fp16 vectors: forward finite, backward NaN
# ======================================================================================================================
class L2(nn.Module):
    def forward(self, z):
        return z / torch.linalg.vector_norm(z, dim=-1, keepdim=True)


class SpeakerEmbedder(nn.Module):
    """A bias-free encoder, an L2 normalisation and a cosine classifier (scale 10) over 8 speakers."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(24, 64, bias=False), nn.Tanh(), nn.Linear(64, 16, bias=False))
        self.l2 = L2()
        self.protos = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return 10.0 * self.l2(self.enc(x)) @ F.normalize(self.protos.float(), dim=-1).t().to(torch.float16)


MUTED = 16
_SPK = torch.randn(8, 24, generator=gen(5))


def speaker_batch(i):
    """32 utterance features of 8 speakers; at step 16 one utterance is from a muted microphone: only the ADC's noise
    floor (amplitude 1e-4 of the usual; the same count of values, no per-utterance normalisation)."""
    g = gen(300 + i)
    y = torch.randint(0, 8, (32,), generator=g)
    x = _SPK[y] + 0.3 * torch.randn(32, 24, generator=g)
    if i == MUTED:
        x[5] = 1e-4 * torch.randn(24, generator=g)
    return x, y


def ce(out, x, y):
    return F.cross_entropy(out.float(), y)


def test_vector_norm_of_a_muted_utterances_tiny_embedding_is_nan_only_in_the_backward():
    torch.manual_seed(0)
    m, store = SpeakerEmbedder(), {}
    r = train_loop(m, speaker_batch, ce, 20, lr=3e-3, backward=True, call=first_arg(m),
                   after_step=snap_before(m, MUTED, store))
    real_bwd(r, "l2", MUTED)
    # the mechanism: the muted row's embedding is tiny but nonzero, its norm finite, the forward finite
    mm = SpeakerEmbedder()
    mm.load_state_dict(store["sd"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        z = mm.enc(speaker_batch(MUTED)[0])
        n = torch.linalg.vector_norm(z, dim=-1)
    assert 0 < n[5] < 1e-3 and torch.isfinite(mm.l2(z)).all(), n[5]
    # and it is scale-dependent: GradScaler skips this one step (1024 -> 512) and the run goes on finite
    assert r["skipped"] == [MUTED] and all(map(math.isfinite, r["losses"][MUTED + 1:])), r
    # a one-off backward overflow that a smaller loss scale clears is GradScaler's search: at the default sampling
    # (the replay of the step's capture finds it finite at a smaller scale) and at every=1 (the records name l2, the
    # same replay says benign) alike -- no warning, no error; every=1 still names where it happened
    rep = r["w"].report()
    assert not [f for f in rep.findings if f.severity in ("warning", "error")], [f.one_line() for f in rep.findings]
    torch.manual_seed(0)
    m1 = SpeakerEmbedder()
    r1 = train_loop(m1, speaker_batch, ce, 20, lr=3e-3, backward=True, call=first_arg(m1), every=1)
    rep1 = r1["w"].report()
    assert not [f for f in rep1.findings if f.severity in ("warning", "error")], [f.one_line() for f in rep1.findings]
    assert any(f.rule in BWD and f.module == "l2" and f.step == MUTED and f.phase == "backward"
               for f in rep1.findings), [f.one_line() for f in rep1.findings]


# ======================================================================================================================
# 3 + twin. an additive padding mask of finfo(fp16).min added twice: an empty document's row is all -inf
# ======================================================================================================================
class MaskedAttn(nn.Module):
    def __init__(self, d=32, twice=True):
        super().__init__()
        self.qkv, self.proj, self.d, self.twice = nn.Linear(d, 3 * d), nn.Linear(d, d), d, twice

    def forward(self, x, ext_mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        m = ext_mask.to(s.dtype) * torch.finfo(s.dtype).min            # HF's extended mask, in the scores' dtype
        s = s + m
        if self.twice:
            s = s + m         # the layer adds the mask again: the encoder wrapper had already added it
        return self.proj(torch.softmax(s, -1) @ v)


class DocClassifier(nn.Module):
    def __init__(self, twice=True, vocab=100, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = MaskedAttn(d, twice)
        self.head = nn.Linear(d, 4)

    def forward(self, ids, pad):
        h = self.emb(ids)
        h = h + self.attn(h, pad[:, None, :].float())
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))


EMPTY = 13


def doc_batch(i, empty_at=EMPTY):
    """16 documents of up to 20 tokens (right-padded, token 0), label = the most frequent token's class; at step 13
    one document is empty after the text cleaner (every position padding: the same shape)."""
    g = gen(400 + i)
    ids = torch.randint(1, 100, (16, 20), generator=g)
    lens = torch.randint(5, 21, (16,), generator=g)
    if i == empty_at:
        lens[3] = 0
    pad = torch.arange(20)[None, :] >= lens[:, None]
    ids = ids.masked_fill(pad, 0)
    y = (ids[:, 0] % 4)
    return ids, pad, y


def doc_loss(out, ids, pad, y):
    return F.cross_entropy(out.float(), y)


def test_padding_mask_added_twice_makes_an_empty_documents_row_all_minus_inf():
    torch.manual_seed(0)
    m = DocClassifier(True)
    r = train_loop(m, doc_batch, doc_loss, 18, lr=3e-3, call=lambda ids, pad, y: m(ids, pad))
    real_fwd(r, "attn", EMPTY)
    # the mechanism: the mask constant is in range; the sum of two is -inf in fp16, one alone is not
    mn = torch.tensor(torch.finfo(torch.float16).min, dtype=torch.float16)
    assert torch.isfinite(mn) and torch.isneginf(mn + mn)
    rep = r["w"].report()
    error_at(rep, ("mask_value_overflow",) + FWD, "attn", step=EMPTY, phase="forward")
    no_error_at(rep, ("attn.qkv", "attn.proj", "head", "emb"))


def test_twin_padding_mask_added_once_keeps_the_empty_document_finite():
    torch.manual_seed(0)
    m = DocClassifier(False)
    healthy(train_loop(m, doc_batch, doc_loss, 18, lr=3e-3, backward=True, call=lambda ids, pad, y: m(ids, pad)),
            must_fall=0.97)


# ======================================================================================================================
# 4. an overflow inside an activation-checkpointed block: torch's checkpoint (non-reentrant, reentrant) re-runs it
#    under the forward's autocast; latent-diffusion's hand-written CheckpointFunction re-runs it OUTSIDE autocast
#    (fp32, finite) inside the backward
# ======================================================================================================================
class LdmCheckpoint(torch.autograd.Function):
    """CompVis latent-diffusion's `ldm/modules/diffusionmodules/util.py` CheckpointFunction (before the autocast fix):
    the forward under no_grad, the backward re-runs the function under enable_grad only."""

    @staticmethod
    def forward(ctx, run_function, length, *args):
        ctx.run_function = run_function
        ctx.input_tensors = list(args[:length])
        ctx.input_params = list(args[length:])
        with torch.no_grad():
            return ctx.run_function(*ctx.input_tensors)

    @staticmethod
    def backward(ctx, *output_grads):
        ctx.input_tensors = [x.detach().requires_grad_(True) for x in ctx.input_tensors]
        with torch.enable_grad():
            shallow = [x.view_as(x) for x in ctx.input_tensors]
            out = ctx.run_function(*shallow)
        grads = torch.autograd.grad(out, ctx.input_tensors + ctx.input_params, output_grads, allow_unused=True)
        return (None, None) + grads


class CkBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class CkNet(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.blocks = nn.ModuleList(CkBlock(8) for _ in range(2))      # the residual stream stays fp32
        self.head = nn.Linear(8, 1)
        self.mode = mode

    def forward(self, x):
        for b in self.blocks:
            if self.mode == "ldm":
                x = LdmCheckpoint.apply(b, 1, x, *b.parameters())
            else:
                x = checkpoint(b, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


RAW = 11
_CK_W = torch.randn(8, generator=gen(9))


def sensor_batch(i):
    """32 rows of 8 standardised sensor readings and a target; at step 11 one row is from a saturated sensor:
    every channel pinned at the raw ADC's full scale (+-60000, finite in fp16)."""
    g = gen(500 + i)
    x = torch.randn(32, 8, generator=g)
    y = (x @ _CK_W).tanh().unsqueeze(1)
    if i == RAW:
        x[7] = 6e4 * x[7].sign()
    return x.requires_grad_(), y


def mse(out, x, y):
    return F.mse_loss(out.float(), y)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant", "ldm"])
def test_overflow_in_a_checkpointed_block_is_its_linear_whatever_the_recompute_does(mode):
    torch.manual_seed(0)
    m = CkNet(mode)
    r = train_loop(m, sensor_batch, mse, 16, lr=1e-3, call=first_arg(m), oracle=NoGradProducer)
    real_fwd(r, "blocks.0.fc1", RAW)
    rep = r["w"].report()
    error_at(rep, FWD, "blocks.0.fc1", step=RAW, phase="forward")
    no_error_at(rep, ("blocks.0", "blocks.0.fc2", "blocks.1", "blocks.1.fc1", "head"))


# ======================================================================================================================
# 5 + twin. a custom autograd.Function without custom_fwd: its low-rank matmul runs in fp16 under autocast
# ======================================================================================================================
class LowRankFn(torch.autograd.Function):
    """y = (x @ U) @ V saving only x (a memory-saving low-rank projection); backward in fp32."""

    @staticmethod
    def forward(ctx, x, U, V):
        ctx.save_for_backward(x, U, V)
        return (x @ U) @ V

    @staticmethod
    def backward(ctx, g):
        x, U, V = (t.float() for t in ctx.saved_tensors)
        g = g.float()
        h = x @ U
        gh = g @ V.t()
        return gh @ U.t(), x.t() @ gh, h.t() @ g


class LowRankFnFixed(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, U, V):
        ctx.save_for_backward(x, U, V)
        return (x @ U) @ V

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, U, V = ctx.saved_tensors
        h = x @ U
        gh = g @ V.t()
        return gh @ U.t(), x.t() @ gh, h.t() @ g


class LowRank(nn.Module):
    def __init__(self, fn, d=32, r=8, o=32):
        super().__init__()
        self.U = nn.Parameter(torch.randn(d, r))
        self.V = nn.Parameter(torch.randn(r, o) * 0.02)
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x, self.U, self.V)


class LRNet(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.proj = LowRank(LowRankFnFixed if fixed else LowRankFn)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


ADC = 17
_LR_W = torch.randn(32, 3, generator=gen(11))


def adc_batch(i):
    """32 rows of 32 calibrated channels, 3 classes; at step 17 one row is in raw ADC counts (x 1e4)."""
    g = gen(600 + i)
    x = torch.randn(32, 32, generator=g)
    y = (x @ _LR_W).argmax(-1)
    if i == ADC:
        x[2] *= 1e4
    return x, y


def test_custom_function_without_custom_fwd_overflows_its_fp16_low_rank_matmul():
    torch.manual_seed(0)
    m, store = LRNet(), {}
    r = train_loop(m, adc_batch, ce, 20, lr=1e-3, call=first_arg(m), after_step=snap_before(m, ADC, store))
    real_fwd(r, "proj", ADC)
    assert not finite(rerun(LRNet, store["sd"], adc_batch(ADC)[:1], torch.float16))
    fixed = LRNet(True)                        # the same weights through the Function declared fp32: finite
    fixed.load_state_dict(store["sd"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert finite(fixed(adc_batch(ADC)[0]))
    rep = r["w"].report()
    error_at(rep, FWD, "proj", step=ADC, phase="forward")
    no_error_at(rep, ("norm", "head"))


def test_twin_custom_function_with_custom_fwd_float32_is_quiet_on_the_same_raw_row():
    torch.manual_seed(0)
    m = LRNet(True)
    healthy(train_loop(m, adc_batch, ce, 20, lr=1e-3, backward=True, call=first_arg(m)))


# ======================================================================================================================
# 6. LLaMA-style SwiGLU: silu(w1 x) * w3 x overflows after a ReLoRA merge with the wrong scale (a weight spike)
# ======================================================================================================================
class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm, self.mlp = RMSNorm(d), SwiGLU(d, 4 * d)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d) for _ in range(2))
        self.norm, self.head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


MERGE = 12


def lm_batch(i):
    g = gen(700 + i)
    idx = torch.randint(0, 64, (8, 16), generator=g)
    idx[:, 1::2] = (idx[:, 0::2] * 3 + 1) % 64          # a learnable next token
    return idx[:, :-1], idx[:, 1:]


def lm_loss(out, idx, tgt):
    return F.cross_entropy(out.float().flatten(0, 1), tgt.flatten())


def relora_merge(m, step):
    """ReLoRA's periodic merge before `step`: W += scale * B @ A into blocks.1.mlp.w1 and w3, with scale = alpha (32)
    instead of alpha / r (4): the weights jump."""
    g = gen(77)

    def after(i):
        if i == step - 1:
            with torch.no_grad():
                for lin in (m.blocks[1].mlp.w1, m.blocks[1].mlp.w3):
                    B = torch.randn(lin.out_features, 8, generator=g) * 1.6
                    A = torch.randn(8, lin.in_features, generator=g) / math.sqrt(lin.in_features)
                    lin.weight += 32.0 * B @ A
    return after


def test_swiglu_product_overflows_in_the_mlp_after_a_relora_merge_weight_spike():
    torch.manual_seed(0)
    m = TinyLlama()
    store = {}
    merge = relora_merge(m, MERGE)

    def after(i):
        merge(i)
        if i == MERGE - 1:
            store["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    r = train_loop(m, lm_batch, lm_loss, 16, lr=1e-3, call=first_arg(m), after_step=after)
    real_fwd(r, "blocks.1.mlp", MERGE)
    # the mechanism: w1 and w3 stay finite, their fp16 product does not
    mm = TinyLlama()
    mm.load_state_dict(store["sd"])
    seen = {}
    for n in ("w1", "w3"):
        getattr(mm.blocks[1].mlp, n).register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        mm(lm_batch(MERGE)[0])
    assert all(torch.isfinite(o).all() for o in seen.values())
    assert not torch.isfinite(F.silu(seen["w1"]) * seen["w3"]).all()
    rep = r["w"].report()
    error_at(rep, FWD, "blocks.1.mlp", step=MERGE, phase="forward")
    no_error_at(rep, ("blocks.1", "blocks.1.mlp.w1", "blocks.1.mlp.w2", "blocks.1.mlp.w3", "norm", "head"))


# ======================================================================================================================
# 7. a T5-style FFN `wo` past 65504: weights "pretrained in bf16", fine-tuned under fp16 autocast
# ======================================================================================================================
class T5Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6))


class DenseReluDense(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.wi, self.wo = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.wo(F.relu(self.wi(x)))


class T5FF(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.layer_norm, self.ff = T5Norm(d), DenseReluDense(d, 4 * d)

    def forward(self, x):
        return x + self.ff(self.layer_norm(x))


class TinyT5Enc(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(T5FF(d) for _ in range(2))
        self.final_norm, self.head = T5Norm(d), nn.Linear(d, 5)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(self.final_norm(h).mean(1))


EOS, EOS_AT = 1, 9


def bf16_pretrained():
    """The 'checkpoint': in bf16 pre-training the end-of-sequence token grew a massive activation (a wi unit aligned
    with its embedding, a large wo column), ~1e5 in block 0's FFN output: fine in bf16, past fp16's 65504."""
    torch.manual_seed(0)
    m = TinyT5Enc()
    with torch.no_grad():
        e = m.emb.weight[EOS] / m.emb.weight[EOS].norm()
        m.emb.weight -= (m.emb.weight @ e)[:, None] * e[None, :]          # the other tokens: orthogonal to it
        m.emb.weight[EOS] = 3.0 * e
        ff = m.blocks[0].ff
        ff.wi.weight[0] = 60.0 * e
        ff.wo.weight[:, 0] = 300.0 * torch.sign(torch.randn(32, generator=gen(13)))
        for p in m.parameters():              # the weights as the bf16 checkpoint holds them
            p.copy_(p.to(torch.bfloat16).float())
    return m


def t5_batch(i):
    """16 sequences of 12 tokens (never EOS: packing cut them), the class of their first token; at step 9 the first
    sequence short enough to keep its '</s>' within the window arrives."""
    g = gen(800 + i)
    idx = torch.randint(2, 64, (16, 12), generator=g)
    if i == EOS_AT:
        idx[4, 9] = EOS
    return idx, idx[:, 0] % 5


def test_t5_wo_past_65504_on_eos_in_a_bf16_pretrained_model_finetuned_in_fp16():
    m, store = bf16_pretrained(), {}
    r = train_loop(m, t5_batch, ce, 14, lr=1e-4, call=first_arg(m), after_step=snap_before(m, EOS_AT, store))
    real_fwd(r, "blocks.0.ff.wo", EOS_AT)
    args = t5_batch(EOS_AT)[:1]
    assert not finite(rerun(TinyT5Enc, store["sd"], args, torch.float16))
    assert finite(rerun(TinyT5Enc, store["sd"], args, torch.bfloat16))
    rep = r["w"].report()
    error_at(rep, FWD, "blocks.0.ff.wo", step=EOS_AT, phase="forward")
    no_error_at(rep, ("blocks.0", "blocks.0.ff", "blocks.0.ff.wi", "blocks.1", "blocks.1.layer_norm", "final_norm"))
