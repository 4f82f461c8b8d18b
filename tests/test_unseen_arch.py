"""Failure probes inside architectures the other tests do not build, watched through the public API only (watch ->
an ordinary fp16 autocast + GradScaler loop on the CPU -> w.report(), and diagnose(run_dir)), at the default
sampling and at every=1: RWKV time mixing's exp(k) and channel mixing's squared ReLU in fp16, a Mamba-style
selective scan written as cumulative products (the product underflows, the division by it overflows) or as
exp(-cumsum) (overflows), a ViT whose patch-embedding conv overflows after a weight blow-up, ConvNeXt's hand-written
channels-first LayerNorm whose variance overflows, a UNet whose GroupNorm turns a conv's inf into NaN, a Hyena FFT
long convolution whose fp32 result is cast back to fp16 past 65504, a Perceiver's cross-attention scores past 65504
(hand-written softmax), a GNN's mean aggregation / GCN normalisation at an isolated node (zero degree), a VQ-VAE
codebook distance ||z||^2 that overflows and silently collapses every code to 0, a contrastive margin loss whose
squared distance overflows, an MoE expert that overflows only once the load balancer routes tokens to it, capsule
routing's hand-written softmax, a 24-block residual MLP whose block 17 blows up (deep module names), and one module
instance called three times per forward whose third call overflows. Each model goes bad at a known step and the
failure is asserted to be real; the right rule at the producing module among the first three findings, at that
step, and no error at the modules that only passed the value on. Where ampdoctor is wrong the test is a strict
xfail whose reason says what it reported instead."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import (both, EVERY, first_bad, FP16, in_top3, mean_sq, no_error_at, nonfinite_loss_steps, one_thread,
                       randn, short_loop as loop, top3)


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


# ======================================================================================================================
# 1. RWKV: time mixing's exp(k), channel mixing's relu(k)**2, in fp16
# ======================================================================================================================
class TimeMix(nn.Module):
    """RWKV's wkv written out in the working dtype (no running max subtracted, as the reference CUDA kernel does):
    exp(k) of an fp16 key overflows past k = 11.09."""

    def __init__(self, d=16):
        super().__init__()
        self.key, self.value, self.receptance, self.output = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        k, v, r = self.key(x), self.value(x), torch.sigmoid(self.receptance(x))
        ek = torch.exp(k)
        wkv = torch.cumsum(ek * v, 1) / torch.cumsum(ek, 1)
        return self.output(r * wkv)


class ChannelMix(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.key, self.value, self.receptance = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False), \
            nn.Linear(d, d, bias=False)

    def forward(self, x):
        k = torch.square(torch.relu(self.key(x)))  # RWKV's squared ReLU: past 256 it overflows fp16
        return torch.sigmoid(self.receptance(x)) * self.value(k)


class RWKVBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln1, self.att, self.ln2, self.ffn = nn.LayerNorm(d), TimeMix(d), nn.LayerNorm(d), ChannelMix(d)

    def forward(self, x):
        x = x + self.att(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class RWKV(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Linear(8, d)
        self.blocks = nn.ModuleList(RWKVBlock(d) for _ in range(2))
        self.ln_out, self.head = nn.LayerNorm(d), nn.Linear(d, 1)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_out(x))


@EVERY
@pytest.mark.parametrize("where", ["att", "ffn"])
def test_rwkv_exp_of_key_or_squared_relu_overflows_in_the_mixer(tmp_path, every, where):
    """From step 3 blocks.1's key weights are scaled up (x30 for the time mixing's key: |k| up to ~60, exp(k)
    overflows; x300 for the channel mixing's key: relu(k) up to ~700, its square overflows). The key Linear's own
    output is finite: the mixer's exp / square made the inf."""
    torch.manual_seed(0)
    m, x = RWKV(), randn(2, 32, 8)
    key = m.blocks[1].att.key if where == "att" else m.blocks[1].ffn.key
    mod = f"blocks.1.{where}"

    def batch(i):
        if i == 3:
            with torch.no_grad():
                key.weight.mul_(30.0 if where == "att" else 300.0)
        return (x,)
    ok = torch.isfinite(m(x)).all()
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.blocks[0](m.emb(x))
        blk = m.blocks[1]
        if where == "att":
            k = blk.att.key(blk.ln1(h))
            assert torch.isfinite(k).all() and torch.isinf(torch.exp(k)).any()  # real
        else:
            h2 = h + blk.att(blk.ln1(h))
            k = blk.ffn.key(blk.ln2(h2))
            assert torch.isfinite(h2).all() and torch.isfinite(k).all() and torch.isinf(torch.relu(k) ** 2).any()
    assert ok and first_bad(w) == 3 and 3 in nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", mod)
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        if where == "att":
            assert f.op == "aten::exp", f.one_line()
        no_error_at(rep, (f"{mod}.key", f"{mod}.value", f"{mod}.output", "blocks.1.ln2", "blocks.1.ffn"
                          if where == "att" else "blocks.1.att", "blocks.1", "ln_out", "head", ""))


