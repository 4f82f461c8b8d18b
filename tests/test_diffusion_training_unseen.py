"""DIFFUSION / FLOW-MATCHING / SCORE-MODEL TRAINING under fp16, in plain PyTorch (no diffusers import): the loss
weightings, preconditionings and conditioning paths of those training scripts, each written the way a port writes
it (the schedule's scalars cast to the cached fp16 latents' dtype, a mask cast to the features' dtype), broken at a
known step by the draw or update that reaches the fp16 edge.

Near cases that live elsewhere (not repeated here): EDM's loss weight (sigma^2 + sigma_data^2) / (sigma sigma_data)^2
on a tiny sigma (test_unseen_variants11); DSM 1 / sigma^2 with sigma^2 flushed to 0 (test_density_models_unseen,
test_unseen_variants49); x0 = (x_t - ...) / sqrt(alpha_bar) with the cosine schedule's alpha_bar(T) = 0
(test_domain_models_unseen); Min-SNR eps weights at zero terminal SNR and c_noise = log(sigma) from fp16
alphas_cumprod (test_unseen_variants14); sigma = sqrt(1 - alpha_bar) = 0 in bf16 (test_bf16_probe,
test_domain_models_unseen); every sinusoidal / Gaussian-Fourier timestep embedding in fp16 / bf16
(test_unseen_variants2/28/29, test_bf16_probe, test_bf16_unseen, test_domain_models_unseen); CFG's null label
through a PixelNorm eps (test_unseen_variants19).

Loop: probe_harness.probe_run (AdamW, GradScaler("cpu") at its defaults, CPU fp16 autocast, unscale_ ->
clip_grad_norm_(1.0) -> scaler.step -> scaler.update, ampdoctor.watch(model, optimizer=, scaler=, run_dir=tmp_path)
at the default sampling). Every model computes its own loss (the diffusers / k-diffusion wrapper layout); the
data are cached fp16 latents (16-d, low rank) and fp16 noise. Injections at step 5 (BAD): the bad step's draw
itself (a logit-normal tail, the first draw past sigma = 256 once the sigma_max warm-up ends, a t at the logSNR
clip, the first caption CFG drops) or a parameter changed under no_grad before its forward (an lr spike's update).

Oracle for every failure (a failing oracle is a plain failure, never an xfail): the loss is first non-finite at the
bad step and the scaler skips it; probe_harness.Producer's first forward producer is the expected module at that
step; the bad step re-run from the weights it ran with (snap_at) gives a non-finite loss under fp16 autocast, and
finite outputs and loss in fp32 (fp16's doing); plus a check of the mechanism's own threshold (below). Report
check (`producer_top3`): among the first three findings a warning/error of an accepted rule at the expected module
and the bad step, phase forward (or null), and no overflow/nan_origin error at another named module at that step;
else WrongAnswer (strict xfail via `wrong`).

Failures:
 1. rf_sigma_sqrt  rectified flow (SD3 recipe): sigma = sigmoid(u), u ~ N(0, 1) (logit-normal), cast to the
                   latents' dtype (diffusers' get_sigmas(..., dtype=model_input.dtype)), the "sigma_sqrt" loss
                   weighting sigmas ** -2.0 taken before its .float() (diffusers' compute_loss_weighting_for_sd3);
                   at step 5 a tail draw u = -6.5: sigma = 1.5e-3 (a normal fp16 number, nothing flushes), its
                   -2 power 4.4e5 > 65504                                          -> overflow at `weighting`.
 2. ve_precond     VE noise range (sigma_max = 348, the NCSN++ CelebA-HQ/FFHQ-256 setting) with k-diffusion's
                   VDenoiser scalings c_skip = sd^2 / (s^2 + sd^2), c_out = -s sd / sqrt(s^2 + sd^2), c_in, and
                   its training target (x0 - c_skip x) / c_out, all in the latents' dtype inside `precond`; a
                   sigma_max warm-up (80) ends at step 5 and the first draw past 256 gives s^2 = inf: c_skip = 0,
                   c_out = -0, target = x0 / -0 = inf (fp32: c_out = -0.5)           -> overflow at `precond`.
 3. v_trunc_snr    v-prediction trained with progressive distillation's truncated-SNR x-space loss
                   max(alpha^2 / sigma^2, 1) ||x0 - x0_hat||^2, x0_hat = alpha z - sigma v_hat, on the cosine
                   logSNR schedule clipped to [-20, 20], alpha/sigma in the latents' dtype (`sched`); at step 5 a
                   row draws t = 1e-5 (logSNR 20): sigma^2 = sigmoid(-20) = 2e-9 is 0 in fp16, the weight is
                   1 / 0 = inf and the error exactly 0: inf * 0 = NaN (fp32: 4.9e8 x 2e-9 ~ 1, the two cancel)
                                                                          -> nan_origin/overflow/underflow at `loss`.
 4. cfg_caption    text-conditioned denoiser, classifier-free-guidance dropout done by blanking the caption's
                   attention mask; the caption is mean-pooled sentence-transformers' way, sum(h m) / clamp(sum(m),
                   min=1e-9), with the mask cast to the features' dtype (`pool`); the first dropped caption (step
                   5): 1e-9 is 0 in fp16, 0 / 0 = NaN (fp32: 0 / 1e-9 = 0, the intended null embedding)
                                                                      -> eps_underflow/nan_origin at `pool`.
 5. edm2_uncert    EDM2's learned per-sigma uncertainty, loss = weight / exp(logvar) * (D - y)^2 + logvar, with
                   sigma drawn in the latents' dtype (randn_like on the fp16 latents, EDM's P_mean/P_std) so the
                   whole criterion runs in fp16; an lr spike's update sets `logvar_linear`'s bias to -12.5 at
                   step 5: exp(-12.5) = 3.7e-6 (subnormal), weight / it > 65504        -> overflow at `criterion`.
Healthy twins (the fixed form), each run with and without the watch: losses and final weights bitwise identical,
every loss finite, no producer, no skip after the scaler's first steps, no RuntimeWarning, finite weights, the loss
fell (last fifth < 0.95 x first fifth), no warning/error in the report: ve_precond_fp32 (k-diffusion's scalings
and target in fp32; the same warm-up, draws past 256 from step 5 on), v_trunc_snr_fp32 (alpha/sigma, x0_hat and
the weight in fp32; t = 1e-5 rows at steps 5, 17, 29), cfg_caption_fp32 (the mask .float(), as
sentence-transformers writes it; captions dropped at steps 5, 17, 29). Each twin asserts its batches hold the
fp16 form's trigger (ve: rows past 256 at steps 7, 8, 11, 12, ...). No twin for 1 and 5: their fp32 forms
(weights 4.4e5 and 4e6 on the same draws) give fp16 gradients past 65504 under any useful loss scale - the fix
there is a bounded weight, a different objective, not a precision fix.

Result when written (torch 2.13 CPU, 2 runs identical): 7 pass, 1 xfail, the whole file ~7 s (pytest ~4 s).
Top findings:
 1 rf_sigma_sqrt  XFAIL (wrong words): `[error] overflow at weighting aten::pow step 5: aten::pow in `weighting`
                  overflowed float16 (input up to 0.96; in fp16 x**2 is inf for |x| > 255.9) - a variance or norm
                  computed in low precision`, fix "as HF's RMSNorm does". Rule, module, op, step right; the words are
                  the squaring case's, for sigmas ** -2.0 of a small input (min 1.5e-3: |x|**-2 is inf for |x| <
                  3.9e-3). Should say: a negative power of a small value overflowed; take the power in fp32
                  (sigmas.float() ** -2.0) or bound the weight. Fixed since (thirty-seventh session: the op trace
                  keeps a pow's number exponent, OpEvent.scalar_exponent, and a negative power's smallest input):
                  `x ** -2 with |x| down to 0.0015 (float16 holds |x| ** -2 only for |x| > 0.00391) — a negative
                  power of a small value`, fix: the power in fp32 and a bound.
 2 ve_precond     `[error] overflow at precond aten::pow step 5: ... (input up to 340; in fp16 x**2 is inf for |x| >
                  255.9) - a variance or norm computed in low precision` (threshold right; "variance or norm" is
                  only the framing: it is sigma**2 of the scalings; fix "compute in fp32" right).
 3 v_trunc_snr    `[error] overflow at loss aten::div step 5: aten::div in `loss` hit its singular point ... +inf;
                  it propagates to aten::mul in `loss`` + `[error] underflow at loss aten::div step 5: the zeros ...
                  are not zero in fp32`.
 4 cfg_caption    `[error] eps_underflow at pool aten::clamp step 5: ... eps 1e-09, which rounds to 0 in float16`
                  + `[error] nan_origin at pool aten::div step 5`.
 5 edm2_uncert    `[error] overflow at criterion aten::div step 5: aten::div in `criterion` produced +inf from finite
                  inputs` (the spike persists: step 6 is skipped too).
 Twins: no warning or error.
Not built: Min-SNR-gamma's min(snr, gamma) / snr at t -> 0 (snr = inf in fp16 gives gamma / inf = 0: finite, a
negligible mis-weighting, no failure); EDM at sigma_max = 80 (sigma^2 = 6400, c_in/c_out all in range in fp16).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import WrongAnswer, failure_oracle, probe_run, producer_top3, twin_checks, wrong
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

AC = dict(device_type="cpu", dtype=torch.float16)
BAD = 5
D, B = 16, 32
H16 = torch.float16


def rn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(9100 + seed))


def rnd(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(9200 + seed))


BASIS = rn(4, D, seed=0) * 0.5


def latents(i, cycle=4):
    """Cached fp16 latents (rank-4 data, ~unit scale) and fp16 noise for step i (4 distinct batches, cycled)."""
    z = rn(B, 4, seed=10 + i % cycle) @ BASIS + 0.1
    return z.to(H16), rn(B, D, seed=20 + i % cycle).to(H16)


class Den(nn.Module):
    """The denoiser: [x, cond] -> Linear -> SiLU -> Linear -> D (fp16 under autocast)."""

    def __init__(self, c=1, hid=64):
        super().__init__()
        self.inp, self.out = nn.Linear(D + c, hid), nn.Linear(hid, D)

    def forward(self, x, cond):
        return self.out(F.silu(self.inp(torch.cat([x.float(), cond.float()], -1))))


# ------------------------------------------------------------------------------- 1. rectified flow, sigma_sqrt

class SigmaSqrt(nn.Module):
    """diffusers' compute_loss_weighting_for_sd3("sigma_sqrt"): (sigmas ** -2.0).float() - the power in the
    sigmas' dtype."""

    def forward(self, sig):
        return (sig ** -2.0).float()


