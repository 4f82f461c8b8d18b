"""DeepSpeed rules: what DeepSpeed's own loss scaler did in a watched run (ampdoctor/integrations/deepspeed.py
records it), joined with the engine's fp16 config — the checks of `ampdoctor doctor --deepspeed`, confirmed or
softened by what the run showed.

- scaler_misorder: the optimizer divides the gradients by a loss scale the backward never applied
  (DeepSpeed 0.19.x, ZeRO stage 0 + fp16: deepspeedai/DeepSpeed#8393).
- skipped_steps: a static `loss_scale` that overflows; DeepSpeed skips those steps and never lowers it.
- loss_scale_collapse: the dynamic scale hit `min_loss_scale` and DeepSpeed stopped the run.
"""
from __future__ import annotations

import math

from ..findings import Finding
from .registry import RuleConfig, RunData, register

_AT_MIN = "Current loss scale already at minimum"


def _boundary(r):
    return next((e for e in r.events if e.kind == "engine.step" and e.extra.get("boundary")), None)


def _where(run: RunData) -> str:
    ds = run.meta.env.get("deepspeed") or {}
    return (f"DeepSpeed {ds.get('version')}, ZeRO stage {ds.get('zero_stage')}, {ds.get('optimizer')}")


def _unapplied(run: RunData) -> list[Finding]:
    pairs = []
    for r in run.steps:
        ev = _boundary(r)
        d = ev.extra.get("ds_scale") if ev is not None else None
        if d and r.scale and math.isfinite(r.scale):
            pairs.append((r, ev, float(d), r.scale))
    off = [p for p in pairs if abs(math.log2(p[2] / p[3])) >= 0.5]
    if not off or len(off) * 2 < len(pairs):
        return []
    r, ev, d, a = off[0]
    bw = next((e for e in r.events if e.kind == "engine.backward"), ev)
    return [Finding(
        "scaler_misorder", "error", "scaler", None, None, r.step,
        f"DeepSpeed's optimizer divides the gradients by its loss scale ({d:g}) but the backward multiplied them by "
        f"{a:g}: the loss was never scaled ({_where(run)}). Every update is {d / a:g}x too small, gradient clipping "
        "and Adam's eps see the wrong magnitude, and fp16 gradients get no protection from underflow.",
        "Use a path whose backward applies the scale: ZeRO stage 1 (`\"zero_optimization\": {\"stage\": 1}`, also on "
        "one GPU), or bf16 (`\"bf16\": {\"enabled\": true}`, no loss scale at all), or a DeepSpeed release with the "
        "fix for stage 0 (deepspeedai/DeepSpeed#8393).",
        {"api": "engine.backward", "ds_scale": d, "applied_scale": a, "steps": len(off), "of_steps": len(pairs), "file": bw.file,
         "line": bw.line, "deepspeed": run.meta.env.get("deepspeed"), "rank_hint": 5})]


def _static(run: RunData, cfg: RuleConfig) -> list[Finding]:
    sc = run.meta.scaler
    if sc.get("dynamic") is not False or not run.steps:
        return []
    steps = run.steps
    skipped = [r for r in steps if r.skipped]
    scale = sc.get("init_scale")
    ev = {"loss_scale": scale, "skipped": len(skipped), "steps": len(steps),
          "skipped_steps": [r.step for r in skipped][:100], "rank_hint": 40}
    if not skipped:
        return [Finding("skipped_steps", "info", "scaler", None, None, None,
                        f"DeepSpeed uses a static loss scale ({scale:g}); it did not overflow in these {len(steps)} "
                        "steps, but it never adapts if the gradients grow.",
                        "Prefer dynamic loss scaling: \"loss_scale\": 0 in the fp16 block.", dict(ev, rank_hint=90))]
    fwd = [r for r in skipped if r.forward_bad]
    prod = next((p for r in skipped for p in (r.forward_producer if r.forward_bad else None, r.backward_producer)
                 if p is not None), None)
    share = len(skipped) / len(steps)
    if fwd and len(fwd) * 2 >= len(skipped):
        msg = (f"DeepSpeed skipped {len(skipped)} of {len(steps)} steps; on {len(fwd)} of them the forward itself "
               "was non-finite, which no loss scale can fix.")
        fix = "Fix the forward inf/NaN (see the overflow/nan_origin finding)."
    else:
        msg = (f"DeepSpeed's static loss_scale {scale:g} overflowed the fp16 gradients on {len(skipped)} of "
               f"{len(steps)} steps ({share:.0%}): DeepSpeed skips every such step and never lowers a static "
               "scale, so those batches train nothing.")
        fix = ("Use dynamic loss scaling (\"fp16\": {\"loss_scale\": 0, \"initial_scale_power\": 16}), or a static "
               f"scale well below {scale:g}.")
    sev = "error" if share >= 0.5 or len(skipped) >= cfg.skipped_min else "warning"
    # the config is the root cause of gradient overflows (named first); a forward inf/NaN is reported elsewhere
    return [Finding("skipped_steps", sev, "scaler", prod.module if prod else None, None, skipped[0].step, msg, fix,
                    dict(ev, share=share, rank_hint=70 if fwd and len(fwd) * 2 >= len(skipped) else 4))]


def _floor(run: RunData, cfg: RuleConfig) -> list[Finding]:
    hit = next(((r, e) for r in run.steps for e in r.events if _AT_MIN in (e.error or "")), None)
    if hit is None:
        return []
    longest = cur = 0
    for r in run.steps:
        cur = cur + 1 if r.skipped else 0
        longest = max(longest, cur)
    if longest >= cfg.collapse_consecutive:
        return []  # scale_timeline reports the collapse, with its cause
    r, e = hit
    mn = run.meta.scaler.get("min_scale")
    return [Finding("loss_scale_collapse", "error", "scaler", None, None, r.step,
                    f"DeepSpeed's loss scale fell to min_loss_scale ({mn}) and the engine stopped the run at "
                    f"{e.file}:{e.line} (\"{_AT_MIN}\"): the gradients are inf/NaN at any scale.",
                    "Find the inf/NaN's producer (the findings above, or `ampdoctor replay` of the capture); a lower "
                    "min_loss_scale would only hide it.",
                    {"api": "engine.step", "min_loss_scale": mn, "error": e.error, "file": e.file, "line": e.line, "rank_hint": 60})]


def _config(run: RunData) -> list[Finding]:
    """`doctor --deepspeed`'s config checks, kept as they are where the run showed skipped steps and softened
    to info where it did not (the static loss scale is _static's)."""
    conf = ((run.meta.env.get("deepspeed") or {}).get("config")) or {}
    if not conf:
        return []
    from ..doctor import check_deepspeed
    try:
        found = check_deepspeed(conf)
    except Exception:
        return []
    skipped = sum(r.skipped for r in run.steps)
    out = []
    for f in found:
        if "loss_scale" in f.evidence:
            continue
        if not skipped and f.severity == "warning":
            f.severity = "info"
            f.message += f" (No step was skipped in this run's {len(run.steps)} steps.)"
        f.evidence.update(from_config=True, run_skipped=skipped)
        out.append(f)
    return out


@register("deepspeed_scaler", emits=("scaler_misorder", "skipped_steps", "loss_scale_collapse"))
def deepspeed_scaler(run: RunData, cfg: RuleConfig) -> list[Finding]:
    if not run.meta.env.get("deepspeed"):
        return []
    return _unapplied(run) + _static(run, cfg) + _floor(run, cfg) + _config(run)
