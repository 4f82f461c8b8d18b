"""The once-per-step transfer of an open step's values to the host, and what is decided on reading them.

`presync` runs just before the optimizer step (or when the scaler skipped it, or when no step came): it
gathers the loss, the scale, found_inf, gradient norms and every statistic vector the hooks queued, moves
them to the host in one transfer per device (ampdoctor/record/hostcopy.py; the step is STAGED); `resolve` reads
them and asks the machine's CapturePolicy whether the step is worth a capture (ampdoctor/record/autocapture.py).
Turning the step into a StepRecord is record/assemble.py's (`finalize`); what is measured about the parameters is
ampdoctor/record/params.py.
"""
from __future__ import annotations

import functools
import math

import torch

from .autocapture import maybe_capture
from .gradexits import loss_ops
from .hostcopy import Pending
from .openstep import StepPhase
from .params import amax_and_l2, checked_weights, model_grads, norms, weight_amax
from ..tensors import nonfinite_input
from .stats import NSTAT

__all__ = ["presync", "presync_more", "stage_rows", "resolve", "found_inf_all"]


def _cuda_scaler(scaler) -> bool:
    """A CUDA GradScaler on a machine with CUDA: the step's values are read later, without a synchronisation of their
    own (also when it is disabled, e.g. `GradScaler(enabled=False)` for bf16). On a machine without CUDA
    (`torch.cuda.amp.GradScaler()` there is disabled, the model on the CPU) they are read now, before the optimizer
    step changes the weights the CPU checks read (presync's `w_deferred`)."""
    return scaler is not None and getattr(scaler, "_device", "") == "cuda" and _cuda_here()


@functools.cache
def _cuda_here() -> bool:
    """torch.cuda.is_available(), asked once (it is read every step)."""
    return torch.cuda.is_available()


def found_inf_all(m) -> None:
    """At scaler.update() with several optimizers on one scaler: whether any of them found inf this iteration
    (presync ran at the first scaler.step and saw only that optimizer's). Queued like presync's values."""
    states = getattr(m.w.scaler, "_per_optimizer_states", None)
    if m.st.phase is StepPhase.OPEN or not states or len(states) < 2:
        return
    fi = [v.detach().double().reshape(()) for s in states.values() for v in s.get("found_inf_per_device", {}).values()]
    if fi:
        m.st.late = Pending([("found_inf_all", torch.stack(fi).sum())],
                             _cuda_scaler(m.w.scaler), slots=m.host_slots,
                             slot=("late", m.st.step & 1))


