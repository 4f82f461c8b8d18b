"""Healthy runs at ampdoctor's DEFAULT watch, twenty-eighth set: fp16 loops ported from the AMP code paths of
well-known training codebases, each written the way that codebase writes it (its classes and helpers reduced to the
lines the loop runs), on tiny models. `ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path /
"run")` and nothing else (scaler=None where the codebase scales the loss by hand); CPU fp16 autocast, a real
`torch.amp.GradScaler("cpu")` where the codebase uses one, fixed seeds (global RNG seeded where the codebase draws
from it), one intra-op thread, 30-48 iterations each. Not covered by tests/test_healthy_default*.py (checked by
grep): YOLOv5, detectron2, mmengine, fastai, nnU-Net, Lightning's manual optimization, fairseq's FP16Optimizer with
its own DynamicLossScaler, diffusers' min-SNR / noise offset / v-prediction fine-tune, DINO's per-parameter clipping
and last-layer freeze, torchvision's every-N-steps EMA. Every case runs twice:

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite; the case learned
  (the mean loss of the last fifth below `fall` x the first fifth's, or the case's own measure where the training
  loss is not comparable step to step); probe_harness.Producer's forward hooks saw no module make inf/NaN from
  finite inputs; the gradients finite after every optimizer step that was not skipped; every weight (and EMA /
  teacher weight) finite at the end; skipped steps only the loss scaler's opening search (a first streak from step 0
  of at most 4, then at most 2 isolated skips, each with a finite loss);
- the WATCHED run must train bitwise identically (`identical`): every loss, loss scale, skip, every optimizer step's
  gradients, the case's extras (eval losses, lrs, scales), every final weight and buffer, the EMA / teacher copies,
  the optimizer's state_dict and the final scale; then (`judge`) w.report() after close() and
  ampdoctor.diagnose(run_dir) must hold no warning and no error (info is fine), exit code 0, no internal error, one
  recorded step per optimizer step of the watched optimizer, and no `ampdoctor: ...` Python warning during the run.
  A false alarm is a strict xfail (probe_harness.wrong: WrongAnswer only) whose reason quotes ampdoctor; a failing
  oracle or a difference in training is a plain failure.

The cases:
 1. torchvision_cls_reference: torchvision's references/classification/train.py: CrossEntropyLoss(label_smoothing
    0.1) on RandomMixup / RandomCutmix soft targets (one chosen per batch), SGD with norm_weight_decay=0 groups,
    SequentialLR(LinearLR warmup, CosineAnnealingLR) stepped per epoch, unscale_ + clip_grad_norm_(1.0) only because
    --clip-grad-norm is set, and ExponentialMovingAverage (an AveragedModel, use_buffers=True) updated only every
    model_ema_steps=4 iterations with the alpha adjusted by batch x steps / epochs and n_averaged.fill_(0) during
    the warmup epochs; learned: the clean held-out loss of the model (and of the EMA) at the end below 0.7x start;
 2. yolov5_accumulate_warmup: ultralytics YOLOv5 train.py: uint8 images / 255, the loss multiplied by the batch size
    (compute_loss), accumulate = max(round(nbs / bs), 1) with nbs 64, bs 16, ramped 1 -> 4 by np.interp during
    warmup, so scaler.step/update only every `accumulate` iterations (`ni - last_opt_step >= accumulate`); warmup by
    np.interp of each group's lr (the bias group FALLING from warmup_bias_lr 0.1, the others rising from 0) and of
    SGD's momentum (0.8 -> 0.937), nesterov, weight decay scaled by bs * accumulate / nbs, Detect biases initialised
    to log priors, unscale_ + clip_grad_norm_(10.0), ModelEMA with the decay ramp d * (1 - exp(-updates / tau));
 3. detectron2_amp_trainer: detectron2's AMPTrainer.run_step (loss dict summed inside autocast, zero_grad AFTER the
    forward, scale(losses).backward(), get_scale() logged, no unscale_ in the trainer), the gradient clipping of
    maybe_add_gradient_clipping (CLIP_TYPE "norm": a per-parameter clip_grad_norm_ INSIDE the subclassed
    optimizer's step, i.e. after GradScaler.step's own unscale_), FrozenBatchNorm2d with "pretrained" stats in the
    backbone, the stem frozen (freeze_at=1, left out of the optimizer), WarmupMultiStep lr (factor 1/1000 linear);
 4. mmengine_amp_optim_wrapper: mmengine's AmpOptimWrapper (accumulative_counts=3 over 40 iterations: loss / 3, the
    last update over the 1 remaining iteration with loss / 1), optim_context (autocast), update_params, clip_grad
    max_norm=35 after unscale_, BaseModel.train_step / parse_losses (a loss list summed, an `acc` log var left out),
    ImgDataPreprocessor's mean/std on uint8 inputs, LinearLR warmup by iteration then MultiStepLR;
 5. fairseq_fp16_optimizer: fairseq's FP16Optimizer (--fp16, --fp16-no-flatten-grads) on a model.half() seq
    tagger: the loss (a token SUM) scaled by hand by its own DynamicLossScaler (init 128, --fp16-scale-window 8, so
    it grows to 2**9), fp16 grads copied into fp32 masters, multiply_grads(1 / ntokens) folded with 1 / scale,
    clip_grad_norm(0.1) whose norm doubles as the overflow check (OverflowError -> zero_grad, skip), Adam(0.9, 0.98)
    on the masters under inverse_sqrt, the masters copied back into the fp16 model; no GradScaler (scaler=None);
    the watch is given fairseq's inner fp32 optimizer (FP16Optimizer.fp32_optimizer, over the masters);
 6. fairseq_fp16_optimizer_flat: 5 with fairseq's default flat masters (one flat fp32 Parameter holding all), the
    watch given the FP16Optimizer;
 7. diffusers_sd_finetune: diffusers' train_text_to_image.py: frozen "VAE" and "text encoder" cast to fp16
    (weight_dtype) and run under no_grad, latents sampled and x 0.18215, noise offset 0.1, scaled_linear betas,
    v-prediction target (get_velocity), min-SNR-gamma 5 weighting (/ (snr + 1)), a tiny cross-attention UNet in fp32
    under autocast, accelerator.clip_grad_norm_ (unscale_ + clip 1.0), constant_with_warmup, EMAModel with
    (1 + step) / (10 + step) decay; learned: a held-out weighted v-loss (fixed noise, timesteps) below 0.8x start;
 8. dino_multicrop: DINO's main_dino.py: 2 global + 4 local crops, MultiCropWrapper (backbone per resolution group),
    DINOHead with a weight-normed last layer (weight_g frozen at 1), DINOLoss (teacher centering, temperature warmup),
    lr / wd / teacher-momentum schedules written into param_groups every iteration (wd on group 0 only),
    utils.clip_gradients (PER-PARAMETER, clip 3.0) after unscale_, cancel_gradients_last_layer (p.grad = None on the
    last layer through the first epoch), EMA teacher; learned: the loss falls;
 9. fastai_mixed_precision: fastai's MixedPrecision callback: autocast entered in before_batch and exited in
    after_loss, after_pred casts the predictions to float, the callback passes ITSELF to scaler.step as a fake
    optimizer (its param_groups the real ones; its step() only notes "not skipped"), the real optimizer step comes
    after (or CancelStepException), scaler.update() in after_step; fit_one_cycle (cosine lr, div 25, final div 1e5,
    and Adam's beta1 cycled 0.95 -> 0.85 -> 0.95), AdamW(eps 1e-5, wd 0.01) through OptimWrapper, a TabularModel
    (embeddings, BatchNorm1d on the continuous inputs, LinBnDrop blocks);
10. nnunet_deep_supervision: nnU-Net v2's train_step: zero_grad(set_to_none=True), a 2D UNet (Conv-InstanceNorm-
    LeakyReLU(0.01)) with deep supervision outputs at 3 scales weighted 1, 1/2, 0 (nnU-Net zeroes the lowest
    resolution's weight, so that head gets exactly zero gradient), DC_and_CE_loss (MemoryEfficientSoftDiceLoss,
    batch dice, do_bg False, smooth 1e-5; the loss negative), SGD(1e-2, momentum 0.99, nesterov, wd 3e-5), PolyLR,
    unscale_ + clip_grad_norm_(12); learned: the loss falls by > 0.3;
11. lightning_manual_two_optimizers: Lightning's manual optimization under precision "16-mixed": training_step inside
    autocast, self.optimizers(), toggle_optimizer / untoggle_optimizer (requires_grad juggling), manual_backward
    (scaler.scale(loss).backward() inside autocast), opt.step() through MixedPrecision.optimizer_step (unscale_,
    scaler.step, scaler.update: TWO updates of one scaler per iteration), two optimizers (a regressor and a probe
    classifier on the shared body's features); watched with the first optimizer.

Result when written: 8/11 quiet (11/11 now) (info findings only: `skipped_steps` / `overflow` "as designed" where a scaler's
first steps skipped; DINO's opening search takes 9 halvings, 65536 -> 128, allowed as its streak), every run bitwise
identical with and without the watch (losses, scales, per-step gradients, extras, weights, EMA/teacher copies,
optimizer state). Three false alarms when written (strict xfails then; fixed since, the marks removed):
 - 3 detectron2_amp_trainer: `[error] scaler_misorder at (run) optimizer.step step 0: optimizer.step() ran twice in
   one iteration on the same gradients (first ... through scaler.step(), again at ... super(type(self), self).step)`.
   The update is applied once: detectron2's clipping subclass calls SGD.step via super(); torch wraps each
   optimizer class's step for the global step hooks when an instance is first built, so once ANY plain SGD exists in
   the process both wrappers fire. The case builds a plain SGD first so that the result does not depend on test
   order. (Fixed: a step() inside the same optimizer's step() is one step, record/monitorsink.global_opt_pre.)
 - 6 fairseq_fp16_optimizer_flat: watch() raised WatchError "the optimizer does not hold any of the model's
   parameters" for fairseq's default flat fp32 master (record/runmeta.py masters_of matched masters one for one by
   shape); given the FP16Optimizer wrapper the report then counted 1 step for 40. (Fixed: one flat fp32 master of
   all the parameters is a master copy, and an optimizer stepping the given optimizer's masters is its inner one.)
   Cases 5 and 6 then showed a timing-dependent `[warning] headroom_trend at embed ... gradient (unscaled) ... falling
   0.20 bits/step`: the hand-made loss scaler doubling every 8 steps. (Fixed: without a GradScaler, an fp16 model
   trained through fp32 masters has its backward not judged, rules/headroom.py.)
 - 9 fastai_mixed_precision: the Python warning "ampdoctor disabled itself after an internal error
   (AttributeError: 'MixedPrecision' object has no attribute 'zero_grad'); training continues unwatched": fastai
   hands its callback to scaler.step as a fake optimizer; then `[error] scaler_misorder ... optimizer.step() ...
   called directly on gradients still multiplied by the loss scale` for the real step after it. (Fixed: no zero_grad
   wrapper on an object without one; gradients unscaled through another object holding the same parameters are
   unscaled, record/monitorsink._opt_pre.)
Lightning (11): the report counts 80 steps for 40 iterations (one per scaler.update(), two per iteration), which the
test expects. The file takes ~12 s.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
import sys
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import wrong  # noqa: E402
from scenarios import gen, one_thread  # noqa: E402
from codebase_harness import (DEBUG, Rec, fall_by, healthy, identical, judge, ns,  # noqa: E402
                             registrar, run)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
F16 = torch.float16
CASES: dict = {}
XFAIL: dict[str, str] = {}


case = registrar(CASES)


def eval_fell(key, factor):
    def check(r):
        ev = r.c.extra[key]
        assert ev[-1] < factor * ev[0], ev
    return check


# ------------------------------------------------------------------------------------------------------ data
def colour_images(seed, n=32, size=8):
    """3-channel size x size images; class c (0-2): a bright 3x3 square in channel c, class 3: in all three; anywhere
    (the square's centre, normalised, is a box target); noise."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        y = torch.randint(0, 4, (n,), generator=g)
        x = 0.3 * torch.randn(n, 3, size, size, generator=g)
        box = torch.zeros(n, 2)
        for b in range(n):
            c = int(y[b])
            dy, dx = (int(v) for v in torch.randint(0, size - 2, (2,), generator=g))
            chans = slice(0, 3) if c == 3 else slice(c, c + 1)
            x[b, chans, dy:dy + 3, dx:dx + 3] += 1.0
            box[b] = torch.tensor([(dy + 1.5) / size, (dx + 1.5) / size])
        return x, y, box
    return batch


def to_uint8(x):
    return ((x.clamp(-2, 2) + 2) * 63.75).round().to(torch.uint8)


# ------------------------------------------------------------------------------ 1. torchvision classification ref
class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """torchvision references/classification/utils.py."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


class RandomMixup:
    """references/classification/transforms.py (p=1): lam from Beta(alpha, alpha) by torch._sample_dirichlet."""

    def __init__(self, num_classes, alpha=0.2):
        self.num_classes, self.alpha = num_classes, alpha

    def __call__(self, batch, target):
        target = F.one_hot(target, num_classes=self.num_classes).to(dtype=batch.dtype)
        batch_rolled, target_rolled = batch.roll(1, 0), target.roll(1, 0)
        lambda_param = float(torch._sample_dirichlet(torch.tensor([self.alpha, self.alpha]))[0])
        batch_rolled.mul_(1.0 - lambda_param)
        batch = batch.mul(lambda_param).add_(batch_rolled)
        target_rolled.mul_(1.0 - lambda_param)
        return batch, target.mul(lambda_param).add_(target_rolled)


class RandomCutmix(RandomMixup):
    def __init__(self, num_classes, alpha=1.0):
        super().__init__(num_classes, alpha)

    def __call__(self, batch, target):
        target = F.one_hot(target, num_classes=self.num_classes).to(dtype=batch.dtype)
        batch_rolled, target_rolled = batch.roll(1, 0), target.roll(1, 0)
        lambda_param = float(torch._sample_dirichlet(torch.tensor([self.alpha, self.alpha]))[0])
        H, W = batch.shape[-2:]
        r_x, r_y = torch.randint(W, (1,)), torch.randint(H, (1,))
        r = 0.5 * math.sqrt(1.0 - lambda_param)
        r_w_half, r_h_half = int(r * W), int(r * H)
        x1, y1 = int(torch.clamp(r_x - r_w_half, min=0)), int(torch.clamp(r_y - r_h_half, min=0))
        x2, y2 = int(torch.clamp(r_x + r_w_half, max=W)), int(torch.clamp(r_y + r_h_half, max=H))
        batch = batch.clone()
        batch[:, :, y1:y2, x1:x2] = batch_rolled[:, :, y1:y2, x1:x2]
        lambda_param = float(1.0 - (x2 - x1) * (y2 - y1) / (W * H))
        target_rolled.mul_(1.0 - lambda_param)
        return batch, target.mul(lambda_param).add_(target_rolled)


def small_resnet(classes=4, d=16):
    """A ResNet-ish net: conv-BN-ReLU stem, one basic block, global pool, fc."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(d, d, 3, padding=1, bias=False), nn.BatchNorm2d(d)
            self.conv2, self.bn2 = nn.Conv2d(d, d, 3, padding=1, bias=False), nn.BatchNorm2d(d)
            nn.init.zeros_(self.bn2.weight)   # zero_init_residual

        def forward(self, x):
            return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, d, 3, padding=1, bias=False), nn.BatchNorm2d(d)
            self.layer1 = Block()
            self.fc = nn.Linear(d, classes)

        def forward(self, x):
            return self.fc(self.layer1(F.relu(self.bn1(self.conv1(x)))).mean((2, 3)))
    return Net()


