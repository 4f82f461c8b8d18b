"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`, nothing else), eighth
set: FINE-TUNING and the loop shapes of real projects, each in a variant the earlier healthy probes
(tests/test_healthy*.py) do not run. Tiny models pretrained once in fp32 (unwatched, cached), then fine-tuned for
30-42 steps (one run 210) with fixed seeds: fp16 autocast on the CPU with a real torch.amp.GradScaler("cpu") (bf16 autocast
without a scaler where that is what people do). Each run is first asserted healthy (every loss finite, the loss
falls, the scale stays >= 1 and backs off at most once after the first 10 steps), then judged: no warning and no
error (info is fine). Where marked "twin", the same loop also runs unwatched on a deep copy made before the watch,
with the same seeds, and the losses (and the final weights) must be bitwise identical.

Scenarios:
 1. LoRA as a parametrization (minLoRA style, torch.nn.utils.parametrize) on q/v of a frozen fp32 causal LM, B zero
    initialised, alpha/r = 2, lr 1e-2 (twin);
 2. QLoRA-style: every Linear of the LM replaced by an int8 weight buffer + bf16 per-row scale dequantised in the
    forward, fp32 LoRA A/B with LoRA dropout; bf16 autocast, no scaler (twin);
 3. ULMFiT gradual unfreezing: a new head only, then one more top layer every 8 steps through requires_grad_(True)
    and optimizer.add_param_group with discriminative lr (/2.6 per level) (twin);
 4. a linear probe whose features come from the user's own register_forward_hook on a frozen `.half()` CNN in eval
    mode run under torch.no_grad() (train() overridden to keep it in eval);
 5. distillation with the fp16 teacher a submodule of the watched wrapper (eval, no_grad, train() overridden), KL
    with log_target=True at T=2 scaled by T^2 plus CE, a dict output (twin);
 6. gradient accumulation normalised by the token count of the whole window (reduction="sum" / n_tokens, the
    transformers fix), variable-length sequences with -100 labels, 10 micro-batches per epoch in windows 4, 4, 2,
    warmup + linear decay;
 7. selective activation checkpointing (checkpoint(use_reentrant=False, context_fn=create_selective_checkpoint_
    contexts(policy)) saving matmuls, recomputing the rest, attention and residual dropout) (twin);
 8. greedy generation samples every 5 steps (model.eval(), no_grad, autocast, 8 full forwards per sample) (twin);
 9. fine-tuning from a checkpoint: a pretraining run's model (strict=False, a new 6-class head) and its GradScaler
    state (scale grown to 2**13 with growth_interval 10) loaded into a fresh scaler after the watch started; and a
    save/restore round trip of model, optimizer and scaler through torch.save/torch.load at step 20 (twin);
