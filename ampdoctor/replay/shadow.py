"""fp32 shadow and dtype what-if: the same batch in fp32 and under fp16 / bf16 (/ TF32 on CUDA).

Module forward hooks keep each call's floating outputs (and inputs), keyed by (module, call index), so a
low-precision run can be compared with the fp32 run module by module. `precision_suspects` picks modules
whose error stands far above the others *and* above the error they received from their inputs.

Both sides of a comparison run with dropout off (`NoDropout`: functional dropout is the identity, SDPA and
MultiheadAttention get dropout_p = 0): a low-precision run and an fp32 run do not draw the same dropout masks
(on CUDA, SDPA's fused fp16 kernel and the fp32 math kernel draw differently), and comparing two different
random masks measures the randomness, not the precision. Eval-mode dropout semantics on both sides compare like
with like; everything else (batch-norm statistics, train-mode branches) stays as captured.
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..record.stats import is_wrapped
from ..tensors import flatten_tensors
from . import modelio

__all__ = ["NoDropout", "Recorder", "Selections", "fp32_model", "rel_err", "run_dtype", "precision_suspects",
           "chose_differently", "whatif", "floats"]


def floats(tree) -> list[torch.Tensor]:
    """The non-empty floating tensors of a nested value (the recorder's flatten: dataclass outputs included); not a
    torch.func transform's wrapper (a module called inside vmap: its values are the transform's, not kept past it)."""
    return [t for t in flatten_tensors(tree, []) if t.is_floating_point() and t.numel() and not is_wrapped(t)]


def _floats(tree) -> list[torch.Tensor]:
    # a copy: a later in-place op (ReLU(inplace=True) after BatchNorm) must not change what was recorded
    return [t.detach().to(torch.float32, copy=True) for t in floats(tree)]


_DROPOUT_FNS = {f for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                            F.feature_alpha_dropout, torch.dropout, getattr(torch, "dropout_", None),
                            torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout) if f is not None}
# (function, position of the argument, its keyword, the value that turns dropout off)
_DROPOUT_ARGS = [(F.scaled_dot_product_attention, 4, "dropout_p", 0.0),
                 (F.multi_head_attention_forward, 13, "training", False)]


class NoDropout(TorchFunctionMode):
    """Dropout off for everything run inside: dropout functions return their input, SDPA runs with
    dropout_p = 0 and F.multi_head_attention_forward with training = False (its flag only gates dropout)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUT_FNS:
            return args[0] if args else kwargs["input"]
        for fn, pos, kw, off in _DROPOUT_ARGS:
            if func is fn:
                if len(args) > pos:
                    args = tuple(args[:pos]) + (off,) + tuple(args[pos + 1:])
                else:
                    kwargs[kw] = off
        return func(*args, **kwargs)


# value-ranking ops: their index outputs are discrete choices (an MoE router's top-k, a hard argmax)
_SELECT_OPS = frozenset({"aten::topk", "aten::sort", "aten::argsort", "aten::argmax", "aten::argmin", "aten::max",
                         "aten::min", "aten::kthvalue", "aten::median", "aten::nanmedian", "aten::mode"})
# of those, the ones mostly used for their values (`x - x.max(-1, keepdim=True).values`, a median): there a tie, equal
# values taken at another index, changes nothing. topk/sort/argmax are used for their indices (routing, gathering):
# there a tie broken another way is a choice like any other (an MoE router whose fp16 probabilities tie)
_VALUE_OPS = frozenset({"aten::max", "aten::min", "aten::kthvalue", "aten::median", "aten::nanmedian", "aten::mode"})


_TIE_NUMEL = 1 << 20  # inputs kept for the tie check up to this size (a router's logits); larger: any change counts


class Selection(NamedTuple):
    where: tuple               # the modules whose forward was running, outermost first
    idx: torch.Tensor          # the indices chosen
    inp: torch.Tensor | None   # the values chosen from (kept up to _TIE_NUMEL, for _VALUE_OPS), for the tie check
    dim: int | None            # along which (None: the flattened input, as argmax without dim)


class Selections(TorchDispatchMode):
    """The index outputs of value-ranking ops, in order, each with the modules whose forward was running (`stack`,
    kept by the Recorder). A low-precision run whose choices differ from the fp32 run's took another branch there:
    the error of those modules is that choice's (a token routed to another expert), not rounding's."""

    def __init__(self, stack: list):
        super().__init__()
        self.stack = stack
        self.log: list[Selection] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.name in _SELECT_OPS:
            idx = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)
                   and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if idx and x is not None:
                named = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                         for i, a in enumerate(func._schema.arguments)}
                dim = named.get("dim", -1)
                keep = func._schema.name in _VALUE_OPS and x.numel() <= _TIE_NUMEL
                self.log.append(Selection(tuple(self.stack), idx[-1].detach().clone(),
                                          x.detach().clone() if keep else None, dim if isinstance(dim, int) else None))
        return out


