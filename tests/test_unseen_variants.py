"""Variants of shared/FP16.md's failure patterns that the other tests do not build: failures that start mid-run
under the default sampling, nested module names, a CLIP loss module whose logit scale grows, hand-written norms
that flush only some rows (or leave only their trained bias), attention with a fully masked row, scaler misuse
seen from the command line, and healthy runs with a learning-rate warmup. Real torch, real hooks, fp16 autocast
on the CPU with a real GradScaler; the right rule at the producing module among the first three findings."""
import functools
import json
import subprocess
import sys


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import ConvNet, TinyGPT, amp_loop, hf_loss, mse_to_zero, randn, top3


loop = functools.partial(amp_loop, steps=6)


def quiet(rep):
    bad = [f.one_line() for f in rep.findings if f.severity in ("error", "warning")]
    assert not bad and rep.exit_code == 0, bad



# -- 1. SwiGLU `silu(gate) * up` overflowing inside a nested block, from step 4 on --------------------------------
class SwiGLU(nn.Module):
    def __init__(self, d=16, h=64):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False),
                                         nn.Linear(h, d, bias=False))
        self.act = nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), SwiGLU()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Linear(8, 16), nn.ModuleList(Block() for _ in range(2)), nn.Linear(16, 1)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_swiglu_product_overflow_from_mid_run_names_the_nested_mlp(tmp_path):
    torch.manual_seed(0)
    m, x = Stack(), randn(8, 8)

    def batch(i):
        if i == 4:  # gate and up stay finite (|x| < 500); their product does not
            with torch.no_grad():
                m.blocks[1].mlp.gate.weight.mul_(250)
                m.blocks[1].mlp.up.weight.mul_(250)
        return (x,)
    w = loop(m, batch, mse_to_zero, steps=9, run_dir=tmp_path / "r")
    f = top3(w.report(), "overflow", "blocks.1.mlp")
    assert (f.phase, f.step, f.op) == ("forward", 4, "aten::mul")
    rep = ampdoctor.diagnose(tmp_path / "r")  # from disk, without the replay: the same module and rule
    f = top3(rep, "overflow", "blocks.1.mlp")
    assert f.step == 4
    assert not any(g.module in ("blocks.1.mlp.gate", "blocks.1.mlp.up", "blocks.1.mlp.act", "blocks.1.mlp.down")
                   and g.severity == "error" for g in rep.findings)


# -- 2. CLIP loss module: exp(t) * sim with a logit scale t that keeps growing -------------------------------------
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        return F.normalize(self.proj(x), dim=-1)


class ClipLoss(nn.Module):
    def __init__(self, t0):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(t0))

    def forward(self, a, b):
        logits = self.logit_scale.exp() * (a @ b.t())  # |sim| <= 1: inf once exp(t) > 65504 (t > 11.09)
        y = torch.arange(a.shape[0])
        return (F.cross_entropy(logits.float(), y) + F.cross_entropy(logits.t().float(), y)) / 2


class Clip(nn.Module):
    def __init__(self, t0=10.0):
        super().__init__()
        self.enc, self.loss = Encoder(), ClipLoss(t0)

    def forward(self, a, b):
        return self.loss(self.enc(a), self.enc(b))


def test_clip_logit_scale_growing_past_fp16_names_the_loss_module():
    torch.manual_seed(0)
    m = Clip()
    a = randn(16, 16)
    b = a + 0.05 * randn(16, 16, seed=1)

    def batch(i):
        with torch.no_grad():
            m.loss.logit_scale.add_(0.25)  # t grows as it does over a long CLIP run: 10.25, 10.5, ... 11.25 at step 4
        return (a, b)
    w = loop(m, batch, lambda out, *args: out, steps=8, clip=None)
    rep = w.report()
    f = top3(rep, "overflow", "loss")
    assert (f.phase, f.step, f.op) == ("forward", 4, "aten::mul")
    assert not any(g.module == "enc" and g.severity == "error" for g in rep.findings)