class RF(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Den()
        self.weighting = SigmaSqrt()

    def forward(self, x0, noise, u):
        sig = torch.sigmoid(u).to(x0.dtype)[:, None]        # get_sigmas(..., dtype=model_input.dtype)
        xt = (1 - sig) * x0 + sig * noise
        v = self.net(xt, sig)
        w = self.weighting(sig)
        return (w * (v.float() - (noise - x0).float()) ** 2).mean()


def b_rf(bad=None):
    def b(i):
        x0, n = latents(i)
        u = rn(B, seed=30 + i % 4)
        if i == bad:
            u[3] = -6.5                                        # a logit-normal tail draw: sigma = 1.5e-3
        return (x0, n, u), None
    return b


# -------------------------------------------------------------------- 2. VE range, k-diffusion VDenoiser scalings

SD = 0.5


class VPrecond(nn.Module):
    """k-diffusion VDenoiser's scalings and training target, in the noised latents' dtype (`fp32`: in fp32)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, x0, noised, sigma):
        if self.fp32:
            x0, noised, sigma = x0.float(), noised.float(), sigma.float()
        s = sigma.to(noised.dtype)[:, None]
        c_skip = SD ** 2 / (s ** 2 + SD ** 2)
        c_out = -s * SD / (s ** 2 + SD ** 2) ** 0.5
        c_in = 1 / (s ** 2 + SD ** 2) ** 0.5
        return c_in * noised, (x0 - c_skip * noised) / c_out


class VEModel(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.net = Den()
        self.precond = VPrecond(fp32)

    def forward(self, x0, noise, sigma):
        sigma = sigma.to(x0.dtype)
        noised = x0 + noise * sigma[:, None]
        inp, target = self.precond(x0, noised, sigma)
        c_noise = (sigma.float().log() / 4)[:, None]
        return F.mse_loss(self.net(inp, c_noise).float(), target.float())


def b_ve(bad=None, warm=BAD):
    """sigma log-uniform in [0.002, sigma_max]; sigma_max 80 before the warm-up ends at `warm`, then 348. At `bad`
    row 0 draws 340 (the first draw past 256; the step's other rows are drawn under 256)."""
    def b(i):
        x0, n = latents(i)
        smax = 80.0 if i < warm else 348.0
        r = rnd(B, seed=40 + i % 4)
        sigma = (math.log(0.002) + r * (math.log(smax) - math.log(0.002))).exp()
        if i == bad:
            sigma = sigma.clamp(max=250.0)
            sigma[0] = 340.0
        return (x0, n, sigma), None
    return b


# -------------------------------------------------------------------- 3. v-prediction, truncated-SNR x-space loss

def cosine_logsnr(t):
    return (-2 * torch.log(torch.tan(math.pi * t / 2))).clamp(-20.0, 20.0)


class Sched(nn.Module):
    """alpha, sigma of the cosine logSNR schedule, in `dtype` (the latents')."""

    def forward(self, t, dtype):
        ls = cosine_logsnr(t).to(dtype)[:, None]
        return torch.sigmoid(ls).sqrt(), torch.sigmoid(-ls).sqrt()


class TruncSNRLoss(nn.Module):
    """Progressive distillation's truncated-SNR x-space loss max(alpha^2 / sigma^2, 1) ||x0 - x0_hat||^2 with
    x0_hat = alpha z - sigma v_hat, in the operands' dtype."""

    def forward(self, v_hat, z, x0, alpha, sigma):
        x0_hat = alpha * z - sigma * v_hat
        w = (alpha ** 2 / sigma ** 2).clamp(min=1.0)
        return (w * (x0 - x0_hat) ** 2).float().mean()


class VPred(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32
        self.net = Den()
        self.sched = Sched()
        self.loss = TruncSNRLoss()

    def forward(self, x0, noise, t):
        dt = torch.float32 if self.fp32 else x0.dtype
        alpha, sigma = self.sched(t, dt)
        x0, noise = x0.to(dt), noise.to(dt)
        z = alpha * x0 + sigma * noise
        v_hat = self.net(z, cosine_logsnr(t)[:, None] / 20)
        return self.loss(v_hat.to(dt), z, x0, alpha, sigma)


def b_v(bad=None, low=()):
    """t ~ U(0.02, 0.98); at `bad` (and `low`) row 0 draws t = 1e-5 (logSNR at its clip, 20)."""
    def b(i):
        x0, n = latents(i)
        t = 0.02 + 0.96 * rnd(B, seed=50 + i % 4)
        if i == bad or i in low:
            t[0] = 1e-5
        return (x0, n, t), None
    return b


# ----------------------------------------------------------------------- 4. CFG caption dropout, masked mean pool

V, L, E = 50, 6, 32


class MeanPool(nn.Module):
    """sentence-transformers' mean pooling, sum(h m) / clamp(sum(m), min=1e-9), the mask cast to h's dtype
    (`fp32`: .float(), as sentence-transformers writes it)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, h, mask):
        m = mask.unsqueeze(-1).float() if self.fp32 else mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / (m.sum(1)).clamp(min=1e-9)


def ab_cos(t):
    return torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2


class CondDen(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.tok = nn.Embedding(V, E)
        self.txt = nn.Linear(E, E)
        self.pool = MeanPool(fp32)
        self.net = Den(c=1 + E)

    def forward(self, ids, mask, x0, noise, t):
        c = self.pool(self.txt(self.tok(ids)), mask)
        ab = ab_cos(t)[:, None]
        xt = ab.sqrt() * x0.float() + (1 - ab).sqrt() * noise.float()
        eps = self.net(xt, torch.cat([t[:, None], c.float()], -1))
        return F.mse_loss(eps.float(), noise.float())


CAP_W = rn(V, D, seed=60) * 0.3


def b_cfg(bad=None, drops=()):
    """Captions (token ids, all 6 tokens valid) that shift the latents; the CFG coin drops row 2's caption (mask all
    0) first at `bad` (and at `drops`)."""
    def b(i):
        g = torch.Generator().manual_seed(9300 + i % 4)
        ids = torch.randint(0, V, (B, L), generator=g)
        mask = torch.ones(B, L, dtype=torch.long)
        if i == bad or i in drops:
            mask[2] = 0
        x0, n = latents(i)
        x0 = (x0.float() + CAP_W[ids].mean(1)).to(H16)
        t = 0.02 + 0.96 * rnd(B, seed=70 + i % 4)
        return (ids, mask, x0, n, t), None
    return b


# ------------------------------------------------------------------------------- 5. EDM2 learned uncertainty

class EDM2Loss(nn.Module):
    """EDM2's loss with the learned uncertainty: weight / exp(logvar) * (D - y)^2 + logvar (in sigma's dtype)."""

    def forward(self, denoised, y, sigma, logvar):
        weight = (sigma ** 2 + SD ** 2) / (sigma * SD) ** 2
        return ((weight / logvar.exp()) * (denoised - y) ** 2 + logvar).float().mean()


class EDM2(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Den()
        self.logvar_linear = nn.Linear(1, 1)
        self.criterion = EDM2Loss()

    def forward(self, y, noise, rnd_normal):
        sigma = (rnd_normal * 1.2 - 1.2).exp()[:, None]         # rnd_normal = randn_like(latents): fp16
        noised = y + noise * sigma
        s = sigma
        c_skip = SD ** 2 / (s ** 2 + SD ** 2)
        c_out = s * SD / (s ** 2 + SD ** 2).sqrt()
        c_in = 1 / (s ** 2 + SD ** 2).sqrt()
        c_noise = s.float().log() / 4
        denoised = c_skip * noised + c_out * self.net(c_in * noised, c_noise)
        logvar = self.logvar_linear(c_noise)
        return self.criterion(denoised, y, sigma, logvar)


def b_edm2(bad=None):
    def b(i):
        y, n = latents(i)
        return (y, n, rn(B, seed=80 + i % 4).to(H16)), None
    return b


def lr_spike_logvar(i, m, bad):
    """An lr spike's update drives the uncertainty head's bias to -12.5 at `bad`."""
    if i == bad:
        m.logvar_linear.bias.fill_(-12.5)
        m.logvar_linear.weight.zero_()


# ---------------------------------------------------------------------------------------------------------- cases
# name: (factory, batch(bad), inject(i, m, bad) or None, expected module, accepted rules, threshold check(r) or None)

def check_rf(args):
    sig = torch.sigmoid(args[2]).to(H16)
    assert sig.min() > 6.1e-5 and not torch.isfinite(sig ** -2.0).all()        # normal fp16, power past 65504
    assert torch.isfinite(sig.float() ** -2.0).all()


def check_ve(args):
    s = args[2].to(H16)
    assert s.max() > 255.9 and not torch.isfinite(s ** 2).all() and torch.isfinite(s.float() ** 2).all()


def check_v(args):
    ls = cosine_logsnr(args[2])
    assert ls.max() == 20.0 and torch.sigmoid(-ls.to(H16)).min() == 0 and torch.sigmoid(-ls).min() > 1e-9


def check_cfg(args):
    assert torch.tensor(1e-9, dtype=H16) == 0 and (args[1].sum(1) == 0).any()


def check_edm2(args):
    assert torch.exp(torch.tensor(-12.5, dtype=H16)) > 0 and 1 / torch.exp(torch.tensor(-12.5, dtype=H16)) > 65504


OWN = lambda out, y: out.float()                                # noqa: E731  (the model computes its own loss)
FWD_RULES = ("overflow", "nan_origin")
CASES = {
    "rf_sigma_sqrt": (RF, b_rf, None, "weighting", FWD_RULES, check_rf),
    "ve_precond": (VEModel, b_ve, None, "precond", FWD_RULES, check_ve),
    "v_trunc_snr": (VPred, b_v, None, "loss", FWD_RULES + ("underflow",), check_v),
    "cfg_caption": (CondDen, b_cfg, None, "pool", FWD_RULES + ("eps_underflow",), check_cfg),
    "edm2_uncert": (EDM2, b_edm2, lr_spike_logvar, "criterion", FWD_RULES, check_edm2),
}

# Words checks (after the rule/module/step check): what the finding's message must not say.
WORDS = {
    # sigma ** -2.0: the input is small (1.5e-3), not large; the x**2 threshold does not apply
    "rf_sigma_sqrt": lambda f: "x**2 is inf" not in f.message,
}

XFAIL: dict = {}  # (rf_sigma_sqrt was one when written: fixed since, see the docstring)


def build(factory, seed=0):
    torch.manual_seed(seed)
    return factory()


def replay_bad(name, r):
    """The bad step's forward from the weights it ran with, under fp16 autocast and in fp32: (output fp16, loss fp16,
    output fp32, loss fp32) - the model's output is its loss."""
    factory, mk, *_ = CASES[name]
    m = build(factory)
    m.load_state_dict(r["sd"])
    if CASES[name][2] is not None:
        with torch.no_grad():
            CASES[name][2](BAD, m, BAD)
    args, _ = mk(BAD)(BAD)
    with torch.no_grad():
        with torch.autocast(**AC):
            o16 = m(*args)
        a32 = [a.float() if a.is_floating_point() else a for a in args]
        o32 = m(*a32)
    return o16, o16, o32, o32


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_diffusion_fails(name, tmp_path):
    factory, mk, inj, where, rules, check = CASES[name]
    m = build(factory)
    inject = None if inj is None else (lambda i, mm: inj(i, mm, BAD))
    r = probe_run(m, mk(BAD), OWN, BAD + 2, str(tmp_path / "run"), inject=inject, snap_at=BAD)
    # oracle: the loss first non-finite at BAD, skipped; the producer `where` at BAD; the step replayed fails in
    # fp16 (the model's output, its loss, non-finite) and is finite in fp32; the mechanism's own threshold
    o16, l16, o32, l32 = replay_bad(name, r)
    assert not torch.isfinite(o16) and torch.isfinite(o32), (o16, o32)
    failure_oracle(r, BAD, where, (o16, l16, o32, l32))
    check(mk(BAD)(BAD)[0])
    f = producer_top3(r["rep"], rules, where, BAD)
    if name in WORDS and not WORDS[name](f):
        raise WrongAnswer(f"right rule at the right place, wrong words: {f.message}")
    print(name, "->", f.phase, f.one_line(), "|", f.fix[:80])


