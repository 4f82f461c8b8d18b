"""rules/outside.py carried: a model that returns a state (a memory summed in fp16) which the loop feeds back. The
state overflows inside the model on a step whose loss stays finite; the next step's batch holds the inf and its loss
is NaN. At the default sampling the overflow is named at the module whose output first held it, on the step it
happened (the always-on headroom saw it there), not blamed on the data. Truly bad data stays the data's.

Real model, real GradScaler and AdamW, CPU fp16 autocast; the truth is measured beside the watch.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


class Memory(nn.Module):
    """Reads the mean of the carried memory and adds this segment's keys to it (in the autocast dtype unless fp32)."""

    def __init__(self, d: int, fp32: bool):
        super().__init__()
        self.k = nn.Linear(d, d)
        self.fp32 = fp32

    def forward(self, x, mem):
        read = (mem / 1e5).to(x.dtype)
        k = self.k(x).sum(1)
        new = mem.float() + k.float() if self.fp32 else mem.to(k.dtype) + k
        return x + read[:, None, :], new


class Streamer(nn.Module):
    def __init__(self, d=16, fp32=False):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.memory = Memory(d, fp32)
        self.head = nn.Linear(d, 1)

    def forward(self, x, mem):
        h, mem = self.memory(self.inp(x), mem)
        return self.head(h).squeeze(-1), mem


def _run(fp32=False, poison_at=None, steps=12):
    torch.manual_seed(0)
    m = Streamer(fp32=fp32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    mem = torch.zeros(2, 16)
    first_inf, bad_loss = None, []
    with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w:
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(2, 2048, 4, generator=g) + 4.0
            if poison_at == i:
                x[0, 0, 0] = math.inf  # the data pipeline's bad record
            y = torch.tanh(x.sum(-1))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out, mem = m(x, mem)
            if first_inf is None and not torch.isfinite(mem).all():
                first_inf = i
            mem = mem.detach()
            loss = F.mse_loss(out.float(), y)
            if not math.isfinite(loss.item()):
                bad_loss.append(i)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    return w.report(), first_inf, bad_loss


def test_a_memory_that_overflows_in_fp16_and_is_fed_back_is_named_where_it_overflowed():
    rep, first_inf, bad_loss = _run()
    # real: the memory the model returned at step k held inf while step k's loss was finite; k+1's loss is not
    assert first_inf is not None and bad_loss and bad_loss[0] == first_inf + 1, (first_inf, bad_loss)
    top = rep.findings[:3]
    hit = [f for f in top if f.rule == "overflow" and f.module == "memory"]
    assert hit, [f.one_line() for f in rep.findings]
    assert hit[0].step == first_inf and hit[0].phase == "forward" and hit[0].severity == "error", hit[0].one_line()
    assert hit[0].evidence["carried"] and hit[0].evidence["fed_back_at"] == first_inf + 1
    assert not [f for f in rep.findings if f.module is None and f.rule in ("overflow", "nan_origin")
                and f.severity == "error" and "data" in f.message], [f.one_line() for f in rep.findings]


def test_the_same_memory_kept_in_fp32_is_quiet():
    rep, first_inf, bad_loss = _run(fp32=True)
    assert first_inf is None and not bad_loss
    assert not [f for f in rep.findings if f.severity in ("warning", "error")], [f.one_line() for f in rep.findings]


def test_a_bad_record_in_the_data_is_still_the_datas():
    rep, first_inf, bad_loss = _run(fp32=True, poison_at=5)
    assert bad_loss and bad_loss[0] == 5
    top = rep.findings[:3]
    assert any(f.module is None and f.step == 5 and "data" in f.message for f in top), [f.one_line() for f in top]
    assert not [f for f in rep.findings if f.evidence.get("carried")]
