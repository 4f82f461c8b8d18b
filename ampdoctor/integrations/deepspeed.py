"""DeepSpeed: `ampdoctor.watch(engine)` for an engine from `deepspeed.initialize(...)`.

The watch goes on `engine.module` (the user's model); this module adds what DeepSpeed does instead of
`torch.amp.GradScaler`. `EnginePatch` wraps `engine.backward` and `engine.step` (one CallEvent each, with the
gradient-accumulation boundary); at each boundary `engine.step()` is the step boundary. The loss scale is read
twice: the scale DeepSpeed's loss scaler holds (what its optimizer divides the gradients by; the event's
`extra["ds_scale"]`) and the scale the backward really applied (the gradient that reaches the loss, times the
accumulation steps: `StepRecord.scale`), so a scale the engine never applies is seen (rules/deepspeed.py).
`found_inf`/`skipped` come from the optimizer's `overflow` flag. Gradient norms are measured at the boundary,
before DeepSpeed's step, divided by the applied scale (i.e. unscaled); under ZeRO-2 the engine has already
moved the gradients out of `p.grad` and only DeepSpeed's global norm is recorded (`engine.step` event,
`total_norm`). Per-rank records go to `run_dir/rank-<r>/` like FSDP; ampdoctor adds no collective.

`deepspeed` is never imported here: an engine is recognised by duck typing, and only where the object's
class comes from the `deepspeed` package (so the package is already loaded).
"""
from __future__ import annotations

import math
import sys

import torch
from torch import nn

from ..record.monitor import _InstancePatch
from ..record.params import model_grads, norms
from ..record.transfer import presync

__all__ = ["is_engine", "engine_of", "describe", "EnginePatch", "find_engine"]

_ENGINE_API = ("module", "backward", "step", "is_gradient_accumulation_boundary", "optimizer")


def is_engine(obj) -> bool:
    """Whether `obj` is a DeepSpeed engine (DeepSpeedEngine or a subclass), without importing deepspeed."""
    mod = type(obj).__module__ or ""
    if "deepspeed" not in sys.modules or not (mod == "deepspeed" or mod.startswith("deepspeed.")):
        return False
    return all(hasattr(obj, k) for k in _ENGINE_API) and isinstance(getattr(obj, "module", None), nn.Module)


def engine_of(model, optimizer=None):
    """The DeepSpeed engine to watch for `watch(model, optimizer=...)`: `model` itself when it is an engine, or
    the engine wrapping it (`watch(engine.module, optimizer=engine.optimizer)`, a trainer's callback); else None.
    Costs nothing unless deepspeed is loaded."""
    if "deepspeed" not in sys.modules:
        return None
    if is_engine(model):
        return model
    # the engine's own module with its optimizer (a trainer's callback): only then search the heap for the engine
    # (gc.get_referrers walks every object: not on each plain watch() of a process that merely imported deepspeed)
    from_ds = optimizer is not None and (type(optimizer).__module__ or "").startswith("deepspeed")
    return find_engine(model) if from_ds and isinstance(model, nn.Module) else None


def find_engine(module: nn.Module):
    """The DeepSpeed engine that wraps `module`, found among the objects that refer to it (for trainers that
    hand their callbacks only the inner model, e.g. `transformers.Trainer(deepspeed=...)`); None if none."""
    if "deepspeed" not in sys.modules:
        return None
    import gc
    for holder in gc.get_referrers(module):  # the engine's `_modules` dict, then the engine itself
        if isinstance(holder, dict):
            for eng in gc.get_referrers(holder):
                if is_engine(eng) and eng.module is module:
                    return eng
    return None


# -- what the engine is configured to do ---------------------------------------------------------------------

def _call(engine, name, default=None):
    fn = getattr(engine, name, None)
    try:
        return fn() if callable(fn) else default
    except Exception:
        return default


def scaler_state(opt) -> dict:
    """DeepSpeed's loss-scaler state as plain numbers: FP16_Optimizer/FP16_UnfusedOptimizer keep it in
    `loss_scale_config`, the ZeRO optimizers in `loss_scaler` (DynamicLossScaler with hysteresis, or a static
    LossScaler). Empty when the optimizer scales nothing."""
    cfg = getattr(opt, "loss_scale_config", None)
    if cfg is not None:
        if not getattr(cfg, "use_grad_scaling", True):
            return {}
        return {"cur_scale": float(cfg.cur_scale), "dynamic": bool(cfg.dynamic_loss_scale),
                "scale_factor": cfg.scale_factor, "scale_window": cfg.scale_window,
                "min_scale": cfg.min_loss_scale, "hysteresis": None}
    ls = getattr(opt, "loss_scaler", None)
    if ls is None or not hasattr(ls, "cur_scale"):
        return {}
    dyn = hasattr(ls, "scale_window")
    return {"cur_scale": float(ls.cur_scale), "dynamic": dyn, "scale_factor": getattr(ls, "scale_factor", None),
            "scale_window": getattr(ls, "scale_window", None), "min_scale": getattr(ls, "min_scale", None),
            "hysteresis": getattr(ls, "delayed_shift", None),
            "raise_error_at_min_scale": getattr(ls, "raise_error_at_min_scale", None)}


