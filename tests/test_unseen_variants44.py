"""Forty-fourth set: THE REAL FAULT AMONG OTHERS (ranking). Ten fp16 runs in which the real, training-breaking fault
sits beside other things a rule engine may also report: GradScaler's ordinary search for a loss scale and a later
benign skip, a layer at 92% of fp16's max that never overflows, a float32 layer far past 65504, a second independent
fault, a loop misuse, a module called twice per forward, the module that turns the inf into NaN, a crash after the
NaN, a 300k-parameter trunk that spreads one inf element to every element, and the skipped_steps /
loss_scale_collapse consequences of a NaN on every step. Watched through the public API only
(`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")` at the default settings: full
statistics on step 0 and every 200th, so every fault below sits on an unsampled step) -> an ordinary CPU fp16
autocast + `torch.amp.GradScaler("cpu")` (default init_scale 65536) loop: scale(loss).backward -> unscale_ ->
clip_grad_norm_ -> step -> update -> close -> `w.report()` (5: clip before unscale_; 8: the run dies first).

Each fault is proven first by the test's own oracle: probe_harness.Producer (keyword inputs checked: the first
module whose output is non-finite while its inputs and own parameters were finite, at which step; for 6 at which
call of the step; for 4 EveryProducer, every such (module, step)), the steps whose loss is non-finite, the steps the
scaler skipped (its scale before and after each step), plus what each distractor really did (the near-max layer's
peak on every call, the float32 layer's dtype and peak, the clip's norm against the norm the optimizer got, what the
NaN maker received and returned, the non-finite element counts layer by layer, the crash's step and message) and,
where the fault is an fp16 one, the same batch in float32 (a fresh model, no autocast) staying finite. A failing
oracle is a plain failure. Only then must the rule be among the report's first three findings at the PRODUCER (not
a module that only passed the inf/NaN on), at its step and phase, an error (CONTRACT.md: `error` = training is broken
or silently wrong); a wrong report raises WrongAnswer naming ampdoctor's top three (rule@module step [severity]).

 1. a tabular price regressor (8 -> 32 -> 32 -> 1): GradScaler's search skips steps 0 and 2 (scaled gradients past
    fp16 at 65536), at step 9 one missing reading arrives as the sentinel 99999 (inf in `inp`'s fp16 cast), at step
    14 four labels arrive in cents (x 100: a finite loss of ~4500 whose scaled backward overflows at the settled
    scale: a single benign skip) -> overflow at `inp`, step 9, forward, error, in the top three; the search's
    findings (steps 0-2) only `info` (CONTRACT: the first backoffs alone are info).
 2. a listing model of two towers: a frozen pretrained text tower whose projection `text.proj` runs at 60000
    (>= 0.9 x 65504 on every call, never past it) and a numeric tower whose features arrive un-standardised at step 7
    (52000 +- 4000, each below 65504): `num.fc1`'s matmul overflows -> overflow at `num.fc1`, step 7, error, in the
    top three; no error at `text.proj` / `text` / `text.down` (an overflow_risk warning there is true and allowed).
 3. a next-item recommender with float32 time features (`clock`: seconds since the dataset's start x 2 pi / period,
    autocast off, up to 1.2e5, only ever read by sin/cos in float32) and an entropy bonus `ent` computed in fp16:
    the sampler's temperature drops from 1 to 0.05 at step 6 (and stays), fp16 softmax flushes p to 0, 0 * log 0 =
    NaN on every step from 6 -> nan_origin (or overflow: log(0) = -inf, or underflow: p flushed to 0) at `ent`,
    step 6, error, in the top three; no warning or error at `clock`.
 4. TWO independent faults in a store-demand model: at step 8 one store's features arrive x 100 and the Poisson
    head `rate` (exp(log-rate) in fp16) overflows; at step 14 a new store with no sales history (an all-zero
    histogram) reaches `hist_norm` ((h - mean) / (std + 1e-8), 1e-8 == 0 in fp16: 0 / 0 = NaN) -> overflow at
    `rate`, step 8, error, in the top three (CONTRACT: findings most important first, root causes before their
    consequences; it sets no order between two independent root causes, so none is asserted), and an error
    (nan_origin or eps_underflow) at `hist_norm`, step 14, anywhere in the report.
 5. a SwiGLU classifier in a loop that calls clip_grad_norm_ BEFORE unscale_ (every step: the clip sees norms of
    ~65536 x the true one, the optimizer gets gradients of norm <= 1/65536, 100x and more below what clipping the true
    gradients would give); at step 6 one row arrives in raw units (x 1000) and `ff`'s silu(gate) * up passes 65504
    (gate and up finite) -> both in the top three: overflow at `ff`, step 6, forward, error, and clip_before_unscale
    (module null, step 0, error).
 6. a Siamese pair scorer whose feature-crossing tower (a(x) * b(x)) is shared by query and candidate (two calls per
    forward): at step 5 one candidate arrives un-standardised (x 300), the tower's SECOND call overflows (its first,
    the query, finite) -> overflow at `tower`, step 5, error, in the top three; no error at `tower.out`, `head`,
    the root.
 7. a sensor classifier: `inp` (per-timestep Linear) -> `ln` (LayerNorm, fp16 on CPU): one window arrives in raw ADC
    counts at step 6 (each < 65504), `inp`'s matmul gives +-inf, `ln` receives the inf (no NaN) and returns NaN
    (inf - mean) -> overflow at `inp` (the producer, not the NaN maker), step 6, error, in the top three; anything
    said of `ln` at step 6 ranked below it (CONTRACT: root causes before their consequences).
 8. a cosine classifier (x / (||x|| + 1e-8) in fp16) whose batch at step 7 holds a dead sensor's all-zero row:
    0 / 0 = NaN at `norm`, the loss NaN, the step skipped; then the run CRASHES at step 9 (a) inside `with
    ampdoctor.watch(...)` on the logger's `assert math.isfinite(mean loss since the last line)`, (b) in a script
    that opens the watch without `with` and never reaches close(), on a shape error (the epoch's short last batch
    of 20 rows meets a hard-coded `.view(32, 4)`); its Producer runs inside the script and writes its truth step by
    step -> the report after the crash (a: `w.report()` and `diagnose(run_dir)`; b: `diagnose(run_dir)`) exits 1,
    has an alarm (not "healthy") and names nan_origin or eps_underflow at `norm`, step 7, error, in the top three.
 9. FiLM conditioning: a 5-parameter `film` (exp(w . z + b), 4 context features) scales the input of a 297k-parameter
    trunk (Linear 64 -> 512, BatchNorm1d, ReLU, 512 -> 512, ReLU, -> 1): at step 8 one row's context arrives x 40,
    `film` overflows in ONE element; `trunk.0` makes that row's 512 elements non-finite, the BatchNorm all 16384
    -> overflow at `film`, step 8, error, in the top three; no error at the trunk's layers or the root.
10. a document classifier with learned-query attention pooling (key-padding mask filled with -inf): from step 5 the
    loader reads a shard with an empty document in every batch, the fully masked row's softmax is NaN on every
    step, 20 skips in a row (the scale <= 65536 / 2^20) -> nan_origin at `pool`, step 5, error, in the top three,
    above or beside the consequences (skipped_steps, loss_scale_collapse).

What ampdoctor says (torch 2.13 CPU; 10 of 11 right, 1 strict xfail failing only at the report check):
- right: 1 `[error] overflow at inp aten::_to_copy step 9`, `[error] skipped_steps step 9`, the search `[info]
  overflow at out step 0 ... as designed`; 2 `[error] overflow at num.fc1 aten::addmm step 7`, skipped_steps,
  `[warning] overflow_risk at text.proj step 0` (true); 3 `[error] overflow at ent aten::log step 6` + `[error]
  underflow at ent step 6`, nothing at `clock`; 5 `[error] clip_before_unscale step 0`, `[error] overflow at ff
  aten::mul step 6`; 6 `[error] overflow at tower aten::mul step 5`; 7 `[error] overflow at inp aten::addmm step 6`
  ("it propagates to aten::native_layer_norm in `ln`"), nothing at `ln`; 8a and 8b `[error] eps_underflow at norm
  aten::add step 7` + `[error] nan_origin at norm aten::div step 7`, exit 1, the crash recorded in the summary
  (AssertionError / RuntimeError at step 9); 9 `[error] overflow at film aten::exp step 8`; 10 `[error] nan_origin
  at pool aten::_softmax step 5` + `[error] loss_scale_collapse at pool step 5`.
- wrong (strict xfail): 4. The first fault is right (`[error] overflow at rate aten::exp step 8` first), but the
  second is never located: the top three are overflow@rate step 8 [error], skipped_steps@(run) step 8 [error],
  eps_underflow@hist_norm step 8 [warning] ("uses eps 1e-08, which rounds to 0 in float16"), and nothing names step
  14. The step-14 NaN is only counted in skipped_steps. Its record has no forward producer (an unsampled step:
  the default recording only trips on the loss and gradients) and no capture is written for it:
  record/autocapture.py CapturePolicy.observe takes one capture per kind, and a second forward failure (another
  module, another step) is the same kind "forward" as step 8's, so it is never replayed. The eps_underflow warning
  comes from the replay of captures/8, where the eps was seen but not reached (evidence reached 0): right module,
  wrong step and severity.
Noticed (not asserted): in 9 the overflow's message says "it propagates to aten::addmm in `trunk.0`", passing over
the root's own `x * film(z)` (aten::mul in `(root)`) that carries the inf there first.

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants44.py -q -p no:cacheprovider (about 7 s)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import (Producer, WrongAnswer, at_top3, finite, probe_run, wrong)
from scenarios import alarms, gen, lines, no_error_at, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def run(m, batch, loss_fn, steps, run_dir, *, lr=1e-3, call_in_first=False, **kw):
    """probe_harness.probe_run (the user's loop at the default settings: AdamW, GradScaler("cpu") at its default
    init_scale 65536, unscale_ -> clip -> step -> update) with a Producer on keyword inputs as the oracle."""
    return probe_run(m, batch, loss_fn, steps, run_dir, lr=lr,
                     oracle=lambda m: Producer(m, with_kwargs=True, call_in_first=call_in_first), **kw)


class EveryProducer(Producer):
    """Producer (keyword inputs checked), and `hits`: EVERY (module, step) whose output is non-finite while its
    inputs and own parameters were finite, in call order (the first hit of a step is that step's producer)."""

    def __init__(self, m, **kw):
        super().__init__(m, with_kwargs=True, **kw)
        self.hits = []
        for n, mod in m.named_modules():
            self.hs.append(mod.register_forward_hook(self._every(n), with_kwargs=True))

    def _every(self, n):
        def f(mod, args, kwargs, out):
            if finite(args) and finite(kwargs) and not finite(out) and all(
                    bool(torch.isfinite(p).all()) for p in mod.parameters(recurse=False)):
                self.hits.append((n, self.step))
        return f

    def by_step(self):
        """{step: that step's first producer}."""
        out = {}
        for n, s in self.hits:
            out.setdefault(s, n)
        return out


def run_every(m, batch, loss_fn, steps, run_dir, **kw):
    """`run` with an EveryProducer as the oracle; r["producers"] is its by_step()."""
    held = {}
    r = probe_run(m, batch, loss_fn, steps, run_dir, oracle=lambda m: held.setdefault("o", EveryProducer(m)), **kw)
    r["producers"] = held["o"].by_step()
    return r


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} step {f.step} [{f.severity}]"
            for f in rep.findings[:3]]


