"""headroom_trend as an early warning, probed end to end on CPU fp16 loops (autocast + GradScaler, unscale_ ->
clip -> step -> update), through the public API only (`ampdoctor.watch(..., headroom=True | "auto")`, `report()`).

Each run is measured by the test itself, with its own hooks: the step of the first inf/NaN (forward output, loss) or
skipped step (found_inf after the scaler's first applied update), and which module's value crosses fp16's max
first — forward: the first module, in the order forward hooks fire (innermost first), whose fp16 output holds
inf/NaN or whose fp32 output exceeds 65504 (it overflows when the next fp16 op casts it); backward: the first
module, in the order the gradient hooks fire, whose output's gradient (fp16) holds inf/NaN.

A) Growth toward 65504 that ends in an overflow; a `headroom_trend` finding must name the crossing module or a
   module in its direct chain (listed per scenario in `ACCEPT`, with the reason), at a step >= 10 before the first
   inf/skip. Presence is asserted, not rank: the overflow, update_spike, nan_origin and the scaler's findings
   rightly come first, and the early warning is often 4th or lower (it was 1st in weightnorm_drift/ema_feedback,
   2nd in attention_temperature/residual_no_norm when it came true).
   1. lr_too_high_transformer: a small pre-LN transformer (Adam lr 0.1, no warmup, no clipping);
   2. weightnorm_drift: a weight-norm reparametrised Linear whose gain `g` an optimizer step-post hook multiplies
      by 1.15 after every step (a buggy re-normalisation);
   3. residual_no_norm: a residual stream without normalisation (only the readout has a LayerNorm), each block
      adding exp(log_alpha_k) * relu(f(x)) with gains that a sign-flipped "gain prior" raises by ~lr a step;
   4. attention_temperature: attention logits q.k * exp(log_temp) with a learnable temperature pushed up by a
      sign-flipped prior (the `score` module's logits grow exponentially);
   5. ema_feedback: a "normaliser" that multiplies by its EMA of |x| instead of dividing (positive feedback
      through a batch statistic buffer);
   6. embedding_frequent_token: an embedding and an output layer trained by SGD (lr 0.08, weight decay 0) on a
      positive-only dot-product score (no negatives): the frequent token's row and its output weights grow
      together, (1 + lr) a step (lr 0.08);
   7. swiglu_gate: a SwiGLU MLP (read through a LayerNorm) whose gate pre-activation gain grows (sign-flipped
      prior): silu saturates into its linear regime and the gated product grows;
   8. loss_weight_ramp: a curriculum loss weight x1.2 a step (backward growth; the forward stays flat);
   + default_auto_drift: scenario 2 at headroom="auto" (presence and lead only).
B) Healthy twins and traps, which must give no headroom_trend and no warning/error at all:
   plateau (fast growth for ~60 steps, then flat at ~2e3), cosine_rise_fall (AdamW noise equilibrium that follows
   a warmup+cosine lr: up, then down), domain_jump (inputs x100 once at step 100, then flat), fp32_accumulator (an
   fp32 region under autocast(enabled=False) whose output grows steadily to 1e6), integer_like (stable fp16 counts
   of 20000-40000), noisy_spikes (heavy-tailed, trendless abs-max with x10 spikes), scaler_growth (the loss scale
   doubles every 10 steps from 1: the scaled gradients grow 0.1 bits/step), tiny_long (400 steps of a tiny MLP at
   the default headroom="auto"); plus plateau and noisy_spikes again at "auto".

What ampdoctor got wrong (strict xfails):
- embedding_frequent_token (fixed since the thirty-eighth session: a loss below zero has no floor to reach, so
  rules/headroomseries.py `_fit_beyond` calls it no fit): no headroom_trend at all; only overflow_risk at `out`
  step 138 and an info skipped_steps at 137 (the first skip, 137). `out` is the model's own output and the loss (an
  unbounded -score) falls while it grows, which looked like the rule's "a regression fitting its targets" exemption.
- default_auto_drift (fixed since): at headroom="auto" the tiny model's series is sparse (stride ~11-12) and the
  x1.15 drift was not warned before the first skip at step 50 (headroom=True warns at `wn` step 35); record/budget.py
  `creep` now puts the series on every step when the last points' rate takes an output past 256 by the next point.
Seen but passing (not asserted): lr_too_high_transformer warns at blocks.0.qkv with "10.6 bits left" (more than the
README's 8-bit closeness) and residual_no_norm's second warning (blocks.1 at step 81) forecasts step 134 for an
overflow at step 88; the SwiGLU overflow finding names step 110 for a first inf at step 108.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16_MAX = 65504.0
LEAD = 10


# --- the loop and the test's own measurement --------------------------------------------------------------------

class Probe:
    """Forward hooks on every module (output abs-max, dtype, finiteness) and a gradient hook on each fp16 output."""

    def __init__(self, model):
        self.model = model
        self.step = 0
        self.fwd_cross: tuple[int, str] | None = None   # (step, module) of the first forward crossing
        self.bwd_cross: tuple[int, str] | None = None
        self.absmax: dict[str, list[tuple[int, float]]] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules()]

    def _hook(self, name):
        def hook(mod, args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                return
            with torch.no_grad():
                a = t.detach().float().abs().max().item() if t.numel() else 0.0
            self.absmax.setdefault(name, []).append((self.step, a))
            bad = (not math.isfinite(a)) if t.dtype == torch.float16 else (not math.isfinite(a) or a > FP16_MAX)
            if bad and self.fwd_cross is None:
                self.fwd_cross = (self.step, name)
            if t.requires_grad and t.dtype == torch.float16:
                step = self.step

                def ghook(g):
                    if self.bwd_cross is None and not bool(torch.isfinite(g).all()):
                        self.bwd_cross = (step, name)
                t.register_hook(ghook)
        return hook

    def param_grads(self, step):
        """A weight gradient computed in fp16 (grad_out x input) that overflowed: the modules whose own parameters'
        gradients hold inf/NaN, the last layer first (the order in which backward reaches them)."""
        if self.bwd_cross is not None and self.bwd_cross[0] < step:
            return
        bad = [n for n, m in reversed(list(self.model.named_modules()))
               if any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in m.parameters(False))]
        if bad and self.bwd_cross is None:
            self.bwd_cross = (step, bad[0])

    def close(self):
        for h in self.handles:
            h.remove()


class Run:
    def __init__(self, w, probe, losses, scales, skips, first_bad):
        self.w, self.probe, self.losses, self.scales, self.skips, self.first_bad = (w, probe, losses, scales, skips,
                                                                                    first_bad)
        self.rep = w.report(replay=False)
        self.findings = self.rep.findings

    def trend(self):
        return [f for f in self.findings if f.rule == "headroom_trend"]

    def lines(self):
        return [f.one_line() for f in self.findings]

    def cross(self):
        """(step, module, phase) of the first crossing of fp16's max the test saw."""
        c = [(s, m, "forward") for s, m in [self.probe.fwd_cross or (None, None)] if s is not None]
        c += [(s, m, "backward") for s, m in [self.probe.bwd_cross or (None, None)] if s is not None]
        return min(c, key=lambda x: (x[0], x[2] != "forward")) if c else None

    def peak(self, module):
        return max(a for _, a in self.probe.absmax[module])


