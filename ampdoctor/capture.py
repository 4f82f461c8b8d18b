"""Captures (format v1): one batch plus the state needed to re-run it, written and read back safely.

A capture is a directory:

    manifest.json          format "ampdoctor-capture", format_version 1, versions, model class, HF config,
                           autocast {device, dtype, enabled}, scaler state, step, the structure of args/kwargs
                           (JSON, tensors as {"__tensor__": key}; a namedtuple as its type's name, fields and
                           items: torch's PackedSequence comes back as itself, any other as a namedtuple of the
                           same fields, no class a capture names is imported), and per file its size and sha256
    tensors.safetensors    the batch tensors ("a/…", "k/…"), RNG states taken before the forward ("rng/…") and,
                           from a watch, the gradient that reached the model's outputs ("g/…", manifest grad_out)
    state.safetensors      the model's weights and buffers (state_dict)

The checks a capture passes before it is read are ampdoctor/capturecheck.py. Nothing is pickled, and loading
never imports or calls anything a capture names (the model is rebuilt, if
at all, by replay/hfbuild.py from a Hugging Face config). `load_capture` also reads `.pt` files named by a
manifest, only through `torch.load(weights_only=True)`, which refuses a payload that would run code. Before a
tensor file is read its safetensors header is checked against the file's size (offsets contiguous, sizes
matching dtypes and shapes), a sparse file is refused, and so is one larger than the memory available. JSON is
parsed with a depth bound. Every check that fails raises `BadInput` with one line. Copies of tensors happen only
in `write_capture`.
"""
from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import enum
import hashlib
import json
import keyword
import math
import os
import struct
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .capturecheck import (FORMAT_NAME, FORMAT_VERSION, MAX_DEPTH, MAX_MANIFEST_BYTES, _FILE_ROLES,
                           _check_manifest, _check_safetensors, _need, _read_tensors, _safe_file)
from .errors import BadInput
from .fsutil import atomic_write_bytes, atomic_write_text, loads_bounded, read_regular
from .tensors import unpack_np_rng, unpack_py_rng

__all__ = ["Capture", "Opaque", "save_batch", "write_capture", "load_capture", "relive", "FORMAT_NAME", "FORMAT_VERSION"]

_LEAF = (int, float, bool, str, type(None))


@dataclass
class Capture:
    """A loaded capture. `args`/`kwargs` are rebuilt with CPU tensors; `rng` maps "cpu"/"cuda:<i>" to states."""

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


