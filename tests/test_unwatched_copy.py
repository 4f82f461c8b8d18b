"""A loop that never runs the watched model's forward, only deep copies of it (a first-order MAML learner cloned
every iteration): a copy carries none of ampdoctor's hooks (record/hooks.py CopiesInert), so when its loss goes
non-finite no layer can be named and there is no batch to capture. The finding says so, and what to watch
instead, rather than advising a replay of a capture that does not exist (rules/outside.py `unlocated`).

Real torch: CPU fp16 autocast, torch.amp.GradScaler("cpu"), one thread.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import ampdoctor


def test_clone_only_loop_says_the_watched_forward_did_not_run():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    meta = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(meta.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(meta, optimizer=opt, scaler=sc)
    for i in range(8):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        if i == 5:
            x[0] = 1e5  # a raw reading: the clone's first Linear overflows fp16
        opt.zero_grad()
        learner = copy.deepcopy(meta)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(learner(x).float(), y)
        grads = torch.autograd.grad(sc.scale(loss), list(learner.parameters()))
        for p, g in zip(meta.parameters(), grads):
            p.grad = g
        sc.step(opt)
        sc.update()
    w.close()
    rep = w.report()
    top = rep.findings[0]
    assert (top.rule, top.severity, top.step, top.module) == ("nan_origin", "error", 5, None), top.one_line()
    assert "forward did not run" in top.message and "deepcopy" in top.message, top.message
    assert top.evidence.get("no_forward") is True
    assert "replay its capture" not in top.message
