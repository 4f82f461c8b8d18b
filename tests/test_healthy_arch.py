"""Healthy runs of architectures that tests/test_healthy*.py do not cover, each of which must raise no warning and
no error (shared/CONTRACT.md): a ViT (patch-embedding conv, class token, pre-norm blocks, GELU); ConvNeXt blocks
(depthwise 7x7 conv, LayerNorm over channels-last, layer scale 1e-6); a UNet with self-attention at the bottleneck,
GroupNorm/SiLU and a timestep embedding on a noise-prediction loss; a wav2vec-style 1D conv feature encoder (GroupNorm
in its first layer, a weight-normalised grouped positional conv) feeding a transformer; an MLP-Mixer; a Perceiver
(cross-attention from learned latents to the inputs, weights shared across its repeats); a Mamba-style selective
scan in plain PyTorch (A = -exp(A_log) and exp(A*dt) in fp32, the scan as a cumsum/segment-sum); RWKV-4 time mixing
(exp decay and the max-stabilised WKV recurrence in fp32) with squared-ReLU channel mixing; a Hyena operator (an
implicit long filter, torch.fft.rfft/irfft under autocast); a GCN (symmetric degree normalisation, messages through
index_add_); a decision transformer (return, state and action embeddings interleaved into one causal sequence); a
VQ-VAE (straight-through estimator, codebook + commitment loss, no EMA); a Siamese network with a contrastive margin
loss; capsules with dynamic routing (softmax iterations, squash); SE-ResNeXt blocks (grouped 3x3 convs, squeeze-
excitation); weight-standardised convs with GroupNorm (BiT's eps 1e-10 and timm's batch_norm form); DETR's set
prediction loss (learned queries through a transformer decoder, a greedy bipartite match, no-object weight, L1 +
GIoU). 30 steps each, fp16 autocast on the CPU with GradScaler("cpu") (bf16 without a scaler for the ViT, the
Mamba scan and Hyena as well), at ampdoctor's default sampling and at every=1, `headroom=True` for some; each run is
asserted healthy (finite, loss falling, few backoffs) and judged through w.report() and ampdoctor.diagnose(run_dir).
Every op here runs under CPU fp16 autocast, but an fp16 conv's backward on the CPU is ~50x slower than bf16's, so
the conv models are small (8x8 or 16x16 inputs with a strided stem, 8-16 channels, batches of 8)."""
import functools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


sys.path.insert(0, str(Path(__file__).parent))
from scenarios import EVERY, gen, healthy_run, one_thread, quiet, randn  # noqa: E402


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

# ampdoctor's default sampling, every step, and the default sampling with the every-step headroom series
SAMPLING = pytest.mark.parametrize("every,headroom", [(None, None), (1, None), (None, True)],
                                   ids=["default", "every1", "headroom"])


run = functools.partial(healthy_run, steps=30, lr=3e-3)  # (AdamW; the scaler from 65536, as GradScaler's default)


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


# --- data ---------------------------------------------------------------------------------------------------------

def images(i, B=16, C=3, H=16, K=4, noise=0.7, y=None):
    """K fixed smooth class templates (4x4 noise upsampled) plus per-sample noise; labels random per step."""
    tmpl = F.interpolate(randn(K, C, 4, 4, seed=123), size=(H, H), mode="bilinear", align_corners=False)
    g = gen(i)
    y = torch.randint(0, K, (B,), generator=g) if y is None else y
    return tmpl[y] + noise * torch.randn(B, C, H, H, generator=g), y


def audio(i, B=8, L=320, K=4):
    """Sinusoids whose frequency is the class, random phase and amplitude, plus noise."""
    g = gen(i)
    y = torch.randint(0, K, (B,), generator=g)
    t = torch.arange(L) / L
    ph = torch.rand(B, 1, generator=g) * 6.28
    amp = 0.5 + torch.rand(B, 1, generator=g)
    x = amp * torch.sin(2 * math.pi * (6 + 9 * y[:, None]) * t + ph) + 0.3 * torch.randn(B, L, generator=g)
    return x[:, None], y


def arith(i, B=8, T=16, V=64, stride=5):
    """Sequences (start + stride * t) % V: next-token prediction learnable in a few dozen steps."""
    start = torch.randint(0, V, (B, 1), generator=gen(i))
    return ((start + stride * torch.arange(T)) % V,)


