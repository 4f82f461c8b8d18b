"""HEALTHY training whose numbers LOOK alarming but are fine: a mixed-precision debugger must stay silent. Each run
is watched at ampdoctor's DEFAULT settings (`ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path /
"run")`, nothing else). fp16 = CPU fp16 autocast + a real torch.amp.GradScaler("cpu") (default init scale 2**16
unless noted); bf16 = bf16 autocast, no scaler. Tiny models, 40-120 optimizer steps, fixed seeds, one intra-op
thread.

One loop for all (`fit`): [before(i)] -> zero_grad -> `accum` micro-batches under autocast, each loss / accum,
scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) (unless noted) -> scaler.step -> update -> sched.step().
The test's own oracle first (`healthy`, plus each case's own checks that the alarming shape is really there; a
failure there is a plain failure): every loss finite; forward hooks on every module saw no non-finite floating
output; the unscaled gradients non-finite only on steps the scaler skipped, and those only in its opening search
(steps < OPENING; in fact no run skips a step); the loss fell (last quarter's mean below FALL x the first quarter's;
the RL case checks its policy instead). Then (`judge`): w.report() and ampdoctor.diagnose(run_dir) hold no warning
and no error, exit code 0, one step recorded per optimizer step, no `ampdoctor...` Python warning, and the CLI
`python -m ampdoctor report RUN_DIR --out DIR --json FILE` exits 0 with no warning or error in its JSON. Where marked
(twin), the same run (same seeds, same oracle hooks) WITHOUT the watch must give bitwise identical losses, unscaled
gradients at every step and final state_dict. A false alarm is a strict xfail (probe_harness.wrong: WrongAnswer
only) quoting the finding.

Runs:
 1. flat_hot_activations (fp16, twin): an un-normalised input projection (weights ~1e3) whose fp16 output abs-max
    sits at 23-35% of fp16's max (1.5e4-2.3e4) on EVERY step, flat (first and last 20 steps' means within 3%),
    then LayerNorm + MLP classifier; AdamW.
 2. warmup_growth_plateau (fp16): a regression net predicting in the targets' units (head -> fixed Denorm x1e4,
    targets ~1e4); Adam with a 50-step linear warmup then decay: the output abs-max climbs ~70x (from ~250 to
    ~2e4, peak 32% of fp16's max) over the warmup, then plateaus at ~1.2e4 (steps 60-90 vs 90-120 within 10%).
 3. loss_spike_hard_batch (fp16, twin, init scale 2**12): MSE regression; step 30's batch has targets 10x off: the
    loss jumps ~300x once (~0.13 -> 42) and is back to its level within 3 steps.
 4. tiny_grads_deep_narrow (fp16, init scale 2**20, no clipping): 12 tanh layers of width 8 (orthogonal init,
    gain 1.3), targets ~3e-3, loss ~1e-5 -> 1e-6; the first layer's true gradients have a median ~6e-7 (< 1e-5 every
    step) while the scaled ones stay far above fp16's normal range (asserted); Adam.
 5. bf16_large_targets (bf16): regression on targets ~1e4 +- 2e3 in their own units (Denorm x2e3 + 1e4 in bf16,
    whose spacing there is 64); the output abs-max > 8e3 every step.
 6. sgdr_restarts (fp16): SGD lr 0.4 momentum 0.9 under CosineAnnealingWarmRestarts(T_0=20): the loss jumps > 1.5x
    after the restarts at steps 20 and 40 (asserted), falling overall.
 7. dropout_p09 (fp16, twin): a 256-wide MLP with Dropout(p=0.9) (kept activations x10, 90% zeros).
 8. rl_advantage_std_clamp (fp16): a contextual bandit, REINFORCE with batch-normalised advantages whose rewards
    are near constant (1.0 or 1.0001: std ~5e-5, or exactly 0 on some batches, where clamp_min(1e-8) gives zero
    advantages and an all-zero gradient); the loss crosses zero; the policy's hit rate rises by > 0.3.
 9. temperature_anneal (fp16): a classifier whose logits pass a Temp module (a buffer annealed 1 -> 0.1
    geometrically): its outputs grow steadily ~150x (0.18 -> 26-33) and stay finite.
10. frozen_fp16_backbone_bn (fp16): a frozen feature extractor held in fp16 (fp16 parameters, requires_grad False,
    not in the optimizer), an fp16 buffer of input offsets (raw features ~300), BatchNorm1d (fp32 running stats
    updated under autocast) after a trainable Linear; the fp16 weights unchanged and the stats fp32 (asserted).
11. accum16_micro (fp16, twin): 16 micro-batches of 4 samples per optimizer step through one scaler.
12. fp32_head_beyond_fp16 (fp16, twin): the head (Linear + Denorm x2e4 + 1e5) runs outside autocast on h.float():
    its fp32 outputs are ~1.2e5, past fp16's max, every step (asserted).
13. sdpa_head_dim_256 (fp16): one attention head of dimension 256 through F.scaled_dot_product_attention.

Result when written: 13 pass, 0 xfail (stable over two runs, ~35 s on one thread). ampdoctor reported no finding at
all (not even info) on any of the 13 runs, the twins (1, 3, 7, 11, 12) trained bitwise identically watched and
unwatched, and the CLI exited 0 on each. Noted while building the cases (not false alarms: the runs were changed):
a head trained with Adam at lr 5-50 to reach ~1e4 outputs drew `update_spike` warnings (x70-x690 weight jumps in
one step), which were right, so the large outputs now come from a fixed de-normalisation.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import WrongAnswer, wrong  # noqa: E402
from scenarios import alarms, gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

ROOT = str(Path(__file__).resolve().parent.parent)
FP16, BF16 = torch.float16, torch.bfloat16
F16MAX = torch.finfo(FP16).max      # 65504
F16TINY = torch.finfo(FP16).tiny    # 6.1e-5, the smallest normal fp16
OPENING = 8     # the scaler's opening search: skips only before this step
FALL = 0.9


def rn(*shape, seed):
    return torch.randn(*shape, generator=gen(seed))


# --- data -----------------------------------------------------------------------------------------------------------

TEACH = rn(16, 8, seed=4343)


def cls_batch(seed, n=32, d=16, k=4):
    x = rn(n, d, seed=seed)
    return x, (torch.tanh(x) @ TEACH[:d, :k]).argmax(1)


def reg_batch(seed, n=32, d=16, scale=1.0, offset=0.0):
    """y = offset + scale * tanh(x @ w / 2): a smooth regression target of magnitude `scale` around `offset`."""
    x = rn(n, d, seed=seed)
    return x, offset + scale * torch.tanh(x[:, :d] @ TEACH[:d, 0] / 2)


def tok_batch(seed, n=16, t=8, vocab=12):
    g = gen(seed)
    tok = torch.randint(1, vocab, (n, t), generator=g)
    return tok, (2 * (tok < vocab // 2).sum(1) > t).long()


# --- models ---------------------------------------------------------------------------------------------------------

def mlp(seed, d_in=16, h=64, d_out=4, drop=0.0):
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, h), nn.GELU()] + ([nn.Dropout(drop)] if drop else []) + [nn.Linear(h, h), nn.GELU(),
                                                                                        nn.Linear(h, d_out)]
    return nn.Sequential(*layers)


class HotInput(nn.Module):
    """An un-normalised input projection whose fp16 output sits at ~20-40% of fp16's max on every batch (weights
    ~1e3, moved ~1e-3 a step by AdamW: flat for the whole run), then LayerNorm and an ordinary MLP."""

    def __init__(self, seed, d=16, h=64):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(d, h)
        with torch.no_grad():
            self.proj.weight.mul_(7900.0)
        self.ln = nn.LayerNorm(h)
        self.fc, self.head = nn.Linear(h, h), nn.Linear(h, 4)

    def forward(self, x):
        return self.head(F.gelu(self.fc(F.gelu(self.ln(self.proj(x))))))


class Denorm(nn.Module):
    """x * scale + shift: the targets' fixed de-normalisation (buffers; 0-dim, so an fp16/bf16 x stays fp16/bf16)."""

    def __init__(self, scale, shift):
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale)))
        self.register_buffer("shift", torch.tensor(float(shift)))

    def forward(self, x):
        return x * self.scale + self.shift


