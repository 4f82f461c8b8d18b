"""Forty-sixth set: MULTI-MODEL AND MULTI-OPTIMIZER LOOPS. Six fp16 failures and two healthy twins in loops with
more than one network and/or more than one optimizer, written the way PyTorch's AMP examples ("Working with Multiple
Models, Losses, and Optimizers": one GradScaler for all optimizers, scaler.step(opt) per optimizer, ONE
scaler.update() per iteration) and real repos write them. CONTRACT.md's watch() takes one model, one optional
optimizer and one optional scaler, so each run watches ONE container module that holds every network (the
Lightning-module / ModuleDict layout) with one of its optimizers and the shared scaler, at the default settings
(`ampdoctor.watch(container, optimizer=opts[...], scaler=sc, run_dir=tmp_path / "run")`: full statistics on step 0
and every 200th, so every fault below sits on an unsampled iteration, 5-12); module names are therefore qualified by
the container ("D.head", "teacher.4", ...). Every iteration steps each optimizer exactly once and calls update()
once, so CONTRACT's `step` (the optimizer step, 0-based) is the iteration index whichever optimizer is watched. CPU
`torch.autocast("cpu", dtype=torch.float16)` + `torch.amp.GradScaler("cpu")` (default init_scale 65536).

Each fault is proven first by the test's own oracle: probe_harness.Producer on the whole container (keyword inputs
checked: the first module whose output is non-finite while its inputs and own parameters were finite, at which
iteration), the iterations with a non-finite loss, the iterations whose update() backed the scale off (before the
fault only the scaler's opening search, iterations 0-4), per-case taps (the networks that must stay finite), and
the same iteration in float32 (a fresh container with the weights that forward ran with, `.float()`, no autocast)
staying finite. A failing oracle is a plain failure. Only then must the rule be among the report's first three
findings at the PRODUCER, at its iteration, forward phase, severity `error` (CONTRACT: training is broken or silently
wrong), with no error at the modules that only passed the inf/NaN on (or never saw it); a wrong report raises
WrongAnswer naming ampdoctor's top three (rule@module step [severity]).

 1. a conditional GAN (ring of 8 gaussians, labels) with a PROJECTION discriminator (BigGAN style: psi(h) +
    <embed[y], h> in `D.head`), LSGAN losses, Adam for G and for D, ONE GradScaler (D: real + fake.detach(),
    scaler.step(optD); G through the stepped D, scaler.step(optG); one update()); watched with optG. At iteration 5
    eight real samples arrive in raw coordinate units (x 20000; D.body's outputs stay below 65504) -> overflow at
    `D.head`, step 5, error, in the top three; no error at D.body / D / G / the root.
 2. a GAN for a categorical column: the generator's output layer `G.out` is a hand-written softmax (exp(l) /
    sum exp(l), no max subtracted); same one-scaler two-optimizer loop, BCE losses, watched with optD. At iteration 7
    the latent sampler's std is 40 (a schedule in the wrong units): logits past 11.09, exp = inf in fp16, inf / inf =
    NaN from finite features; D only passes it on -> nan_origin (or overflow: the exp) at `G.out`, step 7, error;
    no error at G.body / D / the root.
 3. an actor-critic (contextual bandit, 64 envs) with an Adam per network, one scaler (unscale_ both, clip, step
    both, update); the critic's value head `critic.value` predicts in units of a running return scale (a 0-dim
    buffer: max |return| seen) and de-normalises. At iteration 8 one env pays an unclipped jackpot of 60000: the
    scale becomes 60000 (< 65504) and the head's fp16 product passes 65504 (on every later iteration too); the
    actor's every output stays finite -> overflow at `critic.value`, step 8, error; no error at the actor, the
    critic's body, the root. Watched with the ACTOR's optimizer.
 4. distillation: a `Distiller` holding a frozen teacher in pure fp16 (`.half()`, eval, requires_grad off, run under
    no_grad; pretrained in bf16, logits in the thousands) and a student under autocast; only the student's AdamW.
    At iteration 11 two rows arrive at 8x contrast: the teacher's head `teacher.4` gives +-inf from finite features;
    the student's outputs stay finite and only RECEIVE the inf, in the KD loss (softmax(inf) = NaN) -> overflow at
    `teacher.4`, step 11, error. Producer, not loss: CONTRACT's `overflow` names "a module (op) [that] turned finite
    inputs into +-inf", and `module` is a name from the watched model's named_modules(); the teacher is a submodule
    of the watched Distiller, so its head is named (module null is only for "no module applies"); the loss, the
    student and the root only propagate.
 5. a CLIP-style dual encoder (forward(xi, xt) -> both towers' embeddings), one AdamW per tower (different lrs),
    ONE scaler; the text tower's projection comes from a checkpoint (weights std 0.25). At iteration 6 one text row
    arrives un-standardised (x 4000; txt.enc's outputs below 65504) -> overflow at `txt.proj`, step 6, error; no
    error at txt / txt.enc / img / the root. Watched with the IMAGE tower's optimizer.
 6. an EMA copy: the container holds the online `net` and `ema` (swa_utils.AveragedModel, EMA 0.99,
    update_parameters every iteration; the EMA's validation loss every 4th); at iteration 12 one row arrives in raw
    ADC counts (52000 +- 4000) -> overflow at `net.0`, step 12, error; the skipped step leaves the weights and the
    EMA finite, every EMA forward is finite: no error at any `ema.*` module, `net` or the root.
 7. healthy twin of 1 (no raw samples, 30 iterations): D's LSGAN loss falls, only the opening search skips -> no
    warning, no error, no RuntimeWarning of ampdoctor's.
 8. healthy twin of 5 (no raw row, 30 iterations): the contrastive loss falls -> no warning, no error.

What ampdoctor says (torch 2.13 CPU; 6 of 8 right when written, 2 strict xfails failing only at the report check;
8 of 8 now):
- right: 3 `[error] overflow at critic.value step 8` ("seen on sampled step 9"); 4 `[error] overflow at teacher.4
  aten::addmm step 11`; 5 `[error] overflow at txt.proj aten::mm step 6`; 6 `[error] overflow at net.0 aten::addmm
  step 12`, nothing at `ema.*`; 7 and 8 quiet (7 only `info`: the search's backward overflows and "skipped 8 of 60
  steps" -- 60 for 30 iterations, see below).
- wrong when written (strict xfail; fixed since, below), both GAN loops: 1 top three overflow@(run) step 10 [error], skipped_steps@(run) step 10
  [error], overflow@D.head step 0 [info] (the opening search; truth: overflow@D.head step 5); 2 top three
  nan_origin@(run) step 14 [error], skipped_steps@(run) step 14 [error] (truth: nan_origin/overflow@G.out step 7).
  Two faults of ampdoctor's. (a) The step is doubled: record/monitorsink.py ends the open step on every
  scaler.step whose optimizer `owns()` a parameter of the watched model; with the container watched, optD and optG
  both own some, so optD's scaler.step ends a step and optG's zero_grad opens the next (StepMachine.begin): two
  "steps" per iteration (the case meant for it, "another model's optimizer on the shared scaler", is only handled
  when the watch holds one network). (b) The producer is never named: on unsampled steps only the ROOT's hooks are
  installed (record/step.py sync_module_hooks) and the capture takes the root forward's arguments
  (record/autocapture.py maybe_capture needs st.batches); a GAN loop calls G and D, never the container, so no
  capture is written, close() runs no replay, and rules/outside.py can only say "a step without per-layer
  statistics" at (run). (Cases 5 and 6 call the container's forward and are located; case 3 never calls its root
  either and is located only because the overflow repeats on the following, now fully recorded, iterations.)
- fixed since: a step whose scaler.step() came while an optimizer of the model that the scaler steps every iteration
  has not stepped yet, and whose update() has not come, goes on (record/step.py StepMachine.iteration_goes_on): one
  step per iteration (1: `overflow@D.head step 5 [error]`; 2: `overflow@G.out step 7 [error]`; 7: 30 steps for 30
  iterations). With the iteration one step, the networks the loop calls become entry modules as for a container
  with one optimizer (record/entries.py), so the bad batch is captured and its replay names the producer.

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants46.py -q -p no:cacheprovider (about 7 s)
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import ampdoctor
from probe_harness import Producer, WrongAnswer, at_top3, finite
from scenarios import alarms, gen, lines, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def run(build, step_fn, steps, run_dir, *, watch_opt, snap_at=None, seed=0, tap=None):
    """The user's multi-network loop under ONE `ampdoctor.watch(container, optimizer=opts[watch_opt],
    scaler=sc, run_dir=...)` at the default settings (CONTRACT.md: one model, one optional optimizer, one optional
    scaler; the container holds every network, so every producer has a name in its named_modules()). `build()`
    gives (container, {name: optimizer}); `step_fn(i, m, opts, sc)` runs iteration i (every optimizer stepped
    through the one GradScaler("cpu"), default init_scale 65536, and ONE sc.update()) and returns its losses.

    The oracle: probe_harness.Producer on the whole container (keyword inputs checked: the first module whose output
    is non-finite while its inputs and own parameters were finite, at which iteration), the iterations with a
    non-finite loss, the iterations whose update() backed the scale off (the scaler's skips), and (`snap_at`) the
    state dict the forward of that iteration ran with. `tap(m)`: extra oracle hooks, removed with the Producer."""
    torch.manual_seed(seed)
    m, opts = build()
    sc = torch.amp.GradScaler("cpu")
    orc = Producer(m, with_kwargs=True)
    taps = tap(m) if tap is not None else []
    r = dict(skipped=[], bad_loss=[], losses=[], sd=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opts[watch_opt], scaler=sc, run_dir=run_dir)
        for i in range(steps):
            orc.step = i
            if i == snap_at:
                r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
            s0 = sc.get_scale()
            ls = [float(v) for v in step_fn(i, m, opts, sc)]
            r["losses"].append(ls)
            if not all(map(math.isfinite, ls)):
                r["bad_loss"].append(i)
            if sc.get_scale() < s0:
                r["skipped"].append(i)
        orc.remove()
        for h in taps:
            h.remove()
        w.close()
        r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["first"] = orc.first
    r["m"] = m
    return r


def search(skipped, before):
    """The scaler's skips before iteration `before` are only its opening search for a scale (65536 down to at
    least 4096): within iterations 0-4."""
    early = [s for s in skipped if s < before]
    assert all(s < 5 for s in early), skipped


def real(r, name, at):
    """The fault is real: the oracle's first producer is `name` at iteration `at`; the loss first non-finite there;
    the scaler skips it and, before it, only its opening search (`search`)."""
    assert r["first"] == (name, at), r["first"]
    assert r["bad_loss"] and r["bad_loss"][0] == at, r["bad_loss"]
    assert at in r["skipped"], r["skipped"]
    search(r["skipped"], at)


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} step {f.step} [{f.severity}]"
            for f in rep.findings[:3]]


def named(r, rules, module, step, phase="forward", severity="error", clean=()):
    """The report check: one of `rules` at `module`, at `step`, in `phase`, with `severity` (CONTRACT: `error` =
    training is broken or silently wrong), among the first three findings; and no error at any module of `clean`
    (modules that only passed the inf/NaN on, or never saw it). A failure is a WrongAnswer naming ampdoctor's top
    three (rule, module, step, severity)."""
    rep = r["rep"]
    try:
        f = at_top3(rep, rules, module, step=step, phase=phase, severity=severity)
        no_error_at(rep, clean)
        return f
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:700]})") from None


def quiet(r):
    """A healthy twin: every loss finite, no skip but the scaler's opening search (`search`), no producer, no
    RuntimeWarning of ampdoctor's, and no warning or error in the report (exit 0)."""
    assert r["first"] is None and not r["bad_loss"], (r["first"], r["bad_loss"])
    search(r["skipped"], len(r["losses"]))
    rep = r["rep"]
    if r["warns"] or alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(rep)} warnings={r['warns']} {lines(rep)}")


def fp32(build, sd, fn):
    """The same iteration in float32: a fresh container with the weights the fp16 forward ran with, `.float()`,
    no autocast; returns fn(container)."""
    torch.manual_seed(0)
    m, _ = build()
    m.load_state_dict(sd)
    m.float()
    with torch.no_grad():
        return fn(m)


def mlp(*dims, act=nn.ReLU):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def bce(logits, target):
    return F.binary_cross_entropy_with_logits(logits.float(), torch.full_like(logits.float(), target))


def lsq(logits, target):
    """The least-squares GAN loss (Mao et al. 2017), in fp32."""
    return F.mse_loss(logits.float(), torch.full_like(logits.float(), target))


def finite_outputs(prefix):
    """A tap: forward hooks on every module under `prefix`; seen[(name, i)] False where an output was non-finite."""
    seen = {}

    def tap(mm):
        hs = []
        for n, mod in mm.named_modules():
            if n == prefix or n.startswith(prefix + "."):
                hs.append(mod.register_forward_hook(
                    lambda mod, i, o, n=n: seen.__setitem__(n, seen.get(n, True) and finite(o))))
        return hs
    return seen, tap


# ======================================================================================================================
# 1. a conditional GAN whose projection discriminator's output layer overflows on a raw-units real sample
#    (one GradScaler for both optimizers, as the AMP examples recommend)
# ======================================================================================================================
class CondGen(nn.Module):
    def __init__(self, z=8, k=8, d=128):
        super().__init__()
        self.emb = nn.Embedding(k, 8)
        self.net = mlp(z + 8, d, d, 2)

    def forward(self, z, y):
        return self.net(torch.cat([z, self.emb(y)], 1))


class ProjHead(nn.Module):
    """The projection discriminator's output (Miyato & Koyama 2018, BigGAN): psi(h) + <embed[y], h>."""

    def __init__(self, d, k):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, d) / math.sqrt(d))
        self.bias = nn.Parameter(torch.zeros(1))
        self.embed = nn.Parameter(torch.randn(k, d))

    def forward(self, h, y):
        return F.linear(h, self.weight, self.bias).squeeze(-1) + (self.embed[y].to(h.dtype) * h).sum(-1)


class ProjDisc(nn.Module):
    def __init__(self, k=8, d=256):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, d), nn.LeakyReLU(0.2), nn.Linear(d, d), nn.LeakyReLU(0.2))
        self.head = ProjHead(d, k)

    def forward(self, x, y):
        return self.head(self.body(x), y)


class GAN(nn.Module):
    def __init__(self, G, D):
        super().__init__()
        self.G, self.D = G, D


def build_cgan():
    m = GAN(CondGen(), ProjDisc())
    return m, {"G": torch.optim.Adam(m.G.parameters(), lr=2e-4, betas=(0.5, 0.999)),
               "D": torch.optim.Adam(m.D.parameters(), lr=2e-4, betas=(0.5, 0.999))}


def ring(i):
    """128 points on 8 gaussians on a ring of radius 2, with their mode as the label."""
    g = gen(5000 + i)
    y = torch.randint(0, 8, (128,), generator=g)
    a = y.float() * (2 * math.pi / 8)
    return torch.stack([2 * a.cos(), 2 * a.sin()], 1) + 0.05 * torch.randn(128, 2, generator=g), y


RAW_AT, RAW_SCALE = 5, 20000.0


def cgan_batch(i, fault=True):
    """The real batch, and the generator's noise and labels; at RAW_AT (fault) eight real samples arrive in the
    dataset's raw coordinate units (x RAW_SCALE: radius 2 -> ~40000, each below 65504)."""
    x, y = ring(i)
    if fault and i == RAW_AT:
        x[:8] = x[:8] * RAW_SCALE
    g = gen(6000 + i)
    return x, y, torch.randn(128, 8, generator=g), torch.randint(0, 8, (128,), generator=g)


def cgan_step(fault=True):
    def step(i, m, opts, sc):
        """The AMP examples' two-optimizer loop: D on real + fake.detach(), scaler.step(optD); then G through the
        stepped D, scaler.step(optG); ONE scaler.update() per iteration."""
        x, y, z, yf = cgan_batch(i, fault)
        opts["D"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = m.G(z, yf)
            loss_d = lsq(m.D(x, y), 1.0) + lsq(m.D(fake.detach(), yf), 0.0)
        sc.scale(loss_d).backward()
        sc.step(opts["D"])
        opts["G"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_g = lsq(m.D(fake, yf), 1.0)
        sc.scale(loss_g).backward()
        sc.step(opts["G"])
        sc.update()
        return loss_d, loss_g
    return step


def test_gan_projection_discriminator_head_overflows_one_scaler_two_optimizers(tmp_path):
    r = run(build_cgan, cgan_step(), RAW_AT + 4, tmp_path / "run", watch_opt="G", snap_at=RAW_AT)
    # truth: D.head (the projection output) overflows at RAW_AT from finite features (D.body's outputs < 65504,
    # checked by the oracle: D.body.* are not the producer); D's loss is non-finite there, the scale backs off
    real(r, "D.head", RAW_AT)
    x, y, _, _ = cgan_batch(RAW_AT)
    h = fp32(build_cgan, r["sd"], lambda m: m.D.body(x))
    assert float(h.abs().max()) < 65504, float(h.abs().max())
    assert finite(fp32(build_cgan, r["sd"], lambda m: m.D(x, y))), "float32"
    named(r, "overflow", "D.head", RAW_AT, clean=("D.body", "D.body.2", "D.body.3", "D", "", "G", "G.net"))


def test_healthy_twin_gan_one_scaler_two_optimizers(tmp_path):
    r = run(build_cgan, cgan_step(fault=False), 30, tmp_path / "run", watch_opt="G")
    ld = [l[0] for l in r["losses"]]
    assert sum(ld[-5:]) < 0.2 * sum(ld[:5]), ld     # the discriminator learns (LSGAN)
    quiet(r)


# ======================================================================================================================
# 2. a GAN for a categorical column whose generator's output layer (a hand-written softmax) makes NaN
# ======================================================================================================================
class SoftmaxOut(nn.Module):
    """The generator's output layer: class probabilities by a hand-written softmax, exp(l) / sum exp(l) (no max
    subtracted)."""

    def __init__(self, d, k):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, d) / math.sqrt(d))
        self.bias = nn.Parameter(torch.zeros(k))

    def forward(self, h):
        e = F.linear(h, self.weight, self.bias).exp()
        return e / e.sum(-1, keepdim=True)


class CatGen(nn.Module):
    def __init__(self, z=16, d=64, k=8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(z, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.out = SoftmaxOut(d, k)

    def forward(self, z):
        return self.out(self.body(z))


def build_catgan():
    m = GAN(CatGen(), mlp(8, 64, 64, 1, act=lambda: nn.LeakyReLU(0.2)))
    return m, {"G": torch.optim.Adam(m.G.parameters(), lr=2e-4, betas=(0.5, 0.999)),
               "D": torch.optim.Adam(m.D.parameters(), lr=2e-4, betas=(0.5, 0.999))}


PI = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
NOISE_AT, NOISE_STD = 7, 40.0


def catgan_batch(i):
    """128 real rows of a categorical column (smoothed one-hots drawn from PI) and the generator's noise; at
    NOISE_AT the latent sampler's std is NOISE_STD (a truncation/annealing schedule read in the wrong units)."""
    g = gen(7000 + i)
    real = F.one_hot(torch.multinomial(PI, 128, replacement=True, generator=g), 8).float() * 0.92 + 0.01
    z = torch.randn(128, 16, generator=g) * (NOISE_STD if i == NOISE_AT else 1.0)
    return real, z


def catgan_step(i, m, opts, sc):
    real, z = catgan_batch(i)
    opts["D"].zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        fake = m.G(z)
        loss_d = bce(m.D(real), 1.0) + bce(m.D(fake.detach()), 0.0)
    sc.scale(loss_d).backward()
    sc.step(opts["D"])
    opts["G"].zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        loss_g = bce(m.D(fake), 1.0)
    sc.scale(loss_g).backward()
    sc.step(opts["G"])
    sc.update()
    return loss_d, loss_g


def test_gan_generator_softmax_output_makes_nan(tmp_path):
    seen = {}

    def tap(m):
        def f(mod, i, o):
            seen.setdefault("out", []).append((finite(i), bool(torch.isnan(o).any())))
        return [m.G.out.register_forward_hook(f)]
    r = run(build_catgan, catgan_step, NOISE_AT + 4, tmp_path / "run", watch_opt="D", snap_at=NOISE_AT, tap=tap)
    # truth: G.out gets finite features at NOISE_AT (G.body is not the producer) and returns NaN (exp past 11.09 is
    # inf in fp16: inf / inf); the discriminator only passes it on; both losses are NaN there, the scale backs off.
    # In float32 the same forward is finite.
    real(r, "G.out", NOISE_AT)
    assert seen["out"][NOISE_AT] == (True, True) and not any(n for _, n in seen["out"][:NOISE_AT]), seen["out"]
    _, z = catgan_batch(NOISE_AT)
    assert finite(fp32(build_catgan, r["sd"], lambda m: m.D(m.G(z)))), "float32"
    named(r, ("nan_origin", "overflow"), "G.out", NOISE_AT, clean=("G.body", "G", "D", "D.0", "D.2", "D.4", ""))


# ======================================================================================================================
# 3. an actor-critic whose critic's value head (de-normalised by a running return scale) overflows after a reward
#    spike; the actor is fine
# ======================================================================================================================
class ScaledValue(nn.Module):
    """A value head that predicts in units of a running return scale (a 0-dim buffer: max |return| seen) and
    returns the de-normalised value."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, d) / math.sqrt(d))
        self.bias = nn.Parameter(torch.zeros(1))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, h):
        return F.linear(h, self.weight, self.bias).squeeze(-1) * self.scale


class Critic(nn.Module):
    def __init__(self, obs=8, d=64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, d), nn.Tanh())
        self.value = ScaledValue(d)

    def forward(self, o):
        return self.value(self.body(o))


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.actor, self.critic = mlp(8, 64, 4, act=nn.Tanh), Critic()


def build_ac():
    m = ActorCritic()
    return m, {"actor": torch.optim.Adam(m.actor.parameters(), lr=1e-3),
               "critic": torch.optim.Adam(m.critic.parameters(), lr=1e-3)}


JACKPOT_AT, JACKPOT = 8, 60000.0


def bandit(i, m):
    """A contextual bandit of 64 parallel envs: the reward is the chosen action's feature plus noise; at JACKPOT_AT
    one env pays an unclipped jackpot of JACKPOT points."""
    g = gen(8000 + i)
    o = torch.randn(64, 8, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        a = torch.distributions.Categorical(logits=m.actor(o).float()).sample()
    r = o[torch.arange(64), a] + 0.1 * torch.randn(64, generator=g)
    if i == JACKPOT_AT:
        r[5] = JACKPOT
    return o, a, r


def ac_step(i, m, opts, sc):
    o, a, ret = bandit(i, m)
    with torch.no_grad():
        m.critic.value.scale.copy_(torch.maximum(m.critic.value.scale, ret.abs().max()))
    for opt in opts.values():
        opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        logits, v = m.actor(o).float(), m.critic(o).float()
    s = m.critic.value.scale
    logp = F.log_softmax(logits, -1)
    adv = (ret - v).detach()
    loss = -(logp.gather(1, a[:, None]).squeeze(1) * adv / s).mean() + 0.5 * F.mse_loss(v / s, ret / s) \
        + 0.01 * (logp.exp() * logp).sum(-1).mean()
    sc.scale(loss).backward()
    sc.unscale_(opts["actor"])
    sc.unscale_(opts["critic"])
    nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    sc.step(opts["actor"])
    sc.step(opts["critic"])
    sc.update()
    return (loss,)


def test_actor_critic_value_head_overflows_on_a_reward_spike(tmp_path):
    seen, tap = finite_outputs("actor")
    r = run(build_ac, ac_step, JACKPOT_AT + 4, tmp_path / "run", watch_opt="actor", snap_at=JACKPOT_AT, tap=tap)
    # truth: critic.value overflows at JACKPOT_AT (finite features x a scale of 60000 < 65504, both finite: its
    # fp16 product passes 65504); the actor's every output stays finite; the loss non-finite, the scale backs off.
    # In float32 the same forward is finite.
    real(r, "critic.value", JACKPOT_AT)
    assert seen and all(seen.values()), seen
    o, _, _ = bandit(JACKPOT_AT, r["m"])
    sd = dict(r["sd"], **{"critic.value.scale": torch.tensor(JACKPOT)})      # (the scale the forward ran with)
    assert finite(fp32(build_ac, sd, lambda m: m.critic(o))), "float32"
    named(r, "overflow", "critic.value", JACKPOT_AT,
          clean=("actor", "actor.0", "actor.1", "actor.2", "critic.body", "critic.body.0", "critic", ""))


# ======================================================================================================================
# 4. distillation: a frozen fp16 (`.half()`, eval) teacher's logits overflow; the student only receives them
# ======================================================================================================================
class Distiller(nn.Module):
    """The teacher and the student in one module (the torchdistill / Lightning-module layout): the teacher runs
    frozen in pure fp16 under no_grad, the student under autocast."""

    def __init__(self):
        super().__init__()
        self.teacher = mlp(32, 256, 256, 10)
        self.student = mlp(32, 64, 10)

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x.half())
        return self.student(x), t


W_KD = torch.randn(32, 10, generator=gen(46))
SHARP = 50000.0


def build_kd():
    m = Distiller()
    with torch.no_grad():   # a teacher pretrained in bf16 whose logits run in the thousands (bf16's range never
        m.teacher[4].weight.mul_(SHARP)   # stopped them)
    m.teacher.half().eval().requires_grad_(False)
    return m, {"student": torch.optim.AdamW(m.student.parameters(), lr=2e-3)}


BRIGHT_AT, BRIGHT = 11, 8.0


def kd_batch(i):
    """128 standardised rows and their labels; at BRIGHT_AT two rows arrive at BRIGHT x the usual contrast
    (un-normalised images), each value below 65504."""
    x = torch.randn(128, 32, generator=gen(9000 + i))
    y = (x @ W_KD).argmax(1)
    if i == BRIGHT_AT:
        x[[3, 7]] = x[[3, 7]] * BRIGHT
    return x, y


def kd_step(i, m, opts, sc):
    x, y = kd_batch(i)
    opts["student"].zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        s, t = m(x)
    T = 4.0
    kd = F.kl_div(F.log_softmax(s.float() / T, -1), F.softmax(t.float() / T, -1), reduction="batchmean") * T * T
    loss = kd + F.cross_entropy(s.float(), y)
    sc.scale(loss).backward()
    sc.unscale_(opts["student"])
    nn.utils.clip_grad_norm_(m.student.parameters(), 1.0)
    sc.step(opts["student"])
    sc.update()
    return (loss,)


def test_distillation_frozen_half_teacher_logits_overflow(tmp_path):
    seen, tap = finite_outputs("student")
    r = run(build_kd, kd_step, BRIGHT_AT + 4, tmp_path / "run", watch_opt="student", snap_at=BRIGHT_AT, tap=tap)
    # truth: teacher.4 (the teacher's head, fp16 weights all finite) overflows at BRIGHT_AT from finite features
    # (teacher.0 / teacher.2 below 65504); the student's every output stays finite (it only receives the inf, in
    # the loss: softmax(inf) = NaN); the loss is NaN there, the scale backs off. In float32 the teacher is finite.
    real(r, "teacher.4", BRIGHT_AT)
    assert seen and all(seen.values()), seen
    x, _ = kd_batch(BRIGHT_AT)
    assert finite(fp32(build_kd, r["sd"], lambda m: m.teacher(x))), "float32"
    named(r, "overflow", "teacher.4", BRIGHT_AT,
          clean=("student", "student.0", "student.2", "teacher", "teacher.0", "teacher.2", ""))


# ======================================================================================================================
# 5. a dual-encoder (CLIP-style) with one optimizer per tower and one GradScaler: the text tower's projection
#    overflows
# ======================================================================================================================
class Tower(nn.Module):
    def __init__(self, feats=32, d=512, e=64, proj_std=None):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(feats, d), nn.GELU())
        self.proj = nn.Linear(d, e, bias=False)
        if proj_std is not None:   # the projection of a pretrained checkpoint
            nn.init.normal_(self.proj.weight, std=proj_std)

    def forward(self, x):
        return self.proj(self.enc(x))


class DualEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.img, self.txt = Tower(), Tower(proj_std=0.25)

    def forward(self, xi, xt):
        return self.img(xi), self.txt(xt)


def build_dual():
    m = DualEncoder()
    return m, {"img": torch.optim.AdamW(m.img.parameters(), lr=1e-3),
               "txt": torch.optim.AdamW(m.txt.parameters(), lr=5e-4)}


A_IMG, A_TXT = torch.randn(16, 32, generator=gen(1)), torch.randn(16, 32, generator=gen(2))
RAWTXT_AT, RAWTXT = 6, 4000.0


def dual_batch(i, fault=True):
    """64 image/text feature pairs of 64 shared concepts; at RAWTXT_AT (fault) one text row arrives without its
    standardisation (x RAWTXT, each value below 65504)."""
    g = gen(9500 + i)
    c = torch.randn(64, 16, generator=g)
    xi = c @ A_IMG + 0.3 * torch.randn(64, 32, generator=g)
    xt = c @ A_TXT + 0.3 * torch.randn(64, 32, generator=g)
    if fault and i == RAWTXT_AT:
        xt[9] = xt[9] * RAWTXT
    return xi, xt


def dual_step(fault=True):
    def step(i, m, opts, sc):
        xi, xt = dual_batch(i, fault)
        for opt in opts.values():
            opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            ei, et = m(xi, xt)
        ei, et = F.normalize(ei.float(), dim=-1), F.normalize(et.float(), dim=-1)
        logits = ei @ et.t() / 0.07
        lbl = torch.arange(64)
        loss = (F.cross_entropy(logits, lbl) + F.cross_entropy(logits.t(), lbl)) / 2
        sc.scale(loss).backward()
        sc.step(opts["img"])
        sc.step(opts["txt"])
        sc.update()
        return (loss,)
    return step


def test_dual_encoder_two_optimizers_text_projection_overflows(tmp_path):
    r = run(build_dual, dual_step(), RAWTXT_AT + 4, tmp_path / "run", watch_opt="img", snap_at=RAWTXT_AT)
    # truth: txt.proj overflows at RAWTXT_AT from finite features (txt.enc's outputs below 65504); the image tower
    # never sees it; the loss is NaN there, the scale backs off. In float32 the tower is finite.
    real(r, "txt.proj", RAWTXT_AT)
    _, xt = dual_batch(RAWTXT_AT)
    h = fp32(build_dual, r["sd"], lambda m: m.txt.enc(xt))
    assert float(h.abs().max()) < 65504, float(h.abs().max())
    assert finite(fp32(build_dual, r["sd"], lambda m: m.txt(xt))), "float32"
    named(r, "overflow", "txt.proj", RAWTXT_AT, clean=("txt", "txt.enc", "txt.enc.0", "txt.enc.1", "img", ""))


def test_healthy_twin_dual_encoder_two_optimizers(tmp_path):
    r = run(build_dual, dual_step(fault=False), 30, tmp_path / "run", watch_opt="img")
    ls = [l[0] for l in r["losses"]]
    assert sum(ls[-5:]) < 0.8 * sum(ls[:5]), ls
    quiet(r)


# ======================================================================================================================
# 6. an EMA copy (swa_utils.AveragedModel) updated every iteration and evaluated every 4: the online network
#    overflows; the EMA is not the producer
# ======================================================================================================================
class WithEMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(16, 128, 128, 1, act=nn.GELU)
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.99))

    def forward(self, x):
        return self.net(x)


def build_ema():
    m = WithEMA()
    return m, {"net": torch.optim.AdamW(m.net.parameters(), lr=1e-3)}


W_EMA = torch.randn(16, 1, generator=gen(3)) * 0.5
ADC_AT = 12
X_VAL = torch.randn(256, 16, generator=gen(4))


def ema_batch(i):
    """64 standardised rows, a regression target; at ADC_AT one row arrives in raw ADC counts (52000 +- 4000,
    each below 65504)."""
    x = torch.randn(64, 16, generator=gen(9900 + i))
    y = x @ W_EMA
    if i == ADC_AT:
        x[7] = x[7].clamp(-3, 3) * 4000 + 52000
    return x, y


def ema_step(i, m, opts, sc):
    x, y = ema_batch(i)
    opts["net"].zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        out = m(x)
    loss = F.mse_loss(out.float(), y)
    sc.scale(loss).backward()
    sc.unscale_(opts["net"])
    nn.utils.clip_grad_norm_(m.net.parameters(), 1.0)
    sc.step(opts["net"])
    sc.update()
    m.ema.update_parameters(m.net)
    if i % 4 == 0:   # the EMA's validation loss
        with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
            val = F.mse_loss(m.ema(X_VAL).float(), X_VAL @ W_EMA)
        return loss, val
    return (loss,)


def test_ema_copy_is_not_the_producer(tmp_path):
    seen, tap = finite_outputs("ema")
    r = run(build_ema, ema_step, ADC_AT + 4, tmp_path / "run", watch_opt="net", snap_at=ADC_AT, tap=tap)
    # truth: net.0 overflows at ADC_AT (inputs below 65504); the step is skipped, so the weights and the EMA stay
    # finite; every EMA forward (validation at 0, 4, 8, 12) is finite. In float32 the batch is finite.
    real(r, "net.0", ADC_AT)
    assert seen and all(seen.values()), seen
    assert all(torch.isfinite(v).all() for k, v in r["m"].state_dict().items() if v.is_floating_point())
    x, _ = ema_batch(ADC_AT)
    assert float(x.abs().max()) < 65504
    assert finite(fp32(build_ema, r["sd"], lambda m: m.net(x))), "float32"
    ema_mods = tuple(n for n, _ in r["m"].named_modules() if n.startswith("ema"))
    named(r, "overflow", "net.0", ADC_AT, clean=ema_mods + ("net", ""))
