"""A finding's step is where the failure began: the capture's step when its replay confirms a producer first seen
on a later sampled step, and the start of the run of skips for loss_scale_collapse (not GradScaler's first,
benign backoff). Found on a softmax-then-log run: the overflow said step 11 and the collapse step 0, the first
bad step was 8."""
from __future__ import annotations

import tempfile

import torch
from torch import nn

import ampdoctor


class Clf(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x, y):
        p = torch.softmax(self.head(self.enc(x)), -1)
        return -torch.log(p.gather(1, y[:, None])).mean()   # log(softmax): in fp16 p underflows to 0


def test_findings_date_from_the_first_bad_step():
    torch.manual_seed(0)
    m = Clf()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        if i == 8:
            with torch.no_grad():
                m.head.weight.mul_(12.0)   # confident logits: wrong classes below fp16's smallest subnormal
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x, y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    rep = w.report()
    w.close()
    steps = list(w.steps)
    first_bad = next(r.step for r in steps if r.skipped and r.step > 0)
    assert first_bad == 8 and steps[0].skipped and not steps[8].sampled   # a benign backoff at 0; 8 is routine
    by_rule = {f.rule: f for f in rep.findings}
    assert by_rule["overflow"].step == 8 and by_rule["overflow"].op == "aten::log"
    assert by_rule["underflow"].step == 8
    assert by_rule["loss_scale_collapse"].step == 8
    assert [f.rule for f in rep.findings[:3]] == ["overflow", "underflow", "loss_scale_collapse"]
