"""SILENT fp16 failures ("my fp16 fine-tune silently stopped learning") in setups the earlier silent sets
(test_silent_stop, test_silent_unseen, test_master_weights_eps, test_pole_underflow, test_underflow_transient) do not
build: no inf/NaN anywhere, the run goes on, and it stops learning (or learns far worse than fp32) because of fp16.

Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=sc or None, run_dir=...)` at the
default settings -> an ordinary CPU loop -> close() -> report()). Each failure is first proven by the test's own
oracle (a failing oracle is a plain failure, never an xfail): the share of elements with a nonzero gradient that
step() left unchanged, the buffer that never moved, the gradient lost to zero against an fp32 twin on the same
weights and batch, an fp32 twin that learns where the fp16 run does not. Then the rule (CONTRACT.md id), at the
module where the rule names one, among the first three findings with severity warning or error. A wrong report
raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. a `.half()` MLP trained with AdamW(lr 1e-2, eps 1e-4) under ExponentialLR(gamma 0.9) (lr 2e-5 at the end): the
    first steps learn, then the decayed lr falls below half an ulp and most updates round away (fc2: ~75% of the
    elements with a nonzero gradient left unchanged at steps 45-55, against ~20% at steps 20-30); the fp16 run
    ends at ~1.7x the fp32 twin's loss (update_underflow / fp16_master_weights).
 2. a mean-teacher (semi-supervised consistency) net whose EMA teacher weights are fp16 *buffers* written in place
    with decay 0.9999: the teacher stays on its initial weights (>90% of its elements never change), the fp32 twin's
    teacher follows the student (update_underflow: "an fp16 EMA copy your code writes").
 3. an auxiliary head whose loss term is weighted 1e-6, Adam, under `GradScaler(init_scale=1.0)` ("the default
    65536 skips the first steps"; growth_interval left at 2000, so the scale stays 1 over the run): the aux
    head's output gradient (~4e-9) is flushed to zero in fp16 (aux.weight.grad exactly 0), its loss term does not
    fall while the fp32 twin's does (underflow at
    `aux`, backward).
 4. a `.half()` regressor on raw (un-centred, ~50) targets, SGD(lr 3e-3) + clip_grad_norm_(1.0): the head bias's
    huge gradient sets the clip factor, so the body's clipped updates are ~100x smaller and round away (>90% of
    its elements with a nonzero gradient unchanged at every step) while the fp32 twin's body moves
    (update_underflow at `body`).
 5. a CLIP-style contrastive model `.half()`'d with its learnable logit_scale (log(1/0.07) = 2.66, ulp 2^-9) and
    AdamW(lr 1e-4): the scalar temperature never moves (its +-lr update is below half an ulp) while the projections
    do, the fp32 twin's logit_scale moves (update_underflow at the root, the logit_scale's module).
Healthy twins (no warning, no error): 1, 4 and 5 with fp32 weights under fp16 autocast + GradScaler (4: unscale_
then clip); 2 with fp32 EMA buffers; 3 with a default GradScaler.

Result when written: 8 pass, 2 xfail (stable over two runs); 9 pass, 1 xfail since. Top finding per case:
 1. PASS  `[error] fp16_master_weights at (root) step 0`, then `[error] update_underflow at fc1 step 40` (93%) and
    `... at fc2 step 40` (90%).
 2. XFAIL (wrong) when written `[]`: the report is empty. PASS since (record/params.py outside_snapshot reads
    fp16/bf16 buffers too): `[error] update_underflow at (root)`.
 3. XFAIL (wrong) `[]`: the report is empty.
 4. PASS  `[error] fp16_master_weights at (root) step 0`, then `[error] update_underflow at body step 0` (81%).
 5. PASS  `[error] fp16_master_weights at (root) step 0`, then `[error] update_underflow at (root) step 0` (100% of
    `logit_scale`'s sampled elements unchanged).
 Twins: all quiet (1 and 3: only `[info] overflow ... step 0` + `[info] skipped_steps` from the scaler's first
 backoff).

What ampdoctor got wrong (strict xfails via `wrong`, WrongAnswer only):
 2. says nothing; should say `update_underflow` (warning/error) at the root (the module owning the buffers) or at
    body/head: fp16 EMA *buffers* (register_buffer, written in place by the user's code) keep >90% of their elements
    at their initial values. record/params.py outside_snapshot samples only frozen fp16/bf16 *parameters*
    (requires_grad False), never buffers, so an EMA teacher kept as buffers is not seen.
 3. says nothing; should say `underflow` (backward) at `aux`: the scale is 1.0 all run (README: "the scale stays <=
    8 all run") and the aux head's whole output gradient (~4e-9) is flushed to zero in fp16, aux.weight.grad exactly
    0 every step (fp32 twin: nonzero, its aux term falls below 0.7x its start). Arguable: with no nonzero fp16 gradient left at
    `aux` there is no subnormal share to measure; but CONTRACT.md's `underflow` counts values "flushed to 0".
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import WrongAnswer, wrong
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def gen(i):
    return torch.Generator().manual_seed(2000 + i)


def expect(rep, rules, modules, severity=("warning", "error"), phase=None):
    """One of `rules` at one of `modules` among the first three findings with `severity`, else WrongAnswer."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.rule in rules and (modules is None or f.module in modules) and f.severity in severity \
                and (phase is None or f.phase in phase):
            return f
    raise WrongAnswer(f"wanted {rules} at {modules} {severity}; got: {lines(rep)[:3]}")


