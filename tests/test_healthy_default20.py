"""Healthy runs at ampdoctor's DEFAULT watch, twentieth set: LONG runs (220-450 steps) that cross the default
sampling's second full-statistics step (step 200; the default every=200 records full per-layer statistics on step 0
and every 200th step, with the per-step headroom series and the trip-wire between them), so that the early warning
(`headroom_trend`), the window check of `update_spike` (the updates between step 0 and step 200 compared at once)
and the loss-scale rules (`skipped_steps`, `loss_scale_collapse`, `underflow`) get a long series to misread.
`ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")` and nothing else; none of these
runs may give a warning or an error (info is fine): checked on `w.report()` and on `ampdoctor.diagnose(run_dir)`.

Tiny models (widths 8-64), fixed seeds, one intra-op thread, CPU fp16 autocast with a real
`torch.amp.GradScaler("cpu")`. Not covered by the earlier probes (tests/test_healthy*.py, checked by grep): a
warmup-stable-decay (WSD) schedule, a scaler whose growth_interval=50 keeps probing through step 200 and 400, a
cross-entropy fit to ~1e-5 while the scale grows to 2**18, a sequence-length curriculum doubling at step 100 and at
the sampled step 200 under a fixed token budget, a mean teacher with a sigmoid consistency ramp-up over 150 steps,
KL annealing that reaches 1 exactly at step 200 (the loss RISES during it), a 300-step GAN stepping D and G on one
scaler every iteration, and stochastic depth with an eval pass every 50 steps (so an eval forward lands right before
the sampled steps 200).

Every run keeps its own oracle, independent of ampdoctor (`Log` + `Probe`: forward hooks on every leaf module,
training forwards only): every loss finite; the loss falls (or, where a schedule raises it, what should fall falls);
GradScaler's first search takes at most 4 halvings and every later skip is a single one (never two running), of the
kind and number each case states; every module output finite and below a stated bound (8192, 3 bits under 65504,
unless said); every parameter finite at the end; plus what makes each case what it is (below).

Cases:
 1. growth50_probes: a sum-reduced regression loss (fairseq-style), GradScaler(init_scale=2**10, growth_interval=50),
    450 steps: the scale doubles every 50 clean steps until the scaled gradients reach fp16's max (step 202), then
    GradScaler keeps probing (grows, skips once, halves back) for the rest of the run (oracle: >= 5 growths, >= 3
    later skips, each a single probe fewer than 50 steps after a growth, the scale back at the proven one);
 2. wsd_normfree: a norm-free GELU MLP (no weight decay) on raw features of scale 30, Adam under warmup-stable-decay
    (linear warmup 50 steps, constant to step 300, linear to 0 at 400): the hidden activations grow for the first
    ~150 steps and then plateau, 400 steps;
 3. converged_ce: a classifier on separable clusters, no weight decay, GradScaler(growth_interval=100), 420 steps:
    the loss falls below 1e-3 (measured ~1e-5), the logits keep growing, the unscaled gradient into the logits
    shrinks > 100x while the scale grows to >= 2**18;
 4. seq_curriculum: a causal transformer (one block, SDPA) on a copy-4-back task, sequence length 16 -> 32 at step
    100 -> 64 at step 200 with the batch halved each time (a fixed token budget), 300 steps;
 5. mean_teacher: a dropout MLP classifier with 16 labelled + 48 unlabelled samples a batch, an EMA teacher (decay
    0.99, unwatched, fp16 autocast under no_grad), consistency weight exp(-5 (1 - t)^2) ramped over 150 steps, 300
    steps;
 6. vae_kl_anneal_200: a VAE whose KL weight rises linearly 0 -> 1 over steps 0-200, then stays at 1, 400 steps: the
    total loss rises while the weight does; the reconstruction falls;
 7. gan_one_scaler_300: a 2-D GAN, D and G (Adam, betas 0.5/0.999) both stepped every iteration through one
    GradScaler, one update per iteration, the watch on a container of both with D's optimizer, 300 steps;
 8. droppath_eval50: a residual MLP with stochastic depth (rates 0.1..0.3, a new mask per step) and dropout, an eval
    pass (model.eval(), no_grad, autocast, a 4x batch) after every 50th step, 300 steps.

Results: all 8 runs quiet (no warning, no error; w.report() and diagnose(run_dir) agree), no xfails. The only
findings are `info`: skipped_steps "a normal rate for dynamic loss scaling" (cases 1, 2, 3, 6) and an `overflow`
info at the layer whose scaled backward overflowed while GradScaler searched (cases 2, 3, 6). Measured: case 1's
scale 2**10 -> 2**14 by step 200, probes skipped at 202, 325, 383; case 2's hidden layer abs-max 34 -> ~250 by step
150 then flat (the output ~800, inside headroom_trend's 8 bits), single halvings at 44, 58, 112 during warmup; case 3's
loss ~2e-5 from step 40 on, the unscaled gradient into the logits 1.4e-2 -> ~1e-6, scale 2**15 -> 2**18; case 6's
loss 207 -> ~18 at step 100, up to ~21 while beta reaches 1, reconstruction 207 -> ~5.7. Observed, not asserted:
the GAN's 300 iterations (two scaler.step calls, one update each) are recorded as 600 steps (sampled 0, 200, 400 =
iterations 0, 100, 200), and the default headroom="auto" series covered 3 of them; on the other runs it covered
10-45% of the steps.
"""
from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
# GradScaler skips its first step while searching, so the first sched.step() comes before an optimizer step
pytestmark = pytest.mark.filterwarnings("ignore:.*lr_scheduler.step.*:UserWarning")
FP16 = torch.float16
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ------------------------------------------------------------------------------------------------------ the oracle
class Probe:
    """Forward hooks on every leaf module: the abs-max of each output per training step (any dtype)."""

    def __init__(self, model):
        self.step = 0
        self.on = True
        self.amax: dict[str, dict[int, float]] = {}
        self.nonfinite: list[tuple[str, int]] = []
        self.hs = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules()
                   if not list(m.children())]

    def _hook(self, name):
        def f(mod, inp, out):
            if not self.on or not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return
            o = out.detach()
            if not torch.isfinite(o).all():
                self.nonfinite.append((name, self.step))
            a = o.abs().max().item() if o.numel() else 0.0
            d = self.amax.setdefault(name, {})
            d[self.step] = max(d.get(self.step, 0.0), a)
        return f

    def peak(self):
        return max((v for d in self.amax.values() for v in d.values()), default=0.0)

    def series(self, name):
        d = self.amax[name]
        return [d[k] for k in sorted(d)]

    def remove(self):
        for h in self.hs:
            h.remove()