class RegNet(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear -> GELU -> head -> Denorm(scale, shift): the model predicts in the
    targets' own units (~scale around shift). `fp32_head`: head and Denorm run outside autocast on h.float() (a mixed
    fp32 head). `head_init` multiplies the head's initial weights."""

    def __init__(self, seed, scale, shift=0.0, d=16, h=64, fp32_head=False, head_init=1.0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.ln, self.fc2, self.head = nn.Linear(d, h), nn.LayerNorm(h), nn.Linear(h, h), nn.Linear(h, 1)
        self.out = Denorm(scale, shift)
        self.fp32_head = fp32_head
        with torch.no_grad():
            self.head.weight.mul_(head_init)
            self.head.bias.zero_()

    def forward(self, x):
        h = F.gelu(self.fc2(F.gelu(self.ln(self.fc1(x)))))
        if self.fp32_head:
            with torch.autocast("cpu", enabled=False):
                return self.out(self.head(h.float())).squeeze(-1)
        return self.out(self.head(h)).squeeze(-1)


class DeepNarrow(nn.Module):
    """12 tanh layers of width 8 (orthogonal init, gain 1.3: the signal neither dies nor explodes) and a head
    initialised ~1e-3: the targets are ~3e-3, so the loss is ~1e-5 and the true gradients ~1e-6 (fine once scaled
    by the loss scale)."""

    def __init__(self, seed, d=16, w=8, depth=12):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d, w)
        self.layers = nn.ModuleList([nn.Linear(w, w) for _ in range(depth)])
        self.head = nn.Linear(w, 1)
        for lin in self.layers:
            nn.init.orthogonal_(lin.weight, gain=1.3)
        with torch.no_grad():
            self.head.weight.mul_(0.005)
            self.head.bias.zero_()

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for lin in self.layers:
            h = torch.tanh(lin(h))
        return self.head(h).squeeze(-1)


