"""The HTML reporter: one self-contained file (inline CSS, JS and PNG data URIs; no network, no fonts).

`write_html(report, path)` renders templates/report.html.j2 with jinja2 (autoescaped: module names and
messages come from user code) and writes it atomically. `path` is a file ending in .html, or a directory that
gets `index.html` plus the standalone plot PNGs beside it. A Content-Security-Policy forbids every fetch, so
the page cannot reach the network even if a value slipped through. This module only shapes panels into rows;
the charts come from plots.py, the downsampling and "why this plot is empty" from panels.py, headlines, fix
blocks and `code` spans from prose.py. Each thing is said once: the root finding's fix is shown in the top card
and referred to (not repeated) by its finding card and by the replay's fix search.
"""
from __future__ import annotations

import base64
import json
import math
import os

from . import panels, prose
from .panels import fmt_num, num

__all__ = ["write_html", "render_html"]

MAX_CALL_ROWS = 300
_REF_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
LAYER_COLS = [("module", "module", "str"), ("type", "type", "str"), ("calls", "calls", "num"),
              ("absmax_out", "abs-max out", "num"), ("headroom_bits", "headroom (bits)", "num"),
              ("subnormal_share", "subnormal share", "num"), ("absmax_grad", "abs-max grad", "num"),
              ("grad_norm", "grad norm", "num"), ("nonfinite_out", "non-finite out", "num")]
PLOT_INFO = {"heatmap": ("heatmap", "Headroom heatmap", "layer × step; black: inf/NaN output; hover a row for its values"),
             "timeline": ("timeline", "Loss-scale timeline", "skipped steps shaded red"),
             "grad_norms": ("grad-norms", "Gradient norms", "per parameter, right after unscale_; worst value per bin"),
             "headroom_timeline": ("headroom-timeline", "Headroom timeline",
                                   "forward headroom per step, closest layers; dotted: forecast to the max")}


def _sort_value(v, col: str) -> str:
    x = num(v)
    if x is None:
        return "" if not isinstance(v, str) else v
    if math.isnan(x):   # a NaN statistic is as bad as it gets: lowest headroom, highest anything else
        return "-Infinity" if col == "headroom_bits" else "Infinity"
    return repr(x).replace("inf", "Infinity")


def _layer_rows(layers: list[dict]) -> list[list[dict]]:
    rows = []
    for layer in layers:
        row = []
        for key, _, kind in LAYER_COLS:
            v = layer.get(key)
            if kind == "str":
                text = ("(root)" if key == "module" and v == "" else "" if v is None else str(v))
                row.append({"text": text, "v": text, "cls": "mono" if key == "module" else ""})
                continue
            x, cls = num(v), ""
            text = fmt_num(v)
            if key == "headroom_bits" and x is not None:
                cls = "hr-bad" if not x > 0 else "hr-low" if x < 2 else "hr-sub" if x > 30 else ""
                text = "inf/NaN" if not math.isfinite(x) else f"{x:.2f}"
            elif key == "subnormal_share" and x is not None and math.isfinite(x):
                text = f"{100 * x:.1f}%"
                cls = "hr-low" if x >= 0.25 else ""
            elif key == "nonfinite_out" and x:
                cls = "hr-bad"
            row.append({"text": text, "v": _sort_value(v, key), "cls": ("num " + cls).strip()})
        rows.append(row)
    return rows


def _evidence(f: dict) -> list[tuple[str, str, str]]:
    """(key, what it means for this finding, value) rows; ranking internals left out."""
    ev = f.get("evidence") or {}
    out = []
    for k, v in ev.items():
        if k in prose.HIDDEN_EVIDENCE:
            continue
        if isinstance(v, (dict, list)):
            text = json.dumps(v) if not (isinstance(v, list) and all(isinstance(x, str) for x in v)) \
                else " → ".join(v) if k == "sequence" else ", ".join(v)
        else:
            text = fmt_num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
        out.append((str(k), prose.evidence_label(str(k), ev, f.get("op")), text[:2000]))
    return out


