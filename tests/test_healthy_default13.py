"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`, nothing else; several also
at `every=1`), thirteenth set: FINE-TUNING AND TRAINING-RECIPE patterns that real users run every day - PEFT/LoRA and
QLoRA adapters on a frozen low-precision base, EMA / teacher copies, distillation, gradual unfreezing, layer-wise lr
decay, variable gradient accumulation, sparse MoE routing, SWA, mixup/cutmix with label smoothing, bf16 without a
scaler, and fp32 with a disabled GradScaler. Tiny models (hidden 16-64), 25-40 steps each, fixed seeds, CPU, fp16
autocast + `torch.amp.GradScaler("cpu")` unless stated.

Each run is first asserted healthy by the test's own oracle (`Loop.finish`): every loss finite; the mean of the last
k losses below a stated factor of the first k (and a clean held-out loss falls where the training loss is noisy by
design: mixup, SWA); GradScaler skipped only its first few backoffs (growth_interval is 2000, so in 25-40 steps the scale
never grows and every skip is one halving of the initial 65536: at most 4 in all, never two running after the first
applied step); every
parameter finite at the end. Then it is judged: no warning and no error in the report (info is fine), exit code 0,
and ampdoctor did not switch itself off (`summary.internal_error`).

Cases:
 1. [default, every=1] PEFT-style LoRA: a "pretrained" MLP converted with `.half()` and frozen (`requires_grad_(False)`),
    every Linear wrapped as PEFT's `lora.Linear` does (`base_layer`, `lora_dropout["default"]`,
    `lora_A["default"]` = nn.Linear(in, r) kaiming, `lora_B["default"]` = nn.Linear(r, out) zeros, scaling alpha/r),
    the optimizer on the fp32 adapters only; the task is a rank-2 change of the base (so the zero-born lora_B grows
    from exactly 0 and lora_A's gradient is exactly 0 on step 0 - the PEFT norm);
 2. [default, every=1] QLoRA-ish: the base weights held as int8 with per-row absmax scales (buffers, bitsandbytes' LLM.int8 storage),
    dequantised to fp16 on the fly in every forward (`q.to(fp16) * scale`), fp32 LoRA adapters on top;
 3. EMA outside the watched model: two unwatched copies updated after every step, one with
    `torch._foreach_lerp_(ema, params, 0.1)` (timm ModelEmaV3-style), one with
    `p_ema.mul_(0.999).add_(p, alpha=0.001)` (the classic form); the first EMA's held-out loss falls too;
 4. [default, every=1] an EMA registered as a submodule of the watched model (`model.ema`, eval mode,
    `requires_grad_(False)`), run under `torch.no_grad()` inside the forward for a logged consistency value and
    updated in place with `_foreach_lerp_` after every step;
 5. [default, every=1] knowledge distillation: a frozen fp16 teacher (`.half()`, eval) registered inside the watched
    model and called under `torch.no_grad()` in its forward; loss = 0.7 * T^2 * KL(student/T || teacher/T) + 0.3 *
    CE, T = 4 (Hinton et al.);
 6. [fp32, fp16, fp16 every=1] gradual unfreezing (ULMFiT): only the head in the optimizer first, then at step 10
    the top block's `requires_grad_(True)` and `opt.add_param_group(..., lr=lr / 2.6)`, at step 20 the next block
    likewise; in the fp16 variants the frozen blocks were loaded in half to save memory and are `.float()`-ed as
    they are unfrozen (the same Parameter objects change dtype mid-run, then join the optimizer);
 7. [default, every=1] layer-wise lr decay (ELECTRA/BEiT fine-tuning): 10 parameter groups (embedding, 8 blocks,
    head) with lr = 3e-3 * 0.75^depth, the embedding's group lr=0 (frozen by its lr, gradients still computed), a
    LambdaLR with linear warmup from lr 0 at step 0 and a cosine down to exactly 0 at the last step;
 8. [default, every=1] gradient accumulation with a variable number of micro-batches per optimizer step (the cycle
    1, 4, 2) and each micro-batch's loss divided by that step's count, 25 micro-batches an epoch so that the
    epoch's last step is a partial accumulation (3 of 4), 3 epochs;
 9. [default, every=1] a Switch-style MoE with top-1 routing over 8 experts and 6 tokens a batch (at least 2
    experts get no token, so no gradient, on every step: checked) plus an auxiliary head used only on every third
    step (a conditional branch); `zero_grad(set_to_none=True)`, so those parameters have `grad is None`;
10. [default, every=1] SWA in the last third: `AveragedModel` + `SWALR` (anneal over 4 steps to swa_lr) from step 26 of 39, cosine
    before, `update_bn` on the SWA copy at the end (a BatchNorm1d net); the SWA copy's held-out loss < the start;
11. label smoothing 0.1 with soft targets from mixup and cutmix (alternating, Beta(0.4, 0.4)), dropout and
    stochastic depth (timm DropPath 0.1) on a small residual conv net; a clean held-out loss falls;
12. bf16 autocast, no scaler (`scaler=None`), a two-block causal transformer (tests/scenarios.TinyGPT);
13. [default, every=1] pure fp32 (no autocast) with `GradScaler("cpu", enabled=False)` passed to the watch: the
    `enabled=use_amp` pattern with AMP switched off (scale/unscale_/step/update are pass-throughs).

Results: 24 runs (13 designs), all quiet at the default sampling and at every=1, on the default oneDNN ISA and with
ONEDNN_MAX_CPU_ISA=AVX2 / AVX512_CORE_BF16. The one skip among them (case 9, step 22: the first backoff from 65536
when a 6-token batch's backward overflowed in `router`) is reported as `info` (overflow "as designed" at every=1,
skipped_steps "a normal rate"), as it should be.

What ampdoctor got wrong: nothing in this set (no strict xfails).

Right: zero-born LoRA B / zero A gradient on step 0 (no update_spike, no underflow), int8 dequantisation per forward,
EMA copies outside and inside the watched model (in-place `_foreach_lerp_` on registered frozen parameters is no
update_spike), an fp16 teacher under no_grad inside the forward, add_param_group mid-run (also for parameters that
were fp16 until `.float()` at unfreezing: no fp16_master_weights), 10 groups with an lr-0 group and lr 0 at the
first and last step (no update_underflow / update_spike), 1/4/2/3 micro-batches per step, experts and a branch
with `grad is None` on some steps, AveragedModel + SWALR + update_bn, mixup/cutmix soft targets with label
smoothing and drop-path, bf16 without a scaler, a disabled GradScaler in an fp32 run.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import TinyGPT, gen, one_thread, quiet  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16
EVERY = pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# --- harness ------------------------------------------------------------------------------------------------------

class Loop:
    """A watched AMP loop (autocast -> scale(loss).backward -> unscale_ -> clip -> step -> update) with the test's own
    record: each step's loss and whether GradScaler skipped it (its scale went down at update())."""

    def __init__(self, model, opt, sc, every=None, clip=1.0, dtype=FP16):
        self.model, self.opt, self.sc, self.clip, self.dtype = model, opt, sc, clip, dtype
        self.w = ampdoctor.watch(model, optimizer=opt, scaler=sc, **({} if every is None else {"every": every}))
        self.losses, self.skipped = [], []

    def backward(self, loss):
        (self.sc.scale(loss) if self.sc is not None else loss).backward()

    def step(self, loss_value):
        before = self.sc.get_scale() if self.sc is not None else 1.0
        if self.sc is not None:
            self.sc.unscale_(self.opt)
        if self.clip:
            ps = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(ps, self.clip)
        if self.sc is not None:
            self.sc.step(self.opt)
            self.sc.update()
        else:
            self.opt.step()
        self.skipped.append(self.sc is not None and self.sc.get_scale() < before)
        self.losses.append(float(loss_value))

    def autocast(self):
        return torch.autocast("cpu", dtype=self.dtype or FP16, enabled=self.dtype is not None)

    def one(self, loss_fn):
        """One ordinary optimizer step: `loss_fn()` under autocast. Returns the loss."""
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = loss_fn()
        self.backward(loss)
        self.step(loss.item())
        return loss

    def finish(self, fall=0.7, k=5, max_backoffs=4):
        """Asserts the run was healthy, then that ampdoctor stayed quiet; returns the report."""
        self.w.close()
        ls = self.losses
        assert ls and all(map(math.isfinite, ls)), ls
        assert sum(ls[-k:]) / k < fall * sum(ls[:k]) / k, (ls[:k], ls[-k:])
        # GradScaler's first few backoffs only: growth_interval is 2000, so in these runs the scale never grows and
        # every skip is one more halving of the initial 65536 (at most `max_backoffs`, never two running after the
        # first applied step)
        later = [i for i, s in enumerate(self.skipped) if s and i >= self.skipped.index(False)]
        assert sum(self.skipped) <= max_backoffs and all(b - a > 1 for a, b in zip(later, later[1:])), self.skipped
        for n, p in self.model.named_parameters():
            assert torch.isfinite(p).all(), n
        rep = self.w.report()
        quiet([rep])
        assert not rep.to_dict()["summary"].get("internal_error"), rep.to_dict()["summary"]
        return rep


def scaler():
    return torch.amp.GradScaler("cpu")


def mlp(d=16, h=64, k=8):
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, k))


