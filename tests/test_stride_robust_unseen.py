"""Stride robustness of the always-on headroom series, on runs ampdoctor has not seen: HEALTHY fp16 training whose
activations grow and then settle must stay quiet at EVERY stride of the series, and GENUINE runaways must still get
their `headroom_trend` early warning at every stride.

The default watch (headroom="auto") puts each layer's abs-max on one routine step in `stride`, the stride chosen
from timing, so it differs from machine to machine (CI's slow 2-core box picked 4 and drew a false warning
elsewhere). Each case runs at the default watch and with the stride pinned at 1, 2, 3, 4, 6, 8, 16 and 32
(tests/stride_sweep.install through monkeypatch; the pinned stride is checked from the records as in
test_healthy_near_max.py). fp16 CPU autocast + GradScaler("cpu"), one intra-op thread, the loop zero_grad ->
forward (per micro-batch) -> scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update.

Every scenario is first run UNWATCHED (the twin, with the test's own forward hooks on every module). Healthy: every
loss finite, no non-finite module output, the loss falling (last tenth < 0.9 x first tenth), at most 2 scaler
backoffs after step 20, the largest fp16 output in [256, 32768). Runaway: the first module whose output is
non-finite from finite inputs is the named layer, at the step given, and the loss is first non-finite there. Then
WATCHED: losses (NaN included) and final state_dict bitwise the twin's; healthy: no warning/error and no
`headroom_trend` at any severity; runaway: a `headroom_trend` at the named module, step <= first non-finite output -
10 (README's rule table: `warning`, turned `error` once the forecast came true, as it does in these runs; the step
is the warning's either way).

Healthy scenarios (fixed seeds, 150-260 steps; in the twin, the fp16 output abs-max of the module named):
 1. staged_finetune: gradual unfreezing (head, + body.2 at 60, all at 120, each stage re-warmed) of a regressor on
    raw targets through Denorm(2500, 3000): `out` 2.6e3 -> ~6e3 (peak 7.0e3);
 2. progressive_resize: a CNN on raw 0..255 pixels, images 6x6 -> 10x10 (step 50) -> 14x14 (step 100):
    `conv1` ~200 -> ~290 (peak 310; one ordinary backoff at step 77);
 3. sgdr_restart: cosine annealing with warm restarts (period 60) on a learned output gain toward 6e3 x tanh(.):
    `out` 95 -> ~6e3, re-growing after each restart (peak 6.8e3);
 4. logit_scale: a NormFace cosine classifier, frozen encoder, nearly collinear classes, learned logit scale
    (init 10, label smoothing 0.005): `logits` 10 -> ~2e4 by step ~150, then flat (peak 2.1e4);
 5. target_drift: targets whose scale drifts 1.5e3 -> 6e3 linearly over steps 0-150, then stops; a learned gain
    tracks it: `out` 270 -> ~8e3 (peak 8.6e3);
 6. aux_rampup: an auxiliary raw-unit regression head whose loss weight ramps 0 -> 1 over 100 steps (SGD momentum):
    `aux_gain` ~55-90 for 110 steps -> ~5e3 (peak 9.3e3);
 7. llrd: layer-wise lr decay (x0.5 a layer) under a large head lr (SGD 3.0) on raw targets 1200 + 400 z:
    `head` 0.8 -> ~1.2e3, flat from step ~150;
 8. batch_ramp: batch size 8 -> 32 -> 128 (steps 50, 100) on heavy-tailed raw inputs (Student-t x200): `0`
    ~600 -> ~900 (peak 1.4e3);
 9. accum_change: gradient accumulation 1 -> 4 micro-batches at step 100, a learned gain toward 8e3 x tanh(.):
    `out` 160 -> ~8e3 (peak 1.04e4);
10. ema_eval: an EMA copy (decay 0.95) evaluated under fp16 autocast every 10 steps, the watched model's gain
    toward 1.2e4 x tanh(.): `out` 200 -> ~1.25e4 (peak 2.1e4).
Runaways (the first non-finite output, in the twin):
 1. weight_x115: `up`'s weight x1.15 after every step from step 30 (LayerNorm after it): `up` ~2.4 -> 3e4 at
    step 98, inf at step 103;
 2. input_drift: raw inputs growing x1.06 a step from step 20 (a running sum for a running mean): `up` ~2.5 ->
    2.6e4 at step 180, inf at step 188;
 3. rising_lr_gain: a learned gain toward 2e5 targets (beyond fp16's max) under an lr rising x1.02 a step:
    `out` 9 -> 4.7e4 at step 96, +inf at step 98.

Result when written: 116 pass, 1 xfail (90 healthy + 27 runaway cases; ~65 s on one thread). ampdoctor was quiet
on all 10 healthy scenarios at every stride (no headroom_trend at any severity, no warning/error), and warned on
every runaway at every stride but one. The wrong answer (strict xfail, probe_harness.wrong):
 - rising_lr_gain at stride 32: NO headroom_trend at all; the report's only finding is `[error] overflow at out
   step 98: ...`. The series had points at steps 0-7, 39 and 71 and then (creep) every step 72-98, while `out`
   climbed ~1.8e3 -> 4.7e4 (5.2 bits -> 0.5 bit left) and overflowed at 98; at the default watch and strides 1, 8,
   16 it warns at steps 52-59 (7-8 bits left, forecast ~step 112-136). Checked unwatched: the twin's first
   non-finite output is `out` at step 98 from finite inputs, its loss first non-finite there. (Likely the 32-step
   gap before creep: the 39 -> 71 jump reads as one step change in the window -- not confirmed in the code.)
   Extra pinned sweeps: rising_lr_gain also misses at strides 14, 18, 20, 21, 22, 26, 28, 30 (warns at 10, 12, 16,
   24); weight_x115 warns too late at 28 (step 95, overflow at 103; in time at 5-26 and 30); input_drift in time at
   5-30. The DEFAULT watch's stride follows the load (seen 14-21 here with another job running): there a miss at a
   measured stride was the same wrong answer met by chance (a runtime xfail then); on the second run while writing,
   rising_lr_gain-default drew stride ~21 and the same miss (only `[error] overflow at out step 98`).
Fixed since (all 117 pass; the runtime xfail is gone): three defects, each in rules/headroomseries.py or
record/budget.py. (1) The model's own output growing while the loss falls read as a fit (`fitting_predicate`),
though the loss, as a line in the output's magnitude, reached zero only at ~2e5: a fit towards targets beyond
fp16's range is no fit (`_fit_beyond`). (2) The 39 -> 71 fall across the series' gap read as one step change
(`_jump` now subtracts what the rest of the window's rate gives over the gap). (3) weight_x115 at stride 28 was
warned late because the series went to every step only at step 91 (`creep` wanted an abs-max >= 256; at 63 it was
255.9 after rising 5.8 bits in 28 steps): creep now also starts when the rate of the last points takes the output
there by the next point. All three runaways are now warned in time pinned at strides 1-32 (5, 7, 10, 12, 14, 18,
20-30 checked beside this file's modes).
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

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
import stride_sweep  # noqa: E402
from probe_harness import WrongAnswer, wrong  # noqa: E402
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = torch.float16
NEAR = 256.0        # 8 bits from fp16's max (record/budget.py ALERT_ABSMAX)
CEIL = 32768.0      # a healthy twin's fp16 outputs stay below this (1 bit of margin)
FIRST = 20          # the scaler's opening search
MAX_BACKOFFS = 2    # after it
LEAD = 10           # a runaway's warning comes at least this many steps before its first non-finite output
MODES = ["default", "1", "2", "3", "4", "6", "8", "16", "32"]


# --- building blocks ------------------------------------------------------------------------------------------------

class Gain(nn.Module):
    """x * exp(g), g a learned scalar, in x's dtype (an fp16 output under autocast)."""

    def __init__(self, init):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(math.log(init)))

    def forward(self, x):
        return x * self.g.exp().to(x.dtype)


