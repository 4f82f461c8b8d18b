"""TWO independent real defects in one fp16 run: a loop misuse (GradScaler / optimizer calls) AND a numeric defect
(a layer that overflows fp16, or makes NaN, at step k). The user needs BOTH named: fixing only one leaves a broken
run. Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=...)` at the
default settings -> the user's CPU fp16-autocast loop -> close() -> report()), on tiny models.

Each numeric defect is first proven by the test's own oracle (probe_harness.Producer: the module and step where
the first inf/NaN is made from finite inputs, own parameters finite; the loss first non-finite at that step); a
failing oracle is a plain failure, never an xfail. Each misuse is by construction (the loop's own code; where
torch raises for it, the test checks the exception at the expected iteration). Then: each expected rule
(CONTRACT.md id) among the FIRST THREE findings with severity warning or error; the numeric rule at its module and
step k, the loop rule anywhere (its module is null / the root). A wrong report raises WrongAnswer (strict xfail via
`wrong`).

Loop misuses: `clip_first` clip_grad_norm_ on the still-scaled gradients, then unscale_ (clip_before_unscale /
scaler_misorder); `half` a `.half()` model trained by AdamW (eps 1e-4) without a scaler (fp16_master_weights); `no_update`
scaler.update() never called (missing_scaler_update; the second iteration's unscale_ raises "unscale_() is being
called after step()"); `update_first` unscale_ -> clip -> update() -> step() (scaler_misorder; the second
iteration's unscale_ raises); `bypass` unscale_ -> clip -> optimizer.step() instead of scaler.step() -> update()
(scaler_misorder: the inf check is bypassed, the overflow step's inf gradients are applied).
Numeric defects: `overflow` mid's weights blown up (filled with 1e4) before step k: mid turns finite inputs into
inf (overflow at `mid`, step k); `l2norm` a zero (padding) row reaches x / x.norm(): 0/0 (nan_origin at `norm`);
`rms` a hand-written RMSNorm with eps 1e-8, which is 0 in fp16, on a zero row: rsqrt(0) * 0 (eps_underflow or
nan_origin at `norm`); `softmax` a key-padding mask with one fully padded sequence: softmax over a row of -inf only
(nan_origin at `attn`).

Cases:
 D1. clip_first + overflow at mid, step 5.
 D2. clip_first + softmax over an all -inf row in attn, step 4.
 D3. clip_first + RMSNorm eps 1e-8 on a zero row, step 3.
 D4. half (no master weights) + l2norm of a zero row, step 4.
 D5. half (no master weights) + overflow at mid, step 4.
 D6. no_update + RMSNorm eps 1e-8 on a zero row at step 1 (the iteration whose unscale_ raises).
 D7. update_first + softmax over an all -inf row at step 1 (the iteration whose unscale_ raises).
 D8. bypass + overflow at mid, step 4 (the inf gradients are applied: every later loss NaN).
 D9. no_update + l2norm of a zero row at step 1.
D10. update_first + RMSNorm eps 1e-8 on a zero row at step 1.
Twins (one defect only; the report must name it and have no warning/error of the other rule):
 T1. clip_first alone (D1 without the overflow): clip_before_unscale / scaler_misorder, no overflow.
 T2. l2norm alone in a correct fp32-weight autocast + GradScaler loop (D4 without `.half()`): nan_origin at norm,
     no fp16_master_weights.
(Not built: TF32 flags on CPU - CONTRACT.md's env_tf32 concerns a GPU, and envrules.py makes it `info` where no
compute capability is known, so it is no warning-level defect on CPU; accumulation with scaler.step every
micro-batch - no CONTRACT.md rule names it.)

Result when written: 12 pass, 0 xfail (stable over two runs). ampdoctor's first findings (abridged):
 D1. [error] clip_before_unscale (run) step 0; [error] overflow at mid aten::addmm step 5; [error] skipped_steps.
 D2. [error] clip_before_unscale (run) step 0; [error] nan_origin at attn aten::_softmax step 4; skipped_steps.
 D3. [error] clip_before_unscale (run) step 0; [error] eps_underflow at norm aten::add step 3; [error] overflow at
     norm aten::rsqrt step 3.
 D4. [error] nan_origin at norm aten::div step 4; [warning] fp16_master_weights at (root) step 0.
 D5. [error] overflow at mid aten::addmm step 4; [warning] fp16_master_weights at (root) step 0.
 D6. [error] missing_scaler_update (run) step 0; [error] eps_underflow at norm step 1; [error] overflow at norm
     aten::rsqrt step 1.
 D7. [error] scaler_misorder (run) GradScaler.update step 0; [error] missing_scaler_update step 0; [error]
     nan_origin at attn aten::_softmax step 1.
 D8. [error] scaler_misorder (run) optimizer.step step 0; [error] overflow at mid aten::addmm step 4.
 D9. [error] missing_scaler_update (run) step 0; [error] nan_origin at norm aten::div step 1.
D10. [error] scaler_misorder (run) step 0; [error] missing_scaler_update step 0; [error] eps_underflow at norm step 1
     (third: the one misuse takes two of the three slots, so the eps is named only just).
 T1. only [error] clip_before_unscale; T2. [error] nan_origin at norm step 4, [error] skipped_steps; no
     fp16_master_weights / update_underflow.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer
from scenarios import lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

W_TRUE = randn(8, 1, seed=4242) * 0.5
CLIP_RULES = ("clip_before_unscale", "scaler_misorder")
ALARM = ("warning", "error")


# ======================================================================================================================
# models: one numeric defect each
# ======================================================================================================================
class L2Norm(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class RMSNorm(nn.Module):
    """A hand-written RMSNorm (no weight), eps 1e-8: rounds to 0 in fp16."""

    def __init__(self, eps=1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Attn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, pad):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        s = s.masked_fill(pad[:, None, :], float("-inf"))          # key padding mask
        return torch.softmax(s, dim=-1) @ self.v(x)


class Net(nn.Module):
    """overflow: body -> relu -> mid -> relu -> head; l2norm: norm -> body -> relu -> head; rms: body (no bias) ->
    norm -> relu -> head; softmax: attn -> mean over the sequence -> body -> relu -> head."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.body = nn.Linear(8, 32, bias=kind != "rms")
        self.head = nn.Linear(32, 1)
        if kind == "overflow":
            self.mid = nn.Linear(32, 32)
        elif kind == "l2norm":
            self.norm = L2Norm()
        elif kind == "rms":
            self.norm = RMSNorm()
        elif kind == "softmax":
            self.attn = Attn()

    def forward(self, x, pad=None):
        x = x.to(self.body.weight.dtype)           # a `.half()` model's inputs follow its weights
        if self.kind == "overflow":
            return self.head(torch.relu(self.mid(torch.relu(self.body(x)))))
        if self.kind == "l2norm":
            return self.head(torch.relu(self.body(self.norm(x))))
        if self.kind == "rms":
            return self.head(torch.relu(self.norm(self.body(x))))
        return self.head(torch.relu(self.body(self.attn(x, pad).mean(1))))


