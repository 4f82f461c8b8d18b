"""Always-on headroom (ampdoctor/record/headroom.py): every step, every module, forward and backward abs-max with inf/NaN,
batched and read with the step's one transfer; the series round-trips through the run dir and old run dirs
without it still load."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
from ampdoctor.records import StepRecord
from ampdoctor.rundir import read_run


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def _train(model, steps, every, x_of=None, run_dir=None, dtype=torch.float16, headroom=True):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    g = torch.Generator().manual_seed(0)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, every=every, run_dir=run_dir, headroom=headroom)
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g) if x_of is None else x_of(i, g)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(model(x).float(), torch.zeros(4, 4))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    return w


def test_every_step_every_module_on_the_default_watch():
    w = _train(Net(), 6, every=200)
    names = [m[0] for m in w.meta.modules]
    for r in w.steps:
        h = r.headroom
        assert h is not None and len(h["fwd"]) == len(h["bwd"]) == len(h["dtype"]) == len(names), r.step
        for i, n in enumerate(names):
            if n == "act":  # a ReLU passes its input's range on: its input, a's output, is what is read
                assert h["fwd"][i] is None and h["bwd"][i] is None, (r.step, h)
                continue
            assert h["fwd"][i] is not None and h["fwd"][i] > 0, (r.step, n)
            assert h["bwd"][i] is not None and h["bwd"][i] > 0, (r.step, n)
        assert h["dtype"][names.index("a")] == "h"  # an fp16 Linear output under autocast


def assert_same_series(full, fast):
    """Step by step after step 0, the sampled run (full statistics) and the routine one (always-on headroom)
    give the same series (also used by tests/test_fused.py on CUDA)."""
    for a, b in zip(list(full.steps)[1:], list(fast.steps)[1:]):
        assert a.sampled and not b.sampled
        for key in ("fwd", "bwd"):
            for x, y in zip(a.headroom[key], b.headroom[key]):
                assert x == y or math.isclose(x, y, rel_tol=1e-2), (key, a.headroom, b.headroom)
        assert a.headroom["dtype"] == b.headroom["dtype"]


def test_routine_steps_agree_with_the_full_statistics():
    """every=1 (full statistics) and the default (always-on) see the same abs-max on the same step."""
    torch.manual_seed(0)
    m1 = Net()
    m2 = Net()
    m2.load_state_dict(m1.state_dict())
    full = _train(m1, 4, every=1)
    fast = _train(m2, 4, every=200)
    assert_same_series(full, fast)


def test_non_finite_values_show_through():
    def x_of(i, g):
        x = torch.randn(4, 8, generator=g)
        if i == 2:
            x[0, 0] = math.inf
        return x
    w = _train(Net(), 4, every=200, x_of=x_of)
    r = list(w.steps)[2]
    assert not r.sampled
    i = [m[0] for m in w.meta.modules].index("a")
    v = r.headroom["fwd"][i]
    assert not math.isfinite(v)


def test_series_round_trips_and_old_run_dirs_load(tmp_path):
    w = _train(Net(), 3, every=200, run_dir=tmp_path / "run")
    meta, steps = read_run(str(tmp_path / "run"))
    assert [s.headroom for s in steps] == [s.headroom for s in w.steps]
    d = steps[1].to_dict()
    d.pop("headroom")
    assert StepRecord.from_dict(d).headroom is None  # a run dir written before the field existed
    assert len(json.dumps(steps[1].headroom)) < 40 * len(meta.modules)  # compact


def test_hooks_removed_on_close():
    model = Net()
    w = _train(model, 2, every=200)
    assert w.closed
    for mod in model.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks


class _Writer:
    """A SummaryWriter-like recorder (the sink's documented `writer=` interface)."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.append((tag, value, global_step))


def test_tensorboard_headroom_bits_every_step():
    wr = _Writer()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, writer=wr, headroom=True)
    for _ in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    steps = sorted({s for tag, _, s in wr.scalars if tag == "headroom_bits/a"})
    assert steps == [0, 1, 2, 3]
    v = next(v for tag, v, s in wr.scalars if tag == "headroom_bits/a" and s == 2)
    assert 5 < v < 20