# -- 3. hand-written norms squaring in fp16: silent zeros, not NaN ------------------------------------------------
class RMSNormFp16(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LayerNormFp16(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class NormNet(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.up, self.norm, self.head = nn.Linear(8, 32), norm(32), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.norm(self.up(x)))


def _norm_run(norm, *, gain, rows, every, steps=6):
    """`up` grows ×gain at step 3 on `rows` of the 16 (the others stay small): those rows' x² overflow."""
    torch.manual_seed(0)
    m, x = NormNet(norm), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.up.weight.mul_(gain)
        return (torch.cat([x[:rows], x[rows:] / gain]) if i >= 3 else x,)
    return m, loop(m, batch, mse_to_zero, steps=steps, every=every)


def test_rms_norm_flushing_a_few_rows_mid_run_is_an_overflow_at_the_norm():
    """Two rows of sixteen overflow (x² > 65504) and come out as zeros: 12% of the output, below the 25% asked of
    other modules, but a norm's output is zero only where its input was."""
    m, w = _norm_run(RMSNormFp16, gain=300, rows=2, every=1)
    rep = w.report()
    f = top3(rep, "overflow", "norm")
    assert (f.phase, f.step) == ("forward", 3)


def test_layer_norm_with_a_trained_bias_returns_only_the_bias_mid_run():
    """With a bias, the flushed rows are not zeros: (x - mu) / sqrt(inf) * w + b = b, far below the norm's output
    on the steps before."""
    m, w = _norm_run(LayerNormFp16, gain=3000, rows=16, every=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        y = m.norm(m.up(randn(16, 8)))
    assert (y == m.norm.bias.to(y.dtype)).all(-1).float().mean() > 0.5  # real: most rows are only the bias
    rep = w.report()
    f = top3(rep, "overflow", "norm")
    assert (f.phase, f.step) == ("forward", 3) and f.evidence["flushed"] == "bias"


def test_layer_norm_flushed_to_its_bias_from_an_unsampled_step_is_seen():
    """Wrong when written (a strict xfail: at the default sampling a step whose loss, output and gradients stay
    finite was not recorded per layer, and the trip-wire checks inf/NaN only); fixed since: the always-on series
    sees the norm's output collapse, the next step is sampled (record/autocapture.py CapturePolicy.collapse) and the
    finding is dated by the series (rules/numeric.py silent_zeros)."""
    m, w = _norm_run(LayerNormFp16, gain=3000, rows=16, every=None)
    f = top3(w.report(), "overflow", "norm")
    assert (f.phase, f.step) == ("forward", 3), f.one_line()


def test_hand_written_layer_norm_with_large_but_safe_inputs_raises_nothing():
    """Inputs past 256 whose deviations from the mean stay small (|x - mu| < 256): the fp16 square does not
    overflow, and no silent-zeros finding appears."""
    torch.manual_seed(0)
    m = NormNet(LayerNormFp16)
    with torch.no_grad():
        m.up.bias.fill_(300.0)
    w = loop(m, lambda i: (randn(16, 8, seed=i),), mse_to_zero, steps=6, every=1)
    quiet(w.report())


# -- 4. attention with a fully masked row ---------------------------------------------------------------------------
class MHANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(4, 16), nn.MultiheadAttention(16, 2, batch_first=True), \
            nn.Linear(16, 1)

    def forward(self, x, pad):
        h = self.emb(x)
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        return self.head(h + a).mean()


class AddMaskAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, -1)
        add = torch.zeros(pad.shape, dtype=x.dtype).masked_fill(pad, float("-inf"))[:, None, :]
        return self.o(torch.softmax(q @ k.transpose(-1, -2) / 4 + add, -1) @ v)


class AddMaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(4, 16), AddMaskAttn(), nn.Linear(16, 1)

    def forward(self, x, pad):
        h = self.emb(x)
        return self.head(h + self.attn(h, pad)).mean()


def _padded():
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[2] = True  # the third sequence is padding only
    return randn(3, 6, 4), pad


def test_fully_masked_row_in_an_additive_mask_collapses_the_scale_at_the_attention():
    torch.manual_seed(0)
    x, pad = _padded()
    w = loop(AddMaskNet(), lambda i: (x, pad), lambda out, *a: out, steps=14, clip=None)
    rep = w.report()
    f = top3(rep, "nan_origin", "attn")
    assert f.step == 0 and f.op == "aten::_softmax"
    top3(rep, "loss_scale_collapse", "attn")


def test_fully_masked_row_in_multihead_attention_is_handled_by_torch_and_quiet():
    """torch's MultiheadAttention returns a finite row for a fully padded sequence: nothing to report."""
    torch.manual_seed(0)
    x, pad = _padded()
    w = loop(MHANet(), lambda i: (x, pad), lambda out, *a: out, steps=8, clip=None)
    quiet(w.report())


# -- 5. scaler misuse, seen through the command line after the script died -----------------------------------------
_MISUSE = """
import sys, torch, torch.nn as nn, ampdoctor
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=sys.argv[2])
for it in range(5):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(torch.randn(8, 4)).float().pow(2).mean()
    sc.scale(loss).backward()
    if sys.argv[1] == "unscale_twice":
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.unscale_(opt)  # raises in torch; the script dies here
        sc.step(opt)
        sc.update()
    else:
        opt.step()  # on scaled gradients, and no scaler.step/update at all: torch says nothing
"""


@pytest.mark.parametrize("kind,needle", [("unscale_twice", "unscale_()` was called twice"),
                                         ("optimizer_step_on_scaled", "optimizer.step()")])
def test_scaler_misuse_is_named_by_the_cli_report(tmp_path, kind, needle):
    script, rd, out = tmp_path / "train.py", tmp_path / "run", tmp_path / "report.json"
    script.write_text(_MISUSE)
    died = subprocess.run([sys.executable, str(script), kind, str(rd)], capture_output=True, text=True)
    assert (died.returncode != 0) == (kind == "unscale_twice"), died.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(rd), "--no-html", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    first = json.loads(out.read_text())["findings"][0]
    assert first["rule"] == "scaler_misorder" and needle in first["message"], first
    assert first["evidence"]["sequence"]


# -- 6. healthy runs with a learning-rate warmup: no warning, no error ----------------------------------------------
@pytest.mark.parametrize("every", [None, 1])
def test_healthy_convnet_40_steps_with_warmup_is_quiet(every):
    torch.manual_seed(0)
    xs = [randn(16, 3, 16, 16, seed=i) for i in range(4)]
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(9))
    w = loop(ConvNet(), lambda i: (xs[i % 4],), lambda out, *a: F.cross_entropy(out.float(), y), steps=40,
             every=every, lr=3e-3, warmup=10)
    quiet(w.report())


@pytest.mark.parametrize("every", [None, 1])
def test_healthy_transformer_40_steps_with_warmup_is_quiet(every):
    torch.manual_seed(0)

    def batch(i):
        idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(i))
        return idx, torch.roll(idx, -1, 1)
    w = loop(TinyGPT(), batch, hf_loss, steps=40, every=every, lr=3e-3, warmup=10)
    quiet(w.report())
