"""DOMAIN MODELS (diffusion, VAE, audio, stereo, contrastive, point-cloud graphs, detection) that break under fp16
or bf16: tiny CPU models, each with one mechanism written the way those code bases write it, trained for 8 steps.
fp16 cases run in probe_harness.probe_run (fp16 CPU autocast + GradScaler("cpu"): scale(loss).backward -> unscale_
-> clip_grad_norm_(1.0) -> step -> update -> close() -> report()) under `ampdoctor.watch(model, optimizer=AdamW,
scaler=..., run_dir=...)` at the default settings; the bf16-only cases run the ordinary bf16 loop (bf16 CPU
autocast, no scaler: backward -> clip -> step) under `ampdoctor.watch(model, optimizer=AdamW, scaler=None,
run_dir=...)`.

The trigger arrives with the data at step K = 5 (the first batch that draws the last diffusion timestep, a
zero-padded clip, a raw 0-255 frame, a stray LiDAR point, ...); every earlier step is finite.

Each failure is first proven by the file's own oracle (probe_harness.Producer, keyword inputs checked: the module
and step where the first inf/NaN is made from finite inputs, own parameters finite; before K nothing but the
scaler's opening backoffs, steps 0-2; the loss first non-finite at K) and by a float32 check of the mechanism (the
same computation in fp32 is finite); a failing oracle is a plain failure, never an xfail. Then the CONTRACT.md rule
must be among the FIRST THREE findings, severity warning or error, at the producer module and step K. A wrong
report raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. fourier_t     score_sde's Gaussian-Fourier time features (scale 16, 2*pi folded in) as a frozen Linear(1, 8)
                  fed raw DDPM timesteps: t < 50 in the low-noise warm-up, full range 0..999 from step 5: t * w
                  passes 65504 in the fp16 Linear -> overflow at `temb.proj` (sin(inf) = NaN downstream).
 2. x0_cosine     a DDPM wrapper that reconstructs x0 = (x_t - sqrt(1 - ab) * eps) / sqrt(ab) for an x0 loss, with
                  the cosine schedule's alphas_cumprod cast to the prediction's dtype (diffusers' `.to(dtype)`):
                  ab[999] = 2.4e-9 is 0 in fp16, 1/sqrt(0) -> overflow (or underflow) at `x0`, step 5 (the first
                  batch drawing t = 999).
 3. vae_kl        a VAE whose KL term is its own submodule, -0.5 * sum(1 + logvar - mu^2 - exp(logvar)) in fp16: a
                  depth-map shard left in centimetres (0-100, not normalised) at step 5 gives logvar ~17 > 11.1,
                  exp = inf (KL taken right after the encoder, as many VAEs do) -> overflow at `kl`.
 4. logmel_amin   an in-model log-mel front end written as torchaudio's AmplitudeToDB, 10 * log10(clamp(mel,
                  min=1e-10)): 1e-10 is 0 in fp16; the first zero-padded (silent) clip at step 5 -> log10(0) = -inf
                  -> eps_underflow (or overflow) at `frontend`.
 5. gwc_cost      a GwcNet-style group-wise correlation cost volume `(fl * fr).view(B, G, C/G, ...).mean(2)` on fp16
                  features: the elementwise product overflows before the mean; a raw 12-bit stereo pair at step 5 ->
                  overflow at `cost`.
 6. cos_by_hand   SimCLR's NT-Xent on a cosine similarity by hand, a @ b.T / (sqrt(sum(a*a)) * sqrt(sum(b*b))):
                  an image left unnormalised (x 255, both views) at step 5, its two views' z1.z2 and |z|^2 pass
                  65504, inf / inf = NaN -> nan_origin (or overflow) at `sim`.
 7. kernel_deg    a point-cloud graph conv with Gaussian-kernel edge weights exp(-d^2 / 2s^2) on positions cast to
                  the features' dtype (`pos.type_as(h)`) and symmetric degree normalisation deg^-1/2: a stray point
                  (~4.5 from the object) at step 5 has every edge weight below fp16's subnormals (0), deg = 0, inf *
                  0 = NaN -> nan_origin (or underflow/overflow) at `gconv` (float32: weights ~1e-10, finite).
 8. fcos_exp      an FCOS head ported without mmdet's `.float()`: ltrb = exp(Scale(bbox_pred(x))) with mmcv's
                  0-dim Scale (the product stays fp16): a raw 10-bit frame at step 5 gives reg > 11.1, ltrb = inf;
                  the IoU loss hides it (min(inf, t) = t, iou = 0 -> clamp -> finite loss), the backward's
                  inf * 0 = NaN makes the scaler skip -> overflow at `head`.
 9. bf16_score    (bf16 only) a VP-SDE score head, score = -eps / std with std = sqrt(1 - ab) and ab cast to the
                  prediction's bf16: ab[3] = 0.99948 is 1.0 in bf16 (0.99951 in fp16), std = 0, -eps / 0 = inf ->
                  overflow at `score`, step 5 (the first batch drawing a small t).
10. bf16_bce      (bf16 only) an objectness criterion by hand, -(t log p + (1 - t) log(1 - p)) on p = sigmoid(logit)
                  in bf16: a clean, high-contrast positive at step 5 has logit in (5.6, 8), p rounds to 1.0 in bf16 (not in
                  fp16), (1 - t) * log(0) = 0 * -inf = NaN -> nan_origin (or overflow) at `criterion`.
Healthy twins (the same triggers, done correctly; no warning, no error):
11. fourier_t with the projection in fp32 (autocast off, t.float() @ W, sin/cos cast back): quiet.
12. logmel_amin with the dB conversion in fp32 (mel.float().clamp(min=1e-10)): quiet on the silent clip.
13. bf16_bce with F.binary_cross_entropy_with_logits on fp32 logits: quiet on the confident positive.

Result when written (torch 2.13 CPU, default watch): 13 pass, 0 xfail (stable over two runs, ~4 s). ampdoctor's
first findings (abridged):
 1. PASS [error] overflow at temb.proj aten::mm step 5 (max |x| 999 -> inf; propagates to aten::sin in temb);
    [error] skipped_steps at temb.proj; [info] precision_loss at temb.proj (integer timesteps in fp16).
 2. PASS [error] overflow at x0 aten::div step 5 (singular point); [error] underflow at x0 aten::div step 5 (the
    zeros are not zero in fp32); [error] skipped_steps.
 3. PASS [error] overflow at kl aten::exp step 5 (input up to 16.95); [error] skipped_steps.
 4. PASS [error] eps_underflow at frontend aten::clamp step 5 (1e-10 rounds to 0); [error] overflow at frontend
    aten::log10 step 5; [error] skipped_steps.
 5. PASS [error] overflow at cost aten::mul step 5 (propagates to aten::mean in cost); [error] skipped_steps.
 6. PASS [error] overflow at sim aten::sum step 5 (propagates to aten::div in sim); [error] skipped_steps.
 7. PASS [error] overflow at gconv aten::pow step 5; [error] underflow at gconv aten::pow step 5; skipped_steps.
    The overflow's words were wrong when written (an x**2 overflow of a variance, for deg.pow(-0.5) at 0); fixed
    since (replay/explain.py: a negative power at 0 is its singular point); the case checks the words.
    (Rule, module and step right; the overflow message's text is the squaring one, "input up to 10.59; x**2 is inf
    for |x| > 255.9", while the inf comes from deg.pow(-0.5) of deg == 0 - the underflow finding says it right.)
 8. PASS [error] overflow at head aten::exp step 5 (input up to 55.7), although the loss stayed finite;
    [info] skipped_steps.
 9. PASS [error] overflow at score aten::div step 5; [error] underflow at score aten::div step 5.
10. PASS [error] overflow at criterion aten::log step 5 (-inf; propagates to aten::mul); [error] underflow at
    criterion aten::log step 5.
11-13. quiet (no finding at all).
(Not built: DDPM 1/sqrt(alpha_bar) with the linear schedule - ab[999] = 4e-5 stays a nonzero fp16 subnormal, no inf;
GCN deg = 0 for an isolated node and dice 0/0 on an empty mask - they fail in fp32 as well, not precision faults;
RAFT's correlation volume, RetinaNet's exp(dw), CLIP's logit_scale and log(mel + 1e-10) - built in earlier sets.)
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, probe_run, named_top3, quiet_twin
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

K, STEPS, B = 5, 8, 8
ALARM = ("warning", "error")
FWD = ("overflow", "nan_origin")
BF16 = torch.bfloat16


def own_loss(out, y):
    """The model returns its own loss."""
    return out.float()


# ======================================================================================================================
# checks
# ======================================================================================================================
def real(r, module, step=K, hidden=False):
    """The oracle: the first inf/NaN from finite inputs is made by `module` at `step`; before `step` nothing but the
    scaler's first backoffs (steps 0-2); at `step` the loss is non-finite (`hidden`: the loss hides it, finite, and
    the scaler skips the step on the NaN gradients)."""
    assert r["first"] == (module, step), (r["first"], r["bad_loss"], r["skipped"], r["losses"])
    assert all(s < 3 for s in r["skipped"] if s < step) and not [s for s in r["bad_loss"] if s < step], r
    if hidden:
        assert step not in r["bad_loss"] and step in r["skipped"], (r["losses"], r["skipped"])
    else:
        assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


def named(rep, rules, module, step=K):
    """One of `rules` at `module`, at `step` (default K), warning or error, among the first three findings
    (probe_harness.named_top3)."""
    return named_top3(rep, rules, module, step)


quiet = quiet_twin  # (probe_harness.quiet_twin: the healthy twin's checks)


def run(m, batch, tmp_path, loss_fn=own_loss, lr=1e-3):
    return probe_run(m, batch, loss_fn, STEPS, str(tmp_path / "run"), lr=lr)


def bf16_run(m, batch, tmp_path, lr=1e-3, steps=STEPS):
    """The ordinary bf16 loop (no scaler): zero_grad -> bf16 CPU autocast forward (the model returns its loss) ->
    backward -> clip_grad_norm_(1.0) -> step, under ampdoctor.watch(m, optimizer=AdamW, scaler=None, run_dir=...),
    with the Producer oracle. Returns the same keys as probe_run that the checks read."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    orc = Producer(m, with_kwargs=True)
    r = dict(skipped=[], bad_loss=[], losses=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = ampdoctor.watch(m, optimizer=opt, scaler=None, run_dir=str(tmp_path / "run"))
        for i in range(steps):
            orc.step = i
            opt.zero_grad()
            args, kwargs = batch(i)
            with torch.autocast("cpu", dtype=BF16):
                loss = m(*args, **kwargs).float()
            r["losses"].append(loss.item())
            if not math.isfinite(loss.item()):
                r["bad_loss"].append(i)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        orc.remove()
        w.close()
        r["rep"] = w.report()
    r["first"] = orc.first
    return r


# ======================================================================================================================
# 1, 11: Gaussian-Fourier time features on raw DDPM timesteps
# ======================================================================================================================
T_STEPS = 1000


class FourierT(nn.Module):
    """score_sde's GaussianFourierProjection(scale=16) as a frozen Linear(1, n) (2*pi folded into the weight), then
    [sin, cos]; `fp32`: the projection in fp32 with autocast off (the fix), the features cast back."""

    def __init__(self, n=8, scale=16.0, fp32=False):
        super().__init__()
        self.fp32 = fp32
        self.proj = nn.Linear(1, n, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(n, 1, generator=gen(3)) * scale * 2 * math.pi)
        self.proj.weight.requires_grad_(False)

    def forward(self, t):
        if self.fp32:
            with torch.autocast("cpu", enabled=False):
                f = t.float()[:, None] @ self.proj.weight.t()
            return torch.cat([f.sin(), f.cos()], -1)
        f = self.proj(t[:, None])
        return torch.cat([f.sin(), f.cos()], -1)


class TinyDenoiser(nn.Module):
    """x_t, t -> eps prediction: an input Linear, the time features through a small MLP added, an output Linear;
    the model returns the epsilon-prediction MSE."""

    def __init__(self, fp32=False, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.temb = FourierT(fp32=fp32)
        self.tmlp = nn.Sequential(nn.Linear(16, d), nn.SiLU())
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x_t, t, eps):
        h = F.silu(self.inp(x_t)) + self.tmlp(self.temb(t))
        return F.mse_loss(self.out(h).float(), eps)


def noisy(i, t):
    x0 = torch.randn(B, 16, generator=gen(100 + i % 4)).clamp(-1, 1)
    eps = torch.randn(B, 16, generator=gen(200 + i))
    ab = cosine_alphas_cumprod()[t][:, None]
    return x0, eps, ab.sqrt() * x0 + (1 - ab).sqrt() * eps


def fourier_batch(i):
    """Timesteps below 50 in the warm-up (steps < K), the full range 0..999 from step K."""
    hi = 50 if i < K else T_STEPS
    t = torch.randint(0, hi, (B,), generator=gen(300 + i))
    if i == K:
        t[0] = T_STEPS - 1
    _, eps, x_t = noisy(i, t)
    return (x_t, t.float(), eps), None


def test_1_fourier_time_features_overflow_on_raw_timesteps(tmp_path):
    m = TinyDenoiser()
    w = m.temb.proj.weight.abs().max().item()
    assert 49 * w < 65504 < 999 * w < 3e38, w                        # finite before K and in fp32; inf in fp16 at K
    r = run(m, fourier_batch, tmp_path)
    real(r, "temb.proj")
    named(r["rep"], "overflow", "temb.proj")


def test_11_healthy_fourier_time_features_in_fp32(tmp_path):
    r = run(TinyDenoiser(fp32=True), fourier_batch, tmp_path)
    quiet(r)


# ======================================================================================================================
# 2: x0 reconstruction with the cosine schedule cast to fp16
# ======================================================================================================================
def cosine_alphas_cumprod(T=T_STEPS, s=0.008):
    """Improved DDPM's cosine schedule (betas clipped at 0.999), float32."""
    x = torch.linspace(0, T, T + 1, dtype=torch.float64)
    f = torch.cos(((x / T) + s) / (1 + s) * math.pi * 0.5) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0).float()


