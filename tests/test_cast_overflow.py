"""A cast that overflows: a value computed in fp32 (CLIP's `logit_scale.exp() * sim`, a temperature, an fp32 op's
output under autocast) that is too large for the low-precision op it feeds. Autocast casts that op's input to fp16
(`aten::_to_copy`), and the cast makes the inf; on CUDA the corpus's `clip/logit-scale@3` fails there (F.normalize
returns fp32 under CUDA autocast, so `scale * a` stays fp32 and the matmul's cast overflows). The finding names the
cast at the module whose call made it, and says what it is: a cast of finite values past the dtype's max, not an op
that "produced inf from finite inputs" with the generic advice to run the op in fp32."""
from __future__ import annotations

import torch
import torch.nn as nn

import ampdoctor


class Tempered(nn.Module):
    """A learned temperature applied in fp32, then a Linear under autocast."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.log_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        h = self.a(x).float() * self.log_scale.exp()  # fp32, finite
        return self.b(h)  # autocast casts h to fp16 here: past 65504 it becomes inf


def _run(tmp_path, spike_at=3, iters=6):
    torch.manual_seed(0)
    m = Tempered()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")
    for it in range(iters):
        if it == spike_at:
            with torch.no_grad():
                m.log_scale.fill_(13.0)  # e^13 = 442413: h up to ~1e6, finite in fp32
        x = torch.randn(16, 8) * 10
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    w.close()
    return w.report()


def test_an_overflowing_cast_is_named_as_a_cast(tmp_path):
    rep = _run(tmp_path)
    top = rep.findings[0]
    assert (top.rule, top.module, top.op, top.step, top.severity) == ("overflow", "b", "aten::_to_copy", 3, "error")
    # what it is: finite fp32 values past fp16's max, turned into inf by the cast
    assert "cast" in top.message and "float32" in top.message and "float16" in top.message, top.message
    assert "65504" in top.message, top.message
    amax = float(top.message.split("max |x| = ")[1].split(")")[0])
    assert 65504 < amax < 1e9, top.message
    # the advice: bound the value before the low-precision op, or run that op in fp32 (valid Python follows)
    assert "clamp" in top.fix and "fp32" in top.fix, top.fix
    assert "self.b(" in top.fix, top.fix


def test_a_healthy_run_of_the_same_model_is_quiet(tmp_path):
    rep = _run(tmp_path, spike_at=None)
    assert [f for f in rep.findings if f.severity in ("warning", "error")] == []
