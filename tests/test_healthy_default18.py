"""Healthy fp16 runs at ampdoctor's DEFAULT watch, eighteenth set: a false-alarm probe of three checks ampdoctor just
gained. `ampdoctor.watch(model, optimizer=opt, scaler=scaler)` and nothing else; none of these runs may give a
warning or an error (info is fine).

A. `underflow` (backward) under a dynamic GradScaler now fires when the loss falls >= 1000x in one step from its usual
   level and >= 90% of the nonzero fp16 gradients into a module are below 2^-14 afterwards. Healthy runs whose loss
   legitimately falls >= 1000x in one step, with the gradients still in fp16's normal range:
    U1 cnn_box_term_off: a CNN trained with a box-regression term in raw pixel units (MSE ~1e4) for a warm-up of 10
       steps, then classification only (the loss falls ~1e4x); init_scale 256;
    U2 lm_sum_to_mean: TinyGPT pretrained with a token-SUM cross-entropy times world_size * accum (16) from an old
       script, then the fine-tuning config's token MEAN from step 10 (falls ~2000x), 202 steps so ampdoctor's
       periodic sample (step 200) lands inside the new regime; init_scale 256;
    U3 easy_subset: a classifier on a mix of well-separated clean clusters and a random-label region; at step 60
       the loader switches to the clean subset the model already solves (loss ~0.7 -> ~1e-5);
    U4 kd_softce_to_kl: a student initialised from a slightly perturbed copy of the teacher; the distillation
       loss is refactored at step 12 from soft-target cross-entropy (-sum p_t log p_s, floor H(p_t) ~ 1.7) to
       F.kl_div (the same gradient, floor 0): the loss falls >= 1000x, the gradients do not change at all;
    U5 consistency_scaled_last: from step 20 a Pi-model consistency term (~1e-5) is scaled and backpropagated after
       the cross-entropy each step: the loss a step's record keeps (the last one scaled) falls ~1e5x.
   Oracle (`Shares`, tensor hooks on every module's output, no ampdoctor): the fall is real (the median of the 8
   losses before the fall step >= 1000x the loss at it, and those 8 within 1000x of the first losses); every step's
   gradient into every module output is fp16 and < 50% of its nonzero values below 2^-14; nothing skipped after
   GradScaler's first search; the loss keeps falling after the fall.
B. "scaled loss never backpropagated" (a node pre-hook on scaler.scale's output, every step). Correct loops that use
   the scaled loss unusually:
    S1 separate_line: `scaled = scaler.scale(loss)` then `scaled.backward()` on its own line;
    S2 docs_two_models: PyTorch's "multiple models, losses and optimizers" recipe: two losses of two models,
       `scaler.scale(loss0).backward(retain_graph=True)`, `scaler.scale(loss1).backward()`, unscale_(opt0), two
       scaler.step, one update;
    S3 scale_list: `scaler.scale([l1, l2])` (GradScaler takes iterables), `torch.autograd.backward(scaled)`;
    S4 grad_penalty: PyTorch's AMP gradient-penalty recipe: `torch.autograd.grad(scaler.scale(loss), params,
       create_graph=True)`, unscaled by hand, `loss + grad_norm` scaled and backpropagated;
    S5 accum4: 4 micro-batches, `scaled = scaler.scale(loss / 4)`, `scaled.backward()` each;
    S6 log_scaled_after_backward: after `scaler.scale(loss).backward()` the loop logs the scaled loss with a second
       `scaler.scale(loss).item()` (a debugging line: its value, never backpropagated, changes nothing);
    S7 autograd_grad_manual: `torch.autograd.grad(scaler.scale(loss), params)` written into `.grad` by hand;
    S8 ensemble: 3 models on one scaler, every member's loss scaled first (`[scaler.scale(l) for l in losses]`),
       then each member's backward, unscale_, clip, scaler.step in turn, one update;
    S9 outlier_guard: `scaled = scaler.scale(loss)`, then a loss-spike guard drops a batch whose loss is 100x the
       running median (step 13, targets in the wrong units): no backward and no step for it.
C. scaling twice (scaler.scale() of a value made from an earlier scaler.scale() output, within 16 autograd nodes).
   Correct loops with two scale() calls per step:
    T1 two_heads: two losses on one trunk each scaled and backpropagated (retain_graph);
    T2 gan: a GAN's D and G losses on one scaler (D step, G step, one update);
    T3 accum_running_sum: 4-way accumulation that keeps an attached running sum of the micro-batch losses;
    T4 detached_for_logging: a loss weight computed from detached scaled values (`scaler.scale(main).detach() /
       scale`) for a balanced auxiliary term, scaled and backpropagated;
    T5 disabled_scaler_grad_penalty: the same gradient-penalty recipe with `GradScaler(enabled=False)` (a bf16 run
       of an fp16-capable script, as `GradScaler(enabled=use_fp16)` is written): scale() returns the loss itself.
   Oracle for B and C: SGD training; the same loop run without any scaler (a pass-through object: scale() returns
   its argument, step() calls optimizer.step()) and no watch ends at the same weights (allclose): the AMP loop
   applied exactly the unscaled gradients (scaling twice or never would be off by the scale); the loss falls (the
   GAN: the generated mean approaches the data's); finite losses, no skipped step at all.

Results (default watch; info findings only on the quiet runs): U1-U5 quiet (falls of 7e3x, 2e3x, 6e4x, 4e5x, 1e5x;
the oracle's worst share of nonzero fp16 gradient values below 2^-14 over all steps and modules: 2% U1, 5% U2, 38% U3
at `out`, 0.4% U4, 0.1% U5); S1-S5, S7, T1-T4 quiet.
Four false alarms when written (strict xfails then, fixed since: the check is judged when the step ends, a loss
whose scaled twin was backpropagated or that a later forward left behind is exempt, a disabled scaler's scale()
scales nothing), each an [error] scaler_misorder (module None, phase scaler):
 - S6 step 0, "scaled loss never backpropagated" at the logging `scaler.scale(loss).item()`;
 - S8 step 0, "never backpropagated" at the ensemble's list of scale() calls: the check runs at the iteration's
   FIRST scaler.step, before the other members' scaled losses were due to be backpropagated;
 - S9 step 13, "never backpropagated" at the dropped batch's scale(): its unused scaled loss is counted into the
   next iteration;
 - T5 step 0, "scaled a loss that scaler.scale() had already scaled" with GradScaler(enabled=False), whose scale()
   returns the loss itself (PyTorch's gradient-penalty recipe in a bf16 run).

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_healthy_default18.py
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import TinyGPT, alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
TINY = 2.0 ** -14
FP16 = dict(device_type="cpu", dtype=torch.float16)


def quiet(w):
    rep = w.report()
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)
    return rep


# ======================================================================================================================
# A. underflow after a 1000x loss fall: oracle and loop
# ======================================================================================================================
def share_below(g):
    a = g.detach().float().abs()
    nz = (a > 0) & torch.isfinite(a)
    n = int(nz.sum())
    return (float((a[nz] < TINY).float().mean()) if n else 0.0), n, g.dtype


class Shares:
    """Per (module, step): (share of the nonzero gradient values into the module's output below 2^-14, count, dtype),
    the worst call of the step."""

    def __init__(self, m):
        self.step, self.seen = 0, {}
        self.hs = [mod.register_forward_hook(self._fwd(n)) for n, mod in m.named_modules()]

    def _fwd(self, n):
        def f(mod, inp, out):
            if torch.is_tensor(out) and out.requires_grad and out.is_floating_point():
                step = self.step

                def h(g):
                    v = share_below(g)
                    old = self.seen.get((n, step))
                    if old is None or v[0] > old[0]:
                        self.seen[(n, step)] = v
                out.register_hook(h)
        return f

    def worst(self, steps):
        vals = [(v[0], n, s, v[2]) for (n, s), v in self.seen.items() if s in steps and v[1] >= 16]
        return max(vals) if vals else (0.0, None, None, None)

    def remove(self):
        for h in self.hs:
            h.remove()


def fall_loop(m, batch, loss_fn, steps, *, lr=1e-3, init_scale=65536.0, call=None):
    """zero_grad -> fp16 autocast forward -> scaler.scale(loss).backward -> unscale_ -> clip 1.0 -> step -> update,
    under the default watch, with the Shares oracle. Returns (watch, shares, losses, skipped)."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    probe = Shares(m)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, skipped = [], []
    for i in range(steps):
        probe.step = i
        opt.zero_grad()
        args = batch(i)
        with torch.autocast(**FP16):
            loss = loss_fn((call or m)(*args), *args)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        s0 = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            skipped.append(i)
        losses.append(loss.item())
    w.close()
    probe.remove()
    return w, probe, losses, skipped


def median(v):
    return sorted(v)[len(v) // 2]


def healthy_fall(probe, losses, skipped, fall, *, max_share=0.5):
    """The fall at `fall` is real (>= 1000x below the median of the 8 losses before, those within 1000x of the first
    ones); gradients in fp16's normal range on every step (< max_share of the nonzero values below 2^-14, fp16);
    no skip after the first 4 steps; finite losses; the loss keeps falling after the fall."""
    assert all(map(math.isfinite, losses)), losses
    before = losses[fall - 8:fall]
    assert median(before) >= 1000 * losses[fall], (before, losses[fall])
    assert median(before) * 1000 >= median(losses[:8]), losses[:8]
    assert not [s for s in skipped if s >= 4], skipped
    worst = probe.worst(range(len(losses)))
    assert worst[0] < max_share and worst[3] in (torch.float16, None), worst
    k = max(3, (len(losses) - fall) // 4)
    assert sum(losses[-k:]) < sum(losses[fall:fall + k]), losses[fall:]
    return worst


# -- U1: a box-regression warm-up term in raw pixel units, then classification only -----------------------------------
BOX_OFF = 10


class BoxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.cls = nn.Linear(8, 5)
        self.box = nn.Linear(8, 4)

    def forward(self, x):
        h = self.f(x)
        return self.cls(h), self.box(h)


def box_batch(i):
    g = gen(20000 + i)
    y = torch.randint(0, 5, (16,), generator=g)
    x = 0.5 * torch.randn(16, 3, 8, 8, generator=g) + (y.float() / 2 - 1).view(16, 1, 1, 1)
    box = 50 + 100 * torch.rand(16, 4, generator=g)          # pixel coordinates on a 224 image
    return x, y, box, i < BOX_OFF


def box_loss(out, x, y, box, warm):
    logits, pbox = out
    loss = F.cross_entropy(logits.float(), y)
    if warm:
        loss = loss + F.mse_loss(pbox.float(), box)
    return loss


def first_arg(m):
    return lambda x, *rest: m(x)


# -- U2: TinyGPT, token-sum CE * 16 (world_size * accum of the pretraining script), then token mean --------------------
LM_SWITCH, LM_B = 10, 8


def lm_batch(i):
    g = gen(21000 + i % 6)
    idx = torch.randint(0, 16, (LM_B, 16), generator=g)      # 16 of 64 tokens used: learnable
    return idx, torch.roll(idx, -1, 1), i < LM_SWITCH


def lm_loss(logits, idx, tgt, old):
    ce = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="sum" if old else "mean")
    return ce * 16 if old else ce


# -- U3: a switch to the clean subset the model already solves ---------------------------------------------------------
EASY_SWITCH = 60
_CENTRES = 3.0 * torch.randn(4, 8, generator=gen(22))


class Clf(nn.Module):
    def __init__(self, d_in=8, c=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.out = nn.Linear(64, c)

    def forward(self, x):
        return self.out(self.body(x))


def easy_batch(i):
    g = gen(23000 + i)
    y = torch.randint(0, 4, (32,), generator=g)
    x = _CENTRES[y] + 0.3 * torch.randn(32, 8, generator=g)
    if i < EASY_SWITCH:                                        # half the batch: a random-label region far away
        n = 16
        x[:n] = 0.3 * torch.randn(n, 8, generator=g) + 12.0
        y[:n] = torch.randint(0, 4, (n,), generator=g)
    return x, y


def ce(out, x, y):
    return F.cross_entropy(out.float(), y)


# -- U4: KD, soft-target cross-entropy refactored to KL (same gradient) ------------------------------------------------
KD_SWITCH = 12
_TEACHER = Clf(16, 10)
with torch.no_grad():
    for p in _TEACHER.parameters():
        p.copy_(torch.randn(p.shape, generator=gen(24)) * (0.6 / math.sqrt(p.shape[-1])))


def student():
    s = copy.deepcopy(_TEACHER)
    with torch.no_grad():
        for p in s.parameters():
            p.add_(torch.randn(p.shape, generator=gen(25)) * 0.01 * p.abs().mean())
    return s


def kd_batch(i):
    x = torch.randn(64, 16, generator=gen(26000 + i))
    with torch.no_grad():
        p_t = torch.softmax(_TEACHER(x), -1)
    return x, p_t, i < KD_SWITCH


def kd_loss(out, x, p_t, old):
    logp = F.log_softmax(out.float(), -1)
    if old:
        return -(p_t * logp).sum(-1).mean()                   # soft-target cross-entropy
    return F.kl_div(logp, p_t, reduction="batchmean")         # the refactor: the same gradient


# -- U5: a consistency term switched on at step 20, scaled and backpropagated after the main loss ----------------------
CONS_ON, CONS_STEPS = 20, 50


def consistency_run():
    """zero_grad -> CE: scale().backward(retain_graph) -> from CONS_ON a Pi-model consistency term (the MSE between
    the logits and those of the same model on the input plus 1% noise, no grad): scale().backward() -> unscale_ ->
    clip -> step -> update. The loss scaled LAST falls from the CE (~0.5) to the consistency term (~1e-5) at
    CONS_ON."""
    torch.manual_seed(0)
    m = Clf()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    probe = Shares(m)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    last, ce_losses, skipped = [], [], []
    for i in range(CONS_STEPS):
        probe.step = i
        opt.zero_grad()
        x, y = easy_batch(100 + i)
        with torch.autocast(**FP16):
            logits = m(x)
            loss = F.cross_entropy(logits.float(), y)
        sc.scale(loss).backward(retain_graph=i >= CONS_ON)
        last_loss = loss
        if i >= CONS_ON:
            with torch.no_grad(), torch.autocast(**FP16):
                t_logits = m(x + 0.01 * torch.randn(x.shape, generator=gen(40000 + i))).float()
            with torch.autocast(**FP16):
                cons = F.mse_loss(logits.float(), t_logits)
            sc.scale(cons).backward()
            last_loss = cons
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        s0 = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            skipped.append(i)
        last.append(last_loss.item())
        ce_losses.append(loss.item())
    w.close()
    probe.remove()
    return w, probe, last, ce_losses, skipped


# ----------------------------------------------------------------------------------------------------------------------
def test_U1_cnn_box_term_switched_off():
    torch.manual_seed(0)
    m = BoxNet()
    w, probe, ls, sk = fall_loop(m, box_batch, box_loss, 40, call=first_arg(m), lr=3e-3, init_scale=256.0)
    healthy_fall(probe, ls, sk, BOX_OFF)
    quiet(w)


def test_U2_lm_token_sum_to_token_mean():
    torch.manual_seed(0)
    m = TinyGPT()
    w, probe, ls, sk = fall_loop(m, lm_batch, lm_loss, 202, call=lambda idx, *r: m(idx),
                                 init_scale=256.0)
    healthy_fall(probe, ls, sk, LM_SWITCH)
    # ampdoctor's periodic sample (step 200) lies in the new regime: within 1000x of the fall's level
    assert ls[LM_SWITCH] / 1000 < ls[200] < ls[LM_SWITCH] * 1000, (ls[LM_SWITCH], ls[200])
    quiet(w)


def test_U3_switch_to_an_easy_subset():
    torch.manual_seed(0)
    m = Clf()
    w, probe, ls, sk = fall_loop(m, easy_batch, ce, 90, call=first_arg(m), lr=1e-2)
    healthy_fall(probe, ls, sk, EASY_SWITCH)
    quiet(w)


def test_U4_kd_soft_cross_entropy_refactored_to_kl():
    torch.manual_seed(0)
    m = student()
    w, probe, ls, sk = fall_loop(m, kd_batch, kd_loss, 40, call=first_arg(m))
    healthy_fall(probe, ls, sk, KD_SWITCH)
    quiet(w)


# ======================================================================================================================
# B and C: scaled losses used unusually but correctly; the oracle is the same loop without any loss scaling
# ======================================================================================================================
class NoScaler:
    """The reference loop's stand-in for GradScaler: no loss scaling at all (scale() returns its argument)."""

    def scale(self, x):
        return x

    def unscale_(self, opt):
        pass

    def step(self, opt, *a, **k):
        return opt.step(*a, **k)

    def update(self, *a):
        pass

    def get_scale(self):
        return 1.0


def pair(make, body, steps, *, enabled=True, init_scale=1024.0):
    """`body(i, m, opts, sc)` (one iteration; returns its loss, a float) for `steps` steps, twice from the same seed:
    under the default watch with GradScaler("cpu", init_scale, enabled) (watched optimizer opts[0]), and with
    NoScaler and no watch. Asserts the two end at the same weights (the AMP loop applied the unscaled gradients)
    and that the scaler skipped nothing; returns (watch, model, losses)."""
    out = []
    for ref in (False, True):
        torch.manual_seed(0)
        m, opts = make()
        sc = NoScaler() if ref else torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=enabled)
        w = None if ref else ampdoctor.watch(m, optimizer=opts[0], scaler=sc)
        losses, skipped = [], []
        for i in range(steps):
            s0 = sc.get_scale()
            losses.append(body(i, m, opts, sc))
            if sc.get_scale() < s0:
                skipped.append(i)
        if w is not None:
            w.close()
        assert not skipped and all(map(math.isfinite, losses)), (skipped, losses)
        out.append((w, m, losses))
    (w, m, losses), (_, m_ref, _) = out
    for (n, p), q in zip(m.named_parameters(), m_ref.parameters()):
        # (fp16 rounds the reference's unscaled small gradients differently: ~1e-4 apart after 40 steps; a loss
        # scaled twice or never would put the updates 1024x off)
        assert torch.allclose(p, q, rtol=1e-2, atol=2e-3), (n, float((p - q).abs().max()))
    return w, m, losses


def falls(losses, factor=0.5):
    k = max(3, len(losses) // 6)
    assert sum(losses[-k:]) < factor * sum(losses[:k]), losses


_W = torch.randn(8, 1, generator=gen(31)) * 0.5


def reg_batch(i):
    x = torch.randn(16, 8, generator=gen(32000 + i % 8))
    return x, x @ _W


def cls_target(x):
    return (x[:, 0] + x[:, 1] > 0).long()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        self.aux = nn.Linear(32, 2)

    def forward(self, x):
        return self.head(self.trunk(x))


def net_sgd(lr=0.05):
    def make():
        m = Net()
        return m, [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)]
    return make


def finish(m, opt, sc, clip=True):
    sc.unscale_(opt)
    if clip:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
    sc.step(opt)
    sc.update()


# -- B. the "never backpropagated" check -------------------------------------------------------------------------------
def s1_separate_line(i, m, opts, sc):
    opt = opts[0]
    opt.zero_grad()
    x, y = reg_batch(i)
    with torch.autocast(**FP16):
        loss = F.mse_loss(m(x).float(), y)
    scaled = sc.scale(loss)
    scaled.backward()
    finish(m, opt, sc)
    return loss.item()


class TwoModels(nn.Module):
    def __init__(self):
        super().__init__()
        self.model0 = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.model1 = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def two_models():
    m = TwoModels()
    return m, [torch.optim.SGD(m.model0.parameters(), lr=0.003, momentum=0.9),
               torch.optim.SGD(m.model1.parameters(), lr=0.003, momentum=0.9)]


def s2_docs_two_models(i, m, opts, sc):
    """https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-multiple-models-losses-and-optimizers"""
    opt0, opt1 = opts
    opt0.zero_grad()
    opt1.zero_grad()
    x, y = reg_batch(i)
    with torch.autocast(**FP16):
        output0 = m.model0(x)
        output1 = m.model1(x)
        loss0 = F.mse_loss((2 * output0 + 3 * output1).float(), y)
        loss1 = F.mse_loss((3 * output0 - 5 * output1).float(), y)
    sc.scale(loss0).backward(retain_graph=True)
    sc.scale(loss1).backward()
    sc.unscale_(opt0)
    torch.nn.utils.clip_grad_norm_(m.model0.parameters(), 5.0)
    sc.step(opt0)
    sc.step(opt1)
    sc.update()
    return loss0.item() + loss1.item()


def s3_scale_list(i, m, opts, sc):
    opt = opts[0]
    opt.zero_grad()
    x, y = reg_batch(i)
    with torch.autocast(**FP16):
        h = m.trunk(x)
        l_reg = F.mse_loss(m.head(h).float(), y)
        l_cls = F.cross_entropy(m.aux(h).float(), cls_target(x))
    scaled = sc.scale([l_reg, l_cls])                        # GradScaler scales an iterable of tensors
    torch.autograd.backward(scaled)
    finish(m, opt, sc)
    return l_reg.item() + l_cls.item()


def _grad_penalty(i, m, opts, sc, autocast: dict):
    opt = opts[0]
    opt.zero_grad()
    x, y = reg_batch(i)
    params = [p for n, p in m.named_parameters() if not n.startswith("aux")]
    with torch.autocast(**autocast):
        loss = F.mse_loss(m(x).float(), y)
    scaled_grad_params = torch.autograd.grad(outputs=sc.scale(loss), inputs=params, create_graph=True)
    inv_scale = 1. / sc.get_scale()
    grad_params = [p * inv_scale for p in scaled_grad_params]
    with torch.autocast(**autocast):
        grad_norm = 0
        for grad in grad_params:
            grad_norm += grad.pow(2).sum()
        grad_norm = grad_norm.sqrt()
        loss = loss + 0.1 * grad_norm
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    return loss.item()


def s4_grad_penalty(i, m, opts, sc):
    """https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-penalty"""
    return _grad_penalty(i, m, opts, sc, FP16)


def s5_accum4(i, m, opts, sc):
    opt = opts[0]
    opt.zero_grad()
    tot = 0.0
    for k in range(4):
        x, y = reg_batch(4 * i + k)
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y) / 4
        scaled = sc.scale(loss)
        scaled.backward()
        tot += loss.item()
    finish(m, opt, sc)
    return tot


LOG = []


def s6_log_scaled_loss(i, m, opts, sc):
    opt = opts[0]
    opt.zero_grad()
    x, y = reg_batch(i)
    with torch.autocast(**FP16):
        loss = F.mse_loss(m(x).float(), y)
    sc.scale(loss).backward()
    LOG.append(sc.scale(loss).item())                         # debugging: how large is the scaled loss?
    finish(m, opt, sc)
    return loss.item()


def s7_autograd_grad_manual(i, m, opts, sc):
    """Gradients by torch.autograd.grad of the scaled loss, written into .grad by hand (a functional-style loop)."""
    opt = opts[0]
    opt.zero_grad(set_to_none=True)
    x, y = reg_batch(i)
    params = [p for n, p in m.named_parameters() if not n.startswith("aux")]
    with torch.autocast(**FP16):
        loss = F.mse_loss(m(x).float(), y)
    for p, g in zip(params, torch.autograd.grad(sc.scale(loss), params)):
        p.grad = g
    finish(m, opt, sc)
    return loss.item()


class Ensemble(nn.Module):
    def __init__(self, k=3):
        super().__init__()
        self.members = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)) for _ in range(k))


