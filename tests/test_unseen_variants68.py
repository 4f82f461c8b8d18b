"""Sixty-eighth set: FP16 FAILURES WHERE NAMING THE PRODUCER IS HARD BECAUSE OF MODULE STRUCTURE, on UNSAMPLED
steps (the default watch takes full statistics on step 0 and every 200th; every failure here starts between steps 14
and 21). Five fp16 failures and five healthy twins (the same model, the fix applied). Tiny models, fixed seeds, one
intra-op thread. Watched through the public API only (probe_harness.variant_run -> probe_run: `ampdoctor.watch(model,
optimizer=AdamW, scaler=GradScaler("cpu"), run_dir=tmp_path / "run")` at the default settings; CPU fp16 autocast,
scale(loss).backward -> unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`); every model computes
its own loss. Earlier probes already build: one instance in two towers, a tied `lm_head` Linear, F.linear on the
embedding in the root, a ModuleDict of task heads (test_shared_modules_unseen); an ALBERT block with a SqReLU child,
a Universal Transformer's looped attention, siamese / shared q-k projections (test_unseen_variants63); a block called
three times (test_unseen_arch 14, test_unseen_variants25 4); top-k MoE experts in a ModuleList (variants14/18/27/38);
counters that cycle heads (variants37 5, variants39 7/9). None of the five below.

Names accepted. CONTRACT.md: `module` is "the qualified name from `model.named_modules()`"; named_modules() drops
duplicates, so a module registered under several names has exactly ONE name there: the first on its depth-first walk
(registration order). That is the only name accepted (an alias such as `layers.3` is not a name named_modules()
gives), and it is the name the oracle gives too (probe_harness.Producer hooks named_modules()). ampdoctor's own
watch.py maps id(module) to the first of named_modules(remove_duplicate=False), the same name. So the stock
variant_named_at_producer / variant_twin_quiet apply unchanged, `call` counting the shared module's calls in the step.

Each failure is proven first by its own oracle: probe_harness.Producer with call counting (the first (module, step,
call) whose output is non-finite while its inputs, keyword inputs and own parameters were finite), the loss first
non-finite at that step, the scaler skipping it (before it only the opening backoffs, steps 0-2), the same run
UNWATCHED giving bitwise the same losses (NaN = NaN), and the bad step's weights running the bad batch in float32
(no autocast; fp16-stored data read as float32) to a finite loss. A failing oracle is a plain failure. Only then
must overflow / nan_origin be among the report's first three findings at the PRODUCER (an error, at the oracle's
step), with no overflow/nan_origin error at that step naming a module that only passed the value on; a wrong report
is a strict xfail (`wrong`).

 1. cycle_rev: Takase & Kiyono (2021) "cycle (rev)" cross-layer sharing, two unique residual blocks (fc1 -> SqReLU
    `act` -> fc2, no norm) for four layers: `self.layers = ModuleList(blocks + blocks[::-1])`, so named_modules has
    `layers.0`, `layers.1` only (`layers.2` IS layers.1, `layers.3` IS layers.0). At step 18 one feature column
    arrives un-standardised (x20): the residual stream grows layer by layer and the 4th layer's squared ReLU passes
    65504 -> `layers.0.act`, call 2 (not `layers.3.act`, not `layers.1.act`). Fix: pre-LayerNorm in the block and
    features clipped to +-5 sd (twin).
 2. albert_inline: an ALBERT-style encoder, ONE block applied three times, its MLP written as modded-nanogpt writes
    it, `x + c_proj(F.relu(c_fc(x)).square())`: the square is the block's own op right after its child c_fc. A column
    x30 at step 14 -> the 3rd application's square overflows -> `layer` (the parent, call 3; not `layer.c_fc`, not
    `layer.c_proj` that is fed the inf). Fix: pre-LayerNorm and clipped features (twin).
 3. tied_rec: a bag-of-items recommender whose item table is ALSO the output projection through one module, HF's
    TFSharedEmbeddings pattern (`emb(ids)` looks up, `emb(h, mode="linear")` is F.linear(h, emb.weight)): `emb` is
    called twice a forward. Prices are stored log1p(dollars); at step 21 a luxury session's shard holds raw cents
    (5e3-4e4, finite in fp16): the pooled state reaches ~2.6e4 and the logits mm passes 65504 -> `emb`, call 2 (the
    projection, not the lookup; not `mlp.2`). Fix: log1p of the prices in the model (twin).
 4. demix: DEMix-style domain experts (Gururangan et al. 2021) in an nn.ModuleDict keyed by domain ("news", "legal",
    "code", "bio"), each row routed by its domain tag and an expert with no rows not called at all; the code shard
    comes every 4th batch (steps 1, 5, 9, ...: never the sampled step 0). Experts are SwiGLU w2(silu(w1 x) * w3 x).
    At step 21 one code row holds a raw feature (4000): only `experts.code` receives it; w1 x and w3 x stay finite,
    their product overflows -> `experts.code` (the expert's own mul, not `experts.code.w1/w3/w2`, no other expert).
    Fix: features clipped to +-5 sd (twin).
 5. aux_every4: an auxiliary depth head run only every 4th step (the loop passes with_aux = step % 4 == 3: steps 3,
    7, 11, ...; never the sampled step 0), its squared error in fp16 against depth targets cached in fp16; at step 19
    one frame's depth was exported in millimetres (x1000): (pred - depth)^2 overflows -> `aux` (not `aux.proj`,
    not `body.*`). Fix: smooth L1 in float32 (twin).

Result when written (torch 2.13 CPU, default watch): 10 pass, 0 xfail (stable over two runs, ~15 s).
ampdoctor's first finding in each failing run (each then `[error] skipped_steps at (run)` at the same step):
 1. `[error] overflow at layers.0.act aten::mul step 18: aten::mul in `layers.0.act` produced +inf from finite
    inputs; it propagates to aten::addmm in `layers.0.fc2``
 2. `[error] overflow at layer aten::pow step 14: aten::pow in `layer` overflowed float16 (input up to 1368; ...); it
    propagates to aten::addmm in `layer.c_proj``
 3. `[error] overflow at emb aten::mm step 21: aten::mm in `emb` overflowed float16: finite inputs (max |x| =
    2.586e+04) gave +-inf (max 65504); it propagates to aten::_log_softmax in `(root)``
 4. `[error] overflow at experts.code aten::mul step 21: aten::mul in `experts.code` produced +-inf from finite
    inputs; it propagates to aten::mm in `experts.code.w2``
 5. `[error] overflow at aux aten::pow step 19: aten::pow in `aux` overflowed float16 (input up to 1443; ...)`
The twins' reports hold no warning and no error (tied_rec: info only, the opening backoffs at steps 0-1).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants68.py
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import variant_named_at_producer, variant_twin_quiet
from scenarios import gen, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


class SqReLU(nn.Module):
    """Primer's squared ReLU as a module."""

    def forward(self, x):
        r = torch.relu(x)
        return r * r


