"""The module state a forward reads besides its arguments (record/modstate.py), kept with each batch and set by
the replay: which state a watch finds (a counter, a memory that starts as None, a buffer written in place; not a
BatchNorm's running statistics, not a cache built once on the first forward, not an output kept as an attribute
(an aux loss in the autograd graph), not a buffer over the snapshot
budget), a weight the forward writes itself (through `.data`: found by its norm), what a capture holds of it (the
values the captured forward found; such a weight in the capture's weights), that a replay from disk names the
producer with it and leaves the live model's state as it was, and that a capture's state entries are data: an
entry ampdoctor does not write, or a number that is no number, is refused in one line (exit 2), and one naming an
attribute of another kind is not set.

A real CPU fp16 autocast + torch.amp.GradScaler("cpu") loop; the model cycles three heads by a counter, carries a
memory between steps, normalises by a lagging running mean it updates after reading it; at the bad step (head 2,
which only the counter picks) the extra input arrives in the wrong unit (finite in fp32, past 65504 after `extra`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import ampdoctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Stateful(nn.Module):
    def __init__(self, big_buffer: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.calls = 0            # picks the head (a number attribute)
        self.mem = None           # a memory carried across steps (a tensor attribute that starts as None)
        self.cache = None         # built on the first forward only (not state)
        self.register_buffer("mean", torch.zeros(8))   # lagging normaliser: read, then updated in place
        if big_buffer:
            self.register_buffer("bank", torch.zeros(3 << 20))  # 12 MiB, written every forward: over the budget
        self.big = big_buffer
        self.bn = nn.BatchNorm1d(8)
        self.inp = nn.Linear(8, 16)
        self.heads = nn.ModuleList([nn.Linear(16, 4) for _ in range(3)])
        self.extra = nn.Linear(1, 16)  # the head-2 branch's extra input (the producer at BAD_STEP)

    def forward(self, x, e):
        if self.cache is None:
            self.cache = torch.arange(16.0)
        h = self.inp(self.bn(x - self.mean))
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.float().mean(0))
            if self.big:
                self.bank.add_(1.0)
        head = self.calls % 3
        self.calls += 1
        if head == 2:
            h = h + self.extra(e)
        m = h.float().mean(0, keepdim=True).detach()
        self.mem = m if self.mem is None else (0.5 * self.mem + 0.5 * m)
        self.aux = h.float().pow(2).mean()  # an output kept as an attribute (in the graph): not state
        return self.heads[head](h + self.mem.to(h.dtype)).float()


def batch(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 8, generator=g)
    return x, torch.rand(16, 1, generator=g)


def train(model, steps, run_dir=None, bad_step=None, big=False):
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=run_dir) if run_dir is not None else None
    losses = []
    for i in range(steps):
        x, e = batch(i)
        if i == bad_step:
            e = e * 1e5  # the sensor in the wrong unit: finite in fp32, past fp16's max after `extra`
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, e).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return w, losses


def head2_step():
    """The first step after the probed ones whose forward takes head 2 (counter % 3 == 2)."""
    return next(s for s in range(4, 20) if s % 3 == 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("modstate")
    bad = head2_step()
    model = Stateful()
    w, losses = train(model, bad + 3, run_dir=d / "run", bad_step=bad)
    w.close()
    return d, bad, model, w, losses


def test_the_failure_is_real_and_only_the_counter_exposes_it():
    bad = head2_step()
    _, losses = train(Stateful(), bad + 1, bad_step=bad)
    assert not torch.isfinite(torch.tensor(losses[bad]))
    assert all(torch.isfinite(torch.tensor(losses[:bad])))
    # the same input on a step whose counter picks another head stays finite
    _, losses = train(Stateful(), bad + 2, bad_step=bad + 1)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_capture_holds_the_state_the_forward_found(run):
    d, bad, _, _, _ = run
    cap = d / "run" / "captures" / str(bad)
    man = json.loads((cap / "manifest.json").read_text())
    assert set(man["state"]) == {"num:calls", "tensor:mem", "buf:mean"}, man["state"]
    from ampdoctor.capture import load_capture
    c = load_capture(cap)
    assert c.rng["num:calls"].item() == bad  # the counter before the bad step's forward (one forward a step)
    # the memory and the running mean as the bad step's forward found them: rebuilt by an unwatched run
    twin = Stateful()
    train(twin, bad, bad_step=None)
    assert torch.equal(c.rng["tensor:mem"], twin.mem)
    assert torch.equal(c.rng["buf:mean"], twin.mean)
    assert not any(k.startswith("buf:bn.") for k in man["state"])   # BatchNorm's running statistics: not state
    assert "tensor:cache" not in man["state"]                           # built once, on step 0
    assert "tensor:aux" not in man["state"]                             # an output in the graph, not state


def test_report_names_the_producer_at_the_bad_step(run):
    _, bad, _, w, _ = run
    top = w.report().findings[:3]
    assert any(f.rule == "overflow" and f.module == "extra" and f.step == bad and f.severity == "error"
               for f in top), [(f.rule, f.module, f.step) for f in top]


def test_replay_from_disk_sets_the_state_and_gives_the_live_model_its_own_back(run):
    d, bad, model, _, _ = run
    calls, mem, mean = model.calls, model.mem.clone(), model.mean.clone()
    rep = ampdoctor.replay(str(d / "run" / "captures" / str(bad)), model=model)
    top = rep.findings[:3]
    assert any(f.rule == "overflow" and f.module == "extra" for f in top), [(f.rule, f.module) for f in top]
    assert model.calls == calls and torch.equal(model.mem, mem) and torch.equal(model.mean, mean)


def _tamper(src, dst, edit):
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    t = load_file(str(dst / "tensors.safetensors"))
    edit(t)
    save_file(t, str(dst / "tensors.safetensors"))
    man = json.loads((dst / "manifest.json").read_text())
    man["files"]["tensors"]["bytes"] = os.path.getsize(dst / "tensors.safetensors")
    man["files"]["tensors"]["sha256"] = None
    (dst / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.__setitem__("state/call:os.system", torch.zeros(1)), "not one ampdoctor writes"),
    (lambda t: t.__setitem__("state/num:calls", torch.zeros(3)), "is not a number"),
    (lambda t: t.__setitem__("state/list:calls", torch.zeros(2, 2)), "is not a list of numbers"),
], ids=["foreign-entry", "num-not-a-number", "list-not-numbers"])
def test_a_foreign_state_entry_is_one_line_and_exit_2(run, tmp_path, edit, says):
    d, bad, _, _, _ = run
    cap = tmp_path / "cap"
    _tamper(d / "run" / "captures" / str(bad), cap, edit)
    before = {p.name: p.read_bytes() for p in cap.iterdir()}
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "replay", str(cap)], cwd=ROOT, capture_output=True,
                       text=True, timeout=240)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("ampdoctor:")]
    assert p.returncode == 2 and len(lines) == 1 and says in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert {q.name: q.read_bytes() for q in cap.iterdir()} == before


def test_a_state_entry_naming_another_kind_of_attribute_is_not_set(run, tmp_path):
    """A capture's "num:" entry for an attribute the live model holds as a method or a string, a "tensor:" entry
    for a Parameter, a "buf:" entry for a name that is no buffer: each left as it is."""
    from ampdoctor.replay.modelio import preserved, set_rng
    model = Stateful()
    model.label = "head"
    before = (model.forward, model.label, model.inp.weight.detach().clone())
    rng = {"num:forward": torch.tensor(3), "num:label": torch.tensor(1.5), "tensor:inp.weight": torch.zeros(16, 8),
           "buf:inp.bias": torch.zeros(16), "num:nowhere.calls": torch.tensor(1), "num:calls": torch.tensor(5)}
    with preserved(model):
        set_rng(rng, model)
        assert model.calls == 5 and type(model.calls) is int
        assert model.forward == before[0] and model.label == "head"
        assert torch.equal(model.inp.weight, before[2]) and isinstance(model.inp.weight, nn.Parameter)
        assert "bias" not in model.inp._buffers
    assert model.calls == 0


def test_state_over_the_snapshot_budget_is_left_out_and_training_is_unchanged(tmp_path):
    bad = head2_step()
    model = Stateful(big_buffer=True)
    w, losses = train(model, bad + 1, run_dir=tmp_path / "run", bad_step=bad)
    w.close()
    man = json.loads((tmp_path / "run" / "captures" / str(bad) / "manifest.json").read_text())
    assert "buf:bank" not in man["state"] and "buf:mean" in man["state"]
    _, plain = train(Stateful(big_buffer=True), bad + 1, bad_step=bad)
    assert [str(v) for v in losses] == [str(v) for v in plain]


class EmaCode(nn.Module):
    """A codebook the forward moves through `.data` (no version bump: found by its norm) after reading it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.code = nn.Embedding(1, 8)
        self.code.weight.requires_grad_(False)

    def forward(self, x, e):
        out = self.lin(x) + self.code.weight[0]
        self.code.weight.data.mul_(0.5).add_(0.5 * x.float().mean(0))
        return out.float()


def test_a_weight_the_forward_writes_through_data_is_captured_as_the_forward_found_it(tmp_path):
    from ampdoctor.capture import load_capture
    bad = 6

    def make():
        return EmaCode()
    model = make()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")
    for i in range(bad + 1):
        x, _ = batch(i)
        if i == bad:
            x = x * 1e5
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, None).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    w.close()
    c = load_capture(tmp_path / "run" / "captures" / str(bad))
    twin = make()  # the codebook as step `bad`'s forward found it: moved by the forwards before
    with torch.no_grad():
        for i in range(bad):
            twin.code.weight.mul_(0.5).add_(0.5 * batch(i)[0].float().mean(0))
    assert torch.equal(c.state_dict["code.weight"], twin.code.weight.detach())
    assert not torch.equal(c.state_dict["code.weight"], model.code.weight.detach())
    assert "param:code.weight" not in c.manifest["rng"] and "param:code.weight" not in c.manifest["state"]
