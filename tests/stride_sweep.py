"""pytest plugin (not a test file): pin the stride of every watch's headroom series, to find the false
`headroom_trend` alarms that the default headroom="auto" raises only at some strides (the stride follows the
machine's load, so such a test is flaky; pinned, it fails or passes every time).

    cd tests && AMPDOCTOR_FORCE_STRIDE=4 ../.venv/bin/python -m pytest -q -p stride_sweep test_healthy*.py ...

    cd tests && AMPDOCTOR_WANDER_SEED=24 ../.venv/bin/python -m pytest -q -p stride_sweep test_healthy*.py ...

Without AMPDOCTOR_FORCE_STRIDE or AMPDOCTOR_WANDER_SEED the plugin does nothing. With AMPDOCTOR_FORCE_STRIDE=k,
every `Watch` built without an explicit `config=` and `headroom=` (ampdoctor.watch, the HF/Lightning callbacks: they
pass headroom=None unless told) gets:

  k == 1: headroom=True (the series on every routine step);
  k > 1:  headroom="auto" with headroom_budget=1e-9, and its HeadroomBudget swapped (per instance, via __class__)
          for a subclass whose `ended` records fixed fake timings (a step with the series 2 units, one without 1:
          the series costs 100%, over any budget) and whose `due` runs with record.budget.MAX_STRIDE = k; so after
          the calibration at stride 2 (3 timed steps of each kind) the stride is exactly k, whatever the load.

With AMPDOCTOR_WANDER_SEED=N, each such watch's stride wanders instead (`install_wandering`: a new stride drawn at
random now and then, seeded with N per watch), as a loaded host's moving measurement sets it: the false alarms that
only a sequence of strides gives (CI's settle_near_2e4, see test_healthy_near_max.py) show up there.

A test's explicit choice (config= or headroom=) is left alone, and so is every other watch's budget (nothing is
patched module-wide), and every watch of a test marked `stride_own` (one that checks the budget's own choice of
stride: a forced stride fails it by design). `python -m ampdoctor` subprocesses a test launches are not forced (the plugin is not loaded
there). The terminal summary says how many watches were forced.
"""
from __future__ import annotations

import functools
import os

import pytest

_ENV = "AMPDOCTOR_FORCE_STRIDE"
_WANDER_ENV = "AMPDOCTOR_WANDER_SEED"
_forced = {"watches": 0, "explicit": 0, "tests": set()}
_current = {"nodeid": None, "own": False}  # the running test; whether it is marked stride_own


def forced_stride() -> int | None:
    v = os.environ.get(_ENV, "").strip()
    if not v:
        return None
    k = int(v)
    if not 1 <= k <= 32:
        raise pytest.UsageError(f"{_ENV} must be in 1..32, got {v!r}")
    return k


def _pinned_budget_class(k: int):
    import ampdoctor.record.budget as budget

    class PinnedBudget(budget.HeadroomBudget):
        __slots__ = ()  # same layout: an instance's __class__ can be swapped to it

        def ended(self) -> None:
            self.add(self.timed, None if self.timed is None or self.t0 is None else 2.0 if self.timed else 1.0)

        def tail(self, seconds: float) -> None:
            pass  # no `tail` added to a fake time

        def due(self) -> bool:
            saved = budget.MAX_STRIDE
            budget.MAX_STRIDE = k
            try:
                return budget.HeadroomBudget.due(self)
            finally:
                budget.MAX_STRIDE = saved

    PinnedBudget.__name__ = PinnedBudget.__qualname__ = f"PinnedBudget{k}"
    return PinnedBudget


WANDER_CHOICES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)
WANDER_P = 0.2


def _wandering_budget_class(seed: int):
    """A budget whose stride wanders as on a loaded host: at each routine step, with chance WANDER_P, a new stride
    drawn from WANDER_CHOICES (seeded), as a measurement that moves with the load sets it (CI's two cores). `creep`
    still puts the series on every step when a layer nears the max."""
    import random

    import ampdoctor.record.budget as budget
    rng = random.Random(seed)

    class WanderingBudget(budget.HeadroomBudget):
        __slots__ = ()

        def due(self) -> bool:
            if self.alert_left > 0:
                return budget.HeadroomBudget.due(self)
            if rng.random() < WANDER_P:
                self.stride = rng.choice(WANDER_CHOICES)
            self.dirty = False  # (the measured stride is not worked out: the draw stands)
            return budget.HeadroomBudget.due(self)

    WanderingBudget.__name__ = WanderingBudget.__qualname__ = f"WanderingBudget{seed}"
    return WanderingBudget


