"""Fifty-seventh set: SILENT AND SLOW FP16 FAILURES (nothing goes inf/NaN at the step that matters, or only long after
it: training stops learning, a scale decays, an optimizer state vanishes, an activation creeps up to 65504), in loop
styles and structures the earlier silent sets (17, 22, 26, 30, 42) do not build: an HF-style model that returns its
own loss, a Lightning-style module whose loop clips only during warm-up, a triplet-loss metric learner, LoRA
adapters under a hand-written half-state AdamW, a Gumbel-softmax quantiser with an annealed temperature, a two-tower
recommender with an fp16 item table. Watched through the public API only: `ampdoctor.watch(model, optimizer=opt,
scaler=sc (or None), run_dir=tmp_path / "run")` at the default settings, close(), report() (4: also a `w.report()`
mid-run); ampdoctor's RuntimeWarnings recorded. Tiny models, fixed seeds, one intra-op thread; CPU fp16 autocast
(+ a real `torch.amp.GradScaler("cpu")` where the case has one).

Each failure is proven first by the test's own oracle (a failing oracle is a plain failure); only then must the rule
be among the report's first three findings at the module, at the onset step, with the severity CONTRACT.md implies;
a wrong report raises WrongAnswer naming ampdoctor's top three (rule@module step [severity]).

 1. a GradScaler pinned at 1 (`GradScaler("cpu", init_scale=1.0, growth_interval=10**9)`: "a static scale, no
    skipped steps") on an HF-style extreme multi-label classifier (`model(x, labels=y)` returns {"loss", "logits"};
    4096 labels, BCE-with-logits averaged over batch x labels, the head's bias at the label prior -6 as XML/RetinaNet
    code initialises it). The gradient reaching the fp16 logits is (sigmoid(z) - y) / (32 * 4096): for the negatives
    ~2e-8, below half of fp16's smallest subnormal: oracle (a full backward hook on `head`): >= 90% of the gradient
    into `head`'s output is exactly 0 while the same step at the default scale (2^16) has < 1% zeros; step 0's
    gradients (same weights, same batch) are off the default scale's: the head's bias > 20%, the encoder's weight
    > 10% -> underflow (backward) at `head`, step 0, error.
 2. a triplet-loss metric learner with the Euclidean distance written out, `sqrt(((a - b) ** 2).sum(-1))` (module
    `dist`), margin 4. From step 6 (the sampler's second epoch wraps around) every batch holds anchors paired with
    themselves: a == p bitwise, sqrt's backward is 1 / (2 * 0) = inf, times (a - p) = 0: NaN in the backward every
    step; the forward and the loss stay finite (oracle: the loss finite everywhere, the parameter gradients
    non-finite from step 6 only, the scaler skips every step from 6 and the scale falls 2^12-fold), the model never
    trains again -> loss_scale_collapse (nan_origin accepted: the backward producer) at `dist`, step 6, error.
 3. LoRA adapters (rank 8, B zero-initialised as peft does) on a frozen two-block MLP, trained by a hand-written
    "half-state AdamW" that keeps exp_avg / exp_avg_sq in fp16 to halve the optimizer memory (the step itself in
    fp32, eps 1e-8; lr 1e-2, clip 1.0). At step 0 only lora_b has a gradient, and a small one: 0.001 * g^2 falls
    below fp16's smallest subnormal for 85-91% of its elements, exp_avg_sq is 0 where exp_avg is not, and the update
    is lr * g / eps: oracle: that share, the largest element change per layer (lora_b: ~5e5 x lr at step 0;
    lora_a: 0), the loss after it x5 or non-finite (step 1's forward overflows in lora_b); the same loop under
    torch.optim.AdamW moves no element by more than 3x lr -> update_spike at a lora_b, step 0, error.
 4. a Gumbel-softmax quantiser (discrete VAE) with the temperature annealed exponentially every step,
    tau = exp(-0.2 * step), the floor forgotten (Jang et al. anneal tau to a floor of 0.5). `quantizer` returns
    (logits + g) / tau in fp16: its abs-max grows x1.22 per step (0.29 bits/step) from ~10 to 65504 over ~40 steps
    and overflows there (oracle: a forward hook's abs-max per step, the first inf step S, the loss non-finite and
    the step skipped at S, finite before). A mid-run `w.report()` at S - 5 (training going on) must already warn ->
    headroom_trend at `quantizer`, warning, its forecast within 4 steps of S; the final report: headroom_trend at
    `quantizer` among the first three (the forecast came true: error), dated before S.
 5. a Lightning-style module (`training_step`, the loop's clipping configured only for the warm-up:
    `gradient_clip_val if global_step < warmup`), SGD(momentum 0.9) with a linear lr warm-up to 0.2 over 8 steps,
    unstandardised regression targets (~20). During warm-up the gradients are clipped to 1.0 (each update < 0.3 of
    the layer's norm); the first unclipped update (step 8) moves `out` by 6x its norm, the loss then jumps x4 and
    the scaler skips; the run recovers afterwards, so the oracle proves a spike, not a broken run -> update_spike at
    a spiked layer, step 8, warning or error.
 6. a two-tower recommender whose item table `item_emb` is kept in fp16 ("90% of the memory"; the towers fp32 under
    fp16 autocast; no scaler: GradScaler refuses fp16 gradients), SGD lr 0.5 with a step decay x0.01 at step 10.
    From step 0, lr * g (~5e-4) is below half an fp16 ulp of most entries (|w| ~ 1): >= 80% of the table's
    elements with a nonzero gradient are unchanged by each step (>= 99% after the decay), every fp32 parameter's
    < 10% -> update_underflow at `item_emb`, step 0..3, error.
Healthy twins (no warning, no error, no RuntimeWarning; the same loop unwatched gives bitwise the same losses and
final weights):
 7. twin of 1: the same classifier at GradScaler's default scale.
 8. twin of 3: the same LoRA model under torch.optim.AdamW (fp32 states).

Result when written (torch CPU, default watch): 5/8 right (7/8 now) (1, 5, 6, both twins); strict xfails (WrongAnswer):
- 2 (fixed since): top three `overflow@dist step 6 [error]` (right: sqrt's backward makes +inf there),
  `loss_scale_collapse@net.2 step 6 [error]`: the hooks' producer on the later sampled steps is `net.2`, which the
  replay of step 6 corrected to `dist` for the overflow finding but not for the collapse. Now a scaler finding
  follows the replay's correction of a producer first seen on a later step (analysis/replayfold.py
  _follow_refined).
- 3 (fixed since): top three `overflow@blocks.1.lora_b step 1 [error]`, `skipped_steps@blocks.1.lora_b step 1
  [error]`: the step-0 update that caused it is not named. rules/updates.py _spikes: factor = norm_after /
  norm_before only `if n0 > 0 else 0.0`, so a zero-initialised weight (LoRA B, ControlNet zero convs, ReZero) could
  never spike. Now a zero-born weight's first updates are held to what an Adam-type optimizer's steps allow
  (_adam_bound: at most ~4 lr per element per update).
- 4: no headroom_trend at all: the mid-run report at S - 5 is empty (the abs-max 42368 of 65504, growing ~0.3
  bits/step since step 0); the final report: `overflow@quantizer step 44 [error]`, `skipped_steps@quantizer step 44
  [error]`. The default budget records the series on one routine step in ~8 on this tiny model: 9 points by step 38,
  where the trend needs a window of 12. (Recording it on every step near the max warned here at step 28, but the
  windows mixing sparse and dense points then warned on a healthy target-units staircase, test_trend_strides s8:
  not kept.)
Seen, not asserted: 5 is a warning (`update_spike at out step 8`, x6.74); 6 also gives `fp16_master_weights at
item_emb step 0 [error]` first and `underflow at item_emb step 0 [error]`.

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants57.py
"""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

