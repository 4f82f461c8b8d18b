"""The scaler's side of the step machine: what happens when the user's code calls the GradScaler's scale, unscale_,
step and update (ampdoctor/record/monitor.py installs the patches that call these methods; the optimizer's own
step() and zero_grad are record/optsink.py's, a clipping function's calls record/clipsink.py's).
A scaler.step() that stepped or skipped moves the open step to StepPhase.ENDED; an error of ampdoctor's own in any
of these switches the watch off (StepMachine.fail) and never reaches the training loop."""
from __future__ import annotations

import functools

import torch

from .openstep import StepPhase
from .params import grads_after_unscale
from .monitor import guarded, scaler_stage
from .optsink import _grad_versions, _unscaled_through_another
from .readback import resolve_early
from .transfer import found_inf_all, presync, presync_more, skipped_grads, stage_rows

__all__ = ["MonitorCallbacks"]


def _ran(flag: list, grads):
    """A backward reached the scaled loss: [ran, with create_graph (autograd's grad mode is on inside a backward that
    builds a graph of the gradients: a gradient penalty's)]."""
    flag[0] = True
    if torch.is_grad_enabled():
        flag[1] = True


def _first_grad(opt) -> tuple | None:
    """(parameter, its gradient's id, version) of the optimizer's first parameter holding a gradient: taken as a
    scaler.step ends, to see whether the next iteration's backward adds onto those (already unscaled) gradients."""
    for g in opt.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                return p, id(p.grad), p.grad._version
    return None


def _stale(mark, backwards: int) -> bool:
    """Whether the gradient `mark` names is still the same tensor and moved by exactly `backwards` in-place
    accumulations since: nothing zeroed it (zero_grad(set_to_none=False) would have moved it once more)."""
    p, gid, ver = mark
    g = p.grad
    return g is not None and id(g) == gid and backwards > 0 and g._version - ver == backwards


def _reaches(node, target, limit: int = 16) -> bool:
    """Whether autograd node `target` is `node` or among the first `limit` nodes of the graph behind it (breadth
    first): the loss a scale() gets was made from an already-scaled one. Only the nodes next to the loss are walked
    (a second micro-batch's separate graph never reaches the first's scaled node)."""
    todo, seen = [node], 0
    while todo and seen < limit:
        n = todo.pop(0)
        if n is target:
            return True
        seen += 1
        todo.extend(f for f, _ in getattr(n, "next_functions", ()) if f is not None)
    return False


def _found_inf(scaler, opts: list):
    """The inf checks `scaler.unscale_` recorded for these optimizers this iteration, summed (a 0-d float64 tensor),
    or None when there are none."""
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    fi = [v.detach().double().reshape(()) for o in opts
          for v in (states.get(id(o)) or {}).get("found_inf_per_device", {}).values()]
    return (fi[0] if len(fi) == 1 else torch.stack(fi).sum()) if fi else None


def _refilled(st, opt) -> None:
    """Mark the zero_grads of `opt` after a scaled loss (optsink.zero_grad_done) whose gradients were written again
    before this unscale_/step: the step's gradients were not discarded."""
    keep = []
    for ev, o, vers in st.zeroed:
        if o is not opt:
            keep.append((ev, o, vers))
        elif _grad_versions(o) != vers:
            ev.extra["refilled"] = True
    st.zeroed = keep


