"""Nineteenth set of failure-pattern variants: fp16 forward/backward overflow, NaN, mask-constant and epsilon failures
in architectures the eighteen earlier sets do not build (RetNet, evidential deep learning, a von Mises direction
head, NeuralSort learning-to-rank, Performer's FAVOR+, a pointer network, a class-conditional mapping network with
PixelNorm, DeepFM, an improved bilinear CNN, a wav2vec2-style Gumbel quantizer, a LLaMA-style SwiGLU block), watched
through the public API only (watch -> an ordinary fp16 autocast + GradScaler loop on the CPU -> w.report()) at
ampdoctor's default settings (and, for 7, 9 and 11, at every=1 too), with the failure starting mid-run (never at step
0) and neighbours on both sides of the producer.

 1. RetNet's chunk-parallel retention with the decay factorised onto q and k (gamma^(i-j) = gamma^i * gamma^-j, one
    matmul instead of a (T, T) decay mask) and cast to the activations' fp16: the sequence-length curriculum jumps
    from 64 to 512 tokens at step 4, the fastest-decaying head's gamma^-511 = 1.1e7 is inf (`blocks.0.retention`,
    not its q/k/v Linears, not the FFN or the norms);
 2. evidential deep learning (Sensoy et al. 2018) fine-tuned from a CE-pretrained classifier, exp evidence clamped at
    10 as the EDL repos do, and the Dirichlet KL regulariser's lgamma in fp16: a mislabelled sample at step 4 keeps
    its confident (wrong) evidence alpha ~ 1.6e4 in alpha_tilde, lgamma(1.6e4) = 1.4e5 is inf (`edl`);
 3. a von Mises likelihood for wind direction whose concentration kappa grows with the wind speed (a physical prior)
    and whose normaliser is log(I0(kappa)) in fp16: a storm batch at step 4 drives kappa past 13.3, I0 is inf
    (`likelihood`, not the kappa Linear);
 4. NeuralSort (Grover et al. 2019) as a listwise ranking loss: P_max = ((n + 1 - 2i) s - A_s 1) / tau in fp16 with
    tau = 0.05; a query with 1024 candidates at step 4 (32 before) passes 65504 in the division (`sorter`, not the
    scorer or the NDCG module);
 5. Performer's FAVOR+ positive random features exp(w.x - |x|^2 / 2) without performer-pytorch's stabiliser: a
    sensor spike at step 4 makes one query's |x|^2 / 2 ~ 300, every feature flushes to 0 and its normaliser is
    0 / 0 (`blocks.0.attn`, not its qkv Linear nor the input projection);
 6. a pointer network sorting variable-length lists whose attention masks padding with masked_fill(-1e10), passed
    only for ragged batches: the first ragged batch at step 3 raises "value cannot be converted to type c10::Half
    without overflow" (mask_value_overflow at `pointer`);
 7. a class-conditional denoiser with classifier-free-guidance label dropout, a StyleGAN-style mapping network and
    PixelNorm x * rsqrt(mean(x^2) + 1e-8): the null label (a zero padding_idx row, through a bias-free projection)
    first drawn at step 3 is a zero vector, the 1e-8 is 0 in fp16, 0 * inf = NaN (`mapping.norm_c`; eps_underflow);
 8. DeepFM whose FM term 0.5 ((sum v)^2 - sum v^2) runs on fp16 field embeddings: a raw (un-logged) click count
    at step 4 makes one field ~300, both squares are inf and inf - inf NaN (`fm`, not field_proj, not the deep MLP);
 9. an improved bilinear CNN (Lin & Maji 2017) with the signed square root sign(g) sqrt(|g| + 1e-10): a blank
    (constant) video frame at step 4 leaves dead channels, exact zeros in the Gram matrix; the forward is finite,
    the 1e-10 is 0 in fp16 and sqrt's backward is 0 / 0 (a backward-only NaN at `pool`);
10. a wav2vec2-style Gumbel-softmax quantizer whose temperature decays per update to a floor of 1e-4 ("hard codes
    after the warm-up"): (logits + g) / tau passes 65504 once tau < ~2e-4, at step 7 (natural onset; `quantizer`);
11. a LLaMA-style block whose norm has an outlier gain on one channel (the massive-activation channel of pretrained
    LLMs, Sun et al. 2024): packed batches start carrying BOS at step 4, silu(gate) * up on BOS is ~1e5 = inf in the
    SwiGLU's own product (`blocks.0.mlp`, not gate/up/down, not the attention).
Healthy twins (the fix applied, the same inputs including the special batch; no warning and no error): 1 with the
decay as a masked (T, T) matrix exp((i - j) log gamma), 3 with log(i0e(kappa)) + kappa, 9 with the signed square
root in fp32.

Each failure is first checked to be real in the loop itself: forward hooks on every module name the first module (and
step) whose output is non-finite while its inputs and own parameters were finite; for 9 full backward hooks and
parameter hooks name the first module whose gradient w.r.t. its inputs or its own parameters is non-finite while the
gradient reaching its outputs was finite (and the forward stays finite); the loss, the scaler's skipped step and the
case's mechanism (the cast value, lgamma's argument, kappa, the fp32 reference, the exception, ...) are checked too.
Then ampdoctor's report must hold an `error` finding of the right rule at that module among the first three, at that
step, with no error at the modules that only passed the value on. Where ampdoctor is wrong the test is a strict
xfail whose reason says what it reported instead.

What ampdoctor got wrong: all eleven producers are named with the right rule at the right step among the first three
findings (at every=1 too for 7, 9, 11), with no error at the neighbours, and the three twins are quiet. Fixed since
(they were strict xfails): the message of 4 and 10 (a division by a nonzero Python temperature whose quotient
overflows) called it `aten::div ... hit its singular point (an input is 0 / -1)` and added a spurious `[error]
underflow ... the zeros that aten::div turned into +inf are not zero in fp32` (in 10 the second of the first three
slots): replay/optrace.py counted a zero in any input of div as the singular point (exact zeros of the numerator);
it now counts the divisor's (`replay/opevent.pole_inputs`).
"""
import copy
import math
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, in_top3, lines, no_error_at, one_thread
from probe_harness import error_at, healthy as _healthy, real_fwd as real, train_loop as _train_loop


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
# the backward oracle's full backward hooks on modules whose inputs need no gradient (the first layer): expected
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

