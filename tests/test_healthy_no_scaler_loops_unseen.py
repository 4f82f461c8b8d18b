"""HEALTHY LOOPS WITHOUT A torch GradScaler (scaler=None: bf16, fp32, or a loss scale the loop keeps itself), written
to walk the paths a watch takes for such loops since the thirty-seventh session: a zero_grad that clears inf/NaN
gradients in an open step with no optimizer step is a thrown-away iteration (record/optsink.discards_iteration),
counted on the step that comes (steps are optimizer steps; for a while that session they were numbered by iteration,
record/step.StepMachine._next_number, since removed: CONTRACT.md's `step`), and rules/ownscale.py
reports `skipped_steps` when such a loop throws away >= 25% (at least 5) of its iterations after its first update.
A mixed-precision debugger must stay silent on every healthy loop here; three loops that really do throw away a
large share of their iterations must be named. Tiny models, fixed seeds (the global RNG seeded where the loop draws
from it), one intra-op thread, 40-120 iterations each; `ampdoctor.watch(model, optimizer=..., run_dir=tmp_path /
"run")` and nothing else.

Every case runs twice with the same seeds, unwatched and watched, each inside the same `Loop` (forward hooks on
every module noting a non-finite floating output; a step pre-hook on the loop's optimizers keeping the gradients
every real optimizer step applies; a warnings recorder). The test's own oracle first (a failure there is a plain
failure: this file's bug): every loss finite but those of the batches the loop guards against by design (NaN labels);
no module output non-finite; the loop's own skips exactly the ones its own bookkeeping explains (the guarded batches;
an own scaler's opening search, before its first update or within the first OPENING iterations, and after it only
isolated probes at the edge: at a scale no lower than the iteration before's, finite loss, at most two in a row);
the optimizer stepped; the loss (or the case's metric) fell; every final weight finite. Then (`same`) the watched run
trained bitwise identically to the unwatched one: every loss (NaN == NaN on a guarded batch), every skip, every
applied gradient, the extras (scales, eval losses, metrics) and the final state_dict. Then (`judge`) w.report() after
close() and ampdoctor.diagnose(run_dir) hold no warning or error, exit code 0, no `ampdoctor...` Python warning. A
false alarm or a bitwise break is a strict xfail (probe_harness.wrong: WrongAnswer only) quoting what ampdoctor said.

Healthy loops:
 1. bf16_eval_between_steps     LayerNorm MLP under bf16 autocast, AdamW + clip 1.0; every 5 iterations model.eval()
                                + no_grad + autocast on a held-out batch, then model.train(). 50 iterations.
 2. fp32_sgd_zero_at_end        fp32, SGD (momentum 0.9, nesterov) + StepLR, zero_grad(set_to_none=False) at the END
                                of each iteration only (the first step starts with no gradients). 40 iterations.
 3. nan_guard_before_backward   bf16; batches 9, 23, 41 carry a NaN label (a missing value); `if not
                                torch.isfinite(loss): optimizer.zero_grad(); continue` BEFORE backward. 60 iterations.
 4. nan_guard_after_backward    bf16; 6 of 80 batches (7, 19, 33, 48, 60, 71) carry a NaN label; backward, then the
                                clip norm is the check: non-finite -> optimizer.zero_grad(); continue. 6 thrown-away
                                iterations (>= 5) but 8% of the run: healthy data handling, not >= 25%.
 5. fairseq_scaler_window_8     fairseq's DynamicLossScaler (init 2**16, tolerance 0) with its default window
                                2**14 / (world size 128 x update_freq 16) = 8, on an fp32 LayerNorm MLP under fp16
                                autocast, summed CE, grads x 1 / (scale x bsz), clip norm as the overflow check,
                                OverflowError -> zero_grad; the opening search (0, 1, 2, 5) and then 6 isolated
                                probes at 2**14 (>= 5 after the first update, ~5% of 120 iterations).
 6. megatron_2pow24_hysteresis  Megatron-style fp16 model (model.half()) + fp32 main params, DynamicGradScaler
                                (initial 2**24, min 1, loss-scale window 32, hysteresis 2), found_inf by
                                torch._amp_foreach_non_finite_check_and_unscale_, `continue` on overflow (zero_grad
                                at the top): opening search 0-6, growth probes at 72 and 75. 80 iterations.
 7. megatron_run_ends_on_a_probe case 6 stopped at max_steps 73: its last iteration is the growth probe at 72.
 8. apex_static_scale_masters   apex FP16_Optimizer (static_loss_scale 2**10): fp16 model with LayerNorm, fp32 masters
                                (Adam), grads copied and divided by hand, clip_master_grads 1.0, masters copied back.
                                40 iterations.
 9. pgd_adversarial_bf16        Madry PGD (3 steps, eps 0.1, alpha 0.04) under bf16: each attack step backward on the
                                input, model.zero_grad() between (finite gradients cleared mid-step), then
                                optimizer.zero_grad() and the training backward on the adversarial batch. 40 iterations.
10. pcgrad_two_tasks_bf16       a shared trunk with a regression and a classification head; per task zero_grad +
                                backward(retain_graph=True) + the grads kept, PCGrad's projection of conflicting
                                gradients, p.grad assigned, step. 40 iterations.
11. grad_accum_zero_after_step  fp32, accumulation 4 (loss / 4), zero_grad only after each step (and once before the
                                loop). 64 micro-batches, 16 updates.
12. double_zero_grad            bf16; `model.zero_grad(); optimizer.zero_grad()` at the top of each iteration. 40
                                iterations.
13. gan_bf16_two_optimizers     a conditional GAN under bf16: the discriminator's zero_grad / backward / step on
                                detached fakes, then the generator's (adversarial + 10 x L1); the watch gets a
                                ModuleDict of both and opt_g; the L1 term must fall. 40 iterations.
14. rl_skip_empty_advantage     REINFORCE on a contextual bandit under bf16: actions sampled (a seeded generator),
                                advantage = reward - batch mean; where every reward in the batch is equal (no
                                advantage) the loop skips backward and step (`continue` after the forward); the
                                policy's NLL of the best action must fall. 60 iterations.

Loops that SHOULD be named (`skipped_steps`, warning or error, at the first iteration thrown away after the first
update, among the first three findings of w.report() and of diagnose(run_dir); the oracle counts the loop's own
skips: >= 5 and >= 25% of the iterations after the first update (the last iteration's left out), and the same loop
with the fix applied under 25%):
 F1. megatron_window_1          case 6's scaler configured with loss-scale window 1 and hysteresis 1 (initial 2**16):
                                the scale doubles after every clean iteration and overflows again: 23 of 49
                                thrown away from iteration 3 (fixed: window 1000, hysteresis 2). 50 iterations.
 F2. fairseq_floor_batch_rampup fairseq's scaler with threshold_loss_scale 2**12 (the floor); a batch-size rampup
                                from 32 to 1024 rows at iteration 25 under the summed loss: the fp16 weight
                                gradients overflow at the floor, every iteration 25-49 is thrown away (fixed: no
                                floor, the scale halves past it and training goes on). Accepted steps: 5 (one
                                opening-search skip after the first update, the literal first) or 25 (the streak).
 F3. hand_scaler_window_2       a hand-written dynamic scaler (init 2**16) growing after every 2 clean iterations (a
                                window meant as 2000 typed as 2): 17 of 59 thrown away from iteration 6 (fixed:
                                window 2000, no skip). 60 iterations.

Result when written (torch 2.13 CPU, two runs of the file, the same both times): 15 pass, 2 xfail (wrong answers),
the whole file ~8-9 s (11-12 s with interpreter start), one thread.
 - 13 of the 14 healthy loops: no finding of any severity but one info, bitwise identical watched/unwatched.
   (megatron_2pow24_hysteresis: `[info] nan_origin at 5 step 0: The backward overflowed in `5` at step 0 on
   iterations the loop then threw away ... searching down from a high start`.) fairseq_scaler_window_8: summary
   thrown_away_iterations 10, no finding: the >= 5 but < 25% path stays quiet.
 - WRONG (false alarm) 7 megatron_run_ends_on_a_probe: `[error] overflow at 5 aten::mm step 72: the backward of
   AddmmBackward0 in `5` (aten::mm) overflowed float16: finite values (max |x| = 1.332e+04) gave -inf ...`, exit 1,
   a capture written. The very same probe at 72 in the 80-iteration run (case 6) is quiet; only because the run
   ends on it (the loop `continue`s, no zero_grad after it) the open step is recorded at close with its inf
   gradients (record/step.finish_open_step: _clean_open is False) and read as a failure.
 - WRONG (missed) F2 fairseq_floor_batch_rampup: no finding at all, "Healthy: no problems found in 21 step(s)",
   thrown_away_iterations 4, although iterations 25-49 were all thrown away. The step opened at 25 never reaches an
   optimizer step; fairseq's loop zeroes the gradients in its `except OverflowError`, so at close the open step's
   gradients are clean and finish_open_step drops it (with its 24 discarded iterations). Checked in scratch: the
   same loop without that zero_grad gets `[error] overflow at 5 aten::mm step 25` and `[error] skipped_steps at (run)
   step 5: The loop threw away 25 of 46 iterations ... from step 5 on` - dated at the lone opening-search skip at 5,
   not at 25 where the streak began, and without the "every iteration since then" tail wording (the record at 5
   holds one of the 25).
 - F1: `[warning] skipped_steps at (run) step 3: The loop threw away 23 of 49 iterations after its first update
   (47%)`; F3: `[warning] skipped_steps at (run) step 6: ... 17 of 59 ... (29%)`. Right.
 - Odd, not asserted: nan_guard_before_backward records 57 steps for 60 iterations: a guard before backward clears
   no inf/NaN gradients, so the skipped iteration is not counted as thrown away and the step numbers after iteration
   9 lag the loop's iterations by 1, 2, 3 (a failure after them would be dated by update count, as before the
   thirty-seventh session); likewise rl_skip_empty_advantage, 54 steps for 60 iterations (6 skips before backward).
   gan_bf16_two_optimizers counts 80 steps for 40 iterations (one per optimizer.step, two optimizers). The info on
   megatron_2pow24_hysteresis is filed under `nan_origin` though the backward made +-inf, not NaN.
Both wrong answers fixed since, the same session (record/step.finish_open_step): a loop that throws iterations away
and ends on one (its growth probe) leaves no failure at close, and an open step holding thrown-away iterations is
kept at close; rules/ownscale.py dates a run that ends in such a streak at the streak's first step (F2: `[error]
skipped_steps at (run) step 21: ... the last 25 in a row from step 21 on ...`: iteration 25 is optimizer step 21,
the loop having thrown away 4 iterations before it; steps are optimizer steps, CONTRACT.md). 17 pass.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import WrongAnswer, wrong
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16
OPENING = 8     # an own scaler's opening search may go on a few iterations past its first update, not beyond this


def rn(*shape, seed):
    return torch.randn(*shape, generator=gen(seed))


TEACH = rn(16, 4, seed=6161) * 0.5


def reg_batch(i, n=32, cycle=8):
    """A learnable regression batch: y = tanh(x) @ TEACH (`cycle` distinct batches)."""
    x = rn(n, 16, seed=600 + i % cycle)
    return x, torch.tanh(x) @ TEACH


def cls_batch(i, n=32, cycle=8):
    x = rn(n, 16, seed=800 + i % cycle)
    return x, (torch.tanh(x) @ TEACH).argmax(1)


def mlp(seed, d_in=16, h=64, d_out=4, ln=False):
    torch.manual_seed(seed)
    norm = [nn.LayerNorm(h)] if ln else []
    return nn.Sequential(nn.Linear(d_in, h), *norm, nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, d_out))


def mean(xs):
    return sum(xs) / len(xs)


# --- the session: oracle hooks + warnings recorder + (watched) ampdoctor.watch -----------------------------------

class Loop:
    """`with Loop(rd, model, optimizer=..., scaler=None) as s:` around the user's loop. `rd` None: the unwatched twin
    (the same hooks, no watch). The loop appends each iteration's loss to `s.losses` (NaN kept: a guarded batch), the
    iterations it skipped to `s.skipped`, puts what else must be identical into `s.extra` (`s.metric`: the series
    that must fall, where not the losses); `s.state` is taken from the model at exit. A step pre-hook on each
    optimizer of `grads_of` (default: the watched one) keeps the gradients every real optimizer step applies."""

    def __init__(self, rd, model, grads_of=None, **watch_kw):
        self.rd, self.model, self.kw = rd, model, watch_kw
        self.step, self.losses, self.skipped, self.extra, self.bad_out, self.grads = 0, [], [], {}, [], []
        self.metric = None
        self.grads_of = grads_of if grads_of is not None else [watch_kw["optimizer"]]
        self.rep = self.disk = self.w = None

    def __enter__(self):
        names = {mod: n for n, mod in self.model.named_modules()}

        def hook(mod, inp, out):
            outs = [out] if torch.is_tensor(out) else list(out) if isinstance(out, (tuple, list)) else []
            for t in outs:
                if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    self.bad_out.append((names[mod], self.step))
        self.hs = [mod.register_forward_hook(hook) for mod in self.model.modules()]

        def keep(o, args, kwargs):
            self.grads.append([None if p.grad is None else p.grad.detach().clone() for g in o.param_groups
                               for p in g["params"]])
        self.hs += [o.register_step_pre_hook(keep) for o in self.grads_of]
        self._wc = warnings.catch_warnings(record=True)
        self.seen = self._wc.__enter__()
        warnings.simplefilter("always")
        if self.rd is not None:
            self.w = ampdoctor.watch(self.model, run_dir=self.rd, **self.kw)
        return self

    def __exit__(self, *exc):
        for h in self.hs:
            h.remove()
        try:
            if self.w is not None:
                self.w.close()
                if exc[0] is None:
                    self.rep = self.w.report()
                    self.disk = ampdoctor.diagnose(self.rd)
        finally:
            self._wc.__exit__(*exc)
        self.warns = [str(x.message) for x in self.seen if str(x.message).startswith("ampdoctor")]
        self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return False


def healthy(s, fall=0.9, bad=(), min_steps=10):
    """The oracle (module docstring): losses finite but at the guarded batches `bad` (exactly those), no module
    output non-finite, >= `min_steps` optimizer steps, the loss (s.metric where set) fell below `fall` x its first
    quarter's mean, the final weights finite."""
    assert [i for i, v in enumerate(s.losses) if not math.isfinite(v)] == list(bad), s.losses
    assert s.bad_out == [], s.bad_out[:10]
    assert len(s.grads) >= min_steps, len(s.grads)
    ls = [v for v in (s.losses if s.metric is None else s.metric) if math.isfinite(v)]
    k = max(2, len(ls) // 4)
    assert mean(ls[-k:]) < fall * mean(ls[:k]), (mean(ls[:k]), mean(ls[-k:]), ls)
    assert all(bool(torch.isfinite(v).all()) for v in s.state.values() if v.is_floating_point())


def _eq(x, y):
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_eq(a, b) for a, b in zip(x, y))
    if torch.is_tensor(x) and torch.is_tensor(y):
        return torch.equal(x, y) or x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())
    return x == y


