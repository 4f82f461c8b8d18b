"""Healthy runs at ampdoctor's DEFAULT watch and at `every=1`, thirty-ninth set: SIX TRAINING RECIPES NOT PROBED
BY THE EARLIER FILES (four fp16 with a real GradScaler, two bf16 with a disabled one).

Each case is a realistic recipe that could provoke a false alarm; `ampdoctor.watch(model, optimizer=...,
scaler=..., run_dir=tmp_path / "run")` at the default sampling and again with `every=1` (full statistics every
step), nothing else; CPU autocast (fp16 with a real `torch.amp.GradScaler("cpu")`, or bf16 with
`GradScaler("cpu", enabled=False)`, the usual way one loop serves both), backward -> unscale_ -> clip -> step ->
update, fixed seeds, one intra-op thread, 60-150 optimizer steps each. Every case runs three times: once
UNWATCHED (shared by both modes) and once under each watch.

- The unwatched run carries the oracle, independent of ampdoctor (`healthy`; a failure is a plain failure): every
  loss finite, the mean of the last 5 losses <= 0.9 x the first 5's, the scaler skipped no step but the opening
  ones (< 3), every final weight and buffer finite.
- The watched run must train bitwise identically (probe_harness.same_run): the losses, the skipped steps, every
  final weight and buffer, the case's extras.
- Then (probe_harness.quiet_healthy) w.report() after close() holds no warning and no error, exit code 0, at least
  one step seen, and no `ampdoctor...` Python warning; otherwise WrongAnswer, a strict xfail (probe_harness.wrong)
  quoting ampdoctor.

Left out (grep of tests/test_*.py): most of the brief's suggestions are probed already -- Mamba's selective scan,
Hyena's FFT long conv (test_healthy_arch), VQ-VAE codebooks with commitment loss (arch, default35, 37), ConvNeXt
layer scale, Perceiver latents, CLIP's logit_scale clamp, label smoothing, distillation KL, a layer flat near the
max (test_healthy_near_max). New here (0 hits in tests/ for each): MDLM's masked-diffusion LM (the brief's
suggestion), Mixture-of-Depths routing (the brief's), DreamerV3's symlog two-hot critic, GRU-D, the Differential
Transformer, the Nystromformer; and the first bf16 cases run through HealthyLoop (a disabled GradScaler).

The cases:
 1. mdlm_subs_masked_diffusion: Sahoo et al.'s MDLM on arithmetic progressions mod 16 (length 16): a 2-block
    bidirectional transformer denoiser; the log-linear schedule with antithetic t in [1e-3, 1], tokens absorbed
    into MASK with probability t; the SUBS parametrisation INSIDE the watched root module, in fp32 (masked_fill
    of the MASK logit with -inf before the log-softmax; at unmasked positions log-probs -inf everywhere but 0 at
    the observed token), so the model's output is mostly -inf by design; loss = -sum(log p(x0) at masked
    positions x 1/t) / tokens (weights up to 1000). 80 steps, 2.889 -> 2.454 (first / last 5).
 2. mod_topk_routing_bf16: Raposo et al.'s Mixture-of-Depths in bf16: 4 causal blocks, the odd ones see only the
    top-25% tokens chosen by a scalar Linear router (topk, sorted to keep order, gather), their residual update
    multiplied by the router weight and scatter_add-ed back into the fp32 stream; next-token LM on arithmetic
    progressions mod 10. AdamW, scaler disabled. 80 steps, 2.388 -> 1.313.
 3. dreamer_symlog_twohot_critic: DreamerV3's critic: symlog inputs (feature scales 0.1 to 100), Linear /
    LayerNorm / SiLU MLP, a ZERO-initialised 255-way output Linear (outscale 0: no gradient reaches the MLP at step
    0), two-hot targets of symlog(returns) over bins linspace(-20, 20) whose symexp reaches 4.9e8 (fp32 buffer),
    returns spanning six orders of magnitude, the prediction symexp(E[bin]) in fp32 as a second output; clip 100.
    The per-step symlog error is an extra compared between runs. 150 steps, 5.486 -> 3.121.
 4. grud_irregular_missing: Che et al.'s GRU-D on irregular series with 65% missing values and gaps of up to
    ~60 h: BRITS's TemporalDecay modules gamma = exp(-relu(W delta + b)) (diagonal for the input), computed in
    fp16 under autocast -- ~21% of the input decays' nonzero values are subnormal and ~8% exactly 0 ("forgotten",
    by design); input decay towards the mean, hidden-state decay, mask-fed hand-written GRU cell (16 calls a
    step). Binary trend classification. 60 steps, 0.581 -> 0.004.
 5. diff_transformer_arith: Ye et al.'s Differential Transformer: attention = softmax(Q1K1) - lambda
    softmax(Q2K2), lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init(depth), softmax in fp32 with a -inf causal
    mask, per-head RMSNorm (subln) x (1 - lambda_init), RMSNorm / SiLU MLP blocks; next-token LM on arithmetic
    progressions mod 12. AdamW (0.9, 0.98), wd 0.1. 80 steps, 2.498 -> 1.136.
 6. nystromformer_denoise_bf16: Xiong et al.'s Nystromformer (HF's layout) in bf16: 4 segment-mean landmarks,
    three softmax kernels, the pseudo-inverse of the middle one by 6 Newton-Schulz iterations (13I, 15I, 7I)
    with bf16 matmuls, a depthwise conv skip on V; denoising a period-4 motif with 25% blanked tokens (per-token
    CE). AdamW, scaler disabled. 60 steps, 2.266 -> 0.078.

Result when written (torch 2.13 CPU, default watch and every=1): 12 pass, 0 strict xfail (6 cases x {default,
every=1}): no warning or error finding, exit code 0, no `ampdoctor...` Python warning, every watched run bitwise
identical to the unwatched one. The only finding: mdlm (both modes) -- `[info] overflow at (root) step 0`: "(root)
(MDLM) emits -inf from finite inputs ..., but later ops absorb it: the loss and the outputs stayed finite -- an
additive -inf mask before a softmax does this by design." The other ten reports are empty (GRU-D's subnormal
decays raise no underflow; the zero-initialised DreamerV3 head raises nothing). XFAIL is empty. The file takes
60-80 s on one thread.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace as ns

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import HealthyLoop, healthy_run, quiet_healthy, same_run, trained_healthily, wrong  # noqa: E402
from scenarios import gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
DEBUG = os.environ.get("H39_DEBUG") == "1"
F16, BF16 = torch.float16, torch.bfloat16
CASES: dict = {}
XFAIL: dict[tuple[str, str], str] = {}
MODES = {"default": {}, "every1": {"every": 1}}


def case(steps, fall=0.9):
    def reg(fn):
        CASES[fn.__name__] = ns(build=fn, steps=steps, fall=fall)
        return fn
    return reg


def amp_update(model, optimizer, scaler, loss, clip=1.0):
    """scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update -> zero_grad (with a disabled scaler
    for bf16 every scaler call is the identity / a plain optimizer.step)."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


