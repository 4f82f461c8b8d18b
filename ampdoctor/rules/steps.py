"""One definition per idea over a run's StepRecords, shared by the rules, the summary and the panels (analysis/):
forward inf/NaN that later ops absorbed, the first step that went bad for a real reason (not GradScaler's search:
rules/backoff.py), the step where a failure happened when only the trip-wire saw it, and a recorded crash.

Pure functions of records; no import of anything above `records` (rules and analysis both import this).
"""
from __future__ import annotations

from ..fixes import modules_related
from ..records import ModuleCall, StepRecord
from .backoff import benign_backoff

__all__ = ["absorbed", "absorbed_modules", "real_bad", "real_bad_steps", "first_bad_step", "onset_step", "first_unlocated_skip",
           "series_onset", "crash", "unfinished", "parents", "descendants"]


def absorbed(recs: list[StepRecord]) -> bool:
    """Non-finite forward values that never reached the loss or the outputs: no step of the group had a
    non-finite loss, output or crash, and either the values were only -inf (a mask: what the backward does is
    the backward's business), or at least one step was stepped with finite gradients, or every step's skip had a
    backward producer of its own elsewhere."""
    if any(r.loss_finite is False or r.output_finite is False or r.exception for r in recs):
        return False
    if all(not r.forward_bad for r in recs):  # only -inf (a mask), and the forward ended finite
        return True
    if any(not r.skipped and r.grad_finite is not False and (r.loss_finite or r.output_finite) for r in recs):
        return True
    # every step was skipped, each for a backward producer elsewhere (a module the forward producer's gradient
    # passed through finite: its own backward took the inf in stride), e.g. a softcap's tanh absorbing lm_head's inf
    # while a norm's backward overflowed further down
    return all(r.skipped and r.backward_producer is not None and r.forward_producer is not None
               and r.backward_producer.module is not None and r.forward_producer.module is not None
               and not modules_related(r.backward_producer.module, r.forward_producer.module) for r in recs)


def absorbed_modules(steps: list[StepRecord]) -> set[str]:
    """Modules whose forward inf/NaN (every step it was their first producer) later ops absorbed."""
    by: dict[str, list[StepRecord]] = {}
    for r in steps:
        if r.forward_producer is not None:
            by.setdefault(r.forward_producer.module, []).append(r)
    return {m for m, recs in by.items() if absorbed(recs)}


def real_bad(r: StepRecord, benign: set[int], absorbed_mods: set[str]) -> bool:
    """The step went bad for a reason other than GradScaler's benign backoff or an absorbed forward inf (a mask)."""
    p = r.forward_producer
    if r.step in benign and not r.exception and r.output_finite is not False \
            and (p is None or p.detail.get("mask_like")):
        return False  # a loss the scale made non-finite in the search (scaled_loss_steps; benign_backoff has them)
    if r.loss_finite is False or r.output_finite is False or r.exception:
        return True
    if p is not None and not p.detail.get("mask_like") and p.module not in absorbed_mods:
        return True
    backward = r.skipped or r.grad_finite is False or r.backward_producer is not None
    return bool(backward) and r.step not in benign


def real_bad_steps(steps: list[StepRecord], has_scaler: bool, growth_factor: float | None = None):
    """The steps that went bad for a real reason (`real_bad`), in order, as a generator."""
    benign = benign_backoff(steps, has_scaler, growth_factor=growth_factor)
    mods = absorbed_modules(steps)
    return (r for r in steps if real_bad(r, benign, mods))


def first_bad_step(steps: list[StepRecord], has_scaler: bool, growth_factor: float | None = None) -> int | None:
    return next((r.step for r in real_bad_steps(steps, has_scaler, growth_factor)), None)


def onset_step(steps: list[StepRecord], observed: int, phase: str) -> int:
    """The step where a failure seen at sampled step `observed` began: walking back over the unsampled steps
    just before it that only the trip-wire saw going bad the same way (forward: loss/output non-finite or a
    crash; backward: skipped or non-finite gradients with a finite forward)."""
    by = {r.step: r for r in steps}
    k = observed
    while k - 1 in by:
        r = by[k - 1]
        if r.sampled and r.modules:
            break
        fwd = r.loss_finite is False or r.output_finite is False or bool(r.exception)
        bwd = (r.skipped or r.grad_finite is False) and not fwd
        if not (fwd if phase == "forward" else bwd):
            break
        k -= 1
    return k


