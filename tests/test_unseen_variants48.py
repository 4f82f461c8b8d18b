"""Forty-eighth set: GAN-FAMILY AND MULTI-NETWORK ADVERSARIAL LOOPS WATCHED AT ONE NETWORK. The one line a user adds
to a GAN script: `ampdoctor.watch(D, optimizer=optD, scaler=sc, run_dir=...)` (or G / optG, or the VAE of a VAE-GAN)
at the default settings (full statistics on step 0 and every 200th: every fault below sits on an unsampled step,
6-14). Module names are relative to the WATCHED network (its named_modules()); the oracle names them qualified by
their network ("D.4"). Losses in torch's AMP shapes: ONE GradScaler for both optimizers (scaler.step(optD); ...;
scaler.step(optG); one update() per iteration; under n_critic an update() after every step, since GradScaler refuses
a second step() of one optimizer before update()), or one scaler per network. The gradient penalties follow torch's
AMP "Gradient penalty" recipe: autograd.grad of the SCALED output with create_graph=True, then x 1/scale by hand.
CPU `torch.autocast("cpu", dtype=torch.float16)` + `torch.amp.GradScaler("cpu")` (init_scale 65536), Adam.

Each failure is proven first by its own oracle (a failing oracle is a plain failure): probe_harness.Producer on every
network (the first module whose output is non-finite from finite inputs and own parameters, at which step; with
`backward`, the first backward producer), the iterations with a non-finite loss, the watched scaler's back-offs and
scale. Only then must the rule be among the report's first three findings at the producer (relative to the watched
network), at the watched optimizer's step, with severity `error` (CONTRACT: training is broken or silently wrong),
with no error at the modules that only passed the inf/NaN on; a wrong report raises WrongAnswer naming ampdoctor's
top three (rule@module step [severity]).

 1. DCGAN-style conv G / D (ProGAN's minibatch-stddev layer in D, fp16 under autocast), one shared scaler, watched
    at D. At step 6 a batch of raw 12-bit scans (0..4095) arrives unnormalised: the convs stay finite, `4`
    (MinibatchStd) squares deviations > 255.9 -> overflow at `4`, step 6, error; nothing at 0-3, 5, 6, the root.
 2. a conv GAN whose G emits log-intensities through `ExpOut` (exp), one shared scaler, watched at G. At step 9 the
    latents come from a bank of uint8 codes whose dequantisation was forgotten: exp of > 11.09 -> overflow at `5`,
    step 9, error; D only passes it on.
 3. case 1's loop watched at G, the raw scans arriving from step 7 on: D overflows on every iteration, the SHARED
    scaler skips every one and its scale falls 65536 -> 16, while G's own loss and gradients stay finite (optG steps
    on). The producer is in D, outside the watched network, so no G module applies: expected loss_scale_collapse (or
    skipped_steps) at module null, step 7, error, and no error at any G module.
 4. WGAN-GP (8-gaussians ring, MLPs), one shared scaler, watched at D, the penalty switched on at step 6 (a penalty
    warmup) and its gradients NOT unscaled (the recipe's `* 1/scale` forgotten): bitwise the recipe's run until 6,
    then the penalty is scale^2 too large, D's loss explodes (> 1e6 x the recipe's, still finite) and the backward
    of the scaled penalty overflows first in D's last Linear `4` (Producer, backward) at step 6; every step from 6
    skips (scale 32768 -> 128) where the recipe's run settles -> overflow at `4`, backward, step 6, error.
 5. SNGAN-style hinge loss with n_critic=3 (a minibatch-stddev layer in the critic), one shared scaler updated after
    every step, watched at D: at iteration 4, critic step 2 (optD's step 14) eight real points arrive in raw units
    (x 1000): `4` overflows; the hinge's relu(1 - inf) = 0 keeps the loss FINITE; the step is skipped -> overflow
    at `4`, step 14 (the watched optimizer's step, not the iteration), error.
 6. VAE-GAN, two scalers (the VAE's and D's), watched at the VAE with its own optimizer and scaler: at step 9 one
    row is a sensor glitch (x 300): the reparameterisation `sample` (exp(logvar / 2) in fp16) overflows from finite
    mu / logvar -> overflow at `sample`, step 9, error; nothing at body / mu / logvar / dec / the root.
Healthy twins (watched vs unwatched: bitwise the same losses, loss scales and final weights of both networks; the
generator's samples reach the ring (< 0.6 x its first distance); every loss finite after the scaler's opening search;
no skip after it; no RuntimeWarning; no warning or error in the report):
 7. StyleGAN2-style non-saturating loss with lazy R1 (every 4 iterations) by the recipe, one shared scaler, watched
    at D (60 iterations). The R1's scaled autograd.grad overflows at scale 65536 on iteration 0: a NaN loss the
    scaler skips (the opening search, allowed).
 8. WGAN-GP by the recipe, n_critic=2, one shared scaler updated after every step, watched at G (60 iterations);
    the same opening-search NaN of the critic's loss at iteration 0.
 9. spectral norm on every Linear of D, hinge loss, n_critic=2, TWO scalers, watched at D (60 iterations).

What ampdoctor says (torch 2.13 CPU; 9 of 9 right; 4 and 8 were wrong when written, fixed since):
- right: 1 `[error] overflow at 4 aten::pow step 6`; 2 `[error] overflow at 5 aten::exp step 9`; 3 `[error]
  loss_scale_collapse at (run) step 7` (when written also, first, `[error] nan_origin at (run) step 7` "The loss
  became NaN outside the watched model (in the loss computation)", D's loss read as G's: gone with the fix of 8);
  5 `[error] overflow at 4 aten::pow step 14`; 6 `[error] overflow at sample aten::exp step 9`; 7 and 9 quiet.
- 4, wrong when written (a strict xfail then): top three `overflow@4 step 0 [error]` (backward, evidence.steps [0, 7, 8, 9, 11, 12, 13]),
  `skipped_steps@(run) step 6 [error]` (truth: overflow@4 backward step 6). rules/origins.py producers() groups a
  module's producers over the whole run by (phase, module, kind) and dates the finding at the group's first record:
  the scaler's opening-search overflow of step 0 (judged info in the correctly unscaled run, bitwise the same until
  step 6) absorbs the fault's, so the error points at step 0. Fixed since: a backward group's steps that
  GradScaler's search explains (benign_backoff) no longer date, describe or judge the same module's later failure
  (rules/origins.py producers); now `[error] overflow at 4 aten::mm step 6`.
- 8, wrong when written (a strict xfail then): `[error] nan_origin at (run) step 0: The loss became
  NaN outside the watched model (in the loss computation)`: a false alarm. The critic's loss (scaled through the
  shared scaler) is NaN at the opening search, skipped as the recipe intends; with G watched the step record holds
  the critic's loss, G's own step is not skipped, so rules/lossorigin.py outside_model() finds it outside
  benign_backoff() and calls it an error (case 7, D watched, the same NaN is read as the search). Fixed since: the
  losses scaled before another model's optimizer's scaler.step are that network's and leave the watched step's
  record (record/monitorsink.py, `_Step.loss_mark`); 8 is quiet.

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants48.py -q -p no:cacheprovider (about 15 s)
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer, at_top3
from scenarios import alarms, gen, lines, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
class Nets(nn.ModuleDict):
    """The networks of one adversarial setup, by name (never called as a whole: the oracle's handle on them all)."""


class Ctx:
    """What an iteration's body gets: the networks, the optimizers, the scalers, the oracle (whose `step` the body
    may set itself: the watched optimizer's step under n_critic), and the iteration."""

    def __init__(self, nets, opts, scs, orc):
        self.nets, self.opts, self.scs, self.orc, self.i = nets, opts, scs, orc, 0


def run(build, body, steps, run_dir, *, watch, watch_opt, watch_sc="", seed=0, watched=True, backward=False,
        rearm_at=None):
    """The user's adversarial loop with ONE network watched: `ampdoctor.watch(nets[watch], optimizer=opts[watch_opt],
    scaler=scs[watch_sc], run_dir=...)` at the default settings (full statistics on step 0 and every 200th). `build()`
    gives (Nets, {name: optimizer}, {name: GradScaler}): one shared scaler (key "") or one per network;
    `body(ctx)` runs iteration ctx.i and returns its losses.

    The oracle: probe_harness.Producer on every network (keyword inputs checked; `backward`: also the backward
    producer), its step the iteration unless the body sets it; the iterations with a non-finite loss; the iterations
    where the watched scaler backed off; the loss scale after each iteration. `rearm_at`: the backward producer is
    looked for from that iteration on (the scaler's opening search before it is not the fault). `watched=False`: the
    same loop without a watch or an oracle (the bitwise twin)."""
    torch.manual_seed(seed)
    nets, opts, scs = build()
    orc = Producer(nets, backward=backward, with_kwargs=True) if watched else None
    ctx = Ctx(nets, opts, scs, orc)
    sc = scs[watch_sc]
    r = dict(skipped=[], bad_loss=[], losses=[], scales=[], rep=None, warns=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(nets[watch], optimizer=opts[watch_opt], scaler=sc, run_dir=run_dir) if watched else None
        for i in range(steps):
            ctx.i = i
            if orc is not None:
                orc.step = i
                if i == rearm_at:
                    orc.first_bwd = None
            s0 = sc.get_scale()
            ls = [float(v) for v in body(ctx)]
            r["losses"].append(ls)
            if not all(map(math.isfinite, ls)):
                r["bad_loss"].append(i)
            if sc.get_scale() < s0:
                r["skipped"].append(i)
            r["scales"].append(sc.get_scale())
        if orc is not None:
            orc.remove()
        if w is not None:
            w.close()
            r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["first"] = orc.first if orc is not None else None
    r["first_bwd"] = orc.first_bwd if orc is not None else None
    r["nets"] = nets
    r["weights"] = {k: v.detach().clone() for k, v in nets.state_dict().items()}
    return r


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} step {f.step} [{f.severity}]"
            for f in rep.findings[:3]]


