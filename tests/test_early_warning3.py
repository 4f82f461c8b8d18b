"""headroom_trend as an early warning, third set (test_headroom_trend.py, test_early_warning2.py and
test_healthy_trend3.py are the first two and the healthy long-growth set): CPU fp16 loops (autocast + a real
GradScaler("cpu")), the public API (`ampdoctor.watch(model, optimizer=opt, scaler=scaler)` at the defaults, or with
`every=1`), then `w.report(replay=False)`.

Every run is first run UNWATCHED with the test's own forward hooks on the modules it names (the abs-max of their
output and of their input, the largest over a step's calls), which gives: the first bad step (the first step whose
loss or a hooked module's output holds inf/NaN, or a skipped step once GradScaler's first 10 steps of search are
over); the growth rate of the growing layer (a least-squares slope of its headroom, log2(65504/abs-max), over the
30-100 steps before the first bad one, at least 0.03 bits a step and into the rule's 8-bit reach); and that its input
does NOT grow (it is the producer, not a layer that passes a growing input on), while a listed pass-on layer's input
does. The watched run must give bitwise the same losses (watching changes nothing), and its report must hold a
`headroom_trend` whose EARLIEST finding names the growing layer at a step <= first bad - 10, with evidence of the
current headroom (equal to the test's own abs-max at that step, within 0.05 bits), the rate (within 2x of the test's
slope up to that step) and a forecast step after it; no headroom_trend may name a layer that only passes it on.

The default watch's series (headroom="auto") runs at a stride its budget measures from the step time (record/
budget.py): on these tiny CPU models it jumps between 1 and 32 from one run to the next (the median of 9 timings of
~1 ms steps under load), so a default run is asserted here only where the outcome is the same at every stride 1..32
(checked while writing this file with tests/stride_sweep.py at 1, 2, 4, 8, 16, 24, 32); where it is not, the default
watch is run at the stride pinned (stride_sweep.install, as test_trend_strides.py does) and the same run at every=1.
GradScaler's init_scale is given per run: with 65536 the scaled WEIGHT gradient of the growing layer's consumer (a
sum over the batch, which no headroom series records) overflows first, 14-15 bits below the max in the forward
(probe head, TD critic: first skip at step 22 and 34), beyond the rule's 8-bit reach (not asserted).

A) growth that ends in an inf or a skipped step (13 runs):
   1. decay_sign_adam (default) and 1b. the same at every=1: a post-LN MLP whose `hidden` Linear gets a hand-written
      decoupled weight decay with the sign flipped (x1.03 a step on its weight and bias) beside Adam: smooth growth
      from 2^-4 to the max (first inf at step 441, warned at ~316-361 at every stride);
   2. positional_table (default): learned positional embeddings under SGD with an "L2 on the table" term whose sign
      is flipped: the (fp32) table grows x1.025 a step; `proj` (fp16) reads tok + pos and overflows first (564);
   3. annealed_attention_temperature (the default at its stride pinned to 8 and to 1; see PINNED_XFAIL's note):
      an inverse temperature buffer on the attention scores annealed x1.025 a step with no cap (a sharpening
      schedule whose clamp is missing); init_scale 256;
   4. amplifier_chain (every=1; and the default at stride 2): `embed` grows (sign-flipped L2, SGD), `expand` — a
      64->256 Linear initialised with torch.randn (no fan-in scaling: ~3.5 bits of gain) — only passes it on and
      reaches the max first (inf at 399);
   5. root_logit_temperature (every=1; and the default at stride 32): the classifier's forward multiplies its logits
      by an inverse temperature buffer annealed x1.03 a step, no floor on the temperature; separable data, the loss
      reaches 0 by step ~140 while the logits run away (inf at 389);
   6. prune_rescale_conv (every=1): a BatchNorm-free (GroupNorm) conv net whose `conv2` is magnitude-pruned with
      the 1/keep rescale re-applied on every step instead of once: x1.1 a step (inf at 117, warned at 59);
   7. unfreeze_decay_sign_at_60 (every=1): `hidden` frozen for 60 healthy steps, then unfrozen into a decay group
      with the sign flipped: x1.08 a step from step 60; its own test also checks that the rate is the recent one and
      the forecast within 15 steps of the overflow (forecast 180, inf at 188);
   8. td_without_target_network (every=1): TD(0) with a linear critic on frozen bias-free ReLU features and
      transitions s -> 2s (the deadly triad): V(s) diverges geometrically (x1.13 a step); init_scale 16;
   9. probe_head_lr_too_high (every=1): a linear probe on a frozen backbone, SGD at lr 0.7 > 2/lambda_max (3.0 for
      this head): its output oscillates in sign and grows x1.08 a step; init_scale 32. (Adam at a too-high lr moves
      each weight by ~lr a step: linear growth, not geometric; SGD above 2/lambda is the geometric case.)
  10. noisy_sgd_decay_sign (every=1): the post-LN MLP of 1 under SGD with momentum (lr 0.05) and the sign-flipped
      decay written as p.add_(p, alpha=lr * wd): `hidden` grows 0.035-0.045 bits a step under ~0.3 bits of batch
      noise (inf at 311).
   Logits under label-smoothing-free cross-entropy on separable data are not among them: their norm grows like
   log t under (S)GD as the gradient vanishes exponentially (a rate that tends to 0 bits a step); a scale pushed by
   something other than the loss (5) is what runs away. test_healthy_trend3.py runs the log t case.
B) healthy runs that grow, oscillate, jump or sit near the max: no headroom_trend and no warning or error at all
   (each asserted healthy first: finite losses, at most one ordinary backoff after step 10, the value inside the
   rule's 8 bits and above overflow_risk's 1 bit; 8 runs):
   1. hint_warmup_settles (default) and 2. the same at every=1: a FitNets-style hint loss pulls an inner layer's
      output onto a teacher's unnormalised features (~1500) with its own lr warmed up over 40 steps: 16 -> ~4.2 bits
      by step ~100, flat to step 300;
   3. periodic_inputs_every1: inputs whose amplitude cycles x32 with a 50-step period (a daily cycle fed raw): the
      first layer's headroom falls 5 bits in every half period (up to 0.4 bits a step) to ~3.7 bits; the run ends
      in a falling half;
   4. log_growth_every1: raw features whose magnitude grows like log t: the first layer 7.1 -> 4.3 bits;
   5. flat_at_2_12 (default): raw features x2000: a layer whose abs-max sits at ~2^12 (3.4-4.1 bits) for 300 steps;
   6. unfreeze_jump_every1: a pretrained adapter whose output gain, frozen at 1/8 during a head-only warmup, is
      unfrozen at step 100 (lr 0.2): its output jumps x8 (6.4 -> 3.6 bits) in 5 steps and stays there;
   7. annealed_temperature_capped (default): scenario 3 with its cap (the buffer stops at 212): growth to ~3 bits
      below the max, then flat for ~200 steps;
   8. root_logit_temperature_capped (default): scenario 5 with the cap (612): the logits stop ~3 bits below the max.

What ampdoctor got wrong (strict xfails):
- positional_table (default, the same at every stride 1-32): `headroom_trend at proj step 488: ... 3.4 bits left,
  falling 0.04 bits/step, forecast to overflow around step 583` and nothing names `pos`, the table that grows (proj's
  weights do not; its input, tok + pos, grows at the table's rate). Cause: the series holds fp16/bf16 values only
  (record/headroom.py Headroom._forward skips any output whose dtype is not fp16/bf16, "fp32 values have no
  fp16/bf16 range to lose"; record/series.py from_calls likewise on sampled steps; rules/headroom.py series() reads
  only the 'h'/'b' codes), and an Embedding's output stays fp32 under autocast, so `pos` has no series and
  headroom_trend's producer search (the first in forward order of the layers falling at the rate) starts at `proj`.
  overflow_risk (rules/numeric.py) does follow an fp32 value into the low-precision op that takes it, and names `pos`
  (at step 565, after the overflow).
- (fixed since the thirty-eighth session: rules/headroomseries.py `windows` judges a dense series over its last
  LONG_SPAN = 48 steps as well, and a 12-point warning refuted by what came next leaves that longer look its turn)
  noisy_sgd_decay_sign (every=1): `headroom_trend at hidden step 306: ... 0.4 bits left` for an inf at step 311 (5
  steps, not 10). _first_warning (rules/headroom.py) did warn at step 216 (3.4 bits), but from a 12-step window whose
  slope (-0.102) was twice the true rate (0.045), forecasting step 250; at step 250 `hidden` still had 2.65 bits, so
  _refuted (past the forecast step with >= REFUTED_BITS = 2 left) dropped it although the layer kept falling to its
  overflow; the refutation set `floor` a bit lower (2.4) and no later window was both _significant (3 standard
  errors of ~0.3 bits of batch noise over 12 consecutive steps is ~0.075 bits/step) and steady until 0.4 bits. The
  window is WINDOW = 12 points at any stride, so the denser the series (every=1, headroom=True, the default's stride
  1) the shorter the time a slope is judged over; at strides 8-32 the same growth is warned ~70-110 steps early.
- (fixed since, with root_logit_temperature below: record/budget.py `creep` has the series on every step while an
  fp16 output within 8 bits of the max keeps rising, so the window spans steps, not strides)
  amplifier_chain at the default's stride 2: `headroom_trend at expand step 311` (3.3 bits, forecast 403), then a
  second `headroom_trend at embed step 315` for the same growth: the earliest names `expand`, which only amplifies
  embed's output. Cause: headroom_trend (rules/headroom.py) puts a layer into the warned layer's chain only when
  `_rate_at` gives it a rate at that step, and _rate_at returns None whenever the layer's own 12-point slope is
  above -MIN_RATE (0.03 bits/step): embed falls 0.035 bits a step and its window ending at step 311 reads -0.025, so
  the chain is [expand] (the relative 0.5-2x test and CHAIN_BITS are never reached) and embed's own warning becomes
  a second finding. At every=1 and at strides 1, 4-32 the same run names embed only.
- root_logit_temperature at the default's stride 32: no headroom_trend at all; the model's logits grow x1.03 a step
  from 2^-3 to inf at step 389. Cause: `_fitting` (rules/headroom.py), the exemption for "the model's own output
  growing while the loss falls", compares the median loss around a window's start (+- half the window) with that of
  its last half; at stride 32 a 12-point window spans ~350 steps and reaches back to the first ~140 steps, while the
  classifier was still learning (loss 1.38 -> 0, exactly 0 from step ~140), so every window reads as fitting and is
  exempt, although the loss had been 0 for 250 steps and nothing pulls the logits back. At strides 1-24 the windows
  are shorter and the same run is warned (at every=1: step 285, 4.4 bits left).
Seen while writing this (not asserted): in root_logit_temperature the logits first hold inf at step 389 with a
finite loss (0.0), and the `overflow` finding is dated 398; in annealed_attention_temperature the forecast came true
(inf at step 460 in `temp`) but headroom_trend stays a warning, since the inf's producer was not located
(`nan_origin at (run) step 460 ... a step without per-layer statistics` at every=200).

Runtime: ~40 s on one core (each scenario runs twice: the test's own measurement, then watched).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import same_losses  # noqa: E402
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16_MAX = 65504.0
LEAD = 10        # the promise: at least this many steps before the first inf or skipped step
SEARCH = 10      # GradScaler's first steps: a skip there is its search from init_scale, not the growth
AFTER_BAD = 5    # steps run after the first bad one


def bits(v: float) -> float:
    return math.log2(FP16_MAX / v) if v > 0 and math.isfinite(v) else (math.inf if v == 0 else -math.inf)


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope (per step) of (step, value) points."""
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((s - mx) ** 2 for s, _ in points)
    return sum((s - mx) * (v - my) for s, v in points) / sxx


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


