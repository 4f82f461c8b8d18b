"""Watching breaks nothing (issue 12): arguments reach the module as the caller passed them, TorchScript
submodules, copies of a watched model, modules that return their own Parameter, a run that dies on an exception,
and nanoGPT's zero_grad after scaler.update()."""
from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _loop(model, steps=3, every=1, run_dir=None, zero_grad_after=False, headroom=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, every=every, run_dir=run_dir, headroom=headroom)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        if not zero_grad_after:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8, generator=g)).float().pow(2).mean()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        if zero_grad_after:
            opt.zero_grad(set_to_none=True)
    return w


class Appender(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, feats):
        feats.append(x * 2)
        return self.fc(x)


class UsesFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Appender()

    def forward(self, x):
        feats = []
        y = self.a(x, feats)
        return y + feats[0]


@pytest.mark.parametrize("every", [1, 200])
def test_a_list_argument_the_module_appends_to_is_the_callers(every):
    w = _loop(UsesFeatures(), every=every)  # IndexError under the old argument rebuilding
    w.close()
    assert len(w.steps) == 3 and all(r.loss_finite for r in w.steps)


class Keeps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.kept = None

    def forward(self, x, p):
        assert isinstance(p, nn.Parameter), type(p)
        self.kept = x
        return self.fc(x) * p


class PassesParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = Keeps()

    def forward(self, x):
        out = self.k(x, self.k.scale)
        assert self.k.kept is x  # the module saw the caller's own tensor
        return out


def test_arguments_keep_their_identity_and_type():
    w = _loop(PassesParam(), every=1)
    w.close()
    assert len(w.steps) == 3


class WithScript(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.scripted(self.fc1(x)))


def test_torchscript_submodules_are_left_unwatched():
    m = WithScript()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = _loop(m, every=1)
        w.close()
    # (the module-state probe once read a ScriptModule's parameter wrapper with .get: the watch disabled itself)
    assert not [str(x.message) for x in seen if "ampdoctor disabled itself" in str(x.message)]
    assert not w.machine.disabled
    mods = {c.module for c in w.steps[0].modules}
    assert {"fc1", "fc2"} <= mods and "scripted" not in mods
    assert all(not x._forward_hooks and not x._forward_pre_hooks for x in m.modules()
               if not isinstance(x, torch.jit.ScriptModule))


def test_a_scripted_root_is_refused_and_leaves_nothing():
    m = torch.jit.script(nn.Sequential(nn.Linear(8, 8)))
    for _ in range(2):
        with pytest.raises(ampdoctor.WatchError, match="TorchScript"):
            ampdoctor.watch(m)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("every,headroom", [(1, False), (200, False), (200, True)])
def test_copies_of_a_watched_model_carry_nothing(tmp_path, every, headroom):
    """Module hooks, the always-on headroom's (HeadroomHook, PassHook on the ReLU) included, copy and pickle as
    inert hooks that remove themselves."""
    m = Net()
    w = _loop(m, steps=2, every=every, run_dir=tmp_path / "run", headroom=headroom)
    if headroom:
        assert m.act._forward_hooks and m.fc1._forward_hooks
    ema = copy.deepcopy(m)                  # EMA: the most common copy
    buf = io.BytesIO()
    torch.save(m, buf)                       # a whole-model checkpoint
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for c in (ema, loaded):
        c(torch.randn(2, 8))                 # the inert hooks remove themselves on first use
        assert all(not x._forward_hooks and not x._forward_pre_hooks for x in c.modules())
    w.close()
    assert all(not x._forward_hooks and not x._forward_pre_hooks for x in m.modules())
    assert len(w.steps) == 2


class PosEnc(nn.Module):
    def __init__(self):
        super().__init__()
        self.pe = nn.Parameter(torch.zeros(8))

    def forward(self):
        return self.pe


