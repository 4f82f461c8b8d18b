"""More architectures for the corpus, written here the way their usual open-source implementations write them:
a ViT (patch conv, nn.MultiheadAttention), a diffusion UNet (sinusoidal timesteps, GroupNorm, an attention block,
noise-prediction loss), an LSTM language model, a convolutional VAE (ConvTranspose decoder, KL with exp(logvar)),
a top-2 mixture-of-experts LM (fp32 router softmax, index_add_ dispatch, load-balancing loss), a CLIP-style
two-tower model (exp(logit_scale) times cosine similarities), a ConvNeXt (depthwise convs, channels-last LayerNorm,
layer scale 1e-6), a wav2vec2-style CTC speech model (GroupNorm conv features, weight-normed positional conv, key
padding) and a graph convolution network (index_add_ message passing). Each comes with a batch maker (global RNG) and a
loss; models.py turns them into ModelSpecs. Sizes: "tiny" for the CPU tests, "small" for the GPU corpus."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# -- ViT ----------------------------------------------------------------------------------------------------------

_VIT = {"tiny": dict(img=16, patch=4, d=32, depth=2, heads=2, B=8), "small": dict(img=64, patch=8, d=256, depth=6,
                                                                                   heads=8, B=64)}


class ViTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(self, img, patch, d, depth, heads, classes=10):
        super().__init__()
        n = (img // patch) ** 2
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(d, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)[:, 0])


def vit(size):
    s = _VIT[size]
    return ViT(s["img"], s["patch"], s["d"], s["depth"], s["heads"])


def labelled_images(B, hw, device):
    """((images,), {}, labels): 10 classes, each shifting its images' mean by label/10 (learnable, never trivial)."""
    y = torch.randint(0, 10, (B,), device=device)
    x = torch.randn(B, 3, hw, hw, device=device) + y.view(-1, 1, 1, 1).float() / 10
    return (x,), {}, y


def vit_batch(size, device):
    s = _VIT[size]
    return labelled_images(s["B"], s["img"], device)


# -- diffusion UNet (DDPM-style) -----------------------------------------------------------------------------------

_UNET = {"tiny": dict(c=16, hw=16, B=4), "small": dict(c=64, hw=32, B=32)}
T_STEPS = 1000