# --- the loop and the test's own measurement --------------------------------------------------------------------

class Probe:
    """Forward hooks on the named modules: per step, the abs-max of the floating output (any dtype) and of the
    floating inputs; the first (step, module) whose output holds inf/NaN."""

    def __init__(self, model, names):
        self.step = 0
        self.out: dict[str, dict[int, float]] = {n: {} for n in names}
        self.inp: dict[str, dict[int, float]] = {n: {} for n in names}
        self.cross: tuple[int, str] | None = None
        mods = dict(model.named_modules())
        self.handles = [mods[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name):
        def hook(mod, args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            with torch.no_grad():
                a = t.detach().float().abs().max().item()
                xs = [x.detach().float().abs().max().item() for x in args
                      if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()]
            o, i = self.out[name], self.inp[name]   # the largest over the step's calls (a target network pass)
            o[self.step] = max(a, o.get(self.step, 0.0)) if math.isfinite(a) else a
            if xs:
                i[self.step] = max(max(xs), i.get(self.step, 0.0))
            if not math.isfinite(a) and self.cross is None:
                self.cross = (self.step, name)
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


class Scenario:
    def __init__(self, *, build, opt, batch, loss, steps, init_scale=65536.0, after=None, watch=None, grower=None,
                 passers=(), probe=(), span=40, min_rate=0.03, input_flat=True, seed=0):
        self.build, self.opt, self.batch, self.loss, self.steps = build, opt, batch, loss, steps
        self.init_scale, self.after, self.watch = init_scale, after, {} if watch is None else watch
        self.grower, self.passers, self.span, self.min_rate = grower, tuple(passers), span, min_rate
        self.probe = tuple(dict.fromkeys(([grower] if grower is not None else []) + list(passers) + list(probe)))
        self.input_flat, self.seed = input_flat, seed


class Run:
    pass


def run(sc: Scenario, *, watched: bool, stop=True, steps=None) -> Run:
    """zero_grad -> autocast fp16 forward + loss -> scaler.scale(loss).backward() -> unscale_ -> step -> update ->
    after(model, opt, i) under no_grad. Unwatched with the test's probe, or watched (sc.watch) without it, for
    `steps` steps (the reference run's count) when given."""
    torch.manual_seed(sc.seed)
    model = sc.build()
    opt = sc.opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=sc.init_scale)
    probe = None if watched else Probe(model, sc.probe)
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, **sc.watch) if watched else None
    r = Run()
    r.losses, r.scales, r.skips, r.first_bad = [], [], [], None
    try:
        for i in range(sc.steps if steps is None else steps):
            if probe is not None:
                probe.step = i
            opt.zero_grad(set_to_none=True)
            args = sc.batch(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sc.loss(model, i, *args)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < before
            if sc.after is not None:
                with torch.no_grad():
                    sc.after(model, opt, i)
            r.losses.append(loss.item())
            r.scales.append(scaler.get_scale())
            if skipped:
                r.skips.append(i)
            bad = (not math.isfinite(r.losses[-1]) or (skipped and i >= SEARCH)
                   or (probe is not None and probe.cross is not None))
            if bad and r.first_bad is None:
                r.first_bad = i
            if stop and steps is None and r.first_bad is not None and i >= r.first_bad + AFTER_BAD:
                break
    finally:
        if w is not None:
            w.close()
        if probe is not None:
            probe.close()
    r.probe, r.model, r.w = probe, model, w
    if w is not None:
        r.rep = w.report(replay=False)
        r.findings = r.rep.findings
        r.lines = [f.one_line() for f in r.findings]
        r.trend = sorted((f for f in r.findings if f.rule == "headroom_trend"), key=lambda f: f.step)
    return r


def series(r: Run, module: str, kind="out") -> dict[int, float]:
    d = r.probe.out[module] if kind == "out" else r.probe.inp[module]
    return {s: bits(v) for s, v in d.items()}


def rate_before(r: Run, module: str, end: int, span: int, kind="out") -> float:
    """The test's own rate: bits lost per step (positive when falling), least squares over [end - span, end)."""
    s = series(r, module, kind)
    pts = [(k, v) for k, v in s.items() if end - span <= k < end and math.isfinite(v)]
    return -slope(pts)


def ce(m, i, x, y):
    return F.cross_entropy(m(x).float(), y)


def cls_batch(d=16, n=64, k=4, scale=1.0, seed=0):
    W = torch.randn(d, k, generator=gen(seed + 999))

    def batch(i):
        x = torch.randn(n, d, generator=gen(seed * 100000 + i))
        return x * (scale(i) if callable(scale) else scale), (x @ W).argmax(-1)
    return batch


# --- A) failing scenarios -------------------------------------------------------------------------------------------

class PostLN(nn.Module):
    def __init__(self, small=0.05):
        super().__init__()
        self.inp, self.hidden = nn.Linear(16, 64), nn.Linear(64, 64)
        self.ln, self.head = nn.LayerNorm(64), nn.Linear(64, 4)
        with torch.no_grad():
            self.hidden.weight.mul_(small)
            self.hidden.bias.mul_(small)

    def forward(self, x):
        return self.head(self.ln(self.hidden(torch.relu(self.inp(x)))))


def sc_decay_sign_adam(watch=None):
    def after(m, o, i):        # decoupled decay by hand, p *= (1 - wd) with wd = -0.03: the sign is wrong
        for p in m.hidden.parameters():
            p.mul_(1.03)
    return Scenario(build=PostLN, opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), batch=cls_batch(), loss=ce,
                    steps=600, after=after, grower="hidden", probe=["ln", "head"], span=60, watch=watch)


