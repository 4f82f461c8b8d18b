"""Static plots of a Report (matplotlib, no pyplot): headroom heatmap, loss-scale timeline, per-layer gradient norms,
per-layer headroom timeline (every step, with the headroom_trend forecast).

`render_plots(report)` returns {file name: PNG bytes}; `write_plots(report, out_dir)` writes the same files so
each can be used on its own; `render(report)` gives the `Plot`s themselves (PNG plus the heatmap's row regions,
which the HTML lays over the image as tooltips). A plot with nothing to show is not drawn: panels.empty_reasons
says why in one sentence instead (`headroom_timeline_empty` for the headroom timeline). Large runs are downsampled by keeping the worst value per bin (panels.py).
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field

from . import panels
from .panels import num

__all__ = ["render_plots", "write_plots", "render", "Plot", "PLOT_FILES"]

PLOT_FILES = {"heatmap": "headroom_heatmap.png", "headroom_timeline": "headroom_timeline.png",
              "timeline": "loss_scale.png", "grad_norms": "grad_norms.png"}
RED, ORANGE, BLUE, GREY, INK, BLACK = "#c5221f", "#e37400", "#1a73e8", "#9aa0a6", "#202124", "#000000"
BF16_BITS = math.log2(panels.FP16_MAX / panels.BF16_MAX)          # -112: bf16's max on the fp16 headroom axis
UNDERFLOW_BITS = math.log2(panels.FP16_MAX / panels.FP16_MIN_NORMAL)  # 30: below this absmax is all subnormal


@dataclass
class Plot:
    """One rendered plot: the PNG, and for the heatmap one region per row (percentages of the image:
    left/top/width/height, with title, module, nonfinite, cols)."""
    png: bytes
    areas: list[dict] = field(default_factory=list)
    caption: str = ""      # what the picture points at, in words (the HTML shows it under the image)


def _style() -> dict:
    return ({"font.size": 9, "axes.titlesize": 11, "axes.titleweight": "bold", "axes.spines.top": False,
             "axes.spines.right": False, "axes.edgecolor": "#bdc1c6", "axes.labelcolor": INK,
             "xtick.color": "#5f6368", "ytick.color": "#5f6368", "font.family": "DejaVu Sans",
             "axes.titlelocation": "left", "figure.dpi": 100, "savefig.dpi": 100})


def _subplots(figsize, layout=None):
    """A Figure outside pyplot: no global state, no GUI backend, nothing to close."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout=layout)
    return fig, fig.subplots()


def _png(fig, tight: bool = True):
    """PNG bytes (tight: cropped to the drawing); untight also returns the image size, which then equals the
    figure's, so that positions read from the axes after drawing are image pixels."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight" if tight else None, facecolor="white",
                metadata={"Software": None})
    if tight:
        return buf.getvalue()
    w, h = fig.canvas.get_width_height()
    return buf.getvalue(), (w, h)


def _legend(ax, handles=None, labels=None, **kw) -> None:
    """A legend only when something is labelled (matplotlib warns on an empty one)."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, **kw)


