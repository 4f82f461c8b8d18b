"""Twenty-ninth set: fp16 failures in NON-transformer architectures at ampdoctor's DEFAULT sampling (every=None: full
statistics on step 0 and every 200th only), each starting on an UNSAMPLED step (6-30) and never through a batch with
more values than the ones before (no 8x input jump that would make the step sampled). Every model is trained with the
ordinary loop (probe_harness.train_loop: fp16 CPU autocast + GradScaler("cpu"), unscale_, clip, step, update) under
ampdoctor.watch(model, optimizer=, scaler=).

Each failure is proven by an independent oracle before anything ampdoctor says: probe_harness.Producer's hooks name
the innermost module whose output turns non-finite from finite inputs and parameters (or, 6, whose input gradient
turns non-finite from a finite output gradient), real_fwd / real_bwd (the loss and the scaler's first skip at that
step and none before), and, where the weights matter, a fresh unwatched model with the bad step's weights runs the
bad batch: non-finite under fp16 autocast, finite in fp32. Then the rule must be an error at the PRODUCER among the
report's first three findings, at that step, and no error at the modules that only passed the value on.
 1. VAE: a shard of 10-bit raw frames (never / 1023) at step 11; logvar is finite (~70) and exp(0.5 * logvar) in the
    custom `reparam` module passes 65504 -> overflow at `reparam` (not `logvar`, not the decoder);
 2. CLIP-style dual encoder: at step 8 the head's temperature is warm-started from a codebase that keeps the logit
    scale linear (1 / 0.07 = 14.29) into this one's log-space parameter: exp(14.29) = 1.6e6, past 65504 in the fp16
    product -> overflow at `head`;
 3. IRNN (nn.RNN(nonlinearity="relu"), recurrent weight 1.15 x identity; fp16 under CPU autocast) with a
    sequence-length curriculum 12 -> 80 (6.7x the values, below the 8x jump that makes a step sampled) at step 13:
    the hidden state passes 65504 -> overflow at `rnn`, not `head`;
 4. CNN with BatchNorm: a 'spectral normalisation' callback divides features.3's weights by a power-iteration
    estimate stuck at its 1e-5 floor before step 9 -> overflow at `features.3` (the conv), not the BatchNorm after it;
 5. DDPM denoiser: an embedder written for continuous t in [0, 1] (t * 1000) fed integer timesteps in the activations'
    dtype; a low-noise curriculum admits t >= 66 at step 13: 66 * 1000 is inf in fp16, sin(inf) NaN -> `temb`;
 6. focal loss over the whole distribution in a `criterion` module, log(softmax) in fp16 behind torch.where: a
    device reporting in the wrong unit (x 25) at step 17 makes non-target probabilities exactly 0, the forward stays
    finite (where masks log(0)), the backward is 0 * -inf = NaN -> `criterion` (the forward op aten::log accepted:
    probe_harness.error_at's hidden_op);
 7. mixture density network: sigma = exp(.) in the `mdn` head; a duration column in seconds, not minutes (x 60 + 90),
    at step 19 -> overflow at `mdn` (not `mdn.log_sigma`);
 8. graph network: weighted messages summed with scatter_add_ in fp16; day 21's interaction graph is a star (every
    edge into user 0, the same number of edges) -> overflow at `convs.0` (not its LayerNorm, not `convs.1`);
 9. bag-of-words encoder: x / x.norm() (no eps) in `l2norm`; an empty document (all stop words) at step 23: its mean
    bag and bias-free projection are a zero row, 0 / 0 -> nan_origin at `l2norm`;
10. ArcFace-style cosine classifier: F.normalize's default eps = 1e-12 is 0 in fp16; a dropped frame's all-zero crop
    at step 6 gives zero features -> eps_underflow at `cos` (the clamp_min guard does nothing);
11. GAT (pyGAT's layer): torch.where(adj > 0, e, -9e15 * ones_like(e)); -9e15 is -inf in fp16; adjacency without
    self-loops and, from step 14, a paper with no citations (an all-masked row): softmax NaN -> mask_value_overflow at
    `gat1` (the same constant in `gat2` is a second true producer);
12. tabular regressor: from step 9 (epoch 2) the loss is re-balanced per region with weights 1 / count (2e-9 to
    1.5e-8, not normalised to mean 1); the loss scale stays 1024 (GradScaler's growth_interval 2000): >= 90% of the
    gradient into `head`'s fp16 output is below 2^-14, body.0's weight gradient > 50% exact zeros (fp32: none) ->
    underflow (backward) at head / body.*.
Healthy twins (the same architectures, sane settings; no warning, no error, losses fall, no skip, no producer):
the VAE on scaled pixels; the CLIP head with CLIP's clamp at ln(100) on the same warm start; the GAT with the dtype's
own minimum as the fill on the same isolated node.

What ampdoctor said. Right (1-11): overflow at reparam (aten::exp) 11, head (aten::mul) 8, rnn (aten::addmm) 13,
features.3 (aten::convolution) 9, temb (aten::mul, "propagates to aten::sin") 13, criterion (aten::log, forward) 17,
mdn (aten::exp) 19, convs.0 (aten::scatter_add_) 21; nan_origin at l2norm (aten::div) 23; at cos eps_underflow
(aten::clamp_min, eps 1e-12) first and nan_origin (aten::div) second, step 6; at gat1 mask_value_overflow (-9e15)
first and overflow (aten::mul) second, step 14 (each the other way round before the replay fold ranked a constant
before the inf/NaN it explains); the three twins quiet.
12 (fixed; was an empty report at the default sampling and at every=1 alike): underflow (backward) at head, dated at
step 9, where the loss fell 1e8x and the loss scale did not follow. Twin: the same weights normalised to mean 1, quiet.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_unseen_variants29.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import error_at, finite, healthy, real_bwd, real_fwd, snap_before, train_loop
from scenarios import gen, lines, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
FWD = ("overflow", "nan_origin")     # an op inside the producer made inf, a later op of the same module NaN


def fp16_only(factory, sd, call, args):
    """The independent re-run: a fresh unwatched model with the bad step's weights runs the bad batch; under fp16
    autocast its output is non-finite, in fp32 finite (the failure is the working dtype's, not the data's)."""
    outs = []
    for enabled in (True, False):
        m = factory()
        m.load_state_dict(sd)
        torch.manual_seed(1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=enabled):
            outs.append(call(m)(*args))
    assert not finite(outs[0]), "fp16 run is finite"
    assert finite(outs[1]), "fp32 run is not finite"


# ======================================================================================================================
# 1 + twin. VAE: exp(0.5 * logvar) in a Reparam module
# ======================================================================================================================
class Reparam(nn.Module):
    def forward(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + std * torch.randn_like(std)


class VAE(nn.Module):
    def __init__(self, d=64, h=64, z=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.mu, self.logvar = nn.Linear(h, z), nn.Linear(h, z)
        self.reparam = Reparam()
        self.dec = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x):
        h = self.enc(x)
        mu, lv = self.mu(h), self.logvar(h)
        return self.dec(self.reparam(mu, lv)), mu, lv


VAE_RAW = 11


def pixels(i, raw_at=VAE_RAW):
    """Step i's 32 flattened 8x8 grey images in [0, 1]; at `raw_at` a shard of 10-bit raw sensor frames that the
    loader never divided by 1023 (0..1023 counts)."""
    g = gen(100 + i)
    base = torch.rand(32, 1, 8, 8, generator=g)
    x = F.avg_pool2d(F.pad(base, (1, 1, 1, 1), mode="replicate"), 3, 1).flatten(1)   # smooth, learnable images
    if i == raw_at:
        x = (x * 1023).round()
    return (x,)


def vae_loss(out, x):
    xr, mu, lv = out
    rec = F.mse_loss(xr.float(), x)
    kl = -0.5 * torch.mean(1 + lv.float() - mu.float().pow(2) - lv.float().exp())
    return rec + 1e-3 * kl


def test_vae_reparam_exp_of_logvar_overflows_on_an_unscaled_shard():
    torch.manual_seed(0)
    m, store = VAE(), {}
    r = train_loop(m, pixels, vae_loss, 16, lr=1e-3, after_step=snap_before(m, VAE_RAW, store))
    real_fwd(r, "reparam", VAE_RAW)
    fp16_only(VAE, store["sd"], lambda mm: mm, pixels(VAE_RAW))
    # the mechanism: logvar is finite (~tens) and exp(0.5 * logvar) passes 65504
    mm = VAE()
    mm.load_state_dict(store["sd"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        lv = mm.logvar(mm.enc(pixels(VAE_RAW)[0]))
    assert torch.isfinite(lv).all() and lv.max() > 2 * math.log(65504), lv.max()
    rep = r["w"].report()
    error_at(rep, FWD, "reparam", step=VAE_RAW, phase="forward")
    no_error_at(rep, ("logvar", "mu", "dec", "dec.0", "enc"))


def test_twin_vae_on_scaled_pixels_is_quiet():
    torch.manual_seed(0)
    m = VAE()
    healthy(train_loop(m, lambda i: pixels(i, raw_at=None), vae_loss, 24, lr=1e-3, backward=True))


# ======================================================================================================================
# 2 + twin. CLIP-style contrastive head: a learnable logit scale without CLIP's clamp at ln(100)
# ======================================================================================================================
class ClipHead(nn.Module):
    """Cosine similarities times exp(logit_scale) (CLIP's init ln(1 / 0.07)); `clamp`: CLIP's clamp at ln(100)."""

    def __init__(self, clamp=False):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.clamp = clamp

    def forward(self, a, b):
        a = a / a.norm(dim=-1, keepdim=True)
        b = b / b.norm(dim=-1, keepdim=True)
        s = self.logit_scale.clamp(max=math.log(100.0)) if self.clamp else self.logit_scale
        return s.exp() * (a @ b.t())


class DualEncoder(nn.Module):
    def __init__(self, clamp=False, d=24, e=16):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, e))
        self.txt = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, e))
        self.head = ClipHead(clamp)

    def forward(self, x, y):
        return self.head(self.img(x), self.txt(y))


_PAIR_R = torch.randn(24, 24, generator=gen(7)) / 24 ** 0.5


def pairs(i):
    """Step i's 32 (image, caption) feature pairs: the caption is a fixed linear view of the image plus noise."""
    g = gen(200 + i)
    x = torch.randn(32, 24, generator=g)
    return x, x @ _PAIR_R + 0.1 * torch.randn(32, 24, generator=g)


def clip_loss(logits, x, y):
    lab = torch.arange(logits.shape[0])
    z = logits.float()
    return (F.cross_entropy(z, lab) + F.cross_entropy(z.t(), lab)) / 2


def no_loss_jump(losses, upto):
    """No finite loss moved by 1000x in one step before `upto` (such a move makes ampdoctor sample the next step)."""
    for a, b in zip(losses[:upto], losses[1:upto]):
        a, b = max(abs(a), 1e-12), max(abs(b), 1e-12)
        assert a / b < 1000 and b / a < 1000, losses


CLIP_RESUME = 8


def warm_start_scale(m, at):
    """At the end of step `at - 1` the head's temperature is warm-started from a run of a codebase that keeps the
    logit scale linear (1 / 0.07 = 14.29, the value it logs as `logit_scale`) into this one's log-space parameter:
    exp(14.29) = 1.6e6, finite in fp32, past 65504 in fp16."""
    def after(i):
        if i == at - 1:
            with torch.no_grad():
                m.head.logit_scale.fill_(1 / 0.07)
    return after


def test_clip_logit_scale_warm_started_in_linear_units_overflows_fp16():
    torch.manual_seed(0)
    m, store = DualEncoder(), {}
    ws = warm_start_scale(m, CLIP_RESUME)

    def after(i):
        ws(i)
        snap_before(m, CLIP_RESUME, store)(i)
    r = train_loop(m, pairs, clip_loss, CLIP_RESUME + 3, lr=5e-3, after_step=after)
    real_fwd(r, "head", CLIP_RESUME)
    no_loss_jump(r["losses"], CLIP_RESUME)
    fp16_only(DualEncoder, store["sd"], lambda mm: mm, pairs(CLIP_RESUME))
    rep = r["w"].report()
    error_at(rep, FWD, "head", step=CLIP_RESUME, phase="forward")
    no_error_at(rep, ("img", "txt", "img.2", "txt.2"))


def test_twin_clip_with_the_clamp_is_quiet():
    """CLIP's clamp at ln(100) on the same warm start: logits stay within 100."""
    torch.manual_seed(0)
    m = DualEncoder(clamp=True)
    healthy(train_loop(m, pairs, clip_loss, 24, lr=5e-3, backward=True, after_step=warm_start_scale(m, CLIP_RESUME)))


# ======================================================================================================================
# 3. IRNN (ReLU RNN, recurrent weights initialised to a gain x identity) under a sequence-length curriculum
# ======================================================================================================================
class IRNN(nn.Module):
    def __init__(self, gain=1.15):
        super().__init__()
        self.rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(gain * torch.eye(32))
            self.rnn.bias_hh_l0.zero_()
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])[:, 0]


