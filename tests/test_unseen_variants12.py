"""Twelfth set of failure-pattern variants, watched through the public API only (watch -> an ordinary autocast +
GradScaler loop on the CPU -> w.report()) at ampdoctor's default settings, with the failure starting mid-run (never
at step 0) and neighbours on both sides of the producer. The emphasis is producer attribution: GeM pooling's
x.clamp(eps).pow(3) written functionally in a retrieval head's forward, overflowing on a raw 0-255 frame (the head,
not the backbone or head.whiten); an mmdet-style FPN whose top-down sum of two finite laterals (~5e4 each) is past
65504 in the FPN's own forward (not the laterals, not the output convs); a Conv1d STFT front end whose fp16 power
re*re + im*im of a clipped full-scale beep is inf and passes through log, LayerNorm, Dropout and Linear to the loss
(the front end, not those); a stereo matcher's shared feature extractor that overflows only on its second call, for
a raw 16-bit right frame; a custom autograd.Function softplus with a stable forward and the textbook backward
exp(x) / (1 + exp(x)) = inf / inf (backward-only NaN); a neural temporal point process whose fp16 event times of
day-long sessions round consecutive events together, log(0) = -inf in the time encoder every step from step 5 and a
collapsed loss scale; a GradScaler stuck at 1.0 whose head gradient turns subnormal when a batch-size ramp (8 ->
4096) divides the mean loss's gradient (silent underflow); a pure-fp16 model (model.half(), plain SGD, no scaler)
whose accumulation over 64 micro-batches makes the gradient below the head subnormal; a bf16 run keeping an
fp16-only fused dense-ReLU-dense Function (`custom_fwd(cast_inputs=torch.float16)`) that turns ~1e5 bf16 embeddings
into inf; a Lorentz-model exp map cosh(|v|) in the encoder's forward overflowing on a hub node's raw degrees; a
custom "safe log" Function in the criterion whose backward g / p is inf where fp16 flushed a mislabelled sample's
probability to 0; NT-Xent with a learnable raw temperature and a hand-written exp(sim / t) that overflows once t
falls below ~0.09 (natural onset, step 11), after which the frozen t overflows every step and the scale collapses.
Healthy twins (no warning, no error): GeM pooled in fp32 on the same batches (raw frame included), the STFT power in
fp32 (beep included), the softplus Function with the sigmoid backward (outlier included), NT-Xent as cross_entropy
with the temperature clamped at 0.05.

Each failure is first checked to be real in the loop itself (the loss, the scaler's skipped steps and scale, forward
hooks naming the first module, and its call, whose output is non-finite from finite inputs; backward hooks for the
backward-only failures; the subnormal share of the gradient flowing into each leaf module for the underflows); then
the right rule at the producing module among the first three findings, at the right step. Where ampdoctor is wrong
the test is a strict xfail whose reason says what it reported instead.

ampdoctor got wrong:
- the custom softplus Function's backward NaN at `act`, step 4: only `[info] skipped_steps at (run) step 4` (found
  with every=1, missed at the default sampling). Fixed since: a skip at a scale that already worked is replayed, and
  a capture keeps the gradient that reached the model's outputs, so the replay runs the step's own backward
  without the user's loss function;
- the GradScaler stuck at 1.0 with the head's gradient 94% subnormal from step 5: an empty report (every=1 too).
  Fixed since: the batch-size ramp (8x the input values of any batch before) makes step 5 sampled;
- the pure-fp16 model's underflow at body.3 from step 4: only `[warning] fp16_master_weights at (root) step 0`
  (found with every=1, missed at the default sampling).
"""
import math
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, in_top3, lines, no_error_at, one_thread, randn
from probe_harness import Producer, at_top3 as at, healthy as _healthy


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


healthy = partial(_healthy, bwd=False)  # the oracle's backward producer is not checked


