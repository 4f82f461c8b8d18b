"""ampdoctor: find out why mixed-precision (fp16/bf16) training broke — which layer, op, step and call.

Public API (shared/CONTRACT.md): `watch`, `diagnose`, `save_batch`, `replay`, `Report`, `Finding`.
"""
from __future__ import annotations

__version__ = "0.1.0"

import sys as _sys
import types as _types

from .config import WatchConfig  # noqa: E402
from .errors import AmpDoctorError, BadInput, WatchError  # noqa: E402
from .findings import Finding, Report  # noqa: E402

# torch is imported on first use of `watch`/`Watch`, not here, so that `ampdoctor --help` starts at once.
# `ampdoctor.watch` and `ampdoctor.replay` are the functions even after their submodules load (the import
# system would otherwise set the package attribute to the submodule).
_FUNCTIONS = ("watch", "replay")


class _Package(_types.ModuleType):
    def __setattr__(self, name, value):
        if name in _FUNCTIONS and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


def __getattr__(name):
    if name in ("watch", "Watch"):
        import importlib
        mod = importlib.import_module(__name__ + ".watch")
        globals().update(watch=mod.watch, Watch=mod.Watch)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["watch", "Watch", "diagnose", "save_batch", "replay", "Report", "Finding", "WatchConfig",
           "AmpDoctorError", "BadInput", "WatchError", "__version__"]


def diagnose(run_dir) -> Report:
    """The Report of a run directory written by `watch(..., run_dir=...)` (all ranks merged)."""
    from .analysis import diagnose_run_dir
    return diagnose_run_dir(str(run_dir))


def save_batch(path, model, *args, **kwargs) -> str:
    """Capture one batch and the state needed to re-run it (weights, RNG, autocast state)."""
    from .capture import save_batch as _save_batch
    return _save_batch(path, model, *args, **kwargs)


def replay(capture, model=None, loss_fn=None, **kwargs) -> Report:
    """Re-run a capture with op-level instrumentation, an fp32 shadow run and a fix search."""
    from .replay import replay as _replay
    return _replay(capture, model=model, loss_fn=loss_fn, **kwargs)