class Denorm(nn.Module):
    """The usual target de-normalisation: y = x * std + mean with fixed (dataset) statistics, fp16 in, fp16 out."""

    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x):
        return x * self.std + self.mean


class ScaledRegressor(nn.Module):
    """body (MLP) -> head Linear(h, 1) -> `out` (a learned Gain or a fixed Denorm)."""

    def __init__(self, out, d=16, h=32, act=nn.Tanh, norm=False):
        super().__init__()
        layers = [nn.Linear(d, h)] + ([nn.LayerNorm(h)] if norm else []) + [act(), nn.Linear(h, h), act()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(h, 1)
        self.out = out

    def forward(self, x):
        return self.out(self.head(self.body(x))).squeeze(-1)


def _mse(scale):
    def loss(out, y):
        return F.mse_loss(out.float() / scale, y / scale)
    return loss


def _rel_mse(out, y):
    s = y.abs().max()
    return F.mse_loss(out.float() / s, y / s)


def _ce(out, y):
    return F.cross_entropy(out.float(), y)


class Spec:
    """One scenario: model, optimizer, lr factor per step (or None), data(i) -> [(args, target), ...] (micro-batches:
    gradient accumulation when more than one), loss(out, target), steps, after(i) under no_grad (or None), and for a
    runaway the module that should be named."""

    def __init__(self, model, opt, lr_at, data, loss, steps, after=None, target=None):
        self.model, self.opt, self.lr_at, self.data, self.loss, self.steps = model, opt, lr_at, data, loss, steps
        self.after, self.target = after, target


def _x(seed, n=64, d=16):
    return torch.randn(n, d, generator=gen(seed))


# --- healthy scenarios ------------------------------------------------------------------------------------------------

def h_staged_finetune():
    """A "pretrained" body fine-tuned with gradual unfreezing: head alone (steps 0-59), + body.2 (60-119), all (120-),
    each stage re-warmed; the head's Denorm(2500, 3000) output reaches the raw targets ~2.5e3 +- 3e3."""
    torch.manual_seed(201)
    m = ScaledRegressor(Denorm(2500.0, 3000.0))
    w = torch.randn(16, generator=gen(201)) / 4
    m.body.requires_grad_(False)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)

    def lr_at(i):
        if i == 60:
            m.body[2].requires_grad_(True)
        if i == 120:
            m.body.requires_grad_(True)
        return min(1.0, ((i % 60) + 1) / 10)

    def data(i):
        x = _x(12000 + i)
        return [((x,), 2500 + 3000 * torch.tanh(x @ w))]
    return Spec(m, opt, lr_at, data, _mse(3000), 200)


class ResizeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 5, padding=2)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.pool(F.relu(self.conv2(F.relu(self.conv1(x))))).flatten(1))


def h_progressive_resize():
    """Progressive resizing on raw 0..255 pixels: images 8x8 (steps 0-59), 16x16 (60-119), 24x24 (120-); a
    4-class CNN with global average pooling."""
    torch.manual_seed(202)
    m = ResizeNet()
    proto = torch.rand(4, 3, 4, 4, generator=gen(202))

    def data(i):
        s = 6 if i < 50 else 10 if i < 100 else 14
        g = gen(13000 + i)
        y = torch.randint(0, 4, (8,), generator=g)
        base = F.interpolate(proto[y], size=(s, s), mode="nearest")
        img = ((base * 0.7 + 0.3 * torch.rand(8, 3, s, s, generator=g)) * 255).round()
        return [((img,), y)]
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return Spec(m, opt, None, data, _ce, 150)


def h_sgdr_restart():
    """Cosine annealing with warm restarts (SGDR, period 60) on a learned output gain toward raw targets 6e3 x
    tanh(.): each restart's lr kicks the gain off its fit and it re-grows and settles."""
    torch.manual_seed(203)
    m = ScaledRegressor(Gain(200.0))
    w = torch.randn(16, generator=gen(203)) / 4
    opt = torch.optim.Adam([{"params": list(m.body.parameters()) + list(m.head.parameters()), "lr": 3e-3},
                            {"params": m.out.parameters(), "lr": 0.08}])

    def data(i):
        x = _x(14000 + i)
        return [((x,), 6000 * torch.tanh(x @ w))]
    return Spec(m, opt, lambda i: 0.02 + 0.49 * (1 + math.cos(math.pi * (i % 60) / 60)), data, _mse(6000), 240)