def lm_loss(m, idx):
    return F.cross_entropy(m(idx)[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten())


# --- shared transformer parts ---------------------------------------------------------------------------------------

class Attn(nn.Module):
    """Multi-head attention through SDPA; kv from `ctx` when given (cross-attention)."""

    def __init__(self, d=32, h=4, dk=None, causal=False):
        super().__init__()
        self.h, self.causal = h, causal
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(dk or d, 2 * d), nn.Linear(d, d)

    def forward(self, x, ctx=None):
        B, T, C = x.shape
        ctx = x if ctx is None else ctx
        q = self.q(x).view(B, T, self.h, -1).transpose(1, 2)
        k, v = (t.view(B, ctx.shape[1], self.h, -1).transpose(1, 2) for t in self.kv(ctx).chunk(2, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(o.transpose(1, 2).reshape(B, T, C))


class PreNorm(nn.Module):
    def __init__(self, d=32, h=4, causal=False, mult=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attn(d, h, causal=causal)
        self.mlp = nn.Sequential(nn.Linear(d, mult * d), nn.GELU(), nn.Linear(mult * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# --- ViT ------------------------------------------------------------------------------------------------------------

class ViT(nn.Module):
    def __init__(self, d=32, n=2, patch=4, H=16, K=4):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (H // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.ModuleList(PreNorm(d) for _ in range(n))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, K)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], 1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x[:, 0]))


@SAMPLING
def test_vit_patch_conv_class_token_prenorm_gelu(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(ViT(), images, ce, tmp_path, steps=30, every=every, headroom=headroom))


def test_vit_bf16_without_a_scaler(tmp_path):
    torch.manual_seed(0)
    quiet(run(ViT(), images, ce, tmp_path, steps=30, every=1, dtype=torch.bfloat16))


# --- ConvNeXt -------------------------------------------------------------------------------------------------------

class ConvNeXtBlock(nn.Module):
    def __init__(self, d, ls=1e-6):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(ls * torch.ones(d))

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)                     # channels-last for the LayerNorm and the MLP
        h = self.gamma * self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims=(16, 32), K=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        self.stage1 = nn.Sequential(ConvNeXtBlock(dims[0]), ConvNeXtBlock(dims[0]))
        self.down = nn.Sequential(LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, stride=2))
        self.stage2 = nn.Sequential(ConvNeXtBlock(dims[1]), ConvNeXtBlock(dims[1]))
        self.norm, self.head = nn.LayerNorm(dims[1], eps=1e-6), nn.Linear(dims[1], K)

    def forward(self, x):
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean((2, 3))))


@SAMPLING
def test_convnext_depthwise_7x7_channels_last_layernorm_layer_scale_1e_6(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(ConvNeXt(), images, ce, tmp_path, steps=30, every=every, headroom=headroom))


# --- UNet with bottleneck attention ---------------------------------------------------------------------------------

class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim=32):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x))) + self.t(F.silu(temb))[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class AttnBlock2d(nn.Module):
    def __init__(self, c, h=4):
        super().__init__()
        self.norm, self.qkv, self.proj, self.h = nn.GroupNorm(4, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1), h

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = (t.reshape(B, self.h, C // self.h, H * W).transpose(-1, -2)
                   for t in self.qkv(self.norm(x)).chunk(3, 1))
        o = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(B, C, H, W)
        return x + self.proj(o)


def timestep_embedding(t, dim=32):
    half = dim // 2
    f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    a = t.float()[:, None] * f
    return torch.cat([a.cos(), a.sin()], -1)


class AttnUNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 32))
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.d1 = ResBlock(c, c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid1, self.mid_attn, self.mid2 = ResBlock(2 * c, 2 * c), AttnBlock2d(2 * c), ResBlock(2 * c, 2 * c)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.upc = nn.Conv2d(2 * c, c, 3, padding=1)
        self.u1 = ResBlock(2 * c, c)
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x, t):
        te = self.temb(timestep_embedding(t))
        h1 = self.d1(self.inp(x), te)
        h = self.mid2(self.mid_attn(self.mid1(self.down(h1), te)), te)
        h = self.u1(torch.cat([self.upc(self.up(h)), h1], 1), te)
        return self.out(h)


ABAR = torch.cos(torch.linspace(0, 1, 101) * math.pi / 2).clamp(min=1e-3) ** 2   # a cosine schedule, 100 steps


def noised(i, B=8):
    x0, _ = images(i, B=B, H=8, noise=0.1)
    g = gen(1000 + i)
    t = torch.randint(0, 100, (B,), generator=g)
    eps = torch.randn(x0.shape, generator=g)
    a = ABAR[t][:, None, None, None]
    return a.sqrt() * x0 + (1 - a).sqrt() * eps, t, eps


def eps_loss(m, xt, t, eps):
    return F.mse_loss(m(xt, t).float(), eps)


@EVERY
def test_unet_groupnorm_silu_attention_at_bottleneck_noise_prediction(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(AttnUNet(), noised, eps_loss, tmp_path, steps=30, every=every, lr=2e-3))


# --- wav2vec-style conv feature encoder + transformer ---------------------------------------------------------------

