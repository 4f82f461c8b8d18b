"""The replayed step run again to search: at lower loss scales (how many GradScaler backoffs make its backward
finite: `_scaler_search`) and with modules kept in fp32 (the fewest that make it finite: `_fix`, over
fixsearch.search), and the order in which non-finite op events are blamed (`_low_precision_first`). Each re-run
restores the model's state as replay's pipeline (replay/__init__.py) does around all of them."""
from __future__ import annotations

import math

import torch

from . import fixsearch, modelio, shadow as shadow_mod
from .optrace import OpTracer


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def code_device(cap, devtype: str) -> str:
    """The device type a fix's code names: the training run's autocast device (the capture's), not the one the
    replay ran on (a CUDA capture replayed on a CPU-only machine is fixed with `device_type="cuda"`)."""
    return ((cap.autocast or {}).get("device") if cap is not None else None) or devtype


def _backward_events(m, args, kwargs, devtype, dtype, cap, loss_fn) -> list:
    """The op trace's events of the same step at loss scale 1, low-precision first ([] when it raised)."""
    tracer = OpTracer(m)
    try:
        with tracer:
            modelio.run_step(m, args, kwargs, device=devtype, dtype=dtype, rng=cap.rng, loss_fn=loss_fn, scale=1.0,
                             on_backward=tracer.backward_begins)
    except Exception:
        return []
    return _low_precision_first(tracer.events)


def _grads_finite(m, args, kwargs, devtype, dtype, cap, loss_fn, scale) -> bool | None:
    """One plain step at `scale`: are all parameter gradients finite? None when the step raised."""
    try:
        _, _, grads = modelio.run_step(m, args, kwargs, device=devtype, dtype=dtype, rng=cap.rng, loss_fn=loss_fn,
                                       scale=scale)
    except Exception:
        return None
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def _scaler_search(m, args, kwargs, devtype, dtype, cap, loss_fn, scale) -> dict:
    """The forward was finite and only the backward overflowed at the capture's loss scale: find the smallest
    number of GradScaler backoffs k (scale · backoff^k, not below 1) after which the same step is finite. A hit
    means the scaler's normal search (it skips k steps and goes on); none, down to scale 1, keeps the error."""
    backoff = (cap.scaler_state or {}).get("backoff_factor", 0.5)
    backoff = float(backoff) if isinstance(backoff, (int, float)) and 0 < backoff < 1 else 0.5
    kmax = max(1, min(24, math.ceil(math.log(scale) / -math.log(backoff)) if scale > 1 else 1))
    tried: dict[int, bool | None] = {}

    def ok(k: int) -> bool:
        if k not in tried:
            tried[k] = _grads_finite(m, args, kwargs, devtype, dtype, cap, loss_fn, max(scale * backoff ** k, 1.0))
        return bool(tried[k])
    lo, hi = 0, None                       # not finite at k = lo; finite at k = hi
    for k in (1, 2, 4, 8, 16, kmax):       # a few geometric probes, then bisect between the last two
        k = min(k, kmax)
        if ok(k):
            hi = k
            break
        lo = k
        if k == kmax:
            break
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return {"capture_scale": scale, "backoff_factor": backoff,
            "finite_at": None if hi is None else max(scale * backoff ** hi, 1.0), "backoffs": hi,
            "tried": [{"scale": max(scale * backoff ** k, 1.0), "finite": v} for k, v in sorted(tried.items())]}


def _fix(m, args, kwargs, devtype, dtype, cap, loss_fn, scale, first, ref) -> dict:
    def try_set(mods):
        with fixsearch.fp32_modules(m, mods, devtype):
            try:
                rec, finite, loss = shadow_mod.run_dtype(m, args, kwargs, device=devtype, dtype=dtype, rng=cap.rng,
                                                         loss_fn=loss_fn, scale=scale)
                over = rec.overflow_modules()
                if not finite and not over and scale and scale > 1 and (
                        loss is None or bool(torch.isfinite(loss).all())):
                    # the forward is finite with these modules in fp32 and only the backward overflowed at the
                    # capture's loss scale: GradScaler's backoff handles that (a few skipped steps, as designed)
                    lower = next((s for s in (max(scale * 0.5 ** k, 1.0) for k in (4, 8, 16))
                                  if _grads_finite(m, args, kwargs, devtype, dtype, cap, loss_fn, s)), None)
                    finite = lower is not None
                    backed_off[tuple(mods)] = lower
                    if not finite:
                        # no loss scale makes the backward finite: its producer at scale 1 is the next to try
                        # (else the search would step out to the root without trying it)
                        over = [e.module for e in _backward_events(m, args, kwargs, devtype, dtype, cap, loss_fn)
                                if e.phase == "backward" and e.module is not None][:1]
            except Exception as e:   # a crash of this configuration, reported as such (not "not finite")
                return False, None, f"{type(e).__name__}: {_first_line(e)}"
        return finite, (over[0] if over else None), None

    backed_off: dict = {}   # modules -> the lower loss scale at which their trial's backward was finite
    res = fixsearch.search(first, try_set)
    # None: finite at the capture's own loss scale; else the scale GradScaler's backoff reaches it at
    res["finite_at_scale"] = backed_off.get(tuple(res["modules"])) if res["found"] else None
    if res["found"]:
        root_err = None
        if ref is not None and ("", 0) in ref.outs:   # like with like: dropout off, as the fp32 reference ran
            try:
                with fixsearch.fp32_modules(m, res["modules"], devtype):
                    rec, _, _ = shadow_mod.run_dtype(m, args, kwargs, device=devtype, dtype=dtype, rng=cap.rng,
                                                     loss_fn=loss_fn, scale=scale, dropout=False)
                if ("", 0) in rec.outs:
                    root_err = shadow_mod.rel_err(rec.outs[("", 0)], ref.outs[("", 0)])
            except Exception:
                root_err = None
        res["output_rel_err_vs_fp32"] = None if root_err is None or not math.isfinite(root_err) else root_err
        res["snippet"] = fixsearch.snippet(res["modules"], code_device(cap, devtype))
    else:
        res["snippet"] = ""
    return res


_LP = ("float16", "bfloat16")


def _lowp(e) -> bool:
    return e.out_dtype in _LP or any(d in _LP for d in (e.in_dtypes or []))


def _low_precision_first(events: list) -> list:
    """Order non-finite op events for blame: forward before backward and, within a phase, ops whose module still
    returned finite values (absorbed: NewGELU's x**3 inside a saturating tanh) after those whose values got out,
    then ops that compute in a low-precision dtype before full-precision ones (an fp32 `log(0)` that the model then
    masks away, as T5's relative-position buckets do, is not a mixed-precision failure). (An absorbed forward op
    stays before the backward: T5LayerNorm's x**2 overflowing into exact zeros is the failure, not its backward.)"""
    return sorted(events, key=lambda e: (e.phase != "forward", e.absorbed, not _lowp(e), e.seq))
