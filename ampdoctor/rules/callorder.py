"""The order of the GradScaler / optimizer / zero_grad calls in the recorded sequence: scaler_misorder and
missing_scaler_update (`call_order`), from each call's kind, optimizer, the error GradScaler raised and what
the recorder noted on it (a backward after unscale_, a closure, ...). What came between two calls is asked of
rules/callseq.py's queries."""
from __future__ import annotations

from ..findings import Finding
from .registry import RuleConfig, RunData, register
from .scaler import ORDER, _loc, _seq
from .callseq import (_NO_INF, _backward_after_unscale, _guards_direct_steps, _no_inf_follows, _other_step_after,
                      _stepped_again, _stepped_later, _unscaled_since_update, _updated_in_repeat, _updated_later,
                      _zeroed_after_backward, _zeroed_between_backwards)

_UNSCALE_TWICE = "unscale_() has already been called"
_STEP_TWICE = "step() has already been called since the last update()"
_CLOSURE = "Closure use is not currently supported"
_NO_SCALE = "but _scale is None"  # GradScaler's unscale_/step/update before any scale() of this scaler
_STEPS = ("step", "optimizer.step")  # between two unscale_s: a zero_grad, or a step and then a `scale`, is a new
#  iteration (a `scale` alone is another micro-batch of the same one: gradient accumulation; a step alone, the same
#  iteration unscaling again after its step)


def _unscaled_in_step(e) -> bool:
    """An unscale_ call made inside scaler.step() that raised because that step had unscaled its optimizer."""
    return e.internal and e.kind == "unscale_" and _UNSCALE_TWICE in (e.error or "")


def _dropped_after_inf(since_update: list, z, e, rec) -> bool:
    """The zero_grad `z` came after this optimizer's unscale_ and the scaler then skipped the step: the unscale_
    had found inf/NaN and recorded it, so `scaler.step` skips whatever the gradients hold (a wrapper that drops
    non-finite gradients after its clip loses nothing)."""
    if e.kind != "step" or rec is None or not rec.skipped:
        return False
    before = since_update[:since_update.index(z)]
    return any(p.kind == "unscale_" and (p.opt is None or p.opt == e.opt) for p in before)


