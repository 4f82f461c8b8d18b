"""A finished step becomes a StepRecord: `finalize` (when the next iteration begins) reads the step's values back
(readback.resolve), judges the scaled losses no backward went through (`unpropagated`), builds the module calls,
parameter statistics and producers, hands the record to the sinks and stores it (storage.py). The transfer that
brings the values to the host is transfer.py's."""
from __future__ import annotations

import math

import torch

from .openstep import StepPhase
from .params import HUGE_GROWTH, MIN_SAMPLED, ROUNDED_SHARE
from .producers import backward_producer, forward_producer
from .series import from_calls
from ..records import ModuleCall, ParamStat, StepRecord, TensorStats
from .stats import combine, integer_input, vector_to_stats
from .storage import folded, store
from .readback import resolve
from .transfer import presync

__all__ = ["finalize", "unpropagated"]


def _weights(module: str, w_bad: dict, m):
    """Whether the module's own weights are finite (None when it has none): non-finite weights come from an
    earlier update, so a module holding them is not the producer of what it outputs."""
    if module not in m.param_modules:
        return None
    bad = w_bad.get(module)
    return TensorStats(dtype="weights", ref="weights", numel=m.param_modules[module],
                       nan=int(bad == "nan"), posinf=int(bad == "inf"))


def _stats_for(c, slot, rows):
    lst = [vector_to_stats(rows[i], dt, ref) for i, dt, ref in c.rows[slot] if i in rows]
    return combine(lst)


def _rounding(upd: dict) -> bool:
    """Whether a module's sampled update elements mostly rounded away (as rules/weights.py update_underflow counts
    them: per module, on MIN_SAMPLED elements or more): ends the every-LOW_CHECK_EVERY checks (params.py)."""
    mods: dict[str, list] = {}
    for name, v in upd.items():
        t = mods.setdefault(name.rpartition(".")[0], [0, 0])
        t[0] += v[0]
        t[1] += v[1]
    return any(n >= MIN_SAMPLED and k >= ROUNDED_SHARE * n for k, n in mods.values())


def unpropagated(st) -> None:
    """The step's scaled losses that no backward went through (`scaler.scale(loss)` as a statement, then
    `loss.backward()`: unscale_ divides gradients that were never scaled): `extra["backward"] = False` on their
    scale() call (rules/callorder.py). Judged when the step ends, after all of its backward passes (an ensemble
    scales every member's loss before the first member's backward and step). Not such a loss: a second scale() of a
    loss whose scaled twin was backpropagated (`scaler.scale(loss).item()` for the logs), nor one that a later
    forward left behind before the step's first unscale_/step (a batch a loss-spike guard dropped)."""
    outs, st.scaled_outs = st.scaled_outs, []
    done = {node for _, ran, node, _ in outs if ran[0] and node is not None}
    for ev, ran, node, micro in outs:
        if ran[0] or node in done or (st.micro_stepped is not None and micro < st.micro_stepped):
            continue
        ev.extra["backward"] = False


def _allreduced(m) -> bool:
    """The watched model is a DistributedDataParallel of several ranks: its parameters' gradients are averaged over
    the ranks after each rank's own backward."""
    return (m.w.meta.world_size or 1) > 1 and isinstance(m.w.model, torch.nn.parallel.DistributedDataParallel)


