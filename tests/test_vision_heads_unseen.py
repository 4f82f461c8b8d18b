"""VISION HEADS (detection, segmentation, pose, tracking) and their losses, written the way popular repos write them,
that break under fp16: tiny CPU models trained for 8 steps in probe_harness.probe_run (fp16 CPU autocast +
GradScaler("cpu"): scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> close() -> report())
under `ampdoctor.watch(model, optimizer=AdamW, scaler=..., run_dir=...)` at the default settings.

The trigger arrives with the data at step K = 5 (a raw frame, a sub-pixel annotation, a box in the letterbox padding,
a collapsed query, ...); every earlier step is finite.

Two placements of the loss:
- IN the watched model (a criterion submodule, CenterNet's ModelWithLoss, mmdet's reg_decoded_bbox decoder, ...):
  the oracle (probe_harness.Producer, keyword inputs checked) names the module and step where the first inf/NaN is
  made from finite inputs; before K nothing but the scaler's opening backoffs (steps 0-2), the loss first non-finite
  at K; and the same forward in float32 with the weights step K ran with is finite. Then the CONTRACT.md rule must be
  among the FIRST THREE findings, severity warning or error, at that module and step K.
- OUTSIDE the model (a plain function on its output, as DETR's main.py / YOLOv5's ComputeLoss / mmseg-style scripts
  call it): the oracle sees every model output finite up to K, no producer module, the loss finite before K and
  non-finite at K; recomputing that loss from the recorded step-K outputs gives the same non-finite value in fp16 and
  a finite one in float32. Then among the first three warning/error findings one at step K with `module` null (phase
  forward or null) or "" (the root), whose rule fits (inf: overflow/underflow; NaN: nan_origin/overflow/underflow),
  and no overflow/nan_origin at a named submodule at step K (README, "Where the producer is not a module").
A failing oracle is a plain failure, never an xfail; a wrong report raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. detr_giou_in   DETR's SetCriterion (L1 + GIoU on cxcywh -> xyxy, box_ops.generalized_box_iou, diag) as the
                   model's `criterion` submodule, targets moved with `.to(src_boxes)` (the device idiom, which also
                   casts them to fp16): at step 5 a collapsed query (w, h logits < -20: sigmoid is 0 in fp16) is
                   matched to a sub-pixel annotation (w = h = 1e-4, whose xyxy corners round together in fp16):
                   union = 0 + 0 - 0, iou = 0/0 = NaN -> nan_origin (or overflow/underflow) at `criterion`.
 2. frcnn_noclip   a Faster R-CNN box head with mmdet's reg_decoded_bbox (L1 on decoded boxes), its decoder
                   torchvision's BoxCoder.decode_single ported without `clamp(max=log(1000/16))` and with torchvision's
                   `boxes.to(rel_codes.dtype)`: RoI features of a raw frame at step 5 give dh > 11.1, exp(dh) = inf ->
                   overflow at `decoder`.
 3. softargmax     an integral-pose head: soft-argmax over a 16x16 heatmap with temperature 1/4 written as
                   exp(beta * h) / sum: a raw frame at step 5 gives beta * h > 11.1, inf / inf = NaN -> nan_origin
                   (or overflow) at `softargmax`.
 4. centernet      CenterNet's ModelWithLoss: CtdetLoss's `_sigmoid` = clamp(sigmoid, 1e-4, 1 - 1e-4) in fp16 - the
                   max 0.9999 rounds to 1.0 in fp16, the clamp does nothing - then `_neg_loss`: a raw frame at step 5
                   gives heat logits > 8.3 at negative locations, p = 1, log(1 - p) = -inf -> overflow/nan_origin at
                   `loss.crit` (or eps_underflow at `loss`, the clamp's module, or `loss.crit`).
 5. seg_ce150      (outside) an ADE20K-style 150-class segmentation loss by hand,
                   logits - log(exp(logits).sum(1)) on the fp16 output: an overexposed frame at step 5 keeps every
                   logit below 11.09 (each exp finite) but the 150-term sum passes 65504, log(inf) = inf, the loss
                   inf -> overflow/underflow, module null.
 6. siamfc_xcorr   SiamFC's head, `_fast_xcorr` (grouped conv2d of the search features with the exemplar's) then
                   `* out_scale` (0.001) after the sum: a raw exemplar/search pair at step 5 -> the correlation
                   passes 65504 before it is scaled -> overflow at `head`.
 7. reid_normalize FairMOT/JDE's re-ID embedding, emb_scale * F.normalize(emb) (eps 1e-12, 0 in fp16), on a
                   bias-free conv + ReLU backbone: a box that augmentation pushed into the letterbox's zero padding at
                   step 5 has the all-zero embedding, 0 / max(0, 0) = NaN (fp32: 0 / 1e-12 = 0) -> nan_origin or
                   eps_underflow at `reid`.
 8. yolo_ciou      (outside) YOLOv5's ComputeLoss + bbox_iou(CIoU=True): pwh = (2 * sigmoid(p)) ** 2 * anchor; a
                   collapsed prediction at step 5 (wh logits < -12) squares to 0 in fp16 (before the fp32 anchors),
                   atan(w1 / h1) = atan(0 / 0) = NaN -> nan_origin/overflow/underflow, module null.
 9. detr_giou_out  (outside) case 1's criterion called by the training script on the model's (logits, boxes), as
                   DETR's main.py does: the NaN is the loss's -> module null.
10. kp_ce_map      a Keypoint R-CNN-style keypoint loss in the model (`kp_loss`), the cross-entropy over the 56x56
                   heatmap positions written by hand as log(exp(x).sum()) - x[target]: a raw frame at step 5 keeps
                   every logit below 11.09 (each exp finite), the 3136-term sum overflows -> overflow at `kp_loss`.
Healthy twins (the same triggers, done as the repos do; no warning, no error):
11. frcnn_noclip with torchvision's clamp(max=log(1000/16)) on dw, dh.
12. centernet with the heatmap upcast first (`_sigmoid(out.float())`): the clamp holds in fp32.
13. softargmax with F.softmax(beta * h.float()) (the integral-regression repos' softmax, in fp32).
(11 and 12: the raw frame's finite but large loss makes the 65536-scaled backward overflow at step 5 - GradScaler's
ordinary backoff, allowed as `skips` once the same step's unscaled fp16 forward + backward is shown finite.)

Result when written (torch 2.13 CPU, default watch): 13 pass, 0 xfail (stable over two runs, ~4 s). ampdoctor's
first findings (abridged):
 1. PASS [error] nan_origin at criterion aten::div step 5 (singular point); [error] skipped_steps.
 2. PASS [error] overflow at decoder aten::exp step 5 (input up to 21.38); [error] skipped_steps.
 3. PASS [error] overflow at softargmax aten::exp step 5 (input up to 50.1; propagates to aten::div);
    [error] skipped_steps.
 4. PASS [error] eps_underflow at loss aten::clamp step 5 (the bound 0.9999 rounds to 1 in fp16: "the guard does
    nothing"); [error] overflow at loss.crit aten::log step 5 (-inf); [error] skipped_steps. (Its message gave
    fp16's spacing near 1 as 0.000977, the spacing above 1; below 1, where 0.9999 lies, it is 0.000488 - fixed
    since, and checked.)
 5. PASS [error] overflow at (run) step 5: "The loss became inf outside the watched model ..." (module null).
 6. PASS [error] overflow at head aten::convolution step 5 (max |x| 88.8 -> +inf); [error] skipped_steps.
 7. PASS [error] eps_underflow at reid aten::clamp_min step 5 (eps 1e-12 rounds to 0); [error] nan_origin at reid
    aten::div step 5; [error] skipped_steps.
 8. PASS [error] nan_origin at (run) step 5: "The loss became NaN outside the watched model ..." (module null).
 9. PASS [error] nan_origin at (run) step 5 (module null); [error] skipped_steps.
10. PASS [error] overflow at kp_loss aten::sum step 5 ("produced +inf from finite inputs"); [error] skipped_steps;
    [info] nan_origin at kp_loss step 0 (the scaled backward's overflow at the first scale, "as designed").
11-12. quiet: only [info] skipped_steps at step 5 ("a normal rate for dynamic loss scaling").
13. quiet (no finding at all).
(Not built: YOLOv5's xyxy branch clamps h with eps 1e-7, which fp16 keeps (1.2e-7): no 0/0; DETR with fp32 targets
(type promotion keeps union > 0); a soft-argmax whose 3072-term sum overflows with every exp finite gives p = 0,
coordinates 0 and a finite loss - silent, no inf/NaN for the oracle; RAFT's correlation volume, RetinaNet/FCOS
exp(dw), dice and bf16 BCE - built in earlier sets.)
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import WrongAnswer, finite, probe_run
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

K, STEPS = 5, 8
ALARM = ("warning", "error")
FWD = ("overflow", "nan_origin")
H16 = torch.float16


def own_loss(out, y):
    """The model returns its own loss."""
    return out.float()


# ======================================================================================================================
# checks
# ======================================================================================================================
def real(r, module, step=K):
    """The oracle (in-model loss): the first inf/NaN from finite inputs is made by `module` at `step`; before it
    nothing but the scaler's first backoffs (steps 0-2); at `step` the loss is non-finite."""
    assert r["first"] == (module, step), (r["first"], r["bad_loss"], r["skipped"], r["losses"])
    assert all(s < 3 for s in r["skipped"] if s < step) and not [s for s in r["bad_loss"] if s < step], r
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