def train_loop(m, batch, loss_fn, steps, *, opt=None, lr=1e-3, scaler=True, init_scale=1024.0, dtype=torch.float16,
               autocast=True, clip=1.0, call=None, backward=False, accum=None, scaler_kw=None):
    """zero_grad -> forward under autocast(dtype) -> (scale(loss)).backward -> (unscale_) -> clip -> step -> (update).
    `batch(i)` gives iteration i's args; `accum(i)` micro-batches per step (each loss divided by it). Returns a dict:
    w (closed watch), first (producer, step, call) from forward hooks, first_bwd (with `backward=True`), skipped
    (steps whose scale went down), bad_loss (steps with a non-finite loss), losses, scales."""
    opt = opt or torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, **(scaler_kw or {})) if scaler else None
    prod = Producer(m, backward=backward, own_params=False, leaf_backward=True, call_in_first=True)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    call = call or m
    skipped, bad_loss, losses, scales = [], [], [], []
    for step in range(steps):
        prod.step = step
        opt.zero_grad(set_to_none=False)
        n = accum(step) if accum else 1
        total = 0.0
        for _ in range(n):
            args = batch(step)
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                loss = loss_fn(call(*args), *args) / n
            total += loss.item()
            (sc.scale(loss) if sc else loss).backward()
        losses.append(total)
        if not math.isfinite(total):
            bad_loss.append(step)
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        if sc:
            before = sc.get_scale()
            sc.step(opt)
            sc.update()
            if sc.get_scale() < before:
                skipped.append(step)
            scales.append(sc.get_scale())
        else:
            opt.step()
    w.close()
    prod.remove()
    return dict(w=w, first=prod.first, first_bwd=prod.first_bwd, skipped=skipped, bad_loss=bad_loss, losses=losses,
                scales=scales)


# ======================================================================================================================
# 1. GeM pooling (image retrieval) written functionally in the head's forward: x.clamp(eps).pow(3) in fp16; a raw,
#    unnormalised 0-255 frame at step 4 gives backbone features ~1e3 (finite) whose cube is past 65504
# ======================================================================================================================
class GeMHead(nn.Module):
    def __init__(self, c=32, d=16, p=3.0, fp32=False):
        super().__init__()
        self.whiten, self.p, self.fp32 = nn.Linear(c, d), p, fp32

    def forward(self, f):
        if self.fp32:
            with torch.autocast("cpu", enabled=False):
                g = F.avg_pool2d(f.float().clamp(min=1e-6).pow(self.p), f.shape[-2:]).pow(1.0 / self.p)
        else:
            g = F.avg_pool2d(f.clamp(min=1e-6).pow(self.p), f.shape[-2:]).pow(1.0 / self.p)
        return self.whiten(g.flatten(1))


class Retriever(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                      nn.ReLU())
        nn.init.constant_(self.backbone[2].bias, 0.5)  # as trained: every channel fires somewhere on every image
        self.head = GeMHead(fp32=fp32)

    def forward(self, x):
        return F.normalize(self.head(self.backbone(x)), dim=-1)


_PROTOS = F.normalize(randn(4, 16, seed=77), dim=-1)


def _retrieval_images(i):
    g = torch.Generator().manual_seed(i)
    y = torch.randint(0, 4, (8,), generator=g)
    x = torch.randn(8, 3, 12, 12, generator=g) * 0.5 + y[:, None, None, None] * 0.25
    if i == 4:
        x[3] = torch.rand(3, 12, 12, generator=g) * 255  # a frame that skipped Normalize (raw 0-255)
    return x, y


def _retrieval_loss(z, x, y):
    return (1 - (z.float() * _PROTOS[y]).sum(-1)).mean()


def test_gem_pooling_cube_in_the_heads_functional_forward_overflows_in_the_head_on_a_raw_frame():
    torch.manual_seed(0)
    m = Retriever()
    r = train_loop(m, _retrieval_images, _retrieval_loss, 8, call=lambda x, y: m(x))
    assert r["first"] == ("head", 4, 1) and r["bad_loss"] == [4] and r["skipped"] == [4], r  # real
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        f = m.backbone(_retrieval_images(4)[0])
        assert torch.isfinite(f).all() and not torch.isfinite(f.pow(3)).all()  # finite features, inf cube
    rep = r["w"].report()
    at(rep, ("overflow",), "head", step=4, phase="forward")
    no_error_at(rep, ("backbone", "backbone.2", "backbone.3", "head.whiten", ""))


def test_healthy_twin_gem_pooling_taken_in_fp32_on_the_same_batches_is_quiet():
    torch.manual_seed(0)
    m = Retriever(fp32=True)
    healthy(train_loop(m, _retrieval_images, _retrieval_loss, 24, lr=3e-3, call=lambda x, y: m(x)))


