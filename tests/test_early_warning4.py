"""headroom_trend as an early warning, fourth set (test_headroom_trend.py, test_early_warning2.py,
test_early_warning3.py and test_trend_realistic.py are the earlier ones): creep mechanisms none of them builds. CPU
fp16 loops (autocast + a real GradScaler("cpu"), one intra-op thread, fixed seeds), the default
`ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=...)`, then `w.report(replay=False)`. The loop, the
test's own forward-hook measurement (`Probe`) and the checks of the series come from test_early_warning3.py
(imported, not copied).

Every run is first run UNWATCHED with the test's hooks, which give the first bad step (a non-finite loss or hooked
output, or a skipped step after GradScaler's first 10 steps) and the oracle: the producer loses >= 0.05 bits/step
over the 40 steps before it, the first layer of its chain to reach the max is inside the rule's 8 bits 10 steps
before it, and the producer's input is flat (unless it feeds itself, a recurrence) while each listed pass-on
layer's input grows at its rate. The watched run must give bitwise the same losses, and its EARLIEST headroom_trend
(warning, or error once it came true) must name the producer at a step <= first bad - 10 with a forecast after it,
and no headroom_trend may name a pass-on layer. The default watch's series stride follows the machine's load (1..32
on these tiny models), so the failing runs are watched with the stride pinned (tests/stride_sweep.install, as
test_early_warning3.py and test_trend_realistic.py do) at 1 and 16 (the conv run also at 32) and the stride is
asserted from the records.

A) creeping failures (4 runs x 2 strides + 1):
   1. layernorm_gain_energy_reward: an "activation energy" term on a LayerNorm's output added with the wrong sign
      (a reward, not a penalty) under SGD: the gain of `ln` (the stem before it frozen) grows ~x1.065 a step, ln's
      fp32 output falls 0.09 bits/step; `proj` (fp16) reads it and overflows at step 106 (proj's own weights grow a
      little too, so it is not listed as a pure pass-on layer);
   2. rnn_spectral_radius_creep: a linear RNN (h = rec(h) + inp(x_t), 16 steps, orthogonal init) with AWD-LSTM's
      activation regulariser on h_T added with the wrong sign, Adam lr 2e-4: the recurrent weight's spectral radius
      creeps past 1 and rec's output falls ~0.19 bits/step from step ~200; first skip (rec's backward) at 241;
   3. qk_uncapped_exponential_warmup: attention whose q/k projections have their own param group on an exponential
      warm-up lr = 1e-3 * 1.05**step with its min(.., peak) missing (Adam): q's and k's outputs fall 0.064
      bits/step each from flat inputs, the QK-norm-less logits (`score`, a module of its own with no weights) twice
      that; `score` overflows at step 146;
   4. conv_new_block_lr_too_high: a block added to a frozen BatchNorm-free residual conv net, fine-tuned alone by
      SGD at lr 0.6 (above 2/lambda_max of the then quadratic loss): its conv's output oscillates and grows ~0.08
      bits/step; first skip at 166 (the forward still ~5 bits below the max).
B) healthy twins (finite losses, at most one late skip; no headroom_trend and no warning or error at all; the
   default watch unpinned: the same at strides 1, 2, 8, 16, 32 when written):
   layernorm_energy_hinge_settles (1 with the reward capped at an RMS of 40: ln 14.3 -> 7.3 bits over ~130 steps,
   flat to step 400), qk_warmup_capped (3 with the lr capped at 0.02), flat_at_1e4 (a frozen pretrained projection
   whose output sits at ~1e4, 4.4-4.7 bits, for 300 steps), fp32_memory_never_cast (an fp32 buffer growing x1.05 a
   step to ~2e7 under autocast, returned as an fp32 module output but only used after an fp32 normalisation).

What ampdoctor got wrong (strict xfails, WrongAnswer only):
- layernorm_gain_energy_reward at stride 16: no headroom_trend at all; the report is `overflow at proj step 106`
  and `loss_scale_collapse at (run) step 111`. Right: headroom_trend at `ln` by step 96 (ln has 7.1 bits at step
  75 and falls 0.09 bits/step). At stride 1 the same run is warned at ln step 72 (strides 2-8: 69-71).
- rnn_spectral_radius_creep at stride 16: `[error] headroom_trend at rec step 243: `rec` (Linear) output is losing
  headroom to the float16 maximum steadily: 3.0 bits left at step 243, falling 0.10 bits/step, forecast to
  overflow around step 286.` First bad step: the skip at 241 (rec's backward overflow, which ampdoctor's overflow
  finding dates 244, the second skip). Right: at rec by step 231. At stride 1 it warns at rec step 216 (passes);
  at 8: 233, at 24/32: 244.
- qk_uncapped_exponential_warmup at stride 1: `[error] headroom_trend at score step 103: `score` (Score) output is
  losing headroom to the float16 maximum steadily: 7.3 bits left at step 103, falling 0.16 bits/step, forecast to
  overflow around step 154. It did: the first inf/NaN came at step 146, in `score`.`; at stride 16 the same at
  score step 135 (3.1 bits, forecast 196); at 24/32 no headroom_trend. In time, but at `score`, which has no
  weights and only multiplies q's and k's growing outputs (each falling 0.064 bits/step from flat inputs). Right:
  the finding at `q` (or `k`), with `score` as the first to reach the max (the form ampdoctor uses for the RNN:
  "`inp`, which takes its values, is the first to reach the max").
- conv_new_block_lr_too_high at stride 32: `[warning] headroom_trend at blocks.1.conv step 169: `blocks.1.conv`
  (Conv2d) output is losing headroom to the float16 maximum steadily: 4.5 bits left at step 169, falling 0.06
  bits/step, forecast to overflow around step 241.` First bad step: the skip at 166. Right: by step 156. At
  strides 1 and 16 (passing) it warns at step 123 and 135.
Seen but passing: layernorm_gain_energy_reward at stride 1 also gets a second headroom_trend at `proj` (step 84).

Result when written: 8 pass, 5 xfail (~19 s on one core); 11 pass, 2 xfail since (the three stride cases:
record/budget.py `creep` has the series on every step while an fp16 output within 8 bits of the max keeps rising);
13 pass since (the two qk cases: rules/headroom.py `_factors`: a weightless producer whose inputs' falls add up to
its own is named at the first of those weighted inputs, `q`, with `score` as the first to reach the max).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import WrongAnswer, wrong  # noqa: E402
from scenarios import alarms, gen, one_thread  # noqa: E402
from test_early_warning3 import (LEAD, SEARCH, Scenario, ce, cls_batch, rate_before, run,  # noqa: E402
                                 same_losses, series)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


# --- A) creeping failures ------------------------------------------------------------------------------------------

class LNNet(nn.Module):
    """inp -> LayerNorm `ln` (fp32 under autocast) -> proj (fp16) -> relu -> head."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln = nn.Linear(16, 64), nn.LayerNorm(64)
        self.proj, self.head = nn.Linear(64, 64), nn.Linear(64, 4)
        self.inp.requires_grad_(False)      # a frozen pretrained stem; its final LayerNorm is tuned with the head

    def forward(self, x):
        h = self.ln(self.inp(x))
        self.last_ln = h
        return self.head(torch.relu(self.proj(h)))


