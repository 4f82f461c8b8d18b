"""Fifty-first set: FP16 FAILURES IN OPTICAL FLOW, DENSE PREDICTION, VIDEO, SPEECH SEPARATION AND DETECTION TRAINING
CODE (RAFT, MiDaS, masked temporal pooling over untrimmed videos, Conv-TasNet with a PIT SI-SNR loss, KL-Loss box
regression with uncertainty, a Charbonnier flow loss). Six fp16 failures (five forward, one backward) that start
mid-run at a known step (7-9: never a sampled step; full statistics are taken on step 0 and every 200th) and two
healthy twins, each mechanism written the way those repos write it. Small models, fixed seeds. Watched through the
public API only (`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")` at the default
settings) in probe_harness.probe_run: an ordinary CPU fp16 autocast + `torch.amp.GradScaler("cpu")` loop
(scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`); every model
computes its own loss (the loss a submodule, as these repos' criterion is).

Each failure is proven first by the test's own oracle: probe_harness.Producer (keyword inputs checked: the first
module whose output is non-finite while its inputs and own parameters were finite, at the expected step), the loss
(first non-finite there), the scaler (it skips that step; before it only the opening backoffs of steps 0-2), a
float32 check (the model with the weights the bad step's forward ran with runs the bad batch in float32, no
autocast: finite loss, finite gradients) and the mechanism re-run on those weights under fp16 autocast (the
producer's inputs finite, its output not). A failing oracle is a plain failure. Only then must the rule be among
the report's first three findings at the PRODUCER, at that step, forward, an `error`, with no error at the modules
that only passed the inf/NaN on (the producer's neighbours and the root); a wrong report raises WrongAnswer naming
ampdoctor's top three (rule@module op step phase [severity]).

 1. RAFT with a norm-free feature encoder (BasicEncoder(norm_fn="none")) and the all-pairs correlation volume
    computed on the fp16 feature maps (RAFT itself casts fmap1/fmap2 to float before CorrBlock; here the cast is
    left out): `corr` = matmul of 256-channel features, divided by sqrt(C) only AFTER the matmul. At step 8 a frame
    pair is read as 16-bit PNGs (0-65535; RAFT's own 2 * (img / 255) - 1 gives up to 513): the features stay finite,
    their dot products pass 65504 -> overflow at `corr`, step 8 (`fnet.*` finite).
 2. MiDaS's scale-and-shift-invariant loss (compute_scale_and_shift: the per-image 2x2 normal equations, det =
    a_00 * a_11 - a_01^2) in the prediction's fp16 (target.type_as(prediction)), the mixed-dataset recipe: sparse
    LiDAR ground truth (~4% valid pixels) until step 7 brings a dense synthetic depth map (every pixel valid): a_00 *
    a_11 and a_01^2 pass 65504 (inf - inf = NaN) -> overflow / nan_origin at `ssi`, step 7 (the prediction finite).
 3. an action classifier over pre-extracted per-frame features, variable-length videos padded, the masked temporal
    mean-pool written (x * mask).sum(1) / mask.sum(1) with the mask .type_as(x) (fp16): at step 9 an untrimmed video
    (32768 frames) enters the batch: the fp16 sum over frames passes 65504 -> overflow at `pool`, step 9.
 4. twin of 3: the masked mean-pool in float32 (the same untrimmed video) -> quiet.
 5. a Conv-TasNet-style mask separator trained with asteroid's PIT SI-SNR loss (zero-mean; EPS = 1e-8 added to the
    target energy and the noise energy) computed in the estimate's fp16 (targets .type_as(est)): at step 8 a
    Libri2Mix "max"-style chunk where the second speaker is silent (an all-zero target): its energy is 0, EPS is 0
    in fp16, dot * s / energy = 0 * 0 / 0 = NaN -> nan_origin (eps_underflow / underflow accepted: the root cause)
    at `sisnr`, step 8 (the separator's estimate finite).
 6. twin of 5: the SI-SNR in float32 (est.float(), the same silent target: -80 dB, finite) -> quiet.
 7. KL-Loss box regression with uncertainty (He et al. 2019): a head predicts alpha = log(sigma^2) per box
    coordinate, the loss exp(-alpha) * smooth_l1(delta - target) + alpha / 2 in fp16. At step 8 a batch of images
    arrives unnormalised (raw 0-255, the Normalize transform missing): alpha reaches about -25 (finite; exp(25) is
    finite in float32) and exp(-alpha) passes 65504 -> overflow at `kl_loss`, step 8 (`bbox_std` finite).
 8. a small flow network fine-tuned on a mixed dataset (RAFT's C+T+S+K recipe) with BasicSR's Charbonnier loss,
    sqrt(diff^2 + eps) with eps = 1e-12, the diff masked by the valid map first, in fp16: dense FlyingChairs-like
    ground truth until step 8 brings the first KITTI-like sparse sample (valid on ~20% of the pixels): the masked
    diffs are exactly 0, eps is 0 in fp16, sqrt(0) is finite but its backward divides by 0 -> a BACKWARD failure
    (Producer with backward hooks: forward finite, loss finite, the first backward producer `charbonnier` at step 8,
    the scaler skips it) -> overflow / nan_origin (eps_underflow / underflow accepted) at `charbonnier`, step 8
    (phase backward or forward accepted); nothing at `net.*` or the root.
Twins also run unwatched: losses and final weights bitwise identical with and without the watch; no warning, no
error, no RuntimeWarning of ampdoctor's.

Result when written: 8/8 right; wrong: none. What ampdoctor said (torch 2.13 CPU; top three):
1 `[error] overflow at corr aten::bmm step 8 forward` + `[error] skipped_steps (run) step 8`;
2 `[error] overflow at ssi aten::mul step 7 forward` + `[error] skipped_steps (run) step 7`;
3 `[error] overflow at pool aten::sum step 9 forward` + `[error] skipped_steps at pool step 9` (the skipped_steps
  finding attributed to the module `pool`, elsewhere `(run)`; noticed, not asserted);
4 quiet (only `[info] skipped_steps (run) step 1`);
5 `[error] eps_underflow at sisnr aten::add step 8 forward` + `[error] nan_origin at sisnr aten::div step 8 forward` +
  `[error] skipped_steps (run) step 8`;
6 quiet (only `[info] overflow at decoder step 0` backward, the opening backoff, and `[info] skipped_steps`);
7 `[error] overflow at kl_loss aten::exp step 8 forward` + `[error] skipped_steps (run) step 8`;
8 `[error] overflow at charbonnier aten::div step 8 backward` + `[error] eps_underflow at charbonnier aten::add step 8
  forward` + `[warning] skipped_steps (run) step 0` (the scaler also skips step 9).
Not built: a depth SILog loss with a zero (LiDAR-hole) pixel: fp16-specific only through a vanishing eps, the same
mechanism as 5 and 8; a Swin relative position bias table: timm adds the fp32 table to the fp16 logits, which
promotes them to float32, so a growing table does not overflow fp16 there.

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants51.py -q -p no:cacheprovider
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import (Producer, WrongAnswer, at_top3, finite, probe_run, quiet_twin,
                           real_fwd_after_backoffs as real_fwd)
from scenarios import gen, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def own_loss(out, y):
    """The models below compute their own training loss."""
    return out


def run(m, batch, steps, run_dir, *, lr=1e-3, oracle=lambda m: Producer(m, with_kwargs=True), **kw):
    """probe_harness.probe_run at ampdoctor's default settings; the oracle a Producer on keyword inputs too."""
    return probe_run(m, batch, own_loss, steps, run_dir, lr=lr, oracle=oracle, **kw)


