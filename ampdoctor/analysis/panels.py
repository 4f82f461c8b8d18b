"""The data panels the reporters draw (Report.data), built from a run's records: the per-step timeline, the
per-layer table, the forward headroom heatmap, the grad-norm grid, the scaler/optimizer call sequence, the
environment, and the headroom timeline of the layers that matter."""
from __future__ import annotations

import math

from ..findings import Finding
from ..records import DTYPE_LIMITS, RunMeta, StepRecord
from ..rules import RunData
from ..rules.backoff import benign_backoff
from ..rules.steps import absorbed_modules, real_bad

__all__ = ["build_panels"]


def _headroom(s) -> float | None:
    if s is None:
        return None
    if not s.finite:   # inf or NaN in the output: no headroom at all (the reporters draw these cells black)
        return -math.inf
    if not s.absmax:
        return None
    mx = DTYPE_LIMITS.get(s.ref if s.ref in ("float16", "bfloat16") else "float16")[0]
    return math.log2(mx / s.absmax)


def build_panels(meta: RunMeta, steps: list[StepRecord], findings: list[Finding] = ()) -> dict:
    run = RunData(meta, steps)
    benign = benign_backoff(steps, run.has_scaler, growth_factor=run.growth_factor)
    mods = absorbed_modules(steps)
    bad = {r.step for r in steps if real_bad(r, benign, mods)}
    timeline = [{"step": r.step, "loss": r.loss, "scale": r.scale, "skipped": r.skipped, "grad_norm": r.grad_norm,
                 "sampled": r.sampled, "bad": r.step in bad} for r in steps]
    layers: dict[str, dict] = {}
    order = [m[0] for m in meta.modules]
    head: dict[str, dict[int, float]] = {}
    for r in steps:
        for c in r.modules:
            L = layers.setdefault(c.module, {"module": c.module, "type": c.type, "depth": c.depth, "calls": 0,
                                             "absmax_out": 0.0, "headroom_bits": None, "subnormal_share": 0.0,
                                             "absmax_grad": 0.0, "grad_norm": None, "nonfinite_out": 0})
            L["calls"] += 1
            if c.out is not None:
                L["absmax_out"] = max(L["absmax_out"], c.out.absmax)
                L["nonfinite_out"] += c.out.nonfinite
                h = _headroom(c.out)
                if h is not None:
                    L["headroom_bits"] = h if L["headroom_bits"] is None else min(L["headroom_bits"], h)
                    d = head.setdefault(c.module, {})
                    d[r.step] = min(d.get(r.step, h), h)
                nz = c.out.nonzero_finite
                if nz:
                    L["subnormal_share"] = max(L["subnormal_share"], c.out.subnormal / nz)
            if c.gout is not None:
                g = c.gout.absmax / (r.scale or 1.0)
                L["absmax_grad"] = max(L["absmax_grad"], g)
        for p in r.params:
            if p.grad_norm is not None and p.module in layers:
                L = layers[p.module]
                L["grad_norm"] = max(L["grad_norm"] or 0.0, p.grad_norm)
    mods = [m for m in order if m in head] + [m for m in head if m not in order]
    hsteps = sorted({s for d in head.values() for s in d})
    gnames = sorted({p.name for r in steps for p in r.params if p.grad_norm is not None})
    gsteps = sorted({r.step for r in steps if any(p.grad_norm is not None for p in r.params)})
    gval = {(r.step, p.name): p.grad_norm for r in steps for p in r.params}
    calls = []
    for r in steps:
        for e in r.events:
            calls.append({"step": e.step, "index": e.index, "kind": e.kind, "file": e.file, "line": e.line,
                          "stage": e.stage, "error": e.error, "internal": e.internal,
                          "misordered": bool(e.error or e.scaled)})
    return {"timeline": timeline,
            "layers": sorted(layers.values(), key=lambda L: order.index(L["module"]) if L["module"] in order else 1e9),
            "heatmap": {"modules": mods, "steps": hsteps, "ref": "float16",
                        "headroom": [[head[m].get(s) for s in hsteps] for m in mods]},
            "grad_norms": {"names": gnames, "steps": gsteps,
                           "values": [[gval.get((s, n)) for s in gsteps] for n in gnames]},
            "calls": calls[-2000:], "env": meta.env,
            "headroom_timeline": _headroom_timeline(meta, steps, findings, head, min(bad) if bad else None)}


_HT_MAX = {"h": DTYPE_LIMITS["float16"][0], "b": DTYPE_LIMITS["bfloat16"][0]}


def _headroom_timeline(meta: RunMeta, steps: list[StepRecord], findings, head: dict, first_bad) -> dict:
    """Forward headroom bits per step (StepRecord.headroom; the sampled steps' statistics where a step has none)
    of the layers that matter: those named by headroom_trend findings, then the 5 with the least headroom at any
    step; 8 at most. None: not measured (or not fp16/bf16); -inf: non-finite. `forecast`: per warned layer, the
    step its headroom is forecast to reach zero."""
    names = [m[0] for m in meta.modules]
    series: dict[str, dict[int, float | None]] = {}
    for r in steps:
        h = r.headroom or {}
        fwd, dts = h.get("fwd") or [], h.get("dtype") or ""
        for i, v in enumerate(fwd[:len(names)]):
            if v is None:
                continue
            if not math.isfinite(v):
                b = -math.inf
            elif dts[i:i + 1] in _HT_MAX and v > 0:
                b = math.log2(_HT_MAX[dts[i]] / v)
            else:
                continue
            d = series.setdefault(names[i], {})
            d[r.step] = min(d.get(r.step, b), b)
    for m, d in head.items():              # sampled steps recorded without a headroom vector
        for s, b in d.items():
            series.setdefault(m, {}).setdefault(s, b)
    forecast = {}
    for f in findings:
        if f.rule == "headroom_trend" and f.phase == "forward" and f.module in series:
            forecast.setdefault(f.module, f.evidence.get("forecast_step"))
    rest = sorted((m for m in series if m not in forecast), key=lambda m: (min(series[m].values()), m))
    mods = (list(forecast) + rest[:5])[:8]
    hsteps = sorted({s for m in mods for s in series[m]})
    return {"modules": mods, "steps": hsteps, "headroom": [[series[m].get(s) for s in hsteps] for m in mods],
            "forecast": forecast, "first_bad_step": first_bad}
