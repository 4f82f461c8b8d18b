"""BACKWARD-ONLY fp16 failures: the forward (and the loss) is finite everywhere, and one module's own backward makes
the inf/NaN from a finite incoming gradient. The report must name that module (phase backward), not a module that
only passed the non-finite gradient on.

Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=sc)` at the default settings ->
probe_harness.train_loop: fp16 CPU autocast, `GradScaler("cpu", init_scale=1024)`, scale(loss).backward -> unscale_
-> clip_grad_norm_(1.0) -> step -> update -> close() -> report()). Each failure is first proven by the test's own
oracle (probe_harness.Producer with backward hooks: no module's output is ever non-finite, no loss is non-finite, the
first module whose input gradient (or own parameters' gradient) is non-finite while the gradient reaching its outputs
was finite is the producer, at that step, and the scaler skips that step first), plus each case's mechanism checked
directly (fp16 only, or at every loss scale down to 1). A failing oracle is a plain failure, never an xfail. Then the
rule (CONTRACT.md id: overflow / nan_origin; loss_scale_collapse where the failure repeats every step) at the
producer, at the oracle's step, phase backward where the finding states one, with severity warning or error, among
the first three findings; a wrong report raises WrongAnswer (strict xfail via `wrong`).

Cases (each goes bad at step 4 unless said):
 1. a learnable complex filterbank (bias-free) with power-law compression (re^2 + im^2)^0.15 (|X|^0.3): a short
    clip zero-padded at step 4 gives re = im = 0 exactly; pow's backward at 0 is inf, 2 re * inf NaN (`compress`).
 2. a Siamese embedder with an angular loss acos(cos.clamp(-1, 1)): the augmentation worker returns identical views
    for four pairs at step 4; their fp16 cosine is exactly 1.0, acos' = -1/sqrt(0) = -inf (`angle`).
 3. a geo-locator's latitude head asin(tanh(z)) ("tanh keeps asin in range"): a near-pole sample with loud
    features saturates tanh to exactly 1.0 in fp16; asin' = inf times tanh' = 0 is NaN (`lat`).
 4. label-smoothed cross-entropy through a custom autograd.Function SafeLog (forward log(p.float().clamp_min(1e-12)),
    backward g / p in fp16): one over-confident sample's fp16 softmax underflows to 0 -> g / 0 (`logp`).
 5. MIL sound-event tagging with a custom LogSumExp pooling Function: forward max-shifted (finite), backward
    exp(x) / sum exp(x) computed in fp16 without the shift; a loud frame's logit > 11.1 gives inf / inf (`pool`).
 6. a regression head initialised to the targets' std (weights up to ~1.6e3) on LayerScale(3e-4) features, under
    GradScaler(init_scale=1.0): from step 4 the target feed stops standardising (raw units, ~1e5); the gradient
    reaching `head` is finite in fp16, dL/dx = g W is not, at every scale from 1 down to 2^-7 (steps 4-11 all
    skipped) -> overflow at `head` (backward) and loss_scale_collapse.
 7. a Switch-style net, every block under torch.utils.checkpoint(use_reentrant=False), blocks.1 an MoE block whose
    router scales its output by (1 + sum p log p) written with torch.where(p > 0, p * log p, 0): a token of raw
    magnitude makes the fp16 softmax underflow to 0; where's backward sends 0 to p * log p, 0 * -inf = NaN in the
    recomputed backward (`blocks.1.gate`). The -inf of log(0) is made in the forward and hidden by the where, so a
    forward finding naming aten::log is accepted too (probe_harness.error_at's `hidden_op` convention).
 8. a classifier returning its own loss (HF style) with a focal loss gamma = 0.5 in a `criterion` submodule: an
    easy sample's fp16 softmax rounds to exactly 1.0, (1 - p)^0.5 has an infinite derivative at 0 (`criterion`).
 9. an attention classifier with an L1/2 sparsity penalty (sum A^0.5)^2 on its attention rows in a `sparsity`
    module: a token of raw magnitude makes some fp16 softmax entries exactly 0 (none in fp32); pow' at 0 is inf.
10. case 3's model with the near-pole station in every batch from step 4 (NaN at every scale): overflow/nan_origin
    at `lat` step 4 and loss_scale_collapse.
Healthy twins (no warning, no error): 1 with (re^2 + im^2 + 1e-4)^0.15 in fp32; 2 with cos clamped to +-(1 - 1e-3);
4 with F.log_softmax.

Result when written (torch 2.13 CPU): 13 pass, 0 xfail (stable over two runs, ~3 s). Top findings:
 1. `[error] overflow at compress aten::pow step 4 (backward)`, `[warning] skipped_steps step 4`.
 2. `[error] overflow at angle aten::rsqrt step 4 (backward)`, `[warning] skipped_steps step 4`.
 3. `[error] overflow at lat aten::rsqrt step 4 (backward)`, `[warning] skipped_steps step 4`.
 4. `[error] overflow at logp aten::div step 4 (backward)`, `[warning] skipped_steps step 4`.
 5. `[error] overflow at pool aten::exp step 4 (backward)`, `[warning] skipped_steps step 4`.
 6. `[error] overflow at head aten::mm step 4 (backward)`, `[error] loss_scale_collapse (module null) step 5`
    (the first skip is step 4; case 10's collapse names its layer and step 4).
 7. `[error] overflow at blocks.1.gate aten::log step 4` phase FORWARD, `[error] underflow at blocks.1.gate aten::log
    step 4` (forward): right module and step, the hidden -inf of log(0) rather than the backward NaN (accepted as
    the hidden op; no finding says phase backward).
 8. `[error] overflow at criterion aten::pow step 4 (backward)`, `[warning] skipped_steps step 4`.
 9. `[error] overflow at sparsity aten::pow step 4 (backward)`, `[warning] skipped_steps step 4`.
10. `[error] overflow at lat aten::rsqrt step 4 (backward)`, `[error] loss_scale_collapse at lat step 4`.
 Twins: quiet.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from probe_harness import WrongAnswer, finite, real_bwd, train_loop
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

BAD = 4
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# the run, the oracle's checks, the report's checks
# ======================================================================================================================
def run(m, batch, loss_fn, steps=8, lr=1e-3, whole=False, init_scale=1024.0):
    """probe_harness.train_loop with the backward oracle at ampdoctor's default sampling. `batch(i)` gives the
    model's inputs then the target; the model gets the inputs only (`whole`: all of them, target included)."""
    call = m if whole else (lambda *a: m(*a[:-1]))
    r = train_loop(m, batch, loss_fn, steps, backward=True, lr=lr, call=call, init_scale=init_scale)
    r["rep"] = r["w"].report()
    return r


