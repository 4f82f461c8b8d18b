"""Where the GPU waits during a watched step, and for what host work: torch.profiler over a few steps, the device's
idle time between kernels attributed to what the host was doing meanwhile (the innermost of the step's phases
and of ampdoctor's entry points, each wrapped in a `record_function` range here), plain and watched side by side.
The table prints last.

    python benchmarks/idle_gaps.py --model gpt2 --every 1 [--steps 2]

A gap is the device idle between the end of one kernel (or copy) and the start of the next, within the profiled
steps; each microsecond of it goes to the range that was open on the host then (the host was busy there, or waiting
in it). Host time of a range is its own wall time on the host, summed.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import overhead as bench  # noqa: E402

import ampdoctor  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "unscale_", "clip", "scaler.step", "update")
# (module path, attribute) of ampdoctor's entry points to time: hooks and the step's stages
ENTRIES = [
    ("ampdoctor.record.modulehooks", "ModuleHookCallbacks._forward_pre"),
    ("ampdoctor.record.modulehooks", "ModuleHookCallbacks._forward_post"),
    ("ampdoctor.record.openstep", "_Step.measure"),
    ("ampdoctor.record.transfer", "presync"),
    ("ampdoctor.record.transfer", "resolve"),
    ("ampdoctor.record.assemble", "finalize"),
    ("ampdoctor.record.params", "update_check_pre"),
    ("ampdoctor.record.params", "update_check_post"),
    ("ampdoctor.record.params", "grads_after_unscale"),
    ("ampdoctor.record.step", "StepMachine.begin"),
    ("ampdoctor.record.fused", "StatBuffer.flush"),
    ("ampdoctor.record.fused", "StatBuffer.vectors"),
]


def _wrap_entries() -> None:
    import importlib
    for modname, attr in ENTRIES:
        mod = importlib.import_module(modname)
        owner, _, name = attr.rpartition(".")
        obj = getattr(mod, owner) if owner else mod
        fn = getattr(obj, name)
        label = f"ad:{attr}"

        def wrapped(*a, _fn=fn, _label=label, **k):
            with torch.autograd.profiler.record_function(_label):
                return _fn(*a, **k)
        setattr(obj, name, wrapped)
        # modules that imported the function by name call their own reference: rebind those too
        if not owner:
            for m in list(sys.modules.values()):
                if m is not None and getattr(m, "__name__", "").startswith("ampdoctor") and getattr(m, name, None) is fn:
                    setattr(m, name, wrapped)


def step(v, batch, loss_of):
    rf = torch.autograd.profiler.record_function
    args, kwargs = batch
    with rf("zero_grad"):
        v.opt.zero_grad(set_to_none=True)
    with rf("forward"), torch.autocast(v.device.type, dtype=torch.float16, enabled=v.device.type == "cuda"):
        loss = loss_of(v.model(*args, **kwargs))
    with rf("backward"):
        v.scaler.scale(loss).backward()
    with rf("unscale_"):
        v.scaler.unscale_(v.opt)
    with rf("clip"):
        torch.nn.utils.clip_grad_norm_(v.model.parameters(), 1.0)
    with rf("scaler.step"):
        v.scaler.step(v.opt)
    with rf("update"):
        v.scaler.update()


def profile(v, batches, loss_of, steps):
    """{range: [device idle µs while it was innermost, host µs]} per step, and the device busy µs per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_
    sync = torch.cuda.synchronize if v.device.type == "cuda" else (lambda: None)
    sync()
    with prof_(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(v, batches[i % len(batches)], loss_of)
        sync()
    busy, ranges = [], []
    for e in prof.events():
        tr = e.time_range
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            if not e.name.startswith(("ad:",) + PHASES) and tr.end > tr.start:
                busy.append((tr.start, tr.end))
        elif e.name in PHASES or e.name.startswith("ad:"):
            ranges.append((tr.start, tr.end, e.name))
    busy.sort()
    merged = []
    for s, t in busy:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    gaps = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    # the innermost open range at each instant: sweep over the ranges' edges (nested ranges on one thread)
    ranges.sort(key=lambda r: (r[0], -r[1]))
    edges = sorted({x for r in ranges for x in r[:2]} | {x for g in gaps for x in g})
    out: dict = collections.defaultdict(lambda: [0.0, 0.0])
    for s, t, name in ranges:
        out[name][1] += (t - s) / steps
    starts = [r[0] for r in ranges]
    for a, b in zip(edges, edges[1:]):
        mid = (a + b) / 2
        # is the device idle over [a, b]?
        j = bisect.bisect_right(gaps, (mid, float("inf"))) - 1
        if j < 0 or not (gaps[j][0] <= mid < gaps[j][1]):
            continue
        inner, best = "(between ranges)", None
        for k in range(bisect.bisect_right(starts, mid) - 1, -1, -1):
            s, t, name = ranges[k]
            if s <= mid < t and (best is None or s >= best):
                inner, best = name, s
                break
        out[inner][0] += (b - a) / steps
    return out, sum(t - s for s, t in merged) / steps


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2")
    p.add_argument("--every", type=int, default=1, help="0: the watch's default")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda")  # (cpu: a dry run of the script itself, no device kernels)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    base, batches, loss_of = bench.build(a.model, dev)
    plain = bench.Variant("plain", copy.deepcopy(base), dev, torch.float16)
    watched = bench.Variant("w", copy.deepcopy(base), dev, torch.float16)
    _wrap_entries()
    kw = {"every": a.every} if a.every else {}  # (0: the default)
    w = ampdoctor.watch(watched.model, optimizer=watched.opt, scaler=watched.scaler, **kw)
    for v in (plain, watched):
        for i in range(3):
            step(v, batches[i % len(batches)], loss_of)
    rp, bp = profile(plain, batches, loss_of, a.steps)
    rw, bw = profile(watched, batches, loss_of, a.steps)
    w.close()
    print(f"{a.model} every={a.every}: device busy a step plain {bp / 1e3:.1f} ms, watched {bw / 1e3:.1f} ms; "
          f"device idle plain {sum(v[0] for v in rp.values()) / 1e3:.1f} ms, "
          f"watched {sum(v[0] for v in rw.values()) / 1e3:.1f} ms")
    print("| range (innermost on the host) | idle plain ms | idle watched ms | host plain ms | host watched ms |")
    print("|---|---:|---:|---:|---:|")
    for name in sorted(set(rp) | set(rw), key=lambda n: -rw.get(n, [0])[0]):
        ip, hp = rp.get(name, [0.0, 0.0])
        iw, hw = rw.get(name, [0.0, 0.0])
        print(f"| {name} | {ip / 1e3:.2f} | {iw / 1e3:.2f} | {hp / 1e3:.2f} | {hw / 1e3:.2f} |")


if __name__ == "__main__":
    main()
