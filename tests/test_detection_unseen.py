"""OBJECT DETECTION AND SEGMENTATION training under fp16: small synthetic detectors and segmenters (random images,
boxes and masks made here from fixed seeds; no torchvision models, no downloads, no pretrained weights), each with an
fp16 hazard these losses and decoders are known for, injected at step 5.

Loop: probe_harness.probe_run (AdamW, GradScaler("cpu") at its defaults, CPU fp16 autocast, scale(loss).backward ->
unscale_ -> clip_grad_norm_(1.0) -> scaler.step -> scaler.update, ampdoctor.watch(model, optimizer=, scaler=,
run_dir=tmp_path) at the default sampling), 7 steps. Injections: a head's bias changed under no_grad before step 5's
forward (the drift an lr spike / a bad update leaves), or step 5's batch itself (a full-resolution frame, point
annotations).

Oracle for every failure (a failing oracle is a plain failure, never an xfail): the loss is first non-finite at step
5 and the scaler skips that step; probe_harness.Producer's first forward producer is the expected module at step 5
(None for a loss written in the training script outside the model: CONTRACT.md's module null / "(run)"; there every
model output is finite); step 5 re-run from the weights it ran with (snap_at) gives a non-finite loss under fp16
autocast, and finite outputs and loss in fp32 (fp16's doing). Report check: among the first three findings a
warning/error of an accepted rule at the expected module and step 5, phase forward (or null), and no overflow /
nan_origin error at another named module at step 5; else WrongAnswer (strict xfail via probe_harness.wrong).

Failures:
 1. yolo_decode_exp  YOLOv3 decoding in the model's `decode` module, w = anchor * exp(tw) in the head's fp16, no
                     clamp at log(1000/16): the regression head's tw/th bias +12 at step 5, exp(12.4) > 65504
                                                                              -> overflow at decode.
 2. fcos_iou_eps     FCOS ltrb = exp(conv) * stride, IoU loss 1 - inter / (union + 1e-8) in the `criterion`
                     submodule, targets `.to(pred)`: at step 5 the regression bias -20 (exp(-20) flushes to 0 in
                     fp16: collapsed boxes) meets point annotations (x1 == x2, y1 == y2): union 0, eps 1e-8 is 0 in
                     fp16, 0/0 = NaN (fp32: tiny boxes, union > 0)            -> nan_origin / eps_underflow at
                     criterion. (torchvision's eps 1e-7 would NOT vanish: it rounds to the subnormal 1.19e-7 in fp16,
                     so a union of exactly 0 gives 0 / 1.19e-7 = 0; hence 1e-8 here.)
 3. giou_pixels      GIoU in the `criterion` submodule on boxes scaled back to the original image size in pixels
                     (size `.to(pred)`): multi-scale batches of 128-160 px until a 1333 x 800 COCO frame at step 5,
                     whose box areas (~666 x 400) pass 65504, inf/inf and inf - inf -> overflow at criterion.
 4. focal_by_hand    RetinaNet focal loss written from p = sigmoid(logits) in fp16 in the `loss` submodule, BCE as
                     -(y log p + (1 - y) log(1 - p)): the cls bias +16 at step 5 (logits ~11.4): fp16 sigmoid rounds
                     to exactly 1, log(1 - p) = -inf, 0 * -inf = NaN (fp32: 1 - p ~ 1e-5)
                                                                              -> overflow / nan_origin at loss.
 5. dice_fullres     (outside) soft Dice over the batch in the training script, the mask `type_as` the fp16
                     probabilities: 96x96 crops until one 512x512 frame at step 5, whose sums over 262144 pixels
                     (p.sum(), g.sum(), (p * g).sum()) pass 65504: inf / inf = NaN -> nan_origin/overflow, module null.
 6. lvis_ce_exp      an RoI box head over LVIS's 1203 classes, cross-entropy by hand (log(exp(x).sum()) - x[t]) in the
                     `cls_loss` submodule: 10 class biases +12 at step 5, exp overflows -> overflow at cls_loss.
Healthy twins (the fixed form, no injection), each run with and without the watch: losses and final weights bitwise
identical, every loss finite, no producer, no skip after the scaler's first steps, no RuntimeWarning, the loss fell
(the last fifth's mean 5 % below the first's), no warning/error in the report: yolo_clamped (tw, th clamped at
log(1000/16)), fcos_iou_fp32 (IoU on pred.float(), eps 1e-7, a quarter of the targets point annotations every step, 80
steps), giou_normalized (GIoU on normalized [0, 1] coordinates, the 1333 x 800 frame at step 5 included),
focal_torch_fp32 (torchvision's sigmoid_focal_loss formula, F.binary_cross_entropy_with_logits on fp32 logits),
dice_fp32_fullres (Dice on p.float(), the 512x512 frame included), seg_ce_ignore (5-class F.cross_entropy on fp32
logits, ignore_index=255 on 10 % of the pixels), fpn_long (backbone + UPerNet-style FPN with ReLU'd laterals + shared
head, 120 steps).

Not covered: an FPN whose top-down additions overflow while no lateral conv does. With these small random-init
convs the largest lateral dominates every sum (p3 / lat3 ~ 1.06-1.1), so scaling a layer's weights always made a
conv (the scaled one or a lateral) the first producer, never the `fpn` addition; a window that exists (all laterals
x5.7e4) was too narrow to survive 5 training steps, so the case was left out rather than tuned to a knife edge.

Result when written (torch 2.13 CPU): 13 pass, 0 xfail, stable over two runs, the whole file ~10-13 s. Top findings:
 1 `[error] overflow at decode aten::exp step 5: aten::exp in `decode` overflowed float16 (input up to 12.45; fp16
   exp(x) is inf for x > 11.09)`.
 2 `[error] eps_underflow at criterion aten::add step 5: aten::add in `criterion` uses eps 1e-08, which rounds to 0
   in float16: the guard does nothing`.
 3 `[error] overflow at criterion aten::mul step 5: aten::mul in `criterion` produced +inf from finite inputs; it
   propagates to aten::sub in `criterion``.
 4 `[error] overflow at loss aten::log step 5: aten::log in `loss` hit its singular point (an input is 0 / -1) and
   produced -inf; it propagates to aten::mul in `loss``.
 5 `[error] nan_origin at (run) step 5: The loss became NaN outside the watched model (in the loss computation)
   while the model's outputs were finite (its ops: Add, Div, Mul, Rsub, Sum; of those, in fp16: a division (by one
   that rounded to 0), sum (of many values))`.
 6 `[error] overflow at cls_loss aten::exp step 5: aten::exp in `cls_loss` overflowed float16 (input up to 12.16;
   fp16 exp(x) is inf for x > 11.09)`.
 Twins: no warning or error.
No wrong answer found.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import failure_oracle, probe_run, producer_top3, twin_checks, wrong
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

AC = dict(device_type="cpu", dtype=torch.float16)
BAD = 5                                         # the injected step of every failure case


def rn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(8300 + seed))


def rnd(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(8400 + seed))


def grid(h, w, stride, dtype):
    """Location centres (x, y) of an h x w feature map in pixels, in `dtype` (the head's own dtype)."""
    ys = (torch.arange(h, dtype=dtype) + 0.5) * stride
    xs = (torch.arange(w, dtype=dtype) + 0.5) * stride
    return xs[None, :].expand(h, w), ys[:, None].expand(h, w)


class Backbone(nn.Module):
    """Three ReLU conv stages: C3 (1/4), C4 (1/8), C5 (1/16)."""

    def __init__(self, w=8):
        super().__init__()
        self.s3 = nn.Sequential(nn.Conv2d(3, w, 3, 4, 1), nn.ReLU())
        self.s4 = nn.Sequential(nn.Conv2d(w, w, 3, 2, 1), nn.ReLU())
        self.s5 = nn.Sequential(nn.Conv2d(w, w, 3, 2, 1), nn.ReLU())

    def forward(self, x):
        c3 = self.s3(x)
        c4 = self.s4(c3)
        return c3, c4, self.s5(c4)


# ------------------------------------------------------------------------------------------ YOLO box decoding

class YoloDecode(nn.Module):
    """YOLOv3's decoding of (tx, ty, tw, th): centre (sigmoid(t) + grid) * stride, size anchor * exp(t) in the
    head's dtype. `clamp`: tw, th clamped at log(1000/16) first (torchvision's BoxCoder bbox_xform_clip)."""

    def __init__(self, stride=8, anchor=(24.0, 16.0), clamp=None):
        super().__init__()
        self.stride, self.anchor, self.clamp = stride, anchor, clamp

    def forward(self, t):
        gx, gy = grid(t.shape[2], t.shape[3], self.stride, t.dtype)
        tw, th = t[:, 2], t[:, 3]
        if self.clamp is not None:
            tw, th = tw.clamp(max=self.clamp), th.clamp(max=self.clamp)
        cx = (torch.sigmoid(t[:, 0]) - 0.5) * self.stride + gx
        cy = (torch.sigmoid(t[:, 1]) - 0.5) * self.stride + gy
        return torch.stack([cx, cy, torch.exp(tw) * self.anchor[0], torch.exp(th) * self.anchor[1]], 1)


class Yolo(nn.Module):
    def __init__(self, clamp=None):
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Conv2d(8, 4, 1)
        self.decode = YoloDecode(clamp=clamp)

    def forward(self, img):
        return self.decode(self.head(self.backbone(img)[1]))


def yolo_l1(out, y):
    """The training script's loss: L1 on the decoded boxes, normalized by the 64-pixel image, in fp32."""
    return (out.float() / 64 - y / 64).abs().mean()


def b_yolo(bad=None):
    def b(i):
        k = i % 4
        c = torch.stack(grid(8, 8, 8, torch.float32))[None] + 2 * rn(2, 2, 8, 8, seed=k)
        wh = torch.tensor([24.0, 16.0])[None, :, None, None] * torch.exp(0.3 * rn(2, 2, 8, 8, seed=10 + k))
        return (rn(2, 3, 64, 64, seed=20 + k),), torch.cat([c, wh], 1)
    return b


# ----------------------------------------------------------------------------------- FCOS ltrb + IoU loss

def cxcywh_xyxy(b):
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def iou_terms(p, t):
    """(inter, union, enclosing area) of xyxy boxes p, t (same dtype)."""
    lt, rb = torch.max(p[..., :2], t[..., :2]), torch.min(p[..., 2:], t[..., 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    ap = (p[..., 2] - p[..., 0]) * (p[..., 3] - p[..., 1])
    at = (t[..., 2] - t[..., 0]) * (t[..., 3] - t[..., 1])
    union = ap + at - inter
    clt, crb = torch.min(p[..., :2], t[..., :2]), torch.max(p[..., 2:], t[..., 2:])
    cwh = crb - clt
    return inter, union, cwh[..., 0] * cwh[..., 1]


class IoULoss(nn.Module):
    """1 - inter / (union + eps), targets moved with `.to(pred)` (the device idiom, which casts them to fp16 too).
    `fp32`: computed on pred.float() and the fp32 targets."""

    def __init__(self, eps, fp32=False):
        super().__init__()
        self.eps, self.fp32 = eps, fp32

    def forward(self, pred, tgt):
        pred = pred.float() if self.fp32 else pred
        inter, union, _ = iou_terms(pred, tgt.to(pred))
        return (1 - inter / (union + self.eps)).mean()


class Fcos(nn.Module):
    """FCOS's regression branch: ltrb = exp(conv) * stride at each C4 location; boxes (x - l, y - t, x + r, y + b)
    built in the head's dtype; the IoU loss is the submodule `criterion`."""

    def __init__(self, criterion):
        super().__init__()
        self.backbone = Backbone()
        self.reg = nn.Conv2d(8, 4, 3, padding=1)
        self.criterion = criterion

    def forward(self, img, tgt):
        d = torch.exp(self.reg(self.backbone(img)[1])) * 8.0
        gx, gy = grid(d.shape[2], d.shape[3], 8, d.dtype)
        box = torch.stack([gx - d[:, 0], gy - d[:, 1], gx + d[:, 2], gy + d[:, 3]], -1)
        return self.criterion(box, tgt)


def b_fcos(bad=None, points=None):
    """Per-location xyxy targets around each location; from step `points` on a quarter of them are point annotations
    (x1 == x2, y1 == y2: a keypoint-only object, a box shrunk to nothing by a crop)."""
    def b(i):
        k = i % 4
        gx, gy = grid(8, 8, 8, torch.float32)
        c = torch.stack([gx, gy])[None] + rn(2, 2, 8, 8, seed=30 + k)
        wh = 12 * torch.exp(0.3 * rn(2, 2, 8, 8, seed=40 + k))
        if points is not None and i >= points:
            wh = wh * (rnd(2, 1, 8, 8, seed=50 + i) > 0.25)
        tgt = cxcywh_xyxy(torch.cat([c, wh], 1).permute(0, 2, 3, 1))
        return (rn(2, 3, 64, 64, seed=60 + k), tgt), None
    return b


# ------------------------------------------------------------------------------- GIoU in absolute pixels

class GIoULoss(nn.Module):
    """1 - GIoU of normalized cxcywh boxes; `pixels`: first scaled to the original image's size in pixels (the
    size moved with `.to(pred)`), as a script that reports pixel IoUs does."""

    def __init__(self, pixels):
        super().__init__()
        self.pixels = pixels

    def forward(self, pred, tgt, size):
        tgt = tgt.to(pred)
        if self.pixels:
            s = size.to(pred).repeat(2)
            pred, tgt = pred * s, tgt * s
        inter, union, area_c = iou_terms(cxcywh_xyxy(pred), cxcywh_xyxy(tgt))
        giou = inter / union - (area_c - union) / area_c
        return (1 - giou).mean()


class BoxDet(nn.Module):
    """A dense box head: sigmoid(conv) -> normalized cxcywh at each C4 location; the loss is `criterion`."""

    def __init__(self, criterion):
        super().__init__()
        self.backbone = Backbone()
        self.box = nn.Conv2d(8, 4, 3, padding=1)
        self.criterion = criterion

    def forward(self, img, tgt, size):
        p = torch.sigmoid(self.box(self.backbone(img)[1])).permute(0, 2, 3, 1)
        return self.criterion(p, tgt, size)


def b_multiscale(bad=None):
    """Multi-scale training: the original images are 128-160 px, the model sees them resized to 64x64; at `bad` a
    full-resolution COCO frame (1333 x 800) comes through."""
    def b(i):
        k = i % 4
        c = 0.25 + 0.5 * rnd(2, 8, 8, 2, seed=70 + k)
        wh = 0.15 + 0.35 * rnd(2, 8, 8, 2, seed=80 + k)
        size = torch.tensor([1333.0, 800.0]) if i == bad else 128 + 32 * rnd(2, seed=90 + i)
        return (rn(2, 3, 64, 64, seed=100 + k), torch.cat([c, wh], -1), size), None
    return b


# ------------------------------------------------------------------------------------- focal loss by hand

class FocalByHand(nn.Module):
    """RetinaNet's sigmoid focal loss (alpha 0.25, gamma 2) written from p = sigmoid(logits) in the logits' dtype,
    BCE as -(y log p + (1 - y) log(1 - p)); normalized by the number of positives."""

    def forward(self, logits, y):
        y = y.to(logits)
        p = torch.sigmoid(logits)
        ce = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))
        pt = p * y + (1 - p) * (1 - y)
        at = 0.25 * y + 0.75 * (1 - y)
        return (at * (1 - pt) ** 2 * ce).sum() / y.sum().clamp(min=1)


class FocalTorch(nn.Module):
    """torchvision.ops.sigmoid_focal_loss's formula on the fp32 logits (F.binary_cross_entropy_with_logits)."""

    def forward(self, logits, y):
        x = logits.float()
        p = torch.sigmoid(x)
        ce = F.binary_cross_entropy_with_logits(x, y, reduction="none")
        pt = p * y + (1 - p) * (1 - y)
        at = 0.25 * y + 0.75 * (1 - y)
        return (at * (1 - pt) ** 2 * ce).sum() / y.sum().clamp(min=1)


class Retina(nn.Module):
    """A dense classification head on C4, 4 classes, bias at RetinaNet's prior -log((1 - 0.01) / 0.01)."""

    def __init__(self, loss):
        super().__init__()
        self.backbone = Backbone()
        self.cls = nn.Conv2d(8, 4, 3, padding=1)
        nn.init.constant_(self.cls.bias, -math.log(99))
        self.loss = loss

    def forward(self, img, y):
        return self.loss(self.cls(self.backbone(img)[1]), y)


def b_retina(bad=None):
    def b(i):
        k = i % 4
        y = (rnd(2, 4, 8, 8, seed=110 + k) < 0.05).float()
        return (rn(2, 3, 64, 64, seed=120 + k), y), None
    return b


# -------------------------------------------------------------------------------------- segmentation: Dice

class Segmenter(nn.Module):
    """Conv stem at 1/4 resolution, a conv, a ConvTranspose2d(4, stride 4) back to full resolution; `classes` 1:
    sigmoid probabilities (fp16 under autocast), else the logits."""

    def __init__(self, classes=1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 4, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 1, 1), nn.ReLU())
        self.up = nn.ConvTranspose2d(8, classes, 4, 4)
        self.classes = classes

    def forward(self, img):
        h = self.up(self.stem(img))
        return torch.sigmoid(h) if self.classes == 1 else h