EVERY = pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])


def at(rep, rules, module, step, phase="forward"):
    """probe_harness.error_at at `step`, in the forward unless told."""
    return error_at(rep, rules, module, step, phase)


def train_loop(m, batch, loss_fn, steps, *, backward_oracle=False, **kw):
    """probe_harness.train_loop; `backward_oracle`: the oracle's backward hooks too; a forward that raises ends the loop."""
    return _train_loop(m, batch, loss_fn, steps, backward=backward_oracle, catch=True, **kw)


healthy = partial(_healthy, bwd=False)  # the oracle's backward producer is not checked


def gen(i):
    return torch.Generator().manual_seed(i)


def fp16_forward(m, *args):
    """One forward of (a copy of) `m` under fp16 autocast, outside any watch."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        return copy.deepcopy(m)(*args)


# ======================================================================================================================
# 1. RetNet retention with the decay factorised onto q and k, cast to fp16: a 512-token batch at step 4
# ======================================================================================================================
class Retention(nn.Module):
    def __init__(self, d=32, h=4, stable=False):
        super().__init__()
        self.h, self.stable = h, stable
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.register_buffer("log_gamma", torch.log(1 - 2.0 ** (-5.0 - torch.arange(h))))  # RetNet's per-head decay

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.h, C // self.h).transpose(1, 2) for f in (self.q, self.k, self.v))
        k = k * (C // self.h) ** -0.5
        n = torch.arange(T, dtype=torch.float32)
        if self.stable:  # the (T, T) decay mask gamma^(i - j) for i >= j, 0 above the diagonal
            diff = n[:, None] - n[None, :]
            D = torch.exp(self.log_gamma[:, None, None] * diff.clamp(min=0)) * (diff >= 0)
            att = (q @ k.transpose(-1, -2)) * D.to(q.dtype)
        else:  # gamma^(i - j) = gamma^i * gamma^-j folded into q and k: one matmul, no (T, T) mask to build
            q = q * torch.exp(self.log_gamma[:, None] * n)[..., None].to(q.dtype)
            k = k * torch.exp(-self.log_gamma[:, None] * n)[..., None].to(k.dtype)
            att = (q @ k.transpose(-1, -2)).tril()
        att = att / att.abs().sum(-1, keepdim=True).clamp(min=1)  # RetNet's retention-score normalisation
        return self.o((att @ v).transpose(1, 2).reshape(B, T, C))


class RetNetBlock(nn.Module):
    def __init__(self, d=32, stable=False):
        super().__init__()
        self.ln1, self.retention = nn.LayerNorm(d), Retention(d, stable=stable)
        self.ln2, self.ffn = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.retention(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class RetNet(nn.Module):
    def __init__(self, vocab=32, d=32, stable=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(RetNetBlock(d, stable), RetNetBlock(d, stable))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.emb(idx))))


def _counting(i):  # sequences that count up mod 32 (learnable); the length curriculum jumps to 512 at step 4
    T, B = (512, 2) if i >= 4 else (64, 8)
    start = torch.randint(0, 32, (B, 1), generator=gen(i))
    seq = (start + torch.arange(T + 1)) % 32
    return seq[:, :-1], seq[:, 1:]


def _lm_loss(o, idx, y):
    return F.cross_entropy(o.float().flatten(0, 1), y.flatten())


def test_retnet_factorised_decay_overflows_in_the_retention_when_the_length_curriculum_reaches_512():
    torch.manual_seed(0)
    m = RetNet()
    casts = []

    def hook(mod, inp, out):  # the largest factor gamma^-j the retention casts to fp16 (fastest-decaying head)
        casts.append(math.exp(-float(mod.log_gamma[0]) * (inp[0].shape[1] - 1)))

    h = m.blocks[0].retention.register_forward_hook(hook)
    r = train_loop(m, _counting, _lm_loss, 6, lr=3e-3, call=lambda idx, y: m(idx))
    h.remove()
    real(r, "blocks.0.retention", 4)
    assert casts[3] < 100 and casts[4] > 65504, casts  # 64 tokens: gamma^-63 = 7.4; 512: gamma^-511 = 1.1e7
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "blocks.0.retention", 4)
    no_error_at(rep, ("blocks.0.retention.q", "blocks.0.retention.k", "blocks.0.retention.v",
                      "blocks.0.retention.o", "blocks.0.ln1", "blocks.0.ln2", "blocks.0.ffn", "blocks.0.ffn.0",
                      "blocks.0.ffn.2", "blocks.0", "blocks.1", "blocks.1.retention", "blocks", "emb", "ln", "head",
                      ""))


def test_healthy_twin_retnet_with_the_masked_decay_matrix_on_the_same_512_token_batch_is_quiet():
    torch.manual_seed(0)
    m = RetNet(stable=True)
    r = train_loop(m, _counting, _lm_loss, 8, lr=3e-3, call=lambda idx, y: m(idx))
    healthy(r)


# ======================================================================================================================
# 2. evidential deep learning: the Dirichlet KL's lgamma in fp16 on a mislabelled, confidently predicted sample
# ======================================================================================================================
class EDLLoss(nn.Module):
    """Sensoy et al. 2018: the expected cross-entropy under Dir(alpha) plus the annealed KL(Dir(alpha_tilde) ||
    Dir(1)), alpha_tilde = the evidence with the target's removed; exp evidence clamped at 10 (the EDL repos)."""

    def __init__(self, K=10, anneal=0.5):
        super().__init__()
        self.K, self.anneal = K, anneal

    def forward(self, logits, y):
        alpha = torch.exp(logits.clamp(-10, 10)) + 1
        S = alpha.sum(-1, keepdim=True)
        onehot = F.one_hot(y, self.K).to(alpha.dtype)
        nll = (onehot * (torch.digamma(S) - torch.digamma(alpha))).sum(-1)
        at = onehot + (1 - onehot) * alpha
        St = at.sum(-1, keepdim=True)
        kl = (torch.lgamma(St.squeeze(-1)) - math.lgamma(self.K) - torch.lgamma(at).sum(-1)
              + ((at - 1) * (torch.digamma(at) - torch.digamma(St))).sum(-1))
        return nll + self.anneal * kl