def presync(m, opt, grads_scaled: bool = False, early: bool = False) -> None:
    """Queue the open step's values for its one transfer (Pending), just before its optimizer step. `early`: from
    scaler.step() before GradScaler's synchronisation (monitorsink.stage_early: a routine step whose gradients
    unscale_ already checked), while the device still works through the backward, not after it, when the device
    waits for the host; its found_inf is staged and read like any value (the scaler may still skip)."""
    st = m.st
    st.regions = None  # the backward is done: the walked autograd nodes need not stay referenced
    st.scaled_node = None  # (nor the scaled loss's node: its graph holds the module hooks, and they the machine)
    if st.phase is not StepPhase.OPEN:
        return
    parts: list[tuple[str, torch.Tensor]] = []
    # few kernels on routine steps: no per-value conversions (torch.cat promotes to the widest dtype)
    if st.losses:
        parts.append(("loss", st.losses[0].reshape(-1) if len(st.losses) == 1 else
                      torch.cat([x.reshape(-1) for x in st.losses])))
    if st.scale_t is not None:
        parts.append(("scale", st.scale_t))
    # the sums of each micro-batch's outputs (non-finite iff an output value was): concatenated with the rest
    parts += [("out_ok", t) for sums, _ in st.out_ok for t in sums]
    if isinstance(st.found_inf_t, torch.Tensor):
        parts.append(("found_inf", st.found_inf_t))
    via_scaler = early or st.in_scaler_step > 0
    need_grad_check = st.sampled or m.w.scaler is None or not via_scaler
    if st.grad_parts is not None:  # measured right after unscale_ (already unscaled)
        st.param_names, amax, l2 = st.grad_parts
        parts += [("g_amax", amax), ("g_l2", l2)]
    elif st.bwd_grads:  # optimizer steps fused into the backward: each one's gradients as its step began (optsink)
        st.param_names = [n for names, _, _ in st.bwd_grads for n in names]
        parts.append(("g_amax", torch.cat([a.to(st.bwd_grads[0][1].device) for _, a, _ in st.bwd_grads])))
        if st.sampled and all(l2 is not None for _, _, l2 in st.bwd_grads):
            parts.append(("g_l2", torch.cat([l2.to(st.bwd_grads[0][1].device) for _, _, l2 in st.bwd_grads])))
        st.bwd_grads = []
    elif need_grad_check and not st.sampled and st.full_norms and m.w.scaler is None:
        # a clip over every parameter returned the total norm: it is read first, and the per-parameter abs-max only
        # when it is not finite (resolve runs right after this, before the optimizer step: no scaler, no async)
        st.grad_by_norm = True
    else:
        names, grads = model_grads(m) if need_grad_check else ([], [])
        if grads and opt is not None and len(m.known_optimizers) > 1:
            # another optimizer's parameters are not this step's to apply (a GAN's discriminator holds last
            # iteration's skipped gradients until its own zero_grad): only the ones `opt` steps, or none holds
            others = m.held_by_others(opt)
            if others:
                keep = [i for i, n in enumerate(names) if id(m.param_by_name[n]) not in others]
                names, grads = [names[i] for i in keep], [grads[i] for i in keep]
        st.param_names = names
        if grads and st.sampled:
            amax, l2 = amax_and_l2(grads)
            parts += [("g_amax", amax), ("g_l2", l2)]
        elif grads:
            parts.append(("g_amax", norms(grads, math.inf)))
    if st.sampled:  # (the dtypes the step ran with: a model .half()'d after the loop, before close, ran fp32)
        st.step_dtypes = {n: p.dtype for n, p in m.params}
    if st.sampled and m.params:  # are the weights themselves finite?
        st.pw_index = st.pw_index or checked_weights(m)  # (taken at the forward's start when it ran)
        # on the CPU nothing is gained by queueing: the weights are checked in resolve, on bad steps only
        st.w_deferred = all(m.params[i][1].device.type == "cpu" for i in st.pw_index)
        if st.pw_index and not st.w_deferred:
            parts.append(("w_amax", weight_amax(m, st)))
            if st.w_start is not None:
                parts.append(("w_start", st.w_start))
    if st.outside is not None:
        parts.append(("outside", st.outside[1]))
    if st.masters is not None and st.masters[1] is not None:
        parts.append(("masters", st.masters[1]))
    if st.sampled:
        m.buffers.refresh()  # which buffers the training writes (after this step's forward)
    b_amax = m.buffers.part()
    if b_amax is not None:
        parts.append(("b_amax", b_amax))
    parts += [(f"norm{j}", t) for j, (_, t) in enumerate(st.norms)]  # gradient norms a clip or engine returned
    staged, st.staged = st.staged, None
    if staged is None or staged[0] != len(st.vecs) or st.fbuf:  # (rows measured after stage_rows: gather anew)
        if staged is not None:
            for idx, mat in staged[1].values():
                for k, i in enumerate(idx):
                    st.vecs[i] = mat[k]
        staged = (len(st.vecs), _gather_rows(st))
    for dev, (idx, mat) in staged[1].items():
        parts.append((f"vec:{dev}", mat))
    st.vec_order = {str(dev): idx for dev, (idx, _) in staged[1].items()}
    if st.probes:  # small fp16/bf16 inputs: integer-valued beyond the dtype's exact range? (stats.integer_probe)
        parts.append(("intp", torch.stack(st.probes)))
        st.probes = []
    parts += m.hr.parts()  # the always-on headroom's abs-max vectors (ampdoctor/record/headroom.py)
    asynchronous = _cuda_scaler(m.w.scaler)
    st.pending = Pending(parts, asynchronous, via_scaler and not early, grads_scaled, m.host_slots,
                         ("main", st.step & 1))
    st.advance(StepPhase.STAGED)
    st.half = (len(st.losses), len(st.out_ok))
    if not asynchronous and not early and not (m.w.scaler is not None and opt is not None and (
            len(m.known_optimizers) > 1 or not m.records) and m.others_to_step(set(m.scaler_stepped()))):
        resolve(m)  # (another optimizer still to step this iteration: read at finalize with what it adds, presync_more)