class Wav2Vec(nn.Module):
    def __init__(self, d=32, K=4):
        super().__init__()
        self.fe = nn.Sequential(nn.Conv1d(1, d, 10, stride=5, bias=False), nn.GroupNorm(d, d), nn.GELU(),
                                nn.Conv1d(d, d, 3, stride=2, bias=False), nn.GELU(),
                                nn.Conv1d(d, d, 3, stride=2, bias=False), nn.GELU())
        self.fp_norm, self.fp = nn.LayerNorm(d), nn.Linear(d, d)
        self.pos_conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(d, d, 8, padding=4, groups=4), dim=2)
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(PreNorm(d) for _ in range(2))
        self.head = nn.Linear(d, K)

    def forward(self, wav):
        wav = (wav - wav.mean(-1, keepdim=True)) / (wav.std(-1, keepdim=True) + 1e-5)   # feature extractor's norm
        x = self.fp(self.fp_norm(self.fe(wav).transpose(1, 2)))
        x = x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)        # SamePad drops one
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


@SAMPLING
def test_wav2vec_conv_feature_encoder_positional_conv_transformer(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(Wav2Vec(), audio, ce, tmp_path, steps=30, every=every, headroom=headroom))


# --- MLP-Mixer ------------------------------------------------------------------------------------------------------

class MixerBlock(nn.Module):
    def __init__(self, n_tok, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.tok = nn.Sequential(nn.Linear(n_tok, 2 * n_tok), nn.GELU(), nn.Linear(2 * n_tok, n_tok))
        self.ch = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.tok(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.ln2(x))


class Mixer(nn.Module):
    def __init__(self, d=32, K=4):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.Sequential(MixerBlock(16, d), MixerBlock(16, d))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, K)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.stem(x).flatten(2).transpose(1, 2))).mean(1))


@EVERY
def test_mlp_mixer_token_and_channel_mixing(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(Mixer(), images, ce, tmp_path, steps=30, every=every))


# --- Perceiver ------------------------------------------------------------------------------------------------------

class Perceiver(nn.Module):
    def __init__(self, din=8, d=32, n_lat=8, repeats=2, K=4):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n_lat, d) * 0.02)
        self.inp = nn.Linear(din, d)
        self.ln_q, self.ln_kv, self.cross = nn.LayerNorm(d), nn.LayerNorm(d), Attn(d, 1)
        self.cross_mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.latent_blocks = nn.ModuleList(PreNorm(d, mult=2) for _ in range(2))
        self.repeats = repeats
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, K))

    def forward(self, x):
        kv = self.ln_kv(self.inp(x))
        z = self.latents.expand(x.shape[0], -1, -1)
        for _ in range(self.repeats):                      # the cross-attention's weights shared across repeats
            z = z + self.cross(self.ln_q(z), kv)
            z = z + self.cross_mlp(z)
            for b in self.latent_blocks:
                z = b(z)
        return self.head(z.mean(1))


def point_sets(i, B=16, M=32, din=8, K=4):
    """Sets of M points scattered around one of K fixed centres (the class), in random order."""
    centres = randn(K, din, seed=77)
    g = gen(i)
    y = torch.randint(0, K, (B,), generator=g)
    return centres[y][:, None] + 1.5 * torch.randn(B, M, din, generator=g), y


@EVERY
def test_perceiver_cross_attention_to_latents_shared_repeats(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(Perceiver(), point_sets, ce, tmp_path, steps=30, every=every))


# --- Mamba-style selective scan -----------------------------------------------------------------------------------

class Mamba(nn.Module):
    """S6 in plain PyTorch: dt = softplus(.) and A = -exp(A_log) in fp32, the discretised decay exp(A*dt) as a
    segment sum of a cumsum (h_t = sum_{s<=t} exp(cum_t - cum_s) dt_s B_s x_s), the output gated by silu(z)."""

    def __init__(self, d=32, n=8, expand=2, k=4, rank=4):
        super().__init__()
        di = expand * d
        self.n, self.rank = n, rank
        self.in_proj = nn.Linear(d, 2 * di, bias=False)
        self.conv = nn.Conv1d(di, di, k, groups=di, padding=k - 1)
        self.x_proj = nn.Linear(di, rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(rank, di)
        dt = torch.exp(torch.rand(di) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))    # inverse softplus
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(di, 1))
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = nn.Linear(di, d, bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        x, z = self.in_proj(x).chunk(2, -1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :L].transpose(1, 2))
        dt, Bm, Cm = self.x_proj(x).split([self.rank, self.n, self.n], -1)
        dt = F.softplus(self.dt_proj(dt).float())                              # (B, L, di) fp32
        A = -torch.exp(self.A_log.float())                                      # (di, n)
        cum = (dt[..., None] * A).cumsum(1)                                     # (B, L, di, n)
        seg = cum[:, :, None] - cum[:, None]                                    # (B, t, s, di, n)
        causal = torch.ones(L, L, dtype=torch.bool).tril()[None, :, :, None, None]
        decay = torch.exp(seg.masked_fill(~causal, float("-inf")))
        u = dt[..., None] * Bm.float()[:, :, None] * x.float()[..., None]      # (B, L, di, n)
        h = torch.einsum("btsdn,bsdn->btdn", decay, u)
        y = torch.einsum("btdn,btn->btd", h, Cm.float()) + self.D * x.float()
        return self.out_proj(y.to(x.dtype) * F.silu(z))


