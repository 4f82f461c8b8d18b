"""Long HEALTHY runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=scaler)`, nothing else):
small models trained for 600-1000 steps with the features of real long runs, probing for LATE false alarms
(headroom_trend, update_spike, update_underflow after an lr decay, skipped_steps rates, overflow_risk, underflow
when late gradients get small).

Every run shares one loop (`fit`), the loop people write: a fixed training set reshuffled each epoch (a seeded
permutation per epoch, `drop_last`), an occasional hard batch (a few steps where a quarter of the batch is
out-of-distribution or mislabelled), zero_grad -> forward under `torch.autocast("cpu", dtype)` ->
`scaler.scale(loss).backward()` -> `unscale_` -> clip_grad_norm_ (where said) -> `scaler.step` -> `scaler.update`
-> `sched.step()`; an eval pass every 100 steps (`model.eval()`, `torch.no_grad()`, autocast, two held-out
batches, back to `train()`); and a checkpoint round-trip near mid-run (model, optimizer, scaler and scheduler
`state_dict`s through `torch.save`/`torch.load` of a BytesIO, loaded back with `load_state_dict`, as a resume in
the same process does). fp16 runs use `GradScaler("cpu", growth_interval=200)` (the default init scale 2**16, so
the scale grows several times and probes past what the gradients allow: the pattern of any long fp16 run with the
default growth_interval=2000, ten times faster); bf16 runs pass a `GradScaler("cpu", enabled=False)` (the common
`GradScaler(enabled=dtype == torch.float16)` idiom). fp32 parameters, weight decay everywhere.

Each run is first asserted healthy by the test's own oracle: every training and eval loss finite; the mean of the
last tenth of the training losses below a fraction of the first tenth's; the eval loss fell; every step the scaler
skipped (its scale went down at that update) is either part of the first search (no step applied yet) or a single
probe (a skip at a scale that a growth had just reached: see below), and the scale after the checkpoint
round-trip is the one saved. Then it is judged: the report has no warning and no error (info is fine) and
ampdoctor did not switch itself off (`summary.internal_error`).

Cases (fp32 parameters under autocast; growths/probes as measured, the same with ONEDNN_MAX_CPU_ISA=AVX2 unless
said):
 1. mlp_cosine: a 3-layer GELU MLP classifier (10 classes from a random tanh teacher, 6400 samples, batch 64),
    fp16, AdamW wd 0.01, CosineAnnealingLR to 0, 1000 steps; hard batches with a quarter of the labels wrong; the
    scale grows to 2**19 and probes fail at steps 612 and 830 (single skips, 13 and 18 steps after a growth);
 2. cnn_step_decay: Conv-BN-ReLU x2 + pooling + Linear on 8x8 bar images (4 orientations), batch 16, fp16, SGD
    nesterov momentum 0.9, wd 5e-4, MultiStepLR x0.1 at 60% and 80% (the ResNet recipe), 600 steps; BatchNorm's
    running statistics in the eval passes; hard batches with a quarter of the images x2.5 (one probe skip with AVX2);
 3. transformer_onecycle: 2 pre-LN nn.TransformerEncoderLayer (d 32, 4 heads) reversing 6-token sequences, fp16,
    AdamW wd 0.01 under OneCycleLR (warmup to 3e-3, anneal to 3e-3/1e4), clip 1.0 after unscale_, 600 steps; its
    eval passes take PyTorch's fused encoder fast path (eval + no_grad);
 4. lstm_step_decay: an LSTM written out with Linear gates (nn.LSTM has no fp16 CPU kernel: oneDNN refuses the
    primitive under autocast, on AVX512-FP16 and AVX2 alike) that must output the mean of its first 3 inputs after
    8 steps, fp16, Adam wd 1e-5, clip 1.0, MultiStepLR x0.1 at 60%/80%, 600 steps, hard batches x2;
 5. autoencoder_bf16: a tanh MLP autoencoder (64 -> 8 -> 64) on rank-6 data plus noise, bf16 autocast (the scaler
    disabled), AdamW cosine, 1000 steps;
 6. diffusion_denoiser: a DDPM-style noise predictor for 8-D points on a closed curve, sinusoidal timestep
    embeddings through an MLP added in every residual block (cosine alpha-bar, 1000 timesteps, a fresh t and noise
    per batch), fp16, AdamW with 50 warmup steps then cosine, 800 steps: the scale reaches 2**20;
 7. contrastive_two_tower: two MLP towers, L2-normalised embeddings, CLIP's learnable logit scale (init 1/0.07,
    exp clamped at 100), symmetric InfoNCE over the batch of 64 pairs, fp16, AdamW one-cycle, 800 steps;
 8. heavy_tailed_regression: an MLP regressing targets with Student-t (df 2) noise under a Huber loss (delta 1),
    fp16, SGD momentum 0.9 wd 1e-4, MultiStepLR x0.1 at 60%/80%, 1000 steps: outlier batches overflow the fp16 backward
    at a freshly grown scale (probe skips at 255, 464 and 868, each the first skip at a scale a growth had reached);
 9. vanishing_gradients_late: a noiseless smooth regression (tanh MLP, fp16, Adam, cosine to 0): the loss falls
    45x and the late gradients are small; the scale climbs to 2**21 and keeps them in fp16's normal range.

Oracle's probe, precisely: GradScaler grows after growth_interval clean steps, so a skip at a scale reached by a
growth, before that scale was itself held clean for growth_interval steps, is the scaler testing an unproven scale
(the run of the scale began with a growth); a skip at a scale reached by a backoff (already proven) or a second skip
in a row is not allowed. The watch must also have counted every step and the same number of skips as the test
(`summary.steps`, `summary.skipped_steps`), and every fp16 run's scale grew at least twice.

Result: 9 runs, all quiet at the defaults (the probe skips are a single `info` skipped_steps; no headroom_trend,
update_spike, update_underflow, overflow_risk or underflow late in the runs, after the lr decays or across the
checkpoint round-trip and the eval passes). Nothing ampdoctor got wrong here; no xfails. Runtime about 18-23 s
(9 runs, one thread, on a loaded 2-core machine).
"""
from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16


