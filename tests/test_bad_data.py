"""A batch that already holds inf/NaN when the model receives it (a corrupt record, a division by a zero std in the
data pipeline): no module produced the values, so the finding is `nan_origin` (`overflow` for ±inf only) with no
module, at the step whose batch it was — from the live watch at the default sampling and at every=1, from
`diagnose(run_dir)`, and from `replay` of the step's capture. A model that takes NaN inputs on purpose and
handles them (nan_to_num) stays healthy. Real torch, real hooks, a real GradScaler("cpu")."""
import pytest
import torch
import torch.nn as nn

import ampdoctor
from scenarios import EVERY, amp_loop, lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def sq(out, *args, **kwargs):
    return out.float().pow(2).mean()


def data_finding(rep):
    f = next((f for f in rep.findings[:3] if f.rule in ("nan_origin", "overflow") and f.module is None
              and "batch" in f.message), None)
    assert f is not None, lines(rep)
    return f


@EVERY
def test_nan_in_the_batch_is_the_data_not_a_layer(tmp_path, every):
    x = randn(32, 8)

    def batch(i):
        xx = x.clone()
        if i == 3:
            xx[5, 2] = float("nan")  # one corrupt value
        return (xx,)
    w = amp_loop(mlp(), batch, sq, every=every, run_dir=tmp_path / "r")
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = data_finding(rep)
        assert (f.rule, f.step, f.evidence["nan"], f.evidence["input"]) == ("nan_origin", 3, 1, 0), f.one_line()
        assert rep.findings[0] is f or rep.findings[0].rule == "nan_origin", lines(rep)
        assert not [g for g in rep.findings if g.rule in ("overflow", "nan_origin") and g.module], lines(rep)
    caps = sorted((tmp_path / "r" / "captures").iterdir())
    assert [c.name for c in caps] == ["3"]
    rep = ampdoctor.replay(caps[0], model=mlp(), loss_fn=sq)
    f = data_finding(rep)
    assert (f.rule, f.step) == ("nan_origin", 3), f.one_line()


class Keyed(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, *, features, scale):
        return self.head(torch.relu(self.enc(features * scale)))


def test_inf_in_a_keyword_input_is_named_by_its_keyword():
    x = randn(32, 8)
    m = Keyed()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    for i in range(6):
        opt.zero_grad()
        s = torch.ones(32, 1)
        if i == 2:
            s[0, 0] = float("inf")  # a per-sample weight computed as 1 / count with count == 0
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(features=x, scale=s).float().pow(2).mean()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    rep = w.report()
    w.close()
    f = data_finding(rep)
    assert f.step == 2 and f.evidence["input"] == "scale" and f.evidence["posinf"] == 1, f.one_line()
    assert f.rule == "overflow" and "`scale`" in f.message, f.one_line()


class Imputing(nn.Module):
    """Missing features arrive as NaN and are imputed with 0 (tabular models do this)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(torch.nan_to_num(x, nan=0.0))


@EVERY
def test_nan_inputs_a_model_handles_are_no_finding(every):
    x = randn(32, 8)
    x[::3, 1] = float("nan")
    y = randn(32, 1, seed=1)
    w = amp_loop(Imputing(), lambda i: (x,), lambda out, *a: (out.float() - y).pow(2).mean(), every=every, steps=10)
    rep = w.report()
    bad = [f.one_line() for f in rep.findings if f.severity in ("warning", "error")]
    assert not bad, bad


@EVERY
def test_nan_in_a_target_used_only_by_the_loss_is_the_loss_operand(every):
    """The target never enters the model: F.mse_loss(out.float(), y) with one NaN in y at step 3. The model's
    outputs are finite (checked every step), and MSE makes neither NaN nor inf from finite values: nan_origin
    outside the model (module null), naming the target — not an overflow, and not 'a step without statistics'."""
    x, y = randn(32, 8), randn(32, 1, seed=2)
    calls = []

    def loss(out, *args):
        t = y.clone()
        if len(calls) == 3:
            t[4, 0] = float("nan")
        calls.append(1)
        return torch.nn.functional.mse_loss(out.float(), t)
    w = amp_loop(mlp(), lambda i: (x,), loss, every=every)
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule in ("nan_origin", "overflow") and f.module is None), None)
    assert f is not None, lines(rep)
    assert (f.rule, f.step, f.phase) == ("nan_origin", 3, "forward") and "target" in f.message, f.one_line()
    assert "without per-layer statistics" not in f.message, f.one_line()
