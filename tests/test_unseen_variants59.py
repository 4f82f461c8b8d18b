"""Fifty-ninth set: FP16 FAILURES IN GEOMETRIC AND NON-TRANSFORMER MODEL FAMILIES (point clouds, capsule networks,
Kolmogorov-Arnold networks, E(n)-equivariant GNNs), with mechanisms the earlier sets do not build (there: GIN's sum
aggregation over a hub (10), GAT's unstabilised edge softmax (14), a Lorentz exp map (12), random Fourier features
(42, 54), GIoU in pixel coordinates (10), F.normalize's eps (29), the energy regulariser's square (15)). Six fp16
failures (five start mid-run at step 7, never a sampled step: full statistics are taken on step 0 and every 200th;
one at step 3, where training first brings a prediction close enough) and four healthy twins. Tiny models, fixed
seeds, one intra-op thread. Watched through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=...,
run_dir=tmp_path / "run")` at the default settings) in probe_harness.probe_run: an ordinary CPU fp16 autocast +
`torch.amp.GradScaler("cpu")` loop (scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update -> close ->
`w.report()`); every model computes its own loss.

Each failure is proven first by the test's own oracle (test_unseen_variants56's check_failure): probe_harness.Producer
(keyword inputs checked: the first module whose output is non-finite while its inputs and own parameters were
finite, at the expected step), the loss (first non-finite there; 6: finite, see there), the scaler (it skips that
step; before it only the opening backoffs, steps 0-2), a float32 check (the weights the bad step's forward ran with
run the bad batch in float32, no autocast: finite loss, finite gradients), the producer re-run on those weights under
fp16 autocast (its inputs finite, its output not), the mechanism itself measured, and the FIX (the same weights, the
same batch, under fp16 autocast: finite). A failing oracle is a plain failure. Only then must the rule be among the
report's first three findings at the PRODUCER, at that step, an `error`, forward phase, with no error at the modules
that only passed the inf/NaN on; a wrong report raises WrongAnswer naming ampdoctor's top three.

 1. PCN-style point-cloud completion (PointNet encoder of the centred partial scan, MLP decoder, centroid added
    back) trained with the symmetric squared Chamfer distance in its pure-PyTorch matmul form d = |a|^2 + |b|^2 -
    2 a @ b^T (`chamfer`; the bmm autocasts to fp16, the float32 norms do not). LiDAR tiles are ego-centred (objects
    within 30 m) until step 7, when a shard left in the city map frame arrives (the tile ~ (312, -247, 3) m from the
    origin): a.b ~ 1.6e5 > 65504, the bmm gives +inf, d = -inf, loss -inf -> overflow (nan_origin accepted) at
    `chamfer`, step 7 (not `enc`/`dec`, whose inputs are centred). Fix: the distances in float32 (twin 7).
 2. a capsule network (Sabour et al. 2017; conv -> primary capsules -> dynamic routing, margin loss) on lung-CT
    patches, with the squash written as most re-implementations do: |s|^2 = (s ** 2).sum(-1), |s|^2 / (1 + |s|^2) *
    s / sqrt(|s|^2) in the conv's fp16 (`primary`). Windowed patches (lung window, standardised) until step 7; then
    a series whose DICOM rescale/window step the loader skipped (raw Hounsfield units, about -1000..+130): a primary
    capsule's |s| ~ 2750 > 256, |s|^2 = inf, inf / inf = NaN -> nan_origin (overflow accepted) at `primary`, step 7
    (`primary.conv` finite; not `conv1`, not `digit`). Fix: the squash in float32 (twin 8).
 3. a Kolmogorov-Arnold network with a power (Taylor / "PolyKAN") basis, phi_oi(x) = sum_k c_oik x^k, k <= 5, on
    standardised sensor features winsorised at 3 std (3^5 = 243): the basis is built in float32 from the float32
    input, but the einsum contraction autocasts it to fp16. At step 7 a row holds a 9.6-std spike (a shard the
    winsoriser never saw): 9.6^5 = 81,537 > 65504, the cast makes +inf -> overflow (nan_origin accepted) at
    `layer1`, step 7 (the Softsign between the layers turns inf into NaN; not `norm`, not `layer2`). Fix: the
    contraction in float32 (twin 9).
 4. an EGNN (Satorras et al. 2021; edge MLP on (h_i, h_j, |x_i - x_j|^2), EDM's sum-aggregation factor 100) on a
    fully connected graph, predicting an affinity from coarse-grained complexes in Angstrom. Small complexes (10 A
    across) until step 7, when one record is a whole 400 A cryo-EM assembly: |x_i - x_j|^2 up to ~4e5 (float32) enters
    `layers.0.edge_mlp.0`, whose Linear autocasts it to fp16 = +inf -> overflow (nan_origin accepted) at
    `layers.0.edge_mlp.0`, step 7 (not its parent `layers.0.edge_mlp`, `layers.0`, `layers.1`, `head`). Fix: a
    radius graph (12 A cutoff), as EGNNs on large systems use (twin 10).
 5. the same completion model with the L1 Chamfer distance (PCN's CD-L1: mean of sqrt(d)) in the matmul form, for a
    short-range scanner (objects within 3 m). The bmm's fp16 rounding (|a.b| up to a few tens, ulp ~1/64) is
    cancellation error in d; once training brings a predicted point within that error of a target point (step 3
    here), d < 0 (measured: fp16 negative, float32 not) and sqrt(d) = NaN -> nan_origin (overflow accepted) at
    `chamfer`, step 3. Fix: the distances in float32.
 6. the KAN of 3 with tanh between the layers (ChebyKAN's squashing) instead of Softsign: tanh(+-inf) = +-1 heals
    the forward (the loss at step 7 is finite), only the backward through the saved +inf basis is NaN and the
    scaler skips step 7 -> overflow (nan_origin accepted) at `layer1`, step 7, though no loss ever showed it (the
    oracle: producer `layer1` at 7, finite loss, step 7 skipped, the unscaled fp16 gradients non-finite, the fix's
    finite).
Healthy twins (the fix applied, the same special batches; also run unwatched: losses and final weights bitwise
identical with and without the watch; no warning, no error, no RuntimeWarning of ampdoctor's):
 7. twin of 1: the Chamfer distances in float32 (the map-frame tile included) -> quiet.
 8. twin of 2: the squash in float32 (the raw-HU batch included) -> quiet.
 9. twin of 3: the KAN contraction in float32 (the spike included) -> quiet.
10. twin of 4: the EGNN on a 12 A radius graph (the assembly included) -> quiet.

Result when written (torch 2.13 CPU, default watch): 10/10 right, no xfail. Top findings:
1 `[error] overflow at chamfer aten::bmm step 7` ("finite inputs (max |x| = 308.5) gave +inf"), `[error]
  skipped_steps (run) step 7`, `[info] overflow at chamfer step 0` (the opening backoffs);
2 `[error] overflow at primary aten::pow step 7` ("in fp16 x**2 is inf for |x| > 255.9 ... propagates to aten::div"),
  `[error] skipped_steps (run) step 7`;
3 `[error] overflow at layer1 aten::_to_copy step 7` (propagates to aten::div in `norm`), `[error] skipped_steps`;
4 `[error] overflow at layers.0.edge_mlp.0 aten::_to_copy step 7`, `[error] skipped_steps (run) step 7`;
5 `[error] nan_origin at chamfer aten::sqrt step 3`, `[error] skipped_steps at chamfer step 3`;
6 `[error] overflow at layer1 aten::_to_copy step 7`, `[info] skipped_steps (run) step 7` ("a normal rate");
7-10 quiet (info only: the opening backoff at step 0).
Not built: a Noisy-OR MIL pooling prod(1 - p_i) over a whole-slide bag (torch.prod runs in float32 under CPU
autocast: no fp16 op); a CompressAI-style likelihood lower bound 1e-9 (its LowerBound's bound is a 1-element float32
tensor: max(fp16, bound) promotes to float32 and the bound survives); PolyKAN of degree 8 with LayerNorm between the
layers (its scaled backward overflows on every step from step 0: no mid-run failure to find).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants59.py
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import finite
from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")
BAD_AT = 7


# the loop, the oracle and the checks: test_unseen_variants56's (its run, twin and check_failure)
from test_unseen_variants56 import (check_failure, fp16_calls, fp16_loss, fp32_finite, named, run,  # noqa: E402
                                   snapshot_model, twin)


# ======================================================================================================================
# 1./7. point-cloud completion: a pure-PyTorch Chamfer distance (|a|^2 + |b|^2 - 2 a.b) on a map-frame LiDAR tile
# ======================================================================================================================
N_PC, M_PC, B_PC, LR_PC = 48, 96, 4, 1e-2
MAP_ORIGIN = (312.0, -247.0, 3.0)       # the shard's tile, in the city map frame (metres)


class Chamfer(nn.Module):
    """The symmetric squared Chamfer distance in its matmul form (the pure-PyTorch one of many repos)."""

    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, a, b):
        if self.fix:                                     # the fix: the distances in float32
            with torch.autocast("cpu", enabled=False):
                return self.dist(a.float(), b.float())
        return self.dist(a, b)

    @staticmethod
    def dist(a, b):
        xx, yy = (a * a).sum(-1), (b * b).sum(-1)
        zz = a @ b.transpose(1, 2)
        d = xx[:, :, None] + yy[:, None, :] - 2 * zz
        return d.min(2).values.mean() + d.min(1).values.mean()


class PointCompletion(nn.Module):
    """PCN-style: a PointNet encoder of the centred partial scan, a folding-free MLP decoder of M points, the
    partial scan's centroid added back; the loss is the Chamfer distance to the complete object."""

    def __init__(self, fix=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 64))
        self.dec = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, M_PC * 3))
        self.chamfer = Chamfer(fix)

    def forward(self, partial, full):
        c = partial.mean(1, keepdim=True)
        z = self.enc(partial - c).amax(1)
        pred = self.dec(z).view(-1, M_PC, 3) + c
        return self.chamfer(pred, full)


