"""Forty-fifth set: DETECTION, SEGMENTATION, SPEECH AND 3D HEADS. Ten fp16 failures that start mid-run at a known
step (6-11: never a sampled step; full statistics are taken on step 0 and every 200th) in the heads and losses of
detection, segmentation, speech and 3D code, each written the way those repos write it: a RetinaNet box decoder
without torchvision's clamp, YOLOv5's CIoU with eps 1e-9, a CenterPoint heatmap focal loss on log(sigmoid), nnU-Net's
batch dice, FCOS's joint score sqrt(cls * ctr), an integral-pose soft-argmax, a 16-band Fourier encoding, an RNN-T
joint's hand-written log-softmax, BEVFormer's point sampling without force_fp32, and a log-mel front end with eps
1e-10. Small models of a few named modules each (the producer is one specific submodule), fixed seeds.
Watched through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")`
at the default settings) -> an ordinary CPU fp16 autocast + `torch.amp.GradScaler("cpu")` loop: for 2-9
probe_harness.probe_run (scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update -> close ->
`w.report()`); 1 in torchvision's references/detection train_one_epoch (SGD + warmup, a list of images and a list of
target dicts in, a dict of losses out, `sys.exit(1)` on a non-finite loss, before that step's backward); 10 in
SpeechBrain's Brain.fit_batch (check_loss_isfinite: a warning per non-finite loss, a ValueError once its patience
of 3 is exhausted). 1 and 10 are checked on the live report after the exit / crash AND on
`ampdoctor.diagnose(run_dir)`.

Each failure is proven first by the test's own oracle: probe_harness.Producer (keyword inputs checked: the first
module whose output is non-finite while its inputs and own parameters were finite, at the expected step; for 5 its
backward hooks: the first module whose input gradient is non-finite while its output gradient was finite, every
forward and loss finite), the loss (first non-finite there), the scaler (it skips that step; before it only the
first steps' backoffs, 0-2; for 7 GradScaler's search, consecutive from step 0), a float32 check (the model with the
weights the bad step's forward ran with, probe_run's snap_at, runs the bad batch in float32 with no autocast: finite
output, and where a loss_fn is given a finite loss and finite gradients), and the mechanism itself, re-run on those
weights under fp16 autocast (the values entering the producer finite and fp16, the threshold crossed: exp's 11.09,
sigmoid's 17.3, 65504, 1e-9 / 1e-10 == 0, a zero product; and not crossed in float32 or on the batch before). A
failing oracle is a plain failure. Only then must the rule be among the report's first three findings at the
PRODUCER, at that step, in that phase, an `error` (CONTRACT.md: training is broken), with no error at the modules
that only passed the inf/NaN on (the producer's children and parents, the root); a wrong report raises WrongAnswer
naming ampdoctor's top three (rule@module op step phase [severity]). On the CPU autocast keeps exp, log, sigmoid,
sum, sin and softmax in the input's dtype and runs matmul / linear / conv in fp16 (grid_sample and the BCE losses in
fp32): every producer below computes in fp16 inside its own code.

 1. RetinaNet (two levels P3 / P4, cls and box convs SHARED by the levels, `box_coder` called once per level):
    torchvision's BoxCoder.decode_single ported without the clamp of dw, dh at log(1000 / 16); at step 8 one frame
    comes from a camera's 14-bit raw output divided by 255 (x 64): dw up to ~32 > log(65504 / 24), exp(dw) * anchor
    = inf -> overflow at `box_coder`, step 8 (the script then exits on "Loss is nan, stopping training").
 2. a YOLOv5-style head whose CIoU loss (`loss_box`) is YOLOv5 v5.0's bbox_iou with eps 1e-9, the targets cast to
    the predictions' dtype: at step 7 the first image of a crowd-counting set whose head points were converted to
    0 x 0 boxes: h2 = 0 + 1e-9 = 0 in fp16, atan(w2 / h2) = atan(0 / 0) = NaN -> nan_origin (or eps_underflow) at
    `loss_box`, step 7.
 3. a CenterPoint-style BEV heatmap head with CenterNet's focal loss (`loss_heatmap`, mmdet3d's avg_factor keyword)
    on log(sigmoid(x)) and log(sigmoid(-x)), no clamp: at step 10 the first sweep of a second LiDAR whose driver
    reports reflectivity in percent (x 100): logits up to ~27, sigmoid(-x) == 0 in fp16 for x > 17.3, log 0 = -inf
    -> overflow (log 0) or underflow (the flushed sigmoid) at `loss_heatmap`, step 10.
 4. nnU-Net-style soft dice with batch_dice (tp / fp / fn summed over the batch and the patch) in fp16, in the
    model's training forward: the patch-size curriculum goes from 64 x 64 to 128 x 128 at step 9 (131072 voxels,
    ~91000 foreground): 2 tp and the denominator pass 65504, inf / inf = NaN -> overflow at `dice`, step 9.
 5. a two-level FCOS (mmdet's layout, `score` shared by the levels, a dict of losses) trained on its ranking score
    sqrt(sigmoid(cls) * sigmoid(ctr)): at step 11 one frame from the cache of pre-normalised tensors goes through
    Normalize again (values down to -11): cls + ctr logits < -17.3, the product is 0 in fp16 (> 0 in float32),
    sqrt's gradient 1 / (2 sqrt(0)) -> NaN in the BACKWARD only -> nan_origin (or overflow) at `score`, step 11,
    backward.
 6. an integral-pose soft-argmax whose heatmap is exp(beta x) / sum exp(beta x) written out: the training loop's
    schedule sharpens beta from 1 to 40 at step 8: beta x up to ~37 > 11.09 -> overflow at `soft_argmax`, step 8.
 7. a neural SDF with nerf-pytorch's Fourier encoding (16 bands, Python-float frequencies: x keeps fp16) of points
    mapped by a learned alignment (an nn.Linear, fp16): GradScaler searches for a scale on steps 0-4 (2^15 cos in
    the backward), then from step 8 the far-field curriculum samples points in [-2.5, 2.5]^3: 2^15 x > 65504, inf,
    sin(inf) = NaN -> overflow at `embed`, step 8.
 8. an RNN-T (fine-tuned from a float32 checkpoint made here by 40 steps: its joint is confident, logits up to ~7)
    whose `joint` writes log-softmax as logits - log(sum(exp(logits))): at step 9 one clip read with
    normalize=False (int16 amplitudes: log-mel energies +20.8 under mean-only CMVN): logits up to 12.6 > 11.09 ->
    overflow at `joint`, step 9 (not `joint.out`, whose logits are finite).
 9. BEVFormer-style spatial cross-attention (`sca`, called with keyword arguments) whose point_sampling runs in
    fp16 (the port without @force_fp32): lidar2img @ p (a matmul: fp16), divided by max(depth, 1e-5); from step 7
    the second vehicle's side camera has half the BEV grid behind it: u d / 1e-5 = inf in fp16 (~1e7 and masked in
    float32), grid_sample(inf) = NaN -> overflow at `sca`, step 7.
10. a keyword spotter's in-model log-mel front end, log(mel + 1e-10): from step 6 the length-bucketing sampler is
    swapped for a plain shuffle and short clips are zero-padded: mel power 0, 1e-10 == 0 in fp16, log(0) = -inf ->
    overflow or eps_underflow at `frontend`, step 6 (SpeechBrain's patience ends the run at step 9).
Twins (the fix applied, the same data including the special batches; no warning, no error, no RuntimeWarning, the
loss down by 10%): 2 with YOLOv5's current eps 1e-7 (1.19e-7 in fp16: it survives), 4 with the dice in float32,
6 with F.softmax (the max subtracted).
Not built: a GIoU loss dividing by a union that is 0 (it needs a predicted box degenerate too; YOLO's CIoU aspect
term divides by the box's own height instead, case 2); a deformable-attention offset Linear overflowing (a plain
Linear overflow, built in many sets; case 9 carries the offsets); activation checkpointing around case 9's `sca`
(BEVFormer's with_cp): ampdoctor alone is right there (overflow at `sca`, aten::div, step 7), but the oracle's hooks
change what the recomputation saves and torch.utils.checkpoint raises, so it is not asserted.

What ampdoctor says (torch 2.13 CPU): ten of ten right at the producer, its step and phase among the first three
findings, an error, and the three twins quiet:
1 `[error] overflow at box_coder aten::exp step 8` (its only finding; the same from diagnose(run_dir));
2 `[error] eps_underflow at loss_box aten::add step 7` + `[error] nan_origin at loss_box aten::div step 7`;
3 `[error] overflow at loss_heatmap aten::log step 10` + `[error] underflow at loss_heatmap aten::log step 10`;
4 `[error] overflow at dice aten::mul step 9`; 5 `[error] nan_origin at score aten::div step 11` (backward,
SqrtBackward0); 6 `[error] overflow at soft_argmax aten::exp step 8`; 7 `[error] overflow at embed aten::mul step 8`
(the search of steps 0-4 `[info] ... as designed`); 8 `[error] overflow at joint aten::exp step 9` ("input up to
12.58"); 9 `[error] overflow at sca aten::div step 7`; 10 `[error] eps_underflow at frontend aten::add step 6` +
`[error] overflow at frontend aten::log step 6` (both reports).
Noticed (not asserted): in 5 the skip of step 11 is `[info] skipped_steps ... a normal rate for dynamic loss
scaling`, although its NaN (0 / 0 in sqrt's backward) is there at every loss scale; in the forward cases a skip
whose forward was non-finite is an error ("which no loss scale can fix").

Run: .venv/bin/python -m pytest -n 0 tests/test_unseen_variants45.py -q -p no:cacheprovider (about 7 s)
"""
from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import (Producer, WrongAnswer, at_top3, finite, probe_run, quiet_twin,
                           real_fwd_after_backoffs as real_fwd)
