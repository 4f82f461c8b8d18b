"""FP16 FAILURES UNDER GRADIENT ACCUMULATION (and other loops with several forwards per optimizer step).

CONTRACT.md numbers steps by OPTIMIZER steps (0-based): a loop of 4 micro-batches per step that breaks in micro-batch
3 of step 5 broke at step 5, not at micro-batch 22 (or 21, or 20). Every case here runs its own accumulation loop
(`accum_run`): per optimizer step, zero_grad -> for each micro-batch: fp16 CPU autocast forward (the model computes its
own loss) -> loss / gas -> `scaler.scale(loss).backward()`; then once per step unscale_ -> clip_grad_norm_(1.0) ->
scaler.step -> scaler.update, under `ampdoctor.watch(model, optimizer=AdamW, scaler=GradScaler("cpu"),
run_dir=tmp_path / "run")` at the default settings, read back through `w.report()`. Small models, fixed seeds, one
intra-op thread.

Each failure is proven first by an independent oracle (a failing oracle is a plain failure, never an xfail):
probe_harness.Producer (keyword inputs checked; its `step` kept at the OPTIMIZER step) names the first module whose
output is non-finite while its inputs and own parameters were finite, and the loop notes in which (step, micro-batch,
call) that happened; for the backward-only case Producer(backward=True) names the first module whose input / parameter
gradient is non-finite while its output gradient was finite, with a finite forward. The loop also asserts the loss is
first non-finite there and that the scaler skips that step (before it, only the opening backoffs of steps 0-2). Only
then is the report checked: one of the case's rules (CONTRACT.md) among the first three findings, an `error`, at the
PRODUCER module, at that optimizer step, with no error at the modules that only passed the inf/NaN on; a wrong report
raises WrongAnswer naming ampdoctor's top three (`wrong(...)` marks it as a strict xfail stating what it said).

 1. 4 micro-batches per step (loss / 4), a sensor regressor; micro-batch 3 (index 2) of step 5 holds a row logged in
    raw ADC counts (~2e5) -> overflow at `body.0` (the fp16 cast/linear of the input), step 5 (not 22, not 20/21).
 2. ragged epochs: 22 micro-batches per epoch, 4 per step, the epoch's last step takes the remaining 2 (steps 0-5 in
    epoch 0, step 5 ragged); epoch 1's micro-batch 1 holds a 24-bit WAV read as int32 PCM and never divided by
    2**31 (a 1-D conv audio model) -> overflow at `net.0`, step 6 (global micro-batch 23: 23 // 4 = 5 is wrong).
 3. DDP-style `no_sync()` for all but the last micro-batch, on a plain wrapper (`DDPLike`, `.module`, no process
    group); a mixture-of-experts router with a hand-written softmax (exp without the max subtracted) in fp16: step 3,
    micro-batch 1 holds an outlier -> NaN (inf / inf) at `module.router`, step 3 (nan_origin; overflow accepted).
 4. HF-style `gradient_accumulation_steps = 8`, `loss = loss / gas`: an image model whose micro-batch 6 of step 0
    (the FIRST optimizer step, where the scaler's ordinary opening backoff also happens) is an HDR frame in linear
    radiance (sun pixels 1e5) -> overflow at `stem.0`, step 0, an error (not the opening backoff's info).
 5. a siamese (contrastive-pair) verifier: two forwards of the same encoder per micro-batch; step 4, micro-batch 1,
    the pair's second recording is in raw counts -> overflow at `enc.0` (its 2nd call that micro-batch), step 4.
 6. logit distillation: a frozen teacher (a submodule, no grad, in the optimizer: only the student) and a
    student per micro-batch; the teacher was trained in fp32 on the raw units (x * 100); step 2, micro-batch 3 holds
    a 10-std event that pushes the teacher's 2nd Linear past 65504 ->
    overflow at `teacher.2`, step 2 (not the student, not the KL, not the frozen teacher's other layers).
 7. SFT-style token classifier with CrossEntropyLoss(ignore_index=-100) as a submodule `crit`: step 3, micro-batch
    2's response was truncated away, every label is -100, the mean over 0 tokens is 0/0 -> nan_origin at `crit`,
    step 3 (a dtype-blind bug; the contract's nan_origin names the producer anyway). The ignored tokens' gradients
    are 0, so the scaler does NOT skip (asserted): only the logged loss is NaN.
 8. backward-only: a custom autograd Function (the norm of a feature vector, backward g * x / |x|) in `energy`;
    step 4, micro-batch 1 (the 2nd) is a near-silent frame: |x|^2 underflows to 0 in fp16 while x does not, the
    forward is finite and the backward is x / 0 = inf -> overflow (nan_origin accepted) at `energy`, phase
    backward, step 4, an error. The oracle also re-runs that micro-batch on step 4's weights WITHOUT loss scaling:
    the gradient is non-finite at scale 1 too (the loss scale is not the cause), finite in float32 and with the fix
    (the Function in float32). The backward oracle ignores the scaler's opening backoffs (steps 0-2).
 9. misuse: `optimizer.zero_grad()` inside the micro-batch loop (each micro-batch discards the ones before it) ->
    scaler_misorder (call order, CONTRACT.md), an error, step 0 (the oracle: the gradients the step applies are
    exactly the last micro-batch's alone).
Healthy (also run unwatched: losses and final weights bitwise identical with and without the watch; no warning, no
error in the report):
10. the regressor of 1, 4 micro-batches, no spike.
11. ragged epochs + DDPLike.no_sync + the MoE router with the max subtracted.
12. gas = 8 with the siamese pair (two forwards per micro-batch).

Result when written (torch 2.13 CPU, default watch): 10 passed, 2 strict xfail (wrong), ~6 s.
 1 right: `[error] overflow at body.0 aten::_to_copy step 5`, `[error] skipped_steps (run) step 5`.
 2 right: `[error] overflow at net.0 aten::_to_copy step 6`, `[error] skipped_steps (run) step 6`.
 3 right: `[error] overflow at module.router aten::exp step 3` ("fp16 exp(x) is inf for x > 11.09").
 4 right: `[error] overflow at stem.0 aten::_to_copy step 0`, `[error] skipped_steps at stem.0 step 0`.
 5 right: `[error] overflow at enc.0 aten::addmm step 4` (propagates to `enc.1`).
 6 right: `[error] overflow at teacher.2 aten::addmm step 2` (propagates to the root's log_softmax).
 7 right: `[error] nan_origin at crit aten::nll_loss_forward step 3`.
 8 WRONG when written (xfail): `[info] overflow at energy step 4` "the loss-scaled backward overflowed ... while the loss scale
   was high; GradScaler skipped them and lowered the scale, as designed" -- right module and step, but an info
   blaming the loss scale; truth: an error, the backward is non-finite at scale 1 too. PASS since: the capture
   holds the micro-batch whose backward made the gradients non-finite (record/autocapture.py bad_micro), and the
   replay names the op that overflows at scale 1 when none makes it finite (`[error] nan_origin at energy
   aten::div step 4`; at the capture's scale `head`'s weight gradient overflowed first).
 9 WRONG when written (xfail): no finding at all (the report is empty); truth: scaler_misorder (zero_grad between
   the scaled backward and the step), error, step 0; each step applies the last micro-batch's gradient alone. PASS
   since (rules/callseq.py _zeroed_between_backwards: two or more zero_grads between the backwards of one step).
10-12 quiet (info only: the opening backoff at step 0), bitwise identical with and without the watch.

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_accumulation_failures.py
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer, at_top3, finite
from scenarios import gen, lines, no_error_at, one_thread, alarms

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FWD = ("overflow", "nan_origin")
DEBUG = False


# ======================================================================================================================
# the loop and the checks
# ======================================================================================================================
def accum_run(make, micro, plan, run_dir, *, watch=True, div=None, sync=None, lr=1e-3, backward=False,
              zero="step", grads_at_step=None, params=None, snap_at=None):
    """The user's accumulation loop. `plan`: the number of micro-batches of each optimizer step; `micro(step, k, g)`
    gives micro-batch k of `step` (g: the global micro-batch index) as (args, kwargs). `div`: the loss divisor (None:
    the step's micro-batch count; an int: HF's fixed gradient_accumulation_steps). `sync`: m -> a context manager
    factory for all but the last micro-batch (DDP's no_sync). `zero`: "step" (zero_grad once per step) or "micro"
    (inside the micro-batch loop: the misuse). Returns a dict: first (oracle (module, step)), where ((step, k, call)
    of the first forward producer), first_bwd, where_bwd ((step, k)), bad_loss ((step, k) with a non-finite loss),
    skipped (steps), losses, weights, rep, sd (the state dict step `snap_at` ran with). The backward oracle forgets
    what it saw on a step of the scaler's opening search (steps 0-2, skipped): a scaled backward overflowing there
    is the loss scale's own backoff, by design."""
    torch.manual_seed(0)
    m = make()
    opt = torch.optim.AdamW(m.parameters() if params is None else params(m), lr=lr)
    sc = torch.amp.GradScaler("cpu")
    prod = Producer(m, backward=backward, with_kwargs=True, call_in_first=True) if watch else None
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) if watch else None
    r = dict(where=None, where_bwd=None, bad_loss=[], skipped=[], losses=[], rep=None, applied=[], sd=None)
    g = 0
    for step, n in enumerate(plan):
        if prod is not None:
            prod.step = step
        if step == snap_at:
            r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
        if zero == "step":
            opt.zero_grad()
        for k in range(n):
            if zero == "micro":
                opt.zero_grad()
            before = dict(prod.calls) if prod is not None else {}
            args, kwargs = micro(step, k, g)
            ctx = sync(m)() if sync is not None and k < n - 1 else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = m(*args, **kwargs)
                r["losses"].append(loss.item())
                if not math.isfinite(loss.item()):
                    r["bad_loss"].append((step, k))
                sc.scale(loss / (n if div is None else div)).backward()
            if prod is not None and prod.first is not None and r["where"] is None:
                r["where"] = (step, k, prod.first[2] - before.get(prod.first[:2], 0))   # its call in this micro-batch
            if prod is not None and prod.first_bwd is not None and r["where_bwd"] is None:
                r["where_bwd"] = (step, k)
            g += 1
        if grads_at_step is not None:
            r["applied"].append(grads_at_step(m, step))
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        s0 = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            r["skipped"].append(step)
            if backward and step < 3 and prod is not None and prod.first is None:
                prod.first_bwd, r["where_bwd"] = None, None
    if prod is not None:
        prod.remove()
    if w is not None:
        w.close()
        r["rep"] = w.report()
    r["first"] = prod.first[:2] if prod is not None and prod.first is not None else None
    r["first_bwd"] = prod.first_bwd if prod is not None else None
    r["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    if DEBUG:
        print("where", r["where"], "first", r["first"], "first_bwd", r["first_bwd"], r["where_bwd"])
        print("bad_loss", r["bad_loss"][:4], "skipped", r["skipped"])
        if r["rep"] is not None:
            print("\n".join(lines(r["rep"])[:6]))
    return r


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} {f.op} step {f.step} {f.phase} [{f.severity}]"
            for f in rep.findings[:3]]


