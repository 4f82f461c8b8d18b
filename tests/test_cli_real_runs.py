"""The CLI on REAL runs, as an external suite drives it (docs/CONTRACT.md only): a training script and its model
module are written to tmp, the script runs in its own `python` (CPU, fp16 autocast, `torch.amp.GradScaler("cpu")`
unless the case says otherwise, `ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=RUN)`), then
`python -m ampdoctor report RUN --json --out --tensorboard` and `python -m ampdoctor replay RUN/captures/<step>
--model rr_<case>:factory --json` (the model module on PYTHONPATH) run as subprocesses, and the JSON and exit codes are
judged. Each script carries its own oracle: forward (pre-)hooks on every module record the first (module, step) whose
output is inf/NaN while its inputs and own weights were finite, and the module a raising forward was inside; the log
(losses, skipped steps, clip norms, parameter dtypes) is written to a JSON file, also when the script crashes.

Cases (the producer is the oracle's, asserted in test_the_run_is_what_it_claims):
 - overflow_raw_units: a shard of raw, unstandardized prices reaches step 7; the fp16 cast in the first Linear
   `embed` overflows. Want `overflow` at `embed`, step 7, error.
 - log0_loss_head: binary cross-entropy written by hand in a loss-head module; on a 100x batch (step 5) fp16
   sigmoid rounds to 1, log(1 - p) = log(0) = -inf, 0 * -inf = NaN. Want `overflow` or `nan_origin` (the contract's
   wording fits both) at `loss_head`, step 5, error.
 - softmax_by_hand: attention with exp / sum and no max subtraction; an unnormalized batch (step 6) overflows exp.
   Want `overflow` at `attn` (README: an exp overflowing into NaN in one module is an overflow), step 6, error.
 - clip_before_unscale: clip_grad_norm_ before scaler.unscale_ (the oracle: the clip saw norms > 100, the scale in
   them). Want `clip_before_unscale`, module null, step 0, error or warning.
 - half_no_master: model.half(), SGD on the fp16 weights, no scaler. Want `fp16_master_weights` at the root ("")
   or null, step 0.
 - half_scaler_crash: model.half() with a GradScaler: unscale_ raises "Attempting to unscale FP16 gradients." at
   step 0 and the script dies. Want the crash (ValueError, step 0) in the summary and on stdout, exit 1, and
   `fp16_master_weights` among the first three.
 - crash_after_nan: batch standardization by hand ((x - mean) / std) on a padded batch of one repeated row (step 5):
   0 / 0 in `norm`; the script's guard then raises RuntimeError. Want `nan_origin` at `norm`, step 5, and the crash
   (RuntimeError, step 5), exit 1.
 - mask_minus_1e9: a padding mask filled with -1e9 in fp16; the first ragged batch (step 3) makes masked_fill raise
   inside `attn`. Want the crash (RuntimeError, step 3) and `mask_value_overflow` at `attn`, step 3, exit 1.
 - healthy_mlp / healthy_attention (torch.softmax, 2 accumulated micro-batches, LR warmup) / healthy_logits
   (binary_cross_entropy_with_logits, every=1): the loss falls, nothing non-finite. Want exit 0 and no warning or
   error (GradScaler's first backoffs are `info`), no crash.

Checks, per case:
 (a) `report --json` findings (rule, module, step, severity), in order, equal `ampdoctor.diagnose(RUN)`'s (the top
     three first, then all), and so do the summary's crash and the exit code (Report.exit_code).
 (b) exit code per CONTRACT/README: 1 with an error finding or a crash, else 0; no traceback; a crashed script's
     report says so (summary.crash with the right type/step/message, "crash" on stdout); a script that ended
     normally is not reported as crashed; healthy runs exit 0 with no warning/error.
 (c) failing runs: the case's rule at the producer's module, step and severity among the first three findings.
 (d) runs that produced inf/NaN or crashed wrote captures/<step>; `replay CAP --model rr_<case>:factory --json`
     exits 0/1 per its own findings and its top finding is the case's rule at the producer; `replay CAP` without
     --model is either a report or one `ampdoctor: ...` line with exit 2 (contract: a plain nn.Module needs --model).
 (e) `--out DIR` writes index.html (naming the producer; saying "crash" for crashed runs); a second report into
     the same DIR works with the same exit code (one run of each kind: RERUN); a foreign non-empty DIR is refused
     with exit 2 and one line, its files byte-identical and the call's --json not written.
 (f) `--tensorboard DIR` writes events.out.tfevents* files.

Budget: 11 pipelines (train, then its CLI calls) on a pool of 3 threads; 50-100 s on 2 cores (by load).

What ampdoctor did: every check passed as written; no strict xfail. Notes: the overflow in overflow_raw_units is
named at op aten::_to_copy (autocast's fp32 -> fp16 cast of inputs above 65504 inside `embed`), which is what
happened; log(0) is reported as `overflow` at aten::log in `loss_head` (the replay also lists the `nan_origin` at
aten::div after it); `fp16_master_weights` names the root ""; the healthy runs' early GradScaler backoffs wrote no
capture (README: the scaler's normal search writes none); `replay` without --model refuses with one line
("... ampdoctor never imports classes a capture names: pass model= (or --model package.module:factory)"), exit 2.
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys

import pytest

import ampdoctor
from probe_harness import ROOT, WrongAnswer, error_line, one_line_or_report, run_cli, snapshot, strict_json, wrong

# ------------------------------------------------------------------------------------------------ the scripts
# Every training script starts with PRELUDE: the oracle (forward hooks on every module: the first (module, step)
# whose output is non-finite while its inputs and own weights were finite), the user's ordinary loop `train` (fp16
# autocast + GradScaler("cpu") on the CPU under ampdoctor.watch(..., run_dir=RUN_DIR), AdamW/SGD, unscale_ -> clip
# -> step -> update unless a case asks for its mistake), and the log the oracle writes to ORACLE_FILE (also when the
# script crashes). The oracle's hooks come off before close(), whose replay of a capture runs the model again.
PRELUDE = '''
import json, math, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.nn.functional as F
import ampdoctor

torch.set_num_threads(1)
RUN_DIR, ORACLE_FILE = sys.argv[1], sys.argv[2]


def finite(x):
    if torch.is_tensor(x):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        return all(finite(t) for t in x)
    return True


class Oracle:
    def __init__(self, model):
        self.step, self.first, self.stack = 0, None, []
        self.hs = [mod.register_forward_hook(self._hook(n)) for n, mod in model.named_modules()]
        self.hs += [mod.register_forward_pre_hook(self._enter(n)) for n, mod in model.named_modules()]

    def _enter(self, n):
        def f(mod, inp):
            self.stack.append(n)
        return f

    def _hook(self, n):
        def f(mod, inp, out):
            if self.stack and self.stack[-1] == n:
                self.stack.pop()
            if (self.first is None and finite(inp) and finite(list(mod.parameters(recurse=False)))
                    and not finite(out)):
                self.first = [n, self.step]
        return f


LOG = {"first": None, "bad_loss": [], "skipped": [], "losses": [], "clip_norms": [], "scales": [],
       "param_dtypes": []}


def save(orc):
    for h in orc.hs:
        h.remove()
    LOG["first"] = orc.first
    LOG["open"] = orc.stack                             # the modules a forward that raised was inside
    with open(ORACLE_FILE, "w") as f:
        json.dump(LOG, f)


def train(model, batch, loss_fn, steps=12, *, opt="adamw", lr=1e-3, clip="after", use_scaler=True, half=False,
          accum=1, warmup=0, crash_on_nan=False, every=None):
    if half:
        model.half()                                    # the whole model in fp16, no fp32 master copy
    opt = (torch.optim.AdamW(model.parameters(), lr=lr) if opt == "adamw"
           else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    LOG["param_dtypes"] = sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup)) if warmup else None
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=RUN_DIR,
                        **({} if every is None else {"every": every}))
    orc = Oracle(model)
    try:
        for i in range(steps):
            orc.step = i
            opt.zero_grad()
            total = 0.0
            for k in range(accum):
                args, y = batch(i, k)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(*args)
                    loss = loss_fn(out, y) / accum
                total += loss.item()
                (scaler.scale(loss) if scaler else loss).backward()
            LOG["losses"].append(total)
            if not math.isfinite(total):
                LOG["bad_loss"].append(i)
            s0 = scaler.get_scale() if scaler else None
            LOG["scales"].append(s0)
            if clip == "before":                        # the mistake: the gradients are still scaled here
                LOG["clip_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            if scaler:
                if clip == "after":
                    scaler.unscale_(opt)
                    LOG["clip_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() < s0:
                    LOG["skipped"].append(i)
            else:
                if clip == "after":
                    LOG["clip_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
                opt.step()
            if sched is not None:
                sched.step()
            if crash_on_nan and not math.isfinite(total):
                raise RuntimeError(f"loss is {total} at step {i}, giving up")
    finally:
        save(orc)
    w.close()


def gen(seed):
    return torch.Generator().manual_seed(seed)
'''

# name -> (the model module rr_<name>.py, the script's body after PRELUDE)
SOURCES = {
    # A batch whose features were never standardized (prices in cents) reaches step 7: the first Linear's fp16
    # output overflows.
    "overflow_raw_units": ('''
import torch
from torch import nn


class PriceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 32)
        self.act = nn.GELU()
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.act(self.embed(x)))


def factory():
    torch.manual_seed(0)
    return PriceNet()
''', '''
from rr_overflow_raw_units import factory

W = torch.randn(6, 1, generator=gen(7))


def batch(i, k):
    x = torch.randn(16, 6, generator=gen(100 + i))
    y = x @ W
    if i == 7:                                  # this shard was never standardized: raw prices in cents
        x = x.abs() * 1e5 + 5e4
    return (x,), y


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y))
'''),
    # Binary cross-entropy written by hand in a loss-head module: sigmoid rounds to exactly 1.0 in fp16 on a batch
    # of large features (step 5), log(1 - p) = log(0) = -inf, and 0 * -inf = NaN.
    "log0_loss_head": ('''
import torch
from torch import nn


class BCEByHand(nn.Module):
    def forward(self, logits, y):
        p = torch.sigmoid(logits)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
        self.loss_head = BCEByHand()

    def forward(self, x, y):
        return self.loss_head(self.body(x).squeeze(-1), y)


def factory():
    torch.manual_seed(0)
    return Classifier()
''', '''
from rr_log0_loss_head import factory

W = torch.randn(10, generator=gen(3))


def batch(i, k):
    x = torch.randn(32, 10, generator=gen(200 + i))
    y = (x @ W > 0).float()
    if i == 5:                                  # a sensor glitch: this batch is 100x too large
        x = x * 100
    return (x, y), None


train(factory(), batch, lambda out, y: out.float())
'''),
    # Attention with a softmax written by hand (exp / sum, no max subtraction) in a small time-series transformer:
    # an unnormalized batch at step 6 makes scores > 11.1, exp overflows fp16, inf / inf = NaN inside `attn`.
    "softmax_by_hand": ('''
import math
import torch
from torch import nn


class HandAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.d)
        e = torch.exp(s)                        # softmax by hand, no max subtraction
        a = e / e.sum(dim=-1, keepdim=True)
        return self.proj(a @ v)


class SensorTransformer(nn.Module):
    def __init__(self, f=4, d=32):
        super().__init__()
        self.embed = nn.Linear(f, d)
        self.attn = HandAttention(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.attn(h))
        return self.head(h.mean(1))


def factory():
    torch.manual_seed(0)
    return SensorTransformer()
''', '''
from rr_softmax_by_hand import factory


def batch(i, k):
    x = torch.randn(8, 12, 4, generator=gen(300 + i))
    y = x.mean(dim=(1, 2)).unsqueeze(-1)
    if i == 6:                                  # readings in raw units
        x = x * 20
    return (x,), y


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y))
'''),
    # clip_grad_norm_ on the scaled gradients (no unscale_ before it): the clip sees the loss scale, not the norm.
    "clip_before_unscale": ('''
import torch
from torch import nn


def factory():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
''', '''
from rr_clip_before_unscale import factory

W = torch.randn(8, 1, generator=gen(5))


def batch(i, k):
    x = torch.randn(16, 8, generator=gen(400 + i % 4))
    return (x,), x @ W


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y), clip="before")
'''),
    # model.half() with the optimizer on the fp16 parameters; no GradScaler (it refuses fp16 gradients), SGD.
    "half_no_master": ('''
import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def factory():
    torch.manual_seed(0)
    return Regressor()
''', '''
from rr_half_no_master import factory

W = torch.randn(8, 1, generator=gen(6))


def batch(i, k):
    x = torch.randn(16, 8, generator=gen(500 + i % 4))
    return (x.half(),), (x @ W)


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y), half=True, use_scaler=False, opt="sgd")
'''),
    # model.half() with a GradScaler: scaler.unscale_ raises "Attempting to unscale FP16 gradients." at step 0.
    "half_scaler_crash": ('''
import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def factory():
    torch.manual_seed(0)
    return Regressor()
''', '''
from rr_half_scaler_crash import factory

W = torch.randn(8, 1, generator=gen(6))


def batch(i, k):
    x = torch.randn(16, 8, generator=gen(500 + i % 4))
    return (x.half(),), (x @ W)


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y), half=True, opt="sgd")
'''),
    # Batch standardization written by hand ((x - mean) / std) on a batch of 16 copies of one row (a padded last
    # batch) at step 5: std = 0, 0 / 0 = NaN inside `norm`; the script's own guard then raises after that step.
    "crash_after_nan": ('''
import torch
from torch import nn


class Standardize(nn.Module):
    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)


class TabNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(12, 24)
        self.norm = Standardize()
        self.act = nn.ReLU()
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        return self.head(self.act(self.norm(self.enc(x))))


def factory():
    torch.manual_seed(0)
    return TabNet()
''', '''
from rr_crash_after_nan import factory


def batch(i, k):
    x = torch.randn(16, 12, generator=gen(600 + i))
    if i == 5:                                  # the padded last batch: one sample repeated
        x = x[:1].repeat(16, 1)
    return (x,), (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


train(factory(), batch, lambda out, y: F.cross_entropy(out.float(), y), crash_on_nan=True)
'''),
    # A padding mask filled with -1e9 (fine in fp32, out of fp16's range): the first ragged batch (step 3) makes
    # masked_fill raise "value cannot be converted to type c10::Half without overflow" inside `attn`; the script dies.
    "mask_minus_1e9": ('''
import math
import torch
from torch import nn


class MaskedAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.d)
        if pad.any():
            s = s.masked_fill(pad[:, None, :], -1e9)
        return self.proj(torch.softmax(s, dim=-1) @ v)


class SensorTransformer(nn.Module):
    def __init__(self, f=4, d=32):
        super().__init__()
        self.embed = nn.Linear(f, d)
        self.attn = MaskedAttention(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x, pad):
        h = self.embed(x)
        h = self.norm(h + self.attn(h, pad))
        return self.head(h.mean(1))


def factory():
    torch.manual_seed(0)
    return SensorTransformer()
''', '''
from rr_mask_minus_1e9 import factory


def batch(i, k):
    x = torch.randn(8, 12, 4, generator=gen(700 + i))
    pad = torch.zeros(8, 12, dtype=torch.bool)
    if i >= 3:                                  # the first ragged batch: the last 4 positions of each row padded
        pad[:, 8:] = True
    return (x, pad), x.mean(dim=(1, 2)).unsqueeze(-1)


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y))
'''),
    # Healthy: standardized regression, the ordinary loop.
    "healthy_mlp": ('''
import torch
from torch import nn


class PriceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 32)
        self.act = nn.GELU()
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.act(self.embed(x)))


def factory():
    torch.manual_seed(0)
    return PriceNet()
''', '''
from rr_healthy_mlp import factory

W = torch.randn(6, 1, generator=gen(7))


def batch(i, k):
    x = torch.randn(16, 6, generator=gen(100 + i % 4))
    return (x,), x @ W


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y), lr=3e-2)
'''),
    # Healthy: the time-series transformer with torch.softmax, 2 micro-batches accumulated, LR warmup.
    "healthy_attention": ('''
import math
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.d), dim=-1)
        return self.proj(a @ v)


class SensorTransformer(nn.Module):
    def __init__(self, f=4, d=32):
        super().__init__()
        self.embed = nn.Linear(f, d)
        self.attn = Attention(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.attn(h))
        return self.head(h.mean(1))


def factory():
    torch.manual_seed(0)
    return SensorTransformer()
''', '''
from rr_healthy_attention import factory


def batch(i, k):
    x = torch.randn(8, 12, 4, generator=gen(300 + (2 * i + k) % 6))
    return (x,), x.mean(dim=(1, 2)).unsqueeze(-1) * 4


train(factory(), batch, lambda out, y: F.mse_loss(out.float(), y), accum=2, warmup=3, lr=3e-3)
'''),
    # Healthy: the classifier with the stable loss (binary_cross_entropy_with_logits), every step recorded.
    "healthy_logits": ('''
import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)


def factory():
    torch.manual_seed(0)
    return Classifier()
''', '''
from rr_healthy_logits import factory

W = torch.randn(10, generator=gen(3))


def batch(i, k):
    x = torch.randn(32, 10, generator=gen(200 + i % 4))
    return (x,), (x @ W > 0).float()


train(factory(), batch, lambda out, y: F.binary_cross_entropy_with_logits(out.float(), y), every=1, lr=1e-2)
'''),
}

# name -> what the run is. producer: the oracle's first (module, step), None for none; rules: the accepted rule ids
# of the cause and module/step/severities it must have among the first three findings (module None: no module
# applies); crash: the script dies on an exception; capture: a capture must be written (a step produced inf/NaN).
CASES = {
    "overflow_raw_units": dict(producer=["embed", 7], rules=("overflow",), module="embed", step=7,
                               severity=("error",), crash=False, capture=True),
    # log(0) = -inf from a finite 0 (an inf from finite inputs, `overflow`) and then 0 * -inf = NaN (`nan_origin`):
    # the contract's wording fits either; the module and step are what matter.
    "log0_loss_head": dict(producer=["loss_head", 5], rules=("nan_origin", "overflow"), module="loss_head", step=5,
                           severity=("error",), crash=False, capture=True),
    # README: "an exp that overflowed into a NaN inside one module is an overflow at that op, not a nan_origin".
    "softmax_by_hand": dict(producer=["attn", 6], rules=("overflow",), module="attn", step=6, severity=("error",),
                            crash=False, capture=True),
    "clip_before_unscale": dict(producer=None, rules=("clip_before_unscale",), module=None, step=0,
                                severity=("error", "warning"), crash=False, capture=False),
    # No single layer is at fault: the root ("") or no module (null) both say so.
    "half_no_master": dict(producer=None, rules=("fp16_master_weights",), module=("", None), step=0,
                           severity=("error", "warning"), crash=False, capture=False),
    "half_scaler_crash": dict(producer=None, rules=("fp16_master_weights",), module=("", None), step=0,
                              severity=("error", "warning"), crash=("ValueError", 0, "unscale FP16"), capture=False),
    "crash_after_nan": dict(producer=["norm", 5], rules=("nan_origin",), module="norm", step=5, severity=("error",),
                            crash=("RuntimeError", 5, "giving up"), capture=True),
    "mask_minus_1e9": dict(producer=None, rules=("mask_value_overflow",), module="attn", step=3, severity=("error",),
                           crash=("RuntimeError", 3, "without overflow"), capture=True),
    "healthy_mlp": dict(producer=None, rules=None, crash=False, capture=False),
    "healthy_attention": dict(producer=None, rules=None, crash=False, capture=False),
    "healthy_logits": dict(producer=None, rules=None, crash=False, capture=False),
}
FAILING = [n for n, c in CASES.items() if c["rules"]]
CAPTURED = [n for n, c in CASES.items() if c["capture"]]
# the runs whose report is written a second time into the same --out dir (one of each kind; the HTML costs ~3 s)
RERUN = ("overflow_raw_units", "clip_before_unscale", "crash_after_nan", "healthy_attention")

# (check, case) -> the reason of a strict xfail (ampdoctor answered wrongly; see the module docstring).
WRONG = {}


def cases(check, names=tuple(CASES)):
    """`names` as pytest params, those ampdoctor answers wrongly for `check` marked wrong(reason)."""
    return [pytest.param(n, marks=wrong(WRONG[(check, n)])) if (check, n) in WRONG else n for n in names]


def need(ok, msg):
    """A check of ampdoctor's answer: WrongAnswer (the only failure a `wrong` mark accepts) when it fails."""
    if not ok:
        raise WrongAnswer(msg)