def _calls(calls: list[dict], first_bad) -> tuple[list[dict], str]:
    """Keep what explains a failure: misordered or failing calls, the first steps, and around the first bad step."""
    def keep(c):
        s = c.get("step")
        near = first_bad is not None and s is not None and abs(s - first_bad) <= 1
        return c.get("misordered") or c.get("error") or (s is not None and s <= 2) or near
    rows = calls if len(calls) <= MAX_CALL_ROWS else [c for c in calls if keep(c)][:MAX_CALL_ROWS]
    out = []
    for c in rows:
        src = f"{c.get('file') or ''}:{c['line']}" if c.get("line") is not None else (c.get("file") or "")
        out.append({**c, "source": src})
    n_mis = sum(bool(c.get("misordered")) for c in calls)
    note = f"{len(calls)} calls in program order"
    if len(rows) < len(calls):
        note += f"; showing {len(rows)}: out-of-order and failing calls, the first steps and the first bad step"
    if n_mis:
        note += f"; {n_mis} out of order (highlighted)"
    return out, note


_BAD_KINDS = ("overflow", "nan", "inf", "posinf", "neginf", "constant", "exception", "first NaN", "nan_origin")


def _op_numbers(c: dict, ops: list[dict]) -> str:
    """What the op did, in numbers, from replay's op record: 'max |in| 883.5 → 55 ±inf of 512 (float16)'."""
    o = next((o for o in ops if o.get("op") == c.get("op") and o.get("module") == c.get("module")
              and o.get("phase") == c.get("phase")), None)
    if not o:
        return ""
    bad = []
    for key, word in (("out_posinf", "+inf"), ("out_neginf", "-inf"), ("out_nan", "NaN")):
        if o.get(key):
            bad.append(f"{fmt_num(o[key])} {word}")
    text = f"max |in| {fmt_num(o.get('absmax_in'))}" if o.get("absmax_in") is not None else ""
    if bad:
        text += (" → " if text else "") + ", ".join(bad) + (f" of {fmt_num(o['out_numel'])}" if o.get("out_numel") else "")
    return text + (f" ({o['out_dtype']})" if o.get("out_dtype") and text else "")


def _chain(items: list[dict], ops: list[dict] | None = None) -> list[dict]:
    """One box per chain stage, from the first bad op to the loss and the gradients: replay's stages
    (constant, exception, origin, first_nan, loss, grads), or plain {phase, module, op, kind, source} items."""
    rows = []
    raised = any(c.get("stage") == "exception" for c in items)
    for c in items:
        stage = c.get("stage")
        src = c.get("source") or c.get("line") or ""
        row = {"module": c.get("module"), "op": c.get("op"), "phase": c.get("phase"), "source": str(src),
               "detail": "", "numbers": _op_numbers(c, ops or [])}
        if stage == "constant":
            row.update(badge="constant", detail=f"{c.get('rule', '')}: value {fmt_num(c.get('value'))}")
        elif stage == "exception":
            row.update(badge="exception", detail=str(c.get("message", "")))
        elif stage == "first_nan":
            row.update(badge="first NaN")
        elif stage == "loss":
            if c.get("finite") is None:
                row.update(badge="loss", cls="skip",
                           detail="not computed: the forward raised" if raised
                           else "not computed: " + prose.NO_LOSS_TEXT)
            else:
                row.update(badge="loss", detail="finite" if c.get("finite") else "inf/NaN",
                           cls="ok" if c.get("finite") else "error")
        elif stage == "grads":
            if any(r.get("cls") == "skip" for r in rows):
                continue                      # no loss, no backward: said once, on the loss box
            n = c.get("count") or 0
            names = ", ".join(map(str, c.get("nonfinite") or []))
            more = f" (+{n - len(c.get('nonfinite') or [])})" if n > len(c.get("nonfinite") or []) else ""
            row.update(badge="gradients", detail=f"{n} non-finite" + (f": {names}{more}" if names else "")
                       if n else "all finite", cls="error" if n else "ok")
        else:
            kind = str(c.get("kind") or stage or "op")
            row.update(badge="overflow → inf" if kind == "overflow" else kind)
            row.setdefault("cls", "error" if kind in _BAD_KINDS else "warning")
        row.setdefault("cls", "error" if row["badge"] in _BAD_KINDS else "warning")
        rows.append(row)
    return rows


