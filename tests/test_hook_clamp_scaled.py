"""Gradient hooks under GradScaler: `p.register_hook(lambda g: g.clamp(-c, c))` runs inside the scaled backward, so it
clamps gradients still multiplied by the loss scale (really at c / scale). A sampled step records which parameters
the user's code hooks (ParamStat.grad_hooked); rules/scaler.py `_hook_clamped` names hooked parameters whose largest
scaled gradients all sit at one round bound: clip_before_unscale, error. A hook that only logs, one that multiplies
its bound by `scaler.get_scale()` (the right way), and a clamp on a single parameter stay quiet, and watching
changes nothing. Real torch, real hooks, real GradScaler, the public API.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

SCALE = 1024.0
CLIP = 0.5
STEPS = 6


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(i):
    g = torch.Generator().manual_seed(500 + i)
    x = torch.randn(32, 8, generator=g)
    return x, x[:, :1] * 30.0


def run(hook, tmp_path=None, watch=True, only_first=False):
    """`hook(scaler)` -> the function each parameter's gradient goes through (None: no hooks)."""
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10 ** 6)
    stepped = []
    if hook is not None:
        for p in list(m.parameters())[:1] if only_first else m.parameters():
            p.register_hook(hook(sc))
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(tmp_path / "run")) if watch else None
    losses = []
    for i in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = F.mse_loss(out.float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        stepped.append([float(p.grad.abs().max()) for p in m.parameters()])
        sc.step(opt)
        sc.update()
        losses.append(float(loss))
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return rep, losses, stepped, [p.detach().clone() for p in m.parameters()]


def clamp(sc):
    return lambda g: g.clamp(-CLIP, CLIP)


def clamp_rescaled(sc):
    return lambda g: g.clamp(-CLIP * sc.get_scale(), CLIP * sc.get_scale())


def log_only(sc):
    seen = []
    return lambda g: seen.append(float(g.norm())) and None


def test_a_clamp_in_gradient_hooks_is_clip_before_unscale(tmp_path):
    rep, _, stepped, _ = run(clamp, tmp_path)
    _, _, free, _ = run(None, watch=False)
    # oracle: every stepped gradient is cut at CLIP / SCALE, where the unhooked ones reach far above it
    top, top_free = max(map(max, stepped)), max(map(max, free))
    assert top <= CLIP / SCALE * 1.0001 and top_free > 20 * CLIP / SCALE, (stepped, free)
    f = rep.findings[0]
    assert (f.rule, f.severity, f.step) == ("clip_before_unscale", "error", 0), lines(rep)
    assert f.evidence["bound_scaled"] == pytest.approx(CLIP) and f.evidence["loss_scale"] == SCALE
    assert "unscale_" in f.fix


@pytest.mark.parametrize("hook,only_first", [(clamp_rescaled, False), (log_only, False), (clamp, True)],
                         ids=["bound_times_scale", "log_only", "one_param"])
def test_hooks_that_do_not_clamp_scaled_gradients_are_quiet_and_unchanged(tmp_path, hook, only_first):
    rep, losses, stepped, ws = run(hook, tmp_path, only_first=only_first)
    _, losses2, stepped2, ws2 = run(hook, watch=False, only_first=only_first)
    assert losses == losses2 and stepped == stepped2 and all(torch.equal(a, b) for a, b in zip(ws, ws2))
    if hook is clamp_rescaled:  # oracle: the real bound is CLIP, and step 0's gradients sit at it in 2+ parameters
        assert max(map(max, stepped)) <= CLIP * 1.0001 and sum(v == CLIP for v in stepped[0]) >= 2, stepped[0]
    assert not [f for f in rep.findings if f.rule == "clip_before_unscale"], lines(rep)
    assert alarms(rep.findings) == [], lines(rep)
