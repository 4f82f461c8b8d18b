"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`, nothing else; a few also
at `every=1`), twelfth set: HEALTHY fp16 runs (fp32 parameters, `torch.autocast("cpu", dtype=torch.float16)`,
`torch.amp.GradScaler("cpu")`; a few bf16 autocast runs without a scaler) that look suspicious to a naive detector
- a saw-tooth loss scale, activations that grow, large activations, periodic lr jumps, tiny weights, a loss near
zero, modules run twice - long enough (100-240 steps) for the trend and early-warning rules (headroom_trend,
update_spike, skipped_steps) to have a chance to misfire. Tiny models, fixed seeds, CPU.

Each run is first asserted healthy by the test's own oracle: every loss finite, the loss falls (by the stated
factor), and GradScaler skipped steps only as designed: its first search (consecutive halvings before the first
applied update), then single skips only (never two running): the probes of a scale it had just grown (above the
scale that earned its latest growth), and at most 5 other single halvings (none in case 1) as the gradients grow
while the model fits; the scale never below 128. Then it is judged: no warning and no error in the report (info
is fine) and ampdoctor did not switch itself off (`summary.internal_error`).

Scenarios:
 1. [growth_interval 25 and 10, each at default and every=1] the saw-tooth: GradScaler("cpu", growth_interval=gi)
    on a classifier whose summed cross-entropy (`reduction="sum"`, 15% label noise: the gradients never vanish)
    overflows fp16's backward above a fixed scale: after the first search (65536 -> 4096) the scale doubles every
    gi clean steps and that probe backs off once, over and over (180 steps; checked: >= 5 probes, all at the one
    scale 8192, every later skip a probe, never two running). A small growth_interval is what fairseq's
    `--fp16-scale-window` / Megatron's `loss_scale_window` expose, and a saw-tooth scale plot is the normal
    picture of dynamic loss scaling (1 probe in gi + 1 steps is its designed cost);
 2. a long linear warmup (60 of 160 steps, Adam 1e-2) on an un-normalised ReLU MLP regression (targets of amplitude
    60): the hidden layer's abs-max grows ~x30 (1 -> ~28; checked > x15) while it fits, then settles (checked: no
    growth over the last 60 steps); the scaler halves a few more times on the way, one skip at a time;
 3. [default, every=1] large but stable activations ~1e4: a price-like target in raw units (1e4 + 500 * f(x)), the
    output bias initialised at the target mean (a common trick), an L1 (MAE) loss in fp32 on the fp16 output
    (checked: every output between 9e3 and 1.5e4 on every step); the scaler settles a few halvings down as the
    output layer's weights grow;
 4. a frozen fp16 embedding table (pretrained word vectors stored in half, `requires_grad_(False)`) under a trained
    fp32 head, the optimizer holding the head only;
 5. gradient accumulation over 4 micro-batches (`scaler.scale(loss / 4).backward()` each), one `unscale_` + clip +
    step + update per optimizer step (the PyTorch AMP docs' recipe);
 6. [fp16, bf16] two losses backwarded separately (`retain_graph=True` on the first) through a shared trunk, then one
    unscale_/clip/step/update (PyTorch AMP docs, "multiple losses");
 7. an EMA copy of the model (timm ModelEmaV2-style, decay 0.98, a separate unwatched module) updated after every
    step and evaluated under autocast every 10 steps (checked: its eval loss falls too);
 8. [fp16, bf16] stochastic depth and dropout whose rates change every step (a random drop-path rate in [0, 0.3] and
    dropout in [0, 0.2] per step, as in curriculum-dropout/schedule-drop-path recipes) on a residual MLP;
 9. [fp16, fp16 every=1, bf16] cosine annealing with warm restarts (SGDR, `CosineAnnealingWarmRestarts(T_0=30)`,
    180 steps): the lr jumps from < 3e-5 back to 3e-3 every 30 steps, so every restart's update is > 100x the one
    before it;
10. weight decay driving the weights of dead input features (16 always-zero columns: sensors that are never wired)
    to tiny values: SGD momentum 0.9, lr 0.05, L2 0.1 on the input layer only (a compressed long run: lr 0.1 and
    wd 5e-4 over 100k steps shrink them as much), 200 steps; those fp32 weights shrink by > x1e3 and more than half
    fall below fp16's normal range when autocast casts them (checked), the live weights train;
11. sparse embeddings: `nn.Embedding(sparse=True)` stepped by SparseAdam (fp32) beside AdamW on the dense tower, one
    scaler, both optimizers unscaled, the dense one clipped; the watch is given the AdamW;
12. [fp16, fp16 every=1, bf16] `torch.utils.checkpoint.checkpoint(use_reentrant=False)` on two of four blocks;
13. [default, every=1] a shared encoder called twice per step (a Siamese regression of a pair's distance);
14. a loss that legitimately becomes very small: a teacher of the student's own shape (its weights + 0.03 noise),
    Adam 1e-2 with cosine decay over 240 steps; the MSE falls from ~7e-3 to ~1.5e-5 (checked < 5e-5 over the last
    20 steps) while the scaler keeps working.

Results: 25 runs (14 designs), all quiet: the saw-tooth at growth_interval 25 and 10, the x30 warmup growth, the
~1e4 outputs, the frozen fp16 table, accumulation, two backwards, the EMA, per-step drop rates, SGDR's restarts
(no update_spike), the decayed dead weights (no underflow), SparseAdam beside AdamW, checkpointed blocks, the
twice-called encoder and the ~1e-5 loss. (Every design but 1 was also run at every=1 and every=3 while writing
this file: all quiet.)

What ampdoctor got wrong (fixed since): at growth_interval=10 every later skip is the probe of a just-doubled scale
(4096 -> 8192) at about the designed rate 1/(gi + 1); it was a `skipped_steps` warning ("skipped 14 of 176 steps
after warm-up (8%)") and at every=1 also an `overflow` error at `4` step 0, because rules/backoff.py benign_backoff
counted the probes against its 5% `later_share`. Single probes above the scale that earned the growth are now
benign up to 1 in 8 steps (`PROBE_SHARE`).
"""
from __future__ import annotations

import copy
import functools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, one_thread, quiet_watch  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

quiet = functools.partial(quiet_watch, close=True, internal=True)  # closed first; no internal error either

FP16, BF16 = torch.float16, torch.bfloat16
EVERY = pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])
DTYPES = pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# --- helpers ------------------------------------------------------------------------------------------------------

def watch(model, opt, sc=None, every=None):
    return ampdoctor.watch(model, optimizer=opt, scaler=sc, **({} if every is None else {"every": every}))


def falls(losses, fall=0.8, k=None):
    """Every loss finite; the mean of the last k below `fall` x the mean of the first k."""
    assert losses and all(map(math.isfinite, losses)), losses
    k = k or max(3, len(losses) // 10)
    assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, (losses[:k], losses[-k:])


class Scales:
    """The test's record of GradScaler: the scale before each step and whether that step was skipped."""

    def __init__(self, sc):
        self.sc, self.before, self.skipped = sc, [], []

    def pre(self):
        self.before.append(self.sc.get_scale() if self.sc else None)

    def post(self):
        # GradScaler backs off (scale * 0.5) exactly when it skipped the optimizer step
        self.skipped.append(bool(self.sc) and self.sc.get_scale() < self.before[-1])

    def growths(self):
        s = self.before
        return sum(1 for a, b in zip(s, s[1:]) if b > a)

    def normal(self, min_scale=2.0 ** 7, max_other=5):
        """Skips only as GradScaler is designed to skip: its first search (consecutive halvings before the first
        applied update), then single backoffs only (each followed at once by an applied step): the probes of a scale
        just grown (above the scale that earned the latest growth), any number, and at most `max_other` other single
        halvings (the gradients growing while the model fits); the scale never below `min_scale`."""
        if not self.sc:
            assert not any(self.skipped)
            return
        first = self.skipped.index(False)
        later = [i for i in range(first, len(self.skipped)) if self.skipped[i]]
        assert all(b - a >= 2 for a, b in zip(later, later[1:])), later
        base, other = None, []
        for i in range(first + 1, len(self.before)):
            if self.before[i] > self.before[i - 1]:
                base = self.before[i - 1]
            if self.skipped[i] and not (base is not None and self.before[i] > base):
                other.append(i)
        assert len(other) <= max_other, (other, later)
        assert min(self.before) >= min_scale, min(self.before)

    def later_scales(self):
        first = self.skipped.index(False)
        return [self.before[i] for i in range(first, len(self.skipped)) if self.skipped[i]]


def amp_step(model, opt, sc, rec, loss_fn, dtype=FP16, clip=1.0, params=None):
    """One step of the PyTorch AMP recipe: autocast forward, scale(loss).backward, unscale_, clip, step, update."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype):
        loss = loss_fn()
    rec.pre()
    if sc:
        sc.scale(loss).backward()
        sc.unscale_(opt)
    else:
        loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(params if params is not None else model.parameters(), clip)
    if sc:
        sc.step(opt)
        sc.update()
    else:
        opt.step()
    rec.post()
    return loss.item()


def scaler_for(dtype, **kw):
    return torch.amp.GradScaler("cpu", **kw) if dtype == FP16 else None


def mlp(d=16, h=64, k=8, act=nn.GELU):
    return nn.Sequential(nn.Linear(d, h), act(), nn.Linear(h, h), act(), nn.Linear(h, k))


def teacher_data(i, B=128, d=16, k=8, seed=11, noise=0.0):
    """A fixed random 2-layer teacher's labels for fresh inputs each step (optionally a share flipped at random)."""
    g = gen(seed)
    w1, w2 = torch.randn(d, 32, generator=g), torch.randn(32, k, generator=g)
    gi = gen(1000 + i)
    x = torch.randn(B, d, generator=gi)
    y = (torch.tanh(x @ w1) @ w2).argmax(-1)
    if noise:
        flip = torch.rand(B, generator=gi) < noise
        y = torch.where(flip, torch.randint(0, k, (B,), generator=gi), y)
    return x, y


def reg_data(i, B=64, d=16, k=4, seed=7, amp=1.0, off=0.0):
    g = gen(seed)
    a = torch.randn(d, k, generator=g) / math.sqrt(d) * 2
    x = torch.randn(B, d, generator=gen(100 + i))
    return x, torch.tanh(x @ a) * amp + off


# --- 1. the saw-tooth loss scale ----------------------------------------------------------------------------------

@pytest.mark.parametrize("gi,every", [
    (25, None), (25, 1),
    (10, None), (10, 1),
], ids=["gi25-default", "gi25-every1", "gi10-default", "gi10-every1"])
def test_sawtooth_scale_growth_every_interval_then_one_backoff(gi, every):
    m = mlp(h=128)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu", growth_interval=gi)
    rec = Scales(sc)
    w = watch(m, opt, sc, every)
    losses = []
    for i in range(180):
        x, y = teacher_data(i, noise=0.15)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.cross_entropy(m(x).float(), y, reduction="sum"), clip=None))
    falls(losses, 0.8)
    rec.normal(max_other=0)
    # the saw-tooth: after the first search, >= 5 probes, each one growth above the one working scale, backed off
    probes = rec.later_scales()
    assert len(probes) >= 5 and len(set(probes)) == 1 and rec.growths() >= 5, (probes, rec.growths())
    quiet(w)


# --- 2. long warmup, activations grow x30 then settle ---------------------------------------------------------

def test_long_warmup_activations_grow_x30_then_settle():
    m = mlp(k=4, act=nn.ReLU)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 60))
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    peaks = []
    m[2].register_forward_hook(lambda mod, a, out: peaks.append(float(out.detach().abs().max())))
    w = watch(m, opt, sc)
    losses = []
    for i in range(160):
        x, y = reg_data(i, amp=60.0)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.mse_loss(m(x).float(), y), clip=None))
        sched.step()
    falls(losses, 0.2)
    rec.normal()
    # the hidden layer's abs-max grows ~x30 over the warmup, then stays (no growth over the last 60 steps)
    assert max(peaks[100:]) / peaks[0] > 15 and max(peaks[130:]) < 1.3 * max(peaks[100:130]), \
        (peaks[:3], peaks[100:110], peaks[-5:])
    quiet(w)


