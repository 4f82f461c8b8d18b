"""HEALTHY training loops written with real-code idioms a mixed-precision debugger must stay silent on, watched at
ampdoctor's DEFAULT settings (`ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")`, nothing
else). fp16 = CPU fp16 autocast + a real torch.amp.GradScaler("cpu") (default init scale 2**16: it may skip a few
opening steps while it finds its scale); bf16 = bf16 autocast, no scaler. Tiny models, 40-60 optimizer steps, fixed
seeds, one intra-op thread.

One loop for all (`fit`): zero_grad -> `accum` micro-batches under autocast, each loss / accum, scale(loss).backward
-> unscale_ -> clip (by norm 1.0, by value, or none) -> scaler.step -> update -> sched.step() -> `after(i)`
(EMA / SWA updates). The test's own oracle first (`healthy`; a failure there is a plain failure): every loss
finite; forward hooks on every module saw no non-finite floating output; the unscaled gradients non-finite only on
steps the scaler skipped, and those only the opening search (steps < OPENING, never later); the loss fell (the mean
of the last quarter below FALL x the first quarter's). Then (`judge`): w.report() and ampdoctor.diagnose(run_dir)
hold no warning and no error, exit code 0, one step recorded per optimizer step, no `ampdoctor...` Python warning.
Where marked (twin), the same run (same seeds, same oracle hooks) WITHOUT the watch must give bitwise identical
losses, unscaled gradients at every step and final state_dict (the watch does not change training). A false alarm
is a strict xfail (probe_harness.wrong: WrongAnswer only) quoting the finding.

Not duplicated: test_healthy_default* cover several of these idioms one at a time in other models; here they are
combined differently (e.g. weight_norm + spectral_norm in one net, SWA's AveragedModel deep-copied AFTER the watch
is on, finfo.min masking of fp16 logits, sparse embedding gradients through GradScaler.unscale_).

Runs (search = GradScaler(init_scale=2**20): the scaler's opening search skips steps 0-3 before it settles;
the others at the default 2**16 skip nothing):
 1. wn_spectral_mlp (fp16, twin): parametrizations.weight_norm on the first Linear, spectral_norm on the second
    (power iteration updates its u/v buffers each training forward), AdamW 2e-3.
 2. orthogonal_rnn (fp16): a hand-rolled tanh RNN over 6 steps whose square recurrent Linear is
    parametrizations.orthogonal; AdamW.
 3. lora_frozen_base (fp16, twin): LoRA (r=4, alpha 8) on both hidden Linears of a frozen base MLP, B zeros so A's
    gradients are exactly zero at step 0 (asserted); only A/B and a trainable head in AdamW.
 4. ema_averaged_model (fp16): AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=True) built
    before the watch, updated each step; the EMA model evaluated under autocast at the end inside the watch.
 5. swa_swalr_bn (fp16): conv + BatchNorm2d net, SGD momentum, CosineAnnealingLR then from step 30 SWALR with an
    AveragedModel created THEN (a deepcopy of the watched model); update_bn over 4 batches at the end, SWA model
    evaluated (its loss finite and below the first loss).
 6. accum4_onecycle_smooth (fp16, twin): 4 micro-batches per step through one scaler, OneCycleLR, label smoothing
    0.1 cross-entropy.
 7. mha_key_padding (fp16, search): Embedding(padding_idx=0) + nn.MultiheadAttention(batch_first) with
    key_padding_mask (1..T real tokens per row, never a fully padded row), masked mean pooling.
 8. encoder_norm_first_nested (fp16, search): nn.TransformerEncoder(2 layers norm_first=True,
    enable_nested_tensor=True, final LayerNorm) with src_key_padding_mask; an eval pass (model.eval(), no_grad,
    autocast) every 20 steps.
 9. gn_in_channels_last_clipvalue (fp16, twin): Conv -> GroupNorm -> Conv -> InstanceNorm2d(affine) net in
    channels_last (model and input), clip_grad_value_(0.5) after unscale_.
10. param_groups_frozen (fp16, search): AdamW with three groups: decayed weights (wd 0.1), biases + LayerNorm
    (wd 0), and a frozen embedding group (requires_grad False, lr 0): never gets a gradient (asserted unchanged).
11. emb_maxnorm_checkpoint (fp16, twin, search): Embedding(padding_idx=0, max_norm=1.0) (renormalises rows in
    place in the forward) + two residual MLP blocks through torch.utils.checkpoint(use_reentrant=False).
12. finfo_min_masked_logits (fp16, search): hand-written attention whose fp16 scores are masked_fill'ed with
    torch.finfo(scores.dtype).min at padded keys, and a classifier whose fp16 logits of illegal classes are masked
    with torch.finfo(logits.dtype).min (the target always legal), cross-entropy in fp32.
13. sparse_embedding_sgd (fp16, twin, search): nn.Embedding(sparse=True) mean-pooled + Linear head, SGD (sparse
    gradients through GradScaler.unscale_), no clipping.
14. bf16_mha_finfo_mask: run 12's model in bf16 (finfo(bfloat16).min masks), no scaler.
15. bf16_ema_wn: run 1's model in bf16 with an EMA AveragedModel updated each step, no scaler.

Result when written: 14 pass, 1 xfail (stable over two runs, ~8 s on one thread). The twin runs (1, 3, 6, 9, 11,
13) trained bitwise identically watched and unwatched, including the skipped steps of 11 and 13. The search runs'
opening skips came out as info only (`skipped_steps ... a normal rate`, `overflow ... GradScaler skipped them ...
as designed`), as they should.
14 was wrong when written, fixed since (output_sum takes a bf16 output's min and max, summed in float64): a strict
xfail then, with [error] nan_origin at (run) (module None, op None) step 0, phase forward: "The
  model's output became non-finite at step 0, a step without per-layer statistics; the replay of its capture ...
  stayed finite ..." (evidence unlocated, replay_finite: true). The output is finite (asserted by the oracle's
  hooks); its logits of illegal classes hold torch.finfo(torch.bfloat16).min = -3.39e38 (5 in the first batch),
  and the watch's per-step output trip-wire sums a bf16 output in fp32 (record/modulehooks.py output_sum, whose
  comment assumes a finite bf16 output whose fp32 sum overflows is already broken): two such values make -inf.
  The fp16 twin of this model (run 12, finfo(float16).min) is quiet.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations as P
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn
from torch.utils.checkpoint import checkpoint

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import WrongAnswer, wrong  # noqa: E402
from scenarios import alarms, gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16
OPENING = 8     # the scaler's opening search: skips only before this step
FALL = 0.9
SEARCH = 2.0 ** 20  # the init scale of the runs marked [search]: the scaler backs off 3-4 times in the opening steps


def rn(*shape, seed):
    return torch.randn(*shape, generator=gen(seed))


# --- data -----------------------------------------------------------------------------------------------------------

TEACH = rn(16, 8, seed=4242)


def cls_batch(seed, n=32, d=16, k=4):
    x = rn(n, d, seed=seed)
    return x, (torch.tanh(x) @ TEACH[:d, :k]).argmax(1)


def seq_cls_batch(seed, n=16, t=6, d=16):
    x = rn(n, t, d, seed=seed)
    return x, (torch.tanh(x.mean(1) * 2) @ TEACH[:d, :4]).argmax(1)


def tok_batch(seed, n=16, t=10, vocab=12):
    """Token rows with 1..t real tokens (ids 1..vocab-1), padded with 0 at the end; label: more tokens < vocab/2
    than >= among the real ones."""
    g = gen(seed)
    tok = torch.randint(1, vocab, (n, t), generator=g)
    lens = torch.randint(1, t + 1, (n,), generator=g)
    tok = tok.masked_fill(torch.arange(t)[None, :] >= lens[:, None], 0)
    real = tok > 0
    small = ((tok < vocab // 2) & real).sum(1)
    return tok, (2 * small > lens).long()


def img_batch(seed, n=16, c=3, s=8):
    g = gen(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    xs = torch.arange(float(s))
    grid = [torch.sin(xs[:, None] * (1 + k)) * torch.cos(xs[None, :] * (4 - k)) for k in range(4)]
    x = torch.stack([grid[int(k)] for k in y])[:, None].expand(n, c, s, s) + 0.5 * torch.randn(n, c, s, s, generator=g)
    return x.contiguous(), y


# --- models ---------------------------------------------------------------------------------------------------------

def mlp(seed, d_in=16, h=64, d_out=4, ln=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, h)] + ([nn.LayerNorm(h)] if ln else []) + [nn.GELU(), nn.Linear(h, h), nn.GELU(),
                                                                           nn.Linear(h, d_out)]
    return nn.Sequential(*layers)


def wn_spectral_mlp(seed):
    m = mlp(seed)
    P.weight_norm(m[0])
    P.spectral_norm(m[2])
    return m


class OrthoRNN(nn.Module):
    def __init__(self, seed, d=16, h=32):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.rec, self.head = nn.Linear(d, h), nn.Linear(h, h, bias=False), nn.Linear(h, 4)
        P.orthogonal(self.rec)

    def forward(self, x):
        h = torch.zeros(x.shape[0], self.rec.in_features, device=x.device)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return self.head(h)


class LoRALinear(nn.Module):
    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        base.bias.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def lora_mlp(seed):
    m = mlp(seed)
    for p in m.parameters():
        p.requires_grad_(False)
    m[0], m[2] = LoRALinear(m[0]), LoRALinear(m[2])
    m[4].weight.requires_grad_(True)
    m[4].bias.requires_grad_(True)
    return m


class ConvBN(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        return self.head(F.relu(self.b2(self.c2(x))).mean((2, 3)))


class ConvGNIN(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.c1, self.gn = nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16)
        self.c2, self.inorm = nn.Conv2d(16, 16, 3, padding=1), nn.InstanceNorm2d(16, affine=True)
        self.head = nn.Linear(16 * 4, 4)

    def forward(self, x):
        x = F.silu(self.gn(self.c1(x)))
        x = F.silu(self.inorm(self.c2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 2).flatten(1))    # (a plain mean would undo InstanceNorm)


class MHANet(nn.Module):
    def __init__(self, seed, vocab=12, d=32, t=10):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.pos = nn.Embedding(vocab, d, padding_idx=0), nn.Embedding(t, d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tok):
        pad = tok == 0
        h = self.emb(tok) + self.pos(torch.arange(tok.shape[1]))
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        h = self.ln(h + a)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class EncNet(nn.Module):
    def __init__(self, seed, vocab=12, d=32, t=10):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.pos = nn.Embedding(vocab, d, padding_idx=0), nn.Embedding(t, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # "enable_nested_tensor is True, but ... norm_first was True"
            self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(d), enable_nested_tensor=True)
        self.head = nn.Linear(d, 2)

    def forward(self, tok):
        pad = tok == 0
        h = self.enc(self.emb(tok) + self.pos(torch.arange(tok.shape[1])), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class GroupedNet(nn.Module):
    def __init__(self, seed, vocab=12, d=32):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.emb.weight.requires_grad_(False)
        self.fc1, self.ln, self.fc2 = nn.Linear(d, 64), nn.LayerNorm(64), nn.Linear(64, 2)

    def forward(self, tok):
        keep = (tok > 0).unsqueeze(-1).float()
        h = (self.emb(tok) * keep).sum(1) / keep.sum(1)
        return self.fc2(F.gelu(self.ln(self.fc1(h))))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class CkptNet(nn.Module):
    def __init__(self, seed, vocab=12, d=32):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d, padding_idx=0, max_norm=1.0)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, 2)

    def forward(self, tok):
        keep = (tok > 0).unsqueeze(-1).float()
        h = self.emb(tok) * 4.0
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False)
        return self.head((h * keep).sum(1) / keep.sum(1))


class MaskedAttnNet(nn.Module):
    """Hand-written single-head attention; padded keys masked with finfo(scores.dtype).min; the classifier's logits
    of the classes illegal for a row (class 3 when the row has fewer than 3 real tokens) masked with
    finfo(logits.dtype).min."""

    def __init__(self, seed, vocab=12, d=32, t=10):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.pos = nn.Embedding(vocab, d, padding_idx=0), nn.Embedding(t, d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, tok):
        pad = tok == 0
        h = self.emb(tok) + self.pos(torch.arange(tok.shape[1]))
        q, k, v = self.qkv(h).chunk(3, -1)
        s = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(pad[:, None, :], torch.finfo(s.dtype).min)
        h = h + self.o(torch.softmax(s, -1) @ v)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        logits = self.head((h * keep).sum(1) / keep.sum(1))
        illegal = torch.zeros_like(logits, dtype=torch.bool)
        illegal[:, 3] = (~pad).sum(1) < 3
        return logits.masked_fill(illegal, torch.finfo(logits.dtype).min)


def masked_label(tok):
    """4 classes: 2 x (more small tokens) + (first token small), class 3 needing >= 3 real tokens (else 2)."""
    real = tok > 0
    lens = real.sum(1)
    small = ((tok < 6) & real).sum(1)
    y = 2 * (2 * small > lens).long() + (tok[:, 0] < 6).long()
    return torch.where((y == 3) & (lens < 3), torch.full_like(y, 2), y)


class SparseBag(nn.Module):
    def __init__(self, seed, vocab=50, d=16):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d, padding_idx=0, sparse=True)
        self.head = nn.Linear(d, 2)

    def forward(self, tok):
        keep = (tok > 0).unsqueeze(-1).float()
        return self.head((self.emb(tok) * keep).sum(1) / keep.sum(1))


# --- the loop -------------------------------------------------------------------------------------------------------

def ce(out, y):
    return F.cross_entropy(out.float(), y)


def dense(g):
    return g.to_dense() if g.is_sparse else g


def fit(m, data, loss_fn, steps, tmp_path, *, opt, sched=None, dtype=FP16, accum=1, clip="norm", watch=True,
        after=None, end=None, eval_every=0, seed=0, call=None, init_scale=2.0 ** 16):
    """The user's loop (module docstring) under ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=...) at its
    defaults (`watch=False`: the same loop, the same oracle hooks, no watch). `after(i)` runs after each step,
    `end(r)` after the loop inside the watch. Records losses, skipped steps, steps with non-finite unscaled
    gradients, (module, step) of non-finite module outputs, the unscaled gradients of every step (dense clones), the
    final state_dict, the reports."""
    torch.manual_seed(seed)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == FP16 else None
    call = call or m
    r = dict(losses=[], skipped=[], bad_grad=[], bad_out=[], grads=[], evals=[], warns=[], rep=None, disk=None)
    names = {mod: n for n, mod in m.named_modules()}
    cur = {"step": 0}

    def hook(mod, inp, out):
        outs = [out] if torch.is_tensor(out) else [t for t in (out if isinstance(out, (tuple, list)) else [])
                                                    if torch.is_tensor(t)]
        for t in outs:
            if t.is_floating_point() and not t.is_nested and not bool(torch.isfinite(t).all()):
                r["bad_out"].append((names[mod], cur["step"]))
    hs = [mod.register_forward_hook(hook) for mod in m.modules()]
    params = [p for g in opt.param_groups for p in g["params"]]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run") if watch else None
        for i in range(steps):
            cur["step"] = i
            opt.zero_grad()
            tot = 0.0
            for k in range(accum):
                x, y = data(i, k)
                with torch.autocast("cpu", dtype=dtype):
                    loss = loss_fn(call(x), y) / accum
                tot += loss.item()
                (sc.scale(loss) if sc is not None else loss).backward()
            r["losses"].append(tot)
            if sc is not None:
                sc.unscale_(opt)
            gs = [dense(p.grad).detach().clone() if p.grad is not None else None for p in params]
            r["grads"].append(gs)
            if not all(bool(torch.isfinite(g).all()) for g in gs if g is not None):
                r["bad_grad"].append(i)
            if clip == "norm":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            elif clip == "value":
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.5)
            if sc is not None:
                s0 = sc.get_scale()
                sc.step(opt)
                sc.update()
                if sc.get_scale() < s0:
                    r["skipped"].append(i)
            else:
                opt.step()
            if sched is not None:
                sched.step()
            if after is not None:
                after(i)
            if eval_every and (i + 1) % eval_every == 0:
                m.eval()
                with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
                    x, y = data(10 ** 5, 0)
                    r["evals"].append(loss_fn(call(x), y).item())
                m.train()
        if end is not None:
            end(r)
        for h in hs:
            h.remove()
        if w is not None:
            w.close()
            r["rep"] = w.report()
            r["disk"] = ampdoctor.diagnose(tmp_path / "run")
    r["warns"] = [str(x.message) for x in seen if str(x.message).startswith("ampdoctor")]
    r["state"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return r


def healthy(r):
    """The oracle (module docstring)."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and all(map(math.isfinite, r["evals"])), ls
    assert r["bad_out"] == [], r["bad_out"][:10]
    assert set(r["bad_grad"]) <= set(r["skipped"]), (r["bad_grad"], r["skipped"])
    assert all(s < OPENING for s in r["skipped"]), r["skipped"]
    k = max(1, len(ls) // 4)
    assert sum(ls[-k:]) < FALL * sum(ls[:k]), (sum(ls[:k]) / k, sum(ls[-k:]) / k, ls)


def judge(r):
    """ampdoctor: no warning or error in w.report() nor diagnose(run_dir), exit 0, no `ampdoctor...` Python warning,
    every optimizer step recorded."""
    for rep in (r["rep"], r["disk"]):
        bad = alarms(rep.findings)
        if bad or rep.exit_code != 0 or r["warns"]:
            raise WrongAnswer(f"{bad} {r['warns']} | all: {lines(rep)}")
        assert rep.summary["steps"] == len(r["losses"]), rep.summary


def same(a, b):
    """The watched and unwatched runs trained bitwise identically."""
    assert a["losses"] == b["losses"], [(i, x, y) for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if x != y]
    assert a["skipped"] == b["skipped"], (a["skipped"], b["skipped"])
    for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        for j, (x, y) in enumerate(zip(ga, gb)):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (i, j)
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k


# --- the runs: name -> (build(tmp_path, watch) -> run dict, twin) ---------------------------------------------------

RUNS = {}


def case(twin=False):
    def deco(fn):
        RUNS[fn.__name__[4:]] = (fn, twin)
        return fn
    return deco


@case(twin=True)
def run_wn_spectral_mlp(tmp_path, watch=True):
    m = wn_spectral_mlp(1)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    return fit(m, lambda i, k: cls_batch(i % 20), ce, 50, tmp_path, opt=opt, watch=watch)


@case()
def run_orthogonal_rnn(tmp_path, watch=True):
    m = OrthoRNN(2)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return fit(m, lambda i, k: seq_cls_batch(i % 20), ce, 50, tmp_path, opt=opt, watch=watch)


@case(twin=True)
def run_lora_frozen_base(tmp_path, watch=True):
    m = lora_mlp(3)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=5e-3)
    r = fit(m, lambda i, k: cls_batch(i % 20), ce, 50, tmp_path, opt=opt, watch=watch)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    g0 = dict(zip(names, r["grads"][0]))
    assert all(bool((g0[n] == 0).all()) for n in ("0.lora_A", "2.lora_A")), list(g0)    # B == 0: A's grads exactly 0
    assert bool((g0["0.lora_B"] != 0).any())
    return r


