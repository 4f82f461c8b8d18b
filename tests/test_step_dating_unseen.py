"""THE RIGHT STEP: fp16 failures in loops whose optimizer-step count is easy to get wrong.

CONTRACT.md: a finding's `step` is "the optimizer step (0-based)". Each case below is a real training-loop shape in
which the loop's iteration, the number of forwards seen, or the micro-batch index differ from the optimizer step:
variable accumulation, evaluation forwards between steps, a loss-spike guard that throws whole iterations away, a
skip of GradScaler's right before the failure, two forwards per step, a failure just past the default sampled step
200. Every case runs under `ampdoctor.watch(model, optimizer=AdamW, scaler=GradScaler("cpu"), run_dir=...)` at the
default settings, read back through `w.report()`.

How the steps are counted here (my reading of CONTRACT.md and README): a step is closed by the optimizer step or
the scaler's update ("A watch finds step boundaries by itself (optimizer step / scaler update)"), so an iteration
whose `scaler.step` GradScaler skipped (found_inf) IS a step of its own (every probe file counts the opening
backoffs of steps 0-2 so); an iteration that calls neither the optimizer nor the scaler (a loop-level guard that
`continue`s before the backward) is NOT a step: its forward belongs to the step that comes ("an iteration it skips
calls no optimizer step, so it joins the next step's record (steps are optimizer steps, as fairseq's `num_updates`
counts them)", README, said there of a loop's own loss scaler; the same count holds for any loop that throws an
iteration away). Micro-batches and eval forwards are never steps.

The runner (`run_loop`) gives each case's loop three calls: `r.fwd(fn, *args)` (one fp16 CPU autocast forward,
`no_grad=True` for an eval forward), `r.bwd(loss)` (`scaler.scale(loss).backward()`), `r.update()` (unscale_ ->
clip_grad_norm_(1.0) -> scaler.step -> scaler.update), and counts optimizer steps in `r.step` by those updates
alone. The ORACLE runs on the UNWATCHED run (no ampdoctor hooks there): probe_harness.Producer (keyword inputs
checked, calls counted per step from 1; its `step` kept at `r.step`) names the first module whose output is
non-finite while its inputs and own weights were finite, with the step and its call within the step; an optimizer
step post-hook counts the real `optimizer.step()` calls, and steps == applied + skipped is asserted (the count is
the optimizer's); the forward that first returned a non-finite loss is re-run in float32 (no autocast, the weights
and RNG state it ran with): finite (fp16's doing). The watched run must give bitwise the same losses (watching
changes nothing). Only then is the report judged: overflow/nan_origin, an `error`, at the PRODUCER module, at that
optimizer step, among the first three findings, and no such error at that step at a module that only passed the
value on (probe_harness.producer_top3); otherwise WrongAnswer (a strict xfail via `wrong(...)`). Each case has a
healthy twin (the fix applied): genuinely healthy (finite, loss falling, no skip but the opening backoffs or the
case's own benign one), bitwise the same watched and unwatched (losses and weights), no ampdoctor RuntimeWarning,
and a report without warning or error.

Cases:
 1. token-budget accumulation (ASR / fairseq-style "accumulate micro-batches until the step holds BUDGET frames",
    one utterance per micro-batch, loss = summed CE / the step's frames; utterances of 8-110 frames): the steps
    hold 3, 2, 5, 4, 3, 3, 4, 3, 7 micro-batches. In step 6 (global micro-batch 23), micro-batch 4 of 4 is an
    utterance whose features are the POWER spectrogram (exp of the log-mel, x2e4: the log was forgotten for one
    shard) -> overflow at `inp` (its fp16 cast), step 6 (not 23, not 23 // 4 = 5). Fix: the log (re-extracted).
 2. evaluation between steps (a Lightning-style loop: 2 sanity-validation batches before step 0, then a validation
    pass of 3 batches, `model.eval()` + no_grad + autocast, after every 5th step): a DLRM-style CTR model whose
    training batch of step 10, right after the validation that followed step 9, has one row's impression count
    raw (3e5) instead of log1p -> overflow at `bot.0`, step 10 (its 4th call in that step: 3 eval forwards came
    first). Fix: log1p on every shard.
 3. just past the sampled step: a station-temperature forecaster, 204 steps (step 200 is the default watch's
    routinely sampled step); at step 201 one station's missing reading is the archive's sentinel -99999 (not
    masked) -> overflow at `inp`, step 201 (not 200, not 202+). Fix: mask the sentinel (fill with the mean).
 4. a loss-spike guard (`if not isfinite(loss) or loss > 3 * ema: continue` before the backward: no backward, no
    optimizer step, no scaler call; OLMo/PaLM-style "skip the batch"): iteration 7 is a batch from a depth camera
    set to decimetres (finite, loss x10 -> the guard throws it away); at iteration 13 a depth image's invalid
    returns carry the driver's 65535 code (not masked) -> fp16 cast inf at `patch`; the guard throws that
    iteration away too. 12 optimizer steps were done before it (0-6, 7-11): overflow at `patch`, step 12 (not 13).
    Fix: mask the invalid returns (set 0).
 5. the step right after a GradScaler skip: a regressor with GradScaler(growth_interval=10); after its opening
    search the scale grows and the next step's scaled backward overflows (a finite forward, the gradients finite at
    scale 1: asserted) -> skipped, the scale halves: benign, GradScaler by design; the VERY NEXT step's batch holds
    a Reynolds-number feature unnormalised (4e6) -> overflow at `inp`, that step (not the skip before it).
    Fix: the feature normalised (the benign skip stays in the twin).
 6. R-Drop (two forwards of the same batch per optimizer step with different dropout masks, CE of both + KL
    between them; one backward): a tabular text classifier with input feature dropout (p=0.5, kept values x2); at
    step 16 one row's `helpful_votes` is a raw count of 41000 (finite in fp16): the first forward's mask drops it,
    the second keeps it (x2 = 82000) -> overflow at `inp`, its 2nd call of step 16 (the oracle asserts the call;
    the step was chosen where torch's RNG under seed 0 gives that pair of masks). Fix: log1p on the count.
Also: `test_plan_is_really_variable` pins case 1's plan (at least 3 different micro-batch counts, the bad one the
4th of its step, the global micro-batch index neither the step nor index // 4).

Result when written (torch 2.13 CPU, default watch): 13 pass, 0 xfail (stable over two runs, ~23 s). ampdoctor's
first finding in each failing run (the second is `[error] skipped_steps` at the same step in cases 1, 2, 3, 5, 6):
 1. `[error] overflow at inp aten::_to_copy step 6: aten::_to_copy in `inp` produced +inf from finite inputs`.
 2. `[error] overflow at bot.0 aten::_to_copy step 10` (propagates to aten::addmm in `top.0`).
 3. `[error] overflow at inp aten::_to_copy step 201: ... produced -inf from finite inputs`.
 4. `[error] overflow at patch aten::_to_copy step 12` (the optimizer step, not the iteration 13; then the opening
    backoff's `[info] overflow at head step 0` and `[info] skipped_steps`; no scaler skip at step 12: the guard
    threw the iteration away).
 5. `[error] overflow at inp aten::_to_copy step 29` (then `[error] skipped_steps at inp step 29`: 3 of 32 skipped,
    "on 1 of them the forward pass itself was non-finite"); the benign skip at 28 is not blamed.
 6. `[error] overflow at inp aten::_to_copy step 16` (the 2nd forward of the step).
The twins' reports hold only info findings (4: the opening backoffs of steps 0-1; 5: `[info] skipped_steps step 8`,
"2 of 35 ... a normal rate"), and every twin is bitwise the same watched and unwatched.
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
from probe_harness import Producer, WrongAnswer, finite, producer_top3, same_bits
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FWD = ("overflow", "nan_origin")
DEBUG = False


# ======================================================================================================================
# the runner and the checks
# ======================================================================================================================
class Loop:
    """What a case's loop drives: fwd / bwd / update, the optimizer-step count `step`, and (unwatched) the oracle."""

    def __init__(self, m, opt, sc, oracle):
        self.m, self.opt, self.sc = m, opt, sc
        self.step, self.fwd_in_step = 0, 0
        self.losses, self.bad, self.skipped, self.applied = [], [], [], 0
        self.fp32, self.unscaled_ok, self.last, self.thrown = None, {}, None, []
        self.prod = Producer(m, with_kwargs=True, call_in_first=True) if oracle else None
        self.hook = opt.register_step_post_hook(self._applied) if oracle else None

    def _applied(self, *a):
        self.applied += 1

    def fwd(self, fn, *args, no_grad=False):
        """fn(model, *args) -> a scalar loss, under fp16 CPU autocast (and no_grad for an eval forward)."""
        if self.prod is not None:
            self.prod.step = self.step
            self.last = (copy.deepcopy(self.m), torch.get_rng_state(), fn, args, no_grad)
        with torch.no_grad() if no_grad else torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = fn(self.m, *args)
        v = loss.item()
        self.losses.append(v)
        if not math.isfinite(v):
            self.bad.append((self.step, self.fwd_in_step))
            if self.prod is not None and self.fp32 is None:
                self.fp32 = self._rerun(fp16=False)
        self.fwd_in_step += 1
        return loss

    def _rerun(self, fp16, backward=False):
        """The last forward again on a copy of the weights it ran with and its RNG state: (the loss, [grads])."""
        mc, rng, fn, args, _ = self.last
        mc = copy.deepcopy(mc)
        with torch.random.fork_rng():
            torch.set_rng_state(rng)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = fn(mc, *args)
            grads = None
            if backward:
                loss.backward()
                grads = [p.grad for p in mc.parameters() if p.grad is not None]
        return loss.item(), grads

    def bwd(self, loss):
        self.sc.scale(loss).backward()

    def update(self):
        s0 = self.sc.get_scale()
        self.sc.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.m.parameters(), 1.0)
        self.sc.step(self.opt)
        self.sc.update()
        if self.sc.get_scale() < s0:
            self.skipped.append(self.step)
            if self.prod is not None and self.fwd_in_step == 1:
                # the step's one forward + backward at loss scale 1: are its gradients finite?
                loss, grads = self._rerun(fp16=True, backward=True)
                self.unscaled_ok[self.step] = math.isfinite(loss) and finite(grads)
        self.step += 1
        self.fwd_in_step = 0