import ampdoctor
from probe_harness import WrongAnswer, at_top3
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
TINY16 = torch.finfo(FP16).tiny          # 2^-14, fp16's smallest normal
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ======================================================================================================================
# the loop, the oracles and the checks
# ======================================================================================================================
def run(build, make_opt, steps, run_dir, *, batch, loss_of=None, scaler=None, autocast=True, clip=None, before=None,
        setup=None, record=None, mid_report=None, watch=True, seed=0, call=None):
    """The user's loop under ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) at the default settings:
    [before(i, m, opt) under no_grad] -> zero_grad -> forward `m(*batch(i))` or `call(m, batch(i))` (fp16 autocast where `autocast`) ->
    loss = loss_of(out) (default: out itself) -> with a scaler (`scaler`: GradScaler("cpu", **scaler) kwargs):
    scale(loss).backward -> [unscale_ + clip_grad_norm_(clip(i)) where clip(i) is not None] -> step -> update;
    without: backward -> [clip] -> step; -> [scheduler.step] -> [w.report() after step `mid_report`]. `make_opt(m)`
    gives (the optimizer, a scheduler or None). The oracle: per step each weight's update ratio ||dW|| / ||W|| (by
    module), the largest element change of each weight, per parameter the share of its elements with a nonzero gradient that the step left unchanged,
    `setup(m, seen)` (hooks, returned and removed at the end), `record(i, m, opt, seen)`. Returns a dict."""
    torch.manual_seed(seed)
    m = build()
    opt, sched = make_opt(m)
    sc = torch.amp.GradScaler("cpu", **scaler) if scaler is not None else None
    r = dict(losses=[], bad_loss=[], skipped=[], scales=[], ratio=[], dmax=[], rounded=[], bad_grad=[], seen={}, rep=None,
             mid=None, warns=[])
    hooks = setup(m, r["seen"]) if setup is not None else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) if watch else None
        for i in range(steps):
            r["seen"]["step"] = i
            if before is not None:
                with torch.no_grad():
                    before(i, m, opt)
            w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16, enabled=autocast):
                out = m(*batch(i)) if call is None else call(m, batch(i))
            loss = out if loss_of is None else loss_of(out)
            r["losses"].append(loss.item())
            if not math.isfinite(loss.item()):
                r["bad_loss"].append(i)
            c = clip(i) if clip is not None else None
            if sc is not None:
                s0 = sc.get_scale()
                r["scales"].append(s0)
                sc.scale(loss).backward()
                if c is not None:
                    sc.unscale_(opt)
                    nn.utils.clip_grad_norm_(m.parameters(), c)
                grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)
                sc.step(opt)
                sc.update()
                if sc.get_scale() < s0:
                    r["skipped"].append(i)
            else:
                loss.backward()
                if c is not None:
                    nn.utils.clip_grad_norm_(m.parameters(), c)
                grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)
                opt.step()
            if not grads_ok:
                r["bad_grad"].append(i)
            if sched is not None:
                sched.step()
            with torch.no_grad():
                r["ratio"].append({n[:-len(".weight")]: float((p.float() - w0[n].float()).norm()
                                                              / w0[n].float().norm().clamp(min=1e-12))
                                   for n, p in m.named_parameters() if n.endswith(".weight") and p.requires_grad})
                r["dmax"].append({n[:-len(".weight")]: float((p.float() - w0[n].float()).abs().max())
                                  for n, p in m.named_parameters() if n.endswith(".weight") and p.requires_grad})
                rd = {}
                for n, p in m.named_parameters():
                    if p.grad is None:
                        continue
                    nz = p.grad != 0
                    if int(nz.sum()):
                        rd[n] = float((p[nz] == w0[n][nz]).float().mean())
                r["rounded"].append(rd)
            if record is not None:
                record(i, m, opt, r["seen"])
            if w is not None and i == mid_report:
                r["mid"] = w.report()
        for h in hooks:
            h.remove()
        if w is not None:
            w.close()
            r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in caught if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    if DEBUG:
        print("losses", [round(v, 4) for v in r["losses"]], "skipped", r["skipped"], "bad_grad", r["bad_grad"])
        print("scales", r["scales"])
        for i, d in enumerate(r["ratio"]):
            print(i, {k: f"{v:.3g}" for k, v in d.items()}, {k: f"{v:.2f}" for k, v in r["rounded"][i].items()})
        for tag in ("mid", "rep"):
            if r[tag] is not None:
                print(tag, "\n".join(lines(r[tag])))
    return r


