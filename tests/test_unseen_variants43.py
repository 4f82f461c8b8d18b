"""Forty-third set: LATE ONSETS. Ten fp16 failures that start LATE in the run, long after ampdoctor's default watch
has settled into its routine: full statistics only on step 0 and every 200th step, the headroom series
(headroom="auto") only on the routine steps its budget allows. Onsets at steps 37, 64, 120 (in one micro-batch of
four), 199 (the step before a sampled one), 200 (a sampled step itself), 201 (the step after it) and 233, and three
slow creeps (growing raw inputs, an annealed Gumbel-softmax temperature, an EMA teacher whose weights keep growing)
whose overflow comes at steps 70-140. Watched through the public API only (`ampdoctor.watch(model, optimizer=...,
scaler=..., run_dir=tmp_path / "run")` at the default settings, nothing else -> an ordinary CPU fp16 autocast +
`torch.amp.GradScaler("cpu")` loop: scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update ->
close -> `w.report()`), ampdoctor's RuntimeWarnings recorded. Tiny models, fixed seeds, one intra-op thread.

Each failure is proven first by the test's own oracle: probe_harness.Producer with keyword inputs (the first module
whose output is non-finite while its inputs and own parameters were finite, at the expected step; in 3 the call too,
i.e. the micro-batch; in 2 and 4 its backward hooks: the first module whose input gradient is non-finite while its
output gradient was finite, in 2 read anew on every step), the loss (first non-finite there; for 2, 4 and 7 every loss
finite), the scaler (skips the step; every skip before it had a finite loss, six at most: GradScaler's ordinary search
or a rare gradient spike, never a forward failure nor a collapsing scale) and, where the cause
is fp16's range, a float32 check (the same weights the failing step ran with, the same batch, in float32 without
autocast: finite; for 4 the gradients too). The creeps also prove the creep (8: the producer's output grows steadily
for 60 steps before it overflows; 9: 1/tau grows 7.3% a step and the largest |logit + gumbel| / tau passes 65504 at
the onset; 10: the teacher's weight norms grow every step). 2 replays its two skips from the weights they ran with
(step 40: non-finite at scale 65536, finite unscaled; step 64: NaN unscaled in fp16, finite in float32). 6 proves the
batch's model inputs finite and the target NaN; 7 measures every layer's weight-norm factor ||w after|| / ||w before||
around every update (the truth is the layer with the clearly largest factor, twice any other, at the step of the lr
jump; every earlier update below x1.05).
Only then must the rule be among the report's first three findings at the PRODUCER (not a module that only passed the
inf on), at its step, with the contract's severity (overflow / nan_origin: error, in the oracle's phase, and no error
dated at that step at the modules that only passed it on; 6: nan_origin with `module: null`, forward, error;
update_spike: warning, or error; the run stays finite). In a creep the contract's early warning `headroom_trend` may
come first (dated before the overflow, the rate and the forecast step in its evidence): the overflow itself must still
be among the first three. A wrong report raises WrongAnswer naming ampdoctor's top three (a failing oracle or a crash
fails otherwise).

 1. a Poisson demand model (MLP body, head `rate = exp(lin(h))` in the activations' dtype, as a GLM writes it): at
    step 37 a newly onboarded store sends its promotion discount in raw percent (50) where the feature is a z-score
    -> lin's output is 29.2 (exp 4.9e12: finite in float32) -> fp16's exp overflows -> overflow at `head`, step 37.
 2. a conv net on 4-band satellite tiles with LLaMA's RMSNorm (x * rsqrt(mean(x^2) + 1e-6) * w) over the channels
    of its bias-free convs, ported without the float() upcast, and an auxiliary cloud-cover head whose MSE is on raw
    percent (weight 0.01): at step 40 a batch of cloud-covered tiles (90-100%) -> the scaled MSE gradient overflows
    fp16 in `cloud`'s backward at 65536 -> GradScaler skips once and halves (its job: the step is finite unscaled);
    at step 64 a nodata tile outside the swath (all zeros) -> rsqrt's backward -0.5 g r^3 with r = 1000 is inf,
    times 0 = NaN, at any loss scale (finite in float32) -> overflow / nan_origin at `n2`, step 64, backward (the
    oracle reads the backward producer of every step: `cloud` at 40, `n2` at 64).
 3. an MLP-mixer under gradient accumulation (4 micro-batches per optimizer step, loss / 4): at step 120 the third
    micro-batch holds an HDR frame whose specular highlight is clipped at half-float EXR's max, 65504 (the patch
    embedding's input is finite in fp16; its output is not) -> overflow at `embed`, step 120 (its 3rd call).
 4. a keyword-spotting 1-D conv net (convs without bias) with a hand-written channel RMSNorm
    x * rsqrt(mean(x^2) + 1e-6) in fp16: at step 199 a digitally silent clip (all zeros) -> the forward is finite
    (0 * 1000), rsqrt's backward -0.5 g r^3 = 1e9 is inf in fp16 -> the BACKWARD only, first at `norm2` (backward runs
    from the end) -> overflow / nan_origin at `norm2`, step 199, backward.
 5. an FT-Transformer on tabular data (numeric feature tokens x_j * W_j + b_j; its first block has no LayerNorm, as
    the paper's): at step 200 a shard arrives without the quantile transform for one column (income in cents) -> the
    first block's qkv Linear gets tokens past 65504 (autocast's cast to fp16 overflows) -> overflow at
    `blocks.0.qkv`, step 200.
 6. a GRU forecaster (the gates written with Linear layers): at step 201 one target reading is missing, read from the
    CSV as NaN; the model's inputs and outputs stay finite, the MSE is NaN -> nan_origin with `module: null` (the loss
    computation, outside the model), step 201, forward.
 7. a tiny GPT (GPT-2's N(0, 0.02) embedding init) on AdamW with a ResNet recipe's schedule: lr 0.4 (0.1 x 1024/256,
    Goyal's linear scaling) with a one-epoch constant warmup at 1% (ConstantLR(factor=0.01, total_iters=1) stepped
    per epoch; an epoch is 233 steps): AdamW trains at 4e-3, then at the epoch boundary the lr jumps x100 ->
    update_spike at `pos` (x2.95; the next layer x1.42), step 233.
 8. online forecasting of raw case counts (log target; the 14-day input window left in raw counts) through a frozen
    pretrained input projection, a LayerNorm and a trainable head: 16 regions growing 3-5% a day, one optimizer step
    a day: `inp`'s output grows ~4% a step until its matmul passes 65504 (inputs up to 63330, finite in fp16) ->
    overflow at `inp`, step 140 (headroom_trend at `inp` may come first); a second test reads that early warning
    against the README's rule table (dated before the overflow, an error once the forecast came true, ranked after
    the overflow).
 9. a categorical VAE with F.gumbel_softmax (the noise and the division in the logits' dtype) and Jang et al.'s
    annealing tau = exp(-r t) at r = 0.07 a step without its max(0.5, .) floor: 1/tau grows 7.3% a step ->
    (logits + g) / tau passes 65504 -> overflow at `quant`, step 125.
10. a mean teacher (semi-supervised consistency to an EMA of the student) whose EMA is written
    `t.mul_(m).add_(s)` without the (1 - m): the teacher's weights grow every step towards 1 / (1 - m) = 33x the
    student's -> its last Linear passes 65504 -> overflow at `teacher.4`, step 70.
Twins (the fix applied, run just as long or longer; healthy: every loss finite, the loss down, no producer, no skip
after the first steps' search; ampdoctor quiet: no warning, no error, no RuntimeWarning): 4 with the RMSNorm computed
in float32 (the silent clip still at step 199, 205 steps, past the sampled step 200); 9 with the max(0.5, .) floor
(160 steps); 10 with the EMA written right (120 steps). The twin of 4 still has the silent clip at step 199: with the
norm in float32 its backward is finite, but the clip's gradient is multiplied by rsqrt(1e-6) = 1000 and the fp16
gradient into conv2's input passes 65504 at the scale of the time: GradScaler skips 199 once and halves the scale, its
job (the oracle: the only skip, no producer but that scaled backward at 199).

Not built: the conv net of 2 fed a tile in its uint16 scale (a forward overflow at `c3`, step 64, after a natural
gradient-spike skip at 44: named right; a forward failure has a capture kind of its own, so it probes less than 2);
raw counts through a TRAINABLE input layer (its weight gradients, g x counts, drove GradScaler's scale below 1 from
step 116 before the forward overflowed at 141: two failures, no single truth; hence 8's frozen projection); CLIP's
learned logit scale exp(t) * cos without its clamp (in a tiny dual encoder Adam's steps on t shrink as the loss goes
to 0: t plateaus near 3.6, no creep to 11.09 within 260 steps); a sensor glitch in the GRU's input (x2h overflows but
sigmoid/tanh absorb the inf: the loss stays finite, a hidden overflow whose severity the contract leaves open); a
masked mean pooling written as a sum at a 64 -> 2048-token curriculum step (no overflow at tiny widths, 4x the time
budget); an Adam lr jump x10-x100 at ordinary learning rates (Adam moves each weight ~lr per update: no layer of rms
0.02 or more changes x2 below an lr of ~0.1, hence 7's SGD-recipe lr).

What ampdoctor says (on 1802c27): nine of ten right, one wrong (a strict xfail, fixed since); the three twins quiet; no
RuntimeWarning. The same at every forced headroom stride (tests/stride_sweep.py, AMPDOCTOR_FORCE_STRIDE=1..32).
- right: 1 `[error] overflow at head aten::exp step 37`; 3 `[error] overflow at embed aten::addmm step 120` (the
  micro-batch that went bad was captured); 4 `[error] overflow at norm2 aten::pow step 199` (backward,
  RsqrtBackward0); 5 `[error] overflow at blocks.0.qkv aten::_to_copy step 200`; 6 `[error] nan_origin at (run) step
  201` ("The loss became NaN outside the watched model ... the target or a loss weight"); 7 `[warning] update_spike at
  pos step 233` (x2.9); 8 `[error] overflow at inp aten::addmm step 140`, then `[error] headroom_trend at inp step
  41-42` ("forecast to overflow around step 139-140. It did"); 9 `[error] overflow at quant aten::div step 125`
  (headroom_trend cannot see it: quant's output is the softmax); 10 `[error] overflow at teacher.4 aten::addmm step
  70`. The twins: 4's only finding `[info] skipped_steps at (run) step 199` ("a normal rate"); 9 and 10 empty.
- wrong when written (a strict xfail, fixed since): 2. The report's only finding was `[info] skipped_steps at
  (run) step 40: GradScaler skipped 2 of 67 steps; a normal rate for dynamic loss scaling.`: the nodata tile's NaN
  backward at step 64 (n2, at any loss scale) was not reported at all. record/autocapture.py CapturePolicy keeps one capture per kind of bad step: the benign skip at
  step 40 (a skip after the first applied update) took the `backward` kind, so step 64, the same kind, writes no
  capture; it was not sampled, its follow-up steps are clean, and the report's replay of an unexplained skip (a skip
  at a scale already stepped with, README) has no capture of 64 to run. 4, the same bug as the first skip after
  the search, is named right. Now a `backward` skip that comes again after 5 clean steps at a scale an update
  already used is captured too, and a report with nothing wrong replays such captures in turn until one finds an
  error (analysis/replaychoice.choose_replay): `[error] overflow at n2 aten::pow step 64` (backward), the same from
  `diagnose(run_dir)`.
Noticed (timing-dependent, not asserted): in 10, at headroom="auto" about one run in two also lists `[warning]
headroom_trend at teacher.2 step 71-73` ("forecast to overflow around step 102-123; `teacher.4`, which takes its
values, is the first to reach the max") and once `[warning] headroom_trend at teacher.4 step 71` ("0.1 bits left ...
forecast around step 72"): early warnings dated after the overflow they forecast (teacher.4 overflowed at 70), and
still warnings, not the error the README's rule table gives once the forecast came true. rules/headroom.py
_came_true returns None when the run's first bad step is at or before the warning's step, and nothing drops a first
warning reached after it; series() ends a module's series only at a non-finite value in the series itself, so when
the overflow step was not a series step (off the auto stride) teacher.4's series runs on past step 70. At forced
strides 1-32 the warning either comes before the overflow as an error ("It did") or not at all. Since mended: a
headroom_trend warning first reached after the warned layers had already produced the inf/NaN in that phase is
dropped (rules/headroom.py _failed_by; tests/test_headroom_trend.py builds it deterministically). 10 also lists
`[warning] overflow_risk at teacher step 71` (the teacher's output at 6.1e4 on the step after its overflow).

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants43.py -q -p no:cacheprovider
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer, at_top3, finite, probe_run, quiet_twin
from scenarios import gen, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FWD = ("overflow", "nan_origin")
SAMPLED = 200          # ampdoctor's default `every`: full statistics on step 0 and every 200th


# ======================================================================================================================
# the loop, the oracles and the checks
# ======================================================================================================================
def run(m, batch, loss_fn, steps, run_dir, *, lr=1e-3, backward=False, snap_at=None, **kw):
    """probe_harness.probe_run (the user's loop at the default settings) with a Producer on keyword inputs as the
    oracle (`backward`: its backward hooks too); `batch(i)` gives (args, kwargs, y)."""
    return probe_run(m, batch, loss_fn, steps, run_dir, lr=lr, snap_at=snap_at,
                     oracle=lambda m: Producer(m, backward=backward, with_kwargs=True), **kw)


def search_only_before(r, step, most=6):
    """Every skip before `step` had a finite loss, and there were `most` of them at most: GradScaler's ordinary search
    for a scale (and a rare gradient spike), never a forward failure nor a scale collapsing over the run."""
    early = [s for s in r["skipped"] if s < step]
    assert all(math.isfinite(r["losses"][s]) for s in early) and len(early) <= most, r["skipped"]


def real_late(r, name, step, call=None):
    """The forward failure is real and late: the oracle's first producer `name` at `step` (and `call`), the loss first
    non-finite there, the scaler skips it, every earlier skip GradScaler's ordinary search."""
    assert r["first"] == ((name, step) if call is None else (name, step, call)), r["first"]
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["bad_loss"]
    assert step in r["skipped"], r["skipped"]
    search_only_before(r, step)


def real_late_bwd(r, name, step):
    """The backward failure is real and late: every forward and loss finite, the oracle's first backward producer
    `name` at `step`, the scaler skips it, every earlier skip GradScaler's ordinary search."""
    assert r["first"] is None and r["bad_loss"] == [], (r["first"], r["bad_loss"])
    assert r["first_bwd"] == (name, step), r["first_bwd"]
    assert step in r["skipped"], r["skipped"]
    search_only_before(r, step)


def fp32_finite(make, sd, batch, step, loss_fn=None):
    """The bad batch is an fp16 failure: a model with the weights the failing step ran with (`sd`, probe_run's snap_at)
    runs it in float32 throughout (no autocast) to a finite output (with `loss_fn`: a finite loss and finite
    gradients too)."""
    torch.manual_seed(0)
    m = make()
    m.load_state_dict(sd)
    args, kwargs, y = batch(step)
    out = m(*args, **kwargs)
    assert finite(out), step
    if loss_fn is not None:
        loss = loss_fn(out, y)
        loss.backward()
        assert math.isfinite(loss.item()) and all(finite(p.grad) for p in m.parameters() if p.grad is not None)


def top3(rep):
    return [f"{f.rule} @ {f.module!r} step {f.step} [{f.severity}] ({f.phase})" for f in rep.findings[:3]]


def named(r, rule, module, step, phase="forward", quiet_at=(), severity="error"):
    """The report check: `rule` (or one of the rules) at the producer, at its step, in `phase`, with `severity`, among
    the first three findings; no error dated at that step at the modules that only passed it on. A failure is a
    WrongAnswer naming ampdoctor's top three and the RuntimeWarnings it gave."""
    rep = r["rep"]
    try:
        at_top3(rep, rule, module, step=step, phase=phase, severity=severity)
        passed_on = [f.one_line() for f in rep.findings if f.module in quiet_at and f.step == step
                     and f.severity == "error"]
        assert not passed_on, passed_on
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:600]})") from None
    assert not [s for s in r["warns"] if "could not write a capture" in s or "replay" in s], r["warns"]


