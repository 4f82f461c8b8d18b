"""Static plots of a Report (matplotlib Agg, no pyplot): headroom heatmap, loss-scale timeline, per-layer gradient norms.

`render_plots(report)` returns {file name: PNG bytes} (the HTML reporter inlines them); `write_plots(report,
out_dir)` writes the same files so each can be used on its own. A plot whose panel is missing or empty is
left out. Large runs are downsampled by keeping the worst value per bin (panels.py), never by dropping it.
"""
from __future__ import annotations

import io
import math
import os

from . import panels
from .panels import num

__all__ = ["render_plots", "write_plots", "PLOT_FILES"]

PLOT_FILES = {"heatmap": "headroom_heatmap.png", "timeline": "loss_scale.png", "grad_norms": "grad_norms.png"}
RED, ORANGE, BLUE, GREY, INK = "#c5221f", "#e37400", "#1a73e8", "#9aa0a6", "#202124"
BF16_BITS = math.log2(panels.FP16_MAX / panels.BF16_MAX)          # -112: bf16's max on the fp16 headroom axis
UNDERFLOW_BITS = math.log2(panels.FP16_MAX / panels.FP16_MIN_NORMAL)  # 30: below this absmax is all subnormal


def _style() -> dict:
    return ({"font.size": 9, "axes.titlesize": 11, "axes.titleweight": "bold", "axes.spines.top": False,
                         "axes.spines.right": False, "axes.edgecolor": "#bdc1c6", "axes.labelcolor": INK,
                         "xtick.color": "#5f6368", "ytick.color": "#5f6368", "font.family": "DejaVu Sans",
                         "axes.titlelocation": "left", "figure.dpi": 100, "savefig.dpi": 100})


