"""OPTIMIZER / weight-update side failures of low-precision training, in ordinary user loops (what the earlier silent
and master-weight sets do not build: a hand-rolled static loss scale, a fused optimizer on fp16 parameters that
GradScaler accepts, fp16 `.grad` accumulation, a second optimizer stepped on scaled gradients, a per-group lr typo,
a cosine schedule on bf16 weights, a hand-rolled master-weight loop that never copies back).

Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=sc or None, run_dir=...)` at the
default settings -> the loop -> close() -> report()). Each failure is first proven by the test's own oracle (a failing
oracle is a plain failure, never an xfail): weights non-finite right after a step() whose gradients were finite, the
micro-batch whose accumulation into `.grad` made it inf while every module's own gradient was finite, the share of
elements with a nonzero gradient that step() left unchanged, a weight-norm jump, the fp32-recipe twin learning where
the failing run does not. Then the CONTRACT.md rule at the module and step among the first three findings (warning
or error). A wrong report raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. `.half()` MLP, torch Adam (eps 1e-8) with a hand-rolled static loss scale (loss * 1024, grads / 1024): fp16
    exp_avg_sq underflows to 0 and eps is 0, every weight is inf/NaN after step 0 (eps_underflow /
    fp16_master_weights, root or null, step 0, error).
 2. `.half()` MLP, `AdamW(fused=True)` under GradScaler (the fused step unscales fp16 grads itself, so torch raises
    nothing): lr 1e-4 updates round away on fp16 weights, ~30-40% of fc1's updated elements unchanged after 35 steps
    and growing (fp16_master_weights / update_underflow, warning or error).
 3. the same run: the fused kernel keeps eps in fp32 (elements with an all-zero gradient stay exactly 0, finite):
    no eps_underflow at warning/error and no message claiming the updates went non-finite.
 4. `.half()` regressor, sum-reduced loss on raw-scale targets, 64 micro-batches accumulated into fp16 `.grad`: each
    micro-batch's gradients are finite, `head.weight.grad` becomes inf in micro-batch 56 of step 0's accumulation
    (overflow at `head`, step 0, error).
 5. a second optimizer (SGD for the head) stepped with `opt_head.step()` on still-scaled gradients while the body's
    goes through `scaler.step`: the head's weights blow up x2.6e3 at step 0 (scaler_misorder, step 0).
 6. an AdamW param group for `mid` with lr 1.0 (a 1e3x typo of 1e-3): `mid`'s weight norm >5x at step 0, the next
    loss >5x the first, the scaled backward downstream overflows (update_spike at `mid`, step 0).
 7. `.to(bfloat16)` MLP, AdamW(2e-3) with CosineAnnealingLR to 1e-6: as the lr decays most updates round away
    (>90% of fc1's elements with a nonzero gradient unchanged at the end) (update_underflow at a Linear).
 8. a hand-rolled master-weight loop (fp32 copies in the optimizer, grads copied over) that forgets to copy the
    masters back into the `.half()` model: the model's weights never change in 20 steps (update_underflow /
    fp16_master_weights / update_spike..., any warning or error at the root or a Linear).
Healthy twins (quiet, losses and weights bitwise identical with and without the watch): 1 (fp32 weights, fp16
autocast, GradScaler, Adam), 2 (fused AdamW on fp32 weights under autocast + GradScaler), 4 (fp32 weights, autocast,
GradScaler, mean loss / 64), 5 (both optimizers through the scaler), 6 (one lr), 7 (fp32 weights under bf16 autocast).

Result when written: 12 pass, 2 xfail (stable over three runs, ~4 s); 3 and 8 fixed since (14 pass).
 3. XFAIL when written (wrong; fixed since: the run's meta records a fused group, whose eps rules/weights.py no
    longer calls vanished): `[error] eps_underflow at (root) optimizer.step: AdamW uses eps=1e-08 on fp16 parameters: it
    rounds to 0 in fp16, so the update divides by sqrt(v) + 0 and any parameter with v == 0 gets inf/NaN.` and
    fp16_master_weights's "Its eps rounds to 0 in fp16 too, which is how the updates went non-finite": the fused
    AdamW kernel computes in fp32 (zero-gradient elements stay 0), and no weight ever went non-finite.
 8. XFAIL when written (wrong; fixed since: the forwards after a sampled step compare the model's weights with its
    masters, record/params.py masters_compare, and update_underflow says the masters are never copied back):
    the report was empty; the fp16 model never changed while its optimizer stepped fp32 copies.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def gen(i):
    return torch.Generator().manual_seed(7100 + i)


W_TRUE = torch.randn(16, 1, generator=gen(999)) * 0.5


def batch(i, n=32, scale=1.0, cycle=8):
    x = torch.randn(n, 16, generator=gen(i % cycle))
    return x, torch.sin(x @ W_TRUE) * scale


class Net(nn.Module):
    def __init__(self, seed=0, act=torch.tanh):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.mid, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)
        self.act = act

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)
        return self.head(self.act(self.mid(self.act(self.fc1(x)))))


def mse(o, y):
    return F.mse_loss(o.float(), y.float())


def go(m, opt, it, steps, run_dir, *, sc=None, watch=True):
    """watch(m, optimizer=opt, scaler=sc, run_dir) -> it(i) per step (returns the loss) -> close -> report.
    `watch=False`: the same loop unwatched. Returns (report or None, losses, final state dict)."""
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(run_dir)) if watch else None
    losses = [it(i) for i in range(steps)]
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return rep, losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def expect(rep, rules, modules, steps=None, severity=("warning", "error")):
    """One of `rules` at one of `modules` among the first three findings, step in `steps` (None: any)."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.rule in rules and f.module in modules and f.severity in severity \
                and (steps is None or f.step in steps):
            return f
    raise WrongAnswer(f"wanted {rules} at {modules} steps {steps}; top 3: {lines(rep)[:3]}")