def top3(rep):
    return "; ".join(f"{f.rule}@{f.module if f.module is not None else '(run)'} step {f.step} [{f.severity}]"
                     for f in rep.findings[:3])


def named(rep, rules, modules, step, severity="error"):
    """ampdoctor's answer: one of `rules` at one of `modules`, at `step` (one value or a tuple), with `severity`,
    among the first three findings; otherwise WrongAnswer naming its top three."""
    rules = (rules,) if isinstance(rules, str) else rules
    modules = (modules,) if isinstance(modules, str) or modules is None else modules
    hit = None
    for mod in modules:
        try:
            hit = at_top3(rep, rules, mod, step=step, severity=severity)
            break
        except AssertionError:
            continue
    if hit is None:
        raise WrongAnswer(f"expected {'/'.join(rules)} at {'/'.join(map(str, modules))} step {step} [{severity}]; "
                          f"top three: {top3(rep)}")
    return hit


def all_finite(sd):
    return all(bool(torch.isfinite(v).all()) for v in sd.values() if v.is_floating_point())


def twin_quiet(build, make_opt, steps, run_dir, *, fall=0.9, **kw):
    """The healthy twin: the watched run finite and learning, no skip after step 3, no RuntimeWarning, no warning or
    error; the unwatched run gives bitwise the same losses and final weights."""
    r = run(build, make_opt, steps, run_dir, **kw)
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and all_finite(r["weights"]) and not r["bad_grad"], r
    assert sum(ls[-3:]) < fall * sum(ls[:3]), ls
    assert [s for s in r["skipped"] if s > 3] == [], r["skipped"]
    u = run(build, make_opt, steps, None, watch=False, **kw)
    assert u["losses"] == ls, (u["losses"], ls)
    assert all(torch.equal(u["weights"][k], v) for k, v in r["weights"].items())
    assert r["warns"] == [], r["warns"]
    rep = r["rep"]
    assert rep.summary["steps"] >= 1, rep.summary
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm: {top3(rep)}")
    return r