# --- the loop -----------------------------------------------------------------------------------------------------

class Data:
    """A fixed training set reshuffled each epoch (seeded permutation, drop_last) and a held-out set."""

    def __init__(self, X, Y, B, n_val, seed=0):
        self.X, self.Y, self.Xv, self.Yv = X[n_val:], Y[n_val:], X[:n_val], Y[:n_val]
        self.B, self.seed = B, seed
        self.per_epoch = len(self.X) // B

    def batch(self, i):
        e, k = divmod(i, self.per_epoch)
        idx = torch.randperm(len(self.X), generator=gen(self.seed * 1000 + e))[k * self.B:(k + 1) * self.B]
        return self.X[idx].clone(), self.Y[idx].clone()

    def val(self):
        h = len(self.Xv) // 2
        return [(self.Xv[:h], self.Yv[:h]), (self.Xv[h:], self.Yv[h:])]


def fit(model, data, loss_fn, opt, sched, *, steps, dtype=FP16, clip=None, harden=None, hard_every=173):
    """The long-run loop; returns (watch, losses, eval losses, scales before / after each update, ckpt step)."""
    sc = torch.amp.GradScaler("cpu", growth_interval=200, enabled=dtype == FP16)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc)
    losses, evals, before, after = [], [], [], []
    ckpt_at = steps // 2 + 7
    for i in range(steps):
        x, y = data.batch(i)
        if harden and i % hard_every == hard_every - 1:
            x, y = harden(x, y, i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, x, y)
        sc.scale(loss).backward()
        if clip:
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before.append(sc.get_scale())
        sc.step(opt)
        sc.update()
        after.append(sc.get_scale())
        sched.step()
        losses.append(loss.item())
        if i % 100 == 99:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
                evals.append(sum(loss_fn(model, xv, yv).item() for xv, yv in data.val()) / 2)
            model.train()
        if i == ckpt_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict(),
                        "sched": sched.state_dict()}, buf)
            buf.seek(0)
            ck = torch.load(buf, weights_only=False)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sc.load_state_dict(ck["scaler"])
            sched.load_state_dict(ck["sched"])
            assert sc.get_scale() == after[-1]
    w.close()
    return w, losses, evals, before, after


