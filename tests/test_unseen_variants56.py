"""Fifty-sixth set: FP16 FAILURES IN LLM FINE-TUNING RECIPES AS PEOPLE WRITE THEM TODAY, in tiny decoder-only
transformers (RMSNorm upcast to float32 as LLaMA's, causal attention written out, GELU MLP), with mechanisms or
structures the earlier sets do not build (there: DPO's summed log-probs going -inf (38), offline KD from cached
top-k raw logits (38), GRPO's std + 1e-8 (38), a router z-loss summed over a long bucket (hf 7), hand-written router
softmaxes (18, 27), an extended padding mask added twice (31), a block-diagonal mask built as (1 - allowed) * min in
fp16 (hf 3), a merged LoRA with the wrong alpha/r (hf 6), fp16 RMSNorm / QK-norm (27)). Five fp16 failures that
start mid-run at a known step (7: never a sampled step; full statistics are taken on step 0 and every 200th) and two
healthy twins. Small models, fixed seeds, one intra-op thread. Watched through the public API only
(`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")` at the default settings) in
probe_harness.probe_run: an ordinary CPU fp16 autocast + `torch.amp.GradScaler("cpu")` loop (scale(loss).backward ->
unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`); every model computes its own loss.

Each failure is proven first by the test's own oracle: probe_harness.Producer (keyword inputs checked: the first
module whose output is non-finite while its inputs and own parameters were finite, at the expected step), the loss
(first non-finite there), the scaler (it skips that step, except in 1 and 2, where the non-finite value never reaches
a gradient: see there; before it only the opening backoffs, steps 0-2, 0-4 for 2), a float32 check (the model with
the weights the bad step's forward ran with runs the bad batch in float32, no autocast: finite loss, finite
gradients; for 3, a mask bug, non-finite in float32 too), the producer re-run on those weights under fp16 autocast
(its inputs finite, its output not) and the FIX named per case (the same weights, the same batch, under fp16
autocast: finite). A failing oracle is a plain failure. Only then must the rule be among the report's first three
findings at the PRODUCER, at that step, an `error`, forward phase, with no error at the modules that only passed the
inf/NaN on; a wrong report raises WrongAnswer naming ampdoctor's top three (rule@module op step phase [severity]).

 1. a fused-linear chunked cross-entropy over an 80,000-token vocabulary (Liger / Cut-Cross-Entropy style: the loss
    module `ce` owns the lm_head weight and never materialises the full logits): pass 1 takes the row max over the
    vocabulary chunks, pass 2 accumulates sum_c exp(z_c - m).sum(-1) chunk by chunk in the logits' fp16. The model
    zeroes the hidden states of padding positions before the final norm ("pads cannot leak"); the per-token losses
    are masked after. Packed batches (no padding) until step 7, then the shard's last, short document is padded:
    a padding row's logits are all exactly 0, every exp is 1, the running sum reaches 64,000 after four chunks of
    16,000 and 80,000 = +inf after the fifth; lse = inf, inf * 0 = NaN: the logged loss is NaN while every gradient
    stays finite (the mask's 0 multiplies it away; m is detached), so the scaler skips nothing and training goes on
    with a NaN loss curve -> overflow (nan_origin accepted) at `ce`, step 7 (not `body.norm`, not `body.layers.*`,
    not the root). Fix: the running sum in float32 (twin 6). lr 1e-2 (the 80k-row head learns slowly at 1e-3).
 2. logit distillation with a temperature schedule (T = 4 for the first phase, T = 1 from step 7) and the KL written
    out as sum p_t (log p_t - log q_s) with p_t = softmax(t / T) in the logits' fp16 (`kd`; the teacher a frozen,
    sharper LM inside the wrapper). At T = 4 the teacher's logit spread (24-37 per row) divided by 4 leaves every
    probability a normal fp16 number; at T = 1 the tail probabilities (below e^-17.3) flush to 0, log(0) = -inf and 0 * -inf =
    NaN. The NaN sits in the teacher's (no-grad) term only: the loss is NaN from step 7 on, the student's gradients
    stay finite, the scaler does not skip (its opening search takes steps 0-4 here: the T^2 = 16 factor) -> nan_origin
    (overflow / underflow accepted: log(0) is the first non-finite value) at `kd`, step 7 (not the teacher, whose
    logits are finite). Fix: F.kl_div(log_softmax(s / T), log_softmax(t / T), log_target=True) in
    float32 (twin 7).
 3. sequence packing with a document mask: allowed = causal & same document & key not padding, masked_fill(-inf),
    softmax (eager attention written out). Full packs until step 7, when the epoch's last pack is short and padded
    at the end: a padding query's own key is padding and every earlier key belongs to another document, so its row
    is all -inf and softmax makes NaN in `layers.0.attn` (its q/k/v/o Linears finite); layer 1 reads the NaN values
    through exactly-zero weights (0 * NaN) and every row goes NaN -> nan_origin (mask_value_overflow accepted) at
    `lm.body.layers.0.attn`, step 7 (not `...layers.1.attn`, not `...layers.0`). A mask bug, not a precision one
    (float32 is NaN too, asserted), but CONTRACT's nan_origin is dtype-blind. Fix: padding queries may attend to
    themselves (allowed |= eye).
 4. ORPO (Hong et al. 2024, TRL's odds_ratio_loss on average log-probs) without the float32 upcast of the logits:
    log_odds = (c - r) - (log1p(-exp(c)) - log1p(-exp(r))) in fp16 (`orpo`). The SFT policy has learned to loop
    (after token t its top prediction is t again, by a margin of ~18). At step 7 an on-policy rejected sample is a
    degenerate loop ("t t t t ..."): its average log-prob is ~ -1e-6, exp of it is 1.0 in fp16, log1p(-1) = -inf,
    log_odds = -inf, logsigmoid(-inf) = -inf, loss +inf -> overflow (nan_origin accepted) at `orpo`, step 7 (the
    policy's logits finite). In float32 exp(-1e-6) < 1 and log1p(...) = -13.8. Fix: the log-probs in float32.
 5. IPO (Azar et al. 2023; TRL loss_type="ipo", which uses AVERAGE response log-probs) with the reference's
    log-probs precomputed (precompute_ref_log_probs) and cached in fp16, and the loss (h - 1/(2 beta))^2 with
    h = (pi_c - ref_c) - (pi_r - ref_r) in fp16 (`ipo`). At step 7 a shard of the cache written by an earlier run
    with loss_type="sigmoid" (SUMMED log-probs) arrives: ref_c ~ -360 for an 88-token chosen response, ref_r ~ -29
    for an 8-token rejected one, h ~ 330 and h^2 passes 65504 -> overflow (nan_origin accepted) at `ipo`, step 7
    (the policy's logits finite). Fix: h in float32.
Healthy twins (the fix applied, the same special batches; also run unwatched: losses and final weights bitwise
identical with and without the watch; no warning, no error, no RuntimeWarning of ampdoctor's):
 6. twin of 1: the chunked cross-entropy's running sum in float32 (the padded pack included; 18 steps) -> quiet.
 7. twin of 2: the KL by F.kl_div on float32 log-probs, log_target=True (T = 1 from step 7; 14 steps) -> quiet.

Result when written (torch 2.13 CPU, default watch): 7/7 right, no xfail. Top findings:
1 `[error] overflow at ce aten::add step 7` ("produced +inf from finite inputs; it propagates to aten::mul"), the
  only finding;
2 `[error] overflow at kd aten::log step 7` (singular point), `[error] underflow at kd aten::log step 7` ("a
  softmax probability below 6e-8 becomes 0"), `[info] nan_origin at kd step 1` (the opening backoffs);
3 `[error] nan_origin at lm.body.layers.0.attn aten::_softmax step 7`, `[error] skipped_steps (run) step 7`;
4 `[error] overflow at orpo aten::log1p step 7`, `[error] underflow at orpo aten::log1p step 7`;
5 `[error] overflow at ipo aten::pow step 7` ("input up to 355.2; in fp16 x**2 is inf for |x| > 255.9");
6, 7 quiet; losses and final weights bitwise identical with and without the watch.
Not built: a Gemma-style `x * sqrt(d)` normaliser (the embedding's output stays float32 under CPU autocast: no fp16
op sees it unless the base model is held in fp16); an RMSNorm eps of 1e-6 "vanishing" (it is a subnormal, 1.01e-6,
not 0, in fp16: rsqrt(eps) = 993 is finite; the backward rsqrt^3 of a zero row is set 27's case 8); logit
soft-capping cap * tanh(x / cap) after an fp16 overflow (tanh(inf) = 1 gives what float32 gives: no wrong value
to find, set 38 says the same); q.k growth after LR warmup without QK-norm (no deterministic, known step in a unit
test's few steps); router logits under a too-high router LR (F.softmax subtracts the max: no fp16 producer before
the Linear itself passes 65504; hand-written router softmaxes are sets 18 and 27).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants56.py
"""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import (Producer, WrongAnswer, at_top3, finite, probe_run, quiet_twin,
                           real_fwd_after_backoffs as real_fwd)
