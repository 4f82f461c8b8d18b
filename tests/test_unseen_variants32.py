"""Thirty-second set: shared/FP16.md failure patterns in variants the earlier probes do not build, each starting on an
UNSAMPLED step (9-13, or a natural onset there) at ampdoctor's DEFAULT sampling (watch(model, optimizer=, scaler=):
full statistics on step 0 and every 200th, and on a batch with more than 8x the input values of any before; no batch
here grows that much). Every model is trained with the ordinary loop (probe_harness.train_loop: fp16 CPU autocast +
GradScaler("cpu"), scale(loss).backward, unscale_, clip, step, update).

Each failure is proven by an independent oracle first: probe_harness.Producer's hooks (the innermost module whose
output, or input gradient, turns non-finite from finite inputs; real_fwd / real_bwd: the loss and the scaler's first
skip at that step), plus the case's mechanism re-run on the bad step's weights and batch (fp16 non-finite, fp32 or
the fixed code finite). Then the rule must be an error at the PRODUCER among the report's first three findings, at that
step, and no error at the modules that only passed the value on.

 1. a linear-chain CRF tagger whose forward algorithm is log(exp(.).sum()) by hand in the emissions' fp16 (the
    transition matrix cast to it): trained on 5-word queries, the first 20-word sentences (step 12; 4x the values)
    make alpha pass ln(65504) -> overflow at `crf`, not emit/enc/emb;
 2. RoPE whose positions are made in the activations' dtype (`arange(T).to(q.dtype)`): a context-length warmup from
    512 to 2560 tokens at step 10 puts positions past 2048, where fp16 rounds neighbours together (2049 -> 2048,
    rotary phases off by up to 1 rad); nothing goes inf/NaN -> precision_loss at `attn.rope`, step 10;
 3. a softmax cross-entropy written by hand (exp(z) / exp(z).sum(), -log) in a `criterion` module, at lr 5e-2 on a
    separable problem: the logits grow as the model fits and pass 11.09 at step 11 (natural onset, no data change)
    -> overflow at `criterion`;
 4. a phase-aware front end, torch.atan2(im, re) of a bias-free learnable filterbank: from step 10 each batch holds a
    muted microphone's frame (dither, 1e-3 of the level); the forward is finite, atan2's backward takes the
    reciprocal of re^2 + im^2 (subnormal in fp16) = inf at any loss scale -> overflow (backward) at `phase`;
 5. MixMatch's Sharpen p^(1/T) / sum (T = 0.5, the paper's default) over a 10,000-class label space, after a
    supervised warm-up: a blank frame in the unlabelled stream at step 11 has a flat guess (p = 1e-4), every p^2 is
    0 in fp16 and the sharpened target 0 / 0 -> nan_origin (or underflow) at `sharpen`;
 6. a next-item recommender's full-catalog softmax loss with torch.logsumexp on the fp16 logits ("the stable
    form"): the catalog grows from 32,768 to 131,072 active items at step 12; with near-uniform logits the sum inside
    logsumexp (after the max) is ~ the item count, inf past 65504 -> overflow at `criterion` (and silently: the
    backward exp(z - inf) is 0, nothing is skipped, the loss is logged inf);
 7. V-Net's soft Dice with batch-wide sums in fp16 (nnU-Net's batch_dice): a site whose tiles are ~95% organ at
    step 9 makes sum(g^2) and 2 sum(p g) pass 65504, inf / inf -> overflow at `dice`, not the convs;
 8. an entity linker masking padded candidates with the "fp16-safe" -1e4 and dividing by a temperature of 0.05
    AFTER masking (-2e5 = -inf in fp16): ragged candidate lists begin at step 13 and one mention's list is empty, its
    row all -inf, log_softmax NaN, the loss NaN (masked_fill's backward zeroes the row: nothing is skipped) ->
    mask_value_overflow (or overflow / nan_origin) at `linker`, an error, step 13.
Healthy twins (the fix on the same batches; losses finite and falling, nothing skipped, no producer, no warning or
error): 1 with torch.logsumexp in the CRF; 6 with the logsumexp taken on logits.float().

What ampdoctor said. Right: 1 `[error] overflow at crf aten::sum step 12`; 3 `[error] overflow at criterion aten::exp
step 11`; 4 `[error] overflow at phase aten::reciprocal step 10` (backward); 5 `[error] nan_origin at sharpen aten::div
step 11`; 6 `[error] overflow at criterion aten::logsumexp step 12`; 7 `[error] overflow at dice aten::mul step 9`;
both twins quiet.
Wrong when written (strict xfails; 2 and 8 fixed since):
 2. (fixed) an EMPTY report. integer_precision (rules/numeric.py) read the integer probes that record/modulehooks.py
    takes only on sampled steps; step 10 is not one, and nothing goes non-finite to trigger a capture. Now the
    modules whose inputs a sampled step found to be an integer ramp are probed on routine steps too
    (record/intwatch.py): `[warning] precision_loss at attn.rope step 10`, as every=1 said.
 8. (a strict xfail when written, fixed) only `[info] overflow at linker step 13: ... emits -inf from finite inputs
    (first at step 14), but later ops absorb it: the loss and the outputs stayed finite`, verdict "Healthy". Step 13
    (unsampled, loss and output NaN, gradients finite, no skip) has no forward producer in its record;
    rules/origins.py groups the sampled steps 14-15 (benign -inf of the ragged rows) as `absorbed` (info) and dates
    it 13; a report with nothing wrong replayed only an unexplained skip's capture, and the fold dropped a replay
    overflow beside an (info) one at that module. Now a report with nothing wrong also replays the capture of a
    step whose loss or output went non-finite (replaychoice.unexplained_nonfinite), and the replay's error replaces an
    `absorbed` info finding at that module when the captured step's loss or output was non-finite:
    `[error] overflow at linker aten::div step 13`.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_unseen_variants32.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import at_top3, error_at, finite, healthy, real_bwd, real_fwd, snap_before, train_loop
from scenarios import gen, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
FWD = ("overflow", "nan_origin")     # an op inside the producer made inf, a later op of the same module NaN
BWD = ("overflow", "nan_origin")


def out_loss(out, *args):
    """train_loop's loss_fn for models that return their own (scalar) loss."""
    return out.float()


