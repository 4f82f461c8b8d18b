"""Sixty-first set: FP16 FAILURES IN MODEL FAMILIES NO EARLIER SET BUILDS (grep of test_unseen_variants*.py: no
neural ODE / RK4, no Kalman filter, no sparse autoencoder / ghost grads, no Gaussian splatting). Four fp16 failures
that start mid-run at step 7 (never a sampled step) from a real data event, and three healthy twins. Tiny models,
fixed seeds, one intra-op thread. Watched through the public API only (`ampdoctor.watch(model, optimizer=...,
scaler=..., run_dir=...)` at the default settings) by test_unseen_variants56's run/check_failure/twin (probe_harness
.probe_run: CPU fp16 autocast + `torch.amp.GradScaler("cpu")`, scale(loss).backward -> unscale_ -> clip -> step ->
update -> close -> `w.report()`); every model computes its own loss.

Each failure is proven first by check_failure's oracle: probe_harness.Producer (first module whose output is
non-finite from finite inputs and own parameters) at step 7, the loss first non-finite there, the scaler skips it
(before it only the opening backoffs), the bad step's weights run the bad batch in float32 to a finite loss and
finite gradients, the producer re-run under fp16 gives non-finite output from finite inputs, and the fix (same
weights, same batch) is finite. Only then must overflow/nan_origin be an `error` among the report's first three
findings at the PRODUCER, step 7, forward phase, with no error at the modules that only passed it on.

 1. a latent ODE (continuous-time RNN field dz/dt = -z + W2 tanh(W1 z)) integrated by fixed-grid RK4 on the
    observation times (torchdiffeq's 'rk4' without step_size). At step 7 the sensor was offline for 40 s: one RK4
    step of h = 40 on a decaying field is unstable (|R(-40)| ~ 1e5), the stage combination passes 65504 in `ode`'s
    own arithmetic -> overflow at `ode`, step 7 (not `ode.func*`, `dec`). Fix: max_step 0.5 (twin 5).
 2. a differentiable constant-velocity Kalman tracker learning its noise (log q, log r): at step 7 every track is
    occluded for 150 frames; the predict-only covariance F P F^T + Q grows as q n^3 / 3 and the fp16 mm passes
    65504 -> overflow at `kf` (aten::mm), step 7. Fix: the filter's covariance algebra in float32 (twin 6).
 3. a ReLU sparse autoencoder on residual-stream activations with ghost grads (exp(pre-activation) of latents dead
    for 2 steps, decoded by W_dec): at step 7 the cached shard kept the BOS position, whose massive activation (200
    in dim 0) gives dead latents pre-activations ~ 25; exp is float32 (pre was promoted by the float32 bias) but
    the decoding matmul casts it to fp16 = +inf -> overflow at `sae` (aten::_to_copy), step 7. (No twin: the fp32
    ghost path's run still skips step 7 in backward and the loss does not fall in 12 steps.)
 4. a pure-PyTorch 3D Gaussian splatting renderer, EWA projection Sigma' = J Sigma J^T in pixel units under
    autocast (`project`): at step 7 a handheld view passed 0.40 m from the object, its nearest Gaussian ~3 cm from
    the camera: J ~ f x / z^2 ~ 1e4, Sigma' > 65504 -> overflow at `project`, step 7. Fix: the projection in
    float32 (twin 7), as gsplat does.
Healthy twins (watched and unwatched: losses and weights bitwise identical; no warning, no error):
 5. twin of 1: RK4 with max_step 0.5 (the gap included) -> quiet.
 6. twin of 2: the Kalman filter in float32 (the occlusion included) -> quiet.
 7. twin of 4: the projection in float32 (the close view included) -> quiet.

Result when written (torch 2.13 CPU, default watch): 7 pass, 0 xfail. Top findings:
1 `[error] overflow at ode aten::mul step 7` (propagates to aten::addmm in `ode.func.w1`);
2 `[error] overflow at kf aten::mm step 7` (finite inputs max 6.534e4 gave +inf; propagates to aten::bmm);
3 `[error] overflow at sae aten::_to_copy step 7` (propagates to aten::mm);
4 `[error] overflow at project aten::_to_copy step 7` (-inf; propagates to aten::bmm);
5-7 quiet.
Not built: an exponential integrate-and-fire (AdEx) spiking layer: with reset at V_peak = 20 the exp argument is
bounded by (20 - V_T) / D_T = 5, so forward Euler never overflows; an SAE ghost-grads twin (see 3).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants61.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")
BAD_AT = 7

# the loop, the oracle and the checks: test_unseen_variants56's (its run, twin and check_failure)
from test_unseen_variants56 import check_failure, twin  # noqa: E402


# ======================================================================================================================
# 1./9. a continuous-time RNN as a neural ODE, integrated by fixed-grid RK4 on the observation times
# ======================================================================================================================
F_OD, H_OD, B_OD, T_OD, LR_OD, GAP = 3, 16, 16, 10, 1e-2, 40.0


class CTRNNField(nn.Module):
    """dz/dt = -z + W2 tanh(W1 z): a leaky continuous-time RNN's vector field (stable: the flow decays)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(H_OD, H_OD), nn.Linear(H_OD, H_OD)

    def forward(self, z):
        return -z + self.w2(torch.tanh(self.w1(z)))