# ======================================================================================================================
# 2. Mamba-style selective scan in fp16
# ======================================================================================================================
class SelectiveScan(nn.Module):
    """S6 with the scan computed in parallel, kept in the activations' dtype (A cast to it): h_t = P_t * sum_s
    (dt_s B_s x_s / P_s), P = cumprod(exp(dt A)) ("cumprod"), or P = exp(cumsum(dt A)) with 1/P as exp(-cumsum)
    ("exp")."""

    def __init__(self, d=8, n=4, r=2, kind="cumprod"):
        super().__init__()
        self.n, self.r, self.kind = n, r, kind
        self.in_proj, self.x_proj = nn.Linear(d, d), nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj, self.out_proj = nn.Linear(r, d), nn.Linear(d, d)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(d, 1))
        self.D = nn.Parameter(torch.ones(d))
        with torch.no_grad():
            self.dt_proj.bias.fill_(-6.0)  # dt ~ softplus(-6) = 0.0025, Mamba's small initial step

    def forward(self, x):
        u = F.silu(self.in_proj(x))
        dt, B, C = self.x_proj(u).split([self.r, self.n, self.n], -1)
        dt = F.softplus(self.dt_proj(dt))  # (b, L, d)
        A = -torch.exp(self.A_log).to(dt.dtype)  # (d, n)
        dtA = dt[..., None] * A  # (b, L, d, n), fp16
        Bx = dt[..., None] * B[:, :, None, :] * u[..., None]
        if self.kind == "cumprod":
            P = torch.cumprod(torch.exp(dtA), 1)  # flushes to 0 once sum(dt A) < -17
            h = P * torch.cumsum(Bx / P, 1)
        else:
            cs = torch.cumsum(dtA, 1)
            h = torch.exp(cs) * torch.cumsum(Bx * torch.exp(-cs), 1)  # exp(-cs) overflows once -cs > 11.09
        y = (h * C[:, :, None, :]).sum(-1) + u * self.D.to(u.dtype)
        return self.out_proj(y)


class MambaBlock(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.norm, self.mixer = nn.LayerNorm(8), SelectiveScan(kind=kind)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class Mamba(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.layers = nn.ModuleList(MambaBlock(kind) for _ in range(2))
        self.norm_f, self.head = nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm_f(h))


@EVERY
@pytest.mark.parametrize("kind", ["cumprod", "exp"])
def test_mamba_parallel_scan_in_fp16_breaks_in_the_mixer(tmp_path, every, kind):
    """From step 3 layers.1's dt bias is 2 (dt ~ 2.1: a learned step grown large): sum(dt A) over 64 positions
    reaches -500. cumprod: P flushes to 0 and Bx / P = inf (overflow; underflow of P is also a fair root cause);
    exp: exp(-cumsum) overflows. Either way the mixer's own ops, not dt_proj / x_proj, whose outputs stay finite."""
    torch.manual_seed(0)
    m, x = Mamba(kind), randn(2, 64, 4)
    mixer = m.layers[1].mixer

    def batch(i):
        if i == 3:
            with torch.no_grad():
                mixer.dt_proj.bias.fill_(2.0)
        return (x,)
    assert torch.isfinite(m(x)).all()
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.layers[0](m.emb(x))
        assert torch.isfinite(h).all() and not torch.isfinite(mixer(m.layers[1].norm(h))).all()  # real
    assert first_bad(w) == 3
    rules = ("overflow", "underflow") if kind == "cumprod" else ("overflow",)
    for rep in both(w, tmp_path / "r"):
        f = in_top3(rep, rules, "layers.1.mixer", error_run=True)
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        if kind == "exp":
            assert f.op == "aten::exp", f.one_line()
        no_error_at(rep, ("layers.1.mixer.dt_proj", "layers.1.mixer.x_proj", "layers.1.mixer.in_proj",
                          "layers.1.mixer.out_proj", "layers.1", "norm_f", "head", ""))


# ======================================================================================================================
# 3. ViT: the patch-embedding conv overflows after a weight blow-up
# ======================================================================================================================
class PatchEmbed(nn.Module):
    def __init__(self, d=32, p=4):
        super().__init__()
        self.proj = nn.Conv2d(3, d, p, stride=p)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ViTBlock(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.norm1, self.norm2, self.h = nn.LayerNorm(d), nn.LayerNorm(d), h
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.patch_embed = PatchEmbed(d)
        self.cls_token, self.pos_embed = nn.Parameter(torch.zeros(1, 1, d)), nn.Parameter(torch.randn(1, 17, d) * .02)
        self.blocks = nn.ModuleList(ViTBlock(d) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, img):
        x = self.patch_embed(img)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], 1) + self.pos_embed
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x[:, 0]))