from scenarios import gen, lines, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")
BAD_AT = 7


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def own_loss(out, y):
    """The models below compute their own training loss."""
    return out


def run(m, batch, steps, run_dir, *, lr=1e-3, oracle=lambda m: Producer(m, with_kwargs=True), **kw):
    """probe_harness.probe_run at ampdoctor's default settings; the oracle a Producer on keyword inputs too."""
    r = probe_run(m, batch, own_loss, steps, run_dir, lr=lr, oracle=oracle, **kw)
    if DEBUG:
        print("first", r["first"], "bad_loss", r["bad_loss"], "skipped", r["skipped"])
        print("losses", [round(v, 4) for v in r["losses"]])
        if r["rep"] is not None:
            print("\n".join(lines(r["rep"])))
    return r


def snapshot_model(make, r, **kw):
    """A fresh model (`make(**kw)`) with the weights (and buffers) the bad step's forward ran with."""
    torch.manual_seed(0)
    m = make(**kw)
    m.load_state_dict(r["sd"])
    return m


def fp32_finite(make, r, batch, step):
    """The bad batch is an fp16 failure: the bad step's weights run it in float32 (no autocast) to a finite loss with
    finite gradients."""
    m = snapshot_model(make, r)
    args, kwargs, _ = batch(step)
    loss = m(*args, **kwargs)
    loss.backward()
    assert math.isfinite(loss.item()), loss
    assert all(finite(p.grad) for p in m.parameters() if p.grad is not None), step


