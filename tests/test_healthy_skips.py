"""Healthy fp16 runs whose GradScaler skips a step at a loss scale that an earlier step already stepped with (a
gradient spike), the case `replaychoice.unexplained_skip` now replays in w.report()/w.close(); and failure twins where
the one-off skip is a bug that no loss scale fixes. Real CPU loops: fp16 autocast, torch.amp.GradScaler("cpu",
init_scale, growth_interval), `ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=DIR)` at its defaults
(every=1 where said), one intra-op thread, fixed seeds, 40 steps (twins 24).

Each healthy run is first shown healthy: every loss finite and falling, at most 4 skips, at least one skip at a scale
an earlier applied step used, each such skip not finite at its own scale and finite at half of it (re-run from the
step's weights, batch and RNG), and the watch captured it so that the replay path is taken. Then: w.close() takes
< 20 s; it and w.report() leave the model (weights, buffers, grads, train flags: bitwise) and the global RNG state as
they were; w.report(), ampdoctor.diagnose(DIR) and `python -m ampdoctor report DIR --json` have no warning and no
error (CLI exit 0); no replay-*.json in DIR.

Healthy scenarios (the spike at step 17 unless said):
 1. mlp_outlier_target: MLP regression, one target off by 30 (label noise), scale 2**14 since step 0; loss outside.
 2. mlp_climbing_scale: GradScaler(init 2**10, growth_interval=4) climbs to 2**15; the outlier batch (step 22) and
    the next overflow at scales already used (a double backoff), later a probe at 2**16.
 3. heavy_tailed_input: a 4-class classifier, one sample x32 (heavy-tailed features); loss outside.
 4. attention_logit_spike: causal self-attention with a -inf triu mask, one sequence x20 (attention logits spike);
    HF-style loss inside.
 5. sdpa_logit_spike: the same through F.scaled_dot_product_attention(is_causal=True).
 6. batchnorm_outlier: Conv + BatchNorm (train mode) regression, a mislabelled image; loss inside.
 7. dropout_hf_outlier: dropout p=0.1 in an HF-style model (the replay must draw the step's own mask).
 8. dict_kwargs_outlier: dict batches passed as keyword arguments (input_ids, features, attention_mask, labels).
 9. tied_lm_padding_batch: tied embedding / LM head; one batch is almost all padding (2 real target tokens), so the
    token-mean loss gives those tokens a large gradient.
10. masked_policy_advantage: a policy whose logits mask illegal actions with -inf (masked_fill in the root's
    forward), an advantage-weighted log-likelihood loss inside, one rare large advantage (200).
11. masked_policy_mask_module: the same with the mask in its own submodule `mask`.
12. grad_accumulation: 4 micro-batches per step, one holds the outlier; loss outside.
13. two_optimizers: SGD-momentum head + AdamW body, one scaler (the watch gets the head's optimizer, whose step the
    overflow skips; the body's gradients stay finite and it steps).
14. rmsnorm_tiny_eps: hand-written RMSNorm with eps=1e-8 (never needed: no zero rows).
15. sgd_every1: SGD momentum + weight decay, zero_grad(set_to_none=False), every=1.

Failure twins (a skip at the settled scale 2**10 at step 12; not finite at any scale down to 1): the error must name
the producing module at step 12 among the first three findings of w.report() and diagnose(DIR), CLI exit 1:
 a. triplet_duplicate_pair: a triplet loss whose distance is sqrt(clamp(d2, min=0)); one positive equals its anchor:
    sqrt'(0) in the backward only -> `dist`.
 b. log_of_useless_clamp: -log(clamp(p, min=1e-8)) on fp16 probabilities, one confident mistake: p = 0 and 1e-8 is 0
    in fp16 -> `crit`.
 c. l2norm_padding_row: x / ||x|| without eps on a batch with a padding row of zeros -> `l2n`.

What ampdoctor got wrong (fixed since: the replay's outputs check takes -inf alone as a mask, as the watch does):
 - 10, 11 (masked policy logits): the replay of the skipped step 17 reports `[error] overflow at (root)
   aten::_to_copy step 17: the backward of ToCopyBackward0 in `(root)` (aten::_to_copy) produced -inf from finite
   gradients` although half the loss scale makes that step finite. ampdoctor/replay/__init__.py runs the scaler
   search (which would make it `info`, GradScaler's normal search) only when the model's outputs are finite, and
   these logits hold the -inf action mask -- which the watch itself counts as finite (StepRecord.output_finite). In
   11 the error is folded into w.report() (and diagnose/CLI exit 1) and close() saves replay-0.json; in 10 the
   report stays quiet only by coincidence (fold_replay drops the error because the watch's [info] overflow for the
   -inf mask is at the same module "" and rule), but replay-0.json holding that false error is still saved in the
   run dir.
Everything else is quiet, fast (close() well under 1 s), and leaves model and RNG bitwise unchanged."""
from __future__ import annotations