class EvidentialNet(nn.Module):
    def __init__(self, d_in=16, d=64, K=10):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.evidence = nn.Linear(d, K)
        self.edl = EDLLoss(K)

    def forward(self, x, y):
        return self.edl(self.evidence(self.backbone(x)), y).mean()


_CENTRES = torch.randn(10, 16, generator=gen(99)) * 2


def _digits(i, n=32):
    g = gen(100 + i)
    y = torch.randint(0, 10, (n,), generator=g)
    x = _CENTRES[y] + 0.5 * torch.randn(n, 16, generator=g)
    if i == 4:
        y = y.clone()
        y[7] = (y[7] + 1) % 10  # an annotator's swapped label
    return x, y


def _pretrained_classifier():
    torch.manual_seed(0)
    m = EvidentialNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for i in range(60):  # CE pretraining in fp32 (the checkpoint EDL fine-tunes)
        x, y = _digits(1000 + i, 64)
        opt.zero_grad()
        F.cross_entropy(m.evidence(m.backbone(x)), y).backward()
        opt.step()
    return m


def test_evidential_dirichlet_kl_lgamma_overflows_in_the_edl_module_on_a_mislabelled_confident_sample():
    m = _pretrained_classifier()
    x4, y4 = _digits(4)
    logits = fp16_forward(m.evidence, fp16_forward(m.backbone, x4))
    wrong = logits[7].float().clamp(-10, 10).exp() + 1
    # real: the mislabelled sample's (wrong) confident evidence reaches alpha_tilde, past lgamma's fp16 range
    assert int(logits[7].argmax()) != int(y4[7]) and float(wrong.max()) > 9000, logits[7]
    assert math.lgamma(float(wrong.max())) > 65504
    r = train_loop(m, _digits, lambda loss, x, y: loss, 6, lr=1e-4)
    real(r, "edl", 4)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "edl", 4)
    no_error_at(rep, ("evidence", "backbone", "backbone.0", "backbone.2", ""))


# ======================================================================================================================
# 3. a von Mises direction head: log(I0(kappa)) in fp16 on a storm batch (kappa grows with wind speed)
# ======================================================================================================================
class VonMisesNLL(nn.Module):
    def __init__(self, stable=False):
        super().__init__()
        self.stable = stable

    def forward(self, mu, kappa, theta):
        log_i0 = torch.log(torch.special.i0e(kappa)) + kappa if self.stable else torch.log(torch.special.i0(kappa))
        return -kappa * torch.cos(theta - mu) + math.log(2 * math.pi) + log_i0