@EVERY
def test_vit_patch_embedding_conv_overflows_after_a_weight_blow_up(tmp_path, every):
    """At step 3 the patch embedding's conv weights are x1e5 (a bad resume / lr spike): the conv's fp16 output
    passes 65504 while its weights and the images are finite. The conv made it; the positional add, the blocks'
    LayerNorms (inf -> NaN) only passed it on."""
    torch.manual_seed(0)
    m, img = ViT(), randn(4, 3, 16, 16)
    y = torch.arange(4) % 10

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.patch_embed.proj.weight.mul_(1e5)
        return (img,)
    w = loop(m, batch, lambda out, *a: F.cross_entropy(out.float(), y), every=every, run_dir=tmp_path / "r",
             lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        assert m.patch_embed.proj.weight.abs().max() < 65504 and torch.isinf(m.patch_embed.proj(img)).any()  # real
    assert first_bad(w) == 3 and 3 in nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "patch_embed.proj")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("patch_embed", "blocks.0.norm1", "blocks.0", "blocks.0.qkv", "blocks.1", "norm", "head",
                          ""))


# ======================================================================================================================
# 4. ConvNeXt: the hand-written channels-first LayerNorm's variance overflows
# ======================================================================================================================
class LayerNorm2d(nn.Module):
    """ConvNeXt's LayerNorm(data_format="channels_first"), as written in the official repository."""

    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)  # fp16: |x - u| > 256 -> inf
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.pwconv1, self.act, self.pwconv2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.GELU(), \
            nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(1e-2 * torch.ones(c))

    def forward(self, x):
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h)))) * self.gamma
        return x + h.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.downsample_layers = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), LayerNorm2d(16)),
            nn.Sequential(LayerNorm2d(16), nn.Conv2d(16, 32, 2, stride=2))])
        self.stages = nn.ModuleList([ConvNeXtBlock(16), ConvNeXtBlock(32)])
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 10)

    def forward(self, x):
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.head(self.norm(x.mean((-2, -1))))


@pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])
def test_convnext_channels_first_layer_norm_variance_overflows_silently(tmp_path, every):
    """From step 3 the stem conv's outputs are ~2000 (weights x3000): finite, but the hand-written LayerNorm's
    (x - u)**2 overflows, its variance is inf, (x - u) / inf = 0: every pixel leaves the norm as its bias, the loss
    stays finite and nothing is skipped (training silently sees nothing). The norm's pow made the inf. The default
    was wrong when written (a strict xfail: nothing reported); fixed since: the stem's output jumping past 256 in the
    always-on series has the next step sampled, and the norm's finding is dated by its input's series."""
    torch.manual_seed(0)
    m, img = ConvNeXt(), randn(4, 3, 16, 16)
    y = torch.arange(4) % 10

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.downsample_layers[0][0].weight.mul_(3000.0)
        return (img,)
    w = loop(m, batch, lambda out, *a: F.cross_entropy(out.float(), y), every=every, run_dir=tmp_path / "r",
             lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        stem, norm = m.downsample_layers[0]
        h = stem(img)
        assert torch.isfinite(h).all() and h.abs().max() < 65504  # real: the conv is fine
        out = norm(h)
        assert torch.isfinite(out).all() and (out == norm.bias[None, :, None, None].to(out.dtype)).all()
        with torch.autocast("cpu", enabled=False):
            assert not (norm(h.float()) == norm.bias[None, :, None, None]).all()  # fp32 keeps the signal
    assert not nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "downsample_layers.0.1")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("downsample_layers.0.0", "downsample_layers.0", "stages.0", "downsample_layers.1.0",
                          "norm", "head", ""))


