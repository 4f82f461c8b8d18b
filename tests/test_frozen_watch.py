"""A watch on a model that does not train (a distillation teacher, a perceptual-loss network): no optimizer or
scaler given, every parameter frozen. It has no optimizer step of its own, so its steps end with the other models'
(record/optsink.py `_foreign_step`): an optimizer step, or a step of a GradScaler no watch holds, skipped ones
included. Before, every iteration landed in step 0, and a teacher's forward under no_grad was no step at all.

Real torch: CPU fp16 autocast, torch.amp.GradScaler("cpu"), one thread, fixed seeds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, in_top3

FP16 = torch.float16


def mlp(*dims, gain=1.0):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    m = torch.nn.Sequential(*layers[:-1])
    with torch.no_grad():
        m[-1].weight.mul_(gain)
    return m


def batch(i, fault_at=None):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(16, 8, generator=g)
    return x * 10000.0 if i == fault_at else x


def distill(iters, fault_at=None, gain=1.0, init_scale=2.0 ** 20):
    """Only the frozen fp16 teacher is watched; the student trains unwatched with its own GradScaler (whose
    opening search skips steps, as does the fault)."""
    torch.manual_seed(0)
    teacher = mlp(8, 64, 64, 4, gain=gain).half().eval().requires_grad_(False)
    student = mlp(8, 32, 4)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    w = ampdoctor.watch(teacher)
    skipped = []
    for i in range(iters):
        x = batch(i, fault_at)
        with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
            t = teacher(x) / gain
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.mse_loss(student(x).float(), t.float())
        before = sc.get_scale()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < before:
            skipped.append(i)
    w.close()
    return w, skipped


def test_teacher_alone_watched_fault_named_at_its_iteration():
    torch.set_num_threads(1)
    w, skipped = distill(11, fault_at=8, gain=100.0)
    assert 8 in skipped and skipped[0] == 0, skipped  # the student's scaler skips the opening steps and the fault
    assert [r.step for r in w.machine.records] == list(range(11))  # one step per iteration, skipped ones too
    rep = w.report()
    assert in_top3(rep, ("overflow",), "4"), [f.one_line() for f in rep.findings]
    first = rep.findings[0]
    assert (first.rule, first.module, first.step, first.severity) == ("overflow", "4", 8, "error"), first.one_line()


def test_teacher_alone_watched_healthy_quiet_one_step_per_iteration():
    torch.set_num_threads(1)
    w, skipped = distill(12)
    assert skipped and max(skipped) < 6, skipped
    assert [r.step for r in w.machine.records] == list(range(12))
    assert not alarms(w.report().findings), [f.one_line() for f in w.report().findings]


def test_perceptual_network_under_grad_counts_the_generators_steps():
    """A frozen feature network in the loss, called on the fake and on the real images each iteration (the
    gradient flows through it into the generator): its steps are the generator's, not one per call."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    feat = mlp(8, 32, 16).requires_grad_(False)
    gen = mlp(4, 32, 8)
    opt = torch.optim.Adam(gen.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    w = ampdoctor.watch(feat)
    wg = ampdoctor.watch(gen, optimizer=opt, scaler=sc)
    for i in range(10):
        z, real = torch.randn(16, 4), batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = gen(z)
            loss = F.mse_loss(feat(fake).float(), feat(real).float())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    w.close()
    wg.close()
    assert [r.step for r in w.machine.records] == list(range(10))
    assert [r.step for r in wg.machine.records] == list(range(10))
    assert not alarms(w.report().findings) and not alarms(wg.report().findings)


def test_a_trained_model_watched_without_optimizer_is_not_frozen():
    """No optimizer or scaler given, but the model trains: its own optimizer's steps (torch's global hook) end its
    steps, as before; a second model's optimizer does not."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    a, b = mlp(8, 16, 1), mlp(8, 16, 1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=1e-2), torch.optim.SGD(b.parameters(), lr=1e-2)
    w = ampdoctor.watch(a)
    for i in range(6):
        x = batch(i)
        for m, o in ((a, oa), (b, ob), (b, ob)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    w.close()
    assert [r.step for r in w.machine.records] == list(range(6))
    assert not alarms(w.report().findings)