# --- 3. large stable activations ~1e4 -----------------------------------------------------------------------------

@EVERY
def test_large_stable_outputs_around_1e4_unnormalised_target(every):
    m = mlp(k=1)
    with torch.no_grad():
        m[-1].bias.fill_(1e4)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-2)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    peaks = []
    m[-1].register_forward_hook(lambda mod, a, out: peaks.append(float(out.detach().abs().max())))
    w = watch(m, opt, sc, every)
    losses = []
    for i in range(150):
        x, y = reg_data(i, k=1, amp=500.0, off=1e4)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.l1_loss(m(x).float(), y)))
    falls(losses, 0.3)
    rec.normal()
    assert 9e3 < min(peaks) and max(peaks) < 1.5e4, (min(peaks), max(peaks))
    quiet(w)


# --- 4. frozen fp16 embedding + trained head ----------------------------------------------------------------------

class FrozenVectors(nn.Module):
    def __init__(self, V=400, d=48, k=4):
        super().__init__()
        self.emb = nn.Embedding(V, d).half().requires_grad_(False)  # pretrained vectors kept in half
        self.head = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, k))

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def bag_data(i, emb, B=64, T=12, k=4):
    g = gen(5000 + i)
    ids = torch.randint(0, emb.num_embeddings, (B, T), generator=g)
    proj = torch.randn(emb.embedding_dim, k, generator=gen(9))
    y = (emb.weight.float()[ids].mean(1) @ proj).argmax(-1)
    return ids, y