def ensemble():
    m = Ensemble()
    return m, [torch.optim.SGD(e.parameters(), lr=0.05, momentum=0.9) for e in m.members]


def s8_ensemble(i, m, opts, sc):
    """An ensemble on one GradScaler: every member's loss scaled first, then each member's backward and step in
    turn, one update (each member's graph and optimizer are its own)."""
    x, y = reg_batch(i)
    for opt in opts:
        opt.zero_grad()
    with torch.autocast(**FP16):
        losses = [F.mse_loss(e(x).float(), y) for e in m.members]
    scaled = [sc.scale(loss) for loss in losses]
    for s, opt, e in zip(scaled, opts, m.members):
        s.backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(e.parameters(), 5.0)
        sc.step(opt)
    sc.update()
    return sum(loss.item() for loss in losses)


OUTLIER = 13
GUARD = {}


def s9_outlier_guard(i, m, opts, sc):
    """A loss-spike guard: a batch whose loss is 100x the running median is dropped (no backward, no step); the
    batch at OUTLIER has its targets in the wrong units (x1000)."""
    opt = opts[0]
    hist = GUARD.setdefault(id(m), [])
    opt.zero_grad()
    x, y = reg_batch(i)
    if i == OUTLIER:
        y = 1000 * y
    with torch.autocast(**FP16):
        loss = F.mse_loss(m(x).float(), y)
    scaled = sc.scale(loss)
    if hist and loss.item() > 100 * median(hist[-10:]):
        return median(hist[-10:])                              # dropped: nothing backpropagated, no step
    hist.append(loss.item())
    scaled.backward()
    finish(m, opt, sc)
    return loss.item()


