"""Healthy runs at ampdoctor's DEFAULT watch, thirty-second set: LARGE BUT SAFE fp16 ACTIVATIONS. Every case's fp16
forward outputs sit in, or grow into, 256..30000 (within 8 bits of the fp16 max, where headroom_trend may warn) and
then settle, never within one bit of 65504. The risk tested is a FALSE headroom_trend warning on a healthy run whose
activations are large by design or grow and then stop. `ampdoctor.watch(model, optimizer=..., scaler=...,
run_dir=tmp_path / "run")` and nothing else; CPU fp16 autocast with a real `torch.amp.GradScaler("cpu")`, fixed
seeds, one intra-op thread, 60-150 optimizer steps each. The harness is tests/codebase_harness.py's (Rec, ns,
healthy, identical, judge), with its own `run` that adds:

- on the UNWATCHED twin, a range oracle (forward hooks on every module, `Range`): the largest |x| of every module's
  fp16 output per step must reach 256 at some step (the case's own `reach`, default 256), and no floating output of
  any module (fp16, or fp32 under autocast) ever comes within one bit of the fp16 max (|x| < 32752);
- on the WATCHED run, w.report() after the iterations in the case's `mid` (training going on), each of which, as
  the final w.report() and ampdoctor.diagnose(run_dir), must hold no warning and no error.

The oracle (`healthy`, probe_harness.Producer on the twin): every loss finite, the case learned, no module made
inf/NaN from finite inputs, gradients finite on every kept step, only the scaler's opening search skipped, every
final weight finite; the watched run trains bitwise identically (`identical`: losses, scales, skips, every step's
gradients, weights, optimizer state, final scale); no `ampdoctor: ...` Python warning. A false alarm is a strict
xfail (probe_harness.wrong: WrongAnswer only) whose reason quotes ampdoctor; a failing oracle or a difference in
training is a plain failure.

The cases:
 1. regression_large_targets: an MLP regressing house-price-like targets 2000..14000 (unnormalised), the head's
    output growing from ~0 to the targets, then fitting them;
 2. frozen_readout_hidden_growth: the hidden layer itself must grow (a frozen averaging readout), targets ~1500;
    a linear warm-up of the learning rate over 20 steps; hidden fp16 activations grow from ~1 to ~2000 and settle;
 3. llm_outlier_channels: a tiny pre-LN transformer block whose input projection writes 3 "massive activation"
    channels (~2000-4000, as LLMs' outlier features) into an fp32 residual that LayerNorm normalises;
 4. attention_logits_warmup_plateau: a key-retrieval attention whose q.k logits (its own module, fp16) grow to a
    few hundred during a warm-up + cosine-to-zero schedule, then plateau;
 5. vgg_no_bn_raw_pixels: a VGG-style conv stack without BatchNorm on raw 0..255 pixels: conv features in the
    hundreds to thousands from the first step;
 6. embedding_sqrt_d_scaled: a Transformer-style embedding (std 1) multiplied by sqrt(d_model)=32 ... and a
    weight-tied-free input projection: fp16 features of several hundred;
 7. sum_pooling_long_sequence: per-token ReLU features summed over 512 positions (a bag-of-words sum, not a mean):
    pooled fp16 values in the hundreds to low thousands;
 8. clip_temperature_clamped: CLIP's contrastive loss on unnormalised encoder features (raw inputs 0..100: fp16
    features in the hundreds) with the learned temperature exp(t) growing from 1/0.07 and clamped at 100;
 9. sum_loss_big_batch: cross-entropy with reduction='sum' over a batch of 256 (the loss ~ hundreds) on tabular
    features in the thousands (fp16 first-layer outputs in the thousands);
10. tabular_unnormalised_mse: unnormalised tabular data (square feet 500..4000, year 1950..2020, rooms 1..8), MSE
    on a normalised target: the first layer's fp16 outputs ~ thousands for the whole run;
11. curriculum_input_scale_doubling: the input scale doubled at step 40 and again at step 80, then left alone: the
    first layer's fp16 output steps up a bit each time (~600 -> ~1200 -> ~2400) and stays;
12. cosine_schedule_growth_then_decay: a residual MLP without normalisation under warm-up + cosine decay to 0,
    trained on targets ~300: hidden features grow while the learning rate is high and freeze as it reaches 0.

Result when written: every oracle holds (healthy, in range, bitwise identical); final reports all quiet. False
headroom_trend warnings in MID-RUN reports: frozen_readout_hidden_growth at every stride (strict xfail, XFAIL);
regression_large_targets, attention_logits_warmup_plateau and curriculum_input_scale_doubling at some strides only
(FLAKY: non-strict xfail raising WrongAnswer only; pin with AMPDOCTOR_FORCE_STRIDE to reproduce). Written against
a recording of the series on every step near the max (since taken back); the same four warn without it.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import Producer, WrongAnswer, wrong  # noqa: E402
from scenarios import alarms, gen, one_thread  # noqa: E402
from codebase_harness import DEBUG, Rec, healthy, identical, judge, ns, registrar  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
F16 = torch.float16
NEAR = 65504.0 / 2       # one bit below the fp16 max
CASES: dict = {}
XFAIL: dict[str, str] = {
    # at every forced stride 1..32 (tests/stride_sweep.py) and at the default
    "frozen_readout_hidden_growth": "mid-run report (step 80): [warning] headroom_trend at fc2 step 52-53: `fc2` "
    "(Linear) output is losing headroom ... 6.9 bits left at step 53, falling 0.22 bits/step, forecast to overflow "
    "around step 84; the hidden layer is fitting targets ~1500 through a frozen readout and settles at ~2800 "
    "(4.5 bits left); at step 80 it still had 5.4 bits, the forecast is stale (rules/headroomseries.py _refuted / "
    "fitting_predicate: only the root's own output counts as a fit)",
}
# The same false headroom_trend in mid-run reports, but only at some headroom strides (the stride under the default
# headroom="auto" follows the machine's load), so not a strict xfail: strides where it warned, and what it said.
FLAKY: dict[str, str] = {
    "regression_large_targets": "strides 1, 8, 16 and the default here: mid-run report (step 60) [warning] "
    "headroom_trend at 2 step 39: 8.0 bits left, falling 0.09 bits/step, forecast to overflow around step 132 "
    "(a hidden Linear growing while the head fits targets ~10000; it settles, later reports drop it)",
    "attention_logits_warmup_plateau": "strides 4, 8 and once at the default: mid-run reports (steps 60, 90) "
    "[warning] headroom_trend at logits step 47: 7.7 bits left, falling 0.09 bits/step, forecast around step 130 "
    "(q.k logits growing in warm-up, plateau at ~330 = 7.6 bits left)",
    "curriculum_input_scale_doubling": "strides 1, 2, 4, 32: mid-run reports (steps 45, 85, 105) [warning] "
    "headroom_trend at inp step 42: 6.1 bits left, falling 0.09 bits/step, forecast around step 111 (a one-time "
    "doubling of the input scale at step 40, read as a steady fall)",
}

_case = registrar(CASES)


def case(iters, mid=(), reach=256.0, **kw):
    """registrar's @case plus the iterations after which the watched run asks for a mid-run report (`mid`) and the
    fp16 abs-max the case must reach (`reach`)."""
    def deco(make):
        _case(iters, **kw)(make)
        cs = CASES[kw.get("name") or make.__name__]
        cs.mid, cs.reach = tuple(mid), reach
        return make
    return deco


# ------------------------------------------------------------------------------------------------------ range oracle
def _tensors(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class Range:
    """Forward hooks on every module: per step, the largest |x| of any fp16 output (`hi16`) and of any floating
    output (`hi`)."""

    def __init__(self, m):
        self.step, self.hi16, self.hi = 0, {}, {}
        self.hs = [mod.register_forward_hook(self._fwd) for mod in m.modules()]

    def new_step(self, step):
        self.step = step

    def _fwd(self, mod, inp, out):
        with torch.no_grad():
            for t in _tensors(out):
                if t.is_floating_point() and t.numel():
                    v = float(t.detach().abs().max())
                    self.hi[self.step] = max(self.hi.get(self.step, 0.0), v)
                    if t.dtype == F16:
                        self.hi16[self.step] = max(self.hi16.get(self.step, 0.0), v)

    def remove(self):
        for h in self.hs:
            h.remove()


def run(cs, rd=None):
    """codebase_harness.run with the range oracle on the twin and the mid-run reports on the watched run."""
    c = cs.make()
    prod = Producer(c.m) if rd is None else None
    rng = Range(c.m) if rd is None else None
    r = SimpleNamespace(losses=[], c=c, rd=rd, w=None, first=None, case=cs, mid=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if rd is not None:
            try:
                r.w = ampdoctor.watch(c.m, optimizer=c.watch_opt, scaler=c.sc, run_dir=rd)
            except ampdoctor.WatchError as e:
                raise WrongAnswer(f"watch refused a healthy setup: {e}") from e
        try:
            for i in range(cs.iters):
                if prod is not None:
                    prod.new_step(c.rec.n)
                    rng.new_step(c.rec.n)
                r.losses.append(float(c.body(i)))
                if r.w is not None and i in cs.mid:
                    rep = r.w.report()
                    r.mid += [f"(mid-run report after step {i}) {a}" for a in alarms(rep.findings)]
                    if DEBUG:
                        print("  mid", i, [f.one_line() for f in rep.findings])
        finally:
            if r.w is not None:
                r.w.close()
            if prod is not None:
                prod.remove()
                rng.remove()
                r.first = prod.first
    r.rng = rng
    r.warns = [str(x.message) for x in seen if str(x.message).startswith("ampdoctor")]
    r.state = {k: v.detach().clone() for k, v in c.m.state_dict().items()}
    r.opt_state = c.opt.state_dict()
    r.final_scale = c.sc.get_scale() if c.sc is not None else None
    return r


def in_range(r):
    """The twin's activations reached the case's range and never came within one bit of the fp16 max."""
    rng, reach = r.rng, r.case.reach
    top16, top = max(rng.hi16.values()), max(rng.hi.values())
    assert top16 >= reach, (top16, reach)
    assert top < NEAR, (top, [s for s, v in rng.hi.items() if v >= NEAR][:5])


# ------------------------------------------------------------------------------------------------------ the loop
def amp_case(model, optimizer, loss_fn, *, init_scale=65536.0, clip=1.0, sched=None):
    """An ordinary fp16 loop: autocast forward (`loss_fn(i)` -> loss), scale(loss).backward(), unscale_, [clip],
    step, update, [sched.step()], zero_grad(set_to_none=True)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    rec = Rec(model)

    def body(i):
        with torch.autocast("cpu", dtype=F16):
            loss = loss_fn(i)
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        if sched is not None:
            sched.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body)