# ======================================================================================================================
# 1 + twin. a linear-chain CRF whose forward algorithm is log(sum(exp(.))) by hand, in the emissions' fp16
# ======================================================================================================================
K_TAGS, CRF_LONG = 5, 12


class CRF(nn.Module):
    """A linear-chain CRF layer (start scores + a K x K transition matrix) whose negative log-likelihood runs the
    forward algorithm in log space. `stable=False`: the log-sum-exp written out, log(exp(.).sum()) (no max
    subtracted), with the parameters cast to the emissions' dtype ("AMP support" in ports of pytorch-crf);
    `stable=True`: torch.logsumexp, the fix."""

    def __init__(self, k, stable=False):
        super().__init__()
        self.stable = stable
        self.start = nn.Parameter(torch.zeros(k))
        self.trans = nn.Parameter(0.1 * torch.randn(k, k, generator=gen(11)))

    def lse(self, x, dim):
        return torch.logsumexp(x, dim) if self.stable else torch.log(torch.exp(x).sum(dim))

    def forward(self, em, tags):
        trans, start = self.trans.to(em.dtype), self.start.to(em.dtype)
        alpha = start + em[:, 0]
        for t in range(1, em.shape[1]):
            alpha = self.lse(alpha[:, :, None] + trans[None], 1) + em[:, t]
        log_z = self.lse(alpha, 1)
        gold = (start[tags[:, 0]] + em.gather(2, tags[..., None]).squeeze(-1).sum(1)
                + trans[tags[:, :-1], tags[:, 1:]].sum(1))
        return (log_z - gold).mean() / em.shape[1]      # per token


class Tagger(nn.Module):
    """A small sequence tagger: embedding -> tanh Linear -> emission Linear -> CRF (returns the mean NLL)."""

    def __init__(self, stable=False):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.enc = nn.Linear(16, 32)
        self.emit = nn.Linear(32, K_TAGS)
        self.crf = CRF(K_TAGS, stable)

    def forward(self, ids, tags):
        return self.crf(self.emit(torch.tanh(self.enc(self.emb(ids)))), tags)


