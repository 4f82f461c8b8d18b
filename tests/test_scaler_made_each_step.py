"""A GradScaler created inside the loop body (`scaler = torch.amp.GradScaler()` one line too low): each iteration's
scaler starts at init_scale, skips its first step when the scaled gradients overflow, backs off, and is thrown away,
so the next one starts at init_scale again. Every step is skipped and the weights never move. ampdoctor named the
rule (`skipped_steps`, error) but gave the wrong cause ("the scaler's backoff_factor leaves it where it is") and fix
(call update() without an argument); found by tests/test_loop_misuse_unseen2.py N1 (thirty-sixth session). The
recorder marks the first call of every scaler it adopts (`extra["adopted"]`): a pinned scale whose skipped steps each
adopted a new scaler is this loop. A loop that makes its scaler once, before the loop, is the twin: it backs off and
trains, with the usual opening skips only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import misuse_batch, misuse_net
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def _run(inside: bool, steps=8):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    w0 = [p.detach().clone() for p in m.parameters()]
    w = ampdoctor.watch(m, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g) * 4
    sc = None if inside else torch.amp.GradScaler("cpu")
    for _ in range(steps):
        if inside:
            sc = torch.amp.GradScaler("cpu")  # a new scaler every iteration
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        sc.scale(F.mse_loss(out.float(), y, reduction="sum")).backward()
        sc.unscale_(opt)
        sc.step(opt)
        sc.update()
    rep = w.report()
    w.close()
    moved = any(not torch.equal(a, b) for a, b in zip(w0, m.parameters()))
    return rep, moved


def test_a_scaler_made_every_iteration_is_named_as_such():
    rep, moved = _run(inside=True)
    assert not moved  # every step skipped: the weights never changed
    f = next((f for f in rep.findings if f.rule == "skipped_steps" and f.severity == "error"), None)
    assert f is not None, [(x.rule, x.severity) for x in rep.findings]
    assert "backoff_factor leaves it" not in f.message, f.message
    assert "new GradScaler" in f.message and "every iteration" in f.message, f.message
    assert "once" in f.fix and "before the loop" in f.fix, f.fix


def test_a_scaler_made_once_backs_off_and_trains():
    rep, moved = _run(inside=False, steps=24)
    assert moved
    assert not any(f.rule == "skipped_steps" and f.severity == "error" for f in rep.findings), \
        [(x.rule, x.severity, x.message[:80]) for x in rep.findings]


def _output_grad_overflow(scaler_inside: bool):
    """A sum-reduced loss whose scaled gradient overflows fp16 at the model's output: with a GradScaler made in the
    loop body, or with a hand-made fixed multiplier (no GradScaler). Returns the report's output-gradient finding."""
    m = misuse_net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt)
    for i in range(10):
        x, y = misuse_batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = F.mse_loss(out.float(), y, reduction="sum")
        if scaler_inside:
            sc = torch.amp.GradScaler("cpu")
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
            sc.step(opt)
            sc.update()
        else:
            (loss * 65536.0).backward()
            if all(torch.isfinite(p.grad).all() for p in m.parameters()):
                opt.step()
    w.close()
    rep = w.report()
    return next((f for f in rep.findings[:3] if f.rule == "overflow" and f.phase == "backward"
                 and f.module in (None, "", "(run)")), None), rep


@pytest.mark.parametrize("scaler_inside", [True, False], ids=["gradscaler", "fixed_multiplier"])
def test_output_gradient_overflow_advice_fits_the_loop(scaler_inside):
    """The output-gradient overflow's fix said "use GradScaler instead of a fixed multiplier" to a loop that used a
    GradScaler (test_loop_misuse_unseen2 N1): with a GradScaler the advice is to keep one for the run."""
    f, rep = _output_grad_overflow(scaler_inside)
    assert f is not None, [(x.rule, x.severity, x.module, x.phase) for x in rep.findings]
    if scaler_inside:
        assert "fixed multiplier" not in f.fix and "hand-made" not in f.message, (f.message, f.fix)
        assert "loss scale 65536" in f.message and "one GradScaler" in f.fix, (f.message, f.fix)
    else:
        assert "instead of a fixed multiplier" in f.fix, f.fix
