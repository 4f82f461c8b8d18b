"""The open step: what the hooks append during one optimizer step, and how it becomes a StepRecord.

`StepMachine` receives every hook and monitor callback of one Watch. During a step it only appends device
tensors (statistic vectors, the loss, the scale) and host-side call events. Just before the optimizer step
(`presync`) everything crosses to the host in one transfer; the record is finished when the next iteration
begins (`finalize`), so that `scaler.update()` and late calls land in the step they belong to.
"""
from __future__ import annotations

import dataclasses
import sys
import weakref
import warnings
from dataclasses import dataclass, field

import torch

from .monitor import caller_location, scaler_stage
from .producers import backward_producer, forward_producer
from .records import CallEvent, ModuleCall, ParamStat, StepRecord
from . import fused
from .stats import full_stats, is_measurable, light_stats, ref_dtype, thresholds

__all__ = ["StepMachine", "flatten_tensors"]

_LOW = (torch.float16, torch.bfloat16)


def flatten_tensors(obj, out: list, depth: int = 0) -> list:
    """Tensors inside nested tuples/lists/dicts/dataclasses (Hugging Face ModelOutput included)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        pass
    elif isinstance(obj, dict):
        for v in obj.values():
            flatten_tensors(v, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            flatten_tensors(v, out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            flatten_tensors(getattr(obj, f.name, None), out, depth + 1)
    return out


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


@dataclass
class _Call:
    module: str
    type: str
    call: int
    seq: int
    depth: int
    parent: int | None
    autocast: str | None
    grad_enabled: bool
    rows: dict = field(default_factory=lambda: {"inp": [], "par": [], "out": [], "gout": [], "gin": []})
    bseq: int | None = None


@dataclass
class _Step:
    step: int
    sampled: bool
    calls: list = field(default_factory=list)
    vecs: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    stack: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    events: list = field(default_factory=list)
    scale_t: object = None
    found_inf_t: object = None
    grad_parts: object = None
    param_names: list = field(default_factory=list)
    upd: list = field(default_factory=list)
    batch: object = None
    rng: object = None
    autocast: str | None = None
    micro: int = 0
    exception: dict | None = None
    synced: dict | None = None
    ended: bool = False
    bseq: int = 0
    in_scaler_step: int = 0
    scaled_since_update: bool = False
    capture: str | None = None
    vec_order: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)
    pending: object = None
    fbuf: dict = field(default_factory=dict)
    fused_amp: bool = False


class StepMachine:
    """Hook and monitor callbacks of one Watch; see the module docstring."""

    def __init__(self, watch, sinks):
        self.w = watch
        self.cfg = watch.config
        self.sinks = sinks
        self.records: list[StepRecord] = []
        self.known_optimizers: set[int] = set()
        self._rejected_optimizers: set[int] = set()
        self._followup = 0
        self._event_index = 0
        self._captures = 0
        self._captured_kinds: set[str] = set()
        self._mod_handles: list = []
        self.params = [(n, p) for n, p in watch.model.named_parameters()]  # fixed for the watch's lifetime
        self.param_info = {n: (str(p.dtype).replace("torch.", ""), p.numel()) for n, p in self.params}
        self.param_modules: dict[str, int] = {}
        for n, p in self.params:
            mod = n.rpartition(".")[0]
            self.param_modules[mod] = self.param_modules.get(mod, 0) + p.numel()
        self._detailed: list = []      # sampled records whose module details are kept in memory
        self._last_seq: tuple = ()     # the last routine call sequence (see sync._store)
        self._skip_streak = 0
        self._disabled = False
        self.suspended = False
        self._root = watch.model
        self._model_params = None
        self.writer = None
        if watch.run_dir is not None:
            import os
            from .rundir import RunDirWriter
            meta = watch.meta
            path = watch.run_dir
            if meta.rank is not None and (meta.world_size or 1) > 1:
                path = os.path.join(path, f"rank-{meta.rank}")
            self.writer = RunDirWriter(path, meta)
        self.st = self._new_step(0)

    # -- step lifecycle -----------------------------------------------------------------------------
    def _new_step(self, step: int) -> _Step:
        every = self.cfg.every
        sampled = step % every == 0 or self._followup > 0
        if self._followup > 0:
            self._followup -= 1
        return _Step(step=step, sampled=sampled)

    def _begin(self) -> None:
        """A new iteration starts (root forward, zero_grad, scaler.scale): close the ended step."""
        if self.st.ended:
            self.finalize()
            self.st = self._new_step(self.st.step + 1)
            self.sync_module_hooks()

    # Hooks on the modules below the root are only present on sampled steps: a routine step runs the model
    # with the root's two hooks alone (the cheapest watch is the one that is not there).
    def sync_module_hooks(self) -> None:
        want = self.st.sampled and not self._disabled
        if want and not self._mod_handles:
            for mod in self.w.model.modules():
                if mod is self._root:
                    continue
                self._mod_handles.append(mod.register_forward_pre_hook(self.forward_pre, with_kwargs=True))
                self._mod_handles.append(mod.register_forward_hook(self.forward_post, with_kwargs=True,
                                                                   always_call=True))
        elif not want and self._mod_handles:
            self.remove_module_hooks()

    def remove_module_hooks(self) -> None:
        for h in self._mod_handles:
            h.remove()
        self._mod_handles = []

    def finish_open_step(self) -> None:
        st = self.st
        trained = st.ended or st.events or st.losses or st.micro or st.exception
        if trained or (st.calls and not self.records):  # an eval-only tail after training is not a step
            self.finalize()
            self.st = self._new_step(st.step + 1)
            if not self.w.closed:
                self.sync_module_hooks()

    def finish(self) -> None:
        if not self._disabled:
            self.finish_open_step()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for s in self.sinks:
            try:
                s.close()
            except Exception:
                pass

    def _fail(self, e: BaseException) -> None:
        """An error inside ampdoctor itself: switch ampdoctor off, keep the user's training running."""
        if not self._disabled:
            self._disabled = True
            warnings.warn(f"ampdoctor disabled itself after an internal error ({type(e).__name__}: {e}); "
                          "training continues unwatched. Please report this.", RuntimeWarning, stacklevel=3)

    def _event(self, kind: str, **kw) -> CallEvent:
        f, ln = caller_location(3)
        ev = CallEvent(kind=kind, step=self.st.step, index=self._event_index, file=f, line=ln, **kw)
        self._event_index += 1
        self.st.events.append(ev)
        return ev

    # -- module hooks --------------------------------------------------------------------------------
    def forward_pre(self, module, args, kwargs):
        if self._disabled or self.suspended:
            return None
        try:
            return self._forward_pre(module, args, kwargs)
        except Exception as e:  # never break the user's model
            self._fail(e)
            return None

    def _forward_pre(self, module, args, kwargs):
        st = self.st
        if module is self._root and not st.stack:
            self._begin()
            st = self.st
            if torch.is_grad_enabled():
                st.micro += 1
                st.batch = (args, kwargs)
                st.rng = _rng_state()
                st.autocast = _autocast_str()
        if not st.sampled or len(st.calls) >= self.cfg.max_module_calls:
            st.stack.append(None)
            return None
        name = self.w._names.get(id(module), "?")
        n = st.counts.get(name, 0)
        st.counts[name] = n + 1
        parent = next((c.seq for c in reversed(st.stack) if c is not None), None)
        grad = torch.is_grad_enabled()
        c = _Call(module=name, type=type(module).__name__, call=n, seq=len(st.calls), depth=len(st.stack),
                  parent=parent, autocast=_autocast_str(), grad_enabled=grad)
        st.calls.append(c)
        st.stack.append(c)
        tensors = flatten_tensors(args, flatten_tensors(kwargs, [])) if kwargs else flatten_tensors(args, [])
        for t in tensors:
            if is_measurable(t):
                self._row(c, "inp", t, light=True)
        if grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            return self._wrap_inputs(c, args, kwargs)
        return None

    def _wrap_inputs(self, c: _Call, args, kwargs):
        """Give the module a view of each input that requires grad, so the gradient flowing out of *this*
        module (not the sum over all consumers) can be measured. Identical tensors get one view, so
        identity checks such as MultiheadAttention's `query is key` behave as before."""
        memo: dict[int, torch.Tensor] = {}

        def sub(x, depth=0):
            if isinstance(x, torch.Tensor):
                if not (x.requires_grad and is_measurable(x)):
                    return x
                v = memo.get(id(x))
                if v is None:
                    v = x.view_as(x)
                    v.register_hook(self._grad_hook(c, "gin"))
                    memo[id(x)] = v
                return v
            if depth < 2 and type(x) in (tuple, list):
                return type(x)(sub(y, depth + 1) for y in x)
            return x
        new_args = tuple(sub(a) for a in args)
        new_kwargs = {k: sub(v) for k, v in kwargs.items()} if kwargs else kwargs
        return new_args, new_kwargs

    def forward_post(self, module, args, kwargs, output):
        if self._disabled or self.suspended:
            return None
        try:
            self._forward_post(module, output)
        except Exception as e:
            self._fail(e)
        return None

    def _forward_post(self, module, output):
        st = self.st
        c = st.stack.pop() if st.stack else None
        exc = sys.exc_info()[1]
        if exc is not None and st.exception is None:
            f, ln = _tb_location(exc)
            st.exception = {"module": _tb_module(exc, self.w._names, self.w._names.get(id(module), "?")),
                            "type": type(exc).__name__,
                            "message": str(exc).split("\n")[0][:500], "file": f, "line": ln,
                            "autocast": _autocast_str()}
        if module is self._root and not st.stack and exc is None and torch.is_grad_enabled():
            loss = _loss_of(output)
            if loss is not None and self.w.scaler is None:
                st.losses.append(loss)
        if c is None or exc is not None:
            return
        for t in flatten_tensors(output, []):
            if is_measurable(t):
                self._row(c, "out", t, light=False)
                if t.requires_grad and c.grad_enabled:
                    t.register_hook(self._grad_hook(c, "gout"))

    def _row(self, c: _Call, slot: str, t: torch.Tensor, light: bool, ref=None) -> None:
        st = self.st
        if ref is None:
            ref = ref_dtype(t.dtype, _autocast_dtype(t.device.type))
        # A tensor measured once this step (a module's output is the next one's input; a gradient flows
        # into one module and out of another) is not measured again.
        # Keyed by memory, not identity: a view of the same memory (e.g. the gradient flowing out of one module
        # and into the next) has the same values. The first tensor measured there must still be alive (so the
        # memory was not reused) and the shared version counter unchanged (no in-place write since).
        try:
            key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version, ref)
        except RuntimeError:  # inference tensors have no version counter; some wrappers no storage
            key = None
        hit = st.seen.get(key) if key is not None else None
        if hit is not None and hit[0]() is not None and (light or hit[2]):
            c.rows[slot].append((hit[1], _dt(t.dtype), _dt(ref)))
            return
        idx = len(st.vecs)
        if t.is_cuda and fused.available(t):  # one Triton kernel per tensor, into the step's buffer
            buf = st.fbuf.get(t.device)
            if buf is None:
                buf = st.fbuf[t.device] = fused.StatBuffer(t.device)
            v = ("fused", t.device, buf.add(t, thresholds(t.dtype, ref)))
            light = False
        else:
            v = light_stats(t, ref) if light else full_stats(t, ref)
        c.rows[slot].append((idx, _dt(t.dtype), _dt(ref)))
        st.vecs.append(v)
        if key is not None:
            try:
                st.seen[key] = (weakref.ref(t), idx, not light)
            except TypeError:
                pass

    def _grad_hook(self, c: _Call, slot: str):
        st = self.st

        def hook(g):
            if self._disabled or self.st is not st or g is None or not is_measurable(g):
                return None
            try:
                if c.bseq is None:
                    c.bseq = st.bseq
                    st.bseq += 1
                ref = ref_dtype(g.dtype, _autocast_dtype(g.device.type) or _ac_from_str(c.autocast))
                self._row(c, slot, g, light=slot == "gin", ref=ref)
            except Exception as e:
                self._fail(e)
            return None
        return hook

    # -- scaler / optimizer / clip monitor (called by monitor.py patches) ----------------------------------
    def before(self, kind, args, kwargs):
        if self._disabled:
            return None
        if kind == "scale":
            self._begin()
        st = self.st
        opt = None
        if kind in ("unscale_", "step"):
            opt = args[0] if args else kwargs.get("optimizer")
        stage = scaler_stage(self.w.scaler, opt) if opt is not None else None
        ev = self._event(kind, stage=stage)
        if st.in_scaler_step > 0:
            ev.detail["internal"] = True  # e.g. the unscale_ that scaler.step() does itself
        if kind == "scale":
            out = args[0] if args else kwargs.get("outputs")
            if isinstance(out, torch.Tensor) and out.numel() == 1:
                st.losses.append(out.detach().reshape(()))
            st.scaled_since_update = True
        elif kind == "update":
            st.scaled_since_update = False
            new = args[0] if args else kwargs.get("new_scale")
            ev.detail["has_steps"] = any(e.kind == "step" for e in st.events)
            if new is not None:
                ev.detail["new_scale"] = float(new) if not isinstance(new, torch.Tensor) else None
        elif kind == "step":
            st.in_scaler_step += 1
            if opt is not None and id(opt) not in self.known_optimizers and self._owns(opt):
                self.known_optimizers.add(id(opt))
                self.w.adopt_optimizer(opt)
        return (ev, opt)

    def after(self, tok, args, kwargs, out):
        if tok is None or self._disabled:
            return
        ev, opt = tok
        st = self.st
        sc = self.w.scaler
        if ev.kind == "scale" and getattr(sc, "_scale", None) is not None:
            st.scale_t = sc._scale.detach().clone()
        if ev.kind == "step":
            st.in_scaler_step -= 1
            try:
                fi = self.w.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
                if fi:
                    st.found_inf_t = torch.stack([v.detach().double().reshape(()) for v in fi.values()]).sum()
            except (AttributeError, KeyError, TypeError):
                pass
            self._presync(opt)
            st.ended = True

    def failed(self, tok, e: BaseException) -> None:
        if tok is None:
            return
        ev = tok[0] if isinstance(tok, tuple) else tok
        ev.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        if ev.kind == "step":
            self.st.in_scaler_step = max(self.st.in_scaler_step - 1, 0)

    def zero_grad(self, optimizer) -> None:
        if self._disabled:
            return
        self._begin()
        self._event("zero_grad")

    def clip_before(self, kind, parameters):
        if self._disabled:
            return None
        ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        mine = self._model_param_ids()
        if not any(id(p) in mine for p in ps):
            return None
        sc = self.w.scaler
        stage = None
        scaled = False
        if sc is not None and self.w.optimizer is not None and getattr(sc, "_enabled", True):
            stage = scaler_stage(sc, self.w.optimizer)
            scaled = self.st.scaled_since_update and stage in (None, "READY")
        return self._event(kind, stage=stage, scaled=scaled)

    def clip_after(self, ev, out) -> None:
        if ev is None:
            return
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            ev.detail["norm_t"] = out.detach().double().reshape(())

    def global_opt_pre(self, opt, args, kwargs):
        if self._disabled:
            return None
        try:
            if id(opt) not in self.known_optimizers:
                if id(opt) in self._rejected_optimizers or not self._owns(opt):
                    self._rejected_optimizers.add(id(opt))
                    return None
                self.known_optimizers.add(id(opt))
                self.w.adopt_optimizer(opt)
            closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
            if callable(closure) and not isinstance(opt, torch.optim.LBFGS):
                # forward/backward run inside step(closure): do the step's work after the closure returns
                def wrapped(_c=closure, _opt=opt):
                    out = _c()
                    self._opt_pre(_opt)
                    return out
                if len(args) > 1:
                    return (args[0], wrapped, *args[2:]), kwargs
                return args, dict(kwargs, closure=wrapped)
            self._opt_pre(opt)
        except Exception as e:
            self._fail(e)
        return None

    def _opt_pre(self, opt) -> None:
        if self._disabled:
            return
        try:
            st = self.st
            sc = self.w.scaler
            stage = scaler_stage(sc, opt) if sc is not None else None
            via = st.in_scaler_step > 0
            fused = via and getattr(opt, "_step_supports_amp_scaling", False)
            if fused:  # GradScaler calls a fused optimizer's step even when it skips: read its found_inf
                fi = getattr(opt, "found_inf", None)
                if isinstance(fi, torch.Tensor):
                    st.found_inf_t = fi.detach().double().reshape(-1).sum()
                st.fused_amp = True
            scaled = bool(sc is not None and (not via or fused) and st.scaled_since_update
                          and stage in (None, "READY"))
            self._event("optimizer.step", stage=stage, scaled=scaled and not via,
                        detail={"via_scaler": via, "fused": bool(fused)})
            self._presync(opt, grads_scaled=scaled)
            self._update_check_pre(opt)
            if not via:
                st.ended = True
        except Exception as e:
            self._fail(e)

    def global_opt_post(self, opt, args, kwargs):
        if self._disabled or id(opt) not in self.known_optimizers:
            return
        try:
            self._update_check_post(opt)
        except Exception as e:
            self._fail(e)

    def _owns(self, opt) -> bool:
        mine = self._model_param_ids()
        return any(id(p) in mine for g in opt.param_groups for p in g["params"])

    def _model_param_ids(self) -> set:
        if self._model_params is None:
            self._model_params = {id(p) for p in self.w.model.parameters()}
        return self._model_params

    # -- the one transfer per step ---------------------------------------------------------------------
    def _presync(self, opt, grads_scaled: bool = False) -> None:
        from .sync import presync
        presync(self, opt, grads_scaled)

    def _update_check_pre(self, opt) -> None:
        from .sync import update_check_pre
        update_check_pre(self, opt)

    def _update_check_post(self, opt) -> None:
        from .sync import update_check_post
        update_check_post(self, opt)

    def finalize(self) -> None:
        from .sync import finalize
        try:
            finalize(self)
        except Exception as e:
            self._fail(e)


