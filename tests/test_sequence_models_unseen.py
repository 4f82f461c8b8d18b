"""SEQUENCE / SPEECH / TIME-SERIES models that break under fp16: tiny CPU models, each with one mechanism written the
way those code bases write it, trained for 8 steps in probe_harness.probe_run (fp16 CPU autocast + GradScaler("cpu"):
scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> close() -> report()) under
`ampdoctor.watch(model, optimizer=AdamW, scaler=..., run_dir=...)` at the default settings.

The trigger arrives with the data at step K = 5 (the first window of a series' full history, a flat-lined sensor,
an utterance left empty by VAD trimming, a 25-minute recording, a viral item); every earlier step is finite.

Each failure is first proven by the file's own oracle (probe_harness.Producer, keyword inputs checked: the module
and step where the first inf/NaN is made from finite inputs, own parameters finite; before K nothing but the
scaler's opening backoffs, steps 0-2; the loss first non-finite at K); a failing oracle is a plain failure, never an
xfail. Then the CONTRACT.md rule must be among the FIRST THREE findings, severity warning or error, at the producer
module and step K. A wrong report raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. slstm_nostab  xLSTM's sLSTM cell by hand (exponential input gate, sigmoid forget gate initialised open: 1.0 in
                  fp16, normaliser n = f n + i, h = o c / n) WITHOUT the paper's stabiliser state, its recurrent
                  state zeros of the input projection's dtype (fp16): 24-step windows keep n ~ 1e4; the 256-step
                  window at step 5 accumulates exp(i~) ~ 400 per step past 65504 -> inf, inf / inf = NaN ->
                  overflow (or nan_origin) at `rnn`.
 2. revin_fp16    RevIN (x - mean) / sqrt(var + 1e-8) on windows from a dataset stored as float16: a flat-lined
                  sensor at step 5 has var = 0 and 1e-8 is 0 in fp16 -> 0 / 0 -> eps_underflow (or nan_origin) at
                  `revin`.
 3. empty_utt     masked mean pooling sum(h * mask) / length over padded frames: an utterance emptied by VAD
                  trimming (length 0) at step 5 -> 0 / 0 -> nan_origin at `pool`.
 4. long_count    the same pooling with the frame count taken as mask.to(h.dtype).sum(): a 25-minute recording
                  (150000 frames) at step 5 -> the count and the feature sums pass 65504 -> inf / inf -> overflow
                  (or nan_origin) at `pool`.
 5. nb_lgamma     DeepAR's negative-binomial NLL written by hand with `y.type_as(mu)`: a viral item's 12000 sales at
                  step 5 (representable in fp16) -> lgamma(12000) ~ 1.0e5 = inf, inf - inf -> overflow (or
                  nan_origin) at `lik`.
Healthy twins (the same triggers, done right; no warning, no error):
 6. slstm with the stabiliser (m = max(log f + m, i~), exp(i~ - m)) on the same 256-step window: quiet.
 7. RevIN with the statistics in fp32 and eps 1e-5 on the flat-lined sensor: quiet.
 8. masked mean with lengths.clamp(min=1) on the empty utterance: quiet.

Result when written (torch 2.13 CPU, default watch): 8 pass, 0 xfail (stable over two runs, ~5 s). First findings
(abridged):
 1. PASS [error] overflow at rnn aten::add step 5 (propagates to aten::div); [error] skipped_steps at rnn step 5.
 2. PASS [error] eps_underflow at revin aten::add step 5 (1e-08 rounds to 0 in float16); [error] nan_origin at
    revin aten::div step 5; [error] skipped_steps.
 3. PASS [error] nan_origin at pool aten::div step 5; [error] skipped_steps.
 4. PASS [error] overflow at pool aten::sum step 5 (propagates to aten::div); [error] skipped_steps at pool.
 5. PASS [error] overflow at lik aten::lgamma step 5 (propagates to aten::sub); [error] skipped_steps; [info]
    overflow at lik step 1 (the scaled backward at the opening scale, "as designed").
 6-8. quiet (no finding at all).
(Not built, tried: a Keras-style ReLU LSTM cell (activation="relu", forget bias 5) - the gates saturate and the cell
state levels off at ~700 even on raw inputs, no inf; a He-initialised dilated TCN on one raw series - the residual
stream grows with depth (to ~5.4e4 entering block 4), but the producer is block 4's first conv, not a residual sum,
and the scaled backward skips steps 3-4 before the trigger, so the oracle's clean-prefix condition fails; Bahdanau
attention with a max-shifted softmax by hand over a 100000-frame source - no inf at any module output and every loss
finite; whether the weights' sum overflowed (silently zeroing the context) was not checked against fp32.)
"""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import probe_run, named_top3, quiet_twin
from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