def series_onset(steps: list[StepRecord], slot: int, kind: str, located: int) -> int:
    """A forward failure of the module at `slot` (RunMeta.modules) located on sampled step `located`: the run's first
    step whose forward went bad, when it came earlier on a routine step and that step's always-on headroom series saw
    this module's output go non-finite first, the same way (`first_bad` of StepRecord.headroom; `kind` "inf" or
    "nan"), with nothing else located or brought by the data: the same producer, dated where it began (finite steps
    may lie between: a batch that overflows, then one that does not). `located` otherwise."""
    for r in steps:
        if r.step >= located:
            return located
        p = r.forward_producer
        if p is not None and not p.detail.get("mask_like"):
            return located  # located on a step of its own
        if not r.forward_bad:
            continue
        h = r.headroom or {}
        fwd = h.get("fwd") or ()
        if r.modules or r.bad_input or r.bad_weights or h.get("first_bad") != slot or slot >= len(fwd):
            return located
        v = fwd[slot]
        if not isinstance(v, (int, float)) or (v != v) != (kind == "nan"):
            return located
        return r.step
    return located


def first_unlocated_skip(steps: list[StepRecord], located: int, benign: set[int]) -> int:
    """A backward overflow first located at step `located`: the run's first step skipped for its backward (finite
    forward) if it came earlier with no per-layer statistics, the scaler's backoff made the steps after it healthy
    (so the follow-ups saw nothing), and nothing else was located in between — the same producer, dated where the
    skips began. `located` otherwise (or when a located step or a forward failure came first)."""
    first = None
    for r in steps:
        if r.step >= located:
            break
        if r.forward_producer is not None or r.backward_producer is not None:
            return located
        if r.loss_finite is False or r.output_finite is False or r.exception:
            return located
        if (r.skipped or r.grad_finite is False) and r.step not in benign:
            if r.sampled and r.modules:
                return located  # a sampled skip that located nothing: not this producer's
            if first is None:
                first = r.step
    return first if first is not None else located


def unfinished(meta, steps: list[StepRecord], running: bool | None) -> dict | None:
    """A run read back from its directory whose watch never closed (`RunMeta.closed` False: no end line) and whose
    process is not running (`running`: False, or None when that cannot be told, e.g. another host): it was killed
    (SIGKILL, the OOM killer, a lost node, os._exit) after its last recorded step. Described like a crash."""
    if getattr(meta, "closed", None) is not False or running is True:
        return None
    last = steps[-1].step if steps else 0
    host = meta.process.get("host") if isinstance(meta.process, dict) else None
    msg = ("the training process ended without closing the watch (killed: SIGKILL, the OOM killer, a lost node, "
           f"os._exit) after step {last}; nothing after it was recorded" if running is False else
           f"the watch was never closed: the run was killed after step {last}, or it is still running "
           f"on {host or 'another host'}")
    return {"step": last, "type": "Killed" if running is False else "Unfinished", "message": msg, "module": None,
            "file": None, "line": None}


def crash(steps: list[StepRecord]) -> dict | None:
    """The exception that ended the run: the last recorded step carries one that the script did not catch."""
    if not steps or not steps[-1].exception or steps[-1].exception.get("caught"):
        return None
    e = steps[-1].exception
    return {"step": steps[-1].step, "type": e.get("type"), "message": e.get("message"), "module": e.get("module"),
            "file": e.get("file"), "line": e.get("line")}


def parents(calls: list[ModuleCall]) -> dict[int, int | None]:
    """seq -> seq of the enclosing call, rebuilt from forward (pre-)order and depth."""
    out: dict[int, int | None] = {}
    stack: list[ModuleCall] = []
    for c in sorted(calls, key=lambda c: c.seq):
        while stack and stack[-1].depth >= c.depth:
            stack.pop()
        out[c.seq] = stack[-1].seq if stack else None
        stack.append(c)
    return out


def descendants(calls: list[ModuleCall], c: ModuleCall, par: dict[int, int | None]) -> list[ModuleCall]:
    """The calls that ran inside call `c`."""
    out = []
    for d in calls:
        p = par.get(d.seq)
        while p is not None and p != c.seq:
            p = par.get(p)
        if p == c.seq:
            out.append(d)
    return out