# ======================================================================================================================
# 5. UNet: a GroupNorm fed a conv's inf turns it into NaN; the conv is the producer
# ======================================================================================================================
class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(3, 8, 3, padding=1)
        self.down, self.mid = ResBlock(8, 16), ResBlock(16, 16)
        self.up = ResBlock(32, 8)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        h0 = self.inc(x)
        h1 = self.down(h0)
        h2 = self.mid(F.avg_pool2d(h1, 2))
        h3 = self.up(torch.cat([F.interpolate(h2, scale_factor=2.0), h1], 1))
        return self.out(h3)


@EVERY
def test_unet_group_norm_fed_a_convs_inf_is_not_the_producer(tmp_path, every):
    """At step 3 down.conv1's weights are x3e5: its output overflows fp16. down.norm2 (GroupNorm) receives the inf
    and returns NaN, mid's and up's GroupNorms NaN too. The conv made the inf; the GroupNorms only passed it on."""
    torch.manual_seed(0)
    m, img = UNet(), randn(2, 3, 8, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.down.conv1.weight.mul_(3e5)
        return (img,)
    w = loop(m, batch, lambda out, x: (out.float() - x).pow(2).mean(), every=every, run_dir=tmp_path / "r",
             lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        a = F.silu(m.down.norm1(m.inc(img)))
        c = m.down.conv1(a)
        assert torch.isfinite(a).all() and torch.isinf(c).any() and torch.isnan(m.down.norm2(c)).any()  # real
    assert first_bad(w) == 3 and 3 in nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "down.conv1")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("down.norm2", "down.conv2", "down", "mid.norm1", "mid", "up.norm1", "up", "out", "inc",
                          ""))


# ======================================================================================================================
# 6. Hyena: the FFT long convolution's fp32 result cast back to fp16
# ======================================================================================================================
class FFTConv(nn.Module):
    """Hyena's fftconv: the FFTs run in fp32 (autocast upcasts them), the result is cast back to the input's
    dtype, which overflows once the long filter's response passes 65504."""

    def __init__(self, d=8, L=128):
        super().__init__()
        self.filter = nn.Parameter(torch.randn(d, L) * 0.02 * torch.exp(-0.05 * torch.arange(L)))
        self.D = nn.Parameter(torch.ones(d))

    def forward(self, u):  # (B, d, L)
        L = u.shape[-1]
        n = 2 * L
        k_f = torch.fft.rfft(self.filter, n=n) / n
        u_f = torch.fft.rfft(u.to(self.filter.dtype), n=n)
        y = torch.fft.irfft(u_f * k_f, n=n, norm="forward")[..., :L]
        return (y + u * self.D[:, None]).to(u.dtype)


class HyenaOperator(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.short_filter = nn.Conv1d(3 * d, 3 * d, 3, padding=2, groups=3 * d)
        self.long_conv = FFTConv(d)

    def forward(self, x):
        L = x.shape[1]
        z = self.short_filter(self.in_proj(x).transpose(1, 2))[..., :L]
        x1, x2, v = z.chunk(3, 1)
        y = self.long_conv(v * x1) * x2
        return self.out_proj(y.transpose(1, 2))


class Hyena(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(8), "mixer": HyenaOperator()})
                                    for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer["mixer"](layer["norm"](h))
        return self.head(h)


@EVERY
def test_hyena_fft_long_conv_result_cast_back_to_fp16_overflows(tmp_path, every):
    """At step 3 layers.0's long filter is x1e7 (an implicit filter whose decay was lost): the fp32 FFT convolution
    gives values past 65504, and the cast back to fp16 at the end of fftconv makes them inf. The long conv module
    made it; the gating multiply and out_proj only passed it on."""
    torch.manual_seed(0)
    m, x = Hyena(), randn(2, 128, 4)
    lc = m.layers[0]["mixer"].long_conv

    def batch(i):
        if i == 3:
            with torch.no_grad():
                lc.filter.mul_(1e7)
        return (x,)
    assert torch.isfinite(m(x)).all()
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        op = m.layers[0]["mixer"]
        z = op.short_filter(op.in_proj(m.layers[0]["norm"](m.emb(x))).transpose(1, 2))[..., :128]
        x1, x2, v = z.chunk(3, 1)
        assert torch.isfinite(v * x1).all() and (v * x1).dtype == torch.float16
        assert torch.isinf(lc(v * x1)).any()  # real: the cast of the fp32 result
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "layers.0.mixer.long_conv")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("layers.0.mixer", "layers.0.mixer.out_proj", "layers.0.mixer.short_filter",
                          "layers.1.norm", "layers.1.mixer", "head", ""))