class Attn(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, causal=False):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(d), Attn(d, heads), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def delta(self, x, causal=False):
        """The block's residual update (x + delta is the usual block)."""
        a = self.attn(self.n1(x), causal)
        return a + self.ff(self.n2(x + a))

    def forward(self, x, causal=False):
        return x + self.delta(x, causal)


def arith(g, b, n, mod):
    start, k = torch.randint(0, mod, (b, 1), generator=g), torch.randint(1, mod, (b, 1), generator=g)
    return (start + k * torch.arange(n)) % mod


# ------------------------------------------------------------------ 1. MDLM masked (absorbing-state) diffusion LM
class DenoiserLM(nn.Module):
    def __init__(self, vocab=17, d=32, n=16, blocks=2):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(n, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, t):
        x = self.emb(t) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class MDLM(nn.Module):
    """Sahoo et al. 2024's SUBS parametrisation inside the model's forward, in fp32: the mask token's logit -inf
    (masked_fill before the log-softmax: the model never predicts MASK), and at unmasked positions the log-probs
    are -inf everywhere but 0 at the observed token (carry-over unmasking). The output is mostly -inf by design."""

    def __init__(self, vocab=16, n=16):
        super().__init__()
        self.mask = vocab
        self.backbone = DenoiserLM(vocab + 1, n=n)

    def forward(self, xt):
        logits = self.backbone(xt).float()
        logits = logits.masked_fill(F.one_hot(torch.tensor(self.mask), self.mask + 1).bool(), float("-inf"))
        logp = logits.log_softmax(-1)
        keep = F.one_hot(xt, self.mask + 1).bool()
        carry = torch.zeros_like(logp).masked_fill(~keep, float("-inf"))
        return torch.where((xt != self.mask)[..., None], carry, logp)


