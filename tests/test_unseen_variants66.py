"""Sixty-sixth set: fp16 failures made in the BACKWARD pass only (every forward output and every loss finite), on
UNSAMPLED steps (the default watch takes full statistics on step 0 and every 200th; each failure here starts between
steps 12 and 20), with mechanisms the earlier sets do not build (grep of test_backward_only_unseen.py and
test_unseen_variants*.py: sqrt / pow(p < 1) / rsqrt at 0, acos / asin / acosh at the domain edge, atan2 of a muted
frame, lgamma's digamma, LSQ's (x / s) / s, where-traps and several custom Functions are built there; not tan's
1 + tan^2, hypot at (0, 0) made by fp16 rounding, reciprocal's result^2, nor an IoU Function's union^2). Four
failures and four healthy twins (the same model, the fix applied). Tiny models, fixed seeds, one intra-op thread.
Watched through the public API only (probe_harness.probe_run: `ampdoctor.watch(model, optimizer=AdamW,
scaler=GradScaler("cpu"), run_dir=tmp_path / "run")` at the default settings; CPU fp16 autocast,
scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> close -> `w.report()`); every model
computes its own loss.

Each failure is proven first by its own oracle, before anything ampdoctor says (a failing oracle is a plain failure):
probe_harness.Producer with backward hooks, read and re-armed after every step: no module output is ever
non-finite, no loss is non-finite, and the first module whose gradient w.r.t. its inputs (or own parameters) is
non-finite while the gradient reaching its outputs was finite is the expected PRODUCER at the expected step (before
it only the opening backoffs' scaled overflows, steps 0-2); the scaler skips that step (before it only steps 0-2);
the same run UNWATCHED gives bitwise the same losses; and, from the weights that step's forward ran with, the bad
batch's gradients are non-finite at loss scale 1 (so no lowering of the scale cures it) while the same model in
float32 (no autocast; fp16-stored data read as float32) has a finite loss and finite gradients. Only then must
overflow / nan_origin be an ERROR at the producer, at the oracle's step, phase backward, among the report's first
three findings, and no overflow / nan_origin error at that step may name another module (one that only passed the
non-finite gradient on); a wrong report raises WrongAnswer (strict xfail via probe_harness.wrong).

 1. horizon: single-image camera calibration. The pitch head maps its logit into (-90, 90) degrees with
    90 * tanh(z) ("tanh keeps the angle open") and the `horizon` module gives the horizon line's offset from the
    image centre in image heights, (f / H) * tan(pitch) (the labels' own formula; smooth-L1 loss). At step 14 a
    drone's nadir frame (pitch -89.5 deg, feature statistics far outside the street-level range) arrives: |z| > 4.5,
    fp16 tanh is exactly -1, pitch rounds to -1.5703 and tan = -2066 (finite), but TanBackward's 1 + tan^2 = 4.3e6
    is inf at any loss scale, times tanh' = 0: NaN -> `horizon`. Fix: the angle's range bounded at +-80 deg
    (1 + tan^2 <= 33; twin: the nadir frame's scaled backward still overflows once at the high scale, so the scaler
    skips step 14 and halves: info).
 2. iou: a box-regression head (anchor + deltas; the anchors made in the features' dtype, as torchvision's
    AnchorGenerator makes them) trained with an IoU loss through a custom autograd.Function whose hand-written
    backward takes d IoU / d union = -inter / (union * union) in the inputs' fp16. At step 17 the first small object
    (8 x 9 px of a 1000 px tile: union 8.8e-5) arrives: union^2 = 7.7e-9 is 0 in fp16, inter / 0 = inf at any scale
    -> `iou`. Fix: the Function under torch.amp.custom_fwd(cast_inputs=torch.float32) / custom_bwd (twin: the small
    box's genuinely large gradient overflows the scaled fp16 gradient once: a skip at step 17, info).
 3. ade: a trajectory forecaster whose loss module `ade` is the average displacement error hypot(dx, dy) between
    the predicted and true positions in the MAP frame, in metres, the cached tracks stored in fp16. At step 12 the
    first scene of a second city arrives (map coordinates ~700 m, fp16 spacing 0.5 m) with a parked car: its
    predicted offset (< 0.25 m) rounds away, prediction == truth exactly, hypot(0, 0) = 0 is finite but
    HypotBackward's dx / hypot = 0 / 0 is NaN at any scale -> `ade` (float32: dx = the offset, finite). Fix: agent-
    centric coordinates (the offset against the future relative to the last observed position).
 4. depth: self-supervised-style monocular depth with monodepth2's disp_to_depth (depth = 1 / (min_disp +
    (max_disp - min_disp) sigmoid(z))) and max_depth raised to 1 km for a long-range set; SILog loss on the LiDAR-
    valid pixels. At step 20 a frame with open sky (no LiDAR return, masked out of the loss) arrives: the sky's disp
    falls below 1/256, depth > 256 m (finite, at most 1000), and ReciprocalBackward's -g * depth^2 (>= 65536) is
    inf at any scale (-0 * inf = NaN on the masked pixels) -> `depth`. Fix: the conversion in float32 (`z.float()`).

Result when written (torch 2.13 CPU, default watch): 8 pass, 0 xfail (stable over two runs). ampdoctor's first finding
in each failing run:
 1. `[error] overflow at horizon aten::pow step 14: the backward of TanBackward0 in `horizon` (aten::pow) produced
    +inf from finite gradients ...` (second: `[warning] skipped_steps step 14`: "non-finite at every loss scale
    down to 1").
 2. `[error] overflow at iou aten::div step 17: the backward of IoUFnBackward in `iou` (aten::div) produced +inf
    from finite gradients ... No loss scale makes it finite` (second: `[warning] skipped_steps (run) step 0`, 3 of
    20 skipped; the opening backoffs of steps 0-1 are not blamed on any module).
 3. `[error] nan_origin at ade aten::div step 12: the backward of HypotBackward0 in `ade` (aten::div) produced NaN
    from finite gradients ...` (second: `[warning] skipped_steps (run) step 0`).
 4. `[error] overflow at depth aten::mul step 20: the backward of ReciprocalBackward0 in `depth` (aten::mul)
    produced +inf from finite gradients ...`.
The twins' reports hold only info findings (the opening backoffs; the one benign skip of twins 1 and 2).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants66.py
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import Producer, WrongAnswer, finite, probe_run, same_bits
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

BWD = ("overflow", "nan_origin")
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def own_loss(out, y):
    """The models below compute their own training loss."""
    return out


def run(case, steps, run_dir, *, fix=False, watch=True, snap_at=None):
    """probe_run of `case` (fixed seed) with a backward Producer read and re-armed after every step: r["bwd"] maps a
    step to the first module whose backward made a non-finite gradient from finite incoming ones there."""
    torch.manual_seed(0)
    m = case["make"](fix=fix)
    hold, per_step = {}, {}

    def oracle(mod):
        hold["o"] = Producer(mod, backward=True, with_kwargs=True)
        return hold["o"]

    def after(i, mod):
        o = hold.get("o")
        if o is not None:
            if o.first_bwd is not None:
                per_step[i] = o.first_bwd[0]
            o.first_bwd = None

    r = probe_run(m, case["batch"], own_loss, steps, run_dir, lr=case.get("lr", 1e-3), watch=watch, snap_at=snap_at,
                  oracle=oracle, after=after)
    r["bwd"] = per_step
    if DEBUG and watch:
        print(case["name"], "fix" if fix else "", "bwd", per_step, "skip", r["skipped"], "first", r["first"])
        print("\n".join(lines(r["rep"])[:4]))
    return r


def grads_at_bad(case, sd, *, fix=False, fp32=False):
    """The model with the weights `sd` (the bad step's forward ran with them) on the bad batch, the loss's backward
    at loss scale 1: (loss finite, every gradient finite). fp16 autocast, or float32 throughout (`fp32`: no
    autocast, fp16-stored inputs read as float32)."""
    torch.manual_seed(0)
    m = case["make"](fix=fix)
    m.load_state_dict(sd)
    args, _ = case["batch"](case["bad"])
    if fp32:
        args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    with torch.autocast("cpu", dtype=torch.float16, enabled=not fp32):
        loss = m(*args)
    loss.backward()
    return math.isfinite(loss.item()), all(finite(p.grad) for p in m.parameters() if p.grad is not None)


def proven(case, r, plain):
    """The oracle: a backward-only failure made by case["name"] at case["bad"], at every loss scale, fp16's doing."""
    bad, name = case["bad"], case["name"]
    assert r["first"] is None and r["bad_loss"] == [], (r["first"], r["bad_loss"])        # forward, loss finite
    assert r["bwd"].get(bad) == name, r["bwd"]                                            # the producer, there
    assert all(s < 3 for s in r["bwd"] if s < bad), r["bwd"]                              # before: the opening only
    assert bad in r["skipped"] and all(s < 3 for s in r["skipped"] if s < bad), r["skipped"]
    assert same_bits(r["losses"], plain["losses"]), (r["losses"], plain["losses"])
    assert grads_at_bad(case, r["sd"]) == (True, False)                                   # at scale 1 too
    assert grads_at_bad(case, r["sd"], fp32=True) == (True, True)                         # float32: finite


def named_backward(rep, name, step):
    """overflow / nan_origin, an error at `name`, at `step`, phase backward, among the first three findings; no
    overflow / nan_origin error at that step names another module. Else WrongAnswer."""
    f = next((f for f in rep.findings[:3] if f.rule in BWD and f.module == name and f.step == step
              and f.severity == "error"), None)
    if f is None:
        raise WrongAnswer(f"wanted {BWD} error at {name!r} step {step}; top 3: {lines(rep)[:3]}")
    if f.phase != "backward":
        raise WrongAnswer(f"wrong phase {f.phase!r}: {f.one_line()}")
    carriers = [x.one_line() for x in rep.findings if x.step == step and x.rule in BWD and x.severity == "error"
                and x.module not in (name, None)]
    if carriers:
        raise WrongAnswer(f"a module that only passed the value on blamed: {carriers}; top 3: {lines(rep)[:3]}")
    return f


def check_failure(case, tmp_path):
    bad = case["bad"]
    r = run(case, bad + 3, tmp_path / "run", snap_at=bad)
    plain = run(case, bad + 3, tmp_path / "plain", watch=False)
    proven(case, r, plain)
    named_backward(r["rep"], case["name"], bad)


def check_twin(case, tmp_path):
    """The fix applied, the same batches (the bad one included), bad + 6 steps: healthy (finite losses, no forward
    producer, no skip from step 3 on but case["twin_skips"] (a benign skip of the bad batch's SCALED backward), the
    mean of the last three losses 5% below the first three's, the bad batch's gradients finite at loss scale 1), the
    same losses unwatched; then ampdoctor quiet (no warning or error, exit 0, no RuntimeWarning), else WrongAnswer."""
    steps = case["bad"] + 6
    r = run(case, steps, tmp_path / "run", fix=True, snap_at=case["bad"])
    plain = run(case, steps, tmp_path / "plain", fix=True, watch=False)
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, (ls, r["first"])
    assert [s for s in r["skipped"] if s >= 3] == list(case.get("twin_skips", ())), r["skipped"]
    assert sum(ls[-3:]) < 0.95 * sum(ls[:3]), ls
    assert grads_at_bad(case, r["sd"], fix=True) == (True, True)
    assert same_bits(ls, plain["losses"]), (ls, plain["losses"])
    rep = r["rep"]
    if alarms(rep.findings) or rep.exit_code != 0 or r["warns"]:
        raise WrongAnswer(f"false alarm on a healthy twin: {lines(rep)[:4]}; warnings {r['warns']}")


# ======================================================================================================================
# 1. camera calibration: the horizon offset (f / H) tan(pitch), pitch = 90 deg * tanh(z); a nadir drone frame
# ======================================================================================================================
HOR_BAD = 14


class Horizon(nn.Module):
    """The horizon line's offset from the image centre, in image heights, for a pitch in (-lim, lim)."""

    def __init__(self, fix=False):
        super().__init__()
        self.lim = math.radians(80.0 if fix else 90.0)

    def forward(self, z, f_over_h):
        return f_over_h * torch.tan(self.lim * torch.tanh(z))


class PitchNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.pitch = nn.Linear(32, 1)
        self.horizon = Horizon(fix)

    def forward(self, x, f_over_h, y):
        off = self.horizon(self.pitch(self.enc(x))[:, 0], f_over_h)
        return F.smooth_l1_loss(off.float(), y)


def hor_batch(i):
    """Standardised image statistics of street-level frames (pitch within ~+-20 deg), f / H stored in fp16; at
    HOR_BAD one drone frame looking straight down (its statistics x80, pitch -89.5 deg)."""
    g = gen(6610 + i % 5)
    x = torch.randn(16, 24, generator=g)
    pitch = torch.deg2rad(6 * x[:, :3].sum(1) / 3 ** 0.5 + 2 * torch.randn(16, generator=g))
    f_over_h = (0.6 + 0.6 * torch.rand(16, generator=g)).half()
    if i == HOR_BAD:
        x, pitch = x.clone(), pitch.clone()
        x[9] = x[9] * 80
        pitch[9] = math.radians(-89.5)
    return (x, f_over_h, f_over_h.float() * torch.tan(pitch)), None


HOR = dict(make=PitchNet, batch=hor_batch, bad=HOR_BAD, name="horizon", twin_skips=(HOR_BAD,))


def test_horizon_tan_of_a_saturated_pitch_is_infinite_in_the_horizon_backward(tmp_path):
    m = PitchNet()
    (x, fh, _), _ = hor_batch(HOR_BAD)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        t = torch.tan(m.horizon.lim * torch.tanh(torch.tensor([-6.0], dtype=torch.float16)))
    assert t.item() == -2066.0 and not torch.isfinite(1 + t * t).all()          # tan finite, 1 + tan^2 inf
    check_failure(HOR, tmp_path)


def test_twin_horizon_with_the_pitch_bounded_at_80_degrees_is_quiet(tmp_path):
    check_twin(HOR, tmp_path)


# ======================================================================================================================
# 2. an IoU loss through a custom autograd.Function whose backward squares the union in fp16: a small object
# ======================================================================================================================
IOU_BAD = 17


class IoUFn(torch.autograd.Function):
    """IoU of (x0, y0, x1, y1) boxes with a hand-written backward (a fused IoU loss kernel's reference code)."""

    @staticmethod
    def forward(ctx, p, t):
        iw = (torch.minimum(p[:, 2], t[:, 2]) - torch.maximum(p[:, 0], t[:, 0])).clamp(min=0)
        ih = (torch.minimum(p[:, 3], t[:, 3]) - torch.maximum(p[:, 1], t[:, 1])).clamp(min=0)
        inter = iw * ih
        union = (p[:, 2] - p[:, 0]) * (p[:, 3] - p[:, 1]) + (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1]) - inter
        ctx.save_for_backward(p, t, iw, ih, inter, union)
        return inter / union

    @staticmethod
    def backward(ctx, g):
        p, t, iw, ih, inter, union = ctx.saved_tensors
        d_union = -g * inter / (union * union)
        d_inter = g / union - d_union
        on = ((iw > 0) & (ih > 0)).to(g.dtype)
        wp, hp = p[:, 2] - p[:, 0], p[:, 3] - p[:, 1]
        gp = torch.zeros_like(p)
        gp[:, 0] = -d_inter * on * ih * (p[:, 0] > t[:, 0]).to(g.dtype) - d_union * hp
        gp[:, 2] = d_inter * on * ih * (p[:, 2] < t[:, 2]).to(g.dtype) + d_union * hp
        gp[:, 1] = -d_inter * on * iw * (p[:, 1] > t[:, 1]).to(g.dtype) - d_union * wp
        gp[:, 3] = d_inter * on * iw * (p[:, 3] < t[:, 3]).to(g.dtype) + d_union * wp
        return gp, None


