"""LLM BUILDING BLOCKS that break under fp16: tiny decoder-style language models (token embedding -> one block ->
lm_head; vocab 32, width 16, 8 tokens, a few thousand parameters), each with one modern block written the way
practitioners write it, trained on the CPU with fp16 autocast + GradScaler for 8 steps. Watched through the public
API only (`ampdoctor.watch(model, optimizer=AdamW, scaler=GradScaler("cpu"), run_dir=...)` at the default settings,
via probe_harness.probe_run: scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> close()
-> report()).

The trigger arrives with the data at step K = 5: a rare token (id 31) whose embedding has a large norm (the
"massive activation" tokens of real LLMs; blocks without a norm in front, or without QK-norm, see it raw), a batch
with padding, or a chunk of a long document whose absolute positions pass 65504.

Each failure is first proven by the file's own oracle (probe_harness.Producer, keyword inputs checked: the module
and step where the first inf/NaN is made from finite inputs, own parameters finite; the step is the first one after
the scaler's ordinary first backoffs that is non-finite or skipped); a failing oracle is a plain failure, never an
xfail. Then the CONTRACT.md rule must be among the FIRST THREE findings, severity warning or error, at the
producer module and step K. A wrong report raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. geglu      GeGLU feed-forward `gelu(gate(x)) * up(x)`: gate and up are finite (~hundreds) for the rare token,
               their product is past 65504 -> overflow at `ffn`, step 5.
 2. qk_logits  causal attention without QK-norm, `(q @ k^T) / sqrt(d)` (scale after the matmul): the rare token's
               q.k is past 65504 -> inf -> softmax NaN -> overflow (or nan_origin) at `attn`, step 5.
 3. softcap    Gemma-style final logit soft-capping `cap * tanh(logits / cap)` applied AFTER a tied fp16 lm_head
               whose logit for the rare token (its own embedding row) overflowed: tanh(inf) = 1 hides the inf, the
               loss stays finite and nothing is skipped (silent: the capped logit's gradient is 0) -> overflow
               at `head`, step 5.
 4. zloss      MoE router z-loss `logsumexp(router_logits) ** 2` in fp16: lse ~ 400 for the rare token, its square
               overflows -> overflow at `moe.router`, step 5 (the loss is inf).
 5. router_exp MoE router normalising by hand `exp(l) / exp(l).sum()` (no max shift): exp(l) = inf for the rare
               token, inf / inf = NaN -> nan_origin (or overflow) at `moe.router`, step 5.
 6. hand_ce    the model computes its own LM loss by hand over the vocabulary, `logits.exp().sum(-1).log() -
               logits[target]` (logsumexp without the max shift): exp(logit > 11.1) = inf -> overflow at
               `lm_loss`, step 5.
 7. rope_pos   rotary embedding that casts position_ids to the activations' dtype (fp16): the chunk of a long
               document at step 5 has positions 66000.. -> inf -> cos(inf) = NaN -> nan_origin (or overflow) at
               `attn.rope`, step 5.
 8. leftpad    causal mask and left-padding key mask both filled with -inf: the first batch with a left-padded
               sequence (step 5) has pad query rows whose every allowed key is padding -> softmax over -inf only
               -> nan_origin at `attn`, step 5.
 9. qknorm_eps QK-norm as `F.normalize(q, eps=1e-12)` in fp16 (1e-12 is 0 there), bias-free q projection and an
               Embedding(padding_idx=0): the first padded batch (step 5) gives q = 0 -> 0/0 -> eps_underflow (or
               nan_origin) at `attn.q_norm`, step 5.
Healthy twins (the same blocks done correctly, same triggers; no warning, no error):
10. RMSNorm upcast to fp32 (Llama's way) in front of a GeGLU whose input is the rare token's raw embedding (its
    square, ~4e4-9e4 per element, would overflow fp16): the loss falls, quiet.
11. rope_pos with positions and cos/sin computed in fp32 (cast to fp16 afterwards), positions to 92400: quiet.
12. hand_ce with the max shift (`m + log(sum(exp(l - m)))`), same rare token: quiet.

Result when written (torch 2.13 CPU, default watch): 11 pass, 1 xfail (12 pass since) (stable over two runs, ~3 s). First
findings (abridged):
 1. PASS [error] overflow at ffn aten::mul step 5; [error] skipped_steps (run) step 5.
 2. PASS [error] overflow at attn aten::bmm step 5 (max |x| 351 -> +inf); [error] skipped_steps.
 3. wrong when written (a strict xfail then), fixed since: only `[info] skipped_steps at (run) step 1`. The oracle:
    `head` (tied lm_head, aten::mm/linear) turns finite inputs into +inf at step 5; the soft-cap's tanh maps it to
    exactly 30, so the loss stays finite, nothing is skipped, and the rare token's capped logit gets a zero
    gradient. Now `[info] overflow at head step 5` from the always-on headroom series (rules/outside.py
    absorbed_unsampled); the case asks for the overflow at `head`, step 5, at any severity (an absorbed inf is
    `info` by design, see the test).
 4. PASS [error] overflow at moe.router aten::pow step 5 ("x**2 is inf for |x| > 255.9"); skipped_steps.
 5. PASS [error] overflow at moe.router aten::exp step 5 (propagates to aten::div); skipped_steps.
 6. PASS [error] overflow at lm_loss aten::exp step 5 (input up to 14.5); skipped_steps.
 7. PASS [error] overflow at attn.rope aten::_to_copy step 5 (propagates to aten::cos); skipped_steps at attn.rope.
 8. PASS [error] nan_origin at attn aten::_softmax step 5; skipped_steps.
 9. PASS [error] eps_underflow at attn.q_norm aten::clamp_min step 5; [error] nan_origin at attn.q_norm aten::div
    step 5; [error] eps_underflow at attn.k_norm.
 10-12. quiet (12: one [info] skipped_steps at step 0).
(Not built: a hand-written RMSNorm squaring in fp16 - its variance overflow gives rsqrt(inf) = 0, silent zeros, no
inf/NaN at any module output, so the Producer oracle cannot prove it; ALiBi slopes x positions - no inf below
~131k positions.)
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import probe_run, named_top3, quiet_twin
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
def ids_at(i, rare=False, pad=0, left=False):
    """Step i's (inputs, targets); `rare`: at step K one token of sequence 0 is the rare token; `pad`: at step K
    sequence 1 has `pad` padding tokens (left or right)."""
    ids = torch.randint(1, RARE, (B, T + 1), generator=gen(i % 4))
    if i == K and rare:
        ids[0, 3] = RARE
    if i == K and pad:
        if left:
            ids[1, :pad] = PAD
        else:
            ids[1, -pad:] = PAD
    return ids[:, :-1], ids[:, 1:]


def ce(out, y):
    return F.cross_entropy(out.float().reshape(-1, V), y.reshape(-1))


def rare_batch(i):
    x, y = ids_at(i, rare=True)
    return (x,), y


def loud_embedding(emb, scale=300.0):
    """The rare token's embedding row: large (its norm ~ `scale` x 4), the rest N(0, 1)."""
    with torch.no_grad():
        emb.weight[RARE] = torch.randn(D, generator=gen(7)).sign() * scale