@case(80)
def mdlm_subs_masked_diffusion():
    torch.manual_seed(21)
    V, MASK, n, B, eps = 16, 16, 16, 32, 1e-3
    model = MDLM(V, n)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")

    def step(i):
        g = gen(21_000_000 + i)
        x0 = arith(g, B, n, V)
        u = torch.rand(1, generator=g)
        t = (u + torch.arange(B) / B) % 1 * (1 - eps) + eps      # MDLM's antithetic (low-discrepancy) t
        move = (1 - eps) * t                                     # log-linear schedule: 1 - exp(-sigma(t))
        masked = torch.rand(B, n, generator=g) < move[:, None]
        xt = torch.where(masked, MASK, x0)
        with torch.autocast("cpu", dtype=F16):
            logp = model(xt).gather(-1, x0[..., None]).squeeze(-1)     # 0 at unmasked positions (carried over)
        w = 1 / t                                                # dsigma / expm1(sigma) for the log-linear schedule
        loss = -(logp * masked * w[:, None]).sum() / masked.numel()
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 2. Mixture-of-Depths (bf16)
class MoDLM(nn.Module):
    """Raposo et al. 2024: every other block sees only the top-k (capacity 25%) tokens chosen by a scalar router;
    the block's update is multiplied by the router weight (so the router gets gradient) and scattered back."""

    def __init__(self, vocab=10, d=32, n=24, blocks=4, capacity=0.25):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(n, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.routers = nn.ModuleList(nn.Linear(d, 1) for _ in range(blocks // 2))
        self.k = int(n * capacity)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, t):
        x = self.emb(t) + self.pos
        for j, b in enumerate(self.blocks):
            if j % 2 == 0:
                x = b(x, causal=True)
                continue
            r = self.routers[j // 2](x).squeeze(-1)                      # (B, n)
            idx = r.topk(self.k, -1).indices.sort(-1).values            # keep the sequence order
            gidx = idx[..., None].expand(-1, -1, x.shape[-1])
            sel = x.gather(1, gidx)
            upd = b.delta(sel, causal=True) * r.gather(1, idx)[..., None]
            x = x.scatter_add(1, gidx, upd.to(x.dtype))
        return self.head(self.norm(x))


@case(80)
def mod_topk_routing_bf16():
    torch.manual_seed(22)
    model = MoDLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=False)          # bf16: the usual loop with the scaler off

    def step(i):
        t = arith(gen(22_000_000 + i), 16, 25, 10)
        with torch.autocast("cpu", dtype=BF16):
            logits = model(t[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 10), t[:, 1:].reshape(-1))
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 3. DreamerV3 symlog two-hot critic
def symlog(x):
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x):
    return torch.sign(x) * torch.expm1(x.abs())


class TwoHotCritic(nn.Module):
    """DreamerV3's reward / value head: symlog inputs, an MLP (Linear, LayerNorm, SiLU), a ZERO-initialised output
    Linear over 255 bins equally spaced in symlog space on [-20, 20]; the prediction symexp(E[bin]) in fp32 (the
    bins' symexp reaches 4.9e8, beyond fp16's max -- they stay fp32)."""

    def __init__(self, din=8, d=64, bins=255):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(din, d), nn.LayerNorm(d), nn.SiLU(), nn.Linear(d, d), nn.LayerNorm(d),
                                 nn.SiLU())
        self.out = nn.Linear(d, bins)
        nn.init.zeros_(self.out.weight)                          # DreamerV3: outscale 0.0 for reward and critic
        nn.init.zeros_(self.out.bias)
        self.register_buffer("bins", torch.linspace(-20, 20, bins))

    def forward(self, obs):
        logits = self.out(self.mlp(symlog(obs)))
        mean = (logits.float().softmax(-1) * self.bins).sum(-1)
        return logits, symexp(mean)


