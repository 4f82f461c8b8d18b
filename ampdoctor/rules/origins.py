"""Where an inf/NaN came from: the `producers` rule (overflow, nan_origin) over the module-level producers of
each bad step; the origins that are not a module's forward or backward (the loss outside the model, the data,
weights an earlier update wrote, a bad step without per-layer statistics) are ampdoctor/rules/outside.py's."""
from __future__ import annotations

from ..findings import Finding
from ..records import ACCUMULATING, ModuleCall, StepRecord
from .registry import RuleConfig, RunData, register
from ..fixes import fp32_snippet
from .backoff import benign_backoff, loop_opening_search
from .steps import absorbed, first_unlocated_skip, onset_step, series_onset
from .outside import absorbed_unsampled, bad_buffers, bad_data, bad_weights, unlocated
from .lossorigin import output_grad_nonfinite, outside_model


def autocast_device(run: RunData) -> str:
    """The autocast device of the run ("cuda" unless it ran on the CPU)."""
    ac = next((r.autocast for r in run.steps if r.autocast), None)
    return ac.split(":")[0] if ac else ("cpu" if (run.meta.env or {}).get("device", "cpu") == "cpu" else "cuda")


def _call(rec: StepRecord, module: str, call: int) -> ModuleCall | None:
    return next((c for c in rec.modules if c.module == module and c.call == call), None)


def where(module: str | None) -> str:
    """A module as a message names it: `name`, `(root)` for the model itself, "outside the model" for None."""
    return "outside the model" if module is None else f"`{module}`" if module else "`(root)`"


def _what_inf(s) -> str:
    """The non-finite values a TensorStats holds, in words: +inf, -inf, ±inf, NaN."""
    if s is None:
        return "inf/NaN"
    if s.posinf and s.neginf:
        return "±inf"
    if s.posinf or s.neginf:
        return "+inf" if s.posinf else "-inf"
    return "NaN" if s.nan else "inf/NaN"


def _evidence(c: ModuleCall | None, phase: str, rec: StepRecord) -> dict:
    ev: dict = {"call": c.call if c else None, "type": c.type if c else None}
    if c is None:
        return ev
    a, b = (c.inp, c.out) if phase == "forward" else (c.gout, c.gin)
    if a is not None:
        ev["absmax_in"] = a.absmax
        ev["nonfinite_in"] = a.nonfinite
    if b is not None:
        ev["absmax_out_finite"] = b.absmax
        ev.update({"nan_out": b.nan, "posinf_out": b.posinf, "neginf_out": b.neginf, "numel_out": b.numel,
                   "dtype_out": b.dtype, "ref": b.ref})
    if c.autocast:
        ev["autocast"] = c.autocast
    if phase == "backward" and rec.scale:
        ev["loss_scale"] = rec.scale
    return ev


def _inside(module: str, name: str) -> bool:
    return name != module and (module == "" or name.startswith(module + "."))


def _kind(r: StepRecord, p) -> str:
    """The producer's kind, 'nan' read as 'inf' where the NaN was made from an inf this module itself made: a
    module inside it already received ±inf (forward: as an input; backward: as its incoming gradient), e.g. a
    custom autograd Function's backward overflowing before a Linear's backward turned the inf into inf - inf."""
    if p.kind != "nan" or p.module is None:
        return p.kind
    for c in r.modules:
        if _inside(p.module, c.module):
            s = c.inp if p.phase == "forward" else c.gout
            if s is not None and (s.posinf or s.neginf):
                return "inf"
    return p.kind


SETTLED = 5
"""Clean applied steps between GradScaler's search and a module's next backward overflow that make that overflow a
failure of its own, not the one the search began in (as record/autocapture.py captures a skip that comes back)."""


def _clean_between(steps, recs: list[StepRecord], step: int) -> int:
    """The applied steps without inf/NaN after the group's last record before `step` and before `step`."""
    last = max((r.step for r in recs if r.step < step), default=-1)
    return sum(1 for r in steps if last < r.step < step and not r.skipped and not r.bad)