10. two stages: head only with SGD momentum (the watch's optimizer), then at step 12 a new AdamW over the whole
    model with a warmup/cosine LambdaLR, the same scaler and watch;
11. layer-wise lr decay (0.75 per level) x weight-decay/no-decay groups (biases, LayerNorms, embeddings) under
    OneCycleLR with a per-group max_lr list; sequence classification with class weights on imbalanced classes;
12. CutMix (p=0.5, the lambda corrected to the box's area) with label smoothing as lam*CE(y_a) + (1-lam)*CE(y_b)
    on a pretrained BatchNorm CNN with a new head;
13. round-robin multi-task training: one task per step (6-way CE, regression, 8 multi-label tags), weighted losses,
    a forward returning a dict holding only the asked task's head output (idle heads get no gradient) (twin);
14. early stopping inside `with ampdoctor.watch(...) as w:`: validation every 5 steps, a `break` mid-epoch, the best
    state_dict restored before leaving the block;
15. BatchNorm statistics frozen from step 10 (model.train() then every BN .eval() each iteration), validation in
    model.eval() every 5 steps, batch 8 (twin);
16. resize_token_embeddings by hand: 4 new task tokens initialised at the mean of the old rows, the LM head re-tied
    to the new embedding, positional embeddings frozen (twin);
17. an EMA made by copy.deepcopy(model) AFTER the watch started (timm's ModelEmaV3 built after the AMP setup),
    decay min(0.998, (1+n)/(10+n)), BN buffers copied, validated under autocast every 5 steps (twin);
18. prompt tuning: 8 fp32 soft-prompt vectors (initialised from vocabulary rows, lr 0.1) prepended to the
    embeddings of a frozen `.half()` LM kept in eval, steering it through its own tied head;
19. a reward model (Bradley-Terry: -logsigmoid(r_chosen - r_rejected) + a 0.01 centring term), the reward read at
    each sequence's last real token, chosen (counting) and rejected (degenerating into a repetition) in one forward
    (twin);
20. DPO: summed response log-probs of the policy and of a frozen bf16 reference copy (not watched), beta 0.1; bf16
    autocast, no scaler;
21. BitFit: only the biases (and a new head) trainable, clip_grad_value_ after unscale_ (twin);
22. Houlsby adapters (zero-initialised up projections) on a frozen trunk with R-Drop: two dropout forwards per step,
    CE + symmetric KL (twin);
23. ReLoRA restarts every 12 steps: the adapters merged into the frozen base under no_grad, A re-initialised, B
    zeroed, optimizer.state cleared, a jagged re-warmup (twin);
24. class-incremental learning: 100 steps on 4 classes, then the head grown to 6 classes (the old rows copied) and a
    new AdamW, the same scaler and watch, 110 more steps (210: past the sampled step 200);
25. sparse fine-tuning: a Fisher mask (the top 10% of each weight matrix by squared fp32 gradient, kept as buffers)
    applied through param.register_hook (twin).

Twin runs (1-3, 5, 7-9, 13, 15-17, 19, 21-23, 25): watching changed nothing, losses, scales and weights are bitwise
identical (17: the EMA copy's too).

What ampdoctor got wrong (`quiet` also asserts the report has no `internal_error`); fixed since (the headroom hooks
skip a module that has no slot, the sampled steps name it):
 - 24: ampdoctor switched itself off mid-run. After the head was replaced by a new nn.Linear at step 100, a
   RuntimeWarning "ampdoctor disabled itself after an internal error (KeyError: <id>); training continues
   unwatched. Please report this." and the report's summary `internal_error` {type KeyError, step 101-103 or 200}
   with the verdict "ampdoctor stopped watching at step N after an internal error ...; later steps were not
   recorded". No finding is raised, so a check of findings alone passes: the run looks "Healthy" while everything
   after the swap is unwatched. Cause: StepMachine.__init__ (ampdoctor/record/step.py) builds `slot_of` (id of
   each module -> headroom slot) and `params` once at watch time; HeadroomHooks.install
   (ampdoctor/record/headroomhooks.py) walks model.modules() afresh and indexes `slot_of[id(mod)]`, a KeyError for
   any module added later (here a new head; LoRA injected or embeddings resized after the watch began would do the
   same, not run here). It runs when the wall-clock headroom budget re-installs parked hooks (so the step varies)
   and, always, on the step after a sampled step (201 at the defaults).
No other scenario raised a warning or an error: the only finding in the other 24 runs is one info (`skipped_steps`
"GradScaler skipped 1 of 36 steps; a normal rate", 15)."""
from __future__ import annotations

import copy
import functools
import io
import math
import sys
from collections import namedtuple
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, one_thread, quiet_watch, randn  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

quiet = functools.partial(quiet_watch, internal=True)  # the report has no internal error either


@pytest.fixture(autouse=True)
def seeded():
    """Models (new heads, adapters) are built from the same global RNG state whatever ran before."""
    torch.manual_seed(0)


FP16, BF16 = torch.float16, torch.bfloat16
Run = namedtuple("Run", "w losses scales")


# --- helpers ------------------------------------------------------------------------------------------------------

def healthy(losses, scales=(), *, fall=0.9, k=None, first=10, max_late_backoffs=1):
    """Every loss finite; the mean of the last k losses below `fall` x the mean of the first k (default k = a tenth
    of the run, at least 3); the loss scale stays >= 1 after the first `first` steps and backs off at most
    `max_late_backoffs` times after them."""
    assert losses and all(map(math.isfinite, losses)), losses
    k = k or max(3, len(losses) // 10)
    assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, (losses[:k], losses[-k:])
    if scales:
        assert min(scales[first:]) >= 1.0, scales
        late = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a and i + 1 >= first]
        assert len(late) <= max_late_backoffs, (late, scales)


def twin(build, loop, extra=None):
    """`loop(model, watched)` -> Run, on a deep copy unwatched and on the model watched (the copy is made before any
    watch exists; each loop seeds the global RNG itself): the losses and the final state_dict (and `extra(model)`'s
    tensors) must be bitwise identical. Returns the watched Run."""
    model = build()
    ref = copy.deepcopy(model)
    r0 = loop(ref, False)
    r1 = loop(model, True)
    assert r0.losses == r1.losses, [(i, a, b) for i, (a, b) in enumerate(zip(r0.losses, r1.losses)) if a != b][:5]
    assert r0.scales == r1.scales
    s0, s1 = ref.state_dict(), model.state_dict()
    assert s0.keys() == s1.keys()
    for n in s0:
        assert torch.equal(s0[n], s1[n]), n
    return r1


def watching(model, opt, sc, on):
    return ampdoctor.watch(model, optimizer=opt, scaler=sc) if on else None


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def amp_step(loss, opt, sc, params, clip=1.0):
    """scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update (no scaler: backward -> clip -> step)."""
    if sc is not None:
        sc.scale(loss).backward()
        sc.unscale_(opt)
    else:
        loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(params, clip)
    if sc is not None:
        sc.step(opt)
        sc.update()
    else:
        opt.step()


def fit(model, opt, loss_fn, *, steps, watched, dtype=FP16, clip=1.0, sched=None, before=None, after=None,
        params=None, scaler_kw=None):
    """zero_grad -> `loss_fn(model, i)` under autocast(dtype) (a loss, or (loss, monitored)) -> amp_step ->
    sched.step -> after(i). before(i) runs first each step. Returns Run (the watch closed)."""
    torch.manual_seed(0)
    sc = torch.amp.GradScaler("cpu", **(scaler_kw or {})) if dtype == FP16 else None
    w = watching(model, opt, sc, watched)
    losses, scales = [], []
    model.train()
    for i in range(steps):
        if before:
            before(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            out = loss_fn(model, i)
        loss, mon = out if isinstance(out, tuple) else (out, out)
        amp_step(loss, opt, sc, params() if callable(params) else (params or trainable(model)), clip)
        if sched:
            sched.step()
        if after:
            after(i)
        losses.append(float(mon.detach()))
        scales.append(sc.get_scale() if sc else 1.0)
    if w:
        w.close()
    return Run(w, losses, scales)


def frozen_rng(fn):
    """Pretraining (cached) must not move the global RNG: the tests' models are built after it, in any order."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            return fn(*a, **k)
    return wrapper


# --- data -----------------------------------------------------------------------------------------------------------

NTOK = 27                  # content tokens 1..27; 0 is padding; 28.. are added by fine-tunes
V0, TMAX, D = 28, 24, 32


def counting(i, B=16, T=16, strides=(1, 2), probs=None, seed=0):
    """Sequences counting by a stride from a random start (mod 27, tokens 1..27); returns (ids, stride index)."""
    g = gen(seed * 100_000 + i)
    s = torch.randint(0, NTOK, (B, 1), generator=g)
    if probs is None:
        k = torch.randint(0, len(strides), (B,), generator=g)
    else:
        k = torch.multinomial(torch.tensor(probs), B, replacement=True, generator=g)
    b = torch.tensor(strides)[k][:, None]
    return (s + b * torch.arange(T)) % NTOK + 1, k


WA = randn(16, 4, seed=4242)
WB = WA @ randn(4, 6, seed=4343)           # task B: 6 classes in the span of task A's projections


def classes(W, i, n=64, noise=0.3, seed=0):
    g = gen(seed * 100_000 + i)
    z = torch.randn(n, 16, generator=g)
    return z, (z @ W + noise * torch.randn(n, W.shape[1], generator=g)).argmax(1)


TMPL_A = F.interpolate(randn(4, 1, 4, 4, seed=123), size=(16, 16), mode="bilinear", align_corners=False)
TMPL_B = F.interpolate(randn(4, 1, 4, 4, seed=321), size=(16, 16), mode="bilinear", align_corners=False)


def images(tmpl, i, B=16, seed=0):
    g = gen(seed * 100_000 + i)
    y = torch.randint(0, tmpl.shape[0], (B,), generator=g)
    return tmpl[y] + 0.6 * torch.randn(B, 1, 16, 16, generator=g), y


# --- models and their (cached) pretraining --------------------------------------------------------------------------

class LMBlock(nn.Module):
    def __init__(self, d=D, heads=2, p=0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(B, T, self.heads, C // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.o(a.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyLM(nn.Module):
    """A pre-norm causal LM with tied input/output embeddings."""

    def __init__(self, V=V0, d=D, L=2):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(TMAX, d)
        self.blocks = nn.ModuleList(LMBlock(d) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def run_blocks(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def hidden(self, ids=None, embeds=None):
        x = self.emb(ids) if embeds is None else embeds
        x = x + self.pos(torch.arange(x.shape[1]))
        return self.ln_f(self.run_blocks(x))

    def forward(self, ids):
        return self.head(self.hidden(ids))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), ignore_index=-100)


@functools.lru_cache(None)
@frozen_rng
def _lm(steps=300):
    """Pretrained on strides 1-4 over all TMAX positions (the loss ends near 0.25; its floor is log(4)/23)."""
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / steps))
    for i in range(steps):
        ids, _ = counting(i, T=TMAX, strides=(1, 2, 3, 4), seed=9)
        loss = lm_loss(m(ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return m


def pretrained_lm():
    return copy.deepcopy(_lm()).train()


class Trunk(nn.Module):
    def __init__(self, h=64, L=4, K=4, p=0.0):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16 if i == 0 else h, h), nn.LayerNorm(h), nn.GELU(),
                                                  nn.Dropout(p)) for i in range(L))
        self.head = nn.Linear(h, K)

    def features(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, x):
        return self.head(self.features(x))


@functools.lru_cache(None)
@frozen_rng
def _trunk(h=64, L=4, task="A", steps=60):
    W = WA if task == "A" else WB
    m = Trunk(h, L, K=W.shape[1])
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for i in range(steps):
        x, y = classes(W, i, seed=7)
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


def pretrained_trunk(K=6, **kw):
    """The task-A trunk with a new K-way head (initialised from the global RNG)."""
    m = copy.deepcopy(_trunk(**kw))
    m.head = nn.Linear(m.head.in_features, K)
    return m.train()


class SmallCNN(nn.Module):
    def __init__(self, K=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Linear(32, K)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


@functools.lru_cache(None)
@frozen_rng
def _cnn():
    m = SmallCNN()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for i in range(40):
        x, y = images(TMPL_A, i, seed=5)
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


def pretrained_cnn(K=4):
    m = copy.deepcopy(_cnn())
    m.head = nn.Linear(32, K)
    return m.train()


# --- 1. LoRA as a parametrization -----------------------------------------------------------------------------------

class LoRAParam(nn.Module):
    def __init__(self, out_f, in_f, r=4, alpha=8):
        super().__init__()
        self.A = nn.Parameter(torch.randn(r, in_f) / math.sqrt(in_f))
        self.B = nn.Parameter(torch.zeros(out_f, r))
        self.scale = alpha / r

    def forward(self, W):
        return W + (self.B @ self.A).to(W.dtype) * self.scale


def stride5(i, **kw):
    """Fine-tuning data: counting by 5, a stride the LM never saw."""
    return counting(i, strides=(5,), seed=kw.pop("seed", 1), **kw)[0]


def test_lora_parametrization_on_frozen_fp32_lm_twin():
    def build():
        m = pretrained_lm().requires_grad_(False)
        for name, mod in list(m.named_modules()):
            if name.split(".")[-1] in ("q", "v"):
                parametrize.register_parametrization(mod, "weight", LoRAParam(*mod.weight.shape))
        return m

    def loop(m, watched):
        opt = torch.optim.AdamW(trainable(m), lr=1e-2, weight_decay=0.0)
        return fit(m, opt, lambda m, i: lm_loss(m(ids := stride5(i)), ids), steps=40, watched=watched)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 2. QLoRA-style int8 base, bf16 ---------------------------------------------------------------------------------

class QLoRALinear(nn.Module):
    def __init__(self, lin, r=4, alpha=8, p=0.05):
        super().__init__()
        W = lin.weight.detach()
        s = W.abs().amax(1, keepdim=True) / 127
        self.register_buffer("qweight", torch.round(W / s).to(torch.int8))
        self.register_buffer("wscale", s.to(BF16))
        self.register_buffer("bias", lin.bias.detach().to(BF16))
        self.lora_A = nn.Linear(W.shape[1], r, bias=False)
        self.lora_B = nn.Linear(r, W.shape[0], bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_drop, self.scale = nn.Dropout(p), alpha / r

    def forward(self, x):
        w = self.qweight.to(BF16) * self.wscale
        return F.linear(x.to(BF16), w, self.bias) + self.lora_B(self.lora_A(self.lora_drop(x))) * self.scale


def test_qlora_int8_base_bf16_lora_dropout_twin():
    def build():
        m = pretrained_lm().requires_grad_(False)
        for b in m.blocks:
            for name in ("q", "k", "v", "o", "fc1", "fc2"):
                setattr(b, name, QLoRALinear(getattr(b, name)))
        return m

    def loop(m, watched):
        opt = torch.optim.AdamW(trainable(m), lr=5e-3, weight_decay=0.0)
        return fit(m, opt, lambda m, i: lm_loss(m(ids := stride5(i)), ids), steps=40, watched=watched, dtype=BF16)
    r = twin(build, loop)
    healthy(r.losses, fall=0.7)
    quiet(r.w)


# --- 3. ULMFiT gradual unfreezing -----------------------------------------------------------------------------------

def test_ulmfit_gradual_unfreezing_add_param_group_twin():
    def build():
        m = pretrained_trunk(K=6)
        m.layers.requires_grad_(False)
        return m

    def loop(m, watched):
        opt = torch.optim.AdamW(m.head.parameters(), lr=1e-2)

        def before(i):
            if i and i % 8 == 0 and i // 8 <= len(m.layers):
                k = i // 8
                layer = m.layers[-k].requires_grad_(True)
                opt.add_param_group({"params": list(layer.parameters()), "lr": 1e-2 / 2.6 ** k})
        return fit(m, opt, lambda m, i: F.cross_entropy(m(classes(WB, i)[0]).float(), classes(WB, i)[1]),
                   steps=40, watched=watched, before=before)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 4. linear probe through a user forward hook on a frozen .half() CNN --------------------------------------------

class HookProbe(nn.Module):
    def __init__(self, backbone, K=4):
        super().__init__()
        self.backbone = backbone.half().eval().requires_grad_(False)
        self.head = nn.Linear(32, K)
        self._feats = {}
        backbone.features[8].register_forward_hook(lambda mod, inp, out: self._feats.__setitem__("f", out))

    def train(self, mode=True):
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x):
        with torch.no_grad():
            self.backbone(x.half())                      # the output is thrown away: the hook kept the features
        f = self._feats.pop("f").float().mean((2, 3))
        return self.head(f)


def test_linear_probe_user_forward_hook_frozen_half_cnn():
    m = HookProbe(pretrained_cnn())
    opt = torch.optim.AdamW(m.head.parameters(), lr=3e-2)

    def loss(m, i):
        x, y = images(TMPL_B, i)
        return F.cross_entropy(m(x).float(), y)
    r = fit(m, opt, loss, steps=40, watched=True)
    healthy(r.losses, r.scales, fall=0.8)
    assert all(not p.requires_grad for p in m.backbone.parameters()) and not m.backbone.training
    quiet(r.w)


# --- 5. distillation: fp16 teacher as a submodule ------------------------------------------------------------------

class Distill(nn.Module):
    def __init__(self, teacher, student, T=2.0):
        super().__init__()
        self.teacher = teacher.half().eval().requires_grad_(False)
        self.student, self.T = student, T

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, x, y):
        with torch.no_grad():
            t = self.teacher(x.half()).float()
        s = self.student(x).float()
        T = self.T
        kd = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True,
                      reduction="batchmean") * T * T
        ce = F.cross_entropy(s, y)
        return {"loss": 0.7 * kd + 0.3 * ce, "kd": kd, "ce": ce, "logits": s}


def test_distillation_fp16_teacher_submodule_kl_log_target_twin():
    def build():
        return Distill(copy.deepcopy(_trunk(h=128, L=3, task="B", steps=120)), Trunk(h=32, L=2, K=6))

    def loop(m, watched):
        opt = torch.optim.AdamW(m.student.parameters(), lr=3e-3)

        def loss(m, i):
            out = m(*classes(WB, i))
            return out["loss"], out["ce"]
        return fit(m, opt, loss, steps=40, watched=watched)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 6. token-normalised gradient accumulation, ragged windows -----------------------------------------------------

def var_len(j, B=8, T=16):
    """Stride-3 sequences of lengths 6..16, right-padded with 0; labels -100 on the padding."""
    ids = stride5(j, B=B, T=T, seed=2)
    lens = torch.randint(6, T + 1, (B,), generator=gen(50_000 + j))
    pad = torch.arange(T)[None] >= lens[:, None]
    return ids.masked_fill(pad, 0), ids.masked_fill(pad, -100)


def test_token_normalised_accumulation_ragged_windows():
    m = pretrained_lm()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    per_epoch, accum, epochs = 10, 4, 10
    total = epochs * math.ceil(per_epoch / accum)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 3, max(0.0, (total - s) / (total - 3))))
    torch.manual_seed(0)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for epoch in range(epochs):
        mbs = [var_len(epoch * per_epoch + j) for j in range(per_epoch)]
        for start in range(0, per_epoch, accum):
            window = mbs[start:start + accum]
            n_tok = sum(int((y[:, 1:] != -100).sum()) for _, y in window)
            opt.zero_grad(set_to_none=True)
            acc = 0.0
            for x, y in window:
                with torch.autocast("cpu", dtype=FP16):
                    logits = m(x)
                    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), y[:, 1:].flatten(),
                                           ignore_index=-100, reduction="sum") / n_tok
                sc.scale(loss).backward()
                acc += loss.item()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            sched.step()
            losses.append(acc)
            scales.append(sc.get_scale())
    w.close()
    assert len(losses) == total == 30
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 7. selective activation checkpointing --------------------------------------------------------------------------