def _heatmap(hm: dict, d: dict) -> Plot | None:
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, Normalize

    ds = panels.downsample_heatmap(hm, max_modules=60, max_steps=300)
    if not ds["headroom"] or len(ds["steps"]) < 2:
        return None
    grid = np.array([[np.nan if v is None else v for v in row] for row in ds["headroom"]], dtype=float)
    finite = grid[np.isfinite(grid)]
    lo = max(min(-4.0, math.floor(finite.min()) - 1 if finite.size else -4.0), -116.0)
    hi = max(34.0, math.ceil(finite.max()) + 1 if finite.size else 34.0)
    stops = [(-4, "#7f0000"), (0, RED), (0.5, "#f28b30"), (4, "#fdd663"), (10, "#ceead6"), (20, "#81c995"),
             (30, "#4a90c2"), (34, "#7b5ea7")]
    stops = [(lo, "#4a0000")] * (lo < -4) + stops + [(hi, "#5b3f86")] * (hi > 34)
    cmap = LinearSegmentedColormap.from_list("headroom", [((v - lo) / (hi - lo), c) for v, c in stops])
    cmap = cmap.with_extremes(bad="#eceff1", under=BLACK)   # grey: not sampled; black: inf/NaN in the output
    rows, cols = grid.shape
    fig, ax = _subplots((11, min(max(2.8, 0.16 * rows + 1.6), 11)), layout="constrained")
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
    title = f"Headroom to the {ref} max, per layer and step (bits; black = inf/NaN)"
    if rows < ds["n_modules"]:
        title += f" — {ds['n_modules']} layers binned"
    ax.set_title(title, color=INK, pad=16)
    bad_cols = np.isneginf(grid).any(axis=0)
    caption = []
    if bad_cols.any():   # the first bad step: a line on the left edge of its column (cells stay visible)
        j0 = int(np.argmax(bad_cols))
        ax.axvline(j0 - 0.5, color=RED, lw=2.0, ls="--")
        ax.annotate(f"first inf/NaN: step {ds['steps'][j0]}", xy=(j0 - 0.5, -0.5), xytext=(2, 2),
                    textcoords="offset points", color=RED, fontsize=8, va="bottom", annotation_clip=False)
        caption.append(f"Dashed line: step {ds['steps'][j0]}, the first step with an inf/NaN output.")
    c = panels.culprit_cell(ds, d)
    if c is not None:
        wi, wj = c["cell"]
        v = c["value"]
        if v < 4:   # circle only a cell worth finding; a healthy run's lowest headroom is just noted
            ax.plot([wj], [wi], marker="o", ms=16, mfc="none", mec="white", mew=2.2)
            ax.plot([wj], [wi], marker="o", ms=19, mfc="none", mec=RED if v <= 0 else INK, mew=1.4)
        what = "inf/NaN" if math.isinf(v) else f"{v:.2f} bits"
        lead = {"first non-finite": "first inf/NaN", "lowest headroom": "lowest headroom"}.get(c["why"], c["why"])
        said = {"first non-finite": "the first inf/NaN output", "lowest headroom": "the lowest headroom"}.get(
            c["why"], f"named as the root cause by the {c['why']} finding")
        caption.insert(0, f"{'Circled' if v < 4 else 'Noted'}: `{c['module']}` at step {c['step']} ({what}), {said}.")
        ax.annotate(f"{lead}: {c['module']} at step {c['step']} ({what}){'  — circled' if v < 4 else ''}",
                    xy=(1.0, 1.0), xycoords="axes fraction", xytext=(0, 3), textcoords="offset points",
                    va="bottom", ha="right", fontsize=8.5, fontweight="bold" if v <= 0 else "normal",
                    color=RED if v <= 0 else INK, annotation_clip=False)
    cb = fig.colorbar(im, ax=ax, fraction=0.035, pad=0.015, extend="min")
    cb.set_label("bits of headroom (grey: not sampled; black: inf/NaN)", fontsize=8)
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
    png, (W, H) = _png(fig, tight=False)
    bb = ax.get_window_extent()                     # after drawing: the axes in image pixels (origin bottom-left)
    x0, x1, y_top, y_bot = bb.x0, bb.x1, H - bb.y1, H - bb.y0
    areas = []
    for i, label in enumerate(ds["modules"]):
        row = grid[i]
        nonfin = [ds["steps"][j] for j in range(cols) if np.isneginf(row[j])]
        fin = row[np.isfinite(row)]
        tip = f"{label}: " + (f"inf/NaN output from step {nonfin[0]} ({len(nonfin)} of {cols} columns)" if nonfin
                              else f"lowest headroom {fin.min():.2f} bits" if fin.size else "not sampled")
        areas.append({"left": 100 * x0 / W, "top": 100 * (y_top + i * (y_bot - y_top) / rows) / H,
                      "width": 100 * (x1 - x0) / W, "height": 100 * (y_bot - y_top) / rows / H, "title": tip,
                      "module": label, "nonfinite": bool(nonfin), "cols": cols})
    return Plot(png, areas, " ".join(caption))


