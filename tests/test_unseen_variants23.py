"""Twenty-third set: masks, constants and custom Functions in realistic models. fp16 failures from shared/FP16.md's
"Masks and constants" and "Systems" sections, written the way model repos write them, watched through the public
API only (watch -> an ordinary fp16 autocast + GradScaler("cpu") loop -> w.report()) at ampdoctor's default sampling,
each starting mid-run (step 3 or 4) through the data: a padded, left-padded or empty sequence, or a new data shard.

 1. a text classifier whose collator returns attention_mask=None when a batch needs no padding (HF
    DataCollatorWithPadding users who drop all-ones masks, fairseq's key_padding_mask=None): the attention does
    `scores.masked_fill(mask == 0, -1e9)` (the Annotated Transformer / many BERT re-implementations), which only
    meets the fp16 scores when the first ragged (longer, padded) batch arrives at step 3: masked_fill raises
    "value cannot be converted to type c10::Half without overflow" inside `blocks.0.attn`; the run dies there;
 2. a GPT-2-style decoder classifier (last-token pooling, as GPT2ForSequenceClassification) trained on left-padded
    batches, its causal mask applied as torch.where(causal, s, full([], finfo(float32).min, dtype=s.dtype)) and its
    padding mask added as (1 - am) * finfo(float32).min (the pre-fix HF GPT-2/GPT-Neo code path): in fp16 both
    constants are -inf, so a left-padding query row (all its allowed keys padded) is -inf everywhere and softmax is
    NaN; the first left-padded batch is at step 3 (mask_value_overflow at `blocks.0.attn`; the NaN rows reach the
    pooled token through the second block);
 3. an additive padding mask added twice: the data pipeline pre-computes an additive key-padding bias
    (1 - am) * finfo(float16).min ("the right constant for fp16") and passes it as attn_bias, and the model adds its
    own padding mask from attention_mask as well; -65504 + -65504 = -inf in fp16 (finite in fp32), so a sample with
    an empty transcript (all keys padded; from step 4 on) has a row of -inf and softmax NaN (`blocks.0.attn`);
 4. a fully masked row: masked_fill(~am, -inf) (the nn.MultiheadAttention key_padding_mask convention) and an empty
    sequence in the batch from step 3 (an utterance whose transcript was filtered to nothing): softmax of a row of
    -inf is NaN (nan_origin at `blocks.0.attn`);
 5. a custom autograd.Function without torch.amp.custom_fwd/custom_bwd: a fused LayerNorm for a tabular model
    (apex-style: forward upcasts x.float(), backward recomputes mean and the one-pass variance E[x^2] - E[x]^2 from
    the saved input in its own dtype). The features come from a float16 memmap, as large tabular/embedding stores
    keep them; from step 3 on a new shard holds rows whose missing values are the sentinel 9999: the forward is
    finite, but in the backward x * x and mu * mu are inf in fp16, inf - inf = NaN, and the weight/bias gradients
    of `norm` are NaN every step (overflow / nan_origin at `norm`, backward);
 6-7. the fused LayerNorm of 5 inside an activation-checkpointed block (torch.utils.checkpoint, use_reentrant=False (6)
    and True (7)) behind an fp16 stem: the recomputation in the backward re-runs the Function under the restored
    autocast state and its backward makes the NaN (`blk.norm`, backward; a missing-value row from step 3 on);
 8. an extractive-QA span head (BiDAF/DrQA-style) that masks every non-context position with (1 - ctx) * -1e30 in
    the fp16 logits: from step 3 a window holds only question tokens (a question longer than max_seq_len, labelled
    index 0 as HF's run_qa preprocessing does); its start/end logits are all -inf, cross-entropy is NaN; in fp32
    -1e30 is finite and the loss too (mask_value_overflow at `qa`).
5 runs twice, stopped after 6 steps (3 skipped) and after 10 (7 skipped).
Healthy twins (the fix applied, the same special batches; no warning and no error): 2 with the constant
finfo(scores.dtype).min in one masked_fill of the combined causal & padding mask; 4 with masked_fill(-inf) on
right-padded batches where every row keeps a valid key; 5 with @torch.amp.custom_fwd(device_type="cpu",
cast_inputs=torch.float32) / @torch.amp.custom_bwd(device_type="cpu").

Not built (no real failure in torch 2.13 that differs from the above): checkpoint recomputation "under a different
autocast state" - both checkpoint implementations save and restore the CPU autocast state, so the recomputation
sees the forward's state (6-7 show the recomputed backward instead); a cached fp16 causal mask reused at a longer
length and ALiBi slopes times positions give -inf only at masked keys (every row keeps its diagonal), which
ampdoctor rightly calls healthy.

Each failure is first checked to be real in the loop itself: forward hooks on every module name the first module
whose output is non-finite from finite inputs and parameters (2-4), or the module whose forward raised (1), or the
fp16 head's rows that are -inf everywhere while the fp32 loss is finite (8); a
backward oracle (full backward pre-hooks and hooks plus tensor hooks on each module's own parameters) names the first
module whose gradient is non-finite while the gradient reaching it was finite (5-7); the scaler skips that step and
none before; the same batch in fp32 is finite (1, 2, 3, 8) where the failure is fp16's. Then ampdoctor's report must hold
an `error` finding of the right rule at that module among the first three, at that step.

What ampdoctor got wrong (strict xfails when written, all fixed since): 5 stopped after 6 steps was `[info] overflow
at norm ... as designed` though the capture's replay found the step non-finite at every scale down to 1
(analysis/replayfold.py now lets that replay's error replace the info finding); 7 (use_reentrant=True) was only
`[info] skipped_steps at (run) step 3 ... a normal rate`, nothing at blk.norm or any module: the replay ran the
forward only, as autograd.grad refuses reentrant checkpointing (the replay now runs torch's reentrant checkpoints
inline, replay/modelio.py inline_reentrant_checkpoints).
Right: 1 (the crash is `mask_value_overflow at blocks.0.attn step 3`), 2 (also, rightly, mask_value_overflow at
blocks.1.attn, which holds the same constant), 3, 4, 5, 6, 8, and the three twins are quiet. Same results
with ONEDNN_MAX_CPU_ISA=AVX2.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor
from scenarios import lines, no_error_at, one_thread
from probe_harness import Producer, error_at, healthy


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

MASK_RULES = ("mask_value_overflow", "nan_origin", "overflow")
NAN_RULES = ("nan_origin", "overflow")
NEG32 = torch.finfo(torch.float32).min


def at(rep, rules, module, step, phase=None):
    """probe_harness.error_at at `step` (without scenarios.in_top3), in a run that exits 1."""
    hit = error_at(rep, rules, module, step, phase, top3=False)
    assert rep.exit_code == 1, lines(rep)
    return hit


def train_loop(m, batch, loss_fn, steps, *, lr=3e-3, init_scale=1024.0):
    """AdamW + GradScaler("cpu"): forward under fp16 autocast -> scale(loss).backward() -> unscale_ -> clip -> step ->
    update, watched at ampdoctor's default sampling. A forward that raises ends the run (as it would end the user's
    script); the exception is kept. Returns a dict with the closed watch and the oracle's results."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    orc = Producer(m, backward=True, stack=True)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    skipped, bad_loss, losses, crash = [], [], [], None
    try:
        for step in range(steps):
            orc.step = step
            opt.zero_grad()
            args, y = batch(step)
            try:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_fn(m(*args), y)
            except RuntimeError as e:
                crash = (e, list(orc.stack), step)
                break
            if not torch.isfinite(loss):
                bad_loss.append(step)
            losses.append(loss.item())
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            before = sc.get_scale()
            sc.step(opt)
            sc.update()
            if sc.get_scale() < before:
                skipped.append(step)
    finally:
        w.close()
        orc.remove()
    return dict(w=w, first=orc.first, first_bwd=orc.first_bwd, skipped=skipped, bad_loss=bad_loss, losses=losses,
                crash=crash)


