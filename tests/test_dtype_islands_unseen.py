"""DTYPE ISLANDS: explicit dtype handling inside models under fp16 autocast (autocast(enabled=False) regions,
explicit .half()/.to(float16), nested autocast, fp16 parameters/buffers, custom_fwd, mixed-dtype branches). Small
CPU models, 16 steps of probe_harness.probe_run (fp16 autocast + GradScaler("cpu"), AdamW, unscale_ + clip, default
watch); the trigger is the batch of step K = 4 scaled up (case 4: a spam document; case 5: from step 0). Each failure
is first proven by the Producer oracle (first module making inf/NaN from finite inputs, at that step, loss non-finite
there); then the rule must be among the first three findings (warning/error) at the producer and step, else
WrongAnswer (strict xfail via `wrong`). Twins: quiet_twin (a skip at K alone, the scaler's ordinary backoff on the
outlier batch, is allowed), no internal error, losses and weights bitwise identical unwatched.

Failures:
 1. gram       autocast(enabled=False) island forgot .float(): fp16 Gram pooling h^T h over tokens -> overflow at gram.
 2. energy     x.to(float16) inside forward, then log1p(h*h) -> overflow at energy (aten::mul).
 3. nested     model runs in bf16 autocast, block re-enters fp16 autocast; block.proj (Linear) overflows fp16.
 4. pool       frozen nn.Embedding .half()'d, bag-of-words sum over 32 tokens in fp16 -> overflow at pool.
 5. norm       Standardize module .half()'d: buffer inv_std = 1/1e-5 = inf in fp16 -> NaN/inf at norm, step 0.
 6. gate       custom_fwd(cast_inputs=float32) Function returns out.half(); next module's exp() overflows at gate.
 7. mix        fp32 branch (autocast off, mean x^2 ~ 9e4) + fp16 branch promotes to fp32; mix Linear's cast -> inf.
 8. bank       fp16 torch.matmul, inner dim 2048, in an autocast(enabled=False) island -> overflow at bank.
Healthy twins (9-16, same order): .float() in the island; .float() before the square; bf16 inside bf16; fp32 sum
pool over the fp16 table; fp32 buffers; custom_fwd returns fp32; RMS (sqrt) branch; q prescaled by N**-0.5.

Result when written (torch 2.13 CPU): 14 pass, 2 xfail (strict, WrongAnswer), stable over two runs, ~3 s; 3 and 11
fixed since (16 pass: the root's trip-wire summed a bf16 output with torch.stack, which raises under the loop's
fp16 autocast; record/modulehooks.output_sum adds two float64 values instead, tests/test_output_sum.py):
 1. PASS [error] overflow at gram aten::bmm step 4.   2. PASS [error] overflow at energy aten::mul step 4.
 3. WRONG: top 3 empty. summary: "ampdoctor stopped watching at step 0 after an internal error (RuntimeError:
    Unexpected floating ScalarType in at::autocast::prioritize)" - nested autocast of a different dtype breaks it.
 4. PASS [error] overflow at pool aten::sum step 4 (no fp16_master_weights for the frozen fp16 table: right).
 5. PASS [error] nan_origin at norm aten::mul step 0; loss_scale_collapse at norm.
 6. PASS [error] overflow at gate aten::exp step 4.   7. PASS [error] overflow at mix aten::_to_copy step 4.
 8. PASS [error] overflow at bank aten::mm step 4.
 11. WRONG: the bf16-in-bf16 twin is "quiet" only because the watch stopped at step 0 with the same internal error
    (the model's bf16 autocast nested in the loop's fp16 one). Other twins: quiet (10, 12, 15, 16: one [info]
    skipped_steps at step 4).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import WrongAnswer, named_top3, probe_run, quiet_twin
from scenarios import gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

B, T, D, K, STEPS = 8, 8, 16, 4, 16
ALARM = ("warning", "error")
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# data: 4 cycled batches; step K brings the trigger (the same batch scaled by `big`)
# ======================================================================================================================
def feats(shape, big, i):
    x = torch.randn(*shape, generator=gen(i % 4))
    return x * big if i == K else x


def target(i):
    return 0.5 * torch.tanh(torch.randn(B, 1, generator=gen(100 + i % 4)))


def batcher(shape, big):
    return lambda i: ((feats(shape, big, i),), target(i))


def loss(out, y):
    return F.huber_loss(out.float(), y)


# ======================================================================================================================
# 1: autocast(enabled=False) island that forgot .float(): a Gram (second-order) pooling over tokens in fp16
# ======================================================================================================================
class GramPool(nn.Module):
    def __init__(self, fp32):
        super().__init__()
        self.fp32 = fp32

    def forward(self, h):                                   # (B, T, D), fp16 from the autocast region
        with torch.autocast("cpu", enabled=False):
            if self.fp32:
                h = h.float()
            g = h.transpose(1, 2) @ h                       # (B, D, D): sum over T of h_i h_j
            return (g / g.flatten(1).norm(dim=1).clamp_min(1.0)[:, None, None]).flatten(1)


class GramNet(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.gram, self.head = nn.Linear(D, D), GramPool(fp32), nn.Linear(D * D, 1)

    def forward(self, x):
        return self.head(self.gram(self.proj(x)))


# ======================================================================================================================
# 2: an explicit x.to(torch.float16) inside forward before a square (raw fp32 features)
# ======================================================================================================================
class LogEnergy(nn.Module):
    def __init__(self, fp32):
        super().__init__()
        self.fp32 = fp32

    def forward(self, x):
        h = x.float() if self.fp32 else x.to(torch.float16)
        return torch.log1p(h * h)


class EnergyNet(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        torch.manual_seed(0)
        self.energy, self.head = LogEnergy(fp32), nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.energy(x))


# ======================================================================================================================
# 3: nested autocast: the model runs itself in bf16, one block re-enters fp16 autocast "for speed"
# ======================================================================================================================
class InnerBlock(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype, self.proj = dtype, nn.Linear(64, 64)
        nn.init.normal_(self.proj.weight, std=1.0)

    def forward(self, h):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.proj(h)


class NestedNet(nn.Module):
    def __init__(self, inner=torch.float16):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.head = nn.Linear(D, 64), InnerBlock(inner), nn.Linear(64, 1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(self.block(self.inp(x)) / 10.0)


# ======================================================================================================================
# 4: a frozen embedding table .half()'d to save memory feeding an fp32 model: bag-of-words sum pooling
# ======================================================================================================================
V, TB, RARE = 32, 32, 31


class SumPool(nn.Module):
    def __init__(self, fp32):
        super().__init__()
        self.fp32 = fp32

    def forward(self, h):
        return (h.float() if self.fp32 else h).sum(1) / h.shape[1]


class BagNet(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        with torch.no_grad():
            self.emb.weight[RARE] = torch.randn(D, generator=gen(7)).sign() * 3000.0
        self.emb.half().weight.requires_grad_(False)        # frozen pretrained vectors kept in fp16
        self.pool, self.head = SumPool(fp32), nn.Linear(D, 1)

    def forward(self, ids):
        return self.head(self.pool(self.emb(ids)))


def bag_batch(i):
    ids = torch.randint(1, RARE, (B, TB), generator=gen(i % 4))
    if i == K:
        ids[0, :25] = RARE                                   # a spam document repeating the rare token
    return (ids,), target(i)


# ======================================================================================================================
# 5: an fp16 registered buffer: a standardiser's 1/std (1e5 for a constant feature) is inf in fp16
# ======================================================================================================================
class Standardize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("inv_std", 1.0 / std.clamp_min(1e-5))

    def forward(self, x):
        return (x - self.mean) * self.inv_std


CONST = 3                                                    # feature 3 is a constant 0.5 in the data


def std_feats(i, big=1.0):
    x = feats((B, D), big, i)
    x[:, CONST] = 0.5
    return x


class StdNet(nn.Module):
    def __init__(self, half_norm=True):
        super().__init__()
        torch.manual_seed(0)
        calib = torch.cat([std_feats(i) for i in range(4)])
        self.norm = Standardize(calib.mean(0), calib.std(0))
        if half_norm:
            self.norm.half()                                 # "the whole input pipeline in fp16"
        self.body, self.head = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(self.norm(x))))


def std_batch(i):
    return (std_feats(i),), target(i)


# ======================================================================================================================
# 6: a custom_fwd(cast_inputs=float32) island whose forward returns .half(); the next op (softmax by hand) overflows
# ======================================================================================================================
class Fp32Proj(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w, half_out):
        ctx.save_for_backward(x, w)
        out = x @ w
        return out.half() if half_out else out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.float()
        return g @ w.t(), x.transpose(-1, -2) @ g, None


class Island(nn.Module):
    def __init__(self, half_out):
        super().__init__()
        self.w, self.half_out = nn.Parameter(torch.randn(D, D) * 0.25), half_out

    def forward(self, h):
        return Fp32Proj.apply(h, self.w, self.half_out)


class ExpGate(nn.Module):
    def forward(self, h):
        e = h.exp()
        return e / e.sum(-1, keepdim=True)


class IslandNet(nn.Module):
    def __init__(self, half_out=True):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.island, self.gate, self.head = nn.Linear(D, D), Island(half_out), ExpGate(), nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.gate(self.island(self.inp(x))))


# ======================================================================================================================
# 7: two branches, one fp32 (an energy feature computed with autocast off), one fp16; their sum promotes to fp32
#    and carries > 65504 into the next Linear, whose autocast cast to fp16 overflows
# ======================================================================================================================
class EnergyBranch(nn.Module):
    def __init__(self, rms):
        super().__init__()
        self.rms = rms

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            x = x.float()
            e = (x * x).mean(-1, keepdim=True)
            e = e.sqrt() if self.rms else e
            return e.expand(-1, D)


class BranchNet(nn.Module):
    def __init__(self, rms=False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = EnergyBranch(rms), nn.Linear(D, D)
        self.mix, self.head = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x):
        h = self.a(x) + self.b(x)                           # fp32 + fp16 -> fp32
        return self.head(torch.relu(self.mix(h)))


# ======================================================================================================================
# 8: an explicit fp16 torch.matmul with a large inner dimension (2048) in an autocast(enabled=False) island
# ======================================================================================================================
N = 2048


class Bank(nn.Module):
    def __init__(self, prescale):
        super().__init__()
        self.bank, self.prescale = nn.Parameter(torch.rand(N, 8)), prescale

    def forward(self, h):
        with torch.autocast("cpu", enabled=False):
            q = h.half()
            if self.prescale:
                q = q * N ** -0.5
            return torch.matmul(q, self.bank.half())


class BankNet(nn.Module):
    def __init__(self, prescale=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.bank, self.head = nn.Linear(D, N), Bank(prescale), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.bank(torch.relu(self.inp(x))) / 64.0)


# ======================================================================================================================
# checks
# ======================================================================================================================
def real(r, module, step=K):
    """The oracle: the first inf/NaN from finite inputs is made by `module` at `step`; before it nothing but the
    scaler's first backoffs (steps 0-2); at `step` the loss is non-finite."""
    assert r["first"] == (module, step), (r["first"], r["bad_loss"], r["skipped"], r["losses"])
    assert all(s < 3 for s in r["skipped"] if s < step) and not [s for s in r["bad_loss"] if s < step], r
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]