def fp16_loss(make, r, batch, step, **kw):
    """The bad batch under fp16 autocast on the bad step's weights (`make(**kw)`: the fix): the loss."""
    m = snapshot_model(make, r, **kw)
    args, kwargs, _ = batch(step)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        return m(*args, **kwargs)


def fp16_calls(make, r, batch, step, name):
    """[(inputs, output)] of each call of module `name` when the bad step's forward is re-run under fp16 autocast."""
    m = snapshot_model(make, r)
    seen = []
    h = dict(m.named_modules())[name].register_forward_hook(
        lambda mod, a, kw, o: seen.append((tuple(a) + tuple(kw.values()), o)), with_kwargs=True)
    args, kwargs, _ = batch(step)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        m(*args, **kwargs)
    h.remove()
    return seen


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} {f.op} step {f.step} {f.phase} [{f.severity}]"
            for f in rep.findings[:3]]


def named(r, rules, module, step, phase="forward", quiet_at=()):
    """One of `rules` at the producer `module`, at `step`, in `phase`, an error, among the first three findings, and
    no error at the modules that only passed it on; else a WrongAnswer naming ampdoctor's top three."""
    rep = r["rep"]
    try:
        at_top3(rep, rules, module, step=step, phase=phase, severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:800]})") from None


def twin(make, batch, steps, tmp_path, lr=1e-3, fall=0.9, skips=(), params=None):
    """A healthy twin: watched (with the oracle) and unwatched; healthy, ampdoctor quiet, and the watch changed
    nothing: losses and final weights bitwise identical."""
    torch.manual_seed(0)
    m = make()
    r = run(m, batch, steps, tmp_path / "run", lr=lr, params=params(m) if params else None)
    torch.manual_seed(0)
    m = make()
    bare = run(m, batch, steps, tmp_path / "bare", lr=lr, watch=False, params=params(m) if params else None)
    assert r["losses"] == bare["losses"], (r["losses"], bare["losses"])
    assert all(torch.equal(r["weights"][k], bare["weights"][k]) for k in r["weights"])
    ls = r["losses"]     # healthy (a plain failure otherwise): finite, falling, no producer, no skip but `skips`
    assert all(map(math.isfinite, ls)) and r["first"] is None and sum(ls[-3:]) < fall * sum(ls[:3]), (r["first"], ls)
    assert [s for s in r["skipped"] if s >= 3] == list(skips), r["skipped"]
    try:
        quiet_twin(r, fall=fall, skips=skips)
    except AssertionError as e:
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(r['rep'])} warnings={r['warns']} "
                          f"({str(e)[:800]})") from None
    return r


