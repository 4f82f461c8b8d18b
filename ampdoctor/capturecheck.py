"""Checks on a capture before anything in it is trusted (ampdoctor/capture.py reads captures through these):
the manifest's shape and names, every file's path staying inside the capture, and each safetensors header
against the file's size (offsets contiguous, sizes matching dtypes and shapes, no sparse file, nothing larger than
the memory available) before a tensor is read. Each failed check raises `BadInput` with one line.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from .errors import BadInput
from .fsutil import loads_bounded

FORMAT_NAME = "ampdoctor-capture"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 16 << 20
MAX_FILE_BYTES = 64 << 30
MAX_HEADER_BYTES = 100 << 20
MAX_DEPTH = 48           # structure nesting a capture may have (args are rarely 5 deep)
_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}
_FILE_ROLES = ("tensors", "state")


def _need(cond: bool, what: str, path: str) -> None:
    if not cond:
        raise BadInput(f"capture {path}: {what}")


def _safe_file(root: str, name: Any, cap: str) -> str:
    _need(isinstance(name, str) and name and os.path.basename(name) == name and name not in (".", ".."),
          f"file name {name!r} in manifest.json is not a plain file name", cap)
    fp = os.path.join(root, name)
    _need(os.path.lexists(fp), f"missing file {name} (re-create the capture)", cap)
    real_root = os.path.realpath(root)
    _need(os.path.commonpath([real_root, os.path.realpath(fp)]) == real_root,
          f"{name} is a link that points outside the capture directory; refusing to read it", cap)
    _need(os.path.isfile(fp), f"{name} is not a regular file", cap)
    return fp


def _check_manifest(m: Any, cap: str) -> None:
    _need(isinstance(m, dict), "manifest.json is not a JSON object", cap)
    _need(m.get("format") == FORMAT_NAME, f"manifest format is {m.get('format')!r}, expected {FORMAT_NAME!r}", cap)
    v = m.get("format_version")
    _need(isinstance(v, int) and not isinstance(v, bool), "format_version is not an integer", cap)
    _need(v <= FORMAT_VERSION, f"format_version {v} is newer than this ampdoctor reads ({FORMAT_VERSION}); "
          "upgrade ampdoctor", cap)
    _need(v >= 1, f"unknown format_version {v}", cap)
    types = {"torch_version": str, "ampdoctor_version": str, "model_class": str, "structure": dict, "files": dict,
             "autocast": dict}
    for k, t in types.items():
        _need(isinstance(m.get(k), t), f"manifest field {k!r} must be {t.__name__}, got {type(m.get(k)).__name__}",
              cap)
    for k, t in (("hf_config", dict), ("scaler", dict), ("extra", dict), ("rng", list), ("state", list), ("training", bool),
                 ("eval_modules", list)):
        _need(m.get(k) is None or isinstance(m.get(k), t), f"manifest field {k!r} must be {t.__name__} or null", cap)
    step = m.get("step")
    _need(step is None or (isinstance(step, int) and not isinstance(step, bool)), "manifest step is not an int", cap)
    entry = (m.get("extra") or {}).get("entry")  # the module the batch went into (record/entries.py)
    _need(entry is None or isinstance(entry, str) and 0 < len(entry) <= 1000 and all(
        p.isidentifier() or p.isdigit() for p in entry.split(".")), "manifest extra.entry is not a module name", cap)
    ac = m["autocast"]
    _need(isinstance(ac.get("device"), str) and isinstance(ac.get("dtype"), str)
          and isinstance(ac.get("enabled"), bool), "manifest autocast must be {device: str, dtype: str, enabled: "
          "bool}", cap)
    _need(ac["dtype"] in ("float16", "bfloat16", "float32"), f"autocast dtype {ac['dtype']!r} is not supported", cap)
    _need(set(m["structure"]) == {"args", "kwargs"}, "manifest structure must hold exactly args and kwargs", cap)
    for role in _FILE_ROLES:
        f = m["files"].get(role)
        _need(isinstance(f, dict) and isinstance(f.get("name"), str), f"manifest files.{role} is missing", cap)
        n = f.get("bytes")
        _need(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_FILE_BYTES,
              f"files.{role}.bytes is not a size ampdoctor accepts (0..{MAX_FILE_BYTES})", cap)
        _need(f.get("sha256") is None or isinstance(f.get("sha256"), str), f"files.{role}.sha256 is not a str", cap)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_safetensors(fp: str, cap: str) -> None:
    """Refuse a tensor file whose header does not add up with its size, that is sparse (holes read as zeros:
    gigabytes from a few kilobytes on disk), or that would not fit in memory — before reading its data."""
    name = os.path.basename(fp)
    size = os.path.getsize(fp)
    with open(fp, "rb") as f:
        head = f.read(8)
        _need(len(head) == 8, f"{name} is not a valid safetensors file (shorter than its header)", cap)
        n = int.from_bytes(head, "little")
        _need(0 < n <= min(size - 8, MAX_HEADER_BYTES), f"{name} is not a valid safetensors file (header length "
              f"{n} for a {size}-byte file)", cap)
        header = loads_bounded(f.read(n), f"capture {cap}: {name} header", 4)
    _need(isinstance(header, dict), f"{name} is not a valid safetensors file (header not an object)", cap)
    spans = []
    for k, v in header.items():
        if k == "__metadata__":
            continue
        ok = (isinstance(v, dict) and v.get("dtype") in _ST_DTYPES and isinstance(v.get("shape"), list)
              and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in v["shape"])
              and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
              and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in v["data_offsets"]))
        _need(ok, f"{name} is not a valid safetensors file (entry {str(k)[:40]!r})", cap)
        a, b = v["data_offsets"]
        numel = math.prod(v["shape"])
        _need(b - a == numel * _ST_DTYPES[v["dtype"]], f"{name}: tensor {str(k)[:40]!r} has {b - a} bytes for shape "
              f"{v['shape']} {v['dtype']} (corrupt)", cap)
        spans.append((a, b))
    data = size - 8 - n
    end = 0
    for a, b in sorted(spans):
        _need(a == end, f"{name}: tensor data offsets overlap or leave gaps (corrupt)", cap)
        end = b
    _need(end == data, f"{name}: the header describes {end} bytes of tensor data but the file holds {data} "
          "(truncated or padded)", cap)
    blocks = getattr(os.stat(fp), "st_blocks", None)
    _need(blocks is None or size < 256 << 20 or blocks * 512 >= size // 8, f"{name} is a sparse file ({size} bytes "
          f"but {blocks * 512 if blocks else 0} on disk): holes, not weights; refusing to read it", cap)
    avail = _mem_available()
    _need(avail is None or data <= avail * 0.8, f"{name} holds {data / 2 ** 30:.1f} GiB of tensors, more than the "
          f"memory available ({avail / 2 ** 30 if avail else 0:.1f} GiB); refusing to load it", cap)


def _read_tensors(fp: str, cap: str) -> dict[str, torch.Tensor]:
    name = os.path.basename(fp)
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file as st_load_file
        try:
            out = st_load_file(fp)   # memory-mapped: the file is not read into a second copy first
        except Exception as e:
            raise BadInput(f"capture {cap}: {name} is not a valid safetensors file ({str(e).splitlines()[0][:120]})")
    elif name.endswith(".pt"):
        avail = _mem_available()
        _need(avail is None or os.path.getsize(fp) <= avail * 0.4, f"{name} is larger than the memory available; "
              "refusing to load it", cap)
        try:
            out = torch.load(fp, map_location="cpu", weights_only=True)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise BadInput(f"capture {cap}: {name} was refused by torch.load(weights_only=True): {first}")
    else:
        raise BadInput(f"capture {cap}: {name} has an unknown extension (expected .safetensors or .pt)")
    _need(isinstance(out, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out.items()),
          f"{name} does not hold a flat mapping of names to tensors", cap)
    return out