# ======================================================================================================================
# The attention models of 1-4: embedding -> 2 post-LN blocks (self-attention with a mask convention) -> pooling -> head
# ======================================================================================================================
class Attn(nn.Module):
    def __init__(self, d, h, style):
        super().__init__()
        self.qkv, self.out, self.h, self.style = nn.Linear(d, 3 * d), nn.Linear(d, d), h, style

    def forward(self, x, am=None, bias=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, -1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(C // self.h)
        st = self.style
        if st == "fill1e9":  # the Annotated Transformer: scores.masked_fill(mask == 0, -1e9)
            if am is not None:
                s = s.masked_fill(am[:, None, None, :] == 0, -1e9)
        elif st == "gpt2_f32min":  # pre-fix HF GPT-2: mask_value from float32, padding mask * finfo(float32).min
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            s = torch.where(causal, s, torch.full([], NEG32, dtype=s.dtype, device=s.device))
            s = s + (1.0 - am[:, None, None, :].to(s.dtype)) * NEG32
        elif st == "fixed":  # one masked_fill of the combined mask with the working dtype's own min
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            s = s.masked_fill(~(causal & am[:, None, None, :].bool()), torch.finfo(s.dtype).min)
        elif st == "double":  # the model's own additive padding mask ... plus the pipeline's bias
            s = s + (1.0 - am[:, None, None, :].to(s.dtype)) * torch.finfo(s.dtype).min
            if bias is not None:
                s = s + bias.to(s.dtype)
        elif st == "neginf":  # nn.MultiheadAttention's key_padding_mask convention
            s = s.masked_fill(am[:, None, None, :] == 0, float("-inf"))
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h, style):
        super().__init__()
        self.attn = Attn(d, h, style)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, am=None, bias=None):
        x = self.ln1(x + self.attn(x, am, bias))
        return self.ln2(x + self.mlp(x))


