"""The module hooks' side of the step machine: what happens when a watched module's forward begins and ends (the
root's every step; the other modules' on sampled steps only, see StepMachine.sync_module_hooks) and when the
gradient of a module's output or input arrives. Each hook only queues measurements in the open step
(openstep._Step.measure) and keeps references; an error of ampdoctor's own switches the watch off
(StepMachine.fail) and never reaches the model."""
from __future__ import annotations

import functools
import math
import random
import sys

import torch

from . import modstate
from ..errors import error_line
from .gradexits import EntryHook, ExitHook, Regions, gradient_exits, in_backward, input_nodes, sequence_nr
from .hooks import GRAD_OUT_BYTES, in_compiled_frame, keep_grad
from .lowcast import LowCastMode
from .openstep import _Call
from .copies import MASTERS_STEPS, masters_compare, masters_snapshot, outside_compare, outside_snapshot
from .params import checked_weights, model_grads, norms, weight_amax
from .stats import is_measurable, ref_dtype
from ..tensors import (ac_from_str, autocast_dtype, autocast_str, copy_tensors, flatten_tensors, input_versions,
                       input_writes, loss_of, module_type, rng_state, shallow, tb_location, tb_module)

__all__ = ["ModuleHookCallbacks"]


class ModuleHookCallbacks:
    """Mixin of StepMachine: the forward pre/post hooks and the gradient hooks of the watched modules."""

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
        top = False
        if not st.stack and (module is self.root or id(module) in self.entries):  # (entries: record/entries.py)
            top = True
            if module is self.root and not self.compiled and in_compiled_frame():
                # torch.compile'd after the watch began: the other modules' hooks would be traced into the
                # graph (and recompile it whenever they change); they come off for good
                self.compiled = True
                self.remove_module_hooks()
                self.hr_hooks.remove()
                self.int_watch.remove()
            self.begin()
            st = self.st
            self.exc_at_top = st.exception  # (an exception a submodule raises and the model catches: _forward_post)
            if torch.is_grad_enabled() or self.w.optimizer is None and self.frozen():  # (a teacher's no_grad too)
                st.micro += 1
                if st.micro == 1:
                    self._input_jump(st, args, kwargs)
                else:
                    self._grads_so_far(st)
                rng = rng_state(self.rng_extra)
                if self.state_keys:  # the module state this forward reads (a counter, a memory: modstate.py)
                    rng.update(modstate.snapshot(self.state_keys))
                if st.micro == 1 and not self.compiled and modstate.due(st.step, st.sampled, self.probed_at):
                    self.probed_at = st.step
                    self.state_probe = modstate.probe(self.w.model, modstate.params_due(st.step, st.sampled))
                if self.copy_inputs:  # this model writes into its own inputs: keep them as it received them
                    st.batches.append((copy_tensors(args), copy_tensors(kwargs), rng))
                else:
                    # (the containers copied, not the tensors: a forward that pops `labels` out of the dict it gets
                    # must not empty the capture's batch)
                    st.batches.append((shallow(args), shallow(kwargs), rng))
                    if st.step < 3 or st.sampled:  # does the forward write into its inputs? (input_writes)
                        st.in_versions = input_versions((args, kwargs))
                if module is not self.root:
                    st.entry_of[id(st.batches[-1])] = self.entries[id(module)]
                if st.sampled and st.micro == 1 and self._rng_due(st.step):
                    self.rng_probe = _rng_probe()  # (does the forward draw from Python's or NumPy's RNG?)
                    self.rng_probed_at = st.step
                if st.micro == 1 and self.outside_snap is not None and st.step > self.outside_snap[0]:
                    st.outside = outside_compare(self, self.outside_snap)  # frozen fp16 weights written since?
                    self.outside_snap = None
                if st.micro == 1 and self.masters_snap is not None and st.step > self.masters_snap[0]:
                    st.masters = (self.masters_snap[0], masters_compare(self.masters_snap))  # masters copied back?
                    self.masters_snap = None
                if st.sampled and st.micro == 1 and self.params:
                    self.outside_snap = outside_snapshot(self, st.step)
                    self.masters_left = MASTERS_STEPS if (self.w.meta.optimizer or {}).get("masters") else 0
                    # the weights as the step found them: a forward that writes its own weights (an in-place
                    # renorm, an EMA codebook) is their producer, not an earlier update (readback.resolve)
                    st.pw_index = checked_weights(self)
                    st.w_start = weight_amax(self, st) if st.pw_index else None
                if st.micro == 1 and self.masters_left:  # (a hand-rolled master-weight loop: copies.py)
                    self.masters_left -= 1
                    self.masters_snap = masters_snapshot(self, st.step)
                del st.batches[:-8]  # the last few micro-batches (accumulation, or a loop that skips bad ones)
                st.autocast = autocast_str()
        elif st.sampled and not st.stack and torch.is_grad_enabled():
            st.tops.append(module)  # called at top level, not the root: an entry if the root is never called
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
        if top and st.micro == 1 and self._lowcast_due(st.step):
            self.lowcast = (LowCastMode(self), module)  # (integers made in fp16/bf16 inside the forward)
            self.lowcast[0].__enter__()
            self.lowcast_at = st.step
        if grad:
            ins = [t for t in tensors if t.requires_grad and is_measurable(t)]
            if ins:  # where the gradient towards these inputs leaves this module (see gradient_exits)
                c.grad_inputs = input_nodes(ins)  # their nodes now: an in-place forward replaces them
                c.seq0 = sequence_nr()

    def _grads_so_far(self, st) -> None:
        """A later micro-batch's forward (gradient accumulation): the abs-max of the gradients the micro-batches
        before it accumulated, a device scalar read only if the step goes bad, so that a backward-only failure is
        captured from the micro-batch whose backward made it (autocapture.bad_micro), not from the last one."""
        if self.compiled or len(st.acc_grads) >= 64:
            return
        _, grads = model_grads(self)
        if grads:
            st.acc_grads.append((st.micro, norms(grads, math.inf).amax()))

    def _input_jump(self, st, args, kwargs) -> None:
        """The batch holds INPUT_JUMP times more values than any before (a sequence-length or resolution curriculum
        jumping by orders of magnitude): this step takes the full statistics, as a sampled step does (what such a
        jump does to the gradients, e.g. makes them subnormal, shows nowhere else on an unsampled step)."""
        n = sum(t.numel() for t in args if isinstance(t, torch.Tensor))
        if kwargs:
            n += sum(v.numel() for v in kwargs.values() if isinstance(v, torch.Tensor))
        seen, self.max_input = self.max_input, max(self.max_input, n)
        if seen and n > INPUT_JUMP * seen and not st.sampled and not self.compiled and not self.hr.observing:
            st.sampled = True
            self.hr_hooks.start(True)  # (the series comes from the full statistics, as on any sampled step)
            self.sync_module_hooks()

    def forward_post(self, module, args, kwargs, output):
        if self.lowcast is not None and self.lowcast[1] is module and (self.disabled or len(self.st.stack) <= 1):
            self._lowcast_off()
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
        # the forward raised: torch runs this (always_call) hook from its exception handler, with no output. With
        # an output, an exception in sys.exc_info() is one the caller is handling (a training loop that goes on
        # inside an `except` block), not this forward's
        exc = sys.exc_info()[1] if output is None else None
        if exc is not None and (st.exception is None
                                or st.exception is not self.exc_at_top and exc is not self.exc_obj):
            # (the first module it passes through names it; one caught inside this forward gives way to it)
            st.exception = self.exception_info(exc, self.w._names.get(id(module), "?"))
            self.exc_obj = exc  # (held until the top-level forward ends: its traceback holds the frames)
        top = not st.stack and (module is self.root or id(module) in self.entries)
        if top:
            self.exc_obj = None
        if top and exc is None and st.exception is not self.exc_at_top:
            # the forward returned: what a submodule raised inside it, the model caught itself (a fused kernel's
            # fallback); it did not stop the step
            st.exception = self.exc_at_top
        if top and st.in_versions is not None:
            vers, st.in_versions = st.in_versions, None
            if input_writes(vers):
                # e.g. x.div_(255) on the caller's batch: a capture must hold the batch as the forward received it
                self.copy_inputs = True
        if top and exc is None and (torch.is_grad_enabled() or self.w.optimizer is None and self.frozen()):
            loss = loss_of(output)
            if loss is not None and self.w.scaler is None:
                st.losses.append(loss)
            # every step: is the model's output finite? (one reduction, read with the step's other values)
            outs = [t for t in flatten_tensors(output, [])[:4] if is_measurable(t) and t.numel()]
            st.out_seq = sequence_nr()  # nodes numbered from here on are the loss computation's (loss_ops)
            if outs:
                sums = [output_sum(t) for t in outs]
                st.out_ok.append((sums, len(st.batches) - 1))  # concatenated with the step's other values
                if st.batches:  # the gradient that reaches each small output, kept for a capture (see keep_grad)
                    slot = st.grad_outs.setdefault(id(st.batches[-1]), [None] * len(outs))
                    for j, t in enumerate(outs):
                        node = t.grad_fn  # (a leaf output, a module returning its own parameter: nothing to keep)
                        if node is not None and t.numel() * t.element_size() <= GRAD_OUT_BYTES:
                            node.register_prehook(EntryHook(t.output_nr, functools.partial(keep_grad, slot, j)))
        if top and self.rng_probe is not None:
            self._rng_drawn(self.rng_probe)
            self.rng_probe = None
        if top and self.state_probe is not None:
            probe, self.state_probe = self.state_probe, None
            if exc is None:
                known = {k[0] for k in self.state_keys}
                keys, was = modstate.changed(probe, self.w.model)
                new = [c for c in keys if c[0] not in known]
                self.state_keys += new
                if st.batches and any(c[0] in was for c in new):  # this batch's own, from before its forward
                    st.batches[-1][2].update(modstate.snapshot([c for c in new if c[0] in was], was))
        if top:
            st.forwards += 1
            for buf in st.fbuf.values():  # the forward's pending statistics: measured before the backward begins
                buf.forward_done()
        if module is self.root and self.hr.on and exc is None:
            self.hr.forward(0, output, self._root_tap)  # the root's headroom (the only one on a compiled model)
            self.hr.forward_done()
        elif top and self.hr.on:
            self.hr.forward_done()  # an entry's (its own value comes from its headroom hook)
        if c is None:
            return
        ins, c.grad_inputs = c.grad_inputs, None
        if exc is not None:
            return
        outs = [t for t in flatten_tensors(output, []) if is_measurable(t)]
        for t in outs:
            self._row(c, "out", t, light=False)
            # (none on a leaf, a module that returns its own Parameter: it would outlive the step)
            node = t.grad_fn
            if node is not None and c.grad_enabled and t.requires_grad:
                node.register_prehook(EntryHook(t.output_nr, self._grad_hook(c, "gout")))
        if ins:
            hook = self._grad_hook(c, "gin")
            if st.regions is None:
                st.regions = Regions()
            for node, idx in gradient_exits(outs, ins, c.seq0, st.regions):
                node.register_hook(ExitHook(idx, hook))

    def _lowcast_due(self, step: int) -> bool:
        """Whether this sampled step's forward runs under lowcast.LowCastMode: step 0, then as modstate.due probes
        (steps 1-8, then every PROBE_GAP steps), one forward a step (not an evaluation's forwards after it, nor a
        loop without optimizer steps, which stays at step 0); never on a compiled model or one with compiled parts
        (the mode would enter their graphs)."""
        return not (self.compiled or self.lowcast is not None or self.has_compiled_parts) \
            and step != self.lowcast_at and (step == 0 or modstate.due(step, True, self.lowcast_at))

    def _lowcast_off(self) -> None:
        """The root's forward ended (or ampdoctor failed inside it): the mode comes off the stack. A mode the model
        pushed inside its forward and left on top of ours is not popped: ours is switched off in place."""
        mode, _ = self.lowcast
        self.lowcast = None
        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is mode:
            mode.__exit__(None, None, None)
        else:
            mode.off = True
        if mode.error is not None:
            self.fail(mode.error)

    def _rng_due(self, step: int) -> bool:
        """Whether a sampled step's forward is probed for Python's and NumPy's RNG: not once both are known to be
        drawn; the first steps (0-8), then at most every modstate.PROBE_GAP steps (every=1 samples every step, and the
        two generators' states cost ~0.3 ms a probe to read and compare)."""
        extra = self.rng_extra
        if extra is not None and extra[0] and extra[1]:
            return False
        return step == 0 or modstate.due(step, True, self.rng_probed_at)

    def _rng_drawn(self, before) -> None:
        """A sampled step's forward drew from Python's `random` or NumPy's global RNG (LayerDrop with random.random(),
        a crop with np.random): from now on each batch keeps their state too, for a faithful replay."""
        py, np_rng = _rng_probe()
        extra = self.rng_extra or (False, False, [])
        drawn = (extra[0] or py != before[0], extra[1] or np_rng != before[1], extra[2])
        if drawn[:2] != extra[:2]:
            self.rng_extra = drawn

    def exception_info(self, exc: BaseException, default_module: str | None) -> dict:
        f, ln = tb_location(exc)
        return {"module": tb_module(exc, self.w._names, default_module), "type": type(exc).__name__,
                "message": error_line(exc), "file": f, "line": ln, "autocast": autocast_str()}

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