def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class SACLM(TinyLM):
    def run_blocks(self, x):
        for b in self.blocks:
            if self.training:
                x = checkpoint(b, x, use_reentrant=False,
                               context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))
            else:
                x = b(x)
        return x


def test_selective_activation_checkpointing_twin():
    def build():
        m = SACLM()
        m.load_state_dict(_lm().state_dict())
        return m

    def loop(m, watched):
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
        return fit(m, opt, lambda m, i: lm_loss(m(ids := stride5(i)), ids), steps=30, watched=watched)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 8. greedy generation samples during training -------------------------------------------------------------------

def test_greedy_generation_samples_every_5_steps_twin():
    prompts = stride5(999, B=2)[:, :4]
    samples = {}

    def generate(m, i):
        m.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
            ids = prompts.clone()
            for _ in range(8):
                nxt = m(ids)[:, -1].float().argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
        m.train()
        samples[i] = ids

    def loop(m, watched):
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
        samples.clear()
        r = fit(m, opt, lambda m, i: lm_loss(m(ids := stride5(i)), ids), steps=30, watched=watched,
                after=lambda i: generate(m, i) if i % 5 == 4 else None)
        return r._replace(losses=r.losses + [float((samples[29] == stride5(999, B=2)[:, :12]).float().mean())])
    r = twin(pretrained_lm, loop)
    healthy(r.losses[:-1], r.scales, fall=0.7)
    quiet(r.w)


