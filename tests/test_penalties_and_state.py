"""Gradient penalties / double backward under AMP, and state kept outside the optimizer, at ampdoctor's DEFAULT
settings (`ampdoctor.watch(model, optimizer=opt, scaler=scaler)`), in ordinary CPU loops with a real GradScaler.

(A) PyTorch's documented AMP recipe for a gradient penalty (autograd.grad of the *scaled* loss with create_graph,
unscaled by hand with 1 / scaler.get_scale(), the penalty computed under autocast, then scaler.scale(loss + penalty)
.backward()): on parameter gradients, WGAN-GP on interpolates, R1 on real samples, an input-gradient (double
backprop) penalty, a second-order PINN residual; from init_scale 65536 (the first steps may overflow and be skipped,
as GradScaler intends) and from 1024. Healthy ones must raise no warning and no error. Failures: the WGAN-GP recipe
without its inv_scale (the penalty x the scale), a penalty module computing sum(g**2) in fp16 that overflows when
the gradients grow mid-run, a penalty weight typed 1e6 for 10.

(B) State outside the optimizer: BatchNorm running stats under fp16 autocast and in a `.half()` model trained through
fp32 master copies, an fp32 EMA copy updated with lerp each step, a BYOL/MoCo-style fp32 momentum encoder with a
momentum schedule, a running mean/var normaliser fed fp32 statistics, a VQ-VAE codebook updated by EMA in fp32
buffers, int and float step-counter buffers. Healthy ones must be quiet. Failures: a running mean/var observation
normaliser whose variance is computed in fp16 from (h - mean)**2 (inf buffer, finite output), BatchNorm running_var
of a `.half()` model overflowing on a loud batch (silent in training mode, zeros at eval), a mean-teacher kept in
fp16 with momentum 0.9999 updated by lerp_ (every update rounds away).

Each failure is first asserted real in the loop itself. Where ampdoctor is wrong the test is a strict xfail whose
reason says what it reported. The WGAN-GP recipe without inv_scale (info only) was one, fixed (a loss built from a
create_graph backward's gradients through a scaled loss, scaled again with no get_scale() read between, is
clip_before_unscale: rules/scaler.py _penalty_scaled). The `.half()` model's BatchNorm
running_var going inf (no findings: batch_norm's kernel writes the buffer without moving its version counter) and the
fp16 mean teacher rounding its updates away (no findings) were ones too, fixed (record/buffers.py compares norms;
params.outside_snapshot/outside_compare: frozen fp16 weights written in place whose values did not change)."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import in_top3, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16
SCALES = pytest.mark.parametrize("init_scale", [65536.0, 1024.0], ids=["scale65536", "scale1024"])


def gen(i):
    return torch.Generator().manual_seed(i)


def alarms(rep):
    return [f.one_line() for f in rep.findings if f.severity in ("warning", "error")]


def quiet(w):
    rep = w.report()
    assert not alarms(rep) and rep.exit_code == 0, lines(rep)
    return rep


def mlp(*dims, act=nn.GELU):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def healthy(losses, scales=(), fall=0.9, k=5, skip=0, bounded=None, early=12):
    """From `skip` on every loss finite and falling (mean of last k < fall x mean of first k; or every one below
    `bounded`); the loss scale backs off only in the first `early` steps, at most once after."""
    ls = losses[skip:]
    assert all(map(math.isfinite, ls)), losses
    if bounded is not None:
        assert max(abs(v) for v in ls) < bounded, ls
    else:
        assert sum(ls[-k:]) / k < fall * sum(ls[:k]) / k, ls
    drops = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]
    assert sum(i >= early for i in drops) <= 1, (drops, scales)


def recipe_grads(sc, value, inputs):
    """PyTorch's AMP gradient-penalty recipe: grads of the scaled value with create_graph, unscaled by hand."""
    scaled = torch.autograd.grad(sc.scale(value), inputs, create_graph=True)
    inv_scale = 1.0 / sc.get_scale()
    return [g * inv_scale for g in scaled]


def ring_data(n, seed):
    g = gen(seed)
    k = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    return torch.stack([2 * k.cos(), 2 * k.sin()], 1) + 0.05 * torch.randn(n, 2, generator=g)


def regression(i, n=64, d=8):
    x = torch.randn(n, d, generator=gen(i))
    y = (x[:, :4].sum(1, keepdim=True) - x[:, 4:].pow(2).mean(1, keepdim=True))
    return x, y


