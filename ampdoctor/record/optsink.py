"""The optimizer's side of the step machine: its step() (torch's global optimizer step hooks, which
ampdoctor/watch.py registers), its zero_grad (monitor.OptimizerPatch), and which optimizers step this model
(`owns`). An optimizer step outside scaler.step() moves the open step to StepPhase.ENDED; one inside it is
scaler.step()'s (record/monitorsink.py). An error of ampdoctor's own in any of these switches the watch off
(StepMachine.fail) and never reaches the training loop."""
from __future__ import annotations

import math

import torch

from .gradexits import in_backward
from .monitor import guarded, others_stepped, scaler_stage
from .openstep import StepPhase
from .params import norms, update_check_post, update_check_pre
from .readback import resolve_early
from .transfer import presync

__all__ = ["OptimizerCallbacks"]


def _grad_versions(opt) -> list:
    """Which gradient tensors the optimizer's parameters hold, and their version counters (an in-place
    accumulation bumps it)."""
    return [None if p.grad is None else (id(p.grad), p.grad._version)
            for g in opt.param_groups for p in g["params"]]


def _unscaled_through_another(opt, unscaled: list) -> bool:
    """`scaler.step(opt)` is about to unscale `opt` itself (no unscale_ of this object this iteration), while another
    optimizer object holding the same parameters was unscaled already (a wrapper such as Lookahead and its inner
    optimizer): those gradients get divided by the scale twice."""
    if any(o is opt for o in unscaled):
        return False
    return any(_shares_params(o, opt) for o in unscaled)


def _shares_params(a, b) -> bool:
    """Optimizer-like objects `a` and `b` hold a parameter in common."""
    try:
        mine = {id(p) for g in b.param_groups for p in g["params"]}
        return any(id(p) in mine for g in a.param_groups for p in g["params"])
    except (AttributeError, KeyError, TypeError):
        return False


def _forward_went_bad(st) -> bool:
    """The open step's losses, or its outputs, hold NaN or +inf so far (-inf alone in an output is a mask). One
    read on the host: the one that a step without a GradScaler makes at its first optimizer step anyway."""
    losses = [t.reshape(-1).float() for t in st.losses]
    outs = [t.reshape(-1).float() for sums, _ in st.out_ok for t in sums]
    if not losses and not outs:
        return False
    try:
        flags = []
        if losses:
            flags.append(~torch.isfinite(torch.cat(losses)).all())
        if outs:
            v = torch.cat(outs)
            flags.append((torch.isnan(v) | (v == math.inf)).any())
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).any())
    except RuntimeError:  # (losses on several devices)
        return False


def _unstepped_since_scale(events) -> bool:
    """No unscale_, step or optimizer step since the iteration's last scale() (the scaled gradients are unread)."""
    for e in reversed(events):
        if e.kind == "scale":
            return True
        if e.kind in ("unscale_", "step", "optimizer.step", "update"):
            return False
    return False


