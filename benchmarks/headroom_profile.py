"""Where the always-on headroom's cost goes on a GPU (issue 15): torch.profiler over a few steps of GPT-2 small
(B=8, T=1024, fp16 autocast + GradScaler, AdamW, unscale_ + clip), plain and `watch(..., headroom=True)`.

Prints, per variant: kernels launched per step, GPU busy time per step, CPU wall per step; then the kernels
the watch adds (by name, total GPU time per step). Run on a CUDA machine with transformers:
    python benchmarks/headroom_profile.py [--steps 3] [--model gpt2|nanogpt] [--amp fp16|bf16]
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampdoctor  # noqa: E402
from benchmarks.overhead import Variant, build  # noqa: E402


def profile(v: Variant, batches, loss_of, steps: int):
    for i in range(3):
        v.step(batches[i % len(batches)], loss_of)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            v.step(batches[i % len(batches)], loss_of)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    kern = collections.Counter()
    kt = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[e.name] += 1
            kt[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return wall, kern, kt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--amp", default="fp16", choices=["fp16", "bf16"])
    a = p.parse_args()
    dev = torch.device("cuda")
    base, batches, loss_of = build(a.model, dev)
    amp = torch.float16 if a.amp == "fp16" else torch.bfloat16
    res = {}
    for name in ("plain", "headroom"):
        v = Variant(name, copy.deepcopy(base), dev, amp)
        v.install()
        res[name] = profile(v, batches, loss_of, a.steps)
        v.remove()
        del v
        torch.cuda.empty_cache()
    n = a.steps
    (w0, k0, t0), (w1, k1, t1) = res["plain"], res["headroom"]
    print(f"model={a.model} amp={a.amp} torch {torch.__version__}, {n} profiled steps")
    print("| variant | kernels/step | GPU busy ms/step | wall ms/step (profiled) |")
    print("|---|---:|---:|---:|")
    for name, (w, k, t) in res.items():
        print(f"| {name} | {sum(k.values()) / n:.0f} | {sum(t.values()) / n / 1e3:.2f} | {w * 1e3:.2f} |")
    extra = {name: (k1[name] - k0.get(name, 0), (t1[name] - t0.get(name, 0)) / n / 1e3) for name in k1}
    top = sorted(extra.items(), key=lambda kv: -kv[1][1])[:12]
    print("| kernel added by the watch | launches/step | GPU ms/step |")
    print("|---|---:|---:|")
    for name, (cnt, ms) in top:
        print(f"| {name[:90]} | {cnt / n:.0f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
