"""Thirty-eighth set: FAILURES IN THE BUILDING BLOCKS OF 2024-2026 TRAINING CODE. Ten fp16 failures that start
mid-run at a known step (5-12: never a sampled step; full statistics are taken on step 0 and every 200th), in a
Mamba-2 SSD mixer, an xLSTM mLSTM layer, BitNet b1.58's BitLinear, a fused SwiGLU autograd.Function, a JiT-style
x-prediction denoiser with a v-loss, offline distillation from cached top-k teacher log-probs, GRPO's
group-normalised advantage, DPO's summed sequence log-probs, a top-2 MoE's load-balancing loss and a blockwise
(online-softmax) attention.
Watched through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")`
at the default settings -> an ordinary CPU fp16 autocast + `torch.amp.GradScaler("cpu")` loop: scale(loss).backward
-> unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`), ampdoctor's RuntimeWarnings recorded.

Each failure is proven first by the test's own oracle (probe_harness.Producer with keyword inputs: the first module
whose output is non-finite while its inputs, keyword inputs and own parameters were finite, at the expected step;
for 4 its backward hooks: the first module whose input gradient is non-finite while its output gradient was
finite), plus the loss (first non-finite there; for 4 every loss finite) and the scaler (skips it; before it only
the first steps' backoffs, 0-2), plus a float32 check (a fresh model runs the bad batch in float32 throughout, no
autocast: finite; for 4 its gradients too). Only then must the rule (`overflow`/`nan_origin`; 7 also
`eps_underflow`, 10 also `mask_value_overflow`) be among the report's first three findings at the PRODUCER, at that
step, in that phase, error (and no error at the modules that only passed it on); a wrong report raises WrongAnswer
naming ampdoctor's top three (a failing oracle or a crash fails otherwise). On the CPU autocast keeps
exp/cumsum/softmax/log_softmax/sum/std in the input's dtype: every producer below computes in fp16 inside the
module's own code (not a Linear's cast).

 1. Mamba-2's SSD mixer in its quadratic (dual) form, ported with the scan in the activations' dtype and a
    hand-written segsum that takes exp(cs_i - cs_j) first and zeroes the upper triangle after (`* causal`;
    ssd_minimal masks with -inf before the exp): a context-length warmup from 8 x 16 to 2 x 64 tokens at step 8
    makes the upper triangle's exp(sum |A dt|) pass 65504 (input up to 27.4), inf * 0 = NaN -> `layers.0.mixer`,
    step 8 (and every step after).
 2. xLSTM's mLSTM in its parallel form without the stabiliser (no row max m subtracted before exp(log D)): a
    forecaster on standardised sensor windows; at step 6 four series' channel 0 arrive in raw deci-units (x 10 + 40)
    -> input-gate pre-activations up to ~14 > 11.09 -> exp overflows, C v / n = NaN -> `mlstm`, step 6.
 3. BitNet b1.58's BitLinear (RMS-normalised input, per-token absmax activations 127 / max|x| clamped at 1e-5,
    ternary weights, straight-through): a padded row (padding_idx 0 -> zeros) reaches the second BitLinear in fp16,
    127 / 1e-5 = 1.27e7 = inf, 0 * inf = NaN. Packed batches until step 9, then a source of short documents padded
    to the longest -> `down`, step 9 (the first BitLinear sees the embedding's fp32 rows: finite).
 4. a fused SwiGLU torch.autograd.Function (Liger-style: forward F.silu(a) * b, saving a and b) whose backward
    recomputes the sigmoid written out as exp(a) / (1 + exp(a)): a tabular classifier on standardised heavy-tailed
    features; at step 11 one account's volume is 40 sigma (finite, real) -> pre-activations > 11.09, inf / inf =
    NaN in the BACKWARD only -> `mlp.act`, step 11, backward.
 5. JiT-style x-prediction with a v-loss: v = (x_pred - z_t) / (1 - t) with 1 - t clamped at 1e-5 (JiT: 0.05), in
    the net's dtype, t drawn from the Euler sampler's 20-point grid linspace(0, 1, 20) whose endpoint t = 1 is
    first drawn at step 6 (again at 8 and 13): (x_pred - x) / 1e-5 passes 65504 -> overflow at the root `` (the
    denoiser's own forward), step 6. Two runs: to step 8 (t = 1 twice) and on to step 13 (three times).
 6. offline distillation from a cache of top-8 teacher log-probs (stored fp16), renormalised over the cached
    entries as exp(log p) / sum exp(log p): the shard of step 10 was cached as raw logits (an LLM-like offset of
    ~14, up to 23.2) -> exp overflows, inf / inf = NaN -> `kd`, step 10.
 7. GRPO's advantage (r - mean) / (std + 1e-8) over groups of 8 completions, the 0/1 verifier rewards cast to the
    log-probs' dtype: the 1e-8 is 0 in fp16; at step 12 the first prompt whose 8 completions are all correct ->
    0 / 0 = NaN -> `adv`, step 12 (eps_underflow or nan_origin).
 8. DPO (policy + frozen reference, chosen and rejected concatenated) with the sequence log-prob summed in fp16
    (TRL's concatenated_forward without its fp32 upcast): responses of 256-1023 tokens (sums down to ~ -3000);
    at step 7 one rejected response is a runaway generation cut at max_new_tokens = 24576 (fp32 sum -89497) ->
    -inf, then -inf - (-inf) = NaN -> `seq_logp` (its first call, the policy's), step 7.
 9. a top-2 MoE whose Switch/GShard load-balancing loss counts the tokens per expert in the router probabilities'
    dtype (`one_hot(idx).to(probs.dtype).sum()`): the batch-size ramp-up goes from 16k rows to 160k at step 10
    (63k-99k routings per expert) -> +inf -> `router`, step 10.
10. blockwise (ring/flash-style online-softmax) attention over KV blocks of 16, the key-padding bias -1e9 made in
    the scores' dtype (-inf in fp16): with right padding a fully padded block is only ever a last one (exp(-inf - m)
    = 0); from step 5 the batches come from a rollout buffer that pads on the left, a sequence of 32 tokens or
    fewer starts with a fully padded block, m = -inf and exp(-inf - (-inf)) = NaN -> `attn`, step 5
    (mask_value_overflow or nan_origin). In float32 the -1e9 block is wiped by the next block's correction.
Twins (the config fixed; no warning, no error, no RuntimeWarning, the loss down by 10%): 1 with ssd_minimal's
segsum (masked with -inf before the exp); 3 with the activation quantisation in float32; 10 with a -1e4 bias.
Not built: Gemma-2-style attention logit soft-capping (tanh(inf) = 1 absorbs an fp16 q.k overflow in the forward:
no forward inf/NaN at a known producer); RoPE with fp16 positions, gated-unit products, a learned InfoNCE
temperature and a router z-loss (test_unseen_variants27/32, 25/27/31, 29/25 and 5 build them); a learned
positional table with a huge row (the embedding output stays fp32 under CPU autocast and the LayerNorm after it
normalises it in fp32: no fp16 op sees the row).

What ampdoctor says (on 39af6a7; the same on db7839c): ten of ten right at the producer, its step and phase among
the first three findings, an error (1 overflow aten::exp; 2 nan_origin aten::bmm; 3 overflow aten::reciprocal;
4 overflow backward aten::exp; 5 overflow aten::div; 6 overflow aten::exp; 7 eps_underflow aten::add + nan_origin
aten::div; 8 overflow aten::sum; 9 overflow aten::sum; 10 mask_value_overflow aten::_to_copy), the three twins
quiet, no RuntimeWarning. Wrong at first (a strict xfail here, fixed since):
- 5 when the run goes on to step 13 (t = 1 a third time; the same loop, five more steps): step 6 was gone. The top
  three: `[error] overflow at (root) aten::div step 1` (phase backward, from the replay of captures/1: the
  ordinary backoffs of steps 1-2 at loss scale 65536/32768 made an error), `[error] overflow at (root) step 8`
  (forward, from the records), `[error] skipped_steps at (root) step 6`. The three forward failures' skips were
  counted as later backoffs (5 after the first applied update: no longer rare), so the backoffs of steps 1-2 were
  judged no search; rules/backoff.benign_backoff no longer counts a skip whose forward went non-finite. Its message
  also wrote the root as `` (now `(root)`).
Noticed: in 2 the op named is aten::bmm (the NaN maker) while the first inf came from aten::exp (its input held
the mask's -inf: not asserted); its message said "the model's outputs stayed finite: its inf/NaN reached the loss
another way" although the step's record has output_finite false (4 NaN outputs): now said only where the
outputs were finite (asserted).

Run: .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_unseen_variants38.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import (Producer, WrongAnswer, at_top3, finite, probe_run, quiet_twin,
                           real_fwd_after_backoffs as real_fwd)
from scenarios import lines, no_error_at, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def gen(i):
    return torch.Generator().manual_seed(i)


def run(m, batch, loss_fn, steps, run_dir, *, lr=1e-3, backward=False):
    """probe_harness.probe_run (the user's loop at the default settings) with a Producer on keyword inputs as the
    oracle (`backward`: its backward hooks too); `batch(i)` gives (args, kwargs, y)."""
    return probe_run(m, batch, loss_fn, steps, run_dir, lr=lr,
                     oracle=lambda m: Producer(m, backward=backward, with_kwargs=True))


def real_bwd(r, name, step):
    """The backward failure is real: every forward and loss finite, the oracle's first backward producer `name` at
    `step`, the scaler skips it (before it only the first steps' ordinary backoffs, steps 0-2)."""
    assert r["first"] is None and r["bad_loss"] == [], r
    assert r["first_bwd"] == (name, step), r
    assert step in r["skipped"] and all(s < 3 for s in r["skipped"] if s < step), r


def fp32_finite(make, batch, step, loss_fn=None):
    """The bad batch is an fp16 failure: a fresh model (seed 0) runs it in float32 throughout (no autocast, its
    floating inputs as float32) to a finite output (with `loss_fn`: a finite loss and finite gradients too)."""
    torch.manual_seed(0)
    m = make()
    args, kwargs, y = batch(step)
    args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    out = m(*args, **kwargs)
    assert finite(out), step
    if loss_fn is not None:
        loss = loss_fn(out, y)
        loss.backward()
        assert math.isfinite(loss.item()) and all(finite(p.grad) for p in m.parameters() if p.grad is not None)


def named(r, rule, module, step, phase="forward", quiet_at=()):
    """The report check: `rule` at the producer, at its step, in `phase`, error, among the first three findings (and
    no error at the modules that only passed it on). A failure is a WrongAnswer naming ampdoctor's top three and
    the RuntimeWarnings it gave."""
    rep = r["rep"]
    try:
        at_top3(rep, rule, module, step=step, phase=phase, severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={lines(rep)[:3]} warnings={r['warns']} ({e})") from None
    assert not [s for s in r["warns"] if "could not write a capture" in s or "replay" in s], r["warns"]


def quiet(r):
    """A twin: healthy (the loss down by 10% at least) and ampdoctor quiet (probe_harness.quiet_twin)."""
    quiet_twin(r, fall=0.9)


def own_loss(out, y):
    return out


def ce(out, y):
    return F.cross_entropy(out.float(), y)


FWD = ("overflow", "nan_origin")


def markov_tokens(i, b, t, vocab=32):
    """A learnable token stream: next = (3 * tok + 7) % vocab nine times in ten, else a random token."""
    g = gen(1000 + i)
    ids = torch.empty(b, t, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (b,), generator=g)
    noise = torch.randint(0, vocab, (b, t), generator=g)
    keep = torch.rand(b, t, generator=g) < 0.9
    for j in range(1, t):
        ids[:, j] = torch.where(keep[:, j], (3 * ids[:, j - 1] + 7) % vocab, noise[:, j])
    return ids


# ======================================================================================================================
# 1 + twin. Mamba-2's SSD mixer (quadratic dual form) with a hand-written segsum: exp first, the causal mask after
# ======================================================================================================================
class SSDMixer(nn.Module):
    def __init__(self, d=16, n=8, heads=4, mask_first=False):
        super().__init__()
        self.d, self.n, self.h, self.p, self.mask_first = d, n, heads, d // heads, mask_first
        self.in_proj = nn.Linear(d, 2 * d + 2 * n + heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 4.0, heads)))
        self.dt_bias = nn.Parameter(torch.full((heads,), math.log(math.expm1(0.1))))     # dt = 0.1 at init
        self.D = nn.Parameter(torch.ones(heads))
        self.out_proj = nn.Linear(d, d, bias=False)

    def segsum(self, a):
        """[..., i, j] = sum_{j < s <= i} a_s (causal part); exp'd and masked to the lower triangle."""
        T = a.shape[-1]
        cs = a.cumsum(-1)
        seg = cs[..., :, None] - cs[..., None, :]
        causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
        if self.mask_first:                               # ssd_minimal: mask with -inf, then exp
            return torch.exp(seg.masked_fill(~causal, float("-inf")))
        return torch.exp(seg) * causal                    # the port: exp, then zero the upper triangle

    def forward(self, u):
        b, t, _ = u.shape
        z, x, B, C, dt = self.in_proj(u).split([self.d, self.d, self.n, self.n, self.h], -1)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))                    # (b, t, h)
        A = -torch.exp(self.A_log).to(dt.dtype)                            # the scan kept in the activations' dtype
        L = self.segsum((dt * A).transpose(1, 2))                          # (b, h, t, t)
        x = x.reshape(b, t, self.h, self.p)
        y = torch.einsum("bin,bjn,bhij,bjhp->bihp", C, B, L, x * dt[..., None])
        y = y + x * self.D.to(x.dtype)[:, None]
        return self.out_proj(y.reshape(b, t, self.d) * F.silu(z))


