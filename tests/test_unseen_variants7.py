"""Seventh set of failure-pattern variants, watched through the public API only (watch -> an ordinary loop ->
w.report()), at the default sampling and (for most) at every=1: an audio front-end fed raw int16 PCM; a weight-tied
LM head whose logits overflow; hand-written swish (x / (1 + exp(-x))) whose exp overflows in the forward and makes a
NaN only in the backward; hand-written softplus log(1 + exp(x)); a prototypical network's distance by expansion
(|a|^2 + |b|^2 - 2ab) going negative under sqrt; SwAV's Sinkhorn exp(scores / 0.05); a mixture-density loss whose
densities flush to 0; sinusoidal positions from an fp16 arange past 65504; an overflow inside an activation-
checkpointed block; RMSNorm with eps=1e-8 on a padding row; stick-breaking cumprod flushing to 0 under log; a
log-cosh loss; linear attention whose k^T v state overflows over a long sequence; a sum-reduced loss over a big batch
with unnormalised targets; StepLR with gamma=10 (a typo for 0.1); a pure-bf16 model whose AdamW updates round away;
GradScaler(growth_interval=1); two optimizers with one scaler (clip after unscale_ of only one; optimizer.step on the
other). Each failure is first asserted to be real; then the right rule at the producing module among the first three
findings, at the right step where it matters. Where ampdoctor is wrong the test is a strict xfail whose reason says
what it reported instead."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor
from scenarios import (BF16, EVERY, first_bad, FP16, in_top3, lines, no_error_at, nonfinite_loss_steps, one_thread,
                       randn, short_loop as loop)
from probe_harness import at_top3 as at


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


# ======================================================================================================================
# 1. speech front-end: Conv1d over raw int16 PCM (a clip loaded without / 32768) at step 3
# ======================================================================================================================
class AudioNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = nn.Sequential(nn.Conv1d(1, 16, 400, stride=160), nn.ReLU(), nn.Conv1d(16, 16, 3, padding=1))
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.frontend[0].weight.normal_(0, 0.1)  # a trained filterbank

    def forward(self, wav):
        return self.head(self.frontend(wav.unsqueeze(1)).mean(-1))


@EVERY
def test_conv_frontend_fed_raw_int16_pcm_overflows_in_the_first_conv(every):
    torch.manual_seed(0)
    m = AudioNet()
    wav = torch.rand(4, 8000, generator=torch.Generator().manual_seed(0)) * 2 - 1

    def batch(i):  # step 3's clip came from a loader path that forgot to normalise int16 samples
        return ((wav * 32767).round() if i == 3 else wav,)
    w = loop(m, batch, lambda o, *a: o.float().pow(2).mean(), every=every)
    assert first_bad(w) == 3 and nonfinite_loss_steps(w) == [3]
    rep = w.report()
    at(rep, ("overflow",), "frontend.0", step=3, phase="forward")
    no_error_at(rep, ("frontend.1", "frontend.2", "head", ""))


# ======================================================================================================================
# 2. weight-tied LM head (lm_head.weight is tok.weight), embeddings scaled by sqrt(d), no final norm
# ======================================================================================================================
class TiedLM(nn.Module):
    def __init__(self, V=128, d=64):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.tok.weight
        self.d = d
        with torch.no_grad():
            self.tok.weight[100:].mul_(12)  # rare tokens whose rows grew during pre-training

    def forward(self, idx):
        x = self.tok(idx) * math.sqrt(self.d)
        x = x + self.mlp(x)
        return self.lm_head(x)


@EVERY
def test_weight_tied_lm_head_logits_overflow_in_the_head_not_the_embedding(every):
    torch.manual_seed(0)
    m = TiedLM()
    g = torch.Generator().manual_seed(1)
    common = torch.randint(0, 100, (4, 16), generator=g)
    rare = common.clone()
    rare[:, 5] = 110

    def batch(i):
        return ((rare if i >= 4 else common),)
    w = loop(m, batch, lambda o, idx: F.cross_entropy(o.float().flatten(0, 1), idx.roll(-1, 1).flatten()),
             every=every)
    assert first_bad(w) == 4
    rep = w.report()
    at(rep, ("overflow",), "lm_head", step=4, phase="forward")
    no_error_at(rep, ("tok", "mlp", "mlp.0", "mlp.2", ""))


class RootTiedLM(TiedLM):
    """GPT-2 style: no lm_head module, the logits are F.linear(x, tok.weight) in the root's forward."""

    def __init__(self):
        super().__init__()
        del self.lm_head

    def forward(self, idx):
        x = self.tok(idx) * math.sqrt(self.d)
        x = x + self.mlp(x)
        return F.linear(x, self.tok.weight)