def set_weight_decay(model, weight_decay, norm_weight_decay):
    """torchvision.ops._utils / references: norm layers' parameters in their own group."""
    norm_classes = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)
    params = {"other": [], "norm": []}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad:
                continue
            params["norm" if isinstance(module, norm_classes) else "other"].append(p)
    return [{"params": params["other"], "weight_decay": weight_decay},
            {"params": params["norm"], "weight_decay": norm_weight_decay}]


@case(40, learned=lambda r: (eval_fell("eval", 0.7)(r), eval_fell("eval_ema", 0.7)(r)))
def torchvision_cls_reference():
    torch.manual_seed(1)
    model = small_resnet()
    epochs, per_epoch, warmup_epochs, bs = 8, 5, 2, 32
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(set_weight_decay(model, 1e-4, 0.0), lr=0.1, momentum=0.9)
    main_lr = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs - warmup_epochs)
    warm_lr = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup_epochs)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm_lr, main_lr], milestones=[warmup_epochs])
    scaler = torch.amp.GradScaler("cpu")
    model_ema_steps, model_ema_decay = 4, 0.99
    adjust = 1 * bs * model_ema_steps / epochs
    alpha = min(1.0, (1.0 - model_ema_decay) * adjust)
    model_ema = ExponentialMovingAverage(model, decay=1.0 - alpha)
    rec = Rec(model)
    data, held = colour_images(1), colour_images(2, n=128)(0)
    mixupcutmix = [RandomMixup(4, alpha=0.2), RandomCutmix(4, alpha=1.0)]
    extra = {"eval": [], "eval_ema": [], "lr": []}

    def evaluate():
        for key, net in (("eval", model), ("eval_ema", model_ema)):
            net.eval()
            with torch.inference_mode(), torch.autocast("cpu", dtype=F16):
                extra[key].append(F.cross_entropy(net(held[0]).float(), held[1]).item())
            net.train()

    def body(it):
        epoch, i = divmod(it, per_epoch)
        if it == 0:
            evaluate()
        image, target, _ = data(it)
        image, target = mixupcutmix[int(torch.randint(0, 2, (1,)))](image, target)   # RandomChoice in collate_fn
        with torch.autocast("cpu", dtype=F16, enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad()
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                    # args.clip_grad_norm is not None
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        if model_ema and i % model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < warmup_epochs:
                model_ema.n_averaged.fill_(0)          # reset ema buffer to keep copying weights during warmup
        if i == per_epoch - 1:
            lr_scheduler.step()
            extra["lr"].append(optimizer.param_groups[0]["lr"])
        if it == epochs * per_epoch - 1:
            evaluate()
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra, {"ema": model_ema})


