"""Third set of failure-pattern variants, each starting mid-run at a known step, watched through the public API
only (watch -> ordinary loop -> w.report(), and diagnose(run_dir)), at the default sampling and at every=1: an
intermittent Linear overflow in a deep GELU/SiLU/tanh MLP, overflows in the backward only (x.pow(4), a custom
autograd Function), NaN from sqrt of a negative variance (a hand-written std), log(softmax) in a loss module,
0 * inf, an embedding with rows scaled up, a module called twice with the overflow on the second call, a wrapper
holding the real model as `.module`, and torch.compile. Real torch, real hooks, a real GradScaler; the right rule
at the producing module among the first three findings, at the step where it began. Where ampdoctor is wrong the
test is a strict xfail whose reason says what and where."""
import functools

import pytest
import torch
import torch.nn as nn

from scenarios import EVERY, amp_loop, both, lines, no_error_at, one_thread, randn, top3


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


loop = functools.partial(amp_loop, steps=8)


def mean_sq(out, *args):
    return out.float().pow(2).mean()


# -- 1. deep MLP with GELU/SiLU/tanh: one Linear overflows on one batch in five ------------------------------------
class DeepMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.SiLU(),
                                    nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        # an inf out of layers.4 would be absorbed by the Tanh (tanh(inf) = 1): the tests overflow layers.2

    def forward(self, x):
        return self.layers(x)


@EVERY
def test_intermittent_linear_overflow_in_a_deep_mlp(tmp_path, every):
    """layers.2 (after a GELU) has weights ×5000: its outputs are ~3.5e3 on ordinary batches, inf on the outlier
    batches (inputs ×20) of steps 3 and 8; the layers before it stay finite on those (< 1e3)."""
    torch.manual_seed(0)
    m = DeepMLP()
    with torch.no_grad():
        m.layers[2].weight.mul_(5000)
    x = randn(8, 16)

    def batch(i):
        return (x * 20 if i % 5 == 3 else x,)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = m.layers[:2](x * 20)
        assert h.abs().max() < 1e3 and not torch.isfinite(m.layers[2](h)).all()  # real: the outlier overflows
        assert torch.isfinite(m.layers[:3](x)).all()
    w = loop(m, batch, mean_sq, steps=10, every=every, run_dir=tmp_path / "r", lr=1e-5, init_scale=1024.0)
    assert [r.step for r in w.steps if r.skipped] == [3, 8]
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "layers.2")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        rules = [g.rule for g in rep.findings]
        if "skipped_steps" in rules:
            assert rules.index("skipped_steps") > rules.index("overflow"), lines(rep)
        no_error_at(rep, ("layers.0", "layers.1", "layers.3", "layers.4", "layers.5", "layers.6", "layers.8", ""))


# -- 2. overflow in the backward only: x.pow(4) with a finite forward ------------------------------------------------
class Quartic(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = 1.0

    def forward(self, h):
        return (h * self.gain).pow(4)


class PowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.quart = nn.Linear(8, 16), Quartic()

    def forward(self, x):
        return self.quart(torch.tanh(self.inp(x)))


@EVERY
def test_backward_only_overflow_of_pow4(tmp_path, every):
    """From step 3, quart's input is ~±12 (tanh × 12): x⁴ ≤ 20736 is finite; its gradient 4x³·g with the loss
    scale (g = 65536 / 256 per element) is not, until the scale has backed off to ~2048."""
    torch.manual_seed(0)
    m, x = PowNet(), randn(16, 8) * 3

    def batch(i):
        if i == 3:
            m.quart.gain = 12.0
        return (x,)
    w = loop(m, batch, lambda out, x: out.float().mean(), every=every, run_dir=tmp_path / "r", lr=1e-5)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.skipped and r3.loss_finite is not False and not any(r.skipped for r in w.steps if r.step < 3)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "quart")
        assert (f.phase, f.step) == ("backward", 3), f.one_line()
        no_error_at(rep, ("inp", ""))