def sc_ln_gain_energy(target=None, steps=400, lam=25.0, lr=0.05):
    """An 'activation energy' term on the LayerNorm output added with the wrong sign (a reward, not a penalty): SGD
    drives the LN gain up geometrically. `target`: the reward stops at an RMS of `target` (a hinge)."""
    def loss(m, i, x, y):
        out = m(x)
        e = m.last_ln.float().pow(2).mean()
        if target is not None:      # the bonus stops at an RMS of `target` (a hinge)
            e = e.clamp(max=target ** 2)
        return F.cross_entropy(out.float(), y) - lam * e
    return Scenario(build=LNNet, opt=lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr),
                    batch=cls_batch(), loss=loss,
                    steps=steps, init_scale=16.0, grower="ln", probe=["inp", "proj", "head"], span=40)


class LinRNN(nn.Module):
    """A linear RNN: h = rec(h) + inp(x_t) over T steps, the readout on h_T."""

    def __init__(self, T=16):
        super().__init__()
        self.T = T
        self.inp, self.rec, self.head = nn.Linear(8, 32), nn.Linear(32, 32, bias=False), nn.Linear(32, 4)
        with torch.no_grad():
            self.rec.weight.copy_(torch.linalg.qr(torch.randn(32, 32))[0])    # orthogonal (IRNN-style) init

    def forward(self, x):
        h = torch.zeros(x.shape[0], 32)
        for t in range(self.T):
            h = self.rec(h) + self.inp(x[:, t])
        self.last_h = h
        return self.head(h)


