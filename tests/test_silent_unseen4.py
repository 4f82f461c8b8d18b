"""SILENT fp16 failures, fourth set ("my fp16 fine-tune silently stopped learning"): setups test_silent_stop,
test_silent_unseen, test_silent_unseen2/3 and test_rule_variety_unseen do not build. No inf/NaN anywhere, nothing
skipped, the run goes on, and (part of) the model never moves because of fp16.

Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=sc)` at the default settings)
via probe_harness's HealthyLoop / healthy_run: the same loop runs unwatched and watched, `same_run` checks the two are
bitwise equal (losses, skipped steps, final weights and buffers, the oracle's own measurements). Each failure is first
proven by the test's own oracle on the unwatched run (a failing oracle is a plain failure, never an xfail): gradients
exactly zero after unscale_ at every step while the fixed run's are not and its loss falls; parameters bit-identical
to their start while the fp32 twin's moved in every element. Then the rule (CONTRACT.md id) among the first three
findings with severity warning or error, at the parameter's module (or the root / null where the rule is global), at
a step the case states. A wrong report raises WrongAnswer (strict xfail via `wrong`).

Cases (fix in brackets):
 1. resume from a checkpoint saved after the loss scale had collapsed: `scaler.load_state_dict(ckpt["scaler"])`
    restores scale 65536 * 2**-40 = 6e-8 (growth_interval 2000 left as is), fp32 classifier under fp16 autocast,
    Adam. Every gradient is exactly 0 after unscale_ at every step (loss x scale spread over the logits is far below
    fp16's smallest subnormal), nothing is skipped (all finite), the scale never regrows within the run, the loss is
    the same at every step of a repeated batch. [do not restore the scaler's state after a collapse: a fresh
    GradScaler] Accept: underflow (backward) at `head`/`body`, or loss_scale_collapse (module null/root); step <= 2:
    the defect is there from step 0 and every step shows it.
 2. "LayerNorm tuning" (train only the norms' gains and biases, a PEFT recipe for VLM/LLM adaptation) of a `.half()`
    model, plain SGD(lr 1e-3): lr * grad (~5e-5) is below half an fp16 ulp of the gains at 1.0 (4.9e-4): every gain
    stays exactly 1.0 while the biases (at 0) move and the fp32 twin's gains move in every element. [fp32 weights
    under fp16 autocast + GradScaler] Accept: update_underflow / fp16_master_weights at the root or `norm1`/`norm2`
    (the norms' module; fp16_master_weights is global: the root), step <= 10 (there from step 0; the default
    sampling may see it at its first full steps).
Healthy twins (no warning, no error): 1 with a fresh GradScaler; 2 with fp32 weights under fp16 autocast + GradScaler.

Not kept (their oracle failed, so they are no failures):
 - DDP (gloo, world 1) with `fp16_compress_hook` on an fp32 regressor of minute returns (~1e-4), Adam: 84% of the
   body's gradient elements were flushed to 0 by the fp16 all-reduce, but the loss after 60 steps was within 1% of
   the run without the hook (Adam learned from the survivors; the head's gradients stayed representable).
   `bf16_compress_hook` (the fix) needs CUDA/NCCL, so no twin on the CPU either.
 - a frozen `.half()` LM with fp32 LoRA adapters (PEFT's autocast_adapter_dtype), token-mean CE / 16 accumulation
   steps, no GradScaler: 99% of `head`'s output gradient was subnormal, but the run learned as much as the run with a
   GradScaler (4.6598 vs 4.6598 after 30 steps: the residual stream kept the adapters' gradients representable);
   without residuals and a GPT-2 (std 0.02) init neither run learned in 20 steps.
 - case 2 with AdamW(lr 1e-4): eps 1e-8 is 0 in fp16 and the loss was NaN from step 1 (eps_underflow, not silent);
   with the "fp16 eps" 1e-4, exp_avg_sq of the small gradients flushed to 0 in fp16, so the update was lr * m / eps
   (~g) and the gains moved by up to 4%: no stall.

Result when written (torch 2.13 CPU, default watch): 4 pass, 0 xfail (stable over two runs, ~12 s).
 1. PASS  `[error] underflow at head step 0`: "Every gradient flowing into `head` (Linear) is exactly zero in fp16
    although the loss is 1.49: the loss x the scale (5.96046e-08) ... below fp16's smallest subnormal" (only finding).
 2. PASS  `[error] fp16_master_weights at (root) step 0`, then `[error] update_underflow at norm1 step 0` (50% of
    sampled elements of `norm1.weight` unchanged).
 Twins: both reports empty.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import HealthyLoop, WrongAnswer, healthy_run, quiet_healthy, same_run
from scenarios import lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def gen(i):
    return torch.Generator().manual_seed(4000 + i)


def expect(rep, rules, modules, severity=("warning", "error"), phase=None, steps=None):
    """One of `rules` at one of `modules` (None in `modules`: a null module) among the first three findings with
    `severity`, `phase` (a finding's null phase accepted) and step in `steps` (None: any), else WrongAnswer."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.rule in rules and f.module in modules and f.severity in severity \
                and (phase is None or f.phase in phase or f.phase is None) \
                and (steps is None or f.step is None or f.step in steps):
            return f
    raise WrongAnswer(f"wanted {rules} at {modules} {severity} steps {steps}; got: {lines(rep)[:3]}")


def both(build, steps, tmp_path):
    """The unwatched and the watched run of the same loop; bitwise equal (same_run). Returns (unwatched, watched)."""
    ru = healthy_run(build(), steps)
    rw = healthy_run(build(), steps, watch_kw={}, run_dir=str(tmp_path / "run"))
    same_run(rw, ru)
    return ru, rw


# ======================================================================================================================
# 1./twin 1. resumed with the scaler state of a collapsed run: scale 6e-8 from step 0
# ======================================================================================================================
W_CLS = torch.randn(16, 4, generator=gen(1))


class Cls(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _cls_batch(i):
    x = torch.randn(64, 16, generator=gen(100 + i % 8))
    return x, (x @ W_CLS).argmax(1)


def _resume(restore):
    def build():
        torch.manual_seed(0)
        m = Cls()
        opt = torch.optim.Adam(m.parameters(), lr=3e-3)
        sc = torch.amp.GradScaler("cpu")
        if restore:     # the checkpoint was written after 40 backoffs in a row (a corrupt shard, a bad lr spike)
            sd = sc.state_dict()
            sd["scale"], sd["_growth_tracker"] = 65536.0 * 2.0 ** -40, 0
            sc.load_state_dict(sd)
        zero, scales = [], []

        def step(i):
            x, y = _cls_batch(i)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x).float(), y)
            scales.append(sc.get_scale())
            sc.scale(loss).backward()
            sc.unscale_(opt)
            zero.append(all(bool((p.grad == 0).all()) for p in m.parameters()))
            sc.step(opt)
            sc.update()
            return loss.item()
        return HealthyLoop(m, opt, sc, step, extra=[zero, scales])
    return build