from scenarios import gen, no_error_at, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def run(m, batch, loss_fn, steps, run_dir, *, lr=1e-3, backward=False, **kw):
    """probe_harness.probe_run (the user's loop at the default settings: AdamW, GradScaler("cpu") at its default
    init_scale 65536, scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update) with a Producer on
    keyword inputs as the oracle (`backward`: its backward hooks too); `batch(i)` gives (args, kwargs, y)."""
    return probe_run(m, batch, loss_fn, steps, run_dir, lr=lr,
                     oracle=lambda m: Producer(m, backward=backward, with_kwargs=True), **kw)


def real_bwd(r, name, step):
    """The backward failure is real: every forward and loss finite, the oracle's first backward producer `name` at
    `step`, the scaler skips it (before it only the first steps' ordinary backoffs, steps 0-2)."""
    assert r["first"] is None and r["bad_loss"] == [], r
    assert r["first_bwd"] == (name, step), r
    assert step in r["skipped"] and all(s < 3 for s in r["skipped"] if s < step), r


def snapshot_model(make, r):
    """The model with the weights the bad step's forward ran with (probe_run's snap_at)."""
    torch.manual_seed(0)
    m = make()
    m.load_state_dict(r["sd"])
    return m


def fp32_finite(make, r, batch, step, loss_fn=None, before=None):
    """The bad batch is an fp16 failure: the model, with the weights the bad step's forward ran with (probe_run's
    snap_at), runs it in float32 throughout (no autocast, its floating inputs as float32) to a finite output (with
    `loss_fn`: a finite loss and finite gradients too)."""
    m = snapshot_model(make, r)
    if before is not None:
        before(step, m)
    args, kwargs, y = batch(step)
    args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    out = m(*args, **kwargs)
    assert finite(out), step
    if loss_fn is not None:
        loss = loss_fn(out, y)
        loss.backward()
        assert math.isfinite(loss.item()) and all(finite(p.grad) for p in m.parameters() if p.grad is not None)


def fp16_calls(make, r, batch, step, name, before=None):
    """[(inputs, output)] of each call of module `name` (inputs: its positional then keyword inputs) when the bad
    step's forward is re-run (its weights, its batch, fp16 autocast, no grad): the mechanism behind the oracle's
    verdict."""
    m = snapshot_model(make, r)
    if before is not None:
        before(step, m)
    seen = []
    h = dict(m.named_modules())[name].register_forward_hook(
        lambda mod, a, kw, o: seen.append((tuple(a) + tuple(kw.values()), o)), with_kwargs=True)
    args, kwargs, _ = batch(step)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        m(*args, **kwargs)
    h.remove()
    return seen


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} {f.op} step {f.step} {f.phase} [{f.severity}]"
            for f in rep.findings[:3]]


def named(r, rules, module, step, phase="forward", quiet_at=()):
    """The report check: one of `rules` at the producer `module`, at `step`, in `phase`, an error, among the first
    three findings (and no error at the modules that only passed it on). A failure is a WrongAnswer naming
    ampdoctor's top three (rule@module op step phase [severity]) and the RuntimeWarnings it gave."""
    rep = r["rep"]
    try:
        at_top3(rep, rules, module, step=step, phase=phase, severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:800]})") from None


def quiet(r):
    """A twin: healthy (the loss down by 10% at least) and ampdoctor quiet (probe_harness.quiet_twin)."""
    quiet_twin(r, fall=0.9)


def own_loss(out, y):
    return out


def mse(out, y):
    return F.mse_loss(out.float(), y)


FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# 1. a RetinaNet-style box decoder ported from torchvision's BoxCoder.decode_single without bbox_xform_clip
# ======================================================================================================================
class BoxCoder(nn.Module):
    """torchvision.models.detection._utils.BoxCoder.decode_single (weights 1, 1, 1, 1 as RetinaNet's), the anchors
    cast to the codes' dtype as torchvision does, ported without torchvision's clamp of dw, dh at bbox_xform_clip =
    log(1000 / 16)."""

    def forward(self, rel_codes, boxes):
        boxes = boxes.to(rel_codes.dtype)
        widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        ctr_x, ctr_y = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
        dx, dy, dw, dh = rel_codes.unbind(-1)
        pred_ctr_x, pred_ctr_y = dx * widths + ctr_x, dy * heights + ctr_y
        pred_w, pred_h = torch.exp(dw) * widths, torch.exp(dh) * heights
        return torch.stack([pred_ctr_x - 0.5 * pred_w, pred_ctr_y - 0.5 * pred_h,
                            pred_ctr_x + 0.5 * pred_w, pred_ctr_y + 0.5 * pred_h], -1)


def grid_anchors(size, stride, anchor):
    """One square anchor of side `anchor` per cell of a size x size map of stride `stride` (x1, y1, x2, y2)."""
    c = (torch.arange(size, dtype=torch.float32) + 0.5) * stride
    cy, cx = torch.meshgrid(c, c, indexing="ij")
    return torch.stack([cx - anchor / 2, cy - anchor / 2, cx + anchor / 2, cy + anchor / 2], -1).reshape(-1, 4)


