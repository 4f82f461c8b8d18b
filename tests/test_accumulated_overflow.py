"""rules/outside.py _accumulated: on a step without per-layer statistics (the default sampling), gradients that went
±inf only in one module's fp16 parameters, over several micro-batches with every loss finite, are an overflow of the
fp16 .grad's sum, named at that module (backward). An inf that a backward op makes spreads to the layers below and is
not called that.

A pure fp16 regressor with an apex-style static loss scale (check the gradients, unscale by hand, step or skip),
trained for real; the truth is measured with gradient hooks beside the watch.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

ACC, STATIC, BAD = 16, 256.0, 9


class Reg(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x))


def _batch(step, k, scale):
    g = torch.Generator().manual_seed(100 * step + k)
    x = torch.randn(16, 8, generator=g)
    y = x[:, :1] * 2.0 + 1.0
    return x.half(), y * (scale if step >= BAD else 1.0)


def _run(target_scale: float, micro: int):
    torch.manual_seed(0)
    m = Reg().half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    first_bad, micro_max = None, []
    hooks = [p.register_hook(lambda g: micro_max.append(float(g.float().abs().max()))) for p in m.parameters()]
    with ampdoctor.watch(m, optimizer=opt) as w:
        for step in range(BAD + 3):
            opt.zero_grad()
            for k in range(micro):
                x, y = _batch(step, k, target_scale)
                loss = F.mse_loss(m(x).float(), y)
                assert torch.isfinite(loss)
                (loss * STATIC / micro).backward()
            bad = [n for n, p in m.named_parameters() if not torch.isfinite(p.grad).all()]
            if bad and first_bad is None:
                first_bad = (step, bad)
            if not bad:
                for p in m.parameters():
                    p.grad.div_(STATIC)
                opt.step()
    for h in hooks:
        h.remove()
    return w.report(), first_bad, micro_max


def test_the_fp16_grad_sum_of_finite_micro_batches_overflowing_is_named_at_its_module():
    rep, first_bad, micro_max = _run(200.0, ACC)
    # real: every micro-batch's own gradient is finite; their sum in head.bias's fp16 .grad is not, from step BAD
    assert first_bad == (BAD, ["head.bias"]), first_bad
    assert all(v < 65504 for v in micro_max)
    top = rep.findings[:3]
    hit = [f for f in top if f.module == "head" and f.rule == "overflow"]
    assert hit, [f.one_line() for f in rep.findings]
    f = hit[0]
    assert f.step == BAD and f.phase == "backward" and f.severity == "error" and f.evidence["accumulated"], f.one_line()
    assert f.evidence["params"] == ["head.bias"] and "micro-batches" in f.message
    assert not [g for g in rep.findings if g.module and g.module.startswith("body") and g.severity == "error"
                and g.rule in ("overflow", "nan_origin")], [g.one_line() for g in rep.findings]


def test_one_micro_batch_whose_backward_overflows_everywhere_is_not_called_an_accumulation():
    rep, first_bad, micro_max = _run(6e3, 1)
    # real: one micro-batch, and its inf reaches the layers below the head
    assert first_bad is not None and first_bad[0] == BAD and len(first_bad[1]) > 2, first_bad
    assert not [f for f in rep.findings if f.evidence.get("accumulated")], [f.one_line() for f in rep.findings]