def warmup_cosine(warm, total, floor=0.0):
    def f(k):
        if k < warm:
            return (k + 1) / warm
        p = min(1.0, (k - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def mlp(d_in, h, d_out, depth=2):
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    return nn.Sequential(*layers, nn.Linear(d, d_out))


# ----------------------------------------------------------------------- 1. regression on large targets
def house(seed, n=64, d=8):
    wt = torch.randn(d, generator=gen(seed))

    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, d, generator=g)
        y = 8000.0 + 2000.0 * torch.tanh(x @ wt / 2) + 100.0 * torch.randn(n, generator=g)
        return x, y[:, None]
    return batch


@case(120, mid=(30, 60, 90), reach=2000.0)
def regression_large_targets():
    torch.manual_seed(1)
    model = mlp(8, 64, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.03)
    data = house(1)

    def loss_fn(i):
        x, y = data(i)
        return F.l1_loss(model(x).float(), y)           # MAE on prices (an MSE's gradient here would be ~1e4)
    return amp_case(model, optimizer, loss_fn, clip=None, init_scale=2.0 ** 7)


# ----------------------------------------------------------------------- 2. hidden growth through a frozen readout
class FrozenReadout(nn.Module):
    def __init__(self, d_in=8, h=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, h), nn.Linear(h, h)
        self.readout = nn.Linear(h, 1, bias=False)
        nn.init.constant_(self.readout.weight, 1.0 / h)
        self.readout.weight.requires_grad_(False)

    def forward(self, x):
        return self.readout(F.relu(self.fc2(F.relu(self.fc1(x)))))


@case(120, mid=(25, 50, 80))
def frozen_readout_hidden_growth():
    torch.manual_seed(2)
    model = FrozenReadout()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 20))
    g0 = gen(22)
    wt = torch.randn(8, generator=g0)

    def loss_fn(i):
        g = gen(2_000_000 + i)
        x = torch.randn(64, 8, generator=g)
        y = 1500.0 + 300.0 * torch.tanh(x @ wt)
        return F.l1_loss(model(x).float()[:, 0], y)
    return amp_case(model, optimizer, loss_fn, clip=None, sched=sched)