class Log:
    def __init__(self):
        self.losses: list[float] = []
        self.scales: list[float] = []    # the scale each step ran at
        self.skipped: list[int] = []     # steps whose update lowered the scale (the step was skipped)
        self.extra: dict[str, list] = {}

    def add(self, key, v):
        self.extra.setdefault(key, []).append(v)

    def healthy(self, *, fall=0.5, k=None, max_later=0, probes_ok=False, growth_interval=None):
        """Finite losses falling below `fall` x; the scaler's first search <= 4 halvings; later skips single ones:
        at most `max_later`, or (probes_ok) each a probe: right after a growth (fewer clean steps than
        growth_interval since the scale last rose) with the scale back at the proven one afterwards."""
        ls = self.losses
        assert all(map(math.isfinite, ls)), ls
        k = k or max(5, len(ls) // 10)
        assert sum(ls[-k:]) / k < fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)
        first_good = next(i for i in range(len(ls)) if i not in self.skipped)
        search = [s for s in self.skipped if s < first_good]
        later = [s for s in self.skipped if s > first_good]
        assert len(search) <= 4, self.skipped
        assert not any(b == a + 1 for a, b in zip(later, later[1:])), later
        if probes_ok:
            for s in later:
                rose = max(t for t in range(1, s + 1) if self.scales[t] > self.scales[t - 1])
                assert s - rose < growth_interval, (s, rose, self.scales[rose - 2:s + 2])
                assert self.scales[s + 1] == self.scales[rose - 1] if s + 1 < len(self.scales) else True
        else:
            assert len(later) <= max_later, later
        return later


