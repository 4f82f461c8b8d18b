"""Tests of ampdoctor/replay: each failing case is captured under CPU fp16 autocast, replayed, and must be
attributed to the right rule, module, phase and (real) ATen op; plus the controls and safety properties."""
from __future__ import annotations

import json
import os

import pytest
import torch

import failing_models as fm
from ampdoctor.capture import load_capture, save_batch
from ampdoctor.errors import BadInput
from ampdoctor.replay import replay
from ampdoctor.replay import modelio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def capture(tmp_path, case, name="cap"):
    with torch.autocast("cpu", dtype=torch.float16):
        return save_batch(tmp_path / name, case.model, *case.args, **case.kwargs)


def find(report, **want):
    hits = [f for f in report.findings if all(getattr(f, k) == v for k, v in want.items())]
    assert hits, f"no finding {want} in:\n" + "\n".join(f.one_line() for f in report.findings)
    return hits[0]


class NeedsArg(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x).float().sum()


CASES = ["attn", "t5", "log1p", "normalize", "masked_fill", "exp_loss"]


@pytest.mark.parametrize("name", CASES)
def test_case_attribution(tmp_path, name):
    case = getattr(fm, f"case_{name}")()
    path = capture(tmp_path, case)
    rep = replay(path, model=case.model, loss_fn=case.loss_fn)
    e = case.expect
    f = find(rep, rule=e["rule"], module=e["module"], phase=e["phase"], **({"op": e["op"]} if "op" in e else {}))
    assert f.severity == "error" and f.fix and f.message
    assert rep.exit_code == 1
    assert rep.findings[0].severity == "error"
    json.dumps(rep.to_dict())   # JSON-ready
    data = rep.to_dict()["replay"]
    assert data["capture"] == str(path) and data["chain"]


def test_attn_details(tmp_path):
    case = fm.case_attn()
    rep = replay(capture(tmp_path, case), model=case.model, loss_fn=case.loss_fn)
    first = rep.findings[0]
    assert (first.rule, first.module, first.op) == ("overflow", "attn", "aten::bmm")   # the origin comes first
    assert first.evidence["line"].startswith("tests/failing_models.py") or "failing_models.py" in first.evidence["line"]
    assert first.evidence["absmax_in"] > 0 and first.evidence["out_posinf"] + first.evidence["out_neginf"] > 0
    d = rep.data["replay"]
    assert [c["stage"] for c in d["chain"]][:2] == ["origin", "first_nan"]
    assert d["chain"][1]["op"] == "aten::_softmax"
    assert d["fix"]["modules"] == ["attn"] and "get_submodule(name)" in d["fix"]["snippet"]
    assert d["whatif"]["float16"]["finite"] is False and d["whatif"]["bfloat16"]["finite"] is True
    assert d["whatif"]["float16"]["overflow_modules"][0] == "attn"
    assert {"module", "rel_err"} <= set(d["shadow"][0])


def test_t5_fix_and_order(tmp_path):
    case = fm.case_t5()
    rep = replay(capture(tmp_path, case), model=case.model)
    assert rep.findings[0].module == "ff.wo"
    # issue 13.6: the NaN in final_norm only passes the overflow on: listed under its origin, not an error
    assert [f.module for f in rep.findings if f.severity == "error"] == ["ff.wo"]
    cons = rep.findings[0].evidence["consequences"]
    assert [(c["module"], c["kind"]) for c in cons] == [("final_norm", "nan_origin")]
    assert rep.data["replay"]["fix"]["modules"] == ["ff.wo"]


def test_log1p_backward_names_autograd_node(tmp_path):
    case = fm.case_log1p()
    rep = replay(capture(tmp_path, case), model=case.model)
    f = find(rep, rule="nan_origin", phase="backward")
    assert f.evidence["autograd_node"] == "Log1PBackward0" and f.module == "consistency"
    eps = find(rep, rule="eps_underflow", module="consistency", op="aten::clamp")
    assert eps.severity == "error" and rep.findings[0] is eps
    assert rep.summary["loss"] == rep.summary["loss"]   # forward loss is finite (NaN only in the backward)


def test_normalize_eps_first(tmp_path):
    case = fm.case_normalize()
    rep = replay(capture(tmp_path, case), model=case.model, loss_fn=case.loss_fn)
    f = rep.findings[0]
    assert (f.rule, f.module, f.op) == ("eps_underflow", "embed_head", "aten::clamp_min")
    assert f.evidence["value"] == 1e-12 and f.evidence["rounded"] == 0.0