class RetinaLite(nn.Module):
    """A two-level RetinaNet with torchvision's detection API (a list of image tensors, a list of target dicts in,
    a dict of losses out): a conv stem (P3, stride 4), a stride-2 conv (P4, stride 8), classification and
    box-regression convs SHARED by the levels (RetinaNetHead's layout, one anchor per cell: 12 px on P3, 24 px on
    P4), the box coder called once per level, the decoded boxes of the positives trained with an L1 loss."""

    def __init__(self, size=32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.p4 = nn.Sequential(nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU())
        self.cls_logits = nn.Conv2d(32, 1, 3, padding=1)
        self.bbox_reg = nn.Conv2d(32, 4, 3, padding=1)
        self.box_coder = BoxCoder()
        self.register_buffer("anchors3", grid_anchors(size // 4, 4.0, 12.0))
        self.register_buffer("anchors4", grid_anchors(size // 8, 8.0, 24.0))

    def forward(self, images, targets):
        x = torch.stack(images)
        gt = torch.stack([t["boxes"][0] for t in targets])
        pos = torch.stack([t["positives"] for t in targets])
        b = x.shape[0]
        p3 = self.stem(x)
        logits, boxes = [], []
        for f, anchors in ((p3, self.anchors3), (self.p4(p3), self.anchors4)):
            logits.append(self.cls_logits(f).flatten(1))
            deltas = self.bbox_reg(f).permute(0, 2, 3, 1).reshape(-1, 4)
            boxes.append(self.box_coder(deltas, anchors.repeat(b, 1)).view(b, -1, 4))
        logits, boxes = torch.cat(logits, 1), torch.cat(boxes, 1)
        reg = (boxes.float() - gt[:, None]).abs().sum(-1)
        return {"classification": F.binary_cross_entropy_with_logits(logits.float(), pos.float()),
                "bbox_regression": (reg * pos).sum() / pos.sum() / 32.0}


def loss_dict_sum(out, y):
    """The detection loop's loss: the sum of the model's loss dict (torchvision's references/detection)."""
    return sum(out.values())


MEAN, STD = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
LEVELS = ((torch.arange(8) + 0.5) * 4, (torch.arange(4) + 0.5) * 8)        # cell centres of P3 and P4 (px)
RAWFRAME_AT = 8


def inside(lo, hi, v):
    return (v[None] > lo[:, None]) & (v[None] < hi[:, None])


def retina_batch(i, size=32):
    """8 RGB frames with one bright box each (8-18 px), normalised with ImageNet's mean/std; the positives are the
    anchors (P3 then P4) whose centre lies in the box. At RAWFRAME_AT one frame comes from the second camera's 14-bit
    raw output (0-16383), divided by 255 as the 8-bit frames are: up to 64x the range Normalize expects."""
    g = gen(100 + i)
    img = torch.rand(8, 3, size, size, generator=g) * 0.3
    xy = torch.randint(0, size - 18, (8, 2), generator=g).float()
    wh = torch.randint(8, 19, (8, 2), generator=g).float()
    gt = torch.cat([xy, xy + wh], -1)
    for b in range(8):
        x1, y1, x2, y2 = gt[b].long().tolist()
        img[b, :, y1:y2, x1:x2] = 0.9
    if i == RAWFRAME_AT:
        img[5] = img[5] * (16383 / 255)
    pos = torch.cat([(inside(gt[:, 1], gt[:, 3], c)[:, :, None] & inside(gt[:, 0], gt[:, 2], c)[:, None, :]).flatten(1)
                     for c in LEVELS], 1)
    return ((img - MEAN) / STD, gt, pos), {}, None


def retina_batch_api(i):
    """retina_batch in torchvision's detection API: a list of 8 image tensors and a list of 8 target dicts
    (boxes (1, 4), labels, the anchors' positive mask)."""
    (img, gt, pos), _, _ = retina_batch(i)
    return (list(img), [{"boxes": gt[k:k + 1], "labels": torch.ones(1, dtype=torch.long), "positives": pos[k]}
                        for k in range(8)]), {}, None


def torchvision_train_one_epoch(m, batch, steps, run_dir, lr=0.01):
    """torchvision's references/detection/engine.py train_one_epoch under `with ampdoctor.watch(...)` (default
    settings): SGD (momentum 0.9, weight decay 1e-4), the first epoch's linear warmup (LinearLR from 1/1000 over
    1000 iterations), forward under autocast -> losses = sum(loss_dict.values()) -> `loss_value = losses.item()`;
    `if not math.isfinite(loss_value): print(...); sys.exit(1)` -> zero_grad -> scaler.scale(losses).backward() ->
    scaler.step -> scaler.update -> lr_scheduler.step(). The oracle (a Producer) runs alongside; returns its first
    producer, the losses, the weights the last forward ran with, where and how the script exited, and the reports
    (w.report() after the exit, and ampdoctor.diagnose(run_dir) as the user runs it afterwards)."""
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / 1000, total_iters=1000)
    sc = torch.amp.GradScaler("cpu")
    orc = Producer(m, with_kwargs=True)
    r = dict(losses=[], exited=None, sd=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) as w:
                for i in range(steps):
                    orc.step = i
                    r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
                    (images, targets), _, _ = batch(i)
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss_dict = m(images, targets)
                        losses = sum(loss for loss in loss_dict.values())
                    loss_value = losses.item()
                    r["losses"].append(loss_value)
                    if not math.isfinite(loss_value):
                        print(f"Loss is {loss_value}, stopping training")
                        sys.exit(1)
                    opt.zero_grad()
                    sc.scale(losses).backward()
                    sc.step(opt)
                    sc.update()
                    sched.step()
        except SystemExit as e:
            r["exited"] = (i, e.code)
        finally:
            orc.remove()
    r["first"] = orc.first
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["rep"], r["disk"] = w.report(), ampdoctor.diagnose(run_dir)
    return r


def test_retinanet_box_decoder_without_the_clamp_overflows_exp_dw(tmp_path):
    torch.manual_seed(0)
    r = torchvision_train_one_epoch(RetinaLite(), retina_batch_api, RAWFRAME_AT + 4, tmp_path / "run")
    # truth: `box_coder` (one of its two calls) is the first producer, at RAWFRAME_AT; every loss before it finite;
    # the script stops there (torchvision's sys.exit(1) on a non-finite loss, before any backward of that step)
    assert r["first"] == ("box_coder", RAWFRAME_AT), r["first"]
    assert r["exited"] == (RAWFRAME_AT, 1) and len(r["losses"]) == RAWFRAME_AT + 1, r
    assert all(map(math.isfinite, r["losses"][:-1])) and not math.isfinite(r["losses"][-1]), r["losses"]
    fp32_finite(RetinaLite, r, retina_batch_api, RAWFRAME_AT)
    # the mechanism: the codes reaching the (shared) decoder are finite fp16; the raw frame's dw / dh pass
    # log(65504 / 24) (exp(dw) * anchor > 65504) and stay far below float32's limit
    calls = fp16_calls(RetinaLite, r, retina_batch_api, RAWFRAME_AT, "box_coder")
    dwdh = torch.cat([a[0][:, 2:].float() for a, _ in calls])
    assert len(calls) == 2 and all(a[0].dtype == torch.float16 and finite(a) for a, _ in calls)
    assert math.log(65504 / 24) < float(dwdh.max()) < 80.0 and not all(finite(o) for _, o in calls), dwdh.max()
    # the live report after the exit and the one the user gets from the run directory
    for rep in (r["rep"], r["disk"]):
        named(dict(r, rep=rep), FWD, "box_coder", RAWFRAME_AT, quiet_at=("bbox_reg", "cls_logits", "stem", "p4", ""))


# ======================================================================================================================
# 2 + twin. a YOLO-style head whose CIoU loss is YOLOv5 v5.0's bbox_iou (eps=1e-9), the targets cast to the
#    predictions' dtype; a zero-size (point) annotation
# ======================================================================================================================
class CIoULoss(nn.Module):
    """1 - CIoU (YOLOv5 v5.0's bbox_iou(..., x1y1x2y2=False, CIoU=True, eps=1e-9), boxes as cx, cy, w, h)."""

    def __init__(self, eps=1e-9):
        super().__init__()
        self.eps = eps

    def forward(self, box1, box2):
        eps = self.eps
        b1_x1, b1_x2 = box1[:, 0] - box1[:, 2] / 2, box1[:, 0] + box1[:, 2] / 2
        b1_y1, b1_y2 = box1[:, 1] - box1[:, 3] / 2, box1[:, 1] + box1[:, 3] / 2
        b2_x1, b2_x2 = box2[:, 0] - box2[:, 2] / 2, box2[:, 0] + box2[:, 2] / 2
        b2_y1, b2_y2 = box2[:, 1] - box2[:, 3] / 2, box2[:, 1] + box2[:, 3] / 2
        inter = (torch.min(b1_x2, b2_x2) - torch.max(b1_x1, b2_x1)).clamp(0) * \
                (torch.min(b1_y2, b2_y2) - torch.max(b1_y1, b2_y1)).clamp(0)
        w1, h1 = b1_x2 - b1_x1, b1_y2 - b1_y1 + eps
        w2, h2 = b2_x2 - b2_x1, b2_y2 - b2_y1 + eps
        union = w1 * h1 + w2 * h2 - inter + eps
        iou = inter / union
        cw = torch.max(b1_x2, b2_x2) - torch.min(b1_x1, b2_x1)
        ch = torch.max(b1_y2, b2_y2) - torch.min(b1_y1, b2_y1)
        c2 = cw ** 2 + ch ** 2 + eps
        rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2) ** 2 + (b2_y1 + b2_y2 - b1_y1 - b1_y2) ** 2) / 4
        v = (4 / math.pi ** 2) * torch.pow(torch.atan(w2 / h2) - torch.atan(w1 / h1), 2)
        with torch.no_grad():
            alpha = v / (v - iou + (1 + eps))
        return 1 - (iou - (rho2 / c2 + v * alpha))


class YoloLite(nn.Module):
    """A one-scale YOLOv5-style detector on an 8x8 grid (stride 4, one 6 x 6 px anchor): per cell (tx, ty, tw, th,
    obj); the positive is the cell of each target's centre; pxy = 2 sigmoid - 0.5, pwh = (2 sigmoid)^2 anchor;
    the objectness target is the detached IoU; the targets cast with `.type_as(pbox)` (the port's collate keeps
    them in the activations' dtype). Returns the loss."""

    def __init__(self, eps=1e-9):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.SiLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.SiLU())
        self.detect = nn.Conv2d(32, 5, 1)
        self.loss_box = CIoULoss(eps)
        self.anchor = 6.0 / 4

    def forward(self, images, tgt):
        p = self.detect(self.backbone(images)).permute(0, 2, 3, 1)           # (B, 8, 8, 5)
        b = torch.arange(images.shape[0])
        gij = tgt[:, :2].long()
        ps = p[b, gij[:, 1], gij[:, 0]]
        pxy = ps[:, :2].sigmoid() * 2 - 0.5
        pwh = (ps[:, 2:4].sigmoid() * 2) ** 2 * self.anchor
        pbox = torch.cat([pxy, pwh], 1)
        tbox = torch.cat([tgt[:, :2] - gij, tgt[:, 2:]], 1).type_as(pbox)
        ciou_loss = self.loss_box(pbox, tbox)
        tobj = torch.zeros_like(p[..., 4])
        tobj[b, gij[:, 1], gij[:, 0]] = (1 - ciou_loss.detach()).clamp(0).to(tobj.dtype)
        lobj = F.binary_cross_entropy_with_logits(p[..., 4].float(), tobj.float())
        return 0.05 * ciou_loss.mean().float() + lobj


POINT_AT = 7


def yolo_batch(i):
    """8 frames (32 x 32) with one bright box each (4-12 px); targets in grid units (cx, cy, w, h). At POINT_AT the
    first image of a crowd-counting set merged into training: its head-point labels were converted to boxes of
    size 0 x 0."""
    g = gen(200 + i)
    img = torch.rand(8, 3, 32, 32, generator=g) * 0.3
    wh = torch.randint(4, 13, (8, 2), generator=g).float()
    xy = torch.rand(8, 2, generator=g) * (32 - wh)
    for b in range(8):
        x1, y1 = xy[b].long().tolist()
        x2, y2 = (xy[b] + wh[b]).long().tolist()
        img[b, :, y1:y2, x1:x2] = 0.9
    tgt = torch.cat([xy + wh / 2, wh], 1) / 4
    if i == POINT_AT:
        tgt[3, 2:] = 0.0
    return ((img - MEAN) / STD, tgt), {}, None


def test_yolo_ciou_eps_1e9_nan_on_a_zero_size_box(tmp_path):
    torch.manual_seed(0)
    r = run(YoloLite(), yolo_batch, own_loss, POINT_AT + 3, tmp_path / "run", lr=3e-3, snap_at=POINT_AT)
    real_fwd(r, "loss_box", POINT_AT)
    fp32_finite(YoloLite, r, yolo_batch, POINT_AT)
    # the mechanism: the point annotation is the only zero-size box of the run; 1e-9 is 0 in fp16 (w2 / h2 = 0 / 0),
    # 1e-7 (the twin's) is not
    assert [i for i in range(POINT_AT + 3) if bool((yolo_batch(i)[0][1][:, 2:] == 0).any())] == [POINT_AT]
    assert float(torch.tensor(1e-9, dtype=torch.float16)) == 0.0 < float(torch.tensor(1e-7, dtype=torch.float16))
    named(r, FWD + ("eps_underflow",), "loss_box", POINT_AT, quiet_at=("detect", "backbone", ""))


def test_twin_yolo_ciou_eps_1e7_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(YoloLite(eps=1e-7), yolo_batch, own_loss, POINT_AT + 6, tmp_path / "run", lr=3e-3))