def snapshot_model(make, r):
    """A fresh model with the weights (and buffers) the bad step's forward ran with (probe_run's snap_at)."""
    torch.manual_seed(0)
    m = make()
    m.load_state_dict(r["sd"])
    return m


def fp32_finite(make, r, batch, step):
    """The bad batch is an fp16 failure: the bad step's weights run it in float32 (no autocast) to a finite loss with
    finite gradients."""
    m = snapshot_model(make, r)
    args, kwargs, _ = batch(step)
    args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    loss = m(*args, **kwargs)
    loss.backward()
    assert math.isfinite(loss.item()) and all(finite(p.grad) for p in m.parameters() if p.grad is not None), step


def fp16_calls(make, r, batch, step, name):
    """[(inputs, output)] of each call of module `name` when the bad step's forward is re-run under fp16 autocast."""
    m = snapshot_model(make, r)
    seen = []
    h = dict(m.named_modules())[name].register_forward_hook(
        lambda mod, a, kw, o: seen.append((tuple(a) + tuple(kw.values()), o)), with_kwargs=True)
    args, kwargs, _ = batch(step)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        m(*args, **kwargs)
    h.remove()
    return seen


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} {f.op} step {f.step} {f.phase} [{f.severity}]"
            for f in rep.findings[:3]]


