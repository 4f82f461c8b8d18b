"""update_spike: one optimizer update (or a few, between two sampled steps) multiplied a layer's weights by a
large factor — a learning rate too high for the weights' scale, a missing warmup, clipping off or after step.

Reads ParamStat.weight_norm / weight_norm_after (L2 norms right before and after the update, sampled steps;
ampdoctor/record/params.py). Weights too small to have a meaningful scale (zero-initialised biases, LoRA's B) are
left out: their first updates multiply them by any factor, as designed. A weight first seen at zero has no scale
but the sum of its own updates for its first `_ZERO_GRACE` updates: momentum building up and a warmup ramping the
learning rate multiply that sum by 2-3 per update (a BatchNorm bias under SGD momentum and OneCycle: 0.0009,
0.0021, 0.0045, 0.0123), as designed; the other weights of its layer carry the layer's scale. A factor is taken against the largest norm the weight has
had so far, not only the one right before the update: a weight crossing zero (a regression head's bias marching
from -0.05 to the target's mean at Adam's ±lr per update: 0.0098 -> 0.0197) passes through norms far below its
own scale, and regrowing to it is no spike.
"""
from __future__ import annotations

import bisect
import math

from ..findings import Finding
from ..records import StepRecord
from .registry import RuleConfig, RunData, register
from .backoff import benign_backoff
from .steps import absorbed_modules, real_bad

_MIN_RMS = 1e-3        # weights whose root-mean-square is below this have no scale to spike from
_WINDOW_UPDATES = 50   # between two sampled steps, look only this many updates apart (or at a huge factor)
_HUGE = 1e3
_BROKE = 100.0         # a spike this large followed by skipped steps within _AFTER steps broke the run
_AFTER = 3
_ADAM_MAX_STEP = 4.0   # Adam's per-element step is at most ~lr * (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr
_ZERO_GRACE = 10       # updates a weight first seen at zero takes to have a scale of its own
_FEW = 16              # a parameter of fewer elements (a SkipInit gain, a temperature) crosses zero under ordinary
#                        steps: its first recorded update has no scale to compare with (unless the ratio is huge)


def _lr(run: RunData) -> float | None:
    lrs = [g.get("lr") for g in run.meta.optimizer.get("groups") or [] if isinstance(g.get("lr"), (int, float))]
    return max(lrs) if lrs else None


def _by_updates(run: RunData, growth: float, n_upd: int, numel: int) -> bool:
    """Whether `n_upd` optimizer updates can have grown a weight's norm by `growth`. An Adam-type optimizer moves
    each element by at most a few learning rates per update, so its updates bound the growth; a larger change
    between two sampled steps was made outside the optimizer (the user's code, a checkpoint load) and is not an
    update spike (the overflow it causes is named where it happens)."""
    lr = _lr(run)
    if lr is None or not _adam(run):
        return True
    return growth <= _adam_reach(lr, n_upd, numel)


def _adam(run: RunData) -> bool:
    return "adam" in str(run.meta.optimizer.get("class") or "").lower()


def _adam_reach(lr: float, n_upd: int, numel: int) -> float:
    """The largest L2 norm `n_upd` updates of an Adam-type optimizer at `lr` can add to a weight of `numel`
    elements (each moves every element by at most _ADAM_MAX_STEP learning rates)."""
    return n_upd * _ADAM_MAX_STEP * lr * math.sqrt(max(numel, 1))


def _adam_bound(run: RunData, lr: float | None, n_upd: int, numel: int) -> float | None:
    """The largest L2 norm `n_upd` updates of an Adam-type optimizer can give a weight that started at zero (at the
    larger of the update's and the run's learning rate), or None for other optimizers."""
    lrs = [v for v in (lr, _lr(run)) if isinstance(v, (int, float)) and v > 0]
    if not lrs or not _adam(run):
        return None
    return _adam_reach(max(lrs), n_upd, numel)


def _clipped(r: StepRecord) -> str:
    """'before' when the step clipped gradients before the optimizer step, 'after' if only after, else 'off';
    'unknown' for a routine step kept without its calls (storage thins them) and no clip norm."""
    if not r.events:
        return "before" if r.grad_norm is not None else "unknown"
    kinds = [e.kind for e in r.events if not e.internal]
    step_at = next((i for i, k in enumerate(kinds) if k in ("step", "optimizer.step")), None)
    clips = [i for i, k in enumerate(kinds) if k.startswith("clip_grad")]
    if not clips:
        return "off"
    return "before" if step_at is None or clips[0] < step_at else "after"