def test_masked_fill_raise_is_caught(tmp_path):
    case = fm.case_masked_fill()
    rep = replay(capture(tmp_path, case), model=case.model, loss_fn=case.loss_fn)
    assert "without overflow" in rep.data["replay"]["forward_error"]
    assert rep.findings[0].rule == "mask_value_overflow" and rep.findings[0].evidence["value"] == -1e9
    assert rep.data["replay"]["fix"]["modules"] == ["attn"]


def test_mask_constant_that_silently_becomes_inf_is_a_warning():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(4, 4)

        def forward(self, x):
            s = self.attn(x)
            return torch.softmax(torch.where(s > 0, s, -1e9), -1).float().sum()
    torch.manual_seed(0)
    m = M()
    from ampdoctor.capture import write_capture
    import tempfile
    d = write_capture(tempfile.mkdtemp(), m, (torch.randn(3, 4),), {},
                      autocast={"device": "cpu", "dtype": "float16", "enabled": True})
    rep = replay(d, model=m, shadow=False, whatif=False)
    f = find(rep, rule="mask_value_overflow", module="", op="aten::scalar_tensor")   # torch.where in the root
    assert f.severity == "warning" and rep.exit_code == 0


def test_healthy_model_has_no_problems(tmp_path):
    case = fm.case_healthy()
    rep = replay(capture(tmp_path, case), model=case.model)
    assert not [f for f in rep.findings if f.severity in ("error", "warning")], [f.one_line() for f in rep.findings]
    assert rep.summary["finite"] is True and rep.exit_code == 0
    assert rep.data["replay"]["whatif"]["bfloat16"]["finite"] is True


def test_precision_loss_found():
    class Cancel(torch.nn.Module):
        def forward(self, x):
            return (x + 1000.0) - 1000.0        # fp16 spacing at 1000 is 0.5: x is mostly lost

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.cancel = Cancel()
            self.b = torch.nn.Linear(16, 16)
            self.c = torch.nn.Linear(16, 1)

        def forward(self, x):
            return self.c(self.b(self.cancel(self.a(x)))).float().mean()
    torch.manual_seed(0)
    m = M()
    from ampdoctor.capture import write_capture
    import tempfile
    d = write_capture(tempfile.mkdtemp(), m, (torch.randn(8, 16),), {},
                      autocast={"device": "cpu", "dtype": "float16", "enabled": True})
    rep = replay(d, model=m, whatif=False)
    f = find(rep, rule="precision_loss", module="cancel")
    assert f.severity == "warning" and f.evidence["rel_err"] > 1e-2
    assert not [x for x in rep.findings if x.rule == "precision_loss" and x.module != "cancel"]


def test_precision_loss_that_every_later_module_inherits(tmp_path):
    """Diffusion-style timesteps ~1000 pass a Linear in bf16 (spacing 4 or 8 there) before sin/cos: the embedding
    is 39% off and everything after it inherits the error, so the median module is off too. The module that
    turned exact inputs into that error is named; those that only inherit it are not."""
    class TimeEmb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Linear(1, 1, bias=False)
            torch.nn.init.ones_(self.scale.weight)
            self.register_buffer("freqs", torch.exp(-torch.arange(16) / 16 * 4.0))

        def forward(self, t):
            tt = self.scale(t)
            return torch.cat([torch.sin(tt * self.freqs), torch.cos(tt * self.freqs)], -1)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.temb = TimeEmb()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

        def forward(self, t):
            return self.mlp(self.temb(t))
    torch.manual_seed(0)
    m = M()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cap = save_batch(str(tmp_path / "cap"), m, torch.tensor([[997.0], [999.0], [1001.0], [1003.0]]))
    rep = replay(cap, model=m)
    f = find(rep, rule="precision_loss", module="temb")
    assert f.evidence["rel_err"] > 0.1 and (f.evidence["in_rel_err"] or 0.0) < 1e-3
    assert [x.module for x in rep.findings if x.rule == "precision_loss"] == ["temb"]


def test_replay_leaves_model_unchanged(tmp_path):
    case = fm.case_attn()
    path = capture(tmp_path, case)
    m = case.model
    m.eval()
    with torch.no_grad():
        m.attn.o.weight.add_(0.5)                 # the live model differs from the capture
    for p in m.parameters():
        p.grad = torch.full_like(p, 3.0)
    grad_objs = [p.grad for p in m.parameters()]
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params_before = [id(p) for p in m.parameters()]
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    replay(path, model=m, loss_fn=case.loss_fn)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert [id(p) for p in m.parameters()] == params_before
    assert [p.grad for p in m.parameters()] == grad_objs and all(bool((p.grad == 3.0).all()) for p in m.parameters())
    assert not m.training and torch.equal(torch.get_rng_state(), rng)
    assert not m._forward_hooks and not m.attn._forward_pre_hooks and "forward" not in m.attn.__dict__