def check_failure(tmp_path, make, batch, step, name, rules, quiet_at, steps_after=3, lr=1e-3, params=None, skip=True,
                  opening=3, fp32=True):
    """Oracle first (producer `name` at `step`, loss non-finite there, (`skip`) skipped; float32 finite; the
    producer's inputs finite and its output not under fp16; the fix finite), then the report. skip=False: the
    gradients stay finite (the non-finite value is multiplied by a zero mask), the scaler does not skip it. `opening`:
    the scaler's opening search backs off on steps 0 .. opening-1 (the KD loss's T^2 = 16 takes five). fp32=False:
    a dtype-independent failure (a mask bug): the float32 run is non-finite too (asserted)."""
    torch.manual_seed(0)
    m = make()
    r = run(m, batch, step + steps_after, tmp_path / "run", lr=lr, snap_at=step,
            params=params(m) if params else None)
    if skip and opening == 3:
        real_fwd(r, name, step)
    else:
        assert r["first"] == (name, step) and r["bad_loss"] and r["bad_loss"][0] == step, r
        assert all(s < opening for s in r["skipped"] if s < step) and (step in r["skipped"]) == skip, r["skipped"]
    if fp32:
        fp32_finite(make, r, batch, step)
    else:
        args, kwargs, _ = batch(step)
        with torch.no_grad():
            assert not math.isfinite(snapshot_model(make, r)(*args, **kwargs).item())
    calls = fp16_calls(make, r, batch, step, name)
    assert any(finite(a) and not finite(o) for a, o in calls), name
    assert not math.isfinite(fp16_loss(make, r, batch, step).item())
    assert math.isfinite(fp16_loss(make, r, batch, step, fix=True).item())
    named(r, rules, name, step, quiet_at=quiet_at)
    return r