def car(g, n, centre):
    """n points on the surface of a 4 x 1.8 x 1.5 m box centred at `centre` [B, 1, 3]."""
    B = centre.shape[0]
    p = torch.rand(B, n, 3, generator=g) * 2 - 1
    face = torch.randint(0, 3, (B, n), generator=g)
    sign = torch.where(torch.rand(B, n, generator=g) < 0.5, -1.0, 1.0)
    p.scatter_(2, face[..., None], sign[..., None])
    return p * torch.tensor([2.0, 0.9, 0.75]) + centre


def pc_batch(i):
    """Ego-centred tiles (objects within 30 m of the sensor); at BAD_AT a tile of a shard left in the map frame."""
    g = gen(5910 + i)
    centre = torch.rand(B_PC, 1, 3, generator=g) * torch.tensor([60.0, 60.0, 2.0]) - torch.tensor([30.0, 30.0, 1.0])
    if i == BAD_AT:
        centre = centre + torch.tensor(MAP_ORIGIN)
    full = car(g, M_PC, centre)
    order = (full - centre)[..., 0].argsort(1)[:, :N_PC]          # the half facing the sensor
    partial = full.gather(1, order[..., None].expand(-1, -1, 3))
    return (partial, full), {}, None


def test_chamfer_matmul_form_on_a_map_frame_lidar_tile_overflows_fp16(tmp_path):
    r = check_failure(tmp_path, PointCompletion, pc_batch, BAD_AT, "chamfer", FWD, lr=LR_PC,
                      quiet_at=("enc", "enc.0", "enc.2", "dec", "dec.0", "dec.2", ""))
    # the mechanism: a.b passes 65504 in the map frame; in the ego frame it stays far inside
    for i, inside in ((BAD_AT - 1, True), (BAD_AT, False)):
        full = pc_batch(i)[0][1]
        dot = float((full @ full.transpose(1, 2)).abs().max())
        assert (dot < 5_000) if inside else (dot > 100_000), (i, dot)
    return r


