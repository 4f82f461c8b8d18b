"""fp16 failures made IN THE LOSS FUNCTION, in both places a loss lives: as an nn.Module inside the watched model
(`WithLoss(net, loss)`, forward(x..., target) -> the scalar loss; CONTRACT.md: the producer is that submodule,
named "loss") and as user code after `out = model(x)` outside it (CONTRACT.md/README: module null, "(run)"). Not a
repeat of test_outside_loss_unseen.py: other loss kinds, and the loss-as-submodule half is new.

Loop: probe_harness.probe_run (AdamW, GradScaler("cpu") at its defaults, CPU fp16 autocast, unscale_ -> clip ->
step -> update, run_dir = tmp_path). Oracle for every failure (a failing oracle is a plain failure, never an xfail):
the loss is first non-finite at the bad step; the Producer's first forward producer is `loss` (inside) or none
(outside: every model output finite); the bad step re-run from the weights it ran with (snap_at) gives a finite
model/net output, a non-finite fp16 loss, and a finite loss from the same output in fp32 (fp16's doing). Report
check: among the first three findings a warning/error of the accepted rules at the loss module ("loss") or module
None, at the bad step, phase forward (or null); no overflow/nan_origin error at any other named layer at that step;
outside, the text must not send the user to the data ("target held", "inputs held", ...). A wrong report raises
WrongAnswer (strict xfail via `wrong`).

Failures (inside = loss submodule "loss"; outside = module None):
 1. infonce_log0 (inside)  cosine InfoNCE, tau 0.01, softmax by hand (max subtracted) then log(p_pos): at step 4
                          row 0's positive is another item, exp(-gap/0.01) flushes to 0 in fp16, log(0) = -inf.
 2. focal_sat    (inside)  focal loss gamma 2 from an fp16 sigmoid: inputs x60 at step 5 saturate p to 1 / 0,
                          log(0) = -inf, 0 * -inf = NaN.
 3. dice_eps     (inside)  soft Dice over valid pixels, eps 1e-8 (0 in fp16): a fully padded image at step 3 gives
                          0 / (0 + 0 + 0) = NaN (fp32: 0 / 1e-8 = 0). eps_underflow accepted.
 4. kl_logq      (inside)  distillation KL with torch.log(torch.softmax(z)) (fp16 on CPU autocast): inputs x40 at
                          step 6 flush student probabilities to 0, log(0) = -inf, the loss inf.
 5. poisson_eps  (outside) hand-written Poisson NLL `rate - y * log(rate + 1e-8)`, rate = softplus(out) in fp16:
                          inputs x60 at step 4 give rate 0, the eps is 0 in fp16, log(0) -> the loss inf.
                          (F.poisson_nll_loss itself runs in fp32 under CPU autocast: it is the healthy twin.)
 6. triplet_sq   (outside) triplet margin loss with squared fp16 distances: embeddings x400 at step 5 make both
                          sums of squares overflow, inf - inf = NaN.
 7. gauss_nll    (outside) hand-written Gaussian NLL, var = exp(logvar) in fp16: inputs x60 at step 3 underflow
                          var, (y - mu)^2 / var -> the loss inf.
 8. logcosh      (outside) log-cosh regression on fp16 residuals (target cast to the output's dtype): targets
                          shifted by 20 at step 6, cosh(20) overflows fp16, the loss inf.
 9. focal_pow_backward_inside  focal gamma 0.5 as the "loss" submodule; confident correct logits (inputs x30) at
                          step 5 make pt exactly 1 in fp16; forward finite, PowBackward gives inf / NaN at the
                          net's output at every loss scale (fp32: finite). Want nan_origin/overflow error at "loss",
                          step 5, phase backward (the outside twin of this is an xfail in test_outside_loss_unseen).
Healthy twins on the same data, each run with and without the watch (losses and weights bitwise identical; no
producer; no warning/error; no skip but the scaler's own search at the first steps or the bad step and the one after
it, which the unwatched run skips too): infonce_stable (F.cross_entropy on fp32 normalized embeddings), focal_stable
(BCE-with-logits form in fp32), kl_stable (F.kl_div(log_softmax(z.float()))), poisson_fp32 (F.poisson_nll_loss on an
fp32 softplus rate), triplet_fp32 (the same triplet loss on out.float()).

Result when written: 14 pass, 0 xfail (stable over two runs; whole file ~3 s). Top findings:
 1, 2, 4  `[error] overflow at loss aten::log step <bad>: aten::log in `loss` hit its singular point (an input is
          0 / -1) and produced -inf` (fix: eps representable in fp16, or run `loss` in fp32).
 3        `[error] eps_underflow at loss aten::add step 3: ... uses eps 1e-08, which rounds to 0 in float16`.
 5, 7, 8  `[error] overflow at (run) step <bad>: The loss became inf outside the watched model (in the loss
          computation) while the model's outputs were finite.`; 6 the same as nan_origin. (In 5 the precise cause is
          the vanished eps; outside the model ampdoctor names no op or eps, but its fix, the loss in fp32, is right.)
 9        `[error] overflow at loss aten::pow step 5: the backward of PowBackward0 in `loss` (aten::pow) produced
          +inf from finite gradients ... No loss scale makes it finite`.
 Twins: only info findings (the scaler's backoff at the scaled-up steps, skipped_steps at a normal rate).
No wrong answer found.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import Producer, WrongAnswer, finite, named_top3, probe_run, wrong
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

AC = dict(device_type="cpu", dtype=torch.float16)


def rn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(5200 + seed))


def rnd(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(5300 + seed))


# ------------------------------------------------------------------------------------------------------- networks

class Net(nn.Module):
    def __init__(self, k, d_in=8, hid=32):
        super().__init__()
        self.body, self.head = nn.Linear(d_in, hid), nn.Linear(hid, k)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class Siamese(nn.Module):
    """One encoder applied to every view; returns a tuple of embeddings."""

    def __init__(self, k=16):
        super().__init__()
        self.enc = Net(k)

    def forward(self, *views):
        return tuple(self.enc(v) for v in views)


class WithLoss(nn.Module):
    """The loss as a submodule of the watched model: forward(inputs..., target) -> the scalar loss."""

    def __init__(self, net, loss):
        super().__init__()
        self.net, self.loss = net, loss

    def forward(self, *args):
        *xs, y = args
        out = self.net(*xs)
        return self.loss(out, y)


# ------------------------------------------------------------------------------------------------- loss modules

TAU = 0.01


class InfoNCE(nn.Module):
    """Cosine InfoNCE at temperature 0.01, softmax by hand (max subtracted), then log of the positive's probability."""

    def forward(self, out, y):
        za, zb = out
        za = za / za.norm(dim=-1, keepdim=True)
        zb = zb / zb.norm(dim=-1, keepdim=True)
        s = za @ zb.T / TAU
        e = (s - s.amax(-1, keepdim=True)).exp()
        p = e / e.sum(-1, keepdim=True)
        return -p.diagonal().log().mean()


