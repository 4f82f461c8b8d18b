"""Twenty-seventh set: fp16 failures inside the building blocks of modern architectures, written by hand as users write
them (not from transformers): RMSNorm, SwiGLU, attention, a top-k MoE router, rotary embeddings, an encoder-decoder's
cross-attention, a growing residual stream, QK-norm. Each is a tiny model trained with the ordinary loop
(probe_harness.train_loop: fp16 CPU autocast + GradScaler("cpu"), unscale_, clip, step, update) under
ampdoctor.watch at its DEFAULT sampling, the failure starting at step 4 through the data.

 1. a sensor forecaster (pre-norm blocks) whose RMSNorm computes x.pow(2).mean() in fp16 (no upcast; the fp32 gain
    promotes the output to fp32): from step 4 a new site's sensor is not standardised (x1000); the variance is inf in
    blocks.0.norm1, x * rsqrt(inf) = 0 silently zeroes that window (no inf/NaN anywhere, no skip) -> overflow at
    `blocks.0.norm1`, step 4 (default and every=1);
 2. SwiGLU (one fused w12, w3(silu(a) * b)) in a pre-norm block whose MLP-branch norm was forgotten: one raw window
    at step 4; w12 stays finite, the product in `blocks.0.mlp`'s own forward overflows -> `blocks.0.mlp`;
 3. post-norm blocks whose attention forgot the 1/sqrt(d) scale: q @ k^T of the raw window overflows in
    `blocks.0.attn` (q, k finite) -> `blocks.0.attn`, not its q/k projections nor norm1 (which turns inf into NaN);
 4. a recommender's top-2 MoE router with a hand-written softmax exp(l) / exp(l).sum(): at step 4 a backfilled
    partition holds watch time in raw seconds (150-550, not log1p'd); logits ~ 40 (exp is inf in fp16 past 11.09,
    finite in fp32) -> `moe.router`, not `moe.router.proj` or the experts;
 5. rotary embeddings whose angles are computed in the activations' dtype (pos.to(v.dtype) * inv_freq; HF passed
    value_states for the dtype): a streamed chunk 70,000 tokens into a book at step 4; the position is inf in fp16,
    cos(inf) = NaN -> `blocks.0.attn.rope`; and (second test) its first inf is the int -> fp16 cast, not cos;
 6. a tiny speech-to-text encoder-decoder (T5-style unscaled attention, pre-norm) whose encoder's final norm was
    forgotten: at step 4 a clip of raw int16 PCM (clipped at +-32767); the memory stays finite (< 65504 / 1.3), the
    encoder's self-attention reads normalised inputs, and only the decoder's cross-attention q @ k^T overflows ->
    `decoder.layers.0.cross_attn`, not its k projection, the encoder or the decoder block;
 7. an 8-block residual MLP without norms (He init, Fixup's scaling forgotten): the raw window (x3500) makes the
    stream's peak grow block by block (finite through blocks.5) until a late block overflows -> the oracle's
    producer in blocks.6/7 (blocks.7.fc1 here);
 8. backward only: per-head QK-norm as an fp16 RMSNorm; from step 4 right-padded batches (token 0, a zero
    embedding, bias-free projections): the pad rows of q/k are exactly 0, the forward is finite (0 * rsqrt(1e-6)),
    RsqrtBackward0's rsqrt(1e-6) ** 3 is inf in fp16 and 0 * inf = NaN -> the backward oracle's module
    (`blocks.0.attn.k_norm`), phase backward, at every loss scale.
Healthy controls (same architectures, done right; no warning, no error): the LLaMA-style LM with fp32 rotary angles
and upcast QK-norm on the same far positions and padded batches; the forecaster with upcast RMSNorm on case 1's raw
sensor.

Oracles, before anything ampdoctor says: probe_harness.Producer's forward hooks name the innermost module whose
output turns non-finite from finite inputs and parameters (2-7), its backward hooks the first module whose input
gradient is non-finite while the gradient reaching it was finite (8), with real_fwd / real_bwd (the loss and the
scaler's first skip at that step); for 1 forward pre-hooks on the working-dtype RMSNorms recompute x.pow(2).mean()
in fp16 (inf) and fp32 (finite); a fresh model on the bad batch is non-finite under fp16 autocast and finite in fp32
(2-6); each case's mechanism is measured (position 70000 in fp16, the memory's peak, the stream's growth, the
rsqrt factor). Then the report must hold the rule (overflow / nan_origin) at that module among its first three
findings, at that step and phase, with no error at the modules that only passed the value on.

What ampdoctor got wrong (strict xfail):
- 1 (default sampling): an empty report; step 4 is not sampled, and only a sampled step's statistics show the
  flushed rows. Should be overflow at blocks.0.norm1, step 4. (At every=1 it was empty too: silent_zeros took any
  "RMSNorm" for torch's own, which cannot flush; fixed, the every=1 case passes.)
- 5, second test (fixed): the replay named `nan_origin at blocks.0.attn.rope aten::cos`, while the first non-finite
  value is the +inf of rope's own int64 -> fp16 cast of the position (the op tracer read only floating inputs);
  now overflow at blocks.0.attn.rope, aten::_to_copy.
Right: 2 overflow at blocks.0.mlp aten::mul; 3 overflow at blocks.0.attn aten::bmm; 4 overflow at moe.router
aten::exp; 5 nan_origin at blocks.0.attn.rope (the module); 6 overflow at decoder.layers.0.cross_attn aten::bmm;
7 overflow at blocks.7.fc1 aten::addmm; 8 overflow at blocks.0.attn.k_norm (RsqrtBackward0) backward; all step 4,
and both controls quiet.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_unseen_variants27.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import at_top3, healthy, real_bwd, real_fwd, train_loop, xf
from scenarios import no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

BAD = ("overflow", "nan_origin")
D = 32
FP16_MAX = 65504.0


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ======================================================================================================================
# building blocks, written by hand as model repos write them
# ======================================================================================================================
class RMSNorm(nn.Module):
    """LLaMA's RMSNorm; `upcast=False`: the variance in the working dtype (x.pow(2).mean() in fp16)."""

    def __init__(self, d=D, eps=1e-6, upcast=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.upcast = eps, upcast

    def forward(self, x):
        if self.upcast:
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """w3(silu(a) * b) with a, b from one fused projection (the product is quadratic in the input's scale)."""

    def __init__(self, d=D, hidden=2 * D):
        super().__init__()
        self.w12 = nn.Linear(d, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        a, b = self.w12(x).chunk(2, -1)
        return self.w3(F.silu(a) * b)


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Rotary(nn.Module):
    """cos/sin of position * inv_freq; `fp32=False`: the angles in the activations' dtype (pos.to(x.dtype))."""

    def __init__(self, hd, fp32=True, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, hd, 2).float() / hd), persistent=False)
        self.fp32 = fp32

    def forward(self, x, pos):  # pos [B, T] int64 -> cos, sin [B, 1, T, hd / 2]
        if self.fp32:
            with torch.autocast("cpu", enabled=False):
                f = pos[..., None].float() * self.inv_freq
            return f.cos().to(x.dtype)[:, None], f.sin().to(x.dtype)[:, None]
        f = pos[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
        return f.cos()[:, None], f.sin()[:, None]


class Attention(nn.Module):
    """Multi-head attention by hand. scale: "before" (q * hd**-0.5, then q @ k^T), "after" (matmul, then / sqrt(hd):
    the Annotated Transformer), "none" (forgotten). qk_norm: None, or RMSNorm's `upcast` for per-head q/k norms.
    rope: a Rotary module. mem: the keys/values' source (cross-attention)."""

    def __init__(self, d=D, h=2, scale="before", qk_norm=None, rope=None):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.h, self.scale = h, scale
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm, self.k_norm = RMSNorm(d // h, upcast=qk_norm), RMSNorm(d // h, upcast=qk_norm)
        self.rope = rope

    def forward(self, x, mem=None, pos=None, causal=False):
        B, T, C = x.shape
        mem = x if mem is None else mem
        S, hd = mem.shape[1], C // self.h
        q = self.q(x).view(B, T, self.h, hd).transpose(1, 2)
        k = self.k(mem).view(B, S, self.h, hd).transpose(1, 2)
        v = self.v(mem).view(B, S, self.h, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = self.rope(v, pos)   # (HF passed value_states for the dtype)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.scale == "before":
            s = (q * hd ** -0.5) @ k.transpose(-1, -2)
        elif self.scale == "after":
            s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
        else:
            s = q @ k.transpose(-1, -2)
        if causal:
            s = s.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), float("-inf"))
        a = torch.softmax(s.float(), -1).to(v.dtype)
        return self.o((a @ v).transpose(1, 2).reshape(B, T, C))


# ======================================================================================================================
# a sensor-forecasting transformer (cases 1-3 and a healthy twin): inp -> blocks -> norm -> head
# ======================================================================================================================
class TSBlock(nn.Module):
    """layout "pre": x + attn(norm1(x)); x + mlp(norm2(x)). "pre_no_norm2": the MLP branch's norm forgotten.
    "post": norm1(x + attn(x)); norm2(x + mlp(x)) (the original Transformer's)."""

    def __init__(self, layout="pre", upcast=True, scale="before"):
        super().__init__()
        self.layout = layout
        self.norm1, self.norm2 = RMSNorm(upcast=upcast), RMSNorm(upcast=upcast)
        self.attn, self.mlp = Attention(scale=scale), SwiGLU()

    def forward(self, x):
        if self.layout == "post":
            x = self.norm1(x + self.attn(x))
            return self.norm2(x + self.mlp(x))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(x if self.layout == "pre_no_norm2" else self.norm2(x))


class Forecaster(nn.Module):
    def __init__(self, n_feat=8, n=2, **kw):
        super().__init__()
        self.inp = nn.Linear(n_feat, D)
        self.blocks = nn.ModuleList(TSBlock(**kw) for _ in range(n))
        self.norm, self.head = RMSNorm(), nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))[..., 0]