# ---------------------------------------------------------------------------------------------------------- twins
# name: (factory, batch, steps, lr, trigger(batch args): the fp16 form's trigger is in this batch)

TWINS = {
    "ve_precond_fp32": (lambda: VEModel(fp32=True), b_ve(), 40, 3e-3, lambda a: a[2].max() > 255.9),
    "v_trunc_snr_fp32": (lambda: VPred(fp32=True), b_v(low=(5, 17, 29)), 40, 3e-3,
                         lambda a: cosine_logsnr(a[2]).max() == 20.0),
    "cfg_caption_fp32": (lambda: CondDen(fp32=True), b_cfg(drops=(5, 17, 29)), 40, 3e-3,
                         lambda a: (a[1].sum(1) == 0).any()),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_diffusion_twin(name, tmp_path):
    factory, batch, steps, lr, trigger = TWINS[name]
    hit = [i for i in range(steps) if trigger(batch(i)[0])]
    assert hit and hit[0] >= BAD and len(hit) >= 3, hit          # the same trigger, from BAD on
    runs = []
    for watch in (True, False):
        m = build(factory)
        runs.append(probe_run(m, batch, OWN, steps, str(tmp_path / f"w{watch}"), lr=lr, watch=watch))
    r, plain = runs
    twin_checks(r, plain, steps)