def dice_loss(p, g):
    """The training script's soft Dice over the batch (smooth 1), the mask `type_as` the prediction (fp16)."""
    g = g.type_as(p)
    return 1 - (2 * (p * g).sum() + 1) / (p.sum() + g.sum() + 1)


def dice_fp32(p, g):
    return dice_loss(p.float(), g)


def b_seg(bad=None):
    """Random 96x96 crops (2 per batch); at `bad` one full-resolution 512x512 image (crop size raised to the full
    frame). The foreground is where channel 0 > -0.25 (60 % of the pixels)."""
    def b(i):
        s, n = (512, 1) if i == bad else (96, 2)
        x = rn(n, 3, s, s, seed=130 + i)
        return (x,), (x[:, :1] > -0.25).float()
    return b


def b_seg_classes(bad=None):
    """5-class masks from thresholds of channel 0's 4x4-block means; 10 % of the pixels ignore_index 255 (void)."""
    def b(i):
        x = rn(2, 3, 64, 64, seed=140 + i % 4)
        blocks = F.interpolate(F.avg_pool2d(x[:, :1], 4), scale_factor=4)[:, 0]
        t = torch.bucketize(blocks, torch.tensor([-0.4, -0.12, 0.12, 0.4]))
        t[rnd(2, 64, 64, seed=150 + i % 4) < 0.1] = 255
        return (x,), t
    return b