def twin(build, steps, tmp_path, fall=0.9):
    """A healthy twin: `build()` -> (m, opt, sc, it). Watched and unwatched on fresh copies: losses and final weights
    bitwise identical, every loss finite and falling, the report quiet."""
    m, opt, sc, it = build()
    rep, losses, sd = go(m, opt, it, steps, tmp_path / "run", sc=sc)
    m2, opt2, sc2, it2 = build()
    _, losses2, sd2 = go(m2, opt2, it2, steps, None, sc=sc2, watch=False)
    assert all(map(math.isfinite, losses)), losses
    k = max(2, steps // 5)
    assert sum(losses[-k:]) < fall * sum(losses[:k]), losses
    assert losses == losses2, (losses, losses2)
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)
    assert rep.summary["steps"] >= 1, rep.summary
    return losses


def amp_it(m, opt, sc, bt=batch, dtype=torch.float16):
    """The correct recipe: fp32 weights, autocast(dtype), [GradScaler: scale -> unscale_ -> step -> update]."""
    def it(i):
        opt.zero_grad()
        x, y = bt(i)
        with torch.autocast("cpu", dtype=dtype):
            out = m(x)
        loss = mse(out, y)
        if sc is None:
            loss.backward()
            opt.step()
        else:
            sc.scale(loss).backward()
            sc.unscale_(opt)
            sc.step(opt)
            sc.update()
        return loss.item()
    return it


