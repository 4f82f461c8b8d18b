"""The Triton kernels of the fused statistics (ampdoctor/record/fused.py owns their use): one block's counts and
extremes (`acc`, every statistic; `lean`, the cheap route), a program's totals into a row (`emit`, `emit_lean`),
the per-tensor kernel and the table kernel. Imported only where Triton is (fused._kernel), so that the package
imports without it.

Each program first reads its share of a tensor the cheap way (`lean`: zeros, below-normal, finite abs-max and
smallest nonzero, and one flag per lane for a value that is NaN, ±inf or at least `min(near, ovf)`). Only a program
whose share raised the flag reads it again with every count (`acc`). Without such a value the counts the cheap
route leaves out (NaN, ±inf, near-max, would-overflow) are zero, so both routes give the same row; healthy values
almost never raise it, and the full arithmetic (nine accumulators per value) made the kernel compute-bound at
~0.9 TB/s on an H200."""
import triton
import triton.language as tl


@triton.jit
def acc(x, m, c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin, tiny, near, ovf):
    # one block of values (x as fp32, m: which lanes hold one) into the per-lane accumulators
    a = tl.abs(x)
    fin = m & (a < float("inf")) & (x == x)
    af = tl.where(fin, a, 0.0)
    c_nan += ((x != x) & m).to(tl.int32)
    c_pinf += ((x == float("inf")) & m).to(tl.int32)
    c_ninf += ((x == float("-inf")) & m).to(tl.int32)
    c_zero += (fin & (af == 0.0)).to(tl.int32)
    c_near += (fin & (af >= near)).to(tl.int32)
    c_sub += (fin & (af > 0.0) & (af < tiny)).to(tl.int32)
    c_ovf += (fin & (af >= ovf)).to(tl.int32)
    amax = tl.maximum(amax, af)
    amin = tl.minimum(amin, tl.where(fin & (af > 0.0), af, float("inf")))
    return c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin


@triton.jit
def lean(x, m, c_zero, c_sub, c_big, amax, amin, tiny, big):
    # the cheap route for one block: a masked lane holds 0.0 (other=0.0), so only the zero count needs the mask;
    # c_big flags a lane that saw NaN (a != a), ±inf or a value >= big (then the program reads its share again)
    a = tl.abs(x)
    c_zero += ((a == 0.0) & m).to(tl.int32)
    c_sub += ((a > 0.0) & (a < tiny)).to(tl.int32)
    c_big = c_big | ((a >= big) | (a != a)).to(tl.int32)
    amax = tl.maximum(amax, a)
    amin = tl.minimum(amin, tl.where(a > 0.0, a, float("inf")))
    return c_zero, c_sub, c_big, amax, amin


@triton.jit
def fresh(BLOCK: tl.constexpr):
    z = tl.zeros([BLOCK], tl.int32)
    return z, z, z, z, z, z, z, tl.zeros([BLOCK], tl.float32), tl.full([BLOCK], float("inf"), tl.float32)


@triton.jit
def fresh_lean(BLOCK: tl.constexpr):
    z = tl.zeros([BLOCK], tl.int32)
    return z, z, z, tl.zeros([BLOCK], tl.float32), tl.full([BLOCK], float("inf"), tl.float32)