def timestep_embedding(t, dim):
    """The sinusoidal embedding of integer timesteps, in fp32 (as diffusers' get_timestep_embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    a = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(a), torch.cos(a)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1 = nn.GroupNorm(8, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(8, cout)
        self.drop = nn.Dropout(0.1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.drop(F.silu(self.norm2(h))))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(8, c)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(B, 3, C, H * W).unbind(1)
        h = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.proj(h.transpose(1, 2).reshape(B, C, H, W))


class UNet(nn.Module):
    def __init__(self, c):
        super().__init__()
        tdim = 4 * c
        self.c = c
        self.time = nn.Sequential(nn.Linear(c, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(3, c, 3, padding=1)
        self.down1 = ResBlock(c, c, tdim)
        self.downsample = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.down2 = ResBlock(c, 2 * c, tdim)
        self.mid1 = ResBlock(2 * c, 2 * c, tdim)
        self.mid_attn = AttnBlock(2 * c)
        self.mid2 = ResBlock(2 * c, 2 * c, tdim)
        self.upsample = nn.ConvTranspose2d(2 * c, 2 * c, 4, stride=2, padding=1)
        self.up1 = ResBlock(3 * c, c, tdim)
        self.norm_out = nn.GroupNorm(8, c)
        self.conv_out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x, t):
        temb = self.time(timestep_embedding(t, self.c))
        h0 = self.conv_in(x)
        h1 = self.down1(h0, temb)
        h = self.down2(self.downsample(h1), temb)
        h = self.mid2(self.mid_attn(self.mid1(h, temb)), temb)
        h = self.up1(torch.cat([self.upsample(h), h1], dim=1), temb)
        return self.conv_out(F.silu(self.norm_out(h)))


def unet(size):
    return UNet(_UNET[size]["c"])


def unet_batch(size, device):
    s = _UNET[size]
    x0 = torch.rand(s["B"], 3, s["hw"], s["hw"], device=device) * 2 - 1
    t = torch.randint(0, T_STEPS, (s["B"],), device=device)
    noise = torch.randn_like(x0)
    betas = torch.linspace(1e-4, 0.02, T_STEPS, device=device)
    abar = torch.cumprod(1 - betas, 0)[t].view(-1, 1, 1, 1)
    xt = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
    return (xt, t), {}, noise


# -- LSTM language model -------------------------------------------------------------------------------------------

_LSTM = {"tiny": dict(V=64, d=32, L=2, T=16, B=8), "small": dict(V=4096, d=512, L=2, T=128, B=32)}


class LSTMLM(nn.Module):
    def __init__(self, V, d, L):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.drop = nn.Dropout(0.2)
        self.lstm = nn.LSTM(d, d, num_layers=L, batch_first=True, dropout=0.2)
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, V)
        self.rnn_autocast = False  # (the case lstm/bf16-rnn sets it)

    def forward(self, ids):
        x = self.drop(self.emb(ids))
        # CUDA autocast runs cuDNN RNNs in float16 whatever its dtype: under bf16 the LSTM runs in fp32 instead, as
        # a user who knows does (`rnn_autocast` leaves it to autocast); oneDNN has no fp16/bf16 LSTM under CPU
        # autocast: fp32 there
        bf16 = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        if x.device.type == "cuda" and (self.rnn_autocast or not bf16):
            h, _ = self.lstm(x)
        else:
            with torch.autocast(x.device.type, enabled=False):
                h, _ = self.lstm(x.float())
        return self.head(self.drop(F.gelu(self.proj(self.norm(h)))))


def lstm(size):
    s = _LSTM[size]
    return LSTMLM(s["V"], s["d"], s["L"])


def lstm_batch(size, device):
    s = _LSTM[size]
    ids = torch.randint(0, s["V"], (s["B"], s["T"] + 1), device=device)
    return (ids[:, :-1],), {}, ids[:, 1:]


def lm_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


# -- convolutional VAE ---------------------------------------------------------------------------------------------

_VAE = {"tiny": dict(c=8, hw=16, z=8, B=8), "small": dict(c=64, hw=64, z=128, B=64)}


class VAE(nn.Module):
    def __init__(self, c, hw, z):
        super().__init__()
        self.c, self.s = c, hw // 4
        self.enc = nn.Sequential(nn.Conv2d(3, c, 4, 2, 1), nn.BatchNorm2d(c), nn.LeakyReLU(0.2),
                                 nn.Conv2d(c, 2 * c, 4, 2, 1), nn.BatchNorm2d(2 * c), nn.LeakyReLU(0.2))
        flat = 2 * c * self.s * self.s
        self.mu = nn.Linear(flat, z)
        self.logvar = nn.Linear(flat, z)
        self.fc_dec = nn.Linear(z, flat)
        self.dec = nn.Sequential(nn.ConvTranspose2d(2 * c, c, 4, 2, 1), nn.BatchNorm2d(c), nn.ReLU(),
                                 nn.ConvTranspose2d(c, 3, 4, 2, 1))

    def forward(self, x):
        h = self.enc(x).flatten(1)
        mu, logvar = self.mu(h), self.logvar(h)
        zs = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        logits = self.dec(self.fc_dec(zs).view(-1, 2 * self.c, self.s, self.s))
        recon = F.binary_cross_entropy_with_logits(logits, x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.shape[0]
        return recon + kl


def vae(size):
    s = _VAE[size]
    return VAE(s["c"], s["hw"], s["z"])


def vae_batch(size, device):
    s = _VAE[size]
    x = torch.rand(s["B"], 3, s["hw"], s["hw"], device=device)
    return (x,), {}, None


def own_loss(out, target=None):
    return out


# -- mixture of experts --------------------------------------------------------------------------------------------

_MOE = {"tiny": dict(V=64, d=32, E=4, L=2, T=16, B=4), "small": dict(V=4096, d=256, E=8, L=4, T=128, B=16)}


class MoE(nn.Module):
    """Top-2 routing, the router's softmax in fp32 (Switch/Mixtral style), tokens gathered per expert and their
    weighted outputs added back with index_add_; `aux` holds the load-balancing loss of the last call."""

    def __init__(self, d, E, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(E))
        self.aux = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x).float(), dim=-1)
        w, sel = probs.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            tok, slot = (sel == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]).float() * w[tok, slot, None])
        frac = F.one_hot(sel[:, 0], probs.shape[-1]).float().mean(0)
        self.aux = probs.shape[-1] * (frac * probs.mean(0)).sum()
        return out.reshape(shape).to(x.dtype)


class MoEBlock(nn.Module):
    def __init__(self, d, E):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.moe = MoE(d, E)

    def forward(self, x):
        return x + self.moe(self.ln(x))


class MoELM(nn.Module):
    def __init__(self, V, d, E, L):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(MoEBlock(d, E) for _ in range(L))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return loss + 0.01 * sum(b.moe.aux for b in self.blocks)


def moe(size):
    s = _MOE[size]
    return MoELM(s["V"], s["d"], s["E"], s["L"])


def moe_batch(size, device):
    s = _MOE[size]
    ids = torch.randint(0, s["V"], (s["B"], s["T"] + 1), device=device)
    return (ids[:, :-1], ids[:, 1:]), {}, None


# -- CLIP-style contrastive ----------------------------------------------------------------------------------------

_CLIP = {"tiny": dict(c=8, hw=16, V=64, T=8, d=32, B=8), "small": dict(c=64, hw=32, V=4096, T=32, d=256, B=128)}


class CLIP(nn.Module):
    def __init__(self, c, V, d):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.BatchNorm2d(c), nn.ReLU(),
                                   nn.Conv2d(c, 2 * c, 3, 2, 1), nn.BatchNorm2d(2 * c), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, d))
        self.tok = nn.Embedding(V, d)
        self.text = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True,
                                                                     norm_first=True), 2, enable_nested_tensor=False)
        self.text_proj = nn.Linear(d, d)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.clamp_scale = True  # (OpenAI's clamp at 100; an injection turns it off, as code without it runs)

    def forward(self, img, ids):
        a = F.normalize(self.image(img), dim=-1)
        b = F.normalize(self.text_proj(self.text(self.tok(ids)).mean(1)), dim=-1)
        s = self.logit_scale.exp()
        logits = (s.clamp(max=100) if self.clamp_scale else s) * a @ b.t()
        y = torch.arange(len(logits), device=logits.device)
        return (F.cross_entropy(logits.float(), y) + F.cross_entropy(logits.t().float(), y)) / 2


def clip(size):
    s = _CLIP[size]
    return CLIP(s["c"], s["V"], s["d"])


def clip_batch(size, device):
    s = _CLIP[size]
    ids = torch.randint(0, s["V"], (s["B"], s["T"]), device=device)
    img = torch.randn(s["B"], 3, s["hw"], s["hw"], device=device) + (ids[:, :1].float() / s["V"]).view(-1, 1, 1, 1)
    return (img, ids), {}, None


# -- ConvNeXt ------------------------------------------------------------------------------------------------------

_CNX = {"tiny": dict(dims=(16, 32), depths=(1, 1), hw=32, B=8), "small": dict(dims=(64, 128, 256), depths=(2, 2, 2),
                                                                              hw=64, B=64)}


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (ConvNeXt's channels_first LayerNorm)."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, d, layer_scale=1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.pwconv1 = nn.Linear(d, 4 * d)
        self.pwconv2 = nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(layer_scale * torch.ones(d))

    def forward(self, x):
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims, depths, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        stages = []
        for i, (d, n) in enumerate(zip(dims, depths)):
            down = [] if i == 0 else [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], d, 2, 2)]
            stages.append(nn.Sequential(*down, *[ConvNeXtBlock(d) for _ in range(n)]))
        self.stages = nn.ModuleList(stages)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x):
        x = self.stem(x)
        for s in self.stages:
            x = s(x)
        return self.head(self.norm(x.mean((-2, -1))))


def convnext(size):
    s = _CNX[size]
    return ConvNeXt(s["dims"], s["depths"])


def convnext_batch(size, device):
    s = _CNX[size]
    return labelled_images(s["B"], s["hw"], device)


# -- wav2vec2-style CTC speech model -------------------------------------------------------------------------------

_W2V = {"tiny": dict(C=16, d=32, L=1, V=12, samples=1600, B=4), "small": dict(C=256, d=256, L=4, V=32, samples=16000,
                                                                              B=16)}


class Wav2Vec(nn.Module):
    """Conv feature extractor (GroupNorm on the first layer), feature projection, a weight-normed grouped
    positional convolution, a Transformer encoder with key padding, a CTC head (log_softmax and ctc_loss in fp32)."""

    def __init__(self, C, d, L, V):
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(1, C, 10, 5, bias=False), nn.GroupNorm(C, C), nn.GELU(),
                                      nn.Conv1d(C, C, 3, 2, bias=False), nn.GELU(),
                                      nn.Conv1d(C, C, 3, 2, bias=False), nn.GELU())
        self.proj_norm = nn.LayerNorm(C)
        self.projection = nn.Linear(C, d)
        self.pos_conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(d, d, 16, padding=8, groups=4), dim=2)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True,
                                                                        activation="gelu"), L,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d, V)

    def forward(self, wav, wav_lens, labels, label_lens):
        h = self.projection(self.proj_norm(self.features(wav).transpose(1, 2)))
        h = h + F.gelu(self.pos_conv(h.transpose(1, 2))[..., :-1]).transpose(1, 2)
        T = h.shape[1]
        frames = (wav_lens * T) // wav.shape[-1]
        pad = torch.arange(T, device=h.device)[None] >= frames[:, None]
        h = self.encoder(h, src_key_padding_mask=pad)
        logp = F.log_softmax(self.head(h).float(), dim=-1).transpose(0, 1)
        return F.ctc_loss(logp, labels, frames, label_lens, blank=0, zero_infinity=True)


def wav2vec(size):
    s = _W2V[size]
    return Wav2Vec(s["C"], s["d"], s["L"], s["V"])


def wav2vec_batch(size, device):
    s = _W2V[size]
    B, n = s["B"], s["samples"]
    wav = torch.randn(B, 1, n, device=device) * 0.1
    lens = torch.randint(n // 2, n + 1, (B,), device=device)
    lens[0] = n
    wav = wav * (torch.arange(n, device=device)[None, None] < lens[:, None, None])
    label_lens = torch.randint(2, 8, (B,), device=device)
    labels = torch.randint(1, s["V"], (B, 8), device=device)
    return (wav, lens, labels, label_lens), {}, None


# -- graph convolution network -------------------------------------------------------------------------------------

_GNN = {"tiny": dict(N=64, E=256, f=16, d=32, L=2, B=1), "small": dict(N=20000, E=200000, f=128, d=256, L=3, B=1)}


class GCNLayer(nn.Module):
    """Symmetric-normalised message passing: out_i = sum_j x_j W / sqrt(deg_i deg_j), summed with index_add_."""

    def __init__(self, fin, fout):
        super().__init__()
        self.lin = nn.Linear(fin, fout)

    def forward(self, x, src, dst, norm):
        msg = self.lin(x)[src] * norm[:, None]  # (an fp16 message times the fp32 norm: fp32, as PyG's gcn_norm)
        return torch.zeros(x.shape[0], msg.shape[1], dtype=msg.dtype, device=x.device).index_add_(0, dst, msg)


class GCN(nn.Module):
    def __init__(self, f, d, L, classes=8):
        super().__init__()
        dims = [f] + [d] * (L - 1)
        self.convs = nn.ModuleList(GCNLayer(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(L - 1))
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(d, classes)

    def forward(self, x, src, dst, y):
        n = x.shape[0]
        deg = torch.zeros(n, device=x.device).index_add_(0, dst, torch.ones_like(dst, dtype=torch.float32)) + 1
        loops = torch.arange(n, device=x.device)
        src, dst = torch.cat([src, loops]), torch.cat([dst, loops])
        norm = (deg[src] * deg[dst]).rsqrt()
        for conv, ln in zip(self.convs, self.norms):
            x = self.drop(F.relu(ln(conv(x, src, dst, norm))))
        return F.cross_entropy(self.head(x).float(), y)


def gcn(size):
    s = _GNN[size]
    return GCN(s["f"], s["d"], s["L"])


def gcn_batch(size, device):
    s = _GNN[size]
    y = torch.randint(0, 8, (s["N"],), device=device)
    x = torch.randn(s["N"], s["f"], device=device) + F.one_hot(y, s["f"]).float()
    src = torch.randint(0, s["N"], (s["E"],), device=device)
    dst = torch.randint(0, s["N"], (s["E"],), device=device)
    return (x, src, dst, y), {}, None
