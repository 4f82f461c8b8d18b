"""A power with a number as its base and the tensor as the exponent (`10 ** (db / 20)`: decibels to amplitude;
`2 ** x`; mu-law's `(1 + mu) ** |y|`) overflows fp16 like an exp does: 10**x is inf for x > 4.82. The replay named
the op (`aten::pow`) and the module, but explained it as a square ("in fp16 x**2 is inf for |x| > 255.9 - a variance
or norm computed in low precision") with the RMSNorm fix. Found by the audio/video probe's mu-law case (thirty-sixth
session). Now the op trace keeps the number that was the base (`OpEvent.scalar_base`), and the message says what
overflowed: the base raised to the inputs, past the exponent where it leaves fp16's range.

A tensor base keeps the square's text for `x ** 2`; a cube names its own exponent, and a negative power (`s ** -2.0`,
an inverse weight) is explained at its small inputs (thirty-seventh session: `OpEvent.scalar_exponent`, `absmin_in`).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import ampdoctor
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

BAD = 4


class DbGain(nn.Module):
    """A gain predicted in decibels, applied as an amplitude: 10 ** (dB / 20), in the autocast dtype."""

    def __init__(self):
        super().__init__()
        self.db = nn.Linear(8, 8)

    def forward(self, x):
        return x * 10 ** (self.db(x) / 20)


class Energy(nn.Module):
    """An energy squared in fp16 (x ** 2: the square's text)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) ** 2 / 100


def _run(net_cls, tmp_path, spike):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), net_cls(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    losses = []
    for i in range(8):
        if i == BAD:
            with torch.no_grad():  # an update that scaled the first layer (an lr spike)
                m[0].weight.mul_(spike)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    rep = w.report()
    w.close()
    return rep, losses


def _pow_finding(rep):
    top = [f for f in rep.findings if f.severity in ("warning", "error")][:3]
    hit = next((f for f in top if f.rule == "overflow" and f.module == "1" and f.step == BAD), None)
    assert hit is not None, [(f.rule, f.module, f.step, f.op) for f in top]
    return hit


def test_scalar_base_power_is_explained_as_an_exponential(tmp_path):
    rep, losses = _run(DbGain, tmp_path, 300.0)
    assert all(map(math.isfinite, losses[:BAD])) and not math.isfinite(losses[BAD])
    f = _pow_finding(rep)
    assert f.op == "aten::pow"
    assert "x**2" not in f.message and "variance" not in f.message, f.message
    assert "10" in f.message and "4.8" in f.message, f.message  # 10 ** x is inf in fp16 past x = log10(65504)
    assert "RMSNorm" not in f.fix and "fp32" in f.fix, f.fix


def test_tensor_base_power_keeps_the_square_text(tmp_path):
    rep, losses = _run(Energy, tmp_path, 3000.0)
    assert all(map(math.isfinite, losses[:BAD])) and not math.isfinite(losses[BAD])
    f = _pow_finding(rep)
    assert f.op == "aten::pow" and "x**2" in f.message, f.message


class InverseWeight(nn.Module):
    """A per-sample weight 1 / s**2 of a positive scale s (diffusers' "sigma_sqrt" weighting), in fp16."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        s = torch.sigmoid(self.lin(x)) * 0.5 + 1e-4
        return x * s ** -2.0 / 1e4


class Cube(nn.Module):
    """x ** 3 (a cubic term): inf in fp16 past |x| = 65504 ** (1/3) = 40.3, not a variance."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) ** 3 / 1e3


def test_negative_power_is_explained_at_its_small_inputs(tmp_path):
    """s ** -2.0 overflows where s is small (|s| < 65504 ** -0.5 = 3.9e-3): the square's text ('input up to ...;
    x**2 is inf for |x| > 255.9 - a variance or norm') was wrong for it (test_diffusion_training_unseen
    rf_sigma_sqrt, thirty-seventh session)."""
    rep, losses = _run(InverseWeight, tmp_path, -3000.0)  # (the sigmoid's argument far negative: s -> 1e-4)
    assert all(map(math.isfinite, losses[:BAD])) and not math.isfinite(losses[BAD])
    f = _pow_finding(rep)
    assert f.op == "aten::pow", f.op
    assert "x**2" not in f.message and "variance" not in f.message, f.message
    assert "x ** -2" in f.message and "0.00391" in f.message and "negative power" in f.message, f.message
    assert "fp32" in f.fix and "clamp(min=" in f.fix and "RMSNorm" not in f.fix, f.fix


def test_a_cube_names_its_own_exponent(tmp_path):
    rep, losses = _run(Cube, tmp_path, 300.0)
    assert all(map(math.isfinite, losses[:BAD])) and not math.isfinite(losses[BAD])
    f = _pow_finding(rep)
    assert f.op == "aten::pow" and "x**3 is inf for |x| > 40.3" in f.message and "variance" not in f.message, \
        f.message
