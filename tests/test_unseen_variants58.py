"""Fifty-eighth set: FP16 FAILURES IN RECURRENT / STATE-SPACE SEQUENCE MODELS WRITTEN IN PYTORCH (not attention
transformers), with mechanisms the earlier sets do not build (there: minGRU's naive parallel scan A_t * cumsum(b_t /
A_t) with a cumprod (14), HGRN's exp(L) * cumsum(exp(-L) u) (24), Mamba-2's SSD segsum exp'd before its mask (38),
xLSTM mLSTM's unstabilised exp input gate (38), RetNet's gamma^-j factorised onto k (19), non-causal linear attention's
k^T v state (7), CTC over too short an input (9)). Two fp16 failures that start mid-run at a known step (7: never a
sampled step; full statistics are taken on step 0 and every 200th) and two healthy twins. Tiny models, fixed seeds,
one intra-op thread. Watched through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=...,
run_dir=tmp_path / "run")` at the default settings) in probe_harness.probe_run: an ordinary CPU fp16 autocast +
`torch.amp.GradScaler("cpu")` loop (scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update -> close ->
`w.report()`); every model computes its own loss.

Each failure is proven first by the test's own oracle: probe_harness.Producer (keyword inputs checked: the first
module whose output is non-finite while its inputs and own parameters were finite, at the expected step), the loss
(first non-finite there), the scaler (it skips that step; before it only the opening backoffs, steps 0-2), a float32
check (the weights the bad step's forward ran with run the bad batch in float32, no autocast: finite loss, finite
gradients), the producer re-run on those weights under fp16 autocast (its inputs finite, its output not), the
mechanism itself measured, and the FIX (the same weights, the same batch, under fp16 autocast: finite). A failing
oracle is a plain failure. Only then must the rule be among the report's first three findings at the PRODUCER, at
that step, an `error`, forward phase, with no error at the modules that only passed the inf/NaN on; a wrong report
raises WrongAnswer naming ampdoctor's top three (rule@module op step phase [severity]).

 1. minGRU (Feng et al. 2024, "Were RNNs All We Needed?") trained in its LOG-SPACE parallel mode, the paper's own
    numerically stable form (Heinsen's scan): log_h = a* + logcumsumexp(log_values - a*), a* = cumsum(log_coeffs),
    log_coeffs = -softplus(gate), in the activations' fp16 (`rnn`). Log space keeps every exp in range, but a* itself
    is a running sum of log-decays that grows linearly with the length: a byte-level LM's context curriculum goes from
    4,096 to 131,072 tokens at step 7 (what long-context RNN training is for) and a* passes -65504 (about 0.9 nats a
    token) -> a* = -inf, log_values - a* = +inf, a* + inf = NaN -> nan_origin (overflow accepted) at `rnn`, step 7
    (`rnn.proj` finite; not `head`). Fix: the scan in float32 (twin 3).
 2. an RWKV-v1 / AFT-simple causal time-mix (`att`): wkv_t = sum_{u<=t} e^{k_u} v_u / sum_{u<=t} e^{k_u} as two
    cumsums, k = exp(clamp(key(x), max=30)) (RWKV-v1's clamp, sized for float32), no running max subtracted (RWKV-4's
    pp trick), in fp16. An audio-token LM: 256-token clips until step 7, then a 15-minute recording whose tail is
    digital silence (65,536 frames of the silence token): over the silent run every position adds the same e^{k0}
    and e^{k0} v0 to both sums, which pass 65504 in lockstep -> inf / inf = NaN -> nan_origin (overflow accepted) at
    `att`, step 7 (its key/value/receptance/output Linears finite; not `ln1`, `ln2`, `head`). Fix: the two running
    sums in float32 (twin 4).
Healthy twins (the fix applied, the same special batches; also run unwatched: losses and final weights bitwise
identical with and without the watch; no warning, no error, no RuntimeWarning of ampdoctor's):
 3. twin of 1: the log-space scan in float32 (the 131,072-token batch included) -> quiet.
 4. twin of 2: the running sums in float32 (the silent recording included; its scaled backward overflows once at
    step 7, finite unscaled: the scaler's job, reported as info) -> quiet.
(lr 1e-2; in ten steps these LMs fall by 7-10%: the twins are asked for fall=0.95.)

Result when written (torch 2.13 CPU, default watch): 4/4 right, no xfail. Top findings:
1 `[error] overflow at rnn aten::cumsum step 7` ("produced -inf from finite inputs; it propagates to aten::add"),
  `[error] skipped_steps at rnn step 7`, `[info] overflow at rnn.proj step 0` (the opening backoffs, steps 0-4);
2 `[error] overflow at att aten::cumsum step 7` (-inf... propagates to aten::div), `[error] skipped_steps at att
  step 7`;
3 quiet; 4 quiet (`[info] overflow at head step 7`, `[info] skipped_steps (run) step 7`).
Not built (measured, no fp16 producer at a known step): Mamba's exact ZOH B_bar = (exp(dA) - 1) / dA with delta from
softplus flushing to 0 on silent frames (Mamba's dt-bias init keeps dt_proj's output above -9.1 even for a -10 log-mel
floor: softplus stays a normal fp16 number); a CTC head's log(softmax) on silence (random-init logit margins ~5, far
from the 17.3 that flushes a probability; F.ctc_loss itself autocasts to float32 on the CPU); S4D Vandermonde kernels
(computed from float32 parameters, they stay float32 under autocast unless cast by hand); sLSTM without its stabiliser
(the normaliser n overflows, but c / n = finite / inf = 0 is a silent zero unless c overflows too; not built for time).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants58.py
"""
from __future__ import annotations

