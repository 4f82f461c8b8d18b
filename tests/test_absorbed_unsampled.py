"""A forward inf that later ops absorb, on a step without per-layer statistics (rules/outside.py absorbed_unsampled):
the always-on headroom series records which module's output was the first of the forward to hold inf/NaN
(`StepRecord.headroom["first_bad"]`, record/headroom.py), and the report names that module as an `info` overflow,
as a sampled step would. Real hooks, real GradScaler, CPU fp16 autocast, the default watch.

- the producer is named, not a module registered before it that passed the inf on (call order, not registration
  order), and not the root that absorbed it;
- a module whose output is -inf on every step (a mask) is not named at the routine steps;
- a padding mask module emitting -inf on one batch only gives at most an `info`, never a warning or error.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from scenarios import alarms, amp_loop, lines, one_thread, randn

one_thread_fixture = __import__("pytest").fixture(autouse=True)(one_thread)

K = 5  # the step whose batch carries the extreme sample (not a sampled step: 0, then every 200th)


class Scale(nn.Module):
    """A module registered first and called last: it only passes on what it gets."""

    def forward(self, x):
        return x * 1.0


class Swallowed(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scale()  # (registered before fc2: a registration-order guess would name it)
        self.fc1, self.fc2, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        h = self.scale(self.fc2(torch.relu(self.fc1(x))))
        return self.head(torch.tanh(h))  # tanh(inf) = 1: the inf never reaches the loss


def _batch(x):
    def batch(i):
        xx = x.clone()
        if i == K:
            xx[3] *= 1000.0
        return (xx,)
    return batch


def _loss(out, *args):
    return out.float().pow(2).mean()


def test_the_first_module_to_hold_the_inf_is_named_not_the_one_it_passed_through(tmp_path):
    torch.manual_seed(0)
    m, x = Swallowed(), randn(16, 8)
    with torch.no_grad():
        m.fc2.weight.mul_(150)
        with torch.autocast("cpu", dtype=torch.float16):  # real: fc2 overflows on the extreme sample, the rest not
            xb = _batch(x)(K)[0]
            h = torch.relu(m.fc1(xb))
            assert torch.isfinite(h).all() and not torch.isfinite(m.fc2(h)).all()
            assert torch.isfinite(m(xb)).all() and torch.isfinite(m(x)).all()
    w = amp_loop(m, _batch(x), _loss, steps=9, lr=1e-6, run_dir=str(tmp_path / "r"), clip=None, init_scale=1.0)
    recs = {r.step: r for r in w.machine.records}
    assert not recs[K].modules and recs[K].loss_finite and not recs[K].skipped  # routine, silent
    names = [mm[0] for mm in w.meta.modules]
    assert names[recs[K].headroom["first_bad"]] == "fc2"
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "overflow" and f.module == "fc2"), None)
    assert f is not None, lines(rep)
    assert (f.step, f.phase, f.severity) == (K, "forward", "info") and f.evidence["absorbed"], f.one_line()
    assert not [g for g in rep.findings if g.module in ("scale", "", "head") and g.rule == "overflow"], lines(rep)
    assert alarms(rep.findings) == [], lines(rep)


class MinusInfMask(nn.Module):
    def __init__(self, always):
        super().__init__()
        self.always = always

    def forward(self, x, pad):
        s = torch.zeros_like(x)
        if self.always or pad:
            s = s.masked_fill(torch.arange(x.shape[-1]) >= x.shape[-1] - 2, float("-inf"))
        return s


class Masked(nn.Module):
    def __init__(self, always):
        super().__init__()
        self.mask, self.fc, self.head = MinusInfMask(always), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, pad=False):
        h = self.fc(x)
        return self.head(torch.softmax(h + self.mask(h, pad), -1) * h)


def test_mask_modules_are_not_alarms(tmp_path):
    for always in (True, False):
        torch.manual_seed(0)
        m, x = Masked(always), randn(4, 8)
        w = amp_loop(m, lambda i: (x, i == K), lambda out, *a: out.float().pow(2).mean(), steps=9,
                     run_dir=str(tmp_path / f"r{always}"))
        rep = w.report()
        assert alarms(rep.findings) == [], lines(rep)
        at_mask = [f for f in rep.findings if f.module == "mask" and f.evidence.get("source") == "headroom"]
        if always:  # -inf from its first step on: a mask, never finite before
            assert at_mask == [], lines(rep)
        else:  # -inf on one batch only: an info at most
            assert all(f.severity == "info" and f.step == K for f in at_mask), lines(rep)