def seg_ce_ignore(out, y):
    return F.cross_entropy(out.float(), y, ignore_index=255)


# ------------------------------------------------------------------------- LVIS-size softmax CE by hand

class SoftmaxCE(nn.Module):
    """Cross-entropy by hand: log(exp(x).sum(-1)) - x[target], in the logits' dtype."""

    def forward(self, x, t):
        return (torch.log(torch.exp(x).sum(-1)) - x.gather(-1, t[:, None]).squeeze(-1)).mean()


class RoIClassifier(nn.Module):
    """A box head on pooled RoI features: fc -> ReLU -> cls Linear over LVIS's 1203 classes; loss `cls_loss`."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.fc = nn.Linear(8, 32)
        self.cls = nn.Linear(32, 1203)
        self.cls_loss = SoftmaxCE()

    def forward(self, rois, t):
        f = self.backbone(rois)[2].mean((2, 3))
        return self.cls_loss(self.cls(F.relu(self.fc(f))), t)


def b_rois(bad=None):
    def b(i):
        k = i % 4
        return (rn(16, 3, 32, 32, seed=160 + k), torch.randint(0, 1203, (16,),
                generator=torch.Generator().manual_seed(170 + k))), None
    return b


# ------------------------------------------------------------------------------------------------------ FPN

class FPN(nn.Module):
    """UPerNet's FPN: lateral ConvModules (1x1 conv + ReLU) and the top-down path: p5 = l5(c5);
    p4 = l4(c4) + up(p5); p3 = l3(c3) + up(p4) (nearest upsampling)."""

    def __init__(self, w=8, d=8):
        super().__init__()
        self.lat3, self.lat4, self.lat5 = (nn.Sequential(nn.Conv2d(w, d, 1), nn.ReLU()) for _ in range(3))

    def forward(self, c3, c4, c5):
        p5 = self.lat5(c5)
        p4 = self.lat4(c4) + F.interpolate(p5, scale_factor=2, mode="nearest")
        p3 = self.lat3(c3) + F.interpolate(p4, scale_factor=2, mode="nearest")
        return p3, p4, p5


class FpnDet(nn.Module):
    """Backbone -> FPN -> a head shared by the levels (5 maps: 4 box + 1 objectness)."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.fpn = FPN()
        self.head = nn.Conv2d(8, 5, 3, padding=1)

    def forward(self, img):
        return [self.head(p) for p in self.fpn(*self.backbone(img))]


