"""Steps with and without the headroom series, profiled apart: the series forced on a fixed pattern (e.g. "++-":
two steps with it, one without), each step's cProfile kept by its kind, and the functions whose own time per step
differs most between the kinds printed last, with torch.compile's recompilations counted per kind. For a step
without the series that costs more than one with it (measured on the H200's compiled nanoGPT step).

    python benchmarks/kind_profile.py --model nanogpt --device cuda --compile [--pattern ++-] [--steps 120]
    python benchmarks/kind_profile.py ... --timing     # no profiler: each step's time less the plain step's of the
                                                       # same iteration, by (previous kind -> kind)
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as bench  # noqa: E402
from ampdoctor.record import budget as B  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--pattern", default="++-")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--timing", action="store_true")
    a = p.parse_args(argv)
    n = [0]

    def due(self):
        on = a.pattern[n[0] % len(a.pattern)] == "+"
        n[0] += 1
        self.timed = on
        return on
    B.HeadroomBudget.due = due
    dev = torch.device(a.device)
    base, batches, loss_of = bench.build(a.model, dev)
    v = bench.Variant("default", base, dev, torch.float16 if dev.type == "cuda" else None, compile=a.compile)
    v.install()
    m = v.watch.machine
    if a.timing:
        return timing(a, v, bench.Variant("plain", copy.deepcopy(base), dev, v.amp_dtype, compile=a.compile),
                      batches, loss_of, dev)
    prof: dict = {}  # kind -> pstats.Stats of its steps
    times = {True: [], False: []}
    try:
        from torch._dynamo.utils import counters
    except Exception:
        counters = None
    frames = {True: 0, False: 0}
    for i in range(a.steps):
        warm = i < 20
        # (the step's kind is decided when it begins, at zero_grad: read after it ran)
        bench._sync(dev)
        c0 = sum(counters["stats"].values()) if counters is not None else 0
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        v.step(batches[i % len(batches)], loss_of)
        bench._sync(dev)
        pr.disable()
        dt = time.perf_counter() - t
        kind = bool(m.hr.on)
        if not warm and not m.st.sampled:
            times[kind].append(dt)
            st = pstats.Stats(pr)
            if prof.setdefault(kind, st) is not st:
                prof[kind].add(st)
            if counters is not None:
                frames[kind] += sum(counters["stats"].values()) - c0
    per = {}
    for kind in (True, False):
        st = prof.get(kind)
        k = max(1, len(times[kind]))
        per[kind] = {f: v[2] / k for f, v in st.stats.items()} if st else {}
    keys = set(per[True]) | set(per[False])
    diff = sorted(keys, key=lambda f: per[False].get(f, 0) - per[True].get(f, 0), reverse=True)
    print(f"steps with the series {len(times[True])}, median {statistics.median(times[True]) * 1e3:.2f} ms; "
          f"without {len(times[False])}, median {statistics.median(times[False]) * 1e3:.2f} ms; dynamo stats "
          f"events per step: with {frames[True] / max(1, len(times[True])):.2f}, "
          f"without {frames[False] / max(1, len(times[False])):.2f}")
    print("| function | own ms/step without | with | difference |")
    print("|---|---:|---:|---:|")
    for f in diff[:a.top]:
        name = f"{os.path.basename(f[0])}:{f[1]}({f[2]})"
        print(f"| {name[:90]} | {per[False].get(f, 0) * 1e3:.3f} | {per[True].get(f, 0) * 1e3:.3f} | "
              f"{(per[False].get(f, 0) - per[True].get(f, 0)) * 1e3:+.3f} |")


def timing(a, v, plain, batches, loss_of, dev):
    m = v.watch.machine
    b = m.hr_hooks.budget
    by: dict = {}
    win: dict = {}
    prev = None
    for i in range(a.steps):
        dts = []
        for x in (plain, v):
            bench._sync(dev)
            t = time.perf_counter()
            x.step(batches[i % len(batches)], loss_of)
            bench._sync(dev)
            dts.append(time.perf_counter() - t)
        kind = "S" if m.st.sampled else "+" if m.hr.on else "-"
        if i >= 20:
            by.setdefault(f"{prev}{kind}", []).append((dts[1] - dts[0]) * 1e3)
            if b is not None and b.last is not None:  # the budget's own view: the step's timed window
                win.setdefault(f"{prev}{kind}", []).append(b.last[1] * 1e3)
        prev = kind
    print("| previous, this step | steps | watched - plain, median ms | mean ms |")
    print("|---|---:|---:|---:|")
    for k in sorted(by):
        print(f"| {k} | {len(by[k])} | {statistics.median(by[k]):+.2f} | {statistics.fmean(by[k]):+.2f} |")
    print("| previous, this step | budget window (no tail), median ms | steps |")
    print("|---|---:|---:|")
    for k in sorted(win):
        print(f"| {k} | {statistics.median(win[k]):.2f} | {len(win[k])} |")


if __name__ == "__main__":
    main()
