"""ATTENTION VARIANTS WRITTEN BY HAND that break under fp16: tiny language models (token embedding -> one attention
block (residual) -> lm_head; vocab 32, width 16, 8 query tokens, a few thousand parameters), each with one attention
mechanism written the way its paper's reference code or a practitioner writes it, trained on the CPU with fp16
autocast + GradScaler for 8 steps. Watched through the public API only (`ampdoctor.watch(model,
optimizer=AdamW, scaler=GradScaler("cpu"), run_dir=...)` at the default settings, via probe_harness.probe_run:
scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> close() -> report()).

The trigger arrives with the data at step K = 5 (a rare token (id 31) with a large embedding, a padded batch, a
long memory, a long utterance), or, for the learned temperature, with the parameter's own drift.

Each failure is first proven by the file's own oracle (probe_harness.Producer, keyword inputs checked: the module
and step where the first inf/NaN is made from finite inputs, own parameters finite; before K nothing but the
scaler's first backoffs, steps 0-2); a failing oracle is a plain failure, never an xfail. Then the CONTRACT.md rule
must be among the FIRST THREE findings, severity warning or error, at the producer module and step K. A wrong
report raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. elu_zero     linear attention (Katharopoulos et al.) with the elu+1 feature map and no eps ("elu(x)+1 > 0, the
                 normaliser q.sum(k) cannot be 0"): in fp16 elu(x)+1 = (exp(x)-1)+1 rounds to exactly 0 for
                 x < -8.3; the rare token drives every q feature of head 0 to -16, its normaliser is 0 and so is
                 its numerator -> 0/0 -> nan_origin at `attn`, step 5.
 2. relu_eps     EfficientViT-style ReLU linear attention, multi-query (two 16-wide q heads, one shared k/v head),
                 `num / (den + 1e-15)`, without EfficientViT's upcast: the first right-padded batch (step 5) has
                 pad rows with q = k = 0 (padding_idx embedding, bias-free projections), den = 0 and the eps is 0
                 in fp16 -> 0/0 -> eps_underflow (or nan_origin) at `attn`, step 5. The pad rows' targets are
                 ignore_index'd, so the loss stays finite; their NaN reaches the gradients and step 5 is skipped.
 3. favor_exp    Performer FAVOR+ positive random features written as two exps, `exp(x W^T) * exp(-|x|^2/2)`,
                 no max stabiliser: the rare token's q has w.q ~ 20 (exp = inf in fp16, finite in fp32) and
                 -|q|^2/2 ~ -40 (exp = 0 in fp16) -> inf * 0 = NaN -> nan_origin (or overflow) at `attn.phi`.
 4. favor_zero   the same features as one exp, `exp(x W^T - |x|^2/2)`, still without the max stabiliser: for the
                 rare token every feature is exp(< -30), 0 in fp16 (1e-14 in fp32) -> the query's normaliser and
                 numerator are 0 -> 0/0 -> nan_origin at `attn` (underflow at `attn.phi`, the root, accepted).
 5. online_sum   split-KV attention (flash-decoding / ring style): the memory split runs an online softmax over
                 4096-key chunks with its running max, running sum l and accumulator in fp16, returns (o, lse =
                 m + log l), merged with the local causal split by lse. At step 5 the memory is a 98,304-token run of
                 one token: equal logits, l counts the keys and passes 65504 at the 16th chunk (the value
                 accumulator stays below, |v| < 0.6) -> lse = inf -> exp(inf - inf) = NaN in the merge -> overflow
                 (or nan_origin) at `attn`, step 5.
 6. cosine_temp  Swin v2 scaled cosine attention, per-head learned log-temperature, folded into q before the
                 matmul, WITHOUT Swin v2's clamp at ln(100): head 0's temperature drifts upward over a long run
                 (replayed: set to 9.0 + 0.5 i before step i); at step 5 exp(11.5) = 98715 and normalize(q) * 98715
                 is inf once autocast casts it to fp16 for the matmul -> overflow (or nan_origin) at `attn`.
 7. xattn_sum    cross-attention over a 4096-token memory with the normalisation deferred past the value matmul
                 (`(exp(s - max) @ v) / exp(s - max).sum()`): at step 5 the memory is a run of the rare token, the
                 denominator is 4096 (fine) but the value-weighted sum is 4096 * v (|v| ~ 30) -> inf -> overflow at
                 `xattn`, step 5.
 8. gauss_bias   Gaussian relative-position bias `-(i - j)^2 / (2 sigma_h^2)` (local attention of speech models)
                 with the distances built by `arange(T, dtype=x.dtype)`: the long utterance at step 5 (T = 512)
                 squares distances past 255.9 in fp16 -> inf -> the bias is -inf; the forward's loss stays finite
                 (softmax weight 0) but sigma's gradient is 0 * inf = NaN and the step is skipped -> overflow at
                 `attn.relpos`, step 5.
 9. talking      talking-heads attention (Shazeer et al. 2020): the logits of 4 heads mixed by a learned 4x4
                 Linear before the softmax: each head's logit for the rare token is finite (< 45000), their mix
                 passes 65504 -> overflow at `attn.mix`, step 5.
Healthy twins (the same blocks done right, same triggers; no warning, no error):
10. online_sum with the running max, sum and accumulator in float32 (the 98,304-token run included): quiet.
11. cosine_temp with Swin v2's clamp `logit_scale.clamp(max=ln(100))` (the same drift replayed): quiet.
12. relu_eps with EfficientViT's own guard: the kernel products in float32 (the padded batch included): quiet.

Result when written (torch 2.13 CPU, default watch): 12 pass, 0 xfail (stable over two runs, ~4 s). ampdoctor named
every producer; first findings (abridged):
 1. [error] nan_origin at attn aten::div step 5 ("hit its singular point"); [error] skipped_steps step 5.
 2. [error] eps_underflow at attn aten::add step 5 ("eps 1e-15 rounds to 0 in float16"); [error] nan_origin at attn
    aten::div step 5; [error] skipped_steps.
 3. [error] overflow at attn.phi aten::exp step 5 (input up to 19.95; propagates to aten::mul); skipped_steps.
 4. [error] nan_origin at attn aten::div step 5; skipped_steps (the alternative, underflow at attn.phi, not needed).
 5. [error] overflow at attn aten::add step 5 (the running sum; propagates to aten::sub); skipped_steps.
 6. [error] overflow at attn aten::_to_copy step 5 (autocast's cast of the scaled q; propagates to aten::bmm);
    [error] skipped_steps; [warning] eps_underflow at attn aten::clamp_min (F.normalize's 1e-12) step 5. The scaler
    also backs off at steps 2 and 3 (the scaled backward at the high temperature; finite losses), hence
    `early_skips` in this case's oracle.
 7. [error] overflow at xattn aten::bmm step 5 (max |x| 41.3 -> inf; propagates to xattn.o); skipped_steps.
 8. [error] overflow at attn.relpos aten::mul step 5 (d * d); [info] skipped_steps step 5 (the loss stays finite).
 9. [error] overflow at attn.mix aten::mm step 5 (max |x| 3.5e4 -> inf; propagates to aten::_softmax in attn).
 10-12. quiet (no finding at all).
(Not built: the elu+1 normaliser q.sum(k) OVERFLOWING - with a zero-mean v the numerator stays finite and num / inf
is 0: silent zeros, no inf/NaN at any module output, so the Producer oracle cannot prove it; and where v's mean is
large the numerator (the k^T v state) overflows first, which test_unseen_variants7 case 13 already covers.)
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import WrongAnswer, named_top3, probe_run, quiet_twin
from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

V, D, T, B, K, STEPS = 32, 16, 8, 4, 5, 8
RARE, PAD = 31, 0
ALARM = ("warning", "error")
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# data: token ids in 1..30, next-token targets; step K brings the trigger
# ======================================================================================================================
def ids_at(i, rare=False, pad=0, t=T, seed_off=0):
    """Step i's (inputs, targets); `rare`: at step K token 3 of sequence 0 is the rare token; `pad`: at step K
    sequence 1 ends with `pad` padding tokens; `t`: the sequence length."""
    ids = torch.randint(1, RARE, (B, t + 1), generator=gen(i % 4 + seed_off))
    if i == K and rare:
        ids[0, 3] = RARE
    if i == K and pad:
        ids[1, -pad:] = PAD
    return ids[:, :-1], ids[:, 1:]


def ce(out, y):
    return F.cross_entropy(out.float().reshape(-1, V), y.reshape(-1), ignore_index=PAD)


def rare_batch(i):
    x, y = ids_at(i, rare=True)
    return (x,), y


def pad_batch(i):
    x, y = ids_at(i, pad=3)
    return (x,), y


def causal(t):
    return torch.triu(torch.ones(t, t, dtype=torch.bool), 1)


class LM(nn.Module):
    """wte (padding_idx 0) -> h + attn(h, ...) -> head. `mem`: memory token ids, embedded by the same wte. The
    attention block is built here (`make(**kw)`), after the seed: every case's weights independent of test order."""

    def __init__(self, make, seed=0, **kw):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(V, D, padding_idx=PAD)
        self.attn = make(**kw)
        self.head = nn.Linear(D, V)

    def forward(self, ids, mem=None):
        h = self.wte(ids)
        if mem is not None:
            return self.head(h + self.attn(h, self.wte(mem)))
        return self.head(h + self.attn(h))


