"""Healthy runs at ampdoctor's DEFAULT watch and at `every=1`, thirty-sixth set: SIX TRAINING RECIPES NOT PROBED BY
THE EARLIER FILES.

Each case is a realistic recipe that could provoke a false alarm; `ampdoctor.watch(model, optimizer=...,
scaler=..., run_dir=tmp_path / "run")` at the default sampling and again with `every=1` (full statistics every
step), nothing else; CPU fp16 autocast with a real `torch.amp.GradScaler("cpu")`, backward -> unscale_ -> (clip)
-> step -> update, fixed seeds, one intra-op thread, 60-80 optimizer steps each. Every case runs three times: once
UNWATCHED (shared by both modes) and once under each watch.

- The unwatched run carries the oracle, independent of ampdoctor (`healthy`; a failure is a plain failure): every
  loss finite, the mean of the last 5 losses <= 0.9 x the first 5's, the scaler skipped no step but the opening
  ones (< 3; in fact none of the six skips any), every final weight and buffer finite.
- The watched run must train bitwise identically (probe_harness.same_run): the losses, the
  skipped steps, every final weight and buffer, the case's extras (the Lagrange multiplier's trace).
- Then (probe_harness.quiet_healthy) w.report() after close() holds no warning and no error, exit code 0, at least
  one step seen, and no `ampdoctor...` Python warning; otherwise WrongAnswer, a strict xfail (probe_harness.wrong)
  quoting ampdoctor.

Left out (grep of tests/test_healthy*.py docstrings and code): the brief's suggestions are all there already -- LoRA
(16 files), gradient accumulation (37), _foreach / EMA teachers (11), CLIP's logit_scale (7), focal + smooth-L1
detection losses (5 / 17), diffusion timesteps (11), GRU LMs (17), warmup (39), set_to_none=False, distillation.
New here (0-1 hits in those files): a neural cellular automaton, NeuMF / BPR recommenders, MaxUnpool2d, a sliced
Wasserstein loss, a Lagrange multiplier trained by ascent through a `maximize=True` param group, Performer's
FAVOR+ random-feature attention.

The cases:
 1. nca_growing_pattern: Mordvintsev et al.'s growing neural cellular automaton on 16x16, 8 channels: fixed
    identity + Sobel depthwise perception (a `kernel` buffer, groups=8), a 1x1-conv update rule whose last layer
    starts at zero, a random per-cell fire mask (p 0.5), alive masking by a 3x3 max-pool of alpha (> 0.1) before
    and after the update, 8-12 unrolled CA steps per iteration (an fp32 state plus fp16 updates), MSE of RGBA to
    a coloured disk; the NCA notebook's per-parameter gradient normalisation g / (|g| + 1e-8) after unscale_, no
    clipping. 60 steps, loss 0.325 -> 0.157 (first / last 5).
 2. neumf_bpr_implicit: He et al.'s NeuMF (GMF branch = fp32 embedding product, MLP tower in fp16, fused) scored
    on (user, preferred item, other item) triples from a latent-factor + popularity truth, BPR loss
    -logsigmoid(s_pos - s_neg). 80 steps, 0.692 -> 0.466.
 3. segnet_maxunpool_shapes: a SegNet encoder-decoder (conv-BN-ReLU, MaxPool2d(return_indices=True), MaxUnpool2d
    with the saved indices and output_size), per-pixel 3-class cross-entropy segmenting disks and squares in
    noise. 60 steps, 1.003 -> 0.183.
 4. sliced_wasserstein_generator: an MLP generator (LeakyReLU, Adam betas (0.5, 0.9)) from 8-D noise to a ring of
    8 Gaussians, trained by the sliced Wasserstein distance (64 random unit projections of the fp32 cast, sorted,
    squared differences); no discriminator. 80 steps, 1.463 -> 0.169.
 5. lagrangian_logit_budget: a classifier under the constraint mean(logits^2) <= 2, the Lagrangian CE + lambda *
    violation with lambda = softplus(lam_raw), lam_raw a tensor outside the model in its own Adam param group
    with `maximize=True` (gradient ascent on the multiplier), clip_grad_norm_ on the model's parameters only;
    lambda 0.018 -> 0.005 while the constraint is slack, back up to 0.04 once it binds. 80 steps, 1.311 -> 0.49.
 6. performer_favor_majority: a 2-block Performer (FAVOR+: performer-pytorch's positive orthogonal random
    features with the max stabiliser, eps 1e-4, the 1 / (q . sum k) normaliser) classifying which of 4 tokens is
    over-represented in a 16-token sequence. The random features, normaliser and linear attention run in fp32
    (autocast disabled, q/k/v cast up) while the projections, MLPs and head run in fp16: with the features in
    fp16 the scaler backed off on almost every step from step 15 on (65536 -> 128 by step 24), a real fp16
    failure, so the healthy recipe keeps them in fp32 as Performer ports do. 80 steps, 1.18 -> 0.353.

Result when written: 12 pass, 0 strict xfail (6 cases x {default, every=1}): every report is empty (not even an
info finding), no `ampdoctor...` Python warning, every watched run bitwise identical to the unwatched one. XFAIL is
empty. The file takes ~30 s.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace as ns

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import HealthyLoop, healthy_run, quiet_healthy, same_run, trained_healthily, wrong  # noqa: E402
from scenarios import gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
DEBUG = os.environ.get("H36_DEBUG") == "1"
F16 = torch.float16
CASES: dict = {}
XFAIL: dict[tuple[str, str], str] = {}
MODES = {"default": {}, "every1": {"every": 1}}


def case(steps, fall=0.9):
    def reg(fn):
        CASES[fn.__name__] = ns(build=fn, steps=steps, fall=fall)
        return fn
    return reg


def amp_update(model, optimizer, scaler, loss, clip=1.0, params=None, after_unscale=None):
    """scale(loss).backward -> unscale_ -> [after_unscale()] -> clip_grad_norm_ -> step -> update -> zero_grad."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if after_unscale is not None:
        after_unscale()
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters() if params is None else params, clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ 1. growing neural cellular automaton
class NCA(nn.Module):
    """Mordvintsev et al.'s growing NCA: fixed identity + Sobel depthwise perception, a 1x1-conv update rule whose
    last layer starts at zero, a stochastic (per-cell) fire mask, alive masking by a 3x3 max-pool of alpha."""

    def __init__(self, ch=8, hid=32):
        super().__init__()
        self.ch = ch
        sx = torch.tensor([[-1.0, 0, 1], [-2, 0, 2], [-1, 0, 1]]) / 8
        ident = torch.zeros(3, 3)
        ident[1, 1] = 1
        k = torch.stack([ident, sx, sx.t()]).repeat(ch, 1, 1)[:, None]
        self.register_buffer("kernel", k)
        self.w1 = nn.Conv2d(3 * ch, hid, 1)
        self.w2 = nn.Conv2d(hid, ch, 1, bias=False)
        nn.init.zeros_(self.w2.weight)

    def alive(self, x):
        return F.max_pool2d(x[:, 3:4].float(), 3, 1, 1) > 0.1

    def forward(self, x, n, g):
        for _ in range(n):
            pre = self.alive(x)
            y = F.conv2d(x, self.kernel, padding=1, groups=self.ch)
            dx = self.w2(torch.relu(self.w1(y)))
            fire = (torch.rand(x.shape[0], 1, *x.shape[2:], generator=g) <= 0.5)
            x = x + dx * fire
            x = x * (pre & self.alive(x))
        return x