K, STEPS, B = 5, 8, 4
ALARM = ("warning", "error")
FWD = ("overflow", "nan_origin")


def mse(out, y):
    return F.mse_loss(out.float(), y)


# ======================================================================================================================
# checks
# ======================================================================================================================
def real(r, module, step=K, silent=False):
    """The oracle: the first inf/NaN from finite inputs is made by `module` at `step`; before `step` nothing but the
    scaler's first backoffs (steps 0-2); at `step` the loss is non-finite (or, `silent`, no module output is ever
    non-finite, every loss finite)."""
    if silent:
        assert r["first"] is None and not r["bad_loss"], (r["first"], r["bad_loss"], r["losses"])
        return
    assert r["first"] == (module, step), (r["first"], r["bad_loss"], r["skipped"], r["losses"])
    assert all(s < 3 for s in r["skipped"] if s < step) and not [s for s in r["bad_loss"] if s < step], r
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


def named(rep, rules, module, step=K, severities=ALARM):
    """One of `rules` at `module`, at `step` (default K), among the first three findings (probe_harness.named_top3)."""
    return named_top3(rep, rules, module, step, severities)


quiet = quiet_twin  # (probe_harness.quiet_twin: the healthy twin's checks)


def run(m, batch, loss_fn, tmp_path, lr=1e-2, **kw):
    return probe_run(m, batch, loss_fn, STEPS, str(tmp_path / "run"), lr=lr, **kw)


# ======================================================================================================================
# 1/6. xLSTM's sLSTM cell (exponential input gate, normaliser state n) written by hand, without / with the stabiliser
# ======================================================================================================================
class SLSTMCell(nn.Module):
    """sLSTM (Beck et al. 2024): z = tanh, i = exp(i~), f = sigmoid(f~) (or exp with the stabiliser), c = f c + i z,
    n = f n + i, h = o c / n. `stab`: the paper's stabiliser state m = max(f~ + m, i~), i = exp(i~ - m),
    f = exp(f~ + m_prev - m)."""

    def __init__(self, d_in, hid, stab):
        super().__init__()
        self.hid, self.stab = hid, stab
        self.gates = nn.Linear(d_in + hid, 4 * hid)
        with torch.no_grad():
            self.gates.weight.mul_(0.1)
            b = self.gates.bias.view(4, hid)
            b[0].fill_(1.0)          # z: cell input
            b[1].fill_(6.0)          # i~: input gate pre-activation (as in the checkpoint it is fine-tuned from)
            b[2].fill_(8.0)          # f~: forget gate initialised open (sigmoid(8) is 1.0 in fp16)
            b[3].fill_(0.0)          # o

    def forward(self, x, state):
        h, c, n, m = state
        zt, it, ft, ot = self.gates(torch.cat([x, h], -1)).chunk(4, -1)
        z, o = torch.tanh(zt), torch.sigmoid(ot)
        if self.stab:
            lf = -F.softplus(-ft)                           # log sigmoid(f~)
            m_new = torch.maximum(lf + m, it)
            i, f = torch.exp(it - m_new), torch.exp(lf + m - m_new)
        else:
            i, f, m_new = torch.exp(it), torch.sigmoid(ft), m
        c = f * c + i * z
        n = f * n + i
        h = o * c / n
        return h, c, n, m_new


class SeqRegressor(nn.Module):
    """A recurrent forecaster: an input projection, the cell unrolled over time (one module called T times, its
    state zeros of the projection's dtype, as `x.new_zeros`), a Linear head on the last hidden state."""

    def __init__(self, cell, d_in=2, d=4, hid=8):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d_in, d)
        self.rnn = cell(d, hid)
        self.head = nn.Linear(hid, 1)

    def forward(self, x):
        x = self.inp(x)
        bsz, t, _ = x.shape
        z = x.new_zeros(bsz, self.rnn.hid)
        state = (z, z, z, z)
        for k in range(t):
            state = self.rnn(x[:, k], state)
        return self.head(state[0])


