"""The optimizer step fused into the backward (PyTorch's tutorial "How to save memory by fusing the optimizer step into
the backward pass", torchtune's `optimizer_in_bwd`): one optimizer per parameter, stepped and zeroed in a
`register_post_accumulate_grad_hook`, watched with `optimizer=None` (there is no one optimizer).

An iteration is one step: the optimizer steps that one backward makes (one per parameter) are that backward's
step, and their zero_grad calls inside the backward begin nothing (record/optsink.py). Written failing first: the
watch counted each parameter's step as a step of its own (12 parameters, 40 iterations: 480 steps), so a failure at
iteration 25 was reported at step ~300 and the every-200 sample fell inside a backward.

1. healthy (fp16 autocast, no scaler; 40 iterations): 40 steps, quiet, losses and weights bitwise with and without
   the watch;
2. an overflow at iteration 25: `blocks.1.fc`'s weight scaled x 1e5 before that iteration's forward (a bad
   checkpoint merge), its fp16 output passes 65504 -> overflow at blocks.1.fc, step 25, error, in the top three;
   the oracle (forward hooks) names blocks.1.fc as the first module whose output is non-finite from finite inputs.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def data(i):
    g = gen(100 + i)
    x = torch.randn(64, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()


def run(watched, tmp_path, steps=40, spike_at=None):
    torch.manual_seed(0)
    model = Net()
    opts = {p: torch.optim.Adam([p], lr=3e-3) for p in model.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    w = ampdoctor.watch(model, optimizer=None, scaler=None, run_dir=tmp_path / "run") if watched else None
    losses, first_bad = [], None
    for i in range(steps):
        if i == spike_at:
            with torch.no_grad():
                model.blocks[1].fc.weight.mul_(1e5)
        x, y = data(i)
        bad = []
        hs = [m.register_forward_hook(lambda m, a, o, n=n: bad.append(n) if not torch.isfinite(o).all()
                                      and all(torch.isfinite(t).all() for t in a) else None)
              for n, m in model.named_modules() if n]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        for h in hs:
            h.remove()
        if bad and first_bad is None:
            first_bad = (i, bad[0])
        loss.backward()
        losses.append(loss.item())
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return rep, losses, [p.detach().clone() for p in model.parameters()], first_bad


def test_healthy_one_step_per_iteration_and_bitwise(tmp_path):
    rep, losses, weights, bad = run(True, tmp_path)
    _, losses0, weights0, _ = run(False, tmp_path)
    assert bad is None and all(map(math.isfinite, losses)) and losses[-1] < 0.9 * losses[0], losses
    assert losses == losses0 and all(torch.equal(a, b) for a, b in zip(weights, weights0))
    assert alarms(rep.findings) == [], alarms(rep.findings)
    assert rep.summary["steps"] == 40, rep.summary


def test_overflow_located_at_its_iteration(tmp_path):
    rep, losses, _, bad = run(True, tmp_path, spike_at=25)
    assert bad == (25, "blocks.1.fc"), bad                        # the oracle: the producer and its iteration
    assert all(map(math.isfinite, losses[:25])) and not math.isfinite(losses[25])
    top = [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]
    assert any(r in ("overflow", "nan_origin") and m == "blocks.1.fc" and s == 25 and sev == "error"
               for r, m, s, sev in top), [f.one_line() for f in rep.findings[:3]]