class IoUFn32(IoUFn):
    """The fix: the same Function run in float32 under autocast (forward and backward)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, p, t):
        return IoUFn.forward(ctx, p, t)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        return IoUFn.backward(ctx, g)


class IoULoss(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.fn = IoUFn32 if fix else IoUFn

    def forward(self, p, t):
        return 1 - self.fn.apply(p, t)


class BoxHead(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.reg = nn.Linear(64, 4)
        self.iou = IoULoss(fix)

    def forward(self, feat, anchors, gt):
        d = self.reg(self.trunk(feat))
        anchors = anchors.to(d.dtype)                      # anchors in the features' dtype (torchvision's generator)
        cx, cy = anchors[:, 0] + d[:, 0] * anchors[:, 2], anchors[:, 1] + d[:, 1] * anchors[:, 3]
        w, h = anchors[:, 2] * torch.exp(d[:, 2]), anchors[:, 3] * torch.exp(d[:, 3])
        box = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
        return self.iou(box, gt.to(box.dtype)).float().mean()


def iou_batch(i):
    """32 objects (normalised boxes 0.15-0.45 of the tile) with their matched anchors (cx, cy, w, h) and RoI
    features; at IOU_BAD object 5 is 0.008 x 0.009 (a distant pedestrian), its anchor the matching small one."""
    g = gen(6620 + i % 5)
    n = 32
    c = 0.2 + 0.6 * torch.rand(n, 2, generator=g)
    s = 0.15 + 0.3 * torch.rand(n, 2, generator=g)
    if i == IOU_BAD:
        s = s.clone()
        s[5] = torch.tensor([0.008, 0.009])
    gt = torch.cat([c - s / 2, c + s / 2], 1)
    jit = 1 + 0.3 * (torch.rand(n, 2, generator=g) - 0.5)
    anchors = torch.cat([c + 0.1 * s * torch.randn(n, 2, generator=g), s * jit], 1)
    feat = torch.cat([torch.randn(n, 24, generator=g), (gt - anchors) * 5, torch.log(s / anchors[:, 2:]),
                      anchors[:, 2:] * 3], 1)
    return (feat, anchors, gt), None


IOU = dict(make=BoxHead, batch=iou_batch, bad=IOU_BAD, name="iou", twin_skips=(IOU_BAD,))


def test_custom_iou_function_backward_squares_a_small_union_to_zero_in_fp16(tmp_path):
    u = torch.tensor(8.8e-5, dtype=torch.float16)
    assert u > 0 and u * u == 0 and float(u) ** 2 > 0                            # union^2: 0 in fp16 only
    check_failure(IOU, tmp_path)


def test_twin_iou_function_in_float32_is_quiet(tmp_path):
    check_twin(IOU, tmp_path)


# ======================================================================================================================
# 3. trajectory forecasting in map-frame metres (fp16 cache): hypot(0, 0) of a parked car far from the map origin
# ======================================================================================================================
ADE_BAD = 12


class ADE(nn.Module):
    """The average displacement error, the training loss."""

    def forward(self, pred, gt):
        return torch.hypot(pred[..., 0] - gt[..., 0], pred[..., 1] - gt[..., 1]).mean()


class TrajNet(nn.Module):
    def __init__(self, fix=False, t_obs=8, t_pred=6):
        super().__init__()
        self.fix, self.t_pred = fix, t_pred
        self.enc = nn.Sequential(nn.Linear(2 * (t_obs - 1), 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 2 * t_pred)
        self.ade = ADE()

    def forward(self, hist, fut):
        off = self.head(self.enc(hist.diff(dim=1).flatten(1))).view(-1, self.t_pred, 2).cumsum(1)
        last = hist[:, -1:, :]
        if self.fix:
            return self.ade(off, fut - last)               # agent-centric: relative to the last observed position
        return self.ade(last + off, fut)                   # map frame


def ade_batch(i):
    """16 tracks (8 observed + 6 future positions, metres, map frame, cached in fp16) of agents moving 0.8-2 m a
    step near city 1's map origin; at ADE_BAD the first scene of city 2 (~700 m from its origin), agent 7 parked."""
    g = gen(6630 + i % 5)
    n = 16
    far = i == ADE_BAD
    p0 = (torch.tensor([700.0, 650.0]) + 200 * torch.rand(n, 2, generator=g) if far
          else torch.tensor([60.0, 40.0]) + 80 * torch.rand(n, 2, generator=g))
    v = (0.8 + 1.2 * torch.rand(n, 1, generator=g)) * F.normalize(torch.randn(n, 2, generator=g), dim=1)
    if far:
        v = v.clone()
        v[7] = 0.0
    t = torch.arange(14.0)[None, :, None]
    turn = 0.02 * torch.randn(n, 1, 1, generator=g) * t ** 2
    path = (p0[:, None, :] + v[:, None, :] * t + turn * torch.stack([-v[:, 1], v[:, 0]], 1)[:, None, :]).half()
    return (path[:, :8], path[:, 8:]), None