def fp32_ok(make, r, batch, step=K):
    """The same forward in float32 (no autocast), with the weights step `step` ran with, gives a finite loss."""
    m = make()
    m.load_state_dict(r["sd"])
    b = batch(step)
    with torch.no_grad():
        loss = m(*b[0], **(b[1] or {}))
    assert torch.isfinite(loss), float(loss)


def named(rep, rules, module, step=K, also=()):
    """One of `rules` at `module` (or a (rule, module) of `also`), at `step`, among the first three findings, warning
    or error; else WrongAnswer."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.severity in ALARM and f.step == step and (
                f.rule in rules and f.module == module or (f.rule, f.module) in also):
            return f
    raise WrongAnswer(f"wanted {rules} at {module!r} step {step}; top 3: {lines(rep)[:3]}")


class Outside:
    """The training script's loss on the model's output, outside the watched model; keeps each step's outputs
    (detached copies) and targets for the oracle's recomputation."""

    def __init__(self, fn):
        self.fn, self.outs, self.ys = fn, [], []

    def __call__(self, out, y):
        self.outs.append(tuple(o.detach().clone() for o in out) if isinstance(out, tuple) else out.detach().clone())
        self.ys.append(y)
        return self.fn(out, y)

    def again(self, step, dtype):
        o = self.outs[step]
        o = tuple(t.to(dtype) for t in o) if isinstance(o, tuple) else o.to(dtype)
        with torch.no_grad():
            return self.fn(o, self.ys[step])


