"""Does the fix that `ampdoctor replay` suggests really hold? Eight real fp16 failures (CPU fp16 autocast,
torch.amp.GradScaler("cpu", init_scale=1024), AdamW, unscale_ + clip, under ampdoctor.watch(run_dir=...)); batch 3
of 5 is the bad one, the watch writes captures/3, and `ampdoctor.replay(capture, model=fresh)` is read as JSON
(report.to_dict(): findings[0] module/step/rule/fix, and the replay panel's `fix` = {modules, snippet, found,
finite_at_scale}, README "replay"). Each failure is proven by an independent oracle (probe_harness.Producer: the
first module whose output is non-finite from finite inputs, with its step and call) and by our own unwatched rerun
of the step (fresh model, the step's weights and RNG state, its loss scale) being non-finite:
 1. attn         post-LN transformer block, hand-written attention without 1/sqrt(d), un-normalised features: `blk.attn`
 2. convbn       conv net fine-tuned with frozen BatchNorm (bn*.eval(), pretrained running_var 0.01), a raw depth
                 map in mm: `bn2`
 3. gru          proj -> nn.GRU (fp32 under CPU autocast) -> head, a 1e5 sensor glitch: `proj` (input cast)
 4. tied         LM whose head shares the embedding weight, a rare token's grown row: `head`
 5. dict_kwargs  forward(batch: dict, *, labels=...), a price in cents among numeric columns: `num`
 6. dropout      residual FFN with Dropout(0.5), grown output weights, outlier batch: `ff.down` (RNG replayed)
 7. twice        one Refine block applied twice per forward: `refine.fc2` on its 2nd call
 8. custom_fn    log-cosh loss as a custom autograd.Function inside the model, outlier target: `crit` (cosh); the loss
                 is inf but the Function's backward is finite, so the scaler does not even skip the step
Per case: the replay's top finding names the oracle's module and step (error); its rule is `overflow`/`nan_origin`;
the fix holds: the listed modules kept in fp32 by our own patch (autocast off, floating inputs incl. nested dicts cast
to fp32) on a fresh model with the step's weights and RNG, and the fix's snippet exec'd as a user pastes it, make
the loss and every gradient finite at the step's loss scale (or, where `finite_at_scale` is given, the forward
finite at the step's scale and all finite at that scale); the fix is minimal: no listed module can go, it covers
no more modules than the oracle's producer alone when that suffices (README's rule: forward finite, backward finite
at the step's scale or after GradScaler backoffs), and it is the root only when no pair of modules suffices.

Result when written: 30 pass, 2 strict xfail (WrongAnswer) — ampdoctor is wrong on:
 - gru (rule; wrong when written, fixed since: optrace.OpEvent.lone_extreme): top finding `mask_value_overflow` at
   `proj` (aten::_to_copy) for a data value 1e5 cast to fp16; the truth is `overflow` at `proj` (module and step
   right; the fix ['proj'] holds and is minimal).
 - dict_kwargs (minimal): fix [''] (whole model, 5 modules) where ['num', 'head'] suffice by README's rule (finite
   at scale 1 after backoffs); the greedy search, with `num` in fp32 and only the backward overflowing, steps out to
   the root. (The root fix does hold.) Fixed since: a trial whose backward no loss scale makes finite tries the
   backward's producer at scale 1 next (replay/searches._fix): ['num', 'head'], finite at scale 1.
Seen, not wrong: convbn's fix ['bn2'] holds only at finite_at_scale 1.0 (10 backoffs from 1024); dropout's fix
['ff.down', 'head'] at finite_at_scale 1.0 (ff.down in fp32 pushes the residual past 65504 into head's cast).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import ampdoctor
from probe_harness import Producer, WrongAnswer, wrong
from scenarios import one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

BAD = 3          # the bad step of every run (steps 0-2 and 4 are ordinary batches)
STEPS = 5
SCALE = 1024.0   # GradScaler("cpu", init_scale=SCALE); growth_interval 2000: the scale stays put until the skip


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ======================================================================================================================
# the models (each forward returns the scalar loss; a batch carries its target as an argument)
# ======================================================================================================================
class SelfAttn(nn.Module):
    """Multi-head self-attention written by hand: the scores q @ kᵀ are not scaled by 1/sqrt(d)."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.h, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2), -1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """A post-LN transformer block: x = ln1(x + attn(x)); x = ln2(x + ff(x))."""

    def __init__(self, d=32):
        super().__init__()
        self.attn, self.ln1, self.ln2 = SelfAttn(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ff(x))


class TinyTransformer(nn.Module):
    """1. attn: a sequence regressor; a batch of un-normalised features makes q @ kᵀ overflow in `blk.attn`."""

    def __init__(self, d=32):
        super().__init__()
        self.emb, self.blk, self.head = nn.Linear(8, d), Block(d), nn.Linear(d, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.blk(self.emb(x))).squeeze(-1).float(), y)


def attn_batch(i):
    g = gen(i)
    x = torch.randn(4, 12, 8, generator=g) * (200.0 if i == BAD else 1.0)
    return (x, torch.randn(4, 12, generator=g)), {}


class ConvNet(nn.Module):
    """2. convbn: a conv net fine-tuned with its BatchNorm frozen (bn*.eval(), pretrained running statistics of
    data with std 0.1); one batch is a raw depth map in millimetres: `c2` overflows."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 4)
        with torch.no_grad():
            self.bn1.running_var.fill_(0.01)
            self.bn2.running_var.fill_(0.01)

    def forward(self, x, y):
        h = torch.relu(self.bn1(self.c1(x)))
        h = torch.relu(self.bn2(self.c2(h)))
        return F.cross_entropy(self.fc(h.mean((2, 3))).float(), y)