def named(rep, rules, module, step, phase="forward", severity="error", warns=()):
    """The report check: one of `rules` at `module`, at `step`, in `phase`, with `severity`, among the first three
    findings. A failure is a WrongAnswer naming ampdoctor's top three (rule, module, step, severity)."""
    try:
        return at_top3(rep, rules, module, step=step, phase=phase, severity=severity)
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={list(warns)} ({str(e)[:600]})") from None


def mse(out, y):
    return F.mse_loss(out.float(), y)


# ======================================================================================================================
# 1. a real forward overflow at an unsampled step, between the scaler's step-0 search and a later benign skip
# ======================================================================================================================
class TabRegressor(nn.Module):
    def __init__(self, feats=8, d=32):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(feats, d), nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(F.gelu(self.mid(F.gelu(self.inp(x))))).squeeze(-1)


W8 = randn(8, seed=5)
SENTINEL_AT, CENTS_AT = 9, 14


def sentinel_batch(i):
    """64 rows of 8 standardised features, a price target (x @ W8 * 3, in dollars); at SENTINEL_AT one row's
    missing reading arrives as the sentinel 99999 (> 65504); at CENTS_AT four labels arrive in cents (x 100): a
    finite, large loss whose scaled gradients pass fp16 at the scale the search settled on."""
    x = randn(64, 8, seed=100 + i)
    y = (x @ W8) * 3
    if i == SENTINEL_AT:
        x[5, 2] = 99999.0
    if i == CENTS_AT:
        y[:4] = y[:4] * 100
    return (x,), {}, y