class SeqLM(nn.Module):
    """Embedding -> n x (x + mixer(norm(x)) [+ ffn(norm(x))]) -> norm -> head."""

    def __init__(self, mixer, V=64, d=32, n=2, ffn=None):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.mixers = nn.ModuleList(mixer(d) for _ in range(n))
        self.ffn_norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n)) if ffn else None
        self.ffns = nn.ModuleList(ffn(d) for _ in range(n)) if ffn else None
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for j, (ln, mix) in enumerate(zip(self.norms, self.mixers)):
            x = x + mix(ln(x))
            if self.ffns is not None:
                x = x + self.ffns[j](self.ffn_norms[j](x))
        return self.head(self.norm(x))


@EVERY
def test_mamba_selective_scan_exp_a_dt_in_fp32_cumsum(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(SeqLM(Mamba), arith, lm_loss, tmp_path, steps=30, every=every))


def test_mamba_selective_scan_bf16_without_a_scaler(tmp_path):
    torch.manual_seed(0)
    quiet(run(SeqLM(Mamba), arith, lm_loss, tmp_path, steps=30, every=1, headroom=True, dtype=torch.bfloat16))


# --- RWKV -----------------------------------------------------------------------------------------------------------

class TimeMix(nn.Module):
    """RWKV-4 time mixing: token shift, w = -exp(time_decay) and the WKV recurrence in fp32, max-stabilised as the
    reference CUDA kernel does (pp starts at -1e38)."""

    def __init__(self, d):
        super().__init__()
        self.time_decay = nn.Parameter(torch.linspace(-5, 1, d))
        self.time_first = nn.Parameter(torch.full((d,), math.log(0.3)))
        self.mix_k, self.mix_v, self.mix_r = (nn.Parameter(torch.linspace(0.2, 0.8, d)) for _ in range(3))
        self.key, self.value, self.receptance, self.output = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, C = x.shape
        xx = F.pad(x, (0, 0, 1, -1))                                           # x shifted one step back in time
        k = self.key(x * self.mix_k + xx * (1 - self.mix_k)).float()
        v = self.value(x * self.mix_v + xx * (1 - self.mix_v)).float()
        r = torch.sigmoid(self.receptance(x * self.mix_r + xx * (1 - self.mix_r)))
        w, u = -torch.exp(self.time_decay.float()), self.time_first.float()
        aa, bb, pp = x.new_zeros(B, C, dtype=torch.float32), x.new_zeros(B, C, dtype=torch.float32), \
            x.new_full((B, C), -1e38, dtype=torch.float32)
        out = []
        for t in range(T):
            kt, vt = k[:, t], v[:, t]
            ww = u + kt
            p = torch.maximum(pp, ww)
            e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
            out.append((e1 * aa + e2 * vt) / (e1 * bb + e2))
            ww = pp + w
            p = torch.maximum(ww, kt)
            e1, e2 = torch.exp(ww - p), torch.exp(kt - p)
            aa, bb, pp = e1 * aa + e2 * vt, e1 * bb + e2, p
        return self.output(r * torch.stack(out, 1).to(r.dtype))


