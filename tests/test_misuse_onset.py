"""Call-order misuses that begin on a later, routine step whose call sequence is the same as the steps before
(an adversarial loss switched on at `disc_start`, as VQGAN/taming-transformers do): the step's flags must reach the
rules even though its kinds of calls repeat (ampdoctor/record/storage.py keeps a routine step's events only when
something in them is flagged).

G1. a GAN on one GradScaler: the discriminator's gradients are unscaled (and clipped), then the generator's loss is
    backpropagated; from step 5 that loss has the adversarial term through the discriminator, whose parameters are
    not frozen: its scaled gradients land on the discriminator's unscaled ones, and scaler.step(opt_d) applies them
    undivided: scaler_misorder at step 5 (the generator's scaled backward).
G2. its twin: the discriminator frozen (requires_grad False) for the generator's backward: quiet.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
DISC_START = 5


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.d = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, z, real):
        fake = self.g(z)
        return fake, self.d(real), self.d(fake.detach())


def run(freeze_d):
    m = GAN()
    opt_g = torch.optim.Adam(m.g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(m.d.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt_d, scaler=scaler)
    d_moved = []  # did the generator's backward write into the discriminator's (unscaled) gradients?
    try:
        for i in range(12):
            z, real = randn(16, 8, seed=100 + i % 4), randn(16, 8, seed=200 + i % 4)
            opt_d.zero_grad(set_to_none=True)
            opt_g.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                fake, d_real, d_fake = m(z, real)
                d_loss = F.softplus(-d_real.float()).mean() + F.softplus(d_fake.float()).mean()
            scaler.scale(d_loss).backward()
            scaler.unscale_(opt_d)
            torch.nn.utils.clip_grad_norm_(m.d.parameters(), 10.0)
            before = m.d[0].weight.grad.clone()
            for p in m.d.parameters():
                p.requires_grad_(not freeze_d)
            with torch.autocast("cpu", dtype=torch.float16):
                g_loss = F.mse_loss(fake.float(), real)
                if i >= DISC_START:  # the adversarial term, switched on at disc_start
                    g_loss = g_loss + 0.1 * F.softplus(-m.d(fake).float()).mean()
            scaler.scale(g_loss).backward()
            for p in m.d.parameters():
                p.requires_grad_(True)
            d_moved.append(not torch.equal(before, m.d[0].weight.grad))
            scaler.step(opt_d)
            scaler.step(opt_g)
            scaler.update()
            assert math.isfinite(d_loss.item()) and math.isfinite(g_loss.item())
    finally:
        w.close()
    return w.report(), d_moved


def test_g1_adversarial_term_onto_unscaled_grads():
    rep, d_moved = run(freeze_d=False)
    assert d_moved.index(True) == DISC_START  # the oracle: the first step whose backward wrote into them
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None and f.severity == "error", lines(rep)
    assert f.step == DISC_START, f.one_line()
    assert f.evidence.get("sequence"), f.one_line()


def test_g2_discriminator_frozen_quiet():
    rep, d_moved = run(freeze_d=True)
    assert not any(d_moved)
    bad = [f for f in rep.findings if f.severity in ("warning", "error")]
    assert not bad, lines(rep)