def test_dropout_replay_is_exact(tmp_path):
    case = fm.case_dropout()
    m = case.model.train()
    torch.manual_seed(7)
    path = capture(tmp_path, case)
    with torch.autocast("cpu", dtype=torch.float16):    # the original step, right after the capture
        orig = m(*case.args)
    torch.manual_seed(999)                                # a different RNG state when replaying
    cap = load_capture(path)
    modelio.load_weights(m, cap.state_dict)
    out, _, _ = modelio.run_step(m, cap.args, cap.kwargs, device="cpu", dtype=torch.float16, rng=cap.rng,
                                 backward=False)
    assert torch.equal(out, orig)
    rep = replay(path, model=m, loss_fn=case.loss_fn, shadow=False, whatif=False, fix_search=False)
    ev = rep.data["replay"]["ops"][0]
    assert ev["module"] == "boost" and ev["out_posinf"] == int(torch.isposinf(orig).sum())
    assert 0 < ev["out_posinf"] < orig.numel()            # dropout really decided which entries overflow


def test_model_mismatch_is_bad_input(tmp_path):
    case = fm.case_t5()
    path = capture(tmp_path, case)
    with pytest.raises(BadInput, match="model does not match capture: missing .*unexpected"):
        replay(path, model=fm.AttnModel())
    from fixtures.models import TinyT5Block
    with pytest.raises(BadInput, match="shape ff.wi.weight"):
        replay(path, model=TinyT5Block(dff=64))


def test_factory_strings(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rep = replay(os.path.join("fixtures", "captures", "t5_ffn_overflow"), model="fixtures.models:t5_block",
                 shadow=False, whatif=False)
    assert rep.findings[0].module == "ff.wo" and rep.findings[0].step == 17
    for bad, match in [("nomodule_xyz:f", "cannot import"), ("fixtures.models:nope", "no attribute"),
                       ("fixtures.models", "must look like")]:
        with pytest.raises(BadInput, match=match) as e:
            replay(os.path.join("fixtures", "captures", "t5_ffn_overflow"), model=bad)
        assert "\n" not in str(e.value)
    case = fm.case_attn()   # an importable class with a no-argument constructor: a capture's class is never imported
    with pytest.raises(BadInput, match="never imports"):
        replay(capture(tmp_path, case), loss_fn=case.loss_fn, shadow=False, whatif=False)
    with pytest.raises(BadInput, match="pass model="):
        replay(capture(tmp_path, fm.Case(NeedsArg(4), (torch.ones(2, 4),)), "c2"))


def test_fixture_capture_replays_with_progress(monkeypatch):
    monkeypatch.chdir(ROOT)
    lines = []
    rep = replay(load_capture("fixtures/captures/t5_ffn_overflow"), model="fixtures.models:t5_block",
                 progress=lines.append)
    assert lines and lines[-1] == "replay: done"
    assert rep.data["replay"]["fix"]["modules"] == ["ff.wo"]
    assert rep.data["replay"]["scale"] == 1024.0
    assert sum(os.path.getsize(os.path.join(ROOT, "fixtures/captures/t5_ffn_overflow", f))
               for f in os.listdir(os.path.join(ROOT, "fixtures/captures/t5_ffn_overflow"))) < 1 << 20


def test_pure_fp16_model_rebuilt_from_factory(tmp_path, monkeypatch):
    """A `.half()` model captured outside autocast: the factory's fp32 model takes the capture's dtype."""
    monkeypatch.chdir(ROOT)
    from fixtures.models import make_t5_overflow, t5_block_batch
    m = make_t5_overflow().half()
    x, labels = t5_block_batch()
    path = save_batch(tmp_path / "half", m, x.half(), labels=labels)
    rep = replay(path, model="fixtures.models:t5_block")
    assert rep.summary["dtype"] == "float16" and rep.summary["note"] is None
    f = find(rep, rule="overflow", module="ff.wo", phase="forward")
    assert f.evidence["out_dtype"] == "float16"
    assert rep.data["replay"]["whatif"]["bfloat16"]["finite"] is True