@case(60)
def nca_growing_pattern():
    torch.manual_seed(1)
    model = NCA()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    s = 16
    yy, xx = torch.meshgrid(torch.arange(s).float() - 7.5, torch.arange(s).float() - 7.5, indexing="ij")
    r = (yy ** 2 + xx ** 2).sqrt()
    ring = (r < 6).float()
    target = torch.stack([ring, ring * (xx > 0), ring * (yy > 0), ring])[None]   # RGBA, alpha = the ring
    seed = torch.zeros(1, model.ch, s, s)
    seed[:, 3:, s // 2, s // 2] = 1.0

    def per_param_norm():
        # the NCA notebook's per-variable gradient normalisation, on the unscaled gradients
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(p.grad.norm() + 1e-8)

    def step(i):
        g = gen(1_000_000 + i)
        n = int(torch.randint(8, 13, (1,), generator=g))
        with torch.autocast("cpu", dtype=F16):
            x = model(seed.repeat(4, 1, 1, 1), n, g)
        loss = F.mse_loss(x[:, :4].float(), target.expand(4, -1, -1, -1))
        amp_update(model, opt, scaler, loss, clip=None, after_unscale=per_param_norm)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 2. NeuMF recommender, BPR loss
class NeuMF(nn.Module):
    """He et al.'s NeuMF: a GMF branch (elementwise product of embeddings) and an MLP tower on their concatenation,
    fused by a linear layer into one score per (user, item)."""

    def __init__(self, users=64, items=96, d=16):
        super().__init__()
        self.ug, self.ig = nn.Embedding(users, d), nn.Embedding(items, d)
        self.um, self.im = nn.Embedding(users, d), nn.Embedding(items, d)
        for e in (self.ug, self.ig, self.um, self.im):
            nn.init.normal_(e.weight, std=0.1)
        self.mlp = nn.Sequential(nn.Linear(2 * d, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.fuse = nn.Linear(d + 16, 1)

    def forward(self, u, i):
        gmf = self.ug(u) * self.ig(i)
        mlp = self.mlp(torch.cat([self.um(u), self.im(i)], -1))
        return self.fuse(torch.cat([gmf.to(mlp.dtype), mlp], -1)).squeeze(-1)


@case(80)
def neumf_bpr_implicit():
    torch.manual_seed(2)
    model = NeuMF()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu")
    tu, ti = torch.randn(64, 4, generator=gen(2001)), torch.randn(96, 4, generator=gen(2002))
    pop = 2 * torch.randn(96, generator=gen(2003))      # item popularity: a shared part of every user's taste

    def step(i):
        g = gen(2_000_000 + i)
        u = torch.randint(0, 64, (256,), generator=g)
        a, b = torch.randint(0, 96, (256,), generator=g), torch.randint(0, 96, (256,), generator=g)
        better = (tu[u] * ti[a]).sum(1) + pop[a] > (tu[u] * ti[b]).sum(1) + pop[b]
        pos, neg = torch.where(better, a, b), torch.where(better, b, a)
        with torch.autocast("cpu", dtype=F16):
            d = model(u, pos) - model(u, neg)
        loss = -F.logsigmoid(d.float()).mean()
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 3. SegNet, MaxUnpool2d with pooling indices
class SegNet(nn.Module):
    def __init__(self, c=16, k=3):
        super().__init__()
        self.e1 = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.e2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU())
        self.d2 = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.d1 = nn.Conv2d(c, k, 3, padding=1)
        self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)

    def forward(self, x):
        h1, i1 = self.pool(self.e1(x))
        h2, i2 = self.pool(self.e2(h1))
        h = self.d2(self.unpool(h2, i2, output_size=h1.shape))
        return self.d1(self.unpool(h, i1, output_size=x.shape))


@case(60)
def segnet_maxunpool_shapes():
    torch.manual_seed(3)
    model = SegNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    s = 16
    yy, xx = torch.meshgrid(torch.arange(s).float(), torch.arange(s).float(), indexing="ij")

    def batch(i):
        g = gen(3_000_000 + i)
        cy, cx = 3 + 10 * torch.rand(2, 16, 1, 1, generator=g)
        rad = 2 + 2 * torch.rand(16, 1, 1, generator=g)
        disk = ((yy - cy) ** 2 + (xx - cx) ** 2).sqrt() < rad
        sq = ((yy - cx).abs() < rad) & ((xx - cy).abs() < rad) & ~disk
        y = disk.long() + 2 * sq.long()
        img = disk.float() - sq.float() + 0.3 * torch.randn(16, s, s, generator=g)
        return img[:, None], y

    def step(i):
        x, y = batch(i)
        with torch.autocast("cpu", dtype=F16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 4. generator trained by sliced Wasserstein
@case(80)
def sliced_wasserstein_generator():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.5, 0.9))
    scaler = torch.amp.GradScaler("cpu")

    def real(g, n):
        ang = torch.randint(0, 8, (n,), generator=g).float() * math.pi / 4
        return 2 * torch.stack([ang.cos(), ang.sin()], 1) + 0.1 * torch.randn(n, 2, generator=g)

    def step(i):
        g = gen(4_000_000 + i)
        z = torch.randn(256, 8, generator=g)
        with torch.autocast("cpu", dtype=F16):
            fake = model(z)
        theta = torch.randn(2, 64, generator=g)
        theta = theta / theta.norm(dim=0, keepdim=True)
        pf = (fake.float() @ theta).sort(0).values
        pr = (real(g, 256) @ theta).sort(0).values
        loss = (pf - pr).pow(2).mean()
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 5. Lagrangian constraint, multiplier ascent
@case(80)
def lagrangian_logit_budget():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    lam_raw = torch.full((), -4.0, requires_grad=True)        # softplus(lam_raw) >= 0, outside the model
    opt = torch.optim.Adam([{"params": model.parameters()},
                            {"params": [lam_raw], "lr": 5e-2, "maximize": True}], lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    w_t = torch.randn(16, 4, generator=gen(5001))
    budget = 2.0
    lams = []

    def step(i):
        g = gen(5_000_000 + i)
        x = torch.randn(128, 16, generator=g)
        y = (x @ w_t).argmax(1)
        with torch.autocast("cpu", dtype=F16):
            logits = model(x)
        lam = F.softplus(lam_raw)
        violation = logits.float().pow(2).mean() - budget
        loss = F.cross_entropy(logits.float(), y) + lam * violation
        amp_update(model, opt, scaler, loss, params=list(model.parameters()))
        lams.append(float(lam))
        return loss.item()
    return HealthyLoop(model, opt, scaler, step, extra=[lams])


# ------------------------------------------------------------------ 6. Performer (FAVOR+) linear attention
def softmax_kernel(data, proj, is_query, eps=1e-4):
    """performer-pytorch's positive orthogonal random features for the softmax kernel, with its stabiliser (the max
    subtracted: per row for queries, over everything for keys)."""
    norm = data.shape[-1] ** -0.25
    ratio = proj.shape[0] ** -0.5
    dash = torch.einsum("...id,jd->...ij", norm * data, proj)
    diag = (data ** 2).sum(-1, keepdim=True) / 2 * norm ** 2
    stab = dash.amax(-1, keepdim=True) if is_query else dash.amax((-1, -2), keepdim=True).detach()
    return ratio * (torch.exp(dash - diag - stab) + eps)


def orthogonal_features(m, d, g):
    blocks = [torch.linalg.qr(torch.randn(d, d, generator=g))[0].t() for _ in range(math.ceil(m / d))]
    w = torch.cat(blocks)[:m]
    return w * torch.randn(m, d, generator=g).norm(dim=1, keepdim=True)


class FavorAttention(nn.Module):
    def __init__(self, d=32, heads=4, m=32, seed=0):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("proj", orthogonal_features(m, self.dh, gen(seed)))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).float().view(b, n, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        with torch.autocast("cpu", enabled=False):       # the random features and the normaliser in fp32
            q, k = softmax_kernel(q, self.proj, True), softmax_kernel(k, self.proj, False)
            d_inv = 1.0 / torch.einsum("...nd,...d->...n", q, k.sum(-2))
            ctx = torch.einsum("...nd,...ne->...de", k, v)
            out = torch.einsum("...de,...nd,...n->...ne", ctx, q, d_inv)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class Performer(nn.Module):
    def __init__(self, vocab=8, d=32, n=16, layers=2, classes=4):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(0.02 * torch.randn(n, d))
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(ln1=nn.LayerNorm(d), att=FavorAttention(d, seed=60 + j),
                                                       ln2=nn.LayerNorm(d),
                                                       ff=nn.Sequential(nn.Linear(d, 64), nn.GELU(),
                                                                        nn.Linear(64, d))))
                                    for j in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, t):
        x = self.emb(t) + self.pos
        for blk in self.blocks:
            x = x + blk.att(blk.ln1(x))
            x = x + blk.ff(blk.ln2(x))
        return self.head(self.norm(x).mean(1))


