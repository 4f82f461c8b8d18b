"""HEALTHY fine-tuning runs that keep PART of the model in fp16/bf16 on purpose: frozen low-precision parameters or
buffers (never in the optimizer, never written) next to fp32 trainable ones, under CPU autocast. fp16_master_weights
(the optimizer holds fp16 parameters) and update_underflow (low-precision parameters whose updates round away) must
not fire on parameters the optimizer does not hold and nobody writes; no other rule may fire either: no warning,
no error, exit code 0. CPU, fixed seeds, one intra-op thread, tiny models, 60-150 steps.

Each run is proven healthy first by the test's own oracle, independent of ampdoctor (`fit`): every loss finite; the
loss fell (the mean of the last quarter below FALL x the first quarter's); every trainable parameter moved; every
frozen parameter and buffer bitwise unchanged at the end; skipped steps only the scaler's opening search (a run of
skips from step 0, at most OPENING of them) and none later. A failing oracle is a plain failure. Only then must
`w.report()` after `w.close()` hold no finding of severity warning or error (info allowed) and exit code 0; a false
warning/error is to be marked a strict xfail (probe_harness.wrong: WrongAnswer only; `quiet` raises WrongAnswer
quoting the false findings and every finding of the report).

Not duplicated: test_frozen_watch.py (a frozen fp16 teacher watched on its own with an UNWATCHED student, its step
counting; failure cases), test_shared_modules_unseen.py (LoRA adapters that overflow, and their fixed fp32-base
twins), test_healthy_default35.py (a VQ-VAE EMA codebook in buffers; no frozen half-precision parts).

Runs (fp16 = fp16 autocast + torch.amp.GradScaler("cpu"), AdamW on the trainable parameters only; bf16 = bf16
autocast, no scaler):
 1. half_backbone_mlp: an MLP backbone cast with .half(), requires_grad False, + an fp32 Linear head; fp16.
 2. half_backbone_conv_bn: a conv backbone (Conv2d + BatchNorm2d in eval, fp16 running stats) .half() and frozen,
    fp32 pooling head; fp16.
 3. lora_fp16_base: PEFT-style LoraLinear (frozen fp16 base Linear, fp32 lora_A kaiming / lora_B zeros, scaling
    alpha / r = 2) in a two-layer MLP whose other parts are frozen fp16 too; only A/B in AdamW; fp16.
 4. lora_bf16_base: the same adapter layout over a frozen bf16 base; bf16, no scaler.
 5. lora_fp16_attention: LoRA on q and v of a frozen fp16 single-head attention block (a tiny transformer layer,
    LayerNorm frozen fp16 too), an fp32 trainable classifier; fp16.
 6. bf16_embedding_projection: a frozen bf16 Embedding(256, 32) table (mean-pooled) + an fp32 trainable
    projection MLP; bf16, no scaler.
 7. distill_teacher_separate: frozen fp16 teacher run under no_grad, watched by its own watch(teacher); the fp32
    student watched with optimizer and scaler; fp16. Both reports quiet.
 8. distill_teacher_unwatched: the same, the teacher not watched.
 9. distill_teacher_submodule: one wrapper module holding the fp32 student and the frozen fp16 teacher (called under
    no_grad inside its forward), the wrapper watched; fp16.
10. ema_fp32_outside: an fp32 EMA (decay 0.95) of an fp32 model trained under fp16 autocast, a deepcopy outside the
    watched model, updated after each step; fp16. The EMA moves (it is written, fp32): not "frozen".
11. ema_fp32_inside: the same EMA kept inside the watched wrapper as a submodule with requires_grad False; fp16.
12. fp16_rotary_buffers: a tiny rotary-attention regressor whose precomputed cos/sin tables are fp16 buffers
    (persistent=False), and a learned fp16 positional table kept as a frozen buffer, never written; fp16.

Result when written: 12 pass, 0 xfail (stable over two runs, ~2 s of tests on one thread). ampdoctor was quiet on
every run: no finding at any severity (not even info), exit code 0; seen when written (not asserted beyond >= 1):
summary steps equal to the loop's iterations in every report, the separately watched teacher of run 7 too (100).
No skipped step in any run (GradScaler's default 2**16 holds).
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

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import WrongAnswer  # noqa: E402
from scenarios import alarms, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16
FALL = 0.9      # the last quarter's mean loss below this x the first quarter's
OPENING = 16    # the scaler's opening search: at most this many skips, all from step 0 on


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --- the oracle and the loop -------------------------------------------------------------------------------------

def snap(named):
    return {k: v.detach().clone() for k, v in named}


def fit(tmp_path, model, trainable, step_fn, steps, *, dtype=FP16, scaler=True, lr=3e-3, frozen=None,
        after=None, extra_watch=None, watch_model=True):
    """The user's loop: zero_grad -> autocast(dtype) forward + loss (`step_fn(i) -> loss`) -> [scale] backward ->
    [unscale_ -> clip 1.0] -> step -> [update] -> after(i). `trainable`: {name: param} in the optimizer; `frozen`:
    {name: tensor} that must never change (default: every parameter and buffer of `model` not in `trainable`).
    `extra_watch`: another module watched on its own (no optimizer). Returns the reports (main, extra)."""
    opt = torch.optim.AdamW(list(trainable.values()), lr=lr)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    if frozen is None:
        ids = {id(p) for p in trainable.values()}
        frozen = {k: v for k, v in list(model.named_parameters()) + list(model.named_buffers()) if id(v) not in ids}
    f0, t0 = snap(frozen.items()), snap(trainable.items())
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path / "run") if watch_model else None
    we = ampdoctor.watch(extra_watch, run_dir=tmp_path / "extra") if extra_watch is not None else None
    losses, skipped = [], []
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = step_fn(i)
        losses.append(loss.item())
        if sc is not None:
            s0 = sc.get_scale()
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                skipped.append(i)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
            opt.step()
        if after is not None:
            after(i)
    for x in (w, we):
        if x is not None:
            x.close()
    # the oracle
    assert all(map(math.isfinite, losses)), losses
    k = max(1, steps // 4)
    assert sum(losses[-k:]) < FALL * sum(losses[:k]), (losses[:k], losses[-k:])
    assert skipped == list(range(len(skipped))) and len(skipped) <= OPENING, skipped
    still = [n for n, p in trainable.items() if torch.equal(p.detach(), t0[n])]
    assert not still, still
    moved = [n for n, v in frozen.items() if not torch.equal(v.detach(), f0[n])]
    assert not moved, moved
    assert frozen, "a frozen-halves run with nothing frozen"
    assert any(v.dtype in (FP16, BF16) for v in frozen.values()), {n: v.dtype for n, v in frozen.items()}
    return [x.report() for x in (w, we) if x is not None]


def quiet(*reps):
    """No warning or error, exit code 0, in each report: else WrongAnswer quoting the false findings."""
    bad = [a for r in reps for a in alarms(r.findings)] + [f"exit {r.exit_code}" for r in reps if r.exit_code]
    if bad:
        raise WrongAnswer(f"{bad} (all: {[ln for r in reps for ln in lines(r)]})")
    for r in reps:
        assert r.summary["steps"] >= 1, r.summary


def trainable_of(*mods, prefix=""):
    return {f"{prefix}{n}": p for m in mods for n, p in m.named_parameters() if p.requires_grad}


def freeze(m, dtype):
    return m.to(dtype).requires_grad_(False)


# --- 1, 2: a frozen .half() backbone + an fp32 head ----------------------------------------------------------------

class BackboneHead(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        return self.head(self.backbone(x).float())


def teacher_linear(d_in, d_out, seed):
    return torch.randn(d_in, d_out, generator=gen(seed)) / math.sqrt(d_in)


def test_half_backbone_mlp(tmp_path):
    torch.manual_seed(1)
    backbone = freeze(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU()), FP16)
    m = BackboneHead(backbone, nn.Linear(64, 4))
    W = teacher_linear(16, 4, 11)

    def step(i):
        x = torch.randn(32, 16, generator=gen(100 + i % 8))
        return F.cross_entropy(m(x).float(), (x @ W).argmax(-1))
    quiet(*fit(tmp_path, m, trainable_of(m.head, prefix="head."), step, 100))


def test_half_backbone_conv_bn(tmp_path):
    torch.manual_seed(2)
    backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
    with torch.no_grad():  # "pretrained" running statistics
        for bn in (backbone[1], backbone[4]):
            bn.running_mean.uniform_(-0.1, 0.1)
            bn.running_var.uniform_(0.5, 1.5)
    freeze(backbone, FP16).eval()
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3))
    m = BackboneHead(backbone, head)

    def step(i):
        g = gen(200 + i % 6)
        y = torch.randint(0, 3, (16,), generator=g)
        x = torch.randn(16, 3, 12, 12, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float().sub(1) * \
            torch.tensor([1.0, -0.5, 0.3]).view(1, 3, 1, 1)
        return F.cross_entropy(m(x).float(), y)
    m.head.train()
    quiet(*fit(tmp_path, m, trainable_of(m.head, prefix="head."), step, 80, lr=1e-2))


# --- 3, 4, 5: LoRA adapters over a frozen low-precision base --------------------------------------------------------

class LoraLinear(nn.Module):
    """PEFT's layout: base (frozen), lora_A (kaiming), lora_B (zeros), scaling alpha / r; the adapter path in fp32
    weights (autocast casts them for the matmul)."""

    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def lora_mlp(dtype, seed):
    torch.manual_seed(seed)
    fc1, fc2 = freeze(nn.Linear(16, 64), dtype), freeze(nn.Linear(64, 8), dtype)
    return nn.Sequential(LoraLinear(fc1), nn.GELU(), LoraLinear(fc2))


def lora_run(tmp_path, dtype, scaler, seed):
    m = lora_mlp(dtype, seed)
    W = teacher_linear(16, 8, seed + 10)

    def step(i):
        x = torch.randn(32, 16, generator=gen(300 + i % 8))
        return F.mse_loss(m(x).float(), torch.tanh(x @ W) * 2)
    tr = {n: p for n, p in m.named_parameters() if "lora_" in n}
    assert all(p.requires_grad and p.dtype == torch.float32 for p in tr.values())
    return fit(tmp_path, m, tr, step, 100, dtype=dtype, scaler=scaler, lr=5e-3)


def test_lora_fp16_base(tmp_path):
    quiet(*lora_run(tmp_path, FP16, True, 3))


def test_lora_bf16_base(tmp_path):
    quiet(*lora_run(tmp_path, BF16, False, 4))


class LoraAttnLayer(nn.Module):
    def __init__(self, d=32, n_cls=4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.cls = nn.Linear(d, n_cls)

    def forward(self, x):
        h = self.ln(x.to(self.ln.weight.dtype))  # the frozen fp16 stack's hidden states are fp16
        q, k, v = self.q(h), self.k(h), self.v(h)
        a = F.scaled_dot_product_attention(q, k, v)
        h = x + self.o(a)
        return self.cls(h.mean(1).float())


def test_lora_fp16_attention(tmp_path):
    torch.manual_seed(5)
    m = LoraAttnLayer()
    for n in ("ln", "q", "k", "v", "o"):
        freeze(getattr(m, n), FP16)
    m.q, m.v = LoraLinear(m.q), LoraLinear(m.v)
    W = teacher_linear(32, 4, 15)

    def step(i):
        x = torch.randn(8, 10, 32, generator=gen(400 + i % 8))
        return F.cross_entropy(m(x).float(), (x.mean(1) @ W).argmax(-1))
    tr = {n: p for n, p in m.named_parameters() if "lora_" in n or n.startswith("cls.")}
    assert all(p.requires_grad for p in tr.values()) and sum(p.requires_grad for p in m.parameters()) == len(tr)
    quiet(*fit(tmp_path, m, tr, step, 100, lr=5e-3))


# --- 6: a frozen bf16 embedding table ------------------------------------------------------------------------------

class EmbProj(nn.Module):
    def __init__(self, n=256, d=32, k=5):
        super().__init__()
        self.emb = freeze(nn.Embedding(n, d), BF16)
        self.proj = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, k))

    def forward(self, t):
        return self.proj(self.emb(t).mean(1))


def test_bf16_embedding_projection(tmp_path):
    torch.manual_seed(6)
    m = EmbProj()
    label_of = torch.randint(0, 5, (256,), generator=gen(16))

    def step(i):
        t = torch.randint(0, 256, (32, 6), generator=gen(500 + i % 8))
        y = torch.mode(label_of[t], dim=1).values
        return F.cross_entropy(m(t).float(), y)
    quiet(*fit(tmp_path, m, trainable_of(m.proj, prefix="proj."), step, 120, dtype=BF16, scaler=False, lr=1e-2))


# --- 7, 8, 9: distillation from a frozen fp16 teacher --------------------------------------------------------------

def mlp(*dims):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def distill_pair(seed):
    torch.manual_seed(seed)
    teacher = freeze(mlp(16, 64, 64, 6), FP16).eval()
    student = mlp(16, 32, 6)
    return teacher, student


def kd_loss(s_logits, t_logits, T=2.0):
    return F.kl_div(F.log_softmax(s_logits.float() / T, -1), F.softmax(t_logits.float() / T, -1),
                    reduction="batchmean") * T * T


def distill_step(student, teacher):
    def step(i):
        x = torch.randn(32, 16, generator=gen(600 + i % 8))
        with torch.no_grad():
            t = teacher(x)
        return kd_loss(student(x), t)
    return step


@pytest.mark.parametrize("teacher_watched", [True, False], ids=["distill_teacher_separate",
                                                                 "distill_teacher_unwatched"])
def test_distill_teacher(tmp_path, teacher_watched):
    teacher, student = distill_pair(7)
    frozen = dict(teacher.named_parameters())
    reps = fit(tmp_path, student, trainable_of(student), distill_step(student, teacher), 100, frozen=frozen,
               extra_watch=teacher if teacher_watched else None)
    assert len(reps) == (2 if teacher_watched else 1)
    quiet(*reps)


class Distiller(nn.Module):
    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x)
        return kd_loss(self.student(x), t)


def test_distill_teacher_submodule(tmp_path):
    teacher, student = distill_pair(9)
    m = Distiller(student, teacher)

    def step(i):
        return m(torch.randn(32, 16, generator=gen(700 + i % 8)))
    quiet(*fit(tmp_path, m, trainable_of(m.student, prefix="student."), step, 100))


# --- 10, 11: an fp32 EMA of an fp32 model trained under fp16 autocast ---------------------------------------------

def ema_update(ema, model, decay=0.95):
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.mul_(decay).add_(p.detach(), alpha=1 - decay)


def regression_step(model, W, base):
    def step(i):
        x = torch.randn(32, 16, generator=gen(base + i % 8))
        return F.mse_loss(model(x).float(), torch.tanh(x @ W))
    return step


def test_ema_fp32_outside(tmp_path):
    torch.manual_seed(10)
    m = mlp(16, 48, 4)
    ema = copy.deepcopy(m).requires_grad_(False)
    e0 = snap(ema.named_parameters())
    W = teacher_linear(16, 4, 20)
    # the half-precision part: a frozen fp16 input normaliser buffer (never written), inside the watched model
    norm = torch.full((16,), 1.0, dtype=FP16)
    m.register_buffer("in_scale", norm)
    step = regression_step(lambda x: m(x * m.in_scale), W, 800)
    quiet(*fit(tmp_path, m, trainable_of(m), step, 100, after=lambda i: ema_update(ema, m)))
    assert all(not torch.equal(p, e0[n]) for n, p in ema.named_parameters())  # the EMA moved
    assert all(p.dtype == torch.float32 for p in ema.parameters())


class WithEma(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.ema = copy.deepcopy(net).requires_grad_(False)
        self.register_buffer("in_scale", torch.ones(16, dtype=FP16))  # frozen fp16, never written

    def forward(self, x):
        return self.net(x * self.in_scale)


def test_ema_fp32_inside(tmp_path):
    torch.manual_seed(11)
    m = WithEma(mlp(16, 48, 4))
    e0 = snap(m.ema.named_parameters())
    W = teacher_linear(16, 4, 21)
    frozen = {"in_scale": m.in_scale}
    quiet(*fit(tmp_path, m, trainable_of(m.net, prefix="net."), regression_step(m, W, 900), 100, frozen=frozen,
               after=lambda i: ema_update(m.ema, m.net)))
    assert all(not torch.equal(p, e0[n]) for n, p in m.ema.named_parameters())


# --- 12: frozen fp16 rotary / positional tables --------------------------------------------------------------------

def rotary_tables(T, d, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    ang = torch.outer(torch.arange(T).float(), inv)
    return torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class RotaryRegressor(nn.Module):
    def __init__(self, T=12, d=32):
        super().__init__()
        cos, sin = rotary_tables(T, d)
        self.register_buffer("cos", cos.to(FP16), persistent=False)
        self.register_buffer("sin", sin.to(FP16), persistent=False)
        self.register_buffer("pos", (torch.randn(T, d, generator=gen(31)) * 0.1).to(FP16))
        self.inp = nn.Linear(4, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x) + self.pos
        q, k = self.q(h), self.k(h)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        a = F.scaled_dot_product_attention(q, k, self.v(h).to(q.dtype))
        return self.out(a.mean(1)).squeeze(-1)


def test_fp16_rotary_buffers(tmp_path):
    torch.manual_seed(12)
    m = RotaryRegressor()
    w = torch.randn(4, generator=gen(32))

    def step(i):
        x = torch.randn(16, 12, 4, generator=gen(1000 + i % 8))
        y = (x @ w)[:, ::3].mean(1)
        return F.mse_loss(m(x).float(), y)
    frozen = dict(m.named_buffers())
    assert {v.dtype for v in frozen.values()} == {FP16}
    quiet(*fit(tmp_path, m, trainable_of(m), step, 100, frozen=frozen))