class Temp(nn.Module):
    """logits / T; T a buffer the loop anneals from 1 to 0.1."""

    def __init__(self):
        super().__init__()
        self.register_buffer("t", torch.ones(()))

    def forward(self, x):
        return x / self.t


class FrozenHalfBN(nn.Module):
    """A frozen feature extractor kept in fp16 (its weights are fp16 parameters, requires_grad False, not in the
    optimizer), an fp16 buffer of per-feature offsets (raw sensor data ~300), BatchNorm1d (fp32 running stats, updated
    under autocast) after a trainable Linear, and a head."""

    def __init__(self, seed, d=16, h=64):
        super().__init__()
        torch.manual_seed(seed)
        self.register_buffer("offset", torch.full((d,), 300.0).half())
        self.backbone = nn.Linear(d, h).half().requires_grad_(False)
        self.fc = nn.Linear(h, h)
        self.bn = nn.BatchNorm1d(h)
        self.head = nn.Linear(h, 4)

    def forward(self, x):
        f = torch.tanh(self.backbone(x - self.offset))
        return self.head(F.relu(self.bn(self.fc(f))))


class WideHeadAttn(nn.Module):
    """One head of dimension 256 through F.scaled_dot_product_attention, masked mean pooling, classifier."""

    def __init__(self, seed, vocab=12, d=256, t=8):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.qkv, self.o, self.ln = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tok):
        h = self.emb(tok) + self.pos(torch.arange(tok.shape[1]))
        q, k, v = (z.unsqueeze(1) for z in self.qkv(h).chunk(3, -1))        # (B, 1, T, 256)
        a = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        h = self.ln(h + self.o(a))
        return self.head(h.mean(1))


# --- the loop -------------------------------------------------------------------------------------------------------

def ce(out, y):
    return F.cross_entropy(out.float(), y)


def mse(norm):
    return lambda out, y: F.mse_loss(out.float(), y) / norm


