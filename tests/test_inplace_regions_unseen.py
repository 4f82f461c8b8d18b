"""fp16 failures (forward inf/NaN) made by modules that work IN PLACE or inside NESTED AUTOCAST REGIONS, where naming
the producer is harder than for an ordinary out-of-place op: an in-place op rewrites a tensor another module already
returned (so that module's output, or the producer's own input, later reads non-finite), or the inf comes from a cast
at a region boundary rather than from arithmetic. Not built by the earlier probes (test_unseen_variants*: index_add_
GNN sums, masked_fill(-1e9) crashes, custom_fwd under bf16, autocast(enabled=False) eps guards).

Watched through the public API only: tests/probe_harness.py's probe_run (ampdoctor.watch(model, optimizer=AdamW,
scaler=GradScaler("cpu"), run_dir=...) at the default settings, fp16 CPU autocast, unscale_ + clip, 10 steps), the
bad batch at step 5. Each failure is first proven by this file's own oracle, InplaceProducer (a failing oracle is a
plain failure, never an xfail): forward PRE-hooks note whether a module's inputs are finite before its forward runs
(the harness's Producer reads them after, when an in-place op may already have turned them inf), forward hooks then
name the first (module, step, call) whose output is non-finite from finite inputs and finite own parameters; the loss
is non-finite there and the scaler skips it (probe_harness.real_fwd_after_backoffs). Then the rule (CONTRACT.md id)
at that module and step, forward, among the first three findings with severity warning or error; a wrong report
raises WrongAnswer (to be marked a strict xfail via probe_harness.wrong; none needed when written).

Cases (producer per the oracle, all at step 5, forward):
 1. nn.ReLU(inplace=True) right after fc1, a sentinel row (60000) overflows fc1's addmm (overflow at fc1).
 2. timm-style LayerScale(inplace=True), `x.mul_(gamma)` on fc1's finite output (overflow at ls).
 3. graph sum-pooling by `scatter_add_` into an fp16 buffer, one 6000-node graph (overflow at pool).
 4. Poisson rate head `self.lin(h).exp_()`, unnormalised features (overflow at head, not head.lin).
 5. residual blocks `h += self.ff(h)`, every ff output finite, the in-place add overflows (overflow at layers.1).
 6. one Gain module called twice: the out-of-place first call is finite, the in-place second call (`x.mul_(g)`) on
    the spiking branch overflows (overflow at gain, call 2).
 7. an `autocast(enabled=False)` region computing mean(h^2) in fp32, `.half()`-ed back: the cast is the producer
    (overflow at energy).
 8. a bf16 autocast region nested in the fp16 one: its bf16 output (~1e5) is finite, the next Linear's autocast cast
    to fp16 makes the inf (overflow / nan_origin at out_proj).
 9. squared-ReLU autograd Function under `custom_fwd(device_type="cpu", cast_inputs=torch.float16)` / `custom_bwd`:
    relu(x)^2 past |x| = 256 (overflow at act).
10. additive key mask `(1 - mask) * finfo(float32).min` in fp16 (-inf) added in place (`scores.add_`), an empty
    sequence's row all -inf -> NaN softmax (mask_value_overflow at attn).
11. L2 normaliser with an in-place epsilon `.add_(1e-8)` (0 in fp16) on an all-zero row: 0/0 (eps_underflow at l2).
Healthy twins (no warning, no error): 7 returning log1p(energy) from the fp32 region; 9 with cast_inputs=
torch.float32 (the LayerNorm after it brings the fp32 values back); 10 with the bias -1e4. In twins 7 and 9 the
spike's scaled backward overflows fp16 once at step 5: an ordinary GradScaler skip, allowed (ampdoctor: info only).

Result when written: 14 pass, 0 xfail (stable over two runs). Top finding per case:
 1. `[error] overflow at fc1 aten::addmm step 5`      2. `[error] overflow at ls aten::mul_ step 5`
 3. `[error] overflow at pool aten::scatter_add_ step 5`   4. `[error] overflow at head aten::exp_ step 5`
 5. `[error] overflow at layers.1 aten::add_ step 5`   6. `[error] overflow at gain aten::mul_ step 5`
 7. `[error] overflow at energy aten::_to_copy step 5` 8. `[error] overflow at out_proj aten::_to_copy step 5`
 9. `[error] overflow at act aten::pow step 5`         10. `[error] mask_value_overflow at attn aten::mul step 5`
11. `[error] eps_underflow at l2 aten::add_ step 5`, then `[error] nan_origin at l2 aten::div step 5`.
 Twins: only `[info]` (the first steps' backoff overflow at fc2, skipped_steps "a normal rate").
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import WrongAnswer, finite, probe_run, quiet_twin, real_fwd_after_backoffs
from scenarios import lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

STEPS, BAD = 10, 5


def gen(i):
    return torch.Generator().manual_seed(7000 + i)


class InplaceProducer:
    """The forward producer oracle, safe against in-place ops: a forward PRE-hook notes whether a module's inputs
    (positional and keyword) are finite before its forward runs (an in-place op inside it, or after it, may turn
    them non-finite before the forward hook looks); the forward hook then names the first (module, step, call)
    whose output is non-finite while its inputs were finite and its own parameters are finite. Hooks fire children
    first, so the first hit is the innermost producer."""

    def __init__(self, m):
        self.step, self.first, self.first_bwd, self.calls, self.hs, self.open = 0, None, None, {}, [], {}
        for n, mod in m.named_modules():
            self.hs.append(mod.register_forward_pre_hook(self._pre(n), with_kwargs=True))
            self.hs.append(mod.register_forward_hook(self._post(n), with_kwargs=True))

    def _pre(self, n):
        def f(mod, args, kwargs):
            self.open.setdefault(n, []).append(finite(args) and finite(kwargs))
        return f

    def _post(self, n):
        def f(mod, args, kwargs, out):
            ok_in = self.open[n].pop()
            k = self.calls[(n, self.step)] = self.calls.get((n, self.step), 0) + 1
            if self.first is None and ok_in and not finite(out) \
                    and all(bool(torch.isfinite(p).all()) for p in mod.parameters(recurse=False)):
                self.first = (n, self.step, k)
        return f

    def remove(self):
        for h in self.hs:
            h.remove()


def expect(rep, rules, module, step, phase="forward", severity=("warning", "error")):
    """One of `rules` at `module`, `step` (and `phase` where the finding states one) among the first three findings,
    with `severity`; else WrongAnswer."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.rule in rules and f.module == module and f.step == step and f.severity in severity \
                and (f.phase is None or f.phase == phase):
            return f
    raise WrongAnswer(f"wanted {rules} at {module!r} step {step} ({phase}); got: {lines(rep)[:3]}")