def real_outside(r, lf, step=K):
    """The oracle (loss outside the model): every output finite up to `step`, no module producer, the loss finite
    before `step` (skips only among the first backoffs) and non-finite at it; the recomputation from the recorded
    outputs: non-finite in fp16, finite in float32. Returns "inf" or "nan"."""
    assert all(finite(o) for o in lf.outs[:step + 1]), [finite(o) for o in lf.outs]
    assert r["first"] is None, r["first"]
    assert all(s < 3 for s in r["skipped"] if s < step) and not [s for s in r["bad_loss"] if s < step], r
    loss = r["losses"][step]
    assert not math.isfinite(loss), r["losses"]
    again = lf.again(step, H16)
    assert not torch.isfinite(again) and math.isnan(loss) == bool(torch.isnan(again)), (loss, again)
    assert torch.isfinite(lf.again(step, torch.float32)), lf.again(step, torch.float32)
    return "nan" if math.isnan(loss) else "inf"


OUT_RULES = {"inf": ("overflow", "underflow"), "nan": ("nan_origin", "overflow", "underflow")}


def outside(rep, kind, step=K):
    """Among the first three warning/error findings: one at `step`, module null (phase forward or null) or the root,
    whose rule fits `kind`; and no overflow/nan_origin at a named submodule at `step`. Else WrongAnswer."""
    top = [f for f in rep.findings if f.severity in ALARM][:3]
    hits = [f for f in top if f.step == step and f.rule in OUT_RULES[kind]
            and (f.module is None and f.phase in ("forward", None) or f.module == "")]
    blamed = [f for f in top if f.step == step and f.rule in FWD and f.module not in (None, "")]
    if not hits or blamed:
        raise WrongAnswer(f"wanted {OUT_RULES[kind]} at module None/'' step {step}; top 3: {lines(rep)[:3]}")
    return hits[0]