def key(f):
    return (f["rule"], f["module"], f["step"], f["severity"])


# ------------------------------------------------------------------------------------------------ running it all
def _pipeline(helpers, t, name):
    """Train `name`'s script, then every CLI call on its run dir, one after the other; a dict of the results."""
    d = t / name
    d.mkdir()
    rd, orc = d / "run", d / "oracle.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, helpers["dir"]]), OMP_NUM_THREADS="1")
    r = {"rd": rd, "d": d}
    r["train"] = subprocess.run([sys.executable, str(d.parent / "scripts" / f"train_{name}.py"), str(rd), str(orc)],
                                cwd=d, env=env, capture_output=True, text=True, timeout=240)
    r["oracle"] = json.loads(orc.read_text()) if orc.exists() else None
    if not (rd / "manifest.json").exists():
        return r

    def cli(*args):
        return run_cli(helpers, *args, cwd=d)
    r["report"] = cli("report", rd, "--json", d / "a.json", "--out", d / "html", "--tensorboard", d / "tb")
    r["html_first"] = (d / "html" / "index.html").exists()
    if name in RERUN:
        r["report2"] = cli("report", rd, "--json", d / "b.json", "--out", d / "html")
    foreign = d / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("the user's own notes")
    (foreign / "index.html").write_text("<p>the user's own page</p>")
    r["foreign_before"] = snapshot(foreign)
    r["foreign"] = cli("report", rd, "--out", foreign, "--json", d / "c.json")
    r["foreign_after"] = snapshot(foreign)
    caps = sorted((rd / "captures").iterdir(), key=lambda p: p.name) if (rd / "captures").is_dir() else []
    r["captures"] = [c.name for c in caps]
    if caps:
        cap = caps[0]
        r["replay"] = cli("replay", cap, "--model", f"rr_{name}:factory", "--json", d / "r.json", "--no-html")
        r["replay_bare"] = cli("replay", cap, "--json", d / "r0.json", "--no-html")
    rep = ampdoctor.diagnose(str(rd))
    r["diag"], r["diag_exit"] = rep.to_dict(), rep.exit_code
    r["json"] = strict_json(d / "a.json") if (d / "a.json").exists() else None
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    t = tmp_path_factory.mktemp("real_runs")
    helpers = {"dir": str(t / "models")}
    (t / "models").mkdir()
    (t / "scripts").mkdir()
    for name, (model_src, body) in SOURCES.items():
        (t / "models" / f"rr_{name}.py").write_text(model_src)
        (t / "scripts" / f"train_{name}.py").write_text(PRELUDE + body)
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as ex:
        futs = {n: ex.submit(_pipeline, helpers, t, n) for n in CASES}
        return {n: f.result() for n, f in futs.items()}


