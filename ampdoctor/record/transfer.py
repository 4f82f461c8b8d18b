"""The once-per-step transfer of an open step's values to the host: what is staged, and when.

`presync` runs just before the optimizer step (or when the scaler skipped it, or when no step came): it
gathers the loss, the scale, found_inf, gradient norms and every statistic vector the hooks queued and moves
them to the host in one transfer per device (ampdoctor/record/hostcopy.py; the step is STAGED). `presync_more`,
`skipped_grads` and `found_inf_all` stage what the rest of the iteration adds; `stage_rows` gathers a sampled
step's statistic rows early. Reading the values back and deciding what they mean is readback.py's (`resolve`);
turning the step into a StepRecord is record/assemble.py's (`finalize`); what is measured about the parameters is
ampdoctor/record/params.py.
"""
from __future__ import annotations

import math

import torch

from .hostcopy import Pending, cuda_scaler
from .openstep import StepPhase
from .params import amax_and_l2, checked_weights, model_grads, norms, weight_amax
from .readback import resolve

__all__ = ["presync", "presync_more", "stage_rows", "skipped_grads", "found_inf_all"]


def found_inf_all(m) -> None:
    """At scaler.update() with several optimizers on one scaler: whether any of them found inf this iteration
    (presync ran at the first scaler.step and saw only that optimizer's). Queued like presync's values."""
    states = getattr(m.w.scaler, "_per_optimizer_states", None)
    if m.st.phase is StepPhase.OPEN or not states or len(states) < 2:
        return
    fi = [v.detach().double().reshape(()) for s in states.values() for v in s.get("found_inf_per_device", {}).values()]
    if fi:
        m.st.late = Pending([("found_inf_all", torch.stack(fi).sum())],
                             cuda_scaler(m.w.scaler), slots=m.host_slots,
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
    asynchronous = cuda_scaler(m.w.scaler)
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


