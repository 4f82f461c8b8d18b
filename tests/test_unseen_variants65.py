"""Sixty-fifth set: FP16 FAILURES IN ECG, BAYESIAN-DEEP-LEARNING, QUANT-FINANCE AND GENOMICS MODELS, on UNSAMPLED
steps (the default watch takes full statistics on step 0 and every 200th; every failure here starts between steps 13
and 16). No earlier probe file builds these families (grep of test_unseen_variants*.py: no ECG / Pan-Tompkins, no
sparse variational dropout / local reparameterisation, no deep hedging / entropic risk, no BPNet / count tracks).
Four fp16 failures and four healthy twins (the same model, the fix applied). Tiny models, fixed seeds, one intra-op
thread. Watched through the public API only (probe_harness.probe_run: `ampdoctor.watch(model, optimizer=AdamW,
scaler=GradScaler("cpu"), run_dir=tmp_path / "run")` at the default settings; CPU fp16 autocast, scale(loss).backward
-> unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`); every model computes its own loss.

Each failure is proven first by its own oracle: probe_harness.Producer with call counting (the first (module, step,
call) whose output is non-finite while its inputs, keyword inputs and own parameters were finite), the loss first
non-finite at that step, the scaler skipping it (bpnet: NOT skipping it, see 4; before it only the opening backoffs,
steps 0-2), the same run UNWATCHED giving bitwise the same losses (NaN = NaN), and the bad step's weights running the
bad batch in float32 (no autocast; fp16-stored data read as float32) to a finite loss. A failing oracle is a plain
failure. Only then must overflow / nan_origin be among the report's first three findings at the PRODUCER (an error,
at the oracle's step), with no overflow/nan_origin error at that step naming a module that only passed the value on;
a wrong report is a strict xfail (`wrong`).

 1. ecg: a rhythm classifier (tachycardia, rate > 100 bpm) on 2 s single-lead strips at 250 Hz with a Pan-Tompkins
    front end: a fixed FIR band-pass bank (`bandpass`, frozen), then `qrs`: the five-point derivative in mV/s
    (1/8T)(-x[n-2] - 2x[n-1] + 2x[n+1] + x[n+2]), squaring, the 150 ms moving-window integration, log1p. The strips
    are physical mV (derivative up to ~73 mV/s, squared ~5e3); at step 16 a batch from a second database arrives read
    as digital ADC units (1000 / mV; wfdb's physical=False), the derivative reaches 5.6e4 (still finite) and its
    square 3.1e9 is inf in fp16 -> overflow at `qrs` (not `bandpass`, `cls.0`). Fix: square and integrate in
    float32 (`d.float()`) (twin; the ADC batch's scaled backward overflows once: GradScaler skips step 16, info).
 2. svdo: sparse variational dropout (Molchanov et al. 2017, the authors' LinearSVDO: local reparameterisation,
    std = sqrt((x * x) @ exp(2 log_sigma) + 1e-8)) as the hidden layer `svd1` of a Huber regressor on meter data
    (deterministic `enc` before it, Linear `head` after it). At step 13 one household's three energy columns arrive in
    Wh, not kWh (~1e3): `enc` gives activations up to 1063 (finite), x * x > 65504 is inf in fp16 -> overflow at
    `svd1` (not `enc`, `head`). Fix: the variance path in float32 under autocast(enabled=False) (twin; the Wh row's
    scaled backward overflows once: step 13 skipped, info). The 1e-8 vanishing in fp16 is a second, true defect
    (eps_underflow) that this case does not require.
 3. hedge: deep hedging (Buehler et al. 2019) of a short 30-day ATM call (S0 = K = 100) under the entropic risk
    measure (1 / lam) log E[exp(-lam X)], lam = 0.5, written out in `risk`; the policy (delta = sigmoid(MLP(log(S /
    K), tau)), warm-started at delta ~ 0.73) trades on GBM paths simulated once and cached in fp16, so the P&L is
    fp16. Before step 15 -lam X stays below 5.5; at step 15 a stress batch (a quarter of the paths gap down 60% on
    day 12, a failed trial readout) gives -lam X ~ 20 and exp is inf in fp16 -> overflow at `risk` (not `policy.*`).
    Fix: torch.logsumexp(-lam X.float()) - log N (twin; the stress batch's scaled backward overflows once: step 15
    skipped, info).
 4. bpnet: BPNet (Avsec et al. 2021; bpnet-lite's MNLLLoss -lgamma(N + 1) + sum lgamma(k + 1) - sum k log p in
    `mnll`, plus the log-count MSE) on one-hot DNA windows whose read counts the track store keeps in fp16 (as
    Basenji's targets are stored). Window totals are ~350 reads; at step 15 a window in an unfiltered
    (ENCODE-blacklist) satellite repeat holds 20,128 reads: lgamma(20129) ~ 1.8e5 is inf in fp16, inf - inf = NaN
    -> overflow (or nan_origin) at `mnll` (not `profile`, `count`). The lgamma terms do not depend on the weights,
    so the gradients stay finite and GradScaler does NOT skip step 15: the logged loss is NaN (a NaN guard or early
    stopping ends the run) while the step is taken. Fix: the NLL in float32 (`counts.float()`) (twin).

Result when written (torch 2.13 CPU, default watch): 8 pass, 0 xfail. ampdoctor's first finding in each failing run:
 1. `[error] overflow at qrs aten::mul step 16: aten::mul in `qrs` produced +inf from finite inputs; it propagates
    to aten::convolution in `cls.0``
 2. `[error] overflow at svd1 aten::mul step 13: aten::mul in `svd1` produced +inf from finite inputs; it propagates
    to aten::addmm in `head`` (third: `[warning] eps_underflow at svd1 aten::add step 13`, the 1e-8: true)
 3. `[error] overflow at risk aten::exp step 15: ... (input up to 19.95; fp16 exp(x) is inf for x > 11.09)`
 4. `[error] overflow at mnll aten::lgamma step 15: aten::lgamma in `mnll` produced +inf from finite inputs; it
    propagates to aten::add in `mnll`` (no skipped_steps finding: right, nothing was skipped)
The twins' reports hold only info findings (the opening backoffs, and the one skip of each outlier batch's scaled
backward in twins 1-3).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants65.py
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import variant_named_at_producer, variant_twin_quiet
from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ======================================================================================================================
# 1. ECG rhythm classifier with a Pan-Tompkins QRS-energy front end
# ======================================================================================================================
ECG_BAD, ECG_FS, ECG_T, ECG_CH = 16, 250, 500, 4


def fir_bandpass(lo, hi, taps=31, fs=ECG_FS):
    """A Hamming-windowed sinc band-pass (lo..hi Hz), unit gain at the band's centre."""
    n = torch.arange(taps, dtype=torch.float64) - (taps - 1) / 2

    def lp(fc):
        return 2 * fc / fs * torch.sinc(2 * fc / fs * n)
    h = (lp(hi) - lp(lo)) * torch.hamming_window(taps, periodic=False, dtype=torch.float64)
    fc = (lo + hi) / 2
    gain = (h * torch.cos(2 * math.pi * fc / fs * n)).sum()
    return (h / gain).float()


