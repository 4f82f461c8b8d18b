"""BAD DATA OR A BAD MODEL? Does ampdoctor tell a batch that already holds inf/NaN (a corrupt record, a log(0) or a
0/0 in the data pipeline) from a model that makes inf/NaN out of finite inputs, in realistic pipelines? Tiny models,
CPU, fp16 autocast + GradScaler("cpu"), probe_harness.probe_run (AdamW, unscale_ + clip, the default watch with a
run_dir), 8 steps, the trigger at step K = 5.

How CONTRACT.md decides: `overflow` / `nan_origin` name "a module (op) that turned finite inputs into ±inf" / "that
produced NaN where its inputs had none". A batch that already held inf/NaN has no such module: the data answer is
`nan_origin` (`overflow` for ±inf only) with module None at step K (ampdoctor's rules/outside.bad_data: "The batch of
step K already held ..."; for a target the loss-operand answer, whose message names the target, as test_bad_data's
NaN-target case asks), and no overflow / nan_origin alarm may name a module that only received the values
(`data_named`). A batch that is finite but absurd (F4) is no bad-data case for the contract: the first module really
turns finite inputs into inf, so the answer is `overflow` at that module. An -inf mask that is data on every step
(F8) holds no NaN: the softmax that makes NaN of a fully masked row is the nan_origin producer.

Every failure is proven unwatched first by an oracle (probe_harness.Producer: the first module whose output is
non-finite from finite inputs - None for the data cases; `NanProducer` here, NaN from NaN-free inputs, where the
inputs hold -inf or +inf on purpose), the batch itself is checked, and the loss / skip pattern is asserted; a failing
oracle is a plain failure, a wrong report a strict xfail (`wrong`). Healthy twins (the bug fixed): quiet (no warning
or error, losses falling) and losses + final weights bitwise identical with and without the watch.

Cases (new here; test_bad_data has a NaN in a plain MLP's input, an inf keyword input, NaN inputs a model imputes, a
NaN target under MSE):
 F1  tabular regression, BatchNorm1d first, an empty CSV cell parsed as NaN in one sample    -> data (nan_origin).
 F2  log-transformed price target, a free item: log(0) = -inf in the target, MSE loss inf     -> data (the target).
 F3  speed = distance / duration target, a 0 duration: +inf target; Huber: the loss is inf but its gradient is
     bounded, so the scaler applies the step                                                  -> data (the target).
 F4  16-bit PNG frames through ToTensor (no / 255 for non-uint8), normalised: finite, ~2.9e5  -> overflow at stem.0.
 F5  SaliencyMix-like mixup, lambda = s1 / (s1 + s2) of two black frames = 0/0 = NaN: input and soft target NaN
                                                                                              -> data (nan_origin).
 F6  per-batch standardisation in the collate function, a stuck sensor (std 0): 0/0 NaN column -> data.
 F7  the same standardisation as an nn.Module inside the model                                -> nan_origin at norm.
 F8  additive -inf key mask passed as model input every step; an empty transcript at K (a row all -inf): softmax
     NaN inside attn                                                                          -> nan_origin at attn.
 F9  a corrupt record whose label was dropped (ignore_index) but whose NaN features were kept: the loss is finite,
     the NaN reaches the weight gradients (0 * NaN), the step is skipped                      -> data (nan_origin).
 F10 'days since last purchase' = inf for a new customer, in the second positional input; log1p and the first
     Linear pass ±inf on, the head makes inf - inf = NaN                                      -> data (overflow).
 H1-H10 the twins: the NaN cell imputed; log1p target; duration clamped; 8-bit frames; an epsilon in the lambda; a
     std floor (1e-3) inside the model; the -inf mask without an empty row; ignored rows zero-filled; the sentinel
     clamped in the model (F6 has no twin of its own: H7 is its fix moved into the model).

Result when written (torch 2.13 CPU, default watch): 17 pass, 2 xfail, stable over two runs, ~4 s; F2 and F3
fixed since (19 pass).
 F1, F5, F6, F9: PASS "[error] nan_origin at (run) step 5: The batch of step 5 already held N NaN (model input
   argument 0, ...)"; F10 PASS the same as overflow ("already held 1 +inf (model input argument 1 ...)").
 F4 PASS "[error] overflow at stem.0 aten::_to_copy step 5: aten::_to_copy in `stem.0` produced +inf from finite
   inputs" (the autocast cast of 2.9e5 to fp16).
 F7 PASS "[error] nan_origin at norm aten::div step 5"; F8 PASS "[error] nan_origin at attn aten::_softmax step 5".
 F2, F3 XFAIL when written (wrong answer; fixed since: rules/lossorigin._inf_from_operand, an inf loss whose ops ran
   in fp32 and make no inf from finite values names the target or a loss weight, with a data fix): "[error] overflow at (run) step 5: The loss became inf outside the watched model (in
   the loss computation) while the model's outputs were finite." with the fix "Compute the loss in fp32 ... sums of
   many fp16 values overflow" - but the loss already ran in fp32 on finite outputs (F.mse_loss / F.huber_loss make
   no inf from finite values of this size); the -inf / +inf was in the TARGET. For a NaN target the same rule says
   "an operand from outside the model - the target or a loss weight - held NaN/inf" (rules/lossorigin._nan_from_operand);
   the inf-loss branch has no such check, so the user is sent to the loss code, not to the data. Rule, module (None)
   and step are right; the message/fix blame the loss computation. (F3 is also the one case where training went on:
   the scaler did not skip, the weights stayed finite, only the logged loss is inf.)
 H1-H10 PASS: quiet, bitwise identical to the unwatched run.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import WrongAnswer, finite, named_top3, probe_run, quiet_twin
from scenarios import gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

K, STEPS = 5, 8
ALARM = ("warning", "error")
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# checks
# ======================================================================================================================
def real_data(r, bad_loss=True, skipped=True):
    """The oracle: no module made inf/NaN from finite inputs in the whole run (the batch brought them); before K
    only the scaler's opening backoffs; (`bad_loss`) the loss is first non-finite at K; (`skipped`) K is skipped."""
    assert r["first"] is None, r["first"]
    assert all(s < 3 for s in r["skipped"] if s < K), r["skipped"]
    if bad_loss:
        assert r["bad_loss"][:1] == [K], r["losses"]
    else:
        assert r["bad_loss"] == [], r["losses"]
    assert (K in r["skipped"]) == skipped, r["skipped"]


