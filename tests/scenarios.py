"""Training loops for watch tests: healthy models that must raise no warning/error, and failing ones built
from shared/FP16.md's patterns (not only the shipped cases). Each returns the Watch after the loop."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


def one_thread():
    """A fixture body (`@pytest.fixture(autouse=True)` in a test file: `one_thread_fixture = pytest.fixture(
    autouse=True)(one_thread)`): tiny models run faster on one intra-op thread, and do not fight a machine's
    other jobs for cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gen(i):
    return torch.Generator().manual_seed(i)


def alarms(findings):
    """The warnings and errors among findings (Finding objects or their JSON dicts), one line each."""
    return [f.one_line() if hasattr(f, "one_line") else f"{f['rule']}@{f['module']}" for f in findings
            if (f.severity if hasattr(f, "severity") else f["severity"]) in ("warning", "error")]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def amp_loop(model, batch, loss_fn, *, steps=8, every=None, lr=1e-3, run_dir=None, warmup=0, clip=1.0, call=None,
             init_scale=65536.0):
    """AdamW + GradScaler("cpu", init_scale), fp16 autocast on the CPU: backward -> unscale_ -> clip -> step ->
    update (-> a linear warmup scheduler); `batch(i)` gives step i's args, `call` runs the forward (default the
    model itself), `every=None` is ampdoctor's default sampling. Returns the closed Watch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup)) if warmup else None
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir,
                        **({} if every is None else {"every": every}))
    call = model if call is None else call
    for i in range(steps):
        opt.zero_grad()
        args = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(call(*args), *args)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        sc.step(opt)
        sc.update()
        if sched:
            sched.step()
    w.close()
    return w


EVERY = pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])  # ampdoctor's sampling, and every step


def assert_healthy(losses, scales, steps, window, must_fall, max_backoffs):
    """The run really was healthy: every loss finite, the mean of the last `steps // window` losses below
    `must_fall` times that of the first, and at most `max_backoffs` loss-scale decreases."""
    assert all(map(math.isfinite, losses)), losses
    k = max(1, steps // window)
    assert sum(losses[-k:]) / k < must_fall * sum(losses[:k]) / k, losses
    assert sum(b < a for a, b in zip(scales, scales[1:])) <= max_backoffs, scales


def lines(rep):
    return [f.one_line() for f in rep.findings]


def no_error_at(rep, modules):
    """No error finding at any of `modules` (the modules that only passed a failure on)."""
    bad = [f.one_line() for f in rep.findings if f.module in modules and f.severity == "error"]
    assert not bad, bad


def both(w, run_dir):
    """The live report and the one read back from the run directory: they must agree."""
    return (w.report(), ampdoctor.diagnose(run_dir))


def top3(rep, rule, module):
    """The finding `rule` at `module` among the report's first three (asserted; the run is an error run)."""
    got = [(f.rule, f.module) for f in rep.findings[:3]]
    assert (rule, module) in got, [f.one_line() for f in rep.findings]
    assert rep.exit_code == 1
    return next(f for f in rep.findings if (f.rule, f.module) == (rule, module))


