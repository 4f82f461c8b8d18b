"""SILENT fp16/bf16 failures in setups the earlier silent sets (test_silent_stop, test_unseen_variants17/26/40/47/57)
do not build.

Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=sc or None)` at the default
settings -> an ordinary CPU loop -> close() -> report()). Each failure is first proven by the test's own oracle (a
failing oracle is a plain failure, never an xfail): the share of elements with a nonzero gradient that
optimizer.step left unchanged, measured here; gradients exactly zero in the fp16 run but nonzero in an fp32 twin on
the same weights and batch; the NaN an optimizer wrote; the scale and the skipped steps. Then the rule (CONTRACT.md id)
at the module among the first three findings, with the severity CONTRACT.md gives. A wrong report raises
WrongAnswer (strict xfail via `wrong`).

Cases (the failure proven by the test's own oracle first; result when written):
 1. a sentence encoder (Embedding + TransformerEncoderLayer + LayerNorm) cast `.to(torch.bfloat16)` and fine-tuned
    with AdamW at the usual lr 2e-5: the LayerNorm gains never move, >90% of the embedding's and >50% of linear1's
    elements with a nonzero gradient are left unchanged by step() (update_underflow / fp16_master_weights in the
    top three, update_underflow reported): PASS.
 2. a `.half()` bag-of-words classifier (N(0,1) embedding, small 0.1-scaled Linear layers), SGD(lr 0.05,
    momentum 0.9): the embedding's touched rows never change (<5% of its elements ever move) while `out` moves
    (update_underflow at `emb`): PASS.
 3. torch.optim.Adamax (eps=1e-8 == 0 in fp16) over a `.half()` bag model from step 0: every element with a zero
    gradient gets 0/0 = NaN at step 0, every loss after step 0 is NaN (eps_underflow at `emb`/root, step 0): PASS.
 4. a deep (8 x Linear+sigmoid) tabular MLP under fp16 autocast without a GradScaler: against an fp32 twin,
    layers.0/1 lose 100% and layers.2 97% of their gradient elements to zero, layers.7 is within 0.14%
    (underflow at layers.0-3): XFAIL (wrong, below).
 5. a Conv1d waveform denoiser, MSE averaged over 16 x 8192 samples (8-channel, k=5 convs), fp16 autocast, no GradScaler: dL/dout ~1e-6 is
    fp16-subnormal, `enc`'s weight gradient ~18% off fp32 (underflow at out/mid/enc, backward): PASS.
 6. the same denoiser with a GradScaler pinned at 1 by `scaler.update(new_scale=1.0)` every step ("a static
    scale"): steps 1-7 run at scale 1.0, nothing skipped, gradients as far off as in 5 (underflow): XFAIL (wrong)
    when written; PASS since (a scale that falls more than one backoff in a step has the next step sampled,
    record/autocapture.py, and a scale <= 8 on every step after the first counts as pinned, rules/underflow.py).
 7. an unnormalised sum-reduced regression on raw ~300 targets under the default GradScaler: the scaled gradients
    overflow down to a scale below 1, >= 17 steps skipped (loss_scale_collapse / skipped_steps): PASS.
 8. a keyword-spotting Conv1d+BatchNorm net cast to bf16 and trained with RAdam at lr 1e-4: the BN gains never
    move, >50% of conv1/conv2 elements with a nonzero gradient are left unchanged from RAdam's adaptive phase
    (update_underflow reported, update_underflow / fp16_master_weights in the top three): PASS.
Healthy twins (no warning, no error; all PASS): 1 with fp32 weights under bf16 autocast (every parameter moves);
3 with Adamax over fp32 weights under fp16 autocast + GradScaler; 5 with a default GradScaler.

What ampdoctor got wrong (strict xfails, 2 of 11 when written):
 4. `[error] underflow at layers.7 step 0` (69% of the gradient flowing into layers.7 subnormal, "learning stalls")
    and nothing at layers.0-3, where the gradients are actually flushed to zero; layers.7's own weight gradient is
    within 0.14% of fp32. The report names where subnormals begin in the backward, not the layers that lose their
    gradient. (Arguable: ampdoctor names where the gradients first fall below fp16's range in the backward, as it
    names the producer of an overflow; the layers below it have no nonzero gradient left to measure.)
 6. (fixed since) an empty report. The "scale stays <= 8 all run" condition (README, `underflow`) does not hold because step 0 ran
    at 65536; 7 of 8 steps at scale 1 with `enc`'s weight gradient ~18% off fp32 go unreported.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import WrongAnswer, wrong
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def gen(i):
    return torch.Generator().manual_seed(1000 + i)


def expect(rep, rules, modules, severity=("error",), step=None):
    """One of `rules` at one of `modules` among the first three findings with `severity` (and step in `step`), else
    WrongAnswer naming the top three."""
    rules = (rules,) if isinstance(rules, str) else rules
    modules = (modules,) if isinstance(modules, str) or modules is None else modules
    for f in rep.findings[:3]:
        if f.rule in rules and f.module in modules and f.severity in severity and (step is None or f.step in step):
            return f
    raise WrongAnswer(f"wanted {rules} at {modules} {severity}; got: {lines(rep)[:3]}")


def quiet(rep):
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


def run(m, opt, batch, loss_fn, steps, *, dtype=None, scaler=None, rounding=True, new_scale=None):
    """zero_grad -> forward (under autocast(dtype) if given) -> loss -> [scaler] backward -> [unscale_] -> step ->
    [update], watched. Returns (report, losses, per-parameter rounded share per step, scales, skipped, w0)."""
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt, scaler=scaler)
    losses, rounded, scales, skipped = [], [], [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        args, y = batch(i)
        if dtype is not None:
            with torch.autocast("cpu", dtype=dtype):
                out = m(*args)
        else:
            out = m(*args)
        loss = loss_fn(out, y)
        losses.append(loss.item())
        before = {n: p.detach().clone() for n, p in m.named_parameters()} if rounding else None
        if scaler is not None:
            s0 = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update(new_scale)
            scales.append(s0)
            if scaler.get_scale() < s0:
                skipped.append(i)
        else:
            loss.backward()
            opt.step()
        if rounding:
            share = {}
            for n, p in m.named_parameters():
                if p.grad is None:
                    continue
                gnz = p.grad != 0
                if int(gnz.sum()):
                    share[n] = float(((p.detach() == before[n]) & gnz).sum() / gnz.sum())
            rounded.append(share)
    w.close()
    return w.report(), losses, rounded, scales, skipped, w0


def moved(m, w0):
    return {n: float((p.detach() != w0[n]).float().mean()) for n, p in m.named_parameters()}


def zero_vs_fp32(m, args, y, loss_fn, dtype=torch.float16):
    """Step-0 gradients of m under fp16 autocast (no scaling) against an fp32 twin on the same weights and batch:
    per parameter, the share of elements exactly zero in the fp16 run but nonzero in fp32, and the relative error."""
    ref = copy.deepcopy(m).float()
    m2 = copy.deepcopy(m)
    with torch.autocast("cpu", dtype=dtype):
        out = m2(*args)
    loss_fn(out, y).backward()
    loss_fn(ref(*args), y).backward()
    res = {}
    for (n, p), (_, q) in zip(m2.named_parameters(), ref.named_parameters()):
        nz = q.grad != 0
        lost = float(((p.grad == 0) & nz).sum() / nz.sum().clamp(min=1))
        err = float((p.grad.float() - q.grad).norm() / q.grad.norm().clamp(min=1e-30))
        res[n] = (lost, err)
    return res


# ======================================================================================================================
# 1./twin 1. a sentence encoder fine-tuned in pure bf16 with AdamW at the usual lr 2e-5
# ======================================================================================================================
class Encoder(nn.Module):
    def __init__(self, vocab=200, d=32, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        return self.head(self.norm(self.block(self.emb(idx))).mean(1))


def _enc_batch(i):
    idx = torch.randint(0, 200, (16, 12), generator=gen(i % 6))
    return (idx,), (idx[:, 0] % 4)


def _ce(out, y):
    return F.cross_entropy(out.float(), y)


def test_pure_bf16_encoder_finetune_at_adamw_2e_5_rounds_every_update_away():
    torch.manual_seed(0)
    m = Encoder().to(torch.bfloat16)   # "bf16 has fp32's range, no scaler needed": weights, grads, states in bf16
    opt = torch.optim.AdamW(m.parameters(), lr=2e-5)
    rep, losses, rounded, _, _, w0 = run(m, opt, _enc_batch, _ce, 24)
    # truth: every loss finite; from step 2 on (Adam's update ~ lr per element) the LayerNorm gains (1.0) and most
    # weight elements with a nonzero gradient are left unchanged by step(); the final norm's gain never moved
    assert all(map(math.isfinite, losses))
    late = rounded[10]
    assert late["norm.weight"] == 1.0 and late["emb.weight"] > 0.9, late
    assert late["block.linear1.weight"] > 0.5, late
    assert moved(m, w0)["norm.weight"] == 0.0
    expect(rep, ("update_underflow", "fp16_master_weights"), ("", "emb", "norm", "block", "block.linear1",
                                                              "block.linear2", "block.norm1", "block.norm2", "head",
                                                              "block.self_attn"))
    f = next((f for f in rep.findings if f.rule == "update_underflow"), None)
    if f is None or f.severity not in ("warning", "error"):
        raise WrongAnswer(f"no update_underflow: {lines(rep)}")


def test_healthy_twin_fp32_encoder_under_bf16_autocast_at_adamw_2e_5_is_quiet():
    torch.manual_seed(0)
    m = Encoder()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-5)
    rep, losses, rounded, _, _, w0 = run(m, opt, _enc_batch, _ce, 24, dtype=torch.bfloat16)
    assert all(map(math.isfinite, losses))
    assert max(s for r in rounded[2:] for s in r.values()) < 0.2 and rounded[10]["norm.weight"] == 0.0, rounded[10]
    assert min(moved(m, w0).values()) > 0.95, moved(m, w0)
    quiet(rep)


# ======================================================================================================================
# 2. a `.half()` text classifier fine-tuned with SGD: the N(0,1) embedding never moves, the small layers do
# ======================================================================================================================
class BagNet(nn.Module):
    def __init__(self, vocab=1000, d=48):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)           # N(0, 1): |w| ~ 1, half an fp16 ulp ~ 2.4e-4 - 4.9e-4
        self.fc = nn.Linear(d, 32)
        self.out = nn.Linear(32, 3)
        with torch.no_grad():
            self.fc.weight.mul_(0.1)
            self.out.weight.mul_(0.1)

    def forward(self, idx):
        return self.out(torch.tanh(self.fc(self.emb(idx).mean(1))))


def _bag_batch(i):
    idx = torch.randint(0, 1000, (32, 20), generator=gen(i % 8))
    return (idx,), (idx[:, 0] % 3)


def test_half_bag_classifier_sgd_embedding_updates_round_away_small_layers_move():
    torch.manual_seed(0)
    m = BagNet().half()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    rep, losses, rounded, _, _, w0 = run(m, opt, _bag_batch, _ce, 20)
    # truth: finite losses; the embedding's touched rows (nonzero gradient) are left unchanged by ~every step, while
    # `out` moves in most elements
    assert all(map(math.isfinite, losses))
    emb = [r["emb.weight"] for r in rounded[3:]]
    assert min(emb) > 0.9, emb
    assert rounded[5]["out.weight"] < 0.5, rounded[5]
    mv = moved(m, w0)
    assert mv["emb.weight"] < 0.05 and mv["out.weight"] > 0.5, mv
    expect(rep, "update_underflow", "emb", severity=("warning", "error"))


# ======================================================================================================================
# 3./twin 3. Adamax (eps=1e-8) over a `.half()` bag-of-words model from step 0: the padding / unseen rows get 0/0
# ======================================================================================================================
class PadBag(nn.Module):
    def __init__(self, vocab=300, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.out = nn.Linear(d, 3)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


def _padbag_batch(i):
    # batch i uses only ids 0..99 for i < 4, then the whole vocabulary (new documents)
    hi = 100 if i < 4 else 300
    idx = torch.randint(0, hi, (16, 10), generator=gen(i))
    return (idx,), idx[:, 0] % 3


def test_adamax_over_half_bag_model_unseen_rows_become_nan():
    torch.manual_seed(0)
    m = PadBag().half()
    opt = torch.optim.Adamax(m.parameters(), lr=2e-3)
    rep, losses, rounded, _, _, _ = run(m, opt, _padbag_batch, _ce, 8, rounding=False)
    # truth: fp16(1e-8) == 0; every element with a zero gradient at step 0 (the rows batch 0 did not use) gets
    # exp_avg / exp_inf = 0 / 0 = NaN; step 0's loss is finite, every later loss NaN (the next batch reads such rows)
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    rows_nan = torch.isnan(m.emb.weight.float()).any(1)
    assert bool(rows_nan[100:].all()), int(rows_nan.sum())
    assert math.isfinite(losses[0]) and not any(map(math.isfinite, losses[1:])), losses
    expect(rep, ("eps_underflow", "fp16_master_weights"), ("emb", ""), step=(0,))
    expect(rep, "eps_underflow", ("emb", "", None))


def test_healthy_twin_adamax_over_fp32_bag_model_under_fp16_autocast_is_quiet():
    torch.manual_seed(0)
    m = PadBag()
    opt = torch.optim.Adamax(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    rep, losses, _, _, skipped, _ = run(m, opt, _padbag_batch, _ce, 16, dtype=torch.float16, scaler=sc,
                                        rounding=False)
    assert all(map(math.isfinite, losses)) and torch.isfinite(m.emb.weight).all()
    assert all(s < 3 for s in skipped), skipped
    quiet(rep)


# ======================================================================================================================
# 4. a deep sigmoid tabular MLP under fp16 autocast without a scaler: only the lowest layers' gradients underflow
# ======================================================================================================================
class DeepSig(nn.Module):
    def __init__(self, d=32, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for l in self.layers:
            x = torch.sigmoid(l(x))
        return self.head(x)


def _tab_batch(i):
    x = torch.randn(64, 32, generator=gen(i % 5))
    return (x,), x[:, :1] * 0.1


def _mse(out, y):
    return F.mse_loss(out.float(), y)


@wrong("says `[error] underflow at layers.7 step 0` (69% of the gradient into its output subnormal, 'learning "
       "stalls') and nothing at layers.0-3; truth: layers.7's weight gradient is within 0.14% of fp32, while "
       "layers.0/1 lose 100% and layers.2 97% of their gradient elements to zero (layers.3 44%)")
def test_deep_sigmoid_mlp_fp16_autocast_no_scaler_lowest_layers_underflow():
    torch.manual_seed(0)
    m = DeepSig()
    args, y = _tab_batch(0)
    z = zero_vs_fp32(m, args, y, _mse)
    # truth: the gradient shrinks ~x0.25 per sigmoid: layers.0's weight gradient loses most of its elements to fp16
    # flush-to-zero against fp32; the head's does not
    assert z["layers.0.weight"][0] > 0.5 and z["head.weight"][0] == 0.0, z
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    rep, losses, rounded, _, _, w0 = run(m, opt, _tab_batch, _mse, 12, dtype=torch.float16)
    assert all(map(math.isfinite, losses))
    f = expect(rep, "underflow", ("layers.0", "layers.1", "layers.2", "layers.3"), severity=("warning", "error"))
    assert f.phase in ("backward", None), f.one_line()


# ======================================================================================================================
# 5./twin 5. a waveform denoiser, L1 averaged over 16 x 8192 samples, under fp16 autocast without a GradScaler
# ======================================================================================================================
class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv1d(1, 8, 5, padding=2)
        self.mid = nn.Conv1d(8, 8, 5, padding=2)
        self.out = nn.Conv1d(8, 1, 5, padding=2)

    def forward(self, x):
        return x + self.out(F.gelu(self.mid(F.gelu(self.enc(x)))))


def _wave_batch(i):
    g = gen(i % 4)
    clean = torch.sin(torch.linspace(0, 300, 8192))[None, None].repeat(16, 1, 1) * 0.3
    noisy = clean + 0.05 * torch.randn(16, 1, 8192, generator=g)
    return (noisy,), clean


def _msew(out, y):
    return F.mse_loss(out.float(), y)


def test_waveform_denoiser_mean_msew_over_131k_samples_fp16_no_scaler_gradients_underflow():
    torch.manual_seed(0)
    m = Denoiser()
    args, y = _wave_batch(0)
    z = zero_vs_fp32(m, args, y, _msew)
    # truth: dL/dout = 2 (out - y) / 131072 ~ 1e-6, fp16 subnormal; the lower convs' gradients are far off against
    # fp32 (enc ~18%), the output conv's within 1%
    assert 2 * 0.05 / 131072 < 2 ** -14
    assert z["enc.weight"][1] > 0.1, z
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    rep, losses, _, _, _, _ = run(m, opt, _wave_batch, _msew, 6, dtype=torch.float16, rounding=False)
    assert all(map(math.isfinite, losses))
    f = expect(rep, "underflow", ("out", "mid", "enc", ""), severity=("warning", "error"))
    assert f.phase in ("backward", None), f.one_line()


def test_healthy_twin_waveform_denoiser_with_a_default_gradscaler_is_quiet():
    torch.manual_seed(0)
    m = Denoiser()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    rep, losses, _, scales, skipped, _ = run(m, opt, _wave_batch, _msew, 10, dtype=torch.float16, scaler=sc,
                                             rounding=False)
    assert all(map(math.isfinite, losses)) and all(s < 3 for s in skipped), skipped
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    quiet(rep)


# ======================================================================================================================
# 6. a GradScaler pinned at 1 by `scaler.update(new_scale=1.0)` every step ("a static scale") on the same denoiser
# ======================================================================================================================
def test_gradscaler_pinned_at_one_by_update_new_scale_denoiser_gradients_underflow():
    torch.manual_seed(0)
    m = Denoiser()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    rep, losses, _, scales, skipped, _ = run(m, opt, _wave_batch, _msew, 8, dtype=torch.float16, scaler=sc,
                                             rounding=False, new_scale=1.0)
    # truth: step 0 runs at 65536, every later step at 1.0, nothing is skipped; at scale 1 the gradients are the
    # unscaled ones that the fp32 comparison shows far off
    # (the drop 65536 -> 1 after step 0 is the pin, not a skip: step 0's loss and gradients are finite)
    assert scales[0] == 65536.0 and set(scales[1:]) == {1.0} and skipped == [0], (scales, skipped)
    assert all(map(math.isfinite, losses)), losses
    args, y = _wave_batch(0)
    torch.manual_seed(0)
    z = zero_vs_fp32(Denoiser(), args, y, _msew)
    assert z["enc.weight"][1] > 0.1, z
    f = expect(rep, "underflow", ("out", "mid", "enc", ""), severity=("warning", "error"))
    assert f.phase in ("backward", None), f.one_line()


# ======================================================================================================================
# 7. an unnormalised sum-reduced regression under the default GradScaler: the scale halves from 65536 to below 1
# ======================================================================================================================
class Reg(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 64)
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _reg_batch(i):
    x = torch.randn(256, 16, generator=gen(i % 4))
    return (x,), 300.0 + 50 * x[:, :1].repeat(1, 32)   # raw targets ~300 (prices), not standardised


def _sse(out, y):
    return F.mse_loss(out.float(), y, reduction="sum")


def test_sum_reduced_raw_target_regression_scale_collapses_below_one():
    torch.manual_seed(0)
    m = Reg()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    rep, losses, _, scales, skipped, w0 = run(m, opt, _reg_batch, _sse, 24, dtype=torch.float16, scaler=sc,
                                              rounding=False)
    # truth: every loss finite; the scaled gradients overflow fp16 at every scale down to below 1, so the scaler
    # skips >= 17 steps in a row and ends below 1 (65536 -> < 1: far below its start)
    assert all(map(math.isfinite, losses))
    assert len(skipped) >= 17 and min(scales + [sc.get_scale()]) < 1.0, (skipped, scales)
    expect(rep, ("loss_scale_collapse", "skipped_steps"), (None, "", "head", "body"),
           severity=("warning", "error"))


# ======================================================================================================================
# 8. a keyword-spotting Conv1d net cast to bf16 and trained with RAdam at lr 1e-4
# ======================================================================================================================
class KWS(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(40, 64, 5, padding=2)
        self.bn = nn.BatchNorm1d(64)
        self.conv2 = nn.Conv1d(64, 64, 5, padding=2)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.bn(self.conv1(x)))))
        return self.fc(h.mean(-1))


def _kws_batch(i):
    x = torch.randn(32, 40, 50, generator=gen(i % 6))
    return (x.to(torch.bfloat16),), (x[:, 0, :5].sum(1) > 0).long() + 2 * (x[:, 1, :5].sum(1) > 0).long()


def test_bf16_kws_convnet_radam_1e_4_updates_round_away():
    torch.manual_seed(0)
    m = KWS().to(torch.bfloat16)
    opt = torch.optim.RAdam(m.parameters(), lr=1e-4)
    rep, losses, rounded, _, _, w0 = run(m, opt, _kws_batch, _ce, 16)
    # truth: finite losses; the BN gains (1.0: half a bf16 ulp 2e-3) never move, and from step 6 (RAdam's adaptive
    # phase, updates ~ lr) most conv elements with a nonzero gradient are left unchanged by step()
    assert all(map(math.isfinite, losses))
    assert moved(m, w0)["bn.weight"] == 0.0, moved(m, w0)
    assert rounded[10]["conv2.weight"] > 0.5 and rounded[10]["conv1.weight"] > 0.5, rounded[10]
    f = next((f for f in rep.findings if f.rule == "update_underflow"), None)
    if f is None:
        raise WrongAnswer(f"no update_underflow: {lines(rep)}")
    expect(rep, ("update_underflow", "fp16_master_weights"), ("", "conv1", "conv2", "bn", "fc"),
           severity=("warning", "error"))