class InfoNCEStable(nn.Module):
    def forward(self, out, y):
        za, zb = (F.normalize(o.float(), dim=-1) for o in out)
        return F.cross_entropy(za @ zb.T / TAU, torch.arange(za.shape[0]))


class Focal(nn.Module):
    """Binary focal loss (gamma 2) written from the fp16 sigmoid."""

    def forward(self, z, y):
        p = torch.sigmoid(z[:, 0])
        return -(y * (1 - p) ** 2 * p.log() + (1 - y) * p ** 2 * (1 - p).log()).mean()


class FocalStable(nn.Module):
    def forward(self, z, y):
        bce = F.binary_cross_entropy_with_logits(z[:, 0].float(), y, reduction="none")
        return ((1 - torch.exp(-bce)) ** 2 * bce).mean()


class FocalPow(nn.Module):
    """Focal loss with gamma 0.5: (1 - pt) ** 0.5 has an infinite derivative at pt == 1 (fp16 sigmoid saturated)."""

    def forward(self, z, y):
        p = torch.sigmoid(z[:, 0])
        pt = torch.where(y == 1, p, 1 - p)
        return (-(1 - pt) ** 0.5 * pt.log()).mean()


class Dice(nn.Module):
    """Soft Dice over the valid (unpadded) pixels, eps 1e-8 in the denominator (0 in fp16)."""

    def forward(self, z, y):
        t, valid = (v.to(z.dtype) for v in y)
        p = torch.sigmoid(z) * valid
        t = t * valid
        d = 1 - 2 * (p * t).sum(-1) / (p.sum(-1) + t.sum(-1) + 1e-8)
        return d.mean()