def _spike(p, factor: float, before: float, after: float, step: int, span: list, updates: int, rms_before: float,
           **extra) -> dict:
    """One parameter's spike, as _spikes reports it (`extra`: `bound` for a zero-born weight, `before_update`)."""
    return {"name": p.name, "module": p.module, "factor": factor, "before": before, "after": after, "step": step,
            "between": span, "updates": updates, "rms_before": rms_before, "lr": p.lr, **extra}


def _spikes(run: RunData, factor: float, window_factor: float) -> list[dict]:
    """Per parameter: the first window (one update on a sampled step, or the updates between two sampled
    steps) over which its weight norm grew by `factor` (one update) or `window_factor` (several)."""
    updated = {r.step for r in run.steps if not r.skipped}
    order = sorted(updated)

    def between(s0: int, s1: int) -> list[int]:  # the updated steps strictly between two steps (bisect: long runs)
        return order[bisect.bisect_right(order, s0):bisect.bisect_left(order, s1)]
    ref: dict[str, tuple[int, float, int, bool]] = {}  # name -> (step, norm after its update, numel, young then)
    out: dict[str, dict] = {}
    bad_grad: dict[str, list[int]] = {}           # name -> steps whose gradient for it was not finite
    for r in run.steps:
        for p in r.params:
            if p.grad_nonfinite:
                bad_grad.setdefault(p.name, []).append(r.step)
    born_zero: dict[str, int] = {}                # name -> the step it was first seen at zero
    peak: dict[str, float] = {}                   # name -> the largest norm it had before this step
    seen: set[str] = set()
    for r in run.steps:
        for p in r.params:
            if p.weight_norm is None or p.name in out:
                continue
            rms = p.weight_norm / math.sqrt(max(p.numel, 1))
            if p.name not in seen:
                seen.add(p.name)
                if rms < _MIN_RMS:
                    born_zero[p.name] = r.step
            young = p.name in born_zero and len(between(born_zero[p.name] - 1, r.step)) < _ZERO_GRACE
            if young and p.weight_norm_after is not None and r.step in updated and not p.grad_nonfinite:
                n_upd = len(between(born_zero[p.name] - 1, r.step)) + 1
                bound = _adam_bound(run, p.lr, n_upd, p.numel)
                s0 = ref[p.name][0] if p.name in ref else born_zero[p.name]
                if bound and r.step > s0 and p.weight_norm >= _BROKE * bound:
                    # it was already there when this step began: moved between the last look and this step, by
                    # the updates in between or by code outside the optimizer (a write under no_grad)
                    upd = between(s0, r.step)
                    out[p.name] = _spike(p, p.weight_norm / bound, ref[p.name][1] if p.name in ref else 0.0,
                                         p.weight_norm, upd[0] if len(upd) == 1 else s0 + 1, [s0, r.step],
                                         len(upd), rms, bound=bound, before_update=True)
                    continue
                if bound and p.weight_norm_after >= _BROKE * bound:
                    # a zero-born weight has no scale to multiply, but an Adam-type optimizer's own steps bound how
                    # far it can move: far past that, the update was not Adam's ±lr (its second moment underflowed)
                    out[p.name] = _spike(p, p.weight_norm_after / bound, p.weight_norm, p.weight_norm_after,
                                         r.step, [r.step, r.step + 1], 1, rms, bound=bound)
                    continue
            if p.name in ref and not young and not ref[p.name][3]:  # several updates since the last sampled step
                # (not from a norm taken while the weight was still young: a zero-born weight's first updates
                # set its scale, and Adam's ordinary steps from one update's worth read as growth)
                s0, n0, numel, _ = ref[p.name]
                upd = between(s0, r.step)
                n_upd = len(upd)
                f = p.weight_norm / max(n0, peak.get(p.name, 0.0)) if n0 > 0 else 0.0
                rms0 = n0 / math.sqrt(max(numel, 1))
                applied_bad = any(s0 <= b < r.step for b in bad_grad.get(p.name, ()))
                if rms0 >= _MIN_RMS and n_upd and (f >= _HUGE or (f >= window_factor and n_upd <= _WINDOW_UPDATES)) \
                        and _by_updates(run, p.weight_norm - n0, n_upd, numel) and not applied_bad:
                    out[p.name] = _spike(p, f, n0, p.weight_norm, upd[0] if n_upd == 1 else s0 + 1, [s0, r.step],
                                         n_upd, rms0)
                    continue
            # (an update that applied a non-finite gradient is that gradient's consequence: the overflow or
            # nan_origin finding names where it came from)
            if p.weight_norm_after is not None and rms >= _MIN_RMS and r.step in updated and not p.grad_nonfinite \
                    and not young:
                f = p.weight_norm_after / max(p.weight_norm, peak.get(p.name, 0.0))
                if f >= factor and (p.numel >= _FEW or p.name in peak or f >= _HUGE):
                    out[p.name] = {"name": p.name, "module": p.module, "factor": f, "before": p.weight_norm,
                                   "after": p.weight_norm_after, "step": r.step, "between": [r.step, r.step + 1],
                                   "updates": 1, "rms_before": rms, "lr": p.lr}
                    continue
            after = p.weight_norm_after if p.weight_norm_after is not None and r.step in updated else p.weight_norm
            ref[p.name] = (r.step, after, p.numel, young)
            peak[p.name] = max(peak.get(p.name, 0.0), p.weight_norm, after)
    # A bias moving to where the data puts it (a decoder's to the word frequencies, a regression head's to the
    # targets' offset) can double in one update while its layer's weight, which carries the layer's scale, stays:
    # a bias counts only with its weight, or past a huge factor
    weighted = {p.module for r in run.steps for p in r.params
                if p.weight_norm is not None and p.name.rpartition(".")[2] == "weight"}
    spiked = {(s["module"], s["step"]) for s in out.values() if not _is_bias(s["name"])}
    return [s for s in out.values() if not (_is_bias(s["name"]) and s["module"] in weighted and s["factor"] < _HUGE
                                             and (s["module"], s["step"]) not in spiked)]


