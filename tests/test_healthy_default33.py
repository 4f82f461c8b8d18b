"""Healthy runs at ampdoctor's DEFAULT watch, thirty-third set: TRAINING-LOOP RECIPES AROUND THE STEP not probed by
the earlier files - an LR range test followed by a restore, cyclic schedules with cycled momentum, cumulative
BatchNorm statistics, a spatial transformer (affine_grid + grid_sample), pairwise and listwise ranking losses, a
maximised objective (`maximize=True`), center loss with its own optimizer on the same scaler, MC-dropout evaluation,
a detector-style head returning a dataclass of outputs, K-fold re-initialisation in place and early stopping that
restores the best checkpoint (model, optimizer and scaler state). `ampdoctor.watch(model, optimizer=...,
scaler=..., run_dir=tmp_path / "run")` and nothing else; CPU fp16 autocast with a real `torch.amp.GradScaler("cpu")`,
fixed seeds, one intra-op thread, 50-100 optimizer steps each. The harness is tests/codebase_harness.py
(test_healthy_default28-31's): every case runs twice,

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite; the case learned
  (the mean loss of the last fifth below `fall` x the first fifth's, or the case's own measure); probe_harness.
  Producer's forward hooks saw no module make inf/NaN from finite inputs; the gradients finite after every
  optimizer step that was not skipped; every weight finite at the end; skipped steps only the loss scaler's opening
  search;
- the WATCHED run must train bitwise identically (`identical`): losses, scales, skips, every step's gradients, the
  case's extras (eval losses, learning rates, momenta), every final weight and buffer (BatchNorm's running stats
  and num_batches_tracked included), the other modules' state (center loss' centres), the optimizer's state_dict and
  the final scale; then (`judge`) w.report() after close() and ampdoctor.diagnose(run_dir) hold no warning and no
  error, exit code 0, one recorded step per optimizer step, and no `ampdoctor: ...` Python warning. A false alarm
  is a strict xfail (probe_harness.wrong: WrongAnswer only) whose reason quotes ampdoctor; a failing oracle or a
  difference in training is a plain failure.

Left to earlier files (grep of tests/test_healthy_default*.py, test_codebase*.py): OneCycleLR, ReduceLROnPlateau,
warm restarts, SequentialLR, pack_padded_sequence, ctc_loss, key_padding_mask, orthogonal parametrization,
embedding max_norm, SparseAdam, add_param_group, triplet loss, focal loss, ArcFace, TBPTT, K-FAC-free second order.

The cases (the data: x ~ N(0, 1) in 16-D unless said; a fixed random linear "teacher" gives the labels):
 1. lr_range_test_then_train: torch-lr-finder's range_test(end_lr=1, num_iter=50, step_mode="exp", smooth_f=0.05,
    diverge_th=5) on SGD(momentum 0.9) from lr 1e-4 (the smoothed loss rises from 1.39 to ~1.8 near lr 1; a
    finder run to end_lr=10 diverges to a loss of 62 with 4 skipped steps, not healthy, so not used), then reset():
    the model and optimizer state_dicts cached before it loaded back, the lr set to fastai's lr_min (the lr of the
    lowest smoothed loss / 10), 50 more steps; learned: the training phase ends below 0.5x its first loss;
 2. cyclic_lr_triangular2: SGD(momentum 0.9, nesterov) under CyclicLR(base 5e-3, max 0.1, step_size_up 10,
    'triangular2', cycle_momentum 0.8..0.95), stepped every iteration; the lr and momentum logged each step;
 3. bn_cumulative_momentum_none: BatchNorm1d(momentum=None) (a cumulative moving average of the batch statistics)
    in an MLP, AdamW; model.eval() held-out loss every 10 steps under no_grad + autocast;
 4. spatial_transformer_grid_sample: the PyTorch STN tutorial on 12x12 images of four shapes randomly translated:
    a localisation net (conv, fc) whose last Linear starts at zero weight / identity bias, F.affine_grid +
    F.grid_sample (theta and the grid cast to the input's fp32, as the tutorial's fp32 model has them), a conv
    classifier;
 5. listnet_padded_lists: allRank's ListNet: lists of 4..10 documents padded to 10, padded scores and labels set
    to -inf, softmax of both, eps 1e-10 added before the log (scores cast to fp32 first); learned: the loss (which
    has the labels' entropy as its floor) falls by 0.3;
 6. maximize_log_likelihood: heteroscedastic Gaussian regression, the model's (mean, log variance) fitted by
    Adam(maximize=True) on the mean log-likelihood (negative, rising to ~0.2): `scaler.scale(ll).backward()`;
    learned: the log-likelihood rises by 1;
 7. center_loss_two_optimizers: Wen et al.'s center loss (KaiyangZhou/pytorch-center-loss): CE + 0.1 center loss
    on the penultimate features, the centres an nn.Parameter of a separate module with their own SGD(lr 0.5);
    one backward, scaler.step(model optimizer), unscale_(centre optimizer), centre grads x 1/0.1,
    scaler.step(centre optimizer), one update; the model's optimizer is the watched one;
 8. mc_dropout_eval: every 10 steps model.eval() with the Dropout modules put back in train(), 8 stochastic
    passes averaged under no_grad + autocast (the global RNG drives the dropout masks in both twins);
 9. detection_dataclass_losses: a per-cell detector head returning a @dataclass (objectness logits, boxes, class
    logits); loss = BCEWithLogits(pos_weight 3) + SmoothL1(beta 0.1) on the boxes of positive cells + CE on their
    classes, summed;
10. kfold_reinit_in_place: 3 folds of 30 steps on one model: at each fold start model.apply(reset_weights) (every
    child's reset_parameters, the K-fold tutorial's way), the optimizer's state_dict loaded back from its initial
    one; learned: every fold's loss falls below 0.8x its start;
11. early_stop_restore_best: a validation loss every 4 steps; the best model / optimizer / scaler state_dicts
    deep-copied; after 2 evaluations without improvement all three are loaded back and the lr divided by 10
    (Keras' restore_best_weights + ReduceLROnPlateau done by hand); at least one restore happens.
12. coteaching_small_loss: Co-teaching (Han et al. 2018, bhanML/Co-teaching's loss_coteaching) under 30%
    symmetric label noise: two MLPs, each trained on the (1 - forget rate) share of the batch with the smallest
    loss under the OTHER net (forget rate ramped 0 -> 0.3 over 20 steps); two optimizers, two scaled backwards,
    two scaler.step, one update; the first net and its optimizer watched, the second compared too; learned: the
    first net's accuracy on the clean labels rises by 0.3;
13. coral_ordinal_regression: CORAL (coral_pytorch): a shared Linear(h, 1, bias=False) plus K-1 = 4 free biases,
    the loss -sum(logsigmoid(l) levels + (logsigmoid(l) - l)(1 - levels)) on 5 ordered grades of a fixed utility;
14. asgd_averaged_eval: torch.optim.ASGD(lr 0.3, t0 20): every 10 steps the averaged iterate (state "ax") swapped
    into the model under no_grad, evaluated in eval mode under autocast, swapped back (AWD-LSTM's NT-ASGD eval).

Result when written: 14/14 quiet (no warning, no error, no `ampdoctor: ...` Python warning), every run bitwise
identical with and without the watch. The only finding in the whole file is info (maximize_log_likelihood: the
scaler's two opening backoffs, `overflow at 6 step 0 ... GradScaler skipped them and lowered the scale, as
designed`). XFAIL is empty. The file takes ~10 s.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import wrong  # noqa: E402
from scenarios import gen, one_thread  # noqa: E402
from codebase_harness import (DEBUG, Rec, fall_by, healthy, identical, judge, ns, registrar,  # noqa: E402
                             run)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
F16 = torch.float16
CASES: dict = {}
XFAIL: dict[str, str] = {}

case = registrar(CASES)


# ------------------------------------------------------------------------------------------------------ data, model
W_T = torch.randn(16, 4, generator=gen(3300))
U_T = torch.randn(16, generator=gen(3301))


def teacher(seed, n=64, d=16):
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, d, generator=g)
        return x, (x @ W_T).argmax(1)
    return batch


def plain_mlp(h=64, d_out=4, drop=0.0, bn=False):
    layers = [nn.Linear(16, h)]
    if bn:
        layers.append(nn.BatchNorm1d(h, momentum=None))
    layers += [nn.ReLU(), nn.Dropout(drop), nn.Linear(h, h), nn.ReLU(), nn.Dropout(drop), nn.Linear(h, d_out)]
    return nn.Sequential(*layers)


def amp_step(model, optimizer, scaler, rec, loss_fn, clip=None, sched=None):
    """The plain torch.amp recipe: autocast forward (`loss_fn()` -> (loss, logged)), scale(loss).backward(),
    [unscale_ + clip_grad_norm_], step, update, [sched.step()], zero_grad(set_to_none=True)."""
    with torch.autocast("cpu", dtype=F16):
        loss, logged = loss_fn()
    s = scaler.get_scale()
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    rec.after_update(scaler, s)
    if sched is not None:
        sched.step()
    optimizer.zero_grad(set_to_none=True)
    return logged


def ce_loss(model, data):
    def f(i):
        x, y = data(i)
        loss = F.cross_entropy(model(x), y)
        return loss, loss.item()
    return f


def fell(r, fall=0.8):
    ls = r.losses
    k = max(3, len(ls) // 5)
    assert sum(ls[-k:]) / k < fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)


def extra_fell(key, fall=0.8):
    def check(r):
        fell(r, 0.9)
        v = [float(t) for t in r.c.extra[key]]
        assert all(map(math.isfinite, v)), v
        assert v[-1] < fall * v[0], v
    return check


# ----------------------------------------------------------------------- 1. LR range test, restore, train
def finder_learned(r):
    ex = r.c.extra
    n = ex["stop"][0]
    assert 5 < n < 60, ex["stop"]
    tr = r.losses[n:]
    assert len(tr) >= 30 and sum(tr[-5:]) / 5 < 0.5 * tr[0], (tr[0], tr[-5:])


@case(100, learned=finder_learned)
def lr_range_test_then_train():
    # torch-lr-finder's range_test(end_lr=1, step_mode="exp", smooth_f=0.05, diverge_th=5), then reset()
    torch.manual_seed(1)
    model = plain_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(1)
    loss_fn = ce_loss(model, data)
    cache = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(optimizer.state_dict())}
    st = {"finding": True, "smooth": None, "best": math.inf, "lrs": [], "losses": []}
    num_iter, start, end = 50, 1e-4, 1.0
    extra = {"lr": [], "stop": []}

    def body(i):
        lr = optimizer.param_groups[0]["lr"]
        extra["lr"].append(lr)
        out = amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i))
        if st["finding"]:
            sm = out if st["smooth"] is None else 0.05 * out + 0.95 * st["smooth"]
            st["smooth"] = sm
            st["best"] = min(st["best"], sm)
            st["lrs"].append(lr)
            st["losses"].append(sm)
            if sm > 5 * st["best"] or i + 1 == num_iter:
                st["finding"] = False
                extra["stop"].append(i + 1)
                model.load_state_dict(cache["model"])
                optimizer.load_state_dict(cache["opt"])
                # the suggestion: fastai's lr_min, the lr of the lowest smoothed loss / 10
                k = min(range(len(st["losses"])), key=st["losses"].__getitem__)
                for g in optimizer.param_groups:
                    g["lr"] = st["lrs"][k] / 10
                extra["lr"].append(st["lrs"][k] / 10)
            else:
                for g in optimizer.param_groups:
                    g["lr"] = start * (end / start) ** ((i + 1) / (num_iter - 1))
        return out
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 2. CyclicLR triangular2 + cycled momentum
@case(60)
def cyclic_lr_triangular2():
    torch.manual_seed(2)
    model = plain_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=5e-3, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=5e-3, max_lr=0.1, step_size_up=10,
                                              mode="triangular2", cycle_momentum=True, base_momentum=0.8,
                                              max_momentum=0.95)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, teacher(2))
    extra = {"lr": [], "mom": []}

    def body(i):
        extra["lr"].append(optimizer.param_groups[0]["lr"])
        extra["mom"].append(optimizer.param_groups[0]["momentum"])
        return amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i), sched=sched)
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 3. BatchNorm momentum=None
@case(50, learned=extra_fell("eval"))
def bn_cumulative_momentum_none():
    torch.manual_seed(3)
    model = plain_mlp(bn=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, teacher(3))
    hx, hy = teacher(3303, n=128)(0)
    extra = {"eval": []}

    def body(i):
        out = amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i))
        if i % 10 == 0 or i == 49:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=F16):
                extra["eval"].append(F.cross_entropy(model(hx), hy))
            model.train()
        return out
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 4. spatial transformer network
def shapes(seed, n=32):
    """12x12 images of four shapes (horizontal bar, vertical bar, cross, square), randomly translated by up to 3."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        y = torch.randint(0, 4, (n,), generator=g)
        sh = torch.randint(-3, 4, (n, 2), generator=g)
        x = torch.zeros(n, 1, 12, 12)
        for b in range(n):
            cy, cx = 6 + int(sh[b, 0]), 6 + int(sh[b, 1])
            c = int(y[b])
            if c in (0, 2):
                x[b, 0, cy, cx - 2:cx + 3] = 1
            if c in (1, 2):
                x[b, 0, cy - 2:cy + 3, cx] = 1
            if c == 3:
                x[b, 0, cy - 1:cy + 2, cx - 1:cx + 2] = 1
        return x + 0.05 * torch.randn(x.shape, generator=g), y
    return batch