@EVERY
def test_tied_logits_by_f_linear_in_the_root_forward_are_the_roots_overflow(every):
    torch.manual_seed(0)
    m = RootTiedLM()
    g = torch.Generator().manual_seed(1)
    common = torch.randint(0, 100, (4, 16), generator=g)
    rare = common.clone()
    rare[:, 5] = 110
    w = loop(m, lambda i: ((rare if i >= 4 else common),),
             lambda o, idx: F.cross_entropy(o.float().flatten(0, 1), idx.roll(-1, 1).flatten()), every=every)
    assert first_bad(w) == 4
    rep = w.report()
    at(rep, ("overflow",), "", step=4, phase="forward")
    no_error_at(rep, ("tok", "mlp", "mlp.0", "mlp.2"))


# ======================================================================================================================
# 3./4. hand-written activations: swish x / (1 + exp(-x)) (forward finite, backward 0 * inf = NaN) and softplus
#       log(1 + exp(x)) (forward inf)
# ======================================================================================================================
class HandSwish(nn.Module):
    def forward(self, x):
        return x * (1.0 / (1.0 + torch.exp(-x)))


class HandSoftplus(nn.Module):
    def forward(self, x):
        return torch.log(1.0 + torch.exp(x))


class ActMLP(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), act, nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def outlier_batch(at_step, scale=40.0, persist=False):
    x = randn(32, 16)
    return lambda i: ((x * scale) if i == at_step or (persist and i > at_step) else x,)


@EVERY
def test_hand_written_swish_exp_overflow_is_a_backward_nan_at_the_activation(every):
    torch.manual_seed(0)
    m = ActMLP(HandSwish())
    w = loop(m, outlier_batch(3, scale=25.0, persist=True), lambda o, *a: o.float().mean(), every=every,
             init_scale=128.0)
    # real: finite loss, NaN gradients (every step skipped) from step 3 on: the loss scale collapses
    assert nonfinite_loss_steps(w) == [] and [r.step for r in w.steps if r.skipped] == [3, 4, 5, 6, 7]
    rep = w.report()
    at(rep, ("nan_origin", "overflow"), "act", step=3)
    no_error_at(rep, ("fc1", "fc2", ""))


@EVERY
def test_hand_written_softplus_exp_overflow_is_at_the_activation(every):
    torch.manual_seed(0)
    m = ActMLP(HandSoftplus())
    w = loop(m, outlier_batch(3), lambda o, *a: o.float().pow(2).mean(), every=every)
    assert nonfinite_loss_steps(w) == [3] and first_bad(w) == 3
    rep = w.report()
    at(rep, ("overflow",), "act", step=3, phase="forward")
    no_error_at(rep, ("fc1", "fc2", ""))


# ======================================================================================================================
# 5. prototypical network: squared distance by expansion, sqrt of a rounding-negative when a query equals its prototype
# ======================================================================================================================
class ExpandedDistance(nn.Module):
    def forward(self, q, p):
        d2 = (q * q).sum(-1, keepdim=True) + (p * p).sum(-1)[None] - 2 * (q @ p.t())
        return torch.sqrt(d2)


class ProtoNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.dist = ExpandedDistance()

    def forward(self, support, query):
        return -self.dist(self.enc(query), self.enc(support))  # one shot per class: the prototype is the embedding


@EVERY
def test_prototype_distance_by_expansion_is_nan_origin_at_the_distance(every):
    torch.manual_seed(0)
    m = ProtoNet()
    with torch.no_grad():
        m.enc[2].weight.mul_(4)
    support, query = randn(5, 16, seed=1) * 3, randn(10, 16, seed=2) * 3

    near = support.repeat(8, 1) + 1e-3 * randn(40, 16, seed=3)

    def batch(i):  # from step 2 the episode sampler puts near-duplicates of the support images in the query set
        return (support, near if i >= 2 else query)
    w = loop(m, batch, lambda o, s, q: F.cross_entropy(o.float(), torch.arange(len(q)) % 5), every=every)
    assert nonfinite_loss_steps(w)[:1] == [2]
    rep = w.report()
    at(rep, ("nan_origin",), "dist", step=2, phase="forward")
    no_error_at(rep, ("enc", "enc.0", "enc.2", ""))


