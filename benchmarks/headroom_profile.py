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


def python_profile(v: Variant, batches, loss_of, steps: int, top: int = 14) -> str:
    """cProfile of the host side over `steps` steps: ampdoctor's functions by cumulative time per step."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for i in range(steps):
        v.step(batches[i % len(batches)], loss_of)
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    rows = []
    for (fn, ln, name), (cc, nc, tt, ct, _) in st.stats.items():
        if "ampdoctor" in fn:
            rows.append((ct / steps * 1e3, tt / steps * 1e3, nc / steps, f"{os.path.basename(fn)}:{ln}({name})"))
    rows.sort(reverse=True)
    return "\n".join(f"| {r[3]} | {r[2]:.0f} | {r[0]:.3f} | {r[1]:.3f} |" for r in rows[:top])


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
    p.add_argument("--variants", default="plain,headroom")
    p.add_argument("--python", action="store_true", help="also cProfile the host side of each watched variant")
    a = p.parse_args()
    dev = torch.device("cuda")
    base, batches, loss_of = build(a.model, dev)
    amp = torch.float16 if a.amp == "fp16" else torch.bfloat16
    res = {}
    pyprof = {}
    names = [n for n in a.variants.split(",") if n]
    if "plain" not in names:
        names.insert(0, "plain")
    for name in names:
        v = Variant(name, copy.deepcopy(base), dev, amp)
        v.install()
        res[name] = profile(v, batches, loss_of, a.steps)
        if a.python and name != "plain":
            pyprof[name] = python_profile(v, batches, loss_of, 20)
        v.remove()
        del v
        torch.cuda.empty_cache()
    n = a.steps
    print(f"model={a.model} amp={a.amp} torch {torch.__version__}, {n} profiled steps")
    print("| variant | kernels/step | GPU busy ms/step | wall ms/step (profiled) |")
    print("|---|---:|---:|---:|")
    for name, (w, k, t) in res.items():
        print(f"| {name} | {sum(k.values()) / n:.0f} | {sum(t.values()) / n / 1e3:.2f} | {w * 1e3:.2f} |")
    _, k0, t0 = res["plain"]
    for name in names[1:]:
        _, k1, t1 = res[name]
        extra = {kn: (k1[kn] - k0.get(kn, 0), (t1[kn] - t0.get(kn, 0)) / n / 1e3) for kn in k1}
        top = sorted(extra.items(), key=lambda kv: -kv[1][1])[:8]
        print(f"| kernel added by {name} | launches/step | GPU ms/step |")
        print("|---|---:|---:|")
        for kn, (cnt, ms) in top:
            print(f"| {kn[:90]} | {cnt / n:.0f} | {ms:.3f} |")
        if name in pyprof:
            print(f"| host side of {name} (cProfile, 20 steps) | calls/step | cumulative ms/step | own ms/step |")
            print("|---|---:|---:|---:|")
            print(pyprof[name])


if __name__ == "__main__":
    main()