def scale_only(make, r, batch, step=K):
    """Step `step`'s fp16 forward and backward without a loss scale (the weights it ran with): the loss and every
    gradient finite - a skip there was the loss scale's overflow, not the model's."""
    m = make()
    m.load_state_dict(r["sd"])
    b = batch(step)
    with torch.autocast("cpu", dtype=H16):
        loss = m(*b[0], **(b[1] or {}))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def quiet(r, skips=()):
    """A healthy twin: every loss finite, no producer, no skip after the first backoffs but `skips` (the trigger's
    finite but large loss whose gradient, scaled by 65536, overflows: GradScaler's ordinary backoff), the loss
    fell on the same batches (steps 6, 7 against 2, 3: the batches cycle every 4 steps), no warning or error in
    the report."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, r
    assert [s for s in r["skipped"] if s >= 3] == list(skips), r
    assert ls[6] + ls[7] < ls[2] + ls[3], ls
    rep = r["rep"]
    assert alarms(rep.findings) == [], lines(rep)


SKIPS_AT_K = (K,)


def run(m, batch, tmp_path, loss_fn=own_loss, lr=1e-3):
    return probe_run(m, batch, loss_fn, STEPS, str(tmp_path / "run"), lr=lr, snap_at=K)


def cached(fn):
    """A batch function computed once per step (the steered batches read the live model: the oracle's float32
    rerun must see the very batch the step trained on)."""
    memo = {}

    def b(i):
        if i not in memo:
            memo[i] = fn(i)
        return memo[i]
    return b


def steer(f, d, idx, below, seed):
    """An input x of size d for which every component `idx` of f(x) (float32, no grad) is below `below` while all
    of f(x) stays within +-2000: the first of 300 random directions (generator seed + k) along which they fall,
    scaled up by powers of two."""
    with torch.no_grad():
        for k in range(300):
            u = torch.randn(d, generator=gen(seed + k))
            for s in (2.0 ** e for e in range(9)):
                o = f(u * s)
                if o.abs().max() > 2000:
                    break
                if (o[idx] < below).all():
                    return u * s
    raise AssertionError("no steering direction")


# ======================================================================================================================
# 1, 9: DETR's GIoU on a collapsed query matched to a sub-pixel box
# ======================================================================================================================
def box_cxcywh_to_xyxy(x):
    cx, cy, w, h = x.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], -1)


def box_area(b):
    return (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])


def generalized_box_iou(b1, b2):
    """DETR's util/box_ops.py (pairwise)."""
    area1, area2 = box_area(b1), box_area(b2)
    lt = torch.max(b1[:, None, :2], b2[:, :2])
    rb = torch.min(b1[:, None, 2:], b2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area1[:, None] + area2 - inter
    iou = inter / union
    lt = torch.min(b1[:, None, :2], b2[:, :2])
    rb = torch.max(b1[:, None, 2:], b2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    area = wh[..., 0] * wh[..., 1]
    return iou - (area - union) / area


class SetCriterion(nn.Module):
    """DETR's loss_labels + loss_boxes for queries already matched one to one (query q <-> target q)."""

    def forward(self, logits, coord, boxes, labels):
        loss_ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        src = coord.flatten(0, 1)
        tgt = boxes.flatten(0, 1).to(src)                 # "to the device": also to src's fp16
        loss_bbox = F.l1_loss(src, tgt)
        giou = torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src), box_cxcywh_to_xyxy(tgt)))
        return loss_ce + 5 * loss_bbox.float() + 2 * (1 - giou).float().mean()


class DETRLite(nn.Module):
    """Decoder outputs (B, Q, d) -> class_embed, bbox_embed(...).sigmoid() (cxcywh); `criterion` inside the model or
    None (the script calls it)."""

    def __init__(self, inside=True, d=16, h=32, ncls=4):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.class_embed, self.bbox_embed = nn.Linear(h, ncls + 1), nn.Linear(h, 4)
        self.criterion = SetCriterion() if inside else None

    def heads(self, q):
        hs = self.body(q)
        return self.class_embed(hs), self.bbox_embed(hs).sigmoid()

    def forward(self, q, boxes=None, labels=None):
        logits, coord = self.heads(q)
        if self.criterion is None:
            return logits, coord
        return self.criterion(logits, coord, boxes, labels)


NQ, DQ = 6, 16
TINY = torch.tensor([0.5, 0.5, 1e-4, 1e-4])              # a sub-pixel annotation (0.13 px in a 1333 px frame)


def detr_data(m, i):
    q = torch.randn(4, NQ, DQ, generator=gen(3000 + i % 4))
    cxcy = 0.3 + 0.4 * torch.rand(4, NQ, 2, generator=gen(3100 + i % 4))
    wh = 0.1 + 0.4 * torch.rand(4, NQ, 2, generator=gen(3200 + i % 4))
    boxes = torch.cat([cxcy, wh], -1)
    labels = torch.randint(0, 5, (4, NQ), generator=gen(3300 + i % 4))
    if i == K:                                             # a collapsed query matched to the sub-pixel box
        q[0, 0] = steer(lambda x: m.bbox_embed(m.body(x)), DQ, [2, 3], -20.0, 3400)
        boxes[0, 0] = TINY
    return q, boxes, labels


def detr_in_batch(m):
    return cached(lambda i: (detr_data(m, i), None))


def detr_out_batch(m):
    def b(i):
        q, boxes, labels = detr_data(m, i)
        return (q,), (boxes, labels)
    return cached(b)


def detr_loss(out, y):
    return SetCriterion()(*out, *y)


def tiny_box_degenerate():
    """The sub-pixel box: area 0 in fp16, > 0 in float32; sigmoid(-20) is 0 in fp16."""
    xy = box_cxcywh_to_xyxy(TINY[None])
    assert box_area(xy) > 0 and box_area(box_cxcywh_to_xyxy(TINY[None].half())) == 0
    assert float(torch.tensor(-20.0).half().sigmoid()) == 0.0


def test_1_detr_giou_in_model_criterion_zero_union(tmp_path):
    tiny_box_degenerate()
    m = DETRLite()
    batch = detr_in_batch(m)
    r = run(m, batch, tmp_path)
    real(r, "criterion")
    fp32_ok(DETRLite, r, batch)
    named(r["rep"], ("nan_origin", "overflow", "underflow"), "criterion")