@pytest.mark.stride_own
def test_headroom_false_keeps_routine_steps_bare_and_auto_alternates_while_it_measures():
    """headroom=False: no headroom hooks below the root, routine steps carry no series. The default ("auto"):
    the first routine step carries it (observed: every hook on), then steps with and without it alternate
    until both have been timed a few times (ampdoctor/record/budget.py)."""
    model = Net()
    w = _train(model, 4, None, headroom=False)
    assert not any(hasattr(h, "hr") for m in model.modules() for h in m._forward_hooks.values())
    assert [r.headroom is not None for r in w.steps] == [True, False, False, False]  # step 0 is sampled
    w = _train(Net(), 8, None, headroom=None)
    assert w.config.headroom == "auto"
    assert [r.headroom is not None for r in w.steps] == [True, True, False, True, False, True, False, True]


def test_nothing_forward_is_held_into_the_backward():
    """A forward output that nothing else keeps (the fp16 logits, upcast for the loss) is not kept alive by the
    watch into the backward, where the memory peak is (H200: +778 MiB on GPT-2 until this was fixed)."""
    import gc
    import weakref
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    seen = []
    model.b.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, headroom=True)
    alive = []
    for i in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(torch.randn(4, 8)).float(), torch.zeros(4, 4))
        gc.collect()
        alive.append(seen[-1]() is not None)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    assert alive[1:] == [False, False]  # step 0 is sampled (full statistics); 1 and 2 are routine


def test_modules_that_pass_their_input_on_are_not_read():
    from ampdoctor.record.hooks import passes_on
    assert passes_on(nn.ReLU()) and passes_on(nn.GELU()) and passes_on(nn.Dropout(0.1)) and passes_on(nn.Identity())
    assert not passes_on(nn.Linear(2, 2)) and not passes_on(nn.LayerNorm(2)) and not passes_on(nn.PReLU())
    assert not passes_on(nn.MultiheadAttention(4, 2)) and not passes_on(nn.Sequential(nn.ReLU()))


def test_a_container_ending_in_an_activation_is_its_layers_value():
    """Sequential(Linear, ReLU): the container returns the ReLU's output, which is not read (it passes the
    Linear's range on); the container's value is the Linear's, with no second read of the same layer."""
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(self.blk(x))
    w = _train(Outer(), 4, every=200)
    names = [m[0] for m in w.meta.modules]
    for r in list(w.steps)[1:]:
        h = r.headroom
        assert h["fwd"][names.index("blk")] == h["fwd"][names.index("blk.0")], h
        assert h["fwd"][names.index("blk.1")] is None


def test_a_value_over_read_bytes_is_read_in_its_leading_rows(monkeypatch):
    """A value larger than READ_BYTES (a language model's logits) is read in its leading whole rows on routine
    steps; the sampled step (full statistics) reads all of it. Rows 0..1 of the batch hold ~0.5, the last
    row ~50: the routine series shows the leading rows' range, the sampled one the whole."""
    from ampdoctor.record import headroom
    monkeypatch.setattr(headroom, "READ_BYTES", 2 * 4 * 2)  # two rows of four fp16 values

    class Out(nn.Module):
        def forward(self, x):
            return x * 1.0

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4)
            self.out = Out()

        def forward(self, x):
            h = self.a(x)
            base = torch.full_like(h, 0.5)
            base[3] = 50.0
            return self.out(h * 0.001 + base)

    w = _train(M(), 4, every=200)
    i = [m[0] for m in w.meta.modules].index("out")
    steps = list(w.steps)
    assert math.isclose(steps[0].headroom["fwd"][i], 50.0, rel_tol=1e-2)       # sampled: every row
    for r in steps[1:]:
        assert not r.sampled and r.headroom["fwd"][i] < 10.0, r.headroom     # routine: the first two rows