# ======================================================================================================================
# 1. pure fp16 Adam with a hand-rolled static loss scale
# ======================================================================================================================
def test_half_adam_with_static_loss_scale_goes_nonfinite_at_step_0(tmp_path):
    m = Net().half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    seen = []

    def it(i):
        opt.zero_grad()
        x, y = batch(i)
        loss = mse(m(x), y)
        (loss * 1024).backward()
        for p in m.parameters():
            p.grad.div_(1024)
        gfin = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
        opt.step()
        seen.append((gfin, all(bool(torch.isfinite(p).all()) for p in m.parameters())))
        return loss.item()

    rep, losses, _ = go(m, opt, it, 5, tmp_path / "run")
    # oracle: step 0 had finite grads and a finite loss; its update made the weights non-finite
    assert seen[0] == (True, False) and math.isfinite(losses[0]) and not math.isfinite(losses[1]), (seen, losses)
    expect(rep, ("eps_underflow", "fp16_master_weights"), ("", None), steps=(0, None), severity=("error",))


def test_healthy_twin_fp32_adam_under_autocast_and_scaler_is_quiet(tmp_path):
    def build():
        m = Net()
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        sc = torch.amp.GradScaler("cpu")
        return m, opt, sc, amp_it(m, opt, sc)
    twin(build, 30, tmp_path)


# ======================================================================================================================
# 2./3. fused AdamW on fp16 parameters under GradScaler
# ======================================================================================================================
def _zero_col_batch(i):
    x, y = batch(i)
    x[:, 0] = 0.0                    # a feature that is always 0 (a padding channel): fc1.weight[:, 0] gets grad 0
    return x, y


def _fused_half_run(tmp_path, watch=True):
    m = Net().half()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    sc = torch.amp.GradScaler("cpu")
    rounded = []

    def it(i):
        opt.zero_grad()
        x, y = _zero_col_batch(i)
        loss = mse(m(x), y)
        sc.scale(loss).backward()
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        s0 = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() >= s0:       # a step taken
            g = m.fc1.weight.grad != 0
            rounded.append(float(((m.fc1.weight == before["fc1.weight"]) & g).sum() / g.sum()))
        return loss.item()

    rep, losses, sd = go(m, opt, it, 40, tmp_path / "run", sc=sc, watch=watch)
    return rep, losses, sd, rounded


@pytest.fixture(scope="module")
def fused_half(tmp_path_factory):
    return _fused_half_run(tmp_path_factory.mktemp("fused"))


def test_fused_adamw_on_half_params_under_grad_scaler_rounds_updates_away(fused_half):
    rep, losses, sd, rounded = fused_half
    assert all(torch.isfinite(v).all() for v in sd.values()) and all(map(math.isfinite, losses))
    # oracle: a growing share (>30% at the end) of fc1's elements with a nonzero gradient is left unchanged by step()
    assert sum(rounded[-5:]) / 5 > 0.3 and sum(rounded[-5:]) > sum(rounded[1:6]), rounded
    expect(rep, ("fp16_master_weights", "update_underflow"), ("", None, "fc1", "mid", "head"))


def test_fused_adamw_on_half_params_keeps_eps_in_fp32_no_eps_underflow(fused_half):
    rep, losses, sd, _ = fused_half
    # oracle: fc1.weight[:, 0] had an all-zero gradient (v == 0) every step and is still exactly its init (0/0 with a
    # vanished eps would be NaN); every weight is finite
    assert torch.equal(sd["fc1.weight"][:, 0], Net().half().state_dict()["fc1.weight"][:, 0])
    assert all(torch.isfinite(v).all() for v in sd.values())
    bad = [f.one_line() for f in rep.findings if f.severity in ("warning", "error")
           and (f.rule == "eps_underflow" or "non-finite" in f.message)]
    if bad:
        raise WrongAnswer(bad)


def test_healthy_twin_fused_adamw_on_fp32_weights_under_autocast_and_scaler_is_quiet(tmp_path):
    def build():
        m = Net()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        sc = torch.amp.GradScaler("cpu")
        return m, opt, sc, amp_it(m, opt, sc, bt=_zero_col_batch)
    twin(build, 30, tmp_path)


# ======================================================================================================================
# 4. fp16 .grad accumulation over 64 micro-batches overflows
# ======================================================================================================================
ACC = 64


