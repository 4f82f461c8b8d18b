"""NORMALIZATION-FREE AND DEEP-RESIDUAL NETWORKS under fp16, in plain PyTorch on CPU: SkipInit / ReZero (a scalar
residual gain at 0), an NF-ResNet (NFNets' scaled weight standardization, the alpha/beta signal-propagation scaling,
scaled ReLU), DeepNet's DeepNorm (x * alpha + f(x), alpha = (2N)^(1/4)) with its post-LN dropped, a pre-LN
transformer without its final norm, and a 24-block residual MLP whose stream grows ~sqrt(depth) - each broken by an
fp16 hazard these architectures are known for, injected at step 5 (BAD). The question each case asks: which module
PRODUCED the first inf/NaN (the block whose own op overflowed), not a later block or norm that only carried it.
Near cases that live elsewhere (not repeated): a ReZero-style log-gain growing slowly (headroom trend, no inf:
test_early_warning2), ReZero/LayerScale/SkipInit gates healthy (test_healthy_more4, test_healthy_trend3), an 8-block
norm-free MLP fed a raw window (x3500) overflowing in blocks.7.fc1 (test_unseen_variants27 #7), weight standardization
in the activations' dtype flushing grown weights to the bias (test_silent_norms_unseen #8), a residual stream grown
step by step by training (test_unseen_variants2 #4), an encoder's forgotten final norm read by cross-attention
(test_unseen_variants27 #6), NFNet-style adaptive gradient clipping healthy (test_healthy_default19).

Loop: probe_harness.probe_run (AdamW, GradScaler("cpu") at its defaults, CPU fp16 autocast, unscale_ ->
clip_grad_norm_(1.0) -> scaler.step -> scaler.update, ampdoctor.watch(model, optimizer=, scaler=, run_dir=tmp_path)
at the default sampling). Injections at step 5: parameters changed under no_grad before its forward (an lr spike's
update; a structured-pruning callback) or the batch itself (features in raw units, the loader's standardization
skipped).

Oracle for every failure (a failing oracle is a plain failure, never an xfail): the loss is first non-finite at the
bad step and the scaler skips it; probe_harness.Producer's first forward producer (inputs and own parameters finite,
output not) is the expected module at that step; the bad step re-run from the weights it ran with (snap_at, after
the injection) gives a non-finite loss under fp16 autocast, and finite outputs and loss in fp32 (fp16's doing).
Report check (`producer_top3`): among the first three findings a warning/error of an accepted rule at the expected
module and the bad step, phase forward (or null), and no overflow/nan_origin error at another named module at that
step; else WrongAnswer (strict xfail via probe_harness.wrong).

Failures:
 1. skipinit_gain       SkipInit (De & Smith 2020) / ReZero MLP, 8 blocks x + alpha * f(x) with a scalar fp32 gain
                        (alpha * h stays fp16: a 0-dim tensor does not promote), LayerNorm readout; an lr spike's
                        update takes blocks.3.alpha from ~0 to 2e5 (the gain's own param group, no decay): alpha *
                        f(x) (|f| ~ 0.65) passes 65504 in the block's own mul; blocks.4-7 and the readout LayerNorm
                        only carry it                                          -> overflow/nan_origin at blocks.3.
 2. nfnet_ws_pruned     NF-ResNet (Brock et al. 2021: x + 0.2 f(relu_gamma(x) / beta_l), beta_l = sqrt(1 + 0.04 l))
                        whose WSLinear standardizes the weight cast to the activations' dtype, gain (W - mean) /
                        sqrt(fan_in var + 1e-8); at step 5 a magnitude-pruning callback zeroes 4 output rows of
                        blocks.2.fc2: var = 0, 1e-8 is 0 in fp16, 0 / 0 = NaN (fp32: 0 / 1e-4 = 0)
                                                                 -> nan_origin/eps_underflow at blocks.2.fc2.
 3. deepnorm_no_post_ln DeepNet (Wang et al. 2022) blocks x * alpha + f(x), alpha = (2N)^(1/4) = 1.86 (N = 6), f and
                        the input projection at DeepNet's beta-scaled init, the post-LN that DeepNorm relies on
                        dropped: the fp16 stream grows 1.86x per block; at step 5 the features arrive in raw units
                        (x 3000): the stream passes 65504 in blocks.4's own x * alpha (not its Linears, nor
                        blocks.5 / the head that carry it)                     -> overflow/nan_origin at blocks.4.
                        (The scaler also backs off at steps 0-4: the head's loss-scaled backward at the initial
                        65536 scale; ampdoctor reports it as info.)
 4. pre_ln_no_final_norm pre-LN transformer (fp32 token embedding: the stream stays fp32, fp16 branches added to it),
                        6 blocks, the final LayerNorm forgotten; an lr spike's update scales every attn.out and fc2
                        by 3e4: each branch reads LN-normalized input and stays finite (< 65504), the fp32 stream
                        sums twelve of them past 65504, and the head's fp16 cast of the raw stream makes the first
                        inf (no block produced it)                                   -> overflow/nan_origin at head.
 5. deep_resmlp_stream  24-block residual MLP x + fc2(tanh(fc1(x))) with the stream in fp16: bounded branches, so the
                        stream's std grows ~sqrt(depth); an lr spike's update scales every fc2 by 7000: each branch
                        stays finite (~1e4), the stream's peak passes 65504 only in blocks.21's own add (the
                        readout LayerNorm carries it)                         -> overflow/nan_origin at blocks.21.
Healthy twins (the fixed form), each run with and without the watch: losses and final weights bitwise identical,
every loss finite, no producer, no skip after the scaler's first steps, no RuntimeWarning, finite weights, the loss
fell (last fifth 5% below the first fifth), no warning/error in the report: skipinit_no_spike (the same model, no
spike), nfnet_ws_fp32 (standardized from the fp32 parameter, timm's ScaledStdConv way; the same pruning at step 5),
deepnorm_post_ln (DeepNorm with its post-LN; raw-unit batches at steps 5, 17, 29), pre_ln_final_norm (the final
LayerNorm restored, no spike), deep_resmlp_fp32_stream (the residual stream in fp32, no spike).

Result when written (torch 2.13 CPU, 2 runs identical): 10 pass, 0 xfail, the whole file ~16-20 s (pytest), ~23 s
wall with start-up. Top findings:
 1 skipinit_gain        `[error] overflow at blocks.3 aten::mul step 5: aten::mul in `blocks.3` produced ±inf from
                        finite inputs; it propagates to aten::addmm in `blocks.4.fc1``.
 2 nfnet_ws_pruned      `[error] eps_underflow at blocks.2.fc2 aten::add step 5: aten::add in `blocks.2.fc2` uses eps
                        1e-08, which rounds to 0 in float16: the guard does nothing` (second: nan_origin at
                        blocks.2.fc2 aten::div step 5).
 3 deepnorm_no_post_ln  `[error] overflow at blocks.4 aten::mul step 5: ... it propagates to aten::addmm in
                        `blocks.5.fc2`` (the first consumer is blocks.5's own x * alpha / blocks.5.fc1; a detail of
                        the message, not of the verdict).
 4 pre_ln_no_final_norm `[error] overflow at head aten::_to_copy step 5: aten::_to_copy in `head` produced -inf from
                        finite inputs; it propagates to aten::addmm in `head``.
 5 deep_resmlp_stream   `[error] overflow at blocks.21 aten::add step 5: aten::add in `blocks.21` produced -inf from
                        finite inputs; it propagates to aten::native_layer_norm in `norm``.
 Twins: no warning or error.
No wrong answer found.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import failure_oracle, probe_run, producer_top3, twin_checks, wrong
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

BAD = 5
D = 32


def gen(seed):
    return torch.Generator().manual_seed(9400 + seed)


def rn(*shape, seed):
    return torch.randn(*shape, generator=gen(seed))


def mse(out, y):
    return F.mse_loss(out.float(), y)


def ce(out, y):
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


TEACH = rn(16, 4, seed=0) * 0.5


def b_reg(scale_at=(), k=1.0):
    """A regression batch (16 features -> 4 targets, a fixed random map through tanh); at the steps in `scale_at`
    the features arrive un-normalized (x k: raw units, the loader's standardization skipped)."""
    def b(i):
        x = rn(64, 16, seed=10 + i % 4)
        y = torch.tanh(x @ TEACH)
        return ((x * k if i in scale_at else x),), y
    return b


# ------------------------------------------------------------------------------------------ 1. SkipInit / ReZero

class SkipInitBlock(nn.Module):
    """SkipInit (De & Smith 2020) / ReZero: x + alpha * f(x), the scalar gain alpha (fp32 parameter) at 0 at init;
    the stream in fp16 (alpha * h keeps h's dtype: a 0-dim fp32 tensor does not promote an fp16 one)."""

    def __init__(self, d=D):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + self.alpha * self.fc2(torch.relu(self.fc1(x)))


class SkipInitNet(nn.Module):
    """inp -> 8 SkipInit blocks -> LayerNorm readout -> head (no norm inside the residual stack)."""

    def __init__(self, n=8):
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.Sequential(*[SkipInitBlock() for _ in range(n)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.inp(x))))