class Block(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(C // self.h) + mask, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, d=32, n=2, T=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return {"logits": logits, "loss": F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())}


class TwoLayerNet(nn.Module):
    """8 -> 16 -> 1 with named layers (fc1, fc2): the small model of the compile and DDP tests."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                               nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                               nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.f(x).flatten(1))


def train(model, batch, loss_fn, *, steps=8, scaler=True, dtype=torch.float16, opt="adamw", lr=1e-3,
          accum=1, clip=None, correct_order=True, every=1, run_dir=None, autocast=True, eval_every=0, headroom=None):
    """The loop people write (shared/seed): backward -> unscale_ -> clip -> step -> update."""
    o = torch.optim.AdamW(model.parameters(), lr=lr) if opt == "adamw" else torch.optim.SGD(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    w = ampdoctor.watch(model, optimizer=o, scaler=sc, run_dir=run_dir, every=every, headroom=headroom)
    for i in range(steps):
        o.zero_grad()
        for _ in range(accum):
            args = batch(i)
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                loss = loss_fn(model(*args), *args) / accum
            (sc.scale(loss) if sc else loss).backward()
        if sc:
            if clip and correct_order:
                sc.unscale_(o)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            sc.step(o)
            sc.update()
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            o.step()
        if eval_every and i % eval_every == 0:
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=autocast):
                model(*batch(i))
    w.close()
    return w


def gpt_batch(seed=0, B=4, T=16, vocab=64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (B, T), generator=g)
    return lambda i: (idx, torch.roll(idx, -1, 1))


def hf_loss(out, *args):
    return out["loss"] if isinstance(out, dict) else out


def mse_to_zero(out, *args):
    return out.float().pow(2).mean()


# -- shared by the failure-probe files (tests/test_unseen_*.py) --------------------------------------------------
FP16 = dict(device_type="cpu", dtype=torch.float16)   # torch.autocast(**FP16)
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def short_loop(model, batch, loss_fn, **kw):
    """amp_loop for 8 steps from a loss scale of 1024 (a probe's failure starts at a known step; a low start
    keeps GradScaler's initial backoffs out of it)."""
    kw.setdefault("steps", 8)
    kw.setdefault("init_scale", 1024.0)
    return amp_loop(model, batch, loss_fn, **kw)


def out_mean(out, *args):
    return out.float().mean()


def mean_sq(out, *args):
    return out.float().pow(2).mean()


def first_bad(w):
    """The first step the scaler skipped, or None."""
    return next((r.step for r in w.steps if r.skipped), None)


def nonfinite_loss_steps(w):
    return [r.step for r in w.steps if r.loss_finite is False]


def in_top3(rep, rules, module, error_run=False):
    """One of `rules` at `module` among the first three findings (asserted); returns it. `error_run`: the report's
    exit code must be 1 too."""
    got = [(f.rule, f.module) for f in rep.findings[:3]]
    assert any((r, module) in got for r in rules), lines(rep)
    if error_run:
        assert rep.exit_code == 1, lines(rep)
    return next(f for f in rep.findings[:3] if f.module == module and f.rule in rules)


def healthy_run(model, batch, loss_fn, tmp_path, *, steps=40, every=None, headroom=None, opt=None, lr=1e-3, sched=None,
                clip=1.0, dtype=torch.float16, before=None, after=None, max_backoffs=3, must_fall=0.9, window=8, init_scale=65536.0,
        state=None):
    """before(i) -> zero_grad -> forward under autocast(dtype) -> scale(loss).backward -> unscale_ -> clip (the
    parameters that require grad now) -> step -> update -> sched.step -> after(i) under no_grad, under a watch
    with a run_dir (bf16: no scaler); `state["scaler"]` is the GradScaler, for a loss that needs it, and
    `state["losses"]`, `state["scales"]` the per-step series afterwards. Asserts the run was healthy; returns
    (w.report(), diagnose(run_dir)). `opt`: an optimizer or a factory of one (default AdamW at `lr`)."""
    torch.manual_seed(0)
    opt = opt(model) if callable(opt) else (opt or torch.optim.AdamW(model.parameters(), lr=lr))
    sched = sched(opt) if sched else None
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == torch.float16 else None
    if state is not None:
        state["scaler"] = sc
    rd = tmp_path / "run"
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=rd, headroom=headroom,
                        **({} if every is None else {"every": every}))
    losses, scales = [], []
    for i in range(steps):
        if before:
            before(i)
        opt.zero_grad(set_to_none=True)
        args = batch(i)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, *args)
        (sc.scale(loss) if sc else loss).backward()
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        if sched:
            sched.step()
        if after:
            with torch.no_grad():
                after(i)
        losses.append(loss.item())
        scales.append(sc.get_scale() if sc else 1.0)
    w.close()
    if state is not None:
        state.update(losses=losses, scales=scales)
    assert_healthy(losses, scales, steps, window, must_fall, max_backoffs)
    return w.report(), ampdoctor.diagnose(rd)


def quiet(reps):
    """Every report (w.report(), diagnose(run_dir), ...) has no warning or error and exit code 0."""
    for rep in reps:
        assert alarms(rep.findings) == [] and rep.exit_code == 0, [f.one_line() for f in rep.findings]


def quiet_watch(w, *, close=False, internal=False):
    """w's report (after w.close() with `close`) has no warning or error (info is fine); returns the report."""
    # `internal`: and ampdoctor watched the whole run (no internal error in the summary).
    if close:
        w.close()
    rep = w.report()
    summary = rep.to_dict()["summary"] if internal else {}
    assert not alarms(rep.findings) and not summary.get("internal_error"), [f.one_line() for f in rep.findings] + (
        [summary.get("verdict"), summary.get("internal_error")] if internal else [])
    return rep