# ======================================================================================================================
# (A) healthy gradient penalties
# ======================================================================================================================
@SCALES
def test_parameter_gradient_norm_penalty_the_documented_recipe(init_scale):
    """The amp_examples recipe word for word: grads of scaled loss w.r.t. the parameters, inv_scale, the L2 norm of
    all parameter gradients under autocast added to the loss; clip after unscale_; 60 steps."""
    torch.manual_seed(0)
    m = mlp(8, 64, 64, 1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(60):
        opt.zero_grad()
        x, y = regression(i)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.mse_loss(m(x).float(), y)
        grads = recipe_grads(sc, loss, list(m.parameters()))
        with torch.autocast("cpu", dtype=FP16):
            grad_norm = torch.cat([g.float().pow(2).sum().reshape(1) for g in grads]).sum().sqrt()
            total = loss + 0.01 * grad_norm
        sc.scale(total).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(total.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, skip=3, fall=0.6)
    quiet(w)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp(2, 64, 64, act=lambda: nn.LeakyReLU(0.2))
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(F.leaky_relu(self.body(x), 0.2))


def wgan_gp(init_scale, steps=40, inv=True, lam=10.0):
    """WGAN-GP (Gulrajani et al.) on a ring of gaussians: one critic step per generator step, the penalty
    (||grad_x D(x_hat)|| - 1)**2 on interpolates through the AMP recipe; each network has its own GradScaler; the
    critic is watched with its optimizer and scaler. Returns (watch, critic losses, penalties, scales)."""
    torch.manual_seed(1)
    G, D = mlp(8, 64, 64, 2, act=nn.ReLU), Critic()
    oG = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.0, 0.9))
    oD = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.0, 0.9))
    sG = torch.amp.GradScaler("cpu", init_scale=init_scale)
    sD = torch.amp.GradScaler("cpu", init_scale=init_scale)
    w = ampdoctor.watch(D, optimizer=oD, scaler=sD)
    lc, gps, scales = [], [], []
    for i in range(steps):
        real, z = ring_data(64, i), torch.randn(64, 8, generator=gen(5000 + i))
        oD.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = G(z).detach().float()
        eps = torch.rand(64, 1, generator=gen(9000 + i))
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        with torch.autocast("cpu", dtype=FP16):
            d_hat = D(x_hat).float().sum()
        if inv:
            (g,) = recipe_grads(sc=sD, value=d_hat, inputs=[x_hat])
        else:
            (g,) = torch.autograd.grad(sD.scale(d_hat), [x_hat], create_graph=True)  # missing * inv_scale
        with torch.autocast("cpu", dtype=FP16):
            gp = (g.float().norm(2, dim=1) - 1).pow(2).mean()
            loss_c = D(fake).float().mean() - D(real).float().mean() + lam * gp
        sD.scale(loss_c).backward()
        sD.step(oD)
        sD.update()
        oG.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_g = -D(G(torch.randn(64, 8, generator=gen(7000 + i)))).float().mean()
        sG.scale(loss_g).backward()
        sG.step(oG)
        sG.update()
        oD.zero_grad()  # the generator's backward also filled the critic's .grad
        lc.append(loss_c.item())
        gps.append(gp.item())
        scales.append(sD.get_scale())
    w.close()
    x = torch.cat([ring_data(256, 999), torch.randn(256, 2, generator=gen(998))])  # real and off-ring points
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(D(x).sum(), [x])
    return w, lc, gps, scales, gx.norm(dim=1).median().item()


@SCALES
def test_wgan_gp_on_interpolates_with_the_recipe(init_scale):
    w, lc, gps, scales, lip = wgan_gp(init_scale)
    healthy(lc, scales, skip=3, bounded=20.0)
    assert lip > 0.1, lip  # the critic's true input-gradient norm near 1
    assert gps[-1] < gps[3] and all(map(math.isfinite, gps[3:])), gps  # the penalty pulls ||grad|| towards 1
    quiet(w)