def test_unsampled_overflow_between_the_step0_search_and_a_benign_skip(tmp_path):
    torch.manual_seed(0)
    r = run(TabRegressor(), sentinel_batch, mse, 20, tmp_path / "run")
    # truth: the first producer is `inp` at step 9 (the sentinel becomes inf in its fp16 input cast); the loss is
    # non-finite there only; the scaler skips its search steps (before 3), step 9 and the cents batch 14 (whose
    # forward and loss are finite) and no other
    assert r["first"] == ("inp", SENTINEL_AT), r["first"]
    assert r["bad_loss"] == [SENTINEL_AT], r["bad_loss"]
    search = [s for s in r["skipped"] if s < 3]
    assert search and r["skipped"] == search + [SENTINEL_AT, CENTS_AT], r["skipped"]
    assert math.isfinite(r["losses"][CENTS_AT]), r["losses"]
    rep = r["rep"]
    named(rep, "overflow", "inp", SENTINEL_AT, warns=r["warns"])
    # CONTRACT: the scaler's first backoff steps are `info`
    loud = [f.one_line() for f in rep.findings if f.step in search and f.severity != "info"
            and f.rule in ("overflow", "skipped_steps", "loss_scale_collapse")]
    if loud:
        raise WrongAnswer(f"top3={top3(rep)}; the step-0 search reported as a problem: {loud}")


# ======================================================================================================================
# 2. a real overflow in one branch while a frozen layer of the other sits at 92% of the fp16 max every step
# ======================================================================================================================
class TextTower(nn.Module):
    """A frozen pretrained text tower whose projection runs at ~60000 (a bf16-pretrained layer's activations: every
    step within 9% of fp16's max, never past it), and the down-projection it was trained with."""

    def __init__(self, vocab=50, d=16, h=32, peak=60000.0):
        super().__init__()
        self.emb, self.proj, self.down = nn.Embedding(vocab, d), nn.Linear(d, h), nn.Linear(h, 16)
        with torch.no_grad():
            k = peak / self.proj(self.emb.weight).abs().max()
            self.proj.weight.mul_(k)
            self.proj.bias.mul_(k)
            self.down.weight.mul_(1.0 / peak)

    def forward(self, ids):
        return self.down(self.proj(self.emb(ids))).mean(1)


class NumTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


class ListingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.text, self.num, self.head = TextTower(), NumTower(), nn.Linear(32, 1)
        self.text.requires_grad_(False)

    def forward(self, ids, x):
        return self.head(torch.cat([self.text(ids), self.num(x)], -1)).squeeze(-1)


W8B = randn(8, seed=7)
RAW_AT = 7


def listing_batch(i):
    """32 listings: 12 title tokens and 8 standardised numeric features; at RAW_AT the numeric features arrive
    un-standardised (raw counts 52000 +- 4000, clamped to 40000..64000: each below 65504)."""
    g = gen(200 + i)
    ids = torch.randint(0, 50, (32, 12), generator=g)
    x = torch.randn(32, 8, generator=g)
    y = x @ W8B * 0.5 + (ids % 7 == 0).float().mean(1)
    if i == RAW_AT:
        x = x.clamp(-3, 3) * 4000 + 52000
    return (ids, x), {}, y


def test_overflow_in_one_branch_beside_a_layer_at_92_percent_of_max(tmp_path):
    torch.manual_seed(0)
    m = ListingModel()
    peaks = []
    m.text.proj.register_forward_hook(lambda mod, i, o: peaks.append(float(o.abs().max())))
    r = run(m, listing_batch, mse, 14, tmp_path / "run")
    # truth: `num.fc1`'s matmul overflows at step 7 (its inputs < 65504), the only non-finite loss and the only
    # skip; `text.proj` runs at >= 0.9 x 65504 on every call of the run and never overflows
    assert r["first"] == ("num.fc1", RAW_AT), r["first"]
    assert r["bad_loss"] == [RAW_AT] and r["skipped"] == [RAW_AT], r
    assert float(listing_batch(RAW_AT)[0][1].abs().max()) < 65504
    assert len(peaks) >= 14 and all(0.9 * 65504 <= p < 65504 for p in peaks), peaks
    rep = r["rep"]
    named(rep, "overflow", "num.fc1", RAW_AT, warns=r["warns"])
    try:
        no_error_at(rep, ("text.proj", "text", "text.down"))
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} ({e})") from None