def presync_more(m, opt) -> None:
    """Another optimizer's scaler.step() in a step that went on (StepMachine.iteration_goes_on: a GAN's generator
    after its discriminator): the losses and model outputs the iteration added since the step's transfer, and what
    this optimizer's unscale_ found, read with the step's values (resolve merges them)."""
    st = m.st
    if st.pending is None or st.half is None:
        return
    n_l, n_o = st.half
    st.half = (len(st.losses), len(st.out_ok))
    parts = [("loss", t.reshape(-1)) for t in st.losses[n_l:]]
    parts += [("out_ok", t) for sums, _ in st.out_ok[n_o:] for t in sums]
    fi = m._found_inf_of(opt) if opt is not None else None
    if fi is not None:
        parts.append(("found_inf", fi.double().reshape(-1).sum().reshape(1)))
    if parts:
        st.more.append(Pending(parts, False))


def resolve_early(m) -> None:
    """A step staged early whose values are read at once (no asynchronous copy: the CPU): read now, where a step
    staged at its optimizer step reads them (in the optimizer's step, or after scaler.step() when it skipped)."""
    st = m.st
    if st.early and st.pending is not None and not _cuda_scaler(m.w.scaler):
        resolve(m)


def skipped_grads(m) -> None:
    """A step staged early (presync `early`) that GradScaler then skipped: each gradient's abs-max, read with the
    step's values (resolve), as a step staged at its end reads them (which parameters' gradients were not finite)."""
    st = m.st
    names, grads = model_grads(m)
    if grads:
        st.param_names = names
        st.more.append(Pending([("g_amax", norms(grads, math.inf))], False))


def stage_rows(m) -> None:
    """On a sampled step, as scaler.step begins (before GradScaler reads found_inf, which waits for the device):
    the step's statistic rows gathered into one matrix per device, the fused buffers flushed. This host work then
    runs while the device still computes the backward, not while it waits for the optimizer step; presync takes
    the matrices as they are."""
    st = m.st
    if st.sampled and st.phase is StepPhase.OPEN and st.vecs and st.staged is None:
        st.staged = (len(st.vecs), _gather_rows(st))


def _gather_rows(st) -> dict:
    """{device: (indices into st.vecs, a matrix of their rows in that order)}: the fused buffers' rows (flushed;
    ampdoctor/record/fused.py) and the rows measured otherwise, stacked per device. When every row is one buffer's,
    in the order measured (the usual case on a GPU), the buffer's matrix is taken whole: no per-row work."""
    mats = {dev: buf.vectors() for dev, buf in st.fbuf.items()}
    st.fbuf = {}
    vecs = st.vecs
    if len(mats) == 1 and vecs:
        dev, mat = next(iter(mats.items()))
        if mat.shape[0] == len(vecs) and all(isinstance(v, tuple) and v[2] == i for i, v in enumerate(vecs)):
            return {dev: (list(range(len(vecs))), mat)}
    if mats:
        st.vecs = vecs = [mats[v[1]][v[2]] if isinstance(v, tuple) else v for v in vecs]
    by_dev: dict = {}
    for i, v in enumerate(vecs):
        by_dev.setdefault(v.device, []).append(i)
    return {dev: (idx, torch.stack([vecs[i] for i in idx])) for dev, idx in by_dev.items()}


