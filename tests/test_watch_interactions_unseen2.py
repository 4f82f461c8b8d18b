"""A watch left on in REAL user code, second set: what the user's loop does to a WATCHED model DURING training
(reshapes it, evaluates it, copies it into a teacher, rolls it back) must not change training, must stay quiet on a
healthy run, and must name the producer at the right step on a failing one. Mechanisms of
test_watch_interactions_unseen (deepcopy fine-tune / pickle / restore-best without the scaler / ReFT forward hook /
GRL backward hook / bf16 cast / export-free before close / a grown `extra` layer / report before the first step /
apply(init)) are not repeated; grepped first: functional_call (MAML, unseen_variants35), add_param_group and
requires_grad toggles in healthy runs, scaler.load_state_dict at resume (healthy_default3/33/35, long_and_resumed).

 1. widened_block_overflows (failing) / 1h (twin): Net2Net-style widening -- at step 4 the watched model's `fc2`
    is REPLACED by nn.Sequential(Linear(32, 64), ReLU, Linear(64, 32)) (its first Linear x40), its parameters
    added with optimizer.add_param_group. The new block's first backward costs one scaler backoff (step 4, in both
    runs, allowed). At step 8 one raw record (sample x6000) overflows fp16 in `fc2.0`. CONTRACT: module = the name
    from model.named_modules() now: `fc2.0`, step 8 (not `fc2`, the name of the replaced object's hooks). Fix (twin):
    the data pipeline clips every feature to [-6, 6].
 2. eval_before_bad_step (failing) / 2h: validation every 4 steps at the TOP of the iteration, on the watched
    model itself (model.eval(), no_grad, fp16 autocast, model.train()): at step 8 the eval forward runs between
    optimizer step 7 and the training forward of step 8, whose raw record overflows `fc2` (x40). Producer `fc2`,
    step 8 (the capture must hold the training batch, not the eval one). Twin: clipped features.
 3. eval_only_overflow (healthy training): the validation batches before steps 4 and 8 hold the raw record; `fc2`
    overflows in eval only (the val losses are inf), training is healthy and bitwise the unwatched run's. Accepted:
    no warning/error, or one of overflow/nan_origin at `fc2` (the producer); anything else (skipped_steps, a
    training-step nan_origin at the run, another module) is blaming training.
 4. mean_teacher_deepcopy (failing) / 4h: Mean Teacher / DINO -- the teacher is copy.deepcopy(model) made AFTER
    the watch (it carries the watch's hooks), run first each step under no_grad, EMA-updated (lerp_ 0.05) after the
    step; loss = MSE(student, y) + 0.5 MSE(student, teacher). At step 8 the raw record overflows the teacher's
    `fc2` first, then the student's. Producer: the student's `fc2`, step 8. Twin: clipped features.
 5. rollback_to_early_checkpoint (healthy, two variants): a loss-spike rollback -- at step 14 the model and the
    optimizer (and, `with_scaler`, the GradScaler: scaler.load_state_dict) are loaded from the checkpoint
    (state_dicts, weights_only) saved after step 0; the loss jumps back (0.145 -> 1.565) and the scaler skips step 14
    again (both runs). Quiet, bitwise.

Dropped while writing (the oracle, not ampdoctor): gradual unfreezing whose first-layer weight gradient overflows in
backward -- a single overflow at the full loss scale, which GradScaler is designed to absorb (ampdoctor: `info`
overflow at fc1 with every=1, `info` skipped_steps at the default; right); gradient checkpointing switched on
mid-run -- probe_harness.Producer's forward hooks make torch's non-reentrant checkpoint raise CheckpointError
("different number of tensors saved") on the overflowing step even unwatched, so that case has no oracle.

Every case runs unwatched too (same seeds; probe_harness.healthy_run + same_run: losses, skipped steps, final
weights and the val losses bitwise). Failures are proven first (probe_harness.Producer registered after the user's
change; the loss first non-finite at the bad step; skipped; only opening backoffs before it), then overflow /
nan_origin must be an error at the producer and step among the first three findings (probe_harness.producer_top3).

Result when written (torch 2.13 CPU, default watch): 9 pass, 0 xfail (two runs, identical; ~7 s).
First findings: 1 `[error] overflow at fc2.0 aten::addmm step 8` (propagates to `fc2.2`); 2 and 4 `[error] overflow
at fc2 aten::addmm step 8`; 3 `[info] overflow at fc2 step 4: ... later ops absorb it` (dated at the first eval
pass, only info); every twin and 5 quiet (only the opening `info` backoffs). No watched run changed training.
"""
from __future__ import annotations

import copy
import io
import math
import sys
from pathlib import Path
from types import SimpleNamespace as ns

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import (HealthyLoop, Producer, WrongAnswer, healthy_run, producer_top3,  # noqa: E402
                           quiet_healthy, same_run)
from scenarios import lines, one_thread, randn  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