_TS_W = torch.randn(8, generator=_g(999))


def sensors(i, raw_from=None, raw_at=None, gain=1000.0):
    """Step i's windows [16, 12 steps, 8 features], standardised; the target: the next value of a fixed mix.
    From step `raw_from` on (a new site whose sensor is not standardised) or at step `raw_at` only, one window's
    feature 0 holds the raw reading (x `gain`)."""
    x = torch.randn(16, 12, 8, generator=_g(i))
    y = torch.tanh(x @ _TS_W)
    if (raw_from is not None and i >= raw_from) or i == raw_at:
        x[5, :, 0] = x[5, :, 0] * gain + gain
    return x, y


def mse(out, x, y):
    return (out.float() - y).pow(2).mean()


def forecaster_call(m):
    return lambda x, y: m(x)


# ======================================================================================================================
# a recommender's sparse mixture of experts (case 4 and a healthy twin): dense features -> moe -> head
# ======================================================================================================================
class TopKRouter(nn.Module):
    """Shazeer-style top-k gating: logits = proj(x), the k best, their softmax. `fp32=False`: the softmax written
    by hand in the working dtype, exp(l) / exp(l).sum() (no max subtracted)."""

    def __init__(self, d, n_exp=4, k=2, fp32=True):
        super().__init__()
        self.proj = nn.Linear(d, n_exp, bias=False)
        self.k, self.fp32 = k, fp32

    def forward(self, x):
        top, idx = self.proj(x).topk(self.k, -1)
        if self.fp32:
            return torch.softmax(top.float(), -1), idx
        e = top.exp()
        return e / e.sum(-1, keepdim=True), idx


