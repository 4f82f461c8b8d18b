"""Rule clip_before_unscale: the gradients read while still multiplied by the loss scale. A clipping call (or a norm
read) before unscale_, a gradient penalty built from a scaled loss's gradients that were never divided by the scale,
and value clamps in gradient hooks, which run inside the scaled backward. The scale timeline's rules stay in
scaler.py, whose recipe (ORDER) the fixes quote.
"""
from __future__ import annotations

import math

from ..findings import Finding
from ..records import CallEvent
from .registry import RuleConfig, RunData, register
from .scaler import ORDER, _loc, _seq


@register("clip_before_unscale", emits=("clip_before_unscale",))
def clip_before_unscale(run: RunData, cfg: RuleConfig) -> list[Finding]:
    hits = [(r, e) for r in run.steps for e in r.events if e.reads_norm()
            and e.scaled]
    if not hits:
        return _penalty_scaled(run) or _hook_clamped(run)
    r, e = hits[0]
    # the first call on scaled gradients is where unscale_ belongs; a clip in the same step makes it an error
    # (get_total_norm, then clip_grads_with_norm_ with that norm)
    # (a clip_grad_norm_ with max_norm=inf clips nothing: a norm read for the logs, as get_total_norm)
    clip = e if _clips(e) else next((h for rr, h in hits if rr.step == r.step and _clips(h)), None)
    clipping = clip is not None
    norm = e.total_norm
    then = f"; `{clip.kind}` at {_loc(clip)} then clipped with it" if clipping and clip is not e else ""
    n_steps = len({rr.step for rr, _ in hits})
    seen = f"{n_steps} step(s)" + (f", {len(hits)} calls" if len(hits) > n_steps else "")
    # the step never reached an optimizer step over several iterations: the loop acted on the scaled norm by
    # skipping them (a spike guard), and training stopped there (record/stepends.py keeps such a step)
    stopped = r.micro_batches > 1 and not any(x.kind in ("step", "optimizer.step") for x in r.events)
    harm = ('the scaled norm was clipped, so the real update is shrunk by ~the scale factor' if clipping
            else 'the norm it read is scale× too large')
    if stopped:
        harm += (f"; from step {r.step} on the loop stepped no optimizer in its last {r.micro_batches} iterations "
                 "(a guard that skips on a large norm skips them all: training stopped there)")
    msg = f"`{e.kind}` at {_loc(e)} ran on gradients still multiplied by the loss scale ({r.scale:g}){then} — " \
          f"{harm} (seen on {seen})."
    ev = {"api": f"torch.nn.utils.{e.kind}", "file": e.file, "line": e.line, "stage": e.stage, "loss_scale": r.scale,
          "norm_seen": norm, "norm_unscaled_estimate": norm / r.scale if norm and r.scale else None, "calls": len(hits),
          "sequence": _seq(r.events), "rank_hint": 3}
    return [Finding("clip_before_unscale", "error" if clipping or stopped else "warning", "optimizer", None, None,
                    r.step, msg, "Call `scaler.unscale_(optimizer)` before clipping:\n" + ORDER, ev)]


def _penalty_scaled(run: RunData) -> list[Finding]:
    """A gradient penalty from the scaled loss's gradients (`torch.autograd.grad(scaler.scale(loss), ...,
    create_graph=True)`) never divided by the scale: the loss built from them was scaled again and the iteration
    never read `scaler.get_scale()` (monitorsink: `penalty_scaled`)."""
    hit = next(((r, e) for r in run.steps for e in r.events if e.kind == "scale" and e.extra.get("penalty_scaled")),
               None)
    if hit is None:
        return []
    r, e = hit
    return [Finding(
        "clip_before_unscale", "error", "optimizer", None, None, r.step,
        f"The gradients of a scaled loss were taken with create_graph (a gradient penalty) and used while still "
        f"multiplied by the loss scale{f' ({r.scale:g})' if r.scale else ''}: the iteration never read the scale "
        f"to divide them before "
        f"`scaler.scale()` at {_loc(e)} scaled the loss built from them, so the penalty is scale² too large (a "
        "norm read while scaled, as in clipping before unscale_).",
        "Unscale the penalty's gradients by hand (torch's AMP recipe for gradient penalties):\n"
        "scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)\n"
        "inv_scale = 1.0 / scaler.get_scale()\n"
        "grads = [g * inv_scale for g in scaled]\n"
        "penalty = sum(g.pow(2).sum() for g in grads)\n"
        "scaler.scale(loss + lam * penalty).backward()",
        {"api": "torch.autograd.grad", "file": e.file, "line": e.line, "loss_scale": r.scale,
         "sequence": _seq(r.events), "penalty": True, "rank_hint": 3})]


