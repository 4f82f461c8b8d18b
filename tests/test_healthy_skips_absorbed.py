"""HEALTHY fp16 runs that hold two harmless things at once, each of which ampdoctor explains on its own: (a) a rare
step that GradScaler skips at a loss scale that earlier applied steps already used (a hard batch whose target is off
by 100..400 every 70 steps, or a scale grown by a small growth_interval that overflows now and then), after which the
scaler backs off and training goes on; and (b) an intentional -inf or saturated value in the forward that the model
itself absorbs (a -inf padding mask before softmax with >= 1 real key per row, a torch.where(c > 0, c.log(), 0)
guard, masked_fill(-inf) -> MaxPool2d -> ReLU, an fp16 -1e4 / -65504 logit bias, sigmoid saturating to 1.0 then a
clamp). A watch that replays an unexplained skip (replaychoice.unexplained_skips) and also sees the -inf can blame
the -inf for the skip. Also runs with (a) only and (b) only. CPU fp16 autocast (loss inside it, on the fp32 cast),
torch.amp.GradScaler("cpu", init_scale, growth_interval), AdamW, clip_grad_norm_(1.0), `ampdoctor.watch(model,
optimizer=opt, scaler=scaler, run_dir=tmp)` at its defaults, one intra-op thread, fixed seeds, 160-250 steps.

The test's own oracle first (a failure is a plain failure): every loss finite; every model output finite (the
-inf / saturation absorbed) and every weight finite after every step; each skip followed by an applied update
within 4 steps; at most max(4, steps/25) skips after the first 10 steps; (a) runs: at least one such skip at a scale
<= one an earlier applied step used, (b)-only runs: none; (b) runs: the -inf / saturated value present in at least
half the forwards (counted by the model), others: never; the mean loss of the last fifth of the ordinary batches
(hard batches and skipped steps left out) below 0.7 x the first fifth's. Then w.report() after w.close(): no
warning, no error, exit code 0, no `ampdoctor...` Python warning; else a strict xfail (probe_harness.wrong) quoting
the false findings.

(a) + (b):
 1. tfm_padmask_spike: token transformer block, masked_fill(pad keys, -inf) before softmax, regression; target +400
    at steps 40, 110, 180 (skips at 16384, 8192, 4096).
 2. mlp_wherelog_spike: MLP on Poisson count features through torch.where(c > 0, c.log(), 0) on fp16 counts; target
    +300 at 45, 115, 185 (skips at 16384, 8192, 4096).
 3. conv_maskpool_relu_spike: conv net, masked_fill(invalid columns, -inf) -> MaxPool2d(2) -> ReLU; target +300 at
    35, 105, 175.
 4. gru_attnpool_spike: GRU -> attention pooling with masked_fill(padded steps, -inf) -> softmax; target +400 at 50,
    120, 190.
 5. tfm_bias1e4_growth: the transformer with an additive fp16 -1e4 padding bias, init_scale 2**8, growth_interval
    15; target +150 at 60, 130, 200 (skips at 2**16 and 2**19, scales already stepped with).
 6. cls_bias65504_growth: MLP classifier, an fp16 -65504 bias on each sample's 5 disallowed classes (a logit below
    -16 rounds to -inf), cross-entropy; init_scale 2**14, growth_interval 30: skips at 150, 162, 200, 235.
 7. mlp_wherelog_halfspike: run 2 with a milder hard batch (+100): one skip at 45 (16384).
(a) only:
 8. mlp_spike: tanh MLP regression, target +300 at 40, 110, 180.
 9. conv_spike: run 3's conv net without the mask.
10. gru_spike_growth: GRU with a plain masked mean, init_scale 2**8, growth_interval 20, target +200 at 50, 120, 190
    (skips at 120, 190).
(b) only:
11. tfm_padmask: run 1 without hard batches.
12. mlp_wherelog: run 2 without hard batches.
13. sigmoid_clamp_bce: MLP on x4-scaled inputs (separable), fp16 sigmoid saturating to exactly 0/1, clamp(1e-3,
    1 - 1e-3), hand-written BCE.

Result when written: 11 pass, 2 xfail (whole file ~15 s). The xfails (exit code 1), both times the same false error:
 - 2 mlp_wherelog_spike and 7 mlp_wherelog_halfspike: `[error] overflow at (root) aten::log step 45: aten::log in
   `(root)` hit its singular point (an input is 0 / -1) and produced -inf; the run skipped step 45 at a loss scale
   (16384) that earlier steps had stepped with: this overflow, not the scaler's search, is why` -- the -inf of the
   log is in the branch torch.where discards (on input data: no gradient flows through it) and is there on every
   step; the skip is the hard batch's gradient (run 12, the same model without hard batches, and run 8, the hard
   batches without the guard, are quiet). Every other run gets at most [info] skipped_steps / [info] overflow.
   (The error came from a change of the same day, promoting a replayed forward overflow at an unexplained skip; it
   now leaves out ops at their singular point and absorbed ones: 13 pass since.)
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import WrongAnswer, finite  # noqa: E402
from scenarios import alarms, gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = torch.float16
RECOVER = 4         # every skip is followed by an applied update within this many steps
OPENING = 10        # the scaler's opening search: skips before this step are not the spike


# --- the models: each counts in `hits` the forwards where its intentional -inf / saturated value was there ----------

class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.hits = 0

    def note(self, bad):
        with torch.no_grad():
            self.hits += int(bool(bad.any()))


class PadAttnBlock(Counted):
    """Token embedding -> one pre-LN transformer block (2 heads) whose scores get masked_fill(pad, -inf) on padded
    keys (every row keeps >= 1 real key) or an additive fp16 bias (`bias`: -1e4 on padded keys) -> masked mean pool
    -> Linear head."""

    def __init__(self, vocab=24, d=32, heads=2, out=1, bias=None):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(16, d) * 0.1)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, out)
        self.h, self.bias = heads, bias

    def forward(self, tok, pad):
        B, T = tok.shape
        x = self.emb(tok) + self.pos[:T]
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.bias is None:
            s = s.masked_fill(pad[:, None, None, :], float("-inf"))
            self.note(torch.isinf(s))
        else:
            s = s + pad[:, None, None, :].to(s.dtype) * self.bias
            self.note(s <= self.bias / 2)
        a = torch.softmax(s, -1)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(B, T, -1))
        x = x + self.ff(self.ln2(x))
        keep = (~pad).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1)).squeeze(-1)


def tok_batch(i, seed, B=32, T=12, vocab=24):
    """Token sequences of random length 2..T (the rest padding, token 0); target: the mean of a fixed per-token value
    over the real tokens."""
    g = gen(seed * 100003 + i)
    tok = torch.randint(1, vocab, (B, T), generator=g)
    n = torch.randint(2, T + 1, (B,), generator=g)
    pad = torch.arange(T)[None, :] >= n[:, None]
    tok = tok.masked_fill(pad, 0)
    val = torch.linspace(-1, 1, vocab)[torch.randperm(vocab, generator=gen(seed))]
    y = (val[tok] * (~pad)).sum(1) / n
    return (tok, pad), y


class WhereLogMLP(Counted):
    """Count features (Poisson, many zeros) -> torch.where(c > 0, c.log(), 0) on the fp16 counts (log(0) = -inf in
    the discarded branch) -> MLP."""

    def __init__(self, d=12, h=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 1))

    def forward(self, c):
        c = c.to(FP16)
        lg = c.log()
        self.note(torch.isinf(lg))
        return self.net(torch.where(c > 0, lg, 0).to(FP16)).squeeze(-1)


W_COUNT = torch.randn(12, generator=gen(7)) * 0.5


def count_batch(i, seed, B=32):
    g = gen(seed * 100003 + i)
    c = torch.poisson(torch.rand(B, 12, generator=g) * 3, generator=g)
    y = torch.where(c > 0, c.log(), 0) @ W_COUNT + 0.3 * (c > 0).float().sum(1) / 12
    return (c,), y


class MaskPoolConv(Counted):
    """Conv(1->8) -> masked_fill(invalid pixels, -inf) -> MaxPool2d(2) (an all-invalid window keeps -inf) -> ReLU
    (-inf -> 0) -> Conv(8->16) -> ReLU -> global mean -> Linear. `mask=False`: no fill."""

    def __init__(self, mask=True):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, 1)
        self.mask = mask

    def forward(self, img, valid):
        h = self.c1(img)
        if self.mask:
            h = h.masked_fill(~valid, float("-inf"))
        h = F.max_pool2d(h, 2)
        self.note(torch.isinf(h))
        h = torch.relu(h)
        h = torch.relu(self.c2(h))
        return self.head(h.mean((2, 3))).squeeze(-1)


def img_batch(i, seed, B=16, S=12):
    """Noise images with one bright 2x2 blob of amplitude a in the valid region (the columns left of a random width
    4..S); target a."""
    g = gen(seed * 100003 + i)
    img = torch.randn(B, 1, S, S, generator=g) * 0.2
    wid = torch.randint(4, S + 1, (B,), generator=g)
    valid = (torch.arange(S)[None, None, None, :] < wid[:, None, None, None]).expand(B, 1, S, S)
    a = torch.rand(B, generator=g)
    for b in range(B):
        r = int(torch.randint(0, S - 1, (1,), generator=g))
        c = int(torch.randint(0, int(wid[b]) - 1, (1,), generator=g))
        img[b, 0, r:r + 2, c:c + 2] += 3 * a[b]
    img = img * valid
    return (img, valid), a


class GRUPool(Counted):
    """GRU(4->24) -> attention pooling whose scores get masked_fill(padded steps, -inf) -> Linear. `mask=False`:
    a plain masked mean instead."""

    def __init__(self, mask=True):
        super().__init__()
        self.gru = nn.GRU(4, 24, batch_first=True)
        self.score, self.head = nn.Linear(24, 1), nn.Linear(24, 1)
        self.mask = mask

    def forward(self, x, pad):
        h, _ = self.gru(x)
        if self.mask:
            s = self.score(h).squeeze(-1).masked_fill(pad, float("-inf"))
            self.note(torch.isinf(s))
            a = torch.softmax(s, -1).unsqueeze(-1)
            z = (a.to(h.dtype) * h).sum(1)
        else:
            keep = (~pad).unsqueeze(-1).to(h.dtype)
            z = (h * keep).sum(1) / keep.sum(1)
        return self.head(z).squeeze(-1)


def seq_batch(i, seed, B=16, T=10):
    """Sequences of length 2..T (padding zeros); target: the mean of feature 0 times the sign of the last real
    step's feature 1."""
    g = gen(seed * 100003 + i)
    x = torch.randn(B, T, 4, generator=g)
    n = torch.randint(2, T + 1, (B,), generator=g)
    pad = torch.arange(T)[None, :] >= n[:, None]
    x = x.masked_fill(pad.unsqueeze(-1), 0)
    y = (x[..., 0].sum(1) / n) + 0.5 * torch.tanh(x[torch.arange(B), n - 1, 1])
    return (x, pad), y


