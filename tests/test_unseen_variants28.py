"""Twenty-eighth set: bf16-specific failures and their healthy twins, on the CPU under torch.autocast("cpu",
dtype=torch.bfloat16) or in pure bf16 (`model.to(torch.bfloat16)`), no GradScaler. bf16 has fp32's range and an
8-bit significand, so these are precision failures, not overflows. Each is a small hand-written model; an
independent oracle (the same computation in fp32 against bf16 on the unwatched run, hooks, parameter snapshots)
first shows the failure is real, then the report must name the rule at the module among its first three findings
(at the default sampling); each twin, the same model done right, must give no warning and no error.

 1. a flow-matching denoiser casts its continuous time t in [0, 1) to the activations' dtype before scaling it to
    1000 (`self.time_embed(t.to(h.dtype) * 1000)`): t = 0.997 and 0.998 become one value, phases t * freq of the
    sinusoid are off by radians -> precision_loss at `time_embed` (the module that receives the rounded times);
 2. twin of 1: t stays fp32 through `t * 1000` and sin/cos (autocast leaves them fp32) -> quiet;
 3. a ViT whose 2-D sin-cos position embedding takes the flattened patch index made as
    `torch.arange(N, dtype=h.dtype)` (1024 patches of a 32x32 grid): index 257 becomes 256, about half the
    patches share a (row, col) with another -> precision_loss at `pos_embed`;
 4. a CLIP-style model cast with `model.to(torch.bfloat16)` AFTER its AdamW was built (the optimizer now holds bf16
    parameters, no fp32 master): the learnable temperature logit_scale = log(1 / 0.07) = 2.66 sits where half a bf16
    ulp (2^-8) is far above Adam's ~lr step, it never moves while both projections do -> update_underflow at `temp`;
 5. twin of 4: the fp32 model under bf16 autocast (fp32 master weights): logit_scale moves -> quiet;
 6. a pure-bf16 VAE whose KL warm-up counts its steps in a float buffer that `model.to(torch.bfloat16)` cast:
    step + 1 == step from 256 on, the KL weight freezes at 0.256 of its 1.0 -> precision_loss (or
    update_underflow) at `kl_warmup`, the module whose state stops moving;
 7. twin of 6: the counter is an int64 buffer (not cast) -> quiet;
 8. a cosine classifier (scale 50) pre-trained in fp32 with cross_entropy, fine-tuned under bf16 autocast through a
    `logprob` module written torch.log(torch.softmax(z)): gaps of 92-100 between logits make the far classes'
    probabilities exactly 0 in bf16 (fp32 keeps them subnormal), log(0) = -inf in the forward and 0 / 0 = NaN in the
    backward at step 0 while the loss stays finite -> nan_origin / overflow at `logprob`;
 9. twin of 8: F.log_softmax -> quiet (and the fine-tune follows fp32's losses).
Not a case: a total loss summed over micro-batches in bf16 (`total = total + loss`, one backward): the logged total
is rounded, but the gradient of a sum is the same whatever the sum's rounding -- no training failure to see.

What ampdoctor got wrong (strict xfails; empty reports; 4 fixed since):
- 1: time_embed's bf16 input holds fractions below 128, so the integer-precision check does not fire; nothing goes
  non-finite, so no replay against fp32 either;
- 4 (fixed): update_underflow judged a module only on >= 16 sampled elements in one check, so temp's one scalar
  was never judged; a module that small is now judged over its checks (4 or more, 75% rounded away);
- 6: rounding is checked for parameters only; a written buffer is read only for inf/NaN.
Right: 3 precision_loss at pos_embed; 8 overflow at logprob (aten::log) step 0; 2, 5, 7 and 9 quiet.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_unseen_variants28.py
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, at_top3, finite, xf
from scenarios import gen, one_thread, quiet_watch

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
BF16 = torch.bfloat16


def bf16_loop(m, opt, batch, loss_fn, steps, *, autocast=True, watch=True, before=None, after=None):
    """zero_grad -> before(i) -> forward + loss under bf16 autocast (`autocast`) -> backward -> step -> after(i), no
    scaler, under ampdoctor.watch(m, optimizer=opt) at its default sampling (`watch`). Returns (closed watch or None,
    losses)."""
    w = ampdoctor.watch(m, optimizer=opt) if watch else None
    losses = []
    try:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            if before:
                before(i)
            args = batch(i)
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                loss = loss_fn(m, *args)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if after:
                after(i)
    finally:
        if w is not None:
            w.close()
    return w, losses


class Rounding:
    """Oracle of updates that round away: `before(i)` snapshots every parameter, `after(i)` counts, per parameter, the
    elements with a nonzero gradient that the step left unchanged (w + dw == w). `share()`: over all steps per
    parameter; `worst(min_numel)`: per parameter of `min_numel` elements or more, the largest share in one step."""

    def __init__(self, m):
        self.m, self.prev, self.same, self.total, self.per_step = m, {}, {}, {}, {}

    def before(self, i):
        self.prev = {n: p.detach().clone() for n, p in self.m.named_parameters()}

    def after(self, i):
        for n, p in self.m.named_parameters():
            nz = p.grad != 0
            k, t = int(((p.detach() == self.prev[n]) & nz).sum()), int(nz.sum())
            self.same[n], self.total[n] = self.same.get(n, 0) + k, self.total.get(n, 0) + t
            self.per_step.setdefault(n, []).append(k / max(t, 1))

    def share(self):
        return {n: self.same[n] / max(self.total[n], 1) for n in self.same}

    def worst(self, min_numel=16):
        return {n: max(v) for n, v in self.per_step.items() if dict(self.m.named_parameters())[n].numel() >= min_numel}


def sinusoid(t, dim=32):
    """Sinusoidal features of t (any shape [B]) in t's dtype."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half).to(t.dtype)
    a = t[:, None] * freqs[None]
    return torch.cat([a.sin(), a.cos()], -1)