def causal(t):
    return torch.triu(torch.ones(t, t, dtype=torch.bool), 1)


# ======================================================================================================================
# blocks
# ======================================================================================================================
class GeGLU(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(D, hidden), nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class RMSNorm32(nn.Module):
    """Llama's RMSNorm: the statistics in fp32, the result back in the input's dtype."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(D)), eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class FFNLM(nn.Module):
    """wte -> GeGLU (residual) -> head; `norm`: pre-norm and final norm, fp32 RMSNorms (Llama's layout)."""

    def __init__(self, norm=False):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D)
        loud_embedding(self.wte)
        if norm:
            self.norm, self.norm_f = RMSNorm32(), RMSNorm32()
        self.ffn = GeGLU()
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.wte(ids)
        if hasattr(self, "norm"):                           # pre-norm, and a final norm before the head
            return self.head(self.norm_f(h + self.ffn(self.norm(h))))
        return self.head(h + self.ffn(h))


class Rope(nn.Module):
    """Rotary embedding; `fp32=False` casts the positions to the activations' dtype (the bug)."""

    def __init__(self, dim=D, base=10000.0, fp32=False):
        super().__init__()
        self.fp32 = fp32
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x, pos):
        if self.fp32:
            f = pos.float()[..., None] * self.inv_freq
            cos, sin = f.cos().to(x.dtype), f.sin().to(x.dtype)
        else:
            p = pos.to(x.dtype)
            f = p[..., None] * self.inv_freq.to(x.dtype)
            cos, sin = f.cos(), f.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class L2Norm(nn.Module):
    """QK-norm as F.normalize (eps 1e-12: 0 in fp16)."""

    def forward(self, x):
        return F.normalize(x, dim=-1, eps=1e-12)


