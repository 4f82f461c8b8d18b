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
    return env


def deprecated_amp_in_use(scaler=None) -> list[str]:
    """Deprecated AMP classes in use: a `torch.cuda.amp.GradScaler` (use `torch.amp.GradScaler("cuda")`)."""
    found = []
    try:
        import torch.cuda.amp as old_amp
        if scaler is not None and type(scaler) is getattr(old_amp, "GradScaler", None):
            found.append("torch.cuda.amp.GradScaler")
    except ImportError:
        pass
    return found