# ------------------------------------------------------------------------ 2. NFNet: scaled weight standardization

GAMMA_RELU = math.sqrt(2 / (1 - 1 / math.pi))          # NF-ResNets' scaled ReLU: unit second moment out


class WSLinear(nn.Linear):
    """NFNet's scaled weight standardization as a Linear: gain * (W - mean) / sqrt(fan_in * var + eps) per output
    row, a learnable gain (1 at init). `fp32`: standardized from the fp32 parameter (timm's ScaledStdConv2d);
    otherwise from the weight cast to the activations' dtype, with eps 1e-8 (0 in fp16)."""

    def __init__(self, d_in, d_out, fp32=False, eps=1e-8):
        super().__init__(d_in, d_out)
        self.gain = nn.Parameter(torch.ones(d_out, 1))
        self.fp32, self.eps = fp32, eps

    def forward(self, x):
        w = self.weight if self.fp32 else self.weight.to(x.dtype)
        mu = w.mean(1, keepdim=True)
        var = (w - mu).pow(2).mean(1, keepdim=True)
        w_hat = self.gain.to(w.dtype) * (w - mu) / torch.sqrt(w.shape[1] * var + self.eps)
        return F.linear(x, w_hat, self.bias.to(w_hat.dtype))


class NFBlock(nn.Module):
    """NF-ResNet block (Brock et al. 2021): x + alpha * f(act(x) / beta), beta = sqrt(1 + l alpha^2) the expected
    std of the stream at block l, alpha = 0.2, act the scaled ReLU; f = WSLinear -> scaled ReLU -> WSLinear."""

    def __init__(self, l, alpha=0.2, fp32=False):
        super().__init__()
        self.alpha, self.beta = alpha, math.sqrt(1 + l * alpha ** 2)
        self.fc1, self.fc2 = WSLinear(D, 2 * D, fp32), WSLinear(2 * D, D, fp32)

    def forward(self, x):
        h = GAMMA_RELU * torch.relu(x) / self.beta
        return x + self.alpha * self.fc2(GAMMA_RELU * torch.relu(self.fc1(h)))