class RK4(nn.Module):
    """torchdiffeq's fixed-grid 'rk4' without step_size: one RK4 step per interval of the observation grid;
    `max_step` (the fix): intervals subdivided into steps of at most 0.5 (RK4's stability limit for the -z is 2.79)."""

    def __init__(self, max_step=None):
        super().__init__()
        self.func = CTRNNField()
        self.max_step = max_step

    def forward(self, z, t):
        out = [z]
        for k in range(t.shape[0] - 1):
            dt = float(t[k + 1] - t[k])
            n = 1 if self.max_step is None else max(1, math.ceil(dt / self.max_step))
            h = dt / n
            for _ in range(n):
                k1 = self.func(z)
                k2 = self.func(z + 0.5 * h * k1)
                k3 = self.func(z + 0.5 * h * k2)
                k4 = self.func(z + h * k3)
                z = z + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            out.append(z)
        return torch.stack(out, 1)


class LatentODE(nn.Module):
    """Encode the first observation, integrate the latent state over the (irregular) observation times, decode each."""

    def __init__(self, fix=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(F_OD, H_OD), nn.Tanh())
        self.ode = RK4(0.5 if fix else None)
        self.dec = nn.Linear(H_OD, F_OD)

    def forward(self, y, t):
        z = self.ode(self.enc(y[:, 0]), t)
        return F.mse_loss(self.dec(z).float(), y)


def ode_batch(i):
    """Damped oscillators sampled every 0.1 s; at BAD_AT the sensor was offline for 40 s after the 5th sample."""
    g = gen(6110 + i)
    t = torch.arange(T_OD) * 0.1
    if i == BAD_AT:
        t[5:] += GAP
    w = 2 + torch.rand(B_OD, F_OD, generator=g)
    ph = torch.rand(B_OD, F_OD, generator=g) * 6.28
    y = torch.exp(-0.05 * t)[None, :, None] * torch.sin(w[:, None] * t[None, :, None] + ph[:, None])
    return (y, t), {}, None


def test_ode_rk4_on_the_observation_grid_explodes_across_a_sensor_gap(tmp_path):
    r = check_failure(tmp_path, LatentODE, ode_batch, BAD_AT, "ode", FWD, lr=LR_OD,
                      quiet_at=("ode.func", "ode.func.w1", "ode.func.w2", "dec", "enc", "enc.0", ""))
    return r


def test_twin_ode_rk4_with_a_max_step_stays_quiet(tmp_path):
    twin(lambda: LatentODE(fix=True), ode_batch, 12, tmp_path, lr=LR_OD)


# ======================================================================================================================
# 2./10. a differentiable Kalman filter (constant-velocity tracker): the covariance predicted through an occlusion
# ======================================================================================================================
B_KF, T_KF, OCC, LR_KF = 8, 24, 150, 5e-2


class KalmanCV(nn.Module):
    """A learned constant-velocity Kalman filter: state (x, y, vx, vy), observations (x, y); learned log process and
    observation noise (the transition is the fixed physics); the loss is the innovations' Gaussian NLL. A missing detection (mask 0) runs
    the predict step only. `fix`: the filter's covariance algebra in float32."""

    def __init__(self, fix=False):
        super().__init__()
        Fm = torch.eye(4)
        Fm[0, 2] = Fm[1, 3] = 1.0
        self.register_buffer("F", Fm)               # the physics: constant velocity, 1 frame
        self.log_q = nn.Parameter(torch.tensor(-2.0))
        self.log_r = nn.Parameter(torch.tensor(3.0))
        self.fix = fix

    def forward(self, y, mask):
        if self.fix:
            with torch.autocast("cpu", enabled=False):
                return self.filter(y, mask)
        return self.filter(y, mask)

    def filter(self, y, mask):
        B, T, _ = y.shape
        H = torch.eye(2, 4)
        Q = torch.exp(self.log_q) * torch.diag(torch.tensor([0.25, 0.25, 1.0, 1.0]))
        R = torch.exp(self.log_r) * torch.eye(2)
        x = torch.cat([y[:, 0], torch.zeros(B, 2)], -1)
        P = torch.eye(4).expand(B, 4, 4)
        nll = y.new_zeros(())
        for t in range(1, T):
            x = x @ self.F.T
            P = self.F @ P @ self.F.T + Q
            if not bool(mask[:, t].any()):
                continue
            S = H @ P @ H.T + R
            v = y[:, t] - x[:, :2]
            Sinv = torch.linalg.inv(S.float())
            K = P @ H.T @ Sinv.to(P.dtype)
            m = mask[:, t, None]
            x = x + m * (K @ v[..., None])[..., 0]
            P = P - m[..., None] * (K @ H @ P)
            nll = nll + (0.5 * (torch.logdet(S.float()) + (v[:, None].float() @ Sinv @ v[..., None].float())[:, 0, 0])
                         * m[:, 0]).sum() / B
        return nll / T