def real(r, name, step, k, call=1, bwd=False, skip=True):
    """The oracle: the producer `name` first at optimizer step `step`, micro-batch `k` (its `call`-th call there);
    the loss first non-finite there (forward) or finite throughout (backward); the scaler skips `step` (`skip=False`:
    it does not, the gradients are finite), and before it only the opening backoffs (steps 0-2)."""
    if bwd:
        assert r["first"] is None and r["bad_loss"] == [], r
        assert r["first_bwd"] == (name, step) and r["where_bwd"] == (step, k), r
    else:
        assert r["first"] == (name, step) and r["where"] == (step, k, call), r
        assert r["bad_loss"] and r["bad_loss"][0] == (step, k), r["bad_loss"]
    assert (step in r["skipped"]) == skip and all(s < 3 for s in r["skipped"] if s < step), r["skipped"]


def named(r, rules, module, step, phase="forward", quiet_at=()):
    """One of `rules` at the producer `module`, at optimizer step `step`, in `phase`, an error, among the first
    three findings; no error at the modules that only passed it on. Else a WrongAnswer naming the top three."""
    rep = r["rep"]
    try:
        at_top3(rep, rules, module, step=step, phase=phase, severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} ({str(e)[:600]})") from None


def healthy_twin(make, micro, plan, tmp_path, **kw):
    """Watched and unwatched: bitwise identical losses and weights; healthy (finite, falling, no producer, no skip
    after the opening backoffs); the report has no warning or error."""
    r = accum_run(make, micro, plan, tmp_path / "run", **kw)
    bare = accum_run(make, micro, plan, tmp_path / "bare", watch=False, **kw)
    assert r["losses"] == bare["losses"], (r["losses"][:8], bare["losses"][:8])
    assert all(torch.equal(r["weights"][k], bare["weights"][k]) for k in r["weights"])
    ls = r["losses"]
    n = max(2, len(ls) // 4)
    assert all(map(math.isfinite, ls)) and r["first"] is None and sum(ls[-n:]) < 0.9 * sum(ls[:n]), (r["first"], ls)
    assert [s for s in r["skipped"] if s >= 3] == [], r["skipped"]
    rep = r["rep"]
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(rep)}")
    return r