def mse(out, y):
    return F.mse_loss(out.float(), y)


def run(m, batch, tmp_path, loss_fn=mse, watch=True):
    return probe_run(m, batch, loss_fn, STEPS, str(tmp_path / "run"), oracle=InplaceProducer, watch=watch)


W8 = torch.randn(8, 1, generator=gen(999)) * 0.5


def xbatch(i, scale=1.0, n=16):
    x = torch.randn(n, 8, generator=gen(i % 4))
    if i == BAD:
        x = x.abs() * scale
    return x


def reg_batch(scale):
    def b(i):
        x = xbatch(i, scale)
        return (x,), (x / (scale if i == BAD else 1.0)) @ W8
    return b


# ======================================================================================================================
# 1. nn.ReLU(inplace=True) right after an overflowing Linear: step 5's batch holds a sentinel row (60000, finite in
#    fp16), fc1's addmm overflows, the ReLU rewrites fc1's (already inf) output in place
# ======================================================================================================================
class ReluInplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def sentinel_batch(i):
    x = torch.randn(16, 8, generator=gen(i % 4))
    y = x @ W8
    if i == BAD:
        x[7] = 6e4              # a row of missing readings filled with the sentinel 60000 (fits fp16)
    return (x,), y


def test_relu_inplace_after_overflowing_linear(tmp_path):
    torch.manual_seed(0)
    r = run(ReluInplaceNet(), sentinel_batch, tmp_path)
    real_fwd_after_backoffs(r, "fc1", BAD, call=1)
    expect(r["rep"], ("overflow",), "fc1", BAD)