class LogitScale(nn.Module):
    """fp32 cosines times exp(t), t learned, returned in fp16 (the logits the loss reads)."""

    def __init__(self, init):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(math.log(init)))

    def forward(self, cos):
        return (cos * self.t.exp()).to(FP16)


class CosineClassifier(nn.Module):
    """NormFace: logits = exp(t) * cos(feature, class weight), t learned (init log 10), fp16 logits."""

    def __init__(self, d=16, k=8):
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.weight = nn.Parameter(torch.randn(k, d) * 0.1)
        self.logits = LogitScale(10.0)

    def forward(self, x):
        f = F.normalize(self.enc(x).float(), dim=-1)
        with torch.autocast("cpu", enabled=False):      # the cosines in fp32: their gradient is s times the logits'
            cos = f @ F.normalize(self.weight, dim=-1).t()
        return self.logits(cos)


def h_logit_scale():
    """A cosine classifier over nearly collinear class clusters with a learned logit scale exp(t) (init 10), label
    smoothing 0.005: the scale climbs to the few-thousands the tiny angular margins need, then settles."""
    torch.manual_seed(204)
    m = CosineClassifier()
    common = 5.0 * F.normalize(torch.randn(16, generator=gen(2040)), dim=0)
    centers = common + 0.04 * torch.randn(8, 16, generator=gen(204))
    with torch.no_grad():
        m.enc.weight.copy_(torch.eye(16))
        m.enc.bias.zero_()
        m.weight.copy_(centers)
    m.enc.requires_grad_(False)     # a frozen pretrained encoder (here the identity)

    def data(i):
        g = gen(15000 + i)
        y = torch.randint(0, 8, (64,), generator=g)
        return [((centers[y] + 0.004 * torch.randn(64, 16, generator=g),), y)]

    def loss(out, y):
        return F.cross_entropy(out.float(), y, label_smoothing=0.005)
    opt = torch.optim.Adam([{"params": [m.weight], "lr": 1e-4},
                            {"params": m.logits.parameters(), "lr": 0.05}])
    return Spec(m, opt, lambda i: min(1.0, (i + 1) / 20), data, loss, 220)


def h_target_drift():
    """Regression whose target scale drifts slowly (1.5e3 -> 6e3, linearly over steps 0-150, e.g. inflation) and then
    stops; a learned output gain tracks it (Adam 0.03)."""
    torch.manual_seed(205)
    m = ScaledRegressor(Gain(500.0))
    w = torch.randn(16, generator=gen(205)) / 4
    opt = torch.optim.Adam([{"params": list(m.body.parameters()) + list(m.head.parameters()), "lr": 3e-3},
                            {"params": m.out.parameters(), "lr": 0.03}])

    def data(i):
        x = _x(16000 + i)
        return [((x,), (1500 + 4500 * min(i, 150) / 150) * (1 + 0.3 * torch.tanh(x @ w)))]
    return Spec(m, opt, None, data, _rel_mse, 260)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU())
        self.cls = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 1)
        self.aux_gain = Gain(50.0)

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.aux_gain(self.aux(h)).squeeze(-1)


