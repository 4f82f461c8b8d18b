"""How often the module-state probe runs (record/modstate.py `due`): steps 1-8, then sampled steps at least
PROBE_GAP apart. With every=1 each step is sampled, and a probe on each one (every module's attributes walked
before and after the forward, the parameters' norms compared) cost about 1.5 ms of a 28 ms CPU step
(benchmarks/RESULTS.md, thirty-second session). The state that starts changing late is still found, at the next
probe.

The RNG probe (does the forward draw from Python's `random` or NumPy's global RNG? modulehooks._rng_due) follows
the same cadence from step 0, and stops once both are found drawn: with every=1 it read and compared both generators'
states on every step (~0.3 ms of a 25 ms CPU step, thirty-seventh session).

Real watches on a real CPU fp16 autocast + GradScaler loop; the probe is counted by wrapping the module's own
function (it still runs)."""
from __future__ import annotations

import sys

import torch
from torch import nn

import ampdoctor
from ampdoctor.record import modstate


class LateCounter(nn.Module):
    """A two-layer net with a counter that only starts moving at step `start` (a schedule switched on late)."""

    def __init__(self, start: int):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)
        self.start, self.seen, self.phase = start, 0, 0

    def forward(self, x):
        self.seen += 1
        if self.seen > self.start:
            self.phase += 1
        return self.b(torch.relu(self.a(x))).float().pow(2).mean()


def _counted(monkeypatch, owner, name, model, every, steps):
    """Train `model` under a watch with `owner.name` (a probe function) wrapped to count the steps whose root
    forward_pre called it (it still runs). Returns (the probed steps, the watch's machine, closed)."""
    probed = []
    orig = getattr(owner, name)

    def counted(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "_forward_pre":  # (not the second look after the forward)
            probed.append(w.machine.st.step)
        return orig(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, every=every)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    machine = w.machine
    w.close()
    return probed, machine


def _run(monkeypatch, every, steps, start=10_000):
    probed, machine = _counted(monkeypatch, modstate, "probe", LateCounter(start), every, steps)
    return probed, [k for k, *_ in machine.state_keys]


def test_every1_probes_steps_1_to_8_then_every_gap(monkeypatch):
    probed, _ = _run(monkeypatch, every=1, steps=70)
    gap = modstate.PROBE_GAP
    assert probed == list(range(1, 9)) + [8 + gap, 8 + 2 * gap], probed


def test_default_probes_its_sampled_steps(monkeypatch):
    probed, _ = _run(monkeypatch, every=40, steps=90)
    assert probed == list(range(1, 9)) + [40, 80], probed
    probed, _ = _run(monkeypatch, every=20, steps=70)
    assert probed == list(range(1, 9)) + [40], probed  # 20 is within PROBE_GAP of step 8, 60 of step 40


def test_state_that_starts_late_is_found_at_the_next_probe(monkeypatch):
    probed, keys = _run(monkeypatch, every=1, steps=70, start=20)
    assert "num:phase" in keys and "num:seen" in keys, keys
    probed, keys = _run(monkeypatch, every=1, steps=30, start=20)
    assert "num:phase" not in keys and "num:seen" in keys, keys  # no probe between step 9 and 32


# -- the RNG probe (modulehooks._rng_due): does the forward draw from Python's `random` or NumPy's global RNG? ------
class PyDraw(nn.Module):
    """Draws from Python's `random` in its forward from step `start` on (a LayerDrop switched on late)."""

    def __init__(self, start: int):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)
        self.start, self.seen = start, 0

    def forward(self, x):
        import random
        self.seen += 1
        h = torch.relu(self.a(x))
        if self.seen > self.start and random.random() < 2.0:  # (always true: the draw is what matters)
            h = h * 1.0
        return self.b(h).float().pow(2).mean()


def _run_rng(monkeypatch, every, steps, start):
    from ampdoctor.record import modulehooks
    probed, machine = _counted(monkeypatch, modulehooks, "_rng_probe", PyDraw(start), every, steps)
    extra = machine.rng_extra
    return probed, bool(extra and extra[0])


def test_every1_probes_the_rng_on_steps_0_to_8_then_every_gap(monkeypatch):
    probed, drawn = _run_rng(monkeypatch, every=1, steps=70, start=10_000)
    gap = modstate.PROBE_GAP
    assert probed == list(range(0, 9)) + [8 + gap, 8 + 2 * gap], probed
    assert not drawn


def test_default_probes_the_rng_on_its_sampled_steps(monkeypatch):
    probed, _ = _run_rng(monkeypatch, every=40, steps=90, start=10_000)
    # (the default also samples a few early steps to learn the step's shape: each sampled step is probed)
    assert probed[0] == 0 and probed[-2:] == [40, 80] and all(s <= 8 for s in probed[:-2]), probed


def test_a_forward_drawing_from_random_is_found_and_not_probed_again(monkeypatch):
    probed, drawn = _run_rng(monkeypatch, every=1, steps=40, start=0)
    assert drawn
    # Python's random found drawn at step 0; NumPy's is still probed (imported or not) on the cadence
    assert probed == list(range(0, 9)) + [8 + modstate.PROBE_GAP], probed
    probed, drawn = _run_rng(monkeypatch, every=1, steps=40, start=20)
    assert drawn and probed == list(range(0, 9)) + [8 + modstate.PROBE_GAP], (probed, drawn)  # found at step 33