def creep_named(r, module, step, quiet_at=()):
    """A creep's report check: the overflow at the producer, at its step, forward, error, among the first three (the
    contract's early warning `headroom_trend` may come before it in the list)."""
    named(r, FWD, module, step, quiet_at=quiet_at)


def early_warning_coherent(r, module, step):
    """A creep's early warning, where the report gives one about the producer's chain (`module` named as the layer or
    as evidence.first_to_overflow), must read as the README's rule table documents it: dated before the overflow it
    forecasts (a warning is given "while there is time to act"), with its rate and forecast step in the evidence, an
    `error` once the forecast came true ("`warning`; `error` once the forecast came true, with the step and module of
    the overflow") and ranked after the overflow itself. A report without one is fine: the warning is optional."""
    rep = r["rep"]
    ov = next((i for i, f in enumerate(rep.findings) if f.rule in FWD and f.module == module and f.step == step), None)
    if ov is None:
        raise WrongAnswer(f"top3={top3(rep)} (no overflow at {module!r} step {step} to rank the early warning after)")
    for i, f in enumerate(rep.findings):
        ev = f.evidence or {}
        if f.rule != "headroom_trend" or module not in (f.module, ev.get("first_to_overflow")):
            continue
        bad = []
        if f.step is None or f.step >= step:
            bad.append(f"dated at step {f.step}, not before the overflow at step {step}")
        if "forecast_step" not in ev or "rate_bits_per_step" not in ev:
            bad.append("no rate / forecast step in its evidence")
        if f.severity != "error":
            bad.append(f"still a {f.severity} after the forecast came true at step {step}")
        if i < ov:
            bad.append("ranked before the overflow")
        if bad:
            raise WrongAnswer(f"top3={top3(rep)} headroom_trend: {f.one_line()} -> {'; '.join(bad)}")


