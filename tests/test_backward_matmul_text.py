"""A matmul whose backward overflows fp16 (its weight gradient: the layer's inputs times the gradient from above,
summed over the batch) is a magnitude problem, not a singular point: the replay's text for it said "the gradient of
this op is not finite at the values the forward produced" and advised guarding "the forward op's singular point"
with an eps or a clamp (replay/explain.py). Found on a fairseq-style loop (a hand-made dynamic loss scaler, no
GradScaler, the loop skipping the optimizer step itself on an inf gradient norm; test_healthy_repo_loops_unseen holds
its healthy form) whose features arrive unnormalised (x3000) from step 12 on: the last Linear's weight gradient
overflows at every loss scale the loop's scaler tries, down to 0.25.

Real torch, real CPU fp16 autocast, real ampdoctor.watch; the oracle re-runs the bad step's backward at loss scale 1
and finds the last Linear's weight gradient non-finite in fp16 and finite in fp32."""
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
BAD = 12


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _batch(g, it):
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    return (x * 3000 if it >= BAD else x), y


def _loss(m, x, y, fp16=True):
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = m(x)
    return F.mse_loss(out.float(), y)


def test_a_matmul_backward_overflow_is_explained_as_magnitude(tmp_path):
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=str(tmp_path / "run"))
    sc, g, skipped, snap = DynamicLossScaler(2.0 ** 16), torch.Generator().manual_seed(1), [], None
    for it in range(24):
        x, y = _batch(g, it)
        if it == BAD:
            snap = ({k: v.clone() for k, v in m.state_dict().items()}, x, y)
        opt.zero_grad(set_to_none=True)
        (_loss(m, x, y) * sc.scale).backward()
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
    # oracle: every iteration from BAD on skipped; at loss scale 1 the last Linear's weight gradient overflows fp16
    assert skipped == list(range(BAD, 24)), skipped
    for fp16, finite in ((True, False), (False, True)):
        c = _net()
        c.load_state_dict(snap[0])
        _loss(c, snap[1], snap[2], fp16).backward()
        assert bool(torch.isfinite(c[4].weight.grad).all()) is finite, fp16
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "overflow" and f.module == "4" and f.step == BAD), None)
    assert f is not None, [x.one_line() for x in rep.findings]
    assert f.phase == "backward", f.phase
    assert "overflowed float16" in f.message and "summed over the batch" in f.message, f.message
    assert "singular point" not in f.fix and "in fp32" in f.fix, f.fix