def test_twin_chamfer_in_fp32_stays_quiet(tmp_path):
    twin(lambda: PointCompletion(fix=True), pc_batch, 12, tmp_path, lr=LR_PC)


# ======================================================================================================================
# 2./8. a capsule network on CT patches: the squash's squared norm of a raw-HU batch
# ======================================================================================================================
P_CT, B_CT, K_CT, LR_CT = 12, 8, 4, 1e-2


def squash(s, fix=False):
    """Sabour et al.'s squash, as most re-implementations write it."""
    if fix:
        s = s.float()
    sq = (s ** 2).sum(-1, keepdim=True)
    return sq / (1 + sq) * s / torch.sqrt(sq + 1e-7)


class PrimaryCaps(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.conv = nn.Conv2d(32, 4 * 8, 3, stride=2)
        self.fix = fix

    def forward(self, h):
        s = self.conv(h)
        B = s.shape[0]
        s = s.view(B, 4, 8, *s.shape[-2:]).permute(0, 1, 3, 4, 2).reshape(B, -1, 8)
        return squash(s, self.fix)


class DigitCaps(nn.Module):
    """Dynamic routing by agreement (3 iterations) from 36 primary capsules to K_CT class capsules of 16 dims."""

    def __init__(self, fix=False):
        super().__init__()
        self.W = nn.Parameter(0.1 * torch.randn(36, K_CT, 16, 8))
        self.fix = fix

    def forward(self, u):
        u_hat = torch.einsum("ikdj,bij->bikd", self.W, u)
        b = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype)
        for it in range(3):
            c = torch.softmax(b, 2)
            v = squash((c[..., None] * u_hat).sum(1), self.fix)
            if it < 2:
                b = b + (u_hat * v[:, None].to(u_hat.dtype)).sum(-1)
        return v


class CapsNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5)
        self.primary = PrimaryCaps(fix)
        self.digit = DigitCaps(fix)

    def forward(self, x, y):
        v = self.digit(self.primary(F.relu(self.conv1(x))))
        ln = torch.sqrt((v.float() ** 2).sum(-1))
        t = F.one_hot(y, K_CT).float()
        return (t * F.relu(0.9 - ln) ** 2 + 0.5 * (1 - t) * F.relu(ln - 0.1) ** 2).sum(-1).mean()


def window(hu):
    """The lung window (-1000..400 HU) to [0, 1], then standardised."""
    return ((hu.clamp(-1000, 400) + 1000) / 1400 - 0.5) / 0.25


def ct_batch(i):
    """Lung-CT patches (-800 HU parenchyma + noise) with a soft-tissue blob (+40 HU) in the quadrant of its class;
    windowed, except at BAD_AT: a series whose DICOM rescale/window step the loader skipped (raw HU)."""
    g = gen(5920 + i)
    y = torch.randint(0, K_CT, (B_CT,), generator=g)
    hu = -800 + 60 * torch.randn(B_CT, 1, P_CT, P_CT, generator=g)
    h = P_CT // 2
    for b in range(B_CT):
        r0, c0 = (int(y[b]) // 2) * h, (int(y[b]) % 2) * h
        hu[b, 0, r0 + 1:r0 + h - 1, c0 + 1:c0 + h - 1] = 40 + 30 * torch.randn(h - 2, h - 2, generator=g)
    return ((hu if i == BAD_AT else window(hu)), y), {}, None


def test_capsule_squash_squared_norm_of_a_raw_hu_batch_is_inf_over_inf(tmp_path):
    r = check_failure(tmp_path, CapsNet, ct_batch, BAD_AT, "primary", FWD, lr=LR_CT,
                      quiet_at=("primary.conv", "conv1", "digit", ""))
    # the mechanism: a primary capsule's |s| passes 256 on the raw batch (|s|^2 = inf), not on a windowed one
    m = snapshot_model(CapsNet, r)
    for i, inside in ((BAD_AT - 1, True), (BAD_AT, False)):
        with torch.no_grad():
            s = m.primary.conv(F.relu(m.conv1(ct_batch(i)[0][0])))
        assert (float(s.abs().max()) < 50) if inside else (float(s.abs().max()) > 300), (i, float(s.abs().max()))
    return r


def test_twin_capsule_squash_in_fp32_stays_quiet(tmp_path):
    twin(lambda: CapsNet(fix=True), ct_batch, 12, tmp_path, lr=LR_CT, skips=())


# ======================================================================================================================
# 3./9. a KAN with a power (Taylor) basis: the float32 basis of an outlier row cast to fp16 by the contraction
# ======================================================================================================================
F_KAN, H_KAN, DEG, B_KAN, LR_KAN, OUTLIER = 8, 16, 5, 256, 1e-2, 9.6


class PolyKAN(nn.Module):
    """A KAN layer with a power basis: phi_oi(x) = sum_k c_oik x^k; out_o = sum_i phi_oi(x_i)."""

    def __init__(self, i, o, fix=False):
        super().__init__()
        # Taylor-like init: c_k ~ N(0, 1) / (i 3^k), so that the +-3 std range of a standardised input is O(1)
        self.coef = nn.Parameter(torch.randn(o, i, DEG + 1) / i * 3.0 ** -torch.arange(DEG + 1.0))
        self.fix = fix

    def forward(self, x):
        basis = x[..., None] ** torch.arange(DEG + 1)
        if self.fix:                                     # the fix: the contraction in float32
            with torch.autocast("cpu", enabled=False):
                return torch.einsum("bik,oik->bo", basis.float(), self.coef)
        return torch.einsum("bik,oik->bo", basis, self.coef)


class KANRegressor(nn.Module):
    def __init__(self, fix=False, squash=nn.Softsign):
        super().__init__()
        self.layer1 = PolyKAN(F_KAN, H_KAN, fix)
        self.norm = squash()                             # the hidden layer's inputs in (-1, 1)
        self.layer2 = PolyKAN(H_KAN, 1, fix)

    def forward(self, x, y):
        return F.mse_loss(self.layer2(self.norm(self.layer1(x))).float().squeeze(-1), y)


def kan_batch(i):
    """Standardised sensor features, winsorised at 3 std; a smooth target. At BAD_AT one row holds a 5.2-std
    reading (a real spike, from a shard the winsoriser never saw)."""
    g = gen(5930 + i)
    x = torch.randn(B_KAN, F_KAN, generator=g).clamp(-3, 3)
    if i == BAD_AT:
        x[5, 3] = OUTLIER
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] - 0.3 * x[:, 3]
    return (x, y), {}, None