def _raw_batch(i, k=0):
    return batch(i * ACC + k, n=64, scale=150.0, cycle=10 ** 6)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_half_grad_accumulation_over_64_micro_batches_overflows_head_grad_at_step_0(tmp_path):
    m = Net().half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-4)
    orc = Producer(m, backward=True)
    first_inf = []

    def it(i):
        orc.step = i
        opt.zero_grad()
        tot = 0.0
        for k in range(ACC):
            x, y = _raw_batch(i, k)
            loss = ((m(x).float() - y) ** 2).sum()
            loss.backward()
            tot += loss.item()
            if not first_inf and not torch.isfinite(m.head.weight.grad).all():
                first_inf.append((i, k, orc.first_bwd))
        opt.step()
        return tot / ACC

    rep, losses, _ = go(m, opt, it, 3, tmp_path / "run")
    orc.remove()
    # oracle: the forward and every module's own gradient were finite in step 0; the sum in .grad overflowed
    assert math.isfinite(losses[0]) and first_inf and first_inf[0][0] == 0 and first_inf[0][1] > 0, first_inf
    assert first_inf[0][2] is None and (orc.first is None or orc.first[1] >= 1), (first_inf, orc.first)
    expect(rep, "overflow", ("head",), steps=(0,), severity=("error",))


def test_healthy_twin_fp32_weights_accumulating_64_mean_losses_under_scaler_is_quiet(tmp_path):
    def build():
        m = Net()
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        sc = torch.amp.GradScaler("cpu")

        def it(i):
            opt.zero_grad()
            tot = 0.0
            for k in range(ACC // 4):
                x, y = batch(i * 16 + k, n=16, cycle=128)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = m(x)
                loss = mse(out, y)
                tot += loss.item()
                sc.scale(loss / (ACC // 4)).backward()
            sc.unscale_(opt)
            sc.step(opt)
            sc.update()
            return tot / (ACC // 4)
        return m, opt, sc, it
    twin(build, 16, tmp_path)


# ======================================================================================================================
# 5. a second optimizer stepped directly on scaled gradients
# ======================================================================================================================
def _two_opt(misuse):
    m = Net()
    body = torch.optim.AdamW(list(m.fc1.parameters()) + list(m.mid.parameters()), lr=1e-3)
    head = torch.optim.SGD(m.head.parameters(), lr=1e-2, momentum=0.9)
    sc = torch.amp.GradScaler("cpu")

    def it(i):
        body.zero_grad()
        head.zero_grad()
        x, y = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = mse(out, y)
        sc.scale(loss).backward()
        sc.unscale_(body)
        sc.step(body)
        if misuse:
            head.step()                 # forgot: scaler.step(head)
        else:
            sc.unscale_(head)
            sc.step(head)
        sc.update()
        return loss.item()
    return m, body, sc, it


def test_head_optimizer_stepped_directly_on_scaled_grads_is_scaler_misorder(tmp_path):
    m, body, sc, it = _two_opt(True)
    w0 = m.head.weight.detach().norm().item()
    w = ampdoctor.watch(m, optimizer=body, scaler=sc, run_dir=str(tmp_path / "run"))
    losses = [it(0)]
    w1 = m.head.weight.detach().norm().item()
    losses += [it(i) for i in range(1, 6)]
    w.close()
    rep = w.report()
    # oracle: the head's weights x>100 at step 0, the run non-finite soon after
    assert w1 > 100 * w0 and not all(map(math.isfinite, losses)), (w0, w1, losses)
    expect(rep, "scaler_misorder", ("", None, "head"), steps=(0, None), severity=("error",))


def test_healthy_twin_both_optimizers_through_the_scaler_is_quiet(tmp_path):
    twin(lambda: _two_opt(False), 30, tmp_path)


# ======================================================================================================================
# 6. a param group's lr 1e3x too large
# ======================================================================================================================
def _groups(mid_lr):
    m = Net(act=F.gelu)
    rest = [p for n, p in m.named_parameters() if not n.startswith("mid.")]
    opt = torch.optim.AdamW([{"params": rest}, {"params": list(m.mid.parameters()), "lr": mid_lr}], lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    return m, opt, sc, amp_it(m, opt, sc)


def test_param_group_lr_typo_blows_up_mid_at_step_0(tmp_path):
    m, opt, sc, it = _groups(1.0)
    w0 = m.mid.weight.detach().norm().item()
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(tmp_path / "run"))
    losses = [it(0)]
    w1 = m.mid.weight.detach().norm().item()
    losses += [it(i) for i in range(1, 12)]
    w.close()
    rep = w.report()
    # oracle: mid's weights x>5 by step 0's update, the next loss >5x the first; the twin with one lr learns
    assert w1 > 5 * w0 and losses[1] > 5 * losses[0], (w0, w1, losses)
    expect(rep, "update_spike", ("mid",), steps=(0,))


def test_healthy_twin_one_lr_for_every_group_is_quiet(tmp_path):
    twin(lambda: _groups(1e-3), 30, tmp_path)


# ======================================================================================================================
# 7. bf16 weights under a cosine schedule to 1e-6
# ======================================================================================================================
COS = 120


def test_bf16_weights_under_cosine_decay_round_their_updates_away(tmp_path):
    m = Net().to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.0)
    sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=COS, eta_min=1e-6)
    rounded = []

    def it(i):
        opt.zero_grad()
        x, y = batch(i)
        loss = mse(m(x), y)
        loss.backward()
        before = m.fc1.weight.detach().clone()
        opt.step()
        sch.step()
        g = m.fc1.weight.grad != 0
        rounded.append(float(((m.fc1.weight == before) & g).sum() / g.sum()))
        return loss.item()

    rep, losses, _ = go(m, opt, it, COS, tmp_path / "run")
    # oracle: few updates round away early, nearly all at the end
    assert max(rounded[:3]) < 0.15 and min(rounded[-10:]) > 0.9, rounded
    expect(rep, ("update_underflow", "fp16_master_weights"), ("", None, "fc1", "mid", "head"))


def test_healthy_twin_fp32_weights_under_bf16_autocast_and_cosine_is_quiet(tmp_path):
    def build():
        m = Net()
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.0)
        sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=COS, eta_min=1e-6)
        base = amp_it(m, opt, None, dtype=torch.bfloat16)

        def it(i):
            loss = base(i)
            sch.step()
            return loss
        return m, opt, None, it
    twin(build, COS, tmp_path)


