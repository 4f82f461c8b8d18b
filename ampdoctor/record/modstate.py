"""The state a model's forward reads and writes besides its arguments: a step counter that picks a task head
(`self.calls % 3`), a memory carried between steps as a plain tensor attribute (`self.state = (...).detach()`),
buffers the forward updates before or after reading them (a lagging observation normaliser, spectral_norm's power
iteration vectors). A replay of a captured batch must start from that state as the step's forward found it, not
as it stands when the report runs (replay/modelio.set_rng sets it, `preserved()` restores the live one after).

Which state a model has is learned on a few probed steps (the first routine ones and every sampled one: `probe`
before the root's forward and `changed` after it): an int/float/bool attribute whose value changed, a tensor
attribute that was replaced or written in place, a buffer written in place (its version counter), a parameter
written in place (its version counter or, through `.data`, its norm). A cache that
is built once (a rotary table filled on the first forward) changes on step 0 only, which is not probed. From
then on each batch keeps a `snapshot` of those keys (numbers as they are; a tensor written in place copied, one
replaced by the forward referenced; within SNAPSHOT_BYTES),
under the keys a capture writes them with (capture.STATE_PREFIXES):

    "num:<module>.<attr>"     an int, float or bool attribute
    "tensor:<module>.<attr>"  a plain tensor attribute
    "buf:<module>.<name>"     a buffer
    "param:<module>.<name>"   a parameter the forward writes (a hand-written max-norm renormalisation, an EMA
                              codebook): the capture's weights take this value (record/autocapture.py)

Normalisation layers' running statistics are left out: a BatchNorm in training mode updates them without reading
them (its output is the batch's own statistics), and one in eval mode does not change them.
"""
from __future__ import annotations

import torch

__all__ = ["probe", "changed", "snapshot", "due", "SNAPSHOT_BYTES", "MAX_COPIES"]

SNAPSHOT_BYTES = 8 << 20   # per batch: larger state (a MoCo queue of 65536 keys) is left to the replay's live value
MAX_COPIES = 32            # ... and at most this many copies (an EMA teacher updated inside the forward: none of it)
_MODULE_KEYS = frozenset(vars(torch.nn.Module())) | {"training", "_compiled_call_impl"}
_NORM = torch.nn.modules.batchnorm._NormBase
_NUM = (int, float, bool)


def _fingerprint(v):
    if type(v) in _NUM:
        return v
    if v is None:  # (a memory not filled yet: a tensor attribute the forward sets for the first time)
        return None
    if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and not v.requires_grad:
        return (id(v), v._version)
    return _SKIP  # (a tensor in the autograd graph kept as an attribute is an output, e.g. an aux loss, not state)


_SKIP = object()


def probe(model: torch.nn.Module) -> dict:
    """Key -> (module, name, fingerprint) of every candidate piece of state, as it is now; "" -> the parameters'
    keys and their L2 norms (`_norms`: a parameter written through `.data` keeps its version counter)."""
    out = {}
    pkeys, params = [], []
    for name, mod in model.named_modules():
        pre = f"{name}." if name else ""
        for k, v in vars(mod).items():
            if k in _MODULE_KEYS or k.startswith("__"):
                continue
            fp = _fingerprint(v)
            if fp is _SKIP:
                continue
            out[f"{'num:' if type(v) in _NUM else 'tensor:'}{pre}{k}"] = (mod, k, fp)
        for k, p in mod._parameters.items():
            if p is not None and p.layout == torch.strided and not p.is_meta and type(p.detach()) is torch.Tensor:
                key = f"param:{pre}{k}"
                out[key] = (mod, k, (id(p), p._version))
                pkeys.append(key)
                params.append(p)
        if isinstance(mod, _NORM):
            continue
        for k, b in mod._buffers.items():
            if b is not None:
                out[f"buf:{pre}{k}"] = (mod, k, (id(b), b._version))
    out[""] = (pkeys, _norms(params))
    return out


def _norms(params: list) -> list:
    """[(indices, their L2 norms as one fp32 vector)] per device: one multi-tensor kernel per (device, dtype), no
    read (`changed` reads the comparison once)."""
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    by_dev: dict = {}
    with torch.no_grad():
        for (dev, dt), idx in groups.items():
            ns = torch._foreach_norm([params[i].detach() for i in idx]) if dt.is_floating_point else \
                [params[i].detach().double().norm() for i in idx]
            by_dev.setdefault(dev, []).extend(zip(idx, ns))
    return [([i for i, _ in items], torch.stack([n.float() for _, n in items])) for items in by_dev.values()]


def _moved(before: tuple, after: tuple) -> set:
    """The parameter keys whose norm differs between two probes (NaN and NaN the same)."""
    (k0, g0), (k1, g1) = before, after
    if k0 != k1 or len(g0) != len(g1):
        return set()
    out = set()
    for (idx, a), (_, b) in zip(g0, g1):
        diff = (a != b) & ~(a.isnan() & b.isnan())
        out.update(k0[idx[j]] for j in diff.nonzero().flatten().tolist())
    return out


def changed(before: dict, model: torch.nn.Module) -> list:
    """[(key, module, name, copy)] of the state the forward since `before` (a `probe`) changed; `copy`: the tensor
    was written in place (a snapshot must copy it), not replaced by a new one (a reference is enough). A parameter
    counts when the forward wrote it (an in-place max-norm renormalisation, an EMA codebook update)."""
    after = probe(model)
    out, seen = [], set()
    moved = _moved(before[""], after[""]) if "" in before else set()
    for key, entry in after.items():
        old = before.get(key)
        if not key or old is None:
            continue
        mod, name, fp = entry
        if key.startswith("param:"):
            p = mod._parameters.get(name)
            if (old[2] != fp or key in moved) and id(p) not in seen:
                seen.add(id(p))
                out.append((key, mod, name, True))
            continue
        if old[2] == fp or fp is None and not key.startswith("num:"):
            continue
        out.append((key, mod, name, isinstance(fp, tuple) and isinstance(old[2], tuple) and old[2][0] == fp[0]))
    return out


def due(step: int, sampled: bool) -> bool:
    """Whether a step's forward is probed: the first routine steps (1, 2) and every later sampled one."""
    return 1 <= step <= 2 or sampled and step > 0


def snapshot(keys: list) -> dict:
    """Key -> the state's value now: numbers as they are; a tensor the forward writes in place copied, one it
    replaces kept as (tensor, its version) (capture.write_capture leaves it out if it was written since); up to
    SNAPSHOT_BYTES and MAX_COPIES copies in all."""
    out = {}
    budget, copies = SNAPSHOT_BYTES, MAX_COPIES
    for key, mod, name, copy in keys:
        if key.startswith("num:"):
            v = vars(mod).get(name)
            if type(v) in _NUM:
                out[key] = v
            continue
        t = mod._buffers.get(name) if key.startswith("buf:") else mod._parameters.get(name) \
            if key.startswith("param:") else vars(mod).get(name)
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
            continue
        nb = t.nelement() * t.element_size()
        if nb > budget or copy and not copies:
            continue
        budget -= nb
        if copy:
            copies -= 1
            out[key] = t.detach().clone()
        else:
            out[key] = (t.detach(), t._version)  # (the same version counter; no graph kept alive)
    return out