# ======================================================================================================================
# 7. Perceiver: cross-attention scores past 65504, hand-written softmax
# ======================================================================================================================
class CrossAttention(nn.Module):
    def __init__(self, q_dim=32, ctx_dim=16, dim_head=32):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.to_q, self.to_kv = nn.Linear(q_dim, dim_head, bias=False), nn.Linear(ctx_dim, 2 * dim_head, bias=False)
        self.to_out = nn.Linear(dim_head, q_dim)

    def forward(self, x, context):
        q = self.to_q(x) * self.scale
        k, v = self.to_kv(context).chunk(2, -1)
        sim = torch.einsum("b i d, b j d -> b i j", q, k)
        sim = sim - sim.amax(-1, keepdim=True).detach()
        attn = sim.exp()
        attn = attn / attn.sum(-1, keepdim=True)
        return self.to_out(torch.einsum("b i j, b j d -> b i d", attn, v))


class Perceiver(nn.Module):
    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(8, 32))
        self.norm_latents, self.norm_context = nn.LayerNorm(32), nn.LayerNorm(16)
        self.cross_attn = CrossAttention()
        self.latent_ff = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, data):
        x = self.latents.expand(data.shape[0], -1, -1)
        x = x + self.cross_attn(self.norm_latents(x), self.norm_context(data))
        x = x + self.latent_ff(x)
        return self.head(x.mean(1))


@EVERY
def test_perceiver_cross_attention_scores_overflow_in_the_attention(tmp_path, every):
    """At step 3 to_q and to_kv's weights are x1000 (a spike): q ~ 100, k ~ 1000, both finite, but q . k over 32
    dimensions passes 65504 in the fp16 einsum. The hand-written softmax then makes inf - inf = NaN. The attention
    module's score product made the inf, not its projections."""
    torch.manual_seed(0)
    m, data = Perceiver(), randn(4, 64, 16)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.cross_attn.to_q.weight.mul_(1000.0)
                m.cross_attn.to_kv.weight.mul_(1000.0)
        return (data,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        ca = m.cross_attn
        q = ca.to_q(m.norm_latents(m.latents))[None] * ca.scale
        k = ca.to_kv(m.norm_context(data)).chunk(2, -1)[0]
        assert torch.isfinite(q).all() and torch.isfinite(k).all()
        assert torch.isinf(torch.einsum("b i d, b j d -> b i j", q.expand(4, -1, -1), k)).any()  # real
    assert first_bad(w) == 3 and 3 in nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "cross_attn")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("cross_attn.to_q", "cross_attn.to_kv", "cross_attn.to_out", "latent_ff", "latent_ff.0",
                          "head", ""))