def same(a, b):
    """The watched run `a` and the unwatched `b` trained bitwise identically (NaN == NaN where a guarded batch's
    loss is NaN in both)."""
    bad = [(i, x, y) for i, (x, y) in enumerate(zip(a.losses, b.losses)) if not _eq(x, y)]
    assert len(a.losses) == len(b.losses) and not bad, bad[:5]
    assert a.skipped == b.skipped, (a.skipped, b.skipped)
    assert _eq(a.metric, b.metric), "metric"
    assert len(a.grads) == len(b.grads), (len(a.grads), len(b.grads))
    for i, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        for j, (x, y) in enumerate(zip(ga, gb)):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), ("grad", i, j)
    assert a.extra.keys() == b.extra.keys()
    for k in a.extra:
        assert _eq(a.extra[k], b.extra[k]), k
    assert a.state.keys() == b.state.keys()
    for k in a.state:
        assert torch.equal(a.state[k], b.state[k]), k


def judge(s):
    """ampdoctor: no warning or error in w.report() nor diagnose(run_dir), exit 0, no `ampdoctor...` warning."""
    for rep in (s.rep, s.disk):
        bad = alarms(rep.findings)
        if bad or rep.exit_code != 0 or s.warns:
            raise WrongAnswer(f"{bad} {s.warns[:2]} | all: {lines(rep)}")


