"""Loop misuse probes, sixth set: GradScaler / optimizer / clipping misuse in loop structures taken from real
repositories' patterns that tests/test_loop_misuse2..5.py do not build, each with its corrected twin, watched through
the public API only (`ampdoctor.watch(model, optimizer=..., scaler=...)`, or `watch(model, optimizer=...)` that finds
the scaler, around an ordinary fp16 autocast + torch.amp.GradScaler("cpu") loop on a tiny model, then `w.report()`)
at ampdoctor's default settings. Every misuse first checks in the test itself that it happened as designed and did
harm (torch's exception at the expected iteration, the norm the clip saw vs. the true unscaled norm of a copy, the
share of elements clipped that the true gradient would not have clipped, the applied vs. the true gradient norm,
the scaler's own scale history, NaN weights, parameter dtypes), recorded by the test's own code. Then: the rule
among the first three findings, error (skipped_steps: warning or error), at the step of the first misuse (the
watch's optimizer-step count) and, for clip/call-order rules, the line of the user's wrong call in the evidence.

Misuse:
 M1. a `Trainer.train_step()` that builds a closure (zero_grad, forward, scaled backward and, from step 2 after a
     warm-up, clip_grad_norm_), calls it, then scaler.step + update: the clip sees 1024x the true norm:
     clip_before_unscale at step 2 at the clip inside the closure.
 M2. per-parameter `clip_grad_value_` in `register_post_accumulate_grad_hook` hooks (the fused-optimizer
     tutorial's hook, used to "clip as gradients arrive"), registered from step 2: they run inside the scaled
     backward, clipping elements whose true value is below the clip value: clip_before_unscale at step 2 at the
     hook's clip line.
 M3. fine-tuning with the backbone frozen for 3 steps; once unfrozen only its param group
     (`opt.param_groups[0]["params"]`) is clipped, right after the backward and before unscale_:
     clip_before_unscale at step 3.
 M4. batch-size warm-up by accumulation (`accum_at(step)`: 1 micro-batch for steps 0-2, then 2) with
     scaler.step(opt) after every micro-batch and update() + scheduler + zero_grad only at the boundary: harmless
     while accum is 1; step 3's second micro-batch raises "step() has already been called since the last
     update()": missing_scaler_update (or scaler_misorder) at step 3 at that step() line.
 M5. a GAN whose discriminator gets two updates per generator update after a 2-iteration warm-up, one scaler,
     update() once per iteration: iteration 2's second scaler.step(optD) raises: missing_scaler_update (or
     scaler_misorder) at step 2 (one step per iteration: D and G through one scaler, one update(); step 4 when
     written, each optimizer step counted) at the D step line.
 M6. StyleGAN2-style lazy R1 regularization (`global_step % 4 == 0`, global_step from 1: iterations 3 and 7), R1
     computed with torch's gradient-penalty recipe, through a helper that calls `scaler.unscale_(optD)` inside
     `torch.no_grad()` (to weight the penalty by D's gradient norm) BEFORE the penalty's scaled backward: the
     applied gradient norm is ~300x the true one: scaler_misorder at step 3 (iteration 3; 6 when written) at the
     unscale_ or the R1 backward line.
 M7. the GradScaler created inside `train_one_epoch()` (a sum-reduced regression loss: the working scale is 1024,
     so each new scaler skips 6 of an epoch's 8 steps at 65536..2048): skipped_steps (warning or error) at step 8,
     the first step of epoch 1. Decision, from CONTRACT.md's skipped_steps ("an unusual share of steps (the first
     few backoffs alone are info)"): the first epoch's search is the normal backoff; each restart repeats it, and
     when the repeats throw away most of the run (18 of 24 steps) that share is unusual, dated where the lost scale
     first cost a step. T7b: the same rebuilt scaler whose search costs at most two steps per epoch (2 of 80) is
     healthy, because the scale is the scaler's only state and it is found again at once.
 M8. "step directly when the loss is finite": after unscale_ + clip, `optimizer.step()` if torch.isfinite(loss),
     else `scaler.step(optimizer)`; an outlier batch (inputs x40) at step 5 overflows the scaled backward with a
     finite loss, so optimizer.step applies inf/NaN (weights NaN): scaler_misorder at step 0 (the first bypass of
     GradScaler's inf check) at the optimizer.step line.
 M9. encoder and head with one optimizer each on one scaler; only `opt_head.zero_grad(set_to_none=True)` is called.
     Under AMP the stale encoder gradients are divided by the scale at each unscale_, so training looks normal
     until the outlier batch at step 5: the encoder's inf gradients are never cleared, every later step is skipped
     and the scale falls from 1024 to 0.125: loss_scale_collapse (or skipped_steps) at step 5 (one watch step per
     iteration: both optimizers step after one backward and one update).
M10. a Trainer that evaluates each epoch with `model.half()` "to save memory" and never converts back: the first
     step of epoch 1 (step 4) has fp16 parameters in the optimizer and unscale_ raises "Attempting to unscale FP16
     gradients.": fp16_master_weights at step 4.

Correct twins (no warning, no error; each checked to train or to stay finite): T1 the closure unscales before its
clip; T2 clip_grad_value_ in an optimizer step pre-hook (it runs inside scaler.step, after GradScaler's unscale_:
the gradients it sees have the true norm); T3 the backbone group clipped after unscale_; T4 step + update at the
accumulation boundary only; T5 an update() after each discriminator step and after the generator step; T6 the R1
backward before the no_grad unscale_; T7 the scaler made once (one search of 6 skips: info); T7b (above); T8
scaler.step always (the outlier is one skipped step); T9 both optimizers zeroed (one skipped step, then training
goes on); T10 the evaluation under autocast with fp32 weights.

What ampdoctor got wrong (fixed since): M7's skipped_steps was dated at step 0 (the first epoch's normal search)
and came third, after overflow errors at step 0 and 5 that the scaler-once twin reports as info: the restart branch
of rules/scaler.py now dates it at the first skip after the first restart, and rules/backoff.py benign_backoff judges
each restart's search as a run of its own (`scale_restarts`).

Seen but not asserted: M8's third finding is '[error] skipped_steps at (run) step 6 ... the forward pass itself was
non-finite' (the NaN weights); M9's first finding is the outlier's '[error] overflow at head aten::mm step 5'.
"""
import copy
import math
import os
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, lines, one_thread, randn
from probe_harness import expect as _expect, learned as _learned, quiet_report, run_misuse, tag_line, gnorm


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
SCALE = 1024.0