# -- 3. a custom autograd Function whose backward multiplies by a large constant ------------------------------------
class Amplify(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class AmpBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.k = nn.Linear(16, 16), 1.0

    def forward(self, h):
        return Amplify.apply(self.lin(h), self.k)


class AmpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(8, 16), AmpBlock(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


@EVERY
def test_custom_function_backward_overflow(tmp_path, every):
    torch.manual_seed(0)
    m, x = AmpNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            m.block.k = 1e4  # forward unchanged; the gradient through block ×1e4 in fp16
        return (x,)
    w = loop(m, batch, lambda out, x: out.float().mean(), every=every, run_dir=tmp_path / "r", lr=1e-5,
             init_scale=4096.0)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.skipped and not any(r.skipped for r in w.steps if r.step < 3)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "block")
        assert (f.phase, f.step) == ("backward", 3), f.one_line()
        no_error_at(rep, ("inp", "head", ""))  # block.lin: its weight gradient (16 rows of ~4e4) overflows at step 7


# -- 4. a hand-written std with catastrophic cancellation: sqrt of a negative variance ------------------------------
class HandStd(nn.Module):
    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - m * m  # fp16: E[x²] - E[x]² goes negative for a large offset
        return (x - m) / torch.sqrt(var)


class StdNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(8, 32), HandStd(), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.norm(self.inp(x)))


@EVERY
def test_sqrt_of_negative_variance_is_nan_origin_at_the_norm(tmp_path, every):
    torch.manual_seed(0)
    m, x = StdNet(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.inp.bias.fill_(200.0)  # values 200 ± 1: x² ~ 4e4 with ulp 32, the difference is noise
        return (x,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-5, clip=None)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = m.inp(x)
        assert torch.isfinite(h).all() and torch.isnan(m.norm(h)).any()  # real: NaN from finite input
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "nan_origin", "norm")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("inp", "head", ""))


# -- 5. log(softmax(x)) in a loss module inside the model -----------------------------------------------------------
class SoftmaxNLL(nn.Module):
    def forward(self, logits, y):
        p = torch.softmax(logits, -1)  # fp16 on CPU autocast: the target's probability flushes to 0
        return -torch.log(p.gather(1, y[:, None])).mean()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.criterion = nn.Linear(16, 32), nn.Linear(32, 10), SoftmaxNLL()

    def forward(self, x, y):
        return self.criterion(self.head(torch.relu(self.body(x))), y)


@EVERY
def test_log_of_softmax_in_a_loss_module(tmp_path, every):
    torch.manual_seed(0)
    m, x, y = Classifier(), randn(16, 16), torch.arange(16) % 10

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.head.weight.mul_(60)  # logits ~±100 (finite): wrong classes' probabilities < 6e-8 -> 0
        return (x, y)
    w = loop(m, batch, lambda out, *a: out, every=every, run_dir=tmp_path / "r", lr=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        lg = m.head(torch.relu(m.body(x)))
        assert torch.isfinite(lg).all() and lg.abs().max() < 1e3 and not torch.isfinite(m.criterion(lg, y))
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "criterion")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("body", "head"))


# -- 6. 0 * inf: a gate exp(s) that overflows where the mask is 0 -> NaN only ----------------------------------------
class ExpGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(16, 16)

    def forward(self, h, mask):
        return h * torch.exp(self.score(h)) * mask


class GateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gate, self.head = nn.Linear(8, 16), ExpGate(), nn.Linear(16, 1)

    def forward(self, x, mask):
        return self.head(self.gate(self.inp(x), mask))


@EVERY
def test_zero_times_inf_is_named_at_the_gate(tmp_path, every):
    """From step 3 the gate's scores on the masked half reach ~20: exp = inf there, × mask 0 = NaN; the unmasked
    half stays finite. The first non-finite value is exp's +inf: an overflow in gate."""
    torch.manual_seed(0)
    m, x = GateNet(), randn(16, 8)
    mask = torch.cat([torch.ones(8), torch.zeros(8)])

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.gate.score.bias[8:] = 20.0
        return (x, mask)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        o = m.gate(m.inp(x), mask)
        assert torch.isnan(o).any() and not torch.isinf(o).any()  # real: NaN only, made by 0 * inf
    for rep in both(w, tmp_path / "r"):
        got = [(f.rule, f.module) for f in rep.findings[:3]]
        assert ("overflow", "gate") in got or ("nan_origin", "gate") in got, lines(rep)
        f = next(f for f in rep.findings if f.module == "gate" and f.rule in ("overflow", "nan_origin"))
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("inp", "head", "gate.score", ""))


# -- 7. an embedding whose rows are scaled up: the first Linear after it overflows ----------------------------------
class EmbNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.proj, self.act, self.head = nn.Embedding(50, 64), nn.Linear(64, 256), nn.GELU(), \
            nn.Linear(256, 1)

    def forward(self, ids):
        return self.head(self.act(self.proj(self.emb(ids))))


