"""The state a model's forward reads and writes besides its arguments: a step counter that picks a task head
(`self.calls % 3`), a memory carried between steps as a plain tensor attribute (`self.state = (...).detach()`),
buffers the forward updates before or after reading them (a lagging observation normaliser, spectral_norm's power
iteration vectors). A replay of a captured batch must start from that state as the step's forward found it, not
as it stands when the report runs (replay/modelstate.set_rng sets it, `preserved()` restores the live one after).

Which state a model has is learned on probed steps (steps 1-8, then sampled ones at least PROBE_GAP steps
apart: `probe` before the root's forward and `changed` after it): an int/float/bool attribute whose value changed,
a list or deque of numbers or tensors appended to, a tensor attribute that was replaced or written in place, a
buffer written in place (its version counter), a parameter written in place (its version counter or, through
`.data`, its norm; parameters only on steps 1-2 and probed sampled ones). A cache that is built once (a rotary table filled on the first
forward) changes on step 0 only, which is not probed. From then on each batch keeps a `snapshot` of those keys
(numbers and lists as they are; a tensor copied, or referenced when the forward replaces it and it is large;
within SNAPSHOT_BYTES and MAX_COPIES); the probed step that finds a number or a list changing keeps its value
from before the forward too (a flag the forward flips once, on a bad step). State larger than the budget, or
first changed after step 8 on a step that is not sampled, is replayed as it stands when the report runs (a
persistent buffer: as the capture's weights hold it, after the captured forward). The keys a capture writes
them with (capture.STATE_PREFIXES):

    "num:<module>.<attr>"     an int, float or bool attribute
    "list:<module>.<attr>"    a list or deque of numbers (its values as a 1-D tensor)
    "tlist:<module>.<attr>"   a list or deque of tensors of one shape (stacked)
    "tensor:<module>.<attr>"  a plain tensor attribute
    "buf:<module>.<name>"     a buffer
    "param:<module>.<name>"   a parameter the forward writes (a hand-written max-norm renormalisation, an EMA
                              codebook): the capture's weights take this value (record/autocapture.py)

Normalisation layers' running statistics are left out: a BatchNorm in training mode updates them without reading
them (its output is the batch's own statistics), and one in eval mode does not change them.
"""
from __future__ import annotations

import collections

import torch

__all__ = ["probe", "changed", "snapshot", "due", "params_due", "SNAPSHOT_BYTES", "MAX_COPIES", "MODULE_KEYS"]

SNAPSHOT_BYTES = 8 << 20   # per batch: larger state (a MoCo queue of 65536 keys) is left out
MAX_COPIES = 32            # ... and at most this many copies (an EMA teacher updated inside the forward: none of it)
REF_BYTES = 1 << 20        # a tensor the forward replaces is referenced above this size (a copy below it: the
#                            forward may also write it in place, e.g. zero a memory that went non-finite)
PROBE_GAP = 25             # sampled steps closer to the last probed one than this are not probed (`due`)
MAX_ITEMS = 1024           # a longer list is no state kept per batch (a log of every loss)
MODULE_KEYS = frozenset(vars(torch.nn.Module())) | {"training", "_compiled_call_impl"}
"""A module's own bookkeeping (hooks, parameters, buffers, children, mode): never state (replay/modelstate.py too)."""
_NORM = torch.nn.modules.batchnorm._NormBase
_NUM = (int, float, bool)
_SEQ = (list, collections.deque)
_SKIP = object()


def _fingerprint(v):
    if type(v) in _NUM:
        return v
    if v is None:  # (a memory not filled yet: a tensor attribute the forward sets for the first time)
        return None
    if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and not v.requires_grad:
        return (id(v), v._version)
    if type(v) in _SEQ and len(v) <= MAX_ITEMS and (not v or _items(v) is not None):
        return ("seq", id(v), len(v), id(v[-1]) if v else None)
    return _SKIP  # (a tensor in the autograd graph kept as an attribute is an output, e.g. an aux loss, not state)


def _items(v) -> str | None:
    """"num" for a sequence of numbers, "tensor" for one of plain tensors of one shape and dtype, else None."""
    first = v[0]
    if type(first) in _NUM:
        return "num" if all(type(x) in _NUM for x in v) else None
    if isinstance(first, torch.Tensor) and not first.requires_grad:
        return "tensor" if all(isinstance(x, torch.Tensor) and not x.requires_grad and x.shape == first.shape
                               and x.dtype == first.dtype for x in v) else None
    return None


def _kind(v) -> str:
    return "num:" if type(v) in _NUM else "list:" if type(v) in _SEQ else "tensor:"