def quiet(r, fall=0.9):
    """A twin: healthy (the loss down by 10% at least) and ampdoctor quiet (probe_harness.quiet_twin)."""
    quiet_twin(r, fall=fall)
    assert r["first_bwd"] is None, r["first_bwd"]


def mse(out, y):
    return F.mse_loss(out.float(), y)


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def recorder(mod, store):
    """A forward hook keeping the abs-max of `mod`'s output per call (removed by the caller)."""
    return mod.register_forward_hook(lambda m_, i_, o: store.append(float(o.detach().abs().max())))


# ======================================================================================================================
# 1. a Poisson demand model: exp(lin(h)) in fp16; a new store's floor area in raw m^2 at step 37
# ======================================================================================================================
class PoissonHead(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 1)

    def forward(self, h):
        return torch.exp(self.lin(h)).squeeze(-1)           # the rate, in the activations' dtype


class DemandNet(nn.Module):
    def __init__(self, feats=10, d=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(feats, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.head = PoissonHead(d)

    def forward(self, x):
        return self.head(self.body(x))


W10 = randn(10, seed=3) * 0.3
STORE_AT = 37


def demand_batch(i):
    """64 store-days of 10 standardised features and their unit sales; at STORE_AT a newly onboarded store sends its
    promotion discount (feature 0) in raw percent, 50, where the feature is a z-score."""
    g = gen(200 + i)
    x = torch.randn(64, 10, generator=g)
    y = torch.poisson((x @ W10 + 1.5).exp().clamp(max=1e3), generator=g)
    if i == STORE_AT:
        x[5, 0] = 50.0
    return (x,), {}, y


def poisson_nll(out, y):
    return F.poisson_nll_loss(out.float(), y, log_input=False)


def test_poisson_head_exp_overflows_on_a_raw_percent_feature_at_step_37(tmp_path):
    torch.manual_seed(0)
    r = run(DemandNet(), demand_batch, poisson_nll, STORE_AT + 4, tmp_path / "run", lr=3e-3, snap_at=STORE_AT)
    real_late(r, "head", STORE_AT)
    fp32_finite(DemandNet, r["sd"], demand_batch, STORE_AT)
    named(r, FWD, "head", STORE_AT, quiet_at=("head.lin", "body", ""))


# ======================================================================================================================
# 2. a conv net with a hand-written RMSNorm2d: a benign skip at step 40 (cloud cover in raw percent), then a nodata
#    tile at step 64 whose backward is NaN at any loss scale
# ======================================================================================================================
class RMSNorm2d(nn.Module):
    """LLaMA's RMSNorm over the channels of a feature map, x * rsqrt(mean(x^2) + 1e-6) * w, ported without its
    float() upcast: in the input's dtype."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps) * self.weight[:, None, None].to(x.dtype)


class SatNet(nn.Module):
    """Land-cover classes and an auxiliary cloud-cover regression (in percent) from 4-band tiles."""

    def __init__(self, bands=4, n_cls=4):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(bands, 16, 3, padding=1, bias=False), RMSNorm2d(16)
        self.c2, self.n2 = nn.Conv2d(16, 32, 3, padding=1, stride=2, bias=False), RMSNorm2d(32)
        self.c3 = nn.Conv2d(32, 32, 3, padding=1, stride=2)
        self.head, self.cloud = nn.Linear(32, n_cls), nn.Linear(32, 1)

    def forward(self, x):
        h = F.gelu(self.n1(self.c1(x)))
        h = F.gelu(self.n2(self.c2(h)))
        h = F.relu(self.c3(h)).mean((2, 3))
        return self.head(h), self.cloud(h).squeeze(-1)


SPECTRA = randn(4, 4, 1, 1, seed=7)
CLOUDY_AT, NODATA_AT = 40, 64


def tile_batch(i):
    """16 tiles of 4 bands x 12 x 12 (reflectance 0..1 by land-cover class) with their cloud cover in percent (0-10%);
    at CLOUDY_AT a batch of cloud-covered tiles (90-100%, brighter); at NODATA_AT one tile lies outside the swath:
    nodata, all zeros."""
    g = gen(300 + i)
    y = torch.randint(0, 4, (16,), generator=g)
    x = 0.3 + 0.1 * SPECTRA[y] + 0.05 * torch.randn(16, 4, 12, 12, generator=g)
    cover = torch.rand(16, generator=g) * 10
    if i == CLOUDY_AT:
        cover = 90 + 10 * torch.rand(16, generator=g)
        x = x + 0.5 * cover[:, None, None, None] / 100
    if i == NODATA_AT:
        x[2] = 0.0
    return (x,), {}, (y, cover)


def sat_loss(out, t):
    return F.cross_entropy(out[0].float(), t[0]) + 0.01 * F.mse_loss(out[1].float(), t[1])


def stepwise_run(m, batch, loss_fn, steps, run_dir, *, lr=1e-3, snaps=()):
    """probe_run with a backward Producer read and reset after every step (r["bwd"]: step -> the first backward
    producer of that step), and the state dicts the forwards of `snaps` ran with (r["sds"])."""
    holder, bwd, sds = {}, {}, {}

    def oracle(m):
        holder["o"] = Producer(m, backward=True, with_kwargs=True)
        return holder["o"]

    def before(i, m):
        if i in snaps:
            sds[i] = {k: v.detach().clone() for k, v in m.state_dict().items()}

    def after(i, m):
        o = holder["o"]
        if o.first_bwd is not None:
            bwd[i], o.first_bwd = o.first_bwd[0], None
    r = probe_run(m, batch, loss_fn, steps, run_dir, lr=lr, oracle=oracle, before=before, after=after)
    r["bwd"], r["sds"] = bwd, sds
    return r


def grads_finite(make, sd, batch, step, loss_fn, *, scale=1.0, fp16=True):
    """A model with the weights `sd` runs step `step`'s batch (fp16 autocast, or float32 throughout) and backward of
    the loss x `scale`: whether the loss and every gradient are finite."""
    torch.manual_seed(0)
    m = make()
    m.load_state_dict(sd)
    args, kwargs, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = m(*args, **kwargs)
    loss = loss_fn(out, y)
    (loss * scale).backward()
    return math.isfinite(loss.item()) and all(finite(p.grad) for p in m.parameters() if p.grad is not None)


def test_conv_rmsnorm_nodata_tile_backward_nan_after_a_benign_skip_at_step_64(tmp_path):
    torch.manual_seed(0)
    r = stepwise_run(SatNet(), tile_batch, sat_loss, NODATA_AT + 3, tmp_path / "run", lr=3e-3,
                     snaps=(CLOUDY_AT, NODATA_AT))
    # the oracle: every forward and loss finite; two skips, 40 and 64, each from its own backward producer
    assert r["first"] is None and r["bad_loss"] == [], (r["first"], r["bad_loss"])
    assert r["skipped"] == [CLOUDY_AT, NODATA_AT], r["skipped"]
    assert r["bwd"] == {CLOUDY_AT: "cloud", NODATA_AT: "n2"}, r["bwd"]
    # 40 is GradScaler's job: the cloud-cover MSE's gradient overflows fp16 at the scale of the time, not unscaled
    sd40, sd64 = r["sds"][CLOUDY_AT], r["sds"][NODATA_AT]
    assert not grads_finite(SatNet, sd40, tile_batch, CLOUDY_AT, sat_loss, scale=65536.0)
    assert grads_finite(SatNet, sd40, tile_batch, CLOUDY_AT, sat_loss, scale=1.0)
    # 64 is the bug: NaN gradients at any scale in fp16 (scale 1 here), finite in float32
    assert not grads_finite(SatNet, sd64, tile_batch, NODATA_AT, sat_loss, scale=1.0)
    assert grads_finite(SatNet, sd64, tile_batch, NODATA_AT, sat_loss, fp16=False)
    named(r, FWD, "n2", NODATA_AT, phase="backward", quiet_at=("c2", "c1", "n1", "c3", "head", "cloud", ""))


# ======================================================================================================================
# 3. an MLP-mixer under 4-micro-batch gradient accumulation; an HDR frame in micro-batch 3 of step 120
# ======================================================================================================================
class MixerBlock(nn.Module):
    def __init__(self, n_tok, d, e=2):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.tok = nn.Sequential(nn.Linear(n_tok, n_tok * e), nn.GELU(), nn.Linear(n_tok * e, n_tok))
        self.ch = nn.Sequential(nn.Linear(d, d * e), nn.GELU(), nn.Linear(d * e, d))

    def forward(self, x):
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


class Mixer(nn.Module):
    def __init__(self, patch=4, img=16, ch=3, d=32, depth=2, n_cls=5):
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(ch * patch * patch, d)
        self.blocks = nn.ModuleList(MixerBlock((img // patch) ** 2, d) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, n_cls)

    def forward(self, x):
        b, c, _, _ = x.shape
        p = self.patch
        x = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h).mean(1))


IMGS = randn(5, 3, 16, 16, seed=9)
HDR_AT, HDR_MICRO, ACCUM = 120, 2, 4


def micro_batch(i, k):
    """Micro-batch k of optimizer step i: 8 images of 5 classes; (HDR_AT, HDR_MICRO) holds an HDR frame whose
    specular highlight is clipped at half-float EXR's max (65504, finite in fp16)."""
    g = gen(4000 + ACCUM * i + k)
    y = torch.randint(0, 5, (8,), generator=g)
    x = 0.5 + 0.2 * IMGS[y] + 0.1 * torch.randn(8, 3, 16, 16, generator=g)
    if (i, k) == (HDR_AT, HDR_MICRO):
        x[1, :, 4:8, 4:8] = 65504.0
    return x, y


def accum_run(m, steps, run_dir, lr=2e-3):
    """The user's accumulation loop under watch(m, optimizer=AdamW, scaler=GradScaler("cpu"), run_dir=...) at the
    default settings: ACCUM x (fp16 autocast forward -> scale(loss / ACCUM).backward) -> unscale_ -> clip -> step ->
    update. The oracle (Producer, calls counted) names the micro-batch as the call."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu")
    orc = Producer(m, call_in_first=True)
    r = dict(skipped=[], bad_loss=[], losses=[], bad_micro=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir)
        for i in range(steps):
            orc.step = i
            if i == HDR_AT:
                r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
            opt.zero_grad()
            total = 0.0
            for k in range(ACCUM):
                x, y = micro_batch(i, k)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = m(x)
                loss = F.cross_entropy(out.float(), y) / ACCUM
                if not math.isfinite(loss.item()):
                    r["bad_micro"].append((i, k))
                total += loss.item()
                sc.scale(loss).backward()
            r["losses"].append(total)
            if not math.isfinite(total):
                r["bad_loss"].append(i)
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s0 = sc.get_scale()
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                r["skipped"].append(i)
        orc.remove()
        w.close()
        r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["first"], r["first_bwd"] = orc.first, orc.first_bwd
    return r


def test_mixer_accumulation_one_micro_batch_overflows_at_step_120(tmp_path):
    torch.manual_seed(0)
    r = accum_run(Mixer(), HDR_AT + 4, tmp_path / "run")
    real_late(r, "embed", HDR_AT, call=HDR_MICRO + 1)          # the third call of step 120: micro-batch 2
    assert r["bad_micro"] == [(HDR_AT, HDR_MICRO)], r["bad_micro"]
    assert r["skipped"] == [HDR_AT], r["skipped"]
    fp32_finite(Mixer, r["sd"], lambda i: ((micro_batch(i, HDR_MICRO)[0],), {}, None), HDR_AT)
    named(r, FWD, "embed", HDR_AT, quiet_at=("blocks.0.n1", "blocks.0", "blocks.1", "head", ""))


# ======================================================================================================================
# 4 + twin. keyword spotting: a hand-written channel RMSNorm in fp16; a silent clip at step 199 (backward only)
# ======================================================================================================================
class ChannelRMSNorm(nn.Module):
    """x * rsqrt(mean over channels of x^2 + 1e-6) * w, in the input's dtype (`fp32`: computed in float32)."""

    def __init__(self, d, eps=1e-6, fp32=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.fp32 = eps, fp32

    def forward(self, x):                                       # x: (batch, channels, time)
        if self.fp32:
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + self.eps)
            return y.to(x.dtype) * self.weight[:, None].to(x.dtype)
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps) * self.weight[:, None].to(x.dtype)


class KWSNet(nn.Module):
    def __init__(self, n_mels=20, d=32, n_cls=6, fp32=False):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, d, 5, padding=2, bias=False)
        self.norm1 = ChannelRMSNorm(d, fp32=fp32)
        self.conv2 = nn.Conv1d(d, d, 5, padding=2, bias=False)
        self.norm2 = ChannelRMSNorm(d, fp32=fp32)
        self.head = nn.Linear(d, n_cls)

    def forward(self, x):
        h = F.gelu(self.norm1(self.conv1(x)))
        h = F.gelu(self.norm2(self.conv2(h)))
        return self.head(h.mean(-1))