class WindDirection(nn.Module):
    def __init__(self, d=32, stable=False):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(7, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.mu = nn.Linear(d, 1)
        self.kappa = nn.Linear(d + 1, 1)  # sees the wind speed directly: stronger wind, steadier direction
        with torch.no_grad():
            self.kappa.weight.normal_(0, 0.01)
            self.kappa.weight[0, -1] = 0.3
            self.kappa.bias.fill_(-1.0)
        self.likelihood = VonMisesNLL(stable)

    def forward(self, met, speed, theta):
        h = self.encoder(torch.cat([met, speed], -1))
        kappa = F.softplus(self.kappa(torch.cat([h, speed], -1)))
        return self.likelihood(self.mu(h), kappa, theta)


_WIND_W = torch.randn(6, generator=gen(7))


def _stations(i):
    g = gen(200 + i)
    met = torch.randn(64, 6, generator=g)
    speed = 2 + 10 * torch.rand(64, 1, generator=g)
    if i == 4:
        speed = speed + 50  # a storm: 52-62 m/s
    theta = (0.5 * met @ _WIND_W)[:, None] + 0.3 * torch.randn(64, 1, generator=g)
    return met, speed, theta


def _wind_loss(nll, met, speed, theta):
    return nll.float().mean()


def test_von_mises_log_i0_of_a_storm_batch_overflows_in_the_likelihood_module():
    torch.manual_seed(0)
    m = WindDirection()
    kappas = []
    h = m.kappa.register_forward_hook(lambda mod, inp, out: kappas.append(float(F.softplus(out.detach().float()).max())))
    r = train_loop(m, _stations, _wind_loss, 6, call=lambda met, speed, theta: m(met, speed, theta))
    h.remove()
    real(r, "likelihood", 4)
    # real: kappa stays below ~4 on ordinary days; the storm drives it past 13.3, where fp16 I0 is inf
    assert max(kappas[:4]) < 5 and kappas[4] > 14, kappas
    assert not torch.isfinite(torch.special.i0(torch.tensor(kappas[4], dtype=torch.float16)))
    rep = r["w"].report()
    at(rep, ("overflow",), "likelihood", 4)
    no_error_at(rep, ("kappa", "mu", "encoder", "encoder.0", "encoder.2", ""))


def test_healthy_twin_von_mises_with_log_i0e_plus_kappa_on_the_same_storm_batch_is_quiet():
    torch.manual_seed(0)
    m = WindDirection(stable=True)
    r = train_loop(m, _stations, _wind_loss, 12, lr=1e-2, call=lambda met, speed, theta: m(met, speed, theta))
    healthy(r)


# ======================================================================================================================
# 4. NeuralSort as a listwise ranking loss: a 1024-candidate query at step 4 overflows P_max / tau
# ======================================================================================================================
class NeuralSort(nn.Module):
    """Grover et al. 2019, as their code writes it: P_max = (C - B)^T with C = s (n + 1 - 2i)^T, B = A_s 1."""

    def __init__(self, tau=0.05):
        super().__init__()
        self.tau = tau

    def forward(self, s):  # s: (B, n, 1)
        n = s.shape[1]
        one = torch.ones(n, 1, dtype=s.dtype)
        A = (s - s.transpose(1, 2)).abs()
        Bm = A @ one
        scaling = (n + 1 - 2 * (torch.arange(n) + 1)).to(s.dtype)
        C = s @ scaling[None, None, :]
        P_max = (C - Bm).transpose(1, 2)
        return torch.softmax(P_max / self.tau, -1)


class NDCGLoss(nn.Module):
    def forward(self, P, rel):
        gains = (2 ** rel - 1)[..., None]
        disc = 1 / torch.log2(torch.arange(rel.shape[1], dtype=torch.float32) + 2)
        dcg = ((P.float() @ gains).squeeze(-1) * disc).sum(-1)
        ideal = (gains.squeeze(-1).sort(-1, descending=True).values * disc).sum(-1)
        return 1 - (dcg / ideal).mean()


class Ranker(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.scorer = nn.Sequential(nn.Linear(8, d), nn.ReLU(), nn.Linear(d, 1))
        with torch.no_grad():  # pre-trained pointwise on graded relevance: scores around 4
            self.scorer[2].bias.fill_(4.0)
        self.sorter, self.ndcg = NeuralSort(), NDCGLoss()

    def forward(self, docs, rel):
        return self.ndcg(self.sorter(self.scorer(docs)), rel)


_REL_W = torch.randn(8, generator=gen(8))


def _queries(i):
    g = gen(300 + i)
    B, n = (1, 1024) if i == 4 else (8, 32)
    docs = torch.randn(B, n, 8, generator=g)
    rel = (docs @ _REL_W).clamp(-2, 2).add(2).round()  # graded relevance 0..4
    return docs, rel


def _row_max(s):
    """The largest row maximum of P_max, in fp32: about n * mean(s), the value the softmax subtracts."""
    s = s.detach().float()
    n = s.shape[1]
    C = s @ (n + 1 - 2 * (torch.arange(n) + 1)).float()[None, None, :]
    return float((C - (s - s.transpose(1, 2)).abs().sum(-1, keepdim=True)).amax(1).max())


def test_neuralsort_relaxed_permutation_overflows_in_the_sorter_on_a_1024_candidate_query():
    torch.manual_seed(0)
    m = Ranker()
    pre = []
    h = m.sorter.register_forward_hook(lambda mod, inp, out: pre.append(_row_max(inp[0]) / mod.tau))
    r = train_loop(m, _queries, lambda loss, docs, rel: loss, 6, call=lambda docs, rel: m(docs, rel))
    h.remove()
    real(r, "sorter", 4)
    # real: the scores are finite fp16; on 32 candidates |P_max| / tau stays far below 65504, on 1024 it cannot
    docs, rel = _queries(4)
    s = fp16_forward(m.scorer, docs)
    assert s.dtype == torch.float16 and bool(torch.isfinite(s).all())
    assert _row_max(s) / 0.05 > 65504 and max(pre[:4]) < 65504, (_row_max(s), pre)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "sorter", 4)
    no_error_at(rep, ("scorer", "scorer.0", "scorer.2", "ndcg", ""))


# ======================================================================================================================
# 5. Performer's FAVOR+ without its stabiliser: a sensor spike's query flushes every random feature to 0
# ======================================================================================================================
class FavorAttention(nn.Module):
    def __init__(self, d=32, h=4, m=32):
        super().__init__()
        self.h, self.dh, self.m = h, d // h, m
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("proj", torch.randn(m, d // h, generator=gen(5)))

    def phi(self, x):  # positive random features: exp(w.x - |x|^2 / 2) / sqrt(m)
        x = x * self.dh ** -0.25
        return torch.exp(x @ self.proj.t() - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(self.m)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        qp, kp = self.phi(q), self.phi(k)
        num = qp @ (kp.transpose(-1, -2) @ v)
        den = qp @ kp.sum(-2)[..., None]
        return self.out((num / den).transpose(1, 2).reshape(B, T, C))


class PerformerBlock(nn.Module):  # post-LN, as the original Transformer
    def __init__(self, d=32):
        super().__init__()
        self.attn, self.ln1 = FavorAttention(d), nn.LayerNorm(d)
        self.ffn, self.ln2 = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)), nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class SensorPerformer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(1, d)
        self.blocks = nn.Sequential(PerformerBlock(d), PerformerBlock(d))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def _sensors(i):
    g = gen(400 + i)
    t = torch.arange(64) / 8
    clean = torch.sin(t[None] + 6 * torch.rand(16, 1, generator=g))[..., None]
    x = clean + 0.1 * torch.randn(16, 64, 1, generator=g)
    if i == 4:
        x[3, 40, 0] = 40.0  # a glitching sensor's spike
    return x, clean


def test_performer_favor_features_of_a_spike_query_flush_to_zero_and_the_attention_divides_0_by_0():
    torch.manual_seed(0)
    m = SensorPerformer()
    r = train_loop(m, _sensors, lambda o, x, y: F.mse_loss(o.float(), y), 6, lr=3e-3, call=lambda x, y: m(x))
    real(r, "blocks.0.attn", 4)
    # real: the spike's fp16 query features are all exactly 0 (the exponent is far below fp16's floor)
    x, _ = _sensors(4)
    att = m.blocks[0].attn
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        q = att.qkv(m.inp(x)).view(16, 64, 3, 4, 8)[:, :, 0].transpose(1, 2)
        feats = att.phi(q)
    assert feats.dtype == torch.float16 and bool((feats[3, :, 40] == 0).all()) and bool((feats[0] > 0).all())
    rep = r["w"].report()
    at(rep, ("nan_origin", "underflow"), "blocks.0.attn", 4)
    no_error_at(rep, ("inp", "blocks.0.attn.qkv", "blocks.0.attn.out", "blocks.0.ln1", "blocks.0.ffn",
                      "blocks.0.ln2", "blocks.0", "blocks.1", "blocks.1.attn", "blocks", "head", ""))


# ======================================================================================================================
# 6. a pointer network whose padding mask is masked_fill(-1e10), passed only for ragged batches: raises at step 3
# ======================================================================================================================
class PointerAttention(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.W1, self.W2, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(d, 1, bias=False)

    def forward(self, dec, enc, mask=None):
        u = self.v(torch.tanh(self.W1(enc)[:, None] + self.W2(dec)[:, :, None])).squeeze(-1)  # (B, T_dec, T_enc)
        if mask is not None:
            u = u.masked_fill(~mask[:, None, :], -1e10)
        return u


class PointerNet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(1, d), nn.ReLU(), nn.Linear(d, d))
        self.decoder = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.pointer = PointerAttention(d)

    def forward(self, x, lengths):
        enc = self.encoder(x)
        mask = None
        if bool((lengths < x.shape[1]).any()):  # ragged batch: mask the padding
            mask = torch.arange(x.shape[1])[None] < lengths[:, None]
        return self.pointer(self.decoder(enc), enc, mask)


def _lists(i):
    g = gen(500 + i)
    x = torch.rand(16, 12, 1, generator=g)
    lengths = torch.full((16,), 12)
    if i >= 3:  # the bucketing sampler's first mixed-length bucket
        lengths = torch.randint(6, 13, (16,), generator=g)
        lengths[0] = 7
        x = x.masked_fill(torch.arange(12)[None, :, None] >= lengths[:, None, None], 0.0)
    return x, lengths, x.squeeze(-1).argsort(-1)


def test_pointer_network_minus_1e10_padding_mask_raises_in_fp16_on_the_first_ragged_batch():
    torch.manual_seed(0)
    m = PointerNet()
    r = train_loop(m, _lists, lambda u, x, lengths, y: F.cross_entropy(u.float().flatten(0, 1), y.flatten()), 6,
                   lr=3e-3, call=lambda x, lengths, y: m(x, lengths))
    # real: steps 0-2 trained; the first ragged batch (step 3) raised the fp16 conversion error; in fp32 it is fine
    assert r["crash"] is not None and r["crash"][0] == 3 and len(r["losses"]) == 3, r
    assert "without overflow" in str(r["crash"][1]), r["crash"]
    x, lengths, _ = _lists(3)
    assert torch.isfinite(copy.deepcopy(m)(x, lengths).clamp(min=-1e30)).all()
    rep = r["w"].report()
    at(rep, ("mask_value_overflow",), "pointer", 3)
    no_error_at(rep, ("encoder", "encoder.0", "encoder.2", "decoder", "decoder.0", "decoder.2", "pointer.W1",
                      "pointer.W2", "pointer.v", ""))


# ======================================================================================================================
# 7. a class-conditional mapping network's PixelNorm on the CFG null label: 0 * rsqrt(0 + 1e-8) in fp16
# ======================================================================================================================
class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8)


class Mapping(nn.Module):
    def __init__(self, classes=10, d=32):
        super().__init__()
        self.embed = nn.Embedding(classes + 1, d, padding_idx=classes)  # the last row: the null (dropped) label
        self.proj = nn.Linear(d, d, bias=False)
        self.norm_z, self.norm_c = PixelNorm(), PixelNorm()
        self.mlp = nn.Sequential(nn.Linear(2 * d, d), nn.LeakyReLU(0.2), nn.Linear(d, d), nn.LeakyReLU(0.2))

    def forward(self, z, c):
        return self.mlp(torch.cat([self.norm_z(z), self.norm_c(self.proj(self.embed(c)))], -1))


class CondDenoiser(nn.Module):
    def __init__(self, d=32, dx=16):
        super().__init__()
        self.mapping = Mapping(d=d)
        self.film = nn.Linear(d, 2 * d)
        self.body = nn.Sequential(nn.Linear(dx, d), nn.SiLU())
        self.out = nn.Linear(d, dx)

    def forward(self, x_noisy, z, c):
        scale, shift = self.film(self.mapping(z, c)).chunk(2, -1)
        return self.out(self.body(x_noisy) * (1 + scale) + shift)


_PROTOS = torch.randn(10, 16, generator=gen(11))


def _cfg_batches(i):
    g = gen(600 + i)
    c = torch.randint(0, 10, (32,), generator=g)
    x0 = _PROTOS[c]
    noise = torch.randn(32, 16, generator=g)
    if i >= 3:  # label dropout (p = 0.1) starts after the conditional warm-up
        c = torch.where(torch.rand(32, generator=g) < 0.1, torch.full_like(c, 10), c)
        c[5] = 10
    return x0 + noise, torch.randn(32, 32, generator=g), c, noise


@EVERY
def test_pixelnorm_eps_vanishes_in_fp16_on_the_null_label_of_classifier_free_guidance_dropout(every):
    torch.manual_seed(0)
    m = CondDenoiser()
    r = train_loop(m, _cfg_batches, lambda o, x, z, c, n: F.mse_loss(o.float(), n), 6, every=every,
                   call=lambda x, z, c, n: m(x, z, c))
    real(r, "mapping.norm_c", 3)
    # real: the null label's projected embedding is exactly 0 in fp16, and 1e-8 is 0 in fp16 (fine in fp32)
    _x, _z, c, _n = _cfg_batches(3)
    e = fp16_forward(m.mapping.proj, m.mapping.embed(c))
    assert e.dtype == torch.float16 and bool((e[5] == 0).all()) and torch.tensor(1e-8, dtype=torch.float16) == 0
    assert torch.isfinite(PixelNorm()(e.float())).all()
    rep = r["w"].report()
    at(rep, ("eps_underflow", "nan_origin"), "mapping.norm_c", 3)
    no_error_at(rep, ("mapping.proj", "mapping.embed", "mapping.norm_z", "mapping.mlp", "mapping.mlp.0",
                      "mapping.mlp.2", "mapping", "film", "body", "body.0", "out", ""))


# ======================================================================================================================
# 8. DeepFM's FM term on fp16 field embeddings: a raw click count at step 4, inf - inf in `fm`
# ======================================================================================================================
class FM(nn.Module):
    def forward(self, v):  # v: (B, F, k)
        s = v.sum(1)
        return 0.5 * (s * s - (v * v).sum(1)).sum(1, keepdim=True)


class DeepFM(nn.Module):
    def __init__(self, n_cat=6, card=50, n_num=4, k=16):
        super().__init__()
        self.cat_emb = nn.Embedding(n_cat * card, k)
        self.num_emb = nn.Parameter(torch.randn(n_num, k) * 0.1)
        self.field_proj = nn.Linear(k, k)  # a shared field-wise transform (AutoInt-style) before the interactions
        self.fm = FM()
        self.deep = nn.Sequential(nn.Linear((n_cat + n_num) * k, 64), nn.ReLU(), nn.Linear(64, 1))
        self.card = card

    def forward(self, cats, nums):
        offs = torch.arange(cats.shape[1]) * self.card
        fields = torch.cat([self.cat_emb(cats + offs), nums[..., None] * self.num_emb], 1)
        v = self.field_proj(fields)
        return self.fm(v) + self.deep(v.flatten(1))


def _impressions(i):
    g = gen(700 + i)
    cats = torch.randint(0, 50, (64, 6), generator=g)
    nums = torch.randn(64, 4, generator=g)  # standardised (log1p, z-scored) counts
    if i == 4:
        nums[9, 2] = 3000.0  # a row from the un-logged export: a raw click count
    y = ((cats[:, 0] % 2) ^ (nums[:, 0] > 0).long()).float()[:, None]
    return cats, nums, y


def test_deepfm_square_of_sum_overflows_in_the_fm_module_on_a_raw_click_count():
    torch.manual_seed(0)
    m = DeepFM()
    r = train_loop(m, _impressions, lambda o, c, n, y: F.binary_cross_entropy_with_logits(o.float(), y), 6, lr=3e-3,
                   call=lambda c, n, y: m(c, n))
    real(r, "fm", 4)
    cats, nums, _ = _impressions(4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        offs = torch.arange(6) * 50
        v = m.field_proj(torch.cat([m.cat_emb(cats + offs), nums[..., None] * m.num_emb], 1))
    # real: every fp16 field embedding is finite; the raw count's field is past 256, so its square is inf
    assert v.dtype == torch.float16 and bool(torch.isfinite(v).all()) and float(v[9].abs().max()) > 256
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "fm", 4)
    no_error_at(rep, ("field_proj", "cat_emb", "deep", "deep.0", "deep.2", ""))


# ======================================================================================================================
# 9. an improved bilinear CNN's signed square root: a blank frame's dead channels, sqrt's backward 0 / 0 (eps = 0)
# ======================================================================================================================
class SignedSqrtBilinear(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, x):  # (B, C, H, W) -> (B, C * C)
        x = x.flatten(2)
        g = torch.bmm(x, x.transpose(1, 2)) / x.shape[-1]
        if self.fp32:
            g = g.float()
        return (torch.sign(g) * torch.sqrt(torch.abs(g) + 1e-10)).flatten(1)


class BCNN(nn.Module):
    def __init__(self, c=8, classes=5, fp32=False):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.ReLU(),
                                      nn.Conv2d(c, c, 3, padding=1, bias=False), nn.ReLU())
        self.pool = SignedSqrtBilinear(fp32)
        self.norm = nn.LayerNorm(c * c)
        self.fc = nn.Linear(c * c, classes)

    def forward(self, img):
        return self.fc(self.norm(self.pool(self.features(img))))


