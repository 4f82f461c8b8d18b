"""Forty-ninth set: FP16 FAILURES IN GENERATIVE-MODEL TRAINING CODE (score matching, diffusion, hierarchical VAEs,
VQ tokenizers for autoregressive priors, vocoders). Five fp16 failures that start mid-run at a known step (7-11:
never a sampled step; full statistics are taken on step 0 and every 200th) and two healthy twins, each mechanism
written the way those repos write it, different from the generative cases of earlier sets (exp(logvar) overflows,
DDPM / cosine alpha_bar in fp16, EDM's loss weight, affine-coupling exp(s), CFG null-label PixelNorm, x-prediction
1 / (1 - t), timestep embedders: sets 5, 9, 11, 14, 19, 24, 29, 37, 38, 48). Small models, fixed seeds.
Watched through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")`
at the default settings) in probe_harness.probe_run: an ordinary CPU fp16 autocast + `torch.amp.GradScaler("cpu")`
loop (scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`); every model
computes its own loss (the diffusers / lucidrains wrapper layout).

Each failure is proven first by the test's own oracle: probe_harness.Producer (keyword inputs checked: the first
module whose output is non-finite while its inputs and own parameters were finite, at the expected step), the loss
(first non-finite there), the scaler (it skips that step, except in 1, see there), a float32 check (the model with
the weights the bad step's forward ran with runs the bad batch in float32, no autocast: finite loss, finite
gradients) and the mechanism itself re-run on those weights under fp16 autocast (the producer's inputs finite fp16,
the threshold crossed). A failing oracle is a plain failure. Only then must the rule be among the report's first
three findings at the PRODUCER, at that step, forward, an `error`, with no error at the modules that only passed the
inf/NaN on (the producer's children, parents and the root); a wrong report raises WrongAnswer naming ampdoctor's top
three (rule@module op step phase [severity]).

 1. NCSN (Song & Ermon 2019) on cached fp16 latents, sigma ladder 1 -> 0.01 (L = 10) indexed per row and cast to
    the data's dtype; the criterion module `dsm` is anneal_dsm_score_estimation: target = -1 / sigma^2 (x~ - x), 0.5
    sum((scores - target)^2) * sigma^2. A coarse-to-fine curriculum admits the two smallest levels at step 8: at
    sigma = 0.01 the summed squared error ~ 1e4 chi2_16 passes 65504 BEFORE the sigma^2 weight -> overflow at `dsm`,
    step 8. The scaler never skips: the inf is made by the reduction (sum's backward only broadcasts), gradients stay
    finite, the weights keep training while the logged loss reads inf from step 8 on.
 2. a DDPM (T = 100, improved DDPM's scaled linear schedule, fixed clipped posterior variance) on cached fp16 8-bit
    images, hybrid loss L_simple + 0.001 L_0 where L_0 (`nll`) is guided-diffusion's
    discretized_gaussian_log_likelihood (approx cdf, every log behind clamp(min=1e-12)) in the data's dtype: the first
    row drawn at t = 0 (step 7) has a pixel ~3 posterior stds off its bin, cdf_plus == cdf_min in fp16 and 1e-12 is 0
    in fp16: log(0) = -inf -> overflow / eps_underflow at `nll`, step 7.
 3. twin of 2: the NLL's inputs cast to float32 (the same t = 0 draws) -> quiet.
 4. a VDVAE-style ladder VAE whose top-down `block` computes VDVAE's gaussian_analytical_kl(qm, pm, qv, pv) =
    ... 0.5 (exp(qv)^2 + (qm - pm)^2) / exp(pv)^2 in fp16: at step 7 eight rows of a second sensor arrive without
    standardisation (x 20); the prior head's logsigma goes below -8.7, exp(pv) ** 2 is 0 in fp16 -> overflow at
    `block`, step 7 (not block.prior / block.posterior, whose outputs are finite).
 5. a VQ image tokenizer (the tokenizer of an autoregressive prior) whose `quantizer` adds a MAGVIT-v2-style entropy
    penalty on p = softmax(-dist * 15), p * log(p + 1e-10), the codebook in the codes' dtype: at step 11 a shard from
    a camera with 16x the gain; distance gaps pass 17.3, softmax flushes p to exactly 0 in fp16 and 1e-10 is 0 in
    fp16: 0 * log(0) = NaN -> nan_origin / eps_underflow at `quantizer`, step 11.
 6. twin of 5: the entropy from float32 distances (the same gain batch; one ordinary scaler backoff on its finite
    loss) -> quiet.
 7. a vocoder whose linear head predicts mu-law companded samples and whose L1 is on the waveform after WaveNet's
    mu-law expansion sign(y) (256 ** |y| - 1) / 255 (`expand`, unclamped, fp16): at step 9 four frames of a clip
    recorded at maximum input gain (log-mel x 10): |y| >= 2, 256 ** 2 = 65536 = inf -> overflow at `expand`, step 9.
Twins also run unwatched: losses and final weights bitwise identical with and without the watch; no warning, no
error, no RuntimeWarning of ampdoctor's. (A diffusion / tokenizer loss barely moves in ~20 steps: the twins are
asked to stay finite and not rise, fall=1.1 / 1.0.)
Not built (time): a Flow++ variational dequantizer's sigmoid log-det log(u) + log(1 - u) with u == 1.0 in fp16 (the
hot-pixel trigger tried left h below 8.3; the window 8.3 < h < 16.6 where only fp16 saturates is narrow).

What ampdoctor says (torch 2.13 CPU): five of five right at the producer, its step, forward, an error, among the
first three findings; the twins quiet:
1 `[error] overflow at dsm aten::sum step 8` (then only the scaler's opening skip, info);
2 `[error] eps_underflow at nll aten::clamp step 7` + `[error] overflow at nll aten::log step 7`;
4 `[error] overflow at block aten::pow step 7` + `[error] skipped_steps (run) step 7`;
5 `[error] eps_underflow at quantizer aten::add step 11` + `[error] overflow at quantizer aten::log step 11`;
7 `[error] overflow at expand aten::pow step 9`.
Noticed (not asserted): in 5 the first finding for a NaN (0 * log 0) is eps_underflow then overflow (the -inf of
log), no nan_origin; the twin of 5 reports its backoff at step 11 as `[info] skipped_steps`.

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants49.py -q -p no:cacheprovider (about 5 s)
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import (Producer, WrongAnswer, at_top3, finite, probe_run, quiet_twin,
                           real_fwd_after_backoffs as real_fwd)
from scenarios import gen, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def own_loss(out, y):
    """The models below compute their own training loss (the lucidrains / diffusers-wrapper layout)."""
    return out


def run(m, batch, steps, run_dir, *, lr=1e-3, **kw):
    """probe_harness.probe_run: the user's loop at ampdoctor's default settings (AdamW, GradScaler("cpu") at its
    default init_scale 65536, fp16 CPU autocast forward, scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) ->
    step -> update), the oracle a Producer on keyword inputs too; `batch(i)` gives (args, kwargs, y)."""
    return probe_run(m, batch, own_loss, steps, run_dir, lr=lr, oracle=lambda m: Producer(m, with_kwargs=True), **kw)


def snapshot_model(make, r):
    """A fresh model with the weights (and buffers) the bad step's forward ran with (probe_run's snap_at)."""
    torch.manual_seed(0)
    m = make()
    m.load_state_dict(r["sd"])
    return m


def fp32_finite(make, r, batch, step):
    """The bad batch is an fp16 failure: the model with the bad step's weights runs it in float32 throughout (no
    autocast, every floating input as float32) to a finite loss with finite gradients."""
    m = snapshot_model(make, r)
    args, kwargs, _ = batch(step)
    args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    loss = m(*args, **kwargs)
    loss.backward()
    assert math.isfinite(loss.item()) and all(finite(p.grad) for p in m.parameters() if p.grad is not None), step


def fp16_calls(make, r, batch, step, name):
    """[(inputs, output)] of each call of module `name` when the bad step's forward is re-run (its weights, its batch,
    fp16 autocast, no grad): the mechanism behind the oracle's verdict."""
    m = snapshot_model(make, r)
    seen = []
    h = dict(m.named_modules())[name].register_forward_hook(
        lambda mod, a, kw, o: seen.append((tuple(a) + tuple(kw.values()), o)), with_kwargs=True)
    args, kwargs, _ = batch(step)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        m(*args, **kwargs)
    h.remove()
    return seen


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} {f.op} step {f.step} {f.phase} [{f.severity}]"
            for f in rep.findings[:3]]


