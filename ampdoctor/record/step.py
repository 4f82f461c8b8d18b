"""The open step: what the hooks append during one optimizer step, and how it becomes a StepRecord.

`StepMachine` receives every hook and monitor callback of one Watch. During a step it only appends device
tensors (statistic vectors, the loss, the scale) and host-side call events to the open step (openstep._Step,
whose phase says where it is: OPEN, STAGED, ENDED, FINAL). Just before the optimizer step (`presync`)
everything crosses to the host in one transfer; the record is finished when the next iteration begins
(`finalize`), so that `scaler.update()` and late calls land in the step they belong to.
"""
from __future__ import annotations

import functools
import math
import sys
import time
import warnings

import torch

from .autocapture import CapturePolicy
from .buffers import BufferWatch
from .gradexits import ExitHook, Regions, gradient_exits, in_backward, input_nodes, sequence_nr
from .hooks import ModuleHook, hookable, in_compiled_frame
from .monitor import caller_location
from .monitorsink import MonitorCallbacks
from ..records import CallEvent, StepRecord
from .openstep import StepPhase, _Call, _Step
from .headroom import Headroom
from .headroomhooks import HeadroomHooks
from .hooks import GRAD_OUT_BYTES, GradTap, keep_grad, passes_on
from .hostcopy import HostSlots
from .transfer import finalize
from .params import checked_weights, model_grads, norms, outside_compare, outside_snapshot, weight_amax
from .stats import is_measurable, ref_dtype
from ..tensors import (ac_from_str, autocast_dtype, autocast_str, copy_tensors, flatten_tensors, input_versions,
                       input_writes, is_sharded, loss_of, module_type, rng_state, tb_location, tb_module)

__all__ = ["StepMachine", "flatten_tensors"]


