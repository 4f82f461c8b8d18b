"""Where host work is free in a step that syncs every iteration: the plain training step of overhead.py with a host
spin of `--spin` µs put at one point of it at a time, interleaved with the plain step (medians). A spin at a point
where the device waits for the host costs its full length; one where the host runs ahead of the device (after the
backward returns, before GradScaler's synchronisation in scaler.step) costs what is left of it after the device's
queue drains. Measured on an H100 (thirty-ninth session, benchmarks/RESULTS.md): no point of the nanoGPT-style step
hides host work, so moving the watch's work within the step gains nothing there.

    python benchmarks/window_probe.py --model nanogpt --device cuda --spin 300 [--steps 60]

The table (median ms a step, +ms over plain) prints last.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.overhead import Variant, _quiet, _sync, build  # noqa: E402


SPOTS = ("start", "after_forward", "after_backward", "after_step")


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class Spun(Variant):
    """The plain step with a host spin at `spot` (one of SPOTS)."""

    def __init__(self, spot, us, *a, **k):
        super().__init__("plain", *a, **k)
        self.label, self.spot, self.us = f"spin@{spot}", spot, us

    def step(self, batch, loss_of):
        args, kwargs = batch
        if self.spot == "start":
            _spin(self.us)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float16,
                            enabled=self.amp_dtype is not None):
            loss = loss_of(self.fwd(*args, **kwargs))
        if self.spot == "after_forward":
            _spin(self.us)
        self.scaler.scale(loss).backward()
        if self.spot == "after_backward":
            _spin(self.us)
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        if self.spot == "after_step":
            _spin(self.us)
        self.scaler.update()
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--spin", type=float, default=300.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args()
    device = torch.device(a.device)
    amp = torch.float16 if device.type == "cuda" else None
    base, batches, loss_of = build(a.model, device)
    vs = [Variant("plain", copy.deepcopy(base), device, amp)]
    vs += [Spun(s, a.spin, copy.deepcopy(base), device, amp) for s in SPOTS]
    with _quiet():
        for i in range(a.warmup + a.steps):
            batch = batches[i % len(batches)]
            for v in vs:
                _sync(device)
                t0 = time.perf_counter()
                v.step(batch, loss_of)
                _sync(device)
                if i >= a.warmup:
                    v.times.append(time.perf_counter() - t0)
    plain = statistics.median(vs[0].times) * 1e3
    print(f"model={a.model} device={device} spin={a.spin:.0f}us steps={a.steps} torch {torch.__version__}")
    print("| variant | ms a step | +ms over plain |\n|---|---:|---:|")
    for v in vs:
        t = statistics.median(v.times) * 1e3
        print(f"| {v.label} | {t:.3f} | {t - plain:+.3f} |")


if __name__ == "__main__":
    main()