RNN_LONG = 13


def sequences(i, long_at=RNN_LONG):
    """Step i's 16 sequences of 4 features, 12 steps long, 80 from step `long_at` (a 6.7x curriculum jump, fewer than
    8x the values); the target: the mean of feature 0."""
    T = 80 if i >= long_at else 12
    x = torch.rand(16, T, 4, generator=gen(300 + i))
    return x, x[:, :, 0].mean(1)


def seq_mse(out, x, y):
    return F.mse_loss(out.float(), y)


def test_irnn_hidden_state_overflows_when_the_curriculum_lengthens_the_sequences():
    torch.manual_seed(0)
    m, store = IRNN(), {}
    r = train_loop(m, sequences, seq_mse, RNN_LONG + 3, call=lambda x, y: m(x), lr=1e-3,
                   after_step=snap_before(m, RNN_LONG, store))
    real_fwd(r, "rnn", RNN_LONG)
    fp16_only(IRNN, store["sd"], lambda mm: (lambda x, y: mm(x)), sequences(RNN_LONG))
    rep = r["w"].report()
    error_at(rep, FWD, "rnn", step=RNN_LONG, phase="forward")
    no_error_at(rep, ("head",))


# ======================================================================================================================
# 4. CNN with BatchNorm: a callback rescales one conv's weights by 1 / (a power iteration's spectral norm estimate)
# ======================================================================================================================
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