# ======================================================================================================================
# 6. SwAV: Sinkhorn's exp(scores / 0.05) on cosine scores overflows fp16 from step 0
# ======================================================================================================================
class Sinkhorn(nn.Module):
    def __init__(self, eps=0.05, iters=3):
        super().__init__()
        self.eps, self.iters = eps, iters

    @torch.no_grad()
    def forward(self, scores):
        Q = torch.exp(scores / self.eps).t()
        Q = Q / Q.sum()
        K, B = Q.shape
        for _ in range(self.iters):
            Q = Q / Q.sum(dim=1, keepdim=True) / K
            Q = Q / Q.sum(dim=0, keepdim=True) / B
        return (Q * B).t()


class SwAV(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.prototypes = nn.Linear(16, 32, bias=False)
        self.sinkhorn = Sinkhorn()
        with torch.no_grad():
            self.prototypes.weight.copy_(F.normalize(self.prototypes.weight, dim=1))

    def forward(self, x1, x2):
        s1 = self.prototypes(F.normalize(self.backbone(x1), dim=1))
        s2 = self.prototypes(F.normalize(self.backbone(x2), dim=1))
        q1, q2 = self.sinkhorn(s1), self.sinkhorn(s2)
        return -0.5 * ((q1 * F.log_softmax(s2.float() / 0.1, 1)).sum(1).mean()
                       + (q2 * F.log_softmax(s1.float() / 0.1, 1)).sum(1).mean())


@EVERY
def test_swav_sinkhorn_exp_of_scores_over_eps_overflows_in_the_sinkhorn(every):
    torch.manual_seed(0)
    m = SwAV()
    x = randn(32, 32)
    w = loop(m, lambda i: (x, x + 0.1 * randn(32, 32, seed=i + 1)), lambda o, *a: o, every=every)
    assert nonfinite_loss_steps(w)[:1] == [0]
    rep = w.report()
    at(rep, ("overflow",), "sinkhorn", step=0, phase="forward")
    no_error_at(rep, ("backbone", "backbone.2", "prototypes"))  # (root: F.normalize's eps=1e-12 is a fair finding)


# ======================================================================================================================
# 7. mixture density network: component densities exp(-z^2/2) flush to 0 in fp16 for an outlier target -> log(0)
# ======================================================================================================================
class MDNLoss(nn.Module):
    def forward(self, pi_logits, mu, log_sigma, y):
        sigma = torch.exp(log_sigma)
        z = (y[:, None] - mu) / sigma
        dens = torch.exp(-0.5 * z * z) / (sigma * math.sqrt(2 * math.pi))
        p = (torch.softmax(pi_logits, -1) * dens).sum(-1)
        return -torch.log(p).mean()


class MDN(nn.Module):
    def __init__(self, K=5):
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(8, 64), nn.Tanh())
        self.pi, self.mu, self.log_sigma = nn.Linear(64, K), nn.Linear(64, K), nn.Linear(64, K)
        self.criterion = MDNLoss()

    def forward(self, x, y):
        h = self.hidden(x)
        return self.criterion(self.pi(h), self.mu(h), self.log_sigma(h), y)


@EVERY
def test_mixture_density_loss_log_of_flushed_densities_is_at_the_criterion(every):
    torch.manual_seed(0)
    m = MDN()
    x, y = randn(64, 8), randn(64, seed=1).half()  # targets stored in fp16 by the dataset

    def batch(i):  # step 4 has a few outlier targets (a sensor glitch)
        return (x, torch.where(torch.arange(64) < 4, torch.tensor(12.0).half(), y) if i == 4 else y)
    w = loop(m, batch, lambda o, *a: o, every=every)
    assert nonfinite_loss_steps(w) == [4]
    rep = w.report()
    at(rep, ("overflow", "underflow"), "criterion", step=4, phase="forward")
    no_error_at(rep, ("hidden", "hidden.0", "pi", "mu", "log_sigma", ""))


# ======================================================================================================================
# 8. sinusoidal positions from torch.arange(T, dtype=x.dtype): past 65504 frames the positions are inf -> sin(inf)
# ======================================================================================================================
class SinusoidalPositions(nn.Module):
    def forward(self, x):
        T, d = x.shape[1], x.shape[2]
        pos = torch.arange(T, device=x.device, dtype=x.dtype)[:, None]
        div = torch.exp(torch.arange(0, d, 2, device=x.device, dtype=x.dtype) * (-math.log(10000.0) / d))
        pe = torch.cat([torch.sin(pos * div), torch.cos(pos * div)], -1)
        return x + pe


