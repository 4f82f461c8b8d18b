"""Where a watched step spends its time: cProfile of the host side and aten op counts per step.

    python benchmarks/profile_every1.py --model cpu-gpt --every 1 --steps 10 [--device cuda] [--top 30]

Runs `--steps` steps unwatched and `--steps` steps watched (after warm-up), prints per-step wall time of both,
the number of aten ops per step (torch.profiler, CPU side: one op ~ one kernel launch on CUDA) and the
functions with the highest own time in the watched steps.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as bench  # noqa: E402

import ampdoctor  # noqa: E402


def _ops_per_step(v, batches, loss_of, steps, kernels=False):
    """(aten ops per step, device kernels per step, device busy ms per step)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=kernels) as prof:
        for i in range(steps):
            v.step(batches[i % len(batches)], loss_of)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    n = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    kern = busy = 0.0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kern += 1
            busy += getattr(e, "device_time", 0) or getattr(e, "cuda_time", 0) or 0
    if kernels:
        ka = prof.key_averages(group_by_input_shape=True)
        for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
            try:
                print(ka.table(sort_by=key, row_limit=25, max_name_column_width=40, max_shapes_column_width=70))
                break
            except Exception:
                continue
    return n / steps, kern / steps, busy / 1e3 / steps


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cpu-gpt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--amp", default=None, choices=["fp16", "bf16", "off"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kernels", action="store_true", help="print the top ops by device time, by input shape")
    p.add_argument("--dump", default=None, help="also write the watched steps' cProfile to this file")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    amp = a.amp or ("fp16" if dev.type == "cuda" else "off")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    base, batches, loss_of = bench.build(a.model, dev)
    plain = bench.Variant("plain", copy.deepcopy(base), dev, amp_dtype)
    watched = bench.Variant("w", copy.deepcopy(base), dev, amp_dtype)
    w = ampdoctor.watch(watched.model, optimizer=watched.opt, scaler=watched.scaler, every=a.every)

    def timed(v):
        ts = []
        for i in range(a.steps):
            bench._sync(dev)
            t = time.perf_counter()
            v.step(batches[i % len(batches)], loss_of)
            bench._sync(dev)
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2] * 1e3

    for v in (plain, watched):
        for i in range(3):
            v.step(batches[i % len(batches)], loss_of)
    tp, tw = timed(plain), timed(watched)
    print(f"{a.model} {dev} amp={amp} every={a.every}: plain {tp:.2f} ms/step, watched {tw:.2f} ms/step "
          f"({tw / tp:.3f}x)")
    op_p, k_p, b_p = _ops_per_step(plain, batches, loss_of, 3)
    op_w, k_w, b_w = _ops_per_step(watched, batches, loss_of, 3, kernels=a.kernels)
    print(f"aten ops per step: plain {op_p:.0f}, watched {op_w:.0f} (+{op_w - op_p:.0f})")
    if dev.type == "cuda":
        print(f"device kernels per step: plain {k_p:.0f}, watched {k_w:.0f}; device busy ms per step: "
              f"plain {b_p:.1f}, watched {b_w:.1f}")
    nmod = sum(1 for _ in watched.model.modules())
    print(f"modules: {nmod}")
    pr = cProfile.Profile()
    pr.enable()
    for i in range(a.steps):
        watched.step(batches[i % len(batches)], loss_of)
    bench._sync(dev)
    pr.disable()
    w.close()
    if a.dump:
        pr.dump_stats(a.dump)
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("ampdoctor", a.top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
