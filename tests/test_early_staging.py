"""A routine step's values staged as scaler.step() begins (record/monitorsink._stage_early: the loop's own unscale_
already checked the gradients) record the same step as values staged in the optimizer's step: its loss, scale,
found_inf and whether it was skipped, and, on a step GradScaler then skips, which gradients were not finite (read by
transfer.skipped_grads: without it such a step said nothing about its gradients, grad_finite None instead of False).

Real CPU fp16 runs (autocast + GradScaler("cpu"), AdamW, unscale_ + clip + step + update): a scaler search at
init_scale 2**30 (skipped steps, routine and sampled) and a gradient overflow at iteration 20 (the loss x1e4 under a
scale of 2**16); the records are compared field by field with the same run whose steps are staged in the optimizer's
step (`_stage_early` answering no), and the skipped routine steps must say their gradients were not finite.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.record.monitorsink import MonitorCallbacks

FIELDS = ("step", "skipped", "found_inf", "scale", "loss", "loss_finite", "grad_finite", "output_finite", "sampled")


def _count_early(monkeypatch, allow: bool = True) -> dict:
    """Count the steps _stage_early stages early (none when not `allow`: it then always answers no)."""
    calls = {"early": 0}
    real = MonitorCallbacks._stage_early

    def stage_early(self, ev, opt, args):
        ok = real(self, ev, opt, args) and allow
        calls["early"] += ok
        return ok
    monkeypatch.setattr(MonitorCallbacks, "_stage_early", stage_early)
    return calls


def _run(early: bool, monkeypatch):
    real = MonitorCallbacks._stage_early
    calls = _count_early(monkeypatch, allow=early)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters())
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
    w = ampdoctor.watch(net, optimizer=opt, scaler=sc, headroom=True)
    losses = []
    for i in range(30):
        x = torch.randn(4, 8)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(x).float().pow(2).mean() * (1e4 if i == 20 else 1)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    w.close()
    monkeypatch.setattr(MonitorCallbacks, "_stage_early", real)
    rows = [tuple(getattr(r, f) for f in FIELDS) + (tuple(e.kind for e in r.events),) for r in w.steps]
    return rows, w, calls["early"], losses


def test_early_staging_records_the_same_steps(monkeypatch):
    late, w_late, n_late, losses_late = _run(False, monkeypatch)
    early, w_early, n_early, losses_early = _run(True, monkeypatch)
    assert n_late == 0 and n_early >= 5, (n_late, n_early)
    assert losses_early == losses_late
    for a, b in zip(early, late):
        assert repr(a) == repr(b), (a, b)  # (repr: NaN grad norms compare equal as text)
    assert len(early) == len(late) == 30
    skipped_routine = [r for r in w_early.steps if r.skipped and not r.sampled]
    assert skipped_routine, [(r.step, r.skipped, r.sampled) for r in w_early.steps]
    for r in skipped_routine:
        assert r.grad_finite is False, (r.step, r.grad_finite)
    top = [(f.rule, f.step) for f in w_early.report().findings[:3]]
    assert top == [(f.rule, f.step) for f in w_late.report().findings[:3]]


@pytest.mark.parametrize("misuse", ["no_unscale", "two_unscales"])
def test_early_staging_only_after_the_loops_own_single_unscale(misuse, monkeypatch):
    """scaler.step() without the loop's unscale_ (GradScaler unscales inside it), or after unscale_ twice (torch
    raises): the step is staged in the optimizer's step as before."""
    calls = _count_early(monkeypatch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters())
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(net, optimizer=opt, scaler=sc)
    for i in range(12):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(torch.randn(4, 8)).float().pow(2).mean()
        sc.scale(loss).backward()
        if misuse == "two_unscales":
            sc.unscale_(opt)
            with pytest.raises(RuntimeError):
                sc.unscale_(opt)
        sc.step(opt)
        sc.update()
    w.close()
    assert calls["early"] == 0
    assert len(w.steps) == 12
