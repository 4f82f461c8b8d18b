"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`), most with
`headroom=True` (the per-layer headroom series on every step, the `headroom_trend` early warning's input), sixth set:
the situations where an early-warning/trend rule or a scaler rule could misfire. Tiny models, 115-400 steps each,
fixed seeds, fp16 autocast on the CPU with a real torch.amp.GradScaler("cpu") (bf16 without one where said);
`torch.backends.cuda.matmul.allow_tf32` is left untouched. Each run is first asserted healthy (every loss finite, the
loss falls or stays bounded, the scale stays >= 1 and backs off at most as said after the first 20 steps), then
judged: no warning and no error (info is fine).

Scenarios:
 1. a residual MLP without a final norm on inputs at scale 30, warmup 40 then cosine over 300 steps (the residual
    stream grows during the warmup, then settles);
 2. GradScaler(init 2**14, growth_interval=10) growing to 2**24 at step 99 and backing off once;
 3. gradient accumulation, scaler.step every 4 micro-batches (warmup + cosine, 160 optimizer steps); and the same
    with zero_grad(set_to_none=False), SGD momentum and growth_interval=10 probing its ceiling;
 4. a GAN, D then G, two optimizers and one scaler, unscale_ + clip per optimizer; updated after each network's
    step or once per iteration; watched with D's or G's optimizer (4 variants);
 5. two GradScalers (a classifier and a ~100x larger regression loss), one module watched with the first pair;
 6. zero_grad(set_to_none=False) with SGD momentum + weight decay, MultiStepLR, BatchNorm, 250 steps;
 7. AdamW parameter groups: embeddings at 3x lr, decay 0.1 on matrices, weight decay 0 for biases and LayerNorms, on
    a small pre-norm transformer LM (nn.TransformerEncoderLayer, causal mask), warmup + cosine;
 8. a frozen conv backbone (requires_grad=False, kept in eval) on raw 0-255 pixels, a trainable LayerNorm + head;
 9. an EMA deep copy lerped after every step outside autocast (torch._foreach_lerp_), evaluated under autocast and
    inference_mode every 10 steps;
10. bf16 without a scaler: int64 positions and fp32 timestamps up to ~4000 s (sinusoidal encoding with autocast off);
    raw counts up to 5000 through bf16 Linears next to int64 bucket ids;
11. an fp32 island under torch.autocast(enabled=False) computing energies of 1e5-1e6 (past fp16's max);
12. activations held at 1e3-1e4 in fp16 by a fixed per-feature gain, stable for 300 steps;
13. torch.utils.checkpoint over residual blocks with dropout, use_reentrant False and True, eval passes;
14. nn.MultiheadAttention with key_padding_mask over variable-length sequences, an Embedding with padding_idx;
    a padding_idx bag-of-words summed over documents of up to 200 tokens;
15. a first-step overflow (reduction='sum' over 256 examples) that GradScaler backs off from, from 2**16 and from
    2**24 (a 14-step search);
16. weight tying (the LM head's weight is the token embedding), warmup + cosine to 10%, 250 steps;
17. a siamese encoder (with BatchNorm) called twice per step, a contrastive margin loss;
18. optimizers: SGD nesterov, Adagrad, RMSprop (plain; centered with momentum), AdamW(foreach=True),
    AdamW(fused=False, foreach=False);
19. linearly separable data: logits grow like log(t) for 400 steps (no weight decay, no smoothing);
20. CosineAnnealingWarmRestarts (T_0=50, T_mult=2) over 350 steps on unnormalised inputs;
21. the large-batch linear scaling rule: batch 512, SGD nesterov, lr warmed up 0.1 -> 1.6, then cosine, BatchNorm;
22. GradScaler(init 2, growth_interval=10): the scaled gradients climb 0.1 bit/step towards fp16's max for 230
    steps (2 -> 2**24) under headroom=True, one skipped step (233) and backoff;
23. a GAN with 5 discriminator steps per generator step on one scaler updated after every step, watched with D's or
    G's optimizer;
24. an RBF network whose Gaussian features of far centres are tiny (below fp16's normal range) by design;
25. a 256-tag multi-label tagger whose forward returns sigmoid probabilities: the absent tags' probabilities fall
    below fp16's normal range as it learns.

False alarms found (fixed since: a forward output whose abs-max is >= 2^-3 holds no underflow that matters,
rules/underflow.py `_NEGLIGIBLE_BELOW`):
 - 24: `underflow` warning, phase forward, module "0" (the RBF layer), step 0: "90% of the nonzero outputs of `0` are
   below fp16's normal range (2^-14); they lose precision or vanish." Far centres' kernel values are negligible by
   design: their contribution to the O(1) read-out is below fp16's resolution whatever their own precision.
 - 25: `underflow` warning, phase forward, module "prob" (nn.Sigmoid), step 200 (the default sampling's second
   full-statistics step): "67% of the nonzero outputs of `prob` are below fp16's normal range (2^-14); they lose
   precision or vanish." The rule exempts Softmax outputs as probabilities, but not Sigmoid ones.
No trend, scaler or update rule misfired: scenarios 1-23 are reported without a warning or an error."""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, one_thread, quiet_watch as quiet  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16


# --- helpers ------------------------------------------------------------------------------------------------------

def healthy(losses, scales=(), *, fall=0.9, k=None, first=20, max_late_backoffs=1, bounded=None):
    """Every loss finite; the mean of the last k losses below `fall` x the mean of the first k (default k = a tenth
    of the run), or with `bounded` every loss after `first` below it; the loss scale stays >= 1 after the first
    `first` steps and backs off at most `max_late_backoffs` times after them."""
    assert losses and all(map(math.isfinite, losses)), losses
    k = k or max(1, len(losses) // 10)
    if bounded is None:
        assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, (losses[:k], losses[-k:])
    else:
        assert max(losses[first:]) < bounded, max(losses[first:])
    if scales:
        assert min(scales[first:]) >= 1.0, scales
        late = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a and i + 1 >= first]
        assert len(late) <= max_late_backoffs, (late, scales)


def warmup_cosine(warm, total, floor=0.0):
    """LambdaLR factor: linear warmup over `warm` steps, then cosine from 1 down to `floor` at `total`."""
    def f(s):
        if s < warm:
            return (s + 1) / warm
        p = min(1.0, (s - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def fit(model, batch, loss_fn, *, steps, dtype=FP16, opt=None, lr=1e-3, sched=None, clip=1.0, headroom=None,
        scaler_kw=None, accum=1, set_to_none=True, after=None, watched=None):
    """The loop people write: zero_grad -> `accum` x (forward under autocast(dtype) -> scale(loss / accum).backward)
    -> unscale_ -> clip (parameters that require grad) -> step -> update -> sched.step -> after(i) under no_grad,
    watched at the defaults (plus `headroom` when given). bf16: no scaler. `batch(j)` gives micro-batch j's args,
    `loss_fn(model, *args)` the loss. Returns (watch, losses, scales)."""
    torch.manual_seed(0)
    opt = opt(model) if callable(opt) else (opt or torch.optim.AdamW(model.parameters(), lr=lr))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched) if callable(sched) else sched
    sc = torch.amp.GradScaler("cpu", **(scaler_kw or {})) if dtype == FP16 else None
    w = ampdoctor.watch(watched or model, optimizer=opt, scaler=sc,
                        **({} if headroom is None else {"headroom": headroom}))
    params = [p for g in opt.param_groups for p in g["params"]]
    losses, scales = [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for j in range(accum):
            args = batch(i * accum + j)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(model, *args) / accum
            (sc.scale(loss) if sc else loss).backward()
            total += loss.item()
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in params if p.requires_grad], clip)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        if after:
            with torch.no_grad():
                after(i)
        losses.append(total)
        scales.append(sc.get_scale() if sc else 1.0)
    w.close()
    return w, losses, scales


def ce(m, x, y):
    return F.cross_entropy(m(x).float(), y)


W4 = torch.randn(16, 4, generator=gen(4242))


def classes(n=64, d=16, scale=1.0, noise=0.3, seed=0):
    """Gaussian features (times `scale`), a 4-class target from a fixed linear map of the unscaled features."""
    def batch(i):
        z = torch.randn(n, d, generator=gen(seed * 100_000 + i))
        y = (z @ W4 + noise * torch.randn(n, 4, generator=gen(seed * 100_000 + 50_000 + i))).argmax(1)
        return z * scale, y
    return batch


def mlp(d_in=16, h=64, out=4, act=nn.GELU, depth=2):
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, h), act()]
        d = h
    return nn.Sequential(*layers, nn.Linear(d, out))


def tokens(B=8, T=16, V=48, seed=0):
    """A learnable token stream: each sequence counts up from a random token by its own stride b in {1, 2} (mod V),
    so next-token loss can fall well below log V."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        a = torch.ones(B, dtype=torch.long)
        b = torch.randint(1, 3, (B,), generator=g)
        t = [torch.randint(0, V, (B,), generator=g)]
        for _ in range(T):
            t.append((a * t[-1] + b) % V)
        s = torch.stack(t, 1)
        return s[:, :-1], s[:, 1:]
    return batch


# --- 1. warmup + cosine, the residual stream grows while lr rises, then settles -------------------------------------

class ResMLP(nn.Module):
    """Pre-activation residual MLP blocks without a final norm: the residual stream's scale follows the updates."""

    def __init__(self, d_in=16, d=64, n=3, out=4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def test_residual_mlp_warmup_40_then_cosine_300_steps_stream_grows_then_settles_headroom():
    """Inputs at scale 30; lr 3e-3 warmed up over 40 steps then cosine to 0 over 300 steps: the residual stream and
    logits grow through the warmup and the early high-lr phase, then stop moving as the lr decays."""
    steps = 300
    w, losses, scales = fit(ResMLP(), classes(scale=30.0), ce, steps=steps, lr=3e-3, headroom=True,
                            sched=warmup_cosine(40, steps))
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 2. GradScaler growing to 2^24 every 10 steps, one backoff ------------------------------------------------------

def test_gradscaler_growth_interval_10_grows_to_2_24_then_backs_off_once():
    """GradScaler(init_scale=2**14, growth_interval=10), a classification loss weighted 0.05: the scale doubles
    every 10 clean steps up to 2**24 at step 99; the next batch's gradients overflow fp16 at 2**24, that step is
    skipped and the scale halves to 2**23, then it grows back to 2**24 ten steps later (115 steps in all). One
    backoff after a long growth is how the scaler finds its ceiling."""
    steps = 115
    w, losses, scales = fit(mlp(16, 64, 4), classes(), lambda m, x, y: 0.05 * ce(m, x, y), steps=steps, lr=1e-3,
                            scaler_kw=dict(init_scale=2.0 ** 14, growth_interval=10))
    assert max(scales) >= 2.0 ** 24, scales
    backs = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]
    assert len(backs) == 1, (backs, scales)
    healthy(losses, scales, fall=0.9)
    quiet(w)



# --- 3. gradient accumulation: scaler.step every 4 micro-batches ---------------------------------------------------

def test_accumulation_4_micro_batches_warmup_cosine_160_steps_headroom():
    """4 micro-batches of 16 per optimizer step (`scaler.scale(loss / 4).backward()` each, one unscale_/clip/
    step/update per 4), lr warmup 20 then cosine over 160 optimizer steps (640 forwards), inputs at scale 8."""
    steps = 160
    w, losses, scales = fit(mlp(16, 64, 4, depth=3), classes(n=16, scale=8.0), ce, steps=steps, accum=4, lr=2e-3,
                            headroom=True, sched=warmup_cosine(20, steps))
    healthy(losses, scales, fall=0.7)
    quiet(w)


def test_accumulation_4_with_growth_interval_10_and_set_to_none_false_default_sampling():
    """The same 4-micro-batch accumulation, but gradients zeroed in place (`zero_grad(set_to_none=False)`), a
    GradScaler with growth_interval=10 from 2**10, SGD momentum 0.9, constant lr, 150 optimizer steps. The scale
    reaches its ceiling (~2**21) by step ~95; from there each growth probe overflows once and halves back (5 skipped
    steps of 150, one per ~11 steps: what growth_interval=10 asks for)."""
    steps = 150
    w, losses, scales = fit(mlp(16, 64, 4), classes(n=16), ce, steps=steps, accum=4, set_to_none=False,
                            opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                            scaler_kw=dict(init_scale=2.0 ** 10, growth_interval=10))
    healthy(losses, scales, fall=0.7, max_late_backoffs=6)
    quiet(w)


# --- 4. GAN: two optimizers, one scaler -----------------------------------------------------------------------------

def ring(n, i):
    """2-D points on a ring of radius 2 with noise: the GANs' real data."""
    g = gen(70_000 + i)
    a = torch.rand(n, generator=g) * 2 * math.pi
    return torch.stack([a.cos(), a.sin()], 1) * 2 + 0.05 * torch.randn(n, 2, generator=g)


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        self.D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                               nn.Linear(64, 1))


def ring_distance(G, n=512):
    with torch.no_grad():
        p = G(torch.randn(n, 8, generator=gen(99_999))).float()
    return (p.norm(dim=1) - 2).abs().mean().item()


@pytest.mark.parametrize("updates", ["update_after_each", "one_update"])
@pytest.mark.parametrize("watch_opt", ["D", "G"])
def test_gan_d_then_g_one_scaler_separate_unscale_and_clip_per_optimizer(updates, watch_opt):
    """DCGAN-style AMP loop: D on real and `fake.detach()` (scale -> backward -> unscale_(optD) -> clip D ->
    step(optD)), then G's non-saturating loss through D (zero_grad of both; unscale_(optG) -> clip G ->
    step(optG)); one GradScaler, updated after each network's step or once per iteration. The whole GAN module is
    watched with D's or G's optimizer; 200 iterations. Healthy: D's loss stays bounded, G's samples reach the
    ring."""
    torch.manual_seed(0)
    gan = GAN()
    oD = torch.optim.Adam(gan.D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    oG = torch.optim.Adam(gan.G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(gan, optimizer=oD if watch_opt == "D" else oG, scaler=sc)
    dist0 = ring_distance(gan.G)
    ld, lg, scales = [], [], []
    for i in range(200):
        real, z = ring(128, i), torch.randn(128, 8, generator=gen(10_000 + i))
        oD.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = gan.G(z)
            dr, df = gan.D(real).float(), gan.D(fake.detach()).float()
            loss_d = F.binary_cross_entropy_with_logits(dr, torch.ones_like(dr)) + \
                F.binary_cross_entropy_with_logits(df, torch.zeros_like(df))
        sc.scale(loss_d).backward()
        sc.unscale_(oD)
        torch.nn.utils.clip_grad_norm_(gan.D.parameters(), 5.0)
        sc.step(oD)
        if updates == "update_after_each":
            sc.update()
        oG.zero_grad()
        oD.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            dg = gan.D(fake).float()
            loss_g = F.binary_cross_entropy_with_logits(dg, torch.ones_like(dg))
        sc.scale(loss_g).backward()
        sc.unscale_(oG)
        torch.nn.utils.clip_grad_norm_(gan.G.parameters(), 5.0)
        sc.step(oG)
        sc.update()
        ld.append(loss_d.item())
        lg.append(loss_g.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(ld, scales, bounded=3.0)
    healthy(lg, bounded=6.0)
    assert ring_distance(gan.G) < 0.5 * dist0, (dist0, ring_distance(gan.G))
    quiet(w)


# --- 5. two scalers ---------------------------------------------------------------------------------------------------

class TwoTask(nn.Module):
    """A classifier and a regressor trained side by side in one module, each with its own optimizer and
    GradScaler (separate loss scales for losses of very different magnitudes)."""

    def __init__(self):
        super().__init__()
        self.cls = mlp(16, 64, 4)
        self.reg = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def test_two_scalers_two_networks_one_module_watched_with_the_first_pair():
    """Two optimizers, two GradScalers (the regressor's loss is ~100x the classifier's and its scaler settles
    lower): each loss scaled by its own scaler, each optimizer unscaled, clipped, stepped and its scaler updated;
    the module holding both is watched with the classifier's optimizer and scaler. 150 steps."""
    torch.manual_seed(0)
    m = TwoTask()
    o1 = torch.optim.AdamW(m.cls.parameters(), lr=2e-3)
    o2 = torch.optim.AdamW(m.reg.parameters(), lr=2e-3)
    s1, s2 = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    w = ampdoctor.watch(m, optimizer=o1, scaler=s1)
    data, wr = classes(), torch.randn(16, generator=gen(5))
    l1s, l2s, sc1, sc2 = [], [], [], []
    for i in range(150):
        x, y = data(i)
        t = 30.0 * torch.tanh(x @ wr / 4)
        o1.zero_grad()
        o2.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            l1 = F.cross_entropy(m.cls(x).float(), y)
            l2 = F.smooth_l1_loss(m.reg(x).float().squeeze(-1), t, beta=5.0)
        s1.scale(l1).backward()
        s2.scale(l2).backward()
        for o, s, net in ((o1, s1, m.cls), (o2, s2, m.reg)):
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            s.step(o)
            s.update()
        l1s.append(l1.item())
        l2s.append(l2.item())
        sc1.append(s1.get_scale())
        sc2.append(s2.get_scale())
    w.close()
    healthy(l1s, sc1, fall=0.7)
    healthy(l2s, sc2, fall=0.7)
    quiet(w)


# --- 6. zero_grad(set_to_none=False), SGD momentum, long run -------------------------------------------------------

def test_zero_grad_set_to_none_false_sgd_momentum_weight_decay_250_steps_headroom():
    """Gradients zeroed in place every step (the pre-2.0 default), SGD momentum 0.9 + weight decay 5e-4 with a
    step decay at 150 and 220 (MultiStepLR, gamma 0.1), a BatchNorm MLP, 250 steps."""
    steps = 250
    m = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                      nn.ReLU(), nn.Linear(64, 4))

    def opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    o = opt(m)
    w, losses, scales = fit(m, classes(scale=5.0), ce, steps=steps, opt=o, set_to_none=False, headroom=True,
                            sched=torch.optim.lr_scheduler.MultiStepLR(o, [150, 220], 0.1))
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 7. parameter groups: different lrs, no decay for norms and biases ---------------------------------------------

class TinyLM(nn.Module):
    """Token + learned position embeddings, 2 pre-norm transformer layers (nn.TransformerEncoderLayer,
    norm_first, causal mask), a final LayerNorm and a head tied to the token embedding (when `tied`)."""

    def __init__(self, V=48, d=32, T=16, n=2, tied=True):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(n))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.ln(x))


def lm_loss(m, x, y):
    return F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())


def test_param_groups_embeddings_body_head_lrs_no_decay_for_norms_biases_warmup_cosine_headroom():
    """AdamW with three groups: embeddings at lr 3e-3, the transformer weights at 1e-3 with weight decay 0.1, and
    every bias and LayerNorm parameter at 1e-3 with weight decay 0; warmup 20 then cosine over 200 steps."""
    steps = 200
    torch.manual_seed(0)
    m = TinyLM(tied=False)

    def opt(m):
        emb = list(m.tok.parameters()) + list(m.pos.parameters())
        seen = {id(p) for p in emb}
        decay = [p for n, p in m.named_parameters() if id(p) not in seen and p.ndim >= 2]
        no_decay = [p for n, p in m.named_parameters() if id(p) not in seen and p.ndim < 2]
        return torch.optim.AdamW([{"params": emb, "lr": 3e-3, "weight_decay": 0.0},
                                  {"params": decay, "lr": 1e-3, "weight_decay": 0.1},
                                  {"params": no_decay, "lr": 1e-3, "weight_decay": 0.0}])
    w, losses, scales = fit(m, tokens(), lm_loss, steps=steps, opt=opt, headroom=True,
                            sched=warmup_cosine(20, steps))
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 8. frozen backbone, trainable head ------------------------------------------------------------------------------

class Frozen(nn.Module):
    """A 'pretrained' conv backbone (requires_grad=False, kept in eval) whose pooled features sit in the hundreds
    (raw 0-255 pixels, no normalisation), and a trainable LayerNorm + linear head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 4))
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x))

    def train(self, mode=True):
        super().train(mode)
        self.backbone.eval()
        return self


def images(n=32, seed=0):
    """8x8 RGB images in 0..255: class k brightens channel k % 3 and the top or bottom half."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        y = torch.randint(0, 4, (n,), generator=g)
        x = torch.rand(n, 3, 8, 8, generator=g) * 128
        for k in range(4):
            sel = y == k
            half = slice(0, 4) if k < 2 else slice(4, 8)
            x[sel, k % 3, half] += 100
        return x.round(), y
    return batch


def test_frozen_backbone_requires_grad_false_raw_pixel_features_trainable_head_headroom():
    """Only the head is in the optimizer; the frozen backbone's conv outputs sit at ~1e2-1e3 in fp16 on raw pixels,
    unchanged over 200 steps while the head learns."""
    steps = 200
    torch.manual_seed(0)
    m = Frozen().train()
    w, losses, scales = fit(m, images(), ce, steps=steps, headroom=True,
                            opt=lambda m: torch.optim.AdamW(m.head.parameters(), lr=3e-3))
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 9. EMA copy updated each step outside autocast ------------------------------------------------------------------

def test_ema_copy_lerped_after_every_step_outside_autocast_evaluated_under_autocast_every_10():
    """A deep copy of the model (not watched, requires_grad off) updated after every optimizer step with
    `torch._foreach_lerp_` (decay 0.99) in fp32 under no_grad outside autocast; the EMA is evaluated every 10
    steps under autocast and inference_mode; 200 steps, lr warmup 20 then cosine, headroom on."""
    steps = 200
    torch.manual_seed(0)
    m = ResMLP(n=2)
    ema = copy.deepcopy(m).requires_grad_(False).eval()
    evals = []
    data = classes(scale=10.0)

    def after(i):
        torch._foreach_lerp_(list(ema.parameters()), list(m.parameters()), 0.01)
        if i % 10 == 9:
            x, y = data(1_000_000 + i)
            with torch.inference_mode(), torch.autocast("cpu", dtype=FP16):
                evals.append(F.cross_entropy(ema(x).float(), y).item())
    w, losses, scales = fit(m, data, ce, steps=steps, lr=2e-3, headroom=True, after=after,
                            sched=warmup_cosine(20, steps))
    healthy(losses, scales, fall=0.6)
    assert evals[-1] < 0.7 * evals[0], evals
    quiet(w)


# --- 10. bf16 without a scaler, integer positions and large fp32 values -------------------------------------------

class TimeSeries(nn.Module):
    """Events at integer positions 0..T-1 (int64) with fp32 timestamps up to ~4000 s: a sinusoidal encoding of the
    timestamp computed in fp32 (autocast off), added to a bf16 value projection, a GRU-free mean-pooled MLP head.
    The timestamps (>= 256) and positions never enter a bf16 op as raw values."""

    def __init__(self, d=32):
        super().__init__()
        self.val = nn.Linear(2, d)
        self.pos = nn.Embedding(64, d)
        self.mix = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.head = nn.Linear(d, 3)
        self.register_buffer("freq", torch.exp(-math.log(1e4) * torch.arange(0, d, 2) / d), persistent=False)

    def forward(self, vals, ts):
        pos = torch.arange(vals.shape[1], dtype=torch.int64)
        with torch.autocast("cpu", enabled=False):
            ang = ts.float()[..., None] * self.freq
            enc = torch.cat([ang.sin(), ang.cos()], -1)
        x = self.val(vals) + self.pos(pos) + enc
        x = x + self.mix(x)
        return self.head(x.mean(1))


def events(n=32, T=48, seed=0):
    """Class = which of three frequencies the sequence oscillates at, timestamps from 0 to ~4000 s."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        y = torch.randint(0, 3, (n,), generator=g)
        ts = torch.cumsum(torch.rand(n, T, generator=g) * 160, 1)
        f = torch.tensor([0.5, 1.0, 2.0])[y][:, None]
        v = torch.sin(f * torch.arange(T)[None] + torch.rand(n, 1, generator=g) * 6.28)
        vals = torch.stack([v, v - torch.roll(v, 1, 1)], -1)
        return vals, ts, y
    return batch


def test_bf16_no_scaler_int64_positions_fp32_timestamps_up_to_4000_headroom():
    steps = 200
    torch.manual_seed(0)
    w, losses, scales = fit(TimeSeries(), events(), lambda m, v, t, y: F.cross_entropy(m(v, t).float(), y),
                            steps=steps, dtype=BF16, lr=3e-3, headroom=True, sched=warmup_cosine(20, steps))
    healthy(losses, fall=0.5)
    quiet(w)


def test_bf16_no_scaler_raw_counts_in_the_thousands_and_int64_bucket_ids():
    """bf16 autocast on features that are raw counts (0..5000, bf16 represents them to 3 significant digits, which
    is all they need) next to int64 bucket ids fed to an embedding; values >= 256 through bf16 Linears are fine in
    bf16's range. 200 steps."""
    steps = 200
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(300, 16)
            self.inp = nn.Linear(4, 32)
            self.body = nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 64), nn.SiLU(), nn.Linear(64, 2))

        def forward(self, counts, bucket):
            return self.body(torch.cat([self.inp(counts), self.emb(bucket)], -1))

    wc = torch.tensor([1.0, -1.0, 0.5, 0.0])

    def batch(i):
        g = gen(i)
        counts = (torch.rand(64, 4, generator=g) * 5000).round()
        bucket = torch.randint(0, 300, (64,), generator=g)
        y = ((counts / 5000 - 0.5) @ wc + 0.3 * ((bucket % 2) * 2 - 1) > 0).long()
        return counts, bucket, y
    w, losses, scales = fit(M(), batch, lambda m, c, b, y: F.cross_entropy(m(c, b).float(), y), steps=steps,
                            dtype=BF16, lr=2e-3, headroom=True)
    healthy(losses, fall=0.8)
    quiet(w)


