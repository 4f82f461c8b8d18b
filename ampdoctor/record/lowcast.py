"""Integers made or cast into fp16/bf16 inside a module's forward: positions, timesteps or counters that never
were a module's input, so the input probe (openstep._Step.probe_integers) cannot see them.

On a sampled step whose forward is due (StepMachine.lowcast_due: step 0, the first steps, then every
modstate.PROBE_GAP), a torch function mode is active for the root's forward. It only looks at what three kinds of
call do, and queues `stats.integer_probe` of the values in the open step, under the innermost module call running
(read back with the step's one transfer; rules/numeric.py integer_precision judges them):
- a creation in the low dtype: `torch.arange(T, dtype=self.inv_freq.dtype)` (older transformers rotary embeddings
  after `model.to(torch.bfloat16)`): the made values;
- a conversion of an integer (or fp32) tensor to the low dtype (`t.to(torch.bfloat16)`, `.half()`, `.type_as(h)`),
  or arithmetic whose type promotion does it (`h + t` with int64 `t` and a bf16 `h`): the integer operand;
- an op that autocast runs in the low dtype (`inv_freq @ pos.float()` under bf16 autocast): its fp32 operands.
The probe keeps openstep's limits (small vector-shaped tensors, one device); the mode returns every result as the
op made it and never replaces an argument.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..tensors import autocast_dtype

__all__ = ["LowCastMode"]

_LOW = (torch.float16, torch.bfloat16)
_MADE = frozenset({"arange", "linspace", "range"})
_CONVERT = frozenset({"to", "type", "half", "bfloat16", "type_as"})
_PROMOTE = frozenset({"add", "sub", "mul", "outer", "ger", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__",
                      "__isub__", "__mul__", "__rmul__", "__imul__"})
# (not a division: a mean over counts (`h.sum(1) / lengths`) loses only the dtype's usual relative precision)
_AUTOCAST = frozenset({"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "linear", "einsum", "addmm", "baddbmm",
                       "addbmm", "addmv", "mv", "conv1d", "conv2d", "conv3d"})
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class LowCastMode(TorchFunctionMode):
    """Active for the root's forward on a due sampled step (modulehooks); `m` is the StepMachine."""

    def __init__(self, m):
        super().__init__()
        self.m = m
        self.off = False  # left on the stack under a mode of the model's own (modulehooks._lowcast_off)
        self.error = None  # an error of ampdoctor's own in `_look`: the machine fails when the mode comes off

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype in _LOW and not (self.off or self.m.disabled) \
                and not torch.compiler.is_compiling():
            try:
                self._look(getattr(func, "__name__", ""), args, out)
            except Exception as e:  # never break the user's model (the mode is not on the stack in here)
                self.off, self.error = True, e
        return out

    def _look(self, name: str, args, out: torch.Tensor) -> None:
        st = self.m.st
        c = next((c for c in reversed(st.stack) if c is not None), None)
        if c is None:
            return
        low = out.dtype
        if name in _MADE:
            if type(out) is torch.Tensor:
                st.probe_cast(c, out, low, name)
        elif name in _CONVERT:
            src = args[0] if args and _plain(args[0]) else None
            if src is not None and (src.dtype in _INTS or src.dtype is torch.float32):
                st.probe_cast(c, src, low, name)
        elif name in _PROMOTE:
            for a in args[:2]:
                if _plain(a) and a.dtype in _INTS and a.numel() > 1:
                    st.probe_cast(c, a, low, name)
        elif name in _AUTOCAST and autocast_dtype(out.device.type) is low:
            for a in args[:3]:
                if _plain(a) and a.dtype is torch.float32:
                    st.probe_cast(c, a, low, name)


def _plain(a) -> bool:
    """A plain tensor outside autograd: what positions and timesteps are. Not a weight or an activation (they
    require grad: a Linear's fp32 weight under autocast is cast on every call), nor a tensor subclass (a DTensor's
    values are a shard)."""
    return type(a) is torch.Tensor and not a.requires_grad
