"""bf16 training failures that the earlier bf16 probes (test_bf16_probe, test_bf16_training, test_bf16_unseen,
test_half_in_bf16, test_unseen_variants13/17/28/42, test_integer_precision, test_integer_features_autocast) do not
build, each with a healthy twin (the fix applied): 8 tests.

Watched through the public API only: `ampdoctor.watch(model, optimizer=AdamW, scaler=None, run_dir=tmp_path/"run")`
around a plain bf16 loop (zero_grad -> forward + loss under `torch.autocast("cpu", dtype=torch.bfloat16)` -> backward
-> step), `w.close()`, `w.report()`. Tiny CPU models, fixed seeds, one intra-op thread. Every run is repeated
unwatched from the same weights: the losses must be bitwise identical (the watch changes nothing).

Each failure is proven first by its own oracle, independent of ampdoctor (a failing oracle is a plain failure, never
an xfail): the same module and weights in fp32 against bf16, and/or an fp32 twin (the same loop without autocast) on
the same batches. Only then must the contract's rule be among the report's first three findings, as a warning or an
error, at the module named (a wrong report raises WrongAnswer: strict xfail via probe_harness.wrong).

Failures (cases, oracle, what is accepted):
 F1. a GeoCLIP-style location encoder: random Fourier features of raw GPS degrees (lat ~40.75, lon ~-73.97, spread
     +-0.06) through a frozen Linear(2, 32) (frequencies 2 pi * 8 / degree) under autocast. autocast casts the
     degrees to bf16 (ulp 0.25 / 0.5 there: ~3 and 1 distinct values left of ~250) and the phases (~2000 rad) have
     a bf16 ulp of 8-16 rad. Oracle: the same module in fp32 vs bf16 differs by > 1 (sin/cos are noise), and the
     fp32 twin's loss ends < 1/5 of the bf16 run's. Fix (twin): the projection under `autocast(enabled=False)`.
     Accepted: precision_loss at `geo` or `geo.proj` (where the degrees and phases lose their digits).
 F2. a pretrained binary classifier ending in `nn.Sigmoid()` + `nn.BCELoss`, fine-tuned under autocast after a
     policy change flips the labels of a region it is confident about (|logit| ~9). In bf16 sigmoid(z) == 1.0 for
     z > 6.24 (fp32 keeps 1 - 1e-4), BCELoss clamps log(0) to -100 and sigmoid's backward p (1 - p) is exactly 0:
     the confidently wrong samples get no gradient. Oracle: > 50% of the samples relabelled 1 -> 0 get a per-sample
     gradient of exactly 0 in bf16 (65%; fp32: < 10%, 3%), the loss after 100 steps is > 3x the fp32 twin's (11.2
     against 2.1; measured while writing: at lr 3e-3 over 200 steps the bf16 run catches up, as the shared weights'
     drift brings those logits below 6.24: a stall of the relabelled samples, not a permanent stop). Fix: no Sigmoid
     module, BCEWithLogitsLoss. Accepted: precision_loss at `prob` (the module whose
     bf16 output rounds to exactly 1).
 F3. a discrete-time survival model (520 weekly bins, weekly hazards ~5e-4..1e-3): hazards = sigmoid(head) and the
     survival curve S = cumprod(1 - h) in the `surv` module, under autocast. 1 - 5e-4 == 1.0 in bf16, so S stays ~1:
     the 10-year survival the model reports is ~0.98 where the same weights in fp32 give ~0.65 (the data: ~0.72), and
     the logged NLL is too low. Oracle: the bf16 vs fp32 S(10y) on the trained weights (> 0.2 apart), and the bf16
     loss below the fp32 twin's (the likelihood is wrong, not better). Fix: S = exp(cumsum(logsigmoid(-z))) in fp32.
     Accepted: precision_loss at `surv`.
 F4. an ArcFace head whose "safe" clamp `cos.clamp(-1 + 1e-3, 1 - 1e-3)` (1e-3 is fine in fp16: 0.999 exists there)
     runs on bf16 cosines: 1 - 1e-3 is 1.0 in bf16 (ulp 2^-8 below 1), the clamp does nothing, the imprinted
     classes' enrolled samples reach cos == 1.0 and acos' = -1/sqrt(0) = -inf in the backward. Oracle: the bound is
     1.0 in bf16 and 0.999 in fp32; the bf16 run's gradients turn non-finite from finite inputs and losses (the fp32
     twin stays finite). Fix: clamp and acos on `cos.float()`. Accepted: eps_underflow (the vanished bound), overflow
     or nan_origin at `arc`.
Twins: no warning, no error, and the run trains (loss falls / the oracle is clean).

Result when written (torch 2.13 CPU; two runs identical, ~12 s): 5 pass, 3 strict xfail (WrongAnswer only).
 F1 XFAIL the report is empty (top3 = []). Truth: bf16 keeps 3 / 1 distinct latitudes / longitudes of 256 / 252,
    the Fourier features are off by up to 2.0, the loss stalls at 0.87 (fp32 twin 0.053). Likely why: the integer
    probe of a Linear's fp32 input under autocast (record/stats.py cast_in) looks for integers only; these degrees
    are fractional and nothing goes non-finite, so no replay against fp32 is made.
 F2 XFAIL the report is empty (top3 = []). Truth: sigmoid's bf16 output is exactly 1.0 for 65% of the relabelled
    samples, their gradient is exactly 0, the loss after 100 steps is 11.2 against the fp32 twin's 2.1.
 F3 XFAIL the report is empty (top3 = []). Truth: S(10 years) 0.98 in bf16 against 0.65 for the same weights in
    fp32 (data ~0.72); the logged NLL 1.72 is below the fp32 twin's 2.09 because log S is ~0.
 F4 PASS  top3: `[error] overflow at arc aten::rsqrt step 0: the backward of AcosBackward0 in `arc` (aten::rsqrt)
    produced +inf from finite gradients ...`, `[error] eps_underflow at arc aten::clamp step 0: aten::clamp in `arc`
    uses the bound -0.999 (1 - 1e-03), which rounds to exactly -1 in bfloat16 ... the guard does nothing` (right;
    it quotes the lower bound, the upper one 0.999 -> 1.0 is the one that fires). Only two findings. Since
    (replay/constants._reached counts a bound's values on its own side): it quotes the bound 0.999.
 Twins T1-T4: quiet (no warning, no error), bitwise identical watched / unwatched, the loss falls.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import WrongAnswer, wrong
from scenarios import alarms, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
BF16 = torch.bfloat16


# ======================================================================================================================
# the loop and the checks
# ======================================================================================================================
def bf16_loop(m, batch, loss_fn, steps, *, lr=1e-3, autocast=True, run_dir=None):
    """zero_grad -> forward + loss (bf16 CPU autocast when `autocast`) -> backward -> AdamW step, watched when
    `run_dir` is given (scaler=None). `batch(i)` gives step i's (inputs, target). Returns (report or None, losses,
    finite: whether every gradient stayed finite)."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    w = ampdoctor.watch(m, optimizer=opt, scaler=None, run_dir=run_dir) if run_dir is not None else None
    losses, grads_finite = [], True
    try:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            x, y = batch(i)
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                loss = loss_fn(m(x), y)
            loss.backward()
            grads_finite &= all(bool(p.grad.isfinite().all()) for p in m.parameters() if p.grad is not None)
            opt.step()
            losses.append(loss.item())
    finally:
        if w is not None:
            w.close()
    return (w.report() if w is not None else None), losses, grads_finite