# --- 9. fine-tune from a checkpoint; scaler state loaded after the watch; save/restore round trip --------------------

@functools.lru_cache(None)
@frozen_rng
def _checkpoint_bytes():
    m = Trunk()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10)
    for i in range(30):
        x, y = classes(WA, i, seed=7)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        amp_step(loss, opt, sc, m.parameters())
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "scaler": sc.state_dict()}, buf)
    return buf.getvalue()


def test_finetune_from_checkpoint_scaler_state_loaded_after_watch_twin():
    ck = torch.load(io.BytesIO(_checkpoint_bytes()))
    assert ck["scaler"]["scale"] == 2.0 ** 13

    def build():
        m = Trunk(K=6)
        missing, unexpected = m.load_state_dict({k: v for k, v in ck["model"].items() if not k.startswith("head.")},
                                                strict=False)
        assert sorted(missing) == ["head.bias", "head.weight"] and not unexpected
        return m

    def loop(m, watched):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
        sc = torch.amp.GradScaler("cpu")
        w = watching(m, opt, sc, watched)
        sc.load_state_dict(ck["scaler"])
        losses, scales = [], []
        for i in range(40):
            if i == 20:
                buf = io.BytesIO()
                torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict()}, buf)
                buf.seek(0)
                back = torch.load(buf)
                m.load_state_dict(back["model"])
                opt.load_state_dict(back["opt"])
                sc.load_state_dict(back["scaler"])
            opt.zero_grad(set_to_none=True)
            x, y = classes(WB, i)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            amp_step(loss, opt, sc, m.parameters())
            losses.append(loss.item())
            scales.append(sc.get_scale())
        if w:
            w.close()
        return Run(w, losses, scales)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 10. head-only SGD stage, then a new AdamW over everything ------------------------------------------------------

