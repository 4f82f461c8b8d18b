"""RECOMMENDER AND TABULAR MODELS under fp16: EmbeddingBag pooling, factorization machines, DCN cross layers, raw
numeric features, two-tower retrieval with an in-batch softmax, rating regression, an FT-Transformer - each broken by
an fp16 hazard these models are known for, injected at a known step, on small synthetic click / rating / tabular
data made here from fixed seeds.

Loop: probe_harness.probe_run (AdamW, GradScaler("cpu") at its defaults, CPU fp16 autocast, unscale_ ->
clip_grad_norm_(1.0) -> scaler.step -> scaler.update, ampdoctor.watch(model, optimizer=, scaler=, run_dir=tmp_path)
at the default sampling). Injections: a parameter changed under no_grad before the bad step's forward (the drift a
bad sparse update or an lr spike leaves), a schedule reaching its final value, or the bad step's batch itself (a
whale user, a luxury price, a viral item, a binge session).

Oracle for every failure (a failing oracle is a plain failure, never an xfail): the loss is first non-finite at the
bad step and the scaler skips it; probe_harness.Producer's first forward producer is the expected module at that
step (None for user code outside the model - CONTRACT.md's module null / "(run)" - where every model output is
finite, and None for the data case, where the batch itself already holds inf); the bad step re-run from the weights
it ran with (snap_at) gives a non-finite loss under fp16 autocast, and finite outputs and loss in fp32 (for the data
case: the same pipeline in fp32) - fp16's doing. Report check (`named_top3`): among the first three findings a
warning/error of an accepted rule at the expected module and the bad step, phase forward (or null), and no
overflow/nan_origin error at another named module at that step; else WrongAnswer (strict xfail via `wrong`).

Failures:
 1. bag_sum        EmbeddingBag(mode="sum") CTR model; every batch holds a bot user with 2000 clicks on the hot item
                   3. At step 5 a bad sparse update leaves row 3 at 50: the pooled sum (fp32: EmbeddingBag is not
                   an autocast op) is 1e5, and the first Linear's autocast cast to fp16 makes inf  -> overflow at mlp.0.
 2. fm_square      DeepFM whose field embeddings go through an fp16 projection; the FM term
                   0.5 * ((sum v)^2 - sum v^2) runs in fp16 in `fm`. Step 4: the projection's bias +70 (20 fields
                   of ~70): (sum v)^2 ~ 2e6 and sum v^2 ~ 1e5 are both inf, inf - inf = NaN
                                                                                 -> nan_origin/overflow at fm.
 3. dcn_cross      DCN-v2, 5 cross layers x_{l+1} = x0 * W_l x_l + x_l; step 5 a bad update scales the embedding
                   table x15: each layer multiplies the scale by |x0 W| until a layer's W overflows
                                                                                            -> overflow at that W.
 4. raw_price      tabular MLP on raw (unnormalized) numeric features, price in dollars; at step 4 a luxury listing
                   priced 2e5 arrives: the first Linear's fp16 cast of it is inf             -> overflow at mlp.0.
 5. log1p_fp16     the pipeline takes log1p of view counts in fp16 (counts.half().log1p()); at step 5 a viral
                   item with 2e5 views: the cast is inf before the model sees it            -> the data (module None).
 6. tower_temp     two-tower retrieval, in-batch softmax by hand (exp / sum of exp) over cosine / tau in module
                   `sm`; the temperature schedule reaches tau = 0.01 at step 5: logits up to 100, exp inf,
                   inf / inf = NaN                                          -> overflow/nan_origin at sm.
 7. rating_mse     rating (watch-time) regression, fp16 targets (stored half), MSE by hand in the loop
                   ((pred - y) ** 2).mean(); at step 5 one binge session of 3000 s: 9e6 = inf -> overflow at (run).
 8. ftt_attn       FT-Transformer (no norm before the first block's attention, as in the paper); at step 4 a
                   feature token's embedding is scaled x3000 (tokens ~1e3): the fp16 q @ k^T in `blocks.0.attn`
                   overflows
                                                                                     -> overflow at blocks.0.attn.
Healthy twins (the fixed form, no injection), each run with and without the watch: losses and final weights bitwise
identical, every loss finite, no producer, no skip after the scaler's first steps, no RuntimeWarning, the loss fell,
no warning/error in the report: bag_mean (mode="mean" with the same bot user), fm_fp32 (FM on v.float()),
tab_normalized (standardized features, log1p in fp32), tower_ce (F.cross_entropy on fp32 logits, tau 0.05),
rating_scaled (targets / 100, fp32 MSE), rare_ids (Zipf categorical ids over a 20000-row table: most rows rarely or
never updated), dcn_long (3 cross layers, 160 steps), ftt_long (1-block FT-Transformer, 150 steps). fm_fp32 and
ftt_long (CALIBRATES) keep small gradients for a while, so the scaler's first search comes late (fm_fp32 skips steps 4
and 18, ftt_long 54, 76, 114: one backoff at each new scale, the unwatched run making the same ones): for them at
most 3 skips, identical with and without the watch, instead of none after step 2.

Result when written (torch CPU, 2 runs identical): 16 pass, 0 xfail, the whole file ~11 s. Top findings:
 1 bag_sum    `[error] overflow at mlp.0 aten::_to_copy step 5: aten::_to_copy in `mlp.0` produced +inf from finite
              inputs`; 4 raw_price the same at step 4.
 2 fm_square  `[error] overflow at fm aten::mul step 4: aten::mul in `fm` produced +inf ...; it propagates to
              aten::sub in `fm``.
 3 dcn_cross  `[error] overflow at cross.3.W aten::_to_copy step 5` (propagates to cross.4.W).
 5 log1p_fp16 `[error] overflow at (run) step 5: The batch of step 5 already held 1 +inf (model input argument 0)`.
 6 tower_temp `[error] overflow at sm aten::exp step 5: ... (input up to 75.5; fp16 exp(x) is inf for x > 11.09)`.
 7 rating_mse `[error] overflow at (run) step 5: The loss became inf outside the watched model ... in fp16: a power
              (a square past 255.9)`.
 8 ftt_attn   `[error] overflow at blocks.0.attn aten::bmm step 4: ... finite inputs (max |x| = 1242) gave ±inf`.
 Twins: no warning or error.
No wrong answer found.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import finite, probe_run, producer_top3, twin_checks, wrong
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

AC = dict(device_type="cpu", dtype=torch.float16)


def gen(seed):
    return torch.Generator().manual_seed(8300 + seed)


def rn(*shape, seed):
    return torch.randn(*shape, generator=gen(seed))


def ri(hi, *shape, seed):
    return torch.randint(0, hi, shape, generator=gen(seed))


def bce(out, y):
    return F.binary_cross_entropy_with_logits(out.float(), y)


def own(out, y):
    return out


# ------------------------------------------------------------------------------------------------ EmbeddingBag CTR

N_ITEMS, HOT = 500, 3
QUALITY = rn(N_ITEMS, seed=900)


class BagCTR(nn.Module):
    """A user's click history pooled by an EmbeddingBag, then an MLP -> click logit."""

    def __init__(self, mode="sum", d=16):
        super().__init__()
        self.bag = nn.EmbeddingBag(N_ITEMS, d, mode=mode)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, items, offsets):
        return self.mlp(self.bag(items, offsets)).squeeze(-1)