import copy
import glob
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.analysis.replaychoice import unexplained_skip

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, gen, in_top3, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP16 = torch.float16


# --- the loop and what it records --------------------------------------------------------------------------------

@dataclass
class Run:
    model: nn.Module
    w: object
    run_dir: Path
    loss_fn: object
    batch: object
    accum: int
    losses: list = field(default_factory=list)
    scales: list = field(default_factory=list)      # the loss scale each step's backward used
    skipped: list = field(default_factory=list)     # steps the scaler skipped
    snaps: dict = field(default_factory=dict)       # step -> (model state, global RNG state) at the step's start


def train(model, batch, loss_fn, run_dir, *, steps=40, init_scale=2.0 ** 10, growth_interval=2000, lr=1e-3,
          opts=None, accum=1, clip=1.0, every=None, set_to_none=True):
    """The loop people write, under `ampdoctor.watch(model, optimizer=opts[0], scaler=sc, run_dir=run_dir)`:
    zero_grad -> `accum` x (forward+loss under fp16 autocast -> scale(loss / accum).backward()) -> unscale_ each
    optimizer -> clip -> step each -> update. `batch(j)` gives micro-batch j's args, `loss_fn(model, *args)` the loss.
    The watch is NOT closed here (the tests time close()). Records each step's scale, loss and skip, and the model
    state + RNG at the start of every step (for re-running a skipped step at other scales)."""
    torch.manual_seed(0)
    opts = opts(model) if callable(opts) else [torch.optim.AdamW(model.parameters(), lr=lr)]
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    w = ampdoctor.watch(model, optimizer=opts[0], scaler=sc, run_dir=run_dir,
                        **({} if every is None else {"every": every}))
    r = Run(model, w, Path(run_dir), loss_fn, batch, accum)
    params = [p for o in opts for g in o.param_groups for p in g["params"]]
    for i in range(steps):
        r.snaps[i] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, torch.get_rng_state())
        for o in opts:
            o.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for j in range(accum):
            args = batch(i * accum + j)
            with torch.autocast("cpu", dtype=FP16):
                loss = loss_fn(model, *args) / accum
            sc.scale(loss).backward()
            total += loss.item()
        s = sc.get_scale()
        for o in opts:
            sc.unscale_(o)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        for o in opts:
            sc.step(o)
        sc.update()
        r.losses.append(total)
        r.scales.append(s)
        if sc.get_scale() < s:
            r.skipped.append(i)
    return r


def grads_finite(r: Run, step: int, scale: float) -> bool:
    """Step `step` re-run on a copy of the model from its state at that step's start (same batch, same RNG), its
    loss scaled by `scale`: are the loss and every gradient finite?"""
    m = copy.deepcopy(r.model)
    state, rng = r.snaps[step]
    m.load_state_dict(state)
    keep = torch.get_rng_state()
    torch.set_rng_state(rng)
    try:
        ok = True
        for j in range(r.accum):
            args = r.batch(step * r.accum + j)
            with torch.autocast("cpu", dtype=FP16):
                loss = r.loss_fn(m, *args) / r.accum
            ok &= bool(torch.isfinite(loss).all())
            (loss.float() * scale).backward()
    finally:
        torch.set_rng_state(keep)
    return ok and all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)


def settled_skips(r: Run):
    """The skipped steps whose loss scale an earlier, applied step had already used."""
    out = []
    for s in r.skipped:
        used = [r.scales[i] for i in range(s) if i not in r.skipped]
        if used and r.scales[s] <= max(used):
            out.append(s)
    return out


