"""Fourth set of failure-pattern variants: in-place operations and aliasing, the way real code writes them, watched
through the public API only (watch -> ordinary fp16 autocast + GradScaler loop -> w.report(), and
diagnose(run_dir)), at the default sampling and at every=1: a residual added in place (`out += identity`),
in-place activations after an overflowing layer, normalisation done in place (div_ by a zero std, sqrt_ of a
negative variance), in-place ops on a view, writes into a preallocated fp16 buffer (copy_ of an fp32 value, out=
into a NaN-initialised workspace, index_add_), modules returning a view or their input object, an in-place scale in
the parent's own code, exp_/cumsum_/div_ in place, backward-only overflows through in-place ops (mul_, sqrt_ at 0),
weights renormalised in place inside forward, and a model scaling its input batch in place. Each model goes bad at
a known step; the right rule at the producing module (not one that only passed the inf/NaN on) among the first
three findings, at that step and phase, and (forward) the op the replay names. Where ampdoctor is wrong the test is
a strict xfail whose reason says what and where."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import (both, EVERY, first_bad, FP16, lines, no_error_at, one_thread, out_mean, randn,
                       short_loop as loop, top3)


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def not_a_mask(rep):
    """A scale factor beyond fp16's max in `x * k` on activations is no mask constant: fp16 ops compute with the
    Python number in fp32 (x = 1e-3 times 1e6 is 1000), the overflow is the op's, and "use finfo(dtype).min for
    the mask" is no fix for it."""
    bad = [f.one_line() for f in rep.findings if f.rule == "mask_value_overflow"]
    assert not bad, bad


# -- 1. torchvision BasicBlock style: the residual added in place overflows ----------------------------------------
class ResBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin, self.bn = nn.Linear(d, d), nn.LayerNorm(d, elementwise_affine=False)
        self.relu = nn.ReLU(inplace=True)
        self.gain = 1.0

    def forward(self, x):
        identity = x
        out = self.lin(x) * self.gain
        out += identity  # in place: the sum overflows, in this block's own code
        return self.relu(out)


class ResNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(8, 16), ResBlock(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


@EVERY
def test_residual_added_in_place_overflows_in_the_block(tmp_path, every):
    """From step 3 the stem's output is ~4e4 (bias) and block.lin passes it on (identity weight, gain 1): each
    term is finite, `out += identity` is 8e4 -> inf, made by the block's own in-place add."""
    torch.manual_seed(0)
    m, x = ResNetish(), randn(16, 8) * 0.1
    with torch.no_grad():
        m.block.lin.weight.copy_(torch.eye(16))
        m.block.lin.bias.zero_()

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.stem.bias.fill_(4e4)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.stem(x)
        assert torch.isfinite(h).all() and torch.isfinite(m.block.lin(h)).all()
        assert not torch.isfinite(m.block(h)).all()  # real: the in-place residual add overflows
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "block")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::add_"), f.one_line()
        no_error_at(rep, ("stem", "block.lin", "block.relu", "head", ""))


# -- 2. in-place activations after an overflowing Linear: the activation is not blamed ------------------------------
class ActNet(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), act, nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class FnReLU(nn.Module):
    def forward(self, x):
        return F.relu(x, inplace=True)


@EVERY
@pytest.mark.parametrize("act", ["relu_module", "relu_fn", "silu", "leaky"])
def test_in_place_activation_after_an_overflowing_linear(tmp_path, every, act):
    """From step 3 fc1's weights are x1e5: its output is inf; an in-place activation (ReLU, F.relu(inplace=True),
    SiLU, whose silu(-inf) = NaN, LeakyReLU) rewrites that same tensor and passes it on: never the producer."""
    torch.manual_seed(0)
    acts = {"relu_module": nn.ReLU(inplace=True), "relu_fn": FnReLU(), "silu": nn.SiLU(inplace=True),
            "leaky": nn.LeakyReLU(0.1, inplace=True)}
    m, x = ActNet(acts[act]), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.fc1.weight.mul_(1e5)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        assert torch.isinf(m.fc1(x)).any()  # real: fc1 overflows fp16
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "fc1")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::addmm"), f.one_line()
        no_error_at(rep, ("act", "fc2", ""))


# -- 3. hand-written normalisation done in place ------------------------------------------------------------------
class InPlaceStdNorm(nn.Module):
    def forward(self, x):
        mu, sd = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
        return (x - mu).div_(sd)  # a constant row: 0 / 0


