"""Small tensor and context helpers shared by the hooks: nested-output flattening, autocast state, RNG
state, the model's own loss, and where in the user's code an exception was raised."""
from __future__ import annotations

import dataclasses
import random
import struct
import sys

import torch

__all__ = ["flatten_tensors", "copy_tensors", "input_versions", "input_writes", "local", "is_sharded", "module_type", "dt_name", "loss_of", "rng_state", "pack_py_rng", "unpack_py_rng", "pack_np_rng", "unpack_np_rng", "shallow", "autocast_dtype", "autocast_str",
           "ac_from_str", "tb_module", "tb_location"]


def flatten_tensors(obj, out: list, depth: int = 0) -> list:
    """Tensors inside nested tuples/lists/dicts/dataclasses (Hugging Face ModelOutput included) and the parameter
    tensors a torch.distributions object holds (a policy's or a forecaster's `Normal(loc, scale)`: the tensors
    already in its attributes; none of its lazy properties is computed)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        pass
    elif isinstance(obj, dict):
        for v in obj.values():
            flatten_tensors(v, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            flatten_tensors(v, out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            flatten_tensors(getattr(obj, f.name, None), out, depth + 1)
    elif isinstance(obj, torch.distributions.Distribution):
        out.extend(v for v in vars(obj).values() if isinstance(v, torch.Tensor))
    return out


def copy_tensors(obj, depth: int = 0):
    """`obj` with every tensor inside nested tuples/lists/dicts replaced by a detached copy (the rest as is)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if depth > 6:
        return obj
    if isinstance(obj, dict):
        return {k: copy_tensors(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_tensors(v, depth + 1) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(copy_tensors(v, depth + 1) for v in obj)
    return obj


def input_versions(obj) -> list:
    """(tensor, version counter) of each tensor in `obj` that has one (inference tensors have none)."""
    out = []
    for t in flatten_tensors(obj, []):
        if not t.is_inference():
            out.append((t, t._version))
    return out


def input_writes(versions: list) -> bool:
    """Whether any tensor of `input_versions` was written in place since (its version counter moved)."""
    return any(t._version != v for t, v in versions)


def is_sharded(t) -> bool:
    """A DTensor (FSDP2, tensor parallel): this rank holds only part of it."""
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise). ampdoctor measures local shards only: a
    collective inside the training step could hang a run whose ranks sample different steps."""
    return t.to_local() if is_sharded(t) else t


_TYPES: dict = {}


def module_type(cls: type, qualified: bool = False) -> str:
    """A module class's name as the user wrote it: FSDP2's `fully_shard` swaps a module's class for a generated
    subclass (`FSDPLinear`); that is reported as the user's class (`Linear`)."""
    key = (cls, qualified)
    if key not in _TYPES:
        c = cls
        if c.__module__.startswith("torch.distributed.fsdp") and c.__name__.startswith("FSDP") and len(c.__mro__) > 2:
            c = c.__mro__[2] if c.__mro__[1].__name__ == "FSDPModule" else c.__mro__[1]
        _TYPES[key] = f"{c.__module__}.{c.__qualname__}" if qualified else c.__name__
    return _TYPES[key]


_DT_NAMES: dict = {}


def dt_name(d: torch.dtype) -> str:
    name = _DT_NAMES.get(d)
    if name is None:
        name = _DT_NAMES[d] = str(d).replace("torch.", "")
    return name


def loss_of(output):
    """The model's own loss: a scalar output, `.loss`, or output["loss"]."""
    t = output
    if not isinstance(t, torch.Tensor):
        t = getattr(output, "loss", None)
        if t is None and isinstance(output, dict):
            t = output.get("loss")
    if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
        return t.detach().reshape(())
    return None


def rng_state(extra=None):
    """The CPU and every initialised CUDA generator's state (what `torch.cuda.get_rng_state_all()` returns,
    without its per-device lookups: this runs at every step's forward). `extra`: (python, numpy, generators) --
    what else the model's forward draws from (record/modulehooks.py finds out): Python's `random`, NumPy's global
    RNG (packed as bytes, `pack_py_rng`/`pack_np_rng`) and torch.Generators the model holds ([(name, generator)])."""
    s = {"cpu": torch.default_generator.get_state()}  # (what torch.get_rng_state() returns, without its wrapper)
    if torch.cuda.is_initialized():
        s["cuda"] = [g.get_state() for g in torch.cuda.default_generators]
    if extra is not None:
        py, np_rng, gens = extra
        if py:
            s["py"] = pack_py_rng(random.getstate())
        if np_rng and "numpy" in sys.modules:
            s["np"] = pack_np_rng(sys.modules["numpy"].random.get_state())
        for name, g in gens:
            s[f"gen:{name}"] = g.get_state()
    return s


_PY_HEAD = struct.Struct("<iBd")   # version, has gauss_next, gauss_next; then 625 uint32 (the state and its index)
_NP_HEAD = struct.Struct("<iid")   # pos, has_gauss, cached_gaussian; then 624 uint32 keys


def pack_py_rng(state) -> torch.Tensor:
    """Python `random`'s state (random.getstate()) as a uint8 tensor, for a capture's RNG states."""
    version, internal, gauss = state
    raw = _PY_HEAD.pack(version, gauss is not None, gauss or 0.0) + struct.pack(f"<{len(internal)}I", *internal)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack_py_rng(t: torch.Tensor):
    """random.setstate()'s argument from `pack_py_rng`'s tensor; ValueError when it is not one."""
    raw = bytes(t.numpy().tobytes()) if t.dtype == torch.uint8 and t.dim() == 1 else b""
    if len(raw) != _PY_HEAD.size + 625 * 4:
        raise ValueError("not a packed Python RNG state")
    version, has, gauss = _PY_HEAD.unpack_from(raw)
    return version, struct.unpack_from("<625I", raw, _PY_HEAD.size), gauss if has else None


def pack_np_rng(state) -> torch.Tensor:
    """NumPy's global RNG state (np.random.get_state(): MT19937) as a uint8 tensor."""
    _, keys, pos, has_gauss, cached = state
    raw = _NP_HEAD.pack(int(pos), int(has_gauss), float(cached)) + bytes(keys.astype("<u4").tobytes())
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack_np_rng(t: torch.Tensor):
    """np.random.set_state()'s argument from `pack_np_rng`'s tensor; ValueError when it is not one."""
    import numpy as np
    raw = bytes(t.numpy().tobytes()) if t.dtype == torch.uint8 and t.dim() == 1 else b""
    if len(raw) != _NP_HEAD.size + 624 * 4:
        raise ValueError("not a packed NumPy RNG state")
    pos, has_gauss, cached = _NP_HEAD.unpack_from(raw)
    if not 0 <= pos <= 624 or has_gauss not in (0, 1):
        raise ValueError("not a packed NumPy RNG state")
    return "MT19937", np.frombuffer(raw[_NP_HEAD.size:], dtype="<u4").astype(np.uint32), pos, has_gauss, cached


def autocast_dtype(device_type: str):
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):
        pass
    return None