@case(80)
def performer_favor_majority():
    torch.manual_seed(6)
    model = Performer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")

    def step(i):
        g = gen(6_000_000 + i)
        y = torch.randint(0, 4, (32,), generator=g)
        t = torch.randint(0, 8, (32, 16), generator=g)
        extra = torch.rand(32, 16, generator=g) < 0.3
        t = torch.where(extra, y[:, None], t)            # the label's token is over-represented
        with torch.autocast("cpu", dtype=F16):
            logits = model(t)
        loss = F.cross_entropy(logits.float(), y)
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ---------------------------------------------------------------------------------------------------- the runs
def run(name, mode=None, run_dir=None):
    """The case's loop for CASES[name].steps iterations: unwatched (mode None) or watched with MODES[mode]."""
    cs = CASES[name]
    return healthy_run(cs.build(), cs.steps, None if mode is None else MODES[mode], run_dir)


@functools.lru_cache(maxsize=None)
def unwatched(name):
    return run(name)


@pytest.mark.parametrize("name,mode", [pytest.param(n, m, marks=wrong(XFAIL[n, m]) if (n, m) in XFAIL else ())
                                       for n in CASES for m in MODES])
def test_healthy36(name, mode, tmp_path):
    ru = unwatched(name)
    if DEBUG:
        ls = ru.losses
        print(name, "skipped", ru.skipped, "loss", [round(v, 4) for v in ls[::max(1, len(ls) // 8)]], ls[-1])
    trained_healthily(ru, CASES[name].fall)
    rw = run(name, mode, tmp_path / "run")
    if DEBUG:
        print(name, mode, lines(rw.rep))
    same_run(rw, ru)
    quiet_healthy(rw)