class NormNet(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(8, 32), norm, nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.inp(x))))


@EVERY
def test_in_place_normalisation_of_a_dead_row_is_nan_origin_at_the_norm(tmp_path, every):
    """From step 3 the input's first 4 rows are zero and inp's bias is -1 (weights small): relu makes those rows
    all zero, the norm divides 0 by 0 in place -> NaN, made by `norm`."""
    torch.manual_seed(0)
    m = NormNet(InPlaceStdNorm())
    x = randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.inp.bias.fill_(-1.0)
                m.inp.weight.mul_(0.01)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = torch.relu(m.inp(x))
        assert torch.isfinite(h).all() and torch.isnan(m.norm(h.clone())).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "nan_origin", "norm")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::div_"), f.one_line()
        no_error_at(rep, ("inp", "head", ""))


# -- 4. an in-place op on a view: one channel scaled up ----------------------------------------------------------------
class ChannelBoost(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 1.0

    def forward(self, x):
        x[:, 0].mul_(self.k)  # in place on a view of x; x is returned
        return x


class Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 1.0

    def forward(self, x):
        return x * self.k  # out of place: the same overflow, for comparison


class ViewNet(nn.Module):
    def __init__(self, boost):
        super().__init__()
        self.fc1, self.boost, self.fc2 = nn.Linear(8, 16), boost, nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.boost(self.fc1(x)))


@EVERY
@pytest.mark.parametrize("kind", ["view_mul_", "product"])
def test_in_place_op_on_a_view_overflows(tmp_path, every, kind):
    """From step 3 channel 0 is multiplied by 1e6 in place through a view (`product`: x * 1e6 out of place). The
    overflow is the product's; 1e6 is no mask constant (a mask_value_overflow error was reported beside it)."""
    torch.manual_seed(0)
    m, x = ViewNet(ChannelBoost() if kind == "view_mul_" else Product()), randn(16, 8)
    op = "aten::mul_" if kind == "view_mul_" else "aten::mul"

    def batch(i):
        if i == 3:
            m.boost.k = 1e6
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "boost")
        assert (f.phase, f.step, f.op) == ("forward", 3, op), f.one_line()
        no_error_at(rep, ("fc1", "fc2", ""))
        not_a_mask(rep)
    cap = next(r.capture for r in w.steps if r.step == 3)
    rr = ampdoctor.replay(cap, model=m, loss_fn=out_mean)  # the capture's replay on its own, too
    f = rr.findings[0]
    assert (f.rule, f.module, f.op) == ("overflow", "boost", op), lines(rr)
    not_a_mask(rr)


# -- 5. writing into a preallocated fp16 buffer: slice assignment of an fp32 value, index_add_ aggregation ----------
class TimeConcat(nn.Module):
    """Concatenates the features with a timestep embedding computed in fp32 (outside autocast), by writing both
    into one preallocated buffer of the features' dtype: the write casts the fp32 embedding to fp16."""

    def __init__(self, fill="zeros"):
        super().__init__()
        self.k, self.fill = 1.0, fill

    def forward(self, h, t):
        with torch.autocast("cpu", enabled=False):
            emb = torch.cat([torch.sin(t[:, None] * self.k), t[:, None] * self.k], 1).float()
        new = h.new_zeros if self.fill == "zeros" else (lambda *s: h.new_full(s, float("nan")))
        out = new(h.shape[0], h.shape[1] + emb.shape[1])
        out[:, : h.shape[1]] = h
        out[:, h.shape[1]:] = emb  # copy_ into fp16: 1e5 -> inf
        return out


class CatNet(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.fc1, self.cat, self.fc2 = nn.Linear(8, 16), TimeConcat(fill), nn.Linear(18, 1)

    def forward(self, x, t):
        return self.fc2(self.cat(self.fc1(x), t))


@EVERY
@pytest.mark.parametrize("fill", ["zeros", "nan"])
def test_fp32_value_written_into_an_fp16_buffer_overflows(tmp_path, every, fill):
    """From step 3 the timestep embedding's linear part is t x 2e4 (t up to 10): finite in fp32, inf once written
    into the fp16 buffer. `fill="nan"`: the buffer is pre-filled with NaN (so that an unwritten slot shows) and
    every slot is then overwritten: the old NaN are not an input of the write."""
    torch.manual_seed(0)
    m, x, t = CatNet(fill), randn(16, 8), torch.linspace(0, 10, 16)

    def batch(i):
        if i == 3:
            m.cat.k = 2e4
        return (x, t)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.fc1(x)
        assert h.dtype == torch.float16 and torch.isfinite(h).all() and torch.isinf(m.cat(h, t)).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "cat")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::copy_"), f.one_line()
        no_error_at(rep, ("fc1", "fc2", ""))


