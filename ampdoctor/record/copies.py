"""The weights that change outside the optimizer's own update, compared across the forwards after a sampled step:
frozen fp16/bf16 copies the user's code writes in place (an EMA teacher, a momentum encoder: do their updates round
away?) and an fp16/bf16 model stepped through fp32 master copies (do the masters come back into it?). Each pair of
functions snapshots the first elements as a forward begins and queues the comparison for the step's one transfer
(transfer.py); rules/weights.py judges them.
"""
from __future__ import annotations

import torch

from ..tensors import local

__all__ = ["OUTSIDE_SAMPLE", "outside_snapshot", "outside_compare", "MASTERS_STEPS", "masters_snapshot",
           "masters_compare"]

_LOW = (torch.float16, torch.bfloat16)


OUTSIDE_SAMPLE = 4096
"""Elements compared of each frozen low-precision parameter (see outside_snapshot)."""


_NORM_STATS = (torch.nn.modules.batchnorm._NormBase,)  # (their running statistics: outside_snapshot leaves them)


def outside_snapshot(m, step: int):
    """On a sampled step, as its forward begins: the first elements and version of every fp16/bf16 parameter that
    no gradient updates (requires_grad False) and of every fp16/bf16 buffer but a norm layer's running statistics:
    an EMA teacher or momentum encoder kept in low precision, as parameters or as buffers, written in place by the
    user's code between steps. None when there is none."""
    items = []
    for name, p in m.params:
        if p.requires_grad or p.dtype not in _LOW or p.layout != torch.strided:
            continue
        w = local(p.detach())
        if w.numel():
            items.append((name, p, p._version, w.reshape(-1)[:OUTSIDE_SAMPLE].clone()))
    for mod_name, mod in m.w.model.named_modules():
        if isinstance(mod, _NORM_STATS) or not mod._buffers:
            continue  # (running statistics: torch's own momentum update, no copy of a model)
        for b_name, b in mod._buffers.items():
            if b is None or b.dtype not in _LOW or b.layout != torch.strided or b.is_meta or not b.numel():
                continue
            items.append((f"{mod_name}.{b_name}" if mod_name else b_name, b, b._version,
                          b.detach().reshape(-1)[:OUTSIDE_SAMPLE].clone()))
    return (step, items) if items else None


def outside_compare(m, snap) -> tuple[list[str], torch.Tensor, set] | None:
    """At the next step's forward: of the parameters and buffers written since the snapshot, how many sampled
    elements are unchanged: `(names, [[unchanged, sampled], ...], by_data)`, read with the step's transfer. An update
    made outside the optimizer that rounds away (w * 0.9999 + 0.0001 * w' == w in fp16) leaves them all as they
    were. `by_data`: the names whose version did not move (written through `.data`, as DINO/BYOL/MoCo momentum
    encoders do, or not written at all): readback.resolve keeps those only where some element did change."""
    names, rows, by_data = [], [], set()
    for name, p, version, before in snap[1]:
        if p._version == version:
            by_data.add(name)
        now = local(p.detach()).reshape(-1)[:before.numel()]
        if now.shape != before.shape:
            continue  # (resized in place: not an update to compare)
        names.append(name)
        rows.append(torch.stack([(now == before).sum().double(), torch.tensor(float(before.numel()),
                                                                            dtype=torch.float64, device=now.device)]))
    return (names, torch.stack(rows), by_data) if rows else None


MASTERS_STEPS = 4
"""Steps from each sampled one whose forward snapshots the masters and the model (masters_snapshot): a step whose
update was skipped (the scaler's first backoff) moves nothing, so the next ones look again."""


def masters_snapshot(m, step: int):
    """When the optimizer steps copies of an fp16/bf16 model's weights (RunMeta.optimizer["masters"]: the hand-rolled
    master-weight loop), as a forward begins: for each weight and its master, matched one for one in order, the first
    elements of the weight and of the master rounded to the weight's dtype. None when they cannot be matched (one flat
    master, another order) or there is nothing to compare."""
    opt = m.w.optimizer
    if opt is None or not (m.w.meta.optimizer or {}).get("masters"):
        return None
    mine = [p for _, p in m.params if p.requires_grad]
    held = [q for g in opt.param_groups for q in g["params"]]
    if len(mine) != len(held) or any(p.shape != q.shape for p, q in zip(mine, held)):
        return None
    items, dev = [], None
    for p, q in zip(mine, held):
        if p.dtype not in _LOW or p.layout != torch.strided or q.layout != torch.strided or not p.numel():
            continue
        if dev is None:
            dev = p.device
        if p.device != dev or q.device != dev:
            continue
        w = local(p.detach()).reshape(-1)[:OUTSIDE_SAMPLE]
        mq = local(q.detach()).reshape(-1)[:OUTSIDE_SAMPLE]
        items.append((p, q, w.clone(), mq.to(p.dtype, copy=True)))
    return (step, items) if items else None


def masters_compare(snap) -> torch.Tensor | None:
    """At the next step's forward: of the snapshot's master elements whose value in the weight's dtype moved since,
    how many of the model's elements stayed exactly as they were: a device vector [stuck, moved], read with the step's
    transfer. A loop that copies the masters back leaves none stuck (the weight is then its master rounded); one that
    forgets trains its masters while the forward runs the first weights for ever."""
    stuck, moved = [], []
    for p, q, w0, q0 in snap[1]:
        w = local(p.detach()).reshape(-1)[:w0.numel()]
        mq = local(q.detach()).reshape(-1)[:q0.numel()].to(p.dtype)
        if w.shape != w0.shape or mq.shape != q0.shape:
            continue  # (resized in place)
        mv = mq != q0
        stuck.append((mv & (w == w0)).sum())
        moved.append(mv.sum())
    if not moved:
        return None
    return torch.stack([torch.stack(stuck).sum(), torch.stack(moved).sum()]).double()