def window_batch(i, long_len=256, short=24, scale=1.0):
    """Step i's standardised windows (B, T, 2) and next-value targets; T = `short`, and at step K the first window
    of the full history (`long_len` steps)."""
    t = long_len if i == K else short
    g = gen(i % 4)
    x = torch.randn(B, t, 2, generator=g) * 0.5 * scale
    y = x[:, -4:, 0].mean(-1, keepdim=True) / scale
    return (x,), y


def test_1_slstm_without_stabiliser_normaliser_passes_65504_on_a_long_window(tmp_path):
    r = run(SeqRegressor(lambda d, h: SLSTMCell(d, h, stab=False)), window_batch, mse, tmp_path)
    real(r, "rnn")
    named(r["rep"], FWD, "rnn")


# ======================================================================================================================
# 2/7. RevIN on windows stored as float16 (eps 1e-8 is 0 there) / with the statistics in fp32
# ======================================================================================================================
class RevIN(nn.Module):
    """Reversible instance normalisation (Kim et al. 2022), statistics over time; `fp32`: computed in float32."""

    def __init__(self, eps=1e-8, fp32=False):
        super().__init__()
        self.eps, self.fp32 = eps, fp32

    def forward(self, x, mode):
        if mode == "norm":
            if self.fp32:
                x = x.float()
            self.mean = x.mean(-1, keepdim=True).detach()
            self.std = torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + self.eps).detach()
            return (x - self.mean) / self.std
        return x * self.std + self.mean