class Aggregate(nn.Module):
    """GNN-style sum of messages per node, in place into a zero buffer: one hub node receives every message."""

    def __init__(self):
        super().__init__()
        self.msg = nn.Linear(16, 16)
        self.hub = False

    def forward(self, h):
        m = self.msg(h)
        dst = torch.zeros(m.shape[0], dtype=torch.long) if self.hub else torch.arange(m.shape[0])
        return torch.zeros_like(m).index_add_(0, dst, m)


class GraphNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.agg, self.head = nn.Linear(8, 16), Aggregate(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.agg(self.inp(x)))


@EVERY
def test_index_add_aggregation_overflows_in_the_aggregator(tmp_path, every):
    """Messages ~2e3 (finite); from step 3 all 64 go to node 0: the in-place index_add_ sums them to inf (loss
    scale 1: head's weight gradient, a sum over 64 rows of 2e3, stays finite)."""
    torch.manual_seed(0)
    m, x = GraphNet(), randn(64, 8)
    with torch.no_grad():
        m.agg.msg.bias.fill_(2e3)

    def batch(i):
        if i == 3:
            m.agg.hub = True
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None, init_scale=1.0)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        assert torch.isfinite(m.agg.msg(m.inp(x))).all() and torch.isinf(m.agg(m.inp(x))).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "agg")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::index_add_"), f.one_line()
        no_error_at(rep, ("inp", "agg.msg", "head", ""))


# -- 6. modules that return a view of their input, or their input unchanged, after another overflowed --------------
class KeepHalf(nn.Module):
    def forward(self, x):
        x.masked_fill_(self.pad, 0.0)  # padded rows zeroed in place; the inf in the others passes on
        return x[:, : x.shape[1] // 2]

    def __init__(self):
        super().__init__()
        self.register_buffer("pad", torch.arange(16)[:, None] >= 12, persistent=False)


class PassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.keep, self.ident, self.fc2 = (nn.Linear(8, 32), nn.Dropout(0.0), KeepHalf(),
                                                                nn.Identity(), nn.Linear(16, 1))

    def forward(self, x):
        return self.fc2(self.ident(self.keep(self.drop(self.fc1(x)))))


@EVERY
def test_passthrough_modules_after_an_overflow_are_not_blamed(tmp_path, every):
    torch.manual_seed(0)
    m, x = PassNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.fc1.weight.mul_(1e5)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        assert torch.isinf(m.fc1(x)[:, :16]).any()  # real, in the half that is kept
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "fc1")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::addmm"), f.one_line()
        no_error_at(rep, ("drop", "keep", "ident", "fc2", ""))


# -- 7. backward-only overflow through an in-place scale ---------------------------------------------------------------
class InScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 1.0

    def forward(self, x):
        return x.mul_(self.k)


class BwdNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale, self.head = nn.Linear(8, 16), InScale(), nn.Linear(16, 1)
        with torch.no_grad():
            self.lin.weight.mul_(1e-3)
            self.lin.bias.mul_(1e-3)

    def forward(self, x):
        return self.head(self.scale(self.lin(x)))


@EVERY
def test_backward_only_overflow_through_an_in_place_scale(tmp_path, every):
    """From step 3 `scale` multiplies lin's small output (~1e-3) by 1e4 in place: ~10, finite; the gradient
    through it (scaled loss: ~1e3 per element, x 1e4) is inf in fp16."""
    torch.manual_seed(0)
    m, x = BwdNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            m.scale.k = 1e4
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.skipped and r3.loss_finite is not False and first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "scale")
        assert (f.phase, f.step) == ("backward", 3), f.one_line()
        no_error_at(rep, ("head", ""))  # lin: its weight gradient (a sum over the batch) overflows at step 5


# -- 8. an in-place scale in the parent's own code (not in a child module) -------------------------------------------
class ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)
        self.k = 1.0

    def forward(self, x):
        h = self.fc1(x)
        h *= self.k  # in place, in the block's own forward: fc1's output tensor now holds inf
        return self.fc2(h)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = ScaledBlock()

    def forward(self, x):
        return self.block(x)