def loss_key(out):
    return out["loss"]


# ======================================================================================================================
# 1./7. an HF-style extreme multi-label classifier under a GradScaler pinned at 1
# ======================================================================================================================
XML_IN, XML_H, XML_C, XML_B = 64, 128, 4096, 32
XML_W = torch.randn(XML_IN, XML_C, generator=gen(5700))


class XMLClassifier(nn.Module):
    """encoder (Linear -> GELU) -> head (Linear, bias at the label prior); `forward(x, labels)` returns
    {"loss": BCE-with-logits mean, "logits"} (HF style)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(XML_IN, XML_H), nn.GELU())
        self.head = nn.Linear(XML_H, XML_C)
        with torch.no_grad():
            self.head.bias.fill_(-6.0)                 # log prior of a label (~5 of 4096 on)

    def forward(self, x, labels=None):
        logits = self.head(self.encoder(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.binary_cross_entropy_with_logits(logits.float(), labels)
        return out


def xml_batch(i):
    g = gen(5710 + i % 6)
    x = torch.randn(XML_B, XML_IN, generator=g)
    s = x @ XML_W
    y = torch.zeros(XML_B, XML_C)
    y.scatter_(1, s.topk(5, dim=1).indices, 1.0)
    return x, y


def adamw(lr):
    return lambda m: (torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr), None)


def head_grad_out(m, seen):
    def hook(mod, gin, gout):
        g = gout[0]
        nz = (g != 0)
        seen.setdefault("zero_share", []).append(float((~nz).float().mean()))
        seen.setdefault("sub_share", []).append(float(((g.abs() < TINY16) & nz).float().mean()))
        seen.setdefault("dtype", []).append(g.dtype)
    return [m.head.register_full_backward_hook(hook)]


def enc_grad(i, m, opt, seen):
    if i == 0:
        seen["grad0"] = {n: p.grad.detach().clone() for n, p in m.named_parameters()}


PINNED = dict(init_scale=1.0, growth_interval=10 ** 9)


def test_scaler_pinned_at_one_flushes_the_multilabel_gradients(tmp_path):
    steps = 12
    r = run(XMLClassifier, adamw(1e-2), steps, tmp_path / "run", batch=xml_batch, loss_of=loss_key, scaler=PINNED,
            setup=head_grad_out, record=enc_grad)
    ok = run(XMLClassifier, adamw(1e-2), steps, None, batch=xml_batch, loss_of=loss_key, scaler={},
             setup=head_grad_out, record=enc_grad, watch=False)
    s, t = r["seen"], ok["seen"]
    if DEBUG:
        print("pinned zero", s["zero_share"], "default zero", t["zero_share"], "sub", s["sub_share"])
    # truth: every step finite, no skip, the scale stays 1; the gradient into the head's fp16 output is >= 90% exactly
    # zero every step (< 1% at the default scale), and step 0's gradients (same weights, same batch) are off the
    # default scale's: the head's bias > 20% (the negatives' share is lost), the encoder's weight > 10%
    assert all(map(math.isfinite, r["losses"])) and r["skipped"] == [] and set(r["scales"]) == {1.0}, r
    assert s["dtype"][0] == FP16
    assert min(s["zero_share"]) >= 0.9 and max(t["zero_share"]) < 0.01, (s["zero_share"], t["zero_share"])
    off = {n: float((g - t["grad0"][n]).norm() / t["grad0"][n].norm()) for n, g in s["grad0"].items()}
    if DEBUG:
        print("grad off", off)
    assert off["head.bias"] > 0.2 and off["encoder.0.weight"] > 0.1, off
    assert sum(r["losses"][-3:]) > 1.05 * sum(ok["losses"][-3:]), (r["losses"], ok["losses"])    # it learns less
    named(r["rep"], "underflow", "head", 0)
    assert r["warns"] == [], r["warns"]


def test_twin_default_scale_multilabel_is_quiet(tmp_path):
    twin_quiet(XMLClassifier, adamw(1e-2), 12, tmp_path / "run", batch=xml_batch, loss_of=loss_key, scaler={})


# ======================================================================================================================
# 2. a triplet loss whose hand-written distance meets a == p from step 6: NaN in sqrt's backward every step
# ======================================================================================================================
DUP_AT = 6
TRI_B, TRI_D = 32, 24
CENTERS = torch.randn(8, TRI_D, generator=gen(5720)) * 2


class Distance(nn.Module):
    """The Euclidean distance written out (no eps): sqrt(sum((a - b)^2))."""

    def forward(self, a, b):
        return ((a - b) ** 2).sum(-1).sqrt()


class TripletNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(TRI_D, 64), nn.ReLU(), nn.Linear(64, 16))
        self.dist = Distance()

    def forward(self, a, p, n):
        ea, ep, en = self.net(a), self.net(p), self.net(n)
        return F.relu(self.dist(ea, ep) - self.dist(ea, en) + 4.0).float().mean()


def triplet_batch(i, dup=True):
    g = gen(5730 + i)
    ca = torch.randint(0, 8, (TRI_B,), generator=g)
    cn = (ca + torch.randint(1, 8, (TRI_B,), generator=g)) % 8
    a = CENTERS[ca] + 0.5 * torch.randn(TRI_B, TRI_D, generator=g)
    p = CENTERS[ca] + 0.5 * torch.randn(TRI_B, TRI_D, generator=g)
    n = CENTERS[cn] + 0.5 * torch.randn(TRI_B, TRI_D, generator=g)
    if dup and i >= DUP_AT:              # the sampler's second epoch wraps: a few anchors are their own positive
        p[:4] = a[:4]
    return a, p, n


def test_triplet_distance_nan_backward_every_step_collapses_the_scale(tmp_path):
    steps = DUP_AT + 12
    r = run(TripletNet, adamw(1e-3), steps, tmp_path / "run", batch=triplet_batch, scaler={})
    # truth: every loss finite; the gradients non-finite exactly from step 6 on; no skip before 6 but the opening
    # backoffs (0-3), every step from 6 skipped; the scale ends 2^11-fold (or more) below its value at step 6; the
    # same sampler without self-pairs trains
    assert all(map(math.isfinite, r["losses"])), r["losses"]
    assert r["bad_grad"] == list(range(DUP_AT, steps)), r["bad_grad"]
    assert all(s < 4 for s in r["skipped"] if s < DUP_AT) and [s for s in r["skipped"] if s >= DUP_AT] == \
        list(range(DUP_AT, steps)), r["skipped"]
    assert r["scales"][-1] <= r["scales"][DUP_AT] / 2 ** 11, r["scales"]
    assert all_finite(r["weights"])
    ok = run(TripletNet, adamw(1e-3), steps, None, batch=lambda i: triplet_batch(i, dup=False), scaler={},
             watch=False)            # a sampler that never pairs an item with itself: finite, learning
    assert not ok["bad_grad"] and sum(ok["losses"][-3:]) < 0.9 * sum(ok["losses"][:3]), ok["losses"]
    assert r["warns"] == [], r["warns"]
    # the root cause: sqrt's backward in `dist` (+inf from finite gradients: overflow; NaN: nan_origin), step 6
    named(r["rep"], ("overflow", "nan_origin"), "dist", DUP_AT)
    # and its consequence, the collapse, traced to the same module
    named(r["rep"], "loss_scale_collapse", "dist", DUP_AT)


# ======================================================================================================================
# 3./8. LoRA under a hand-written AdamW with fp16 states: exp_avg_sq underflows to 0, the update is lr * g / eps
# ======================================================================================================================
class LoRALinear(nn.Module):
    """A frozen base Linear plus B(A(x)) * alpha / r (peft's layout: A kaiming, B zeros)."""

    def __init__(self, d, r=8, alpha=16):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d, r, bias=False)
        self.lora_b = nn.Linear(r, d, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scaling


class LoRANet(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList([LoRALinear(d), LoRALinear(d)])
        self.head = nn.Linear(d, 4)
        self.head.requires_grad_(False)

    def forward(self, x, y):
        h = F.gelu(self.embed(x))
        for b in self.blocks:
            h = h + F.gelu(b(h))
        return F.cross_entropy(self.head(h).float(), y)


W_T = torch.randn(16, 4, generator=gen(5740))


def teacher(i, n=64):
    g = gen(5750 + i)
    x = torch.randn(n, 16, generator=g)
    return x, (x @ W_T).argmax(1)


class HalfStateAdamW(Optimizer):
    """AdamW with exp_avg / exp_avg_sq stored in fp16 ("halve the optimizer's memory"); the step in fp32."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=FP16)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=FP16)
                st["step"] += 1
                g = p.grad.float()
                m = st["exp_avg"].float().mul_(b1).add_(g, alpha=1 - b1)
                v = st["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                st["exp_avg"].copy_(m)
                st["exp_avg_sq"].copy_(v)
                bc1, bc2 = 1 - b1 ** st["step"], 1 - b2 ** st["step"]
                denom = (st["exp_avg_sq"].float() / bc2).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(st["exp_avg"].float(), denom, value=-group["lr"] / bc1)
        return None


LORA_LR = 1e-2


def half_state(m):
    return HalfStateAdamW([p for p in m.parameters() if p.requires_grad], lr=LORA_LR), None


def v_zero(i, m, opt, seen):
    for k, b in enumerate(m.blocks):
        p = b.lora_b.weight
        st = opt.state.get(p)
        if st is None or p.grad is None or not isinstance(opt, HalfStateAdamW):
            continue
        nz = p.grad != 0
        seen.setdefault(f"vzero_{k}", []).append(float(((st["exp_avg_sq"] == 0) & nz).float().sum()
                                                     / nz.float().sum().clamp(min=1)))


def test_half_state_adamw_vanishing_second_moment_spikes_lora_b(tmp_path):
    steps = 10
    r = run(LoRANet, half_state, steps, tmp_path / "run", batch=teacher, scaler={}, clip=lambda i: 1.0,
            record=v_zero)
    dmax, s = r["dmax"], r["seen"]
    if DEBUG:
        print(s, [{k: f"{v / LORA_LR:.3g}" for k, v in d.items()} for d in dmax])
    spike = next(i for i, d in enumerate(dmax) if max(d.values()) > 100 * LORA_LR)
    spiked = tuple(k for k, v in dmax[spike].items() if v > 100 * LORA_LR)
    # truth: the first update (step 0) moves an element of each lora_b (zero-initialised: its norm was 0) by > 100x
    # the lr, where exp_avg_sq is 0 for a share of the elements with a nonzero gradient while exp_avg is not; the
    # lora_a (no gradient yet: B = 0) do not move; after it the loss is x5 or non-finite; the same loop with fp32
    # states never moves an element by more than 3x the lr and trains
    assert spike == 0 and spiked == ("blocks.0.lora_b", "blocks.1.lora_b"), dmax[:2]
    assert all(s[f"vzero_{k}"][0] > 0.05 for k in (0, 1)), s
    assert all(v == 0 for k, v in dmax[0].items() if k.endswith("lora_a")), dmax[0]
    after = r["losses"][1:]
    assert not all(map(math.isfinite, after)) or max(after) > 5 * r["losses"][0], r["losses"]
    ok = run(LoRANet, adamw(LORA_LR), steps, None, batch=teacher, scaler={}, clip=lambda i: 1.0, watch=False)
    assert all(map(math.isfinite, ok["losses"])) and max(max(d.values()) for d in ok["dmax"]) < 3 * LORA_LR, \
        ok["dmax"]
    named(r["rep"], "update_spike", spiked, spike)
    assert r["warns"] == [], r["warns"]


def test_twin_fp32_state_adamw_lora_is_quiet(tmp_path):
    twin_quiet(LoRANet, adamw(LORA_LR), 24, tmp_path / "run", batch=teacher, scaler={}, clip=lambda i: 1.0)


# ======================================================================================================================
# 4. a Gumbel-softmax quantiser whose temperature is annealed without a floor: headroom shrinks for ~40 steps
# ======================================================================================================================
ANNEAL = 0.2


class GumbelQuantizer(nn.Module):
    """(logits + Gumbel noise) / tau, in the logits' dtype (fp16 under autocast)."""

    def __init__(self, d, k):
        super().__init__()
        self.proj = nn.Linear(d, k)
        self.tau = 1.0
        self.noise = None

    def forward(self, h):
        logits = self.proj(h)
        return (logits + self.noise.to(logits.dtype)) / self.tau


class DVAE(nn.Module):
    def __init__(self, d_in=32, d=64, k=64):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, d), nn.GELU())
        self.quantizer = GumbelQuantizer(d, k)
        self.codebook = nn.Linear(k, d, bias=False)
        self.decoder = nn.Sequential(nn.GELU(), nn.Linear(d, d_in))

    def forward(self, x):
        y = self.quantizer(self.encoder(x))
        z = self.codebook(torch.softmax(y.float(), dim=-1).to(y.dtype))
        return F.mse_loss(self.decoder(z).float(), x)