def named(r, rules, module, step, phase="forward", quiet_at=()):
    """The report check: one of `rules` at the producer `module`, at `step`, in `phase`, an error, among the first
    three findings, and no error at the modules that only passed it on. A failure is a WrongAnswer naming ampdoctor's
    top three (rule@module op step phase [severity]) and its RuntimeWarnings."""
    rep = r["rep"]
    try:
        at_top3(rep, rules, module, step=step, phase=phase, severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:800]})") from None


def twin(make, batch, steps, tmp_path, lr=1e-3, fall=0.9, skips=()):
    """A healthy twin: run watched (with the oracle) and unwatched; healthy, ampdoctor quiet (quiet_twin: the loss
    down by 10%), and the watch changed nothing: losses and final weights bitwise identical."""
    torch.manual_seed(0)
    r = run(make(), batch, steps, tmp_path / "run", lr=lr)
    torch.manual_seed(0)
    bare = run(make(), batch, steps, tmp_path / "bare", lr=lr, watch=False)
    assert r["losses"] == bare["losses"], (r["losses"], bare["losses"])
    assert all(torch.equal(r["weights"][k], bare["weights"][k]) for k in r["weights"])
    try:
        quiet_twin(r, fall=fall, skips=skips)
    except AssertionError as e:
        if r["first"] is not None or not all(map(math.isfinite, r["losses"])):
            raise
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(r['rep'])} warnings={r['warns']} "
                          f"({str(e)[:800]})") from None
    return r