def _cur_scale(opt) -> float | None:
    cfg = getattr(opt, "loss_scale_config", None)
    if cfg is not None:
        return float(cfg.cur_scale) if getattr(cfg, "use_grad_scaling", True) else None
    ls = getattr(opt, "loss_scaler", None)
    return float(ls.cur_scale) if ls is not None and hasattr(ls, "cur_scale") else None


def _inner(opt):
    """The torch optimizer inside DeepSpeed's wrapper (it steps the fp32 master copies, when there are any)."""
    seen = 0
    while hasattr(getattr(opt, "optimizer", None), "param_groups") and seen < 4:
        opt, seen = opt.optimizer, seen + 1
    return opt


def describe(engine, meta) -> None:
    """Fill the RunMeta of a watch on `engine.module` with what DeepSpeed does (before it is written): which
    parameters the torch optimizer itself holds (under a DeepSpeed fp16/bf16 optimizer it holds fp32 master
    copies, not the model's low-precision parameters), the loss scaler, and the engine's precision config."""
    opt = getattr(engine, "optimizer", None)
    inner = _inner(opt) if opt is not None else None
    held = {id(p) for g in getattr(inner, "param_groups", []) for p in g["params"]}
    for row in meta.params:
        row[4] = None
    if inner is not None:
        ids = {n: id(p) for n, p in engine.module.named_parameters()}
        for row in meta.params:
            row[4] = ids.get(row[0]) in held
        dts = sorted({str(p.dtype).replace("torch.", "") for g in inner.param_groups for p in g["params"]})
        groups = [dict({k: g[k] for k in ("lr", "eps", "weight_decay") if isinstance(g.get(k), (int, float))},
                       params=[["?", str(p.dtype).replace("torch.", "")] for p in g["params"]][:2000])
                  for g in inner.param_groups]
        meta.optimizer = {"class": type(inner).__name__, "param_dtypes": dts, "groups": groups,
                          "deepspeed_wrapper": type(opt).__name__ if opt is not inner else None,
                          "master_weights": bool(held) and not any(ids.get(r[0]) in held for r in meta.params
                                                                  if r[2] in ("float16", "bfloat16"))}
    raw = getattr(getattr(engine, "_config", None), "_param_dict", None) or {}
    ds = sys.modules.get("deepspeed")
    info = {"version": getattr(ds, "__version__", None), "zero_stage": _call(engine, "zero_optimization_stage"),
            "fp16": bool(_call(engine, "fp16_enabled", False)), "bf16": bool(_call(engine, "bfloat16_enabled", False)),
            "gradient_accumulation_steps": _call(engine, "gradient_accumulation_steps"),
            "gradient_clipping": _call(engine, "gradient_clipping"),
            "optimizer": type(opt).__name__ if opt is not None else None,
            "config": {k: raw[k] for k in ("fp16", "bf16", "bfloat16", "zero_optimization", "gradient_clipping",
                                            "gradient_accumulation_steps") if k in raw}}
    meta.env = dict(meta.env, deepspeed=info)
    st = scaler_state(opt) if opt is not None and info["fp16"] else {}
    if st:
        f = st.get("scale_factor") or 2.0
        meta.scaler = {"class": f"deepspeed:{type(opt).__name__}", "enabled": True, "init_scale": st["cur_scale"],
                       "growth_factor": float(f), "backoff_factor": 1.0 / float(f),
                       "growth_interval": st.get("scale_window"), "dynamic": st["dynamic"],
                       "min_scale": st.get("min_scale"), "hysteresis": st.get("hysteresis"),
                       "raise_error_at_min_scale": st.get("raise_error_at_min_scale"),
                       "device": str(getattr(engine, "device", "")), "deepspeed": True}


# -- the patch on the engine ---------------------------------------------------------------------------------

