"""From records to a Report: run the rules, rank the findings (root cause first), write the summary and the
data panels the reporters draw; merge the ranks of a distributed run; fold in an in-process replay."""
from __future__ import annotations

import dataclasses
import math
import warnings

from .errors import BadInput
from .findings import Finding, Report
from .records import DTYPE_LIMITS, ParamStat, RunMeta, StepRecord
from .rules import RuleConfig, RunData, run_rules
from .rules.scaler import ranks_diverged
from .rules.steps import absorbed_modules, benign_backoff, real_bad
from .summary import crash_covered, summarize, verdict

__all__ = ["build_report", "diagnose_run_dir", "merge_replay", "rank"]


def rank(findings: list[Finding]) -> list[Finding]:
    """Most important first, in the one order of findings (`Finding.sort_key`)."""
    return sorted(findings, key=Finding.sort_key)


def build_report(meta: RunMeta, steps: list[StepRecord], *, run_dir: str | None = None,
                 config: RuleConfig | None = None) -> Report:
    run = RunData(meta, steps)
    findings = rank(run_rules(run, config))
    return Report(findings, summarize(meta, steps, findings, run_dir, run.has_scaler),
                  _panels(meta, steps, findings))


def _headroom(s) -> float | None:
    if s is None:
        return None
    if not s.finite:   # inf or NaN in the output: no headroom at all (the reporters draw these cells black)
        return -math.inf
    if not s.absmax:
        return None
    mx = DTYPE_LIMITS.get(s.ref if s.ref in ("float16", "bfloat16") else "float16")[0]
    return math.log2(mx / s.absmax)


def _panels(meta: RunMeta, steps: list[StepRecord], findings: list[Finding] = ()) -> dict:
    benign = benign_backoff(steps, RunData(meta, steps).has_scaler)
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
                          "stage": e.stage, "error": e.error, "internal": bool(e.detail.get("internal")),
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


def diagnose_run_dir(run_dir: str) -> Report:
    """Read a run directory (all ranks) and build its Report; findings carry evidence.rank when distributed."""
    from .rundir import find_rank_dirs, read_run
    ranks = find_rank_dirs(run_dir)
    try:
        return _diagnose(run_dir, ranks, read_run)
    except (TypeError, AttributeError, KeyError, ValueError, IndexError) as e:
        if isinstance(e, BadInput):
            raise
        raise BadInput(f"{run_dir}: malformed records ({type(e).__name__}: {e}); was this written by "
                       "ampdoctor.watch?") from None


def _diagnose(run_dir, ranks, read_run) -> Report:
    if len(ranks) == 1 and ranks[0][0] is None:
        meta, steps = read_run(ranks[0][1])
        return build_report(meta, steps, run_dir=run_dir)
    runs = [(r, path, *read_run(path)) for r, path in ranks]
    _combine_shards([steps for _, _, _, steps in runs])
    reports = [(r, build_report(meta, steps, run_dir=path), steps) for r, path, meta, steps in runs]
    return _merge_ranks(run_dir, reports)


def _combine_shards(per_rank: list[list[StepRecord]]) -> None:
    """FSDP2: each rank recorded its own shard of a sharded parameter's gradient (ParamStat.sharded). Where
    every rank sampled the step, replace the shard values by the parameter's global ones (L2: root of the sum
    of squares; abs-max: the largest, NaN first) on every rank's record, and the step's total norm with them.
    A rank without a ParamStat for the parameter held an empty shard."""
    by_step: dict[int, list[StepRecord]] = {}
    for steps in per_rank:
        for s in steps:
            by_step.setdefault(s.step, []).append(s)
    for step, recs in by_step.items():
        if len(recs) != len(per_rank) or not all(s.sampled for s in recs):
            continue
        shards: dict[str, list[ParamStat]] = {}
        for s in recs:
            for p in s.params:
                if p.sharded:
                    shards.setdefault(p.name, []).append(p)
        if not shards:
            continue
        for ps in shards.values():
            l2 = [p.grad_norm for p in ps]
            amax = [p.grad_absmax for p in ps if p.grad_absmax is not None]
            g = math.sqrt(sum(v * v for v in l2)) if None not in l2 else None
            a = next((v for v in amax if v != v), max(amax)) if amax else None
            bad = max(p.grad_nonfinite for p in ps)
            for p in ps:
                p.grad_norm, p.grad_absmax, p.grad_nonfinite = g, a, bad
            for s in recs:
                if not any(p.name == ps[0].name for p in s.params):
                    s.params.append(dataclasses.replace(ps[0]))
        for s in recs:
            norms = [p.grad_norm for p in s.params if p.grad_norm is not None]
            if norms:
                s.grad_norm = math.sqrt(sum(v * v for v in norms))


