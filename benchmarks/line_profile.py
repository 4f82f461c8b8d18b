"""Where the watch's host time goes, line by line: line_profiler over chosen ampdoctor functions during a watched
loop (benchmarks/overhead.py's `build` and `Variant`, the loop calling `loss.item()` each step as issue 15's
nanoGPT step does). Prints, per function, its total time per step and its lines costing at least `--min-us` a
step. Read it for where to look, not for how much: line_profiler's tracing makes every Python line slower, and a line
that calls Python code is charged with its callees' traced lines (a dataclass's generated __init__, one traced line
per field, lands on the line that makes the object); time a suspect with perf_counter around it, or compare two
checkouts with `overhead.py --baseline`.

    python benchmarks/line_profile.py --model nanogpt --device cuda [--variant default] [--steps 100]
    python benchmarks/line_profile.py --model cpu-gpt --device cpu --amp off --variant every1 \
        --funcs record.params:norms,record.cpustats:stats

Needs `pip install line_profiler` (not a dependency of ampdoctor).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as bench  # noqa: E402

HOT = ("record.modulehooks:ModuleHookCallbacks._forward_pre,record.modulehooks:ModuleHookCallbacks._forward_post,"
       "record.step:StepMachine.begin,record.step:StepMachine._new_step,record.step:StepMachine.event,"
       "record.assemble:finalize,record.transfer:resolve,record.transfer:presync,record.hostcopy:Pending.__init__,"
       "record.hostcopy:Pending.result,record.headroomhooks:HeadroomHooks.start,record.headroom:Headroom.forward,"
       "record.headroom:Headroom.forward_done,record.headroom:Headroom.parts,"
       "record.monitorsink:MonitorCallbacks.before,"
       "record.monitorsink:MonitorCallbacks.after,record.optsink:OptimizerCallbacks.zero_grad,"
       "record.hooks:HeadroomHook.__call__,record.hooks:GradTap.__call__")


def _resolve(spec: str):
    """'module:Class.method' under ampdoctor -> the function object (unwrapped)."""
    modname, attr = spec.split(":")
    obj = importlib.import_module("ampdoctor." + modname)
    for a in attr.split("."):
        obj = getattr(obj, a)
    return getattr(obj, "__wrapped__", obj)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="fp16", choices=["fp16", "bf16", "off"])
    p.add_argument("--variant", default="default")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--funcs", default=HOT)
    p.add_argument("--min-us", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    from line_profiler import LineProfiler
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    model, batches, loss_of = bench.build(a.model, dev)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[a.amp]
    v = bench.Variant(a.variant, model, dev, amp)
    lp = LineProfiler()
    fns = []
    for spec in a.funcs.split(","):
        try:
            fn = _resolve(spec)
        except (AttributeError, ImportError) as e:
            print(f"skipped {spec}: {e}")
            continue
        lp.add_function(fn)
        fns.append(fn)
    v.install()
    for i in range(a.warmup):
        v.step(batches[i % len(batches)], loss_of).item()
    lp.enable_by_count()
    for i in range(a.steps):
        v.step(batches[i % len(batches)], loss_of).item()
    lp.disable_by_count()
    v.remove()
    stats = lp.get_stats()
    unit = stats.unit
    rows = []
    for (filename, first, name), lines in stats.timings.items():
        total = sum(t for _, _, t in lines) * unit * 1e6 / a.steps
        rows.append((total, filename, first, name, lines))
    rows.sort(reverse=True)
    print(f"model={a.model} device={a.device} amp={a.amp} variant={a.variant} torch {torch.__version__} "
          f"steps={a.steps} (us per step, line_profiler-inflated)")
    for total, filename, first, name, lines in rows:
        if total < a.min_us:
            continue
        src = open(filename).read().splitlines()
        print(f"\n{name} ({os.path.basename(filename)}:{first}) {total:.1f} us/step")
        for ln, hits, t in sorted(lines):
            us = t * unit * 1e6 / a.steps
            if us >= a.min_us:
                print(f"  {ln:5d} {hits / a.steps:6.1f}x {us:8.1f}  {src[ln - 1].strip()[:100]}")


if __name__ == "__main__":
    main()