# ======================================================================================================================
# 1. cycle-rev cross-layer sharing: ModuleList [b0, b1, b1, b0], the 4th layer is `layers.0`
# ======================================================================================================================
class CRBlock(nn.Module):
    def __init__(self, d, fix=False):
        super().__init__()
        self.norm = nn.LayerNorm(d) if fix else nn.Identity()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), SqReLU(), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class CycleRev(nn.Module):
    """Takase & Kiyono (2021) "cycle (rev)" parameter sharing: 2 unique blocks for 4 layers, the list holding the
    same instances twice (named_modules: `layers.0`, `layers.1`; `layers.2` is `layers.1`, `layers.3` is
    `layers.0`)."""

    def __init__(self, fix=False, nf=16, d=32, nc=4, unique=2):
        super().__init__()
        blocks = [CRBlock(d, fix) for _ in range(unique)]
        self.inp, self.head, self.fix = nn.Linear(nf, d), nn.Linear(d, nc), fix
        self.layers = nn.ModuleList(blocks + blocks[::-1])

    def forward(self, x, y):
        h = self.inp(x.clamp(-5, 5) if self.fix else x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).float(), y)


CR_W = torch.randn(16, 4, generator=gen(6801))
CR_BAD, CR_RAW = 18, 20.0


def cr_batch(i):
    x = torch.randn(64, 16, generator=gen(6810 + i % 6))
    y = (x @ CR_W).argmax(-1)
    if i == CR_BAD:
        x = x.clone()
        x[:, 5] *= CR_RAW
    return (x, y), None