# ---------------------------------------------------------------------------------------------------- 2. YOLOv5
class Conv(nn.Module):
    """ultralytics Conv: Conv2d(bias=False) + BatchNorm2d + SiLU."""

    def __init__(self, c1, c2, k=3, s=1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class TinyYolo(nn.Module):
    """16x16 input, stride 4, one anchor per cell: (x, y, obj, cls0, cls1) per cell."""

    def __init__(self, nc=2):
        super().__init__()
        self.model = nn.Sequential(Conv(3, 16, 3, 2), Conv(16, 32, 3, 2), Conv(32, 32, 3, 1))
        self.detect = nn.Conv2d(32, 3 + nc, 1)
        s = 4
        with torch.no_grad():        # Model._initialize_biases
            b = self.detect.bias
            b[2] += math.log(8 / (640 / s) ** 2)
            b[3:] += math.log(0.6 / (nc - 0.99))

    def forward(self, x):
        return self.detect(self.model(x)).permute(0, 2, 3, 1)   # (B, 4, 4, 5)


def yolo_batches(seed, n=16):
    """uint8 16x16 images with one 4x4 square of class 0 (red) or 1 (green); its centre's cell and offset."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        img = 0.25 * torch.randn(n, 3, 16, 16, generator=g)
        tgt = torch.zeros(n, 5)                                        # cell y, cell x, off y, off x, class
        for b in range(n):
            c = int(torch.randint(0, 2, (1,), generator=g))
            y0, x0 = (int(v) for v in torch.randint(0, 13, (2,), generator=g))
            img[b, c, y0:y0 + 4, x0:x0 + 4] += 1.5
            cy, cx = y0 + 2.0, x0 + 2.0
            tgt[b] = torch.tensor([cy // 4, cx // 4, cy / 4 - cy // 4, cx / 4 - cx // 4, c])
        return to_uint8(img), tgt
    return batch


class ComputeLoss:
    """utils/loss.py, reduced to one anchor per cell: BCE objectness (all cells), BCE classes and an xy loss on the
    positive cell, each weighted by its hyp gain, the sum x batch size."""

    def __init__(self, hyp):
        self.hyp, self.BCE = hyp, nn.BCEWithLogitsLoss()

    def __call__(self, p, targets):
        bs = p.shape[0]
        gy, gx, cls = targets[:, 0].long(), targets[:, 1].long(), targets[:, 4].long()
        tobj = torch.zeros(p.shape[:3])
        ps = p[torch.arange(bs), gy, gx].float()
        pxy = ps[:, :2].sigmoid() * 2 - 0.5
        lbox = ((pxy - targets[:, 2:4]) ** 2).sum(1).mean()
        tobj[torch.arange(bs), gy, gx] = 1.0
        lobj = self.BCE(p[..., 2].float(), tobj)
        t = torch.zeros(bs, 2)
        t[torch.arange(bs), cls] = 1.0
        lcls = self.BCE(ps[:, 3:], t)
        lbox, lobj, lcls = lbox * self.hyp["box"], lobj * self.hyp["obj"], lcls * self.hyp["cls"]
        return (lbox + lobj + lcls) * bs, torch.stack((lbox, lobj, lcls)).detach()


class ModelEMA:
    """utils/torch_utils.py ModelEMA (tau lowered from 2000 to 5 for a 12-update run)."""

    def __init__(self, model, decay=0.9999, tau=5, updates=0):
        self.ema = copy.deepcopy(model).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


@case(48)
def yolov5_accumulate_warmup():
    torch.manual_seed(2)
    model = TinyYolo()
    hyp = {"lr0": 0.01, "lrf": 0.01, "momentum": 0.937, "weight_decay": 0.0005, "warmup_epochs": 1.0,
           "warmup_momentum": 0.8, "warmup_bias_lr": 0.1, "box": 0.05, "obj": 1.0, "cls": 0.5}
    batch_size, nbs, epochs, nb = 16, 64, 4, 12
    accumulate = max(round(nbs / batch_size), 1)
    hyp["weight_decay"] *= batch_size * accumulate / nbs
    g = [], [], []                                    # smart_optimizer: weights (decay), BN weights, biases
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=False):
            if p_name == "bias":
                g[2].append(p)
            elif p_name == "weight" and isinstance(v, bn):
                g[1].append(p)
            else:
                g[0].append(p)
    optimizer = torch.optim.SGD(g[2], lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": hyp["weight_decay"]})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    lf = lambda x: (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]     # noqa: E731  linear
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)
    nw = round(hyp["warmup_epochs"] * nb)            # max(..., 100) in YOLOv5: lowered for a 48-iteration run
    scaler = torch.amp.GradScaler("cpu")
    compute_loss = ComputeLoss(hyp)
    rec = Rec(model)
    data = yolo_batches(2, batch_size)
    st = {"last_opt_step": -1, "accumulate": accumulate}
    extra = {"acc": [], "lr": []}
    optimizer.zero_grad()

    def body(ni):
        epoch, i = divmod(ni, nb)
        imgs, targets = data(ni)
        imgs = imgs.float() / 255
        if ni <= nw:
            xi = [0, nw]
            st["accumulate"] = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
            for j, x in enumerate(optimizer.param_groups):
                x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])
                if "momentum" in x:
                    x["momentum"] = np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]])
        with torch.autocast("cpu", dtype=F16):
            pred = model(imgs)
            loss, loss_items = compute_loss(pred, targets)
        scaler.scale(loss).backward()
        if ni - st["last_opt_step"] >= st["accumulate"]:
            s = scaler.get_scale()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            scaler.step(optimizer)
            scaler.update()
            rec.after_update(scaler, s)
            optimizer.zero_grad()
            ema.update(model)
            st["last_opt_step"] = ni
            extra["acc"].append(float(st["accumulate"]))
            extra["lr"].append([float(x["lr"]) for x in optimizer.param_groups])
        if i == nb - 1:
            scheduler.step()
        return loss.item() / batch_size
    return ns(model, optimizer, scaler, rec, body, extra, {"ema": ema.ema})


# ------------------------------------------------------------------------------------------------ 3. detectron2
class FrozenBatchNorm2d(nn.Module):
    """detectron2.layers.FrozenBatchNorm2d: affine and stats in buffers, never updated."""

    def __init__(self, num_features, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features) - eps)

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        bias = self.bias - self.running_mean * scale
        scale, bias = scale.reshape(1, -1, 1, 1), bias.reshape(1, -1, 1, 1)
        out_dtype = x.dtype
        return x * scale.to(out_dtype) + bias.to(out_dtype)


class ConvFBN(nn.Sequential):
    def __init__(self, c1, c2, s=1):
        super().__init__(nn.Conv2d(c1, c2, 3, s, 1, bias=False), FrozenBatchNorm2d(c2), nn.ReLU())


class TinyRCNN(nn.Module):
    """A backbone (stem + res2, FrozenBN with "pretrained" stats), and box-head-like heads returning a loss dict
    in training (GeneralizedRCNN's contract)."""

    def __init__(self, classes=4, d=16):
        super().__init__()
        self.stem, self.res2 = ConvFBN(3, d), ConvFBN(d, 2 * d, 2)
        g = gen(33)
        for mod in self.modules():
            if isinstance(mod, FrozenBatchNorm2d):
                n = mod.weight.numel()
                mod.weight.copy_(1 + 0.2 * torch.randn(n, generator=g))
                mod.bias.copy_(0.1 * torch.randn(n, generator=g))
                mod.running_mean.copy_(0.2 * torch.randn(n, generator=g))
                mod.running_var.copy_(0.5 + torch.rand(n, generator=g))
        self.box_head = nn.Sequential(nn.Flatten(), nn.Linear(2 * d * 16, 64), nn.ReLU())
        self.cls_score, self.bbox_pred = nn.Linear(64, classes + 1), nn.Linear(64, 2)
        nn.init.normal_(self.cls_score.weight, std=0.01)
        nn.init.normal_(self.bbox_pred.weight, std=0.001)
        for lin in (self.cls_score, self.bbox_pred):
            nn.init.constant_(lin.bias, 0)

    def forward(self, batched_inputs):
        x, y, box = batched_inputs
        f = self.box_head(self.res2(self.stem(x)))
        scores, deltas = self.cls_score(f), self.bbox_pred(f)
        return {"loss_cls": F.cross_entropy(scores, y),
                "loss_box_reg": F.smooth_l1_loss(deltas, (box - 0.5) * 4, beta=0.0, reduction="sum") / y.numel()}


def maybe_add_gradient_clipping(optimizer_type, clip_value=1.0, norm_type=2.0):
    """detectron2/solver/build.py, CLIP_TYPE "norm": a per-parameter clipper run inside the optimizer's step."""
    def per_param_clipper(p):
        torch.nn.utils.clip_grad_norm_(p, clip_value, norm_type)

    def optimizer_wgc_step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                per_param_clipper(p)
        super(type(self), self).step(closure)

    return type(optimizer_type.__name__ + "WithGradientClip", (optimizer_type,), {"step": optimizer_wgc_step})


class AMPTrainer:
    """detectron2/engine/train_loop.py AMPTrainer.run_step (SimpleTrainer's data iterator, storage as a dict)."""

    def __init__(self, model, data_loader, optimizer, grad_scaler=None, precision=torch.float16,
                 log_grad_scaler=True):
        self.model, self._data_loader_iter, self.optimizer = model, iter(data_loader), optimizer
        self.grad_scaler = grad_scaler or torch.amp.GradScaler("cpu")
        self.precision, self.log_grad_scaler, self.storage = precision, log_grad_scaler, {"grad_scaler": []}
        self.after_step_hooks = []

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        data = next(self._data_loader_iter)
        with torch.autocast("cpu", dtype=self.precision):
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        if self.log_grad_scaler:
            self.storage["grad_scaler"].append(self.grad_scaler.get_scale())
        metrics = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        total = sum(metrics.values())
        if not np.isfinite(total):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration! loss_dict = {metrics}")
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        for h in self.after_step_hooks:
            h()
        return total


@case(40, fall=0.9)
def detectron2_amp_trainer():
    torch.manual_seed(3)
    model = TinyRCNN()
    for p in model.stem.parameters():                 # freeze_at=1
        p.requires_grad_(False)
    params = []                                        # get_default_optimizer_params: WEIGHT_DECAY_NORM 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            params.append({"params": [p], "weight_decay": 1e-4})
    # A plain SGD built first, as in any process that has built one before (another test, an eval script): torch then
    # has SGD.step wrapped by Optimizer._patch_step_function too, so the global step hooks fire in the subclass's
    # step AND in its super().step(). Without it the result would depend on test order.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    opt_cls = maybe_add_gradient_clipping(torch.optim.SGD)
    optimizer = opt_cls(params, lr=0.05, momentum=0.9, nesterov=False)
    warmup_iters, steps = 5, (35,)

    def lr_factor(it):                                  # WarmupParamScheduler(MultiStepParamScheduler), linear
        f = 0.1 ** sum(it >= s for s in steps)
        if it < warmup_iters:
            alpha = it / warmup_iters
            f *= 0.001 * (1 - alpha) + alpha
        return f
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    data = colour_images(3)
    loader = (data(i) for i in itertools.count())
    trainer = AMPTrainer(model, loader, optimizer)
    rec = Rec(model)
    extra = {"grad_scaler": trainer.storage["grad_scaler"]}
    trainer.after_step_hooks.append(lambda: rec.after_update(trainer.grad_scaler, trainer.storage["grad_scaler"][-1]))
    trainer.after_step_hooks.append(sched.step)
    return ns(model, optimizer, trainer.grad_scaler, rec, lambda i: trainer.run_step(), extra)


# ---------------------------------------------------------------------------------------------------- 4. mmengine
class AmpOptimWrapper:
    """mmengine/optim/optimizer/{optimizer_wrapper,amp_optimizer_wrapper}.py, reduced to the lines that run."""

    def __init__(self, optimizer, accumulative_counts=1, clip_grad=None, loss_scale="dynamic", dtype=None):
        self.optimizer, self._accumulative_counts = optimizer, accumulative_counts
        self._inner_count, self._max_counts, self._remainder_counts = 0, -1, -1
        self.clip_grad_kwargs = clip_grad or {}
        self.clip_func = nn.utils.clip_grad_norm_
        assert loss_scale == "dynamic"
        self.loss_scaler = torch.amp.GradScaler("cpu")
        self._scale_update_param = None
        self.cast_dtype = dtype or F16
        self.message_hub, self.on_step = {}, None

    def initialize_count_status(self, model, init_counts, max_counts):
        self._inner_count, self._max_counts = init_counts, max_counts
        self._remainder_counts = self._max_counts % self._accumulative_counts

    def update_params(self, loss):
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            self.step()
            self.zero_grad()

    def scale_loss(self, loss):
        if self._accumulative_counts == 1:
            loss_factor = 1
        elif self._max_counts == -1:
            loss_factor = self._accumulative_counts
        elif self._inner_count < self._max_counts - self._remainder_counts:
            loss_factor = self._accumulative_counts
        else:
            loss_factor = self._remainder_counts
        return loss / loss_factor

    def should_update(self):
        return self._inner_count % self._accumulative_counts == 0 or self._inner_count == self._max_counts

    def should_sync(self):
        return ((self._inner_count + 1) % self._accumulative_counts == 0
                or (self._inner_count + 1) == self._max_counts)

    def backward(self, loss, **kwargs):
        self.loss_scaler.scale(loss).backward(**kwargs)
        self._inner_count += 1

    def _clip_grad(self):
        params = [p for pg in self.optimizer.param_groups for p in pg["params"]]
        params = list(filter(lambda p: p.requires_grad and p.grad is not None, params))
        if len(params) > 0:
            grad = self.clip_func(params, **self.clip_grad_kwargs)
            if grad is not None:
                self.message_hub["train/grad_norm"] = float(grad)

    def step(self):
        s = self.loss_scaler.get_scale()
        if self.clip_grad_kwargs:
            self.loss_scaler.unscale_(self.optimizer)
            self._clip_grad()
        self.loss_scaler.step(self.optimizer)
        self.loss_scaler.update(self._scale_update_param)
        if self.on_step is not None:            # the test's recorder
            self.on_step(s)

    def zero_grad(self):
        self.optimizer.zero_grad()

    @contextlib.contextmanager
    def optim_context(self, model):
        sync = contextlib.nullcontext()
        if not self.should_sync() and hasattr(model, "no_sync"):
            sync = model.no_sync()
        with sync, torch.autocast("cpu", dtype=self.cast_dtype):
            yield


class MMClassifier(nn.Module):
    """An mmengine BaseModel: data_preprocessor (ImgDataPreprocessor), loss mode returning a dict with a list of
    auxiliary losses and an accuracy (not a loss), train_step / parse_losses as in mmengine/model/base_model."""

    def __init__(self, d=16):
        super().__init__()
        self.register_buffer("mean", torch.tensor([123.675, 116.28, 103.53]).view(-1, 1, 1), False)
        self.register_buffer("std", torch.tensor([58.395, 57.12, 57.375]).view(-1, 1, 1), False)
        self.backbone = nn.Sequential(nn.Conv2d(3, d, 3, padding=1), nn.BatchNorm2d(d), nn.ReLU(),
                                      nn.Conv2d(d, 2 * d, 3, stride=2, padding=1), nn.BatchNorm2d(2 * d), nn.ReLU())
        self.head = nn.Linear(2 * d, 4)
        self.aux_heads = nn.ModuleList(nn.Linear(2 * d, 4) for _ in range(2))

    def data_preprocessor(self, data, training=False):
        inputs, y = data
        inputs = inputs[:, [2, 1, 0]].float()          # bgr_to_rgb
        return (inputs - self.mean) / self.std, y

    def forward(self, inputs, y, mode="loss"):
        f = self.backbone(inputs).mean((2, 3))
        logits = self.head(f)
        return {"loss_cls": F.cross_entropy(logits, y),
                "loss_aux": [0.4 * F.cross_entropy(h(f), y) for h in self.aux_heads],
                "acc": (logits.argmax(1) == y).float().mean()}

    def parse_losses(self, losses):
        log_vars = []
        for loss_name, loss_value in losses.items():
            if isinstance(loss_value, torch.Tensor):
                log_vars.append([loss_name, loss_value.mean()])
            else:
                log_vars.append([loss_name, sum(_loss.mean() for _loss in loss_value)])
        loss = sum(value for key, value in log_vars if "loss" in key)
        log_vars.insert(0, ["loss", loss])
        return loss, OrderedDict(log_vars)

    def train_step(self, data, optim_wrapper):
        with optim_wrapper.optim_context(self):
            inputs, y = self.data_preprocessor(data, True)
            losses = self(inputs, y, mode="loss")
        parsed_losses, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed_losses)
        return log_vars


@case(40)
def mmengine_amp_optim_wrapper():
    torch.manual_seed(4)
    model = MMClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    ow = AmpOptimWrapper(optimizer, accumulative_counts=3, clip_grad=dict(max_norm=35, norm_type=2))
    max_iters = 40
    ow.initialize_count_status(model, 0, max_iters)     # IterBasedTrainLoop.run

    def lr_factor(it):                                  # LinearLR(0.001, by_epoch=False, end=3) + MultiStepLR([30])
        f = 0.001 + (1 - 0.001) * min(it, 3) / 3
        return f * (0.1 if it >= 30 else 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    rec = Rec(model)
    ow.on_step = lambda s: rec.after_update(ow.loss_scaler, s)
    data = colour_images(4, n=16)
    extra = {"acc": []}

    def body(i):
        x, y, _ = data(i)
        log_vars = model.train_step((to_uint8(x), y), ow)
        sched.step()                                     # ParamSchedulerHook.after_train_iter
        extra["acc"].append(log_vars["acc"].item())
        return log_vars["loss"].item()
    return ns(model, optimizer, ow.loss_scaler, rec, body, extra)


# ----------------------------------------------------------------------------------------------------- 5-6. fairseq
class DynamicLossScaler:
    """fairseq/optim/dynamic_loss_scaler.py."""

    def __init__(self, init_scale=2.0 ** 15, scale_factor=2.0, scale_window=2000, tolerance=0.0, threshold=None,
                 min_loss_scale=1e-4):
        self.loss_scale, self.scale_factor, self.scale_window = init_scale, scale_factor, scale_window
        self.tolerance, self.threshold, self.min_loss_scale = tolerance, threshold, min_loss_scale
        self._iter, self._last_overflow_iter, self._last_rescale_iter, self._overflows_since_rescale = 0, -1, -1, 0

    def scale(self, outputs):
        return self.loss_scale * outputs

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1

    def _decrease_loss_scale(self):
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def check_overflow(self, grad_norm):
        if grad_norm == float("inf") or grad_norm != grad_norm:
            iter_since_rescale = self._iter - self._last_rescale_iter
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
            if pct_overflow >= self.tolerance:
                self._decrease_loss_scale()
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            if self.loss_scale <= self.min_loss_scale:
                raise FloatingPointError("Minimum loss scale reached")
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


class FP16Optimizer:
    """fairseq/optim/fp16_optimizer.py (_FP16OptimizerMixin + FP16Optimizer): fp32 master params (flat or one per
    fp16 param), backward of the hand-scaled loss, grads synced into the masters, one multiply factor folding
    1 / loss_scale with multiply_grads, clip_grad_norm as the overflow check, step, masters copied back."""

    def __init__(self, fp16_params, flatten, lr, scale_window):
        self.fp16_params, self.has_flat_params = fp16_params, flatten
        if flatten:
            total = sum(p.numel() for p in fp16_params)
            fp32 = torch.zeros(total, dtype=torch.float)
            offset = 0
            for p in fp16_params:
                fp32[offset:offset + p.numel()].copy_(p.data.view(-1))
                offset += p.numel()
            fp32 = nn.Parameter(fp32)
            fp32.grad = fp32.data.new(total)
            self.fp32_params = [fp32]
        else:
            self.fp32_params = []
            for p in fp16_params:
                p32 = nn.Parameter(p.data.float())
                p32.grad = torch.zeros_like(p32.data)
                self.fp32_params.append(p32)
        self.fp32_optimizer = torch.optim.Adam(self.fp32_params, lr=lr, betas=(0.9, 0.98), eps=1e-8)
        self.scaler = DynamicLossScaler(init_scale=2.0 ** 7, scale_window=scale_window)
        self._multiply_factor, self._needs_sync = 1.0 / self.scaler.loss_scale, False

    @property
    def param_groups(self):
        return self.fp32_optimizer.param_groups

    def state_dict(self):
        return self.fp32_optimizer.state_dict()

    def get_lr(self):
        return self.param_groups[0]["lr"]

    def set_lr(self, lr):
        for g in self.param_groups:
            g["lr"] = lr

    def backward(self, loss):
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        self._needs_sync = True

    def _sync_fp16_grads_to_fp32(self):
        if self._needs_sync:
            if self.has_flat_params:
                offset = 0
                for p in self.fp16_params:
                    if not p.requires_grad:
                        continue
                    grad_data = p.grad.data if p.grad is not None else p.data.new_zeros(p.data.shape)
                    numel = grad_data.numel()
                    self.fp32_params[0].grad.data[offset:offset + numel].copy_(grad_data.view(-1))
                    offset += numel
            else:
                for p, p32 in zip(self.fp16_params, self.fp32_params):
                    if not p.requires_grad:
                        continue
                    if p.grad is not None:
                        p32.grad.data.copy_(p.grad.data)
                    else:
                        p32.grad = torch.zeros_like(p.data, dtype=torch.float)
            self._needs_sync = False

    def _sync_fp32_params_to_fp16(self):
        if self.has_flat_params:
            offset = 0
            for p in self.fp16_params:
                numel = p.data.numel()
                p.data.copy_(self.fp32_params[0].data[offset:offset + numel].view_as(p.data))
                offset += numel
        else:
            for p, p32 in zip(self.fp16_params, self.fp32_params):
                p.data.copy_(p32.data)

    def _unscale_grads(self):
        if self._multiply_factor != 1.0:
            for p32 in self.fp32_params:
                p32.grad.data.mul_(self._multiply_factor)
            self._multiply_factor = 1.0

    def multiply_grads(self, c):
        self._multiply_factor *= c

    def clip_grad_norm(self, max_norm):
        self._sync_fp16_grads_to_fp32()
        # fp32_optimizer.clip_grad_norm(0): fairseq's utils.clip_grad_norm_ with max_norm 0 only measures
        grad_norm = self._multiply_factor * float(torch.norm(torch.stack([torch.norm(p.grad.detach(), 2.0)
                                                                          for p in self.fp32_params]), 2.0))
        if self.scaler is not None:
            if grad_norm > max_norm > 0.0:
                self._multiply_factor *= max_norm / grad_norm
            self.scaler.check_overflow(grad_norm)
        return grad_norm

    def step(self):
        self._sync_fp16_grads_to_fp32()
        self._unscale_grads()
        self.fp32_optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        self._sync_fp32_params_to_fp16()

    def zero_grad(self):
        for p in self.fp16_params:
            p.grad = None
        for p32 in self.fp32_params:
            if p32.grad is not None:
                p32.grad.zero_()
        self._needs_sync = False
        if self.scaler is not None:
            self._multiply_factor = 1.0 / float(self.scaler.loss_scale)


class ConvTagger(nn.Module):
    """A fairseq-ish fp16 sequence tagger: embeddings (scaled by sqrt(d)), a conv layer, LayerNorm, output proj."""

    def __init__(self, vocab=24, d=32, tags=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        nn.init.normal_(self.embed.weight, 0, d ** -0.5)
        nn.init.constant_(self.embed.weight[0], 0)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, tags)
        self.scale = math.sqrt(d)

    def forward(self, tokens):
        x = self.embed(tokens) * self.scale
        x = x + F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.out(F.relu(self.fc(self.ln(x))))


W_TAG = torch.randint(0, 6, (24, 3), generator=gen(55))


def tag_batches(seed, n=16, T=12):
    """Token sequences (pad 0 at the end of each row, lengths 6-12); a token's tag depends on it and its left
    neighbour."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        tok = torch.randint(1, 24, (n, T), generator=g)
        lens = torch.randint(6, T + 1, (n,), generator=g)
        pad = torch.arange(T)[None] >= lens[:, None]
        tok[pad] = 0
        left = torch.cat([torch.zeros(n, 1, dtype=torch.long), tok[:, :-1]], 1)
        tags = torch.where(left % 4 == 0, W_TAG[tok, 1], W_TAG[tok, 0])
        tags[pad] = -100
        return tok, tags
    return batch


def fairseq_fp16(flatten):
    torch.manual_seed(5)
    model = ConvTagger().half()
    params = list(filter(lambda p: p.requires_grad, model.parameters()))
    optimizer = FP16Optimizer(params, flatten=flatten, lr=1e-2, scale_window=8)
    warmup, peak = 8, 1e-2
    rec = Rec(model)
    data = tag_batches(5)
    extra = {"loss_scale": [], "gnorm": []}
    num_updates = [0]

    def lr_step(n):                               # inverse_sqrt, warmup_init_lr 1e-7
        return 1e-7 + n * (peak - 1e-7) / warmup if n < warmup else peak * math.sqrt(warmup) / math.sqrt(n)

    def train_step(i):                            # Trainer.train_step, update_freq 1
        model.train()
        optimizer.zero_grad()
        tok, tags = data(i)
        logits = model(tok)                        # fp16 model, no autocast
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        loss = F.nll_loss(lprobs.view(-1, 6), tags.view(-1), ignore_index=-100, reduction="sum")
        sample_size = int((tags != -100).sum())
        optimizer.backward(loss)
        scale = optimizer.scaler.loss_scale
        try:
            optimizer.multiply_grads(1.0 / sample_size)
            grad_norm = optimizer.clip_grad_norm(0.1)
            optimizer.step()
            rec.step(scale, False)
            num_updates[0] += 1
            optimizer.set_lr(lr_step(num_updates[0]))
        except OverflowError:
            optimizer.zero_grad()
            grad_norm = float("inf")
            rec.skips_unseen = getattr(rec, "skips_unseen", 0) + 1
        extra["loss_scale"].append(scale)
        extra["gnorm"].append(float(grad_norm))
        return loss.item() / sample_size
    optimizer.set_lr(lr_step(0))
    return ns(model, optimizer.fp32_optimizer, None, rec, train_step, extra,
              watch_opt=optimizer.fp32_optimizer if not flatten else optimizer)


def _no_overflow(r):
    assert not getattr(r.c.rec, "skips_unseen", 0) and max(r.c.extra["loss_scale"]) >= 2 ** 9, r.c.extra
    k = len(r.losses) // 5
    assert sum(r.losses[-k:]) / k < 0.8 * sum(r.losses[:k]) / k


CASES["fairseq_fp16_optimizer"] = SimpleNamespace(make=lambda: fairseq_fp16(False), iters=40, fall=0.8,
                                                  learned=_no_overflow)
CASES["fairseq_fp16_optimizer_flat"] = SimpleNamespace(make=lambda: fairseq_fp16(True), iters=40, fall=0.8,
                                                       learned=_no_overflow)

# ------------------------------------------------------------------------------------------- 7. diffusers SD ft
class DDPMScheduler:
    """diffusers DDPMScheduler, the parts training uses: scaled_linear betas, add_noise, get_velocity."""

    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012):
        self.betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float32) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)
        self.config = SimpleNamespace(num_train_timesteps=num_train_timesteps, prediction_type="v_prediction")

    def _coefs(self, x, timesteps):
        ac = self.alphas_cumprod.to(dtype=x.dtype)
        sqrt_alpha_prod = (ac[timesteps] ** 0.5).flatten()
        sqrt_one_minus_alpha_prod = ((1 - ac[timesteps]) ** 0.5).flatten()
        while len(sqrt_alpha_prod.shape) < len(x.shape):
            sqrt_alpha_prod = sqrt_alpha_prod.unsqueeze(-1)
            sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.unsqueeze(-1)
        return sqrt_alpha_prod, sqrt_one_minus_alpha_prod

    def add_noise(self, original_samples, noise, timesteps):
        a, s = self._coefs(original_samples, timesteps)
        return a * original_samples + s * noise

    def get_velocity(self, sample, noise, timesteps):
        a, s = self._coefs(sample, timesteps)
        return a * noise - s * sample


def compute_snr(noise_scheduler, timesteps):
    """diffusers.training_utils.compute_snr."""
    alphas_cumprod = noise_scheduler.alphas_cumprod
    sqrt_alphas_cumprod = alphas_cumprod ** 0.5
    sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod) ** 0.5
    alpha = sqrt_alphas_cumprod[timesteps].float()
    sigma = sqrt_one_minus_alphas_cumprod[timesteps].float()
    return (alpha / sigma) ** 2


def timestep_embedding(t, dim=32):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class TinyCondUNet(nn.Module):
    """conv_in -> ResBlock(time emb) -> cross-attention to the text states -> ResBlock -> conv_out, GroupNorm/SiLU."""

    def __init__(self, c=4, d=32, ctx=16):
        super().__init__()
        self.conv_in = nn.Conv2d(c, d, 3, padding=1)
        self.time_embedding = nn.Sequential(nn.Linear(32, d), nn.SiLU(), nn.Linear(d, d))
        self.norm1, self.conv1 = nn.GroupNorm(8, d), nn.Conv2d(d, d, 3, padding=1)
        self.norm_attn, self.to_q = nn.GroupNorm(8, d), nn.Linear(d, d, bias=False)
        self.to_k, self.to_v = nn.Linear(ctx, d, bias=False), nn.Linear(ctx, d, bias=False)
        self.to_out = nn.Linear(d, d)
        self.norm2, self.conv2 = nn.GroupNorm(8, d), nn.Conv2d(d, d, 3, padding=1)
        self.norm_out, self.conv_out = nn.GroupNorm(8, d), nn.Conv2d(d, c, 3, padding=1)

    def forward(self, sample, timesteps, encoder_hidden_states):
        emb = self.time_embedding(timestep_embedding(timesteps).to(sample.dtype))
        h = self.conv_in(sample)
        h = h + self.conv1(F.silu(self.norm1(h) + emb[:, :, None, None]))
        B, C, H, W = h.shape
        q = self.to_q(self.norm_attn(h).flatten(2).transpose(1, 2))
        k, v = self.to_k(encoder_hidden_states), self.to_v(encoder_hidden_states)
        h = h + self.to_out(F.scaled_dot_product_attention(q, k, v)).transpose(1, 2).reshape(B, C, H, W)
        h = h + self.conv2(F.silu(self.norm2(h)))
        return SimpleNamespace(sample=self.conv_out(F.silu(self.norm_out(h))))


class EMAModel:
    """diffusers.training_utils.EMAModel (no warmup: (1 + step) / (10 + step) capped by decay)."""

    def __init__(self, parameters, decay=0.9999, min_decay=0.0, update_after_step=0):
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay, self.min_decay, self.update_after_step, self.optimization_step = decay, min_decay, \
            update_after_step, 0

    def get_decay(self, optimization_step):
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        cur_decay_value = (1 + step) / (10 + step)
        return max(min(cur_decay_value, self.decay), self.min_decay)

    @torch.no_grad()
    def step(self, parameters):
        parameters = list(parameters)
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)

    def state_dict(self):
        return {str(i): p for i, p in enumerate(self.shadow_params)}


class FrozenVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 2, stride=2)      # -> mean, logvar of 4 latent channels

    def encode(self, x):
        mean, logvar = self.enc(x).chunk(2, dim=1)
        logvar = torch.clamp(logvar, -30.0, 20.0)
        std = torch.exp(0.5 * logvar)
        return SimpleNamespace(latent_dist=SimpleNamespace(sample=lambda: mean + std * torch.randn(
            mean.shape, dtype=mean.dtype)))


PROMPT_COLOURS = torch.rand(6, 3, generator=gen(77)) * 2 - 1


def sd_batches(seed, n=8):
    """8x8 images whose colour and gradient follow one of 6 "prompts" (token ids 1-6 plus 3 filler tokens)."""
    ramp = torch.linspace(-1, 1, 8)

    def batch(i):
        g = gen(seed * 100_000 + i)
        pid = torch.randint(0, 6, (n,), generator=g)
        img = PROMPT_COLOURS[pid][:, :, None, None] * (0.6 + 0.4 * ramp[None, None, :, None])
        img = img + 0.05 * torch.randn(n, 3, 8, 8, generator=g)
        ids = torch.cat([pid[:, None] + 1, torch.randint(7, 16, (n, 3), generator=g)], 1)
        return img, ids
    return batch


@case(40, learned=eval_fell("eval", 0.8))
def diffusers_sd_finetune():
    torch.manual_seed(7)
    weight_dtype = F16
    vae, text_encoder = FrozenVAE(), nn.Embedding(16, 16)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(dtype=weight_dtype)
    text_encoder.to(dtype=weight_dtype)
    unet = TinyCondUNet()
    unet.train()
    ema_unet = EMAModel(unet.parameters(), decay=0.9999)
    noise_scheduler = DDPMScheduler()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=2e-3, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    warm = 5
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / warm))  # constant_with_warmup
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(unet)
    data = sd_batches(7)
    noise_offset, snr_gamma, scaling_factor = 0.1, 5.0, 0.18215
    g_eval = gen(707)
    ev_x, ev_ids = sd_batches(8, n=32)(0)
    ev_eps = torch.randn(32, 4, 4, 4, generator=g_eval)
    ev_t = torch.randint(0, 1000, (32,), generator=g_eval)
    extra = {"eval": []}

    def weighted_loss(model_pred, target, timesteps):
        snr = compute_snr(noise_scheduler, timesteps)
        mse_loss_weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
        mse_loss_weights = mse_loss_weights / (snr + 1)                # v_prediction
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
        loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
        return loss.mean()

    def evaluate():
        with torch.no_grad():
            latents = vae.enc(ev_x.to(weight_dtype)).chunk(2, dim=1)[0] * scaling_factor
            enc = text_encoder(ev_ids)
            noisy = noise_scheduler.add_noise(latents, ev_eps.to(weight_dtype), ev_t)
            target = noise_scheduler.get_velocity(latents, ev_eps.to(weight_dtype), ev_t)
            with torch.autocast("cpu", dtype=F16):
                pred = unet(noisy, ev_t, enc).sample
            extra["eval"].append(weighted_loss(pred, target, ev_t).item())

    def body(step):
        if step == 0:
            evaluate()
        pixel_values, input_ids = data(step)
        latents = vae.encode(pixel_values.to(weight_dtype)).latent_dist.sample()
        latents = latents * scaling_factor
        noise = torch.randn_like(latents)
        if noise_offset:
            noise += noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), dtype=latents.dtype)
        bsz = latents.shape[0]
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,)).long()
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(input_ids)
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
        with torch.autocast("cpu", dtype=F16):                       # accelerator.prepare(unet)'s forward
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
        model_pred = model_pred.float()                               # convert_outputs_to_fp32
        loss = weighted_loss(model_pred, target, timesteps)
        s = scaler.get_scale()
        scaler.scale(loss).backward()                                 # accelerator.backward
        scaler.unscale_(optimizer)                                    # accelerator.clip_grad_norm_
        nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        scaler.step(optimizer)                                        # AcceleratedOptimizer.step
        scaler.update()
        rec.after_update(scaler, s)
        lr_scheduler.step()
        optimizer.zero_grad()
        ema_unet.step(unet.parameters())
        if step == 39:
            evaluate()
        return loss.item()
    return ns(unet, optimizer, scaler, rec, body, extra, {"ema": ema_unet})


# ------------------------------------------------------------------------------------------------------ 8. DINO
class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, norm_last_layer=True, nlayers=3, hidden_dim=64, bottleneck_dim=16):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.constant_(m.bias, 0)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(torch.unique_consecutive(torch.tensor([inp.shape[-1] for inp in x]),
                                                          return_counts=True)[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, _out))
            start_idx = end_idx
        return self.head(output)


def dino_backbone(d=32):
    return nn.Sequential(nn.Conv2d(3, d, 3, padding=1), nn.GELU(), nn.Conv2d(d, d, 3, stride=2, padding=1),
                         nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(d))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = student_output / self.student_temp
        student_out = student_out.chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1)
        teacher_out = teacher_out.detach().chunk(2)
        total_loss, n_loss_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True) / len(teacher_output)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup_schedule = np.array([])
    warmup_iters = warmup_epochs * niter_per_ep
    if warmup_epochs > 0:
        warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup_schedule, schedule))


def clip_gradients(model, clip):
    norms = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def get_params_groups(model):
    regularized, not_regularized = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or len(param.shape) == 1:
            not_regularized.append(param)
        else:
            regularized.append(param)
    return [{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}]


PROTOS = torch.randn(6, 3, 16, 16, generator=gen(88))


def dino_crops(seed, n=16):
    """Images drawn from 6 smooth prototypes (plus noise); 2 global 12x12 and 4 local 6x6 random crops (flips)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        k = torch.randint(0, 6, (n,), generator=g)
        base = F.avg_pool2d(PROTOS[k], 3, 1, 1) + 0.1 * torch.randn(n, 3, 16, 16, generator=g)
        crops = []
        for size, count in ((12, 2), (6, 4)):
            for _ in range(count):
                y0, x0 = (int(v) for v in torch.randint(0, 16 - size + 1, (2,), generator=g))
                c = base[:, :, y0:y0 + size, x0:x0 + size]
                crops.append(c.flip(-1) if bool(torch.rand(1, generator=g) < 0.5) else c)
        return crops
    return batch


def _dino_learned(r):
    kl = r.c.extra["kl"]
    assert sum(kl[-6:]) / 6 < 0.8 * sum(kl[:6]) / 6, kl


@case(30, learned=_dino_learned, streak=10)
def dino_multicrop():
    torch.manual_seed(8)
    out_dim, epochs, per_epoch = 64, 3, 10
    student = MultiCropWrapper(dino_backbone(), DINOHead(32, out_dim, norm_last_layer=True))
    teacher = MultiCropWrapper(dino_backbone(), DINOHead(32, out_dim))
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    dino_loss = DINOLoss(out_dim, 6, 0.04, 0.07, 2, epochs)
    optimizer = torch.optim.AdamW(get_params_groups(student))
    fp16_scaler = torch.amp.GradScaler("cpu")
    lr_schedule = cosine_scheduler(2e-3, 1e-5, epochs, per_epoch, warmup_epochs=1)
    wd_schedule = cosine_scheduler(0.04, 0.4, epochs, per_epoch)
    momentum_schedule = cosine_scheduler(0.996, 1, epochs, per_epoch)
    rec = Rec(student)
    data = dino_crops(8)
    extra = {"agree": [], "kl": []}

    def body(it):
        epoch = it // per_epoch
        images = data(it)
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:
                param_group["weight_decay"] = wd_schedule[it]
        center = dino_loss.center                       # the test's measure: the teacher targets' entropy
        with torch.autocast("cpu", dtype=F16, enabled=fp16_scaler is not None):
            teacher_output = teacher(images[:2])
            student_output = student(images)
            loss = dino_loss(student_output, teacher_output, epoch)
        with torch.no_grad():
            q = F.softmax((teacher_output - center) / dino_loss.teacher_temp_schedule[epoch], dim=-1)
            extra["kl"].append(loss.item() - float(-(q * q.clamp_min(1e-30).log()).sum(-1).mean()))
        if not math.isfinite(loss.item()):
            raise SystemExit(1)
        optimizer.zero_grad()
        s = fp16_scaler.get_scale()
        fp16_scaler.scale(loss).backward()
        fp16_scaler.unscale_(optimizer)
        clip_gradients(student, 3.0)
        cancel_gradients_last_layer(epoch, student, 1)
        fp16_scaler.step(optimizer)
        fp16_scaler.update()
        rec.after_update(fp16_scaler, s)
        with torch.no_grad():
            m = momentum_schedule[it]
            for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        extra["agree"].append(float((student_output[:32].argmax(1) == teacher_output.argmax(1)).float().mean()))
        return loss.item()
    return ns(student, optimizer, fp16_scaler, rec, body, extra, {"teacher": teacher, "dino_loss": dino_loss})


# ------------------------------------------------------------------------------------------------------ 9. fastai
class CancelStepException(Exception):
    pass


class OptimWrapper:
    """fastai.optimizer.OptimWrapper: fastai hypers (lr, mom) mapped onto a torch optimizer's (lr, betas[0])."""

    def __init__(self, opt):
        self.opt = opt

    @property
    def param_groups(self):
        return self.opt.param_groups

    def set_hyper(self, k, v):
        for pg in self.opt.param_groups:
            if k == "mom":
                pg["betas"] = (v, pg["betas"][1])
            else:
                pg[k] = v

    def step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()


class MixedPrecision:
    """fastai.callback.fp16.MixedPrecision (AMPMode.FP16)."""

    def __init__(self, learn):
        self.learn = learn

    def before_fit(self):
        self.autocast, self.learn.scaler, self.scales = torch.autocast("cpu", dtype=F16), \
            torch.amp.GradScaler("cpu"), []

    def before_batch(self):
        self.autocast.__enter__()

    def after_pred(self):
        self.learn.pred = self.learn.pred.float()                  # to_float

    def after_loss(self):
        self.autocast.__exit__(None, None, None)

    def before_backward(self):
        self.learn.loss_grad = self.learn.scaler.scale(self.learn.loss_grad)

    def before_step(self):
        "Use `self` as a fake optimizer. `self.skipped` will be set to True `after_step` if gradients overflow."
        self.skipped = True
        self.learn.scaler.step(self)
        if self.skipped:
            raise CancelStepException()
        self.scales.append(self.learn.scaler.get_scale())

    def after_step(self):
        self.learn.scaler.update()

    @property
    def param_groups(self):
        "Pretend to be an optimizer for `GradScaler`"
        return self.learn.opt.param_groups

    def step(self, *args, **kwargs):
        "Fake optimizer step to detect whether this batch was skipped from `GradScaler`"
        self.skipped = False


class LinBnDrop(nn.Sequential):
    def __init__(self, n_in, n_out, bn=True, p=0.0, act=None):
        layers = [nn.BatchNorm1d(n_in)] if bn else []
        if p != 0:
            layers.append(nn.Dropout(p))
        layers.append(nn.Linear(n_in, n_out, bias=not bn))
        if act is not None:
            layers.append(act)
        super().__init__(*layers)


class TabularModel(nn.Module):
    """fastai.tabular.model.TabularModel."""

    def __init__(self, emb_szs, n_cont, out_sz, layers, ps=0.1, embed_p=0.05):
        super().__init__()
        self.embeds = nn.ModuleList([nn.Embedding(ni, nf) for ni, nf in emb_szs])
        for e in self.embeds:
            nn.init.trunc_normal_(e.weight, std=0.01)
        self.emb_drop = nn.Dropout(embed_p)
        self.bn_cont = nn.BatchNorm1d(n_cont)
        n_emb = sum(e.embedding_dim for e in self.embeds)
        sizes = [n_emb + n_cont] + layers + [out_sz]
        self.layers = nn.Sequential(*[LinBnDrop(sizes[i], sizes[i + 1], bn=i != len(sizes) - 2,
                                                p=ps if 0 < i < len(sizes) - 2 else 0.0,
                                                act=nn.ReLU(inplace=True) if i < len(sizes) - 2 else None)
                                      for i in range(len(sizes) - 1)])

    def forward(self, x_cat, x_cont):
        x = torch.cat([e(x_cat[:, i]) for i, e in enumerate(self.embeds)], 1)
        x = self.emb_drop(x)
        x = torch.cat([x, self.bn_cont(x_cont)], 1)
        return self.layers(x)


W_TAB = torch.randn(4, generator=gen(99))
CAT_EFF = torch.randn(2, 7, generator=gen(98))


def tabular_batches(seed, n=64):
    def batch(i):
        g = gen(seed * 100_000 + i)
        cat = torch.stack([torch.randint(0, 5, (n,), generator=g), torch.randint(0, 7, (n,), generator=g)], 1)
        cont = torch.randn(n, 4, generator=g) * torch.tensor([1.0, 10.0, 100.0, 0.1]) + torch.tensor([0, 50.0, 0, 3])
        z = ((cont - torch.tensor([0, 50.0, 0, 3])) / torch.tensor([1.0, 10.0, 100.0, 0.1])) @ W_TAB
        z = z + CAT_EFF[0, cat[:, 0]] + CAT_EFF[1, cat[:, 1]]
        y = (z > 0).long() + (z > 1.5).long()
        return cat, cont, y
    return batch


def combined_cos(pct, start, middle, end):
    def sched_cos(start, end, pos):
        return start + (1 + math.cos(math.pi * (1 - pos))) * (end - start) / 2

    def f(p):
        if p < pct:
            return sched_cos(start, middle, p / pct)
        return sched_cos(middle, end, (p - pct) / (1 - pct))
    return f


@case(40)
def fastai_mixed_precision():
    torch.manual_seed(9)
    model = TabularModel([(5, 3), (7, 4)], 4, 3, [64, 32])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.01, betas=(0.95, 0.99))
    learn = SimpleNamespace(model=model, opt=OptimWrapper(opt), loss_func=nn.CrossEntropyLoss())
    cb = MixedPrecision(learn)
    cb.before_fit()
    n_iter, lr_max = 40, 1e-2
    lr_sched = combined_cos(0.25, lr_max / 25, lr_max, lr_max / 25 / 1e5)     # fit_one_cycle
    mom_sched = combined_cos(0.25, 0.95, 0.85, 0.95)
    rec = Rec(model)
    data = tabular_batches(9)
    extra = {"scales": cb.scales, "skipped": []}

    def body(i):
        learn.opt.set_hyper("lr", lr_sched(i / n_iter))                        # ParamScheduler.before_batch
        learn.opt.set_hyper("mom", mom_sched(i / n_iter))
        x_cat, x_cont, y = data(i)
        cb.before_batch()
        learn.pred = model(x_cat, x_cont)
        cb.after_pred()
        learn.loss_grad = learn.loss_func(learn.pred, y)
        learn.loss = learn.loss_grad.clone()
        cb.after_loss()
        cb.before_backward()
        learn.loss_grad.backward()
        s = learn.scaler.get_scale()
        try:
            cb.before_step()
            learn.opt.step()
        except CancelStepException:
            extra["skipped"].append(i)
        cb.after_step()
        rec.after_update(learn.scaler, s)
        learn.opt.zero_grad()
        return learn.loss.item()
    return ns(model, opt, learn.scaler, rec, body, extra)


# ----------------------------------------------------------------------------------------------------- 10. nnU-Net
class ConvDropoutNormReLU(nn.Sequential):
    def __init__(self, c1, c2, stride=1):
        super().__init__(nn.Conv2d(c1, c2, 3, stride, 1), nn.InstanceNorm2d(c2, eps=1e-5, affine=True),
                         nn.LeakyReLU(0.01, inplace=True))


class PlainConvUNet(nn.Module):
    """dynamic_network_architectures' PlainConvUNet, 3 stages (8, 16, 32), deep supervision: a seg layer per
    decoder stage, outputs highest resolution first."""

    def __init__(self, c_in=1, classes=3, f=(8, 16, 32)):
        super().__init__()
        self.enc = nn.ModuleList([nn.Sequential(ConvDropoutNormReLU(c_in, f[0]), ConvDropoutNormReLU(f[0], f[0])),
                                  nn.Sequential(ConvDropoutNormReLU(f[0], f[1], 2), ConvDropoutNormReLU(f[1], f[1])),
                                  nn.Sequential(ConvDropoutNormReLU(f[1], f[2], 2), ConvDropoutNormReLU(f[2], f[2]))])
        self.transpconvs = nn.ModuleList([nn.ConvTranspose2d(f[2], f[1], 2, 2), nn.ConvTranspose2d(f[1], f[0], 2, 2)])
        self.dec = nn.ModuleList([nn.Sequential(ConvDropoutNormReLU(2 * f[1], f[1])),
                                  nn.Sequential(ConvDropoutNormReLU(2 * f[0], f[0]))])
        self.seg_layers = nn.ModuleList([nn.Conv2d(f[2], classes, 1), nn.Conv2d(f[1], classes, 1),
                                         nn.Conv2d(f[0], classes, 1)])
        for mod in self.modules():                      # InitWeights_He(1e-2)
            if isinstance(mod, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(mod.weight, a=1e-2)
                if mod.bias is not None:
                    nn.init.constant_(mod.bias, 0)

    def forward(self, x):
        skips = []
        for stage in self.enc:
            x = stage(x)
            skips.append(x)
        seg_outputs = [self.seg_layers[0](x)]
        for s in range(2):
            x = self.transpconvs[s](x)
            x = self.dec[s](torch.cat((x, skips[-(s + 2)]), 1))
            seg_outputs.append(self.seg_layers[s + 1](x))
        return seg_outputs[::-1]


class MemoryEfficientSoftDiceLoss(nn.Module):
    def __init__(self, batch_dice=True, do_bg=False, smooth=1e-5):
        super().__init__()
        self.batch_dice, self.do_bg, self.smooth = batch_dice, do_bg, smooth

    def forward(self, x, y):
        x = torch.softmax(x, 1)                          # softmax_helper_dim1
        axes = tuple(range(2, x.ndim))
        with torch.no_grad():
            y_onehot = torch.zeros(x.shape, device=x.device, dtype=torch.bool)
            y_onehot.scatter_(1, y.long(), 1)
            if not self.do_bg:
                y_onehot = y_onehot[:, 1:]
            sum_gt = y_onehot.sum(axes)
        if not self.do_bg:
            x = x[:, 1:]
        intersect = (x * y_onehot).sum(axes)
        sum_pred = x.sum(axes)
        if self.batch_dice:
            intersect, sum_pred, sum_gt = intersect.sum(0), sum_pred.sum(0), sum_gt.sum(0)
        dc = (2 * intersect + self.smooth) / (torch.clip(sum_gt + sum_pred + self.smooth, 1e-8))
        return -dc.mean()


class DC_and_CE_loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.ce, self.dc = nn.CrossEntropyLoss(), MemoryEfficientSoftDiceLoss()

    def forward(self, net_output, target):
        return self.dc(net_output, target) + self.ce(net_output, target[:, 0].long())


class DeepSupervisionWrapper(nn.Module):
    def __init__(self, loss, weight_factors):
        super().__init__()
        self.loss, self.weight_factors = loss, tuple(weight_factors)

    def forward(self, *args):
        return sum(weight * self.loss(*inputs) for weight, *inputs in zip(self.weight_factors, *args) if weight != 0.0)


def seg_batches(seed, n=8):
    """16x16 single-channel images: a bright square (label 1) and a dark disk (label 2) on noise."""
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")

    def batch(i):
        g = gen(seed * 100_000 + i)
        img = 0.3 * torch.randn(n, 1, 16, 16, generator=g)
        lab = torch.zeros(n, 1, 16, 16)
        for b in range(n):
            s = int(torch.randint(3, 7, (1,), generator=g))
            y0, x0 = (int(v) for v in torch.randint(0, 16 - s, (2,), generator=g))
            lab[b, 0, y0:y0 + s, x0:x0 + s] = 1
            cy, cx = (float(v) for v in torch.randint(3, 13, (2,), generator=g))
            disk = (yy - cy) ** 2 + (xx - cx) ** 2 <= 6.0
            lab[b, 0][disk] = 2
        img = img + (lab == 1).float() * 1.0 - (lab == 2).float() * 1.0
        return img, lab
    return batch


@case(30, learned=fall_by(0.3))
def nnunet_deep_supervision():
    torch.manual_seed(10)
    network = PlainConvUNet()
    weights = np.array([1 / (2 ** i) for i in range(3)])
    weights[-1] = 0
    weights = weights / weights.sum()
    loss = DeepSupervisionWrapper(DC_and_CE_loss(), weights)
    optimizer = torch.optim.SGD(network.parameters(), 1e-2, weight_decay=3e-5, momentum=0.99, nesterov=True)
    epochs, per_epoch = 6, 5
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: (1 - e / epochs) ** 0.9)   # PolyLRScheduler
    grad_scaler = torch.amp.GradScaler("cpu")
    rec = Rec(network)
    data = seg_batches(10)

    def train_step(it):
        data_, target = data(it)
        target = [target, F.interpolate(target, scale_factor=0.5, mode="nearest"),
                  F.interpolate(target, scale_factor=0.25, mode="nearest")]      # downsample_seg_for_ds_transform
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=F16, enabled=True):
            output = network(data_)
            lo = loss(output, target)
        s = grad_scaler.get_scale()
        grad_scaler.scale(lo).backward()
        grad_scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(network.parameters(), 12)
        grad_scaler.step(optimizer)
        grad_scaler.update()
        rec.after_update(grad_scaler, s)
        if it % per_epoch == per_epoch - 1:
            lr_scheduler.step()
        return lo.detach().cpu().numpy().item()
    return ns(network, optimizer, grad_scaler, rec, train_step)