def search(skipped, before):
    """The scaler's skips before iteration `before` are only its opening search for a scale: within 0-4."""
    assert all(s < 5 for s in skipped if s < before), skipped


def real(r, name, at):
    """The fault is real: the oracle's first producer is `name` (qualified by its network) at iteration `at`, the
    loss first non-finite there, the scaler skips it and before it only its opening search."""
    assert r["first"] == (name, at), r["first"]
    assert r["bad_loss"] and r["bad_loss"][0] == at, r["bad_loss"]
    assert at in r["skipped"], r["skipped"]
    search(r["skipped"], at)


def subtree(nets, net):
    """Every module name of network `net`, relative to it (as the watch names them)."""
    return tuple(n for n, _ in nets[net].named_modules())


def named(r, rules, module, step, phase="forward", severity="error", clean=()):
    """The report check: one of `rules` at `module` (relative to the WATCHED network; None: no module applies) at
    `step`, `phase`, `severity`, among the first three findings; no error at any module of `clean`. A failure is a
    WrongAnswer naming ampdoctor's top three."""
    rep = r["rep"]
    try:
        f = at_top3(rep, rules, module, step=step, phase=phase, severity=severity)
        no_error_at(rep, clean)
        return f
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:700]})") from None


def quiet(r):
    """A healthy run: every loss finite, no producer, no skip after the opening search, no RuntimeWarning of
    ampdoctor's, and no warning or error in the report (exit 0)."""
    assert r["first"] is None and not r["bad_loss"], (r["first"], r["bad_loss"])
    search(r["skipped"], len(r["losses"]))
    rep = r["rep"]
    if r["warns"] or alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(rep)} warnings={r['warns']} {lines(rep)}")


