"""What ampdoctor adds to a step's peak GPU memory, and where it is allocated (CUDA only).

    python benchmarks/memory_peak.py --model gpt2 --variants plain,default,every1

For each variant (own model copy, own AdamW + GradScaler, as in overhead.py) runs warm-up steps, then one step
under `torch.cuda.memory._record_memory_history`. Replays the allocator trace to find the moment of the
step's peak and the blocks alive then; prints the peak above the step's start, and the live bytes at the peak
grouped by the innermost frame outside torch (e.g. `modeling_gpt2.py:123` or `ampdoctor/fused.py:108`), so the
difference between plain and a watched variant names the allocation sites that grew.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import Variant, build  # noqa: E402


def _site(frames) -> str:
    for f in frames:
        fn = f.get("filename", "")
        if "/torch/" in fn and "/ampdoctor/" not in fn:
            continue
        if fn.startswith("??") or fn.endswith(".cpp") or fn.endswith(".h") or "<" in fn:
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--variants", default="plain,default,every1")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    base, batches, loss_of = build(a.model, dev)
    results = {}
    for name in a.variants.split(","):
        v = Variant(name, copy.deepcopy(base), dev, torch.float16)
        v.install()
        for i in range(a.warmup):
            v.step(batches[i % len(batches)], loss_of)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        v.step(batches[a.warmup % len(batches)], loss_of)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak_api = torch.cuda.max_memory_allocated() - start
        trace = snap["device_traces"][torch.cuda.current_device()]
        peak, by = live_at_peak(trace, start)
        results[name] = (peak_api, peak, by)
        v.remove()
        del v
        torch.cuda.empty_cache()
    plain = results.get("plain")
    print(f"\n{'variant':10} {'peak over start (MiB)':>22} {'delta vs plain':>15}")
    for name, (peak_api, peak, by) in results.items():
        d = (peak_api - plain[0]) / 2**20 if plain else 0.0
        print(f"{name:10} {peak_api / 2**20:22.1f} {d:+15.1f}")
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