def first_after_update(skipped, iters):
    """The loop's own count: the first iteration thrown away after its first update, and how many of the
    iterations after the first update it threw away (the last iteration's skip left out: no zero_grad follows it
    inside the watch), out of how many."""
    upd = next(i for i in range(iters) if i not in skipped)
    later = [i for i in skipped if upd < i < iters - 1]
    return (later[0] if later else None), len(later), iters - 1 - upd


def fires(s, steps):
    """`skipped_steps` (warning or error) at one of `steps` among the first three findings of w.report() and of
    diagnose(run_dir); else WrongAnswer."""
    for rep in (s.rep, s.disk):
        hit = next((f for f in rep.findings[:3] if f.rule == "skipped_steps" and f.severity in ("warning", "error")
                    and f.step in steps), None)
        if hit is None:
            raise WrongAnswer(f"wanted skipped_steps at step {' or '.join(map(str, steps))}; "
                              f"top 3: {lines(rep)[:3]} summary {rep.summary.get('verdict')!r}")


RUNS = {}


def case(**health):
    """Register `run_<name>(rd) -> Loop`; `health`: healthy()'s keywords, and `check` (a callable on the unwatched
    Loop: the case's own oracle for its skips; default: no skip but the guarded batches)."""
    def deco(fn):
        RUNS[fn.__name__[4:]] = (fn, health)
        return fn
    return deco