class FrameEncoder(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.proj, self.pos, self.out = nn.Linear(2, d), SinusoidalPositions(), nn.Linear(d, 1)

    def forward(self, frames):
        return self.out(self.pos(self.proj(frames)))


def test_sinusoidal_positions_from_an_fp16_arange_past_65504_is_at_the_positions():
    torch.manual_seed(0)
    m = FrameEncoder()
    short, long = randn(1, 1000, 2), randn(1, 66000, 2, seed=1)  # step 3: a recording of 66000 frames
    w = loop(m, lambda i: (long if i == 3 else short,), lambda o, *a: o.float().pow(2).mean())
    assert nonfinite_loss_steps(w) == [3]
    rep = w.report()
    at(rep, ("overflow", "nan_origin"), "pos", step=3, phase="forward")
    no_error_at(rep, ("proj", "out", ""))


# ======================================================================================================================
# 9. an overflow inside an activation-checkpointed block (its forward runs twice: once more inside the backward)
# ======================================================================================================================
class CkptBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class CkptNet(nn.Module):
    def __init__(self, d=16, n=3, reentrant=False):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(CkptBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 1)
        self.inp = nn.Linear(d, d)  # identity (so that the reentrant checkpoint's input requires grad)
        with torch.no_grad():
            self.blocks[1].fc2.weight.mul_(3000)
            self.inp.weight.copy_(torch.eye(d))
            self.inp.bias.zero_()

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


@EVERY
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_overflow_inside_an_activation_checkpointed_block_is_its_linear(every, reentrant):
    torch.manual_seed(0)
    m = CkptNet(reentrant=reentrant)
    w = loop(m, outlier_batch(3, scale=30.0), lambda o, *a: o.float().mean(), every=every)
    assert nonfinite_loss_steps(w) == [3]
    rep = w.report()
    at(rep, ("overflow",), "blocks.1.fc2", step=3, phase="forward")
    no_error_at(rep, ("inp", "blocks.1", "blocks.2", "blocks.2.fc1", "head", ""))


# ======================================================================================================================
# 10. RMSNorm with eps=1e-8 (0 in fp16) on a padding row: 0 * rsqrt(0) = NaN
# ======================================================================================================================
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-8):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class PaddedEncoder(nn.Module):
    def __init__(self, V=50, d=32):
        super().__init__()
        self.tok = nn.Embedding(V, d, padding_idx=0)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, idx):
        return self.head(self.norm(self.proj(self.tok(idx))))