# ======================================================================================================================
# 3. a CenterPoint-style BEV heatmap head with CenterNet's focal loss written on sigmoid(x) (no clamp) in fp16
# ======================================================================================================================
class HeatmapFocalLoss(nn.Module):
    """CenterNet's _neg_loss (Law & Deng's focal loss on Gaussian heatmaps) on p = sigmoid(x), without CenterNet's
    _sigmoid clamp, its log(1 - p) rewritten as log(sigmoid(-x)) (the "symmetric" form), in the logits' dtype;
    normalised by mmdet3d's avg_factor (the number of peaks, computed by the caller)."""

    def forward(self, logits, gt, avg_factor=1.0):
        p = torch.sigmoid(logits)
        gt = gt.to(p.dtype)
        pos = gt.eq(1).to(p.dtype)
        neg = 1 - pos
        pos_loss = torch.log(p) * (1 - p) ** 2 * pos
        neg_loss = torch.log(torch.sigmoid(-logits)) * p ** 2 * (1 - gt) ** 4 * neg
        return -(pos_loss.sum() + neg_loss.sum()) / avg_factor


class BEVCenterNet(nn.Module):
    """A LiDAR BEV detector's centre head: pillar pseudo-image (occupancy, max height, mean intensity) -> a conv
    encoder -> a heatmap conv (bias -2.19, CenterPoint's init) -> the focal loss. Returns the loss."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                     nn.ReLU())
        self.heatmap = nn.Conv2d(16, 2, 3, padding=1)
        with torch.no_grad():
            self.heatmap.bias.fill_(-2.19)
        self.loss_heatmap = HeatmapFocalLoss()

    def forward(self, bev, gt):
        num_pos = float(gt.eq(1).sum())
        return self.loss_heatmap(self.heatmap(self.encoder(bev)), gt, avg_factor=max(num_pos, 1.0))


SENSOR2_AT = 10


def bev_batch(i, size=24):
    """8 BEV grids (24 x 24 cells) with 1-3 objects of 2 classes each: occupancy and height channels, intensity in
    0-1, Gaussian centre heatmaps (sigma 1.5 cells, peak 1). At SENSOR2_AT the first sweep of the second LiDAR
    model, whose driver reports reflectivity in percent (0-100)."""
    g = gen(300 + i)
    bev = torch.zeros(8, 3, size, size)
    gt = torch.zeros(8, 2, size, size)
    yy, xx = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    for b in range(8):
        bev[b, 0] = (torch.rand(size, size, generator=g) < 0.05).float()
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            cx, cy = torch.randint(2, size - 2, (2,), generator=g).tolist()
            c = int(torch.randint(0, 2, (1,), generator=g))
            bev[b, 0, cy - 1:cy + 2, cx - 1:cx + 2] = 1.0
            bev[b, 1, cy - 1:cy + 2, cx - 1:cx + 2] = 0.5 + c
            bev[b, 2, cy - 1:cy + 2, cx - 1:cx + 2] = 0.3 + 0.5 * torch.rand(1, generator=g)
            gt[b, c] = torch.maximum(gt[b, c], torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * 1.5 ** 2)))
    if i == SENSOR2_AT:
        bev[4, 2] = bev[4, 2] * 100
    return (bev, gt), {}, None


def test_centerpoint_focal_log_of_fp16_sigmoid_is_minus_inf(tmp_path):
    torch.manual_seed(0)
    r = run(BEVCenterNet(), bev_batch, own_loss, SENSOR2_AT + 3, tmp_path / "run", lr=3e-3, snap_at=SENSOR2_AT)
    real_fwd(r, "loss_heatmap", SENSOR2_AT)
    fp32_finite(BEVCenterNet, r, bev_batch, SENSOR2_AT)
    # the mechanism: the heatmap logits are finite fp16; on the percent-reflectivity sweep some pass 17.3, where
    # sigmoid(-x) is 0 in fp16 (log 0 = -inf), while in float32 every sigmoid(-x) stays > 0
    (a, o), = fp16_calls(BEVCenterNet, r, bev_batch, SENSOR2_AT, "loss_heatmap")
    x = a[0]
    assert x.dtype == torch.float16 and finite(x) and not finite(o)
    assert bool((torch.sigmoid(-x) == 0).any()) and bool((torch.sigmoid(-x.float()) > 0).all()), x.max()
    named(r, FWD + ("underflow",), "loss_heatmap", SENSOR2_AT, quiet_at=("heatmap", "encoder", ""))


# ======================================================================================================================
# 4 + twin. nnU-Net-style soft dice with batch_dice=True (tp / fp / fn summed over the batch and the patch) in fp16;
#    the patch-size curriculum
# ======================================================================================================================
class SoftDiceLoss(nn.Module):
    """nnU-Net's SoftDiceLoss (batch_dice=True, smooth 1e-5, do_bg=False) on sigmoid foreground probabilities:
    1 - (2 tp + s) / (2 tp + fp + fn + s), tp / fp / fn summed over the batch and the spatial axes. `fp32`: the
    sums in float32 (the fix)."""

    def __init__(self, smooth=1e-5, fp32=False):
        super().__init__()
        self.smooth, self.fp32 = smooth, fp32

    def forward(self, logits, y):
        if self.fp32:
            logits = logits.float()
        p = torch.sigmoid(logits)
        y = y.to(p.dtype)
        tp, fp, fn = (p * y).sum(), (p * (1 - y)).sum(), ((1 - p) * y).sum()
        return 1 - (2 * tp + self.smooth) / (2 * tp + fp + fn + self.smooth)


class TinyUNet(nn.Module):
    """A two-level U-Net (encoder conv, stride-2 conv, bilinear upsampling, skip concatenation, 1x1 head) whose
    training forward returns dice + BCE (nnU-Net's DC_and_BCE_loss; the BCE with logits, fp32 under autocast)."""

    def __init__(self, fp32_dice=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(4, 4, 3, 2, 1), nn.ReLU())
        self.dec = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(4, 1, 1)
        self.dice = SoftDiceLoss(fp32=fp32_dice)

    def forward(self, x, y):
        e = self.enc(x)
        u = F.interpolate(self.down(e), scale_factor=2, mode="bilinear", align_corners=False)
        logits = self.head(self.dec(torch.cat([e, u], 1)))
        return self.dice(logits, y) + F.binary_cross_entropy_with_logits(logits.float(), y)


BIGPATCH_AT = 9


def organ_batch(i):
    """8 CT-like slices with one large organ (an ellipse covering ~70% of the patch, HU-normalised intensity +1 over
    0 +- 0.3 noise); nnU-Net's patch-size curriculum: 64 x 64 patches, from BIGPATCH_AT 128 x 128 (131072 voxels a
    batch, ~91000 of them foreground)."""
    g = gen(400 + i)
    s = 128 if i >= BIGPATCH_AT else 64
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, s), torch.linspace(-1, 1, s), indexing="ij")
    c = torch.rand(8, 2, generator=g) * 0.3 - 0.15
    ax = 0.85 + 0.2 * torch.rand(8, 2, generator=g)
    y = ((((xx - c[:, 0, None, None]) / ax[:, 0, None, None]) ** 2
          + ((yy - c[:, 1, None, None]) / ax[:, 1, None, None]) ** 2) < 1).float()[:, None]
    x = y + 0.3 * torch.randn(8, 1, s, s, generator=g)
    return (x, y), {}, None


