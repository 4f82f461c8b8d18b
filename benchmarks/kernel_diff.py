"""Which device kernels a watch adds to a step: torch.profiler over the plain step and the watched one, device time
per kernel name summed per step, and the names whose time grew most, largest first (the table prints last).

    python benchmarks/kernel_diff.py --model gpt2 --device cuda --every 1 [--steps 3] [--top 20]

Plain and watched run on their own copies of one model (benchmarks/overhead.py's `build` and `Variant`), after a
few warm-up steps each. Names are the profiler's kernel names cut to 70 characters.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as bench  # noqa: E402

import ampdoctor  # noqa: E402


def per_kernel(v, batches, loss_of, steps):
    """{kernel name: (device µs per step, launches per step)} over `steps` steps of variant `v`."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            v.step(batches[i % len(batches)], loss_of)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out: dict = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            k = out[e.name[:70]]
            k[0] += (getattr(e, "device_time", 0) or getattr(e, "cuda_time", 0) or 0) / steps
            k[1] += 1 / steps
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    base, batches, loss_of = bench.build(a.model, dev)
    plain = bench.Variant("plain", copy.deepcopy(base), dev, torch.float16)
    watched = bench.Variant("w", copy.deepcopy(base), dev, torch.float16)
    w = ampdoctor.watch(watched.model, optimizer=watched.opt, scaler=watched.scaler, every=a.every)
    for v in (plain, watched):
        for i in range(3):
            v.step(batches[i % len(batches)], loss_of)
    kp, kw = per_kernel(plain, batches, loss_of, a.steps), per_kernel(watched, batches, loss_of, a.steps)
    w.close()
    rows = sorted(((kw[n][0] - kp.get(n, [0, 0])[0], kw[n][1] - kp.get(n, [0, 0])[1], n) for n in kw), reverse=True)
    tp, tw = sum(v[0] for v in kp.values()), sum(v[0] for v in kw.values())
    print(f"{a.model} every={a.every}: device time a step plain {tp / 1e3:.1f} ms, watched {tw / 1e3:.1f} ms")
    print("| +µs a step | +launches a step | kernel |\n|---:|---:|---|")
    for dt, dn, n in rows[:a.top]:
        print(f"| {dt:.0f} | {dn:.0f} | {n} |")


if __name__ == "__main__":
    main()