# ======================================================================================================================
# the tiny decoder-only transformer
# ======================================================================================================================
class RMSNorm(nn.Module):
    """LLaMA's: the statistics in float32."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    """Eager causal attention written out; `allowed` [B, T, T] (True: may attend)."""

    def __init__(self, d, heads, fix=False):
        super().__init__()
        self.h, self.dh, self.fix = heads, d // heads, fix
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, allowed):
        B, T, D = x.shape
        q, k, v = (p(x).view(B, T, self.h, self.dh).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = (q @ k.transpose(-1, -2)) * self.dh ** -0.5
        if self.fix:                                    # a padding query may at least attend to itself
            allowed = allowed | torch.eye(T, dtype=torch.bool)
        a = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        return self.o((a @ v).transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d, heads, fix=False):
        super().__init__()
        self.norm1, self.attn = RMSNorm(d), Attention(d, heads, fix)
        self.norm2, self.mlp = RMSNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, allowed):
        x = x + self.attn(self.norm1(x), allowed)
        return x + self.mlp(self.norm2(x))


def causal(B, T):
    return torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)


class Decoder(nn.Module):
    """Token embedding, `n` pre-norm blocks, final norm: the hidden states."""

    def __init__(self, vocab, d=32, heads=2, n=1, fix=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, fix) for _ in range(n))
        self.norm = RMSNorm(d)

    def forward(self, ids, allowed=None, keep=None):
        x = self.embed(ids)
        allowed = causal(*ids.shape) if allowed is None else allowed
        for blk in self.layers:
            x = blk(x, allowed)
        if keep is not None:
            x = x * keep[..., None].to(x.dtype)        # zero the padding positions: nothing can leak from them
        return self.norm(x)


def lm_tokens(g, B, T, vocab, used=200):
    """A learnable toy language: next = (7 prev + 3) mod `used`, with a random start per row."""
    ids = torch.empty(B, T, dtype=torch.long)
    ids[:, 0] = torch.randint(0, used, (B,), generator=g)
    for t in range(1, T):
        ids[:, t] = (7 * ids[:, t - 1] + 3) % used
    return ids


# ======================================================================================================================
# 1./6. a fused-linear chunked cross-entropy over an 80k vocabulary, its running sum of exps in fp16
# ======================================================================================================================
V_CE, CHUNK, B_CE, T_CE = 80_000, 16_000, 4, 16


class ChunkedCE(nn.Module):
    """Fused linear + cross-entropy over vocabulary chunks (owns the lm_head weight): the row max over the chunks,
    then the running sum of exp(z_c - m); per-token losses masked and averaged."""

    def __init__(self, d, vocab, fix=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d) * d ** -0.5)
        self.fix = fix

    def forward(self, h, y, mask):
        chunks = self.weight.split(CHUNK)
        m = torch.stack([F.linear(h, w).amax(-1) for w in chunks], -1).amax(-1).detach()
        s = 0
        for w in chunks:
            e = torch.exp(F.linear(h, w) - m[..., None])
            s = s + (e.float() if self.fix else e).sum(-1)
        lse = m + torch.log(s)
        zy = (h * self.weight[y]).sum(-1)
        return ((lse - zy) * mask).sum() / mask.sum()


class ChunkLM(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.body = Decoder(V_CE, d=32, heads=2, n=1)
        self.ce = ChunkedCE(32, V_CE, fix)

    def forward(self, ids, keep):
        h = self.body(ids[:, :-1], keep=keep[:, :-1])
        mask = (keep[:, :-1] * keep[:, 1:]).float()
        return self.ce(h, ids[:, 1:], mask)


def ce_batch(i):
    """Packed rows (no padding); at BAD_AT the shard's last document is short: row 0 is padded after 10 tokens."""
    g = gen(5610 + i)
    ids = lm_tokens(g, B_CE, T_CE + 1, V_CE)
    keep = torch.ones(B_CE, T_CE + 1)
    if i == BAD_AT:
        ids[0, 10:], keep[0, 10:] = 0, 0
    return (ids, keep), {}, None


def test_chunked_ce_running_sum_of_a_padding_row_overflows_fp16(tmp_path):
    r = check_failure(tmp_path, ChunkLM, ce_batch, BAD_AT, "ce", FWD, skip=False, lr=1e-2,
                      quiet_at=("body", "body.norm", "body.layers.0", "body.layers.0.attn", "body.layers.0.mlp", ""))
    # the mechanism: a padding row's logits are all exactly 0 (sum of exps = V > 65504); a packed row's sum is small
    m = snapshot_model(ChunkLM, r)
    (ids, keep), _, _ = ce_batch(BAD_AT)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        z = F.linear(m.body(ids[:, :-1], keep=keep[:, :-1]), m.ce.weight)
    assert z.dtype == FP16 and bool((z[0, 12] == 0).all())
    assert float(torch.exp(z[1].float() - z[1].float().amax(-1, keepdim=True)).sum(-1).max()) < 20_000