class PosNet(nn.Module):
    def __init__(self, V=32, T=12, d=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        self.proj, self.ln, self.head = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, V)
        with torch.no_grad():
            self.pos.weight.mul_(0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(torch.relu(self.proj(x))))


def sc_positional_table():
    data = torch.randint(0, 32, (64, 13), generator=gen(7))

    def batch(i):
        rows = data[(torch.arange(16) + 16 * i) % 64]
        return rows[:, :-1], rows[:, 1:]

    def loss(m, i, x, y):   # "L2 on the positional table", coefficient -0.25: the sign is wrong
        return F.cross_entropy(m(x).float().flatten(0, 1), y.flatten()) - 0.25 * m.pos.weight.pow(2).sum()
    return Scenario(build=PosNet, opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.05), batch=batch, loss=loss,
                    steps=700, grower="pos", passers=["proj"], probe=["ln", "head"], span=60)


class Anneal(nn.Module):
    """scores * beta, beta a buffer multiplied by `rate` on every training forward (up to `cap`, when given)."""

    def __init__(self, rate=1.025, cap=None, start=0.02):
        super().__init__()
        self.rate, self.cap = rate, cap
        self.register_buffer("beta", torch.tensor(start))

    def forward(self, s):
        if self.training:
            self.beta.mul_(self.rate)
            if self.cap is not None:
                self.beta.clamp_(max=self.cap)
        return s * self.beta.to(s.dtype)