def conv_freeze(m):
    m.bn1.eval()
    m.bn2.eval()


def conv_batch(i):
    g = gen(i)
    x = torch.rand(4, 1, 12, 12, generator=g) * (3000.0 if i == BAD else 1.0)
    return (x, torch.randint(0, 4, (4,), generator=g)), {}


class GRUForecaster(nn.Module):
    """3. gru: proj -> GRU -> head; a sensor glitch (a reading in raw units, 1e5 > fp16's max) makes `proj`'s
    input cast overflow (the GRU itself runs in fp32 under CPU autocast)."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.rnn, self.head = nn.Linear(4, d), nn.GRU(d, d, batch_first=True), nn.Linear(d, 1)

    def forward(self, x, y):
        h, _ = self.rnn(self.proj(x))
        return F.mse_loss(self.head(h[:, -1]).squeeze(-1).float(), y)


def gru_batch(i):
    g = gen(i)
    x = torch.randn(4, 10, 4, generator=g)
    if i == BAD:
        x[1, 6, 2] = 1.0e5
    return (x, torch.randn(4, generator=g)), {}


class TiedLM(nn.Module):
    """4. tied: a small LM whose output projection shares the embedding's weight; a rare token's embedding row has
    grown (norm² ≈ 80000): the logit of a context holding it overflows in `head`."""

    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight[7] = 50.0

    def forward(self, tok, tgt):
        h = self.emb(tok)
        h = h + 0.1 * self.ff(h)
        return F.cross_entropy(self.head(h).float().flatten(0, 1), tgt.flatten())


def tied_batch(i):
    g = gen(i)
    tok = torch.randint(8, 50, (4, 10), generator=g)
    if i == BAD:
        tok[2, 4] = 7
    return (tok, torch.randint(8, 50, (4, 10), generator=g)), {}


class DictModel(nn.Module):
    """5. dict_kwargs: forward(batch: dict, *, labels): token ids and numeric columns; one batch has a price in
    cents (2e5 > fp16's max) in its numeric columns: `num`'s input cast overflows."""

    def __init__(self, vocab=30, d=16):
        super().__init__()
        self.emb, self.num = nn.EmbeddingBag(vocab, d), nn.Linear(4, d)
        self.mid, self.head = nn.Linear(d, d), nn.Linear(d, 1)
        with torch.no_grad():
            self.num.weight.mul_(0.01)

    def forward(self, batch, *, labels):
        h = self.emb(batch["tokens"]) + self.num(batch["numeric"])
        return F.mse_loss(self.head(torch.relu(self.mid(h))).squeeze(-1).float(), labels)


def dict_batch(i):
    g = gen(i)
    num = torch.randn(4, 4, generator=g)
    if i == BAD:
        num[0, 3] = 2.0e5
    b = {"tokens": torch.randint(0, 30, (4, 6), generator=g), "numeric": num}
    return (b,), {"labels": torch.randn(4, generator=g)}


class DropFFN(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.up, self.drop, self.down = nn.Linear(d, h), nn.Dropout(0.5), nn.Linear(h, d)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x))))


class DropoutModel(nn.Module):
    """6. dropout: a residual feed-forward with dropout (p=0.5: kept entries doubled) whose output weights grew
    (T5-style); an outlier batch: `ff.down` overflows, which entries do depends on the dropout mask."""

    def __init__(self):
        super().__init__()
        self.inp, self.ff, self.head = nn.Linear(16, 32), DropFFN(), nn.Linear(32, 4)
        with torch.no_grad():
            self.ff.down.weight.mul_(100.0)
            self.head.weight.mul_(1e-3)

    def forward(self, x, y):
        h = self.inp(x)
        return F.mse_loss(self.head(h + self.ff(h)).float(), y)


def dropout_batch(i):
    g = gen(i)
    x = torch.randn(8, 16, generator=g) * (1000.0 if i == BAD else 1.0)
    return (x, torch.randn(8, 4, generator=g)), {}


class Refine(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        with torch.no_grad():
            self.fc2.weight.mul_(50.0)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class TwiceModel(nn.Module):
    """7. twice: one refinement block applied twice per forward (weights shared, a universal-transformer step); the
    first call grows the activations, the second call's `refine.fc2` overflows on a large batch."""

    def __init__(self, d=32):
        super().__init__()
        self.inp, self.refine, self.norm, self.head = nn.Linear(8, d), Refine(d), nn.LayerNorm(d), nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.norm(self.refine(self.refine(self.inp(x))))
        return F.mse_loss(self.head(h).squeeze(-1).float(), y)


def twice_batch(i):
    g = gen(i)
    x = torch.randn(8, 8, generator=g) * (400.0 if i == BAD else 1.0)
    return (x, torch.randn(8, generator=g)), {}


class LogCoshFn(torch.autograd.Function):
    """log(cosh(r)) by hand with its analytic backward tanh(r): cosh overflows fp16 for |r| > ~11.8."""

    @staticmethod
    def forward(ctx, r):
        ctx.save_for_backward(r)
        return torch.log(torch.cosh(r))

    @staticmethod
    def backward(ctx, g):
        (r,) = ctx.saved_tensors
        return g * torch.tanh(r)


class LogCosh(nn.Module):
    def forward(self, pred, y):
        return LogCoshFn.apply(pred - y.to(pred.dtype)).float().mean()


class CustomFnModel(nn.Module):
    """8. custom_fn: a regressor trained with a log-cosh loss, a custom autograd Function inside the model; a batch
    of outlier targets (residual ~20): cosh overflows in `crit`."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.crit = LogCosh()

    def forward(self, x, y):
        return self.crit(self.body(x).squeeze(-1), y)


def custom_batch(i):
    g = gen(i)
    y = torch.randn(8, generator=g)
    if i == BAD:
        y[3] = 20.0
    return (torch.randn(8, 8, generator=g), y), {}


# ======================================================================================================================
# the cases
# ======================================================================================================================
@dataclass
class Case:
    name: str
    factory: Callable[[], nn.Module]
    batch: Callable[[int], tuple]
    producer: str                           # the module the independent oracle must name (checked: the design)
    prepare: Callable[[nn.Module], None] | None = None    # after building / loading (a frozen BatchNorm)


CASES = [
    Case("attn", TinyTransformer, attn_batch, "blk.attn"),
    Case("convbn", ConvNet, conv_batch, "bn2", prepare=conv_freeze),
    Case("gru", GRUForecaster, gru_batch, "proj"),
    Case("tied", TiedLM, tied_batch, "head"),
    Case("dict_kwargs", DictModel, dict_batch, "num"),
    Case("dropout", DropoutModel, dropout_batch, "ff.down"),
    Case("twice", TwiceModel, twice_batch, "refine.fc2"),
    Case("custom_fn", CustomFnModel, custom_batch, "crit"),
]
BY_NAME = {c.name: c for c in CASES}


def build(case):
    torch.manual_seed(0)
    m = case.factory()
    m.train()
    if case.prepare is not None:
        case.prepare(m)
    return m


# ======================================================================================================================
# the real run, watched, with the oracle beside it
# ======================================================================================================================
@dataclass
class Run:
    case: Case
    run_dir: str
    oracle: tuple | None = None             # Producer.first: (module, step, call)
    losses: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    state: dict = field(default_factory=dict)   # the weights/buffers the bad step's forward ran with
    rng: torch.Tensor | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    scale: float = 0.0
    caps: list = field(default_factory=list)

    @property
    def cap(self):
        return os.path.join(self.run_dir, "captures", str(BAD))


def train(case, root) -> Run:
    m = build(case)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=SCALE)
    r = Run(case, os.path.join(str(root), case.name))
    orc = Producer(m, with_kwargs=True, call_in_first=True)
    torch.manual_seed(5)
    with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=r.run_dir):
        for i in range(STEPS):
            orc.step = i
            args, kwargs = case.batch(i)
            opt.zero_grad()
            if i == BAD:
                r.state = {k: v.detach().clone() for k, v in m.state_dict().items()}
                r.rng, r.args, r.kwargs, r.scale = torch.get_rng_state(), args, kwargs, sc.get_scale()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(*args, **kwargs)
            r.losses.append(loss.item())
            s0 = sc.get_scale()
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                r.skipped.append(i)
        orc.remove()                       # (before close(): its replay runs the model again)
    r.oracle = orc.first
    cdir = os.path.join(r.run_dir, "captures")
    r.caps = sorted(os.listdir(cdir)) if os.path.isdir(cdir) else []
    return r


def _up(t):
    return t.float() if torch.is_tensor(t) and t.is_floating_point() else t


def in_fp32(model, names):
    """Our own "keep these modules in fp32": autocast off around their forward, every floating input (nested in
    dicts/lists too) cast to fp32."""
    for n in names:
        mod = model.get_submodule(n)

        def fwd(*a, _orig=mod.forward, **k):
            with torch.autocast("cpu", enabled=False):
                return _orig(*tree_map(_up, a), **tree_map(_up, k))
        mod.forward = fwd


@dataclass
class Step:
    loss: float
    fwd_finite: bool
    finite: bool


def rerun(r: Run, fp32=(), *, scale=None, snippet=None) -> Step:
    """The bad step again, unwatched, on a fresh model holding that step's weights, with its RNG state, under fp16
    autocast; `fp32`: modules kept in fp32 by our own patch; `snippet`: the fix search's snippet exec'd on the model
    as a user pastes it. The backward runs at `scale` (default the step's loss scale)."""
    m = build(r.case)
    m.load_state_dict(r.state)
    if snippet is not None:
        exec(snippet, {"model": m})
    in_fp32(m, list(fp32))
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(r.rng)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(*r.args, **r.kwargs)
        fwd_ok = bool(torch.isfinite(loss).all())
        (loss.float() * (r.scale if scale is None else scale)).backward()
    grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)
    return Step(float(loss.detach()), fwd_ok, fwd_ok and grads_ok)


# ======================================================================================================================
# fixtures
# ======================================================================================================================
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fix_holds")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = train(BY_NAME[name], root)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def replays(runs):
    """The replay's report as JSON (CONTRACT.md: findings + summary + the replay panel), for a fresh model."""
    cache = {}

    def get(name):
        if name not in cache:
            r = runs(name)
            rep = ampdoctor.replay(r.cap, model=build(r.case))
            cache[name] = json.loads(json.dumps(rep.to_dict()))
        return cache[name]
    return get


def listing(d):
    return "\n".join(f"[{f['severity']}] {f['rule']} @ {f['module']!r} {f['op']} step {f['step']}"
                     for f in d["findings"][:5])


def claim(cond, msg):
    if not cond:
        raise WrongAnswer(msg)


def _real(r: Run):
    """The failure is real, at BAD, with the designed producer (our own checks: a failure here is our bug)."""
    assert all(map(math.isfinite, r.losses[:BAD])), r.losses
    first_bad = next(i for i in range(STEPS) if i in r.skipped or not math.isfinite(r.losses[i]))
    assert first_bad == BAD, (r.skipped, r.losses)
    assert r.caps and r.caps[0] == str(BAD), r.caps
    assert r.oracle is not None and r.oracle[:2] == (r.case.producer, BAD), r.oracle
    assert not rerun(r).finite                          # our unwatched rerun of the step is broken too


XF: dict = {}  # name -> {test: reason}: what ampdoctor gets wrong (strict xfails, WrongAnswer only)
# wrong when written, right since: dict_kwargs (minimal): the search answered [''] where ['num', 'head'] suffice
# (replay/searches._fix: a trial whose backward no loss scale makes finite tries that backward's producer at scale 1 next)


def params(test):
    return [pytest.param(c.name, marks=wrong(XF[c.name][test])) if test in XF.get(c.name, {}) else c.name
            for c in CASES]


# ======================================================================================================================
# the tests
# ======================================================================================================================
@pytest.mark.parametrize("name", params("producer"))
def test_replay_names_the_oracles_producer_and_step(runs, replays, name):
    r = runs(name)
    _real(r)
    d = replays(name)
    top = d["findings"][0] if d["findings"] else None
    claim(top is not None and top["severity"] == "error", f"no error finding on top:\n{listing(d)}")
    claim((top["module"], top["step"]) == (r.oracle[0], r.oracle[1]),
          f"replay names {top['module']!r} at step {top['step']}, the oracle {r.oracle[0]!r} at step {r.oracle[1]}"
          f"\n{listing(d)}")


@pytest.mark.parametrize("name", params("rule"))
def test_the_producers_finding_is_an_overflow(runs, replays, name):
    """CONTRACT.md: `overflow` is a module (op) turning finite inputs into ±inf; `mask_value_overflow` is a
    fill/mask constant out of range. Every producer here turns finite data into +inf or -inf."""
    r = runs(name)
    _real(r)
    d = replays(name)
    top = d["findings"][0]
    claim(top["rule"] in ("overflow", "nan_origin"), f"the producer's finding is {top['rule']!r}, not 'overflow':\n"
                                                     f"{listing(d)}")


def _fix(d):
    fix = d["replay"]["fix"]
    claim(fix["found"] is True and fix["modules"], f"no fix found: {fix}")
    return fix


@pytest.mark.parametrize("name", params("holds"))
def test_the_suggested_fix_really_holds(runs, replays, name):
    r = runs(name)
    _real(r)
    d = replays(name)
    fix = _fix(d)
    mods, at = fix["modules"], fix.get("finite_at_scale")
    top = d["findings"][0]
    claim(fix["snippet"] and fix["snippet"] in top["fix"], f"the fix snippet is not in the top finding's fix: "
                                                           f"{top['fix']!r}")
    ours = rerun(r, mods)
    if at:
        claim(ours.fwd_finite, f"{mods} in fp32: the forward is still not finite (loss {ours.loss})")
        ours = rerun(r, mods, scale=at)
    claim(ours.finite, f"{mods} kept in fp32 (our patch) at scale {at or r.scale:g}: loss {ours.loss}, step still "
                       "not finite")
    pasted = rerun(r, scale=at, snippet=fix["snippet"])
    claim(pasted.finite, f"the snippet for {mods}, pasted, at scale {at or r.scale:g}: loss {pasted.loss}, step "
                         "still not finite")


def _covered(model, names):
    return sum(any(n == x or x == "" or n.startswith(x + ".") for x in names) for n, _ in model.named_modules())


def _suffices(r, mods):
    """README's rule: the forward finite with `mods` in fp32 and the backward finite at the step's scale or a few
    GradScaler backoffs lower (≥ 2^-16 of it)."""
    s = rerun(r, mods)
    return s.finite or s.fwd_finite and rerun(r, mods, scale=max(r.scale * 0.5 ** 16, 1.0)).finite


@pytest.mark.parametrize("name", params("minimal"))
def test_the_suggested_fix_is_minimal(runs, replays, name):
    r = runs(name)
    _real(r)
    fix = _fix(replays(name))
    mods, at = fix["modules"], fix.get("finite_at_scale") or r.scale
    for i in range(len(mods)):                              # none of them can go
        rest = mods[:i] + mods[i + 1:]
        claim(not rerun(r, rest, scale=at).finite, f"{mods} is not minimal: {rest} alone fixes the step")
    m = build(r.case)
    if _suffices(r, [r.oracle[0]]):                         # the producer alone suffices: no more than it
        claim(_covered(m, mods) <= _covered(m, [r.oracle[0]]),
              f"fix {mods} (covers {_covered(m, mods)} modules) where the producer {r.oracle[0]!r} alone suffices")
    if "" in mods:                                          # the whole model: only if no pair of modules does it
        names = [n for n, _ in m.named_modules() if n]
        best = next(([a, b] for i, a in enumerate(names) for b in names[i + 1:]
                     if not b.startswith(a + ".") and _suffices(r, [a, b])), None)
        claim(best is None, f"fix {mods} (the whole model in fp32, {_covered(m, mods)} modules) where {best} "
                            f"({_covered(m, best)} modules) suffice")