def twohot(y, bins):
    """DreamerV3's two-hot encoding of symlog(y) over `bins` (fp32)."""
    x = symlog(y)
    hi = torch.searchsorted(bins, x).clamp(1, len(bins) - 1)
    lo = hi - 1
    w_hi = ((x - bins[lo]) / (bins[hi] - bins[lo])).clamp(0, 1)
    return F.one_hot(lo, len(bins)) * (1 - w_hi)[:, None] + F.one_hot(hi, len(bins)) * w_hi[:, None]


@case(150)
def dreamer_symlog_twohot_critic():
    torch.manual_seed(23)
    model = TwoHotCritic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    scaler = torch.amp.GradScaler("cpu")
    err = []

    def step(i):
        g = gen(23_000_000 + i)
        obs = torch.randn(128, 8, generator=g) * torch.tensor([1.0, 1.0, 3.0, 10.0, 100.0, 1.0, 1.0, 0.1])
        # positive returns over six orders of magnitude, log-magnitude from obs 1..4 (obs 0, 5-7 distractors)
        y = torch.exp(3.0 + 2.0 * obs[:, 1] + 0.3 * obs[:, 2] + 0.05 * obs[:, 3] + 0.004 * obs[:, 4])
        with torch.autocast("cpu", dtype=F16):
            logits, value = model(obs)
        loss = -(twohot(y, model.bins) * logits.float().log_softmax(-1)).sum(-1).mean()
        err.append((symlog(value) - symlog(y)).abs().mean().item())
        amp_update(model, opt, scaler, loss, clip=100.0)          # DreamerV3 clips at 100 (AGC aside)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step, extra=[err])


# ------------------------------------------------------------------ 4. GRU-D on irregular series with missing values
class TemporalDecay(nn.Module):
    """BRITS / GRU-D's TemporalDecay module: gamma = exp(-relu(W delta + b)), W masked to its diagonal for the
    input decay. Under autocast F.linear is fp16 and exp runs in fp16: long gaps (delta up to ~60 h) give decays
    below fp16's normal range (exp(-9.7) = 6.1e-5), subnormal or exactly 0 -- the intended "forgotten" -- which
    only weight convex blends (x towards the mean, h towards 0)."""

    def __init__(self, din, dout, diag=False):
        super().__init__()
        std = 1 / math.sqrt(dout)
        self.W, self.b = nn.Parameter(torch.empty(dout, din).uniform_(-std, std)), nn.Parameter(torch.zeros(dout))
        self.register_buffer("m", torch.eye(din) if diag else torch.ones(dout, din))

    def forward(self, delta):
        return torch.exp(-torch.relu(F.linear(delta, self.W * self.m, self.b)))


class GRUD(nn.Module):
    """Che et al. 2018's GRU-D: input decay towards the empirical mean, hidden-state decay, the mask fed to the
    gates (a hand-written GRU cell, 16 time steps: every module called 16 times a step)."""

    def __init__(self, d=6, h=32, classes=2):
        super().__init__()
        self.h = h
        self.decay_x, self.decay_h = TemporalDecay(d, d, diag=True), TemporalDecay(d, h)
        self.gates = nn.Linear(3 * d + h, 3 * h)
        self.cand = nn.Linear(h, h, bias=False)
        self.head = nn.Linear(h, classes)

    def forward(self, x, m, delta, xmean):
        b, T, _ = x.shape
        hs = torch.zeros(b, self.h)
        xlast = xmean.expand(b, -1)
        for t in range(T):
            gx, gh = self.decay_x(delta[:, t]), self.decay_h(delta[:, t])
            xlast = torch.where(m[:, t] > 0, x[:, t], xlast)
            xh = m[:, t] * x[:, t] + (1 - m[:, t]) * (gx * xlast + (1 - gx) * xmean)
            hs = gh * hs
            zr_c = self.gates(torch.cat([xh, hs, m[:, t], delta[:, t] / 48], -1))
            z, r, c = zr_c.chunk(3, -1)
            z, r = torch.sigmoid(z), torch.sigmoid(r)
            hs = (1 - z) * hs + z * torch.tanh(c + self.cand(r * hs))
        return self.head(hs)