def set_rare(m, row):
    with torch.no_grad():
        m.wte.weight[RARE] = row


def heads(x, h):
    b, t, _ = x.shape
    return x.view(b, t, h, -1).transpose(1, 2)


def merge(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


# ======================================================================================================================
# 1-2: linear attention: elu+1 features that round to 0; a ReLU kernel whose eps is 0 in fp16
# ======================================================================================================================
class EluLinearAttn(nn.Module):
    """Non-causal linear attention, 4 heads of 4, phi = elu + 1, out = phi(q) (phi(k)^T v) / phi(q).sum(phi(k))."""

    def __init__(self, h=4):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = (heads(p(x), self.h) for p in (self.q, self.k, self.v))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        kv = torch.einsum("bhtd,bhte->bhde", k, v)
        num = torch.einsum("bhtd,bhde->bhte", q, kv)
        den = torch.einsum("bhtd,bhd->bht", q, k.sum(2))[..., None]
        return self.o(merge(num / den))


class ReluLinearAttn(nn.Module):
    """EfficientViT LiteMLA's ReLU linear attention, multi-query: 2 q heads of 16, one shared k/v head of 16;
    `fp32`: EfficientViT's guard (the kernel products in float32)."""

    def __init__(self, fp32=False, eps=1e-15):
        super().__init__()
        self.fp32, self.eps = fp32, eps
        self.q = nn.Linear(D, 2 * D, bias=False)
        self.k, self.v = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.o = nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        q = heads(F.relu(self.q(x)), 2)                       # b 2 t 16
        k, v = F.relu(self.k(x))[:, None], self.v(x)[:, None]  # b 1 t 16 (shared by both q heads)
        if self.fp32:
            q, k, v = q.float(), k.float(), v.float()
        with torch.autocast("cpu", enabled=not self.fp32):
            kv = k.transpose(-1, -2) @ v                      # b 1 16 16
            num = q @ kv
            den = q @ k.sum(2, keepdim=True).transpose(-1, -2)  # b 2 t 1
        return self.o(merge(num / (den + self.eps)).to(x.dtype))


def elu_model():
    m = LM(EluLinearAttn)
    wq = m.attn.q.weight.detach()[:4]                         # head 0's q rows
    set_rare(m, -16.0 * torch.linalg.pinv(wq) @ torch.ones(4))  # q of head 0 = -16 on every feature
    return m


def test_1_linear_attention_elu_plus_one_rounds_to_zero_in_fp16(tmp_path):
    m = elu_model()
    with torch.no_grad():                                    # the mechanism: elu+1 of -16 is 0 in fp16, not in fp32
        assert float(F.elu(torch.tensor(-16.0).half()) + 1) == 0.0 < float(F.elu(torch.tensor(-16.0)) + 1)
    r = run(m, rare_batch, ce, tmp_path, lr=1e-3)
    real(r, "attn")
    named(r["rep"], "nan_origin", "attn")


def test_2_multi_query_relu_linear_attention_eps_vanishes_on_padding(tmp_path):
    r = run(LM(ReluLinearAttn), pad_batch, ce, tmp_path)
    real(r, "attn", silent=True)                             # the pad rows' NaN logits are ignore_index'd ...
    assert K in r["skipped"], r["skipped"]                    # ... but their NaN reaches the gradients
    named(r["rep"], ("eps_underflow", "nan_origin"), "attn")


# ======================================================================================================================
# 3-4: Performer FAVOR+ positive random features without the max stabiliser
# ======================================================================================================================
class FavorFeatures(nn.Module):
    """phi(x) = exp(w.x - |x|^2/2) / sqrt(m), m = 32 Gaussian features (a fixed buffer); `split`: as two exps."""

    def __init__(self, split, m=32):
        super().__init__()
        self.split = split
        self.register_buffer("w", torch.randn(m, D, generator=gen(11)))

    def forward(self, x):
        wx = x @ self.w.to(x.dtype).T
        sq = (x * x).sum(-1, keepdim=True) / 2
        if self.split:
            f = torch.exp(wx) * torch.exp(-sq)
        else:
            f = torch.exp(wx - sq)
        return f / math.sqrt(self.w.shape[0])


class Performer(nn.Module):
    """Single-head non-causal FAVOR+ attention; q, k scaled by d^-1/4 (the softmax kernel's normaliser)."""

    def __init__(self, split):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.phi = FavorFeatures(split)

    def forward(self, x):
        c = D ** -0.25
        q, k, v = self.phi(self.q(x) * c), self.phi(self.k(x) * c), self.v(x)
        num = q @ (k.transpose(-1, -2) @ v)
        den = q @ k.sum(1, keepdim=True).transpose(-1, -2)
        return self.o(num / den)


def favor_model(split, norm_q):
    """The rare token's embedding chosen so that its (scaled) q has norm `norm_q`."""
    m = LM(Performer, split=split)
    e = torch.randn(D, generator=gen(7)).sign()
    q = m.attn.q.weight.detach() @ e * D ** -0.25
    set_rare(m, e * norm_q / float(q.norm()))
    return m


def test_3_performer_features_as_two_exps_overflow_times_underflow(tmp_path):
    m = favor_model(split=True, norm_q=9.0)
    r = run(m, rare_batch, ce, tmp_path, lr=1e-3)
    real(r, "attn.phi")
    named(r["rep"], FWD, "attn.phi")


def test_4_performer_features_without_max_stabiliser_all_underflow(tmp_path):
    m = favor_model(split=False, norm_q=12.0)
    r = run(m, rare_batch, ce, tmp_path, lr=1e-3)
    real(r, "attn")
    try:
        named(r["rep"], FWD, "attn")
    except WrongAnswer:
        named(r["rep"], "underflow", "attn.phi")


# ======================================================================================================================
# 5: online softmax (split-KV) with fp16 running statistics
# ======================================================================================================================
CHUNK, LONG = 4096, 98304


def lse_softmax(s, v, dt):
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s.to(dt) - m.to(dt))
    l = p.sum(-1, keepdim=True)
    return (p.to(v.dtype) @ v).to(dt) / l, m.to(dt) + torch.log(l)


