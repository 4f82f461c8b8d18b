"""Scaler and optimizer monitor: records every call, in order, with the caller's line.

Patches are instance attributes on the user's GradScaler and optimizer (removed on close); the clipping functions of
`torch.nn.utils`, shared by all open watches, are patched in clippatch.py. A call that raises is recorded before the
exception propagates, so a report after a crashed script still names the misuse and the line. Also here: the
caller's file:line (`caller_location`) and the guard that keeps ampdoctor's own errors out of the user's calls.
"""
from __future__ import annotations

import enum
import functools
import os
import sys
import threading
import weakref
from typing import Any, Callable

import torch

__all__ = ["ScalerPatch", "OptimizerPatch", "ScalerFinder", "caller_location", "scaler_stage",
           "guarded", "LOOSE", "others_stepped"]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ampdoctor package (this file is in record/)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SITE = os.path.dirname(_TORCH_DIR)
# trainer libraries whose frames are skipped so that a location points at the user's own script
_LIB_DIRS = tuple(os.path.join(_SITE, n) + os.sep for n in ("transformers", "accelerate", "lightning",
                                                              "pytorch_lightning", "lightning_fabric"))


_SKIP_PREFIXES = (_PKG_DIR, _TORCH_DIR, "<frozen") + _LIB_DIRS
_LOC: dict = {}  # (id(code), f_lasti) -> (code, (file, line) of a user's frame, or None for a skipped frame):
#                  decided once per call site. Keyed by id (hashing a code object hashes its contents, ~0.6 us) and
#                  holding the code, so the id is not reused while the entry lives; f_lineno would decode the line
#                  table, linear in the code's length (a training loop at a script's top level is one long code)


def _skipped(code) -> bool:
    fn = code.co_filename
    return fn.startswith(_SKIP_PREFIXES) or fn.endswith("/contextlib.py") or fn.endswith("/functools.py")


def caller_location(skip: int = 2) -> tuple[str | None, int | None]:
    """(file, line) of the first frame outside ampdoctor, torch and the trainer libraries."""
    f = sys._getframe(skip)
    while f is not None:
        code = f.f_code
        hit = _LOC.get((id(code), f.f_lasti))
        if hit is None or hit[0] is not code:
            if len(_LOC) > 16384:  # generated code (exec, compile) must not grow it forever
                _LOC.clear()
            hit = _LOC[(id(code), f.f_lasti)] = (code, None if _skipped(code) else (code.co_filename, f.f_lineno))
        if hit[1] is not None:
            return hit[1]
        f = f.f_back
    return None, None


def guarded(fn):
    """A patch's callback (the step machine's methods the patches here call): ampdoctor's own errors go to
    StepMachine.fail, never into the user's call."""
    @functools.wraps(fn)
    def call(self, *args):
        try:
            return fn(self, *args)
        except Exception as e:
            self.fail(e)
            return None
    return call


_STAGE_NAMES: dict = {}  # id(OptState member) -> (member, its name): an enum's hash and .name are Python code


def scaler_stage(scaler, optimizer) -> str | None:
    """GradScaler's per-optimizer stage name (READY / UNSCALED / STEPPED) or None."""
    try:
        st = scaler._per_optimizer_states[id(optimizer)]["stage"]
    except (AttributeError, KeyError, TypeError):
        return None
    known = _STAGE_NAMES.get(id(st))
    if known is not None and known[0] is st:
        return known[1]
    name = getattr(st, "name", None)  # an OptState enum (str() of it is slow, and once per scaler call)
    name = name if isinstance(name, str) else str(st)
    if isinstance(st, enum.Enum):  # members live as long as their class: the id is theirs
        _STAGE_NAMES[id(st)] = (st, name)
    return name


class _InstancePatch:
    """Replace methods on one object by wrappers; `remove()` restores exactly what was there. Two watches may wrap
    the same object (an encoder's and a decoder's watch given one optimizer and one scaler): closed in any order,
    each takes itself out of the chain and the object ends with its own methods."""

    _live: dict = {}  # id(obj) -> the patches on it not yet removed, oldest first

    def __init__(self, obj: Any):
        self.obj = obj
        self._saved: list[list] = []  # [name, had, old, our wrapper, what it calls]

    def wrap(self, name: str, make: Callable[[Callable], Callable]) -> None:
        had = name in vars(self.obj)
        orig = getattr(self.obj, name)
        fn = make(orig)
        self._saved.append([name, had, vars(self.obj).get(name), fn, orig])
        setattr(self.obj, name, fn)
        live = _InstancePatch._live.setdefault(id(self.obj), [])
        if self not in live:
            live.append(self)

    def remove(self) -> None:
        live = _InstancePatch._live.get(id(self.obj), [])
        others = [p for p in live if p is not self]
        for name, had, old, fn, orig in reversed(self._saved):
            if vars(self.obj).get(name) is not fn:
                # another patch wrapped this one since: its wrapper now calls what this one called, and it will put
                # back what this one found
                above = next((e for p in others for e in p._saved if e[0] == name and e[2] is fn), None)
                if above is not None:
                    above[1], above[2] = had, old
                    _relink(above[3], fn, orig)
                continue
            if had:
                setattr(self.obj, name, old)
            else:
                try:
                    delattr(self.obj, name)
                except AttributeError:
                    pass
        self._saved.clear()
        if others:
            _InstancePatch._live[id(self.obj)] = others
        else:
            _InstancePatch._live.pop(id(self.obj), None)