def test_r1_regularisation_on_real_samples_non_saturating_gan():
    """StyleGAN-style R1: gamma/2 * ||grad_x D(x_real)||**2 on flattened 8x8 'images' (a blob whose position
    varies), through the recipe; the non-saturating loss; lazy regularisation every 4th critic step (StyleGAN2)."""
    torch.manual_seed(2)
    G = mlp(16, 64, 64, 64, act=nn.ReLU)
    D = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    oG = torch.optim.Adam(G.parameters(), lr=5e-4, betas=(0.0, 0.99))
    oD = torch.optim.Adam(D.parameters(), lr=5e-4, betas=(0.0, 0.99))
    sD, sG = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(D, optimizer=oD, scaler=sD)
    yy, xx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    ld, r1s, scales = [], [], []
    for i in range(60):
        c = torch.rand(32, 2, generator=gen(i)) * 4 + 2
        real = torch.exp(-((xx - c[:, 0, None, None]) ** 2 + (yy - c[:, 1, None, None]) ** 2) / 2).flatten(1)
        real = (real * 2 - 1).requires_grad_(i % 4 == 0)
        oD.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            fake = G(torch.randn(32, 16, generator=gen(100 + i))).detach()
            d_real = D(real).float()
            loss_d = F.softplus(D(fake).float()).mean() + F.softplus(-d_real).mean()
        if i % 4 == 0:
            (g,) = recipe_grads(sD, d_real.sum(), [real])
            with torch.autocast("cpu", dtype=FP16):
                r1 = g.float().pow(2).flatten(1).sum(1).mean()
                loss_d = loss_d + 4 * (10.0 / 2) * r1  # gamma=10, x4 for the lazy interval
            r1s.append(r1.item())
        sD.scale(loss_d).backward()
        sD.step(oD)
        sD.update()
        oG.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss_g = F.softplus(-D(G(torch.randn(32, 16, generator=gen(200 + i)))).float()).mean()
        sG.scale(loss_g).backward()
        sG.step(oG)
        sG.update()
        oD.zero_grad()
        ld.append(loss_d.item())
        scales.append(sD.get_scale())
    w.close()
    healthy(ld, scales, skip=2, bounded=10.0)
    assert all(map(math.isfinite, r1s[1:])), r1s
    quiet(w)


@SCALES
def test_input_gradient_double_backprop_penalty_on_a_classifier(init_scale):
    """Drucker-LeCun double backprop: CE + 0.5 * ||d CE / d x||**2 per sample (a Jacobian-norm robustness penalty);
    the per-sample input gradient through the recipe; SGD with momentum, no clip."""
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    proto = torch.randn(5, 20, generator=gen(33)) * 1.5
    losses, scales = [], []
    for i in range(60):
        g0 = gen(i)
        y = torch.randint(0, 5, (64,), generator=g0)
        x = (proto[y] + torch.randn(64, 20, generator=g0)).requires_grad_(True)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            ce = F.cross_entropy(m(x).float(), y)
        (gx,) = recipe_grads(sc, ce, [x])
        with torch.autocast("cpu", dtype=FP16):
            loss = ce + 0.5 * (64 * gx.float()).pow(2).sum(1).mean()  # the per-sample gradient of its own CE
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, skip=3, fall=0.5)
    quiet(w)


@SCALES
def test_pinn_poisson_second_derivative_through_two_recipe_grads(init_scale):
    """-u'' = pi**2 sin(pi x) on [0, 1], u(0) = u(1) = 0: u' and u'' each by autograd.grad of a scaled value with
    create_graph (the recipe twice), the residual + boundary loss under autocast; 80 steps."""
    torch.manual_seed(4)
    m = mlp(1, 32, 32, 1, act=nn.Tanh)
    opt = torch.optim.Adam(m.parameters(), lr=5e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    ends = torch.tensor([[0.0], [1.0]])
    for i in range(80):
        opt.zero_grad()
        x = torch.rand(64, 1, generator=gen(i)).requires_grad_(True)
        with torch.autocast("cpu", dtype=FP16):
            u = m(x).float()
        (du,) = recipe_grads(sc, u.sum(), [x])
        (d2u,) = recipe_grads(sc, du.sum(), [x])
        with torch.autocast("cpu", dtype=FP16):
            res = -d2u - math.pi ** 2 * torch.sin(math.pi * x)
            loss = res.pow(2).mean() + 10 * m(ends).float().pow(2).mean()
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, skip=4, fall=0.5)
    quiet(w)


def test_wgan_gp_in_bf16_without_a_scaler():
    """The same penalty under bf16 autocast: plain autograd.grad, no scaler, no inv_scale."""
    torch.manual_seed(5)
    G, D = mlp(8, 64, 64, 2, act=nn.ReLU), Critic()
    oG = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.0, 0.9))
    oD = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.0, 0.9))
    w = ampdoctor.watch(D, optimizer=oD)
    lc = []
    for i in range(40):
        real, z = ring_data(64, i), torch.randn(64, 8, generator=gen(5000 + i))
        oD.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            fake = G(z).detach().float()
        eps = torch.rand(64, 1, generator=gen(9000 + i))
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        with torch.autocast("cpu", dtype=BF16):
            (g,) = torch.autograd.grad(D(x_hat).float().sum(), [x_hat], create_graph=True)
            gp = (g.float().norm(2, dim=1) - 1).pow(2).mean()
            loss_c = D(fake).float().mean() - D(real).float().mean() + 10 * gp
        loss_c.backward()
        oD.step()
        oG.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss_g = -D(G(torch.randn(64, 8, generator=gen(7000 + i)))).float().mean()
        loss_g.backward()
        oG.step()
        lc.append(loss_c.item())
    w.close()
    healthy(lc, bounded=20.0)
    quiet(w)