def _merge_ranks(run_dir, reports) -> Report:
    merged: dict[tuple, Finding] = {}
    for r, rep, _ in reports:
        for f in rep.findings:
            key = (f.rule, f.module, f.phase)
            if key not in merged or (f.step is not None and (merged[key].step is None or f.step < merged[key].step)):
                f.evidence["rank"] = r
                merged[key] = f
            merged[key].evidence.setdefault("ranks", [])
            if r not in merged[key].evidence["ranks"]:
                merged[key].evidence["ranks"].append(r)
    findings = rank(list(merged.values()) + ranks_diverged({r: steps for r, _, steps in reports}))
    first = reports[0][1]
    summ = dict(first.summary)
    crash = next((rep.summary.get("crash") for _, rep, _ in reports if rep.summary.get("crash")), None)
    firsts = [rep.summary.get("first_bad_step") for _, rep, _ in reports if rep.summary.get("first_bad_step") is not None]
    summ.update({"run_dir": run_dir, "ranks": [r for r, _, _ in reports], "crash": crash,
                 "first_bad_step": min(firsts) if firsts else None,
                 "errors": sum(f.severity == "error" for f in findings) + (crash is not None and
                                                                          not crash_covered(crash, findings)),
                 "warnings": sum(f.severity == "warning" for f in findings),
                 "infos": sum(f.severity == "info" for f in findings)})
    top = next((f for f in findings if f.severity in ("error", "warning")), None)
    if top is not None or crash is not None:
        summ["verdict"] = verdict(findings, summ.get("steps", 0), crash,
                                  rank=top.evidence.get("rank") if top is not None else None)
    return Report(findings, summ, first.data)


_OPLEVEL = ("overflow", "nan_origin", "mask_value_overflow", "eps_underflow")


def merge_replay(rep: Report, watch) -> Report:
    """Re-run the first capture in-process with op-level instrumentation and fold its findings in: an op-level
    finding at the same module (or inside it) refines the module-level one (rule and op)."""
    m = watch.machine
    m.suspended = True  # the watch's own hooks must not record the replay's forward
    try:
        return merge_capture_replay(rep, watch.steps, watch.model)
    finally:
        m.suspended = False


def _follow_refined(findings: list[Finding], refined: set[int], before: list[str | None]) -> None:
    """The scaler findings that named a producer module (loss_scale_collapse, skipped_steps: "it comes from X")
    follow the replay where it located that producer more precisely inside X (under torch.compile the watch sees
    only the root module; the replay of the capture names the layer)."""
    moved: dict[str | None, str] = {}
    for i, old in enumerate(before):
        f = findings[i]
        if id(f) in refined and old is not None and f.module and f.module != old and (
                not old or f.module.startswith(old + ".")):
            moved.setdefault(old, f.module)
    for i, f in enumerate(findings):
        if f.phase == "scaler" and f.module in moved and id(f) not in refined:
            new = moved[f.module]
            msg = f.message.replace(f"`{f.module or '(root)'}`", f"`{new}`")
            findings[i] = Finding(f.rule, f.severity, f.phase, new, f.op, f.step, msg, f.fix, f.evidence)