class SplitKVAttn(nn.Module):
    """Self-attention (causal) over the 8 local tokens plus cross-attention to a long memory, computed as two
    splits merged by their log-sum-exps; the memory split is an online softmax over CHUNK-key chunks (running max
    m, running sum l, accumulator acc) in `dt` (fp16: the activations' dtype; fp32: the fix)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x, mem):
        q, k, v = self.q(x) * D ** -0.5, self.k(x), self.v(x)
        dt = torch.float32 if self.fp32 else q.dtype
        km, vm = self.k(mem), self.v(mem)                        # 1 N D, shared by the batch
        b, t, _ = q.shape
        mx = torch.full((b, t, 1), -math.inf, dtype=dt)
        l, acc = torch.zeros(b, t, 1, dtype=dt), torch.zeros(b, t, D, dtype=dt)
        for c in range(0, km.shape[1], CHUNK):
            s = (q @ km[:, c:c + CHUNK].transpose(-1, -2)).to(dt)
            new = torch.maximum(mx, s.amax(-1, keepdim=True))
            a, p = torch.exp(mx - new), torch.exp(s - new)
            l = l * a + p.sum(-1, keepdim=True)
            acc = acc * a + (p.to(vm.dtype) @ vm[:, c:c + CHUNK]).to(dt)
            mx = new
        o_mem, lse_mem = acc / l, mx + torch.log(l)
        s_loc = (q @ k.transpose(-1, -2)).masked_fill(causal(t), -math.inf)
        o_loc, lse_loc = lse_softmax(s_loc, v, dt)
        lse = torch.logaddexp(lse_mem, lse_loc)
        out = o_mem * torch.exp(lse_mem - lse) + o_loc * torch.exp(lse_loc - lse)
        return self.o(out.to(x.dtype))


def quiet_token(m):
    """The token (1..30) whose value vector is the smallest (max |v|): the long run's token."""
    with torch.no_grad():
        vs = m.attn.v(m.wte.weight[1:RARE]).abs().amax(-1)
    return 1 + int(vs.argmin())


