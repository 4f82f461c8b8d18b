"""SYSTEMS failure patterns (shared/FP16.md "Systems") and their neighbours, in ordinary user code: custom autograd
Functions with and without torch.amp.custom_fwd, activation checkpointing, DistributedDataParallel (one-process
gloo group), nn.DataParallel on the CPU, torch.func.functional_call, torch.nn.utils.parametrize, user forward hooks,
a frozen encoder run under torch.no_grad inside forward, and buffers updated in forward (fp8-style delayed scaling).
Tiny models (width 16-64, batch 8), fp16 CPU autocast + GradScaler("cpu"), watched through the public API only
(probe_harness.probe_run: `ampdoctor.watch(model, optimizer=AdamW, scaler=GradScaler("cpu"), run_dir=...)` at the
default settings, scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> close() ->
report()).

The trigger arrives with the data at step K = 5 (one sample of the batch un-normalised, or far too small). Each
failure is first proven by the file's own oracle (probe_harness.Producer on the watched object: the module and step
where the first inf/NaN is made from finite inputs; for the backward case, the first module whose input gradient is
non-finite while its output gradient was finite); a failing oracle is a plain failure, never an xfail. Then the
CONTRACT.md rule must be among the FIRST THREE findings, warning or error, at the producer module and step K
(probe_harness.named_top3; a wrong report would raise WrongAnswer, marked with probe_harness.wrong). Names: CONTRACT.md says
`module` is the qualified name from `named_modules()` of the WATCHED model, so for a watched DDP / DataParallel
wrapper the producer is `module.ff`; the inner name `ff` is accepted too (it names the same module).
Healthy twins: no warning/error (quiet_twin) and the losses and the final state dict (weights and buffers) bitwise
identical with and without the watch.

Cases:
 1. fn_no_custom_fwd   a hand-written fused softmax autograd.Function (exp(x) / sum exp(x), no max shift, its own
                       backward) WITHOUT custom_fwd: autocast hands it fp16 logits; at step 5 a logit > 11.1 ->
                       exp = inf -> inf / inf = NaN -> nan_origin (or overflow) at `smax`, step 5.
 2. fn_custom_fwd      twin of 1 with @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32) /
                       custom_bwd: the same logits (< 88) are finite in fp32: quiet, bitwise identical.
 3. fn_bwd_only        a hand-written L2-norm Function (forward sqrt(sum x^2), backward g * x / n): at step 5 a
                       sample ~1e-5 (x^2 flushes to 0 in fp16, n = 0): forward finite, backward x / 0 = inf ->
                       overflow (or nan_origin) at `norm`, backward, step 5.
 4. ckpt_reentrant     torch.utils.checkpoint(use_reentrant=True) around each GeGLU block (recomputed in backward);
                       at step 5 gelu(gate) * up of `blocks.1` passes 65504 (blocks.0's output stays finite) ->
                       overflow at `blocks.1`, step 5 (oracle: FwdOracle, a plain forward-hook oracle).
 5. ckpt_nonreentrant  the same with use_reentrant=False (proof: an oracle run stopped after step 5's forward, see
                       the test; any input-reading forward-hook oracle, probe_harness.Producer included, makes
                       torch's non-reentrant checkpoint raise CheckpointError in step 5's backward, watch or not).
 6. ckpt_healthy       twins of 4/5 on ordinary data (both modes): quiet, bitwise identical.
 7. ddp_healthy        DistributedDataParallel(world_size=1, gloo, FileStore in /root/scratch): quiet, bitwise
                       identical to the unwatched DDP twin.
 8. ddp_overflow       the same DDP with the GeGLU of 4 unprotected: overflow at `module.ff` (or `ff`), step 5.
 9. functional_call    the model called through torch.func.functional_call(model, params, (x,)) (the MAML /
                       ensembling idiom): overflow at `ff`, step 5.
10. parametrize        the first Linear under torch.nn.utils.parametrizations.weight_norm with a grown gain: the
                       raw sample of step 5 takes its output past 65504 -> overflow at `fc1` (not at its
                       parametrization submodules), step 5.
11. user_hook          a user forward hook on `enc` multiplies its output by 1e3 (a de-normalisation hook
                       registered before watch): at step 5 enc's hooked output passes 65504; the next module
                       (`norm`, LayerNorm) turns the inf into NaN -> overflow at `enc` (the hooked module), step 5.
12. dataparallel      nn.DataParallel on the CPU (no device ids: it calls its module) around the GeGLU net:
                      overflow at `module.ff` (or `ff`), step 5.
13. frozen_no_grad    a frozen GeGLU encoder (requires_grad False) run under `with torch.no_grad()` inside the
                      model's forward, a trainable head: overflow at `encoder`, step 5 (no backward through it).
14. buffer_delayed    fp8-style delayed scaling: a module scales its input by target / amax with amax a buffer
                      updated in forward from the PREVIOUS batches; the raw sample of step 5 times 30000 / amax_prev
                      passes 65504 -> overflow at `scale`, step 5.
15. buffer_healthy    the same module with target 1 (normalise to ~1): quiet, losses and state dict (buffers
                      included) bitwise identical with and without the watch.
Not built: a torch.jit.script'ed submodule (TorchScript is deprecated and its modules take no Python forward hooks,
so neither the oracle nor a watch can see inside it).

Result when written (torch 2.13 CPU, default watch): 16 pass, 0 xfail (stable over two runs, ~4-17 s); no wrong
answer found. First findings (abridged):
 1. [error] overflow at smax aten::exp step 5 (input up to 22.3; "fp16 exp(x) is inf for x > 11.09").
 3. [error] nan_origin at norm aten::div step 5, "the backward of L2NormBackward ... produced NaN from finite
    gradients"; [warning] skipped_steps "non-finite at every loss scale down to 1".
 4, 5. [error] overflow at blocks.1 aten::mul step 5 (propagates to blocks.1.down).
 8, 12. [error] overflow at module.ff aten::mul step 5 (the watched wrapper's name, as CONTRACT.md says).
 9. [error] overflow at ff aten::mul step 5.   10. [error] overflow at fc1 aten::addmm step 5.
11. [error] overflow at enc aten::mul step 5 (the user hook's mul, attributed to the hooked module).
13. [error] overflow at encoder aten::mul step 5.
14. [error] overflow at scale aten::mul step 5 (and a [warning] overflow_risk at scale from step 0: its output
    reached 4.5e4 on ordinary batches, which is true - the delayed scaling targets 30000).
 2, 6, 7, 15. quiet (at most [info] for the scaler's opening backoff), losses and state dicts bitwise identical.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from probe_harness import Producer, finite, named_top3, probe_run, quiet_twin
from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

D, B, K, STEPS, STEPS_H = 16, 8, 5, 8, 12
ALARM = ("warning", "error")
FWD = ("overflow", "nan_origin")
TARGET_W = torch.randn(D, 1, generator=gen(77)) * 0.1
SCRATCH = "/root/scratch"


# ======================================================================================================================
# data, loss, checks
# ======================================================================================================================
def batch_fn(trig=None):
    """Step i's (args, y): x ~ N(0, 1) (4 distinct batches, cycled), y = x @ TARGET_W; at step K sample 0 of x is
    multiplied by `trig` (an un-normalised, or far too small, sample)."""
    def batch(i):
        x = torch.randn(B, D, generator=gen(100 + i % 4))
        y = x @ TARGET_W                            # the target of the normalised sample
        if i == K and trig is not None:
            x = x.clone()
            x[0] *= trig
        return (x,), y
    return batch


def mse(out, y):
    if isinstance(out, dict):
        out = out["pred"]
    return F.mse_loss(out.float(), y)


def real(r, module, step=K):
    """The oracle: the first inf/NaN from finite inputs is made by `module` at `step`; before `step` nothing but the
    scaler's first backoffs (steps 0-2) and no non-finite loss; the loss is non-finite at `step`."""
    assert r["first"] == (module, step), (r["first"], r["bad_loss"], r["skipped"])
    assert all(s < 3 for s in r["skipped"] if s < step) and not [s for s in r["bad_loss"] if s < step], r
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