# ----------------------------------------------------------------------- 3. LLM outlier channels
class OutlierBlock(nn.Module):
    def __init__(self, d_in=16, d=32, classes=4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        with torch.no_grad():
            self.inp.weight.mul_(20.0)            # a wide-ranged residual stream (~10-50) ...
            self.inp.weight[:3] *= 30.0           # ... with three "massive activation" channels (~1000-3000)
        self.ln1 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.ln2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x).float()
        h = h + self.ff(self.ln1(h)).float()
        return self.head(self.ln2(h))


def teacher(seed, n=64, d=16, classes=4):
    W = torch.randn(d, classes, generator=gen(seed))

    def batch(i):
        x = torch.randn(n, d, generator=gen(seed * 100_000 + i))
        return x, (x @ W).argmax(1)
    return batch


@case(80, mid=(20, 50), reach=1000.0)
def llm_outlier_channels():
    torch.manual_seed(3)
    model = OutlierBlock()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = teacher(3)

    def loss_fn(i):
        x, y = data(i)
        return F.cross_entropy(model(x).float(), y)
    return amp_case(model, optimizer, loss_fn)


# ----------------------------------------------------------------------- 4. attention logits, warm-up then plateau
class Logits(nn.Module):
    def forward(self, q, k):
        return q @ k.transpose(-1, -2)