line_of = partial(tag_line, __file__)


def expect(rep, rule, severity=("error",), step=None, tag=None, file=HERE):
    """probe_harness.expect at this file's `# @tag` lines of `file`, scaler_misorder with its sequence."""
    return _expect(rep, rule, severity, step, tag, src=HERE, file=file, sequence=True)


quiet = quiet_report


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(i):
    return randn(16, 8, seed=i), randn(16, 1, seed=100 + i)


def fwd_loss(m, i):
    x, y = batch(i)
    with torch.autocast(**FP16):
        return F.mse_loss(m(x).float(), y)


def true_grads(m, loss_of):
    """The unscaled gradients of `loss_of(copy)` at m's current weights, on a copy (m is untouched)."""
    c = copy.deepcopy(m)
    c.zero_grad(set_to_none=True)
    loss_of(c).backward()
    return {n: p.grad.detach().clone() for n, p in c.named_parameters() if p.grad is not None}


def scaler(init=SCALE, **kw):
    return torch.amp.GradScaler("cpu", init_scale=init, **kw)


run = run_misuse


learned = partial(_learned, k=2, factor=0.9)


# ======================================================================================================================
# M1 / T1. A Trainer class whose train_step() builds a closure (forward, scaled backward, and from step 2 on a
# clip_grad_norm_), calls it, then scaler.step + update: the clip inside the closure runs before any unscale_
# ======================================================================================================================
class Trainer:
    """A home-grown Trainer (the closure style of fairseq/HF `training_step` ports): train_step(i) -> loss."""

    def __init__(self, model, ok, clip_from=2):
        self.model, self.ok, self.clip_from = model, ok, clip_from
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scaler = scaler()
        self.global_step = 0
        self.seen = []  # (step, the norm the clip returned, the true unscaled norm)

    def train_step(self, i):
        true = gnorm(true_grads(self.model, lambda c: fwd_loss(c, i)).values())

        def closure():
            self.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(self.model, i)
            self.scaler.scale(loss).backward()
            if self.global_step >= self.clip_from:  # "clipping after the warm-up steps"
                if self.ok:
                    self.scaler.unscale_(self.opt)
                n = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)  # @trainer-clip
                self.seen.append((self.global_step, float(n), true))
            return loss

        loss = closure()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.global_step += 1
        return loss.item()