# ======================================================================================================================
# 2. an mmdet-style FPN (laterals first, then the top-down path, then the output convs) over a backbone whose deep
#    stages amplify: a raw 16-bit frame at step 4 gives laterals ~5e4 (finite); their top-down sum is past 65504, in
#    the FPN's own forward; the output convs only pass the inf on
# ======================================================================================================================
class FPN(nn.Module):
    def __init__(self, chs=(16, 32, 64), d=32):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, d, 1) for c in chs)
        self.fpn_convs = nn.ModuleList(nn.Conv2d(d, d, 3, padding=1) for _ in chs)

    def forward(self, feats):
        lat = [conv(f) for conv, f in zip(self.lateral, feats)]
        for i in range(len(lat) - 1, 0, -1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], size=lat[i - 1].shape[-2:], mode="nearest")
        return [conv(p) for conv, p in zip(self.fpn_convs, lat)]


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU())
        self.stage2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.stage3 = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU())
        self.fpn = FPN()
        self.head = nn.Conv2d(32, 5, 1)
        with torch.no_grad():  # as pretrained without normalisation: the deeper stages and the laterals amplify
            for conv in (self.stage2[0], self.stage3[0], *self.fpn.lateral):
                conv.weight.mul_(3.0)

    def forward(self, x):
        c1 = self.stem(x)
        c2 = self.stage2(c1)
        return [self.head(p) for p in self.fpn([c1, c2, self.stage3(c2)])]


def _det_batch(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, 3, 32, 32, generator=g)
    if i == 4:
        x[1] = x[1].abs() * 16000.0  # a raw 16-bit frame (0..65535), not normalised
    return (x,)


def _det_loss(outs, x):
    return sum(o.float().pow(2).mean() for o in outs) / len(outs)


def test_fpn_top_down_sum_of_two_finite_laterals_overflows_in_the_fpn_not_its_convs():
    torch.manual_seed(0)
    m = Detector()
    r = train_loop(m, _det_batch, _det_loss, 7, lr=1e-4)
    assert r["first"] == ("fpn", 4, 1) and r["bad_loss"] == [4] and r["skipped"] == [4], r  # real
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        c1 = m.stem(_det_batch(4)[0])
        c2 = m.stage2(c1)
        lat = [conv(f) for conv, f in zip(m.fpn.lateral, [c1, c2, m.stage3(c2)])]
        s2 = lat[1] + F.interpolate(lat[2], size=lat[1].shape[-2:])
        s1 = lat[0] + F.interpolate(s2, size=lat[0].shape[-2:])
        assert all(torch.isfinite(t).all() for t in lat + [s2]) and not torch.isfinite(s1).all()  # finite + finite
        assert torch.isfinite(m.fpn.fpn_convs[1](s2)).all() and torch.isfinite(m.fpn.fpn_convs[2](lat[2])).all()
    rep = r["w"].report()
    at(rep, ("overflow",), "fpn", step=4, phase="forward")
    no_error_at(rep, ("fpn.lateral.0", "fpn.lateral.1", "fpn.fpn_convs.0", "stage3", "head", ""))


# ======================================================================================================================
# 3. a Conv1d STFT front end (fixed DFT kernels, as in ONNX-exportable speech models) whose power re*re + im*im is
#    taken in fp16: a full-scale, clipped 1 kHz calibration beep at step 4 puts |X| ~ 330 (finite) and the power past
#    65504; log -> LayerNorm -> Dropout -> Linear carry it to the loss: the producer is the front end
# ======================================================================================================================
class ConvSTFT(nn.Module):
    def __init__(self, n_fft=1024, hop=256, fp32=False):
        super().__init__()
        n, k = torch.arange(n_fft).float(), torch.arange(n_fft // 2 + 1).float()
        win = torch.hann_window(n_fft, periodic=True)
        ang = 2 * math.pi * k[:, None] * n[None] / n_fft
        self.conv = nn.Conv1d(1, 2 * len(k), n_fft, stride=hop, bias=False)
        self.conv.weight.data.copy_(torch.cat([torch.cos(ang) * win, -torch.sin(ang) * win])[:, None])
        self.conv.weight.requires_grad_(False)
        self.fp32 = fp32

    def forward(self, wav):
        re, im = self.conv(wav[:, None]).chunk(2, dim=1)
        if self.fp32:
            re, im = re.float(), im.float()
        return torch.log(re * re + im * im + 1e-4)  # [B, F, frames]


class AudioTagger(nn.Module):
    def __init__(self, fp32=False, n_classes=4):
        super().__init__()
        self.frontend = ConvSTFT(fp32=fp32)
        self.norm, self.drop = nn.LayerNorm(513), nn.Dropout(0.1)
        self.proj, self.act = nn.Linear(513, 64), nn.ReLU()
        self.classifier = nn.Linear(64, n_classes)

    def forward(self, wav):
        h = self.act(self.proj(self.drop(self.norm(self.frontend(wav).transpose(1, 2)))))
        return self.classifier(h.mean(1))


def _clips(i):
    g = torch.Generator().manual_seed(i)
    y = torch.randint(0, 4, (4,), generator=g)
    t = torch.arange(6400) / 16000
    freq = torch.tensor([300.0, 700.0, 1500.0, 3000.0])[y]
    wav = 0.3 * torch.sin(2 * math.pi * freq[:, None] * t) + 0.05 * torch.randn(4, 6400, generator=g)
    if i == 4:
        wav[2] = torch.sign(torch.sin(2 * math.pi * 1000.0 * t))  # a clipped full-scale beep
    return wav, y


def _tag_loss(o, wav, y):
    return F.cross_entropy(o.float(), y)


def test_conv_stft_power_of_a_full_scale_beep_overflows_in_the_front_end_not_the_norm_dropout_or_linear():
    torch.manual_seed(0)
    m = AudioTagger()
    r = train_loop(m, _clips, _tag_loss, 7, call=lambda wav, y: m(wav))
    assert r["first"] == ("frontend", 4, 1) and r["bad_loss"] == [4] and r["skipped"] == [4], r  # real
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        spec = m.frontend.conv(_clips(4)[0][:, None])
        assert torch.isfinite(spec).all() and not torch.isfinite(spec * spec).all()
    rep = r["w"].report()
    at(rep, ("overflow",), "frontend", step=4, phase="forward")
    no_error_at(rep, ("frontend.conv", "norm", "drop", "proj", "classifier", ""))


def test_healthy_twin_conv_stft_power_taken_in_fp32_is_quiet():
    torch.manual_seed(0)
    m = AudioTagger(fp32=True)
    healthy(train_loop(m, _clips, _tag_loss, 16, lr=3e-3, call=lambda wav, y: m(wav)))


# ======================================================================================================================
# 4. a stereo matcher whose feature extractor is shared by the left and right images (called twice a step): at step
#    4 the right camera's frame arrives as raw 16-bit sensor counts; only the second call's first conv overflows
# ======================================================================================================================
class StereoNet(nn.Module):
    def __init__(self, D=4):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                      nn.ReLU())
        self.aggregate = nn.Sequential(nn.Conv2d(D, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, D, 3, padding=1))
        self.D = D

    def forward(self, left, right):
        fl, fr = self.features(left), self.features(right)
        cost = torch.stack([(fl * torch.roll(fr, d, dims=-1)).mean(1) for d in range(self.D)], 1)
        prob = torch.softmax(self.aggregate(cost), 1)
        return (prob * torch.arange(self.D, device=prob.device)[:, None, None]).sum(1)