# ======================================================================================================================
# (A) failing gradient penalties
# ======================================================================================================================
def test_wgan_gp_recipe_without_inv_scale_is_a_gradient_norm_read_while_scaled():
    """The WGAN-GP critic's input gradient taken from the scaled critic output but never multiplied by inv_scale:
    ||grad|| is read 1024x too large, so the penalty drives the critic's true gradient norm to ~1/1024 instead of 1
    (a near-constant critic that teaches the generator nothing)."""
    w, lc, gps, scales, lip = wgan_gp(1024.0, steps=40, inv=False)
    assert gps[0] > 1e3 and lip < 0.05, (gps, lip)  # real: the critic is squeezed to ~1/1024-Lipschitz (healthy ~1)
    rep = w.report()
    assert any(f.rule == "clip_before_unscale" for f in rep.findings[:3]), lines(rep)


class PenalisedRegressor(nn.Module):
    """A regressor on fp16 inputs (the data pipeline stores features in fp16 to save memory) with a per-sample
    input-gradient penalty module that sums the squared fp16 gradient in fp16."""

    def __init__(self):
        super().__init__()
        self.net = mlp(8, 64, 64, 1)
        self.penalty = InputGradPenalty()

    def forward(self, x):
        return self.net(x)


class InputGradPenalty(nn.Module):
    """One-sided Lipschitz penalty (WGAN-LP style) on each sample's input gradient."""

    def forward(self, g):
        norm = g.pow(2).sum(1).sqrt()  # g is fp16: a squared norm past 65504 is inf (fp32 would hold it)
        return (norm - 1).clamp(min=0).pow(2).mean()


def test_fp16_input_gradient_penalty_overflows_mid_run_on_outlier_targets():
    """From step 20 each batch carries one mislabelled sample (target 1000 instead of O(1)): its per-sample input
    gradient is ~2*1000*||w|| and its squared norm, summed in fp16 by the penalty module, is inf; (inf - 1)**2's
    backward through sqrt is inf * 0 = NaN, and GradScaler skips nearly every later step. The same penalty in fp32 is finite (checked)."""
    torch.manual_seed(6)
    m = PenalisedRegressor()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    pens, pens32, skipped = [], [], []
    for i in range(36):
        x, y = regression(i)
        if i >= 20:
            y[7] = 1000.0
        x = x.half().requires_grad_(True)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            err = (m(x).float() - y).pow(2)
        (g,) = recipe_grads(sc, err.mean(), [x])
        g = 64 * g  # the per-sample gradient of its own squared error
        with torch.autocast("cpu", dtype=FP16):
            pen = m.penalty(g)
            loss = err.mean() + 1e-3 * pen
        pens.append(pen.item())
        pens32.append((g.detach().float().pow(2).sum(1).sqrt() - 1).clamp(min=0).pow(2).mean().item())
        before = sc.get_scale()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < before:
            skipped.append(i)
    w.close()
    bad = [i for i, p in enumerate(pens) if not math.isfinite(p)]
    assert bad[0] == 20 and len(bad) >= 12, pens  # real: inf from step 20 (nearly every later step)
    assert all(map(math.isfinite, pens32)), pens32  # fp32 would hold it
    assert skipped[0] == 20 and len(skipped) >= 10, skipped
    rep = w.report()
    f = in_top3(rep, ("overflow",), "penalty", error_run=True)
    assert f.step == 20, (f.one_line(), lines(rep))


def test_gradient_penalty_weight_typo_1e6_collapses_the_loss_scale():
    """The documented parameter-gradient-norm recipe with the penalty weight typed 1e6 (for 1e-2 = 0.01): the
    scaled penalty's backward overflows fp16 until GradScaler has halved the scale 20+ times, and the task loss
    does not fall (checked against the same loop at 0.01)."""
    def run(lam):
        torch.manual_seed(0)
        m = mlp(8, 64, 64, 1)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
        task, scales = [], []
        for i in range(40):
            opt.zero_grad()
            x, y = regression(i)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.mse_loss(m(x).float(), y)
            grads = recipe_grads(sc, loss, list(m.parameters()))
            with torch.autocast("cpu", dtype=FP16):
                grad_norm = torch.cat([g.float().pow(2).sum().reshape(1) for g in grads]).sum().sqrt()
                total = loss + lam * grad_norm
            sc.scale(total).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            task.append(loss.item())
            scales.append(sc.get_scale())
        w.close()
        return w, task, scales
    _, good, good_scales = run(0.01)
    w, task, scales = run(1e6)
    assert sum(good[-5:]) < 0.6 * sum(good[:5]) and min(good_scales) >= 512, (good, good_scales)
    assert min(scales) < 1e-2 and sum(task[-5:]) > 0.8 * sum(task[:5]), (task, scales)  # real
    rep = w.report()
    assert any(f.rule == "loss_scale_collapse" for f in rep.findings[:3]) and rep.exit_code == 1, lines(rep)