def assert_healthy(r: Run, *, fall=0.8, max_skips=4):
    """A healthy run with the one-off skips this file is about: every loss finite, falling (mean of the last fifth
    below `fall` x that of the first fifth), at least one skip at a loss scale an earlier step stepped with, at most
    `max_skips` skips after the first applied step, and each such skip is a gradient spike: not finite at its own
    scale, finite at half of it."""
    assert all(map(math.isfinite, r.losses)), r.losses
    k = max(1, len(r.losses) // 5)
    assert sum(r.losses[-k:]) / k < fall * sum(r.losses[:k]) / k, (r.losses[:k], r.losses[-k:])
    ss = settled_skips(r)
    assert ss, (r.skipped, r.scales)
    assert len(r.skipped) <= max_skips, (r.skipped, r.scales)
    for s in ss:
        assert not grads_finite(r, s, r.scales[s]), (s, r.scales[s])
        assert grads_finite(r, s, r.scales[s] / 2), (s, r.scales[s])
    # the watch saw it the same way, captured it, and the new replay path takes it
    assert [x.step for x in r.w.steps if x.skipped] == r.skipped
    assert unexplained_skip(list(r.w.steps)) is not None, [(x.step, x.scale, x.skipped, x.capture)
                                                          for x in r.w.steps]
    return ss


def state_of(model):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()})


def _bytes(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same_state(a, b):
    sa, ga, ma = a
    sb, gb, mb = b
    assert sa.keys() == sb.keys() and ma == mb
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(_bytes(sa[k]), _bytes(sb[k])), k
    for k in ga:
        assert (ga[k] is None) == (gb[k] is None), k
        if ga[k] is not None:
            assert torch.equal(ga[k], gb[k]), k


def cli_report(run_dir: Path):
    out = run_dir.parent / (run_dir.name + "-report.json")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(run_dir), "--json", str(out), "--out",
                        str(run_dir.parent / (run_dir.name + "-html"))],
                       cwd=str(run_dir.parent), env=env, capture_output=True, text=True, timeout=300)
    return p, (json.loads(out.read_text()) if out.exists() else None)


# the CLI reads the same run directory as diagnose() (plus the HTML report): run it on one scenario of each kind
# (loss outside the model, loss inside it, an -inf-masked output) to keep the file's time down
CLI_SCENARIOS = {"mlp_outlier_target", "dropout_hf_outlier", "masked_policy_mask_module"}


def judged_quiet(r: Run, cli: bool = True):
    """What this file holds a healthy run with settled-scale skips to: close() returns in < 20 s, changes neither
    the model (weights, buffers, grads, train flags: bitwise) nor the global RNG; so does report(); report(),
    diagnose(run_dir) and (with `cli`) the CLI say nothing above info (CLI exit 0); no replay-*.json in the run
    dir."""
    before, rng = state_of(r.model), torch.get_rng_state()
    t0 = time.perf_counter()
    r.w.close()
    dt = time.perf_counter() - t0
    assert dt < 20, f"close() took {dt:.1f} s"
    same_state(before, state_of(r.model))
    assert torch.equal(rng, torch.get_rng_state())
    rep = r.w.report()
    same_state(before, state_of(r.model))
    assert torch.equal(rng, torch.get_rng_state())
    assert not alarms(rep.findings), lines(rep)
    assert rep.exit_code == 0, lines(rep)
    diag = ampdoctor.diagnose(r.run_dir)
    assert not alarms(diag.findings), lines(diag)
    assert not glob.glob(str(r.run_dir / "**" / "replay-*.json"), recursive=True), os.listdir(r.run_dir)
    if cli:
        p, js = cli_report(r.run_dir)
        assert p.returncode == 0, (p.returncode, p.stderr[-2000:], js and alarms(js["findings"]))
        assert js is not None and not alarms(js["findings"])
    return rep


# --- models and data ---------------------------------------------------------------------------------------------

W16 = torch.randn(16, 1, generator=gen(7))
W4 = torch.randn(16, 4, generator=gen(4242))


def mlp(d_in=16, h=64, out=1, drop=0.0):
    return nn.Sequential(nn.Linear(d_in, h), nn.GELU(), nn.Dropout(drop), nn.Linear(h, h), nn.GELU(),
                         nn.Linear(h, out))