# ======================================================================================================================
# 1-2. flow matching: continuous time cast to bf16 before it is scaled to 1000
# ======================================================================================================================
class TimeEmbed(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))

    def forward(self, t):
        return self.mlp(sinusoid(t, self.mlp[0].in_features))


class FlowNet(nn.Module):
    def __init__(self, d=32, bf16_time=True):
        super().__init__()
        self.inp, self.time_embed = nn.Linear(16, d), TimeEmbed(d)
        self.body = nn.Sequential(nn.SiLU(), nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 16))
        self.bf16_time = bf16_time

    def forward(self, x, t):
        h = self.inp(x)
        tt = t.to(h.dtype) * 1000 if self.bf16_time else t * 1000   # the bug: t in bf16 before the scaling
        return self.body(h + self.time_embed(tt))


def flow_batch(i, B=64):
    g = gen(i)
    x1 = torch.randn(B, 16, generator=g) * 0.5 + 1.0
    x0 = torch.randn(B, 16, generator=g)
    t = torch.rand(B, generator=g)
    return (1 - t[:, None]) * x0 + t[:, None] * x1, t, x1 - x0


def flow_loss(m, xt, t, v):
    return F.mse_loss(m(xt, t).float(), v)


def _flow_run(bf16_time):
    torch.manual_seed(0)
    m = FlowNet(bf16_time=bf16_time)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return bf16_loop(m, opt, flow_batch, flow_loss, 40)


def _flow_oracle():
    """In the bug's path 0.997 and 0.998 are one time, and the sinusoid's phases of a real batch are off by > 1 rad
    against fp32 (the fp32 path keeps every time distinct and exact to fp32's rounding)."""
    t = torch.tensor([0.997, 0.998])
    assert (t.to(BF16) * 1000)[0] == (t.to(BF16) * 1000)[1]
    assert (t * 1000)[0] != (t * 1000)[1]
    _, tb, _ = flow_batch(0)
    ref = sinusoid((tb * 1000).double())
    bad = sinusoid((tb.to(BF16) * 1000).double())   # the rounded times, even with exact sin/cos
    good = sinusoid(tb * 1000).double()
    assert (bad - ref).abs().max() > 1.0, (bad - ref).abs().max()
    assert (good - ref).abs().max() < 1e-3, (good - ref).abs().max()
    grid = torch.arange(1000) / 1000                                  # 1000 distinct times, far fewer in bf16
    assert (grid.to(BF16) * 1000).unique().numel() < 700, (grid.to(BF16) * 1000).unique().numel()


@xf("empty report; should be precision_loss at time_embed. time_embed's bf16 input t.to(bf16) * 1000 holds "
    "fractions below 128 (e.g. 20.75, 79.5), so the watch's integer-precision check (an all-integer input past 256) "
    "does not fire, although 0.997 and 0.998 are one time and the sinusoid's phases are off by radians; nothing goes "
    "non-finite, so there is no capture to replay against fp32 either")
