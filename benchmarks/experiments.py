"""Candidate speed-ups of ampdoctor's hot path, measured in-process by monkeypatching (ampdoctor/ is untouched).

    python benchmarks/experiments.py --model gpt2 --device cuda --steps 20 \
        --variants plain,default,default-roothooks,noop-hooks,every1,every1-fused,every1-cache,every1-cache-fused
    python benchmarks/experiments.py --check      # the candidate stats equal ampdoctor's, field by field
    python benchmarks/experiments.py --micro [--cuda]   # per-call time / peak memory of the stats functions

Extra variants (each patch is active only inside that variant's own steps, so variants do not leak):
    noop-hooks          no-op forward pre/post hooks (with_kwargs, always_call) on every module: the floor of
                        per-module hooks
    default-roothooks   ampdoctor default, with the per-module hooks removed again except the root's: what an
                        unsampled step costs when module hooks are installed only for sampled steps
    every1-fused        every=1 with `fused_full_stats` / `fused_light_stats` (one stacked reduction)
    every1-cache        every=1 with a per-step cache of statistic rows keyed by (storage, shape, stride,
                        version, ref dtype): a tensor seen again (output of one module = input of the next,
                        a parameter used twice, a view) is not measured again
    every1-cache-fused  both
    every1-cnz          every=1 with `cnz_full_stats` / `cnz_light_stats`: counts via torch.count_nonzero (no
                        float64 copy of each mask), fewer 0-d conversions
    every1-cache-cnz    both cache and cnz
    default-fast        default + module hooks only on the root + `_model_grads` skipped when its result is
                        unused (unsampled step under a GradScaler): the cheap-path changes proposed for ampdoctor
    every1-cache-vnorm  every1-cache with light_stats reduced to one `vector_norm(x, inf)` kernel (absmax, and
                        non-finite when any NaN/inf) + a zeros count: the two-tier idea (counts dropped here,
                        so this one measures speed only)
"""
from __future__ import annotations

import math
import os
import sys
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as bench  # noqa: E402

import ampdoctor  # noqa: E402
import ampdoctor.record.step as _ss  # noqa: E402
import ampdoctor.record.stats as _stats  # noqa: E402

_F64 = torch.float64
_INF = math.inf


def fused_full_stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    """Same vector as ampdoctor.record.stats.full_stats, with the seven counts taken by one reduction."""
    x = x.detach()
    n = x.numel()
    if n == 0:
        return _stats.full_stats(x, ref)
    near, tiny, ovf = _stats._THR.get(ref, _stats._THR[torch.float32])
    a = x.abs()
    inf_a = a == _INF
    zero = a == 0
    widen = x.dtype.itemsize > ref.itemsize or (x.dtype == torch.float32 and ref == torch.float16)
    rows = [torch.isnan(a), x == _INF, inf_a, zero, a >= near, a < tiny]
    if widen:
        rows.append(a >= ovf)
    c = torch.stack(rows).view(len(rows), -1).sum(1, dtype=_F64)
    af = a.masked_fill(inf_a, 0).nan_to_num_(nan=0.0)
    absmax = af.amax().to(_F64)
    min_nz = af.masked_fill_(zero | (af == 0), _INF).amin().to(_F64)
    nan, pinf, ainf, zeros, ge_near, lt_tiny = c[0], c[1], c[2], c[3], c[4], c[5]
    ovf_n = (c[6] - ainf) if widen else torch.zeros((), dtype=_F64, device=x.device)
    return torch.stack([torch.full((), n, dtype=_F64, device=x.device), nan, pinf, ainf - pinf, zeros, absmax,
                        min_nz, ge_near - ainf, lt_tiny - zeros, ovf_n])


def fused_light_stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    x = x.detach()
    if x.numel() == 0:
        return _stats.light_stats(x, ref)
    a = x.abs()
    inf_a = a == _INF
    c = torch.stack([x == 0, torch.isnan(a), x == _INF, inf_a]).view(4, -1).sum(1, dtype=_F64)
    absmax = a.masked_fill(inf_a, 0).nan_to_num_(nan=0.0).amax().to(_F64)
    m1 = torch.full((), -1.0, dtype=_F64, device=x.device)
    return torch.stack([torch.full((), x.numel(), dtype=_F64, device=x.device), c[1], c[2], c[3] - c[2], c[0],
                        absmax, m1, m1, m1, m1])


