"""Healthy runs that must raise no warning and no error (shared/CONTRACT.md), beyond tests/test_healthy*.py: a
dilated Conv1d TCN on synthetic audio; graph message passing through `index_add_`, `scatter_add_` and
`scatter_reduce` (amax/mean); `nn.Embedding(padding_idx=0)` on variable-length padded batches; a mixture of losses
(cross-entropy + 0.01 * MSE on unnormalised targets); ReZero (alpha=0) and LayerScale (1e-5, 1e-6) gates; a model
that fits to a loss of ~1e-4..1e-6 and trains on; `torch.clamp` on the output; batch size 1. fp16 autocast on the
CPU with a real GradScaler("cpu"), at the default sampling and at every=1, judged through w.report(); each run is
asserted healthy (finite, loss falling, few backoffs)."""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, assert_healthy, gen, one_thread  # noqa: E402


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def run(model, batch, loss_fn, *, steps=40, every=None, lr=1e-3, clip=1.0, sgd=False, max_backoffs=3,
        must_fall=0.9, window=8):
    """Batch-size-1 losses are noisy: their check compares the first and last thirds (`window=3`).
    zero_grad -> fp16 autocast forward -> scale(loss).backward -> unscale_ -> clip -> step -> update under a
    watch; asserts the run was healthy and returns its report."""
    torch.manual_seed(0)
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if sgd
           else torch.optim.AdamW(model.parameters(), lr=lr))
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, **({} if every is None else {"every": every}))
    losses, scales = [], []
    for i in range(steps):
        opt.zero_grad()
        args = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, *args)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    assert_healthy(losses, scales, steps, window, must_fall, max_backoffs)
    return w.report()


def quiet(rep):
    assert alarms(rep.findings) == [], [f.one_line() for f in rep.findings]


EVERY = pytest.mark.parametrize("every", [None, 1])


class TCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Conv1d(1, 16, 5, padding=2)
        self.blocks = nn.ModuleList([nn.Conv1d(16, 16, 3, padding=d, dilation=d) for d in (1, 2, 4, 8)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(16) for _ in range(4)])
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = F.relu(self.inp(x))
        for c, n in zip(self.blocks, self.norms):
            h = h + F.relu(n(c(h)))
        return self.head(h.mean(-1))


def tones(i):
    g = gen(i)
    y = torch.randint(0, 5, (16,), generator=g)
    t = torch.arange(128).float() / 128
    return torch.sin(2 * math.pi * (y[:, None] + 1) * 3 * t)[:, None] + 0.3 * torch.randn(16, 1, 128, generator=g), y


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


@EVERY
def test_dilated_conv1d_tcn_on_tones(every):
    quiet(run(TCN(), tones, ce, steps=25, every=every, lr=3e-3))


class GNN(nn.Module):
    """Two rounds of message passing: sum by index_add_, then by scatter_add_, both divided by the degree; then
    amax and mean by scatter_reduce."""
    def __init__(self):
        super().__init__()
        self.emb, self.l1, self.l2, self.l3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.out = nn.Linear(32, 3)

    def forward(self, x, src, dst):
        h = F.relu(self.emb(x))
        deg = torch.bincount(dst, minlength=h.shape[0]).clamp(min=1)[:, None]
        for layer, mode in ((self.l1, "index"), (self.l2, "scatter")):
            msg = layer(h)[src]
            agg = torch.zeros(h.shape[0], msg.shape[1], dtype=msg.dtype)
            agg = (agg.index_add_(0, dst, msg) if mode == "index"
                   else agg.scatter_add_(0, dst[:, None].expand_as(msg), msg))
            h = F.relu(h + agg / deg.to(agg.dtype))
        msg = self.l3(h)[src]
        idx = dst[:, None].expand_as(msg)
        mx = torch.full((h.shape[0], 32), -1e4, dtype=msg.dtype).scatter_reduce(0, idx, msg, "amax",
                                                                                 include_self=False)
        mean = torch.zeros((h.shape[0], 32), dtype=msg.dtype).scatter_reduce(0, idx, msg, "mean",
                                                                              include_self=False)
        return self.out(h + F.relu(mx) + mean)


def graph():
    g, n = gen(99), 60
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, torch.randint(0, n, (300,), generator=g), torch.randint(0, n, (300,), generator=g), y


@EVERY
def test_graph_message_passing_index_add_scatter_add_scatter_reduce(every):
    x, src, dst, y = graph()
    quiet(run(GNN(), lambda i: (x, src, dst, y), lambda m, x, s, d, y: F.cross_entropy(m(x, s, d), y),
              every=every, lr=3e-3))


class PadBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32, padding_idx=0)
        self.mix, self.head = nn.Linear(32, 32), nn.Linear(32, 2)

    def forward(self, ids):
        m = (ids != 0).unsqueeze(-1)
        h = torch.tanh(self.mix(self.emb(ids)))
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