class NFNet(nn.Module):
    def __init__(self, n=6, fp32=False):
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.Sequential(*[NFBlock(l, fp32=fp32) for l in range(n)])
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def prune_rows(path, k):
    """A magnitude-pruning callback at the bad step: the `k` output rows of Linear `path` with the smallest norm
    are zeroed (structured pruning)."""
    def inj(i, m, bad):
        if i == bad:
            w = m.get_submodule(path).weight
            w[w.norm(dim=1).argsort()[:k]] = 0.0
    return inj


# -------------------------------------------------------------------------------------- 3. DeepNet / DeepNorm

class DeepNormBlock(nn.Module):
    """DeepNet (Wang et al. 2022): LN(x * alpha + f(x)), alpha = (2N)^(1/4), f's init scaled by beta = (8N)^(-1/4).
    `post_ln=False`: the up-weighting kept with the post-LN dropped (the stream grows alpha-fold per block)."""

    def __init__(self, n, post_ln=True):
        super().__init__()
        self.alpha = (2 * n) ** 0.25
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        for lin in (self.fc1, self.fc2):
            nn.init.xavier_normal_(lin.weight, gain=(8 * n) ** -0.25)
        self.ln = nn.LayerNorm(D) if post_ln else nn.Identity()

    def forward(self, x):
        return self.ln(x * self.alpha + self.fc2(torch.relu(self.fc1(x))))


