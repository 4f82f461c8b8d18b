"""An iteration that has not reached its optimizer step when the report is taken or the watch closes.

- `w.report()` inside an iteration (between the backward and the step) leaves that iteration to finish: the step
  numbers stay one per optimizer step (before: the report finished the open step, and the iteration became two
  records, every later step numbered one too high);
- a loop that stops after the backward of a healthy iteration did not train in it: no step is counted for it;
- but a loop that stops because that iteration went bad (a non-finite loss, or non-finite gradients the loop
  checked itself) has its failure recorded, at that step."""
import math

import pytest
import torch
import torch.nn as nn

import ampdoctor
from scenarios import lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def _setup():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return m, opt, sc


def _forward(m, i, bad=False):
    x = randn(4, 8, seed=i)
    if bad:
        x = x * float("inf")
    with torch.autocast("cpu", dtype=torch.float16):
        return m(x).float().pow(2).mean()


def test_a_report_inside_an_iteration_keeps_one_step_per_optimizer_step():
    m, opt, sc = _setup()
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    for i in range(12):
        opt.zero_grad()
        sc.scale(_forward(m, i)).backward()
        if i == 5:
            mid = w.report(replay=False)
            assert mid.summary["steps"] == 5, mid.summary
        sc.step(opt)
        sc.update()
    rep = w.report(replay=False)
    w.close()
    assert [r.step for r in w.steps] == list(range(12))
    assert rep.summary["steps"] == 12, rep.summary
    assert w.steps[5].loss is not None and w.steps[6].loss is not None


def test_a_loop_that_stops_after_a_healthy_backward_counts_no_step_for_it():
    m, opt, sc = _setup()
    with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w:
        for i in range(10):
            opt.zero_grad()
            sc.scale(_forward(m, i)).backward()
            if i == 9:
                break  # (time is up)
            sc.step(opt)
            sc.update()
    assert len(w.steps) == 9


@pytest.mark.parametrize("how", ["nan_loss", "nan_grads"])
def test_a_loop_that_stops_on_a_bad_iteration_keeps_it(how):
    m, opt, sc = _setup()
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    for i in range(10):
        opt.zero_grad()
        loss = _forward(m, i, bad=how == "nan_loss" and i == 7)
        if not math.isfinite(loss.item()):
            break
        sc.scale(loss).backward()
        if how == "nan_grads" and i == 7:
            with torch.no_grad():
                m[0].weight.grad[0, 0] = float("nan")
            break
        sc.step(opt)
        sc.update()
    rep = w.report(replay=False)
    w.close()
    assert len(w.steps) == 8 and w.steps[-1].step == 7 and w.steps[-1].bad, [(r.step, r.bad) for r in w.steps]
    last = w.steps[-1]
    assert last.grad_finite is False if how == "nan_grads" else False in (last.loss_finite, last.output_finite)
    if how == "nan_loss":
        assert any(f.step == 7 and f.severity == "error" for f in rep.findings), lines(rep)