def trainer_run(ok):
    m = net()
    t = Trainer(m, ok)
    losses = []
    rep, raised = run(m, lambda i: losses.append(t.train_step(i % 4)), steps=10, optimizer=t.opt, scaler=t.scaler)
    return rep, raised, t.seen, losses


def test_m1_trainer_closure_clips_scaled_gradients_from_step_2():
    rep, raised, seen, _ = trainer_run(False)
    # real: the norm the clip saw (and clipped to 0.5) is the loss scale times the true norm
    assert raised is None and seen[0][0] == 2, (raised, seen)
    assert all(abs(n / (SCALE * t) - 1) < 0.02 for _, n, t in seen), seen
    expect(rep, "clip_before_unscale", step=2, tag="trainer-clip")


def test_t1_twin_trainer_closure_unscales_before_its_clip_is_quiet():
    rep, raised, seen, losses = trainer_run(True)
    assert raised is None and all(abs(n / t - 1) < 0.02 for _, n, t in seen), seen
    learned(losses[:4] + losses[-4:])
    quiet(rep)


# ======================================================================================================================
# M2 / T2. clip_grad_value_ per parameter: in post-accumulate-grad hooks (registered from step 2, "clip as the
# gradients arrive, like the fused-optimizer tutorial") it runs inside the scaled backward; in an optimizer step
# pre-hook it runs inside scaler.step, after GradScaler's unscale_ (correct)
# ======================================================================================================================
def value_run(in_backward):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = scaler()
    seen = []  # (step, share of elements clipped that the true gradient would not have clipped)
    state = {"step": 0, "hooked": False}
    losses = []

    def post_hook(p):
        g = p.grad.detach().clone()
        torch.nn.utils.clip_grad_value_([p], 0.05)  # @value-hook
        seen.append((state["step"], float(((g.abs() > 0.05) & (g.abs() / sc.get_scale() <= 0.05)).float().mean()),
                     float(p.grad.abs().max())))

    def pre_hook(o, args, kwargs):
        g = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.05)
        t = state["true"]
        seen.append((state["step"], max(float(((g[n].abs() > 0.05) & (t[n].abs() <= 0.04)).float().mean()) for n in g),
                     gnorm(g.values()) / gnorm(t.values())))

    def body(i):
        if i == 2 and not state["hooked"]:
            state["hooked"] = True
            if in_backward:
                for p in m.parameters():
                    p.register_post_accumulate_grad_hook(post_hook)
            else:
                opt.register_step_pre_hook(pre_hook)
        state["step"] = i
        state["true"] = true_grads(m, lambda c: fwd_loss(c, i % 4))
        opt.zero_grad()
        loss = fwd_loss(m, i % 4)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        losses.append(loss.item())

    rep, raised = run(m, body, steps=10, optimizer=opt, scaler=sc)
    return rep, raised, seen, losses


def test_m2_clip_grad_value_in_post_accumulate_grad_hooks_clips_scaled_gradients():
    rep, raised, seen, _ = value_run(True)
    # real: from step 2 most elements are clipped although their true (unscaled) value is below the clip value
    assert raised is None and seen[0][0] == 2, (raised, seen[:2])
    assert sum(s for _, s, _ in seen) / len(seen) > 0.3, seen
    expect(rep, "clip_before_unscale", step=2, tag="value-hook")


def test_t2_twin_clip_grad_value_in_a_step_pre_hook_runs_after_unscale_and_is_quiet():
    rep, raised, seen, losses = value_run(False)
    # the pre-hook sees the unscaled gradients (their norm is the true one) and clips nothing a true one would not
    assert raised is None and seen and all(s == 0 and abs(r - 1) < 0.02 for _, s, r in seen), seen
    learned(losses[:4] + losses[-4:])
    quiet(rep)