def test_power_basis_kan_contraction_casts_an_outlier_s_x_to_the_8_to_fp16_inf(tmp_path):
    r = check_failure(tmp_path, KANRegressor, kan_batch, BAD_AT, "layer1", FWD, lr=LR_KAN,
                      quiet_at=("norm", "layer2", ""))
    # the mechanism: x^8 of the outlier is past 65504 (in float32, before the cast); 3^8 is far inside
    assert OUTLIER ** DEG > 65504 > 3.0 ** DEG * 4
    x = kan_batch(BAD_AT)[0][0]
    assert float(x.abs().max()) == pytest.approx(OUTLIER) and float(kan_batch(BAD_AT - 1)[0][0].abs().max()) <= 3
    return r


def test_twin_power_basis_kan_contraction_in_fp32_stays_quiet(tmp_path):
    twin(lambda: KANRegressor(fix=True), kan_batch, 12, tmp_path, lr=LR_KAN)


# 6. the same KAN with tanh between the layers (ChebyKAN's squashing): tanh(+-inf) = +-1 heals the forward, the loss
#    is finite, and only the backward (inf in the saved fp16 basis) is NaN: the scaler skips the step
def test_power_basis_kan_overflow_healed_by_tanh_still_named_at_its_producer(tmp_path):
    make = functools.partial(KANRegressor, squash=nn.Tanh)
    torch.manual_seed(0)
    r = run(make(), kan_batch, BAD_AT + 3, tmp_path / "run", lr=LR_KAN, snap_at=BAD_AT)
    assert r["first"] == ("layer1", BAD_AT) and r["bad_loss"] == [], r
    assert BAD_AT in r["skipped"] and all(s < 3 for s in r["skipped"] if s < BAD_AT), r["skipped"]
    fp32_finite(make, r, kan_batch, BAD_AT)
    assert any(finite(a) and not finite(o) for a, o in fp16_calls(make, r, kan_batch, BAD_AT, "layer1"))
    assert math.isfinite(fp16_loss(make, r, kan_batch, BAD_AT).item())          # healed: the loss is finite
    for fix, ok in ((False, False), (True, True)):                               # the gradients are not, but fixed
        m = snapshot_model(make, r, fix=fix)
        args, _, _ = kan_batch(BAD_AT)
        with torch.autocast("cpu", dtype=FP16):
            loss = m(*args)
        loss.backward()
        assert all(finite(p.grad) for p in m.parameters()) == ok, fix
    named(r, FWD, "layer1", BAD_AT, quiet_at=("norm", "layer2", ""))