def named(rep, rules, module, step=K):
    return named_top3(rep, rules, module, step, ALARM)


def run(make, batch, tmp_path, lr=1e-2):
    return probe_run(make(), batch, loss, STEPS, str(tmp_path / "run"), lr=lr)


def twin(make, batch, tmp_path, lr=1e-2):
    """A healthy twin: quiet under the watch (quiet_twin), losses and final weights bitwise identical unwatched."""
    r = run(make, batch, tmp_path, lr)
    quiet_twin(r, skips=[s for s in r["skipped"] if s == K])
    if r["rep"].summary.get("internal_error"):                # quiet only because it stopped watching
        raise WrongAnswer(f"internal error: {r['rep'].summary['internal_error']}; {lines(r['rep'])[:3]}")
    u = probe_run(make(), batch, loss, STEPS, None, lr=lr, watch=False)
    assert r["losses"] == u["losses"], (r["losses"], u["losses"])
    assert all(torch.equal(r["weights"][k], u["weights"][k]) for k in u["weights"])
    return r


# ======================================================================================================================
# failures
# ======================================================================================================================
def test_1_autocast_off_island_without_float(tmp_path):
    r = run(GramNet, batcher((B, T, D), 200.0), tmp_path)
    real(r, "gram")
    named(r["rep"], FWD, "gram")


