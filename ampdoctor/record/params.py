"""What a step measures about the parameters, queued for the step's one transfer (ampdoctor/record/transfer.py): the
gradients' abs-max and L2 norm per parameter (right after unscale_ on sampled steps), whether the weights are
finite, each weight's L2 norm right before and after the optimizer update (sampled steps; rule update_spike),
and whether sampled low-precision updates rounded away (w + Δw == w)."""
from __future__ import annotations

import math
import operator

import torch

from . import cpustats
from ..records import ROUNDED_AWAY_SHARE, ROUNDING_MIN_SAMPLED
from ..tensors import local

__all__ = ["model_grads", "norms", "amax_and_l2", "grads_after_unscale", "checked_weights", "weight_amax",
           "UpdateCheck", "update_check_pre", "update_check_post"]


def model_grads(m):
    """The parameters' gradients as this rank holds them (a DTensor's local shard; see tensors.local), not detached
    (`norms` reads them without recording). Runs every step of a loop without a GradScaler: one comprehension."""
    if m.sharded:
        pairs = [(n, local(g.detach())) for n, p in m.params
                 if (g := p.grad) is not None and g.layout == _STRIDED and g.is_floating_point()]
        pairs = [(n, g) for n, g in pairs if g.numel()]
    else:
        pairs = [(n, g) for n, p in m.params
                 if (g := p.grad) is not None and g.layout == _STRIDED and g.is_floating_point() and g.numel()]
    return [n for n, _ in pairs], [g for _, g in pairs]


_STRIDED = torch.strided
_F64 = torch.float64
_F32 = torch.float32
_LOW = (torch.float16, torch.bfloat16)
_DEV_DT = operator.attrgetter("device", "dtype")


def _group_norms(ts: list[torch.Tensor], ord: float) -> torch.Tensor:
    """Norms of tensors of one device and dtype, as a float64 vector on that device."""
    if ord != math.inf and ts[0].dtype in _LOW:
        ts = [t.float() for t in ts]
    if ord == math.inf and ts[0].device.type == "cpu":  # (_foreach_norm(inf) is a slow per-tensor loop there)
        return cpustats.absmax(ts)
    # fp32 values at least (an fp16 max is exact in fp32): stacking fp16 values inside a bf16 autocast region fails
    return torch.stack(torch._foreach_norm(ts, ord, dtype=_F32 if ts[0].dtype in _LOW else None)).to(_F64)


def norms(tensors: list[torch.Tensor], ord: float) -> torch.Tensor:
    """Per-tensor norms (inf: abs-max, NaN-propagating) as one float64 vector on the first tensor's device:
    one multi-tensor kernel per (device, dtype) group; low-precision tensors' L2 norms are taken in fp32. Nothing
    is recorded for autograd (a gradient made with create_graph is read as it is)."""
    with torch.no_grad():
        keys = list(map(_DEV_DT, tensors))
        k0 = keys[0]
        if keys.count(k0) == len(keys):  # one group (the usual case): no per-tensor work in Python
            return _group_norms(tensors, ord)
        by: dict = {}
        for i, k in enumerate(keys):
            by.setdefault(k, []).append(i)
        dev = k0[0]
        out = torch.empty(len(tensors), dtype=_F64, device=dev)
        for idx in by.values():
            out[torch.tensor(idx, device=dev)] = _group_norms([tensors[i] for i in idx], ord).to(dev)
        return out


