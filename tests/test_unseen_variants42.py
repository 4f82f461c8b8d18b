"""Forty-second set: SILENT bf16 FAILURES. Eight bf16 failures users hit where nothing goes inf or NaN: the loss stays
finite, training just stops improving or learns something wrong. bf16 has fp32's range and an 8-bit significand, so
these are precision failures (updates below half an ulp, a state that stops moving, a signal riding on a large
offset, integers past 256). Watched through the public API only (`ampdoctor.watch(model, optimizer=..., run_dir=
tmp_path / "run")` at the default settings, no GradScaler -> the case's own loop: zero_grad -> forward (+ loss) under
`torch.autocast("cpu", dtype=torch.bfloat16)`, or a pure-bf16 model `model.to(torch.bfloat16)` without autocast ->
backward -> step -> close -> `w.report()`), ampdoctor's RuntimeWarnings recorded. Tiny models, fixed seeds, CPU.

Each failure is proven first by the test's own oracle: the share of elements with a nonzero gradient that the
optimizer step left exactly as they were (w + dw == w) and how far the loss fell against fp32 master weights;
a momentum copy's elements compared around each in-place update; a BatchNorm's running mean against the batches'
means and the eval-mode loss against the train-mode one; the same computation in fp32 on the same weights and
inputs (a module's output, a rotary table, Fourier features); the loss against an fp32 twin on the same batches.
Only then must the rule the contract names be among the report's first three findings at the module where the
precision is lost (update_underflow: error; precision_loss: warning or error), at the step it begins where it
begins mid-run. A wrong report raises WrongAnswer naming ampdoctor's top three (a failing oracle or a crash fails
otherwise). Twins (the fix applied): the run really trains (the loss falls, the oracle clean) and ampdoctor gives no
warning, no error and no RuntimeWarning; a twin it alarms on raises FalseAlarm.

 1. a classifier "fine-tuned from a bf16 checkpoint" in pure bf16 (`model.to(torch.bfloat16)`, AdamW at the HF
    Trainer's default lr 5e-5, 6-step linear warmup): Adam's ~lr step is below half an ulp of almost every weight
    (|w| > ~0.02): 82-93% of every layer's updates round away from step 0 (mean over 60 steps), the loss falls
    less than 1/3 as far as with fp32 master weights (0.005 against 0.023) -> update_underflow (error) at a Linear
    whose updates round away, step 0..7.
 2. a momentum (key) encoder kept in bf16 "to halve its memory" next to an fp32 student under bf16 autocast, updated
    with DINO's line `param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)` at MoCo's m = 0.999: the relative
    step 1e-3 is below half a bf16 ulp (2^-9..2^-8), > 94% of the key encoder's elements are unchanged by each
    update; after 40 updates 6% of them have ever moved (the fp32 copy: all) -> update_underflow (error) at
    `encoder_k` (an in-place update outside the optimizer), step 0..2.
 3. a BatchNorm1d(affine=False) input normaliser with TF's momentum (torch momentum=0.01, as TF ports and timm's
    TF-EfficientNets set it) in a pure-bf16 tabular regressor whose raw features have means 5..15: the running
    mean's EMA step 0.01 * (batch mean - running mean) rounds away once it is below half an ulp, the running means
    stop at 57-76% of the features' means (15 of 16 unchanged over the last 150 of 450 steps, every one > 20% off);
    train-mode batch statistics hide it, the eval-mode loss is 69x the train-mode one (> 5x asserted; the fp32
    twin's running means are within 1.3%, its eval loss below its train-mode one) -> precision_loss (or
    update_underflow about the running statistics) at `bn`.
 4. a regression in kelvin (targets ~290 K, spread +-3 K) under bf16 autocast with the output bias initialised to
    the targets' mean (the "init the last layer well" advice), targets not standardised: the head's bf16 output has
    an ulp of 2 K at 290, a 256-sample batch's predictions take 4 distinct values (<= 8 asserted), off the same
    weights in fp32 by up to 1.7 K, the loss stalls at 12x that of the same model without autocast (> 5x asserted)
    -> precision_loss at `head` (whose output loses the signal to the offset).
 5. span mean-pooling by prefix sums (`c = h.cumsum(1); (c[end] - c[start]) / len`, the O(T) trick) in a pure-bf16
    span regressor over 1024 tokens: the running sums reach 200-530 (ulp 1-4), their differences for spans late in
    the sequence are mostly rounding -> the pooled spans past token 512 are 39% off fp32's (> 25% asserted; 6%
    before token 128), the loss stalls at 1.65x the fp32-cumsum twin's (> 1.5x) -> precision_loss at `span_pool`.
 6. rotary embeddings computed as the older transformers LlamaRotaryEmbedding did, `t = torch.arange(T,
    dtype=self.inv_freq.dtype)`, in a model loaded in bf16 (`model.to(torch.bfloat16)` casts the inv_freq buffer):
    the positions 0..1023 hold 513 distinct values, inv_freq and t * inv_freq are rounded in bf16 too, the cos/sin
    tables past position 256 are off by up to 2.0 (mean 0.88) -> precision_loss at `rotary` (the positions never
    enter a module: they are made inside it from its own buffer's dtype).
 7. (no failure: the truth decided) AdamW with eps=1e-8 on a pure-bf16 recommender whose item table has rows no batch
    touches: exp_avg_sq is bf16 and 0 on those rows, but 1e-8 is a normal bf16 number (bf16 has fp32's exponent), so
    m / (sqrt(0) + eps) = 0 / 1e-8 = 0: they stay finite and untouched, the updates land (< 50% rounded in every
    step), the loss falls. The same step in fp16 writes NaN (eps == 0 there: 0 / 0) -> no eps_underflow, nothing.
 8. an online forecaster trained on the stream as it arrives (each step the last 32 days, from day 200), its
    collate casting the batch to the model's dtype (pure bf16), day-of-week and day-of-year features from the day
    index (`torch.remainder(day, 7)`, exact below 256): from the step whose window first reaches past day 256
    (step 27) neighbouring days are rounded together, their day-of-week is wrong by a day, the loss turns back up
    (its minimum 0.40 at step 45, 0.60-0.93 after step 58) while the fp32-day twin's falls to 1/35 of it ->
    precision_loss at `seasonal`, step 27..38 (an unsampled step: full statistics are taken on step 0 and every
    200th).
Twins (no warning, no error, no RuntimeWarning; the run really trains): 1 with fp32 weights under bf16 autocast
(fp32 master weights); 2 with the key encoder kept fp32; 3 with fp32 weights and BatchNorm buffers under bf16
autocast (450 steps: the running means within 1.3%); 4 with the targets standardised ((y - 290) / 3, the bias at 0); 5 with the prefix sums taken
in fp32 (`h.float().cumsum(1)`); 6 with int64 positions and the tables made in fp32, cast afterwards; 8 with the
day index kept fp32 until the features are made.
Not built (no failure to see on these): a loss averaged in bf16 over a large batch (torch's CPU reductions and cumsum
accumulate bf16 in fp32: the mean of 1e5 values is off only by its final rounding, 0.3%; the gradient of a mean is
1/N whatever the sum's rounding); gradients accumulated over 64 micro-batches in a pure-bf16 model's .grad (within
0.7-2% of the fp32 sum of the same micro-batch gradients, measured: rounding, not a stalled training); attention
scores that collapse in bf16 (test_bf16_probe.py 8 builds it); a hand-written running sum (test_bf16_probe.py 7).

What ampdoctor says (torch 2.13 CPU; 4 of 8 right: 1, 2, 8 and the no-failure case 7; all 7 twins quiet; 4 strict
xfails, each failing only at the report check; at first 2 and 8 were wrong too):
- right: 1 `[error] update_underflow at enc.0 step 0` (97% of enc.0's sampled elements); 7 quiet (no eps_underflow:
  rules/weights.py optimizer_eps judges only float16 parameters, which is right for bf16).
- 2 (fixed since; was a strict xfail): an empty report, also at every=1. DINO's `param_k.data.mul_(m).add_(...)` writes through `.data`, which does
  not move the Parameter's `_version` (nor does an assignment `param_k.data = ...`); record/params.py outside_compare skips
  every parameter whose `_version` did not move (`if p._version == version: continue`). The same update written
  `param_k.mul_(m).add_(...)` under torch.no_grad() IS reported (`update_underflow at encoder_k step 1`, 97%).
  outside_compare now compares a parameter whose version did not move too, and keeps it where some sampled
  element changed (a frozen weight changes none).
- 3: `[error] update_underflow at body.0 step 260` (body.0.bias: the oracle measures 38-72% of its updates rounding
  at steps 256-264, weight ~40%: borderline, at the 50% threshold), nothing at `bn`, also at every=1: a buffer's EMA
  (running_mean) is never checked for rounding.
- 4, 5: empty reports: without a non-finite step nothing is replayed against fp32 (replay/explain.py's
  precision_loss needs a capture), and no integer input is involved.
- 6 (fixed since; was a strict xfail): an empty report, also at every=1: the bf16 positions are made inside
  `rotary`, never a module's input, so the integer probe (record/openstep.py probe_integers, on module inputs) never
  saw them. record/lowcast.py now probes what torch.arange makes in bf16 inside a sampled step's forward.
- 8 (fixed since; was a strict xfail): `[error] update_underflow at mix.2 step 60` (51% of mix.2's sampled
  elements: borderline true, the oracle measures 50% of mix.2.weight at step 59-60), nothing at `seasonal`: the
  integer probe ran only on sampled steps (record/modulehooks.py returns before probing when `not st.sampled`), and
  step 0's days are all below 256. Now a module whose input a sampled step found to be an integer ramp is probed
  on routine steps too (record/intwatch.py): `[warning] precision_loss at seasonal` at the onset step.
Seen, not asserted: MoCo's own form `param_k.data = param_k.data * m + param_q.data * (1 - m)` with an fp32 student
silently turns the bf16 key encoder into fp32 (`.data =` takes the promoted fp32 result), so it does not fail.

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants42.py
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
from probe_harness import WrongAnswer, wrong, xf
from scenarios import alarms, gen, lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

BF16 = torch.bfloat16


# ======================================================================================================================
# the loop, the oracles and the checks
# ======================================================================================================================
class FalseAlarm(AssertionError):
    """A twin (the fix applied, proven healthy) on which ampdoctor gave a warning, an error or a RuntimeWarning."""


def false_alarm(reason):
    """A strict xfail that accepts only FalseAlarm."""
    return xf(reason).with_args(raises=FalseAlarm)


def run(m, opt, batch, loss_fn, steps, run_dir, *, autocast=True, watch=True, before=None, after=None, sched=None):
    """The user's bf16 loop under ampdoctor.watch(m, optimizer=opt, run_dir=run_dir) at the default settings, no
    scaler, inside a warnings recorder: [before(i)] -> zero_grad -> loss_fn(m, *batch(i)) under bf16 CPU autocast
    (`autocast`; off for a pure-bf16 model) -> backward -> step -> [sched.step()] -> [after(i)]. `watch=False`: the
    same loop without a watch (an oracle's fp32 reference run). Returns a dict: losses, rep (the report), warns
    (ampdoctor's RuntimeWarnings)."""
    r = dict(losses=[], rep=None, warns=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, run_dir=run_dir) if watch else None
        try:
            for i in range(steps):
                if before is not None:
                    before(i)
                opt.zero_grad(set_to_none=True)
                args = batch(i)
                with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                    loss = loss_fn(m, *args)
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                r["losses"].append(loss.item())
                if after is not None:
                    after(i)
        finally:
            if w is not None:
                w.close()
    if w is not None:
        r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    return r


def named(r, rules, modules, *, steps=None, severity=("error",), about=None):
    """The report check: one of `rules` at one of `modules`, among the first three findings, with `severity`, at one
    of `steps` (None: any), and (`about(f)`) saying what the oracle saw. A failure is a WrongAnswer naming ampdoctor's
    top three and its RuntimeWarnings."""
    rep = r["rep"]
    hits = [f for f in rep.findings[:3] if f.rule in rules and f.module in modules and f.severity in severity
            and (steps is None or f.step in steps) and (about is None or about(f))]
    if not hits:
        raise WrongAnswer(f"top3={lines(rep)[:3]} warnings={r['warns']} (wanted {rules} at {sorted(modules)}, "
                          f"steps {steps if steps is None else (min(steps), max(steps))})")
    return hits[0]


def quiet(r, fall=1.0):
    """A twin: it really trained (every loss finite, the mean of the last five below `fall` x the first five), and
    ampdoctor is quiet (no warning or error finding, exit code 0, no RuntimeWarning) or FalseAlarm."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)), ls
    assert sum(ls[-5:]) < fall * sum(ls[:5]), ls
    rep = r["rep"]
    if alarms(rep.findings) or rep.exit_code != 0 or r["warns"]:
        raise FalseAlarm(f"{alarms(rep.findings)[:3]} warnings={r['warns']}")


class Rounding:
    """Oracle of updates that round away: `before(i)` snapshots every parameter, `after(i)` records, per parameter
    and step, the share of the elements with a nonzero gradient that the step left exactly as they were."""

    def __init__(self, m):
        self.m, self.prev, self.per_step = m, {}, {}

    def before(self, i):
        self.prev = {n: p.detach().clone() for n, p in self.m.named_parameters()}

    def after(self, i):
        for n, p in self.m.named_parameters():
            nz = p.grad != 0
            same = int(((p.detach() == self.prev[n]) & nz).sum())
            self.per_step.setdefault(n, []).append(same / max(int(nz.sum()), 1))

    def mean(self):
        return {n: sum(v) / len(v) for n, v in self.per_step.items()}

    def worst(self, min_numel=16):
        ps = dict(self.m.named_parameters())
        return {n: max(v) for n, v in self.per_step.items() if ps[n].numel() >= min_numel}


def weights(m):
    return {n: p.detach().float().clone() for n, p in m.named_parameters()}


# ======================================================================================================================
# 1. a pure-bf16 fine-tune at the HF Trainer's default lr: the updates round away
# ======================================================================================================================
class FTNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.head = nn.Linear(128, 4)

    def forward(self, x):
        return self.head(self.enc(x))


FT_P = randn(64, 4, seed=1)
FT_STEPS = 60
FT_LAYERS = ("enc.0", "enc.2", "head")


def ft_batch(i, dtype):
    x = randn(128, 64, seed=100 + i)
    return x.to(dtype), (x @ FT_P).argmax(1)


def ft_ce(m, x, y):
    return F.cross_entropy(m(x).float(), y)


def ft_run(run_dir, pure, watch=True):
    """The fine-tune: `pure` = the bf16 checkpoint trained in bf16; else fp32 weights under bf16 autocast. Returns
    (run dict, Rounding)."""
    torch.manual_seed(0)
    m = FTNet()
    if pure:
        m.to(BF16)
    opt = torch.optim.AdamW(m.parameters(), lr=5e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 6))
    rnd = Rounding(m)
    dt = BF16 if pure else torch.float32
    r = run(m, opt, lambda i: ft_batch(i, dt), ft_ce, FT_STEPS, run_dir, autocast=not pure, watch=watch,
            before=rnd.before, after=rnd.after, sched=sched)
    return r, rnd


def drop(r, k=10):
    """How far the loss fell: the mean of the first k losses minus that of the last k."""
    return (sum(r["losses"][:k]) - sum(r["losses"][-k:])) / k


def test_pure_bf16_finetune_at_hf_default_lr_rounds_away_is_update_underflow(tmp_path):
    r, rnd = ft_run(tmp_path / "run", pure=True)
    ref, _ = ft_run(tmp_path / "ref", pure=False, watch=False)
    share = rnd.mean()
    for layer in FT_LAYERS:
        assert share[f"{layer}.weight"] > 0.8, share                      # most updates round away, every step
    assert drop(r) < 0.35 * drop(ref), (drop(r), drop(ref))                # it learns < 1/3 of what fp32 masters do
    rounding = {layer for layer in FT_LAYERS if max(rnd.per_step[f"{layer}.weight"]) > 0.5}
    named(r, ("update_underflow",), rounding, steps=range(0, 8))


def test_twin_finetune_with_fp32_master_weights_under_autocast_is_quiet(tmp_path):
    r, rnd = ft_run(tmp_path / "run", pure=False)
    assert max(rnd.worst().values()) < 0.05, rnd.worst()                   # the updates land
    quiet(r)


# ======================================================================================================================
# 2. a bf16 momentum encoder updated in place through .data (DINO's line, MoCo's momentum)
# ======================================================================================================================
def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


class Siamese(nn.Module):
    """BYOL/MoCo-style: an online encoder + predictor trained by the optimizer, a momentum (key) encoder that follows
    it by an EMA, frozen, in `key_dtype`."""

    def __init__(self, key_dtype):
        super().__init__()
        self.encoder_q, self.predictor = _mlp(), nn.Linear(32, 32)
        self.encoder_k = copy.deepcopy(self.encoder_q).to(key_dtype).requires_grad_(False)

    def forward(self, x1, x2):
        q = F.normalize(self.predictor(self.encoder_q(x1)).float(), dim=-1)
        with torch.no_grad():
            k = F.normalize(self.encoder_k(x2.to(self.encoder_k[0].weight.dtype)).float(), dim=-1)
        return 2 - 2 * (q * k).sum(-1).mean()

    @torch.no_grad()
    def momentum_update(self, m=0.999):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)      # DINO's update line


SIAM_STEPS = 40


def siam_batch(i):
    z = randn(128, 32, seed=10 + i)
    return z + 0.3 * randn(128, 32, seed=500 + i), z + 0.3 * randn(128, 32, seed=900 + i)


def siam_loss(m, x1, x2):
    return m(x1, x2)


def siam_run(run_dir, key_dtype, watch=True):
    """Returns (run dict, the key encoder's unchanged share per update, its weights at the start and the end)."""
    torch.manual_seed(0)
    m = Siamese(key_dtype)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    k0, unchanged = weights(m.encoder_k), []

    def after(i):
        before = [p.detach().clone() for p in m.encoder_k.parameters()]
        m.momentum_update()
        same = sum(int((p.detach() == b).sum()) for p, b in zip(m.encoder_k.parameters(), before))
        unchanged.append(same / sum(b.numel() for b in before))
    r = run(m, opt, siam_batch, siam_loss, SIAM_STEPS, run_dir, watch=watch, after=after)
    assert m.encoder_k[0].weight.dtype == key_dtype
    return r, unchanged, k0, weights(m.encoder_k)


def ever_changed(k0, k1):
    """The share of the key encoder's elements that differ from where they started."""
    return sum(int((k1[n] != k0[n]).sum()) for n in k0) / sum(v.numel() for v in k0.values())


def test_bf16_momentum_encoder_updated_through_data_rounds_away_is_update_underflow_at_encoder_k(tmp_path):
    r, unchanged, k0, k1 = siam_run(tmp_path / "run", BF16)
    _, _, f0, f1 = siam_run(tmp_path / "ref", torch.float32, watch=False)
    assert min(unchanged) > 0.9 and sum(unchanged) / len(unchanged) > 0.95, unchanged   # the EMA updates round away
    assert ever_changed(k0, k1) < 0.4 and ever_changed(f0, f1) == 1.0, (ever_changed(k0, k1), ever_changed(f0, f1))
    named(r, ("update_underflow",), {"encoder_k"}, steps=range(0, 3))


def test_twin_fp32_momentum_encoder_is_quiet(tmp_path):
    r, unchanged, _, _ = siam_run(tmp_path / "run", torch.float32)
    assert max(unchanged) < 0.05, unchanged                                 # every EMA update moves it
    quiet(r)


# ======================================================================================================================
# 3. a BatchNorm input normaliser with TF's momentum in pure bf16: the running mean stops short
# ======================================================================================================================
class TabNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16, momentum=0.01, affine=False)          # TF's momentum 0.99, torch's 0.01
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.body(self.bn(x))).squeeze(-1)


TAB_MU = 5 + 10 * torch.rand(16, generator=gen(2))       # raw features: means 5..15
TAB_SD = 0.5 + torch.rand(16, generator=gen(4))
TAB_W = randn(16, seed=5)
TAB_STEPS = 450


def tab_batch(i, dtype=BF16):
    z = randn(64, 16, seed=100 + i)
    return (TAB_MU + TAB_SD * z).to(dtype), (z @ TAB_W).tanh()


def tab_mse(m, x, y):
    return F.mse_loss(m(x).float(), y)


def tab_run(run_dir, pure):
    """`pure`: the model in bf16 (its BatchNorm buffers too); else fp32 weights and buffers under bf16 autocast.
    Returns (run dict, the running mean after each step, the model)."""
    torch.manual_seed(0)
    m = TabNet()
    dt = BF16 if pure else torch.float32
    m.to(dt)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    hist = []
    r = run(m, opt, lambda i: tab_batch(i, dt), tab_mse, TAB_STEPS, run_dir, autocast=not pure,
            after=lambda i: hist.append(m.bn.running_mean.detach().float().clone()))
    return r, hist, m


def eval_vs_train(m, autocast):
    """(eval-mode loss, train-mode loss) on a held-out batch (the running statistics against the batch's own)."""
    x, y = tab_batch(999, m.head.weight.dtype)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        m.eval()
        ev = float(tab_mse(m, x, y))
        m.train()
        tr = float(tab_mse(m, x, y))
    return ev, tr


@wrong("top3=['[error] update_underflow at body.0 step 260' (body.0.bias, 50%: borderline)]: nothing at bn, also "
       "at every=1; the running statistics' EMA is never checked for rounding")
def test_pure_bf16_batchnorm_running_mean_stops_short_is_reported_at_bn(tmp_path):
    r, hist, m = tab_run(tmp_path / "run", pure=True)
    rm = hist[-1]
    assert float(((rm - TAB_MU).abs() / TAB_MU).min()) > 0.2, rm           # every feature's mean > 20% off
    assert int((hist[-150] == rm).sum()) >= 14, (hist[-150], rm)             # and stopped: 150 steps, no change
    ev, tr = eval_vs_train(m, autocast=False)
    assert ev > 5 * tr, (ev, tr)                                           # the model it ships is broken
    named(r, ("precision_loss", "update_underflow"), {"bn"}, severity=("warning", "error"),
          about=lambda f: f.rule == "precision_loss" or "running" in str(f.evidence) + f.message)


def test_twin_batchnorm_fp32_weights_and_buffers_under_autocast_is_quiet(tmp_path):
    r, hist, m = tab_run(tmp_path / "run", pure=False)
    assert float(((hist[-1] - TAB_MU).abs() / TAB_MU).max()) < 0.05, hist[-1]  # (0.99^450 = 1% of the way left)
    assert not torch.equal(hist[-60], hist[-1])
    ev, tr = eval_vs_train(m, autocast=True)
    assert ev < 2 * tr, (ev, tr)
    quiet(r)


# ======================================================================================================================
# 4. a regression in kelvin under bf16 autocast: the signal rides on a 290 K offset
# ======================================================================================================================
class KelvinNet(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            self.head.bias.fill_(offset)          # the output bias at the targets' mean

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


K_W = randn(8, seed=5)
K_STEPS = 150


def kelvin_batch(i, offset=290.0, scale=1.0):
    x = randn(256, 8, seed=100 + i)
    y = 290.0 + 3.0 * (x @ K_W / 3).tanh() + 0.9 * (x[:, 0] * x[:, 1]).tanh()
    return x, (y - 290.0 + offset) / scale


def kelvin_mse(m, x, y):
    return F.mse_loss(m(x).float(), y)


def kelvin_run(run_dir, standardised, autocast=True, watch=True):
    torch.manual_seed(0)
    off, scale = (0.0, 3.0) if standardised else (290.0, 1.0)
    m = KelvinNet(off)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    r = run(m, opt, lambda i: kelvin_batch(i, off, scale), kelvin_mse, K_STEPS, run_dir, autocast=autocast,
            watch=watch)
    return r, m


@wrong("top3=[] (an empty report): nothing goes non-finite, so no replay against fp32 runs, and the head's output "
       "is no integer input")
def test_kelvin_regression_under_bf16_autocast_loses_the_signal_to_the_offset_at_head(tmp_path):
    r, m = kelvin_run(tmp_path / "run", standardised=False)
    ref, _ = kelvin_run(tmp_path / "ref", standardised=False, autocast=False, watch=False)
    x, y = kelvin_batch(999)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        pred = m(x)
    with torch.no_grad():
        pred32 = m(x)                          # the same weights in fp32
    assert float(y.std()) > 1.5 and pred.unique().numel() <= 8, pred.unique()
    assert float((pred.float() - pred32).abs().max()) > 0.5
    assert sum(r["losses"][-10:]) > 5 * sum(ref["losses"][-10:]), (r["losses"][-10:], ref["losses"][-10:])
    named(r, ("precision_loss",), {"head"}, severity=("warning", "error"))


def test_twin_kelvin_regression_with_standardised_targets_is_quiet(tmp_path):
    r, _ = kelvin_run(tmp_path / "run", standardised=True)
    assert sum(r["losses"][-10:]) / 10 < 0.02, r["losses"][-10:]          # (= 0.18 K^2 in kelvin)
    quiet(r, fall=0.5)


# ======================================================================================================================
# 5. span mean-pooling by prefix sums in pure bf16
# ======================================================================================================================
class SpanPool(nn.Module):
    """Mean of h[start..end] for every span, by prefix sums (`fp32`: the sums taken in fp32)."""

    def __init__(self, fp32):
        super().__init__()
        self.fp32 = fp32

    def forward(self, h, start, end):
        c = F.pad((h.float() if self.fp32 else h).cumsum(1), (0, 0, 1, 0))
        b = torch.arange(h.shape[0])[:, None]
        span = (c[b, end + 1] - c[b, start]) / (end - start + 1)[..., None].to(c.dtype)
        return span.to(h.dtype)


class SpanNet(nn.Module):
    def __init__(self, fp32):
        super().__init__()
        self.tok = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.span_pool = SpanPool(fp32)
        self.reg = nn.Linear(32, 1)

    def forward(self, x, start, end):
        return self.reg(self.span_pool(self.tok(x), start, end)).squeeze(-1)


SPAN_V = randn(16, seed=7)
SPAN_STEPS = 80


def span_batch(i, B=8, T=1024, S=32):
    g = gen(100 + i)
    x = torch.randn(B, T, 16, generator=g)
    start = torch.randint(0, T - 8, (B, S), generator=g)
    n = torch.randint(1, 8, (B, S), generator=g)
    cs = F.pad((x @ SPAN_V).cumsum(1), (1, 0))
    b = torch.arange(B)[:, None]
    return x.to(BF16), start, start + n - 1, (cs[b, start + n] - cs[b, start]) / n   # the span's mean signal


def span_mse(m, x, start, end, y):
    return F.mse_loss(m(x, start, end).float(), y)


def span_run(run_dir, fp32, watch=True):
    torch.manual_seed(0)
    m = SpanNet(fp32).to(BF16)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return run(m, opt, span_batch, span_mse, SPAN_STEPS, run_dir, autocast=False, watch=watch), m


@wrong("top3=[] (an empty report): nothing goes non-finite, so no replay against fp32 runs")
def test_bf16_prefix_sum_span_pooling_is_precision_loss_at_span_pool(tmp_path):
    r, m = span_run(tmp_path / "run", fp32=False)
    ref, _ = span_run(tmp_path / "ref", fp32=True, watch=False)
    x, start, end, y = span_batch(999)
    with torch.no_grad():
        h = m.tok(x)
        got, want = m.span_pool(h, start, end).float(), SpanPool(True)(h, start, end).float()
    rel = (got - want).abs().mean(-1) / want.abs().mean(-1)
    assert float(rel[start > 512].mean()) > 0.25 and float(rel[start < 128].mean()) < 0.1, rel
    assert sum(r["losses"][-10:]) > 1.5 * sum(ref["losses"][-10:]), (r["losses"][-10:], ref["losses"][-10:])
    named(r, ("precision_loss",), {"span_pool"}, severity=("warning", "error"))


def test_twin_prefix_sums_in_fp32_is_quiet(tmp_path):
    r, _ = span_run(tmp_path / "run", fp32=True)
    quiet(r, fall=0.2)


# ======================================================================================================================
# 6. rotary tables from positions made in the inv_freq buffer's dtype (bf16 after model.to)
# ======================================================================================================================
class Rotary(nn.Module):
    def __init__(self, dim, fixed):
        super().__init__()
        self.fixed, self.dim = fixed, dim
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def tables(self, T, dtype):
        if self.fixed:   # int64 positions and the frequencies made in fp32 (no buffer .to can cast), cast afterwards
            inv_freq = 1.0 / 10000 ** (torch.arange(0, self.dim, 2, device=self.inv_freq.device).float() / self.dim)
            f = torch.outer(torch.arange(T, device=self.inv_freq.device).float(), inv_freq)
        else:            # the older transformers LlamaRotaryEmbedding
            t = torch.arange(T, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            f = torch.outer(t, self.inv_freq)
        e = torch.cat([f, f], -1)
        return e.cos().to(dtype), e.sin().to(dtype)

    def forward(self, q, k):
        cos, sin = self.tables(q.shape[-2], q.dtype)

        def half_turn(x):
            x1, x2 = x.chunk(2, -1)
            return torch.cat([-x2, x1], -1)
        return q * cos + half_turn(q) * sin, k * cos + half_turn(k) * sin


class RopeLM(nn.Module):
    def __init__(self, fixed, V=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.qkv, self.rotary, self.out = nn.Linear(d, 3 * d), Rotary(d, fixed), nn.Linear(d, V)

    def forward(self, ids):
        h = self.emb(ids)
        q, k, v = self.qkv(h).chunk(3, -1)
        q, k = self.rotary(q, k)
        T = ids.shape[1]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.out(h + att @ v)


ROPE_T, ROPE_STEPS = 1024, 12


def rope_batch(i, B=2, V=64):
    ids = torch.randint(0, V, (B, ROPE_T + 1), generator=gen(100 + i))
    return ids[:, 1:], ids[:, :-1]            # predict the token before


def rope_ce(m, x, y):
    return F.cross_entropy(m(x).float()[:, 1:].reshape(-1, 64), y[:, 1:].reshape(-1))


def rope_run(run_dir, fixed):
    torch.manual_seed(0)
    m = RopeLM(fixed).to(BF16)                # loaded in bf16: the inv_freq buffer too
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    rnd = Rounding(m)
    r = run(m, opt, rope_batch, rope_ce, ROPE_STEPS, run_dir, autocast=False, before=rnd.before, after=rnd.after)
    return r, m, rnd


# (was a strict xfail, "an empty report": the bf16 positions are made inside `rotary`, never a module's input;
# record/lowcast.py probes what torch.arange makes in bf16 inside a forward)
def test_rotary_positions_in_the_bf16_inv_freq_dtype_are_precision_loss_at_rotary(tmp_path):
    r, m, _ = rope_run(tmp_path / "run", fixed=False)
    assert m.rotary.inv_freq.dtype == BF16
    assert torch.arange(ROPE_T, dtype=BF16).unique().numel() == 513         # 1024 positions, 513 values
    cos, sin = m.rotary.tables(ROPE_T, torch.float32)
    rc, rs = Rotary(32, True).tables(ROPE_T, torch.float32)
    err = torch.maximum((cos - rc).abs(), (sin - rs).abs()).amax(-1)
    assert float(err[256:].max()) > 1.0 and float(err[256:].mean()) > 0.3, err
    named(r, ("precision_loss",), {"rotary"}, severity=("warning", "error"))


def test_twin_rotary_tables_from_int64_positions_in_fp32_is_quiet(tmp_path):
    r, m, rnd = rope_run(tmp_path / "run", fixed=True)
    assert max(rnd.worst().values()) < 0.5, rnd.worst()                    # (pure bf16, but the updates land)
    cos, _ = m.rotary.tables(ROPE_T, torch.float32)
    rc, _ = Rotary(32, True).tables(ROPE_T, torch.float32)
    assert float((cos - rc).abs().max()) < 0.01
    quiet(r)


# ======================================================================================================================
# 7. AdamW eps=1e-8 on bf16 optimizer state: not a failure
# ======================================================================================================================
class Rec(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(1000, 16)
        nn.init.normal_(self.items.weight, std=0.05)
        self.tower = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids):
        return self.tower(self.items(ids)).squeeze(-1)


REC_W = randn(1000, seed=3)
REC_STEPS = 24


def rec_batch(i):
    ids = torch.randint(0, 100, (64,), generator=gen(100 + i)) + 100 * (i % 3)   # rows 0..299 only
    return ids, REC_W[ids].tanh()


def rec_mse(m, ids, y):
    return F.mse_loss(m(ids).float(), y)


def test_adamw_eps_1e8_on_bf16_state_is_no_eps_underflow(tmp_path):
    torch.manual_seed(0)
    m = Rec().to(BF16)
    start = m.items.weight.detach().clone()
    # the contrast: one AdamW step of the same model in fp16, where eps == 0 and the untouched rows get 0 / 0
    h = copy.deepcopy(m).half()
    o16 = torch.optim.AdamW(h.parameters(), lr=1e-2, eps=1e-8)
    rec_mse(h, *rec_batch(0)).backward()
    o16.step()
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0 and bool(h.items.weight[500:].isnan().all())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-8)
    rnd = Rounding(m)
    r = run(m, opt, rec_batch, rec_mse, REC_STEPS, tmp_path / "run", autocast=False, before=rnd.before,
            after=rnd.after)
    st = opt.state[m.items.weight]
    assert torch.tensor(1e-8, dtype=BF16).item() > 0.9e-8 and st["exp_avg_sq"].dtype == BF16
    untouched = (st["exp_avg_sq"] == 0).all(1)
    assert bool(untouched[300:].all()) and int(untouched[:300].sum()) < 10   # v == 0 on the rows no batch touched
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())
    # ... decayed by AdamW's weight decay alone (w * (1 - lr * wd) rounds away in bf16: they stay as they were)
    assert torch.equal(m.items.weight[300:], start[300:])
    assert max(rnd.worst().values()) < 0.5, rnd.worst()                    # the updates land
    assert not [f for f in r["rep"].findings if f.rule == "eps_underflow"], lines(r["rep"])
    quiet(r, fall=0.5)


# ======================================================================================================================
# 8. an online forecaster whose bf16 day index passes 256 mid-run
# ======================================================================================================================
class Seasonal(nn.Module):
    """Day-of-week and day-of-year Fourier features of the day index, in the index's dtype."""

    def forward(self, day):
        dow = torch.remainder(day, 7.0) / 7.0           # exact for an integer day held exactly
        doy = torch.remainder(day, 365.25) / 365.25
        ph = 2 * math.pi * torch.stack([dow, doy], -1)
        return torch.cat([ph.sin(), ph.cos()], -1)


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.seasonal, self.lags = Seasonal(), nn.Linear(8, 32)
        self.mix = nn.Sequential(nn.Linear(36, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, lags, day):
        h = self.lags(lags)
        return self.mix(torch.cat([h, self.seasonal(day).to(h.dtype)], -1)).squeeze(-1)


FC_START, FC_STEPS = 200, 64


def fc_raw(i, B=64):
    """Step i's window: the last 32 days of the stream (days FC_START + i .. + 31), fp32."""
    g = gen(100 + i)
    day = FC_START + i + torch.randint(0, 32, (B,), generator=g).float()
    lags = 0.1 * torch.randn(B, 8, generator=g)
    return lags, day, 2 * torch.sin(2 * math.pi * day / 7) + 0.5 * torch.sin(2 * math.pi * day / 365.25) + lags.sum(-1)


def fc_batch(i, fixed=False):
    lags, day, y = fc_raw(i)
    return lags.to(BF16), (day if fixed else day.to(BF16)), y      # the collate: everything to the model's dtype


def fc_mse(m, lags, day, y):
    return F.mse_loss(m(lags, day).float(), y)


def fc_run(run_dir, fixed, watch=True):
    torch.manual_seed(0)
    m = Forecaster().to(BF16)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return run(m, opt, lambda i: fc_batch(i, fixed), fc_mse, FC_STEPS, run_dir, autocast=False, watch=watch)


def fc_onset():
    """The first step whose bf16 days hold fewer distinct values than its days."""
    return next(i for i in range(FC_STEPS) if fc_raw(i)[1].to(BF16).unique().numel() < fc_raw(i)[1].unique().numel())


def test_online_forecaster_bf16_day_index_past_256_is_precision_loss_at_seasonal(tmp_path):
    onset = fc_onset()
    assert 24 <= onset <= 30, onset
    sea = Seasonal()
    for i in (0, onset - 1):          # before it the features are bf16's rounding of fp32's
        d = fc_raw(i)[1]
        assert float((sea(d.to(BF16)).float() - sea(d)).abs().max()) < 0.05, i
    d = fc_raw(FC_STEPS - 1)[1]
    assert float((sea(d.to(BF16)).float() - sea(d)).abs().max()) > 0.5          # a day-of-week off by a day
    r = fc_run(tmp_path / "run", fixed=False)
    ref = fc_run(tmp_path / "ref", fixed=True, watch=False)
    ls, rs = r["losses"], ref["losses"]
    assert min(ls[-6:]) > 1.2 * min(ls), ls                                   # the loss turns back up
    assert sum(ls[-8:]) > 10 * sum(rs[-8:]), (ls[-8:], rs[-8:])
    named(r, ("precision_loss",), {"seasonal"}, steps=range(onset, onset + 12), severity=("warning", "error"))


def test_twin_forecaster_with_an_fp32_day_index_is_quiet(tmp_path):
    r = fc_run(tmp_path / "run", fixed=True)
    quiet(r, fall=0.1)
