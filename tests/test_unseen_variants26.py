"""Twenty-sixth set: SILENT fp16/bf16 failures (no inf/NaN in the forward of the steps that matter; training just stops
learning or degrades), watched through the public API only (ampdoctor.watch(model, optimizer=..., scaler=...) at
ampdoctor's DEFAULT sampling -> an ordinary CPU loop -> w.report()), with the failure starting mid-run where that is
realistic. Each failure is first proven in the test itself (the share of a layer's updates that rounded away, the
subnormal/zero share of the gradient flowing into a layer read by a full backward hook, the gradient against an fp32
recomputation on the same weights and batch, the weights that went non-finite while a
twin with the fix stays finite); then the rule, at the module, among the first three findings, at or near the onset.

 1. a pre-norm residual MLP fine-tuned in pure bf16 (`model.to(torch.bfloat16)`, AdamW lr 2e-2) with
    MultiStepLR(milestones=[12], gamma=0.25): before the milestone < 50% of any layer's updates round away; from
    step 12 lr = 5e-3 is below half a bf16 ulp of the RMSNorm gains (~1.0, half an ulp 2e-3 / 3.9e-3 against Adam's
    |m / sqrt(v)| ~ lr) and >= 90% of both norms' updates round away, while the Linear layers (|w| < 0.13, half an
    ulp <= 2.4e-4) keep moving (< 50% rounded). The known practice: keep norm gains in fp32 in pure-bf16 training.
    Expected: update_underflow at `blocks.0.norm` / `blocks.1.norm`, dated 12..15 (the lr change is checked on its
    step; ampdoctor checks low-precision updates every 4 steps), none at the Linear layers.
 2. a bf16 recipe moved to fp16 autocast WITHOUT a GradScaler, on a tiny LM trained with a sequence-length warmup
    (Li et al. 2022, DeepSpeed's curriculum: 8 sequences of 8 tokens, then of 16384 from step 12) and a token-mean
    cross-entropy: the per-logit gradient (p - onehot) / (B * T) falls ~2000x at the jump; before it < 25% of the
    gradients flowing into `head`/`fc` are subnormal and the weight gradients are within 1% of fp32's, from it on
    >= 90% are subnormal every step and the embedding's gradient is > 5% off fp32's (FP16.md: "gradients underflow
    without loss scaling"). Expected: underflow (backward) at `head` (or `fc`/`emb`), step 12..15.
 3. `torch.optim.Adafactor(params, eps=(1e-30, 1e-3))` (the eps pair of the Adafactor paper and of HF's Adafactor,
    copied into torch's) over a `.half()` model: torch's Adafactor clamps the variance estimate at eps1 and eps1**2,
    both 0 in fp16; g**2 of the small gradients underflows to 0, rsqrt(0) = inf, and the first update writes inf/NaN
    into the weights while that step's loss was finite (the same fp16 model with eps1=None, i.e. finfo(fp16).eps,
    stays finite). Expected: eps_underflow (error) at the layer or the root.
 4. `torch.optim.RMSprop` with its default eps=1e-8 over a `.half()` value network (small TD targets): 1e-8 is 0 in
    fp16 and (1 - alpha) * g**2 of the small gradients too, so g / (sqrt(0) + 0) writes inf/NaN on the first update
    (a finite loss on that step). Expected: eps_underflow (error), step 0.
Healthy twins (the fix applied; no warning, no error): 1 with fp32 weights under bf16 autocast and the same
MultiStepLR; 2 with a default GradScaler; 3 with fp32 weights under fp16 autocast + GradScaler and the same
Adafactor(eps=(1e-30, 1e-3)); 4 with fp32 weights under fp16 autocast + GradScaler and the same RMSprop.

What ampdoctor got wrong (both fixed since):
 2. (fixed since) no scaler, a sequence-length jump at step 12 that makes 100% of the gradients into `head`/`fc`
    subnormal: an empty report at the default sampling (per-module gradients were recorded on step 0 and on bad
    steps only). A batch with more than 8x the input values of any before now makes its step sampled
    (record/modulehooks._input_jump): `underflow at head step 12`.
 3. (fixed since) Adafactor eps=(1e-30, 1e-3) on fp16 weights gave no eps_underflow: rules/weights.py optimizer_eps
    read `group["eps"]` only as a number, and torch's Adafactor keeps the pair (eps1, eps2); the watch now records
    the pair and the rule reads its smallest value.
Right: 1 (update_underflow at blocks.0.norm and blocks.1.norm, step 12, nothing at the Linear layers), 2, 3, 4
(eps_underflow, step 0), and the four twins are quiet. Tried and dropped (premise too weak to call a failure): a
classifier converging without a scaler (the gradients into the deep layers 50-90% subnormal, yet every weight
gradient within 0.1% of fp32's), and a raw first shard that backs GradScaler off to 0.5 (70% subnormal gradients
into the encoder afterwards, its weight gradient within 0.3% of fp32's).

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_unseen_variants26.py
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import gen, lines, one_thread, quiet

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16_NORMAL = 2.0 ** -14


def found(rep, rules, modules, steps=None, severities=("error",)):
    """A finding of one of `rules` at one of `modules` among the report's first three (asserted), at one of `steps`
    when given, with a severity in `severities`; returns it."""
    hit = [f for f in rep.findings[:3] if f.rule in rules and f.module in modules]
    assert hit, lines(rep)
    f = hit[0]
    assert f.severity in severities, lines(rep)
    if steps is not None:
        assert f.step in steps, lines(rep)
    return f


def subnormal_share(t):
    """Share of the nonzero finite values of `t` below fp16's normal range."""
    nz = t[(t != 0) & torch.isfinite(t)]
    return float((nz.abs() < FP16_NORMAL).float().mean()) if nz.numel() else 1.0


