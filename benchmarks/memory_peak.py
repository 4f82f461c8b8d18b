"""What ampdoctor adds to a step's peak GPU memory, and where it is allocated (CUDA only).

    python benchmarks/memory_peak.py --model gpt2 --variants plain,default,every1

Variants (own model copy, own AdamW + GradScaler, as in overhead.py) run interleaved; after warm-up every step
is recorded with `torch.cuda.memory._record_memory_history`. For each variant's highest step, replays the
allocator trace to find the moment of the step's peak and the blocks alive then; prints the peak above the step's start, and the live bytes at the peak
grouped by the innermost frame outside torch (e.g. `modeling_gpt2.py:123` or `ampdoctor/record/fused.py:108`), so the
difference between plain and a watched variant names the allocation sites that grew.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import Variant, build  # noqa: E402


def _site(frames) -> str:
    for f in frames:
        fn = f.get("filename", "")
        if "/torch/" in fn and "/ampdoctor/" not in fn:
            continue
        if not fn or fn.startswith("??") or fn.endswith(".cpp") or fn.endswith(".h") or "<" in fn:
            continue
        return f"{'/'.join(fn.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
    return "(torch internal)"


def live_at_peak(trace: list[dict], start: int) -> tuple[int, dict[str, int]]:
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    peak_set: dict[int, tuple[int, str]] = {}
    for e in trace:
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
            cur += e["size"]
            if cur > peak:
                peak, peak_set = cur, dict(live)
        elif a in ("free_requested",):
            if e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
    by: dict[str, int] = {}
    for size, site in peak_set.values():
        by[site] = by.get(site, 0) + size
    return peak, by


def _patched(name: str):
    """Experiment variants of every1: `every1-noviews` (no per-module input views, so no `gin`),
    `every1-nogradhooks` (gradient hooks that measure nothing), `every1-gc` (gc.collect() before the step)."""
    import contextlib
    import gc

    from ampdoctor.record.step import StepMachine

    @contextlib.contextmanager
    def ctx():
        saved = {}
        if name.endswith("-noviews"):
            saved["_wrap_inputs"] = StepMachine._wrap_inputs
            StepMachine._wrap_inputs = lambda self, c, args, kwargs: None
        if name.endswith("-nogradhooks"):
            saved["_grad_hook"] = StepMachine._grad_hook
            StepMachine._grad_hook = lambda self, c, slot: (lambda g: None)
        if name.endswith("-gc"):
            gc.collect()
        if name.endswith("-nokernel"):  # the hooks' Python work only: rows are queued, no kernel launched
            from ampdoctor.record import fused
            saved_add = fused.StatBuffer.add

            def add(self, x, thresholds):
                self.numel.append(x.numel())
                self.factor.append(1)
                if len(self.numel) > self.cnt.shape[0]:
                    self._grow()
                return len(self.numel) - 1
            fused.StatBuffer.add = add
            saved["__add"] = saved_add
        try:
            yield
        finally:
            for k, v in saved.items():
                if k == "__add":
                    from ampdoctor.record import fused
                    fused.StatBuffer.add = v
                else:
                    setattr(StepMachine, k, v)
    return ctx()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--variants", default="plain,default,every1")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-history", action="store_true", help="time the steps only (no allocator trace)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    base, batches, loss_of = build(a.model, dev)
    variants = [Variant(name, copy.deepcopy(base), dev, torch.float16) for name in a.variants.split(",")]
    for v in variants:  # every1-<experiment>: the every1 watch, patched during its own steps (see _patched)
        v.exp, v.name = v.name, ("every1" if v.name.startswith("every1-") else v.name)
    for v in variants:
        v.install()
    results: dict = {}
    per_step: dict = {v.exp: [] for v in variants}
    times: dict = {v.exp: [] for v in variants}
    for i in range(a.warmup + a.steps):  # interleaved, as in overhead.py
        for v in variants:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            rec = i >= a.warmup and not a.no_history
            patch = _patched(v.exp)
            patch.__enter__()
            if rec:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            t0 = time.perf_counter()
            v.step(batches[i % len(batches)], loss_of)
            torch.cuda.synchronize()
            if i >= a.warmup:
                times[v.exp].append(time.perf_counter() - t0)
            patch.__exit__(None, None, None)
            peak_api = torch.cuda.max_memory_allocated() - start
            if rec:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                per_step[v.exp].append(peak_api)
                if v.exp not in results or peak_api > results[v.exp][0]:
                    trace = snap["device_traces"][torch.cuda.current_device()]
                    peak, by = live_at_peak(trace, start)
                    results[v.exp] = (peak_api, peak, by)
    for v in variants:
        print(f"{v.exp:18} median step {statistics.median(times[v.exp]) * 1e3:8.2f} ms")
    for v in variants:
        if per_step[v.exp]:
            print(f"{v.exp:18} per-step peak over start (MiB): "
              + " ".join(f"{x / 2**20:.0f}" for x in per_step[v.exp]))
    if not results:
        return
    plain = results.get("plain")
    print(f"\n{'variant':18} {'peak over start (MiB)':>22} {'delta vs plain':>15}")
    for name, (peak_api, peak, by) in results.items():
        d = (peak_api - plain[0]) / 2**20 if plain else 0.0
        print(f"{name:18} {peak_api / 2**20:22.1f} {d:+15.1f}")
    if plain:
        for name, (_, _, by) in results.items():
            if name == "plain":
                continue
            diff = {k: by.get(k, 0) - plain[2].get(k, 0) for k in set(by) | set(plain[2])}
            rows = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:a.top]
            print(f"\nlive at peak, {name} minus plain (MiB), by allocation site:")
            for k, b in rows:
                if b:
                    print(f"  {b / 2**20:+9.1f}  {k}")


if __name__ == "__main__":
    main()