def b_bag(bad=None):
    """32 users: 31 with 20 random clicks, user 0 a bot with 2000 clicks on the hot item (+ 20 random); the label:
    the mean quality of the history > 0."""
    def b(i):
        bags = [torch.cat([torch.full((2000,), HOT), ri(N_ITEMS, 20, seed=100 + i)])]
        bags += [ri(N_ITEMS, 20, seed=1000 * (i % 6) + u) for u in range(1, 32)]
        offsets = torch.tensor([0] + [len(x) for x in bags[:-1]]).cumsum(0)
        y = torch.stack([(QUALITY[x].mean() > 0).float() for x in bags])
        return (torch.cat(bags), offsets), y
    return b


# ----------------------------------------------------------------------------------------- factorization machines

N_FIELDS, VOCAB = 20, 50


class FMInteraction(nn.Module):
    """The FM second-order term 0.5 * sum_k ((sum_f v)^2 - sum_f v^2), in v's dtype (fp16) or in fp32."""

    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, v):
        if self.fp32:
            v = v.float()
        s = v.sum(1)
        return 0.5 * (s * s - (v * v).sum(1)).sum(-1)


class DeepFM(nn.Module):
    def __init__(self, fp32=False, k=8):
        super().__init__()
        self.emb = nn.Embedding(N_FIELDS * VOCAB, k)
        self.proj = nn.Linear(k, k)                     # a field-embedding projection: runs in fp16
        self.first = nn.Embedding(N_FIELDS * VOCAB, 1)
        self.fm = FMInteraction(fp32)
        self.deep = nn.Sequential(nn.Linear(N_FIELDS * k, 32), nn.ReLU(), nn.Linear(32, 1))
        nn.init.normal_(self.emb.weight, 0.0, 0.1)      # the usual small FM init (libFM / DeepCTR)
        nn.init.zeros_(self.proj.bias)

    def forward(self, ids):
        v = self.proj(self.emb(ids))
        return self.first(ids).sum((1, 2)) + self.fm(v).float() + self.deep(v.flatten(1)).squeeze(-1).float()


