"""A hand-rolled master-weight loop (an fp16 model, fp32 copies in the optimizer, gradients copied over) whose
updated masters must come back into the model. ampdoctor/record/copies.py `masters_snapshot` / `masters_compare`
look at the forwards after a sampled step; rules/weights.py `_masters_not_copied` names a loop that never copies
back (update_underflow, error, module null), and nothing else: a loop that copies back, one whose updates are too
small to change an fp16 weight yet (the masters move, their fp16 rounding does not), one that copies back only
some tensors, and a first step the loop skipped stay quiet about it. Real torch, real hooks, the public API.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

import ampdoctor
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

STEPS = 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.head = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype))))


def batch(i):
    g = torch.Generator().manual_seed(100 + i % 4)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :1] * 0.5


def run(tmp_path, *, lr=1e-3, back="all", skip_first=False):
    """The loop: fp16 forward and backward (loss x 128), gradients into the fp32 masters / 128, AdamW on the masters,
    then `back`: "all" copies every master into the model, "weights" only the 2-d ones, "none" nothing.
    `skip_first`: step 0's gradients are made inf and the loop skips its update (as on a scaler's backoff)."""
    m = Net().half()
    masters = [p.detach().float().clone().requires_grad_() for p in m.parameters()]
    opt = torch.optim.AdamW(masters, lr=lr)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=str(tmp_path / "run"))
    p0 = [p.detach().clone() for p in m.parameters()]
    for i in range(STEPS):
        m.zero_grad()
        x, y = batch(i)
        loss = ((m(x).float() - y) ** 2).mean()
        (loss * 128).backward()
        if skip_first and i == 0:
            m.head.bias.grad.fill_(float("inf"))
        grads = [p.grad.float() / 128 for p in m.parameters()]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            continue  # the loop skips a step with non-finite gradients
        for mp, g in zip(masters, grads):
            mp.grad = g
        opt.step()
        with torch.no_grad():
            for mp, p in zip(masters, m.parameters()):
                if back == "all" or back == "weights" and p.dim() == 2:
                    p.copy_(mp)
    w.close()
    changed = [not torch.equal(a, b) for a, b in zip(p0, m.parameters())]
    return w.report(), changed


def masters_findings(rep):
    return [f for f in rep.findings if f.rule == "update_underflow" and f.evidence.get("masters")]


def test_masters_never_copied_back_is_update_underflow_at_the_run(tmp_path):
    rep, changed = run(tmp_path, back="none")
    assert not any(changed)  # oracle: the model the forward runs never changed
    f = rep.findings[0]
    assert (f.rule, f.severity, f.module, f.step) == ("update_underflow", "error", None, 0), lines(rep)
    assert f.evidence["copied_back"] is False and f.evidence["moved"] >= 16
    assert "copy" in f.fix and "masters" in f.message
    # the run dir holds it too: a report from disk says the same (StepRecord.masters_back round trip)
    again = ampdoctor.diagnose(str(tmp_path / "run"))
    assert [(g.rule, g.module, g.step) for g in masters_findings(again)] == [("update_underflow", None, 0)]
    recs = [json.loads(ln) for ln in open(os.path.join(tmp_path, "run", "steps.jsonl"))]
    assert any((r.get("masters_back") or {}).get("stuck") for r in recs)


def test_a_skipped_first_step_is_looked_past(tmp_path):
    rep, changed = run(tmp_path, back="none", skip_first=True)
    assert not any(changed)
    got = masters_findings(rep)
    # (an iteration without an optimizer step is no step of its own: ampdoctor's step 0 holds both iterations, and
    # its update, at the second, is the one that never came back)
    assert [(f.severity, f.step) for f in got] == [("error", 0)], lines(rep)


@pytest.mark.parametrize("lr", [1e-3, 1e-8])
def test_a_loop_that_copies_back_is_quiet(tmp_path, lr):
    rep, changed = run(tmp_path, lr=lr, back="all")
    if lr == 1e-3:
        assert all(changed)  # oracle: the copies reached the model
    else:
        assert not all(changed)  # oracle: updates below most fp16 ulps: the masters move, most weights cannot yet
    assert not masters_findings(rep), lines(rep)
    assert alarms(rep.findings) == [], lines(rep)


def test_a_partial_copy_back_is_not_called_never_copied(tmp_path):
    rep, changed = run(tmp_path, back="weights")
    assert changed == [True, False, True, False]  # oracle: the weights moved, the biases never did
    assert not masters_findings(rep), lines(rep)