def batch(kind, i, bad_step):
    """Step i's (args, y): a learnable regression; at bad_step the l2norm / rms batch has a zero row, the softmax
    batch a fully padded sequence."""
    if kind == "softmax":
        x = randn(8, 6, 8, seed=i % 4)
        pad = torch.zeros(8, 6, dtype=torch.bool)
        pad[:, 4:] = True                                      # every sequence: 4 tokens + 2 padding
        if i == bad_step:
            pad[0] = True                                      # an empty sequence
        return (x, pad), x.mean(1) @ W_TRUE
    x = randn(16, 8, seed=i % 4)
    if i == bad_step and kind in ("l2norm", "rms"):
        x[0] = 0.0
    return (x,), x @ W_TRUE


# ======================================================================================================================
# the user's loop, with one of the misuses
# ======================================================================================================================
def run(kind, loop, bad_step, steps=8, run_dir=None):
    """watch -> for each step: [overflow: mid.weight filled with 1e4 before bad_step] zero_grad -> fp16 autocast
    forward -> mse -> the `loop`'s backward/unscale_/clip/step/update -> close -> report. A RuntimeError /
    AssertionError raised by torch for the misuse stops the loop (kept as (step, message)). Returns a dict: rep,
    first (the oracle's first producer), bad_loss, losses, raised, norms (what the clips returned)."""
    m = Net(kind)
    if loop == "half":
        m = m.half()
    # (a `.half()` model's AdamW needs an eps fp16 can hold: 1e-8 is 0 there and makes NaN weights at step 0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-4 if loop == "half" else 1e-8)
    sc = None if loop == "half" else torch.amp.GradScaler("cpu")
    prod = Producer(m, with_kwargs=True)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(run_dir) if run_dir else None)
    r = dict(bad_loss=[], losses=[], raised=None, norms=[])
    try:
        for i in range(steps):
            prod.step = i
            if kind == "overflow" and i == bad_step:
                with torch.no_grad():
                    m.mid.weight.fill_(1e4)
            opt.zero_grad()
            args, y = batch(kind, i, bad_step)
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(*args)
            loss = F.mse_loss(out.float(), y)
            r["losses"].append(loss.item())
            if not math.isfinite(loss.item()):
                r["bad_loss"].append(i)
            if loop == "half":
                loss.backward()
                r["norms"].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
                opt.step()
                continue
            sc.scale(loss).backward()
            if loop == "clip_first":
                r["norms"].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))   # still scaled
                sc.unscale_(opt)
            else:
                sc.unscale_(opt)
                r["norms"].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
            if loop == "update_first":
                sc.update()
                sc.step(opt)
            elif loop == "bypass":
                opt.step()                                     # not scaler.step: no inf check
                sc.update()
            elif loop == "no_update":
                sc.step(opt)
            else:
                sc.step(opt)
                sc.update()
    except (RuntimeError, AssertionError) as e:
        r["raised"] = (i, str(e))
    finally:
        prod.remove()
        w.close()
    r["rep"], r["first"] = w.report(), prod.first
    return r