def tag_batch(i):
    """16 sentences; the tag is a function of the word. Search queries of 5 words until step 12, when the first
    shard of full sentences (20 words: 4x the values, below the 8x that makes a step sampled) arrives."""
    g = gen(100 + i)
    n = 20 if i >= CRF_LONG else 5
    ids = torch.randint(0, 50, (16, n), generator=g)
    return ids, ids // 10


def test_crf_forward_algorithm_by_hand_overflows_fp16_on_the_first_long_sentences():
    torch.manual_seed(0)
    m, store = Tagger(), {}
    r = train_loop(m, tag_batch, out_loss, 16, lr=1e-2, after_step=snap_before(m, CRF_LONG, store))
    real_fwd(r, "crf", CRF_LONG)
    # the mechanism: the same emissions through the same CRF in fp32 are finite; in fp16 exp(alpha + trans) is inf
    mm = Tagger()
    mm.load_state_dict(store["sd"])
    ids, tags = tag_batch(CRF_LONG)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.float16):
            em = mm.emit(torch.tanh(mm.enc(mm.emb(ids))))
        assert em.dtype == torch.float16 and finite(em)
        assert not finite(mm.crf(em, tags)) and finite(mm.crf(em.float(), tags))
    rep = r["w"].report()
    error_at(rep, FWD, "crf", step=CRF_LONG, phase="forward")
    no_error_at(rep, ("emit", "enc", "emb"))


def test_twin_crf_with_torch_logsumexp_is_quiet_on_the_same_long_sentences():
    torch.manual_seed(0)
    m = Tagger(stable=True)
    healthy(train_loop(m, tag_batch, out_loss, 16, lr=1e-2, backward=True))


# ======================================================================================================================
# 2. rotary embeddings whose positions are cast to the activations' fp16: a context-length warmup past 2048
# ======================================================================================================================
ROPE_LONG, SHORT_T, LONG_T = 10, 512, 2560