# ------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name", list(CASES))
def test_the_run_is_what_it_claims(runs, name):
    """The oracle: the script ran (crashed only where it should), the producer is the one the case names."""
    r, c = runs[name], CASES[name]
    p = r["train"]
    assert p.returncode == (1 if c["crash"] else 0), p.stderr[-3000:]
    if c["crash"]:
        assert "Traceback" in p.stderr and ("Error" in p.stderr.splitlines()[-1]), p.stderr[-2000:]
    o = r["oracle"]
    assert o is not None and o["first"] == c["producer"], (o, p.stderr[-2000:])
    assert (r["rd"] / "manifest.json").exists(), os.listdir(r["rd"])
    if c["producer"] is not None:
        assert o["bad_loss"] and o["bad_loss"][0] == c["producer"][1], o
    else:
        assert o["bad_loss"] == [] and all(map(math.isfinite, o["losses"])), o
    if name.startswith("healthy"):
        assert sum(o["losses"][-3:]) < 0.9 * sum(o["losses"][:3]), o["losses"]
    if name == "clip_before_unscale":                 # the clip saw scaled gradients (norm ~ scale x the real one)
        assert min(o["clip_norms"]) > 100 and o["scales"][0] >= 1024, o
    if name.startswith("half"):
        assert o["param_dtypes"] == ["torch.float16"], o
    if name == "mask_minus_1e9":                      # the forward raised inside attn, at masked_fill
        assert o["open"][-1] == "attn" and len(o["losses"]) == 3 and "masked_fill" in p.stderr, (o, p.stderr[-1500:])
    else:
        assert o["open"] == [], o


