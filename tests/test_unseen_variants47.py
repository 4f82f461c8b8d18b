"""Forty-seventh set: OPTIMIZER-SIDE fp16 FAILURES ACROSS LESS COMMON OPTIMIZERS AND SETTINGS, and their healthy
twins. RAdam, Adamax, NAdam, Adagrad, RMSprop, torch.optim.Adafactor, fused SGD (nesterov) and fused AdamW (amsgrad,
weight decay, per-group lrs), over fp16 parameters (`.half()`, no scaler: GradScaler refuses fp16 gradients) or over
fp32 parameters under CPU `torch.autocast("cpu", dtype=torch.float16)` + `torch.amp.GradScaler("cpu")` (default
init_scale 65536). Watched through the public API only: `ampdoctor.watch(model, optimizer=opt, scaler=sc (or None),
run_dir=tmp_path / "run")` at the default settings (full statistics on step 0 and every 200th), close(), report();
ampdoctor's RuntimeWarnings recorded. Tiny models, fixed seeds, one intra-op thread; the file runs in a few seconds.

Each failure is proven first by the test's own oracle (a failing oracle is a plain failure): probe_harness.Producer
(keyword inputs; own parameters allowed non-finite, `bad_weights` naming it: where the first non-finite forward output
came from weights the optimizer had broken), the steps with a non-finite loss, the scaler's skips, per-step readings
of the gradients, the weights and the optimizer state (`record`), and the same run in float32 (or with the AMP recipe
done right) staying finite / training. Only then must the rule be among the report's first three findings, at the
module, at the step, with severity `error` (CONTRACT: training is broken or silently wrong); a wrong report raises
WrongAnswer naming ampdoctor's top three (rule@module step [severity]).

 1. RAdam(lr=1e-3, eps=1e-8) over a `.half()` bag-of-embeddings classifier (Embedding padding_idx=0, masked mean
    pooling, Linear head), no scaler. RAdam's first five updates are unrectified (momentum only, no division); its
    variance rectification starts at rho_t > 5, the 6th update (step 5). The padding row's gradient is 0 on every
    step, its exp_avg_sq 0, fp16(1e-8) = 0: step 5's update is 0 * inf = NaN in the row (every weight finite before),
    the pooling's NaN * 0 makes step 6's loss NaN (first non-finite output: emb, from its own weights); the fp32 model
    stays finite -> eps_underflow at `emb`, step 5, error, in the top three.
 2. gradual unfreezing: Adamax(lr=2e-3) over a frozen `.half()` embedding (no gradient, skipped) and an fp32 head; the
    table unfrozen at step 7: the padding row's exp_inf = max(0, |0| + fp16(1e-8)) = 0, 0 / 0 = NaN (every weight
    finite before; step 8's loss NaN); the same unfreezing of an fp32 table stays finite -> eps_underflow at `emb`,
    step 7, error.
 3. fused SGD (momentum 0.9, nesterov, fused=True) through GradScaler, clip_grad_norm_(1.0) WITHOUT unscale_ ("the
    fused kernel unscales"): at step 0 the clip reads the scaled norm (65536 x the right loop's, same weights and
    batch), clips it to 1 and the kernel divides by the scale: the loss does not move (last three > 0.95 x first
    three) while the right loop (unscale_ first; its clip really clips: norm > 1) halves it -> clip_before_unscale,
    module null, step 0, error.
 4. Adagrad(lr=0.05) stepped directly on the scaled gradients (scaler.scale(loss).backward(); opt.step(); no
    scaler.step, no update): Adagrad's g / sqrt(sum g^2) hides the x65536 through step 1; at step 2 an ordinary
    batch's scaled gradients overflow fp16 (loss finite), nothing skips the step, state_sum goes inf and the weights
    NaN (every later loss NaN); the AMP recipe (scaler.step + update, no clip: the same updates up to eps) skips step 2
    (its opening search) and stays finite -> scaler_misorder, module null, step 0 (the first misordered call), error.
 5. NAdam(lr=1e-2): unscale_ -> clip -> optimizer.step() (not scaler.step) -> update(): at step 7 a label glitch of
    300 makes the scaled gradient overflow; unscale_ finds it and update() backs off, but the step is applied: the
    clip's coefficient 1/inf = 0 turns the inf into NaN, the weights are NaN, every later loss NaN; the AMP recipe
    skips step 7 and stays finite -> scaler_misorder, module null, step 0, error.
 6. a `.half()` Linear -> RMSNorm -> GELU -> Linear regressor on RMSprop(lr=3e-4, eps=1e-4: the fp16-safe eps) with
    StepLR(step_size=6, gamma=0.1): before the decay < 30% of the gains' updates round away, from step 6 on all of
    them (below half an ulp of ~1.0) while the Linear weights keep moving (< 50%); every loss finite; in float32 the
    gains move on every step -> update_underflow at `norm`, step 6, error.
 7. torch.optim.Adafactor(lr=1e-4, "the Adam lr") on the same `.half()` regressor: Adafactor's step is relative to
    RMS(w), so each update is ~1e-4 of the weights' scale: from step 0 every gain update and > 75% of the other
    modules' round away on every step; in float32 > 95% move -> update_underflow at one of the modules whose every
    parameter rounds > 75% away (inp / norm / out), step 0, error.
Healthy twins (every loss finite and falling, no producer, no skip after the scaler's opening search (steps 0-4) but
the ones named, no RuntimeWarning, no warning or error, exit 0; and the watch changes nothing: the same loop without a
watch gives bitwise the same losses and final weights):
 8. twin of 3: the fused SGD with unscale_ before the clip (20 steps, the loss halves).
 9. twin of 5: NAdam through scaler.step (16 steps): the glitch at step 7 is skipped, the scaler's job.
10. twin of 1/2: RAdam(lr=0.2) over the fp32 bag classifier under autocast + GradScaler, unscale_ + clip (30 steps).
11. fused AdamW (amsgrad=True, per-group lrs 3e-3 / 1e-2 and weight decay 0.05 / 0) through GradScaler's fused path:
    no unscale_, no clip: scaler.step hands the kernel grad_scale / found_inf (24 steps).

What ampdoctor says (torch 2.13 CPU): 11 of 11 right (1 was wrong when written, fixed since).
- right: 2 `[error] fp16_master_weights at emb step 0`, `[error] eps_underflow at emb optimizer.step step 7`,
  `[error] nan_origin at emb step 7`; 3 `[error] clip_before_unscale at (run) clip_grad_norm_ step 0`; 4 `[error]
  scaler_misorder at (run) optimizer.step step 0` ("called directly on gradients still multiplied by the loss scale"),
  then `[info] overflow at head aten::mm step 2` (see below); 5 `[error] scaler_misorder at (run) step 0` ("called
  directly after scaler.unscale_()"), `[error] nan_origin at body.0 step 7`; 6 `[error] fp16_master_weights at (root)
  step 0`, `[error] update_underflow at norm step 6`; 7 `[error] fp16_master_weights at (root) step 0`, `[error]
  update_underflow at inp step 0` ("So do 2 more layer(s) ... (norm, out)"). Twins: 8 and 9 only `[info]
  skipped_steps` ("a normal rate"), 10 and 11 no finding.
- 1, wrong when written (a strict xfail then): top three `[error] fp16_master_weights@(root) step 0` (its message does say "Its eps
  rounds to 0 in fp16 too, which is how the updates went non-finite (eps_underflow)"), `[error] update_underflow@emb
  step 0`, `[error] update_underflow@head step 0`; `[error] eps_underflow at (root) step 5` only 4th and at the root,
  `[error] nan_origin at emb step 5` 5th. Expected: eps_underflow at `emb` (where the 0/0 wrote NaN), step 5, in the
  top three. The step-0 update_underflow findings are true (RAdam's unrectified updates are lr x momentum, ~1e-6 on
  N(0, 1) weights: they round away), but they outrank the failure that ended training (NaN weights at step 5).
  rules/weights.py optimizer_eps names `_common_module(low)` of the group's fp16 parameters (here every parameter:
  the root), not the module whose update it broke (`_broken_at` finds the step: it knows which parameters went
  non-finite), and ranks below update_underflow; in 2 the only fp16 parameter is emb's, so the common module is right.
  Fixed since: eps_underflow names the module whose weights the first bad step found non-finite (rules/weights.py
  `_went_bad`), and when the eps broke the run the group's fp16_master_weights / update_underflow findings rank
  after it: top three now `eps_underflow at emb step 5`, `fp16_master_weights at (root) step 0`, `update_underflow
  at emb step 0`.
In 4 the backward overflow at head step 2 was `[info]` "the scaler skips this step and lowers the scale as designed"
when written, but this loop never calls scaler.step/update: the step was applied (the weights went NaN there). Fixed
since (analysis/replayfold._applied: a step the optimizer applied itself with non-finite gradients is no scaler
search): `[error] overflow at head step 2`, asserted.

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants47.py -q -p no:cacheprovider (a few seconds)
"""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer, at_top3
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def run(build, make_opt, step_fn, steps, run_dir, *, scaler=True, watch=True, record=None):
    """The user's loop under `ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=...)` at the default settings (no
    `every`: full statistics on step 0 and every 200th). `build()` gives the model (seed 0), `make_opt(m)` its
    optimizer (and, where the recipe has one, a scheduler: `(opt, sched)`), `scaler`: a GradScaler("cpu") at its
    defaults (init_scale 65536) or none; `step_fn(i, m, opt, sc)` runs iteration i as the case's loop writes it and
    returns its loss (the scheduler, if any, steps after it). `watch=False`: the same loop, no watch, no oracle.

    The oracle: probe_harness.Producer (keyword inputs checked: the first module whose output is non-finite while its
    inputs were finite; `bad_weights` names it where its own parameters were already non-finite), the iterations with a non-finite loss, the iterations whose update()
    backed the scale off, and `record(i, m, opt, before, seen)` after each iteration (`before`: the parameters the
    iteration's forward ran with; the gradients are still on the parameters)."""
    torch.manual_seed(0)
    m = build()
    opt = make_opt(m)
    opt, sched = opt if isinstance(opt, tuple) else (opt, None)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    orc = Producer(m, with_kwargs=True, own_params=False) if watch else None
    r = dict(losses=[], bad_loss=[], skipped=[], seen={}, rep=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) if watch else None
        for i in range(steps):
            if orc is not None:
                orc.step = i
            before = {n: p.detach().clone() for n, p in m.named_parameters()}
            s0 = sc.get_scale() if sc is not None else None
            loss = float(step_fn(i, m, opt, sc))
            if sched is not None:
                sched.step()
            r["losses"].append(loss)
            if not math.isfinite(loss):
                r["bad_loss"].append(i)
            if sc is not None and sc.get_scale() < s0:
                r["skipped"].append(i)
            if record is not None:
                record(i, m, opt, before, r["seen"])
        if orc is not None:
            orc.remove()
        if w is not None:
            w.close()
            r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["first"] = orc.first if orc is not None else None
    r["bad_weights"] = orc.bad_weights if orc is not None else None
    r["m"], r["opt"] = m, opt
    r["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    if DEBUG and r["rep"] is not None:
        print("\n" + "\n".join(lines(r["rep"])[:8]), r["warns"], r["skipped"], r["bad_loss"])
    return r


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} step {f.step} [{f.severity}]"
            for f in rep.findings[:3]]