# ======================================================================================================================
# M3 / T3. Fine-tuning with a frozen backbone for 3 steps, then unfrozen: only the backbone's param group is clipped
# ("it is the fragile part"), and that clip sits right after the backward, before scaler.unscale_
# ======================================================================================================================
def subset_run(ok):
    m = net()
    m.body.requires_grad_(False)
    opt = torch.optim.AdamW([{"params": m.body.parameters(), "lr": 1e-3},
                             {"params": m.head.parameters(), "lr": 1e-2}])
    sc = scaler()
    seen = []
    losses = []

    def body(i):
        if i == 3:
            m.body.requires_grad_(True)  # unfreeze the backbone
        true = true_grads(m, lambda c: fwd_loss(c, i % 4))
        opt.zero_grad()
        loss = fwd_loss(m, i % 4)
        sc.scale(loss).backward()
        if ok:
            sc.unscale_(opt)
        if i >= 3:
            n = torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 0.1)  # @subset-clip
            seen.append((i, float(n), gnorm([true["body.weight"], true["body.bias"]])))
        sc.step(opt)
        sc.update()
        losses.append(loss.item())

    rep, raised = run(m, body, steps=10, optimizer=opt, scaler=sc)
    return rep, raised, seen, losses


def test_m3_backbone_param_group_clipped_before_unscale_once_unfrozen_at_step_3():
    rep, raised, seen, _ = subset_run(False)
    assert raised is None and seen[0][0] == 3 and all(abs(n / (SCALE * t) - 1) < 0.02 for _, n, t in seen), seen
    expect(rep, "clip_before_unscale", step=3, tag="subset-clip")


def test_t3_twin_backbone_param_group_clipped_after_unscale_is_quiet():
    rep, raised, seen, losses = subset_run(True)
    assert raised is None and all(abs(n / t - 1) < 0.02 for _, n, t in seen), seen
    learned(losses[:4] + losses[-4:])
    quiet(rep)


# ======================================================================================================================
# M4 / T4. Batch-size warm-up by accumulation: `accum_at(step)` micro-batches per optimizer step (1 for steps 0-2,
# then 2); the loop calls scaler.step(opt) after every micro-batch but scaler.update() (+ zero_grad + scheduler)
# only at the accumulation boundary: harmless while accum is 1, at step 3 the second micro-batch's step() raises
# ======================================================================================================================
def accum_at(step):
    return 1 if step < 3 else 2


def accum_run(ok):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    sc = scaler()
    st = {"step": 0, "micro": 0, "losses": [], "updates": []}

    def body(i):  # i counts micro-batches
        k = accum_at(st["step"])
        loss = fwd_loss(m, i % 4)
        sc.scale(loss / k).backward()
        st["micro"] += 1
        if not ok:
            sc.step(opt)  # @accum-step
        if st["micro"] == k:  # the accumulation boundary
            if ok:
                sc.step(opt)
            sc.update()
            sched.step()
            opt.zero_grad()
            st["updates"].append(i)
            st["step"] += 1
            st["micro"] = 0
        st["losses"].append(loss.item())

    rep, raised = run(m, body, steps=11, optimizer=opt, scaler=sc)
    return rep, raised, st


def test_m4_accumulation_warmup_steps_the_scaler_every_micro_batch_raises_at_step_3():
    rep, raised, st = accum_run(False)
    # real: steps 0-2 are one micro-batch each; step 3's second micro-batch calls step() again before update()
    assert st["updates"] == [0, 1, 2] and raised is not None and raised[0] == 4, (st["updates"], raised)
    assert "step() has already been called since the last update()" in raised[1], raised
    expect(rep, ("missing_scaler_update", "scaler_misorder"), step=3, tag="accum-step")


def test_t4_twin_accumulation_warmup_steps_at_the_boundary_is_quiet():
    rep, raised, st = accum_run(True)
    assert raised is None and st["updates"] == [0, 1, 2, 4, 6, 8, 10], st["updates"]
    learned(st["losses"][:4] + st["losses"][-4:])
    quiet(rep)