def assert_healthy(losses, evals, before, after, fall, eval_fall=1.0):
    assert losses and all(map(math.isfinite, losses)), [l for l in losses if not math.isfinite(l)][:5]
    assert evals and all(map(math.isfinite, evals)), evals
    k = max(3, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < fall * first, (first, last)
    assert evals[-1] < eval_fall * evals[0], evals
    applied = grown = False
    bad = []
    for i, (b, a) in enumerate(zip(before, after)):
        if i and b != before[i - 1]:
            grown = b > before[i - 1]                    # this scale was reached by a growth (not a backoff)
        if a < b:                                        # the scaler skipped step i
            if applied and not grown:                    # neither the first search nor a probe
                bad.append((i, b, a))
        else:
            applied = True
    assert not bad, ("skips that are neither the first search nor a single probe", bad)
    return sum(a < b for b, a in zip(before, after))


def quiet(w):
    rep = w.report()
    summary = rep.to_dict()["summary"]
    assert not alarms(rep.findings) and not summary.get("internal_error"), \
        [f.one_line() for f in rep.findings] + [summary.get("verdict"), summary.get("internal_error")]
    return rep


def cosine(opt, steps):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)


def step_decay(opt, steps):
    return torch.optim.lr_scheduler.MultiStepLR(opt, [int(0.6 * steps), int(0.8 * steps)], 0.1)


def one_cycle(opt, steps, lr):
    return torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps)


def warm_cosine(opt, steps, warm):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / (steps - warm)))))


def ce(model, x, y):
    return F.cross_entropy(model(x).float(), y)


def mse(model, x, y):
    return F.mse_loss(model(x).float(), y)


def ood(scale=3.0, share=4):
    """A hard batch: a quarter of the samples out of distribution (inputs x `scale`)."""
    def f(x, y, i):
        x = x.clone()
        x[: len(x) // share] *= scale
        return x, y
    return f


def relabel(k):
    """A hard batch: a quarter of the labels wrong (label noise)."""
    def f(x, y, i):
        y = y.clone()
        y[: len(y) // 4] = torch.randint(0, k, (len(y) // 4,), generator=gen(i))
        return x, y
    return f


# --- the cases ----------------------------------------------------------------------------------------------------

def case_mlp_cosine():
    g = gen(1)
    X = torch.randn(6656, 32, generator=g)
    w1, w2 = torch.randn(32, 64, generator=g), torch.randn(64, 10, generator=g)
    Y = (torch.tanh(X @ w1) @ w2).argmax(-1)
    m = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
    steps = 1000
    return dict(model=m, data=Data(X, Y, 64, 256), loss_fn=ce, opt=opt, sched=cosine(opt, steps), steps=steps,
                harden=relabel(10), fall=0.65)


def bars(n, g, size=8):
    """Images with one bar (horizontal, vertical, diagonal, anti-diagonal) at a random place, plus noise."""
    y = torch.randint(0, 4, (n,), generator=g)
    X = 0.3 * torch.randn(n, 1, size, size, generator=g)
    pos = torch.randint(1, size - 1, (n,), generator=g)
    r = torch.arange(size)
    for j in range(n):
        p, c = int(pos[j]), int(y[j])
        if c == 0:
            X[j, 0, p, :] += 1
        elif c == 1:
            X[j, 0, :, p] += 1
        elif c == 2:
            X[j, 0, r, r] += 1
        else:
            X[j, 0, r, size - 1 - r] += 1
    return X, y


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                               nn.Conv2d(4, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(2))
        self.fc = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc(self.f(x).flatten(1))


def case_cnn_step_decay():
    X, Y = bars(1088, gen(2))
    m = CNN()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = 600
    return dict(model=m, data=Data(X, Y, 16, 64), loss_fn=ce, opt=opt, sched=step_decay(opt, steps), steps=steps,
                harden=ood(2.5), fall=0.5)


class Seq2Seq(nn.Module):
    def __init__(self, vocab=12, d=32, T=8):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.enc(h)))


