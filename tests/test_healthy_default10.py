"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`, nothing else), tenth
set, several also at `every=1`: realistic designs the earlier healthy probes (tests/test_healthy*.py) do not run.
Tiny models, fixed seeds, 60-160 steps each, fp16 autocast on the CPU with a real torch.amp.GradScaler("cpu")
(bf16 autocast without a scaler where said). Each run is first asserted healthy with the test's own measurements
(every loss finite, the loss falls, the scale stays >= 1 after the scaler's first search and backs off only as
said), plus the property that makes the design worth probing (below), then judged: the report holds no warning and
no error (info is fine) and ampdoctor did not switch itself off (`summary.internal_error`).

Scenarios:
 1. [default, every=1] a noise-free regression (a linear skip + a GELU branch, SGD momentum 0.1, cosine) converging
    to near-zero residuals: the loss falls by ~4 orders of magnitude (> 5e3x), > 80% of the UNSCALED gradients into
    the fp16 output end below fp16's normal range (2^-14) while a GradScaler(growth_interval=20) has grown the scale
    to >= 2^22 so that < 1% of the scaled ones are subnormal (one probing backoff late in the run);
 2. [default, every=1] HF-style additive masks in the autocast dtype: a causal mask and a padding mask, each
    finfo(float16).min, summed in fp16 to -inf where both apply (the old LLaMA/GPT-NeoX eager path), added to the fp16
    scores, softmax in fp32 (`dtype=torch.float32`); right padding, so no query row is fully masked (checked);
 3. a 1000-class classifier with label_smoothing=0.1: an fp32 nn.Embedding table (autocast leaves embeddings in
    fp32) mean-pooled and read by fp16 Linears (checked: the embedding output is fp32, the head's fp16);
 4. a weather regressor on raw sensor units (air pressure in Pa, ~1.0e5, past fp16's max, in an
    fp32 batch) through an RL-style running normaliser (Welford count/mean/M2 fp32 buffers updated in forward; the
    count passes 65504 and M2 reaches ~1e12) before fp16 Linears;
 5. [default, every=1] a transaction model: a `CumSpend` module returns the running total of raw amounts (fp32 under
    autocast, up to ~1e5, past fp16's max), which a `LogLinear` module takes as `lin(log1p(x))`: log1p in fp32 first,
    so no fp16 op ever sees the large values (checked: the Linear's fp16 input is < 16);
 6. bf16 autocast without a scaler on raw incomes and house prices (1e4-2e6): the first bf16 Linear outputs ~1e6
    (past fp16's max, far inside bf16's), a LayerNorm after it;
 7. a stateful GRU language model with truncated BPTT (the hidden state carried across batches and detached, the
    `repackage_hidden` of PyTorch's word_language_model example), SGD at lr 20 with clip_grad_norm_(0.25) as in that
    example; the GRU runs in fp32 under CPU fp16 autocast, the embedding fp32, the decoder fp16;
 8. a TransformerEncoder classifier trained under fp16 autocast, validated every 10 steps in fp32 under
    `torch.no_grad()` with a `src_key_padding_mask`: the encoder's fast path (nested tensors, padded positions zero)
    runs with the watch's hooks on;
 9. ArcFace (additive angular margin 0.5, s=64): fp16 backbone, L2-normalised features and class weights, the cosine
    and the margin computed in fp32 under `autocast(enabled=False)` with sqrt(clamp(1 - cos^2, 1e-6));
10. [default, every=1] periodic resets of the head (primacy bias, Nikishin et al. 2022): every 40 steps
    `head.reset_parameters()` under no_grad and the head's AdamW state dropped; the loss jumps and recovers.

Results: 14 runs (10 designs; every=1 also for 1, 2, 5, 10): all quiet (4 were strict xfails, 3 causes, fixed since).
Quiet: the HF-style fp16 masks summing to -inf (2, both samplings), 1000 classes with an fp32 embedding (3), raw
pressure in Pa through a Welford normaliser (4), bf16 activations ~1e6 (6), the TransformerEncoder fast path in
no_grad validation (8: the hooks took the nested tensors, no internal error), ArcFace (9), periodic head resets (10,
both samplings: the reset is outside the optimizer, no update_spike), the near-zero-residual regression at the
default sampling (1).

What ampdoctor got wrong (strict xfails, fixed since: rules/updates.py `_spikes` counts a bias only with its layer's
weight or past a huge factor, and update_spike's causes follow the optimizer (Adam-type or not); rules/numeric.py
`_low_readers`: a container none of whose children took the wide value is no reader):
 1 at every=1: `[warning] update_spike at out step 1: ... multiplied the weights of `out` x2.2 (||w|| 0.0648 ->
    0.143) ... (lr=0.1; Adam-type optimizers ...)`: the parameter is out.bias, 4 elements, taking its second SGD
    momentum step towards the targets' offset. rules/updates.py `_spikes` (single-update branch): a parameter of
    fewer than `_FEW` elements is exempt only while it is not in `peak`, i.e. on its first recorded update; at
    every=1 step 0 records it, so the ordinary second step (f = after / max(before, peak) = 2.2 >= spike_factor)
    is a spike. (The default sampling records only step 0 and stays quiet.) The cause text assumes Adam for SGD.
 5 (both samplings): `[warning] overflow_risk at cum step 0: `cum` (CumSpend) output reached 1.023e+05, which is
    1.56x the float16 maximum (65504) while still in float32: the float16 op that takes it will make inf.` No fp16
    op takes it: `tot` (LogLinear) takes log1p in fp32 and its fp16 Linear `tot.lin` sees inputs < 16 (checked).
    rules/numeric.py `overflow_risk` keeps an fp32 output as at risk when any later module d has
    `d.inp.overflow_as_ref > 0 and _low(d.out)`: the wrapper `tot` qualifies (fp32 input past 65504, fp16 output);
    the module that really casts down (its child `tot.lin`, input < 16) is not what is checked.
 7: `[warning] update_spike at dec step 0: ... multiplied the weights of `dec` x4.88 (||w|| 0.276 -> 1.34) ...
    (lr=20; Adam-type optimizers ...); clipping cannot help here: it bounds the gradient, not Adam's +-lr step.`
    PyTorch's word_language_model recipe (SGD lr 20, clip 0.25): the first clipped step moves dec.bias (40
    elements, rms 0.04 at PyTorch's default init) to the unigram log-frequencies while dec.weight barely moves
    (checked: bias x>2, weight x<1.5); the loss falls 3.7 -> ~2.3 with no skip. rules/updates.py `_spikes` judges
    each parameter alone (numel >= _FEW, rms >= _MIN_RMS, factor >= spike_factor) and names the layer; the causes
    (update_spike) are Adam's although the optimizer is SGD, whose step the clipping does bound.
"""
from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, one_thread, quiet_watch  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

quiet = functools.partial(quiet_watch, close=True, internal=True)  # closed first; no internal error either

FP16, BF16 = torch.float16, torch.bfloat16
EVERY = pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# --- helpers ------------------------------------------------------------------------------------------------------

def watch(model, opt, sc, every):
    return ampdoctor.watch(model, optimizer=opt, scaler=sc, **({} if every is None else {"every": every}))


def healthy(losses, scales=(), *, fall=0.9, k=None, first=10, max_late_backoffs=2):
    """Every loss finite; the mean of the last k losses below `fall` x the mean of the first k (k: a tenth of the
    run, at least 3); the scale >= 1 after `first` steps and at most `max_late_backoffs` backoffs after them."""
    assert losses and all(map(math.isfinite, losses)), losses
    k = k or max(3, len(losses) // 10)
    assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, (losses[:k], losses[-k:])
    if scales:
        assert min(scales[first:]) >= 1.0, scales
        late = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a and i + 1 >= first]
        assert len(late) <= max_late_backoffs, (late, scales)


def backoffs(scales):
    return [i + 1 for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]


def amp_step(loss, opt, sc, params, clip=1.0):
    sc.scale(loss).backward()
    sc.unscale_(opt)
    if clip:
        torch.nn.utils.clip_grad_norm_(params, clip)
    sc.step(opt)
    sc.update()


# --- 1. regression to near-zero residuals, the scaler growing to compensate -------------------------------------------

class Regressor(nn.Module):
    """A linear skip plus a GELU branch (the branch learns to contribute nothing to a linear target)."""

    def __init__(self, d=8, h=64, k=4):
        super().__init__()
        self.skip, self.fc1, self.out = nn.Linear(d, k), nn.Linear(d, h), nn.Linear(h, k)

    def forward(self, x):
        return self.skip(x) + self.out(F.gelu(self.fc1(x)))


A8 = torch.randn(8, 4, generator=gen(5)) * 0.5


@pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])
def test_regression_to_near_zero_residuals_scaler_grows(every):
    steps, B = 200, 256
    m = Regressor()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    sc = torch.amp.GradScaler("cpu", growth_interval=20)
    w = watch(m, opt, sc, every)
    losses, scales, sub = [], [], []
    for i in range(steps):
        x = torch.randn(B, 8, generator=gen(1000 + i))
        y = x @ A8 + 0.3                                                  # noise-free: the residuals can reach ~0
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            out = m(x)
        assert out.dtype == FP16
        s = sc.get_scale()
        out.register_hook(lambda g, s=s: sub.append((float(((g.float() / s).abs() < 2 ** -14).float().mean()),
                                                     float(((g.abs() < 2 ** -14) & (g != 0)).float().mean()))))
        loss = F.mse_loss(out.float(), y)
        amp_step(loss, opt, sc, m.parameters(), clip=None)
        sched.step()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    healthy(losses, scales, fall=1e-3)
    assert losses[0] / max(losses[-10:]) > 5e3, (losses[0], losses[-10:])    # ~4 orders of magnitude
    assert max(scales) >= 2 ** 22, scales                                  # the scale grew to compensate ...
    assert min(u for u, _ in sub[-10:]) > 0.8, sub[-10:]                   # ... for unscaled grads below 2^-14
    assert max(v for _, v in sub[-10:]) < 0.01, sub[-10:]                 # that are normal once scaled
    quiet(w)


# --- 2. additive fp16 masks summing to -inf -----------------------------------------------------------------------------

class EagerAttention(nn.Module):
    def __init__(self, d=32, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2) / math.sqrt(C // self.heads)
        s = s + mask                                                      # (B, 1, T, T) in the autocast dtype
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o((p @ v).transpose(1, 2).reshape(B, T, C))


class MaskedBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(d), nn.LayerNorm(d), EagerAttention(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class HFStyleLM(nn.Module):
    """Takes input_ids and a 0/1 attention_mask; builds the 4-D additive mask in the autocast dtype the way older
    HF eager code did: causal (finfo.min above the diagonal) + padding (finfo.min on padded keys), summed."""

    def __init__(self, V=32, T=16, d=32, L=2):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(MaskedBlock(d) for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, V)
        self.last_mask = None

    def forward(self, ids, attention_mask):
        B, T = ids.shape
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        lo = torch.finfo(dtype).min
        causal = torch.triu(torch.full((T, T), lo, dtype=dtype), 1)[None, None]
        pad = (1.0 - attention_mask[:, None, None, :].to(dtype)) * lo
        mask = causal + pad                                               # lo + lo = -inf in fp16
        self.last_mask = mask.detach()
        x = self.emb(ids) + self.pos(torch.arange(T))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


def padded_counting(i, B=16, T=16, V=32):
    g = gen(2000 + i)
    s = torch.randint(1, V, (B, 1), generator=g)
    ids = (s + torch.arange(T)) % (V - 1) + 1
    lens = torch.randint(6, T + 1, (B,), generator=g)
    am = (torch.arange(T)[None] < lens[:, None]).long()
    ids = ids * am                                                        # 0 is padding
    labels = torch.where(am.bool(), ids, -100)
    return ids, am, labels


@EVERY
def test_additive_fp16_masks_sum_to_neg_inf(every):
    steps = 80
    m = HFStyleLM()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, every)
    losses, scales = [], []
    for i in range(steps):
        ids, am, labels = padded_counting(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            logits = m(ids, am)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        mk = m.last_mask
        assert mk.dtype == FP16 and torch.isneginf(mk).any()              # the summed mask holds -inf
        assert torch.isfinite(mk).any(-1).all()                           # ... but no query row is fully masked
        amp_step(loss, opt, sc, m.parameters())
        losses.append(loss.item())
        scales.append(sc.get_scale())
    healthy(losses, scales, fall=0.5)
    quiet(w)


# --- 3. 1000 classes, label smoothing, fp32 embedding read by fp16 Linears ---------------------------------------------

class BagClassifier(nn.Module):
    def __init__(self, V=2048, d=64, h=128, k=1000):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.fc, self.head = nn.Linear(d, h), nn.Linear(h, k)

    def forward(self, ids):
        return self.head(F.gelu(self.fc(self.emb(ids).mean(1))))


def thousand(i, B=128, T=12, K=1000, V=2048):
    """Class c's signature tokens are 2c and 2c + 1 (4 of the 12 tokens), the rest uniform noise."""
    g = gen(3000 + i)
    y = torch.randint(0, K, (B,), generator=g)
    sig = 2 * y[:, None] + torch.randint(0, 2, (B, 4), generator=g)
    return torch.cat([sig, torch.randint(0, V, (B, T - 4), generator=g)], 1), y


def test_thousand_classes_label_smoothing_fp32_embedding_fp16_linear():
    steps = 100
    m = BagClassifier()
    seen = {}
    hooks = [mod.register_forward_hook(lambda mod, a, o, n=n: seen.__setitem__(n, o.dtype))
             for n, mod in (("emb", m.emb), ("head", m.head))]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, None)
    losses, scales = [], []
    for i in range(steps):
        ids, y = thousand(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(ids).float(), y, label_smoothing=0.1)
        amp_step(loss, opt, sc, m.parameters())
        losses.append(loss.item())
        scales.append(sc.get_scale())
    for h in hooks:
        h.remove()
    assert seen == {"emb": torch.float32, "head": FP16}, seen
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 4. raw sensor units through a Welford running normaliser -----------------------------------------------------------

class RunningNorm(nn.Module):
    """Observation normaliser of RL codebases (Welford/Chan parallel update of count, mean and M2 in fp32 buffers,
    updated in training forwards), clipped to +-10."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("count", torch.tensor(1e-4))
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("m2", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                n, bm = x.shape[0], x.mean(0)
                bm2 = ((x - bm) ** 2).sum(0)
                tot = self.count + n
                delta = bm - self.mean
                self.mean += delta * n / tot
                self.m2 += bm2 + delta ** 2 * self.count * n / tot
                self.count.copy_(tot)
        var = self.m2 / self.count
        return ((x - self.mean) / torch.sqrt(var + 1e-8)).clamp(-10, 10)


class WeatherNet(nn.Module):
    def __init__(self, d=6, h=64):
        super().__init__()
        self.norm = RunningNorm(d)
        self.fc1, self.fc2, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, x):
        return self.out(F.silu(self.fc2(F.silu(self.fc1(self.norm(x)))))).squeeze(-1)


def weather(i, B=1024):
    """Pressure (Pa), temperature (K), humidity (%), wind (m/s), hour, altitude (m); target: temperature in 1 h (C)."""
    g = gen(4000 + i)
    p = 101325 + 1200 * torch.randn(B, generator=g)
    t = 288 + 8 * torch.randn(B, generator=g)
    hum = 30 + 60 * torch.rand(B, generator=g)
    wind = 8 * torch.rand(B, generator=g)
    hour = torch.randint(0, 24, (B,), generator=g).float()
    alt = 400 * torch.rand(B, generator=g)
    x = torch.stack([p, t, hum, wind, hour, alt], 1)
    y = (t - 273.15) + 0.002 * (p - 101325) - 0.1 * wind + 2 * torch.sin(hour / 24 * 2 * math.pi) - 0.0065 * alt
    return x, y + 0.2 * torch.randn(B, generator=g)


def test_raw_pressure_pa_welford_running_normaliser(every=None):
    steps = 100
    m = WeatherNet()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, every)
    losses, scales = [], []
    for i in range(steps):
        x, y = weather(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            out = m(x)
        assert out.dtype == FP16
        loss = F.mse_loss(out.float(), y)
        amp_step(loss, opt, sc, m.parameters())
        losses.append(loss.item())
        scales.append(sc.get_scale())
    assert m.norm.count > 65504 and m.norm.m2.max() > 1e11 and x.abs().max() > 65504   # past fp16's max, in fp32
    healthy(losses, scales, fall=0.1)
    quiet(w)


# --- 5. a running total in fp32 under autocast, log1p before the fp16 Linear ---------------------------------------------

class CumSpend(nn.Module):
    def forward(self, amounts):
        return amounts.cumsum(1)                                          # fp32 (amounts are fp32)


class LogLinear(nn.Module):
    """A numeric feature embedding: log1p of a non-negative raw value, then a Linear."""

    def __init__(self, h):
        super().__init__()
        self.lin = nn.Linear(1, h)

    def forward(self, x):
        return self.lin(torch.log1p(x).unsqueeze(-1))


class SpendModel(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.cum = CumSpend()
        self.amt, self.tot = LogLinear(h), LogLinear(h)
        self.mix, self.head = nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, amounts):
        z = F.gelu(self.amt(amounts)) + F.gelu(self.tot(self.cum(amounts)))
        return self.head(F.gelu(self.mix(z)).mean(1)).squeeze(-1)


def transactions(i, B=64, T=128):
    """Log-normal amounts (median ~300, up to several thousand); label: a high spender (total > 4.4e4)."""
    g = gen(5000 + i)
    level = torch.exp(5.2 + 0.6 * torch.randn(B, 1, generator=g))
    amounts = level * torch.exp(0.5 * torch.randn(B, T, generator=g))
    return amounts, (amounts.sum(1) > 4.4e4).float()


@pytest.mark.parametrize("every", [None, 1],
                         ids=["default", "every1"])
def test_running_total_fp32_cumsum_into_log1p_linear(every):
    steps = 80
    m = SpendModel()
    lin_in = []
    hk = m.tot.lin.register_forward_hook(lambda mod, a, o: lin_in.append(float(a[0].abs().max())))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, every)
    losses, scales, tops = [], [], []
    for i in range(steps):
        x, y = transactions(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            logit = m(x)
            tops.append(float(m.cum(x).abs().max()))
        loss = F.binary_cross_entropy_with_logits(logit.float(), y)
        amp_step(loss, opt, sc, m.parameters())
        losses.append(loss.item())
        scales.append(sc.get_scale())
    hk.remove()
    assert sorted(tops)[len(tops) // 4] > 65504, sorted(tops)            # the running total passes fp16's max ...
    assert max(lin_in) < 16, max(lin_in)                                  # ... no fp16 op sees it (log1p first)
    healthy(losses, scales, fall=0.85)
    quiet(w)


# --- 6. bf16: activations past fp16's max, far inside bf16's ------------------------------------------------------------

class PriceNet(nn.Module):
    def __init__(self, d=4, h=64):
        super().__init__()
        self.inp, self.ln = nn.Linear(d, h), nn.LayerNorm(h)
        self.fc, self.out = nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, x):
        return self.out(F.gelu(self.fc(self.ln(self.inp(x))))).squeeze(-1)


def housing(i, B=128):
    g = gen(6000 + i)
    income = 1e4 + 2e5 * torch.rand(B, generator=g)
    area = 40 + 260 * torch.rand(B, generator=g)
    rooms = torch.randint(1, 8, (B,), generator=g).float()
    price = 3.5 * income + 2500 * area + 1e4 * rooms + 2e4 * torch.randn(B, generator=g)
    x = torch.stack([income, area, rooms, price], 1)
    return x, (income - 1.1e5) / 6e4                                      # predict income (standardised)


def test_bf16_raw_money_activations_past_fp16_max():
    steps = 100
    m = PriceNet()
    peaks = []
    hk = m.inp.register_forward_hook(lambda mod, a, o: peaks.append((o.dtype, float(o.abs().max()))))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    w = watch(m, opt, None, None)
    losses = []
    for i in range(steps):
        x, y = housing(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            out = m(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    hk.remove()
    assert all(d == BF16 for d, _ in peaks) and min(v for _, v in peaks) > 65504, peaks[:3]
    healthy(losses, fall=0.5)
    quiet(w)


# --- 7. stateful GRU LM, truncated BPTT, SGD lr 20 + clip 0.25 ------------------------------------------------------------

class GRULM(nn.Module):
    def __init__(self, V=40, d=64, h=128, p=0.2):
        super().__init__()
        self.emb, self.drop = nn.Embedding(V, d), nn.Dropout(p)
        self.rnn = nn.GRU(d, h, batch_first=True)
        self.dec = nn.Linear(h, V)

    def forward(self, ids, h):
        o, h = self.rnn(self.drop(self.emb(ids)), h)
        return self.dec(self.drop(o)), h


def markov_stream(B=16, n=20 * 80 + 1, V=40, seed=7):
    """B streams of a sparse Markov chain: each token has 3 likely successors."""
    g = gen(seed)
    succ = torch.randint(0, V, (V, 3), generator=g)
    x = torch.empty(B, n, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (B,), generator=g)
    for t in range(1, n):
        pick = torch.randint(0, 3, (B,), generator=g)
        nxt = succ[x[:, t - 1], pick]
        x[:, t] = torch.where(torch.rand(B, generator=g) < 0.9, nxt, torch.randint(0, V, (B,), generator=g))
    return x


def test_stateful_gru_lm_truncated_bptt_sgd_lr20_clip025():
    steps, bptt = 80, 20
    data = markov_stream()
    m = GRULM()
    opt = torch.optim.SGD(m.parameters(), lr=20.0)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, None)
    losses, scales = [], []
    h = torch.zeros(1, data.shape[0], 128)
    m.train()
    for i in range(steps):
        ids, tgt = data[:, i * bptt:(i + 1) * bptt], data[:, i * bptt + 1:(i + 1) * bptt + 1]
        h = h.detach()                                                    # repackage_hidden
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            logits, h = m(ids, h)
        assert logits.dtype == FP16 and h.dtype == torch.float32
        loss = F.cross_entropy(logits.float().reshape(-1, 40), tgt.reshape(-1))
        n0 = (float(m.dec.weight.norm()), float(m.dec.bias.norm()))
        amp_step(loss, opt, sc, m.parameters(), clip=0.25)
        if i == 0:
            fw, fb = float(m.dec.weight.norm()) / n0[0], float(m.dec.bias.norm()) / n0[1]
            assert fw < 1.5 and fb > 2, (fw, fb)                          # the bias moves, the matrix barely
        losses.append(loss.item())
        scales.append(sc.get_scale())
    healthy(losses, scales, fall=0.85)
    assert sum(losses[-10:]) / 10 < 2.5 < math.log(40), losses[-10:]   # well below uniform (3.69)
    quiet(w)


# --- 8. TransformerEncoder fast path in the validation passes -------------------------------------------------------------

class EncClassifier(nn.Module):
    def __init__(self, V=30, d=32, k=3):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        self.head = nn.Linear(d, k)

    def forward(self, ids):
        pad = ids == 0
        x = self.enc(self.emb(ids), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))


def padded_bags(i, B=32, T=16):
    g = gen(8000 + i)
    y = torch.randint(0, 3, (B,), generator=g)
    own = y[:, None] * 9 + torch.randint(0, 9, (B, T), generator=g) + 1
    ids = torch.where(torch.rand(B, T, generator=g) < 0.6, own, torch.randint(1, 28, (B, T), generator=g))
    lens = torch.randint(4, T + 1, (B,), generator=g)
    return ids * (torch.arange(T)[None] < lens[:, None]), y


def test_transformer_encoder_fast_path_validation_no_grad_fp32():
    steps = 60
    m = EncClassifier()
    nested = []
    hk = m.enc.layers[0].register_forward_pre_hook(lambda mod, a, kw: nested.append(a[0].is_nested), with_kwargs=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, None)
    losses, scales, vals = [], [], []
    xv, yv = padded_bags(99_999, B=64)
    for i in range(steps):
        m.train()
        x, y = padded_bags(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        amp_step(loss, opt, sc, m.parameters())
        losses.append(loss.item())
        scales.append(sc.get_scale())
        if i % 10 == 9:
            m.eval()
            with torch.no_grad():
                vals.append(F.cross_entropy(m(xv), yv).item())
    hk.remove()
    assert any(nested) and not all(nested), nested                        # validation took the fast path
    assert all(map(math.isfinite, vals)) and vals[-1] < 0.7 * vals[0], vals
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 9. ArcFace ----------------------------------------------------------------------------------------------------------

class ArcFace(nn.Module):
    def __init__(self, d=64, k=200, s=64.0, margin=0.5):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.PReLU(), nn.Linear(128, d),
                                      nn.BatchNorm1d(d))
        self.weight = nn.Parameter(torch.randn(k, d) * 0.01)
        self.s, self.cm, self.sm = s, math.cos(margin), math.sin(margin)
        self.th, self.mm = math.cos(math.pi - margin), math.sin(math.pi - margin) * margin

    def forward(self, x, y):
        emb = self.backbone(x)
        with torch.autocast("cpu", enabled=False):
            cos = F.linear(F.normalize(emb.float()), F.normalize(self.weight))
            sin = torch.sqrt((1.0 - cos * cos).clamp(min=1e-6))
            phi = cos * self.cm - sin * self.sm
            phi = torch.where(cos > self.th, phi, cos - self.mm)
            onehot = F.one_hot(y, cos.shape[1]).to(cos.dtype)
            return self.s * (onehot * phi + (1 - onehot) * cos)


CENTRES = torch.randn(200, 32, generator=gen(909))


def faces(i, B=128):
    g = gen(9000 + i)
    y = torch.randint(0, 200, (B,), generator=g)
    return CENTRES[y] + 0.5 * torch.randn(B, 32, generator=g), y


def test_arcface_margin_s64_cosine_in_fp32():
    steps = 100
    m = ArcFace()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, None)
    losses, scales = [], []
    for i in range(steps):
        x, y = faces(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            logits = m(x, y)
        assert logits.dtype == torch.float32
        loss = F.cross_entropy(logits, y)
        amp_step(loss, opt, sc, m.parameters(), clip=5.0)
        losses.append(loss.item())
        scales.append(sc.get_scale())
    healthy(losses, scales, fall=0.5)
    quiet(w)


# --- 10. periodic head resets ------------------------------------------------------------------------------------------

class ResetNet(nn.Module):
    def __init__(self, d=16, h=64, k=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU())
        self.head = nn.Linear(h, k)

    def forward(self, x):
        return self.head(self.body(x))


W16 = torch.randn(16, 4, generator=gen(1616))


def blobs(i, B=64):
    g = gen(10_000 + i)
    z = torch.randn(B, 16, generator=g)
    return z, (z @ W16 + 0.3 * torch.randn(B, 4, generator=g)).argmax(1)


@EVERY
def test_periodic_head_reset_primacy_bias(every):
    steps, period = 120, 40
    m = ResetNet()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = watch(m, opt, sc, every)
    losses, scales = [], []
    for i in range(steps):
        if i and i % period == 0:
            with torch.no_grad():
                m.head.reset_parameters()
            for p in m.head.parameters():
                opt.state.pop(p, None)
        x, y = blobs(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        amp_step(loss, opt, sc, m.parameters())
        losses.append(loss.item())
        scales.append(sc.get_scale())
    for r in (period, 2 * period):
        before, at = sum(losses[r - 5:r]) / 5, losses[r]
        after = sum(losses[r + 30:r + 40]) / 10
        assert at > 2 * before and after < 0.5 * at, (r, before, at, after)   # jumps and recovers
    healthy(losses, scales, fall=0.5)
    quiet(w)