def probe(model: torch.nn.Module, params: bool = True) -> dict:
    """Key -> (module, name, fingerprint, value) of every candidate piece of state, as it is now (`value`: a number,
    a sequence's copy, a tensor attribute itself); with `params`, "" -> the parameters' keys and their L2 norms
    (`_norms`: a parameter written through `.data` keeps its version counter)."""
    out = {}
    pkeys, ps = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.jit.ScriptModule):
            continue  # (TorchScript: left unwatched; its attribute dicts are wrappers without .get)
        pre = f"{name}." if name else ""
        for k, v in vars(mod).items():
            if k in MODULE_KEYS or k.startswith("__"):
                continue
            fp = _fingerprint(v)
            if fp is _SKIP:
                continue
            out[f"{_kind(v)}{pre}{k}"] = (mod, k, fp, list(v) if type(v) in _SEQ else v)
        if params:
            for k, p in mod._parameters.items():
                if p is not None and p.layout == torch.strided and not p.is_meta and type(p.detach()) is torch.Tensor:
                    key = f"param:{pre}{k}"
                    out[key] = (mod, k, (id(p), p._version), None)
                    pkeys.append(key)
                    ps.append(p)
        if isinstance(mod, _NORM):
            continue
        for k, b in mod._buffers.items():
            if b is not None:
                out[f"buf:{pre}{k}"] = (mod, k, (id(b), b._version), None)
    if params:
        out[""] = (pkeys, _norms(ps))
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


def changed(before: dict, model: torch.nn.Module) -> tuple[list, dict]:
    """([(key, module, name, copy)], {key: value before}) of the state the forward since `before` (a `probe`)
    changed; `copy`: the tensor was written in place (a snapshot must copy it), not replaced. A parameter counts
    when the forward wrote it (an in-place max-norm renormalisation, an EMA codebook update). The values before
    are what the probe held of the numbers, sequences and replaced tensors (for the probed batch's own snapshot)."""
    after = probe(model, params="" in before)
    out, seen, was = [], set(), {}
    moved = _moved(before[""], after[""]) if "" in before else set()
    for key, entry in after.items():
        old = before.get(key)
        if not key or old is None:
            continue
        mod, name, fp, _ = entry
        if key.startswith("param:"):
            p = mod._parameters.get(name)
            if (old[2] != fp or key in moved) and id(p) not in seen:
                seen.add(id(p))
                out.append((key, mod, name, True))
            continue
        if old[2] == fp or fp is None and not key.startswith("num:"):
            continue
        copy = isinstance(fp, tuple) and isinstance(old[2], tuple) and old[2][0] == fp[0] and fp[0] != "seq"
        out.append((key, mod, name, copy))
        if key.startswith(("num:", "list:")) or not copy and isinstance(old[3], torch.Tensor):
            was[key] = old[3]
    return out, was


def due(step: int, sampled: bool, last: int = -PROBE_GAP) -> bool:
    """Whether a step's forward is probed: the first routine steps (1-8), then a sampled one PROBE_GAP steps or more
    after the last probed step (`last`). With every=1 every step is sampled, and a probe on each cost more than a
    tenth of a small model's step (every module's attributes walked twice, the parameters' norms compared)."""
    return 1 <= step <= 8 or sampled and step > 0 and step - last >= PROBE_GAP


def params_due(step: int, sampled: bool) -> bool:
    """Whether a probe also reads the parameters' norms (one device read): steps 1-2 and sampled ones."""
    return 1 <= step <= 2 or sampled and step > 0


def snapshot(keys: list, was: dict | None = None) -> dict:
    """Key -> the state's value now (or, for the keys in `was`, the value before the forward that just ran):
    numbers and sequences as they are (a sequence copied: a list of numbers, or of tensors marked "tlist:"); a
    tensor copied, or kept as (tensor, its version) when the forward replaces it and it is larger than REF_BYTES
    (capture.write_capture leaves it out if it was written since); up to SNAPSHOT_BYTES and MAX_COPIES copies."""
    out = {}
    budget, copies = SNAPSHOT_BYTES, MAX_COPIES
    for key, mod, name, copy in keys:
        if was is not None and key in was:
            v = was[key]
        elif key.startswith("param:"):
            v = mod._parameters.get(name)
        elif key.startswith("buf:"):
            v = mod._buffers.get(name)
        else:
            v = vars(mod).get(name)
        if key.startswith("num:"):
            if type(v) in _NUM:
                out[key] = v
            continue
        if key.startswith("list:"):
            items = list(v) if type(v) in _SEQ and len(v) <= MAX_ITEMS else None
            kind = (_items(items) if items else "num") if items is not None else None
            if kind == "num":
                out[key] = items
            elif kind == "tensor" and sum(t.nelement() * t.element_size() for t in items) <= budget:
                budget -= sum(t.nelement() * t.element_size() for t in items)
                out["t" + key] = [t.detach() for t in items]
            continue
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or v.is_meta:
            continue
        nb = v.nelement() * v.element_size()
        if nb > budget:
            continue
        if copy or nb <= REF_BYTES:
            if not copies:
                continue
            copies -= 1
            out[key] = v.detach().clone()
        else:
            out[key] = (v.detach(), v._version)  # (the same version counter; no graph kept alive)
        budget -= nb
    return out
