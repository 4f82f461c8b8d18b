"""The every-step gradient trip-wire of a loop without a GradScaler, when the loop clips every parameter: the clip's
total norm is read first, and the per-parameter abs-max only when that norm is not finite (record/transfer.py
presync, record/readback.py resolve). Whatever route it takes, a routine step must say the same as the per-parameter
check: which parameters' gradients went non-finite, at which step; and a healthy step is finite."""
import math

import pytest
import torch
import torch.nn as nn

import ampdoctor
from scenarios import one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


class SqrtHead(nn.Module):
    """sqrt of its input's square: at an exact 0 (step `at`'s batch) the backward is 0 * inf = NaN."""

    def forward(self, x):
        return (x * x).sum(-1, keepdim=True).sqrt()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), SqrtHead())


def _run(clip, steps=12, bad_at=6, dtype=torch.bfloat16):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt)
    for i in range(steps):
        opt.zero_grad()
        x = randn(4, 8, seed=i)
        if i == bad_at:
            with torch.no_grad():
                m[2].weight.zero_()
                m[2].bias.zero_()  # the head's input is exactly 0 for this batch: d sqrt / dx = inf there
        with torch.autocast("cpu", dtype=dtype):
            loss = m(x).float().mean()
        loss.backward()
        if clip == "all":
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        elif clip == "part":
            torch.nn.utils.clip_grad_norm_(m[0].parameters(), 1e9)
        if i != bad_at:
            opt.step()
    w.close()
    return w


@pytest.mark.parametrize("clip", ["all", "part", None])
def test_a_nan_gradient_is_seen_at_its_step_with_its_parameters_whatever_the_route(clip):
    w = _run(clip)
    recs = {r.step: r for r in w.steps}
    assert all(recs[s].grad_finite is True for s in range(1, 6)), [recs[s].grad_finite for s in range(1, 6)]
    bad = recs[6]
    assert bad.grad_finite is False
    names = {p.name for p in bad.params if p.grad_nonfinite}
    assert {"2.weight", "2.bias"} <= names, names
    rep = w.report(replay=False)
    assert any(f.rule in ("nan_origin", "overflow") and f.step == 6 for f in rep.findings), \
        [f.one_line() for f in rep.findings]


def test_the_clip_route_reads_no_gradient_on_a_healthy_step(monkeypatch):
    """With a clip over every parameter, a healthy routine step computes no per-parameter abs-max at all (the sampled
    step 0 measures everything, as always); with a clip over a part, every step does."""
    from ampdoctor.record import params, transfer
    calls = []
    orig = params.norms

    def counting(ts, ord):
        if ord == math.inf and len(ts) == 4:
            calls.append(1)
        return orig(ts, ord)
    monkeypatch.setattr(transfer, "norms", counting)
    both = params.amax_and_l2

    def counting_both(ts):  # (a sampled step reads the abs-max and the L2 norm together)
        if len(ts) == 4:
            calls.append(1)
        return both(ts)
    monkeypatch.setattr(transfer, "amax_and_l2", counting_both)
    _run("all", steps=5, bad_at=99)
    routine = len(calls)
    calls.clear()
    _run("part", steps=5, bad_at=99)
    assert (routine, len(calls)) == (1, 5)