def teacher_batch(i, B=64, d=16, k=8, seed=7):
    """Fresh inputs each step, labels from a fixed random 2-layer teacher."""
    g = gen(seed)
    w1, w2 = torch.randn(d, 32, generator=g), torch.randn(32, k, generator=g)
    x = torch.randn(B, d, generator=gen(1000 + i))
    return x, (torch.tanh(x @ w1) @ w2).argmax(-1)


# --- 1, 2: LoRA / QLoRA ---------------------------------------------------------------------------------------------

class LoraLinear(nn.Module):
    """PEFT's lora.Linear layout: base_layer (frozen), lora_dropout/lora_A/lora_B ModuleDicts keyed by adapter name,
    A kaiming-uniform (a=sqrt(5)), B zeros, scaling alpha / r; the adapters follow the input's dtype as PEFT does."""

    def __init__(self, base, r=4, alpha=8, dropout=0.05):
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(dropout)})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(self.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, self.out_features, bias=False)})
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B["default"].weight)
        self.scaling = alpha / r

    @property
    def in_features(self):
        return self.base_layer.in_features

    @property
    def out_features(self):
        return self.base_layer.out_features

    def forward(self, x):
        out = self.base_layer(x)
        a, b, drop = self.lora_A["default"], self.lora_B["default"], self.lora_dropout["default"]
        return out + b(a(drop(x))) * self.scaling


