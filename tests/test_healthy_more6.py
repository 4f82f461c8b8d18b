"""Healthy runs that must raise no warning and no error (shared/CONTRACT.md), beyond tests/test_healthy*.py: a tiny
Llama (RMSNorm with its variance in fp32, rotary embeddings in fp32, SwiGLU, SDPA `is_causal=True`, tied embeddings),
with `torch.utils.checkpoint` inside the loop over its layers, with variable sequence lengths (a curriculum), on
packed sequences (EOS-separated documents, with and without a per-document mask and reset positions), and in bf16
without a scaler; a top-2 mixture of experts with a load-balancing loss and a router z-loss in fp32; 16k-vocab
logits with label smoothing and `ignore_index` padding (cast to fp32 by hand or left to autocast), a token-sum loss
that makes GradScaler back off from 65536, Gemma-style logit soft-capping; ALiBi float biases through SDPA; a
diffusion MLP with fp32 sinusoidal timestep embeddings and a v-prediction loss; CLIP's contrastive loss with a
learnable logit scale clamped at 100 (from scratch, and a fine-tune starting at the clamp); PPO (ratio clipping,
advantages normalised with eps=1e-8 in fp32, value loss, entropy bonus); modules that never get a gradient, a task
head first used and added to the optimizer mid-run, `requires_grad` toggled both ways mid-run, a param group held at
lr 0 and ramped; OneCycleLR with clipping at 0.1, warmup -> PolynomialLR; frozen `.half()` parts (an embedding, a
text encoder under no_grad) beside fp32 trainable ones, in and out of the optimizer; quantisation-aware training with
straight-through estimators (round/detach, a custom sign Function); nested autocast regions (fp32 attention inside,
fp16 again inside that); a model taking kwargs and returning a dict with its loss, one returning a (loss, logits,
aux) tuple; BYOL's two views through an online network and an EMA target with one backward; one layer shared across
depth and an unrolled GRUCell; a perceptual loss through a frozen feature network; gradient reversal (DANN); FGSM
adversarial training with the input gradient from the scaled loss. fp16 autocast on the CPU with GradScaler("cpu")
(bf16 without one where said), at the default sampling, at every=1 and with `headroom=True` where cheap; each run is
asserted healthy (finite, loss falling, few backoffs) and judged through w.report() and ampdoctor.diagnose(run_dir).
(The frozen fp16 embedding held by an optimizer built from model.parameters(), never stepped, was reported as
fp16_master_weights / eps_underflow: parameters count only when they can be trained.)"""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


sys.path.insert(0, str(Path(__file__).parent))
from scenarios import EVERY, gen, healthy_run, one_thread, quiet  # noqa: E402


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

# ampdoctor's default sampling, every step, and the default sampling with the every-step headroom series
SAMPLING = pytest.mark.parametrize("every,headroom", [(None, None), (1, None), (None, True)],
                                   ids=["default", "every1", "headroom"])


run = healthy_run


def adamw(lr, **kw):
    return lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr, **kw)


def vectors(i, bs=32, d=20, k=4, seed=7):
    wt = torch.randn(d, k, generator=gen(seed))
    x = torch.randn(bs, d, generator=gen(i))
    return x, (x @ wt).argmax(1)


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


# --- a tiny Llama -----------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Llama/T5: the variance in fp32, the normalised activations cast back to the input's dtype."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps)).to(dt)