def _subplots(figsize):
    """A Figure outside pyplot: no global state, no GUI backend, nothing to close."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", facecolor="white", metadata={"Software": None})
    return buf.getvalue()


def _heatmap(hm: dict) -> bytes | None:
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, Normalize

    ds = panels.downsample_heatmap(hm, max_modules=60, max_steps=300)
    if not ds["headroom"]:
        return None
    grid = np.array([[np.nan if v is None else v for v in row] for row in ds["headroom"]], dtype=float)
    finite = grid[np.isfinite(grid)]
    lo = max(min(-4.0, math.floor(finite.min()) - 1 if finite.size else -4.0), -116.0)
    hi = max(34.0, math.ceil(finite.max()) + 1 if finite.size else 34.0)
    stops = [(-4, "#7f0000"), (0, RED), (0.5, "#f28b30"), (4, "#fdd663"), (10, "#ceead6"), (20, "#81c995"),
             (30, "#4a90c2"), (34, "#7b5ea7")]
    stops = [(lo, "#4a0000")] * (lo < -4) + stops + [(hi, "#5b3f86")] * (hi > 34)
    cmap = LinearSegmentedColormap.from_list("headroom", [((v - lo) / (hi - lo), c) for v, c in stops])
    cmap = cmap.with_extremes(bad="#eceff1", under="#1f0000")   # grey: not sampled; black: -inf (overflowed)
    rows, cols = grid.shape
    fig, ax = _subplots((11, min(max(2.6, 0.16 * rows + 1.4), 11)))
    masked = np.ma.masked_invalid(np.where(np.isneginf(grid), lo - 1, grid))
    im = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap, norm=Normalize(lo, hi),
                   extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
    ax.set_yticks(range(rows))
    ax.set_yticklabels([m[-60:] for m in ds["modules"]], fontsize=7 if rows <= 60 else 5.5)
    ticks = np.linspace(0, cols - 1, min(cols, 10)).round().astype(int)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(ds["steps"][t]) for t in ticks])
    ax.set_xlabel("optimizer step" + (f" ({ds['n_steps']} steps, worst per bin)" if cols < ds["n_steps"] else ""))
    ref = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(ds["ref"], str(ds["ref"]))
    title = f"Headroom to the {ref} max, per layer and step (bits; ≤ 0 = overflow)"
    if rows < ds["n_modules"]:
        title += f" — {ds['n_modules']} layers binned"
    ax.set_title(title, color=INK, pad=16)
    w = ds["worst"]
    if w is not None:
        wi, wj = w["cell"]
        v = w["value"]
        if v < 4:   # circle only a cell worth finding; a healthy run's "worst" is just noted
            ax.plot([wj], [wi], marker="o", ms=16, mfc="none", mec=INK, mew=1.6)
            ax.plot([wj], [wi], marker="o", ms=19, mfc="none", mec="white", mew=1.0)
        ax.annotate(f"worst: {w['module'] or '(root)'} at step {w['step']}: "
                    f"{'overflow (inf/nan)' if math.isinf(v) else f'{v:.2f} bits'}{'  (circled)' if v < 4 else ''}", xy=(0, 1.0),
                    xycoords="axes fraction", xytext=(0, 3), textcoords="offset points", va="bottom",
                    fontsize=8, color=RED if v <= 0 else INK, annotation_clip=False)
    cb = fig.colorbar(im, ax=ax, fraction=0.035, pad=0.015, extend="min")
    cb.set_label("bits of headroom (grey: not sampled; black: inf/nan)", fontsize=8)
    marks = {0.0: f"0  {ref} max"}
    if ref == "fp16":   # the other limits are drawn on the fp16 axis only
        marks[UNDERFLOW_BITS] = f"{UNDERFLOW_BITS:.0f}  fp16 min normal"
    if ref == "fp16" and lo <= BF16_BITS:
        marks[BF16_BITS] = f"{BF16_BITS:.0f}  bf16 max"
    ticks = sorted(set(marks) | {t for t in (10.0, 20.0, -50.0, -100.0) if lo <= t <= hi})
    cb.set_ticks(ticks)
    cb.set_ticklabels([marks.get(t, f"{t:.0f}") for t in ticks], fontsize=7)
    for bits in marks:
        cb.ax.axhline(bits, color=INK, lw=1.2)
    out = _png(fig)
    return out


def _timeline(tl: list[dict]) -> bytes | None:
    pts = [(int(r["step"]), num(r.get("scale")), num(r.get("loss")), bool(r.get("skipped"))) for r in tl
           if r.get("step") is not None]
    if not pts:
        return None
    steps = [p[0] for p in pts]
    scales = [p[1] if p[1] and p[1] > 0 and math.isfinite(p[1]) else float("nan") for p in pts]
    has_scale = any(s == s for s in scales)
    if not has_scale and all(p[2] is None for p in pts) and not any(p[3] for p in pts):
        return None                                    # nothing to draw: no scaler, no loss seen
    fig, ax = _subplots((11, 3.4))
    if has_scale:
        ax.step(steps, scales, where="post", color=BLUE, lw=1.8, label="loss scale")
        ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale", color=BLUE)
    skipped = [p[0] for p in pts if p[3]]
    for s in skipped:
        ax.axvspan(s - 0.5, s + 0.5, color=RED, alpha=0.18 if len(skipped) < 200 else 0.1, lw=0)
    if skipped:
        ax.plot([], [], color=RED, alpha=0.35, lw=6, label=f"skipped step ({len(skipped)})")
    ax2 = ax.twinx() if has_scale else ax
    losses = [p[2] for p in pts]
    fin = [(s, v) for s, v in zip(steps, losses) if v is not None and math.isfinite(v)]
    if fin:
        ax2.plot([f[0] for f in fin], [f[1] for f in fin], color=GREY, lw=1.1, label="loss")
    bad = [s for s, v in zip(steps, losses) if v is not None and not math.isfinite(v)]
    if bad:
        ax2.plot(bad, [1.0] * len(bad), "x", color=RED, ms=5, transform=ax2.get_xaxis_transform(),
                 clip_on=False, label="loss inf/nan")
    ax2.set_ylabel("loss", color="#5f6368")
    ax.set_xlabel("optimizer step")
    if has_scale:
        ax2.spines["right"].set_visible(True)
        ax.set_title("Loss scale over steps (skipped steps shaded)", color=INK)
    else:
        ax.set_title("Loss over steps (no GradScaler in this run)", color=INK)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels() if has_scale else ([], [])
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8, frameon=False, ncol=4)
    out = _png(fig)
    return out


def _grad_norms(gn: dict, top: int = 8) -> bytes | None:
    import matplotlib

    names, steps = list(gn.get("names") or []), list(gn.get("steps") or [])
    series = []
    for name, vals in zip(names, gn.get("values") or []):
        xs, ys = panels.downsample_series(steps, vals, keep="max")
        fin = [y for y in ys if y is not None and math.isfinite(y) and y > 0]
        nonfin = any(y is not None and not math.isfinite(y) for y in ys)
        series.append((nonfin, max(fin) if fin else 0.0, name, xs, ys))
    if not any(s[1] > 0 or s[0] for s in series):
        return None
    series.sort(key=lambda s: (not s[0], -s[1]))
    fig, ax = _subplots((11, 3.8))
    colors = matplotlib.colormaps["tab10"].colors
    for rank, (nonfin, _, name, xs, ys) in enumerate(reversed(series)):
        highlighted = len(series) - 1 - rank < top
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y) and y > 0]
        if pts:
            kw = dict(lw=1.4, label=name[-50:] or "(root)", color=colors[(len(series) - 1 - rank) % 10]) \
                if highlighted else dict(lw=0.6, color="#dadce0")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **kw)
        bad = [x for x, y in zip(xs, ys) if y is not None and not math.isfinite(y)]
        if bad:
            ax.plot(bad, [1.0] * len(bad), "x", color=RED, ms=5, transform=ax.get_xaxis_transform(), clip_on=False)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient norm")
    more = f" (top {top} of {len(series)} shown in colour)" if len(series) > top else ""
    ax.set_title(f"Gradient norm per layer{more}; red x = inf/nan", color=INK)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    out = _png(fig)
    return out


def render_plots(report) -> dict[str, bytes]:
    """PNG bytes per file name (see PLOT_FILES) for the panels the report has."""
    import matplotlib

    d = report if isinstance(report, dict) else report.to_dict()
    out: dict[str, bytes] = {}
    with matplotlib.rc_context(_style()):
        for key, fn in (("heatmap", _heatmap), ("timeline", _timeline), ("grad_norms", _grad_norms)):
            panel = d.get(key)
            if panel:
                png = fn(panel)
                if png:
                    out[PLOT_FILES[key]] = png
    return out


def write_plots(report, out_dir: str | os.PathLike) -> list[str]:
    """Write the report's plots as PNG files into `out_dir` (created if needed); return their paths."""
    from ..fsutil import atomic_write_bytes
    return [atomic_write_bytes(os.path.join(os.fspath(out_dir), name), png)
            for name, png in render_plots(report).items()]