def padded(i, bs=16):
    g = gen(i)
    lens = torch.randint(1, 12 + (i % 3) * 10, (bs,), generator=g)
    ids = torch.randint(1, 50, (bs, int(lens.max())), generator=g)
    ids[torch.arange(ids.shape[1])[None] >= lens[:, None]] = 0
    return ids, ((ids == 7) | (ids == 8)).any(1).long()


@EVERY
def test_embedding_padding_idx_variable_length_batches(every):
    quiet(run(PadBag(), padded, ce, every=every, lr=3e-3))


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.cls, self.reg = nn.Linear(64, 4), nn.Linear(64, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


@EVERY
def test_mixture_of_losses_weights_1_and_0_01_unnormalised_regression(every):
    w4 = torch.randn(20, 4, generator=gen(5))

    def batch(i):
        x = torch.randn(32, 20, generator=gen(i))
        return x, (x @ w4).argmax(1), x[:, :3].sum(1, keepdim=True) * 100

    def loss(m, x, y, r):
        c, p = m(x)
        return 1.0 * F.cross_entropy(c, y) + 0.01 * F.mse_loss(p.float(), r)
    quiet(run(TwoHeads(), batch, loss, every=every, lr=3e-3))


class Gated(nn.Module):
    """Residual branches scaled by a learnable gate: ReZero (a scalar at 0) or LayerScale (a vector at init)."""
    def __init__(self, init=0.0, n=4):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 64), nn.Linear(64, 1)
        self.f = nn.ModuleList([nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(n)])
        self.alpha = nn.ParameterList([nn.Parameter(torch.full((64,) if init else (), float(init)))
                                       for _ in range(n)])

    def forward(self, x):
        h = self.inp(x)
        for f, a in zip(self.f, self.alpha):
            h = h + a * f(h)
        return self.out(h)


def mse(m, x, y):
    return F.mse_loss(m(x).float(), y)


@EVERY
@pytest.mark.parametrize("init,sgd,lr", [(0.0, False, 1e-3), (0.0, True, 1e-2), (1e-5, False, 1e-3),
                                         (1e-6, True, 1e-2)])
def test_rezero_and_layerscale_gates(init, sgd, lr, every):
    wr = torch.randn(16, 1, generator=gen(3))

    def batch(i):
        x = torch.randn(64, 16, generator=gen(i))
        return x, torch.sin(x @ wr)
    quiet(run(Gated(init), batch, mse, steps=50, every=every, lr=lr, sgd=sgd))


@EVERY
def test_a_model_that_fits_to_a_tiny_loss_and_trains_on(every):
    """Two fixed batches, cross-entropy down to ~1e-6, and an fp16 mean-square regression to ~4e-3."""
    def batch(i):
        x = torch.randn(16, 8, generator=gen(i % 2)) * 3
        return x, (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    rep = run(model, batch, lambda m, x, y: F.cross_entropy(m(x), y), steps=200, every=every, lr=1e-2,
              must_fall=1e-3)
    quiet(rep)
    wt = torch.randn(8, 1, generator=gen(4)) * 0.3

    def reg(i):
        x = torch.randn(32, 8, generator=gen(i % 4))
        return x, x @ wt
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    quiet(run(model, reg, lambda m, x, y: ((m(x) - y) ** 2).mean(), steps=150, every=every, lr=1e-2,
              must_fall=0.01))


@EVERY
@pytest.mark.parametrize("gain", [1.0, 10.0])
def test_clamped_output(gain, every):
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    def batch(i):
        x = torch.randn(32, 8, generator=gen(i))
        return x * gain, torch.sigmoid(3 * x[:, :1]).clamp(0.05, 0.95) * 1.2 - 0.1
    quiet(run(model, batch, lambda m, x, y: F.mse_loss(torch.clamp(m(x), 0.0, 1.0).float(), y), steps=60,
              every=every, lr=3e-3 if gain == 1 else 1e-2))


class ConvGN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.gn, self.c2 = nn.Conv1d(2, 16, 7, padding=3), nn.GroupNorm(4, 16), nn.Conv1d(16, 16, 3, padding=1)
        self.h = nn.Linear(16, 3)

    def forward(self, x):
        return self.h(F.relu(self.c2(F.relu(self.gn(self.c(x))))).mean(-1))


@EVERY
def test_batch_size_1(every):
    def vec(i):
        x = torch.randn(1, 10, generator=gen(i))
        return x, x[:, :3].argmax(1)
    model = nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 3))
    quiet(run(model, vec, ce, steps=60, every=every, lr=1e-3, must_fall=1.0, window=3))

    def sig(i):
        g = gen(i)
        y = torch.randint(0, 3, (1,), generator=g)
        return torch.randn(1, 2, 128, generator=g) + y.float(), y
    quiet(run(ConvGN(), sig, ce, steps=60, every=every, lr=1e-3, clip=0, must_fall=1.0, window=3))
    quiet(run(PadBag(), lambda i: padded(i, bs=1), ce, steps=60, every=every, lr=3e-3, must_fall=1.0, window=3))