# ======================================================================================================================
# (B) healthy state outside the optimizer
# ======================================================================================================================
def fp16_fit(m, step_loss, steps, opt, init_scale=65536.0, clip=1.0, after=None, params=None):
    """zero_grad -> step_loss(i) under fp16 autocast -> scale.backward -> unscale_ -> clip -> step -> update ->
    after(i) under no_grad, watched at the defaults. Returns (watch, losses, scales)."""
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    params = params or [p for p in m.parameters() if p.requires_grad]
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = step_loss(i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        sc.step(opt)
        sc.update()
        if after:
            with torch.no_grad():
                after(i)
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    return w, losses, scales


def blobs(i, n=64, d=16, k=4, loc=20.0, spread=8.0):
    """k gaussian classes in d dims, off-centre and wide (raw features: BatchNorm's running stats matter)."""
    g = gen(i)
    centres = torch.randn(k, d, generator=gen(77)) * 1.5
    y = torch.randint(0, k, (n,), generator=g)
    return loc + spread * (centres[y] + torch.randn(n, d, generator=g)), y


def test_batchnorm1d_running_stats_under_fp16_autocast_with_eval_passes():
    """BatchNorm1d after each Linear on raw off-centre features; an eval pass under autocast every 10 steps uses
    the fp32 running stats (and must score about as well as training)."""
    torch.manual_seed(10)
    m = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                      nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    xv, yv = blobs(999, n=256)
    accs = []

    def after(i):
        if i % 10 == 9:
            m.eval()
            with torch.autocast("cpu", dtype=FP16):
                accs.append((m(xv).argmax(1) == yv).float().mean().item())
            m.train()

    def step_loss(i):
        x, y = blobs(i)
        return F.cross_entropy(m(x).float(), y)
    w, losses, scales = fp16_fit(m, step_loss, 50, opt, after=after)
    healthy(losses, scales, fall=0.5)
    assert accs[-1] > 0.9 and m[1].running_var.dtype == torch.float32, (accs, m[1].running_var.dtype)
    quiet(w)


class HalfBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(16, 64), nn.BatchNorm1d(64)
        self.fc2, self.bn2 = nn.Linear(64, 64), nn.BatchNorm1d(64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.fc1(x)))
        return self.head(torch.relu(self.bn2(self.fc2(x))))


def half_master_loop(m, batch, steps, lr=1e-3, eval_at=()):
    """The classic mixed-precision recipe without autocast: the model itself `.half()` (BatchNorm's buffers too),
    fp32 master copies held by the optimizer; fp16 grads copied into the masters, unscale_ -> clip -> step -> update
    on the masters, then the masters copied back into the fp16 model. Returns (watch, losses, scales, rvs, evals):
    bn1's running_var after each step and eval-mode outputs at `eval_at`."""
    m.half()
    masters = [p.detach().float().clone().requires_grad_(True) for p in m.parameters()]
    opt = torch.optim.AdamW(masters, lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales, rvs, evals = [], [], [], {}
    for i in range(steps):
        x, y = batch(i)
        opt.zero_grad()
        m.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x.half()).float(), y)
        sc.scale(loss).backward()
        for mp, p in zip(masters, m.parameters()):
            mp.grad = p.grad.float()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        sc.step(opt)
        sc.update()
        with torch.no_grad():
            for mp, p in zip(masters, m.parameters()):
                p.copy_(mp)
        losses.append(loss.item())
        scales.append(sc.get_scale())
        rvs.append(m.bn1.running_var.detach().clone())
        if i in eval_at:
            m.eval()
            with torch.no_grad():
                evals[i] = m(blobs(999, n=128)[0].half()).float()
            m.train()
    w.close()
    return w, losses, scales, rvs, evals


