"""Sixty-seventh set: fp16 failures made in the FORWARD pass (a module's output first goes inf/NaN there) by parts of
modern architectures, on UNSAMPLED steps (the default watch takes full statistics on step 0 and every 200th; each
failure here starts between steps 13 and 15). Grep of the earlier sets (test_unseen_variants*.py, test_unseen_arch.py,
test_sequence_models_unseen.py, test_scientific_ml_unseen.py, test_systems_unseen.py, test_vision_heads_unseen.py,
test_recsys_tabular_unseen.py, test_long_context_unseen.py): no DeltaNet / delta rule, no PolyNorm, no ALiBi built
BLOOM's way (slope x key position); built there and not repeated: Mamba S6's exp(cumsum(dt A)) (62), Mamba-2's SSD
segsum (38), minGRU's log-space scan (58), a router z-loss (5, 56), Performer's FAVOR+ (19), SwiGLU products (many),
hand-written RMSNorm (many), RoPE positions past 65504 (27), xPos (long_context), mean pooling (long_context). Three
failures and three healthy twins (the same model, the fix applied). Tiny models, fixed seeds, one intra-op thread.
Watched through the public API only (probe_harness.variant_run: `ampdoctor.watch(model, optimizer=AdamW,
scaler=GradScaler("cpu"), run_dir=tmp_path / "run")` at the default settings; CPU fp16 autocast, scale(loss).backward
-> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> close -> `w.report()`); every model computes its own loss.

Each failure is proven first by its own oracle (probe_harness.variant_named_at_producer): probe_harness.Producer with
call counting (the first (module, step, call) whose output is non-finite while its inputs, keyword inputs and own
parameters were finite), the loss first non-finite at that step, the scaler skipping it (before it only the opening
backoffs, steps 0-2), the same run UNWATCHED giving bitwise the same losses, and the bad step's weights running the bad
batch in float32 (no autocast) to a finite loss. A failing oracle is a plain failure. Only then must overflow /
nan_origin be an error at the PRODUCER at that step among the report's first three findings, with no such error at
that step naming a module that only passed the value on; a wrong report is a strict xfail (`wrong`). Each twin
(probe_harness.variant_twin_quiet, bad + 6 steps, the bad batch included): the same losses unwatched, every loss
finite, no producer, the last three losses 5% below the first three, no skip after step 2, and no warning or error.

 1. deltanet: a byte-ish LM with DeltaNet's token mixer (Yang et al. 2024) in fla's naive recurrent reference form
    (S_t = S_{t-1} + k_t (beta_t (v_t - S_{t-1}^T k_t))^T, o_t = S_t^T q_t, the state made `.to(v)`: fp16), ported
    without the q / k L2 norm (fla's qk_norm='l2'). With raw keys beta |k|^2 is ~2, the transition I - beta k k^T no
    longer contracts and the state grows geometrically with the length: harmless on 32-token windows, but at step 15
    the first 1024-token document arrives and S passes 65504 (finite in float32) -> overflow / nan_origin at `mixer`
    (not `mixer.o_proj`, `head`). Fix: q and k L2-normalised (F.normalize), as fla does.
 2. polynorm: a tabular regressor whose activation is PolyNorm (Zhuo et al. 2024, "Polynomial Composition
    Activations", as Motif's models use it): w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b, norm(u) = u / sqrt(mean(u^2)
    + eps). norm(x^3) squares the cube: x^6 passes 65504 already at |x| > 6.3 (rsqrt(inf) = 0 silently zeroes that
    row's cubic term) and x^3 itself at |x| > 40.3, where inf * 0 = NaN. At step 14 one row's revenue column arrives in
    dollars, not thousands (x900): `ffn.fc` gives ~490 (finite) -> overflow / nan_origin at `ffn.act` (not `ffn.fc`,
    `ffn2.*`, `head`). Fix: PolyNorm in float32 (`x.float()`; each normalised term then has rms 1).
 3. alibi: an LM with block-local causal attention (blocks of 32) whose scores are torch.baddbmm(alibi, q, k^T) with
    ALiBi built as BLOOM builds it: slope x KEY position ((attention_mask.cumsum(-1) - 1) * mask; the query's offset is
    dropped, softmax being shift invariant), in float32, cast to fp16 by baddbmm under autocast. 8 heads: slope 1/2
    for the first. 256-token windows until step 13, then a long-context stage's first 135,168-token book: 0.5 x
    131,040 reaches 65520 -> alibi = +inf for the late keys, softmax of +inf rows = NaN -> overflow / nan_origin at
    `attn` (not `attn.qkv`, `attn.out`, `mlp`, `head`). Fix: the key position relative to its block's first key (the
    same softmax, bounded bias).

Result when written (torch 2.13 CPU, default watch): 6 pass, 0 xfail (three runs, the same), 2-3 minutes.
ampdoctor's first finding in each failing run:
 1. `[error] overflow at mixer aten::sum step 15: aten::sum in `mixer` produced ±inf from finite inputs; it propagates
    to aten::bmm in `mixer`` (second: `[error] skipped_steps at (run) step 15`, "the forward pass itself was
    non-finite, which no loss scale can fix").
 2. `[error] overflow at ffn.act aten::pow step 14: aten::pow in `ffn.act` overflowed float16 (input up to 490.5; in
    fp16 x**3 is inf for |x| > 40.31); it propagates to aten::div in `ffn.act``.
 3. `[error] overflow at attn aten::_to_copy step 13: aten::_to_copy in `attn` produced +inf from finite inputs; it
    propagates to aten::_softmax in `attn``.
The twins' reports hold only info findings (the opening backoffs).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants67.py
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import variant_named_at_producer, variant_twin_quiet
from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ======================================================================================================================
# 1. DeltaNet's delta rule (fla's naive recurrent reference) with the q / k L2 norm left out: a long document
# ======================================================================================================================
DN_BAD, DN_V, DN_D, DN_DK = 15, 32, 32, 12


class DeltaRule(nn.Module):
    """DeltaNet's token mixer (Yang et al. 2024), the delta rule in fla's naive recurrent form: S_t = S_{t-1} + k_t
    (beta_t (v_t - S_{t-1}^T k_t))^T, o_t = S_t^T q_t, the state made in v's dtype. `fix`: q and k L2-normalised
    (fla's default qk_norm='l2'): the transition I - beta k k^T then contracts."""

    def __init__(self, d=DN_D, dk=DN_DK, fix=False):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(d, dk, bias=False), nn.Linear(d, dk, bias=False)
        self.v_proj, self.b_proj = nn.Linear(d, dk, bias=False), nn.Linear(d, 1)
        self.o_proj = nn.Linear(dk, d, bias=False)
        self.fix, self.dk = fix, dk

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        beta = torch.sigmoid(self.b_proj(x))
        if self.fix:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        q = q * self.dk ** -0.5
        S = torch.zeros(x.shape[0], self.dk, self.dk).to(v)
        out = []
        for t in range(x.shape[1]):
            kt = k[:, t]
            u = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t]
            S = S + kt[..., None] * u[:, None, :]
            out.append(torch.einsum("bd,bdm->bm", q[:, t], S))
        return self.o_proj(torch.stack(out, 1))


