"""Activation checkpointing: the forward that torch.utils.checkpoint re-runs inside the backward is not a second
forward of the step (its modules' hooks do not record it), and the internal exception non-reentrant
checkpointing raises to stop that re-run early is not the user's crash."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, reentrant: bool, early_stop: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.reentrant, self.early_stop = reentrant, early_stop

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant) if self.reentrant else \
                checkpoint(b, x, use_reentrant=False, early_stop=self.early_stop)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("every", [1, None], ids=["every1", "default"])
def test_checkpointed_training_is_healthy_and_recorded_once(tmp_path, reentrant, every):
    torch.manual_seed(0)
    m = Net(reentrant)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path, **({"every": every} if every else {}))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        opt.zero_grad()
        x = torch.randn(8, 16, generator=g, requires_grad=reentrant)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), torch.zeros(8, 1))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    assert len(w.steps) == 4
    assert not any(r.exception for r in w.steps), [r.exception for r in w.steps]
    assert not any(r.capture for r in w.steps)
    fc1 = [c for c in w.steps[0].modules if c.module == "blocks.0.fc1"]
    assert len(fc1) == 1, [(c.module, c.call) for c in fc1]  # the forward, not the re-run in the backward
    rep = ampdoctor.diagnose(tmp_path)
    assert rep.summary["crash"] is None and rep.summary["first_bad_step"] is None
    assert not [f for f in rep.findings if f.severity != "info"]