def fpn_loss(out, y):
    """The script's loss over the levels, in fp32."""
    return sum(F.smooth_l1_loss(o.float(), t) for o, t in zip(out, y))


def b_fpn(bad=None):
    def b(i):
        k = i % 4
        x = rn(2, 3, 64, 64, seed=180 + k)
        ys = [torch.tanh(F.avg_pool2d(x, s)[:, :1].repeat(1, 5, 1, 1) * 3) for s in (4, 8, 16)]
        return (x,), ys
    return b


def own(out, y):
    return out


# ---------------------------------------------------------------------------------------------- injections

def bias_add(path, val, sl=slice(None)):
    """At the bad step param `path` (a bias) gets +val on `sl`: the drift an lr spike / a bad update leaves."""
    def inj(i, m, bad):
        if i == bad:
            m.get_parameter(path)[sl] += val
    return inj


# ---------------------------------------------------------------------------------------------------- cases
# name: (factory, batch(bad), loss_fn, inject(i, m, bad) or None, expected module (None: user code outside the
# model, "(run)"), accepted rules)
CASES = {
    "yolo_decode_exp": (Yolo, b_yolo, yolo_l1, bias_add("head.bias", 12.0, slice(2, 4)), "decode", ("overflow",)),
    "fcos_iou_eps": (lambda: Fcos(IoULoss(1e-8)), lambda bad: b_fcos(bad, points=bad), own,
                     bias_add("reg.bias", -20.0), "criterion", ("nan_origin", "eps_underflow")),
    "giou_pixels": (lambda: BoxDet(GIoULoss(pixels=True)), b_multiscale, own, None, "criterion",
                    ("overflow", "nan_origin")),
    "focal_by_hand": (lambda: Retina(FocalByHand()), b_retina, own, bias_add("cls.bias", 16.0), "loss",
                      ("nan_origin", "overflow")),
    "dice_fullres": (Segmenter, b_seg, dice_loss, None, None, ("nan_origin", "overflow")),
    "lvis_ce_exp": (RoIClassifier, b_rois, own, bias_add("cls.bias", 12.0, slice(0, 10)), "cls_loss",
                    ("overflow", "nan_origin")),
}

