"""The floor under the default watch's per-step cost: a throwaway recorder doing only a routine step's essential
work, timed beside the plain step and the real default watch (interleaved in one process, medians), plus the count
of the device ops each adds to a routine step (a TorchDispatchMode over a few steps). Not a part of ampdoctor: a
measure of how much of the default's cost is the recording itself and how much the per-call checks around it.

The minimal recorder: the root's forward pre-hook keeps the batch (containers copied) and the RNG state, its post-hook
one output sum; the four GradScaler methods, zero_grad and clip_grad_norm_ are wrapped, each call recording its kind
and the caller's file:line (ampdoctor's own `caller_location`); the loss, the scale, the output sum and the clip's
norm are concatenated and read once a step (with a CUDA GradScaler: into pinned memory, read at the next step, as
ampdoctor does); one tuple is stored per step.

    python benchmarks/minimal_step.py --model nanogpt --device cuda [--steps 120]
    python benchmarks/minimal_step.py --model mlp --device cpu --amp fp16

The table (median ms a step, +ms over plain, ratio; then device ops a step) prints last.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.overhead import build  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.record.monitor import caller_location  # noqa: E402
from ampdoctor.tensors import rng_state, shallow  # noqa: E402

_CLIP = torch.nn.utils.clip_grad_norm_


class Minimal:
    """The essential work of a routine step, nothing else (see the module docstring)."""

    def __init__(self, model, opt, scaler):
        self.events, self.vals, self.records, self.batches = [], [], [], []
        self.pending = None
        self.cuda = scaler is not None and getattr(scaler, "_device", "") == "cuda"
        self.scaler = scaler
        model.register_forward_pre_hook(self.pre, with_kwargs=True)
        model.register_forward_hook(self.post, with_kwargs=True, always_call=True)
        for k in ("scale", "unscale_", "step", "update"):
            setattr(scaler, k, self._wrap(k, getattr(scaler, k)))
        zero = opt.zero_grad

        def zero_grad(*a, **kw):
            self.begin()
            self.events.append(("zero_grad", caller_location(2)))
            return zero(*a, **kw)
        opt.zero_grad = zero_grad

    def clip(self, *a, **kw):
        out = _CLIP(*a, **kw)
        self.events.append(("clip", caller_location(2)))
        self.vals.append(out.detach().reshape(1).float())
        return out

    def _wrap(self, kind, orig):
        def wrapper(*a, **kw):
            self.events.append((kind, caller_location(2)))
            out = orig(*a, **kw)
            if kind == "scale":
                self.vals.append(a[0].detach().reshape(1).float())
                self.vals.append(self.scaler._scale.reshape(1))
            elif kind == "step":
                flat = torch.cat(self.vals)
                if self.cuda:
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                    self.pending = (host, ev)
                else:
                    self.pending = (flat, None)
                self.vals = []
            return out
        return wrapper

    def begin(self):
        if self.pending is not None:
            host, ev = self.pending
            if ev is not None:
                ev.synchronize()
            self.records.append((len(self.records), host.tolist(), tuple(self.events)))
            self.pending = None
        self.events = []

    def pre(self, mod, args, kwargs):
        self.batches.append((shallow(args), shallow(kwargs), rng_state(None)))
        del self.batches[:-8]

    def post(self, mod, args, kwargs, out):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor):
            self.vals.append(t.detach().sum(dtype=torch.float32).reshape(1))


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="fp16", choices=["fp16", "off"])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--block", type=int, default=10)
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    model, batches, loss_of = build(a.model, dev)
    amp = a.amp == "fp16"
    runs = {}
    for name in ("plain", "minimal", "default"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        sc = torch.amp.GradScaler(dev.type)
        rec = Minimal(m, opt, sc) if name == "minimal" else None
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc) if name == "default" else None
        runs[name] = (m, opt, sc, rec, w)

    def step(name, i):
        m, opt, sc, rec, _ = runs[name]
        args, kwargs = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.float16, enabled=amp):
            loss = loss_of(m(*args, **kwargs))
        sc.scale(loss).backward()
        sc.unscale_(opt)
        (rec.clip if rec is not None else torch.nn.utils.clip_grad_norm_)(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return loss.item()

    for name in runs:  # warm-up, past the watch's sampled step 0 and its observed step
        for i in range(12):
            step(name, i)
    times = {k: [] for k in runs}
    done = 0
    while done < a.steps:
        for name in runs:
            for i in range(a.block):
                t = time.perf_counter()
                step(name, done + i)
                times[name].append(time.perf_counter() - t)
        done += a.block
    ops = {}
    for name in runs:  # device ops a routine step (steps 200+ would be sampled: these are not)
        with Count() as c:
            for i in range(5):
                step(name, i)
        ops[name] = c.n
    w = runs["default"][4]
    disabled = w.machine.disabled
    w.close()
    print(f"model={a.model} device={a.device} torch {torch.__version__} steps={a.steps}"
          + (" (the default watch disabled itself: its times are void)" if disabled else ""))
    plain = statistics.median(times["plain"])
    print("| variant | median ms | +ms over plain | ratio | ops a step | +ops |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        n = sum(ops[name].values()) / 5
        print(f"| {name} | {med * 1e3:.3f} | {(med - plain) * 1e3:+.3f} | {med / plain:.3f}x | {n:.1f} | "
              f"{n - sum(ops['plain'].values()) / 5:+.1f} |")
    extra = ops["default"] - ops["plain"]
    print("the default's extra ops a step: " + ", ".join(f"{k} {v / 5:g}" for k, v in extra.most_common(12)))


if __name__ == "__main__":
    main()