def quiet(rep):
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


def run(m, opt, batch, loss_fn, steps, run_dir, *, dtype=None, scaler=None, sched=None, after=None, watch=True):
    """zero_grad -> forward (autocast(dtype) if given) -> loss -> [scaler] backward -> [unscale_] -> step ->
    [update] -> [sched.step()] -> [after(i, m)], watched (`watch=False`: the unwatched twin). Returns (report,
    losses, per step {param: share of elements with a nonzero gradient left unchanged by step()})."""
    w = ampdoctor.watch(m, optimizer=opt, scaler=scaler, run_dir=str(run_dir)) if watch else None
    losses, rounded = [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        args, y = batch(i)
        if dtype is not None:
            with torch.autocast("cpu", dtype=dtype):
                out = m(*args)
        else:
            out = m(*args)
        loss = loss_fn(out, y, m)
        losses.append(loss.item())
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if sched is not None:
            sched.step()
        share = {}
        for n, p in m.named_parameters():
            if p.grad is not None and int((p.grad != 0).sum()):
                gnz = p.grad != 0
                share[n] = float(((p.detach() == before[n]) & gnz).sum() / gnz.sum())
        rounded.append(share)
        if after is not None:
            with torch.no_grad():
                after(i, m)
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return rep, losses, rounded


def mean(xs):
    return sum(xs) / len(xs)


# ======================================================================================================================
# 1./twin 1. a `.half()` MLP under a linear LR decay: the updates round away once the lr has decayed
# ======================================================================================================================
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)           # the `.half()` model's inputs follow its weights
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


W_MLP = torch.randn(16, 1, generator=gen(99)) * 0.5
STEPS1 = 60


def _mlp_batch(i):
    x = torch.randn(64, 16, generator=gen(i % 10))
    return (x,), x @ W_MLP


def _mse(out, y, m=None):
    return F.mse_loss(out.float(), y)


def _decay(opt):
    # lr 1e-2 -> 2e-5 over the run: ExponentialLR(gamma=0.9)
    return torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)


def _mlp_run(tmp, half, watch=True, scaler=False):
    torch.manual_seed(0)
    m = MLP().half() if half else MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4 if half else 1e-8)   # (1e-4: the "fp16 eps")
    sc = torch.amp.GradScaler("cpu") if scaler else None
    return run(m, opt, _mlp_batch, _mse, STEPS1, tmp, sched=_decay(opt), watch=watch, scaler=sc,
               dtype=torch.float16 if scaler else None)


def test_half_mlp_under_linear_lr_decay_stops_learning_once_updates_round_away(tmp_path):
    rep, losses, rounded = _mlp_run(tmp_path / "run", half=True)
    _, ref, _ = _mlp_run(tmp_path / "ref", half=False, watch=False)
    # truth: finite losses; late in the decay most elements with a nonzero gradient are left unchanged by step();
    # the fp16 run's late losses are above the fp32 twin's
    assert all(map(math.isfinite, losses))
    early, late = (mean([r["fc2.weight"] for r in rounded[k:k + 10]]) for k in (20, 45))
    assert late > 0.6 and late > 2 * early, (early, late)
    assert mean(losses[-10:]) > 1.3 * mean(ref[-10:]), (losses[-10:], ref[-10:])
    expect(rep, ("update_underflow", "fp16_master_weights"), ("", "fc1", "fc2", "head"))