def resolve(m) -> None:
    """Read the step's values (see _Pending), decide whether it went bad, and capture it if so."""
    st = m.st
    if st.pending is None:
        return
    pending, st.pending = st.pending, None
    via_scaler, grads_scaled = pending.via_scaler, pending.grads_scaled
    host = pending.result()
    more, st.more, st.half = st.more, [], None
    more_inf = []  # what the later optimizers' unscale_ found
    for p in more:  # the rest of the iteration (presync_more): its losses and outputs follow the step's own
        got = p.result()
        for k in ("loss", "out_ok"):
            if k in got:
                host[k] = host.get(k, []) + got[k]
        if "g_amax" in got and "g_amax" not in host:  # (skipped_grads)
            host["g_amax"] = got["g_amax"]
        more_inf += got.get("found_inf", [])
    rows: dict[int, list[float]] = {}
    if st.vec_order:  # (a step with statistic rows: sampled, or one that measured a tensor)
        for key, vals in host.items():
            if key.startswith("vec:"):
                idx = st.vec_order[key[4:]] if key[4:] in st.vec_order else next(iter(st.vec_order.values()))
                for k, i in enumerate(idx):
                    rows[i] = vals[k * NSTAT:(k + 1) * NSTAT]
    st.vecs = []  # release device memory
    st.headroom = m.hr.host_series(host)
    if st.headroom is not None:
        m.policy.collapse(st.headroom["fwd"], st.headroom["dtype"], st.step)  # (a norm flushed: sample the next)
        if m.hr_hooks.budget is not None:
            m.hr_hooks.budget.creep(st.headroom["fwd"], st.headroom["dtype"])
    for j, (ev, _) in enumerate(st.norms):
        if f"norm{j}" in host:
            ev.total_norm = host[f"norm{j}"][0]
    st.norms = []  # a norm returned after presync is not read (the step's values are already on their way)
    scale = host.get("scale", [None])[0]
    found_inf = host.get("found_inf", [None])[0]
    if via_scaler and not st.fused_amp:
        found_inf = 0.0  # GradScaler only calls a plain optimizer's step when no inf was found
    if more_inf:
        found_inf = (found_inf or 0.0) + sum(more_inf)
    div = scale if (grads_scaled and scale and st.grad_parts is None) else 1.0
    g_amax, g_l2 = host.get("g_amax", []), host.get("g_l2", [])
    if st.grad_by_norm:  # (presync) the total norm of a clip over every parameter, read before any gradient
        if all(math.isfinite(v) for j in st.full_norms for v in host.get(f"norm{j}", [math.nan])):
            g_amax = None
        else:
            names, grads = model_grads(m)
            st.param_names = names
            g_amax = norms(grads, math.inf).tolist() if grads else []
    if div != 1.0 and g_amax is not None:
        g_amax, g_l2 = [v / div for v in g_amax], [v / div for v in g_l2]
    losses = host.get("loss", [])
    grad_finite = True if g_amax is None else all(map(math.isfinite, g_amax)) if g_amax else None
    g_amax = g_amax or []
    out_sums = host.get("out_ok", [])
    out_ok, i = [], 0  # per micro-batch: were all of its output sums finite?
    # an output whose sums are finite or -inf held no +inf or NaN: -inf only, a mask (an RL policy's illegal
    # actions, constrained decoding); with a finite loss it broke nothing, and it is not a non-finite output
    loss_ok = bool(losses) and all(math.isfinite(v) for v in losses)
    for sums, _ in st.out_ok:
        n = sum(t.numel() for t in sums)
        vals = out_sums[i:i + n]
        out_ok.append(all(math.isfinite(v) for v in vals) or loss_ok and all(v == -math.inf or math.isfinite(v)
                                                                              for v in vals))
        i += n
    st.output_finite = all(out_ok) if out_ok else None
    if st.output_finite is False:  # capture the first micro-batch whose output went non-finite
        st.bad_batch = st.out_ok[out_ok.index(False)][1]
    st.out_ok = []
    if losses and not loss_ok and st.output_finite is not False:
        st.loss_ops, st.loss_low, st.loss_consts = loss_ops(st.loss_node, st.out_seq)
    st.loss_node = None
    bad_fwd = any(not math.isfinite(v) for v in losses) or st.exception is not None or st.output_finite is False
    if bad_fwd and st.batches:  # did the batch itself hold inf/NaN? (bad steps only)
        i = st.bad_batch if st.bad_batch >= 0 else len(st.batches) - 1
        st.bad_input = nonfinite_input(st.batches[i][0], st.batches[i][1])
        micro = st.micro - (len(st.batches) - 1 - i)
        if st.bad_input and st.exception is None and micro not in st.scaled_micros and \
                max(st.scaled_micros, default=0) > micro:
            # with a GradScaler, the loop scaled a later micro-batch's loss and never this one's: it skipped the
            # batch before its backward (a NaN guard on the loss), so the batch trained nothing (rules/outside.py)
            st.bad_input["unscaled"] = True
    bad_bwd = (found_inf or 0) > 0 or grad_finite is False
    if st.sampled or bad_fwd or bad_bwd:
        w_bad = _bad_weights(m, st, host, bad_fwd, bad_bwd)
    else:  # (a routine step that went well: no weight was read)
        w_bad, st.w_start = {}, None
    st.bad_buffer = m.buffers.read(host.get("b_amax"))
    if st.outside is not None:
        got = host.get("outside") or []
        by_data = st.outside[2]  # (all unchanged without a version move: a frozen weight, not one written)
        st.outside = {n: [int(got[2 * k]), int(got[2 * k + 1])] for k, n in enumerate(st.outside[0])
                      if 2 * k + 1 < len(got) and not (n in by_data and got[2 * k] >= got[2 * k + 1])} or None
    if st.masters is not None:
        got = host.get("masters") or []
        st.masters = {"since": st.masters[0], "stuck": int(got[0]), "moved": int(got[1])} if len(got) == 2 else None
    st.synced = {"losses": losses, "scale": scale, "found_inf": found_inf, "g_amax": g_amax, "g_l2": g_l2,
                 "w_bad": w_bad,
                 "rows": rows, "grads_scaled": grads_scaled, "grad_finite": grad_finite,
                 "probes": host.get("intp", [])}
    m.policy.loss_jump(losses, sampled=st.sampled)
    # (a forward that raised with nothing non-finite seen: its capture is its own kind, so that a later overflow still
    # gets one; a loop that catches a bad batch's error and goes on)
    raised_only = st.exception is not None and st.output_finite is not False and all(map(math.isfinite, losses))
    kind = m.policy.observe(bad_fwd, bad_bwd, scale, sampled=st.sampled, scaler=m.w.scaler is not None,
                            raised_only=raised_only)
    if kind:
        maybe_capture(m, st, kind)