class Mamba2LM(nn.Module):
    def __init__(self, vocab=32, d=16, layers=2, mask_first=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.RMSNorm(d), "mixer": SSDMixer(d, mask_first=mask_first)})
                                    for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.layers:
            h = h + blk["mixer"](blk["norm"](h))
        return self.head(self.norm(h))


LONG_AT = 8


def ssd_batch(i):
    """Context-length warmup: 8 x 16 tokens, from step LONG_AT 2 x 64 (the same tokens per step)."""
    ids = markov_tokens(i, 2, 65) if i >= LONG_AT else markov_tokens(i, 8, 17)
    return (ids[:, :-1],), {}, ids[:, 1:]


def lm_loss(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def test_mamba2_ssd_segsum_exp_before_mask_overflows_at_the_context_warmup(tmp_path):
    torch.manual_seed(0)
    r = run(Mamba2LM(), ssd_batch, lm_loss, LONG_AT + 3, tmp_path / "run", lr=3e-3)
    real_fwd(r, "layers.0.mixer", LONG_AT)
    fp32_finite(Mamba2LM, ssd_batch, LONG_AT)
    named(r, FWD, "layers.0.mixer", LONG_AT, quiet_at=("layers.0.mixer.in_proj", "layers.0.mixer.out_proj",
                                                       "layers.1.mixer", "head", ""))


def test_twin_mamba2_ssd_segsum_masked_before_exp_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(Mamba2LM(mask_first=True), ssd_batch, lm_loss, LONG_AT + 4, tmp_path / "run", lr=3e-3))