class StepMachine(MonitorCallbacks):
    """Hook and monitor callbacks of one Watch; see the module docstring."""

    def __init__(self, watch, sinks):
        self.w = watch
        self.cfg = watch.config
        self.sinks = sinks
        self.records: list[StepRecord] = []
        self.known_optimizers: set[int] = set()
        self.opt_numbers: dict[int, int] = {}  # id(optimizer) -> 0, 1, ... in order of first scaler call
        self._rejected_optimizers: set[int] = set()
        self._event_index = 0
        self.policy = CapturePolicy(self.cfg)  # which steps are sampled, which bad steps captured
        self._mod_handles: list = []
        self.host_slots = HostSlots()  # the pinned buffers the step's values come back through (hostcopy.py)
        self.copy_inputs = False  # the model writes into its inputs: batches are kept as copies (input_writes)
        # always-on headroom (ampdoctor/record/headroom.py): one slot per module, in RunMeta.modules order
        mods = [m for _, m in watch.model.named_modules()]
        self.slot_of = {id(m): i for i, m in enumerate(mods)}
        self.slot_of_name = {n: i for i, (n, _) in enumerate(watch.model.named_modules())}
        self.hr = Headroom(len(mods))
        self.hr_skip = frozenset(i for i, m in enumerate(mods) if passes_on(m))  # not read (see passes_on)
        self._root_tap = GradTap(self.hr, 0)
        self.hr_hooks = HeadroomHooks(self)  # their life, and which routine steps record the series
        cs = self.cfg.compile_stats
        self._compile_stats = cs if cs is not None else self.cfg.every <= 10
        self.params = [(n, p) for n, p in watch.model.named_parameters()]  # fixed for the watch's lifetime
        self.param_info = {n: (str(p.dtype).replace("torch.", ""), p.numel()) for n, p in self.params}
        self.param_by_name = dict(self.params)
        self._dtype0 = self.params[0][1].dtype if self.params else None  # (a cast of the model: _new_step)
        self.sharded = {n for n, p in self.params if is_sharded(p)}  # FSDP2: norms are per-shard until merged
        self.param_modules: dict[str, int] = {}
        for n, p in self.params:
            mod = n.rpartition(".")[0]
            self.param_modules[mod] = self.param_modules.get(mod, 0) + p.numel()
        self.low_opts: dict[int, bool] = {}    # id(optimizer) -> holds fp16/bf16 parameters (params.lr_moved)
        self.lr_checked: dict[int, list] = {}  # id(optimizer) -> its learning rates at the last update check
        self.buffers = BufferWatch(watch.model)  # the buffers the training writes: finite? (buffers.py)
        self.outside_snap = None  # frozen fp16/bf16 weights as a sampled step found them (params.outside_snapshot)
        self.routine_weight_checks = 0  # bad routine steps whose weights were read (transfer.resolve; a few only)
        self.disabled = False
        self.suspended = False
        self.compiled = False  # the model runs under torch.compile: only the root's hooks (see modulehooks.py)
        self.root = watch.model
        self._model_params = None
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
        self.st = self._new_step(0)

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
        return _Step(step=step, sampled=sampled)

    def begin(self) -> None:
        """A new iteration starts (root forward, zero_grad, scaler.scale): close the ended step."""
        if self.st.phase is StepPhase.ENDED:
            t = time.perf_counter()
            self.finalize()
            self.st = self._new_step(self.st.step + 1, time.perf_counter() - t)
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
                if mod is self.root or not hookable(mod):
                    continue
                self._mod_handles.append(pre.register(mod))
                self._mod_handles.append(post.register(mod))
        elif not want and self._mod_handles:
            self.remove_module_hooks()

    def remove_module_hooks(self) -> None:
        for h in self._mod_handles:
            h.remove()
        self._mod_handles = []

    def finish_open_step(self, mid_run: bool = False) -> None:
        """`mid_run`: a report taken while training goes on (Watch.report before close)."""
        st = self.st
        # a zero_grad alone (nanoGPT's after scaler.update()) opens no step
        trained = st.phase is StepPhase.ENDED or any(e.kind != "zero_grad" for e in st.events) or st.losses \
            or st.micro or st.exception
        if trained or (st.calls and not self.records):  # an eval-only tail after training is not a step
            if (st.phase is StepPhase.OPEN and st.exception is None and (mid_run or self.records)
                    and not any(e.error for e in st.events) and self._clean_open()):
                # an iteration not (yet) at its optimizer step, with nothing non-finite in it and no call that
                # raised (a scaler error the loop caught): a report taken inside it leaves it to the iteration; at
                # the end it is no step (a loop that stopped after the backward)
                return
            self.finalize()
            self.st = self._new_step(st.step + 1)
            if not self.w.closed:
                self.sync_module_hooks()

    def _clean_open(self) -> bool:
        """The open step's losses, outputs and gradients so far are all finite (read now: a report or a close)."""
        st = self.st
        vals = [t for t in st.losses] + [t for sums, _ in st.out_ok for t in sums]
        if any(not bool(torch.isfinite(t).all()) for t in vals):
            return False
        _, grads = model_grads(self)
        return not grads or bool(torch.isfinite(norms(grads, math.inf)).all())

    def finish(self) -> None:
        if not self.disabled:
            self.finish_open_step()

    def close(self) -> None:
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
        self.remove_module_hooks()
        self.hr_hooks.remove()
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
        that may be the user's (5 from a patch's guarded callback: event, the callback, _guarded, the patch)."""
        evs = self.st.events
        if kw.get("via_scaler") and evs and evs[-1].kind == "step":
            f, ln = evs[-1].file, evs[-1].line  # the optimizer step scaler.step() made: where that was called
        else:
            f, ln = caller_location(skip)
        ev = CallEvent(kind=kind, step=self.st.step, index=self._event_index, file=f, line=ln, **kw)
        self._event_index += 1
        self.st.events.append(ev)
        return ev

    # -- module hooks --------------------------------------------------------------------------------
    def forward_pre(self, module, args, kwargs):
        # under torch.compile the hook compiles away (nothing of ampdoctor's enters the graph); inside a backward
        # it is activation checkpointing re-running the forward: not a forward of the step
        if self.disabled or self.suspended or torch.compiler.is_compiling() or in_backward():
            return None
        try:
            self._forward_pre(module, args, kwargs)
        except Exception as e:  # never break the user's model
            self.fail(e)
        return None  # the arguments are never replaced: the module sees the caller's own objects

    def _forward_pre(self, module, args, kwargs):
        st = self.st
        if module is self.root and not st.stack:
            if not self.compiled and in_compiled_frame():
                # torch.compile'd after the watch began: the other modules' hooks would be traced into the
                # graph (and recompile it whenever they change); they come off for good
                self.compiled = True
                self.remove_module_hooks()
                self.hr_hooks.remove()
            self.begin()
            st = self.st
            if torch.is_grad_enabled():
                st.micro += 1
                if self.copy_inputs:  # this model writes into its own inputs: keep them as it received them
                    st.batches.append((copy_tensors(args), copy_tensors(kwargs), rng_state()))
                else:
                    st.batches.append((args, kwargs, rng_state()))
                    if st.step < 3 or st.sampled:  # does the forward write into its inputs? (input_writes)
                        st.in_versions = input_versions((args, kwargs))
                if st.micro == 1 and self.outside_snap is not None and st.step > self.outside_snap[0]:
                    st.outside = outside_compare(self, self.outside_snap)  # frozen fp16 weights written since?
                    self.outside_snap = None
                if st.sampled and st.micro == 1 and self.params:
                    self.outside_snap = outside_snapshot(self, st.step)
                    # the weights as the step found them: a forward that writes its own weights (an in-place
                    # renorm, an EMA codebook) is their producer, not an earlier update (transfer.resolve)
                    st.pw_index = checked_weights(self)
                    st.w_start = weight_amax(self, st) if st.pw_index else None
                del st.batches[:-8]  # the last few micro-batches (accumulation, or a loop that skips bad ones)
                st.autocast = autocast_str()
        if not st.sampled or len(st.calls) >= self.cfg.max_module_calls:
            st.stack.append(None)
            return
        name = self.w._names.get(id(module), "?")
        n = st.counts.get(name, 0)
        st.counts[name] = n + 1
        parent = next((c.seq for c in reversed(st.stack) if c is not None), None)
        grad = torch.is_grad_enabled()
        c = _Call(module=name, type=module_type(type(module)), call=n, seq=len(st.calls), depth=len(st.stack),
                  parent=parent, autocast=autocast_str(), grad_enabled=grad)
        st.calls.append(c)
        st.stack.append(c)
        tensors = flatten_tensors(args, flatten_tensors(kwargs, [])) if kwargs else flatten_tensors(args, [])
        for t in tensors:
            if is_measurable(t):
                self._row(c, "inp", t, light=True)
                st.probe_integers(c, t)
        if grad:
            ins = [t for t in tensors if t.requires_grad and is_measurable(t)]
            if ins:  # where the gradient towards these inputs leaves this module (see gradient_exits)
                c.grad_inputs = input_nodes(ins)  # their nodes now: an in-place forward replaces them
                c.seq0 = sequence_nr()

    def forward_post(self, module, args, kwargs, output):
        if self.disabled or self.suspended or torch.compiler.is_compiling() or in_backward():
            return None
        try:
            self._forward_post(module, output)
        except Exception as e:
            self.fail(e)
        return None

    def _forward_post(self, module, output):
        st = self.st
        c = st.stack.pop() if st.stack else None
        exc = sys.exc_info()[1]
        if exc is not None and st.exception is None:
            st.exception = self.exception_info(exc, self.w._names.get(id(module), "?"))
        if module is self.root and not st.stack and st.in_versions is not None:
            vers, st.in_versions = st.in_versions, None
            if input_writes(vers):
                # e.g. x.div_(255) on the caller's batch: a capture must hold the batch as the forward received it
                self.copy_inputs = True
        if module is self.root and not st.stack and exc is None and torch.is_grad_enabled():
            loss = loss_of(output)
            if loss is not None and self.w.scaler is None:
                st.losses.append(loss)
            # every step: is the model's output finite? (one reduction, read with the step's other values)
            outs = [t for t in flatten_tensors(output, [])[:4] if is_measurable(t) and t.numel()]
            st.out_seq = sequence_nr()  # nodes numbered from here on are the loss computation's (loss_ops)
            if outs:
                # a sum is non-finite when any value is (inf - inf = NaN); in a wider dtype it cannot overflow,
                # and unlike isfinite(t).all() it allocates nothing the size of the output (e.g. the logits)
                # (fp16/bf16 sum in fp32: asked for float64, CUDA's bf16 reduction first makes a copy the size of
                # the output, +785 MiB on GPT-2's logits; a finite bf16 output whose fp32 sum overflows needs values
                # near 1e34, already broken)
                # (a one-value fp32/fp64 output, e.g. the loss, is its own sum: no kernel)
                sums = [t.detach().reshape(1) if t.numel() == 1 and t.dtype in _WIDE else
                        t.detach().sum(dtype=torch.float32 if t.dtype in _HALF else torch.float64).reshape(1)
                        for t in outs]
                st.out_ok.append((sums, len(st.batches) - 1))  # concatenated with the step's other values
                if st.batches:  # the gradient that reaches each small output, kept for a capture (see keep_grad)
                    slot = st.grad_outs.setdefault(id(st.batches[-1]), [None] * len(outs))
                    for j, t in enumerate(outs):
                        if t.requires_grad and t.numel() * t.element_size() <= GRAD_OUT_BYTES:
                            t.register_hook(functools.partial(keep_grad, slot, j))
        if module is self.root and self.hr.on and exc is None:
            self.hr.forward(0, output, self._root_tap)  # the root's headroom (the only one on a compiled model)
            self.hr.forward_done()
        if c is None:
            return
        ins, c.grad_inputs = c.grad_inputs, None
        if exc is not None:
            return
        outs = [t for t in flatten_tensors(output, []) if is_measurable(t)]
        for t in outs:
            self._row(c, "out", t, light=False)
            # a tensor hook on a leaf (a module that returns its own Parameter) would outlive the step
            if t.requires_grad and c.grad_enabled and t.grad_fn is not None:
                t.register_hook(self._grad_hook(c, "gout"))
        if ins:
            hook = self._grad_hook(c, "gin")
            if st.regions is None:
                st.regions = Regions()
            for node, idx in gradient_exits(outs, ins, c.seq0, st.regions):
                node.register_hook(ExitHook(idx, hook))

    def exception_info(self, exc: BaseException, default_module: str | None) -> dict:
        f, ln = tb_location(exc)
        return {"module": tb_module(exc, self.w._names, default_module), "type": type(exc).__name__,
                "message": str(exc).split("\n")[0][:500], "file": f, "line": ln, "autocast": autocast_str()}

    def _row(self, c: _Call, slot: str, t: torch.Tensor, light: bool, ref=None) -> None:
        """Queue tensor `t`'s statistics in the open step (openstep._Step.measure)."""
        self.st.measure(c, slot, t, light, ref, self._compile_stats)

    def _grad_hook(self, c: _Call, slot: str):
        st = self.st

        def hook(g):
            if self.disabled or self.st is not st or g is None or not is_measurable(g):
                return None
            try:
                if c.bseq is None:
                    c.bseq = st.bseq
                    st.bseq += 1
                ref = ref_dtype(g.dtype, autocast_dtype(g.device.type) or ac_from_str(c.autocast))
                self._row(c, slot, g, light=False, ref=ref)
            except Exception as e:
                self.fail(e)
            return None
        return hook

    # -- the one transfer per step (ampdoctor/record/transfer.py) -------------------------------------------
    def finalize(self) -> None:
        try:
            finalize(self)
        except Exception as e:
            self.fail(e)


_HALF = (torch.float16, torch.bfloat16)
_WIDE = (torch.float32, torch.float64)