@EVERY
def test_rms_norm_eps_1e_8_on_a_padding_row_is_at_the_norm(every):
    torch.manual_seed(0)
    m = PaddedEncoder()
    idx = torch.randint(1, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    padded = idx.clone()
    padded[0, 9:] = 0  # step 2: the first batch with a short sequence, padded with index 0

    def batch(i):
        return (padded if i == 2 else idx,)
    w = loop(m, batch, lambda o, *a: o.float().pow(2).mean(), every=every)
    assert nonfinite_loss_steps(w) == [2]
    rep = w.report()
    at(rep, ("eps_underflow", "nan_origin"), "norm", step=2)
    no_error_at(rep, ("tok", "proj", "head", ""))


# ======================================================================================================================
# 11. stick-breaking weights by cumprod in fp16: the remaining stick flushes to 0 after ~24 breaks, log(0) = -inf
# ======================================================================================================================
class StickBreaking(nn.Module):
    def forward(self, logits):
        beta = torch.sigmoid(logits)
        rem = torch.cumprod(1 - beta, dim=-1)
        w = beta * torch.cat([torch.ones_like(rem[..., :1]), rem[..., :-1]], -1)
        return torch.log(w)


class StickModel(nn.Module):
    def __init__(self, K=64):
        super().__init__()
        self.fc = nn.Linear(16, K)
        self.stick = StickBreaking()

    def forward(self, x):
        return self.stick(self.fc(x))


@EVERY
def test_stick_breaking_cumprod_flushing_to_zero_under_log_is_at_the_stick(every):
    torch.manual_seed(0)
    m = StickModel()
    x = randn(16, 16)
    tgt = torch.arange(16) * 4  # targets spread over all 64 sticks
    w = loop(m, lambda i: (x,), lambda o, x: F.nll_loss(o.float(), tgt), every=every)
    assert nonfinite_loss_steps(w)[:1] == [0]
    rep = w.report()
    at(rep, ("underflow", "overflow"), "stick", step=0, phase="forward")
    no_error_at(rep, ("fc", ""))


# ======================================================================================================================
# 12. a log-cosh regression loss module: cosh(12) = 81377 > 65504 for an outlier residual
# ======================================================================================================================
class LogCosh(nn.Module):
    def forward(self, pred, y):
        return torch.log(torch.cosh(pred - y)).mean()


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.criterion = LogCosh()

    def forward(self, x, y):
        return self.criterion(self.net(x).squeeze(-1), y)


@EVERY
def test_log_cosh_loss_overflows_in_the_criterion_on_an_outlier_target(every):
    torch.manual_seed(0)
    m = Regressor()
    x, y = randn(32, 8), randn(32, seed=1).half()

    def batch(i):
        yy = y.clone()
        if i == 5:
            yy[3] = 20.0  # a mislabelled sample
        return (x, yy)
    w = loop(m, batch, lambda o, *a: o, every=every)
    assert nonfinite_loss_steps(w) == [5]
    rep = w.report()
    at(rep, ("overflow",), "criterion", step=5, phase="forward")
    no_error_at(rep, ("net", "net.0", "net.2", ""))


# ======================================================================================================================
# 13. linear attention: the k^T v state summed over a long sequence overflows fp16
# ======================================================================================================================
class LinearAttention(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        kv = torch.einsum("btd,bte->bde", k, v)
        z = 1.0 / (torch.einsum("btd,bd->bt", q, k.sum(1)) + 1e-3)
        return self.out(torch.einsum("btd,bde,bt->bte", q, kv, z))


class LinearAttnNet(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(4, d), LinearAttention(d), nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.attn(self.inp(x)).mean(1))


@EVERY
def test_linear_attention_kv_state_over_a_long_sequence_overflows_in_the_attention(every):
    torch.manual_seed(0)
    m = LinearAttnNet()
    with torch.no_grad():
        m.inp.weight.mul_(6)
    short, long = randn(2, 64, 4), randn(2, 4096, 4, seed=1)
    w = loop(m, lambda i: (long if i == 3 else short,), lambda o, *a: o.float().pow(2).mean(), every=every)
    assert first_bad(w) == 3
    rep = w.report()
    at(rep, ("overflow",), "attn", step=3, phase="forward")
    no_error_at(rep, ("inp", "attn.qkv", "attn.out", "head", ""))


# ======================================================================================================================
# 14. reduction="sum" over a big batch with unnormalised targets: the head's weight gradient overflows at every scale
# ======================================================================================================================
@EVERY
def test_sum_reduced_loss_over_a_big_batch_overflows_the_heads_weight_gradient(every):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = randn(512, 8), randn(512, 1, seed=1) * 300 + 2000  # house prices in thousands, not standardised
    w = loop(m, lambda i: (x,), lambda o, x: F.mse_loss(o.float(), y, reduction="sum"), every=every, steps=10)
    assert nonfinite_loss_steps(w) == [] and all(r.skipped for r in w.steps)
    rep = w.report()
    at(rep, ("overflow", "loss_scale_collapse"), "2", phase="backward")
    no_error_at(rep, ("0", "1", ""))


# ======================================================================================================================
# 15. StepLR(gamma=10), a typo for 0.1: the lr jumps x10 at steps 3 and 6 and the weights blow up
# ======================================================================================================================
def test_step_lr_gamma_10_update_spike_or_overflow_at_the_step_it_jumps():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=10.0)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    x, y = randn(64, 16), randn(64, 1, seed=1)
    lrs, losses = [], []
    for i in range(10):
        opt.zero_grad()
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(loss.item())
        sched.step()
    w.close()
    assert not all(map(math.isfinite, losses)), losses
    rep = w.report()
    got = [(f.rule, f.module, f.step) for f in rep.findings[:3]]
    bad = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    ok = [g for g in got if g[1] in ("0", "2") and (g[0] == "update_spike" and g[2] in (3, 6)
                                                    or g[0] == "overflow" and g[2] == bad)]
    assert ok, (losses, lines(rep))


# ======================================================================================================================
# 16. pure-bf16 fine-tuning (model.to(torch.bfloat16), AdamW lr=1e-5): every update rounds away
# ======================================================================================================================
def test_pure_bf16_adamw_small_lr_updates_round_away():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    w = ampdoctor.watch(m, optimizer=opt)
    x, y = randn(64, 32).bfloat16(), randn(64, 1, seed=1).bfloat16()
    changed = []
    for i in range(6):
        opt.zero_grad()
        F.mse_loss(m(x).float(), y.float()).backward()
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        changed.append(max(float((b != p).float().mean()) for b, p in zip(before, m.parameters())))
    w.close()
    assert max(changed[1:]) < 0.05, changed  # real: (nearly) no element moves
    rep = w.report()
    got = [(f.rule, f.module) for f in rep.findings[:3]]
    assert ("update_underflow", "0") in got or ("update_underflow", "2") in got, lines(rep)


# ======================================================================================================================
# 17. GradScaler(growth_interval=1): the scale doubles every step and every other step overflows and is skipped
# ======================================================================================================================
def test_growth_interval_1_skips_every_other_step():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    x, y = randn(64, 8) * 3, randn(64, 1, seed=1) * 3
    for i in range(40):
        opt.zero_grad()
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    w.close()
    skipped = sum(r.skipped for r in w.steps)
    assert skipped >= 12, skipped  # real: a third or more of the steps skipped
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "skipped_steps"), None)
    assert f is not None and f.severity in ("warning", "error"), lines(rep)