def _birds(i):
    g = gen(800 + i)
    y = torch.randint(0, 5, (16,), generator=g)
    img = torch.randn(16, 3, 12, 12, generator=g) + y[:, None, None, None] * 0.3
    if i == 4:
        img[6] = -1.8  # a blank (constant) frame from a dropped video segment, after normalisation
    return img, y


def test_bilinear_cnn_signed_sqrt_of_dead_channels_is_a_backward_nan_in_the_pool():
    torch.manual_seed(0)
    m = BCNN()
    r = train_loop(m, _birds, lambda o, img, y: F.cross_entropy(o.float(), y), 6, call=lambda img, y: m(img),
                   backward_oracle=True)
    # real: the forward is finite at every module; the pool's backward is the first non-finite gradient, at step 4
    assert r["first"] is None and not r["bad_loss"], r
    assert r["first_bwd"] == ("pool", 4) and r["skipped"] == [4], r
    # ... the blank frame's Gram matrix holds exact zeros, and fp32 (where 1e-10 survives) has a finite gradient
    img, y = _birds(4)
    probe = copy.deepcopy(m)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        x = probe.features(img).flatten(2)
        gram = torch.bmm(x, x.transpose(1, 2))
    zeros = (gram == 0).flatten(1).sum(1)
    assert gram.dtype == torch.float16 and int(zeros[6]) > 0 and int(zeros.sum()) == int(zeros[6]), zeros
    probe32 = copy.deepcopy(m)
    F.cross_entropy(probe32(img), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in probe32.parameters())
    rep = r["w"].report()
    at(rep, ("nan_origin", "eps_underflow", "overflow"), "pool", 4, phase=None)
    no_error_at(rep, ("features", "features.0", "features.2", "norm", "fc", ""))