class ChannelMix(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mix_k, self.mix_r = nn.Parameter(torch.full((d,), 0.5)), nn.Parameter(torch.full((d,), 0.5))
        self.key, self.receptance, self.value = nn.Linear(d, 4 * d, bias=False), nn.Linear(d, d, bias=False), \
            nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        xx = F.pad(x, (0, 0, 1, -1))
        k = torch.square(torch.relu(self.key(x * self.mix_k + xx * (1 - self.mix_k))))
        return torch.sigmoid(self.receptance(x * self.mix_r + xx * (1 - self.mix_r))) * self.value(k)


@SAMPLING
def test_rwkv_time_mixing_exp_decay_wkv_in_fp32_channel_mixing(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(SeqLM(TimeMix, ffn=ChannelMix), arith, lm_loss, tmp_path, steps=30, every=every, headroom=headroom))


# --- Hyena ----------------------------------------------------------------------------------------------------------

class Sin(nn.Module):
    def __init__(self, d, w=10.0):
        super().__init__()
        self.freq = nn.Parameter(w * torch.ones(1, d))

    def forward(self, x):
        return torch.sin(self.freq * x)


class HyenaFilter(nn.Module):
    """The implicit long filter: positional features (t, cos, sin) -> MLP with sin activations -> exponential
    decay window."""

    def __init__(self, d, L=64, emb=5, order=16):
        super().__init__()
        t = torch.linspace(0, 1, L)[:, None]
        bands = (emb - 1) // 2
        f = torch.linspace(1e-4, bands - 1, bands)[None]
        ang = 2 * math.pi * f * torch.linspace(0, 1, L)[:, None]
        self.register_buffer("z", torch.cat([t, ang.cos(), ang.sin()], -1))
        self.register_buffer("t", t)
        self.mlp = nn.Sequential(nn.Linear(emb, order), Sin(order), nn.Linear(order, order), Sin(order),
                                 nn.Linear(order, d, bias=False))
        self.register_buffer("deltas", torch.linspace(math.log(1e-2) / 1.5, math.log(1e-2) / 0.3, d)[None])

    def forward(self, L):
        return self.mlp(self.z[:L]) * torch.exp(-self.t[:L] * self.deltas.abs())          # (L, d)


def fftconv(u, k, D):
    """Hyena's fftconv_ref: a causal convolution of u (B, d, L) with k (d, L) through rfft/irfft at 2L (autocast
    on the CPU runs the FFTs in fp32), plus the skip D."""
    L = u.shape[-1]
    n = 2 * L
    k_f = torch.fft.rfft(k, n=n) / n
    u_f = torch.fft.rfft(u.to(k.dtype), n=n)
    y = torch.fft.irfft(u_f * k_f, n=n, norm="forward")[..., :L]
    return (y + u * D[:, None]).to(u.dtype)


class Hyena(nn.Module):
    def __init__(self, d, L=64):
        super().__init__()
        self.d = d
        self.in_proj, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.short = nn.Conv1d(3 * d, 3 * d, 3, padding=2, groups=3 * d)
        self.filter = HyenaFilter(d, L)
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, u):
        L = u.shape[1]
        uc = self.short(self.in_proj(u).transpose(1, 2))[..., :L]
        x1, x2, v = uc.split(self.d, 1)
        v = fftconv(v * x1, self.filter(L).transpose(0, 1), self.bias)
        return self.out_proj((v * x2).transpose(1, 2))


def hyena_ffn(d):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


@EVERY
def test_hyena_implicit_filter_fft_long_convolution_under_autocast(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(SeqLM(Hyena, ffn=hyena_ffn), lambda i: arith(i, T=32), lm_loss, tmp_path, steps=30, every=every))


def test_hyena_bf16_without_a_scaler(tmp_path):
    torch.manual_seed(0)
    quiet(run(SeqLM(Hyena, ffn=hyena_ffn), lambda i: arith(i, T=32), lm_loss, tmp_path, steps=30, every=1,
              dtype=torch.bfloat16))


# --- GCN ------------------------------------------------------------------------------------------------------------

def sbm_graph(i, N=96, K=4, din=16, p_in=0.15, p_out=0.01):
    """A stochastic block model: K communities (the labels), features = a noisy community signature, so that
    neighbourhood averaging helps."""
    g = gen(i)
    y = torch.randint(0, K, (N,), generator=g)
    same = y[:, None] == y[None]
    adj = torch.rand(N, N, generator=g) < torch.where(same, p_in, p_out)
    adj = torch.triu(adj, 1)
    src, dst = adj.nonzero(as_tuple=True)
    ei = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])
    x = randn(K, din, seed=55)[y] + 2.0 * torch.randn(N, din, generator=g)
    return x, ei, y


class GCNConv(nn.Module):
    """Kipf & Welling: D^-1/2 (A + I) D^-1/2 X W, messages scattered with index_add_."""

    def __init__(self, din, dout):
        super().__init__()
        self.lin = nn.Linear(din, dout, bias=False)
        self.bias = nn.Parameter(torch.zeros(dout))

    def forward(self, x, ei):
        N = x.shape[0]
        loops = torch.arange(N)
        src, dst = torch.cat([ei[0], loops]), torch.cat([ei[1], loops])
        deg = torch.zeros(N).index_add_(0, dst, torch.ones(dst.numel()))
        dinv = deg.pow(-0.5).masked_fill(deg == 0, 0)
        h = self.lin(x)
        msg = h[src] * (dinv[src] * dinv[dst]).to(h.dtype)[:, None]
        return h.new_zeros(N, h.shape[1]).index_add_(0, dst, msg) + self.bias


class GCN(nn.Module):
    def __init__(self, din=16, d=32, K=4):
        super().__init__()
        self.c1, self.c2, self.c3 = GCNConv(din, d), GCNConv(d, d), GCNConv(d, K)

    def forward(self, x, ei):
        h = F.dropout(F.relu(self.c1(x, ei)), 0.2, self.training)
        h = F.relu(self.c2(h, ei))
        return self.c3(h, ei)