def test_resumed_scaler_state_of_a_collapsed_run_flushes_every_gradient(tmp_path):
    ru, rw = both(_resume(True), 32, tmp_path)
    fx = healthy_run(_resume(False)(), 32)
    zero, scales = ru.loop.extra
    # truth: scale 6e-8 on every step, nothing skipped, every gradient exactly 0 after unscale_, the loss on each of
    # the 8 repeated batches identical at every pass; the fresh-scaler run's gradients are nonzero and its loss falls
    assert set(scales) == {65536.0 * 2.0 ** -40} and ru.skipped == [], (set(scales), ru.skipped)
    assert all(zero), zero
    assert all(ru.losses[i] == ru.losses[i % 8] for i in range(32)), ru.losses
    assert not any(fx.loop.extra[0]) and fx.skipped == []
    assert sum(fx.losses[-8:]) < 0.7 * sum(fx.losses[:8]), fx.losses
    expect(rw.rep, ("underflow", "loss_scale_collapse"), (None, "", "head", "body"), steps=range(0, 3))


def test_healthy_twin_fresh_scaler_after_resume_is_quiet(tmp_path):
    ru, rw = both(_resume(False), 32, tmp_path)
    assert sum(ru.losses[-8:]) < 0.7 * sum(ru.losses[:8])
    quiet_healthy(rw)


# ======================================================================================================================
# 2./twin 2. LayerNorm tuning of a `.half()` model, AdamW(lr 1e-4): the gains never leave 1.0
# ======================================================================================================================
class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm1 = nn.LayerNorm(32)
        self.mid = nn.Linear(32, 32)
        self.norm2 = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.norm1(self.inp(x.to(self.inp.weight.dtype))))
        return self.out(torch.tanh(self.norm2(self.mid(h))))


W_TOW = torch.randn(16, 4, generator=gen(2))


def _tow_batch(i):
    x = torch.randn(64, 16, generator=gen(200 + i % 8))
    return x, (x @ W_TOW).argmax(1)


def _ln_tuning(dtype, autocast):
    def build():
        torch.manual_seed(0)
        m = Tower().to(dtype)
        m.requires_grad_(False)
        for n in ("norm1", "norm2"):
            getattr(m, n).requires_grad_(True)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        sc = torch.amp.GradScaler("cpu", enabled=autocast)

        def step(i):
            x, y = _tow_batch(i)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            sc.step(opt)
            sc.update()
            return loss.item()
        return HealthyLoop(m, opt, sc, step)
    return build


def _moved(r, name):
    start = _ln_tuning(torch.float32, False)().model.state_dict()[name]
    return float((r.weights[name].float() != start).float().mean())


def test_half_layernorm_tuning_with_adamw_1e_4_never_moves_the_gains(tmp_path):
    ru, rw = both(_ln_tuning(torch.float16, False), 30, tmp_path)
    r32 = healthy_run(_ln_tuning(torch.float32, False)(), 30)
    # truth: every gain of norm1/norm2 is still exactly 1.0 (AdamW's ~1e-4 step < half an ulp of 1.0); the biases (at
    # 0) did move; the fp32 twin's gains moved in every element
    for n in ("norm1", "norm2"):
        assert bool((ru.weights[f"{n}.weight"] == 1.0).all()), ru.weights[f"{n}.weight"]
        assert _moved(ru, f"{n}.bias") > 0.9 and _moved(r32, f"{n}.weight") > 0.99
    expect(rw.rep, ("update_underflow", "fp16_master_weights"), ("", "norm1", "norm2"), steps=range(0, 11))


def test_healthy_twin_fp32_layernorm_tuning_under_autocast_and_scaler_is_quiet(tmp_path):
    ru, rw = both(_ln_tuning(torch.float32, True), 30, tmp_path)
    assert _moved(ru, "norm1.weight") > 0.99 and _moved(ru, "norm2.weight") > 0.99
    quiet_healthy(rw)