@EVERY
def test_bilinear_cnn_signed_sqrt_backward_nan_at_every1_and_default(every):
    torch.manual_seed(0)
    m = BCNN()
    r = train_loop(m, _birds, lambda o, img, y: F.cross_entropy(o.float(), y), 6, call=lambda img, y: m(img),
                   every=every)
    assert r["first"] is None and r["skipped"] == [4], r
    rep = r["w"].report()
    at(rep, ("nan_origin", "eps_underflow", "overflow"), "pool", 4, phase=None)
    no_error_at(rep, ("features", "features.0", "features.2", "norm", "fc", ""))


def test_healthy_twin_bilinear_cnn_signed_sqrt_in_fp32_on_the_same_blank_frame_is_quiet():
    torch.manual_seed(0)
    m = BCNN(fp32=True)
    r = train_loop(m, _birds, lambda o, img, y: F.cross_entropy(o.float(), y), 10, lr=3e-3,
                   call=lambda img, y: m(img))
    healthy(r)


# ======================================================================================================================
# 10. a wav2vec2-style Gumbel quantizer whose temperature anneals to a floor of 1e-4: (logits + g) / tau overflows
# ======================================================================================================================
class GumbelQuantizer(nn.Module):
    def __init__(self, d=32, groups=2, codes=16, max_temp=2.0, min_temp=1e-4, decay=0.25):
        super().__init__()
        self.G, self.V = groups, codes
        self.weight_proj = nn.Linear(d, groups * codes)
        self.codevectors = nn.Parameter(torch.randn(groups * codes, d // groups) * 0.1)
        self.max_temp, self.min_temp, self.decay = max_temp, min_temp, decay
        self.num_updates = 0

    @property
    def temp(self):
        return max(self.max_temp * self.decay ** self.num_updates, self.min_temp)

    def forward(self, x):
        B, T, _ = x.shape
        logits = self.weight_proj(x).view(B * T * self.G, self.V)
        probs = F.gumbel_softmax(logits, tau=self.temp, hard=False)
        if self.training:
            self.num_updates += 1
        return (probs.view(B * T, self.G * self.V, 1) * self.codevectors).view(B * T, self.G, self.V, -1) \
            .sum(2).view(B, T, -1)


class ContrastiveQuantModel(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.feature = nn.Sequential(nn.Conv1d(1, d, 8, stride=4), nn.GELU())
        self.quantizer = GumbelQuantizer(d)
        self.context = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, wav):
        f = self.feature(wav).transpose(1, 2)
        return self.context(f), self.quantizer(f)


def _wavs(i):
    g = gen(900 + i)
    t = torch.arange(256) / 16
    return (torch.sin(t * (1 + 3 * torch.rand(8, 1, generator=g))) + 0.1 * torch.randn(8, 256, generator=g))[:, None],


def _contrastive(out, wav):
    c, q = out
    sim = F.cosine_similarity(c.float()[:, :, None], q.float()[:, None], dim=-1) / 0.1
    return F.cross_entropy(sim.flatten(0, 1), torch.arange(sim.shape[1]).repeat(sim.shape[0]))


def test_gumbel_quantizer_temperature_floor_1e4_overflows_in_the_quantizer_as_it_anneals():
    torch.manual_seed(0)
    m = ContrastiveQuantModel()
    temps, peaks = [], []

    def hook(mod, inp, out):  # the temperature used and the largest |logit| of this call
        temps.append(mod.max_temp * mod.decay ** (mod.num_updates - 1) if mod.num_updates else mod.max_temp)
        peaks.append(float(mod.weight_proj(inp[0]).detach().float().abs().max()))

    h = m.quantizer.register_forward_hook(hook)
    r = train_loop(m, _wavs, _contrastive, 9, call=lambda wav: m(wav))
    h.remove()
    onset = r["first"][1] if r["first"] else None
    real(r, "quantizer", onset)
    # real: a natural onset mid-run, when the temperature has fallen so far that logit / tau passes fp16's max
    assert onset is not None and 5 <= onset <= 8, (onset, temps)
    # (the logits stay below 1; a Gumbel draw g ~ 8 overflows (logit + g) / tau once tau ~ 1e-4, none can at 2e-3)
    assert max(peaks) < 2 and temps[onset] * 65504 < 10 and temps[onset - 2] * 65504 > 100, (onset, temps, peaks)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "quantizer", onset)
    no_error_at(rep, ("quantizer.weight_proj", "feature", "feature.0", "context", "context.0", "context.2", ""))


# ======================================================================================================================
# 11. a LLaMA-style block with a massive-activation channel: BOS in the packed batches from step 4, SwiGLU's product
# ======================================================================================================================
class SwiGLU(nn.Module):
    def __init__(self, d=32, f=64):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp = SwiGLU(d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class TinyLlama(nn.Module):
    BOS, SINK = 0, 7  # the BOS token and the residual channel it writes its massive activation to

    def __init__(self, vocab=40, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(LlamaBlock(d), LlamaBlock(d))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        with torch.no_grad():  # as in a pretrained LLM: an outlier norm gain on the sink channel, BOS's huge value there
            self.emb.weight[:, self.SINK] = 0
            self.emb.weight[self.BOS, self.SINK] = 30.0
            self.blocks[0].ln2.weight[self.SINK] = 40.0
            self.blocks[0].mlp.gate.weight[0, self.SINK] = 1.5
            self.blocks[0].mlp.up.weight[0, self.SINK] = 1.5

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.emb(idx))))