# ======================================================================================================================
# M5 / T5. A GAN whose discriminator gets a second update per generator update once the warm-up is over
# (`d_steps = 1 if it < 2 else 2`, one GradScaler for both optimizers, scaler.update() once at the end of the
# iteration): the second scaler.step(optD) of iteration 2 raises. Twin: an update() after each scaler.step.
# ======================================================================================================================
class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def gan_run(ok, iters=6):
    gan = GAN()
    optD = torch.optim.Adam(gan.D.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optG = torch.optim.Adam(gan.G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    sc = scaler()
    log = {"d_steps": [], "steps": 0, "d": [], "g": []}

    def body(it):
        d_steps = 1 if it < 2 else 2
        log["d_steps"].append(d_steps)
        for k in range(d_steps):
            real, z = randn(16, 8, seed=10 * it + k) + 2.0, randn(16, 4, seed=500 + 10 * it + k)
            optD.zero_grad()
            with torch.autocast(**FP16):
                d_loss = (F.softplus(gan.D(gan.G(z).detach())).float().mean()
                          + F.softplus(-gan.D(real)).float().mean())
            sc.scale(d_loss).backward()
            sc.step(optD)  # @gan-d-step
            log["steps"] += 1
            log["d"].append(d_loss.item())
            if ok:
                sc.update()
        z = randn(16, 4, seed=900 + it)
        optG.zero_grad()
        with torch.autocast(**FP16):
            g_loss = F.softplus(-gan.D(gan.G(z))).float().mean()
        sc.scale(g_loss).backward()
        sc.step(optG)
        log["steps"] += 1
        log["g"].append(g_loss.item())
        sc.update()

    rep, raised = run(gan, body, steps=iters, optimizer=optD, scaler=sc)
    return rep, raised, log


def test_m5_gan_second_discriminator_step_without_update_raises():
    rep, raised, log = gan_run(False)
    # real: iterations 0-1 (D, G) ran; iteration 2's first D step ran (the 5th optimizer step), its second raised
    assert raised is not None and raised[0] == 2 and log["steps"] == 5, (raised, log["steps"])
    assert "step() has already been called since the last update()" in raised[1], raised
    # one step per iteration: D and G step through the one scaler, one update() each (steps 0 and 1); iteration 2's
    # first D step is step 2 (counted 4 when written: each optimizer step was a step, StepMachine.iteration_goes_on)
    expect(rep, ("missing_scaler_update", "scaler_misorder"), step=2, tag="gan-d-step")


def test_t5_twin_gan_update_after_each_discriminator_step_is_quiet():
    rep, raised, log = gan_run(True)
    assert raised is None and log["steps"] == 2 * 2 + 4 * 3, log["steps"]
    assert all(map(math.isfinite, log["d"] + log["g"])), log
    quiet(rep)


# ======================================================================================================================
# M6 / T6. StyleGAN2's lazy R1 regularization (every 4th iteration, `global_step % 4 == 0` with global_step from 1)
# through a penalty helper that, to set its weight from the discriminator's current gradient norm, calls
# `scaler.unscale_(optD)` inside `torch.no_grad()` BEFORE the penalty's own scaled backward: from iteration 3 the
# R1 gradients land on already unscaled gradients and scaler.step applies them x scale
# ======================================================================================================================
def r1_term(D, real, sc):
    """R1 = E|dD(real)/dreal|^2 with torch's AMP gradient-penalty recipe (scaled autograd.grad, then * inv_scale)."""
    real = real.detach().requires_grad_(True)
    with torch.autocast(**FP16):
        out = D(real).float().sum()
    g, = torch.autograd.grad(sc.scale(out), real, create_graph=True)
    g = g * (1.0 / sc.get_scale())
    with torch.autocast(**FP16):
        return g.float().pow(2).sum(1).mean()


def penalty(D, optD, real, sc, early):
    if early:
        with torch.no_grad():
            sc.unscale_(optD)  # @r1-unscale
            gn = gnorm([p.grad for p in D.parameters()])
        w = 5.0 if gn < 1.0 else 1.0  # "a weaker penalty while D's gradients are large"
    else:
        w = 5.0
    return w, r1_term(D, real, sc) * w * 4  # x d_reg_every (lazy regularization)


def r1_run(ok, iters=8):
    gan = GAN()
    optD = torch.optim.Adam(gan.D.parameters(), lr=2e-3, betas=(0.0, 0.99))
    optG = torch.optim.Adam(gan.G.parameters(), lr=2e-3, betas=(0.0, 0.99))
    sc = scaler()
    log = {"reg": [], "ratio": [], "d": []}

    def d_loss_of(D, real, z):
        with torch.autocast(**FP16):
            return F.softplus(D(gan.G(z).detach())).float().mean() + F.softplus(-D(real)).float().mean()

    def body(it):
        global_step = it + 1
        real, z = randn(16, 8, seed=it) + 2.0, randn(16, 4, seed=300 + it)
        optD.zero_grad()
        d_loss = d_loss_of(gan.D, real, z)
        sc.scale(d_loss).backward()
        if global_step % 4 == 0:
            w, r1 = penalty(gan.D, optD, real, sc, early=not ok)
            sc.scale(r1).backward()  # @r1-backward
            if ok:
                with torch.no_grad():
                    sc.unscale_(optD)
            # oracle: the gradients scaler.step will apply vs. the true ones (main loss + the same penalty, no scale)
            D2 = copy.deepcopy(gan.D)
            D2.zero_grad()
            (d_loss_of(D2, real, z) + r1_term(D2, real, torch.amp.GradScaler("cpu", init_scale=1.0)) * w * 4).backward()
            log["reg"].append(it)
            log["ratio"].append(gnorm([p.grad for p in gan.D.parameters()]) / gnorm([p.grad for p in D2.parameters()]))
        sc.step(optD)
        log["d"].append(d_loss.item())
        optG.zero_grad()
        with torch.autocast(**FP16):
            g_loss = F.softplus(-gan.D(gan.G(z))).float().mean()
        sc.scale(g_loss).backward()
        sc.step(optG)
        sc.update()

    rep, raised = run(gan, body, steps=iters, optimizer=optD, scaler=sc)
    return rep, raised, log


def test_m6_r1_penalty_backpropagated_after_an_unscale_in_no_grad():
    rep, raised, log = r1_run(False)
    # real: on the regularized iterations the applied gradient norm is far above the true one (the R1 part x scale)
    assert raised is None and log["reg"] == [3, 7] and all(r > 20 for r in log["ratio"]), log
    # iteration 3 is the watch's step 3: D and G step through the one scaler, one update() per iteration (step 6
    # when written: each optimizer step was a step, StepMachine.iteration_goes_on)
    expect(rep, "scaler_misorder", step=3, tag=("r1-unscale", "r1-backward"))


def test_t6_twin_r1_penalty_backpropagated_before_unscale_is_quiet():
    rep, raised, log = r1_run(True)
    assert raised is None and log["reg"] == [3, 7] and all(abs(r - 1) < 0.03 for r in log["ratio"]), log
    assert all(map(math.isfinite, log["d"])), log
    quiet(rep)


# ======================================================================================================================
# M7 / T7. The GradScaler created inside the epoch loop (a `train_one_epoch(model, loader, optimizer)` that makes
# its own `GradScaler()`, default init_scale 65536): every epoch searches for a working scale again. With
# unnormalized regression targets (x50: the scale that fits is 1024) each search costs 6 of an epoch's 8 steps.
# Decision (CONTRACT.md, skipped_steps: "the scaler skipped an unusual share of steps (the first few backoffs
# alone are info)"): the first epoch's search is the normal backoff; each later one repeats it, and when the
# repeats throw away most of the run that is an unusual share: a skipped_steps warning (or error), dated at the
# first step the lost scale cost (epoch 1's first step). With normalized targets the search costs one step per
# epoch (2 of 80): the scale is the scaler's only state and it is found again at once: healthy, info at most.
# ======================================================================================================================
W_TRUE = randn(8, 1, seed=7)


def reg_batch(i):
    x = randn(16, 8, seed=1000 + i)
    return x, x @ W_TRUE


def train_one_epoch(m, opt, sc, epoch, n, reduction, log):
    sc = sc if sc is not None else torch.amp.GradScaler("cpu")  # made anew by every call
    for b in range(n):
        x, y = reg_batch(b)
        opt.zero_grad()
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y, reduction=reduction)
        s0 = sc.get_scale()
        if b == 0:
            log["start_scale"].append(s0)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        log["skipped"].append(sc.get_scale() < s0)
        log["losses"].append(loss.item() / (16 if reduction == "sum" else 1))


def epochs_run(rebuild, epochs, n, reduction):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.03)
    log = {"skipped": [], "losses": [], "start_scale": []}
    once = None if rebuild else torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt)  # the scaler is found (it does not exist yet when the watch begins)
    try:
        for e in range(epochs):
            train_one_epoch(m, opt, once, e, n, reduction, log)
    finally:
        w.close()
    return w.report(), log