def test_9_detr_giou_outside_the_model(tmp_path):
    tiny_box_degenerate()
    m = DETRLite(inside=False)
    lf = Outside(detr_loss)
    r = run(m, detr_out_batch(m), tmp_path, loss_fn=lf)
    kind = real_outside(r, lf)
    outside(r["rep"], kind)


# ======================================================================================================================
# 2, 11: Faster R-CNN decoded-box loss, the decoder without torchvision's clamp
# ======================================================================================================================
BBOX_CLIP = math.log(1000.0 / 16)


class Decoder(nn.Module):
    """torchvision's BoxCoder.decode_single, weights (10, 10, 5, 5); `clip`: its clamp on dw, dh (None: dropped)."""

    def __init__(self, clip=None):
        super().__init__()
        self.clip = clip

    def forward(self, rel_codes, boxes):
        boxes = boxes.to(rel_codes.dtype)
        widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        ctr_x, ctr_y = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
        dx, dy = rel_codes[:, 0] / 10, rel_codes[:, 1] / 10
        dw, dh = rel_codes[:, 2] / 5, rel_codes[:, 3] / 5
        if self.clip is not None:
            dw, dh = dw.clamp(max=self.clip), dh.clamp(max=self.clip)
        px, py = dx * widths + ctr_x, dy * heights + ctr_y
        pw, ph = torch.exp(dw) * widths, torch.exp(dh) * heights
        return torch.stack([px - 0.5 * pw, py - 0.5 * ph, px + 0.5 * pw, py + 0.5 * ph], 1)


class RoIHead(nn.Module):
    """fc -> (cls_score, bbox_pred); mmdet's reg_decoded_bbox: the L1 loss on decoded boxes (per 64 px)."""

    def __init__(self, clip=None, d=16, h=32, ncls=4):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.cls_score, self.bbox_pred = nn.Linear(h, ncls), nn.Linear(h, 4)
        self.decoder = Decoder(clip)

    def forward(self, feats, proposals, gt, labels):
        h = self.fc(feats)
        boxes = self.decoder(self.bbox_pred(h), proposals)
        return F.cross_entropy(self.cls_score(h).float(), labels) + F.l1_loss(boxes.float() / 64, gt / 64)


def frcnn_batch(i):
    n = 16
    xy = 100 * torch.rand(n, 2, generator=gen(3500 + i % 4))
    wh = 16 + 112 * torch.rand(n, 2, generator=gen(3600 + i % 4))
    proposals = torch.cat([xy, xy + wh], 1)
    gt = proposals + 8 * torch.randn(n, 4, generator=gen(3700 + i % 4))
    feats = torch.randn(n, 16, generator=gen(3800 + i % 4))
    labels = torch.randint(0, 4, (n,), generator=gen(3900 + i % 4))
    if i == K:
        feats = feats * 255.0                              # the RoIs of a raw, unnormalised frame
    return (feats, proposals, gt, labels), None


def test_2_frcnn_decode_without_clamp_exp_overflow(tmp_path):
    r = run(RoIHead(), frcnn_batch, tmp_path)
    real(r, "decoder")
    fp32_ok(RoIHead, r, frcnn_batch)
    named(r["rep"], "overflow", "decoder")


def test_11_healthy_frcnn_decode_with_torchvision_clamp(tmp_path):
    r = run(RoIHead(clip=BBOX_CLIP), frcnn_batch, tmp_path)
    scale_only(lambda: RoIHead(clip=BBOX_CLIP), r, frcnn_batch)
    quiet(r, skips=SKIPS_AT_K)


# ======================================================================================================================
# 3, 13: integral pose regression, soft-argmax with a temperature
# ======================================================================================================================
class SoftArgmax(nn.Module):
    def __init__(self, beta=4.0, fp32=False):
        super().__init__()
        self.beta, self.fp32 = beta, fp32

    def forward(self, hm):
        b, j, h, w = hm.shape
        if self.fp32:
            p = F.softmax(hm.float().flatten(2) * self.beta, -1)
        else:
            e = torch.exp(hm.flatten(2) * self.beta)
            p = e / e.sum(-1, keepdim=True)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        x = (p * xs.flatten().to(p.dtype)).sum(-1)
        y = (p * ys.flatten().to(p.dtype)).sum(-1)
        return torch.stack([x, y], -1)


class PoseNet(nn.Module):
    def __init__(self, fp32=False, joints=4):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(8, joints, 1)
        self.softargmax = SoftArgmax(fp32=fp32)

    def forward(self, img, kp):
        xy = self.softargmax(self.head(self.backbone(img)))
        return F.l1_loss(xy.float() / 16, kp / 16)


