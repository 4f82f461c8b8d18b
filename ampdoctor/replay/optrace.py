"""Op-level tracer: which ATen op first turned finite values into inf/NaN, in which module, on which line.

`OpTracer` is a context manager over one model. Inside it:
- per-module forward pre/post hooks keep a stack of qualified names (the innermost module running);
- a `TorchFunctionMode` maps each autograd node created in the forward to (module, source line, function),
  so a backward op can be attributed through `torch._C._current_autograd_node()`;
- a `TorchDispatchMode` sees every ATen op after autocast: it hands scalar arguments to the constant checks
  (ampdoctor/replay/constants.py) and, when a floating output is not finite, checks the inputs and records an
  `OpEvent` if this op produced the inf/NaN.
Checks are one `isfinite().all()` per floating output; inputs are only examined when an output is bad.
For the advice (explain.py keys it by op and evidence, never by module name) the tracer also keeps the shapes
that forward softmaxes were applied to (`softmax_inputs`: attention scores are what a softmax normalises) and
whether an op ran inside `F.scaled_dot_product_attention` (`OpEvent.in_sdpa`, `sdpa_used`).
"""
from __future__ import annotations

import math
import os
import sys
from collections import deque
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..record import cpustats
from ..tensors import flatten_tensors
from . import constants
from .opevent import (OpEvent, RESULT_OUTPUTS, absmin, floats, has_pole, is_lone, nonfinite_number, pole_inputs,
                      read_args, scalar_base, scalar_exponent)