# ======================================================================================================================
# 2. xLSTM's mLSTM in its parallel form without the stabiliser (a forecaster on standardised sensor windows)
# ======================================================================================================================
class MLSTM(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.h, self.p = heads, d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.igate, self.fgate = nn.Linear(d, heads), nn.Linear(d, heads)
        with torch.no_grad():
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, heads))          # xLSTM's forget-gate bias init
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.h, self.p).transpose(1, 2) for f in (self.q, self.k, self.v))
        i = self.igate(x).transpose(1, 2)                                   # (b, h, t) input-gate pre-activations
        cf = F.logsigmoid(self.fgate(x)).transpose(1, 2).cumsum(-1)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        logd = (cf[..., :, None] - cf[..., None, :] + i[..., None, :]).masked_fill(~causal, float("-inf"))
        dmat = torch.exp(logd)                      # xLSTM subtracts the row max m first (the stabiliser): not here
        c = (q @ k.transpose(-1, -2)) / math.sqrt(self.p) * dmat
        n = c.sum(-1, keepdim=True).abs().clamp_min(1.0)                    # max(|sum_j C_ij|, exp(-m)), m = 0
        return self.out(((c @ v) / n).transpose(1, 2).reshape(b, t, d))


class XLSTMForecaster(nn.Module):
    def __init__(self, feats=6, d=16):
        super().__init__()
        self.inp = nn.Linear(feats, d)
        self.mlstm = MLSTM(d)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(d, 1))

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.mlstm(h))[:, -1, 0]