class FwdOracle:
    """A plain forward producer oracle for the checkpointed models: the first (module, step) whose output is
    non-finite while its positional inputs were finite. (probe_harness.Producer itself makes torch's
    non-reentrant checkpoint raise CheckpointError "A different number of tensors was saved during the original
    forward and recomputation" in the backward of the inf step, watch or no watch; these hooks do not.)"""

    def __init__(self, m):
        self.step, self.first, self.first_bwd, self.calls = 0, None, None, {}
        self.hs = [mod.register_forward_hook(self._fwd(n)) for n, mod in m.named_modules()]

    def _fwd(self, n):
        def f(mod, inp, out):
            if self.first is None and finite(inp) and not finite(out):
                self.first = (n, self.step)
        return f

    def remove(self):
        for h in self.hs:
            h.remove()


def named_any(rep, rules, modules, step=K):
    """named_top3 for the first of `modules` that matches (a wrapper's `module.x` or the inner `x`)."""
    err = None
    for mod in modules:
        try:
            return named_top3(rep, rules, mod, step, ALARM)
        except AssertionError as e:         # WrongAnswer
            err = e
    raise err


def run(m, batch, tmp_path, steps=STEPS, lr=1e-2, **kw):
    return probe_run(m, batch, mse, steps, str(tmp_path / "run"), lr=lr, **kw)