class TextClassifier(nn.Module):
    def __init__(self, style, pool="mean", V=40, d=32, h=2, ncls=3):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(32, d)
        self.blocks = nn.ModuleList([Block(d, h, style) for _ in range(2)])
        self.head = nn.Linear(d, ncls)
        self.pool = pool

    def forward(self, ids, am=None, bias=None):
        T = ids.shape[1]
        h = self.emb(ids) + self.pos(torch.arange(T, device=ids.device))
        for b in self.blocks:
            h = b(h, am, bias)
        if self.pool == "last":  # GPT2ForSequenceClassification with left padding: the last position
            return self.head(h[:, -1])
        m = (torch.ones_like(ids) if am is None else am).unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


def _ce(out, y):
    return F.cross_entropy(out.float(), y)


def _text(i, B=6, T=10, pad=None, special_from=3):
    """Step i's batch (a pool of 4 batches, cycled, so the twins can learn): token ids 1..39, the label a function
    of the tokens. From `special_from` on the batch is padded per `pad`: "right" (ragged, lengths >= 3, and longer),
    "left" (left padding), "empty" (right padding and one empty sequence), "none"."""
    g = torch.Generator().manual_seed(300 + i % 4)
    L = T + 4 if (pad == "right" and i >= special_from) else T
    ids = torch.randint(1, 40, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    if pad and pad != "none" and i >= special_from:
        lens = torch.randint(3, L, (B,), generator=g)
        lens[0] = L
        if pad == "empty":
            lens[2 + i % 3] = 0  # an empty transcript
        for b, n in enumerate(lens.tolist()):
            if pad == "left":
                am[b, :L - n] = 0
            else:
                am[b, n:] = 0
        ids = ids * am
    y = torch.stack([(ids[b][am[b].bool()] > 20).sum() % 3 if am[b].any() else torch.tensor(0) for b in range(B)])
    return ids, am, y


def _fp32_finite(m, *args):
    with torch.no_grad():
        return bool(torch.isfinite(m(*args)).all())


# ----------------------------------------------------------------------------------------------------------------------
# 1. masked_fill(-1e9): the collator drops all-ones masks; the first ragged batch (step 3) meets the fp16 scores
# ----------------------------------------------------------------------------------------------------------------------
def test_masked_fill_minus_1e9_meets_fp16_scores_at_the_first_padded_batch():
    torch.manual_seed(0)
    m = TextClassifier("fill1e9")

    def batch(i):
        ids, am, y = _text(i, pad="right")
        return ((ids, None if bool(am.all()) else am), y)  # the collator: no mask for an unpadded batch

    # the premise: the padded step-3 batch is fine in fp32, and steps 0-2 carry no mask at all
    (ids, am), _ = batch(3)
    assert am is not None and all(batch(i)[0][1] is None for i in range(3))
    assert _fp32_finite(m, ids, am)
    r = train_loop(m, batch, _ce, 6)
    e, stack, step = r["crash"]
    assert "cannot be converted to type c10::Half without overflow" in str(e) and step == 3, r
    assert stack[-1] == "blocks.0.attn", stack  # the innermost module running when masked_fill raised
    assert r["first"] is None and not r["skipped"] and len(r["losses"]) == 3, r
    rep = r["w"].report()
    at(rep, ("mask_value_overflow",), "blocks.0.attn", 3)


# ----------------------------------------------------------------------------------------------------------------------
# 2. GPT-2-style finfo(float32).min mask values in fp16 with left padding (from step 3); twin: finfo(s.dtype).min
# ----------------------------------------------------------------------------------------------------------------------
def _left(i):
    ids, am, y = _text(i, pad="left")
    return (ids, am), y


def test_gpt2_style_float32_min_mask_value_in_fp16_left_padding_rows_are_nan():
    torch.manual_seed(0)
    m = TextClassifier("gpt2_f32min", pool="last")
    (ids, am), _ = _left(3)
    assert _fp32_finite(m, ids, am)  # in fp32 the same batch is finite (min + min is finite where it matters)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):  # the mechanism: the fp16 constant is -inf
        assert torch.full([], NEG32, dtype=torch.float16).item() == float("-inf")
    r = train_loop(m, _left, _ce, 6)
    assert r["first"] == ("blocks.0.attn", 3) and r["bad_loss"][:1] == [3] and r["skipped"][:1] == [3], r
    rep = r["w"].report()
    at(rep, MASK_RULES, "blocks.0.attn", 3)
    # blocks.1.attn holds the same constant (a mask_value_overflow there is right), but it makes no NaN of its own
    assert not [f for f in rep.findings if f.module == "blocks.1.attn" and f.rule in NAN_RULES
                and f.severity == "error"], lines(rep)
    no_error_at(rep, ("blocks.0", "blocks.1", "head", "blocks.0.ln1", "blocks.1.ln1"))


def test_healthy_twin_causal_and_padding_mask_filled_once_with_the_dtypes_own_min_is_quiet():
    torch.manual_seed(0)
    m = TextClassifier("fixed", pool="last")
    healthy(train_loop(m, _left, _ce, 24))


# ----------------------------------------------------------------------------------------------------------------------
# 3. the padding mask added twice (pipeline bias + the model's own), an empty transcript from step 4
# ----------------------------------------------------------------------------------------------------------------------
def test_additive_padding_mask_added_twice_makes_minus_inf_rows_for_an_empty_sequence():
    torch.manual_seed(0)
    m = TextClassifier("double")

    def batch(i):
        ids, am, y = _text(i, pad="empty", special_from=4)
        bias = (1.0 - am[:, None, None, :].float()) * torch.finfo(torch.float16).min  # "the fp16-safe constant"
        return (ids, am, bias), y

    args, _ = batch(4)
    assert _fp32_finite(m, *args)  # -131008 is finite in fp32: the fp32 run is fine
    r = train_loop(m, batch, _ce, 7)
    assert r["first"] == ("blocks.0.attn", 4) and r["bad_loss"][:1] == [4] and r["skipped"][:1] == [4], r
    rep = r["w"].report()
    at(rep, MASK_RULES, "blocks.0.attn", 4)
    no_error_at(rep, ("blocks.1.attn", "blocks.0", "head"))


# ----------------------------------------------------------------------------------------------------------------------
# 4. masked_fill(-inf) and an empty sequence (step 3): a fully masked row; twin: right padding, every row a key
# ----------------------------------------------------------------------------------------------------------------------
def test_fully_masked_row_of_an_empty_sequence_makes_softmax_nan():
    torch.manual_seed(0)
    m = TextClassifier("neginf")

    def batch(i):
        ids, am, y = _text(i, pad="empty")
        return (ids, am), y

    r = train_loop(m, batch, _ce, 6)
    assert r["first"] == ("blocks.0.attn", 3) and r["bad_loss"][:1] == [3] and r["skipped"][:1] == [3], r
    rep = r["w"].report()
    at(rep, NAN_RULES + ("mask_value_overflow",), "blocks.0.attn", 3)
    no_error_at(rep, ("blocks.1.attn", "blocks.0", "head"))


def test_healthy_twin_minus_inf_key_padding_where_every_row_keeps_a_valid_key_is_quiet():
    torch.manual_seed(0)
    m = TextClassifier("neginf")

    def batch(i):
        ids, am, y = _text(i, pad="right")
        return (ids, am), y

    healthy(train_loop(m, batch, _ce, 24))


# ----------------------------------------------------------------------------------------------------------------------
# 8. an extractive-QA span head masking non-context positions with (1 - ctx) * -1e30 in the fp16 logits: a question
#    longer than max_seq_len (step 3 on) leaves no context token; every start/end logit is -inf, the loss NaN
# ----------------------------------------------------------------------------------------------------------------------
class SpanHead(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 2)

    def forward(self, h, ctx):
        start, end = self.proj(h).unbind(-1)
        neg = (1 - ctx.to(start.dtype)) * -1e30  # "mask everything that is not context" (BiDAF/DrQA-style heads)
        return start + neg, end + neg


class SpanQA(nn.Module):
    def __init__(self, V=40, d=32, h=2):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(32, d)
        self.block = Block(d, h, "neginf")
        self.qa = SpanHead(d)

    def forward(self, ids, ctx):
        T = ids.shape[1]
        h = self.block(self.emb(ids) + self.pos(torch.arange(T)), torch.ones_like(ids))
        return self.qa(h, ctx)


def _squad(i, B=6, T=12):
    """[question | context] windows; the answer span lies in the context (the start is marked by token 39). From
    step 3 on one window holds only question tokens (a question longer than max_seq_len): its label is index 0, as
    the HF run_qa preprocessing labels an answer outside the window."""
    g = torch.Generator().manual_seed(500 + i % 4)
    ids = torch.randint(1, 39, (B, T), generator=g)
    qlen = torch.randint(2, 6, (B,), generator=g)
    ctx = (torch.arange(T)[None] >= qlen[:, None]).long()
    start = qlen + torch.randint(0, 4, (B,), generator=g)
    ids[torch.arange(B), start] = 39
    end = (start + 2).clamp(max=T - 1)
    if i >= 3:
        ctx[4] = 0
        start[4] = end[4] = 0
    return (ids, ctx), (start, end)


def _span_loss(out, y):
    return (F.cross_entropy(out[0].float(), y[0]) + F.cross_entropy(out[1].float(), y[1])) / 2


def test_span_head_minus_1e30_context_mask_on_a_window_without_context_is_nan():
    torch.manual_seed(0)
    m = SpanQA()
    (ids, ctx), y = _squad(3)
    with torch.no_grad():
        assert torch.isfinite(_span_loss(m(ids, ctx), y))  # fp32: -1e30 is finite, the loss is finite
        with torch.autocast("cpu", dtype=torch.float16):
            st, en = m(ids, ctx)
        assert torch.isneginf(st[4]).all() and torch.isfinite(st[:4]).any()  # fp16: -1e30 is -inf, the whole row
    r = train_loop(m, _squad, _span_loss, 6)
    assert r["bad_loss"][:1] == [3] and r["skipped"][:1] == [3], r
    rep = r["w"].report()
    at(rep, ("mask_value_overflow",), "qa", 3)
    no_error_at(rep, ("block", "block.attn", "qa.proj", "emb"))


# ======================================================================================================================
# 5-7. a fused LayerNorm as a custom autograd.Function: forward upcasts, backward recomputes the statistics from the
#      saved input in its own dtype (one-pass variance); fp16 features with a 9999 missing-value sentinel from step 3
# ======================================================================================================================
class _FusedLN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, eps):
        xf = x.float()
        mu = xf.mean(-1, keepdim=True)
        rstd = ((xf * xf).mean(-1, keepdim=True) - mu * mu + eps).rsqrt()
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return ((xf - mu) * rstd * w + b).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.to(x.dtype)
        mu = x.mean(-1, keepdim=True)
        rstd = ((x * x).mean(-1, keepdim=True) - mu * mu + ctx.eps).rsqrt()
        xhat = (x - mu) * rstd
        gw = g * w.to(x.dtype)
        dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
        dims = tuple(range(g.dim() - 1))
        return dx, (g * xhat).sum(dims).to(w.dtype), g.sum(dims).to(w.dtype), None