class KLDistill(nn.Module):
    """KL(teacher || student) with the student's probabilities from torch.softmax (fp16 on CPU autocast), then log."""

    def forward(self, z, t):
        q = torch.softmax(z, -1)
        return (t * (t.log() - torch.log(q))).sum(-1).mean()


class KLStable(nn.Module):
    def forward(self, z, t):
        return F.kl_div(F.log_softmax(z.float(), -1), t, reduction="batchmean")


# ----------------------------------------------------------------------------------------------- outside losses
# (out, y) as probe_run calls them, the model's output under fp16 autocast, outside the model.

def poisson_eps(out, y):
    rate = F.softplus(out)
    return (rate - y * torch.log(rate + 1e-8)).mean()


def poisson_twin(out, y):
    return F.poisson_nll_loss(F.softplus(out.float()), y, log_input=False)


def triplet_sq(out, y):
    a, p, n = out
    return torch.relu(((a - p) ** 2).sum(-1) - ((a - n) ** 2).sum(-1) + 1.0).mean()


def triplet_twin(out, y):
    a, p, n = (o.float() for o in out)
    return torch.relu(((a - p) ** 2).sum(-1) - ((a - n) ** 2).sum(-1) + 1.0).mean()


def gauss_nll(out, y):
    mu, logvar = out[:, 0], out[:, 1]
    var = logvar.exp()
    return 0.5 * (var.log() + (y - mu) ** 2 / var).mean()


def logcosh(out, y):
    return torch.log(torch.cosh(out[:, 0] - y.to(out.dtype))).mean()


# ------------------------------------------------------------------------------------------------------ batches
# batch(i) -> (args, y) for probe_run; `inside` cases put y into the args (the model computes the loss).

W = rn(8, 4, seed=999)


def scaled(i, bad, s):
    return s if i >= bad else 1.0


def b_pair(bad):
    """Two views of the same items; from `bad` on, row 0's second view is another item (x1[1]'s twin sits in its
    row), so row 0's positive is far below its best match: a probability gap of exp(-gap / 0.01)."""
    def b(i):
        x1 = rn(16, 8, seed=i % 3)
        x2 = x1 + 0.05 * rn(16, 8, seed=10 + i % 3)
        if i >= bad:
            x2[0] = rn(8, seed=20)
            x2[1] = x1[0]
        return (x1, x2), None
    return b


def b_bin(bad, s=60.0):
    def b(i):
        x = rn(64, 8, seed=i % 3) * scaled(i, bad, s)
        return (x,), (rnd(64, seed=i % 3) < 0.5).float()
    return b


HOLD = {}


def b_confident(bad, s=30.0):
    """From `bad` on, inputs x30 with the labels the model (HOLD["m"]'s net, the weights this step runs with)
    already gets right: confident and correct."""
    def b(i):
        x = rn(64, 8, seed=i % 3)
        y = (rnd(64, seed=i % 3) < 0.5).float()
        if i >= bad:
            x = x * s
            with torch.no_grad():
                y = (HOLD["m"].net(x)[:, 0] > 0).float()
        return (x,), y
    return b


def b_mask(bad):
    def b(i):
        x = rn(8, 8, seed=i % 3)
        t = (rnd(8, 4, seed=30 + i % 3) < 0.5).float()
        valid = torch.ones(8, 4)
        if i >= bad:
            valid[0] = 0.0      # a fully padded image
        return (x,), (t, valid)
    return b


def b_teacher(bad, s=40.0):
    def b(i):
        x = rn(32, 8, seed=i % 3) * scaled(i, bad, s)
        return (x,), torch.softmax(rn(32, 10, seed=40 + i % 3), -1)
    return b


def b_counts(bad, s=60.0):
    def b(i):
        x = rn(64, 8, seed=i % 3)
        y = torch.poisson(torch.full((64, 4), 2.0), generator=torch.Generator().manual_seed(50 + i % 3))
        return (x * scaled(i, bad, s),), y
    return b


def b_triplet(bad, s=400.0):
    def b(i):
        a = rn(32, 8, seed=i % 3)
        p = a + (0.1 if i < bad else 1.0) * rn(32, 8, seed=60 + i % 3)
        n = rn(32, 8, seed=70 + i % 3)
        k = scaled(i, bad, s)
        return (a * k, p * k, n * k), None
    return b