class Rotary(nn.Module):
    """RoPE on (B, H, T, d) with the positions it is handed; `fp32`: the angles are computed from fp32 positions and
    only cos/sin are cast (the fix)."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x, pos):
        ang = pos[:, None] * self.inv_freq.to(pos.dtype)[None]      # fp16 positions: fp16 angles
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class RopeAttn(nn.Module):
    def __init__(self, d=32, h=2, fp32=False):
        super().__init__()
        self.h, self.fp32 = h, fp32
        self.qkv = nn.Linear(d, 3 * d)
        self.rope = Rotary(d // h)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.reshape(B, T, self.h, D // self.h).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        # the bug: positions made in the activations' dtype (HF's `position_ids.to(value_states.dtype)` pattern)
        pos = torch.arange(T, device=x.device).to(torch.float32 if self.fp32 else q.dtype)
        q, k = self.rope(q, pos), self.rope(k, pos)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, T, D))


class RopeLM(nn.Module):
    def __init__(self, fp32=False, V=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.norm = nn.LayerNorm(d)
        self.attn = RopeAttn(d, fp32=fp32)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.attn(self.norm(x))
        x = x + self.mlp(x)
        return self.head(x)


def rope_batch(i):
    """One sequence: a copy task (the second half repeats the first), 512 tokens until step 10, when the context
    warmup moves to 2560 tokens (5x the values: below the 8x that makes a step sampled)."""
    g = gen(200 + i)
    T = LONG_T if i >= ROPE_LONG else SHORT_T
    half = torch.randint(0, 64, (1, T // 2), generator=g)
    return (torch.cat([half, half], 1),)


def lm_loss(out, ids):
    return F.cross_entropy(out[:, :-1].float().reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))


def test_rope_positions_in_fp16_collide_past_2048_after_a_context_length_warmup():
    torch.manual_seed(0)
    m = RopeLM()
    seen, cur = {}, {}
    h = m.attn.rope.register_forward_pre_hook(      # the positions rope receives, per step (train_loop keeps the step)
        lambda mod, args: seen.setdefault(cur["step"], []).append((args[1].dtype, args[1].double())))
    r = train_loop(m, rope_batch, lm_loss, 13, lr=3e-3, hooks=cur)
    h.remove()
    # real: no inf/NaN anywhere, nothing skipped; from step 10 the fp16 positions past 2048 are rounded together
    assert r["first"] is None and not r["skipped"] and all(map(math.isfinite, r["losses"])), r
    for step, calls in seen.items():
        dt, pos = calls[0]
        assert dt == torch.float16
        exact = torch.arange(pos.numel(), dtype=torch.float64)
        wrong = int((pos != exact).sum())
        assert (wrong > 0) == (step >= ROPE_LONG), (step, wrong)
    pos16 = torch.arange(LONG_T).half()
    assert pos16[2049] == pos16[2048] and (pos16.double() != torch.arange(LONG_T)).sum() >= 200
    # and what the rotation does with them: RoPE of the same vectors with the fp16 and the exact positions
    x = torch.randn(1, 1, LONG_T, 16, generator=gen(7))
    rot = m.attn.rope
    with torch.no_grad():
        err = (rot(x, pos16.float()) - rot(x, torch.arange(LONG_T).float())).abs()
    assert err[..., :2048, :].max() < 1e-4 and err[..., 2048:, :].max() > 0.5, err.max()
    rep = r["w"].report()
    at_top3(rep, "precision_loss", "attn.rope", step=ROPE_LONG, severity=("warning", "error"))


# ======================================================================================================================
# 3. a softmax cross-entropy written by hand, exp(z) / exp(z).sum(), in fp16: the logits grow as the model fits
# ======================================================================================================================
class SoftmaxCE(nn.Module):
    """The textbook softmax + negative log-likelihood, written out (no max subtracted)."""

    def forward(self, logits, y):
        e = torch.exp(logits)
        p = e / e.sum(-1, keepdim=True)
        return -torch.log(p.gather(1, y[:, None])).mean()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)
        self.criterion = SoftmaxCE()

    def forward(self, x, y):
        return self.criterion(self.head(self.body(x)), y)


_CLS_W = torch.randn(20, 10, generator=gen(21))


def cls_batch(i):
    """64 samples of a separable 10-class problem (the class is the argmax of a fixed projection); the same
    distribution every step: nothing in the data changes."""
    g = gen(300 + i)
    x = torch.randn(64, 20, generator=g)
    return x, (x @ _CLS_W).argmax(-1)


def test_hand_written_softmax_ce_overflows_when_the_logits_pass_11_as_the_model_fits():
    torch.manual_seed(0)
    m = Classifier()
    zmax = []
    h = m.head.register_forward_hook(lambda mod, a, out: zmax.append(out.detach().float().max().item()))
    r = train_loop(m, cls_batch, out_loss, 20, lr=5e-2)
    h.remove()
    onset = r["first"][1] if r["first"] else None
    # real: a natural onset mid-run: the first step whose largest fp16 logit passes ln(65504) = 11.09 (or whose sum of
    # exps passes 65504): the hand-written loss is the first module with a non-finite output, the loss is non-finite
    assert onset is not None and 7 <= onset <= 20, (onset, zmax)
    real_fwd(r, "criterion", onset)
    assert max(zmax[:onset]) < 11.1 and zmax[onset] > 10.0, zmax
    assert all(map(math.isfinite, r["losses"][:onset])) and not r["skipped"][:1] < [onset], r
    rep = r["w"].report()
    error_at(rep, FWD, "criterion", step=onset, phase="forward")
    no_error_at(rep, ("head", "body.2", "body"))


# ======================================================================================================================
# 4. the phase of a learnable filterbank, torch.atan2(im, re), in fp16: a muted microphone's clip (backward only)
# ======================================================================================================================
MUTE_FROM = 10


class Phase(nn.Module):
    def forward(self, re, im):
        return torch.atan2(im, re)


class PhaseNet(nn.Module):
    """A learnable (bias-free) complex filterbank (real and imaginary Linear maps of a 64-sample frame), the phase of
    each bin as the feature, a classifier head (phase-aware front ends; the magnitude is not used)."""

    def __init__(self):
        super().__init__()
        self.fb_re = nn.Linear(64, 32, bias=False)
        self.fb_im = nn.Linear(64, 32, bias=False)
        self.phase = Phase()
        self.head = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.head(self.phase(self.fb_re(x), self.fb_im(x)))


_TONES = torch.randn(4, 64, generator=gen(31))


def frame_batch(i):
    """32 frames of 4 sound classes; from step 10 a new recording site's shard holds one frame per batch from a
    muted microphone: only the dither (amplitude 1e-3 of the usual level, same shape)."""
    g = gen(400 + i)
    y = torch.randint(0, 4, (32,), generator=g)
    x = _TONES[y] + 0.3 * torch.randn(32, 64, generator=g)
    if i >= MUTE_FROM:
        x[7] = 1e-3 * torch.randn(64, generator=g)
    return x, y


def ce(out, x, y):
    return F.cross_entropy(out.float(), y)


def first_arg(m):
    return lambda x, *rest: m(x)


def test_atan2_phase_of_a_muted_frame_has_an_infinite_gradient_in_fp16():
    torch.manual_seed(0)
    m, store = PhaseNet(), {}
    r = train_loop(m, frame_batch, ce, 14, lr=3e-3, backward=True, call=first_arg(m),
                   after_step=snap_before(m, MUTE_FROM, store))
    real_bwd(r, "phase", MUTE_FROM)
    # the mechanism: atan2's backward is g * re / (re^2 + im^2) with the reciprocal taken in fp16: for the muted frame
    # re^2 + im^2 is below 1 / 65504 (subnormal in fp16), its reciprocal inf; in fp32 the gradient is finite
    mm = PhaseNet()
    mm.load_state_dict(store["sd"])
    x = frame_batch(MUTE_FROM)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        re, im = mm.fb_re(x), mm.fb_im(x)
    den = (re * re + im * im)[7]
    assert re.dtype == torch.float16 and bool(((den > 0) & (den < 1 / 65504)).any()), den
    for dt in (torch.float16, torch.float32):
        a, b = re.detach().to(dt).requires_grad_(), im.detach().to(dt).requires_grad_()
        torch.atan2(b, a).sum().backward()
        assert finite(torch.atan2(b, a)) and finite(a.grad) == (dt == torch.float32), dt
    # every later batch brings its muted frame: the backward is inf at any loss scale, the scaler keeps backing off
    assert r["skipped"] == list(range(MUTE_FROM, 14)), r
    rep = r["w"].report()
    error_at(rep, BWD, "phase", step=MUTE_FROM, phase="backward")
    no_error_at(rep, ("fb_re", "fb_im", "head.0", "head.2", "head"))


# ======================================================================================================================
# 5. MixMatch's sharpening p ** (1 / T) / sum, T = 0.5, in fp16 over a 10,000-class label space: a blank frame
# ======================================================================================================================
N_CLS, BLANK = 10000, 11


class Sharpen(nn.Module):
    """MixMatch's Sharpen(p, T) = p^(1/T) / sum p^(1/T) (T = 0.5, the paper's default)."""

    def __init__(self, T=0.5):
        super().__init__()
        self.T = T

    def forward(self, p):
        pt = p ** (1 / self.T)
        return pt / pt.sum(-1, keepdim=True)


class MixMatchNet(nn.Module):
    """A bias-free backbone (as conv backbones followed by norms are) and a bias-free 10,000-way head (a product
    recogniser's label space); the MixMatch loss in the
    forward: cross-entropy on the labelled batch, the L2 between the prediction on an augmented unlabelled view and
    the sharpened guess on the other (the guess under no_grad)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False), nn.ReLU())
        self.head = nn.Linear(64, N_CLS, bias=False)
        self.sharpen = Sharpen(0.5)

    def forward(self, xl, y, xu1, xu2):
        loss_x = F.cross_entropy(self.head(self.body(xl)).float(), y)
        with torch.no_grad():
            q = self.sharpen(torch.softmax(self.head(self.body(xu1)), -1))
        pu = torch.softmax(self.head(self.body(xu2)), -1)
        return loss_x + 100.0 * ((pu - q) ** 2).mean()