KEYWORDS = randn(6, 20, 1, seed=11)
SILENT_AT = SAMPLED - 1


def kws_batch(i):
    """16 clips of 24 log-mel frames (mean-normalised) of 6 keywords; at SILENT_AT one clip is digitally silent: the
    floored, mean-normalised log-mel of silence is all zeros."""
    g = gen(500 + i)
    y = torch.randint(0, 6, (16,), generator=g)
    x = KEYWORDS[y] * torch.rand(16, 1, 24, generator=g) + 0.3 * torch.randn(16, 20, 24, generator=g)
    if i == SILENT_AT:
        x[4] = 0.0
    return (x,), {}, y


def test_kws_rmsnorm_backward_overflows_on_a_silent_clip_at_step_199(tmp_path):
    torch.manual_seed(0)
    r = run(KWSNet(), kws_batch, ce, SILENT_AT + 3, tmp_path / "run", lr=2e-3, backward=True, snap_at=SILENT_AT)
    real_late_bwd(r, "norm2", SILENT_AT)
    assert r["skipped"] == [SILENT_AT], r["skipped"]
    fp32_finite(KWSNet, r["sd"], kws_batch, SILENT_AT, loss_fn=ce)
    named(r, FWD, "norm2", SILENT_AT, phase="backward", quiet_at=("conv2", "conv1", "norm1", "head", ""))


