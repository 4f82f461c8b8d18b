"""Harness of the codebase-loop healthy files (test_healthy_default28/29): each case is a real codebase's training
loop, built afresh by its `make()`, run watched and unwatched. It owns

- `Rec`: what a case records per optimizer step (scale, skipped, gradients); `ns`: a built case;
- `registrar`: the `@case(...)` decorator filling a file's CASES;
- `run`: one run (watched under `ampdoctor.watch(m, optimizer=..., scaler=..., run_dir=...)`, or the unwatched twin
  under the forward-producer oracle), with the Python warnings ampdoctor gave;
- `healthy`: the oracle that the run was really healthy (finite, learned, only the scaler's opening search skipped);
- `identical` (with `same`, `bits`): the watched and unwatched runs bitwise identical (losses, scales, gradients,
  extras, weights, optimizer state);
- `judge`: the report (in-process and from the run dir) quiet, exit code 0, one recorded step per optimizer step;
  a false alarm raises probe_harness.WrongAnswer;
- `fall_by`: a `learned` check for a loss that may be negative.
Nothing here is a test."""
from __future__ import annotations

import math
import os
import warnings
from types import SimpleNamespace

import torch

import ampdoctor
from probe_harness import Producer, WrongAnswer, finite, quiet_report
from scenarios import alarms, lines

DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ------------------------------------------------------------------------------------------------------ the loop
class Rec:
    """What the test records per optimizer step of the watched optimizer (the case's loop calls `step` right after
    it): the scale the step ran at, whether it was skipped, the gradients it left."""

    def __init__(self, m):
        self.m, self.n, self.scales, self.skipped, self.grads = m, 0, [], [], []

    def step(self, scale, skipped):
        self.scales.append(scale)
        if skipped:
            self.skipped.append(self.n)
        self.grads.append([None if p.grad is None else p.grad.detach().clone() for p in self.m.parameters()])
        self.n += 1

    def after_update(self, sc, s):
        """After scaler.update(): skipped when the scale fell."""
        self.step(s, sc.get_scale() < s)


def ns(m, opt, sc, rec, body, extra=None, others=None, watch_opt=None, steps=None):
    """A built case: the model, the optimizer (and the one to watch, when another object), the scaler, its Rec, its
    loop body (iteration -> loss), its extras (dict of lists, compared bitwise) and other modules whose state must
    match too (EMA / teacher copies)."""
    return SimpleNamespace(m=m, opt=opt, sc=sc, rec=rec, body=body, extra=extra if extra is not None else {},
                           others=others or {}, watch_opt=watch_opt if watch_opt is not None else opt,
                           steps=steps or (lambda: rec.n))


def registrar(cases: dict):
    """The `@case(iters, ...)` decorator of a file whose cases go into `cases` (name -> how to build and judge it)."""
    def case(iters, fall=0.8, learned=None, name=None, streak=4):
        def deco(make):
            cases[name or make.__name__] = SimpleNamespace(make=make, iters=iters, fall=fall, learned=learned,
                                                           streak=streak)
            return make
        return deco
    return case


def run(cs, rd=None):
    """One run of `cs` (its make() builds everything afresh from fixed seeds). rd given: under
    ampdoctor.watch(m, optimizer=..., scaler=..., run_dir=rd) and nothing else; rd None: the unwatched twin, under
    the oracle's forward hooks (probe_harness.Producer)."""
    c = cs.make()
    prod = Producer(c.m) if rd is None else None
    r = SimpleNamespace(losses=[], c=c, rd=rd, w=None, first=None, case=cs)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if rd is not None:
            try:
                r.w = ampdoctor.watch(c.m, optimizer=c.watch_opt, scaler=c.sc, run_dir=rd)
            except ampdoctor.WatchError as e:
                raise WrongAnswer(f"watch refused a healthy setup: {e}") from e
        try:
            for i in range(cs.iters):
                if prod is not None:
                    prod.new_step(c.rec.n)
                r.losses.append(float(c.body(i)))
        finally:
            if r.w is not None:
                r.w.close()
            if prod is not None:
                prod.remove()
                r.first = prod.first
    r.warns = [str(x.message) for x in seen if str(x.message).startswith("ampdoctor")]
    r.state = {k: v.detach().clone() for k, v in c.m.state_dict().items()}
    for name, mod in c.others.items():
        st = mod.state_dict() if hasattr(mod, "state_dict") else mod
        r.state.update({f"{name}::{k}": v.detach().clone() for k, v in st.items()})
    r.opt_state = c.opt.state_dict()
    r.final_scale = c.sc.get_scale() if c.sc is not None else None
    return r


# ------------------------------------------------------------------------------------------------------ the oracle
def healthy(r):
    cs, rec = r.case, r.c.rec
    ls = r.losses
    assert ls and all(map(math.isfinite, ls)), ls
    if cs.learned is not None:
        cs.learned(r)
    else:
        k = max(3, len(ls) // 5)
        assert sum(ls[-k:]) / k < cs.fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)
    assert r.first is None, r.first
    assert rec.n > 0
    first = next(k for k in range(rec.n) if k not in rec.skipped)
    late = [s for s in rec.skipped if s > first]
    assert first <= getattr(cs, "streak", 4) and len(late) <= 2 and not any(s + 1 in late for s in late), (rec.skipped, rec.scales)
    bad = [i for i, gs in enumerate(rec.grads) if i not in rec.skipped and not finite([g for g in gs if g is not None])]
    assert not bad, bad
    assert all(finite(v) for v in r.state.values())


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same(x, y):
    if torch.is_tensor(x):
        return torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


def identical(rw, ru):
    aw, au = rw.c.rec, ru.c.rec
    assert rw.losses == ru.losses, [(k, p, q) for k, (p, q) in enumerate(zip(rw.losses, ru.losses)) if p != q][:3]
    assert aw.scales == au.scales and aw.skipped == au.skipped and rw.final_scale == ru.final_scale
    diff = [k for k, (p, q) in enumerate(zip(aw.grads, au.grads)) if not same(p, q)]
    assert not diff and len(aw.grads) == len(au.grads), diff[:5]
    assert same(rw.c.extra, ru.c.extra), [k for k in ru.c.extra if not same(rw.c.extra.get(k), ru.c.extra[k])]
    diff = [k for k in ru.state if not same(rw.state.get(k), ru.state[k])]
    assert not diff and rw.state.keys() == ru.state.keys(), diff
    assert same(rw.opt_state, ru.opt_state), "optimizer state differs"


def judge(r):
    if r.warns:
        raise WrongAnswer(" | ".join(r.warns))
    reps = (r.w.report(), ampdoctor.diagnose(r.rd))
    if DEBUG:
        for f in reps[0].findings:
            print("  ", f.one_line(), f.evidence if f.severity != "info" else "")
    bad = list(dict.fromkeys(x for rep in reps for x in alarms(rep.findings)))
    if bad:
        raise WrongAnswer(" | ".join(bad))
    for rep in reps:
        quiet_report(rep)
        summary = rep.to_dict()["summary"]
        assert rep.exit_code == 0 and not summary.get("internal_error"), summary
        assert summary["steps"] == r.c.steps(), (summary["steps"], r.c.steps(), lines(rep))


def fall_by(margin):
    """For a loss that may be negative: the last fifth's mean below the first fifth's by `margin`."""
    def check(r):
        ls = r.losses
        k = max(3, len(ls) // 5)
        assert sum(ls[-k:]) / k < sum(ls[:k]) / k - margin, (sum(ls[:k]) / k, sum(ls[-k:]) / k)
    return check