@case(60)
def grud_irregular_missing():
    torch.manual_seed(24)
    model = GRUD()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    T, d = 16, 6
    xmean = torch.zeros(d)

    def batch(i):
        g = gen(24_000_000 + i)
        b = 64
        y = torch.randint(0, 2, (b,), generator=g)
        slope = (2 * y - 1).float()[:, None, None] * (0.5 + torch.rand(b, 1, d, generator=g))
        gaps = torch.rand(b, T, generator=g) * 2 + (torch.rand(b, T, generator=g) < 0.15) * 30
        times = gaps.cumsum(1)
        times = times / times[:, -1:]
        x = slope * times[..., None] + 0.3 * torch.randn(b, T, d, generator=g)
        m = (torch.rand(b, T, d, generator=g) < 0.35).float()
        m[:, 0] = 1.0
        delta = torch.zeros(b, T, d)                              # hours since each feature was last observed
        for t in range(1, T):
            delta[:, t] = gaps[:, t, None] + (1 - m[:, t - 1]) * delta[:, t - 1]
        return x * m, m, delta, y

    def step(i):
        x, m, delta, y = batch(i)
        with torch.autocast("cpu", dtype=F16):
            logits = model(x, m, delta, xmean)
        loss = F.cross_entropy(logits.float(), y)
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 5. Differential Transformer
class DiffAttn(nn.Module):
    """Ye et al. 2024's differential attention (the official multihead_diffattn): softmax(Q1 K1) - lambda
    softmax(Q2 K2), lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init, a per-head RMSNorm (subln), x (1 -
    lambda_init)."""

    def __init__(self, d, heads, depth):
        super().__init__()
        self.h, self.hd = heads, d // heads // 2
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        self.lq1, self.lk1, self.lq2, self.lk2 = (nn.Parameter(torch.randn(self.hd) * 0.1) for _ in range(4))
        self.subln = nn.RMSNorm(2 * self.hd, eps=1e-5)

    def forward(self, x):
        b, n, d = x.shape
        q = self.q(x).view(b, n, 2 * self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(b, n, 2 * self.h, self.hd).transpose(1, 2)
        v = self.v(x).view(b, n, self.h, 2 * self.hd).transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) * self.hd ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        a = s.float().masked_fill(causal, float("-inf")).softmax(-1).type_as(s).view(b, self.h, 2, n, n)
        lam = (torch.exp((self.lq1 * self.lk1).sum()) - torch.exp((self.lq2 * self.lk2).sum()) + self.lambda_init)
        a = a[:, :, 0] - lam * a[:, :, 1]
        y = self.subln(a @ v) * (1 - self.lambda_init)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


class DiffLM(nn.Module):
    def __init__(self, vocab=12, d=32, n=24, layers=2, heads=2):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(n, d) * 0.02)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(n1=nn.RMSNorm(d), attn=DiffAttn(d, heads, j), n2=nn.RMSNorm(d),
                                                       ff=nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(),
                                                                        nn.Linear(4 * d, d))))
                                    for j in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab)

    def forward(self, t):
        x = self.emb(t) + self.pos[:t.shape[1]]
        for L in self.layers:
            x = x + L.attn(L.n1(x))
            x = x + L.ff(L.n2(x))
        return self.head(self.norm(x))