def mlp(*dims, act=nn.SiLU):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


# ======================================================================================================================
# 1. NCSN's annealed denoising score matching on cached fp16 latents: the unweighted squared error at sigma_min
# ======================================================================================================================
SIGMAS = torch.logspace(0, -2, 10)       # NCSN (Song & Ermon 2019): sigma_1 = 1 ... sigma_10 = 0.01, geometric
D1, B1, FINE_AT = 16, 32, 8
A1 = torch.randn(4, D1, generator=gen(101)) * 0.5


class AnnealedDSM(nn.Module):
    """NCSN's anneal_dsm_score_estimation (anneal_power 2) as a criterion module, in the inputs' dtype:
    target = -1 / sigma^2 * (perturbed - samples); 0.5 * sum((scores - target)^2) * sigma^2."""

    def forward(self, scores, perturbed, samples, sigmas):
        target = -1 / (sigmas ** 2) * (perturbed - samples)
        return (0.5 * ((scores - target) ** 2).sum(-1) * sigmas.squeeze(-1) ** 2).mean()


class NCSN(nn.Module):
    """A noise-conditional score network (NCSNv2's output / sigma) on flattened latents; the sigma ladder indexed
    per row and cast to the data's dtype (diffusers' convention); the loss computed in the model."""

    def __init__(self, d=D1, h=128):
        super().__init__()
        self.register_buffer("sigmas", SIGMAS.clone())
        self.net = mlp(d + 1, h, h, d)
        self.dsm = AnnealedDSM()

    def forward(self, x, labels, noise):
        sig = self.sigmas[labels].to(x.dtype)[:, None]
        perturbed = x + noise.to(x.dtype) * sig
        scores = self.net(torch.cat([perturbed, sig.log()], -1)) / sig
        return self.dsm(scores, perturbed, x, sig)