def autocast_str() -> str | None:
    for dev in ("cuda", "cpu"):
        d = autocast_dtype(dev)
        if d is not None:
            return f"{dev}:{dt_name(d)}"
    return None


def ac_from_str(s: str | None):
    if not s:
        return None
    return getattr(torch, s.split(":")[1], None)


def tb_module(exc: BaseException, names: dict, default: str) -> str:
    """The innermost watched module whose forward is on the traceback (found through `self` in its frame)."""
    tb = exc.__traceback__
    best = default
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if obj is not None and id(obj) in names and tb.tb_frame.f_code.co_name == "forward":
            best = names[id(obj)]
        tb = tb.tb_next
    return best


def tb_location(exc: BaseException) -> tuple[str | None, int | None]:
    """The deepest traceback frame in user code (outside torch and ampdoctor)."""
    from .record.monitor import _PKG_DIR, _TORCH_DIR
    tb = exc.__traceback__
    best = (None, None)
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not (fn.startswith(_PKG_DIR) or fn.startswith(_TORCH_DIR)):
            best = (fn, tb.tb_lineno)
        tb = tb.tb_next
    return best


def shallow(x):
    """`x` (a model call's args tuple or kwargs dict) with the dicts and lists directly in it copied: what the
    caller passed, kept as it was even when the forward then changes a container it received. Tensors and other
    objects are the caller's own. (Every step: nothing deeper.)"""
    if type(x) is tuple:
        return tuple(dict(v) if type(v) is dict else list(v) if type(v) is list else v for v in x) \
            if any(type(v) is dict or type(v) is list for v in x) else x
    if type(x) is dict:
        return {k: dict(v) if type(v) is dict else list(v) if type(v) is list else v for k, v in x.items()}
    return x


def nonfinite_input(args, kwargs) -> dict | None:
    """The first floating-point tensor among a model call's arguments that holds inf/NaN, counted:
    `{"arg": position or keyword, "nan": n, "posinf": n, "neginf": n, "numel": n, "dtype": name}`, else None.
    A tensor whose only non-finite values are -inf and whose finite values are none above 0 is an additive mask
    or bias (BERT's `(1 - mask) * finfo.min`, cast to fp16, is -inf where padded; a causal mask filled with -inf),
    not bad data: what a module makes of it (a softmax over a row of -inf only) is that module's. With positive
    values beside the -inf (a generator's overflowed sample fed to a critic) it is data."""
    named = [(i, a) for i, a in enumerate(args or ())] + [(k, v) for k, v in (kwargs or {}).items()]
    for key, obj in named:
        for t in flatten_tensors(obj, []):
            if not t.is_floating_point() or not t.numel() or t.is_meta:
                continue
            try:
                with torch.no_grad():
                    t = t.detach()
                    if bool(torch.isfinite(t).all()):
                        continue
                    nan, pinf, ninf = int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()), int(torch.isneginf(t).sum())
                    mask = not nan and not pinf and not bool((torch.where(torch.isneginf(t), 0, t) > 0).any())
            except RuntimeError:  # a tensor subclass or device that cannot answer: not this check's business
                continue
            if mask:
                continue
            return {"arg": key, "nan": nan, "posinf": pinf, "neginf": ninf, "numel": t.numel(),
                    "dtype": str(t.dtype).replace("torch.", "")}
    return None