def pose_batch(i):
    img = torch.rand(2, 3, 16, 16, generator=gen(4000 + i % 4))
    kp = 2 + 12 * torch.rand(2, 4, 2, generator=gen(4100 + i % 4))
    if i == K:
        img = img * 40.0                                   # a raw frame, not normalised
    return (img, kp), None


def test_3_softargmax_exp_with_temperature(tmp_path):
    r = run(PoseNet(), pose_batch, tmp_path, lr=1e-2)
    real(r, "softargmax")
    fp32_ok(PoseNet, r, pose_batch)
    named(r["rep"], FWD, "softargmax")


def test_13_healthy_softargmax_softmax_in_fp32(tmp_path):
    r = run(PoseNet(fp32=True), pose_batch, tmp_path, lr=1e-2)
    quiet(r)


# ======================================================================================================================
# 4, 12: CenterNet's focal loss with its clamp in fp16
# ======================================================================================================================
def _sigmoid(x):
    """CenterNet's utils._sigmoid (out of place)."""
    return torch.clamp(x.sigmoid(), min=1e-4, max=1 - 1e-4)


class FocalLoss(nn.Module):
    """CenterNet's _neg_loss."""

    def forward(self, pred, gt):
        pos_inds = gt.eq(1).float()
        neg_inds = gt.lt(1).float()
        neg_weights = torch.pow(1 - gt, 4)
        pos_loss = torch.log(pred) * torch.pow(1 - pred, 2) * pos_inds
        neg_loss = torch.log(1 - pred) * torch.pow(pred, 2) * neg_weights * neg_inds
        num_pos = pos_inds.float().sum()
        return -(pos_loss.sum() + neg_loss.sum()) / num_pos


class CtdetLoss(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.fp32, self.crit = fp32, FocalLoss()

    def forward(self, hm, gt):
        return self.crit(_sigmoid(hm.float() if self.fp32 else hm), gt)


class CenterNetLite(nn.Module):
    def __init__(self, ncls=2):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.hm = nn.Conv2d(8, ncls, 1)
        with torch.no_grad():
            self.hm.bias.fill_(-2.19)

    def forward(self, img):
        return self.hm(self.backbone(img))


class ModelWithLoss(nn.Module):
    """CenterNet's trainer wraps the network and its loss in one module (the one that gets watched)."""

    def __init__(self, fp32=False):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.loss = CenterNetLite(), CtdetLoss(fp32)

    def forward(self, img, gt):
        return self.loss(self.model(img), gt)


def gaussian_gt(i, ncls=2, s=16):
    g = torch.zeros(2, ncls, s, s)
    yy, xx = torch.meshgrid(torch.arange(s).float(), torch.arange(s).float(), indexing="ij")
    c = torch.randint(2, s - 2, (2, ncls, 2), generator=gen(4200 + i % 4))
    for b in range(2):
        for k in range(ncls):
            g[b, k] = torch.exp(-((xx - c[b, k, 0]) ** 2 + (yy - c[b, k, 1]) ** 2) / (2 * 1.5 ** 2))
    return g


def ctdet_batch(i):
    img = torch.rand(2, 3, 16, 16, generator=gen(4300 + i % 4))
    if i == K:
        img = img * 255.0                                  # a raw 8-bit frame, not normalised
    return (img, gaussian_gt(i)), None


def test_4_centernet_clamp_vanishes_log_one_minus_p(tmp_path):
    assert float(torch.tensor(1 - 1e-4).half()) == 1.0 and float(torch.tensor(1 - 1e-4)) < 1.0
    r = run(ModelWithLoss(), ctdet_batch, tmp_path)
    real(r, "loss.crit")
    fp32_ok(ModelWithLoss, r, ctdet_batch)
    named(r["rep"], FWD + ("eps_underflow",), "loss.crit", also=(("eps_underflow", "loss"),))
    # the words: fp16's spacing just below 1 (where 0.9999 lies) is 2**-11, not finfo.eps = 2**-10 (the spacing
    # above 1; wrong when written, fixed since in replay/constants.py)
    eps = [f.message for f in r["rep"].findings if f.rule == "eps_underflow" and "rounds to exactly 1" in f.message]
    assert eps and all("below 1 is 0.000488" in m for m in eps), eps


def test_12_healthy_centernet_sigmoid_in_fp32(tmp_path):
    r = run(ModelWithLoss(fp32=True), ctdet_batch, tmp_path)
    scale_only(lambda: ModelWithLoss(fp32=True), r, ctdet_batch)
    quiet(r, skips=SKIPS_AT_K)


# ======================================================================================================================
# 5: 150-class segmentation cross-entropy by hand, outside the model
# ======================================================================================================================
class SegNet(nn.Module):
    def __init__(self, ncls=150):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.cls_seg = nn.Conv2d(16, ncls, 1)

    def forward(self, img):
        return self.cls_seg(self.backbone(img))


def seg_ce_by_hand(logits, y):
    logp = logits - torch.log(torch.exp(logits).sum(1, keepdim=True))
    return -logp.gather(1, y[:, None]).mean()


def seg_batch(i):
    img = torch.rand(2, 3, 8, 8, generator=gen(4400 + i % 4))
    y = torch.randint(0, 150, (2, 8, 8), generator=gen(4500 + i % 4))
    if i == K:
        img = img * 22.0                                   # an overexposed frame
    return (img,), y


def test_5_seg_150_class_ce_by_hand_outside(tmp_path):
    lf = Outside(seg_ce_by_hand)
    r = run(SegNet(), seg_batch, tmp_path, loss_fn=lf)
    kind = real_outside(r, lf)
    e = lf.outs[K].exp()                                   # every exp finite in fp16, the 150-term sum is not
    assert torch.isfinite(e).all() and not torch.isfinite(e.sum(1)).all(), lf.outs[K].max()
    outside(r["rep"], kind)


# ======================================================================================================================
# 6: SiamFC cross-correlation, scaled after the sum
# ======================================================================================================================
class SiamFCHead(nn.Module):
    """SiamFC's head: _fast_xcorr, then * out_scale."""

    def __init__(self, out_scale=0.001):
        super().__init__()
        self.out_scale = out_scale

    def forward(self, z, x):
        nz = z.size(0)
        nx, c, h, w = x.size()
        out = F.conv2d(x.view(-1, nz * c, h, w), z, groups=nz)
        out = out.view(nx, -1, out.size(-2), out.size(-1))
        return out * self.out_scale


class SiamFC(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, c, 3), nn.ReLU(), nn.Conv2d(c, c, 3))
        self.head = SiamFCHead()

    def forward(self, z, x, labels):
        resp = self.head(self.backbone(z), self.backbone(x))
        return F.binary_cross_entropy_with_logits(resp.float(), labels)