# ======================================================================================================================
# 1./10. a sensor regressor, 4 micro-batches per step; a raw-ADC row in micro-batch 3 of step 5
# ======================================================================================================================
W_REG = torch.randn(16, 1, generator=gen(4242)) * 0.5


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.body(x)).float(), y)


def reg_micro(spike=None):
    def micro(step, k, g):
        x = torch.randn(8, 16, generator=gen(100 + g % 16))
        y = x @ W_REG
        if spike == (step, k):
            x = x.clone()
            x[3] = torch.rand(16, generator=gen(7)) * 2e5 + 1e5       # raw ADC counts, never scaled
        return (x, y), {}
    return micro


def test_spike_in_micro_batch_3_of_step_5_is_step_5(tmp_path):
    r = accum_run(Regressor, reg_micro(spike=(5, 2)), [4] * 8, tmp_path / "run")
    real(r, "body.0", 5, 2)
    named(r, FWD, "body.0", 5, quiet_at=("body.1", "body.2", "body.3", "body", "head", ""))


def test_healthy_four_micro_batches(tmp_path):
    healthy_twin(Regressor, reg_micro(), [4] * 12, tmp_path, lr=1e-2)


# ======================================================================================================================
# 2. ragged epochs (22 micro-batches, 4 per step: the last step of an epoch takes 2); an int16 clip in epoch 1
# ======================================================================================================================
EPOCH, GAS = 22, 4