W6 = randn(6, seed=11)
DECI_AT = 6


def sensor_batch(i):
    """Standardised 24-step windows of 6 sensors; at DECI_AT one station's channel 0 comes in raw deci-units (x 10)."""
    x = randn(16, 24, 6, seed=200 + i)
    y = (x[:, -4:] @ W6).mean(-1).tanh()
    if i == DECI_AT:
        x[:4, :, 0] = x[:4, :, 0] * 10 + 40
    return (x,), {}, y


def mse(out, y):
    return F.mse_loss(out.float(), y)


def test_mlstm_without_stabiliser_input_gate_exp_overflows(tmp_path):
    torch.manual_seed(0)
    r = run(XLSTMForecaster(), sensor_batch, mse, DECI_AT + 3, tmp_path / "run")
    real_fwd(r, "mlstm", DECI_AT)
    fp32_finite(XLSTMForecaster, sensor_batch, DECI_AT)
    named(r, FWD, "mlstm", DECI_AT, quiet_at=("inp", "mlstm.igate", "mlstm.out", "head.1", ""))
    f = next(f for f in r["rep"].findings if f.module == "mlstm" and f.step == DECI_AT)
    # (the step's outputs were NaN: the message must not say they stayed finite)
    assert "outputs stayed finite" not in f.message, f.message


# ======================================================================================================================
# 3 + twin. BitNet b1.58's BitLinear: per-token absmax activation quantisation in the activations' dtype
# ======================================================================================================================
class BitLinear(nn.Linear):
    """BitNet b1.58 (the training recipe's BitLinear): RMS-normalised input, per-token 8-bit absmax activations
    127 / max|x| (clamped at 1e-5), ternary absmean weights, straight-through estimators."""

    def __init__(self, d_in, d_out, quant_fp32=False):
        super().__init__(d_in, d_out, bias=False)
        self.quant_fp32 = quant_fp32

    def forward(self, x):
        dt = x.dtype
        if self.quant_fp32:
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        s = 127.0 / x.abs().amax(-1, keepdim=True).clamp(min=1e-5)
        x = x + ((x * s).round().clamp(-128, 127) / s - x).detach()
        ws = 1.0 / self.weight.abs().mean().clamp(min=1e-5)
        w = self.weight + ((self.weight * ws).round().clamp(-1, 1) / ws - self.weight).detach()
        return F.linear(x.to(dt), w)