def install_wandering(seed: int, patch=None):
    """Like `install`, with the stride wandering (seeded) instead of pinned: the sequence of strides a loaded host's
    measurement gives, which no pinned stride reproduces."""
    install(2, patch=patch, budget_class=lambda: _wandering_budget_class(seed))


def install(k: int, patch=None, budget_class=None):
    """Wrap Watch.__init__ so that unconfigured watches run the series at stride k. `patch(obj, name, value)`
    defaults to setattr (the plugin, for the session); tests pass monkeypatch.setattr."""
    from ampdoctor.config import DEFAULT_EVERY, WatchConfig
    from ampdoctor.watch import Watch

    patch = patch or setattr
    pinned = _pinned_budget_class(k) if k > 1 and budget_class is None else None
    orig = Watch.__init__
    if getattr(orig, "_stride_sweep", None) is not None:
        orig = orig._stride_sweep

    @functools.wraps(orig)
    def __init__(self, model, *args, every=None, config=None, headroom=None, **kw):
        if config is not None or headroom is not None or _current["own"]:
            _forced["explicit"] += 1
            return orig(self, model, *args, every=every, config=config, headroom=headroom, **kw)
        every = DEFAULT_EVERY if every is None else every
        if k == 1:
            config = WatchConfig(every=every, headroom=True)
        else:
            config = WatchConfig(every=every, headroom="auto", headroom_budget=1e-9)
        orig(self, model, *args, config=config, **kw)
        cls = pinned if budget_class is None else budget_class()  # (a new class, its own seeded draws, per watch)
        if cls is not None:
            b = self.machine.hr_hooks.budget
            assert b is not None and type(b).__slots__ == cls.__mro__[1].__slots__
            b.__class__ = cls
        _forced["watches"] += 1
        if _current["nodeid"]:
            _forced["tests"].add(_current["nodeid"])

    __init__._stride_sweep = orig
    patch(Watch, "__init__", __init__)


def series_gaps(w) -> set:
    """The gaps between routine steps of watch `w` that carried the series with only routine steps between them,
    after the calibration (stride 2 up to step 7): a sampled or bad step records everything and restarts the count."""
    gaps, prev = set(), None
    for r in w.steps:
        if r.modules or r.skipped or r.found_inf:
            prev = None
            continue
        if r.headroom:
            if prev is not None and prev >= 7:
                gaps.add(r.step - prev)
            prev = r.step
    return gaps


def check_stride(w, stride: int) -> None:
    """At a pinned stride k, the series ran k apart (and, with `creep` putting it on every step for a while, 1 apart
    too): no gap above k, and k among them when k > 1."""
    gaps = series_gaps(w)
    assert gaps and max(gaps) <= stride, (stride, sorted(gaps))
    if stride > 1:
        assert stride in gaps, (stride, sorted(gaps))


def wander_seed() -> int | None:
    v = os.environ.get(_WANDER_ENV, "").strip()
    return int(v) if v else None


def pytest_configure(config):
    k, seed = forced_stride(), wander_seed()
    if k is not None and seed is not None:
        raise pytest.UsageError(f"{_ENV} and {_WANDER_ENV} exclude each other")
    if k is not None:
        install(k)
    elif seed is not None:
        install_wandering(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current["nodeid"] = item.nodeid
    _current["own"] = item.get_closest_marker("stride_own") is not None
    try:
        yield
    finally:
        _current["nodeid"], _current["own"] = None, False


def pytest_report_header(config):
    k, seed = forced_stride(), wander_seed()
    if seed is not None:
        return f"stride_sweep: headroom series stride wandering (seed {seed}) for watches without config=/headroom="
    if k is not None:
        return f"stride_sweep: headroom series pinned at stride {k} for watches without config=/headroom="


def pytest_terminal_summary(terminalreporter):
    k, seed = forced_stride(), wander_seed()
    if k is not None or seed is not None:
        how = f"stride {k}" if seed is None else f"stride wandering (seed {seed})"
        terminalreporter.write_line(
            f"stride_sweep: {how}: {_forced['watches']} watches forced in {len(_forced['tests'])} tests; "
            f"{_forced['explicit']} watches left alone (explicit config=/headroom=); counted in this process "
            f"(pytest-xdist workers count their own)")