def real(r, module, step):
    """The oracle: the first inf/NaN from finite inputs is made by `module` at `step`; the loss is finite before
    and non-finite at `step`."""
    assert r["first"] == (module, step), (r["first"], r["raised"])
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


def named(rep, rules, module=..., step=None):
    """One of `rules` (at `module`, at `step`, where given) among the first three findings, warning or error;
    else WrongAnswer with ampdoctor's top three."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.rule in rules and f.severity in ALARM and (module is ... or f.module == module) \
                and (step is None or f.step == step):
            return f
    raise WrongAnswer(f"wanted {rules} at {'any' if module is ... else module!r} step {step}; top 3: "
                      f"{lines(rep)[:3]}")


def numeric(rep, rules, module, step):
    """The numeric finding: `rules` at `module`; a nan_origin / overflow finding must be at `step` too."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.rule in rules and f.severity in ALARM and f.module == module \
                and (f.rule not in ("nan_origin", "overflow") or f.step == step):
            return f
    raise WrongAnswer(f"wanted {rules} at {module!r} step {step}; top 3: {lines(rep)[:3]}")


def none_of(rep, rules):
    """No warning/error of `rules` anywhere in the report (the twin's absent defect is not invented)."""
    bad = [f.one_line() for f in rep.findings if f.rule in rules and f.severity in ALARM]
    if bad:
        raise WrongAnswer(f"invented {bad}; top 3: {lines(rep)[:3]}")


def raised_at(r, step, text):
    """torch raised for the misuse at `step` (the misuse took effect as built)."""
    assert r["raised"] is not None and r["raised"][0] == step and text in r["raised"][1], r["raised"]


# ======================================================================================================================
# D1-D3: clip_grad_norm_ before unscale_
# ======================================================================================================================
def test_d1_clip_before_unscale_and_overflow_at_mid(tmp_path):
    r = run("overflow", "clip_first", 5, run_dir=tmp_path / "run")
    real(r, "mid", 5)
    assert r["raised"] is None and r["norms"][0] > 100, r["norms"]          # the clip saw the x65536 norm
    named(r["rep"], CLIP_RULES)
    numeric(r["rep"], "overflow", "mid", 5)


def test_d2_clip_before_unscale_and_softmax_over_all_masked_row(tmp_path):
    r = run("softmax", "clip_first", 4, run_dir=tmp_path / "run")
    real(r, "attn", 4)
    assert r["raised"] is None and r["norms"][0] > 100, r["norms"]
    named(r["rep"], CLIP_RULES)
    numeric(r["rep"], "nan_origin", "attn", 4)


def test_d3_clip_before_unscale_and_rmsnorm_eps_vanishing_in_fp16(tmp_path):
    r = run("rms", "clip_first", 3, run_dir=tmp_path / "run")
    real(r, "norm", 3)
    assert r["raised"] is None and r["norms"][0] > 100, r["norms"]
    named(r["rep"], CLIP_RULES)
    numeric(r["rep"], ("eps_underflow", "nan_origin"), "norm", 3)


