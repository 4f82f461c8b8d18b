"""The structure of a captured batch (a model call's args and kwargs) as JSON, for ampdoctor/capture.py: `encode`
turns it into JSON with placeholders (tensors go to the capture's tensor file under a key; what JSON cannot hold as
it is goes under a marker naming what it was), `decode` reads it back with every marker checked (BadInput, one
line, on anything malformed), and `relive` gives a decoded batch the live objects a watch kept for its in-process
replay. Nothing a capture names is imported or called: a namedtuple or dataclass comes back as one of the same name
and fields (torch's PackedSequence as itself), an enum member as its value, an object no marker fits as an `Opaque`.
"""
from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import enum
import keyword
import math
import types
from typing import Any

import numpy as np
import torch

from .capturecheck import _need
from .errors import BadInput

__all__ = ["encode", "decode", "encode_sparse", "decode_sparse", "relive", "Opaque", "LEAF"]

LEAF = (int, float, bool, str, type(None))


def encode(obj: Any, key: str, tensors: dict, where: str, opaque: bool = False) -> Any:
    """Turn args/kwargs into JSON with tensor placeholders; tensors are copied to CPU into `tensors`. What JSON
    cannot hold as it is goes in under a marker that says what it was (see `decode`); an object no marker fits (a
    callable, a class of the user's) is an `__opaque__` placeholder naming its type when `opaque` (a watch's capture: it is still written,
    the in-process replay gives the live object back, `relive`; a replay from disk says so in one line), else
    BadInput (save_batch)."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:  # a sparse adjacency (GCN), a sparse feature matrix
            sp = encode_sparse(obj, key, tensors, where, opaque)
            return {"__sparse__": sp} if sp is not None else {"__opaque__": {
                "type": f"torch.Tensor (layout {obj.layout})", "where": where[:200]}}
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key, "requires_grad": bool(obj.requires_grad), "device": str(obj.device)}
    if isinstance(obj, enum.Enum):  # (before str/int: a str- or int-mixin member is one too)
        value = obj.value if isinstance(obj.value, LEAF) and not isinstance(obj.value, float) else None
        return {"__enum__": {"type": _type_name(obj), "name": str(obj.name), "value": value}}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": str(obj)}
    if isinstance(obj, LEAF):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{key}.{i}", tensors, f"{where}[{i}]", opaque) for i, v in enumerate(obj)]
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
                encode(k, f"{key}.k{len(pairs)}", tensors, f"{where} key {k!r}", opaque)
            pairs.append([kk, encode(v, f"{key}.{len(pairs) if kk is not k else k}", tensors, f"{where}[{k!r}]",
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


_SPARSE_PARTS = {"coo": ("indices", "values"), "csr": ("crow_indices", "col_indices", "values")}
_LAYOUTS = {torch.sparse_coo: "coo", torch.sparse_csr: "csr"}
MAX_SPARSE_DIMS = 8


def encode_sparse(t: torch.Tensor, key: str, tensors: dict, where: str, opaque: bool = False) -> dict | None:
    """A sparse COO or CSR tensor as its parts (strided tensors under `key`/<part>) and its size; None for another
    layout when `opaque` (a watch's capture), else BadInput naming `where`."""
    kind = _LAYOUTS.get(t.layout)
    if kind is None:
        if opaque:
            return None
        raise BadInput(f"cannot capture {where}: a tensor of layout {t.layout} (strided, sparse COO and sparse CSR "
                       "tensors are supported)")
    t = t.detach().to("cpu", copy=True)
    if kind == "coo":
        t = t.coalesce()
    parts = {}
    for part in _SPARSE_PARTS[kind]:
        tensors[f"{key}/{part}"] = getattr(t, part)().contiguous()
        parts[part] = f"{key}/{part}"
    return {"layout": kind, "size": list(t.shape), "parts": parts, "requires_grad": bool(t.requires_grad)}


def decode_sparse(sp: Any, tensors: dict, cap: str) -> torch.Tensor:
    """A sparse tensor written by `encode_sparse`, its invariants checked by torch (indices in range, sorted
    compressed rows): BadInput on anything malformed."""
    _need(isinstance(sp, dict) and sp.get("layout") in _SPARSE_PARTS and isinstance(sp.get("parts"), dict)
          and isinstance(sp.get("size"), list) and 0 < len(sp["size"]) <= MAX_SPARSE_DIMS
          and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2 ** 40 for n in sp["size"]),
          "malformed sparse tensor in structure", cap)
    parts = []
    for part in _SPARSE_PARTS[sp["layout"]]:
        k = sp["parts"].get(part)
        _need(isinstance(k, str) and k in tensors, f"structure names tensor {k!r} that is not stored", cap)
        parts.append(tensors[k])
    try:
        if sp["layout"] == "coo":
            t = torch.sparse_coo_tensor(*parts, sp["size"], check_invariants=True, is_coalesced=True)
        else:
            t = torch.sparse_csr_tensor(*parts, sp["size"], check_invariants=True)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise BadInput(f"capture {cap}: a sparse tensor in it is malformed ({str(e).splitlines()[0][:120]})")
    return t.requires_grad_(True) if sp.get("requires_grad") and t.is_floating_point() else t


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls.__name__)}"[:200]



def decode(obj: Any, tensors: dict, cap: str) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors, cap) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            _need(isinstance(key, str) and key in tensors, f"structure names tensor {key!r} that is not stored", cap)
            t = tensors[key]
            return t.requires_grad_(True) if obj.get("requires_grad") and t.is_floating_point() else t
        if "__sparse__" in obj:
            return decode_sparse(obj["__sparse__"], tensors, cap)
        if "__tuple__" in obj:
            _need(isinstance(obj["__tuple__"], list), "malformed tuple in structure", cap)
            return tuple(decode(v, tensors, cap) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return _pairs(obj["__dict__"], tensors, cap)
        for mark in ("__mapping__", "__namespace__", "__dataclass__"):
            if mark in obj:
                return _record(mark, obj[mark], tensors, cap)
        if "__enum__" in obj:  # an enum member comes back as its value (the in-process replay: the member itself)
            e = obj["__enum__"]
            _need(isinstance(e, dict) and isinstance(e.get("value"), LEAF), "malformed enum in structure", cap)
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
    _need(isinstance(obj, LEAF), f"unsupported value {type(obj).__name__} in structure", cap)
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
    v = decode(k, tensors, cap)
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
    return {_key(k, tensors, cap): decode(v, tensors, cap) for k, v in pairs}


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
    items = [decode(v, tensors, cap) for v in nt["items"]]
    cls = _known_namedtuples().get(nt["type"])
    if cls is not None and tuple(cls._fields) == tuple(nt["fields"]):
        return tuple.__new__(cls, items)  # (its fields as stored: no constructor of the class runs)
    name = nt["type"].rpartition(".")[2]
    name = name if name.isidentifier() and not keyword.iskeyword(name) else "CapturedTuple"
    return collections.namedtuple(name, nt["fields"])(*items)
