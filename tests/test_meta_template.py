"""A model holding a template module on the meta device (torch.func.stack_module_state + vmap over
functional_call: the members' weights are stacked Parameters, the template holds no values), watched with an
optimizer built from `model.parameters()` (which include the template's meta parameters; torch's optimizers skip
them, they never get a gradient). Found by tests/test_healthy_default22.py: ampdoctor disabled itself at the first
optimizer step (record/params.py measured the meta parameters' norms: "Cannot copy out of meta tensor"), and a bad
step's capture could not be written (capture.py copied every state_dict tensor to the CPU).

Checked here: the watch stays on over a healthy run and over a broken one (one member's weights x30000 at step 8);
the broken run's capture is written, holds no meta tensor, and loads into a fresh model of the same class (its own
template stays on the meta device) for a replay through the public API.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

import ampdoctor
from ampdoctor.capture import load_capture


class Member(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


class Ensemble(nn.Module):
    def __init__(self, k=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        members = [Member() for _ in range(k)]
        params, _ = stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self.base = copy.deepcopy(members[0]).to("meta")

    def forward(self, x):
        def one(ps, xb):
            return functional_call(self.base, dict(zip(self.names, ps)), (xb,))
        return vmap(one)(tuple(self.stacked), x)


def run(tmp_path, steps, break_at=None):
    model = Ensemble()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)   # the meta template's parameters included
    sc = torch.amp.GradScaler("cpu", init_scale=1024)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
        for i in range(steps):
            if i == break_at:
                with torch.no_grad():
                    model.stacked[0][1].mul_(30000.0)   # member 1's first Linear, loaded with a wrong scale
            x = torch.randn(4, 64, 4, generator=g)
            y = x.sum(-1, keepdim=True)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            sc.step(opt)
            sc.update()
        w.close()
    msgs = [str(c.message) for c in caught if "ampdoctor" in str(c.message)]
    return w, msgs


def test_meta_template_parameters_in_the_optimizer_leave_the_watch_on(tmp_path):
    w, msgs = run(tmp_path, 12)
    assert not msgs, msgs
    rep = w.report()
    assert rep.summary["internal_error"] is None, rep.summary
    assert rep.summary["steps"] == 12
    assert not [f for f in rep.findings if f.severity in ("warning", "error")], rep.text()


def test_meta_template_capture_is_written_and_replays(tmp_path):
    w, msgs = run(tmp_path, 12, break_at=8)
    assert not msgs, msgs   # (no "could not write a capture")
    rep = w.report()
    assert rep.summary["internal_error"] is None, rep.summary
    assert rep.summary["first_bad_step"] is not None and rep.summary["captures"], rep.summary
    cap = load_capture(rep.summary["captures"][0])
    assert cap.state_dict and not any(k.startswith("base.") for k in cap.state_dict), list(cap.state_dict)
    fresh = Ensemble(seed=5)
    r2 = ampdoctor.replay(cap.path, fresh)   # loads the captured weights into a model whose template is meta
    assert fresh.base.net[0].weight.is_meta
    # the weights x30000 overflow the step's backward at once, then a later batch's forward inside the vmap'd
    # template (seen there by the replay's op-level instrumentation: aten::bmm in base.net.0)
    assert any(f.severity == "error" for f in r2.findings), r2.text()
    top = [(f.rule, f.module, f.step) for f in rep.findings[:3]]
    assert ("overflow", "base.net.0", rep.summary["first_bad_step"]) in top, rep.text()


def test_the_replay_moves_the_model_to_its_device_and_leaves_a_meta_template_there():
    """replay/modelio.module_to is what the replay calls to put the model on its device: a second `to_device` (the
    batch's tree_map) once shadowed it, so the model was never moved (a tree_map leaves a Module as it is). Moved
    here to the meta device, which the CPU has besides itself: every tensor goes, the template's stays meta."""
    from ampdoctor.replay import modelio
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    m[1].register_buffer("template", torch.empty(3, device="meta"))
    modelio.module_to(m, torch.device("meta"))
    assert all(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
    assert modelio.to_device((torch.ones(2),), torch.device("meta"))[0].is_meta  # (the batch's own: a tree_map)