def test_healthy_twin_fp32_mlp_under_autocast_and_scaler_with_lr_decay_is_quiet(tmp_path):
    rep, losses, _ = _mlp_run(tmp_path / "run", half=False, scaler=True)
    assert all(map(math.isfinite, losses)) and mean(losses[-10:]) < 0.5 * mean(losses[:5]), losses
    quiet(rep)


# ======================================================================================================================
# 2./twin 2. a mean teacher whose EMA weights are fp16 buffers written in place (decay 0.999)
# ======================================================================================================================
class MeanTeacher(nn.Module):
    def __init__(self, ema_dtype):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.decay = 0.9999
        for n, p in (("body_w", self.body.weight), ("head_w", self.head.weight)):
            self.register_buffer(f"ema_{n}", p.detach().clone().to(ema_dtype))

    def forward(self, x):
        s = self.head(torch.relu(self.body(x)))
        with torch.no_grad():
            h = torch.relu(F.linear(x, self.ema_body_w.to(x.dtype), self.body.bias))
            t = F.linear(h, self.ema_head_w.to(x.dtype), self.head.bias)
        return s, t

    @torch.no_grad()
    def update_teacher(self):
        for buf, p in ((self.ema_body_w, self.body.weight), (self.ema_head_w, self.head.weight)):
            buf.mul_(self.decay).add_(p.detach().to(buf.dtype), alpha=1 - self.decay)


def _mt_batch(i):
    x = torch.randn(32, 16, generator=gen(i % 8))
    return (x,), (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def _mt_loss(out, y, m=None):
    s, t = out
    s = s.float()
    return F.cross_entropy(s, y) + 0.1 * F.mse_loss(s.softmax(-1), t.float().softmax(-1))


def _mt_run(tmp, ema_dtype):
    torch.manual_seed(0)
    m = MeanTeacher(ema_dtype)
    w0 = m.ema_head_w.clone()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    rep, losses, _ = run(m, opt, _mt_batch, _mt_loss, 40, tmp, dtype=torch.float16, scaler=sc,
                         after=lambda i, m: m.update_teacher())
    return rep, losses, m, w0


def test_mean_teacher_with_fp16_ema_buffers_never_moves_its_teacher(tmp_path):
    rep, losses, m, w0 = _mt_run(tmp_path / "run", torch.float16)
    # truth: the student moved far from the teacher's start, but the fp16 EMA buffers are bit-identical to it (each
    # 1e-4 * (w' - w) increment is below half an ulp); the fp32 twin's teacher moved
    assert all(map(math.isfinite, losses))
    assert (m.head.weight.detach() - w0.float()).abs().max() > 0.05
    assert float((m.ema_head_w == w0).float().mean()) > 0.9, float((m.ema_head_w == w0).float().mean())
    _, _, m32, w32 = _mt_run(tmp_path / "ref", torch.float32)
    assert float((m32.ema_head_w != w32).float().mean()) > 0.9
    expect(rep, "update_underflow", ("", "body", "head"))


def test_healthy_twin_mean_teacher_with_fp32_ema_buffers_is_quiet(tmp_path):
    rep, losses, m, w0 = _mt_run(tmp_path / "run", torch.float32)
    assert all(map(math.isfinite, losses)) and float((m.ema_head_w != w0).float().mean()) > 0.9
    quiet(rep)


# ======================================================================================================================
# 3./twin 3. an aux head whose loss is weighted 1e-6 under GradScaler(init_scale=1.0)
# ======================================================================================================================
class AuxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 64)
        self.main = nn.Linear(64, 1)
        self.aux = nn.Linear(64, 8)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.main(h), self.aux(h.detach())     # the aux head trains on frozen trunk features


def _aux_batch(i):
    x = torch.randn(64, 16, generator=gen(i % 6))
    return (x,), (x[:, :1], x[:, 8:])