def fit(model, batch, loss_fn, *, steps, opt=None, lr=1e-3, sched=None, clip=1.0, init_scale=1024.0,
        growth_interval=2000, headroom=True, after=None, stop_after_bad=3):
    """zero_grad -> autocast fp16 forward + loss -> scaler.scale(loss).backward -> unscale_ -> clip -> step ->
    update -> sched.step -> after(i). Stops `stop_after_bad` steps after the first inf/NaN or skip."""
    torch.manual_seed(0)
    opt = opt(model) if callable(opt) else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched) if sched else None
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    probe = Probe(model)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, headroom=headroom)
    losses, scales, skips, first_bad, applied = [], [], [], None, False
    try:
        for i in range(steps):
            probe.step = i
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model, i, *batch(i))
            sc.scale(loss).backward()
            probe.param_grads(i)
            sc.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = sc.get_scale()
            sc.step(opt)
            sc.update()
            skipped = sc.get_scale() < before
            if sched:
                sched.step()
            if after:
                with torch.no_grad():
                    after(i)
            losses.append(loss.item())
            scales.append(sc.get_scale())
            if skipped:
                skips.append(i)
            bad = (not math.isfinite(losses[-1])) or (skipped and applied) or (probe.fwd_cross is not None)
            applied = applied or not skipped
            if bad and first_bad is None:
                first_bad = i
            if first_bad is not None and i >= first_bad + stop_after_bad:
                break
    finally:
        w.close()
        probe.close()
    return Run(w, probe, losses, scales, skips, first_bad)