def test_frozen_fp16_embedding_trained_head():
    m = FrozenVectors()
    frozen = m.emb.weight.detach().clone()
    opt = torch.optim.AdamW(m.head.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    w = watch(m, opt, sc)
    losses = []
    for i in range(150):
        ids, y = bag_data(i, m.emb)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.cross_entropy(m(ids).float(), y),
                               params=m.head.parameters()))
    falls(losses, 0.7)
    rec.normal()
    assert torch.equal(m.emb.weight, frozen) and m.emb.weight.grad is None
    quiet(w)


# --- 5. gradient accumulation over 4 micro-batches ------------------------------------------------------------------

def test_gradient_accumulation_4_micro_batches_one_unscale():
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    w = watch(m, opt, sc)
    losses = []
    for i in range(100):
        opt.zero_grad(set_to_none=True)
        tot = 0.0
        for j in range(4):
            x, y = teacher_data(4 * i + j, B=32)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y) / 4
            sc.scale(loss).backward()
            tot += float(loss)
        rec.pre()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        rec.post()
        losses.append(tot)
    falls(losses, 0.6)
    rec.normal()
    quiet(w)


# --- 6. two losses backwarded separately, one step ------------------------------------------------------------------

class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.cls, self.reg = nn.Linear(64, 8), nn.Linear(64, 4)

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