def test_flow_time_cast_to_bf16_before_scaling_is_precision_loss_at_time_embed():
    _flow_oracle()
    w, losses = _flow_run(True)
    assert all(map(math.isfinite, losses)), losses
    at_top3(w.report(), "precision_loss", "time_embed")


def test_twin_flow_time_kept_fp32_is_quiet():
    _flow_oracle()
    w, losses = _flow_run(False)
    assert all(map(math.isfinite, losses)) and sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
    quiet_watch(w)


# ======================================================================================================================
# 3. ViT: 2-D sin-cos positions from a flattened patch index made in the activations' dtype
# ======================================================================================================================
class PosEmbed2D(nn.Module):
    def __init__(self, d=32, grid=32):
        super().__init__()
        self.d, self.grid = d, grid

    def forward(self, idx):
        row, col = torch.div(idx, self.grid, rounding_mode="floor"), torch.remainder(idx, self.grid)
        return torch.cat([sinusoid(row.float(), self.d // 2), sinusoid(col.float(), self.d // 2)], -1)


class TinyViT(nn.Module):
    def __init__(self, d=32, grid=32, classes=4):
        super().__init__()
        self.patch_embed, self.pos_embed = nn.Linear(12, d), PosEmbed2D(d, grid)
        self.mix = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.patch_embed(x)
        idx = torch.arange(h.shape[1], dtype=h.dtype)   # the bug: bf16 under autocast, 1024 indices
        h = h + self.pos_embed(idx)
        return self.head(self.mix(h).mean(1))


def vit_batch(i, B=4, N=1024):
    g = gen(i)
    y = torch.randint(0, 4, (B,), generator=g)
    x = torch.randn(B, N, 12, generator=g) + y[:, None, None].float() * 0.3
    return x, y


def test_vit_patch_index_in_bf16_is_precision_loss_at_pos_embed():
    idx = torch.arange(1024)
    rc32 = torch.stack([idx // 32, idx % 32], 1)
    ib = idx.to(BF16).float()
    rc16 = torch.stack([torch.div(ib, 32, rounding_mode="floor"), torch.remainder(ib, 32)], 1)
    assert rc32.unique(dim=0).shape[0] == 1024
    assert rc16.unique(dim=0).shape[0] < 600, rc16.unique(dim=0).shape   # real: ~half the patches share a position
    torch.manual_seed(0)
    m = TinyViT()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    w, losses = bf16_loop(m, opt, vit_batch, lambda m, x, y: F.cross_entropy(m(x).float(), y), 6)
    assert all(map(math.isfinite, losses)), losses
    at_top3(w.report(), "precision_loss", "pos_embed")


# ======================================================================================================================
# 4-5. CLIP-style temperature: bf16 parameters without fp32 masters (model cast after the optimizer was built)
# ======================================================================================================================
class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, sim):
        return sim * self.logit_scale.exp()


class Clip(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.img_proj, self.txt_proj, self.temp = nn.Linear(16, d), nn.Linear(24, d), Temperature()

    def forward(self, img, txt):
        a = F.normalize(self.img_proj(img), dim=-1)
        b = F.normalize(self.txt_proj(txt), dim=-1)
        return self.temp(a @ b.t())


_CLIP_MIX = torch.randn(16, 24, generator=gen(123))


def clip_batch(i, B=32, dtype=torch.float32):
    g = gen(i)
    img = torch.randn(B, 16, generator=g)
    txt = img @ _CLIP_MIX + 0.3 * torch.randn(B, 24, generator=g)
    return img.to(dtype), txt.to(dtype)


def clip_loss(m, img, txt):
    logits = m(img, txt).float()
    y = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2


def _clip_run(pure_bf16, watch=True, steps=24):
    """Returns (watch, losses, per parameter name the share of its elements with a nonzero gradient whose update
    rounded away, summed over steps, and the logit_scale's trajectory)."""
    torch.manual_seed(0)
    m = Clip()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
    if pure_bf16:
        m.to(BF16)            # the bug: after the optimizer was built, which now holds the bf16 parameters
    rnd, scale = Rounding(m), []

    def after(i):
        rnd.after(i)
        scale.append(m.temp.logit_scale.item())

    dtype = BF16 if pure_bf16 else torch.float32
    w, losses = bf16_loop(m, opt, lambda i: clip_batch(i, dtype=dtype), clip_loss, steps, autocast=not pure_bf16,
                          watch=watch, before=rnd.before, after=after)
    return w, losses, rnd.share(), scale


def test_clip_cast_to_bf16_after_the_optimizer_is_update_underflow_at_temp():
    _, _, share, scale = _clip_run(True, watch=False)
    assert share["temp.logit_scale"] == 1.0 and len(set(scale)) == 1, (share, scale)   # real: it never moves
    assert share["img_proj.weight"] < 0.5 and share["txt_proj.weight"] < 0.5, share    # the projections do
    _, _, share32, scale32 = _clip_run(False, watch=False)
    assert abs(scale32[-1] - math.log(1 / 0.07)) > 5e-3, scale32                         # fp32 masters: it moves
    w, losses, _, _ = _clip_run(True)
    assert all(map(math.isfinite, losses)), losses
    at_top3(w.report(), "update_underflow", "temp")


def test_twin_clip_with_fp32_masters_under_autocast_is_quiet():
    w, losses, share, scale = _clip_run(False)
    assert all(map(math.isfinite, losses)) and sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses
    assert share["temp.logit_scale"] < 0.5 and len(set(scale)) > 10, (share, scale)
    quiet_watch(w)


# ======================================================================================================================
# 6-7. a KL warm-up whose step counter is a float buffer cast to bf16 by model.to(torch.bfloat16)
# ======================================================================================================================
class KLWarmup(nn.Module):
    def __init__(self, total=1000, int_counter=False):
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.long if int_counter else torch.float32))
        self.total = total

    def forward(self):
        beta = (self.step.float() / self.total).clamp(max=1.0)
        if self.training:
            self.step += 1
        return beta


class VAE(nn.Module):
    def __init__(self, d=16, z=4, int_counter=False):
        super().__init__()
        self.enc, self.dec = nn.Linear(d, 2 * z), nn.Sequential(nn.Linear(z, 32), nn.Tanh(), nn.Linear(32, d))
        self.kl_warmup = KLWarmup(int_counter=int_counter)

    def forward(self, x, eps):
        mu, logvar = self.enc(x).float().chunk(2, -1)
        zz = mu + (0.5 * logvar).exp() * eps
        rec = self.dec(zz.to(x.dtype)).float()
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1).mean()
        return F.mse_loss(rec, x.float()) + self.kl_warmup() * kl


_VAE_BASIS = torch.randn(4, 16, generator=gen(7))


def vae_batch(i, B=32, dtype=BF16):
    g = gen(i)
    x = torch.randn(B, 4, generator=g) @ _VAE_BASIS
    return x.to(dtype), torch.randn(B, 4, generator=g)


VAE_STEPS = 300


def _vae_run(int_counter, watch=True):
    torch.manual_seed(0)
    m = VAE(int_counter=int_counter).to(BF16)   # pure bf16: every float buffer is cast too
    opt = torch.optim.AdamW(m.parameters(), lr=3e-2)   # high enough that no layer's bf16 updates round away
    counts, rnd = [], Rounding(m)

    def after(i):
        rnd.after(i)
        counts.append(m.kl_warmup.step.item())
    w, losses = bf16_loop(m, opt, vae_batch, lambda m, x, e: m(x, e), VAE_STEPS, autocast=False, watch=watch,
                          before=rnd.before, after=after)
    assert max(rnd.worst().values()) < 0.45, rnd.worst()   # the weights train: < 45% rounded away in any step
    return w, losses, counts


@xf("empty report; should be precision_loss (or update_underflow) at kl_warmup. Its bf16 `step` buffer stops at "
    "256 (256 + 1 == 256) from step 256 and the KL weight freezes at 0.256, but the watch checks rounding only for "
    "parameters (optimizer updates, frozen ones written in place) and reads written buffers only for inf/NaN")
def test_pure_bf16_kl_warmup_counter_freezes_at_256_is_reported_at_kl_warmup():
    _, _, counts = _vae_run(False, watch=False)
    assert counts[255] == 256 and counts[-1] == 256, counts[250:]      # real: 256 + 1 == 256 in bf16, from step 256
    _, _, counts_int = _vae_run(True, watch=False)
    assert counts_int[-1] == VAE_STEPS                                  # the int64 counter keeps counting
    w, losses, _ = _vae_run(False)
    assert all(map(math.isfinite, losses)), losses
    at_top3(w.report(), ("precision_loss", "update_underflow"), "kl_warmup")


def test_twin_pure_bf16_vae_with_an_int64_counter_is_quiet():
    w, losses, counts = _vae_run(True)
    assert counts[-1] == VAE_STEPS
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.9 * sum(losses[:20]), losses
    quiet_watch(w)


# ======================================================================================================================
# 8-9. cosine classifier (scale 50): log(softmax) in bf16 -> log(0) = -inf forward, 0 / 0 = NaN backward
# ======================================================================================================================
class CosHead(nn.Module):
    def __init__(self, d=2, c=10, scale=50.0):
        super().__init__()
        a = torch.arange(c) * 2 * math.pi / c
        self.weight = nn.Parameter(torch.stack([a.cos(), a.sin()], 1))
        self.scale = scale

    def forward(self, f):
        return self.scale * F.normalize(f, dim=-1) @ F.normalize(self.weight, dim=-1).t()


class LogProb(nn.Module):
    def __init__(self, stable):
        super().__init__()
        self.stable = stable

    def forward(self, z):
        return F.log_softmax(z, -1) if self.stable else torch.log(torch.softmax(z, -1))


class CosNet(nn.Module):
    """8 -> 2-D embedding (a NormFace-style visualisation) -> cosine logits * 50 over 10 classes -> log-probs."""

    def __init__(self, stable=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        self.head, self.logprob = CosHead(), LogProb(stable)

    def forward(self, x):
        return self.logprob(self.head(self.enc(x)))


_CENTRES = torch.randn(10, 8, generator=gen(99))


def cls_batch(i, B=64):
    g = gen(i)
    y = torch.randint(0, 10, (B,), generator=g)
    return _CENTRES[y] + 0.5 * torch.randn(B, 8, generator=g), y


def nll(m, x, y):
    return F.nll_loss(m(x).float(), y)


def _pretrained(stable):
    """60 fp32 steps with cross_entropy on the head's logits (the pre-training script)."""
    torch.manual_seed(0)
    m = CosNet(stable)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    bf16_loop(m, opt, cls_batch, lambda m, x, y: F.cross_entropy(m.head(m.enc(x)), y), 60, autocast=False,
              watch=False)
    return m


FT_STEPS = 12


def _finetune(m, autocast, watch=True, prod=None):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def before(i):
        if prod is not None:
            prod.new_step(i)
    return bf16_loop(m, opt, lambda i: cls_batch(100 + i), nll, FT_STEPS, autocast=autocast, watch=watch,
                     before=before)


def _fp32_finetune_losses(stable):
    _, losses = _finetune(_pretrained(stable), autocast=False, watch=False)
    return losses


def test_bf16_log_of_softmax_in_a_cosine_classifier_is_nan_at_logprob():
    m = _pretrained(False)
    x, y = cls_batch(100)
    with torch.no_grad():
        z = m.head(m.enc(x))
        gap = z.max(-1).values - z.min(-1).values
        assert 92 < gap.max() < 100, gap.max()                          # p ~ e^-gap: 0 in bf16, subnormal in fp32
        assert (torch.softmax(z, -1) > 0).all() and (torch.softmax(z.to(BF16), -1) == 0).any()
    ref = copy.deepcopy(m)
    fp32 = _fp32_finetune_losses(False)                                 # the same fine-tune in fp32 is finite
    assert all(map(math.isfinite, fp32)), fp32
    prod = Producer(m, backward=True)
    w, losses = _finetune(m, autocast=True, prod=prod)
    prod.remove()
    assert math.isfinite(losses[0]) and not math.isfinite(losses[1]), losses   # step 0's loss is finite ...
    assert prod.first_bwd == ("logprob", 0), prod.first_bwd                     # ... its backward NaN at logprob
    assert prod.first == ("logprob", 0), prod.first                             # (log(0) = -inf in its forward)
    assert finite(list(ref.parameters()))
    at_top3(w.report(), ("nan_origin", "overflow"), "logprob", step=0)


def test_twin_bf16_log_softmax_in_a_cosine_classifier_is_quiet():
    fp32 = _fp32_finetune_losses(True)
    m = _pretrained(True)
    prod = Producer(m, backward=True)
    w, losses = _finetune(m, autocast=True, prod=prod)
    prod.remove()
    assert prod.first is None and prod.first_bwd is None, (prod.first, prod.first_bwd)
    assert all(map(math.isfinite, losses)), losses
    assert all(abs(a - b) < 0.1 * b + 0.05 for a, b in zip(losses, fp32)), (losses, fp32)  # it trains as fp32 does
    quiet_watch(w)