def test_two_stage_head_sgd_then_new_adamw_same_scaler_and_watch():
    m = pretrained_trunk(K=6)
    m.layers.requires_grad_(False)
    torch.manual_seed(0)
    opt = torch.optim.SGD(m.head.parameters(), lr=0.05, momentum=0.9)
    sched = None
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(40):
        if i == 12:
            m.layers.requires_grad_(True)
            opt = torch.optim.AdamW([{"params": m.layers.parameters(), "lr": 5e-4},
                                     {"params": m.head.parameters(), "lr": 2e-3}], weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / 28)))
        opt.zero_grad(set_to_none=True)
        x, y = classes(WB, i)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        amp_step(loss, opt, sc, trainable(m))
        if sched:
            sched.step()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 11. LLRD x no-decay groups under OneCycleLR, weighted CE -------------------------------------------------------

class SeqClassifier(nn.Module):
    def __init__(self, lm, K=4):
        super().__init__()
        self.lm, self.drop, self.cls = lm, nn.Dropout(0.1), nn.Linear(D, K)

    def forward(self, ids):
        return self.cls(self.drop(self.lm.hidden(ids).mean(1)))


def llrd_groups(m, lr=1e-2, decay=0.75, wd=0.01):
    levels = {"lm.emb": 0, "lm.pos": 0, "lm.blocks.0": 1, "lm.blocks.1": 2, "lm.ln_f": 3, "cls": 3}
    groups = {}
    for n, p in m.named_parameters():
        lvl = next(v for k, v in levels.items() if n.startswith(k))
        nd = n.endswith("bias") or ".ln" in n or n.startswith(("lm.emb", "lm.pos"))
        key = (lvl, nd)
        groups.setdefault(key, {"params": [], "lr": lr * decay ** (3 - lvl), "weight_decay": 0.0 if nd else wd})
        groups[key]["params"].append(p)
    return list(groups.values())


def test_llrd_no_decay_groups_onecycle_per_group_max_lr_weighted_ce():
    m = SeqClassifier(pretrained_lm())
    opt = torch.optim.AdamW(llrd_groups(m))
    assert len(opt.param_groups) == 7
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=40,
                                                pct_start=0.15)
    probs = (0.4, 0.3, 0.2, 0.1)
    weight = 1 / torch.tensor(probs)
    weight = weight / weight.mean()

    def loss(m, i):
        ids, y = counting(i, strides=(1, 2, 3, 4), probs=probs, seed=3)
        return F.cross_entropy(m(ids).float(), y, weight=weight)
    r = fit(m, opt, loss, steps=40, watched=True, sched=sched)
    healthy(r.losses, r.scales, fall=0.8, k=6)
    quiet(r.w)


# --- 12. CutMix + label smoothing -----------------------------------------------------------------------------------

def cutmix(x, y, i, p=0.5):
    g = gen(70_000 + i)
    if float(torch.rand(1, generator=g)) > p:
        return x, y, y, 1.0
    lam = float(torch.rand(1, generator=g))
    H, W = x.shape[-2:]
    r = math.sqrt(1 - lam)
    ch, cw = int(H * r), int(W * r)
    cy, cx = int(torch.randint(0, H, (1,), generator=g)), int(torch.randint(0, W, (1,), generator=g))
    y0, y1, x0, x1 = max(cy - ch // 2, 0), min(cy + ch // 2, H), max(cx - cw // 2, 0), min(cx + cw // 2, W)
    perm = torch.randperm(x.shape[0], generator=g)
    x = x.clone()
    x[..., y0:y1, x0:x1] = x[perm][..., y0:y1, x0:x1]
    lam = 1 - (y1 - y0) * (x1 - x0) / (H * W)
    return x, y, y[perm], lam


def test_cutmix_label_smoothing_pretrained_bn_cnn():
    m = pretrained_cnn()
    opt = torch.optim.AdamW([{"params": m.features.parameters(), "lr": 1e-3},
                             {"params": m.head.parameters(), "lr": 5e-3}])

    def loss(m, i):
        x, y = images(TMPL_B, i)
        x, ya, yb, lam = cutmix(x, y, i)
        out = m(x).float()
        l = lam * F.cross_entropy(out, ya, label_smoothing=0.1) + (1 - lam) * F.cross_entropy(out, yb,
                                                                                          label_smoothing=0.1)
        return l
    r = fit(m, opt, loss, steps=40, watched=True)
    healthy(r.losses, r.scales, fall=0.85, k=8)
    quiet(r.w)


# --- 13. round-robin multi-task, dict output ------------------------------------------------------------------------

class MultiTask(nn.Module):
    def __init__(self, trunk):
        super().__init__()
        self.trunk = trunk
        self.heads = nn.ModuleDict({"cls": nn.Linear(64, 6), "reg": nn.Linear(64, 1), "tags": nn.Linear(64, 8)})

    def forward(self, x, task):
        h = self.trunk.features(x)
        return {task: self.heads[task](h), "hidden": h}


TASKS = ("cls", "reg", "tags")
TAGW, REGW = WA @ randn(4, 8, seed=11), randn(16, seed=12)
TASK_WEIGHT = {"cls": 1.0, "reg": 0.5, "tags": 2.0}


def task_batch(task, i):
    x, y = classes(WB, i, seed=4)
    if task == "reg":
        y = torch.sin(x @ REGW / 4)[:, None]
    elif task == "tags":
        y = (x @ TAGW > 0).float()
    return x, y


def task_loss(task, out, y):
    if task == "cls":
        return F.cross_entropy(out.float(), y)
    if task == "reg":
        return F.mse_loss(out.float(), y)
    return F.binary_cross_entropy_with_logits(out.float(), y)


def test_round_robin_multitask_dict_output_idle_heads_twin():
    def build():
        t = pretrained_trunk()
        del t.head
        return MultiTask(t)

    def loop(m, watched):
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3)

        def loss(m, i):
            task = TASKS[i % 3]
            x, y = task_batch(task, i)
            return TASK_WEIGHT[task] * task_loss(task, m(x, task)[task], y)
        return fit(m, opt, loss, steps=42, watched=watched)
    r = twin(build, loop)
    for t in range(3):
        healthy(r.losses[t::3], fall=0.8, k=3)
    assert min(r.scales[10:]) >= 1.0
    quiet(r.w)


