"""Fifth set of failure-pattern variants, the way real model code writes them, watched through the public API only
(watch -> ordinary fp16 autocast + GradScaler loop -> w.report(), and diagnose(run_dir)), at the default sampling
and at every=1: a T5-style RMSNorm squaring in fp16 deep in an encoder, a MoE router's z-loss, a masked
log-likelihood whose forward hides log(0) and whose backward is 0/0, a hand-written attention pooling dividing by a
sum of zeros, a hand-written cosine similarity whose eps=1e-8 is 0 in fp16, an annealed loss weight whose gradients
flush to zero, model.half() with a decaying learning rate whose updates round away, attention with a large head
dim scaled after the product, an Upsample/Conv decoder, a hand-written recurrence overflowing at one time step of
its shared cell, a model wrapped twice (`.module.model`), a failure past step 250, a Gaussian NLL's exp(logvar), a
pure-fp16 diffusion schedule whose last alpha_bar flushes to 0, and scaler misuse in helpers, callbacks and
gradient accumulation (clip before unscale_ from a step on, update() only in the logging branch, update() before
step(), unscale_ twice from a callback, an epoch-end flush with optimizer.step(), update()/unscale_ per
micro-batch, a gradient norm read for the logs while scaled, the scaled loss discarded, model.half() handed to a
GradScaler). Each model goes bad at a known step; the right rule at the producing module (not one that only passed
the inf/NaN on) among the first three findings, at that step. Where ampdoctor is wrong the test is a strict xfail
whose reason says what it reported instead."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import (both, EVERY, first_bad, FP16, in_top3, lines, mean_sq, no_error_at, one_thread, out_mean, randn,
                       short_loop as loop, top3)


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


# -- 1. T5 LayerNorm (RMS, no mean) squaring in fp16, deep in an encoder: x finite, x.pow(2) inf -> silent zeros ----
class T5LayerNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(d)), eps

    def forward(self, hidden_states):
        # transformers' T5LayerNorm upcasts to fp32 here; this copy does not
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class T5FF(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layer_norm = T5LayerNorm(d)
        self.wi, self.wo = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, h):
        return h + self.wo(F.relu(self.wi(self.layer_norm(h))))


class T5Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList([T5FF()])

    def forward(self, h):
        return self.layer[0](h)


class T5Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.ModuleList(T5Block() for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.block:
            h = b(h)
        return self.head(h)


@EVERY
def test_t5_layer_norm_variance_overflow_deep_in_an_encoder(tmp_path, every):
    """From step 3 block 1's input holds rows with values ~480 (finite; block 0's wo adds them): x.pow(2) is
    2.3e5 -> inf, the mean inf, rsqrt 0: those rows come out of the norm as silent zeros (no NaN, finite loss).
    (The head's weight gradient, a batch sum of those large activations, also overflows in steps 3-5: the scaler
    skips them and backs off, a consequence, reported as info.)"""
    torch.manual_seed(0)
    m, x = T5Encoder(), randn(16, 8)
    ff0 = m.block[0].layer[0]

    def batch(i):
        if i == 3:
            with torch.no_grad():
                ff0.wo.weight.mul_(0.0)
                ff0.wo.weight[:, :8] = 150.0  # block 0's output rows reach a few hundred
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert all(r.loss_finite is not False for r in w.steps)  # the norm's zeros are silent: the loss stays finite
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.block[0](m.embed(x))
        ln = m.block[1].layer[0].layer_norm
        assert torch.isfinite(h).all() and h.abs().max() < 6e4 and (h.abs().amax(-1) > 256).any()
        assert torch.isinf(h.pow(2)).any() and (ln(h).abs().amax(-1) == 0).any()  # real: rows flushed to 0
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "block.1.layer.0.layer_norm")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::pow"), f.one_line()
        no_error_at(rep, ("block.0.layer.0.wo", "block.0", "block.1.layer.0.wi", "head", ""))


# -- 2. a MoE router's z-loss (Switch / ST-MoE): logsumexp(logits)^2 in fp16 ------------------------------------------
class Router(nn.Module):
    def __init__(self, d=16, e=4):
        super().__init__()
        self.classifier = nn.Linear(d, e)
        self.z_loss = None

    def forward(self, h):
        logits = self.classifier(h)
        self.z_loss = torch.logsumexp(logits, -1).pow(2).mean()  # logits ~300: 9e4 -> inf in fp16
        return torch.softmax(logits.float(), -1)


class MoE(nn.Module):
    def __init__(self, d=16, e=4):
        super().__init__()
        self.router = Router(d, e)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))

    def forward(self, h):
        p = self.router(h)
        return sum(p[..., i:i + 1] * ex(h) for i, ex in enumerate(self.experts))


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.head = nn.Linear(8, 16), MoE(), nn.Linear(16, 1)

    def forward(self, x):
        out = self.head(self.moe(self.inp(x)))
        return out.float().pow(2).mean() + 1e-3 * self.moe.router.z_loss


@EVERY
def test_moe_router_z_loss_overflows_in_the_router(tmp_path, every):
    """From step 3 the router's logits drift to ~300 (a bias): finite, softmax fine (fp32), but the z-loss squares
    logsumexp ~300 in fp16: inf, made by the router's pow."""
    torch.manual_seed(0)
    m, x = MoENet(), randn(16, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.moe.router.classifier.bias.fill_(300.0)
        return (x,)
    w = loop(m, batch, lambda out, *a: out, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    # the loss is inf from step 3; its gradients (2 * lse * 1e-3 * scale) stay finite: no step is skipped
    assert [r.step for r in w.steps if r.loss_finite is False] == list(range(3, 8)) and first_bad(w) is None
    with torch.no_grad(), torch.autocast(**FP16):
        lg = m.moe.router.classifier(m.inp(x))
        m.moe.router(m.inp(x))
        assert torch.isfinite(lg).all() and torch.isinf(m.moe.router.z_loss)  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "moe.router")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::pow"), f.one_line()
        no_error_at(rep, ("inp", "moe.router.classifier", "moe", "head"))


# -- 3. masked log-likelihood: torch.where hides log(0) in the forward, its backward is 0 * inf = NaN --------------------
class MaskedNLL(nn.Module):
    def forward(self, logits, pad):
        p = torch.softmax(logits.masked_fill(pad, float("-inf")), -1)  # padded slots: p exactly 0
        ll = torch.where(pad, torch.zeros_like(p), torch.log(p))  # forward finite; d log(p) / dp at p = 0 is inf
        return -ll.sum(-1).mean()


class SlotModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.head, self.criterion = nn.Linear(8, 16), nn.Linear(16, 6), MaskedNLL()

    def forward(self, x, pad):
        return self.criterion(self.head(torch.relu(self.enc(x))), pad)


@EVERY
def test_where_masked_log_of_zero_is_a_backward_nan_origin_in_the_loss_module(tmp_path, every):
    """Up to step 2 no slot is padded; from step 3 the last two slots are: p is exactly 0 there, log(p) = -inf is
    hidden by torch.where, the loss stays finite; LogBackward divides the (zero) gradient by p = 0: 0 / 0 = NaN.
    Made in `criterion` (its forward's log(0) is the cause, its backward the NaN), not in head or enc, which only
    receive it."""
    torch.manual_seed(0)
    m, x = SlotModel(), randn(16, 8)
    pad = torch.zeros(16, 6, dtype=torch.bool)

    def batch(i):
        p = pad.clone()
        if i >= 3:
            p[:, 4:] = True
        return (x, p)
    w = loop(m, batch, lambda out, *a: out, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.skipped and r3.loss_finite is not False and first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = in_top3(rep, ("nan_origin", "overflow"), "criterion")
        # the producer is criterion at step 3: its log's -inf in the forward (hidden by where) or its backward's NaN
        assert f.step == 3 and (f.phase == "backward" or f.op == "aten::log"), f.one_line()
        no_error_at(rep, ("enc", "head", ""))


# -- 4. hand-written attention pooling: relu scores normalised by their sum, a sample whose scores are all 0 --------
class ReluPool(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h):
        a = torch.relu(self.score(h))  # (B, T, 1)
        a = a / a.sum(1, keepdim=True)  # no eps: a sample whose scores are all <= 0 is 0 / 0
        return (a * h).sum(1)


class PoolNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.pool, self.head = nn.Linear(8, 16), ReluPool(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.pool(self.enc(x)))


@EVERY
def test_division_by_a_sum_of_zeros_in_a_hand_written_pooling(tmp_path, every):
    torch.manual_seed(0)
    m, x = PoolNet(), randn(4, 6, 8)
    with torch.no_grad():
        m.pool.score.bias.fill_(5.0)
        m.pool.score.weight.mul_(0.01)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.pool.score.bias.fill_(-5.0)  # every score <= 0
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.enc(x)
        assert torch.isfinite(h).all() and torch.isnan(m.pool(h)).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "nan_origin", "pool")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::div"), f.one_line()
        no_error_at(rep, ("enc", "pool.score", "head", ""))


# -- 5. a hand-written cosine similarity with eps=1e-8 (0 in fp16) and an all-zero embedding ----------------------------
class CosSim(nn.Module):
    def forward(self, a, b):
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + 1e-8)


class DualEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.d, self.sim = nn.Linear(8, 16), nn.Linear(8, 16), CosSim()

    def forward(self, xq, xd):
        return self.sim(torch.relu(self.q(xq)), torch.relu(self.d(xd)))


@EVERY
def test_hand_written_cosine_similarity_eps_vanishes_in_fp16(tmp_path, every):
    """From step 3 the document tower's relu output is all zero for some rows (a dead tower: bias -10): the
    norm is 0, + 1e-8 is still 0 in fp16, 0 / 0 = NaN. The cause is the eps: eps_underflow at sim."""
    torch.manual_seed(0)
    m, xq, xd = DualEncoder(), randn(16, 8), randn(16, 8, seed=1)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.d.weight.mul_(0.01)
                m.d.bias.fill_(-10.0)
        return (xq, xd)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        assert torch.isnan(m(xq, xd)).any()  # real
        z = torch.zeros(2, 16)
        assert torch.isfinite(m.sim(z, z)).all()  # in fp32, 1e-8 is no zero
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "eps_underflow", "sim")
        assert f.step == 3, f.one_line()
        no_error_at(rep, ("q", "d", ""))


# -- 6. an auxiliary loss weight annealed to 1e-8: its gradients flush to zero in the fp16 backward --------------------
class AuxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("every", [
    None,  # (was a strict xfail: nothing at the default sampling; the loss's 1e8x drop now samples the next step)
    1], ids=["default", "every1"])