def dvae_batch(i, n=64):
    return (torch.randn(n, 32, generator=gen(5760 + i)),)


def anneal(i, m, opt):
    m.quantizer.tau = math.exp(-ANNEAL * i)            # Jang et al.: max(0.5, exp(-r t)); the floor forgotten
    u = torch.rand(64, 64, generator=gen(5770 + i)).clamp(1e-6, 1 - 1e-6)
    m.quantizer.noise = -torch.log(-torch.log(u))


def q_absmax(m, seen):
    def hook(mod, inp, out):
        seen.setdefault("absmax", []).append(float(out.float().abs().max()))
    return [m.quantizer.register_forward_hook(hook)]


def first_inf(r):
    return next(i for i, v in enumerate(r["seen"]["absmax"]) if not math.isfinite(v))


@pytest.mark.xfail(strict=False, raises=WrongAnswer, reason=(
    "no headroom_trend at all: the mid-run report at step 39 (S - 5, the abs-max 42368 of 65504, growing "
    "~0.3 bits/step since step 0) is empty; the final report's top three: overflow@quantizer step 44 [error]; "
    "skipped_steps@quantizer step 44 [error]; expected headroom_trend at quantizer [warning] before step 40. Not "
    "strict: the series' stride follows the machine's load (headroom=\"auto\"), and on a loaded host (the full suite "
    "beside other work) a denser series warned in time"))