ADE_CASE = dict(make=TrajNet, batch=ade_batch, bad=ADE_BAD, name="ade")


def test_ade_hypot_of_a_parked_car_rounded_onto_its_truth_is_nan_in_the_ade_backward(tmp_path):
    (hist, fut), _ = ade_batch(ADE_BAD)
    assert (hist[7, -1] + torch.tensor([0.2, -0.2], dtype=torch.float16) == fut[7, 0]).all()   # 0.2 m rounds away
    check_failure(ADE_CASE, tmp_path)


def test_twin_ade_in_agent_centric_coordinates_is_quiet(tmp_path):
    check_twin(ADE_CASE, tmp_path)


# ======================================================================================================================
# 4. monodepth2's disp_to_depth with max_depth 1 km: the sky's depth^2 in ReciprocalBackward
# ======================================================================================================================
DEP_BAD = 20
MIN_DISP, MAX_DISP = 1.0 / 1000, 1.0 / 0.1                   # max_depth 1000 m, min_depth 0.1 m


class DispToDepth(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, z):
        if self.fix:
            z = z.float()
        return 1.0 / (MIN_DISP + (MAX_DISP - MIN_DISP) * torch.sigmoid(z))


class DepthNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU())
        self.disp = nn.Linear(48, 1)
        with torch.no_grad():
            self.disp.bias.fill_(-4.0)
        self.depth = DispToDepth(fix)

    def forward(self, x, gt):
        depth = self.depth(self.disp(self.enc(x))[..., 0])
        valid = gt > 0                                     # LiDAR returns only
        d = depth.float().log()[valid] - gt[valid].log()
        return (d * d).mean() - 0.85 * d.mean() ** 2         # SILog