class Expert(nn.Module):
    def __init__(self, d, hidden=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    def __init__(self, d, n_exp=4, k=2, fp32=True):
        super().__init__()
        self.router = TopKRouter(d, n_exp, k, fp32)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n_exp))

    def forward(self, x):  # [N, d]
        w, idx = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, (w[rows, slot, None] * expert(x[rows])).to(out.dtype))
        return out


class Ranker(nn.Module):
    def __init__(self, n_dense=12, fp32=True):
        super().__init__()
        self.inp = nn.Linear(n_dense, D)
        self.moe = MoE(D, fp32=fp32)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        return self.head(h + self.moe(h))[:, 0]


_RANK_W = torch.randn(12, generator=_g(998))


def impressions(i, raw_at=None):
    """Step i's 64 impressions x 12 dense features (log1p'd counts, standardised) and click labels; at step `raw_at`
    a backfilled partition whose watch-time feature (column 3) is in raw seconds, not log1p'd."""
    x = torch.randn(64, 12, generator=_g(i))
    y = (x @ _RANK_W > 0).float()
    if i == raw_at:
        x[:8, 3] = torch.rand(8, generator=_g(50 + i)) * 400 + 150   # 2.5 - 9 minute views, in seconds
    return x, y


def bce(out, x, y):
    return F.binary_cross_entropy_with_logits(out.float(), y)


