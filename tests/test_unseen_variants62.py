"""Sixty-second set: FP16 FAILURES IN MODEL FAMILIES NO EARLIER SET BUILDS (grep of test_unseen_variants*.py: no
Hopfield layer, no Perceiver, no Tweedie objective; Mamba only as Mamba-2's SSD segsum (38), never the S6 scan in its
closed form; test_unseen_arch.py has a cumprod selective scan and a Perceiver whose hand-written softmax overflows,
not these mechanisms). Four fp16 failures that start mid-run at step 7 (never a sampled step) from a real data event,
and four healthy twins. Tiny models, fixed seeds, one intra-op thread. Watched through the public API only
(`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=...)` at the default settings) by test_unseen_variants56's
run/check_failure/twin (probe_harness.probe_run: CPU fp16 autocast + `torch.amp.GradScaler("cpu")`,
scale(loss).backward -> unscale_ -> clip -> step -> update -> close -> `w.report()`); every model computes its own loss.

Each failure is proven first by check_failure's oracle: probe_harness.Producer (first module whose output is
non-finite from finite inputs and own parameters) at step 7, the loss first non-finite there, the scaler skips it
(before it only the opening backoffs), the bad step's weights run the bad batch in float32 to a finite loss and
finite gradients, the producer re-run under fp16 gives non-finite output from finite inputs, and the fix (same
weights, same batch) is finite. Only then must overflow/nan_origin be an `error` among the report's first three
findings at the PRODUCER, step 7, forward phase, with no error at the modules that only passed it on.

 1. a Mamba (S6) LM whose selective scan is written in its closed parallel form h_t = exp(S_t) * cumsum_s(exp(-S_s)
    dt_s B_s u_s), S = cumsum(dt A), with A cast to the activations' dtype (the einsum then runs in fp16); Mamba's dt
    init (0.001-0.02), S4D-real A_n = -n. Contexts of 64 tokens keep |S| below 6.2; at step 7 the context curriculum
    moves to 512 tokens, |S| reaches ~49 and exp(-S) passes 65504 (exp(S) flushes to 0: 0 * inf = NaN) ->
    overflow at `mixer` (aten::exp), step 7 (not `mixer.in_proj` / `x_proj` / `dt_proj` / `out_proj`, `head`).
    Fix: the scan in float32 (twin 5).
 2. a modern Hopfield pooling layer (Ramsauer et al. 2020; DeepRC-style immune-repertoire MIL classifier) with a
    large beta = 16: softmax(beta R Y^T) over the bag's stored patterns Y = W_K x. At step 7 a repertoire from a
    second sequencing facility kept raw clone counts in the abundance column (an expanded clone of 30,000
    templates, the bag's other counts raw too, instead of log1p): R Y^T reaches 6.1e4, still finite, beta * it is
    not (on ordinary bags |beta R Y^T| < 111) -> overflow at `pool` (aten::mul), step 7 (not `pool.k`, `embed`,
    `head`). Fix: the association in float32 (twin 6).
 3. a Perceiver flight-track classifier (learned latents cross-attend to the ADS-B samples + Fourier time
    features; no LayerNorm on the input array, which the loader standardises) whose cross-attention forgot the
    1/sqrt(d) scale. At step 7 a shard skipped the standardisation: one track's position columns are raw ENU metres
    (an airliner descending from 42 km east, 36 km north, 10,500 m up); `adapter`, `to_k` stay finite (k ~ 1.7e4),
    q k^T passes 65504 -> overflow at `cross` (aten::bmm), step 7 (not `cross.to_q/to_k/to_v`, `adapter`, `mlp`).
    Fix: the scale restored, on q before the matmul (twin 7: the step-7 backward still overflows the scaled
    gradients once, finite unscaled: the scaler's job, reported as info).
 4. an insurance-pricing MLP trained with the Tweedie deviance (p = 1.5, LightGBM / XGBoost's reg:tweedie) written
    out on the log-mean f in its fp16: -y exp(-f/2) / (-1/2) + exp(f/2) / (1/2). At step 7 a broker's bordereau
    carries the sum insured in raw $k (105 for a $105k policy) instead of the standardised log: that row's f is
    -26.6 (the net's learned slope on the column is negative) and the claim term's exp((1 - p) f) = exp(13.3) passes
    65504 (that policy had a claim: the loss is +inf) -> overflow at `tweedie` (aten::exp), step 7 (not `mlp.*`).
    Fix: the deviance in float32 (twin 8: the step-7 scaled backward overflows once, finite unscaled: info).
Healthy twins (watched and unwatched: losses and weights bitwise identical; no warning, no error):
 5. twin of 1: the scan in float32 (the 512-token contexts included) -> quiet.
 6. twin of 2: the Hopfield association in float32 (the raw-count repertoire included) -> quiet.
 7. twin of 3: the 1/sqrt(d) scale on q (the raw-ENU track included; step 7 skipped once, info) -> quiet.
 8. twin of 4: the deviance in float32 (the raw sum insured included; step 7 skipped once, info) -> quiet.

Result when written (torch 2.13 CPU, default watch): 8 pass, 0 xfail. Top findings:
1 `[error] overflow at mixer aten::exp step 7` ("input up to 49.28; fp16 exp(x) is inf for x > 11.09; it propagates
  to aten::cumsum"), `[error] skipped_steps at mixer step 7`;
2 `[error] overflow at pool aten::mul step 7` ("produced ±inf from finite inputs; it propagates to aten::_softmax");
3 `[error] overflow at cross aten::bmm step 7` ("finite inputs (max |x| = 1.744e+04) gave ±inf");
4 `[error] overflow at tweedie aten::exp step 7` ("input up to 13.3");
5-8 quiet (7 and 8: `[info] skipped_steps (run) step 7`, "a normal rate for dynamic loss scaling").
Not built: an RWKV-4 WKV recurrence with exp(k) and a decay (k comes from LayerNorm'd inputs, |k| < 2 here: the
decayed sums saturate near e^k / w < 1e3, no data event reaches 65504; RWKV-v1's undecayed sums are set 58); a
PointNet far-outlier point (without a squaring op the shared MLP is positively homogeneous and shrinks the scale,
and an in-model unit-sphere normalisation's |p|^2 overflow divides to finite zeros: no non-finite output); capsule
routing, RealNVP, MDN (sets 59, 9/54, 29).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants62.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")
BAD_AT = 7
FALL_MB = FALL_HP = FALL_TW = 0.9
SKIPS_PC = SKIPS_TW = (7,)

# the loop, the oracle and the checks: test_unseen_variants56's (its run, twin and check_failure)
from test_unseen_variants56 import check_failure, twin  # noqa: E402


# ======================================================================================================================
# 1./5. a Mamba (S6) selective scan in its closed parallel form: exp(cumsum(dt A)) and exp(-cumsum(dt A))
# ======================================================================================================================
V_MB, D_MB, E_MB, N_MB, R_MB, B_MB, L_MB, L_LONG, LR_MB = 32, 16, 32, 4, 4, 4, 64, 512, 1e-2


class SelectiveSSM(nn.Module):
    """Mamba's S6 mixer (Gu & Dao 2023) without the short conv: x_proj gives the input-dependent dt, B, C; dt =
    softplus(dt_proj(.)) from Mamba's dt init (0.001-0.02); A = -exp(A_log), S4D-real (A_n = -n). The scan in its
    closed form, h_t = exp(S_t) * cumsum_s(exp(-S_s) dt_s B_s u_s), S = cumsum(dt A), where dt A is built by
    einsum (autocast: the activations' fp16). `fix`: the scan in float32."""

    def __init__(self, fix=False):
        super().__init__()
        self.in_proj = nn.Linear(D_MB, 2 * E_MB)
        self.x_proj = nn.Linear(E_MB, R_MB + 2 * N_MB, bias=False)
        self.dt_proj = nn.Linear(R_MB, E_MB)
        dt = torch.exp(torch.rand(E_MB, generator=gen(6201)) * (math.log(0.02) - math.log(1e-3)) + math.log(1e-3))
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))     # inverse softplus, as Mamba's init
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N_MB + 1).float()).repeat(E_MB, 1))
        self.D = nn.Parameter(torch.ones(E_MB))
        self.out_proj = nn.Linear(E_MB, D_MB)
        self.fix = fix

    def forward(self, x):
        u, z = self.in_proj(x).chunk(2, -1)
        u = F.silu(u)
        dt, Bm, Cm = self.x_proj(u).split([R_MB, N_MB, N_MB], -1)
        dt = F.softplus(self.dt_proj(dt))
        A = -torch.exp(self.A_log)
        if self.fix:
            with torch.autocast("cpu", enabled=False):
                y = self.scan(dt.float(), A, Bm.float(), Cm.float(), u.float())
        else:
            y = self.scan(dt, A, Bm, Cm, u)
        return self.out_proj(y * F.silu(z))

    def scan(self, dt, A, Bm, Cm, u):
        S = torch.cumsum(torch.einsum("bld,dn->bldn", dt, A.to(dt.dtype)), 1)
        h = torch.exp(S) * torch.cumsum(torch.exp(-S) * (dt * u)[..., None] * Bm[:, :, None], 1)
        return (h * Cm[:, :, None]).sum(-1) + u * self.D