def _loss_of(output):
    """The model's own loss: a scalar output, `.loss`, or output["loss"]."""
    t = output
    if not isinstance(t, torch.Tensor):
        t = getattr(output, "loss", None)
        if t is None and isinstance(output, dict):
            t = output.get("loss")
    if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
        return t.detach().reshape(())
    return None


def _rng_state():
    s = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def _autocast_dtype(device_type: str):
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):
        pass
    return None


def _autocast_str() -> str | None:
    for dev in ("cuda", "cpu"):
        d = _autocast_dtype(dev)
        if d is not None:
            return f"{dev}:{_dt(d)}"
    return None


def _ac_from_str(s: str | None):
    if not s:
        return None
    return getattr(torch, s.split(":")[1], None)


def _tb_module(exc: BaseException, names: dict, default: str) -> str:
    """The innermost watched module whose forward is on the traceback (found through `self` in its frame)."""
    tb = exc.__traceback__
    best = default
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if obj is not None and id(obj) in names and tb.tb_frame.f_code.co_name == "forward":
            best = names[id(obj)]
        tb = tb.tb_next
    return best


def _tb_location(exc: BaseException) -> tuple[str | None, int | None]:
    """The deepest traceback frame in user code (outside torch and ampdoctor)."""
    from .monitor import _PKG_DIR, _TORCH_DIR
    tb = exc.__traceback__
    best = (None, None)
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not (fn.startswith(_PKG_DIR) or fn.startswith(_TORCH_DIR)):
            best = (fn, tb.tb_lineno)
        tb = tb.tb_next
    return best