def test_twin_kws_rmsnorm_in_float32_is_quiet_past_the_sampled_step(tmp_path):
    torch.manual_seed(0)
    r = run(KWSNet(fp32=True), kws_batch, ce, SAMPLED + 5, tmp_path / "run", lr=2e-3, backward=True)
    # the silent clip still comes at step 199: in float32 the norm's backward is finite, but it multiplies the clip's
    # gradient by rsqrt(1e-6) = 1000, and at the loss scale of the time the fp16 gradient into conv2's input passes
    # 65504: GradScaler skips step 199 once and halves the scale (a gradient spike, its job), no skip after it
    assert r["first_bwd"] in (None, ("conv2", SILENT_AT)), r["first_bwd"]
    quiet_twin(r, skips=(SILENT_AT,), fall=0.9)


# ======================================================================================================================
# 5. an FT-Transformer on tabular data; at step 200 (a sampled step) a column without its quantile transform
# ======================================================================================================================
class NumericTokenizer(nn.Module):
    """FT-Transformer's feature tokenizer for numeric features: x_j * W_j + b_j, and a [CLS] token first."""

    def __init__(self, n, d):
        super().__init__()
        s = d ** -0.5
        self.weight = nn.Parameter(torch.empty(n, d).uniform_(-s, s))
        self.bias = nn.Parameter(torch.empty(n, d).uniform_(-s, s))
        self.cls = nn.Parameter(torch.empty(1, 1, d).uniform_(-s, s))

    def forward(self, x):
        t = x[..., None] * self.weight + self.bias
        return torch.cat([self.cls.expand(len(x), 1, -1), t], 1)