def fit(model, opt, steps, step_loss, tmp_path, *, scaler, sched=None, clip=1.0, after=None, probe=True):
    """zero_grad -> loss = step_loss(i) under fp16 autocast -> scale(loss).backward -> unscale_ -> clip -> step ->
    update -> sched.step -> after(i), under `ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=...)`."""
    torch.manual_seed(0)
    rd = tmp_path / "run"
    pr = Probe(model) if probe else None
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=rd)
    log = Log()
    for i in range(steps):
        if pr:
            pr.step = i
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = step_loss(i, log)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if sched:
            sched.step()
        log.losses.append(loss.item())
        log.scales.append(before)
        if scaler.get_scale() < before:
            log.skipped.append(i)
        if after:
            if pr:
                pr.on = False
            after(i, log)
            if pr:
                pr.on = True
    w.close()
    if pr:
        pr.remove()
        assert not pr.nonfinite, pr.nonfinite[:5]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return w, rd, log, pr


def judge(w, rd):
    """No warning or error in w.report() nor in ampdoctor.diagnose(run_dir); exit code 0 for both."""
    reps = (w.report(), ampdoctor.diagnose(rd))
    if DEBUG:
        print("  headroom series on", sum(1 for r in w.steps if r.headroom), "of", len(w.steps), "steps; sampled",
              [r.step for r in w.steps if r.sampled])
        for f in reps[0].findings:
            print(" ", f.one_line(), f.evidence if f.severity != "info" else "")
    for rep in reps:
        assert alarms(rep.findings) == [] and rep.exit_code == 0, [f.one_line() for f in rep.findings]
    assert reps[0].summary["steps"] == reps[1].summary["steps"]
    return reps[0]


def mlp(*ws, act=nn.GELU, last_act=False):
    layers = []
    for a, b in zip(ws, ws[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*(layers if last_act else layers[:-1]))


def dbg(*a):
    if DEBUG:
        print(*a)


# ------------------------------------------------------------------------------------ 1. growth_interval=50 probes
def test_growth50_probes_through_steps_200_and_400(tmp_path):
    torch.manual_seed(1)
    teacher = mlp(16, 32, 1)
    X = torch.randn(2048, 16, generator=gen(1))
    with torch.no_grad():
        Y = teacher(X) * 3
    model = mlp(16, 64, 64, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=50)

    def step_loss(i, log):
        j = torch.randint(0, 2048, (64,), generator=gen(100 + i))
        return F.mse_loss(model(X[j]).float(), Y[j], reduction="sum")

    w, rd, log, pr = fit(model, opt, 450, step_loss, tmp_path, scaler=sc)
    dbg("scales", [(i, s) for i, s in enumerate(log.scales) if i == 0 or s != log.scales[i - 1]], "skips", log.skipped)
    later = log.healthy(fall=0.2, probes_ok=True, growth_interval=50)
    growths = sum(b > a for a, b in zip(log.scales, log.scales[1:]))
    assert growths >= 5 and len(later) >= 3, (growths, later)
    assert pr.peak() < 8192
    judge(w, rd)


# ------------------------------------------------------------------------------------ 2. WSD on a norm-free MLP
def test_wsd_schedule_normfree_mlp_activations_grow_then_plateau(tmp_path):
    torch.manual_seed(2)
    X = torch.randn(4096, 16, generator=gen(2)) * 30
    wt = torch.randn(16, 4, generator=gen(3)) / 4
    Y = (torch.tanh(X @ wt / 30) * 20 + (X[:, :4] / 3)) * 15   # targets in raw units, |y| up to ~1e3
    model = mlp(16, 64, 64, 4)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=0.0)
    wsd = lambda s: min((s + 1) / 50, 1.0) if s < 300 else max(0.0, (400 - s) / 100)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, wsd)
    sc = torch.amp.GradScaler("cpu")

    def step_loss(i, log):
        j = torch.randint(0, 4096, (64,), generator=gen(200 + i))
        return F.smooth_l1_loss(model(X[j]).float(), Y[j])

    w, rd, log, pr = fit(model, opt, 400, step_loss, tmp_path, scaler=sc, sched=sched)
    h = pr.series("2")  # the second hidden Linear's output
    dbg("hidden amax", [round(h[s]) for s in range(0, 400, 25)],
        "out", [round(pr.series("4")[s]) for s in range(0, 400, 25)],
        "loss", [round(log.losses[s], 3) for s in range(0, 400, 50)])
    log.healthy(fall=0.2, max_later=3)   # single halvings while the warmup grows the gradients (steps 44, 58, 112)
    early = sum(h[:10]) / 10
    mid = sum(h[150:250]) / 100
    late = sum(h[300:]) / 100
    assert mid > 2 * early and 0.7 < late / mid < 1.4, (early, mid, late)
    assert pr.peak() < 8192
    judge(w, rd)


