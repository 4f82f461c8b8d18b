"""record/lowcast.py: integers made in, or cast to, bf16/fp16 inside a module's forward (never a module's input) are
probed on a sampled step and named as precision_loss at that module (and so are rows of positions, (B, T), that a
module takes: openstep._rising_row); the mode that sees them changes nothing, comes
off the stack with the forward (also when it raises), and stays away from models with compiled parts.

Each case trains a small real model with a real optimizer under bf16 autocast (or a pure bf16 model) and reads the
report, on the CPU and, where there is one, on CUDA; the twins differ only in the line that makes the positions.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

BF16 = torch.bfloat16
T = 600  # positions 0..599: bf16 holds every integer only up to 256


class Pos(nn.Module):
    """A sinusoidal position feature made inside the forward, in one of four ways."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("freq", torch.linspace(0.001, 0.1, 8))

    def forward(self, x):
        n = x.shape[1]
        dev = x.device
        if self.how == "arange_low":      # the bug: positions made in the activations' dtype
            t = torch.arange(n, dtype=x.dtype, device=dev)
        elif self.how == "promote":       # the bug: int64 positions promoted to bf16 by the add
            return torch.sin(x + torch.arange(n, device=dev)[None, :, None])
        elif self.how == "counts":        # fine: a mean over integer counts (a division) stays quiet
            lengths = torch.tensor([n, 100, n, 3], device=dev)[: x.shape[0]]
            return x + (x.sum(1, keepdim=True) / lengths[:, None, None])
        else:                             # the twin: positions in fp32, only the result cast
            t = torch.arange(n, dtype=torch.float32, device=dev)
        ang = torch.outer(t.float(), self.freq)
        return x + torch.cat([ang.sin(), ang.cos()], -1).to(x.dtype)[None]


class Net(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.pos = Pos(how)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.pos(self.inp(x)))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, T, 4, generator=g), torch.randn(4, T, 1, generator=g)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _run(how: str, watch: bool, steps: int = 4, every=None, pure=False, raise_at=None, device="cpu"):
    torch.manual_seed(0)
    m = Net(how).to(device)
    if pure:
        m = m.to(BF16)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt, **({"every": every} if every else {})) if watch else None
    losses, depth = [], []
    h = m.pos.register_forward_hook(lambda mod, a, o: depth.append(torch._C._len_torch_function_stack()))
    try:
        for i in range(steps):
            x, y = (t.to(device) for t in _batch(i))
            if pure:
                x, y = x.to(BF16), y.to(BF16)
            opt.zero_grad()
            with torch.autocast(device, dtype=BF16, enabled=not pure):
                if raise_at == i:
                    with pytest.raises(RuntimeError):
                        m(x[..., :3])  # a shape error inside the forward
                    assert torch._C._len_torch_function_stack() == 0
                out = m(x)
            loss = F.mse_loss(out.float(), y.float())
            loss.backward()
            opt.step()
            losses.append(loss.item())
            assert torch._C._len_torch_function_stack() == 0  # the mode is off between forwards
    finally:
        h.remove()
        if w is not None:
            w.close()
    return w, m, losses, depth


def _precision(rep):
    return [f for f in rep.findings if f.rule == "precision_loss"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how,via", [("arange_low", ("arange",)), ("promote", ("add", "__add__"))])
def test_integers_made_in_bf16_inside_a_module_are_precision_loss_there(how, via, device):
    w, m, losses, depth = _run(how, True, device=device)
    # real: the positions past 256 collide in bf16
    assert torch.arange(T, dtype=BF16).unique().numel() < T
    rep = w.report()
    top = rep.findings[:3]
    hit = [f for f in top if f.rule == "precision_loss" and f.module == "pos"]
    assert hit, [f.one_line() for f in rep.findings]
    assert hit[0].step == 0 and hit[0].severity == "warning" and hit[0].evidence["via"] in via
    assert hit[0].evidence["max_integer"] >= 512, hit[0].evidence
    assert "inside its forward" in hit[0].message or "makes integers" in hit[0].message, hit[0].message
    assert depth[0] == 1 and depth[1:] == [0] * (len(depth) - 1)  # the mode: step 0's forward only (default)


def test_pure_bf16_model_arange_in_the_weights_dtype_is_named():
    w, _, _, _ = _run("arange_low", True, pure=True)
    hit = [f for f in _precision(w.report()) if f.module == "pos"]
    assert hit and hit[0].evidence["dtype"] == "bfloat16", [f.one_line() for f in w.report().findings]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["fp32", "counts"])