def test_nnunet_batch_dice_sums_overflow_at_the_bigger_patch(tmp_path):
    torch.manual_seed(0)
    r = run(TinyUNet(), organ_batch, own_loss, BIGPATCH_AT + 2, tmp_path / "run", lr=1e-2, snap_at=BIGPATCH_AT)
    real_fwd(r, "dice", BIGPATCH_AT)
    fp32_finite(TinyUNet, r, organ_batch, BIGPATCH_AT)
    # the mechanism: before the curriculum step every sum of the dice stays below 65504 (sum p + sum y <= 8 x 64 x 64
    # + ~21000); at 128 x 128 the foreground alone is > 65504 voxels and 2 tp (float32) passes 65504 too: inf / inf
    fg = [float(organ_batch(i)[0][1].sum()) for i in range(BIGPATCH_AT + 1)]
    assert max(fg[:-1]) + 8 * 64 * 64 < 65504 < fg[-1], fg
    (a, o), = fp16_calls(TinyUNet, r, organ_batch, BIGPATCH_AT, "dice")
    assert a[0].dtype == torch.float16 and finite(a) and not finite(o)
    assert 2 * float((torch.sigmoid(a[0].float()) * a[1]).sum()) > 65504
    named(r, FWD, "dice", BIGPATCH_AT, quiet_at=("head", "dec", ""))


def test_twin_nnunet_batch_dice_in_fp32_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(TinyUNet(fp32_dice=True), organ_batch, own_loss, BIGPATCH_AT + 3, tmp_path / "run", lr=1e-2))


# ======================================================================================================================
# 5. an FCOS-style head trained on its joint score sqrt(sigmoid(cls) * sigmoid(centerness)): sqrt of an fp16 product
#    that underflows to 0, whose gradient is inf in the backward only
# ======================================================================================================================
class JointScore(nn.Module):
    """FCOS's ranking score, the geometric mean of the classification and centerness probabilities, in the logits'
    dtype (trained directly, as quality-estimation heads do)."""

    def forward(self, cls_logits, ctr_logits):
        return torch.sqrt(torch.sigmoid(cls_logits) * torch.sigmoid(ctr_logits))


class FCOSLite(nn.Module):
    """A two-level FCOS (mmdet's layout: the head's convs and `score` SHARED by the levels, called once per level):
    a conv stem (P3, stride 4), a stride-2 conv (P4, stride 8), a classification conv (prior bias -4.6) and a
    centerness conv; the joint score is trained against FCOS's centerness target of each location (0 off the
    objects) with an L2 loss. Returns mmdet's dict of losses ({"loss_score": ...})."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.p4 = nn.Sequential(nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU())
        self.cls_logits = nn.Conv2d(32, 1, 3, padding=1)
        self.centerness = nn.Conv2d(32, 1, 3, padding=1)
        with torch.no_grad():
            self.cls_logits.bias.fill_(-math.log(99))
        self.score = JointScore()

    def forward(self, images, ctr_targets):
        p3 = self.stem(images)
        s = torch.cat([self.score(self.cls_logits(f), self.centerness(f)).flatten(1) for f in (p3, self.p4(p3))], 1)
        return {"loss_score": F.mse_loss(s.float(), ctr_targets)}


TWICE_AT = 11


def fcos_batch(i):
    """retina_batch's frames and boxes; the target per location (P3 then P4) is FCOS's centerness
    sqrt(min(l, r) / max(l, r) * min(t, b) / max(t, b)) inside the box, 0 outside. At TWICE_AT one frame comes from
    the cache of pre-normalised tensors and goes through Normalize a second time (values down to -11)."""
    (img, gt, pos), _, _ = retina_batch(1000 + i)
    if i == TWICE_AT:
        img[2] = (img[2] - MEAN) / STD
    ctr = []
    for c in LEVELS:
        l, r = c[None] - gt[:, 0, None], gt[:, 2, None] - c[None]
        t, b = c[None] - gt[:, 1, None], gt[:, 3, None] - c[None]
        lr = (torch.minimum(l, r) / torch.maximum(l, r)).clamp(min=0)
        tb = (torch.minimum(t, b) / torch.maximum(t, b)).clamp(min=0)
        ctr.append((tb[:, :, None] * lr[:, None, :]).sqrt().flatten(1))
    return (img, torch.cat(ctr, 1) * pos), {}, None


def test_fcos_joint_score_sqrt_of_an_underflowed_product_nan_in_backward(tmp_path):
    torch.manual_seed(0)
    r = run(FCOSLite(), fcos_batch, loss_dict_sum, TWICE_AT + 2, tmp_path / "run", lr=2e-3, snap_at=TWICE_AT,
            backward=True)
    real_bwd(r, "score", TWICE_AT)
    fp32_finite(FCOSLite, r, fcos_batch, TWICE_AT, loss_dict_sum)
    # the mechanism: `score`'s two calls (P3, P4) are finite; sigmoid(cls) * sigmoid(ctr) is exactly 0 in fp16 at some
    # locations of the twice-normalised frame (sqrt's gradient 1 / (2 sqrt(0))), > 0 everywhere in float32
    calls = fp16_calls(FCOSLite, r, fcos_batch, TWICE_AT, "score")
    assert len(calls) == 2 and all(finite(a) and finite(o) for a, o in calls)
    assert any(bool((torch.sigmoid(a) * torch.sigmoid(b) == 0).any()) for (a, b), _ in calls)
    assert all(bool((torch.sigmoid(a.float()) * torch.sigmoid(b.float()) > 0).all()) for (a, b), _ in calls)
    named(r, FWD, "score", TWICE_AT, phase="backward", quiet_at=("cls_logits", "centerness", "stem", "p4", ""))


# ======================================================================================================================
# 6 + twin. an integral (soft-argmax) keypoint head whose heatmap is exp(beta * logits) / sum, beta sharpened mid-run
# ======================================================================================================================
class SoftArgmax2d(nn.Module):
    """Integral pose regression's soft-argmax: the normalised heatmap exp(beta x) / sum exp(beta x) written out (no
    max subtracted), the expected (x, y) in [0, 1]. `stable`: F.softmax (the max subtracted: the fix). `beta` is
    set by the training loop's schedule."""

    def __init__(self, beta=1.0, stable=False):
        super().__init__()
        self.beta, self.stable = beta, stable

    def forward(self, logits):
        b, k, h, w = logits.shape
        z = self.beta * logits.flatten(2)
        if self.stable:
            hm = F.softmax(z, -1)
        else:
            e = torch.exp(z)
            hm = e / e.sum(-1, keepdim=True)
        hm = hm.view(b, k, h, w)
        xs = torch.linspace(0, 1, w, dtype=hm.dtype)
        ys = torch.linspace(0, 1, h, dtype=hm.dtype)
        return torch.stack([(hm.sum(2) * xs).sum(-1), (hm.sum(3) * ys).sum(-1)], -1)