def fit(m, data, loss_fn, steps, tmp_path, *, opt, sched=None, dtype=FP16, accum=1, clip=True, watch=True,
        before=None, seed=0, init_scale=2.0 ** 16, track=()):
    """The user's loop under ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=...) at its defaults (`watch=False`:
    the same loop, the same oracle hooks, no watch): [before(i)] -> zero_grad -> `accum` micro-batches under
    autocast, each loss / accum, scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> scaler.step -> update ->
    sched.step(). Records losses, skipped steps, steps with non-finite unscaled gradients, (module, step) of
    non-finite module outputs, the unscaled gradients of every step, the per-step abs-max of the `track`ed modules'
    outputs, the final state_dict, the reports."""
    torch.manual_seed(seed)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == FP16 else None
    r = dict(losses=[], skipped=[], bad_grad=[], bad_out=[], grads=[], scaled=[], warns=[], rep=None, disk=None,
             absmax={n: [] for n in track}, scales=[])
    names = {mod: n for n, mod in m.named_modules()}
    cur = {"step": 0}

    def hook(mod, inp, out):
        if torch.is_tensor(out) and out.is_floating_point():
            if not bool(torch.isfinite(out).all()):
                r["bad_out"].append((names[mod], cur["step"]))
            n = names[mod]
            if n in r["absmax"]:
                s = r["absmax"][n]
                v = float(out.detach().abs().max())
                if len(s) == cur["step"] + 1:
                    s[-1] = max(s[-1], v)
                else:
                    s.append(v)
    hs = [mod.register_forward_hook(hook) for mod in m.modules()]
    params = [p for g in opt.param_groups for p in g["params"]]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run") if watch else None
        for i in range(steps):
            cur["step"] = i
            if before is not None:
                before(i)
            opt.zero_grad()
            tot = 0.0
            for k in range(accum):
                x, y = data(i, k)
                with torch.autocast("cpu", dtype=dtype):
                    loss = loss_fn(m(x), y) / accum
                tot += loss.item()
                (sc.scale(loss) if sc is not None else loss).backward()
            r["losses"].append(tot)
            r["scaled"].append([p.grad.detach().clone() if p.grad is not None else None for p in params])
            if sc is not None:
                r["scales"].append(sc.get_scale())
                sc.unscale_(opt)
            gs = [p.grad.detach().clone() if p.grad is not None else None for p in params]
            r["grads"].append(gs)
            if not all(bool(torch.isfinite(g).all()) for g in gs if g is not None):
                r["bad_grad"].append(i)
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
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
        for h in hs:
            h.remove()
        if w is not None:
            w.close()
            r["rep"] = w.report()
            r["disk"] = ampdoctor.diagnose(tmp_path / "run")
    r["warns"] = [str(x.message) for x in seen if str(x.message).startswith("ampdoctor")]
    r["state"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    r["dir"] = tmp_path
    return r


def healthy(r, falls=True):
    """The oracle: every loss finite, no module output non-finite, unscaled gradients non-finite only on the steps the
    scaler skipped and those only in its opening search, the loss fell (last quarter's mean below FALL x the first
    quarter's; `falls=False`: a case checks its own progress)."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)), ls
    assert r["bad_out"] == [], r["bad_out"][:10]
    assert set(r["bad_grad"]) <= set(r["skipped"]), (r["bad_grad"], r["skipped"])
    assert all(s < OPENING for s in r["skipped"]), r["skipped"]
    if falls:
        k = max(1, len(ls) // 4)
        assert sum(ls[-k:]) < FALL * sum(ls[:k]), (sum(ls[:k]) / k, sum(ls[-k:]) / k, ls)


def cli(r):
    """`python -m ampdoctor report RUN_DIR --out DIR --json FILE` (CONTRACT's CLI) on the run: (exit code, the JSON
    findings' alarms, stderr)."""
    d = r["dir"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(d / "run"), "--out", str(d / "html"),
                        "--json", str(d / "cli.json")], cwd=d, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode in (0, 1), (p.returncode, p.stderr[-2000:])     # 2 (bad input) or a crash: a plain failure
    found = json.loads((d / "cli.json").read_text())["findings"]
    return p.returncode, alarms(found), p.stderr


def judge(r):
    """ampdoctor: no warning or error in w.report() nor diagnose(run_dir), exit code 0 there and from the CLI (whose
    JSON holds no warning or error either), no `ampdoctor...` Python warning, every optimizer step recorded."""
    for rep in (r["rep"], r["disk"]):
        bad = alarms(rep.findings)
        if bad or rep.exit_code != 0 or r["warns"]:
            raise WrongAnswer(f"{bad} {r['warns']} | all: {lines(rep)}")
        assert rep.summary["steps"] == len(r["losses"]), rep.summary
    rc, bad, err = cli(r)
    if rc != 0 or bad:
        raise WrongAnswer(f"CLI exit {rc}: {bad} | {err[-500:]}")


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


def mean(xs):
    return sum(xs) / len(xs)


# --- the runs: name -> (build(tmp_path, watch) -> run dict, twin) ---------------------------------------------------

RUNS = {}


def case(twin=False):
    def deco(fn):
        RUNS[fn.__name__[4:]] = (fn, twin)
        return fn
    return deco


@case(twin=True)
def run_flat_hot_activations(tmp_path, watch=True):
    m = HotInput(1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    r = fit(m, lambda i, k: cls_batch(i % 20), ce, 80, tmp_path, opt=opt, watch=watch, track=("proj",))
    a = r["absmax"]["proj"]
    assert all(0.2 * F16MAX <= v <= 0.4 * F16MAX for v in a), (min(a), max(a))     # 20-40% of max, every step
    assert abs(mean(a[-20:]) - mean(a[:20])) < 0.03 * mean(a), (mean(a[:20]), mean(a[-20:]))   # flat: no trend
    return r


@case()
def run_warmup_growth_plateau(tmp_path, watch=True):
    m = RegNet(2, scale=1e4, head_init=0.1)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * (1 - 0.9 * max(0, s - 50) / 70))
    r = fit(m, lambda i, k: reg_batch(i % 20, scale=1e4), mse(1e8), 120, tmp_path, opt=opt, sched=sched,
            watch=watch, track=("out",))
    a = r["absmax"]["out"]
    assert mean(a[40:50]) > 30 * mean(a[:10]), (mean(a[:10]), mean(a[40:50]))                  # it grew ...
    assert abs(mean(a[60:90]) - mean(a[90:])) < 0.1 * mean(a[60:]), (mean(a[60:90]), mean(a[90:]))  # ... plateaued
    assert 0.15 * F16MAX < min(a[60:]) and max(a) < 0.4 * F16MAX, (min(a[60:]), max(a))
    return r


@case(twin=True)
def run_loss_spike_hard_batch(tmp_path, watch=True):
    m = mlp(3, d_out=1)

    def data(i, k):
        x, y = reg_batch(i % 20)
        return x, y * 10 if i == 30 else y      # one hard batch: targets 10x off
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    r = fit(m, data, lambda o, y: F.mse_loss(o.float().squeeze(-1), y), 60, tmp_path, opt=opt, watch=watch,
            init_scale=2.0 ** 12)
    ls = r["losses"]
    assert ls[30] > 100 * mean(ls[25:30]), (ls[25:31])
    assert mean(ls[33:38]) < 2 * mean(ls[25:30]), (ls[25:38])   # recovered
    return r


@case()
def run_tiny_grads_deep_narrow(tmp_path, watch=True):
    m = DeepNarrow(4)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    r = fit(m, lambda i, k: reg_batch(i % 20, scale=0.003), mse(1.0), 80, tmp_path, opt=opt, watch=watch,
            clip=False, init_scale=2.0 ** 20)
    first = [g[0] for g in r["grads"]]          # inp.weight's true gradient
    scaled = [g[0] for g in r["scaled"]]
    assert max(float(g.abs().median()) for g in first) < 1e-5, max(float(g.abs().median()) for g in first)
    assert min(float(g.abs().median()) for g in scaled) > 10 * F16TINY      # scaled: far above fp16's normal range
    return r


@case()
def run_bf16_large_targets(tmp_path, watch=True):
    m = RegNet(5, scale=2e3, shift=1e4)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    r = fit(m, lambda i, k: reg_batch(i % 20, scale=2e3, offset=1e4), mse(4e6), 60, tmp_path, opt=opt, dtype=BF16,
            watch=watch, track=("out",))
    assert min(r["absmax"]["out"]) > 8e3
    return r


@case()
def run_sgdr_restarts(tmp_path, watch=True):
    m = mlp(6)
    opt = torch.optim.SGD(m.parameters(), lr=0.4, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=20)
    r = fit(m, lambda i, k: cls_batch(i % 20), ce, 80, tmp_path, opt=opt, sched=sched, watch=watch)
    ls = r["losses"]
    for s in (20, 40):      # a jump after the restarts
        assert max(ls[s:s + 5]) > 1.5 * mean(ls[s - 4:s]), (s, ls[s - 4:s + 5])
    return r


@case(twin=True)
def run_dropout_p09(tmp_path, watch=True):
    m = mlp(7, h=256, drop=0.9)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    return fit(m, lambda i, k: cls_batch(i % 20), ce, 60, tmp_path, opt=opt, watch=watch)


@case()
def run_rl_advantage_std_clamp(tmp_path, watch=True):
    m = mlp(8)
    opt = torch.optim.Adam(m.parameters(), lr=5e-3)
    st = {"hits": [], "zero_std": 0}
    cur = {"i": 0}

    def before(i):
        cur["i"] = i

    def loss_fn(out, best):
        logp = torch.log_softmax(out.float(), -1)
        a = torch.multinomial(logp.detach().exp(), 1, generator=gen(10_000 + cur["i"])).squeeze(1)
        hit = (a == best).float()
        reward = 1.0 + 1e-4 * hit           # a near-constant reward: std ~5e-5, or exactly 0
        std = reward.std()
        st["zero_std"] += int(std == 0)
        adv = (reward - reward.mean()) / std.clamp_min(1e-8)
        st["hits"].append(float(hit.mean()))
        return -(adv * logp.gather(1, a[:, None]).squeeze(1)).mean()
    r = fit(m, lambda i, k: cls_batch(i % 20, n=8), loss_fn, 100, tmp_path, opt=opt, watch=watch, before=before)
    h = st["hits"]
    assert mean(h[-25:]) > mean(h[:25]) + 0.3, (mean(h[:25]), mean(h[-25:]))   # the policy learned
    assert st["zero_std"] >= 3, st                                             # batches of std exactly 0 met
    return r


@case()
def run_temperature_anneal(tmp_path, watch=True):
    m = nn.Sequential(*mlp(9), Temp())
    steps = 80
    r = fit(m, lambda i, k: cls_batch(i % 20), ce, steps, tmp_path, opt=torch.optim.AdamW(m.parameters(), lr=2e-3),
            watch=watch, before=lambda i: m[-1].t.fill_(0.1 ** (i / (steps - 1))), track=("5",))
    a = r["absmax"]["5"]
    assert float(m[-1].t) == pytest.approx(0.1) and mean(a[-5:]) > 4 * mean(a[:5]), (mean(a[:5]), mean(a[-5:]))
    return r


@case()
def run_frozen_fp16_backbone_bn(tmp_path, watch=True):
    m = FrozenHalfBN(10)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)

    def data(i, k):
        x, y = cls_batch(i % 20)
        return 300.0 + 0.5 * x, y       # raw sensor-like features, centred by the fp16 offset buffer
    w0 = m.backbone.weight.clone()
    r = fit(m, data, ce, 60, tmp_path, opt=opt, watch=watch)
    assert m.backbone.weight.dtype == FP16 and torch.equal(m.backbone.weight, w0) and m.offset.dtype == FP16
    assert m.bn.running_mean.dtype == torch.float32 and int(m.bn.num_batches_tracked) == 60
    return r


@case(twin=True)
def run_accum16_micro(tmp_path, watch=True):
    m = mlp(11)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return fit(m, lambda i, k: cls_batch(1000 * (i % 5) + k, n=4), ce, 40, tmp_path, opt=opt, accum=16, watch=watch)


@case(twin=True)
def run_fp32_head_beyond_fp16(tmp_path, watch=True):
    m = RegNet(12, scale=2e4, shift=1e5, fp32_head=True)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    r = fit(m, lambda i, k: reg_batch(i % 20, scale=2e4, offset=1e5), mse(4e8), 60, tmp_path, opt=opt, watch=watch,
            track=("out",))
    assert min(r["absmax"]["out"]) > 1.2 * F16MAX      # fp32 values past fp16's max, legitimately
    return r


@case()
def run_sdpa_head_dim_256(tmp_path, watch=True):
    m = WideHeadAttn(13)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return fit(m, lambda i, k: tok_batch(i % 20), ce, 60, tmp_path, opt=opt, watch=watch)


FALSE_ALARMS: dict = {  # run name -> the false finding(s) ampdoctor reported (abridged)
}
XFAIL = {name: wrong(reason) for name, reason in FALSE_ALARMS.items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=XFAIL[n]) if n in XFAIL else n for n in RUNS])
def test_healthy_training_shape(name, tmp_path):
    fn, twin = RUNS[name]
    r = fn(tmp_path)
    healthy(r, falls=name != "rl_advantage_std_clamp")
    if twin:
        same(r, fn(tmp_path / "twin", watch=False))
    judge(r)