# ------------------------------------------------------------------------------------ 3. converged cross-entropy
def test_cross_entropy_converged_to_1e4_with_growing_scale(tmp_path):
    torch.manual_seed(3)
    centers = torch.randn(4, 8, generator=gen(4)) * 4
    lab = torch.arange(512) % 4
    X = centers[lab] + 0.3 * torch.randn(512, 8, generator=gen(5))
    model = mlp(8, 32, 4, act=nn.ReLU)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", growth_interval=100)
    gmax = []

    def step_loss(i, log):
        j = torch.randint(0, 512, (64,), generator=gen(300 + i))
        out = model(X[j])
        if out.requires_grad:
            out.register_hook(lambda g: gmax.append(g.abs().max().item() / sc.get_scale()))
        return F.cross_entropy(out.float(), lab[j])

    w, rd, log, pr = fit(model, opt, 420, step_loss, tmp_path, scaler=sc)
    dbg("loss", [f"{log.losses[s]:.2e}" for s in range(0, 420, 40)], "scale", log.scales[::50], log.skipped,
        "gmax", [f"{gmax[s]:.1e}" for s in range(0, 420, 40)])
    log.healthy(fall=1e-2, max_later=2)
    assert sum(log.losses[-20:]) / 20 < 1e-3
    logits = pr.series("2")
    assert logits[-1] > 2 * logits[10]
    assert max(gmax[:10]) > 100 * max(gmax[-20:])
    assert log.scales[-1] >= 2.0 ** 18
    judge(w, rd)


# ------------------------------------------------------------------------------------ 4. sequence-length curriculum
class CausalLM(nn.Module):
    def __init__(self, vocab=16, d=32, h=2, T=64):
        super().__init__()
        self.h = h
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        B, T = idx.shape
        x = self.emb(idx) + self.pos(torch.arange(T))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], -1)
        sh = lambda t: t.view(B, T, self.h, -1).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(sh(q), sh(k), sh(v), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, -1))
        x = x + self.ff(self.ln2(x))
        return self.head(self.lnf(x))


PERM = torch.randperm(16, generator=gen(14))


def test_sequence_length_curriculum_doubles_at_100_and_200(tmp_path):
    torch.manual_seed(4)
    model = CausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    sc = torch.amp.GradScaler("cpu")

    def batch(i):
        T = 16 if i < 100 else 32 if i < 200 else 64
        B = 256 // T
        g = gen(400 + i)
        seq = torch.empty(B, T + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, 16, (B,), generator=g)
        for t in range(1, T + 1):  # a Markov chain: the next token is PERM[token] 90% of the time
            noise = torch.randint(0, 16, (B,), generator=g)
            seq[:, t] = torch.where(torch.rand(B, generator=g) < 0.9, PERM[seq[:, t - 1]], noise)
        return seq[:, :-1], seq[:, 1:]

    def step_loss(i, log):
        x, y = batch(i)
        logits = model(x)
        log.add("T", x.shape[1])
        return F.cross_entropy(logits.float().reshape(-1, 16), y.reshape(-1))

    w, rd, log, pr = fit(model, opt, 300, step_loss, tmp_path, scaler=sc)
    dbg("loss", [round(log.losses[s], 4) for s in range(0, 300, 20)], "skips", log.skipped)
    assert log.extra["T"][99] == 16 and log.extra["T"][100] == 32 and log.extra["T"][200] == 64
    log.healthy(fall=0.6, max_later=1)
    assert pr.peak() < 8192
    judge(w, rd)