def h_aux_rampup():
    """A classifier with an auxiliary regression head in raw units (targets ~4e3), whose loss weight ramps 0 -> 1
    over steps 0-100 (SGD with momentum: the aux head moves only as its weight grows); its output grows and settles."""
    torch.manual_seed(206)
    m = TwoHeads()
    W = torch.randn(16, 4, generator=gen(206))
    w = torch.randn(16, generator=gen(2060)) / 4
    opt = torch.optim.SGD([{"params": list(m.trunk.parameters()) + list(m.cls.parameters()) +
                            list(m.aux.parameters()), "lr": 0.05},
                           {"params": m.aux_gain.parameters(), "lr": 0.3}], momentum=0.9)
    step = {"i": 0}

    def data(i):
        step["i"] = i
        x = _x(17000 + i)
        return [((x,), ((x @ W).argmax(1), 4000 * torch.tanh(x @ w)))]

    def loss(out, y):
        logits, reg = out
        ramp = min(1.0, step["i"] / 100)
        return F.cross_entropy(logits.float(), y[0]) + ramp * F.mse_loss(reg.float() / 4000, y[1] / 4000)
    return Spec(m, opt, None, data, loss, 220)


class Deep(nn.Module):
    def __init__(self, d=16, h=32, n=4):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d if k == 0 else h, h), nn.LayerNorm(h), nn.GELU())
                                     for k in range(n)])
        self.head = nn.Linear(h, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).squeeze(-1)


def h_llrd():
    """Layer-wise lr decay (x0.5 per layer down from the head) with a large head lr (SGD, head 3.0, clip 1.0) on raw
    targets 1200 + 400 z: the head's output grows from ~0 to ~1.2e3 and fits."""
    torch.manual_seed(207)
    m = Deep()
    w = torch.randn(16, generator=gen(207)) / 4
    groups = [{"params": m.head.parameters(), "lr": 3.0}]
    for k, layer in enumerate(reversed(m.layers)):
        groups.append({"params": layer.parameters(), "lr": 0.05 * 0.5 ** k})
    opt = torch.optim.SGD(groups, momentum=0.9)

    def data(i):
        x = _x(18000 + i)
        return [((x,), 1200 + 400 * torch.tanh(x @ w))]
    return Spec(m, opt, lambda i: 1.0 if i < 150 else 0.3, data, _mse(1200), 220)


def h_batch_ramp():
    """A batch-size ramp 8 -> 32 -> 128 (steps 0-49, 50-99, 100-) on heavy-tailed raw inputs (Student-t, 4 dof,
    x200): a larger batch holds larger extremes; the first layer's output max steps up with it, and settles."""
    torch.manual_seed(208)
    m = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
    W = torch.randn(16, 4, generator=gen(208))
    t = torch.distributions.StudentT(4.0)

    def data(i):
        n = 8 if i < 50 else 32 if i < 100 else 128
        torch.manual_seed(19000 + i)
        z = t.sample((n, 16)).clamp(-15, 15)
        return [((z * 200,), (z @ W).argmax(1))]
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return Spec(m, opt, None, data, _ce, 200)


def h_accum_change():
    """Gradient accumulation switched from 1 to 4 micro-batches at step 100 (the loss divided by 4, same lr), a
    learned gain toward raw targets 8e3 x tanh(.)."""
    torch.manual_seed(209)
    m = ScaledRegressor(Gain(300.0))
    w = torch.randn(16, generator=gen(209)) / 4
    opt = torch.optim.Adam([{"params": list(m.body.parameters()) + list(m.head.parameters()), "lr": 3e-3},
                            {"params": m.out.parameters(), "lr": 0.05}])

    def data(i):
        k = 1 if i < 100 else 4
        out = []
        for j in range(k):
            x = _x(20000 + 10 * i + j, n=32)
            out.append(((x,), 8000 * torch.tanh(x @ w)))
        return out
    return Spec(m, opt, lambda i: 1.0 if i < 70 else 0.97 ** (i - 70), data, _mse(8000), 200)