def regression(spikes, n=32, seed=0):
    """A linear target plus small noise; at the steps in `spikes` one example's target is off by that amount (a
    label-noise outlier)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, 16, generator=g)
        y = x @ W16 + 0.1 * torch.randn(n, 1, generator=g)
        if i in spikes:
            y[5] += spikes[i]
        return x, y
    return batch


def mse(m, x, y):
    return F.mse_loss(m(x).float(), y)


class HF(nn.Module):
    """A Hugging Face-style wrapper: forward(x, labels) -> {"loss", "logits"}."""

    def __init__(self, body, loss="mse"):
        super().__init__()
        self.body, self.kind = body, loss

    def forward(self, x, labels):
        logits = self.body(x)
        if self.kind == "mse":
            loss = F.mse_loss(logits.float(), labels)
        else:
            loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
        return {"loss": loss, "logits": logits}


def hf_loss(m, *args):
    return m(*args)["loss"]


def heavy_inputs(spikes, n=64, seed=0):
    """4-class Gaussian data; at the steps in `spikes` one example's features are that many times larger (a
    heavy-tailed sample)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        z = torch.randn(n, 16, generator=g)
        y = (z @ W4 + 0.3 * torch.randn(n, 4, generator=g)).argmax(1)
        if i in spikes:
            z[3] *= spikes[i]
        return z, y
    return batch


def ce(m, x, y):
    return F.cross_entropy(m(x).float(), y)


class AttnBlock(nn.Module):
    """One pre-norm causal self-attention block (a -inf causal mask, as nanoGPT), on continuous features."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.out = nn.Linear(d, 1)
        self.h = h

    def forward(self, x, labels):
        x = self.inp(x)
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)     # no norm before qkv: input spikes reach the logits
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        mask = torch.full((T, T), float("-inf")).triu(1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(C // self.h) + mask, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        x = x + self.mlp(self.ln2(x))
        pred = self.out(self.ln1(x))
        return {"loss": F.mse_loss(pred.float(), labels), "logits": pred}


def seq_data(spikes, B=8, T=12, seed=0):
    """Sequences of 8 features; the target is the running mean of feature 0. At the steps in `spikes`, one
    sequence's features are that many times larger (a spike in the attention logits) and its targets too."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(B, T, 8, generator=g)
        if i in spikes:
            x[1] *= spikes[i]
        y = x[..., :1].cumsum(1) / torch.arange(1, T + 1).view(1, T, 1)
        return x, y
    return batch


class BNNet(nn.Module):
    """Conv + BatchNorm (train mode) regression head that returns the loss."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                               nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(8, 1)

    def forward(self, x, labels):
        pred = self.fc(self.f(x).flatten(1))
        return {"loss": F.mse_loss(pred.float(), labels), "logits": pred}


def images(spikes, n=16, seed=0):
    """8x8 images; the target is the mean of channel 0 (x10); at the steps in `spikes` one image's target is off by
    that amount (a mislabelled example)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, 3, 8, 8, generator=g)
        y = 10 * x[:, 0].mean((1, 2)).unsqueeze(1)
        if i in spikes:
            y[2] += spikes[i]
        return x, y
    return batch


class KwModel(nn.Module):
    """Dict batches as keyword arguments (input_ids, features, attention_mask, labels) -> {"loss", "logits"}."""

    def __init__(self, V=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.feat = nn.Linear(4, d)
        self.ff = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, input_ids, features, attention_mask, labels):
        h = self.emb(input_ids) + self.feat(features)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1)
        pred = self.ff(pooled)
        return {"loss": F.mse_loss(pred.float(), labels), "logits": pred}


def kw_data(spikes, B=16, T=6, seed=0):
    def batch(i):
        g = gen(seed * 100_000 + i)
        ids = torch.randint(0, 50, (B, T), generator=g)
        f = torch.randn(B, T, 4, generator=g)
        mask = torch.ones(B, T)
        mask[:, 4:] = (torch.rand(B, 2, generator=g) > 0.5).float()
        y = (f[..., 0] * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        if i in spikes:
            y[7] += spikes[i]
        return ({"input_ids": ids, "features": f, "attention_mask": mask, "labels": y},)
    return batch


def kw_loss(m, d):
    return m(**d)["loss"]


class TiedLM(nn.Module):
    """A tiny LM whose head is the token embedding (tied weights); labels -100 are padding (ignored)."""

    def __init__(self, V=48, d=32):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.mix = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, labels):
        h = self.tok(idx)
        h = h + self.mix(h)
        logits = self.head(self.ln(h))
        return {"loss": F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100),
                "logits": logits}