# ----------------------------------------------------------------------------- 1. bf16, eval between the steps

@case()
def run_bf16_eval_between_steps(rd):
    m = mlp(1, ln=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    xv, yv = cls_batch(0, n=128, cycle=10 ** 6)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        s.extra["eval"] = []
        for i in range(50):
            s.step = i
            x, y = cls_batch(i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.cross_entropy(m(x).float(), y)
            s.losses.append(loss.item())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            if i % 5 == 4:
                m.eval()
                with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
                    s.extra["eval"].append(F.cross_entropy(m(xv).float(), yv).item())
                m.train()
    assert s.extra["eval"][-1] < 0.9 * s.extra["eval"][0], s.extra["eval"]
    return s


# ---------------------------------------------------------------------------- 2. fp32, zero_grad at the end

@case()
def run_fp32_sgd_zero_at_end(rd):
    m = mlp(2)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        for i in range(40):
            s.step = i
            x, y = cls_batch(i)
            loss = F.cross_entropy(m(x), y)
            s.losses.append(loss.item())
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=False)
    return s


# --------------------------------------------------------------------------------- 3-4. NaN guards, data handling

NAN_BEFORE, NAN_AFTER = (9, 23, 41), (7, 19, 33, 48, 60, 71)


def nan_batch(i, bad):
    x, y = reg_batch(i)
    if i in bad:
        y = y.clone()
        y[5, 2] = float("nan")                      # a missing value in the labels
    return x, y


@case(bad=NAN_BEFORE, check=lambda s: s.skipped == list(NAN_BEFORE))
def run_nan_guard_before_backward(rd):
    m = mlp(3, ln=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        for i in range(60):
            s.step = i
            x, y = nan_batch(i, NAN_BEFORE)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.mse_loss(m(x).float(), y)
            s.losses.append(loss.item())
            if not torch.isfinite(loss):
                s.skipped.append(i)
                opt.zero_grad()
                continue
            loss.backward()
            opt.step()
    return s


@case(bad=NAN_AFTER, check=lambda s: s.skipped == list(NAN_AFTER))
def run_nan_guard_after_backward(rd):
    m = mlp(4, ln=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        for i in range(80):
            s.step = i
            x, y = nan_batch(i, NAN_AFTER)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.mse_loss(m(x).float(), y)
            s.losses.append(loss.item())
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            if not torch.isfinite(gn):
                s.skipped.append(i)
                opt.zero_grad()
                continue
            opt.step()
    return s


# ---------------------------------------------------------------------- 5. fairseq DynamicLossScaler, window 8

class FairseqScaler:
    """fairseq/optim/dynamic_loss_scaler.py (tolerance 0): halve on overflow (never below `threshold`), double after
    `scale_window` clean iterations, FloatingPointError at `min_loss_scale`."""

    def __init__(self, init_scale=2.0 ** 16, scale_window=2000, threshold=None, min_loss_scale=1e-4):
        self.loss_scale, self.scale_window, self.threshold = init_scale, scale_window, threshold
        self.min_loss_scale = min_loss_scale
        self._iter, self._last_overflow_iter = 0, -1

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= 2.0
        self._iter += 1

    def check_overflow(self, grad_norm):
        if grad_norm == float("inf") or grad_norm != grad_norm:
            self._last_overflow_iter = self._iter
            self.loss_scale /= 2.0
            if self.threshold is not None:
                self.loss_scale = max(self.loss_scale, self.threshold)
            if self.loss_scale <= self.min_loss_scale:
                raise FloatingPointError(f"Minimum loss scale reached ({self.min_loss_scale}).")
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


def fairseq_run(rd, *, iters, scale_window, init_scale=2.0 ** 16, threshold=None, rampup=None, seed=5):
    """fairseq's FP16 path on an fp32 model under fp16 autocast: summed CE, loss x scale backward, multiply_grads(1 /
    (scale x bsz)), clip_grad_norm_(1.0) whose norm is the overflow check, OverflowError -> zero_grad, no step.
    `rampup` = (iteration, rows): the batch size from then on. s.extra["scale"]: the scale each iteration ran at."""
    m = mlp(seed, ln=True)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3, betas=(0.9, 0.98))
    sc = FairseqScaler(init_scale, scale_window, threshold=threshold)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        s.extra["scale"] = []
        for i in range(iters):
            s.step = i
            n = rampup[1] if rampup is not None and i >= rampup[0] else 32
            x, y = cls_batch(i, n=n)
            s.extra["scale"].append(sc.loss_scale)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y, reduction="sum")
            s.losses.append(loss.item() / n)
            (sc.loss_scale * loss).backward()
            try:
                for p in m.parameters():
                    p.grad.mul_(1.0 / (sc.loss_scale * n))
                gn = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                sc.check_overflow(float(gn))
                opt.step()
                sc.update()
            except OverflowError:
                s.skipped.append(i)
                opt.zero_grad()
    return s


def own_scaler_skips(s, most_later=4, least_opening=1, least_later=0, opening=OPENING):
    """An own scaler's skips are its own doing: >= `least_opening` in the opening search (before the first update;
    it may go on a little after it, before iteration `opening`: the first updates' gradients grow); after it
    `least_later`..`most_later`, each a probe at the edge after the scale grew back: at a scale no lower than the
    iteration before ran at, with a finite loss, and at most two in a row (Megatron's hysteresis 2)."""
    sk, scale = s.skipped, s.extra["scale"]
    upd = next(i for i in range(len(s.losses)) if i not in sk)
    later = [i for i in sk if i > upd]
    assert len([i for i in sk if i < upd]) >= least_opening and least_later <= len(later) <= most_later, sk
    for i in (i for i in later if i >= opening):
        assert scale[i] >= scale[i - 1] and math.isfinite(s.losses[i]), (i, sk, scale)
        assert not (i + 1 in sk and i + 2 in sk), (i, sk)
    return True


@case(check=lambda s: own_scaler_skips(s, most_later=12, least_later=5))
def run_fairseq_scaler_window_8(rd):
    """fairseq's default window 2 ** 14 / (world size 128 x update_freq 16) = 8: a probe every few dozen
    iterations, >= 5 after the first update but ~5% of the run."""
    return fairseq_run(rd, iters=120, scale_window=2 ** 14 // (128 * 16))


# --------------------------------------------------- 6-8. fp16 models with fp32 main params: Megatron and apex

class MegatronScaler:
    """megatron/core/optimizer/grad_scaler.py DynamicGradScaler: backoff after `hysteresis` overflows, never below
    min_scale, growth after `growth_interval` clean iterations."""

    def __init__(self, initial_scale, min_scale=1.0, growth_interval=1000, hysteresis=2):
        self.scale, self.min_scale, self.growth_interval, self.hysteresis = initial_scale, min_scale, \
            growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker, self._hysteresis_tracker = 0, self.hysteresis
                self.scale *= 2.0


def fp16_mains_run(rd, *, iters, scaler, init_scale, growth_interval=1000, hysteresis=2, seed=6, clip=None,
                   lr=3e-3):
    """An fp16 model (model.half(), fp16 inputs, no autocast; the loss in fp32 on out.float()) with fp32 main params
    kept by hand (Megatron's Float16OptimizerWithFloat16Params / apex's FP16_Optimizer): zero both grads -> (loss x
    scale).backward -> main.grad = model grad .float() -> unscale + found_inf ("megatron":
    torch._amp_foreach_non_finite_check_and_unscale_ and the DynamicGradScaler; "static": apex's static scale, grads
    divided by hand, a non-finite one skips) -> [clip the mains] -> Adam on the mains -> mains copied back."""
    m = mlp(seed, ln=True).half()
    params = list(m.parameters())
    mains = [nn.Parameter(p.detach().float()) for p in params]
    opt = torch.optim.Adam(mains, lr=lr)
    sc = MegatronScaler(init_scale, growth_interval=growth_interval, hysteresis=hysteresis) \
        if scaler == "megatron" else None
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        s.extra["scale"] = []
        for i in range(iters):
            s.step = i
            x, y = reg_batch(i)
            scale = sc.scale if sc is not None else init_scale
            s.extra["scale"].append(scale)
            opt.zero_grad(set_to_none=True)
            m.zero_grad(set_to_none=True)
            loss = F.mse_loss(m(x.half()).float(), y)
            s.losses.append(loss.item())
            (loss * scale).backward()
            for mp, p in zip(mains, params):
                mp.grad = p.grad.float()
            grads = [mp.grad for mp in mains]
            if sc is not None:
                found = torch.zeros(1)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor([1.0 / scale]))
                bad = bool(found.item())
                sc.update(bad)
            else:
                bad = not all(bool(torch.isfinite(g).all()) for g in grads)
                if not bad:
                    for g in grads:
                        g.div_(scale)
            if bad:
                s.skipped.append(i)
                continue
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(mains, clip)
            opt.step()
            with torch.no_grad():
                for mp, p in zip(mains, params):
                    p.copy_(mp)
    return s


@case(check=lambda s: own_scaler_skips(s, least_opening=4, least_later=2) and s.skipped[-2:] == [72, 75])
def run_megatron_2pow24_hysteresis(rd):
    return fp16_mains_run(rd, iters=80, scaler="megatron", init_scale=2.0 ** 24, growth_interval=32)


@case(check=lambda s: own_scaler_skips(s, least_opening=4, least_later=1) and s.skipped[-1] == 72)
def run_megatron_run_ends_on_a_probe(rd):
    """Case 6 stopped at max_steps 73: its last iteration is the scaler's growth probe at 72 (the overflow the
    80-iteration run skips and trains on past); the loop ends there, `continue` with no zero_grad after it."""
    return fp16_mains_run(rd, iters=73, scaler="megatron", init_scale=2.0 ** 24, growth_interval=32)


@case(fall=0.8)
def run_apex_static_scale_masters(rd):
    return fp16_mains_run(rd, iters=40, scaler="static", init_scale=2.0 ** 10, clip=1.0)


# ----------------------------------------------------------------------------------- 9. PGD adversarial, bf16

@case()
def run_pgd_adversarial_bf16(rd):
    m = mlp(8, ln=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    eps, alpha = 0.1, 0.04
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        for i in range(40):
            s.step = i
            x, y = cls_batch(i)
            delta = torch.zeros_like(x)
            for _ in range(3):                                          # the attack
                delta.requires_grad_(True)
                with torch.autocast("cpu", dtype=BF16):
                    adv_loss = F.cross_entropy(m(x + delta).float(), y)
                adv_loss.backward()
                delta = (delta + alpha * delta.grad.sign()).clamp(-eps, eps).detach()
                m.zero_grad()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.cross_entropy(m(x + delta).float(), y)
            s.losses.append(loss.item())
            loss.backward()
            opt.step()
    return s


# ------------------------------------------------------------------------------------------ 10. PCGrad, bf16

class TwoTask(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU())
        self.reg, self.cls = nn.Linear(64, 4), nn.Linear(64, 4)

    def forward(self, x):
        h = self.trunk(x)
        return self.reg(h), self.cls(h)


@case()
def run_pcgrad_two_tasks_bf16(rd):
    m = TwoTask(9)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    params = list(m.parameters())
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        s.extra["conflicts"] = 0
        for i in range(40):
            s.step = i
            x, yr = reg_batch(i)
            _, yc = cls_batch(i)
            with torch.autocast("cpu", dtype=BF16):
                out_r, out_c = m(x)
            losses = [F.mse_loss(out_r.float(), yr), F.cross_entropy(out_c.float(), yc)]
            s.losses.append(sum(t.item() for t in losses))
            task_grads = []
            for t, lt in enumerate(losses):
                opt.zero_grad()
                lt.backward(retain_graph=t == 0)
                task_grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                             for p in params]))
            proj = [g.clone() for g in task_grads]
            for a in range(2):                                            # PCGrad: project out the conflict
                b = 1 - a
                dot = torch.dot(proj[a], task_grads[b])
                if dot < 0:
                    s.extra["conflicts"] += 1
                    proj[a] -= dot / task_grads[b].norm() ** 2 * task_grads[b]
            flat, k = proj[0] + proj[1], 0
            for p in params:
                p.grad = flat[k:k + p.numel()].view_as(p).clone()
                k += p.numel()
            opt.step()
    return s


