"""A custom torch.autograd.Function without custom_fwd (shared/FP16.md, systems): autocast hands it fp16 inputs
and its exp overflows. The overflow is named at the module and op, and the fix says how to declare the
Function's dtype (custom_fwd/custom_bwd); every code block of it compiles."""
from __future__ import annotations

import tempfile

import torch
from torch import nn

import ampdoctor
from ampdoctor.report.prose import fix_blocks


class SoftplusSq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.log1p(torch.exp(x)) ** 2

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g * 2 * torch.log1p(torch.exp(x)) * torch.sigmoid(x)


class Act(nn.Module):
    def forward(self, x):
        return SoftplusSq.apply(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), Act(), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))).float().mean()


def test_custom_function_overflow_names_the_module_and_suggests_custom_fwd():
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    for i in range(10):
        if i == 5:
            with torch.no_grad():
                m.fc1.weight.mul_(8.0)   # pre-activations past 11.09: exp overflows in fp16
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(torch.randn(16, 16, generator=g) * 3)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    rep = w.report()
    w.close()
    f = rep.findings[0]
    assert (f.rule, f.module, f.op, f.step) == ("overflow", "act", "aten::exp", 5)
    assert "custom_fwd" in f.fix and "custom_bwd" in f.fix
    for b in fix_blocks(f.fix):
        if b["kind"] == "code":
            compile(b["text"], "<fix>", "exec")
