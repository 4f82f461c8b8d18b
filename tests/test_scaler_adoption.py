"""A GradScaler the loop uses but `watch` was not given is found at its first unscale_/step on the watched model's
optimizer (record/monitor.ScalerFinder) and watched from then on; a scaler made anew each epoch is adopted anew.
Before, every step the unwatched scaler skipped merged into one open step (32 iterations recorded as one)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.amp.grad_scaler import GradScaler

import ampdoctor


def _loop(w, m, opt, steps, scaler_of, bad=()):
    for i in range(steps):
        sc = scaler_of(i)
        opt.zero_grad()
        x = torch.randn(16, 8) * (1e5 if i in bad else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), x[:, :1].float())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        sc.step(opt)
        sc.update()


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return m, torch.optim.SGD(m.parameters(), lr=1e-3)


def test_an_unwatched_scaler_is_adopted_and_its_skips_are_steps_of_their_own():
    m, opt = _model()
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(m, optimizer=opt)
    _loop(w, m, opt, 8, lambda i: sc, bad=(3, 4))
    w.close()
    steps = list(w.steps)
    assert [r.step for r in steps] == list(range(8)), [(r.step, r.skipped) for r in steps]
    assert [r.step for r in steps if r.skipped] == [3, 4]
    assert w.scaler is sc and w.meta.scaler["init_scale"] == 256.0
    assert steps[5].scale == 64.0  # two backoffs
    rep = w.report()
    assert any(f.rule == "overflow" and f.module == "0" and f.step == 3 for f in rep.findings[:3]), \
        [f.one_line() for f in rep.findings]
    assert GradScaler.step is GradScaler.__dict__["step"] and not hasattr(GradScaler.step, "__wrapped__")


def test_a_scaler_made_anew_each_epoch_is_adopted_anew():
    m, opt = _model()
    w = ampdoctor.watch(m, optimizer=opt)
    scalers = [torch.amp.GradScaler("cpu", init_scale=128.0) for _ in range(3)]
    _loop(w, m, opt, 9, lambda i: scalers[i // 3])
    w.close()
    assert len(w.steps) == 9 and w.scaler is scalers[-1]
    assert all(r.scale == 128.0 for r in w.steps), [r.scale for r in w.steps]


def test_a_given_scaler_is_kept_and_a_scaler_of_another_model_is_left_alone():
    m, opt = _model()
    other, oopt = _model()
    sc, osc = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    _loop(w, other, oopt, 2, lambda i: osc)  # a second training in the same process, not watched
    w.close()
    assert w.scaler is sc and not hasattr(type(osc).step, "__wrapped__")
    w2 = ampdoctor.watch(m, optimizer=opt)
    _loop(w2, other, oopt, 2, lambda i: osc)
    assert w2.scaler is None  # its optimizer holds none of the watched model's parameters
    w2.close()
