"""Queries over a recorded call sequence (the CallEvents of a run, in order, or those since the last update()):
what came between two calls of the GradScaler / optimizer / zero_grad. rules/callorder.py's `call_order` asks them
to tell a misordered loop from a correct one; each is a pure function of the events it is given."""
from __future__ import annotations

import dataclasses

from ..records import CallEvent

_NO_INF = "No inf checks were recorded"  # GradScaler's error at a step() no unscale_ found an inf check for


def _unscaled_since_update(since_update: list[CallEvent]) -> bool:
    """No loss was scaled (and no optimizer unscaled or stepped) in these events since the last update()."""
    return not any(p.kind in ("scale", "unscale_", "step", "optimizer.step") for p in since_update)


def _no_inf_follows(events: list[CallEvent], i: int) -> bool:
    """The iteration's scaler.step after `events[i]` found no inf checks (no backward reached the optimizer at all:
    that branch names it)."""
    for p in events[i:]:
        if p.kind == "step" and _NO_INF in (p.error or ""):
            return True
        if p.kind in ("update", "scale", "zero_grad") and p is not events[i]:
            return False
    return False


def _zeroed_after_backward(since_update: list[CallEvent], e: CallEvent) -> CallEvent | None:
    """This optimizer's `zero_grad` after the iteration's last scaled backward and before `e` (its unscale_ or
    step), when one came after a `scale`: the gradients the step was to apply were cleared (before its unscale_,
    or between the unscale_ and the step: `unscale_` -> clip -> `zero_grad` -> `step`)."""
    last_scale = max((i for i, p in enumerate(since_update) if p.kind == "scale"), default=None)
    if last_scale is None:
        return None
    for p in since_update[last_scale + 1:]:
        if p.kind == "zero_grad" and (p.opt is None or e.opt is None or p.opt == e.opt) \
                and not p.extra.get("refilled"):
            # (refilled: the loop wrote the gradients again before the step, a meta-learning loop assigning
            # `.grad` from autograd.grad, whose scaled "backward" wrote none)
            return p
        if p.kind == "step" and p.opt == e.opt:
            return None  # (this optimizer already stepped: a zero_grad after it is the next iteration's)
    return None


ACCUM_ZEROED_MIN = 2
"""zero_grads between the scaled backwards of one step that make it gradient accumulation thrown away: two or more
(three micro-batches, each with its own forward). One is a deliberate pattern: an adversarial step (FGSM: a
backward for the input's gradient, zero_grad, the real backward), SAM's two passes."""


def _zeroed_between_backwards(since_update: list[CallEvent], e: CallEvent, micro: int) -> list[CallEvent]:
    """This optimizer's `zero_grad`s that each came after a scaled backward and before the next one, in an iteration
    of at least ACCUM_ZEROED_MIN + 1 micro-batches (forwards of the model) ending at `e` (its unscale_ or step):
    a zero_grad inside the accumulation loop. Empty when fewer."""
    out, seen_scale = [], False
    for p in since_update:
        if p.kind == "scale":
            seen_scale = True
        elif p.kind == "zero_grad" and seen_scale and (p.opt is None or e.opt is None or p.opt == e.opt):
            out.append(p)
            seen_scale = False
        elif p.kind in ("step", "optimizer.step") and p.opt == e.opt:
            return []  # (stepped in between: separate iterations)
    if not seen_scale or len(out) < ACCUM_ZEROED_MIN or micro < len(out) + 1:
        return []  # (the last zero_grad must be followed by a backward: else _zeroed_after_backward's case)
    return out


def _stepped_again(events: list[CallEvent], i: int, first_scale: int | None) -> CallEvent | None:
    """The earlier `optimizer.step` of the same optimizer as `events[i]` with no scaled backward or zero_grad between
    them (an update() between them does not count): the same gradients stepped twice (one GradScaler per loss, each
    stepping the one optimizer; `scaler.step(opt)` then `opt.step()`; a helper's step + update and the loop's again),
    or the `scaler.step(opt)` that skipped them (inf/NaN) before a direct `opt.step()` applied them.
    Only in a loop that scales its losses: one whose scaler is off may backpropagate the raw loss and zero the
    gradients through the module (neither is a recorded call): `first_scale`, the index of the run's first scale."""
    e = events[i]
    if e.opt is None:
        return None
    for j in range(i - 1, -1, -1):
        p = events[j]
        if p.kind in ("scale", "zero_grad"):
            return None
        if p.opt == e.opt and not p.error and (p.kind == "optimizer.step" or p.kind == "step" and not e.via_scaler):
            # (a `scaler.step` of the optimizer with no optimizer step after it: GradScaler skipped it, inf/NaN)
            return p if first_scale is not None and first_scale < j else None
    return None