def vnorm_light_stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    x = x.detach()
    if x.numel() == 0:
        return _stats.light_stats(x, ref)
    m1 = torch.full((), -1.0, dtype=_F64, device=x.device)
    return torch.stack([torch.full((), x.numel(), dtype=_F64, device=x.device), m1, m1, m1,
                        (x == 0).sum(dtype=_F64), torch.linalg.vector_norm(x, math.inf).to(_F64), m1, m1, m1, m1])


import ampdoctor.record.transfer as _sync  # noqa: E402
_orig_model_grads = _sync.model_grads


def _lazy_model_grads(m):
    st = m.st
    if not (st.sampled or m.w.scaler is None or not st.in_scaler_step > 0):
        return [], []
    return _orig_model_grads(m)


def cnz_full_stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    """Same vector as ampdoctor.record.stats.full_stats; counts with torch.count_nonzero (int64) instead of
    `mask.sum(dtype=float64)`, which materialises a float64 copy of every mask (8 bytes per element)."""
    x = x.detach()
    n = x.numel()
    if n == 0:
        return _stats.full_stats(x, ref)
    near, tiny, ovf = _stats._THR.get(ref, _stats._THR[torch.float32])
    cnt = torch.count_nonzero
    a = x.abs()
    af = torch.nan_to_num(a, nan=0.0, posinf=0.0)
    z = af == 0
    widen = x.dtype.itemsize > ref.itemsize or (x.dtype == torch.float32 and ref == torch.float16)
    ovf_n = cnt(af >= ovf) if widen else torch.zeros((), dtype=torch.int64, device=x.device)
    i = torch.stack([cnt(torch.isnan(a)), cnt(x == _INF), cnt(x == -_INF), cnt(z), cnt(af >= near),
                     cnt(af < tiny), ovf_n]).to(_F64)
    f = torch.stack([af.amax(), af.masked_fill(z, _INF).amin()]).to(_F64)
    nonfin = i[0] + i[1] + i[2]
    return torch.stack([torch.full((), n, dtype=_F64, device=x.device), i[0], i[1], i[2], i[3] - nonfin, f[0],
                        f[1], i[4], i[5] - i[3], i[6]])


def cnz_light_stats(x: torch.Tensor, ref: torch.dtype) -> torch.Tensor:
    x = x.detach()
    if x.numel() == 0:
        return _stats.light_stats(x, ref)
    cnt = torch.count_nonzero
    i = torch.stack([cnt(torch.isnan(x)), cnt(x == _INF), cnt(x == -_INF), cnt(x == 0)]).to(_F64)
    absmax = torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).amax().to(_F64)
    m1 = torch.full((), -1.0, dtype=_F64, device=x.device)
    return torch.stack([torch.full((), x.numel(), dtype=_F64, device=x.device), i[0], i[1], i[2], i[3], absmax,
                        m1, m1, m1, m1])


def micro(device):
    """Per-call time and extra peak memory of the statistics functions on one large activation."""
    import time
    dev = torch.device(device)
    for shape, dt in (((8, 1024, 3072), torch.float16), ((8, 1024, 768), torch.float32), ((64, 64), torch.float16)):
        x = torch.randn(*shape, device=dev).to(dt)
        for name, f in (("full_stats", _stats.full_stats), ("cnz_full_stats", cnz_full_stats),
                        ("light_stats", _stats.light_stats), ("cnz_light_stats", cnz_light_stats),
                        ("vector_norm_inf", lambda x, r: torch.linalg.vector_norm(x, math.inf))):
            for _ in range(3):
                f(x, torch.float16)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            for _ in range(20):
                f(x, torch.float16)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            us = (time.perf_counter() - t) / 20 * 1e6
            mem = (torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda" else float("nan")
            print(f"{device} {str(tuple(shape)):18} {str(dt):14} {name:16} {us:10.1f} us/call  peak +{mem:8.1f} MiB")


def _cached_row(self, c, slot, t, light):
    """StepMachine._row with a per-step cache (see the module docstring)."""
    ac = _ss._autocast_dtype(t.device.type)
    ref = _ss.ref_dtype(t.dtype, ac)
    st = self.st
    cache = st.__dict__.setdefault("_rowcache", {})
    key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t._version, ref)
    hit = cache.get(key)
    # the weak reference proves the measured tensor (and so its storage) is still alive: no address reuse
    if hit is not None and hit[0]() is not None and (hit[2] or light):
        idx = hit[1]
    else:
        v = _ss.light_stats(t, ref) if light else _ss.full_stats(t, ref)
        idx = len(st.vecs)
        st.vecs.append(v)
        try:
            cache[key] = (weakref.ref(t), idx, not light)
        except TypeError:
            pass
    c.rows[slot].append((idx, _ss._dt(t.dtype), _ss._dt(ref)))