@DTYPES
def test_two_losses_backwarded_separately_then_one_step(dtype):
    m = TwoHeads()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = scaler_for(dtype)
    rec = Scales(sc)
    w = watch(m, opt, sc)
    losses = []
    for i in range(120):
        x, y = teacher_data(i, B=64)
        r = reg_data(i, B=64)[1] + torch.tanh(x[:, :4])
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            logits, pred = m(x)
            l1 = F.cross_entropy(logits.float(), y)
            l2 = F.mse_loss(pred.float(), r)
        rec.pre()
        if sc:
            sc.scale(l1).backward(retain_graph=True)
            sc.scale(l2).backward()
            sc.unscale_(opt)
        else:
            l1.backward(retain_graph=True)
            l2.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        rec.post()
        losses.append(l1.item() + l2.item())
    falls(losses, 0.6)
    rec.normal()
    quiet(w)


# --- 7. EMA copy of the model ---------------------------------------------------------------------------------------

def test_ema_copy_updated_each_step_evaluated_under_autocast():
    m = mlp()
    ema = copy.deepcopy(m).requires_grad_(False).eval()  # timm ModelEmaV2: a separate module, not watched
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    xv, yv = teacher_data(99999, B=256)
    evals = []
    w = watch(m, opt, sc)
    losses = []
    for i in range(150):
        x, y = teacher_data(i)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.cross_entropy(m(x).float(), y)))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), m.parameters()):
                pe.lerp_(pm, 0.02)
        if i % 10 == 0:
            with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
                evals.append(float(F.cross_entropy(ema(xv).float(), yv)))
    falls(losses, 0.6)
    falls(evals, 0.7, k=3)
    rec.normal()
    quiet(w)