def _relink(wrapper, old, new) -> None:
    """Make `wrapper` (a closure made by a patch's `make`) call `new` where it called `old`."""
    for cell in getattr(wrapper, "__closure__", None) or ():
        if cell.cell_contents is old:
            cell.cell_contents = new
    if getattr(wrapper, "__wrapped__", None) is old:
        wrapper.__wrapped__ = new


class ScalerPatch(_InstancePatch):
    """Wraps scale / unscale_ / step / update of one GradScaler and reports them to `sink(kind, ...)`."""

    def __init__(self, scaler, sink):
        super().__init__(scaler)
        for kind in ("scale", "unscale_", "step", "update"):
            self.wrap(kind, lambda orig, kind=kind: self._make(kind, orig, sink))
        if callable(getattr(scaler, "get_scale", None)):  # only counted: the loop read the scale (an unscale by hand)
            self.wrap("get_scale", lambda orig: self._read(orig, sink))

    @staticmethod
    def _read(orig: Callable, sink) -> Callable:
        def get_scale(*args, **kwargs):
            sink.scale_read()
            return orig(*args, **kwargs)
        get_scale.__wrapped__ = orig
        return get_scale

    @staticmethod
    def _make(kind: str, orig: Callable, sink) -> Callable:
        def wrapper(*args, **kwargs):
            tok = sink.before(kind, args, kwargs)
            try:
                out = orig(*args, **kwargs)
            except BaseException as e:
                sink.failed(tok, e)
                raise
            sink.after(tok, args, kwargs, out)
            return out
        wrapper.__wrapped__ = orig
        return wrapper


LOOSE: weakref.WeakSet = weakref.WeakSet()
"""The step machines of the open watches given no optimizer and no scaler: a frozen model's (a distillation teacher,
a perceptual-loss network) has no step of its own and ends its steps with the other models' (optsink._foreign_step)."""


def others_stepped(machine=None) -> None:
    """A training step ended (an optimizer stepped, or a scaler skipped it) that is not a loose watch's own:
    `machine`'s, or one that no watch sees (a GradScaler no watch holds: ScalerFinder)."""
    for m in list(LOOSE) if LOOSE else ():
        if m is not machine and not m.disabled:
            m._foreign_step()


class ScalerFinder:
    """Process-wide, for watches given no `scaler=`: a GradScaler that unscales or steps an optimizer on a watched
    model's parameters is adopted by that watch (`Watch.adopt_scaler`: a ScalerPatch on the instance, so from then
    on its calls are recorded like a given scaler's). A scaler made anew each epoch is adopted anew. Wraps
    `GradScaler.unscale_` / `step` on the class; a patched instance's own attributes shadow them, so only the
    calls of scalers no watch knows pass through here."""

    _lock = threading.Lock()
    _watches: list = []
    _saved: list[tuple[Any, str, Any]] = []

    @classmethod
    def add(cls, watch) -> None:
        with cls._lock:
            if not cls._watches:
                cls._install()
            cls._watches.append(watch)

    @classmethod
    def discard(cls, watch) -> None:
        with cls._lock:
            if watch in cls._watches:
                cls._watches.remove(watch)
            if not cls._watches:
                for owner, name, orig in reversed(cls._saved):
                    setattr(owner, name, orig)
                cls._saved.clear()

    @classmethod
    def _install(cls) -> None:
        from torch.amp.grad_scaler import GradScaler
        for name in ("unscale_", "step"):
            orig = GradScaler.__dict__[name]
            cls._saved.append((GradScaler, name, orig))
            setattr(GradScaler, name, cls._wrapper(name, orig))

    @classmethod
    def _wrapper(cls, name: str, orig: Callable) -> Callable:
        def wrapper(scaler, optimizer, *args, **kwargs):
            for w in list(cls._watches):
                try:
                    adopted = w.adopt_scaler(scaler, optimizer)
                except Exception:  # finding a scaler must never break the user's call
                    adopted = False
                if adopted:
                    # this call is recorded through the new patch; a subclass's own method that reached here
                    # through super() would run its body a second time that way: recorded here, around torch's
                    if getattr(type(scaler), name, None) is wrapper:
                        return getattr(scaler, name)(optimizer, *args, **kwargs)
                    return ScalerPatch._make(name, functools.partial(orig, scaler), w.machine)(
                        optimizer, *args, **kwargs)
            out = orig(scaler, optimizer, *args, **kwargs)
            if name == "step":  # (stepped or skipped: a loose watch's iteration ends with it)
                others_stepped()
            return out
        wrapper.__wrapped__ = orig
        return wrapper


class OptimizerPatch(_InstancePatch):
    """A zero_grad wrapper on one optimizer (its steps are seen through torch's global optimizer hooks)."""

    def __init__(self, optimizer, sink):
        super().__init__(optimizer)

        def make_zero_grad(orig):
            def zero_grad(*args, **kwargs):
                sink.zero_grad(optimizer)
                out = orig(*args, **kwargs)
                if sink.zero_pending is not None:
                    sink.zero_grad_done(optimizer)
                return out
            zero_grad.__wrapped__ = orig
            return zero_grad
        if callable(getattr(optimizer, "zero_grad", None)):  # (an object that only poses as an optimizer for
            self.wrap("zero_grad", make_zero_grad)           # GradScaler, fastai's MixedPrecision, has none)