class X0(nn.Module):
    """x0 = (x_t - sqrt(1 - ab) * eps) / sqrt(ab), ab = alphas_cumprod[t] cast to eps's dtype (diffusers' way)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("alphas_cumprod", cosine_alphas_cumprod())

    def forward(self, x_t, eps, t):
        ab = self.alphas_cumprod[t].to(eps.dtype)[:, None]
        return (x_t - (1 - ab).sqrt() * eps) / ab.sqrt()


class X0Diffusion(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.tin = nn.Embedding(T_STEPS, d)
        self.net = nn.Sequential(nn.Linear(d, 32), nn.SiLU(), nn.Linear(32, d))
        self.x0 = X0()

    def forward(self, x_t, t, x0):
        eps = self.net(x_t + self.tin(t))
        return F.mse_loss(self.x0(x_t, eps, t).float(), x0)


def x0_batch(i):
    t = torch.randint(0, 900, (B,), generator=gen(400 + i))
    if i == K:
        t[2] = T_STEPS - 1
    x0, _, x_t = noisy(i, t)
    return (x_t, t, x0), None


def test_2_x0_reconstruction_cosine_schedule_last_alpha_bar_flushes(tmp_path):
    ab = cosine_alphas_cumprod()
    assert 0 < ab[-1] < 1e-8 and float(ab[-1].half()) == 0.0       # 2.4e-9: finite 1/sqrt in fp32, 0 in fp16
    r = run(X0Diffusion(), x0_batch, tmp_path)
    real(r, "x0")
    named(r["rep"], ("overflow", "underflow", "nan_origin"), "x0")


# ======================================================================================================================
# 3: VAE KL term as a submodule, exp(logvar) in fp16
# ======================================================================================================================
class KL(nn.Module):
    def forward(self, mu, logvar):
        return (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)).mean()


class VAE(nn.Module):
    def __init__(self, d=32, z=8):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(d, 64), nn.ReLU())
        self.mu, self.logvar = nn.Linear(64, z), nn.Linear(64, z)
        self.dec = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, d))
        self.kl = KL()

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        kld = self.kl(mu, logvar).float()
        zs = mu + (0.5 * logvar.float()).clamp(max=20).exp() * torch.randn(mu.shape, generator=gen(9))
        rec = F.mse_loss(self.dec(zs).float(), x)
        return rec + 0.1 * kld


def vae_batch(i):
    x = torch.rand(B, 32, generator=gen(500 + i % 4))
    if i == K:
        x = x * 100.0                                              # a shard left in centimetres, not normalised
    return (x,), None


def test_3_vae_kl_exp_logvar_overflows_on_raw_pixels(tmp_path):
    r = run(VAE(), vae_batch, tmp_path)
    real(r, "kl")
    named(r["rep"], "overflow", "kl")


# ======================================================================================================================
# 4, 12: log-mel front end with AmplitudeToDB's amin = 1e-10 in fp16
# ======================================================================================================================
class LogMel(nn.Module):
    """A Conv1d STFT (DFT basis, no bias), power, a mel filterbank matmul, 10 * log10(clamp(mel, min=1e-10));
    `fp32`: the dB conversion in fp32."""

    def __init__(self, n_fft=32, n_mels=8, fp32=False):
        super().__init__()
        self.fp32 = fp32
        k = torch.arange(n_fft // 2 + 1)[:, None].float()
        n = torch.arange(n_fft)[None].float()
        win = torch.hann_window(n_fft)
        basis = torch.cat([torch.cos(2 * math.pi * k * n / n_fft), -torch.sin(2 * math.pi * k * n / n_fft)]) * win
        self.stft = nn.Conv1d(1, basis.shape[0], n_fft, stride=n_fft // 2, bias=False)
        with torch.no_grad():
            self.stft.weight.copy_(basis[:, None])
        self.stft.weight.requires_grad_(False)
        self.register_buffer("fb", torch.rand(n_fft // 2 + 1, n_mels, generator=gen(11)))

    def forward(self, wav):
        X = self.stft(wav[:, None])
        half = X.shape[1] // 2
        power = X[:, :half] ** 2 + X[:, half:] ** 2
        mel = power.transpose(1, 2) @ self.fb.to(power.dtype)
        if self.fp32:
            return 10 * torch.log10(mel.float().clamp(min=1e-10))
        return 10 * torch.log10(mel.clamp(min=1e-10))


class KWS(nn.Module):
    def __init__(self, fp32=False, n_cls=4):
        super().__init__()
        torch.manual_seed(0)
        self.frontend = LogMel(fp32=fp32)
        self.norm = nn.LayerNorm(8)
        self.cls = nn.Linear(8, n_cls)

    def forward(self, wav, y):
        h = self.norm(self.frontend(wav) / 10)
        return F.cross_entropy(self.cls(h.mean(1)).float(), y)


def kws_batch(i):
    y = torch.randint(0, 4, (B,), generator=gen(600 + i % 4))
    tt = torch.arange(512).float() / 512
    wav = torch.stack([0.5 * torch.sin(2 * math.pi * (20 + 15 * int(c)) * tt) for c in y])
    wav = wav + 0.05 * torch.randn(wav.shape, generator=gen(700 + i))
    if i == K:
        wav[3, 256:] = 0.0                                         # the first zero-padded (silent-tail) clip
    return (wav, y), None


def test_4_logmel_amin_vanishes_in_fp16_on_zero_padding(tmp_path):
    assert float(torch.tensor(1e-10).half()) == 0.0
    r = run(KWS(), kws_batch, tmp_path, lr=1e-2)
    real(r, "frontend")
    named(r["rep"], ("eps_underflow", "overflow"), "frontend")


def test_12_healthy_logmel_db_in_fp32(tmp_path):
    r = run(KWS(fp32=True), kws_batch, tmp_path, lr=1e-2)
    quiet(r)


# ======================================================================================================================
# 5: GwcNet group-wise correlation cost volume
# ======================================================================================================================
class GwcCost(nn.Module):
    def __init__(self, groups=4, maxdisp=4):
        super().__init__()
        self.g, self.maxdisp = groups, maxdisp

    def forward(self, fl, fr):
        b, c, h, w = fl.shape
        vol = fl.new_zeros(b, self.g, self.maxdisp, h, w)
        for d in range(self.maxdisp):
            p = (fl[..., d:] * fr[..., :w - d]).view(b, self.g, c // self.g, h, w - d).mean(2)
            vol[:, :, d, :, d:] = p
        return vol


class Stereo(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        torch.manual_seed(0)
        self.feat = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.cost = GwcCost()
        self.agg = nn.Conv3d(4, 1, 1)

    def forward(self, left, right, disp):
        fl, fr = self.feat(left), self.feat(right)
        c = self.agg(self.cost(fl, fr)).squeeze(1)                  # B, D, H, W
        p = torch.softmax(c.float(), 1)
        pred = (p * torch.arange(c.shape[1]).float()[None, :, None, None]).sum(1)
        return F.smooth_l1_loss(pred, disp)


def stereo_batch(i):
    left = torch.rand(2, 3, 8, 12, generator=gen(800 + i % 4))
    right = torch.roll(left, -2, dims=-1)
    disp = torch.full((2, 8, 12), 2.0)
    if i == K:
        left, right = left * 4095.0, right * 4095.0                # a raw 12-bit sensor pair, not normalised
    return (left, right, disp), None


def test_5_gwc_cost_volume_product_overflows_before_the_mean(tmp_path):
    r = run(Stereo(), stereo_batch, tmp_path)
    real(r, "cost")
    named(r["rep"], "overflow", "cost")


# ======================================================================================================================
# 6: cosine similarity by hand in a dual encoder
# ======================================================================================================================
class CosSim(nn.Module):
    def forward(self, a, b):
        na = (a * a).sum(-1).sqrt()
        nb = (b * b).sum(-1).sqrt()
        return (a @ b.t()) / (na[:, None] * nb[None, :])


class SimCLR(nn.Module):
    """One encoder, two augmented views, NT-Xent on the cosine similarity by hand (temperature 0.1)."""

    def __init__(self, d=32, e=32):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, e))
        self.sim = CosSim()

    def forward(self, v1, v2):
        s = self.sim(self.enc(v1), self.enc(v2)).float() / 0.1
        y = torch.arange(s.shape[0])
        return (F.cross_entropy(s, y) + F.cross_entropy(s.t(), y)) / 2


def pair_batch(i):
    base = torch.randn(B, 32, generator=gen(900 + i % 4))
    v1 = base + 0.1 * torch.randn(B, 32, generator=gen(1000 + i))
    v2 = base + 0.1 * torch.randn(B, 32, generator=gen(1100 + i))
    if i == K:
        v1[1], v2[1] = v1[1] * 255.0, v2[1] * 255.0                # one image not normalised: both views raw
    return (v1, v2), None


def test_6_cosine_similarity_by_hand_squares_overflow(tmp_path):
    m = SimCLR()
    with torch.no_grad():
        v1, v2 = pair_batch(K)[0]
        z1, z2 = m.enc(v1[1]), m.enc(v2[1])
    assert (z1 @ z2) > 1.2 * 65504 and (z1 @ z2) / (z1.norm() * z2.norm()) < 3e38   # fp32: a finite cosine
    r = run(m, pair_batch, tmp_path)
    real(r, "sim")
    named(r["rep"], FWD, "sim")


# ======================================================================================================================
# 7: Gaussian-kernel graph with symmetric degree normalisation
# ======================================================================================================================
class KernelGConv(nn.Module):
    """A = exp(-|p_i - p_j|^2 / 2s^2) off the diagonal on positions cast to the features' dtype, D^-1/2 A D^-1/2,
    then a Linear on the aggregated features."""

    def __init__(self, d=16, s=0.5):
        super().__init__()
        self.lin, self.s = nn.Linear(d, d), s

    def forward(self, h, pos):
        p = pos.type_as(h)
        d2 = (p[:, :, None] - p[:, None]).pow(2).sum(-1)
        a = torch.exp(-d2 / (2 * self.s ** 2)) * (1 - torch.eye(p.shape[1], dtype=h.dtype))
        dinv = a.sum(-1).pow(-0.5)
        a = dinv[:, :, None] * a * dinv[:, None, :]
        return self.lin(a @ h)


class PointNetG(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, d)
        self.gconv = KernelGConv(d)
        self.head = nn.Linear(d, 3)

    def forward(self, pos, y):
        h = F.relu(self.embed(pos))
        h = F.relu(self.gconv(h, pos))
        return F.cross_entropy(self.head(h.max(1).values).float(), y)


N_PTS = 24


def cloud_batch(i):
    y = torch.arange(4) % 3
    pos = torch.randn(4, N_PTS, 3, generator=gen(1200 + i % 4)) * 0.4
    pos = pos * (1 + y.float())[:, None, None]
    if i == K:
        pos[0, 5] = pos[0].mean(0) + torch.tensor([0.0, 0.0, 4.5])  # a stray LiDAR return
    return (pos, y), None


def test_7_kernel_graph_degree_zero_from_fp16_underflow(tmp_path):
    pos, _ = cloud_batch(K)[0]
    d2 = (pos[0, 5] - torch.cat([pos[0, :5], pos[0, 6:]])).pow(2).sum(-1) / (2 * 0.5 ** 2)
    w = torch.exp(-d2)
    assert (w > 1e-30).all() and (w.half() == 0).all(), d2          # every edge weight: 0 in fp16, > 0 in fp32
    r = run(PointNetG(), cloud_batch, tmp_path)
    real(r, "gconv")
    named(r["rep"], ("nan_origin", "underflow", "overflow"), "gconv")
    # the words follow the op: deg.pow(-0.5) at deg = 0 is the pole of a negative power, not an x**2 overflow
    # (wrong when written: "in fp16 x**2 is inf for |x| > 255.9 — a variance or norm computed in low precision")
    ovf = [f for f in r["rep"].findings if f.rule == "overflow" and f.module == "gconv" and f.op == "aten::pow"]
    assert ovf and all("x**2" not in f.message and "singular point" in f.message for f in ovf), lines(r["rep"])


# ======================================================================================================================
# 8: FCOS ltrb = exp(Scale(x)) without mmdet's .float()
# ======================================================================================================================
class Scale(nn.Module):
    """mmcv's Scale: a learnable 0-dim fp32 factor (the product keeps the input's fp16)."""

    def __init__(self, v=1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(v))

    def forward(self, x):
        return x * self.scale


class FCOSHead(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.tower = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU())
        self.cls_logits, self.bbox_pred = nn.Conv2d(c, 1, 3, padding=1), nn.Conv2d(c, 4, 3, padding=1)
        self.scale = Scale()

    def forward(self, x):
        t = self.tower(x)
        return self.cls_logits(t), torch.exp(self.scale(self.bbox_pred(t)))


class FCOS(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.head = FCOSHead(c)

    def forward(self, img, ltrb, obj):
        cls, reg = self.head(self.backbone(img))
        reg = reg.float()
        inter = torch.minimum(reg, ltrb)
        ai = (inter[:, 0] + inter[:, 2]) * (inter[:, 1] + inter[:, 3])
        ap = (reg[:, 0] + reg[:, 2]) * (reg[:, 1] + reg[:, 3])
        at = (ltrb[:, 0] + ltrb[:, 2]) * (ltrb[:, 1] + ltrb[:, 3])
        iou = ai / (ap + at - ai)
        return -torch.log(iou.clamp(min=1e-6)).mean() + F.binary_cross_entropy_with_logits(cls.float()[:, 0], obj)


def fcos_batch(i):
    img = torch.rand(2, 3, 8, 8, generator=gen(1300 + i % 4))
    ltrb = 1 + 3 * torch.rand(2, 4, 8, 8, generator=gen(1400 + i % 4))
    obj = (torch.rand(2, 8, 8, generator=gen(1500 + i % 4)) > 0.5).float()
    if i == K:
        img = img * 1023.0                                         # a raw 10-bit frame, not normalised
    return (img, ltrb, obj), None


def test_8_fcos_exp_of_scaled_regression_without_float(tmp_path):
    r = run(FCOS(), fcos_batch, tmp_path)
    real(r, "head", hidden=True)
    named(r["rep"], "overflow", "head")


# ======================================================================================================================
# 9: bf16 VP-SDE score head: std = sqrt(1 - ab) with ab in bf16
# ======================================================================================================================
def linear_alphas_cumprod(T=T_STEPS):
    return torch.cumprod(1 - torch.linspace(1e-4, 0.02, T, dtype=torch.float64), 0).float()


class ScoreHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("alphas_cumprod", linear_alphas_cumprod())

    def forward(self, eps, t):
        ab = self.alphas_cumprod[t].to(eps.dtype)[:, None]
        return -eps / (1 - ab).sqrt()


class ScoreModel(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.tin = nn.Embedding(T_STEPS, d)
        self.net = nn.Sequential(nn.Linear(d, 32), nn.SiLU(), nn.Linear(32, d))
        self.score = ScoreHead()

    def forward(self, x_t, t, z):
        ab = self.score.alphas_cumprod[t][:, None]
        std = (1 - ab).sqrt()
        s = self.score(self.net(x_t + self.tin(t)), t).float()
        return ((s * std + z) ** 2).sum(-1).mean()                 # score_sde's loss, std in fp32


def score_batch(i):
    t = torch.randint(100, T_STEPS, (B,), generator=gen(1600 + i))
    if i == K:
        t[4] = 3                                                    # the first small t
    x0 = torch.randn(B, 16, generator=gen(1700 + i % 4)).clamp(-1, 1)
    z = torch.randn(B, 16, generator=gen(1800 + i))
    ab = linear_alphas_cumprod()[t][:, None]
    return (ab.sqrt() * x0 + (1 - ab).sqrt() * z, t, z), {}


def test_9_bf16_score_std_rounds_to_zero(tmp_path):
    ab3 = linear_alphas_cumprod()[3]
    assert float(ab3.to(BF16)) == 1.0 and float(ab3.half()) < 1.0     # bf16-specific: fp16 keeps 1 - ab > 0
    r = bf16_run(ScoreModel(), score_batch, tmp_path)
    real(r, "score")
    named(r["rep"], ("overflow", "nan_origin", "precision_loss"), "score")


# ======================================================================================================================
# 10, 13: bf16 objectness BCE by hand
# ======================================================================================================================
class BCEByHand(nn.Module):
    def forward(self, logit, t):
        p = torch.sigmoid(logit)
        return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()


class BCEWithLogits(nn.Module):
    def forward(self, logit, t):
        return F.binary_cross_entropy_with_logits(logit.float(), t)


class Objectness(nn.Module):
    def __init__(self, fixed=False, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(d, 32), nn.ReLU())
        self.obj = nn.Linear(32, 1)
        self.criterion = BCEWithLogits() if fixed else BCEByHand()

    def forward(self, x, t):
        return self.criterion(self.obj(self.body(x)).squeeze(-1), t).float()


OBJ_DIR = torch.randn(16, generator=gen(1900))


HARD = 50.0


def obj_batch(i):
    t = (torch.arange(B) % 2).float()
    x = torch.randn(B, 16, generator=gen(2000 + i % 4)) * 0.5 - (2 * t - 1)[:, None] * OBJ_DIR * 0.3
    if i == K:
        x[1] = -OBJ_DIR * HARD                                     # a clean, high-contrast positive (t[1] = 1)
    return (x, t), {}


def obj_logit(m, x):
    with torch.no_grad():
        return m.obj(m.body(x)).squeeze(-1)


def test_10_bf16_bce_by_hand_log_one_minus_p(tmp_path):
    m = Objectness()
    seen = []
    h = m.obj.register_forward_hook(lambda mod, i, o: seen.append(o.detach().float()[1, 0]))
    r = bf16_run(m, obj_batch, tmp_path, lr=1e-4)
    h.remove()
    z = float(seen[K])                                             # the hard positive's logit at step K
    one = torch.tensor(1.0)
    assert float(torch.sigmoid(torch.tensor(z).to(BF16))) == 1.0, z            # p == 1 in bf16: log(1 - p) = -inf
    assert float(one.half() - torch.sigmoid(torch.tensor(z).half())) > 0, z     # fp16 keeps 1 - p > 0
    assert math.isfinite(math.log1p(-1 / (1 + math.exp(-z)))), z                # fp32 finite
    real(r, "criterion")
    named(r["rep"], FWD, "criterion")


def test_13_healthy_bf16_bce_with_logits(tmp_path):
    r = bf16_run(Objectness(fixed=True), obj_batch, tmp_path, lr=1e-4)
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, r
    assert sum(ls[4:]) < sum(ls[:4]), ls                           # the same four batches, cycled
    assert alarms(r["rep"].findings) == [], lines(r["rep"])