@pytest.mark.parametrize("body", [s1_separate_line, s3_scale_list, s4_grad_penalty, s5_accum4, s7_autograd_grad_manual],
                         ids=lambda f: f.__name__)
def test_B_scaled_loss_used_unusually(body):
    w, m, losses = pair(net_sgd(), body, 40)
    falls(losses)
    quiet(w)


def test_B_docs_two_models_two_optimizers():
    w, m, losses = pair(two_models, s2_docs_two_models, 40)
    falls(losses)
    quiet(w)


def test_B_ensemble_scaled_first_then_backward_and_step_per_member():
    w, m, losses = pair(ensemble, s8_ensemble, 40)
    falls(losses)
    quiet(w)


def test_B_outlier_batch_dropped_after_scale():
    GUARD.clear()
    w, m, losses = pair(net_sgd(), s9_outlier_guard, 40)
    falls(losses)
    assert all(len(h) == 39 for h in GUARD.values()), {k: len(h) for k, h in GUARD.items()}   # one batch dropped
    quiet(w)


def test_B_scaled_loss_logged_by_a_second_scale_call():
    LOG.clear()
    w, m, losses = pair(net_sgd(), s6_log_scaled_loss, 40)
    falls(losses)
    assert LOG[0] == 1024.0 * losses[0]                        # (the logged value: the scaled loss, nothing else)
    quiet(w)