@EVERY
def test_in_place_scale_in_the_parent_is_the_parent_not_the_child_whose_output_it_mutated(tmp_path, every):
    """fc1's output was finite when fc1 returned; the block then multiplied that same tensor by 1e6 in place. The
    producer is `block` (its own `h *= k`), not fc1 (whose output tensor was mutated after it returned)."""
    torch.manual_seed(0)
    m, x = Outer(), randn(16, 8)

    def batch(i):
        if i == 3:
            m.block.k = 1e6
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "block")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::mul_"), f.one_line()
        no_error_at(rep, ("block.fc1", "block.fc2", ""))
        not_a_mask(rep)


# -- 9. sqrt_ of a variance that cancellation made negative, in place ----------------------------------------------------
class InPlaceRMS(nn.Module):
    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        sd = (x * x).mean(-1, keepdim=True).sub_(m * m).sqrt_()  # fp16 E[x²] - E[x]² < 0 -> NaN, in place
        return (x - m) / sd


class RMSNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(8, 32), InPlaceRMS(), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.norm(self.inp(x)))


@EVERY
def test_in_place_sqrt_of_a_negative_variance_is_nan_origin_at_the_norm(tmp_path, every):
    torch.manual_seed(0)
    m, x = RMSNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.inp.bias.fill_(200.0)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.inp(x)
        assert torch.isfinite(h).all() and torch.isnan(m.norm(h)).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "nan_origin", "norm")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::sqrt_"), f.one_line()
        no_error_at(rep, ("inp", "head", ""))


# -- 10. backward-only overflow inside a residual block with in-place add and in-place ReLU -------------------------
class BwdResBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.lin(x)
        out += x
        return self.relu(out)


class BwdResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(8, 16), BwdResBlock(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


@EVERY
def test_backward_only_overflow_in_a_block_with_in_place_residual_and_relu(tmp_path, every):
    """From step 3 block.lin's weights are x3e3 while its input is ~1e-3 (stem weights x1e-3): its output stays
    ~1, finite; the gradient it sends back (g @ W, the scaled g ~1e2 per element) is inf in fp16."""
    torch.manual_seed(0)
    m, x = BwdResNet(), randn(16, 8)
    with torch.no_grad():
        m.stem.weight.mul_(1e-3)
        m.stem.bias.mul_(1e-3)
        m.head.weight.fill_(1.0)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.block.lin.weight.mul_(3e3)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.skipped and r3.loss_finite is not False and first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "block.lin")
        assert (f.phase, f.step) == ("backward", 3), f.one_line()
        no_error_at(rep, ("block.relu", "head", ""))  # stem: its weight gradient (a batch sum) overflows at step 5


# -- 11. attention scores masked in place with -inf; a fully padded sample -> softmax NaN ------------------------------
class MaskedAttn(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, h, pad):
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 4.0
        scores.masked_fill_(pad[:, None, :], float("-inf"))  # in place; a sample whose keys are all padding
        return torch.softmax(scores, -1) @ v


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(8, 16), MaskedAttn(), nn.Linear(16, 1)

    def forward(self, x, pad):
        return self.head(self.attn(self.inp(x), pad))


@EVERY
def test_fully_masked_row_after_in_place_masked_fill_is_nan_origin_at_the_attention(tmp_path, every):
    torch.manual_seed(0)
    m, x = AttnNet(), randn(4, 6, 8)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[:, 4:] = True

    def batch(i):
        p = pad.clone()
        if i >= 3:
            p[1] = True  # from step 3 sample 1 is all padding (an empty sequence in the batch)
        return (x, p)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        assert torch.isnan(m(*batch(3))).any() and torch.isfinite(m.inp(x)).all()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "nan_origin", "attn")
        assert (f.phase, f.step) == ("forward", 3) and "softmax" in (f.op or ""), f.one_line()
        no_error_at(rep, ("inp", "attn.qkv", "head", ""))


# -- 12. a hand-written softmax with exp_ in place (no max subtracted) ------------------------------------------------
class HandSoftmax(nn.Module):
    def forward(self, s):
        e = s.exp_()  # in place on the scores: exp(12) = 1.6e5 -> inf in fp16, then inf / inf = NaN
        return e / e.sum(-1, keepdim=True)


class GateMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.score, self.soft, self.head = nn.Linear(8, 16), HandSoftmax(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.soft(self.score(x)))