class _FusedLNAmp(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w, b, eps):
        return _FusedLN.forward(ctx, x, w, b, eps)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        return _FusedLN.backward(ctx, g)


class FusedLayerNorm(nn.Module):
    def __init__(self, d, amp_safe=False, eps=1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.fn, self.eps = (_FusedLNAmp if amp_safe else _FusedLN), eps

    def forward(self, x):
        return self.fn.apply(x, self.weight, self.bias, self.eps)


class TabularNet(nn.Module):
    def __init__(self, amp_safe=False, d_in=12):
        super().__init__()
        self.norm = FusedLayerNorm(d_in, amp_safe)
        self.fc1, self.act, self.fc2 = nn.Linear(d_in, 48), nn.GELU(), nn.Linear(48, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.norm(x))))[:, 0]


_TAB_W = torch.randn(12, generator=torch.Generator().manual_seed(5))


def _tab(i, n=32, sentinel_from=3):
    """fp16 features as read from a float16 memmap; from `sentinel_from` on, the new shard's rows with missing
    readings carry the sentinel 9999 in every feature (their target is the shard mean). Cycled over 4 batches."""
    g = torch.Generator().manual_seed(400 + i % 4)
    x = torch.randn(n, 12, generator=g)
    y = (x @ _TAB_W).tanh() + 0.05 * torch.randn(n, generator=g)
    if i >= sentinel_from:
        x[[3, 17]] = 9999.0
        y[[3, 17]] = 0.0
    return (x.half(),), y


