"""bf16 precision failures in setups the earlier bf16 probes (test_bf16_probe, test_bf16_training,
test_unseen_variants13/17/28, test_integer_precision) do not build, and healthy bf16 twins.

Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=None)` around a plain bf16 loop:
zero_grad -> forward under `torch.autocast("cpu", dtype=torch.bfloat16)` (or a model.to(bf16) without autocast) ->
loss.backward -> step -> w.close() -> w.report()); tiny CPU models, fixed seeds, one intra-op thread. bf16 has fp32's
range and an 8-bit mantissa, so these failures are precision, not overflow. Each failure is first proven by the
test's own oracle against fp32 (the same module and weights in fp32, or an fp32 twin trained on the same batches; a
failing oracle is a plain failure, never an xfail), then the rule (CONTRACT.md id) must be among the report's first
three findings, as a warning or error, at the module named. A wrong report raises WrongAnswer (strict xfail via
`wrong`).

Failures:
 F1. a denoiser's Gaussian-Fourier timestep features written as a frozen Linear(1, 16) on fp32 t in 0..999 under
     autocast: the Linear casts t to bf16 (997 -> 996), neighbouring timesteps collide and sin/cos are off by > 0.5:
     precision_loss at time_embed (or time_embed.proj).
 F2. rotary tables made by `inv_freq[:, None] @ pos[None, :].float()` (HF's way) without disabling autocast, T = 512:
     the matmul runs in bf16, 256 == 257 and cos/sin are off by > 0.5 past 256: precision_loss at rotary.
 F3. an RL observation normaliser whose running second moment is a bf16 buffer updated by `lerp_(x**2, 0.001)`: it
     never leaves 1.0 while the fp32 twin's moves > 0.1: update_underflow at obs_norm (or the root).
 F4. a pure-bf16 (model.to(bf16)) Linear + TransformerEncoderLayer + head fine-tuned with Adam at lr 1e-5: > 90% of
     every weight matrix's elements never change (fp32 twin: > 90% move): update_underflow / fp16_master_weights at
     a stuck module.
 F5. an fp32 residual MLP under autocast with one LayerScale gamma created in bf16 (0.1), AdamW lr 1e-4: gamma never
     moves, the fp32 twin's every element does: update_underflow / fp16_master_weights at ls.
 F6. a one-pass instance norm (var = E[x^2] - E[x]^2) after a Conv1d on pressure readings (DC 1013 hPa): in bf16
     the variance cancels to negative values and sqrt gives NaN from finite inputs (fp32: finite, var > 0):
     nan_origin (or precision_loss) at norm.
 F7. prototype logits -||f - p||^2 computed by the expansion ||f||^2 - 2 f.p + ||p||^2 (VQ-VAE / ProtoNet code) on
     features with a common offset (|f|^2 ~ 800): bf16 error > 2x the logits' spread, the nearest prototype differs
     from fp32's for > 40% of rows, the fp32 twin learns (loss < half the bf16 run's): precision_loss at dist (or enc).
Healthy twins (no warning, no error in w.report() nor in diagnose(run_dir); the loss falls): an MLP; an Embedding +
pre-LN TransformerEncoderLayer classifier; a conv net with BatchNorm; an LSTM kept in fp32 (autocast disabled around
it) behind a bf16 Linear; F2's model with the rotary tables in fp32 (autocast disabled, HF's fix); F7's model with the
distances computed directly in fp32.

Result when written: 9 pass, 4 xfail (stable over two runs, ~4 s); 10 pass, 3 xfail since.
 F4 PASS  `[error] update_underflow at emb step 0: 98% of sampled elements of emb's parameters (bfloat16) did not
          change although their gradient was nonzero` (the only finding).
 F5 PASS  `[error] update_underflow at ls step 0: 100% of sampled elements of ls.gamma (bfloat16) did not change`.
 F6 PASS  `[error] nan_origin at norm aten::sqrt step 0: aten::sqrt in norm produced NaN from NaN-free inputs`.
 Healthy: all six quiet.
What ampdoctor got wrong (strict xfails, WrongAnswer only):
 F1 XFAIL the report is empty (no finding at all): the timesteps are fp32 at the module boundary and become bf16
    only inside the Linear under autocast (README's known limit for fp32 calendar years into a Linear is similar).
    PASS since (record/stats.py `cast_in`: a Linear's small fp32 inputs under fp16/bf16 autocast are probed for
    integers too): `[warning] precision_loss at time_embed.proj step 0: ... takes a float32 input that holds only
    integers and computes with it in bfloat16 (autocast casts it there), up to 999 ...`.
 F2 XFAIL when written (passes since record/lowcast.py) the report was empty: int64 positions -> bf16 inside a
    matmul under autocast; no bf16 input holds them.
 F3 XFAIL the report is empty, although README says bf16 buffers the code writes in place are compared.
 F7 XFAIL the report is empty: silent cancellation, nothing non-finite, no integers.
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
from scenarios import alarms, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
BF16 = torch.bfloat16


# ======================================================================================================================
# the loop and the checks
# ======================================================================================================================
def bf16_loop(m, batch, loss_fn, steps, *, opt=None, lr=1e-3, autocast=True, watch=True, run_dir=None, after=None,
              clip=None):
    """The user's bf16 loop: zero_grad -> forward (bf16 CPU autocast when `autocast`) -> loss.backward -> [clip] ->
    step -> [after(i, m)], under ampdoctor.watch(m, optimizer=opt, scaler=None, run_dir=run_dir) (`watch`), or the
    same loop unwatched (the fp32 twin). `batch(i)` gives step i's (inputs..., target). Returns (report or None,
    losses)."""
    opt = opt(m) if callable(opt) else (opt or torch.optim.AdamW(m.parameters(), lr=lr))
    w = ampdoctor.watch(m, optimizer=opt, scaler=None, run_dir=run_dir) if watch else None
    losses = []
    try:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            *args, y = batch(i)
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                loss = loss_fn(m(*args), y)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            opt.step()
            losses.append(loss.item())
            if after is not None:
                with torch.no_grad():
                    after(i, m)
    finally:
        if w is not None:
            w.close()
    return (w.report() if w is not None else None), losses


def top3(rep):
    return [f.one_line()[:220] for f in rep.findings[:3]]


def named(rep, rules, modules):
    """One of `rules` at one of `modules` among the first three findings, as a warning or error; else WrongAnswer
    naming ampdoctor's top three."""
    rules = (rules,) if isinstance(rules, str) else rules
    hit = [f for f in rep.findings[:3] if f.rule in rules and f.module in modules
           and f.severity in ("warning", "error")]
    if not hit:
        raise WrongAnswer(f"want {rules} at one of {sorted(map(str, modules))}; top3={top3(rep)}")
    return hit[0]