@SAMPLING
def test_gcn_message_passing_symmetric_degree_normalisation(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(GCN(), sbm_graph, lambda m, x, ei, y: F.cross_entropy(m(x, ei), y), tmp_path, steps=30, every=every,
              headroom=headroom, lr=1e-2))


# --- decision transformer -------------------------------------------------------------------------------------------

class DecisionTransformer(nn.Module):
    def __init__(self, ds=8, A=4, d=32, T=10, n=2):
        super().__init__()
        self.ret, self.state, self.act = nn.Linear(1, d), nn.Linear(ds, d), nn.Embedding(A, d)
        self.time = nn.Embedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(PreNorm(d, causal=True) for _ in range(n))
        self.norm, self.pred = nn.LayerNorm(d), nn.Linear(d, A)

    def forward(self, rtg, s, a, ts):
        B, T = a.shape
        te = self.time(ts)
        x = torch.stack([self.ret(rtg) + te, self.state(s) + te, self.act(a) + te], 2).reshape(B, 3 * T, -1)
        x = self.ln(x)                                                  # (R_1, s_1, a_1, R_2, s_2, a_2, ...)
        for b in self.blocks:
            x = b(x)
        return self.pred(self.norm(x[:, 1::3]))                           # the action from each state token


def trajectories(i, B=16, T=10, ds=8, A=4):
    """An expert acting argmax(s @ W); rewards 1 per step, returns-to-go scaled by 1/T as in the paper's code."""
    W = randn(ds, A, seed=31)
    g = gen(i)
    s = torch.randn(B, T, ds, generator=g)
    a = (s @ W).argmax(-1)
    rtg = (T - torch.arange(T, dtype=torch.float32)).expand(B, T)[..., None] / T
    return rtg, s, a, torch.arange(T).expand(B, T)


@EVERY
def test_decision_transformer_interleaved_return_state_action_tokens(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(DecisionTransformer(), trajectories,
              lambda m, rtg, s, a, ts: F.cross_entropy(m(rtg, s, a, ts).flatten(0, 1), a.flatten()),
              tmp_path, steps=30, every=every))


# --- VQ-VAE ---------------------------------------------------------------------------------------------------------

class VQVAE(nn.Module):
    def __init__(self, c=16, dz=16, K=64, beta=0.25):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, c, 4, 2, 1), nn.ReLU(), nn.Conv2d(c, dz, 4, 2, 1))
        self.codebook = nn.Embedding(K, dz)
        nn.init.normal_(self.codebook.weight)
        self.dec = nn.Sequential(nn.ConvTranspose2d(dz, c, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(c, 3, 4, 2, 1))
        self.beta = beta

    def forward(self, x):
        ze = self.enc(x)                                                   # (B, dz, 4, 4)
        flat = ze.permute(0, 2, 3, 1).reshape(-1, ze.shape[1])
        E = self.codebook.weight
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ E.t() + E.pow(2).sum(1)
        zq = self.codebook(dist.argmin(1)).view(ze.shape[0], ze.shape[2], ze.shape[3], -1).permute(0, 3, 1, 2)
        vq = F.mse_loss(zq, ze.detach().to(zq.dtype)) + self.beta * F.mse_loss(ze, zq.detach().to(ze.dtype))
        zq = ze + (zq.to(ze.dtype) - ze).detach()                            # straight-through
        return self.dec(zq), vq


def vq_loss(m, x, _y):
    rec, vq = m(x)
    return F.mse_loss(rec.float(), x) + vq


@EVERY
def test_vqvae_straight_through_codebook_and_commitment_loss(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(VQVAE(), lambda i: images(i, B=8, noise=0.2), vq_loss, tmp_path, steps=30, every=every))


# --- Siamese network, contrastive margin loss ----------------------------------------------------------------------

class Siamese(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, d))

    def forward(self, a, b):
        return F.pairwise_distance(self.enc(a), self.enc(b))


def pairs(i, B=8, K=4):
    """Image pairs: half of the same class (two independent noisy draws of its template), half of another."""
    g = gen(9000 + i)
    y1 = torch.randint(0, K, (B,), generator=g)
    same = torch.rand(B, generator=g) < 0.5
    y2 = torch.where(same, y1, (y1 + torch.randint(1, K, (B,), generator=g)) % K)
    return images(i, B=B, y=y1)[0], images(5000 + i, B=B, y=y2)[0], same.float()


def contrastive(m, a, b, same, margin=2.0):
    d = m(a, b).float()
    return 0.5 * (same * d.pow(2) + (1 - same) * F.relu(margin - d).pow(2)).mean()


@EVERY
def test_siamese_shared_encoder_contrastive_margin_loss(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(Siamese(), pairs, contrastive, tmp_path, steps=30, every=every))