def test_m7_grad_scaler_rebuilt_every_epoch_repeats_its_search():
    rep, log = epochs_run(True, 3, 8, "sum")
    sk = log["skipped"]
    # real: every epoch starts at 65536 and skips most of its steps again (the twin's one scaler skips none after
    # epoch 0)
    assert log["start_scale"] == [65536.0] * 3, log["start_scale"]
    assert all(sum(sk[8 * e:8 * e + 8]) >= 5 and sk[8 * e] for e in range(3)), sk
    expect(rep, "skipped_steps", ("warning", "error"), step=8)


def test_t7_twin_grad_scaler_made_once_is_quiet():
    rep, log = epochs_run(False, 3, 8, "sum")
    sk = log["skipped"]
    assert sum(sk[:8]) >= 5 and not any(sk[8:]), sk  # the one search, then none
    learned(log["losses"], k=4)
    quiet(rep)


def test_t7b_grad_scaler_rebuilt_every_epoch_with_a_one_step_search_is_healthy():
    rep, log = epochs_run(True, 2, 40, "mean")
    sk = log["skipped"]
    # real: epoch 1 starts from a new scaler at 65536 (not epoch 0's settled scale); each search skips <= 2 steps
    assert log["start_scale"] == [65536.0, 65536.0] and 1 <= sum(sk[:40]) <= 2 and sum(sk[40:]) <= 2, (log, sk)
    learned(log["losses"], k=4)
    quiet(rep)