def ncsn_batch(i):
    """32 rows of cached fp16 latents (a VAE's encodings, stored in half precision), their sigma labels and noise.
    Coarse-to-fine curriculum: levels 1-8 (sigma >= 0.028) until FINE_AT, all ten from then on."""
    g = gen(1000 + i)
    x = (torch.randn(B1, 4, generator=g) @ A1 + 0.1 * torch.randn(B1, D1, generator=g)).to(FP16)
    labels = torch.randint(0, 8 if i < FINE_AT else 10, (B1,), generator=g)
    return (x, labels, torch.randn(B1, D1, generator=g)), {}, None


def test_ncsn_dsm_unweighted_error_overflows_at_sigma_min(tmp_path):
    torch.manual_seed(0)
    r = run(NCSN(), ncsn_batch, FINE_AT + 3, tmp_path / "run", snap_at=FINE_AT)
    # truth: `dsm` is the first producer, at FINE_AT; the loss is inf from there on, but the scaler never skips: the
    # inf is made by the reduction (sum's backward only broadcasts), the gradients stay finite and the weights keep
    # training while the logged loss reads inf
    assert r["first"] == ("dsm", FINE_AT), r["first"]
    assert r["bad_loss"] == list(range(FINE_AT, FINE_AT + 3)), r["bad_loss"]
    assert all(s < 3 for s in r["skipped"]), r["skipped"]
    fp32_finite(NCSN, r, ncsn_batch, FINE_AT)
    # the mechanism: the inputs to `dsm` are finite fp16; at sigma = 0.01 the target is ~ z / sigma and the summed
    # squared error ~ 1e4 * chi2_16 passes 65504 before the sigma^2 weight brings it back
    (a, o), = fp16_calls(NCSN, r, ncsn_batch, FINE_AT, "dsm")
    assert finite(a) and all(t.dtype == FP16 for t in a) and not finite(o)
    named(r, FWD, "dsm", FINE_AT, quiet_at=("net", "net.0", "net.2", "net.4", ""))


# ======================================================================================================================
# 2 + twin. a DDPM trained with improved DDPM's hybrid loss on cached fp16 images: the L_0 decoder NLL is guided-
#    diffusion's discretized_gaussian_log_likelihood, clamp(min=1e-12) in the data's dtype
# ======================================================================================================================
T2, D2, B2 = 100, 1024, 16


def approx_standard_normal_cdf(x):
    """guided-diffusion's losses.approx_standard_normal_cdf."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class DecoderNLL(nn.Module):
    """L_0: -log p(x_0 | x_1) in bits per dim, guided-diffusion's discretized_gaussian_log_likelihood (8-bit bins,
    the edge bins open, every log behind clamp(min=1e-12)), in the inputs' dtype; `fp32`: cast to float32 first (the
    twin)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, x, means, log_scales):
        if self.fp32:
            x, means, log_scales = x.float(), means.float(), log_scales.float()
        centered_x = x - means
        inv_stdv = torch.exp(-log_scales)
        cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered_x + 1.0 / 255.0))
        cdf_min = approx_standard_normal_cdf(inv_stdv * (centered_x - 1.0 / 255.0))
        log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
        log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
        cdf_delta = cdf_plus - cdf_min
        log_probs = torch.where(x < -0.999, log_cdf_plus,
                                torch.where(x > 0.999, log_one_minus_cdf_min, torch.log(cdf_delta.clamp(min=1e-12))))
        return -log_probs.mean(-1) / math.log(2.0)