# ======================================================================================================================
# 2. ALBERT-style shared block with the squared ReLU written inline (modded-nanogpt's MLP)
# ======================================================================================================================
class InlineMLPBlock(nn.Module):
    """x + c_proj(relu(c_fc(x)).square()): the square is the block's own op, right after its child c_fc."""

    def __init__(self, d, fix=False):
        super().__init__()
        self.norm = nn.LayerNorm(d) if fix else nn.Identity()
        self.c_fc, self.c_proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.c_proj(F.relu(self.c_fc(self.norm(x))).square())


class AlbertInline(nn.Module):
    def __init__(self, fix=False, nf=16, d=32, nc=4, reps=3):
        super().__init__()
        self.emb, self.layer, self.cls = nn.Linear(nf, d), InlineMLPBlock(d, fix), nn.Linear(d, nc)
        self.reps, self.fix = reps, fix

    def forward(self, x, y):
        h = self.emb(x.clamp(-5, 5) if self.fix else x)
        for _ in range(self.reps):
            h = self.layer(h)
        return F.cross_entropy(self.cls(h).float(), y)


AI_W = torch.randn(16, 4, generator=gen(6821))
AI_BAD, AI_RAW = 14, 30.0


def ai_batch(i):
    x = torch.randn(64, 16, generator=gen(6830 + i % 6))
    y = (x @ AI_W).argmax(-1)
    if i == AI_BAD:
        x = x.clone()
        x[:, 2] *= AI_RAW
    return (x, y), None


# ======================================================================================================================
# 3. SASRec-style recommender, the item table tied as the output projection through one SharedEmbedding module
# ======================================================================================================================
class SharedEmbedding(nn.Embedding):
    """HF's TFSharedEmbeddings pattern: mode="embedding" looks ids up, mode="linear" projects hidden states onto the
    same table (the logits). One module, called twice a forward."""

    def forward(self, x, mode="embedding"):
        if mode == "linear":
            return F.linear(x, self.weight)
        return super().forward(x)