# ======================================================================================================================
# 1./twin. pure-bf16 fine-tune, MultiStepLR: the RMSNorm gains (~1.0) stop moving at the milestone
# ======================================================================================================================
class PreNormMLP(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(norm=nn.RMSNorm(d), fc=nn.Linear(d, d))) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b["fc"](F.gelu(b["norm"](h)))
        return self.head(h)


MILESTONE = 12


def _bf16_finetune(pure):
    """22 steps of AdamW(lr 2e-2) + MultiStepLR([12], 0.25); `pure`: the model in bf16, else fp32 weights under bf16
    autocast. Returns (watch, per-step rounded share of each weight, losses, norm gains at the milestone and end)."""
    torch.manual_seed(0)
    m = PreNormMLP()
    if pure:
        m = m.to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[MILESTONE], gamma=0.25)
    W = torch.randn(16, 1, generator=gen(99))
    w = ampdoctor.watch(m, optimizer=opt)
    share, losses, gains = [], [], {}
    for i in range(22):
        x = torch.randn(64, 16, generator=gen(i))
        y = torch.tanh(x @ W)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not pure):
            out = m(x.to(next(m.parameters()).dtype))
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        opt.step()
        sched.step()
        share.append({n: float(((p.detach() == before[n]) & (grads[n] != 0)).sum() / (grads[n] != 0).sum().clamp(min=1))
                      for n, p in m.named_parameters() if n.endswith("weight")})
        losses.append(loss.item())
        if i == MILESTONE - 1:
            gains["milestone"] = {n: p.detach().clone() for n, p in m.named_parameters() if ".norm." in n}
    gains["end"] = {n: p.detach().clone() for n, p in m.named_parameters() if ".norm." in n}
    w.close()
    return w, share, losses, gains


NORMS = ("blocks.0.norm.weight", "blocks.1.norm.weight")
LINEARS = ("inp.weight", "blocks.0.fc.weight", "blocks.1.fc.weight", "head.weight")


def test_pure_bf16_multisteplr_milestone_freezes_the_rmsnorm_gains():
    w, share, losses, gains = _bf16_finetune(pure=True)
    # real: before the milestone no layer's updates mostly round away; from it on >= 90% of both norms' do, every
    # step, and their gains end exactly where the milestone left them; the Linear layers keep moving
    assert all(s[n] < 0.5 for s in share[:MILESTONE] for n in NORMS + LINEARS), share[:MILESTONE]
    assert all(s[n] >= 0.9 for s in share[MILESTONE:] for n in NORMS), [[s[n] for n in NORMS] for s in share]
    assert all(s[n] < 0.5 for s in share for n in LINEARS), [[s[n] for n in LINEARS] for s in share]
    assert all(float((gains["end"][n] != gains["milestone"][n]).float().mean()) < 0.2 for n in NORMS)
    assert all(map(math.isfinite, losses))
    # ... while the same schedule over fp32 weights keeps moving the gains after the milestone
    _, share32, _, gains32 = _bf16_finetune(pure=False)
    assert all(float((gains32["end"][n] != gains32["milestone"][n]).float().mean()) > 0.9 for n in NORMS)
    rep = w.report()
    found(rep, ("update_underflow",), ("blocks.0.norm", "blocks.1.norm"), steps=range(MILESTONE, MILESTONE + 4))
    # (the Linear layers' updates land: no update_underflow is theirs)
    assert not [f for f in rep.findings if f.rule == "update_underflow"
                and f.module in ("inp", "blocks.0.fc", "blocks.1.fc", "head")], lines(rep)