def _ties_only(lo: Selection, hi: Selection) -> bool:
    """For a value op (_VALUE_OPS): the fp32 run's indices pick, from the low-precision run's own values, the same
    values as its own indices did: the two runs differ by a tie (two maxima that fp16 rounds together), not by a
    choice."""
    x = lo.inp
    if x is None or lo.idx.shape != hi.idx.shape or x.dim() == 0:
        return False
    a, b = lo.idx.long(), hi.idx.long()
    if lo.dim is None:
        x, a, b, d = x.reshape(-1), a.reshape(-1), b.reshape(-1), 0
    else:
        d = lo.dim % x.dim()
        if a.dim() < x.dim():  # a reduction without keepdim dropped the dimension
            a, b = a.unsqueeze(d), b.unsqueeze(d)
    try:
        va, vb = x.gather(d, a), x.gather(d, b)
    except RuntimeError:
        return False
    return torch.equal(va.sort(d).values, vb.sort(d).values)


class Recorder:
    """Forward hooks on every module: inputs and outputs per (module, call). Removed on exit. `selections`: also
    log the choices of value-ranking ops (Selections), for `chose_differently`."""

    def __init__(self, model: torch.nn.Module, keep_inputs: bool = True, selections: bool = False):
        self.names = {m: n for n, m in model.named_modules()}
        self.keep_inputs = keep_inputs
        self.outs: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.ins: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.order: list[tuple[str, int]] = []
        self._calls: dict[str, int] = {}
        self._handles: list = []
        self._stack: list[str] = []
        self.selections = Selections(self._stack) if selections else None

    def _pre(self, mod, args, kwargs):
        self._stack.append(self.names[mod])

    def _hook(self, mod, args, kwargs, out):
        name = self.names[mod]
        if self._stack and self._stack[-1] == name:
            self._stack.pop()
        c = self._calls.get(name, 0)
        self._calls[name] = c + 1
        key = (name, c)
        self.order.append(key)
        self.outs[key] = _floats(out)
        if self.keep_inputs:
            self.ins[key] = _floats((args, kwargs))

    def __enter__(self) -> "Recorder":
        for m in self.names:
            if self.selections is not None:
                self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
        if self.selections is not None:
            self.selections.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.selections is not None:
            self.selections.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def overflow_modules(self) -> list[str]:
        """Modules (innermost first in call order) whose outputs hold inf/NaN while their inputs are finite."""
        found = []
        for key in self.order:
            outs, ins = self.outs[key], self.ins.get(key, [])
            if any(not bool(torch.isfinite(t).all()) for t in outs) and all(bool(torch.isfinite(t).all()) for t in ins):
                if key[0] not in found:
                    found.append(key[0])
        return found


def rel_err(lo: list[torch.Tensor], hi: list[torch.Tensor]) -> float | None:
    """‖lo − hi‖ / ‖hi‖ over matching tensors; inf when lo is non-finite where hi is finite; None if no match."""
    num = den = 0.0
    matched = False
    for a, b in zip(lo, hi):
        if a.shape != b.shape:
            continue
        matched = True
        fb = torch.isfinite(b)
        if bool((~torch.isfinite(a) & fb).any()):
            return math.inf
        num += float(((a - b)[fb] ** 2).sum())
        den += float((b[fb] ** 2).sum())
    if not matched:
        return None
    return 0.0 if num == 0.0 else math.sqrt(num) / max(math.sqrt(den), 1e-30)


def fp32_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself when its floating weights are fp32, else an fp32 deep copy."""
    if all(t.dtype == torch.float32 for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()):
        return model
    return copy.deepcopy(model).float()


def run_dtype(model, args, kwargs, *, device, dtype, rng, loss_fn, scale=None, tf32=False, cast_inputs=None,
              dropout: bool = True, selections: bool = False):
    """Run one step under `dtype` autocast (None = fp32) with a Recorder. Returns (recorder, finite, loss).
    `dropout=False` runs it under `NoDropout` (for comparisons between dtypes); `selections`: the recorder logs
    the choices of value-ranking ops (see chose_differently)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        if cast_inputs is not None:
            args, kwargs = modelio.to_device((args, kwargs), device, cast_inputs)
        with Recorder(model, selections=selections) as rec, (contextlib.nullcontext() if dropout else NoDropout()):
            out, loss, grads = modelio.run_step(model, args, kwargs, device=device, dtype=dtype, rng=rng,
                                                loss_fn=loss_fn, scale=scale)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    finite = all(bool(torch.isfinite(t).all()) for t in _floats(out) + _floats(loss) + list(grads.values()))
    return rec, finite, loss