@pytest.mark.parametrize("name", cases("agree"))
def test_cli_json_agrees_with_diagnose(runs, name):
    """(a) `report --json` gives the findings ampdoctor.diagnose(run_dir) gives in-process."""
    r = runs[name]
    assert r["diag"] is not None
    need(r["json"] is not None, f"no --json file: rc {r['report'].returncode} {r['report'].stderr[-2000:]}")
    cli_f, api_f = [key(f) for f in r["json"]["findings"]], [key(f) for f in r["diag"]["findings"]]
    need(cli_f[:3] == api_f[:3], f"top three differ: CLI {cli_f[:3]} vs diagnose {api_f[:3]}")
    need(cli_f == api_f, f"findings differ: CLI {cli_f} vs diagnose {api_f}")
    need(r["json"]["summary"].get("crash") == r["diag"]["summary"].get("crash"),
         f"crash: CLI {r['json']['summary'].get('crash')} vs diagnose {r['diag']['summary'].get('crash')}")
    need(r["report"].returncode == r["diag_exit"],
         f"exit {r['report'].returncode} vs Report.exit_code {r['diag_exit']}")


@pytest.mark.parametrize("name", cases("exit"))
def test_exit_code_per_contract(runs, name):
    """(b) exit 1 with an error finding or a crash, else 0; failing runs exit 1, healthy ones 0 with no warning or
    error; a crashed run says so."""
    r, c = runs[name], CASES[name]
    p, d = r["report"], r["json"]
    need("Traceback" not in p.stderr, p.stderr[-3000:])
    need(d is not None, f"no JSON: rc {p.returncode}: {p.stderr[-2000:]}")
    errors = [key(f) for f in d["findings"] if f["severity"] == "error"]
    crash = d["summary"].get("crash")
    need(p.returncode == (1 if errors or crash else 0), f"exit {p.returncode}, errors {errors}, crash {crash}")
    if c["crash"]:
        need(bool(crash) and p.returncode == 1 and "crash" in p.stdout.lower(),
             f"crashed script: exit {p.returncode}, summary crash {crash!r}, stdout {p.stdout[:600]!r}")
        typ, step, msg = c["crash"]
        need((crash["type"], crash["step"]) == (typ, step) and msg in crash["message"],
             f"crash {crash}, want {typ} at step {step} ({msg!r})")
    else:
        need(not crash, f"a script that ended normally reported as crashed: {crash}")
    if c["rules"] is None:
        alarms = [key(f) for f in d["findings"] if f["severity"] in ("warning", "error")]
        need(p.returncode == 0 and not alarms and not crash, f"healthy run: exit {p.returncode}, {alarms}, {crash}")
    else:
        need(bool(errors) or c["severity"] != ("error",), f"failing run without an error: {d['findings']}")


