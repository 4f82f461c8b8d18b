"""Diagnostic variants of the fused statistics' table kernel (device time only; not used by ampdoctor): what bounds
the shipped kernel (`ampdoctor/record/fusedkernels.py` stats_table_kernel), measured on the cases of
`benchmarks/table_kernel_bench.py`:

- `shipped`:   ampdoctor's table pass as it is (StatBuffer.flush);
- `lean-only`: the same grid and loop, the cheap route's arithmetic only (never the second read);
- `amax-only`: the same grid and loop, one accumulator (abs-max);
- `load-only`: the same grid and loop, the values summed (the floor of this loop shape);
- `unroll2`:   the cheap route with two blocks loaded per iteration (more bytes in flight per warp).

    python benchmarks/table_kernel_variants.py       # (CUDA + Triton) a table of µs per case, last
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ampdoctor.record import fused  # noqa: E402
from ampdoctor.record.fusedkernels import fresh_lean, lean  # noqa: E402
from ampdoctor.record.tables import triton_cdiv  # noqa: E402
import table_kernel_bench as bench  # noqa: E402


@triton.jit
def _head(meta_ptr, T, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # program (t, p): tensor t of the table (its element offset and its whole blocks' end), its p-th share
    t = tl.program_id(0)
    off = tl.multiple_of(tl.load(meta_ptr + t), ALIGN)
    n = tl.load(meta_ptr + T + t)
    return t, off, n - n % BLOCK, tl.program_id(1).to(tl.int64), tl.num_programs(1).to(tl.int64)


@triton.jit
def lean_only_kernel(base_ptr, meta_ptr, T, out_ptr, tiny, big, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    t, off, full, p, nprog = _head(meta_ptr, T, BLOCK, ALIGN)
    ones = tl.full([BLOCK], 1, tl.int1)
    c_zero, c_sub, c_big, amax, amin = fresh_lean(BLOCK)
    for start in range(p * BLOCK, full, nprog * BLOCK):
        start = tl.multiple_of(start, BLOCK)
        x = tl.load(base_ptr + off + start + tl.arange(0, BLOCK)).to(tl.float32)
        c_zero, c_sub, c_big, amax, amin = lean(x, ones, c_zero, c_sub, c_big, amax, amin, tiny, big)
    tot = tl.sum(c_zero, axis=0) + tl.sum(c_sub, axis=0) + tl.max(c_big, axis=0)
    tl.atomic_max(out_ptr + t, tl.max(amax, axis=0) + tl.min(amin, axis=0) + tot.to(tl.float32))


@triton.jit
def amax_only_kernel(base_ptr, meta_ptr, T, out_ptr, tiny, big, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    t, off, full, p, nprog = _head(meta_ptr, T, BLOCK, ALIGN)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(p * BLOCK, full, nprog * BLOCK):
        start = tl.multiple_of(start, BLOCK)
        x = tl.load(base_ptr + off + start + tl.arange(0, BLOCK)).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    tl.atomic_max(out_ptr + t, tl.max(amax, axis=0))


@triton.jit
def load_only_kernel(base_ptr, meta_ptr, T, out_ptr, tiny, big, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    t, off, full, p, nprog = _head(meta_ptr, T, BLOCK, ALIGN)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(p * BLOCK, full, nprog * BLOCK):
        start = tl.multiple_of(start, BLOCK)
        acc += tl.load(base_ptr + off + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.atomic_add(out_ptr + t, tl.sum(acc, axis=0))


@triton.jit
def unroll2_kernel(base_ptr, meta_ptr, T, out_ptr, tiny, big, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    t, off, full, p, nprog = _head(meta_ptr, T, BLOCK, ALIGN)
    ones = tl.full([BLOCK], 1, tl.int1)
    c_zero, c_sub, c_big, amax, amin = fresh_lean(BLOCK)
    step = nprog * BLOCK
    for start in range(p * BLOCK, full, 2 * step):
        start = tl.multiple_of(start, BLOCK)
        nxt = start + step
        x = tl.load(base_ptr + off + start + tl.arange(0, BLOCK)).to(tl.float32)
        y = tl.load(base_ptr + off + nxt + tl.arange(0, BLOCK), mask=(nxt + tl.arange(0, BLOCK)) < full,
                    other=0.0).to(tl.float32)
        c_zero, c_sub, c_big, amax, amin = lean(x, ones, c_zero, c_sub, c_big, amax, amin, tiny, big)
        c_zero, c_sub, c_big, amax, amin = lean(y, nxt + tl.arange(0, BLOCK) < full, c_zero, c_sub, c_big, amax,
                                                amin, tiny, big)
    tot = tl.sum(c_zero, axis=0) + tl.sum(c_sub, axis=0) + tl.max(c_big, axis=0)
    tl.atomic_max(out_ptr + t, tl.max(amax, axis=0) + tl.min(amin, axis=0) + tot.to(tl.float32))


VARIANTS = {"lean-only": lean_only_kernel, "amax-only": amax_only_kernel, "load-only": load_only_kernel,
            "unroll2": unroll2_kernel}


def variant_pass(kernel, vals):
    """One launch over `vals` (one dtype), grid as the shipped table pass's for one size class."""
    base = vals[0]
    size = base.element_size()
    meta = torch.tensor([(v.data_ptr() - base.data_ptr()) // size for v in vals] + [v.numel() for v in vals],
                        dtype=torch.int64, device=base.device)
    out = torch.zeros(len(vals), dtype=torch.float32, device=base.device)
    span = fused._T_BLOCK * fused._T_ITERS
    P = max(1, min(fused._T_MAX_PROGRAMS, triton_cdiv(max(v.numel() for v in vals), span)))
    kernel[(len(vals), P)](base, meta, len(vals), out, 6e-5, 32768.0, BLOCK=fused._T_BLOCK, ALIGN=16 // size)
    return out


def main():
    if not torch.cuda.is_available() or not fused.available(torch.zeros(1, device="cuda")):
        raise SystemExit("needs CUDA and Triton")
    rows = []
    for dt, label, vals in bench.cases():
        plan = fused.DeferPlan()
        bench.table_pass(vals, torch.float16, plan)
        r = {"shipped": bench._time(lambda: bench.table_pass(vals, torch.float16, plan)) * 1e3}
        for name, k in VARIANTS.items():
            r[name] = bench._time(lambda: variant_pass(k, vals)) * 1e3
        rows.append((dt, label, sum(v.nbytes for v in vals) / 2**20, r))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; device µs of one pass over the case's 8 values")
    print("| dtype | values | MiB | " + " | ".join(rows[0][3]) + " |")
    print("|---|---|---:|" + "---:|" * len(rows[0][3]))
    for dt, label, mib, r in rows:
        print(f"| {dt} | {label} | {mib:.0f} | " + " | ".join(f"{v:.0f}" for v in r.values()) + " |")


if __name__ == "__main__":
    main()