class STN(nn.Module):
    def __init__(self):
        super().__init__()
        self.localization = nn.Sequential(nn.Conv2d(1, 8, 5), nn.MaxPool2d(2), nn.ReLU())
        self.fc_loc = nn.Sequential(nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 6))
        self.fc_loc[2].weight.data.zero_()
        self.fc_loc[2].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(16 * 3 * 3, 4)

    def stn(self, x):
        xs = self.localization(x).flatten(1)
        theta = self.fc_loc(xs).view(-1, 2, 3).to(x.dtype)
        grid = F.affine_grid(theta, list(x.size()), align_corners=False)
        return F.grid_sample(x, grid.to(x.dtype), align_corners=False)

    def forward(self, x):
        return self.fc(self.conv(self.stn(x)).flatten(1))


@case(70)
def spatial_transformer_grid_sample():
    torch.manual_seed(4)
    model = STN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, shapes(4))
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 5. ListNet on padded lists
def listnet_loss(y_pred, y_true, eps=1e-10, padded_value_indicator=-1):
    # allRank's listNet, as written there
    y_pred = y_pred.clone()
    y_true = y_true.clone()
    mask = y_true == padded_value_indicator
    y_pred[mask] = float("-inf")
    y_true[mask] = float("-inf")
    preds_smax = F.softmax(y_pred, dim=1)
    true_smax = F.softmax(y_true, dim=1)
    preds_smax = preds_smax + eps
    preds_log = torch.log(preds_smax)
    return torch.mean(-torch.sum(true_smax * preds_log, dim=1))