def same(a, b):
    """The watch changed nothing: the same losses (repr: exact, NaN equal to NaN), loss scales and final weights
    (bitwise)."""
    ra, rb = ([list(map(repr, l)) for l in x["losses"]] for x in (a, b))
    assert ra == rb, [(i, x, y) for i, (x, y) in enumerate(zip(ra, rb)) if x != y][:3]
    assert a["scales"] == b["scales"]
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


def bce(logits, target):
    return F.binary_cross_entropy_with_logits(logits.float(), torch.full_like(logits.float(), target))


def adam(m, lr=2e-4, betas=(0.5, 0.999)):
    return torch.optim.Adam(m.parameters(), lr=lr, betas=betas)


# ======================================================================================================================
# data: 16x16 RGB "images" (soft blobs in [-1, 1]) and the 8-gaussians ring (the WGAN-GP paper's toy)
# ======================================================================================================================
YY, XX = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")


def images(i, n=16):
    g = gen(4800 + i)
    c = torch.rand(n, 2, 1, 1, generator=g) * 10 + 3
    col = torch.rand(n, 3, 1, 1, generator=g) * 2 - 1
    blob = torch.exp(-((XX - c[:, :1]) ** 2 + (YY - c[:, 1:]) ** 2) / 8)
    return (col * blob * 1.6 - 0.6 * (1 - blob)).clamp(-1, 1)


def ring(i, n=64):
    g = gen(4900 + i)
    k = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    return 2 * torch.stack([k.cos(), k.sin()], 1) + 0.05 * torch.randn(n, 2, generator=g)


def noise(i, n, d, std=1.0):
    return torch.randn(n, d, generator=gen(5900 + i)) * std