def ce(model, i, x, y):
    return F.cross_entropy(model(x).float(), y)


def cls_batch(d=16, n=64, classes=4, scale=1.0, seed=0):
    W = torch.randn(d, classes, generator=gen(seed + 999))

    def batch(i):
        x = torch.randn(n, d, generator=gen(seed * 100000 + i)) * (scale(i) if callable(scale) else scale)
        return x, (x @ W).argmax(-1)
    return batch


# --- A) growth that ends in an overflow ---------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = heads

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.h)
        a = a.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallTransformer(nn.Module):
    def __init__(self, vocab=40, d=32, n=2, T=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.lnf, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))


def run_lr_too_high_transformer(headroom=True):
    m = SmallTransformer()
    data = torch.randint(0, 40, (32, 17), generator=gen(5))

    def batch(i):
        rows = data[(torch.arange(8) + 8 * i) % 32]
        return rows[:, :-1], rows[:, 1:]

    def loss(m, i, x, y):
        return F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())
    return fit(m, batch, loss, steps=250, lr=0.1, clip=None, headroom=headroom)


class WNLinear(nn.Module):
    """Linear with weight = g * v / ||v|| (per output row)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.v = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.g = nn.Parameter(torch.ones(d_out, 1))
        self.b = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return F.linear(x, self.g * self.v / self.v.norm(dim=1, keepdim=True), self.b)


class WNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.wn = WNLinear(64, 64)
        self.act = nn.ReLU()
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.act(self.wn(torch.relu(self.inp(x)))))


def run_weightnorm_drift(headroom=True):
    m = WNNet()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)

    def renorm(optimizer, args, kwargs):      # the bug: re-applies a gain correction on every step
        with torch.no_grad():
            m.wn.g.mul_(1.15)
    opt.register_step_post_hook(renorm)
    return fit(m, cls_batch(), ce, steps=200, opt=lambda _: opt, headroom=headroom)


class ReZeroBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = nn.Linear(d, d)
        self.log_alpha = nn.Parameter(torch.tensor(-1.0))

    def forward(self, x):
        return x + self.log_alpha.exp().to(x.dtype) * torch.relu(self.f(x))


class ResidualNoNorm(nn.Module):
    def __init__(self, d=32, n=4):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(ReZeroBlock(d) for _ in range(n))
        self.lnf, self.head = nn.LayerNorm(d), nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))   # only the readout is normalised (fp32 under autocast)


def run_residual_no_norm():
    m = ResidualNoNorm()

    def loss(m, i, x, y):   # a gain "prior" with its sign flipped: it rewards large gains
        return F.cross_entropy(m(x).float(), y) - 1.0 * sum(b.log_alpha for b in m.blocks)

    def opt(m):
        alphas = [b.log_alpha for b in m.blocks]
        rest = [p for n, p in m.named_parameters() if not n.endswith("alpha")]
        return torch.optim.Adam([{"params": rest, "lr": 1e-3}, {"params": alphas, "lr": 0.05}])
    return fit(m, cls_batch(), loss, steps=250, opt=opt, clip=None)


class Score(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_temp = nn.Parameter(torch.tensor(0.0))

    def forward(self, q, k):
        return (q @ k.transpose(-1, -2)) * self.log_temp.exp().to(q.dtype)


class TempAttention(nn.Module):
    def __init__(self, d=32, T=8):
        super().__init__()
        self.emb = nn.Linear(16, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.score = Score()
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.emb(x)
        a = self.score(self.q(h), self.k(h)).float().softmax(-1).to(h.dtype)
        return self.head((a @ self.v(h)).mean(1))


def run_attention_temperature():
    m = TempAttention()
    W = torch.randn(16, 4, generator=gen(77))

    def batch(i):
        x = torch.randn(16, 8, 16, generator=gen(3000 + i))
        return x, (x.mean(1) @ W).argmax(-1)

    def loss(m, i, x, y):
        return F.cross_entropy(m(x).float(), y) - 1.0 * m.score.log_temp

    def opt(m):
        rest = [p for n, p in m.named_parameters() if n != "score.log_temp"]
        return torch.optim.Adam([{"params": rest, "lr": 1e-3}, {"params": [m.score.log_temp], "lr": 0.06}])
    return fit(m, batch, loss, steps=250, opt=opt)


class EMAScale(nn.Module):
    """Meant to divide by a running |x| statistic; multiplies by it instead (positive feedback)."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("stat", torch.ones(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():   # the statistic of the output it scales: positive feedback
                self.stat.mul_(0.9).add_(0.1 * (x.detach().float() * self.stat).abs().mean(0))
        return x * self.stat.to(x.dtype)


class EMANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.norm = EMAScale(64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def run_ema_feedback():
    m = EMANet()
    with torch.no_grad():
        m.fc1.weight.mul_(4.0)   # |fc1 out| ~ 2 on average: the statistic grows ~x1.15 a step
    return fit(m, cls_batch(), ce, steps=250, lr=1e-3)


class DotScore(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.out = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            self.emb.weight.mul_(0.3)
            self.out.weight.mul_(0.3)

    def forward(self, x):
        return self.out(self.emb(x))


def run_embedding_frequent_token():
    m = DotScore()

    def batch(i):      # token 3 is in every pair (a frequent token), its context varies
        g = gen(500 + i)
        ctx = torch.randint(0, 50, (32,), generator=g)
        ctx[:16] = 7
        return torch.full((32,), 3), ctx

    def loss(m, i, x, y):   # positive-only objective: raise the pair's score, no negatives
        return -m(x).float().gather(1, y[:, None]).mean()

    return fit(m, batch, loss, steps=250, opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.08, weight_decay=0.0),
               clip=1e6)


class SwiGLU(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)
        self.log_gain = nn.Parameter(torch.tensor(0.0))

    def forward(self, x):
        return self.down(F.silu(self.gate(x) * self.log_gain.exp().to(x.dtype)) * self.up(x))


class GLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mlp = SwiGLU()
        self.ln, self.head = nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.ln(self.mlp(self.inp(x))))


def run_swiglu_gate():
    m = GLUNet()

    def loss(m, i, x, y):
        return F.cross_entropy(m(x).float(), y) - 1.0 * m.mlp.log_gain

    def opt(m):
        rest = [p for n, p in m.named_parameters() if n != "mlp.log_gain"]
        return torch.optim.Adam([{"params": rest, "lr": 1e-3}, {"params": [m.mlp.log_gain], "lr": 0.1}])
    return fit(m, cls_batch(), loss, steps=250, opt=opt)