def watched_and_plain(make, batch, loss_fn, steps, tmp_path, **kw):
    """The watched bf16 run and the same run unwatched (same weights): the losses must be bitwise identical."""
    rep, losses, ok = bf16_loop(make(), batch, loss_fn, steps, run_dir=str(tmp_path / "run"), **kw)
    _, plain, ok2 = bf16_loop(make(), batch, loss_fn, steps, **kw)
    assert [struct_bits(v) for v in losses] == [struct_bits(v) for v in plain], "the watch changed the run"
    assert ok == ok2
    return rep, losses, ok


def struct_bits(v):
    return torch.tensor(v, dtype=torch.float64).view(torch.int64).item() if math.isfinite(v) else repr(v)


def top3(rep):
    return [f.one_line()[:240] for f in rep.findings[:3]]


def named(rep, rules, modules):
    """One of `rules` at one of `modules` among the first three findings, as a warning or error; else WrongAnswer."""
    hit = [f for f in rep.findings[:3]
           if f.rule in rules and f.module in modules and f.severity in ("warning", "error")]
    if not hit:
        raise WrongAnswer(f"want {rules} at one of {sorted(modules)}; top3={top3(rep)}")
    return hit[0]


def quiet(rep):
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy run: {alarms(rep.findings)[:3]}")