# ======================================================================================================================
# M8 / T8. "Step directly when the loss is finite, let the scaler handle the rest": after unscale_ + clip, a user
# check on the LOSS chooses `optimizer.step()` (finite) or `scaler.step(optimizer)` (not finite), then update().
# The loss stays finite when only the scaled backward overflows: an outlier batch at step 5 (inputs x40, a sensor
# glitch) makes the backward overflow at scale 1024 with a finite loss, and optimizer.step() applies the inf/NaN.
# ======================================================================================================================
OUTLIER = 5


def outlier_batch(i):
    x, y = batch(i % 4)
    return (40 * x if i == OUTLIER else x), y


def finite_check_run(ok, steps=12):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = scaler()
    log = {"direct": [], "grads_bad": [], "weights_bad": [], "losses": [], "scales": []}

    def body(i):
        opt.zero_grad()
        x, y = outlier_batch(i)
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        log["scales"].append(sc.get_scale())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        log["grads_bad"].append(not all(torch.isfinite(p.grad).all() for p in m.parameters()))
        if torch.isfinite(loss) and not ok:
            opt.step()  # @direct-step
            log["direct"].append(i)
        else:
            sc.step(opt)
        sc.update()
        log["weights_bad"].append(not all(torch.isfinite(p).all() for p in m.parameters()))
        log["losses"].append(loss.item())

    rep, raised = run(m, body, steps=steps, optimizer=opt, scaler=sc)
    return rep, raised, log


def test_m8_optimizer_step_when_the_loss_is_finite_applies_an_overflowed_backward():
    rep, raised, log = finite_check_run(False)
    k = log["grads_bad"].index(True)
    # real: every step before k was a direct optimizer.step on finite gradients; at k (the outlier) the loss was
    # finite, the backward overflowed, and optimizer.step wrote inf/NaN into the weights
    assert raised is None and k == OUTLIER and log["direct"][:k + 1] == list(range(k + 1)), log
    assert math.isfinite(log["losses"][k]) and log["weights_bad"].index(True) == k, log
    # the first bypass of GradScaler's inf check is step 0
    expect(rep, "scaler_misorder", step=0, tag="direct-step")


def test_t8_twin_scaler_step_always_skips_the_overflowed_step_and_is_quiet():
    rep, raised, log = finite_check_run(True)
    assert raised is None and log["grads_bad"].index(True) == OUTLIER and not any(log["weights_bad"]), log
    learned(log["losses"][:4] + log["losses"][-4:])
    quiet(rep)


