"""The open step's phase (record/openstep.StepPhase: one owner, changed only by _Step.advance) and the capture
policy (record/autocapture.CapturePolicy: which steps are sampled, which bad steps get a capture)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.config import WatchConfig
from ampdoctor.record.autocapture import CapturePolicy
from ampdoctor.record.openstep import StepPhase, StepPhaseError, _Step
from ampdoctor.records import BACKOFF_MAX_STREAK

OPEN, STAGED, ENDED, FINAL = StepPhase.OPEN, StepPhase.STAGED, StepPhase.ENDED, StepPhase.FINAL
ALLOWED = {(OPEN, STAGED), (STAGED, ENDED), (STAGED, FINAL), (ENDED, ENDED), (ENDED, FINAL)}


def _step_at(phase: StepPhase) -> _Step:
    st = _Step(step=0, sampled=False)
    path = {OPEN: [], STAGED: [STAGED], ENDED: [STAGED, ENDED], FINAL: [STAGED, FINAL]}[phase]
    for p in path:
        st.advance(p)
    assert st.phase is phase
    return st


def test_a_step_opens_and_goes_through_its_phases_in_order():
    st = _Step(step=3, sampled=True)
    assert st.phase is OPEN and not st.ended
    st.advance(STAGED)
    assert st.phase is STAGED and not st.ended
    st.advance(ENDED)
    assert st.ended
    st.advance(ENDED)  # a second optimizer's step in the same iteration
    st.advance(FINAL)
    assert st.phase is FINAL and not st.ended
    eval_tail = _Step(step=4, sampled=False)  # no optimizer step came: staged at finalize, then final
    eval_tail.advance(STAGED)
    eval_tail.advance(FINAL)
    assert eval_tail.phase is FINAL


@pytest.mark.parametrize("frm,to", [(a, b) for a, b in itertools.product(StepPhase, StepPhase)
                                    if (a, b) not in ALLOWED])
def test_an_illegal_transition_is_refused_and_the_phase_stays(frm, to):
    st = _step_at(frm)
    with pytest.raises(StepPhaseError, match=f"{frm.name} to {to.name}"):
        st.advance(to)
    assert st.phase is frm


def test_the_phase_is_not_assignable():
    st = _Step(step=0, sampled=False)
    with pytest.raises(AttributeError):
        st.phase = ENDED
    with pytest.raises(AttributeError):
        st.ended = True


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    return model, opt, sc


def _backward(model, sc, g):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(torch.randn(4, 8, generator=g)).float(), torch.zeros(4, 1))
    sc.scale(loss).backward()


def test_a_watched_run_moves_each_step_open_staged_ended_final():
    model, opt, sc = _setup()
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(w.machine.st.phase))  # runs after ampdoctor's presync
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, every=1)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        opt.zero_grad()
        _backward(model, sc, g)
        st = w.machine.st
        assert st.step == step and st.phase is OPEN
        sc.step(opt)
        assert st.phase is ENDED
        sc.update()
        assert st.phase is ENDED and w.machine.st is st and len(w.steps) == step  # waits for the next iteration
    opt.zero_grad()  # the next iteration begins: the ended step is made into its record
    assert st.phase is FINAL and w.machine.st is not st and w.machine.st.phase is OPEN
    w.close()
    assert seen == [STAGED] * 3
    assert [r.step for r in w.steps] == [0, 1, 2] and not any(r.internal_error for r in w.steps)


def test_an_illegal_transition_in_a_watched_run_disables_the_watch_not_the_training():
    """A step made final before its optimizer step (as a bug in ampdoctor would): the transition to ENDED is
    refused inside scaler.step(); the watch switches itself off and says so, the training goes on."""
    model, opt, sc = _setup()
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, every=1)
    g = torch.Generator().manual_seed(0)
    opt.zero_grad()
    _backward(model, sc, g)
    sc.step(opt)
    sc.update()
    opt.zero_grad()
    _backward(model, sc, g)
    st = w.machine.st
    st.advance(STAGED)
    st.advance(FINAL)
    before = model[0].weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="disabled itself after an internal error.*StepPhaseError"):
        sc.step(opt)
    assert not torch.equal(model[0].weight, before), "the optimizer step still ran"
    sc.update()
    for _ in range(2):  # training goes on, unwatched
        opt.zero_grad()
        _backward(model, sc, g)
        sc.step(opt)
        sc.update()
    w.close()
    assert w.machine.disabled
    err = [r for r in w.steps if r.internal_error]
    assert len(err) == 1 and err[0].step == 1
    assert err[0].internal_error["type"] == "StepPhaseError" and "FINAL to ENDED" in err[0].internal_error["message"]


# -- the capture policy ------------------------------------------------------------------------------------
def _kinds(policy: CapturePolicy, seq, scaler=True):
    """seq: (bad_fwd, bad_bwd, scale) per step; the policy's kind for each."""
    return [policy.kind(f, b, s, scaler) for f, b, s in seq]