# ------------------------------------------------------------------------------------ 5. mean teacher
def test_mean_teacher_sigmoid_rampup_150_steps(tmp_path):
    torch.manual_seed(5)
    centers = torch.randn(5, 12, generator=gen(6)) * 1.5
    lab = torch.arange(2000) % 5
    X = centers[lab] + 0.8 * torch.randn(2000, 12, generator=gen(7))
    student = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.ReLU(),
                            nn.Dropout(0.2), nn.Linear(64, 5))
    teacher = copy.deepcopy(student).requires_grad_(False)  # before the watch: an ordinary, unwatched copy
    opt = torch.optim.Adam(student.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    ramp = lambda i: math.exp(-5 * (1 - min(i, 150) / 150) ** 2)  # noqa: E731  (Laine & Aila; Tarvainen & Valpola)

    def step_loss(i, log):
        jl = torch.randint(0, 2000, (16,), generator=gen(500 + i))
        ju = torch.randint(0, 2000, (48,), generator=gen(600 + i))
        xa = torch.cat([X[jl], X[ju]])
        noise = lambda: 0.1 * torch.randn(xa.shape, generator=gen(700 + i))  # noqa: E731
        out = student(xa + noise())
        with torch.no_grad():
            t_out = teacher(xa + noise())
        ce = F.cross_entropy(out[:16].float(), lab[jl])
        cons = F.mse_loss(out.float().softmax(-1), t_out.float().softmax(-1))
        log.add("ce", ce.item())
        log.add("w", ramp(i))
        return ce + 10 * ramp(i) * cons

    def after(i, log):
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.lerp_(ps, 0.01)
        if i % 50 == 49:
            teacher.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
                acc = (teacher(X[:500]).argmax(-1) == lab[:500]).float().mean().item()
            teacher.train()
            log.add("acc", acc)

    w, rd, log, pr = fit(student, opt, 300, step_loss, tmp_path, scaler=sc, after=after)
    dbg("ce", [round(log.extra["ce"][s], 3) for s in range(0, 300, 25)], "acc", log.extra["acc"], log.skipped)
    log.healthy(fall=0.5)
    ce = log.extra["ce"]
    assert sum(ce[-30:]) < 0.3 * sum(ce[:30])
    assert log.extra["w"][0] < 0.01 and log.extra["w"][-1] == 1.0
    assert log.extra["acc"][-1] > 0.9
    judge(w, rd)


# ------------------------------------------------------------------------------------ 6. VAE, KL annealed to step 200
class VAE(nn.Module):
    def __init__(self, d=32, z=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, 64), nn.SiLU())
        self.mu = nn.Linear(64, z)
        self.logvar = nn.Linear(64, z)
        self.dec = nn.Sequential(nn.Linear(z, 64), nn.SiLU(), nn.Linear(64, d))

    def forward(self, x):
        h = self.enc(x)
        mu, lv = self.mu(h).float(), self.logvar(h).float().clamp(-10, 10)
        zz = mu + torch.randn_like(mu) * (0.5 * lv).exp()
        return self.dec(zz), mu, lv


def test_vae_kl_weight_annealed_to_1_at_step_200(tmp_path):
    torch.manual_seed(6)
    basis = torch.randn(6, 32, generator=gen(8))
    X = torch.randn(3000, 6, generator=gen(9)) @ basis + 0.1 * torch.randn(3000, 32, generator=gen(10))
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")

    def step_loss(i, log):
        x = X[torch.randint(0, 3000, (64,), generator=gen(800 + i))]
        rec, mu, lv = model(x)
        recon = F.mse_loss(rec.float(), x, reduction="none").sum(-1).mean()
        kl = (-0.5 * (1 + lv - mu ** 2 - lv.exp())).sum(-1).mean()  # fp32
        beta = min(1.0, i / 200)
        log.add("recon", recon.item())
        log.add("kl", kl.item())
        return recon + beta * kl

    w, rd, log, pr = fit(model, opt, 400, step_loss, tmp_path, scaler=sc)
    rec = log.extra["recon"]
    dbg("loss", [round(log.losses[s], 2) for s in range(0, 400, 25)],
        "recon", [round(rec[s], 2) for s in range(0, 400, 50)],
        "kl", [round(log.extra["kl"][s], 2) for s in range(0, 400, 50)], log.skipped)
    log.healthy(fall=0.5, max_later=2)   # two single halvings while the early gradients grow (steps 3, 24)
    assert sum(rec[-40:]) < 0.3 * sum(rec[:40])
    # the loss RISES while beta ramps up: some stretch of 50 steps before step 200 ends higher than it began
    assert any(sum(log.losses[s + 40:s + 50]) > 1.05 * sum(log.losses[s:s + 10]) for s in range(40, 160, 10)), \
        [round(log.losses[s], 2) for s in range(0, 220, 10)]
    # after the ramp the loss settles or falls
    assert sum(log.losses[-50:]) <= 1.05 * sum(log.losses[200:250])
    judge(w, rd)


# ------------------------------------------------------------------------------------ 7. GAN, one scaler, 300 steps
class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2),
                               nn.Linear(32, 2))
        self.D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2),
                               nn.Linear(32, 1))


