"""The CPU fast path for `stats.full_stats`: every statistic of a tensor in one pass of a small C function.

On the CPU a watched step with `every=1` measures a few hundred tensors; what costs is not the arithmetic but
the per-call work around it (an eager `full_stats` is a dozen ATen ops, a torch.compile'd one pays the
compiled-function wrapper each call). This module compiles ~80 lines of C once per machine with the system C
compiler (`cc -O3 -fopenmp-simd`: vectorised, single-threaded, no OpenMP runtime; an AVX2 clone where
supported; well under a second), loads it with ctypes and calls it on the tensor's memory: one
pass, a few microseconds of call overhead, the result written straight into a float64 row laid out like
`records.STAT_FIELDS`. The numbers equal the eager reference exactly (`tests/test_stats.py`): comparisons use
the thresholds rounded to the tensor's own dtype, as the eager ops do. Without a C compiler, `available()` is
False and callers use the compiled or eager path.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import subprocess
import sys
import tempfile
import threading

import torch

from .fused import is_dense
from .stats import _F64, _THR

__all__ = ["available", "supports", "stats", "absmax"]

_SRC = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static float h2f_table[65536];
static int table_ready = 0;

static float half_to_float(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        if (m == 0) { bits = s; }
        else { int k = -1; do { k++; m <<= 1; } while (!(m & 0x400)); m &= 0x3ff;
               bits = s | ((uint32_t)(127 - 15 - k) << 23) | (m << 13); }
    } else if (e == 31) { bits = s | 0x7f800000u | (m << 13); }
    else { bits = s | ((e + 127 - 15) << 23) | (m << 13); }
    float f; memcpy(&f, &bits, 4); return f;
}

void ad_init(void) {
    if (table_ready) return;
    for (uint32_t i = 0; i < 65536; i++) h2f_table[i] = half_to_float((uint16_t)i);
    table_ready = 1;
}

/* One pass, branch-free so the inner loop vectorises (omp simd); chunks of 2^16 values with int32 counters,
   summed in int64. Single-threaded (threads cost more than they save at these sizes, measured) and no OpenMP
   runtime next to torch's own.
   out: numel nan posinf neginf zeros absmax min_nonzero near_max subnormal overflow_as_ref (as full_stats) */
#define CHUNK 65536
#ifdef AD_CLONES  /* an AVX2 build next to the baseline one, picked at load time */
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

typedef struct { int64_t c[7]; double mx, mn; } part_t;
typedef struct { const void *p; int64_t lo, hi; double near, tiny, ovf; part_t r; void (*fn)(void *); } job_t;

#define KERNEL(NAME, T, ARG, LOAD)                                                                          \
CLONES static void NAME##_range(void *arg) {                                                              \
    job_t *j = (job_t *)arg;                                                                               \
    const ARG *p = (const ARG *)j->p;                                                                      \
    T near = (T)j->near, tiny = (T)j->tiny, ovf = (T)j->ovf;                                              \
    int64_t c_nan = 0, c_pinf = 0, c_ninf = 0, c_zero = 0, c_near = 0, c_below = 0, c_ovf = 0;              \
    T amax = 0, amin = (T)INFINITY;                                                                        \
    for (int64_t lo = j->lo; lo < j->hi; lo += CHUNK) {                                                    \
        int64_t hi = lo + CHUNK < j->hi ? lo + CHUNK : j->hi;                                              \
        int32_t k_nan = 0, k_pinf = 0, k_ninf = 0, k_zero = 0, k_near = 0, k_below = 0, k_ovf = 0;         \
        T mx = 0, mn = (T)INFINITY;                                                                        \
        _Pragma("omp simd reduction(+:k_nan,k_pinf,k_ninf,k_zero,k_near,k_below,k_ovf) reduction(max:mx) reduction(min:mn)") \
        for (int64_t i = lo; i < hi; i++) {                                                                \
            T x = LOAD;                                                                                    \
            T a = x < 0 ? -x : x;                                                                          \
            int isnan_ = x != x, isinf_ = a == (T)INFINITY;                                                \
            k_nan += isnan_; k_pinf += isinf_ & (x > 0); k_ninf += isinf_ & (x < 0);                       \
            T af = (isnan_ | isinf_) ? (T)0 : a;                                                           \
            k_zero += af == 0; k_near += af >= near; k_below += af < tiny; k_ovf += af >= ovf;             \
            mx = af > mx ? af : mx;                                                                        \
            T m = af > 0 ? af : (T)INFINITY;                                                               \
            mn = m < mn ? m : mn;                                                                          \
        }                                                                                                  \
        c_nan += k_nan; c_pinf += k_pinf; c_ninf += k_ninf; c_zero += k_zero; c_near += k_near;            \
        c_below += k_below; c_ovf += k_ovf;                                                                \
        amax = mx > amax ? mx : amax; amin = mn < amin ? mn : amin;                                        \
    }                                                                                                      \
    part_t r = {{c_nan, c_pinf, c_ninf, c_zero, c_near, c_below, c_ovf}, (double)amax, (double)amin};      \
    j->r = r;                                                                                              \
}                                                                                                          \
void NAME(const ARG *p, int64_t n, double near, double tiny, double ovf, double *out) {                   \
    run(NAME##_range, p, n, near, tiny, ovf, out);                                                         \
}

static void run(void (*fn)(void *), const void *p, int64_t n, double near, double tiny, double ovf, double *out) {
    job_t j = {p, 0, n, near, tiny, ovf, {{0}, 0, 0}, fn};
    fn(&j);
    const int64_t *c = j.r.c;
    double nonfin = (double)(c[0] + c[1] + c[2]);
    out[0] = (double)n; out[1] = (double)c[0]; out[2] = (double)c[1]; out[3] = (double)c[2];
    out[4] = (double)c[3] - nonfin; out[5] = j.r.mx; out[6] = j.r.mn;
    out[7] = (double)c[4]; out[8] = (double)(c[5] - c[3]); out[9] = (double)c[6];
}

static inline float bf16_to_float(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }

KERNEL(ad_stats_f32, float, float, p[i])
KERNEL(ad_stats_f16, float, uint16_t, h2f_table[p[i]])
KERNEL(ad_stats_bf16, float, uint16_t, bf16_to_float(p[i]))
KERNEL(ad_stats_f64, double, double, p[i])
"""