class OptimizerCallbacks:
    """Mixin of StepMachine: the optimizer's step() and zero_grad calls, and whether an optimizer is this model's."""

    @guarded
    def zero_grad(self, optimizer) -> None:
        if self.disabled:
            return
        if self.discards_iteration(optimizer):
            self.st.discarded += 1
            self.threw_away = True
        if not self._awaits_update() and not in_backward():  # (inside a backward: an optimizer step fused into
            self.begin()                                      # it zeroes its parameter's gradient, step_in_backward)
        ev = self.event("zero_grad", 5)
        ev.opt = self.opt_numbers.setdefault(id(optimizer), len(self.opt_numbers))
        self.stepped_grads.pop(id(optimizer), None)
        if self.st.scaled_since_update:  # after a scaled loss: are the gradients written again before the step?
            self.zero_pending = ev

    @guarded
    def zero_grad_done(self, optimizer) -> None:
        """The zero_grad that came after a scaled loss has returned: which gradients the optimizer holds now, to
        tell at its unscale_/step whether the loop wrote them again in between (monitorsink.before: a meta-learning
        loop assigning `.grad` from autograd.grad) or the step's gradients were discarded (rules/callorder.py)."""
        ev, self.zero_pending = self.zero_pending, None
        self.st.zeroed.append((ev, optimizer, _grad_versions(optimizer)))

    def discards_iteration(self, optimizer) -> bool:
        """This zero_grad throws an iteration away: the step is open after a forward and no optimizer step came, and
        the gradients it clears hold inf/NaN (read now: only a loop that skips its own step gets here). A loop that
        keeps its own loss scale (fairseq's DynamicLossScaler, Megatron's, apex's FP16_Optimizer; no GradScaler)
        skips the optimizer step on an overflow and zeroes the gradients: the iterations it threw away join the step
        that comes (rules/backoff.loop_opening_search), whose record counts them (`StepRecord.discarded`; steps stay
        numbered by optimizer step, as CONTRACT.md's `step` is, and as fairseq's own `num_updates` counts: rules/
        ownscale.py). With a GradScaler, only a zero_grad after a scaled loss and before any unscale_/step of this
        iteration (a guard that skips bad batches behind the scaler's back: update() never runs, the scale never
        backs off). Finite gradients cleared between backwards (an adversarial step, PCGrad) are no skip."""
        st = self.st
        if st.phase is not StepPhase.OPEN or not st.micro or in_backward():
            return False
        if self.w.scaler is not None:
            if not (st.scaled_since_update and _unstepped_since_scale(st.events)) or st.discard_micro == st.micro:
                return False  # (one per forward: PCGrad zeroes the gradients between the tasks of one iteration)
            st.discard_micro = st.micro
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if isinstance(p.grad, torch.Tensor) and p.grad.is_floating_point()]
        return bool(grads) and not bool(torch.isfinite(norms(grads, math.inf)).all())

    def _awaits_update(self) -> bool:
        """The step ended with `scaler.step()` and its `update()` is still to come (`step; zero_grad; update`, or an
        update deferred to the top of the next iteration): a zero_grad now leaves the step open for it."""
        if self.st.phase is not StepPhase.ENDED or self.w.scaler is None:
            return False
        for e in reversed(self.st.events):
            if e.kind == "update":
                return False
            if e.kind == "step":
                return True
        return False

    def global_opt_pre(self, opt, args, kwargs):
        if self.disabled:
            return None
        try:
            nest = self.st.opt_nest
            if id(opt) in nest:
                # a step() inside this optimizer's own step(): a subclass calling super().step() (torch hooks each
                # class's step once an instance of it exists: detectron2's clipping SGD subclass): one step
                nest[id(opt)] += 1
                return None
            nest[id(opt)] = 1
            if id(opt) not in self.known_optimizers:
                if id(opt) in self._rejected_optimizers or not self.owns(opt):
                    self._rejected_optimizers.add(id(opt))
                    self._foreign_step()
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
            self.fail(e)
        return None

    def _opt_pre(self, opt) -> None:
        if self.disabled:
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
            if scaled and not via and st.unscaled_opts and _unscaled_through_another(
                    opt, st.unscaled_opts):
                # the scaler never saw this optimizer, but unscaled its parameters' gradients through another object
                # holding them (fastai's MixedPrecision hands itself to scaler.step as a stand-in optimizer whose
                # step() only notes "not skipped"; the real optimizer steps after it)
                scaled = False
            ev = self.event("optimizer.step", stage=stage, scaled=scaled and not via, via_scaler=via, fused=bool(fused))
            ev.opt = self.opt_numbers.setdefault(id(opt), len(self.opt_numbers))
            if not via and in_backward() and self.step_in_backward(st, opt):
                update_check_pre(self, opt)
                return
            presync(self, opt, grads_scaled=scaled)
            resolve_early(self)
            if via and not fused:
                # GradScaler found every gradient finite (it steps the optimizer): the loss they came from was
                # finite, and loss_ops (read only when it was not) will not need its graph. The reference goes now,
                # so that the graph dies when the loop drops its own (as without the watch: while the device runs
                # the optimizer's kernels), not at the next iteration's start, where the device waits for the host
                st.loss_node = None
            update_check_pre(self, opt)
            if not via:
                self.end_step()
        except Exception as e:
            self.fail(e)

    def end_step(self) -> None:
        """The open step reached its end: the optimizer stepped, or the scaler skipped it (the caller has queued
        the step's values: presync). A frozen model's watch ends its own step with it (`_foreign_step`)."""
        self.st.advance(StepPhase.ENDED)
        self.hr_hooks.ended()
        others_stepped(self)

    def _foreign_step(self) -> None:
        """Another model's step ended (an optimizer step no watch sees, or another watch's step, skipped ones
        included). A watch on a frozen model (a distillation teacher, a perceptual-loss network: no optimizer or
        scaler given, no parameter that trains) has no step of its own: the training loop's iteration ends here,
        after the model's forwards in it, so that its steps count the loop's iterations."""
        st = self.st
        if st.phase is not StepPhase.OPEN or not st.forwards or in_backward() or not self.frozen():
            return
        try:
            presync(self, None)
            st.advance(StepPhase.ENDED)
            self.hr_hooks.ended()
        except Exception as e:
            self.fail(e)

    def frozen(self) -> bool:
        """The watch is on a model that does not train: no optimizer or scaler given or found, no parameter that
        requires grad. Its forwards (under no_grad too: a teacher's) are the steps' forwards."""
        return self.w.optimizer is None and self.w.scaler is None and not self.known_optimizers \
            and not any(p.requires_grad for _, p in self.params)

    def step_in_backward(self, st, opt) -> bool:
        """An optimizer step fused into the backward (PyTorch's "optimizer step in backward" recipe, torchtune's
        optimizer_in_bwd: one optimizer per parameter, stepped and zeroed in a post-accumulate-grad hook): the
        backward's steps are one step, which ends when the backward does (autograd's final callback). Each
        optimizer's gradients are read now, before its step and its zero_grad (presync takes them). False when
        no final callback can be queued (the step then ends here, as any optimizer step does)."""
        task = torch._C._current_graph_task_id()
        if task != st.bwd_task:  # (the first fused step of this backward)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            except RuntimeError:
                return False
            first = st.bwd_task is None
            st.bwd_task = task
            if first and st.batches and _forward_went_bad(st):
                # the updates to come change the weights this step's forwards ran with: a capture (and the check of
                # which weights were already non-finite, readback.resolve) takes them as they are now, as it takes
                # those of a forward that writes its own weights (record/modstate.py)
                found = {f"param:{n}": p.detach().clone() for n, p in self.params}
                for b in st.batches:
                    b[2].update(found)
        name_of = self._param_names()
        pairs = [(name_of[id(p)], g) for grp in opt.param_groups for p in grp["params"]
                 if id(p) in name_of and (g := p.grad) is not None and g.layout == torch.strided
                 and g.is_floating_point() and g.numel()]
        if pairs:
            gs = [g for _, g in pairs]
            st.bwd_grads.append(([n for n, _ in pairs], norms(gs, math.inf), norms(gs, 2) if st.sampled else None))
        return True

    def _backward_ended(self) -> None:
        """The backward whose optimizer steps step_in_backward saw has ended: the step ends."""
        st = self.st
        st.bwd_task = None
        if self.disabled or st.phase is not StepPhase.OPEN:
            return
        try:
            presync(self, None)
            self.end_step()
        except Exception as e:
            self.fail(e)

    def _param_names(self) -> dict:
        """id(parameter) -> its name, for the parameters the watch began with (fixed for the watch's life)."""
        if self._name_of_param is None:
            self._name_of_param = {id(p): n for n, p in self.params}
        return self._name_of_param

    def global_opt_post(self, opt, args, kwargs):
        if self.disabled:
            return
        nest = self.st.opt_nest
        n = nest.pop(id(opt), 0)
        if n > 1:  # the inner step() of a subclass's (see global_opt_pre)
            nest[id(opt)] = n - 1
            return
        if id(opt) not in self.known_optimizers:
            return
        try:
            update_check_post(self, opt)
        except Exception as e:
            self.fail(e)

    def owns(self, opt) -> bool:
        mine = self._model_param_ids()
        if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            return True
        if self.w.meta.optimizer.get("masters") and opt is not self.w.optimizer and _shares_params(
                opt, self.w.optimizer):
            return True  # it steps the given optimizer's master copies (a wrapper's inner optimizer: fairseq's)
        # parameters the model gained after the watch began (LoRA adapters put in, a grown head) with an optimizer
        # built for them alone; the answer is kept per optimizer and parameter count (a GAN's other optimizer is
        # asked at every update())
        n = sum(len(g["params"]) for g in opt.param_groups)
        try:
            known = self._owns_later.get(opt)
        except TypeError:  # an optimizer object that takes no weak reference: asked afresh each time
            known = None
        if known is None or known[0] != n:
            now = {id(p) for p in self.w.model.parameters()}
            known = (n, any(id(p) in now for g in opt.param_groups for p in g["params"]))
            try:
                self._owns_later[opt] = known
            except TypeError:
                pass
        return known[1]

    def _model_param_ids(self) -> set:
        if self._model_params is None:
            self._model_params = {id(p) for _, p in self.params}  # the parameter list cached at watch start
        return self._model_params