def _stereo(i):
    g = torch.Generator().manual_seed(i)
    left = torch.randn(4, 3, 16, 24, generator=g)
    disp = torch.randint(0, 4, (4, 16, 24), generator=g).float()
    right = left + 0.1 * torch.randn(4, 3, 16, 24, generator=g)
    if i == 4:
        right[0] = torch.rand(3, 16, 24, generator=g) * 60000.0  # raw 16-bit counts, no normalisation
    return left, right, disp


def test_shared_feature_extractor_overflows_only_on_its_second_call_for_the_right_image():
    torch.manual_seed(0)
    m = StereoNet()
    r = train_loop(m, _stereo, lambda o, l, rr, d: F.smooth_l1_loss(o.float(), d), 7,
                   call=lambda l, rr, d: m(l, rr))
    assert r["first"] == ("features.0", 4, 2) and r["bad_loss"] == [4] and r["skipped"] == [4], r  # real: 2nd call
    rep = r["w"].report()
    f = at(rep, ("overflow",), "features.0", step=4, phase="forward")
    assert f.evidence.get("call") in (2, None), f.evidence
    no_error_at(rep, ("features", "features.2", "aggregate", "aggregate.0", ""))


# ======================================================================================================================
# 5. a custom autograd.Function softplus with a stable forward (max(x,0) + log1p(exp(-|x|))) and the textbook
#    backward exp(x) / (1 + exp(x)): in fp16 exp(x) is inf past x = 11.1 and inf / inf is NaN; an outlier row at step
#    4 gives such pre-activations; the forward stays finite
# ======================================================================================================================
class _Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stable_grad):
        ctx.save_for_backward(x)
        ctx.stable_grad = stable_grad
        return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        if ctx.stable_grad:
            return g * torch.sigmoid(x), None
        e = torch.exp(x)
        return g * e / (1 + e), None


class FusedSoftplus(nn.Module):
    def __init__(self, stable_grad=False):
        super().__init__()
        self.stable_grad = stable_grad

    def forward(self, x):
        return _Softplus.apply(x, self.stable_grad)


class SoftplusMLP(nn.Module):
    def __init__(self, stable_grad=False):
        super().__init__()
        self.inp, self.act = nn.Linear(16, 64), FusedSoftplus(stable_grad)
        self.mid, self.act2 = nn.Linear(64, 64), nn.Tanh()
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(self.act2(self.mid(self.act(self.inp(x)))))