# --- 14. early stopping mid-epoch inside `with watch`, best weights restored -----------------------------------------

def test_early_stopping_break_mid_epoch_inside_with_best_restored():
    m = pretrained_trunk(K=6)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    xv, yv = classes(WB, 0, n=256, seed=99)
    best, best_state, losses, scales, step, stopped = float("inf"), None, [], [], 0, None
    torch.manual_seed(0)
    with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w:
        for epoch in range(20):
            m.train()
            for j in range(8):
                x, y = classes(WB, step)
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=FP16):
                    loss = F.cross_entropy(m(x).float(), y)
                amp_step(loss, opt, sc, m.parameters())
                losses.append(loss.item())
                scales.append(sc.get_scale())
                step += 1
                if step % 5 == 0:                                # eval_steps=5, epochs of 8
                    m.eval()
                    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
                        logits = m(xv).float()
                    m.train()
                    vl = F.cross_entropy(logits, yv).item()
                    acc = (logits.argmax(1) == yv).float().mean().item()
                    if vl < best:
                        best, best_state = vl, copy.deepcopy(m.state_dict())
                    if acc >= 0.8:
                        stopped = (epoch, j)
                        break
            if stopped:
                break
        m.load_state_dict(best_state)
    assert stopped and stopped[1] < 7, (stopped, step)          # mid-epoch
    healthy(losses, scales, fall=0.7, k=3)
    quiet(w)


# --- 15. BatchNorm statistics frozen from step 10, validation every 5 steps -----------------------------------------

def test_bn_stats_frozen_from_step_10_train_eval_toggles_twin():
    xv, yv = images(TMPL_B, 0, B=64, seed=98)
    val = []

    def before(m, i):
        m.train()
        if i >= 10:
            for mod in m.modules():
                if isinstance(mod, nn.BatchNorm2d):
                    mod.eval()

    def after(m, i):
        if i % 5 == 4:
            m.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
                val.append(F.cross_entropy(m(xv).float(), yv).item())

    def loop(m, watched):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        val.clear()
        r = fit(m, opt, lambda m, i: F.cross_entropy(m(images(TMPL_B, i, B=8)[0]).float(), images(TMPL_B, i, B=8)[1]),
                steps=36, watched=watched, before=lambda i: before(m, i), after=lambda i: after(m, i))
        return r._replace(losses=r.losses + val)
    r = twin(pretrained_cnn, loop)
    healthy(r.losses[:36], r.scales, fall=0.7)
    assert r.losses[-1] < 0.7 * r.losses[36]                       # validation falls too
    quiet(r.w)


# --- 16. resize_token_embeddings by hand, tied head re-tied, positions frozen ----------------------------------------

def resize_token_embeddings(lm, n_new):
    old = lm.emb.weight.detach()
    emb = nn.Embedding(old.shape[0] + n_new, old.shape[1])
    with torch.no_grad():
        emb.weight[:old.shape[0]] = old
        emb.weight[old.shape[0]:] = old.mean(0) + 0.1 * old.std(0) * torch.randn(n_new, old.shape[1])
    lm.emb = emb
    lm.head = nn.Linear(old.shape[1], emb.num_embeddings, bias=False)
    lm.head.weight = lm.emb.weight
    return lm


TASK_TOKENS = {28: 1, 29: -1, 30: 3, 31: -2}                   # new tokens: count up 1, down 1, up 3, down 2


def task_tokens_batch(i, B=16, T=15):
    g = gen(80_000 + i)
    tok = torch.randint(28, 32, (B,), generator=g)
    step = torch.tensor([TASK_TOKENS[int(t)] for t in tok])[:, None]
    s = torch.randint(0, NTOK, (B, 1), generator=g)
    seq = (s + step * torch.arange(T)) % NTOK + 1
    ids = torch.cat([tok[:, None], seq], 1)
    labels = ids.clone()
    labels[:, :2] = -100                                         # predict from the second counted token on
    return ids, labels


def test_resized_tied_embeddings_new_task_tokens_frozen_positions_twin():
    def build():
        m = resize_token_embeddings(pretrained_lm(), 4)
        m.pos.weight.requires_grad_(False)
        return m

    def loop(m, watched):
        opt = torch.optim.AdamW(trainable(m), lr=3e-3)

        def loss(m, i):
            ids, labels = task_tokens_batch(i)
            return lm_loss(m(ids), labels)
        return fit(m, opt, loss, steps=40, watched=watched)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 17. EMA deep-copied after the watch started --------------------------------------------------------------------