class Tracker(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.kf = KalmanCV(fix)

    def forward(self, y, mask):
        return self.kf(y, mask)


def kf_batch(i):
    """Pedestrian tracks (metres, 1 frame per step, noise 0.3 m); at BAD_AT every track is occluded for OCC frames
    (a parked truck) before it reappears."""
    g = gen(6120 + i)
    T = T_KF + (OCC if i == BAD_AT else 0)
    v = torch.randn(B_KF, 1, 2, generator=g) * 0.1
    x = torch.randn(B_KF, 1, 2, generator=g) * 5 + v * torch.arange(T)[None, :, None]
    y = x + 0.3 * torch.randn(B_KF, T, 2, generator=g)
    mask = torch.ones(B_KF, T)
    if i == BAD_AT:
        mask[:, 10:10 + OCC] = 0
    return (y, mask), {}, None


def test_kalman_covariance_predicted_through_an_occlusion_overflows_fp16(tmp_path):
    return check_failure(tmp_path, Tracker, kf_batch, BAD_AT, "kf", FWD, lr=LR_KF, quiet_at=("",))


def test_twin_kalman_in_fp32_stays_quiet(tmp_path):
    twin(lambda: Tracker(fix=True), kf_batch, 12, tmp_path, lr=LR_KF)


# ======================================================================================================================
# 3./11. a sparse autoencoder on LLM residual activations with ghost grads: a BOS token's massive activation
# ======================================================================================================================
D_SAE, L_SAE, B_SAE, LR_SAE, MASSIVE = 64, 256, 32, 1e-3, 200.0


class SAE(nn.Module):
    """A ReLU sparse autoencoder (Bricken et al. 2023) with Anthropic's ghost grads: latents that have not fired for
    DEAD steps get an auxiliary loss through exp(pre-activation), rescaled to half the residual's norm. `fix`: the
    ghost path in float32."""

    DEAD = 2

    def __init__(self, fix=False):
        super().__init__()
        self.W_enc = nn.Parameter(torch.randn(D_SAE, L_SAE) * 0.0625)
        self.b_enc = nn.Parameter(torch.full((L_SAE,), -1.5))
        self.W_dec = nn.Parameter(self.W_enc.detach().T.clone() / self.W_enc.detach().T.norm(dim=1, keepdim=True))
        self.b_dec = nn.Parameter(torch.zeros(D_SAE))
        self.register_buffer("since_fired", torch.zeros(L_SAE))
        self.fix = fix

    def forward(self, x):
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        acts = F.relu(pre)
        recon = acts @ self.W_dec + self.b_dec
        resid = (x - recon.float()).detach()
        loss = F.mse_loss(recon.float(), x) + 1e-3 * acts.float().sum(-1).mean()
        dead = self.since_fired >= self.DEAD
        if self.training:
            with torch.no_grad():
                self.since_fired.copy_(torch.where((acts > 0).any(0), 0.0, self.since_fired + 1))
        if bool(dead.any()):
            p = pre[:, dead].float() if self.fix else pre[:, dead]
            if self.fix:
                with torch.autocast("cpu", enabled=False):
                    ghost = torch.exp(p) @ self.W_dec[dead]
            else:
                ghost = torch.exp(p) @ self.W_dec[dead]
            scale = resid.norm(dim=-1, keepdim=True) / (2 * ghost.float().norm(dim=-1, keepdim=True).detach() + 1e-6)
            loss = loss + F.mse_loss(ghost.float() * scale, resid)
        return loss


class SAEProbe(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.sae = SAE(fix)

    def forward(self, x):
        return self.sae(x)


def sae_batch(i):
    """Residual-stream activations of layer 6 (standardised, low-rank structure); at BAD_AT the shard was cached
    without dropping the BOS position: one row holds the BOS token's massive activation (about 200 in dim 0)."""
    g = gen(6130 + i)
    basis = torch.randn(8, D_SAE, generator=gen(6139))
    x = F.relu(torch.randn(B_SAE, 8, generator=g)) @ basis * 0.5 + 0.3 * torch.randn(B_SAE, D_SAE, generator=g)
    if i == BAD_AT:
        x[0] = 0.2 * torch.randn(D_SAE, generator=g)
        x[0, 0] = MASSIVE
    return (x,), {}, None


def test_sae_ghost_grads_exp_of_a_bos_massive_activation_overflows_fp16(tmp_path):
    return check_failure(tmp_path, SAEProbe, sae_batch, BAD_AT, "sae", FWD, lr=LR_SAE, quiet_at=("",))



# ======================================================================================================================
# 4. a pure-PyTorch 3D Gaussian splatting renderer: a Gaussian close to a camera, its pixel-space covariance in fp16
# ======================================================================================================================
N_GS, PIX, FOCAL, LR_GS = 64, 16, 40.0, 1e-2


class Project(nn.Module):
    """EWA splatting's projection (Zwicker et al.; 3DGS): Sigma' = J Sigma J^T in pixels (+0.3 low-pass)."""

    def forward(self, mean, log_scale, cam_z):
        p = mean + torch.tensor([0.0, 0.0, 1.0]) * cam_z[:, None, None]          # camera translated along its axis
        x, y, z = p.unbind(-1)
        zero = torch.zeros_like(z)
        J = torch.stack([torch.stack([FOCAL / z, zero, -FOCAL * x / z ** 2], -1),
                         torch.stack([zero, FOCAL / z, -FOCAL * y / z ** 2], -1)], -2)  # [B, N, 2, 3]
        cov3 = torch.diag_embed(torch.exp(2 * log_scale)).expand(J.shape[0], -1, -1, -1)
        cov2 = J @ cov3 @ J.transpose(-1, -2) + 0.3 * torch.eye(2)
        uv = torch.stack([FOCAL * x / z, FOCAL * y / z], -1) + PIX / 2
        return uv, cov2


class Splat(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        g = gen(6140)
        self.mean = nn.Parameter(torch.rand(N_GS, 3, generator=g) * 0.8 - 0.4)
        self.log_scale = nn.Parameter(torch.full((N_GS, 3), -3.0))
        self.color = nn.Parameter(torch.rand(N_GS, generator=g))
        self.opacity = nn.Parameter(torch.zeros(N_GS))
        self.project = Project()
        self.fix = fix

    def forward(self, cam_z, target):
        if self.fix:
            with torch.autocast("cpu", enabled=False):
                uv, cov2 = self.project(self.mean, self.log_scale, cam_z)
        else:
            uv, cov2 = self.project(self.mean, self.log_scale, cam_z)
        a, b, c = cov2[..., 0, 0], cov2[..., 0, 1], cov2[..., 1, 1]
        det = a * c - b * b
        ys, xs = torch.meshgrid(torch.arange(PIX) + 0.5, torch.arange(PIX) + 0.5, indexing="ij")
        dx = xs.reshape(1, -1, 1) - uv[:, None, :, 0]
        dy = ys.reshape(1, -1, 1) - uv[:, None, :, 1]
        power = -0.5 * (c[:, None] * dx * dx - 2 * b[:, None] * dx * dy + a[:, None] * dy * dy) / det[:, None]
        alpha = torch.sigmoid(self.opacity) * torch.exp(power.clamp(max=0))
        img = (alpha * self.color).sum(-1).view(-1, PIX, PIX)
        return F.mse_loss(img.float(), target)


def gs_batch(i):
    """Views of a small object from a camera 2 m away (cam_z 2 +- 0.2); at BAD_AT a view from a handheld capture that
    passed 0.40 m from the object's front (cam_z 0.40: its nearest Gaussian ~3 cm from the camera)."""
    g = gen(6150 + i)
    cz = 2 + 0.4 * torch.rand(4, generator=g) - 0.2
    if i == BAD_AT:
        cz[1] = 0.40
    target = torch.rand(4, PIX, PIX, generator=g) * 0.1 + 0.5
    return (cz, target), {}, None


def test_gaussian_splatting_pixel_covariance_of_a_near_gaussian_overflows_fp16(tmp_path):
    return check_failure(tmp_path, Splat, gs_batch, BAD_AT, "project", FWD, lr=LR_GS, quiet_at=("",))


def test_twin_gaussian_splatting_projection_in_fp32_stays_quiet(tmp_path):
    twin(lambda: Splat(fix=True), gs_batch, 12, tmp_path, lr=LR_GS)