class QRSEnergy(nn.Module):
    """Pan-Tompkins: the five-point derivative (in mV/s: (1/8T)(-x[n-2] - 2x[n-1] + 2x[n+1] + x[n+2])), squaring,
    the 150 ms moving-window integration, then log1p (the classifier's input)."""

    def __init__(self, fix=False):
        super().__init__()
        self.register_buffer("kern", torch.tensor([-1.0, -2.0, 0.0, 2.0, 1.0]) * (ECG_FS / 8))
        self.fix = fix

    def forward(self, x):
        c = x.shape[1]
        d = F.conv1d(x, self.kern.to(x.dtype).expand(c, 1, 5), padding=2, groups=c)
        if self.fix:
            d = d.float()
        e = F.avg_pool1d(d * d, 37, stride=1, padding=18)
        return torch.log1p(e)


class ECGNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.bandpass = nn.Conv1d(1, ECG_CH, 31, padding=15, bias=False)
        with torch.no_grad():
            for k, (lo, hi) in enumerate([(5, 15), (8, 20), (3, 10), (10, 25)]):
                self.bandpass.weight[k, 0] = fir_bandpass(lo, hi)
        self.bandpass.weight.requires_grad_(False)       # the fixed FIR filter bank of the Pan-Tompkins front end
        self.qrs = QRSEnergy(fix)
        self.cls = nn.Sequential(nn.Conv1d(ECG_CH, 16, 9, stride=4), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                                 nn.Linear(16, 2))

    def forward(self, x, y):
        return F.cross_entropy(self.cls(self.qrs(self.bandpass(x))).float(), y)


def ecg_batch(i):
    """Two-second single-lead strips (mV) at 250 Hz: Gaussian QRS (R 1.0-1.6 mV) and T waves, baseline wander,
    noise; the label is tachycardia (rate > 100 bpm). At ECG_BAD a batch from the second database, read as digital
    ADC units (1000 / mV) where the first gives physical mV."""
    g = gen(6510 + i % 6)
    b = 16
    hr = 50 + 100 * torch.rand(b, generator=g)
    t = torch.arange(ECG_T) / ECG_FS
    x = torch.zeros(b, ECG_T)
    for k in range(b):
        rr = 60 / float(hr[k])
        ph = float(torch.rand(1, generator=g)) * rr
        amp = 1.0 + 0.6 * float(torch.rand(1, generator=g))
        for c in torch.arange(ph - rr, 2 + rr, rr):
            x[k] += amp * torch.exp(-((t - c) / 0.012) ** 2 / 2) + 0.3 * torch.exp(-((t - c - 0.25) / 0.04) ** 2 / 2)
    x += 0.3 * torch.sin(2 * math.pi * 0.3 * t + 6.28 * torch.rand(b, 1, generator=g))
    x += 0.02 * torch.randn(b, ECG_T, generator=g)
    if i == ECG_BAD:
        x = x * 1000
    return (x[:, None], (hr > 100).long()), None


