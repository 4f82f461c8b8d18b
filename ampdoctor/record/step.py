"""The open step: what the hooks append during one optimizer step, and how it becomes a StepRecord.

`StepMachine` receives every hook and monitor callback of one Watch (the module hooks' in modulehooks.py, the
scaler patches' in monitorsink.py, the optimizer's in optsink.py, the clipping functions' in clipsink.py). During a
step it only appends device tensors (statistic vectors, the loss, the scale) and host-side call events to the open
step (openstep._Step, whose phase says where it is: OPEN, STAGED, ENDED, FINAL). Just before the optimizer step
(`presync`) everything crosses to the host in one transfer; the record is finished when the next iteration begins
(`finalize`), so that `scaler.update()` and late calls land in the step they belong to. Whether an ended step's
iteration goes on, and what becomes of the step a report or a close finds open, is record/stepends.py's.
"""
from __future__ import annotations

import contextlib
import time
import warnings
import weakref

import torch

from .autocapture import CapturePolicy
from .buffers import BufferWatch
from .hooks import GradTap, ModuleHook, hookable, passes_on
from .modulehooks import ModuleHookCallbacks
from .monitor import LOOSE, caller_location
from .monitorsink import MonitorCallbacks
from .optsink import OptimizerCallbacks
from .clipsink import ClipCallbacks
from ..records import CallEvent, StepRecord
from .openstep import StepPhase, _Step
from .headroom import Headroom
from .headroomhooks import HeadroomHooks
from .intwatch import IntWatch
from .hostcopy import HostSlots
from .fused import DeferPlan
from .assemble import finalize
from .entries import step_ended
from .stepends import StepEnds
from ..tensors import flatten_tensors, is_sharded  # noqa: F401  (flatten_tensors: re-exported)

__all__ = ["StepMachine", "flatten_tensors"]