def test_twin_fp32_weights_under_bf16_autocast_with_the_same_multisteplr_is_quiet():
    w, share, losses, _ = _bf16_finetune(pure=False)
    assert all(map(math.isfinite, losses)) and sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses
    assert all(s[n] < 0.05 for s in share for n in NORMS + LINEARS), share
    quiet([w.report()])


# ======================================================================================================================
# 2./twin. fp16 autocast without a GradScaler: a sequence-length warmup (8 -> 16384 tokens) makes the gradients subnormal
# ======================================================================================================================
class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.emb(idx))))


SWITCH, LONG, SEQ_STEPS = 12, 16384, 16


def _tokens(i):
    """Step i's batch: 8 sequences of 8 tokens before SWITCH, of 16384 after (the sequence-length warmup's jump); the
    target is a fixed permutation of the token (learnable)."""
    x = torch.randint(0, 64, (8, 8 if i < SWITCH else LONG), generator=gen(i))
    return x, (x * 5 + 3) % 64


def _seq_warmup(scaler):
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.Adam(m.parameters(), lr=2e-2)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    seen, sub, errs, losses = {}, [], {}, []
    hooks = [mod.register_full_backward_hook(lambda mod, gi, go, n=n: seen.__setitem__(n, go[0].detach()))
             for n, mod in (("fc", m.fc), ("head", m.head))]
    for i in range(SEQ_STEPS):
        x, y = _tokens(i)
        if i in (SWITCH - 1, SWITCH, SEQ_STEPS - 1):
            # the oracle: the same batch and weights in fp32, the weight gradients before this step's update
            ref = copy.deepcopy(m)
            F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
            g32 = {n: p.grad for n, p in ref.named_parameters() if n.endswith("weight")}
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten())
        (sc.scale(loss) if sc else loss).backward()
        sub.append({n: subnormal_share(t) for n, t in seen.items()})
        if i in (SWITCH - 1, SWITCH, SEQ_STEPS - 1):
            k = sc.get_scale() if sc else 1.0
            errs[i] = {n: float((p.grad / k - g32[n]).norm() / g32[n].norm()) for n, p in m.named_parameters()
                       if n.endswith("weight")}
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    w.close()
    return w, sub, errs, losses


def test_fp16_without_gradscaler_sequence_length_warmup_makes_the_gradients_subnormal():
    w, sub, errs, losses = _seq_warmup(scaler=False)
    # real: before the jump < 25% of the gradients into head/fc are subnormal and the weight gradients are within
    # 1% of fp32's; from it on >= 90% are subnormal on every step, and the embedding's gradient (the deepest) is
    # > 5% off fp32's (every weight gradient > 2%: 20x-100x the error before the jump)
    assert all(v < 0.25 for s in sub[:SWITCH] for v in s.values()), sub[:SWITCH]
    assert all(v >= 0.9 for s in sub[SWITCH:] for v in s.values()), sub[SWITCH:]
    assert max(errs[SWITCH - 1].values()) < 0.01, errs
    assert all(errs[k]["emb.weight"] > 0.05 and min(errs[k].values()) > 0.02 for k in (SWITCH, SEQ_STEPS - 1)), errs
    assert all(map(math.isfinite, losses))
    found(w.report(), ("underflow",), ("head", "fc", "emb", ""), steps=range(SWITCH, SWITCH + 4))


def test_twin_fp16_sequence_length_warmup_with_a_default_gradscaler_is_quiet():
    w, sub, errs, losses = _seq_warmup(scaler=True)
    assert all(map(math.isfinite, losses)) and losses[-1] < 0.7 * losses[0], losses
    assert all(v < 0.05 for s in sub for v in s.values()), sub
    assert max(max(e.values()) for e in errs.values()) < 0.01, errs
    quiet([w.report()])