_MM_W = torch.randn(32, N_CLS, generator=gen(41))


def mm_batch(i):
    """16 labelled and 16 unlabelled samples (two noisy views each); from step 11 the unlabelled stream holds one
    blank frame (all zeros: a corrupted decode / a lens cap), both views of it."""
    g = gen(500 + i)
    xl = torch.randn(16, 32, generator=g)
    y = (xl @ _MM_W).argmax(-1)
    xu = torch.randn(16, 32, generator=g)
    if i == BLANK:
        xu[3] = 0.0
    return xl, y, xu + 0.05 * torch.randn(16, 32, generator=g) * (xu != 0), xu + 0.05 * torch.randn(
        16, 32, generator=g) * (xu != 0)


def pretrained_mixmatch():
    """The supervised warm-up MixMatch starts from: 20 fp32 AdamW steps on labelled batches (before the watch)."""
    torch.manual_seed(0)
    m = MixMatchNet()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-2)
    for i in range(20):
        g = gen(9000 + i)
        x = torch.randn(128, 32, generator=g)
        loss = F.cross_entropy(m.head(m.body(x)), (x @ _MM_W).argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


def test_mixmatch_sharpen_of_a_blank_frames_flat_guess_underflows_to_0_over_0():
    m, store = pretrained_mixmatch(), {}
    r = train_loop(m, mm_batch, out_loss, 14, lr=1e-3, init_scale=256.0, after_step=snap_before(m, BLANK, store))
    real_fwd(r, "sharpen", BLANK)
    # the mechanism: the blank frame's guess is flat (p = 1e-4 for every class), every p^2 is below fp16's smallest
    # subnormal; the other samples' guesses are peaked enough to keep nonzero squares
    mm = MixMatchNet()
    mm.load_state_dict(store["sd"])
    xu1 = mm_batch(BLANK)[2]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        p = torch.softmax(mm.head(mm.body(xu1)), -1)
    assert p.dtype == torch.float16 and p[3].max() < 1.7e-4 and bool((p[3] ** 2 == 0).all())
    assert bool((p[[0, 1, 2, 4]] ** 2 > 0).any(-1).all())       # the other samples keep a nonzero sharpened guess
    assert finite(mm.sharpen(p.float())) and not finite(mm.sharpen(p))
    rep = r["w"].report()
    error_at(rep, FWD + ("underflow",), "sharpen", step=BLANK, phase="forward")
    no_error_at(rep, ("head", "body", "body.2", "body.3"))


# ======================================================================================================================
# 6 + twin. a full-catalog softmax loss with torch.logsumexp in fp16: the catalog grows past 65504 items
# ======================================================================================================================
N_MAX, N_OLD, GROW = 131072, 32768, 12


class CatalogNLL(nn.Module):
    """The full softmax over the catalog, -log p(pos) = logsumexp(logits) - logits[pos], written with torch.logsumexp
    "for stability" on the fp16 logits (`fp32=True`: on logits.float(), the fix)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, logits, pos):
        z = logits.float() if self.fp32 else logits
        return (torch.logsumexp(z, -1) - z.gather(1, pos[:, None]).squeeze(1)).mean()


class NextItem(nn.Module):
    """A next-item recommender: the mean of the user's last 8 items' embeddings through a small tower, scored against
    every active item of the (pre-allocated) item table."""

    def __init__(self, fp32=False):
        super().__init__()
        self.items = nn.Embedding(N_MAX, 16)
        nn.init.normal_(self.items.weight, std=0.02)
        self.tower = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.criterion = CatalogNLL(fp32)
        self.n_items = N_OLD

    def forward(self, hist, pos):
        u = self.tower(self.items(hist).mean(1))
        return self.criterion(u @ self.items.weight[:self.n_items].t(), pos)


_HITS = torch.randperm(N_OLD, generator=gen(61))[:256]


def item_batch(i):
    """64 users' last 8 items (from the whole active catalog) and the next one, one of the 256 best sellers."""
    g = gen(600 + i)
    n = N_MAX if i >= GROW else N_OLD
    hist = torch.randint(0, n, (64, 8), generator=g)
    return hist, _HITS[torch.randint(0, 256, (64,), generator=g)]


def catalog_grows(m):
    """after_step: the nightly refresh before step 12 activates a merged vendor's items (already allocated): 32768 ->
    131072 active items. The model's inputs keep their shape."""
    def after(i):
        if i == GROW - 1:
            m.n_items = N_MAX
    return after


def test_torch_logsumexp_over_a_131k_item_catalog_overflows_fp16():
    torch.manual_seed(0)
    m = NextItem()
    store = {}
    snap = snap_before(m, GROW, store)
    grow = catalog_grows(m)
    r = train_loop(m, item_batch, out_loss, 15, lr=3e-3, after_step=lambda i: (snap(i), grow(i)))
    real_fwd(r, "criterion", GROW, skip=False)
    # and silently so: logsumexp's backward exp(z - inf) is 0, the gradients stay finite, the scaler skips nothing and
    # every later step is taken on the positives' term alone (no normaliser), the logged loss inf
    assert r["skipped"] == [] and r["bad_loss"] == [12, 13, 14], r
    # the mechanism: every logit is near 0, so the sum inside logsumexp (after the max is subtracted) is ~ the number
    # of items: < 65504 for 32768, inf for 131072 in fp16; the same logsumexp in fp32 is finite (~11.8)
    mm = NextItem()
    mm.load_state_dict(store["sd"])
    mm.n_items = N_MAX
    hist, pos = item_batch(GROW)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        z = mm.tower(mm.items(hist).mean(1)) @ mm.items.weight.t()
        assert z.dtype == torch.float16 and finite(z) and z.abs().max() < 1.0
        assert not finite(torch.logsumexp(z, -1)) and finite(torch.logsumexp(z[:, :N_OLD], -1))
        assert finite(torch.logsumexp(z.float(), -1))
    rep = r["w"].report()
    error_at(rep, FWD, "criterion", step=GROW, phase="forward")
    no_error_at(rep, ("tower", "tower.0", "tower.2", "items"))


def test_twin_catalog_logsumexp_in_fp32_is_quiet_after_the_catalog_grows():
    torch.manual_seed(0)
    m = NextItem(fp32=True)
    r = train_loop(m, item_batch, out_loss, 15, lr=3e-3, backward=True, after_step=catalog_grows(m))
    ls = r["losses"]
    assert ls[GROW - 1] < ls[0] and ls[-1] < ls[GROW], ls    # learns before and after the growth (+ln 4 there)
    healthy(r, must_fall=1.2)


# ======================================================================================================================
# 7. V-Net's soft Dice with batch-wide sums (nnU-Net's batch_dice) in fp16: a site whose tiles are nearly all organ
# ======================================================================================================================
ORGAN = 9


class SoftDice(nn.Module):
    """V-Net's Dice loss 1 - 2 sum(p g) / (sum p^2 + sum g^2), the sums over the whole batch, on fp16 probabilities
    (under CPU autocast sigmoid, mul and sum stay in the logits' fp16)."""

    def forward(self, logits, target):
        p = torch.sigmoid(logits)
        g = target.to(p.dtype)
        inter = (p * g).sum()
        return 1 - 2 * inter / ((p * p).sum() + (g * g).sum())


class SegNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(8, 1, 1)
        self.dice = SoftDice()

    def forward(self, x, mask):
        return self.dice(self.out(self.enc(x)), mask)


def seg_batch(i):
    """8 tiles of 96 x 96 and their organ masks (a disc, ~15% of the tile); from step 9 the first batch from a
    site that acquires zoomed-in: the organ covers ~95% of every tile (same tile size, same number of values)."""
    g = gen(700 + i)
    yy, xx = torch.meshgrid(torch.arange(96.0), torch.arange(96.0), indexing="ij")
    c = 20 + 56 * torch.rand(8, 2, generator=g)
    r = (58.0 if i == ORGAN else 21.0) + 3 * torch.rand(8, generator=g)
    if i == ORGAN:
        c = 48 + 4 * torch.rand(8, 2, generator=g)
    mask = ((yy - c[:, 0, None, None]) ** 2 + (xx - c[:, 1, None, None]) ** 2 < r[:, None, None] ** 2).float()
    x = mask[:, None] * torch.tensor([0.8, 0.5, 0.3])[:, None, None] + 0.3 * torch.randn(8, 3, 96, 96, generator=g)
    return x, mask[:, None]


def test_batch_dice_sums_pass_65504_on_a_site_whose_tiles_are_nearly_all_organ():
    torch.manual_seed(0)
    m, store = SegNet(), {}
    r = train_loop(m, seg_batch, out_loss, 12, lr=1e-2, after_step=snap_before(m, ORGAN, store))
    real_fwd(r, "dice", ORGAN)
    # the mechanism: the organ's pixel count (sum g^2) passes 65504 and so does 2 sum(p g): inf / inf in fp16; the same
    # sums in fp32 are finite
    x, mask = seg_batch(ORGAN)
    assert mask.sum() > 65504 and max(seg_batch(i)[1].sum() for i in range(ORGAN)) < 20000
    mm = SegNet()
    mm.load_state_dict(store["sd"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        logits = mm.out(mm.enc(x))
        assert logits.dtype == torch.float16 and finite(logits)
        assert not finite(mm.dice(logits, mask)) and finite(mm.dice(logits.float(), mask))
    rep = r["w"].report()
    error_at(rep, FWD, "dice", step=ORGAN, phase="forward")
    no_error_at(rep, ("out", "enc", "enc.2", "enc.3"))


# ======================================================================================================================
# 8. an "fp16-safe" mask constant (-1e4) divided by a temperature AFTER masking: a mention with no candidate
# ======================================================================================================================
NO_CAND = 13


class Linker(nn.Module):
    """Scores a mention against its (padded) candidate entities: dot products, padding masked with -1e4 (the
    constant chosen to be fp16-safe), then a temperature of 0.05, log_softmax over the candidates."""

    def __init__(self, d=32, tau=0.05):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.tau = tau

    def forward(self, mention, cands, valid):
        s = (self.q(mention)[:, None] * self.k(cands)).sum(-1)
        s = s.masked_fill(~valid, -1e4)
        return torch.log_softmax(s / self.tau, -1)


class EntityLinker(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 32))
        self.linker = Linker()

    def forward(self, mention, cands, valid):
        return self.linker(self.enc(mention), cands, valid)


_ENT = torch.randn(200, 32, generator=gen(81))
_ENT_X = torch.randn(200, 24, generator=gen(82))


def link_batch(i):
    """32 mentions with 16 candidate entities each (the gold one first, label 0); from step 13 a new candidate
    generator returns lists of variable length (2-16, padded to 16), and for one mention of that batch an empty list
    (an unseen alias): no valid candidate, its label index 0 as for a NIL mention."""
    g = gen(800 + i)
    ent = torch.randint(0, 200, (32, 16), generator=g)
    mention = _ENT_X[ent[:, 0]] + 0.2 * torch.randn(32, 24, generator=g)
    n_valid = torch.randint(2, 17, (32,), generator=g) if i >= NO_CAND else torch.full((32,), 16)
    if i == NO_CAND:
        n_valid[5] = 0
    valid = torch.arange(16)[None] < n_valid[:, None]
    return mention, _ENT[ent], valid, torch.zeros(32, dtype=torch.long)


def link_loss(out, mention, cands, valid, y):
    return F.nll_loss(out.float(), y)


def test_mask_constant_divided_by_a_temperature_after_masking_is_minus_inf_for_an_empty_candidate_list():
    torch.manual_seed(0)
    m = EntityLinker()
    r = train_loop(m, link_batch, link_loss, 16, lr=3e-3, call=lambda a, b, c, y: m(a, b, c))
    real_fwd(r, "linker", NO_CAND, skip=False)
    # silently: the empty row's log_softmax is NaN and so is the loss, but masked_fill's backward zeroes that row's
    # gradient (every entry of it was filled): the scaler skips nothing, the logged loss is NaN
    assert r["bad_loss"] == [NO_CAND] and r["skipped"] == [], r
    # the mechanism: -1e4 is in fp16's range, -1e4 / 0.05 = -2e5 is not; in fp32 the empty row is uniform, finite
    c = torch.tensor(-1e4, dtype=torch.float16)
    assert torch.isfinite(c) and torch.isneginf(c / 0.05) and torch.isfinite(c.float() / 0.05)
    assert torch.log_softmax(torch.full((16,), -1e4) / 0.05, -1).isfinite().all()
    rep = r["w"].report()
    error_at(rep, ("mask_value_overflow",) + FWD, "linker", step=NO_CAND, phase="forward")
    no_error_at(rep, ("linker.q", "linker.k", "enc", "enc.2"))