def test_ema_deepcopy_after_watch_started_warmup_decay_twin():
    emas, val = {}, []
    xv, yv = images(TMPL_B, 0, B=64, seed=97)

    def loop(m, watched):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        sc = torch.amp.GradScaler("cpu")
        w = watching(m, opt, sc, watched)
        ema = copy.deepcopy(m).eval().requires_grad_(False)         # after the watch: timm builds it after AMP setup
        emas[watched] = ema
        losses, scales = [], []
        for i in range(36):
            m.train()
            opt.zero_grad(set_to_none=True)
            x, y = images(TMPL_B, i)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            amp_step(loss, opt, sc, m.parameters())
            with torch.no_grad():
                d = min(0.998, (1 + i) / (10 + i))
                e_p, m_p = list(ema.parameters()), list(m.parameters())
                torch._foreach_mul_(e_p, d)
                torch._foreach_add_(e_p, m_p, alpha=1 - d)
                for eb, mb in zip(ema.buffers(), m.buffers()):
                    eb.copy_(mb)
            if i % 5 == 4:
                with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
                    val.append(F.cross_entropy(ema(xv).float(), yv).item())
            losses.append(loss.item())
            scales.append(sc.get_scale())
        if w:
            w.close()
        return Run(w, losses + val[-7:], scales)

    r = twin(pretrained_cnn, loop)
    for a, b in zip(emas[False].state_dict().values(), emas[True].state_dict().values()):
        assert torch.equal(a, b)
    healthy(r.losses[:36], r.scales, fall=0.7)
    assert r.losses[-1] < 0.7 * r.losses[36], r.losses[36:]    # the EMA's validation loss falls
    quiet(r.w)


# --- 18. prompt tuning on a frozen .half() LM ------------------------------------------------------------------------

class PromptTuned(nn.Module):
    def __init__(self, lm, n_prompt=8):
        super().__init__()
        self.n_prompt = n_prompt
        self.prompt = nn.Parameter(lm.emb.weight[1:1 + n_prompt].detach().clone())
        self.lm = lm.half().eval().requires_grad_(False)

    def train(self, mode=True):
        super().train(mode)
        self.lm.eval()
        return self

    def forward(self, ids):
        e = self.lm.emb(ids)
        x = torch.cat([self.prompt.to(e.dtype).expand(ids.shape[0], -1, -1), e], 1)
        return self.lm.head(self.lm.hidden(embeds=x))[:, self.n_prompt:]


def test_prompt_tuning_soft_prompt_frozen_half_lm():
    m = PromptTuned(pretrained_lm())
    opt = torch.optim.AdamW([m.prompt], lr=0.1, weight_decay=0.0)

    def loss(m, i):
        ids = counting(i, strides=(3,), seed=6)[0]               # steer the LM (strides 1-4) to count by 3
        return lm_loss(m(ids), ids)
    r = fit(m, opt, loss, steps=40, watched=True)
    healthy(r.losses, r.scales, fall=0.5)
    quiet(r.w)


# --- 19. reward model, Bradley-Terry --------------------------------------------------------------------------------

class RewardModel(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm, self.v_head = lm, nn.Linear(D, 1)

    def forward(self, ids, lengths):
        h = self.lm.hidden(ids)
        return self.v_head(h[torch.arange(ids.shape[0]), lengths - 1]).squeeze(-1)


def preference_pairs(i, B=16, T=16):
    """Chosen: a counting sequence; rejected: the same degenerating into a repetition (its last 2-5 real tokens
    repeat the one before them); lengths 10..16, 0-padded."""
    g = gen(90_000 + i)
    chosen, _ = counting(i, B=B, T=T, seed=8)
    lens = torch.randint(10, T + 1, (B,), generator=g)
    k = torch.randint(2, 6, (B,), generator=g)
    pos, start = torch.arange(T)[None], (lens - k)[:, None]
    rejected = torch.where((pos >= start) & (pos < lens[:, None]), chosen.gather(1, start - 1), chosen)
    pad = pos >= lens[:, None]
    return chosen.masked_fill(pad, 0), rejected.masked_fill(pad, 0), lens


def test_reward_model_bradley_terry_last_token_twin():
    def loop(m, watched):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)

        def loss(m, i):
            c, rj, lens = preference_pairs(i)
            r = m(torch.cat([c, rj]), torch.cat([lens, lens])).float()
            rc, rr = r.chunk(2)
            bt = -F.logsigmoid(rc - rr).mean()
            return bt + 0.01 * (rc + rr).pow(2).mean(), bt
        return fit(m, opt, loss, steps=40, watched=watched)
    r = twin(lambda: RewardModel(pretrained_lm()), loop)
    healthy(r.losses, r.scales, fall=0.8)
    quiet(r.w)


# --- 20. DPO, bf16, frozen reference outside the watch --------------------------------------------------------------

def dpo_batch(i, B=16, P=5, R=8):
    """Prompt: 5 tokens counting by 5; chosen: it continues by 5; rejected: it continues by 1."""
    g = gen(95_000 + i)
    s = torch.randint(0, NTOK, (B, 1), generator=g)
    prompt = (s + 5 * torch.arange(P)) % NTOK
    last = prompt[:, -1:]
    chosen = torch.cat([prompt, (last + 5 * torch.arange(1, R + 1)) % NTOK], 1) + 1
    rejected = torch.cat([prompt, (last + torch.arange(1, R + 1)) % NTOK], 1) + 1
    return chosen, rejected, P


def response_logp(logits, ids, P):
    lp = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp[:, P - 1:].sum(-1)


def test_dpo_bf16_frozen_bf16_reference_outside_watch():
    policy = pretrained_lm()
    ref = copy.deepcopy(policy).to(BF16).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
    beta = 0.1

    def loss(m, i):
        c, rj, P = dpo_batch(i)
        both = torch.cat([c, rj])
        pc, pr = response_logp(m(both), both, P).chunk(2)
        with torch.no_grad():
            rc, rr = response_logp(ref(both), both, P).chunk(2)
        return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
    r = fit(policy, opt, loss, steps=30, watched=True, dtype=BF16)
    assert abs(r.losses[0] - math.log(2)) < 0.15, r.losses[0]   # bf16 policy vs bf16 copy: near log 2
    healthy(r.losses, fall=0.8)
    quiet(r.w)


# --- 21. BitFit, clip_grad_value_ -----------------------------------------------------------------------------------