def lm_data(short, B=8, T=16, V=48, seed=0):
    """Counting sequences (next token = token + stride); at the steps in `short` the batch is almost all padding
    (only that many real target tokens): the mean over a few tokens gives each of them a large gradient."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        b = torch.randint(1, 3, (B, 1), generator=g)
        s = (torch.randint(0, V, (B, 1), generator=g) + b * torch.arange(T + 1)) % V
        idx, y = s[:, :-1], s[:, 1:].clone()
        if i in short:
            y.view(-1)[short[i]:] = -100
        return idx, y
    return batch


class Policy(nn.Module):
    """A policy over 12 actions with illegal actions masked to -inf in its logits; the loss (advantage-weighted
    log-likelihood of the taken actions) is computed inside, returned HF-style."""

    def __init__(self):
        super().__init__()
        self.net = mlp(16, 64, 12)

    def forward(self, obs, legal, actions, adv):
        logits = self.net(obs).masked_fill(~legal, float("-inf"))
        logp = torch.log_softmax(logits.float(), -1).gather(1, actions[:, None]).squeeze(1)
        return {"loss": -(adv * logp).mean(), "logits": logits}


def policy_data(spikes, n=32, seed=0):
    """Legal actions: a random 8 of 12 per state; the expert's action is argmax(obs[:12]) among the legal ones, with
    an advantage in [0.5, 1.5); at the steps in `spikes` one advantage is that large (a rare big return)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        obs = torch.randn(n, 16, generator=g)
        legal = torch.rand(n, 12, generator=g).argsort(1) < 8
        good = obs[:, :12].masked_fill(~legal, -1e9).argmax(1)
        actions = good.clone()       # an expert's actions, weighted by their advantage
        adv = 0.5 + torch.rand(n, generator=g)
        if i in spikes:
            adv[4] = spikes[i]
        return obs, legal, actions, adv
    return batch


class MaskLogits(nn.Module):
    def forward(self, logits, legal):
        return logits.masked_fill(~legal, float("-inf"))


class Policy2(Policy):
    """Policy with the illegal-action mask in its own submodule (`mask`)."""

    def __init__(self):
        super().__init__()
        self.mask = MaskLogits()

    def forward(self, obs, legal, actions, adv):
        logits = self.mask(self.net(obs), legal)
        logp = torch.log_softmax(logits.float(), -1).gather(1, actions[:, None]).squeeze(1)
        return {"loss": -(adv * logp).mean(), "logits": logits}


class RMSNormNet(nn.Module):
    """A residual MLP with hand-written RMSNorms whose eps (1e-8) vanishes in fp16: no row is ever all zero here,
    so the eps never matters; the loss is returned HF-style."""

    class RMSNorm(nn.Module):
        def __init__(self, d, eps=1e-8):
            super().__init__()
            self.w, self.eps = nn.Parameter(torch.ones(d)), eps

        def forward(self, x):
            return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.n1, self.n2 = self.RMSNorm(d), self.RMSNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.out = nn.Linear(d, 1)

    def forward(self, x, labels):
        h = self.inp(x)
        h = h + self.ff(self.n1(h))
        pred = self.out(self.n2(h))
        return {"loss": F.mse_loss(pred.float(), labels), "logits": pred}


class SDPANet(nn.Module):
    """Causal attention through F.scaled_dot_product_attention(is_causal=True); loss inside."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)
        self.h = h

    def forward(self, x, labels):
        x = self.inp(x)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        pred = self.out(self.ln(x))
        return {"loss": F.mse_loss(pred.float(), labels), "logits": pred}


def two_opts(model):
    """The head on SGD with momentum, the body on AdamW: two optimizers, one scaler (the watch gets the head's, the
    one whose step the outlier's gradient overflow skips)."""
    head = list(model.body[-1].parameters()) if isinstance(model, HF) else list(model[-1].parameters())
    ids = {id(p) for p in head}
    body = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.SGD(head, lr=1e-2, momentum=0.9), torch.optim.AdamW(body, lr=3e-3)]


def sgd(model):
    return [torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9, weight_decay=1e-4)]