import math


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")
BAD_AT = 7


# the loop, the oracle and the checks: test_unseen_variants56's (its run, twin and check_failure)
from test_unseen_variants56 import check_failure, run, snapshot_model, twin  # noqa: E402


def byte_lm_tokens(g, B, T, vocab):
    """A learnable toy stream: next = (5 prev + 1) mod vocab, flipped to a random token 1 time in 8."""
    ids = torch.empty(B, T, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (B,), generator=g)
    noise = torch.rand(B, T, generator=g) < 0.125
    rnd = torch.randint(0, vocab, (B, T), generator=g)
    for t in range(1, T):
        ids[:, t] = torch.where(noise[:, t], rnd[:, t], (5 * ids[:, t - 1] + 1) % vocab)
    return ids


def next_token_ce(logits, ids):
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


# ======================================================================================================================
# 1./3. minGRU in log space (Heinsen's scan): the running sum of log-decays passes -65504 on a 131k-token context
# ======================================================================================================================
V_GRU, D_GRU, SHORT_GRU, LONG_GRU, LR_GRU = 32, 16, 4096, 131_072, 1e-2


def log_g(x):
    """minGRU's log of its g(x) = x + 0.5 (x >= 0), sigmoid(x) (x < 0)."""
    return torch.where(x >= 0, torch.log(F.relu(x) + 0.5), -F.softplus(-x))


class MinGRU(nn.Module):
    """minGRU's log-space parallel mode (the paper's Listing: parallel_scan_log)."""

    def __init__(self, d, fix=False):
        super().__init__()
        self.proj = nn.Linear(d, 2 * d)
        self.fix = fix

    def forward(self, x):
        hidden, gate = self.proj(x).chunk(2, -1)
        log_coeffs = -F.softplus(gate)
        log_values = -F.softplus(-gate) + log_g(hidden)
        if self.fix:
            log_coeffs, log_values = log_coeffs.float(), log_values.float()
        a_star = torch.cumsum(log_coeffs, 1)
        log_h = a_star + torch.logcumsumexp(log_values - a_star, 1)
        return torch.exp(log_h)