def test_2_explicit_half_before_square(tmp_path):
    r = run(EnergyNet, batcher((B, D), 300.0), tmp_path)
    real(r, "energy")
    named(r["rep"], "overflow", "energy")


def test_3_fp16_autocast_nested_in_bf16(tmp_path):
    r = run(NestedNet, batcher((B, D), 8000.0), tmp_path)
    real(r, "block.proj")
    named(r["rep"], "overflow", "block.proj")


def test_4_frozen_fp16_embedding_sum_pool(tmp_path):
    r = run(BagNet, bag_batch, tmp_path)
    real(r, "pool")
    named(r["rep"], "overflow", "pool")


def test_5_fp16_buffer_inv_std_is_inf(tmp_path):
    m = StdNet()
    assert float(m.norm.inv_std[CONST]) == float("inf")
    r = run(lambda: m, std_batch, tmp_path)
    real(r, "norm", step=0)
    named(r["rep"], FWD, "norm", step=0)


def test_6_custom_fwd_island_returns_fp16(tmp_path):
    r = run(IslandNet, batcher((B, D), 25.0), tmp_path)
    real(r, "gate")
    named(r["rep"], FWD, "gate")


def test_7_fp32_branch_promotes_sum_then_linear_casts(tmp_path):
    r = run(BranchNet, batcher((B, D), 300.0), tmp_path)
    real(r, "mix")
    named(r["rep"], "overflow", "mix")