def _replay(rp: dict, root_fix: str) -> dict | None:
    if not rp:
        return None
    shadow = []
    errs = [(s.get("module"), num(s.get("rel_err"))) for s in rp.get("shadow") or []]
    finite = [e for _, e in errs if e is not None and math.isfinite(e) and e > 0]
    top = max(finite) if finite else 1.0
    for mod, e in sorted(errs, key=lambda t: -(t[1] if t[1] is not None and not math.isnan(t[1]) else math.inf)):
        pct = 100 if e is None or not math.isfinite(e) else max(1, 100 * e / top)
        shadow.append({"module": mod, "text": fmt_num(e), "pct": round(pct, 1), "bad": e is None or not math.isfinite(e)})
    whatif = []
    for dt, w in (rp.get("whatif") or {}).items():
        err = w.get("max_rel_err_module") or "—"
        if w.get("max_rel_err") is not None:
            err += f" ({fmt_num(w['max_rel_err'])})"
        whatif.append({"dtype": dt, "finite": bool(w.get("finite")), "max_err": w.get("error") or err,
                       "overflow": ", ".join(m or "(root)" for m in w.get("overflow_modules") or []) or "none"})
    fix = rp.get("fix") or {}
    snippet = fix.get("snippet")
    shown = bool(snippet) and snippet.strip() in (root_fix or "")
    return {"capture": rp.get("capture") or "", "chain": _chain(rp.get("chain") or [], rp.get("ops") or []),
            "shadow": shadow, "whatif": whatif, "snippet": None if shown else snippet, "snippet_shown": shown,
            "fix_modules": ", ".join(fix.get("modules") or [])}


def _env(env: dict) -> list[tuple[str, str]]:
    def show(v):
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, (list, tuple)):
            return ".".join(map(str, v)) if all(isinstance(x, int) for x in v) else ", ".join(map(str, v))
        return "—" if v is None else str(v)
    return [(str(k), show(v)) for k, v in (env or {}).items()]


def _version() -> str:
    try:
        from .. import __version__
        return str(__version__)
    except Exception:
        return ""


def _rich(text) -> "markupsafe.Markup":
    """Escaped text with `backticks` turned into <code> spans (a jinja filter)."""
    from markupsafe import Markup, escape
    return Markup("").join(Markup("<code>%s</code>") % p if is_code else escape(p)
                           for p, is_code in prose.code_spans(str(text or "")))


def _plots(d: dict, plots: dict | None) -> tuple[list[dict], dict[str, str]]:
    """Plot rows for the template and the PNGs to write beside index.html ({file name: bytes})."""
    from .plots import PLOT_FILES, Plot, headroom_timeline_empty, render
    if plots is None:
        rendered = render(d)
    else:                          # PNGs given by the caller, by file name
        by_file = {v: k for k, v in PLOT_FILES.items()}
        rendered = {by_file[n]: Plot(png) for n, png in plots.items() if n in by_file}
    reasons = panels.empty_reasons(d)
    if (why := headroom_timeline_empty(d)) is not None:
        reasons["headroom_timeline"] = why
    rows = []
    for key in PLOT_FILES:
        sid, title, note = PLOT_INFO[key]
        if key in rendered:
            rows.append({"id": sid, "title": title, "note": note, "areas": rendered[key].areas,
                         "caption": rendered[key].caption,
                         "b64": base64.b64encode(rendered[key].png).decode("ascii")})
        elif key in reasons:
            rows.append({"id": sid, "title": title, "note": "", "empty": reasons[key]})
    return rows, {PLOT_FILES[k]: p.png for k, p in rendered.items()}


