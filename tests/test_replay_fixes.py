"""Replay's fix texts (issue 13.7, 13.8): every snippet replay can emit is valid Python for any module name
(numbered children, nested, root), and the advice follows the op and the evidence, not the module's name."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import failing_models as fm
from ampdoctor.capture import save_batch
from ampdoctor.fixes import call_expr, fp32_patch_snippet, fp32_snippet
from ampdoctor.replay import replay
from ampdoctor.replay.explain import build_findings
from ampdoctor.replay.fixsearch import snippet
from ampdoctor.replay.optrace import OpEvent

NAMES = ["layers.2", "h.0.mlp", "", "blocks.0.1", "encoder.block.1.ff.wo", "weird-name.0", "class", None]


def code_of(fix: str) -> str:
    """The Python part of a fix text: from its first `with `/`import ` line to the next blank line (or the end)."""
    lines = fix.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(("with ", "import ")))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip() and lines[start].startswith("with ")),
               len(lines))
    return "\n".join(lines[start:end])


def _events(module):
    mk = dict(seq=5, module=module, kind="overflow", out_dtype="float16", absmax_in=300.0, out_posinf=1,
              out_numel=4, in_dtypes=["float16"], out_shape=[2, 8, 8])
    return [OpEvent(phase="forward", op="aten::bmm", **mk), OpEvent(phase="forward", op="aten::mm", **mk),
            OpEvent(phase="forward", op="aten::pow", **mk), OpEvent(phase="forward", op="aten::add", **mk),
            OpEvent(phase="forward", op="aten::log", **dict(mk, kind="nan_origin", out_nan=2), in_zeros=1),
            OpEvent(phase="backward", op="aten::div", autograd_node="Log1PBackward0",
                    **dict(mk, kind="nan_origin", out_nan=2))]


@pytest.mark.parametrize("module", NAMES)
def test_every_snippet_compiles(module):
    fixes = []
    for ev in _events(module):
        found = build_findings(events=[ev], consts=[], step_bad=True, step=3, device="cuda", forward_error=None,
                               fix={"found": True, "snippet": snippet([module or ""], "cuda")},
                               suspects=[{"module": module, "rel_err": 0.5, "in_rel_err": 0.0, "median": 1e-3}],
                               dtype="float16", softmax_inputs=[(9, module, (2, 8, 8))])
        fixes += [f.fix for f in found]
    assert len(fixes) >= 2 * len(_events(module))
    for fx in fixes:
        compile(code_of(fx), "<fix>", "exec")
        if "fix search" in fx:
            compile(fx.split("(ampdoctor fix search):\n", 1)[1], "<fix>", "exec")
    compile(fp32_snippet(module, "cpu"), "<fix>", "exec")
    compile(fp32_patch_snippet([module or "", "layers.2"], "cpu"), "<fix>", "exec")


def test_call_expr_reaches_the_module():
    """The expression names the module from its owner's forward: the numbered child is indexed, never `self.2`."""
    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.blocks = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
            self.mlp = nn.Linear(2, 2)
    o = Owner()
    for name, owner in [("layers.2", o), ("blocks.0.1", o), ("h.0.mlp", o)]:
        target = o.get_submodule(name) if not name.startswith("h.") else o.mlp
        assert eval(call_expr(name), {"self": owner}) is target
    assert call_expr("") == "model" and call_expr(None) == "model"


def _capture(tmp_path, model, *args, name="cap"):
    with torch.autocast("cpu", dtype=torch.float16):
        return save_batch(tmp_path / name, model, *args)


def test_t5_feed_forward_is_not_told_to_scale_q(tmp_path):
    case = fm.case_t5()
    with torch.autocast("cpu", dtype=torch.float16):
        cap = save_batch(tmp_path / "cap", case.model, *case.args, **case.kwargs)
    rep = replay(cap, model=case.model, fix_search=False, whatif=False)
    f = rep.findings[0]
    assert (f.module, f.op) == ("ff.wo", "aten::mm")
    assert "q @ k" not in f.fix and "1/sqrt(d)" not in f.fix


class BatchedProj(nn.Module):
    """A batched per-group projection (bmm) named like attention, whose output no softmax normalises."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((2, 16, 16), 400.0))

    def forward(self, x):
        return torch.bmm(x, self.w)


class NotAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_proj = BatchedProj()

    def forward(self, x):
        return self.attn_proj(x).float().mean()


def test_attention_advice_needs_attention_evidence(tmp_path):
    rep = replay(_capture(tmp_path, NotAttention(), torch.full((2, 4, 16), 20.0)), model=NotAttention(),
                 fix_search=False, whatif=False)
    f = rep.findings[0]
    assert (f.rule, f.module, f.op) == ("overflow", "attn_proj", "aten::bmm")
    assert "q @ k" not in f.fix and "attention" not in f.fix
    case = fm.case_attn()                                  # q @ kᵀ followed by softmax: the attention advice
    rep = replay(_capture(tmp_path, case.model, *case.args, name="attn"), model=case.model, loss_fn=case.loss_fn,
                 fix_search=False, whatif=False)
    assert rep.findings[0].op == "aten::bmm" and "scale q by 1/sqrt(d)" in rep.findings[0].fix
    assert "scaled_dot_product_attention" in rep.findings[0].fix          # this model does not use SDPA


class SdpaAndManual(nn.Module):
    """SDPA already in use in one branch; the manual q @ kᵀ of the other overflows."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x)
        a = F.scaled_dot_product_attention(q, q, q)
        s = torch.softmax(q @ (q * 3000.0).transpose(-1, -2), -1)
        return (a + s @ q).float().mean()


def test_no_use_sdpa_advice_when_sdpa_is_in_use(tmp_path):
    torch.manual_seed(0)
    m = SdpaAndManual()
    rep = replay(_capture(tmp_path, m, torch.randn(1, 8, 16) * 4), model=m, fix_search=False, whatif=False)
    f = rep.findings[0]
    assert f.rule == "overflow" and f.op in ("aten::bmm", "aten::matmul"), f.one_line()
    assert "scale q by 1/sqrt(d)" in f.fix and "use F.scaled_dot_product_attention" not in f.fix


def test_overflow_wording_follows_the_sign_of_the_infs(tmp_path):
    """A replayed matmul whose output overflowed only to +inf is said to give +inf, not ±inf (issue 13 item 8)."""
    import torch
    import torch.nn as nn
    import ampdoctor
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad():
        m[0].weight.fill_(1e3)
        m[0].bias.zero_()
    x = torch.full((2, 4), 30.0)
    with torch.autocast("cpu", dtype=torch.float16):
        ampdoctor.save_batch(str(tmp_path / "cap"), m, x)
    rep = ampdoctor.replay(str(tmp_path / "cap"), model=m, loss_fn=lambda out, *a: out.float().sum())
    f = next(f for f in rep.findings if f.rule == "overflow" and f.module == "0")
    assert "+inf" in f.message and "±inf" not in f.message, f.message
