"""Thirty-third set of unseen failure variants: SILENT fp16/bf16 failures (no inf/NaN reaches a module output, or the
only visible sign is GradScaler skipping steps), watched through the public API only (`ampdoctor.watch(model,
optimizer=..., scaler=...)` at the default settings -> an ordinary CPU loop -> `w.report()`), in causes the other
probes do not build. Each failure is first proven in the test itself by an independent check (parameter snapshots
around the optimizer step, the gradients the scaler unscaled, the scaler's own scale history, backward hooks naming
the first module whose gradient goes non-finite from a finite one); then the rule among the report's first three
findings at the module and step the truth names. Twins (the fix applied): no warning, no error.

 1. a pure-bf16 regression net (`model.to(torch.bfloat16)`) trained with Adagrad(lr=0.02): Adagrad's effective step
    lr * g / sqrt(sum g^2) shrinks like 1/sqrt(t) and falls below half a bf16 ulp of the `gain` vector (1.0, half an
    ulp 3.9e-3) mid-run, while the Linear layers (|w| <= 0.25) keep moving: update_underflow at `gain`, at the step
    where more than half of its updates first round away (+-4: the watch checks low-precision updates periodically).
 2. a run resumed with `scaler.load_state_dict(ckpt["scaler"])` from a checkpoint written after a NaN streak drove the
    scale to 2^-26 (growth_interval 2000, so it stays there): the gradients entering the fp16 head are flushed to 0,
    nothing is skipped, the SGD weights never move: underflow (backward) at `head`, or loss_scale_collapse, step 0.
 3. an L_1/2 weight penalty sum |w|^0.5 of `enc.weight` (module `penalty`) and torch's own magnitude pruning
    (`prune.l1_unstructured(enc, "weight", 0.5)`) at step 3: on the pruned zeros pow's backward is inf and abs's
    sign(0) = 0 makes it NaN in weight_orig.grad; the forward and the loss stay finite, the scaler skips every step
    from 3 and the scale falls below 1: loss_scale_collapse / nan_origin (or overflow, backward) at `penalty`, step 3.
 4. a mixture-density head whose weakest component is pruned at step 3 by zeroing its mixture weight in place
    (`head.mix[3] = 0`): log(w) = -inf stays inside the head (logsumexp keeps the output finite), log's backward 0/0
    is NaN in `mix.grad` every step, the scale collapses: loss_scale_collapse / nan_origin at `head`, step 3.
 5. `GradScaler("cpu")` built inside the user's `train_step` helper (a fresh scaler every iteration, default init
    scale 65536) on a regression with unnormalised targets (~10): every step overflows at 65536 and is skipped, the
    next iteration's scaler starts at 65536 again, the weights never move (one scaler for the run backs off to 2048
    and trains): skipped_steps (or loss_scale_collapse), error, step 0; and the finding should say why.
 6. `torch.set_default_dtype(torch.bfloat16)` set "to save memory" before the model and AdamW(lr=1e-4) are built, then
    an ordinary bf16 autocast loop: the parameters (and Adam's state) are bf16, Adam's ~lr step is below half an ulp
    of nearly every weight of `proj` (|w| up to 0.5): update_underflow at `proj` (or `head`), step 0.
 7. a VICReg-style variance term relu(1 - sqrt(z.var(0))) (module `varreg`, VICReg's eps dropped) switched on at step
    5 over a projector one of whose output channels was structurally pruned (weight row 0: a constant feature): var =
    0, sqrt's backward is inf, times var's (z - mean) = 0 is NaN, forward finite, every step from 5 skipped:
    loss_scale_collapse / nan_origin (or overflow, backward) at `varreg`, step 5.
Twins: 1 with fp32 weights under bf16 autocast and the same Adagrad; 7 with VICReg's sqrt(var + 1e-4).

Where ampdoctor is wrong the test is a strict xfail whose reason says what it reported instead.

What ampdoctor got wrong (strict xfails; 2 fixed since):
- 2 (fixed): an empty report. rules/underflow.py `underflow` and `vanished_gradient` skipped every step whose scale
  is < 1 (taken for a collapsed scale, loss_scale_collapse's consequence), while rules/scaler.py scale_timeline
  compares the scale with its init_scale, here the restored 2^-26, and sees no backoff and no skip. Now a scale
  below 1 counts as a collapse's consequence only in a run with skipped steps: `[error] underflow at head step 0`
  ("every gradient flowing into `head` is exactly zero ... the loss x the scale (1.49e-08)"; the fix names the
  restored scale).
- 5 (the explanation): the rule and step are right (`[error] skipped_steps at (run) step 0`), but its message says
  "the scale stayed at 65536: the scaler's backoff_factor leaves it where it is" and the fix "call update() without
  an argument, keep backoff_factor < 1" (both already so); the `[error] overflow at (run) step 0` above it says "use
  GradScaler instead of a fixed multiplier". rules/backoff.py scale_restarts looks for a scale that rises after a skip;
  a scaler made anew each iteration is recorded at 65536 every step, so no rise is seen. Fixed since (thirty-sixth
  session, tests/test_scaler_made_each_step.py): the pinned scale whose skipped steps each began with a newly adopted
  scaler says "a new GradScaler every iteration" and the fix "create the GradScaler once, before the loop".
Seen, not asserted: in 3 the loss_scale_collapse names `enc` (the parameter's owner), not `penalty`, which the
overflow finding above it names.
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import prune

import ampdoctor
from probe_harness import Producer, at_top3
from scenarios import alarms, lines, randn


def quiet(rep):
    assert not alarms(rep.findings), lines(rep)
    assert rep.summary["steps"] >= 1, rep.summary


def rounded_share(before, after, grads):
    """Share of the elements with a nonzero gradient whose value did not change across the step."""
    tot = chg = 0
    for b, a, g in zip(before, after, grads):
        if g is None:
            continue
        nz = g != 0
        tot += int(nz.sum())
        chg += int((nz & (a == b)).sum())
    return chg / max(tot, 1)


# ------------------------------------------------------------------------------------ 1. bf16 Adagrad, gain stalls
class Gain(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


class GainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gain, self.out = nn.Linear(16, 32), Gain(32), nn.Linear(32, 1)

    def forward(self, x):
        return self.out(torch.relu(self.gain(self.inp(x))))


W1 = randn(16, 1, seed=11)


def _adagrad_run(pure_bf16, steps=48):
    torch.manual_seed(1)
    m = GainNet()
    if pure_bf16:
        m = m.to(torch.bfloat16)
    opt = torch.optim.Adagrad(m.parameters(), lr=0.02)
    groups = {"gain": list(m.gain.parameters()), "inp": list(m.inp.parameters()), "out": list(m.out.parameters())}
    share = {k: [] for k in groups}
    losses = []
    with ampdoctor.watch(m, optimizer=opt) as w:
        for i in range(steps):
            x = randn(32, 16, seed=100 + i)
            y = x @ W1 + 0.3 * randn(32, 1, seed=500 + i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not pure_bf16):
                out = m(x.to(next(m.parameters()).dtype))
            loss = F.mse_loss(out.float(), y)
            loss.backward()
            snap = {k: ([p.detach().clone() for p in ps], [p.grad.detach().clone() for p in ps])
                    for k, ps in groups.items()}
            opt.step()
            for k, ps in groups.items():
                share[k].append(rounded_share(snap[k][0], [p.detach() for p in ps], snap[k][1]))
            losses.append(loss.item())
    return w, share, losses


def test_pure_bf16_adagrad_gain_updates_round_away_mid_run():
    w, share, losses = _adagrad_run(True)
    assert all(map(math.isfinite, losses)), losses
    onset = next(i for i, s in enumerate(share["gain"]) if s > 0.5)
    assert 4 <= onset <= 40, share["gain"]
    rest = share["gain"][onset:]
    assert sum(rest) / len(rest) > 0.6, share["gain"]                # and mostly stays stalled
    assert max(share["inp"]) < 0.5 and max(share["out"]) < 0.5, (share["inp"], share["out"])
    rep = w.report()
    f = at_top3(rep, "update_underflow", "gain", severity="error")
    assert f.step is not None and abs(f.step - onset) <= 4, (onset, f.one_line(), lines(rep))


def test_twin_fp32_weights_under_bf16_autocast_adagrad_quiet():
    w, share, losses = _adagrad_run(False)
    assert max(share["gain"]) < 0.5, share["gain"]
    assert sum(losses[-8:]) < 0.9 * sum(losses[:8]), losses
    quiet(w.report())


# ------------------------------------------------------------------ 2. scaler restored from a collapsed checkpoint
class Reg(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


W2 = randn(8, 1, seed=22) * 0.5


def test_scaler_restored_at_a_collapsed_scale_flushes_every_gradient():
    torch.manual_seed(2)
    m = Reg()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sc = torch.amp.GradScaler("cpu")
    # the checkpoint of a run whose NaN streak (42 backoffs) left the scale at 2^-26
    ck = {"scale": 2.0 ** -26, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
          "_growth_tracker": 0}
    sc.load_state_dict(ck)
    assert sc.get_scale() == 2.0 ** -26
    w0 = [p.detach().clone() for p in m.parameters()]
    ref = Reg()
    ref.load_state_dict(m.state_dict())
    zero_share, skipped = [], 0
    with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w:
        for i in range(10):
            x = randn(16, 8, seed=200 + i)
            y = x @ W2
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
            loss = F.mse_loss(out.float(), y)
            s0 = sc.get_scale()
            sc.scale(loss).backward()
            sc.unscale_(opt)
            g = torch.cat([p.grad.flatten() for p in m.parameters()])
            zero_share.append(float((g == 0).float().mean()))
            sc.step(opt)
            sc.update()
            skipped += sc.get_scale() < s0
    # the truth: fp32 gradients of the same batch are nonzero; here every gradient is 0 and nothing moved
    x = randn(16, 8, seed=200)
    F.mse_loss(ref(x), x @ W2).backward()
    assert all(float(p.grad.abs().max()) > 1e-3 for p in ref.parameters())
    assert skipped == 0 and min(zero_share) > 0.95, zero_share
    assert all(torch.equal(a, p.detach()) for a, p in zip(w0, m.parameters()))
    rep = w.report()
    hits = [f for f in rep.findings[:3]
            if (f.rule == "underflow" and f.module == "head") or f.rule == "loss_scale_collapse"]
    assert hits, lines(rep)
    assert hits[0].severity == "error" and hits[0].step in (0, None), (hits[0].one_line(), lines(rep))


# -------------------------------------------------------------- 3. L_1/2 weight penalty after magnitude pruning
class LpPenalty(nn.Module):
    """The L_1/2 sparsity regulariser sum |w|^0.5 of a weight (sparsity-inducing, as in L1/2 pruning papers)."""

    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, w):
        return w.abs().pow(self.p).sum()


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec, self.penalty = nn.Linear(16, 64), nn.Linear(64, 16), LpPenalty(0.5)

    def forward(self, x):
        rec = self.dec(torch.tanh(self.enc(x)))
        return rec, self.penalty(self.enc.weight)


def _collapse_loop(m, batch, loss_of, steps, before=None, lr=1e-3):
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    prod = Producer(m, backward=True)
    scales, skipped, losses = [], [], []
    try:
        with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w:
            for i in range(steps):
                prod.step = i
                if before is not None:
                    before(i, m)
                opt.zero_grad()
                args = batch(i)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = m(*args)
                loss = loss_of(out, *args)
                s0 = sc.get_scale()
                scales.append(s0)
                sc.scale(loss).backward()
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                sc.step(opt)
                sc.update()
                if sc.get_scale() < s0:
                    skipped.append(i)
                losses.append(loss.item())
    finally:
        prod.remove()
    return w, prod, scales, skipped, losses, sc


def _proven_collapse(prod, scales, skipped, losses, sc, module, onset, steps):
    assert all(map(math.isfinite, losses)), losses               # silent: the loss stays finite
    assert prod.first is None, prod.first                         # no module output ever non-finite
    assert prod.first_bwd == (module, onset), prod.first_bwd      # the backward producer
    assert skipped == list(range(onset, steps)), skipped          # every step from the onset skipped
    assert sc.get_scale() < 1.0 and scales[onset - 1] >= 512, (scales, sc.get_scale())


def test_lhalf_weight_penalty_after_magnitude_pruning_collapses_the_scale():
    torch.manual_seed(3)
    m = SparseNet()

    def before(i, m):
        if i == 3:                    # torch's own magnitude pruning: enc.weight = weight_orig * weight_mask
            prune.l1_unstructured(m.enc, "weight", amount=0.5)

    def batch(i):
        return (randn(16, 16, seed=300 + i),)

    def loss_of(out, x):
        rec, pen = out
        return F.mse_loss(rec.float(), x) + 1e-4 * pen.float()

    steps = 18
    w, prod, scales, skipped, losses, sc = _collapse_loop(m, batch, loss_of, steps, before)
    _proven_collapse(prod, scales, skipped, losses, sc, "penalty", 3, steps)
    assert bool(torch.isnan(m.enc.weight_orig.grad).any())
    rep = w.report()
    # pow's backward makes the +inf (0^-0.5) and abs's sign(0) = 0 the NaN: overflow (backward) names the same producer
    at_top3(rep, ("loss_scale_collapse", "nan_origin", "overflow"), "penalty", step=3, severity="error")


# ---------------------------------------------------------------------------- 4. a pruned mixture component, log 0
class MixtureHead(nn.Module):
    """Gaussian-mixture log-likelihood of y with K learnable means/log-stds and learnable mixture weights."""

    def __init__(self, d, k=4):
        super().__init__()
        self.mu, self.logstd = nn.Linear(d, k), nn.Linear(d, k)
        self.mix = nn.Parameter(torch.full((k,), 1.0 / k))

    def forward(self, h, y):
        w = self.mix.clamp(min=0)
        logw = torch.log(w / w.sum())
        mu, ls = self.mu(h).float(), self.logstd(h).float().clamp(-5, 5)
        comp = -0.5 * ((y - mu) / ls.exp()) ** 2 - ls - 0.9189385
        return -torch.logsumexp(logw + comp, dim=-1).mean()


class MDN(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.head = nn.Sequential(nn.Linear(8, 32), nn.Tanh()), MixtureHead(32)

    def forward(self, x, y):
        return self.head(self.trunk(x), y)


def test_pruned_mixture_component_log_zero_collapses_the_scale():
    torch.manual_seed(4)
    m = MDN()

    def before(i, m):
        if i == 3:                     # prune the weakest component, the textbook way
            with torch.no_grad():
                m.head.mix[3] = 0.0

    def batch(i):
        x = randn(16, 8, seed=400 + i)
        return x, x[:, :1] * 0.7 + 0.1 * randn(16, 1, seed=900 + i)

    steps = 18
    w, prod, scales, skipped, losses, sc = _collapse_loop(m, batch, lambda out, x, y: out, steps, before)
    _proven_collapse(prod, scales, skipped, losses, sc, "head", 3, steps)
    assert bool(torch.isnan(m.head.mix.grad).any())
    rep = w.report()
    at_top3(rep, ("loss_scale_collapse", "nan_origin"), "head", step=3, severity="error")


# ------------------------------------------------------------------------------ 5. a fresh GradScaler per iteration
def train_step(model, opt, x, y, log):
    scaler = torch.amp.GradScaler("cpu")          # the bug: a new scaler (scale 65536) every call
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = F.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    s0 = scaler.get_scale()
    scaler.update()
    log.append((s0, scaler.get_scale(), loss.item()))


@functools.lru_cache(maxsize=None)
def _fresh_scaler_run():
    """The run of case 5 with its independent proof (asserted); returns the report."""
    torch.manual_seed(5)
    m = Reg()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    w0 = [p.detach().clone() for p in m.parameters()]
    log = []
    with ampdoctor.watch(m, optimizer=opt) as w:
        for i in range(16):
            x = randn(16, 8, seed=500 + i)
            y = x @ W2 * 10.0 + 10.0                 # unnormalised targets (~10)
            train_step(m, opt, x, y, log)
    assert all(s0 == 65536.0 and s1 == 32768.0 for s0, s1, _ in log), log      # each one backs off once
    assert all(torch.equal(a, p.detach()) for a, p in zip(w0, m.parameters()))  # nothing ever applied
    # the fix (one scaler for the run) on a copy: it backs off a few times, then trains
    torch.manual_seed(5)
    m2 = Reg()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    sc2 = torch.amp.GradScaler("cpu")
    skips2 = 0
    for i in range(16):
        x = randn(16, 8, seed=500 + i)
        opt2.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = m2(x)
        s0 = sc2.get_scale()
        sc2.scale(F.mse_loss(out.float(), x @ W2 * 10.0 + 10.0)).backward()
        sc2.step(opt2)
        sc2.update()
        skips2 += sc2.get_scale() < s0
    assert skips2 <= 8 and not all(torch.equal(a, p.detach()) for a, p in zip(w0, m2.parameters())), skips2
    return w.report()


def test_gradscaler_built_every_iteration_skips_every_step():
    rep = _fresh_scaler_run()
    hits = [f for f in rep.findings[:3] if f.rule in ("skipped_steps", "loss_scale_collapse")]
    assert hits, lines(rep)
    assert hits[0].severity == "error" and hits[0].step in (0, None), (hits[0].one_line(), lines(rep))


def test_gradscaler_built_every_iteration_finding_names_the_restarts():
    rep = _fresh_scaler_run()
    f = next(f for f in rep.findings[:3] if f.rule in ("skipped_steps", "loss_scale_collapse"))
    text = (f.message + " " + (f.fix or "")).lower()
    assert "backoff_factor" not in f.message, f.one_line()
    assert any(k in text for k in ("restart", "anew", "once", "every iteration", "each iteration")), f.one_line()


# ------------------------------------------------------------------------ 6. set_default_dtype(bfloat16), AdamW
class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(4, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.head(F.gelu(self.proj(x)))


def test_default_dtype_bf16_makes_adamw_updates_round_away():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(6)
        m = Proj()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    finally:
        torch.set_default_dtype(old)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    wt = randn(4, 1, seed=66)
    share = {"proj": [], "head": []}
    with ampdoctor.watch(m, optimizer=opt) as w:
        for i in range(12):
            x = randn(32, 4, seed=600 + i)
            y = torch.sin(x @ wt)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x.to(torch.bfloat16))
            loss = F.mse_loss(out.float(), y)
            loss.backward()
            snap = {k: ([p.detach().clone() for p in getattr(m, k).parameters()],
                        [p.grad.detach().clone() for p in getattr(m, k).parameters()]) for k in share}
            opt.step()
            for k in share:
                share[k].append(rounded_share(snap[k][0], [p.detach() for p in getattr(m, k).parameters()],
                                              snap[k][1]))
    assert min(share["proj"]) > 0.8, share["proj"]
    rep = w.report()
    hits = [f for f in rep.findings[:3] if f.rule == "update_underflow" and f.module in ("proj", "head")]
    assert hits, lines(rep)
    assert hits[0].severity == "error" and hits[0].step == 0, (hits[0].one_line(), lines(rep))


# -------------------------------------------------------------------- 7. VICReg variance term without eps, dead unit
class VarReg(nn.Module):
    def __init__(self, eps=None):
        super().__init__()
        self.eps = eps

    def forward(self, z):
        std = torch.sqrt(z.var(dim=0)) if self.eps is None else torch.sqrt(z.var(dim=0) + self.eps)
        return F.relu(1.0 - std).mean()


class SSL(nn.Module):
    def __init__(self, eps=None):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        self.varreg = VarReg(eps)
        with torch.no_grad():                        # a structurally pruned output channel (a pruned checkpoint)
            self.projector[2].weight[0].zero_()
        self.use_var = False

    def forward(self, x1, x2):
        z1, z2 = self.projector(self.backbone(x1)), self.projector(self.backbone(x2))
        inv = F.mse_loss(z1.float(), z2.float())
        var = self.varreg(z1) + self.varreg(z2) if self.use_var else z1.new_zeros(())
        return inv + var.float()


def _vicreg(eps, steps=18):
    torch.manual_seed(7)
    m = SSL(eps)

    def before(i, m):
        m.use_var = i >= 5

    def batch(i):
        x = randn(32, 16, seed=700 + i)
        return x, x + 0.1 * randn(32, 16, seed=800 + i)

    return _collapse_loop(m, batch, lambda out, *a: out, steps, before)


def test_vicreg_variance_term_without_eps_on_a_dead_unit_collapses_the_scale():
    steps = 18
    w, prod, scales, skipped, losses, sc = _vicreg(None, steps)
    _proven_collapse(prod, scales, skipped, losses, sc, "varreg", 5, steps)
    rep = w.report()
    at_top3(rep, ("loss_scale_collapse", "nan_origin"), "varreg", step=5, severity="error")


def test_twin_vicreg_with_sqrt_var_plus_eps_quiet():
    w, prod, scales, skipped, losses, sc = _vicreg(1e-4)
    assert prod.first is None and prod.first_bwd is None and not skipped, (prod.first_bwd, skipped)
    quiet(w.report())