class Retrieve(nn.Module):
    """Given a query token and 8 keys, attend to the key whose id matches and read its value."""

    def __init__(self, V=16, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        nn.init.normal_(self.emb.weight, std=2.0)
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.logits = Logits()
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, V)

    def forward(self, qi, ki, vi):
        att = self.logits(self.q(self.emb(qi)), self.k(self.emb(ki))).float().softmax(-1)
        return self.out((att.to(F16) @ self.v(self.emb(vi))))[:, 0]


@case(120, mid=(30, 60, 90))
def attention_logits_warmup_plateau():
    torch.manual_seed(4)
    model = Retrieve()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(10, 90))

    def loss_fn(i):
        g = gen(4_000_000 + i)
        ki = torch.stack([torch.randperm(16, generator=g)[:8] for _ in range(32)])
        vi = torch.randint(0, 16, (32, 8), generator=g)
        pick = torch.randint(0, 8, (32,), generator=g)
        qi = ki.gather(1, pick[:, None])
        return F.cross_entropy(model(qi, ki, vi).float(), vi.gather(1, pick[:, None])[:, 0])
    return amp_case(model, optimizer, loss_fn, sched=sched)


# ----------------------------------------------------------------------- 5. VGG without BatchNorm on raw pixels
class VGGNoBN(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def pixels(seed, n=16):
    """Raw 0..255 images (not normalised): class c brightens quadrant c."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        y = torch.randint(0, 4, (n,), generator=g)
        x = torch.rand(n, 3, 16, 16, generator=g) * 120.0
        for b in range(n):
            r, c = divmod(int(y[b]), 2)
            x[b, :, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 135.0
        return x.floor(), y
    return batch


@case(60, mid=(15, 40))
def vgg_no_bn_raw_pixels():
    torch.manual_seed(5)
    model = VGGNoBN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = pixels(5)

    def loss_fn(i):
        x, y = data(i)
        return F.cross_entropy(model(x).float(), y)
    return amp_case(model, optimizer, loss_fn)


# ----------------------------------------------------------------------- 6. embedding x sqrt(d_model)
class ScaledEmbedLM(nn.Module):
    def __init__(self, V=32, d=1024, h=64):
        super().__init__()
        self.emb = nn.Embedding(V, d)          # std 1 (nn.Embedding's default init)
        self.scale = math.sqrt(d)
        self.proj = nn.Linear(d, h)
        nn.init.normal_(self.proj.weight, std=0.08)
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, V)

    def forward(self, x):
        return self.head(self.norm(self.proj(self.emb(x) * self.scale)))


@case(80, mid=(20, 50))
def embedding_sqrt_d_scaled():
    torch.manual_seed(6)
    model = ScaledEmbedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)

    def loss_fn(i):
        g = gen(6_000_000 + i)
        x = torch.randint(0, 32, (64,), generator=g)
        return F.cross_entropy(model(x).float(), (7 * x + 5) % 32)
    return amp_case(model, optimizer, loss_fn)


# ----------------------------------------------------------------------- 7. sum pooling over a long sequence
class SumPool(nn.Module):
    def forward(self, h):
        return h.sum(1)


class BagOfTokens(nn.Module):
    def __init__(self, V=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.tok = nn.Linear(d, d)
        nn.init.constant_(self.tok.bias, 0.5)
        self.pool = SumPool()
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.pool(F.relu(self.tok(self.emb(x)))))


@case(80, mid=(20, 50))
def sum_pooling_long_sequence():
    torch.manual_seed(7)
    model = BagOfTokens()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)

    def loss_fn(i):
        g = gen(7_000_000 + i)
        y = torch.randint(0, 2, (16,), generator=g)
        x = torch.randint(0, 64, (16, 512), generator=g)
        x = torch.where((torch.rand(16, 512, generator=g) < 0.2) & (y[:, None] == 1), x % 8, x)  # class 1: more 0..7
        return F.cross_entropy(model(x).float(), y)
    return amp_case(model, optimizer, loss_fn, init_scale=2.0 ** 9)


# ----------------------------------------------------------------------- 8. CLIP with a clamped temperature
class TinyCLIP(nn.Module):
    def __init__(self, d_a=12, d_b=10, d=16):
        super().__init__()
        self.enc_a = nn.Sequential(nn.Linear(d_a, 32), nn.ReLU(), nn.Linear(32, d))
        self.enc_b = nn.Sequential(nn.Linear(d_b, 32), nn.ReLU(), nn.Linear(32, d))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a, b):
        fa = F.normalize(self.enc_a(a).float(), dim=-1)
        fb = F.normalize(self.enc_b(b).float(), dim=-1)
        return self.logit_scale.exp() * fa @ fb.t()


def clip_learned(r):
    ls = r.losses
    assert sum(ls[-10:]) / 10 < 0.7 * sum(ls[:10]) / 10, (ls[:3], ls[-3:])
    sc = r.c.extra["scale"]
    assert max(sc) <= 100.0 + 1e-3 and sc[-1] > 1.2 * sc[0], (sc[:3], sc[-3:])


@case(100, mid=(30, 70), learned=clip_learned)
def clip_temperature_clamped():
    torch.manual_seed(8)
    model = TinyCLIP()
    optimizer = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if n != "logit_scale"], "lr": 1e-2},
                                   {"params": [model.logit_scale], "lr": 0.1, "weight_decay": 0.0}], lr=2e-3)
    Wa, Wb = torch.randn(6, 12, generator=gen(81)), torch.randn(6, 10, generator=gen(82))
    def loss_fn(i):
        z = torch.randn(32, 6, generator=gen(8_000_000 + i))
        a, b = (z @ Wa) * 40.0, (z @ Wb) * 40.0                   # unnormalised raw inputs, ~ +-300
        lg = model(a, b)
        t = torch.arange(32)
        return 0.5 * (F.cross_entropy(lg, t) + F.cross_entropy(lg.t(), t))

    c = amp_case(model, optimizer, loss_fn)
    inner = c.body
    c.extra["scale"] = []

    def body(i):
        out = inner(i)
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))                # CLIP's clamp
        c.extra["scale"].append(float(model.logit_scale.exp()))
        return out
    c.body = body
    return c


# ----------------------------------------------------------------------- 9. sum-reduced loss over a big batch
def tabular(seed, n):
    """Unnormalised house features: square feet 500..4000, year 1950..2020, rooms 1..8, and a label-free noise."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        sqft = 500 + 3500 * torch.rand(n, generator=g)
        year = (1950 + 70 * torch.rand(n, generator=g)).floor()
        rooms = torch.randint(1, 9, (n,), generator=g).float()
        noise = torch.randn(n, generator=g)
        x = torch.stack([sqft, year, rooms, noise], 1)
        price = 0.1 * sqft + 2.0 * (year - 1985) + 20.0 * rooms
        return x, price
    return batch


class Standardised(nn.Module):
    """A tabular MLP whose first layer sees the raw (unnormalised) features."""

    def __init__(self, d_out):
        super().__init__()
        self.net = mlp(4, 32, d_out)
        with torch.no_grad():
            self.net[0].weight.mul_(0.2)

    def forward(self, x):
        return self.net(x)


@case(100, mid=(30, 70))
def sum_loss_big_batch():
    torch.manual_seed(9)
    model = Standardised(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    data = tabular(9, 256)

    def loss_fn(i):
        x, price = data(i)
        y = torch.bucketize(price, torch.tensor([230.0, 330.0]))          # cheap / middle / expensive
        return F.cross_entropy(model(x).float(), y, reduction="sum") / 16.0
    return amp_case(model, optimizer, loss_fn, init_scale=2.0 ** 2)


# ----------------------------------------------------------------------- 10. unnormalised tabular data, MSE
@case(100, mid=(30, 70))
def tabular_unnormalised_mse():
    torch.manual_seed(10)
    model = Standardised(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = tabular(10, 64)

    def loss_fn(i):
        x, price = data(i)
        return F.mse_loss(model(x).float()[:, 0], (price - 280.0) / 100.0)
    return amp_case(model, optimizer, loss_fn, init_scale=2.0 ** 3)


# ----------------------------------------------------------------------- 11. curriculum: input scale x2, x2
@case(120, mid=(45, 85, 105), reach=1500.0)
def curriculum_input_scale_doubling():
    torch.manual_seed(11)
    model = OutlierBlock()
    with torch.no_grad():
        model.inp.weight[:3] /= 2.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = teacher(11)

    def loss_fn(i):
        x, y = data(i)
        s = 1.0 if i < 40 else 2.0 if i < 80 else 4.0
        return F.cross_entropy(model(x * s).float(), y)
    return amp_case(model, optimizer, loss_fn)


# ----------------------------------------------------------------------- 12. residual MLP, warm-up + cosine to 0
class ResMLP(nn.Module):
    def __init__(self, d=16, h=32, blocks=3):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d)) for _ in range(blocks)])
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