def _sp_batch(i):
    x = randn(64, 16, seed=i)
    y = x[:, :4].sum(1, keepdim=True).tanh()
    if i == 4:
        x[7] = x[7] * 40.0  # one mis-scaled row
    return x, y


def test_custom_function_softplus_with_the_textbook_backward_is_nan_in_its_backward_only():
    torch.manual_seed(0)
    m = SoftplusMLP()
    r = train_loop(m, _sp_batch, lambda o, x, y: F.mse_loss(o.float(), y), 7, backward=True,
                   call=lambda x, y: m(x))
    assert r["first"] is None and not r["bad_loss"] and r["skipped"] == [4], r  # real: the forward is finite
    assert r["first_bwd"] == ("act", 4), r
    rep = r["w"].report()
    at(rep, ("nan_origin", "overflow"), "act", step=4, phase="backward")
    no_error_at(rep, ("inp", "mid", "act2", "out", ""))


def test_healthy_twin_custom_softplus_with_the_sigmoid_backward_is_quiet():
    torch.manual_seed(0)
    m = SoftplusMLP(stable_grad=True)
    healthy(train_loop(m, _sp_batch, lambda o, x, y: F.mse_loss(o.float(), y), 20, lr=3e-3,
                       call=lambda x, y: m(x)))


# ======================================================================================================================
# 6. a neural temporal point process fed event times stored in fp16 (seconds since the session start): from step 5
#    on the loader serves day-long sessions, where fp16's spacing (4-16 s) rounds events 1-3 s apart onto the same
#    value: dt = 0, log(dt) = -inf in the time encoder, every step; the scaler skips every step and the scale collapses
# ======================================================================================================================
class TimeEncoder(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.proj = nn.Linear(1, d)

    def forward(self, t):
        dt = t[:, 1:] - t[:, :-1]
        return self.proj(torch.log(dt)[..., None])


class NeuralTPP(nn.Module):
    def __init__(self, n_types=6, d=16):
        super().__init__()
        self.type_emb = nn.Embedding(n_types, d)
        self.time_enc = TimeEncoder(d)
        self.encoder = nn.Sequential(nn.Linear(2 * d, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, n_types)

    def forward(self, types, t):
        h = torch.cat([self.type_emb(types[:, 1:-1]), self.time_enc(t[:, :-1])], -1)
        return self.head(self.encoder(h))


def _events(i):
    g = torch.Generator().manual_seed(i)
    types = torch.randint(0, 6, (16, 33), generator=g)
    gaps = 1.0 + 2.0 * torch.rand(16, 33, generator=g)
    start = torch.rand(16, 1, generator=g) * (200.0 if i < 5 else 30000.0)
    return types, (start + gaps.cumsum(1)).half()  # stored as fp16 to halve the event log's memory


def _tpp_loss(logits, types, t):
    return F.cross_entropy(logits.float().flatten(0, 1), types[:, 2:].flatten())


def test_fp16_event_times_of_long_sessions_give_log_of_zero_gaps_every_step_and_collapse_the_scale():
    torch.manual_seed(0)
    m = NeuralTPP()
    r = train_loop(m, _events, _tpp_loss, 20)
    assert r["first"] == ("time_enc", 5, 1) and r["bad_loss"] == list(range(5, 20)), r  # real, and persistent
    assert r["skipped"] == list(range(5, 20)) and r["scales"][-1] < 1024 * 2.0 ** -14, r
    assert (_events(2)[1].diff(dim=1) > 0).all() and (_events(5)[1].diff(dim=1) == 0).any()  # fp16 spacing
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin", "loss_scale_collapse"), "time_enc", step=5)
    assert "loss_scale_collapse" in [f.rule for f in rep.findings if f.severity == "error"], lines(rep)
    no_error_at(rep, ("time_enc.proj", "encoder", "encoder.0", "head", "type_emb", ""))


# ======================================================================================================================
# 7. a GradScaler stuck low (init_scale=1.0 "to avoid the first skipped steps"; growth_interval 2000) on a regression
#    of small targets (daily log-returns, ~0.05): at step 5 a batch-size ramp takes the batch from 16 to 1024, the
#    mean-reduced loss's gradient per output drops 64x, and the fp16 gradient into the head is subnormal
# ======================================================================================================================
class ReturnsMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.body(x))


def _returns(i):
    n = 8 if i < 5 else 4096
    x = randn(n, 16, seed=i)
    return x, 0.5 * torch.tanh(x[:, :4] + 0.5 * x[:, 4:8])



_TINY = torch.finfo(torch.float16).tiny


class GradShares:
    """Full backward hooks on the leaf modules: per (module, step) the largest share (over micro-batches) of the
    nonzero gradient values flowing into the module's output that are below fp16's smallest normal (2^-14)."""

    def __init__(self, m):
        self.step, self.share = 0, {}
        self.order = [n for n, mod in m.named_modules() if n and not list(mod.children())]  # forward order
        self.hs = [mod.register_full_backward_hook(self._hook(n)) for n, mod in m.named_modules() if n in self.order]

    def _hook(self, n):
        def f(mod, gin, gout):
            g = gout[0]
            nz = g[g != 0]
            s = (nz.abs() < _TINY).float().mean().item() if nz.numel() else 1.0
            self.share[(n, self.step)] = max(s, self.share.get((n, self.step), 0.0))
        return f

    def onset(self, level=0.5):
        """(module, step): the first step where some module's incoming gradient is mostly subnormal, and the first
        such module in backward order (where the underflow starts)."""
        for step in sorted({k[1] for k in self.share}):
            for n in reversed(self.order):
                if self.share.get((n, step), 0.0) > level:
                    return n, step
        return None

    def remove(self):
        for h in self.hs:
            h.remove()


def test_scaler_stuck_at_1_lets_the_heads_fp16_gradient_underflow_once_the_batch_ramps_up():
    torch.manual_seed(0)
    m = ReturnsMLP()
    gs = GradShares(m)

    def batch(i):
        gs.step = i
        return _returns(i)
    r = train_loop(m, batch, lambda o, x, y: F.mse_loss(o.float(), y), 8, init_scale=1.0,
                   call=lambda x, y: m(x))
    gs.remove()
    assert r["first"] is None and not r["skipped"] and set(r["scales"]) == {1.0}, r  # silent: no inf, no skip
    assert gs.onset() == ("head", 5) and all(gs.share[("body.0", k)] < 0.1 for k in range(5)), gs.share  # real
    assert all(gs.share[(n, k)] > 0.9 for n in gs.order for k in range(5, 8)), gs.share
    rep = r["w"].report()
    at(rep, ("underflow",), "head", step=5, phase="backward")


# ======================================================================================================================
# 8. a pure-fp16 model (model.half(), plain SGD with momentum, no scaler: GradScaler refuses fp16 gradients) whose
#    gradient accumulation goes from 1 to 64 micro-batches at step 4, each loss divided by 64: from then on the
#    gradient flowing back out of the head (into body.3) and everything below it is subnormal
# ======================================================================================================================
@pytest.mark.xfail(strict=True, reason="ampdoctor reports only `[warning] fp16_master_weights at (root) step 0`: no "
                   "underflow at body.3 (85% subnormal from step 4, body.0 99%); found only with every=1")
def test_pure_fp16_model_with_accumulation_over_64_micro_batches_underflows_below_the_head():
    torch.manual_seed(0)
    m = ReturnsMLP().half()
    gs = GradShares(m)

    def batch(i):
        gs.step = i
        x = randn(16, 16, seed=i)
        return x.half(), torch.tanh(x[:, :4] + 0.5 * x[:, 4:8])
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    r = train_loop(m, batch, lambda o, x, y: F.mse_loss(o.float(), y), 7, opt=opt, scaler=False, autocast=False,
                   accum=lambda i: 1 if i < 4 else 64, call=lambda x, y: m(x))
    gs.remove()
    assert r["first"] is None and not r["bad_loss"], r
    assert gs.onset() == ("body.3", 4) and all(gs.share[(n, k)] < 0.1 for n in gs.order for k in range(4)), gs.share
    rep = r["w"].report()
    at(rep, ("underflow",), "body.3", step=4, phase="backward")
    assert "fp16_master_weights" in [f.rule for f in rep.findings], lines(rep)


# ======================================================================================================================
# 9. a bf16 run with an fp16-only fused kernel: a dense-ReLU-dense autograd.Function written for fp16 AMP
#    (`custom_fwd(cast_inputs=torch.float16)`), kept when the run moved to bf16 autocast; a reading in the wrong
#    units (x1e5) at step 4 gives embeddings ~1e5, finite in bf16, which the kernel's fp16 cast turns into inf
# ======================================================================================================================
class _FusedDenseReluDense(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float16)
    def forward(ctx, x, w1, b1, w2, b2):
        h = F.linear(x, w1, b1)
        a = torch.relu(h)
        ctx.save_for_backward(x, w1, a, w2)
        return F.linear(a, w2, b2)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w1, a, w2 = ctx.saved_tensors
        g2, a2, x2 = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1]), x.reshape(-1, x.shape[-1])
        gh = (g2 @ w2) * (a2 > 0)
        return (gh @ w1).reshape(x.shape), gh.T @ x2, gh.sum(0), g2.T @ a2, g2.sum(0)