# --- 8. stochastic depth / dropout varying per step -----------------------------------------------------------------

class DropPathBlock(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)
        self.drop_path = 0.0

    def forward(self, x):
        h = self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))
        if self.training and self.drop_path > 0:
            keep = (torch.rand(x.shape[0], 1, device=x.device) >= self.drop_path).to(h.dtype)
            h = h * keep / (1 - self.drop_path)
        return x + h


class ResMLP(nn.Module):
    def __init__(self, d=64, n=4, k=8):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(16, d), nn.ModuleList(DropPathBlock(d) for _ in range(n)), \
            nn.Linear(d, k)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@DTYPES
def test_stochastic_depth_and_dropout_rates_change_every_step(dtype):
    m = ResMLP()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = scaler_for(dtype)
    rec = Scales(sc)
    g = gen(77)
    w = watch(m, opt, sc)
    losses = []
    for i in range(120):
        rate, p = float(torch.rand((), generator=g)) * 0.3, float(torch.rand((), generator=g)) * 0.2
        for k, b in enumerate(m.blocks):
            b.drop_path = rate * (k + 1) / len(m.blocks)
            b.drop.p = p
        x, y = teacher_data(i)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.cross_entropy(m(x).float(), y), dtype=dtype))
    falls(losses, 0.7)
    rec.normal()
    quiet(w)


# --- 9. cosine annealing with warm restarts -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype,every", [(FP16, None), (FP16, 1), (BF16, None)], ids=["fp16", "fp16_every1", "bf16"])
def test_cosine_warm_restarts_periodic_lr_jumps(dtype, every):
    m = mlp(h=96)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=30, eta_min=0.0)
    sc = scaler_for(dtype)
    rec = Scales(sc)
    w = watch(m, opt, sc, every)
    losses, lrs = [], []
    for i in range(180):
        x, y = teacher_data(i)
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(amp_step(m, opt, sc, rec, lambda: F.cross_entropy(m(x).float(), y), dtype=dtype))
        sched.step()
    falls(losses, 0.6)
    rec.normal()
    assert lrs[29] < 3e-5 and lrs[30] == 3e-3 and lrs[150] == 3e-3
    quiet(w)


# --- 10. weight decay drives dead-feature weights to tiny values ----------------------------------------------------

def test_weight_decay_drives_dead_feature_weights_tiny():
    m = mlp(d=32, k=4)
    # L2 on the input layer only (the others in a no-decay group), SGD with momentum
    opt = torch.optim.SGD([{"params": [m[0].weight], "weight_decay": 0.1},
                           {"params": [p for n, p in m.named_parameters() if n != "0.weight"], "weight_decay": 0.0}],
                          lr=0.05, momentum=0.9)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    w0 = m[0].weight.detach()[:, 16:].abs().max().item()
    w = watch(m, opt, sc)
    losses = []
    for i in range(200):
        x, y = reg_data(i, amp=2.0)
        x = torch.cat([x, torch.zeros(x.shape[0], 16)], 1)  # 16 never-wired sensors: always zero
        losses.append(amp_step(m, opt, sc, rec, lambda: F.mse_loss(m(x).float(), y)))
    falls(losses, 0.2)
    rec.normal()
    dead = m[0].weight.detach()[:, 16:]
    sub = (dead.abs() < torch.finfo(FP16).tiny).float().mean().item()
    assert dead.abs().max() < 1e-3 * w0 and sub > 0.5, (dead.abs().max(), w0, sub)
    assert m[0].weight.detach()[:, :16].abs().max() > 0.1
    quiet(w)


# --- 11. sparse embeddings with SparseAdam beside AdamW -------------------------------------------------------------