def run_loop(case, run_dir, *, watched, fix=False):
    """One run of `case`: make() -> AdamW(lr) + GradScaler("cpu", **scaler) -> case["loop"](r, fix) (watched: under
    ampdoctor.watch at the default settings, closed and reported; unwatched: the oracle on). Returns the Loop, with
    `rep`, `warns` (ampdoctor's RuntimeWarnings), `first` (the oracle's), `weights`."""
    torch.manual_seed(0)
    m = case["make"]()
    opt = torch.optim.AdamW(m.parameters(), lr=case.get("lr", 1e-3))
    sc = torch.amp.GradScaler("cpu", **case.get("scaler", {}))
    r = Loop(m, opt, sc, oracle=not watched)
    r.rep = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) if watched else None
        case["loop"](r, fix)
        if w is not None:
            w.close()
            r.rep = w.report()
    r.warns = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
               and str(x.message).startswith("ampdoctor")]
    r.first = None
    if r.prod is not None:
        r.prod.remove()
        r.hook.remove()
        r.first = r.prod.first
        assert r.applied + len(r.skipped) == r.step, (r.applied, r.skipped, r.step)
    r.weights = {k: v.detach().clone() for k, v in m.state_dict().items()}
    if DEBUG:
        print(case["name"], "fix" if fix else "", "watched" if watched else "oracle", "first", r.first, "bad",
              r.bad[:3], "skipped", r.skipped[:8], "steps", r.step, "unscaled_ok", r.unscaled_ok)
        if r.rep is not None:
            print("\n".join(lines(r.rep)[:5]))
    return r