# ======================================================================================================================
# M9 / T9. An encoder and a head, one optimizer each (different lr), one GradScaler; the loop zeroes only the head's
# optimizer (`opt_head.zero_grad(set_to_none=True)`; the encoder's zero_grad was dropped in a refactor). Under AMP
# the stale encoder gradients are divided by the scale at every unscale_, so the run trains normally, until the
# first overflow (the outlier batch of M8 at step 5): the encoder's inf gradients are never cleared, every later
# step is skipped and the scale collapses. Twin: both optimizers zeroed (the outlier is one skipped step).
# ======================================================================================================================
def one_zero_run(ok, steps=18):
    m = net()
    opt_enc = torch.optim.AdamW(m.body.parameters(), lr=1e-3)
    opt_head = torch.optim.AdamW(m.head.parameters(), lr=1e-2)
    sc = scaler()
    log = {"skipped": [], "enc_bad": [], "losses": []}

    def body(i):
        opt_head.zero_grad(set_to_none=True)
        if ok:
            opt_enc.zero_grad(set_to_none=True)
        x, y = outlier_batch(i)
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        s0 = sc.get_scale()
        sc.scale(loss).backward()
        sc.step(opt_enc)
        sc.step(opt_head)
        sc.update()
        log["skipped"].append(sc.get_scale() < s0)
        log["enc_bad"].append(not all(torch.isfinite(p.grad).all() for p in m.body.parameters()))
        log["losses"].append(loss.item())

    rep, raised = run(m, body, steps=steps, optimizer=opt_enc, scaler=sc)
    return rep, raised, log


def test_m9_only_one_of_two_optimizers_zeroed_keeps_an_inf_gradient_forever():
    rep, raised, log = one_zero_run(False)
    k = log["skipped"].index(True)
    # real: normal steps up to k, then the encoder's gradients stay inf/NaN and every step from k is skipped
    assert raised is None and k == OUTLIER and all(log["skipped"][k:]) and all(log["enc_bad"][k:]), log
    assert not any(log["enc_bad"][:k]), log
    # both optimizers step once per iteration after one backward and one update(): one step of the watch each
    expect(rep, ("loss_scale_collapse", "skipped_steps"), step=k)


def test_t9_twin_both_optimizers_zeroed_is_quiet():
    rep, raised, log = one_zero_run(True)
    assert raised is None and [i for i, b in enumerate(log["skipped"]) if b] == [OUTLIER], log
    learned(log["losses"][:4] + log["losses"][-4:])
    quiet(rep)


# ======================================================================================================================
# M10 / T10. A Trainer that evaluates after each epoch in half precision "to save memory" (`model.half()` before
# the eval loop, never undone): from epoch 1 (step 4) the optimizer's parameters are fp16, and GradScaler's
# unscale_ raises "Attempting to unscale FP16 gradients.". Twin: the eval under autocast, weights left in fp32.
# ======================================================================================================================
def eval_half_run(ok, epochs=3, n=4):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = scaler()
    log = {"dtypes": [], "losses": [], "evals": []}

    def evaluate():
        m.eval()
        x, y = batch(99)
        with torch.no_grad():
            if ok:
                with torch.autocast(**FP16):
                    out = m(x)
            else:
                m.half()  # @eval-half
                out = m(x.half())
        log["evals"].append(F.mse_loss(out.float(), y).item())
        m.train()

    def body(e):
        for b in range(n):
            log["dtypes"].append(m.body.weight.dtype)
            opt.zero_grad()
            loss = fwd_loss(m, b)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            log["losses"].append(loss.item())
        evaluate()

    rep, raised = run(m, body, steps=epochs, optimizer=opt, scaler=sc)
    return rep, raised, log


def test_m10_model_half_for_evaluation_leaves_fp16_parameters_in_the_optimizer():
    rep, raised, log = eval_half_run(False)
    # real: epoch 0 trains in fp32 weights; the first step of epoch 1 (step 4) has fp16 weights and unscale_ raises
    assert raised is not None and raised[0] == 1 and "Attempting to unscale FP16 gradients" in raised[1], raised
    assert log["dtypes"] == [torch.float32] * 4 + [torch.float16], log["dtypes"]
    expect(rep, "fp16_master_weights", step=4)


def test_t10_twin_evaluation_under_autocast_is_quiet():
    rep, raised, log = eval_half_run(True)
    assert raised is None and set(log["dtypes"]) == {torch.float32}, log["dtypes"]
    learned(log["losses"][:4] + log["losses"][-4:])
    quiet(rep)