class ByteRNN(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.embed = nn.Embedding(V_GRU, D_GRU)
        self.rnn = MinGRU(D_GRU, fix)
        self.head = nn.Linear(D_GRU, V_GRU)

    def forward(self, ids):
        return next_token_ce(self.head(self.rnn(self.embed(ids))), ids)


def gru_batch(i):
    """The context curriculum: 4,096-token windows until BAD_AT, 131,072 from there."""
    g = gen(5810 + i)
    return (byte_lm_tokens(g, 1, LONG_GRU if i >= BAD_AT else SHORT_GRU, V_GRU),), {}, None


def test_mingru_log_space_scan_running_sum_of_log_decays_passes_fp16_range(tmp_path):
    r = check_failure(tmp_path, ByteRNN, gru_batch, BAD_AT, "rnn", FWD, quiet_at=("rnn.proj", "head", "embed", ""),
                      lr=LR_GRU, opening=5)
    # the mechanism: a* reaches beyond -65504 in float32 on the long context; on the short one it stays far inside
    m = snapshot_model(ByteRNN, r)
    for i, inside in ((BAD_AT - 1, True), (BAD_AT, False)):
        with torch.no_grad():
            gate = m.rnn.proj(m.embed(gru_batch(i)[0][0])).chunk(2, -1)[1]
            a_end = float(-F.softplus(gate).sum(1).min())
        assert (a_end > -30_000) if inside else (a_end < -66_000), (i, a_end)


def test_twin_mingru_log_space_scan_in_fp32_stays_quiet(tmp_path):
    # On some CPUs (an Intel Sapphire Rapids with AVX512-FP16, torch 2.13) the scaled backward of the 131,072-token
    # batch overflows once at BAD_AT (finite unscaled: the scaler's job, which it does); on others it does not. The
    # unwatched run says which: those skips, and only those, are the healthy run's (no warning, no error either way)
    torch.manual_seed(0)
    bare = run(ByteRNN(fix=True), gru_batch, 10, None, lr=LR_GRU, watch=False)
    skips = tuple(s for s in bare["skipped"] if s >= 3)
    assert skips in ((), (BAD_AT,)) and all(map(math.isfinite, bare["losses"])), (skips, bare["losses"])
    twin(lambda: ByteRNN(fix=True), gru_batch, 10, tmp_path, lr=LR_GRU, fall=0.95, skips=skips)


# ======================================================================================================================
# 2./4. RWKV-v1 / AFT-simple causal time-mix: two running sums of exp(k) over a long run of silence
# ======================================================================================================================
V_AU, D_AU, SHORT_AU, SILENT_AU, SILENCE, LR_AU = 64, 16, 256, 65_536, 0, 1e-2


class TimeMix(nn.Module):
    """RWKV-v1's time-mix without its decay curve (AFT-simple, causal): sigmoid(r) * cumsum(e^k v) / cumsum(e^k)."""

    def __init__(self, d, fix=False):
        super().__init__()
        self.key, self.value = nn.Linear(d, d), nn.Linear(d, d)
        self.receptance, self.output = nn.Linear(d, d), nn.Linear(d, d)
        self.fix = fix

    def forward(self, x):
        k = torch.exp(torch.clamp(self.key(x), max=30))
        v = self.value(x)
        if self.fix:
            k, v = k.float(), v.float()
        wkv = torch.cumsum(k * v, 1) / torch.cumsum(k, 1)
        return self.output(torch.sigmoid(self.receptance(x)) * wkv)


class AudioLM(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.embed = nn.Embedding(V_AU, D_AU)
        self.ln1, self.att, self.ln2 = nn.LayerNorm(D_AU), TimeMix(D_AU, fix), nn.LayerNorm(D_AU)
        self.head = nn.Linear(D_AU, V_AU)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.att(self.ln1(x))
        return next_token_ce(self.head(self.ln2(x)), ids)


def audio_batch(i):
    """256-token clips (codec tokens 1..63); at BAD_AT one recording of 256 + 65,536 frames whose tail is silence."""
    g = gen(5820 + i)
    ids = 1 + byte_lm_tokens(g, 2, SHORT_AU, V_AU - 1)
    if i == BAD_AT:
        ids = torch.cat([ids[:1], torch.full((1, SILENT_AU), SILENCE)], 1)
    return (ids,), {}, None


def test_rwkv_v1_time_mix_running_sums_of_exp_k_over_silence_overflow(tmp_path):
    r = check_failure(tmp_path, AudioLM, audio_batch, BAD_AT, "att", FWD,
                      quiet_at=("att.key", "att.value", "att.receptance", "att.output", "ln1", "ln2", "head",
                                "embed", ""), lr=LR_AU)
    # the mechanism: each silent frame's e^k is modest (far from 65504); the sums over the silent run are not
    m = snapshot_model(AudioLM, r)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        k0 = torch.exp(m.att.key(m.ln1(m.embed(torch.tensor([[SILENCE]])))))
        v0 = m.att.value(m.ln1(m.embed(torch.tensor([[SILENCE]]))))
    assert float(k0.max()) < 100 and float((k0 * SILENT_AU).max()) > 65504, k0
    assert float((k0 * v0.abs() * SILENT_AU).max()) > 65504, (k0, v0)


def test_twin_rwkv_v1_time_mix_running_sums_in_fp32_stay_quiet(tmp_path):
    twin(lambda: AudioLM(fix=True), audio_batch, 10, tmp_path, lr=LR_AU, fall=0.95, skips=(BAD_AT,))