class TiedRec(nn.Module):
    def __init__(self, fix=False, items=200, d=32):
        super().__init__()
        self.emb = SharedEmbedding(items, d)
        self.price = nn.Linear(1, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.fix = fix

    def forward(self, ids, price, y):
        p = torch.log1p(price) if self.fix else price        # the fix: log prices, as the training shards store them
        h = (self.emb(ids) + self.price(p[..., None])).mean(1)
        h = h + self.mlp(h)
        return F.cross_entropy(self.emb(h, mode="linear").float(), y)


TR_BAD, TR_CENTS = 21, 100.0


def tr_batch(i):
    g = gen(6840 + i % 6)
    ids = torch.randint(0, 200, (32, 10), generator=g)
    price = torch.rand(32, 10, generator=g) * 4.0               # log1p(price in dollars), ~0-4
    y = (ids[:, -1] * 7 + 3) % 200
    if i == TR_BAD:
        price = price.clone()
        price[4] = (50 + 350 * torch.rand(10, generator=g)) * TR_CENTS   # a luxury session, raw prices in cents
    return (ids, price, y), None


# ======================================================================================================================
# 4. DEMix-style domain experts in a ModuleDict, rows routed by their domain tag
# ======================================================================================================================
DOMAINS = ("news", "legal", "code", "bio")


class SwiGLU(nn.Module):
    """An expert FFN: w2(silu(w1 x) * w3 x); the gate product is the expert's own op."""

    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DEMix(nn.Module):
    def __init__(self, fix=False, nf=12, d=32, nc=3):
        super().__init__()
        self.inp, self.cls, self.fix = nn.Linear(nf, d), nn.Linear(d, nc), fix
        self.experts = nn.ModuleDict({k: SwiGLU(d, 2 * d) for k in DOMAINS})

    def forward(self, x, dom, y):
        h = self.inp(x.clamp(-5, 5) if self.fix else x)
        out = torch.zeros_like(h)
        for k, name in enumerate(DOMAINS):
            sel = dom == k
            if sel.any():                                       # an expert with no rows is not called
                out[sel] = self.experts[name](h[sel]).to(out.dtype)
        return F.cross_entropy(self.cls(h + out).float(), y)


DM_W = torch.randn(12, 3, generator=gen(6851))
DM_BAD, DM_RAW = 21, 4000.0


def dm_batch(i):
    g = gen(6860 + i % 6)
    x = torch.randn(48, 12, generator=g)
    dom = torch.randint(0, 2, (48,), generator=g) + torch.randint(0, 2, (48,), generator=g) * 3   # news / bio
    if i % 4 == 1:                                               # the code shard: every 4th batch, never step 0
        dom[:8] = 2
    y = (x @ DM_W).argmax(-1)
    if i == DM_BAD:
        x = x.clone()
        x[3, 7] = DM_RAW                                         # a code row (dom 2) with one raw feature
    return (x, dom, y), None


# ======================================================================================================================
# 5. an auxiliary depth head run every 4th step (steps 3, 7, 11, ...), never on the sampled step 0
# ======================================================================================================================
class DepthAux(nn.Module):
    """Auxiliary depth regression on targets cached in fp16; the squared error in the activations' dtype."""

    def __init__(self, d, fix=False):
        super().__init__()
        self.proj, self.fix = nn.Linear(d, 1), fix

    def forward(self, h, depth):
        pred = self.proj(h)[:, 0]
        if self.fix:
            return F.smooth_l1_loss(pred.float(), depth.float())
        return (pred - depth).pow(2).mean()


class AuxNet(nn.Module):
    def __init__(self, fix=False, nf=12, d=32, nc=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(nf, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.cls, self.aux = nn.Linear(d, nc), DepthAux(d, fix)

    def forward(self, x, y, depth, with_aux):
        h = self.body(x)
        loss = F.cross_entropy(self.cls(h).float(), y)
        if with_aux:
            loss = loss + 0.1 * self.aux(h, depth).float()
        return loss


AX_W = torch.randn(12, 3, generator=gen(6871))
AX_BAD, AX_MM = 19, 1000.0


def ax_batch(i):
    g = gen(6880 + i % 6)
    x = torch.randn(32, 12, generator=g)
    y = (x @ AX_W).argmax(-1)
    depth = 1.0 + 3.0 * torch.rand(32, generator=g)             # metres
    if i == AX_BAD:
        depth[6] *= AX_MM                                        # one frame's depth exported in millimetres
    return (x, y, depth.half(), i % 4 == 3), None


CASES = {
    "cycle_rev": dict(make=CycleRev, batch=cr_batch, bad=CR_BAD, name="layers.0.act", call=2),
    "albert_inline": dict(make=AlbertInline, batch=ai_batch, bad=AI_BAD, name="layer", call=3),
    "tied_rec": dict(make=TiedRec, batch=tr_batch, bad=TR_BAD, name="emb", call=2),
    "demix": dict(make=DEMix, batch=dm_batch, bad=DM_BAD, name="experts.code", call=1),
    "aux_every4": dict(make=AuxNet, batch=ax_batch, bad=AX_BAD, name="aux", call=1, lr=1e-2),
}


@pytest.mark.parametrize("key", list(CASES))
def test_failure_named_at_the_producer(tmp_path, key):
    variant_named_at_producer(CASES[key], tmp_path, debug=DEBUG)


@pytest.mark.parametrize("key", list(CASES))
def test_twin_with_the_fix_stays_quiet(tmp_path, key):
    variant_twin_quiet(CASES[key], tmp_path, debug=DEBUG)