def _other_step_after(events: list[CallEvent], i: int, since_update: list[CallEvent]) -> CallEvent | None:
    """The scaler.step of another optimizer that follows the update `events[i]` before any new scaled backward
    (scale) or zero_grad, when this iteration already stepped one: an update() inside `for opt in opts:`."""
    stepped = {p.opt for p in since_update if p.kind == "step" and not p.error}
    if not stepped:
        return None
    for p in events[i + 1:]:
        if p.kind in ("scale", "zero_grad", "update") or p.extra.get("adopted"):
            return None  # (adopted: a GradScaler found at this call, whose scale() of the iteration ran unseen)
        if p.kind == "step" and p.opt is not None and p.opt not in stepped:
            return p
    return None


def _backward_after_unscale(since_update: list[CallEvent], opt) -> CallEvent | None:
    """This optimizer's `unscale_` among the events since the last update, when a scaled loss was backpropagated
    after it (a `scale` whose backward ran; the step found the optimizer's gradients written since, see
    record/monitorsink.py): the unscale_ that came too early; None otherwise."""
    u = None
    for p in since_update:
        if p.kind == "unscale_" and p.opt == opt:
            u = p
        elif p.kind == "scale" and u is not None and p.extra.get("backward") is not False:
            return u
    return None


def _stepped_later(events: list[CallEvent], i: int) -> bool:
    """A scaler or optimizer step follows the update `events[i]` before the next iteration begins (its scale or
    zero_grad): an update before the step, not an iteration whose step was skipped."""
    for p in events[i + 1:]:
        if p.kind in ("step", "optimizer.step"):
            return True
        if p.kind in ("scale", "zero_grad"):
            return False
    return False


def _updated_in_repeat(steps: dict, e: CallEvent) -> bool:
    """The record after scaler.step `e`'s has no events because its calls repeated those of `e`'s record (a routine
    step, record/storage.py keeps no repeated sequence): the iteration went on as that record's calls do, so an
    `update()` is looked for there (`_updated_later` over e's record followed by a copy of it one step on). A GAN
    watched at its discriminator ends each record at the discriminator's step, and the generator's step and the one
    update of the iteration begin the next record."""
    rec, nxt = steps.get(e.step), steps.get(e.step + 1)
    if rec is None or nxt is None or nxt.events or nxt.sampled:
        return False
    evs = [x for x in rec.events if not x.internal]
    i = next((k for k, x in enumerate(evs) if x is e), None)
    if i is None:
        return False
    return _updated_later(evs + [dataclasses.replace(x, step=x.step + 1) for x in evs], i)


def _updated_later(events: list[CallEvent], i: int) -> bool:
    """An `update()` follows the scaler.step `events[i]` in its iteration: in its own step record, or in a later
    one after another optimizer's scaler.step. A GAN steps its discriminator's optimizer, runs the generator's
    backward and steps the other optimizer on the same scaler, then updates once (torch AMP docs, multiple
    optimizers: update() once, after all of them stepped); the watch starts a new step record at each optimizer
    step, so the update lands in the next record. An update before the next scale() is this iteration's too (a
    zero_grad between step and update begins the next record). The same optimizer unscaling or stepping again
    first: missing."""
    e = events[i]
    other = False
    scaled = False  # a scale() came since: the next iteration's backward has begun
    for j in range(i + 1, len(events)):
        p = events[j]
        if p.kind == "update":
            # before the next scale(), an update is this iteration's wherever its record begins (a zero_grad
            # between step and update, or an update deferred to the top of the next iteration, starts the next
            # record first: StepMachine.begin)
            return p.step == e.step or other or not scaled
        if p.kind in ("step", "unscale_") and p.opt == e.opt:
            return False
        if p.kind == "step" or p.kind == "optimizer.step" and not p.via_scaler and p.opt != e.opt:
            other = True  # (another optimizer stepped directly is its own misuse: scaler_misorder names it)
        elif p.kind == "scale":
            scaled = True
    return False


def _guards_direct_steps(steps) -> bool:
    """The loop steps the optimizer itself after `unscale_` and leaves that step out when unscale_ found inf/NaN (a
    finite-norm guard: `if math.isfinite(norm): optimizer.step()`, then `update()`), as `scaler.step()` would: some
    step whose unscale_ found inf has no optimizer step at all, and none that found inf stepped directly."""
    guarded = False
    for r in steps:
        if not r.found_inf:
            continue
        evs = [e for e in r.events if not e.internal]
        if not any(e.kind == "unscale_" for e in evs):
            continue
        if any(e.kind == "optimizer.step" and not e.via_scaler for e in evs):
            return False  # inf/NaN gradients were stepped on: no guard
        if not any(e.kind == "step" for e in evs):
            guarded = True
    return guarded