class AttnPool(nn.Module):
    def __init__(self, cap=None, d=32):
        super().__init__()
        self.emb = nn.Linear(16, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.temp = Anneal(1.025, cap)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.relu(self.emb(x))
        s = self.temp(self.q(h) @ self.k(h).transpose(-1, -2))
        return self.head((s.softmax(-1) @ self.v(h)).mean(1))


def attn_batch():
    W = torch.randn(16, 4, generator=gen(77))

    def batch(i):
        x = torch.randn(16, 8, 16, generator=gen(3000 + i))
        return x, (x.mean(1) @ W).argmax(-1)
    return batch


def sc_annealed_attention_temperature(cap=None, steps=700):
    return Scenario(build=lambda: AttnPool(cap), opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                    batch=attn_batch(), loss=ce, steps=steps, init_scale=256.0, grower="temp", probe=["q", "head"],
                    span=60)


class AmpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.expand = nn.Linear(64, 256)
        with torch.no_grad():
            self.embed.weight.mul_(0.05)
            self.expand.weight.copy_(torch.randn(256, 64))   # a from-scratch init: no 1/sqrt(fan_in)
        self.ln, self.head = nn.LayerNorm(256), nn.Linear(256, 4)

    def forward(self, x):
        return self.head(self.ln(self.expand(torch.relu(self.embed(x)))))


def sc_amplifier_chain(watch=None):
    def loss(m, i, x, y):   # an L2 penalty on embed with its coefficient's sign flipped
        return ce(m, i, x, y) - 0.25 * m.embed.weight.pow(2).sum()

    def opt(m):
        return torch.optim.SGD([{"params": [m.embed.weight], "lr": 0.05},
                                {"params": [p for n, p in m.named_parameters() if n != "embed.weight"], "lr": 1e-3}])
    return Scenario(build=AmpNet, opt=opt, batch=cls_batch(), loss=loss, steps=700, init_scale=1024.0,
                    grower="embed", passers=["expand"], probe=["ln", "head"], span=60, watch=watch)


class TempClassifier(nn.Module):
    def __init__(self, cap=None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.cap = cap
        self.register_buffer("inv_temp", torch.tensor(0.05))

    def forward(self, x):
        if self.training:
            self.inv_temp.mul_(1.03)       # annealed towards a sharp softmax; the floor on the temperature is missing
            if self.cap is not None:
                self.inv_temp.clamp_(max=self.cap)
        return self.head(self.body(x)) * self.inv_temp.to(torch.float16)


def separable_batch(d=16, k=4, n=64, seed=3, scale=1.0):
    C = torch.randn(k, d, generator=gen(seed)) * 3

    def batch(i):
        g = gen(seed * 1000 + i)
        y = torch.randint(0, k, (n,), generator=g)
        return scale * (C[y] + 0.3 * torch.randn(n, d, generator=g)), y
    return batch


def sc_root_logit_temperature(cap=None, watch=None):
    return Scenario(build=lambda: TempClassifier(cap), opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                    batch=separable_batch(), loss=ce, steps=600, init_scale=1024.0, grower="", probe=["head"],
                    span=60, watch=watch)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.gn, self.head = nn.GroupNorm(2, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.gn(self.conv2(torch.relu(self.conv1(x))))
        return self.head(torch.relu(h).mean((2, 3)))


def sc_prune_rescale_conv():
    W = torch.randn(3, 4, generator=gen(9))

    def batch(i):
        x = torch.randn(16, 3, 8, 8, generator=gen(400 + i))
        return x, (x.mean((2, 3)) @ W).argmax(-1)
    mask = {}

    def after(m, o, i):
        w = m.conv2.weight
        if "m" not in mask:  # keep the largest 70%...
            mask["m"] = (w.abs() >= w.abs().flatten().kthvalue(int(0.3 * w.numel())).values).to(w.dtype)
        w.mul_(mask["m"]).div_(0.91)   # ... and the bug: the rescale is applied on every step, not once
    return Scenario(build=ConvNet, opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), batch=batch, loss=ce,
                    steps=200, after=after, grower="conv2", probe=["conv1", "gn", "head"], watch={"every": 1})


def sc_unfreeze_decay_sign_at_60():
    def build():
        m = PostLN(small=1.0)
        m.hidden.requires_grad_(False)
        return m

    def after(m, o, i):
        if i == 59:   # unfreeze `hidden` into a decay group whose decay has the wrong sign
            m.hidden.requires_grad_(True)
            o.add_param_group({"params": list(m.hidden.parameters()), "lr": 1e-3})
        if i >= 59:
            for p in m.hidden.parameters():
                p.mul_(1.08)
    return Scenario(build=build, opt=lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad],
                                                                 lr=1e-3),
                    batch=cls_batch(scale=3.0), loss=ce, steps=250, after=after, grower="hidden",
                    probe=["inp", "ln", "head"], span=40, watch={"every": 1})


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 64, bias=False), nn.ReLU())
        self.features.requires_grad_(False)
        self.value = nn.Linear(64, 1, bias=False)

    def forward(self, s):
        return self.value(self.features(s))