# ======================================================================================================================
# DCGAN (conv G and D), the AMP examples' one-scaler loop
# ======================================================================================================================
Z = 16


def dcgan_g():
    return nn.Sequential(nn.ConvTranspose2d(Z, 32, 4, 1, 0, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.ConvTranspose2d(32, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.ConvTranspose2d(16, 3, 4, 2, 1), nn.Tanh())


class MinibatchStd(nn.Module):
    """ProGAN's minibatch-stddev layer: the features' standard deviation over the batch, averaged, appended as one
    more channel (computed in the features' dtype: fp16 under CPU autocast; eps 1e-4, representable in fp16)."""

    def forward(self, x):
        std = (x - x.mean(0, keepdim=True)).pow(2).mean(0).add(1e-4).sqrt().mean()
        return torch.cat([x, std.expand(x.shape[0], 1, *x.shape[2:]).to(x.dtype)], 1)


def dcgan_d():
    return nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(16, 32, 4, 2, 1), nn.LeakyReLU(0.2),
                         MinibatchStd(), nn.Conv2d(33, 1, 4, 1, 0), nn.Flatten())


def build_dcgan(two_scalers=False):
    def build():
        nets = Nets({"G": dcgan_g(), "D": dcgan_d()})
        scs = {"G": torch.amp.GradScaler("cpu"), "D": torch.amp.GradScaler("cpu")} if two_scalers else \
            {"": torch.amp.GradScaler("cpu")}
        return nets, {"G": adam(nets.G), "D": adam(nets.D)}, scs
    return build


def dcgan_body(real_fn=images, z_fn=lambda i: noise(i, 16, Z)):
    def body(c):
        G, D, sc = c.nets.G, c.nets.D, c.scs[""]
        real = real_fn(c.i)
        z = z_fn(c.i)[:, :, None, None]
        c.opts["D"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = G(z)
            loss_d = bce(D(real), 1.0) + bce(D(fake.detach()), 0.0)
        sc.scale(loss_d).backward()
        sc.step(c.opts["D"])
        c.opts["G"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_g = bce(D(fake), 1.0)
        sc.scale(loss_g).backward()
        sc.step(c.opts["G"])
        sc.update()
        return loss_d, loss_g
    return body


RAW_AT = 6


def raw_at(at, persist=False):
    """The real batches; at iteration `at` (`persist`: and from then on) a batch of raw 12-bit scans arrives
    unnormalised (0..4095, each value below 65504)."""
    def real_fn(i):
        x = images(i)
        return (x + 1) * 2047.5 if i == at or persist and i > at else x
    return real_fn


class ExpOut(nn.Module):
    """A generator's output in log space: positive intensities exp(t) (spectrogram / density-map GANs)."""

    def forward(self, t):
        return t.exp()


def spec_g():
    return nn.Sequential(nn.ConvTranspose2d(Z, 32, 4, 1, 0), nn.ReLU(), nn.ConvTranspose2d(32, 16, 4, 2, 1),
                         nn.ReLU(), nn.ConvTranspose2d(16, 1, 4, 2, 1), ExpOut())


def spec_d():
    return nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(16, 32, 4, 2, 1), nn.LeakyReLU(0.2),
                         nn.Conv2d(32, 1, 4, 1, 0), nn.Flatten())


def build_spec():
    nets = Nets({"G": spec_g(), "D": spec_d()})
    return nets, {"G": adam(nets.G), "D": adam(nets.D)}, {"": torch.amp.GradScaler("cpu")}


def spectra(i):
    """16x16 one-channel magnitude patches (positive: exp of a blob map)."""
    return images(i)[:, :1].exp()


CODES_AT = 9


def latents(at=CODES_AT):
    """The generator's latents; at iteration `at` a batch comes from a latent bank of uint8 codes (0..255) whose
    dequantisation (/ 127.5 - 1) was forgotten."""
    def z_fn(i):
        if i == at:
            return torch.randint(0, 256, (16, Z), generator=gen(5800 + i)).float()
        return noise(i, 16, Z)
    return z_fn


# ======================================================================================================================
# WGAN-GP / R1 / SNGAN on the 8-gaussians ring (MLPs), the penalty by torch's AMP "Gradient penalty" recipe
# ======================================================================================================================
def mlp(*dims, act=lambda: nn.LeakyReLU(0.2), sn=False):
    layers = []
    for a, b in zip(dims, dims[1:]):
        lin = nn.Linear(a, b)
        layers += [nn.utils.parametrizations.spectral_norm(lin) if sn else lin, act()]
    return nn.Sequential(*layers[:-1])


def ring_d(sn=False, mbstd=False):
    """The critic: Linear(2, 64) -> LeakyReLU -> Linear(64, 64) -> LeakyReLU [-> MinibatchStd] -> Linear(., 1)
    (`sn`: every Linear under spectral norm)."""
    body = mlp(2, 64, 64, sn=sn)
    tail = [nn.LeakyReLU(0.2)] + ([MinibatchStd()] if mbstd else [])
    last = nn.Linear(65 if mbstd else 64, 1)
    return nn.Sequential(*body, *tail, nn.utils.parametrizations.spectral_norm(last) if sn else last)


def build_ring(sn=False, mbstd=False, two_scalers=False, betas=(0.5, 0.9)):
    def build():
        nets = Nets({"G": mlp(8, 64, 64, 2, act=nn.ReLU), "D": ring_d(sn, mbstd)})
        scs = {"G": torch.amp.GradScaler("cpu"), "D": torch.amp.GradScaler("cpu")} if two_scalers else \
            {"": torch.amp.GradScaler("cpu")}
        return nets, {"G": adam(nets.G, 1e-3, betas), "D": adam(nets.D, 1e-3, betas)}, scs
    return build


def input_grad(sc, d_out, x, unscale=True):
    """torch's AMP "Gradient penalty" recipe: autograd.grad of the SCALED output (create_graph=True), then the
    gradient unscaled by hand (x 1/scale) before the penalty is built from it. `unscale=False`: that line forgotten."""
    g, = torch.autograd.grad(sc.scale(d_out.sum()), x, create_graph=True)
    return g * (1.0 / sc.get_scale()) if unscale else g


GP_FROM, LAMBDA = 6, 10.0


def wgan_gp_body(unscale=True, n_critic=1, gp_from=0, watch_d=True):
    """WGAN-GP (Gulrajani et al. 2017) with one GradScaler: n_critic critic steps (each scaler.step(optD) +
    update(): GradScaler refuses a second step() of one optimizer before update()), then one generator step. The
    penalty lambda * (||grad_x D(x_hat)|| - 1)^2 on random interpolates, from iteration `gp_from` (a penalty warmup)."""
    def body(c):
        G, D, sc = c.nets.G, c.nets.D, c.scs[""]
        out = []
        for k in range(n_critic):
            j = c.i * n_critic + k
            if watch_d and c.orc is not None:
                c.orc.step = j                          # the watched optimizer's step
            real, z = ring(j), noise(j, 64, 8)
            c.opts["D"].zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                with torch.no_grad():
                    fake = G(z).float()
                wd = D(fake).float().mean() - D(real).float().mean()
            loss_d = wd
            if c.i >= gp_from:
                a = torch.rand(64, 1, generator=gen(7700 + j))
                x_hat = (a * real + (1 - a) * fake).requires_grad_(True)
                with torch.autocast("cpu", dtype=FP16):
                    d_hat = D(x_hat).float()
                g = input_grad(sc, d_hat, x_hat, unscale)
                with torch.autocast("cpu", dtype=FP16):
                    gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
                loss_d = wd + LAMBDA * gp
            sc.scale(loss_d).backward()
            sc.step(c.opts["D"])
            sc.update()
            out.append(loss_d)
        c.opts["G"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_g = -D(G(noise(10_000 + c.i, 64, 8))).float().mean()
        sc.scale(loss_g).backward()
        sc.step(c.opts["G"])
        sc.update()
        return out + [loss_g]
    return body


RAWRING_AT, RAWRING = (4, 2), 1000.0      # (iteration, critic step): the watched optimizer's step 4 * 3 + 2 = 14


def hinge_body(n_critic=3, fault=True, watch_d=True):
    """SNGAN-style (Miyato et al. 2018): hinge loss, n_critic critic steps per generator step on one GradScaler
    (scaler.step(optD) + update() per critic step, then the generator's). At RAWRING_AT (fault) eight real points
    arrive in the dataset's raw coordinate units (x RAWRING: radius 2 -> 2000)."""
    def body(c):
        G, D, sc = c.nets.G, c.nets.D, c.scs[""]
        out = []
        for k in range(n_critic):
            j = c.i * n_critic + k
            if watch_d and c.orc is not None:
                c.orc.step = j
            real = ring(j)
            if fault and (c.i, k) == RAWRING_AT:
                real[:8] = real[:8] * RAWRING
            c.opts["D"].zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                with torch.no_grad():
                    fake = G(noise(j, 64, 8))
                loss_d = F.relu(1 - D(real).float()).mean() + F.relu(1 + D(fake).float()).mean()
            sc.scale(loss_d).backward()
            sc.step(c.opts["D"])
            sc.update()
            out.append(loss_d)
        c.opts["G"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_g = -D(G(noise(10_000 + c.i, 64, 8))).float().mean()
        sc.scale(loss_g).backward()
        sc.step(c.opts["G"])
        sc.update()
        return out + [loss_g]
    return body


def r1_body(every=4):
    """StyleGAN2's loss on one GradScaler: non-saturating logistic loss, lazy R1 (gamma / 2 * E||grad_x D(x)||^2 on
    reals, x every, every `every` iterations, iteration 0 included) by the AMP gradient-penalty recipe (unscaled by
    hand); scaler.step(optD); the generator's step, scaler.step(optG); ONE update()."""
    def body(c):
        G, D, sc = c.nets.G, c.nets.D, c.scs[""]
        real, z = ring(c.i), noise(c.i, 64, 8)
        c.opts["D"].zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            fake = G(z)
            loss_d = F.softplus(D(fake.detach()).float()).mean() + F.softplus(-D(real).float()).mean()
        if c.i % every == 0:
            x = real.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=FP16):
                d_x = D(x).float()
            g = input_grad(sc, d_x, x)
            with torch.autocast("cpu", dtype=FP16):
                r1 = g.pow(2).sum(1).mean()
            loss_d = loss_d + 0.5 * 1.0 * r1 * every
        sc.scale(loss_d).backward()
        sc.step(c.opts["D"])
        c.opts["G"].zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss_g = F.softplus(-D(fake).float()).mean()
        sc.scale(loss_g).backward()
        sc.step(c.opts["G"])
        sc.update()
        return loss_d, loss_g
    return body


def hinge_two_scalers_body(n_critic=2):
    """SNGAN's hinge loss and n_critic, one GradScaler per network (scs["D"] stepped and updated per critic step,
    scs["G"] per generator step)."""
    def body(c):
        G, D, sd, sg = c.nets.G, c.nets.D, c.scs["D"], c.scs["G"]
        out = []
        for k in range(n_critic):
            j = c.i * n_critic + k
            if c.orc is not None:
                c.orc.step = j
            c.opts["D"].zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                with torch.no_grad():
                    fake = G(noise(j, 64, 8))
                loss_d = F.relu(1 - D(ring(j)).float()).mean() + F.relu(1 + D(fake).float()).mean()
            sd.scale(loss_d).backward()
            sd.step(c.opts["D"])
            sd.update()
            out.append(loss_d)
        c.opts["G"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_g = -D(G(noise(10_000 + c.i, 64, 8))).float().mean()
        sg.scale(loss_g).backward()
        sg.step(c.opts["G"])
        sg.update()
        return out + [loss_g]
    return body


def ring_error(G, seed=77):
    """Mean | ||G(z)|| - 2 |: how far the generator's samples are from the data's circle."""
    with torch.no_grad():
        return float((G(torch.randn(512, 8, generator=gen(seed))).norm(dim=1) - 2).abs().mean())


# ======================================================================================================================
# VAE-GAN (Larsen et al. 2016): the VAE (encoder + reparameterisation + decoder) against a discriminator
# ======================================================================================================================
class Reparam(nn.Module):
    """z = mu + exp(logvar / 2) * eps (exp in the features' dtype: fp16 under CPU autocast)."""

    def forward(self, mu, logvar, eps):
        return mu + (0.5 * logvar).exp() * eps


class VAE(nn.Module):
    def __init__(self, d=16, h=64, k=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.mu, self.logvar = nn.Linear(h, k), nn.Linear(h, k)
        self.sample = Reparam()
        self.dec = nn.Sequential(nn.Linear(k, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x, eps):
        h = self.body(x)
        mu, logvar = self.mu(h), self.logvar(h)
        return self.dec(self.sample(mu, logvar, eps)), mu, logvar


def build_vaegan():
    nets = Nets({"vae": VAE(), "D": mlp(16, 64, 1)})
    return nets, {"vae": torch.optim.Adam(nets.vae.parameters(), 1e-3), "D": adam(nets.D, 1e-3)}, \
        {"vae": torch.amp.GradScaler("cpu"), "D": torch.amp.GradScaler("cpu")}


A_VAE = torch.randn(4, 16, generator=gen(48))
GLITCH_AT, GLITCH = 9, 300.0


def vae_batch(i, fault=True):
    """64 rows on a 4-dim manifold plus noise; at GLITCH_AT (fault) one row is a sensor glitch (x GLITCH)."""
    g = gen(6600 + i)
    x = torch.randn(64, 4, generator=g) @ A_VAE + 0.1 * torch.randn(64, 16, generator=g)
    if fault and i == GLITCH_AT:
        x[11] = x[11] * GLITCH
    return x, torch.randn(64, 4, generator=g)


def vaegan_body(fault=True):
    """Two GradScalers: the discriminator's step (real vs recon.detach(), BCE), then the VAE's (recon MSE + KL +
    0.1 x the adversarial term)."""
    def body(c):
        V, D, sv, sd = c.nets.vae, c.nets.D, c.scs["vae"], c.scs["D"]
        x, eps = vae_batch(c.i, fault)
        with torch.autocast("cpu", dtype=FP16):
            recon, mu, logvar = V(x, eps)
        c.opts["D"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_d = bce(D(x), 1.0) + bce(D(recon.detach()), 0.0)
        sd.scale(loss_d).backward()
        sd.step(c.opts["D"])
        sd.update()
        c.opts["vae"].zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            adv = bce(D(recon), 1.0)
        mu, logvar = mu.float(), logvar.float()
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
        loss = F.mse_loss(recon.float(), x) + 0.01 * kl + 0.1 * adv
        sv.scale(loss).backward()
        sv.step(c.opts["vae"])
        sv.update()
        return loss_d, loss
    return body


# ======================================================================================================================
# the cases
# ======================================================================================================================
def test_dcgan_one_scaler_watched_at_d_minibatch_std_overflows(tmp_path):
    r = run(build_dcgan(), dcgan_body(raw_at(RAW_AT)), RAW_AT + 4, tmp_path / "run", watch="D", watch_opt="D")
    # truth: D's minibatch-stddev layer (`4`) squares deviations past 255.9 in fp16 at RAW_AT from finite features
    # (the convs' outputs below 65504: they are not the producer); the loss is non-finite, the scale backs off
    real(r, "D.4", RAW_AT)
    named(r, "overflow", "4", RAW_AT, clean=("", "0", "1", "2", "3", "5", "6"))


def test_log_space_generator_watched_at_g_exp_overflows(tmp_path):
    r = run(build_spec, dcgan_body(spectra, latents()), CODES_AT + 3, tmp_path / "run", watch="G", watch_opt="G")
    # truth: G's log-space output (`5`: exp) overflows at CODES_AT from finite log-intensities (the transposed
    # convs' outputs finite); D only passes the inf on; the loss is non-finite, the scale backs off
    real(r, "G.5", CODES_AT)
    named(r, "overflow", "5", CODES_AT, clean=("", "0", "1", "2", "3", "4"))


def test_dcgan_watched_at_g_discriminator_breaks_the_shared_scaler(tmp_path):
    at = 7
    r = run(build_dcgan(), dcgan_body(raw_at(at, persist=True)), at + 12, tmp_path / "run", watch="G",
            watch_opt="G")
    # truth: from `at` on every real batch is raw: D's minibatch-stddev layer overflows on each, D's loss is
    # non-finite, the ONE shared scaler skips every iteration and its scale falls 65536 -> 16 (the generator's own
    # loss and gradients stay finite: optG steps on). The producer is in D, outside the watched G.
    real(r, "D.4", at)
    assert r["skipped"] == list(range(at, at + 12)) and r["scales"][-1] <= 16, (r["skipped"], r["scales"])
    assert all(math.isfinite(l[1]) for l in r["losses"]), r["losses"]
    # expected: the collapse (or the skips) at module null, error, from `at`; no error at any module of G
    named(r, ("loss_scale_collapse", "skipped_steps"), None, at, phase=("scaler", None),
          clean=subtree(r["nets"], "G"))


def test_wgan_gp_penalty_gradients_not_unscaled(tmp_path):
    r = run(build_ring(), wgan_gp_body(unscale=False, gp_from=GP_FROM), GP_FROM + 8, tmp_path / "run", watch="D",
            watch_opt="D", backward=True, rearm_at=GP_FROM)
    ok = run(build_ring(), wgan_gp_body(unscale=True, gp_from=GP_FROM), GP_FROM + 8, None, watch="D",
             watch_opt="D", watched=False)
    # truth: the same run as the recipe's up to GP_FROM (bitwise); from GP_FROM the penalty is scale^2 too large:
    # D's loss explodes (> 1e6 x the recipe's) while staying finite; the backward of the scaled penalty overflows
    # first in D's last Linear `4` (its weight gradient) at GP_FROM, and every iteration from GP_FROM is skipped
    # (the scale falls 32768 -> 128) where the recipe's run settles after two backoffs
    assert r["losses"][:GP_FROM] == ok["losses"][:GP_FROM]
    assert r["first"] is None and r["first_bwd"] == ("D.4", GP_FROM), (r["first"], r["first_bwd"])
    assert r["losses"][GP_FROM][0] > 1e6 * abs(ok["losses"][GP_FROM][0]), (r["losses"][GP_FROM], ok["losses"])
    assert r["skipped"][1:] == list(range(GP_FROM, GP_FROM + 8)) and r["scales"][-1] <= 128, r["skipped"]
    search(r["skipped"], GP_FROM)
    assert len([s for s in ok["skipped"] if s >= GP_FROM]) <= 2, ok["skipped"]
    named(r, "overflow", "4", GP_FROM, phase="backward", clean=("", "0", "1", "2", "3"))


def test_ncritic3_hinge_critic_watched_step_counts_critic_steps(tmp_path):
    it, k = RAWRING_AT
    r = run(build_ring(mbstd=True), hinge_body(), it + 3, tmp_path / "run", watch="D", watch_opt="D")
    # truth: at critic step 14 (iteration 4, k=2) D's minibatch-stddev layer `4` overflows from finite features
    # (the Linears' outputs finite); the hinge's relu(1 - inf) = 0 keeps the loss FINITE; the scaler skips that step
    step = it * 3 + k
    assert r["first"] == ("D.4", step), r["first"]
    assert not r["bad_loss"] and r["skipped"] == [0, it], (r["bad_loss"], r["skipped"])
    named(r, "overflow", "4", step, clean=("", "0", "1", "2", "3", "5"))


def test_vaegan_two_scalers_watched_at_vae_reparam_exp_overflows(tmp_path):
    r = run(build_vaegan, vaegan_body(), GLITCH_AT + 3, tmp_path / "run", watch="vae", watch_opt="vae",
            watch_sc="vae")
    # truth: the reparameterisation `sample` (exp(logvar / 2), fp16) overflows at GLITCH_AT from finite mu / logvar
    # (the encoder's Linears finite); the decoder and D only pass the inf on; the VAE's scaler skips the step
    real(r, "vae.sample", GLITCH_AT)
    named(r, "overflow", "sample", GLITCH_AT, clean=("", "body", "body.0", "mu", "logvar", "dec", "dec.0", "dec.2"))


# ---------------------------------------------------------------------------------------------------- healthy twins
def twin(build, body, steps, **kw):
    """The loop unwatched and watched: bitwise the same losses, scales and final weights. Returns the watched run."""
    a = run(build, body, steps, None, watched=False, **kw)
    b = run(build, body, steps, None, **kw)
    same(a, b)
    return b


def learned(r, build):
    """Every loss finite after the scaler's opening search, and the generator's samples reached the circle."""
    torch.manual_seed(0)
    e0 = ring_error(build()[0].G)
    assert all(math.isfinite(v) for l in r["losses"][5:] for v in l), r["losses"]
    assert ring_error(r["nets"].G) < 0.6 * e0, (e0, ring_error(r["nets"].G))


def search_nan(r):
    """The recipe's opening search: a non-finite loss only at iterations the scaler skipped, within 0-4 (the
    scaled autograd.grad of the penalty overflows while the scale is still 65536)."""
    assert all(s < 5 and s in r["skipped"] for s in r["bad_loss"]), (r["bad_loss"], r["skipped"])
    r["bad_loss"] = []


def test_healthy_twin_r1_lazy_one_scaler_watched_at_d():
    build = build_ring()
    r = twin(build, r1_body(), 60, watch="D", watch_opt="D")
    learned(r, build)
    search_nan(r)
    quiet(r)


def test_healthy_twin_wgan_gp_ncritic2_one_scaler_watched_at_g():
    build = build_ring()
    r = twin(build, wgan_gp_body(n_critic=2, watch_d=False), 60, watch="G", watch_opt="G")
    learned(r, build)
    search_nan(r)
    quiet(r)


def test_healthy_twin_sngan_hinge_two_scalers_watched_at_d():
    build = build_ring(sn=True, two_scalers=True)
    r = twin(build, hinge_two_scalers_body(), 60, watch="D", watch_opt="D", watch_sc="D")
    learned(r, build)
    quiet(r)