_SMALL_INIT = 4.0  # a weight this many times below the model's typical rms started small on purpose (see _catching_up)


def _typical_rms(run: RunData) -> float | None:
    """The median root-mean-square of the model's weight matrices (not biases, not a few-element gain) on the first
    step that recorded them: the scale the model's layers have."""
    rec = next((r for r in run.steps if r.params), None)
    if rec is None:
        return None
    v = sorted(p.weight_norm / math.sqrt(p.numel) for p in rec.params
               if p.weight_norm is not None and p.numel >= _FEW and not _is_bias(p.name))
    return v[len(v) // 2] if v else None


def _catching_up(s: dict, typical: float | None) -> bool:
    """A weight initialised far below the model's typical scale on purpose (a policy head at orthogonal gain 0.01,
    a classifier head scaled down) that the run's first update multiplies by a large factor (Adam's first step is
    ±lr per element) while it stays no larger than the model's typical weight: it is reaching the scale the rest of
    the model already has, as designed (the first update only, on a run that never went non-finite; the caller
    asks: a learning-rate jump later in the run is a spike whatever the weight's scale)."""
    if typical is None or not s["before"] or not s["rms_before"]:
        return False
    rms_after = s["after"] * s["rms_before"] / s["before"]
    return s["rms_before"] * _SMALL_INIT <= typical and rms_after <= typical


def _is_bias(name: str) -> bool:
    return name.rpartition(".")[2] == "bias"


@register("update_spike", emits=("update_spike",))
def update_spike(run: RunData, cfg: RuleConfig) -> list[Finding]:
    spikes = _spikes(run, cfg.spike_factor, cfg.spike_window_factor)
    if not spikes:
        return []
    benign = benign_backoff(run.steps, run.has_scaler, growth_factor=run.growth_factor)
    mods = absorbed_modules(run.steps)
    if next((r.step for r in run.steps if real_bad(r, benign, mods)), None) is None:
        typical = _typical_rms(run)
        start = next((r.step for r in run.steps), 0)
        spikes = [s for s in spikes if not (s["step"] == start and _catching_up(s, typical))]
        if not spikes:
            return []
    step = min(s["step"] for s in spikes)
    first = [s for s in spikes if s["step"] == step]
    worst = max(first, key=lambda s: s["factor"])
    layers: dict[str, float] = {}
    for s in sorted(first, key=lambda s: -s["factor"]):
        layers.setdefault(s["module"], s["factor"])
    went_bad = next((r.step for r in run.steps if r.step >= step and real_bad(r, benign, mods)), None)
    if went_bad is None and worst["factor"] >= _BROKE:
        # the weights grew a hundredfold in one window and the scaler skipped right after: those skips are the
        # spike's overflows (a short run's few skips read like its normal search), not a search
        went_bad = next((r.step for r in run.steps if r.skipped and step < r.step <= step + _AFTER), None)
    lr = worst.get("lr") or _lr(run)  # (the update's own where a check recorded it: a scheduler's jump)
    rec = next((r for r in run.steps if r.step == worst["between"][0]), None)
    clip = _clipped(rec) if rec is not None else "off"
    one = worst["updates"] == 1
    names = ", ".join(f"`{m or '(root)'}` ×{f:.3g}" for m, f in list(layers.items())[:4])
    more = f" and {len(layers) - 4} more layer(s)" if len(layers) > 4 else ""
    s0, s1 = worst["between"]
    if worst.get("before_update"):  # (a zero-born weight found moved before its sampled step's own update)
        by = (f"{worst['updates']} optimizer update(s) or code outside the optimizer" if worst["updates"] else
              "code outside the optimizer (no update came in between)")
        when = f"Between step {s0} and step {s1}, {by}"
    elif one:
        when = f"The optimizer update at step {worst['step']}"
    else:
        when = f"The {worst['updates']} optimizer updates between step {s0} and step {s1}"
    msg = (f"{when} multiplied the weights of {names}{more} (‖w‖ {worst['before']:.3g} → {worst['after']:.3g})"
           + (f"; the run went non-finite at step {went_bad}." if went_bad is not None else "."))
    fix = ("Lower the learning rate or add a warmup, e.g. "
           "`sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2000))`; "
           "clip after unscale_ and before step:\n"
           "scaler.unscale_(optimizer)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
           "scaler.step(optimizer)\nscaler.update()")
    causes = []
    adam = _adam(run)
    if worst.get("bound"):  # a zero-born weight moved past what Adam's steps allow (_spikes)
        msg = (f"{when} moved the weights of `{worst['module'] or '(root)'}`, zero-initialised, to ‖w‖ "
               f"{worst['after']:.3g}: {worst['factor']:.3g}× further than an Adam-type optimizer's steps can "
               f"(at most {worst['bound']:.3g} for lr={lr:g})"
               + (f"; the run went non-finite at step {went_bad}." if went_bad is not None else "."))
        causes.append("the optimizer's second moment is 0 where its first moment is not (its state kept in "
                      "fp16/bf16, where g² underflows, or an eps too small for it): the update becomes lr × m / eps")
        if worst.get("before_update"):
            causes.append("code outside the optimizer that wrote the weights (an assignment under no_grad, a "
                          "checkpoint or EMA copy loaded into them)")
        fix = ("Keep the optimizer's state (exp_avg, exp_avg_sq) in float32, or use torch.optim.AdamW, which keeps "
               "it in the parameters' dtype; with low-precision state, raise eps (1e-8 is below fp16's resolution).")
    elif lr is not None and adam:
        ratio = lr / worst["rms_before"] if worst["rms_before"] else math.inf
        causes.append(f"a learning rate too high for these weights (lr={lr:g}; Adam-type optimizers move every "
                      f"weight by about ±lr per update, here {ratio:.3g}× the weights' typical size)")
    elif lr is not None:
        causes.append(f"a learning rate too high for these weights (lr={lr:g}; the update is lr × the gradient)")
    else:
        causes.append("a learning rate too high for these weights")
    if not worst.get("bound"):
        causes.append("no warmup (start from ~1% of the learning rate and ramp up over the first 1-2k steps)")
    if clip != "unknown" and not worst.get("bound"):
        causes.append({"off": "no gradient clipping", "after": "gradient clipping after the optimizer step",
                       "before": "clipping cannot help here: it bounds the gradient, not Adam's ±lr step" if adam
                       else "a clipping threshold too loose for this learning rate (the update is lr × the clipped "
                       "gradient)"}[clip])
    ev = {"factor": worst["factor"], "norm_before": worst["before"], "norm_after": worst["after"],
          "param": worst["name"], "between_steps": worst["between"], "updates": worst["updates"],
          "layers": [[m, f] for m, f in list(layers.items())[:20]], "lr": lr, "clipping": clip,
          "causes": causes, "went_bad_at": went_bad, "rank_hint": 10 if went_bad is not None else 30}
    return [Finding("update_spike", "error" if went_bad is not None else "warning", "optimizer", worst["module"],
                    None, worst["step"], msg + " Usual causes: " + "; ".join(causes) + ".", fix, ev)]
