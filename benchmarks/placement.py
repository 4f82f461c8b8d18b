"""Where in the training step host work is free: the plain loop (no watch) with a busy-wait of `--spin` µs of host
time injected at one point of the step per variant, interleaved in one process, ratios of medians. A point where
the device still has queued work (e.g. right after `backward()` returns, while its kernels run) hides the spin; a
point right after a synchronisation (GradScaler's found_inf read, the loop's `loss.item()`) pays all of it.
Also counts the synchronising CUDA calls of a plain and a watched step (`torch.cuda.set_sync_debug_mode`).

    python benchmarks/placement.py --model nanogpt --device cuda [--spin 300] [--steps 80]

Points: fwd_start (the root forward's start, after zero_grad), fwd_end (the forward returned), bwd_end (backward()
returned), pre_step (before scaler.step, after unscale_ + clip), opt_pre (the optimizer step's pre-hook: after
GradScaler's found_inf read), post_update (after scaler.update, before loss.item()), post_item (after loss.item()).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.overhead import build  # noqa: E402

POINTS = ("none", "fwd_start", "fwd_end", "bwd_end", "pre_step", "opt_pre", "post_update", "post_item")


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class Run:
    def __init__(self, base, dev, point, us):
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(dev.type)
        self.point, self.us, self.dev = point, us, dev
        self.times: list[float] = []
        if point == "opt_pre":
            self.opt.register_step_pre_hook(lambda *a: spin(us))
        if point == "fwd_start":
            self.model.register_forward_pre_hook(lambda *a: spin(us))

    def step(self, batch, loss_of):
        p, us = self.point, self.us
        args, kwargs = batch
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.dev.type, dtype=torch.float16):
            loss = loss_of(self.model(*args, **kwargs))
        if p == "fwd_end":
            spin(us)
        self.scaler.scale(loss).backward()
        if p == "bwd_end":
            spin(us)
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if p == "pre_step":
            spin(us)
        self.scaler.step(self.opt)
        self.scaler.update()
        if p == "post_update":
            spin(us)
        v = loss.item()
        if p == "post_item":
            spin(us)
        return v


def count_syncs(base, dev, batch, loss_of, watched: bool) -> int:
    import ampdoctor
    r = Run(base, dev, "none", 0)
    w = ampdoctor.watch(r.model, optimizer=r.opt, scaler=r.scaler) if watched else None
    for _ in range(5):
        r.step(batch, loss_of)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                r.step(batch, loss_of)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if w is not None:
        w.close()
    syncs = [str(x.message).split("\n")[0] for x in got if "synchroniz" in str(x.message)]
    return len(syncs) // 3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--spin", type=float, default=300.0)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--points", default=",".join(POINTS))
    a = p.parse_args()
    dev = torch.device(a.device)
    base, batches, loss_of = build(a.model, dev)
    runs = [Run(base, dev, pt, a.spin) for pt in a.points.split(",")]
    for i in range(a.steps + 10):
        for r in runs:
            t = time.perf_counter()
            r.step(batches[i % len(batches)], loss_of)
            if i >= 10:
                r.times.append(time.perf_counter() - t)
    if dev.type == "cuda":
        print(f"synchronising calls a step: plain {count_syncs(base, dev, batches[0], loss_of, False)}, "
              f"watched {count_syncs(base, dev, batches[0], loss_of, True)}")
    none = statistics.median(runs[0].times)
    print(f"model={a.model} device={a.device} spin={a.spin:.0f}us torch {torch.__version__} steps={a.steps}")
    print("| spin at | median ms | +us over none | share of the spin paid |")
    print("|---|---:|---:|---:|")
    for r in runs:
        md = statistics.median(r.times)
        print(f"| {r.point} | {md * 1e3:.3f} | {(md - none) * 1e6:+.0f} | {(md - none) * 1e6 / a.spin:.2f} |")


if __name__ == "__main__":
    main()