def named_at_step(case, tmp_path):
    """The failure, proven by the oracle on the unwatched run, then judged in the watched run's report."""
    name, step, call = case["want"]
    u = run_loop(case, tmp_path / "plain", watched=False)
    w = run_loop(case, tmp_path / "run", watched=True)
    assert same_bits(w.losses, u.losses), "watching changed the losses"
    assert u.first == (name, step, call), u.first
    assert u.bad and u.bad[0] == (step, case["fwd"]), u.bad[:3]
    assert u.fp32 is not None and math.isfinite(u.fp32[0]), u.fp32
    # before the failure only the opening backoffs (steps 0-2) and the case's own benign skip
    benign = case.get("benign", ())
    assert all(s < 3 or s in benign for s in u.skipped if s < step), u.skipped
    for s in benign:
        assert s in u.skipped and u.unscaled_ok.get(s) is True, (u.skipped, u.unscaled_ok)
    assert (step in u.skipped) == case.get("skips", True), u.skipped
    if "check" in case:
        case["check"](u, False)
    rep = w.rep
    f = producer_top3(rep, FWD, name, step)
    if f.severity != "error":
        raise WrongAnswer(f"not an error: {f.one_line()}; top 3: {lines(rep)[:3]}")


def twin_quiet(case, tmp_path):
    """The fix applied: healthy, watching changes nothing, the report quiet (else WrongAnswer)."""
    u = run_loop(case, tmp_path / "plain", watched=False, fix=True)
    w = run_loop(case, tmp_path / "run", watched=True, fix=True)
    assert same_bits(w.losses, u.losses), "watching changed the losses"
    assert w.skipped == u.skipped
    for k, v in u.weights.items():
        assert torch.equal(w.weights[k], v), k
    ls = [v for v in u.losses if math.isfinite(v)]
    assert len(ls) == len(u.losses) and u.first is None, (u.bad, u.first)
    benign = case.get("benign", ())
    assert all(s < 3 or s in benign for s in u.skipped), u.skipped
    for s in benign:
        assert s in u.skipped and u.unscaled_ok.get(s) is True, (u.skipped, u.unscaled_ok)
    if "check" in case:
        case["check"](u, True)
    train = case.get("train_losses", lambda r: r.losses)(u)
    k = max(3, len(train) // 5)
    assert sum(train[-k:]) / k < 0.95 * sum(train[:k]) / k, train
    if w.warns:
        raise WrongAnswer(f"ampdoctor warned on a healthy twin: {w.warns}")
    if alarms(w.rep.findings) or w.rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy twin: {lines(w.rep)[:4]}")


# ======================================================================================================================
# 1. token-budget accumulation: a variable number of micro-batches per optimizer step
# ======================================================================================================================
class FrameTagger(nn.Module):
    """Per-frame classifier over log-mel features (a CTC-free toy ASR head); returns the summed CE."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(20, 32)
        self.enc = nn.Sequential(nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.out = nn.Linear(32, 6)

    def forward(self, feats, labels):
        return F.cross_entropy(self.out(self.enc(self.inp(feats))).float(), labels, reduction="sum")


BUDGET = 120
W_LAB = torch.randn(20, 6, generator=gen(77))


def budget_plan(n_utts=200):
    """Utterance lengths (8-110 frames, log-uniform: short commands and long sentences) packed into optimizer steps
    of at least BUDGET frames: [[len, ...], ...]."""
    lens = torch.empty(n_utts).uniform_(math.log(8), math.log(110), generator=gen(5)).exp().long().tolist()
    plan, cur = [], []
    for n in lens:
        cur.append(n)
        if sum(cur) >= BUDGET:
            plan.append(cur)
            cur = []
    return plan


PLAN = budget_plan()
TB_STEP, TB_MICRO = 6, 3                        # the 4th micro-batch of optimizer step 6


def utterance(u, n, power=False):
    f = torch.randn(n, 20, generator=gen(1000 + u))
    y = (f @ W_LAB).argmax(-1)
    return (f.exp() * 2e4 if power else f), y   # the shard whose log was forgotten: power, not log-power


def token_budget_loop(r, fix):
    u = 0
    for s, lens in enumerate(PLAN[:TB_STEP + 3]):
        r.opt.zero_grad()
        frames = sum(lens)
        for k, n in enumerate(lens):
            x, y = utterance(u, n, power=not fix and (s, k) == (TB_STEP, TB_MICRO))
            u += 1
            loss = r.fwd(lambda m, x, y: m(x, y) / frames, x, y)
            r.bwd(loss)
        r.update()


TOKEN_BUDGET = dict(name="token_budget", make=FrameTagger, loop=token_budget_loop, want=("inp", TB_STEP, TB_MICRO + 1),
                    fwd=TB_MICRO, lr=3e-3)


def test_plan_is_really_variable():
    counts = [len(x) for x in PLAN[:TB_STEP + 3]]
    assert len(set(counts)) >= 3 and counts[TB_STEP] == TB_MICRO + 1, counts
    g = sum(counts[:TB_STEP]) + TB_MICRO
    assert g != TB_STEP and g // 4 != TB_STEP, (counts, g)


def test_token_budget_bad_last_micro_batch(tmp_path):
    named_at_step(TOKEN_BUDGET, tmp_path)


def test_token_budget_twin_quiet(tmp_path):
    twin_quiet(TOKEN_BUDGET, tmp_path)


# ======================================================================================================================
# 2. validation forwards between training steps (sanity validation before step 0, then every 5th step)
# ======================================================================================================================
class TinyDLRM(nn.Module):
    """DLRM-style CTR model: dense features -> bottom MLP, sparse ids -> EmbeddingBag, concat -> top MLP -> BCE."""

    def __init__(self):
        super().__init__()
        self.bot = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.emb = nn.EmbeddingBag(50, 16, mode="mean")
        self.top = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))

    def forward(self, dense, ids, y):
        z = torch.cat([self.bot(dense), self.emb(ids)], -1)
        return F.binary_cross_entropy_with_logits(self.top(z).float().squeeze(-1), y)


EV_BAD = 10                                     # right after the validation that follows step 9


def ctr_batch(seed, raw_row=False):
    g = gen(seed)
    counts = torch.empty(32, 8).uniform_(0, 8, generator=g).exp()      # impressions, clicks, dwell... (counts)
    ids = torch.randint(0, 50, (32, 4), generator=g)
    y = ((counts.log1p()[:, 0] - counts.log1p()[:, 3] + (ids[:, 0] % 3 == 0) * 2.0) > 1.0).float()
    dense = counts.log1p()
    if raw_row:
        dense[5, 2] = 3.1e5                     # one shard's impressions left as the raw count
    return dense, ids, y


def ctr_loss(m, dense, ids, y):
    return m(dense, ids, y)


def validate(r, n):
    r.m.eval()
    for v in range(n):
        r.fwd(ctr_loss, *ctr_batch(10_000 + v), no_grad=True)
    r.m.train()


def eval_between_loop(r, fix):
    validate(r, 2)                              # Lightning's num_sanity_val_steps=2
    for i in range(EV_BAD + 3):
        r.opt.zero_grad()
        loss = r.fwd(ctr_loss, *ctr_batch(i % 8, raw_row=not fix and i == EV_BAD))
        r.bwd(loss)
        r.update()
        if (i + 1) % 5 == 0:
            validate(r, 3)


EVAL_BETWEEN = dict(name="eval_between", make=TinyDLRM, loop=eval_between_loop, want=("bot.0", EV_BAD, 4), fwd=3,
                    lr=3e-3, train_losses=lambda r: [r.losses[2 + i + 3 * (i // 5)] for i in range(EV_BAD + 3)])


def test_eval_between_steps_bad_batch_after_validation(tmp_path):
    named_at_step(EVAL_BETWEEN, tmp_path)


def test_eval_between_steps_twin_quiet(tmp_path):
    twin_quiet(EVAL_BETWEEN, tmp_path)


# ======================================================================================================================
# 3. a failure at step 201, just past the default watch's routinely sampled step 200
# ======================================================================================================================
class Forecaster(nn.Module):
    """24 past readings (4 stations x 6 hours) -> the next 4 readings; MSE."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(24, 32)
        self.mid = nn.Sequential(nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.mid(self.inp(x))).float(), y)