class BitClassifier(nn.Module):
    def __init__(self, vocab=40, d=32, classes=3, quant_fp32=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.up = BitLinear(d, 4 * d, quant_fp32)
        self.down = BitLinear(4 * d, d, quant_fp32)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        e = self.emb(ids)
        h = e + self.down(F.relu(self.up(e)).square())              # squared ReLU FFN (BitNet b1.58 2B4T)
        mask = (ids != 0).unsqueeze(-1)
        return self.head((h * mask).sum(1) / mask.sum(1))


PAD_AT = 9


def bit_batch(i):
    """Packed 12-token segments; from PAD_AT a new source of short documents, padded to the longest (id 0)."""
    g = gen(300 + i)
    ids = torch.randint(1, 40, (16, 12), generator=g)
    if i >= PAD_AT:
        lens = torch.randint(4, 13, (16,), generator=g)
        lens[0] = 12
        ids = ids.masked_fill(torch.arange(12)[None] >= lens[:, None], 0)
    y = ((ids % 3 == 0).sum(1) - (ids % 3 == 1).sum(1)).sign() + 1
    return (ids,), {}, y


def test_bitnet_activation_quant_scale_overflows_on_the_first_padded_batch(tmp_path):
    torch.manual_seed(0)
    r = run(BitClassifier(), bit_batch, ce, PAD_AT + 3, tmp_path / "run", lr=3e-3)
    real_fwd(r, "down", PAD_AT)
    fp32_finite(BitClassifier, bit_batch, PAD_AT)
    named(r, FWD, "down", PAD_AT, quiet_at=("up", "head", ""))


def test_twin_bitnet_activation_quant_in_fp32_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(BitClassifier(quant_fp32=True), bit_batch, ce, PAD_AT + 4, tmp_path / "run", lr=3e-3))


# ======================================================================================================================
# 4. a fused SwiGLU autograd.Function whose backward recomputes the sigmoid as exp(a) / (1 + exp(a))
# ======================================================================================================================
class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        e = torch.exp(a)
        sig = e / (1 + e)                                     # recomputed, written out
        return g * b * sig * (1 + a * (1 - sig)), g * a * sig


class FusedSwiGLU(nn.Module):
    def forward(self, a, b):
        return SwiGLUFn.apply(a, b)


class SwiGLUMLP(nn.Module):
    def __init__(self, d_in, hidden):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d_in, hidden), nn.Linear(d_in, hidden), nn.Linear(hidden, d_in)
        self.act = FusedSwiGLU()

    def forward(self, x):
        return self.w2(self.act(self.w1(x), self.w3(x)))


class TabularSwiGLU(nn.Module):
    def __init__(self, feats=8, classes=3):
        super().__init__()
        self.mlp = SwiGLUMLP(feats, 32)
        self.head = nn.Linear(feats, classes)

    def forward(self, x):
        return self.head(x + self.mlp(x))


W8 = randn(8, seed=5)
HEAVY_AT = 11


def heavy_batch(i):
    """Standardised heavy-tailed account features; at HEAVY_AT one account's volume is 40 sigma (finite, real)."""
    x = randn(64, 8, seed=400 + i)
    y = (x @ W8 > 0.5).long() + (x @ W8 > -0.5).long()
    if i == HEAVY_AT:
        x[3, 2] = 40.0
    return (x,), {}, y


def test_fused_swiglu_backward_naive_sigmoid_nan(tmp_path):
    torch.manual_seed(0)
    r = run(TabularSwiGLU(), heavy_batch, ce, HEAVY_AT + 3, tmp_path / "run", backward=True)
    real_bwd(r, "mlp.act", HEAVY_AT)
    fp32_finite(TabularSwiGLU, heavy_batch, HEAVY_AT, ce)
    named(r, FWD, "mlp.act", HEAVY_AT, phase="backward", quiet_at=("mlp.w1", "mlp.w3", "mlp.w2", "head", ""))


# ======================================================================================================================
# 5. JiT-style x-prediction with a v-loss: v = (x_pred - z) / (1 - t), the division "guarded" by 1e-5, in fp16
# ======================================================================================================================
class XPredDenoiser(nn.Module):
    """The denoiser predicts the clean sample; the loss is on the velocity v = (x - z_t) / (1 - t) (z_t = t x +
    (1 - t) e, t = 1 clean). JiT clamps 1 - t at 0.05; this port only guards the division, with 1e-5, in the net's
    dtype."""

    def __init__(self, d=16, clamp=1e-5):
        super().__init__()
        self.clamp = clamp
        self.register_buffer("freqs", torch.exp(torch.linspace(0.0, math.log(100.0), 8)))
        self.net = nn.Sequential(nn.Linear(d + 16, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, d))

    def forward(self, x, e, t):
        tt = t[:, None]
        z = tt * x + (1 - tt) * e
        ang = tt * self.freqs
        x_pred = self.net(torch.cat([z, ang.sin(), ang.cos()], -1))
        z, tt = z.to(x_pred.dtype), tt.to(x_pred.dtype)
        return (x_pred - z) / (1 - tt).clamp_min(self.clamp)