def sc_td_without_target_network():
    def batch(i):
        s = torch.rand(64, 8, generator=gen(200 + i))
        return s, 2 * s            # every transition s -> 2s, reward 0: V(s') = 2 V(s) for a bias-free ReLU critic

    def loss(m, i, s, s2):
        with torch.no_grad():
            target = 0.99 * m(s2).float()     # bootstrapped from the same network: no target network
        return F.mse_loss(m(s).float(), target)
    return Scenario(build=Critic, opt=lambda m: torch.optim.SGD(m.value.parameters(), lr=0.02), batch=batch,
                    loss=loss, steps=200, init_scale=16.0, grower="value", probe=["features.0"], span=30,
                    watch={"every": 1})


class LinearProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


def sc_probe_head_lr_too_high():
    Wt = torch.randn(16, 1, generator=gen(5))

    def batch(i):
        x = torch.randn(64, 16, generator=gen(100 + i))
        return x, 0.25 * (x @ Wt)
    return Scenario(build=LinearProbe, opt=lambda m: torch.optim.SGD(m.head.parameters(), lr=0.7), batch=batch,
                    loss=lambda m, i, x, y: F.mse_loss(m(x).float(), y), steps=200, init_scale=32.0, grower="head",
                    probe=["backbone.2"], span=30, watch={"every": 1})