def ragged_plan(epochs):
    per = [GAS] * (EPOCH // GAS) + ([EPOCH % GAS] if EPOCH % GAS else [])
    return per * epochs


class AudioNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 16, 9, padding=4), nn.ReLU(), nn.Conv1d(16, 32, 9, padding=4),
                                 nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, wav, y):
        h = self.net(wav).mean(-1)
        return F.cross_entropy(self.head(h).float(), y)


def audio_micro(bad_g=None):
    def micro(step, k, g):
        gg = gen(300 + g % EPOCH)
        y = torch.randint(0, 4, (6,), generator=gg)
        t = torch.arange(256) / 256
        wav = torch.sin(2 * math.pi * (3 + 3 * y[:, None]) * t) + 0.3 * torch.randn(6, 256, generator=gg)
        wav = wav[:, None] * 0.5
        if g == bad_g:
            wav = (wav * 2 ** 31).round()              # a 24-bit WAV read as int32 PCM, never divided by 2**31
        return (wav, y), {}
    return micro


def test_ragged_epoch_end_then_a_spike_is_the_optimizer_step(tmp_path):
    plan = ragged_plan(2)                       # [4, 4, 4, 4, 4, 2, 4, 4, 4, 4, 4, 2]
    assert plan[5] == 2 and sum(plan[:6]) == EPOCH
    r = accum_run(AudioNet, audio_micro(bad_g=EPOCH + 1), plan[:9], tmp_path / "run")
    real(r, PROD_AUDIO, 6, 1)
    named(r, FWD, PROD_AUDIO, 6, quiet_at=tuple({"net", "net.0", "net.1", "net.2", "net.3", "head", ""} - {PROD_AUDIO}))