# ======================================================================================================================
# 2. sparse variational dropout (Molchanov et al. 2017): the local reparameterisation's x * x
# ======================================================================================================================
SV_BAD, SV_IN, SV_N = 13, 12, 4096


class LinearSVDO(nn.Module):
    """The authors' LinearSVDO (the variance of the local reparameterisation trick: sqrt((x * x) @ sigma^2 + 1e-8))."""

    def __init__(self, i, o, fix=False):
        super().__init__()
        self.W = nn.Parameter(torch.empty(o, i))
        nn.init.xavier_uniform_(self.W)
        self.log_sigma = nn.Parameter(torch.full((o, i), -5.0))
        self.bias = nn.Parameter(torch.zeros(o))
        self.fix = fix

    def forward(self, x):
        mean = F.linear(x, self.W, self.bias)
        if self.fix:
            with torch.autocast("cpu", enabled=False):
                var = F.linear(x.float() * x.float(), torch.exp(self.log_sigma * 2.0))
        else:
            var = F.linear(x * x, torch.exp(self.log_sigma * 2.0))
        std = torch.sqrt(var + 1e-8)
        return mean + std * torch.randn_like(std)

    def kl(self):
        log_alpha = torch.clamp(2 * self.log_sigma - torch.log(1e-8 + self.W ** 2), -10, 10)
        k1, k2, k3 = 0.63576, 1.8732, 1.48695
        return -(k1 * torch.sigmoid(k2 + k3 * log_alpha) - 0.5 * torch.log1p(torch.exp(-log_alpha)) - k1).sum()


class SVDONet(nn.Module):
    """A deterministic feature layer, then two sparse-VD layers (a Bayesian last-layers regressor, Huber loss)."""

    def __init__(self, fix=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(SV_IN, 64), nn.ReLU())
        self.svd1 = LinearSVDO(64, 64, fix)
        self.head = nn.Linear(64, 1)

    def forward(self, x, y):
        out = self.head(F.relu(self.svd1(self.enc(x)))).squeeze(-1)
        return F.huber_loss(out.float(), y) + 0.1 * self.svd1.kl() / SV_N


SV_W = torch.randn(SV_IN, generator=gen(6502)) * 0.5


def sv_batch(i):
    """Standardised meter features, target a smooth function of them; at SV_BAD one household's three energy
    columns arrive in Wh where the rest are kWh (x 1000)."""
    g = gen(6520 + i % 6)
    x = torch.randn(64, SV_IN, generator=g)
    y = torch.tanh(x @ SV_W) + 0.1 * (x[:, 0] * x[:, 1])
    if i == SV_BAD:
        x = x.clone()
        x[7, :3] = x[7, :3].abs() * 1000 + 500
    return (x, y), None


# ======================================================================================================================
# 3. deep hedging (Buehler et al. 2019) under the entropic risk measure, paths cached in fp16
# ======================================================================================================================
DH_BAD, DH_T, DH_K, DH_LAM, DH_B = 15, 30, 100.0, 0.5, 128


class EntropicRisk(nn.Module):
    """rho(X) = (1 / lam) log E[exp(-lam X)] of the hedged P&L X, written out."""

    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, pnl):
        if self.fix:
            return (torch.logsumexp(-DH_LAM * pnl.float(), 0) - math.log(pnl.shape[0])) / DH_LAM
        return torch.log(torch.exp(-DH_LAM * pnl).mean()) / DH_LAM


class DeepHedge(nn.Module):
    """A short call hedged in the underlying: delta_t = sigmoid(MLP(log(S_t / K), tau_t))."""

    def __init__(self, fix=False):
        super().__init__()
        self.policy = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        nn.init.constant_(self.policy[4].bias, 1.0)      # warm start: delta ~ 0.73, the desk's old static hedge
        self.risk = EntropicRisk(fix)

    def forward(self, s):
        tau = torch.linspace(DH_T, 1, DH_T).to(s.dtype).expand(s.shape[0], DH_T) / 365
        feat = torch.stack([torch.log(s[:, :-1] / DH_K), tau], -1)
        delta = torch.sigmoid(self.policy(feat).squeeze(-1))
        pnl = (delta * (s[:, 1:] - s[:, :-1])).sum(-1) - F.relu(s[:, -1] - DH_K)
        return self.risk(pnl).float()