def twin(make, batch, tmp_path, steps=STEPS_H, lr=1e-2, call=None, **kw):
    """The healthy twin: watched and unwatched runs of fresh models from `make()`; quiet, losses and the final state
    dict bitwise identical. `call(m)` gives the forward to run (default the model)."""
    m1, m2 = make(), make()
    r = probe_run(m1, batch, mse, steps, str(tmp_path / "run"), lr=lr,
                  call=None if call is None else call(m1), **kw)
    r0 = probe_run(m2, batch, mse, steps, str(tmp_path / "run0"), lr=lr, watch=False,
                   call=None if call is None else call(m2), **kw)
    quiet_twin(r)
    assert r["losses"] == r0["losses"], (r["losses"], r0["losses"])
    assert r["weights"].keys() == r0["weights"].keys()
    for k, v in r["weights"].items():
        assert torch.equal(v, r0["weights"][k]), k
    return r


# ======================================================================================================================
# models
# ======================================================================================================================
class HandSoftmax(torch.autograd.Function):
    """A "fused" softmax by hand: no max shift, its own backward; no custom_fwd (autocast gives it fp16)."""

    @staticmethod
    def forward(ctx, x):
        e = x.exp()
        y = e / e.sum(-1, keepdim=True)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        y, = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True))


class HandSoftmax32(torch.autograd.Function):
    """The same kernel declared for autocast: its inputs cast to fp32, the backward in the forward's autocast state."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        e = x.exp()
        y = e / e.sum(-1, keepdim=True)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        y, = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True))


class Smax(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


class MixNet(nn.Module):
    """proj -> softmax mixing weights (the Function) -> a weighted sum of learned prototypes -> head."""

    def __init__(self, fn):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.smax = nn.Linear(D, 8), Smax(fn)
        self.protos = nn.Linear(8, D, bias=False)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.protos(self.smax(self.proj(x))))


class L2Norm(torch.autograd.Function):
    """A per-row L2 norm by hand: forward sqrt(sum x^2), backward g * x / n (no eps)."""

    @staticmethod
    def forward(ctx, x):
        n = (x * x).sum(-1, keepdim=True).sqrt()
        ctx.save_for_backward(x, n)
        return n

    @staticmethod
    def backward(ctx, g):
        x, n = ctx.saved_tensors
        return g * x / n


class NormFeat(nn.Module):
    def forward(self, h):
        return L2Norm.apply(h)


class NormNet(nn.Module):
    """proj (no bias) -> [h, |h|] -> head: a magnitude feature next to the direction."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.norm, self.head = nn.Linear(D, 8, bias=False), NormFeat(), nn.Linear(9, 1)

    def forward(self, x):
        h = self.proj(x)
        return self.head(torch.cat([h, self.norm(h)], -1))