@pytest.mark.parametrize("name", cases("cause", FAILING))
def test_names_the_cause_at_the_producer(runs, name):
    """(c) the case's rule at the producer (the oracle's module), step and severity, among the first three."""
    c, d = CASES[name], runs[name]["json"]
    need(d is not None, "no JSON")
    top = [key(f) for f in d["findings"][:3]]
    modules = c["module"] if isinstance(c["module"], tuple) else (c["module"],)
    hit = [f for f in d["findings"][:3] if f["rule"] in c["rules"] and f["module"] in modules]
    need(hit, f"want {c['rules']} at {c['module']!r} among the first three, got {top}")
    f = hit[0]
    need(c["step"] is None or f["step"] == c["step"], f"step {f['step']}, want {c['step']}: {top}")
    need(f["severity"] in c["severity"], f"severity {f['severity']}, want {c['severity']}: {top}")


@pytest.mark.parametrize("name", cases("replay", CAPTURED))
def test_replay_of_the_capture(runs, name):
    """(d) the capture was written; `replay CAP --model mod:factory --json` exits 0/1 per its findings and its top
    finding names the producer; without --model it works or is one line, exit 2."""
    r, c = runs[name], CASES[name]
    need(r.get("captures"), f"no capture under {r['rd']}/captures")
    need(str(c["step"]) in r["captures"], f"captures {r['captures']}, want one of step {c['step']}")
    p = r["replay"]
    need("Traceback" not in p.stderr and p.returncode in (0, 1), f"exit {p.returncode}: {p.stderr[-2000:]}")
    d = strict_json(r["d"] / "r.json")
    need(d["findings"], "the replay found nothing")
    errors = any(f["severity"] == "error" for f in d["findings"])
    need(p.returncode == (1 if errors else 0), f"exit {p.returncode} with errors={errors}")
    need(d["findings"][0]["rule"] in c["rules"] and d["findings"][0]["module"] == c["module"],
         f"replay's top finding {key(d['findings'][0])}, want {c['rules']} at {c['module']!r}: "
         f"{[key(f) for f in d['findings'][:3]]}")
    try:
        one_line_or_report(r["replay_bare"], [r["d"] / "r0.json"] if r["replay_bare"].returncode != 2 else [])
    except AssertionError as e:
        raise WrongAnswer(f"replay without --model: {e}") from None