class DeltaLM(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.emb = nn.Embedding(DN_V, DN_D)
        self.norm1, self.mixer = nn.LayerNorm(DN_D), DeltaRule(fix=fix)
        self.norm2, self.head = nn.LayerNorm(DN_D), nn.Linear(DN_D, DN_V)

    def forward(self, tok):
        h = self.emb(tok[:, :-1])
        h = h + self.mixer(self.norm1(h))
        return F.cross_entropy(self.head(self.norm2(h)).float().flatten(0, 1), tok[:, 1:].flatten())


def dn_batch(i):
    """Token streams of a noisy second-order process (x_t = 3 x_{t-1} + x_{t-2} + 1 mod V, 15% resampled): 8 x 32
    tokens; at DN_BAD one 1024-token document (the mix's first long one)."""
    g = gen(6710 + i % 6)
    b, t = (1, 1025) if i == DN_BAD else (8, 33)
    x = torch.randint(0, DN_V, (b, t), generator=g)
    noise = torch.rand(b, t, generator=g) < 0.15
    for s in range(2, t):
        x[:, s] = torch.where(noise[:, s], x[:, s], (3 * x[:, s - 1] + x[:, s - 2] + 1) % DN_V)
    return (x,), None


# ======================================================================================================================
# 2. PolyNorm (polynomial composition activation): norm(x^3) squares the cube
# ======================================================================================================================
PN_BAD, PN_IN = 14, 12


class PolyNorm(nn.Module):
    """PolyNorm (Zhuo et al. 2024, as Motif's models use it): w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b, norm(u) =
    u / sqrt(mean(u^2) + eps) over the features. `fix`: computed in float32."""

    def __init__(self, fix=False, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 1 / 3))
        self.bias = nn.Parameter(torch.zeros(1))
        self.fix, self.eps = fix, eps

    def _norm(self, u):
        return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        if self.fix:
            x = x.float()
        return (self.weight[0] * self._norm(x ** 3) + self.weight[1] * self._norm(x ** 2)
                + self.weight[2] * self._norm(x) + self.bias)