def h_ema_eval():
    """An EMA copy of the model (decay 0.95) updated after every step and evaluated under fp16 autocast every 10
    steps on a holdout; the watched model's learned gain climbs toward raw targets 1.2e4 x tanh(.) and settles."""
    torch.manual_seed(210)
    m = ScaledRegressor(Gain(800.0), act=nn.GELU, norm=True)
    ema = copy.deepcopy(m).requires_grad_(False)
    w = torch.randn(16, generator=gen(210)) / 4
    xh = _x(2100, n=128)
    yh = 12000 * torch.tanh(xh @ w)
    opt = torch.optim.Adam([{"params": list(m.body.parameters()) + list(m.head.parameters()), "lr": 2e-3},
                            {"params": m.out.parameters(), "lr": 0.04}])
    evals = []

    def after(i):
        for pe, p in zip(ema.parameters(), m.parameters()):
            pe.mul_(0.95).add_(p.detach(), alpha=0.05)
        if i % 10 == 9:
            with torch.autocast("cpu", dtype=FP16):
                evals.append(_mse(12000)(ema(xh), yh).item())

    def data(i):
        x = _x(21000 + i)
        return [((x,), 12000 * torch.tanh(x @ w))]
    s = Spec(m, opt, lambda i: 1.0 if i < 80 else 0.97 ** (i - 80), data, _mse(12000), 220, after=after)
    s.evals = evals
    return s


HEALTHY = {f.__name__[2:]: f for f in (
    h_staged_finetune, h_progressive_resize, h_sgdr_restart, h_logit_scale, h_target_drift, h_aux_rampup, h_llrd,
    h_batch_ramp, h_accum_change, h_ema_eval)}


# --- runaway scenarios ------------------------------------------------------------------------------------------------

class UpNet(nn.Module):
    """up (Linear, fp16 out) -> LayerNorm (fp32 under autocast) -> GELU -> head: `up` is the layer that overflows."""

    def __init__(self, d=16, h=64, k=4):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, k)

    def forward(self, x):
        return self.head(F.gelu(self.norm(self.up(x))))


def _cls_data(seed, d=16, k=4, scale=1.0):
    W = torch.randn(d, k, generator=gen(seed))

    def data(i):
        x = _x(seed * 100 + i, d=d)
        return [((x * scale,), (x @ W).argmax(1))]
    return data


def r_weight_x115():
    """A bug multiplies `up`'s weight by 1.15 after every step from step 30 (0.2 bits/step): its output climbs from
    ~3 to fp16's max (LayerNorm after it hides the climb from the loss)."""
    torch.manual_seed(301)
    m = UpNet()

    def after(i):
        if i >= 30:
            m.up.weight.mul_(1.15)
    return Spec(m, torch.optim.Adam(m.parameters(), lr=1e-3), None, _cls_data(301), _ce, 140, after=after,
                target="up")


def r_input_drift():
    """A feature-pipeline bug (a running sum where a running mean was meant) makes the raw inputs grow x1.06 a step
    (0.084 bits/step) from step 20: `up`'s fp16 output climbs from ~3 until it overflows (LayerNorm hides it from
    the loss)."""
    torch.manual_seed(302)
    m = UpNet()
    W = torch.randn(16, 4, generator=gen(302))

    def data(i):
        x = _x(30200 + i)
        return [((x * 1.06 ** max(0, i - 20),), (x @ W).argmax(1))]
    return Spec(m, torch.optim.Adam(m.parameters(), lr=1e-3), None, data, _ce, 240, target="up")