def _aux_loss(out, y, m=None):
    main, aux = out
    return F.mse_loss(main.float(), y[0]) + 1e-6 * F.mse_loss(aux.float(), y[1])


def _aux_term(m, i):
    (x,), y = _aux_batch(i)
    with torch.no_grad():
        return float(F.mse_loss(m.aux(torch.relu(m.trunk(x))), y[1]))


def _aux_run(tmp, scaler, dtype=torch.float16):
    torch.manual_seed(0)
    m = AuxNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)   # (Adam: its update does not depend on the 1e-6 weight)
    a0 = _aux_term(m, 0)
    rep, losses, _ = run(m, opt, _aux_batch, _aux_loss, 30, tmp, dtype=dtype, scaler=scaler)
    return rep, losses, m, a0


@wrong("an empty report (no finding at all); truth: at scale 1.0 all run the aux head's output gradient (~4e-9) is "
       "flushed to zero in fp16, aux.weight.grad is exactly 0 every step (fp32 twin: nonzero) and the aux term never "
       "falls: underflow (backward) at `aux`, README: 'the scale stays <= 8 all run'")
def test_aux_loss_weighted_1e_6_under_a_scaler_started_at_1_underflows(tmp_path):
    sc = torch.amp.GradScaler("cpu", init_scale=1.0)   # "the default 65536 skips the first steps": start at 1
    rep, losses, m, a0 = _aux_run(tmp_path / "run", sc)
    # truth: scale 1.0 all run; the aux head's gradient (1e-6 * 2 (aux - y) / 512 ~ 4e-9) is fp16-subnormal:
    # its weight gradient is mostly lost against fp32; the aux term barely falls while the fp32 twin's does
    assert sc.get_scale() == 1.0 and all(map(math.isfinite, losses))
    _, _, m32, a32 = _aux_run(tmp_path / "ref", None, dtype=None)
    a_end, a32_end = _aux_term(m, 0), _aux_term(m32, 0)
    assert a32_end < 0.7 * a32 and a_end > 0.9 * a0, (a0, a_end, a32, a32_end)
    assert not m.aux.weight.grad.any() and m32.aux.weight.grad.abs().max() > 0   # (the last step's gradients)
    f = expect(rep, "underflow", ("aux",))
    assert f.phase in ("backward", None), f.one_line()


def test_healthy_twin_aux_loss_weighted_1e_6_under_a_default_scaler_is_quiet(tmp_path):
    sc = torch.amp.GradScaler("cpu")
    rep, losses, m, a0 = _aux_run(tmp_path / "run", sc)
    assert all(map(math.isfinite, losses)) and _aux_term(m, 0) < 0.7 * a0
    quiet(rep)


# ======================================================================================================================
# 4. a `.half()` regressor on raw (un-centred) targets, SGD + clip_grad_norm_(1.0): the head bias's huge gradient
#    sets the clip factor, the body's clipped updates round away
# ======================================================================================================================
class Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x.to(self.body.weight.dtype))))


W_RAW = torch.randn(16, 1, generator=gen(77))


def _raw_batch(i):
    x = torch.randn(64, 16, generator=gen(i % 6))
    return (x,), 50.0 + x @ W_RAW           # raw targets around 50 (not standardised)


