"""SCIENTIFIC / IMPLICIT-FIELD MODELS under fp16, in plain PyTorch on CPU: a physics-informed network (PDE residual
by torch.autograd.grad(create_graph=True) inside the forward), a NeRF-style field with positional encoding, a SIREN,
a neural ODE (fixed-step RK4 unrolled 50 steps), Fourier neural operators (torch.fft in fp32, the spectral weights
in fp16; a relative-L2 loss), an energy-conserving dynamics model and a conformation generator with a
Lennard-Jones prior - each broken by an fp16 hazard these models are known for, injected at step 5 (BAD).

Loop: probe_harness.probe_run (AdamW, GradScaler("cpu") at its defaults, CPU fp16 autocast, unscale_ ->
clip_grad_norm_(1.0) -> scaler.step -> scaler.update, ampdoctor.watch(model, optimizer=, scaler=, run_dir=tmp_path)
at the default sampling). Injections: the bad step's batch itself (a tile in metres, a field in kelvin, fast
particles, a quiescent sample), a parameter changed under no_grad before its forward (an lr spike's update, two
atoms moved together) or a schedule (coarse-to-fine bands opened).

Oracle for every failure (a failing oracle is a plain failure, never an xfail): the loss is first non-finite at the
bad step and the scaler skips it; probe_harness.Producer's first forward producer is the expected module at that
step (None for energy_drift: the loss written in the loop, CONTRACT.md's module null / "(run)", where every model
output is finite); the bad step re-run from the weights it ran with (snap_at) gives a non-finite loss under fp16
autocast, and finite outputs and loss in fp32 (fp16's doing). Report check (`producer_top3`): among the first three
findings a warning/error of an accepted rule at the expected module and the bad step, phase forward (or null;
pinn_kelvin also backward: its inf is made by autograd.grad's derivative graph, run inside the forward), and no
overflow/nan_origin error at another named module at that step; else WrongAnswer (strict xfail via `wrong`).

Failures:
 1. pinn_kelvin   heat-equation PINN u = 1e3 * net(x, t) (temperature in kelvin, not made dimensionless), residual
                  u_t - u_xx in the submodule `pde` by two autograd.grad(create_graph=True) calls under autocast; an
                  lr spike scales the first layer x100 at step 5: the fp16 second-derivative graph (aten::mm)
                  passes 65504 inside `pde` (fp32: ~4e5, finite)                             -> overflow at pde.
 2. nerf_bands    NeRF field: a learned pose refinement (Linear, fp16 points) -> positional encoding sin/cos(2^k pi
                  p) computed in p's dtype, coarse-to-fine (8 bands open); the schedule opens all 16 at step 5:
                  2^15 pi p > 65504 for |p| > 0.64, sin(inf) = NaN                   -> overflow/nan_origin at enc.
 3. siren_metres  SIREN (omega_0 = 30); at step 5 the loader hands the tile in metres (2000-6000, not normalized):
                  the first Linear's output (up to ~3700) is finite, 30 x it is not  -> overflow/nan_origin at
                  layers.0 (the sine layer, not layers.0.linear).
 4. node_rk4      neural ODE, RK4 unrolled 50 steps with the state in fp16 (y0 from an fp16 Linear); an lr spike
                  scales the dynamics' output layer x16 at step 5: the state and its k-sum pass 65504 in RK4's
                  own additions                                                              -> overflow at ode.
 5. fno_kelvin    FNO1d (N = 1024): rfft in fp32, the spectral multiply as real einsums in fp16; at step 5 a
                  field in kelvin (+300): the DC coefficient (> 65504) is cast to fp16: inf -> overflow at spec.
 6. fno_rel_l2    FNO1d on the operator-learning relative L2 loss ||pred - y|| / (||y|| + 1e-8) in the submodule
                  `rel`, the target cast to the prediction's dtype; at step 5 a quiescent sample (y = 0): 1e-8 is 0
                  in fp16, x / 0 = inf                                          -> eps_underflow/overflow at rel.
 7. energy_drift  next-velocity predictor (fp16 out), the loop's loss adds the relative kinetic-energy drift
                  0.5 (v^2).sum() from the fp16 prediction; at step 5 fast particles (~300 m/s): v^2 > 65504
                                                                                 -> overflow/nan_origin at (run).
 8. lj_collapse   conformation generator (a Linear -> 6 atom positions, fp16) with a Lennard-Jones prior 4 ((1/r^2)^6
                  - (1/r^2)^3) in the submodule `lj`; an update moves atom 1 to 0.2 sigma of atom 0 at step 5:
                  (1/r^2)^6 = 2.4e8                                                           -> overflow at lj.
Healthy twins (the fixed form), each run with and without the watch: losses and final weights bitwise identical,
every loss finite, no producer, no skip after the scaler's first steps, no RuntimeWarning, finite weights, the loss
fell (last fifth < 0.95 x first fifth), no warning/error in the report: pinn_nondim (u dimensionless, the same
autograd.grad residual), nerf_fp32_enc (pose refinement and encoding in fp32, all 16 bands opened at step 5; the
pose kept in fp16 makes the scaler skip steps 5-13 and 33: d sin(2^15 pi p)/dp ~ 1e5 overflows p's fp16 gradient),
siren_normalized (the metre tiles at steps 5, 17, 29 normalized by the loader), node_fp32_state (RK4 state in fp32),
fno_fp32_spectral (spectral multiply with autocast off), fno_rel_l2_fp32 (the relative L2 in fp32), energy_fp32
(energy from the fp32 prediction, fast particles at steps 5, 17, 29), lj_clamped (r^2 clamped at 0.64 sigma^2).

Result when written (torch 2.13 CPU, 2 runs identical): 16 pass, 0 xfail, the whole file ~11 s. Top findings:
 1 pinn_kelvin   `[error] overflow at pde aten::mm step 5: aten::mm in `pde` overflowed float16: finite inputs (max
                 |x| = 3776) gave ±inf (max 65504)` (phase forward).
 2 nerf_bands    `[error] overflow at enc aten::mul step 5: ... produced ±inf from finite inputs; it propagates to
                 aten::sin in `enc``.
 3 siren_metres  `[error] overflow at layers.0 aten::mul step 5` (propagates to aten::sin in `layers.0`).
 4 node_rk4      `[error] overflow at ode aten::add step 5` (propagates to aten::addmm in `ode.f.2`).
 5 fno_kelvin    `[error] overflow at spec aten::_to_copy step 5` (propagates to aten::bmm in `spec`).
 6 fno_rel_l2    `[error] eps_underflow at rel aten::add step 5: aten::add in `rel` uses eps 1e-08, which rounds
                 to 0 in float16: the guard does nothing`.
 7 energy_drift  `[error] overflow at (run) step 5: The loss became inf outside the watched model (in the loss
                 computation) while the model's outputs were finite (... in fp16: a power (a square past 255.9),
                 ...)`.
 8 lj_collapse   `[error] overflow at lj aten::mul step 5`.
 Twins: no warning or error.
No wrong answer found.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import failure_oracle, probe_run, producer_top3, twin_checks, wrong
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

AC = dict(device_type="cpu", dtype=torch.float16)
BAD = 5


def no_autocast(flag):
    """Autocast off inside (the fixed form's fp32 island) where `flag`, else the loop's setting unchanged."""
    return torch.autocast("cpu", enabled=False) if flag else contextlib.nullcontext()


def rn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(8100 + seed))


def rnd(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(8200 + seed))


# ------------------------------------------------------------------------------------------------------------ PINN

class HeatResidual(nn.Module):
    """The heat equation's residual u_t - alpha u_xx at the collocation points, both derivatives by
    torch.autograd.grad(create_graph=True) (run under the loop's autocast: the derivative graph of the fp16 net)."""

    def __init__(self, alpha=1.0):
        super().__init__()
        self.alpha = alpha

    def forward(self, u, xt):
        g = torch.autograd.grad(u.sum(), xt, create_graph=True)[0]
        u_xx = torch.autograd.grad(g[:, 0].sum(), xt, create_graph=True)[0][:, 0]
        return g[:, 1] - self.alpha * u_xx


class PINN(nn.Module):
    """u(x, t) = scale * net(x, t) (scale 1e3: the temperature in kelvin, not made dimensionless); returns the PDE
    residual at the collocation points and u at the initial-condition points."""

    def __init__(self, scale=1e3, hid=32):
        super().__init__()
        self.scale = scale
        self.net = nn.Sequential(nn.Linear(2, hid), nn.Tanh(), nn.Linear(hid, hid), nn.Tanh(), nn.Linear(hid, 1))
        self.pde = HeatResidual()

    def forward(self, xt, xb):
        with torch.enable_grad():
            xt = xt.detach().requires_grad_(True)
            u = self.scale * self.net(xt)
            r = self.pde(u, xt)
        return r, self.scale * self.net(xb)


def pinn_loss(out, y):
    r, ub = out
    s = y[1]
    return (r.float() / s).pow(2).mean() + ((ub.float().squeeze(-1) - s * y[0]) / s).pow(2).mean()


def b_pinn(bad=None):
    def b(i):
        xt = rnd(128, 2, seed=i % 4) * torch.tensor([2.0, 1.0]) - torch.tensor([1.0, 0.0])
        x0 = rnd(64, 1, seed=10 + i % 4) * 2 - 1
        xb = torch.cat([x0, torch.zeros(64, 1)], -1)
        return (xt, xb), (torch.sin(math.pi * x0[:, 0]), 1.0)
    return b


def pinn_loss_k(out, y):
    """The kelvin model's loss: residual and initial condition divided by the temperature scale, in fp32."""
    return pinn_loss(out, (y[0], 1e3))


# ------------------------------------------------------------------------------------------------------ NeRF-style

class PosEnc(nn.Module):
    """NeRF positional encoding [p, sin(2^k pi p), cos(2^k pi p)] for k < n_freq, computed in p's dtype; coarse to
    fine (BARF): only the first `open` bands are computed, the others are zeros. `fp32`: computed from p.float()."""

    def __init__(self, n_freq=16, open_=8, fp32=False):
        super().__init__()
        self.n_freq, self.open, self.fp32 = n_freq, open_, fp32

    def forward(self, p):
        if self.fp32:
            p = p.float()
        feats = [p]
        for k in range(self.n_freq):
            if k < self.open:
                a = (2.0 ** k * math.pi) * p
                feats += [torch.sin(a), torch.cos(a)]
            else:
                feats += [torch.zeros_like(p), torch.zeros_like(p)]
        return torch.cat(feats, -1)


class Field(nn.Module):
    """A NeRF-style field: `pose` (a learned 3x3 refinement of the sample points, BARF; identity at start), `enc`,
    an MLP to rgb."""

    def __init__(self, fp32=False, open_=8, hid=64):
        super().__init__()
        self.pose = nn.Linear(3, 3)
        with torch.no_grad():
            self.pose.weight.copy_(torch.eye(3))
            self.pose.bias.zero_()
        self.enc = PosEnc(16, open_, fp32)
        self.mlp = nn.Sequential(nn.Linear(3 * 33, hid), nn.ReLU(), nn.Linear(hid, 3))

    def forward(self, p):
        with no_autocast(self.enc.fp32):
            q = self.pose(p)
        return self.mlp(self.enc(q))


def field_target(p):
    return torch.stack([torch.sin(3 * p[:, 0]), torch.cos(2 * p[:, 1]), p[:, 2] * p[:, 0]], -1)


def b_field(bad=None):
    def b(i):
        p = rnd(256, 3, seed=20 + i % 4) * 2 - 1
        return (p,), field_target(p)
    return b


def mse(out, y):
    return F.mse_loss(out.float(), y)


def open_all(i, m, bad):
    """The coarse-to-fine schedule opens every band (up to 2^15 pi) at `bad`."""
    if i == bad:
        m.enc.open = 16


# ----------------------------------------------------------------------------------------------------------- SIREN

class Sine(nn.Module):
    """SIREN layer sin(omega_0 * linear(x)), omega_0 = 30, the SIREN initialization."""

    def __init__(self, d_in, d_out, first=False, omega=30.0):
        super().__init__()
        self.omega = omega
        self.linear = nn.Linear(d_in, d_out)
        bound = 1 / d_in if first else math.sqrt(6 / d_in) / omega
        nn.init.uniform_(self.linear.weight, -bound, bound)

    def forward(self, x):
        return torch.sin(self.omega * self.linear(x))


class Siren(nn.Module):
    def __init__(self, hid=64):
        super().__init__()
        self.layers = nn.Sequential(Sine(2, hid, first=True), Sine(hid, hid), nn.Linear(hid, 1))

    def forward(self, x):
        return self.layers(x)


SITE = torch.tensor([3000.0, 5000.0])            # the survey tile's origin, metres


def siren_target(xy):
    return (torch.sin(3 * xy[:, 0]) * torch.cos(2 * xy[:, 1]))[:, None]


def b_siren(bad=None, normalize=False, metres=()):
    """Coordinates in [-1, 1]; at `bad` (and the steps in `metres`) the loader hands the tile in metres
    (SITE + 1000 * the normalized coordinates) - normalized back by the loader with `normalize`."""
    def b(i):
        xy = rnd(256, 2, seed=30 + i % 4) * 2 - 1
        y = siren_target(xy)
        if i == bad or i in metres:
            xy = SITE + 1000.0 * xy
            if normalize:
                xy = (xy - SITE) / 1000.0
        return (xy,), y
    return b


# ------------------------------------------------------------------------------------------------------ neural ODE

class RK4(nn.Module):
    """Fixed-step RK4 of dy/dt = f(y) unrolled `n` steps; the state kept in y0's dtype (`fp32`: in fp32)."""

    def __init__(self, d=8, hid=32, n=50, dt=0.1, fp32=False):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, hid), nn.ReLU(), nn.Linear(hid, d))
        self.n, self.dt, self.fp32 = n, dt, fp32

    def forward(self, y):
        if self.fp32:
            y = y.float()
        h = self.dt
        for _ in range(self.n):
            k1 = self.f(y)
            k2 = self.f(y + 0.5 * h * k1)
            k3 = self.f(y + 0.5 * h * k2)
            k4 = self.f(y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return y


class NeuralODE(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.ode = RK4(fp32=fp32)
        self.dec = nn.Linear(8, 4)

    def forward(self, x):
        return self.dec(self.ode(self.enc(x)))


def b_ode(bad=None):
    rot = rn(4, 4, seed=40) * 0.3

    def b(i):
        x = rn(64, 4, seed=41 + i % 4)
        return (x,), torch.tanh(x @ rot)
    return b


def scale_param(path, k):
    """An lr spike's update: param `path` x k at `bad`."""
    def inj(i, m, bad):
        if i == bad:
            m.get_parameter(path).mul_(k)
    return inj


# ------------------------------------------------------------------------------------------- Fourier neural operator

class SpectralConv1d(nn.Module):
    """FNO spectral convolution: rfft in fp32 (the user's .float(): no fp16 FFT on CPU), the first `modes` Fourier
    coefficients multiplied by complex weights as two real einsums (fp16 under autocast; `fp32`: autocast off),
    irfft back."""

    def __init__(self, c=16, modes=12, fp32=False):
        super().__init__()
        self.modes, self.fp32 = modes, fp32
        s = 1 / (c * c)
        self.wr = nn.Parameter(s * torch.rand(c, c, modes))
        self.wi = nn.Parameter(s * torch.rand(c, c, modes))

    def forward(self, x):                                   # x: (B, C, N)
        n = x.shape[-1]
        xf = torch.fft.rfft(x.float())[..., :self.modes]
        xr, xi = xf.real, xf.imag
        with no_autocast(self.fp32):
            wr, wi = (self.wr.float(), self.wi.float()) if self.fp32 else (self.wr, self.wi)
            yr = torch.einsum("bim,iom->bom", xr, wr) - torch.einsum("bim,iom->bom", xi, wi)
            yi = torch.einsum("bim,iom->bom", xr, wi) + torch.einsum("bim,iom->bom", xi, wr)
        out = torch.zeros(x.shape[0], yr.shape[1], n // 2 + 1, dtype=torch.complex64)
        out[..., :self.modes] = torch.complex(yr.float(), yi.float())
        return torch.fft.irfft(out, n=n)


class FNO1d(nn.Module):
    def __init__(self, c=16, fp32=False):
        super().__init__()
        self.lift = nn.Linear(2, c)
        self.spec = SpectralConv1d(c, fp32=fp32)
        self.w = nn.Conv1d(c, c, 1)
        self.proj = nn.Linear(c, 1)

    def forward(self, u):                                   # u: (B, N)
        grid = torch.linspace(0, 1, u.shape[-1]).expand_as(u)
        h = self.lift(torch.stack([u, grid], -1)).transpose(1, 2)
        h = F.gelu(self.spec(h) + self.w(h))
        return self.proj(h.transpose(1, 2)).squeeze(-1)


N_FNO = 1024


def b_fno(bad=None, kelvin=()):
    """u(x, 0) fields (a few random modes, ~1); target: the field smoothed (a heat-equation step). At `bad` (and
    `kelvin`) the sample comes from a file in kelvin: +300 (the same offset on the target)."""
    xs = torch.linspace(0, 1, N_FNO)

    def b(i):
        a = rn(8, 4, seed=50 + i % 4)
        k = torch.arange(1, 5, dtype=torch.float32)
        u = (a[:, :, None] * torch.sin(math.pi * k[None, :, None] * xs)).sum(1)
        y = (a[:, :, None] * torch.exp(-0.05 * k[None, :, None] ** 2) * torch.sin(math.pi * k[None, :, None] * xs)
             ).sum(1)
        if i == bad or i in kelvin:
            u, y = u + 300.0, y + 300.0
        return (u,), y
    return b


class RelL2(nn.Module):
    """The operator-learning relative L2 loss ||pred - y|| / (||y|| + 1e-8) per sample, the target cast to the
    prediction's dtype (`fp32`: both in fp32)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, pred, y):
        pred = pred.float() if self.fp32 else pred
        y = y.to(pred.dtype)
        num = ((pred - y) ** 2).sum(-1).sqrt()
        den = (y * y).sum(-1).sqrt() + 1e-8
        return (num / den).mean()


class FNOLp(nn.Module):
    """FNO1d trained on the relative L2 loss, computed by the submodule `rel`."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fno = FNO1d()
        self.rel = RelL2(fp32)

    def forward(self, u, y):
        return self.rel(self.fno(u), y)


def b_fno_lp(bad=None):
    """b_fno's fields as (u, y) inputs; at `bad` sample 0 is the quiescent field (u = y = 0)."""
    inner = b_fno()

    def b(i):
        (u,), y = inner(i)
        if i == bad:
            u, y = u.clone(), y.clone()
            u[0], y[0] = 0.0, 0.0
        return (u, y), None
    return b


def own(out, y):
    return out.float()


# -------------------------------------------------------------------------------------- energy-conserving dynamics

class VelNet(nn.Module):
    """Next-velocity predictor v' = skip(v) + mlp([x, v]), `skip` a Linear initialized to the identity (fp16 out)."""

    def __init__(self, hid=32):
        super().__init__()
        self.skip = nn.Linear(3, 3)
        with torch.no_grad():
            self.skip.weight.copy_(torch.eye(3))
            self.skip.bias.zero_()
        self.mlp = nn.Sequential(nn.Linear(6, hid), nn.Tanh(), nn.Linear(hid, 3))

    def forward(self, x, v):
        return self.skip(v) + self.mlp(torch.cat([x, v], -1))


ROT = torch.linalg.qr(rn(3, 3, seed=60))[0]


def b_vel(bad=None, fast=()):
    """A rotation of the velocity (energy conserved); at `bad` (and `fast`) the batch holds fast particles: speeds
    ~300 (m/s, the file not in the km/s the others use)."""
    def b(i):
        x, v = rn(64, 3, seed=61 + i % 4), rn(64, 3, seed=65 + i % 4)
        if i == bad or i in fast:
            v = v * 300.0
        return (x, v), v @ ROT
    return b


def energy_loss(out, y):
    """MSE + the relative kinetic-energy drift, the predicted energy written from the fp16 prediction."""
    e_pred = 0.5 * (out ** 2).sum(-1)
    e_true = 0.5 * (y ** 2).sum(-1)
    rel = F.mse_loss(out.float(), y) / y.pow(2).mean()
    return rel + ((e_pred - e_true) / e_true).pow(2).mean()


def energy_loss32(out, y):
    return energy_loss(out.float(), y)


# ----------------------------------------------------------------------------------------- Lennard-Jones generator

N_AT = 6


def lattice():
    return torch.tensor([[1.5 * k, 0.3 * (k % 2), 0.0] for k in range(N_AT)])


class LJ(nn.Module):
    """Lennard-Jones energy 4 ((s/r)^12 - (s/r)^6) over pairs i < j, sigma = 1, from r^2 in the positions' dtype;
    `r2_min`: r^2 clamped below (the fixed form)."""

    def __init__(self, r2_min=None):
        super().__init__()
        self.r2_min = r2_min

    def forward(self, pos):                                 # (B, n, 3)
        d = pos[:, :, None] - pos[:, None]
        r2 = (d * d).sum(-1)
        n = pos.shape[1]
        iu = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        r2 = r2[:, iu]
        if self.r2_min is not None:
            r2 = r2.clamp_min(self.r2_min)
        inv6 = (1.0 / r2) ** 3
        return (4 * (inv6 * inv6 - inv6)).sum(-1)


class ConfGen(nn.Module):
    """A conformation generator z -> positions (a Linear, its bias the lattice), with its LJ energy."""

    def __init__(self, zd=4, r2_min=None):
        super().__init__()
        self.gen = nn.Linear(zd, N_AT * 3)
        with torch.no_grad():
            self.gen.weight.mul_(0.1)
            self.gen.bias.copy_(lattice().flatten())
        self.lj = LJ(r2_min)

    def forward(self, z):
        pos = self.gen(z).view(-1, N_AT, 3)
        return pos, self.lj(pos)


CONF_P = rn(4, N_AT * 3, seed=70) * 0.05


def b_conf(bad=None):
    def b(i):
        z = rn(32, 4, seed=71 + i % 4)
        return (z,), (lattice().flatten() + z @ CONF_P).view(-1, N_AT, 3)
    return b


def conf_loss(out, y):
    pos, e = out
    return F.mse_loss(pos.float(), y) + 1e-4 * e.float().mean()


def collapse(i, m, bad):
    """An update moves atom 1 onto atom 0 (0.2 sigma apart) at `bad`."""
    if i == bad:
        w, b = m.gen.weight, m.gen.bias
        w[3:6] = w[0:3]
        b[3:6] = b[0:3] + torch.tensor([0.2, 0.0, 0.0])


# ---------------------------------------------------------------------------------------------------------- cases
# name: (factory, batch(bad), loss_fn, inject(i, m, bad) or None, bad step, expected module (None = outside the
# model, "(run)"), accepted rules, accepted phases)
FWD = ("forward", None)
CASES = {
    "pinn_kelvin": (lambda: PINN(1e3), b_pinn, pinn_loss_k, scale_param("net.0.weight", 100.0), BAD, "pde",
                    ("overflow", "nan_origin"), ("forward", "backward", None)),
    "nerf_bands": (lambda: Field(), b_field, mse, open_all, BAD, "enc", ("overflow", "nan_origin"), FWD),
    "siren_metres": (lambda: Siren(), b_siren, mse, None, BAD, "layers.0", ("overflow", "nan_origin"), FWD),
    "node_rk4": (lambda: NeuralODE(), b_ode, mse, scale_param("ode.f.2.weight", 16.0), BAD, "ode",
                 ("overflow",), FWD),
    "fno_kelvin": (lambda: FNO1d(), b_fno, mse, None, BAD, "spec", ("overflow",), FWD),
    "fno_rel_l2": (lambda: FNOLp(), b_fno_lp, own, None, BAD, "rel", ("eps_underflow", "overflow"), FWD),
    "energy_drift": (lambda: VelNet(), b_vel, energy_loss, None, BAD, None, ("overflow", "nan_origin"), FWD),
    "lj_collapse": (lambda: ConfGen(), b_conf, conf_loss, collapse, BAD, "lj", ("overflow",), FWD),
}

XFAIL = {}


def build(factory, seed=0):
    torch.manual_seed(seed)
    return factory()


def run_case(name, tmp_path):
    factory, mk, loss_fn, inj, bad, *_ = CASES[name]
    m = build(factory)
    inject = None if inj is None else (lambda i, mm: inj(i, mm, bad))
    return probe_run(m, mk(bad), loss_fn, bad + 2, str(tmp_path / "run"), inject=inject, snap_at=bad)


def replay_bad(name, r):
    """The bad step's forward from the weights (and schedule) it ran with, under fp16 autocast and in fp32: (model
    output fp16, loss fp16, model output fp32, loss fp32)."""
    factory, mk, loss_fn, inj, bad, *_ = CASES[name]
    m = build(factory)
    if inj is open_all:
        m.enc.open = 16
    m.load_state_dict(r["sd"])
    args, y = mk(bad)(bad)
    with torch.no_grad():
        with torch.autocast(**AC):
            o16 = m(*args)
        l16 = loss_fn(o16, y)
        o32 = m(*args)
        l32 = loss_fn(o32, y)
    return o16, l16, o32, l32


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_sciml_fails(name, tmp_path):
    *_, bad, where, rules, phases = CASES[name]
    r = run_case(name, tmp_path)
    # oracle (probe_harness.failure_oracle): the loss first non-finite at the injected step, skipped; its
    # producer (None: user code outside the model); the step replayed fails in fp16 and is finite in fp32
    failure_oracle(r, bad, where, replay_bad(name, r))
    f = producer_top3(r["rep"], rules, where, bad, phases=phases)
    print(name, "->", f.phase, f.one_line(), "|", f.fix[:80])


# ---------------------------------------------------------------------------------------------------------- twins
# name: (factory, batch, loss_fn, inject or None, steps, lr)

def open_at(step):
    def inj(i, m, bad):
        if i == step:
            m.enc.open = 16
    return inj


TWINS = {
    "pinn_nondim": (lambda: PINN(1.0), b_pinn, pinn_loss, None, 40, 3e-3),
    "nerf_fp32_enc": (lambda: Field(fp32=True), b_field, mse, open_at(BAD), 40, 3e-3),
    "siren_normalized": (lambda: Siren(), lambda bad: b_siren(normalize=True, metres=(5, 17, 29)), mse, None, 40,
                         1e-3),
    "node_fp32_state": (lambda: NeuralODE(fp32=True), b_ode, mse, None, 30, 3e-3),
    "fno_fp32_spectral": (lambda: FNO1d(fp32=True), b_fno, mse, None, 30, 3e-3),
    "fno_rel_l2_fp32": (lambda: FNOLp(fp32=True), b_fno_lp, own, None, 30, 3e-3),
    "energy_fp32": (lambda: VelNet(), lambda bad: b_vel(fast=(5, 17, 29)), energy_loss32, None, 40, 3e-3),
    "lj_clamped": (lambda: ConfGen(r2_min=0.64), b_conf, conf_loss, None, 40, 3e-3),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_sciml_twin(name, tmp_path):
    factory, mk, loss_fn, inj, steps, lr = TWINS[name]
    runs = []
    for watch in (True, False):
        m = build(factory)
        inject = None if inj is None else (lambda i, mm: inj(i, mm, BAD))
        runs.append(probe_run(m, mk(None), loss_fn, steps, str(tmp_path / f"w{watch}"), inject=inject, lr=lr,
                              watch=watch))
    r, plain = runs
    twin_checks(r, plain, steps)