def module_errors(lo: Recorder, hi: Recorder) -> list[dict]:
    """Per (module, call): relative error of outputs and of inputs vs the fp32 run, in call order."""
    rows = []
    for key in lo.order:
        if key not in hi.outs:
            continue
        e = rel_err(lo.outs[key], hi.outs[key])
        if e is None:
            continue
        ei = rel_err(lo.ins.get(key, []), hi.ins.get(key, []))
        rows.append({"module": key[0], "call": key[1], "rel_err": e, "in_rel_err": ei})
    return rows


def chose_differently(lo: Recorder, hi: Recorder) -> set[str]:
    """The modules in whose forward a value-ranking op of the low-precision run picked other indices than the fp32
    run's (both recorded with `selections`): every module on the stack at that op, its ancestors included. A
    difference that only swaps equal values in a max/min/median (ties: `x.max(-1)` of a stable softmax whose maxima
    fp16 rounds together) is no choice."""
    if lo.selections is None or hi.selections is None:
        return set()
    out: set[str] = set()
    for a, b in zip(lo.selections.log, hi.selections.log):
        if a.where == b.where and (a.idx.shape != b.idx.shape or not torch.equal(a.idx, b.idx)) \
                and not _ties_only(a, b):
            out.update(a.where)
    return out


def precision_suspects(rows: list[dict], factor: float = 10.0, floor: float = 1e-2,
                       strong: float = 0.1, chose: set | frozenset = frozenset()) -> list[dict]:
    """Rows whose error is > floor, > factor × the error of their inputs, and whose *own* contribution
    (rel_err − in_rel_err) is > factor × the median contribution — or which turn accurate inputs into an error
    of `strong` (10%) or more, however many modules downstream inherit it (then the median is large too).
    Downstream modules that only inherit an error are not blamed. When a module and one of its ancestors both
    qualify, the innermost is kept. Modules in `chose` (chose_differently: a top-k or argmax in them picked
    otherwise in low precision) are not suspects: their error is a discrete choice's, not lost precision."""
    fin = [r for r in rows if math.isfinite(r["rel_err"]) and math.isfinite(r["in_rel_err"] or 0.0)]
    if len(fin) < 3:
        return []
    fin = [r for i, r in enumerate(fin) if not _carried_from_inside(r, fin[:i])]
    own = {id(r): max(r["rel_err"] - (r["in_rel_err"] or 0.0), 0.0) for r in fin}
    med = statistics.median(own.values())
    hits = [r for r in fin if r["rel_err"] > floor and r["rel_err"] > factor * (r["in_rel_err"] or 0.0)
            and (own[id(r)] > factor * max(med, 1e-12) or r["rel_err"] >= strong) and r["module"] not in chose]
    names = {r["module"] for r in hits}
    return [dict(r, median=med) for r in hits
            if not any(o != r["module"] and (r["module"] == "" or o.startswith(r["module"] + ".")) for o in names)]


def _carried_from_inside(row: dict, before: list[dict]) -> bool:
    """The module's output error is (up to 2×) the error of the last of its own submodules to finish before it
    (rows are in completion order: children first): a parent — the root above all — whose error was made inside
    it, by submodules that each only added a little, is not where precision was lost."""
    name = row["module"]
    last = next((r for r in reversed(before) if r["module"] != name and
                 (name == "" or r["module"].startswith(name + "."))), None)
    return last is not None and row["rel_err"] <= 2.0 * last["rel_err"]


def whatif(model32, args, kwargs, *, device, rng, loss_fn, ref: Recorder, scale=None) -> dict:
    """{dtype: {finite, overflow_modules, max_rel_err_module, max_rel_err}} for fp16, bf16 and (CUDA) tf32, each
    run with dropout off like `ref` (which must be a dropout-off fp32 run)."""
    table = {}
    runs = [("float16", torch.float16, False), ("bfloat16", torch.bfloat16, False)]
    if torch.device(device).type == "cuda":
        runs.append(("tf32", None, True))
    for label, dt, tf32 in runs:
        try:
            rec, finite, _ = run_dtype(model32, args, kwargs, device=device, dtype=dt, rng=rng, loss_fn=loss_fn,
                                       scale=scale if dt == torch.float16 else None, tf32=tf32, dropout=False)
        except (RuntimeError, ValueError) as e:  # (ValueError: a model's own check refusing an inf/NaN it got)
            table[label] = {"finite": False, "error": str(e).splitlines()[0][:200], "overflow_modules": [],
                            "max_rel_err_module": None, "max_rel_err": None}
            continue
        rows = [r for r in module_errors(rec, ref) if r["module"] != ""] or module_errors(rec, ref)
        over = rec.overflow_modules()
        worst = max(rows, key=lambda r: (r["rel_err"], r["module"].count(".")), default=None)
        table[label] = {"finite": finite, "overflow_modules": over,
                        "max_rel_err_module": over[0] if over else (worst["module"] if worst else None),
                        "max_rel_err": worst["rel_err"] if worst else None}
    return table