def test_half_model_with_batchnorm_and_fp32_master_weights():
    torch.manual_seed(11)
    m = HalfBNNet()
    w, losses, scales, rvs, evals = half_master_loop(m, lambda i: blobs(i, loc=2.0, spread=3.0), 50, eval_at=(49,))
    healthy(losses, scales, fall=0.5)
    assert m.bn1.running_var.dtype == FP16 and torch.isfinite(rvs[-1]).all() and torch.isfinite(evals[49]).all()
    quiet(w)


class WithEMA(nn.Module):
    """The trained net and its fp32 EMA copy in one module (so one checkpoint holds both)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
        self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def forward(self, x):
        return self.net(x)


def test_fp32_ema_copy_updated_by_lerp_every_step_and_evaluated_under_autocast():
    torch.manual_seed(12)
    m = WithEMA()
    opt = torch.optim.AdamW(m.net.parameters(), lr=3e-3)
    ev = []

    def after(i):
        decay = min(0.99, (1 + i) / (10 + i))  # timm-style warmup of the decay
        for pe, p in zip(m.ema.parameters(), m.net.parameters()):
            pe.lerp_(p, 1 - decay)
        if i % 10 == 9:
            x, y = blobs(500, loc=0.0, spread=1.0)
            with torch.autocast("cpu", dtype=FP16):
                ev.append(F.cross_entropy(m.ema(x).float(), y).item())

    def step_loss(i):
        x, y = blobs(i, loc=0.0, spread=1.0)
        return F.cross_entropy(m(x).float(), y)
    w, losses, scales = fp16_fit(m, step_loss, 50, opt, after=after)
    healthy(losses, scales, fall=0.5)
    assert ev[-1] < 0.7 * ev[0] and m.ema[0].weight.dtype == torch.float32, ev
    quiet(w)


class MoCoV3(nn.Module):
    """MoCo v3 without a queue: a base encoder + projector + predictor, a momentum encoder (fp32, no grad) updated
    with a cosine momentum schedule 0.99 -> 1; symmetric InfoNCE over in-batch keys."""

    def __init__(self, d=32):
        super().__init__()
        self.base = nn.Sequential(mlp(16, 64, 64, act=nn.ReLU), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, d))
        self.momentum = copy.deepcopy(self.base).requires_grad_(False)
        self.predictor = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, d))

    def forward(self, v1, v2):
        q1, q2 = self.predictor(self.base(v1)), self.predictor(self.base(v2))
        with torch.no_grad():
            k1, k2 = self.momentum(v1), self.momentum(v2)
        return q1, q2, k1, k2


def infonce(q, k, t=0.2):
    q, k = F.normalize(q.float(), dim=1), F.normalize(k.float(), dim=1)
    logits = q @ k.t() / t
    return F.cross_entropy(logits, torch.arange(q.shape[0])) * 2 * t


def test_moco_v3_momentum_encoder_in_fp32_with_a_cosine_momentum_schedule():
    torch.manual_seed(13)
    m = MoCoV3()
    opt = torch.optim.AdamW([*m.base.parameters(), *m.predictor.parameters()], lr=2e-3)
    steps = 60

    def after(i):
        mom = 1 - (1 - 0.99) * (math.cos(math.pi * i / steps) + 1) / 2
        for pk, pq in zip(m.momentum.parameters(), m.base.parameters()):
            pk.mul_(mom).add_(pq.detach(), alpha=1 - mom)

    def step_loss(i):
        x, _ = blobs(i, loc=0.0, spread=1.0)
        g = gen(10_000 + i)
        v1 = x + 0.3 * torch.randn(x.shape, generator=g)
        v2 = x * (1 + 0.1 * torch.randn(x.shape, generator=g))
        q1, q2, k1, k2 = m(v1, v2)
        return infonce(q1, k2) + infonce(q2, k1)
    w, losses, scales = fp16_fit(m, step_loss, steps, opt, after=after,
                                 params=[*m.base.parameters(), *m.predictor.parameters()])
    healthy(losses, scales, fall=0.8)
    quiet(w)


class RunningNorm(nn.Module):
    """Welford-style running mean/var of its input (an RL observation normaliser inside the network), the batch
    statistics computed in fp32 from the fp16 activations; normalises with the running values."""

    def __init__(self, d, fp32=True):
        super().__init__()
        self.fp32 = fp32
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))
        self.register_buffer("count", torch.tensor(1e-4))

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                hs = h.float() if self.fp32 else h
                bm = hs.mean(0)
                bv = (hs - bm).pow(2).mean(0)  # fp16 when not fp32: (h - mean)**2 > 65504 for |h - mean| > 256
                n = h.shape[0]
                delta, tot = bm.float() - self.mean, self.count + n
                self.mean += delta * n / tot
                self.var.copy_((self.var * self.count + bv.float() * n + delta ** 2 * self.count * n / tot) / tot)
                self.count.copy_(tot)
        return (h - self.mean) / torch.sqrt(self.var + 1e-8)


class ValueNet(nn.Module):
    def __init__(self, fp32=True):
        super().__init__()
        self.enc = nn.Linear(16, 64)
        self.norm = RunningNorm(64, fp32=fp32)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.head(self.norm(self.enc(x)))


def returns(i, n=64, loud=None):
    x, _ = blobs(i, loc=0.0, spread=1.0)
    x = x * 30 + 5  # raw sensor units
    if i == loud:
        x[3] *= 40  # a sensor glitch: one reading 40x its range
    y = x[:, :4].mean(1, keepdim=True) / 30
    return x, y


def test_running_mean_var_normaliser_fed_fp32_statistics_survives_a_sensor_glitch():
    """The same glitch as the failure below (one sample x40 at step 15): the fp32 statistics hold it."""
    torch.manual_seed(14)
    m = ValueNet()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)

    def step_loss(i):
        x, y = returns(i, loud=15)
        return F.smooth_l1_loss(m(x).float(), y)
    w, losses, scales = fp16_fit(m, step_loss, 40, opt)
    assert torch.isfinite(m.norm.var).all() and all(map(math.isfinite, losses)), losses
    healthy(losses, scales, bounded=50.0)
    quiet(w)


class EMAQuantizer(nn.Module):
    """VQ-VAE codebook updated by EMA (van den Oord et al., appendix): fp32 buffers embed, cluster_size, embed_avg;
    distances in fp32; straight-through estimator."""

    def __init__(self, k=32, d=8, decay=0.99):
        super().__init__()
        self.decay = decay
        self.register_buffer("embed", torch.randn(k, d, generator=gen(5)))
        self.register_buffer("cluster_size", torch.ones(k))
        self.register_buffer("embed_avg", self.embed.clone())

    def forward(self, z):
        zf = z.float()
        idx = torch.cdist(zf, self.embed).argmin(1)
        q = self.embed[idx]
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.embed.shape[0]).float()
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ zf, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                cs = (self.cluster_size + 1e-5) / (n + 32 * 1e-5) * n
                self.embed.copy_(self.embed_avg / cs[:, None])
        commit = F.mse_loss(zf, q)
        return zf + (q - zf).detach(), commit


class VQVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = mlp(16, 64, 8)
        self.vq = EMAQuantizer()
        self.dec = mlp(8, 64, 16)

    def forward(self, x):
        zq, commit = self.vq(self.enc(x))
        return self.dec(zq), commit


def test_vqvae_codebook_updated_by_ema_in_fp32_buffers():
    torch.manual_seed(15)
    m = VQVAE()
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)

    def step_loss(i):
        x, _ = blobs(i, n=128, loc=0.0, spread=1.0)
        rec, commit = m(x)
        return F.mse_loss(rec.float(), x) + 0.25 * commit
    w, losses, scales = fp16_fit(m, step_loss, 60, opt)
    healthy(losses, scales, fall=0.8)
    assert m.vq.embed.dtype == torch.float32 and torch.isfinite(m.vq.embed).all()
    quiet(w)


class CountingNet(nn.Module):
    """register_buffer step counters: an int64 batch counter (like BatchNorm's num_batches_tracked) and a float one
    driving a warm-up gate on a residual branch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("batches", torch.zeros((), dtype=torch.long))
        self.register_buffer("t", torch.zeros(()))
        self.stem, self.branch, self.head = nn.Linear(16, 64), mlp(64, 64, 64), nn.Linear(64, 4)

    def forward(self, x):
        if self.training:
            self.batches += 1
            self.t += 1.0
        gate = torch.clamp(self.t / 20.0, max=1.0)
        h = torch.relu(self.stem(x))
        return self.head(h + gate * self.branch(h))


def test_int_and_float_step_counter_buffers():
    torch.manual_seed(16)
    m = CountingNet()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)

    def step_loss(i):
        x, y = blobs(i, loc=0.0, spread=1.0)
        return F.cross_entropy(m(x).float(), y)
    w, losses, scales = fp16_fit(m, step_loss, 40, opt)
    healthy(losses, scales, fall=0.5)
    assert m.batches.item() == 40 and m.t.item() == 40.0
    quiet(w)