def _context(d: dict, plots: dict | None) -> tuple[dict, dict]:
    summary = d.get("summary") or {}
    root = panels.root_finding(d)
    crash = summary.get("crash") if isinstance(summary.get("crash"), dict) else None
    verdict = summary.get("verdict") or summary.get("headline") or (root or {}).get("message") \
        or "No mixed-precision problems found."
    root_fix = (root or {}).get("fix") or ""
    findings = []
    for f in d.get("findings") or []:
        same = f is root or (root_fix and f.get("fix") == root_fix)
        findings.append({**f, "evidence": _evidence(f), "fix_blocks": [] if same else prose.fix_blocks(f.get("fix")),
                         "fix_above": bool(same and f.get("fix"))})
    stats = [(label, summary[k]) for k, label in (("steps", "steps"), ("bad_steps", "bad steps"),
                                                  ("skipped_steps", "skipped"), ("first_bad_step", "first bad step"))
             if summary.get(k) not in (None, "")]
    header = [f"run {summary['run_dir']}"] if summary.get("run_dir") else []
    if summary.get("every"):
        every = summary["every"]
        header.append("per-layer stats every step" if every == 1 else f"per-layer stats every {every} steps")
    calls, calls_note = _calls(d.get("calls") or [], summary.get("first_bad_step"))
    plot_rows, pngs = _plots(d, plots)
    replay = _replay(d.get("replay") or {}, root_fix)
    sections = [("crash", "Crash", crash), ("findings", "Findings", findings), ("layers", "Layers", d.get("layers"))]
    sections += [(p["id"], p["title"], True) for p in plot_rows]
    sections += [("calls", "Call sequence", calls), ("replay", "Replay", replay), ("env", "Environment", d.get("env"))]
    ctx = dict(title=summary.get("model_class") or "mixed-precision report", header=header, verdict=verdict,
               headline=prose.headline(root, verdict) if root else verdict, root=root,
               root_fix=prose.fix_blocks(root_fix), crash=crash, crash_line=prose.crash_line(crash) if crash else "",
               counts=panels.counts(d), stats=stats, findings=findings, layers=_layer_rows(d.get("layers") or []),
               layer_cols=LAYER_COLS, plots=plot_rows, calls=calls, calls_note=calls_note, replay=replay,
               env=_env(d.get("env") or {}), toc=[(i, label) for i, label, present in sections if present],
               ref=_REF_NAMES.get((d.get("heatmap") or {}).get("ref") or "float16", "fp16"), version=_version())
    return ctx, pngs


def _render(d: dict, plots: dict | None) -> tuple[str, dict]:
    import jinja2

    ctx, pngs = _context(d, plots)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
    env.filters["rich"] = _rich
    return env.get_template("report.html.j2").render(**ctx), pngs


def render_html(report, plots: dict[str, bytes] | None = None) -> str:
    """The report as one HTML string; `plots` ({file name: PNG}) defaults to the report's own plots."""
    d = report if isinstance(report, dict) else report.to_dict()
    return _render(d, plots)[0]


def write_html(report, path: str | os.PathLike) -> str:
    """Write the report to `path` (…/x.html, or a directory → index.html + plot PNGs); return the HTML path.

    Only ampdoctor's own file names are written, each atomically; nothing else in the directory is touched.
    """
    from ..fsutil import atomic_write_bytes, atomic_write_text

    path = os.fspath(path)
    is_dir = os.path.isdir(path) or not path.lower().endswith((".html", ".htm"))
    d = report if isinstance(report, dict) else report.to_dict()
    html, pngs = _render(d, None)
    if is_dir:
        for name, png in pngs.items():
            atomic_write_bytes(os.path.join(path, name), png)
        path = os.path.join(path, "index.html")
    return atomic_write_text(path, html)