# -- C. scaling twice ----------------------------------------------------------------------------------------------
def t1_two_heads(i, m, opts, sc):
    opt = opts[0]
    opt.zero_grad()
    x, y = reg_batch(i)
    with torch.autocast(**FP16):
        h = m.trunk(x)
        l_reg = F.mse_loss(m.head(h).float(), y)
        l_cls = F.cross_entropy(m.aux(h).float(), cls_target(x))
    sc.scale(l_reg).backward(retain_graph=True)
    sc.scale(0.5 * l_cls).backward()
    finish(m, opt, sc)
    return l_reg.item() + l_cls.item()


def t3_accum_running_sum(i, m, opts, sc):
    opt = opts[0]
    opt.zero_grad()
    running = 0
    for k in range(4):
        x, y = reg_batch(4 * i + k)
        with torch.autocast(**FP16):
            loss = F.mse_loss(m(x).float(), y) / 4
        sc.scale(loss).backward()
        running = running + loss                              # attached: only read for the log
    finish(m, opt, sc)
    return running.item()


def t4_detached_for_logging(i, m, opts, sc):
    """A balanced auxiliary term whose weight comes from detached scaled values (the log's unscaled main loss)."""
    opt = opts[0]
    opt.zero_grad()
    x, y = reg_batch(i)
    with torch.autocast(**FP16):
        h = m.trunk(x)
        l_reg = F.mse_loss(m.head(h).float(), y)
        l_cls = F.cross_entropy(m.aux(h).float(), cls_target(x))
    scaled = sc.scale(l_reg)
    scaled.backward(retain_graph=True)
    main_for_log = scaled.detach() / sc.get_scale()
    weight = 0.5 * main_for_log / (l_cls.detach() + 1e-3)
    sc.scale(weight * l_cls).backward()
    finish(m, opt, sc)
    return l_reg.item() + l_cls.item()


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.D = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))