CNN_SPIKE = 9


def images(i):
    g = gen(400 + i)
    y = torch.randint(0, 5, (16,), generator=g)
    x = torch.randn(16, 3, 8, 8, generator=g) * 0.5 + y[:, None, None, None].float() / 4
    return x, y


def ce(out, x, y):
    return F.cross_entropy(out.float(), y)


def spectral_callback(m, at):
    """At the end of step `at - 1`, a 'spectral normalisation' callback divides features.3's weights by a power
    iteration's norm estimate; started from a zero vector the estimate is its floor, 1e-5 (x 1e5)."""
    def after(i):
        if i == at - 1:
            with torch.no_grad():
                m.features[3].weight.div_(1e-5)
    return after


def test_cnn_conv_overflows_after_a_weight_spike_not_the_batchnorm_after_it():
    torch.manual_seed(0)
    m, store = SmallCNN(), {}
    spike = spectral_callback(m, CNN_SPIKE)

    def after(i):
        spike(i)
        snap_before(m, CNN_SPIKE, store)(i)
    r = train_loop(m, images, ce, CNN_SPIKE + 3, call=lambda x, y: m(x), lr=3e-3, after_step=after)
    real_fwd(r, "features.3", CNN_SPIKE)
    fp16_only(SmallCNN, store["sd"], lambda mm: (lambda x, y: mm.train()(x)), images(CNN_SPIKE))
    rep = r["w"].report()
    error_at(rep, FWD, "features.3", step=CNN_SPIKE, phase="forward")
    no_error_at(rep, ("features.4", "features.0", "fc", "features"))