def named(r, rules, module, step, severity=("error",), phase=None):
    """The report check: one of `rules` at `module` among the first three findings, at `step`, with `severity`
    (CONTRACT: `error` = training is broken or silently wrong) and (where given) `phase`. A failure is a WrongAnswer
    naming ampdoctor's top three (rule@module step [severity])."""
    rep = r["rep"]
    err = None
    for mod in module if isinstance(module, (tuple, list)) else (module,):     # (one of several accepted modules)
        try:
            return at_top3(rep, rules, mod, step=step, phase=phase, severity=severity)
        except AssertionError as e:
            err = e
    raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(err)[:700]})") from None


def twin_quiet(build, make_opt, step_fn, steps, run_dir, *, skips=(), fall=0.7):
    """A healthy twin: every loss finite and the last three below `fall` x the first three, no producer, no skip but
    `skips` (the scaler's job) after the scaler's opening search (iterations 0-4), no RuntimeWarning of ampdoctor's, no
    warning or error in the report (exit 0); and the watch changes nothing: the same loop without a watch gives
    bitwise the same losses and final weights."""
    r = run(build, make_opt, step_fn, steps, run_dir)
    bare = run(build, make_opt, step_fn, steps, None, watch=False)
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, (ls, r["first"])
    assert sum(ls[-3:]) < fall * sum(ls[:3]), ls
    assert [s for s in r["skipped"] if s >= 5] == list(skips), r["skipped"]
    assert ls == bare["losses"], "the watch changed the losses"
    assert r["weights"].keys() == bare["weights"].keys()
    assert all(torch.equal(v, bare["weights"][k]) for k, v in r["weights"].items()), "the watch changed the weights"
    rep = r["rep"]
    if r["warns"] or alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(rep)} warnings={r['warns']} {lines(rep)}")
    return r