REAL_MEAN = torch.tensor([2.0, -1.0])


def gan():
    m = GAN()
    return m, [torch.optim.SGD(m.D.parameters(), lr=0.05), torch.optim.SGD(m.G.parameters(), lr=0.02)]


def t2_gan(i, m, opts, sc):
    opt_d, opt_g = opts
    g = gen(33000 + i)
    real = REAL_MEAN + 0.3 * torch.randn(32, 2, generator=g)
    z = torch.randn(32, 4, generator=g)
    opt_d.zero_grad()
    with torch.autocast(**FP16):
        fake = m.G(z)
        d_real, d_fake = m.D(real).float(), m.D(fake.detach()).float()
        d_loss = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + \
            F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
    sc.scale(d_loss).backward()
    sc.step(opt_d)
    opt_g.zero_grad()
    with torch.autocast(**FP16):
        d_gen = m.D(fake).float()
        g_loss = F.binary_cross_entropy_with_logits(d_gen, torch.ones_like(d_gen))
    sc.scale(g_loss).backward()
    sc.step(opt_g)
    sc.update()
    return float((fake.detach().float().mean(0) - REAL_MEAN).norm())    # how far the generated mean is


@pytest.mark.parametrize("body", [t1_two_heads, t3_accum_running_sum, t4_detached_for_logging],
                         ids=lambda f: f.__name__)