class MonitorCallbacks:
    """Mixin of StepMachine: records each scaler call as a CallEvent and marks step boundaries (with
    OptimizerCallbacks, whose `owns` it asks)."""

    @guarded
    def before(self, kind, args, kwargs):
        if self.disabled:
            return None
        if kind == "scale":
            self.begin()
        st = self.st
        opt = None
        if kind in ("unscale_", "step"):
            opt = args[0] if args else kwargs.get("optimizer")
            if st.micro_stepped is None:
                st.micro_stepped = st.micro
        stage = scaler_stage(self.w.scaler, opt) if opt is not None else None
        ev = self.event(kind, 5, stage=stage)
        if opt is not None:  # several optimizers may share one scaler (one step each, one update)
            ev.opt = self.opt_numbers.setdefault(id(opt), len(self.opt_numbers))
            if self.scaler_adopted:  # the first call of a scaler found now: its scale() ran unseen
                ev.extra["adopted"] = True
                self.scaler_adopted = False
                if stage in (None, "READY") and getattr(self.w.scaler, "_enabled", True):
                    # nothing unscaled this optimizer yet: a clip earlier in this iteration, recorded before the
                    # scaler was known, read the scaled gradients (rules/scaler.py: clipping before unscale_)
                    for e in st.events:
                        if e.reads_norm() and e.scaled is False:
                            e.scaled = True
            mark = self.stepped_grads.pop(id(opt), None) if self.stepped_grads else None
            if mark is not None and st.in_scaler_step == 0 and _stale(
                    mark, sum(1 for e in st.events if e.kind == "scale")):
                # no zero_grad since the last scaler.step: this iteration's scaled backward added onto the gradients
                # that step had already unscaled, and they are about to be divided again (rules/callorder.py)
                ev.extra["stale_grads"] = True
            if st.zeroed:
                _refilled(st, opt)
            if kind == "unscale_":
                st.unscaled_opts.append(opt)
        # e.g. the unscale_ that scaler.step() does itself; it never calls update(): an update inside it is the
        # user's, from an optimizer step hook (rules/callorder.py)
        ev.internal = st.in_scaler_step > 0 and kind != "update"
        if kind == "update" and st.in_scaler_step > 0:
            ev.extra["in_step"] = True
        if kind == "scale":
            if st.scaled_outs and not st.scale_reads and any(r[1] for _, r, _, _ in st.scaled_outs):
                # the gradients of a scaled loss were taken with create_graph (torch.autograd.grad: a gradient
                # penalty) and the loop has not read the scale in this iteration to divide them (GradNorm's loop
                # reads it before): a loss made from them is about to be scaled again (rules/scaler.py)
                ev.extra["penalty_scaled"] = True
            out = args[0] if args else kwargs.get("outputs")
            if isinstance(out, torch.Tensor) and out.grad_fn is not None and st.scaled_node is not None and \
                    _reaches(out.grad_fn, st.scaled_node):
                # scaler.scale(scaler.scale(loss)), or of a value made from it (a helper's `loss / accum`):
                # rules/callorder.py
                ev.extra["scaled_twice"] = True
            if isinstance(out, torch.Tensor) and out.numel() == 1:
                st.losses.append(out.detach().reshape(()))
                st.loss_node = out.grad_fn  # a reference only: read on a step whose loss went non-finite
                if out.grad_fn is not None and st.out_seq is not None:  # made inside the model's forward?
                    st.loss_in_model = out.grad_fn._sequence_nr() < st.out_seq
            st.scaled_since_update = True
            if st.unscaled_opts and st.unscaled_grads is None:
                # a scaled loss after this iteration's unscale_: did its backward write into those gradients?
                # (a GAN backpropagates the generator's loss into its own parameters only; an accumulation
                # boundary off by one writes scaled gradients into the ones unscale_ already divided)
                st.unscaled_grads = {id(o): _grad_versions(o) for o in st.unscaled_opts}
        elif kind == "update":
            st.scaled_since_update = False
            if st.phase is StepPhase.OPEN and st.scale_t is not None and st.scale_t is getattr(
                    self.w.scaler, "_scale", None):
                st.scale_t = st.scale_t.clone()  # update() before the step's values were staged: keep the old
            new = args[0] if args else kwargs.get("new_scale")
            ev.has_steps = any(e.kind == "step" for e in st.events)
            if st.phase is StepPhase.OPEN and st.found_inf_t is None and st.unscaled_opts:
                # no step came (the loop skipped it, e.g. on a non-finite gradient norm): whether the scaler backs
                # off is what unscale_ found, read before update() clears it
                st.found_inf_t = _found_inf(self.w.scaler, [o for o in st.unscaled_opts if self.owns(o)])
            found_inf_all(self)
            if new is not None and not isinstance(new, torch.Tensor):
                ev.new_scale = float(new)
        elif kind == "step":
            if len(args) > 1 and callable(args[1]):
                # scaler.step(opt, closure): GradScaler hands positional arguments on to optimizer.step, which runs
                # the closure's forward and scaled backward after unscale_ (rules/scaler.py call_order)
                ev.extra["closure"] = True
            if st.in_scaler_step == 0:
                self.hr.stage()  # queue the headroom reductions before the scaler's synchronisation
                stage_rows(self)  # (and gather the sampled step's statistics: host work while the device computes)
                before = (st.unscaled_grads or {}).get(id(opt))
                if before is not None and _grad_versions(opt) != before:
                    ev.extra["grads_after_unscale"] = True  # rules/scaler.py call_order: scaler_misorder
                if opt is not None and st.unscaled_opts and _unscaled_through_another(opt, st.unscaled_opts):
                    ev.extra["unscaled_twice"] = True  # rules/callorder.py: scaler_misorder
                if self._stage_early(ev, opt, args):
                    st.found_inf_t = self._found_inf_of(opt)
                    presync(self, opt, early=True)
                    st.early = True
            st.in_scaler_step += 1
            if opt is not None and id(opt) not in self.known_optimizers and self.owns(opt):
                self.known_optimizers.add(id(opt))
                self.w.adopt_optimizer(opt)
        return (ev, opt)

    @guarded
    def scale_read(self):
        """`scaler.get_scale()` ran (the loop reads the scale, e.g. to unscale a penalty's gradients by hand)."""
        if not self.disabled:
            self.st.scale_reads += 1

    def _stage_early(self, ev, opt, args) -> bool:
        """Whether scaler.step(opt) beginning now stages the step's values before GradScaler's synchronisation
        (transfer.presync `early`) rather than in the optimizer's step after it: a routine step of the one optimizer
        this watch knows, whose gradients the loop's own unscale_ already checked (so nothing GradScaler does before
        the optimizer's step adds a value), with nothing unusual about the call. The host work is the same; it runs
        while the device still works through the backward instead of while it waits for the host (issue 15:
        benchmarks/window_probe.py). Anything else keeps the staging at the optimizer's step."""
        st = self.st
        return (st.phase is StepPhase.OPEN and not st.sampled and not st.fused_amp and not ev.extra
                and opt is not None and len(args) <= 1 and self.known_optimizers == {id(opt)}
                and not getattr(opt, "_step_supports_amp_scaling", False) and st.unscaled_opts == [opt]
                and scaler_stage(self.w.scaler, opt) == "UNSCALED")

    def _found_inf_of(self, opt):
        """What `unscale_(opt)` found this iteration, as a 1-value tensor (None when it has not run)."""
        try:
            fi = self.w.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        except (AttributeError, KeyError, TypeError):
            return None
        if not fi:
            return None
        vs = [v.detach().reshape(-1) for v in fi.values()]  # fresh tensors per unscale_: no copy
        return vs[0] if len(vs) == 1 else torch.cat([v.double() for v in vs]).sum()

    @guarded
    def after(self, tok, args, kwargs, out):
        if tok is None or self.disabled:
            return
        ev, opt = tok
        st = self.st
        sc = self.w.scaler
        loss = (args[0] if args else kwargs.get("outputs")) if ev.kind == "scale" else None
        if ev.kind == "scale" and isinstance(out, torch.Tensor) and out is not loss:
            st.scaled_node = out.grad_fn  # (a disabled GradScaler's scale() returns the loss itself: nothing scaled)
        if ev.kind == "scale" and getattr(sc, "_scale", None) is not None:
            # the scale tensor itself: only update() changes it in place, after presync has queued its copy
            # (an update() that comes first takes a copy then, see before)
            st.scale_t = sc._scale
        if ev.kind == "scale" and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            # does the backward go through the scaled loss? (`scaler.scale(loss)` as a statement, then
            # loss.backward(): unscale_ divides gradients that were never scaled) A node pre-hook only notes it;
            # every step, as a branch that begins doing so on a later step repeats the calls of the step before
            ran = [False, False]
            out.grad_fn.register_prehook(functools.partial(_ran, ran))
            node = getattr(loss, "grad_fn", None)
            st.scaled_outs.append((ev, ran, None if node is None else id(node), st.micro))
            st.scaled_micros.add(st.micro)
        if ev.kind == "unscale_" and opt is not None and st.sampled and self.owns(opt):  # (sampled steps only)
            grads_after_unscale(self, opt)
        if ev.kind == "update" and st.phase is StepPhase.OPEN and st.in_scaler_step == 0 and any(
                self.owns(o) for o in st.unscaled_opts):
            # update() with no step since unscale_: the loop skipped this iteration's step itself (e.g. on a
            # non-finite gradient norm); the iteration ends here, as a skipped step (its found_inf, see before).
            # (Another model's optimizer only, a GAN's generator stepped through the one scaler while the watch
            # holds the discriminator: no step of this model's; its half of the iteration joins the next one)
            presync(self, None)
            self.end_step()
        if ev.kind == "update":
            st.loss_mark = len(st.losses)
        if ev.kind == "step":
            st.in_scaler_step -= 1
            if opt is not None and id(opt) not in self.known_optimizers and not self.owns(opt):
                # another model's optimizer on the shared scaler (a GAN's discriminator): not this step's end, and the
                # losses scaled since the last step or update were its network's (a critic's loss at the scaler's
                # opening search, NaN and skipped as designed), not this model's
                if st.in_scaler_step == 0 and st.phase is StepPhase.OPEN and len(st.losses) > st.loss_mark:
                    del st.losses[st.loss_mark:]
                    st.loss_node = None
                return
            if st.clip_pending and opt is not None:
                self._clip_was_scaled(opt)
            fi = self._found_inf_of(opt)
            if fi is not None:
                st.found_inf_t = fi
            if opt is not None and st.in_scaler_step == 0:
                self.stepped_grads[id(opt)] = _first_grad(opt)
                self.opt_stepped_at[id(opt)] = st.step
            if st.phase is StepPhase.ENDED and st.in_scaler_step == 0:
                presync_more(self, opt)  # a second optimizer's step in an iteration that went on
            if st.early and st.in_scaler_step == 0 and not any(
                    o.kind == "optimizer.step" and o.index > ev.index for o in st.events):
                skipped_grads(self)  # staged early and then skipped: which gradients were not finite
            presync(self, opt)
            resolve_early(self)
            st.loss_mark = len(st.losses)
            self.end_step()

    @guarded
    def failed(self, tok, e: BaseException) -> None:
        if tok is None:
            return
        ev = tok[0] if isinstance(tok, tuple) else tok
        ev.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        opt = tok[1] if isinstance(tok, tuple) else None
        if opt is not None and "unscale FP16 gradients" in ev.error:
            # which fp16 parameters it refused (e.g. a group added by add_param_group after the watch began)
            names = self._param_names()
            ev.extra["fp16_params"] = [names.get(id(p), "?") for g in opt.param_groups for p in g["params"]
                                       if p.grad is not None and p.grad.dtype == torch.float16][:50]
        if ev.kind == "step":
            self.st.in_scaler_step = max(self.st.in_scaler_step - 1, 0)
            for o in self.st.events:  # the optimizer.step it began raised with it: it stepped nothing
                if o.kind == "optimizer.step" and o.index > ev.index and o.via_scaler and o.error is None:
                    o.error = ev.error
