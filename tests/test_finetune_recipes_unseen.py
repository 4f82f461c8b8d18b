"""FINE-TUNING RECIPES under fp16, in plain PyTorch on CPU: knowledge distillation with a temperature, label
smoothing by hand after a head re-initialisation, a weight-tied LM whose vocabulary was resized, prompt tuning whose
soft prompt grew, and LoRA adapters cast to fp16 - each broken by an fp16 hazard at a known step (BAD = 5), on
synthetic token data from fixed seeds (sequence classification: label = first token mod 4; next-token LM).

Loop: probe_harness.probe_run (AdamW, GradScaler("cpu") at its defaults, CPU fp16 autocast, unscale_ ->
clip_grad_norm_(1.0) -> step -> update, ampdoctor.watch(model, optimizer=, scaler=, run_dir=tmp_path) at the default
sampling); the fp16-adapter case has its own loop (`fp16_loop`: fp16 weights, no autocast, no scaler - unscale_
refuses fp16 gradients - SGD(momentum 0.9) at lr 1e-3; plain Adam at lr 1e-5 on fp16 weights was tried first and is
not silent: its eps 1e-8 is 0 in fp16 and the first step makes the adapters inf).

Oracle for every overflow case (a failing oracle is a plain failure, never an xfail): the loss is first non-finite at
the bad step and the scaler skips it; Producer's first forward producer is the expected module at that step (None
for user code: every model output finite); the bad step re-run from the weights it ran with is non-finite under fp16
autocast and finite in fp32. Report check (`producer_top3`): an accepted rule at that module ("(run)" = None) and
step among the first three findings, phase forward/null, no overflow/nan_origin error at a module that only passed
the value on. A wrong report raises WrongAnswer (strict xfail via probe_harness.wrong).

Failures:
 kd_module_T005        Distill(student, frozen teacher, kd=DistillKL) with KL(p_t || p_s) by hand, log(softmax(x / T))
                       in fp16; the temperature schedule drops T 4 -> 0.05 at step 5: logit gaps / T > 17 flush
                       probabilities to 0, log(0) = -inf, 0 * -inf = NaN (fp32: finite)  -> overflow/nan_origin/
                       underflow at kd.
 kd_user_T005          the same term computed in the loss code                      -> the same rules at (run).
 smooth_log_head_std1  label smoothing by hand, -(q * softmax(logits).log()).sum(); at step 5 stage 2 re-initialises
                       the classifier head with nn.init.normal_ (std 1, the default, instead of 0.02): logits ~ 30,
                       the fp16 softmax flushes to 0, log(0) = -inf, loss inf         -> overflow/nan_origin at (run).
 tied_double_scale     TiedLM (d_model 1024, lm_head tied to the embedding, no final LayerNorm), the embedding scaled
                       by sqrt(d_model) = 32 twice; the vocabulary was resized for 4 special tokens with rows from
                       nn.init.normal_ (std 1); they first appear at step 5: the self logit 1024 * |e|^2 ~ 1e6
                       overflows fp16                                                  -> overflow at lm_head.
 prompt_grows          prompt tuning on a post-norm encoder, the soft prompt prepended to the token embeddings;
                       by step 5 it has grown 400-fold (lr 0.3, no decay: injected): q @ k^T of the prompt rows
                       passes 65504 in the hand-written attention               -> overflow at blocks.0.attn.
 lora_fp16_adapters_no_master  frozen fp16 base, LoRA adapters (r 4, alpha 8) and head cast to fp16 and stepped
                       directly (silent: every loss finite): after 12 steps > 50% of the lora_A entries never moved
                       (blocks.0.fc1.lora_A's too), while the same steps on fp32 copies move > 95%
                       -> update_underflow/fp16_master_weights at blocks.0.fc1.lora_A step 0.
Healthy twins (each run with and without the watch, probe_harness.twin_checks: losses and final weights bitwise
identical, the loss falls, no producer, no skip after step 2, no RuntimeWarning, no warning/error in the report):
 lora_fp32_adamw_alpha2 (frozen fp16 base, fp32 adapters, alpha/r = 2, AdamW over the trainable params only),
 kd_T2_log_softmax (T = 2, log_softmax + F.kl_div(log_target=True)), smooth_ce_head_std002 (head re-initialised
 with std 0.02 at step 5, F.cross_entropy(label_smoothing=0.1)), tied_scale_once_mean_init (scaled once, new rows
 the mean of the old, the special tokens from step 5), prompt_tuning_fp32_prompt (the prompt at lr 3e-3).
Not made into cases: LoRA alpha/r = 64 overflowing base + delta (with LayerNorm'd inputs and adapters from any
plausible training the delta x 64 stays in the hundreds; an honest overflow needed an unrealistic injection), and
gradual unfreezing / layer-wise lr decay (no fp16-specific failure at a chosen step came out of them in time).

Result when written (torch CPU, 2 runs identical): 11 pass, 0 xfail, the whole file ~6 s. Top findings:
 kd_module_T005        `[error] overflow at kd aten::log step 5: aten::log in `kd` hit its singular point (an input
                       is 0 / -1) and produced -inf`, then `[error] underflow at kd aten::log step 5`.
 kd_user_T005          `[error] nan_origin at (run) step 5: The loss became NaN outside the watched model ...`.
 smooth_log_head_std1  `[error] overflow at (run) step 5: The loss became inf outside the watched model ... log (of a
                       value that rounded to 0)`.
 tied_double_scale     `[error] overflow at lm_head aten::mm step 5: ... finite inputs (max |x| = 3812) gave +inf`.
 prompt_grows          `[error] overflow at blocks.0.attn aten::bmm step 5` (propagates to aten::_softmax).
 lora_fp16_adapters_no_master  `[error] fp16_master_weights at (root) step 0`, `[error] update_underflow at
                       blocks.0.fc1.lora_A step 0: 98% of sampled elements ... did not change`.
 Twins: only `[info] skipped_steps ... a normal rate` (or nothing).
No wrong answer found.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import finite, named_top3, probe_run, producer_top3, twin_checks, wrong
from scenarios import lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

D, V, L, NB, C = 64, 60, 12, 16, 4
BAD = 5


def gen(seed):
    return torch.Generator().manual_seed(8100 + seed)


def b_cls(i):
    """Sequence classification: 16 sequences of 12 tokens (4 distinct batches, cycled); the label is the first
    token mod 4 (read off the first position, BERT's [CLS] pooling)."""
    ids = torch.randint(0, V, (NB, L), generator=gen(i % 4))
    return (ids,), ids[:, 0] % C


# ------------------------------------------------------------------------------------------------------- networks

class Attn(nn.Module):
    """Single-head self-attention by hand: (q @ k^T) / sqrt(d), an fp16 softmax, @ v."""

    def __init__(self, d=D):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, h):
        s = self.q(h) @ self.k(h).transpose(-1, -2) / math.sqrt(h.shape[-1])
        return self.o(torch.softmax(s, -1) @ self.v(h))