FIELD_W = rn(N_FIELDS * VOCAB, seed=901)


def b_fields(n_fields=N_FIELDS, vocab=VOCAB, cycle=6):
    def mk(bad=None):
        def b(i):
            ids = ri(vocab, 64, n_fields, seed=200 + i % cycle) + torch.arange(n_fields) * vocab
            y = (FIELD_W[ids].sum(-1) > 0).float()
            return (ids,), y
        return b
    return mk


# ------------------------------------------------------------------------------------------------------------ DCN

class Cross(nn.Module):
    """DCN-v2 cross layer: x0 * (W x + b) + x."""

    def __init__(self, d):
        super().__init__()
        self.W = nn.Linear(d, d)

    def forward(self, x0, x):
        return x0 * self.W(x) + x


class DCN(nn.Module):
    def __init__(self, n_cross=5, n_fields=8, k=8):
        super().__init__()
        self.emb = nn.Embedding(n_fields * VOCAB, k)
        d = n_fields * k
        self.cross = nn.ModuleList(Cross(d) for _ in range(n_cross))
        self.head = nn.Linear(d, 1)

    def forward(self, ids):
        x0 = self.emb(ids).flatten(1)
        x = x0
        for c in self.cross:
            x = c(x0, x)
        return self.head(x).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------- tabular

class TabMLP(nn.Module):
    def __init__(self, d_in=4):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d_in, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.mlp(x).squeeze(-1)


def raw_table(i, n=64):
    """age (18-70), orders (0-200), price in dollars (10-500), views (exponential, mean 1000): raw, finite fp32."""
    g = gen(300 + i % 6)
    age = 18 + 52 * torch.rand(n, generator=g)
    orders = torch.floor(200 * torch.rand(n, generator=g))
    price = 10 + 490 * torch.rand(n, generator=g)
    views = torch.floor(-1000 * torch.log(torch.rand(n, generator=g)))
    y = ((orders / 200 - price / 500 + (age - 44) / 104) > 0).float()
    return age, orders, price, views, y


def b_raw(bad=None):
    """The raw features straight into the model; at `bad` a luxury listing priced 2e5."""
    def b(i):
        age, orders, price, views, y = raw_table(i)
        if i == bad:
            price[7] = 2.0e5
        return (torch.stack([age, orders, price, views / 100], -1),), y
    return b