class KeypointNet(nn.Module):
    """A SimpleBaseline-style pose net: a conv backbone (stride 4), a deconvolution (16 x 16 heatmaps), a 1x1 heatmap
    conv for 4 keypoints, the soft-argmax. Returns (B, 4, 2) coordinates in [0, 1]."""

    def __init__(self, stable=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.deconv = nn.Sequential(nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.ReLU())
        self.heatmap = nn.Conv2d(16, 4, 1)
        self.soft_argmax = SoftArgmax2d(stable=stable)

    def forward(self, images):
        return self.soft_argmax(self.heatmap(self.deconv(self.backbone(images))))


SHARPEN_AT = 8


def sharpen(i, m):
    """The training loop's beta schedule: a soft heatmap (beta 1) for the first SHARPEN_AT steps, then the
    sharpening stage (beta 40)."""
    m.soft_argmax.beta = 1.0 if i < SHARPEN_AT else 40.0


def pose_batch(i):
    """8 frames (32 x 32) with 4 bright keypoint blobs of distinct colours; the targets their (x, y) / 31."""
    g = gen(600 + i)
    img = torch.rand(8, 3, 32, 32, generator=g) * 0.2
    kp = torch.randint(3, 29, (8, 4, 2), generator=g)
    colours = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    for b in range(8):
        for k in range(4):
            x, y = kp[b, k].tolist()
            img[b, :, y - 1:y + 2, x - 1:x + 2] = colours[k][:, None, None]
    return ((img - MEAN) / STD,), {}, kp.float() / 31


def l1(out, y):
    return F.l1_loss(out.float(), y)


def test_soft_argmax_exp_of_beta_logits_overflows_when_beta_sharpens(tmp_path):
    torch.manual_seed(0)
    r = run(KeypointNet(), pose_batch, l1, SHARPEN_AT + 3, tmp_path / "run", lr=3e-3, snap_at=SHARPEN_AT,
            before=sharpen)
    real_fwd(r, "soft_argmax", SHARPEN_AT)
    fp32_finite(KeypointNet, r, pose_batch, SHARPEN_AT, l1, before=sharpen)
    # the mechanism: beta x passes 11.09 (exp > 65504 in fp16) from the logits' peak, far below float32's 88.7
    (a, o), = fp16_calls(KeypointNet, r, pose_batch, SHARPEN_AT, "soft_argmax", before=sharpen)
    assert a[0].dtype == torch.float16 and finite(a) and not finite(o)
    assert 11.09 < 40.0 * float(a[0].max()) < 88.0, a[0].max()
    named(r, FWD, "soft_argmax", SHARPEN_AT, quiet_at=("heatmap", "deconv", ""))


def test_twin_soft_argmax_with_softmax_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(KeypointNet(stable=True), pose_batch, l1, SHARPEN_AT + 5, tmp_path / "run", lr=3e-3, before=sharpen))


# ======================================================================================================================
# 7. a neural SDF with a 16-band Fourier (NeRF) positional encoding of fp16 points; the sampling box widens
# ======================================================================================================================
class FourierEmbed(nn.Module):
    """nerf-pytorch's embedder: [x, sin(2^k x), cos(2^k x) for k < L], the bands as Python floats (so x keeps its
    dtype)."""

    def __init__(self, n_freqs=16):
        super().__init__()
        self.n_freqs = n_freqs

    def forward(self, x):
        out = [x]
        for k in range(self.n_freqs):
            out += [torch.sin(x * 2.0 ** k), torch.cos(x * 2.0 ** k)]
        return torch.cat(out, -1)


class NeuralSDF(nn.Module):
    """An object SDF network: a learned object-to-canonical alignment (an nn.Linear(3, 3) at identity: fp16 under
    autocast), the Fourier encoding (16 bands for fine detail), a Softplus MLP."""

    def __init__(self, n_freqs=16, d=64):
        super().__init__()
        self.align = nn.Linear(3, 3)
        with torch.no_grad():
            self.align.weight.copy_(torch.eye(3))
            self.align.bias.zero_()
        self.embed = FourierEmbed(n_freqs)
        self.mlp = nn.Sequential(nn.Linear(3 + 6 * n_freqs, d), nn.Softplus(beta=10), nn.Linear(d, d),
                                 nn.Softplus(beta=10), nn.Linear(d, 1))

    def forward(self, pts):
        return self.mlp(self.embed(self.align(pts))).squeeze(-1)


FARFIELD_AT = 8


def sdf_batch(i):
    """512 query points and the SDF of a sphere of radius 0.5: off-surface samples in the unit cube; from FARFIELD_AT
    the far-field curriculum draws a 20% share in [-2.5, 2.5]^3 to constrain the field away from the object."""
    g = gen(700 + i)
    pts = torch.rand(512, 3, generator=g) * 2 - 1
    if i >= FARFIELD_AT:
        pts[:100] = pts[:100] * 2.5
    sdf = pts.norm(dim=-1) - 0.5
    return (pts,), {}, sdf


def test_sdf_fourier_encoding_of_far_field_points_is_sin_of_inf(tmp_path):
    torch.manual_seed(0)
    r = run(NeuralSDF(), sdf_batch, mse, FARFIELD_AT + 3, tmp_path / "run", snap_at=FARFIELD_AT)
    # truth: `embed` is the first producer at FARFIELD_AT (and the loss first non-finite there, the step skipped);
    # before it only GradScaler's search for a scale (consecutive backoffs from step 0: the top band's gradient,
    # 2^15 cos(2^15 x), passes fp16 at the large initial scales), with every loss finite
    assert r["first"] == ("embed", FARFIELD_AT), r["first"]
    assert r["bad_loss"] and r["bad_loss"][0] == FARFIELD_AT and FARFIELD_AT in r["skipped"], r
    search = [s for s in r["skipped"] if s < FARFIELD_AT]
    assert search == list(range(len(search))) and len(search) <= 6, r["skipped"]
    fp32_finite(NeuralSDF, r, sdf_batch, FARFIELD_AT, mse)
    # the mechanism: 2^15 x passes 65504 for the far-field points (|x| up to 2.5 after the alignment), not for the
    # same weights on the unit-cube batch before
    (a, o), = fp16_calls(NeuralSDF, r, sdf_batch, FARFIELD_AT, "embed")
    (a0, o0), = fp16_calls(NeuralSDF, r, sdf_batch, FARFIELD_AT - 1, "embed")
    assert a[0].dtype == torch.float16 and finite(a) and not finite(o) and finite(o0)
    assert float(a0[0].abs().max()) * 2 ** 15 < 65504 < float(a[0].abs().max()) * 2 ** 15
    named(r, FWD, "embed", FARFIELD_AT, quiet_at=("align", "mlp.0", "mlp", ""))


# ======================================================================================================================
# 8. an RNN-T joint network whose log-softmax is written by hand (logsumexp without the max); an int16 clip
# ======================================================================================================================
class Joint(nn.Module):
    """The RNN-T joint: ReLU(enc W_e + pred W_p) -> vocabulary logits -> log-probabilities written as
    logits - log(sum(exp(logits))) (no max subtracted)."""

    def __init__(self, d=32, vocab=16):
        super().__init__()
        self.enc_proj, self.pred_proj, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, enc, pred):
        h = F.relu(self.enc_proj(enc)[:, :, None] + self.pred_proj(pred)[:, None])
        logits = self.out(h)
        return logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))


class Transducer(nn.Module):
    """A small RNN-T: a feed-forward encoder over 40-dim log-mel frames (mean-normalised by the data pipeline),
    a stateless prediction network (embedding + linear over [blank] + labels), the joint. Returns (B, T, U+1, V)
    log-probabilities."""

    def __init__(self, feats=40, d=32, vocab=16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(feats, d), nn.ReLU(), nn.Linear(d, d))
        self.embed = nn.Embedding(vocab, d)
        self.predictor = nn.Linear(d, d)
        self.joint = Joint(d, vocab)

    def forward(self, feats, labels):
        pred_in = F.pad(labels, (1, 0))                                   # blank (0) first
        return self.joint(self.encoder(feats), self.predictor(self.embed(pred_in)))


def rnnt_loss(logp, labels):
    """The RNN-T negative log-likelihood (Graves 2012) by the forward recursion, in float32."""
    logp = logp.float()
    B, T, U1, V = logp.shape
    blank = logp[..., 0]
    emit = logp[:, :, :-1].gather(-1, labels[:, None, :, None].expand(B, T, U1 - 1, 1)).squeeze(-1)
    alpha = torch.full((B, U1), float("-inf"))
    alpha[:, 0] = 0.0
    for t in range(T):
        if t > 0:
            alpha = alpha + blank[:, t - 1]
        cols = [alpha[:, 0]]
        for u in range(1, U1):
            cols.append(torch.logaddexp(alpha[:, u], cols[-1] + emit[:, t, u - 1]))
        alpha = torch.stack(cols, 1)
    return -(alpha[:, -1] + blank[:, -1, -1]).mean()


def transducer_loss(out, y):
    return rnnt_loss(out, y)


PROTOS = randn(16, 40, seed=81)
INT16_AT = 9


def asr_batch(i):
    """8 utterances: 12 frames of 40-dim natural-log mel energies, mean-normalised with the corpus' global mean
    (Kaldi's CMVN default, norm_vars=false: std ~3.5), and 4-token transcripts (tokens 1-15, each spoken over 3
    frames as its prototype spectrum + noise). At INT16_AT one clip was read with normalize=False (int16
    amplitudes, x 32768): its log-mel energies are ln(32768^2) = 20.8 higher."""
    g = gen(800 + i)
    labels = torch.randint(1, 16, (8, 4), generator=g)
    feats = 3.5 * (PROTOS[labels].repeat_interleave(3, 1) * 0.8 + 0.6 * torch.randn(8, 12, 40, generator=g))
    if i == INT16_AT:
        feats[6] += 2 * math.log(32768)
    return (feats, labels), {}, labels