LATE_BAD = 201


def weather_batch(i, sentinel=False):
    g = gen(i % 16)
    t0 = torch.rand(16, 1, generator=g) * 100
    hours = t0 + torch.arange(7.0)
    phase = torch.rand(16, 4, 1, generator=g) * 6.28
    series = torch.sin(hours[:, None, :] / 4 + phase) + 0.05 * torch.randn(16, 4, 7, generator=g)
    x, y = series[..., :6].reshape(16, 24).clone(), series[..., 6]
    if sentinel:
        x[3, 7] = -99999.0                      # station 2's missing hour: the archive's sentinel, not masked
    return x, y


def late_loop(r, fix):
    for i in range(LATE_BAD + 3):
        r.opt.zero_grad()
        loss = r.fwd(lambda m, x, y: m(x, y), *weather_batch(i, sentinel=not fix and i == LATE_BAD))
        r.bwd(loss)
        r.update()


LATE = dict(name="late", make=Forecaster, loop=late_loop, want=("inp", LATE_BAD, 1), fwd=0)


def test_failure_at_step_201_after_sampled_200(tmp_path):
    named_at_step(LATE, tmp_path)


def test_failure_at_step_201_twin_quiet(tmp_path):
    twin_quiet(LATE, tmp_path)


# ======================================================================================================================
# 4. a loss-spike guard throws whole iterations away (no backward, no optimizer step, no scaler call)
# ======================================================================================================================
class DepthPatchNet(nn.Module):
    """A ViT-style patch embedding over 16x16 depth images (metres) -> mean pool -> 3 classes (near/mid/far)."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(16, 32)
        self.blk = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 3)

    def forward(self, img, y):
        p = img.unfold(1, 4, 4).unfold(2, 4, 4).reshape(img.shape[0], 16, 16)
        h = self.patch(p)
        return F.cross_entropy(self.head((h + self.blk(h)).mean(1)).float(), y)


GUARD_SPIKE, GUARD_BAD = 7, 13                  # iterations; the bad one runs in optimizer step 12


def depth_batch(i, decimetres=False, invalid=False):
    g = gen(i % 6)
    y = torch.randint(0, 3, (24,), generator=g)
    img = (1.0 + 2.5 * y[:, None, None] + 0.6 * torch.randn(24, 16, 16, generator=g)).clamp_min(0.2)
    if decimetres:
        img = img * 10                          # a camera configured for decimetres: finite, the loss spikes
    if invalid:
        img[2, 4:8, 4:8] = 65535.0              # the driver's "no return" code, not masked to 0
    return img, y


def guard_loop(r, fix):
    ema = None
    for i in range(GUARD_BAD + 4):
        r.opt.zero_grad()
        loss = r.fwd(lambda m, x, y: m(x, y), *depth_batch(i, decimetres=i == GUARD_SPIKE,
                                                            invalid=not fix and i == GUARD_BAD))
        v = loss.item()
        if not math.isfinite(v) or (ema is not None and i >= 3 and v > 3 * ema):
            r.thrown.append(i)
            continue                            # "skip the batch": no backward, no step, no scaler call
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        r.bwd(loss)
        r.update()


def guard_check(u, fix):
    """The guard threw away the spike (and the bad iteration): the bad forward ran after 12 optimizer steps."""
    assert u.thrown == ([GUARD_SPIKE] if fix else [GUARD_SPIKE, GUARD_BAD]), u.thrown


GUARD = dict(name="guard", make=DepthPatchNet, loop=guard_loop, want=("patch", GUARD_BAD - 1, 1), fwd=0, skips=False,
             lr=3e-3, check=guard_check)


def test_loss_guard_thrown_away_iterations_count_optimizer_steps(tmp_path):
    named_at_step(GUARD, tmp_path)


def test_loss_guard_twin_quiet(tmp_path):
    twin_quiet(GUARD, tmp_path)


# ======================================================================================================================
# 5. the step right after a benign GradScaler skip (the scale's sawtooth: grown, overflowed, halved)
# ======================================================================================================================
class FlowRegressor(nn.Module):
    """8 flow descriptors (normalised) -> a drag coefficient; MSE."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.mid = nn.Sequential(nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.out = nn.Linear(32, 1)

    def forward(self, x, y):
        return F.mse_loss(self.out(self.mid(self.inp(x))).float().squeeze(-1), y)