def _timeline(tl: list[dict], d: dict) -> Plot | None:
    pts = [(int(r["step"]), num(r.get("scale")), num(r.get("loss")), bool(r.get("skipped"))) for r in tl
           if r.get("step") is not None]
    if not pts:
        return None
    steps = [p[0] for p in pts]
    scales = [p[1] if p[1] and p[1] > 0 and math.isfinite(p[1]) else float("nan") for p in pts]
    has_scale = any(s == s for s in scales)
    losses = [p[2] for p in pts]
    fin = [(s, v) for s, v in zip(steps, losses) if v is not None and math.isfinite(v)]
    skipped = [p[0] for p in pts if p[3]]
    if not has_scale and not fin and not skipped:
        return None                                    # nothing to draw (panels.empty_reasons says why)
    fig, ax = _subplots((11, 3.4))
    if has_scale:
        ax.step(steps, scales, where="post", color=BLUE, lw=1.8, label="loss scale")
        ax.set_yscale("log", base=2)
        ax.set_ylabel("loss scale", color=BLUE)
    for s in skipped:
        ax.axvspan(s - 0.5, s + 0.5, color=RED, alpha=0.18 if len(skipped) < 200 else 0.1, lw=0)
    if skipped:
        ax.plot([], [], color=RED, alpha=0.35, lw=6, label=f"skipped step ({len(skipped)} of {len(pts)})")
    # a second axis for the loss only when some loss is finite: an axis of NaNs is an empty -0.04..0.04 scale
    ax2 = ax.twinx() if has_scale and fin else ax
    if fin:
        ax2.plot([f[0] for f in fin], [f[1] for f in fin], color=GREY, lw=1.1, label="loss")
        ax2.set_ylabel("loss", color="#5f6368")
        if ax2 is not ax:
            ax2.spines["right"].set_visible(True)
    elif not has_scale:
        ax.set_yticks([])
    bad = [s for s, v in zip(steps, losses) if v is not None and not math.isfinite(v)]
    if bad:
        ax.plot(bad, [1.0] * len(bad), "x", color=RED, ms=5, transform=ax.get_xaxis_transform(), clip_on=False,
                label=f"loss inf/NaN ({len(bad)})")
    ax.set_xlabel("optimizer step")
    if has_scale:
        ax.set_title("Loss scale over steps (skipped steps shaded red)", color=INK)
    else:
        ax.set_title("Loss over steps (no GradScaler in this run)", color=INK)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels() if ax2 is not ax else ([], [])
    _legend(ax, h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, frameon=False,
            ncol=4)
    return Plot(_png(fig))


def _grad_norms(gn: dict, d: dict, top: int = 8) -> Plot | None:
    import matplotlib

    names, steps = list(gn.get("names") or []), list(gn.get("steps") or [])
    if len(steps) < 2:
        return None
    series = []
    for name, vals in zip(names, gn.get("values") or []):
        xs, ys = panels.downsample_series(steps, vals, keep="max")
        fin = [y for y in ys if y is not None and math.isfinite(y) and y > 0]
        nonfin = any(y is not None and not math.isfinite(y) for y in ys)
        series.append((nonfin, max(fin) if fin else 0.0, name, xs, ys))
    if not any(s[1] > 0 for s in series):
        return None                                    # nothing finite (panels.empty_reasons says why)
    series.sort(key=lambda s: (not s[0], -s[1]))
    fig, ax = _subplots((11, 3.8))
    colors = matplotlib.colormaps["tab10"].colors
    bad_steps = set()
    for rank, (nonfin, _, name, xs, ys) in enumerate(reversed(series)):
        highlighted = len(series) - 1 - rank < top
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y) and y > 0]
        if pts:
            kw = dict(lw=1.4, label=name[-50:] or "(root)", color=colors[(len(series) - 1 - rank) % 10]) \
                if highlighted else dict(lw=0.6, color="#dadce0")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None, **kw)
        bad_steps.update(x for x, y in zip(xs, ys) if y is not None and not math.isfinite(y))
    if bad_steps:
        ax.plot(sorted(bad_steps), [1.0] * len(bad_steps), "x", color=RED, ms=5, transform=ax.get_xaxis_transform(),
                clip_on=False, label="inf/NaN on that step")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient norm (unscaled)")
    more = f" (top {top} of {len(series)} shown in colour)" if len(series) > top else ""
    ax.set_title(f"Gradient norm per parameter after unscale_{more}", color=INK)
    _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    return Plot(_png(fig))