class EnginePatch(_InstancePatch):
    """Wraps `engine.backward` and `engine.step` and tells the watch's step machine about them (the DeepSpeed
    counterpart of ScalerPatch + the monitor's callbacks). `remove()` restores the engine exactly."""

    def __init__(self, engine, machine):
        super().__init__(engine)
        self.engine, self.m = engine, machine
        self._applied = None      # the gradient reaching the loss in this step's first backward, x accumulation
        self._applied_step = -1
        self.wrap("backward", self._make_backward)
        self.wrap("step", self._make_step)

    def _make_backward(self, orig):
        return self._around(orig, lambda args, kwargs: self._guard(
            self._before_backward, args[0] if args else kwargs.get("loss"), kwargs),
                            self._after_backward)

    def _make_step(self, orig):
        return self._around(orig, lambda args, kwargs: self._guard(self._before_step), self._after_step)

    def _around(self, orig, before, after):
        """`orig` with `before(args, kwargs) -> token` ahead of it and `after(token)` behind it; a call that raises
        is recorded (`_failed`) before the exception goes on."""
        def call(*args, **kwargs):
            tok = before(args, kwargs)
            try:
                out = orig(*args, **kwargs)
            except BaseException as e:
                self._failed(tok, e)
                raise
            self._guard(after, tok)
            return out
        call.__wrapped__ = orig
        call.__name__ = getattr(orig, "__name__", "call")
        return call

    def _guard(self, fn, *args):
        """ampdoctor's own errors switch the watch off; they never reach the training loop."""
        if self.m.disabled:
            return None
        try:
            return fn(*args)
        except Exception as e:
            self.m.fail(e)
            return None

    def _failed(self, tok, e: BaseException) -> None:
        if tok is None:
            return
        ev, hook = tok
        ev.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        if hook is not None:
            hook.remove()

    # engine.backward(loss): the loss, and the scale the backward applies to it
    def _before_backward(self, loss, kwargs):
        m, eng = self.m, self.engine
        m.begin()
        ev = m.event("engine.backward", extra={"boundary": bool(_call(eng, "is_gradient_accumulation_boundary")),
                                                "micro_step": getattr(eng, "micro_steps", None)})
        hook = None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
            m.w.note_loss(loss)
            if loss.requires_grad and self._applied_step != m.st.step:
                gas = _call(eng, "gradient_accumulation_steps") or 1
                factor = float(gas) if kwargs.get("scale_wrt_gas", True) else 1.0
                self._applied_step = m.st.step
                self._applied = None

                def seen(g, _f=factor):
                    self._applied = g.detach().reshape(()).double() * _f  # d(backward's root)/d(loss)
                hook = loss.register_hook(seen)
        return ev, hook

    def _after_backward(self, tok):
        if tok is not None and tok[1] is not None:
            tok[1].remove()

    # engine.step(): at an accumulation boundary, the optimizer step and the end of ampdoctor's step
    def _before_step(self):
        m, eng = self.m, self.engine
        managed = _call(eng, "managed_gradient_accumulation", True)
        boundary = True if managed is False else bool(_call(eng, "is_gradient_accumulation_boundary", True))
        opt = getattr(eng, "optimizer", None)
        ev = m.event("engine.step", extra={"boundary": boundary, "ds_scale": _cur_scale(opt),
                                            "global_step": getattr(eng, "global_steps", None)})
        if boundary:
            st = m.st
            applied = self._applied if self._applied_step == st.step else None
            if applied is not None:
                st.scale_t = applied
            names, grads = model_grads(m)  # ZeRO-2: none left in p.grad (the engine reduced them away)
            if grads:
                div = applied if applied is not None else 1.0
                amax = norms(grads, math.inf) / div
                l2 = norms(grads, 2) / div if st.sampled else torch.empty(0, dtype=torch.float64,
                                                                          device=amax.device)
                st.grad_parts = (names, amax, l2)
            ev.extra["grads_measured"] = bool(grads)
        return ev, None

    def _after_step(self, tok):
        if tok is None:
            return
        ev = tok[0]
        if not ev.extra.get("boundary"):
            return
        m, eng = self.m, self.engine
        opt = getattr(eng, "optimizer", None)
        st = m.st
        overflow = getattr(opt, "overflow", None)
        if isinstance(overflow, bool):
            st.found_inf_t = torch.tensor(float(overflow), dtype=torch.float64)
            ev.extra["overflow"] = overflow
        ev.extra["scale_after"] = _cur_scale(opt)
        ev.extra["skipped_steps"] = getattr(eng, "skipped_steps", None)
        gn = getattr(eng, "_global_grad_norm", None)  # the attribute: get_global_grad_norm() may be a collective
        if isinstance(gn, torch.Tensor) and gn.numel() == 1:
            st.norms.append((ev, gn.detach().double().reshape(())))  # read with the step's one transfer
        elif isinstance(gn, (int, float)):
            ev.total_norm = float(gn)
        presync(m, None)
        m.end_step()