# ---------------------------------------------------------------- 11. accumulation, zero_grad after the step

@case()
def run_grad_accum_zero_after_step(rd):
    m = mlp(10)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    accum = 4
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        opt.zero_grad()
        for i in range(64):
            s.step = i
            x, y = cls_batch(i, n=16, cycle=16)
            loss = F.cross_entropy(m(x), y)
            s.losses.append(loss.item())
            (loss / accum).backward()
            if (i + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    return s


# -------------------------------------------------------------------------------- 12. zero_grad called twice

@case()
def run_double_zero_grad(rd):
    m = mlp(11, ln=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        for i in range(40):
            s.step = i
            x, y = reg_batch(i)
            m.zero_grad()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.mse_loss(m(x).float(), y)
            s.losses.append(loss.item())
            loss.backward()
            opt.step()
    return s


# ------------------------------------------------------------------------------ 13. a bf16 GAN, two optimizers

@case(fall=0.8)
def run_gan_bf16_two_optimizers(rd):
    torch.manual_seed(12)
    G = nn.Sequential(nn.Linear(16 + 8, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
    D = nn.Sequential(nn.Linear(16 + 4, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    both = nn.ModuleDict({"G": G, "D": D})
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    zg = gen(1212)
    with Loop(rd, both, optimizer=opt_g, scaler=None, grads_of=[opt_g, opt_d]) as s:
        s.metric = []
        for i in range(40):
            s.step = i
            c, real = reg_batch(i)
            z = torch.randn(32, 8, generator=zg)
            with torch.autocast("cpu", dtype=BF16):
                fake = G(torch.cat([c, z], 1))
            opt_d.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                d_real = D(torch.cat([c, real], 1)).float()
                d_fake = D(torch.cat([c, fake.detach()], 1)).float()
            d_loss = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + \
                F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                g_out = D(torch.cat([c, fake], 1)).float()
            l1 = F.l1_loss(fake.float(), real)
            g_loss = F.binary_cross_entropy_with_logits(g_out, torch.ones_like(g_out)) + 10 * l1
            g_loss.backward()
            opt_g.step()
            s.losses.append(g_loss.item() + d_loss.item())
            s.metric.append(l1.item())
    return s


# --------------------------------------------------------------------- 14. RL: skip on an empty advantage batch

@case(check=lambda s: 1 <= len(s.skipped) <= 30)
def run_rl_skip_empty_advantage(rd):
    m = mlp(13)
    opt = torch.optim.Adam(m.parameters(), lr=5e-3)
    ag = gen(1313)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        s.metric = []
        for i in range(60):
            s.step = i
            x, best = cls_batch(i, n=8, cycle=10)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                logits = m(x).float()
            logp = F.log_softmax(logits, -1)
            s.metric.append(F.nll_loss(logp.detach(), best).item())
            a = torch.multinomial(logp.detach().exp(), 1, generator=ag).squeeze(1)
            reward = (a == best).float()
            adv = reward - reward.mean()
            if not bool((adv != 0).any()):                              # no advantage: nothing to learn from
                s.losses.append(float(-reward.mean()))
                s.skipped.append(i)
                continue
            loss = -(logp.gather(1, a[:, None]).squeeze(1) * adv).mean()
            s.losses.append(loss.item())
            loss.backward()
            opt.step()
    return s


# ------------------------------------------------------------------------------------------ should-fire loops

def run_megatron_window_1(rd, window=1, hysteresis=1):
    return fp16_mains_run(rd, iters=50, scaler="megatron", init_scale=2.0 ** 16, growth_interval=window,
                          hysteresis=hysteresis)


def run_fairseq_floor_batch_rampup(rd, threshold=2.0 ** 12):
    return fairseq_run(rd, iters=50, scale_window=2000, threshold=threshold, rampup=(25, 1024))


class HandScaler:
    """A hand-written dynamic scaler: halve on overflow, double after `window` clean iterations."""

    def __init__(self, scale, window):
        self.scale, self.window, self.clean = scale, window, 0

    def update(self, overflow):
        if overflow:
            self.scale, self.clean = self.scale / 2, 0
            return
        self.clean += 1
        if self.clean % self.window == 0:
            self.scale *= 2


def run_hand_scaler_window_2(rd, window=2):
    """An fp32 model under fp16 autocast: loss x scale backward, an inf check over the grads, skip (zero_grad) or
    unscale + SGD step."""
    m = mlp(16)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sc = HandScaler(2.0 ** 16, window)
    with Loop(rd, m, optimizer=opt, scaler=None) as s:
        s.extra["scale"] = []
        for i in range(60):
            s.step = i
            x, y = reg_batch(i)
            s.extra["scale"].append(sc.scale)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.mse_loss(m(x).float(), y)
            s.losses.append(loss.item())
            (loss * sc.scale).backward()
            overflow = not all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
            sc.update(overflow)
            if overflow:
                s.skipped.append(i)
                opt.zero_grad(set_to_none=True)
                continue
            for p in m.parameters():
                p.grad.div_(sc.scale)
            opt.step()
    return s


# --------------------------------------------------------------------------------------------------------- tests

FALSE_ALARMS: dict = {}  # run name -> what ampdoctor said on that healthy loop (none left: see the docstring)
XFAIL = {name: wrong(reason) for name, reason in FALSE_ALARMS.items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=XFAIL[n]) if n in XFAIL else n for n in RUNS])
def test_healthy_no_scaler_loop(name, tmp_path):
    fn, health = RUNS[name]
    health = dict(health)
    check = health.pop("check", None)
    plain = fn(None)
    healthy(plain, **health)
    if check is not None:
        assert check(plain), plain.skipped
    else:
        assert plain.skipped == [], plain.skipped
    watched = fn(tmp_path / "run")
    try:
        same(watched, plain)
    except AssertionError as e:
        raise WrongAnswer(f"the watch changed training: {e}") from e
    judge(watched)


def _fire(fn, fixed, tmp_path, iters, streak=None):
    """A should-fire loop: the oracle counts its own skips (>= 5 and >= 25% of the iterations after its first
    update; the fixed twin under 25%), the watch changes nothing, and the report names skipped_steps at the
    optimizer step of the first iteration thrown away after the first update (or of `streak`: the iteration the
    never-ending streak of skips began, where a lone skip came before it). Steps are optimizer steps (CONTRACT.md):
    iteration k is step k minus the iterations thrown away before it."""
    plain, twin = fn(None), fixed(None)
    first, n, after = first_after_update(plain.skipped, iters)
    assert first is not None and n >= 5 and n >= 0.25 * after, (plain.skipped, n, after)
    _, n_fixed, after_fixed = first_after_update(twin.skipped, iters)
    assert n_fixed < 0.25 * after_fixed, twin.skipped
    assert all(math.isfinite(v) for v in plain.losses) and plain.bad_out == [], plain.losses
    watched = fn(tmp_path / "run")
    try:
        same(watched, plain)
    except AssertionError as e:
        raise WrongAnswer(f"the watch changed training: {e}") from e
    it = first if streak is None else streak
    fires(watched, (it - len([k for k in plain.skipped if k < it]),))  # its optimizer step: the updates before it
    return plain



def test_megatron_window_1_fires(tmp_path):
    """Megatron's scaler with loss-scale window 1 and hysteresis 1: the scale doubles after every clean iteration
    and overflows again (the fixed twin: window 1000, hysteresis 2)."""
    plain = _fire(run_megatron_window_1, lambda rd: run_megatron_window_1(rd, 1000, 2), tmp_path, 50)
    sk, scale = plain.skipped, plain.extra["scale"]
    later = [i for i in sk if i > next(j for j in range(50) if j not in sk)]
    assert all(scale[i] > scale[i - 1] for i in later if i - 1 not in sk), (sk, scale)   # each after a growth


def test_fairseq_floor_batch_rampup_fires(tmp_path):
    """fairseq's scaler floored at threshold_loss_scale 2**12; the batch ramps up to 1024 rows at 25: every
    iteration from 25 overflows at the floor (the fixed twin, no floor, halves past it and trains on)."""
    plain = _fire(run_fairseq_floor_batch_rampup, lambda rd: run_fairseq_floor_batch_rampup(rd, None), tmp_path, 50,
                  streak=25)
    assert [i for i in plain.skipped if i >= 25] == list(range(25, 50)), plain.skipped
    assert plain.extra["scale"][-1] == 2.0 ** 12, plain.extra["scale"]


def test_hand_scaler_window_2_fires(tmp_path):
    """A hand scaler growing after every 2 clean iterations (the fixed twin: window 2000)."""
    _fire(run_hand_scaler_window_2, lambda rd: run_hand_scaler_window_2(rd, 2000), tmp_path, 60)
