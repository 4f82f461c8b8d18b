"""A forward `underflow` seen on a sampled step (step 0) whose module's outputs later grow clear of fp16's subnormal
range is transient, not a warning (tests/test_healthy_default19.py case 1: OLMo-2 from a tiny config, whose
down_proj outputs are all subnormal for the first 2-3 updates and reach ~1.8 later). The module's later values come
from the always-on headroom series between sampled steps. The twin whose layer stays tiny (frozen) keeps the
warning."""
from __future__ import annotations

import torch
from torch import nn

import ampdoctor


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.small = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            self.small.weight.mul_(2e-5)  # outputs ~1e-5: subnormal in fp16 (< 6.1e-5) at step 0

    def forward(self, x):
        return self.head(torch.relu(self.small(torch.relu(self.inp(x)))))


def _run(tmp_path, frozen: bool, steps: int = 60):
    torch.manual_seed(0)
    model = Tiny()
    if frozen:
        model.small.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=str(tmp_path / ("frozen" if frozen else "run")))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    y = torch.randn(64, 1, generator=g)
    outs = []
    model.small.register_forward_hook(lambda m, a, o: outs.append(o.detach().abs().max().item()))
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    rep = w.report()
    w.close()
    return rep, outs


def test_an_underflow_at_initialisation_that_the_updates_grow_out_of_is_info(tmp_path):
    rep, outs = _run(tmp_path, frozen=False)
    assert outs[0] < 2.0 ** -14 and min(outs[-10:]) > 2.0 ** -3, (outs[0], outs[-10:])  # really transient
    bad = [(f.rule, f.severity, f.module, f.step) for f in rep.findings if f.severity in ("warning", "error")]
    assert bad == [] and rep.exit_code == 0, bad
    info = [f for f in rep.findings if f.rule == "underflow" and f.module == "small"]
    assert info and info[0].severity == "info" and info[0].step == 0, [(f.rule, f.severity) for f in rep.findings]
    assert info[0].evidence["cleared_at"] > 0 and "transient" in info[0].message


def test_an_underflow_that_stays_is_still_a_warning(tmp_path):
    rep, outs = _run(tmp_path, frozen=True)
    assert max(outs) < 2.0 ** -14, max(outs)
    hits = [f for f in rep.findings if f.rule == "underflow" and f.module == "small"]
    assert hits and hits[0].severity == "warning" and hits[0].step == 0, [(f.rule, f.severity) for f in rep.findings]
    assert "cleared_at" not in hits[0].evidence