@triton.jit
def emit(cnt_ptr, ext_ptr, c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin):
    # a program's totals into its tensor's row (counts int64 x 7, extremes fp32 x 2)
    tl.atomic_add(cnt_ptr + 0, tl.sum(c_nan.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 1, tl.sum(c_pinf.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 2, tl.sum(c_ninf.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 3, tl.sum(c_zero.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 4, tl.sum(c_near.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 5, tl.sum(c_sub.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 6, tl.sum(c_ovf.to(tl.int64), axis=0))
    tl.atomic_max(ext_ptr + 0, tl.max(amax, axis=0))
    tl.atomic_min(ext_ptr + 1, tl.min(amin, axis=0))


@triton.jit
def emit_lean(cnt_ptr, ext_ptr, c_zero, c_sub, amax, amin):
    # the cheap route's totals (its other counts are zero: nothing to add)
    tl.atomic_add(cnt_ptr + 3, tl.sum(c_zero.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 5, tl.sum(c_sub.to(tl.int64), axis=0))
    tl.atomic_max(ext_ptr + 0, tl.max(amax, axis=0))
    tl.atomic_min(ext_ptr + 1, tl.min(amin, axis=0))


@triton.jit
def stats_kernel(x_ptr, n, iters, cnt_ptr, ext_ptr, tiny, near, ovf, BLOCK: tl.constexpr):
    # One tensor: a capped grid of programs, each striding over it with per-lane accumulators (a large tensor
    # costs one read and a few atomics per program, not per block of 1024 values).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    big = tl.minimum(near, ovf)
    c_zero, c_sub, c_big, amax, amin = fresh_lean(BLOCK)
    for i in range(0, iters):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        c_zero, c_sub, c_big, amax, amin = lean(x, m, c_zero, c_sub, c_big, amax, amin, tiny, big)
    if tl.max(c_big, axis=0) > 0:  # NaN, inf or a value past a threshold here: every count, read again
        c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin = fresh(BLOCK)
        for i in range(0, iters):
            offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin = acc(
                x, m, c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin, tiny, near, ovf)
        emit(cnt_ptr, ext_ptr, c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin)
    else:
        emit_lean(cnt_ptr, ext_ptr, c_zero, c_sub, amax, amin)


@triton.jit
def stats_table_kernel(base_ptr, meta_ptr, T, cnt_ptr, ext_ptr, tiny, near, ovf, BLOCK: tl.constexpr,
                       ALIGN: tl.constexpr):
    # program (t, p): tensor t of the table, its p-th share of the blocks. A tensor is addressed by its element
    # offset from `base_ptr` (a multiple of ALIGN elements: 16 bytes, so loads vectorise); full blocks are
    # read unmasked, the tail by program 0 with a mask; a program with no block adds nothing.
    t = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    nprog = tl.num_programs(1).to(tl.int64)
    off = tl.multiple_of(tl.load(meta_ptr + t), ALIGN)
    n = tl.load(meta_ptr + T + t)
    row = tl.load(meta_ptr + 2 * T + t)
    full = n - n % BLOCK
    big = tl.minimum(near, ovf)
    ones = tl.full([BLOCK], 1, tl.int1)
    c_zero, c_sub, c_big, amax, amin = fresh_lean(BLOCK)
    for start in range(p * BLOCK, full, nprog * BLOCK):
        start = tl.multiple_of(start, BLOCK)
        x = tl.load(base_ptr + off + start + tl.arange(0, BLOCK)).to(tl.float32)
        c_zero, c_sub, c_big, amax, amin = lean(x, ones, c_zero, c_sub, c_big, amax, amin, tiny, big)
    if p == 0:
        offs = full + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(base_ptr + off + offs, mask=m, other=0.0).to(tl.float32)
        c_zero, c_sub, c_big, amax, amin = lean(x, m, c_zero, c_sub, c_big, amax, amin, tiny, big)
    if (p == 0) | (p * BLOCK < full):
        if tl.max(c_big, axis=0) > 0:  # NaN, inf or a value past a threshold here: every count, read again
            c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin = fresh(BLOCK)
            for start in range(p * BLOCK, full, nprog * BLOCK):
                start = tl.multiple_of(start, BLOCK)
                x = tl.load(base_ptr + off + start + tl.arange(0, BLOCK)).to(tl.float32)
                c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin = acc(
                    x, ones, c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin, tiny, near, ovf)
            if p == 0:
                offs = full + tl.arange(0, BLOCK)
                m = offs < n
                x = tl.load(base_ptr + off + offs, mask=m, other=0.0).to(tl.float32)
                c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin = acc(
                    x, m, c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin, tiny, near, ovf)
            emit(cnt_ptr + row * 7, ext_ptr + row * 2,
                 c_nan, c_pinf, c_ninf, c_zero, c_near, c_sub, c_ovf, amax, amin)
        else:
            emit_lean(cnt_ptr + row * 7, ext_ptr + row * 2, c_zero, c_sub, amax, amin)