# ======================================================================================================================
# 5. diffusion: a continuous-time embedder (t * 1000) fed DDPM's integer timesteps, in the activations' dtype
# ======================================================================================================================
class TimeEmbedding(nn.Module):
    """Sinusoidal features of t * scale, written for t in [0, 1] (score-SDE style), computed in `like`'s dtype."""

    def __init__(self, dim=32, scale=1000.0):
        super().__init__()
        half = dim // 2
        self.register_buffer("freqs", torch.exp(-math.log(10000.0) * torch.arange(half) / half))
        self.scale = scale

    def forward(self, t, like):
        a = (t.to(like.dtype) * self.scale)[:, None] * self.freqs.to(like.dtype)[None]
        return torch.cat([a.sin(), a.cos()], -1)


class Denoiser(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.temb = TimeEmbedding(d)
        self.tmlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.body = nn.Sequential(nn.SiLU(), nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 16))

    def forward(self, x, t):
        h = self.inp(x)
        return self.body(h + self.tmlp(self.temb(t, h)))


_BETAS = torch.linspace(1e-4, 0.02, 1000)
_ABAR = torch.cumprod(1 - _BETAS, 0)


def ddpm_batch(i):
    """Step i's 64 noised samples, integer timesteps from a low-noise curriculum t < min(1000, 5 (i + 1))."""
    g = gen(500 + i)
    x0 = torch.randn(64, 16, generator=g) * 0.5 + 1.0
    t = torch.randint(0, min(1000, 5 * (i + 1)), (64,), generator=g)
    eps = torch.randn(64, 16, generator=g)
    ab = _ABAR[t][:, None]
    return ab.sqrt() * x0 + (1 - ab).sqrt() * eps, t, eps


def eps_mse(out, x, t, eps):
    return F.mse_loss(out.float(), eps)


DDPM_BAD = 13      # the first step whose curriculum admits t >= 66: 66 * 1000 > 65504


def test_diffusion_time_embedding_of_integer_timesteps_times_1000_overflows():
    torch.manual_seed(0)
    m = Denoiser()
    assert max(int(ddpm_batch(i)[1].max()) for i in range(DDPM_BAD)) <= 65 < int(ddpm_batch(DDPM_BAD)[1].max())
    r = train_loop(m, ddpm_batch, eps_mse, DDPM_BAD + 3, call=lambda x, t, e: m(x, t), lr=1e-3)
    real_fwd(r, "temb", DDPM_BAD)
    # the mechanism: t * 1000 of t = 66 is inf in fp16, finite in fp32; sin(inf) is NaN
    t = torch.tensor([65, 66])
    assert torch.isfinite(t.half() * 1000.0)[0] and not torch.isfinite(t.half() * 1000.0)[1]
    assert torch.isnan(torch.sin(t.half() * 1000.0))[1]
    rep = r["w"].report()
    error_at(rep, FWD, "temb", step=DDPM_BAD, phase="forward")
    no_error_at(rep, ("tmlp", "tmlp.0", "body", "inp"))


# ======================================================================================================================
# 6. focal loss in a criterion module: log(softmax) in fp16 behind a torch.where -> NaN in the backward only
# ======================================================================================================================
class FocalLoss(nn.Module):
    """Multi-class focal loss (Lin et al. 2017) written over the whole distribution, the non-target terms masked with
    torch.where (a one-hot 'alpha' mask): log(softmax) in the working dtype."""

    def __init__(self, gamma=2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, y):
        p = torch.softmax(logits, -1)
        logp = torch.log(p)
        onehot = F.one_hot(y, logits.shape[-1]).bool()
        terms = (1 - p) ** self.gamma * logp
        return -torch.where(onehot, terms, torch.zeros_like(terms)).sum(-1).mean()