def headroom_timeline_empty(d: dict) -> str | None:
    """One sentence when a run report's headroom timeline has nothing to draw (why, and what to pass); None when
    it has, or when the report is not a run's."""
    if not d.get("timeline"):
        return None
    ht = d.get("headroom_timeline") or {}
    steps = [s for s, *col in zip(ht.get("steps") or [], *(ht.get("headroom") or [[]]))
             if any(num(v) is not None for v in col)]
    if len(steps) >= 2:
        return None
    seen = f"for step {steps[0]} only" if steps else "for no step"
    return (f"Per-layer headroom was recorded {seen}, so there is no timeline to draw: pass `headroom=True` (or "
            f"`every=1`) to `ampdoctor.watch` to record every layer's headroom on every step.")


def _headroom_timeline(ht: dict, d: dict) -> Plot | None:
    import matplotlib

    if headroom_timeline_empty({"timeline": [1], "headroom_timeline": ht}) is not None:
        return None                                    # fewer than two measured steps (the sentence says why)
    mods, forecast = list(ht.get("modules") or []), dict(ht.get("forecast") or {})
    first_bad = num(ht.get("first_bad_step"))
    fig, ax = _subplots((11, 3.8))
    colors = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 3]   # red marks inf/NaN
    bad_x, lo, hi, caption = [], 0.0, 1.0, []
    for k, (m, row) in enumerate(zip(mods, ht.get("headroom") or [])):
        xs, ys = panels.downsample_series(ht.get("steps") or [], row, keep="min")
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
        bad_x += [x for x, y in zip(xs, ys) if y is not None and not math.isfinite(y)]
        label = (m or "(root)")[-50:]
        fc = num(forecast.get(m)) if m in forecast else None
        color = colors[k % len(colors)]
        if fc is not None:
            label += f" (forecast 0 bits at step {fc:.0f})"
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.8 if m in forecast else 1.1,
                    marker="." if len(pts) < 60 else None, ms=4, label=label)
            lo, hi = min(lo, min(p[1] for p in pts)), max(hi, max(p[1] for p in pts))
            if fc is not None and fc > pts[-1][0]:
                ax.plot([pts[-1][0], fc], [pts[-1][1], 0.0], color=color, lw=1.2, ls=":")
                ax.plot([fc], [0.0], marker="x", color=color, ms=7, mew=1.8)
                caption.append(f"`{m or '(root)'}`: {pts[-1][1]:.1f} bits left at step {pts[-1][0]}, forecast to "
                               f"reach the max around step {fc:.0f} (dotted).")
    if bad_x:
        ax.plot(sorted(set(bad_x)), [0.0] * len(set(bad_x)), "x", color=RED, ms=6, mew=1.6, clip_on=False,
                label="inf/NaN output on that step")
    ax.axhline(0.0, color=INK, lw=1.0)
    if first_bad is not None:
        ax.axvline(first_bad, color=RED, lw=1.6, ls="--", label=f"first bad step ({first_bad:.0f})")
        caption.append(f"Dashed line: step {first_bad:.0f}, the first bad step.")
    ax.set_ylim(min(lo, 0.0) - 0.5, hi + 1.0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bits of headroom (0 = dtype max)")
    ax.set_title("Forward headroom per layer and step (the layers closest to the max; dotted: forecast)", color=INK)
    _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    return Plot(_png(fig), caption=" ".join(caption))


_RENDERERS = {"heatmap": _heatmap, "timeline": _timeline, "grad_norms": _grad_norms,
              "headroom_timeline": _headroom_timeline}


def render(report) -> dict[str, Plot]:
    """{plot key (see PLOT_FILES): Plot} for the panels that have something to show."""
    import matplotlib

    d = report if isinstance(report, dict) else report.to_dict()
    out: dict[str, Plot] = {}
    with matplotlib.rc_context(_style()):
        for key, fn in _RENDERERS.items():
            panel = d.get(key)
            if panel:
                plot = fn(panel, d)
                if plot is not None:
                    out[key] = plot
    return out


def render_plots(report) -> dict[str, bytes]:
    """PNG bytes per file name (see PLOT_FILES) for the panels that have something to show."""
    return {PLOT_FILES[k]: p.png for k, p in render(report).items()}


def write_plots(report, out_dir: str | os.PathLike) -> list[str]:
    """Write the report's plots as PNG files into `out_dir` (created if needed); return their paths."""
    from ..fsutil import atomic_write_bytes
    return [atomic_write_bytes(os.path.join(os.fspath(out_dir), name), png)
            for name, png in render_plots(report).items()]