def _bad_weights(m, st, host: dict, bad_fwd: bool, bad_bwd: bool) -> dict:
    """{module: "nan" | "inf"} of the modules whose weights were non-finite and were not when the step's forward
    began (a sampled step's weights, read with its values; a bad step's, read now)."""
    w_amax = host.get("w_amax", [])
    if st.w_deferred and st.pw_index and (bad_fwd or bad_bwd):
        w_amax = weight_amax(m, st).tolist()
    if not st.sampled and bad_fwd and m.params and m.routine_weight_checks < 3:
        # a routine step whose forward went non-finite: were the weights the forward used already non-finite (an
        # update before wrote them)? Read now, on the bad step only (a skipped step left them as the forward saw
        # them; without a scaler this runs before the optimizer step); the first few bad steps only
        m.routine_weight_checks += 1
        st.pw_index = checked_weights(m)
        w_amax = weight_amax(m, st).tolist() if st.pw_index else []
    w_start = host.get("w_start")
    if w_start is None and st.w_start is not None and st.w_deferred and (bad_fwd or bad_bwd):
        w_start = st.w_start.tolist()
    st.w_start = None
    w_bad = {}  # weights already non-finite when the step began (finite then: this step's forward wrote them)
    for k, (i, v) in enumerate(zip(st.pw_index, w_amax)):
        if not math.isfinite(v) and (w_start is None or k >= len(w_start) or not math.isfinite(w_start[k])):
            w_bad[m.params[i][0].rpartition(".")[0]] = "nan" if v != v else "inf"
    if w_bad and st.batches:  # a weight the forward writes itself, finite when this forward began (modstate.py)
        for key, v in st.batches[st.bad_batch if st.bad_batch >= 0 else -1][2].items():
            if key.startswith("param:") and isinstance(v, torch.Tensor) and key[6:].rpartition(".")[0] in w_bad \
                    and bool(torch.isfinite(v).all()):
                del w_bad[key[6:].rpartition(".")[0]]
    return w_bad
