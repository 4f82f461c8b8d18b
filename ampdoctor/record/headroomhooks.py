"""The headroom hooks' life on one watched model, and which routine steps record the series.

The hooks (hooks.HeadroomHook, hooks.PassHook: one forward post-hook per module below the root) go on with the
watch. The first routine step after a sampled one runs every one of them and notes which modules read a value
(Headroom.observe); at the next step boundary the others come off until the next sampled step (Headroom.plan).
With headroom="auto" the budget (budget.py) says which routine steps carry the series, and between those steps
the hooks come off entirely ("parked": a hooked module takes torch's slow call path even when its hook returns at
once). They come off for good when the watch closes, fails, or finds the model compiled.
"""
from __future__ import annotations

import time

from typing import TYPE_CHECKING

from .budget import HeadroomBudget
from .hooks import HeadroomHook, PassHook, hookable

if TYPE_CHECKING:
    from .step import StepMachine

__all__ = ["HeadroomHooks"]


class HeadroomHooks:
    """Owned by the StepMachine (`m`), whose Headroom (`m.hr`) the hooks feed."""

    def __init__(self, m: "StepMachine"):
        self.m = m
        self.handles: dict[int, tuple] = {}  # slot -> (its module's hook dict, the hook's id) while the hook is on
        self.sites: list | None = None  # [(slot, module, hook, id)] of every hooked module, as the last full install
        #                                 found them (an install after parking re-puts them: no walk of the model)
        self.wanted = False      # installed (some may be pruned or parked for now)
        self.parked = False      # ... but off between the steps that carry the series (headroom="auto")
        self.observe_next = True  # the next routine step observes which hooks read anything
        self.idle: frozenset = frozenset()  # the slots the last observed step pruned
        self.empty = False       # ... and it read nothing at all (no fp16/bf16 value anywhere, root included)
        cfg = m.cfg
        self.budget = HeadroomBudget(cfg.headroom_budget) if cfg.headroom == "auto" else None

    def start(self, sampled: bool, tail: float = 0.0) -> None:
        """A step begins: prune after an observed step, and set `hr.on` (whether this step records the series)
        as WatchConfig.headroom and the budget say. `tail`: what finalising the ended step took (counted to it)."""
        m, hr, budget = self.m, self.m.hr, self.budget
        if hr.observing:
            self.prune()
        hr.reset()
        own, hr.spent = hr.spent, 0.0  # the ended step's series work, its read-back included (finalised just now)
        if budget is not None:
            budget.tail(tail)
            budget.series_time(own)
            budget.begin()
        # sampled steps: the full statistics give the series; the root's own value also when compiled
        hr.on = m.cfg.headroom is not False and not sampled and not m.disabled
        if sampled:
            self.observe_next = True
        elif hr.on and self.observe_next and self.wanted:
            self.observe_next = False
            self.install()
            hr.observe()
            if budget is not None:
                budget.untimed()
        elif hr.on and budget is not None and self.empty:
            hr.on = False  # the observed step read nothing (an fp32 model): nothing to read until it is observed again
        elif hr.on and budget is not None:
            hr.on = budget.due()
            if hr.on and self.parked:
                self.install(skip=self.idle, walk=False)
            elif not hr.on and not self.parked and self.wanted and budget.stride > 1:
                t = time.perf_counter()
                self.park()
                t = time.perf_counter() - t
                budget.t0 += t  # (the series' own cost, not this step's)
                budget.tail(t)

    def ended(self) -> None:
        """The open step reached its optimizer step (the budget times it)."""
        if self.budget is not None:
            self.budget.ended()

    def install(self, skip=frozenset(), walk: bool = True) -> None:
        """Every module below the root (none on a compiled model: the root's eager hooks record the root's value),
        but the slots in `skip` (the pruned ones, when the hooks come back after steps without the series).
        `walk`: find the modules by walking the model (a module added since has no slot; one taken out is not
        hooked again); without it the hooks go back where the last walk put them, each under the id torch gave it
        then: a parked watch's hooks come back every few steps, and the walk and torch's handles cost ~0.2 ms."""
        m = self.m
        if m.compiled or m.disabled:
            return
        self.wanted = True
        self.parked = False
        if walk or self.sites is None:
            old = {site[0]: site for site in self.sites or ()}
            sites = []
            for mod in m.w.model.modules():
                if mod is m.root or mod is m.w.model or not hookable(mod):
                    continue
                slot = m.slot_of.get(id(mod))  # (None: a module added after the watch began has no series)
                if slot is None:
                    continue
                site = old.get(slot)
                if site is None or site[1] is not mod:
                    hook = PassHook(m.hr, slot) if slot in m.hr_skip else HeadroomHook(m.hr, slot, m.fail)
                    site = (slot, mod, hook, None)
                sites.append(site)
            self.sites = sites
        handles = self.handles
        for k, (slot, mod, hook, hid) in enumerate(self.sites):
            if slot in handles or slot in skip:
                continue
            if hid is None:  # first time on this module: torch's registration, whose id is kept
                hid = hook.register(mod).id
                self.sites[k] = (slot, mod, hook, hid)
            else:  # what register_forward_hook does, less the handle: the hook under its id, last in the dict
                mod._forward_hooks[hid] = hook
            handles[slot] = (mod._forward_hooks, hid)

    def prune(self) -> None:
        """After an observed step: the hooks of modules that read nothing come off until the next sampled step
        (~2/3 of a transformer's: fp32 LayerNorms and residual streams under autocast, containers returning a
        child's output, pass-on modules no container returns). The series stays the same: a pruned container's
        value is its child's (Headroom.plan)."""
        m = self.m
        self.empty = not m.hr.read
        idle, _ = m.hr.plan(fixed=m.slot_of[id(m.root)])
        self.idle = frozenset(idle)
        for slot in idle:
            h = self.handles.pop(slot, None)
            if h is not None:
                h[0].pop(h[1], None)

    def park(self) -> None:
        """Between the steps that carry the series: no hook at all; they come back, pruned, for the next one."""
        for hooks, hid in self.handles.values():
            hooks.pop(hid, None)
        self.handles = {}
        self.parked = True

    def remove(self) -> None:
        """For good (close, an internal error, a compiled model)."""
        self.park()
        self.parked = False
        self.wanted = False
        self.sites = None