@case(50, learned=fall_by(0.3))
def listnet_padded_lists():
    torch.manual_seed(6)
    model = plain_mlp(d_out=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        g = gen(6_000_000 + i)
        B, L = 16, 10
        x = torch.randn(B, L, 16, generator=g)
        rel = (x @ U_T).clamp(-1.99, 1.99).add(2).floor()              # relevance 0..3
        n = torch.randint(4, L + 1, (B,), generator=g)
        rel[torch.arange(L)[None, :] >= n[:, None]] = -1
        scores = model(x).squeeze(-1).float()
        loss = listnet_loss(scores, rel)
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 6. maximize=True on a log-likelihood
def ll_rose(r):
    ls = r.losses
    k = max(3, len(ls) // 5)
    assert sum(ls[-k:]) / k > sum(ls[:k]) / k + 1.0, (sum(ls[:k]) / k, sum(ls[-k:]) / k)


@case(60, learned=ll_rose)
def maximize_log_likelihood():
    torch.manual_seed(7)
    model = plain_mlp(d_out=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, maximize=True)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        g = gen(7_000_000 + i)
        x = torch.randn(64, 16, generator=g)
        sd = 0.1 + 0.5 * torch.sigmoid(x[:, 0])
        y = 3 * (x @ U_T)[:, None] / 4 + sd[:, None] * torch.randn(64, 1, generator=g)
        out = model(x).float()
        mu, log_var = out[:, :1], out[:, 1:]
        ll = (-0.5 * (log_var + (y - mu) ** 2 / log_var.exp() + math.log(2 * math.pi))).mean()
        return ll, ll.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 7. center loss with its own optimizer
class CenterLoss(nn.Module):
    def __init__(self, num_classes=4, feat_dim=32):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(num_classes, feat_dim))

    def forward(self, x, labels):
        c = self.centers[labels]
        return (x.float() - c).pow(2).sum(1).clamp(min=1e-12, max=1e12).mean() / 2


class FeatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.PReLU(), nn.Linear(64, 32), nn.PReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        f = self.body(x)
        return f, self.head(f)


@case(50)
def center_loss_two_optimizers():
    torch.manual_seed(8)
    model = FeatNet()
    cent = CenterLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    opt_c = torch.optim.SGD(cent.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(8)
    wc = 0.1
    extra = {"cent": []}

    def body(i):
        x, y = data(i)
        with torch.autocast("cpu", dtype=F16):
            f, logits = model(x)
            lc = cent(f, y)
            loss = F.cross_entropy(logits, y) + wc * lc
        extra["cent"].append(lc.detach())
        optimizer.zero_grad()
        opt_c.zero_grad()
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.unscale_(opt_c)
        for p in cent.parameters():
            p.grad.data *= (1. / wc)
        scaler.step(opt_c)
        scaler.update()
        rec.after_update(scaler, s)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra, others={"cent": cent})


# ----------------------------------------------------------------------- 8. MC dropout evaluation
@case(50, learned=extra_fell("eval"))
def mc_dropout_eval():
    torch.manual_seed(9)
    model = plain_mlp(drop=0.2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, teacher(9))
    hx, hy = teacher(9909, n=128)(0)
    extra = {"eval": []}

    def body(i):
        out = amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i))
        if i % 10 == 0 or i == 49:
            model.eval()
            for m in model.modules():
                if m.__class__.__name__.startswith("Dropout"):
                    m.train()
            with torch.no_grad(), torch.autocast("cpu", dtype=F16):
                p = torch.stack([model(hx).float().softmax(-1) for _ in range(8)]).mean(0)
                extra["eval"].append(F.nll_loss(p.log(), hy))
            model.train()
        return out
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 9. detector head returning a dataclass
@dataclass
class DetOutput:
    obj_logits: torch.Tensor
    boxes: torch.Tensor
    cls_logits: torch.Tensor