XFAIL: dict = {}


def build(factory, seed=0):
    torch.manual_seed(seed)
    return factory()


def run_case(name, tmp_path):
    factory, mk, loss_fn, inj, _, _ = CASES[name]
    m = build(factory)
    inject = None if inj is None else (lambda i, mm: inj(i, mm, BAD))
    return probe_run(m, mk(BAD), loss_fn, BAD + 2, str(tmp_path / "run"), inject=inject, snap_at=BAD)


def replay_bad(name, sd):
    """The bad step's forward from the weights it ran with: (output fp16, loss fp16, output fp32, loss fp32)."""
    factory, mk, loss_fn, *_ = CASES[name]
    m = build(factory)
    m.load_state_dict(sd)
    args, y = mk(BAD)(BAD)
    with torch.no_grad():
        with torch.autocast(**AC):
            o16 = m(*args)
        l16 = loss_fn(o16, y)
        o32 = m(*args)
        l32 = loss_fn(o32, y)
    return o16, l16, o32, l32


def check_report(rep, name):
    *_, where, rules = CASES[name]
    return producer_top3(rep, rules, where, BAD)


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_detection_fails(name, tmp_path):
    *_, where, _ = CASES[name]
    r = run_case(name, tmp_path)
    # oracle (probe_harness.failure_oracle): the loss first non-finite at the injected step, skipped; its
    # producer (None: user code outside the model); the step replayed fails in fp16 and is finite in fp32
    failure_oracle(r, BAD, where, replay_bad(name, r["sd"]))
    f = check_report(r["rep"], name)
    print(name, "->", f.one_line())