# ======================================================================================================================
# 18./19. two optimizers (body + head), one GradScaler
# ======================================================================================================================
class BodyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x))


def two_opt_run(after_backward):
    torch.manual_seed(0)
    m = BodyHead()
    ob = torch.optim.AdamW(m.body.parameters(), lr=1e-3)
    oh = torch.optim.SGD(m.head.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=ob, scaler=sc)
    x, y = randn(32, 8), randn(32, 1, seed=1)
    head_w = []
    for i in range(6):
        ob.zero_grad()
        oh.zero_grad()
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y)
        sc.scale(loss).backward()
        after_backward(m, ob, oh, sc)
        sc.update()
        head_w.append(m.head.weight.detach().abs().max().item())
    w.close()
    return w.report(), head_w


def test_two_optimizers_clip_after_unscaling_only_one_is_clip_before_unscale():
    """Was nothing at all: the clip was judged against the watched optimizer's scaler stage only (UNSCALED),
    not against the optimizer that owns the clipped head parameters (still scaled)."""
    norms = []

    def after(m, ob, oh, sc):
        sc.unscale_(ob)  # the head's optimizer was forgotten here
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))  # the head's grads still scaled
        sc.step(ob)
        sc.step(oh)
    rep, _ = two_opt_run(after)
    assert min(norms) > 100, norms  # real: the norm clipped is ~1000x the true one (the head's 1024x scaled grads)
    f = next((f for f in rep.findings[:3] if f.rule == "clip_before_unscale"), None)
    assert f is not None and f.step == 0, lines(rep)


def test_second_optimizer_stepped_directly_on_scaled_gradients_is_scaler_misorder():
    def after(m, ob, oh, sc):
        sc.step(ob)
        oh.step()  # the head's optimizer bypasses the scaler: it applies gradients 1024x too large
    rep, head_w = two_opt_run(after)
    assert head_w[0] > 1, head_w  # real: the head's weights jumped
    f = next((f for f in rep.findings[:3] if f.rule == "scaler_misorder"), None)
    assert f is not None and f.step == 0, lines(rep)


# ======================================================================================================================
# 20. knowledge distillation: a frozen teacher (run under no_grad) inside the watched wrapper overflows at step 2
# ======================================================================================================================
class Distiller(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
        self.teacher = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                     nn.Linear(256, 10))
        self.teacher.requires_grad_(False)
        with torch.no_grad():
            self.teacher[2].weight.mul_(8000)  # a teacher trained in fp32 with large activations

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x)
        s = self.student(x)
        return F.kl_div(F.log_softmax(s.float() / 2, -1), F.softmax(t.float() / 2, -1), reduction="batchmean")


@EVERY
def test_frozen_teacher_under_no_grad_overflows_in_its_own_layer(every):
    torch.manual_seed(0)
    m = Distiller()
    x = randn(32, 16)
    w = loop(m, lambda i: (x * 8 if i == 2 else x,), lambda o, *a: o, every=every)
    assert nonfinite_loss_steps(w) == [2]
    rep = w.report()
    at(rep, ("overflow",), "teacher.2", step=2, phase="forward")
    no_error_at(rep, ("teacher", "teacher.3", "teacher.4", "student", ""))
