"""Entry modules: the modules that take the root's part when the loop never calls the watched model's own forward.

A Lightning module whose `training_step` calls `self.model(x)`, a container holding a generator and a discriminator,
a wrapper that holds the network and its loss: the watched model's forward never runs, so the root's hooks (which
keep each batch for a capture, check the model's output every step, keep the gradient reaching it) would see
nothing on routine steps, and a failure between sampled steps could only be reported at (run). On a sampled step
(every module hooked) the modules called at top level, with gradients on, while the root was not called at all are
noted (`_Step.tops`); those that hold a trainable parameter (not a loss module) become entries two steps later,
when by then a single optimizer steps the model's parameters, or several step it through one GradScaler within one
step (a GAN's generator and discriminator stepped in turn, one scaler.update() per iteration: StepMachine.
iteration_goes_on keeps the iteration one step). With several optimizers otherwise (each optimizer's step ends a
step, and the batches of one iteration would be split across two records) such a container stays without entries.
Entries get the root's two hooks (`ModuleHookCallbacks` treats a top-level call of an entry as a root call) and each
batch they receive is kept with its entry's name (`_Step.entry_of`). A capture of such a batch names its entry
(manifest `extra.entry`), and the replay runs that module of the model (replay/skeleton.entry_view), so the findings
keep the watched model's module names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .hooks import ModuleHook

if TYPE_CHECKING:
    from .openstep import _Step
    from .step import StepMachine

__all__ = ["step_ended"]


WAIT = 2
"""Steps after the sampled step that found the candidates before they become entries (the optimizers seen by then)."""


def step_ended(m: "StepMachine", ended: "_Step") -> None:
    """Step `ended` was finalised and the next one has begun: note its candidates, adopt those that are due."""
    if ended.tops:
        note_candidates(m, ended)
    if m.entry_wait is not None:
        adopt_entries(m, m.st.step)


def note_candidates(m: "StepMachine", st: "_Step") -> None:
    """After sampled step `st`: the modules it called at top level are candidates when the root was not called."""
    if not st.micro and st.tops and m.entry_wait is None:
        m.entry_wait = (list(st.tops), st.step + WAIT)


def adopt_entries(m: "StepMachine", step: int) -> None:
    """At the start of step `step`: the candidates become entries when one optimizer steps the model."""
    tops, due = m.entry_wait
    if step < due:
        return
    m.entry_wait = None
    if m.compiled or m.disabled or m.w.closed or len(m.known_optimizers) > 1 and not _together(m):
        return
    new = []
    for mod in tops:
        if id(mod) in m.entries or any(mod is n for n in new):
            continue
        if not any(p.requires_grad for p in mod.parameters()):
            continue  # a loss module, a frozen network run with gradients on: what the loop trains is elsewhere
        new.append(mod)
    if not new:
        return
    m.remove_module_hooks()  # (put back by sync_module_hooks without the entries: they keep the root's hooks)
    for mod in new:
        m.entries[id(mod)] = m.w._names.get(id(mod), "?")
        m.w._handles.append(ModuleHook(m.forward_pre, "pre", eager=True).register(mod))
        m.w._handles.append(ModuleHook(m.forward_post, "post", eager=True).register(mod))


def _together(m: "StepMachine") -> bool:
    """Every optimizer of the model stepped through the scaler in the step that just ended: one step holds the
    whole iteration (StepMachine.iteration_goes_on), so its batches are not split across records."""
    return {m.opt_stepped_at.get(o) for o in m.known_optimizers} == {m.st.step - 1}
