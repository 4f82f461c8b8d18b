"""GPU microbenchmark of the fused statistics' table kernel (every=1's device time, `record/fused.py`): device µs
and effective bandwidth of one table pass over GPT-2-sized values, by dtype and by whether the values raise the
kernel's flag (a value at or past the near-max threshold, as scaled gradients do: the program reads its share
again with every count), against `x.abs().amax()` on the same bytes.

    python benchmarks/table_kernel_bench.py          # (CUDA + Triton) prints a table last
    python benchmarks/table_kernel_bench.py --sweep  # the same per (BLOCK, ITERS, warps) of the table kernel, each
                                                     # config's rows checked equal to the shipped config's
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ampdoctor.record import fused  # noqa: E402
from ampdoctor.record.stats import thresholds  # noqa: E402


def _time(fn, reps=20) -> float:
    """Median device milliseconds of fn() (queued behind a sleeping kernel, so that the host's Python does not show
    as device time)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def table_pass(vals, ref, plan, rows=False):
    buf = fused.StatBuffer(torch.device("cuda"), rows=len(vals) + 1, plan=plan)
    for i, x in enumerate(vals):
        buf.add(x, thresholds(x.dtype, ref), key=("k", i))
    if rows:
        return buf.vectors().cpu()
    buf.flush()
    return None


def cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 8 * 1024 * 768  # one GPT-2 small activation (B=8, T=1024)
    for dt in (torch.float16, torch.float32):
        for label, scale in (("activation-like (|x|~3)", 1.0), ("scaled-gradient-like (past near-max)", 2e4)):
            vals = [(torch.randn(n * k, generator=g, device="cuda") * scale).to(dt) for k in (1, 1, 4, 4, 3, 1, 1, 1)]
            vals[3][12345] = float("inf")  # one program of one tensor takes the every-count read
            yield str(dt).replace("torch.", ""), label, vals


def sweep():
    configs = [(1024, 8, 4), (2048, 8, 4), (4096, 8, 4), (2048, 8, 8), (4096, 8, 8), (8192, 8, 16), (1024, 32, 2)]
    data = list(cases())
    want = None
    out = []
    for blk, iters, warps in configs:
        fused._T_BLOCK, fused._T_ITERS, fused._T_WARPS = blk, iters, warps
        got, times = [], []
        for dt, label, vals in data:
            plan = fused.DeferPlan()
            table_pass(vals, torch.float16, plan)  # the learning pass
            got.append(table_pass(vals, torch.float16, plan, rows=True))
            times.append(_time(lambda: table_pass(vals, torch.float16, plan)) * 1e3)
        if want is None:
            want = got
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        out.append((blk, iters, warps, times, same))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; table pass µs per case: "
          + "; ".join(f"{dt} {label}" for dt, label, _ in data))
    print("| BLOCK | ITERS | warps | " + " | ".join(f"case {i}" for i in range(len(data))) + " | rows equal |")
    print("|---:|---:|---:|" + "---:|" * len(data) + "---|")
    for blk, iters, warps, times, same in out:
        print(f"| {blk} | {iters} | {warps} | " + " | ".join(f"{t:.0f}" for t in times) + f" | {same} |")


def main():
    if not torch.cuda.is_available() or not fused.available(torch.zeros(1, device="cuda")):
        raise SystemExit("needs CUDA and Triton")
    if "--sweep" in sys.argv:
        return sweep()
    rows = []
    for dt, label, vals in cases():
        plan = fused.DeferPlan()
        table_pass(vals, torch.float16, plan)  # the learning pass (per-tensor launches)
        assert plan.learned
        ms = _time(lambda: table_pass(vals, torch.float16, plan))
        ref = _time(lambda: [x.abs().amax() for x in vals])
        nbytes = sum(x.nbytes for x in vals)
        rows.append((dt, label, nbytes / 2**20, ms * 1e3, nbytes / ms / 1e6, ref * 1e3, nbytes / ref / 1e6))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| dtype | values | MiB | table pass µs | GB/s | abs().amax() µs | GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.0f} | {r[6]:.0f} |")


if __name__ == "__main__":
    main()