# ======================================================================================================================
# 8. GNN: degree normalisation at an isolated node
# ======================================================================================================================
class GraphConv(nn.Module):
    def __init__(self, din, dout, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(din, dout), kind

    def forward(self, h, adj):
        deg = adj.sum(-1, keepdim=True)  # no self-loops: an isolated node has degree 0
        if self.kind == "mean":
            return self.lin((adj @ h) / deg)  # GraphSAGE-style mean: 0 / 0
        dinv = deg.pow(-0.5)  # GCN's D^-1/2: 0 ** -0.5 = inf
        return (dinv * adj * dinv.transpose(0, 1)) @ self.lin(h)  # inf * 0 = NaN


class GNN(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.convs = nn.ModuleList([GraphConv(8, 16, kind), GraphConv(16, 16, kind)])
        self.head = nn.Linear(16, 1)

    def forward(self, x, adj):
        h = torch.relu(self.convs[0](x, adj))
        h = torch.relu(self.convs[1](h, adj))
        return self.head(h)


@EVERY
@pytest.mark.parametrize("kind", ["mean", "gcn"])
def test_gnn_degree_normalisation_at_an_isolated_node(tmp_path, every, kind):
    """The graph of step 3 has an isolated node (node 5: no edges, and no self-loops were added). Mean aggregation
    divides its zero sum by its zero degree: 0/0 = NaN (nan_origin at convs.0, aten::div); GCN's deg ** -0.5 is
    inf and inf * 0 = NaN (nan_origin, or overflow for the inf, at convs.0). The first layer made it; convs.1 and
    the head only passed it on. The node features are finite."""
    torch.manual_seed(0)
    m, x = GNN(kind), randn(12, 8)
    g = torch.Generator().manual_seed(1)
    adj = (torch.rand(12, 12, generator=g) < 0.4).float()
    adj = ((adj + adj.t()) > 0).float().fill_diagonal_(0.0)

    def batch(i):
        a = adj.clone()
        if i == 3:
            a[5, :] = 0.0
            a[:, 5] = 0.0
        return (x, a)
    assert (adj.sum(-1) > 0).all()
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3 and nonfinite_loss_steps(w) == [3]  # real: NaN at step 3 only
    rules = ("nan_origin",) if kind == "mean" else ("nan_origin", "overflow")
    for rep in both(w, tmp_path / "r"):
        f = in_top3(rep, rules, "convs.0", error_run=True)
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        if kind == "mean":
            assert f.op == "aten::div", f.one_line()
        no_error_at(rep, ("convs.0.lin", "convs.1", "convs.1.lin", "head", ""))


# ======================================================================================================================
# 9. VQ-VAE: ||z||^2 of the codebook distance overflows, every vector snaps to code 0
# ======================================================================================================================
class Quantizer(nn.Module):
    def __init__(self, K=32, D=64):
        super().__init__()
        self.codebook = nn.Embedding(K, D)
        self.codebook.weight.data.uniform_(-1 / K, 1 / K)

    def forward(self, z):  # (N, D)
        e = self.codebook.weight
        d = z.pow(2).sum(1, keepdim=True) - 2 * z @ e.t() + e.pow(2).sum(1)  # ||z||^2 in fp16: past 65504 -> inf
        idx = d.argmin(1)
        q = self.codebook(idx).to(z.dtype)
        commit = F.mse_loss(z.float(), q.float().detach())
        return z + (q - z).detach(), commit


class VQVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 2, stride=2))
        self.quantizer = Quantizer()
        self.decoder = nn.Sequential(nn.ConvTranspose2d(64, 32, 2, stride=2), nn.ReLU(), nn.Conv2d(32, 3, 3, padding=1))

    def forward(self, x):
        z = self.encoder(x)
        B, D, H, W = z.shape
        zq, commit = self.quantizer(z.permute(0, 2, 3, 1).reshape(-1, D))
        rec = self.decoder(zq.reshape(B, H, W, D).permute(0, 3, 1, 2))
        return (rec.float() - x).pow(2).mean() + 0.25 * commit


@EVERY
def test_vqvae_codebook_distance_overflows_and_collapses_the_codes(tmp_path, every):
    """From step 3 the encoder's last conv weights are x1000: z ~ 250 per channel, finite,
    but ||z||^2 over 64 channels passes 65504: every distance is inf, argmin returns code 0 for every vector (fp32
    picks many codes). The loss stays finite, nothing is skipped: a silent codebook collapse. The quantizer's sum
    made the inf; the encoder's output is fine."""
    torch.manual_seed(0)
    m, img = VQVAE(), randn(4, 3, 8, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.encoder[2].weight.mul_(1000.0)
        return (img,)
    w = loop(m, batch, lambda out, *a: out, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        z = m.encoder(img).permute(0, 2, 3, 1).reshape(-1, 64)
        e = m.quantizer.codebook.weight
        assert torch.isfinite(z).all() and torch.isinf(z.pow(2).sum(1)).all()  # real
        d16 = z.pow(2).sum(1, keepdim=True) - 2 * z @ e.t() + e.pow(2).sum(1)
        assert (d16.argmin(1) == 0).all()
        with torch.autocast("cpu", enabled=False):
            zf = z.float()
            d32 = zf.pow(2).sum(1, keepdim=True) - 2 * zf @ e.t() + e.pow(2).sum(1)
            assert len(d32.argmin(1).unique()) > 1  # fp32 keeps the codes apart
    assert not nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "quantizer")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("encoder", "encoder.2", "quantizer.codebook", "decoder", "decoder.0", ""))


# ======================================================================================================================
# 10. a contrastive margin loss whose squared distance overflows
# ======================================================================================================================
class ContrastiveLoss(nn.Module):
    """Hadsell et al.'s margin loss: y d^2 + (1 - y) max(0, m - d)^2, d^2 summed in the embeddings' fp16."""

    def __init__(self, margin=1.0):
        super().__init__()
        self.margin = margin

    def forward(self, a, b, same):
        d2 = (a - b).pow(2).sum(-1)
        d = d2.sqrt()
        return (same * d2 + (1 - same) * F.relu(self.margin - d).pow(2)).mean()


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32))
        self.criterion = ContrastiveLoss()

    def forward(self, x1, x2, same):
        return self.criterion(self.encoder(x1), self.encoder(x2), same)