class FocalNet(nn.Module):
    def __init__(self, d=16, c=8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, c))
        self.criterion = FocalLoss()

    def forward(self, x, y):
        return self.criterion(self.body(x), y)


_FOCAL_W = torch.randn(16, 8, generator=gen(8))
FOCAL_GLITCH = 17


def tabular(i, glitch_at=FOCAL_GLITCH):
    """Step i's 64 rows, labels from a fixed linear teacher; at `glitch_at` the rows of one device whose firmware
    reports in the wrong unit (x 25)."""
    x = torch.randn(64, 16, generator=gen(600 + i))
    y = (x @ _FOCAL_W).argmax(-1)
    if i == glitch_at:
        x[:8] = x[:8] * 25
    return x, y


def as_loss(out, *args):
    return out.float()


def test_focal_loss_log_softmax_behind_where_is_nan_in_the_backward():
    torch.manual_seed(0)
    m = FocalNet()
    r = train_loop(m, tabular, as_loss, FOCAL_GLITCH + 3, lr=1e-2, backward=True)
    real_bwd(r, "criterion", FOCAL_GLITCH)
    rep = r["w"].report()
    error_at(rep, FWD, "criterion", step=FOCAL_GLITCH, phase="backward", hidden_op="aten::log")
    no_error_at(rep, ("body", "body.2", "body.0"))


# ======================================================================================================================
# 7. mixture density network: sigma = exp(.) in the MDN head
# ======================================================================================================================
class MDNHead(nn.Module):
    def __init__(self, d=32, k=4):
        super().__init__()
        self.pi, self.mu, self.log_sigma = nn.Linear(d, k), nn.Linear(d, k), nn.Linear(d, k)

    def forward(self, h):
        return self.pi(h), self.mu(h), torch.exp(self.log_sigma(h))