@pytest.mark.parametrize("name", cases("out"))
def test_out_dir_html_rerun_and_foreign(runs, name):
    """(e) --out writes index.html; a second report into the same (ampdoctor's) dir works; a foreign non-empty dir
    is refused: exit 2, one line, its files untouched."""
    r = runs[name]
    p1 = r["report"]
    need(p1.returncode in (0, 1) and r["html_first"], f"first --out: exit {p1.returncode} {p1.stderr[-1500:]}")
    page = (r["d"] / "html" / "index.html").read_text(encoding="utf-8")
    c = CASES[name]
    if isinstance(c.get("module"), str):
        need(f"{c['module']}" in page, f"index.html does not name `{c['module']}`")
    if c["crash"]:
        need("crash" in page.lower(), "index.html of a crashed run does not say it crashed")
    if name in RERUN:
        p2 = r["report2"]
        need(p2.returncode == p1.returncode and (r["d"] / "html" / "index.html").exists(),
             f"second --out into ampdoctor's own dir: exit {p2.returncode} {p2.stderr[-1500:]}")
    try:
        line = error_line(r["foreign"])
    except AssertionError as e:
        raise WrongAnswer(f"foreign --out dir: {e}") from None
    need(r["foreign_after"] == r["foreign_before"], "the foreign dir changed")
    need(not (r["d"] / "c.json").exists(), f"the refused call still wrote --json ({line})")


@pytest.mark.parametrize("name", cases("tb"))
def test_tensorboard_event_files(runs, name):
    """(f) --tensorboard DIR writes event files."""
    tb = runs[name]["d"] / "tb"
    files = [f for _, _, fs in os.walk(tb) for f in fs] if tb.is_dir() else []
    need(any(f.startswith("events.out.tfevents") for f in files), f"no event files under {tb}: {files}")