def mem_batch_for(tok):
    def batch(i):
        x, y = ids_at(i)
        if i == K:
            mem = torch.full((1, LONG), tok)
        else:
            mem = torch.randint(1, RARE, (1, 1024), generator=gen(100 + i))
        return (x,), {"mem": mem}, y
    return batch


def test_5_online_softmax_running_sum_in_fp16_overflows_across_chunks(tmp_path):
    m = LM(SplitKVAttn)
    tok = quiet_token(m)
    r = probe_run(m, mem_batch_for(tok), ce, STEPS, str(tmp_path / "run"), lr=1e-2, snap_at=K)
    real(r, "attn")
    sd = r["sd"]                                              # the weights step K's forward ran with:
    v = sd["wte.weight"][tok] @ sd["attn.v.weight"].T         # the run's value vector, |v| < 0.6: the accumulator
    assert float(v.abs().max()) * LONG < 65504 / 1.05, v      # (98304 * v) stays finite, l (= 98304) does not
    named(r["rep"], FWD, "attn")


# ======================================================================================================================
# 6: Swin v2 scaled cosine attention without the clamp of its learned temperature
# ======================================================================================================================
class CosineAttn(nn.Module):
    """normalize(q) * exp(logit_scale_h) @ normalize(k)^T, 4 heads of 4; `clamp`: Swin v2's clamp at ln(100)."""

    def __init__(self, clamp=False, h=4):
        super().__init__()
        self.h, self.clamp = h, clamp
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(h, 1, 1)))

    def forward(self, x):
        q, k, v = (heads(p(x), self.h) for p in (self.q, self.k, self.v))
        ls = self.logit_scale.clamp(max=math.log(100.0)) if self.clamp else self.logit_scale
        q = F.normalize(q, dim=-1) * ls.exp()                 # the temperature folded into q (fp32 promoted)
        s = (q @ F.normalize(k, dim=-1).transpose(-1, -2)).masked_fill(causal(x.shape[1]), -math.inf)
        return self.o(merge(torch.softmax(s, -1) @ v))