# ======================================================================================================================
# 2. a timm-style LayerScale(inplace=True): `x.mul_(gamma)` on the previous Linear's output; fc1 is finite when it
#    returns, the in-place multiply makes the inf (and leaves fc1's output tensor inf afterwards)
# ======================================================================================================================
class LayerScale(nn.Module):
    def __init__(self, d, init):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, x):
        return x.mul_(self.gamma)


class LayerScaleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ls, self.fc2 = nn.Linear(8, 32), LayerScale(32, 8.0), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.ls(self.fc1(x))))


def test_layerscale_mul_inplace_overflows_on_the_linear_output(tmp_path):
    torch.manual_seed(0)
    r = run(LayerScaleNet(), reg_batch(1.5e4), tmp_path)
    real_fwd_after_backoffs(r, "ls", BAD, call=1)
    expect(r["rep"], ("overflow",), "ls", BAD)


# ======================================================================================================================
# 3. graph sum-pooling by `scatter_add_` into an fp16 buffer: a batch with one huge graph (6000 nodes) overflows it
# ======================================================================================================================
class SegmentSum(nn.Module):
    def forward(self, h, seg, n):
        return h.new_zeros(n, h.shape[-1]).scatter_add_(0, seg[:, None].expand_as(h), h)


class GraphNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.pool, self.head = nn.Linear(8, 16), SegmentSum(), nn.Linear(16, 1)

    def forward(self, x, seg, n):
        return self.head(self.pool(torch.relu(self.enc(x)), seg, n) / 16)


def graph_batch(i):
    g = gen(i % 4)
    if i == BAD:                       # 7 small graphs and one of 6000 nodes with count features (~100)
        x = torch.cat([torch.randn(56, 8, generator=g), torch.randn(6000, 8, generator=g).abs() * 100])
        seg = torch.cat([torch.arange(7).repeat_interleave(8), torch.full((6000,), 7)])
    else:
        x, seg = torch.randn(64, 8, generator=g), torch.arange(8).repeat_interleave(8)
    return (x, seg, 8), torch.ones(8, 1)


def test_scatter_add_inplace_pooling_overflows_the_fp16_buffer(tmp_path):
    torch.manual_seed(0)
    r = run(GraphNet(), graph_batch, tmp_path)
    real_fwd_after_backoffs(r, "pool", BAD, call=1)
    expect(r["rep"], ("overflow",), "pool", BAD)


# ======================================================================================================================
# 4. a Poisson rate head `self.lin(h).exp_()`: the in-place exp overflows once the log-rate passes 11.1
# ======================================================================================================================
class RateHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 1)

    def forward(self, h):
        return self.lin(h).exp_()


class RateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 32), RateHead()

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def poisson(out, y):
    return F.poisson_nll_loss(out.float(), y, log_input=False)


def rate_batch(i):
    x = torch.randn(16, 8, generator=gen(i % 4)) * (200.0 if i == BAD else 1.0)   # step 5: unnormalised features
    return (x,), torch.full((16, 1), 2.0)


def test_exp_inplace_rate_head_overflows(tmp_path):
    torch.manual_seed(0)
    r = run(RateNet(), rate_batch, tmp_path, loss_fn=poisson)
    real_fwd_after_backoffs(r, "head", BAD, call=1)
    expect(r["rep"], ("overflow",), "head", BAD)


# ======================================================================================================================
# 5. residual blocks written `h += self.ff(h)`: every ff output is finite, the in-place residual add overflows
# ======================================================================================================================
class ResBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.ReLU(), nn.Linear(d, d))

    def forward(self, h):
        h += self.ff(h)
        return h


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.layers, self.head = nn.Linear(8, 32), nn.ModuleList(ResBlock(32) for _ in range(3)), \
            nn.Linear(32, 1)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.layers:
            h = blk(h)
        return self.head(h)


def res_oracle_site(r):
    """The producer is a ResBlock (its ff finite: the add is the producer)."""
    first = r["first"]
    assert first is not None and first[0].startswith("layers.") and first[0].count(".") == 1, r["first"]
    return first[0]


def test_residual_inplace_add_overflows(tmp_path):
    torch.manual_seed(0)
    r = run(ResNet(), reg_batch(2.8e4), tmp_path)
    site = res_oracle_site(r)
    real_fwd_after_backoffs(r, site, BAD, call=1)
    expect(r["rep"], ("overflow",), site, BAD)