# ======================================================================================================================
# 3. a NaN producer in a model that also has an fp32 layer whose outputs are far past 65504 (and never meet fp16)
# ======================================================================================================================
class Clock(nn.Module):
    """Seconds since the dataset's start -> phase angles for minute/hour/day/week cycles, in float32 with autocast
    off (as time features should be): angles up to ~1.2e5, only ever consumed by sin/cos in float32."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", 2 * math.pi / torch.tensor([60.0, 3600.0, 86400.0, 604800.0]))

    def forward(self, t):
        with torch.autocast("cpu", enabled=False):
            return t.float()[:, None] * self.freq


class Entropy(nn.Module):
    """The policy-entropy bonus of the next-item sampler at temperature tau, in the logits' dtype."""

    def forward(self, logits, tau):
        p = torch.softmax(logits / tau, -1)
        return -(p * torch.log(p)).sum(-1).mean()


class NextItem(nn.Module):
    def __init__(self, n_items=64, feats=8, d=32):
        super().__init__()
        self.clock = Clock()
        self.enc = nn.Sequential(nn.Linear(feats + 8, d), nn.GELU(), nn.Linear(d, d))
        self.head = nn.Linear(d, n_items)
        self.ent = Entropy()

    def forward(self, x, t, tau):
        ang = self.clock(t)
        with torch.autocast("cpu", enabled=False):
            tf = torch.cat([ang.sin(), ang.cos()], -1)
        logits = self.head(self.enc(torch.cat([x, tf], -1)))
        return logits, self.ent(logits, tau)


SHARP_AT = 6


def next_item_batch(i):
    """32 sessions: 8 features, the event time (seconds since the dataset start, 1.0e6..1.1e6), the next item; the
    sampler's temperature drops from 1 to 0.05 at SHARP_AT (a step schedule)."""
    g = gen(300 + i)
    x = torch.randn(32, 8, generator=g)
    t = 1.0e6 + torch.rand(32, generator=g) * 1e5
    y = torch.randint(0, 64, (32,), generator=g)
    return (x, t, 1.0 if i < SHARP_AT else 0.05), {}, y


def next_item_loss(out, y):
    logits, ent = out
    return F.cross_entropy(logits.float(), y) - 0.01 * ent.float()


def test_nan_producer_beside_an_fp32_layer_far_past_65504(tmp_path):
    torch.manual_seed(0)
    m = NextItem()
    clock = []
    m.clock.register_forward_hook(lambda mod, i, o: clock.append((o.dtype, float(o.abs().max()))))
    r = run(m, next_item_batch, next_item_loss, SHARP_AT + 4, tmp_path / "run")
    # truth: `ent` makes NaN at step 6 from finite logits (fp16 softmax at tau 0.05 flushes p to 0, 0 * log 0), and
    # every step after (the temperature stays); `clock` returns float32 up to ~1.2e5 on every call, finite
    assert r["first"] == ("ent", SHARP_AT), r["first"]
    assert r["bad_loss"] == list(range(SHARP_AT, SHARP_AT + 4)), r["bad_loss"]
    assert SHARP_AT in r["skipped"] and all(s < 3 for s in r["skipped"] if s < SHARP_AT), r["skipped"]
    assert clock and all(dt == torch.float32 and 65504 * 1.5 < mx < 2e5 for dt, mx in clock), clock
    # the same logits in float32 give a finite entropy at tau 0.05: an fp16 failure
    torch.manual_seed(0)
    f32 = NextItem()
    (x, t, tau), _, _ = next_item_batch(SHARP_AT)
    assert finite(f32(x, t, tau)), "float32 entropy"
    rep = r["rep"]
    named(rep, ("nan_origin", "overflow", "underflow"), "ent", SHARP_AT, warns=r["warns"])
    bad = [f.one_line() for f in rep.findings if f.module == "clock" and f.severity in ("warning", "error")]
    if bad:
        raise WrongAnswer(f"top3={top3(rep)}; an alarm at the float32 `clock`: {bad}")