class Int8Linear(nn.Module):
    """A weight-only quantised Linear (LLM.int8-style storage: int8 codes + a per-row absmax scale, fp16 bias),
    dequantised to fp16 in every forward."""

    def __init__(self, lin):
        super().__init__()
        w = lin.weight.detach().float()
        s = w.abs().amax(1, keepdim=True) / 127
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.register_buffer("qweight", torch.round(w / s).to(torch.int8))
        self.register_buffer("scale", s.half())
        self.register_buffer("bias", lin.bias.detach().half())

    def forward(self, x):
        w = self.qweight.to(torch.float16) * self.scale
        return F.linear(x.to(torch.float16), w, self.bias)


def lora_task(quant):
    """A "pretrained" MLP stored in fp16 and frozen (or quantised), LoRA on every Linear; targets from the same base
    with a rank-2 change of its middle layer (what the adapters must learn). Returns (model, batch)."""
    base = mlp(16, 64, 8)
    target = copy.deepcopy(base)
    with torch.no_grad():
        u, v = torch.randn(64, 2, generator=gen(3)), torch.randn(2, 64, generator=gen(4))
        target[2].weight += 0.15 * (u @ v)
    base.half().requires_grad_(False)
    for i in (0, 2, 4):
        base[i] = LoraLinear(Int8Linear(base[i]) if quant else base[i])

    def batch(i):
        x = torch.randn(64, 16, generator=gen(100 + i))
        with torch.no_grad():
            return x, target(x)
    return base, batch


def lora_run(quant, every):
    model, batch = lora_task(quant)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)
    assert all(p.dtype == FP16 and not p.requires_grad for n, p in model.named_parameters() if "base_layer" in n)
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    loop = Loop(model, opt, scaler(), every=every)

    def loss_fn(i):
        x, y = batch(i)
        return F.mse_loss(model(x).float(), y)
    for i in range(40):
        loop.one(lambda: loss_fn(i))
    assert all(m.lora_B["default"].weight.abs().max() > 0 for m in model.modules() if isinstance(m, LoraLinear))
    return loop.finish(fall=0.6)


@EVERY
def test_peft_lora_on_frozen_fp16_base(every):
    lora_run(False, every)


@EVERY
def test_qlora_int8_base_dequantised_each_forward(every):
    lora_run(True, every)


# --- 3, 4: EMA ------------------------------------------------------------------------------------------------------

