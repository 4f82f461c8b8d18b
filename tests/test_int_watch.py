"""Integer inputs probed on routine steps (ampdoctor/record/intwatch.py): a module whose small fp16/bf16 input a
sampled step found to be an integer ramp (positions, timesteps, day indices) is probed on every routine step
from then on, so values that a curriculum or a counter later carries past the dtype's exact range (bf16: 256,
fp16: 2048) are reported as `precision_loss` on the step it happens, at the innermost module that took them,
not at the next sampled step 200 steps later. Real hooks, a real CPU autocast loop, the report read back from the
run dir by `ampdoctor report` too.

Each case proves its failure first (the positions the module received, as the oracle's own pre-hook saw them,
rounded in the dtype from step ONSET on), then asks the report. Training is bitwise the same with and without
the watch; the hooks come off at close; a 0/1 mask is never watched; a malformed `int_inputs` in a run dir is one
line and exit 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from torch import nn

import ampdoctor
from probe_harness import edit_record

BF16 = torch.bfloat16
ONSET = 9      # the first step whose sequence is longer than 256 (bf16 holds every integer only up to 256)
STEPS = 14
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PosEmbed(nn.Module):
    """A sinusoidal position feature computed from the positions it is given (in the model's dtype)."""

    def __init__(self, d=16):
        super().__init__()
        self.register_buffer("freq", torch.exp(-torch.arange(d // 2) / (d // 2) * 4.0))

    def forward(self, pos):
        ang = pos[:, None].float() * self.freq
        return torch.cat([ang.sin(), ang.cos()], -1)


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.pos = PosEmbed(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pos):   # `pos` passes through the block to `pos`: the block is not the module to name
        return self.proj(x + self.pos(pos).to(x.dtype))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.block = Block(d)
        self.head = nn.Linear(d, 1)
        self.gate = Gate()

    def forward(self, x, pos, mask):
        return self.head(self.gate(self.block(self.inp(x), pos), mask)).squeeze(-1)


class Gate(nn.Module):
    """Multiplies by a 0/1 mask vector (fp16/bf16, small, integer-valued: no ramp, never watched)."""

    def forward(self, h, mask):
        return h * mask[:, None].to(h.dtype)


def length(i, grow=True):
    return 300 if grow and i >= ONSET else 120 + i


def batch(i, grow=True):
    g = torch.Generator().manual_seed(i)
    n = length(i, grow)
    x = torch.randn(n, 4, generator=g)
    pos = torch.arange(n, dtype=torch.float32).to(BF16)   # the user's bug: positions cast to the model's dtype
    mask = (torch.rand(n, generator=g) > 0.1).to(BF16)
    y = torch.sin(torch.arange(n) / 17.0)
    return x, pos, mask, y


def run(run_dir, grow=True, watch=True):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    seen = {}
    oracle = m.block.pos.register_forward_pre_hook(lambda mod, a: seen.setdefault(len(seen), a[0].clone()))
    w = ampdoctor.watch(m, optimizer=opt, run_dir=run_dir) if watch else None
    losses = []
    for i in range(STEPS):
        x, pos, mask, y = batch(i, grow)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            out = m(x, pos, mask)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    oracle.remove()
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return m, rep, losses, seen


def top3(rep):
    return [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]


def test_positions_past_256_in_bf16_are_precision_loss_at_the_innermost_module_on_the_step(tmp_path):
    m, rep, _, seen = run(tmp_path / "run")
    # the oracle: from ONSET the bf16 positions the module received are no longer the integers 0..n-1
    for i, pos in seen.items():
        exact = torch.equal(pos.double(), torch.arange(pos.numel(), dtype=torch.float64))
        assert exact == (i < ONSET), i
    got = top3(rep)
    assert ("precision_loss", "block.pos", ONSET, "warning") in got, got
    assert not any(f.rule == "precision_loss" and f.module in ("", "block") for f in rep.findings), got
    # what the run dir holds says the same (the record of the routine step keeps it)
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(tmp_path / "run"), "--json",
                        str(tmp_path / "r.json"), "--out", str(tmp_path / "html")],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode in (0, 1), p.stderr
    fs = json.loads((tmp_path / "r.json").read_text())["findings"]
    assert any(f["rule"] == "precision_loss" and f["module"] == "block.pos" and f["step"] == ONSET for f in fs), fs
    # the hooks come off with the watch
    assert not m.block.pos._forward_pre_hooks and not m.gate._forward_pre_hooks


def test_positions_inside_the_exact_range_are_quiet_and_the_mask_is_not_watched(tmp_path):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=tmp_path / "run")
    hooked = []
    for i in range(6):
        x, pos, mask, y = batch(i, grow=False)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            out = m(x, pos, mask)
        nn.functional.mse_loss(out.float(), y).backward()
        opt.step()
        hooked.append((len(m.block.pos._forward_pre_hooks), len(m.gate._forward_pre_hooks),
                       len(m.block._forward_pre_hooks)))
    w.close()
    rep = w.report()
    assert [f for f in rep.findings if f.severity in ("warning", "error")] == [], top3(rep)
    # watched from the first routine step on: only the innermost module that takes the ramp, never the mask's
    assert all(h == (1, 0, 0) for h in hooked[1:]), hooked


def test_training_is_bitwise_the_same_with_and_without_the_watch(tmp_path):
    m1, _, l1, _ = run(tmp_path / "a")
    m2, _, l2, _ = run(tmp_path / "b", watch=False)
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k


def test_a_malformed_int_inputs_record_is_one_line_and_exit_2(tmp_path):
    run(tmp_path / "run")
    for bad in ("nope", [{"module": 3}], [{"module": "block.pos", "max": "big"}]):
        edit_record(tmp_path / "run", ONSET, int_inputs=bad)
        before = (tmp_path / "run" / "steps.jsonl").read_bytes()
        p = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(tmp_path / "run"), "--out",
                            str(tmp_path / "html")], cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert p.returncode == 2, (bad, p.returncode, p.stderr)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in p.stderr and "int_inputs" in lines[0], p.stderr
        assert (tmp_path / "run" / "steps.jsonl").read_bytes() == before