# name -> () -> (model, batch, loss_fn, train kwargs)
SPECS = {
    # a label-noise outlier (one target off by 30) at a scale steady since step 0
    "mlp_outlier_target": lambda: (mlp(), regression({17: 30.0}), mse, dict(init_scale=2.0 ** 14, lr=3e-3)),
    # GradScaler(init 2**10, growth_interval=4) climbs; the outlier batch overflows at a scale used 3 steps before
    "mlp_climbing_scale": lambda: (mlp(), regression({23: 60.0}), mse,
                                   dict(init_scale=2.0 ** 10, growth_interval=4, lr=3e-3)),
    # one heavy-tailed sample (x32) in a 4-class classifier, loss outside the model
    "heavy_tailed_input": lambda: (mlp(out=4), heavy_inputs({17: 32.0}), ce, dict(init_scale=2.0 ** 18, lr=3e-3)),
    # causal self-attention (-inf mask), one sequence x20: a spike in the attention logits; loss inside
    "attention_logit_spike": lambda: (AttnBlock(), seq_data({17: 20.0}), hf_loss, dict(init_scale=2.0 ** 15)),
    "sdpa_logit_spike": lambda: (SDPANet(), seq_data({17: 30.0}), hf_loss, dict(init_scale=2.0 ** 15)),
    # BatchNorm in train mode, a mislabelled image; loss inside
    "batchnorm_outlier": lambda: (BNNet(), images({17: 100.0}), hf_loss, dict(init_scale=2.0 ** 13, lr=3e-3)),
    # dropout (p=0.1) in an HF-style model: the replay must draw the step's own mask
    "dropout_hf_outlier": lambda: (HF(mlp(drop=0.1)), regression({17: 60.0}), hf_loss,
                                   dict(init_scale=2.0 ** 14, lr=3e-3)),
    # dict batches as keyword arguments
    "dict_kwargs_outlier": lambda: (KwModel(), kw_data({17: 60.0}), kw_loss, dict(init_scale=2.0 ** 14, lr=3e-3)),
    # tied embedding / LM head; one batch almost all padding (2 real target tokens)
    "tied_lm_padding_batch": lambda: (TiedLM(), lm_data({17: 2}), hf_loss, dict(init_scale=2.0 ** 15, lr=3e-3)),
    # -inf masked policy logits (illegal actions), advantage-weighted log-likelihood, one rare large advantage
    "masked_policy_advantage": lambda: (Policy(), policy_data({17: 200.0}), hf_loss,
                                        dict(init_scale=2.0 ** 14, lr=1e-2)),
    "masked_policy_mask_module": lambda: (Policy2(), policy_data({17: 200.0}), hf_loss,
                                          dict(init_scale=2.0 ** 14, lr=1e-2)),
    # gradient accumulation over 4 micro-batches, one of them with the outlier target; loss outside
    "grad_accumulation": lambda: (mlp(), regression({4 * 17 + 2: 160.0}), mse,
                                  dict(init_scale=2.0 ** 15, lr=3e-3, accum=4)),
    # two optimizers (AdamW body, SGD head), one scaler, loss inside
    "two_optimizers": lambda: (HF(mlp()), regression({17: 60.0}), hf_loss,
                               dict(init_scale=2.0 ** 14, opts=two_opts)),
    # RMSNorm with an eps that vanishes in fp16 (never needed: no zero rows)
    "rmsnorm_tiny_eps": lambda: (RMSNormNet(), regression({17: 40.0}), hf_loss, dict(init_scale=2.0 ** 13, lr=3e-3)),
    # SGD momentum, zero_grad(set_to_none=False), every=1 (full statistics on every step)
    "sgd_every1": lambda: (HF(mlp()), regression({17: 60.0}), hf_loss,
                           dict(init_scale=2.0 ** 14, opts=sgd, set_to_none=False, every=1)),
}


# --- failure twins: a one-off skip that no loss scale fixes ------------------------------------------------------

class PairDist(nn.Module):
    """Euclidean distance with a clamp(min=0) that does nothing for sqrt's gradient at 0."""

    def forward(self, a, b):
        return torch.sqrt(torch.clamp(((a.float() - b.float()) ** 2).sum(-1), min=0.0))


class Triplet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.dist = PairDist()

    def forward(self, anchor, pos, neg):
        a, p, n = self.enc(anchor), self.enc(pos), self.enc(neg)
        return F.relu(self.dist(a, p) - self.dist(a, n) + 1.0).mean()