class DeepNormNet(nn.Module):
    def __init__(self, n=6, post_ln=False):
        super().__init__()
        self.inp = nn.Linear(16, D)
        nn.init.xavier_normal_(self.inp.weight, gain=(8 * n) ** -0.25)
        self.blocks = nn.Sequential(*[DeepNormBlock(n, post_ln) for _ in range(n)])
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


# ------------------------------------------------------------------- 4. pre-LN transformer without a final norm

V, T = 40, 8


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = torch.softmax((q @ k.transpose(-1, -2)).float() / math.sqrt(D), -1).to(v.dtype)
        return self.out(a @ v)


class PreLNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), Attn(), nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PreLN(nn.Module):
    """Token embedding (fp32: the stream stays fp32, fp16 branches added to it) -> 6 pre-LN blocks -> [final
    LayerNorm] -> head. `final_norm=False`: the final norm forgotten, the head reads the raw stream."""

    def __init__(self, n=6, final_norm=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.Sequential(*[PreLNBlock() for _ in range(n)])
        self.norm = nn.LayerNorm(D) if final_norm else nn.Identity()
        self.head = nn.Linear(D, V)

    def forward(self, t):
        return self.head(self.norm(self.blocks(self.emb(t))))


def b_tok(bad=None):
    """Token sequences; the target of each token is (token * 7 + 3) mod V (a per-token map)."""
    def b(i):
        t = torch.randint(0, V, (16, T), generator=gen(40 + i % 4))
        return (t,), (t * 7 + 3) % V
    return b


# --------------------------------------------------------------- 5. deep residual MLP, stream growing with depth

class TanhBlock(nn.Module):
    """x + fc2(tanh(fc1(x))): a bounded branch (|tanh| <= 1), so the stream adds ~independent terms and its std
    grows ~sqrt(depth); the stream in fp16."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class DeepResMLP(nn.Module):
    """inp -> 24 TanhBlocks -> [LayerNorm readout] -> head. `fp32`: the residual stream kept in fp32."""

    def __init__(self, n=24, fp32=False):
        super().__init__()
        self.fp32 = fp32
        self.inp = nn.Linear(16, D)
        self.blocks = nn.Sequential(*[TanhBlock() for _ in range(n)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.norm(self.blocks(h.float() if self.fp32 else h)))


# ---------------------------------------------------------------------------------------------------- injections

def scale_params(suffix, k):
    """At the bad step every parameter whose name ends with `suffix` is scaled by k (an lr spike's update)."""
    def inj(i, m, bad):
        if i == bad:
            for name, p in m.named_parameters():
                if name.endswith(suffix):
                    p.mul_(k)
    return inj


def set_param(path, v):
    """At the bad step parameter `path` is set to v (an lr spike's update)."""
    def inj(i, m, bad):
        if i == bad:
            m.get_parameter(path).fill_(v)
    return inj


def pre_ln_spike(k):
    """At the bad step an lr spike's update scales every residual branch's output layer (attn.out, fc2) by k."""
    def inj(i, m, bad):
        scale_params("fc2.weight", k)(i, m, bad)
        scale_params("attn.out.weight", k)(i, m, bad)
    return inj


# ---------------------------------------------------------------------------------------------------------- cases
# name: (factory, batch(bad), loss_fn, inject(i, m, bad) or None, bad step, expected module, accepted rules)
OV = ("overflow", "nan_origin")
CASES = {
    "skipinit_gain": (lambda: SkipInitNet(), lambda bad: b_reg(), mse, set_param("blocks.3.alpha", 2e5), BAD,
                      "blocks.3", OV),
    "nfnet_ws_pruned": (lambda: NFNet(), lambda bad: b_reg(), mse, prune_rows("blocks.2.fc2", 4), BAD,
                        "blocks.2.fc2", ("nan_origin", "eps_underflow")),
    "deepnorm_no_post_ln": (lambda: DeepNormNet(), lambda bad: b_reg((bad,), 3000.0), mse, None, BAD, "blocks.4",
                            OV),
    "pre_ln_no_final_norm": (lambda: PreLN(), lambda bad: b_tok(), ce, pre_ln_spike(3e4), BAD, "head", OV),
    "deep_resmlp_stream": (lambda: DeepResMLP(), lambda bad: b_reg(), mse, scale_params("fc2.weight", 7000.0), BAD,
                           "blocks.21", OV),
}

XFAIL = {}


def build(factory, seed=0):
    torch.manual_seed(seed)
    return factory()


def run_case(name, tmp_path):
    factory, mk, loss_fn, inj, bad, *_ = CASES[name]
    inject = None if inj is None else (lambda i, mm: inj(i, mm, bad))
    return probe_run(build(factory), mk(bad), loss_fn, bad + 2, str(tmp_path / "run"), inject=inject, snap_at=bad)


def replay_bad(name, r):
    """The bad step's forward from the weights it ran with (snap_at: after the injection), under fp16 autocast and
    in fp32: (model output fp16, loss fp16, model output fp32, loss fp32)."""
    factory, mk, loss_fn, inj, bad, *_ = CASES[name]
    m = build(factory)
    m.load_state_dict(r["sd"])
    args, y = mk(bad)(bad)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.float16):
            o16 = m(*args)
        l16 = loss_fn(o16, y)
        o32 = m(*args)
        l32 = loss_fn(o32, y)
    return o16, l16, o32, l32


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_norm_free_fails(name, tmp_path):
    *_, bad, where, rules = CASES[name]
    r = run_case(name, tmp_path)
    # oracle (probe_harness.failure_oracle): the loss first non-finite at the injected step, skipped; the first
    # forward producer is `where` at that step; the step replayed fails in fp16 and is finite in fp32
    failure_oracle(r, bad, where, replay_bad(name, r))
    f = producer_top3(r["rep"], rules, where, bad)
    print(name, "->", f.one_line())


# ---------------------------------------------------------------------------------------------------------- twins
# name: (factory, batch, loss_fn, inject(i, m, bad) or None, steps, lr)
TWINS = {
    "skipinit_no_spike": (lambda: SkipInitNet(), b_reg(), mse, None, 40, 3e-3),
    "nfnet_ws_fp32": (lambda: NFNet(fp32=True), b_reg(), mse, prune_rows("blocks.2.fc2", 4), 40, 3e-3),
    "deepnorm_post_ln": (lambda: DeepNormNet(post_ln=True), b_reg((5, 17, 29), 3000.0), mse, None, 40, 3e-3),
    "pre_ln_final_norm": (lambda: PreLN(final_norm=True), b_tok(), ce, None, 40, 3e-3),
    "deep_resmlp_fp32_stream": (lambda: DeepResMLP(fp32=True), b_reg(), mse, None, 30, 3e-3),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_norm_free_twin(name, tmp_path):
    factory, mk, loss_fn, inj, steps, lr = TWINS[name]
    inject = None if inj is None else (lambda i, mm: inj(i, mm, BAD))
    r, plain = (probe_run(build(factory), mk, loss_fn, steps, str(tmp_path / f"w{w}"), inject=inject, lr=lr,
                          watch=w) for w in (True, False))
    twin_checks(r, plain, steps)