class Block(nn.Module):
    """A post-norm (BERT) block: LN(h + attn(h)), LN(h + fc2(gelu(fc1(h))))."""

    def __init__(self, d=D):
        super().__init__()
        self.attn, self.ln1 = Attn(d), nn.LayerNorm(d)
        self.fc1, self.fc2, self.ln2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)

    def forward(self, h):
        h = self.ln1(h + self.attn(h))
        return self.ln2(h + self.fc2(F.gelu(self.fc1(h))))


class Encoder(nn.Module):
    """Embedding -> 2 post-norm blocks -> a classifier head on position 0. `prompt`: a learned soft prompt
    (n_prompt x d) prepended to the token embeddings (prompt tuning); the head then reads the first real token."""

    def __init__(self, n_prompt=0):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        with torch.no_grad():
            self.emb.weight.mul_(0.5)
        self.prompt = nn.Parameter(torch.randn(n_prompt, D) * 0.5) if n_prompt else None
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        n = 0
        if self.prompt is not None:
            n = self.prompt.shape[0]
            h = torch.cat([self.prompt.to(h.dtype).expand(h.shape[0], -1, -1), h], 1)
        for b in self.blocks:
            h = b(h)
        return self.head(h[:, n])


class LoRALinear(nn.Module):
    """PEFT's LoRA layer: base(x) + lora_B(lora_A(x)) * alpha / r, the base frozen."""

    def __init__(self, base, r=4, alpha=8.0):
        super().__init__()
        self.base, self.scaling = base, alpha / r
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        with torch.no_grad():
            self.lora_B.weight.normal_(0, 0.02)        # resumed adapters (stage 2 of a run): B is no longer 0

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def lora_model(adapters_fp16=False, alpha=8.0):
    """A pretrained Encoder, frozen and cast to fp16 (the base), with LoRA adapters (r=4) on both blocks' fc1
    and fc2 and the head trainable (fp32, or fp16 where the recipe casts them)."""
    torch.manual_seed(0)
    m = Encoder().requires_grad_(False).half()
    for b in m.blocks:
        b.fc1, b.fc2 = LoRALinear(b.fc1, alpha=alpha), LoRALinear(b.fc2, alpha=alpha)
    m.head = nn.Linear(D, C)
    if adapters_fp16:
        for n, mod in m.named_modules():
            if "lora_" in n or n == "head":
                mod.half()
    return m


