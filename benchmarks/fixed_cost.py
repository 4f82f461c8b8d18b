"""The default watch's fixed cost per step, in microseconds, on a model so small that the step is almost nothing but
framework overhead (a 3-layer MLP, batch 32): plain and watched loops interleaved in blocks, medians of per-step
times. What a small real step (a ~1 ms CPU step, a launch-bound GPU step whose loop calls `loss.item()`) pays on
top of its own work, with the noise of bigger models out of the way.

    python benchmarks/fixed_cost.py [--device cpu|cuda] [--steps 3000] [--variants default,hroff,every1,rundir]
                                    [--threads 1] [--amp] [--profile OUT]

The loop is the seed article's: zero_grad -> (CUDA or --amp: fp16 autocast) forward -> scaler.scale(loss).backward() ->
unscale_ -> clip_grad_norm_ -> scaler.step -> scaler.update -> loss.item(). `--profile OUT` also writes a cProfile
of the first variant's steps to OUT (`python -m pstats OUT`). The table (median per step, +us over plain, ratio)
is printed last.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampdoctor  # noqa: E402


def make(device, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type)
    return model, opt, scaler


def step(model, opt, scaler, x, y, amp):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.float16, enabled=amp):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return loss.item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--block", type=int, default=100)
    p.add_argument("--variants", default="default,hroff")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default=None)
    p.add_argument("--amp", action="store_true", help="fp16 autocast on the CPU too (as a CPU test of an fp16 loop runs)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    amp = dev.type == "cuda" or a.amp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 32, generator=g).to(dev)
    y = torch.randn(32, 1, generator=g).to(dev)
    runs = {"plain": make(dev)}
    watches = {}
    for v in a.variants.split(","):
        runs[v] = make(dev)
        kw = {"headroom": False} if v == "hroff" else {"every": 1} if v == "every1" else {}
        if v == "rundir":  # the default with a run directory (one JSON line a step)
            import tempfile
            kw = {"run_dir": tempfile.mkdtemp(prefix="ampdoctor-fixed-cost-")}
        watches[v] = ampdoctor.watch(runs[v][0], optimizer=runs[v][1], scaler=runs[v][2], **kw)
    times = {k: [] for k in runs}
    done = 0
    while done < a.steps:
        for k, (m, o, s) in runs.items():
            for _ in range(a.block):
                t = time.perf_counter()
                step(m, o, s, x, y, amp)
                times[k].append(time.perf_counter() - t)
        done += a.block
    plain = statistics.median(times["plain"][a.block:])
    print(f"device={dev} torch {torch.__version__} steps={a.steps}")
    print("| variant | median us | +us over plain | ratio |")
    print("|---|---:|---:|---:|")
    for k, ts in times.items():
        md = statistics.median(ts[a.block:])
        print(f"| {k} | {md * 1e6:.1f} | {(md - plain) * 1e6:+.1f} | {md / plain:.3f}x |")
    if a.profile:
        k = a.variants.split(",")[0]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            step(*runs[k], x, y, amp)
        pr.disable()
        pr.dump_stats(a.profile)
    for w in watches.values():
        w.close()


if __name__ == "__main__":
    main()
