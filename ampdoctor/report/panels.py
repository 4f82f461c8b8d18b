"""Panel data shared by the reporters: number coercion, worst-value downsampling, the root finding, the
heatmap's culprit cell, and why a plot has nothing to show (`empty_reasons`: one sentence, with what to pass).

Reporters read `report.to_dict()`, where non-finite floats are strings ("inf", "nan") and any panel may be
missing. Everything here turns that into plain floats (or None) and shrinks large runs without hiding the
worst value: a bin keeps the minimum headroom / the maximum norm of the cells it covers, and a non-finite
cell (an overflow) counts as the worst of all.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

__all__ = ["num", "fmt_num", "bins", "worst_headroom", "downsample_heatmap", "downsample_series",
           "root_finding", "counts", "culprit_cell", "empty_reasons", "FP16_MAX", "FP16_MIN_NORMAL", "BF16_MAX"]

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14
BF16_MAX = 3.3895313892515355e38


def num(v: Any) -> float | None:
    """A float from a number or a JSON string ("inf", "-inf", "nan", "1.5"); None when absent or unreadable."""
    if v is None or isinstance(v, bool):
        return None if v is None else float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return None
    return None


def fmt_num(v: Any, digits: int = 4) -> str:
    """Compact human formatting: 812.5, 6.1e-05, inf, nan, — for missing."""
    x = num(v)
    if x is None:
        return "—" if v is None else str(v)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if float(x).is_integer() and abs(x) < 1e7:
        return str(int(x))
    return f"{x:.{digits}g}"


def bins(n: int, max_bins: int) -> list[tuple[int, int]]:
    """Split range(n) into at most `max_bins` contiguous [start, stop) ranges of near-equal size."""
    if n <= 0:
        return []
    k = min(n, max(1, max_bins))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def worst_headroom(values: Iterable[Any]) -> float | None:
    """Minimum headroom of `values`; NaN counts as an overflow (-inf); None if nothing was sampled."""
    best: float | None = None
    for v in values:
        x = num(v)
        if x is None:
            continue
        if math.isnan(x):
            x = -math.inf
        if best is None or x < best:
            best = x
    return best


def downsample_heatmap(hm: dict, max_modules: int = 80, max_steps: int = 400) -> dict:
    """Shrink a layer x step headroom grid, each cell keeping the minimum (worst) of what it covers.

    Returns {"modules": [labels], "steps": [first step of each bin], "step_bins": [[first, last]...],
    "headroom": [[float|None]...], "worst": {"module", "step", "value"} | None, "ref"}. Module bins group
    consecutive modules (model order) and are labelled by the worst module inside them. NaN counts as -inf.
    """
    import numpy as np

    modules = list(hm.get("modules") or [])
    steps = list(hm.get("steps") or [])
    rows = [list(r or []) for r in (hm.get("headroom") or [])][:len(modules)]
    out = {"modules": [], "steps": [], "step_bins": [], "headroom": [], "worst": None,
           "ref": hm.get("ref", "float16"), "n_modules": len(modules), "n_steps": len(steps)}
    if not modules or not steps or not rows:
        return out
    modules = modules[:len(rows)]
    # +inf marks "not sampled" so that it never wins a minimum; NaN (non-finite) becomes -inf so it always does.
    g = np.full((len(rows), len(steps)), np.inf)
    for i, r in enumerate(rows):
        for j, v in enumerate(r[:len(steps)]):
            x = num(v)
            if x is not None:
                g[i, j] = -np.inf if math.isnan(x) else x
    if np.isposinf(g).all():
        return out
    wi, wj = np.unravel_index(int(np.argmin(g)), g.shape)
    out["worst"] = {"module": modules[wi], "step": steps[wj], "value": float(g[wi, wj])}
    sbins = bins(len(steps), max_steps)
    mbins = bins(len(modules), max_modules)
    s = np.minimum.reduceat(g, [a for a, _ in sbins], axis=1)
    small = np.minimum.reduceat(s, [a for a, _ in mbins], axis=0)
    row_worst = g.min(axis=1)
    out["worst"]["cell"] = [next(k for k, (a, b) in enumerate(mbins) if a <= wi < b),
                            next(k for k, (a, b) in enumerate(sbins) if a <= wj < b)]
    out["steps"] = [steps[a] for a, _ in sbins]
    out["step_bins"] = [[steps[a], steps[b - 1]] for a, b in sbins]
    for k, (a, b) in enumerate(mbins):
        li = a + int(np.argmin(row_worst[a:b]))
        label = modules[li] or "(root)"
        out["modules"].append(label if b - a == 1 else f"{label} (+{b - a - 1})")
        out["headroom"].append([None if math.isinf(x) and x > 0 else float(x) for x in small[k]])
    return out


def downsample_series(steps: Sequence[Any], values: Sequence[Any], max_points: int = 400,
                      keep: str = "max") -> tuple[list[int], list[float | None]]:
    """Downsample one series to `max_points` bins keeping the max (or min) finite value; inf/NaN win."""
    xs = list(steps)
    ys = [num(v) for v in values][:len(xs)]
    if len(xs) <= max_points:
        return xs, ys
    ox, oy = [], []
    for a, b in bins(len(xs), max_points):
        chunk = [y for y in ys[a:b] if y is not None]
        bad = [y for y in chunk if not math.isfinite(y)]
        if bad:
            y = bad[0]
        elif chunk:
            y = max(chunk) if keep == "max" else min(chunk)
        else:
            y = None
        ox.append(xs[a])
        oy.append(y)
    return ox, oy


def root_finding(d: dict) -> dict | None:
    """The first error or warning finding (findings are ranked, root cause first); None when healthy."""
    for f in d.get("findings") or []:
        if f.get("severity") in ("error", "warning"):
            return f
    return None


def counts(d: dict) -> dict:
    """Errors/warnings/infos from the findings themselves (the summary's counts may be absent)."""
    c = {"error": 0, "warning": 0, "info": 0}
    for f in d.get("findings") or []:
        if f.get("severity") in c:
            c[f["severity"]] += 1
    return c


def culprit_cell(ds: dict, d: dict) -> dict | None:
    """The heatmap cell to point at, on a downsampled grid `ds`: {"cell": [row, col], "module", "step", "value",
    "why"}. The root finding's module at its step when the grid has it (the producer, not the parents and
    followers that merely carry its inf/NaN); else the earliest non-finite cell (skipping the root module when
    any other is non-finite); else the lowest headroom."""
    import numpy as np

    if not ds.get("headroom"):
        return None
    g = np.array([[np.inf if v is None else v for v in row] for row in ds["headroom"]], dtype=float)
    bins_ = ds["step_bins"]

    root = root_finding(d)
    if root and root.get("module") is not None:
        label = root["module"] or "(root)"
        rows = [i for i, m in enumerate(ds["modules"]) if m == label or m.startswith(label + " (+")]
        if rows:
            i = rows[0]
            step = root.get("step")
            # the bin holding the finding's step, else the first sampled one after it, else the row's worst
            j = next((k for k, (_, b) in enumerate(bins_) if step is not None and step <= b), None)
            j = int(np.argmin(g[i])) if j is None else j
            return {"cell": [i, j], "module": label, "step": ds["steps"][j], "value": float(g[i, j]),
                    "why": root["rule"]}
    bad = np.isneginf(g)
    if bad.any():
        j = int(np.argmax(bad.any(axis=0)))
        rows = [i for i in range(len(g)) if bad[i, j]]
        named = [i for i in rows if ds["modules"][i] != "(root)"] or rows
        i = named[0]
        return {"cell": [i, j], "module": ds["modules"][i], "step": ds["steps"][j], "value": -math.inf,
                "why": "first non-finite"}
    if np.isposinf(g).all():
        return None
    i, j = np.unravel_index(int(np.argmin(g)), g.shape)
    return {"cell": [int(i), int(j)], "module": ds["modules"][i], "step": ds["steps"][j], "value": float(g[i, j]),
            "why": "lowest headroom"}


def _every_hint(d: dict) -> str:
    every = (d.get("summary") or {}).get("every")
    now = f" (this run sampled every {every} steps)" if isinstance(every, int) and every > 1 else ""
    return f"pass `every=1` (or a smaller `every=N`) to `ampdoctor.watch` to record every step{now}"


def empty_reasons(d: dict) -> dict[str, str]:
    """{plot key: one sentence} for the step plots a run report has but that would show nothing: why, and what
    to pass to get the picture. Keys are plots.PLOT_FILES' ("heatmap", "timeline", "grad_norms")."""
    tl = d.get("timeline") or []
    if not tl:          # not a run (a replay, an empty report): no step plots, nothing to explain
        return {}
    out: dict[str, str] = {}
    n = len(tl)
    hm = d.get("heatmap") or {}
    hsteps = list(hm.get("steps") or [])
    has_rows = any(any(num(v) is not None for v in r or []) for r in hm.get("headroom") or [])
    if not hsteps or not has_rows:
        out["heatmap"] = ("No per-layer statistics were recorded in this run, so there is no headroom to draw; "
                          + _every_hint(d) + ".")
    elif len(hsteps) < 2:
        out["heatmap"] = (f"Per-layer statistics exist for step {hsteps[0]} only, of {n} steps: one column is not "
                          f"a picture over steps (the Layers table has its numbers); " + _every_hint(d) + ".")
    scales = [num(r.get("scale")) for r in tl]
    losses = [num(r.get("loss")) for r in tl]
    has_scale = any(x is not None and x > 0 and math.isfinite(x) for x in scales)
    finite_loss = [x for x in losses if x is not None and math.isfinite(x)]
    if not has_scale and not finite_loss and not any(r.get("skipped") for r in tl):
        out["timeline"] = (f"The loss was inf/NaN on all {n} steps and the run had no GradScaler: there is no "
                           f"curve to draw. See the first finding for where the inf/NaN came from."
                           if any(x is not None for x in losses) else
                           f"No loss and no loss scale were seen in {n} steps: pass `scaler=` (your GradScaler) to "
                           f"`ampdoctor.watch`, or return the loss from the model output's `.loss`.")
    gn = d.get("grad_norms") or {}
    gsteps = list(gn.get("steps") or [])
    vals = [num(v) for row in gn.get("values") or [] for v in row or []]
    fin = [v for v in vals if v is not None and math.isfinite(v) and v > 0]
    if not gn.get("names") or not gsteps:
        out["grad_norms"] = ("No gradient norms were recorded: they are measured right after `scaler.unscale_` "
                             "(or before `optimizer.step`) on sampled steps; pass `optimizer=` and `scaler=` to "
                             "`ampdoctor.watch`.")
    elif not fin:
        out["grad_norms"] = (f"Every gradient norm measured after `unscale_` was inf/NaN ({len(gsteps)} sampled "
                             f"steps, {gsteps[0]} to {gsteps[-1]}): nothing finite to draw. The gradients never "
                             f"became finite; fix the first finding.")
    elif len(gsteps) < 2:
        out["grad_norms"] = (f"Gradient norms were measured on step {gsteps[0]} only, of {n} steps: one point per "
                             f"layer is not a picture over steps; " + _every_hint(d) + ".")
    return out
