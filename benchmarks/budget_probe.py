"""What the headroom budget (ampdoctor/record/budget.py) measured on a run: the stride it chose and the recent step
times with and without the series (the cost of neighbouring pairs), beside the plain step's, for the eager and the torch.compile'd model. A default
watch whose series costs more than `headroom_budget` should end with a stride above 1.

    python benchmarks/budget_probe.py --model nanogpt --device cuda [--steps 150] [--compile both|yes|no]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as bench  # noqa: E402


def run(model: str, device: torch.device, compile_: bool, steps: int) -> dict:
    base, batches, loss_of = bench.build(model, device)
    amp = torch.float16 if device.type == "cuda" else None
    import copy
    plain = bench.Variant("plain", copy.deepcopy(base), device, amp, compile=compile_)
    watched = bench.Variant("default", base, device, amp, compile=compile_)
    watched.install()
    b = watched.watch.machine.hr_hooks.budget
    tp, tw, strides, on, kinds = [], [], [], 0, []
    for i in range(steps):
        for v, ts in ((plain, tp), (watched, tw)):
            bench._sync(device)
            t = time.perf_counter()
            v.step(batches[i % len(batches)], loss_of)
            bench._sync(device)
            ts.append(time.perf_counter() - t)
        strides.append(b.stride)
        on += bool(watched.watch.machine.hr.on)
        kinds.append("S" if watched.watch.machine.st.sampled else ("+" if watched.watch.machine.hr.on else "-"))
    m = watched.watch.machine
    out = {"compiled": m.compiled, "stride": b.stride, "strides_last50": sorted(set(strides[-50:])),
           "series_steps": on, "cost_ms": [round(c * 1e3, 2) for c, _ in b.pairs],
           "without_ms": [round(p * 1e3, 2) for _, p in b.pairs],
           "trace": " ".join(f"{k}{w * 1e3:.1f}/{p * 1e3:.1f}" for k, w, p in zip(kinds, tw, tp)),
           "plain_ms": statistics.median(tp[steps // 3:]) * 1e3, "default_ms": statistics.median(tw[steps // 3:]) * 1e3}
    watched.remove()
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--compile", default="both", choices=["both", "yes", "no"])
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    rows = []
    for c in {"both": (False, True), "yes": (True,), "no": (False,)}[a.compile]:
        r = run(a.model, dev, c, a.steps)
        print(r, flush=True)
        rows.append(r)
    print("| compiled | stride | series steps | series cost ms | step without it ms | plain ms | default ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        on = statistics.median(r["cost_ms"]) if r["cost_ms"] else float("nan")
        off = statistics.median(r["without_ms"]) if r["without_ms"] else float("nan")
        print(f"| {r['compiled']} | {r['stride']} | {r['series_steps']} | {on:.2f} | {off:.2f} | {r['plain_ms']:.2f} "
              f"| {r['default_ms']:.2f} | {r['default_ms'] / r['plain_ms']:.3f}x |")


if __name__ == "__main__":
    main()