@case()
def run_ema_averaged_model(tmp_path, watch=True):
    m = mlp(4, ln=True)
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)

    def end(r):
        ema.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
            x, y = cls_batch(10 ** 5)
            r["evals"].append(ce(ema(x), y).item())
    r = fit(m, lambda i, k: cls_batch(i % 20), ce, 50, tmp_path, opt=opt, watch=watch,
            after=lambda i: ema.update_parameters(m), end=end)
    assert r["evals"][-1] < r["losses"][0], (r["evals"], r["losses"][0])
    return r


@case()
def run_swa_swalr_bn(tmp_path, watch=True):
    m = ConvBN(5)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 30)
    swa = {"model": None, "sched": None}

    class Sched:
        def step(self):
            (swa["sched"] or cos).step()

    def after(i):
        if i == 29:
            swa["model"] = AveragedModel(m)        # deep-copied from the watched model, mid-run
            swa["sched"] = SWALR(opt, swa_lr=0.02, anneal_epochs=5)
        if swa["model"] is not None:
            swa["model"].update_parameters(m)

    def end(r):
        with torch.autocast("cpu", dtype=FP16):
            update_bn([img_batch(500 + j) for j in range(4)], swa["model"])
        swa["model"].eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
            x, y = img_batch(10 ** 5)
            r["evals"].append(ce(swa["model"](x), y).item())
    r = fit(m, lambda i, k: img_batch(i % 20), ce, 60, tmp_path, opt=opt, sched=Sched(), watch=watch, after=after,
            end=end)
    assert r["evals"][-1] < r["losses"][0], (r["evals"], r["losses"][0])
    return r