def test_twins_are_quiet(how, device):
    w, _, losses, _ = _run(how, True, device=device)
    rep = w.report()
    assert not _precision(rep), [f.one_line() for f in rep.findings]
    assert not [f for f in rep.findings if f.severity in ("warning", "error")], [f.one_line() for f in rep.findings]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["arange_low", "promote"])
def test_watching_changes_nothing_and_the_mode_comes_off(how, device):
    _, m0, plain, _ = _run(how, False, steps=10, every=1, device=device)
    w, m1, watched, depth = _run(how, True, steps=10, every=1, device=device)
    assert plain == watched
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    # every=1: steps 0-8 are probed (modstate.due), step 9 is not
    assert depth == [1] * 9 + [0], depth


def test_the_mode_comes_off_when_the_forward_raises():
    w, _, losses, depth = _run("arange_low", True, steps=3, every=1, raise_at=1)
    assert len(losses) == 3 and torch._C._len_torch_function_stack() == 0


def test_a_model_with_a_compiled_part_runs_without_the_mode():
    torch.manual_seed(0)
    m = Net("arange_low")
    m.out.compile(backend="eager")  # nn.Module.compile: a compiled part inside an eager model
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    depth = []
    h = m.pos.register_forward_hook(lambda mod, a, o: depth.append(torch._C._len_torch_function_stack()))
    with ampdoctor.watch(m, optimizer=opt, every=1):
        for i in range(2):
            x, y = _batch(i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.mse_loss(m(x).float(), y)
            loss.backward()
            opt.step()
    h.remove()
    assert depth == [0, 0]


# ----------------------------------------------------------------------------------------------------------------------
# (B, T) rows of positions as a module's input (openstep._rising_row): probed when a row rises, not when it does not
# ----------------------------------------------------------------------------------------------------------------------
class Sinus(nn.Module):
    def forward(self, pos):
        ang = pos[..., None] * torch.linspace(0.001, 0.1, 8, dtype=pos.dtype)
        return torch.cat([ang.sin(), ang.cos()], -1)


class RowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = Sinus()
        self.out = nn.Linear(16, 1)

    def forward(self, feats):
        return self.out(self.enc(feats))


def _rows_run(kind: str):
    torch.manual_seed(0)
    m = RowNet().to(BF16)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with ampdoctor.watch(m, optimizer=opt) as w:
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            if kind == "positions":  # packed documents: each row restarts at 0 once, padding -1 at the end
                pos = torch.cat([torch.arange(300), torch.arange(250), -torch.ones(50)]).repeat(4, 1)
            else:                    # integer counts (B, C), as large, in no order along a row
                pos = torch.randint(0, 600, (4, 600), generator=g).float()
            feats = pos.to(BF16)
            opt.zero_grad()
            loss = m(feats).float().pow(2).mean()
            loss.backward()
            opt.step()
    return w.report()


def test_rows_of_positions_past_256_in_bf16_are_precision_loss_at_the_module_taking_them():
    rep = _rows_run("positions")
    hit = [f for f in rep.findings[:3] if f.rule == "precision_loss" and f.module == "enc"]
    assert hit and hit[0].step == 0 and hit[0].evidence["max_integer"] >= 288, [f.one_line() for f in rep.findings]


def test_a_count_matrix_that_does_not_rise_along_its_rows_is_quiet():
    rep = _rows_run("counts")
    assert not _precision(rep), [f.one_line() for f in rep.findings]


def test_iterations_without_optimizer_steps_run_under_the_mode_once():
    """Iterations that never step the optimizer (saliency maps before training: forward, backward, zero_grad; the
    watch stays at step 0) pay for the mode on one forward, not on each."""
    torch.manual_seed(0)
    m = Net("arange_low")
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    depth = []
    h = m.pos.register_forward_hook(lambda mod, a, o: depth.append(torch._C._len_torch_function_stack()))
    with ampdoctor.watch(m, optimizer=opt, every=1):
        for i in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                m(_batch(i)[0]).float().sum().backward()
    h.remove()
    assert depth == [1, 0, 0, 0], depth


def test_short_rows_of_raw_counts_that_rise_are_features_not_positions():
    """(B, 4) raw counts up to 5000 into a Linear under bf16 autocast, each row sorted (as some feature pipelines
    emit them): a few features a sample, rising by construction, are not rows of positions (openstep.MIN_ROW)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-6)
    with ampdoctor.watch(m, optimizer=opt, every=1) as w:
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            counts = (torch.rand(64, 4, generator=g) * 5000).round().sort(-1).values
            counts[:, 0] = (torch.rand(64, generator=g) * 200).round()  # (some small counts too, as real ones have)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = m(counts).float().pow(2).mean()
            loss.backward()
            opt.step()
    assert not _precision(w.report()), [f.one_line() for f in w.report().findings]