PROD_AUDIO = "net.0"


# ======================================================================================================================
# 3./11. DDP-style no_sync on a plain wrapper; a MoE router's hand-written softmax
# ======================================================================================================================
class Router(nn.Module):
    def __init__(self, d, e, fix=False):
        super().__init__()
        self.proj, self.fix = nn.Linear(d, e), fix

    def forward(self, x):
        z = self.proj(x)
        if self.fix:
            z = z - z.amax(-1, keepdim=True)
        ez = z.exp()                                    # the hand-written softmax, in the Linear's fp16
        return ez / ez.sum(-1, keepdim=True)


class MoE(nn.Module):
    def __init__(self, fix=False, d=16, e=4):
        super().__init__()
        self.router = Router(d, e, fix)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, 1)) for _ in range(e))

    def forward(self, x, y):
        p = self.router(x)
        out = torch.stack([ex(x) for ex in self.experts], -1).squeeze(1)
        return F.mse_loss((p * out).sum(-1).float(), y)


class DDPLike(nn.Module):
    """What DDP looks like to a loop: `.module`, `no_sync()`; no process group here."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def forward(self, *a, **k):
        return self.module(*a, **k)


W_MOE = torch.randn(16, generator=gen(77)) * 0.5


def moe_micro(spike=None):
    def micro(step, k, g):
        x = torch.randn(8, 16, generator=gen(500 + g % 11))
        y = torch.tanh(x @ W_MOE)
        if spike == (step, k):
            x = x.clone()
            x[5] = x[5] * 60                            # an outlier row (a unit mix-up upstream)
        return (x, y), {}
    return micro


def test_no_sync_wrapper_router_softmax_nan(tmp_path):
    r = accum_run(lambda: DDPLike(MoE()), moe_micro(spike=(3, 1)), [4] * 6, tmp_path / "run",
                  sync=lambda m: m.no_sync)
    real(r, "module.router", 3, 1)
    named(r, ("nan_origin", "overflow"), "module.router", 3,
          quiet_at=("module.router.proj", "module", "", "module.experts.0"))


def test_healthy_ragged_no_sync_stable_router(tmp_path):
    plan = [4, 4, 3] * 4
    healthy_twin(lambda: DDPLike(MoE(fix=True)), moe_micro(), plan, tmp_path, sync=lambda m: m.no_sync, lr=3e-3)


# ======================================================================================================================
# 4. HF gradient_accumulation_steps = 8, loss / gas: an HDR frame in micro-batch 6 of step 0
# ======================================================================================================================
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(32, 5)

    def forward(self, pixel_values, labels):
        h = self.body(self.stem(pixel_values)).mean((2, 3))
        return F.cross_entropy(self.head(h).float(), labels)


def img_micro(hdr=None):
    def micro(step, k, g):
        gg = gen(900 + g % 24)
        labels = torch.randint(0, 5, (4,), generator=gg)
        px = torch.rand(4, 3, 16, 16, generator=gg) * 0.5 + labels[:, None, None, None] * 0.1
        if hdr == (step, k):
            px = px.clone()
            px[1, :, 4:8, 4:8] = 1.2e5                  # the sun in linear radiance (an .exr, not tone-mapped)
        return (), {"pixel_values": px, "labels": labels}
    return micro


def test_hf_gas8_hdr_frame_in_first_optimizer_step(tmp_path):
    r = accum_run(SmallCNN, img_micro(hdr=(0, 6)), [8] * 4, tmp_path / "run", div=8)
    real(r, "stem.0", 0, 6)
    named(r, FWD, "stem.0", 0, quiet_at=("stem.1", "stem", "body", "body.0", "body.1", "head", ""))


# ======================================================================================================================
# 5./12. a siamese verifier: two forwards of the encoder per micro-batch
# ======================================================================================================================
class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, a, b, same):
        za, zb = self.enc(a), self.enc(b)
        d = (za.float() - zb.float()).pow(2).sum(-1)
        return (same * d + (1 - same) * F.relu(4.0 - d)).mean()


def pair_micro(raw=None):
    def micro(step, k, g):
        gg = gen(1200 + g % 20)
        a = torch.randn(8, 24, generator=gg)
        same = (torch.rand(8, generator=gg) < 0.5).float()
        b = torch.where(same[:, None] > 0, a + 0.1 * torch.randn(8, 24, generator=gg), torch.randn(8, 24, generator=gg))
        if raw == (step, k):
            b = b * 4096 + 3e4                                  # the second device logs raw counts
        return (a, b, same), {}
    return micro


def test_siamese_second_forward_overflow(tmp_path):
    r = accum_run(Siamese, pair_micro(raw=(4, 1)), [4] * 7, tmp_path / "run")
    real(r, "enc.0", 4, 1, call=2)
    named(r, FWD, "enc.0", 4, quiet_at=("enc.1", "enc.2", "enc", ""))


def test_healthy_gas8_two_forwards(tmp_path):
    healthy_twin(Siamese, pair_micro(), [8] * 8, tmp_path, div=8, lr=3e-3)


# ======================================================================================================================
# 6. distillation: a frozen teacher overflows on a hard input
# ======================================================================================================================
RAW_KD = 100.0


class Distill(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 6))
        with torch.no_grad():                           # fp32-trained on unnormalised features: large weights
            for lin in (self.teacher[0], self.teacher[2]):
                lin.weight.mul_(12.0)
        self.teacher.requires_grad_(False).eval()
        torch.manual_seed(2)
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 6))

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x * RAW_KD)                # the teacher was trained on the raw (physical) units
        s = self.student(x)
        return F.kl_div(F.log_softmax(s.float() / 4, -1), F.log_softmax(t.float() / 4, -1), log_target=True,
                        reduction="batchmean")


def kd_micro(hard=None):
    def micro(step, k, g):
        x = torch.randn(8, 16, generator=gen(1500 + g % 12))
        if hard == (step, k):
            x = x.clone()
            x[2] = x[2] * 10                            # a 10-std event (a storm in the sensor log)
        return (x,), {}
    return micro


def test_distillation_frozen_teacher_overflows(tmp_path):
    r = accum_run(Distill, kd_micro(hard=(2, 3)), [4] * 5, tmp_path / "run",
                  params=lambda m: m.student.parameters())
    real(r, PROD_KD, 2, 3)
    named(r, FWD, PROD_KD, 2, quiet_at=tuple({"teacher", "teacher.0", "teacher.1", "teacher.2", "teacher.3",
                                              "teacher.4", "student", "student.0", "student.2", ""} - {PROD_KD}))


PROD_KD = "teacher.2"


# ======================================================================================================================
# 7. SFT token classifier: a micro-batch whose labels are all -100 (mean over 0 tokens)
# ======================================================================================================================
class TokenTagger(nn.Module):
    def __init__(self, vocab=50, d=32, c=7):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.out = nn.Linear(d, c)
        self.crit = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, input_ids, labels):
        logits = self.out(self.mix(self.emb(input_ids)))
        return self.crit(logits.float().flatten(0, 1), labels.flatten())


def sft_micro(empty=None):
    def micro(step, k, g):
        gg = gen(1800 + g % 10)
        ids = torch.randint(0, 50, (4, 12), generator=gg)
        labels = ids % 7
        labels[:, :5] = -100                                  # the prompt is masked
        if empty == (step, k):
            labels[:] = -100                                  # the response was truncated away
        return (), {"input_ids": ids, "labels": labels}
    return micro


def test_all_labels_ignored_micro_batch_nan(tmp_path):
    r = accum_run(TokenTagger, sft_micro(empty=(3, 2)), [4] * 6, tmp_path / "run")
    real(r, "crit", 3, 2, skip=False)      # the ignored tokens' gradients are 0: finite, the step is taken
    named(r, ("nan_origin",), "crit", 3, quiet_at=("out", "mix", "mix.0", "emb", ""))


# ======================================================================================================================
# 8. backward only: a custom Function's backward (g * x / |x|) after |x|^2 underflows to 0 in fp16
# ======================================================================================================================
class VecNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        n = (x * x).sum(-1, keepdim=True).sqrt()
        ctx.save_for_backward(x, n)
        return n

    @staticmethod
    def backward(ctx, g):
        x, n = ctx.saved_tensors
        return g * x / n


class Energy(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) * 0.25)

    def forward(self, x):
        return VecNorm.apply(F.linear(x, self.weight))


class EnergyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.energy = Energy()
        self.head = nn.Linear(17, 1)

    def forward(self, x, y):
        h = torch.cat([x, self.energy(x).to(x.dtype)], -1)
        return F.mse_loss(self.head(h).float().squeeze(-1), y)


def energy_micro(silent=None):
    def micro(step, k, g):
        x = torch.randn(8, 16, generator=gen(2100 + g % 12))
        if silent == (step, k):
            x = x.clone()
            x[4] = x[4] * 1e-5                                   # a near-silent frame
        return (x, x.pow(2).sum(-1).sqrt() * 0.1), {}
    return micro


def test_custom_function_backward_overflow_in_micro_batch_2(tmp_path):
    r = accum_run(EnergyNet, energy_micro(silent=(4, 1)), [4] * 7, tmp_path / "run", backward=True, snap_at=4)
    real(r, "energy", 4, 1, bwd=True)
    (x, y), _ = energy_micro(silent=(4, 1))(4, 1, 17)

    def grads(autocast, fix=False):
        """The bad micro-batch on the weights step 4 ran with, backward WITHOUT loss scaling: energy's gradient."""
        torch.manual_seed(0)
        m = EnergyNet()
        m.load_state_dict(r["sd"])
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            h = F.linear(x, m.energy.weight)
            if fix:                                                  # the fix: the Function in float32
                h = h.float()
            loss = F.mse_loss(m.head(torch.cat([x, VecNorm.apply(h).to(x.dtype)], -1)).float().squeeze(-1), y)
        loss.backward()
        return h, loss, m.energy.weight.grad

    h, loss, g = grads(True)
    assert math.isfinite(loss.item()) and not finite(g)              # finite forward, non-finite backward at scale 1
    assert h.dtype == torch.float16 and bool((h[4] != 0).any()) and float((h[4] * h[4]).sum()) == 0.0
    assert finite(grads(False)[2]) and finite(grads(True, fix=True)[2])   # float32 / the fix: finite
    named(r, FWD, "energy", 4, phase="backward", quiet_at=("head", ""))


# ======================================================================================================================
# 9. misuse: zero_grad inside the micro-batch loop
# ======================================================================================================================
def test_zero_grad_inside_micro_batch_loop(tmp_path):
    seen = {}

    def grads(m, step):
        if step == 0:
            seen["g"] = {n: p.grad.clone() for n, p in m.named_parameters()}
            seen["sd"] = {n: v.detach().clone() for n, v in m.state_dict().items()}
        return None

    r = accum_run(Regressor, reg_micro(), [4] * 6, tmp_path / "run", zero="micro", grads_at_step=grads)
    # the oracle: step 0 applies the LAST micro-batch's (scaled) gradient alone
    m = Regressor()
    m.load_state_dict(seen["sd"])
    (x, y), _ = reg_micro()(0, 3, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(x, y)
    (loss / 4 * 65536.0).backward()
    assert all(torch.equal(p.grad, seen["g"][n]) for n, p in m.named_parameters())
    rep = r["rep"]
    try:
        f = next(f for f in rep.findings[:3] if f.rule == "scaler_misorder")
        assert f.severity == "error" and f.step == 0, f.one_line()
    except (StopIteration, AssertionError) as e:
        raise WrongAnswer(f"top3={top3(rep)} ({e!r})") from None