def test_C_two_scale_calls_per_step(body):
    w, m, losses = pair(net_sgd(), body, 40)
    falls(losses)
    quiet(w)


def test_C_gan_d_and_g_on_one_scaler():
    w, m, dist = pair(gan, t2_gan, 60)
    falls(dist, 0.3)                                          # the generated mean approaches the data's
    quiet(w)


def s4_bf16(i, m, opts, sc):
    """s4's gradient-penalty recipe under bf16 autocast (the scaler disabled in the reference's stead)."""
    return _grad_penalty(i, m, opts, sc, {"device_type": "cpu", "dtype": torch.bfloat16})


def test_C_disabled_scaler_grad_penalty_bf16():
    """`GradScaler(enabled=False)`: scale() returns the loss itself, so the second scale() gets `loss + grad_norm`,
    made from the first's "output" (the loss); nothing is scaled at all."""
    w, m, losses = pair(net_sgd(), s4_bf16, 40, enabled=False)
    falls(losses)
    quiet(w)


def test_U5_consistency_term_scaled_last():
    w, probe, last, ce_losses, sk = consistency_run()
    # the fall is in the loss scaled last (the one a step's record keeps); the gradients stay in range
    worst = probe.worst(range(CONS_STEPS))
    assert median(last[CONS_ON - 8:CONS_ON]) >= 1000 * last[CONS_ON] > 0, last
    assert worst[0] < 0.5 and worst[3] == torch.float16 and not [s for s in sk if s >= 4], (worst, sk)
    assert sum(ce_losses[-5:]) < 0.5 * sum(ce_losses[:5]), ce_losses
    quiet(w)