def siam_batch(i):
    z = torch.rand(2, 3, 8, 8, generator=gen(4600 + i % 4))
    x = torch.rand(2, 3, 20, 20, generator=gen(4700 + i % 4))
    labels = torch.zeros(2, 1, 13, 13)
    labels[:, :, 5:8, 5:8] = 1.0
    if i == K:
        z, x = z * 255.0, x * 255.0                        # a raw exemplar / search pair
    return (z, x, labels), None


def test_6_siamfc_xcorr_overflows_before_out_scale(tmp_path):
    r = run(SiamFC(), siam_batch, tmp_path)
    real(r, "head")
    fp32_ok(SiamFC, r, siam_batch)
    named(r["rep"], "overflow", "head")


# ======================================================================================================================
# 7: re-ID embedding F.normalize of an all-zero crop
# ======================================================================================================================
class ReID(nn.Module):
    """FairMOT's id branch: emb_scale * F.normalize(id_head), emb_scale = sqrt(2) * log(nID - 1)."""

    def __init__(self, c=16, e=16, nid=20):
        super().__init__()
        self.proj = nn.Linear(c, e, bias=False)
        self.emb_scale = math.sqrt(2) * math.log(nid - 1)

    def forward(self, f):
        return self.emb_scale * F.normalize(self.proj(f))


class JDE(nn.Module):
    def __init__(self, c=16, nid=20):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.ReLU())
        self.reid = ReID(c, nid=nid)
        self.classifier = nn.Linear(16, nid)

    def forward(self, crops, ids):
        emb = self.reid(self.backbone(crops).mean((2, 3)))
        return F.cross_entropy(self.classifier(emb).float(), ids)


def reid_batch(i):
    crops = torch.rand(8, 3, 8, 8, generator=gen(4800 + i % 4))
    ids = torch.randint(0, 20, (8,), generator=gen(4900 + i % 4))
    if i == K:
        crops[3] = 0.0                                     # a box inside the letterbox's zero padding
    return (crops, ids), None


def test_7_reid_normalize_eps_vanishes_on_zero_crop(tmp_path):
    assert float(torch.tensor(1e-12).half()) == 0.0
    r = run(JDE(), reid_batch, tmp_path)
    real(r, "reid")
    fp32_ok(JDE, r, reid_batch)
    named(r["rep"], ("nan_origin", "eps_underflow", "overflow"), "reid")