def rope(pos, hd, base=10000.0):
    """cos, sin of the rotary angles in fp32, (T, hd/2) or (B, T, hd/2) for per-token positions."""
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos.to(torch.float32)[..., None] * inv
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x (B, H, T, hd); cos/sin (T, hd/2) or (B, T, hd/2): the rotation in fp32, cast back (Llama's recipe)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).type_as(x)


class SwiGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False),
                                         nn.Linear(h, d, bias=False))

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp = SwiGLU(d, 64)

    def forward(self, x, cos, sin, mask=None):
        B, T, C = x.shape
        a = self.attn_norm(x)
        q, k, v = (w(a).view(B, T, self.h, C // self.h).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, V=64, d=32, n=2, ckpt=False):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.layers = nn.ModuleList(LlamaBlock(d) for _ in range(n))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.embed.weight          # tied, as in small Llamas
        self.ckpt = ckpt

    def forward(self, idx, pos=None, mask=None):
        hd = self.embed.embedding_dim // self.layers[0].h
        cos, sin = rope(torch.arange(idx.shape[1]) if pos is None else pos, hd)
        x = self.embed(idx)
        for layer in self.layers:
            if self.ckpt and self.training:
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def arith(i, B=8, T=16, V=64, stride=5):
    """Sequences (start + stride * t) % V: next-token prediction learnable in a few dozen steps."""
    start = torch.randint(0, V, (B, 1), generator=gen(i))
    return ((start + stride * torch.arange(T)) % V,)


def lm_loss(m, idx, *rest):
    logits = m(idx, *rest)
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten())


@SAMPLING
def test_tiny_llama_rmsnorm_fp32_rope_fp32_swiglu_sdpa_causal_tied(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(Llama(), arith, lm_loss, tmp_path, steps=40, every=every, headroom=headroom, opt=adamw(3e-3)))


@EVERY
def test_tiny_llama_checkpoint_inside_the_loop_over_layers(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(Llama(n=3, ckpt=True), arith, lm_loss, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


def test_tiny_llama_bf16_without_a_scaler(tmp_path):
    torch.manual_seed(0)
    quiet(run(Llama(), arith, lm_loss, tmp_path, steps=40, every=1, dtype=torch.bfloat16, opt=adamw(3e-3)))


@EVERY
def test_curriculum_sequence_length_grows_every_few_steps(every, tmp_path):
    """T = 8, 12, ..., 32: each step's shapes differ from the last one's (a sequence-length warmup)."""
    torch.manual_seed(0)
    quiet(run(Llama(), lambda i: arith(i, T=8 + 4 * min(6, i // 6)), lm_loss, tmp_path, steps=42, every=every,
              opt=adamw(3e-3)))


EOS = 0


def packed(i, B=4, T=32, V=64, doc_mask=False):
    """GPT-style packing: documents of random length (each an arithmetic run), EOS-separated, concatenated and
    cut into rows of T. With doc_mask, positions restart at each document and attention stays inside it."""
    g = gen(i)
    toks, docs, poss = [], [], []
    d = 0
    while len(toks) < B * T:
        n = int(torch.randint(3, 14, (1,), generator=g))
        s = int(torch.randint(1, V, (1,), generator=g))
        doc = [1 + (s + 5 * t) % (V - 1) for t in range(n)] + [EOS]
        toks += doc
        docs += [d] * len(doc)
        poss += list(range(len(doc)))
        d += 1
    idx = torch.tensor(toks[:B * T]).view(B, T)
    if not doc_mask:
        return (idx,)
    doc = torch.tensor(docs[:B * T]).view(B, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return idx, torch.tensor(poss[:B * T]).view(B, T), (doc[:, :, None] == doc[:, None, :]) & causal


@pytest.mark.parametrize("doc_mask", [False, True], ids=["is_causal", "per_document_mask"])
def test_sequence_packing_eos_separated_documents(doc_mask, tmp_path):
    torch.manual_seed(0)
    quiet(run(Llama(), lambda i: packed(i, doc_mask=doc_mask), lm_loss, tmp_path, steps=40, every=1,
              opt=adamw(3e-3)))


# --- mixture of experts -------------------------------------------------------------------------------------------

class Top2MoE(nn.Module):
    """Mixtral-style: the router's logits in fp32, top-2 of softmax renormalised, tokens gathered per expert and
    scattered back with index_add_; the Switch load-balancing loss and ST-MoE's router z-loss, both in fp32."""

    def __init__(self, d=32, e=4, h=64):
        super().__init__()
        self.e = e
        self.router = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d, h) for _ in range(e))
        self.aux = self.z = None

    def forward(self, x):
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        topv, topi = probs.topk(2, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for j, ex in enumerate(self.experts):
            tok, slot = (topi == j).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, (ex(x[tok]) * topv[tok, slot, None]).to(out.dtype))
        frac = F.one_hot(topi, self.e).float().sum(1).mean(0) / 2
        self.aux = self.e * (frac * probs.mean(0)).sum()
        self.z = torch.logsumexp(logits, -1).pow(2).mean()
        return out


class MoENet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp, self.out = nn.Linear(20, d), nn.Linear(d, 4)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))
        self.moes = nn.ModuleList(Top2MoE(d) for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for ln, moe in zip(self.norms, self.moes):
            h = h + moe(ln(h))
        return self.out(h)


def moe_loss(m, x, y):
    return (F.cross_entropy(m(x), y) + 0.01 * sum(moe.aux for moe in m.moes)
            + 1e-3 * sum(moe.z for moe in m.moes))


@SAMPLING
def test_top2_moe_load_balancing_and_router_z_loss_in_fp32(every, headroom, tmp_path):
    torch.manual_seed(1)
    quiet(run(MoENet(), vectors, moe_loss, tmp_path, steps=40, every=every, headroom=headroom, opt=adamw(3e-3)))


def test_top2_moe_bf16_without_a_scaler(tmp_path):
    torch.manual_seed(1)
    quiet(run(MoENet(), vectors, moe_loss, tmp_path, steps=40, every=1, dtype=torch.bfloat16, opt=adamw(3e-3)))


# --- large vocabularies -----------------------------------------------------------------------------------------

class BigVocabLM(nn.Module):
    def __init__(self, V=16384, d=32, softcap=None):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.mix = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.softcap = softcap

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.mix(h)
        logits = self.head(self.norm(h))
        if self.softcap:   # Gemma 2: cap * tanh(logits / cap), in fp32
            logits = self.softcap * torch.tanh(logits.float() / self.softcap)
        return logits


def big_vocab_batch(i, B=4, T=16, V=16384, pad=True):
    """Tokens from a 512-token slice of the vocabulary; the target is a fixed map of the token; rows padded at
    random lengths with ignore_index -100 in the labels."""
    g = gen(i)
    idx = torch.randint(0, 512, (B, T), generator=g) * 31
    y = (idx * 7 + 3) % V
    if pad:
        lens = torch.randint(T // 2, T + 1, (B,), generator=g)
        padded = torch.arange(T)[None] >= lens[:, None]
        idx = idx.masked_fill(padded, 0)
        y = y.masked_fill(padded, -100)
    return idx, y


@pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])
@pytest.mark.parametrize("upcast", [True, False], ids=["logits_float", "autocast_upcasts"])
def test_16k_vocab_logits_label_smoothing_and_ignore_index_padding(upcast, every, tmp_path):
    """upcast: the logits cast to fp32 by hand (HF style) or handed to cross_entropy in fp16 (autocast runs the
    loss in fp32 by itself)."""
    torch.manual_seed(0)

    def loss(m, idx, y):
        logits = m(idx)
        return F.cross_entropy((logits.float() if upcast else logits).flatten(0, 1), y.flatten(), ignore_index=-100,
                               label_smoothing=0.1)
    quiet(run(BigVocabLM(), big_vocab_batch, loss, tmp_path, steps=30, every=every, opt=adamw(1e-2)))


def test_token_sum_loss_over_a_16k_vocab_backs_off_from_65536_then_trains(tmp_path):
    """The seq2seq convention 'sum over tokens, divide by the batch size': the loss starts near 16 x ln(16384)
    (~150) and GradScaler halves from its default 65536 a few times before it settles (info, not a warning)."""
    torch.manual_seed(0)

    def loss(m, idx, y):
        return F.cross_entropy(m(idx).float().flatten(0, 1), y.flatten(), reduction="sum") / idx.shape[0]
    state = {}
    quiet(run(BigVocabLM(), lambda i: big_vocab_batch(i, pad=False), loss, tmp_path, steps=30, every=1,
              opt=adamw(1e-2), max_backoffs=10, state=state))
    assert state["losses"][0] > 100 and state["scales"][-1] < 65536, (state["losses"][0], state["scales"])


def test_gemma_logit_softcapping_in_fp32_16k_vocab(tmp_path):
    torch.manual_seed(0)

    def loss(m, idx, y):
        return F.cross_entropy(m(idx).flatten(0, 1), y.flatten(), ignore_index=-100)
    quiet(run(BigVocabLM(softcap=30.0), big_vocab_batch, loss, tmp_path, steps=30, every=1, headroom=True,
              opt=adamw(1e-2)))


class ALiBi(nn.Module):
    """BLOOM/MPT-style attention: no positional embedding, a per-head linear distance bias added to the scores
    together with the causal -inf, handed to SDPA as a float mask."""

    def __init__(self, V=64, d=32, h=4, n=2):
        super().__init__()
        self.h = h
        self.embed = nn.Embedding(V, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(n))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.lns = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.head = nn.Linear(d, V)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (j + 1) / h) for j in range(h)]), persistent=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        dist = (torch.arange(T)[None] - torch.arange(T)[:, None]).float()            # j - i <= 0 below the diagonal
        bias = (self.slopes[:, None, None] * dist).masked_fill(dist > 0, float("-inf"))
        for qkv, proj, ln in zip(self.qkv, self.proj, self.lns):
            q, k, v = qkv(ln(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
            x = x + proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(B, T, -1))
        return self.head(x)


@EVERY
def test_alibi_float_bias_with_causal_minus_inf_through_sdpa(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(ALiBi(), arith, lm_loss, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


# --- diffusion, CLIP, PPO ---------------------------------------------------------------------------------------

def timestep_embedding(t, dim, max_period=10000):
    """The DDPM/ADM sinusoidal embedding, computed in fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Denoiser(nn.Module):
    def __init__(self, d=16, h=128, temb=32):
        super().__init__()
        self.temb = temb
        self.t_mlp = nn.Sequential(nn.Linear(temb, h), nn.SiLU(), nn.Linear(h, h))
        self.inp = nn.Linear(d, h)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(h), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
                                    for _ in range(2))
        self.out = nn.Linear(h, d)

    def forward(self, x, t):
        h = self.inp(x) + self.t_mlp(timestep_embedding(t, self.temb))
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def alpha_bar(t, T=1000, s=0.008):
    """The cosine schedule (Nichol & Dhariwal), fp32."""
    return torch.cos((t.float() / T + s) / (1 + s) * math.pi / 2) ** 2


def diffusion_batch(i, B=64, d=16):
    """x0 on a 2-d manifold in 16-d (a ring), t uniform in [0, 1000), Gaussian noise: returns (x_t, t, v)."""
    g = gen(i)
    proj = torch.randn(2, d, generator=gen(99)) / math.sqrt(2)
    th = torch.rand(B, generator=g) * 2 * math.pi
    x0 = torch.stack([th.cos(), th.sin()], -1) @ proj
    t = torch.randint(0, 1000, (B,), generator=g)
    eps = torch.randn(B, d, generator=g)
    ab = alpha_bar(t)[:, None]
    return ab.sqrt() * x0 + (1 - ab).sqrt() * eps, t, ab.sqrt() * eps - (1 - ab).sqrt() * x0


@SAMPLING
def test_diffusion_fp32_sinusoidal_timesteps_v_prediction(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(Denoiser(), diffusion_batch, lambda m, xt, t, v: F.mse_loss(m(xt, t).float(), v), tmp_path, steps=50,
              every=every, headroom=headroom, opt=adamw(2e-3), must_fall=0.95))


class CLIP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, d))
        self.text_embed = nn.EmbeddingBag(100, 64, mode="mean")
        self.text_proj = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, d))
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, img, txt):
        i = F.normalize(self.visual(img), dim=-1)
        t = F.normalize(self.text_proj(self.text_embed(txt)), dim=-1)
        return self.logit_scale.exp() * i @ t.t()


def clip_batch(i, B=32, shift=0.0):
    """Pairs from 100 concepts: the 'image' a noisy projection of the concept (through a fixed distortion when
    shift > 0: a new image domain), the 'caption' 4 of its tokens."""
    g = gen(i)
    c = torch.randperm(100, generator=g)[:B]
    distort = torch.eye(24) + shift * torch.randn(24, 24, generator=gen(6)) / math.sqrt(24)
    img = (torch.randn(100, 24, generator=gen(5))[c] + 0.3 * torch.randn(B, 24, generator=g)) @ distort
    txt = torch.stack([c, (c + 1) % 100, (c * 3) % 100, (c * 7 + 2) % 100], 1)
    return img, txt


def clip_loss(m, img, txt):
    logits = m(img, txt).float()
    y = torch.arange(img.shape[0])
    return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2


@pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])
@pytest.mark.parametrize("start", ["from_scratch", "finetune_at_the_clamp"])
def test_clip_contrastive_learnable_logit_scale_clamped_at_100(start, every, tmp_path):
    """open_clip: logit_scale starts at log(1/0.07), sits in a no-decay group and is clamped to [0, log(100)] after
    every step. From scratch its own lr 0.1 lets it move within the run; the fine-tune starts from a pretrained
    model (60 unwatched fp32 steps) whose scale is at the clamp (100, as OpenAI's checkpoints), on a new image
    domain: fp16 logits of magnitude ~75 from the first step."""
    torch.manual_seed(0)
    m = CLIP()
    shift, lr_scale = 0.0, 1e-1
    if start == "finetune_at_the_clamp":
        pre = torch.optim.Adam(m.parameters(), lr=1e-2)
        for i in range(60):
            pre.zero_grad()
            clip_loss(m, *clip_batch(1000 + i)).backward()
            pre.step()
        with torch.no_grad():
            m.logit_scale.fill_(math.log(100))
        shift, lr_scale = 1.0, 1e-3
    peak = []

    def opt(m):
        rest = [p for n, p in m.named_parameters() if n != "logit_scale"]
        return torch.optim.AdamW([{"params": rest, "lr": 1e-3 if shift else 3e-3},
                                  {"params": [m.logit_scale], "lr": lr_scale, "weight_decay": 0.0}])

    def loss(m, img, txt):
        logits = m(img, txt)
        peak.append(logits.detach().abs().max().item())
        y = torch.arange(img.shape[0])
        return (F.cross_entropy(logits.float(), y) + F.cross_entropy(logits.float().t(), y)) / 2

    def clamp(i):
        m.logit_scale.clamp_(0, math.log(100))
    quiet(run(m, lambda i: clip_batch(i, shift=shift), loss, tmp_path, steps=40, every=every, opt=opt, after=clamp))
    if shift:
        assert min(peak) > 60, peak
    else:
        assert m.logit_scale.item() > math.log(1 / 0.07) + 0.5, m.logit_scale.item()


class ActorCritic(nn.Module):
    def __init__(self, d=8, a=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.pi, self.v = nn.Linear(64, a), nn.Linear(64, 1)

    def forward(self, s):
        h = self.body(s)
        return self.pi(h), self.v(h).squeeze(-1)


@EVERY
def test_ppo_clipped_ratio_normalised_advantages_value_loss_entropy(every, tmp_path):
    """A contextual bandit: a rollout of 256 states every 4 updates under no_grad (sampled in fp32 from the fp16
    logits), advantages normalised with eps=1e-8 in fp32, 4 PPO epochs per rollout on minibatches of 64."""
    torch.manual_seed(0)
    m = ActorCritic()
    W = torch.randn(8, 4, generator=gen(3))
    roll = {}

    def batch(i):
        if i % 4 == 0:
            g = gen(100 + i)
            s = torch.randn(256, 8, generator=g)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                logits, v = m(s)
            dist = torch.distributions.Categorical(logits=logits.float())
            a = dist.sample()
            r = 1.0 + (a == (s @ W).argmax(1)).float() + 0.1 * torch.randn(256, generator=g)
            adv = r - v.float()
            roll.update(s=s, a=a, logp=dist.log_prob(a), ret=r, adv=(adv - adv.mean()) / (adv.std() + 1e-8))
        j = slice(64 * (i % 4), 64 * (i % 4 + 1))
        return tuple(roll[k][j] for k in ("s", "a", "logp", "ret", "adv"))

    def loss(m, s, a, old_logp, ret, adv):
        logits, v = m(s)
        logp_all = F.log_softmax(logits.float(), -1)
        ratio = torch.exp(logp_all.gather(1, a[:, None]).squeeze(1) - old_logp)
        pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        ent = -(logp_all.exp() * logp_all).sum(-1).mean()
        return pg + 0.5 * F.mse_loss(v.float(), ret) - 0.01 * ent
    quiet(run(m, batch, loss, tmp_path, steps=48, every=every, clip=0.5, opt=adamw(3e-3, eps=1e-5), must_fall=0.7))


# --- parameters without gradients, changing optimizers ----------------------------------------------------------

class WithUnused(nn.Module):
    """Modules built but never called in training (a pooler, a projection kept for checkpoint compatibility, a
    decoder only used at eval): their parameters sit in the optimizer and never get a gradient."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.pooler = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.legacy_proj = nn.Linear(64, 128)
        self.eval_decoder = nn.Linear(64, 20)

    def forward(self, x):
        return self.head(self.trunk(x))


@EVERY
def test_modules_that_never_get_a_gradient_sit_in_the_optimizer(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(WithUnused(), vectors, ce, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head_a, self.head_b = nn.Linear(64, 4), nn.Linear(64, 3)
        self.use_b = False

    def forward(self, x):
        h = self.trunk(x)
        return self.head_a(h), (self.head_b(h) if self.use_b else None)


@EVERY
def test_second_task_head_first_used_and_added_to_the_optimizer_mid_run(every, tmp_path):
    """Continual/multi-task: head_b exists from the start, is unused and outside the optimizer until step 20,
    then joins the loss and the optimizer (add_param_group with its own lr)."""
    torch.manual_seed(0)
    m = TwoTasks()
    holder = {}

    def opt(m):
        holder["opt"] = torch.optim.AdamW(list(m.trunk.parameters()) + list(m.head_a.parameters()), lr=3e-3)
        return holder["opt"]

    def before(i):
        if i == 20:
            m.use_b = True
            holder["opt"].add_param_group({"params": list(m.head_b.parameters()), "lr": 1e-2})

    def loss(m, x, y):
        a, b = m(x)
        la = F.cross_entropy(a, y)
        return la if b is None else la + 0.5 * F.cross_entropy(b, y % 3)
    quiet(run(m, vectors, loss, tmp_path, steps=40, every=every, opt=opt, before=before, must_fall=1.0))


@EVERY
def test_requires_grad_toggled_mid_run_unfreeze_then_freeze(every, tmp_path):
    """All parameters in the optimizer from the start; the first layer is frozen (no grad) until step 12, then
    trained; the head is frozen from step 28 on (its grads stay None, AdamW skips it)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    m[0].requires_grad_(False)

    def before(i):
        if i == 12:
            m[0].requires_grad_(True)
        if i == 28:
            m[4].requires_grad_(False)
    quiet(run(m, vectors, ce, tmp_path, steps=40, every=every, before=before,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


# --- schedules and clipping -------------------------------------------------------------------------------------

@EVERY
def test_onecycle_lr_with_adamw_beta_cycling_and_clip_0_1(every, tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(),
                      nn.Linear(128, 4))
    quiet(run(m, vectors, ce, tmp_path, steps=40, every=every, clip=0.1,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
              sched=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=40)))


def test_linear_warmup_then_polynomial_decay_power_2(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 4))

    def sched(o):
        return torch.optim.lr_scheduler.SequentialLR(
            o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.01, total_iters=8),
                torch.optim.lr_scheduler.PolynomialLR(o, total_iters=32, power=2.0)], milestones=[8])
    quiet(run(m, vectors, ce, tmp_path, steps=40, every=1, headroom=True, sched=sched,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3)))


def test_backbone_group_held_at_lr_0_then_ramped_per_group_lambda(tmp_path):
    """A per-group LambdaLR: the head trains from step 0, the backbone's group has lr 0 for 10 steps (it gets
    gradients, AdamW's moments accumulate, its weights do not move) and then ramps up over 10 steps."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def opt(m):
        return torch.optim.AdamW([{"params": list(m[:4].parameters()), "lr": 3e-3},
                                  {"params": list(m[4].parameters()), "lr": 3e-3}])

    def sched(o):
        return torch.optim.lr_scheduler.LambdaLR(o, [lambda s: min(1.0, max(0.0, (s - 10) / 10)), lambda s: 1.0])
    quiet(run(m, vectors, ce, tmp_path, steps=40, every=1, opt=opt, sched=sched))


# --- frozen fp16 parts ------------------------------------------------------------------------------------------

class FrozenHalfEmbed(nn.Module):
    """A frozen pretrained embedding stored in fp16 (`.half()`, requires_grad False) under an fp32 trainable head:
    the fp16 weights have no master copy, and need none, since they are never updated."""

    def __init__(self, V=200, d=32):
        super().__init__()
        self.embed = nn.Embedding(V, d).half().requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, idx):
        return self.head(self.embed(idx).mean(1))


@pytest.mark.parametrize("case", [
    "fp16_trainable_only",
    "fp16_adamw_over_all_params",  # was a false alarm: fp16_master_weights + eps_underflow at embed
    "fp16_sgd_momentum_over_all_params",  # was: fp16_master_weights at embed
    "bf16_adamw_over_all_params"])
def test_frozen_half_embedding_with_fp32_trainable_head(case, tmp_path):
    """The optimizer built from the trainable parameters only, or from model.parameters(), so that it holds the
    frozen fp16 (or bf16, under bf16 autocast without a scaler) embedding too, which never gets a gradient, so
    the optimizer never steps it. The label is a fixed linear read-out of the mean embedding."""
    torch.manual_seed(0)
    m = FrozenHalfEmbed()
    dtype = torch.bfloat16 if case.startswith("bf16") else torch.float16
    m.embed.to(dtype)
    readout = torch.randn(32, 4, generator=gen(12))

    def tokens(i, B=32, T=6):
        idx = torch.randint(0, 200, (B, T), generator=gen(i))
        return idx, (m.embed.weight.float()[idx].mean(1) @ readout).argmax(1)
    opt = {"fp16_trainable_only": adamw(3e-3),
           "fp16_sgd_momentum_over_all_params": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
           }.get(case, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3))
    quiet(run(m, tokens, ce, tmp_path, steps=40, every=1, opt=opt, dtype=dtype))
    assert m.embed.weight.dtype == dtype and m.embed.weight.grad is None


class TextToImage(nn.Module):
    """Stable-Diffusion-style: a frozen text encoder cast to fp16 and run under no_grad, conditioning a trainable
    fp32 denoiser through cross-attention."""

    def __init__(self, d=32):
        super().__init__()
        self.text_encoder = nn.Sequential(nn.Embedding(100, d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.text_encoder.half().requires_grad_(False).eval()
        self.inp = nn.Linear(16, d)
        self.xattn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.t_mlp = nn.Sequential(nn.Linear(32, d), nn.SiLU())
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 16))

    def forward(self, x, t, ids):
        with torch.no_grad():
            ctx = self.text_encoder(ids)
        h = (self.inp(x) + self.t_mlp(timestep_embedding(t, 32)))[:, None]
        h = h + self.xattn(h, ctx, ctx, need_weights=False)[0]
        return self.out(h[:, 0])


def test_frozen_fp16_text_encoder_under_no_grad_trainable_fp32_denoiser(tmp_path):
    torch.manual_seed(0)

    def batch(i):
        xt, t, v = diffusion_batch(i)
        return xt, t, torch.randint(0, 100, (xt.shape[0], 5), generator=gen(i + 1)), v
    quiet(run(TextToImage(), batch, lambda m, xt, t, ids, v: F.mse_loss(m(xt, t, ids).float(), v), tmp_path,
              steps=50, every=1, opt=adamw(2e-3), must_fall=0.95))


# --- straight-through estimators --------------------------------------------------------------------------------

def fake_quant(x, bits=8):
    """Symmetric per-tensor fake quantisation with a straight-through gradient; the scale in fp32."""
    qmax = 2 ** (bits - 1) - 1
    s = x.detach().float().abs().amax().clamp(min=1e-8) / qmax
    q = (x.float() / s).round().clamp(-qmax - 1, qmax) * s
    return x + (q.to(x.dtype) - x).detach()


class QLinear(nn.Linear):
    def forward(self, x):
        return F.linear(fake_quant(x), fake_quant(self.weight, 4), self.bias)


class QATNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f1, self.f2, self.f3 = QLinear(20, 64), QLinear(64, 64), QLinear(64, 4)

    def forward(self, x):
        h = F.relu(self.f1(x))
        h = F.relu(self.f2(h))
        return self.f3(h)


class BinaryAct(torch.autograd.Function):
    """sign() forward, hardtanh's gradient backward (BinaryConnect's STE)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1).to(g.dtype)


@EVERY
def test_quantisation_aware_training_round_and_detach_straight_through(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(QATNet(), vectors, ce, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


def test_binary_activations_custom_function_straight_through(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 128), nn.BatchNorm1d(128))
    head = nn.Linear(128, 4)
    model = nn.ModuleDict({"enc": m, "head": head})
    quiet(run(model, vectors, lambda md, x, y: F.cross_entropy(md["head"](BinaryAct.apply(md["enc"](x))), y),
              tmp_path, steps=40, every=1, opt=adamw(3e-3)))


# --- nested autocast, output conventions, several forwards --------------------------------------------------------

class NestedAutocast(nn.Module):
    """Attention scores and softmax in an inner `autocast(enabled=False)` block on `.float()` inputs, with the
    value projection re-entering fp16 inside it (`autocast(dtype=float16)` nested in the disabled region)."""

    def __init__(self, d=32, T=8):
        super().__init__()
        self.inp = nn.Linear(20, T * d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.out = nn.Linear(d, 4)
        self.T, self.d = T, d

    def forward(self, x):
        h = self.inp(x).view(x.shape[0], self.T, self.d)
        with torch.autocast("cpu", enabled=False):
            hf = h.float()
            att = torch.softmax(self.q(hf) @ self.k(hf).transpose(1, 2) / math.sqrt(self.d), -1)
            with torch.autocast("cpu", dtype=torch.float16):
                v = self.v(h)
            ctx = att @ v.float()
        return self.out(self.o(ctx).mean(1))


@EVERY
def test_nested_autocast_fp32_attention_inside_fp16_again_inside_that(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(NestedAutocast(), vectors, ce, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


class HFStyle(nn.Module):
    """Keyword arguments in, a dict with the loss (computed inside forward, in fp32) and the logits out."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        logits = self.f(input_ids * attention_mask[:, :, None].to(input_ids.dtype)).mean(1)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


@EVERY
def test_kwargs_in_dict_with_loss_out(every, tmp_path):
    def batch(i):
        x, y = vectors(i)
        feats = x[:, None].expand(-1, 5, -1).clone()
        mask = torch.ones(32, 5, dtype=torch.long)
        mask[:, 3:] = torch.randint(0, 2, (32, 2), generator=gen(i + 3))
        return feats, mask, y
    torch.manual_seed(0)
    quiet(run(HFStyle(), batch, lambda m, f, a, y: m(input_ids=f, attention_mask=a, labels=y)["loss"], tmp_path,
              steps=40, every=every, opt=adamw(3e-3)))


class TupleOut(nn.Module):
    """forward -> (loss, logits, aux): aux an fp32 dict of a penalty and a detached accuracy."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x, y):
        logits = self.f(x)
        pen = logits.float().pow(2).mean()
        loss = F.cross_entropy(logits, y) + 1e-3 * pen
        return loss, logits, {"penalty": pen, "acc": (logits.argmax(1) == y).float().mean().detach()}


@EVERY
def test_forward_returning_loss_logits_aux_tuple(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(TupleOut(), vectors, lambda m, x, y: m(x, y)[0], tmp_path, steps=40, every=every, opt=adamw(3e-3)))


class BYOL(nn.Module):
    """An online encoder + projector + predictor, and an EMA target (encoder + projector) that is a submodule of
    the model but takes no gradient: two views, four forwards, one backward; the target moves by EMA after each
    step."""

    def __init__(self, d=20, h=64, z=32):
        super().__init__()
        def enc():
            return nn.Sequential(nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, z))
        self.online = enc()
        self.predictor = nn.Sequential(nn.Linear(z, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, z))
        self.target = enc()
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)

    def forward(self, v1, v2):
        p1, p2 = self.predictor(self.online(v1)), self.predictor(self.online(v2))
        with torch.no_grad():
            t1, t2 = self.target(v1), self.target(v2)

        def cos(p, t):
            return 2 - 2 * F.cosine_similarity(p.float(), t.float(), dim=-1).mean()
        return cos(p1, t2) + cos(p2, t1)

    def ema(self, tau=0.99):
        for po, pt in zip(self.online.parameters(), self.target.parameters()):
            pt.lerp_(po, 1 - tau)
        for bo, bt in zip(self.online.buffers(), self.target.buffers()):
            bt.copy_(bo)


@EVERY
def test_byol_two_views_online_and_ema_target_one_backward(every, tmp_path):
    torch.manual_seed(0)
    m = BYOL()

    def batch(i):
        g = gen(i)
        x = torch.randn(64, 20, generator=g)
        return x + 0.3 * torch.randn(64, 20, generator=g), x * (1 + 0.1 * torch.randn(64, 20, generator=g))
    quiet(run(m, batch, lambda m, a, b: m(a, b), tmp_path, steps=40, every=every, opt=adamw(3e-3),
              after=lambda i: m.ema(), must_fall=0.9))


# --- shared layers, gradients through frozen parts, gradient reversal, adversarial inputs --------------------------

class ALBERTish(nn.Module):
    """One encoder layer applied 4 times (ALBERT / Universal Transformer weight sharing) and one GRUCell unrolled
    over 6 steps: each module runs several times per forward and backward."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(20, d)
        self.shared = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.cell = nn.GRUCell(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x).view(x.shape[0], 1, -1).expand(-1, 4, -1)
        for _ in range(4):
            h = self.shared(h)
        s = torch.zeros_like(h[:, 0])
        for t in range(6):
            s = self.cell(h[:, t % 4], s)
        return self.out(s)


@EVERY
def test_one_layer_shared_across_depth_and_an_unrolled_gru_cell(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(ALBERTish(), vectors, ce, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


class Perceptual(nn.Module):
    """An image-to-image net trained with a perceptual loss: a frozen, eval-mode feature network (part of the
    model, no parameter takes a gradient) that the gradient flows through to the generator."""

    def __init__(self):
        super().__init__()
        self.gen = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1))
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2,
                                      padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1))
        self.features.requires_grad_(False).eval()

    def train(self, mode=True):
        super().train(mode)
        self.features.eval()
        return self

    def forward(self, x):
        return self.gen(x)


@EVERY
def test_perceptual_loss_through_a_frozen_feature_network(every, tmp_path):
    torch.manual_seed(0)

    def batch(i):
        clean = F.avg_pool2d(torch.randn(8, 3, 16, 16, generator=gen(i)), 3, 1, 1) * 2
        return clean + 0.3 * torch.randn(8, 3, 16, 16, generator=gen(i + 1)), clean

    def loss(m, noisy, clean):
        out = m(noisy)
        return F.l1_loss(out.float(), clean) + F.mse_loss(m.features(out).float(), m.features(clean).float())
    quiet(run(Perceptual(), batch, loss, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class DANN(nn.Module):
    """Domain-adversarial training: a label head and a domain head behind a gradient reversal layer."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.label = nn.Linear(64, 4)
        self.domain = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, lam):
        h = self.features(x)
        return self.label(h), self.domain(GradReverse.apply(h, lam)).squeeze(-1)


@EVERY
def test_domain_adversarial_gradient_reversal(every, tmp_path):
    torch.manual_seed(0)

    def batch(i):
        xs, ys = vectors(i)
        xt, _ = vectors(i + 500)
        lam = 2 / (1 + math.exp(-10 * i / 40)) - 1        # DANN's schedule from 0 to ~1
        return torch.cat([xs, 0.5 * xt + 1.0]), ys, lam

    def loss(m, x, ys, lam):
        logits, dom = m(x, lam)
        d = torch.cat([torch.zeros(32), torch.ones(32)])
        return F.cross_entropy(logits[:32], ys) + 0.1 * F.binary_cross_entropy_with_logits(dom.float(), d)
    quiet(run(DANN(), batch, loss, tmp_path, steps=40, every=every, opt=adamw(3e-3)))


@EVERY
def test_fgsm_adversarial_training_input_gradient_from_the_scaled_loss(every, tmp_path):
    """Each step: the input gradient by torch.autograd.grad of the *scaled* loss (only its sign is used, as the
    AMP docs do for gradient penalties), then the ordinary scaled backward on clean + adversarial inputs."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    state = {}

    def loss(m, x, y):
        x = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(state["scaler"].scale(F.cross_entropy(m(x), y)), x)
        x_adv = (x + 0.1 * gx.sign()).detach()
        return 0.5 * (F.cross_entropy(m(x.detach()), y) + F.cross_entropy(m(x_adv), y))
    quiet(run(m, vectors, loss, tmp_path, steps=40, every=every, opt=adamw(3e-3), state=state))