class MDN(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.mdn = MDNHead()

    def forward(self, x):
        return self.mdn(self.trunk(x))


MDN_RAW = 19


def inverse_kinematics(i, raw_at=MDN_RAW):
    """Step i's 64 rows of 6 standardised features, a bimodal target; at `raw_at` a new site's duration column
    (feature 5) comes in seconds, not minutes, and unstandardised (x 60 + 90)."""
    g = gen(700 + i)
    x = torch.randn(64, 6, generator=g)
    sign = torch.randint(0, 2, (64,), generator=g).float() * 2 - 1
    y = sign * (x[:, 0].abs() + 0.5) + 0.1 * torch.randn(64, generator=g)
    if i == raw_at:
        x[:, 5] = x[:, 5] * 60 + 90
    return x, y


def mdn_nll(out, x, y):
    logit_pi, mu, sigma = (t.float() for t in out)
    logp = -0.5 * ((y[:, None] - mu) / sigma) ** 2 - sigma.log() - 0.5 * math.log(2 * math.pi)
    return -torch.logsumexp(F.log_softmax(logit_pi, -1) + logp, -1).mean()


def test_mdn_sigma_exp_overflows_on_an_unconverted_column():
    torch.manual_seed(0)
    m, store = MDN(), {}
    r = train_loop(m, inverse_kinematics, mdn_nll, MDN_RAW + 3, call=lambda x, y: m(x), lr=3e-3,
                   after_step=snap_before(m, MDN_RAW, store))
    real_fwd(r, "mdn", MDN_RAW)
    fp16_only(MDN, store["sd"], lambda mm: (lambda x, y: mm(x)), inverse_kinematics(MDN_RAW))
    rep = r["w"].report()
    error_at(rep, FWD, "mdn", step=MDN_RAW, phase="forward")
    no_error_at(rep, ("mdn.log_sigma", "mdn.mu", "mdn.pi", "trunk", "trunk.2"))


# ======================================================================================================================
# 8. graph network: scatter_add aggregation of weighted messages, a star-shaped interaction graph
# ======================================================================================================================
class WeightedSumConv(nn.Module):
    """Messages relu(W x_src) * edge weight (interaction counts), summed at the destination with scatter_add_ in the
    messages' dtype; then an update and a LayerNorm."""

    def __init__(self, d=16):
        super().__init__()
        self.msg, self.upd, self.norm = nn.Linear(d, d), nn.Linear(2 * d, d), nn.LayerNorm(d)

    def forward(self, x, src, dst, w):
        h = F.relu(self.msg(x))
        m = h[src] * w[:, None].to(h.dtype)
        agg = torch.zeros(x.shape[0], m.shape[1], dtype=m.dtype).scatter_add_(0, dst[:, None].expand_as(m), m)
        return self.norm(F.relu(self.upd(torch.cat([x.to(agg.dtype), agg], -1))))


class GNN(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.convs = nn.ModuleList(WeightedSumConv(d) for _ in range(2))
        self.out = nn.Linear(d, 1)

    def forward(self, x, src, dst, w):
        h = self.inp(x)
        for c in self.convs:
            h = c(h, src, dst, w)
        return self.out(h)[:, 0]


GNN_STAR = 21


def snapshot(i, star_at=GNN_STAR, n=1024, e=8192):
    """Day i's interaction graph: n users, e weighted edges (counts 1..50), random endpoints; on day `star_at` a
    giveaway post: every interaction of the day points at user 0 (the same number of edges)."""
    g = gen(800 + i)
    x = torch.randn(n, 8, generator=g)
    src = torch.randint(0, n, (e,), generator=g)
    dst = torch.zeros(e, dtype=torch.long) if i == star_at else torch.randint(0, n, (e,), generator=g)
    w = torch.randint(1, 51, (e,), generator=g).float()
    y = torch.tanh(x[:, 0])
    return x, src, dst, w, y


def node_mse(out, x, src, dst, w, y):
    return F.mse_loss(out.float(), y)


def test_gnn_scatter_add_overflows_at_a_star_shaped_snapshot():
    torch.manual_seed(0)
    m, store = GNN(), {}
    call = lambda x, src, dst, w, y: m(x, src, dst, w)          # noqa: E731
    r = train_loop(m, snapshot, node_mse, GNN_STAR + 3, call=call, lr=3e-3, after_step=snap_before(m, GNN_STAR, store))
    real_fwd(r, "convs.0", GNN_STAR)
    fp16_only(GNN, store["sd"], lambda mm: (lambda x, src, dst, w, y: mm(x, src, dst, w)), snapshot(GNN_STAR))
    rep = r["w"].report()
    error_at(rep, FWD, "convs.0", step=GNN_STAR, phase="forward")
    no_error_at(rep, ("convs.0.msg", "convs.0.upd", "convs.0.norm", "convs.1", "inp", "out"))


# ======================================================================================================================
# 9. a bag-of-words retrieval encoder: x / x.norm() (no eps) on an empty document
# ======================================================================================================================
class L2Norm(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class BagEncoder(nn.Module):
    def __init__(self, vocab=500, d=32, norm=None):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d, mode="mean")
        self.proj = nn.Linear(d, 16, bias=False)
        self.l2norm = norm or L2Norm()
        self.cls = nn.Linear(16, 4)

    def forward(self, tokens, offsets):
        return self.cls(self.l2norm(self.proj(self.bag(tokens, offsets))))


BOW_EMPTY = 23


def documents(i, empty_at=BOW_EMPTY, n=32):
    """Step i's n documents of 5-12 token ids (class = token id mod 4 of the majority); at `empty_at` one document
    whose tokens were all stop words, filtered to nothing (an empty bag)."""
    g = gen(900 + i)
    y = torch.randint(0, 4, (n,), generator=g)
    lens = torch.randint(5, 13, (n,), generator=g)
    if i == empty_at:
        lens[7] = 0
    toks = [torch.randint(0, 125, (int(k),), generator=g) * 4 + y[j] for j, k in enumerate(lens)]
    offsets = torch.tensor([0] + [int(k) for k in lens[:-1]]).cumsum(0)
    return torch.cat(toks), offsets, y


def test_bag_encoder_unit_norm_without_eps_is_nan_on_an_empty_document():
    torch.manual_seed(0)
    m = BagEncoder()
    r = train_loop(m, documents, lambda out, t, o, y: F.cross_entropy(out.float(), y), BOW_EMPTY + 3,
                   call=lambda t, o, y: m(t, o), lr=1e-2)
    real_fwd(r, "l2norm", BOW_EMPTY)
    # the mechanism: the empty bag's mean is a zero row, its projection too (no bias): 0 / 0 (in fp32 as well)
    t, o, _ = documents(BOW_EMPTY)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        z = m.proj(m.bag(t, o))
    assert (z[7] == 0).all() and (z[:7] != 0).any(-1).all()
    rep = r["w"].report()
    error_at(rep, ("nan_origin",), "l2norm", step=BOW_EMPTY, phase="forward")
    no_error_at(rep, ("cls", "proj", "bag"))


# ======================================================================================================================
# 10. ArcFace-style cosine classifier: F.normalize's default eps=1e-12 is 0 in fp16, a black frame's zero features
# ======================================================================================================================
class CosineClassifier(nn.Module):
    def __init__(self, d=32, c=6, s=16.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, d) * 0.1)
        self.s = s

    def forward(self, f):
        return self.s * F.normalize(f, dim=-1) @ F.normalize(self.weight, dim=-1).t().to(f.dtype)


class FaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 32, bias=False))
        self.cos = CosineClassifier()

    def forward(self, x):
        return self.cos(self.backbone(x))


FACE_BLACK = 6


def faces(i, black_at=FACE_BLACK):
    """Step i's 24 8x8 crops of 6 identities; at `black_at` the detector's crop of a dropped frame: all zeros."""
    g = gen(1000 + i)
    y = torch.randint(0, 6, (24,), generator=g)
    x = torch.randn(24, 1, 8, 8, generator=g) * 0.3
    for j in range(24):
        r, c = divmod(int(y[j]), 3)
        x[j, 0, r * 4:(r + 1) * 4, c * 2:(c + 1) * 2 + 1] += 1.5
    if i == black_at:
        x[5] = 0
    return x, y