class FTBlock(nn.Module):
    def __init__(self, d, first=False, heads=2):
        super().__init__()
        self.ln1 = nn.Identity() if first else nn.LayerNorm(d)     # the paper: no first normalisation in block 0
        self.qkv, self.out, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.ln2(x))


class FTTransformer(nn.Module):
    def __init__(self, n=8, d=16, depth=2):
        super().__init__()
        self.tok = NumericTokenizer(n, d)
        self.blocks = nn.ModuleList(FTBlock(d, first=j == 0) for j in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 1)

    def forward(self, x):
        h = self.tok(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h[:, 0])).squeeze(-1)


W8 = randn(8, seed=13)
CENTS_AT = SAMPLED


def tabular_batch(i):
    """32 rows of 8 quantile-transformed features; from a shard read at CENTS_AT, income (column 3) is in raw cents."""
    g = gen(700 + i)
    x = torch.randn(32, 8, generator=g)
    y = torch.tanh(x @ W8 * 0.5) + 0.1 * x[:, 0] * x[:, 1]
    if i == CENTS_AT:
        x[:, 3] = (torch.randn(32, generator=g) * 0.6 + 10.8).exp() * 100
    return (x,), {}, y


def test_ft_transformer_raw_income_overflows_the_first_qkv_at_sampled_step_200(tmp_path):
    torch.manual_seed(0)
    r = run(FTTransformer(), tabular_batch, mse, CENTS_AT + 3, tmp_path / "run", snap_at=CENTS_AT)
    real_late(r, "blocks.0.qkv", CENTS_AT)
    fp32_finite(FTTransformer, r["sd"], tabular_batch, CENTS_AT)
    named(r, FWD, "blocks.0.qkv", CENTS_AT, quiet_at=("blocks.0", "blocks.0.out", "blocks.1", "head", ""))


# ======================================================================================================================
# 6. a GRU forecaster; at step 201 (after a sampled step) one target reading is NaN
# ======================================================================================================================
class LinearGRU(nn.Module):
    """A GRU written with Linear gates (x -> 3 gates for the whole sequence at once, h -> 3 gates per step)."""

    def __init__(self, d_in, d):
        super().__init__()
        self.x2h, self.h2h = nn.Linear(d_in, 3 * d), nn.Linear(d, 3 * d)

    def forward(self, x):                                       # x: (batch, time, features)
        gx = self.x2h(x)
        h = gx.new_zeros(x.shape[0], self.h2h.in_features)
        for j in range(x.shape[1]):
            rx, zx, nx = gx[:, j].chunk(3, -1)
            rh, zh, nh = self.h2h(h).chunk(3, -1)
            r, z = torch.sigmoid(rx + rh), torch.sigmoid(zx + zh)
            h = (1 - z) * torch.tanh(nx + r * nh) + z * h
        return h


class GRUForecaster(nn.Module):
    def __init__(self, feats=6, d=24):
        super().__init__()
        self.gru = LinearGRU(feats, d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.gru(x)).squeeze(-1)


MISSING_AT = SAMPLED + 1


def wave_batch(i):
    """16 windows of 12 steps of 6 phase-shifted sensor waves, the target the next value; at MISSING_AT one target
    reading is missing and the CSV reader made it NaN."""
    g = gen(100 + i)
    ph = torch.rand(16, 1, 1, generator=g) * 6.28
    t = torch.arange(12.0)[None, :, None]
    x = torch.sin(t * 0.4 + ph + torch.arange(6.0)) + 0.1 * torch.randn(16, 12, 6, generator=g)
    y = torch.sin(12 * 0.4 + ph[:, 0, 0])
    if i == MISSING_AT:
        y[3] = float("nan")
    return (x,), {}, y


def test_gru_nan_target_after_the_sampled_step_is_the_data(tmp_path):
    torch.manual_seed(0)
    r = run(GRUForecaster(), wave_batch, mse, MISSING_AT + 4, tmp_path / "run", lr=3e-3)
    # the oracle: no module made a non-finite value; the model's inputs finite, the target NaN, the loss NaN there
    assert r["first"] is None and r["first_bwd"] is None, r["first"]
    x, y = wave_batch(MISSING_AT)[0][0], wave_batch(MISSING_AT)[2]
    assert finite(x) and int(torch.isnan(y).sum()) == 1, y
    assert r["bad_loss"] == [MISSING_AT] and MISSING_AT in r["skipped"], (r["bad_loss"], r["skipped"])
    search_only_before(r, MISSING_AT)
    named(r, "nan_origin", None, MISSING_AT, quiet_at=("head", "gru", "gru.x2h", ""))


