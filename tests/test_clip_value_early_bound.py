"""A `clip_grad_value_` the script bound before the watch began (`from torch.nn.utils import clip_grad_value_` at its
top) is still one of the step's calls: record/clippatch.py's ClipPatch sees it where torch's clip_grad_value_ groups
the gradients it is about to clamp (clip_grad_value_ has no inner clipping function, as clip_grad_norm_ has).

- before unscale_ (the scaled gradients clamped: every update ~1/scale too small): clip_before_unscale, error,
  step 0, at the clip's own line (test_loop_misuse_unseen's U8 was a strict xfail for this: an empty report);
- after unscale_ (the AMP recipe's order): one clip_grad_value_ event per step, in order, no finding at all, and
  the losses and weights bitwise those of the unwatched loop;
- no double count through the module attribute (`torch.nn.utils.clip_grad_value_`, wrapped itself), and torch's
  own function is back in place once the watch closes.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.utils.clip_grad as C
from torch.nn.utils import clip_grad_value_

import ampdoctor
from scenarios import alarms

STEPS = 6


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def _run(order, watched, clip=clip_grad_value_):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc) if watched else None
    losses, line = [], None
    for i in range(STEPS):
        x, y = _batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        if order == "before":
            line = inspect.currentframe().f_lineno + 1
            clip(m.parameters(), 0.1)
            sc.unscale_(opt)
        else:
            sc.unscale_(opt)
            line = inspect.currentframe().f_lineno + 1
            clip(m.parameters(), 0.1)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    if w is None:
        return losses, m, None, None, line
    w.close()
    return losses, m, w, w.report(), line


def test_early_bound_clip_value_before_unscale_is_named_at_its_line():
    _, _, w, rep, line = _run("before", watched=True)
    top = rep.findings[:3]
    hit = [f for f in top if f.rule == "clip_before_unscale" and f.severity == "error" and f.step == 0]
    assert hit, [f.one_line() for f in rep.findings]
    ev = hit[0].evidence
    assert ev.get("line") == line and str(ev.get("file")).endswith("test_clip_value_early_bound.py"), ev


def test_early_bound_clip_value_after_unscale_is_recorded_and_quiet_and_changes_nothing():
    ref_losses, ref_m, _, _, _ = _run("after", watched=False)
    losses, m, w, rep, line = _run("after", watched=True)
    assert losses == ref_losses
    for (n, a), b in zip(m.named_parameters(), ref_m.parameters()):
        assert torch.equal(a, b), n
    assert not alarms(rep.findings), [f.one_line() for f in rep.findings]
    seen = [r for r in w.steps if r.events]  # (a routine step repeating the last one's calls keeps none)
    assert seen and seen[0].step == 0
    for r in seen:
        kinds = [e.kind for e in r.events]
        assert kinds.count("clip_grad_value_") == 1, (r.step, kinds)
        assert kinds.index("unscale_") < kinds.index("clip_grad_value_") < kinds.index("step"), (r.step, kinds)
        ev = next(e for e in r.events if e.kind == "clip_grad_value_")
        assert ev.line == line, (ev.file, ev.line)


def test_module_attribute_clip_value_is_counted_once_and_torch_is_restored():
    orig = C._group_tensors_by_device_and_dtype
    _, _, w, rep, _ = _run("before", watched=True, clip=lambda ps, v: torch.nn.utils.clip_grad_value_(ps, v))
    assert C._group_tensors_by_device_and_dtype is orig
    assert [e.kind for e in w.steps[0].events].count("clip_grad_value_") == 1
    assert any(f.rule == "clip_before_unscale" and f.step == 0 for f in rep.findings[:3])
