"""A loop that keeps its own loss scale (fairseq's DynamicLossScaler, Megatron's, apex's FP16_Optimizer; no
GradScaler) skips the optimizer step itself when the gradient norm is inf and zeroes the gradients at the top of the
next iteration. ampdoctor's steps are optimizer steps (CONTRACT.md: `step`, the optimizer step), so each
thrown-away iteration joins the step that comes (its opening search is one step:
rules/backoff.loop_opening_search), as fairseq's own `num_updates` counts (tests/test_unseen_variants60.py). A
zero_grad that clears inf/NaN gradients in an open step with no optimizer step is counted on that step
(record/optsink.discards_iteration, `StepRecord.discarded`, the summary's `thrown_away_iterations`); the step
numbers stay the optimizer's. (For a while this session numbered the steps after a thrown-away iteration by the loop's
iteration instead; test_unseen_variants60's fairseq cases pin the optimizer step, and the contract says so.)

Real torch, real CPU fp16 autocast; the loops' skips are their own, recorded by the loop itself."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import DynamicLossScaler
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _own_scaler_run(bad, iters, init_scale=2.0 ** 22):
    """The fairseq-style loop; from iteration `bad` on the features arrive unnormalised (x3000): the last Linear's
    weight gradient overflows at every scale. Returns (report, records' steps, the loop's skipped iterations)."""
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt)
    sc, g, skipped = DynamicLossScaler(init_scale), torch.Generator().manual_seed(1), []
    for it in range(iters):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        if bad is not None and it >= bad:
            x = x * 3000
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        (F.mse_loss(out.float(), y) * sc.scale).backward()
        gn = torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")) / sc.scale
        overflow = not math.isfinite(gn)
        sc.update(overflow)
        if overflow:
            skipped.append(it)
            continue
        for p in m.parameters():
            p.grad.div_(sc.scale)
        opt.step()
    w.close()
    return w.report(), [r.step for r in w.steps], skipped


def test_a_failure_after_the_loops_own_skips_is_dated_by_optimizer_step():
    rep, steps, skipped = _own_scaler_run(bad=20, iters=30)
    # the loop's own search skipped a few early iterations; from 20 on every iteration is skipped
    early = [s for s in skipped if s < 20]
    assert len(early) >= 3 and skipped[len(early):] == list(range(20, 30)), skipped
    step = 20 - len(early)  # the optimizer steps before iteration 20: the step iteration 20 belongs to
    f = next((f for f in rep.findings[:3] if f.rule == "overflow" and f.module == "4"), None)
    assert f is not None, [x.one_line() for x in rep.findings]
    assert f.step == step, f.one_line()
    assert steps[-1] == step, steps  # the step that never reached an optimizer step
    # every skipped iteration is counted: each by the next iteration's zero_grad, the last at close
    assert rep.summary["thrown_away_iterations"] == len(skipped), rep.summary
    g = next((f for f in rep.findings if f.rule == "skipped_steps"), None)
    assert g is not None and g.severity == "error" and g.step == step, [x.one_line() for x in rep.findings]


def test_healthy_own_scaler_steps_are_optimizer_steps():
    rep, steps, skipped = _own_scaler_run(bad=None, iters=40)
    assert skipped and skipped[0] == 0, skipped  # (the search from 2**22, then the scale's periodic growth)
    assert [f.one_line() for f in rep.findings if f.severity != "info"] == []
    # one record per optimizer update, numbered 0, 1, 2, ...: the thrown-away iterations join the step that comes
    assert steps == list(range(40 - len(skipped))), (steps, skipped)
    # each skip is thrown away by the next iteration's zero_grad (the last iteration's would be by the next one's)
    assert rep.summary["thrown_away_iterations"] == len([s for s in skipped if s < 39]), rep.summary


def test_finite_gradients_cleared_between_backwards_are_no_skip():
    """An adversarial-training step without a GradScaler (FGSM: a backward for the input's gradient, zero_grad, the
    real backward, the optimizer step): its zero_grad clears finite gradients mid-step every iteration, and the steps
    stay numbered 0, 1, 2, ..."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    w = ampdoctor.watch(m, optimizer=opt)
    g = torch.Generator().manual_seed(2)
    for _ in range(12):
        x, y = torch.randn(32, 16, generator=g).requires_grad_(), torch.randn(32, 4, generator=g)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            F.mse_loss(m(x).float(), y).backward()
        x_adv = (x + 0.01 * x.grad.sign()).detach()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            F.mse_loss(m(x_adv).float(), y).backward()
        opt.step()
    w.close()
    assert [r.step for r in w.steps] == list(range(12))
    assert [f.one_line() for f in w.report().findings if f.severity != "info"] == []
