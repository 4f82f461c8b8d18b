"""A training loop that runs inside an `except` block (a fallback after a failed import or a refused resource, a
retry loop): while the caller handles that exception, `sys.exc_info()` returns it inside every function the loop
calls, module hooks included. A forward hook must not take it for the forward's own exception (torch runs an
always_call forward hook from its exception handler with no output when the forward raises). Before the fix, the
watch recorded the handled exception on every step: the overflow's output check was skipped (the loss "became inf
outside the model while its outputs were finite") and a healthy run was reported with the handled exception."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

BAD = 6


def _run(bad_at=None, in_except=True):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        m[4].weight.mul_(100.0)  # the head's large gain: a raw batch overflows it in fp16
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    g = torch.Generator().manual_seed(1)

    def loop():
        for i in range(10):
            x = torch.randn(32, 8, generator=g)
            if i == bad_at:
                x = x * 1e4
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float() / 100.0, torch.zeros(32, 1))
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()

    if in_except:
        try:
            raise ImportError("no fused kernels here")  # (the fallback path the loop runs in)
        except ImportError:
            loop()
    else:
        loop()
    w.close()
    return w.report()


def test_healthy_loop_inside_an_except_block_is_quiet():
    rep = _run()
    assert not [f for f in rep.findings if f.severity in ("warning", "error")], [f.one_line() for f in rep.findings]
    assert rep.summary.get("crash") is None, rep.summary


def test_overflow_inside_an_except_block_is_named_at_its_producer():
    plain = _run(bad_at=BAD, in_except=False)
    rep = _run(bad_at=BAD)
    top = [(f.rule, f.module, f.step) for f in rep.findings[:3]]
    assert ("overflow", "4", BAD) in [(f.rule, f.module, f.step) for f in plain.findings[:3]], plain.findings
    assert ("overflow", "4", BAD) in top, [f.one_line() for f in rep.findings[:3]]