__all__ = ["OpEvent", "OpTracer", "source_line"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AMPDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
MAX_EVENTS = 32


def _user_frame() -> tuple[str, int, str] | None:
    """(file, line, function) of the first frame outside torch and ampdoctor (the user's code)."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not (fn.startswith(_TORCH_DIR) or fn.startswith(_AMPDOCTOR_DIR) or fn.startswith("<frozen")):
            return fn, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return None


def _fmt(fr: tuple[str, int, str] | None) -> str | None:
    if fr is None:
        return None
    fn, line, name = fr
    return f"{fn if fn.startswith('<') else os.path.relpath(fn)}:{line} in {name}"


def source_line() -> str | None:
    """'file:line in func' of the first frame outside torch and ampdoctor (the user's code)."""
    return _fmt(_user_frame())


_SDPA = torch.nn.functional.scaled_dot_product_attention
_SETITEM = torch.Tensor.__setitem__
_SOFTMAX = {"aten::_softmax", "aten::softmax", "aten::_safe_softmax", "aten::_log_softmax", "aten::log_softmax"}


class _FnMode(TorchFunctionMode):
    def __init__(self, tracer: "OpTracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SETITEM and self.tracer.phase == "forward":
            constants.check_setitem(self.tracer, args)  # (the number it writes, before torch casts it)
        sdpa = func is _SDPA
        self.tracer.sdpa_depth += sdpa
        self.tracer.sdpa_used |= sdpa
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.tracer.sdpa_depth -= sdpa
        if torch.is_grad_enabled():
            for t in flatten_tensors(out, []):
                if t.grad_fn is not None and t.grad_fn not in self.tracer.nodes:
                    self.tracer.nodes[t.grad_fn] = (self.tracer.module(), _user_frame(),
                                                    getattr(func, "__name__", str(func)))
        return out


class _DispatchMode(TorchDispatchMode):
    def __init__(self, tracer: "OpTracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tracer
        tr.seq += 1
        if tr.phase == "forward":
            constants.check_op(tr, func, args, kwargs)
            if func._schema.name in _SOFTMAX and args and isinstance(args[0], torch.Tensor):
                tr.softmax_inputs.append((tr.seq, tr.module(), tuple(args[0].shape)))
        before = None
        if func._schema.is_mutable and len(tr.events) < MAX_EVENTS:
            # an in-place op (x.mul_(k), relu_, out=): its output is its input's storage, so the input must be
            # judged before the op writes it, or an op that overflowed in place reads as passing an inf on
            ins = floats(read_args(func, args, kwargs))
            before = _nan_inf(ins)
        try:
            out = func(*args, **kwargs)
        except Exception:
            tr.note_exception()
            raise
        if len(tr.events) < MAX_EVENTS and func.overloadpacket not in _UNINITIALIZED:
            tr.check_output(func, args, kwargs, out, before)
        return out


# ops whose output is uninitialised memory (it may hold any bit pattern, NaN included): never an origin
_UNINITIALIZED = {getattr(torch.ops.aten, n) for n in ("empty", "empty_like", "empty_strided", "new_empty",
                                                       "new_empty_strided", "resize_", "set_")
                  if hasattr(torch.ops.aten, n)}


def _absmaxes(ts: list) -> list[float] | None:
    """Each tensor's abs-max when all of `ts` are dense CPU tensors, in one C pass without a copy
    (record/cpustats.absmax: NaN when the tensor holds a NaN, else inf when it holds an inf); None otherwise. The
    torch checks below allocate a mask per tensor, which was most of a CPU replay's own time."""
    if ts and cpustats.available() and all(t.device.type == "cpu" and t.layout == torch.strided for t in ts):
        return cpustats.absmax(ts).tolist()
    return None


def _nonfinite(ts: list) -> list:
    """The tensors of `ts` holding inf or NaN."""
    m = _absmaxes(ts)
    if m is not None:
        return [t for t, v in zip(ts, m) if not math.isfinite(v)]
    return [t for t in ts if not bool(torch.isfinite(t).all())]


def _nan_inf(ts: list) -> tuple[bool, bool]:
    """(whether any of `ts` holds a NaN, whether any holds ±inf); with a NaN the second is not asked (False)."""
    m = _absmaxes(ts)
    if m is not None:
        nan = any(math.isnan(v) for v in m)
        return nan, not nan and any(math.isinf(v) for v in m)
    nan = any(bool(torch.isnan(t).any()) for t in ts)
    return nan, not nan and any(bool(torch.isinf(t).any()) for t in ts)


class OpTracer:
    """Context manager: trace one forward (and its backward, from `backward_begins`) of `model`."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.names: dict = {}  # a module under several names (shared, tied) has its first, as the watch names it
        for n, m in model.named_modules(remove_duplicate=False):
            self.names.setdefault(m, n)
        self.stack: list[str] = []
        self.nodes: dict = {}            # autograd node -> (module, line, torch function)
        self._node_module: dict = {}     # filled by propagate(): every reachable node -> forward info
        self.events: list[OpEvent] = []
        self.constants: list[dict] = []  # mask/eps constant events (constants.py)
        self.seq = 0
        self.phase = "forward"
        self.exception_module: str | None = None
        self.softmax_inputs: list[tuple[int, str | None, tuple]] = []   # (seq, module, shape), forward
        self.sdpa_depth = 0
        self.sdpa_used = False
        self._handles: list = []
        self._modes: list = []

    # module stack ---------------------------------------------------------------------------------
    def module(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def _pre(self, mod, args):
        self.stack.append(self.names.get(mod, ""))

    def _post(self, mod, args, out):
        name = self.stack.pop() if self.stack else None
        if self.phase == "forward" and self.events and self.events[-1].module == name and name is not None:
            # this module's own non-finite ops: did their values reach its output?
            mine = [e for e in self.events if e.module == name and e.phase == "forward" and not e.absorbed]
            if mine and all(bool(torch.isfinite(t).all()) for t in floats(out)):
                for e in mine:
                    e.absorbed = True
        if name is not None and torch.is_grad_enabled():
            # a node no op of ours saw made (an autograd Function applied by a forward hook of the user's own that
            # ran before this one): it belongs to the module whose output it made, not to the next consumer
            for t in flatten_tensors(out, []):
                fn = t.grad_fn
                if fn is not None and fn not in self.nodes:
                    self.nodes[fn] = (name, None, "forward hook")

    def __enter__(self) -> "OpTracer":
        for m in set(self.names):
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
        self._modes = [_FnMode(self), _DispatchMode(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def note_exception(self) -> None:
        """Remember the innermost module running when an op raised (before post hooks unwind the stack)."""
        if self.exception_module is None:
            self.exception_module = self.module()

    # backward attribution ---------------------------------------------------------------------------
    def backward_begins(self, root) -> None:
        """modelio.run_step's `on_backward`: the ops from here on are the backward of `root` (the scaled loss)."""
        self.phase = "backward"
        self.propagate([root.grad_fn])

    def propagate(self, roots) -> None:
        """Give every node reachable from `roots` the forward info of its nearest mapped consumer (BFS), so
        nodes created inside composite functions (e.g. F.normalize) are attributed too."""
        info = {}
        q = deque()
        for r in roots:
            if r is not None:
                info[r] = self.nodes.get(r, (None, None, None))
                q.append(r)
        while q:
            n = q.popleft()
            for nxt, _ in getattr(n, "next_functions", ()):
                if nxt is None or nxt in info:
                    continue
                info[nxt] = self.nodes.get(nxt, info[n])
                q.append(nxt)
        self._node_module = info

    def _where(self):
        if self.phase == "forward":
            return self.module(), None, None
        node = torch._C._current_autograd_node()
        if node is None:
            return None, None, None
        mod, frame, _ = self.nodes.get(node) or self._node_module.get(node) or (None, None, None)
        return mod, _fmt(frame), node.name()

    # inf/NaN origin ---------------------------------------------------------------------------------
    def check_output(self, func, args, kwargs, out, before: tuple | None = None) -> None:
        """Record an op that made inf/NaN from finite (overflow) or NaN-free (nan_origin) inputs (the arguments it
        reads: not an `out=` buffer, nor the `self` that copy_/fill_ overwrite). `before`: the inputs' (has NaN,
        has inf) taken before an in-place op ran (its inputs now hold its output)."""
        outs = floats(out)
        n_result = RESULT_OUTPUTS.get(func._schema.name)
        if n_result is not None and isinstance(out, (tuple, list)):
            outs = floats(tuple(out[:n_result]))  # the others are the op's workspace (CTC's log_alpha: log 0 = -inf)
        bad = _nonfinite(outs)
        if not bad:
            return
        read = read_args(func, args, kwargs)
        ins = floats(read)
        if not ins:
            ints = [t for t in flatten_tensors(read, []) if t.numel() and not t.is_floating_point()
                    and not t.is_complex() and t.dtype != torch.bool]
            if ints and not any(bool(torch.isnan(t).any()) for t in bad):
                # integers too large for the floating dtype they are cast to (a position 70000 -> fp16 is inf)
                self._record(func, "overflow", bad, ints, False, float(max(int(t.abs().max()) for t in ints)))
            return  # otherwise a factory (full, scalar_tensor...): constants.py judges its value
        const = nonfinite_number(args, kwargs)
        if const == "nan":
            return  # an intended NaN constant
        in_nan, in_inf = before if before is not None else _nan_inf(ins)
        if in_nan:
            return  # (neither kind below: NaN in, NaN or inf out) - most ops after the first bad one
        out_nan = sum(int(torch.isnan(t).sum()) for t in bad)
        pole = -1.0 if func._schema.name == "aten::log1p" else 0.0
        zeros = sum(int((t == pole).sum()) for t in pole_inputs(func, args, ins)) if has_pole(func, args) else 0
        # (an intended ±inf constant, e.g. masked_fill(mask, -inf), makes inf by design; NaN from it, as in
        # 0 * -inf, is still made here)
        finite_in = not in_nan and not in_inf and const is None
        if finite_in and (not out_nan or not zeros and any(bool(torch.isinf(t).any()) for t in bad)):
            # ±inf from finite inputs; NaN beside it, with no pole hit, is inf - inf in the op's own sums (a
            # convolution's or a matmul's partial sums past the max): an overflow, not a NaN-making op
            kind = "overflow"
        elif out_nan and not in_nan:
            kind = "nan_origin"
        else:
            return
        # the largest finite input value (non-finite ones read as 0; where() rather than t[isfinite(t)], which
        # compacts a copy of every large input)
        absmax = max((float(torch.where(torch.isfinite(t), t, 0).abs().max()) for t in ins if t.numel()),
                     default=0.0)
        self._record(func, kind, bad, ins, in_inf, absmax, before, in_zeros=zeros, args=args, kwargs=kwargs)

    def _record(self, func, kind: str, bad: list, ins: list, in_inf: bool, absmax: float, before=None,
                in_zeros: int = 0, args=(), kwargs=None) -> None:
        """Keep an OpEvent for `func`, which made the non-finite outputs `bad` from inputs `ins`."""
        out_nan = sum(int(torch.isnan(t).sum()) for t in bad)
        mod, line, node = self._where()
        if self.phase == "forward":
            line = source_line()
        self.events.append(OpEvent(
            seq=self.seq, phase=self.phase, module=mod, op=func._schema.name, kind=kind, line=line,
            autograd_node=node, out_dtype=str(bad[0].dtype).replace("torch.", ""), out_nan=out_nan,
            out_posinf=sum(int(torch.isposinf(t).sum()) for t in bad),
            out_neginf=sum(int(torch.isneginf(t).sum()) for t in bad), out_numel=sum(t.numel() for t in bad),
            absmax_in=absmax, in_dtypes=sorted({str(t.dtype).replace("torch.", "") for t in ins}),
            in_has_inf=in_inf, in_zeros=in_zeros,
            out_shape=list(bad[0].shape),
            in_sdpa=self.sdpa_depth > 0,
            in_param=any(t.is_leaf and t.requires_grad for t in ins),
            scalar_base=scalar_base(func, args), scalar_exponent=(e := scalar_exponent(func, args)),
            absmin_in=absmin(ins) if e is not None and e < 0 else None,
            mask_operand=func._schema.name in ("aten::mul", "aten::mul_") and before is None
            and constants.mask_operand(args, kwargs or {}),
            lone_extreme=kind == "overflow" and constants.is_mask_like(absmax) and is_lone(ins, absmax),
            grad_off=self.phase == "forward" and not torch.is_grad_enabled()))