def _packed(i):
    g = gen(1000 + i)
    seq = (torch.randint(1, 40, (8, 1), generator=g) + torch.arange(33)) % 39 + 1  # tokens 1..39, counting up
    if i >= 4:  # the shards packed with a BOS at each document start
        seq[:, 0] = TinyLlama.BOS
        seq[:, 17] = TinyLlama.BOS
    return seq[:, :-1], seq[:, 1:]


@EVERY
def test_llama_massive_activation_on_bos_overflows_in_the_swiglu_product(every):
    torch.manual_seed(0)
    m = TinyLlama()
    r = train_loop(m, _packed, _lm_loss, 6, call=lambda idx, y: m(idx), every=every)
    real(r, "blocks.0.mlp", 4)
    # real: the gate and up projections are finite fp16 on BOS; their silu-product is past fp16's max
    idx, _ = _packed(4)
    mlp = m.blocks[0].mlp
    seen = {}
    hs = [mod.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, out.detach()))
          for n, mod in (("gate", mlp.gate), ("up", mlp.up))]
    fp16_forward(m, idx)
    for h in hs:
        h.remove()
    g, u = seen["gate"], seen["up"]
    assert g.dtype == torch.float16 and bool(torch.isfinite(g).all() and torch.isfinite(u).all())
    assert float((F.silu(g.float()) * u.float()).abs().max()) > 65504
    rep = r["w"].report()
    at(rep, ("overflow",), "blocks.0.mlp", 4)
    no_error_at(rep, ("blocks.0.mlp.gate", "blocks.0.mlp.up", "blocks.0.mlp.down", "blocks.0.ln2", "blocks.0.qkv",
                      "blocks.0.o", "blocks.0.ln1", "blocks.0", "blocks.1", "blocks.1.mlp", "blocks", "emb", "ln",
                      "head", ""))


# ======================================================================================================================
# 4 and 10 again: a division by a nonzero temperature whose quotient overflows is no singular point, no underflow
# ======================================================================================================================


def _division_report(case):
    torch.manual_seed(0)
    if case == "neuralsort":
        m = Ranker()
        return train_loop(m, _queries, lambda loss, docs, rel: loss, 6, call=lambda docs, rel: m(docs, rel))
    m = ContrastiveQuantModel()
    return train_loop(m, _wavs, _contrastive, 9, call=lambda wav: m(wav))


@pytest.mark.parametrize("case", [
    "neuralsort",
    "gumbel",
])
def test_an_overflowing_division_by_a_nonzero_temperature_is_not_called_a_singular_point_or_an_underflow(case):
    r = _division_report(case)
    assert r["first"] is not None and r["first"][0] in ("sorter", "quantizer"), r
    rep = r["w"].report()
    ov = next(f for f in rep.findings if f.rule == "overflow" and f.module == r["first"][0])
    assert ov.op == "aten::div", lines(rep)  # the division is the op that overflowed
    assert "singular point" not in ov.message, ov.message
    assert not [f.one_line() for f in rep.findings if f.rule == "underflow" and f.severity == "error"], lines(rep)