CENTRES = randn(4, 16, seed=21) * 0.5
T_GRID = torch.linspace(0, 1, 20)                 # the Euler sampler's 20-point grid, shared with training
T1_AT = 6


def flow_batch(i):
    """8 samples near 4 centres; t drawn from T_GRID, whose endpoint t = 1 (the clean sample) is first drawn at step
    T1_AT (the generator's seed 590 + step)."""
    g = gen(590 + i)
    t = T_GRID[torch.randint(0, 20, (8,), generator=g)]
    x = CENTRES[torch.randint(0, 4, (8,), generator=g)] + 0.1 * torch.randn(8, 16, generator=g)
    e = torch.randn(8, 16, generator=g)
    return (x, e, t), {}, x - e


def vloss(out, v):
    return F.mse_loss(out.float(), v)


def jit_run(tmp_path, steps):
    torch.manual_seed(0)
    r = run(XPredDenoiser(), flow_batch, vloss, steps, tmp_path / "run", lr=3e-3)
    real_fwd(r, "", T1_AT)
    assert r["bad_loss"] == [i for i in range(steps) if bool((flow_batch(i)[0][2] == 1).any())], r
    fp32_finite(XPredDenoiser, flow_batch, T1_AT)
    return r


def test_jit_xpred_vloss_division_by_one_minus_t_overflows_at_t_equal_1(tmp_path):
    r = jit_run(tmp_path, T1_AT + 3)                          # t = 1 drawn at steps 6 and 8
    named(r, FWD, "", T1_AT, quiet_at=("net.0", "net.2", "net.4"))


def test_jit_xpred_vloss_t_equal_1_three_times_still_names_step_6(tmp_path):
    r = jit_run(tmp_path, T1_AT + 8)                          # t = 1 drawn at steps 6, 8 and 13
    named(r, FWD, "", T1_AT, quiet_at=("net.0", "net.2", "net.4"))
    # the ordinary backoffs of steps 1-2 stay info; the root is written `(root)` in the messages
    assert not [f for f in r["rep"].findings if f.step in (1, 2) and f.severity != "info"], lines(r["rep"])
    assert not [f for f in r["rep"].findings if "``" in f.message], lines(r["rep"])


# ======================================================================================================================
# 6. offline distillation from cached top-k teacher log-probs (fp16 cache); one shard cached raw logits
# ======================================================================================================================
class CachedTopKKD(nn.Module):
    """Cross-entropy to the teacher's top-k, renormalised over the k cached entries: exp(log p) / sum exp(log p)."""

    def forward(self, logits, t_vals, t_idx):
        p = torch.exp(t_vals)
        p = p / p.sum(-1, keepdim=True)
        logq = torch.log_softmax(logits, -1).gather(-1, t_idx)
        return -(p * logq).sum(-1).mean()


class Student(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.head = nn.Linear(d, vocab)
        self.kd = CachedTopKKD()

    def forward(self, ids, t_vals, t_idx):
        h = self.emb(ids)
        return self.kd(self.head(h + self.mlp(h)), t_vals, t_idx)


TEACHER = randn(64, 64, seed=31) * 2.5 + 14.0       # a teacher's raw logits per input token (LLM-like: offset ~14)
RAW_AT = 10


def kd_batch(i):
    """The cache: top-8 teacher log-probs in fp16 and their ids; the shard of step RAW_AT holds the raw logits."""
    ids = torch.randint(0, 64, (16, 24), generator=gen(600 + i))
    logits = TEACHER[ids]
    vals, idx = (logits if i == RAW_AT else logits.log_softmax(-1)).topk(8, -1)
    return (ids, vals.half(), idx), {}, None


def test_cached_topk_kd_raw_logits_shard_overflows_the_kd_exp(tmp_path):
    torch.manual_seed(0)
    r = run(Student(), kd_batch, own_loss, RAW_AT + 3, tmp_path / "run", lr=3e-3)
    real_fwd(r, "kd", RAW_AT)
    fp32_finite(Student, kd_batch, RAW_AT)
    assert bool(torch.isfinite(kd_batch(RAW_AT)[0][1]).all())               # the cached values are finite in fp16
    named(r, FWD, "kd", RAW_AT, quiet_at=("head", "mlp.2", ""))


# ======================================================================================================================
# 7. GRPO's group-normalised advantage (r - mean) / (std + 1e-8) in the log-probs' dtype
# ======================================================================================================================
class GroupAdvantage(nn.Module):
    def __init__(self, group=8, eps=1e-8):
        super().__init__()
        self.group, self.eps = group, eps

    def forward(self, r):
        r = r.view(-1, self.group)
        return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + self.eps)).flatten()