class FusedMLP(nn.Module):
    def __init__(self, d=64, hidden=256):
        super().__init__()
        fc1, fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.w1, self.b1 = nn.Parameter(fc1.weight.data), nn.Parameter(fc1.bias.data)
        self.w2, self.b2 = nn.Parameter(fc2.weight.data), nn.Parameter(fc2.bias.data)

    def forward(self, x):
        return _FusedDenseReluDense.apply(x, self.w1, self.b1, self.w2, self.b2)


class SensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.mlp = FusedMLP()
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.norm(h + self.mlp(h)))


def _sensors(i):
    x = randn(32, 16, seed=i)
    y = x[:, :3].sum(1, keepdim=True)
    if i == 4:
        x[11] = x[11] * 1e5  # one station reporting in mPa instead of hPa
    return x, y


def test_bf16_run_with_an_fp16_only_fused_mlp_overflows_inside_the_fused_kernel():
    torch.manual_seed(0)
    m = SensorNet()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # (after the run the weights are NaN)
        h = m.embed(_sensors(4)[0])
        assert torch.isfinite(h).all() and h.abs().max() > 65504  # fits bf16, not fp16
    r = train_loop(m, _sensors, lambda o, x, y: F.mse_loss(o.float(), y), 7, scaler=False, dtype=torch.bfloat16,
                   call=lambda x, y: m(x))
    assert r["first"] == ("mlp", 4, 1) and r["bad_loss"][:1] == [4], r  # real
    rep = r["w"].report()
    at(rep, ("overflow",), "mlp", step=4, phase="forward")
    no_error_at(rep, ("embed", "norm", "head", ""))