def trainable(m):
    return [p for p in m.parameters() if p.requires_grad]


class DistillKL(nn.Module):
    """The distillation term (CRD's DistillKL) written by hand: KL(p_t || p_s) on softmax(logits / T), with
    log(softmax(s / T)) and p_t * (log p_t - log p_s), times T^2."""

    def __init__(self, T):
        super().__init__()
        self.T = T

    def forward(self, s, t):
        p_s, p_t = torch.softmax(s / self.T, -1), torch.softmax(t / self.T, -1)
        return (p_t * (p_t.log() - p_s.log())).sum(-1).mean() * self.T ** 2


class DistillKLStable(DistillKL):
    """The same term as torchdistill / CRD ship it: log_softmax and F.kl_div(log_target=True)."""

    def forward(self, s, t):
        return F.kl_div(F.log_softmax(s / self.T, -1), F.log_softmax(t / self.T, -1), log_target=True,
                        reduction="batchmean") * self.T ** 2


class Distill(nn.Module):
    """Student fine-tuned against a frozen teacher; `kd` (a module, or None: the term in the loss code) gives the
    distillation term. forward -> (student logits, teacher logits, kd term or None)."""

    def __init__(self, kd):
        super().__init__()
        torch.manual_seed(1)
        self.teacher = Encoder().requires_grad_(False)
        torch.manual_seed(0)
        self.student, self.kd = Encoder(), kd

    def forward(self, ids):
        s = self.student(ids)
        with torch.no_grad():
            t = self.teacher(ids)
        return s, t, (self.kd(s, t) if self.kd is not None else None)


def kd_loss(out, y):
    s, t, kd = out
    return 0.5 * F.cross_entropy(s, y) + 0.5 * kd


def kd_user(T):
    """The distillation term in the loss code (outside the model), the same formula as DistillKL."""
    def loss(out, y):
        s, t, _ = out
        return 0.5 * F.cross_entropy(s, y) + 0.5 * DistillKL(T)(s, t)
    return loss