@register("call_order", emits=("scaler_misorder", "missing_scaler_update"))
def call_order(run: RunData, cfg: RuleConfig) -> list[Finding]:
    if not run.has_scaler and not any(e.kind in ("scale", "unscale_", "update") for r in run.steps for e in r.events):
        return []
    out: list[Finding] = []
    # (GradScaler's own calls inside scaler.step are left out; an unscale_ that raised 'already been called' inside
    # scaler.step is no GradScaler's own, which runs only on an optimizer not unscaled yet: a user's, from an optimizer
    # step hook or the optimizer's own step())
    events = [e for r in run.steps for e in r.events if not e.internal or _unscaled_in_step(e)]
    first_scale = next((k for k, e in enumerate(events) if e.kind == "scale"), None)  # (_stepped_again)
    guarded = _guards_direct_steps(run.steps)  # direct optimizer steps after unscale_ that skip on inf themselves
    steps = {r.step: r for r in run.steps}

    def add(rule, e, msg, fix, extra=None):
        if any(f.rule == rule for f in out):
            return
        r = steps.get(e.step)
        seq = _seq(r.events) if r else []
        out.append(Finding(rule, "error", "scaler", None, None, e.step, msg, fix, dict({
                           "api": f"GradScaler.{e.kind}" if "." not in e.kind else e.kind,
                           "file": e.file, "line": e.line, "sequence": seq,
                                                   "error": e.error, "rank_hint": 4}, **(extra or {}))))

    enabled = (run.meta.scaler or {}).get("enabled", True) is not False
    last_update = None  # index of the latest update() before events[i]
    accum = []  # (zero_grads inside the accumulation loop, the unscale_/step they precede): _zeroed_between_backwards
    for i, e in enumerate(events):
        if i and events[i - 1].kind == "update":
            last_update = i - 1
        prev = events[:i]
        since_update = []
        for p in reversed(prev):
            if p.kind == "update":
                break
            if p.kind in ("step", "optimizer.step") and p.error:
                continue  # a step that raised (a transient failure the loop retries) stepped nothing
            # unscale_/step of another optimizer sharing the scaler: one step each, one update, is the
            # documented multi-optimizer pattern
            if p.kind in ("unscale_", "step") and p.opt != e.opt and e.kind in ("unscale_", "step"):
                continue
            since_update.append(p)
        since_update.reverse()
        if e.kind in ("unscale_", "step") and (zs := _zeroed_between_backwards(
                since_update, e, getattr(steps.get(e.step), "micro_batches", 0))):
            accum.append((zs, e))
        if _NO_SCALE in (e.error or ""):
            add("scaler_misorder", e, f"`scaler.{e.kind}()` at {_loc(e)} found no loss scale (GradScaler asserts "
                "'_scale is None'): the loss was backpropagated without `scaler.scale(loss)` (e.g. `loss.backward()` "
                "where the framework expects `accelerator.backward(loss)` / `self.manual_backward(loss)`), so the "
                "fp16 gradients had no protection from underflow and the scaler cannot unscale or skip them.",
                "Backpropagate the scaled loss — `scaler.scale(loss).backward()`, or the framework's own "
                "backward (`accelerator.backward(loss)`, Lightning's `self.manual_backward(loss)`):\n" + ORDER)
        elif e.kind == "update" and e.extra.get("in_step"):
            add("scaler_misorder", e, f"`scaler.update()` at {_loc(e)} ran inside `scaler.step()` (from an optimizer "
                "step hook, or the optimizer's own step()): on a step GradScaler skips (inf/NaN gradients) the "
                "optimizer's step and its hooks never run, so the scale is not lowered and the next `unscale_` "
                "raises; before the optimizer's step it clears the inf checks, so an `update()` after the step "
                "finds none.", "Call `scaler.update()` once per iteration in the loop, after `scaler.step()`; a "
                "hook inside the step may read `scaler.get_scale()`, not update it:\n" + ORDER)
        elif e.kind in ("unscale_", "step") and not e.error and enabled and last_update is not None and \
                not e.extra.get("adopted") and \
                first_scale is not None and first_scale < last_update and _unscaled_since_update(since_update) \
                and not _no_inf_follows(events, i):
            after = not since_update  # right after update(): a logging block at the end of the loop body
            add("scaler_misorder", e, f"`scaler.{e.kind}()` at {_loc(e)} ran with no `scaler.scale(loss)` since "
                f"`scaler.update()` at {_loc(events[last_update])}" + (
                    ": it unscales the gradients the last step already applied, and leaves the optimizer marked "
                    "as unscaled, so the next `scaler.step()` applies the next iteration's gradients still "
                    "multiplied by the loss scale (or the next `unscale_()` raises)." if after and e.kind == "unscale_"
                    else ": this iteration's backward ran on the raw loss, so `scaler.step()` divides gradients that "
                    "were never multiplied by the scale — every update is that many times too small, and fp16 "
                    "gradients get no protection from underflow."),
                "Scale every backward and unscale only between it and the step (read a gradient norm for the logs "
                "before `scaler.update()`, from the unscaled gradients):\n" + ORDER)
        elif e.kind == "step" and e.extra.get("unscaled_twice"):
            u = next((p for p in reversed(since_update) if p.kind == "unscale_"), None) or next(
                (p for p in reversed(prev) if p.kind == "unscale_"), e)
            add("scaler_misorder", e, f"`scaler.step()` at {_loc(e)} unscales gradients that `scaler.unscale_()` at "
                f"{_loc(u)} already unscaled through another optimizer object holding the same parameters (a "
                "wrapper such as Lookahead and the optimizer inside it): GradScaler tracks them as two optimizers, so "
                "the update uses gradients divided by the loss scale twice and the model barely moves.",
                "Call `scaler.unscale_()` and `scaler.step()` on the same object (the wrapper the loop steps):\n"
                + ORDER)
        elif e.kind == "step" and (_CLOSURE in (e.error or "") or e.extra.get("closure")):
            add("scaler_misorder", e, f"`scaler.step(optimizer, closure)` at {_loc(e)}: GradScaler does not support "
                "closures (given as `closure=` it raises 'Closure use is not currently supported'; given positionally "
                "it passes it on to optimizer.step, which re-runs the forward and the scaled backward after unscale_ "
                "and its inf check: the update uses gradients still multiplied by the loss scale).",
                "Run the forward and `scaler.scale(loss).backward()` yourself, then `scaler.step(optimizer)` "
                "without the closure:\n" + ORDER)
        elif e.kind in ("unscale_", "step") and (z := _zeroed_after_backward(since_update, e)) is not None \
                and not _dropped_after_inf(since_update, z, e, steps.get(e.step)):
            lost = (" (set to None: GradScaler asserts No inf checks were recorded for this optimizer)"
                    if _NO_INF in (e.error or "") else ", so it applies zero gradients and the model does not learn")
            add("scaler_misorder", z, f"`zero_grad()` at {_loc(z)} ran between the scaled backward and "
                f"`scaler.{e.kind}()` at {_loc(e)}: the iteration's gradients are discarded before the step{lost}.",
                "Zero the gradients at the start of the iteration (or after `scaler.update()`), never between "
                "the backward and the step:\n" + ORDER)
        elif e.kind == "step" and _NO_INF in (e.error or ""):
            add("scaler_misorder", e, f"`scaler.step()` at {_loc(e)} found no gradients to check (GradScaler "
                "asserts 'No inf checks were recorded for this optimizer'): no scaled backward reached this "
                "optimizer's parameters in this iteration, or their gradients were cleared before the step.",
                "Backpropagate `scaler.scale(loss)` into the optimizer's parameters before `scaler.step()`, and zero "
                "the gradients only at the start of an iteration:\n" + ORDER)
        elif e.kind == "update" and (_NO_INF in (e.error or "") or not any(p.kind == "step" for p in since_update)):
            # unscale_ recorded this iteration's inf checks and no step follows: the loop skipped the step itself
            # (a non-finite gradient norm) and lets the scaler back off, which GradScaler supports
            skipped_on_purpose = any(p.kind == "unscale_" for p in since_update) and not _stepped_later(events, i)
            twice = i > 0 and events[i - 1].kind == "update" and not since_update
            if twice:
                add("scaler_misorder", e, f"`scaler.update()` at {_loc(e)} ran a second time right after "
                    f"`scaler.update()` at {_loc(events[i - 1])}: the second one has no inf checks of its own "
                    "(GradScaler asserts 'No inf checks').", "Call update() once per iteration, after step() (a helper "
                    "that already updates needs no second call):\n" + ORDER)
            elif not skipped_on_purpose and any(p.kind == "scale" for p in since_update) or _NO_INF in (e.error or ""):
                add("scaler_misorder", e, f"`scaler.update()` at {_loc(e)} ran before `scaler.step()` in this "
                    "iteration: the scale is adjusted from stale inf checks (GradScaler asserts 'No inf checks').",
                    "Call update() after step():\n" + ORDER)
        elif _unscaled_in_step(e):
            add("scaler_misorder", e, f"`scaler.unscale_()` at {_loc(e)} ran inside `scaler.step()` (from an "
                "optimizer step hook, or the optimizer's own step()), after `scaler.step()` had already unscaled "
                "this optimizer's gradients: GradScaler raises 'unscale_() has already been called', and the step "
                "raised with it.", "Unscale once, before `scaler.step()`; inside the step the gradients are already "
                "unscaled, so a hook there can read them (e.g. their norm) without calling unscale_:\n" + ORDER)
        elif e.kind == "unscale_" and (_UNSCALE_TWICE in (e.error or "") or
                                        any(p.kind == "unscale_" for p in since_update)):
            first_u = next((k for k, p in enumerate(since_update) if p.kind == "unscale_"), len(since_update))
            if last_update is not None and _unscaled_since_update(since_update[:first_u]):
                continue  # the earlier unscale_ came with no scale() after an update(): named above, at that call
            # after the first unscale_: a zero_grad, or a step followed by the next backward's scale, began a new
            # iteration (its update() is missing); a step right before this unscale_ is the same iteration's
            new_iter = stepped = seen_unscale = False
            for p in since_update:
                if p.kind == "unscale_":
                    seen_unscale = True
                elif seen_unscale and p.kind == "zero_grad" or stepped and p.kind == "scale":
                    new_iter = True
                elif seen_unscale and p.kind in _STEPS:
                    stepped = True
            if stepped and not new_iter:
                add("scaler_misorder", e, f"`scaler.unscale_()` at {_loc(e)} ran after `scaler.step()` in the same "
                    "iteration (GradScaler raises 'unscale_() is being called after step()'); after step() the "
                    "gradients are already unscaled.", "Unscale before step, once; read the norm after step() without "
                    "a second unscale_:\n" + ORDER)
            elif new_iter:
                # dated at the iteration that lacked its update: its scaler.step (the unscale_ that fails is the
                # next iteration's)
                ended = next((p for p in reversed(since_update) if p.kind == "step" and p.opt == e.opt), e)
                add("missing_scaler_update", ended, f"An iteration ended without `scaler.update()` (e.g. update "
                    f"skipped together with a skipped step){f' after `scaler.step()` at {_loc(ended)}' if ended is not e else ''}; "
                    f"the next `unscale_` at {_loc(e)} fails.",
                    "Call `scaler.update()` once every iteration, also when you skip the optimizer step:\n" + ORDER)
            else:
                micro = any(p.kind == "scale" for p in since_update[[p.kind for p in since_update].index("unscale_"):])
                add("scaler_misorder", e, f"`scaler.unscale_()` was called twice in one iteration (again at "
                    f"{_loc(e)}{', after another micro-batch: unscale once per optimizer step, after the last one' if micro else ''}); "
                    "the second call is an error and would divide the gradients twice.",
                    "Call unscale_ once per iteration, right before clipping; libraries such as Trainer/"
                    "Accelerate already do it:\n" + ORDER)
        elif e.kind == "step" and (_STEP_TWICE in (e.error or "") or any(p.kind == "step" for p in since_update)):
            # dated at the iteration that lacked its update: its scaler.step (the step that fails is the next one's)
            # (only when a new iteration began between the two: a second step in the same iteration is the misuse)
            ended = next((p for p in reversed(since_update) if p.kind == "step" and p.opt == e.opt), e)
            if ended is not e and not any(p.kind in ("scale", "zero_grad")   # (since_update: newest first)
                                          for p in since_update[:since_update.index(ended)]):
                ended = e
            add("missing_scaler_update", ended, f"`scaler.step()` at {_loc(e)} ran again without `scaler.update()` "
                f"since the previous step{f' (at {_loc(ended)}, step {ended.step})' if ended is not e else ''}: the "
                "scale never adapts and GradScaler raises.",
                "Call `scaler.update()` after every `scaler.step()`:\n" + ORDER)
        elif e.kind == "update" and (o := _other_step_after(events, i, since_update)) is not None:
            add("scaler_misorder", e, f"`scaler.update()` at {_loc(e)} ran between two optimizers' steps of one "
                f"iteration (`scaler.step()` again at {_loc(o)}, with no new scaled backward between): the second "
                "optimizer is unscaled with the new scale, not the one its gradients were scaled by, and the "
                "scale's growth counts the iteration twice.",
                "Step every optimizer first, then call `scaler.update()` once (torch's AMP recipe for several "
                "optimizers):\nfor opt in optimizers:\n    scaler.step(opt)\nscaler.update()")
        elif e.kind == "step" and e.extra.get("grads_after_unscale") and _backward_after_unscale(
                since_update, e.opt) is not None:
            u = _backward_after_unscale(since_update, e.opt)
            add("scaler_misorder", u, f"`scaler.unscale_()` at {_loc(u)} ran before the iteration's last "
                f"`scaler.scale(loss).backward()` (a gradient-accumulation boundary off by one?): the gradients "
                f"accumulated after it are still multiplied by the loss scale, and `scaler.step()` at {_loc(e)} "
                "applies them without dividing: the update is up to scale x too large, and the inf check ran "
                "before those gradients existed.",
                "Unscale once per optimizer step, after the last micro-batch's backward:\n" + ORDER)
        elif e.kind == "unscale_" and any(p.kind == "step" for p in since_update):
            add("scaler_misorder", e, f"`scaler.unscale_()` at {_loc(e)} ran after `scaler.step()`.",
                "Unscale before step:\n" + ORDER)
        elif e.kind in ("unscale_", "step") and e.extra.get("stale_grads") and not e.internal:
            add("scaler_misorder", e, f"The gradients were not zeroed after the previous `scaler.step()`: this "
                f"iteration's scaled backward added onto gradients that step had already unscaled, and "
                f"`scaler.{e.kind}()` at {_loc(e)} divides them by the loss scale again, so what the earlier "
                "micro-batches contributed shrinks by the scale (a gradient-accumulation loop that steps every "
                "micro-batch but zeroes only every k-th?).",
                "Zero the gradients after every optimizer step, or step only at the accumulation boundary:\n"
                + ORDER)
        elif e.kind == "scale" and e.extra.get("scaled_twice"):
            add("scaler_misorder", e, f"`scaler.scale()` at {_loc(e)} scaled a loss that `scaler.scale()` had already "
                "scaled: the gradients are multiplied by the loss scale twice and `unscale_` divides once, so every "
                "update is scale× too large (and the first steps overflow until the scale has fallen to its square "
                "root).", "Scale the loss once: `scaler.scale(loss).backward()` (a helper that scales inside must get "
                "the raw loss):\n" + ORDER)
        elif e.kind == "scale" and e.extra.get("backward") is False and any(
                p.kind in ("unscale_", "step") and p.step == e.step for p in events[i + 1:]):
            add("scaler_misorder", e, f"The scaled loss `scaler.scale(loss)` at {_loc(e)} was never "
                "backpropagated: the backward ran on the unscaled loss, and `unscale_`/`step` then divide those "
                "gradients by the loss scale — every update is that many times too small, and fp16 gradients get "
                "no protection from underflow.",
                "Backpropagate the scaled loss: `scaler.scale(loss).backward()`:\n" + ORDER)
        elif e.kind == "optimizer.step" and (again := _stepped_again(events, i, first_scale)) is not None:
            add("scaler_misorder", e, (f"`optimizer.step()` at {_loc(e)} ran after `scaler.step()` at {_loc(again)} "
                "on the same gradients: GradScaler skipped that step (its gradients held inf/NaN) and this call "
                "applied them anyway, so the weights take the inf/NaN; on steps the scaler does not skip it applies "
                "every update twice." if again.kind == "step" else
                f"`optimizer.step()` ran twice in one iteration on the same gradients (first "
                f"at {_loc(again)}{' through scaler.step()' if again.via_scaler else ''}, again at {_loc(e)}), with no "
                "backward between them: every update is applied twice, the second time on gradients a second "
                "GradScaler divided again, or without the scaler's inf check."),
                "Step each optimizer once per iteration through one GradScaler: backpropagate every loss through "
                "the same scaler (`scaler.scale(l_main + l_aux).backward()`), then one `scaler.step(optimizer)` and "
                "one `scaler.update()`:\n" + ORDER, {"first_step_line": again.line})
        elif e.kind == "optimizer.step" and not e.scaled and not e.via_scaler and any(
                p.kind == "unscale_" for p in since_update) and not any(p.kind == "step" for p in since_update) \
                and not guarded:
            add("scaler_misorder", e, f"`optimizer.step()` at {_loc(e)} was called directly after "
                "`scaler.unscale_()`: GradScaler's inf check is bypassed, so a step whose gradients hold inf/NaN "
                "is applied to the weights instead of skipped.",
                "Use `scaler.step(optimizer)` after unscale_ (it skips the step when unscale_ found inf/NaN):\n"
                + ORDER)
        elif e.kind == "optimizer.step" and e.scaled and not e.via_scaler:
            add("scaler_misorder", e, f"`optimizer.step()` at {_loc(e)} was called directly on gradients still "
                "multiplied by the loss scale: the update is scale× too large and inf steps are not skipped.",
                "Use `scaler.step(optimizer)` instead of `optimizer.step()`:\n" + ORDER)
    hit = {e.step for _, e in accum}
    if len(hit) >= 2 or any(k + 1 in steps and not steps[k + 1].events for k in hit):
        # on step after step (a routine step keeps no events: it repeated the sequence of the step before): the
        # loop's own shape. Once, before the first step, is a dry run: a batch-size finder's backwards, each
        # followed by zero_grad
        zs, e = accum[0]
        add("scaler_misorder", zs[0], f"`zero_grad()` at {_loc(zs[0])} runs between the scaled backwards of one "
            f"optimizer step ({len(zs)} times before `scaler.{e.kind}()` at {_loc(e)}, and so on every step): each "
            "clears the gradients the micro-batches before it accumulated, so the step applies the last micro-batch's "
            f"gradient alone and {len(zs)} of {len(zs) + 1} micro-batches are thrown away.",
            "Zero the gradients once per optimizer step, before the first micro-batch (or after `scaler.update()`), "
            "not inside the accumulation loop:\n" + ORDER)
    # a step with scaler.step but no update before the next iteration, without an exception
    if not any(f.rule == "missing_scaler_update" for f in out):
        last = run.steps[-1].step if run.steps else None
        for i, e in enumerate(events):
            if e.kind == "step" and not e.error and e.step != last and not _updated_later(events, i) \
                    and not _updated_in_repeat(steps, e):
                add("missing_scaler_update", e, f"Step {e.step} called `scaler.step()` at {_loc(e)} but never "
                    "`scaler.update()`: the loss scale cannot adapt.", "Call `scaler.update()` every iteration:\n"
                    + ORDER)
                break
    return out