# ======================================================================================================================
# 10. a hyperbolic (Lorentz-model) classifier: the encoder maps a tangent vector onto the hyperboloid with
#     cosh(|v|), sinh(|v|) v/|v| in its own forward, in fp16 (cosh past 65504 for |v| > 11.8); a node whose degree
#     features were not log-scaled arrives at step 5: the producer is the encoder, not to_tangent, not the distance
# ======================================================================================================================
class LorentzEncoder(nn.Module):
    def __init__(self, d_in=32, d=8):
        super().__init__()
        self.to_tangent = nn.Linear(d_in, d)

    def forward(self, h):
        v = self.to_tangent(h)
        r = v.norm(dim=-1, keepdim=True).clamp(min=1e-3)
        return torch.cat([torch.cosh(r), torch.sinh(r) * v / r], -1)


class LorentzDistance(nn.Module):
    def __init__(self, n_classes=5, d=8):
        super().__init__()
        self.protos = nn.Parameter(0.5 * torch.randn(n_classes, d))

    def forward(self, x):
        r = self.protos.norm(dim=-1, keepdim=True)
        p = torch.cat([torch.cosh(r), torch.sinh(r) * self.protos / r], -1)
        inner = -x[:, :1] * p[:, 0] + x[:, 1:] @ p[:, 1:].T
        return -torch.acosh((-inner).clamp(min=1 + 1e-3))


class HyperbolicClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.encoder = LorentzEncoder()
        self.distance = LorentzDistance()

    def forward(self, x):
        return self.distance(self.encoder(self.features(x)))


def _nodes(i):
    g = torch.Generator().manual_seed(i)
    y = torch.randint(0, 5, (32,), generator=g)
    x = torch.randn(32, 12, generator=g) + y[:, None] * 0.2
    if i == 5:
        x[4, :3] = torch.tensor([3200.0, 850.0, 1200.0])  # raw in/out/total degree of a hub
    return x, y


def test_lorentz_exp_map_cosh_overflows_in_the_encoders_forward_on_a_hub_node():
    torch.manual_seed(0)
    m = HyperbolicClassifier()
    r = train_loop(m, _nodes, lambda o, x, y: F.cross_entropy(o.float(), y), 8, call=lambda x, y: m(x))
    assert r["first"] == ("encoder", 5, 1) and r["bad_loss"] == [5] and r["skipped"] == [5], r  # real
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        v = m.encoder.to_tangent(m.features(_nodes(5)[0]))
        assert torch.isfinite(v).all() and v.norm(dim=-1).max() > 12
    rep = r["w"].report()
    at(rep, ("overflow",), "encoder", step=5, phase="forward")
    no_error_at(rep, ("encoder.to_tangent", "features", "features.0", "distance", ""))