def pretrained_transducer(steps=40):
    """The checkpoint being fine-tuned: a Transducer trained in float32 for `steps` AdamW steps on the pretraining
    corpus (asr_batch(-1), asr_batch(-2), ...): its joint is confident, logits up to ~7 on ordinary frames."""
    torch.manual_seed(0)
    m = Transducer()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for k in range(steps):
        (feats, labels), _, _ = asr_batch(-1 - k)
        opt.zero_grad()
        rnnt_loss(m(feats, labels), labels).backward()
        opt.step()
    return m


def test_rnnt_joint_hand_written_log_softmax_overflows_on_an_int16_clip(tmp_path):
    r = run(pretrained_transducer(), asr_batch, transducer_loss, INT16_AT + 3, tmp_path / "run", lr=3e-4,
            snap_at=INT16_AT)
    real_fwd(r, "joint", INT16_AT)
    fp32_finite(Transducer, r, asr_batch, INT16_AT, transducer_loss)
    # the mechanism: the joint's logits (joint.out's finite fp16 output) pass 11.09 on the int16 clip only
    (_, z), = fp16_calls(Transducer, r, asr_batch, INT16_AT, "joint.out")
    assert z.dtype == torch.float16 and finite(z)
    others = torch.cat([z[:6], z[7:]])
    assert float(others.max()) < 11.09 < float(z[6].max()) < 80.0, (others.max(), z[6].max())
    named(r, FWD, "joint", INT16_AT, quiet_at=("joint.out", "encoder", "encoder.2", ""))


# ======================================================================================================================
# 9. BEVFormer-style spatial cross-attention: 3D reference points projected into the cameras in fp16 (point_sampling
#    without its force_fp32), divided by the depth clamped at eps = 1e-5, deformable sampling offsets, grid_sample
# ======================================================================================================================
def lidar2img(yaw_deg, f=8.0, size=16, height=1.5):
    """A pinhole camera at (0, 0, height) in the lidar frame (x forward, y left, z up), yawed `yaw_deg` to the left:
    its 4 x 4 lidar-to-image matrix (u d, v d, d, 1)."""
    th = math.radians(yaw_deg)
    R = torch.tensor([[math.sin(th), -math.cos(th), 0.0], [0.0, 0.0, -1.0], [math.cos(th), math.sin(th), 0.0]])
    K = torch.tensor([[f, 0.0, size / 2], [0.0, f, size / 2], [0.0, 0.0, 1.0]])
    M = torch.eye(4)
    M[:3, :3] = K @ R
    M[:3, 3] = K @ (-R @ torch.tensor([0.0, 0.0, height]))
    return M


class SpatialCrossAttention(nn.Module):
    """BEVFormer's spatial cross-attention, one feature level: each BEV query's pillar of Z reference points is
    projected into every camera (point_sampling: lidar2img @ p, divided by max(depth, eps)), the points behind a
    camera or outside its image masked out; learned sampling offsets around each projection (MSDeformableAttention3D)
    and softmax attention weights over them; grid_sample; the mean over the cameras that see the query."""

    def __init__(self, c=16, points=2, eps=1e-5):
        super().__init__()
        self.points, self.eps = points, eps
        self.sampling_offsets = nn.Linear(c, 2 * points)
        self.attention_weights = nn.Linear(c, points)
        self.value_proj, self.out_proj = nn.Linear(c, c), nn.Linear(c, c)

    def forward(self, query, *, reference_points_3d, feats, lidar2img, img_size):
        # query (B, Q, C); reference_points_3d (Q, Z, 4) homogeneous, metres; feats (B, N, C, h, w); lidar2img
        # (B, N, 4, 4)
        B, Q, C = query.shape
        N, Z, P = feats.shape[1], reference_points_3d.shape[1], self.points
        cam = torch.matmul(lidar2img[:, :, None, None], reference_points_3d[None, None, ..., None]).squeeze(-1)
        # cam: (B, N, Q, Z, 4), fp16 under autocast (matmul)
        depth = cam[..., 2:3]
        uv = cam[..., :2] / torch.maximum(depth, torch.ones_like(depth) * self.eps) / img_size
        seen = (depth > self.eps) & (uv > 0).all(-1, keepdim=True) & (uv < 1).all(-1, keepdim=True)
        off = self.sampling_offsets(query).view(B, 1, Q, 1, P, 2) / feats.shape[-1]
        grid = (uv[..., None, :] + off) * 2 - 1                                                # (B, N, Q, Z, P, 2)
        value = self.value_proj(feats.flatten(3).transpose(2, 3)).transpose(2, 3).reshape(feats.shape)
        s = F.grid_sample(value.flatten(0, 1), grid.flatten(0, 1).flatten(1, 3)[:, :, None].to(value.dtype),
                          align_corners=False)                                                 # (B N, C, Q Z P, 1)
        s = s.view(B, N, C, Q, Z, P).permute(0, 1, 3, 4, 5, 2)                                 # (B, N, Q, Z, P, C)
        w = self.attention_weights(query).softmax(-1).view(B, 1, Q, 1, P, 1)
        per_cam = ((s * w).sum(4) * seen).sum(3)                                               # (B, N, Q, C)
        hits = seen.any(3).to(per_cam.dtype)                                                   # (B, N, Q, 1)
        return self.out_proj(per_cam.sum(1) / hits.sum(1).clamp(min=1))


class BEVOccupancy(nn.Module):
    """A BEVFormer-style occupancy model: a conv backbone on each camera image, learned BEV queries (6 x 6 cells
    centred at x 8-28 m, y -6.5-6.5 m, pillar heights -1 and 1 m), the spatial cross-attention (called with keyword
    arguments, as BEVFormer's encoder calls its attentions), a per-cell head."""

    def __init__(self, c=16, cells=6):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.ReLU(), nn.Conv2d(c, c, 3, 1, 1))
        self.bev_queries = nn.Parameter(torch.randn(cells * cells, c) * 0.5)
        xs, ys = torch.linspace(8, 28, cells), torch.linspace(-6.5, 6.5, cells)
        gx, gy = torch.meshgrid(xs, ys, indexing="ij")
        pil = [torch.stack([gx, gy, torch.full_like(gx, z), torch.ones_like(gx)], -1).reshape(-1, 4) for z in (-1, 1)]
        self.register_buffer("ref_3d", torch.stack(pil, 1))                                     # (Q, Z, 4)
        self.sca = SpatialCrossAttention(c)
        self.head = nn.Linear(c, 1)

    def forward(self, images, l2i):
        B, N = images.shape[:2]
        feats = self.backbone(images.flatten(0, 1))
        feats = feats.view(B, N, *feats.shape[1:])
        q = self.bev_queries[None].expand(B, -1, -1)
        bev = self.sca(q, reference_points_3d=self.ref_3d, feats=feats, lidar2img=l2i,
                       img_size=float(images.shape[-1]))
        return self.head(q + bev).squeeze(-1)


SIDECAM_AT = 7


def bev_occ_batch(i):
    """4 samples from a two-camera rig (front, and front-left yawed 30 degrees: every reference point is in front
    of both), 16 x 16 images, occupancy targets per BEV cell. From SIDECAM_AT the samples come from the second
    vehicle, whose second camera is mounted at the side (yawed 90 degrees): half of the BEV grid lies behind it."""
    g = gen(900 + i)
    images = torch.rand(4, 2, 3, 16, 16, generator=g)
    occ = (torch.rand(4, 36, generator=g) < 0.3).float()
    second = 90.0 if i >= SIDECAM_AT else 30.0
    l2i = torch.stack([lidar2img(0.0), lidar2img(second)])[None].expand(4, -1, -1, -1).clone()
    return ((images - MEAN) / STD, l2i), {}, occ


def bce(out, y):
    return F.binary_cross_entropy_with_logits(out.float(), y)


def test_bevformer_point_sampling_in_fp16_divides_by_the_eps_clamped_depth(tmp_path):
    torch.manual_seed(0)
    r = run(BEVOccupancy(), bev_occ_batch, bce, SIDECAM_AT + 3, tmp_path / "run", snap_at=SIDECAM_AT)
    real_fwd(r, "sca", SIDECAM_AT)
    fp32_finite(BEVOccupancy, r, bev_occ_batch, SIDECAM_AT, bce)
    # the mechanism: every reference point lies in front of the first rig's cameras; the side camera has points
    # behind it (depth <= 0 -> divided by eps = 1e-5: u d / 1e-5 ~ 1e7, inf in fp16, finite in float32)
    ref = BEVOccupancy().ref_3d.reshape(-1, 4).T
    assert float((lidar2img(30.0) @ ref)[2].min()) > 1.0 and float((lidar2img(90.0) @ ref)[2].min()) < 0
    (a, o), = fp16_calls(BEVOccupancy, r, bev_occ_batch, SIDECAM_AT, "sca")
    assert len(a) == 5 and finite(a) and not finite(o)
    named(r, FWD, "sca", SIDECAM_AT, quiet_at=("sca.out_proj", "sca.sampling_offsets", "head", "backbone", ""))