def quiet(rep):
    """No warning and no error (else WrongAnswer: a false alarm on a healthy run)."""
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy run: {alarms(rep.findings)[:3]}")


def falls(losses, k=5, by=0.7):
    assert all(map(math.isfinite, losses)), losses
    assert sum(losses[-k:]) < by * sum(losses[:k]), losses


# ======================================================================================================================
# F1. Gaussian-Fourier timestep features through a Linear(1, D) under bf16 autocast
# ======================================================================================================================
class FourierTime(nn.Module):
    """t (fp32, 0..999) -> [sin, cos](proj(t)), proj a frozen Linear(1, 16) of log-spaced frequencies (the
    score-SDE GaussianFourierProjection written as a Linear)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(1, 16, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.exp(-math.log(1000.0) * torch.arange(16) / 16)[:, None])
        self.proj.weight.requires_grad_(False)

    def forward(self, t):
        z = self.proj(t[:, None])
        return torch.cat([torch.sin(z), torch.cos(z)], -1)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.time_embed = FourierTime()
        self.t_mlp = nn.Linear(32, 64)
        self.inp = nn.Linear(8, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x, t):
        return self.out(F.silu(self.inp(x) + self.t_mlp(self.time_embed(t))))


def f1_batch(i):
    g = torch.Generator().manual_seed(100 + i)
    t = torch.randint(0, 1000, (64,), generator=g).float()
    x = torch.randn(64, 8, generator=g)
    return x, t, x * torch.cos(t / 50.0)[:, None]


def test_f1_fourier_timesteps_through_linear():
    torch.manual_seed(0)
    m = Denoiser()
    # oracle: the embedding of the timesteps 256..999 under bf16 autocast against fp32 (same module, same weights)
    t = torch.arange(1000).float()
    with torch.no_grad():
        ref = m.time_embed(t)
        with torch.autocast("cpu", dtype=BF16):
            low = m.time_embed(t).float()
    hi = slice(256, 1000)
    same_as_next = (low[256:999] == low[257:1000]).all(-1).float().mean().item()
    err = (low[hi] - ref[hi]).abs().max().item()
    assert same_as_next > 0.3 and err > 0.5, (same_as_next, err)                    # neighbours collide, sin/cos off
    assert (ref[256:999] != ref[257:1000]).any(-1).all()                              # fp32: every t is distinct
    rep, losses = bf16_loop(m, f1_batch, F.mse_loss, 30)
    assert all(map(math.isfinite, losses))
    named(rep, "precision_loss", {"time_embed", "time_embed.proj"})


# ======================================================================================================================
# F2. rotary angles made by a matmul (inv_freq @ positions, the HF way) without disabling autocast, T = 512
# ======================================================================================================================
class Rotary(nn.Module):
    def __init__(self, dim, fp32=False):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)
        self.fp32 = fp32

    def tables(self, pos):
        with torch.autocast("cpu", enabled=not self.fp32):       # the fix (HF's LlamaRotaryEmbedding) when fp32
            freqs = (self.inv_freq[:, None].float() @ pos[None, :].float()).transpose(0, 1)
            emb = torch.cat([freqs, freqs], -1)
            return emb.cos(), emb.sin()

    def forward(self, x, pos):
        cos, sin = self.tables(pos)
        x1, x2 = x.chunk(2, -1)
        return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


class RopeAttn(nn.Module):
    def __init__(self, fp32=False, d=16):
        super().__init__()
        self.emb = nn.Linear(4, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.rotary = Rotary(d, fp32)
        self.head = nn.Linear(d, 1)

    def forward(self, x, pos):
        h = self.emb(x)
        q, k = self.rotary(self.q(h), pos), self.rotary(self.k(h), pos)
        a = F.scaled_dot_product_attention(q, k, self.v(h), is_causal=True)
        return self.head(a + h).squeeze(-1)


T2 = 512
POS2 = torch.arange(T2)


def f2_batch(i):
    x = randn(2, T2, 4, seed=200 + i % 4)
    return x, POS2, torch.tanh(x[..., 0].cumsum(-1) / 20)


# (was a strict xfail, "empty report": the positions never were a module's input; record/lowcast.py probes the fp32
# operand of the matmul that autocast runs in bf16)
def test_f2_rotary_matmul_under_autocast():
    torch.manual_seed(0)
    m = RopeAttn()
    with torch.no_grad():
        cos32, _ = Rotary(16, True).tables(POS2)
        with torch.autocast("cpu", dtype=BF16):
            cos16, _ = m.rotary.tables(POS2)
    cos16 = cos16.float()
    assert (cos16[256:] - cos32[256:]).abs().max() > 0.5    # angles rounded
    assert (cos16[256] == cos16[257]).all() and not (cos32[256] == cos32[257]).all()           # 256 == 257
    rep, losses = bf16_loop(m, f2_batch, F.mse_loss, 12)
    assert all(map(math.isfinite, losses))
    named(rep, "precision_loss", {"rotary"})


# ======================================================================================================================
# F3. an RL observation normaliser whose running second moment is a bf16 buffer (decay 0.999)
# ======================================================================================================================
class ObsNorm(nn.Module):
    def __init__(self, d, dtype=BF16):
        super().__init__()
        self.register_buffer("sq", torch.ones(d, dtype=dtype))   # "bf16 to save memory"

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.sq.lerp_((x.detach() ** 2).mean(0).to(self.sq.dtype), 0.001)
        return x / torch.sqrt(self.sq.float() + 1e-5)


class Policy(nn.Module):
    def __init__(self, dtype=BF16):
        super().__init__()
        self.obs_norm = ObsNorm(12, dtype)
        self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.obs_norm(x))))


def f3_batch(i):
    x = randn(64, 12, seed=300 + i) * 1.6
    return x, x[:, :2] * 0.5


@wrong("empty report; want update_underflow at obs_norm: its bf16 running-moment buffer (lerp_ 0.001) never "
       "leaves 1.0 while the fp32 twin's moves > 0.1")
def test_f3_bf16_running_second_moment_buffer():
    torch.manual_seed(0)
    m = Policy()
    twin = Policy(torch.float32)
    twin.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    _, _ = bf16_loop(twin, f3_batch, F.mse_loss, 120, autocast=False, watch=False)
    rep, losses = bf16_loop(m, f3_batch, F.mse_loss, 120)
    assert all(map(math.isfinite, losses))
    assert (m.obs_norm.sq == 1.0).all(), m.obs_norm.sq                   # never left its init
    assert (twin.obs_norm.sq - 1.0).abs().min() > 0.1, twin.obs_norm.sq  # the fp32 twin's moved (toward ~2.56)
    named(rep, "update_underflow", {"obs_norm", ""})


# ======================================================================================================================
# F4. a pure-bf16 transformer block (model.to(bf16)) fine-tuned with Adam at lr 1e-5
# ======================================================================================================================
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 32)
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.block(self.emb(x))).squeeze(-1)


def f4_batch(i, dtype=BF16):
    x = randn(8, 16, 8, seed=400 + i % 4)
    return x.to(dtype), torch.tanh(x.sum(-1)).to(dtype)


def f4_loss(out, y):
    return F.mse_loss(out.float(), y.float())


def test_f4_pure_bf16_block_adam_lr1e_5():
    torch.manual_seed(0)
    m32 = Encoder()
    m = copy.deepcopy(m32).to(BF16)
    twin = copy.deepcopy(m).float()        # the same (bf16-rounded) weights, in fp32
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    adam = lambda mod: torch.optim.Adam(mod.parameters(), lr=1e-5)  # noqa: E731
    bf16_loop(twin, lambda i: f4_batch(i, torch.float32), f4_loss, 10, opt=adam, autocast=False, watch=False)
    rep, losses = bf16_loop(m, f4_batch, f4_loss, 10, opt=adam, autocast=False)
    assert all(map(math.isfinite, losses))
    stuck = set()
    p32 = dict(twin.named_parameters())
    for n, p in m.named_parameters():
        if p.dim() < 2:
            continue
        frozen = (p == before[n]).float().mean().item()
        moved32 = (p32[n] != before[n].float()).float().mean().item()
        assert moved32 > 0.9, (n, moved32)                      # fp32: every weight matrix moves
        if frozen > 0.9:
            stuck.add(n.rsplit(".", 1)[0])
    assert {"emb", "block.linear1", "block.linear2", "head"} <= stuck, stuck   # bf16: their updates round away
    named(rep, ("update_underflow", "fp16_master_weights"), stuck | {"block", "block.self_attn", ""})


# ======================================================================================================================
# F5. an fp32 model under bf16 autocast with one LayerScale gamma created in bf16 (init 0.1), AdamW lr 1e-4
# ======================================================================================================================
class LayerScale(nn.Module):
    def __init__(self, d, dtype=BF16):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 0.1, dtype=dtype))

    def forward(self, x):
        return x * self.gamma


class ResMlp(nn.Module):
    def __init__(self, dtype=BF16):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.ls = LayerScale(32, dtype)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.ls(self.fc2(F.gelu(self.fc1(h))))
        return self.head(h).squeeze(-1)


def f5_batch(i):
    x = randn(64, 8, seed=500 + i % 8)
    return x, torch.sin(x[:, 0] * 2) + x[:, 1] * x[:, 2]


def test_f5_bf16_layerscale_gamma_in_fp32_model():
    torch.manual_seed(0)
    m = ResMlp()
    twin = ResMlp(torch.float32)
    twin.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    g0 = m.ls.gamma.detach().clone()
    bf16_loop(twin, f5_batch, F.mse_loss, 40, lr=1e-4, watch=False)
    rep, losses = bf16_loop(m, f5_batch, F.mse_loss, 40, lr=1e-4)
    assert all(map(math.isfinite, losses))
    assert (m.ls.gamma == g0).all()                                          # bf16: gamma never moved
    moved = twin.ls.gamma.detach() - g0.float()
    assert (moved != 0).all() and moved.abs().max() > 1e-3                    # fp32: every element moved
    named(rep, ("update_underflow", "fp16_master_weights"), {"ls", ""})


# ======================================================================================================================
# F6. a one-pass instance norm (var = E[x^2] - E[x]^2) after a Conv1d on a signal with a large DC offset
# ======================================================================================================================
class OnePassNorm(nn.Module):
    def forward(self, x):                                    # (B, C, T), normalised over T
        mu = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mu * mu
        return (x - mu) / torch.sqrt(var + 1e-5)


class SensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 16, 5)
        self.norm = OnePassNorm()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean(-1)).squeeze(-1)


def f6_batch(i):
    g = torch.Generator().manual_seed(600 + i)
    x = 1013.0 + torch.randn(16, 2, 64, generator=g)            # pressure readings (hPa): DC 1013, wiggle ~1
    return x, (x[:, 0] - 1013.0).mean(-1)


def test_f6_one_pass_variance_cancels_in_bf16():
    torch.manual_seed(0)
    m = SensorNet()
    x, _ = f6_batch(0)
    with torch.no_grad():
        h32 = m.conv(x)
        assert torch.isfinite(m.norm(h32)).all()                                   # fp32 twin: finite
        var32 = (h32.double().var(-1, unbiased=False))
        with torch.autocast("cpu", dtype=BF16):
            h = m.conv(x)
            assert h.dtype == BF16 and torch.isfinite(h).all()
            mu = h.mean(-1, keepdim=True)
            var = ((h * h).mean(-1, keepdim=True) - mu * mu).squeeze(-1)
            out = m.norm(h)
    assert (var < 0).any() and var32.min() > 0, (var.min(), var32.min())   # negative variance in bf16
    assert not torch.isfinite(out).all()                                  # -> NaN out of sqrt, from finite input
    rep, losses = bf16_loop(m, f6_batch, F.mse_loss, 4)
    assert not math.isfinite(losses[0])
    named(rep, ("nan_origin", "precision_loss"), {"norm"})


# ======================================================================================================================
# F7. prototype logits -||f - p||^2 by the expansion ||f||^2 - 2 f.p + ||p||^2 (VQ-VAE / ProtoNet code) in bf16
# ======================================================================================================================
class ProtoDist(nn.Module):
    def __init__(self, protos):
        super().__init__()
        self.protos = nn.Parameter(protos.clone())

    def forward(self, f):
        p = self.protos
        d = (f * f).sum(-1, keepdim=True) - 2 * f @ p.t() + (p * p).sum(-1)
        return -d


CENTRES = randn(8, 16, seed=700) * 0.25


class ProtoNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 32)
        with torch.no_grad():
            self.enc.bias.add_(5.0)                      # "pretrained" features with a common offset: |f|^2 ~ 800
            protos = self.enc(CENTRES)
        self.dist = ProtoDist(protos)

    def forward(self, x):
        return self.dist(self.enc(x))


def f7_batch(i):
    g = torch.Generator().manual_seed(710 + i)
    y = torch.randint(0, 8, (64,), generator=g)
    return CENTRES[y] + 0.075 * torch.randn(64, 16, generator=g), y


@wrong("empty report; want precision_loss at dist: ||f||^2 - 2 f.p + ||p||^2 in bf16 (|f|^2 ~ 800) has an "
       "error larger than the logits' spread, the nearest prototype is wrong for > 40% of rows")
def test_f7_prototype_distance_expansion_in_bf16():
    torch.manual_seed(0)
    m = ProtoNet()
    twin = copy.deepcopy(m)
    x, y = f7_batch(0)
    with torch.no_grad():
        l32 = m(x)
        with torch.autocast("cpu", dtype=BF16):
            l16 = m(x).float()
    spread = (l32.max(-1).values - l32.min(-1).values).median().item()
    assert (l16 - l32).abs().max() > 2 * spread, ((l16 - l32).abs().max(), spread)          # error >> signal
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean() < 0.6                          # nearest code wrong
    _, loss32 = bf16_loop(twin, f7_batch, F.cross_entropy, 30, autocast=False, watch=False)
    rep, losses = bf16_loop(m, f7_batch, F.cross_entropy, 30)
    assert all(map(math.isfinite, losses))
    assert sum(losses[-5:]) > 2 * sum(loss32[-5:]), (losses[-5:], loss32[-5:])               # fp32 learns, bf16 not
    named(rep, "precision_loss", {"dist", "enc"})


# ======================================================================================================================
# healthy twins: no warning, no error, the loss falls
# ======================================================================================================================
def h_mlp():
    m = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def batch(i):
        x = randn(64, 8, seed=800 + i % 8)
        return x, torch.sin(x[:, :2].sum(-1, keepdim=True))
    return m, batch, F.mse_loss, 60, 1e-3


class TinyCls(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 32)
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, ids):
        return self.head(self.block(self.emb(ids)).mean(1))


def h_transformer():
    def batch(i):
        ids = torch.randint(0, 32, (16, 12), generator=torch.Generator().manual_seed(810 + i % 6))
        return ids, ids[:, 0] % 4
    return TinyCls(), batch, F.cross_entropy, 50, 3e-3


def h_convbn():
    m = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                      nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))

    def batch(i):
        g = torch.Generator().manual_seed(820 + i % 6)
        y = torch.randint(0, 3, (32,), generator=g)
        x = torch.randn(32, 1, 8, 8, generator=g) * 0.5
        x[:, :, :4] += (y == 1).float()[:, None, None, None]
        x[:, :, 4:] += (y == 2).float()[:, None, None, None]
        return x, y
    return m, batch, F.cross_entropy, 40, 3e-3


class LstmFp32(nn.Module):
    """A Linear front under bf16 autocast, the LSTM kept in fp32 (autocast disabled around it), a Linear head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        h = self.inp(x)
        with torch.autocast("cpu", enabled=False):
            o, _ = self.lstm(h.float())
        return self.head(o[:, -1]).squeeze(-1)