# ======================================================================================================================
# 4. two independent real faults in one run: an overflow in `rate` at step 8, then NaN made by `hist_norm` at 14
# ======================================================================================================================
class PoissonRate(nn.Module):
    """The Poisson head: rate = exp(log-rate), in the activations' dtype."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 1)

    def forward(self, h):
        return torch.exp(self.lin(h)).squeeze(-1)


class RowStandardize(nn.Module):
    """Per-row standardisation (h - mean) / (std + eps) with the eps of the fp32 original (1e-8: 0 in fp16)."""

    def __init__(self, eps=1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, h):
        return (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + self.eps)


class DemandModel(nn.Module):
    """A store-demand model: 8 store features and a 16-bin sales-history histogram -> a Poisson rate."""

    def __init__(self, feats=8, bins=16, d=32):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(feats, d), nn.GELU(), nn.Linear(d, d))
        self.hist_proj = nn.Linear(bins, d, bias=False)
        self.hist_norm = RowStandardize()
        self.rate = PoissonRate(d)

    def forward(self, x, hist):
        return self.rate(self.enc(x) + self.hist_norm(self.hist_proj(hist)))


W8C = randn(8, seed=9) * 0.3
UNITS_AT, NEW_STORE_AT = 8, 14


def demand_batch(i):
    """64 stores, Poisson counts of rate exp(x @ W8C + 1); at UNITS_AT one store's features arrive x 100 (a unit
    error); at NEW_STORE_AT a new store with no sales history (an all-zero histogram)."""
    g = gen(400 + i)
    x = torch.randn(64, 8, generator=g)
    hist = torch.floor(torch.rand(64, 16, generator=g) * 12)
    y = torch.poisson((x @ W8C + 1.0).exp(), generator=g)
    if i == UNITS_AT:
        x[3] = x[3] * 100
    if i == NEW_STORE_AT:
        hist[10] = 0.0
    return (x, hist), {}, y


def poisson_nll(rate, y):
    rate = rate.float()
    return (rate - y * torch.log(rate)).mean()


@wrong("the second fault (hist_norm's NaN at step 14) is never located: one capture per kind, and the unsampled "
       "step 14 records no producer; only an eps_underflow warning at step 8")
def test_two_independent_faults_overflow_at_8_then_nan_at_14(tmp_path):
    torch.manual_seed(0)
    r = run_every(DemandModel(), demand_batch, poisson_nll, NEW_STORE_AT + 4, tmp_path / "run", lr=3e-3)
    # truth: two producers, one per bad step: `rate` (exp overflows: +inf) at step 8 and `hist_norm` (0 / 0) at 14;
    # the loss is non-finite on those two steps only; the scaler skips them and, before, only its search (< 3)
    assert r["producers"] == {UNITS_AT: "rate", NEW_STORE_AT: "hist_norm"}, r["producers"]
    assert r["bad_loss"] == [UNITS_AT, NEW_STORE_AT], r["bad_loss"]
    assert [s for s in r["skipped"] if s >= 3] == [UNITS_AT, NEW_STORE_AT], r["skipped"]
    # both are fp16 failures: the same batches in float32 (a fresh model) stay finite
    for step in (UNITS_AT, NEW_STORE_AT):
        torch.manual_seed(0)
        assert finite(DemandModel()(*demand_batch(step)[0])), step
    rep = r["rep"]
    # the first fault among the first three (CONTRACT: most important first, root causes before their
    # consequences; it says nothing of the order of two independent root causes) ...
    named(rep, "overflow", "rate", UNITS_AT, warns=r["warns"])
    # ... and the second, independent one reported too (anywhere), an error at its producer and step
    second = [f for f in rep.findings if f.module == "hist_norm" and f.step == NEW_STORE_AT and f.severity == "error"
              and f.rule in ("nan_origin", "eps_underflow")]
    if not second:
        raise WrongAnswer(f"top3={top3(rep)}; no error at hist_norm step {NEW_STORE_AT}: {lines(rep)}")


# ======================================================================================================================
# 5. a real overflow (a SwiGLU product) in a loop that also clips the gradients before unscale_
# ======================================================================================================================
class SwiGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GLUClassifier(nn.Module):
    def __init__(self, feats=12, d=32, n_cls=3):
        super().__init__()
        self.inp, self.ff, self.head = nn.Linear(feats, d), SwiGLU(d, 2 * d), nn.Linear(d, n_cls)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.ff(h))


GLU_AT = 6


def glu_batch(i):
    """48 rows of 12 standardised features, the class the argmax of the first three; at GLU_AT one row arrives in
    raw units (x 1000, at most ~3000: finite in fp16)."""
    g = gen(500 + i)
    x = torch.randn(48, 12, generator=g)
    y = x[:, :3].argmax(1)
    if i == GLU_AT:
        x[7] *= 1000
    return x, y


def test_swiglu_overflow_in_a_loop_that_clips_before_unscale(tmp_path):
    torch.manual_seed(0)
    m = GLUClassifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    prod = Producer(m, with_kwargs=True)
    r = dict(losses=[], skipped=[], bad_loss=[], clip_norm=[], applied=[], scales=[])

    def body(i):
        prod.step = i
        opt.zero_grad()
        x, y = glu_batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = F.cross_entropy(out.float(), y)
        r["losses"].append(loss.item())
        if not math.isfinite(loss.item()):
            r["bad_loss"].append(i)
        s0 = sc.get_scale()
        r["scales"].append(s0)
        sc.scale(loss).backward()
        r["clip_norm"].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))   # still scaled
        sc.unscale_(opt)
        r["applied"].append(float(torch.stack([p.grad.norm() for p in m.parameters()]).norm()))
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            r["skipped"].append(i)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
        try:
            for i in range(12):
                body(i)
        finally:
            prod.remove()
            w.close()
    rep = w.report()
    # truth 1: the producer is `ff` (silu(gate) * up passes 65504; gate and up finite) at step 6, the only bad loss
    # and the only skip
    assert prod.first == ("ff", GLU_AT), prod.first
    assert r["bad_loss"] == [GLU_AT] and r["skipped"] == [GLU_AT], r
    # truth 2: every clip saw the SCALED gradients (norm = scale x the true norm, far above 1), so the optimizer got
    # gradients of norm <= 1 / scale: 100x (and more) smaller than clipping the true gradients to 1 would give
    ok = [i for i in range(12) if i != GLU_AT]
    for i in ok:
        true = r["clip_norm"][i] / r["scales"][i]
        assert r["clip_norm"][i] > 1.0 and r["applied"][i] <= 1.0001 / r["scales"][i], (i, r)
        assert 100 * r["applied"][i] < min(true, 1.0), (i, true, r["applied"][i])
    # both among the first three: the overflow at its producer and step, and the loop's clip on scaled gradients
    named(rep, "overflow", "ff", GLU_AT, phase="forward")
    named(rep, "clip_before_unscale", None, 0, phase=None)


# ======================================================================================================================
# 6. a real overflow in a shared tower on its SECOND call of the forward (a Siamese pair model)
# ======================================================================================================================
class CrossTower(nn.Module):
    """A feature-crossing tower (factorisation-machine style: a(x) * b(x)), shared by both items of a pair."""

    def __init__(self, feats=12, d=32):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(feats, d), nn.Linear(feats, d), nn.Linear(d, 16)

    def forward(self, x):
        return self.out(self.a(x) * self.b(x))


class PairScorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower, self.head = CrossTower(), nn.Linear(32, 1)

    def forward(self, q, c):
        return self.head(torch.cat([self.tower(q), self.tower(c)], -1)).squeeze(-1)


W12 = randn(12, seed=3)
CAND_AT = 5


def pair_batch(i):
    """32 (query, candidate) pairs of 12 standardised features, the target |(q - c) @ W12|; at CAND_AT one
    candidate's features arrive un-standardised (x 300: finite in fp16)."""
    g = gen(600 + i)
    q, c = torch.randn(32, 12, generator=g), torch.randn(32, 12, generator=g)
    y = ((q - c) @ W12).abs()
    if i == CAND_AT:
        c[4] = c[4] * 300
    return (q, c), {}, y