# ======================================================================================================================
# 4./10. an EGNN on a fully connected graph: the squared distance of a large assembly, cast to fp16 by the edge MLP
# ======================================================================================================================
N_EG, B_EG, H_EG, LR_EG, TYPES = 16, 32, 32, 1e-3, 5
POCKET, ASSEMBLY = 10.0, 400.0          # Angstrom across: a small molecule; a whole cryo-EM assembly


class EGCL(nn.Module):
    """Satorras et al. 2021's E(n)-equivariant layer, as their reference code: m_ij = phi_e(h_i, h_j, |x_i - x_j|^2),
    x_i += mean_j (x_i - x_j) phi_x(m_ij), h_i += phi_h(h_i, sum_j m_ij / 100) (EDM's normalisation factor);
    `cutoff` (the fix): a radius graph."""

    def __init__(self, h, cutoff=None):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * h + 1, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))
        self.coord_mlp = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1, bias=False))
        self.cutoff = cutoff

    def forward(self, h, x):
        B, N, _ = h.shape
        diff = x[:, :, None] - x[:, None, :]
        radial = (diff ** 2).sum(-1, keepdim=True)
        adj = 1 - torch.eye(N)
        if self.cutoff is not None:
            adj = adj * (radial[..., 0] < self.cutoff ** 2)
            radial = radial * adj[..., None]
        m = self.edge_mlp(torch.cat([h[:, :, None].expand(B, N, N, -1), h[:, None].expand(B, N, N, -1), radial], -1))
        m = m * adj[..., None].to(m.dtype)
        x = x + (diff * self.coord_mlp(m)).sum(2) / (N - 1)
        h = h + self.node_mlp(torch.cat([h, m.sum(2).to(h.dtype) / 100], -1).to(h.dtype))   # EDM's factor 100
        return h, x