@register("producers", emits=("overflow", "nan_origin"))
def producers(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """The first inf/NaN producer of each bad step, grouped by (phase, module, kind)."""
    groups: dict[tuple, list[StepRecord]] = {}
    for r in run.steps:
        for p in (r.forward_producer, r.backward_producer):
            if p is None or (p.phase == "backward" and (r.loss_finite is False or r.output_finite is False
                                                        or output_grad_nonfinite(r))):
                continue  # the backward of a non-finite loss/output/output gradient: a consequence
            groups.setdefault((p.phase, p.module, _kind(r, p)), []).append(r)
    # NaN in the backward from a module whose backward made inf at or before that step: inf - inf / 0 * inf of
    # its own overflow, the same cause (one finding, not an overflow and a later nan_origin)
    for (phase, module, kind) in [k for k in groups if k[2] == "nan" and k[0] == "backward"]:
        inf = groups.get((phase, module, "inf"))
        if inf and inf[0].step <= groups[(phase, module, kind)][0].step:
            del groups[(phase, module, kind)]
    out = []
    outside = outside_model(run)
    benign = benign_backoff(run.steps, run.has_scaler, growth_factor=run.growth_factor)
    by_loop = loop_opening_search(run.steps, run.has_scaler)
    benign |= by_loop
    dev = autocast_device(run)
    slots = {m[0]: i for i, m in enumerate(run.meta.modules or []) if m}
    for (phase, module, kind), recs in groups.items():
        if phase == "forward" and all(r.bad_input and _fed_nonfinite(r, r.forward_producer) for r in recs):
            continue  # the batch brought the inf (bad_data says so): this module only made NaN of it (inf - inf)
        if phase == "backward":
            # the same module's overflow during GradScaler's search (the opening backoffs) and again later, after
            # the run had trained cleanly for a while, where no search explains it: the failure is dated, described
            # and judged from its own steps (a fault present from the first step, which the search happened to
            # cover, keeps its first step)
            own = [r for r in recs if r.step not in benign]
            if own and len(own) < len(recs) and _clean_between(run.steps, recs, own[0].step) >= SETTLED:
                recs = own
        r0 = recs[0]
        p = r0.forward_producer if phase == "forward" else r0.backward_producer
        c = _call(r0, module, p.call)
        steps = [r.step for r in recs]
        rule = "overflow" if kind == "inf" else "nan_origin"
        if kind == "nan" and phase == "forward" and c is not None and c.type in ACCUMULATING \
                and c.inp is not None and c.inp.finite:
            rule = "overflow"  # a matmul/conv of finite values makes NaN only as inf - inf: its sums overflowed
        ev = _evidence(c, phase, r0)
        ev.update({"steps": steps[:50], "occurrences": len(steps), "rank_hint": 10 if phase == "forward" else 12})
        step = onset_step(run.steps, r0.step, phase)  # the first bad step, when only the trip-wire saw it
        if phase == "backward" and kind == "inf" and step == r0.step and r0.step not in benign:
            step = first_unlocated_skip(run.steps, step, benign)  # skips that began before the follow-ups
        if phase == "forward" and step == r0.step and module in slots:
            step = series_onset(run.steps, slots[module], kind, step)  # the always-on series saw it begin earlier
        if step != r0.step:
            ev["observed_step"] = r0.step
        at = where(module)
        typ = c.type if c else p.detail.get("type", "?")
        vals = _what_inf(c.out if c and phase == "forward" else c.gin if c else None)
        if kind == "inf" and vals == "NaN":
            vals = "±inf (NaN by the time it left)"
        if vals == "inf/NaN":
            vals = "±inf" if kind == "inf" else "NaN"
        sev = "error"
        if phase == "forward" and (absorbed(recs) or p.detail.get("mask_like") and outside):
            sev = "info"
            ev["rank_hint"] = 40
            ev["absorbed"] = True
            msg = (f"{at} ({typ}) emits {'-inf' if p.detail.get('mask_like') else vals} "
                   f"from finite inputs (first at step {r0.step}), but later ops absorb it: the loss and the "
                   "outputs stayed finite" + (" — an additive -inf mask before a softmax does this "
                                                        "by design." if p.detail.get("mask_like") else "."))
            fix = ("Nothing to do while the loss stays finite. A row that is masked entirely turns softmax into NaN; "
                   "a large finite negative value representable in the dtype (torch.finfo(dtype).min) avoids that.")
        elif phase == "backward" and all(s in benign for s in steps):
            sev = "info"
            ev["rank_hint"] = 40
            ev["benign_backoff"] = True
            msg = (f"The loss-scaled backward overflowed in {at} on {len(steps)} step(s) while the loss scale was "
                   "high; GradScaler skipped them and lowered the scale, as designed." if not by_loop else
                   f"The backward overflowed in {at} at step {step} on iterations the loop then threw away without "
                   "an optimizer step (its own loss scale searching down from a high start): the update that came "
                   "had finite gradients.")
            fix = "Nothing to do: a few skipped steps while the loss scale settles are normal."
        elif phase == "forward":
            what = (f"turned finite inputs into {vals}" if kind == "inf" else
                    "produced NaN from finite inputs — its sums of products overflowed (inf - inf = NaN)"
                    if rule == "overflow" else "produced NaN from NaN-free inputs")
            seen = f" (seen on sampled step {r0.step})" if step != r0.step else ""
            msg = (f"{at} ({typ}) {what} in the forward pass at step {step}{seen}"
                   f"{' (' + c.autocast + ' autocast)' if c and c.autocast else ''}; everything after it only "
                   "passed the non-finite values on.")
            fix = ("Keep this module in fp32 or rescale before the operation that overflows, e.g.\n"
                   + fp32_snippet(module, dev)
                   + ("\nRun `ampdoctor replay` on the capture to see the exact op."
                      if any(r.capture for r in run.steps)
                      else "\nTo see the exact op, save a failing batch (`ampdoctor.save_batch`) and replay it.")
                   + " bf16 has fp32's range.")
        else:
            what = f"turned a finite incoming gradient into {vals}" if kind == "inf" else \
                "produced NaN gradients from a NaN-free incoming gradient"
            msg = (f"In the backward pass {at} ({typ}) {what} at step {step}"
                   f"{', on every step' if len(steps) > 2 else ''}; the forward was finite.")
            fix = ("Find the op whose derivative is unbounded here (log/log1p/sqrt/div/pow near 0, norms of tiny "
                   "vectors) and guard it with an epsilon representable in the working dtype, or run the module "
                   "in fp32:\n" + fp32_snippet(module, dev))
        out.append(Finding(rule, sev, phase, module, None, step, msg, fix, ev))
    out.extend(outside)
    data = bad_data(run, dev)
    out.extend(data)
    if not groups and not out:
        out.extend(bad_weights(run) or unlocated(run))
    else:
        # the run first went non-finite on a step without per-layer statistics, before anything located (a later,
        # separate failure that a sampled step caught), or where nothing else is an error (only GradScaler's first
        # search at step 0, an info): that first step is said too, to be replayed
        located = _first_error(out)
        u = unlocated(run)
        if u and (located is None or u[0].step < located):
            out.extend(u)
    # a buffer turned non-finite before any error above (or with none: silent) is where it began
    first = _first_error(out)
    out.extend(f for f in bad_buffers(run) if first is None or f.step < first)
    out.extend(absorbed_unsampled(run, {k[1] for k in groups if k[0] == "forward"}, dev))
    return out


def _fed_nonfinite(r: StepRecord, p) -> bool:
    """The producer's call received ±inf (or NaN) in its input on step `r`; True when the step has no call to tell
    by (a routine step)."""
    c = _call(r, p.module, p.call) if p is not None else None
    return c is None or c.inp is None or not c.inp.finite


def _first_error(findings: list[Finding]) -> int | None:
    """The earliest step of an error finding (None: none has a step)."""
    return min((f.step for f in findings if f.severity == "error" and f.step is not None), default=None)
