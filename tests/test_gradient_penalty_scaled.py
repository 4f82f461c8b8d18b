"""A gradient penalty under GradScaler: the gradients of `scaler.scale(loss)` taken with create_graph are multiplied
by the loss scale, and torch's AMP recipe divides them by `scaler.get_scale()` before the penalty. A loop that does
not builds a penalty scale² too large (record/monitorsink.py: the scaled loss's node hook sees a backward with
create_graph, ScalerPatch counts get_scale() reads; rules/scaler.py `_penalty_scaled`: clip_before_unscale, error).
The recipe, a WGAN-GP penalty on the inputs done right, and a penalty from the unscaled loss stay quiet, bitwise
identical with and without the watch. Real torch, real GradScaler, the public API.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

STEPS = 6
LAM = 1e-3


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(i):
    g = torch.Generator().manual_seed(300 + i)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] * 0.5


def run(kind, watch=True, tmp_path=None):
    """One loop per `kind`: "params" (penalty on the parameters' gradients, never unscaled), "params_recipe" (torch's
    recipe: divided by get_scale()), "inputs" / "inputs_recipe" (a WGAN-GP-style penalty on the inputs' gradients),
    "unscaled_loss" (the penalty's gradients from the unscaled loss: nothing to divide), "read_first" (the scale
    read before the gradients are taken, as GradNorm's loop does, then divided by it). Returns (report or None,
    losses, penalties, final weights)."""
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(tmp_path / "run")) if watch else None
    losses, pens = [], []
    for i in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = batch(i)
        if kind.startswith("inputs"):
            x = x.requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = F.mse_loss(out.float(), y)
        wrt = [x] if kind.startswith("inputs") else list(m.parameters())
        if kind == "unscaled_loss":
            grads = torch.autograd.grad(loss, wrt, create_graph=True)
        elif kind == "read_first":  # GradNorm's order: the scale read first, the scaled gradients divided by it
            s = sc.get_scale()
            grads = [g / s for g in torch.autograd.grad(sc.scale(loss), wrt, create_graph=True)]
        else:
            grads = torch.autograd.grad(sc.scale(loss), wrt, create_graph=True)
            if kind.endswith("_recipe"):
                inv = 1.0 / sc.get_scale()
                grads = [g * inv for g in grads]
        pen = sum(g.pow(2).sum() for g in grads)
        pens.append(float(pen))
        sc.scale(loss + LAM * pen).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(float(loss))
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return rep, losses, pens, [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("kind", ["params", "inputs"])
def test_a_penalty_on_scaled_gradients_is_clip_before_unscale(tmp_path, kind):
    rep, _, pens, _ = run(kind, tmp_path=tmp_path)
    _, _, right, _ = run(kind + "_recipe", watch=False)
    # oracle: the penalty is the recipe's times scale^2 (1024^2), on the first step
    assert abs(pens[0] / (right[0] * 2.0 ** 20) - 1) < 0.05, (pens[0], right[0])
    f = rep.findings[0]
    assert (f.rule, f.severity, f.step) == ("clip_before_unscale", "error", 0), lines(rep)
    assert "get_scale" in f.fix and f.evidence["penalty"] is True


@pytest.mark.parametrize("kind", ["params_recipe", "inputs_recipe", "unscaled_loss", "read_first"])
def test_the_recipe_is_quiet_and_unchanged(tmp_path, kind):
    rep, losses, pens, ws = run(kind, tmp_path=tmp_path)
    _, losses2, pens2, ws2 = run(kind, watch=False)
    assert losses == losses2 and pens == pens2 and all(torch.equal(a, b) for a, b in zip(ws, ws2))
    assert alarms(rep.findings) == [], lines(rep)