# --- capsules with dynamic routing ------------------------------------------------------------------------------

def squash(s, eps=1e-8):
    sq = s.pow(2).sum(-1, keepdim=True)
    return sq / (1 + sq) * s / torch.sqrt(sq + eps)


class CapsNet(nn.Module):
    """Primary capsules from a conv, u_hat = W u per (input capsule, class), three routing iterations (softmax of
    the agreement logits over classes, squash); the routing and squash in fp32 (eps 1e-8)."""

    def __init__(self, K=4, iters=3):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 5)
        self.primary = nn.Conv2d(16, 4 * 8, 5, stride=2)                     # 4 capsule maps of dim 8 on 4x4
        self.W = nn.Parameter(0.05 * torch.randn(64, K, 16, 8))
        self.iters = iters

    def forward(self, x):
        u = self.primary(F.relu(self.conv(x)))                               # (B, 32, 4, 4)
        B = u.shape[0]
        u = squash(u.view(B, 4, 8, 16).permute(0, 1, 3, 2).reshape(B, 64, 8).float())
        u_hat = torch.einsum("nkij,bnj->bnki", self.W, u).float()             # fp16 under autocast
        b = torch.zeros(B, 64, u_hat.shape[2])
        for r in range(self.iters):
            c = b.softmax(2)
            v = squash((c[..., None] * u_hat).sum(1))                          # (B, K, 16)
            if r < self.iters - 1:
                b = b + (u_hat.detach() * v.detach()[:, None]).sum(-1)
        return v.norm(dim=-1)


def margin_loss(m, x, y):
    L = m(x)
    t = F.one_hot(y, L.shape[1]).float()
    return (t * F.relu(0.9 - L).pow(2) + 0.5 * (1 - t) * F.relu(L - 0.1).pow(2)).sum(1).mean()


@EVERY
def test_capsules_dynamic_routing_softmax_iterations_margin_loss(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(CapsNet(), lambda i: images(i, B=8), margin_loss, tmp_path, steps=30, every=every))


# --- SE-ResNeXt -----------------------------------------------------------------------------------------------------

class SE(nn.Module):
    def __init__(self, c, r=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // r, 1), nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class SEResNeXtBlock(nn.Module):
    def __init__(self, cin, cout, stride=1, groups=4, width=16):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.b2 = nn.BatchNorm2d(width)
        self.c3, self.b3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.se = SE(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)), inplace=True)
        h = F.relu(self.b2(self.c2(h)), inplace=True)
        return F.relu(self.se(self.b3(self.c3(h))) + self.down(x), inplace=True)


class SEResNeXt(nn.Module):
    def __init__(self, K=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(True))
        self.layer1, self.layer2 = SEResNeXtBlock(16, 32), SEResNeXtBlock(32, 32, stride=2)
        self.fc = nn.Linear(32, K)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


@SAMPLING
def test_se_resnext_grouped_convs_squeeze_excitation(every, headroom, tmp_path):
    torch.manual_seed(0)
    quiet(run(SEResNeXt(), lambda i: images(i, B=8), ce, tmp_path, steps=30, every=every, headroom=headroom))


# --- weight standardisation -----------------------------------------------------------------------------------------

class StdConvBiT(nn.Conv2d):
    """BiT: the weight standardised per output channel in fp32 with eps 1e-10."""

    def forward(self, x):
        v, m = torch.var_mean(self.weight, dim=[1, 2, 3], keepdim=True, unbiased=False)
        w = (self.weight - m) / torch.sqrt(v + 1e-10)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class StdConvTimm(nn.Conv2d):
    """timm's StdConv2d: the standardisation as batch_norm over the flattened weight, eps 1e-6."""

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class PreActWS(nn.Module):
    def __init__(self, conv, c):
        super().__init__()
        self.gn1, self.c1 = nn.GroupNorm(4, c), conv(c, c, 3, padding=1, bias=False)
        self.gn2, self.c2 = nn.GroupNorm(4, c), conv(c, c, 3, padding=1, bias=False)

    def forward(self, x):
        return x + self.c2(F.relu(self.gn2(self.c1(F.relu(self.gn1(x))))))


class WSNet(nn.Module):
    """BiT-style pre-activation blocks: GroupNorm -> ReLU -> weight-standardised conv."""

    def __init__(self, conv, c=16, K=4):
        super().__init__()
        self.stem = conv(3, c, 3, stride=2, padding=1, bias=False)
        self.blocks = nn.Sequential(PreActWS(conv, c), PreActWS(conv, c))
        self.norm, self.fc = nn.GroupNorm(4, c), nn.Linear(c, K)

    def forward(self, x):
        return self.fc(F.relu(self.norm(self.blocks(self.stem(x)))).mean((2, 3)))