def all_finite(params):
    return all(bool(torch.isfinite(v).all()) for v in params.values())


# ======================================================================================================================
# the models and data
# ======================================================================================================================
V, D, C, L = 120, 32, 4, 12
W_TOK = torch.randn(V, C, generator=gen(47))


class Bag(nn.Module):
    """A bag-of-embeddings classifier: token embeddings (padding_idx 0), masked mean pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        e = self.emb(x)
        mask = (x != 0).unsqueeze(-1).to(e.dtype)
        h = (e * mask).sum(1) / mask.sum(1)
        return self.head(h.to(self.head.weight.dtype))


def bag_batch(i, B=64):
    """64 token sequences of 3-12 tokens (ids 1..119) padded with 0 to 12; the class from a fixed token score."""
    g = gen(4700 + i)
    x = torch.randint(1, V, (B, L), generator=g)
    n = torch.randint(3, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None] < n[:, None]
    x = x.masked_fill(~mask, 0)
    y = (W_TOK[x] * mask[..., None]).sum(1).argmax(1)
    return x, y


def pure_step(batch):
    """A pure low-precision loop (no autocast, no scaler): zero_grad -> forward -> fp32 loss -> backward -> step."""
    def step(i, m, opt, sc):
        x, y = batch(i)
        opt.zero_grad()
        loss = F.cross_entropy(m(x).float(), y)
        loss.backward()
        opt.step()
        return loss
    return step


def amp_step(batch, loss_fn, clip=True):
    """The AMP recipe: zero_grad -> fp16 autocast forward -> fp32 loss -> scale(loss).backward -> unscale_ ->
    clip_grad_norm_(1.0) -> scaler.step -> update (`clip=False`: scale(loss).backward -> scaler.step -> update)."""
    def step(i, m, opt, sc):
        x, y = batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            out = m(x)
        loss = loss_fn(out, y)
        sc.scale(loss).backward()
        if clip:
            sc.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return loss
    return step


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def mse(out, y):
    return F.mse_loss(out.float(), y)


class MLP(nn.Module):
    def __init__(self, d_in=16, d=64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.body(x))


W_REG = torch.randn(16, 1, generator=gen(4747)) * 0.5
GLITCH_AT, GLITCH = 7, 300.0


def reg_batch(i, glitch=True):
    """64 standardised rows, y = x @ W; at GLITCH_AT (glitch) one target is a label glitch of 300: finite and
    harmless unscaled (dL/dout = 2 * 300 / 64), past fp16's max once multiplied by the loss scale 65536."""
    x = torch.randn(64, 16, generator=gen(4800 + i))
    y = x @ W_REG
    if glitch and i == GLITCH_AT:
        y[5] = GLITCH
    return x, y