# ---------------------------------------------------------------------------------------------------- twins
# name: (factory, batch, loss_fn, steps, lr)
TWINS = {
    "yolo_clamped": (lambda: Yolo(clamp=math.log(1000 / 16)), b_yolo, yolo_l1, 40, 3e-3),
    "fcos_iou_fp32": (lambda: Fcos(IoULoss(1e-7, fp32=True)), lambda bad: b_fcos(bad, points=0), own, 80, 1e-2),
    "giou_normalized": (lambda: BoxDet(GIoULoss(pixels=False)), lambda bad: b_multiscale(bad=5), own, 60, 1e-2),
    "focal_torch_fp32": (lambda: Retina(FocalTorch()), b_retina, own, 40, 3e-3),
    "dice_fp32_fullres": (Segmenter, lambda bad: b_seg(bad=5), dice_fp32, 12, 3e-3),
    "seg_ce_ignore": (lambda: Segmenter(classes=5), b_seg_classes, seg_ce_ignore, 60, 1e-2),
    "fpn_long": (FpnDet, b_fpn, fpn_loss, 120, 3e-3),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_detection_twin(name, tmp_path):
    factory, mk, loss_fn, steps, lr = TWINS[name]
    r, plain = (probe_run(build(factory), mk(None), loss_fn, steps, str(tmp_path / f"w{w}"), lr=lr, watch=w)
                for w in (True, False))
    twin_checks(r, plain, steps)
