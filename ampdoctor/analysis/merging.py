"""A run directory to a Report: read every rank (or the one run), give FSDP2's per-rank gradient shards their
global values, build each rank's report and merge them (first step per finding, the ranks that saw it, the
ranks that diverged, one summary and verdict)."""
from __future__ import annotations

import dataclasses
import math

from ..errors import BadInput
from ..findings import Finding, Report
from ..records import ParamStat, StepRecord
from ..rules.scaler import ranks_diverged
from ..summary import counts, verdict
from .ranking import build_report, rank

__all__ = ["diagnose_run_dir"]


def diagnose_run_dir(run_dir: str, saved_replay: bool = True) -> Report:
    """Read a run directory (all ranks) and build its Report; findings carry evidence.rank when distributed.
    With `saved_replay`, the op-level replay the watch ran of a rank's capture (rundir.read_replay) is folded in
    as `w.report()` did."""
    from ..rundir import find_rank_dirs, read_run
    ranks = find_rank_dirs(run_dir)
    try:
        return _diagnose(run_dir, ranks, read_run, saved_replay)
    except (TypeError, AttributeError, KeyError, ValueError, IndexError) as e:
        if isinstance(e, BadInput):
            raise
        raise BadInput(f"{run_dir}: malformed records ({type(e).__name__}: {e}); was this written by "
                       "ampdoctor.watch?") from None


def _diagnose(run_dir, ranks, read_run, saved_replay: bool) -> Report:
    if len(ranks) == 1 and ranks[0][0] is None:
        meta, steps = read_run(ranks[0][1])
        rep = build_report(meta, steps, run_dir=run_dir)
        return _with_saved_replay(rep, steps, ranks[0][1]) if saved_replay else rep
    runs = [(r, path, *read_run(path)) for r, path in ranks]
    _combine_shards([steps for _, _, _, steps in runs])
    reports = [(r, build_report(meta, steps, run_dir=path), steps) for r, path, meta, steps in runs]
    if saved_replay:
        reports = [(r, _with_saved_replay(rep, steps, path), steps) for (r, rep, steps), (_, path)
                   in zip(reports, ranks)]
    return _merge_ranks(run_dir, reports)


def _with_saved_replay(rep: Report, steps: list[StepRecord], path: str) -> Report:
    """Fold in the replay saved with this run (rundir.read_replay) when it is of the capture this report would
    replay; any other (a stale one, of another capture) is left out."""
    from ..rundir import capture_name, read_replay
    from .replaychoice import candidates
    from .replayfold import fold_replay
    saved = read_replay(path)
    if saved is None:
        return rep
    name, doc = saved
    cap = next((c for c in candidates(rep, steps) if capture_name(c) == name), None)
    if cap is None:
        return rep
    return fold_replay(rep, steps, cap, Report.from_dict(doc))


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


_CONSEQUENCES = ("SystemExit", "KeyboardInterrupt")


def _first_crash(reports) -> dict | None:
    """The crash that ended the run, with its rank: an exception of its own before an exit that another rank's
    failure caused (a rank whose collective broke exits with sys.exit), then the earliest step."""
    crashes = [dict(rep.summary["crash"], rank=r) for r, rep, _ in reports if rep.summary.get("crash")]
    return min(crashes, key=lambda c: (c.get("type") in _CONSEQUENCES,
                                       c["step"] if isinstance(c.get("step"), int) else 1 << 62), default=None)


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
    crash = _first_crash(reports)
    firsts = [rep.summary.get("first_bad_step") for _, rep, _ in reports if rep.summary.get("first_bad_step") is not None]
    summ.update({"run_dir": run_dir, "ranks": [r for r, _, _ in reports], "crash": crash,
                 "first_bad_step": min(firsts) if firsts else None, **counts(findings, crash)})
    top = next((f for f in findings if f.severity in ("error", "warning")), None)
    if top is not None or crash is not None:
        summ["verdict"] = verdict(findings, summ.get("steps", 0), crash,
                                  rank=top.evidence.get("rank") if top is not None else None)
    return Report(findings, summ, first.data)