# ======================================================================================================================
# 10. a keyword spotter's in-model log-mel front end, log(mel + 1e-10) in fp16, on zero-padded frames
# ======================================================================================================================
def mel_filterbank(n_freqs=33, n_mels=16, sr=8000):
    """Triangular mel filters (HTK mel scale) for an n_fft = 64 power spectrum at 8 kHz: (n_freqs, n_mels)."""
    def mel(f):
        return 2595 * math.log10(1 + f / 700)

    def hz(m):
        return 700 * (10 ** (m / 2595) - 1)

    pts = torch.tensor([hz(m) for m in torch.linspace(mel(0), mel(sr / 2), n_mels + 2).tolist()])
    f = torch.linspace(0, sr / 2, n_freqs)
    lo, c, hi = pts[:-2, None], pts[1:-1, None], pts[2:, None]
    return torch.clamp(torch.minimum((f - lo) / (c - lo), (hi - f) / (hi - c)), min=0).T


class LogMel(nn.Module):
    """A log-mel front end in the model (as on-device keyword spotters do): Hann-windowed DFT of each 64-sample frame
    as a matmul, power, mel filterbank, log(mel + eps) with the float32 recipe's eps = 1e-10 (0 in fp16)."""

    def __init__(self, n_fft=64, n_mels=16, eps=1e-10):
        super().__init__()
        self.eps = eps
        n = torch.arange(n_fft, dtype=torch.float32)
        k = torch.arange(n_fft // 2 + 1, dtype=torch.float32)
        win = torch.hann_window(n_fft, periodic=True)[:, None]
        ang = 2 * math.pi * n[:, None] * k[None] / n_fft
        self.register_buffer("dft", torch.cat([torch.cos(ang) * win, -torch.sin(ang) * win], 1))   # (64, 66)
        self.register_buffer("fb", mel_filterbank(n_fft // 2 + 1, n_mels))

    def forward(self, frames):
        spec = frames @ self.dft
        re, im = spec.chunk(2, -1)
        return torch.log((re * re + im * im) @ self.fb + self.eps)


class KeywordSpotter(nn.Module):
    """The front end, a per-frame MLP encoder, a masked mean over the clip's frames, a 4-keyword classifier."""

    def __init__(self, d=32):
        super().__init__()
        self.frontend = LogMel()
        self.encoder = nn.Sequential(nn.Linear(16, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.classifier = nn.Linear(d, 4)

    def forward(self, frames, lengths):
        h = self.encoder(self.frontend(frames))
        valid = (torch.arange(frames.shape[1])[None] < lengths[:, None]).unsqueeze(-1).to(h.dtype)
        return self.classifier((h * valid).sum(1) / lengths[:, None])


PADDED_AT = 6
TONES = torch.tensor([500.0, 1000.0, 1800.0, 2800.0])


def kws_batch(i):
    """8 clips of 24-40 frames (64 samples at 8 kHz, no overlap): keyword k is a tone at TONES[k] + a noise floor
    (amplitude 0.1). Until PADDED_AT the length-bucketing sampler gives every clip of a batch the same length; from
    PADDED_AT on (the sampler swapped for a plain shuffle) the shorter clips are zero-padded to the longest."""
    g = gen(1000 + i)
    y = torch.randint(0, 4, (8,), generator=g)
    if i >= PADDED_AT:
        lengths = torch.randint(24, 41, (8,), generator=g)
    else:
        lengths = torch.full((8,), int(torch.randint(24, 41, (1,), generator=g)))
    T = int(lengths.max())
    t = torch.arange(T * 64, dtype=torch.float32) / 8000
    wave = 0.3 * torch.sin(2 * math.pi * TONES[y][:, None] * t) + 0.1 * torch.randn(8, T * 64, generator=g)
    wave = wave * (torch.arange(T * 64)[None] < 64 * lengths[:, None])
    return (wave.view(8, T, 64), lengths), {}, y


def ce(out, y):
    return F.cross_entropy(out.float(), y)


class SpeechBrainLoop:
    """SpeechBrain's Brain.fit_batch / check_loss_isfinite / optimizers_step (v1.0) for one optimizer, precision
    "fp16" on the CPU: forward + compute_objectives under autocast -> scaled_loss = scaler.scale(loss / 1) ->
    check_loss_isfinite (a non-finite loss: a warning and nonfinite_count += 1; past nonfinite_patience = 3 a
    ValueError ends the run) -> backward -> unscale_ -> clip_grad_norm_(max_grad_norm = 5) -> scaler.step ->
    scaler.update -> zero_grad(set_to_none=True)."""

    def __init__(self, m, lr=3e-3, patience=3):
        self.m, self.patience, self.nonfinite_count = m, patience, 0
        self.opt = torch.optim.Adam(m.parameters(), lr=lr)
        self.scaler = torch.amp.GradScaler("cpu")

    def check_loss_isfinite(self, loss):
        if not torch.isfinite(loss):
            self.nonfinite_count += 1
            if self.nonfinite_count > self.patience:
                raise ValueError("Loss is not finite and patience is exhausted. To debug, wrap `fit()` with "
                                 "autograd's `detect_anomaly()`, e.g.\n\nwith torch.autograd.detect_anomaly():"
                                 "\n\tbrain.fit(...)")

    def fit_batch(self, frames, lengths, y):
        with torch.autocast("cpu", dtype=torch.float16):
            logits = self.m(frames, lengths)
            loss = ce(logits, y)
        scaled_loss = self.scaler.scale(loss / 1)
        self.check_loss_isfinite(scaled_loss)
        scaled_loss.backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.m.parameters(), 5.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def speechbrain_fit(m, batch, steps, run_dir, snap_at):
    """SpeechBrainLoop's fit_batch over `steps` batches under `with ampdoctor.watch(...)` (default settings) and a
    Producer; returns its first producer, the losses, the weights the forward of step `snap_at` ran with, the
    crash (step, message) and the reports (w.report() after the crash, ampdoctor.diagnose(run_dir))."""
    brain = SpeechBrainLoop(m)
    orc = Producer(m, with_kwargs=True)
    r = dict(losses=[], crash=None, sd=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with ampdoctor.watch(m, optimizer=brain.opt, scaler=brain.scaler, run_dir=run_dir) as w:
                for i in range(steps):
                    orc.step = i
                    if i == snap_at:
                        r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
                    (frames, lengths), _, y = batch(i)
                    r["losses"].append(brain.fit_batch(frames, lengths, y).item())
        except ValueError as e:
            r["crash"] = (i, str(e))
        finally:
            orc.remove()
    r["first"] = orc.first
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["rep"], r["disk"] = w.report(), ampdoctor.diagnose(run_dir)
    return r


def test_keyword_spotter_log_mel_eps_1e10_on_zero_padded_frames(tmp_path):
    torch.manual_seed(0)
    r = speechbrain_fit(KeywordSpotter(), kws_batch, PADDED_AT + 8, tmp_path / "run", snap_at=PADDED_AT)
    # truth: `frontend` is the first producer at PADDED_AT (every batch from there on is padded: every loss from
    # PADDED_AT non-finite, none before); SpeechBrain's patience (3) runs out on the 4th: a ValueError at PADDED_AT + 3
    assert r["first"] == ("frontend", PADDED_AT), r["first"]
    assert [i for i, v in enumerate(r["losses"]) if not math.isfinite(v)] == list(range(PADDED_AT, PADDED_AT + 3))
    assert r["crash"] and r["crash"][0] == PADDED_AT + 3 and "patience is exhausted" in r["crash"][1], r["crash"]
    fp32_finite(KeywordSpotter, r, kws_batch, PADDED_AT, ce)
    # the mechanism: the first batch with zero-padded frames is PADDED_AT's; their mel power is 0 and 1e-10 is 0 in
    # fp16: log(0) = -inf from finite frames (in float32 log(1e-10) = -23)
    padded = [i for i in range(PADDED_AT + 1) if bool((kws_batch(i)[0][0].abs().sum(-1) == 0).any())]
    assert padded == [PADDED_AT] and float(torch.tensor(1e-10, dtype=torch.float16)) == 0.0
    (a, o), = fp16_calls(KeywordSpotter, r, kws_batch, PADDED_AT, "frontend")
    assert finite(a) and o.dtype == torch.float16 and bool(torch.isneginf(o).any()) and not bool(torch.isnan(o).any())
    # the live report after the crash and the one the user gets from the run directory
    for rep in (r["rep"], r["disk"]):
        named(dict(r, rep=rep), FWD + ("eps_underflow",), "frontend", PADDED_AT,
              quiet_at=("encoder.0", "encoder", "classifier", ""))