# ======================================================================================================================
# a tiny LLaMA-style LM (cases 5, 8 and a healthy twin): token ids with absolute positions, padded batches
# ======================================================================================================================
class LMBlock(nn.Module):
    def __init__(self, rope_fp32=True, qk_upcast=True):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()
        self.attn = Attention(qk_norm=qk_upcast, rope=Rotary(D // 2, fp32=rope_fp32))
        self.mlp = SwiGLU()

    def forward(self, x, pos):
        x = x + self.attn(self.norm1(x), pos=pos, causal=True)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, n=2, rope_fp32=True, qk_upcast=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, D, padding_idx=0)
        self.blocks = nn.ModuleList(LMBlock(rope_fp32, qk_upcast) for _ in range(n))
        self.norm, self.head = RMSNorm(), nn.Linear(D, vocab, bias=False)

    def forward(self, idx, pos):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, pos)
        return self.head(self.norm(x))


def chunks(i, far_at=None, pad_from=None, B=4, T=16):
    """Step i's chunks of long documents, streamed with their absolute positions (Transformer-XL style): chunk
    offsets up to a few thousand tokens; at step `far_at` a chunk 70,000 tokens into a book. From step `pad_from` on
    the last chunk of each document is short and right-padded with token 0. Targets: the next token, -100 at pads."""
    start = torch.randint(1, 64, (B, 1), generator=_g(i))
    idx = (start * 7 ** torch.arange(T + 1)) % 61 + 1   # each token determines the next (learnable)
    off = torch.randint(0, 4096, (B, 1), generator=_g(100 + i))
    if i == far_at:
        off[1] = 70_000
    if pad_from is not None and i >= pad_from:
        idx[0, 10:] = 0
        idx[2, 13:] = 0
    x, y = idx[:, :-1], idx[:, 1:].clone()
    y[x == 0] = -100
    y[y == 0] = -100
    return x, off + torch.arange(T), y


def lm_ce(out, idx, pos, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten(), ignore_index=-100)


def lm_call(m):
    return lambda idx, pos, y: m(idx, pos)


# ======================================================================================================================
# a tiny speech-to-text encoder-decoder (case 6 and a healthy twin): pre-norm blocks; `final_norm=False`: the
# encoder's closing norm forgotten, so the decoder's cross-attention reads the raw residual stream
# ======================================================================================================================
class EncBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()
        self.attn, self.mlp = Attention(scale="none"), SwiGLU()  # T5-style: the scale folded into the init

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = RMSNorm(), RMSNorm(), RMSNorm()
        self.self_attn, self.cross_attn, self.mlp = Attention(scale="none"), Attention(scale="none"), SwiGLU()

    def forward(self, x, mem):
        x = x + self.self_attn(self.norm1(x), causal=True)
        x = x + self.cross_attn(self.norm2(x), mem=mem)
        return x + self.mlp(self.norm3(x))


class Encoder(nn.Module):
    def __init__(self, n_mel=16, final_norm=True):
        super().__init__()
        self.inp = nn.Linear(n_mel, D)
        self.layers = nn.ModuleList(EncBlock() for _ in range(2))
        self.norm = RMSNorm() if final_norm else nn.Identity()

    def forward(self, x):
        h = self.inp(x)
        for b in self.layers:
            h = b(h)
        return self.norm(h)


