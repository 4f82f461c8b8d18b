"""Where the default watch's host time goes, by entry point, on the real host: every callback ampdoctor gets from
torch or from the user's calls (module hooks, autograd node hooks, the scaler/optimizer/clip wrappers, the global
optimizer hooks) timed with perf_counter, each entry's SELF time (its nested entries and the user's own call it
wraps taken out), per step. No profiler: the only overhead is two perf_counter reads per entry, so the total is
close to what the watch costs a host-bound step (nanoGPT's, which syncs every iteration).

    python benchmarks/entry_cost.py --model nanogpt --device cuda [--steps 200]

Prints the plain and watched step times (interleaved, medians), then the table: entry, calls per step, self µs per
step, share of the total. The table prints last.
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.overhead import Variant, build  # noqa: E402

TIMES: dict = {}   # entry -> [seconds of self time, calls]
_STACK: list = []  # [entry, t0, seconds of nested entries / user calls]
ON = [False]


def _enter(name):
    _STACK.append([name, time.perf_counter(), 0.0])


def _exit():
    name, t0, inner = _STACK.pop()
    dt = time.perf_counter() - t0
    if _STACK:
        _STACK[-1][2] += dt
    if name is not None and ON[0]:
        t = TIMES.setdefault(name, [0.0, 0])
        t[0] += dt - inner
        t[1] += 1


def timed(name, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        _enter(name)
        try:
            return fn(*a, **k)
        finally:
            _exit()
    return run


def user(fn):
    """The user's own call inside a wrapper: its time is not the watch's."""
    @functools.wraps(fn)
    def run(*a, **k):
        _enter(None)
        try:
            return fn(*a, **k)
        finally:
            _exit()
    return run


def patch() -> None:
    from ampdoctor.record import clippatch, gradexits, hooks, intwatch, monitor, monitorsink, step
    for cls, label in ((hooks.ModuleHook, "module hook (root pre/post)"), (hooks.GradTap, "headroom grad tap"),
                       (hooks.PassHook, "headroom pass hook"), (hooks.HeadroomHook, "headroom fwd hook"),
                       (gradexits.EntryHook, "node pre-hook (grad kept)"), (gradexits.ExitHook, "node exit hook")):
        cls.__call__ = timed(label, cls.__call__)
    S = step.StepMachine
    S.global_opt_pre = timed("optimizer pre-hook", S.global_opt_pre)
    S.global_opt_post = timed("optimizer post-hook", S.global_opt_post)
    S.zero_grad = timed("zero_grad wrapper", S.zero_grad)
    intwatch.IntWatch._pre = timed("integer watch", intwatch.IntWatch._pre)
    mk = monitor.ScalerPatch._make

    def make(kind, orig, sink):
        return timed(f"scaler.{kind} wrapper", mk(kind, user(orig), sink))
    monitor.ScalerPatch._make = staticmethod(make)
    fan = clippatch.ClipPatch._fan_out.__func__

    def fan_out(cls, kind, parameters, orig, args, kwargs, norm_arg=None):
        return timed(f"clip wrapper ({kind})", fan)(cls, kind, parameters, user(orig), args, kwargs, norm_arg)
    clippatch.ClipPatch._fan_out = classmethod(fan_out)
    _ = monitorsink
    # the big pieces inside those entries, as entries of their own (their time leaves the caller's)
    for modname, attr in INNER:
        _rebind(modname, attr)


INNER = [("ampdoctor.record.assemble", "finalize"), ("ampdoctor.record.transfer", "resolve"),
         ("ampdoctor.record.transfer", "presync"), ("ampdoctor.record.storage", "store"),
         ("ampdoctor.record.step", "StepMachine._new_step"), ("ampdoctor.record.step", "StepMachine.begin"),
         ("ampdoctor.record.params", "update_check_pre"), ("ampdoctor.record.params", "update_check_post"),
         ("ampdoctor.record.hostcopy", "Pending.__init__"), ("ampdoctor.record.hostcopy", "Pending.result"),
         ("ampdoctor.record.step", "StepMachine.event"), ("ampdoctor.record.headroom", "Headroom.forward_done"),
         ("ampdoctor.record.headroom", "Headroom.parts")]


def _rebind(modname: str, attr: str) -> None:
    """Time `modname.attr` (a function or Class.method) as an entry of its own, also where another ampdoctor module
    imported the function by name."""
    import importlib
    mod = importlib.import_module(modname)
    owner, _, name = attr.rpartition(".")
    obj = getattr(mod, owner) if owner else mod
    fn = getattr(obj, name)
    new = timed(attr, fn)
    setattr(obj, name, new)
    if not owner:
        for m in list(sys.modules.values()):
            if getattr(m, "__name__", "").startswith("ampdoctor.") and getattr(m, name, None) is fn:
                setattr(m, name, new)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="fp16", choices=["fp16", "bf16", "off"])
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    patch()
    dev = torch.device(a.device)
    base, batches, loss_of = build(a.model, dev)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[a.amp]
    vs = [Variant("plain", copy.deepcopy(base), dev, amp), Variant("default", copy.deepcopy(base), dev, amp)]
    for v in vs:
        v.install()
    warm = 20
    for i in range(a.steps + warm):
        for v in vs:
            ON[0] = v.name == "default" and i >= warm
            t = time.perf_counter()
            v.step(batches[i % len(batches)], loss_of).item()
            if i >= warm:
                v.times.append(time.perf_counter() - t)
    ON[0] = False
    off = [v.name for v in vs if v.watch is not None and v.watch.machine.disabled]
    for v in vs:
        v.remove()
    plain, watched = (statistics.median(v.times) for v in vs)
    total = sum(t for t, _ in TIMES.values()) / a.steps
    print(f"model={a.model} device={a.device} amp={a.amp} torch {torch.__version__} steps={a.steps}")
    if off:
        print(f"INVALID: the watch disabled itself ({', '.join(off)})")
    print(f"plain {plain * 1e3:.3f} ms, default {watched * 1e3:.3f} ms ({watched / plain:.3f}x, "
          f"+{(watched - plain) * 1e3:.3f} ms); the watch's entries: {total * 1e6:.0f} us a step (self time)")
    print("| entry | calls/step | self us/step | share |")
    print("|---|---:|---:|---:|")
    for name, (t, n) in sorted(TIMES.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name} | {n / a.steps:.1f} | {t / a.steps * 1e6:.1f} | {t / a.steps / total:.0%} |")


if __name__ == "__main__":
    main()