def dh_batch(i):
    """Daily GBM paths (S0 = K = 100, vol 20%, 30 days), simulated once and cached in fp16. At DH_BAD a
    stress-scenario batch: a quarter of the paths gap down 60% overnight on day 12 (a failed trial readout)."""
    g = gen(6530 + i % 6)
    z = torch.randn(DH_B, DH_T, generator=g)
    r = 0.2 * math.sqrt(1 / 365) * z - 0.5 * 0.04 / 365
    if i == DH_BAD:
        r = r.clone()
        r[: DH_B // 4, 12] += math.log(0.4)
    s = DH_K * torch.exp(torch.cat([torch.zeros(DH_B, 1), r.cumsum(1)], 1))
    return (s.half(),), None


# ======================================================================================================================
# 4. BPNet (Avsec et al. 2021) on fp16-stored count tracks: the multinomial NLL's lgamma
# ======================================================================================================================
BP_BAD, BP_L = 15, 200


class MNLL(nn.Module):
    """bpnet-lite's MNLLLoss: -lgamma(N + 1) + sum lgamma(k + 1) - sum k log p, per window."""

    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, logps, counts):
        if self.fix:
            logps, counts = logps.float(), counts.float()
        log_fact_sum = torch.lgamma(counts.sum(-1) + 1)
        log_prod_fact = torch.lgamma(counts + 1).sum(-1)
        log_prod_exp = (counts * logps).sum(-1)
        return -log_fact_sum + log_prod_fact - log_prod_exp


class BPNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.stem = nn.Conv1d(4, 16, 9, padding=4)
        self.dil = nn.ModuleList([nn.Conv1d(16, 16, 3, padding=d, dilation=d) for d in (2, 4)])
        self.profile = nn.Conv1d(16, 1, 15, padding=7)
        self.count = nn.Linear(16, 1)
        nn.init.constant_(self.count.bias, 5.0)            # the mean log count of the training windows
        self.mnll = MNLL(fix)

    def forward(self, seq, counts):
        h = F.relu(self.stem(seq))
        for c in self.dil:
            h = h + F.relu(c(h))
        logps = F.log_softmax(self.profile(h).squeeze(1), -1)
        prof = self.mnll(logps, counts).mean()
        logn = self.count(h.mean(-1)).squeeze(-1)
        cnt = F.mse_loss(logn.float(), torch.log1p(counts.float().sum(-1)))
        return (prof / BP_L + cnt).float()


BP_MOTIF = torch.tensor([0, 2, 1, 3, 3, 1, 2, 0])


def bp_batch(i):
    """One-hot DNA windows with a planted motif whose position gives the read pile-up, counts as the track store
    keeps them (fp16). At BP_BAD a window from an unfiltered (ENCODE-blacklist) satellite repeat: 20,000 reads."""
    g = gen(6540 + i % 6)
    b = 16
    idx = torch.randint(0, 4, (b, BP_L), generator=g)
    pos = torch.randint(20, BP_L - 28, (b,), generator=g)
    for k in range(b):
        idx[k, pos[k]:pos[k] + 8] = BP_MOTIF
    seq = F.one_hot(idx, 4).transpose(1, 2).float()
    depth = 50 + 300 * torch.rand(b, 1, generator=g)
    if i == BP_BAD:
        depth[3] = 20000
    centre = (pos + 4).float()[:, None]
    rate = torch.exp(-((torch.arange(BP_L) - centre) / 6) ** 2 / 2) + 0.02
    rate = depth * rate / rate.sum(-1, keepdim=True)
    counts = torch.poisson(rate, generator=g)
    return (seq, counts.half()), None


CASES = {
    "ecg": dict(make=ECGNet, batch=ecg_batch, bad=ECG_BAD, name="qrs", call=1, twin_skips=(ECG_BAD,)),
    "svdo": dict(make=SVDONet, batch=sv_batch, bad=SV_BAD, name="svd1", call=1, twin_skips=(SV_BAD,)),
    "hedge": dict(make=DeepHedge, batch=dh_batch, bad=DH_BAD, name="risk", call=1, lr=3e-3, twin_skips=(DH_BAD,)),
    "bpnet": dict(make=BPNet, batch=bp_batch, bad=BP_BAD, name="mnll", call=1, lr=3e-3, skips=False),
}


@pytest.mark.parametrize("key", list(CASES))
def test_failure_named_at_the_producer(tmp_path, key):
    variant_named_at_producer(CASES[key], tmp_path, debug=DEBUG)


@pytest.mark.parametrize("key", list(CASES))
def test_twin_with_the_fix_stays_quiet(tmp_path, key):
    variant_twin_quiet(CASES[key], tmp_path, debug=DEBUG)