def test_cosine_classifier_f_normalize_eps_vanishes_in_fp16_on_a_black_frame():
    torch.manual_seed(0)
    m, store = FaceNet(), {}
    r = train_loop(m, faces, ce, FACE_BLACK + 3, call=lambda x, y: m(x), lr=1e-2,
                   after_step=snap_before(m, FACE_BLACK, store))
    real_fwd(r, "cos", FACE_BLACK)
    # the mechanism: eps = 1e-12 is 0 in fp16, so a zero feature row gives 0 / 0; in fp32 the same row is 0
    assert torch.tensor(1e-12, dtype=torch.float16) == 0
    fp16_only(FaceNet, store["sd"], lambda mm: (lambda x, y: mm(x)), faces(FACE_BLACK))
    rep = r["w"].report()
    error_at(rep, ("eps_underflow",), "cos", step=FACE_BLACK, phase="forward")
    # the vanished eps is the root cause of the NaN the same module's division made: ranked before it
    assert (rep.findings[0].rule, rep.findings[0].module) == ("eps_underflow", "cos"), lines(rep)
    no_error_at(rep, ("backbone", "backbone.6"))


# ======================================================================================================================
# 11 + twin. GAT (pyGAT's layer): masked scores torch.where(adj > 0, e, -9e15 * ones_like(e)), an isolated node
# ======================================================================================================================
class GATLayer(nn.Module):
    """pyGAT's GraphAttentionLayer (Diego999/pyGAT): e_ij = leakyrelu(a1 Wh_i + a2 Wh_j), non-edges set to -9e15;
    `safe`: the dtype's own minimum instead."""

    def __init__(self, fin, fout, safe=False):
        super().__init__()
        self.W = nn.Linear(fin, fout, bias=False)
        self.a1, self.a2 = nn.Linear(fout, 1, bias=False), nn.Linear(fout, 1, bias=False)
        self.safe = safe

    def forward(self, h, adj):
        wh = self.W(h)
        e = F.leaky_relu(self.a1(wh) + self.a2(wh).t(), 0.2)
        fill = torch.full_like(e, torch.finfo(e.dtype).min) if self.safe else -9e15 * torch.ones_like(e)
        att = torch.softmax(torch.where(adj > 0, e, fill), dim=1)
        return att @ wh


class GAT(nn.Module):
    def __init__(self, safe=False):
        super().__init__()
        self.gat1, self.gat2 = GATLayer(8, 16, safe), GATLayer(16, 3, safe)

    def forward(self, x, adj):
        return self.gat2(F.elu(self.gat1(x, adj)), adj)


GAT_ISOLATED = 14


def citation_graph(i, isolated_at=GAT_ISOLATED, n=64):
    """Step i's graph of n papers in 3 topics (features: topic signal + noise), edges mostly within a topic, the
    adjacency built from the edge list WITHOUT self-loops (each node has >= 1 neighbour); from `isolated_at` on a
    newly added paper (node 0) has no citations yet: an all-zero row."""
    g = gen(1100 + i)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) * 0.5
    x[torch.arange(n), y] += 1.0
    same = (y[:, None] == y[None]).float()
    adj = (torch.rand(n, n, generator=g) < 0.15 * same + 0.01).float()
    adj = ((adj + adj.t()) > 0).float()
    adj.fill_diagonal_(0)
    lonely = adj.sum(1) == 0
    adj[lonely, (torch.arange(n)[lonely] + 1) % n] = 1            # everyone cites someone
    adj = ((adj + adj.t()) > 0).float()
    if i >= isolated_at:
        adj[0], adj[:, 0] = 0, 0
    return x, adj, y


def gat_ce(out, x, adj, y):
    return F.cross_entropy(out.float(), y)


def test_gat_minus_9e15_mask_is_inf_in_fp16_and_an_isolated_node_softmaxes_to_nan():
    torch.manual_seed(0)
    m, store = GAT(), {}
    x, adj, _ = citation_graph(GAT_ISOLATED - 1)
    assert (adj.sum(1) > 0).all() and (citation_graph(GAT_ISOLATED)[1].sum(1) == 0).sum() == 1
    r = train_loop(m, citation_graph, gat_ce, GAT_ISOLATED + 3, call=lambda x, adj, y: m(x, adj), lr=1e-2,
                   after_step=snap_before(m, GAT_ISOLATED, store))
    real_fwd(r, "gat1", GAT_ISOLATED)
    assert torch.isinf(-9e15 * torch.ones(1, dtype=torch.float16)).all()
    fp16_only(GAT, store["sd"], lambda mm: (lambda x, adj, y: mm(x, adj)), citation_graph(GAT_ISOLATED))
    rep = r["w"].report()
    error_at(rep, ("mask_value_overflow",), "gat1", step=GAT_ISOLATED, phase="forward")
    # the constant is the root cause of the inf the same module's mul made: ranked before it
    assert (rep.findings[0].rule, rep.findings[0].module) == ("mask_value_overflow", "gat1"), lines(rep)
    # (gat2 holds the same -9e15 and the same all-masked row: an error there is a second true producer, not a blame
    # of a propagator)
    no_error_at(rep, ("gat1.W", "gat1.a1", "gat1.a2", "gat2.W"))


