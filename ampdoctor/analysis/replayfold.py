"""Folding a replay into a report: re-run a bad step's capture (the one replaychoice.py chooses) with op-level
instrumentation and let its findings refine the watch's module-level ones (the op, the layer inside the module),
add what only the replay saw, and re-rank; the scaler findings then follow what the replay proved
(replayscaler.py)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..errors import BadInput
from ..findings import Finding, Report
from ..fixes import module_label, modules_related
from ..records import StepRecord
from ..summary import verdict
from .ranking import rank
from .replaychoice import alarming, choose_replay, unexplained_skips
from .replayscaler import applied, benign_backward, follow_refined, no_search, replay_stayed_finite

__all__ = ["merge_capture_replay", "merge_replay", "run_replay", "fold_replay"]


_OPLEVEL = ("overflow", "nan_origin", "mask_value_overflow", "eps_underflow", "underflow")
_CONSTANTS = ("mask_value_overflow", "eps_underflow")


def merge_replay(rep: Report, watch, steps: list[StepRecord] | None = None) -> Report:
    """Re-run the first capture in-process with op-level instrumentation and fold its findings in: an op-level
    finding at the same module (or inside it) refines the module-level one (rule and op). The watch keeps the
    replay (and writes it into its run directory, see `Watch.replayed`), so `diagnose(run_dir)` folds in the same.
    `steps`: the watch's records as a list, where the caller has read them already (a long run's older records
    live in a spill file, and each pass over `watch.steps` reads them back)."""
    steps = list(watch.steps) if steps is None else steps
    picked, rr = choose_replay(rep, steps, lambda cap: watch.replayed(cap, save_any=alarming(rep)))
    return rep if rr is None else fold_replay(rep, steps, picked, rr)


def run_replay(cap, model, loss_fn=None, *, strict: bool = False) -> Report | None:
    """The op-level replay of capture `cap` (a path, or a loaded Capture) that a report folds in (no shadow run or
    what-if; the fix search only for zeros under a log or a division). With `strict`, a replay that fails raises
    (BadInput); otherwise it warns and gives None."""
    from ..replay import replay
    from ..replay.explain import needs_fp32_check
    name = getattr(cap, "path", cap)
    try:
        rr = replay(cap, model=model, loss_fn=loss_fn, shadow=False, whatif=False, fix_search=False)
        if needs_fp32_check(rr.findings):  # log/div of zeros: were they zeros in fp32 too? (underflow or not)
            rr = replay(cap, model=model, loss_fn=loss_fn, shadow=False, whatif=False, fix_search=True)
    except Exception as e:  # replay is a bonus here; the watch report stands on its own
        if strict:
            raise BadInput(f"replaying {name} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") \
                from None
        warnings.warn(f"ampdoctor: in-process replay of {name} failed ({type(e).__name__}: {e})", RuntimeWarning,
                      stacklevel=4)
        return None
    return rr


def merge_capture_replay(rep: Report, steps: list[StepRecord], model, loss_fn=None, *, strict: bool = False) -> Report:
    """`merge_replay` for any model (e.g. `ampdoctor report RUN_DIR --model pkg.mod:factory`). With `strict`, a
    replay that fails raises (BadInput); otherwise it only warns and the report stands as it was."""
    cap, rr = choose_replay(rep, steps, lambda c: run_replay(c, model, loss_fn, strict=strict))
    return rep if rr is None else fold_replay(rep, steps, cap, rr)


def _of_step(g: Finding, step: int | None) -> bool:
    """The finding `g` covers `step` (its own step, or one of its evidence's steps)."""
    return step is not None and (g.step == step or step in (g.evidence.get("steps") or ()))


def _info_twin(findings: list[Finding], f: Finding, cap_step: int | None, absorbed: bool = False) -> int | None:
    """The index of the info overflow/nan_origin finding that the records made of what the replay's finding `f`
    shows at the captured step: `f`'s phase, at `f`'s module or one enclosing it, covering that step or an earlier
    one (`absorbed`: one judged an absorbed -inf, rules/origins.py)."""
    return next((i for i, g in enumerate(findings) if g.severity == "info" and g.rule in ("overflow", "nan_origin")
                 and g.phase == f.phase and g.module is not None and (not absorbed or g.evidence.get("absorbed"))
                 and (f.module == g.module or f.module.startswith(g.module + "."))
                 and (_of_step(g, cap_step) or cap_step is None or g.step is None or g.step <= cap_step)), None)


def _promoted(f: Finding, g: Finding, cap: str, onset, why: str, **evidence) -> Finding:
    """The replay's finding `f` as the error that replaces the records' info finding `g` (see _info_twin), dated
    from g where f has no step, its message saying `why`."""
    ev = dict(f.evidence, module_level_rule=g.rule, from_replay=cap, rank_hint=13, **evidence)
    msg = f.message.rstrip()
    if why[:2].strip()[:1].isupper() and not msg.endswith((".", "!", "?")):
        msg += "."  # (a sentence follows the op's text, which ends without a full stop)
    return Finding(f.rule, "error", f.phase, f.module, f.op, onset(f.step if f.step is not None else g.step),
                   msg + why, f.fix, ev)


def _skip_explained_by_forward(rr: Report, steps: list[StepRecord], cap: str) -> None:
    """The capture is of a step the scaler skipped at a loss scale that earlier steps had stepped with
    (replaychoice.unexplained_skips), and its replay finds an fp16/bf16 op overflowing from finite inputs in the
    forward whose inf the model then dropped (a ReLU after a convolution on an unnormalised image: the output and
    the loss stayed finite, so the replay alone calls it info). That overflow is the step's failure: the batch drove
    the layer past the dtype's range, and the values that stayed finite drove the gradients past it."""
    rec = next((r for r in steps if r.capture == cap), None)  # (by its capture: a resumed run repeats step numbers)
    if rec is None or not rec.skipped or rec.scale is None:
        return
    ops = (rr.data.get("replay") or {}).get("ops") or []
    for i, f in enumerate(rr.findings):
        ev = f.evidence
        # (not an op at its singular point, a guarded log(0) in the branch a `torch.where` throws away, nor one whose
        # inf its own module absorbed: no gradient goes through those, whatever made the skip)
        op = next((o for o in ops if o.get("module") == f.module and o.get("op") == f.op and o.get("phase") == "forward"
                   and o.get("kind") == "overflow"), None)
        if f.rule == "overflow" and f.severity == "info" and f.phase == "forward" and f.module is not None \
                and ev.get("role") == "origin" and ev.get("out_dtype") in ("float16", "bfloat16") \
                and not ev.get("scaler_search") and op is not None \
                and not op.get("absorbed") and not op.get("in_zeros"):
            rr.findings[i] = Finding(
                f.rule, "error", f.phase, f.module, f.op, f.step if f.step is not None else rec.step,
                f.message + f"; the run skipped step {rec.step} at a loss scale ({rec.scale:g}) that earlier steps had "
                "stepped with: this overflow, not the scaler's search, is why",
                f.fix, dict(ev, rank_hint=13, skip_explained=True))
            return


@dataclass
class _Fold:
    """What folding reads of the replay: the capture `cap` (its step `cap_step`, that step's record `rec`), the
    run's step records, the replay's report `rr`, its op events and its loss-scale search."""
    cap: str
    cap_step: int | None
    steps: list[StepRecord]
    rr: Report
    ops: list = field(default_factory=list)
    search: dict = field(default_factory=dict)

    @property
    def rec(self) -> StepRecord | None:
        return next((r for r in self.steps if self.cap_step is not None and r.step == self.cap_step), None)

    def onset(self, step):
        """A finding the replay confirms at the captured step (first seen on a later sampled step, the capture's
        own step a routine one) dates from that step."""
        cs = self.cap_step
        return cs if cs is not None and step is not None and cs < step else step


def _refine_producers(findings: list[Finding], x: _Fold, by_step: dict) -> set[int]:
    """The op inside each module-level producer, from the replay's op events: each overflow/nan_origin warning or
    error the replay locates is replaced (in place) by its op-level form. Returns the ids of those replaced."""
    steps, cap, cap_step, rr, ops, onset = x.steps, x.cap, x.cap_step, x.rr, x.ops, x.onset
    refined: set[int] = set()
    for i, g in enumerate(findings):
        # a module seen on a later sampled step (evidence.observed_step) went bad on another batch: the replay of
        # the capture of the step itself says which module made the inf/NaN there
        unlocated = bool(g.evidence.get("unlocated")) or (
            g.evidence.get("observed_step") not in (None, g.step) and by_step.get(g.step) == cap)
        if g.rule not in ("overflow", "nan_origin") or g.severity == "info" or (g.module is None and not unlocated):
            continue
        # (an op whose inf a later op absorbed, e.g. a softcap's tanh, made nothing of the step's; an unlocated
        # finding takes the replay's first op of its own phase, else of any)
        # (the root's own finding takes any op only when the capture is of one of its steps: under torch.compile the
        # watch sees the root alone; a root finding of later steps, e.g. NaN from a buffer the captured step
        # poisoned, is another event than the capture's)
        root_here = not g.module and _of_step(g, cap_step)
        # (an op the replay judged absorbed still counts for an unlocated forward failure whose own step's loss or
        # output went non-finite: there it was not absorbed)
        fwd_bad_here = unlocated and g.phase == "forward" and any(
            r.step == g.step and (r.loss_finite is False or r.output_finite is False) for r in steps)
        # (nor an op whose inputs already held inf: it only passed on, or made NaN of, what another op made)
        cands = [o for o in ops if o.get("kind") in ("overflow", "nan_origin") and o.get("module") is not None
                 and (not o.get("absorbed") or fwd_bad_here) and not o.get("in_has_inf")
                 and (unlocated or o["module"] == g.module or bool(g.module) and o["module"].startswith(g.module + ".")
                      or root_here)]
        # (an unlocated forward failure is no backward op's: a loss that went non-finite was made in the forward)
        ev = next((o for o in cands if o.get("phase") == g.phase), None) or (
            next(iter(cands), None) if unlocated and g.phase != "forward" else None)
        if ev is None:
            continue
        rule = "overflow" if ev["kind"] == "overflow" else "nan_origin"
        what = "produced ±inf from finite inputs" if rule == "overflow" else "produced NaN from NaN-free inputs"
        evd = dict(g.evidence, module_level_rule=g.rule, op_line=ev.get("line"), op_out_dtype=ev.get("out_dtype"),
                   from_replay=cap)
        twin = next((f for f in rr.findings if f.module == ev["module"] and f.op == ev.get("op")
                     and f.phase == g.phase and f.rule == rule), None)
        if twin is not None and twin.severity == "info" and g.severity != "info":
            twin = None  # the replay alone judged it benign (its scale search): its words would contradict g's
        msg = twin.message if twin else f"{ev.get('op')} in `{module_label(ev['module'])}` {what} ({ev.get('line')})."
        if twin is not None and twin.evidence.get("also_producers"):  # (further producers of the step: explain.py)
            evd["also_producers"] = twin.evidence["also_producers"]
        evd.pop("unlocated", None)
        findings[i] = Finding(rule, g.severity, ev.get("phase") or g.phase, ev["module"], ev.get("op"), onset(g.step),
                              msg, twin.fix if twin else g.fix, evd)
        refined.add(id(findings[i]))
    return refined


def _fold_findings(findings: list[Finding], refined: set[int], x: _Fold, fwd_bad: bool, any_scale: bool) -> None:
    """The replay's own op-level findings, ranked root cause first, folded into `findings` (in place): each refines
    the first watch finding it matches (the first op-level match per watch finding wins), promotes an info finding
    the replay proves wrong, or is added as what only the replay saw."""
    steps, cap, cap_step, rr, search, onset = x.steps, x.cap, x.cap_step, x.rr, x.search, x.onset
    cap_rec = x.rec
    cap_bad_fwd = cap_rec is not None and (cap_rec.loss_finite is False or cap_rec.output_finite is False)
    for f in rr.findings:
        if f.rule not in _OPLEVEL or f.severity == "info" or f.phase == "optimizer":
            # (optimizer: the captured weights were already non-finite; the run's own records date the update that
            # wrote them, rules/outside.bad_weights)
            continue
        if f.phase == "backward" and fwd_bad:
            continue  # gradients of non-finite activations: consequences of the forward origin
        if any_scale and f.rule in ("overflow", "nan_origin") and f.severity == "error" and f.module is not None:
            # the replay found the captured step non-finite at every loss scale down to 1: what the records took
            # for GradScaler's search (an info finding at this module) is no search
            i = _info_twin(findings, f, cap_step)
            if i is not None:
                findings[i] = _promoted(f, findings[i], cap, onset, " No loss scale makes it finite (the replay "
                                        "tried down to 1).", scaler_search=search)
                refined.add(id(findings[i]))
                no_search(findings, cap_step)  # nor are the skips it caused a normal rate
                continue
        if f.rule in ("overflow", "nan_origin") and f.severity == "error" and f.phase == "forward" \
                and f.module is not None and cap_bad_fwd:
            # the records judged this module's -inf absorbed (info: the later sampled steps' loss stayed finite, a
            # mask's -inf doing what it is for), but the captured step's own loss or output went non-finite and its
            # replay finds the module making it: at that step it was not absorbed
            i = _info_twin(findings, f, cap_step, absorbed=True)
            if i is not None:
                findings[i] = _promoted(f, findings[i], cap, onset, f" (At step {cap_step} the loss or the model's "
                                        "output went non-finite: it was not absorbed there.)")
                refined.add(id(findings[i]))
                continue
        if f.rule in ("overflow", "nan_origin") and f.severity == "error" and f.phase == "forward" \
                and f.module is not None and (f.evidence.get("out_posinf") or f.evidence.get("out_nan")):
            # the records could not locate the captured step's non-finite loss (an unsampled step: "(run)"); the
            # replay finds an op inside the model making +inf/NaN from finite inputs. Where every model output
            # stayed finite, its values reached the loss by another way (a penalty a module keeps as an attribute)
            i = next((k for k, g in enumerate(findings) if id(g) not in refined and g.module is None
                      and g.severity == "error" and g.rule in ("overflow", "nan_origin") and _of_step(g, cap_step)),
                     None)
            if i is not None:
                g = findings[i]
                other_way = "; the model's outputs stayed finite: its inf/NaN reached the loss another way (a value " \
                    "the module keeps, e.g. as an attribute, that the loss reads)"
                ev = dict(g.evidence, **{k: v for k, v in f.evidence.items() if k != "rank_hint"},
                          module_level_rule=g.rule, from_replay=cap)
                outs_finite = cap_rec is not None and cap_rec.output_finite is True
                findings[i] = Finding(f.rule, "error", f.phase, f.module, f.op, onset(g.step),
                                      f.message + (other_way if outs_finite else ""), f.fix, ev)
                refined.add(id(findings[i]))
                continue
        if f.rule in ("overflow", "nan_origin"):
            match = next((g for g in findings if id(g) not in refined and g.rule in ("overflow", "nan_origin")
                          and g.phase == f.phase and g.severity != "info" and g.module is not None
                          and f.module is not None and (f.module == g.module or f.module.startswith(g.module + ".")
                                                        if g.module else _of_step(g, cap_step))), None)
            if match is not None:
                i = findings.index(match)
                ev = dict(match.evidence)
                ev.update({k: v for k, v in f.evidence.items() if k != "rank_hint"})
                ev["module_level_rule"] = match.rule
                findings[i] = Finding(f.rule, match.severity, f.phase, f.module, f.op, onset(match.step), f.message,
                                      f.fix, ev)
                refined.add(id(findings[i]))
                continue
            # weights already non-finite when the captured step ran (not those a later update wrote: the capture
            # holds the step's own weights, so an op the replay saw make inf/NaN from them is the producer)
            bad_weights = {c.module for r in steps if cap_step is None or r.step <= cap_step
                           for c in r.modules if c.par is not None and not c.par.finite}
            if f.module is None or f.module in bad_weights or any(
                    g.rule in ("overflow", "nan_origin") and g.phase == f.phase and g.severity != "info"
                    for g in findings):
                # (non-finite weights from an earlier update are not produced by this op; an info finding, the
                # scaler's search at another step, stands in for nothing the replay proves)
                continue
        if not any(g.rule == f.rule and g.module == f.module for g in findings):
            # a constant the replay found feeding the failure (a -1e9 mask, an eps that is 0 in fp16) is the root
            # cause of the inf/NaN a finding names in the same module: ranked before it
            # (or of a loss that went non-finite outside the model at that step: a row the -1e9 masked entirely)
            cause = f.rule in _CONSTANTS and f.severity == "error" and any(
                g.rule in ("overflow", "nan_origin") and g.severity == "error" and g.phase == f.phase
                and (modules_related(g.module, f.module) or g.module is None and g.step == f.step) for g in findings)
            f.evidence["rank_hint"] = (9 if cause else 13) if f.severity == "error" else f.evidence.get("rank_hint", 30)
            f.evidence["from_replay"] = cap
            if f.step is None:
                f.step = next((g.step for g in findings if g.module == f.module), None)
            findings.append(f)


def _one_per_op(findings: list[Finding]) -> list[Finding]:
    """Two module-level findings refined onto the same op of the same step (a later step's finding re-dated to the
    captured one) say one thing: the first is kept."""
    seen: set = set()
    unique = []
    for f in findings:
        key = (f.rule, f.severity, f.phase, f.module, f.op, f.step)
        if f.op is not None and key in seen:
            continue
        seen.add(key)
        unique.append(f)
    return unique


def fold_replay(rep: Report, steps: list[StepRecord], cap: str, rr: Report) -> Report:
    """Fold the replay `rr` of capture `cap` into `rep` (`rr` itself is left as it was: its findings are copied).
    Into a report with nothing wrong (the replay of an `unexplained_skip`) only the replay's errors go: a step that
    no loss scale makes finite; a gradient spike the scaler handles leaves the report as it was."""
    rr = Report.from_dict(rr.to_dict())
    by_step = {r.step: r.capture for r in steps if r.capture}
    # the replay tells what happened at the capture's step: a finding it confirms there (first seen on a later
    # sampled step, the capture's own step being a routine one) dates from that step, its onset
    cap_step = next((s for s, c in by_step.items() if c == cap), None)
    if cap in unexplained_skips(steps):
        _skip_explained_by_forward(rr, steps, cap)
    if not alarming(rep):
        rr.findings = [f for f in rr.findings if f.severity == "error"]
        if not rr.findings:
            return rep
    findings = list(rep.findings)
    before = [f.module for f in findings]
    x = _Fold(cap, cap_step, steps, rr, (rr.data.get("replay") or {}).get("ops") or [],
              (rr.data.get("replay") or {}).get("scaler_search") or {})
    refined = _refine_producers(findings, x, by_step)
    fwd_bad = any(f.phase == "forward" and f.rule in ("overflow", "nan_origin") for f in rr.findings)
    search = x.search
    # (not when the loss scale collapsed from that step on: finite at a smaller scale, but the run's scaler never
    # settled there, as the records' loss_scale_collapse says; its skips are no search)
    collapsed = any(f.rule == "loss_scale_collapse" and f.severity == "error" and f.step == cap_step for f in findings)
    cap_rec = x.rec
    if search.get("finite_at") is not None and not fwd_bad and cap_step is not None and not collapsed \
            and not applied(cap_rec):
        benign_backward(findings, cap_step, search)
    any_scale = bool(search.get("tried")) and search.get("finite_at") is None and any(
        t.get("scale") == 1.0 and t.get("finite") is False for t in search["tried"])
    _fold_findings(findings, refined, x, fwd_bad, any_scale)
    follow_refined(findings, refined, before)
    if any_scale and any(f.severity == "error" and f.rule in ("overflow", "nan_origin") and f.module is not None
                         and f.evidence.get("from_replay") == cap for f in findings):
        no_search(findings, cap_step)  # (an error the replay added to a report with nothing else wrong, too)
    if not any(o.get("kind") in ("overflow", "nan_origin") for o in x.ops):
        replay_stayed_finite(findings, cap_step)
    rep.findings = rank(_one_per_op(findings))
    if rr.data.get("replay"):
        rep.data["replay"] = rr.data["replay"]
    rep.summary["verdict"] = verdict(rep.findings, rep.summary.get("steps", len(steps)), rep.summary.get("crash"),
                                     benign=rep.summary.get("benign_backoff_steps"))
    return rep