class MambaLM(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.emb = nn.Embedding(V_MB, D_MB)
        self.norm = nn.LayerNorm(D_MB)
        self.mixer = SelectiveSSM(fix)
        self.norm_f = nn.LayerNorm(D_MB)
        self.head = nn.Linear(D_MB, V_MB)

    def forward(self, ids):
        h = self.emb(ids[:, :-1])
        h = h + self.mixer(self.norm(h))
        return F.cross_entropy(self.head(self.norm_f(h)).float().flatten(0, 1), ids[:, 1:].flatten())


def mb_batch(i):
    """A byte-level LM (Zipf-distributed tokens); the context curriculum goes from 64 to 512 tokens at BAD_AT."""
    g = gen(6210 + i)
    L = (L_LONG if i >= BAD_AT else L_MB) + 1
    zipf = 1 / torch.arange(1, V_MB + 1).float() ** 1.2
    ids = torch.multinomial(zipf.expand(B_MB, -1), L, replacement=True, generator=g)
    return (ids,), {}, None


def test_mamba_selective_scan_closed_form_overflows_at_the_context_curriculum(tmp_path):
    return check_failure(tmp_path, MambaLM, mb_batch, BAD_AT, "mixer", FWD, lr=LR_MB,
                         quiet_at=("mixer.in_proj", "mixer.x_proj", "mixer.dt_proj", "mixer.out_proj", "norm_f",
                                   "head", "norm", "emb", ""))


def test_twin_mamba_scan_in_fp32_stays_quiet(tmp_path):
    twin(lambda: MambaLM(fix=True), mb_batch, 12, tmp_path, lr=LR_MB, fall=FALL_MB)


# ======================================================================================================================
# 2./6. a modern Hopfield pooling layer (DeepRC-style immune repertoire classifier) with a large beta
# ======================================================================================================================
F_HP, D_HP, H_HP, Q_HP, B_HP, N_HP, LR_HP, BETA = 21, 32, 16, 4, 4, 64, 3e-2, 16.0


class HopfieldPooling(nn.Module):
    """Ramsauer et al. 2020's HopfieldPooling: Q_HP learned state patterns R retrieve from the stored patterns Y =
    W_K x of one bag: softmax(beta R Y^T) (W_V x); beta = 16 (sharp, one-pattern retrieval). `fix`: the association
    R Y^T in float32."""

    def __init__(self, fix=False):
        super().__init__()
        self.k, self.v = nn.Linear(D_HP, H_HP), nn.Linear(D_HP, H_HP)
        self.R = nn.Parameter(torch.randn(Q_HP, H_HP, generator=gen(6220)))
        self.fix = fix

    def forward(self, x):
        Y = self.k(x)
        if self.fix:
            with torch.autocast("cpu", enabled=False):
                logits = BETA * (self.R @ Y.float().transpose(-1, -2))
        else:
            logits = BETA * (self.R @ Y.transpose(-1, -2))
        return (torch.softmax(logits.float(), -1).to(Y.dtype) @ self.v(x)).flatten(1)


class Repertoire(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(F_HP, D_HP), nn.ReLU())
        self.pool = HopfieldPooling(fix)
        self.head = nn.Linear(Q_HP * H_HP, 1)

    def forward(self, x, y):
        return F.binary_cross_entropy_with_logits(self.head(self.pool(self.embed(x))).float()[:, 0], y)


def hp_batch(i):
    """Bags of N_HP TCR sequences: 20 amino-acid composition fractions + log1p(clone count); label: a motif enriched
    in the positives. At BAD_AT a repertoire from a second sequencing facility whose export kept the raw clone
    (template) counts in the abundance column: an expanded clone of 30,000 templates."""
    g = gen(6230 + i)
    comp = torch.softmax(torch.randn(B_HP, N_HP, 20, generator=g), -1)
    y = (torch.arange(B_HP) % 2).float()
    comp[y == 1, :8, 3] += 0.5
    cnt = torch.randint(1, 20, (B_HP, N_HP, 1), generator=g).float()
    ab = torch.log1p(cnt)
    if i == BAD_AT:
        ab[1] = cnt[1]
        ab[1, 0, 0] = 30000.0
    return (torch.cat([comp, ab], -1), y), {}, None


def test_hopfield_pooling_large_beta_association_overflows_on_raw_clone_counts(tmp_path):
    return check_failure(tmp_path, Repertoire, hp_batch, BAD_AT, "pool", FWD, lr=LR_HP,
                         quiet_at=("pool.k", "pool.v", "embed", "embed.0", "embed.1", "head", ""))


def test_twin_hopfield_association_in_fp32_stays_quiet(tmp_path):
    twin(lambda: Repertoire(fix=True), hp_batch, 12, tmp_path, lr=LR_HP, fall=FALL_HP)


# ======================================================================================================================
# 3./7. a Perceiver (Jaegle et al. 2021) whose latent -> input cross-attention forgot the 1/sqrt(d) scale
# ======================================================================================================================
F_PC, D_PC, H_PC, NL_PC, B_PC, T_PC, LR_PC = 6, 32, 64, 16, 8, 48, 3e-3
ENU = (42000.0, 36000.0, 10500.0)      # metres east, north, up of the airport: a descending airliner


class CrossAttention(nn.Module):
    """Latents attend to the input array, one head: softmax(q k^T) v with q from the (LayerNorm'd) latents, k, v from
    the input array; the 1/sqrt(d) scale forgotten (`fix`: restored, on q before the matmul)."""

    def __init__(self, fix=False):
        super().__init__()
        self.norm = nn.LayerNorm(D_PC)
        self.to_q, self.to_k, self.to_v = nn.Linear(D_PC, H_PC), nn.Linear(D_PC, H_PC), nn.Linear(D_PC, H_PC)
        self.to_out = nn.Linear(H_PC, D_PC)
        self.scale = H_PC ** -0.5 if fix else 1.0

    def forward(self, lat, x):
        q, k, v = self.to_q(self.norm(lat)), self.to_k(x), self.to_v(x)
        a = torch.softmax((q * self.scale) @ k.transpose(-1, -2), -1)
        return lat + self.to_out(a @ v)


class Perceiver(nn.Module):
    """Flight-track classifier: the ADS-B samples (position, speed, heading, climb rate, altitude, standardised by the
    loader) embedded with their time's Fourier features, NL_PC learned latents cross-attend, one latent MLP, mean-
    pooled head."""

    def __init__(self, fix=False):
        super().__init__()
        self.adapter = nn.Linear(F_PC + 8, D_PC)
        self.latents = nn.Parameter(torch.randn(NL_PC, D_PC, generator=gen(6250)) * 0.5)
        self.cross = CrossAttention(fix)
        self.mlp = nn.Sequential(nn.LayerNorm(D_PC), nn.Linear(D_PC, 2 * D_PC), nn.GELU(), nn.Linear(2 * D_PC, D_PC))
        self.head = nn.Linear(D_PC, 3)

    def forward(self, x, t, y):
        f = torch.arange(1, 5) * math.pi * t[..., None]
        x = self.adapter(torch.cat([x, torch.sin(f), torch.cos(f)], -1))
        lat = self.cross(self.latents.expand(x.shape[0], -1, -1), x)
        lat = lat + self.mlp(lat)
        return F.cross_entropy(self.head(lat.mean(1)).float(), y)


def pc_batch(i):
    """Tracks of T_PC samples (ENU position, speed, climb rate, heading), standardised by the loader; the class
    (climb / cruise / descent) in the climb-rate column. At BAD_AT a shard whose standardisation step was skipped: one
    track's position columns are raw ENU metres from the airport (an airliner descending from 42 km east, 36 km north,
    10,500 m up)."""
    g = gen(6260 + i)
    y = torch.randint(0, 3, (B_PC,), generator=g)
    x = torch.randn(B_PC, T_PC, F_PC, generator=g)
    x[..., 4] = (y[:, None] - 1).float() + 0.3 * x[..., 3]
    t = torch.linspace(0, 1, T_PC).expand(B_PC, -1)
    if i == BAD_AT:
        s = torch.linspace(0, 1, T_PC)
        x[2, :, :3] = torch.stack([ENU[0] - 9000 * s, ENU[1] - 7000 * s, ENU[2] - 3000 * s], -1)
    return (x, t, y), {}, None


def test_perceiver_unscaled_cross_attention_logits_overflow_on_raw_enu_metres(tmp_path):
    return check_failure(tmp_path, Perceiver, pc_batch, BAD_AT, "cross", FWD, lr=LR_PC,
                         quiet_at=("cross.to_q", "cross.to_k", "cross.to_v", "cross.to_out", "cross.norm", "adapter",
                                   "mlp", "mlp.0", "mlp.1", "mlp.3", "head", ""))


def test_twin_perceiver_with_the_scale_on_q_stays_quiet(tmp_path):
    twin(lambda: Perceiver(fix=True), pc_batch, 12, tmp_path, lr=LR_PC, skips=SKIPS_PC)


# ======================================================================================================================
# 4./8. an insurance-pricing net trained with the Tweedie deviance (compound Poisson-gamma, p = 1.5) written out
# ======================================================================================================================
F_TW, B_TW, LR_TW, P_TW, RAW_SI = 8, 256, 3e-2, 1.5, 105.0


class TweedieLoss(nn.Module):
    """The Tweedie negative log-likelihood (LightGBM / XGBoost's reg:tweedie objective) on the log-mean f:
    -y exp((1 - p) f) / (1 - p) + exp((2 - p) f) / (2 - p), in f's dtype. `fix`: in float32."""

    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, f, y):
        if self.fix:
            f = f.float()
        a, b = 1 - P_TW, 2 - P_TW
        return (-y * torch.exp(a * f) / a + torch.exp(b * f) / b).mean()


class PricingNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(F_TW, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.tweedie = TweedieLoss(fix)

    def forward(self, x, y):
        return self.tweedie(self.mlp(x)[:, 0], y)


def tw_batch(i):
    """Policies (standardised rating factors; column 2 the standardised log sum insured), claim cost per policy-year
    (mostly 0, gamma-sized claims). At BAD_AT a broker's bordereau whose sum insured arrived in raw $k (one policy of
    $480k) instead of the standardised log."""
    g = gen(6270 + i)
    x = torch.randn(B_TW, F_TW, generator=g)
    mu = torch.exp(-1.5 + 0.8 * x[:, 2] - 0.5 * x[:, 0])
    claim = torch.rand(B_TW, generator=g) < 0.3
    y = torch.where(claim, mu * 2 * torch.rand(B_TW, generator=g), torch.zeros(B_TW))
    if i == BAD_AT:
        x[5, 2] = RAW_SI
    return (x, y), {}, None



def test_tweedie_deviance_exp_of_the_log_mean_overflows_on_a_raw_sum_insured(tmp_path):
    return check_failure(tmp_path, PricingNet, tw_batch, BAD_AT, "tweedie", FWD, lr=LR_TW,
                         quiet_at=("mlp", "mlp.0", "mlp.2", "mlp.4", ""))


def test_twin_tweedie_deviance_in_fp32_stays_quiet(tmp_path):
    twin(lambda: PricingNet(fix=True), tw_batch, 12, tmp_path, lr=LR_TW, fall=FALL_TW, skips=SKIPS_TW)
