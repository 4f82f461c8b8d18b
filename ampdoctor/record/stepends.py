"""When a step ends, and what a report or a close finds open: a mixin of StepMachine (record/step.py).

`iteration_goes_on` says whether the ended step's iteration is not over (a GAN's loop on one GradScaler: its second
optimizer still to step before the one update), with the optimizer bookkeeping it asks (which optimizers stepped,
which parameters the model's other optimizers hold); `raised_between` whether an exception that ends the run came
after the ended step, between iterations; `finish_open_step` turns the step a report or a close finds open into a
record, or leaves it to its iteration.
"""
from __future__ import annotations

import math

import torch

from .entries import step_ended
from .monitor import OptimizerPatch
from .openstep import StepPhase
from .params import model_grads, norms

__all__ = ["StepEnds"]


class StepEnds:
    """Mixin of StepMachine: see the module docstring."""

    def iteration_goes_on(self) -> bool:
        """The ended step's iteration is not over: its scaler.step() came and its scaler.update() has not, and an
        optimizer of this model that the scaler stepped in the step before has not stepped in it yet (in the first
        iteration: parameters that this step trained and that no optimizer stepped so far holds). A GAN's loop on
        one GradScaler (the discriminator's step, then the generator's forward, scaled backward and step, then one
        update): both optimizers' steps are one step of a watched container holding both networks. An optimizer
        stepping twice ends it (a loop that never calls update())."""
        if not self._awaits_update():
            return False
        stepped = self.scaler_stepped()
        done = set(stepped)
        if len(done) < len(stepped):
            return False  # an optimizer stepped twice: a second iteration already (a loop that never calls update())
        return self.others_to_step(done)

    def scaler_stepped(self) -> list:
        """The opt numbers of the optimizers scaler.step() stepped in the open step so far, in order."""
        return [e.opt for e in self.st.events if e.kind == "step" and not e.internal]

    def others_to_step(self, done: set) -> bool:
        """Whether another optimizer of the model is still to step through the scaler in this iteration (`done`:
        the opt numbers stepped so far): one it stepped in the step before and not yet in this one, or, in the first
        iteration, one for the parameters this step trained that none of those stepped so far holds."""
        st, last = self.st, self.opt_stepped_at
        if len(self.known_optimizers) > 1 and any(self.opt_numbers.get(o) not in done and last.get(o) == st.step - 1
                                                  for o in self.known_optimizers):
            return True
        return not self.records and st.sampled and self._untouched_in_use(done)

    def raised_between(self, exc: BaseException) -> bool:
        """Whether `exc`, ending the run, was raised after the ended step's last call and before the next iteration's
        first (its data loading at the loop's top): the step had finished (its optimizer step and its scaler's
        update came, no call of it raised), and where the loop's own frame was when it raised lies above that step's
        first call in the loop's file (a check of the step's results below its update() stays the step's)."""
        st = self.st
        if st.phase is not StepPhase.ENDED or self._awaits_update() or any(e.error for e in st.events):
            return False
        calls = [(e.file, e.line) for e in st.events if e.file and e.line is not None and not e.internal]
        if not calls:
            return False
        first = min(ln for f, ln in calls if f == calls[0][0])
        tb = exc.__traceback__
        while tb is not None:  # the frame of the code that made the step's first call: the loop's
            code = tb.tb_frame.f_code
            if code.co_filename == calls[0][0] and any(ln == first for _, _, ln in code.co_lines()):
                return tb.tb_lineno < first
            tb = tb.tb_next
        return False

    def _known_opts(self) -> list:
        """The optimizer objects this watch knows (patched: given or adopted)."""
        return [p.obj for p in self.w._patches if isinstance(p, OptimizerPatch) and id(p.obj) in self.known_optimizers]

    def held_by_others(self, opt) -> set:
        """The ids of the parameters that the model's other known optimizers hold and `opt` does not."""
        return _held(o for o in self._known_opts() if o is not opt) - _held([opt])

    def _untouched_in_use(self, stepped: set) -> bool:
        """Whether parameters that require grad, of modules this (sampled) step ran with gradients on, are held by
        none of the optimizers stepped so far (`stepped`: their opt numbers): a GAN container's other network,
        before its optimizer's first step (not an EMA copy, which no forward with gradients runs; not a second
        optimizer over the same parameters that the loop never steps)."""
        held = _held(o for o in self._known_opts() if self.opt_numbers.get(id(o)) in stepped)
        ran = {c.module for c in self.st.calls if c.grad_enabled}
        return any(p.requires_grad and id(p) not in held and n.rpartition(".")[0] in ran for n, p in self.params)

    def finish_open_step(self, mid_run: bool = False) -> None:
        """`mid_run`: a report taken while training goes on (Watch.report before close)."""
        st = self.st
        # a zero_grad alone (nanoGPT's after scaler.update()) opens no step
        trained = st.phase is StepPhase.ENDED or any(e.kind != "zero_grad" for e in st.events) or st.losses \
            or st.micro or st.exception
        if trained or (st.calls and not self.records):  # an eval-only tail after training is not a step
            if (st.phase is StepPhase.OPEN and st.exception is None and (mid_run or self.records)
                    and not any(e.error for e in st.events)):
                fwd_ok, grads_ok = self._open_finite()
                if fwd_ok and grads_ok and (mid_run or not (st.discarded or _read_scaled(st))):
                    # an iteration not (yet) at its optimizer step, with nothing non-finite in it and no call that
                    # raised (a scaler error the loop caught): a report taken inside it leaves it to the iteration;
                    # at the end it is no step (a loop that stopped after the backward), unless it holds iterations
                    # the loop threw away (kept: they are the run's last ones), or it read the gradients' norm while
                    # they were scaled (a spike guard reading the scaled norm skips every iteration: kept, so the
                    # rules see the read, rules/clipscaled.py)
                    return
                if fwd_ok and not grads_ok and not mid_run and self.threw_away and self.w.scaler is None:
                    # a loop that keeps its own loss scale, ended on an iteration it threw away (its growth probe
                    # overflowed; the next iteration's zero_grad would have cleared it): no failure of its own
                    if not st.discarded:
                        return
                    st.discarded += 1
            # a report inside an iteration whose forward already went non-finite (a NaN guard printing it): the
            # step is recorded as it is now, and the rest of the iteration (its backward, the scaler's skip) is
            # recorded under the same step number and folded into that record when it ends, as if no report came
            folds = mid_run and st.phase is StepPhase.OPEN and not self.w.closed
            self.finalize()
            self.st = self._new_step(st.step if folds else st.step + 1)
            self.st.folds = folds
            if not self.w.closed:
                step_ended(self, st)
                self.sync_module_hooks()

    def _open_finite(self) -> tuple[bool, bool]:
        """Whether the open step's losses and outputs so far are all finite, and whether its gradients are (read
        now: a report or a close; the gradients only when the forward was)."""
        st = self.st
        vals = [t for t in st.losses] + [t for sums, _ in st.out_ok for t in sums]
        if any(not bool(torch.isfinite(t).all()) for t in vals):
            return False, False
        _, grads = model_grads(self)
        return True, not grads or bool(torch.isfinite(norms(grads, math.inf)).all())


def _read_scaled(st) -> bool:
    """A clip or norm read on the open step's gradients while they were still multiplied by the loss scale."""
    return any(e.reads_norm() and e.scaled for e in st.events)


def _held(opts) -> set:
    """The ids of the parameters the optimizers `opts` hold."""
    return {id(q) for o in opts for g in o.param_groups for q in g["params"]}