def test_annealed_loss_weight_flushes_gradients_to_zero(tmp_path, every):
    """The loss weight is 1 up to step 2 and 1e-8 from step 3 (an annealing schedule written with the wrong
    exponent): even at a scale of 1024, d loss / d out ~ 1e-8 * 1024 * 2 * out / 4096 ~ 1e-9, below fp16's
    smallest subnormal: the head's backward flushes them to 0 and nothing trains."""
    torch.manual_seed(0)
    m, x = AuxHead(), randn(64, 16)
    weight = {"w": 1.0}

    def batch(i):
        weight["w"] = 1.0 if i < 3 else 1e-8
        return (x,)
    w = loop(m, batch, lambda out, *a: weight["w"] * out.float().pow(2).mean(), every=every,
             run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) is None
    probe = copy.deepcopy(m)
    with torch.autocast(**FP16):
        (1024.0 * 1e-8 * probe(x).float().pow(2).mean()).backward()
    assert all(p.grad.abs().max() == 0 for p in probe.parameters())  # real: every gradient flushed to zero
    probe.zero_grad()
    (1024.0 * 1e-8 * probe(x).float().pow(2).mean()).backward()
    assert probe.head.weight.grad.abs().max() > 0  # in fp32 they are not
    for rep in both(w, tmp_path / "r"):
        f = in_top3(rep, ("underflow",), "head")
        assert (f.phase, f.step) == ("backward", 3), f.one_line()


# -- 7. model.half() + plain SGD (no master weights), a step-decay schedule: updates round away from step 3 ---------
class HalfNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


@pytest.mark.parametrize("every", [
    None,  # (default sampling: was no update_underflow at all; a routine step checks its updates when the lr moves)
    1], ids=["default", "every1"])
def test_half_model_updates_round_away_after_the_lr_decays(every):
    """model.half() + SGD, no scaler, no master weights: lr 0.1 for steps 0-2 (updates ~1e-3, larger than the
    weights' half ulp), then StepLR x1e-4 at steps 3 and 6: updates ~1e-6, below half an ulp, w + dw == w in
    every parameter: training has silently stopped from step 3."""
    torch.manual_seed(0)
    m = HalfNet().half()
    x, y = randn(64, 16).half(), randn(64, 1, seed=1).half()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=1e-4)
    w = ampdoctor.watch(m, optimizer=opt, **({} if every is None else {"every": every}))
    changed = []
    for i in range(8):
        opt.zero_grad()
        F.mse_loss(m(x).float(), y.float()).backward()
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        sched.step()
        changed.append([float((b != p).float().mean()) for b, p in zip(before, m.parameters())])
    w.close()
    # real: at steps 0-2 (nearly) every element moves, from step 3 (nearly) none does (1 of fc's 256 at 3-5)
    assert all(min(c) > 0.9 for c in changed[:3]) and all(max(c) < 0.01 for c in changed[3:]), changed
    rep = w.report()
    got = [(f.rule, f.module) for f in rep.findings[:3]]
    for mod in ("fc", "out"):
        assert ("update_underflow", mod) in got, lines(rep)
        f = next(f for f in rep.findings if (f.rule, f.module) == ("update_underflow", mod))
        assert f.step == 3 and f.severity == "error", f.one_line()
    assert any(f.rule == "fp16_master_weights" for f in rep.findings), lines(rep)