W_TRUE = randn(8, 1, seed=999) * 0.5
FWD = ("overflow", "nan_origin")
BAD = 8


class Net(nn.Module):
    """fc1 -> relu -> fc2 (x `gain`) -> LayerNorm -> head."""

    def __init__(self, gain=1.0):
        super().__init__()
        self.fc1, self.fc2, self.norm, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.LayerNorm(32), \
            nn.Linear(32, 1)
        with torch.no_grad():
            self.fc2.weight.mul_(gain)

    def forward(self, x):
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(x)))))


def batch(i, bad=None, scale=6000.0, clamp=False):
    """A regression batch (4 distinct ones, cycled); at `bad` sample 3 is `scale` x (a raw, unnormalised record);
    `clamp`: the fix, the data pipeline clips every feature to [-6, 6]."""
    x = randn(16, 8, seed=i % 4)
    y = x @ W_TRUE
    if i == bad:
        x = x.clone()
        x[3] *= scale
    if clamp:
        x = x.clamp(-6.0, 6.0)
    return x, y


def amp_update(c, loss):
    c.sc.scale(loss).backward()
    c.sc.unscale_(c.opt)
    torch.nn.utils.clip_grad_norm_([p for g in c.opt.param_groups for p in g["params"]], 1.0)
    c.sc.step(c.opt)
    c.sc.update()
    return loss.item()


def plain_step(c, x, y, call=None):
    c.opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = (call or c.m)(x)
    return amp_update(c, (out.float() - y).pow(2).mean())


def loop(m, steps, body, lr=1e-3, params=None):
    """A HealthyLoop over `m` (AdamW, GradScaler("cpu")): iteration i sets c.i (and the oracle's step, where one
    is on), runs `body(c)` -> its loss, and takes the oracle off after the last iteration (before close())."""
    c = ns(m=m, opt=torch.optim.AdamW(m.parameters() if params is None else params, lr=lr),
           sc=torch.amp.GradScaler("cpu"), oracle=None, i=0)

    def step(i):
        c.i = i
        if c.oracle is not None:
            c.oracle.step = i
        loss = body(c)
        if i == steps - 1 and c.oracle is not None:
            c.oracle.remove()
        return loss
    lp = HealthyLoop(m, c.opt, c.sc, step)
    lp.c = c
    return lp


def both(build, steps, tmp_path, watch_kw=None):
    """The watched run (default watch unless `watch_kw`) and the unwatched one: bitwise the same (same_run)."""
    torch.manual_seed(0)
    rw = healthy_run(build(steps), steps, watch_kw or {}, str(tmp_path / "run"))
    torch.manual_seed(0)
    ru = healthy_run(build(steps), steps)
    same_run(rw, ru)
    return rw


def failure_truth(r, name, bad=BAD, backward=False, backoffs=()):
    """The oracle's producer is `name` at `bad` (forward, or backward with the loss finite); the loss first non-finite
    there (forward); the scaler skips `bad` and no step from 3 to it."""
    o = r.loop.c.oracle
    if backward:
        assert o.first is None and o.first_bwd == (name, bad), (o.first, o.first_bwd)
        assert all(map(math.isfinite, r.losses)), r.losses
    else:
        assert o.first == (name, bad), o.first
        nf = [i for i, v in enumerate(r.losses) if not math.isfinite(v)]
        assert nf and nf[0] == bad, r.losses
    assert bad in r.skipped and all(s < 3 or s in backoffs for s in r.skipped if s < bad), r.skipped


def healthy_truth(r, fall=0.9, backoffs=(), oracle=True):
    """Finite losses, no skip from step 3 on but `backoffs`, the last 3 losses below `fall` x the first 3, no
    producer (`oracle`)."""
    ls = r.losses
    assert all(map(math.isfinite, ls)), ls
    assert [s for s in r.skipped if s >= 3 and s not in backoffs] == [], r.skipped
    assert sum(ls[-3:]) < fall * sum(ls[:3]), ls
    if oracle and r.loop.c.oracle is not None:
        assert r.loop.c.oracle.first is None and r.loop.c.oracle.first_bwd is None


# 1 ---------------------------------------------------------------------------------------------------------------
WIDEN = 4


def _widen(fix):
    def build(steps):
        def body(c):
            if c.i == WIDEN:  # Net2Net-style widening: fc2 becomes a wider two-layer block, mid-run
                torch.manual_seed(4)
                c.m.fc2 = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
                with torch.no_grad():
                    c.m.fc2[0].weight.mul_(40.0)
                c.opt.add_param_group({"params": list(c.m.fc2.parameters())})
                c.oracle = Producer(c.m)
                c.oracle.step = c.i
            return plain_step(c, *batch(c.i, BAD, clamp=fix))
        return loop(Net(), steps, body)
    return build


def test_widened_block_overflows(tmp_path):
    r = both(_widen(False), BAD + 4, tmp_path)
    failure_truth(r, "fc2.0", backoffs=(WIDEN,))  # the new block's first backward: one backoff
    producer_top3(r.rep, FWD, "fc2.0", BAD)