# ======================================================================================================================
# D4-D5: a `.half()` model, no fp32 master weights
# ======================================================================================================================
def test_d4_half_model_without_master_weights_and_l2norm_of_zero_row(tmp_path):
    r = run("l2norm", "half", 4, run_dir=tmp_path / "run")
    real(r, "norm", 4)
    named(r["rep"], ("fp16_master_weights", "update_underflow"))
    numeric(r["rep"], "nan_origin", "norm", 4)


def test_d5_half_model_without_master_weights_and_overflow_at_mid(tmp_path):
    r = run("overflow", "half", 4, run_dir=tmp_path / "run")
    real(r, "mid", 4)
    named(r["rep"], ("fp16_master_weights", "update_underflow"))
    numeric(r["rep"], "overflow", "mid", 4)


# ======================================================================================================================
# D6-D9: scaler.update() missing / before step / optimizer.step bypassing scaler.step
# ======================================================================================================================
def test_d6_missing_scaler_update_and_rmsnorm_eps_vanishing_in_fp16(tmp_path):
    r = run("rms", "no_update", 1, run_dir=tmp_path / "run")
    real(r, "norm", 1)
    raised_at(r, 1, "unscale_() is being called after step()")
    named(r["rep"], ("missing_scaler_update", "scaler_misorder"))
    numeric(r["rep"], ("eps_underflow", "nan_origin"), "norm", 1)


def test_d7_update_before_step_and_softmax_over_all_masked_row(tmp_path):
    r = run("softmax", "update_first", 1, run_dir=tmp_path / "run")
    real(r, "attn", 1)
    raised_at(r, 1, "unscale_() is being called after step()")
    named(r["rep"], ("scaler_misorder", "missing_scaler_update"))
    numeric(r["rep"], "nan_origin", "attn", 1)


def test_d8_optimizer_step_bypassing_scaler_step_and_overflow_at_mid(tmp_path):
    r = run("overflow", "bypass", 4, run_dir=tmp_path / "run")
    real(r, "mid", 4)
    # harm: the overflow step's non-finite gradients were applied (a scaler.step would have skipped them)
    assert r["raised"] is None and not all(map(math.isfinite, r["losses"][5:])), r["losses"]
    named(r["rep"], "scaler_misorder")
    numeric(r["rep"], "overflow", "mid", 4)


def test_d9_missing_scaler_update_and_l2norm_of_zero_row(tmp_path):
    r = run("l2norm", "no_update", 1, run_dir=tmp_path / "run")
    real(r, "norm", 1)
    raised_at(r, 1, "unscale_() is being called after step()")
    named(r["rep"], ("missing_scaler_update", "scaler_misorder"))
    numeric(r["rep"], "nan_origin", "norm", 1)


def test_d10_update_before_step_and_rmsnorm_eps_vanishing_in_fp16(tmp_path):
    r = run("rms", "update_first", 1, run_dir=tmp_path / "run")
    real(r, "norm", 1)
    raised_at(r, 1, "unscale_() is being called after step()")
    named(r["rep"], ("scaler_misorder", "missing_scaler_update"))
    numeric(r["rep"], ("eps_underflow", "nan_origin"), "norm", 1)


# ======================================================================================================================
# twins: one defect only
# ======================================================================================================================
def test_t1_clip_before_unscale_alone_is_named_and_no_overflow_invented(tmp_path):
    r = run("overflow", "clip_first", bad_step=None, run_dir=tmp_path / "run")
    assert r["first"] is None and not r["bad_loss"] and r["raised"] is None, r
    assert r["norms"][0] > 100, r["norms"]
    named(r["rep"], CLIP_RULES)
    none_of(r["rep"], ("overflow", "nan_origin"))


def test_t2_l2norm_of_zero_row_alone_is_named_and_no_master_weights_invented(tmp_path):
    r = run("l2norm", "ok", 4, run_dir=tmp_path / "run")
    real(r, "norm", 4)
    assert r["raised"] is None
    numeric(r["rep"], "nan_origin", "norm", 4)
    none_of(r["rep"], ("fp16_master_weights", "update_underflow"))