@case(twin=True)
def run_accum4_onecycle_smooth(tmp_path, watch=True):
    m = mlp(6)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=40)
    return fit(m, lambda i, k: cls_batch(4 * (i % 10) + k, n=16), lambda o, y: F.cross_entropy(o.float(), y,
               label_smoothing=0.1), 40, tmp_path, opt=opt, sched=sched, accum=4, watch=watch)


@case()
def run_mha_key_padding(tmp_path, watch=True):
    m = MHANet(7)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return fit(m, lambda i, k: tok_batch(i % 20), ce, 60, tmp_path, opt=opt, watch=watch, init_scale=SEARCH)


@case()
def run_encoder_norm_first_nested(tmp_path, watch=True):
    m = EncNet(8)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return fit(m, lambda i, k: tok_batch(i % 20), ce, 60, tmp_path, opt=opt, watch=watch, init_scale=SEARCH,
               eval_every=20)


@case(twin=True)
def run_gn_in_channels_last_clipvalue(tmp_path, watch=True):
    m = ConvGNIN(9).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)

    def data(i, k):
        x, y = img_batch(i % 20)
        return x.to(memory_format=torch.channels_last), y
    return fit(m, data, ce, 40, tmp_path, opt=opt, clip="value", watch=watch)


@case()
def run_param_groups_frozen(tmp_path, watch=True):
    m = GroupedNet(10)
    decay = [m.fc1.weight, m.fc2.weight]
    no_decay = [m.fc1.bias, m.fc2.bias, m.ln.weight, m.ln.bias]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0},
                             {"params": [m.emb.weight], "lr": 0.0, "weight_decay": 0.0}], lr=3e-3)
    e0 = m.emb.weight.detach().clone()
    r = fit(m, lambda i, k: tok_batch(i % 20), ce, 60, tmp_path, opt=opt, watch=watch, init_scale=SEARCH)
    assert torch.equal(m.emb.weight, e0) and m.emb.weight.grad is None
    return r