def b_log1p(bad=None, pipe=torch.float16):
    """The pipeline: log1p of the counts in `pipe` (fp16 there to halve the batch), the rest standardized; at `bad`
    a viral item with 2e5 views (> 65504: its fp16 cast is inf)."""
    def b(i):
        age, orders, price, views, y = raw_table(i)
        if i == bad:
            views[3] = 2.0e5
        lv = (torch.log1p(views.to(pipe)) - 7.0) / 1.5
        x = torch.stack([(age - 44) / 15, (orders - 100) / 58, (price - 255) / 141, lv.float()], -1)
        return (x,), y
    return b


def b_normalized(bad=None):
    return b_log1p(None, pipe=torch.float32)


# -------------------------------------------------------------------------------------------------- two towers

N_USERS = 400


class Tower(nn.Module):
    def __init__(self, n, d=16):
        super().__init__()
        self.emb = nn.Embedding(n, d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, ids):
        return self.mlp(self.emb(ids))


class InBatchSoftmax(nn.Module):
    """Sampled-softmax retrieval loss by hand: -log(exp(s_ii) / sum_j exp(s_ij)), s = cos / tau."""

    def __init__(self, tau=1.0):
        super().__init__()
        self.tau = tau

    def forward(self, u, v):
        u, v = F.normalize(u, dim=-1), F.normalize(v, dim=-1)
        e = (u @ v.t() / self.tau).exp()
        return -(e.diagonal() / e.sum(-1)).log().mean()


class InBatchCE(nn.Module):
    """The same loss as F.cross_entropy on fp32 logits."""

    def __init__(self, tau=0.05):
        super().__init__()
        self.tau = tau

    def forward(self, u, v):
        u, v = F.normalize(u.float(), dim=-1), F.normalize(v.float(), dim=-1)
        logits = u @ v.t() / self.tau
        return F.cross_entropy(logits, torch.arange(len(u)))