def test_8_fp16_matmul_large_inner_dim_in_island(tmp_path):
    r = run(BankNet, batcher((B, D), 600.0), tmp_path)
    real(r, "bank")
    named(r["rep"], "overflow", "bank")


# ======================================================================================================================
# healthy twins
# ======================================================================================================================
def test_9_healthy_island_with_float(tmp_path):
    twin(lambda: GramNet(fp32=True), batcher((B, T, D), 200.0), tmp_path)


def test_10_healthy_float_before_square(tmp_path):
    twin(lambda: EnergyNet(fp32=True), batcher((B, D), 300.0), tmp_path)


def test_11_healthy_bf16_nested_in_bf16(tmp_path):
    twin(lambda: NestedNet(inner=torch.bfloat16), batcher((B, D), 8000.0), tmp_path)


def test_12_healthy_frozen_fp16_embedding_fp32_pool(tmp_path):
    twin(lambda: BagNet(fp32=True), bag_batch, tmp_path)


def test_13_healthy_fp32_buffers(tmp_path):
    twin(lambda: StdNet(half_norm=False), std_batch, tmp_path)


def test_14_healthy_custom_fwd_returns_fp32(tmp_path):
    twin(lambda: IslandNet(half_out=False), batcher((B, D), 25.0), tmp_path)


def test_15_healthy_rms_branch(tmp_path):
    twin(lambda: BranchNet(rms=True), batcher((B, D), 300.0), tmp_path)


def test_16_healthy_prescaled_fp16_matmul(tmp_path):
    twin(lambda: BankNet(prescale=True), batcher((B, D), 600.0), tmp_path)