def merge_capture_replay(rep: Report, steps: list[StepRecord], model, loss_fn=None, *, strict: bool = False) -> Report:
    """`merge_replay` for any model (e.g. `ampdoctor report RUN_DIR --model pkg.mod:factory`). With `strict`, a
    replay that fails raises (BadInput); otherwise it only warns and the report stands as it was."""
    caps = rep.summary.get("captures") or []
    top = next((f for f in rep.findings if f.severity == "error"), None)
    by_step = {r.step: r.capture for r in steps if r.capture}
    cap = by_step.get(top.step) if top is not None and top.step in by_step else (caps[0] if caps else None)
    if cap is None or not any(f.severity in ("error", "warning") for f in rep.findings):
        # nothing wrong by the watch's own records (e.g. GradScaler's normal backoff): a replay could only add
        # advisory constants to a healthy run
        return rep
    from .replay import replay
    try:
        rr = replay(cap, model=model, loss_fn=loss_fn, shadow=False, whatif=False, fix_search=False)
    except Exception as e:  # replay is a bonus here; the watch report stands on its own
        if strict:
            raise BadInput(f"replaying {cap} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") \
                from None
        warnings.warn(f"ampdoctor: in-process replay of {cap} failed ({type(e).__name__}: {e})", RuntimeWarning,
                      stacklevel=3)
        return rep
    findings = list(rep.findings)
    before = [f.module for f in findings]
    refined: set[int] = set()
    ops = (rr.data.get("replay") or {}).get("ops") or []
    for i, g in enumerate(findings):  # the op inside each module-level producer, from the replay's op events
        # a module seen on a later sampled step (evidence.observed_step) went bad on another batch: the replay of
        # the capture of the step itself says which module made the inf/NaN there
        unlocated = bool(g.evidence.get("unlocated")) or (
            g.evidence.get("observed_step") not in (None, g.step) and by_step.get(g.step) == cap)
        if g.rule not in ("overflow", "nan_origin") or g.severity == "info" or (g.module is None and not unlocated):
            continue
        ev = next((o for o in ops if (o.get("phase") == g.phase or unlocated) and o.get("kind") in ("overflow", "nan_origin")
                   and o.get("module") is not None and (unlocated or o["module"] == g.module or
                                                        o["module"].startswith(g.module + ".") or not g.module)),
                  None)
        if ev is None:
            continue
        rule = "overflow" if ev["kind"] == "overflow" else "nan_origin"
        what = "produced ±inf from finite inputs" if rule == "overflow" else "produced NaN from NaN-free inputs"
        evd = dict(g.evidence, module_level_rule=g.rule, op_line=ev.get("line"), op_out_dtype=ev.get("out_dtype"),
                   from_replay=cap)
        twin = next((f for f in rr.findings if f.module == ev["module"] and f.op == ev.get("op")
                     and f.phase == g.phase and f.rule == rule), None)
        msg = twin.message if twin else f"{ev.get('op')} in `{ev['module']}` {what} ({ev.get('line')})."
        evd.pop("unlocated", None)
        findings[i] = Finding(rule, g.severity, ev.get("phase") or g.phase, ev["module"], ev.get("op"), g.step, msg,
                              twin.fix if twin else g.fix, evd)
        refined.add(id(findings[i]))
    fwd_bad = any(f.phase == "forward" and f.rule in ("overflow", "nan_origin") for f in rr.findings)
    for f in rr.findings:  # ranked root cause first: the first op-level match per watch finding wins
        if f.rule not in _OPLEVEL or f.severity == "info":
            continue
        if f.phase == "backward" and fwd_bad:
            continue  # gradients of non-finite activations: consequences of the forward origin
        if f.rule in ("overflow", "nan_origin"):
            match = next((g for g in findings if id(g) not in refined and g.rule in ("overflow", "nan_origin")
                          and g.phase == f.phase and g.severity != "info" and g.module is not None
                          and f.module is not None and (f.module == g.module or f.module.startswith(g.module + ".")
                                                        if g.module else True)), None)
            if match is not None:
                i = findings.index(match)
                ev = dict(match.evidence)
                ev.update({k: v for k, v in f.evidence.items() if k != "rank_hint"})
                ev["module_level_rule"] = match.rule
                findings[i] = Finding(f.rule, match.severity, f.phase, f.module, f.op, match.step, f.message,
                                      f.fix, ev)
                refined.add(id(findings[i]))
                continue
            bad_weights = {c.module for r in steps for c in r.modules if c.par is not None and not c.par.finite}
            if f.module is None or f.module in bad_weights or any(
                    g.rule in ("overflow", "nan_origin") and g.phase == f.phase for g in findings):
                continue  # (non-finite weights from an earlier update are not produced by this op)
        if not any(g.rule == f.rule and g.module == f.module for g in findings):
            f.evidence["rank_hint"] = 13 if f.severity == "error" else f.evidence.get("rank_hint", 30)
            f.evidence["from_replay"] = cap
            if f.step is None:
                f.step = next((g.step for g in findings if g.module == f.module), None)
            findings.append(f)
    _follow_refined(findings, refined, before)
    rep.findings = rank(findings)
    if rr.data.get("replay"):
        rep.data["replay"] = rr.data["replay"]
    rep.summary["verdict"] = verdict(rep.findings, rep.summary.get("steps", len(steps)), rep.summary.get("crash"),
                                     benign=rep.summary.get("benign_backoff_steps"))
    return rep
