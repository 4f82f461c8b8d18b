"""The environment a run trained in: GPU, compute capability, TF32 switches, bf16 support, and the deprecated AMP
APIs in use (`torch.cuda.amp.*`, apex `amp.initialize`) with their modern equivalents."""
from __future__ import annotations

import importlib
import platform
import re
import sys

__all__ = ["collect_env", "deprecated_amp_in_use", "deprecated_scaler", "MODERN"]


def collect_env(device=None) -> dict:
    """A JSON-ready dict; cheap (no kernels). `device`: a torch.device or its name."""
    import torch  # here, not at the top: the report path (rules/envrules reads MODERN) runs without torch
    env: dict = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
        "allow_tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "allow_tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": "cpu",
        "compute_capability": None,
        "bf16_supported": True,
        "cuda": torch.version.cuda,
    }
    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        idx = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
        env["device"] = torch.cuda.get_device_name(idx)
        env["compute_capability"] = list(torch.cuda.get_device_capability(idx))
        env["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
    return env


# deprecated / legacy AMP APIs and their modern equivalents (rule deprecated_api)
MODERN = {
    "torch.cuda.amp.GradScaler": "torch.amp.GradScaler(\"cuda\")",
    "torch.cuda.amp.autocast": "torch.autocast(\"cuda\", dtype=torch.float16)",
    "torch.cpu.amp.autocast": "torch.autocast(\"cpu\", dtype=torch.bfloat16)",
    "torch.cpu.amp.GradScaler": "torch.amp.GradScaler(\"cpu\")",
    "apex.amp.initialize": "torch.autocast(\"cuda\", dtype=torch.float16) + torch.amp.GradScaler(\"cuda\") "
                           "(apex.amp is deprecated; O2's fp32 master weights = parameters kept in fp32)",
}
_SOURCE = [(re.compile(r"\bcuda\.amp\.autocast\b|\bfrom\s+torch\.cuda\.amp\s+import\s+[^#\n]*\bautocast\b"),
            "torch.cuda.amp.autocast"),
           (re.compile(r"\bcpu\.amp\.autocast\b"), "torch.cpu.amp.autocast"),
           (re.compile(r"\bcuda\.amp\.GradScaler\b|\bfrom\s+torch\.cuda\.amp\s+import\s+[^#\n]*\bGradScaler\b"),
            "torch.cuda.amp.GradScaler"),
           (re.compile(r"\bcpu\.amp\.GradScaler\b|\bfrom\s+torch\.cpu\.amp\s+import\s+[^#\n]*\bGradScaler\b"),
            "torch.cpu.amp.GradScaler"),
           (re.compile(r"\bamp\.initialize\s*\("), "apex.amp.initialize")]


def _user_source() -> str:
    """The source of the first calling file outside ampdoctor, torch, the standard library and installed
    packages (the training script that called `watch`); "" when there is none."""
    import linecache
    import os

    import torch
    here = os.path.dirname(os.path.abspath(__file__))
    skip = (here, os.path.dirname(torch.__file__), os.path.dirname(os.__file__))
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        path = os.path.abspath(fn) if fn and not fn.startswith("<") else ""
        if path and not path.startswith(skip) and "-packages" + os.sep not in path:  # not a library's file
            return "".join(linecache.getlines(path))
        f = f.f_back
    return ""


def deprecated_scaler(scaler) -> list[str]:
    """The deprecated alias a GradScaler was made by (`torch.cuda.amp.GradScaler`, `torch.cpu.amp.GradScaler`), as a
    one-item list, or []."""
    if scaler is None:
        return []
    for dev in ("cuda", "cpu"):
        try:
            old = getattr(importlib.import_module(f"torch.{dev}.amp"), "GradScaler", None)
        except ImportError:
            continue
        if old is not None and type(scaler) is old:
            return [f"torch.{dev}.amp.GradScaler"]
    return []


def deprecated_amp_in_use(scaler=None, source: str | None = None) -> list[str]:
    """Deprecated AMP APIs in use: a `torch.cuda.amp.GradScaler` passed in, apex's `amp.initialize` already
    called, and `torch.cuda.amp.autocast`/`GradScaler` or `amp.initialize` written in the training script
    (`source`, by default the calling script's text)."""
    found = deprecated_scaler(scaler)
    apex_amp = sys.modules.get("apex.amp")
    if apex_amp is not None and getattr(getattr(apex_amp, "_amp_state", None), "handle", None) is not None:
        found.append("apex.amp.initialize")
    if source is None:
        try:
            source = _user_source()
        except Exception:  # reading the caller's source is a courtesy; never fail a watch over it
            source = ""
    source = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("#"))
    for pat, name in _SOURCE:
        if name not in found and pat.search(source):
            found.append(name)
    return found


def _start_time(pid: int):
    """The kernel's start time of process `pid` (Linux: /proc/<pid>/stat field 22, in clock ticks since boot), or
    None where unknown; with the pid it names one process, never a later one that reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2:].split()
        return int(fields[19]), fields[0].decode()  # (starttime, state)
    except (OSError, ValueError, IndexError):
        return None


def process_info() -> dict:
    """Who writes the run: pid, host, and the process's start time (see `alive`)."""
    import os
    import socket
    st = _start_time(os.getpid())
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": st[0] if st else None}


def alive(process: dict) -> bool | None:
    """Whether the process `process_info()` described still runs: None when it cannot be told (another host, no
    pid); a zombie or a pid now held by a later process counts as ended."""
    import os
    import socket
    pid, host = process.get("pid"), process.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or host != socket.gethostname():
        return None
    st = _start_time(pid)
    if st is not None:
        start = process.get("start")
        return st[1] != "Z" and (not isinstance(start, int) or st[0] == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (a permission error: it exists, another user's)
        return True
    return True