def mean(v):
    return sum(v) / len(v)


# ======================================================================================================================
# F1. random Fourier features of raw GPS degrees through a frozen Linear under bf16 autocast
# ======================================================================================================================
CENTER, SPREAD = torch.tensor([40.75, -73.97]), torch.tensor([0.06, 0.05])


class GeoEncoder(nn.Module):
    """GeoCLIP-style: [sin, cos](2 pi B c) with c = (lat, lon) in degrees, B ~ N(0, 8^2) per degree (a frozen
    Linear). `fp32`: the projection runs with autocast disabled (the fix)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.proj = nn.Linear(2, 32, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(32, 2, generator=torch.Generator().manual_seed(7)) * 2 * math.pi * 8)
        self.proj.weight.requires_grad_(False)
        self.fp32 = fp32

    def forward(self, c):
        if self.fp32:
            with torch.autocast("cpu", enabled=False):
                z = self.proj(c.float())
        else:
            z = self.proj(c)
        return torch.cat([z.sin(), z.cos()], -1)


class FareNet(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.geo = GeoEncoder(fp32)
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, c):
        return self.mlp(self.geo(c))


def geo_batch(i):
    """Pickup points around midtown in raw degrees; the target: a smooth price surface over the city."""
    g = torch.Generator().manual_seed(3000 + i)
    c = CENTER + SPREAD * torch.randn(256, 2, generator=g)
    d = (c - CENTER) / SPREAD
    return c, (torch.sin(2 * d[:, 0]) + torch.cos(1.5 * d[:, 1]))[:, None]


def make_fare(fp32=False):
    torch.manual_seed(0)
    return FareNet(fp32)


@wrong("empty report; want precision_loss at geo / geo.proj: the raw GPS degrees (~40.75, ~-73.97) become bf16 in "
       "the frozen Fourier Linear under autocast (ulp 0.25 / 0.5: 3 and 1 distinct values left), the phases are "
       "noise; silent: fractional inputs, nothing non-finite")
def test_f1_gps_degrees_through_fourier_linear(tmp_path):
    m = make_fare()
    c, _ = geo_batch(0)
    with torch.no_grad():
        ref = m.geo(c)
        with torch.autocast("cpu", dtype=BF16):
            low = m.geo(c).float()
    assert (low - ref).abs().max().item() > 1.0 and (low - ref).abs().mean().item() > 0.4
    assert c[:, 1].bfloat16().unique().numel() <= 3 and c[:, 1].unique().numel() > 200
    rep, losses, _ = watched_and_plain(make_fare, geo_batch, F.mse_loss, 150, tmp_path)
    _, fp32, _ = bf16_loop(make_fare(), geo_batch, F.mse_loss, 150, autocast=False)
    assert mean(fp32[-10:]) < 0.2 * mean(losses[-10:]), (mean(fp32[-10:]), mean(losses[-10:]))
    named(rep, ("precision_loss",), {"geo", "geo.proj"})


def test_t1_gps_fourier_projection_in_fp32(tmp_path):
    rep, losses, _ = watched_and_plain(lambda: make_fare(fp32=True), geo_batch, F.mse_loss, 150, tmp_path)
    assert mean(losses[-10:]) < 0.2 * mean(losses[:5]), losses
    quiet(rep)


# ======================================================================================================================
# F2. nn.Sigmoid + nn.BCELoss under bf16 autocast: confidently wrong samples get exactly zero gradient
# ======================================================================================================================
U = torch.randn(16, generator=torch.Generator().manual_seed(9))
V = torch.randn(16, generator=torch.Generator().manual_seed(10))


class Classifier(nn.Module):
    def __init__(self, logits=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)
        self.prob = nn.Identity() if logits else nn.Sigmoid()

    def forward(self, x):
        return self.prob(self.head(self.body(x)))


def clf_batch(i, drift=True):
    """The old labels sign(x.U); after the policy change the region x.V > 1 (~40% of samples) is flipped."""
    g = torch.Generator().manual_seed(4000 + i)
    x = torch.randn(256, 16, generator=g)
    y = (x @ U > 0).float()
    if drift:
        y = torch.where(x @ V > 1.0, 1 - y, y)
    return x, y[:, None]


_PRETRAINED = {}


def pretrained(logits=False):
    """A classifier pretrained in fp32 on the old labels (confident: median |logit| ~9)."""
    if "m" not in _PRETRAINED:
        torch.manual_seed(0)
        m = Classifier(logits=True)
        opt = torch.optim.Adam(m.parameters(), lr=3e-3)
        for i in range(300):
            x, y = clf_batch(10000 + i, drift=False)
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(m(x), y).backward()
            opt.step()
        _PRETRAINED["m"] = m
    m = copy.deepcopy(_PRETRAINED["m"])
    m.prob = nn.Identity() if logits else nn.Sigmoid()
    return m


def zero_grad_share(m, autocast):
    """Share of the samples relabelled 1 -> 0 (the old model says p ~ 1) whose per-sample gradient w.r.t. the head's
    output is exactly 0."""
    x, y = clf_batch(0)
    flip = (x @ V > 1.0) & (x @ U > 0)
    z = m.body(x)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        logit = m.head(z).detach().requires_grad_(True)
        loss = F.binary_cross_entropy(m.prob(logit), y, reduction="sum")
    g, = torch.autograd.grad(loss, logit)
    return (g[flip] == 0).float().mean().item()


@wrong("empty report; want precision_loss at prob: nn.Sigmoid's bf16 output is exactly 1.0 for logits > 6.24, "
       "BCELoss clamps log(0) to -100 and sigmoid's backward p (1 - p) is exactly 0, so the confidently wrong "
       "(relabelled) samples get no gradient; silent: the loss is finite (the -100 clamp), nothing non-finite")
def test_f2_sigmoid_bceloss_saturates_in_bf16(tmp_path):
    m = pretrained()
    assert zero_grad_share(m, autocast=True) > 0.5 and zero_grad_share(m, autocast=False) < 0.1
    rep, losses, ok = watched_and_plain(pretrained, clf_batch, F.binary_cross_entropy, 100, tmp_path)
    _, fp32, _ = bf16_loop(pretrained(), clf_batch, F.binary_cross_entropy, 100, autocast=False)
    assert ok and all(map(math.isfinite, losses))
    assert mean(losses[-5:]) > 3 * mean(fp32[-5:]), (mean(losses[-5:]), mean(fp32[-5:]))
    named(rep, ("precision_loss",), {"prob"})


def test_t2_bce_with_logits(tmp_path):
    rep, losses, ok = watched_and_plain(lambda: pretrained(logits=True), clf_batch,
                                        F.binary_cross_entropy_with_logits, 100, tmp_path)
    _, fp32, _ = bf16_loop(pretrained(logits=True), clf_batch, F.binary_cross_entropy_with_logits, 100,
                           autocast=False)
    assert ok and mean(losses[-5:]) < 0.6 * mean(losses[:5]), losses
    assert abs(mean(losses[-5:]) - mean(fp32[-5:])) < 0.1 * mean(fp32[-5:])
    quiet(rep)


# ======================================================================================================================
# F3. discrete-time survival: S = cumprod(1 - h) with weekly hazards ~5e-4 in bf16
# ======================================================================================================================
T_BINS = 520
B_RISK = torch.randn(8, generator=torch.Generator().manual_seed(3))


class SurvivalCurve(nn.Module):
    """(hazards, survival) from the per-bin logits. `fp32`: S = exp(cumsum(logsigmoid(-z))) in fp32 (the fix)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, z):
        if self.fp32:
            z = z.float()
            return torch.sigmoid(z), torch.exp(torch.cumsum(F.logsigmoid(-z), 1))
        h = torch.sigmoid(z)
        return h, torch.cumprod(1 - h, dim=1)