# ======================================================================================================================
# 8. a hand-rolled master-weight loop that never copies back
# ======================================================================================================================
def test_hand_rolled_masters_never_copied_back_leave_the_half_model_frozen(tmp_path):
    m = Net().half()
    master = [p.detach().float().clone().requires_grad_() for p in m.parameters()]
    m0 = [p.detach().clone() for p in master]
    opt = torch.optim.AdamW(master, lr=1e-3)
    p0 = [p.detach().clone() for p in m.parameters()]

    def it(i):
        m.zero_grad()
        x, y = batch(i)
        loss = mse(m(x), y)
        (loss * 128).backward()
        for mp, p in zip(master, m.parameters()):
            mp.grad = p.grad.float() / 128
        opt.step()
        # forgot: for mp, p in zip(master, m.parameters()): p.data.copy_(mp.data)
        return loss.item()

    rep, losses, _ = go(m, opt, it, 20, tmp_path / "run")
    # oracle: the masters moved, the model the forward runs is bit-identical to its start
    assert all(torch.equal(a, b) for a, b in zip(p0, m.parameters()))
    assert all(not torch.equal(a, b) for a, b in zip(m0, master))
    if not alarms(rep.findings):
        raise WrongAnswer("report empty of warnings/errors: " + repr(lines(rep)))
    expect(rep, ("update_underflow", "fp16_master_weights"), ("", None, "fc1", "mid", "head"))