def run_loss_weight_ramp():
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def loss(m, i, x, y):   # the curriculum weight: x1.2 a step (meant to be capped at 1)
        return 1e-3 * 1.2 ** i * F.cross_entropy(m(x).float(), y)
    return fit(m, cls_batch(), loss, steps=250, lr=1e-3, init_scale=1.0)


FAILURES = {
    # name: (runner, modules a headroom_trend may name, why)
    "lr_too_high_transformer": (run_lr_too_high_transformer, ("blocks.",),
                                "the growth is in the blocks' projections; any of them is the growing chain"),
    "weightnorm_drift": (run_weightnorm_drift, ("wn", "act", "head"),
                         "wn is the growing layer; act (its ReLU, a child of the root that passes it on) and head "
                         "(the direct consumer that reaches the max first) are its chain"),
    "residual_no_norm": (run_residual_no_norm, ("blocks.", "lnf"),
                         "every block adds to the stream (the blocks' outputs are the stream); lnf reads it"),
    "attention_temperature": (run_attention_temperature, ("score",), "the logits' module"),
    "ema_feedback": (run_ema_feedback, ("norm", "fc2"), "the buffer's module, or its direct consumer"),
    "embedding_frequent_token": (run_embedding_frequent_token, ("out", "emb"),
                                 "the score layer (fp16) that reads the growing row; emb's output is fp32"),
    "swiglu_gate": (run_swiglu_gate, ("mlp", "ln"), "the SwiGLU (its gate/up/down children or itself) or ln reading it"),
    "loss_weight_ramp": (run_loss_weight_ramp, ("4", "3", "2", "1", "0"),
                         "backward: every layer's gradient grows at the same rate; the chain's producer"),
    # headroom=None: the default "auto", its stride pinned at 12 by the test (what the tiny model's run measures on a
    # normal draw; left to the load it was 3-12, and the outcome with it)
    "default_auto_drift": (lambda: run_weightnorm_drift(headroom=None), ("wn", "act", "head"), "as weightnorm_drift"),
}
FAILURE_XFAIL: dict[str, str] = {
}


AUTO_STRIDE = 12  # default_auto_drift's series stride (pinned: tests/stride_sweep.py)


def _named(module, prefixes):
    return module is not None and any(module == p or module.startswith(p if p.endswith(".") else p + ".")
                                      or (p.endswith(".") and module.startswith(p)) for p in prefixes)


def _params(table, xfails):
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=xfails[n])] if n in xfails else [], id=n)
            for n in table]


@pytest.mark.parametrize("name", _params(FAILURES, FAILURE_XFAIL))
def test_growth_is_forecast_at_least_10_steps_early(name, monkeypatch):
    runner, accept, _why = FAILURES[name]
    if name == "default_auto_drift":
        sys.path.insert(0, str(Path(__file__).parent))
        import stride_sweep
        stride_sweep.install(AUTO_STRIDE, patch=monkeypatch.setattr)
    torch.manual_seed(0)          # the model's initialisation
    r = runner()
    cross = r.cross()
    assert r.first_bad is not None and cross is not None, (r.first_bad, cross, r.losses[-5:], r.skips)
    # the test's own measurement: the crossing is at (or right before) the first bad step, in an accepted module
    assert _named(cross[1], accept), (cross, r.first_bad)
    if _plateaued(r, cross[1]) and cross[2] == "forward":
        # The crossing layer's own headroom was flat for the 40 steps before the failure: the growth had settled and
        # the overflow came at once, which no trend forecasts (the healthy `plateau` twin has the same shape and must
        # stay silent). Seen for lr_too_high_transformer where oneDNN runs fp16 matmuls without AVX512-FP16 (e.g.
        # ONEDNN_MAX_CPU_ISA=AVX2): then the failure itself must be diagnosed, at its step, among the first three
        # (at the layer, or - report(replay=False) on a one-step failure - as unlocated, to be replayed).
        top = [f for f in r.findings[:3] if f.severity == "error" and f.rule in ("overflow", "nan_origin")
               and f.step == r.first_bad and (_named(f.module, accept) or f.evidence.get("unlocated"))]
        assert top, (r.first_bad, cross, r.lines())
        return
    hits = [f for f in r.trend() if _named(f.module, accept) or _named(f.evidence.get("first_to_overflow"), accept)]
    assert hits, (r.first_bad, cross, r.lines())
    assert min(f.step for f in hits) <= r.first_bad - LEAD, (r.first_bad, cross, r.lines())