@case(twin=True)
def run_emb_maxnorm_checkpoint(tmp_path, watch=True):
    m = CkptNet(11)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return fit(m, lambda i, k: tok_batch(i % 20), ce, 60, tmp_path, opt=opt, watch=watch, init_scale=SEARCH)


@case()
def run_finfo_min_masked_logits(tmp_path, watch=True):
    m = MaskedAttnNet(12)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)

    def data(i, k):
        tok, _ = tok_batch(i % 20)
        return tok, masked_label(tok)
    return fit(m, data, ce, 60, tmp_path, opt=opt, watch=watch, init_scale=SEARCH)


@case(twin=True)
def run_sparse_embedding_sgd(tmp_path, watch=True):
    m = SparseBag(13)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)

    def data(i, k):
        tok, _ = tok_batch(i % 20, vocab=50)
        return tok, ((tok < 25) & (tok > 0)).sum(1).mul(2).gt((tok > 0).sum(1)).long()
    return fit(m, data, ce, 60, tmp_path, opt=opt, clip=None, watch=watch, init_scale=SEARCH)


@case()
def run_bf16_mha_finfo_mask(tmp_path, watch=True):
    m = MaskedAttnNet(14)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)

    def data(i, k):
        tok, _ = tok_batch(i % 20)
        return tok, masked_label(tok)
    return fit(m, data, ce, 60, tmp_path, opt=opt, dtype=BF16, watch=watch)


@case()
def run_bf16_ema_wn(tmp_path, watch=True):
    m = wn_spectral_mlp(15)
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    return fit(m, lambda i, k: cls_batch(i % 20), ce, 50, tmp_path, opt=opt, dtype=BF16, watch=watch,
               after=lambda i: ema.update_parameters(m))


FALSE_ALARMS: dict = {  # run name -> the false finding(s) ampdoctor reported (abridged); none open (see the docstring)
}
XFAIL = {name: wrong(reason) for name, reason in FALSE_ALARMS.items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=XFAIL[n]) if n in XFAIL else n for n in RUNS])
def test_healthy_idiom(name, tmp_path):
    fn, twin = RUNS[name]
    r = fn(tmp_path)
    healthy(r)
    if twin:
        same(r, fn(tmp_path / "twin", watch=False))
    judge(r)