def test_ema_copies_outside_the_watched_model_foreach_lerp_and_mul_add():
    model = mlp()
    ema1, ema2 = copy.deepcopy(model).requires_grad_(False), copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = Loop(model, opt, scaler())
    xv, yv = teacher_batch(999)
    with torch.no_grad():
        start = F.cross_entropy(ema1(xv), yv).item()
    for i in range(40):
        x, y = teacher_batch(i)
        loop.one(lambda: F.cross_entropy(model(x).float(), y))
        with torch.no_grad():
            mp = list(model.parameters())
            torch._foreach_lerp_(list(ema1.parameters()), mp, 0.1)
            for pe, p in zip(ema2.parameters(), mp):
                pe.mul_(0.999).add_(p, alpha=0.001)
    with torch.no_grad():
        assert F.cross_entropy(ema1(xv), yv).item() < 0.8 * start
        assert all(torch.isfinite(p).all() for p in ema2.parameters())
        assert not torch.equal(ema2[0].weight, ema1[0].weight)
    loop.finish()


class WithEma(nn.Module):
    """A net that carries its own EMA as a registered submodule (eval, frozen), run under no_grad in the forward."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.ema = copy.deepcopy(self.net).eval().requires_grad_(False)
        self.last_consistency = None

    def forward(self, x):
        out = self.net(x)
        with torch.no_grad():
            self.last_consistency = (out.float().softmax(-1) - self.ema(x).float().softmax(-1)).pow(2).sum(-1).mean()
        return out

    @torch.no_grad()
    def update_ema(self, decay=0.9):
        torch._foreach_lerp_(list(self.ema.parameters()), list(self.net.parameters()), 1 - decay)


@EVERY
def test_ema_registered_submodule_eval_under_no_grad(every):
    model = WithEma()
    opt = torch.optim.AdamW(model.net.parameters(), lr=1e-2)
    loop = Loop(model, opt, scaler(), every=every)
    cons = []
    for i in range(40):
        x, y = teacher_batch(i)
        loop.one(lambda: F.cross_entropy(model(x).float(), y))
        model.update_ema()
        cons.append(model.last_consistency.item())
    assert all(map(math.isfinite, cons)) and max(cons) > 0
    assert not model.ema.training
    loop.finish()


# --- 5: distillation ------------------------------------------------------------------------------------------------

class Distill(nn.Module):
    def __init__(self, teacher):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.teacher = teacher.half().eval().requires_grad_(False)

    def forward(self, x, y, T=4.0, alpha=0.7):
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
        kd = F.kl_div(F.log_softmax(s.float() / T, -1), F.log_softmax(t.float() / T, -1), reduction="batchmean",
                      log_target=True) * T * T
        return alpha * kd + (1 - alpha) * F.cross_entropy(s.float(), y)


@EVERY
def test_distillation_frozen_fp16_teacher_inside_forward(every):
    teacher = mlp()                           # a "trained", confident teacher: its own argmax defines the labels
    with torch.no_grad():
        teacher[4].weight.mul_(12)
    model = Distill(copy.deepcopy(teacher))

    def batch(i):
        x = torch.randn(64, 16, generator=gen(200 + i))
        with torch.no_grad():
            return x, teacher(x).argmax(-1)
    opt = torch.optim.AdamW(model.student.parameters(), lr=1e-2)
    loop = Loop(model, opt, scaler(), every=every)
    for i in range(40):
        x, y = batch(i)
        loop.one(lambda: model(x, y))
    assert all(p.dtype == FP16 for p in model.teacher.parameters())
    loop.finish(fall=0.7)


# --- 6: gradual unfreezing ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stored", ["fp32", "fp16", "fp16-every1"])
def test_gradual_unfreezing_add_param_group_mid_run(stored):
    """`stored="fp16"`: the frozen layers were loaded in half to save memory and are `.float()`-ed when unfrozen
    (Module.float() changes the Parameter's dtype in place: the same objects, now fp32, join the optimizer)."""
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    for m in (model[0], model[2]):
        m.requires_grad_(False)
        if stored.startswith("fp16"):
            m.half()
    lr = 1e-2
    opt = torch.optim.AdamW(model[4].parameters(), lr=lr)
    loop = Loop(model, opt, scaler(), every=1 if stored.endswith("every1") else None)
    for i in range(36):
        if i in (10, 20):
            layer = model[2] if i == 10 else model[0]
            layer.float().requires_grad_(True)
            opt.add_param_group({"params": list(layer.parameters()), "lr": lr / 2.6 ** (1 if i == 10 else 2)})
        x, y = teacher_batch(i)
        loop.one(lambda: F.cross_entropy(model(x).float(), y))
    assert len(opt.param_groups) == 3
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    loop.finish()


# --- 7: layer-wise lr decay -----------------------------------------------------------------------------------------

class Deep(nn.Module):
    def __init__(self, vocab=32, d=32, n=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


@EVERY
def test_layerwise_lr_decay_ten_groups_zero_lr_embedding_warmup_from_zero_cosine_to_zero(every):
    steps, warm, base, decay = 36, 4, 3e-3, 0.75
    model = Deep()
    groups = [{"params": list(model.emb.parameters()), "lr": 0.0}]
    groups += [{"params": list(b.parameters()), "lr": base * decay ** (8 - j)} for j, b in enumerate(model.blocks)]
    groups += [{"params": list(model.head.parameters()), "lr": base}]
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    assert len(opt.param_groups) == 10

    def f(s):
        if s < warm:
            return s / warm
        return 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - 1 - warm)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    perm = torch.randperm(32, generator=gen(5))        # a fixed "next token" map to learn
    emb0 = model.emb.weight.detach().clone()
    loop = Loop(model, opt, scaler(), every=every)
    lrs = []
    for i in range(steps):
        idx = torch.randint(0, 32, (8, 12), generator=gen(300 + i))
        lrs.append(opt.param_groups[-1]["lr"])
        loop.one(lambda: F.cross_entropy(model(idx).float().flatten(0, 1), perm[idx].flatten()))
        sched.step()
    assert lrs[0] == 0.0 and lrs[-1] < 1e-12 and max(lrs) == pytest.approx(base)
    assert torch.equal(model.emb.weight, emb0) and model.emb.weight.grad is not None
    loop.finish(fall=0.8)


# --- 8: variable gradient accumulation ------------------------------------------------------------------------------

@EVERY
def test_variable_accumulation_1_4_2_with_partial_last_step(every):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = Loop(model, opt, scaler(), every=every)
    counts = []
    for epoch in range(3):
        mb, c = 0, 0
        while mb < 25:
            n = min((1, 4, 2)[c % 3], 25 - mb)
            c += 1
            counts.append(n)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for j in range(n):
                x, y = teacher_batch(mb + j, B=32)   # the same 25 micro-batches each epoch
                with loop.autocast():
                    loss = F.cross_entropy(model(x).float(), y) / n
                loop.backward(loss)
                total += loss.item()
            mb += n
            loop.step(total)
    assert counts[:11] == [1, 4, 2, 1, 4, 2, 1, 4, 2, 1, 3] and len(counts) == 33
    loop.finish(k=11)


# --- 9: MoE with unused experts + a conditional branch ----------------------------------------------------------------

class Switch(nn.Module):
    def __init__(self, d=16, e=8, k=4):
        super().__init__()
        self.inp = nn.Linear(d, 32)
        self.router = nn.Linear(32, e)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(e))
        self.out = nn.Linear(32, k)
        self.aux_head = nn.Linear(32, 1)

    def forward(self, x, aux=False):
        h = F.gelu(self.inp(x))
        probs = self.router(h).float().softmax(-1)
        gate, idx = probs.max(-1)
        y = torch.zeros_like(h)
        self.used = set()
        for e in idx.unique().tolist():
            sel = idx == e
            self.used.add(e)
            y[sel] = (self.experts[e](h[sel]) * gate[sel, None]).to(y.dtype)
        h = h + y
        frac = torch.bincount(idx, minlength=len(self.experts)).float() / len(idx)
        lb = len(self.experts) * (frac * probs.mean(0)).sum()        # Switch load-balancing loss
        return self.out(h), lb, (self.aux_head(h) if aux else None)