def h_lstm():
    def batch(i):
        x = randn(32, 20, 4, seed=830 + i % 6)
        return x, torch.tanh(x[..., 0].sum(-1) / 3)
    return LstmFp32(), batch, F.mse_loss, 50, 3e-3


def h_rotary_fixed():
    return RopeAttn(fp32=True), f2_batch, F.mse_loss, 30, 3e-3


class ProtoNetCdist(ProtoNet):
    """F7 with the fix: distances computed in fp32 (autocast off), by the direct difference."""

    def forward(self, x):
        f = self.enc(x)
        with torch.autocast("cpu", enabled=False):
            return -((f.float()[:, None] - self.dist.protos[None]) ** 2).sum(-1)


def h_proto_fixed():
    return ProtoNetCdist(), f7_batch, F.cross_entropy, 40, 1e-2


HEALTHY = {"mlp": h_mlp, "transformer_block": h_transformer, "conv_batchnorm": h_convbn, "lstm_fp32": h_lstm,
           "rotary_autocast_off": h_rotary_fixed, "proto_fp32_distance": h_proto_fixed}
HEALTHY_WRONG = {}


@pytest.mark.parametrize("case", [pytest.param(k, marks=[wrong(HEALTHY_WRONG[k])] if k in HEALTHY_WRONG else [])
                                  for k in HEALTHY])
def test_healthy_bf16(case, tmp_path):
    torch.manual_seed(0)
    m, batch, loss_fn, steps, lr = HEALTHY[case]()
    rep, losses = bf16_loop(m, batch, loss_fn, steps, lr=lr, run_dir=tmp_path / "run")
    falls(losses, by=0.8 if case == "rotary_autocast_off" else 0.7)
    quiet(rep)
    quiet(ampdoctor.diagnose(tmp_path / "run"))