class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.mlp(h))


class GRPOPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = TinyLM()
        self.adv = GroupAdvantage()

    def forward(self, ids, comp_mask, rewards):
        logp = torch.log_softmax(self.lm(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = comp_mask[:, 1:]
        seq = logp.masked_fill(~m, 0).sum(-1) / m.sum(-1)                 # token-mean log-prob of the completion
        adv = self.adv(rewards.to(logp.dtype))                             # no upcast needed for the product
        return -(torch.exp(seq - seq.detach()) * adv).mean()


ALLOK_AT = 12


def grpo_batch(i):
    """4 prompts x 8 sampled completions, 0/1 verifier rewards; every group mixed, until step ALLOK_AT, whose first
    prompt is easy: all 8 completions are correct."""
    g = gen(700 + i)
    ids = torch.randint(0, 32, (32, 20), generator=g)
    comp = torch.arange(20)[None].expand(32, 20) >= 6
    r = (torch.rand(32, generator=g) < 0.5).float().view(4, 8)
    r[:, 0], r[:, 1] = 1.0, 0.0
    if i == ALLOK_AT:
        r[0] = 1.0
    return (ids, comp, r.flatten()), {}, None


def test_grpo_advantage_eps_1e8_all_correct_group_nan(tmp_path):
    torch.manual_seed(0)
    r = run(GRPOPolicy(), grpo_batch, own_loss, ALLOK_AT + 3, tmp_path / "run")
    real_fwd(r, "adv", ALLOK_AT)
    fp32_finite(GRPOPolicy, grpo_batch, ALLOK_AT)
    named(r, FWD + ("eps_underflow",), "adv", ALLOK_AT, quiet_at=("lm.head", ""))


# ======================================================================================================================
# 8. DPO with summed sequence log-probs in fp16 (policy and frozen reference; chosen and rejected concatenated)
# ======================================================================================================================
class SeqLogProb(nn.Module):
    """sum_t log p(y_t | y_<t) over the response tokens (TRL's concatenated_forward, without its fp32 upcast)."""

    def forward(self, logits, labels, mask):
        logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
        return logp.masked_fill(~mask, 0).sum(-1)


class DPOModel(nn.Module):
    def __init__(self, beta=0.1):
        super().__init__()
        self.beta = beta
        self.policy = TinyLM()
        self.ref = TinyLM()
        self.ref.load_state_dict(self.policy.state_dict())
        self.ref.requires_grad_(False)
        self.seq_logp = SeqLogProb()

    def forward(self, ids, mask):
        x, y, m = ids[:, :-1], ids[:, 1:], mask[:, 1:]
        pol = self.seq_logp(self.policy(x), y, m)
        with torch.no_grad():
            ref = self.seq_logp(self.ref(x), y, m)
        n = ids.shape[0] // 2
        margin = (pol[:n] - ref[:n]) - (pol[n:] - ref[n:])
        return -F.logsigmoid(self.beta * margin).mean()


RUNAWAY_AT = 7


def dpo_batch(i):
    """2 preference pairs of 32-token prompts + responses (chosen: Markov text; rejected: random tokens) of up to 1024
    tokens; at RUNAWAY_AT one rejected response is a runaway generation cut at max_new_tokens = 24576."""
    g = gen(800 + i)
    lens = torch.randint(256, 1024, (4,), generator=g)
    if i == RUNAWAY_AT:
        lens[2] = 24576
    T = 32 + int(lens.max())
    chosen = markov_tokens(i, 2, T)
    rejected = torch.randint(0, 32, (2, T), generator=g)
    ids = torch.cat([chosen, rejected])
    pos = torch.arange(T)[None]
    mask = (pos >= 32) & (pos < 32 + lens[:, None])
    return (ids, mask), {}, None


def test_dpo_summed_logps_of_a_runaway_rejected_response_overflow(tmp_path):
    torch.manual_seed(0)
    r = run(DPOModel(), dpo_batch, own_loss, RUNAWAY_AT + 3, tmp_path / "run", lr=3e-3)
    real_fwd(r, "seq_logp", RUNAWAY_AT)
    fp32_finite(DPOModel, dpo_batch, RUNAWAY_AT)
    named(r, FWD, "seq_logp", RUNAWAY_AT, quiet_at=("policy.head", "ref.head", ""))


# ======================================================================================================================
# 9. a top-2 MoE's load-balancing loss with the token counts in the router probabilities' dtype; batch-size ramp-up
# ======================================================================================================================
class Top2Router(nn.Module):
    def __init__(self, d, experts=4):
        super().__init__()
        self.e = experts
        self.gate = nn.Linear(d, experts, bias=False)

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        w, idx = probs.topk(2, -1)
        counts = F.one_hot(idx, self.e).to(probs.dtype).sum((0, 1))        # tokens routed to each expert
        aux = self.e * (counts / idx.numel() * probs.mean(0)).sum()       # Switch/GShard load balancing
        return w / w.sum(-1, keepdim=True), idx, aux


class MoERegressor(nn.Module):
    def __init__(self, feats=8, d=16, experts=4):
        super().__init__()
        self.inp = nn.Linear(feats, d)
        self.router = Top2Router(d, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
                                     for _ in range(experts))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        w, idx, aux = self.router(h)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            out = out.index_add(0, tok, (w[tok, slot, None] * expert(h[tok])).to(out.dtype))
        return self.head(h + out).squeeze(-1), aux


RAMP_AT = 10


def moe_batch(i):
    """Rows of 8 standardised features; the batch-size ramp-up goes from 16k rows to 160k at step RAMP_AT."""
    n = 160_000 if i >= RAMP_AT else 16_000
    x = randn(n, 8, seed=900 + i)
    return (x,), {}, (x @ W8).tanh()


def moe_loss(out, y):
    return F.mse_loss(out[0].float(), y) + 0.01 * out[1].float()


def test_moe_load_balancing_counts_overflow_at_the_batch_ramp(tmp_path):
    torch.manual_seed(0)
    r = run(MoERegressor(), moe_batch, moe_loss, RAMP_AT + 2, tmp_path / "run", lr=3e-3)
    real_fwd(r, "router", RAMP_AT)
    fp32_finite(MoERegressor, moe_batch, RAMP_AT)
    named(r, FWD, "router", RAMP_AT, quiet_at=("router.gate", "head", ""))


# ======================================================================================================================
# 10 + twin. blockwise (online-softmax) attention over KV blocks with a -1e9 padding bias in the scores' dtype
# ======================================================================================================================
class BlockwiseAttention(nn.Module):
    """Memory-efficient attention in PyTorch (ring/flash style): KV blocks of 16, running max m, normaliser l and
    accumulator; the key-padding bias made in the scores' dtype."""

    def __init__(self, d=32, heads=2, block=16, mask_value=-1e9):
        super().__init__()
        self.h, self.p, self.block, self.mask_value = heads, d // heads, block, mask_value
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.p).permute(2, 0, 3, 1, 4)
        bias = ((~keep).float() * self.mask_value).to(q.dtype)[:, None, None, :]
        m = torch.full((b, self.h, t, 1), float("-inf"), dtype=q.dtype)
        l = torch.zeros(b, self.h, t, 1, dtype=q.dtype)
        acc = torch.zeros_like(q)
        for s in range(0, t, self.block):
            sc = q @ k[..., s:s + self.block, :].transpose(-1, -2) / math.sqrt(self.p) + bias[..., s:s + self.block]
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            p = torch.exp(sc - m_new)
            corr = torch.exp(m - m_new)
            l = l * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v[..., s:s + self.block, :]
            m = m_new
        return self.out((acc / l).transpose(1, 2).reshape(b, t, d))


class ReviewScorer(nn.Module):
    def __init__(self, vocab=50, d=32, mask_value=-1e9):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = BlockwiseAttention(d, mask_value=mask_value)
        self.head = nn.Linear(d, 1)

    def forward(self, ids, keep):
        h = self.emb(ids)
        h = h + self.attn(h, keep)
        km = keep.unsqueeze(-1)
        return self.head((h * km).sum(1) / km.sum(1)).squeeze(-1)


LEFT_AT = 5


def review_batch(i):
    """8 sequences of 48 tokens, padded to the right; from LEFT_AT the batches come from the rollout buffer, which
    pads on the left (as generation does): a sequence of fewer than 33 tokens leaves its first KV block all padding."""
    g = gen(1100 + i)
    ids = torch.randint(1, 50, (8, 48), generator=g)
    lens = torch.randint(12, 49, (8,), generator=g)
    lens[0] = 20
    pos = torch.arange(48)[None]
    keep = pos >= 48 - lens[:, None] if i >= LEFT_AT else pos < lens[:, None]
    ids = ids.masked_fill(~keep, 0)
    y = (ids % 5 == 0).sum(1).float() / lens - 0.2
    return (ids, keep), {}, y


def test_blockwise_attention_minus_1e9_bias_left_padding_nan(tmp_path):
    torch.manual_seed(0)
    r = run(ReviewScorer(), review_batch, mse, LEFT_AT + 3, tmp_path / "run", lr=1e-3)
    real_fwd(r, "attn", LEFT_AT)
    fp32_finite(ReviewScorer, review_batch, LEFT_AT)
    named(r, FWD + ("mask_value_overflow",), "attn", LEFT_AT, quiet_at=("attn.qkv", "attn.out", "head", ""))


def test_twin_blockwise_attention_minus_1e4_bias_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(ReviewScorer(mask_value=-1e4), review_batch, mse, LEFT_AT + 6, tmp_path / "run", lr=1e-3))