def test_widened_block_clamped_twin(tmp_path):
    r = both(_widen(True), BAD + 6, tmp_path)
    healthy_truth(r, fall=1.0, backoffs=(WIDEN,))
    quiet_healthy(r)


# 2 ---------------------------------------------------------------------------------------------------------------
def _eval_first(fix, eval_bad=False):
    def build(steps):
        def body(c):
            if c.i == 0:
                c.oracle = Producer(c.m)
            if c.i % 4 == 0 and c.i > 0:  # validation at the top of the iteration, on the watched model
                c.m.eval()
                xv, yv = batch(c.i + 40, c.i + 40 if eval_bad else None, clamp=fix)
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                    lp.extra.append((c.m(xv).float() - yv).pow(2).mean().item().hex())
                c.m.train()
            return plain_step(c, *batch(c.i, None if eval_bad else BAD, clamp=fix))
        lp = loop(Net(40.0), steps, body)
        return lp
    return build


def test_eval_before_bad_step(tmp_path):
    r = both(_eval_first(False), BAD + 4, tmp_path)
    failure_truth(r, "fc2")
    producer_top3(r.rep, FWD, "fc2", BAD)


def test_eval_only_overflow_training_healthy(tmp_path):
    # the validation batches of steps 4 and 8 hold a raw record: fc2 overflows in eval only; training is healthy
    r = both(_eval_first(False, eval_bad=True), BAD + 4, tmp_path)
    healthy_truth(r, fall=1.0, oracle=False)
    assert r.loop.c.oracle.first == ("fc2", 4), r.loop.c.oracle.first  # in the validation pass before step 4
    assert not any(map(math.isfinite, map(float.fromhex, r.loop.extra))), r.loop.extra
    bad = [f.one_line() for f in r.rep.findings if f.severity in ("warning", "error")
           and not (f.rule in FWD and f.module == "fc2")]
    if bad:
        raise WrongAnswer(f"an eval-only overflow blamed on training: {bad[:3]}; top 3: {lines(r.rep)[:3]}")


def test_eval_before_step_clamped_twin(tmp_path):
    r = both(_eval_first(True), BAD + 6, tmp_path)
    healthy_truth(r, fall=1.0)
    quiet_healthy(r)


# 3 ---------------------------------------------------------------------------------------------------------------
def _mean_teacher(fix):
    def build(steps):
        def body(c):
            if c.i == 0:  # the teacher: a deep copy of the (already watched) student
                c.t = copy.deepcopy(c.m).requires_grad_(False)
                c.oracle = Producer(c.m)
            x, y = batch(c.i, BAD, clamp=fix)
            c.opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                with torch.no_grad():
                    tgt = c.t(x).float()
                out = c.m(x).float()
            loss = amp_update(c, (out - y).pow(2).mean() + 0.5 * (out - tgt).pow(2).mean())
            with torch.no_grad():
                for pt, ps in zip(c.t.parameters(), c.m.parameters()):
                    pt.lerp_(ps, 0.05)
            return loss
        return loop(Net(40.0), steps, body)
    return build


def test_mean_teacher_deepcopy_overflow(tmp_path):
    r = both(_mean_teacher(False), BAD + 4, tmp_path)
    failure_truth(r, "fc2")
    producer_top3(r.rep, FWD, "fc2", BAD)


def test_mean_teacher_clamped_twin(tmp_path):
    r = both(_mean_teacher(True), BAD + 6, tmp_path)
    healthy_truth(r, fall=1.0)
    quiet_healthy(r)


# 4 ---------------------------------------------------------------------------------------------------------------
SAVE_AT, ROLLBACK_AT = 0, 14


def _rollback(with_scaler):
    def build(steps):
        def body(c):
            if c.i == ROLLBACK_AT:  # a loss-spike rollback: model, optimizer (and scaler) from the checkpoint
                c.ck.seek(0)
                st = torch.load(c.ck, weights_only=True)
                c.m.load_state_dict(st["model"])
                c.opt.load_state_dict(st["opt"])
                if with_scaler:
                    c.sc.load_state_dict(st["scaler"])
            loss = plain_step(c, *batch(c.i))
            if c.i == SAVE_AT:
                c.ck = io.BytesIO()
                torch.save({"model": c.m.state_dict(), "opt": c.opt.state_dict(), "scaler": c.sc.state_dict()},
                           c.ck)
            return loss
        return loop(Net(), steps, body, lr=3e-3)
    return build


@pytest.mark.parametrize("with_scaler", [True, False], ids=["with_scaler", "model_opt_only"])
def test_rollback_to_early_checkpoint(tmp_path, with_scaler):
    r = both(_rollback(with_scaler), 24, tmp_path)
    assert all(map(math.isfinite, r.losses)), r.losses
    quiet_healthy(r)