def sc_noisy_sgd_decay_sign():
    lr = 0.05

    def after(m, o, i):
        for p in m.hidden.parameters():     # p.add_(p, alpha=-lr * wd) meant; written with +, wd = 0.5
            p.add_(p, alpha=lr * 0.5)
    return Scenario(build=PostLN, opt=lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9),
                    batch=cls_batch(), loss=ce, steps=400, after=after, grower="hidden", probe=["ln", "head"],
                    span=100, watch={"every": 1})


FAILING = {
    "decay_sign_adam": sc_decay_sign_adam,
    "positional_table": sc_positional_table,
    "amplifier_chain_every1": lambda: sc_amplifier_chain(watch={"every": 1}),
    "root_logit_temperature_every1": lambda: sc_root_logit_temperature(watch={"every": 1}),
    "prune_rescale_conv": sc_prune_rescale_conv,
    "unfreeze_decay_sign_at_60": sc_unfreeze_decay_sign_at_60,
    "td_without_target_network": sc_td_without_target_network,
    "probe_head_lr_too_high": sc_probe_head_lr_too_high,
    "noisy_sgd_decay_sign": sc_noisy_sgd_decay_sign,
    "decay_sign_adam_every1": lambda: sc_decay_sign_adam(watch={"every": 1}),
}
FAILING_XFAIL: dict[str, str] = {
    "positional_table": (
        "headroom_trend names `proj` (step 488, 3.4 bits left), whose input tok + pos grows, never the growing fp32 "
        "table `pos`: the series holds fp16/bf16 values only (record/headroom.py Headroom._forward skips other "
        "dtypes, record/series.py from_calls likewise, rules/headroom.py series() reads only 'h'/'b'), so an "
        "Embedding's fp32 output has no series and the producer search in headroom_trend starts at its consumer "
        "(overflow_risk in rules/numeric.py does follow fp32 values into fp16 ops and names `pos`)"),
}


def _params(table, xfails):
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=xfails[n])] if n in xfails else [], id=n)
            for n in table]


@pytest.mark.parametrize("name", _params(FAILING, FAILING_XFAIL))
def test_steady_growth_is_warned_at_the_growing_layer_10_steps_before_the_first_inf_or_skip(name):
    sc = FAILING[name]()
    ref = run(sc, watched=False)
    bad = ref.first_bad
    assert bad is not None and bad >= 2 * LEAD, (bad, ref.skips, ref.losses[-3:])
    # the growth, measured by the test: the grower loses headroom steadily before the first bad step...
    rate = rate_before(ref, sc.grower, bad, sc.span)
    assert rate >= sc.min_rate, (sc.grower, rate)
    g = series(ref, sc.grower)
    assert g[bad - 1] < 8.0, (sc.grower, g[bad - 1])        # ... into the rule's 8-bit reach before going bad
    # ... and it is the producer: its input does not grow (a passer's input grows at about its rate)
    if sc.input_flat and ref.probe.inp[sc.grower]:
        grew_in = rate_before(ref, sc.grower, bad, sc.span, "in")
        assert grew_in < 0.25 * rate, (sc.grower, "input", grew_in, rate)
    for p in sc.passers:
        assert rate_before(ref, p, bad, sc.span, "in") > 0.5 * rate, (p, "does not take the growth in")
    # the watched run: the same training, then the finding
    wr = run(sc, watched=True, steps=len(ref.losses))
    same_losses(ref, wr)
    assert wr.trend, (bad, wr.lines)
    first = wr.trend[0]
    assert first.module == sc.grower, (sc.grower, bad, wr.lines)
    assert first.step <= bad - LEAD, (first.step, bad, wr.lines)
    ev = first.evidence
    assert abs(ev["headroom_bits"] - g[first.step]) < 0.05, (ev, g[first.step])       # the current headroom
    measured = rate_before(ref, sc.grower, first.step + 1, sc.span)
    assert 0.5 * measured <= -ev["rate_bits_per_step"] <= 2.0 * measured, (ev, measured)  # the rate
    assert ev["forecast_step"] > first.step, ev                                            # a forecast ahead
    assert not [f.one_line() for f in wr.trend if f.module in sc.passers]