def amax_and_l2(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`norms(tensors, inf)` and `norms(tensors, 2)`: on the CPU both in one C pass over each tensor
    (cpustats.absmax_l2: a sampled step's gradients are read once, not twice)."""
    both = cpustats.absmax_l2(tensors) if tensors[0].device.type == "cpu" else None
    return both if both is not None else (norms(tensors, math.inf), norms(tensors, 2))


def grads_after_unscale(m, opt) -> None:
    """On a sampled step, queue the gradients' norms right after `scaler.unscale_(opt)`: what the model
    produced, before clipping rescales it (read at presync with everything else). Only when `opt` holds every
    gradient of the model; otherwise presync measures them before the optimizer step."""
    st = m.st
    if not st.sampled or st.grad_parts is not None:
        return
    names, grads = model_grads(m)
    if not grads:
        return
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    if any(id(p) not in held for n, p in m.params if p.grad is not None):
        return
    st.grad_parts = (names, *amax_and_l2(grads))


def checked_weights(m) -> list[int]:
    """Indices into m.params of the weights whose finiteness a sampled step checks (this rank's part non-empty)."""
    return [i for i, (_, p) in enumerate(m.params)
            if p.is_floating_point() and p.layout == torch.strided and local(p).numel()]


def weight_amax(m, st) -> torch.Tensor:
    """Abs-max of each checked parameter (NaN-propagating): are the weights themselves finite?"""
    return norms([local(m.params[i][1].detach()) for i in st.pw_index], math.inf)


class UpdateCheck:
    """One optimizer step's update check: each parameter's name, the parameter, its rounding sample (flat copy,
    nonzero-gradient mask, how to take it again; Nones without one), the weights' L2 norms before the update (a
    vector, update_check_pre) and the results after it (a matrix, rows [rounded away, sampled, norm before, norm
    after], update_check_post): read at finalize in one transfer each, no per-parameter tensors."""

    __slots__ = ("opt", "names", "params", "samples", "pre", "res", "lrs", "only_huge", "state")

    def __init__(self, opt: int, names: list, params: list, samples: list, pre: torch.Tensor, lrs: list):
        self.opt = opt  # id of the optimizer: a step of several optimizers keeps one check each
        self.names, self.params, self.samples, self.pre, self.res = names, params, samples, pre, None
        self.lrs = lrs  # each parameter's group learning rate for this update (a number, or None)
        self.only_huge = False  # keep only the parameters this update grew HUGE_GROWTH-fold (an unfrozen layer's)
        self.state: dict | None = None  # name -> its optimizer state's dtype, where narrower (narrow_state)


def _opt_params(m, opt) -> list:
    """The optimizer's parameter groups as [(name, parameter)] of the model's floating-point strided parameters,
    kept per optimizer until its parameter count changes (add_param_group)."""
    count = sum(len(g["params"]) for g in opt.param_groups)
    hit = m.opt_params.get(id(opt))
    if hit is None or hit[0] != count:
        names = {id(p): name for name, p in m.w.model.named_parameters()}
        # (not a parameter on the meta device: a template whose weights torch.func.functional_call supplies holds
        # no values to measure)
        groups = [[(names[id(p)], p) for p in g["params"]
                   if id(p) in names and p.is_floating_point() and p.layout == torch.strided and not p.is_meta]
                  for g in opt.param_groups]
        hit = m.opt_params[id(opt)] = (count, groups)
    return hit[1]


def update_check_pre(m, opt) -> None:
    """On a sampled step, just before `opt.step()`: each optimizer parameter's weight L2 norm (one multi-tensor
    kernel per device and dtype, read with the update results at finalize), and for low-precision parameters a
    copy of their first `update_sample` elements to see whether the update rounds away (w + Δw == w)."""
    st = m.st
    st.upd = [c for c in st.upd if c.opt != id(opt)]  # (this optimizer stepped again: its newest check counts)
    # a parameter that never had a gradient at an update has one now: a layer unfrozen (its first updates, from a
    # fresh optimizer state, are where a fine-tune's unfreezing blows it up: rules/updates.py update_spike). Only
    # those are looked at each step (usually none)
    gl, grew = m.gradless, False
    if gl is None:
        m.gradless = [p for _, p in m.params if p.grad is None]
    elif gl and any(p.grad is not None for p in gl):
        m.gradless = [p for p in gl if p.grad is None]
        grew = True
    follow = False
    if not st.sampled:
        if grew:  # the unfrozen layer's next updates too, as the optimizer's fresh state for it settles
            m.check_until = st.step + AFTER_CHANGE
        if not lr_moved(m, opt) and not (st.step % LOW_CHECK_EVERY == 0 and not m.rounding_seen and _low(m, opt)):
            if st.step > m.check_until:
                return
            # checked for the unfrozen layer only: its record keeps a blow-up alone (UpdateCheck.only_huge), not the
            # ordinary growth of a small new layer's first updates
            follow = True
    k = m.cfg.update_sample
    names, params, samples, ws, lrs = [], [], [], [], []
    for g, group in zip(opt.param_groups, _opt_params(m, opt)):
        frozen = g.get("lr") == 0  # (a warmup from 0: the update is exactly zero, nothing rounds)
        lr = g.get("lr")
        lr = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None
        for name, p in group:
            w = local(p.detach())
            if not w.numel():
                continue
            sample = _NO_SAMPLE  # (flat, gnz, rows: the sample's stride, or a sparse gradient's row indices)
            if k > 0 and p.dtype in _LOW and p.grad is not None and not frozen:
                sample = _update_sample(w, local(p.grad.detach()), k)
            names.append(name)
            params.append(p)
            samples.append(sample)
            ws.append(w)
            lrs.append(lr)
    if names:
        chk = UpdateCheck(id(opt), names, params, samples, norms(ws, 2), lrs)
        chk.only_huge = follow
        st.upd.append(chk)


_NO_SAMPLE = (None, None, None)


AFTER_CHANGE = 4
"""Updates checked after the one at which a layer first had a gradient (update_check_pre)."""
HUGE_GROWTH = 100.0
"""Those checks keep a parameter only when the update grew its norm this much (rules/updates.py's _BROKE)."""
LOW_CHECK_EVERY = 4
"""An optimizer holding fp16/bf16 parameters has its updates' rounding checked on every this many steps too, until a
check finds them rounding away (`StepMachine.rounding_seen`, set by assemble.finalize): they start to when the
gradients shrink as a fit converges, at a constant learning rate, between the sampled steps."""
ROUNDED_SHARE = ROUNDED_AWAY_SHARE
MIN_SAMPLED = ROUNDING_MIN_SAMPLED
"""A module whose sampled elements (MIN_SAMPLED or more) round away by ROUNDED_SHARE ends those checks (records.py:
as the rule counts them)."""


def _low(m, opt) -> bool:
    """Whether `opt` holds fp16/bf16 parameters (decided once per optimizer)."""
    low = m.low_opts.get(id(opt))
    if low is None:
        low = m.low_opts[id(opt)] = any(p.dtype in _LOW for g in opt.param_groups for p in g["params"])
    return low


def _update_sample(w: torch.Tensor, g: torch.Tensor, k: int):
    """(`k` elements of weight `w`, which of them have a nonzero gradient, how to take them again): the sample whose
    rounding update_check_post reads: every `numel // k`-th element (a layer's first rows alone can be its rarest
    inputs'), or for a sparse gradient (nn.Embedding(sparse=True)), which reaches only its rows, the first rows it
    holds (their indices)."""
    if g.layout == torch.strided:
        s = max(1, w.numel() // k)
        return w.reshape(-1)[::s][:k].clone(), g.reshape(-1)[::s][:k] != 0, s
    if g.layout != torch.sparse_coo or w.dim() < 1 or not w.shape[0]:
        return None, None, None
    g = g.coalesce()
    rows = g.indices()[0][:max(1, k // max(1, w[0].numel()))]
    return (w.index_select(0, rows).reshape(-1)[:k].clone(),
            g.index_select(0, rows).to_dense().reshape(-1)[:k] != 0, rows)


def lr_moved(m, opt) -> bool:
    """A routine step checks the updates too when a learning rate has moved by 4x or more since the last check:
    for fp16/bf16 parameters either way (a step decay, a warmup's end: when updates start to round away), for any
    optimizer upwards (when one update can blow the weights up). The sampled steps may be hundreds of steps off.
    Host numbers only, once per optimizer step."""
    low = _low(m, opt)
    lrs = [g.get("lr") for g in opt.param_groups]
    if not all(isinstance(x, (int, float)) for x in lrs):
        return False
    last = m.lr_checked.get(id(opt))
    # fp16/bf16 parameters: a move either way (a decay is when updates start to round away); any optimizer: a
    # rise by 4x (a scheduler bug, a restart), when one update can blow the weights up (update_spike's step)
    moved = last is not None and (len(last) != len(lrs) or any(
        (a > 0) != (b > 0) or (a > 0 and (b / a >= 4.0 or low and a / b >= 4.0)) for a, b in zip(last, lrs)))
    if last is None or moved or m.st.sampled:
        m.lr_checked[id(opt)] = lrs
    return moved


def update_check_post(m, opt) -> None:
    """Right after `opt.step()`: the weight norms again, and how many sampled low-precision elements with a
    nonzero gradient did not change, into the check's result matrix (see UpdateCheck)."""
    chk = next((c for c in m.st.upd if c.opt == id(opt) and c.res is None), None)
    if chk is None:
        return
    post = norms([local(p.detach()) for p in chk.params], 2)
    # one matrix (a few kernels in all, not a few per parameter: GPT-2 has 148)
    res = torch.zeros((len(chk.names), 4), dtype=torch.float64, device=post.device)
    res[:, 2] = chk.pre.to(post.device)
    res[:, 3] = post
    sampled, counts = [], []
    for i, (before, gnz, rows) in enumerate(chk.samples):
        if before is not None:
            w = local(chk.params[i].detach())
            after = (w.reshape(-1)[::rows] if isinstance(rows, int) else w.index_select(0, rows).reshape(-1))[
                :before.numel()]
            sampled.append(i)
            counts.append(torch.stack([((after == before) & gnz).sum(), gnz.sum()]).to(post.device))
    if sampled:
        res[torch.tensor(sampled, device=post.device), :2] = torch.stack(counts).double()
    chk.res = res
    if m.st.sampled and not chk.only_huge:
        chk.state = narrow_state(opt, chk.names, chk.params)


def narrow_state(opt, names: list, params: list) -> dict | None:
    """{name: dtype} of the parameters whose optimizer state holds a floating tensor of their size in a narrower
    dtype than theirs (a hand-written or torchdistx-style AdamW keeping exp_avg_sq in fp16 over fp32 weights), the
    narrowest one; None when there are none. Host attributes only, on sampled steps."""
    state = getattr(opt, "state", None)
    if not state:
        return None
    out = {}
    for name, p in zip(names, params):
        try:
            st = state.get(p)
        except TypeError:
            return None
        if not isinstance(st, dict):
            continue
        size = p.dtype.itemsize
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize < size \
                    and v.numel() == p.numel():
                size = v.dtype.itemsize
                out[name] = str(v.dtype).replace("torch.", "")
    return out or None