# ======================================================================================================================
# (B) failing state outside the optimizer
# ======================================================================================================================
def test_running_mean_var_normaliser_with_fp16_statistics_goes_inf_on_a_sensor_glitch():
    """The normaliser above with its batch variance computed in fp16 ((h - mean)**2 of the fp16 activations): the
    glitch at step 15 makes the buffer inf; from then on (h - mean) / sqrt(inf) = 0 for those features, silently
    (finite outputs, losses and gradients, no skipped step)."""
    torch.manual_seed(14)
    m = ValueNet(fp32=False)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    inf_at = []

    def after(i):
        inf_at.append(bool(torch.isinf(m.norm.var).any()))

    def step_loss(i):
        x, y = returns(i, loud=15)
        return F.smooth_l1_loss(m(x).float(), y)
    w, losses, scales = fp16_fit(m, step_loss, 30, opt, init_scale=1024.0, after=after)
    assert inf_at.index(True) == 15 and all(inf_at[15:]), inf_at  # real: inf from the glitch on
    assert all(map(math.isfinite, losses)) and min(scales) == 1024.0, (losses, scales)  # silent
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        dead = torch.isinf(m.norm.var)
        assert (m.norm(m.enc(returns(0)[0]))[:, dead] == 0).all()  # those features are 0 for every later input
    rep = w.report()
    f = in_top3(rep, ("overflow",), "norm")
    assert f.step == 15, (f.one_line(), lines(rep))