def test_twin_gat_with_the_dtype_minimum_on_the_isolated_node_is_quiet():
    torch.manual_seed(0)
    m = GAT(safe=True)
    healthy(train_loop(m, citation_graph, gat_ce, 24, call=lambda x, adj, y: m(x, adj), lr=1e-2, backward=True))


# ======================================================================================================================
# 12. a tabular regressor whose loss gets inverse-frequency sample weights 1 / count (not normalised to mean 1)
# ======================================================================================================================
class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.body(x))[:, 0]


REWEIGHT = 9
_REG_W = torch.randn(12, generator=gen(12))
_COUNTS = torch.tensor([4.2e8, 6.8e7, 1.6e8, 2.4e8])      # rows per region in the full click log


def regions(i, normalised=False):
    """Step i's 64 rows (4 regions); from step `REWEIGHT` on (epoch 2) the loss is re-balanced per region with
    weight 1 / count: 2e-9 to 1.5e-8 instead of ~1 (`normalised`: the same weights scaled to mean 1)."""
    g = gen(1200 + i)
    x = torch.randn(64, 12, generator=g)
    reg = torch.randint(0, 4, (64,), generator=g)
    y = torch.tanh(x @ _REG_W / 3) + 0.3 * reg.float()
    w = 1.0 / _COUNTS[reg] if i >= REWEIGHT else torch.ones(64)
    if normalised:
        w = w / w.mean()
    return x, reg, y, w


def weighted_mse(out, x, reg, y, w):
    return (w * (out.float() - y) ** 2).sum() / 64


class GradInto:
    """Backward hook on `mod`: per step, the share of the gradient reaching its output that is zero or below fp16's
    normal range (2^-14), and the dtype."""

    def __init__(self, mod):
        self.per_step, self.step = {}, 0
        self.h = mod.register_full_backward_hook(self._hook)

    def _hook(self, mod, gin, gout):
        g = gout[0].detach()
        self.per_step[self.step] = (g.dtype, float((g.abs() < 2 ** -14).float().mean()))


def test_inverse_frequency_weights_make_the_head_gradient_underflow_fp16():
    torch.manual_seed(0)
    m, store = Regressor(), {}
    probe = GradInto(m.head)

    def batch(i):
        probe.step = i
        return regions(i)
    r = train_loop(m, batch, weighted_mse, REWEIGHT + 4, call=lambda x, reg, y, w: m(x), lr=3e-3,
                   after_step=snap_before(m, REWEIGHT, store))
    probe.h.remove()
    # real: the gradient into `head`'s fp16 output is mostly normal before, >= 90% subnormal or zero from REWEIGHT on
    assert all(probe.per_step[i][1] < 0.25 for i in range(REWEIGHT)), probe.per_step
    assert all(probe.per_step[i][1] >= 0.9 and probe.per_step[i][0] == torch.float16
               for i in range(REWEIGHT, REWEIGHT + 4)), (probe.per_step, r["scales"])
    # and the damage: on the same weights, batch and loss scale, fp16 autocast flushes most of the first layer's
    # weight gradient to exactly 0 (fp32: none), its direction is lost
    grads = {}
    for ac in (True, False):
        mm = Regressor()
        mm.load_state_dict(store["sd"])
        x, reg, y, w = regions(REWEIGHT)
        with torch.autocast("cpu", dtype=torch.float16, enabled=ac):
            out = mm(x)
        (weighted_mse(out, x, reg, y, w) * r["scales"][REWEIGHT]).backward()
        grads[ac] = mm.body[0].weight.grad
    assert (grads[True] == 0).float().mean() > 0.5 and (grads[False] != 0).all()
    assert (grads[True] - grads[False]).norm() > 0.5 * grads[False].norm()
    assert not r["skipped"] and not r["bad_loss"], r
    rep = r["w"].report()
    hits = [f for f in rep.findings[:3] if f.rule == "underflow" and f.module in ("head", "body", "body.0", "body.2")
            and f.phase == "backward" and f.step in range(REWEIGHT, REWEIGHT + 4)]
    assert hits, lines(rep)


def test_twin_inverse_frequency_weights_normalised_to_mean_one_is_quiet():
    torch.manual_seed(0)
    m = Regressor()
    probe = GradInto(m.head)

    def batch(i):
        probe.step = i
        return regions(i, normalised=True)
    r = train_loop(m, batch, weighted_mse, REWEIGHT + 4, call=lambda x, reg, y, w: m(x), lr=3e-3)
    probe.h.remove()
    assert all(v[1] < 0.25 for v in probe.per_step.values()), probe.per_step  # gradients stay in fp16's range
    assert not r["skipped"] and not r["bad_loss"] and all(map(math.isfinite, r["losses"])), r
    rep = r["w"].report()
    assert not [f for f in rep.findings if f.severity in ("warning", "error")], lines(rep)