# ======================================================================================================================
# 7. a tiny GPT on AdamW with a ResNet recipe's lr and one-epoch constant warmup: the lr jumps x100 at step 233
# ======================================================================================================================
class GPTBlock(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.ln1, self.ln2, self.h = nn.LayerNorm(d), nn.LayerNorm(d), heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=32, d=32, depth=2, ctx=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        nn.init.normal_(self.tok.weight, std=0.02)              # GPT-2's init
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(GPTBlock(d) for _ in range(depth))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def markov_tokens(i, b=16, t=17, vocab=32):
    """A learnable token stream: next = (3 * tok + 7) % vocab nine times in ten, else a random token."""
    g = gen(900 + i)
    ids = torch.empty(b, t, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (b,), generator=g)
    noise = torch.randint(0, vocab, (b, t), generator=g)
    keep = torch.rand(b, t, generator=g) < 0.9
    for j in range(1, t):
        ids[:, j] = torch.where(keep[:, j], (3 * ids[:, j - 1] + 7) % vocab, noise[:, j])
    return ids


EPOCH = 233                # steps per epoch


def weights(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def module_factors(before, after):
    """The update oracle: per module, ||its parameters after|| / ||before|| (all of the module's own parameters)."""
    acc = {}
    for n, w0 in before.items():
        mod = n.rpartition(".")[0]
        a, b = acc.get(mod, (0.0, 0.0))
        acc[mod] = (a + float(w0.double().norm() ** 2), b + float(after[n].double().norm() ** 2))
    return {mod: math.sqrt(b / a) for mod, (a, b) in acc.items() if a > 0}


def test_gpt_constant_warmup_epoch_boundary_lr_jump_spikes_pos_at_step_233(tmp_path):
    torch.manual_seed(0)
    m = TinyGPT()
    opt = torch.optim.AdamW(m.parameters(), lr=0.4)                    # 0.1 x 1024 / 256 (a ResNet recipe's lr)
    sched = torch.optim.lr_scheduler.ConstantLR(opt, factor=0.01, total_iters=1)   # stepped once per epoch
    sc = torch.amp.GradScaler("cpu")
    r = dict(losses=[], factors=[], lrs=[], skipped=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
        for i in range(EPOCH + 3):
            ids = markov_tokens(i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(ids[:, :-1])
            loss = F.cross_entropy(out.float().flatten(0, 1), ids[:, 1:].flatten())
            r["losses"].append(loss.item())
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            before, s0 = weights(m), sc.get_scale()
            r["lrs"].append(opt.param_groups[0]["lr"])
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                r["skipped"].append(i)
            r["factors"].append(module_factors(before, weights(m)))
            if (i + 1) % EPOCH == 0:
                sched.step()
        w.close()
    rep = w.report()
    warns = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
             and str(x.message).startswith("ampdoctor:")]
    # the oracle: lr 4e-3 for the first epoch, 0.4 from step 233; no update before it moved a layer by 5%; at 233
    # `pos` x2.9, twice any other layer; the loss jumps (x5) but stays finite; no skip but the search
    assert r["lrs"][EPOCH - 1] == pytest.approx(4e-3) and r["lrs"][EPOCH] == pytest.approx(0.4), r["lrs"][-5:]
    assert all(v < 1.05 for f in r["factors"][:EPOCH] for v in f.values()), max(
        max(f.values()) for f in r["factors"][:EPOCH])
    f = r["factors"][EPOCH]
    top = max(f, key=f.get)
    assert top == "pos" and f[top] > 2.5 and all(2 * v <= f[top] for k, v in f.items() if k != top), f
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and ls[EPOCH + 1] > 4 * ls[EPOCH - 1], ls[-5:]
    assert [s for s in r["skipped"] if s >= 3] == [], r["skipped"]
    named(dict(rep=rep, warns=warns), "update_spike", "pos", EPOCH, phase=None, severity=("warning", "error"))


# ======================================================================================================================
# 8. creep: online forecasting of raw case counts growing 3-5% a day (the inputs never log-transformed)
# ======================================================================================================================
class CaseForecaster(nn.Module):
    """A pretrained input projection kept frozen (requires_grad False: its output needs no gradient), a LayerNorm and
    a trainable MLP head."""

    def __init__(self, win=14, d=32):
        super().__init__()
        self.inp = nn.Linear(win, d)
        self.inp.requires_grad_(False)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))

    def forward(self, x):
        return self.mlp(self.norm(self.inp(x))).squeeze(-1)


GROWTH = 0.03 + 0.02 * torch.rand(16, generator=gen(5))           # 16 regions, 3-5% a day
SEED_CASES = 20 * (1 + torch.rand(16, generator=gen(6)))
COUNTS_AT = 140


def count_batch(i):
    """Day i: each region's last 14 daily counts (weekly cycle, 5% noise) in raw counts; the target, the next day's
    count, in log1p."""
    t = torch.arange(i, i + 15.0)
    c = SEED_CASES[:, None] * torch.exp(GROWTH[:, None] * t) * (1 + 0.2 * torch.sin(t * 2 * math.pi / 7))
    c = c * (1 + 0.05 * torch.randn(16, 15, generator=gen(1500 + i)))
    return (c[:, :14],), {}, torch.log1p(c[:, 14])


@pytest.fixture(scope="module")
def counts_run(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        amax = []
        m = CaseForecaster()
        hook = recorder(m.inp, amax)
        r = run(m, count_batch, mse, COUNTS_AT + 4, tmp_path_factory.mktemp("counts") / "run", snap_at=COUNTS_AT,
                export=lambda m: hook.remove())
        return r, amax
    finally:
        torch.set_num_threads(n)


def test_creep_raw_case_counts_overflow_the_frozen_input_layer_at_step_140(counts_run):
    r, amax = counts_run
    real_late(r, "inp", COUNTS_AT)
    # the creep: inp's output grew steadily (+2% a step or more over the 60 steps before, never falling 20%)
    pre = amax[COUNTS_AT - 60:COUNTS_AT]
    assert all(map(math.isfinite, pre)) and pre[-1] > 1.02 ** 60 * pre[0], (pre[0], pre[-1])
    assert all(b > 0.8 * a for a, b in zip(pre, pre[1:])), pre
    fp32_finite(CaseForecaster, r["sd"], count_batch, COUNTS_AT)
    creep_named(r, "inp", COUNTS_AT, quiet_at=("norm", "mlp", "mlp.0", "mlp.2", ""))


def test_creep_raw_case_counts_early_warning_reads_as_documented(counts_run):
    r, _ = counts_run
    real_late(r, "inp", COUNTS_AT)
    early_warning_coherent(r, "inp", COUNTS_AT)


# ======================================================================================================================
# 9 + twin. creep: Gumbel-softmax with tau = exp(-r t) annealed without its floor
# ======================================================================================================================
class GumbelQuantizer(nn.Module):
    def __init__(self, d, n=8, k=8):
        super().__init__()
        self.n, self.k, self.tau = n, k, 1.0
        self.proj = nn.Linear(d, n * k)

    def forward(self, h):
        logits = self.proj(h).view(len(h), self.n, self.k)
        return F.gumbel_softmax(logits, tau=self.tau, dim=-1), logits


class CatVAE(nn.Module):
    def __init__(self, x=32, d=64, n=8, k=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(x, d), nn.GELU())
        self.quant = GumbelQuantizer(d, n, k)
        self.dec = nn.Sequential(nn.Linear(n * k, d), nn.GELU(), nn.Linear(d, x))

    def forward(self, x):
        z, logits = self.quant(self.enc(x))
        return self.dec(z.flatten(1)), logits


PATTERNS = (randn(16, 32, seed=19) > 0).float()
R_ANNEAL = 0.07
TAU_AT = 125


def pattern_batch(i):
    """32 binary vectors from 16 patterns, 5% of the bits flipped."""
    g = gen(1700 + i)
    x = PATTERNS[torch.randint(0, 16, (32,), generator=g)]
    return (torch.where(torch.rand(32, 32, generator=g) < 0.05, 1 - x, x),), {}, x


def vae_loss(out, x):
    rec, logits = out
    q = F.softmax(logits.float(), -1)
    kl = (q * (q * q.shape[-1] + 1e-10).log()).sum((1, 2)).mean()
    return F.binary_cross_entropy_with_logits(rec.float(), x, reduction="none").sum(1).mean() + kl


def anneal(floor):
    def before(i, m):
        m.quant.tau = max(floor, math.exp(-R_ANNEAL * i))      # Jang et al.: max(0.5, exp(-r t)); floor 0: no floor
    return before


def test_creep_gumbel_softmax_tau_annealed_without_floor_overflows_at_step_125(tmp_path):
    torch.manual_seed(0)
    seen = []
    m = CatVAE()
    hook = recorder(m.quant.proj, seen)
    r = run(m, pattern_batch, vae_loss, TAU_AT + 3, tmp_path / "run", before=anneal(0.0), snap_at=TAU_AT,
            export=lambda m: hook.remove())
    real_late(r, "quant", TAU_AT)
    # the creep: 1/tau grows 7.3% a step; the logits stay small (|logits| < 20 throughout), so it is the division
    # by tau that passes 65504, at the onset (|logit + gumbel| <= |logit| + 16.7 in fp16)
    assert all(v < 20 for v in seen), max(seen)
    assert (max(seen[TAU_AT - 1:]) + 16.7) * math.exp(R_ANNEAL * TAU_AT) > 65504
    assert (max(seen) + 16.7) * math.exp(R_ANNEAL * (TAU_AT - 40)) < 65504
    creep_named(r, "quant", TAU_AT, quiet_at=("dec", "dec.0", "dec.2", ""))


def test_twin_gumbel_softmax_tau_with_its_floor_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(CatVAE(), pattern_batch, vae_loss, 160, tmp_path / "run", before=anneal(0.5)), fall=0.95)


# ======================================================================================================================
# 10 + twin. creep: a mean teacher whose EMA forgot the (1 - m): the teacher's weights grow every step
# ======================================================================================================================
def student_mlp():
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 5))


class MeanTeacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = student_mlp()
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)

    def forward(self, x, xu):
        with torch.no_grad():
            t = self.teacher(xu)
        return self.student(x), self.student(xu), t


CENTRES = randn(5, 16, seed=23) * 1.5
EMA_M = 0.97
TEACHER_AT = 70


def semi_batch(i):
    """16 labelled points of 5 classes and 48 unlabelled ones."""
    g = gen(1900 + i)
    y = torch.randint(0, 5, (16,), generator=g)
    x = CENTRES[y] + 0.5 * torch.randn(16, 16, generator=g)
    xu = CENTRES[torch.randint(0, 5, (48,), generator=g)] + 0.5 * torch.randn(48, 16, generator=g)
    return (x, xu), {}, y


def mt_loss(out, y):
    logits, su, t = out
    cons = F.mse_loss(F.softmax(su.float(), -1), F.softmax(t.float(), -1))
    return F.cross_entropy(logits.float(), y) + 10 * cons


def ema(right, norms=None):
    def after(i, m):
        with torch.no_grad():
            for pt, ps in zip(m.teacher.parameters(), m.student.parameters()):
                if right:
                    pt.mul_(EMA_M).add_(ps, alpha=1 - EMA_M)
                else:
                    pt.mul_(EMA_M).add_(ps)                     # the (1 - m) forgotten
        if norms is not None:
            norms.append(float(m.teacher[4].weight.norm()))
    return after


def test_creep_mean_teacher_ema_without_1_minus_m_overflows_at_step_70(tmp_path):
    torch.manual_seed(0)
    norms = []
    r = run(MeanTeacher(), semi_batch, mt_loss, TEACHER_AT + 4, tmp_path / "run", after=ema(False, norms),
            snap_at=TEACHER_AT)
    real_late(r, "teacher.4", TEACHER_AT)
    # the creep: the teacher's last layer grew on every update before the onset, by more than 1% a step over the 20
    # updates before it, to more than 10x the student's
    pre = norms[:TEACHER_AT]
    assert all(b > a for a, b in zip(pre, pre[1:])), pre
    assert pre[-1] > 1.01 ** 20 * pre[-21], (pre[-21], pre[-1])
    assert r["sd"]["teacher.4.weight"].norm() > 10 * r["sd"]["student.4.weight"].norm()
    fp32_finite(MeanTeacher, r["sd"], semi_batch, TEACHER_AT)
    creep_named(r, "teacher.4", TEACHER_AT, quiet_at=("teacher", ""))


def test_twin_mean_teacher_with_the_right_ema_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(MeanTeacher(), semi_batch, mt_loss, 120, tmp_path / "run", after=ema(True)))
