"""Integer-valued inputs on routine steps: positions, timesteps or day indices a module takes in fp16/bf16.

A sampled step probes every small vector-shaped fp16/bf16 module input (stats.integer_probe, openstep's
`probe_integers`). A module whose input there held only integers in a ramp (several magnitudes, as positions and
timesteps do) but still inside the dtype's exact range is watched from then on: a forward pre-hook on that module
alone queues the same probe on every routine step (a few small kernels, read back with the step's one transfer).
A curriculum, a context-length warm-up or a counter that later carries the values past 256 (bf16) or 2048 (fp16)
is then seen on the step it happens (StepRecord.int_inputs -> rules/numeric.py integer_precision), not at the
next sampled step hundreds of steps later. Only the innermost module that received the values is watched (a
parent passing them down is not), at most MAX_WATCHED modules.
"""
from __future__ import annotations

import math

import torch

from .gradexits import in_backward
from .hooks import ModuleHook
from .stats import integer_input, probe_row

__all__ = ["IntWatch", "MAX_WATCHED"]

MAX_WATCHED = 8  # modules; a model feeding more integer vectors than this is probed on sampled steps only


def _ramp(row) -> bool:
    """An integer_probe row read back: finite, only integers, and a smallest nonzero magnitude below the largest
    (a position or timestep ramp, not a constant or a 0/1 mask)."""
    if row is None or len(row) < 4:
        return False
    amax, nonfinite, nonint, amin = row[:4]
    return not nonfinite and not nonint and 1.0 <= amax <= 2.0 ** 24 and math.isfinite(amin) and amin < amax


class IntWatch:
    """Owned by the StepMachine (`m`); see the module docstring."""

    def __init__(self, m):
        self.m = m
        self.handles: dict[str, object] = {}  # module name -> the handle of its pre-hook

    def learn(self, calls, probes: list) -> None:
        """After a sampled step: watch the innermost modules whose probed input was an integer ramp."""
        m = self.m
        if m.compiled or m.disabled:
            return
        names = {c.module: c.type for c in calls  # (inputs only: not values made inside a forward, lowcast.py)
                 if any(_ramp(probe_row(probes, i)) for i, dt in c.probes if "@" not in dt)}
        # a parent passing the values down is not watched when a module below it received them too
        inner = [n for n in names if not any(o != n and (n == "" or o.startswith(n + ".")) for o in names)]
        for name in inner:
            if name in self.handles or len(self.handles) >= MAX_WATCHED:
                continue
            try:
                mod = m.w.model.get_submodule(name)
            except AttributeError:
                continue
            hook = ModuleHook(lambda module, args, kwargs, _n=name, _t=names[name]: self._pre(_n, _t, args, kwargs),
                              "pre")
            self.handles[name] = hook.register(mod)

    def _pre(self, name: str, typ: str, args, kwargs) -> None:
        m = self.m
        st = m.st
        if m.disabled or m.suspended or st.sampled or torch.compiler.is_compiling() or in_backward():
            return None  # (a sampled step probes every module's inputs itself)
        try:
            call = _Probed(name, typ)
            for t in list(args) + (list(kwargs.values()) if kwargs else []):
                if isinstance(t, torch.Tensor):
                    st.probe_integers(call, t)
            if call.probes:
                st.int_calls.append(call)
        except Exception as e:  # never break the user's model
            m.fail(e)
        return None

    @staticmethod
    def found(st, probes: list) -> list | None:
        """A routine step's watched inputs that held only integers past the dtype's exact range (read back)."""
        out = [{"module": c.module, "type": c.type, **info} for c in st.int_calls
               if (info := integer_input(c.probes, probes)) is not None]
        return out or None

    def remove(self) -> None:
        for h in self.handles.values():
            h.remove()
        self.handles = {}


class _Probed:
    """A routine step's stand-in for a module call whose inputs are probed (openstep._Call's `probes`)."""
    __slots__ = ("module", "type", "probes")

    def __init__(self, module: str, typ: str):
        self.module, self.type, self.probes = module, typ, []