class GeGLU(nn.Module):
    """down(gelu(gate(x)) * up(x)); gate and up weights grown x `grow` (as a trained FFN's are)."""

    def __init__(self, d=D, hidden=32, grow=2.0):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)
        with torch.no_grad():
            self.gate.weight.mul_(grow)
            self.up.weight.mul_(grow)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class FFNet(nn.Module):
    """inp -> GeGLU `ff` (+ residual) -> head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.ff, self.head = nn.Linear(D, D), GeGLU(), nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.ff(h))


class CkptNet(nn.Module):
    """inp -> two GeGLU blocks, each under torch.utils.checkpoint (recomputed in the backward) -> head."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(GeGLU() for _ in range(2))
        self.head = nn.Linear(D, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(h)


class WNNet(nn.Module):
    """fc1 under weight_norm (its gain g grown, as a trained one is) -> GELU -> fc2."""

    def __init__(self, gain=20.0):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.utils.parametrizations.weight_norm(nn.Linear(D, 64))
        self.act, self.fc2 = nn.GELU(), nn.Linear(64, 1)
        with torch.no_grad():
            self.fc1.parametrizations.weight.original0.mul_(gain)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)) * 1e-2)


class HookNet(nn.Module):
    """enc -> LayerNorm -> head, with the user's forward hook on enc: output x 1e3 (registered at construction)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.norm, self.head = nn.Linear(D, 32), nn.LayerNorm(32), nn.Linear(32, 1)
        self.enc.register_forward_hook(lambda mod, inp, out: out * 1e3)

    def forward(self, x):
        return self.head(self.norm(self.enc(x)))


class FrozenEncNet(nn.Module):
    """A frozen (pretrained) GeGLU encoder run under no_grad inside forward; a trainable head; returns a dict."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = GeGLU()
        self.encoder.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        with torch.no_grad():
            h = self.encoder(x)
        return {"pred": self.head(h), "feat": h}


class DelayedScale(nn.Module):
    """fp8-style delayed scaling: x * (target / amax), amax a buffer from the PREVIOUS batches (updated after use,
    max over a 4-step history as in Transformer Engine's amax history)."""

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.register_buffer("amax_hist", torch.ones(4))

    def forward(self, x):
        y = x * (self.target / self.amax_hist.max())
        with torch.no_grad():
            self.amax_hist.copy_(torch.cat([self.amax_hist[1:], x.detach().abs().amax().float().reshape(1)]))
        return y


class ScaledNet(nn.Module):
    def __init__(self, target):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.scale, self.head = nn.Linear(D, D), DelayedScale(target), nn.Linear(D, 1)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.head(self.norm(self.scale(self.inp(x))))


@contextlib.contextmanager
def gloo_group():
    """A one-process gloo group (world_size 1) on a FileStore in /root/scratch; destroyed afterwards."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("no gloo")
    os.makedirs(SCRATCH, exist_ok=True)
    d = tempfile.mkdtemp(dir=SCRATCH, prefix="systems_ddp_")
    path = os.path.join(d, "store")
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(d)


def ddp(make):
    return lambda: nn.parallel.DistributedDataParallel(make())


# ======================================================================================================================
# 1-3: custom autograd Functions
# ======================================================================================================================
def test_1_function_without_custom_fwd_overflows(tmp_path):
    r = run(MixNet(HandSoftmax), batch_fn(30.0), tmp_path)
    real(r, "smax")
    named_top3(r["rep"], FWD, "smax", K)


def test_2_function_with_custom_fwd_is_quiet_and_identical(tmp_path):
    twin(lambda: MixNet(HandSoftmax32), batch_fn(30.0), tmp_path)


def test_3_function_whose_backward_alone_overflows(tmp_path):
    r = run(NormNet(), batch_fn(1e-5), tmp_path,
            oracle=lambda m: Producer(m, backward=True, with_kwargs=True))
    assert r["first"] is None and K not in r["bad_loss"], r
    assert r["first_bwd"] == ("norm", K), r
    assert K in r["skipped"] and all(s < 3 for s in r["skipped"] if s < K), r
    f = named_top3(r["rep"], FWD, "norm", K)
    assert f.phase in (None, "backward"), f.one_line()


# ======================================================================================================================
# 4-6: activation checkpointing
# ======================================================================================================================
def test_4_checkpointed_block_overflows_reentrant(tmp_path):
    r = run(CkptNet(True), batch_fn(400.0), tmp_path, oracle=FwdOracle)
    real(r, "blocks.1")
    named_top3(r["rep"], FWD, "blocks.1", K)


def oracle_forward_only_at_k(m, batch, lr=1e-2):
    """probe_run's loop without a watch, under FwdOracle, for steps 0..K-1, then only the forward of step K (no
    backward): the oracle's producer and the losses."""
    opt, sc, orc, losses = torch.optim.AdamW(m.parameters(), lr=lr), torch.amp.GradScaler("cpu"), FwdOracle(m), []
    for i in range(K + 1):
        orc.step = i
        opt.zero_grad()
        (x,), y = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(m(x), y)
        losses.append(loss.item())
        if i == K:
            break
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    orc.remove()
    return orc.first, losses