def test_overflow_in_a_shared_tower_on_its_second_call(tmp_path):
    torch.manual_seed(0)
    r = run(PairScorer(), pair_batch, mse, 10, tmp_path / "run", call_in_first=True)
    # truth: `tower` (its a(x) * b(x); a and b finite) overflows at step 5 on its SECOND call (the candidate), its
    # first call (the query) finite; two calls per step; the loss non-finite only there; the scaler skips it and,
    # before it, only its search (< 3)
    assert r["first"] == ("tower", CAND_AT, 2), r["first"]
    assert all(r["calls"][("tower", s)] == 2 for s in range(10)), r["calls"]
    assert r["bad_loss"] == [CAND_AT], r["bad_loss"]
    assert CAND_AT in r["skipped"] and all(s < 3 for s in r["skipped"] if s != CAND_AT), r["skipped"]
    rep = r["rep"]
    named(rep, "overflow", "tower", CAND_AT, warns=r["warns"])
    try:
        no_error_at(rep, ("tower.out", "head", ""))
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} ({e})") from None


# ======================================================================================================================
# 7. an inf made by one module that the NEXT module turns into NaN: the producer is the first one
# ======================================================================================================================
class SensorNet(nn.Module):
    """Per-timestep input projection -> LayerNorm (BERT's embedding LayerNorm; fp16 on CPU autocast) -> a residual
    MLP -> mean over time -> 3 classes."""

    def __init__(self, ch=6, d=32):
        super().__init__()
        self.inp, self.ln = nn.Linear(ch, d), nn.LayerNorm(d)
        self.mix = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.ln(self.inp(x))
        return self.head((h + self.mix(h)).mean(1))


ADC_AT = 6


def sensor_batch(i):
    """16 windows of 20 steps x 6 standardised channels; at ADC_AT one window arrives in raw ADC counts
    (52000 +- 4000, clamped to 40000..64000: each below 65504)."""
    g = gen(700 + i)
    x = torch.randn(16, 20, 6, generator=g)
    y = x[..., :3].mean(1).argmax(1)
    if i == ADC_AT:
        x[3] = x[3].clamp(-3, 3) * 4000 + 52000
    return (x,), {}, y


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def test_inf_from_inp_that_the_layernorm_turns_into_nan(tmp_path):
    torch.manual_seed(0)
    m = SensorNet()
    at_ln = []
    m.ln.register_forward_hook(lambda mod, i, o: at_ln.append(
        (bool(torch.isinf(i[0]).any()), bool(torch.isnan(i[0]).any()), bool(torch.isnan(o).any()))))
    r = run(m, sensor_batch, ce, 10, tmp_path / "run")
    # truth: `inp`'s matmul overflows at step 6 (inputs < 65504): the first producer; `ln` receives that +-inf (no
    # NaN) and returns NaN (inf - mean); the loss non-finite only there, the only skip
    assert r["first"] == ("inp", ADC_AT), r["first"]
    assert float(sensor_batch(ADC_AT)[0][0].abs().max()) < 65504
    assert at_ln[ADC_AT] == (True, False, True), at_ln[ADC_AT]
    assert not any(map(any, at_ln[:ADC_AT])), at_ln
    assert r["bad_loss"] == [ADC_AT] and r["skipped"] == [ADC_AT], r
    rep = r["rep"]
    f = named(rep, "overflow", "inp", ADC_AT, warns=r["warns"])
    # the NaN maker is a consequence: anything said of `ln` at that step comes after the root cause
    i = rep.findings.index(f)
    above = [k for k, g in enumerate(rep.findings) if g.module == "ln" and g.step == ADC_AT and k < i]
    if above:
        raise WrongAnswer(f"top3={top3(rep)}; `ln` (the NaN maker) ranked above the producer: {lines(rep)}")


# ======================================================================================================================
# 8. the run CRASHES two steps after the loss went NaN at step 7 (a) the logger's finite-loss assert inside
#    `with ampdoctor.watch(...)`; (b) a script without `with` that dies on a shape error at the epoch's short batch
# ======================================================================================================================
class CosineNorm(nn.Module):
    """x / (||x|| + eps) with the fp32 original's eps 1e-8 (0 in fp16), in the activations' dtype."""

    def __init__(self, eps=1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x / (x.norm(dim=-1, keepdim=True) + self.eps)


class CosineClassifier(nn.Module):
    """A bias-free encoder, cosine-normalised embeddings, a prototype head with a fixed scale (NormFace style)."""

    def __init__(self, feats=10, d=32, n_cls=4):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(feats, d, bias=False), nn.Tanh(), nn.Linear(d, d, bias=False))
        self.norm = CosineNorm()
        self.protos = nn.Linear(d, n_cls, bias=False)

    def forward(self, x):
        return 10.0 * self.protos(self.norm(self.enc(x)))