@case(80)
def diff_transformer_arith():
    torch.manual_seed(25)
    model = DiffLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.98))
    scaler = torch.amp.GradScaler("cpu")

    def step(i):
        g = gen(25_000_000 + i)
        t = arith(g, 16, 25, 12)
        with torch.autocast("cpu", dtype=F16):
            logits = model(t[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 12), t[:, 1:].reshape(-1))
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ------------------------------------------------------------------ 6. Nystromformer (bf16)
class NystromAttn(nn.Module):
    """Xiong et al. 2021 (the HF NystromformerSelfAttention): landmarks = segment means of Q and K, three softmax
    kernels, the Moore-Penrose pseudo-inverse of the middle one by 6 Newton-Schulz iterations (13I, 15I, 7I), a
    depthwise conv skip on V."""

    def __init__(self, d, heads, landmarks=4, iters=6):
        super().__init__()
        self.h, self.m, self.iters = heads, landmarks, iters
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.conv = nn.Conv2d(heads, heads, (17, 1), padding=(8, 0), groups=heads, bias=False)

    def pinv(self, K):
        eye = torch.eye(K.shape[-1], dtype=K.dtype)
        V = K.transpose(-1, -2) / (K.sum(-2).amax(-1)[..., None, None] * K.sum(-1).amax(-1)[..., None, None])
        for _ in range(self.iters):
            KV = K @ V
            V = 0.25 * V @ (13 * eye - KV @ (15 * eye - KV @ (7 * eye - KV)))
        return V

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        q = q * (d // self.h) ** -0.25
        k = k * (d // self.h) ** -0.25
        ql = q.reshape(b, self.h, self.m, n // self.m, -1).mean(-2)
        kl = k.reshape(b, self.h, self.m, n // self.m, -1).mean(-2)
        k1 = (q @ kl.transpose(-1, -2)).softmax(-1)
        k2 = (ql @ kl.transpose(-1, -2)).softmax(-1)
        k3 = (ql @ k.transpose(-1, -2)).softmax(-1)
        y = (k1 @ self.pinv(k2)) @ (k3 @ v) + self.conv(v)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


class NystromTagger(nn.Module):
    def __init__(self, vocab=9, d=32, n=32, layers=2, heads=2):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(n, d) * 0.02)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(n1=nn.LayerNorm(d), attn=NystromAttn(d, heads),
                                                       n2=nn.LayerNorm(d), ff=nn.Sequential(
                                                           nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))))
                                    for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab - 1)

    def forward(self, t):
        x = self.emb(t) + self.pos
        for L in self.layers:
            x = x + L.attn(L.n1(x))
            x = x + L.ff(L.n2(x))
        return self.head(self.norm(x))


@case(60)
def nystromformer_denoise_bf16():
    torch.manual_seed(26)
    model = NystromTagger()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step(i):
        g = gen(26_000_000 + i)
        motif = torch.randint(0, 8, (16, 4), generator=g)
        clean = motif.repeat(1, 8)                               # a period-4 motif over 32 positions
        noisy = torch.where(torch.rand(16, 32, generator=g) < 0.25, 8, clean)   # 25% blanked (token 8)
        with torch.autocast("cpu", dtype=BF16):
            logits = model(noisy)
        loss = F.cross_entropy(logits.float().reshape(-1, 8), clean.reshape(-1))
        amp_update(model, opt, scaler, loss)
        return loss.item()
    return HealthyLoop(model, opt, scaler, step)


# ---------------------------------------------------------------------------------------------------- the runs
def run(name, mode=None, run_dir=None):
    """The case's loop for CASES[name].steps iterations: unwatched (mode None) or watched with MODES[mode]."""
    cs = CASES[name]
    return healthy_run(cs.build(), cs.steps, None if mode is None else MODES[mode], run_dir)


@functools.lru_cache(maxsize=None)
def unwatched(name):
    return run(name)


@pytest.mark.parametrize("name,mode", [pytest.param(n, m, marks=wrong(XFAIL[n, m]) if (n, m) in XFAIL else ())
                                       for n in CASES for m in MODES])
def test_healthy39(name, mode, tmp_path):
    ru = unwatched(name)
    if DEBUG:
        ls = ru.losses
        print(name, "skipped", ru.skipped, "loss", [round(v, 4) for v in ls[::max(1, len(ls) // 8)]], ls[-1])
    trained_healthily(ru, CASES[name].fall)
    rw = run(name, mode, tmp_path / "run")
    if DEBUG:
        print(name, mode, lines(rw.rep))
    same_run(rw, ru)
    quiet_healthy(rw)