# ======================================================================================================================
# 1. RAdam over a `.half()` model: eps=1e-8 is 0 in fp16; harmless for RAdam's first five (unrectified) updates, the
#    first rectified update (rho_t > 5: step 5) divides the padding row's 0 by 0
# ======================================================================================================================
RECT_AT = 5


def rho(t, b2=0.999):
    ri = 2 / (1 - b2) - 1
    return ri - 2 * t * b2 ** t / (1 - b2 ** t)


def watch_rows(i, m, opt, before, seen):
    g = m.emb.weight.grad
    seen.setdefault("pad_grad_zero", []).append(bool(g is None or (g[0] == 0).all()))
    seen.setdefault("pad_finite", []).append(bool(torch.isfinite(m.emb.weight[0]).all()))
    seen.setdefault("all_finite", []).append(all(bool(torch.isfinite(p).all()) for p in m.parameters()))
    st = opt.state.get(m.emb.weight, {})
    if "exp_avg_sq" in st:
        seen.setdefault("pad_v", []).append(float(st["exp_avg_sq"][0].abs().max()))
    if "exp_inf" in st:
        seen.setdefault("pad_v", []).append(float(st["exp_inf"][0].abs().max()))


def build_half_bag():
    return Bag().half()


def test_radam_half_model_first_rectified_update_divides_by_the_vanished_eps(tmp_path):
    r = run(build_half_bag, lambda m: torch.optim.RAdam(m.parameters(), lr=1e-3), pure_step(bag_batch), RECT_AT + 4,
            tmp_path / "run", scaler=False, record=watch_rows)
    s = r["seen"]
    # truth: RAdam's variance rectification starts at its 6th update (rho_t > 5 first at t = 6: step 5); before it
    # RAdam steps with the momentum alone (no division), so the weights stay finite through step 4. The padding row's
    # gradient is 0 on every step, its exp_avg_sq 0, and eps = 1e-8 is 0 in fp16: step 5's update is
    # 0 * lr * sqrt(bc2) / (0 + 0) = NaN in the padding row; the masked pooling's NaN * 0 makes step 6's loss NaN.
    # The first non-finite forward output is emb's at step 6, from its own NaN weights (no module makes a NaN from
    # finite inputs and finite weights).
    assert [t for t in range(1, 10) if rho(t) > 5][0] == RECT_AT + 1
    assert torch.tensor(1e-8, dtype=FP16).item() == 0.0
    assert all(s["pad_grad_zero"]) and all(v == 0 for v in s["pad_v"]), s
    assert s["all_finite"][:RECT_AT] == [True] * RECT_AT and s["pad_finite"][RECT_AT] is False, s
    assert r["bad_loss"] and r["bad_loss"][0] == RECT_AT + 1, r["losses"]
    assert r["first"] == ("emb", RECT_AT + 1) and r["bad_weights"] == "emb", (r["first"], r["bad_weights"])
    # the same RAdam over the fp32 model stays finite
    f32 = run(Bag, lambda m: torch.optim.RAdam(m.parameters(), lr=1e-3), pure_step(bag_batch), RECT_AT + 4, None,
              scaler=False, watch=False)
    assert all(map(math.isfinite, f32["losses"])) and all_finite(f32["weights"]), f32["losses"]
    named(r, "eps_underflow", "emb", RECT_AT)


