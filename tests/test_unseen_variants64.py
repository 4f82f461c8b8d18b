"""Sixty-fourth set: FP16 FAILURES IN MEMORY, METRIC-LEARNING, RL AND MOLECULAR MODELS, on UNSAMPLED steps (the
default watch takes full statistics on step 0 and every 200th; every failure here starts between steps 9 and 25).
Four fp16 failures and four healthy twins (the same model, the fix applied). Tiny models, fixed seeds, one intra-op
thread. Watched through the public API only (probe_harness.probe_run: `ampdoctor.watch(model, optimizer=AdamW,
scaler=GradScaler("cpu"), run_dir=tmp_path / "run")` at the default settings; CPU fp16 autocast, scale(loss).backward
-> unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`); every model computes its own loss.

Each failure is proven first by its own oracle: probe_harness.Producer with call counting (the first (module, step,
call) whose output is non-finite while its inputs, keyword inputs and own parameters were finite), the loss first
non-finite at that step, the scaler skipping it (before it only the opening backoffs, steps 0-2), the same run
UNWATCHED giving bitwise the same losses (NaN = NaN), and the bad step's weights running the bad batch in float32
(no autocast) to a finite loss. A failing oracle is a plain failure. Only then must overflow / nan_origin be among
the report's first three findings at the PRODUCER (an error, at the oracle's step), with no overflow/nan_origin error
at that step naming a module that only passed the value on; a wrong report is a strict xfail (`wrong`).

 1. ntm: a Neural-Turing-Machine-style read head (content addressing softmax(beta * cos(k, M)), then Graves'
    sharpening w^gamma / sum w^gamma with gamma = 1 + softplus(.) ~ 3.1) over an episode memory of 4 slots; at
    step 14 an episode with a 2048-slot memory arrives: the content weights are ~1/2048, w^gamma ~ 1e-9
    flushes to 0 in fp16 for every slot and 0 / 0 = NaN -> nan_origin at `head` (not `ctrl`, `head.gamma`, `out`).
    Fix: sharpening in log space in float32, softmax(gamma * log_softmax(beta * cos)) (twin).
 2. adacos: AdaCos (Zhang et al. 2019; the adaptive scale s = log(B_avg) / cos(min(pi/4, theta_med)) updated in the
    forward under no_grad, B_avg = sum over the batch of exp(s * cos) of the non-target classes, / batch size, as
    the popular port writes it) on 256 identities; a batch-size ramp-up (16 -> 128, as the recipe's warmup ends)
    at step 17 makes the fp16 SUM pass 65504 before the division: s = inf, logits inf/NaN -> overflow (or
    nan_origin) at `adacos`. Fix: B_avg in float32 (`logits.float()`) (twin).
 3. soft_q: soft Q-learning (entropy-regularised DQN) whose soft value V(s') = alpha * log(sum_a exp(Q(s', a) /
    alpha)) is written out by hand in `soft_v`; the temperature alpha is annealed 0.5 * 0.85^t to a floor: once
    max Q / alpha passes 11.09 the fp16 exp is inf -> overflow at `soft_v` (not `q`), step 11. Fix:
    alpha * torch.logsumexp(Q / alpha) (twin).
 4. lj_prior: a coarse-grained force field (CGnet-style: a learned pair MLP on RBF distances + an analytic
    Lennard-Jones prior eps((sigma/r)^12 - (sigma/r)^6), sigma = 3.4 A) on trajectories stored in fp16; at step
    11 one frame (a high-temperature replica) has two beads 1.25 A apart: (sigma/r)^12 = 1.6e5 (float32) is inf
    in fp16 -> overflow at `prior` (not `pair`, not the root). Fix: the prior in float32 (r.float()) (twin).

Result when written: 8 pass, 0 xfail. ampdoctor's first finding in each failing run:
 1. `[error] nan_origin at head aten::div step 14: aten::div in `head` hit its singular point ... produced NaN`
 2. `[error] overflow at adacos aten::sum step 17: aten::sum in `adacos` produced +inf from finite inputs`
    (third: `[warning] eps_underflow at adacos aten::clamp_min`, F.normalize's 1e-12 in fp16: true, and secondary)
 3. `[error] overflow at soft_v aten::exp step 11: ... (input up to 14.44; fp16 exp(x) is inf for x > 11.09)`
 4. `[error] overflow at prior aten::pow step 11: ... (input up to 2.719; in fp16 x**12 is inf for |x| > 2.52)`
The twins' reports hold only info findings (the opening backoffs of the LJ model's scaler, steps 0-2).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants64.py
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
# 1. NTM-style read head: content addressing + sharpening
# ======================================================================================================================
NTM_BAD, NTM_SLOTS, NTM_LONG, NTM_DM, NTM_NC = 14, 4, 2048, 8, 4


class ReadHead(nn.Module):
    def __init__(self, d, fix=False):
        super().__init__()
        self.key, self.beta, self.gamma = nn.Linear(d, NTM_DM), nn.Linear(d, 1), nn.Linear(d, 1)
        nn.init.constant_(self.gamma.bias, 2.0)          # gamma = 1 + softplus(2) ~ 3.1: a sharp read
        self.fix = fix

    def forward(self, h, mem):
        k = self.key(h)
        k = k / (k.norm(dim=-1, keepdim=True) + 1e-3)
        mn = mem / (mem.norm(dim=-1, keepdim=True) + 1e-3)
        cos = (mn.to(k.dtype) @ k.unsqueeze(-1)).squeeze(-1)                # (B, N)
        b, g = F.softplus(self.beta(h)), 1 + F.softplus(self.gamma(h))
        if self.fix:
            w = (g.float() * torch.log_softmax(b.float() * cos.float(), -1)).softmax(-1)
        else:
            wc = torch.softmax(b * cos, -1)
            w = wc ** g
            w = w / w.sum(-1, keepdim=True)
        return (w.unsqueeze(1).to(k.dtype) @ mem.to(k.dtype)).squeeze(1)


class NTM(nn.Module):
    def __init__(self, fix=False, d=32):
        super().__init__()
        self.ctrl = nn.Sequential(nn.Linear(NTM_DM, d), nn.ReLU())
        self.head = ReadHead(d, fix)
        self.out = nn.Linear(d + NTM_DM, NTM_NC)

    def forward(self, x, mem, y):
        h = self.ctrl(x)
        r = self.head(h, mem)
        return F.cross_entropy(self.out(torch.cat([h, r.to(h.dtype)], -1)).float(), y)


NTM_W = torch.randn(NTM_DM, NTM_NC, generator=gen(6401))


def ntm_batch(i):
    """Recall: the query is a noisy copy of one memory slot; the label is the slot content's class. At NTM_BAD an
    episode with a long history (2048 slots)."""
    g = gen(6410 + i % 6)
    n = NTM_LONG if i == NTM_BAD else NTM_SLOTS
    mem = torch.randn(16, n, NTM_DM, generator=g)
    idx = torch.randint(0, n, (16,), generator=g)
    slot = mem[torch.arange(16), idx]
    x = slot + 0.3 * torch.randn(slot.shape, generator=g)
    return (x, mem, (slot @ NTM_W).argmax(-1)), None


# ======================================================================================================================
# 2. AdaCos: the adaptive scale from a batch sum of exp(s * cos)
# ======================================================================================================================
ADA_BAD, ADA_C, ADA_D, ADA_B0, ADA_B1 = 17, 256, 32, 16, 128


class AdaCosHead(nn.Module):
    """AdaCos as the popular PyTorch port writes it (the scale a buffer here, so that a state dict carries it)."""

    def __init__(self, d, c, fix=False):
        super().__init__()
        self.W = nn.Parameter(torch.randn(c, d) * 0.1)
        self.register_buffer("s", torch.tensor(math.sqrt(2) * math.log(c - 1)))
        self.c, self.fix = c, fix

    def forward(self, x, y):
        logits = F.linear(F.normalize(x), F.normalize(self.W))
        with torch.no_grad():
            lg = logits.float() if self.fix else logits
            theta = torch.acos(torch.clamp(lg, -1.0 + 1e-7, 1.0 - 1e-7))
            one_hot = F.one_hot(y, self.c)
            b_avg = torch.where(one_hot < 1, torch.exp(self.s * lg), torch.zeros_like(lg))
            b_avg = torch.sum(b_avg) / x.size(0)
            theta_med = torch.median(theta[one_hot == 1])
            self.s.copy_(torch.log(b_avg) / torch.cos(torch.clamp(theta_med, max=math.pi / 4)))
        return self.s * logits


class AdaCosNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, ADA_D))
        self.adacos = AdaCosHead(ADA_D, ADA_C, fix)

    def forward(self, x, y):
        return F.cross_entropy(self.adacos(self.body(x), y).float(), y)


ADA_PROTO = torch.randn(ADA_C, 24, generator=gen(6402))


def ada_batch(i):
    """Face-embedding-like identities: a prototype per identity plus noise; the batch size ramps 16 -> 128 at
    ADA_BAD (the warmup's end)."""
    g = gen(6420 + i % 7)
    b = ADA_B1 if i >= ADA_BAD else ADA_B0
    y = torch.randint(0, ADA_C, (b,), generator=g)
    return (ADA_PROTO[y] + 0.5 * torch.randn(b, 24, generator=g), y), None


# ======================================================================================================================
# 3. soft Q-learning: a hand-written soft value under an annealed temperature
# ======================================================================================================================
SQ_A, SQ_S, SQ_BAD = 16, 12, 11


class SoftValue(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, q, alpha):
        if self.fix:
            return alpha * torch.logsumexp(q / alpha, -1)
        return alpha * torch.log(torch.exp(q / alpha).sum(-1))


class SoftQ(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(SQ_S, 64), nn.ReLU(), nn.Linear(64, SQ_A))
        self.soft_v = SoftValue(fix)

    def forward(self, s, a, r, s2, alpha):
        q = self.q(s).gather(-1, a[:, None]).squeeze(-1)
        with torch.no_grad():
            target = r + 0.9 * self.soft_v(self.q(s2), alpha)
        return F.mse_loss(q.float(), target.float())


SQ_R = torch.randn(SQ_S, SQ_A, generator=gen(6403))


def sq_alpha(i):
    return max(0.5 * 0.85 ** i, 0.01)


def sq_batch(i):
    g = gen(6430 + i % 5)
    s, s2 = torch.randn(64, SQ_S, generator=g), torch.randn(64, SQ_S, generator=g)
    a = torch.randint(0, SQ_A, (64,), generator=g)
    r = (s @ SQ_R).gather(-1, a[:, None]).squeeze(-1) * 0.3
    return (s, a, r, s2, sq_alpha(i)), None


# ======================================================================================================================
# 4. coarse-grained force field with a Lennard-Jones prior, trajectories stored in fp16
# ======================================================================================================================
LJ_BAD, LJ_SIG, LJ_EPS, LJ_N = 11, 3.4, 0.2, 12
LJ_I, LJ_J = torch.triu_indices(LJ_N, LJ_N, 1)


class LJPrior(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, r):
        if self.fix:
            r = r.float()
        sr6 = (LJ_SIG / r) ** 6
        return (LJ_EPS * ((LJ_SIG / r) ** 12 - sr6)).sum(-1)


class CGNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.register_buffer("mu", torch.linspace(2.0, 12.0, 16))
        self.pair = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.prior = LJPrior(fix)

    def energy(self, pos):
        r = (pos[:, LJ_I] - pos[:, LJ_J]).norm(dim=-1)                        # (B, P), fp16 as stored
        rbf = torch.exp(-(r.unsqueeze(-1) - self.mu.to(r.dtype)) ** 2 / 2)
        return self.pair(rbf).squeeze(-1).sum(-1) + self.prior(r)

    def forward(self, pos, e_ref):
        return F.mse_loss(self.energy(pos).float(), e_ref) / 1000


def lj_ref(pos):
    """The reference energy (float32): the LJ term plus a smooth many-body-ish pair term the MLP has to learn."""
    r = (pos[:, LJ_I] - pos[:, LJ_J]).float().norm(dim=-1)
    lj = (LJ_EPS * ((LJ_SIG / r) ** 12 - (LJ_SIG / r) ** 6)).sum(-1)
    return lj + (1.5 * torch.exp(-(r - 5.0) ** 2 / 3.0) - 0.5 * torch.exp(-(r - 8.0) ** 2 / 4.0)).sum(-1)


LJ_LATTICE = torch.stack(torch.meshgrid(torch.arange(3.0), torch.arange(2.0), torch.arange(2.0), indexing="ij"),
                         -1).reshape(LJ_N, 3) * 4.2


def lj_batch(i):
    """Frames of a 12-bead system (lattice + thermal noise), stored in fp16; at LJ_BAD one frame from a hot replica
    has beads 0 and 1 at 1.25 A."""
    g = gen(6440 + i % 6)
    pos = LJ_LATTICE + 0.35 * torch.randn(32, LJ_N, 3, generator=g)
    if i == LJ_BAD:
        pos = pos.clone()
        pos[5, 1] = pos[5, 0] + torch.tensor([1.25, 0.0, 0.0])
    pos = pos.half()
    return (pos, lj_ref(pos)), None


CASES = {
    "ntm": dict(make=NTM, batch=ntm_batch, bad=NTM_BAD, name="head", call=1, lr=3e-3),
    "adacos": dict(make=AdaCosNet, batch=ada_batch, bad=ADA_BAD, name="adacos", call=1),
    "soft_q": dict(make=SoftQ, batch=sq_batch, bad=SQ_BAD, name="soft_v", call=1),
    "lj_prior": dict(make=CGNet, batch=lj_batch, bad=LJ_BAD, name="prior", call=1),
}


@pytest.mark.parametrize("key", list(CASES))
def test_failure_named_at_the_producer(tmp_path, key):
    variant_named_at_producer(CASES[key], tmp_path, debug=DEBUG)


@pytest.mark.parametrize("key", list(CASES))
def test_twin_with_the_fix_stays_quiet(tmp_path, key):
    variant_twin_quiet(CASES[key], tmp_path, debug=DEBUG)