def test_5_checkpointed_block_overflows_nonreentrant(tmp_path):
    """Any forward-hook oracle that reads a module's inputs makes torch's non-reentrant checkpoint raise
    CheckpointError in the backward of the inf step (watch or no watch), so the proof is an oracle run of the same
    loop that stops after the forward of step K; the watched run (no oracle) has bitwise the same losses."""
    first, losses = oracle_forward_only_at_k(CkptNet(False), batch_fn(400.0))
    assert first == ("blocks.1", K) and all(map(math.isfinite, losses[:K])) and not math.isfinite(losses[K]), losses
    r = run(CkptNet(False), batch_fn(400.0), tmp_path, oracle=None)
    assert r["losses"][:K] == losses[:K] and r["bad_loss"] and r["bad_loss"][0] == K, (r["losses"], losses)
    named_top3(r["rep"], FWD, "blocks.1", K)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])
def test_6_checkpointed_healthy_twin(tmp_path, reentrant):
    twin(lambda: CkptNet(reentrant), batch_fn(), tmp_path)


# ======================================================================================================================
# 7-8: DistributedDataParallel, one process
# ======================================================================================================================
def test_7_ddp_healthy_is_quiet_and_identical(tmp_path):
    with gloo_group():
        twin(ddp(FFNet), batch_fn(), tmp_path)


def test_8_ddp_does_not_hide_the_producer(tmp_path):
    with gloo_group():
        r = run(ddp(FFNet)(), batch_fn(400.0), tmp_path)
    real(r, "module.ff")
    named_any(r["rep"], FWD, ("module.ff", "ff"))


# ======================================================================================================================
# 9-10: functional_call, parametrize
# ======================================================================================================================
def test_9_functional_call_overflow(tmp_path):
    m = FFNet()
    call = lambda x: torch.func.functional_call(m, dict(m.named_parameters()), (x,))   # noqa: E731
    r = run(m, batch_fn(400.0), tmp_path, call=call)
    real(r, "ff")
    named_top3(r["rep"], FWD, "ff", K)


def test_10_parametrized_weight_norm_layer_overflows(tmp_path):
    r = run(WNNet(), batch_fn(5000.0), tmp_path)
    real(r, "fc1")
    named_top3(r["rep"], FWD, "fc1", K)


# ======================================================================================================================
# 11: a user forward hook rescaling an output
# ======================================================================================================================
def test_11_user_hook_rescale_overflows_at_the_hooked_module(tmp_path):
    r = run(HookNet(), batch_fn(100.0), tmp_path)
    real(r, "enc")
    named_top3(r["rep"], FWD, "enc", K)


# ======================================================================================================================
# 12-15: DataParallel on the CPU, a frozen no_grad encoder, buffers updated in forward
# ======================================================================================================================
def test_12_dataparallel_cpu_overflow(tmp_path):
    r = run(nn.DataParallel(FFNet()), batch_fn(400.0), tmp_path)
    real(r, "module.ff")
    named_any(r["rep"], FWD, ("module.ff", "ff"))


def test_13_frozen_encoder_under_no_grad_overflows(tmp_path):
    r = run(FrozenEncNet(), batch_fn(300.0), tmp_path)
    real(r, "encoder")
    named_top3(r["rep"], FWD, "encoder", K)


def test_14_delayed_scaling_buffer_overflows(tmp_path):
    r = run(ScaledNet(30000.0), batch_fn(40.0), tmp_path)
    real(r, "scale")
    named_top3(r["rep"], FWD, "scale", K)


def test_15_buffer_updated_in_forward_healthy_twin(tmp_path):
    twin(lambda: ScaledNet(1.0), batch_fn(), tmp_path)