class Attn(nn.Module):
    """Single-head causal attention, bias-free projections; options: rope, QK-norm, a key padding mask."""

    def __init__(self, rope=None, qk_norm=False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        if rope is not None:
            self.rope = rope
        if qk_norm:
            self.q_norm, self.k_norm = L2Norm(), L2Norm()
        self.scale = (1.0 if qk_norm else D ** -0.5)

    def forward(self, x, pos=None, pad=None):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if hasattr(self, "rope"):
            q, k = self.rope(q, pos), self.rope(k, pos)
        s = (q @ k.transpose(-1, -2)) * self.scale          # the scale after the matmul
        s = s.masked_fill(causal(x.shape[1]), float("-inf"))
        if pad is not None:
            s = s.masked_fill(pad[:, None, :], float("-inf"))
        return self.o(torch.softmax(s, -1) @ v)


class AttnLM(nn.Module):
    def __init__(self, rope=None, qk_norm=False, loud=False):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D, padding_idx=PAD)
        if loud:
            loud_embedding(self.wte)
        self.attn = Attn(rope=rope, qk_norm=qk_norm)
        self.head = nn.Linear(D, V)

    def forward(self, ids, pos=None, pad=None):
        h = self.wte(ids)
        return self.head(h + self.attn(h, pos=pos, pad=pad))


class SoftcapLM(nn.Module):
    """wte -> GeGLU-free residual MLP -> tied lm_head -> final logit soft-capping (Gemma 2: cap 30)."""

    def __init__(self, cap=30.0):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D)
        loud_embedding(self.wte, scale=80.0)
        self.mlp = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight                  # tied
        self.cap = cap

    def forward(self, ids):
        h = self.wte(ids)
        h = h + 0.1 * self.mlp(h)
        logits = self.head(h)
        return self.cap * torch.tanh(logits / self.cap)


class Router(nn.Module):
    """MoE router: `zloss` -> (softmax probs, z-loss logsumexp^2); `by_hand` -> exp(l) / exp(l).sum() (no shift)."""

    def __init__(self, n=4, kind="zloss"):
        super().__init__()
        self.proj, self.kind = nn.Linear(D, n, bias=False), kind

    def forward(self, x):
        l = self.proj(x)
        if self.kind == "zloss":
            return torch.softmax(l, -1), torch.logsumexp(l, -1).pow(2).mean()
        e = l.exp()
        return e / e.sum(-1, keepdim=True), None


class MoE(nn.Module):
    def __init__(self, kind, n=4):
        super().__init__()
        self.router = Router(n, kind)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(n))

    def forward(self, x):
        p, z = self.router(x)
        out = sum(p[..., e:e + 1] * ex(x) for e, ex in enumerate(self.experts))
        return out, z


class MoELM(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D)
        loud_embedding(self.wte)
        self.moe = MoE(kind)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.wte(ids)
        m, z = self.moe(h)
        return self.head(h + 0.1 * m), z


def moe_loss(out, y):
    logits, z = out
    return ce(logits, y) + (0.0 if z is None else 1e-3 * z.float())


class LMLoss(nn.Module):
    """The LM loss by hand over the vocabulary; `shift=False`: logsumexp without the max shift."""

    def __init__(self, shift):
        super().__init__()
        self.shift = shift

    def forward(self, logits, y):
        if self.shift:
            m = logits.amax(-1, keepdim=True)
            lse = (m + (logits - m).exp().sum(-1, keepdim=True).log()).squeeze(-1)
        else:
            lse = logits.exp().sum(-1).log()
        return (lse - logits.gather(-1, y[..., None]).squeeze(-1)).mean()


class CELM(nn.Module):
    """wte -> residual MLP -> head -> lm_loss (the model returns its loss, as HF models do)."""

    def __init__(self, shift):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D)
        loud_embedding(self.wte, scale=10.0)
        self.mlp = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
        self.head = nn.Linear(D, V)
        self.lm_loss = LMLoss(shift)

    def forward(self, ids, labels):
        h = self.wte(ids)
        return self.lm_loss(self.head(h + self.mlp(h)), labels)


# ======================================================================================================================
# checks
# ======================================================================================================================
def real(r, module, step=K, silent=False):
    """The oracle: the first inf/NaN from finite inputs is made by `module` at `step`; before `step` nothing but the
    scaler's first backoffs (steps 0-2); at `step` the loss is non-finite (or, `silent`, finite and not skipped)."""
    assert r["first"] == (module, step), (r["first"], r["bad_loss"], r["skipped"])
    assert all(s < 3 for s in r["skipped"] if s < step) and not [s for s in r["bad_loss"] if s < step], r
    if silent:
        assert step not in r["bad_loss"] and step not in r["skipped"], (r["losses"], r["skipped"])
    else:
        assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


def named(rep, rules, module, step=K, severities=ALARM):
    """One of `rules` at `module`, at `step` (default K), among the first three findings (probe_harness.named_top3)."""
    return named_top3(rep, rules, module, step, severities)


quiet = quiet_twin  # (probe_harness.quiet_twin: the healthy twin's checks)