def _detail(m, st, s: dict, probes: list) -> tuple:
    """A step's module calls, parameter records and producers: (calls, params, forward producer, backward
    producer), from the values its transfer read back (`s`: StepRecord's `synced`)."""
    rows = s["rows"]
    w_bad = s.get("w_bad") or {}
    calls = [ModuleCall(module=c.module, type=c.type, call=c.call, seq=c.seq, depth=c.depth, autocast=c.autocast,
                        inp=_stats_for(c, "inp", rows), par=_weights(c.module, w_bad, m), out=_stats_for(c, "out", rows),
                        gout=_stats_for(c, "gout", rows), gin=_stats_for(c, "gin", rows), bseq=c.bseq,
                        grad_enabled=c.grad_enabled, int_input=integer_input(c.probes, probes)) for c in st.calls]
    parents = {c.seq: c.parent for c in st.calls}
    if st.sampled:
        m.int_watch.learn(st.calls, probes)  # integer ramps among the inputs: probed on routine steps from now on
    upd = {}
    # [rounded away, sampled, norm before, norm after] per parameter (params.UpdateCheck); a skipped step made no
    # update, but its weights as the step found them (the norms before) show an earlier update's blow-up
    skipped = (s["found_inf"] or 0) > 0
    checks, st.upd = st.upd, []
    narrow = {}  # name -> its optimizer state's dtype, where narrower than the parameter's (params.narrow_state)
    for chk in checks:  # (one per optimizer stepped)
        if chk.state:
            narrow.update(chk.state)
        if chk.only_huge:  # (an unfrozen layer's follow-up check: a blow-up only, params.HUGE_GROWTH)
            if not skipped and chk.res is not None:
                upd.update((n, (*r, lr)) for n, r, lr in zip(chk.names, chk.res.tolist(), chk.lrs)
                           if r[2] > 0 and r[3] >= HUGE_GROWTH * r[2])
        elif skipped:
            upd.update({n: (0, 0, v, None, lr) for n, v, lr in zip(chk.names, chk.pre.tolist(), chk.lrs)})
        elif chk.res is not None:
            upd.update((n, (*r, lr)) for n, r, lr in zip(chk.names, chk.res.tolist(), chk.lrs))
    if upd and not skipped and not m.rounding_seen:
        m.rounding_seen = _rounding(upd)
    params = []
    bad_param_modules = set()
    dtypes = m.param_info
    names, g_amax, g_l2 = st.param_names, s["g_amax"], s["g_l2"]
    # a sampled step keeps every parameter, a routine step only those whose gradient was non-finite
    if st.sampled:
        kept = range(len(names))
    else:
        kept = [i for i, v in enumerate(g_amax) if not math.isfinite(v)] if s["grad_finite"] is False else []
    for i in kept:
        name = names[i]
        amax = g_amax[i] if i < len(g_amax) else None
        l2 = g_l2[i] if i < len(g_l2) else None
        nonfin = amax is not None and not math.isfinite(amax)
        mod = name.rpartition(".")[0]
        if nonfin:
            bad_param_modules.add(mod)
        dt, n = dtypes.get(name, ("?", 0))
        if st.sampled and name in m.param_by_name:  # as the step ran (a model .half()'d after the watch began)
            dt = str((st.step_dtypes or {}).get(name) or m.param_by_name[name].dtype).replace("torch.", "")
        u = upd.get(name)
        params.append(ParamStat(name=name, module=mod, dtype=dt, numel=n, grad_norm=l2, grad_absmax=amax,
                                grad_nonfinite=int(nonfin), update_sampled=int(u[1]) if u else 0,
                                update_rounded_away=int(u[0]) if u else 0, sharded=name in m.sharded,
                                weight_norm=u[2] if u else None, weight_norm_after=u[3] if u else None,
                                lr=u[4] if u else None, state_dtype=narrow.get(name),
                                grad_hooked=st.sampled and bool(getattr(m.param_by_name.get(name), "_backward_hooks",
                                                                        None))))
    if upd:  # a routine step that checked its updates (params.update_check_pre), or a parameter whose gradient
        #      is not among the step's (a sparse one): keep what was found
        seen = {p.name for p in params}
        for name, u in upd.items():
            if name not in seen:
                dt, n = dtypes.get(name, ("?", 0))
                params.append(ParamStat(name=name, module=name.rpartition(".")[0], dtype=dt, numel=n,
                                        update_sampled=int(u[1]), update_rounded_away=int(u[0]),
                                        sharded=name in m.sharded, weight_norm=u[2], weight_norm_after=u[3],
                                        lr=u[4], state_dtype=narrow.get(name)))
    fwd = forward_producer(calls, parents) if calls else None
    if bad_param_modules and _allreduced(m) and not any(
            x is not None and not x.finite for c in calls for x in (c.gout, c.gin)):
        # every gradient this rank's backward made was finite: its parameters' gradients turned non-finite in DDP's
        # all-reduce, from another rank (whose record names the producer), not in one of its own modules
        bad_param_modules = set()
    bwd = backward_producer(calls, parents, bad_param_modules) if calls else None
    return calls, params, fwd, bwd


def finalize(m) -> None:
    st = m.st
    if st.phase is StepPhase.OPEN:
        presync(m, None)
    unpropagated(st)
    resolve(m)
    st.advance(StepPhase.FINAL)
    s = st.synced
    probes = s.get("probes") or []
    if st.calls or st.upd or st.sampled or s["grad_finite"] is False:
        calls, params, fwd, bwd = _detail(m, st, s, probes)
    else:  # a routine step: no module calls, no update check, no gradient to keep (the usual case: nothing to build)
        calls, params, fwd, bwd = [], [], None, None
    w_bad = s.get("w_bad") or {}
    losses = s["losses"]
    g_l2 = [v for v in s["g_l2"]]
    gnorm = math.sqrt(sum(v * v for v in g_l2)) if g_l2 else None
    found_inf = s["found_inf"]
    if st.late is not None:  # another optimizer on the same scaler found inf: the scaler backs off
        late = st.late.result().get("found_inf_all", [0.0])[0]
        st.late = None
        if late > 0:
            found_inf = max(found_inf or 0.0, late)
    rec = StepRecord(step=st.step, sampled=st.sampled, loss=losses[-1] if losses else None,
                     loss_finite=all(math.isfinite(v) for v in losses) if losses else None,
                     scale=s["scale"], found_inf=None if found_inf is None else found_inf > 0,
                     skipped=bool(found_inf and found_inf > 0), grad_finite=s["grad_finite"], grad_norm=gnorm,
                     micro_batches=st.micro, discarded=st.discarded, autocast=st.autocast, forward_producer=fwd,
                     backward_producer=bwd,
                     modules=calls if (st.sampled or fwd or bwd) else [], params=params, events=st.events,
                     exception=st.exception, capture=st.capture, output_finite=st.output_finite,
                     loss_ops=st.loss_ops, loss_low=st.loss_low, loss_consts=st.loss_consts, bad_input=st.bad_input,
                     loss_in_model=st.loss_in_model,
                     bad_weights=(w_bad or None) if not st.sampled else None, bad_buffer=st.bad_buffer,
                     outside_updates=st.outside, masters_back=st.masters,
                     int_inputs=m.int_watch.found(st, probes) if st.int_calls else None,
                     headroom=from_calls(calls, m.slot_of_name, m.hr.n, m.hr_skip) if st.sampled else st.headroom)
    if s.get("grads_scaled") and rec.events:
        rec.events[-1].grads_scaled = True
    # the rest of a step a mid-run report finished: one record of the whole step (storage.folded)
    replaces = st.folds and len(m.records) > 0 and m.records[-1].step == rec.step
    if replaces:
        rec = folded(m.records[-1], rec)
    for sink in m.sinks:  # sinks see the full record; storage keeps a slim one for routine steps
        try:
            sink.on_step(m.w.meta, rec)
        except Exception as e:
            import warnings
            warnings.warn(f"ampdoctor: a reporter failed on step {rec.step} ({e}); it is switched off",
                          RuntimeWarning, stacklevel=2)
            m.sinks = [x for x in m.sinks if x is not sink]
    store(m, rec, replace=replaces)