def triplet_data(dup_step, n=32, seed=0):
    """Positives are noisy copies of the anchor; at `dup_step` one positive IS its anchor (a duplicate in the data):
    distance exactly 0, sqrt'(0) = inf in the backward."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        a = torch.randn(n, 16, generator=g)
        p = a + 0.3 * torch.randn(n, 16, generator=g)
        neg = torch.randn(n, 16, generator=g)
        if i == dup_step:
            p[6] = a[6]
        return a, p, neg
    return batch


class LogClampCrit(nn.Module):
    """-log(clamp(sigmoid(z), min=1e-8)) on fp16 probabilities: 1e-8 rounds to 0 in fp16, the clamp does nothing."""

    def forward(self, z, y):
        p = torch.sigmoid(z.half())
        p = torch.where(y > 0.5, p, 1 - p)
        return -torch.log(torch.clamp(p, min=1e-8)).float().mean()


class LogClampNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(16, 64, 1)
        self.crit = LogClampCrit()

    def forward(self, x, labels):
        return {"loss": self.crit(self.net(x), labels), "logits": None}


def binary_data(bad_step, n=32, seed=0):
    """Binary labels from a linear rule; at `bad_step` one example is a confident mistake (features x40, label
    flipped): its probability of the true label is 0 in fp16."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, 16, generator=g)
        y = (x @ W16 > 0).float()
        if i == bad_step:
            x[3] = 40 * x[3]
            y[3] = 1 - y[3]
        return x, y
    return batch


class L2Norm(nn.Module):
    """x / ||x|| per row, no eps: a padding row of zeros gives 0/0."""

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class L2Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l2n = L2Norm()
        self.net = mlp(16, 64, 4)

    def forward(self, x, labels):
        return {"loss": F.cross_entropy(self.net(self.l2n(x)).float(), labels), "logits": None}


def padded_data(pad_step, n=32, seed=0):
    def batch(i):
        g = gen(seed * 100_000 + i)
        z = torch.randn(n, 16, generator=g)
        y = (z @ W4).argmax(1)
        if i == pad_step:
            z[n - 1] = 0.0       # a padding row
        return z, y
    return batch


TWINS = {
    # (model, batch, loss, train kwargs, producing module, rules)
    "triplet_duplicate_pair": lambda: (Triplet(), triplet_data(12), lambda m, *a: m(*a),
                                       dict(init_scale=2.0 ** 10, lr=3e-3), "dist", ("overflow", "nan_origin")),
    "log_of_useless_clamp": lambda: (LogClampNet(), binary_data(12), hf_loss, dict(init_scale=2.0 ** 10, lr=3e-3),
                                     "crit", ("overflow", "nan_origin", "eps_underflow")),
    "l2norm_padding_row": lambda: (L2Net(), padded_data(12), hf_loss, dict(init_scale=2.0 ** 10, lr=3e-3),
                                   "l2n", ("nan_origin", "overflow")),
}


# --- the tests ---------------------------------------------------------------------------------------------------



@pytest.mark.parametrize("name", list(SPECS))
def test_settled_scale_skip_of_a_healthy_run_is_quiet(name, tmp_path):
    torch.manual_seed(0)
    model, batch, loss_fn, kw = SPECS[name]()
    r = train(model, batch, loss_fn, tmp_path / name, **kw)
    assert_healthy(r)
    judged_quiet(r, cli=name in CLI_SCENARIOS)


@pytest.mark.parametrize("name", list(TWINS))
def test_failure_twin_no_scale_fixes(name, tmp_path):
    torch.manual_seed(0)
    model, batch, loss_fn, kw, mod, rules = TWINS[name]()
    r = train(model, batch, loss_fn, tmp_path / name, steps=24, **kw)
    # healthy until the bad batch, which the scaler skips at the scale steps 0-11 stepped with; no scale fixes it
    assert r.skipped == [12] and settled_skips(r) == [12], (r.skipped, r.scales)
    assert all(map(math.isfinite, r.losses[:12])) and r.losses[11] < r.losses[0], r.losses
    for k in range(int(math.log2(r.scales[12])) + 1):
        assert not grads_finite(r, 12, r.scales[12] / 2 ** k), k
    t0 = time.perf_counter()
    r.w.close()
    assert time.perf_counter() - t0 < 20
    for rep in (r.w.report(), ampdoctor.diagnose(r.run_dir)):
        f = in_top3(rep, rules, mod, error_run=True)
        assert f.severity == "error" and f.step == 12, lines(rep)
    p, js = cli_report(r.run_dir)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert any(f["module"] == mod and f["severity"] == "error" and f["step"] == 12 for f in js["findings"][:3])