# -- 8. attention with a large head dim, the 1/sqrt(d) applied after the product ----------------------------------------
class WideHeadAttention(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.scale = d ** -0.5

    def forward(self, h):
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # the product overflows before the scale
        return torch.softmax(scores.float(), -1).to(v.dtype) @ v


class WideNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(8, 256), WideHeadAttention(), nn.Linear(256, 1)

    def forward(self, x):
        return self.head(self.attn(self.inp(x)))


@EVERY
def test_unscaled_wide_head_attention_scores_overflow_in_the_attention(tmp_path, every):
    """Head dim 256; from step 3 q and k are ~20 each (a bias): q.k ~ 256 * 400 = 1e5 -> inf before the
    x 1/16; scaled it would be 6.4e3. Made by attn's matmul, not by q_proj/k_proj (finite)."""
    torch.manual_seed(0)
    m, x = WideNet(), randn(2, 6, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.attn.q_proj.bias.fill_(20.0)
                m.attn.k_proj.bias.fill_(20.0)
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = m.inp(x)
        q, k = m.attn.q_proj(h), m.attn.k_proj(h)
        assert torch.isfinite(q).all() and torch.isfinite(k).all() and q.abs().max() < 100
        assert torch.isinf(q @ k.transpose(-1, -2)).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "attn")
        assert (f.phase, f.step) == ("forward", 3) and f.op in ("aten::matmul", "aten::bmm"), f.one_line()
        no_error_at(rep, ("inp", "attn.q_proj", "attn.k_proj", "attn.v_proj", "head", ""))


# -- 9. an Upsample/Conv decoder: the first conv overflows, the Upsample and the next conv pass it on -----------------
class UpDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(4, 8, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.act = nn.SiLU()
        self.conv_out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, z):
        return self.conv_out(self.act(self.up(self.conv_in(z))))


class AE(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.decoder = nn.Conv2d(4, 4, 1), UpDecoder()

    def forward(self, z):
        return self.decoder(self.quant(z))


@EVERY
def test_upsample_decoder_overflow_is_the_conv_not_the_upsample(tmp_path, every):
    torch.manual_seed(0)
    m, z = AE(), randn(2, 4, 4, 4)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.decoder.conv_in.weight.mul_(3e5)
        return (z,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        q = m.quant(z)
        assert torch.isfinite(q).all() and torch.isinf(m.decoder.conv_in(q)).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "decoder.conv_in")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        no_error_at(rep, ("quant", "decoder.up", "decoder.act", "decoder.conv_out", "decoder", ""))


# -- 10. a hand-written linear recurrence (weights shared across time): the state overflows at time step 12 ------------
class LinearRNN(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.A, self.B = nn.Linear(d, d, bias=False), nn.Linear(8, d)

    def forward(self, x):  # (B, T, 8)
        h = torch.zeros(x.shape[0], self.A.out_features, device=x.device)
        for t in range(x.shape[1]):
            h = self.A(h) + self.B(x[:, t])  # A is called once per time step
        return h


class SeqNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = LinearRNN(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.rnn(x))


@EVERY
def test_recurrence_overflows_at_one_time_step_in_the_shared_cell(tmp_path, every):
    """A = 0.5 I up to step 2 (the state stays ~1); from step 3 A = 2.5 I: the state grows x2.5 per time step and
    A's matmul passes 65504 at one time step of 16 (~12): the Linear called in the loop makes the inf."""
    torch.manual_seed(0)
    m, x = SeqNet(), randn(4, 16, 8)
    with torch.no_grad():
        m.rnn.A.weight.copy_(0.5 * torch.eye(16))
        m.rnn.B.bias.fill_(1.0)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.rnn.A.weight.copy_(2.5 * torch.eye(16))
        return (x,)
    w = loop(m, batch, out_mean, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h, call = torch.zeros(4, 16), None
        for t in range(16):
            a = m.rnn.A(h)
            if call is None and not torch.isfinite(a).all():
                call = t
            h = a + m.rnn.B(x[:, t])
        assert call is not None and 4 < call < 15, call  # real: one late call of A overflows
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "rnn.A")
        assert (f.phase, f.step) == ("forward", 3), f.one_line()
        assert f.evidence.get("call") in (call, None), f.evidence
        no_error_at(rep, ("rnn.B", "head", ""))


# -- 11/12. a model wrapped twice (`.module.model`); a failure that starts at step 260 --------------------------------
class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.layers(x)


class HasModel(nn.Module):  # a task wrapper, as a Lightning module holds `self.model`
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


class HasModule(nn.Module):  # a DDP-like wrapper holding `self.module`
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *a, **k):
        return self.module(*a, **k)


def twice_wrapped_run(tmp_path, every, at, steps):
    torch.manual_seed(0)
    m, x = HasModule(HasModel(Inner())), randn(16, 8)

    def batch(i):
        if i == at:
            with torch.no_grad():
                m.module.model.layers[2].weight.mul_(1e5)
        return (x,)
    w = loop(m, batch, mean_sq, steps=steps, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    assert first_bad(w) == at
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "module.model.layers.2")
        assert (f.phase, f.step, f.op) == ("forward", at, "aten::addmm"), f.one_line()
        no_error_at(rep, ("module", "module.model", "module.model.layers", "module.model.layers.3",
                          "module.model.layers.4", ""))


@EVERY
def test_overflow_inside_a_model_wrapped_twice(tmp_path, every):
    twice_wrapped_run(tmp_path, every, 3, 8)


@EVERY
def test_overflow_that_starts_at_step_260_past_the_default_sample(tmp_path, every):
    twice_wrapped_run(tmp_path, every, 260, 264)


# -- 13. scaler misuse: a helper clips before unscale_, from step 3 on (clipping switched on after warmup) -------------
def scaler_run(body, steps=8, model=None, accum=1):
    """The model `TwoLayer`, SGD + GradScaler("cpu") + fp16 autocast; `body(i, model, opt, scaler, loss)` does what
    follows the forward (the misuse under test); `zero_grad()` on every `accum`-th iteration. An error raised by GradScaler ends the run, as it ends the user's.
    Returns (watch, the step torch raised at or None)."""
    torch.manual_seed(0)
    m = model or nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    x = randn(16, 8)
    raised = None
    for i in range(steps):
        if i % accum == 0:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x).float().pow(2).mean()
        try:
            body(i, m, opt, sc, loss)
        except (RuntimeError, AssertionError):  # GradScaler raises both
            raised = i
            break
    rep = w.report()
    w.close()
    return rep, raised


def clip_gradients(model, max_norm=1.0):
    """A project's helper: clip and return the norm for the logs."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def test_clip_before_unscale_in_a_helper_from_step_3():
    def body(i, m, opt, sc, loss):
        sc.scale(loss).backward()
        if i >= 3:  # clipping switched on after a warmup; the helper runs on still-scaled gradients
            clip_gradients(m)
        sc.step(opt)
        sc.update()
    rep, raised = scaler_run(body)
    assert raised is None
    f = next((f for f in rep.findings[:3] if f.rule == "clip_before_unscale"), None)
    assert f is not None, lines(rep)
    assert f.step == 3 and f.severity in ("error", "warning"), f.one_line()


def test_update_only_in_the_logging_branch_is_missing_scaler_update():
    """`scaler.update()` moved under `if i % log_every == 0` with the logging: step 0 updates, step 1 does
    not, and torch raises at step 2 ("step() has already been called since the last update()")."""
    def body(i, m, opt, sc, loss):
        sc.scale(loss).backward()
        sc.step(opt)
        if i % 10 == 0:
            sc.update()
    rep, raised = scaler_run(body)
    assert raised == 2
    f = next((f for f in rep.findings[:3] if f.rule == "missing_scaler_update"), None)
    assert f is not None, lines(rep)
    # step 1 ran step() without update(); step 2's step() is where torch raised: either names the place
    assert f.step in (1, 2) and f.severity == "error", f.one_line()


def test_update_before_step_after_unscale_is_silent_in_torch_and_named():
    """unscale_ -> clip -> update -> step (accelerate #357): torch says nothing at step 0 (update() resets the
    optimizer's stage, so step() unscales the already-unscaled gradients again, dividing them by the scale twice),
    and raises only at step 1 ("unscale_() is being called after step()")."""
    def body(i, m, opt, sc, loss):
        sc.scale(loss).backward()
        sc.unscale_(opt)
        clip_gradients(m)
        sc.update()
        sc.step(opt)
    rep, raised = scaler_run(body)
    assert raised == 1
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None, lines(rep)
    assert f.step == 0 and f.evidence.get("sequence"), f.one_line()


def test_unscale_twice_from_a_grad_norm_callback_at_step_5():
    """A logging callback that runs every 5th step calls scaler.unscale_(opt) to log the true norm; the loop
    has already unscaled: torch raises at step 5 and the report must still name it."""
    def log_grad_norm(m, opt, sc):
        sc.unscale_(opt)
        return clip_gradients(m, float("inf"))

    def body(i, m, opt, sc, loss):
        sc.scale(loss).backward()
        sc.unscale_(opt)
        clip_gradients(m)
        if i % 5 == 0 and i > 0:
            log_grad_norm(m, opt, sc)
        sc.step(opt)
        sc.update()
    rep, raised = scaler_run(body)
    assert raised == 5
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None, lines(rep)
    assert f.step == 5 and "unscale_" in f.message, f.one_line()


def test_epoch_end_flush_with_optimizer_step_on_scaled_gradients():
    """Steps 0-4 go through the scaler; step 5 flushes the epoch's last accumulated gradients with a plain
    `opt.step()` (and `zero_grad`), no scaler call: the update applies gradients 1024x too large; torch says
    nothing; steps 6-7 are ordinary again."""
    def body(i, m, opt, sc, loss):
        sc.scale(loss).backward()
        if i == 5:
            opt.step()
            return
        sc.step(opt)
        sc.update()
    rep, raised = scaler_run(body)
    assert raised is None
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None, lines(rep)
    assert f.step == 5, f.one_line()


def test_update_every_micro_batch_in_gradient_accumulation_is_scaler_misorder():
    """Gradient accumulation with `scaler.update()` inside the micro-batch loop and `scaler.step()` after it:
    update() before any step() in the iteration; GradScaler asserts ('No inf checks were recorded prior to
    update.') at the first micro-batch."""
    def body(i, m, opt, sc, loss):
        for _ in range(2):
            sc.scale(loss / 2).backward(retain_graph=True)
            sc.update()
        sc.step(opt)
    rep, raised = scaler_run(body)
    assert raised == 0
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None, lines(rep)
    assert f.step == 0 and "update()" in f.message and f.evidence.get("sequence"), f.one_line()


def test_unscale_every_micro_batch_in_gradient_accumulation_is_unscale_twice():
    """Accumulating 4 micro-batches (zero_grad after each optimizer step), with `unscale_` + clip moved into
    the micro-batch loop: the second micro-batch's unscale_ raises ('unscale_() has already been called on this
    optimizer since the last update()')."""
    def body(i, m, opt, sc, loss):
        sc.scale(loss / 4).backward()
        sc.unscale_(opt)
        clip_gradients(m)
        if i % 4 == 3:
            sc.step(opt)
            sc.update()
    rep, raised = scaler_run(body, accum=4)
    assert raised == 1
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None, lines(rep)
    assert f.step == 0 and "unscale_" in f.message, f.one_line()


@pytest.mark.parametrize("how", [
    pytest.param("by_hand", marks=pytest.mark.xfail(strict=True, reason=(
        "a norm computed by hand (torch.norm of the gradients) is ordinary tensor code: ampdoctor sees the "
        "clipping functions and get_total_norm only, and reports nothing; expected clip_before_unscale at step 0"))),
    "get_total_norm"])
def test_grad_norm_read_for_the_logs_before_unscale_is_named(how):
    """A logging line reads the gradient norm right after backward, before `unscale_`: the logged norm is
    1024x the real one (clipping itself is done correctly after unscale_). CONTRACT.md: clip_before_unscale covers
    a norm read while scaled."""
    logged = []

    def body(i, m, opt, sc, loss):
        sc.scale(loss).backward()
        grads = [p.grad for p in m.parameters()]
        if how == "by_hand":
            logged.append(float(torch.norm(torch.stack([g.detach().norm() for g in grads]))))
        else:
            logged.append(float(torch.nn.utils.get_total_norm(grads)))
        sc.unscale_(opt)
        logged.append(float(clip_gradients(m, float("inf"))))
        sc.step(opt)
        sc.update()
    rep, raised = scaler_run(body)
    assert raised is None and abs(logged[0] / logged[1] - 1024) < 1, logged[:2]  # real: the scaled norm
    f = next((f for f in rep.findings[:3] if f.rule == "clip_before_unscale"), None)
    assert f is not None, lines(rep)
    assert f.step == 0, f.one_line()


def test_scaled_loss_discarded_and_backward_on_the_raw_loss():
    """`scaler.scale(loss)` written as a statement (its result dropped), then `loss.backward()`: torch says
    nothing; GradScaler unscales gradients that were never scaled."""
    grads = []

    def body(i, m, opt, sc, loss):
        sc.scale(loss)
        loss.backward()
        sc.unscale_(opt)
        grads.append(float(clip_gradients(m, float("inf"))))
        sc.step(opt)
        sc.update()
    rep, raised = scaler_run(body)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ref(randn(16, 8)).float().pow(2).mean().backward()
    true = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    assert raised is None and abs(grads[0] * 1024 / true - 1) < 0.05, (grads[0], true)  # real: 1024x too small
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None, lines(rep)
    assert f.step == 0, f.one_line()


# -- 19. a heteroscedastic (Gaussian NLL) head: exp(logvar) in fp16 overflows once logvar passes 11.1 ----------------
class GaussianNLL(nn.Module):
    def forward(self, mu, logvar, y):
        return (0.5 * (logvar + (y - mu) ** 2 / torch.exp(logvar))).mean()  # exp(12) = 1.6e5 -> inf in fp16


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.mean, self.logvar, self.nll = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 1), \
            GaussianNLL()

    def forward(self, x, y):
        h = torch.relu(self.body(x))
        return self.nll(self.mean(h), self.logvar(h), y)


@EVERY
def test_gaussian_nll_exp_of_log_variance_overflows_in_the_loss_module(tmp_path, every):
    """From step 3 the predicted log-variance is ~12 (a bias: an easy batch drove it up): exp is inf in fp16,
    (y - mu)^2 / inf = 0 and the loss stays finite; ExpBackward's grad * inf is NaN. Made by nll's exp."""
    torch.manual_seed(0)
    m, x, y = Regressor(), randn(16, 8), randn(16, 1, seed=1)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.logvar.bias.fill_(12.0)
                m.logvar.weight.mul_(0.01)
        return (x, y)
    w = loop(m, batch, lambda out, *a: out, every=every, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    r3 = next(r for r in w.steps if r.step == 3)
    assert r3.loss_finite is not False and first_bad(w) == 3
    with torch.no_grad(), torch.autocast(**FP16):
        h = torch.relu(m.body(x))
        lv = m.logvar(h)
        assert torch.isfinite(lv).all() and lv.max() < 13 and torch.isinf(torch.exp(lv)).any()  # real
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "nll")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::exp"), f.one_line()
        no_error_at(rep, ("body", "mean", "logvar", ""))


# -- 20. diffusion in pure fp16 (model.half()): the cosine schedule's last alpha_bar (1.9e-15) is 0 in fp16 --------
class Schedule(nn.Module):
    def __init__(self, T=1000):
        super().__init__()
        s = torch.arange(T + 1) / T
        self.register_buffer("alphas_cumprod", torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2)

    def forward(self, x_t, t, eps):  # the x0 prediction, from the predicted noise
        ab = self.alphas_cumprod[t][:, None]
        return (x_t - (1 - ab).sqrt() * eps) / ab.sqrt()  # ab == 0 at t = T in fp16: x / 0 = inf


class X0Diffusion(nn.Module):
    def __init__(self):
        super().__init__()
        self.schedule = Schedule()
        self.denoiser = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 8))

    def forward(self, x0, t, noise):
        ab = self.schedule.alphas_cumprod[t][:, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        eps = self.denoiser(torch.cat([x_t, (t[:, None] / 1000).to(x_t.dtype)], -1))
        return (self.schedule(x_t, t, eps) - x0).pow(2).mean()


@EVERY
def test_pure_fp16_diffusion_schedule_division_by_a_flushed_alpha_bar(every):
    """model.half() (buffers too) + SGD, no scaler: steps 0-2 sample t < 1000; from step 3 the batch holds
    t = 1000, whose alpha_bar (1.9e-15 in fp32) is 0 in fp16: predict_x0 divides by sqrt(0) -> inf. The producer
    is `schedule` (its x0 prediction's division), at step 3; the denoiser only receives the NaN afterwards."""
    torch.manual_seed(0)
    m = X0Diffusion().half()
    assert m.schedule.alphas_cumprod[-1] == 0 and X0Diffusion().schedule.alphas_cumprod[-1] > 0  # real
    x0, noise = randn(16, 8).half(), randn(16, 8, seed=1).half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    w = ampdoctor.watch(m, optimizer=opt, **({} if every is None else {"every": every}))
    losses = []
    for i in range(8):
        t = torch.arange(16) * 50 + 20 * i
        if i == 3:
            t[0] = 1000
        opt.zero_grad()
        loss = m(x0, t, noise).float()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    w.close()
    assert all(math.isfinite(v) for v in losses[:3]) and not math.isfinite(losses[3]), losses
    rep = w.report()
    got = [(f.rule, f.module) for f in rep.findings[:3]]
    assert ("overflow", "schedule") in got or ("underflow", "schedule") in got, lines(rep)
    f = next(f for f in rep.findings[:3] if f.module == "schedule" and f.rule in ("overflow", "underflow"))
    assert (f.phase, f.step) == ("forward", 3) and f.op in (None, "aten::div"), f.one_line()
    no_error_at(rep, ("denoiser.0", "denoiser.1", "denoiser.2", "denoiser", ""))


# -- 21. model.half() handed to a GradScaler: torch raises at unscale_, the report names the fp16 weights -----------
def test_half_model_with_grad_scaler_names_fp16_master_weights():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    x = randn(16, 8)
    with pytest.raises(ValueError, match="FP16 gradients"):
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x.half()).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.unscale_(opt)
            sc.step(opt)
            sc.update()
    rep = w.report()
    w.close()
    f = next((f for f in rep.findings[:3] if f.rule == "fp16_master_weights"), None)
    assert f is not None and f.module in ("", "0", "2"), lines(rep)
    assert f.step == 0 and f.severity == "error", f.one_line()