def data_named(rep, step=K):
    """The bad-data answer: overflow / nan_origin with no module (the batch, not a layer) at `step` among the first
    three findings, warning or error, its message pointing at the data (the batch, or the target: as
    test_bad_data's NaN-target case asks); and no overflow / nan_origin alarm names any module (every module only
    received the batch's values). Else WrongAnswer."""
    f = next((f for f in rep.findings[:3] if f.rule in FWD and f.module is None and f.step == step
              and f.severity in ALARM), None)
    blamed = [g.one_line() for g in rep.findings if g.rule in FWD and g.severity in ALARM and g.module is not None]
    if f is None or blamed or not any(w in f.message for w in ("batch", "target")):
        raise WrongAnswer(f"wanted the data (module None) at step {step}, no module blamed; blamed: {blamed}; "
                          f"top 3: {lines(rep)[:3]}")
    return f


def twin(make, batch, loss_fn, tmp_path, lr=1e-2):
    """A healthy twin: quiet under the watch (probe_harness.quiet_twin), and its losses and final weights bitwise
    identical to the same run without the watch."""
    r = probe_run(make(), batch, loss_fn, STEPS, str(tmp_path / "run"), lr=lr)
    quiet_twin(r)
    u = probe_run(make(), batch, loss_fn, STEPS, None, lr=lr, watch=False)
    assert r["losses"] == u["losses"], (r["losses"], u["losses"])
    assert all(torch.equal(r["weights"][k], u["weights"][k]) for k in u["weights"])
    return r