# ======================================================================================================================
# 3./twin. torch.optim.Adafactor(eps=(1e-30, 1e-3)) over a .half() model: eps1 and eps1**2 are 0 in fp16
# ======================================================================================================================
def _adafactor(half, eps, steps=10):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if half:
        m = m.half()
    opt = torch.optim.Adafactor(m.parameters(), lr=1e-2, eps=eps)
    sc = None if half else torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, first_bad = [], None
    for i in range(steps):
        x = torch.randn(64, 16, generator=gen(i))
        y = x[:, :1] * 0.1
        opt.zero_grad()
        if half:
            loss = (m(x.half()).float() - y).pow(2).mean()
            loss.backward()
            opt.step()
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (m(x).float() - y).pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        losses.append(loss.item())
        if first_bad is None and not all(torch.isfinite(p).all() for p in m.parameters()):
            first_bad = i
    w.close()
    return w, losses, first_bad


def test_torch_adafactor_with_the_paper_eps_pair_on_an_fp16_model():
    w, losses, first_bad = _adafactor(half=True, eps=(1e-30, 1e-3))
    # real: eps1 = 1e-30 and eps1**2 are 0 in fp16 (1e-30 is far below fp16's smallest subnormal); the first update
    # writes inf/NaN into the weights, while eps1=None (finfo(fp16).eps) on the same fp16 model stays finite
    assert torch.tensor(1e-30, dtype=torch.float16).item() == 0.0
    assert first_bad == 0 and math.isfinite(losses[0]), (first_bad, losses)
    _, losses_ok, bad_ok = _adafactor(half=True, eps=(None, 1e-3))
    assert bad_ok is None and all(map(math.isfinite, losses_ok)), losses_ok
    found(w.report(), ("eps_underflow",), ("", "0", "2"))


def test_twin_adafactor_with_the_same_eps_over_fp32_weights_under_autocast_is_quiet():
    w, losses, first_bad = _adafactor(half=False, eps=(1e-30, 1e-3), steps=20)
    assert first_bad is None and all(map(math.isfinite, losses)), losses
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    quiet([w.report()])


# ======================================================================================================================
# 4./twin. torch.optim.RMSprop with its default eps=1e-8 over a .half() value network
# ======================================================================================================================
def _rmsprop(half, steps=12):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    if half:
        m = m.half()
    opt = torch.optim.RMSprop(m.parameters(), lr=1e-3)
    sc = None if half else torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, first_bad, small = [], None, None
    for i in range(steps):
        s = torch.randn(64, 8, generator=gen(i))
        target = 0.1 * s[:, :1] - 0.05 * s[:, 1:2]  # small TD targets: a sparse-reward value function
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=not half):
            v = m(s.half() if half else s)
        loss = F.smooth_l1_loss(v.float(), target)
        (sc.scale(loss) if sc else loss).backward()
        if i == 0:
            # the share of nonzero gradient elements whose (1 - alpha) * g**2 is 0 in fp16
            gs = torch.cat([p.grad.float().flatten() / (sc.get_scale() if sc else 1.0) for p in m.parameters()])
            gs = gs[gs != 0]
            small = float(((0.01 * gs * gs).half() == 0).float().mean())
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        losses.append(loss.item())
        if first_bad is None and not all(torch.isfinite(p).all() for p in m.parameters()):
            first_bad = i
    w.close()
    return w, losses, first_bad, small


def test_rmsprop_default_eps_on_an_fp16_value_network():
    w, losses, first_bad, small = _rmsprop(half=True)
    # real: 1e-8 is 0 in fp16, (1 - alpha) * g**2 of the small gradients is 0 too, and g / (0 + 0) writes inf/NaN
    # into the weights on the first update; the loss of that step was finite
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    assert small > 0.1, small
    assert first_bad == 0 and math.isfinite(losses[0]), (first_bad, losses)
    found(w.report(), ("eps_underflow",), ("", "0", "2", "4"), steps=(0,))


def test_twin_rmsprop_over_fp32_weights_under_autocast_is_quiet():
    w, losses, first_bad, _ = _rmsprop(half=False, steps=30)
    assert first_bad is None and all(map(math.isfinite, losses)), losses
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    quiet([w.report()])
