"""rules/underflow.py _flushed_to_zero: a module whose fp16 output is (almost) all exact zeros from an input that is not
tiny computed something below fp16's range in its own forward: `underflow` (forward) there. Its twins stay quiet: the
same term weighted so that fp16 holds it, and a block whose ReLU is dead (exact zeros that are the activation's, not a
flush).

Real models, real optimizer, CPU fp16 autocast; each report is read through the public Report.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


class Penalty(nn.Module):
    """An activity regulariser inside the model: weight * mean(h^2) per sample, in fp16 under autocast."""

    def __init__(self, weight: float):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = weight

    def forward(self, h):
        return self.weight * self.proj(h).pow(2)


class Net(nn.Module):
    def __init__(self, weight: float, dead: bool = False):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.penalty = Penalty(weight)
        self.side = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        if dead:  # a dead ReLU branch: every pre-activation negative, every output an exact zero
            with torch.no_grad():
                self.side[0].bias.fill_(-100.0)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h + self.side(h)), self.penalty(h)


def _run(weight: float, dead: bool = False, steps: int = 5):
    torch.manual_seed(0)
    m = Net(weight, dead)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    with ampdoctor.watch(m, optimizer=opt) as w:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out, pen = m(x)
            loss = F.mse_loss(out.float(), y) + pen.float().sum()
            loss.backward()
            opt.step()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        pen16 = m(x)[1]
    with torch.no_grad():
        pen32 = m(x)[1]
    return w.report(), pen16, pen32


def _underflows(rep):
    return [f for f in rep.findings if f.rule == "underflow"]


def test_a_penalty_weighted_1e_minus_9_is_flushed_to_zero_in_fp16_at_its_module():
    rep, pen16, pen32 = _run(1e-9)
    assert (pen16 == 0).all() and (pen32 != 0).float().mean() > 0.9  # real: fp16 holds none of it, fp32 all
    top = rep.findings[:3]
    hit = [f for f in top if f.rule == "underflow" and f.module == "penalty"]
    assert hit, [f.one_line() for f in rep.findings]
    f = hit[0]
    assert f.phase == "forward" and f.step == 0 and f.severity == "warning", f.one_line()
    assert f.evidence["zeros"] == f.evidence["numel"] and "exactly zero" in f.message, f.message
    assert not [x for x in rep.findings if x.module in ("penalty.proj", "body", "head")], \
        [x.one_line() for x in rep.findings]


def test_the_same_penalty_weighted_so_that_fp16_holds_it_is_quiet():
    rep, pen16, _ = _run(0.1)
    assert (pen16 != 0).float().mean() > 0.9
    assert not _underflows(rep), [f.one_line() for f in rep.findings]


def test_a_dead_relu_branch_is_not_an_underflow():
    rep, _, _ = _run(0.1, dead=True)
    assert not _underflows(rep), [f.one_line() for f in rep.findings]


class LoRA(nn.Module):
    """A low-rank adapter as peft initialises it: B is all zeros, so its output is zero until B has trained."""

    def __init__(self):
        super().__init__()
        self.A = nn.Linear(16, 4, bias=False)
        self.B = nn.Linear(4, 16, bias=False)
        nn.init.zeros_(self.B.weight)

    def forward(self, x):
        return self.B(self.A(x)) * 2.0


class Adapted(nn.Module):
    def __init__(self):
        super().__init__()
        self.base, self.lora, self.head = nn.Linear(16, 16), LoRA(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.base(x) + self.lora(x))


def test_a_zero_initialised_lora_b_is_not_an_underflow():
    torch.manual_seed(0)
    m = Adapted()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    with ampdoctor.watch(m, optimizer=opt) as w:
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float(), y)
            loss.backward()
            opt.step()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert (m.lora(x) != 0).any()  # real: B has trained away from zero
    rep = w.report()
    assert not _underflows(rep), [f.one_line() for f in rep.findings]