class TiedLM(nn.Module):
    """A small LM, lm_head tied to the embedding, no final LayerNorm: emb * sqrt(d) (`scale` applied `n_scale`
    times: once in the embedding module the recipe ported, once more in the model's forward), a pre-norm MLP
    block, the tied head."""

    def __init__(self, d=1024, vocab=64, n_scale=1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        with torch.no_grad():
            self.emb.weight.normal_(0, 0.02)
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 256), nn.Linear(256, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.emb.weight
        self.scale, self.n_scale = math.sqrt(d), n_scale

    def forward(self, ids):
        h = self.emb(ids) * self.scale ** self.n_scale
        h = h + self.fc2(F.gelu(self.fc1(self.ln(h))))
        return self.lm_head(h)


LM_OLD = 60     # the pretrained vocabulary; ids 60-63 are the special tokens added for fine-tuning


def b_lm(first_new=None):
    """Next-token data: sequences t, t+1, ... (mod 60) from fixed seeds; from step `first_new` on each sequence
    starts with one of the four added special tokens."""
    def b(i):
        g = gen(100 + i % 4)
        start = torch.randint(0, LM_OLD, (8, 1), generator=g)
        ids = (start + torch.arange(9)) % LM_OLD
        if first_new is not None and i >= first_new:
            ids[:, 0] = LM_OLD + torch.randint(0, 4, (8,), generator=g)
        return (ids[:, :-1],), ids[:, 1:]
    return b


def lm_ce(out, y):
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def resize_new_rows(mean_init):
    """The vocabulary was resized for 4 special tokens; their rows initialised by nn.init.normal_ (std 1, the
    default) or (mean_init) as the mean of the old rows (transformers' default since 4.46)."""
    def f(m):
        with torch.no_grad():
            if mean_init:
                m.emb.weight[LM_OLD:] = m.emb.weight[:LM_OLD].mean(0)
            else:
                nn.init.normal_(m.emb.weight[LM_OLD:])
        return m
    return f


def smooth_by_hand(eps=0.1):
    """Label smoothing written in the loss code: q = (1 - eps) one-hot + eps / C, -(q * log(softmax(logits))).sum."""
    def loss(out, y):
        logp = torch.softmax(out, -1).log()
        q = F.one_hot(y, C).to(logp.dtype) * (1 - eps) + eps / C
        return -(q * logp).sum(-1).mean()
    return loss


def smooth_ce(out, y):
    return F.cross_entropy(out, y, label_smoothing=0.1)


def ce(out, y):
    return F.cross_entropy(out, y)


# ---------------------------------------------------------------------------------------------------- injections

def at(k, f):
    def inj(i, m):
        if i == k:
            f(m)
    return inj


def reinit_head(std):
    """Stage 2 of the recipe re-initialises the classifier head for the new label set: nn.init.normal_(std)."""
    def f(m):
        nn.init.normal_(m.head.weight, std=std)
        m.head.bias.zero_()
    return f


def set_T(T):
    def f(m):
        m.kd.T = T
    return f


def grow_prompt(k):
    """Prompt tuning at lr 0.3 without weight decay: by the bad step the soft prompt has grown k-fold."""
    def f(m):
        m.prompt.mul_(k)
    return f


def set_user_T(box, T):
    def f(m):
        box["T"] = T
    return f


# ------------------------------------------------------------------------------------------------- failure cases
# name: (model factory, batch, loss_fn, inject or None, bad step, expected module (None: "(run)"), accepted rules)
CASES = {
    "kd_module_T005": (lambda: Distill(DistillKL(4.0)), b_cls, kd_loss, at(BAD, set_T(0.05)), BAD, "kd",
                       ("overflow", "nan_origin", "underflow")),
    "kd_user_T005": (lambda: Distill(None), b_cls, None, None, BAD, None, ("overflow", "nan_origin", "underflow")),
    "smooth_log_head_std1": (Encoder, b_cls, smooth_by_hand(), at(BAD, reinit_head(1.0)), BAD, None,
                             ("overflow", "nan_origin", "underflow")),
    "tied_double_scale": (lambda: resize_new_rows(False)(TiedLM(n_scale=2)), b_lm(BAD), lm_ce, None, BAD,
                          "lm_head", ("overflow",)),
    "prompt_grows": (lambda: Encoder(n_prompt=4), b_cls, ce, at(BAD, grow_prompt(400.0)), BAD, "blocks.0.attn",
                     ("overflow",)),
}
XFAIL: dict = {}


def build(factory):
    torch.manual_seed(0)
    return factory()


def case_fn(name):
    """(loss_fn, inject) of a case; kd_user_T005's temperature, annealed 4 -> 0.05 at the bad step, lives in the
    loss code."""
    factory, mk, loss_fn, inj, bad, *_ = CASES[name]
    if loss_fn is None:
        box = {"T": 4.0}
        return (lambda out, y: kd_user(box["T"])(out, y)), at(bad, set_user_T(box, 0.05)), box
    return loss_fn, inj, None


def run_case(name, tmp_path):
    factory, mk, _, _, bad, *_ = CASES[name]
    loss_fn, inj, _ = case_fn(name)
    return probe_run(build(factory), mk, loss_fn, bad + 2, str(tmp_path / "run"), inject=inj, snap_at=bad)


def replay_bad(name, r):
    """The bad step from the weights it ran with (and the injection's state): (outputs, loss) under fp16 autocast
    and in fp32."""
    factory, mk, _, _, bad, *_ = CASES[name]
    res = []
    for half in (True, False):
        m = build(factory)
        loss_fn, inj, _ = case_fn(name)
        with torch.no_grad():
            for i in range(bad + 1):
                inj is not None and inj(i, m)
        m.load_state_dict(r["sd"])
        (args, y) = mk(bad)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=half):
            out = m(*args)
            loss = loss_fn(out, y)
        res.append((out, loss))
    return res


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_finetune_fails(name, tmp_path):
    *_, bad, where, rules = CASES[name]
    r = run_case(name, tmp_path)
    # oracle: the loss is first non-finite at the bad step and the scaler skips it; the producer is `where`
    assert r["bad_loss"] and r["bad_loss"][0] == bad, r["losses"]
    assert bad in r["skipped"], r["skipped"]
    assert r["first"] == (None if where is None else (where, bad)), r["first"]
    (o16, l16), (o32, l32) = replay_bad(name, r)
    assert not torch.isfinite(l16), l16
    if where is None:
        assert finite(o16), name                        # user code: the model's outputs were finite
    assert finite(o32) and torch.isfinite(l32), l32     # fp16's doing: the same step in fp32 is finite
    f = producer_top3(r["rep"], rules, where, bad)
    print(name, "->", f.one_line())