# ======================================================================================================================
# 6. one Gain module called twice per step: the first call is out of place and stays finite, only the second, in-place
#    call (on the count-feature branch, which spikes at step 5) overflows
# ======================================================================================================================
class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(6.0))

    def forward(self, x, inplace=False):
        return x.mul_(self.g) if inplace else x * self.g


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fa, self.fb, self.gain, self.head = nn.Linear(8, 16), nn.Linear(8, 16), Gain(), nn.Linear(32, 1)

    def forward(self, x, z):
        a = self.gain(self.fa(x))
        b = self.gain(self.fb(z), inplace=True)
        return self.head(torch.cat([a, b], -1))


def two_batch(i):
    x = torch.randn(16, 8, generator=gen(i % 4))
    z = xbatch(i, 2e4) * (1.0 if i == BAD else 0.5)
    return (x, z), x @ W8


def test_shared_gain_second_inplace_call_overflows(tmp_path):
    torch.manual_seed(0)
    r = run(TwoBranch(), two_batch, tmp_path)
    real_fwd_after_backoffs(r, "gain", BAD, call=2)
    expect(r["rep"], ("overflow",), "gain", BAD)


# ======================================================================================================================
# 7. an `autocast(enabled=False)` region inside the forward: the energy feature sum(h^2) is computed in fp32, then
#    `.half()`-ed back to match the fp16 activations: the cast of a value past 65504 is the producer
#    (twin: the region returns log1p(energy))
# ======================================================================================================================
class EnergyFeature(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.fixed = fixed

    def forward(self, h):
        with torch.autocast("cpu", enabled=False):
            e = h.float().pow(2).mean(-1, keepdim=True)
            if self.fixed:
                e = torch.log1p(e)
        return torch.cat([h, e.half()], -1)


class EnergyNet(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.fc1, self.energy, self.fc2 = nn.Linear(8, 32), EnergyFeature(fixed), nn.Linear(33, 1)

    def forward(self, x):
        return self.fc2(self.energy(self.fc1(x)))


def test_fp32_region_cast_back_to_half_overflows(tmp_path):
    torch.manual_seed(0)
    r = run(EnergyNet(), reg_batch(600.0), tmp_path)
    real_fwd_after_backoffs(r, "energy", BAD, call=1)
    expect(r["rep"], ("overflow",), "energy", BAD)


def test_healthy_twin_fp32_region_log1p_is_quiet(tmp_path):
    torch.manual_seed(0)
    r = run(EnergyNet(fixed=True), reg_batch(600.0), tmp_path)
    quiet_twin(r, skips=(BAD,))     # the spike's scaled backward overflows fp16 once: an ordinary GradScaler skip


# ======================================================================================================================
# 8. a bf16 autocast region nested in the fp16 one ("this expert is sensitive: run it in bf16"): its bf16 output
#    (~1e5) is finite; the next Linear, back in the fp16 region, has autocast cast it to fp16 -> inf there
# ======================================================================================================================
class Bf16Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 32)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(x)


class Bf16Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.expert, self.out_proj = Bf16Expert(), nn.Linear(32, 1)

    def forward(self, x):
        return self.out_proj(self.expert(x))


def test_bf16_region_output_overflows_in_the_next_fp16_linear(tmp_path):
    torch.manual_seed(0)
    r = run(Bf16Net(), reg_batch(1.5e5), tmp_path)
    real_fwd_after_backoffs(r, "out_proj", BAD, call=1)
    expect(r["rep"], ("overflow", "nan_origin"), "out_proj", BAD)


# ======================================================================================================================
# 9. a fused squared-ReLU autograd Function under `custom_fwd(device_type="cpu", cast_inputs=torch.float16)` /
#    `custom_bwd`: relu(x)^2 overflows fp16 past |x| = 256 (twin: cast_inputs=torch.float32; the LayerNorm after it
#    brings the fp32 values back into range)
# ======================================================================================================================
def _sqrelu_fn(cast):
    class SqReLU(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.relu(x) ** 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 2 * torch.relu(x)
    return SqReLU


class SqReLU(nn.Module):
    def __init__(self, cast):
        super().__init__()
        self.fn = _sqrelu_fn(cast)

    def forward(self, x):
        return self.fn.apply(x)


class SqNet(nn.Module):
    def __init__(self, cast=torch.float16):
        super().__init__()
        self.fc1, self.act, self.norm, self.fc2 = nn.Linear(8, 32), SqReLU(cast), nn.LayerNorm(32), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.norm(self.act(self.fc1(x))))


def test_custom_fwd_cast_fp16_function_overflows(tmp_path):
    torch.manual_seed(0)
    r = run(SqNet(), reg_batch(600.0), tmp_path)
    real_fwd_after_backoffs(r, "act", BAD, call=1)
    expect(r["rep"], ("overflow",), "act", BAD)


def test_healthy_twin_custom_fwd_cast_fp32_is_quiet(tmp_path):
    torch.manual_seed(0)
    r = run(SqNet(torch.float32), reg_batch(600.0), tmp_path)
    quiet_twin(r, skips=(BAD,))     # the spike's scaled backward overflows fp16 once: an ordinary GradScaler skip


# ======================================================================================================================
# 10. an additive key mask built `(1 - mask) * finfo(float32).min` in the scores' dtype (fp16: -inf) and added in
#     place (`scores.add_(bias)`); step 5's batch holds padding and an empty sequence: its rows are all -inf -> NaN
#     (twin: the bias -1e4, finite in fp16)
# ======================================================================================================================
class KeyMaskAttn(nn.Module):
    def __init__(self, d, fill):
        super().__init__()
        self.qkv, self.fill = nn.Linear(d, 3 * d), fill

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        bias = (1.0 - mask[:, None, :].to(scores.dtype)) * self.fill
        scores.add_(bias)
        return scores.softmax(-1) @ v


class MaskNet(nn.Module):
    def __init__(self, fill=torch.finfo(torch.float32).min):
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(8, 16), KeyMaskAttn(16, fill), nn.Linear(16, 1)

    def forward(self, x, mask):
        return self.head(self.attn(self.emb(x), mask).mean(1))


def mask_batch(i):
    x = torch.randn(4, 6, 8, generator=gen(i % 4))
    mask = torch.ones(4, 6, dtype=torch.long)
    if i == BAD:
        mask[1, 3:] = 0
        mask[2, :] = 0          # an empty document
    return (x, mask), x.mean(1) @ W8


def test_additive_mask_finfo_float32_min_added_in_place(tmp_path):
    torch.manual_seed(0)
    r = run(MaskNet(), mask_batch, tmp_path)
    real_fwd_after_backoffs(r, "attn", BAD, call=1)
    expect(r["rep"], ("mask_value_overflow",), "attn", BAD)


def test_healthy_twin_additive_mask_minus_1e4_is_quiet(tmp_path):
    torch.manual_seed(0)
    r = run(MaskNet(-1e4), mask_batch, tmp_path)
    quiet_twin(r)


# ======================================================================================================================
# 11. an L2 normaliser with an in-place epsilon: `h.pow(2).sum(-1, keepdim=True).add_(1e-8).sqrt_()`; in fp16 the
#     1e-8 rounds to 0, so the all-zero row of step 5's batch (a sample with no features) gives 0/0 = NaN
# ======================================================================================================================
class L2Norm(nn.Module):
    def forward(self, h):
        n = h.pow(2).sum(-1, keepdim=True).add_(1e-8).sqrt_()
        return h / n


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.l2, self.head = nn.Linear(8, 32, bias=False), L2Norm(), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.l2(self.proj(x)))


def norm_batch(i):
    x = torch.randn(16, 8, generator=gen(i % 4))
    if i == BAD:
        x[3] = 0.0
    return (x,), x @ W8


def test_inplace_eps_in_l2norm_vanishes_in_fp16(tmp_path):
    torch.manual_seed(0)
    m = NormNet()
    (x,), _ = norm_batch(BAD)
    with torch.no_grad():
        assert finite(m(x))                        # the premise: fp32 is fine on the zero row
    r = run(m, norm_batch, tmp_path)
    real_fwd_after_backoffs(r, "l2", BAD, call=1)
    expect(r["rep"], ("eps_underflow",), "l2", BAD)