class ExpVariant(bench.Variant):
    def install(self):
        base = self.name.split("-")[0]
        if base in ("plain", "anomaly", "hf"):
            return super().install()
        if self.name == "noop-hooks":
            self._h = []
            for m in self.model.modules():
                self._h.append(m.register_forward_pre_hook(lambda *a, **k: None, with_kwargs=True))
                self._h.append(m.register_forward_hook(lambda *a, **k: None, with_kwargs=True, always_call=True))
            return
        every = 1 if base == "every1" else None
        self.watch = ampdoctor.watch(self.model, optimizer=self.opt, scaler=self.scaler,
                                     **({"every": every} if every else {}))
        if self.name in ("default-roothooks", "default-fast"):
            keep = []
            for h in self.watch._handles:
                # RemovableHandle.hooks_dict_ref is the hooks dict of the module it belongs to
                d = h.hooks_dict_ref() if hasattr(h, "hooks_dict_ref") else None
                if d is not None and (d is self.model._forward_hooks or d is self.model._forward_pre_hooks
                                      or d not in [m._forward_hooks for m in self.model.modules()]
                                      + [m._forward_pre_hooks for m in self.model.modules()]):
                    keep.append(h)
                else:
                    h.remove()
            self.watch._handles[:] = keep

    def remove(self):
        for h in getattr(self, "_h", []):
            h.remove()
        super().remove()

    def step(self, batch, loss_of):
        fused = "fused" in self.name
        cache = "cache" in self.name
        saved = (_ss.full_stats, _ss.light_stats, _ss.StepMachine._row, _sync.model_grads)
        if fused:
            _ss.full_stats, _ss.light_stats = fused_full_stats, fused_light_stats
        if "cnz" in self.name:
            _ss.full_stats, _ss.light_stats = cnz_full_stats, cnz_light_stats
        if "vnorm" in self.name:
            _ss.light_stats = vnorm_light_stats
        if cache:
            _ss.StepMachine._row = _cached_row
        if self.name == "default-fast":
            _sync.model_grads = _lazy_model_grads
        try:
            return super().step(batch, loss_of)
        finally:
            _ss.full_stats, _ss.light_stats, _ss.StepMachine._row, _sync.model_grads = saved


def check(device="cpu"):
    """The fused statistics equal ampdoctor's on tensors with NaN, ±inf, zeros, subnormals and large values."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    n_ok = 0
    # the (tensor dtype, reference dtype) pairs that ampdoctor.record.stats.ref_dtype produces
    pairs = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
             (torch.float32, torch.bfloat16), (torch.float32, torch.float32)]
    for dt, ref in pairs:
        if True:
            for k in range(6):
                x = (torch.randn(257, 33, generator=g) * 10 ** (k * 2 - 4)).to(dt)
                x[0, :3] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dt)
                x[1, :4] = torch.tensor([0.0, 1e-7, 6e4, -7e4]).to(dt)
                x = x.to(dev)
                for full in (True, False):
                    a = (_stats.full_stats if full else _stats.light_stats)(x, ref).cpu()
                    for cand in ((fused_full_stats, cnz_full_stats) if full else (fused_light_stats, cnz_light_stats)):
                        b = cand(x, ref).cpu()
                        assert torch.equal(a, b), (cand.__name__, dt, ref, k, a.tolist(), b.tolist())
                        n_ok += 1
    print(f"fused and count_nonzero stats identical to ampdoctor's on {n_ok} cases")


if __name__ == "__main__":
    if "--micro" in sys.argv:
        micro("cuda" if "--cuda" in sys.argv else "cpu")
        sys.exit(0)
    if "--check" in sys.argv:
        check("cuda" if "--cuda" in sys.argv else "cpu")
        sys.exit(0)
    bench.Variant = ExpVariant
    bench.ALL_VARIANTS = bench.ALL_VARIANTS + ("noop-hooks", "default-roothooks", "every1-fused", "every1-cache",
                                               "every1-cache-fused", "default-fast", "every1-cache-vnorm", "every1-cnz",
                                               "every1-cache-cnz")
    bench.main()