def named(r, rules, module, step, phase="forward", quiet_at=()):
    """One of `rules` at the producer `module`, at `step`, in `phase`, an error, among the first three findings, and
    no error at the modules that only passed it on; else a WrongAnswer naming ampdoctor's top three."""
    rep = r["rep"]
    try:
        at_top3(rep, rules, module, step=step, phase=phase, severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:800]})") from None


def twin(make, batch, steps, tmp_path, lr=1e-3, fall=0.9, skips=()):
    """A healthy twin: watched (with the oracle) and unwatched; healthy, ampdoctor quiet, and the watch changed
    nothing: losses and final weights bitwise identical."""
    torch.manual_seed(0)
    r = run(make(), batch, steps, tmp_path / "run", lr=lr)
    torch.manual_seed(0)
    bare = run(make(), batch, steps, tmp_path / "bare", lr=lr, watch=False)
    assert r["losses"] == bare["losses"], (r["losses"], bare["losses"])
    assert all(torch.equal(r["weights"][k], bare["weights"][k]) for k in r["weights"])
    ls = r["losses"]     # healthy (a plain failure otherwise): finite, falling, no producer, no skip but `skips`
    assert all(map(math.isfinite, ls)) and r["first"] is None and sum(ls[-3:]) < fall * sum(ls[:3]), (r["first"], ls)
    assert [s for s in r["skipped"] if s >= 3] == list(skips), r["skipped"]
    try:
        quiet_twin(r, fall=fall, skips=skips)
    except AssertionError as e:
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(r['rep'])} warnings={r['warns']} "
                          f"({str(e)[:800]})") from None
    return r


def check_failure(tmp_path, make, batch, step, name, rules, quiet_at, steps_after=3, lr=1e-3):
    """Oracle first (producer `name` at `step`, loss non-finite there, skipped; float32 finite; the producer's
    inputs finite and its output not under fp16), then the report."""
    torch.manual_seed(0)
    r = run(make(), batch, step + steps_after, tmp_path / "run", lr=lr, snap_at=step)
    real_fwd(r, name, step)
    fp32_finite(make, r, batch, step)
    calls = fp16_calls(make, r, batch, step, name)
    assert any(finite(a) and not finite(o) for a, o in calls), name
    named(r, rules, name, step, quiet_at=quiet_at)
    return r