class StepMachine(ModuleHookCallbacks, MonitorCallbacks, OptimizerCallbacks, ClipCallbacks, StepEnds):
    """Hook and monitor callbacks of one Watch; see the module docstring."""

    def __init__(self, watch, sinks):
        self.w = watch
        self.cfg = watch.config
        self.sinks = sinks
        self.records: list[StepRecord] = []
        self.known_optimizers: set[int] = set()
        self.opt_numbers: dict[int, int] = {}  # id(optimizer) -> 0, 1, ... in order of first scaler call
        self.stepped_grads: dict = {}  # id(optimizer) -> monitorsink._first_grad as its last scaler.step ended
        self.opt_stepped_at: dict = {}  # id(optimizer) -> the step its last scaler.step() was in (iteration_goes_on)
        self._rejected_optimizers: set[int] = set()
        self.zero_pending = None  # a zero_grad after a scaled loss, until it returns (optsink.zero_grad_done)
        self._event_index = 0
        self.policy = CapturePolicy(self.cfg)  # which steps are sampled, which bad steps captured
        self._mod_handles: list = []
        self.host_slots = HostSlots()  # the pinned buffers the step's values come back through (hostcopy.py)
        self.copy_inputs = False  # the model writes into its inputs: batches are kept as copies (input_writes)
        self.skeletons: dict = {}  # capture path -> the model's structure when it was written (replay/skeleton.py)
        # capture path -> (args, kwargs) as the model received them (capture.relive): references, at most
        # max_captures batches, kept while the watch lives (the replay runs at report/close)
        self.capture_live: dict = {}
        # what the forward draws from besides torch's default generators, kept with each batch (tensors.rng_state):
        # (Python's random, NumPy's global RNG: found drawn from on a sampled step, modulehooks._rng_drawn; the
        # torch.Generators the model holds)
        gens = [(f"{n}.{k}" if n else k, v) for n, mod in watch.model.named_modules() for k, v in vars(mod).items()
                if isinstance(v, torch.Generator)]
        self.rng_extra = (False, False, gens) if gens else None
        self.rng_probe = None
        self.rng_probed_at = -(1 << 30)  # the last step whose forward was probed for Python's / NumPy's RNG
        self.lowcast = None  # (lowcast.LowCastMode, the module whose forward it is active for), or None
        self.lowcast_at = -(1 << 30)  # the last step whose forward ran under it (modulehooks._lowcast_due)
        self.has_compiled_parts = any(hasattr(mod, "_orig_mod") or getattr(mod, "_compiled_call_impl", None)
                                      is not None for mod in watch.model.modules())
        self.threw_away = False  # the loop threw an iteration away (its own loss scale: optsink.discards_iteration)
        # the module state the forward reads besides its arguments (record/modstate.py): [(key, module, name, copy)]
        # found on probed steps, snapshotted with each batch from then on
        self.state_keys: list = []
        self.state_probe = None
        self.probed_at = -(1 << 30)  # the last step whose forward was probed (modstate.due)
        self.exc_at_top = None  # the open step's exception when the top-level forward began (modulehooks.py)
        self.exc_obj = None     # the exception recorded last inside the running top-level forward (modulehooks.py)
        # always-on headroom (ampdoctor/record/headroom.py): one slot per module, in RunMeta.modules order
        mods = [m for _, m in watch.model.named_modules()]
        self.slot_of = {id(m): i for i, m in enumerate(mods)}
        self.slot_of_name = {n: i for i, (n, _) in enumerate(watch.model.named_modules())}
        self.hr = Headroom(len(mods))
        self.hr_skip = frozenset(i for i, m in enumerate(mods) if passes_on(m))  # not read (see passes_on)
        self._root_tap = GradTap(self.hr, 0)
        self.hr_hooks = HeadroomHooks(self)  # their life, and which routine steps record the series
        self.int_watch = IntWatch(self)  # integer inputs (positions, timesteps) probed on routine steps too
        cs = self.cfg.compile_stats
        self._compile_stats = cs if cs is not None else self.cfg.every <= 10
        # fixed for the watch's lifetime; not a parameter on the meta device (a template whose weights a
        # hypernetwork or torch.func.functional_call supplies: it holds no values)
        self.params = [(n, p) for n, p in watch.model.named_parameters() if not p.is_meta]
        self.param_info = {n: (str(p.dtype).replace("torch.", ""), p.numel()) for n, p in self.params}
        self.param_by_name = dict(self.params)
        self._dtype0 = self.params[0][1].dtype if self.params else None  # (a cast of the model: _new_step)
        self.sharded = {n for n, p in self.params if is_sharded(p)}  # FSDP2: norms are per-shard until merged
        self.param_modules: dict[str, int] = {}
        for n, p in self.params:
            mod = n.rpartition(".")[0]
            self.param_modules[mod] = self.param_modules.get(mod, 0) + p.numel()
        self.low_opts: dict[int, bool] = {}    # id(optimizer) -> holds fp16/bf16 parameters (params.lr_moved)
        self.opt_params: dict[int, tuple] = {}  # id(optimizer) -> its named parameters per group (params._opt_params)
        self.rounding_seen = False             # a check found updates rounding away (params.LOW_CHECK_EVERY)
        self.gradless: list | None = None     # the parameters that never had a gradient at an update (params.py)
        self.check_until = -1                  # routine steps up to this one check their updates (params.py)
        self.lr_checked: dict[int, list] = {}  # id(optimizer) -> its learning rates at the last update check
        self.buffers = BufferWatch(watch.model)  # the buffers the training writes: finite? (buffers.py)
        self.outside_snap = None  # frozen fp16/bf16 weights as a sampled step found them (copies.outside_snapshot)
        self.masters_snap = None  # a master-weight loop's weights and masters as a forward found them (params.py)
        self.masters_left = 0     # forwards still to snapshot them, from the last sampled step on
        self.routine_weight_checks = 0  # bad routine steps whose weights were read (readback.resolve; a few only)
        self.max_input = 0  # the most input values a batch held so far (modulehooks._input_jump)
        self.scaler_adopted = False  # a scaler was just found (Watch.adopt_scaler): its next call is marked
        self.disabled = False
        self.suspended = False
        self.compiled = False  # the model runs under torch.compile: only the root's hooks (see modulehooks.py)
        self.root = watch.model
        # a model whose own forward the loop never calls (a Lightning module's training_step calling self.model, a
        # container of networks): the modules it calls instead, at top level, take the root's part (entries.py)
        self.entries: dict[int, str] = {}
        self.entry_wait: tuple | None = None  # (candidate modules, the step at which they become entries)
        self._entries_probed = False  # a routine step without the root's forward asked for a sampled one
        self._model_params = None
        self._name_of_param = None  # id(parameter) -> name (optsink._param_names)
        # optimizer -> (its parameter count, holds parameters the model gained later): see owns
        self._owns_later: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._uncovered = None  # (optimizers' parameter lists, model parameters none of them holds): _still_scaled
        self.writer = None
        if watch.run_dir is not None:
            import os
            from ..rundir import RunDirWriter
            meta = watch.meta
            path = watch.run_dir
            if meta.rank is not None and (meta.world_size or 1) > 1:
                path = os.path.join(path, f"rank-{meta.rank}")
            self.writer = RunDirWriter(path, meta)
        self.defer_plan = DeferPlan()  # which values the fused statistics may read late (fused.py)
        self.st = self._new_step(0)
        if watch.optimizer is None and watch.scaler is None:
            LOOSE.add(self)  # a frozen model's watch ends its steps with the other models' (optsink.end_step)

    @contextlib.contextmanager
    def suspend(self):
        """The watch's own hooks record nothing inside (a replay's or a capture's forward on the watched model),
        the headroom series' hooks neither (they read only `hr.on`: a replay mid-run fed the next step's series);
        the state before comes back after (suspensions nest)."""
        before, self.suspended = self.suspended, True
        hr_on, self.hr.on = self.hr.on, False
        try:
            yield
        finally:
            self.suspended = before
            self.hr.on = hr_on

    # -- step lifecycle -----------------------------------------------------------------------------
    def _new_step(self, step: int, tail: float = 0.0) -> _Step:
        """`tail`: the seconds the ended step's finalisation took (the headroom budget counts them to it)."""
        if self.params and self.params[0][1].dtype is not self._dtype0:
            # the model was cast (`.half()` after an fp16 evaluation, `.to(bfloat16)`): this step is sampled, so
            # its record has every parameter's dtype as it is now (rules/weights.py fp16_master_weights)
            self._dtype0 = self.params[0][1].dtype
            self.policy.followup = max(self.policy.followup, 1)
        sampled = self.policy.sampled(step)
        self.hr_hooks.start(sampled, tail)  # whether this step records the headroom series (headroomhooks.py)
        return _Step(step=step, sampled=sampled, plan=self.defer_plan)

    def begin(self) -> None:
        """A new iteration starts (root forward, zero_grad, scaler.scale): close the ended step."""
        if self.st.bwd_task is not None:
            # a backward with optimizer steps fused into it that never reached its end (an exception in a hook
            # aborted it): its step ends here (optsink.step_in_backward)
            self._backward_ended()
        if self.st.phase is StepPhase.ENDED and not self.iteration_goes_on():
            t = time.perf_counter()
            self.finalize()
            ended = self.st
            if not ended.micro and not ended.sampled and self.entry_wait is None and not self.entries \
                    and not self._entries_probed and self.records:
                # a step that trained without the root's forward, and no entries known (the loop called the model
                # itself before): the next step is sampled once, to find the modules it calls (entries.py)
                self._entries_probed = True
                self.policy.followup = max(self.policy.followup, 1)
            self.st = self._new_step(self.st.step + 1, time.perf_counter() - t)
            step_ended(self, ended)
            self.sync_module_hooks()

    # Hooks on the modules below the root are only present on sampled steps: a routine step runs the model
    # with the root's two hooks alone (the cheapest watch is the one that is not there).
    def sync_module_hooks(self) -> None:
        want = self.st.sampled and not self.disabled and not self.compiled
        if want and not self._mod_handles:
            names = self.w._names  # a module added after the watch began (a new head) is named too
            for n, mod in self.w.model.named_modules(remove_duplicate=False):
                names.setdefault(id(mod), n)
            pre, post = ModuleHook(self.forward_pre, "pre"), ModuleHook(self.forward_post, "post")
            for mod in self.w.model.modules():
                if mod is self.root or not hookable(mod) or id(mod) in self.entries:
                    continue
                self._mod_handles.append(pre.register(mod))
                self._mod_handles.append(post.register(mod))
        elif not want and self._mod_handles:
            self.remove_module_hooks()

    def remove_module_hooks(self) -> None:
        for h in self._mod_handles:
            h.remove()
        self._mod_handles = []

    def finish(self) -> None:
        if not self.disabled:
            self.finish_open_step()

    def close(self) -> None:
        LOOSE.discard(self)
        if self.writer is not None:
            self.writer.end()
            self.writer.close()
        for s in self.sinks:
            try:
                s.close()
            except Exception:
                pass

    def fail(self, e: BaseException) -> None:
        """An error inside ampdoctor itself: switch ampdoctor off, keep the user's training running, and leave a
        record of the step where it happened, so that the report says so on its first line."""
        if self.disabled:
            return
        self.disabled = True
        self.hr.on = False
        if self.lowcast is not None:  # (the root's forward-post hook, which takes it off, is removed next)
            self._lowcast_off()
        self.remove_module_hooks()
        self.hr_hooks.remove()
        self.int_watch.remove()
        warnings.warn(f"ampdoctor disabled itself after an internal error ({type(e).__name__}: {e}); "
                      "training continues unwatched. Please report this.", RuntimeWarning, stacklevel=3)
        try:
            from .storage import store
            st = self.st
            store(self, StepRecord(step=st.step, exception=st.exception, internal_error={
                "type": type(e).__name__, "message": str(e).split("\n")[0][:500]}))
        except Exception:
            pass

    def event(self, kind: str, skip: int = 3, **kw) -> CallEvent:
        """Record a call of `kind` at the caller's line; `skip`: the frames between caller_location and the first
        that may be the user's (5 from a patch's guarded callback: event, the callback, guarded, the patch)."""
        evs = self.st.events
        if kw.get("via_scaler") and evs and evs[-1].kind == "step":
            f, ln = evs[-1].file, evs[-1].line  # the optimizer step scaler.step() made: where that was called
        else:
            f, ln = caller_location(skip)
        ev = CallEvent(kind=kind, step=self.st.step, index=self._event_index, file=f, line=ln, **kw)
        self._event_index += 1
        self.st.events.append(ev)
        return ev

    # -- the one transfer per step (ampdoctor/record/transfer.py) -------------------------------------------
    def finalize(self) -> None:
        try:
            finalize(self)
        except Exception as e:
            self.fail(e)
