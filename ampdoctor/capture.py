"""Captures (format v1): one batch plus the state needed to re-run it, written and read back safely.

A capture is a directory:

    manifest.json          format "ampdoctor-capture", format_version 1, versions, model class, HF config,
                           autocast {device, dtype, enabled}, scaler state, step, the structure of args/kwargs
                           (JSON, tensors as {"__tensor__": key}; a namedtuple as its type's name, fields and
                           items: torch's PackedSequence comes back as itself, any other as a namedtuple of the
                           same fields, no class a capture names is imported), and per file its size and sha256
    tensors.safetensors    the batch tensors ("a/…", "k/…"), RNG states taken before the forward ("rng/…") and,
                           from a watch, the gradient that reached the model's outputs ("g/…", manifest grad_out)
                           and the state the forward reads besides its arguments, as the forward found it
                           ("state/num:…", "state/tensor:…", "state/buf:…", manifest state: record/modstate.py)
    state.safetensors      the model's weights and buffers (state_dict); a sparse one (COO, CSR: a GCN's adjacency)
                           as its parts in tensors.safetensors ("sp/…", manifest sparse_state), as a sparse
                           argument's are ("__sparse__")

The checks a capture passes before it is read are ampdoctor/capturecheck.py; the args/kwargs structure's JSON
(its markers, `relive` for a watch's in-process replay) is ampdoctor/capturestruct.py. Nothing is pickled, and loading
never imports or calls anything a capture names (the model is rebuilt, if
at all, by replay/hfbuild.py from a Hugging Face config). `load_capture` also reads `.pt` files named by a
manifest, only through `torch.load(weights_only=True)`, which refuses a payload that would run code. Before a
tensor file is read its safetensors header is checked against the file's size (offsets contiguous, sizes
matching dtypes and shapes), a sparse file is refused, and so is one larger than the memory available. JSON is
parsed with a depth bound. Every check that fails raises `BadInput` with one line. Copies of tensors happen only
in `write_capture`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .capturecheck import (FORMAT_NAME, FORMAT_VERSION, MAX_DEPTH, MAX_MANIFEST_BYTES, _FILE_ROLES,
                           _check_manifest, _check_safetensors, _need, _read_tensors, _safe_file)
from .capturestruct import LEAF as _LEAF, Opaque, decode as _decode, decode_sparse as _decode_sparse, \
    encode as _encode, encode_sparse as _encode_sparse, relive
from .errors import BadInput
from .fsutil import atomic_write_bytes, atomic_write_text, loads_bounded, read_regular
from .tensors import unpack_np_rng, unpack_py_rng

__all__ = ["Capture", "Opaque", "save_batch", "write_capture", "load_capture", "relive", "FORMAT_NAME", "FORMAT_VERSION"]

@dataclass
class Capture:
    """A loaded capture. `args`/`kwargs` are rebuilt with CPU tensors; `rng` maps "cpu"/"cuda:<i>" (and "py", "np",
    "gen:<module>.<attr>") to RNG states, and the keys of STATE_PREFIXES to the module state the captured forward
    found (a counter as a 0-d tensor, a memory, a buffer: replay/modelstate.set_rng sets both)."""

    path: str
    manifest: dict
    args: tuple
    kwargs: dict
    state_dict: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    autocast: dict = field(default_factory=dict)
    scaler_state: dict | None = None
    step: int | None = None
    grad_out: list | None = None  # the gradient into each of the step's first floating outputs (see write_capture)

    @property
    def model_class(self) -> str:
        return self.manifest.get("model_class", "")

    @property
    def hf_config(self) -> dict | None:
        return self.manifest.get("hf_config")


# ----------------------------------------------------------------------------------------------- writing
def _ampdoctor_version() -> str:
    try:
        from importlib.metadata import version
        return version("ampdoctor")
    except Exception:
        import sys
        return str(getattr(sys.modules.get("ampdoctor"), "__version__", "0+unknown"))


def _autocast_now() -> dict:
    for dev in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(dev):
                return {"device": dev, "dtype": str(torch.get_autocast_dtype(dev)).replace("torch.", ""),
                        "enabled": True}
        except (RuntimeError, TypeError):
            continue
    return {"device": "cpu", "dtype": "float16", "enabled": False}


STATE_PREFIXES = ("num:", "tensor:", "buf:", "list:", "tlist:")
"""Keys of a batch's RNG dict (and of a capture's "state/" tensors) that hold module state, not RNG states."""
_NUM_DTYPES = (torch.bool, torch.int64, torch.float64)


def _state_tensor(v) -> torch.Tensor:
    """A state entry's value as a tensor: a tensor itself, a number 0-d, a list of numbers 1-D (bool, int64 or
    float64 as the values are), a list of tensors ("tlist:") stacked."""
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True).contiguous()
    if isinstance(v, list):
        if v and isinstance(v[0], torch.Tensor):
            return torch.stack([t.detach().to("cpu") for t in v]).contiguous()
        dt = torch.bool if all(isinstance(x, bool) for x in v) and v else torch.int64 if all(
            isinstance(x, int) for x in v) and v else torch.float64
        return torch.tensor(v, dtype=dt).reshape(-1)
    return torch.tensor(v, dtype=torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int)
                        else torch.float64)


def _rng_now() -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda:{i}"] = s
    return rng


def _norm_rng(rng: dict) -> dict[str, torch.Tensor]:
    """{"cpu": state, "cuda:0": state, ...}; a list under "cuda" (get_rng_state_all) is spread by index."""
    out = {}
    for k, v in rng.items():
        if isinstance(v, (list, tuple)):
            out.update({f"{k}:{i}": s for i, s in enumerate(v)})
        elif isinstance(v, torch.Tensor):
            out[str(k)] = v
    return out


def _norm_autocast(ac: dict | str | None) -> dict:
    """A dict {device, dtype, enabled}, a "device:dtype" string (as a watch records it), or None (= now)."""
    if isinstance(ac, dict):
        return {"device": str(ac.get("device", "cpu")), "dtype": str(ac.get("dtype", "float16")).replace("torch.", ""),
                "enabled": bool(ac.get("enabled", True))}
    if isinstance(ac, str) and ":" in ac:
        dev, dt = ac.split(":", 1)
        return {"device": dev, "dtype": dt.replace("torch.", ""), "enabled": True}
    return _autocast_now()


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v if isinstance(v, _LEAF) else str(v)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_capture(path: str | os.PathLike, model: torch.nn.Module, args: tuple | list, kwargs: dict | None, *,
                  state_dict: dict | None = None, rng: dict | None = None, autocast: dict | None = None,
                  scaler_state: dict | None = None, step: int | None = None, extra: dict | None = None,
                  grad_out: list | None = None, opaque: bool = False) -> str:
    """Write a capture directory at `path` and return it. `state_dict`/`rng` default to the model's weights and
    the RNG states now; a watch passes the ones it took before the bad step's forward, and `grad_out`: the
    gradient that reached each of the model's first floating outputs (None where none did), so that a replay
    without the user's loss function still runs the step's own backward. `opaque`: an argument a capture cannot
    hold is written as a placeholder naming its type (a watch's capture, replayed in-process with the live object)
    instead of refused (see `_encode`)."""
    from safetensors.torch import save as st_save
    path = os.fspath(path)
    tensors: dict[str, torch.Tensor] = {}
    structure = {"args": _encode(tuple(args), "a", tensors, "args", opaque),
                 "kwargs": _encode(dict(kwargs or {}), "k", tensors, "kwargs", opaque)}
    rng = rng if rng is not None else _rng_now()
    for name, s in _norm_rng({k: v for k, v in rng.items() if not str(k).startswith(STATE_PREFIXES)}).items():
        tensors[f"rng/{name}"] = s.detach().to("cpu", copy=True).contiguous()
    for k, v in rng.items():
        if isinstance(v, tuple):  # (a tensor the forward replaces, its version then): left out if written since
            v = v[0] if len(v) == 2 and isinstance(v[0], torch.Tensor) and v[0]._version == v[1] else None
        if str(k).startswith(STATE_PREFIXES) and v is not None:
            tensors[f"state/{k}"] = _state_tensor(v)
    gkeys = None
    if grad_out:
        gkeys = [None if g is None else f"g/{i}" for i, g in enumerate(grad_out)]
        for k, g in zip(gkeys, grad_out):
            if k is not None:
                tensors[k] = g.detach().to("cpu", copy=True).contiguous()
    sd = state_dict if state_dict is not None else model.state_dict()
    # (a tensor on the meta device holds no values: a template module whose weights torch.func.functional_call
    # supplies; the replay's model has its own meta tensor there, see replay/modelio.load_weights)
    state, sparse = {}, {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor) or v.is_meta:
            continue
        if v.layout != torch.strided:  # (a sparse buffer: a GCN's adjacency) its parts go with the batch tensors
            sp = _encode_sparse(v, f"sp/{len(sparse)}", tensors, f"the model's state entry {k!r}", opaque)
            if sp is not None:
                sparse[k] = sp
            continue
        state[k] = v.detach().to("cpu", copy=True).contiguous()
    os.makedirs(path, exist_ok=True)  # (only now: a batch or state that cannot be captured leaves nothing behind)
    files = {}
    for role, data in (("tensors", tensors), ("state", state)):
        fname = f"{role}.safetensors"
        atomic_write_bytes(os.path.join(path, fname), st_save(data))
        fp = os.path.join(path, fname)
        files[role] = {"name": fname, "bytes": os.path.getsize(fp), "sha256": _sha256(fp)}
    cfg = getattr(model, "config", None)
    hf_config = _plain(cfg.to_dict()) if hasattr(cfg, "to_dict") else None
    cls = type(model)
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "torch_version": torch.__version__,
        "ampdoctor_version": _ampdoctor_version(), "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "hf_config": hf_config, "autocast": _norm_autocast(autocast),
        "scaler": _plain(scaler_state) if scaler_state is not None else None, "step": step,
        "training": bool(model.training),
        "eval_modules": [n for n, m in model.named_modules() if not m.training and model.training],
        "structure": structure, "rng": sorted(k[4:] for k in tensors if k.startswith("rng/")),
        "state": sorted(k[6:] for k in tensors if k.startswith("state/")),
        "files": files, "extra": _plain(extra or {}), "grad_out": gkeys, "sparse_state": sparse or None,
    }
    atomic_write_text(os.path.join(path, "manifest.json"), json.dumps(manifest, indent=1))
    return path


def save_batch(path: str | os.PathLike, model: torch.nn.Module, *args, **kwargs) -> str:
    """Capture one batch (`model(*args, **kwargs)`), the model's weights and the RNG states now, for `replay`."""
    if not isinstance(model, torch.nn.Module):
        raise BadInput(f"save_batch needs an nn.Module as its second argument, got {type(model).__qualname__}")
    _refuse_foreign_dir(os.fspath(path))
    return write_capture(path, model, args, kwargs)


_CAPTURE_FILES = {"manifest.json", "tensors.safetensors", "state.safetensors"}


def _refuse_foreign_dir(path: str) -> None:
    """save_batch writes only into a new or empty directory or over an earlier capture: never into a run directory
    or a folder of the user's files (its manifest.json would be replaced)."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise BadInput(f"{path}: exists and is not a directory; save_batch writes a capture directory")
    names = set(os.listdir(path))
    if not names:
        return
    fmt = None
    if names <= _CAPTURE_FILES and "manifest.json" in names:
        try:
            with open(os.path.join(path, "manifest.json"), "rb") as f:
                fmt = json.loads(f.read(MAX_MANIFEST_BYTES + 1)).get("format")
        except (OSError, ValueError, AttributeError):
            fmt = None
    if fmt != FORMAT_NAME:
        raise BadInput(f"{path}: not empty and not an earlier capture ({', '.join(sorted(names)[:3])}"
                       f"{', ...' if len(names) > 3 else ''}); save_batch refuses to write over it: pass a new path")


# ----------------------------------------------------------------------------------------------- reading
def load_capture(path: str | os.PathLike) -> Capture:
    """Read and validate a capture directory. Raises `BadInput` (one line) on anything unusable."""
    cap = os.fspath(path)
    _need(os.path.isdir(cap), "is not a directory (expected a capture written by save_batch or a watch)", cap)
    mp = _safe_file(cap, "manifest.json", cap)
    raw = read_regular(mp, "capture manifest", MAX_MANIFEST_BYTES)
    manifest = loads_bounded(raw, f"capture {cap}: manifest.json", MAX_DEPTH)
    _check_manifest(manifest, cap)
    loaded = {}
    for role in _FILE_ROLES:
        f = manifest["files"][role]
        fp = _safe_file(cap, f["name"], cap)
        size = os.path.getsize(fp)
        _need(size == f["bytes"], f"{f['name']} is {size} bytes but the manifest says {f['bytes']} "
              "(truncated or replaced)", cap)
        if fp.endswith(".safetensors"):
            _check_safetensors(fp, cap)  # cheap header and size checks before hashing or reading any data
        if f.get("sha256"):
            _need(_sha256(fp) == f["sha256"], f"{f['name']} does not match its sha256 (corrupt)", cap)
        loaded[role] = _read_tensors(fp, cap)
    tensors = loaded["tensors"]
    st = manifest["structure"]
    args = _decode(st["args"], tensors, cap)
    kwargs = _decode(st["kwargs"], tensors, cap)
    _need(isinstance(args, tuple) and isinstance(kwargs, dict), "structure args/kwargs have the wrong shape", cap)
    _need(all(isinstance(k, str) for k in kwargs), "structure kwargs keys must be strings", cap)
    rng = {k[4:]: v for k, v in tensors.items() if k.startswith("rng/")}
    for k, v in rng.items():
        _need(v.dtype == torch.uint8 and v.dim() == 1, f"RNG state {k} is not a 1-D uint8 tensor", cap)
        if k in ("py", "np"):  # Python's / NumPy's RNG, packed (tensors.pack_py_rng / pack_np_rng)
            try:
                (unpack_py_rng if k == "py" else unpack_np_rng)(v)
            except (ValueError, struct.error):
                _need(False, f"RNG state {k} is not a valid {'Python' if k == 'py' else 'NumPy'} RNG state", cap)
        if k == "cpu":  # (torch checks a CPU generator's state itself; a CUDA one is checked when it is set)
            try:
                torch.Generator().set_state(v)
            except (RuntimeError, ValueError):
                _need(False, f"RNG state {k} is not a valid CPU generator state", cap)
    for k, v in tensors.items():
        if k.startswith("state/"):
            k = k[6:]
            _need(k.startswith(STATE_PREFIXES), f"state entry {k!r} is not one ampdoctor writes", cap)
            _need(not k.startswith("num:") or v.dim() == 0 and v.dtype in _NUM_DTYPES,
                  f"state entry {k} is not a number", cap)
            _need(not k.startswith("list:") or v.dim() == 1 and v.dtype in _NUM_DTYPES,
                  f"state entry {k} is not a list of numbers", cap)
            _need(not k.startswith("tlist:") or v.dim() >= 1, f"state entry {k} is not a list of tensors", cap)
            rng[k] = v
    sc = manifest.get("scaler")
    _need(sc is None or isinstance(sc, dict), "manifest scaler must be an object", cap)
    for key in ("scale", "backoff_factor", "growth_factor"):
        v = (sc or {}).get(key)
        _need(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
              f"manifest scaler.{key} must be a finite positive number", cap)
    gkeys = manifest.get("grad_out")
    _need(gkeys is None or isinstance(gkeys, list) and len(gkeys) <= 16 and all(
        k is None or isinstance(k, str) and k in tensors and tensors[k].is_floating_point() for k in gkeys),
        "manifest grad_out must list stored floating tensors", cap)
    state_dict = dict(loaded["state"])
    sparse = manifest.get("sparse_state")
    _need(sparse is None or isinstance(sparse, dict) and len(sparse) <= 4096, "manifest sparse_state must be an "
          "object", cap)
    for k, sp in (sparse or {}).items():
        _need(k not in state_dict, f"state entry {k!r} is stored twice", cap)
        state_dict[k] = _decode_sparse(sp, tensors, cap)
    return Capture(path=cap, manifest=manifest, args=args, kwargs=kwargs, state_dict=state_dict, rng=rng,
                   autocast=dict(manifest["autocast"]), scaler_state=manifest.get("scaler"),
                   step=manifest.get("step"), grad_out=[None if k is None else tensors[k] for k in gkeys]
                   if gkeys else None)