def test_gumbel_temperature_annealed_without_floor_loses_headroom_steadily(tmp_path):
    probe = run(DVAE, adamw(1e-3), 60, None, batch=dvae_batch, scaler={}, clip=lambda i: 1.0, before=anneal,
                setup=q_absmax, watch=False)
    S = first_inf(probe)
    steps = S + 3
    r = run(DVAE, adamw(1e-3), steps, tmp_path / "run", batch=dvae_batch, scaler={}, clip=lambda i: 1.0,
            before=anneal, setup=q_absmax, mid_report=S - 5)
    a = r["seen"]["absmax"]
    if DEBUG:
        print("S", S, [round(v, 1) for v in a])
    # truth: the abs-max grows steadily (x > 1.1 per step on average over every 5 steps) from step 0 to S, passes 256
    # at least 15 steps before S, is finite before S and inf at S; the loss is first non-finite at S and S is skipped
    assert first_inf(r) == S and 30 <= S <= 50, (S, a)
    assert all(a[k + 5] > 1.1 ** 5 * a[k] for k in range(0, S - 5)), a
    assert next(k for k, v in enumerate(a) if v >= 256) <= S - 15, a
    assert r["bad_loss"] and r["bad_loss"][0] == S and S in r["skipped"], (r["bad_loss"], r["skipped"])
    f = named(r["mid"], "headroom_trend", "quantizer", tuple(range(0, S - 4)), severity="warning")
    if abs(f.evidence.get("forecast_step", -99) - S) > 4:
        raise WrongAnswer(f"forecast {f.evidence.get('forecast_step')} against the overflow at step {S}")
    named(r["rep"], "headroom_trend", "quantizer", tuple(range(0, S)))
    assert r["warns"] == [], r["warns"]