def b_reg(bad, shift=20.0, s=1.0):
    def b(i):
        x = rn(64, 8, seed=i % 3)
        y = x @ W[:, :1] * 0.5
        return (x * scaled(i, bad, s),), y[:, 0] + (shift if i >= bad else 0.0)
    return b


def b_gauss(bad, s=60.0):
    def b(i):
        x = rn(64, 8, seed=i % 3)
        return (x * scaled(i, bad, s),), (x @ W[:, :1])[:, 0] * 0.5
    return b


# ------------------------------------------------------------------------------------------------------- cases

def inside(batch):
    """probe_run's batch for a model that computes its loss: the target goes in as the last argument."""
    def b(i):
        args, y = batch(i)
        return (*args, y), None
    return b


def own_loss(out, y):
    return out


# name: (model factory, batch(bad), loss_fn for outside cases or None (inside), bad step, accepted rules)
CASES = {
    # the loss is a submodule of the watched model ("loss")
    "infonce_log0": (lambda: WithLoss(Siamese(), InfoNCE()), b_pair, None, 4, ("overflow", "underflow")),
    "focal_sat": (lambda: WithLoss(Net(1), Focal()), b_bin, None, 5, ("nan_origin", "overflow", "underflow")),
    "dice_eps": (lambda: WithLoss(Net(4), Dice()), b_mask, None, 3,
                 ("eps_underflow", "nan_origin", "underflow")),
    "kl_logq": (lambda: WithLoss(Net(10), KLDistill()), b_teacher, None, 6, ("overflow", "underflow")),
    # the loss is computed by the loop, outside the watched model (module None)
    "poisson_eps": (lambda: Net(4), b_counts, poisson_eps, 4, ("eps_underflow", "overflow", "underflow")),
    "triplet_sq": (lambda: Siamese(), b_triplet, triplet_sq, 5, ("overflow", "nan_origin")),
    "gauss_nll": (lambda: Net(2), b_gauss, gauss_nll, 3, ("nan_origin", "overflow", "underflow")),
    "logcosh": (lambda: Net(1), lambda bad: b_reg(bad), logcosh, 6, ("overflow",)),
}

XFAIL = {}


def build(factory):
    torch.manual_seed(0)
    return factory()


def run_case(name, tmp_path, watch=True):
    factory, mk, loss_fn, bad, _ = CASES[name]
    m = build(factory)
    batch = mk(bad) if loss_fn is not None else inside(mk(bad))
    r = probe_run(m, batch, loss_fn or own_loss, bad + 2, str(tmp_path / "run"), snap_at=bad, watch=watch)
    return m, r


def replay_bad(name, r):
    """The bad step's forward re-run from the weights it ran with: the loss input (model output) in fp16, the loss
    value in fp16, and the same loss on the same output in fp32."""
    factory, mk, loss_fn, bad, _ = CASES[name]
    m = build(factory)
    m.load_state_dict(r["sd"])
    args, y = mk(bad)(bad)
    net = m.net if loss_fn is None else m
    lf = m.loss if loss_fn is None else loss_fn
    with torch.no_grad():
        with torch.autocast(**AC):
            out = net(*args)
            l16 = lf(out, y)
        outs = out if isinstance(out, tuple) else (out,)
        f32 = tuple(o.float() for o in outs)
        l32 = lf(f32 if isinstance(out, tuple) else f32[0], y)
    return out, l16, l32