def r_rising_lr_gain():
    """A learned output gain toward raw targets 2e5 (beyond fp16's max: units nobody normalised) under an lr that
    keeps rising (x1.02 a step, a scheduler bug): the gain climbs faster and faster until `out` overflows."""
    torch.manual_seed(303)
    m = ScaledRegressor(Gain(20.0))
    w = torch.randn(16, generator=gen(303)) / 4
    opt = torch.optim.Adam([{"params": list(m.body.parameters()) + list(m.head.parameters()), "lr": 1e-3},
                            {"params": m.out.parameters(), "lr": 0.01}])

    def data(i):
        x = _x(30300 + i)
        return [((x,), 2e5 * (1 + 0.1 * torch.tanh(x @ w)))]
    return Spec(m, opt, lambda i: 1.02 ** i, data, lambda out, y: F.l1_loss(out.float() / 2e5, y / 2e5), 220,
                target="out")


RUNAWAY = {f.__name__[2:]: f for f in (r_weight_x115, r_input_drift, r_rising_lr_gain)}
SCENARIOS = {**HEALTHY, **RUNAWAY}


# --- the loop -------------------------------------------------------------------------------------------------------

class Result:
    def __init__(self, spec, losses, scales, params, peaks, first_bad, w):
        self.spec, self.losses, self.scales, self.params, self.peaks, self.first_bad, self.w = (
            spec, losses, scales, params, peaks, first_bad, w)
        self.rep = w.report(replay=False) if w is not None else None

    def lines(self):
        return [f.one_line() for f in self.rep.findings]


def _finite(t):
    return not (isinstance(t, torch.Tensor) and t.is_floating_point()) or bool(torch.isfinite(t).all())


def train(name, watched):
    """zero_grad -> (per micro-batch) autocast fp16 forward -> loss -> scaler.scale(loss).backward -> unscale_ ->
    clip_grad_norm_(1.0) -> scaler.step -> update -> after(i). Unwatched: forward hooks note every module's fp16
    output abs-max per step and the first (module, step) whose output is non-finite from finite inputs. A run stops
    8 steps after its first non-finite loss."""
    s = SCENARIOS[name]()
    m, opt = s.model, s.opt
    base = [g["lr"] for g in opt.param_groups]
    sc = torch.amp.GradScaler("cpu")
    peaks, handles, first_bad, cur = {}, [], [None], [0]
    if not watched:
        def hook(n):
            def f(mod, args, out):
                if isinstance(out, torch.Tensor) and out.dtype == FP16:
                    peaks.setdefault(n, {})[cur[0]] = max(peaks.get(n, {}).get(cur[0], 0.0),
                                                          out.detach().abs().max().float().item())
                outs = out if isinstance(out, tuple) else (out,)
                if first_bad[0] is None and all(map(_finite, args)) and not all(map(_finite, outs)):
                    first_bad[0] = (n, cur[0])
            return f
        handles = [mod.register_forward_hook(hook(n)) for n, mod in m.named_modules()]
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc) if watched else None
    losses, scales, bad_since = [], [], None
    try:
        for i in range(s.steps):
            cur[0] = i
            if s.lr_at is not None:
                f = s.lr_at(i)
                for g, b in zip(opt.param_groups, base):
                    g["lr"] = b * f
            micro = s.data(i)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for args, y in micro:
                with torch.autocast("cpu", dtype=FP16):
                    loss = s.loss(m(*args), y) / len(micro)
                sc.scale(loss).backward()
                total += loss.item()
            sc.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            if s.after is not None:
                with torch.no_grad():
                    s.after(i)
            losses.append(total)
            scales.append(sc.get_scale())
            if not math.isfinite(total) and bad_since is None:
                bad_since = i
            if bad_since is not None and i >= bad_since + 8:
                break
    finally:
        if w is not None:
            w.close()
        for h in handles:
            h.remove()
    params = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return Result(s, losses, scales, params, peaks, first_bad[0], w)


def _peak(r):
    return max(max(v.values()) for v in r.peaks.values())