class CellDetector(nn.Module):
    def __init__(self, d=8, h=64, classes=3):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU())
        self.obj = nn.Linear(h, 1)
        self.box = nn.Linear(h, 4)
        self.cls = nn.Linear(h, classes)

    def forward(self, x):
        f = self.trunk(x)
        return DetOutput(self.obj(f).squeeze(-1), self.box(f), self.cls(f))


W_OBJ = torch.randn(8, generator=gen(3310))
W_BOX = torch.randn(8, 4, generator=gen(3311))
W_CLS = torch.randn(8, 3, generator=gen(3312))


@case(50)
def detection_dataclass_losses():
    torch.manual_seed(10)
    model = CellDetector()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    bce = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(3.0))

    def loss_fn(i):
        g = gen(10_000_000 + i)
        x = torch.randn(8, 16, 8, generator=g)                    # 8 images x 16 cells
        obj = (x @ W_OBJ > 0.8).float()
        box = torch.sigmoid(x @ W_BOX)
        cls = (x @ W_CLS).argmax(-1)
        out = model(x)
        pos = obj.bool()
        l_obj = bce(out.obj_logits, obj)
        l_box = F.smooth_l1_loss(out.boxes[pos], box[pos], beta=0.1)
        l_cls = F.cross_entropy(out.cls_logits[pos], cls[pos])
        loss = l_obj + l_box + l_cls
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 10. K-fold, re-initialised in place
def reset_weights(m):
    for layer in m.children():
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()