def test_bitfit_biases_only_clip_grad_value_twin():
    def build():
        m = pretrained_trunk(K=6)
        for n, p in m.named_parameters():
            p.requires_grad_(n.endswith("bias") or n.startswith("head."))
        return m

    def loop(m, watched):
        torch.manual_seed(0)
        params = trainable(m)
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        sc = torch.amp.GradScaler("cpu")
        w = watching(m, opt, sc, watched)
        losses, scales = [], []
        for i in range(40):
            opt.zero_grad(set_to_none=True)
            x, y = classes(WB, i)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_value_(params, 0.5)
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
        if w:
            w.close()
        return Run(w, losses, scales)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 22. Houlsby adapters + R-Drop ----------------------------------------------------------------------------------

class Adapter(nn.Module):
    def __init__(self, d=64, r=8, p=0.1):
        super().__init__()
        self.down, self.up, self.drop = nn.Linear(d, r), nn.Linear(r, d), nn.Dropout(p)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):
        return x + self.up(self.drop(F.gelu(self.down(x))))


class AdaptedTrunk(nn.Module):
    def __init__(self, trunk):
        super().__init__()
        self.trunk = trunk.requires_grad_(False)
        self.adapters = nn.ModuleList(Adapter() for _ in trunk.layers)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(64, 6)

    def forward(self, x):
        for layer, ad in zip(self.trunk.layers, self.adapters):
            x = ad(layer(x))
        return self.head(self.drop(x))


def test_houlsby_adapters_rdrop_two_forwards_twin():
    def loop(m, watched):
        opt = torch.optim.AdamW(trainable(m), lr=3e-3)

        def loss(m, i):
            x, y = classes(WB, i)
            a, b = m(x).float(), m(x).float()
            ce = 0.5 * (F.cross_entropy(a, y) + F.cross_entropy(b, y))
            la, lb = a.log_softmax(-1), b.log_softmax(-1)
            kl = 0.5 * (F.kl_div(la, lb, log_target=True, reduction="batchmean")
                        + F.kl_div(lb, la, log_target=True, reduction="batchmean"))
            return ce + kl, ce
        return fit(m, opt, loss, steps=40, watched=watched)
    r = twin(lambda: AdaptedTrunk(copy.deepcopy(_trunk())), loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 23. ReLoRA restarts: merge into the frozen base, re-initialise, reset the optimizer state ------------------------

class LoRALinear(nn.Module):
    def __init__(self, lin, r=4, alpha=8):
        super().__init__()
        self.base = lin.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, lin.in_features))
        self.lora_B = nn.Parameter(torch.zeros(lin.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T.to(x.dtype)) @ self.lora_B.T.to(x.dtype) * self.scale

    @torch.no_grad()
    def merge_and_reinit(self):
        self.base.weight += (self.lora_B @ self.lora_A) * self.scale
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B.zero_()


def test_relora_merge_reinit_optimizer_reset_every_12_steps_twin():
    def build():
        m = pretrained_lm().requires_grad_(False)
        for b in m.blocks:
            for name in ("q", "v", "fc1", "fc2"):
                setattr(b, name, LoRALinear(getattr(b, name)))
        return m

    def loop(m, watched):
        opt = torch.optim.AdamW(trainable(m), lr=1e-2, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s % 12 + 1) / 3))   # jagged re-warmup

        def before(i):
            if i and i % 12 == 0:
                for mod in m.modules():
                    if isinstance(mod, LoRALinear):
                        mod.merge_and_reinit()
                opt.state.clear()
        return fit(m, opt, lambda m, i: lm_loss(m(ids := stride5(i)), ids), steps=40, watched=watched,
                   sched=sched, before=before)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    quiet(r.w)


# --- 24. class-incremental ------------------------------

TMPL_C = torch.cat([TMPL_B, F.interpolate(randn(2, 1, 4, 4, seed=555), size=(16, 16), mode="bilinear",
                                           align_corners=False)])


def test_class_incremental_head_grown_mid_run_new_optimizer():
    m = pretrained_cnn(K=4)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(210):
        if i == 100:                                                 # two new classes arrive
            old = m.head
            m.head = nn.Linear(32, 6)
            with torch.no_grad():
                m.head.weight[:4] = old.weight
                m.head.bias[:4] = old.bias
            opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        x, y = images(TMPL_B if i < 100 else TMPL_C, i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        amp_step(loss, opt, sc, m.parameters())
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses[:100], scales[:100], fall=0.5)
    healthy(losses[100:], fall=0.7, k=5)
    assert losses[100] > 2 * max(losses[90:100])                 # the new classes are new: the loss jumps, then falls
    assert min(scales[10:]) >= 1.0
    quiet(w)


# --- 25. sparse fine-tuning: a Fisher mask (top 10% by squared gradient) applied by parameter hooks -------------------

def test_sparse_finetune_fisher_mask_param_hooks_twin():
    def build():
        m = pretrained_trunk(K=6)
        fisher = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
        for j in range(4):                                           # fp32 gradients before training, unwatched
            x, y = classes(WB, 10_000 + j)
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
            for n, p in m.named_parameters():
                fisher[n] += p.grad ** 2
        m.zero_grad(set_to_none=True)
        for n, p in m.named_parameters():
            if not n.startswith("head.") and p.ndim == 2:
                f = fisher[n].flatten()
                keep = torch.zeros_like(f, dtype=torch.bool)
                keep[f.topk(f.numel() // 10).indices] = True
                mod, name = m.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]
                mod.register_buffer(f"{name}_mask", keep.view_as(p))
        return m

    def loop(m, watched):
        for mod in m.modules():                 # tensor hooks do not survive a deepcopy: registered per copy
            if hasattr(mod, "weight_mask"):
                mod.weight.register_hook(lambda g, mask=mod.weight_mask: g * mask)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
        return fit(m, opt, lambda m, i: F.cross_entropy(m(classes(WB, i)[0]).float(), classes(WB, i)[1]),
                   steps=40, watched=watched)
    m0 = pretrained_trunk(K=6)
    r = twin(build, loop)
    healthy(r.losses, r.scales, fall=0.7)
    moved = (m0.layers[0][0].weight != _trunk().layers[0][0].weight).float().mean()
    assert moved == 0
    quiet(r.w)