@functools.lru_cache(maxsize=None)
def twin(name):
    """The unwatched run. Healthy: asserted healthy and near the max. Runaway: asserted to overflow at its target."""
    r = train(name, watched=False)
    if name in HEALTHY:
        assert all(map(math.isfinite, r.losses)), (name, r.losses)
        assert r.first_bad is None, (name, r.first_bad)
        k = max(3, len(r.losses) // 10)
        assert sum(r.losses[-k:]) / k < 0.9 * sum(r.losses[:k]) / k, (name, r.losses[:k], r.losses[-k:])
        backoffs = [i for i, (a, b) in enumerate(zip(r.scales, r.scales[1:])) if b < a and i + 1 >= FIRST]
        assert len(backoffs) <= MAX_BACKOFFS, (name, backoffs)
        assert NEAR <= _peak(r) < CEIL, (name, {n: max(v.values()) for n, v in r.peaks.items()})
    else:
        assert r.first_bad is not None and r.first_bad[0] == r.spec.target, (name, r.first_bad)
        bad = r.first_bad[1]
        assert all(map(math.isfinite, r.losses[:bad])), (name, r.losses[:bad])
        assert not math.isfinite(r.losses[bad]), (name, bad, r.losses[bad - 2:bad + 2])
        assert bad >= 40, (name, bad)
    return r


check_stride = stride_sweep.check_stride


def _same(r, ref):
    """Bitwise the twin's losses (NaN included) and final state_dict."""
    assert torch.tensor(r.losses, dtype=torch.float64).numpy().tobytes() == \
        torch.tensor(ref.losses, dtype=torch.float64).numpy().tobytes(), (r.losses, ref.losses)
    assert r.params.keys() == ref.params.keys()
    for k, v in ref.params.items():
        assert r.params[k].numpy().tobytes() == v.numpy().tobytes(), k


# Wrong answers found while writing this file: (scenario, mode) -> the exact wrong finding line.
HEALTHY_XFAIL: dict[tuple[str, str], str] = {}
RUNAWAY_XFAIL: dict[tuple[str, str], str] = {}


def _params(names, xfails):
    out = []
    for n in names:
        for mode in MODES:
            marks = [wrong(xfails[(n, mode)])] if (n, mode) in xfails else []
            out.append(pytest.param(n, mode, marks=marks, id=f"{n}-{mode}"))
    return out


def _watched(name, mode, monkeypatch):
    if mode != "default":
        stride_sweep.install(int(mode), patch=monkeypatch.setattr)
    r = train(name, watched=True)
    if mode != "default":
        check_stride(r.w, int(mode))
    return r


@pytest.mark.parametrize("name,mode", _params(HEALTHY, HEALTHY_XFAIL))
def test_healthy_growth_is_quiet_at_every_stride(name, mode, monkeypatch):
    ref = twin(name)
    r = _watched(name, mode, monkeypatch)
    _same(r, ref)
    assert r.rep.summary["steps"] >= len(ref.losses) - 1, r.rep.summary
    bad = alarms(r.rep.findings) + [f.one_line() for f in r.rep.findings
                                    if f.rule == "headroom_trend" and f.severity not in ("warning", "error")]
    if bad or r.rep.exit_code != 0:
        raise WrongAnswer(f"false finding on a healthy run ({name}, stride {mode}): {bad}; all: {r.lines()}")


@pytest.mark.parametrize("name,mode", _params(RUNAWAY, RUNAWAY_XFAIL))
def test_runaway_is_forecast_at_every_stride(name, mode, monkeypatch):
    ref = twin(name)
    r = _watched(name, mode, monkeypatch)
    _same(r, ref)
    target, bad = ref.spec.target, ref.first_bad[1]
    # README's rule table: `warning`, and `error` once the forecast came true (these runs do overflow); its step is
    # the step of the warning either way
    hits = [f for f in r.rep.findings if f.rule == "headroom_trend" and f.severity in ("warning", "error")
            and f.module == target and f.step is not None and f.step <= bad - LEAD]
    if not hits:
        raise WrongAnswer(f"no headroom_trend at {target!r} by step {bad - LEAD} ({name}, stride {mode}; "
                          f"first non-finite output at step {bad}): {r.lines()}")