# ======================================================================================================================
# 8: YOLOv5 ComputeLoss + CIoU, outside the model
# ======================================================================================================================
def bbox_iou(box1, box2, eps=1e-7):
    """YOLOv5's utils/metrics.bbox_iou(xywh=True, CIoU=True)."""
    (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.chunk(4, -1), box2.chunk(4, -1)
    w1_, h1_, w2_, h2_ = w1 / 2, h1 / 2, w2 / 2, h2 / 2
    b1_x1, b1_x2, b1_y1, b1_y2 = x1 - w1_, x1 + w1_, y1 - h1_, y1 + h1_
    b2_x1, b2_x2, b2_y1, b2_y2 = x2 - w2_, x2 + w2_, y2 - h2_, y2 + h2_
    inter = (b1_x2.minimum(b2_x2) - b1_x1.maximum(b2_x1)).clamp(0) * \
            (b1_y2.minimum(b2_y2) - b1_y1.maximum(b2_y1)).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cw = b1_x2.maximum(b2_x2) - b1_x1.minimum(b2_x1)
    ch = b1_y2.maximum(b2_y2) - b1_y1.minimum(b2_y1)
    c2 = cw.pow(2) + ch.pow(2) + eps
    rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2).pow(2) + (b2_y1 + b2_y2 - b1_y1 - b1_y2).pow(2)) / 4
    v = (4 / math.pi ** 2) * ((w2 / h2).atan() - (w1 / h1).atan()).pow(2)
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


class YOLOHead(nn.Module):
    """The matched anchors' features -> (x, y, w, h, obj) logits (Detect's 1x1 conv on a stand-in body)."""

    def __init__(self, d=16, h=32):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.m = nn.Linear(h, 5)

    def forward(self, f):
        return self.m(self.body(f))


def yolo_loss(p, y):
    """ComputeLoss's box + objectness terms for the matched anchors."""
    tbox, anchors = y
    pxy = p[:, :2].sigmoid() * 2 - 0.5
    pwh = (p[:, 2:4].sigmoid() * 2) ** 2 * anchors
    pbox = torch.cat((pxy, pwh), 1)
    iou = bbox_iou(pbox, tbox).squeeze(-1)
    lbox = (1.0 - iou).mean()
    lobj = F.binary_cross_entropy_with_logits(p[:, 4].float(), iou.detach().clamp(0).float())
    return lbox + lobj


def yolo_batch(m):
    def b(i):
        f = torch.randn(12, 16, generator=gen(5000 + i % 4))
        anchors = torch.tensor([[1.25, 1.625], [2.0, 3.75], [4.125, 2.875]]).repeat(4, 1)
        tbox = torch.cat([torch.rand(12, 2, generator=gen(5100 + i % 4)),
                          0.5 + 3 * torch.rand(12, 2, generator=gen(5200 + i % 4))], 1)
        if i == K:                                         # a collapsed prediction on a matched anchor
            f[0] = steer(m, 16, [2, 3], -12.0, 5300)
        return (f,), (tbox, anchors)
    return cached(b)


def test_8_yolo_ciou_atan_zero_over_zero_outside(tmp_path):
    assert float(((torch.tensor(-12.0).half().sigmoid() * 2) ** 2)) == 0.0
    m = YOLOHead()
    lf = Outside(yolo_loss)
    r = run(m, yolo_batch(m), tmp_path, loss_fn=lf)
    kind = real_outside(r, lf)
    outside(r["rep"], kind)


# ======================================================================================================================
# 10: Keypoint R-CNN-style heatmap cross-entropy by hand over a 32x32 map
# ======================================================================================================================
class KeypointLoss(nn.Module):
    """keypointrcnn_loss's cross-entropy over the flattened heatmap, written out as log(sum(exp)) - x[target]."""

    def forward(self, hm, idx):
        x = hm.flatten(2)
        lse = torch.log(torch.exp(x).sum(-1))
        return (lse - x.gather(-1, idx[..., None])[..., 0]).mean()


class KeypointHead(nn.Module):
    def __init__(self, joints=4):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.kp = nn.Conv2d(8, joints, 1)
        self.kp_loss = KeypointLoss()

    def forward(self, img, idx):
        return self.kp_loss(self.kp(self.backbone(img)), idx).float()


def kp_batch(i):
    img = torch.rand(2, 3, 56, 56, generator=gen(5400 + i % 4))
    idx = torch.randint(0, 56 * 56, (2, 4), generator=gen(5500 + i % 4))
    if i == K:
        img = img * 62.0                                   # a raw frame, not normalised
    return (img, idx), None


def test_10_keypoint_heatmap_ce_by_hand_sum_overflows(tmp_path):
    r = run(KeypointHead(), kp_batch, tmp_path)
    real(r, "kp_loss")
    fp32_ok(KeypointHead, r, kp_batch)
    m = KeypointHead()
    m.load_state_dict(r["sd"])
    with torch.no_grad(), torch.autocast("cpu", dtype=H16):
        e = m.kp(m.backbone(kp_batch(K)[0][0])).flatten(2).exp()
    assert torch.isfinite(e).all() and not torch.isfinite(e.sum(-1)).all()   # each exp finite, the sum is not
    named(r["rep"], "overflow", "kp_loss")
