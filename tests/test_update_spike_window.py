"""A zero-initialised weight (a SkipInit / ReZero residual gain) written outside the optimizer between sampled steps
(an assignment under no_grad before step 5's forward): the first sampled step after it (6, a follow-up of the skip
at 5; here every=3's step 6) found it already far past Adam's reach before its own update, and `update_spike` said
"The optimizer update at step 6 moved the weights": a step after the write, and an update that had not moved it
(test_norm_free_deep_unseen's tuning run, thirty-seventh session). The finding now gives the window the weight moved
in (the last look and the step that found it), dated at the window's first step, and says the updates in it or code
outside the optimizer did it.

Real torch: CPU fp16 autocast, AdamW, GradScaler, ampdoctor.watch(every=3)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
BAD = 5


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.alpha = nn.Parameter(torch.zeros(()))  # SkipInit: the residual branch starts switched off

    def forward(self, x):
        return x + self.alpha * torch.tanh(self.fc(x))


def test_a_zero_born_weight_written_outside_the_optimizer_is_dated_by_its_window():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), *[Block() for _ in range(4)], nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, every=3)  # (sampled: 0, 3, 6)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    for i in range(8):
        if i == BAD:
            with torch.no_grad():
                m[3].alpha.fill_(30.0)  # written by the loop, not by the optimizer (Adam's steps reach ~0.01)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    rep = w.report()
    f = next((f for f in rep.findings if f.rule == "update_spike" and f.module == "3"), None)
    assert f is not None, [x.one_line() for x in rep.findings]
    lo, hi = f.evidence["between_steps"]
    assert lo < BAD <= hi and f.step <= BAD, (f.step, lo, hi, f.message)  # a window that holds the write
    assert "code outside the optimizer" in f.message, f.message
    assert f"The optimizer update at step {hi}" not in f.message, f.message