@EVERY
@pytest.mark.parametrize("conv", [StdConvBiT, StdConvTimm], ids=["bit_eps_1e-10", "timm_batchnorm_eps_1e-6"])
def test_weight_standardised_convs_with_groupnorm(conv, every, tmp_path):
    torch.manual_seed(0)
    quiet(run(WSNet(conv), lambda i: images(i, B=8, H=8), ce, tmp_path, steps=30, every=every))


# --- DETR-style set prediction --------------------------------------------------------------------------------------

def box_cxcywh_to_xyxy(b):
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def giou(a, b):
    """Pairwise generalised IoU of xyxy boxes a (N, 4), b (M, 4)."""
    area_a, area_b = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1]), (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt, rb = torch.max(a[:, None, :2], b[None, :, :2]), torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a[:, None] + area_b[None] - inter
    iou = inter / union
    lt2, rb2 = torch.min(a[:, None, :2], b[None, :, :2]), torch.max(a[:, None, 2:], b[None, :, 2:])
    hull = (rb2 - lt2).clamp(min=0).prod(-1)
    return iou - (hull - union) / hull


def greedy_match(cost):
    """A greedy stand-in for the Hungarian algorithm: take the cheapest (query, target) pair left, repeat."""
    cost = cost.clone()
    rows, cols = [], []
    for _ in range(min(cost.shape)):
        q, t = divmod(int(cost.argmin()), cost.shape[1])
        rows.append(q)
        cols.append(t)
        cost[q, :] = float("inf")
        cost[:, t] = float("inf")
    return torch.tensor(rows), torch.tensor(cols)


class DETR(nn.Module):
    def __init__(self, d=32, Q=6, K=3):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, d, 3, 2, 1), nn.ReLU(), nn.Conv2d(d, d, 3, 2, 1), nn.ReLU())
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.02)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 64, 0.0, batch_first=True), 1,
                                             enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 4, 64, 0.0, batch_first=True), 2)
        self.query = nn.Embedding(Q, d)
        self.cls = nn.Linear(d, K + 1)                                      # the last class is 'no object'
        self.box = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, x):
        mem = self.encoder(self.backbone(x).flatten(2).transpose(1, 2) + self.pos)
        h = self.decoder(self.query.weight.expand(x.shape[0], -1, -1), mem)
        return self.cls(h), torch.sigmoid(self.box(h))


def scenes(i, B=8, H=16, K=3):
    """1-3 axis-aligned rectangles per image, class c painted into channel c; targets (cx, cy, w, h) in [0, 1]."""
    g = gen(i)
    x = 0.1 * torch.randn(B, 3, H, H, generator=g)
    targets = []
    for b in range(B):
        n = int(torch.randint(1, 4, (1,), generator=g))
        cls = torch.randint(0, K, (n,), generator=g)
        wh = torch.randint(3, 8, (n, 2), generator=g)
        xy = (torch.rand(n, 2, generator=g) * (H - wh)).long()
        for c, (x0, y0), (w, h) in zip(cls.tolist(), xy.tolist(), wh.tolist()):
            x[b, c, y0:y0 + h, x0:x0 + w] += 1.0
        boxes = torch.cat([(xy + wh / 2) / H, wh / H], 1).float()
        targets.append((cls, boxes))
    return x, targets


def set_loss(m, x, targets, eos_coef=0.1, K=3):
    logits, boxes = m(x)
    logits, boxes = logits.float(), boxes.float()
    tgt_cls = torch.full(logits.shape[:2], K, dtype=torch.long)
    l1, gl, nb = 0.0, 0.0, 0
    for b, (cls, tb) in enumerate(targets):
        with torch.no_grad():
            prob = logits[b].softmax(-1)
            cost = (-prob[:, cls] + 5 * torch.cdist(boxes[b], tb, p=1)
                    - 2 * giou(box_cxcywh_to_xyxy(boxes[b]), box_cxcywh_to_xyxy(tb)))
        qi, ti = greedy_match(cost)
        tgt_cls[b, qi] = cls[ti]
        l1 = l1 + F.l1_loss(boxes[b, qi], tb[ti], reduction="sum")
        gl = gl + (1 - torch.diag(giou(box_cxcywh_to_xyxy(boxes[b, qi]), box_cxcywh_to_xyxy(tb[ti])))).sum()
        nb += len(cls)
    weight = torch.ones(K + 1)
    weight[K] = eos_coef
    return F.cross_entropy(logits.flatten(0, 1), tgt_cls.flatten(), weight) + (5 * l1 + 2 * gl) / nb


@EVERY
def test_detr_set_prediction_greedy_matching_no_object_weight_l1_giou(every, tmp_path):
    torch.manual_seed(0)
    quiet(run(DETR(), scenes, set_loss, tmp_path, steps=30, every=every, lr=1e-3))
