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
    pending, full, fast, keep = {}, [], [], []
    regions = Regions()

    def pre(mod, a, kw):
        ins = [t for t in _tensors((a, kw)) if t.requires_grad]
        pending.setdefault(id(mod), []).append((ins, sequence_nr()))

    def post(mod, a, kw, out):
        ins, seq0 = pending[id(mod)].pop()
        if not ins:
            return
        outs = _tensors(out)
        a, b = gradient_exits(outs, ins, seq0), gradient_exits(outs, ins, seq0, regions)
        keep.append((a, b))  # a node's Python object (and its id) lives only while held on torch 2.11
        full.append(sorted((id(n), tuple(sorted(i))) for n, i in a))
        fast.append(sorted((id(n), tuple(sorted(i))) for n, i in b))
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


# -- a torch without `_get_sequence_nr` (the fallback: a probe node) ------------------------------------------------
def test_probe_gives_the_number_the_next_node_takes():
    """probe_sequence_nr (the fallback) says what torch's own counter says: the number of the next node."""
    from ampdoctor.record.gradexits import _native_sequence_nr, probe_sequence_nr
    x = torch.randn(3, requires_grad=True)
    n = probe_sequence_nr()
    y = x * 2
    assert y.grad_fn._sequence_nr() == n
    if _native_sequence_nr is not None:
        assert probe_sequence_nr() == _native_sequence_nr()


def test_exits_found_with_the_probe_are_the_native_ones(monkeypatch):
    """The walk bounded by the probe's numbers finds the same exits, on the nested model and on T5."""
    import test_gradexits as me
    from ampdoctor.record.gradexits import probe_sequence_nr
    for model, args, kw in ((Net(), (torch.randn(4, 8, requires_grad=True),), {}), _t5_args()):
        torch.manual_seed(0)
        native, _, _ = _exits_both_ways(model, *args, **kw)
        monkeypatch.setattr(me, "sequence_nr", probe_sequence_nr)
        probed, _, _ = _exits_both_ways(model, *args, **kw)
        monkeypatch.setattr(me, "sequence_nr", sequence_nr)
        idx = lambda calls: [sorted(i for _, i in c) for c in calls]  # noqa: E731
        assert len(native) > 10 and idx(native) == idx(probed)


def _t5_args():
    from test_identity import _t5
    model, batch, _ = _t5()
    return model, (), batch(0)


def test_backward_overflow_found_and_gradients_unchanged_without_native_counter(monkeypatch, tmp_path):
    """With torch's counter gone, a module whose backward overflows (x.pow(4): finite forward,
    its gradient 4x³·g past 65504) is still named in the backward, from its own gradient towards its input; the
    watched run's gradients stay bitwise those of the unwatched one."""
    import ampdoctor
    import ampdoctor.record.modulehooks as step
    from ampdoctor.record.gradexits import probe_sequence_nr
    from test_unseen_variants3 import PowNet  # quart(h) = (h * gain) ** 4 after a tanh
    monkeypatch.setattr(step, "sequence_nr", probe_sequence_nr)

    def run(watch):
        torch.manual_seed(0)
        m = PowNet()
        m.quart.gain = 12.0
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)) * 3
        opt = torch.optim.SGD(m.parameters(), lr=1e-6)
        sc = torch.amp.GradScaler("cpu")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "r", every=1) if watch else None
        grads = []
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().mean()
            sc.scale(loss).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            sc.step(opt)
            sc.update()
        if w:
            w.close()
        return w, grads
    w, watched = run(True)
    _, plain = run(False)
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())
               for ga, gb in zip(watched, plain) for a, b in zip(ga, gb))
    quart = next(c for c in w.steps[0].modules if c.module == "quart")
    assert quart.gin is not None and quart.gin.posinf + quart.gin.neginf > 0
    f = next(f for f in w.report().findings if f.rule == "overflow")
    assert (f.module, f.phase, f.step) == ("quart", "backward", 0), f.one_line()


# -- modules that work in place (torchvision's ResNet: ReLU(inplace=True), `out += identity`) ------------------------
class InplaceBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc, self.relu = nn.Linear(d, d), nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.fc(x)
        out += x                       # in place, as torchvision's BasicBlock
        return self.relu(out)          # in place: the output is the input tensor, with a new grad_fn


class InplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0, self.relu = nn.Linear(4, 8), nn.ReLU(inplace=True)
        self.block, self.head = InplaceBlock(), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.block(self.relu(self.fc0(x))))


def test_in_place_modules_have_their_input_gradient(tmp_path):
    """An in-place ReLU has rewritten its input's grad_fn by the time it returns: matched against that, neither it
    nor any module around it (the block, the whole ResNet) had a gradient towards its input. Every module call
    whose input needs a gradient has one now, and the ReLU's is the gradient at fc0's output (a tensor hook on
    the unwatched twin gives the truth)."""
    import ampdoctor
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))

    def run(watch):
        torch.manual_seed(0)
        m = InplaceNet()
        w = ampdoctor.watch(m, run_dir=tmp_path / f"r{watch}", every=1) if watch else None
        seen = {}
        if not watch:
            def grab(mod, i, o):
                o.register_hook(lambda g: seen.setdefault("g", g.clone()))
            m.fc0.register_forward_hook(grab)
        m(x).pow(2).mean().backward()
        if w:
            w.close()
        return w, seen.get("g"), [p.grad for p in m.parameters()]
    w, _, watched = run(True)
    _, truth, plain = run(False)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    calls = {c.module: c for c in w.steps[0].modules}
    missing = [n for n, c in calls.items() if n not in ("", "fc0") and c.gin is None]
    assert not missing, missing
    assert calls["relu"].gin.absmax == truth.abs().max().item()
