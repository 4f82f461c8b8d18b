"""Underflow into a singular point (shared/FP16.md, "Underflow": sigmoid saturation -> log(1 - 1), softmax
then log -> log(0)): the zeros a log turned into -inf are not zero in fp32, so next to the op's own finding the
report says `underflow`; a zero that is zero in fp32 too (a real singular point) is not called that."""
from __future__ import annotations

import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.cls = nn.Linear(32, 1)

    def forward(self, x):
        return torch.sigmoid(self.cls(self.body(x)))


class ManualBCE(nn.Module):
    """-log(1 - p) for negatives, written by hand (not binary_cross_entropy_with_logits)."""

    def __init__(self):
        super().__init__()
        self.scorer = Scorer()

    def forward(self, x):
        p = self.scorer(x)
        return -torch.log(1 - p).mean()


class ReluLog(nn.Module):
    """log of a ReLU output: exactly 0 in any dtype once the bias goes negative — a real singular point."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return -torch.log(torch.relu(self.fc(x))).mean()


def _run(model, bad_from, make_bad, steps=16):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        if i == bad_from:
            with torch.no_grad():
                make_bad(model)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(64, 16, generator=g))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    rep = w.report()
    w.close()
    return rep


def test_a_saturated_sigmoid_under_a_log_is_an_underflow():
    m = ManualBCE()
    rep = _run(m, 6, lambda m: m.scorer.cls.bias.fill_(12.0))   # fp16 sigmoid == 1.0: 1 - p == 0
    top = rep.findings[:3]
    assert any(f.rule == "underflow" and f.op == "aten::log" for f in top), [f.one_line() for f in top]
    assert any(f.rule == "overflow" and f.op == "aten::log" for f in top)
    u = next(f for f in top if f.rule == "underflow")
    assert u.step == 6 and u.evidence["fp32_finite_with"] and "logsigmoid" in u.fix


def test_a_zero_that_is_zero_in_fp32_is_not_an_underflow():
    m = ReluLog()
    rep = _run(m, 6, lambda m: (m.fc.weight.zero_(), m.fc.bias.fill_(-1.0)))  # relu output exactly 0
    assert rep.findings and rep.findings[0].severity == "error"
    assert not [f for f in rep.findings if f.rule == "underflow"], [f.one_line() for f in rep.findings[:4]]


def test_an_eps_that_vanishes_is_the_account_and_the_backward_origin_stays_in_the_top_three(tmp_path):
    """clamp(max=1-1e-6) is a no-op in fp16 and log1p(-1) = -inf: eps_underflow already says why the zeros are
    there; no second `underflow` pushes the backward NaN origin (Log1PBackward0) out of the first three."""
    import failing_models as fm
    from test_replay import capture
    from ampdoctor.replay import replay
    case = fm.case_log1p()
    rep = replay(capture(tmp_path, case), model=case.model)
    top = rep.findings[:3]
    assert not [f for f in rep.findings if f.rule == "underflow"]
    assert any(f.rule == "nan_origin" and f.phase == "backward" and f.module == "consistency" for f in top), \
        [f.one_line()[:120] for f in top]