PINNED = {
    # (scenario, stride): what the default watch does when its budget picks that stride (it picks 1..32 here)
    ("amplifier_chain", 2): sc_amplifier_chain,
    ("root_logit_temperature", 32): sc_root_logit_temperature,
    # (unpinned in FAILING until the thirty-second session, whose full suite under heavy load had the budget pick
    # stride 1 or 2, where it failed until the thirty-eighth session: see the note below PINNED_XFAIL)
    ("annealed_attention_temperature", 8): sc_annealed_attention_temperature,
    ("annealed_attention_temperature", 1): sc_annealed_attention_temperature,
}
PINNED_XFAIL: dict[tuple, str] = {}
# wrong when written, right since the thirty-eighth session (rules/headroomseries.py `windows`: a dense series is
# also judged over its last LONG_SPAN steps): annealed_attention_temperature at stride 1 (and on AMD EPYC CPUs at
# strides 4-16 too, where the series runs on every step from step ~250 while `temp` creeps): no headroom_trend at
# all (first bad step 457-458): `temp` grows x1.025 a step, 0.036 bits/step, and 12 points on 12 steps fall by less
# than the batch-to-batch noise of the attention scores (0.3-0.5 bits), so no 12-point window was steady and
# significant
# wrong when written, right since (record/budget.py `creep`: the series on every step while an fp16 output within 8
# bits of the max keeps rising, so the trend window spans steps, not strides): amplifier_chain at stride 2 (the
# layer that only amplifies embed's output named) and root_logit_temperature at stride 32 (no headroom_trend: the
# 12-point window at stride 32 reached back to the steps where the classifier learned)


@pytest.mark.parametrize("name,stride", [
    pytest.param(n, k, marks=[pytest.mark.xfail(strict=True, reason=PINNED_XFAIL[(n, k)])]
                 if (n, k) in PINNED_XFAIL else [], id=f"{n}-stride{k}") for n, k in PINNED])
def test_default_watch_at_a_stride_its_budget_picks(name, stride, monkeypatch):
    """The default watch (headroom="auto") with its series' stride pinned (tests/stride_sweep.py, as
    test_trend_strides.py does): on these tiny CPU models the budget picks any stride from 1 to 32 from one run to
    the next, so these are runs a user gets. The stride is asserted from the records."""
    import stride_sweep
    sc = PINNED[(name, stride)]()
    ref = run(sc, watched=False)
    bad = ref.first_bad
    assert bad is not None, ref.skips
    stride_sweep.install(stride, patch=monkeypatch.setattr)
    wr = run(sc, watched=True, steps=len(ref.losses))
    same_losses(ref, wr)
    on = [r.step for r in wr.w.steps if r.headroom and not r.sampled and r.step > 20]
    # (the stride the budget runs at; a layer nearing the max has the series on every step for a while:
    # record/budget.py `creep`)
    gaps = [b - a for a, b in zip(on, on[1:])]
    assert stride == 1 or max(set(gaps), key=[g for g in gaps if g > 1].count) == stride, on[:20]
    assert wr.trend, (bad, wr.lines)
    first = wr.trend[0]
    assert first.module == sc.grower and first.step <= bad - LEAD, (sc.grower, bad, wr.lines)
    assert not [f.one_line() for f in wr.trend if f.module in sc.passers]


def test_late_onset_growth_is_forecast_from_the_recent_trend():
    """Scenario 7: healthy for 60 steps, then x1.08 a step. The warning's rate is the recent one, not a line through
    the run so far (which the flat start makes far slower), and its forecast lands within 15 steps of the real
    overflow (the forward inf that is the first bad step)."""
    sc = sc_unfreeze_decay_sign_at_60()
    ref = run(sc, watched=False)
    bad = ref.first_bad
    assert ref.probe.cross is not None and ref.probe.cross[0] == bad, (ref.probe.cross, bad)   # a forward overflow
    g = series(ref, "hidden")
    assert abs(g[59] - g[0]) < 1.0, (g[0], g[59])                   # flat before the onset
    wr = run(sc, watched=True, steps=len(ref.losses))
    same_losses(ref, wr)
    first = wr.trend[0] if wr.trend else None
    assert first is not None and first.module == "hidden" and 60 < first.step <= bad - LEAD, wr.lines
    recent = rate_before(ref, "hidden", first.step + 1, 30)
    so_far = rate_before(ref, "hidden", first.step + 1, first.step + 1)
    assert recent > 1.5 * so_far, (recent, so_far)                 # the two estimates differ...
    rate = -first.evidence["rate_bits_per_step"]
    assert 0.75 * recent <= rate <= 1.5 * recent, (first.evidence, recent, so_far)   # ... and the warning's is recent
    assert abs(first.evidence["forecast_step"] - bad) <= 15, (first.evidence, bad)


# --- B) healthy runs ----------------------------------------------------------------------------------------------

class HintNet(nn.Module):
    """A student whose `hint` layer is regressed (FitNets) onto a teacher's unnormalised features."""

    def __init__(self):
        super().__init__()
        self.inp, self.hint = nn.Linear(16, 64), nn.Linear(64, 64)
        self.ln, self.head = nn.LayerNorm(64), nn.Linear(64, 4)

    def forward(self, x):
        h = self.hint(torch.relu(self.inp(x)))
        self.last_hint = h
        return self.head(self.ln(h))


def hint_batch(level=1500.0):
    Wt = torch.randn(16, 64, generator=gen(51)) / 4
    base = cls_batch(seed=5)

    def batch(i):
        x, y = base(i)
        return x, y, level * torch.tanh(x @ Wt)
    return batch


def hint_loss(m, i, x, y, t):
    out = m(x)
    return F.cross_entropy(out.float(), y) + 1e-3 * F.mse_loss(m.last_hint.float(), t)


