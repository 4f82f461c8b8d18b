"""The clipping functions' side of the step machine: a call of `clip_grad_norm_` / `clip_grad_value_` /
`get_total_norm` over this model's parameters (clippatch.ClipPatch fans the calls out) becomes a CallEvent that
says whether the gradients it read were still multiplied by the loss scale (rules/scaler.py: clipping before
unscale_), and its returned norm is read with the step's one transfer. An error of ampdoctor's own switches the
watch off (StepMachine.fail) and never reaches the training loop."""
from __future__ import annotations

import math

import torch

from .monitor import guarded, scaler_stage
from ..tensors import local

__all__ = ["ClipCallbacks"]


class ClipCallbacks:
    """Mixin of StepMachine (with OptimizerCallbacks, whose `_model_param_ids` it uses): the clipping calls."""

    @guarded
    def clip_before(self, kind, parameters, limit=None, grads=False):
        """`grads`: `parameters` are the gradients themselves (an early-bound clip_grad_value_, clippatch.ClipPatch)."""
        ev = self._clip_event(kind, parameters, grads)
        if ev is None:
            return None
        if isinstance(limit, (int, float)) and math.isinf(limit):
            ev.extra["max_norm"] = math.inf  # clips nothing: the call only reads the norm (rules/scaler.py)
        if self.w.scaler is None and kind in ("clip_grad_norm_", "clip_grad_norm") and not isinstance(
                parameters, torch.Tensor) and self._model_param_ids().issubset(map(id, parameters)):
            self.st.full_clip = ev  # its total norm is finite iff every gradient of the model is (presync)
        return ev

    def _clip_event(self, kind, parameters, grads=False):
        if self.disabled:
            return None
        ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if grads:  # the parameters these gradients are this model's
            gids = set(map(id, ps))
            ps = [p for _, p in self.params if p.grad is not None and id(p.grad) in gids]
        mine = self._model_param_ids()
        if mine.isdisjoint(map(id, ps)):
            # get_total_norm takes the gradients themselves (a norm read for the logs): are they this model's?
            if kind != "get_total_norm" or not ps:
                return None
            grads = {id(p.grad) for _, p in self.params if p.grad is not None}
            if grads.isdisjoint(map(id, ps)):
                return None
        sc = self.w.scaler
        stage = None
        scaled = False
        if sc is not None and self.w.optimizer is not None and getattr(sc, "_enabled", True):
            stage = scaler_stage(sc, self.w.optimizer)
            scaled = self.st.scaled_since_update and stage in (None, "READY")
            # another optimizer on the scaler was unscaled this iteration (a second one, or one built anew each
            # epoch while the watch holds the first): whether these gradients are still scaled is the same
            # question as for UNSCALED below
            unscaled_other = scaled and bool(self.st.unscaled_opts)
            if unscaled_other or not scaled and stage == "UNSCALED" and self.st.scaled_since_update:
                scaled = False
                pending = self._still_scaled(ps, mine)
                if pending:
                    ev = self.event(kind, 5, stage=stage, scaled=False)
                    self.st.clip_pending.append((ev, pending))  # judged when another optimizer steps them
                    return ev
        return self.event(kind, 5, stage=stage, scaled=scaled)

    def _still_scaled(self, ps: list, mine: set) -> set:
        """The watched optimizer is unscaled: the clipped gradients of this model's parameters that no optimizer
        unscaled yet. They make the clip wrong when an optimizer steps them later in the step (a second optimizer
        sharing the scaler, unscaled after the clip); a parameter no optimizer steps only adds to the norm."""
        # the model's parameters none of them holds, kept while the optimizers' parameter lists stay as they are
        # (the usual loop asks every step: one optimizer over every parameter leaves none, and the answer is empty)
        key = tuple((id(o), tuple((id(g["params"]), len(g["params"])) for g in o.param_groups))
                    for o in self.st.unscaled_opts)
        if self._uncovered is None or self._uncovered[0] != key:
            done: set = set()
            for o in self.st.unscaled_opts:
                for g in o.param_groups:
                    done.update(id(p) for p in g["params"])
            self._uncovered = (key, mine - done)
        left = self._uncovered[1]
        if not left:
            return set()
        # (a frozen parameter's gradient is a stale one no backward of this run wrote: not scaled)
        return {id(p) for p in ps if id(p) in left and p.grad is not None and p.requires_grad}

    def _clip_was_scaled(self, opt) -> None:
        """`scaler.step(opt)` runs: a clip earlier in the step over gradients of `opt`'s that were still scaled
        clipped the scaled norm."""
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for ev, pending in self.st.clip_pending:
            if pending & ids:
                ev.scaled = True

    @guarded
    def clip_after(self, ev, out) -> None:
        if ev is None:
            return
        if isinstance(out, torch.Tensor) and out.numel() == 1:  # read with the step's one transfer
            # (FSDP2: a replicated DTensor; any float dtype: the step's transfer concatenates into the widest)
            if ev is self.st.full_clip:
                self.st.full_norms.append(len(self.st.norms))
            self.st.norms.append((ev, local(out.detach()).reshape(())))
