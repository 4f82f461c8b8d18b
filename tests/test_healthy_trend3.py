"""HEALTHY runs in which some layer's values GROW legitimately for a long time but stay far from fp16's max (65504):
`headroom_trend` (the early warning, ampdoctor/rules/headroom.py) — and every other rule — must stay quiet. No
warning, no error, at the default `ampdoctor.watch(model, optimizer=opt, scaler=scaler)` and, where noted, at
`headroom=True` (the series on every step). fp16 autocast on the CPU with GradScaler("cpu") throughout.

Each run is asserted healthy first, with the test's own hooks (`Probe`: every module's output abs-max in any dtype
and the unscaled gradient into it, every step): finite losses, the loss falling, the scaler's skips few and its
scale >= 1 after its search, every value below a stated bound (2e4 unless noted), and the growth itself (a factor
between the first steps and the last tenth, and for some still short of its late level at a given step). Then the
report: no warning/error (all finding lines in the assertion message).

Runs (16 in 14 tests; ~15 s in all):
 1. a classifier becoming confident on separable clusters (no weight decay): logits 0.3 -> ~18 by step 20 -> ~30
    by step 300, like log t;
 2. a pre-LN point-set transformer whose residual stream is fp16 (Linear input projection on raw coordinates, no
    position embedding): ~2.5e2-4e2, larger after each block; the last MLP's output grows ~60x;
 3. unscaled q.k attention scores sharpening on a retrieval task: 7 -> 32, then flat (headroom=True);
 4. a Huber regression on targets 1.35e4 x (1 +- 0.1): the prediction grows from 0.4 to the targets over ~75 steps
    (sigmoid-like) and plateaus for 225 steps, three ways: the model returns its fp16 prediction / returns it
    `.float()` / returns the loss (headroom=True);
 5. a normalisation-free residual MLP with SkipInit gains (raw x100 features, warmup + cosine): a residual
    branch grows ~8x (56 -> ~450) and settles;
 6. CLIP-style two towers with a learnable logit scale (init 1/0.07, clamped at 100): logits 8 -> ~75
    (headroom=True);
 7. raw features of scale 300 under a 100-step linear warmup then a constant lr (Adam, no weight decay): the
    hidden layer grows ~6x (300 -> ~1.7e3) for the whole run;
 8. the same under a triangular cyclic lr: staircase growth 290 -> ~1.3e3;
 9. GradScaler(init_scale=16, growth_interval=20): the scale doubles 15 times, the scaled gradients climb 1 bit
    per 20 steps to ~2.2e4, then the ordinary backoffs (the unscaled ones stay ~1e-2);
10. a sum-reduced loss: the unscaled gradient into the first layer grows ~20x while the loss falls, under the same
    doubling scaler (periodic backoffs from step ~190; headroom=True);
11. a forecaster on a raw series whose level rises linearly: the first layer's output grows linearly,
    700 -> 5.3e3 (reaching 65504 after ~4k steps) and 700 -> 1.35e3 (after ~30k steps);
12. EmbeddingBag sums over 256 tokens, no weight decay: the next Linear grows 58 -> ~210;
13. a GAN whose watched discriminator (own optimizer and scaler) also runs in the generator's step (its own
    scaler): the discriminator's logits drift 0.3 -> a few units.

What ampdoctor got wrong (strict xfails, with the exact finding in each reason; fixed since: the model's last module
stands for an fp32 root's prediction in headroom_trend's fit check, and a parameter of fewer than 16 elements
spikes only at x1000):
- run 4 returning `.float()` or the loss: `[warning] headroom_trend at head step 43: ... 6.7 bits left at step 43,
  falling 0.09 bits/step, forecast to overflow around step 115.` The identical run returning the fp16 prediction
  is silent. Cause: `_fitting` (headroom.py) exempts "the model's own output growing while the loss falls" by
  comparing the layer's series with the ROOT's fp16/bf16 series; a root whose output is fp32 (`.float()`, as HF
  causal LMs return logits, or a loss scalar, as HF models with labels do) has no such series (`series()` reads
  low-precision values only), so `if not rootv ...: return False` and the exemption is lost. The forecast is then
  not refuted (`_refuted`): the plateau's batch abs-max (~1.8e4 median, 2.15e4 at step 115: 1.6 bits) is inside
  REFUTED_BITS (2 bits) at the forecast step and more than 1 bit closer than at the warning.
- run 5: `[warning] update_spike at blocks.2 step 53: The optimizer update at step 53 multiplied the weights of
  `blocks.2` x2.79, `blocks.0` x2.06 (||w|| 0.00405 -> 0.0113) ... (lr=0.0005 ...)`. The weights are the 0-d
  SkipInit gains, which Adam swings between about -0.047 and +0.047 (crossing zero every ~15 steps); step 53 (a
  follow-up step after the scaler's backoff at 52) is the first step whose weight norms are recorded (steps 0-4
  were skipped: no norms), so `_spikes` (ampdoctor/rules/updates.py) has no `peak` for them, and their rms there
  (0.004) is above _MIN_RMS while the zero-born grace does not apply (they were never seen at zero): an ordinary
  ~lr Adam step at a zero crossing reads as a x2.8 spike. The message's lr is also stale: 0.0005 is the warmup's
  first lr read at watch start (`_lr`: run.meta), the lr at step 53 was ~0.0095.
Seen while building these (not kept): with GradScaler(init_scale=1) run 9 has a backward `underflow` error at
step 0 (29% of the gradients into `1` subnormal at scale 1): real at that scale, so the run starts at 16.
Pinned strides (tests/stride_sweep.py, AMPDOCTOR_FORCE_STRIDE=1/2/4/8/16/32) give the same results.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = torch.float16
FP16_MAX = 65504.0


# --- the loop and the test's own measurement --------------------------------------------------------------------

class Probe:
    """The test's own hooks: per module and step, the abs-max of its floating output (any dtype) and of the
    gradient flowing into it, unscaled by the loss scale of the step (`scale` is set before the backward)."""

    def __init__(self, model):
        self.step, self.scale = 0, 1.0
        self.fwd: dict[str, dict[int, float]] = {}
        self.bwd: dict[str, dict[int, float]] = {}
        self.scaled: dict[int, float] = {}   # step -> the largest scaled gradient into any module's output
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules()]

    def _hook(self, name):
        def hook(mod, args, out):
            ts = [t for t in (out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list))
                              else (out,)) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
            if not ts:
                return
            step, fwd = self.step, self.fwd.setdefault(name, {})
            with torch.no_grad():
                a = max(t.detach().abs().max().float().item() for t in ts)
            fwd[step] = max(fwd.get(step, 0.0), a)
            for t in ts:
                if t.requires_grad:
                    bwd, scale = self.bwd.setdefault(name, {}), self.scale

                    def ghook(g, bwd=bwd, step=step, scale=scale):
                        v = g.detach().abs().max().float().item()
                        bwd[step] = max(bwd.get(step, 0.0), v / scale)
                        self.scaled[step] = max(self.scaled.get(step, 0.0), v)
                    t.register_hook(ghook)
        return hook

    def peak(self, phase="fwd", module=None):
        d = self.fwd if phase == "fwd" else self.bwd
        vals = [v for n, s in d.items() if module is None or n == module for v in s.values()]
        return max(vals) if vals else 0.0

    def series(self, module, phase="fwd"):
        d = self.fwd if phase == "fwd" else self.bwd
        return [d[module][s] for s in sorted(d[module])]

    def close(self):
        for h in self.handles:
            h.remove()


class Run:
    def __init__(self, w, probe, losses, scales, skipped, seconds):
        self.w, self.probe, self.losses, self.scales, self.skipped = w, probe, losses, scales, skipped
        self.seconds = seconds
        self.rep = w.report(replay=False)

    def lines(self):
        return [f.one_line() for f in self.rep.findings]


def fit(model, batch, loss_fn, *, steps, opt=None, lr=1e-3, sched=None, clip=1.0, scaler_kw=None, headroom=None,
        every=None, after=None, seed=0):
    """zero_grad -> autocast fp16 forward + loss -> scaler.scale(loss).backward -> unscale_ -> clip -> step ->
    update -> sched.step -> after(i) (no_grad), watched by a default `ampdoctor.watch(model, optimizer=opt,
    scaler=scaler)` (or with `headroom=` / `every=`)."""
    torch.manual_seed(seed)
    opt = opt(model) if callable(opt) else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched) if sched else None
    sc = torch.amp.GradScaler("cpu", **(scaler_kw or {}))
    kw = {k: v for k, v in (("headroom", headroom), ("every", every)) if v is not None}
    probe = Probe(model)
    t0 = time.perf_counter()
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, **kw)
    losses, scales, skipped = [], [], []
    try:
        for i in range(steps):
            probe.step, probe.scale = i, sc.get_scale()
            opt.zero_grad(set_to_none=True)
            args = batch(i)
            with torch.autocast("cpu", dtype=FP16):
                loss = loss_fn(model, *args)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = sc.get_scale()
            sc.step(opt)
            sc.update()
            if sc.get_scale() < before:
                skipped.append(i)
            if sched:
                sched.step()
            if after:
                with torch.no_grad():
                    after(i)
            losses.append(loss.item())
            scales.append(sc.get_scale())
    finally:
        w.close()
        probe.close()
    return Run(w, probe, losses, scales, skipped, time.perf_counter() - t0)


def ce(m, x, y):
    return F.cross_entropy(m(x).float(), y)


def healthy(r, *, fall=0.5, first=20, max_skip_share=0.04, fwd_max=2e4, bwd_max=2e4):
    """The run really was healthy: every loss finite; the mean loss of the last tenth below `fall` x that of the
    first tenth; after the scaler's first `first` steps (its search for a scale) at most `max_skip_share` of the
    steps skipped and the scale never below 1; every module's output (any dtype) and the unscaled gradient into it
    below `fwd_max` / `bwd_max` on every step (the test's own hooks)."""
    assert all(map(math.isfinite, r.losses)), r.losses
    k = max(1, len(r.losses) // 10)
    assert sum(r.losses[-k:]) / k < fall * sum(r.losses[:k]) / k, (r.losses[:k], r.losses[-k:])
    assert min(r.scales[first:]) >= 1.0, r.scales[first::10]
    assert len([s for s in r.skipped if s >= first]) <= max_skip_share * len(r.losses), r.skipped
    assert r.probe.peak("fwd") < fwd_max, r.probe.peak("fwd")
    assert r.probe.peak("bwd") < bwd_max, r.probe.peak("bwd")


def grew(r, module, *, factor, phase="fwd", until=None):
    """The module's abs-max grew: the median over the last tenth of the run at least `factor` x the median over its
    first 5 steps; with `until`, it was still below 80% of that late level at step `until` (a long growth)."""
    s = r.probe.series(module, phase)
    n = len(s)
    early, late = median(s[:5]), median(s[-max(3, n // 10):])
    assert late >= factor * early, (module, early, late)
    if until is not None:
        at = median(s[max(0, until - 2):until + 3])
        assert at < 0.8 * late, (module, until, at, late)
    return early, late


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def silent(r):
    """No warning and no error: the promise on a healthy run (every finding in the message)."""
    assert not alarms(r.rep.findings) and r.rep.exit_code == 0, r.lines()
    assert not [f for f in r.rep.findings if f.rule == "headroom_trend"], r.lines()


def gen_cls(d=16, n=64, k=4, scale=1.0, seed=0, noise=0.3):
    """Features of scale `scale` (raw, unnormalised when large) and a k-class target from the normalised ones."""
    W = torch.randn(d, k, generator=gen(seed + 999))

    def batch(i):
        z = torch.randn(n, d, generator=gen(seed * 100000 + i))
        return z * scale, (z @ W + noise * torch.randn(n, k, generator=gen(seed * 100000 + 50000 + i))).argmax(1)
    return batch


def mlp(d_in=16, h=64, out=4, act=nn.GELU):
    return nn.Sequential(nn.Linear(d_in, h), act(), nn.Linear(h, h), act(), nn.Linear(h, out))


def warmup_cosine(warm, total, floor=0.0):
    def f(s):
        if s < warm:
            return (s + 1) / warm
        p = min(1.0, (s - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return f


# --- 1. a classifier becoming confident: logits growing like log t -----------------------------------------------

def run_confident_classifier(headroom=None):
    torch.manual_seed(1)
    C = torch.randn(6, 16, generator=gen(1))

    def batch(i):
        g = gen(100 + i)
        y = torch.randint(0, 6, (64,), generator=g)
        return C[y] + 0.5 * torch.randn(64, 16, generator=g), y
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 6))
    return fit(m, batch, ce, steps=300, lr=1e-2, clip=None, headroom=headroom)


# --- 2. a pre-LN transformer whose fp16 residual stream grows ----------------------------------------------------

class PreLNBlock(nn.Module):
    def __init__(self, d, h=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, -1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PointSetTransformer(nn.Module):
    """Points (raw coordinates) through a Linear input projection, no position embedding: the residual stream is
    the projection's fp16 output plus the blocks' fp16 outputs, so it stays fp16 under autocast."""

    def __init__(self, din=3, d=32, n=3, k=5):
        super().__init__()
        self.inp = nn.Linear(din, d)
        self.blocks = nn.ModuleList(PreLNBlock(d) for _ in range(n))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, k)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x).mean(1))


def run_prenorm_point_transformer(headroom=None):
    torch.manual_seed(3)
    protos = torch.randn(5, 8, 3, generator=gen(3))

    def batch(i):
        g = gen(500 + i)
        y = torch.randint(0, 5, (16,), generator=g)
        return 100.0 * (protos[y] + 0.5 * torch.randn(16, 8, 3, generator=g)), y
    return fit(PointSetTransformer(), batch, ce, steps=200, lr=1e-2, headroom=headroom,
               sched=lambda s: min(1.0, (s + 1) / 20))


# --- 3. attention scores sharpening on a retrieval task ----------------------------------------------------------

class Score(nn.Module):
    def forward(self, q, k):
        return q @ k.transpose(-1, -2)


class Retrieval(nn.Module):
    """Which of 16 keys is the query token: q.k scores (unscaled) that must sharpen to point at one key."""

    def __init__(self, V=32, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.score = Score()

    def forward(self, query, keys):
        return self.score(self.q(self.emb(query)).unsqueeze(1), self.k(self.emb(keys))).squeeze(1)


def run_retrieval_attention(headroom=None):
    torch.manual_seed(4)

    def batch(i):
        g = gen(900 + i)
        keys = torch.stack([torch.randperm(32, generator=g)[:16] for _ in range(32)])
        pos = torch.randint(0, 16, (32,), generator=g)
        return keys[torch.arange(32), pos], keys, pos
    return fit(Retrieval(), batch, lambda m, q, k, y: F.cross_entropy(m(q, k).float(), y), steps=300, lr=1e-2,
               headroom=headroom, clip=None)


# --- 4. a regression fitting targets of ~1.35e4 (sigmoid-like learning curve) --------------------------------------

class Regressor(nn.Module):
    """`out`: "fp16" returns the head's fp16 output; "float" returns it `.float()` (as HF causal LMs return their
    logits); "loss" returns the Huber loss itself (HF style, forward(x, labels))."""

    def __init__(self, out="fp16"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)
        self.out = out

    def forward(self, x, y=None):
        o = self.head(self.body(x)).squeeze(-1)
        if self.out == "loss":
            return F.smooth_l1_loss(o.float(), y, beta=100.0)
        return o.float() if self.out == "float" else o


def run_regression(out="fp16", headroom=True):
    torch.manual_seed(2)
    wv = torch.randn(8, generator=gen(7))

    def batch(i):
        x = torch.randn(64, 8, generator=gen(i))
        return x, 1.35e4 * (1 + 0.1 * torch.tanh(x @ wv / 3))

    def loss(m, x, y):
        return m(x, y) if out == "loss" else F.smooth_l1_loss(m(x).float(), y, beta=100.0)
    return fit(Regressor(out), batch, loss, steps=300, lr=1e-2, clip=None, headroom=headroom)


# --- 5. a normalisation-free residual MLP (SkipInit gains) --------------------------------------------------------

class SkipInitBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + self.alpha * self.fc2(F.relu(self.fc1(x)))


class SkipInitMLP(nn.Module):
    """No normalisation anywhere: a Linear stem on raw features (fp16 residual stream), residual branches scaled
    by learnable gains that start at 0 (SkipInit)."""

    def __init__(self, d=64, n=3):
        super().__init__()
        self.stem = nn.Linear(16, d)
        self.blocks = nn.Sequential(*[SkipInitBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def run_skipinit_mlp(headroom=None):
    torch.manual_seed(5)
    return fit(SkipInitMLP(), gen_cls(scale=100.0, seed=5), ce, steps=250, lr=1e-2, headroom=headroom,
               sched=warmup_cosine(20, 250, 0.05))


# --- 6. CLIP-style contrastive model: a learnable logit scale growing to its clamp (100) ---------------------------

class Sim(nn.Module):
    def forward(self, a, b, scale):
        return scale * a @ b.t()


class TwoTower(nn.Module):
    def __init__(self, d=16, e=32):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, e))
        self.txt = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, e))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.sim = Sim()

    def forward(self, a, b):
        return self.sim(F.normalize(self.img(a), dim=-1), F.normalize(self.txt(b), dim=-1), self.logit_scale.exp())


def run_clip(headroom=None):
    torch.manual_seed(6)
    A = torch.randn(16, 16, generator=gen(6))
    m = TwoTower()

    def batch(i):
        z = torch.randn(64, 16, generator=gen(4000 + i))
        return z, z @ A + 0.1 * torch.randn(64, 16, generator=gen(14000 + i))

    def loss(m, a, b):
        lg, y = m(a, b).float(), torch.arange(len(a))
        return (F.cross_entropy(lg, y) + F.cross_entropy(lg.t(), y)) / 2

    def opt(m):
        rest = [p for n, p in m.named_parameters() if n != "logit_scale"]
        return torch.optim.AdamW([{"params": rest, "lr": 3e-3}, {"params": [m.logit_scale], "lr": 0.1}],
                                 weight_decay=0.0)

    def after(i):
        m.logit_scale.clamp_(0, math.log(100))   # CLIP's clamp
    return fit(m, batch, loss, steps=300, opt=opt, headroom=headroom, after=after)


# --- 7/8. raw features: a long warmup, then constant; a cyclic lr ----------------------------------------------------

def run_long_warmup(headroom=None):
    torch.manual_seed(8)
    return fit(mlp(), gen_cls(scale=300.0), ce, steps=300, lr=3e-2, clip=None, headroom=headroom,
               sched=lambda s: min(1.0, (s + 1) / 100))


def run_cyclic_lr(headroom=None):
    torch.manual_seed(9)

    def tri(s):
        p = (s % 60) / 30
        return 0.02 + 0.98 * (p if p <= 1 else 2 - p)
    return fit(mlp(), gen_cls(scale=300.0, seed=1), ce, steps=300, lr=3e-2, clip=None, headroom=headroom, sched=tri)


# --- 9/10. the loss scale doubling every 20 steps; gradients growing as the loss falls ----------------------------

def run_scaler_doubling(headroom=None, reduction="mean"):
    torch.manual_seed(12)
    return fit(mlp(16, 64, 6), gen_cls(n=128, k=6, seed=12, noise=0.0),
               lambda m, x, y: F.cross_entropy(m(x).float(), y, reduction=reduction), steps=400, lr=1e-3,
               headroom=headroom, scaler_kw={"init_scale": 16.0, "growth_interval": 20})


# --- 11. a layer growing linearly: a forecaster on a raw series whose level rises ---------------------------------

def run_linear_level(headroom=None, speed=8.0):
    torch.manual_seed(14)

    def batch(i):
        g = gen(60000 + i)
        t0 = i * speed + torch.rand(64, 1, generator=g) * speed       # the stream moves on `speed` time units a step
        t = t0 + torch.arange(17.0)
        series = 500.0 + 1.0 * t + 20.0 * torch.sin(t / 3) + 5.0 * torch.randn(64, 17, generator=g)
        return series[:, :16], series[:, 16]
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    return fit(m, batch, lambda m, x, y: F.smooth_l1_loss(m(x).float().squeeze(-1), y, beta=10.0), steps=300,
               lr=1e-2, headroom=headroom, clip=None)


# --- 12. embeddings without weight decay, summed over long bags ---------------------------------------------------

class BagNet(nn.Module):
    def __init__(self, V=200, d=32):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, d, mode="sum")
        self.fc, self.head = nn.Linear(d, 64), nn.Linear(64, 4)

    def forward(self, idx):
        return self.head(F.gelu(self.fc(self.bag(idx))))


def run_embedding_bag(headroom=None):
    torch.manual_seed(11)
    cls_tok = torch.randint(0, 200, (4, 20), generator=gen(11))

    def batch(i):
        g = gen(40000 + i)
        y = torch.randint(0, 4, (32,), generator=g)
        idx = torch.randint(0, 200, (32, 256), generator=g)
        idx[:, :24] = cls_tok[y][:, torch.randint(0, 20, (24,), generator=g)]
        return idx, y
    return fit(BagNet(), batch, ce, steps=300, lr=3e-2, headroom=headroom, clip=None)


# --- 13. a GAN: the watched discriminator's logits drift ----------------------------------------------------------

def run_gan(headroom=None, steps=300):
    """Non-saturating GAN on 8 Gaussians; the discriminator is watched with its optimizer and its GradScaler, the
    generator has its own optimizer and scaler (and its step runs the watched discriminator forward and backward)."""
    torch.manual_seed(13)
    G = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    oG = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    oD = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    sD, sG = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    ang = torch.arange(8) * (2 * math.pi / 8)
    centres = torch.stack([ang.cos(), ang.sin()], 1) * 2
    probe = Probe(D)
    t0 = time.perf_counter()
    w = ampdoctor.watch(D, optimizer=oD, scaler=sD, **({} if headroom is None else {"headroom": headroom}))
    losses, scales, skipped, g_losses = [], [], [], []
    try:
        for i in range(steps):
            g = gen(8000 + i)
            real = centres[torch.randint(0, 8, (64,), generator=g)] + 0.05 * torch.randn(64, 2, generator=g)
            z = torch.randn(64, 8, generator=g)
            probe.step, probe.scale = i, sD.get_scale()
            oD.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                fake = G(z)
                ld = F.softplus(-D(real).float()).mean() + F.softplus(D(fake.detach()).float()).mean()
            sD.scale(ld).backward()
            before = sD.get_scale()
            sD.step(oD)
            sD.update()
            if sD.get_scale() < before:
                skipped.append(i)
            probe.scale = sG.get_scale()
            oG.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                lg = F.softplus(-D(G(z)).float()).mean()
            sG.scale(lg).backward()
            sG.step(oG)
            sG.update()
            losses.append(ld.item())
            g_losses.append(lg.item())
            scales.append(sD.get_scale())
    finally:
        w.close()
        probe.close()
    r = Run(w, probe, losses, scales, skipped, time.perf_counter() - t0)
    r.g_losses, r.G, r.centres = g_losses, G, centres
    return r


# === the tests ====================================================================================================

def test_classifier_becoming_confident_logits_grow_like_log_t():
    """Separable clusters, no weight decay: the logits grow fast, then like log t (0.3 -> ~18 by step 20 -> ~30
    at step 300) while the loss falls towards 0; 11 bits below the max."""
    r = run_confident_classifier()
    healthy(r, fall=0.01)
    early, late = grew(r, "4", factor=20)
    s = r.probe.series("4")
    assert median(s[150:180]) < late and 15 < late < 100, (median(s[150:180]), late)   # still growing, slowly
    silent(r)


def test_prenorm_point_transformer_fp16_residual_stream_grows_with_depth_and_training():
    """Raw point coordinates (x100) through a Linear input projection and no position embedding: the pre-LN
    residual stream is fp16 and sits at ~2.5e2-4e2 (~8 bits), larger after each block; the last MLP's output grows
    ~60x over the run (0.6 -> ~37) as the blocks learn."""
    r = run_prenorm_point_transformer()
    healthy(r, fall=0.3, fwd_max=2e3)
    grew(r, "blocks.2.out", factor=20)
    assert median(r.probe.series("blocks.2")[-20:]) > median(r.probe.series("inp")[-20:])   # grows with depth
    assert r.probe.peak("fwd", "blocks.2") > 256    # within fp16's 8 bits the rule looks at
    silent(r)


def test_retrieval_attention_scores_sharpen_headroom_every_step():
    """Unscaled q.k scores that must point at one of 16 keys: their abs-max grows 7 -> 32 and settles
    (headroom=True: the series on every step)."""
    r = run_retrieval_attention(headroom=True)
    healthy(r, fall=0.01)
    grew(r, "score", factor=3)
    silent(r)


REGRESSION_XFAIL = (
    "headroom_trend at `head` step 43: `head` (Linear) output is losing headroom to the float16 maximum steadily: "
    "6.7 bits left at step 43, falling 0.09 bits/step, forecast to overflow around step 115. The head is the "
    "model's prediction fitting targets of 1.2e4-1.5e4 (a sigmoid-like curve whose batch abs-max plateaus at "
    "~1.8e4, median, from step ~75 on); the same run returning the fp16 prediction is silent because _fitting "
    "(ampdoctor/rules/headroom.py) exempts the root's own output, but it keys on the root's fp16/bf16 series: "
    "a root that returns `.float()` or the loss has none (`if not rootv ... return False`), so the exemption is "
    "lost; the forecast is then not refuted: at step 115 the plateau leaves the head 1.6 bits, under "
    "REFUTED_BITS (2)")


@pytest.mark.parametrize("out", [
    "fp16",
    pytest.param("float"),
    pytest.param("loss"),
], ids=["fp16_output", "float_output", "returns_loss"])
def test_regression_fit_to_targets_of_1_35e4_sigmoid_learning_curve(out):
    """A Huber regression (beta 100) on targets 1.35e4 x (1 +- 0.1): the prediction grows from ~0.4 to the
    targets' magnitude over ~75 steps (fast, then a plateau) and stays there for 225 steps; the loss falls ~20x.
    The same numbers three ways: the model returns its fp16 prediction, returns it `.float()` (as HF causal LMs
    return their logits), or returns the loss itself (HF style). headroom=True (the series on every step, so the
    finding does not depend on the default's measured stride). The plateau's batch abs-max is ~1.8e4 (median;
    peak 2.4e4, the batch extremes of an imperfect fit): 1.4 bits below the max at worst."""
    r = run_regression(out)
    healthy(r, fall=0.1, fwd_max=2.5e4)
    early, late = grew(r, "head", factor=1000)
    s = r.probe.series("head")
    assert max(s[150:]) < 1.15 * max(s[75:150]), (max(s[75:150]), max(s[150:]))     # settled
    silent(r)


SKIPINIT_XFAIL = (
    "update_spike at blocks.2 step 53: The optimizer update at step 53 multiplied the weights of `blocks.2` x2.79, "
    "`blocks.0` x2.06 (||w|| 0.00405 -> 0.0113) ... (lr=0.0005 ...). The weights are the 0-d SkipInit gains, which "
    "Adam swings between about -0.047 and +0.047; step 53 (a follow-up step after the backoff at 52) is the first "
    "with recorded weight norms (steps 0-4 were skipped), so _spikes (ampdoctor/rules/updates.py) has no `peak` "
    "for them, their rms (0.004) is above _MIN_RMS and the zero-born grace does not apply: an ordinary ~lr Adam "
    "step at a zero crossing reads as a x2.8 spike (the message's lr is the warmup's first lr, run.meta, not "
    "the ~0.0095 of step 53)")


def test_normalisation_free_skipinit_mlp_branches_grow_then_settle():
    """Raw features (x100) into a Linear stem (an fp16 residual stream at ~2-3e2), three residual branches scaled by
    SkipInit gains that start at 0, no normalisation, warmup + cosine: the last branch's output grows ~8x
    (56 -> ~450) over the first ~100 steps and settles."""
    r = run_skipinit_mlp()
    healthy(r, fall=0.1, fwd_max=5e3)
    grew(r, "blocks.2.fc2", factor=4)
    s = r.probe.series("blocks.2.fc2")
    assert max(s[150:]) < 1.5 * max(s[50:150]), (max(s[50:150]), max(s[150:]))
    silent(r)


def test_clip_learnable_logit_scale_grows_towards_its_clamp_headroom_every_step():
    """A two-tower contrastive model with CLIP's learnable logit scale (init 1/0.07, its own lr 0.1, clamped at 100
    after each step): the similarity logits grow 8 -> ~75 while the loss falls (headroom=True)."""
    r = run_clip(headroom=True)
    healthy(r, fall=0.01)
    early, late = grew(r, "sim", factor=5)
    assert late < 100.5
    silent(r)


def test_raw_features_long_warmup_then_constant_lr():
    """Raw features of scale 300, AdamW without weight decay, a 100-step linear warmup to 3e-2 then constant: the
    hidden layer's output grows ~6x (300 -> ~1.7e3, 5.3 bits left) for the whole run, fastest as the warmup ends."""
    r = run_long_warmup()
    healthy(r, fall=0.1, fwd_max=1e4)  # (the loss falls ~18x or ~20x, by the CPU's fp16 matmul path)
    grew(r, "2", factor=3, until=150)
    silent(r)


def test_raw_features_triangular_cyclic_lr_staircase_growth():
    """The same at a triangular cyclic lr (60-step cycles, 2% -> 100% -> 2% of 3e-2): the hidden layer grows in
    steps with each high-lr phase (290 -> ~1.3e3), then holds."""
    r = run_cyclic_lr()
    healthy(r, fall=0.05, fwd_max=1e4)
    grew(r, "2", factor=3)
    silent(r)


def test_gradscaler_doubling_every_20_steps_scaled_gradients_climb_towards_the_max():
    """GradScaler(init_scale=16, growth_interval=20): the scale doubles every 20 steps (16 -> 2^19), so the scaled
    gradients climb 1 bit every 20 steps, by design, to within ~1.5 bits of the max (~2.2e4) by step ~300, where
    the scaler's ordinary backoffs begin (4 skips in the last 100 steps); the unscaled gradients stay ~1e-2. The
    default watch."""
    r = run_scaler_doubling()
    healthy(r, fall=0.2, max_skip_share=0.02)
    assert r.scales[-1] >= 2.0 ** 18 and min(r.skipped, default=400) >= 250, (r.scales[::20], r.skipped)
    early = max(v for s, v in r.probe.scaled.items() if s < 20)
    late = max(v for s, v in r.probe.scaled.items() if s >= 250)
    assert late >= 4096 and late >= 2 ** 12 * early, (early, late)
    silent(r)


def test_sum_reduced_loss_gradients_grow_as_the_loss_falls_with_scaler_doubling_every_20_steps():
    """A sum-reduced cross-entropy (128 rows): the unscaled gradient into the first layer grows ~20x (0.08 -> ~1.5)
    while the loss falls, as the layers above it grow; the scale doubles every 20 steps from 16 until the scaled
    gradients overflow, then backs off and regrows (a skip every ~20-40 steps from step ~200: the ordinary regime).
    headroom=True."""
    r = run_scaler_doubling(headroom=True, reduction="sum")
    healthy(r, fall=0.2, max_skip_share=0.03)
    grew(r, "0", phase="bwd", factor=10, until=100)
    assert len(r.skipped) >= 3, r.skipped
    silent(r)


@pytest.mark.parametrize("speed", [8.0, 1.0], ids=["fast_65504_after_4k_steps", "slow_65504_after_30k_steps"])
def test_forecaster_on_a_raw_series_whose_level_rises_linearly(speed):
    """A forecaster fed a raw series (level 500 + t, a seasonal wiggle, noise) that moves on `speed` time units a
    step: the first layer's output grows linearly, 700 -> 5.3e3 (speed 8; it would reach 65504 after ~4k steps)
    or 700 -> 1.35e3 (speed 1; after ~30k steps), while the Huber loss falls."""
    r = run_linear_level(speed=speed)
    healthy(r, fall=0.3, fwd_max=1e4)
    early, late = grew(r, "0", factor=1.7 if speed == 1.0 else 5.0)
    s = r.probe.series("0")
    mid = median(s[140:160])
    assert abs(mid - (early + late) / 2) < 0.2 * (late - early), (early, mid, late)   # linear, not exponential
    silent(r)


def test_embedding_bag_sums_without_weight_decay_grow_slowly():
    """Bags of 256 token ids summed by an EmbeddingBag (fp32 under autocast), Adam at 3e-2 without weight decay:
    the embedding rows and the next Linear grow slowly (the Linear's output 58 -> ~210)."""
    r = run_embedding_bag()
    healthy(r, fall=0.1)
    grew(r, "fc", factor=2.5)
    silent(r)


def test_gan_discriminator_logits_drift_with_two_scalers():
    """A non-saturating GAN on 8 Gaussians; the discriminator is watched (its own optimizer and GradScaler), the
    generator's step, with its own scaler, runs the watched discriminator forward and backward too. The
    discriminator's logits drift from ~0.3 to a few units and wander there."""
    r = run_gan()
    assert all(map(math.isfinite, r.losses + r.g_losses))
    assert 0.3 < sum(r.losses[-30:]) / 30 < 1.45 and 0.3 < sum(r.g_losses[-30:]) / 30 < 3.0, (r.losses[-5:],
                                                                                              r.g_losses[-5:])
    assert not r.skipped and r.probe.peak("fwd") < 100, (r.skipped, r.probe.peak("fwd"))
    grew(r, "4", factor=2)
    silent(r)