def _encode(obj: Any, key: str, tensors: dict, where: str, opaque: bool = False) -> Any:
    """Turn args/kwargs into JSON with tensor placeholders; tensors are copied to CPU into `tensors`. What JSON
    cannot hold as it is goes in under a marker that says what it was (see `_decode`); an object no marker fits (a
    callable, a class of the user's) is an `__opaque__` placeholder naming its type when `opaque` (a watch's capture: it is still written,
    the in-process replay gives the live object back, `relive`; a replay from disk says so in one line), else
    BadInput (save_batch)."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key, "requires_grad": bool(obj.requires_grad), "device": str(obj.device)}
    if isinstance(obj, enum.Enum):  # (before str/int: a str- or int-mixin member is one too)
        value = obj.value if isinstance(obj.value, _LEAF) and not isinstance(obj.value, float) else None
        return {"__enum__": {"type": _type_name(obj), "name": str(obj.name), "value": value}}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": str(obj)}
    if isinstance(obj, _LEAF):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, f"{key}.{i}", tensors, f"{where}[{i}]", opaque) for i, v in enumerate(obj)]
        fields = getattr(type(obj), "_fields", None)
        if isinstance(obj, tuple) and isinstance(fields, tuple) and len(fields) == len(items) and all(
                isinstance(f, str) for f in fields):
            # a namedtuple (torch's PackedSequence: nn.GRU/LSTM test its class): its fields and its type's name
            return {"__namedtuple__": {"type": _type_name(obj), "fields": list(fields), "items": items}}
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, (dict, collections.abc.Mapping, types.SimpleNamespace)) or (
            dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        if isinstance(obj, types.SimpleNamespace):
            d, mark = vars(obj), "__namespace__"
        elif isinstance(obj, (dict, collections.abc.Mapping)):
            d, mark = obj, "__dict__" if type(obj) is dict else "__mapping__"
        else:
            d, mark = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, "__dataclass__"
        pairs = []
        for k, v in d.items():
            kk = k if isinstance(k, (str, int)) and not isinstance(k, (bool, enum.Enum)) else \
                _encode(k, f"{key}.k{len(pairs)}", tensors, f"{where} key {k!r}", opaque)
            pairs.append([kk, _encode(v, f"{key}.{len(pairs) if kk is not k else k}", tensors, f"{where}[{k!r}]",
                                      opaque)])
        if mark == "__dict__":
            return {"__dict__": pairs}
        return {mark: {"type": _type_name(obj), "pairs": pairs}}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).replace("torch.", "")}
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj)).clone()
        return {"__ndarray__": key}
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return {"__npscalar__": {"dtype": obj.dtype.str, "value": obj.item()}}
    if not opaque:  # (save_batch: a capture made to be replayed from disk)
        raise BadInput(f"cannot capture {where}: unsupported type {type(obj).__qualname__} (tensors, numbers, str, None, "
                       "lists, tuples, dicts, dataclasses, enums, SimpleNamespace and numpy arrays are supported)")
    return {"__opaque__": {"type": _type_name(obj), "where": where[:200]}}


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls.__name__)}"[:200]


def _autocast_now() -> dict:
    for dev in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(dev):
                return {"device": dev, "dtype": str(torch.get_autocast_dtype(dev)).replace("torch.", ""),
                        "enabled": True}
        except (RuntimeError, TypeError):
            continue
    return {"device": "cpu", "dtype": "float16", "enabled": False}


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
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    structure = {"args": _encode(tuple(args), "a", tensors, "args", opaque),
                 "kwargs": _encode(dict(kwargs or {}), "k", tensors, "kwargs", opaque)}
    for name, s in _norm_rng(rng if rng is not None else _rng_now()).items():
        tensors[f"rng/{name}"] = s.detach().to("cpu", copy=True).contiguous()
    gkeys = None
    if grad_out:
        gkeys = [None if g is None else f"g/{i}" for i, g in enumerate(grad_out)]
        for k, g in zip(gkeys, grad_out):
            if k is not None:
                tensors[k] = g.detach().to("cpu", copy=True).contiguous()
    sd = state_dict if state_dict is not None else model.state_dict()
    # (a tensor on the meta device holds no values: a template module whose weights torch.func.functional_call
    # supplies; the replay's model has its own meta tensor there, see replay/modelio.load_weights)
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()
             if isinstance(v, torch.Tensor) and not v.is_meta}
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
        "files": files, "extra": _plain(extra or {}), "grad_out": gkeys,
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
def _decode(obj: Any, tensors: dict, cap: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, cap) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            _need(isinstance(key, str) and key in tensors, f"structure names tensor {key!r} that is not stored", cap)
            t = tensors[key]
            return t.requires_grad_(True) if obj.get("requires_grad") and t.is_floating_point() else t
        if "__tuple__" in obj:
            _need(isinstance(obj["__tuple__"], list), "malformed tuple in structure", cap)
            return tuple(_decode(v, tensors, cap) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return _pairs(obj["__dict__"], tensors, cap)
        for mark in ("__mapping__", "__namespace__", "__dataclass__"):
            if mark in obj:
                return _record(mark, obj[mark], tensors, cap)
        if "__enum__" in obj:  # an enum member comes back as its value (the in-process replay: the member itself)
            e = obj["__enum__"]
            _need(isinstance(e, dict) and isinstance(e.get("value"), _LEAF), "malformed enum in structure", cap)
            return e["value"]
        if "__ndarray__" in obj:
            key = obj["__ndarray__"]
            _need(isinstance(key, str) and key in tensors, f"structure names tensor {key!r} that is not stored", cap)
            return tensors[key].numpy()
        if "__npscalar__" in obj:
            n = obj["__npscalar__"]
            _need(isinstance(n, dict) and isinstance(n.get("dtype"), str) and len(n["dtype"]) <= 8
                  and isinstance(n.get("value"), (int, float)) and not isinstance(n.get("value"), bool)
                  or isinstance(n, dict) and isinstance(n.get("value"), bool), "malformed numpy scalar in structure",
                  cap)
            try:
                dt = np.dtype(n["dtype"])
            except TypeError:
                dt = None
            _need(dt is not None and dt.kind in "biuf", f"numpy scalar of dtype {n['dtype']!r} in structure", cap)
            return dt.type(n["value"])
        if "__opaque__" in obj:
            o = obj["__opaque__"]
            _need(isinstance(o, dict) and isinstance(o.get("type"), str), "malformed placeholder in structure", cap)
            return Opaque(o["type"][:200], str(o.get("where", "?"))[:200])
        if "__namedtuple__" in obj:
            return _namedtuple(obj["__namedtuple__"], tensors, cap)
        if "__float__" in obj:
            _need(obj["__float__"] in ("inf", "-inf", "nan"), "malformed float in structure", cap)
            return float(obj["__float__"])
        if "__dtype__" in obj:
            dt = getattr(torch, str(obj["__dtype__"]), None)
            _need(isinstance(dt, torch.dtype), f"unknown dtype {obj['__dtype__']!r} in structure", cap)
            return dt
        raise BadInput(f"capture {cap}: unknown object in structure (keys {sorted(obj)[:4]})")
    _need(isinstance(obj, _LEAF), f"unsupported value {type(obj).__name__} in structure", cap)
    return obj


class Opaque:
    """What a capture could not hold (a callable, an object of the user's class): its type's name and where it was.
    The in-process replay puts the live object back (`relive`); a replay from disk refuses it (replay/__init__.py)."""

    __slots__ = ("type", "where")

    def __init__(self, type_name: str, where: str):
        self.type, self.where = type_name, where

    def __repr__(self) -> str:
        return f"<not captured: {self.type} at {self.where}>"


def _key(k: Any, tensors: dict, cap: str):
    """A dict key as stored: a str or int as it is, anything else encoded (a tuple of names, an enum member)."""
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return k
    _need(isinstance(k, dict), "malformed dict key in structure", cap)
    v = _decode(k, tensors, cap)
    _need(v is None or isinstance(v, (str, int, float, bool, tuple)) and not isinstance(v, Opaque),
          "unusable dict key in structure", cap)
    try:
        hash(v)
    except TypeError:
        raise BadInput(f"capture {cap}: unhashable dict key in structure") from None
    return v


def _pairs(pairs: Any, tensors: dict, cap: str) -> dict:
    _need(isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 for p in pairs) and len(pairs) <= 100000,
          "malformed dict in structure", cap)
    return {_key(k, tensors, cap): _decode(v, tensors, cap) for k, v in pairs}


def _record(mark: str, r: Any, tensors: dict, cap: str):
    """A Mapping that is no dict (a Hugging Face BatchEncoding) comes back as a dict; a SimpleNamespace as one; a
    dataclass as a dataclass of the same name and fields (none of the user's classes is imported)."""
    _need(isinstance(r, dict) and isinstance(r.get("type"), str), f"malformed {mark.strip('_')} in structure", cap)
    d = _pairs(r.get("pairs"), tensors, cap)
    if mark == "__mapping__":
        return d
    _need(all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in d),
          f"malformed {mark.strip('_')} field names in structure", cap)
    if mark == "__namespace__":
        return types.SimpleNamespace(**d)
    name = r["type"].rpartition(".")[2]
    name = name if name.isidentifier() and not keyword.iskeyword(name) else "CapturedRecord"
    return dataclasses.make_dataclass(name, list(d))(**d)


def relive(decoded: Any, live: Any) -> Any:
    """`decoded` (a capture's args or kwargs) with what a capture cannot give back exactly taken from `live`, the
    objects the model received (kept by the watch for its in-process replay): enum members, the user's classes
    (a dataclass, a BatchEncoding, a namedtuple), objects the capture held only as an `Opaque`. The tensors stay the
    capture's copies (taken when the step ended); where the two structures differ, the decoded one stands."""
    if isinstance(live, torch.Tensor) or isinstance(decoded, torch.Tensor) and not isinstance(live, np.ndarray):
        return decoded
    if isinstance(decoded, Opaque) or isinstance(live, enum.Enum):
        return live
    try:
        if isinstance(live, (list, tuple)) and isinstance(decoded, (list, tuple)) and len(live) == len(decoded):
            items = [relive(d, v) for d, v in zip(decoded, live)]
            if isinstance(live, list):
                return items
            return tuple.__new__(type(live), items) if type(live) is not tuple else tuple(items)
        if isinstance(decoded, dict) and isinstance(live, (dict, collections.abc.Mapping)) and len(decoded) == len(live):
            d = {k: relive(dv, lv) for (k, lv), dv in zip(live.items(), decoded.values())}
            if type(live) is dict:
                return d
            new = copy.copy(live)  # (a BatchEncoding: a UserDict with more state than its items)
            if isinstance(getattr(new, "data", None), dict):
                new.data = d
                return new
            return live
        if dataclasses.is_dataclass(live) and not isinstance(live, type) or isinstance(live, types.SimpleNamespace):
            names = [f.name for f in dataclasses.fields(live)] if dataclasses.is_dataclass(live) else list(vars(live))
            got = vars(decoded) if hasattr(decoded, "__dict__") else {}
            if dataclasses.is_dataclass(decoded):
                got = {f.name: getattr(decoded, f.name) for f in dataclasses.fields(decoded)}
            new = copy.copy(live)
            for n in names:
                if n in got:
                    object.__setattr__(new, n, relive(got[n], getattr(live, n)))
            return new
    except Exception:
        return decoded
    return decoded


def _known_namedtuples() -> dict:
    """The namedtuple classes a capture may name that are rebuilt as themselves: torch's own, fixed here (a
    capture never has a class of its choosing imported); any other comes back as a namedtuple of the same name
    and fields (attribute access works; an isinstance check against the user's class does not)."""
    from torch.nn.utils.rnn import PackedSequence
    return {"torch.nn.utils.rnn.PackedSequence": PackedSequence}


def _namedtuple(nt: Any, tensors: dict, cap: str):
    _need(isinstance(nt, dict) and isinstance(nt.get("type"), str) and isinstance(nt.get("fields"), list)
          and isinstance(nt.get("items"), list) and len(nt["fields"]) == len(nt["items"]) and len(nt["items"]) <= 64
          and all(isinstance(f, str) and f.isidentifier() and not keyword.iskeyword(f) and not f.startswith("_")
                  for f in nt["fields"]) and len(set(nt["fields"])) == len(nt["fields"]),
          "malformed namedtuple in structure", cap)
    items = [_decode(v, tensors, cap) for v in nt["items"]]
    cls = _known_namedtuples().get(nt["type"])
    if cls is not None and tuple(cls._fields) == tuple(nt["fields"]):
        return tuple.__new__(cls, items)  # (its fields as stored: no constructor of the class runs)
    name = nt["type"].rpartition(".")[2]
    name = name if name.isidentifier() and not keyword.iskeyword(name) else "CapturedTuple"
    return collections.namedtuple(name, nt["fields"])(*items)


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
    return Capture(path=cap, manifest=manifest, args=args, kwargs=kwargs, state_dict=loaded["state"], rng=rng,
                   autocast=dict(manifest["autocast"]), scaler_state=manifest.get("scaler"),
                   step=manifest.get("step"), grad_out=[None if k is None else tensors[k] for k in gkeys]
                   if gkeys else None)