def drift(i, m):
    """Head 0's log-temperature as an unclamped run drifts it: 9.0 + 0.5 i (ln 65504 = 11.09 between steps 4, 5)."""
    m.attn.logit_scale[0] = 9.0 + 0.5 * i


def plain_batch(i):
    x, y = ids_at(i)
    return (x,), y


def test_6_swin_v2_cosine_attention_temperature_without_clamp(tmp_path):
    r = probe_run(LM(CosineAttn), plain_batch, ce, STEPS, str(tmp_path / "run"), inject=drift, lr=1e-2)
    real(r, "attn", early_skips=True)
    named(r["rep"], FWD, "attn")


# ======================================================================================================================
# 7: cross-attention over a long memory, normalised after the value matmul
# ======================================================================================================================
class DeferredXAttn(nn.Module):
    """Cross-attention whose softmax normalisation is deferred past the value matmul (one divide of T x D instead
    of T x N): (exp(s - max) @ v) / exp(s - max).sum()."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x, mem):
        q, k, v = self.q(x) * D ** -0.5, self.k(mem), self.v(mem)
        s = q @ k.transpose(-1, -2)
        p = torch.exp(s - s.amax(-1, keepdim=True))
        return self.o((p @ v) / p.sum(-1, keepdim=True))


class XLM(LM):
    def __init__(self):
        super().__init__(nn.Identity)
        self.xattn = DeferredXAttn()
        del self.attn

    def forward(self, ids, mem):
        h = self.wte(ids)
        return self.head(h + self.xattn(h, self.wte(mem)))


def xmem_batch(i):
    x, y = ids_at(i)
    mem = torch.randint(1, RARE, (B, 256), generator=gen(200 + i))
    if i == K:
        mem = torch.full((B, 4096), RARE)
    return (x,), {"mem": mem}, y


def test_7_cross_attention_over_long_memory_value_sum_overflows(tmp_path):
    m = XLM()
    set_rare(m, torch.randn(D, generator=gen(7)).sign() * 30.0)
    with torch.no_grad():
        assert 20 < float(m.xattn.v(m.wte.weight[RARE]).abs().max()) < 60000 / 256
    r = run(m, xmem_batch, ce, tmp_path, lr=1e-3)
    real(r, "xattn")
    named(r["rep"], "overflow", "xattn")


# ======================================================================================================================
# 8: Gaussian relative-position bias with the distances squared in fp16
# ======================================================================================================================
class GaussBias(nn.Module):
    """-(i - j)^2 / (2 sigma_h^2), per head, for the positions of x (b h t d); the distances built in x's dtype."""

    def __init__(self, h=4):
        super().__init__()
        self.sigma = nn.Parameter(torch.full((h, 1, 1), 8.0))

    def forward(self, x):
        pos = torch.arange(x.shape[-2], dtype=x.dtype)
        d = pos[:, None] - pos[None, :]
        return -(d * d) / (2 * self.sigma ** 2)


