"""One GradScaler, two optimizers (torch's AMP recipe for a GAN: scaler.step(optD), the generator's backward,
scaler.step(optG), ONE scaler.update()), with the discriminator's zero_grad at the top of the iteration, watched at
either network or at a container holding both. The watch ends a step record at the watched optimizer's step, so
with the discriminator watched the generator's step and the iteration's update begin the next record; from the
third iteration on the records repeat one call sequence and keep no events (record/storage.py). The call-order
rule once read that as "scaler.step() but never update()" (a missing_scaler_update error on a healthy GAN): it
now looks for the update where the repeated record's calls would have it (rules/callseq._updated_in_repeat).
(A loop that really misses its update repeats no record: GradScaler raises at the optimizer's next step, and a call
that raised keeps its record's events; tests/test_loop_misuse*.py name those.)"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


def _gan(seed=0):
    torch.manual_seed(seed)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    return G, D


def _run(watched: str, iters: int = 14):
    G, D = _gan()
    box = nn.ModuleDict({"G": G, "D": D})
    opt_g = torch.optim.Adam(G.parameters(), 1e-3)
    opt_d = torch.optim.Adam(D.parameters(), 1e-3)
    sc = torch.amp.GradScaler("cpu")
    w = None
    if watched == "D":
        w = ampdoctor.watch(D, optimizer=opt_d, scaler=sc)
    elif watched == "G":
        w = ampdoctor.watch(G, optimizer=opt_g, scaler=sc)
    elif watched == "box":
        w = ampdoctor.watch(box, optimizer=opt_g, scaler=sc)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(iters):
        real = torch.randn(8, 2, generator=g)
        z = torch.randn(8, 4, generator=g)
        opt_d.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = G(z)
            ld = bce(D(real).float(), torch.ones(8, 1)) + bce(D(fake.detach()).float(), torch.zeros(8, 1))
        sc.scale(ld).backward()
        sc.step(opt_d)
        opt_g.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            lg = bce(D(fake).float(), torch.ones(8, 1))
        sc.scale(lg).backward()
        sc.step(opt_g)
        sc.update()
        losses += [ld.item(), lg.item()]
    if w is not None:
        w.close()
    return w, losses, [p.detach().clone() for p in (*G.parameters(), *D.parameters())]


@pytest.mark.parametrize("watched", ["D", "G", "box"])
def test_healthy_one_scaler_gan_is_quiet(watched):
    _, plain_losses, plain_w = _run(None)
    w, losses, weights = _run(watched)
    assert all(map(math.isfinite, plain_losses))
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_w))
    alarms = [(f.rule, f.module, f.step, f.severity) for f in w.report().findings
              if f.severity in ("warning", "error")]
    assert alarms == [], alarms