def test_half_model_batchnorm_running_var_overflows_on_a_loud_batch():
    """The `.half()` model with fp32 masters above; at step 20 one batch arrives in raw units (x300, a missing
    normalisation on one shard): bn1's batch variance ~1e6 is inf in its fp16 running_var. Training mode uses batch
    statistics, so the loss stays finite and nothing is skipped; at eval every output is the same constant (x /
    sqrt(inf) = 0 after bn1)."""
    torch.manual_seed(11)
    m = HalfBNNet()

    def batch(i):
        x, y = blobs(i, loc=2.0, spread=3.0)
        return (x * 300 if i == 20 else x), y
    w, losses, scales, rvs, evals = half_master_loop(m, batch, 30, eval_at=(19, 29))
    assert torch.isfinite(rvs[19]).all() and torch.isinf(rvs[20]).any() and torch.isinf(rvs[-1]).any(), rvs[20]
    assert all(map(math.isfinite, losses)) and min(scales) == 1024.0, (losses, scales)  # silent in training
    dead = torch.isinf(rvs[-1])
    assert dead.sum() > 5, dead.sum()
    assert evals[19].std(0).min() > 0 and torch.isfinite(evals[29]).all()
    rep = w.report()
    f = in_top3(rep, ("overflow",), "bn1")
    assert f.step == 20, (f.one_line(), lines(rep))


class MeanTeacher(nn.Module):
    """Mean teacher (Tarvainen & Valpola) for semi-supervised classification: a student and an EMA teacher, the
    teacher kept in fp16 ("inference only") and updated with lerp_ at momentum 0.9999; consistency loss on
    unlabelled data."""

    def __init__(self):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.teacher = copy.deepcopy(self.student).half().requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x.half())
        return self.student(x), t


def test_fp16_mean_teacher_updated_by_lerp_rounds_every_update_away():
    torch.manual_seed(17)
    m = MeanTeacher()
    opt = torch.optim.AdamW(m.student.parameters(), lr=3e-3)
    t0 = [p.detach().clone() for p in m.teacher.parameters()]
    shadow = [p.detach().float().clone() for p in m.teacher.parameters()]  # what an fp32 teacher would hold

    def after(i):
        for pt, ps, sh in zip(m.teacher.parameters(), m.student.parameters(), shadow):
            pt.lerp_(ps.half(), 1e-4)
            sh.lerp_(ps, 1e-4)

    def step_loss(i):
        x, y = blobs(i, loc=0.0, spread=1.0)
        u, _ = blobs(1000 + i, loc=0.0, spread=1.0)
        s, _ = m(x)
        su, tu = m(u)
        return F.cross_entropy(s.float()[:16], y[:16]) + F.mse_loss(su.float().softmax(1), tu.float().softmax(1))
    w, losses, scales = fp16_fit(m, step_loss, 40, opt, after=after, params=list(m.student.parameters()))
    n = sum(a.numel() for a in t0)
    same = sum((a == b).sum().item() for a, b in zip(t0, m.teacher.parameters())) / n
    moved = sum((a.float() != b).sum().item() for a, b in zip(t0, shadow)) / n
    assert same > 0.9 and moved > 0.99, (same, moved)  # real: the fp32 EMA moves every weight, the fp16 one ~none
    rep = w.report()
    assert any(f.rule == "update_underflow" and (f.module or "").startswith("teacher") for f in rep.findings[:3]), \
        lines(rep)
