"""Where ampdoctor's host time goes, per step, on a host-bound loop (issue 15: the nanoGPT-style step syncs every
iteration with `loss.item()`, so every microsecond of Python shows).

Runs the variants interleaved (timing, with `loss.item()` each step), then profiles each watched variant with
cProfile and attributes host time to ampdoctor: the own time of every ampdoctor function plus the time of every
call it makes outside ampdoctor (torch functions, builtins), except the user's own calls it wraps (the
scaler's and optimizer's methods, clipping, the modules' forward). Prints the ampdoctor functions and the
outside calls by attributed time per step; cProfile inflates everything, so read the shares, not the
absolute numbers.

    python benchmarks/host_profile.py --model nanogpt --device cuda [--variants plain,default,headroom]
    python benchmarks/host_profile.py --model nanogpt-tiny --device cpu      # the same hooks, tiny tensors
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.overhead import Variant, build  # noqa: E402

# the user's calls that ampdoctor's wrappers and hooks pass through: their time is the plain step's
_WRAPPED = ("grad_scaler.py", "optimizer.py", "adam.py", "adamw.py", "clip_grad.py", "nanogpt.py",
            "module.py", "modeling_gpt2.py", "overhead.py", "_compile.py")


def _mine(fn: str) -> bool:
    return f"{os.sep}ampdoctor{os.sep}" in fn


def attribute(st: pstats.Stats, steps: int, top: int):
    own: dict = {}
    outside: dict = {}
    callees: dict = {}
    for callee, (_, _, _, _, callers) in st.stats.items():
        for caller in callers:
            callees.setdefault(caller, set()).add(callee)
    for callee, (cc, nc, tt, ct, callers) in st.stats.items():
        if _mine(callee[0]):
            own[callee] = own.get(callee, 0.0) + tt
            continue
        if os.path.basename(callee[0]) in _WRAPPED:
            continue
        # a call that runs ampdoctor code again (a wrapper such as torch.compiler.disable's) counts its own
        # time only: what it calls is attributed where it lands
        reenters = any(_mine(k[0]) for k in callees.get(callee, ()))
        for caller, edge in callers.items():
            if _mine(caller[0]):
                e_t = edge[2 if reenters else 3] if isinstance(edge, tuple) else 0.0
                outside[(callee, caller)] = outside.get((callee, caller), 0.0) + e_t
    total = sum(own.values()) + sum(outside.values())

    def name(k):
        fn, ln, fname = k
        return f"{os.path.basename(fn)}:{ln}({fname})" if fn != "~" else fname

    lines = [f"attributed host time: {total / steps * 1e3:.3f} ms/step (cProfile-inflated)"]
    lines.append("| ampdoctor function | own ms/step |")
    lines.append("|---|---:|")
    for k, v in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name(k)} | {v / steps * 1e3:.3f} |")
    lines.append("| outside call <- ampdoctor caller | ms/step |")
    lines.append("|---|---:|")
    for (callee, caller), v in sorted(outside.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name(callee)[:60]} <- {name(caller)} | {v / steps * 1e3:.3f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="fp16", choices=["fp16", "bf16", "off"])
    p.add_argument("--variants", default="plain,default,headroom")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prof-steps", type=int, default=30)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--spin", default=None, metavar="VARIANT:SECONDS",
                   help="only run this variant's loop for SECONDS (to sample with py-spy; see pyspy_attr.py)")
    a = p.parse_args()
    dev = torch.device(a.device)
    if a.model == "nanogpt-tiny":  # nanoGPT's module tree (6 blocks) with tiny tensors: host cost only
        from benchmarks.realworld.nanogpt import GPT, GPTConfig
        torch.manual_seed(0)
        base = GPT(GPTConfig(block_size=16, vocab_size=65, n_layer=6, n_head=2, n_embd=32, dropout=0.2)).to(dev)
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(4):
            idx = torch.randint(0, 65, (2, 17), generator=g)
            batches.append(((idx[:, :-1].contiguous().to(dev), idx[:, 1:].contiguous().to(dev)), {}))

        def loss_of(o):
            return o[1]
    else:
        base, batches, loss_of = build(a.model, dev)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[a.amp]
    names = [n for n in a.variants.split(",") if n]
    if a.spin:
        name, _, secs = a.spin.partition(":")
        v = Variant(name, base, dev, amp)
        v.install()
        t0, i = time.perf_counter(), 0
        while time.perf_counter() - t0 < float(secs or 20):
            v.step(batches[i % len(batches)], loss_of).item()
            i += 1
        print(f"{name}: {i} steps in {secs} s")
        return
    vs = [Variant(n, copy.deepcopy(base), dev, amp) for n in names]
    for v in vs:
        v.install()
    times = {v.label: [] for v in vs}
    for i in range(a.steps + 10):
        for v in vs:
            t = time.perf_counter()
            v.step(batches[i % len(batches)], loss_of).item()  # the loop syncs every iteration
            if i >= 10:
                times[v.label].append(time.perf_counter() - t)
    base_ms = statistics.median(times[vs[0].label]) * 1e3
    print(f"model={a.model} device={a.device} amp={a.amp} torch {torch.__version__}")
    print("| variant | median ms | ratio | +ms |")
    print("|---|---:|---:|---:|")
    for v in vs:
        md = statistics.median(times[v.label]) * 1e3
        print(f"| {v.label} | {md:.3f} | {md / base_ms:.3f}x | {md - base_ms:+.3f} |")
    for v in vs:
        if v.watch is None:
            continue
        pr = cProfile.Profile()
        pr.enable()
        for i in range(a.prof_steps):
            v.step(batches[i % len(batches)], loss_of).item()
        pr.disable()
        print(f"\n## {v.label}")
        print(attribute(pstats.Stats(pr), a.prof_steps, a.top))


if __name__ == "__main__":
    main()
