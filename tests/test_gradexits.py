"""Where a module's gradient leaves towards its inputs (ampdoctor/record/gradexits.py): walking the autograd nodes its
forward made. With `Regions` a finished submodule's walk is reused by the enclosing module's; that must find
exactly the exits the full walk finds, on real nested models."""
from __future__ import annotations

import torch
import torch.nn as nn

from ampdoctor.record.gradexits import Regions, gradient_exits, sequence_nr
from ampdoctor.tensors import flatten_tensors


def _tensors(x):
    return [t for t in flatten_tensors(x, []) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _exits_both_ways(model, *args, **kwargs):
    pending, full, fast = {}, [], []
    regions = Regions()

    def pre(mod, a, kw):
        ins = [t for t in _tensors((a, kw)) if t.requires_grad]
        pending.setdefault(id(mod), []).append((ins, sequence_nr()))

    def post(mod, a, kw, out):
        ins, seq0 = pending[id(mod)].pop()
        if not ins:
            return
        outs = _tensors(out)
        full.append(sorted((id(n), tuple(sorted(i))) for n, i in gradient_exits(outs, ins, seq0)))
        fast.append(sorted((id(n), tuple(sorted(i))) for n, i in gradient_exits(outs, ins, seq0, regions)))
    hs = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    hs += [m.register_forward_hook(post, with_kwargs=True) for m in model.modules()]
    try:
        out = model(*args, **kwargs)
    finally:
        for h in hs:
            h.remove()
    return full, fast, out


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.inner = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, x, bias):
        h = self.a(x) + bias            # an input used by this module's own op and by a child
        return x + self.inner(h) * self.b(bias) + self.inner(x)   # a child called twice


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        b = self.bias * 2
        for blk in self.blocks:
            x = blk(x, b)               # one tensor shared by every block (T5's position bias)
        return x


def test_reused_regions_find_the_same_exits_as_full_walks():
    full, fast, out = _exits_both_ways(Net(), torch.randn(4, 8, requires_grad=True))
    assert len(full) > 10 and full == fast
    out.sum().backward()


def test_same_exits_on_a_hugging_face_t5():
    from test_identity import _t5  # the tiny T5 of the bitwise-identity tests
    model, batch, _ = _t5()
    full, fast, out = _exits_both_ways(model, **batch(0))
    assert len(full) > 20 and full == fast