@EVERY
def test_embedding_rows_scaled_up_overflow_in_the_next_linear(tmp_path, every):
    """Rows 0-9 ×3e4 from step 3 (a bad re-init): the embedding (not autocast: fp32) returns values up to 1.2e5,
    finite; proj's autocast cast of them to fp16 is inf."""
    torch.manual_seed(0)
    m = EmbNet()
    ids = torch.arange(32).view(4, 8) % 50

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.emb.weight[:10].mul_(3e4)
        return (ids,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        e = m.emb(ids)
        assert e.dtype == torch.float32 and torch.isfinite(e).all() and e.abs().max() > 65504
        assert not torch.isfinite(m.proj(e)).all()  # real: proj's cast of its fp32 input to fp16 overflows
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "proj")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("act", "head", ""))


# -- 8. one module called twice (weight sharing), the overflow only on the second call ------------------------------
class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.boost = 1.0

    def forward(self, x):
        h = self.shared(torch.relu(self.inp(x)))
        h = self.shared(h * self.boost)  # second call: input ×boost
        return self.head(h)


@EVERY
def test_shared_module_overflow_on_its_second_call(tmp_path, every):
    torch.manual_seed(0)
    m, x = Twice(), randn(16, 8)
    with torch.no_grad():
        m.shared.weight.mul_(30)

    def batch(i):
        if i == 3:
            m.boost = 300.0
        return (x,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h1 = m.shared(torch.relu(m.inp(x)))
        assert torch.isfinite(h1).all() and (h1 * 300).abs().max() < 65504
        assert not torch.isfinite(m.shared(h1 * 300)).all()
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "shared")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        assert f.evidence.get("call") in (1, None), f.evidence
        # steps 0-2: GradScaler's first search (the loss gradient overflows at 65536), cut short by step 3's
        # failure; not an error outside the model
        no_error_at(rep, ("inp", "head", "", None))


# -- 9. a wrapper holding the real model as `.module` ------------------------------------------------------------------
class Wrapper(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *a, **k):
        return self.module(*a, **k)


@EVERY
def test_overflow_inside_a_module_wrapper(tmp_path, every):
    torch.manual_seed(0)
    m = Wrapper(DeepMLP())
    x = randn(8, 16)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.module.layers[2].weight.mul_(2e5)
        return (x,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", lr=1e-5)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "module.layers.2")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("module", "module.layers", "module.layers.3", "module.layers.4", ""))


# -- 10. torch.compile (aot_eager) with an overflow mid-run: the replay names the layer -----------------------------
def test_compiled_model_overflow_mid_run_is_named_by_the_replay(tmp_path):
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        m = DeepMLP()
        x = randn(8, 16)
        compiled = torch.compile(m, backend="aot_eager")

        def batch(i):
            if i == 3:
                with torch.no_grad():
                    m.layers[2].weight.mul_(2e5)
            return (x,)
        w = loop(m, batch, mean_sq, steps=6, run_dir=tmp_path / "r", lr=1e-5, call=compiled)
        for rep in both(w, tmp_path / "r"):
            f = top3(rep, "overflow", "layers.2")
            assert (f.phase, f.step) == ("forward", 3), f.one_line()
    finally:
        torch._dynamo.reset()


# -- an overflow made in place (x.mul_(k) inside a module) -------------------------------------------------------------
class Boost(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 1.0

    def forward(self, x):
        return x.mul_(self.k)  # in place: the op's output is its input's storage


class BoostNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.boost, self.fc2 = nn.Linear(8, 16), Boost(), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.boost(self.fc1(x))))


@EVERY
def test_in_place_overflow_is_the_in_place_op(tmp_path, every):
    """From step 3 `boost` multiplies fc1's output by 1e5 in place: inf, then fc2's addmm makes NaN of it. The
    replay judged the in-place mul_ by its inputs after it ran (already inf: a propagator) and named fc2's addmm
    `nan_origin` ('from NaN-free inputs'); the inputs are judged before the op now."""
    torch.manual_seed(0)
    m, x = BoostNet(), randn(32, 8)

    def batch(i):
        if i == 3:
            m.boost.k = 1e5
        return (x,)
    w = loop(m, batch, lambda out, x: out.float().mean(), every=every, run_dir=tmp_path / "r", lr=1e-4)
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "boost")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("fc1", "fc2"))