# --------------------------------------------------------------------------------------------------- 11. Lightning
class LitTwoTasks(nn.Module):
    """A LightningModule with automatic_optimization = False, the Trainer's pieces it touches inlined: the
    MixedPrecision plugin (scaler, autocast around training_step), toggle_optimizer / untoggle_optimizer,
    manual_backward, LightningOptimizer.step -> MixedPrecision.optimizer_step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head_a, self.head_b = nn.Linear(64, 1), nn.Linear(64, 4)
        self._optimizers, self._param_requires_grad_state = [], {}
        self.scaler = torch.amp.GradScaler("cpu")
        self.on_step, self.updates = None, 0

    def configure_optimizers(self):
        opt_a = torch.optim.Adam([*self.body.parameters(), *self.head_a.parameters()], lr=2e-3)
        opt_b = torch.optim.Adam(self.head_b.parameters(), lr=5e-3)
        return opt_a, opt_b

    def optimizers(self):
        return self._optimizers

    def toggle_optimizer(self, optimizer):
        param_requires_grad_state = {}
        for opt in self._optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param in param_requires_grad_state:
                        continue
                    param_requires_grad_state[param] = param.requires_grad
                    param.requires_grad = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.requires_grad = param_requires_grad_state[param]
        self._param_requires_grad_state = param_requires_grad_state

    def untoggle_optimizer(self, optimizer):
        for opt in self._optimizers:
            if opt is not optimizer:
                for group in opt.param_groups:
                    for param in group["params"]:
                        if param in self._param_requires_grad_state:
                            param.requires_grad = self._param_requires_grad_state[param]
        self._param_requires_grad_state = {}

    def manual_backward(self, loss):
        self.scaler.scale(loss).backward()              # MixedPrecision.pre_backward + backward

    def optimizer_step(self, optimizer):                # MixedPrecision.optimizer_step, manual optimization
        s = self.scaler.get_scale()
        self.scaler.unscale_(optimizer)
        step_output = self.scaler.step(optimizer)
        self.scaler.update()
        self.updates += 1
        if self.on_step is not None:
            self.on_step(optimizer, s)
        return step_output

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y, c = batch
        self.toggle_optimizer(opt_a)
        loss_a = F.mse_loss(self.head_a(self.body(x)).float(), y)
        self.manual_backward(loss_a)
        self.optimizer_step(opt_a)
        opt_a.zero_grad()
        self.untoggle_optimizer(opt_a)
        self.toggle_optimizer(opt_b)
        loss_b = F.cross_entropy(self.head_b(self.body(x)).float(), c)
        self.manual_backward(loss_b)
        self.optimizer_step(opt_b)
        opt_b.zero_grad()
        self.untoggle_optimizer(opt_b)
        return loss_a.detach() + loss_b.detach()


W_A = torch.randn(16, 1, generator=gen(111))
W_B = torch.randn(16, 4, generator=gen(112))


@case(40)
def lightning_manual_two_optimizers():
    torch.manual_seed(11)
    lit = LitTwoTasks()
    lit._optimizers = list(lit.configure_optimizers())
    opt_a = lit._optimizers[0]
    rec = Rec(lit)
    lit.on_step = lambda opt, s: rec.after_update(lit.scaler, s) if opt is opt_a else None

    def body(i):
        g = gen(11 * 100_000 + i)
        x = torch.randn(32, 16, generator=g)
        batch = (x, x @ W_A + 0.1 * torch.randn(32, 1, generator=g), (x @ W_B).argmax(1))
        with torch.autocast("cpu", dtype=F16):          # MixedPrecision.forward_context around training_step
            out = lit.training_step(batch, i)
        return out.item()
    return ns(lit, opt_a, lit.scaler, rec, body, steps=lambda: lit.updates)


# ---------------------------------------------------------------------------------------------------- the test
@pytest.mark.parametrize("name", [pytest.param(n, marks=wrong(XFAIL[n]) if n in XFAIL else ()) for n in CASES])
def test_codebase_loop_healthy(name, tmp_path):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, with the oracle
    if DEBUG:
        rec = ru.c.rec
        print(name, "steps", rec.n, "skipped", rec.skipped, "scales", sorted(set(rec.scales)), "loss",
              [round(v, 4) for v in ru.losses[::max(1, len(ru.losses) // 8)]], ru.losses[-1],
              {k: [round(float(x), 3) if isinstance(x, (int, float)) else None for x in v[::8]][:8]
               for k, v in ru.c.extra.items()})
    healthy(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)
    judge(rw)
