"""precision_loss from the watch (issue 15, bf16 precision): positions or timesteps held in bf16 past 256 (fp16:
past 2048) are already rounded together; the module that takes them is named. Silent on fp32 timesteps, on
activations, and on masks of 0 and a large negative constant."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
from ampdoctor.record.stats import integer_probe, integer_valued


class TimeEmbed(nn.Module):
    """Sinusoidal timestep embedding + Linear, as in a diffusion model."""

    def __init__(self, dim=32):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.half = dim // 2

    def forward(self, t):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(self.half, device=t.device) / self.half)
        a = t[:, None].float() * freqs[None]
        return self.lin(torch.cat([a.sin(), a.cos()], -1).to(self.lin.weight.dtype))


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.time = TimeEmbed()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x, t, mask=None):
        h = x + self.time(t)
        if mask is not None:
            h = h + mask
        return self.body(h)


def _train(t_dtype, steps=3, mask=None):
    """fp32 weights under bf16 autocast (an AMP run); the timesteps are handed in as `t_dtype`."""
    torch.manual_seed(0)
    m = Denoiser()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=g)
        t = torch.randint(0, 1000, (16,), generator=g).to(t_dtype)   # the bug: timesteps cast to the amp dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(m(x, t, mask).float(), torch.zeros(16, 32))
        loss.backward()
        opt.step()
    rep = w.report()
    w.close()
    return rep


def test_bf16_timesteps_are_named_at_the_module_that_takes_them():
    rep = _train(torch.bfloat16)
    pl = [f for f in rep.findings if f.rule == "precision_loss"]
    assert len(pl) == 1 and pl[0].module == "time" and pl[0].severity == "warning", rep.findings
    assert pl[0].evidence["dtype"] == "bfloat16" and pl[0].evidence["exact_up_to"] == 256
    assert 256 < pl[0].evidence["max_integer"] <= 1000 and pl[0].evidence["spacing_at_max"] == 4
    assert rep.findings[0].rule == "precision_loss"   # the run is otherwise healthy: it leads
    compile(pl[0].fix.split(":\n", 1)[1], "<fix>", "exec")


def test_fp32_timesteps_and_masks_are_silent():
    assert not [f for f in _train(torch.float32).findings if f.severity in ("warning", "error")]
    for fill in (-1e4, torch.finfo(torch.bfloat16).min):  # an additive mask: 0 and one large constant
        mask = torch.zeros(16, 32, dtype=torch.bfloat16)
        mask[:, 16:] = fill
        rep = _train(torch.float32, mask=mask)
        assert not [f for f in rep.findings if f.rule == "precision_loss"], rep.findings


def test_large_activations_are_not_integers():
    """Every bf16 value past 128 is an integer: a small 2-D activation pushed past 256 (here by a -1e4 mask) is
    not mistaken for positions (found on the first version of this probe)."""
    mask = torch.zeros(16, 32, dtype=torch.bfloat16)
    mask[:, 16:] = -1e4
    rep = _train(torch.float32, mask=mask)
    assert not [f for f in rep.findings if f.rule == "precision_loss"], rep.findings


def test_the_probe_reads_what_it_should():
    def row(x, dt):
        return integer_valued(integer_probe(x).tolist(), dt)
    ramp = torch.arange(300, dtype=torch.float32)
    assert row(ramp.bfloat16(), "bfloat16") == {"dtype": "bfloat16", "max": 300.0, "exact_up_to": 256.0,
                                                 "rounds_products_from": 256.0}
    assert row(torch.arange(200.).bfloat16(), "bfloat16") is None          # all exact
    assert row(torch.arange(3000.).half(), "float16")["max"] == 3000.0
    # exact fp16 integers past 512: products with a fraction (t * freq) are rounded to 0.5
    assert row(torch.arange(1000.).half(), "float16") == {"dtype": "float16", "max": 999.0, "exact_up_to": 2048.0,
                                                          "rounds_products_from": 512.0}
    assert row(torch.arange(500.).half(), "float16") is None
    assert row(torch.randn(1000).bfloat16() * 1000, "bfloat16") is None     # activations: not integers
    assert row(torch.tensor([0.0, -1e4, -1e4]).bfloat16(), "bfloat16") is None  # a mask: one magnitude
    assert row(torch.tensor([1.0, float("inf"), 300.0]).bfloat16(), "bfloat16") is None
