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


class _Fused(nn.Module):
    def forward(self, x):
        raise RuntimeError("fused kernel unavailable")


class _Block(nn.Module):
    """Tries its fused path, falls back to the plain one (catching the fused module's error itself)."""

    def __init__(self):
        super().__init__()
        self.fused, self.fc = _Fused(), nn.Linear(16, 16)

    def forward(self, x):
        try:
            return self.fused(x)
        except RuntimeError:
            return torch.relu(self.fc(x))


class _Head(nn.Linear):
    def forward(self, x):
        if x.shape[0] == 3:
            raise ValueError("head: a batch of 3 rows is not supported")
        return super().forward(x)


def _fallback_run(crash_at=None):
    torch.manual_seed(0)
    m = nn.Sequential(_Block(), _Block(), _Head(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    try:
        for i in range(6):
            x = torch.randn(3 if i == crash_at else 8, 16)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    except ValueError as e:
        w._record_fatal(e)  # (what the interpreter's exit hook does for an uncaught exception)
    w.close()
    return w.report()


def test_an_exception_the_model_catches_is_no_failure():
    rep = _fallback_run()
    assert not [f for f in rep.findings if f.severity in ("warning", "error")], [f.one_line() for f in rep.findings]
    assert rep.summary.get("crash") is None, rep.summary


def test_the_crash_is_the_uncaught_exception_not_the_caught_one():
    rep = _fallback_run(crash_at=0)  # step 0 is sampled: every module's hooks see the caught fused error first
    crash = rep.summary.get("crash")
    assert crash is not None and crash["type"] == "ValueError" and crash["module"] == "2" and crash["step"] == 0, crash