@EVERY
def test_moe_top1_unused_experts_and_conditional_branch(every):
    model = Switch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = Loop(model, opt, scaler(), every=every)
    unused = []
    wt = torch.randn(16, 4, generator=gen(8))

    def loss_fn(i):
        x = torch.randn(6, 16, generator=gen(500 + i))
        y = (x @ wt).argmax(-1)                       # a linear 4-class teacher
        logits, lb, aux = model(x, aux=i % 3 == 0)
        loss = F.cross_entropy(logits.float(), y) + 0.01 * lb
        if aux is not None:
            loss = loss + 0.1 * aux.float().pow(2).mean()
        return loss
    for i in range(40):
        loop.one(lambda: loss_fn(i))
        unused.append(sum(model.experts[e][0].weight.grad is None for e in range(8)))
        assert (model.aux_head.weight.grad is None) == (i % 3 != 0)
    assert min(unused) >= 2
    loop.finish(fall=0.8, k=8)


# --- 10: SWA --------------------------------------------------------------------------------------------------------

@EVERY
def test_swa_averaged_model_and_swalr_last_third(every):
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                          nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps, swa_start = 39, 26
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=swa_start)
    swa_model = AveragedModel(model)
    swa_sched = SWALR(opt, swa_lr=0.02, anneal_epochs=4)
    xv, yv = teacher_batch(999)
    with torch.no_grad():
        start = F.cross_entropy(model.eval()(xv), yv).item()
    model.train()
    loop = Loop(model, opt, scaler(), every=every)
    for i in range(steps):
        x, y = teacher_batch(i)
        loop.one(lambda: F.cross_entropy(model(x).float(), y))
        if i >= swa_start:
            swa_model.update_parameters(model)
            swa_sched.step()
        else:
            sched.step()
    update_bn([teacher_batch(j)[0] for j in range(5)], swa_model)
    with torch.no_grad():
        assert F.cross_entropy(swa_model.eval()(xv), yv).item() < 0.7 * start
    assert int(swa_model.n_averaged) == steps - swa_start
    loop.finish(k=5)