def _plateaued(r, module, window=40, tol=0.75):
    """The test's own measurement: `module`'s forward headroom (bits below fp16's max) stayed within `tol` bits over
    the `window` steps before the first bad step."""
    h = [math.log2(65504.0 / a) for s, a in r.probe.absmax.get(module, [])
         if r.first_bad - window <= s < r.first_bad and 0 < a < float("inf")]
    return len(h) >= window // 2 and max(h) - min(h) <= tol


# --- B) healthy twins and traps -----------------------------------------------------------------------------------

class Gain(nn.Module):
    def __init__(self, init=0.0):
        super().__init__()
        self.log_gain = nn.Parameter(torch.tensor(init))

    def forward(self, x):
        return x * self.log_gain.exp().to(x.dtype)


def run_plateau(headroom=True):
    """A regression head on raw targets ~2000: a learnable output gain (Adam lr 0.1) grows it fast over the first
    ~60 steps, then it plateaus ~5 bits below the max."""
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1), Gain())
    Wt = torch.randn(8, 1, generator=gen(8))

    def batch(i):
        x = torch.randn(64, 8, generator=gen(7000 + i))
        return x, 2000.0 * (1 + 0.2 * torch.tanh(x @ Wt))

    def opt(m):
        return torch.optim.Adam([{"params": m[:3].parameters(), "lr": 3e-3}, {"params": m[3].parameters(), "lr": 0.1}])
    return fit(m, batch, lambda m, i, x, y: F.l1_loss(m(x).float(), y), steps=300, opt=opt, clip=None,
               headroom=headroom, init_scale=16.0, stop_after_bad=10 ** 6)


def run_cosine_rise_fall():
    """Inputs ~100 into a wide Linear trained by AdamW (weight decay 0.5) on noise: its weights settle where the
    random walk of the updates balances the decay, a level that follows the lr (warmup 30, cosine to 0 at 300):
    the output's abs-max rises to ~1e3-1e4 and falls back."""
    m = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))

    def batch(i):
        x = 300.0 * torch.randn(64, 32, generator=gen(9000 + i))
        return x, torch.randint(0, 4, (64,), generator=gen(19000 + i))

    def sched(s):
        return (s + 1) / 30 if s < 30 else 0.5 * (1 + math.cos(math.pi * (s - 30) / 270))
    return fit(m, batch, ce, steps=300, opt=lambda m: torch.optim.AdamW(m.parameters(), lr=0.5, weight_decay=0.5),
               sched=sched, clip=None, init_scale=16.0, stop_after_bad=10 ** 6)


def run_domain_jump():
    """A new data domain from step 100 on: inputs x100 once, then the same scale: fc1's output jumps ~6.6 bits (to
    ~1e3) and stays flat."""
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    return fit(m, cls_batch(scale=lambda i: 3.0 if i < 100 else 300.0), ce, steps=250, lr=1e-3,
               stop_after_bad=10 ** 6)