class RevINLinear(nn.Module):
    """RevIN -> a per-channel Linear(L, H) (the "linear is all you need" forecaster) -> RevIN denorm."""

    def __init__(self, L=48, H=12, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.revin = RevIN(**kw)
        self.lin = nn.Linear(L, H)

    def forward(self, x):
        return self.revin(self.lin(self.revin(x, "norm")), "denorm")


def revin_batch(i, L=48, H=12):
    """Three sensors' windows from a dataset stored as float16 (B, 3, L) and their next H values (fp32); at step K
    sensor 2 of window 1 has flat-lined (a constant 21.5)."""
    s = (torch.randn(B, 3, L + H, generator=gen(i % 4)).cumsum(-1) * 0.3 + 20.0)
    if i == K:
        s[1, 2] = 21.5
    return (s[..., :L].half(),), s[..., L:].float()


def test_2_revin_eps_vanishes_on_fp16_stored_windows_with_a_flat_lined_sensor(tmp_path):
    r = run(RevINLinear(), revin_batch, mse, tmp_path)
    real(r, "revin")
    named(r["rep"], ("eps_underflow", "nan_origin"), "revin")


# ======================================================================================================================
# 3/8. masked mean over padded frames: an utterance empty after VAD trimming (length 0) / lengths clamped to >= 1
# ======================================================================================================================
class MaskedMean(nn.Module):
    """sum over valid frames / length; `clamp`: the length clamped to >= 1; `count_fp16`: the frame count taken as
    the sum of the mask cast to the features' dtype."""

    def __init__(self, clamp=False, count_fp16=False):
        super().__init__()
        self.clamp, self.count_fp16 = clamp, count_fp16

    def forward(self, h, lengths):
        mask = (torch.arange(h.shape[1])[None] < lengths[:, None]).to(h.dtype)
        s = (h * mask[..., None]).sum(1)
        if self.count_fp16:
            return s / mask.sum(1, keepdim=True)
        n = lengths.clamp(min=1) if self.clamp else lengths
        return s / n[:, None]


class UttClassifier(nn.Module):
    """Frame encoder (Linear + ReLU on 8 filterbank features) -> masked mean pooling -> Linear head (4 classes)."""

    def __init__(self, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 16)
        self.pool = MaskedMean(**kw)
        self.head = nn.Linear(16, 4)

    def forward(self, feats, lengths):
        return self.head(self.pool(F.relu(self.enc(feats)), lengths))


def utt_batch(i, T=50, empty=True, long_t=None):
    """Padded utterances (B, T, 8), their lengths and labels; at step K utterance 2 is empty (`empty`, length 0) or
    the batch holds `long_t` frames, utterance 0 a recording of all of them."""
    g = gen(i % 4)
    t = long_t if (i == K and long_t) else T
    feats = torch.randn(B, t, 8, generator=g) + 1.0
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    if i == K and empty:
        lengths[2] = 0
    if i == K and long_t:
        lengths[0] = t
    y = torch.randint(0, 4, (B,), generator=g)
    return (feats, lengths), y


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def test_3_masked_mean_divides_by_the_length_of_an_empty_utterance(tmp_path):
    r = run(UttClassifier(), utt_batch, ce, tmp_path)
    real(r, "pool")
    named(r["rep"], "nan_origin", "pool")


# ======================================================================================================================
# 4. the masked mean's frame count taken in fp16: a 25-minute recording has more than 65504 frames
# ======================================================================================================================
def test_4_masked_mean_frame_count_in_fp16_passes_65504_on_a_long_recording(tmp_path):
    r = run(UttClassifier(count_fp16=True), lambda i: utt_batch(i, empty=False, long_t=150000), ce, tmp_path)
    real(r, "pool")
    named(r["rep"], FWD, "pool")


# ======================================================================================================================
# 5. DeepAR's negative-binomial likelihood by hand, the count target cast to the prediction's dtype
# ======================================================================================================================
class NegBinNLL(nn.Module):
    """-log NB(y; mu, alpha) = -(lgamma(y + r) - lgamma(y + 1) - lgamma(r) + r log(r / (r + mu)) + y log(mu / (r + mu))),
    r = 1 / alpha, with `y.type_as(mu)` (the target cast to the prediction's dtype)."""

    def forward(self, mu, alpha, y):
        y = y.type_as(mu)
        r = 1.0 / alpha
        ll = (torch.lgamma(y + r) - torch.lgamma(y + 1) - torch.lgamma(r)
              + r * torch.log(r / (r + mu)) + y * torch.log(mu / (r + mu)))
        return -ll.mean()


class DeepARHead(nn.Module):
    """Features of the recent sales (log1p) -> MLP -> mu = softplus(.) * v (v: the item's mean sales, DeepAR's
    scale), alpha = softplus(.) -> the NB NLL (the model returns its loss)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.mu, self.alpha = nn.Linear(16, 1), nn.Linear(16, 1)
        self.lik = NegBinNLL()

    def forward(self, x, v, y):
        h = self.mlp(x)
        mu = F.softplus(self.mu(h)) * v.to(h.dtype)
        return self.lik(mu, F.softplus(self.alpha(h)) + 1e-3, y)


def sales_batch(i):
    """Items' last 8 daily sales (log1p features), their mean v and the next day's count; at step K item 0 went viral
    (12000 sales, its history ~2000 a day)."""
    g = gen(i % 4)
    hist = torch.poisson(torch.rand(B, 1, generator=g) * 40 + 5 + torch.zeros(B, 8), generator=g)
    y = torch.poisson(hist.mean(1, keepdim=True), generator=g)
    if i == K:
        hist[0] = 2000.0
        y[0] = 12000.0
    v = hist.mean(1, keepdim=True) + 1.0
    return (hist.log1p(), v, y), {}, y


def test_5_negative_binomial_lgamma_of_a_viral_items_count_overflows(tmp_path):
    r = run(DeepARHead(), sales_batch, lambda out, y: out.float(), tmp_path)
    real(r, "lik")
    named(r["rep"], FWD, "lik")


# ======================================================================================================================
# 6-8: healthy twins (the same triggers, done right)
# ======================================================================================================================
def test_6_healthy_slstm_with_the_stabiliser_on_the_long_window(tmp_path):
    r = run(SeqRegressor(lambda d, h: SLSTMCell(d, h, stab=True)), window_batch, mse, tmp_path)
    quiet(r)


def test_7_healthy_revin_statistics_in_fp32_on_the_flat_lined_sensor(tmp_path):
    r = run(RevINLinear(fp32=True, eps=1e-5), revin_batch, mse, tmp_path)
    quiet(r)


def test_8_healthy_masked_mean_with_lengths_clamped_on_the_empty_utterance(tmp_path):
    r = run(UttClassifier(clamp=True), utt_batch, ce, tmp_path)
    quiet(r)