def _raw_run(m, run_dir=None, steps=40):
    """The user's loop (no autocast, no scaler: the model is `.half()`'d), watched when `run_dir` is given. Returns
    (per step the share of body.weight's elements with a nonzero gradient left unchanged, the share of body.weight
    that moved over the run, the report or None)."""
    opt = torch.optim.SGD(m.parameters(), lr=3e-3)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=str(run_dir)) if run_dir is not None else None
    w0 = m.body.weight.detach().float().clone()
    rounded = []
    for i in range(steps):
        opt.zero_grad()
        (x,), y = _raw_batch(i)
        F.mse_loss(m(x).float(), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = m.body.weight.detach().clone()
        opt.step()
        g = m.body.weight.grad != 0
        rounded.append(float(((m.body.weight.detach() == before) & g).sum() / g.sum()))
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return rounded, float((m.body.weight.detach().float() != w0).float().mean()), rep


def test_half_regressor_on_raw_targets_clipped_to_1_rounds_the_body_updates_away(tmp_path):
    torch.manual_seed(0)
    m = Raw()
    m32 = copy.deepcopy(m)
    rounded, moved, rep = _raw_run(m.half(), tmp_path / "run")
    _, moved32, _ = _raw_run(m32)
    # truth: the head's bias takes nearly all of the clipped norm; the body's updates (lr * g / ~100) are below half
    # an ulp: >90% of its elements with a nonzero gradient are left unchanged at every step, while the fp32 twin's
    # body moves in most elements
    assert min(rounded) > 0.9, rounded
    assert moved < 0.3 and moved32 > 0.9, (moved, moved32)
    expect(rep, "update_underflow", ("body",))


def test_healthy_twin_fp32_regressor_on_raw_targets_under_autocast_scaler_and_clip_is_quiet(tmp_path):
    torch.manual_seed(0)
    m = Raw()
    opt = torch.optim.SGD(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w0 = m.body.weight.detach().clone()
    losses = []
    with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(tmp_path / "run")) as w:
        for i in range(40):
            opt.zero_grad()
            (x,), y = _raw_batch(i)
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
            loss = F.mse_loss(out.float(), y)
            losses.append(loss.item())
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
    assert all(map(math.isfinite, losses)), losses
    assert float((m.body.weight.detach() != w0).float().mean()) > 0.9
    quiet(w.report())


# ======================================================================================================================
# 5. a CLIP-style model `.half()`'d: the learnable logit_scale (2.66, ulp 2^-9) never moves under AdamW(lr 1e-4)
# ======================================================================================================================
class Clip(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Linear(24, 16)
        self.txt = nn.Linear(12, 16)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a, b):
        ia, tb = F.normalize(self.img(a), dim=-1), F.normalize(self.txt(b), dim=-1)
        return self.logit_scale.exp() * ia @ tb.t()


P_IMG = torch.randn(24, 12, generator=gen(55))


def _clip_batch(i, dtype=torch.float16):
    a = torch.randn(32, 24, generator=gen(i % 8))
    b = a @ P_IMG / 5 + 0.1 * torch.randn(32, 12, generator=gen(100 + i))
    return (a.to(dtype), b.to(dtype)), torch.arange(32)


def _clip_loss(out, y, m=None):
    out = out.float()
    return (F.cross_entropy(out, y) + F.cross_entropy(out.t(), y)) / 2


def test_half_clip_logit_scale_never_moves_under_adamw_1e_4(tmp_path):
    torch.manual_seed(0)
    m = Clip()
    m32 = copy.deepcopy(m)
    m = m.half()
    s0 = m.logit_scale.detach().clone()
    rep, losses, rounded = run(m, torch.optim.AdamW(m.parameters(), lr=1e-4, eps=1e-4), _clip_batch, _clip_loss, 30,
                               tmp_path / "run")
    _, _, _ = run(m32, torch.optim.AdamW(m32.parameters(), lr=1e-4), lambda i: _clip_batch(i, torch.float32),
                  _clip_loss, 30, None, watch=False)
    # truth: finite losses; the logit_scale has a nonzero gradient every step and never changes in fp16, while the
    # fp32 twin's moves by ~30 * lr
    assert all(map(math.isfinite, losses))
    assert all(r.get("logit_scale") == 1.0 for r in rounded), [r.get("logit_scale") for r in rounded]
    assert torch.equal(m.logit_scale.detach(), s0)
    assert abs(float(m32.logit_scale.detach()) - math.log(1 / 0.07)) > 1e-3
    assert mean([r["img.weight"] for r in rounded[5:]]) < 0.5, [r["img.weight"] for r in rounded]
    f = expect(rep, "update_underflow", ("",))
    if "logit_scale" not in f.message + str(f.evidence):
        raise WrongAnswer(f"update_underflow at the root without naming logit_scale: {f.one_line()}")


def test_healthy_twin_fp32_clip_under_autocast_and_scaler_is_quiet(tmp_path):
    torch.manual_seed(0)
    m = Clip()
    s0 = float(m.logit_scale.detach())
    rep, losses, _ = run(m, torch.optim.AdamW(m.parameters(), lr=1e-4), lambda i: _clip_batch(i, torch.float32),
                         _clip_loss, 30, tmp_path / "run", dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    assert all(map(math.isfinite, losses)) and abs(float(m.logit_scale.detach()) - s0) > 1e-3
    quiet(rep)