def test_gan_d_and_g_every_iteration_one_scaler_300_steps(tmp_path):
    torch.manual_seed(7)
    gan = GAN()
    optD = torch.optim.Adam(gan.D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    optG = torch.optim.Adam(gan.G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler("cpu")
    mean = torch.tensor([2.0, -1.0])
    pr = Probe(gan)
    rd = tmp_path / "run"
    w = ampdoctor.watch(gan, optimizer=optD, scaler=sc, run_dir=rd)
    log = Log()
    dist = []
    for i in range(300):
        pr.step = i
        real = mean + torch.randn(64, 2, generator=gen(900 + i)) * torch.tensor([0.5, 0.3])
        z = torch.randn(64, 4, generator=gen(1900 + i))
        before = sc.get_scale()
        # D step
        optD.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            fake = gan.G(z)
            dr, df = gan.D(real).float(), gan.D(fake.detach()).float()
            d_loss = F.binary_cross_entropy_with_logits(dr, torch.ones_like(dr)) + \
                F.binary_cross_entropy_with_logits(df, torch.zeros_like(df))
        sc.scale(d_loss).backward()
        sc.step(optD)
        # G step (non-saturating loss)
        optG.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            dg = gan.D(fake).float()
            g_loss = F.binary_cross_entropy_with_logits(dg, torch.ones_like(dg))
        sc.scale(g_loss).backward()
        sc.step(optG)
        sc.update()
        log.losses.append(d_loss.item())
        log.add("g", g_loss.item())
        log.scales.append(before)
        if sc.get_scale() < before:
            log.skipped.append(i)
        dist.append((fake.detach().float().mean(0) - mean).norm().item())
    w.close()
    pr.remove()
    dbg("d", [round(log.losses[s], 3) for s in range(0, 300, 25)],
        "g", [round(log.extra["g"][s], 3) for s in range(0, 300, 25)],
        "dist", [round(dist[s], 3) for s in range(0, 300, 25)], log.skipped)
    assert not pr.nonfinite and all(torch.isfinite(p).all() for p in gan.parameters())
    ls = log.losses + log.extra["g"]
    assert all(map(math.isfinite, ls))
    assert all(0.3 < l < 3.0 for l in log.losses[50:]), log.losses[50:]   # D neither wins nor collapses
    assert sum(dist[-30:]) / 30 < 0.25 * sum(dist[:10]) / 10, (dist[:10], dist[-30:])
    assert len([s for s in log.skipped if s > 4]) <= 1, log.skipped
    assert pr.peak() < 8192
    judge(w, rd)


# ------------------------------------------------------------------------------------ 8. stochastic depth + eval/50
class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = (torch.rand(x.shape[0], 1) > self.p).to(x.dtype)
        return x * keep / (1 - self.p)


class ResBlock(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)
        self.dp = DropPath(p)

    def forward(self, x):
        return x + self.dp(self.fc2(self.drop(F.gelu(self.fc1(self.ln(x))))))


class DeepRes(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(10, d)
        self.blocks = nn.Sequential(*[ResBlock(d, p) for p in (0.1, 0.17, 0.23, 0.3)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def test_stochastic_depth_with_eval_every_50_steps(tmp_path):
    torch.manual_seed(8)
    wt = torch.randn(10, 3, generator=gen(11))
    X = torch.randn(4000, 10, generator=gen(12))
    lab = (torch.tanh(X) @ wt + 0.3 * torch.randn(4000, 3, generator=gen(13))).argmax(-1)
    model = DeepRes()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 300)
    sc = torch.amp.GradScaler("cpu")

    def step_loss(i, log):
        j = torch.randint(0, 3500, (64,), generator=gen(1000 + i))
        return F.cross_entropy(model(X[j]).float(), lab[j])

    def after(i, log):
        if i % 50 == 49:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
                log.add("val", F.cross_entropy(model(X[3500:3756]).float(), lab[3500:3756]).item())
            model.train()

    w, rd, log, pr = fit(model, opt, 300, step_loss, tmp_path, scaler=sc, after=after)
    dbg("loss", [round(log.losses[s], 3) for s in range(0, 300, 25)], "val", log.extra["val"], log.skipped)
    log.healthy(fall=0.6)
    val = log.extra["val"]
    assert len(val) == 6 and val[-1] < 0.9 * val[0] and val[-1] < 0.35 * sum(log.losses[:10]) / 10, val
    assert pr.peak() < 8192
    judge(w, rd)