def test_gradscalers_initial_search_is_not_captured():
    p = CapturePolicy(WatchConfig())
    search = [(False, True, 2.0 ** (24 - i)) for i in range(BACKOFF_MAX_STREAK - 1)]
    assert _kinds(p, search + [(False, False, 2.0 ** 15)]) == [None] * len(search) + [None]
    assert p.stepped


def test_an_initial_search_that_never_ends_is_persistent():
    p = CapturePolicy(WatchConfig())
    kinds = _kinds(p, [(False, True, 2.0 ** (24 - i)) for i in range(BACKOFF_MAX_STREAK + 1)])
    assert kinds == [None] * (BACKOFF_MAX_STREAK - 1) + ["persistent", "persistent"]


def test_a_skip_after_the_scale_settled_is_backward_and_persistent_skips_are_persistent():
    p = CapturePolicy(WatchConfig())
    settled = [(False, False, 1024.0)] * 3
    skips = [(False, True, 1024.0), (False, True, 512.0), (False, True, 256.0), (False, True, 128.0)]
    assert _kinds(p, settled + skips) == [None] * 3 + ["backward", "backward", "persistent", "persistent"]


def test_a_single_skip_right_after_the_scale_grew_is_the_scaler_probing():
    p = CapturePolicy(WatchConfig())
    assert _kinds(p, [(False, False, 1024.0), (False, False, 2048.0), (False, True, 4096.0),
                      (False, False, 2048.0)]) == [None, None, None, None]


def test_a_forward_failure_is_forward_and_resets_the_skip_streak():
    p = CapturePolicy(WatchConfig())
    assert _kinds(p, [(False, False, 1024.0), (False, True, 1024.0), (True, True, 512.0),
                      (False, True, 512.0)]) == [None, "backward", "forward", "backward"]
    assert p.skip_streak == 1


def test_without_a_scaler_every_nonfinite_gradient_is_backward():
    p = CapturePolicy(WatchConfig())
    assert _kinds(p, [(False, True, None)], scaler=False) == ["backward"]


def test_observe_captures_each_kind_once_schedules_followups_and_spends_the_budget():
    p = CapturePolicy(WatchConfig(every=100, bad_step_followup=2, max_captures=2))
    assert [p.sampled(s) for s in range(3)] == [True, False, False]
    assert p.observe(False, False, 1.0, sampled=False, scaler=True) is None
    assert p.observe(True, False, 1.0, sampled=False, scaler=True) == "forward"
    assert [p.sampled(s) for s in range(3, 6)] == [True, True, False]  # the two follow-ups of a bad step
    assert p.observe(True, False, 1.0, sampled=True, scaler=True) is None  # a second forward failure: no capture
    assert p.followup == 0  # a sampled bad step schedules none
    assert p.observe(False, True, 1.0, sampled=True, scaler=True) == "backward"
    assert [p.spend(), p.spend(), p.spend()] == [True, True, False] and p.captures == 2


def _observe(p: CapturePolicy, seq):
    """seq: (bad_fwd, bad_bwd, scale) per step; the steps whose capture observe() asks for (spending the budget as
    maybe_capture does)."""
    out = []
    for i, (f, b, s) in enumerate(seq):
        if p.observe(f, b, s, sampled=False, scaler=True) is not None and p.spend():
            out.append(i)
    return out


def test_a_skip_that_comes_back_at_a_working_scale_is_captured_once_more_leaving_budget():
    """After a first backward skip took the kind, a skip at a scale an update already used, after 5+ clean steps,
    is captured once more (a harmless spike first, a NaN at any scale later); not a third time, not right after
    the first, not above the working scale, and never the last capture of the budget."""
    ok, skip = (False, False, 1024.0), (False, True, 1024.0)
    run = [ok] * 10 + [skip] + [ok] * 3 + [skip] + [ok] * 6 + [skip] + [ok] * 6 + [skip] + [ok] * 6
    assert _observe(CapturePolicy(WatchConfig()), run) == [10, 21]          # not 14 (too soon), not 28 (once)
    high = run[:21] + [(False, True, 2048.0)] + run[22:]
    assert _observe(CapturePolicy(WatchConfig()), high) == [10, 28]         # above what worked: not at 21
    assert _observe(CapturePolicy(WatchConfig(max_captures=2)), run) == [10]  # the last slot stays free
    fwd = run + [(True, False, 1024.0)]
    assert _observe(CapturePolicy(WatchConfig()), fwd) == [10, 21, len(run)]  # ... for a forward failure
