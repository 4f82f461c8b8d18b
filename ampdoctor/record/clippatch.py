"""The clipping functions' patch: process-wide, `torch.nn.utils`' clip_grad_norm_, clip_grad_value_, get_total_norm
(and the inner functions a clip bound before the watch began still calls) wrapped once while any watch is open, each
call fanned out to the open watches' clip callbacks (clipsink.py) before and after it runs. The scaler's and the
optimizer's patches, per object, are in monitor.py.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch

__all__ = ["ClipPatch"]


_CLIP_FUNCS = ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grad_norm", "clip_grads_with_norm_")
# what torch's clip_grad_norm_ calls through its module's globals (torch >= 2.6): a clip_grad_norm_ the user's
# script bound before the watch began (`from torch.nn.utils import clip_grad_norm_` at its top) is seen there
_INNER_CLIP = "_clip_grads_with_norm_"
# ... and what clip_grad_value_ calls there, before it clamps: one bound early is seen there (it has no inner clip)
_GROUPER = "_group_tensors_by_device_and_dtype"


class ClipPatch:
    """Process-wide: wraps torch.nn.utils' clipping functions once and fans calls out to open watches."""

    _lock = threading.Lock()
    _sinks: list = []
    _saved: list[tuple[Any, str, Any]] = []
    _depth = threading.local()  # inside one of the wrappers: the inner clip is part of that call

    @classmethod
    def add(cls, sink) -> None:
        with cls._lock:
            if not cls._sinks:
                cls._install()
            cls._sinks.append(sink)

    @classmethod
    def discard(cls, sink) -> None:
        with cls._lock:
            if sink in cls._sinks:
                cls._sinks.remove(sink)
            if not cls._sinks:
                for mod, name, orig in reversed(cls._saved):
                    setattr(mod, name, orig)
                cls._saved.clear()

    @classmethod
    def _install(cls) -> None:
        import torch.nn.utils as U
        import torch.nn.utils.clip_grad as C
        originals: dict[str, Callable] = {}
        for mod in (C, U):
            for name in _CLIP_FUNCS:
                fn = getattr(mod, name, None)
                if fn is None:
                    continue
                orig = originals.setdefault(name, getattr(fn, "__wrapped_by_ampdoctor__", fn))
                cls._saved.append((mod, name, fn))
                setattr(mod, name, cls._wrapper(name, orig))
        fn = getattr(C, _INNER_CLIP, None)
        if callable(fn):
            cls._saved.append((C, _INNER_CLIP, fn))
            setattr(C, _INNER_CLIP, cls._inner(getattr(fn, "__wrapped_by_ampdoctor__", fn)))
        fn = getattr(C, _GROUPER, None)
        if callable(fn):
            cls._saved.append((C, _GROUPER, fn))
            setattr(C, _GROUPER, cls._grouper(getattr(fn, "__wrapped_by_ampdoctor__", fn)))

    @classmethod
    def _fan_out(cls, kind: str, parameters, orig: Callable, args, kwargs, norm_arg: int | None = None):
        # max_norm / clip_value (the first argument after the parameters; get_total_norm's is its norm type)
        limit = None if kind == "get_total_norm" else (args[0] if args else kwargs.get("max_norm",
                                                                                     kwargs.get("clip_value")))
        toks = [(s, s.clip_before(kind, parameters, limit)) for s in list(cls._sinks)]
        d = cls._depth
        d.n = getattr(d, "n", 0) + 1
        try:
            out = orig(parameters, *args, **kwargs)
        except BaseException as e:
            for s, t in toks:
                s.failed(t, e)
            raise
        finally:
            d.n -= 1
        # clip_grads_with_norm_ returns nothing: the norm it clipped with is its argument
        norm = out if norm_arg is None else (args[norm_arg] if len(args) > norm_arg else kwargs.get("total_norm"))
        for s, t in toks:
            s.clip_after(t, norm)
        return out

    @classmethod
    def _inner(cls, orig: Callable) -> Callable:
        """torch's own `_clip_grads_with_norm_`, as clip_grad_norm_ calls it: recorded only when no wrapper of ours
        is on the way (a clip_grad_norm_ bound before the watch began), as the clip_grad_norm_ that called it."""
        def inner(parameters, *args, **kwargs):
            if getattr(cls._depth, "n", 0) or not cls._sinks:
                return orig(parameters, *args, **kwargs)
            if not isinstance(parameters, (torch.Tensor, list, tuple)):
                parameters = list(parameters)
            caller = sys._getframe(1).f_code.co_name
            kind = caller if caller in ("clip_grad_norm_", "clip_grad_norm") else "clip_grads_with_norm_"
            return cls._fan_out(kind, parameters, orig, args, kwargs, norm_arg=1)
        inner.__wrapped_by_ampdoctor__ = orig
        inner.__wrapped__ = orig
        inner.__name__ = getattr(orig, "__name__", _INNER_CLIP)
        inner.__doc__ = getattr(orig, "__doc__", None)
        return inner

    @classmethod
    def _grouper(cls, orig: Callable) -> Callable:
        """torch's own `_group_tensors_by_device_and_dtype` in the clipping module, as a clip_grad_value_ bound
        before the watch began calls it with the gradients it is about to clamp: recorded then (only then: no
        wrapper of ours on the way, called from clip_grad_value_ itself) as that clip_grad_value_, over those
        gradients. It returns nothing to read, so there is nothing to record after it."""
        def grouper(tensorlistlist, *args, **kwargs):
            if not getattr(cls._depth, "n", 0) and cls._sinks:
                try:
                    f = sys._getframe(1)
                    if f.f_code.co_name == "clip_grad_value_" and f.f_globals.get(_GROUPER) is grouper:
                        grads = list(tensorlistlist[0]) if tensorlistlist else []
                        limit = f.f_locals.get("clip_value")
                        del f
                        for s in list(cls._sinks):
                            s.clip_before("clip_grad_value_", grads, limit, True)
                except Exception:  # (the sinks' own errors are theirs to handle; a frame we cannot read: nothing)
                    pass
            return orig(tensorlistlist, *args, **kwargs)
        grouper.__wrapped_by_ampdoctor__ = orig
        grouper.__wrapped__ = orig
        grouper.__name__ = getattr(orig, "__name__", _GROUPER)
        return grouper

    @classmethod
    def _wrapper(cls, kind: str, orig: Callable) -> Callable:
        norm_arg = 1 if kind == "clip_grads_with_norm_" else None  # (parameters, max_norm, total_norm, ...)

        def clip(parameters, *args, **kwargs):
            if not isinstance(parameters, (torch.Tensor, list, tuple)):
                parameters = list(parameters)  # a generator would be consumed by our look
            return cls._fan_out(kind, parameters, orig, args, kwargs, norm_arg)
        clip.__wrapped_by_ampdoctor__ = orig
        clip.__wrapped__ = orig
        clip.__name__ = getattr(orig, "__name__", kind)
        clip.__doc__ = getattr(orig, "__doc__", None)
        return clip