def run(make, batch, loss_fn, tmp_path, lr=1e-2, oracle=None):
    kw = {} if oracle is None else {"oracle": oracle}
    return probe_run(make(), batch, loss_fn, STEPS, str(tmp_path / "run"), lr=lr, **kw)


def mse(out, y):
    return F.mse_loss(out.float(), y)


def huber(out, y):
    return F.huber_loss(out.float(), y)


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def soft_ce(out, y):
    return -(y * F.log_softmax(out.float(), -1)).sum(-1).mean()


# ======================================================================================================================
# tabular regression: BatchNorm first (F1), log target (F2), speed target with Huber (F3)
# ======================================================================================================================
NF = 6
TW = torch.randn(NF, 1, generator=gen(7))
FSCALE = torch.tensor([1.0, 10.0, 50.0, 0.1, 3.0, 100.0])     # raw feature units (age, income/1000, ...)


class Tabular(nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm1d(NF) if bn else nn.Identity()
        self.body = nn.Sequential(nn.Linear(NF, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(self.bn(x)))


def tab_x(i):
    return torch.randn(32, NF, generator=gen(100 + i % 4))


def bn_batch(fixed):
    def batch(i):
        z = tab_x(i)
        x = z * FSCALE
        if i == K:
            x[3, 2] = float("nan")                           # an empty CSV cell parsed as NaN
        if fixed:                                            # the pipeline imputes missing cells (column mean)
            miss = torch.isnan(x)
            x = torch.where(miss, torch.nanmean(x, 0, keepdim=True), x)
        return (x,), z @ TW
    return batch


def log_batch(fixed):
    def batch(i):
        x = tab_x(i)
        price = (x @ TW).exp().squeeze(-1) * 20.0            # a positive amount
        if i == K:
            price[6] = 0.0                                   # a free item
        y = torch.log1p(price) if fixed else torch.log(price)
        return (x,), y[:, None]
    return batch


def speed_batch(fixed):
    def batch(i):
        x = tab_x(i)
        dist = F.softplus(x @ TW) * 3.0
        dur = 1.0 + x[:, :1].abs()
        if i == K:
            dur[4] = 0.0                                     # a trip whose end time was logged as its start
        y = dist / (dur.clamp_min(0.5) if fixed else dur)    # target: average speed
        return (x,), y
    return batch


def test_f1_tabular_nan_cell_through_a_batchnorm_is_the_data(tmp_path):
    b = bn_batch(False)
    assert not finite(b(K)[0]) and all(finite(b(i)[0]) for i in range(K))
    r = run(lambda: Tabular(bn=True), b, mse, tmp_path)
    real_data(r)
    data_named(r["rep"])


def test_h1_tabular_nan_cell_imputed_is_quiet(tmp_path):
    twin(lambda: Tabular(bn=True), bn_batch(True), mse, tmp_path)


def test_f2_log_target_of_a_zero_price_is_the_data(tmp_path):
    b = log_batch(False)
    (x,), y = b(K)
    assert finite(x) and y[6, 0] == -math.inf
    r = run(Tabular, b, mse, tmp_path)
    real_data(r)
    assert r["losses"][K] == math.inf
    data_named(r["rep"])


def test_h2_log1p_target_is_quiet(tmp_path):
    twin(Tabular, log_batch(True), mse, tmp_path)


def test_f3_inf_speed_target_under_huber_inf_loss_finite_gradients(tmp_path):
    b = speed_batch(False)
    (x,), y = b(K)
    assert finite(x) and y[4, 0] == math.inf
    r = run(Tabular, b, huber, tmp_path)
    real_data(r, skipped=False)                              # Huber's gradient is bounded: the step is applied
    assert r["losses"][K] == math.inf
    data_named(r["rep"])


def test_h3_speed_target_with_a_clamped_duration_is_quiet(tmp_path):
    twin(Tabular, speed_batch(True), huber, tmp_path)


# ======================================================================================================================
# images: 16-bit frames through ToTensor (F4), saliency-mix lambda of two black frames (F5)
# ======================================================================================================================
MEAN, STD = 0.45, 0.225


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.pool(self.block(self.stem(x))).flatten(1))


def frames(i, n=8):
    """uint8 frames whose label is the brightest channel."""
    g = gen(300 + i % 4)
    base = torch.randint(0, 120, (n, 3, 1, 1), generator=g)
    lab = torch.randint(0, 3, (n,), generator=g)
    base[torch.arange(n), lab] += 120
    img = (base + torch.randint(0, 16, (n, 3, 16, 16), generator=g)).to(torch.uint8)
    return img, lab


def to_tensor(img):
    """torchvision's ToTensor: divides by 255 for uint8 only (an `I;16` PNG comes out as 0..65535)."""
    return img.float().div(255) if img.dtype == torch.uint8 else img.float()


def image_batch(fixed):
    def batch(i):
        img, lab = frames(i)
        if i == K and not fixed:
            img = img.to(torch.int32) * 257                  # 16-bit PNGs: 0..65535, not scaled by ToTensor
        x = to_tensor(img) if not fixed or i != K else img.float() / 255
        return ((x - MEAN) / STD,), lab
    return batch


def test_f4_sixteen_bit_frames_overflow_the_stem_conv_not_bad_data(tmp_path):
    """The batch is finite (max ~2.9e5, past fp16's 65504): no inf/NaN in the data, so not the bad-data answer;
    the stem conv (its autocast cast to fp16) turns finite inputs into inf: CONTRACT.md's `overflow` at it."""
    b = image_batch(False)
    (x,), _ = b(K)
    assert finite(x) and x.abs().max() > 65504 * 2
    r = run(SmallCNN, b, ce, tmp_path)
    assert r["first"] == ("stem.0", K), r["first"]
    assert r["bad_loss"][:1] == [K] and K in r["skipped"], r
    named_top3(r["rep"], FWD, "stem.0", K)


def test_h4_eight_bit_frames_are_quiet(tmp_path):
    twin(SmallCNN, image_batch(True), ce, tmp_path)


def mix_batch(fixed):
    """SaliencyMix-like mixup: lambda is the first frame's share of the pair's saliency mass (its energy)."""
    def batch(i):
        img, lab = frames(i)
        img2, lab2 = frames(i + 1)
        x1, x2 = img.float() / 255, img2.float() / 255
        if i == K:
            x1[2].zero_()
            x2[2].zero_()                                    # two black (padding) frames paired
        s1, s2 = x1.sum((1, 2, 3)), x2.sum((1, 2, 3))
        lam = (s1 + 1e-3) / (s1 + s2 + 2e-3) if fixed else s1 / (s1 + s2)
        lam = lam[:, None]
        x = lam[:, :, None, None] * x1 + (1 - lam[:, :, None, None]) * x2
        y = lam * F.one_hot(lab, 3) + (1 - lam) * F.one_hot(lab2, 3)
        return ((x - MEAN) / STD,), y
    return batch


def test_f5_saliency_mix_lambda_of_two_black_frames_is_nan_data(tmp_path):
    b = mix_batch(False)
    (x,), y = b(K)
    assert torch.isnan(x[2]).all() and torch.isnan(y[2]).all() and finite(b(K - 1))
    r = run(SmallCNN, b, soft_ce, tmp_path)
    real_data(r)
    data_named(r["rep"])


def test_h5_saliency_mix_with_an_epsilon_is_quiet(tmp_path):
    twin(SmallCNN, mix_batch(True), soft_ce, tmp_path)


# ======================================================================================================================
# per-batch standardisation with a zero std: in the collate function (F6) vs an nn.Module (F7)
# ======================================================================================================================
class BatchStd(nn.Module):
    """(x - mean) / std over the batch (per feature), `eps` a floor for std."""

    def __init__(self, eps=None):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        sd = x.std(0, keepdim=True)
        return (x - x.mean(0, keepdim=True)) / (sd if self.eps is None else sd.clamp_min(self.eps))


class Sensor(nn.Module):
    def __init__(self, in_model=False, eps=None):
        super().__init__()
        torch.manual_seed(0)
        self.norm = BatchStd(eps) if in_model else nn.Identity()
        self.body = nn.Sequential(nn.Linear(NF, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(self.norm(x)))


def sensor_batch(normalise):
    def batch(i):
        z = tab_x(i)
        x = z * FSCALE + 5.0
        if i == K:
            x[:, 1] = 42.0                                   # a stuck sensor: one feature constant over the batch
        if normalise:                                        # the collate function standardises per batch
            x = (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)
        return (x,), z @ TW
    return batch


def test_f6_batch_std_of_zero_in_the_collate_function_is_the_data(tmp_path):
    b = sensor_batch(True)
    assert torch.isnan(b(K)[0][0][:, 1]).all() and finite(b(K - 1))
    r = run(Sensor, b, mse, tmp_path)
    real_data(r)
    data_named(r["rep"])


def test_f7_the_same_batch_std_inside_the_model_is_nan_origin_at_the_module(tmp_path):
    b = sensor_batch(False)
    assert finite(b(K))
    r = run(lambda: Sensor(in_model=True), b, mse, tmp_path)
    assert r["first"] == ("norm", K), r["first"]
    assert r["bad_loss"][:1] == [K] and K in r["skipped"], r
    named_top3(r["rep"], "nan_origin", "norm", K)


def test_h7_batch_std_with_a_floor_inside_the_model_is_quiet(tmp_path):
    twin(lambda: Sensor(in_model=True, eps=1e-3), sensor_batch(False), mse, tmp_path)


# ======================================================================================================================
# an additive -inf key mask passed as data (F8), a NaN in a sample the loss ignores (F9)
# ======================================================================================================================
V, T, D = 32, 8, 16


def has_nan(x):
    if torch.is_tensor(x):
        return x.is_floating_point() and bool(torch.isnan(x).any())
    if isinstance(x, (tuple, list)):
        return any(has_nan(t) for t in x)
    if isinstance(x, dict):
        return any(has_nan(t) for t in x.values())
    return False


class NanProducer:
    """Forward hooks: the first (module, step) whose output holds NaN while its inputs (positional and keyword) and
    its own parameters hold none (±inf allowed: CONTRACT.md's nan_origin)."""

    def __init__(self, m):
        self.step, self.first, self.calls, self.hs = 0, None, {}, []
        for n, mod in m.named_modules():
            self.hs.append(mod.register_forward_hook(self._fwd(n), with_kwargs=True))

    def _fwd(self, n):
        def f(mod, args, kwargs, out):
            if self.first is None and not has_nan(args) and not has_nan(kwargs) and has_nan(out) \
                    and not any(torch.isnan(p).any() for p in mod.parameters(recurse=False)):
                self.first = (n, self.step)
        return f

    def remove(self):
        for h in self.hs:
            h.remove()


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, h, mask):
        q, k, v = self.qkv(h).chunk(3, -1)
        s = q @ k.transpose(1, 2) / math.sqrt(D) + mask[:, None, :]
        return s.softmax(-1) @ v


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.attn = Attn()
        self.head = nn.Linear(D, 2)

    def forward(self, ids, mask):
        return self.head((self.emb(ids) + self.attn(self.emb(ids), mask)).mean(1))


def mask_batch(empty):
    """Token ids, an additive key mask (0 / -inf: padding) passed as model input, label: token 1 present."""
    def batch(i):
        g = gen(500 + i % 4)
        ids = torch.randint(2, V, (8, T), generator=g)
        ln = torch.randint(2, T + 1, (8,), generator=g)
        y = torch.randint(0, 2, (8,), generator=g)
        ids[y == 1, 0] = 1
        if i == K and empty:
            ln[3] = 0                                        # an empty transcript: every key is padding
        pad = torch.arange(T)[None, :] >= ln[:, None]
        mask = torch.zeros(8, T).masked_fill(pad, -math.inf)
        return (ids, mask), y
    return batch


def test_f8_minus_inf_mask_as_data_fully_masked_row_is_nan_origin_in_attention(tmp_path):
    """The -inf mask is data on every step (steps 0-4 were fine with it); at K the softmax over a row of -inf
    makes NaN inside `attn` from NaN-free inputs: CONTRACT.md's nan_origin at `attn`, not the batch."""
    b = mask_batch(True)
    assert not has_nan(b(K)) and (b(K)[0][1] == -math.inf).any() and (b(2)[0][1] == -math.inf).any()
    r = run(Tagger, b, ce, tmp_path, oracle=NanProducer)
    assert r["first"] == ("attn", K), r["first"]
    assert r["bad_loss"][:1] == [K] and K in r["skipped"], r
    named_top3(r["rep"], "nan_origin", "attn", K)


def test_h8_minus_inf_mask_as_data_without_an_empty_row_is_quiet(tmp_path):
    twin(Tagger, mask_batch(False), ce, tmp_path)


def ignored_batch(fixed):
    """Classification; the record at row 6 of step K is corrupt: its label was dropped (ignore_index) but its
    features (one NaN) were kept; `fixed`: the collate function zero-fills the features of ignored rows."""
    def batch(i):
        x = tab_x(i)
        y = (x @ TW > 0).long().squeeze(-1)
        if i == K:
            x[6, 3] = float("nan")
            y[6] = -100
        if fixed:
            x = torch.where((y == -100)[:, None], torch.zeros_like(x), x)
        return (x,), y
    return batch


def ce2(out, y):
    return F.cross_entropy(torch.cat([-out.float(), out.float()], -1), y, ignore_index=-100)


def test_f9_nan_in_an_ignored_sample_finite_loss_nan_gradients_is_the_data(tmp_path):
    b = ignored_batch(False)
    assert not finite(b(K)[0])
    r = run(Tabular, b, ce2, tmp_path)
    real_data(r, bad_loss=False)                             # the loss ignores the row; its NaN reaches the grads
    data_named(r["rep"])


def test_h9_ignored_sample_zero_filled_is_quiet(tmp_path):
    twin(Tabular, ignored_batch(True), ce2, tmp_path)


# ======================================================================================================================
# an inf sentinel in the second input (F10): log1p and the first Linear pass it on, the head makes inf - inf = NaN
# ======================================================================================================================
class Recency(nn.Module):
    """log1p of 'days since the last purchase'; `cap`: clamp first (an inf sentinel means 'never')."""

    def __init__(self, cap=None):
        super().__init__()
        self.cap = cap

    def forward(self, d):
        return torch.log1p(d if self.cap is None else d.clamp(max=self.cap))


class Customer(nn.Module):
    def __init__(self, cap=None):
        super().__init__()
        torch.manual_seed(0)
        self.seg = nn.Embedding(8, 4)
        self.rec = Recency(cap)
        self.body = nn.Sequential(nn.Linear(4 + 2, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, segment, days):
        return self.head(self.body(torch.cat([self.seg(segment), self.rec(days)], -1)))


def customer_batch(i):
    g = gen(700 + i % 4)
    seg = torch.randint(0, 8, (32,), generator=g)
    days = torch.rand(32, 2, generator=g) * 300
    if i == K:
        days[9, 0] = math.inf                                # a new customer: 'never purchased' coded as inf
    y = (seg.float()[:, None] - 3.5) / 2 + torch.log1p(days.clamp(max=365)).mean(-1, keepdim=True) - 4.5
    return (seg, days), y


def test_f10_inf_sentinel_in_the_second_input_made_nan_downstream_is_the_data(tmp_path):
    (seg, days), _ = customer_batch(K)
    assert days[9, 0] == math.inf and not torch.isnan(days).any()
    r = run(Customer, customer_batch, mse, tmp_path, oracle=NanProducer)
    assert r["first"] == ("head", K), r["first"]             # body.0 passes +-inf on; head's inf - inf is NaN
    assert r["bad_loss"][:1] == [K] and K in r["skipped"], r
    data_named(r["rep"])


def test_h10_inf_sentinel_clamped_in_the_model_is_quiet(tmp_path):
    twin(lambda: Customer(cap=365.0), customer_batch, mse, tmp_path)