_LIB = None
_LOCK = threading.Lock()
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_THRESH: dict = {}


def _compile(cc: str, so: str) -> None:
    """Compile _SRC to `so`, atomically: built next to it, then renamed (same directory, same file system)."""
    tmp = f"{so}.{os.getpid()}.tmp"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "cpustats.c")
        with open(src, "w") as f:
            f.write(_SRC)
        for extra in (["-DAD_CLONES"], []):  # without function multiversioning where it is unsupported
            r = subprocess.run([cc, "-O3", "-fopenmp-simd", "-fPIC", "-shared", *extra, "-o", tmp, src, "-lm"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
            if r.returncode == 0:
                break
        r.check_returncode()
    os.replace(tmp, so)  # a concurrent process (another rank) sees no library or the whole one


def _build():
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha1((_SRC + cc + sys.platform).encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    so, err = None, None
    for root in (os.path.join(cache, "ampdoctor"), os.path.join(tempfile.gettempdir(), f"ampdoctor-{uid}")):
        so = os.path.join(root, f"cpustats-{tag}.so")
        try:  # a read-only home falls back to the temporary directory
            if not os.path.exists(so):
                os.makedirs(root, exist_ok=True)
                _compile(cc, so)
            break
        except OSError as e:
            err, so = e, None
    if so is None:
        raise err
    lib = ctypes.CDLL(so)
    lib.ad_init()
    vp, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    fns = {}
    for dt, name in ((torch.float32, "ad_stats_f32"), (torch.float16, "ad_stats_f16"),
                     (torch.bfloat16, "ad_stats_bf16"), (torch.float64, "ad_stats_f64")):
        fn = getattr(lib, name)
        fn.argtypes = [vp, i64, f64, f64, f64, vp]
        fn.restype = None
        fns[dt] = fn
    lib.fns = fns
    return lib


def available() -> bool:
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                try:
                    _LIB = _build()
                except Exception:  # no C compiler here: the compiled/eager paths serve
                    _LIB = False
    return bool(_LIB)


def _thresholds(dt: torch.dtype, ref: torch.dtype) -> tuple[float, float, float]:
    """The eager ops compare |x| with Python floats in x's own dtype: round the thresholds the same way."""
    key = (dt, ref)
    if key not in _THRESH:
        near, tiny, ovf = _THR.get(ref, _THR[torch.float32])
        if not (dt.itemsize > ref.itemsize or (dt == torch.float32 and ref == torch.float16)):
            ovf = float("inf")  # full_stats counts cast overflow only for a wider tensor measured against ref
        _THRESH[key] = tuple(torch.tensor(v, dtype=dt).item() for v in (near, tiny, ovf))
    return _THRESH[key]


def stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    """All of STAT_FIELDS for one CPU tensor (float16/bfloat16/float32/float64), as a float64 row."""
    x = x.detach()
    out = torch.empty(10, dtype=_F64)
    n = x.numel()
    if n == 0:
        out.copy_(torch.tensor([0.0, 0, 0, 0, 0, 0.0, float("inf"), 0, 0, 0], dtype=_F64))
        return out
    # order does not matter for these statistics: read a dense (e.g. permuted) tensor's memory as it lies
    flat = x if x.is_contiguous() else (x.as_strided((n,), (1,), x.storage_offset()) if is_dense(x)
                                        else x.contiguous())
    near, tiny, ovf = _thresholds(x.dtype, ref)
    _LIB.fns[x.dtype](flat.data_ptr(), n, near, tiny, ovf, out.data_ptr())
    return out


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and available()


SMALL = 1 << 16        # elements: a smaller tensor is cheaper in one multi-tensor call with the others than in a C call
CHUNK_BYTES = 64 << 20  # of small tensors one multi-tensor call takes (their absolute values are copies)
_foreach_max = getattr(torch, "_foreach_max", None)


def absmax(ts: list[torch.Tensor]) -> torch.Tensor:
    """The abs-max of each CPU tensor, NaN-propagating (NaN when any value is, else inf when any is ±inf; 0 for an
    empty one), as a float64 vector: a tensor of SMALL elements or more by the one-pass C statistics (no copy,
    ~3x faster there), the small ones together by `_foreach_max(_foreach_abs(...))` (~1.7x faster than a C call or
    an abs().amax() each)."""
    out = torch.zeros(len(ts), dtype=_F64)
    small, size, chunks = [], 0, []
    for i, t in enumerate(ts):
        n = t.numel()
        if n >= SMALL and supports(t):
            r = stats(t, t.dtype).tolist()  # records.STAT_FIELDS order
            out[i] = math.nan if r[1] else math.inf if r[2] + r[3] else r[5]
        elif n:
            small.append(i)
            size += t.nbytes
            if size >= CHUNK_BYTES:
                chunks.append(small)
                small, size = [], 0
    if small:
        chunks.append(small)
    with torch.autocast("cpu", enabled=False):  # (stacking fp16 values inside a bf16 autocast region fails)
        for idx in chunks:
            sub = [ts[i] for i in idx]
            vals = _foreach_max(torch._foreach_abs(sub)) if _foreach_max is not None else [t.abs().amax() for t in sub]
            out[torch.tensor(idx)] = torch.stack(vals).to(_F64)
    return out