def _mse(out, y):
    return F.mse_loss(out.float(), y)


LN_STEPS = [
    pytest.param(6, id="6steps"),
    pytest.param(10, id="10steps")]


@pytest.mark.parametrize("steps", LN_STEPS)
def test_custom_function_layernorm_without_custom_fwd_backward_overflows_on_a_sentinel_row(steps):
    torch.manual_seed(0)
    m = TabularNet()
    (x,), y = _tab(3)
    with torch.no_grad():  # the mechanism: the forward (upcast) is finite, fp16 x*x and mu*mu are inf
        assert torch.isfinite(m.norm(x)).all()
        assert torch.isinf(x[3] * x[3]).all() and torch.isinf(x[3].mean() * x[3].mean())
    r = train_loop(m, _tab, _mse, steps, lr=3e-3)
    assert r["first"] is None and 3 not in r["bad_loss"], r
    assert r["first_bwd"] == ("norm", 3) and r["skipped"] == list(range(3, steps)), r
    rep = r["w"].report()
    at(rep, NAN_RULES, "norm", 3, phase="backward")
    no_error_at(rep, ("fc1", "fc2", "act", ""))


def test_healthy_twin_custom_function_with_custom_fwd_cast_to_float32_is_quiet():
    torch.manual_seed(0)
    m = TabularNet(amp_safe=True)
    healthy(train_loop(m, _tab, _mse, 24, lr=3e-3))


