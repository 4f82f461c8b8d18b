"""`optimizer.zero_grad()` inside the gradient-accumulation loop (rules/callorder.py `_zeroed_between_backwards`):
each micro-batch's zero_grad clears what the ones before it accumulated, so every step applies the last
micro-batch's gradient alone. Reported as `scaler_misorder` at that zero_grad. Loops that zero between backwards on
purpose stay quiet: an adversarial step (FGSM: a backward for the input's gradient, zero_grad, the real backward) and
a PCGrad-style step (one forward, one backward per task loss with zero_grad between, the projected gradients written
back before the step)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


def _setup():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return m, opt, sc, ampdoctor.watch(m, optimizer=opt, scaler=sc)


def _loud(rep):
    return [f for f in rep.findings if f.severity in ("warning", "error")]


def _batch(g):
    return torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)


def test_zero_grad_inside_the_accumulation_loop_is_reported():
    m, opt, sc, w = _setup()
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for _k in range(4):
            opt.zero_grad()  # the misuse: inside the micro-batch loop
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float(), y) / 4
            sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None and f.severity == "error" and f.step == 0, [x.one_line() for x in rep.findings]
    assert "3 of 4 micro-batches" in f.message, f.message


def test_fgsm_adversarial_step_is_quiet():
    m, opt, sc, w = _setup()
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = _batch(g)
        x.requires_grad_(True)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        x_adv = (x + 0.01 * x.grad.sign()).detach()
        opt.zero_grad()  # the first backward was for the input's gradient
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x_adv).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    rep = w.report()
    assert _loud(rep) == [], [f.one_line() for f in rep.findings]


def test_pcgrad_style_step_is_quiet():
    m, opt, sc, w = _setup()
    g = torch.Generator().manual_seed(1)
    params = list(m.parameters())
    for _ in range(6):
        x, y = _batch(g)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x).float()
        task_grads = []
        for t in range(3):  # one backward per task loss, from the one forward
            opt.zero_grad()
            sc.scale(F.mse_loss(out[:, t], y[:, t])).backward(retain_graph=t < 2)
            task_grads.append([p.grad.clone() for p in params])
        for p, *gs in zip(params, *task_grads):  # (the projection itself left out: the sum)
            p.grad = sum(gs)
        sc.step(opt)
        sc.update()
    w.close()
    rep = w.report()
    assert _loud(rep) == [], [f.one_line() for f in rep.findings]