# --- 11: label smoothing + mixup/cutmix + dropout/drop-path -------------------------------------------------------------

class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class ResConv(nn.Module):
    def __init__(self, k=6):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
                                    for _ in range(2))
        self.drop_path = DropPath(0.1)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16, k)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = x + self.drop_path(b(x))
        return self.fc(self.drop(x.mean((2, 3))))


def image_batch(i, B=32, k=6):
    g = gen(7)
    templates = torch.randn(k, 3, 8, 8, generator=g)
    gi = gen(400 + i)
    y = torch.randint(0, k, (B,), generator=gi)
    return templates[y] + 0.8 * torch.randn(B, 3, 8, 8, generator=gi), y


def test_label_smoothing_mixup_cutmix_dropout_droppath():
    k = 6
    model = ResConv(k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = Loop(model, opt, scaler())
    beta = torch.distributions.Beta(0.4, 0.4)
    xv, yv = image_batch(999)
    with torch.no_grad():
        start = F.cross_entropy(model.eval()(xv), yv).item()
    model.train()
    for i in range(40):
        x, y = image_batch(i)
        lam = float(beta.sample())
        perm = torch.randperm(x.shape[0])
        if i % 2:                                     # cutmix: paste a box from the permuted batch
            h = int(8 * math.sqrt(1 - lam))
            r, c = torch.randint(0, 8 - h + 1, (2,)).tolist()
            x = x.clone()
            x[:, :, r:r + h, c:c + h] = x[perm, :, r:r + h, c:c + h]
            lam = 1 - h * h / 64
        else:                                         # mixup
            x = lam * x + (1 - lam) * x[perm]
        soft = lam * F.one_hot(y, k).float() + (1 - lam) * F.one_hot(y[perm], k).float()
        loop.one(lambda: F.cross_entropy(model(x).float(), soft, label_smoothing=0.1))
    with torch.no_grad():
        assert F.cross_entropy(model.eval()(xv), yv).item() < 0.5 * start
    loop.finish(fall=0.85, k=8)


# --- 12, 13: bf16 without a scaler, fp32 with a disabled scaler ---------------------------------------------------------

def test_bf16_autocast_no_scaler_tiny_gpt():
    model = TinyGPT(vocab=32, d=32, n=2, T=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = Loop(model, opt, None, dtype=BF16)
    seq = torch.randint(0, 32, (4, 17), generator=gen(9))
    for i in range(36):
        loop.one(lambda: model(seq[:, :-1], seq[:, 1:])["loss"])
    loop.finish(fall=0.7)


@EVERY
def test_fp32_with_disabled_grad_scaler(every):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", enabled=False)     # GradScaler(enabled=use_amp) with use_amp False
    loop = Loop(model, opt, sc, every=every, dtype=None)
    for i in range(36):
        x, y = teacher_batch(i)
        loop.one(lambda: F.cross_entropy(model(x), y))
    assert not sc.is_enabled() and all(p.grad.dtype == torch.float32 for p in model.parameters())
    loop.finish()