def _rng_probe() -> tuple:
    """What tells whether Python's `random` and NumPy's global RNG moved: their states (NumPy's position and first
    key: a draw moves one or the other)."""
    np_mod = sys.modules.get("numpy")
    if np_mod is None:
        return random.getstate(), None
    _, keys, pos, _, _ = np_mod.random.get_state()
    return random.getstate(), (int(pos), int(keys[0]))


def output_sum(t: torch.Tensor) -> torch.Tensor:
    """A 1-value tensor that is non-finite iff a value of `t` is, for the step's trip-wire (read with the step's
    other values). A sum is non-finite when any value is (inf - inf = NaN); in a wider dtype it cannot overflow,
    and unlike isfinite(t).all() it allocates nothing the size of the output (e.g. the logits).
    - a one-value fp32/fp64 output (e.g. the loss) is its own sum: no kernel;
    - fp16 sum in fp32: asked for float64, CUDA's reduction first makes a copy the size of the output (+785 MiB on
      GPT-2's logits); a finite fp16 output cannot overflow an fp32 sum;
    - bf16: its range is fp32's, so two finite values (a mask filled with `finfo(bfloat16).min`) overflow an fp32
      sum. Its min and max instead (one pass, no copy), summed in float64: finite iff every value is, -inf iff the
      only non-finite values are -inf (a mask), as the sum would be;
    - fp32 on the CPU: summed in fp32 first (a CPU's fp64 sum of fp32 values is ~10x slower: 414 vs 43 us on
      8x64x1024 logits: it converts each value), and that sum is read at once (free on the CPU). torch's CPU sum
      of fp32 accumulates in fp64 and rounds once, so it is finite iff every value is and their total is within
      fp32's range; when it is not, the fp64 sum is taken as before: the same answer as the fp64 sum alone
      (plain tensors only: reading a DTensor is a collective);
    - anything else in fp64 (on CUDA without a read: the step's values go to the host in one transfer)."""
    d = t.detach()
    dt = t.dtype
    if dt is torch.float16:
        return d.sum(dtype=torch.float32).reshape(1)
    if dt is torch.bfloat16:  # (no stack: under an fp16 autocast that a bf16 one nested in ended, it cannot
        mn, mx = torch.aminmax(d)  # promote bf16 and raises; an add of float64 values is not autocast's)
        return (mn.to(torch.float64) + mx.to(torch.float64)).reshape(1)
    if dt in _WIDE and t.numel() == 1:
        return d.reshape(1)
    if dt is torch.float32 and type(d) is torch.Tensor and d.device.type == "cpu":
        s = d.sum()
        if math.isfinite(s.item()):
            return s.reshape(1)
    return d.sum(dtype=torch.float64).reshape(1)


INPUT_JUMP = 8
"""How many times more input values than any earlier batch make a step sampled (modulehooks._input_jump)."""
_WIDE = (torch.float32, torch.float64)