@EVERY
def test_in_place_exp_of_a_hand_written_softmax_overflows_in_it(tmp_path, every):
    torch.manual_seed(0)
    m, x = GateMix(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.score.bias[:4] = 12.0
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        s = m.score(x)
        assert s.abs().max() < 20 and not torch.isfinite(m.soft(s)).all()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "soft")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::exp_"), f.one_line()
        no_error_at(rep, ("score", "head", ""))


# -- 13. a max-norm constraint applied to the weight in place inside forward: a pruned (all-zero) row -> 0 / 0 ------
class MaxNormLinear(nn.Linear):
    def forward(self, x):
        with torch.no_grad():  # renormalise the rows in place, as a max-norm constraint written by hand does
            self.weight.div_(self.weight.norm(dim=1, keepdim=True))
        return super().forward(x)


class PrunedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.proj, self.head = nn.Linear(8, 16), MaxNormLinear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.proj(torch.relu(self.inp(x)))))


@pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])
def test_in_place_weight_renorm_in_forward_of_a_zero_row_is_nan_origin_there(tmp_path, every):
    """From step 3 (a pruning step) proj's row 0 is all zeros: its forward divides it by its norm, 0 / 0, and the
    weight itself becomes NaN in the forward (not in an optimizer update). At every=1 the weights were read only
    at the step's sync, after the forward, and proj was 'already NaN when step 3 began: step 2's update wrote
    them'; a sampled step now also reads them when its forward begins. At the default sampling (strict xfail
    here first) the capture held the weights as the step's sync found them, already NaN, and the report said
    'already NaN when step 3 began': the first routine steps now note that proj's forward writes its weight
    (record/modstate.py), each batch keeps it as the forward found it, and the capture and the weight check use
    that copy."""
    torch.manual_seed(0)
    m, x = PrunedNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.proj.weight[0] = 0.0
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "nan_origin", "proj")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("inp", "head", ""))


# -- 14. backward-only overflow just before modules that return their input object (Identity, an in-place no-op) ----
class Touch(nn.Module):
    def forward(self, x):
        return x.clamp_(min=-6e4, max=6e4)  # in place, returns its input object; a no-op on these values


class BwdPassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale, self.ident, self.touch, self.head = (nn.Linear(8, 16), InScale(), nn.Identity(),
                                                                   Touch(), nn.Linear(16, 1))
        with torch.no_grad():
            self.lin.weight.mul_(1e-3)
            self.lin.bias.mul_(1e-3)

    def forward(self, x):
        return self.head(self.touch(self.ident(self.scale(self.lin(x)))))


@EVERY
def test_backward_only_overflow_is_not_blamed_on_passthrough_modules_after_it(tmp_path, every):
    """As test 7, with nn.Identity (returns its input object) and an in-place clamp_ (returns its input object,
    values unchanged) between `scale` and `head`: the gradient through them is the head's, finite; `scale`'s
    backward makes the inf."""
    torch.manual_seed(0)
    m, x = BwdPassNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            m.scale.k = 1e4
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.skipped and r3.loss_finite is not False and first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "scale")
        assert (f.phase, f.step) == ("backward", 3), f.one_line()
        no_error_at(rep, ("ident", "touch", "head", ""))  # lin: its weight gradient overflows at step 5


# -- 15. a running sum done in place (cumsum_) over a long sequence: linear-attention style ---------------------------
class CumKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.kv = nn.Linear(8, 16)

    def forward(self, x):
        s = self.kv(x)
        return s.cumsum_(1)  # in place over the sequence: the running sum passes 65504 late in a long sequence


class CumNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix, self.head = CumKV(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.mix(x) / x.shape[1])


@EVERY
def test_in_place_cumsum_over_a_long_sequence_overflows_in_it(tmp_path, every):
    """kv's outputs are ~300 (bias); sequences of 64 sum to ~2e4, finite; from step 3 the batch holds sequences
    of 256: the in-place running sum reaches ~8e4 -> inf."""
    torch.manual_seed(0)
    m = CumNet()
    with torch.no_grad():
        m.mix.kv.bias.fill_(300.0)
        m.mix.kv.weight.mul_(0.1)
    short, long = randn(2, 64, 8), randn(2, 256, 8)

    def batch(i):
        return (long if i >= 3 else short,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None, init_scale=1.0)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        s = m.mix.kv(long)
        assert torch.isfinite(s).all() and torch.isinf(m.mix(long)).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "mix")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::cumsum_"), f.one_line()
        no_error_at(rep, ("mix.kv", "head", ""))