DEP_W = torch.randn(12, generator=gen(6641)) * 0.4


def dep_batch(i):
    """4 frames x 64 pixels of per-pixel features, LiDAR depth 1-20 m; at DEP_BAD frame 2's first 20 pixels are
    open sky (features of 'very far', no LiDAR return: gt 0, masked)."""
    g = gen(6640 + i % 5)
    x = torch.randn(4, 64, 12, generator=g)
    gt = torch.exp(1.5 + (x @ DEP_W).clamp(-1.2, 1.2))
    if i == DEP_BAD:
        x, gt = x.clone(), gt.clone()
        x[2, :20] = x[2, :20] * 0.2 + DEP_W / DEP_W.norm() ** 2 * 60
        gt[2, :20] = 0.0
    return (x, gt), None


DEP = dict(make=DepthNet, batch=dep_batch, bad=DEP_BAD, name="depth")


def test_inverse_depth_of_the_sky_squares_past_fp16_in_the_depth_backward(tmp_path):
    r = torch.tensor([300.0], dtype=torch.float16)
    assert torch.isfinite(r).all() and not torch.isfinite(r * r).all()        # depth 300 m fine, depth^2 inf
    check_failure(DEP, tmp_path)


def test_twin_inverse_depth_in_float32_is_quiet(tmp_path):
    check_twin(DEP, tmp_path)