def rnn_batch(seed=11):
    W = torch.randn(8, 4, generator=gen(seed + 999))

    def batch(i):
        x = torch.randn(32, 16, 8, generator=gen(seed * 100000 + i))
        return x, (x[:, -1] @ W).argmax(-1)
    return batch


def sc_rnn_spectral_creep(lam=1e-2, lr=2e-3, steps=500):
    """AWD-LSTM-style activation regularisation on the hidden state, added with the wrong sign: Adam raises the
    recurrent weight's spectral radius past 1 and h_T = sum rho^t ... grows across the sequence."""
    def loss(m, i, x, y):
        out = m(x)
        return F.cross_entropy(out.float(), y) - lam * m.last_h.float().pow(2).mean()
    return Scenario(build=LinRNN, opt=lambda m: torch.optim.Adam(m.parameters(), lr=lr), batch=rnn_batch(),
                    loss=loss, steps=steps, init_scale=1.0, grower="rec", passers=["head"], probe=["inp"],
                    span=40, input_flat=False)


class Score(nn.Module):
    def forward(self, q, k):
        return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


class AttnNet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Linear(16, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.score, self.head = Score(), nn.Linear(d, 4)

    def forward(self, x):
        h = self.emb(x)
        a = self.score(self.q(h), self.k(h)).float().softmax(-1)
        return self.head((a.to(h.dtype) @ self.v(h)).mean(1))


def attn_batch(seed=21):
    W = torch.randn(16, 4, generator=gen(seed + 999))

    def batch(i):
        x = torch.randn(32, 8, 16, generator=gen(seed * 100000 + i))
        return x, (x[:, 0] @ W).argmax(-1)
    return batch


def sc_qk_warmup(cap=None, rate=1.05, steps=400, base=1e-3):
    """The q/k projections' own param group on an exponential warm-up, lr = base * rate**step, whose min(.., peak)
    is missing (`cap`: with it)."""
    def opt(m):
        qk = [p for n, p in m.named_parameters() if n.split(".")[0] in ("q", "k")]
        rest = [p for n, p in m.named_parameters() if n.split(".")[0] not in ("q", "k")]
        return torch.optim.Adam([{"params": qk, "lr": base}, {"params": rest, "lr": 1e-3}])

    def after(m, o, i):
        lr = base * rate ** (i + 1)
        o.param_groups[0]["lr"] = lr if cap is None else min(lr, cap)
    sc = Scenario(build=AttnNet, opt=opt, batch=attn_batch(), loss=ce, steps=steps, after=after, init_scale=1024.0,
                  grower="q", passers=["score"], probe=["k", "emb", "head"], span=40)
    sc.reach = "score"      # q.k^T: the logits fall twice as fast as q and k and reach the max first
    return sc


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(torch.relu(x))


class ResConv(nn.Module):
    """A BatchNorm-free residual conv net: stem -> blocks (x + conv(relu(x))) -> pooled linear head."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(Block(c), Block(c))
        self.head = nn.Linear(c, 1)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def sc_conv_block_lr(lr=0.5, steps=400):
    """A block added to a pretrained BatchNorm-free residual conv net and fine-tuned alone (the rest frozen) by SGD
    at an lr above 2/lambda_max of the (then quadratic) loss in its weights: its conv output oscillates in sign and
    grows geometrically."""
    Wt = torch.randn(3, 1, generator=gen(31))

    def batch(i):
        x = torch.randn(16, 3, 8, 8, generator=gen(300 + i))
        return x, x.mean((2, 3)) @ Wt

    def build():
        m = ResConv()
        m.requires_grad_(False)
        m.blocks[1].requires_grad_(True)
        return m
    return Scenario(build=build, opt=lambda m: torch.optim.SGD(m.blocks[1].parameters(), lr=lr), batch=batch,
                    loss=lambda m, i, x, y: F.mse_loss(m(x).float(), y), steps=steps, init_scale=64.0,
                    grower="blocks.1.conv", passers=["head"], probe=["stem", "blocks.0", "blocks.1", "blocks"],
                    span=40)


# --- B) healthy twins -------------------------------------------------------------------------------------------------

class FlatNet(nn.Module):
    """A frozen pretrained projection whose output sits at ~1e4, read through a LayerNorm."""

    def __init__(self, level=1e4):
        super().__init__()
        self.stem, self.ln, self.head = nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 4)
        with torch.no_grad():
            self.stem.weight.mul_(level / 4.0 / self.stem.weight.abs().sum(1).mean())
        self.stem.requires_grad_(False)

    def forward(self, x):
        return self.head(self.ln(self.stem(x)))


def sc_flat_1e4():
    return Scenario(build=FlatNet, opt=lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad],
                                                                  lr=1e-3),
                    batch=cls_batch(seed=4), loss=ce, steps=300, probe=["stem"])


class Accum(nn.Module):
    """An fp32 running sum that grows x1.05 a step (an un-normalised 'feature memory'), used only after an fp32
    normalisation: it never meets an fp16 op."""

    def __init__(self, d=64):
        super().__init__()
        self.register_buffer("s", torch.ones(d))

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                self.s.mul_(1.05).add_(h.detach().float().abs().mean(0))
        with torch.autocast("cpu", enabled=False):
            return self.s.float().expand(h.shape[0], -1) * 1.0


class AccNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.acc, self.head = nn.Linear(16, 64), Accum(), nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        a = self.acc(h)
        with torch.autocast("cpu", enabled=False):
            g = a / a.norm(dim=-1, keepdim=True)
        return self.head(h * g.to(h.dtype))


def sc_fp32_memory():
    return Scenario(build=AccNet, opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), batch=cls_batch(seed=6),
                    loss=ce, steps=300, probe=["acc"])


# --- the tests ----------------------------------------------------------------------------------------------------

FAILING = {
    # name: (scenario, the modules accepted as the producer)
    "layernorm_gain_energy_reward": (sc_ln_gain_energy, ("ln",)),
    "rnn_spectral_radius_creep": (lambda: sc_rnn_spectral_creep(lr=2e-4), ("rec",)),
    "qk_uncapped_exponential_warmup": (sc_qk_warmup, ("q", "k")),
    "conv_new_block_lr_too_high": (lambda: sc_conv_block_lr(lr=0.6), ("blocks.1.conv",)),
}
STRIDES = (1, 16)     # the default watch's series stride, pinned: its budget picks 1..32 on these tiny models
EXTRA = [("conv_new_block_lr_too_high", 32)]
FAILING_WRONG: dict[tuple, str] = {
}
# wrong when written, right since: qk_uncapped_exponential_warmup at strides 1 and 16 (named `score`, which has no
# weights; rules/headroom.py `_factors` names the weighted layers whose falls add up to a weightless product's);
# (record/budget.py `creep`: an fp16 output within 8 bits of the max that keeps
# rising has the series on every step for a while, whatever the stride): layernorm_gain_energy_reward at stride 16
# (no headroom_trend at all), rnn_spectral_radius_creep at stride 16 (warned at step 243 for a first skip at 241),
# conv_new_block_lr_too_high at stride 32 (warned at step 169 for a first skip at 166)


def check(cond, *what):
    """A report check: its failure is a WrongAnswer (the one expected failure of a case marked `wrong`)."""
    if not cond:
        raise WrongAnswer(repr(what))


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


@pytest.mark.parametrize("name,stride", [
    pytest.param(n, k, marks=[wrong(FAILING_WRONG[(n, k)])] if (n, k) in FAILING_WRONG else [], id=f"{n}-stride{k}")
    for n, k in [(n, k) for n in FAILING for k in STRIDES] + EXTRA])
def test_creep_is_warned_at_its_producer_10_steps_before_the_first_inf_or_skip(name, stride, tmp_path,
                                                                                monkeypatch):
    import stride_sweep
    maker, accept = FAILING[name]
    sc = maker()
    ref = run(sc, watched=False)
    bad = ref.first_bad
    assert bad is not None and bad >= 2 * LEAD, (bad, ref.skips, ref.losses[-3:])
    # the oracle: the producer loses headroom steadily before the first bad step...
    rate = rate_before(ref, sc.grower, bad, sc.span)
    assert rate >= 0.05, (sc.grower, rate)
    reach = getattr(sc, "reach", sc.grower)         # ... its chain's first layer to reach the max is within the
    g = series(ref, reach)                          # rule's 8 bits 10 steps before the first bad step...
    assert g[bad - LEAD] < 8.0, (reach, g[bad - LEAD])
    # ... and its input is flat (a layer whose input grows only passes it on), unless it feeds itself (a recurrence)
    if sc.input_flat:
        assert rate_before(ref, sc.grower, bad, sc.span, "in") < 0.25 * rate, (sc.grower, "input grows")
    for p in sc.passers:
        assert rate_before(ref, p, bad, sc.span, "in") > 0.5 * rate, (p, "does not take the growth in")
    # the watched run: the default watch, its series' stride pinned (tests/stride_sweep.py)
    stride_sweep.install(stride, patch=monkeypatch.setattr)
    sc.watch = {"run_dir": str(tmp_path / "run")}
    wr = run(sc, watched=True, steps=len(ref.losses))
    same_losses(ref, wr)
    on = [r.step for r in wr.w.steps if r.headroom and not r.sampled and r.step > 20]
    # (the stride the budget runs at; a layer nearing the max has the series on every step for a while:
    # record/budget.py `creep`)
    gaps = [b - a for a, b in zip(on, on[1:])]
    assert stride == 1 or max(set(gaps), key=[g for g in gaps if g > 1].count) == stride, on[:20]
    check(wr.trend, "no headroom_trend", bad, wr.lines)
    first = wr.trend[0]
    check(first.severity in ("warning", "error"), first.one_line())
    check(first.module in accept, "names", first.module, "not", accept, "first bad", bad, wr.lines)
    check(first.step <= bad - LEAD, "at", first.step, "first bad", bad, wr.lines)
    check(first.evidence["forecast_step"] > first.step, first.evidence)
    check(not [f.one_line() for f in wr.trend if f.module in sc.passers], wr.lines)


HEALTHY = {
    # name: (scenario, the module whose abs-max the twin is about, its lowest headroom must be within 8 bits)
    "layernorm_energy_hinge_settles": (lambda: sc_ln_gain_energy(target=40.0, lam=15.0, steps=400), "ln", True),
    "qk_warmup_capped": (lambda: sc_qk_warmup(cap=0.02), "score", False),
    "flat_at_1e4": (sc_flat_1e4, "stem", True),
    "fp32_memory_never_cast": (sc_fp32_memory, "acc", False),
}
HEALTHY_WRONG: dict[str, str] = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[wrong(HEALTHY_WRONG[n])] if n in HEALTHY_WRONG else [], id=n)
                                  for n in HEALTHY])
def test_healthy_twin_is_silent(name, tmp_path):
    """The default watch, unpinned: the same outcome at strides 1, 2, 8, 16 and 32 when written."""
    maker, module, near = HEALTHY[name]
    sc = maker()
    ref = run(sc, watched=False, stop=False)
    assert all(map(math.isfinite, ref.losses)), ref.losses
    assert len([s for s in ref.skips if s >= SEARCH]) <= 1, ref.skips
    s = series(ref, module)
    if near:
        assert min(s.values()) <= 8.0, min(s.values())
    if module != "acc":
        assert min(s.values()) > 1.5, min(s.values())
    sc.watch = {"run_dir": str(tmp_path / "run")}
    wr = run(sc, watched=True, steps=len(ref.losses))
    same_losses(ref, wr)
    check(not wr.trend, wr.lines)
    check(not alarms(wr.findings), wr.lines)
