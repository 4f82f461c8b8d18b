"""A loss scale the loop keeps itself (Megatron's, apex's FP16_Optimizer: the model `.half()`, fp32 masters, the
scale halved and the optimizer step skipped on inf/NaN gradients), watched with `scaler=None`, starting high
(2**20): its opening search overflows the backward for a few iterations.

1. the loop throws the overflowed gradients away (p.grad = None) and calls no optimizer step: the backward overflow
   at step 0 is the search's, `info`, nothing at warning or error (rules/backoff.py loop_opening_search; written
   failing first as test_healthy_default31's strict xfail: `[error] overflow at layers.0.input_layernorm step 0`);
2. the same loop forgetting to throw them away (it skips the step but keeps p.grad, so every later backward adds
   onto the inf and no step ever comes): training is broken, and the overflow stays an error at the module.
"""
from __future__ import annotations

import math

import pytest
import torch

import ampdoctor
from scenarios import alarms, one_thread
from test_healthy_default31 import Llama, ce, lm_data

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def run(tmp_path, discard: bool, steps: int = 24):
    torch.manual_seed(13)
    model = Llama().half()
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=5e-3)
    w = ampdoctor.watch(model, optimizer=opt, scaler=None, run_dir=tmp_path / "run")
    data = lm_data(13)
    scale, stepped, losses = 2.0 ** 20, 0, []
    for i in range(steps):
        x = data(i)
        loss = ce(model(x[:, :-1]), x[:, 1:])
        (loss * scale).backward()
        if all(bool(torch.isfinite(p.grad).all()) for p in params):
            for m, p in zip(masters, params):
                m.grad = p.grad.float() / scale
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
            stepped += 1
            for p in params:
                p.grad = None
        else:
            scale /= 2
            if discard:
                for p in params:
                    p.grad = None
        losses.append(loss.item())
    w.close()
    return w.report(), stepped, losses


def test_the_loops_opening_search_is_info(tmp_path):
    rep, stepped, losses = run(tmp_path, discard=True)
    assert stepped >= 18 and all(map(math.isfinite, losses)) and losses[-1] < losses[0], (stepped, losses)
    assert alarms(rep.findings) == [], alarms(rep.findings)
    assert any(f.rule == "overflow" and f.phase == "backward" and f.severity == "info" for f in rep.findings), \
        [f.one_line() for f in rep.findings]


def test_a_loop_keeping_the_overflowed_gradients_stays_an_error(tmp_path):
    rep, stepped, _ = run(tmp_path, discard=False)
    assert stepped == 0  # the inf stays in p.grad: the loop never steps again
    top = [(f.rule, f.phase, f.severity) for f in rep.findings[:3]]
    assert ("overflow", "backward", "error") in top, [f.one_line() for f in rep.findings[:3]]