@EVERY
def test_contrastive_margin_loss_squared_distance_overflows_in_the_criterion(tmp_path, every):
    """From step 3 the encoder's last layer is x300: embeddings differ by ~100 per dimension (finite), but
    their squared distance passes 65504: inf loss, the step is skipped.
    The criterion's sum made it; the encoder's output is finite."""
    torch.manual_seed(0)
    m = Siamese()
    x1, x2 = randn(16, 8), randn(16, 8, seed=1)
    same = (torch.arange(16) % 2).float()

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.encoder[2].weight.mul_(300.0)
        return (x1, x2, same)
    w = loop(m, batch, lambda out, *a: out, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        a, b = m.encoder(x1), m.encoder(x2)
        assert torch.isfinite(a - b).all() and torch.isinf((a - b).pow(2).sum(-1)).any()  # real
    assert first_bad(w) == 3 and 3 in nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "criterion")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("encoder", "encoder.0", "encoder.2", ""))


# ======================================================================================================================
# 11. MoE: an expert overflows only once the router sends it tokens
# ======================================================================================================================
class Expert(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class MoE(nn.Module):
    """Top-1 routing with DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias (a buffer the balancer
    moves between steps, not a parameter) is added to the router's scores for the choice only."""

    def __init__(self, d=16, E=4):
        super().__init__()
        self.router = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(E))
        self.register_buffer("e_bias", torch.zeros(E))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.router(flat))
        choice = (scores + self.e_bias).argmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_add(0, idx, (expert(flat[idx]) * scores[idx, e:e + 1]).to(out.dtype))
        return out.reshape(x.shape)


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.moe, self.head = nn.Linear(8, 16), nn.LayerNorm(16), MoE(), nn.Linear(16, 1)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.moe(self.norm(h)))


@EVERY
def test_moe_expert_overflows_only_once_the_router_picks_it(tmp_path, every):
    """Expert 2 was added with a bad init (fc1 x1e5) and its balancing bias starts at -10: it gets no token at
    steps 0-2 (its hooks never fire). At step 3 the balancer lifts its bias to +10: every token goes to it, its
    fc1 overflows. The expert's fc1 made the inf; the router, the MoE's index_add and the head only passed it on,
    and the other experts are healthy."""
    torch.manual_seed(0)
    m, x = MoENet(), randn(4, 8, 8)
    with torch.no_grad():
        m.moe.experts[2].fc1.weight.mul_(1e5)
        m.moe.e_bias[2] = -10.0
    calls = []
    hook = m.moe.experts[2].register_forward_pre_hook(lambda mod, a: calls.append(a[0].shape[0]))

    def batch(i):
        if i == 3:
            m.moe.e_bias[2] = 10.0
        calls.append(("step", i))
        return (x,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    hook.remove()
    assert calls[:4] == [("step", 0), ("step", 1), ("step", 2), ("step", 3)] and calls[4] == 32  # real: first at 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.moe.experts[2].fc1(m.norm(m.emb(x)))
        assert m.moe.experts[2].fc1.weight.abs().max() < 65504 and torch.isinf(h).any()
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "moe.experts.2.fc1")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("moe", "moe.router", "moe.experts.2", "moe.experts.2.act", "moe.experts.2.fc2",
                          "moe.experts.0", "moe.experts.1", "head", ""))


# ======================================================================================================================
# 12. capsule routing: the hand-written routing softmax's exp overflows
# ======================================================================================================================
def squash(s, dim=-1):
    n2 = (s * s).sum(dim, keepdim=True)
    return n2 / (1 + n2) * s / (n2.sqrt() + 1e-4)


class PrimaryCaps(nn.Module):
    def __init__(self, n=32, d=8):
        super().__init__()
        self.lin, self.n, self.d = nn.Linear(8, n * d), n, d

    def forward(self, x):
        return squash(self.lin(x).view(-1, self.n, self.d))


class DigitCaps(nn.Module):
    """Dynamic routing (Sabour et al.), its routing logits kept in the predictions' dtype and its softmax over the
    output capsules written as exp / sum exp."""

    def __init__(self, n_in=32, n_out=4, d_in=8, d_out=16, iters=3):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_in, n_out, d_out, d_in) * 0.05)
        self.iters = iters

    def forward(self, u):  # (B, n_in, d_in)
        u_hat = torch.einsum("ijdk,bik->bijd", self.W, u)  # (B, n_in, n_out, d_out), fp16 under autocast
        b = torch.zeros_like(u_hat[..., 0])
        for it in range(self.iters):
            eb = b.exp()
            c = eb / eb.sum(2, keepdim=True)
            v = squash((c[..., None] * u_hat).sum(1))  # (B, n_out, d_out)
            if it < self.iters - 1:
                b = b + (u_hat * v[:, None]).sum(-1)  # agreement
        return v


class CapsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.primary_caps, self.digit_caps = PrimaryCaps(), DigitCaps()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.digit_caps(self.primary_caps(x))).squeeze(-1)


@EVERY
def test_capsule_routing_softmax_exp_overflows_in_the_digit_capsules(tmp_path, every):
    """At step 3 the routing weights W are x300 (a spike): predictions u_hat of norm ~60, the agreement added to
    the routing logits passes 11.09 and the hand-written softmax's exp overflows (then inf / inf = NaN). The digit
    capsules made it; the primary capsules' outputs are squashed below 1."""
    torch.manual_seed(0)
    m, x = CapsNet(), randn(8, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.digit_caps.W.mul_(300.0)
        return (x,)
    assert torch.isfinite(m(x)).all()
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        u = m.primary_caps(x)
        u_hat = torch.einsum("ijdk,bik->bijd", m.digit_caps.W, u)
        assert torch.isfinite(u).all() and torch.isfinite(u_hat).all() and not torch.isfinite(m.digit_caps(u)).all()
    assert first_bad(w) == 3 and 3 in nonfinite_loss_steps(w)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "digit_caps")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::exp"), f.one_line()
        no_error_at(rep, ("primary_caps", "primary_caps.lin", "head", ""))


# ======================================================================================================================
# 13. a 24-block residual MLP whose block 17 blows up
# ======================================================================================================================
class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ResMLPBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class DeepResMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(ResMLPBlock() for _ in range(24))
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


@pytest.mark.parametrize("at,every", [(5, None), (5, 1), (13, None)], ids=["5-default", "5-every1", "13-default"])
def test_block_17_of_24_blows_up_is_named_by_its_deep_name(tmp_path, at, every):
    """blocks.17.mlp.fc2's weights x4e5 at step `at`: it overflows from that step on; blocks 18-23's LayerNorms
    turn the inf into NaN. The finding names blocks.17.mlp.fc2, not a block after it."""
    torch.manual_seed(0)
    m, x = DeepResMLP(), randn(8, 8)
    fc2 = m.blocks[17].mlp.fc2

    def batch(i):
        if i == at:
            with torch.no_grad():
                fc2.weight.mul_(4e5)
        return (x,)
    w = loop(m, batch, mean_sq, steps=at + 3, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.inp(x)
        for b in m.blocks[:17]:
            h = b(h)
        a = m.blocks[17].mlp.act(m.blocks[17].mlp.fc1(m.blocks[17].norm(h)))
        assert torch.isfinite(a).all() and torch.isinf(fc2(a)).any()  # real
    assert first_bad(w) == at
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "blocks.17.mlp.fc2")
        assert (f.phase, f.step) == ("forward", at), f.one_line()
        no_error_at(rep, ("blocks.17.mlp", "blocks.17", "blocks.18.norm", "blocks.18", "blocks.23", "norm", "head",
                          "inp", ""))


# ======================================================================================================================
# 14. one module instance called three times per forward; only the third call overflows
# ======================================================================================================================
class Looped(nn.Module):
    """ALBERT / universal-transformer style weight sharing: the same layer applied three times."""

    def __init__(self):
        super().__init__()
        self.inp, self.layer, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for _ in range(3):
            h = self.layer(h)
        return self.head(h)


@EVERY
def test_shared_layer_overflows_on_its_third_call_only(tmp_path, every):
    """From step 3 the shared layer's weights are x100: each call multiplies the activations by ~70, the first two
    calls stay finite and the third passes 65504. The shared layer made it (on its third call, index 2)."""
    torch.manual_seed(0)
    m, x = Looped(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.layer.weight.mul_(100.0)
        return (x,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    with torch.no_grad(), torch.autocast(**FP16):
        h1 = m.layer(torch.relu(m.inp(x)))
        h2 = m.layer(h1)
        assert torch.isfinite(h1).all() and torch.isfinite(h2).all() and torch.isinf(m.layer(h2)).any()  # real
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "layer")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        assert f.evidence.get("call") in (2, None), f.evidence
        no_error_at(rep, ("inp", "head", ""))