def seq_ce(model, x, y):
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def reverse_data(seed):
    X = torch.randint(0, 12, (1088, 6), generator=gen(seed))
    return Data(X, X.flip(1), 16, 64, seed=seed)


def case_transformer_onecycle():
    m = Seq2Seq()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    steps = 600
    return dict(model=m, data=reverse_data(3), loss_fn=seq_ce, opt=opt, sched=one_cycle(opt, steps, 3e-3),
                steps=steps, clip=1.0, fall=0.3)


class Recall(nn.Module):
    """An LSTM written out (nn.LSTM has no fp16 kernel on the CPU: oneDNN refuses the primitive under autocast):
    the input projection for all steps at once, then the recurrent projection step by step."""

    def __init__(self, h=24):
        super().__init__()
        self.x2g, self.h2g = nn.Linear(1, 4 * h), nn.Linear(h, 4 * h, bias=False)
        self.head, self.h = nn.Linear(h, 1), h

    def forward(self, x):
        gx = self.x2g(x)
        h = c = torch.zeros(x.shape[0], self.h)
        for t in range(x.shape[1]):
            i, f, g, o = (gx[:, t] + self.h2g(h)).chunk(4, -1)
            c = torch.sigmoid(f + 1) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return self.head(h).squeeze(-1)


def case_lstm_step_decay():
    X = torch.randn(1152, 8, 1, generator=gen(4))
    Y = X[:, :3, 0].mean(1)
    m = Recall()
    opt = torch.optim.Adam(m.parameters(), lr=5e-3, weight_decay=1e-5)
    steps = 600
    return dict(model=m, data=Data(X, Y, 32, 128), loss_fn=mse, opt=opt, sched=step_decay(opt, steps), steps=steps,
                clip=1.0, harden=ood(2.0), fall=0.5)


def case_autoencoder_bf16():
    g = gen(5)
    Z = torch.randn(2304, 6, generator=g)
    X = torch.tanh(Z @ torch.randn(6, 64, generator=g) / 2) + 0.05 * torch.randn(2304, 64, generator=g)
    m = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 32), nn.Tanh(),
                      nn.Linear(32, 64))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    steps = 1000

    def recon(model, x, y):
        return F.mse_loss(model(x).float(), x)
    return dict(model=m, data=Data(X, X, 64, 256), loss_fn=recon, opt=opt, sched=cosine(opt, steps), steps=steps,
                dtype=BF16, harden=ood(2.0), fall=0.5)


def timestep_embedding(t, dim=32):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    a = t.float()[:, None] * freqs[None]
    return torch.cat([a.sin(), a.cos()], -1)


class Denoiser(nn.Module):
    def __init__(self, d=8, h=64):
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(32, h), nn.SiLU(), nn.Linear(h, h))
        self.inp = nn.Linear(d, h)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(h), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
                                    for _ in range(2))
        self.out = nn.Linear(h, d)

    def forward(self, x, t):
        e = self.temb(timestep_embedding(t))
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h + e)
        return self.out(h)


def case_diffusion_denoiser():
    g = gen(6)
    s = torch.rand(2304, 1, generator=g) * 2 * math.pi
    X0 = torch.cat([torch.sin(s * k) for k in range(1, 5)] + [torch.cos(s * k) for k in range(1, 5)], 1)
    T = 1000
    ab = torch.cos((torch.arange(T) / T + 0.008) / 1.008 * math.pi / 2) ** 2
    m = Denoiser()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
    steps = 800
    state = {"i": 0}

    def eps_loss(model, x0, y):
        # a fresh timestep and noise per call, seeded by the sample content (deterministic)
        state["i"] += 1
        gg = gen(100_000 + state["i"])
        t = torch.randint(0, T, (len(x0),), generator=gg)
        eps = torch.randn(x0.shape, generator=gg)
        a = ab[t][:, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
        return F.mse_loss(model(xt, t).float(), eps)
    return dict(model=m, data=Data(X0, X0, 64, 256), loss_fn=eps_loss, opt=opt, sched=warm_cosine(opt, steps, 50),
                steps=steps, fall=0.6, eval_fall=1.0)


class TwoTower(nn.Module):
    def __init__(self, d=24, h=64, e=32):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, e))
        self.k = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, e))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a, b):
        qa, kb = F.normalize(self.q(a), dim=-1), F.normalize(self.k(b), dim=-1)
        return self.logit_scale.exp().clamp(max=100) * qa @ kb.t()