W_FLOW = torch.randn(8, generator=gen(3))
SAW_SKIPS, SAW_BAD = (8, 28), 29               # GradScaler's own skips (the 2nd right after the scale grew back)


def flow_batch(i, raw_re=False):
    g = gen(i % 10)
    x = torch.randn(64, 8, generator=g)
    y = x @ W_FLOW
    if raw_re:
        x = x.clone()
        x[11, 0] = 4.2e6                        # one case's Reynolds number not normalised (log10 / std)
    return x, y


def sawtooth_loop(r, fix):
    for i in range(SAW_BAD + 3 + (3 if fix else 0)):
        r.opt.zero_grad()
        loss = r.fwd(lambda m, x, y: m(x, y), *flow_batch(i, raw_re=not fix and i == SAW_BAD))
        r.bwd(loss)
        r.update()


SAWTOOTH = dict(name="sawtooth", make=FlowRegressor, loop=sawtooth_loop, want=("inp", SAW_BAD, 1), fwd=0,
                benign=SAW_SKIPS, scaler=dict(init_scale=2.0 ** 16, growth_interval=10))


def test_failure_right_after_a_benign_scaler_skip(tmp_path):
    named_at_step(SAWTOOTH, tmp_path)


def test_failure_right_after_a_benign_scaler_skip_twin_quiet(tmp_path):
    twin_quiet(SAWTOOTH, tmp_path)