# -- 16. logits divided in place by a learned temperature that collapsed ---------------------------------------------
class TempScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.0))

    def forward(self, logits):
        return logits.div_(self.t)


class TempNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.temp, self.head = nn.Linear(8, 16), TempScale(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.temp(self.fc(x)))


@EVERY
def test_in_place_division_by_a_collapsed_temperature_overflows_in_it(tmp_path, every):
    torch.manual_seed(0)
    m, x = TempNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.temp.t.fill_(1e-5)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "temp")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::div_"), f.one_line()
        no_error_at(rep, ("fc", "head", ""))


# -- 17. out= into a NaN-initialised workspace buffer (no_grad side computation) ----------------------------------------
class Workspace(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 1.0
        self.register_buffer("ws", torch.full((16, 16), float("nan"), dtype=torch.float16), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            torch.mul(x.detach(), self.k, out=self.ws)  # the workspace's old contents are never read
        return x + self.ws


class WsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ws, self.fc2 = nn.Linear(8, 16), Workspace(), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.ws(self.fc1(x)))


@EVERY
def test_out_into_a_nan_initialised_workspace_overflows_in_the_out_op(tmp_path, every):
    torch.manual_seed(0)
    m, x = WsNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            m.ws.k = 3e5
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "ws")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::mul"), f.one_line()
        no_error_at(rep, ("fc1", "fc2", ""))


# -- 18. the model scales its input batch in place (`x.div_(255)`) --------------------------------------------------
class PixelNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(64, 16), nn.Linear(16, 1)

    def forward(self, x):
        x.div_(255.0)  # in place on the caller's batch: raw pixels to [0, 1]
        return self.head(self.fc(x))


@EVERY
def test_model_scaling_its_input_in_place_is_replayed_from_the_raw_batch(tmp_path, every):
    """From step 3 fc's weights are 4000 (64 inputs): on [0, 1] inputs its output is ~1.3e5 -> inf. The capture must hold the
    raw batch (0..255) as the forward received it: one that held the batch after the forward's x.div_(255) would
    replay inputs /255 twice, finite, and the replay could not name the op. (It did: the capture kept references
    to the args. The watch sees the version counters of the root's inputs move during step 0's forward and keeps
    copies of the batches from then on.)"""
    torch.manual_seed(0)
    m = PixelNet()
    raw = (torch.rand(16, 64, generator=torch.Generator().manual_seed(1)) * 255).round()

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.fc.weight.fill_(4000.0)
        return (raw.clone(),)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        assert not torch.isfinite(m.fc(raw / 255)).all() and torch.isfinite(m.fc(raw / 255 / 255)).all()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "fc")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::addmm"), f.one_line()
        no_error_at(rep, ("head", ""))


# -- 19. a distance computed with sqrt_ in place: identical pairs make its gradient inf, then NaN (backward only) ----
class PairDist(nn.Module):
    def forward(self, a, b):
        return (a - b).pow(2).sum(-1).sqrt_()  # d/dx sqrt at 0 = inf: the backward of identical pairs


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dist = nn.Linear(8, 16), PairDist()

    def forward(self, x1, x2):
        return self.dist(self.enc(x1), self.enc(x2))


@EVERY
def test_backward_of_an_in_place_sqrt_at_zero_distance_is_named_at_the_distance(tmp_path, every):
    """From step 3 the batch holds pairs of identical inputs: the distance is 0 (finite forward); SqrtBackward
    divides by 2 * 0 -> inf, and the chain rule through (a - b) = 0 makes NaN. The producer is `dist`'s backward;
    enc only receives the NaN."""
    torch.manual_seed(0)
    m, x1, x2 = Siamese(), randn(16, 8), randn(16, 8, seed=1)

    def batch(i):
        return (x1, x1.clone() if i >= 3 else x2)
    w = loop(m, batch, lambda out, *a: out.float().mean(), every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.skipped and r3.loss_finite is not False and first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        got = [(f.rule, f.module) for f in rep.findings[:3]]
        assert ("overflow", "dist") in got or ("nan_origin", "dist") in got, lines(rep)
        f = next(f for f in rep.findings if f.module == "dist" and f.rule in ("overflow", "nan_origin"))
        assert (f.phase, f.step) == ("backward", 3), f.one_line()
        no_error_at(rep, ("enc", ""))

