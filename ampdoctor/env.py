"""The environment a run trained in: GPU, compute capability, TF32 switches, bf16 support, AMP APIs in use."""
from __future__ import annotations

import platform

import torch

__all__ = ["collect_env", "deprecated_amp_in_use"]


def collect_env(device: torch.device | str | None = None) -> dict:
    """A JSON-ready dict; cheap (no kernels)."""
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
    env["deprecated_amp"] = deprecated_amp_in_use()
    return env


def deprecated_amp_in_use() -> list[str]:
    """Names of deprecated AMP classes that have been instantiated or imported in this process (best effort)."""
    import sys
    found = []
    mod = sys.modules.get("torch.cuda.amp.grad_scaler")
    if mod is not None and getattr(mod, "_ampdoctor_seen", False):
        found.append("torch.cuda.amp.GradScaler")
    return found