class SurvNet(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, T_BINS)
        with torch.no_grad():
            self.head.bias.fill_(-6.0)
        self.surv = SurvivalCurve(fp32)

    def forward(self, x):
        return self.surv(self.head(self.body(x)))


def surv_batch(i):
    """Exponential event times with weekly hazard 5e-4 * exp(risk / 2), censored at 10 years (520 weeks)."""
    g = torch.Generator().manual_seed(5000 + i)
    x = torch.randn(256, 8, generator=g)
    rate = 5e-4 * torch.exp(0.5 * (x @ B_RISK) / B_RISK.norm())
    t = (-torch.log(torch.rand(256, generator=g)) / rate).long()
    return x, torch.stack([t.clamp(max=T_BINS - 1).float(), (t < T_BINS).float()], 1)


def surv_nll(out, y):
    """The discrete-time likelihood: events log h_t + log S_{t-1}, censored log S_t."""
    h, S = out
    t, ev = y[:, 0].long(), y[:, 1]
    s_prev = torch.where(t > 0, S.gather(1, (t - 1).clamp(min=0)[:, None])[:, 0], torch.ones_like(S[:, 0]))
    ll = ev * (torch.log(h.gather(1, t[:, None])[:, 0]) + torch.log(s_prev)) + (1 - ev) * torch.log(
        S.gather(1, t[:, None])[:, 0])
    return -ll.float().mean()