class FP32Counter(nn.Module):
    """An fp32 region (autocast off): a running count of the tokens seen, which grows to ~1e6 by design; only its
    log reaches the fp16 layers."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(16))

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            if self.training:
                self.seen += x.detach().float().abs().sum(0) * 10
            return x.float() * self.seen   # fp32, grows steadily past 65504


class CounterNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = FP32Counter()
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        c = self.count(x)
        feat = torch.log1p(c.abs()) * torch.sign(c)
        return self.head(torch.relu(self.fc(feat)))


def run_fp32_accumulator():
    return fit(CounterNet(), cls_batch(), ce, steps=200, lr=1e-3, stop_after_bad=10 ** 6)


class Counts(nn.Module):
    """Integer counts of 20000-40000 held in fp16 (exact to 16 at that size), then scaled down by a fixed 1/32768."""

    def forward(self, n):
        return n.to(torch.float16)


class CountNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.counts = Counts()
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, n):
        return self.head(torch.relu(self.fc(self.counts(n) / 32768.0)))


def run_integer_like():
    W = torch.randn(16, 4, generator=gen(31))

    def batch(i):
        n = torch.randint(20000, 40000, (64, 16), generator=gen(4000 + i)).float()
        return n, ((n - 30000) @ W).argmax(-1)
    return fit(CountNet(), batch, ce, steps=250, lr=1e-3, stop_after_bad=10 ** 6)


def run_noisy_spikes(headroom=True):
    """Heavy-tailed inputs (Student-t, 2 dof) scaled so fc1's abs-max sits around 1e3, with a x10 outlier row in
    one batch in 25: a noisy, trendless series with spikes to ~1e4."""
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    W = torch.randn(16, 4, generator=gen(41))
    t = torch.distributions.StudentT(2.0)

    def batch(i):
        torch.manual_seed(6000 + i)
        x = 20.0 * t.sample((64, 16))
        if i % 25 == 7:
            x[0] *= 10.0
        return x, (x @ W).argmax(-1)
    return fit(m, batch, ce, steps=300, lr=1e-3, headroom=headroom, stop_after_bad=10 ** 6)


def run_scaler_growth():
    """The loss scale starts at 1 and doubles every 10 steps (growth_interval=10): the scaled gradients grow
    0.1 bits/step, steadily, until the scaler backs off (its normal search), which is not a trend of the model."""
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    return fit(m, cls_batch(), ce, steps=250, lr=1e-3, init_scale=1.0, growth_interval=10, stop_after_bad=10 ** 6)


def run_tiny_long():
    """400 steps of a tiny MLP at the default headroom="auto"."""
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    return fit(m, cls_batch(), ce, steps=400, lr=3e-3, headroom="auto", stop_after_bad=10 ** 6)


HEALTHY = {
    # name: (runner, module whose abs-max the scenario is about, (low, high) bound on its peak abs-max)
    "plateau": (run_plateau, "3", (1000.0, 8000.0)),
    "cosine_rise_fall": (run_cosine_rise_fall, "0", (256.0, 30000.0)),
    "domain_jump": (run_domain_jump, "0", (256.0, 30000.0)),
    "fp32_accumulator": (run_fp32_accumulator, "count", (FP16_MAX, math.inf)),
    "integer_like": (run_integer_like, "counts", (30000.0, 40000.0)),
    "noisy_spikes": (run_noisy_spikes, "0", (256.0, 60000.0)),
    "scaler_growth": (run_scaler_growth, "2", (0.0, math.inf)),
    "tiny_long": (run_tiny_long, "4", (0.0, math.inf)),
    "plateau_auto": (lambda: run_plateau(headroom="auto"), "3", (1000.0, 8000.0)),
    "noisy_spikes_auto": (lambda: run_noisy_spikes(headroom="auto"), "0", (256.0, 60000.0)),
}
HEALTHY_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize("name", _params(HEALTHY, HEALTHY_XFAIL))
def test_healthy_growth_plateau_or_trap_is_silent(name):
    runner, mod, (lo, hi) = HEALTHY[name]
    torch.manual_seed(0)
    r = runner()
    assert all(map(math.isfinite, r.losses)) and r.probe.fwd_cross is None or name == "fp32_accumulator", r.losses
    assert lo <= r.peak(mod) <= hi, (mod, r.peak(mod))      # the trap is really there
    assert not r.trend(), r.lines()
    assert not alarms(r.findings), r.lines()