class EGNNAffinity(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.embed = nn.Embedding(TYPES, H_EG)
        self.layers = nn.ModuleList(EGCL(H_EG, 12.0 if fix else None) for _ in range(2))
        self.head = nn.Linear(H_EG, 1)

    def forward(self, z, x, y):
        h = self.embed(z)
        for layer in self.layers:
            h, x = layer(h, x)
        return F.mse_loss(self.head(h.mean(1)).float().squeeze(-1), y)


def eg_batch(i):
    """Coarse-grained complexes (atom types, coordinates in Angstrom): small complexes 10 A across until BAD_AT; there
    the dataset's 'pocket' file of one complex is the whole 400 A assembly. The affinity: a function of composition."""
    g = gen(5940 + i)
    z = torch.randint(0, TYPES, (B_EG, N_EG), generator=g)
    x = (torch.rand(B_EG, N_EG, 3, generator=g) - 0.5) * POCKET
    if i == BAD_AT:
        x[0] = (torch.rand(N_EG, 3, generator=g) - 0.5) * ASSEMBLY
    y = (z == 2).float().mean(1) * 4 - (z == 4).float().mean(1) * 2
    return (z, x, y), {}, None


def test_egnn_edge_mlp_casts_the_squared_distance_of_a_large_assembly_to_fp16_inf(tmp_path):
    r = check_failure(tmp_path, EGNNAffinity, eg_batch, BAD_AT, "layers.0.edge_mlp.0", FWD, lr=LR_EG,
                      quiet_at=("layers.0.edge_mlp", "layers.0", "layers.0.edge_mlp.1", "layers.0.edge_mlp.2",
                                "layers.0.coord_mlp", "layers.0.node_mlp", "layers.1", "head", ""))
    # the mechanism: a squared distance past 65504 (256 A) in the assembly; the small ones stay below 10^2 * 3
    for i, inside in ((BAD_AT - 1, True), (BAD_AT, False)):
        x = eg_batch(i)[0][1]
        r2 = float(((x[:, :, None] - x[:, None, :]) ** 2).sum(-1).max())
        assert (r2 < 3 * POCKET ** 2) if inside else (r2 > 65504), (i, r2)
    return r



def test_twin_egnn_radius_graph_stays_quiet(tmp_path):
    twin(lambda: EGNNAffinity(fix=True), eg_batch, 12, tmp_path, lr=LR_EG)

# ======================================================================================================================
# 5. point-cloud completion with the L1 Chamfer distance (PCN's CD-L1, the mean of sqrt of the squared distance) in
#    the matmul form: once a prediction comes within fp16's cancellation error of a target point, d < 0 and sqrt NaN
# ======================================================================================================================
NEAR_PC, BAD_L1 = 3.0, 3


class ChamferL1(Chamfer):
    @staticmethod
    def dist(a, b):
        xx, yy = (a * a).sum(-1), (b * b).sum(-1)
        zz = a @ b.transpose(1, 2)
        d = xx[:, :, None] + yy[:, None, :] - 2 * zz
        return d.min(2).values.sqrt().mean() + d.min(1).values.sqrt().mean()


class PointCompletionL1(PointCompletion):
    def __init__(self, fix=False):
        super().__init__()
        self.chamfer = ChamferL1(fix)


def pc_batch_l1(i):
    """A short-range (robot / tabletop) scanner: objects within 3 m of the sensor, ego frame."""
    g = gen(5950 + i)
    centre = (torch.rand(B_PC, 1, 3, generator=g) * 2 - 1) * torch.tensor([NEAR_PC, NEAR_PC, 1.0])
    full = car(g, M_PC, centre)
    order = (full - centre)[..., 0].argsort(1)[:, :N_PC]
    partial = full.gather(1, order[..., None].expand(-1, -1, 3))
    return (partial, full), {}, None


def test_chamfer_l1_matmul_form_cancellation_is_sqrt_of_a_negative_distance(tmp_path):
    """The step of the first cancellation depends on the CPU's fp16 matmul (step 3 on CI's Intel machines, step 2 on
    AMD EPYC): it is read from an unwatched run, and the oracle and ampdoctor are held to it."""
    torch.manual_seed(0)
    bare = run(PointCompletionL1(), pc_batch_l1, BAD_L1 + 1, tmp_path / "bare", lr=LR_PC, watch=False)
    assert bare["bad_loss"] and bare["bad_loss"][0] in (BAD_L1 - 1, BAD_L1), bare["losses"]
    bad = bare["bad_loss"][0]
    r = check_failure(tmp_path, PointCompletionL1, pc_batch_l1, bad, "chamfer", FWD, lr=LR_PC,
                      quiet_at=("enc", "enc.0", "enc.2", "dec", "dec.0", "dec.2", ""))
    # the mechanism: on the bad step's weights the fp16 matmul form has negative squared distances, float32 none
    m = snapshot_model(PointCompletionL1, r)
    (partial, full), _, _ = pc_batch_l1(bad)
    with torch.no_grad():
        c = partial.mean(1, keepdim=True)
        with torch.autocast("cpu", dtype=FP16):
            pred = m.dec(m.enc(partial - c).amax(1)).view(-1, M_PC, 3) + c
            zz16 = pred @ full.transpose(1, 2)
        xx, yy = (pred * pred).sum(-1), (full * full).sum(-1)
        d16 = xx[:, :, None] + yy[:, None, :] - 2 * zz16
        d32 = xx[:, :, None] + yy[:, None, :] - 2 * (pred.float() @ full.transpose(1, 2))
    assert zz16.dtype == FP16 and float(d16.min()) < 0 <= float(d32.min()) + 1e-4, (float(d16.min()), float(d32.min()))
    return r