def make_surv(fp32=False):
    torch.manual_seed(0)
    return SurvNet(fp32)


@wrong("empty report; want precision_loss at surv: 1 - h with weekly hazards ~5e-4 is 1.0 in bf16, cumprod keeps "
       "the survival curve at ~0.98 after 10 years where the same weights in fp32 give ~0.65; silent: nothing "
       "non-finite, no integers")
def test_f3_survival_cumprod_of_one_minus_hazard_in_bf16(tmp_path):
    rep, losses, _ = watched_and_plain(make_surv, surv_batch, surv_nll, 60, tmp_path, lr=3e-3)
    m = make_surv()
    _, _, _ = bf16_loop(m, surv_batch, surv_nll, 60, lr=3e-3)
    _, fp32, _ = bf16_loop(make_surv(), surv_batch, surv_nll, 60, lr=3e-3, autocast=False)
    x, _ = surv_batch(999)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=BF16):
            s_bf16 = m(x)[1][:, -1].float().mean().item()
        s_fp32 = SurvivalCurve(fp32=True)(m.head(m.body(x)))[1][:, -1].mean().item()
    assert s_bf16 > 0.9 and s_bf16 - s_fp32 > 0.2, (s_bf16, s_fp32)
    assert mean(losses[-5:]) < 0.9 * mean(fp32[-5:]), (losses[-5:], fp32[-5:])   # a wrong, too-low likelihood
    named(rep, ("precision_loss",), {"surv"})