# ======================================================================================================================
# 6. R-Drop: two forwards of the same batch per optimizer step (different dropout masks), one backward
# ======================================================================================================================
class ReviewClassifier(nn.Module):
    """12 review features (TF-IDF summaries, log counts) -> feature dropout -> MLP -> 4 ratings."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.inp = nn.Linear(12, 32)
        self.mid = nn.Sequential(nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.mid(self.inp(self.drop(x)))).float()


W_REV = torch.randn(12, 4, generator=gen(21))
RD_BAD = 16                                     # the first mask drops the bad value, the second keeps it


def review_batch(i, raw_votes=False):
    g = gen(i % 8)
    x = torch.randn(32, 12, generator=g)
    y = (x @ W_REV).argmax(-1)
    if raw_votes:
        x = x.clone()
        x[7, 5] = 41000.0                       # `helpful_votes` as the raw count (finite in fp16; x2 is not)
    return x, y


def rdrop_loss(m, x, y):
    return F.cross_entropy(m(x), y)


def rdrop_loop(r, fix):
    for i in range(RD_BAD + 3):
        r.opt.zero_grad()
        x, y = review_batch(i, raw_votes=not fix and i == RD_BAD)
        keep = {}

        def one(m, x, y, k):
            logits = m(x)
            keep[k] = logits
            return F.cross_entropy(logits, y)
        l1 = r.fwd(lambda m, x, y: one(m, x, y, 1), x, y)
        l2 = r.fwd(lambda m, x, y: one(m, x, y, 2), x, y)
        p1, p2 = keep[1].log_softmax(-1), keep[2].log_softmax(-1)
        kl = 0.5 * (F.kl_div(p1, p2, log_target=True, reduction="batchmean")
                    + F.kl_div(p2, p1, log_target=True, reduction="batchmean"))
        r.bwd((l1 + l2) / 2 + 0.5 * kl)
        r.update()


RDROP = dict(name="rdrop", make=ReviewClassifier, loop=rdrop_loop, want=("inp", RD_BAD, 2), fwd=1, lr=3e-3)


def test_rdrop_second_forward_overflows(tmp_path):
    named_at_step(RDROP, tmp_path)


def test_rdrop_twin_quiet(tmp_path):
    twin_quiet(RDROP, tmp_path)