class BiasedClassifier(Counted):
    """MLP -> 10 logits + an fp16 bias of `bias` (-65504 or -1e4) on the classes the sample may not take -> softmax
    cross-entropy on the fp32 cast (at -65504 a logit below -16 rounds to -inf)."""

    def __init__(self, bias, d=16, h=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))
        self.bias = bias

    def forward(self, x, allowed):
        z = self.net(x)
        z = z + (~allowed).to(z.dtype) * torch.tensor(self.bias, dtype=z.dtype)
        self.note(z <= self.bias / 2)
        return z


W_CLS = torch.randn(16, 10, generator=gen(11))


def cls_batch(i, seed, B=32):
    """Gaussian inputs, label = argmax of a teacher over the 5 allowed classes of each sample (random)."""
    g = gen(seed * 100003 + i)
    x = torch.randn(B, 16, generator=g)
    allowed = torch.rand(B, 10, generator=g).argsort(1) < 5
    y = (x @ W_CLS).masked_fill(~allowed, float("-inf")).argmax(1)
    return (x, allowed), y


class SigmoidClampMLP(Counted):
    """MLP -> sigmoid in fp16 (saturates to exactly 0 or 1 for |z| > ~8.3) -> clamp(1e-3, 1 - 1e-3) -> a hand-written
    binary cross-entropy on the fp32 cast (without the clamp, log(1 - 1) = -inf)."""

    def __init__(self, d=16, h=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, 1))

    def forward(self, x):
        p = torch.sigmoid(self.net(x).squeeze(-1))
        self.note((p == 1) | (p == 0))
        return p.clamp(1e-3, 1 - 1e-3)