def check_report(rep, name):
    factory, mk, loss_fn, bad, rules = CASES[name]
    where = "loss" if loss_fn is None else None
    f = named_top3(rep, rules, where, bad)
    top = rep.findings[:3]
    blamed = [x.one_line() for x in top if x.step == bad and x.rule in ("overflow", "nan_origin")
              and x.severity == "error" and x.module not in (where, "", None)]
    if blamed:
        raise WrongAnswer(f"a layer with finite outputs blamed: {blamed}; top 3: {lines(rep)[:3]}")
    if f.phase not in ("forward", None):
        raise WrongAnswer(f"wrong phase: {f.one_line()} ({f.phase})")
    text = (f.message + " " + (f.fix or "")).lower()
    if where is None:
        # the model's outputs were finite: a finding must not send the user into the model or the data
        for bad_claim in ("target held", "targets held", "input held", "inputs held", "in the data"):
            if bad_claim in text:
                raise WrongAnswer(f"misleading text ({bad_claim!r}): {f.one_line()}")
    return f


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_loss_fails(name, tmp_path):
    factory, mk, loss_fn, bad, rules = CASES[name]
    m, r = run_case(name, tmp_path)
    # the oracle: the loss is first non-finite at `bad`, finite before it
    assert r["bad_loss"] and r["bad_loss"][0] == bad, r["losses"]
    if loss_fn is None:
        # the loss module is the first forward producer (its inputs, the net's output and the target, finite)
        assert r["first"] == ("loss", bad), r["first"]
    else:
        assert r["first"] is None, r["first"]
    out, l16, l32 = replay_bad(name, r)
    assert finite(out), name                        # the model's (or the net's) output is finite
    assert not torch.isfinite(l16), l16             # the replay fails as the run did
    assert torch.isfinite(l32), l32                 # fp16's doing: the same loss on the same output in fp32 is fine
    f = check_report(r["rep"], name)
    print(name, "->", f.one_line(), "|", f.fix)


TWINS = {
    # name: (model factory, batch(bad), loss_fn or None (inside), bad step) -- the same data as the failing case
    "infonce_stable": (lambda: WithLoss(Siamese(), InfoNCEStable()), b_pair, None, 4),
    "focal_stable": (lambda: WithLoss(Net(1), FocalStable()), b_bin, None, 5),
    "kl_stable": (lambda: WithLoss(Net(10), KLStable()), b_teacher, None, 6),
    "poisson_fp32": (lambda: Net(4), b_counts, poisson_twin, 4),
    "triplet_fp32": (lambda: Siamese(), b_triplet, triplet_twin, 5),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_stable_twin(name, tmp_path):
    factory, mk, loss_fn, bad = TWINS[name]
    runs = []
    for watch in (True, False):
        m = build(factory)
        batch = mk(bad) if loss_fn is not None else inside(mk(bad))
        runs.append(probe_run(m, batch, loss_fn or own_loss, bad + 2, str(tmp_path / f"w{watch}"), watch=watch))
    r, plain = runs
    assert all(map(math.isfinite, r["losses"])) and r["first"] is None, (r["losses"], r["first"])
    assert set(r["skipped"]) <= {0, 1, 2, bad, bad + 1}, r["skipped"]   # the scaler's own search only
    assert r["warns"] == [], r["warns"]
    rep = r["rep"]
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)
    # the watch changes nothing: losses and weights bitwise identical
    assert r["losses"] == plain["losses"], (r["losses"], plain["losses"])
    for k, v in r["weights"].items():
        assert torch.equal(v, plain["weights"][k]), k


def test_focal_pow_backward_inside(tmp_path):
    """A loss module whose forward is finite and whose backward makes the NaN: the producer is `loss`, phase
    backward, at every loss scale."""
    bad = 5
    torch.manual_seed(0)
    m = HOLD["m"] = WithLoss(Net(1), FocalPow())
    r = probe_run(m, inside(b_confident(bad)), own_loss, bad + 2, str(tmp_path / "run"), snap_at=bad,
                  oracle=lambda m: Producer(m, backward=True, with_kwargs=True))
    assert r["bad_loss"] == [] and r["first"] is None, (r["losses"], r["first"])
    assert r["first_bwd"] == ("loss", bad), r["first_bwd"]
    assert bad in r["skipped"], r["skipped"]
    # the replay of the bad step: forward finite, the unscaled gradient at the net's output NaN; fp32 fine
    torch.manual_seed(0)
    m2 = HOLD["m"] = WithLoss(Net(1), FocalPow())
    m2.load_state_dict(r["sd"])
    (x,), y = b_confident(bad)(bad)
    with torch.autocast(**AC):
        z = m2.net(x).detach().requires_grad_()
        loss = m2.loss(z, y)
    (g,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(loss) and torch.isnan(g).any(), (loss, g)
    z32 = z.detach().float().requires_grad_()
    (g32,) = torch.autograd.grad(m2.loss(z32, y), z32)
    assert torch.isfinite(g32).all()
    f = named_top3(r["rep"], ("nan_origin", "overflow"), "loss", bad, severities=("error",))
    if f.phase not in ("backward", None):
        raise WrongAnswer(f"wrong phase: {f.one_line()} ({f.phase})")
    print(f.one_line(), "|", f.fix)