# ======================================================================================================================
# 5. a Lightning-style module that clips only during warm-up: the first unclipped update spikes
# ======================================================================================================================
WARMUP = 8
LIT_LR = 0.2


class LitRegressor(nn.Module):
    """A LightningModule-like regressor: `training_step` computes the loss; the trainer loop clips while warming
    up (`gradient_clip_val if global_step < warmup_steps`)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)
        self.global_step = 0

    def forward(self, x):
        return self.out(F.gelu(self.fc2(F.gelu(self.fc1(x))))).squeeze(-1)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self(x).float(), y)


W_R = torch.randn(16, generator=gen(5780))


def reg_batch(i, n=32):
    g = gen(5790 + i)
    x = torch.randn(n, 16, generator=g)
    return x, 20.0 + 3.0 * (x @ W_R) / 4            # unstandardised targets (~20)


def lit_opt(m):
    opt = torch.optim.SGD(m.parameters(), lr=LIT_LR, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))


def lit_clip(i):
    return 1.0 if i < WARMUP else None


def training_step(m, batch):
    m.global_step += 1
    return m.training_step(batch)


def test_clipping_only_during_warmup_lets_the_first_unclipped_update_spike(tmp_path):
    steps = WARMUP + 5
    r = run(LitRegressor, lit_opt, steps, tmp_path / "run", batch=reg_batch, call=training_step, scaler={},
            clip=lit_clip)
    ratio = r["ratio"]
    spike = next(i for i, d in enumerate(ratio) if max(d.values()) > 1.0)
    spiked = tuple(k for k, v in ratio[spike].items() if v > 1.0)
    # truth: every update of the warm-up moves each layer by < 0.3 of its norm; the first unclipped one (step 8)
    # moves at least one layer by more than its norm (out: x6); after it the loss jumps past x4 its value at the
    # spike and the scaler skips a later step (the run recovers: a risk, not proven broken: warning or error);
    # with clipping kept every update stays < 0.5
    assert spike == WARMUP and all(max(d.values()) < 0.3 for d in ratio[:WARMUP]), ratio
    assert max(r["losses"][spike + 1:]) > 4 * r["losses"][spike], r["losses"]
    assert [s for s in r["skipped"] if s > spike], r["skipped"]
    ok = run(LitRegressor, lit_opt, steps, None, batch=reg_batch, call=training_step, scaler={},
             clip=lambda i: 1.0, watch=False)
    assert all(map(math.isfinite, ok["losses"])) and max(max(d.values()) for d in ok["ratio"]) < 0.5, ok["ratio"]
    named(r["rep"], "update_spike", spiked, spike, severity=("warning", "error"))
    assert r["warns"] == [], r["warns"]


# ======================================================================================================================
# 6. a two-tower recommender with an fp16 item table: the lr decay at step 10 makes its updates round away
# ======================================================================================================================
DECAY_AT = 10
N_USERS, N_ITEMS, EMB = 200, 300, 16


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_emb = nn.Embedding(N_USERS, EMB)
        self.item_emb = nn.Embedding(N_ITEMS, EMB).half()       # the big table kept in fp16
        self.user_tower = nn.Sequential(nn.Linear(EMB, 32), nn.ReLU(), nn.Linear(32, EMB))
        self.item_tower = nn.Sequential(nn.Linear(EMB, 32), nn.ReLU(), nn.Linear(32, EMB))

    def forward(self, u, it, y):
        eu = self.user_tower(self.user_emb(u))
        ei = self.item_tower(self.item_emb(it))
        return F.binary_cross_entropy_with_logits((eu * ei).sum(-1).float(), y)


U_F = torch.randn(N_USERS, 4, generator=gen(5800))
I_F = torch.randn(N_ITEMS, 4, generator=gen(5801))


def click_batch(i, n=256):
    g = gen(5810 + i)
    u = torch.randint(0, N_USERS, (n,), generator=g)
    it = torch.randint(0, N_ITEMS, (n,), generator=g)
    return u, it, ((U_F[u] * I_F[it]).sum(-1) > 0).float()


def step_decay(m):
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=DECAY_AT, gamma=0.01)


def test_fp16_item_table_updates_round_away(tmp_path):
    steps = DECAY_AT + 10
    r = run(TwoTower, step_decay, steps, tmp_path / "run", batch=click_batch)
    rd = r["rounded"]
    if DEBUG:
        print([round(d.get("item_emb.weight", -1), 2) for d in rd])
    # truth: from step 0 >= 80% of the table's elements with a nonzero gradient are unchanged by each step (lr * g
    # ~5e-4 against half an ulp of 4.9e-4 at |w| ~ 1), >= 99% after the decay, while every fp32 parameter's < 10%;
    # the loss finite throughout
    assert all(map(math.isfinite, r["losses"])), r["losses"]
    assert all(d["item_emb.weight"] >= 0.8 for d in rd[:DECAY_AT]), rd
    assert all(d["item_emb.weight"] >= 0.99 for d in rd[DECAY_AT:]), rd
    assert all(v < 0.1 for d in rd for k, v in d.items() if k != "item_emb.weight"), rd
    named(r["rep"], "update_underflow", "item_emb", (0, 1, 2, 3))
    assert r["warns"] == [], r["warns"]