class GaussAttn(nn.Module):
    def __init__(self, h=4):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.relpos = GaussBias(h)

    def forward(self, x):
        q, k, v = (heads(p(x), self.h) for p in (self.q, self.k, self.v))
        s = (q * (D // self.h) ** -0.5) @ k.transpose(-1, -2)
        p = torch.softmax(s + self.relpos(q), -1)
        return self.o(merge((p.to(v.dtype)) @ v))


def utterance_batch(i):
    x, y = ids_at(i, t=512 if i == K else 64, seed_off=300)
    return (x,), y


def test_8_gaussian_relative_bias_squares_distances_in_fp16(tmp_path):
    r = run(LM(GaussAttn), utterance_batch, ce, tmp_path)
    real(r, "attn.relpos", silent=True)
    assert K in r["skipped"], r["skipped"]                    # sigma's gradient is 0 * inf = NaN
    named(r["rep"], FWD, "attn.relpos")


# ======================================================================================================================
# 9: talking-heads attention: logits mixed across heads before the softmax
# ======================================================================================================================
class TalkingHeads(nn.Module):
    def __init__(self, h=4):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.mix = nn.Linear(h, h, bias=False)                 # pre-softmax talking-heads projection
        self.post = nn.Linear(h, h, bias=False)                # post-softmax one
        with torch.no_grad():
            self.mix.weight.copy_(torch.eye(h) + 0.5)
            self.post.weight.copy_(torch.eye(h))

    def forward(self, x):
        q, k, v = (heads(p(x), self.h) for p in (self.q, self.k, self.v))
        s = (q * (D // self.h) ** -0.5) @ k.transpose(-1, -2)             # b h t t
        s = self.mix(s.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        s = s.masked_fill(causal(x.shape[1]), -math.inf)
        p = self.post(torch.softmax(s, -1).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.o(merge(p.to(v.dtype) @ v))


def talking_model():
    """The rare token's embedding: every head's logit for the rare token against itself positive (the best of 200
    random directions for the mix at init), scaled so that their mix is 80000; each head's own stays finite."""
    m = LM(TalkingHeads)
    a = m.attn
    with torch.no_grad():
        best = None
        for sd in range(200):
            e = torch.randn(D, generator=gen(500 + sd))
            qh, kh = heads(a.q(e)[None, None], 4), heads(a.k(e)[None, None], 4)
            sl = (qh * kh).sum(-1).flatten() * 0.5
            if bool((sl > 0).all()):
                ratio = float((a.mix.weight @ sl).max() / sl.max())
                if best is None or ratio > best[0]:
                    best = (ratio, e, float(sl.max()))
        ratio, e, top = best
        f = 80000.0 / ratio / top                             # each head's logit scales with |e|^2
        assert top * f < 45000, (ratio, top * f)
        set_rare(m, e * math.sqrt(f))
    return m


def test_9_talking_heads_mix_of_finite_logits_overflows(tmp_path):
    m = talking_model()
    r = run(m, rare_batch, ce, tmp_path, lr=1e-3)
    real(r, "attn.mix")
    named(r["rep"], "overflow", "attn.mix")


# ======================================================================================================================
# 10-12: healthy twins
# ======================================================================================================================
def test_10_healthy_online_softmax_with_fp32_running_statistics(tmp_path):
    m = LM(SplitKVAttn, fp32=True)
    r = run(m, mem_batch_for(quiet_token(m)), ce, tmp_path, lr=1e-2)
    quiet(r)


def test_11_healthy_swin_v2_cosine_attention_with_its_clamp(tmp_path):
    r = probe_run(LM(CosineAttn, clamp=True), plain_batch, ce, STEPS, str(tmp_path / "run"), inject=drift, lr=1e-2)
    quiet(r)


def test_12_healthy_relu_linear_attention_upcast_on_padding(tmp_path):
    r = run(LM(ReluLinearAttn, fp32=True), pad_batch, ce, tmp_path)
    quiet(r)


# ======================================================================================================================
# checks
# ======================================================================================================================
def real(r, module, step=K, silent=False, early_skips=False):
    """The oracle: the first inf/NaN from finite inputs is made by `module` at `step`; before `step` nothing but the
    scaler's first backoffs (steps 0-2; `early_skips`: any backoff of a finite loss before `step`, the scaled
    backward's overflow at a high scale, the scaler's job); at `step` the loss is non-finite (or, `silent`, finite)."""
    assert r["first"] == (module, step), (r["first"], r["bad_loss"], r["skipped"])
    assert early_skips or all(s < 3 for s in r["skipped"] if s < step), r
    assert not [s for s in r["bad_loss"] if s < step], r
    if silent:
        assert step not in r["bad_loss"], r["losses"]
    else:
        assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


def named(rep, rules, module, step=K, severities=ALARM):
    """One of `rules` at `module`, at `step` (default K), among the first three findings (probe_harness.named_top3)."""
    return named_top3(rep, rules, module, step, severities)


quiet = quiet_twin  # (probe_harness.quiet_twin: the healthy twin's checks)


def run(m, batch, loss_fn, tmp_path, lr=1e-2):
    return probe_run(m, batch, loss_fn, STEPS, str(tmp_path / "run"), lr=lr)