# ======================================================================================================================
# 2. gradual unfreezing: Adamax over a frozen `.half()` embedding (and an fp32 head); the embedding unfrozen at step 7
#    gets its first update: exp_inf of the padding row is |0| + fp16(1e-8) = 0, 0 / 0 = NaN
# ======================================================================================================================
UNFREEZE_AT = 7


def build_frozen_half_emb():
    m = Bag()
    m.emb.half().requires_grad_(False)      # the pretrained table, halved to save memory, frozen for the warm-up
    return m


def unfreeze_step(i, m, opt, sc):
    if i == UNFREEZE_AT:
        m.emb.weight.requires_grad_(True)
    return pure_step(bag_batch)(i, m, opt, sc)


def test_adamax_unfreezing_a_half_embedding_divides_the_padding_row_by_a_vanished_eps(tmp_path):
    r = run(build_frozen_half_emb, lambda m: torch.optim.Adamax(m.parameters(), lr=2e-3), unfreeze_step,
            UNFREEZE_AT + 3, tmp_path / "run", scaler=False, record=watch_rows)
    s = r["seen"]
    # truth: the frozen table has no gradient for steps 0-6 (Adamax skips it; the head trains, every loss finite);
    # unfrozen at step 7 its padding row's gradient is 0 and Adamax's exp_inf = max(0, |0| + eps) with eps = 1e-8 = 0
    # in fp16: step 7's update is 0 / 0 = NaN in the padding row (every weight finite before it); step 8's masked
    # pooling gives NaN * 0: its loss is NaN, first at emb's output from emb's own NaN weights.
    assert torch.tensor(1e-8, dtype=FP16).item() == 0.0
    assert all(s["pad_grad_zero"]) and s["pad_v"] == [0.0] * len(s["pad_v"]) and len(s["pad_v"]) >= 1, s
    assert s["all_finite"][:UNFREEZE_AT] == [True] * UNFREEZE_AT and s["pad_finite"][UNFREEZE_AT] is False, s
    assert r["bad_loss"] and r["bad_loss"][0] == UNFREEZE_AT + 1, r["losses"]
    assert r["first"] == ("emb", UNFREEZE_AT + 1) and r["bad_weights"] == "emb", (r["first"], r["bad_weights"])
    # the same unfreezing of an fp32 table stays finite
    def f32():
        m = Bag()
        m.emb.requires_grad_(False)
        return m
    ok = run(f32, lambda m: torch.optim.Adamax(m.parameters(), lr=2e-3), unfreeze_step, UNFREEZE_AT + 3, None,
             scaler=False, watch=False)
    assert all(map(math.isfinite, ok["losses"])) and all_finite(ok["weights"]), ok["losses"]
    named(r, "eps_underflow", "emb", UNFREEZE_AT)