DEAD_AT, LAST_AT, LOG_EVERY, BATCH = 7, 9, 3, 32


def dead_sensor_batch(i):
    """An epoch of 308 rows (10 standardised features, 4 classes) in batches of 32, the last one (LAST_AT) of 20
    (drop_last=False); at DEAD_AT one row is all zeros (a dead sensor)."""
    g = gen(800 + i)
    x = torch.randn(20 if i == LAST_AT else BATCH, 10, generator=g)
    y = x[:, :4].argmax(1)
    if i == DEAD_AT:
        x[11] = 0.0
    return x, y


def smoothed_ce(out, y):
    """Label-smoothed cross-entropy as the script writes it: the one-hot reshaped to the configured batch size."""
    target = F.one_hot(y, 4).view(BATCH, 4) * 0.9 + 0.025
    return -(target * torch.log_softmax(out.float(), -1)).sum(-1).mean()


def crash_truth(r):
    """Truth (both variants): `norm` makes NaN at step 7 (0 / (0 + 1e-8) with 1e-8 == 0 in fp16; its input, the
    dead row's encoding, is exactly 0 and finite), the loss is NaN there only, the scaler skips it (before: only its
    search); the script then dies at step 9. In float32 the same batch stays finite."""
    assert r["first"] == ["norm", DEAD_AT], r["first"]
    assert r["bad_loss"] == [DEAD_AT], r["bad_loss"]
    assert DEAD_AT in r["skipped"] and all(s < 3 for s in r["skipped"] if s != DEAD_AT), r["skipped"]
    assert r["steps_done"] == LAST_AT, r
    torch.manual_seed(0)
    assert finite(CosineClassifier()(dead_sensor_batch(DEAD_AT)[0])), "float32"


def crashed_report_check(rep):
    """Not healthy (exit 1, an alarm), and the NaN's producer among the first three, at its step, an error."""
    if rep.exit_code != 1 or not alarms(rep.findings):
        raise WrongAnswer(f"a crashed NaN run called healthy: exit {rep.exit_code}, {lines(rep)}")
    named(rep, ("nan_origin", "eps_underflow"), "norm", DEAD_AT)


def test_crash_by_the_loggers_assert_inside_with_watch(tmp_path):
    torch.manual_seed(0)
    m = CosineClassifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    prod = Producer(m, with_kwargs=True)
    r = dict(losses=[], skipped=[], bad_loss=[], crash=None, steps_done=0)
    run_dir = tmp_path / "run"
    window = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) as w:
                for i in range(14):
                    prod.step = i
                    opt.zero_grad()
                    x, y = dead_sensor_batch(i)
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = m(x)
                    loss = F.cross_entropy(out.float(), y)
                    r["losses"].append(loss.item())
                    if not math.isfinite(loss.item()):
                        r["bad_loss"].append(i)
                    s0 = sc.get_scale()
                    sc.scale(loss).backward()
                    sc.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                    sc.step(opt)
                    sc.update()
                    if sc.get_scale() < s0:
                        r["skipped"].append(i)
                    window.append(loss.item())
                    if i % LOG_EVERY == 0:                       # the logger: the mean loss since the last line
                        avg = sum(window) / len(window)
                        window.clear()
                        assert math.isfinite(avg), f"step {i}: loss is {avg}"
                    r["steps_done"] = i + 1
        except AssertionError as e:
            r["crash"] = (i, str(e))
        finally:
            prod.remove()
    r["first"] = list(prod.first) if prod.first else None
    r["steps_done"] = r["crash"][0] if r["crash"] else r["steps_done"]
    crash_truth(r)
    assert r["crash"][1].startswith(f"step {LAST_AT}: loss is nan"), r["crash"]
    # the live report and the one read back from the run directory
    for rep in (w.report(), ampdoctor.diagnose(run_dir)):
        crashed_report_check(rep)


CRASH_SCRIPT = """
import json, math, sys
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
import ampdoctor
import test_unseen_variants44 as t
from probe_harness import Producer

run_dir, log_path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = t.CosineClassifier()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
prod = Producer(m, with_kwargs=True)
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir)
r = dict(losses=[], skipped=[], bad_loss=[], first=None, steps_done=0)
for i in range(14):
    prod.step = i
    opt.zero_grad()
    x, y = t.dead_sensor_batch(i)
    with torch.autocast("cpu", dtype=torch.float16):
        out = m(x)
    loss = t.smoothed_ce(out, y)                     # step 9: shape '[32, 4]' is invalid for input of size 80
    r["losses"].append(loss.item())
    if not math.isfinite(loss.item()):
        r["bad_loss"].append(i)
    s0 = sc.get_scale()
    sc.scale(loss).backward()
    sc.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    sc.step(opt)
    sc.update()
    if sc.get_scale() < s0:
        r["skipped"].append(i)
    r["first"], r["steps_done"] = prod.first, i + 1
    with open(log_path, "w") as f:
        json.dump(r, f)
w.close()
"""


def test_crash_of_a_script_without_with_on_a_shape_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CRASH_SCRIPT)
    run_dir, log = tmp_path / "run", tmp_path / "oracle.json"
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), str(run_dir), str(log)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    # the script died at step 9 on the shape error (a traceback, exit 1), after writing the oracle of steps 0-8
    assert p.returncode == 1 and "shape '[32, 4]' is invalid for input of size 80" in p.stderr, p.stderr[-3000:]
    r = json.loads(log.read_text())
    crash_truth(r)
    # what the user gets afterwards: the report from the run directory
    crashed_report_check(ampdoctor.diagnose(run_dir))


