"""A GAN container on one GradScaler on the GPU (record/step.py StepMachine.iteration_goes_on, record/transfer.py
presync_more, record/entries.py): a DCGAN-style loop (PyTorch's AMP examples: the discriminator's scaled backward and
scaler.step, then the generator's, one scaler.update() per iteration), the container holding G and D watched with
one optimizer and never called itself. Cases: healthy (losses bitwise with and without the watch, one step per
iteration, no warning or error), a real batch in raw units at step BAD_D (D's last layer overflows in the
discriminator phase), and a latent spike that only the generator phase draws at step BAD_G (D's last layer overflows
on those fakes, after D's step). Prints the table last.

    python benchmarks/cuda_gan.py [--device cuda] [--steps 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampdoctor  # noqa: E402

BAD_D, BAD_G = 7, 9


class GAN(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(16, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 8))
        self.D = nn.Sequential(nn.Linear(8, d), nn.LeakyReLU(0.2), nn.Linear(d, d), nn.LeakyReLU(0.2),
                               nn.Linear(d, 1))
        with torch.no_grad():
            self.D[4].weight.mul_(150.0)  # a head with a large gain: inputs 1000x too large overflow it in fp16
            self.G[4].weight.mul_(10.0)


def lsq(x, t):
    return F.mse_loss(x.float(), torch.full_like(x.float(), t))


def run(dev, steps, watch, fault):
    torch.manual_seed(0)
    m = GAN().to(dev)
    opt_g = torch.optim.Adam(m.G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(m.D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler(dev.type, init_scale=2.0 ** 10)
    w = ampdoctor.watch(m, optimizer=opt_g, scaler=sc, run_dir=tempfile.mkdtemp(prefix="cuda-gan-")) \
        if watch else None
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for i in range(steps):
        real = torch.randn(64, 8, generator=g).to(dev)
        z = torch.randn(64, 16, generator=g).to(dev)
        z2 = torch.randn(64, 16, generator=g).to(dev)
        if fault == "d" and i == BAD_D:
            real[:4] *= 1e4  # a real batch in raw units (finite in fp16; D.4 overflows)
        if fault == "g" and i == BAD_G:
            z2 *= 1e4  # the generator phase's own latent draw spikes (G finite; D.4 overflows on its fakes)
        opt_d.zero_grad()
        with torch.autocast(dev.type, dtype=torch.float16):
            fake = m.G(z)
            loss_d = lsq(m.D(real), 1.0) + lsq(m.D(fake.detach()), 0.0)
        sc.scale(loss_d).backward()
        sc.step(opt_d)
        opt_g.zero_grad()
        with torch.autocast(dev.type, dtype=torch.float16):
            loss_g = lsq(m.D(m.G(z2)), 1.0)
        sc.scale(loss_g).backward()
        sc.step(opt_g)
        sc.update()
        losses.append((loss_d.item(), loss_g.item()))
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return losses, rep


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    dev = torch.device(a.device)
    rows = []
    plain, _ = run(dev, a.steps, False, None)
    watched, rep = run(dev, a.steps, True, None)
    bad = [f.one_line()[:140] for f in rep.findings if f.severity in ("warning", "error")]
    n = rep.summary.get("steps")
    rows.append(("healthy", "PASS" if plain == watched and not bad and n == a.steps else "FAIL",
                 f"steps={n} bitwise={plain == watched} warnings/errors={bad}"))
    for fault, at in (("d", BAD_D), ("g", BAD_G)):
        _, rep = run(dev, a.steps, True, fault)
        top = [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]
        ok = any(r in ("overflow", "nan_origin") and mod == "D.4" and s == at and sev == "error"
                 for r, mod, s, sev in top)
        rows.append((f"{fault}-phase overflow@D.4 step {at}", "PASS" if ok else "FAIL",
                     f"steps={rep.summary.get('steps')} top3={top}"))
    print(f"torch {torch.__version__} device {dev}")
    print("| case | result | detail |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