# --- 11. an fp32 module under autocast(enabled=False) holding values past fp16's max -------------------------------

class EnergyHead(nn.Module):
    """An fp32 island: the energy sum((h * 300)^2) of the features (~1e5-1e6, past fp16's max of 65504) and its
    log, computed with autocast off in fp32 where they are representable; the log-energy is a feature of the
    classifier."""

    def forward(self, h):
        with torch.autocast("cpu", enabled=False):
            e = (h.float() * 300.0).pow(2).sum(-1, keepdim=True)
            return torch.log(e)


class WithIsland(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.energy = EnergyHead()
        self.head = nn.Linear(65, 4)

    def forward(self, x):
        h = self.enc(x)
        return self.head(torch.cat([h, self.energy(h) - 14.0], -1))


def test_fp32_island_under_autocast_disabled_values_1e5_to_1e6_headroom():
    steps = 200
    torch.manual_seed(0)
    w, losses, scales = fit(WithIsland(), classes(), ce, steps=steps, lr=2e-3, headroom=True)
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 12. large but stable activations in fp16 ------------------------------------------------------------------------

class Amplified(nn.Module):
    """A fixed (buffer) per-feature gain of 200-2000 after the first Linear, as in un-normalised physical units: the
    scaled layer's fp16 output sits at ~1e3-1e4 (about 3-5 bits below fp16's max) with batch-to-batch noise, and
    stays there; a LayerNorm brings it back to unit scale."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.register_buffer("gain", torch.logspace(math.log10(200), math.log10(2000), 64))
        self.scaled = nn.Identity()
        self.norm = nn.LayerNorm(64)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x):
        h = self.scaled(self.inp(x) * self.gain)
        return self.body(self.norm(h))


def test_activations_at_1e3_to_1e4_in_fp16_stable_for_300_steps_headroom():
    steps = 300
    torch.manual_seed(0)
    seen = []
    m = Amplified()
    m.scaled.register_forward_hook(lambda mod, i, o: seen.append(o.detach().abs().max().item()))
    w, losses, scales = fit(m, classes(), ce, steps=steps, lr=1e-3, headroom=True)
    healthy(losses, scales, fall=0.6)
    assert 1e3 < min(seen) and max(seen) < 3e4, (min(seen), max(seen))
    quiet(w)


# --- 13. torch.utils.checkpoint --------------------------------------------------------------------------------------

class CkptNet(nn.Module):
    def __init__(self, reentrant, d=64, n=3):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(2 * d, d)) for _ in range(n))
        self.head = nn.Linear(d, 4)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + (checkpoint(b, x, use_reentrant=self.reentrant) if self.training else b(x))
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_residual_blocks_with_dropout_warmup_cosine_200_steps_headroom(reentrant):
    """Every block under torch.utils.checkpoint (recomputed in backward, dropout's RNG state restored), inputs at
    scale 10, warmup 20 + cosine; an eval pass without checkpointing every 25 steps."""
    steps = 200
    torch.manual_seed(0)
    m = CkptNet(reentrant)
    data = classes(scale=10.0)

    def after(i):
        if i % 25 == 24:
            m.eval()
            with torch.autocast("cpu", dtype=FP16):
                m(data(2_000_000 + i)[0])
            m.train()
    w, losses, scales = fit(m, data, ce, steps=steps, lr=2e-3, headroom=True, after=after,
                            sched=warmup_cosine(20, steps))
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 14. nn.MultiheadAttention with key_padding_mask ------------------------------------------------------------------

class PaddedAttn(nn.Module):
    """Embeddings with padding_idx=0, one nn.MultiheadAttention (batch_first) with key_padding_mask, a masked mean
    pool and a head: classify whether a sequence holds more 'high' tokens (>= V/2) than low ones."""

    def __init__(self, V=40, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, d))
        self.head = nn.Linear(d, 2)

    def forward(self, idx):
        pad = idx == 0
        x = self.emb(idx)
        a, _ = self.attn(x, x, x, key_padding_mask=pad, need_weights=False)
        x = self.ln(x + a)
        x = x + self.ff(x)
        keep = (~pad).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))


def padded_tokens(n=32, T=24, V=40, seed=0):
    """Variable lengths 4..T, zero padding at the end."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        idx = torch.randint(1, V, (n, T), generator=g)
        lens = torch.randint(4, T + 1, (n,), generator=g)
        idx[torch.arange(T)[None] >= lens[:, None]] = 0
        hi = ((idx >= V // 2) & (idx > 0)).sum(1)
        lo = ((idx < V // 2) & (idx > 0)).sum(1)
        return idx, (hi > lo).long()
    return batch


def test_multihead_attention_key_padding_mask_padding_idx_variable_lengths_headroom():
    steps = 200
    torch.manual_seed(0)
    w, losses, scales = fit(PaddedAttn(), padded_tokens(), ce, steps=steps, lr=2e-3, headroom=True,
                            sched=warmup_cosine(20, steps))
    healthy(losses, scales, fall=0.6)
    quiet(w)


def test_embedding_padding_idx_bag_of_words_sum_pool_long_documents_headroom():
    """A padding_idx embedding summed (not averaged) over documents of up to 200 tokens: the pooled fp16 sum grows
    with document length (~1e2 per feature) and varies batch to batch; an MLP classifier on it, 250 steps."""
    steps, V = 250, 200

    class BoW(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 32, padding_idx=0)
            self.pool = nn.Identity()
            self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))

        def forward(self, idx):
            return self.mlp(self.pool(self.emb(idx).sum(1)))

    def batch(i):
        g = gen(i)
        y = torch.randint(0, 3, (32,), generator=g)
        lo = (y * (V // 3)).clamp(min=1)
        idx = lo[:, None] + torch.randint(0, V // 3, (32, 200), generator=g)
        noise = torch.rand(32, 200, generator=g) < 0.5
        idx[noise] = torch.randint(1, V, (int(noise.sum()),), generator=g)
        lens = torch.randint(20, 201, (32,), generator=g)
        idx[torch.arange(200)[None] >= lens[:, None]] = 0
        return idx, y
    torch.manual_seed(0)
    w, losses, scales = fit(BoW(), batch, ce, steps=steps, lr=1e-3, headroom=True)
    healthy(losses, scales, fall=0.5)
    quiet(w)


# --- 15. a first-step overflow that GradScaler backs off from -----------------------------------------------------

@pytest.mark.parametrize("init_scale", [2.0 ** 16, 2.0 ** 24], ids=["default_init", "init_2_24"])
def test_first_steps_overflow_sum_reduction_backs_off_then_trains_150_steps(init_scale):
    """A loss summed over a batch of 256 (reduction='sum'): at the initial scale the fp16 gradients overflow on the
    first step(s), GradScaler skips them and halves until it fits, then trains every step. Benign: at most info."""
    steps = 150
    torch.manual_seed(0)
    w, losses, scales = fit(mlp(16, 64, 4), classes(n=256), lambda m, x, y: F.cross_entropy(m(x).float(), y,
                            reduction="sum"), steps=steps, lr=1e-3, scaler_kw=dict(init_scale=init_scale))
    skipped = [r.step for r in w.steps if r.skipped]
    assert skipped and skipped[0] == 0 and max(skipped) < 16, skipped
    healthy(losses, scales, fall=0.6, max_late_backoffs=0)
    quiet(w)


# --- 16. weight tying -------------------------------------------------------------------------------------------------

def test_tied_embedding_and_head_transformer_lm_warmup_cosine_250_steps_headroom():
    """The LM head's weight is the token embedding's (one Parameter, used at the input and the output, its gradient
    the sum of both uses); warmup 25 then cosine to 10%, 250 steps."""
    steps = 250
    torch.manual_seed(0)
    m = TinyLM(tied=True)
    assert m.head.weight is m.tok.weight
    w, losses, scales = fit(m, tokens(seed=1), lm_loss, steps=steps, lr=3e-3, headroom=True,
                            sched=warmup_cosine(25, steps, 0.1))
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 17. a model called twice per step ------------------------------------------------------------------------------

class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x):
        return F.normalize(self.enc(x).float(), dim=-1)


def test_siamese_encoder_called_twice_per_step_contrastive_margin_headroom():
    """The same encoder (with BatchNorm) on two views per step; a contrastive loss: pairs of the same class pulled
    together, others pushed past a margin of 0.5 on the cosine distance. 250 steps."""
    steps = 250
    data = classes(n=64, scale=3.0)

    def loss(m, x, y):
        perm = torch.roll(torch.arange(x.shape[0]), 1)
        a, b = m(x), m(x[perm] + 0.1 * torch.randn_like(x))
        same = (y == y[perm]).float()
        d = 1 - (a * b).sum(-1)
        return (same * d.pow(2) + (1 - same) * F.relu(0.5 - d).pow(2)).mean()
    torch.manual_seed(0)
    w, losses, scales = fit(Siamese(), data, loss, steps=steps, lr=2e-3, headroom=True)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 18. optimizers other than Adam --------------------------------------------------------------------------------

OPTS = {
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=3e-4, momentum=0.9, centered=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=2e-3, foreach=True),
    "adamw_fused_false": lambda p: torch.optim.AdamW(p, lr=2e-3, fused=False, foreach=False),
}


@pytest.mark.parametrize("name", list(OPTS))
def test_optimizers_sgd_nesterov_adagrad_rmsprop_adamw_foreach_fused_false_150_steps_headroom(name):
    """Each optimizer on the residual MLP at input scale 5 (RMSprop's and Adagrad's first updates are ~lr/sqrt(1 -
    alpha) x the later ones: a large first step by design), 150 steps."""
    steps = 150
    torch.manual_seed(0)
    w, losses, scales = fit(ResMLP(n=2), classes(scale=5.0), ce, steps=steps, headroom=True,
                            opt=lambda m: OPTS[name](m.parameters()))
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 19. a classifier on separable data: logits grow like log(t) forever -------------------------------------------

def test_separable_data_logits_keep_growing_logarithmically_400_steps_headroom():
    """Linearly separable classes without label smoothing or weight decay: cross-entropy drives the logits up
    without bound but only ~log(t) (the margin grows ever more slowly), so the output's headroom shrinks for the whole
    run at a vanishing rate and never nears fp16's max."""
    steps = 400
    torch.manual_seed(0)
    wsep = torch.randn(16, generator=gen(77))

    def batch(i):
        x = torch.randn(64, 16, generator=gen(i))
        y = (x @ wsep > 0).long()
        return x + 0.5 * (y[:, None] * 2 - 1) * wsep / wsep.norm(), y
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    w, losses, scales = fit(m, batch, ce, steps=steps, lr=1e-2, clip=None, headroom=True,
                            opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    healthy(losses, scales, fall=0.1)
    quiet(w)


# --- 20. warm restarts: activations regrow each cycle -------------------------------------------------------------

def test_cosine_annealing_warm_restarts_t0_50_tmult_2_350_steps_headroom():
    """CosineAnnealingWarmRestarts (T_0=50, T_mult=2: restarts at 50, 150): each restart throws the lr back to its
    peak and the residual stream moves again, then settles; 350 steps on unnormalised inputs (scale 20)."""
    steps = 350
    torch.manual_seed(0)
    m = ResMLP(n=2)
    o = torch.optim.AdamW(m.parameters(), lr=3e-3)
    w, losses, scales = fit(m, classes(scale=20.0), ce, steps=steps, opt=o, headroom=True,
                            sched=torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=50, T_mult=2))
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 21. the large-batch linear scaling rule: lr warmup 0.1 -> 1.6 -------------------------------------------------

def test_large_batch_sgd_linear_scaling_warmup_to_lr_1_6_then_cosine_bn_200_steps_headroom():
    """Goyal et al.: batch 512, SGD momentum 0.9, lr warmed up linearly from 0.1 to 1.6 over 40 steps (the lr grows
    16x: so do the updates), then cosine; BatchNorm keeps the activations at unit scale while weight norms grow."""
    steps = 200
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 128), nn.BatchNorm1d(128),
                      nn.ReLU(), nn.Linear(128, 4))
    o = torch.optim.SGD(m.parameters(), lr=1.6, momentum=0.9, weight_decay=1e-4, nesterov=True)

    def f(s):
        if s < 40:
            return (0.1 + (1.6 - 0.1) * s / 40) / 1.6
        return 0.5 * (1 + math.cos(math.pi * (s - 40) / (steps - 40)))
    w, losses, scales = fit(m, classes(n=512), ce, steps=steps, opt=o, clip=None, headroom=True,
                            sched=torch.optim.lr_scheduler.LambdaLR(o, f))
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 22. the scaled gradients climb towards fp16's max for 230 steps (growth_interval=10) ------------------------

def test_gradscaler_from_2_growth_interval_10_climbs_to_2_24_over_230_steps_backs_off_once_headroom():
    """GradScaler(init_scale=2, growth_interval=10), an objective weighted 0.015: the scale doubles every 10 steps
    from 2 to 2**24 (step 229), so the scaled fp16 gradients of every layer climb steadily by 0.1 bit per step
    towards fp16's max for the whole run (the scaler's design: it probes for the largest scale that fits). At step
    233 one batch overflows at 2**24, the step is skipped and the scale halves, then regrows; 245 steps, the
    per-step headroom series on. A backward headroom that shrinks because the scaler grows is no early warning."""
    steps = 245
    torch.manual_seed(0)  # (the model is built before fit seeds: without this its weights follow the tests before)
    w, losses, scales = fit(ResMLP(n=2), classes(scale=5.0), lambda m, x, y: 0.015 * ce(m, x, y), steps=steps,
                            lr=1e-3, headroom=True, scaler_kw=dict(init_scale=2.0, growth_interval=10))
    assert max(scales) == 2.0 ** 24, max(scales)
    backs = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]
    assert len(backs) == 1 and backs[0] > 200, (backs, scales)
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 23. GAN with five critic steps per generator step, one scaler --------------------------------------------------

@pytest.mark.parametrize("watch_opt", ["D", "G"])
def test_gan_five_discriminator_steps_per_generator_step_one_scaler_updated_after_each_step(watch_opt):
    """n_critic=5: five D steps (each scale -> backward -> unscale_(optD) -> clip -> step(optD) -> update) then one
    G step (unscale_(optG) -> clip -> step(optG) -> update) on the same GradScaler; the GAN module watched with D's
    or G's optimizer, so the watched optimizer steps 5 times per update of the other, or once per 6 updates.
    120 generator iterations."""
    torch.manual_seed(0)
    gan = GAN()
    oD = torch.optim.Adam(gan.D.parameters(), lr=5e-4, betas=(0.5, 0.999))
    oG = torch.optim.Adam(gan.G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(gan, optimizer=oD if watch_opt == "D" else oG, scaler=sc)
    dist0 = ring_distance(gan.G)
    ld, lg, scales = [], [], []
    for i in range(120):
        for k in range(5):
            real, z = ring(64, 5 * i + k), torch.randn(64, 8, generator=gen(20_000 + 5 * i + k))
            oD.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                with torch.no_grad():
                    fake = gan.G(z)
                dr, df = gan.D(real).float(), gan.D(fake).float()
                loss_d = F.softplus(-dr).mean() + F.softplus(df).mean()
            sc.scale(loss_d).backward()
            sc.unscale_(oD)
            torch.nn.utils.clip_grad_norm_(gan.D.parameters(), 5.0)
            sc.step(oD)
            sc.update()
            ld.append(loss_d.item())
        oG.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            dg = gan.D(gan.G(torch.randn(128, 8, generator=gen(30_000 + i)))).float()
            loss_g = F.softplus(-dg).mean()
        sc.scale(loss_g).backward()
        sc.unscale_(oG)
        torch.nn.utils.clip_grad_norm_(gan.G.parameters(), 5.0)
        sc.step(oG)
        sc.update()
        lg.append(loss_g.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(ld, bounded=3.0, first=50)
    healthy(lg, scales, bounded=6.0)
    assert ring_distance(gan.G) < 0.5 * dist0, (dist0, ring_distance(gan.G))
    quiet(w)


# --- 24. tiny values that are legitimately tiny ----------------------------------------------------------------------

class RBF(nn.Module):
    """Gaussian radial-basis features exp(-|x - c|^2 / (2 s^2)) over 128 centres (computed in fp32; the read-out
    Linear takes them in fp16 under autocast): a point is near a few centres, so most features are tiny (1e-5 ..
    1e-30, subnormal or zero in fp16) and only the near ones matter: a far feature's contribution to the O(1)
    output is below fp16's resolution there whatever its own precision."""

    def __init__(self, d=4, k=128):
        super().__init__()
        self.centres = nn.Parameter(torch.randn(k, d, generator=gen(3)) * 1.5)
        self.log_s = nn.Parameter(torch.full((k,), math.log(0.4)))

    def forward(self, x):
        d2 = (x[:, None, :] - self.centres[None]).pow(2).sum(-1)
        return torch.exp(-d2 / (2 * torch.exp(2 * self.log_s)))


def test_rbf_network_most_gaussian_features_tiny_in_fp16_headroom():
    """An RBF network (128 Gaussian features with learnable centres and widths, a linear read-out) regressing a
    smooth function of 4 inputs, 200 steps."""
    steps = 200
    torch.manual_seed(0)
    m = nn.Sequential(RBF(), nn.Linear(128, 1))

    def batch(i):
        x = torch.randn(128, 4, generator=gen(i))
        return x, torch.sin(x[:, 0]) + 0.5 * torch.cos(2 * x[:, 1]) * x[:, 2]

    def loss(m, x, y):
        out = m(x)
        return F.mse_loss(out.float().squeeze(-1), y)
    w, losses, scales = fit(m, batch, loss, steps=steps, lr=1e-2, headroom=True)
    healthy(losses, scales, fall=0.6)
    quiet(w)


class Tagger(nn.Module):
    """A multi-label tagger over 256 tags (about 2 present per example): logits for BCE-with-logits, and the tags'
    probabilities from an nn.Sigmoid for the metric (as a model's forward often returns both). The absent tags'
    logits fall to -10 .. -20 as it learns: their probabilities (4.5e-5 .. 2e-9) sit below fp16's normal range
    (6.1e-5) or flush to zero, which is what "absent" means at fp16's resolution."""

    def __init__(self, K=256):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.logits = nn.Linear(128, K)
        self.prob = nn.Sigmoid()
        with torch.no_grad():
            self.logits.bias.fill_(-math.log((K - 2) / 2))   # the prior (RetinaNet-style bias init)

    def forward(self, x):
        z = self.logits(self.body(x))
        return z, self.prob(z)


def test_multilabel_tagger_sigmoid_probabilities_of_absent_tags_below_fp16_normal_range():
    """256 tags, each example's 2 tags determined by its features; BCE with logits in fp32; the sigmoid
    probabilities (returned for the metric) of the ~254 absent tags fall far below 6.1e-5. 260 steps (step 200 is
    one of the default sampling's full-statistics steps); the
    precision of a probability of 1e-6 is irrelevant (it is 0 to any threshold)."""
    steps, K = 260, 256
    proj = torch.randn(16, K, generator=gen(11))

    def batch(i):
        x = torch.randn(64, 16, generator=gen(i))
        top = (x @ proj).topk(2, dim=1).indices
        return x, torch.zeros(64, K).scatter_(1, top, 1.0)
    metric = []

    def loss(m, x, y):
        z, p = m(x)
        metric.append(((p.float() > 0.5) == (y > 0)).float().mean().item())
        return F.binary_cross_entropy_with_logits(z.float(), y) * K / 8
    torch.manual_seed(0)
    m = Tagger()
    seen = []
    m.prob.register_forward_hook(lambda mod, i, o: seen.append((o.detach() < 2 ** -14).float().mean().item()))
    w, losses, scales = fit(m, batch, loss, steps=steps, lr=3e-3, headroom=True)
    healthy(losses, scales, fall=0.6)
    assert seen[-1] > 0.5, seen[::20]
    quiet(w)