def bwd_only(r, name, step, skips=None):
    """The oracle: forward and loss finite all run, `name` the first backward producer at `step`, the first skip
    there (and, `skips`, exactly those steps skipped)."""
    assert r["bad_loss"] == [] and r["first"] is None, (r["bad_loss"], r["first"])
    real_bwd(r, name, step)
    if skips is not None:
        assert r["skipped"] == list(skips), r["skipped"]


def expect(rep, rules, module, step, phase="backward", hidden_op=None):
    """One of `rules` at `module` (... : any), at `step` (an int or a range), warning/error, in `phase` where the
    finding states one, among the first three; else WrongAnswer. `hidden_op`: a forward finding naming that op is
    accepted too (probe_harness.error_at's convention: an op inside the producer made the inf in the forward and
    the module's own code hid it, the NaN coming out in the backward)."""
    rules = (rules,) if isinstance(rules, str) else rules
    steps = step if isinstance(step, range) else (step,)
    for f in rep.findings[:3]:
        if f.rule in rules and (module is ... or f.module == module) and f.step in steps \
                and f.severity in ("warning", "error") \
                and (phase is None or f.phase in (None, phase) or hidden_op is not None and f.op == hidden_op):
            return f
    raise WrongAnswer(f"wanted {rules} at {module!r} step {step} ({phase}); got: {lines(rep)[:3]}")