@case(150, mid=(40, 80, 120))
def cosine_schedule_growth_then_decay():
    torch.manual_seed(12)
    model = ResMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(15, 150))
    wt = torch.randn(8, generator=gen(1212))

    def loss_fn(i):
        x = torch.randn(64, 8, generator=gen(12_000_000 + i))
        y = 300.0 + 60.0 * torch.tanh(x @ wt)
        return F.smooth_l1_loss(model(x).float()[:, 0], y)
    return amp_case(model, optimizer, loss_fn, clip=None, sched=sched, init_scale=2.0 ** 8)


# ---------------------------------------------------------------------------------------------------- the test
def _marks(n):
    if n in XFAIL:
        return wrong(XFAIL[n])
    if n in FLAKY:
        return pytest.mark.xfail(strict=False, raises=WrongAnswer, reason=FLAKY[n])
    return ()


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CASES])
def test_large_activations_healthy(name, tmp_path):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, with the oracles
    if DEBUG:
        rec, hi = ru.c.rec, ru.rng.hi16
        print(name, "steps", rec.n, "skipped", rec.skipped, "loss",
              [round(v, 3) for v in ru.losses[::max(1, len(ru.losses) // 10)]], ru.losses[-1])
        print("  hi16", [round(hi.get(s, 0.0)) for s in range(0, rec.n, max(1, rec.n // 15))],
              "max", round(max(hi.values())), "any", round(max(ru.rng.hi.values())))
    healthy(ru)
    in_range(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)
    judge(rw)                             # the final reports first (quiet there too), then the mid-run ones
    if rw.mid:
        raise WrongAnswer(" | ".join(rw.mid))