def sc_hint_warmup_settles(watch=None, lr=3.0, warm=40):
    def opt(m):   # the hint regressor's own group, warmed up over 40 steps
        return torch.optim.Adam([{"params": m.hint.parameters(), "lr": lr / warm},
                                 {"params": [p for n, p in m.named_parameters() if not n.startswith("hint")],
                                  "lr": 1e-3}])

    def after(m, o, i):
        o.param_groups[0]["lr"] = lr * min(1.0, (i + 2) / warm)
    return Scenario(build=HintNet, opt=opt, batch=hint_batch(), loss=hint_loss, steps=300, after=after,
                    init_scale=1024.0, probe=["hint"], watch=watch)


def amp_batch(amplitude, d=16, n=64, k=4, seed=6):
    """Inputs of amplitude `amplitude(i)` at step i (raw, unnormalised), labels from their direction."""
    W = torch.randn(d, k, generator=gen(seed + 999))

    def batch(i):
        x = torch.randn(n, d, generator=gen(seed * 100000 + i))
        return x * amplitude(i), (x @ W).argmax(-1)
    return batch


def stem_mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))


def sc_periodic_inputs():
    # amplitude 2^(0.5 .. 5.5) * 40 over a 50-step period; 310 steps end in a rising half (headroom falling)
    return Scenario(build=stem_mlp, opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                    batch=amp_batch(lambda i: 40.0 * 2.0 ** (3.0 + 2.5 * math.sin(2 * math.pi * i / 50))),
                    loss=ce, steps=310, probe=["0"], watch={"every": 1})


def sc_log_growth():
    return Scenario(build=stem_mlp, opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                    batch=amp_batch(lambda i: 300.0 * math.log(2 + i / 4), seed=7),
                    loss=ce, steps=300, probe=["0"], watch={"every": 1})


def sc_flat_at_2_12():
    return Scenario(build=stem_mlp, opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-4),
                    batch=amp_batch(lambda i: 2000.0, seed=8), loss=ce, steps=300, probe=["0"])


class GainAdapter(nn.Module):
    """A pretrained adapter (fixed) whose output gain g was frozen at 1/8 during a head-only warmup."""

    def __init__(self, Wt, level):
        super().__init__()
        self.proj = nn.Linear(16, 64, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(level * Wt.t())
        self.proj.requires_grad_(False)
        self.g = nn.Parameter(torch.tensor(0.125), requires_grad=False)

    def forward(self, x):
        return self.proj(x) * self.g.to(torch.float16)


class JumpNet(nn.Module):
    def __init__(self, Wt, level):
        super().__init__()
        self.adapter = GainAdapter(Wt, level)
        self.ln, self.head = nn.LayerNorm(64), nn.Linear(64, 4)

    def forward(self, x):
        h = self.adapter(x)
        self.last_hint = h
        return self.head(self.ln(h))


def sc_unfreeze_jump():
    level = 1500.0
    Wt = torch.randn(16, 64, generator=gen(51)) / 4

    def after(m, o, i):
        if i == 99:   # unfreeze the gain after the head-only warmup
            m.adapter.g.requires_grad_(True)
            o.add_param_group({"params": [m.adapter.g], "lr": 0.2})
    return Scenario(build=lambda: JumpNet(Wt, level),
                    opt=lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3),
                    batch=hint_batch(level), loss=hint_loss, steps=300, after=after, init_scale=32.0,
                    probe=["adapter"], watch={"every": 1})


HEALTHY = {
    # name: (scenario, the module whose abs-max the trap is about)
    "hint_warmup_settles": (sc_hint_warmup_settles, "hint"),
    "hint_warmup_settles_every1": (lambda: sc_hint_warmup_settles(watch={"every": 1}), "hint"),
    "periodic_inputs_every1": (sc_periodic_inputs, "0"),
    "log_growth_every1": (sc_log_growth, "0"),
    "flat_at_2_12": (sc_flat_at_2_12, "0"),
    "unfreeze_jump_every1": (sc_unfreeze_jump, "adapter"),
    "annealed_temperature_capped": (lambda: sc_annealed_attention_temperature(cap=212.0, steps=600), "temp"),
    "root_logit_temperature_capped": (lambda: sc_root_logit_temperature(cap=612.0), ""),
}
HEALTHY_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize("name", _params(HEALTHY, HEALTHY_XFAIL))
def test_healthy_growth_oscillation_jump_or_plateau_is_silent(name):
    maker, module = HEALTHY[name]
    sc = maker()
    ref = run(sc, watched=False, stop=False)
    assert all(map(math.isfinite, ref.losses)), ref.losses
    assert len([s for s in ref.skips if s >= SEARCH]) <= 1, ref.skips   # at most one ordinary backoff
    s = series(ref, module)
    assert min(s.values()) <= 8.0, min(s.values())       # inside the rule's 8-bit reach
    assert min(s.values()) > 1.5, min(s.values())        # and not overflow_risk's 1 bit
    wr = run(sc, watched=True, steps=len(ref.losses))
    same_losses(ref, wr)
    assert not wr.trend, wr.lines
    assert not alarms(wr.findings), wr.lines