class CkptTabular(nn.Module):
    """An fp16 stem, then a block [fused LN -> Linear -> GELU] run under torch.utils.checkpoint."""

    def __init__(self, reentrant):
        super().__init__()
        self.stem = nn.Linear(12, 32)
        self.blk = nn.Sequential()
        self.blk.add_module("norm", FusedLayerNorm(32))
        self.blk.add_module("fc", nn.Linear(32, 32))
        self.blk.add_module("act", nn.GELU())
        self.head = nn.Linear(32, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.blk, h, use_reentrant=self.reentrant)
        return self.head(h)[:, 0]


@pytest.mark.parametrize("reentrant", [pytest.param(True, id="reentrant"), pytest.param(False, id="non_reentrant")])
def test_checkpointed_block_recomputes_a_custom_function_whose_backward_overflows(reentrant):
    torch.manual_seed(0)
    m = CkptTabular(reentrant)
    (x,), y = _tab(3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = m.stem(x.float())
    mu = h[3].float().mean()
    assert abs(mu) > 300 and torch.isinf(h[3] * h[3]).any(), (mu, h[3])  # x*x and mu*mu are inf in fp16

    def batch(i):
        (x,), y = _tab(i)
        return (x.float(),), y

    r = train_loop(m, batch, _mse, 6, lr=1e-3)
    assert r["first"] is None and 3 not in r["bad_loss"], r
    assert r["first_bwd"] == ("blk.norm", 3) and r["skipped"][:1] == [3], r
    rep = r["w"].report()
    at(rep, NAN_RULES, "blk.norm", 3, phase="backward")
    no_error_at(rep, ("stem", "blk.fc", "head", "blk"))