def smooth(g, *shape):
    """A smooth random texture (bilinear upsampling of a coarse grid) in [0, 1], shape (..., H, W)."""
    *lead, h, w = shape
    coarse = torch.rand(*lead, h // 4, w // 4, generator=g)
    return F.interpolate(coarse.reshape(-1, 1, h // 4, w // 4), size=(h, w), mode="bilinear",
                         align_corners=False).reshape(*lead, h, w)


# ======================================================================================================================
# 1. RAFT: the all-pairs correlation volume on fp16 feature maps, a 16-bit frame pair
# ======================================================================================================================
C1, HW1, B1, PNG16_AT = 256, 16, 4, 8


class BasicEncoder(nn.Module):
    """RAFT's feature encoder, norm_fn="none", at 1/2 resolution: both frames in one batch (torch.cat), split after."""

    def __init__(self, output_dim=C1):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.out = nn.Conv2d(64, output_dim, 1)

    def forward(self, x):
        is_list = isinstance(x, (tuple, list))
        if is_list:
            n = x[0].shape[0]
            x = torch.cat(x, dim=0)
        x = self.out(F.relu(self.conv2(F.relu(self.conv1(x)))))
        return torch.split(x, [n, n], dim=0) if is_list else x


class CorrBlock(nn.Module):
    """RAFT's CorrBlock.corr: all pairs of feature vectors, divided by sqrt(dim) after the matmul."""

    def forward(self, fmap1, fmap2):
        batch, dim, ht, wd = fmap1.shape
        fmap1 = fmap1.view(batch, dim, ht * wd)
        fmap2 = fmap2.view(batch, dim, ht * wd)
        corr = torch.matmul(fmap1.transpose(1, 2), fmap2)
        return corr / torch.sqrt(torch.tensor(dim).float())


class RAFTLite(nn.Module):
    """RAFT reduced to one lookup: a soft-argmax over the correlation volume, refined by a small conv."""

    def __init__(self):
        super().__init__()
        self.fnet = BasicEncoder()
        self.corr = CorrBlock()
        self.refine = nn.Conv2d(2, 2, 3, padding=1)
        h = HW1 // 2
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(h), indexing="ij")
        self.register_buffer("coords", torch.stack([xs, ys], -1).reshape(-1, 2).float(), persistent=False)

    def forward(self, image1, image2, flow_gt):
        image1 = 2 * (image1 / 255.0) - 1.0
        image2 = 2 * (image2 / 255.0) - 1.0
        fmap1, fmap2 = self.fnet([image1, image2])     # RAFT: CorrBlock(fmap1.float(), fmap2.float()); cast left out
        corr = self.corr(fmap1, fmap2)
        target = torch.softmax(corr, -1) @ self.coords.to(corr.dtype)
        b, h = len(image1), HW1 // 2
        flow = (target - self.coords.to(target.dtype)).transpose(1, 2).reshape(b, 2, h, h)
        flow = flow + self.refine(flow)
        return (flow.float() - flow_gt).abs().mean()


def raft_batch(i):
    """Frame pairs (0-255) related by a circular shift; the flow at 1/2 resolution. At PNG16_AT the pair was read as
    16-bit PNGs (0-65535)."""
    g = gen(1000 + i)
    img1 = smooth(g, B1, 3, HW1, HW1) * 255
    dx, dy = (int(v) for v in torch.randint(-1, 2, (2,), generator=g))
    img2 = torch.roll(img1, shifts=(2 * dy, 2 * dx), dims=(2, 3))
    flow = torch.tensor([float(dx), float(dy)]).view(1, 2, 1, 1).expand(B1, 2, HW1 // 2, HW1 // 2)
    if i == PNG16_AT:
        img1, img2 = img1 * 257, img2 * 257
    return (img1, img2, flow), {}, None


def test_raft_correlation_volume_in_fp16_overflows_on_16bit_frames(tmp_path):
    check_failure(tmp_path, RAFTLite, raft_batch, PNG16_AT, "corr", FWD,
                  quiet_at=("fnet", "fnet.conv1", "fnet.conv2", "fnet.out", "refine", ""))


# ======================================================================================================================
# 2. MiDaS: the scale-and-shift-invariant loss's normal equations in fp16, a dense ground truth
# ======================================================================================================================
HW2, B2, DENSE_AT = 48, 4, 7


def compute_scale_and_shift(prediction, target, mask):
    """MiDaS's closed-form per-image scale and shift: the 2x2 system A x = b."""
    a_00 = torch.sum(mask * prediction * prediction, (1, 2))
    a_01 = torch.sum(mask * prediction, (1, 2))
    a_11 = torch.sum(mask, (1, 2))
    b_0 = torch.sum(mask * prediction * target, (1, 2))
    b_1 = torch.sum(mask * target, (1, 2))
    x_0 = torch.zeros_like(b_0)
    x_1 = torch.zeros_like(b_1)
    det = a_00 * a_11 - a_01 * a_01
    valid = det.nonzero()
    x_0[valid] = (a_11[valid] * b_0[valid] - a_01[valid] * b_1[valid]) / det[valid]
    x_1[valid] = (-a_01[valid] * b_0[valid] + a_00[valid] * b_1[valid]) / det[valid]
    return x_0, x_1


class ScaleAndShiftInvariantLoss(nn.Module):
    """MiDaS's SSI MAE loss (batch-based reduction) in the prediction's dtype."""

    def forward(self, prediction, target):
        target = target.type_as(prediction)
        mask = (target > 0).type_as(prediction)
        scale, shift = compute_scale_and_shift(prediction, target, mask)
        aligned = scale.view(-1, 1, 1) * prediction + shift.view(-1, 1, 1)
        image_loss = torch.sum(mask * (aligned - target).abs(), (1, 2))
        divisor = torch.sum(mask)
        return torch.sum(image_loss) / divisor if divisor > 0 else image_loss.sum() * 0


class MiDaSLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                     nn.ReLU())
        self.head = nn.Sequential(nn.Conv2d(16, 1, 1), nn.ReLU())
        self.ssi = ScaleAndShiftInvariantLoss()

    def forward(self, image, target):
        return self.ssi(self.head(self.encoder(image)).squeeze(1), target)


def midas_batch(i):
    """Images and disparity ground truth, sparse (LiDAR: ~4% of the pixels valid, 0 elsewhere); at DENSE_AT the
    mixed-dataset sampler draws a synthetic scene with dense ground truth."""
    g = gen(2000 + i)
    img = smooth(g, B2, 3, HW2, HW2)
    disp = 0.5 + 2.0 * img.mean(1)
    valid = torch.rand(B2, HW2, HW2, generator=g) < (1.0 if i == DENSE_AT else 0.04)
    return ((img - 0.5) / 0.25, disp * valid), {}, None


def test_midas_ssi_normal_equations_overflow_on_dense_ground_truth(tmp_path):
    check_failure(tmp_path, MiDaSLite, midas_batch, DENSE_AT, "ssi", FWD,
                  quiet_at=("encoder", "encoder.0", "encoder.2", "head", "head.0", ""))


# ======================================================================================================================
# 3 + twin. masked temporal mean-pool as an fp16 sum over the frames of an untrimmed video
# ======================================================================================================================
F3, D3, K3, B3, LONG_AT, LONG3 = 32, 64, 5, 4, 9, 32768


class MaskedTemporalPool(nn.Module):
    """Mean over the valid (unpadded) frames: (x * mask).sum(1) / mask.sum(1); `fp32`: in float32 (the twin)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, x, mask):
        if self.fp32:
            x = x.float()
        mask = mask.unsqueeze(-1).type_as(x)
        return (x * mask).sum(1) / mask.sum(1).clamp(min=1)


class VideoClassifier(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.proj = nn.Linear(F3, D3)
        self.pool = MaskedTemporalPool(fp32)
        self.head = nn.Linear(D3, K3)

    def forward(self, feats, mask, y):
        return F.cross_entropy(self.head(self.pool(F.relu(self.proj(feats)), mask)).float(), y)


PROTO3 = torch.randn(K3, F3, generator=gen(303))


def video_batch(i):
    """Four videos' pre-extracted per-frame features (non-negative, I3D-like), 20-64 frames, padded; at LONG_AT video
    0 is an untrimmed one (LONG3 frames)."""
    g = gen(3000 + i)
    y = torch.randint(0, K3, (B3,), generator=g)
    lens = torch.randint(20, 65, (B3,), generator=g)
    if i == LONG_AT:
        lens[0] = LONG3
    T = int(lens.max())
    feats = F.relu(torch.randn(B3, T, F3, generator=g) + PROTO3[y][:, None]) * 3
    mask = torch.arange(T)[None] < lens[:, None]
    return (feats * mask[..., None], mask, y), {}, None


def test_masked_temporal_sum_pool_overflows_on_untrimmed_video(tmp_path):
    check_failure(tmp_path, VideoClassifier, video_batch, LONG_AT, "pool", FWD, quiet_at=("proj", "head", ""))


def test_twin_masked_temporal_pool_in_fp32_is_quiet(tmp_path):
    twin(lambda: VideoClassifier(fp32=True), video_batch, LONG_AT + 8, tmp_path, lr=3e-3)


# ======================================================================================================================
# 5 + twin. Conv-TasNet with a PIT SI-SNR loss in fp16: a silent target source
# ======================================================================================================================
N5, L5, T5, B5, SILENT_AT, EPS5 = 32, 16, 2000, 4, 8, 1e-8


def pairwise_si_sdr(est, target):
    """asteroid's PairwiseNegSDR("sisdr") body, returned positive: (B, n_src est, n_src target) in dB."""
    est = est - est.mean(-1, keepdim=True)
    target = target - target.mean(-1, keepdim=True)
    s_est, s_target = est.unsqueeze(2), target.unsqueeze(1)
    pair_wise_dot = torch.sum(s_est * s_target, dim=3, keepdim=True)
    s_target_energy = torch.sum(s_target ** 2, dim=3, keepdim=True) + EPS5
    pair_wise_proj = pair_wise_dot * s_target / s_target_energy
    e_noise = s_est - pair_wise_proj
    pair_wise_sdr = torch.sum(pair_wise_proj ** 2, dim=3) / (torch.sum(e_noise ** 2, dim=3) + EPS5)
    return 10 * torch.log10(pair_wise_sdr + EPS5)


class PITSISNR(nn.Module):
    """Permutation-invariant -SI-SNR over two sources, in the estimate's dtype; `fp32`: in float32 (the twin)."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, est, target):
        est = est.float() if self.fp32 else est
        sdr = pairwise_si_sdr(est, target.type_as(est))
        perms = torch.stack([sdr[:, 0, 0] + sdr[:, 1, 1], sdr[:, 0, 1] + sdr[:, 1, 0]], -1) / 2
        return -perms.max(-1).values.mean()


class TasNetLite(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.encoder = nn.Conv1d(1, N5, L5, stride=L5 // 2, bias=False)
        self.masker = nn.Sequential(nn.Conv1d(N5, 64, 1), nn.PReLU(), nn.Conv1d(64, 2 * N5, 1))
        self.decoder = nn.ConvTranspose1d(N5, 1, L5, stride=L5 // 2, bias=False)
        with torch.no_grad():     # the decoder starts as the encoder's transpose (synthesis = analysis filters)
            self.decoder.weight.copy_(self.encoder.weight * 0.5)
        self.sisnr = PITSISNR(fp32)

    def forward(self, mix, sources):
        b = len(mix)
        w = F.relu(self.encoder(mix.unsqueeze(1)))
        masks = torch.sigmoid(self.masker(w)).view(b, 2, N5, -1)
        est = self.decoder((w.unsqueeze(1) * masks).view(b * 2, N5, -1)).view(b, 2, -1)
        return self.sisnr(est, sources)


def source(g, n):
    """n speech-like sources: a few harmonics under a syllable-rate envelope."""
    t = torch.arange(T5) / 8000
    f0 = 100 + 150 * torch.rand(n, 1, generator=g)
    sig = sum(torch.sin(2 * math.pi * k * f0 * t) / k for k in (1, 2, 3))
    env = torch.sigmoid(8 * torch.sin(2 * math.pi * (3 + 3 * torch.rand(n, 1, generator=g)) * t))
    return 0.3 * sig * env + 0.01 * torch.randn(n, T5, generator=g)


def tasnet_batch(i):
    """Two-speaker mixtures; at SILENT_AT the second speaker of mixture 0 is silent in this chunk (all zeros)."""
    g = gen(5000 + i)
    src = source(g, 2 * B5).view(B5, 2, T5)
    if i == SILENT_AT:
        src[0, 1] = 0.0
    return (src.sum(1), src), {}, None


def test_pit_si_snr_silent_target_nan_in_fp16(tmp_path):
    check_failure(tmp_path, TasNetLite, tasnet_batch, SILENT_AT, "sisnr", FWD + ("eps_underflow", "underflow"),
                  quiet_at=("encoder", "masker", "masker.0", "masker.2", "decoder", ""))


def test_twin_pit_si_snr_in_fp32_is_quiet(tmp_path):
    twin(lambda: TasNetLite(fp32=True), tasnet_batch, SILENT_AT + 8, tmp_path, lr=3e-3)


# ======================================================================================================================
# 7. KL-Loss: box regression with uncertainty, exp(-alpha) in fp16 on an unnormalised batch
# ======================================================================================================================
HW7, B7, RAW_AT = 16, 8, 8
MEAN7, STD7 = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


class KLLoss(nn.Module):
    """He et al. 2019: exp(-alpha) * smooth_l1(delta - target) + alpha / 2, alpha = log(sigma^2), in fp16."""

    def forward(self, delta, alpha, target):
        diff = (delta - target.type_as(delta)).abs()
        sl1 = torch.where(diff < 1, 0.5 * diff * diff, diff - 0.5)
        return (torch.exp(-alpha) * sl1 + 0.5 * alpha).mean()


class BoxRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.bbox_pred = nn.Linear(32, 4)
        self.bbox_std = nn.Linear(32, 4)
        self.kl_loss = KLLoss()

    def forward(self, image, target):
        f = self.backbone(image)
        return self.kl_loss(self.bbox_pred(f), self.bbox_std(f), target)


def box_batch(i):
    """Images with one bright square each; the regression target its (normalised) box deltas. At RAW_AT the
    Normalize transform is missing: raw 0-255 pixels."""
    g = gen(7000 + i)
    img = torch.rand(B7, 3, HW7, HW7, generator=g) * 0.2
    xy = torch.randint(0, HW7 // 2, (B7, 2), generator=g)
    wh = torch.randint(3, HW7 // 2, (B7, 2), generator=g)
    for k in range(B7):
        img[k, :, xy[k, 1]:xy[k, 1] + wh[k, 1], xy[k, 0]:xy[k, 0] + wh[k, 0]] += 0.7
    target = torch.cat([(xy + wh / 2) / HW7 - 0.5, torch.log(wh / (HW7 / 4))], 1)
    img = img * 255 if i == RAW_AT else (img - MEAN7) / STD7
    return (img, target), {}, None


def test_kl_loss_exp_neg_alpha_overflows_on_unnormalised_batch(tmp_path):
    check_failure(tmp_path, BoxRegressor, box_batch, RAW_AT, "kl_loss", FWD,
                  quiet_at=("backbone", "backbone.0", "backbone.2", "bbox_pred", "bbox_std", ""))


# ======================================================================================================================
# 8. a flow network fine-tuned on a mixed dataset with BasicSR's Charbonnier loss in fp16: the first sparse sample
# ======================================================================================================================
HW8, B8, SPARSE_AT, EPS8 = 16, 4, 8, 1e-12


class CharbonnierLoss(nn.Module):
    """BasicSR's charbonnier_loss, sqrt(diff^2 + eps) with eps = 1e-12, over the valid pixels (the diff masked first),
    in the prediction's dtype."""

    def forward(self, pred, target, valid):
        valid = valid.unsqueeze(1).type_as(pred)
        diff = (pred - target.type_as(pred)) * valid
        return torch.sqrt(diff * diff + EPS8).sum() / (2 * valid.sum()).clamp(min=1)


class FlowNetLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(6, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                                 nn.ReLU(), nn.Conv2d(32, 2, 3, padding=1))
        self.charbonnier = CharbonnierLoss()

    def forward(self, image1, image2, flow_gt, valid):
        return self.charbonnier(self.net(torch.cat([image1, image2], 1)), flow_gt, valid)


def flow_batch(i):
    """Frame pairs related by a small circular shift, dense ground truth (a FlyingChairs-like sample); at SPARSE_AT
    the mixed sampler draws a KITTI-like sample: ground truth valid on ~20% of the pixels (0 elsewhere)."""
    g = gen(8000 + i)
    img1 = smooth(g, B8, 3, HW8, HW8) * 2 - 1
    dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
    img2 = torch.roll(img1, shifts=(dy, dx), dims=(2, 3))
    flow = torch.tensor([float(dx), float(dy)]).view(1, 2, 1, 1).expand(B8, 2, HW8, HW8).clone()
    valid = torch.rand(B8, HW8, HW8, generator=g) < (0.2 if i == SPARSE_AT else 2.0)
    return (img1, img2, flow * valid[:, None], valid.float()), {}, None


def test_charbonnier_eps_vanishes_sqrt_backward_nan_on_sparse_sample(tmp_path):
    make, step, name = FlowNetLite, SPARSE_AT, "charbonnier"
    torch.manual_seed(0)
    r = run(make(), flow_batch, step + 3, tmp_path / "run", snap_at=step,
            oracle=lambda m: Producer(m, backward=True, with_kwargs=True))
    assert r["first"] is None and step not in r["bad_loss"], r["first"]         # the forward is finite
    assert r["first_bwd"] == (name, step), r["first_bwd"]                      # the backward NaN starts there
    assert step in r["skipped"] and all(s < 3 for s in r["skipped"] if s < step), r["skipped"]
    fp32_finite(make, r, flow_batch, step)
    named(r, FWD + ("eps_underflow", "underflow"), name, step, phase=("backward", "forward"),
          quiet_at=("net", "net.0", "net.2", "net.4", ""))