W_BIN = torch.randn(16, generator=gen(13))


def bin_batch(i, seed, B=64):
    """Inputs x4 of unit Gaussian (a separable, large-margin problem: the logits grow past fp16 sigmoid's range)."""
    g = gen(seed * 100003 + i)
    x = torch.randn(B, 16, generator=g) * 4
    return (x,), (x @ W_BIN > 0).float()


class PlainMLP(Counted):
    def __init__(self, d=16, h=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


W_REG = torch.randn(16, generator=gen(17)) * 0.3


def reg_batch(i, seed, B=32):
    g = gen(seed * 100003 + i)
    x = torch.randn(B, 16, generator=g)
    return (x,), torch.sin(x @ W_REG) + 0.1 * x[:, 0]


# --- losses ------------------------------------------------------------------------------------------------------

def mse(out, y):
    return F.mse_loss(out.float(), y)


def xent(out, y):
    return F.cross_entropy(out.float(), y)


def bce(p, y):
    p = p.float()
    return -(y * p.log() + (1 - y) * (1 - p).log()).mean()


def spiking(batch, every, first, big, seed):
    """`batch` with one hard sample every `every` steps from `first`: its target (a regression's) off by `big`."""
    def b(i):
        args, y = batch(i, seed)
        if b.hard(i):
            y = y.clone()
            y[0] += big
        return args, y
    b.hard = lambda i: i >= first and (i - first) % every == 0
    return b


def plain(batch, seed):
    def b(i):
        return batch(i, seed)
    b.hard = lambda i: False
    return b


# --- the runs ------------------------------------------------------------------------------------------------------

@dataclass
class Run:
    build: Callable            # () -> model
    batch: Callable            # i -> (args, y)
    loss: Callable             # (out, y) -> scalar
    steps: int
    spike: bool                # (a): a late skip at a scale an applied step already used is expected
    absorb: bool               # (b): the intentional -inf / saturation is expected
    lr: float = 3e-3
    init_scale: float = 2.0 ** 14
    growth_interval: int = 2000
    fall: float = 0.7          # the mean loss of the last fifth (of non-spike steps) < fall x the first fifth's


def seeded(cls, seed, *a, **k):
    def f():
        torch.manual_seed(seed)
        return cls(*a, **k)
    return f


RUNS = {
    # (a) + (b)
    "tfm_padmask_spike": Run(seeded(PadAttnBlock, 1), spiking(tok_batch, 70, 40, 400.0, 1), mse, 220, True, True),
    "mlp_wherelog_spike": Run(seeded(WhereLogMLP, 2), spiking(count_batch, 70, 45, 300.0, 2), mse, 220, True, True),
    "conv_maskpool_relu_spike": Run(seeded(MaskPoolConv, 3), spiking(img_batch, 70, 35, 300.0, 3), mse, 180, True,
                                    True),
    "gru_attnpool_spike": Run(seeded(GRUPool, 4), spiking(seq_batch, 70, 50, 400.0, 4), mse, 200, True, True),
    "tfm_bias1e4_growth": Run(seeded(PadAttnBlock, 5, bias=-1e4), spiking(tok_batch, 70, 60, 150.0, 5), mse, 220,
                              True, True, init_scale=2.0 ** 8, growth_interval=15),
    "cls_bias65504_growth": Run(seeded(BiasedClassifier, 6, -65504.0), plain(cls_batch, 6), xent, 250, True, True,
                                init_scale=2.0 ** 14, growth_interval=30),
    "mlp_wherelog_halfspike": Run(seeded(WhereLogMLP, 13), spiking(count_batch, 70, 45, 100.0, 13), mse, 220, True,
                                  True),
    # (a) only
    "mlp_spike": Run(seeded(PlainMLP, 7), spiking(reg_batch, 70, 40, 300.0, 7), mse, 220, True, False),
    "conv_spike": Run(seeded(MaskPoolConv, 8, mask=False), spiking(img_batch, 70, 35, 300.0, 8), mse, 180, True,
                      False),
    "gru_spike_growth": Run(seeded(GRUPool, 9, mask=False), spiking(seq_batch, 70, 50, 200.0, 9), mse, 200, True,
                            False, init_scale=2.0 ** 8, growth_interval=20),
    # (b) only
    "tfm_padmask": Run(seeded(PadAttnBlock, 10), plain(tok_batch, 10), mse, 200, False, True),
    "mlp_wherelog": Run(seeded(WhereLogMLP, 11), plain(count_batch, 11), mse, 200, False, True),
    "sigmoid_clamp_bce": Run(seeded(SigmoidClampMLP, 12), plain(bin_batch, 12), bce, 200, False, True),
}


def train(run, run_dir):
    """The ordinary loop under ampdoctor.watch at its defaults: zero_grad -> fp16 autocast forward and loss ->
    scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update. Returns what the oracle needs, the
    report and ampdoctor's RuntimeWarnings."""
    m = run.build()
    opt = torch.optim.AdamW(m.parameters(), lr=run.lr)
    sc = torch.amp.GradScaler("cpu", init_scale=run.init_scale, growth_interval=run.growth_interval)
    r = dict(losses=[], scales=[], skipped=[], out_bad=[], w_bad=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir)
        for i in range(run.steps):
            args, y = run.batch(i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                out = m(*args)
                loss = run.loss(out, y)
            if not finite(out):
                r["out_bad"].append(i)
            r["losses"].append(loss.item())
            s0 = sc.get_scale()
            r["scales"].append(s0)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                r["skipped"].append(i)
            if not all(bool(torch.isfinite(p).all()) for p in m.parameters()):
                r["w_bad"].append(i)
        w.close()
    r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if str(x.message).startswith("ampdoctor")]
    r["hits"] = m.hits
    return r


def oracle(run, r):
    """The run was healthy and of the kind it claims (plain assertions: a failure here is a broken run)."""
    ls, sk, sc, n = r["losses"], r["skipped"], r["scales"], run.steps
    assert all(map(math.isfinite, ls)), ls
    assert r["out_bad"] == [] and r["w_bad"] == [], (r["out_bad"], r["w_bad"])
    for s in sk:  # the scaler recovers: an applied update within RECOVER steps
        assert any(j not in sk for j in range(s + 1, min(s + 1 + RECOVER, n))), sk
    late = [s for s in sk if s >= OPENING]
    assert len(late) <= max(4, n // 25), sk                 # rare
    used = [s for s in late if sc[s] <= max((sc[j] for j in range(s) if j not in sk), default=0)]
    if run.spike:
        assert used, (sk, [sc[s] for s in sk])
    else:
        assert late == [], sk
    if run.absorb:
        assert r["hits"] >= n // 2, r["hits"]   # the -inf / saturation was really there (in most forwards)
    else:
        assert r["hits"] == 0
    ok = [l for j, l in enumerate(ls) if j not in sk and not run.batch.hard(j)]   # the ordinary batches
    k = len(ok) // 5
    assert sum(ok[-k:]) < run.fall * sum(ok[:k]), (sum(ok[:k]) / k, sum(ok[-k:]) / k)


def judge(r):
    """ampdoctor's default watch: no warning or error, exit code 0, no ampdoctor warning (else WrongAnswer)."""
    rep = r["rep"]
    bad = alarms(rep.findings)
    if bad or rep.exit_code != 0 or r["warns"]:
        raise WrongAnswer(f"exit {rep.exit_code}; {bad}; warns {r['warns']}; all: {lines(rep)}")


LOG_BLAMED = ("[error] overflow at (root) aten::log step 45: aten::log in `(root)` hit its singular point (an input "
              "is 0 / -1) and produced -inf; the run skipped step 45 at a loss scale (16384) that earlier steps had "
              "stepped with: this overflow, not the scaler's search, is why")
# wrong when written (LOG_BLAMED, exit code 1): mlp_wherelog_spike, mlp_wherelog_halfspike; right since
# (analysis/replayfold.py `_skip_explained_by_forward` leaves out an op at its singular point and one whose module
# absorbed its inf)
XFAIL: dict = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=XFAIL[n]) if n in XFAIL else n for n in RUNS])
def test_healthy_skips_absorbed(name, tmp_path):
    run = RUNS[name]
    t = time.time()
    r = train(run, tmp_path / "run")
    oracle(run, r)
    assert time.time() - t < 20, time.time() - t
    judge(r)


if __name__ == "__main__":  # exploration: python tests/test_healthy_skips_absorbed.py [names...]
    import tempfile
    torch.set_num_threads(1)
    for name in sys.argv[1:] or RUNS:
        run = RUNS[name]
        t = time.time()
        with tempfile.TemporaryDirectory() as d:
            r = train(run, Path(d) / "run")
        sk = r["skipped"]
        ls = [l for j, l in enumerate(r["losses"]) if j not in sk and not run.batch.hard(j)]
        k = len(ls) // 5
        print(f"== {name} {time.time() - t:.1f}s skips={sk} scales@skips={[r['scales'][s] for s in sk]} "
              f"maxscale={max(r['scales'])} hits={r['hits']} out_bad={r['out_bad'][:5]} "
              f"loss {sum(ls[:k]) / k:.4f}->{sum(ls[-k:]) / k:.4f}")
        try:
            oracle(run, r)
            print("  oracle ok")
        except AssertionError as e:
            print("  ORACLE FAIL", str(e)[:300])
        print("  ", lines(r["rep"]), r["warns"])