def folds_fell(r):
    ls = r.losses
    for f in range(3):
        fl = ls[f * 30:(f + 1) * 30]
        assert sum(fl[-5:]) / 5 < 0.8 * sum(fl[:3]) / 3, (f, fl[:3], fl[-5:])


@case(90, learned=folds_fell)
def kfold_reinit_in_place():
    torch.manual_seed(11)
    model = plain_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    init_opt = copy.deepcopy(optimizer.state_dict())
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(11)

    def body(i):
        fold, k = divmod(i, 30)
        if k == 0 and fold > 0:
            model.apply(reset_weights)
            optimizer.load_state_dict(init_opt)
        x, y = data(fold * 1000 + k)

        def lf():
            loss = F.cross_entropy(model(x), y)
            return loss, loss.item()
        return amp_step(model, optimizer, scaler, rec, lf)
    return ns(model, optimizer, scaler, rec, body)


# ----------------------------------------------------------------------- 11. early stopping, restore best
def restored(r):
    fell(r, 0.9)
    assert r.c.extra["restores"], r.c.extra


@case(80, learned=restored)
def early_stop_restore_best():
    torch.manual_seed(12)
    model = plain_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(12, n=32)
    vx, vy = teacher(1212, n=64)(0)
    loss_fn = ce_loss(model, data)
    st = {"best": math.inf, "ckpt": None, "bad": 0}
    extra = {"val": [], "restores": []}

    def body(i):
        out = amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i))
        if i % 4 == 3:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=F16):
                v = float(F.cross_entropy(model(vx), vy))
            model.train()
            extra["val"].append(v)
            if v < st["best"] - 1e-3:
                st["best"], st["bad"] = v, 0
                st["ckpt"] = copy.deepcopy({"model": model.state_dict(), "opt": optimizer.state_dict(),
                                            "scaler": scaler.state_dict()})
            else:
                st["bad"] += 1
                if st["bad"] >= 2:
                    model.load_state_dict(st["ckpt"]["model"])
                    optimizer.load_state_dict(st["ckpt"]["opt"])
                    scaler.load_state_dict(st["ckpt"]["scaler"])
                    for g in optimizer.param_groups:
                        g["lr"] /= 10
                    st["bad"] = 0
                    extra["restores"].append(i)
        return out
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 12. co-teaching, two networks, one scaler
W_NOISE = 0.3