# ======================================================================================================================
# 11. a custom autograd.Function "safe log" in the criterion (NLL on the model's fp16 softmax probabilities): the
#     forward clamps p at 1e-4, the backward returns g / p unclamped; a confidently mislabelled sample at step 4 has
#     its target probability flushed to 0 in fp16 (a raw feature of 500): g / 0 = inf in the criterion's backward
# ======================================================================================================================
class _SafeLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p):
        ctx.save_for_backward(p)
        return torch.log(p.clamp(min=1e-4))

    @staticmethod
    def backward(ctx, g):
        p, = ctx.saved_tensors
        return g / p


class ProbNLL(nn.Module):
    def forward(self, p, y):
        return -_SafeLog.apply(p).gather(1, y[:, None]).mean()


class ProbClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.classifier = nn.Linear(64, 5)
        self.criterion = ProbNLL()

    def forward(self, x, y):
        return self.criterion(torch.softmax(self.classifier(self.features(x)), -1), y)


def _noisy_labels(i):
    g = torch.Generator().manual_seed(i)
    y = torch.randint(0, 5, (32,), generator=g)
    x = torch.randn(32, 16, generator=g) + F.one_hot(y, 16).float() * 2
    if i == 4:
        x[6], y[6] = F.one_hot(torch.tensor(1), 16).float() * 500, 3  # an extreme class-1 sample labelled 3
    return x, y


def test_custom_safe_log_with_an_unclamped_backward_is_inf_in_the_criterions_backward():
    torch.manual_seed(0)
    m = ProbClassifier()
    r = train_loop(m, _noisy_labels, lambda o, *a: o.float(), 7, backward=True)
    assert r["first"] is None and not r["bad_loss"] and r["skipped"] == [4], r  # real: the forward is finite
    assert r["first_bwd"] == ("criterion", 4), r
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        x, y = _noisy_labels(4)
        assert torch.softmax(m.classifier(m.features(x)), -1)[6, 3] == 0  # flushed to 0 in fp16
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "criterion", step=4, phase="backward")
    no_error_at(rep, ("classifier", "features", "features.2", ""))


# ======================================================================================================================
# 12. NT-Xent with a learnable raw temperature and a hand-written exp(sim / t) in fp16: the loss drives t down, and
#     once 1 / t passes ~11 the positives' exp is inf; the skipped steps freeze t, so every later step overflows too
#     and the scale collapses (natural onset, measured in the loop). The twin: cross_entropy on sim / t with t >= 0.05
# ======================================================================================================================
class NTXent(nn.Module):
    def __init__(self, t=0.2, safe=False):
        super().__init__()
        self.t, self.safe = nn.Parameter(torch.tensor(t)), safe

    def forward(self, z1, z2):
        sim = F.normalize(z1, dim=-1) @ F.normalize(z2, dim=-1).T
        if self.safe:
            return F.cross_entropy(sim / self.t.clamp(min=0.05), torch.arange(len(sim)))
        e = torch.exp(sim / self.t)
        return -torch.log(e.diagonal() / e.sum(1)).mean()


class SimCLR(nn.Module):
    def __init__(self, safe=False):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
        self.criterion = NTXent(safe=safe)

    def forward(self, x1, x2):
        return self.criterion(self.projector(self.encoder(x1)), self.projector(self.encoder(x2)))


def _two_views(i):
    x = randn(32, 32, seed=i % 4)
    return x + 0.05 * randn(32, 32, seed=100 + i), x + 0.05 * randn(32, 32, seed=200 + i)


def test_learnable_temperature_in_a_hand_written_nt_xent_overflows_once_it_falls_and_collapses_the_scale():
    torch.manual_seed(0)
    m = SimCLR()
    r = train_loop(m, _two_views, lambda o, *a: o.float(), 30, lr=1e-2)
    assert r["first"] is not None and r["first"][0] == "criterion", r
    onset = r["first"][1]
    assert 3 <= onset <= 20 and r["skipped"] == list(range(onset, 30)), r  # natural onset, then persistent
    assert 1 / m.criterion.t.item() > 11.0, m.criterion.t
    rep = r["w"].report()
    at(rep, ("overflow", "loss_scale_collapse"), "criterion", step=onset, phase="forward")
    assert "loss_scale_collapse" in [f.rule for f in rep.findings if f.severity == "error"], lines(rep)
    no_error_at(rep, ("projector", "projector.2", "encoder", ""))
    # F.normalize's eps 1e-12 is 0 in fp16, but no row's norm is 0 here: not this step's error
    assert "eps_underflow" not in [f.rule for f in rep.findings if f.severity == "error"], lines(rep)


def test_healthy_twin_nt_xent_as_cross_entropy_with_a_clamped_temperature_is_quiet():
    torch.manual_seed(0)
    m = SimCLR(safe=True)
    healthy(train_loop(m, _two_views, lambda o, *a: o.float(), 30, lr=1e-2))
