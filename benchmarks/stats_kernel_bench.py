"""GPU microbenchmark of the per-tensor statistics kernel (every=1's device time): ampdoctor's kernel as it is
(`record/fused.py` StatBuffer) against variants of grid size and arithmetic, on GPT-2-sized tensors, with
`x.abs().amax()` as the bandwidth reference. Each variant's numbers are checked equal to StatBuffer's first.

    python benchmarks/stats_kernel_bench.py          # (CUDA + Triton) prints a table, microseconds per tensor
"""
from __future__ import annotations

import math
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
from ampdoctor.record import fused  # noqa: E402
from ampdoctor.record.stats import thresholds  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def bits_kernel(x_ptr, n, iters, cnt_ptr, ext_ptr, near, tiny, ovf, MASK: tl.constexpr, INF: tl.constexpr,
                BLOCK: tl.constexpr):
    # the values' bit patterns (int16 for fp16/bf16, int32 for fp32), sign cleared: integer compares only
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    c_nan = tl.zeros([BLOCK], tl.int32)
    c_pinf = tl.zeros([BLOCK], tl.int32)
    c_ninf = tl.zeros([BLOCK], tl.int32)
    c_zero = tl.zeros([BLOCK], tl.int32)
    c_near = tl.zeros([BLOCK], tl.int32)
    c_sub = tl.zeros([BLOCK], tl.int32)
    c_ovf = tl.zeros([BLOCK], tl.int32)
    amax = tl.zeros([BLOCK], tl.int32)
    amin = tl.full([BLOCK], INF, tl.int32)
    for i in range(0, iters):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        b = tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32)
        a = b & MASK
        isinf = a == INF
        c_nan += (a > INF).to(tl.int32)
        c_pinf += (isinf & (b >= 0)).to(tl.int32)
        c_ninf += (isinf & (b < 0)).to(tl.int32)
        af = tl.where(a < INF, a, 0)
        c_zero += ((a == 0) & m).to(tl.int32)
        c_near += (af >= near).to(tl.int32)
        c_sub += ((af > 0) & (af < tiny)).to(tl.int32)
        c_ovf += (af >= ovf).to(tl.int32)
        amax = tl.maximum(amax, af)
        amin = tl.minimum(amin, tl.where(af > 0, af, INF))
    tl.atomic_add(cnt_ptr + 0, tl.sum(c_nan.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 1, tl.sum(c_pinf.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 2, tl.sum(c_ninf.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 3, tl.sum(c_zero.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 4, tl.sum(c_near.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 5, tl.sum(c_sub.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 6, tl.sum(c_ovf.to(tl.int64), axis=0))
    tl.atomic_max(ext_ptr + 0, tl.max(amax, axis=0))
    tl.atomic_min(ext_ptr + 1, tl.min(amin, axis=0))


_BITS = {torch.float16: (torch.int16, 0x7FFF, 0x7C00), torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
         torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}


def bits_of(v: float, dt: torch.dtype) -> int:
    return int(torch.tensor(v, dtype=dt).view(_BITS[dt][0]).item())


def decode(bits: int, dt: torch.dtype) -> float:
    ib = _BITS[dt][0]
    return float(torch.tensor(bits, dtype=torch.int64).to(ib).view(dt).float().item())


def run_bits(x, ref, block, min_iters, warps, cnt, ext):
    ib, mask, inf = _BITS[x.dtype]
    near, tiny, ovf = thresholds(x.dtype, ref)
    n = x.numel()
    blocks = triton.cdiv(n, block)
    grid = max(1, min(1024, triton.cdiv(blocks, min_iters)))
    bits_kernel[(grid,)](x.view(ib), n, triton.cdiv(blocks, grid), cnt, ext, bits_of(near, x.dtype),
                         bits_of(tiny, x.dtype), bits_of(ovf, x.dtype), MASK=mask, INF=inf, BLOCK=block,
                         num_warps=warps)


def run_cur(x, ref, block, min_iters, warps, cnt, ext):
    near, tiny, ovf = thresholds(x.dtype, ref)
    n = x.numel()
    blocks = triton.cdiv(n, block)
    grid = max(1, min(1024, triton.cdiv(blocks, min_iters)))
    fused._kernel()[0][(grid,)](x, n, triton.cdiv(blocks, grid), cnt, ext, tiny, near, ovf, BLOCK=block,
                                num_warps=warps)


def row_bits(x, ref, **kw):
    cnt = torch.zeros(7, dtype=torch.int64, device=x.device)
    ext = torch.tensor([0, 0x7FFFFFFF], dtype=torch.int32, device=x.device)
    run_bits(x, ref, cnt=cnt, ext=ext, **kw)
    e = ext.tolist()
    inf = _BITS[x.dtype][2]
    mn = math.inf if e[1] >= inf else decode(e[1], x.dtype)
    return cnt.tolist() + [decode(e[0], x.dtype), mn]


def row_ref(x, ref):
    b = fused.StatBuffer(x.device, rows=4)
    b.add(x, thresholds(x.dtype, ref))
    v = b.vectors()[0].tolist()  # numel nan posinf neginf zeros absmax min_nonzero near_max subnormal overflow_as_ref
    zeros = v[4]
    return [int(v[1]), int(v[2]), int(v[3]), int(zeros), int(v[7]), int(v[8]), int(v[9]), v[5], v[6]]


def timeit(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1e3  # us


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [((768,), torch.float32), ((8, 1024), torch.float32), ((8, 1024, 768), torch.float16),
              ((8, 1024, 768), torch.float32), ((8, 1024, 3072), torch.float16), ((8, 1024, 50257), torch.float16)]
    variants = {
        "cur (1024, grid<=1024)": (run_cur, dict(block=1024, min_iters=1, warps=4)),
        "cur, >=16 iters": (run_cur, dict(block=1024, min_iters=16, warps=4)),
        "bits 1024 >=16 w4": (run_bits, dict(block=1024, min_iters=16, warps=4)),
        "bits 2048 >=8 w8": (run_bits, dict(block=2048, min_iters=8, warps=8)),
        "bits 4096 >=4 w8": (run_bits, dict(block=4096, min_iters=4, warps=8)),
        "bits 1024 >=4 w4": (run_bits, dict(block=1024, min_iters=4, warps=4)),
    }
    # correctness: adversarial values, bits variants vs StatBuffer
    bad = 0
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        for ref in ((dt,) if dt != torch.float32 else (torch.float32, torch.float16, torch.bfloat16)):
            x = torch.randn(300_001, device=dev).to(dt) * 3e4 if dt != torch.bfloat16 else torch.randn(300_001, device=dev).to(dt) * 1e30
            x[::97] = 0
            x[5::1001] = float("inf")
            x[6::2003] = float("-inf")
            x[7::3001] = float("nan")
            x[8::501] = torch.finfo(dt).tiny / 4 if dt != torch.float32 else 1e-40
            x[9::301] = -1e-6
            x[10::401] = 65510.0 if dt == torch.float32 else x[10::401]
            want = row_ref(x, ref)
            for name, (fn, kw) in variants.items():
                if fn is not run_bits:
                    continue
                got = row_bits(x, ref, **kw)
                if got != want:
                    bad += 1
                    print("MISMATCH", name, dt, ref, got, want)
    print("correctness:", "OK" if not bad else f"{bad} mismatches")
    rows = []
    for shape, dt in shapes:
        x = torch.randn(shape, device=dev).to(dt)
        cnt = torch.zeros(7, dtype=torch.int64, device=dev)
        ext32 = torch.zeros(2, dtype=torch.float32, device=dev)
        exti = torch.zeros(2, dtype=torch.int32, device=dev)
        ref = torch.float16
        r = {"torch abs().amax()": timeit(lambda: x.abs().amax())}
        for name, (fn, kw) in variants.items():
            ext = exti if fn is run_bits else ext32
            r[name] = timeit(lambda fn=fn, kw=kw, ext=ext: fn(x, ref, cnt=cnt, ext=ext, **kw))
        rows.append((f"{tuple(shape)} {str(dt)[6:]}", x.numel() * x.element_size() / 1e6, r))
    names = list(rows[0][2])
    print("| tensor | MB | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for label, mb, r in rows:
        print(f"| {label} | {mb:.1f} | " + " | ".join(f"{r[k]:.1f}" for k in names) + " |")
    print("(microseconds per tensor, device time)")


if __name__ == "__main__":
    main()