class UsesPE(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = PosEnc()
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc(x + self.pos())


def test_a_module_returning_its_parameter_leaves_no_tensor_hook():
    import gc
    import weakref
    m = UsesPE()
    w = _loop(m, steps=20, every=1)
    w.close()
    assert not m.pos.pe._backward_hooks
    ref = weakref.ref(w.machine)
    del w
    gc.collect()
    assert ref() is None


def test_zero_grad_after_update_opens_no_extra_step():
    w = _loop(Net(), steps=5, every=1, zero_grad_after=True)
    w.close()
    assert [r.step for r in w.steps] == [0, 1, 2, 3, 4]
    assert ampdoctor.diagnose  # the run dir variant is below
    assert w.report().summary["steps"] == 5


def test_a_run_that_dies_on_an_exception_is_recorded(tmp_path):
    run = tmp_path / "run"
    script = textwrap.dedent(f"""
        import torch, torch.nn as nn, ampdoctor
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
            def forward(self, x, step):
                y = self.fc(x)
                if step == 2:
                    y = y.masked_fill(torch.ones_like(y, dtype=torch.bool), -1e9)  # fp16: overflows, raises
                return y
        m = M()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sc = torch.amp.GradScaler("cpu")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir={str(run)!r})
        for step in range(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                y = m(torch.randn(4, 8), step)
                if step == 2:
                    raise RuntimeError("value cannot be converted to type at::Half without overflow")
                loss = y.float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "RuntimeError" in p.stderr
    rep = ampdoctor.diagnose(str(run))
    assert rep.summary["steps"] == 3
    assert not rep.summary["verdict"].startswith("Healthy")
    lines = [json.loads(ln) for ln in open(next(os.path.join(dp, f) for dp, _, fs in os.walk(run) for f in fs
                                                if f == "steps.jsonl")).read().strip().splitlines()]
    assert lines[-1] == {"run": 0, "end": True}  # closed at interpreter exit: the end line follows the last step
    last = lines[-2]
    assert last["step"] == 2 and last["exception"]["type"] == "RuntimeError"
    cli = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(run), "--no-html"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1, cli.stdout + cli.stderr


def test_watch_on_a_meta_device_model_then_materialised_trains_and_sees_its_buffers():
    """A model built on the meta device (FSDP2's deferred init) can be watched before `to_empty`: the buffer check
    reads nothing it cannot (it raised `Cannot copy out of meta tensor` from watch() itself); watching a
    materialised copy reads the BatchNorm's running statistics as usual."""
    with torch.device("meta"):
        lazy = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    w = ampdoctor.watch(lazy)
    w.close()
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = ampdoctor.watch(m, optimizer=opt)
    for i in range(3):
        opt.zero_grad()
        m(torch.randn(8, 4, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()
    w.close()
    assert w.machine.buffers.live, "the BatchNorm's running statistics are written: read every step"
    assert not [f for f in w.report().findings if f.severity in ("warning", "error")]


def test_sys_exit_is_stood_in_for_only_while_a_watch_is_open(tmp_path):
    """A non-zero sys.exit while watching is recorded on the open step; the stand-in goes away with the last watch
    and never swallows the exit."""
    orig = sys.exit
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w1 = ampdoctor.watch(m, optimizer=opt, run_dir=str(tmp_path / "r"))
    w2 = ampdoctor.watch(nn.Linear(2, 2))
    assert sys.exit is not orig
    opt.zero_grad()
    m(torch.randn(2, 4)).sum().backward()
    with pytest.raises(SystemExit) as e:
        sys.exit(3)
    assert e.value.code == 3
    w1.close()
    assert sys.exit is not orig  # w2 still open
    w2.close()
    assert sys.exit is orig
    last = [r for r in w1.steps][-1]
    assert last.exception["type"] == "SystemExit" and "sys.exit(3)" in last.exception["message"], last.exception
    assert last.exception["file"] == __file__
    rep = ampdoctor.diagnose(str(tmp_path / "r"))
    assert rep.summary["crash"]["type"] == "SystemExit" and rep.exit_code == 1