class TwoTower(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.user, self.item = Tower(N_USERS), Tower(N_ITEMS)
        self.sm = loss

    def forward(self, uid, iid):
        return self.sm(self.user(uid), self.item(iid))


def b_pairs(bad=None):
    """64 distinct users and the item each one clicked: item = (7 u + 3) mod N_ITEMS (learnable)."""
    def b(i):
        uid = torch.randperm(N_USERS, generator=gen(400 + i % 8))[:64]
        return (uid, (7 * uid + 3) % N_ITEMS), None
    return b


def tau_schedule(bad):
    """The temperature warm start (1.0) ends at `bad`: from there tau = 0.01."""
    def inj(i, m, _bad):
        m.sm.tau = 1.0 if i < bad else 0.01
    return inj


# --------------------------------------------------------------------------------------------- rating regression

class RatingNet(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.u, self.i = nn.Embedding(N_USERS, d), nn.Embedding(N_ITEMS, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, uid, iid):
        return self.mlp(torch.cat([self.u(uid), self.i(iid)], -1)).squeeze(-1)


AFF = rn(N_USERS, seed=902)


def b_watch(bad=None, scale=1.0, dtype=torch.float16):
    """Watch time in seconds, 20-80 s (fp16 in the data loader); at `bad` one binge session of 3000 s."""
    def b(i):
        uid, iid = ri(N_USERS, 64, seed=500 + i % 6), ri(N_ITEMS, 64, seed=600 + i % 6)
        y = 50 + 30 * torch.tanh(AFF[uid] + QUALITY[iid])
        if i == bad:
            y[5] = 3000.0
        return (uid, iid), (y / scale).to(dtype)
    return b


def mse_fp16(out, y):
    """MSE by hand on the fp16 prediction and the fp16 target."""
    return ((out - y) ** 2).mean()


def mse_fp32(out, y):
    return F.mse_loss(out.float(), y.float())


# --------------------------------------------------------------------------------------------------- FT-Transformer

class NumTokenizer(nn.Module):
    """FT-Transformer's feature tokenizer: token_j = x_j * W_j + b_j."""

    def __init__(self, n, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) / math.sqrt(d))
        self.bias = nn.Parameter(torch.zeros(n, d))

    def forward(self, x):
        return x[..., None] * self.weight + self.bias


class Attn(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.h = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.h)
        return self.out((a.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


class FTBlock(nn.Module):
    def __init__(self, d, first):
        super().__init__()
        self.norm1 = nn.Identity() if first else nn.LayerNorm(d)   # the paper drops the first block's first norm
        self.attn, self.norm2 = Attn(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class FTT(nn.Module):
    def __init__(self, n=4, d=16, depth=2):
        super().__init__()
        self.tok = NumTokenizer(n, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d) / math.sqrt(d))
        self.blocks = nn.ModuleList(FTBlock(d, k == 0) for k in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 1)

    def forward(self, x):
        t = self.tok(x)
        h = torch.cat([self.cls.expand(len(x), -1, -1), t], 1)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h[:, 0])).squeeze(-1)


# ---------------------------------------------------------------------------------------------------- injections

def set_row(path, row, val):
    def inj(i, m, bad):
        if i == bad:
            m.get_parameter(path)[row] = val
    return inj


def bias_add(path, val):
    def inj(i, m, bad):
        if i == bad:
            m.get_parameter(path).add_(val)
    return inj


def scale_param(path, k, row=slice(None)):
    def inj(i, m, bad):
        if i == bad:
            m.get_parameter(path)[row] *= k
    return inj


# ---------------------------------------------------------------------------------------------------------- cases
# name: (factory, batch(bad), loss_fn, inject(i, m, bad) or None, bad step, expected module (None: user code
# outside the model, "(run)"; DATA: the batch itself held inf, module None), accepted rules)
DATA = "<data>"
CASES = {
    "bag_sum": (lambda: BagCTR("sum"), b_bag, bce, set_row("bag.weight", HOT, 50.0), 5, "mlp.0", ("overflow",)),
    "fm_square": (lambda: DeepFM(), b_fields(), bce, bias_add("proj.bias", 70.0), 4, "fm",
                  ("nan_origin", "overflow")),
    "dcn_cross": (lambda: DCN(), b_fields(8), bce, scale_param("emb.weight", 15.0), 5, "cross.3.W", ("overflow",)),
    "raw_price": (lambda: TabMLP(), b_raw, bce, None, 4, "mlp.0", ("overflow",)),
    "log1p_fp16": (lambda: TabMLP(), b_log1p, bce, None, 5, DATA, ("overflow", "nan_origin")),
    "tower_temp": (lambda: TwoTower(InBatchSoftmax()), b_pairs, own, tau_schedule(5), 5, "sm",
                   ("overflow", "nan_origin")),
    "rating_mse": (lambda: RatingNet(), b_watch, mse_fp16, None, 5, None, ("overflow",)),
    "ftt_attn": (lambda: FTT(), b_normalized, bce, scale_param("tok.weight", 3000.0, 2), 4, "blocks.0.attn",
                 ("overflow",)),
}

XFAIL = {}


def build(factory, seed=0):
    torch.manual_seed(seed)
    return factory()


def run_case(name, tmp_path):
    factory, mk, loss_fn, inj, bad, _, _ = CASES[name]
    m = build(factory)
    inject = None if inj is None else (lambda i, mm: inj(i, mm, bad))
    return probe_run(m, mk(bad), loss_fn, bad + 2, str(tmp_path / "run"), inject=inject, snap_at=bad)


def replay_bad(name, r):
    """The bad step's forward from the weights it ran with, under fp16 autocast and in fp32 (the data case: its
    pipeline in fp32 too): (batch finite, model output fp16, loss fp16, model output fp32, loss fp32)."""
    factory, mk, loss_fn, inj, bad, where, _ = CASES[name]
    m = build(factory)
    m.load_state_dict(r["sd"])
    if inj is not None:
        with torch.no_grad():
            inj(bad, m, bad)                # non-parameter state a schedule sets (tau); parameters: already in sd
        m.load_state_dict(r["sd"])
    args, y = mk(bad)(bad)
    args32, y32 = (b_log1p(bad, pipe=torch.float32)(bad) if where == DATA else (args, y))
    y32 = y32.float() if torch.is_tensor(y32) else y32
    with torch.no_grad():
        with torch.autocast(**AC):
            o16 = m(*args)
        l16 = loss_fn(o16, y)
        o32 = m(*args32)
        l32 = loss_fn(o32, y32)
    return finite(args), o16, l16, o32, l32


def check_report(rep, name):
    *_, bad, where, rules = CASES[name]
    where = None if where == DATA else where
    return producer_top3(rep, rules, where, bad)


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_recsys_fails(name, tmp_path):
    *_, bad, where, _ = CASES[name]
    r = run_case(name, tmp_path)
    # oracle: the loss is first non-finite at the injected step, which the scaler skips
    assert r["bad_loss"] and r["bad_loss"][0] == bad, r["losses"]
    assert bad in r["skipped"], r["skipped"]
    # the producer: the module that makes the first inf/NaN from finite inputs (none: user code or the data)
    assert r["first"] == (None if where in (None, DATA) else (where, bad)), r["first"]
    ok_batch, o16, l16, o32, l32 = replay_bad(name, r)
    assert ok_batch == (where != DATA), name        # the data case: the batch itself already held inf
    assert not torch.isfinite(l16), l16             # the replay fails as the run did
    assert finite(o16) == (where is None), name     # user code: the model's outputs were finite
    assert finite(o32) and torch.isfinite(l32), l32  # fp16's doing: the same step in fp32 is finite
    f = check_report(r["rep"], name)
    print(name, "->", f.one_line(), "|", f.fix)


# ---------------------------------------------------------------------------------------------------------- twins
# name: (factory, batch, loss_fn, steps, lr)

def b_zipf(bad=None):
    """Categorical ids over a 20000-row table, Zipf-like (id = floor(20000 * u^4)): most rows rare or never seen."""
    def b(i):
        g = gen(700 + i)
        ids = torch.floor(20000 * torch.rand(64, 4, generator=g) ** 4).long().clamp_max(19999)
        y = (ids[:, 0] < 300).float()              # set by the first field's frequent ids
        return (ids,), y
    return b


class RareIds(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(20000, d)
        self.mlp = nn.Sequential(nn.Linear(4 * d, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids):
        return self.mlp(self.emb(ids).flatten(1)).squeeze(-1)


TWINS = {
    "bag_mean": (lambda: BagCTR("mean"), b_bag, bce, 40, 3e-3),
    "fm_fp32": (lambda: DeepFM(fp32=True), b_fields(), bce, 40, 3e-3),
    "tab_normalized": (lambda: TabMLP(), b_normalized, bce, 40, 3e-3),
    "tower_ce": (lambda: TwoTower(InBatchCE(0.05)), b_pairs, own, 40, 3e-3),
    "rating_scaled": (lambda: RatingNet(), lambda bad: b_watch(None, 100.0, torch.float32), mse_fp32, 40, 3e-3),
    "rare_ids": (lambda: RareIds(), b_zipf, bce, 60, 3e-3),
    "dcn_long": (lambda: DCN(n_cross=3), b_fields(8), bce, 160, 1e-3),
    "ftt_long": (lambda: FTT(depth=1), b_normalized, bce, 150, 1e-3),
}


# Twins whose gradients stay small for dozens of steps: the scaler's first search (65536 -> 32768 -> ...) comes
# late, one backoff at each new scale, and the unwatched run makes the same ones.
CALIBRATES = {"ftt_long", "fm_fp32"}


@pytest.mark.parametrize("name", list(TWINS))
def test_recsys_twin(name, tmp_path):
    factory, mk, loss_fn, steps, lr = TWINS[name]
    runs = []
    for watch in (True, False):
        m = build(factory)
        runs.append(probe_run(m, mk(None), loss_fn, steps, str(tmp_path / f"w{watch}"), lr=lr, watch=watch))
    r, plain = runs
    twin_checks(r, plain, steps, calibrates=name in CALIBRATES)