# ------------------------------------------------------------------------- the silent one: fp16 adapters, no master
def fp16_loop(m, steps, run_dir, watch=True, lr=1e-3):
    """The recipe's loop with the adapters cast to fp16 (so no GradScaler: unscale_ refuses fp16 gradients):
    SGD(momentum 0.9) over the fp16 trainable parameters, loss.float(), backward, step."""
    opt = torch.optim.SGD(trainable(m), lr=lr, momentum=0.9)
    losses, rep = [], None
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, run_dir=run_dir) if watch else None
        for i in range(steps):
            (ids,), y = b_cls(i)
            opt.zero_grad()
            loss = F.cross_entropy(m(ids).float(), y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
        if w is not None:
            w.close()
            rep = w.report()
    return losses, rep


def test_lora_fp16_adapters_no_master(tmp_path):
    steps = 12
    m = lora_model(adapters_fp16=True)
    a0 = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    losses, rep = fp16_loop(m, steps, str(tmp_path / "run"))
    # oracle: most of the adapters' entries never moved (w + lr * v rounds back to w in fp16) ...
    lora_a = [n for n in a0 if n.endswith("lora_A.weight")]
    still = sum(int((m.get_parameter(n) == a0[n]).sum()) for n in lora_a) / sum(a0[n].numel() for n in lora_a)
    assert still > 0.5 and all(map(math.isfinite, losses)), (still, losses)
    first = "blocks.0.fc1.lora_A.weight"
    assert (m.get_parameter(first) == a0[first]).float().mean() > 0.5
    # ... while the same updates on an fp32 master copy move every entry
    m32 = lora_model(adapters_fp16=True)
    for n, p in m32.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    for mod in m32.modules():
        if isinstance(mod, LoRALinear):
            mod.base.float()
    m32.emb.float()
    for b in m32.blocks:
        b.attn.float(), b.ln1.float(), b.ln2.float()
    fp16_loop(m32, steps, None, watch=False)
    moved = sum(int((m32.get_parameter(n) != a0[n].float()).sum()) for n in lora_a) / sum(a0[n].numel()
                                                                                           for n in lora_a)
    assert moved > 0.95, moved
    print("still", still, "moved fp32", moved, lines(rep)[:3])
    # the report: the updates of the first adapter round away from step 0 (the first module whose do)
    f = named_top3(rep, ("update_underflow", "fp16_master_weights"), "blocks.0.fc1.lora_A", 0)
    print(f.one_line())


# ---------------------------------------------------------------------------------------------------------- twins
# name: (factory, batch, loss_fn, inject, steps, lr, trainable params only)
TWINS = {
    "lora_fp32_adamw_alpha2": (lora_model, b_cls, ce, None, 30, 3e-3, True),
    "kd_T2_log_softmax": (lambda: Distill(DistillKLStable(2.0)), b_cls, kd_loss, None, 30, 3e-3, False),
    "smooth_ce_head_std002": (Encoder, b_cls, smooth_ce, at(BAD, reinit_head(0.02)), 30, 3e-3, False),
    "tied_scale_once_mean_init": (lambda: resize_new_rows(True)(TiedLM(n_scale=1)), b_lm(BAD), lm_ce, None, 30,
                                  1e-3, False),
    "prompt_tuning_fp32_prompt": (lambda: Encoder(n_prompt=4), b_cls, ce, None, 30, 3e-3, False),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_finetune_twin(name, tmp_path):
    factory, mk, loss_fn, inj, steps, lr, only = TWINS[name]
    runs = []
    for w in (True, False):
        m = build(factory)
        runs.append(probe_run(m, mk, loss_fn, steps, str(tmp_path / f"w{w}"), inject=inj, lr=lr, watch=w,
                              params=trainable(m) if only else None))
    r, plain = runs
    twin_checks(r, plain, steps)
    print(name, lines(r["rep"])[:3])