class SparseRec(nn.Module):
    def __init__(self, V=600, d=32, k=5):
        super().__init__()
        self.emb = nn.Embedding(V, d, sparse=True)
        self.tower = nn.Sequential(nn.Linear(d + 8, 64), nn.GELU(), nn.Linear(64, k))

    def forward(self, ids, dense):
        return self.tower(torch.cat([self.emb(ids).mean(1), dense], 1))


def test_sparse_embedding_sparse_adam_fp32_beside_adamw():
    m = SparseRec()
    labels = torch.randint(0, 5, (600,), generator=gen(5))
    sparse_opt = torch.optim.SparseAdam(list(m.emb.parameters()), lr=1e-2)
    opt = torch.optim.AdamW(m.tower.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    w = watch(m, opt, sc)
    losses = []
    for i in range(150):
        g = gen(i % 40)
        ids = torch.randint(0, 600, (64, 3), generator=g)
        dense = torch.randn(64, 8, generator=g)
        y = labels[ids[:, 0]]
        sparse_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(ids, dense).float(), y)
        rec.pre()
        sc.scale(loss).backward()
        assert m.emb.weight.grad.is_sparse
        sc.unscale_(sparse_opt)
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.tower.parameters(), 1.0)
        sc.step(sparse_opt)
        sc.step(opt)
        sc.update()
        rec.post()
        losses.append(loss.item())
    falls(losses, 0.75)
    rec.normal()
    assert m.emb.weight.dtype == torch.float32
    quiet(w)


# --- 12. activation checkpointing on some blocks --------------------------------------------------------------------

class CkptNet(nn.Module):
    def __init__(self, d=64, n=4, k=8):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n))
        self.out = nn.Linear(d, k)

    def forward(self, x):
        h = self.inp(x)
        for j, b in enumerate(self.blocks):
            h = h + (checkpoint(b, h, use_reentrant=False) if j % 2 == 0 and self.training else b(h))
        return self.out(h)


@pytest.mark.parametrize("dtype,every", [(FP16, None), (FP16, 1), (BF16, None)], ids=["fp16", "fp16_every1", "bf16"])
def test_activation_checkpointing_on_two_of_four_blocks(dtype, every):
    m = CkptNet()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = scaler_for(dtype)
    rec = Scales(sc)
    w = watch(m, opt, sc, every)
    losses = []
    for i in range(100):
        x, y = teacher_data(i)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.cross_entropy(m(x).float(), y), dtype=dtype))
    falls(losses, 0.7)
    rec.normal()
    quiet(w)


# --- 13. a shared encoder called twice per step ---------------------------------------------------------------------

class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, a, b):
        return self.head((self.enc(a) - self.enc(b)).abs()).squeeze(-1)


@EVERY
def test_shared_encoder_called_twice_per_step(every):
    m = Siamese()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    proj = torch.randn(16, 4, generator=gen(13))
    w = watch(m, opt, sc, every)
    losses = []
    for i in range(120):
        g = gen(7000 + i)
        a, b = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
        d = (torch.tanh(a @ proj) - torch.tanh(b @ proj)).norm(dim=-1)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.mse_loss(m(a, b).float(), d)))
    falls(losses, 0.3)
    rec.normal()
    quiet(w)


# --- 14. the loss becomes very small late in training ---------------------------------------------------------------

def test_loss_becomes_tiny_late_in_training():
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    target = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)).requires_grad_(False)
    with torch.no_grad():
        for p, q in zip(m.parameters(), target.parameters()):
            q.copy_(p + 0.03 * torch.randn(p.shape, generator=gen(31)))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    steps = 240
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=1e-4)
    sc = torch.amp.GradScaler("cpu")
    rec = Scales(sc)
    w = watch(m, opt, sc)
    losses = []
    for i in range(steps):
        x = torch.randn(128, 8, generator=gen(8000 + i))
        y = target(x)
        losses.append(amp_step(m, opt, sc, rec, lambda: F.mse_loss(m(x).float(), y), clip=None))
        sched.step()
    falls(losses, 1e-2)
    rec.normal()
    assert max(losses[-20:]) < 5e-5, losses[-20:]
    quiet(w)