def noisy_teacher(seed, n=64):
    """teacher() with 30% of the labels replaced by uniform ones (symmetric label noise); also the clean labels."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, 16, generator=g)
        clean = (x @ W_T).argmax(1)
        flip = torch.rand(n, generator=g) < W_NOISE
        return x, torch.where(flip, torch.randint(0, 4, (n,), generator=g), clean), clean
    return batch


def clean_acc_rose(r):
    v = r.c.extra["clean_acc"]
    k = max(3, len(v) // 5)
    assert sum(v[-k:]) / k > sum(v[:k]) / k + 0.3, (v[:k], v[-k:])


@case(60, learned=clean_acc_rose)
def coteaching_small_loss():
    # Han et al. 2018 (bhanML/Co-teaching's loss_coteaching): each net keeps the (1 - forget rate) share of the
    # batch with the smallest loss under the OTHER net and trains on it; forget rate ramps 0 -> 0.3 over 20 steps
    torch.manual_seed(13)
    model1, model2 = plain_mlp(), plain_mlp()
    opt1 = torch.optim.Adam(model1.parameters(), lr=3e-3)
    opt2 = torch.optim.Adam(model2.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model1)
    data = noisy_teacher(13)
    extra = {"clean_acc": [], "kept": []}

    def body(i):
        x, y, clean = data(i)
        forget = W_NOISE * min(1.0, i / 20)
        with torch.autocast("cpu", dtype=F16):
            y1, y2 = model1(x), model2(x)
            l1 = F.cross_entropy(y1, y, reduction="none")
            ind1 = torch.argsort(l1.detach())
            l2 = F.cross_entropy(y2, y, reduction="none")
            ind2 = torch.argsort(l2.detach())
            keep = int((1 - forget) * len(y))
            loss1 = F.cross_entropy(y1[ind2[:keep]], y[ind2[:keep]])
            loss2 = F.cross_entropy(y2[ind1[:keep]], y[ind1[:keep]])
        extra["clean_acc"].append(float((y1.argmax(1) == clean).float().mean()))
        extra["kept"].append(ind2[:keep].clone())
        s = scaler.get_scale()
        opt1.zero_grad()
        scaler.scale(loss1).backward()
        opt2.zero_grad()
        scaler.scale(loss2).backward()
        scaler.step(opt1)
        scaler.step(opt2)
        scaler.update()
        rec.after_update(scaler, s)
        return loss1.item()
    return ns(model1, opt1, scaler, rec, body, extra, others={"net2": model2})


# ----------------------------------------------------------------------- 13. CORAL ordinal regression
class Coral(nn.Module):
    """Cao et al.'s CORAL (Raschka's coral_pytorch): a shared-weight Linear(h, 1, bias=False) and K-1 biases."""

    def __init__(self, K=5, h=64):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.fc = nn.Linear(h, 1, bias=False)
        self.linear_1_bias = nn.Parameter(torch.zeros(K - 1).float())

    def forward(self, x):
        return self.fc(self.features(x)) + self.linear_1_bias


def coral_loss(logits, levels):
    val = -torch.sum(F.logsigmoid(logits) * levels + (F.logsigmoid(logits) - logits) * (1 - levels), dim=1)
    return torch.mean(val)


@case(60)
def coral_ordinal_regression():
    torch.manual_seed(14)
    model = Coral()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)

    def loss_fn(i):
        g = gen(14_000_000 + i)
        x = torch.randn(64, 16, generator=g)
        rank = ((x @ U_T) / 2 + 2.5).clamp(0, 4.99).floor().long()       # 5 ordered grades
        levels = (torch.arange(4)[None, :] < rank[:, None]).float()
        loss = coral_loss(model(x), levels)
        return loss, loss.item()
    return ns(model, optimizer, scaler, rec, lambda i: amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i)))


# ----------------------------------------------------------------------- 14. ASGD with iterate averaging
def ax_eval_fell(r):
    fell(r)
    v = r.c.extra["ax_eval"]
    assert v[-1] < 0.7 * v[0], v


@case(60, learned=ax_eval_fell)
def asgd_averaged_eval():
    # Polyak-Ruppert averaging as torch.optim.ASGD keeps it (state "ax", averaging from step t0=20); the averaged
    # weights are evaluated in a copy every 10 steps (AWD-LSTM's NT-ASGD evaluation: swap in ax, evaluate, swap back)
    torch.manual_seed(15)
    model = plain_mlp()
    optimizer = torch.optim.ASGD(model.parameters(), lr=0.3, t0=20, lambd=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    loss_fn = ce_loss(model, teacher(15))
    hx, hy = teacher(1515, n=128)(0)
    extra = {"ax_eval": []}

    def body(i):
        out = amp_step(model, optimizer, scaler, rec, lambda: loss_fn(i))
        if i % 10 == 9:
            tmp = {}
            with torch.no_grad():
                for p in model.parameters():
                    tmp[p] = p.data.clone()
                    p.data.copy_(optimizer.state[p]["ax"])
                model.eval()
                with torch.autocast("cpu", dtype=F16):
                    extra["ax_eval"].append(float(F.cross_entropy(model(hx), hy)))
                model.train()
                for p in model.parameters():
                    p.data.copy_(tmp[p])
        return out
    return ns(model, optimizer, scaler, rec, body, extra)


# ---------------------------------------------------------------------------------------------------- the test
@pytest.mark.parametrize("name", [pytest.param(n, marks=wrong(XFAIL[n]) if n in XFAIL else ()) for n in CASES])
def test_loop_recipe_healthy(name, tmp_path):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, with the oracle
    if DEBUG:
        rec = ru.c.rec
        print(name, "steps", rec.n, "skipped", rec.skipped, "scales", sorted(set(map(str, rec.scales))), "loss",
              [round(v, 4) for v in ru.losses[::max(1, len(ru.losses) // 8)]], ru.losses[-1], ru.c.extra.get("stop"),
              ru.c.extra.get("restores"))
    healthy(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)
    judge(rw)