def test_twin_chunked_ce_running_sum_in_fp32_stays_quiet(tmp_path):
    twin(lambda: ChunkLM(fix=True), ce_batch, 18, tmp_path, lr=1e-2)


# ======================================================================================================================
# 2./7. logit distillation with a temperature schedule, the KL written out in fp16
# ======================================================================================================================
V_KD, B_KD, T_KD = 128, 8, 16
KD_SCALE = 10.0                     # the teacher's head x10: its logits span 24-37 per row


class KD(nn.Module):
    """KL(p_t || q_s) at temperature T, times T^2 (Hinton et al.)."""

    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, s, t, T):
        if self.fix:
            ls, lt = F.log_softmax(s.float() / T, -1), F.log_softmax(t.float() / T, -1)
            return F.kl_div(ls.flatten(0, 1), lt.flatten(0, 1), log_target=True, reduction="batchmean") * T * T
        p_t = torch.softmax(t / T, -1)
        kl = (p_t * (torch.log(p_t) - torch.log_softmax(s / T, -1))).sum(-1)
        return kl.mean() * T * T


class TinyLM(nn.Module):
    def __init__(self, vocab, d=32, n=1, scale=1.0, fix=False):
        super().__init__()
        self.body = Decoder(vocab, d=d, heads=2, n=n, fix=fix)
        self.head = nn.Linear(d, vocab, bias=False)
        if scale != 1.0:
            with torch.no_grad():
                self.head.weight.mul_(scale)

    def forward(self, ids, allowed=None):
        return self.head(self.body(ids, allowed))


class Distill(nn.Module):
    """The student and a frozen, sharper teacher (its logits span ~40) in one wrapper; the loss is KD only."""

    def __init__(self, fix=False):
        super().__init__()
        self.student = TinyLM(V_KD)
        torch.manual_seed(1)
        self.teacher = TinyLM(V_KD, scale=KD_SCALE).requires_grad_(False)
        self.kd = KD(fix)

    def forward(self, ids, T):
        with torch.no_grad():
            t = self.teacher(ids)
        return self.kd(self.student(ids), t, T)


def student_params(m):
    return m.student.parameters()


def kd_batch(i):
    """The toy language; T = 4 for the first phase, T = 1 from BAD_AT."""
    ids = lm_tokens(gen(5620 + i), B_KD, T_KD, V_KD, used=V_KD)
    return (ids, 4.0 if i < BAD_AT else 1.0), {}, None


def test_kd_kl_written_out_at_temperature_one_has_log_of_zero(tmp_path):
    check_failure(tmp_path, Distill, kd_batch, BAD_AT, "kd", FWD + ("underflow",),
                  quiet_at=("teacher", "teacher.head", "student", "student.head", ""), params=student_params,
                  opening=5, skip=False)
    # the mechanism: the teacher's fp16 probabilities hold exact zeros at T = 1, none at T = 4
    torch.manual_seed(0)
    m = Distill()
    ids = kd_batch(BAD_AT)[0][0]
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        t = m.teacher(ids)
        assert t.dtype == FP16 and bool((torch.softmax(t, -1) == 0).any())
        assert not bool((torch.softmax(t / 4, -1) == 0).any())


def test_twin_kd_by_kl_div_on_fp32_log_probs_stays_quiet(tmp_path):
    twin(lambda: Distill(fix=True), kd_batch, 14, tmp_path, lr=1e-3, params=student_params)


# ======================================================================================================================
# 3. sequence packing with a document mask: the epoch's last pack is padded at the end
# ======================================================================================================================
V_PK, B_PK, T_PK = 128, 4, 32