def case_contrastive_two_tower():
    g = gen(7)
    Z = torch.randn(2304, 24, generator=g)
    A = torch.randn(24, 24, generator=g) / math.sqrt(24)
    V = torch.tanh(Z @ A) + 0.1 * torch.randn(2304, 24, generator=g)   # the paired view
    m = TwoTower()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
    steps = 800

    def infonce(model, a, b):
        logits = model(a, b).float()
        lab = torch.arange(len(a))
        return (F.cross_entropy(logits, lab) + F.cross_entropy(logits.t(), lab)) / 2
    return dict(model=m, data=Data(Z, V, 64, 256), loss_fn=infonce, opt=opt, sched=one_cycle(opt, steps, 2e-3),
                steps=steps, harden=ood(2.0), fall=0.5)


def case_heavy_tailed_regression():
    g = gen(8)
    X = torch.randn(2304, 16, generator=g)
    w = torch.randn(16, generator=g)
    u = torch.randn(2304, generator=g) / torch.randn(2304, 2, generator=g).pow(2).mean(1).sqrt()  # Student-t, df 2
    Y = torch.sin(X @ w / 2) * 3 + X[:, 0] + 0.5 * u
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1), nn.Flatten(0))
    opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    steps = 1000

    def huber(model, x, y):
        return F.huber_loss(model(x).float(), y, delta=1.0)
    return dict(model=m, data=Data(X, Y, 64, 256), loss_fn=huber, opt=opt, sched=step_decay(opt, steps), steps=steps,
                fall=0.6)


def case_vanishing_gradients_late():
    g = gen(9)
    X = torch.rand(2304, 4, generator=g) * 2 - 1
    Y = torch.sin(2 * X[:, :1]) * torch.cos(X[:, 1:2]) + 0.5 * X[:, 2:3] * X[:, 3:4]
    m = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    steps = 1000
    return dict(model=m, data=Data(X, Y, 64, 256), loss_fn=mse, opt=opt, sched=cosine(opt, steps), steps=steps,
                fall=0.05)


CASES = {
    "mlp_cosine": case_mlp_cosine,
    "cnn_step_decay": case_cnn_step_decay,
    "transformer_onecycle": case_transformer_onecycle,
    "lstm_step_decay": case_lstm_step_decay,
    "autoencoder_bf16": case_autoencoder_bf16,
    "diffusion_denoiser": case_diffusion_denoiser,
    "contrastive_two_tower": case_contrastive_two_tower,
    "heavy_tailed_regression": case_heavy_tailed_regression,
    "vanishing_gradients_late": case_vanishing_gradients_late,
}


@pytest.mark.parametrize("name", list(CASES))
def test_long_healthy_run_is_quiet(name):
    torch.manual_seed(0)
    c = CASES[name]()
    dtype = c.get("dtype", FP16)
    w, losses, evals, before, after = fit(c["model"], c["data"], c["loss_fn"], c["opt"], c["sched"],
                                          steps=c["steps"], dtype=dtype, clip=c.get("clip"), harden=c.get("harden"))
    skips = assert_healthy(losses, evals, before, after, c["fall"], c.get("eval_fall", 1.0))
    if dtype == FP16:                                   # the long-run premise: the scale grew again and again
        assert sum(b > a for a, b in zip(after, after[1:])) >= 2, sorted(set(after))
    rep = quiet(w)
    summary = rep.to_dict()["summary"]
    assert summary["steps"] == c["steps"] and summary["skipped_steps"] == skips, summary
