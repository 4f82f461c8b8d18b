"""Host-side cost of ampdoctor's default mode per step on a small, launch-bound model (where a fixed per-step
cost shows most): cProfile of the watched steps, top functions by own time, and per-step wall times.

    python benchmarks/profile_default.py --model convnet --device cuda [--steps 200] [--top 25]
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import Variant, build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="convnet")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    dev = torch.device(a.device)
    base, batches, loss_of = build(a.model, dev)
    amp = torch.float16 if dev.type == "cuda" else None
    vs = [Variant(n, copy.deepcopy(base), dev, amp) for n in ("plain", "default")]
    for v in vs:
        v.install()
    times = {v.name: [] for v in vs}
    for i in range(a.steps):
        for v in vs:
            t = time.perf_counter()
            v.step(batches[i % len(batches)], loss_of)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= 20:
                times[v.name].append(time.perf_counter() - t)
    for v in vs:
        print(f"{v.name:8} median {statistics.median(times[v.name]) * 1e3:.3f} ms")
    pr = cProfile.Profile()
    pr.enable()
    for i in range(a.steps):
        vs[1].step(batches[i % len(batches)], loss_of)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