def quiet(r):
    """The twin was healthy (finite losses, no producer forward or backward, no skip, it learned); ampdoctor quiet."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None and r["first_bwd"] is None, (r["first"], r["first_bwd"])
    assert r["skipped"] == [], r["skipped"]
    assert sum(ls[-2:]) < sum(ls[:2]), ls
    rep = r["rep"]
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


def grad_finite(f, x, scale=1.0):
    """Whether d(scale * f(x).sum())/dx is finite, the forward under fp16 autocast (the forward asserted finite)."""
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = f(x)
    assert finite(y), y
    g, = torch.autograd.grad(y.float().sum() * scale, x)
    return finite(g)


def ce(out, *args):
    return F.cross_entropy(out.float(), args[-1])


# ======================================================================================================================
# 1./twin. power-law compressed magnitude of a learnable complex filterbank: zero-padded frames
# ======================================================================================================================
class Compress(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, re, im):
        if self.fix:
            return (re.float() ** 2 + im.float() ** 2 + 1e-4).pow(0.15)
        return (re * re + im * im).pow(0.15)                     # |X|^0.3: finite at 0, d/dx infinite there


class SpecNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        torch.manual_seed(0)
        self.fb = nn.Linear(32, 32, bias=False)                  # 16 complex filters (re | im)
        self.compress = Compress(fix)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        re, im = self.fb(x).chunk(2, -1)
        return self.head(self.compress(re, im).mean(1))


SPEC_W = torch.randn(32, 4, generator=gen(11))


def spec_batch(i):
    x = torch.randn(8, 12, 32, generator=gen(100 + i % 4))
    y = (x.abs().mean(1) @ SPEC_W.abs() + torch.randn(8, 4, generator=gen(7)) * 0.1).argmax(-1)
    if i == BAD:
        x = x.clone()
        x[2, 5:] = 0.0                                           # a short clip, zero-padded to the batch length
    return x, y


def test_power_compressed_magnitude_of_zero_padded_frames_is_nan_in_compress_backward():
    m = SpecNet()
    z = torch.zeros(1, 32)
    assert not grad_finite(lambda x: m.compress(*m.fb(x).chunk(2, -1)), z)        # the mechanism: pow' at 0
    r = run(m, spec_batch, ce)
    bwd_only(r, "compress", BAD, skips=[BAD])
    expect(r["rep"], FWD, "compress", BAD)


def test_twin_power_compression_with_eps_in_fp32_is_quiet():
    quiet(run(SpecNet(fix=True), spec_batch, ce))


# ======================================================================================================================
# 2./twin. angular loss acos(cos.clamp(-1, 1)) of identical views
# ======================================================================================================================
class Angle(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.lim = 1 - 1e-3 if fix else 1.0

    def forward(self, a, b):
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        return torch.acos(cos.clamp(-self.lim, self.lim))      # "clamped, so acos is safe"


class Siamese(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.angle = Angle(fix)

    def forward(self, a, p, n):
        ea, ep, en = self.enc(a), self.enc(p), self.enc(n)
        return (self.angle(ea, ep) + F.relu(1.5 - self.angle(ea, en))).float().mean()


def pair_batch(i):
    """(anchor, positive, negative, None)."""
    g = gen(200 + i % 4)
    c = torch.randn(4, 16, generator=g) * 2
    ka, kn = torch.arange(16) % 4, (torch.arange(16) + 1) % 4
    a = c[ka] + torch.randn(16, 16, generator=g)
    p = c[ka] + torch.randn(16, 16, generator=g)
    n = c[kn] + torch.randn(16, 16, generator=g)
    if i == BAD:
        p = p.clone()
        p[:4] = a[:4]                                            # the augmentation worker fell back to identity
    return a, p, n, None


def own(out, *args):
    return out


def test_acos_of_identical_views_is_infinite_in_angle_backward():
    m = Siamese()
    a = pair_batch(BAD)[0][:4]
    with torch.autocast("cpu", dtype=torch.float16):
        e = m.enc(a)
    assert (((e * e).sum(-1) / (e.norm(dim=-1) * e.norm(dim=-1))) == 1).any()       # exactly 1.0 in fp16
    r = run(m, pair_batch, own)
    bwd_only(r, "angle", BAD, skips=[BAD])
    expect(r["rep"], FWD, "angle", BAD)


def test_twin_acos_with_a_margin_clamp_is_quiet():
    quiet(run(Siamese(fix=True), pair_batch, own))


# ======================================================================================================================
# 3. latitude head asin(tanh(z)): tanh saturates to exactly 1.0 in fp16
# ======================================================================================================================
class Latitude(nn.Module):
    def forward(self, z):
        return torch.asin(torch.tanh(z))                         # in (-pi/2, pi/2)


class GeoNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.z = nn.Linear(32, 1)
        self.lat = Latitude()

    def forward(self, x):
        return self.lat(self.z(self.enc(x)))[:, 0]


GEO_W = torch.randn(12, generator=gen(31)) * 0.3


def geo_batch(i):
    x = torch.randn(16, 12, generator=gen(300 + i % 4))
    if i == BAD:
        x = x.clone()
        x[6] *= 200                                                # a station near the pole, loud sensors
    return x, torch.asin(torch.tanh(x @ GEO_W)).clamp(-1.4, 1.4)


def mse(out, *args):
    return F.mse_loss(out.float(), args[-1])


def test_asin_of_saturated_tanh_latitude_is_nan_in_lat_backward():
    m = GeoNet()
    assert grad_finite(lambda z: torch.asin(torch.tanh(z.float())), torch.full((1,), 6.0))   # fp32: finite
    assert not grad_finite(lambda z: torch.asin(torch.tanh(z.half())), torch.full((1,), 6.0))
    r = run(m, geo_batch, mse)
    bwd_only(r, "lat", BAD, skips=[BAD])
    expect(r["rep"], FWD, "lat", BAD)


# ======================================================================================================================
# 4./twin. label-smoothed CE through a custom SafeLog Function: backward g / p, p underflowed to 0
# ======================================================================================================================
class SafeLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p):
        ctx.save_for_backward(p)
        return torch.log(p.float().clamp_min(1e-12)).to(p.dtype)    # "upcast and clamped: never -inf"

    @staticmethod
    def backward(ctx, g):
        p, = ctx.saved_tensors
        return g / p                                               # in p's dtype (fp16)


class LogProb(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, z):
        if self.fix:
            return F.log_softmax(z, -1)
        return SafeLog.apply(torch.softmax(z, -1))


class Classifier(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.cls = nn.Linear(64, 8)
        self.logp = LogProb(fix)

    def forward(self, x):
        return self.logp(self.cls(self.body(x)))


CLS_W = torch.randn(16, 8, generator=gen(41))


def cls_batch(i):
    x = torch.randn(32, 16, generator=gen(400 + i % 4))
    y = (x @ CLS_W).argmax(-1)
    if i == BAD:
        x = x.clone()
        x[9] *= 40                                                # an un-normalised record
    return x, y


def smoothed(logp, *args):
    q = F.one_hot(args[-1], 8).float() * 0.9 + 0.1 / 8
    return -(q * logp.float()).sum(-1).mean()


def test_custom_safelog_backward_divides_by_an_underflowed_softmax_in_logp():
    m = Classifier()
    with torch.autocast("cpu", dtype=torch.float16):
        p = torch.softmax(m.cls(m.body(cls_batch(BAD)[0][9:10])), -1)
    assert (p == 0).any() and (torch.softmax(m.cls(m.body(cls_batch(BAD)[0][9:10])).float(), -1) > 0).all()
    r = run(m, cls_batch, smoothed)
    bwd_only(r, "logp", BAD, skips=[BAD])
    expect(r["rep"], FWD, "logp", BAD)


def test_twin_log_softmax_is_quiet():
    quiet(run(Classifier(fix=True), cls_batch, smoothed))


# ======================================================================================================================
# 5. MIL tagging with a custom LogSumExp pooling Function: backward exp(x) / sum exp(x) without the max shift
# ======================================================================================================================
class LSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        mx = x.amax(1, keepdim=True)
        return (mx + (x - mx).exp().sum(1, keepdim=True).log()).squeeze(1)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        e = x.exp()                                                  # fp16, no shift: inf above 11.1
        return g.unsqueeze(1) * e / e.sum(1, keepdim=True)


class LSEPool(nn.Module):
    def forward(self, x):
        return LSE.apply(x)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frame = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
        self.pool = LSEPool()

    def forward(self, x):
        return self.pool(self.frame(x))


def tag_batch(i):
    g = gen(500 + i % 4)
    x = torch.randn(8, 10, 20, generator=g)
    y = (torch.rand(8, 5, generator=g) < 0.3).float()
    if i == BAD:
        x = x.clone()
        x[3, 4] *= 600                                               # one clipped, very loud frame
    return x, y


def bce(out, *args):
    return F.binary_cross_entropy_with_logits(out.float(), args[-1])


def test_custom_logsumexp_pool_backward_without_max_shift_is_nan_in_pool():
    m = Tagger()
    with torch.autocast("cpu", dtype=torch.float16):
        z = m.frame(tag_batch(BAD)[0])
    assert z.abs().max() > 11.1 and finite(z)                        # exp overflows fp16, the forward does not
    r = run(m, tag_batch, bce)
    bwd_only(r, "pool", BAD, skips=[BAD])
    expect(r["rep"], FWD, "pool", BAD)


# ======================================================================================================================
# 6. a head with weights ~125 on LayerScale(1e-3) features: dL/dx overflows at every loss scale down to 1
# ======================================================================================================================
class LayerScale(nn.Module):
    def __init__(self, d, init=3e-4):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, x):
        return x * self.gamma


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(8, 64), nn.Tanh())
        self.ls = LayerScale(64)
        self.head = nn.Linear(64, 1, bias=False)
        with torch.no_grad():                                        # init: output std matched to the targets' (1)
            self.head.weight.mul_(1.0 / (self.head(self.ls(self.enc(torch.randn(256, 8, generator=gen(61)))))
                                         .std()))

    def forward(self, x):
        return self.head(self.ls(self.enc(x)))[:, 0]


REG_W = torch.randn(8, generator=gen(62))
RAW_FROM, REG_STEPS = BAD, 12


def reg_batch(i):
    x = torch.randn(16, 8, generator=gen(600 + i % 4))
    y = torch.tanh(x @ REG_W)
    return x, (y * 3000 + 1e5 if i >= RAW_FROM else y)            # the target feed stops standardising





def test_large_head_weights_overflow_the_input_gradient_at_every_scale_and_collapse_the_scale():
    m = Regressor()
    assert 1024 < m.head.weight.abs().max() < 1e4, m.head.weight.abs().max()
    x, y = reg_batch(RAW_FROM)
    h = m.ls(m.enc(x))
    assert not grad_finite(lambda h: F.mse_loss(m.head(h).float()[:, 0], y), h, scale=1.0)     # at scale 1
    assert not grad_finite(lambda h: F.mse_loss(m.head(h).float()[:, 0], y), h, scale=2 ** -(REG_STEPS - 1 - BAD))
    r = run(m, reg_batch, mse, steps=REG_STEPS, init_scale=1.0)
    bwd_only(r, "head", RAW_FROM, skips=range(RAW_FROM, REG_STEPS))
    rep = r["rep"]
    expect(rep, FWD, "head", RAW_FROM)
    expect(rep, "loss_scale_collapse", ..., range(RAW_FROM, REG_STEPS), phase=None)


# ======================================================================================================================
# 7. checkpointed Switch-style blocks: the MoE router's where(p > 0, p log p, 0) in the recomputed backward
# ======================================================================================================================
class Gate(nn.Module):
    def __init__(self, d, e):
        super().__init__()
        self.router = nn.Linear(d, e)

    def forward(self, h):
        p = torch.softmax(self.router(h), -1)
        ent = torch.where(p > 0, p * p.log(), 0).sum(-1, keepdim=True)   # "0 log 0 = 0"
        return p, ent


class Dense(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, h):
        return h + self.ff(h)


class MoE(nn.Module):
    def __init__(self, d, e=4):
        super().__init__()
        self.gate, self.experts, self.e = Gate(d, e), nn.Linear(d, d * e), e

    def forward(self, h):
        p, ent = self.gate(h)
        mix = (p.unsqueeze(-1) * self.experts(h).unflatten(-1, (self.e, -1))).sum(-2)
        return h + mix * (1 + ent)                                       # confidence-weighted expert mix


class Switch(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Dense(d), MoE(d), Dense(d)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False)
        return self.head(h.mean(1))


def sw_batch(i):
    g = gen(700 + i % 4)
    x = torch.randn(8, 6, 8, generator=g)
    y = (x.mean(1)[:, :3]).argmax(-1)
    if i == BAD:
        x = x.clone()
        x[5, 2] *= 80                                                    # one token of raw magnitude
    return x, y


def test_checkpointed_moe_router_entropy_where_guard_is_nan_in_the_gate_backward():
    m = Switch()
    with torch.autocast("cpu", dtype=torch.float16):
        h = m.blocks[0](m.inp(sw_batch(BAD)[0]))
        p, _ = m.blocks[1].gate(h)
    assert (p == 0).any()                                                # the fp16 softmax underflowed
    r = run(m, sw_batch, ce)
    bwd_only(r, "blocks.1.gate", BAD, skips=[BAD])
    expect(r["rep"], FWD, "blocks.1.gate", BAD, hidden_op="aten::log")


# ======================================================================================================================
# 8. focal loss gamma 0.5 inside the model: (1 - p)^0.5 at p == 1.0 exactly
# ======================================================================================================================
class Focal(nn.Module):
    def __init__(self, gamma=0.5):
        super().__init__()
        self.gamma = gamma

    def forward(self, z, y):
        p = torch.softmax(z, -1).gather(1, y[:, None])[:, 0]
        return -((1 - p) ** self.gamma * p.float().clamp_min(1e-6).log()).float().mean()


class FocalNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 6))
        self.criterion = Focal()

    def forward(self, x, y):
        return self.criterion(self.body(x), y)


FOC_W = torch.randn(16, 6, generator=gen(81))


def focal_batch(i):
    x = torch.randn(32, 16, generator=gen(800 + i % 4))
    y = (x @ FOC_W).argmax(-1)
    if i == BAD:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            z = FocalNet().body(x * 100)
        x, y = x.clone(), y.clone()
        x[11] *= 100                                                     # an easy sample, very confidently right
        y[11] = z[11].argmax()
    return x, y


def own_loss(out, *args):
    return out


def test_focal_loss_fractional_gamma_at_p_exactly_one_is_infinite_in_criterion_backward():
    m = FocalNet()
    x, y = focal_batch(BAD)
    with torch.autocast("cpu", dtype=torch.float16):
        p = torch.softmax(m.body(x[11:12]), -1)
    assert p.max() == 1.0 and p.float().max() == 1.0, p
    r = run(m, focal_batch, own_loss, whole=True)
    bwd_only(r, "criterion", BAD, skips=[BAD])
    expect(r["rep"], FWD, "criterion", BAD)


# ======================================================================================================================
# 9. an L1/2 sparsity penalty on attention probabilities, sum(sqrt-by-pow(A, 0.5))^2: fp16 softmax zeros
# ======================================================================================================================
class Attn(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h):
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / 4.0, -1)
        return a @ self.v(h), a


class Sparsity(nn.Module):
    def forward(self, a):
        return a.pow(0.5).sum(-1).pow(2).mean()                  # the L1/2 quasi-norm of each attention row


class SparseAttnNet(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, d)
        self.attn = Attn(d)
        self.sparsity = Sparsity()
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h, a = self.attn(self.inp(x))
        return self.head(h.mean(1)), self.sparsity(a)


def sa_batch(i):
    g = gen(900 + i % 4)
    x = torch.randn(8, 10, 8, generator=g)
    y = x.mean(1)[:, :3].argmax(-1)
    if i == BAD:
        x = x.clone()
        x[1, 7] *= 9                                                     # one token of raw magnitude
    return x, y


def ce_plus_penalty(out, *args):
    logits, pen = out
    return F.cross_entropy(logits.float(), args[-1]) + 1e-2 * pen.float()


def test_l_half_sparsity_penalty_on_underflowed_attention_is_infinite_in_sparsity_backward():
    m = SparseAttnNet()
    x = sa_batch(BAD)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        _, a16 = m.attn(m.inp(x))
    _, a32 = m.attn(m.inp(x))
    assert (a16 == 0).any() and not (a32 == 0).any()                    # zeros in fp16 only
    r = run(m, sa_batch, ce_plus_penalty)
    bwd_only(r, "sparsity", BAD, skips=[BAD])
    expect(r["rep"], FWD, "sparsity", BAD)


# ======================================================================================================================
# 10. case 3's latitude head with the near-pole station in every batch from step 4: NaN at every loss scale
# ======================================================================================================================
LAT_STEPS = 14


def geo_batch_from(i):
    x, y = geo_batch(i if i < BAD else BAD)
    return (x + 0.01 * torch.randn(x.shape, generator=gen(350 + i)) if i > BAD else x), y


def test_asin_latitude_nan_every_step_from_4_collapses_the_loss_scale():
    r = run(GeoNet(), geo_batch_from, mse, steps=LAT_STEPS)
    bwd_only(r, "lat", BAD, skips=range(BAD, LAT_STEPS))
    rep = r["rep"]
    expect(rep, FWD, "lat", BAD)
    expect(rep, "loss_scale_collapse", ..., range(BAD, LAT_STEPS), phase=None)