# -- 22. TF32 switches set at the top of an fp16 CPU script; an overflow at step 3 stays first ------------------------
@pytest.mark.parametrize("how", ["allow_tf32", "matmul_precision"])
def test_tf32_flags_in_an_fp16_cpu_run_are_env_info_behind_the_overflow(tmp_path, how):
    """The script sets TF32 (copied from a GPU recipe), trains in fp16 autocast on the CPU, and fc1 overflows from
    step 3: the overflow is the first finding; env_tf32 says (info, phase env) that TF32 does not apply here."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        if how == "allow_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            torch.set_float32_matmul_precision("high")
        torch.manual_seed(0)
        m, x = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)), randn(16, 8)

        def batch(i):
            if i == 3:
                with torch.no_grad():
                    m[0].weight.mul_(1e5)
            return (x,)
        w = loop(m, batch, out_mean, run_dir=tmp_path / "r", lr=1e-6, clip=None)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        torch.set_float32_matmul_precision(old[1])
    assert first_bad(w) == 3
    for rep in both(w, tmp_path / "r"):
        f = rep.findings[0]
        assert (f.rule, f.module, f.step) == ("overflow", "0", 3), lines(rep)
        env = [f for f in rep.findings if f.rule == "env_tf32"]
        assert len(env) == 1 and (env[0].severity, env[0].phase, env[0].module) == ("info", "env", None), lines(rep)
        no_error_at(rep, ("1", "2", ""))


# -- 23. unnormalised input features drifting up x1.6 per step: the first Linear overflows at the step it crosses -----
class DriftNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@EVERY
def test_input_drift_overflows_the_first_linear_at_the_step_it_crosses(tmp_path, every):
    """A sensor feature with no normalisation grows x1.6 per step (a counter, a timestamp): fc1's output crosses
    65504 at a step computed here (the first whose fc1 output is not finite); the input, even cast to fp16, is
    finite.
    The overflow is fc1's, at that step, not a later one."""
    torch.manual_seed(0)
    m = DriftNet()
    with torch.no_grad():
        m.fc1.weight[:, 0] = 8.0  # the feature matters: fc1 multiplies it by 8, its sum crosses 65504 first
    base = randn(16, 8)

    def x_at(i):
        x = base.clone()
        x[:, 0] = 100.0 * 1.6 ** i
        return x
    with torch.no_grad(), torch.autocast(**FP16):
        k = next(i for i in range(40) if not torch.isfinite(m.fc1(x_at(i))).all())
    assert 8 <= k <= 20 and x_at(k).abs().max() < 65504 / 4, k  # the fp16 cast of the input itself is finite
    w = loop(m, lambda i: (x_at(i),), out_mean, steps=k + 3, every=every, run_dir=tmp_path / "r", lr=1e-7,
             clip=None, init_scale=1.0)  # a scale of 1: the backward stays finite, the forward is what breaks
    assert first_bad(w) == k
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "overflow", "fc1")
        assert (f.phase, f.step, f.op) == ("forward", k, "aten::addmm"), f.one_line()
        no_error_at(rep, ("act", "fc2", ""))