HOOK_CLAMP_SPREAD = 1e-3
"""Relative spread within which the hooked parameters' largest scaled gradients count as one clamp bound."""


def _round(x: float) -> bool:
    """A number as a person writes it (three significant digits at most: 0.5, 1, 5e-3, 512), in fp32."""
    return x > 0 and abs(x - float(f"{x:.3g}")) <= 1e-6 * x


def _hook_clamped(run: RunData) -> list[Finding]:
    """Gradients clamped during the scaled backward or after it, before unscale_: on a sampled step, parameters whose
    largest gradient after unscale_, times the loss scale, is one value c (their gradients were cut at c while
    multiplied by the scale, so at c / scale really), and c is a round number where c / scale is not (the bound the
    user wrote, not one divided by the scale). Two or more hooked parameters (ParamStat.grad_hooked:
    `p.register_hook(lambda g: g.clamp(-c, c))`) and half of the hooked ones; else three or more parameters and half
    of all (an in-place `p.grad.clamp_(-c, c)` before `scaler.step`, the DQN tutorial's)."""
    if not run.has_scaler:
        return []
    for r in run.steps:
        if not r.sampled or not r.scale or r.scale <= 1 or r.skipped:
            continue
        for hooked in (True, False):
            least = 2 if hooked else 3
            tops = [(p.name, p.grad_absmax * r.scale) for p in r.params if (p.grad_hooked or not hooked)
                    and p.grad_absmax is not None and 0 < p.grad_absmax < math.inf]
            if len(tops) < least:
                continue
            c = max(v for _, v in tops)
            at = [n for n, v in tops if v >= c * (1 - HOOK_CLAMP_SPREAD)]
            if len(at) < least or len(at) * 2 < len(tops) or not _round(c) or _round(c / r.scale):
                continue  # (a bound the user wrote is a round number: one that is round only after unscale_ is a
                #            clamp that divides its bound by the scale, as it should)
            return [_clamped(r, at, tops, c, hooked)]
    return []


def _clamped(r, at: list, tops: list, c: float, hooked: bool) -> Finding:
    where = ("Hooks on the parameters' gradients (`register_hook`) clamp them inside the scaled backward" if hooked
             else "The gradients were clamped while still multiplied by the loss scale (e.g. `p.grad.clamp_(-c, c)` "
             "between the scaled backward and `scaler.step()`, before unscale_)")
    what = "hooked parameters" if hooked else "parameters with gradients"
    return Finding(
        "clip_before_unscale", "error", "optimizer", None, None, r.step,
        f"{where}: after unscale_, the largest gradient of {len(at)} of the {len(tops)} {what} is the same value, "
        f"{c / r.scale:.3g} = {c:.4g} / the loss scale {r.scale:g}. "
        + (f"A hook runs before unscale_, on gradients still multiplied by the scale, so a clamp at {c:.4g} "
           if hooked else f"Before unscale_ the gradients are multiplied by the scale, so a clamp at {c:.4g} ")
        + f"really cuts every gradient at {c / r.scale:.3g}.",
        ("Clip after unscale_ instead of in gradient hooks:\n" if hooked else "Unscale before clamping:\n")
        + ORDER.replace("clip_grad_norm_(model.parameters(), max_norm)",
                        "clip_grad_value_(model.parameters(), clip_value)")
        + ("\n(or divide the bound by `scaler.get_scale()` inside the hook)" if hooked else ""),
        {"api": "torch.Tensor.register_hook" if hooked else "torch.Tensor.clamp_", "params": at[:20],
         "bound_scaled": c, "bound_real": c / r.scale, "loss_scale": r.scale,
         ("hooked" if hooked else "with_grads"): len(tops), "rank_hint": 3})


def _clips(e: CallEvent) -> bool:
    return e.kind.startswith("clip_grad") and e.extra.get("max_norm") != math.inf