def test_t3_survival_log_space_in_fp32(tmp_path):
    rep, losses, _ = watched_and_plain(lambda: make_surv(fp32=True), surv_batch, surv_nll, 60, tmp_path, lr=3e-3)
    _, fp32, _ = bf16_loop(make_surv(fp32=True), surv_batch, surv_nll, 60, lr=3e-3, autocast=False)
    assert mean(losses[-5:]) < 0.8 * mean(losses[:5]), losses
    assert abs(mean(losses[-5:]) - mean(fp32[-5:])) < 0.05 * mean(fp32[-5:])
    quiet(rep)


# ======================================================================================================================
# F4. ArcFace's clamp(-1 + 1e-3, 1 - 1e-3) on bf16 cosines: the bound is 1.0, acos' = -inf
# ======================================================================================================================
N_ID, D_IN, D_EMB = 10, 32, 64
PROTO = torch.randn(N_ID, D_IN, generator=torch.Generator().manual_seed(21))


class ArcMargin(nn.Module):
    """logits = s * cos(acos(clamp(cos)) + m * onehot). `fp32`: the clamp and acos on cos.float() (the fix)."""

    def __init__(self, s=30.0, m=0.3, eps=1e-3, fp32=False):
        super().__init__()
        self.s, self.m, self.eps, self.fp32 = s, m, eps, fp32

    def forward(self, cos, y):
        if self.fp32:
            cos = cos.float()
        theta = torch.acos(cos.clamp(-1 + self.eps, 1 - self.eps))        # "safe": acos' is finite inside
        return self.s * torch.cos(theta + self.m * F.one_hot(y, cos.shape[-1]))


class FaceNet(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, D_EMB))
        self.centers = nn.Parameter(torch.randn(N_ID, D_EMB))
        self.arc = ArcMargin(fp32=fp32)

    def forward(self, xy):
        x, y = xy
        cos = F.linear(F.normalize(self.backbone(x), dim=-1), F.normalize(self.centers, dim=-1))
        return self.arc(cos, y)


def face_batch(i):
    """Each step: the enrolled photo of every identity (the imprinting sample) plus noisy new photos."""
    g = torch.Generator().manual_seed(6000 + i)
    y = torch.cat([torch.arange(N_ID), torch.randint(0, N_ID, (54,), generator=g)])
    x = PROTO[y] + 0.3 * torch.randn(64, D_IN, generator=g)
    x[:N_ID] = PROTO
    return (x, y), y


def make_face(fp32=False):
    """Class centres imprinted from the enrolled photos' embeddings (weight imprinting)."""
    torch.manual_seed(0)
    m = FaceNet(fp32)
    with torch.no_grad():
        m.centers.copy_(m.backbone(PROTO))
    return m


def arc_loss(logits, y):
    return F.cross_entropy(logits.float(), y)


def test_f4_arcface_clamp_bound_vanishes_in_bf16(tmp_path):
    assert torch.tensor(1 - 1e-3, dtype=BF16).item() == 1.0 and torch.tensor(1 - 1e-3).item() < 1.0
    rep, losses, ok = watched_and_plain(make_face, face_batch, arc_loss, 20, tmp_path)
    _, fp32, ok32 = bf16_loop(make_face(), face_batch, arc_loss, 20, autocast=False)
    assert ok32 and all(map(math.isfinite, fp32))
    assert not ok and math.isfinite(losses[0])                    # finite forward, non-finite gradients in bf16
    named(rep, ("eps_underflow", "overflow", "nan_origin"), {"arc"})


def test_t4_arcface_clamp_in_fp32(tmp_path):
    rep, losses, ok = watched_and_plain(lambda: make_face(fp32=True), face_batch, arc_loss, 20, tmp_path)
    assert ok and all(map(math.isfinite, losses)) and mean(losses[-3:]) < 0.7 * mean(losses[:3]), losses
    quiet(rep)
