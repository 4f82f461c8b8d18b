"""Reading a step's values back on the host (transfer.py staged them), and what is decided on reading them.

`resolve` reads the step's one transfer (hostcopy.Pending) and what the rest of the iteration added, turns the
values into the step's `synced` facts (losses, scale, found_inf, gradient abs-max and norms, statistic rows, the
headroom series, which outputs and weights went non-finite, a bad step's non-finite input) and asks the machine's
CapturePolicy whether the step is worth a capture (ampdoctor/record/autocapture.py). `resolve_early` is the CPU's
read of a step staged early, at the point where a step staged at its optimizer step is read.
"""
from __future__ import annotations

import math

import torch

from .autocapture import maybe_capture
from .gradexits import loss_ops
from .hostcopy import cuda_scaler
from .params import checked_weights, model_grads, norms, weight_amax
from ..tensors import nonfinite_input
from .stats import NSTAT

__all__ = ["resolve", "resolve_early"]


def resolve_early(m) -> None:
    """A step staged early whose values are read at once (no asynchronous copy: the CPU): read now, where a step
    staged at its optimizer step reads them (in the optimizer's step, or after scaler.step() when it skipped)."""
    st = m.st
    if st.early and st.pending is not None and not cuda_scaler(m.w.scaler):
        resolve(m)


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