class Decoder(nn.Module):
    def __init__(self, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList(DecBlock() for _ in range(2))
        self.norm, self.head = RMSNorm(), nn.Linear(D, vocab, bias=False)

    def forward(self, idx, mem):
        x = self.emb(idx)
        for b in self.layers:
            x = b(x, mem)
        return self.head(self.norm(x))


class Seq2Seq(nn.Module):
    def __init__(self, final_norm=True):
        super().__init__()
        self.encoder, self.decoder = Encoder(final_norm=final_norm), Decoder()

    def forward(self, feats, idx):
        return self.decoder(idx, self.encoder(feats))


_MEL_W = torch.randn(16, generator=_g(997))


def utterances(i, loud_at=None, gain=300.0):
    """Step i's 4 utterances (20 frames x 16 log-mel bins, normalised) and 8-token transcripts (tokens follow the
    frames' energy, so they are learnable); at step `loud_at` one clip from a new recorder whose features skipped
    the normalisation (x `gain`)."""
    x = torch.randn(4, 20, 16, generator=_g(i))
    tok = ((x[:, :8] @ _MEL_W).sign() + 1).long() * 8 + torch.arange(8) % 8 + 1
    if i == loud_at:
        x[2] = (x[2] * gain).clamp(-32767, 32767)
    y = torch.roll(tok, -1, 1)
    return x, tok, y


def s2s_ce(out, x, tok, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def s2s_call(m):
    return lambda x, tok, y: m(x, tok)


# ======================================================================================================================
# a deep residual MLP without norms (case 7): x + fc2(gelu(fc1(x))) eight times; the stream grows layer by layer
# ======================================================================================================================
class ResBlock(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class DeepResMLP(nn.Module):
    def __init__(self, n=8, d=D):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(ResBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 1)
        with torch.no_grad():  # He-style init of the residual branches (Fixup's scaling forgotten)
            for b in self.blocks:
                nn.init.kaiming_normal_(b.fc1.weight)
                nn.init.kaiming_normal_(b.fc2.weight)
            self.head.weight.mul_(0.01)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)[:, 0]


# ======================================================================================================================
# the tests
# ======================================================================================================================
def fp16_only(make, call, args):
    """A fresh model from `make()` on the batch `args`: the forward is non-finite under fp16 autocast, finite in fp32
    (the failure is fp16's, not the data's)."""
    torch.manual_seed(0)
    m = make()
    with torch.no_grad():
        assert torch.isfinite(call(m)(*args).float()).all()
        with torch.autocast("cpu", dtype=torch.float16):
            assert not torch.isfinite(call(m)(*args).float()).all()


def _variance_oracle(m, hooks):
    """Forward pre-hooks on every RMSNorm that keeps the working dtype: the first (module, step) whose x.pow(2).mean()
    is non-finite in the input's dtype while x is finite (and the same in fp32 is finite). Returns (seen, handles)."""
    seen = []

    def pre(n):
        def f(mod, args):
            x = args[0]
            if not seen and torch.isfinite(x).all():
                v = x.pow(2).mean(-1)
                if not torch.isfinite(v).all() and torch.isfinite(x.float().pow(2).mean(-1)).all():
                    seen.append((n, hooks["step"]))
        return f
    return seen, [mod.register_forward_pre_hook(pre(n)) for n, mod in m.named_modules()
                  if isinstance(mod, RMSNorm) and not mod.upcast]


def _silent_rmsnorm_run(every=None, upcast=False):
    torch.manual_seed(0)
    m = Forecaster(upcast=upcast)
    hooks = {"step": 0}
    seen, hs = _variance_oracle(m, hooks)
    r = train_loop(m, lambda i: sensors(i, raw_from=4), mse, 12, call=forecaster_call(m), lr=3e-3, hooks=hooks,
                   every=every)
    for h in hs:
        h.remove()
    return r, seen


@pytest.mark.parametrize("every", [
    pytest.param(None, marks=xf(
        "the report is empty (exit 0) at the default sampling: the flushed rows show only in a sampled step's full "
        "statistics (exact zeros out of blocks.0.norm1 from nonzero inputs up to 634), and steps 1-11 are not "
        "sampled; nothing non-finite or skipped makes them so. Right: overflow at blocks.0.norm1, step 4, forward "
        "(x.pow(2).mean() is inf in fp16 there, finite in fp32). At every=1 rules/numeric.py silent_zeros names it")),
    1], ids=["default", "every1"])
def test_rmsnorm_variance_in_fp16_overflows_silently_on_a_raw_sensor(every):
    r, seen = _silent_rmsnorm_run(every)
    # real: from step 4 x.pow(2).mean() in blocks.0.norm1 is inf (finite in fp32), the window is silently zeroed:
    # no module output is non-finite, no loss is, nothing is skipped
    assert seen == [("blocks.0.norm1", 4)], seen
    assert r["first"] is None and not r["bad_loss"] and not r["skipped"], r
    rep = r["w"].report()
    at_top3(rep, ("overflow",), "blocks.0.norm1", step=4, phase="forward")


def test_swiglu_gate_times_up_overflows_where_the_mlp_norm_was_forgotten():
    torch.manual_seed(0)
    m = Forecaster(layout="pre_no_norm2")
    fp16_only(lambda: Forecaster(layout="pre_no_norm2"), forecaster_call, sensors(4, raw_at=4))
    r = train_loop(m, lambda i: sensors(i, raw_at=4), mse, 7, call=forecaster_call(m), lr=3e-3)
    real_fwd(r, "blocks.0.mlp", 4)
    rep = r["w"].report()
    at_top3(rep, BAD, "blocks.0.mlp", step=4, phase="forward")
    no_error_at(rep, ("blocks.0.mlp.w12", "blocks.0.mlp.w3", "blocks.0", "blocks.1", "blocks.1.mlp", "norm", "head"))


def test_attention_without_the_scale_overflows_in_q_at_k():
    torch.manual_seed(0)
    m = Forecaster(layout="post", scale="none")
    fp16_only(lambda: Forecaster(layout="post", scale="none"), forecaster_call, sensors(4, raw_at=4))
    r = train_loop(m, lambda i: sensors(i, raw_at=4), mse, 7, call=forecaster_call(m), lr=3e-3)
    real_fwd(r, "blocks.0.attn", 4)
    rep = r["w"].report()
    at_top3(rep, BAD, "blocks.0.attn", step=4, phase="forward")
    no_error_at(rep, ("blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.o", "blocks.0.norm1", "blocks.0", "inp"))


def test_moe_top2_router_hand_written_softmax_overflows_on_raw_watch_time():
    torch.manual_seed(0)
    m = Ranker(fp32=False)
    fp16_only(lambda: Ranker(fp32=False), lambda m: (lambda x, y: m(x)), impressions(4, raw_at=4))
    r = train_loop(m, lambda i: impressions(i, raw_at=4), bce, 7, call=lambda x, y: m(x), lr=3e-3)
    real_fwd(r, "moe.router", 4)
    rep = r["w"].report()
    at_top3(rep, BAD, "moe.router", step=4, phase="forward")
    no_error_at(rep, ("moe.router.proj", "moe", "inp", "head") + tuple(f"moe.experts.{e}" for e in range(4)))


def _rope_run():
    torch.manual_seed(0)
    m = TinyLM(rope_fp32=False)
    # the mechanism: position 70,000 is inf in fp16 (65504 is its largest finite value), finite in fp32
    pos = chunks(4, far_at=4)[1]
    assert not torch.isfinite(pos.to(torch.float16)).all() and torch.isfinite(pos.float()).all()
    fp16_only(lambda: TinyLM(rope_fp32=False), lm_call, chunks(4, far_at=4))
    r = train_loop(m, lambda i: chunks(i, far_at=4), lm_ce, 7, call=lm_call(m), lr=1e-2)
    real_fwd(r, "blocks.0.attn.rope", 4)
    return r["w"].report()


def test_rotary_angles_in_fp16_are_inf_past_position_65504():
    rep = _rope_run()
    at_top3(rep, BAD, "blocks.0.attn.rope", step=4, phase="forward")
    no_error_at(rep, ("blocks.0.attn", "blocks.0", "blocks.0.attn.q_norm", "blocks.0.attn.k_norm", "blocks.1.attn.rope"))


def test_rotary_first_inf_is_the_position_cast_not_cos():
    rep = _rope_run()
    at_top3(rep, ("overflow",), "blocks.0.attn.rope", step=4, phase="forward",
            ops=("aten::_to_copy", "aten::to", "aten::copy_"))


def test_cross_attention_reads_an_encoder_without_its_final_norm():
    torch.manual_seed(0)
    m = Seq2Seq(final_norm=False)
    # the mechanism: the loud clip's memory stays finite (below 65504 / 1.3) while its q @ k^T does not
    x, tok, _ = utterances(4, loud_at=4, gain=40000.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        mem = m.encoder(x)
    assert torch.isfinite(mem).all() and mem.abs().max() < FP16_MAX / 1.3
    fp16_only(lambda: Seq2Seq(final_norm=False), s2s_call, utterances(4, loud_at=4, gain=40000.0))
    r = train_loop(m, lambda i: utterances(i, loud_at=4, gain=40000.0), s2s_ce, 7, call=s2s_call(m), lr=1e-2)
    real_fwd(r, "decoder.layers.0.cross_attn", 4)
    rep = r["w"].report()
    at_top3(rep, BAD, "decoder.layers.0.cross_attn", step=4, phase="forward")
    no_error_at(rep, ("encoder", "encoder.inp", "encoder.layers.1", "decoder.layers.0.cross_attn.k",
                      "decoder.layers.0.cross_attn.q", "decoder.layers.0", "decoder.layers.0.self_attn"))


def test_residual_stream_grows_until_a_late_layer_overflows():
    torch.manual_seed(0)
    m = DeepResMLP()
    # the mechanism: the stream's peak grows layer by layer (each block's output above its input's)
    x = sensors(4, raw_at=4, gain=3500.0)[0][:, -1]
    peaks, h = [], None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = m.inp(x)
        for b in m.blocks[:6]:
            h = b(h)
            peaks.append(float(h.abs().max()))
    assert all(b > a for a, b in zip(peaks, peaks[1:])) and peaks[-1] < FP16_MAX, peaks
    r = train_loop(m, lambda i: tuple(t[:, -1] for t in sensors(i, raw_at=4, gain=3500.0)), mse, 7,
                   call=lambda x, y: m(x), lr=1e-3, init_scale=128.0)
    prod = r["first"][0] if r["first"] else None
    assert prod is not None and prod.startswith(("blocks.6", "blocks.7")), r
    real_fwd(r, prod, 4)
    rep = r["w"].report()
    at_top3(rep, BAD, prod, step=4, phase="forward")
    no_error_at(rep, ("inp", "blocks.0", "blocks.3", "blocks.5", "head"))


def test_qk_norm_in_fp16_backward_is_nan_on_zero_padding_rows():
    torch.manual_seed(0)
    m = TinyLM(qk_upcast=False)
    # the mechanism: rsqrt(0 + 1e-6) ** 3 (RsqrtBackward0's factor) is inf in fp16, finite in fp32
    r16 = torch.rsqrt(torch.zeros(1, dtype=torch.float16) + 1e-6)
    assert torch.isfinite(r16) and not torch.isfinite(r16 ** 3) and torch.isfinite(torch.rsqrt(torch.tensor(1e-6)) ** 3)
    r = train_loop(m, lambda i: chunks(i, pad_from=4), lm_ce, 7, call=lm_call(m), lr=1e-2, backward=True)
    prod = r["first_bwd"][0] if r["first_bwd"] else None
    assert prod in ("blocks.0.attn.q_norm", "blocks.0.attn.k_norm"), r
    real_bwd(r, prod, 4)
    rep = r["w"].report()
    at_top3(rep, BAD, prod, step=4, phase="backward")


def test_healthy_llama_style_lm_on_far_positions_and_padding_is_quiet():
    torch.manual_seed(0)
    m = TinyLM()
    healthy(train_loop(m, lambda i: chunks(i, far_at=4, pad_from=4), lm_ce, 16, call=lm_call(m), lr=1e-2,
                       backward=True))


def test_healthy_upcast_rmsnorm_forecaster_on_the_raw_sensor_is_quiet():
    r, seen = _silent_rmsnorm_run(upcast=True)
    assert seen == []
    healthy(r)