class Block(nn.Module):
    def __init__(self, d_in, d, fix=False):
        super().__init__()
        self.fc, self.act = nn.Linear(d_in, d), PolyNorm(fix)

    def forward(self, x):
        return self.act(self.fc(x))


class PolyMLP(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.ffn = Block(PN_IN, 64, fix)
        self.ffn2 = Block(64, 64, fix)
        self.head = nn.Linear(64, 1)

    def forward(self, x, y):
        return F.huber_loss(self.head(self.ffn2(self.ffn(x))).squeeze(-1).float(), y)


PN_W = torch.randn(PN_IN, generator=gen(6721))


def pn_batch(i):
    """Standardised rows of 12 features (a smooth target); at PN_BAD one row's feature 4 comes in raw units (x900,
    a revenue column in dollars where the others are in thousands)."""
    g = gen(6720 + i % 6)
    x = torch.randn(32, PN_IN, generator=g)
    y = torch.tanh(x @ PN_W / 3) + 0.3 * torch.sin(x[:, 0] * 2)
    if i == PN_BAD:
        x = x.clone()
        x[7, 4] = x[7, 4].abs() * 900 + 900
    return (x, y), None


# ======================================================================================================================
# 3. ALiBi as BLOOM builds it (slope x KEY position, relying on softmax's shift invariance), block-local attention
# ======================================================================================================================
AL_BAD, AL_V, AL_D, AL_H, AL_BLK = 13, 32, 32, 8, 32
AL_LONG = 132 * 1024


def alibi_slopes(h):
    """Press et al.'s slopes for h heads (a power of two): 2^(-8 i / h), i = 1..h."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])


class LocalAlibiAttention(nn.Module):
    """Block-local causal attention (blocks of AL_BLK) whose scores come from torch.baddbmm(alibi, q, k^T) as BLOOM's
    attention computes them; BLOOM's alibi is slope x key position (cumsum of the attention mask - 1), the query's
    own offset dropped (softmax is shift invariant). `fix`: the key position relative to its block start."""

    def __init__(self, fix=False):
        super().__init__()
        self.qkv, self.out = nn.Linear(AL_D, 3 * AL_D), nn.Linear(AL_D, AL_D)
        self.register_buffer("slopes", alibi_slopes(AL_H), persistent=False)
        self.fix = fix

    def forward(self, x, mask):
        b, t, _ = x.shape
        nb, dh = t // AL_BLK, AL_D // AL_H
        q, k, v = self.qkv(x).view(b, nb, AL_BLK, 3, AL_H, dh).permute(3, 0, 1, 4, 2, 5).unbind(0)
        pos = (mask.cumsum(-1) - 1) * mask                                  # BLOOM's arange_tensor
        if self.fix:
            pos = pos - pos.view(b, nb, AL_BLK)[..., :1].expand(b, nb, AL_BLK).reshape(b, t)
        alibi = self.slopes[None, :, None] * pos[:, None, :].float()        # (b, h, t), float32
        alibi = alibi.view(b, AL_H, nb, AL_BLK).permute(0, 2, 1, 3).reshape(-1, 1, AL_BLK)
        s = torch.baddbmm(alibi, q.reshape(-1, AL_BLK, dh), k.reshape(-1, AL_BLK, dh).transpose(1, 2),
                          beta=1.0, alpha=dh ** -0.5)
        causal = torch.ones(AL_BLK, AL_BLK, dtype=torch.bool).triu(1)
        s = s.masked_fill(causal, torch.finfo(s.dtype).min)
        o = torch.bmm(s.softmax(-1).to(v.dtype), v.reshape(-1, AL_BLK, dh))
        o = o.view(b, nb, AL_H, AL_BLK, dh).permute(0, 1, 3, 2, 4).reshape(b, t, AL_D)
        return self.out(o)


class AlibiLM(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.emb = nn.Embedding(AL_V, AL_D)
        self.norm1, self.attn = nn.LayerNorm(AL_D), LocalAlibiAttention(fix)
        self.norm2, self.mlp = nn.LayerNorm(AL_D), nn.Sequential(nn.Linear(AL_D, 64), nn.GELU(), nn.Linear(64, AL_D))
        self.normf, self.head = nn.LayerNorm(AL_D), nn.Linear(AL_D, AL_V)

    def forward(self, tok, mask):
        h = self.emb(tok[:, :-1])
        h = h + self.attn(self.norm1(h), mask)
        h = h + self.mlp(self.norm2(h))
        return F.cross_entropy(self.head(self.normf(h)).float().flatten(0, 1), tok[:, 1:].flatten())


def al_batch(i):
    """Token streams of a noisy copy-with-offset process (x_t = x_{t-3} + 1 mod V, 20% resampled): 4 x 256 tokens;
    at AL_BAD one 135,168-token document (a long-context stage's first book)."""
    g = gen(6730 + i % 6)
    b, t = (1, AL_LONG + 1) if i == AL_BAD else (4, 257)
    n = -(-t // 3)
    fresh = torch.randint(0, AL_V, (b, 3, n), generator=g)
    reset = torch.rand(b, 3, n, generator=g) < 0.2
    reset[..., 0] = True
    j = torch.arange(n).expand(b, 3, n)
    last = torch.where(reset, j, torch.zeros_like(j)).cummax(-1).values      # each chain's last resample
    x = (fresh.gather(-1, last) + j - last) % AL_V
    x = x.transpose(1, 2).reshape(b, 3 * n)[:, :t]
    return (x, torch.ones(b, t - 1, dtype=torch.long)), None


CASES = {
    "deltanet": dict(make=DeltaLM, batch=dn_batch, bad=DN_BAD, name="mixer", call=1, lr=1e-2),
    "polynorm": dict(make=PolyMLP, batch=pn_batch, bad=PN_BAD, name="ffn.act", call=1, lr=3e-3),
    "alibi": dict(make=AlibiLM, batch=al_batch, bad=AL_BAD, name="attn", call=1, lr=1e-2),
}


@pytest.mark.parametrize("key", list(CASES))
def test_failure_named_at_the_producer(tmp_path, key):
    variant_named_at_producer(CASES[key], tmp_path, debug=DEBUG)


@pytest.mark.parametrize("key", list(CASES))
def test_twin_with_the_fix_stays_quiet(tmp_path, key):
    variant_twin_quiet(CASES[key], tmp_path, debug=DEBUG)
