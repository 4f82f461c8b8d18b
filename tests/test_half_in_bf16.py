"""A module that computes in float16 inside a bfloat16 autocast run, with no GradScaler: on CUDA, PyTorch's autocast
runs cuDNN RNNs (nn.LSTM, nn.GRU, nn.RNN) in float16 whatever its dtype (measured on the H200 corpus, torch 2.11:
under bf16 autocast an nn.LSTM's output is float16), so a bf16 LSTM language model's gradients into the LSTM were
67% subnormal in fp16. ampdoctor named the underflow but told the user to "train in bf16", which they were doing.
On the CPU (oneDNN has no low-precision LSTM under autocast) the same thing is a module that casts to float16."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


class HalfBlock(nn.Module):
    """What the cuDNN LSTM is under bf16 autocast: a float16 computation (autocast's RNN wrapper casts to float16
    and runs the kernel below autocast)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return torch.tanh(F.linear(x.half(), self.lin.weight.half(), self.lin.bias.half()))


class Net(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.half_block = HalfBlock(d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.half_block(self.inp(x)))


def test_float16_module_in_a_bf16_run_is_explained(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    w = ampdoctor.watch(model, optimizer=opt, run_dir=str(tmp_path / "run"))
    x = torch.randn(64, 256)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().mean()  # d loss / d out = 1/16384: the gradients are ~1e-5
        loss.backward()
        opt.step()
    w.close()
    rep = w.report()
    uf = [f for f in rep.findings if f.rule == "underflow" and f.module == "half_block"]
    assert uf, [(f.rule, f.module, f.severity) for f in rep.findings]
    f = uf[0]
    assert f.phase == "backward" and f.severity == "error"
    assert "computes in float16 although autocast asks for bfloat16" in f.message, f.message
    assert "no GradScaler" in f.message, f.message
    assert "train in bf16" not in f.fix and "enabled=False" in f.fix, f.fix
    # the bf16 modules around it are not underflow findings of their own
    assert not [g for g in rep.findings if g.rule == "underflow" and g.module in ("inp", "head")], rep.findings
