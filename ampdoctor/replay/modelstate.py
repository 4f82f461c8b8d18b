"""What a replay sets on the model before its forward and gives back afterwards: the RNG states a capture holds
(torch's generators, Python's `random` and NumPy's when the forward draws from them, a generator the model holds),
the module state the captured forward found (record/modstate.py: counters, lists, memories, buffers), and
`preserved()`, which restores the caller's model exactly as it was (weights, buffers, modes, grads, RNG states, the
modules' other attributes).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import random
import sys

import torch

from ..capture import STATE_PREFIXES
from ..record.modstate import MODULE_KEYS
from ..tensors import unpack_np_rng, unpack_py_rng

__all__ = ["preserved", "set_rng"]


def _attributes(mod: torch.nn.Module) -> dict:
    """A module's own attributes besides its parameters, buffers, children and hooks, as the replay's forward may
    change them (a step counter, a memory kept as a plain tensor, a queue or deque, a torch.Generator it draws from): each
    value with what restores it (a tensor's values, a container's items, a generator's state)."""
    out = {}
    for k, v in vars(mod).items():
        if k in MODULE_KEYS:
            continue
        if isinstance(v, torch.Generator):
            keep = v.get_state()
        elif isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.layout == torch.strided \
                and not v.is_meta:
            keep = v.detach().clone()
        elif isinstance(v, collections.deque):
            keep = list(v)  # (a deque keeps its maxlen: restored in place)
        elif isinstance(v, (list, dict, set)):
            keep = type(v)(v)
        else:
            keep = None
        out[k] = (v, keep)
    return out


def _restore_attributes(mod: torch.nn.Module, saved: dict) -> None:
    for k in [k for k in vars(mod) if k not in MODULE_KEYS and k not in saved]:
        delattr(mod, k)  # (an attribute the replay's forward added)
    for k, (v, keep) in saved.items():
        mod.__dict__[k] = v
        if keep is None:
            continue
        if isinstance(v, torch.Generator):
            v.set_state(keep)
        elif isinstance(v, torch.Tensor):
            if v.shape == keep.shape:
                v.data.copy_(keep)  # (written in place: a memory bank's slots)
        elif isinstance(v, list):
            v[:] = keep
        elif isinstance(v, collections.deque):
            v.clear()
            v.extend(keep)
        else:
            v.clear()
            v.update(keep)


@contextlib.contextmanager
def preserved(model: torch.nn.Module):
    """Restore the model's weights and buffers (bitwise, the non-persistent ones too, and the tensor objects a
    forward reassigned), train/eval modes, .grad, the RNG states (torch's, Python's `random`, NumPy's global one:
    a forward may draw from them, e.g. Wav2Vec2's masks) and the modules' other attributes (a counter, a plain-tensor
    memory, a queue, a torch.Generator of the model's own: `_attributes`) on exit."""
    slots = [(mod, d, name, t, t.detach().clone()) for mod in model.modules()
             for d in (mod._parameters, mod._buffers) for name, t in list(d.items()) if t is not None]
    modes = {m: m.training for m in model.modules()}
    py_rng = random.getstate()
    np_mod = sys.modules.get("numpy")
    np_rng = np_mod.random.get_state() if np_mod is not None else None
    grads = {p: (p.grad, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    attrs = [(mod, _attributes(mod)) for mod in model.modules()]
    try:
        yield
    finally:
        with torch.no_grad():
            for mod, d, name, t, v in slots:
                d[name] = t  # (a forward that replaced the buffer object: the module gets its own back)
                t.data.copy_(v)
            for mod, saved in attrs:
                _restore_attributes(mod, saved)
        random.setstate(py_rng)
        if np_rng is not None:
            np_mod.random.set_state(np_rng)
        for m, t in modes.items():
            m.training = t
        for p, (g, val) in grads.items():
            p.grad = g
            if g is not None:
                g.data.copy_(val)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _set_state(model: torch.nn.Module, key: str, v: torch.Tensor) -> None:
    """One piece of module state a capture holds (capture.STATE_PREFIXES; record/modstate.py), set where the model
    has the same kind of thing under that name: a number attribute keeps its Python type, a tensor attribute (or
    one that is None now: a memory not filled yet) gets a copy, a buffer is written in place (replaced when its
    shape changed), a list or deque gets its items back in place. preserved() restores what was there."""
    kind, _, path = key.partition(":")
    mod_name, _, attr = path.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        return
    with torch.no_grad():
        if kind == "num":
            cur = vars(mod).get(attr)
            if type(cur) in (int, float, bool):
                mod.__dict__[attr] = type(cur)(v.item())
        elif kind in ("list", "tlist"):
            cur = vars(mod).get(attr)
            if type(cur) in (list, collections.deque):
                items = v.tolist() if kind == "list" else [t.to(_device(mod, model), copy=True) for t in v.unbind(0)]
                cur.clear()
                cur.extend(items)  # (in place: a deque keeps its maxlen; preserved() restores the items)
        elif kind == "buf":
            b = mod._buffers.get(attr)
            if isinstance(b, torch.Tensor) and b.layout == torch.strided and not b.is_meta:
                if b.shape == v.shape and b.dtype == v.dtype:
                    b.copy_(v)
                else:
                    mod._buffers[attr] = v.to(b.device, copy=True)
        elif kind == "tensor":
            cur = vars(mod).get(attr, _MISSING)
            if cur is None or isinstance(cur, torch.Tensor) and not isinstance(cur, torch.nn.Parameter):
                dev = cur.device if isinstance(cur, torch.Tensor) else _device(mod, model)
                mod.__dict__[attr] = v.to(dev, copy=True)


_MISSING = object()


def _device(mod: torch.nn.Module, model: torch.nn.Module) -> torch.device:
    """Where a module's state goes: its own tensors' device, else the model's, else the CPU."""
    return next((t.device for t in itertools.chain(mod.parameters(), mod.buffers(), model.parameters())),
                torch.device("cpu"))


def set_rng(rng: dict, model: torch.nn.Module | None = None) -> None:
    """The RNG states a capture holds, as they were before the captured forward: torch's CPU and CUDA generators,
    Python's `random` and NumPy's global RNG when the model's forward draws from them, and a torch.Generator the
    model holds ("gen:<module>.<attribute>", set on `model`'s own when it has one there); and the module state the
    captured forward found (a counter, a memory, a buffer it updates: `_set_state`). preserved() restores all of
    them after the replay."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        for k, s in rng.items():
            if k.startswith("cuda:") and int(k[5:]) < torch.cuda.device_count():
                torch.cuda.set_rng_state(s, int(k[5:]))
    if "py" in rng:
        random.setstate(unpack_py_rng(rng["py"]))
    if "np" in rng and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(unpack_np_rng(rng["np"]))
    for k, s in rng.items():
        if k.startswith(STATE_PREFIXES) and model is not None:
            _set_state(model, k, s)
    for k, s in rng.items():
        if k.startswith("gen:") and model is not None:
            mod_name, _, attr = k[4:].rpartition(".")
            try:
                g = vars(model.get_submodule(mod_name)).get(attr)
            except AttributeError:
                continue
            if isinstance(g, torch.Generator):
                g.set_state(s)