class PackedLM(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.lm = TinyLM(V_PK, n=2, fix=fix)

    def forward(self, ids, doc, labels):
        keep = doc >= 0
        allowed = causal(*ids.shape) & (doc[:, :, None] == doc[:, None, :]) & keep[:, None, :]
        logits = self.lm(ids, allowed)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def pack_batch(i):
    """Rows packed from documents of 5-14 tokens (doc ids per position; labels -100 at a document's last token);
    at BAD_AT the epoch's last pack (row 3) runs out of documents after 20 tokens and is padded (doc id -1)."""
    g = gen(5630 + i)
    ids = torch.zeros(B_PK, T_PK, dtype=torch.long)
    doc = torch.zeros(B_PK, T_PK, dtype=torch.long)
    labels = torch.full((B_PK, T_PK), -100)
    for b in range(B_PK):
        t, d = 0, 0
        while t < T_PK:
            n = min(int(torch.randint(5, 15, (1,), generator=g)), T_PK - t)
            ids[b, t:t + n] = lm_tokens(g, 1, n, V_PK, used=V_PK)[0]
            doc[b, t:t + n] = d
            labels[b, t:t + n - 1] = ids[b, t + 1:t + n]
            t, d = t + n, d + 1
    if i == BAD_AT:
        ids[3, 20:], doc[3, 20:], labels[3, 19:] = 0, -1, -100
    return (ids, doc, labels), {}, None


def test_packed_document_mask_leaves_padding_rows_fully_masked(tmp_path):
    check_failure(tmp_path, PackedLM, pack_batch, BAD_AT, "lm.body.layers.0.attn", FWD + ("mask_value_overflow",),
                  fp32=False,
                  quiet_at=("lm.body.layers.0", "lm.body.layers.1", "lm.body.layers.1.attn", "lm.body",
                            "lm.head", "lm", ""))


# ======================================================================================================================
# 4. ORPO's odds ratio on average log-probs in fp16: a degenerate-loop rejected sample
# ======================================================================================================================
V_PO, D_PO, B_PO, P_PO, R_PO, BETA = 64, 64, 4, 8, 16, 0.1


class LoopingLM(nn.Module):
    """An SFT policy that has learned to loop: after token t its top prediction is t again, by a margin of ~18."""

    def __init__(self):
        super().__init__()
        self.body = Decoder(V_PO, d=D_PO, heads=4, n=1)
        self.head = nn.Linear(D_PO, V_PO, bias=False)
        with torch.no_grad():
            self.body.embed.weight.copy_(torch.eye(V_PO) * 8 + 0.05 * torch.randn(V_PO, D_PO))
            for blk in self.body.layers:
                blk.attn.o.weight.mul_(0.02)
                blk.mlp[2].weight.mul_(0.02)
            self.head.weight.copy_(torch.eye(V_PO) * 2.25 + 0.04 * torch.randn(V_PO, D_PO))

    def forward(self, ids):
        return self.head(self.body(ids))


class ORPOLoss(nn.Module):
    """TRL's ORPO: NLL of the chosen half + beta * -logsigmoid(log odds ratio) on average response log-probs."""

    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, logits, ids, resp):
        lp = torch.log_softmax(logits.float() if self.fix else logits, -1)[:, :-1]
        tok = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = resp[:, 1:].to(tok.dtype)
        avg = (tok * m).sum(-1) / m.sum(-1)
        c, r = avg.chunk(2)
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        return -c.mean() - BETA * F.logsigmoid(log_odds).mean()


class ORPO(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.policy = LoopingLM()
        self.orpo = ORPOLoss(fix)

    def forward(self, ids, resp):
        return self.orpo(self.policy(ids), ids, resp)


def orpo_batch(i):
    """Prompt + response, the chosen responses first; responses random tokens that never repeat a token; at BAD_AT
    rejected sample 0 is a degenerate loop: the prompt's last token repeated."""
    g = gen(5640 + i)
    ids = torch.randint(0, V_PO, (2 * B_PO, P_PO + R_PO), generator=g)
    for t in range(1, P_PO + R_PO):
        same = ids[:, t] == ids[:, t - 1]
        ids[same, t] = (ids[same, t] + 1) % V_PO
    ids[B_PO:, :P_PO] = ids[:B_PO, :P_PO]                      # the same prompts
    if i == BAD_AT:
        ids[B_PO, P_PO:] = ids[B_PO, P_PO - 1]
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, P_PO:] = True
    return (ids, resp), {}, None