def timestep_embedding(t, dim=32):
    """The sinusoidal timestep embedding (float32)."""
    freqs = torch.exp(-math.log(10000) * torch.arange(dim // 2) / (dim // 2))
    a = t.float()[:, None] * freqs
    return torch.cat([a.cos(), a.sin()], -1)


class DDPM(nn.Module):
    """An eps-prediction DDPM on flattened 32 x 32 images in [-1, 1], T = 100, improved DDPM's linear schedule
    (scaled by 1000 / T), fixed posterior variance (clipped log), hybrid loss L_simple + 0.001 L_vlb where the VLB
    term is the decoder NLL of the rows drawn at t = 0; the schedule's tables indexed per row and cast to the data's
    dtype (diffusers' add_noise convention)."""

    def __init__(self, fp32_nll=False, h=256):
        super().__init__()
        betas = torch.linspace(1000 / T2 * 1e-4, 1000 / T2 * 0.02, T2, dtype=torch.float64)
        ab = torch.cumprod(1 - betas, 0)
        ab_prev = torch.cat([torch.ones(1, dtype=torch.float64), ab[:-1]])
        post_var = betas * (1 - ab_prev) / (1 - ab)
        for k, v in dict(sqrt_ab=ab.sqrt(), sqrt_1m_ab=(1 - ab).sqrt(), coef_eps=betas / (1 - ab).sqrt(),
                         rsqrt_alpha=(1 - betas).rsqrt(),
                         post_logvar=torch.cat([post_var[1:2], post_var[1:]]).log()).items():
            self.register_buffer(k, v.float())
        self.net = mlp(D2 + 32, h, h, D2)
        self.nll = DecoderNLL(fp32_nll)

    def forward(self, x0, t, noise):
        def ex(a):
            return a[t].to(x0.dtype)[:, None]
        noise = noise.to(x0.dtype)
        x_t = ex(self.sqrt_ab) * x0 + ex(self.sqrt_1m_ab) * noise
        eps = self.net(torch.cat([x_t, timestep_embedding(t).to(x0.dtype)], -1))
        loss = F.mse_loss(eps.float(), noise.float())
        first = t == 0
        if bool(first.any()):
            mean = ex(self.rsqrt_alpha) * (x_t - ex(self.coef_eps) * eps)
            nll = self.nll(x0[first], mean[first], 0.5 * ex(self.post_logvar)[first])
            loss = loss + 1e-3 * nll.float().sum() / len(t)
        return loss


PROTO2 = torch.rand(4, D2, generator=gen(202))


def ddpm_batch(i):
    """16 cached 8-bit 32 x 32 images (stored as fp16 in [-1, 1], mixtures of four prototypes, black borders), uniform
    timesteps, noise."""
    g = gen(2016 + i)
    w = torch.rand(B2, 4, generator=g)
    img = (w @ PROTO2 / w.sum(1, keepdim=True) * 1.3 - 0.15).clamp(0, 1)
    img = img.view(B2, 32, 32)
    img[:, :4], img[:, -4:], img[:, :, :4], img[:, :, -4:] = 0, 0, 0, 0
    x0 = (torch.round(img.flatten(1) * 255) / 127.5 - 1).to(FP16)
    return (x0, torch.randint(0, T2, (B2,), generator=g), torch.randn(B2, D2, generator=g)), {}, None


FIRST_T0 = next(i for i in range(100) if bool((ddpm_batch(i)[0][1] == 0).any()))


def test_ddpm_decoder_nll_clamp_1e12_is_zero_in_fp16(tmp_path):
    torch.manual_seed(0)
    r = run(DDPM(), ddpm_batch, FIRST_T0 + 3, tmp_path / "run", lr=3e-3, snap_at=FIRST_T0)
    real_fwd(r, "nll", FIRST_T0)
    fp32_finite(DDPM, r, ddpm_batch, FIRST_T0)
    # the mechanism: FIRST_T0 is the first batch with a row at t = 0 (the only rows whose L_0 is computed); the
    # inputs of `nll` are finite fp16; a pixel ~3 posterior stds off its bin makes cdf_plus == cdf_min in fp16,
    # clamp(min=1e-12) clamps to 0 (1e-12 is 0 in fp16) and log(0) = -inf (float32: log(1e-12) = -27.6)
    assert 5 <= FIRST_T0 <= 15 and float(torch.tensor(1e-12, dtype=FP16)) == 0.0
    (a, o), = fp16_calls(DDPM, r, ddpm_batch, FIRST_T0, "nll")
    assert finite(a) and all(t.dtype == FP16 for t in a) and bool(torch.isposinf(o).any())
    named(r, FWD + ("eps_underflow",), "nll", FIRST_T0, quiet_at=("net", "net.0", "net.2", "net.4", ""))


def test_twin_ddpm_decoder_nll_in_fp32_is_quiet(tmp_path):
    # the fix (guided-diffusion's own use: the NLL's inputs in float32), the same batches and t = 0 draws; a
    # diffusion loss barely moves in 20 steps, so the twin only has to stay finite and level (fall=1.1)
    torch.manual_seed(0)
    r = run(DDPM(fp32_nll=True), ddpm_batch, FIRST_T0 + 10, tmp_path / "run", lr=3e-3)
    torch.manual_seed(0)
    bare = run(DDPM(fp32_nll=True), ddpm_batch, FIRST_T0 + 10, tmp_path / "bare", lr=3e-3, watch=False)
    assert r["losses"] == bare["losses"] and all(torch.equal(r["weights"][k], bare["weights"][k]) for k in r["weights"])
    try:
        quiet_twin(r, fall=1.1)
    except AssertionError as e:
        if r["first"] is not None or not all(map(math.isfinite, r["losses"])):
            raise
        raise WrongAnswer(f"false alarm: top3={top3(r['rep'])} warnings={r['warns']} ({str(e)[:800]})") from None


# ======================================================================================================================
# 4. a VDVAE-style ladder VAE: gaussian_analytical_kl with exp(logsigma_p) ** 2 underflowing to 0 in fp16
# ======================================================================================================================
D4, H4, Z4, B4, HOT_AT = 32, 64, 8, 32, 7


def gaussian_analytical_kl(mu1, mu2, logsigma1, logsigma2):
    """VDVAE's vae_helpers.gaussian_analytical_kl."""
    return -0.5 + logsigma2 - logsigma1 + 0.5 * (logsigma1.exp() ** 2 + (mu1 - mu2) ** 2) / (logsigma2.exp() ** 2)


class DecBlock(nn.Module):
    """A top-down block: prior p(z | z_top), posterior q(z | h, z_top), the sample and the block's KL."""

    def __init__(self):
        super().__init__()
        self.prior = nn.Linear(Z4, 2 * Z4)
        self.posterior = nn.Linear(H4 + Z4, 2 * Z4)

    def forward(self, h, c, eps):
        pm, pv = self.prior(c).chunk(2, -1)
        qm, qv = self.posterior(torch.cat([h, c], -1)).chunk(2, -1)
        return qm + qv.exp() * eps, gaussian_analytical_kl(qm, pm, qv, pv).sum(-1)


class LadderVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = mlp(D4, H4, H4, act=nn.GELU)
        self.top = nn.Linear(H4, 2 * Z4)
        self.block = DecBlock()
        self.dec = mlp(2 * Z4, H4, D4, act=nn.GELU)

    def forward(self, x, e1, e2):
        h = self.enc(x)
        m2, v2 = self.top(h).float().chunk(2, -1)
        z2 = m2 + v2.exp() * e1
        kl2 = (0.5 * (m2 ** 2 + (2 * v2).exp() - 1) - v2).sum(-1)
        z1, kl1 = self.block(h, z2, e2)
        rec = F.mse_loss(self.dec(torch.cat([z1, z2], -1)).float(), x, reduction="none").sum(-1)
        return (rec + kl1.float() + kl2).mean() / D4     # nats per dim


PROTO4 = torch.randn(4, D4, generator=gen(404))


def vae_batch(i):
    """32 standardised rows; at HOT_AT the rows of a second sensor arrive without its standardisation (x 20)."""
    g = gen(4000 + i)
    x = torch.randn(B4, 4, generator=g) @ PROTO4 / 2 + 0.3 * torch.randn(B4, D4, generator=g)
    if i == HOT_AT:
        x[:8] = x[:8] * 20
    return (x, torch.randn(B4, Z4, generator=g), torch.randn(B4, Z4, generator=g)), {}, None


def test_ladder_vae_kl_prior_variance_underflows(tmp_path):
    torch.manual_seed(0)
    r = run(LadderVAE(), vae_batch, HOT_AT + 3, tmp_path / "run", snap_at=HOT_AT)
    # truth: `block` is the first producer at HOT_AT, the loss first non-finite there and the step skipped (the
    # scaler's earlier skips, 0, 2 and 5, are backward overflows of its search on finite losses)
    assert r["first"] == ("block", HOT_AT) and r["bad_loss"] == [HOT_AT] and HOT_AT in r["skipped"], r
    fp32_finite(LadderVAE, r, vae_batch, HOT_AT)
    # the mechanism: the block's inputs and its prior / posterior heads' outputs are finite; the prior's logsigma
    # on the hot rows goes below -8.7 and exp(logsigma) ** 2 is 0 in fp16 (float32: > 0), (...) / 0 = inf
    (a, o), = fp16_calls(LadderVAE, r, vae_batch, HOT_AT, "block")
    m = snapshot_model(LadderVAE, r)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        pv = m.block.prior(a[1]).chunk(2, -1)[1]
    assert finite(a) and not finite(o) and bool((pv.exp() ** 2 == 0).any()) and bool((pv.float().exp() ** 2 > 0).all())
    named(r, FWD, "block", HOT_AT, quiet_at=("block.prior", "block.posterior", "enc", "top", "dec", ""))


# ======================================================================================================================
# 5 + twin. a VQ image tokenizer (for an autoregressive prior) with MAGVIT-v2-style entropy regularisation on the
#    soft code assignments: p * log(p + 1e-10) with p flushed to 0 in fp16
# ======================================================================================================================
D5, K5, C5, B5, GAIN_AT = 32, 16, 8, 64, 11


class EntropyVQ(nn.Module):
    """Nearest-code quantization (straight-through, VQ-VAE's codebook + 0.25 commitment losses) plus an entropy
    penalty on p = softmax(-dist * inv_temperature): per-sample entropy minus codebook (batch-mean) entropy, p * log(p + 1e-10), in the
    distances' dtype; `fp32`: the entropy terms from float32 distances (the twin)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.codebook = nn.Embedding(K5, C5)
        nn.init.uniform_(self.codebook.weight, -1 / K5, 1 / K5)
        self.fp32, self.inv_temperature = fp32, 15.0      # (vector-quantize-pytorch's LFQ uses 100)

    def forward(self, z):
        cb = self.codebook.weight.type_as(z)       # the codebook in the codes' dtype
        dist = z.pow(2).sum(-1, keepdim=True) - 2 * z @ cb.t() + cb.pow(2).sum(-1)
        p = torch.softmax(-(dist.float() if self.fp32 else dist) * self.inv_temperature, -1)
        avg = p.mean(0)
        ent = -(p * torch.log(p + 1e-10)).sum(-1).mean() + (avg * torch.log(avg + 1e-10)).sum()
        zq = self.codebook(dist.argmin(-1))
        aux = F.mse_loss(zq, z.detach().float()) + 0.25 * F.mse_loss(z.float(), zq.detach()) + 0.1 * ent
        return z + (zq - z).detach(), aux


class Tokenizer(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.enc = mlp(D5, 64, C5, act=nn.GELU)
        self.quantizer = EntropyVQ(fp32)
        self.dec = mlp(C5, 64, D5, act=nn.GELU)

    def forward(self, x):
        zq, aux = self.quantizer(self.enc(x))
        return F.mse_loss(self.dec(zq).float(), x) + aux


PROTO5 = torch.randn(6, D5, generator=gen(505))


def tok_batch(i):
    """64 standardised patches; at GAIN_AT a shard from a camera with 16x the analog gain (x 16)."""
    g = gen(5000 + i)
    x = torch.softmax(torch.randn(B5, 6, generator=g) * 2, -1) @ PROTO5 + 0.2 * torch.randn(B5, D5, generator=g)
    if i == GAIN_AT:
        x = x * 16
    return (x,), {}, None


def test_vq_tokenizer_entropy_penalty_eps_1e10_nan(tmp_path):
    torch.manual_seed(0)
    r = run(Tokenizer(), tok_batch, GAIN_AT + 3, tmp_path / "run", snap_at=GAIN_AT)
    real_fwd(r, "quantizer", GAIN_AT)
    fp32_finite(Tokenizer, r, tok_batch, GAIN_AT)
    # the mechanism: the encoder's fp16 codes are finite; the distance gaps pass 17.3, softmax flushes p to exactly 0
    # in fp16, and 0 + 1e-10 is still 0: 0 * log(0) = NaN (float32: 0 * log(1e-10) = 0)
    (a, o), = fp16_calls(Tokenizer, r, tok_batch, GAIN_AT, "quantizer")
    assert finite(a) and a[0].dtype == FP16 and bool(torch.isnan(o[1])) and float(torch.tensor(1e-10, dtype=FP16)) == 0
    named(r, FWD + ("eps_underflow",), "quantizer", GAIN_AT,
          quiet_at=("quantizer.codebook", "enc", "enc.0", "enc.2", "dec", ""))


def test_twin_vq_tokenizer_entropy_in_fp32_is_quiet(tmp_path):
    # the fix: the entropy terms from float32 distances; the same batches (the gain batch's large gradients make the
    # scaler back off once at GAIN_AT, on a finite loss: an ordinary backoff); a tokenizer's loss moves little in 20
    # steps, so the twin has to stay finite and not rise (fall=1.0)
    twin(lambda: Tokenizer(fp32=True), tok_batch, GAIN_AT + 10, tmp_path, fall=1.0, skips=(GAIN_AT,))


# ======================================================================================================================
# 6. a vocoder whose head predicts mu-law companded samples and whose loss is on the expanded waveform
# ======================================================================================================================
N6, HOP6, B6, LOUD_AT = 20, 32, 32, 9


class MuLawExpand(nn.Module):
    """WaveNet's mu-law expansion sign(y) ((1 + mu) ** |y| - 1) / mu (mu = 255), in the input's dtype, unclamped."""

    def __init__(self, mu=255.0):
        super().__init__()
        self.mu = mu

    def forward(self, y):
        return torch.sign(y) * (torch.pow(1.0 + self.mu, y.abs()) - 1.0) / self.mu


class MuLawVocoder(nn.Module):
    """log-mel frame -> HOP6 mu-law companded samples (a linear head, no tanh) -> expanded -> L1 on the waveform
    (the multi-resolution STFT losses of parallel vocoders need linear-domain audio)."""

    def __init__(self):
        super().__init__()
        self.body = mlp(N6, 128, HOP6, act=nn.GELU)
        self.expand = MuLawExpand()

    def forward(self, mel, wav):
        return F.l1_loss(self.expand(self.body(mel)).float(), wav)


W6 = torch.randn(N6, HOP6, generator=gen(606)) * 0.15


def voc_batch(i):
    """32 frames of standardised log-mel features and their waveform chunks; at LOUD_AT a clip recorded with the
    input gain at maximum arrives without loudness normalisation (its log-mel features x 10)."""
    g = gen(6000 + i)
    mel = torch.randn(B6, N6, generator=g)
    wav = torch.tanh(mel @ W6) * 0.5
    if i == LOUD_AT:
        mel[:4] = mel[:4] * 10
    return (mel, wav), {}, None


def test_vocoder_mu_law_expansion_overflows(tmp_path):
    torch.manual_seed(0)
    r = run(MuLawVocoder(), voc_batch, LOUD_AT + 3, tmp_path / "run", snap_at=LOUD_AT)
    real_fwd(r, "expand", LOUD_AT)
    fp32_finite(MuLawVocoder, r, voc_batch, LOUD_AT)
    # the mechanism: the head's companded outputs are finite fp16; some |y| >= 2 and 256 ** |y| >= 65536 = inf in fp16
    (a, o), = fp16_calls(MuLawVocoder, r, voc_batch, LOUD_AT, "expand")
    assert finite(a) and a[0].dtype == FP16 and float(a[0].abs().max()) >= 2 and not finite(o)
    named(r, FWD, "expand", LOUD_AT, quiet_at=("body", "body.0", "body.2", ""))