def run(m, batch, loss_fn, tmp_path, lr=1e-2):
    return probe_run(m, batch, loss_fn, STEPS, str(tmp_path / "run"), lr=lr)


# ======================================================================================================================
# 1-3: overflow in the forward of the feed-forward, the attention logits, a soft-capped tied head
# ======================================================================================================================
def test_1_geglu_gate_product_overflows(tmp_path):
    r = run(FFNLM(), rare_batch, ce, tmp_path)
    real(r, "ffn")
    named(r["rep"], "overflow", "ffn")


def test_2_attention_logits_without_qk_norm_overflow(tmp_path):
    r = run(AttnLM(loud=True), rare_batch, ce, tmp_path)
    real(r, "attn")
    named(r["rep"], FWD, "attn")


def test_3_softcap_hides_an_overflowed_tied_lm_head(tmp_path):
    """The inf is absorbed (tanh), so the loss, outputs and gradients stay finite: its severity is ampdoctor's call
    (`info`, as for any absorbed forward inf, on a sampled step or not: HF T5's clamp of an inf FF output is the
    healthy case it must not warn about); what must hold is that the overflow is named, at `head`, step 5, among
    the first three findings, although step 5 took no per-layer statistics."""
    r = run(SoftcapLM(), rare_batch, ce, tmp_path)
    real(r, "head", silent=True)
    f = named(r["rep"], "overflow", "head", severities=ALARM + ("info",))
    assert f.evidence.get("absorbed"), f.one_line()


# ======================================================================================================================
# 4-6: MoE router z-loss / exp-normalised router; the LM loss by hand without the max shift
# ======================================================================================================================
def test_4_router_z_loss_square_overflows(tmp_path):
    r = run(MoELM("zloss"), rare_batch, moe_loss, tmp_path)
    real(r, "moe.router")
    named(r["rep"], "overflow", "moe.router")


def test_5_router_softmax_by_hand_without_max_shift(tmp_path):
    r = run(MoELM("by_hand"), rare_batch, moe_loss, tmp_path)
    real(r, "moe.router")
    named(r["rep"], FWD, "moe.router")


def ce_batch(i):
    x, y = ids_at(i, rare=True)
    return (x,), {"labels": y}, y


def test_6_lm_loss_by_hand_logsumexp_without_max_shift(tmp_path):
    r = run(CELM(shift=False), ce_batch, lambda out, y: out.float(), tmp_path)
    real(r, "lm_loss")
    named(r["rep"], "overflow", "lm_loss")


# ======================================================================================================================
# 7-9: rotary positions in fp16; causal + left-padding masks; QK-norm eps in fp16
# ======================================================================================================================
def rope_batch(i):
    x, y = ids_at(i)
    pos = (i * 13200 + torch.arange(T)).expand(B, T)     # chunk i of one long document: 0, 13200, ..., 66000 (K)
    return (x,), {"pos": pos}, y


def test_7_rope_positions_cast_to_fp16_past_65504(tmp_path):
    r = run(AttnLM(rope=Rope()), rope_batch, ce, tmp_path)
    real(r, "attn.rope")
    named(r["rep"], FWD, "attn.rope")


def leftpad_batch(i):
    x, y = ids_at(i, pad=3, left=True)
    return (x,), {"pad": x == PAD}, y


def test_8_causal_and_left_padding_masks_leave_pad_queries_nothing(tmp_path):
    r = run(AttnLM(), leftpad_batch, ce, tmp_path)
    real(r, "attn")
    named(r["rep"], "nan_origin", "attn")


def rightpad_batch(i):
    x, y = ids_at(i, pad=3)
    return (x,), y


def test_9_qk_norm_eps_vanishes_in_fp16_on_padding(tmp_path):
    r = run(AttnLM(qk_norm=True), rightpad_batch, ce, tmp_path)
    real(r, "attn.q_norm")
    named(r["rep"], ("eps_underflow", "nan_origin"), "attn.q_norm")


# ======================================================================================================================
# 10-12: healthy twins
# ======================================================================================================================
def test_10_healthy_fp32_rmsnorm_before_geglu_on_the_rare_token(tmp_path):
    m = FFNLM(norm=True)
    with torch.no_grad():                       # the raw row would overflow fp16 when squared
        assert float(m.wte.weight[RARE].half().pow(2).max()) == math.inf
    r = run(m, rare_batch, ce, tmp_path)
    quiet(r)


def test_11_healthy_rope_in_fp32_at_long_positions(tmp_path):
    r = run(AttnLM(rope=Rope(fp32=True)), rope_batch, ce, tmp_path)
    quiet(r)


def test_12_healthy_lm_loss_by_hand_with_max_shift(tmp_path):
    r = run(CELM(shift=True), ce_batch, lambda out, y: out.float(), tmp_path)
    quiet(r)
