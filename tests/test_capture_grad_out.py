"""A watch's capture keeps the gradient that reached the model's (small) outputs on the bad step, so that a replay
without the user's loss function runs the step's own backward (replay/modelio.captured_grad_loss): the values
stored are the ones autograd passed, a manifest naming something else is refused, and large outputs keep none."""
import json
import os

import pytest
import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.capture import load_capture
from ampdoctor.errors import BadInput


class Net(nn.Module):
    def __init__(self, width=16, out=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, width), nn.Linear(width, out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _run(tmp_path, rows=32, out=4, bad=3, inputs=False):
    torch.manual_seed(0)
    m = Net(out=out)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    seen = {}
    with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(tmp_path / "run")) as w:
        for i in range(6):
            opt.zero_grad()
            x = torch.randn(rows, 8)
            y = torch.randn(rows, out)
            if i == bad and inputs:
                x[0] = 1e5  # past fp16's range: the forward overflows
            elif i == bad:
                y[0] = 3e4  # a target far off: the scaled gradient into the output overflows in the model's backward
            with torch.autocast("cpu", dtype=torch.float16):
                o = m(x)
                o.register_hook(lambda g, i=i: seen.__setitem__(i, g.detach().clone()))
                loss = (o.float() - y).pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    caps = [r.capture for r in w.steps if r.capture]
    return w, caps, seen


def test_the_bad_steps_output_gradient_is_stored_as_autograd_passed_it(tmp_path):
    w, caps, seen = _run(tmp_path)
    assert caps, [(r.step, r.skipped) for r in w.steps]
    cap = load_capture(caps[0])
    step = cap.step
    assert cap.grad_out is not None and cap.grad_out[0] is not None, cap.manifest.get("grad_out")
    assert torch.equal(cap.grad_out[0], seen[step]), (cap.grad_out[0].abs().max(), seen[step].abs().max())
    assert cap.manifest["grad_out"] == ["g/0"]


def test_a_manifest_naming_a_gradient_that_is_not_stored_is_refused(tmp_path):
    _, caps, _ = _run(tmp_path)
    mp = os.path.join(caps[0], "manifest.json")
    man = json.load(open(mp))
    for bad in (["g/7"], ["rng/cpu"], "g/0", [1]):
        man["grad_out"] = bad
        open(mp, "w").write(json.dumps(man))
        with pytest.raises(BadInput, match="grad_out"):
            load_capture(caps[0])


def test_a_large_output_keeps_no_gradient(tmp_path):
    # 40000 x 16 fp16 outputs = 1.25 MB, past record/hooks.GRAD_OUT_BYTES
    w, caps, _ = _run(tmp_path, rows=40000, out=16, inputs=True)
    assert caps
    cap = load_capture(caps[0])
    assert not cap.grad_out or cap.grad_out[0] is None, cap.manifest.get("grad_out")