# ======================================================================================================================
# 9. a fault in a 5-parameter layer upstream of a 297k-parameter trunk that spreads it to every element
# ======================================================================================================================
class FiLMScale(nn.Module):
    """FiLM-style conditioning: a per-row input scale exp(w . z + b) from 4 context features (5 parameters)."""

    def __init__(self, cond=4):
        super().__init__()
        self.lin = nn.Linear(cond, 1)

    def forward(self, z):
        return torch.exp(self.lin(z))


class ConditionedRegressor(nn.Module):
    def __init__(self, feats=64, d=512):
        super().__init__()
        self.film = FiLMScale()
        self.trunk = nn.Sequential(nn.Linear(feats, d), nn.BatchNorm1d(d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(),
                                   nn.Linear(d, 1))

    def forward(self, x, z):
        return self.trunk(x * self.film(z)).squeeze(-1)


W64 = randn(64, seed=1) * 0.1
CTX_AT = 8


def film_batch(i):
    """32 rows of 64 standardised features and 4 context features; at CTX_AT one row's context arrives in raw units
    (x 40)."""
    g = gen(900 + i)
    x, z = torch.randn(32, 64, generator=g), torch.randn(32, 4, generator=g)
    y = x @ W64
    if i == CTX_AT:
        z[5] = z[5] * 40
    return (x, z), {}, y


def test_overflow_in_a_tiny_film_layer_spread_by_a_big_trunk(tmp_path):
    torch.manual_seed(0)
    m = ConditionedRegressor()
    bad = {}
    for n, mod in m.named_modules():
        mod.register_forward_hook(lambda mod, i, o, n=n: bad.setdefault(n, []).append(int((~torch.isfinite(o)).sum())))
    r = run(m, film_batch, mse, 12, tmp_path / "run")
    # truth: `film` (5 parameters) overflows at step 8 in ONE element (exp of ~40); the trunk spreads it: `trunk.0`
    # one row (512 elements) non-finite, the BatchNorm `trunk.1` all 16384; the loss non-finite only there, the only
    # skip beyond the scaler's search (< 3)
    assert r["first"] == ("film", CTX_AT), r["first"]
    assert sum(p.numel() for p in m.film.parameters()) == 5 and sum(p.numel() for p in m.trunk.parameters()) > 2.9e5
    assert bad["film"][CTX_AT] == 1 and bad["trunk.0"][CTX_AT] == 512 and bad["trunk.1"][CTX_AT] == 32 * 512, bad
    assert r["bad_loss"] == [CTX_AT], r["bad_loss"]
    assert CTX_AT in r["skipped"] and all(s < 3 for s in r["skipped"] if s != CTX_AT), r["skipped"]
    rep = r["rep"]
    named(rep, "overflow", "film", CTX_AT, warns=r["warns"])
    try:
        no_error_at(rep, ("trunk", "trunk.0", "trunk.1", "trunk.3", "trunk.5", ""))
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} ({e})") from None


# ======================================================================================================================
# 10. a fully masked row from step 5 on: NaN every step, the scale collapses; the producer must outrank the
#     consequences (skipped_steps, loss_scale_collapse)
# ======================================================================================================================
class AttnPool(nn.Module):
    """Learned-query attention pooling over tokens with a key-padding mask filled with -inf."""

    def __init__(self, d):
        super().__init__()
        self.q = nn.Parameter(torch.randn(d) * 0.1)
        self.k, self.v = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h, keep):
        s = (self.k(h) @ self.q.to(h.dtype)) / math.sqrt(h.shape[-1])
        a = s.masked_fill(~keep, float("-inf")).softmax(-1)
        return (a[..., None] * self.v(h)).sum(1)


class DocClassifier(nn.Module):
    def __init__(self, vocab=100, d=32, n_cls=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ff = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.pool = AttnPool(d)
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids, keep):
        return self.head(self.pool(self.ff(self.emb(ids)), keep))


SHARD_AT = 5


def doc_batch(i):
    """16 documents of up to 24 tokens (right padded); the label is the majority of id % 4. From SHARD_AT the loader
    reads a new shard that has one empty document (length 0) in every batch."""
    g = gen(1000 + i)
    ids = torch.randint(1, 100, (16, 24), generator=g)
    lens = torch.randint(4, 25, (16,), generator=g)
    if i >= SHARD_AT:
        lens[6] = 0
    keep = torch.arange(24)[None] < lens[:, None]
    ids = ids.masked_fill(~keep, 0)
    y = (ids % 4).masked_fill(~keep, 4).mode(1).values.clamp_max(3)
    return (ids, keep), {}, y


def test_fully_masked_row_every_step_the_producer_outranks_the_collapse(tmp_path):
    torch.manual_seed(0)
    steps = SHARD_AT + 20
    r = run(DocClassifier(), doc_batch, ce, steps, tmp_path / "run")
    # truth: `pool` returns NaN from finite inputs at step 5 (a row with every key masked: softmax over -inf only)
    # and on every step after; every loss from 5 is NaN and every step from 5 skipped (20 in a row: the scale is
    # at most 65536 / 2^20)
    assert r["first"] == ("pool", SHARD_AT), r["first"]
    assert r["bad_loss"] == list(range(SHARD_AT, steps)), r["bad_loss"]
    assert [s for s in r["skipped"] if s >= 3] == list(range(SHARD_AT, steps)), r["skipped"]
    rep = r["rep"]
    named(rep, "nan_origin", "pool", SHARD_AT, warns=r["warns"])
