"""`ampdoctor.watch`: the Watch handle that owns every hook and patch on the user's model, optimizer, scaler.

Hooks only measure: they append device-side statistic vectors (ampdoctor/record/stats.py) to the open step
(ampdoctor/record/step.py), which crosses to the host once, just before the optimizer step. Step boundaries
come from the optimizer / GradScaler themselves; the user's loop needs no extra call.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import weakref

import torch
import torch.optim.optimizer as _optim
from torch import nn

from .config import WatchConfig
from .env import deprecated_scaler
from .errors import WatchError
from .exits import OPEN, hook_exit
from .integrations import deepspeed as _deepspeed
from .record.hooks import ModuleHook, hookable
from .record.clippatch import ClipPatch
from .record.monitor import OptimizerPatch, ScalerFinder, ScalerPatch, caller_location
from .record.runmeta import build_meta, masters_of, optimizer_meta, scaler_meta
from .record.step import StepMachine

__all__ = ["Watch", "watch"]

_WATCHED: "weakref.WeakKeyDictionary[nn.Module, Watch]" = weakref.WeakKeyDictionary()


def watch(model, optimizer=None, scaler=None, run_dir=None, *, every: int | None = None,
          config: WatchConfig | None = None, tensorboard_dir=None, writer=None,
          headroom: bool | None = None) -> "Watch":
    """Start watching `model` (and optionally its optimizer and GradScaler). Returns a `Watch`; use it as a
    context manager or call `.close()`. See shared/CONTRACT.md."""
    return Watch(model, optimizer=optimizer, scaler=scaler, run_dir=run_dir, every=every, config=config,
                 tensorboard_dir=tensorboard_dir, writer=writer, headroom=headroom)


class Watch:
    """Owns the hooks and patches of one watched model. `close()` removes all of them and is idempotent."""

    def __init__(self, model, optimizer=None, scaler=None, run_dir=None, *, every=None, config=None,
                 tensorboard_dir=None, writer=None, headroom=None):
        # -- DeepSpeed (ampdoctor/integrations/deepspeed.py): watch the engine's module, patch the engine
        ds_engine = _deepspeed.engine_of(model, optimizer)
        if ds_engine is not None:
            model, optimizer = ds_engine.module, None  # its optimizer steps fp32 masters: the engine is watched
        # -- end DeepSpeed
        wrapper = None
        if isinstance(getattr(model, "_orig_mod", None), nn.Module) and type(model).__name__ == "OptimizedModule":
            wrapper, model = model, model._orig_mod  # torch.compile's wrapper: the root's hooks go on it
        if not isinstance(model, nn.Module):
            raise WatchError(f"ampdoctor.watch expects a torch.nn.Module, got {type(model).__name__}; pass the "
                             "model itself (e.g. watch(model, optimizer=opt, scaler=scaler)).")
        if not hookable(model):
            raise WatchError(f"{type(model).__name__} is a TorchScript module, which takes no Python hooks; watch "
                             "the Python model before torch.jit.script (scripted submodules are left unwatched).")
        if model in _WATCHED and not _WATCHED[model].closed:
            raise WatchError("this model is already watched by another ampdoctor.watch; close that one first "
                             "(w.close() or leave its `with` block).")
        if config is not None and every is not None:
            raise WatchError("pass either every= or config=, not both")
        if config is not None and not isinstance(config, WatchConfig):
            raise WatchError(f"config= expects an ampdoctor.WatchConfig, got {type(config).__name__} (from a dict: "
                             "config=WatchConfig(**d))")
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise WatchError(f"writer= expects a TensorBoard SummaryWriter (with add_scalar), got "
                             f"{type(writer).__name__}; for a log directory pass tensorboard_dir=")
        if tensorboard_dir is not None and os.path.exists(tensorboard_dir) and not os.path.isdir(tensorboard_dir):
            raise WatchError(f"tensorboard_dir={os.fsdecode(tensorboard_dir)!r} is a file, not a directory")
        self.config = config or (WatchConfig(every=every) if every is not None else WatchConfig())
        if headroom is not None:  # the per-step headroom series (WatchConfig.headroom)
            # (a string other than "auto" is refused by WatchConfig, not read as True; 0/1 and numpy bools are bools)
            self.config = dataclasses.replace(self.config, headroom=headroom if isinstance(headroom, (bool, str))
                                              else bool(headroom))
        self.model = model
        self.run_dir = None if run_dir is None else os.fsdecode(run_dir) if isinstance(run_dir, (bytes, os.PathLike)) \
            else str(run_dir)
        params = {id(p) for p in model.parameters()}
        if optimizer is not None:
            if not hasattr(optimizer, "param_groups"):
                raise WatchError(f"optimizer= expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
            opt_params = [p for g in optimizer.param_groups for p in g["params"]]
            if not params and opt_params and not _holds(model, opt_params):
                # (a module keeping its trained tensors as plain attributes, not Parameters, holds them still)
                raise WatchError(f"the model ({type(model).__name__}) has no parameters, and the optimizer's are none "
                                 "of its tensors: watch the model the optimizer trains, not the loss module or "
                                 "another parameter-free module")
            if params and not any(id(p) in params for p in opt_params) and not masters_of(model, opt_params):
                raise WatchError("the optimizer does not hold any of the model's parameters; pass the optimizer "
                                 "built from this model (torch.optim.X(model.parameters(), ...)).")
        if scaler is not None and not all(hasattr(scaler, k) for k in ("scale", "unscale_", "step", "update")):
            raise WatchError(f"scaler= expects a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.optimizer, self.scaler = optimizer, scaler
        self._scaler_found = False  # self.scaler was adopted (ScalerFinder), not given
        self._closed = False
        self._replays: dict = {}  # capture -> its replay Report or None: see replayed()
        self._handles: list = []
        self._patches: list = []
        names = {}
        for name, m in model.named_modules(remove_duplicate=False):
            names.setdefault(id(m), name)
        if wrapper is not None:
            names[id(wrapper)] = ""  # the compiled wrapper stands for the root
        self._names = names
        self.meta = build_meta(self.model, self.optimizer, self.scaler, self.config.every)
        if ds_engine is not None:  # DeepSpeed: its optimizer, loss scaler and config (before the meta is written)
            _deepspeed.describe(ds_engine, self.meta)
        sinks = []
        if tensorboard_dir is not None or writer is not None:
            from .report.tensorboard import TensorBoardSink
            sinks.append(TensorBoardSink(logdir=tensorboard_dir, writer=writer))
        self.machine = StepMachine(self, sinks)
        self._wrapper = wrapper
        try:
            self._install()
            if ds_engine is not None:  # DeepSpeed: engine.backward / engine.step mark the steps
                self._patches.append(_deepspeed.EnginePatch(ds_engine, self.machine))
        except Exception as e:  # leave nothing half-installed behind
            self.close()
            raise WatchError(f"ampdoctor.watch could not install its hooks ({type(e).__name__}: {e}); the model "
                             "is left as it was.") from e
        _WATCHED[model] = self
        OPEN.add(self)
        hook_exit(True)

    # -- lifecycle -------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # the loop raised inside `with ampdoctor.watch(...)`: the open step is the one that crashed (a crash outside
        # the watched modules, e.g. in the loss or the data, leaves no other trace). A KeyboardInterrupt too: the
        # run stopped there, as a script's uncaught one is recorded (Watch._record_fatal at exit)
        if exc is not None:
            try:
                if isinstance(exc, SystemExit):
                    if exc.code not in (None, 0):
                        self._record_exit(exc.code)
                elif isinstance(exc, (Exception, KeyboardInterrupt)):
                    self._record_fatal(exc)
            except Exception:
                pass
        self.close()

    def close(self) -> None:
        """Finish the open step, remove every hook and patch, close the run directory. Idempotent. When the run
        went bad and left a capture, its op-level replay is run once and saved in the run directory (see
        `replayed`; single-process runs), so that `diagnose(run_dir)` and `ampdoctor report RUN_DIR` say what
        `w.report()` says."""
        self._close(replay=True)

    def _close(self, replay: bool) -> None:
        if self._closed:
            return
        self._closed = True
        st = self.machine.st
        if st.exception is not None and not st.exception.get("fatal") and sys.exc_info()[1] is None:
            # the script went on to close the watch with no exception on its way: the one the last step's forward
            # raised, the loop caught (a bad batch skipped on the last iteration); the run did not crash on it
            st.exception["caught"] = True
        try:
            self.machine.finish()
        finally:
            self.machine.remove_module_hooks()
            self.machine.hr_hooks.remove()
            self.machine.int_watch.remove()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            for p in self._patches:
                p.remove() if not isinstance(p, type) else p.discard(self.machine)
            self._patches.clear()
            ClipPatch.discard(self.machine)
            ScalerFinder.discard(self)
            self.machine.close()
            if _WATCHED.get(self.model) is self:
                del _WATCHED[self.model]
            OPEN.discard(self)
            hook_exit(False)
        # in a distributed run only where this rank can run the model by itself (replay/skeleton.alone: a DDP
        # model's module; not when its forward needs a collective the ranks without a capture would never join);
        # and only when a capture was taken (a healthy run's close reads no records and builds no report)
        if replay and self.run_dir is not None and not self.machine.disabled and self.machine.policy.captures and \
                ((self.meta.world_size or 1) <= 1 or _runs_alone(self.model)):
            try:
                from .analysis import build_report
                from .analysis.replaychoice import alarming, choose_replay
                steps = list(self.machine.records)
                rep = build_report(self.meta, steps, run_dir=self.run_dir)
                # (of a healthy-looking report, only a replay that finds an error is kept)
                choose_replay(rep, steps, lambda cap: self.replayed(cap, save_any=alarming(rep)))
            except Exception as e:  # the run directory stands without it; diagnose() then reports module-level
                import warnings
                warnings.warn(f"ampdoctor: could not save the replay of the run's capture ({type(e).__name__}: "
                              f"{e})", RuntimeWarning, stacklevel=3)

    def _record_fatal(self, exc) -> None:
        """The process is ending on `exc` (uncaught): mark the open step as the one that raised it."""
        m = self.machine
        if self._closed or m.disabled or not isinstance(exc, BaseException) or isinstance(exc, SystemExit):
            return
        if m.st.exception is None and m.raised_between(exc):
            m.begin()  # raised at the next iteration's top (its data): that iteration's step is the one that crashed
        if m.st.exception is None:
            m.st.exception = m.exception_info(exc, None)
        m.st.exception["fatal"] = True

    def _record_exit(self, status) -> None:
        """The script called sys.exit(status) with a failure status while watching: mark the open step with it."""
        m = self.machine
        if self._closed or m.disabled:
            return
        if m.st.exception is None:
            f, ln = caller_location(3)
            m.st.exception = {"module": None, "type": "SystemExit", "file": f, "line": ln, "autocast": None,
                              "message": f"the script called sys.exit({status!r})"}
        m.st.exception["fatal"] = True

    def __del__(self):  # pragma: no cover - best effort when a user forgets close()
        try:
            if not self._closed:
                self._close(replay=False)
        except Exception:
            pass

    # -- results ---------------------------------------------------------------------------------------
    @property
    def steps(self):
        """The StepRecords finished so far (in memory)."""
        return self.machine.records

    def report(self, *, replay: bool = True):
        """Build a Report from what was recorded so far (the open step is finished first). With `replay`,
        a capture of the first bad step is re-run in-process with op-level instrumentation when the model
        is still available, and its op-level findings are merged in."""
        from .analysis import build_report
        self.machine.finish_open_step(mid_run=not self._closed)
        steps = list(self.machine.records)
        rep = build_report(self.meta, steps, run_dir=self.run_dir)
        if replay:
            from .analysis import merge_replay
            rep = merge_replay(rep, self, steps)
        return rep

    def replayed(self, capture: str, *, save_any: bool = True):
        """The op-level replay (a Report) of one of this run's captures, as `report()` folds it in: run once
        in-process on the watched model (the watch's own hooks suspended; weights, gradients and RNG restored),
        then kept, and written into the run directory (`replay-<run>.json`) for `diagnose(run_dir)` (without
        `save_any`, only when it found an error: what `fold_replay` takes from it into a report without one). None
        when the replay could not run."""
        if capture in self._replays:
            return self._replays[capture]
        from .analysis.replayfold import run_replay
        from .replay.skeleton import alone as _alone, for_replay
        m = self.machine
        with m.suspend():  # the watch's own hooks must not record the replay's forward
            # (the model as the capture was written when the script has changed it since: replay/skeleton.py; the
            # batch with the objects a capture cannot give back exactly taken from the live ones: capture.relive)
            rr = run_replay(_relived(capture, m.capture_live.get(capture)),
                            for_replay(_alone(self.model) or self.model, m.skeletons.get(capture)))
        self._replays[capture] = rr
        writer = m.writer
        if rr is not None and writer is not None and getattr(writer, "run", None) is not None and (
                save_any or any(f.severity == "error" for f in rr.findings)):
            from .rundir import capture_name, write_replay
            try:
                write_replay(writer.path, writer.run, capture_name(capture), rr.to_dict())
            except OSError as e:
                import warnings
                warnings.warn(f"ampdoctor: could not save the replay in {writer.path} ({e})", RuntimeWarning,
                              stacklevel=2)
        return rr

    # -- for trainer integrations --------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """A new training iteration starts (e.g. a trainer's batch-start callback). The watch sees this itself
        when the watched module's forward runs; trainers that call only submodules say it here."""
        if not self._closed:
            self.machine.begin()

    def note_loss(self, loss) -> None:
        """Record the loss about to be backpropagated when neither `scaler.scale` nor the model's output shows
        it. The same tensor is not counted twice."""
        m = self.machine
        if self._closed or m.disabled or m.st.synced is not None:
            return
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
            t = loss.detach().reshape(())
            if not any(x.data_ptr() == t.data_ptr() for x in m.st.losses):
                m.st.losses.append(t)

    def owns_optimizer(self, optimizer) -> bool:
        """Whether `optimizer` steps any of the watched model's parameters."""
        return self.machine.owns(optimizer)

    # -- installation ----------------------------------------------------------------------------------
    def _install(self) -> None:
        m = self.machine
        m.root = root = self._wrapper if self._wrapper is not None else self.model
        self._handles.append(ModuleHook(m.forward_pre, "pre", eager=True).register(root))
        self._handles.append(ModuleHook(m.forward_post, "post", eager=True).register(root))
        if self._wrapper is not None:
            m.compiled = True  # the compiled graph carries no hooks of ampdoctor's (see modulehooks.py)
        m.sync_module_hooks()  # step 0 is sampled: the other modules' hooks go on now
        if self.config.headroom:  # every step, every module: abs-max forward and backward (headroom.py)
            m.hr_hooks.install()
        self._handles.append(_optim.register_optimizer_step_pre_hook(m.global_opt_pre))
        self._handles.append(_optim.register_optimizer_step_post_hook(m.global_opt_post))
        if self.optimizer is not None:
            self._patches.append(OptimizerPatch(self.optimizer, m))
            m.known_optimizers.add(id(self.optimizer))
        if self.scaler is not None:
            self._patches.append(ScalerPatch(self.scaler, m))
        # the loop's GradScaler, wherever it is made, is found at its first unscale_/step; one given that the loop
        # replaces (a new GradScaler for a second phase, a resume) is followed to the new one the same way
        ScalerFinder.add(self)
        ClipPatch.add(m)

    def adopt_optimizer(self, optimizer) -> None:
        """Start monitoring an optimizer seen stepping on the model's parameters (optimizer= not given)."""
        if self._closed:
            return
        self._patches.append(OptimizerPatch(optimizer, self.machine))
        if self.optimizer is None:
            self.optimizer = optimizer
            self.meta.optimizer = optimizer_meta(optimizer, self.model)

    def adopt_scaler(self, scaler, optimizer) -> bool:
        """Start monitoring a GradScaler seen unscaling or stepping an optimizer on the model's parameters
        (`scaler=` not given, or given and then replaced by the loop; record/monitor.ScalerFinder). A later,
        different scaler doing so replaces the one watched (a scaler made anew each epoch or phase). True when
        adopted."""
        if self._closed or self.machine.disabled or scaler is self.scaler or not self.machine.owns(optimizer):
            return False
        if self.scaler is not None and not self._scaler_found and any(
                e.kind in _SCALER_CALLS for e in self.machine.st.events):
            # the given scaler is in use in this very iteration: a second one beside it (one per network of the
            # model), not its replacement
            return False
        self.scaler, self._scaler_found = scaler, True
        self.meta.scaler = scaler_meta(scaler)
        env = self.meta.env
        for name in deprecated_scaler(scaler):  # made by a deprecated alias (torch.cpu.amp.GradScaler)
            if name not in env.setdefault("deprecated_amp", []):
                env["deprecated_amp"].append(name)
        self._patches.append(ScalerPatch(scaler, self.machine))
        self.machine.scaler_adopted = True  # (its first recorded call says so: rules/callorder.py)
        st = self.machine.st
        if getattr(scaler, "_scale", None) is not None:  # its scale() of this iteration ran before it was found
            st.scale_t, st.scaled_since_update = scaler._scale, True
        return True


_SCALER_CALLS = ("scale", "unscale_", "step", "update")


def _holds(model: nn.Module, tensors: list) -> bool:
    """Some module of `model` keeps one of `tensors` as an attribute (or in a list/tuple/dict attribute)."""
    ids = {id(t) for t in tensors}
    for mod in model.modules():
        for v in vars(mod).values():
            vals = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
            if any(id(x) in ids for x in vals):
                return True
    return False


def watch_of(model: nn.Module) -> "Watch | None":
    """The open watch of `model`, if one holds it."""
    w = _WATCHED.get(model)
    return w if w is not None and not w.closed else None


def _runs_alone(model) -> bool:
    """This rank can replay the model by itself (replay/skeleton.alone; imported here: a later stage)."""
    from .replay.skeleton import alone
    return alone(model) is not None


def _relived(capture: str, live: tuple | None):
    """Capture `capture` loaded, its args/kwargs given back the live objects the model received (capture.relive);
    the path itself when there are none, or the capture does not load (the replay then says why)."""
    if live is None:
        return capture
    from .capture import load_capture, relive
    from .errors import BadInput
    try:
        cap = load_capture(capture)
    except BadInput:
        return capture
    cap.args = relive(cap.args, tuple(live[0]))
    cap.kwargs = relive(cap.kwargs, dict(live[1] or {}))
    return cap