# ======================================================================================================================
# 3./twin. fused SGD (nesterov) through GradScaler: clip_grad_norm_ without unscale_ ("the fused kernel unscales")
# ======================================================================================================================
def fused_sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, fused=True)


def fused_step(unscale, norms):
    def step(i, m, opt, sc):
        x, y = reg_batch(i, glitch=False)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            out = m(x)
        loss = mse(out, y)
        sc.scale(loss).backward()
        if unscale:
            sc.unscale_(opt)
        norms.append(float(nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        sc.step(opt)
        sc.update()
        return loss
    return step


FUSED_STEPS = 20


def test_fused_sgd_clipped_before_unscale_shrinks_every_update_by_the_loss_scale(tmp_path):
    bad_norms, ok_norms = [], []
    r = run(MLP, fused_sgd, fused_step(False, bad_norms), FUSED_STEPS, tmp_path / "run")
    ok = run(MLP, fused_sgd, fused_step(True, ok_norms), FUSED_STEPS, None, watch=False)
    # truth: the same model, batch and weights at step 0: the clip read the norm of the SCALED gradients (x 65536, the
    # scale the step ran at), clipped them to 1 and the fused kernel then divided by 65536: the update is 65536x too
    # small on every step. The loss does not move, while the right loop (unscale_ first) halves it; no non-finite
    # loss or forward output anywhere (the scaler's skips are its ordinary search).
    assert not r["bad_loss"] and r["first"] is None, r
    assert abs(bad_norms[0] / 65536.0 - ok_norms[0]) < 1e-2 * ok_norms[0], (bad_norms[0], ok_norms[0])
    assert ok_norms[0] > 1.0, ok_norms[0]                  # the right loop's clip really clips: max_norm 1 matters
    assert sum(ok["losses"][-3:]) < 0.5 * sum(ok["losses"][:3]), ok["losses"]
    assert sum(r["losses"][-3:]) > 0.95 * sum(r["losses"][:3]), r["losses"]
    named(r, "clip_before_unscale", None, 0)


def test_twin_fused_sgd_unscaled_before_the_clip_is_quiet(tmp_path):
    twin_quiet(MLP, fused_sgd, fused_step(True, []), FUSED_STEPS, tmp_path / "run", fall=0.5)


# ======================================================================================================================
# 4. Adagrad stepped directly on the scaled gradients (scaler.scale(loss).backward(); opt.step(): no scaler.step, no
#    update): Adagrad's g / sqrt(sum g^2) hides the x65536 -- until a scaled gradient overflows and nothing skips it
# ======================================================================================================================
SEARCH_AT = 2       # the first iteration whose gradients overflow at 65536: the AMP recipe's search skips it


def grads_state(i, m, opt, before, seen):
    seen.setdefault("grads_finite", []).append(all(bool(torch.isfinite(p.grad).all()) for p in m.parameters()
                                                   if p.grad is not None))
    seen.setdefault("weights_finite", []).append(all(bool(torch.isfinite(p).all()) for p in m.parameters()))


def clean_reg(i):
    return reg_batch(i, glitch=False)


def adagrad_direct_step(i, m, opt, sc):
    x, y = clean_reg(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        out = m(x)
    loss = mse(out, y)
    sc.scale(loss).backward()
    opt.step()
    return loss


def test_adagrad_stepped_on_scaled_gradients_applies_the_overflowed_step(tmp_path):
    adagrad = lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05)     # noqa: E731
    steps = SEARCH_AT + 4
    r = run(MLP, adagrad, adagrad_direct_step, steps, tmp_path / "run", record=grads_state)
    s = r["seen"]
    # truth: every gradient and weight finite through step 1 (Adagrad's normalisation hides the x65536); at step 2
    # an ordinary batch's gradients, multiplied by the scale 65536 that no update() ever lowers, overflow fp16 (the
    # loss itself finite); nothing skips the step: Adagrad's state_sum becomes inf, inf / inf writes NaN into the
    # weights and every later loss is NaN. The AMP recipe (scaler.step + update; no clip, so its updates are the
    # same up to Adagrad's eps) skips step 2 (its opening search: the scale halves) and stays finite.
    assert s["grads_finite"][:SEARCH_AT] == [True] * SEARCH_AT and s["grads_finite"][SEARCH_AT] is False, s
    assert s["weights_finite"][:SEARCH_AT] == [True] * SEARCH_AT and s["weights_finite"][SEARCH_AT] is False, s
    assert math.isfinite(r["losses"][SEARCH_AT]) and r["bad_loss"] == list(range(SEARCH_AT + 1, steps)), r
    ok = run(MLP, adagrad, amp_step(clean_reg, mse, clip=False), steps, None, watch=False)
    assert ok["skipped"][0] == SEARCH_AT and all(map(math.isfinite, ok["losses"])) and all_finite(ok["weights"]), ok
    named(r, "scaler_misorder", None, 0)
    # the overflowed gradients were applied (no scaler.step skipped the step): no "GradScaler's normal search" for it
    assert not any("as designed" in f.message for f in r["rep"].findings), [f.one_line() for f in r["rep"].findings]
    assert any((f.rule, f.module, f.step, f.severity) == ("overflow", "head", SEARCH_AT, "error")
               for f in r["rep"].findings), [f.one_line() for f in r["rep"].findings]


# ======================================================================================================================
# 5./twin. NAdam: unscale_ -> clip -> optimizer.step() (not scaler.step) -> update(): the inf check is made, the scale
#    backs off, but nothing skips the step
# ======================================================================================================================
def nadam(m):
    return torch.optim.NAdam(m.parameters(), lr=1e-2)


def nadam_bypass_step(i, m, opt, sc):
    x, y = reg_batch(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        out = m(x)
    loss = mse(out, y)
    sc.scale(loss).backward()
    sc.unscale_(opt)
    nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()                          # "the gradients are already unscaled"
    sc.update()
    return loss


def test_nadam_stepped_after_unscale_bypasses_the_skip(tmp_path):
    r = run(MLP, nadam, nadam_bypass_step, GLITCH_AT + 4, tmp_path / "run", record=grads_state)
    s = r["seen"]
    # truth: at step 7 the glitch's scaled gradient overflows; unscale_ finds it and update() backs the scale off, but
    # optimizer.step() was called directly: clip_grad_norm_'s coefficient 1 / inf = 0 turns the inf into NaN and
    # NAdam writes it into its moments and the weights; every later loss is NaN (the scale keeps halving). The AMP
    # recipe (scaler.step) skips step 7 and stays finite.
    assert s["weights_finite"][:GLITCH_AT] == [True] * GLITCH_AT and s["weights_finite"][GLITCH_AT] is False, s
    assert GLITCH_AT in r["skipped"] and math.isfinite(r["losses"][GLITCH_AT]), r
    assert r["bad_loss"] == list(range(GLITCH_AT + 1, GLITCH_AT + 4)), r["losses"]
    ok = run(MLP, nadam, amp_step(reg_batch, mse), GLITCH_AT + 4, None, watch=False)
    assert GLITCH_AT in ok["skipped"] and all(map(math.isfinite, ok["losses"])) and all_finite(ok["weights"]), ok
    named(r, "scaler_misorder", None, 0)


def test_twin_nadam_through_scaler_step_skips_the_glitch_and_is_quiet(tmp_path):
    twin_quiet(MLP, nadam, amp_step(reg_batch, mse), 16, tmp_path / "run", skips=(GLITCH_AT,))


# ======================================================================================================================
# 6. a `.half()` model on RMSprop with the fp16-safe eps=1e-4 and a StepLR decay x0.1 at step 6: from step 6 the
#    RMSNorm gains' updates are below half an ulp of 1.0 and round away
# ======================================================================================================================
DECAY_AT = 6


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.norm = nn.RMSNorm(64)
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(F.gelu(self.norm(self.inp(x.to(self.inp.weight.dtype)))))


def rmsprop_steplr(m):
    opt = torch.optim.RMSprop(m.parameters(), lr=3e-4, eps=1e-4)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=DECAY_AT, gamma=0.1)


def rounded(i, m, opt, before, seen):
    """Per parameter: the share of the elements with a nonzero gradient that the update left unchanged."""
    for n, p in m.named_parameters():
        nz = p.grad != 0
        seen.setdefault(n, []).append(float(((p.detach() == before[n]) & nz).sum() / nz.sum().clamp(min=1)))


def reg_pure_step(i, m, opt, sc):
    x, y = reg_batch(i, glitch=False)
    opt.zero_grad()
    loss = mse(m(x), y)
    loss.backward()
    opt.step()
    return loss


def test_rmsprop_half_model_steplr_decay_rounds_the_norm_gains_away(tmp_path):
    steps = DECAY_AT + 6
    r = run(lambda: NormNet().half(), rmsprop_steplr, reg_pure_step, steps, tmp_path / "run", scaler=False,
            record=rounded)
    s = r["seen"]
    # truth: before the decay RMSprop's updates (~ lr * g / sqrt(v), 3-10 x lr) land on the gains at ~1.0; from step 6
    # on (lr 3e-5) they are below half an ulp (2.4e-4 / 4.9e-4) and round away on every step, while the Linear weights
    # (~0.1, a finer grid) keep moving; every loss finite. In float32 the gains move on every step.
    if DEBUG:
        print({k: [round(v, 2) for v in vs] for k, vs in s.items()})
    assert all(v < 0.3 for v in s["norm.weight"][:DECAY_AT]) and all(v > 0.9 for v in s["norm.weight"][DECAY_AT:]), s
    assert all(v < 0.5 for v in s["inp.weight"]), s["inp.weight"]
    assert all(map(math.isfinite, r["losses"])) and r["first"] is None, r["losses"]
    f32 = run(NormNet, rmsprop_steplr, reg_pure_step, steps, None, scaler=False, watch=False, record=rounded)
    assert all(v < 0.2 for v in f32["seen"]["norm.weight"]), f32["seen"]["norm.weight"]
    named(r, "update_underflow", "norm", DECAY_AT)


# ======================================================================================================================
# 7. torch.optim.Adafactor on a `.half()` model at lr=1e-4 ("the Adam lr"): Adafactor's step is relative to the
#    parameter's RMS (alpha = RMS(w) * min(lr, 1/sqrt(t))), so each update is ~1e-4 of the weights' scale: below half
#    an ulp (2^-12 .. 2^-11 relative) for most elements
# ======================================================================================================================
def test_adafactor_at_the_adam_lr_on_a_half_model_rounds_its_relative_steps_away(tmp_path):
    steps = 8
    adafactor = lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-4)     # noqa: E731
    r = run(lambda: NormNet().half(), adafactor, reg_pure_step, steps, tmp_path / "run", scaler=False, record=rounded)
    s = r["seen"]
    # truth: from the first update on, every RMSNorm gain update and out.bias's, and most of the Linear weights'
    # (> 75% of the elements with a nonzero gradient), round away on every step; every loss finite. In float32 (the
    # same optimizer, weights and batches) over 95% of them move on every step. The accepted modules: those whose every parameter rounds > 75% away on every step.
    assert all(v == 1.0 for v in s["norm.weight"]), s["norm.weight"]
    gone = tuple(mod for mod in ("inp", "norm", "out")
                 if all(v > 0.75 for n, vs in s.items() if n.startswith(mod + ".") for v in vs))
    assert "norm" in gone, s
    assert all(map(math.isfinite, r["losses"])) and r["first"] is None, r["losses"]
    f32 = run(NormNet, adafactor, reg_pure_step, steps, None, scaler=False, watch=False, record=rounded)
    assert all(v < 0.05 for vs in f32["seen"].values() for v in vs), f32["seen"]
    named(r, "update_underflow", gone, 0)


# ======================================================================================================================
# twin of 1/2: RAdam over fp32 weights under fp16 autocast + GradScaler (unscale_ + clip + step + update)
# ======================================================================================================================
def test_twin_radam_fp32_weights_under_autocast_and_scaler_is_quiet(tmp_path):
    twin_quiet(Bag, lambda m: torch.optim.RAdam(m.parameters(), lr=0.2), amp_step(bag_batch, ce), 30,
               tmp_path / "run", fall=0.9)


# ======================================================================================================================
# twin: fused AdamW (amsgrad, decoupled weight decay, per-group learning rates) through GradScaler's fused path: no
#    unscale_, no clip; scaler.step hands the kernel grad_scale / found_inf and the kernel unscales (and skips)
# ======================================================================================================================
def fused_adamw_groups(m):
    return torch.optim.AdamW([{"params": m.body.parameters(), "lr": 3e-3, "weight_decay": 0.05},
                              {"params": m.head.parameters(), "lr": 1e-2, "weight_decay": 0.0}],
                             amsgrad=True, fused=True)


def test_twin_fused_adamw_amsgrad_groups_unscaled_inside_the_kernel_is_quiet(tmp_path):
    opt = fused_adamw_groups(MLP())
    assert opt._step_supports_amp_scaling          # GradScaler.step takes the fused path (no unscale_ of its own)
    twin_quiet(MLP, fused_adamw_groups, amp_step(clean_reg, mse, clip=False), 24, tmp_path / "run", fall=0.3)
