"""What follows from a non-finite gradient is not a finding of its own: an update that applied inf/NaN
gradients is no update_spike, and weights that are already inf/NaN do not "round away" (update_underflow).
Found on a pure-fp16 run whose gradient accumulation into fp16 `.grad` overflowed (shared/FP16.md, weights and
updates): the top finding was update_underflow, then update_spike x inf, and the overflow third."""
from __future__ import annotations

import tempfile

import torch
from torch import nn

import ampdoctor


def test_fp16_gradient_accumulation_overflow_is_the_finding_not_its_consequences():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-6)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        opt.zero_grad()
        for _ in range(16):   # micro-batches summed into fp16 .grad: the sum passes 65504
            x = (torch.randn(8, 16, generator=g) * 30).half()
            (m(x).float() * 2000.0).sum().backward()
        opt.step()
    rep = w.report()
    w.close()
    rules = [f.rule for f in rep.findings]
    assert rules[0] == "overflow" and rep.findings[0].module == "2" and rep.findings[0].phase == "backward"
    assert rep.findings[0].step == 0
    assert "update_underflow" not in rules and "update_spike" not in rules, rules
    assert "fp16_master_weights" in rules[:3]