def test_orpo_log_odds_of_a_looping_rejected_sample_in_fp16(tmp_path):
    r = check_failure(tmp_path, ORPO, orpo_batch, BAD_AT, "orpo", FWD,
                      quiet_at=("policy", "policy.head", "policy.body", ""))
    # the mechanism: the loop's average log-prob is within half an fp16 ulp of 0 below 1.0 (exp rounds to 1)
    m = snapshot_model(ORPO, r)
    ids = orpo_batch(BAD_AT)[0][0]
    with torch.no_grad():
        lp = torch.log_softmax(m.policy(ids).float(), -1)[B_PO, P_PO - 1:-1]
        avg = lp.gather(-1, ids[B_PO, P_PO:, None]).mean()
    assert -2.4e-4 < float(avg) < 0 and torch.exp(avg.half()).item() == 1.0


# ======================================================================================================================
# 5. IPO with reference log-probs precomputed and cached in fp16: a shard cached as per-token averages
# ======================================================================================================================
V_IP, B_IP, P_IP, L_IP = 64, 4, 8, 88
IPO_BETA = 0.1


class IPOLoss(nn.Module):
    """(h - 1 / (2 beta))^2, h = (pi_c - ref_c) - (pi_r - ref_r) on average response log-probs (TRL's IPO)."""

    def __init__(self, fix=False):
        super().__init__()
        self.fix = fix

    def forward(self, logits, ids, resp, ref):
        lp = torch.log_softmax(logits, -1)[:, :-1]
        tok = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = resp[:, 1:]
        pi = ((tok.float() * m).sum(-1) / m.sum(-1)).to(tok.dtype)         # TRL's IPO: average log-probs
        if self.fix:
            pi, ref = pi.float(), ref.float()
        pc, pr = pi.chunk(2)
        rc, rr = ref.chunk(2)
        h = (pc - rc) - (pr - rr)
        return ((h - 1 / (2 * IPO_BETA)) ** 2).mean()


class IPO(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.policy = TinyLM(V_IP)
        self.ipo = IPOLoss(fix)

    def forward(self, ids, resp, ref):
        return self.ipo(self.policy(ids), ids, resp, ref)


@functools.lru_cache(maxsize=None)
def reference():
    """The frozen reference: the policy's initial weights (IPO's model is built under torch.manual_seed(0))."""
    torch.manual_seed(0)
    return TinyLM(V_IP).eval()


def ipo_batch(i):
    """Chosen responses of L_IP tokens, rejected ones of 8 (the rest masked); the reference's average response
    log-probs precomputed (float32, no autocast) and cached in fp16; at BAD_AT the shard's cache was written by an
    earlier run with loss_type="sigmoid" and holds the SUMS."""
    g = gen(5650 + i)
    ids = lm_tokens(g, 2 * B_IP, P_IP + L_IP, V_IP, used=V_IP)
    resp = torch.zeros(2 * B_IP, P_IP + L_IP)
    resp[:B_IP, P_IP:] = 1
    resp[B_IP:, P_IP:P_IP + 8] = 1
    with torch.no_grad():
        lp = torch.log_softmax(reference()(ids), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        ref = (lp * resp[:, 1:]).sum(-1)
    if i != BAD_AT:
        ref = ref / resp[:, 1:].sum(-1)
    return (ids, resp, ref.to(FP16)), {}, None


def test_ipo_square_of_a_mismatched_reference_cache_overflows_fp16(tmp_path):
    check_failure(tmp_path, IPO, ipo_batch, BAD_AT, "ipo", FWD, quiet_at=("policy", "policy.head", "policy.body", ""))
