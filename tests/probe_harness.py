"""Test harness shared by the probe files (test_unseen_variants*, ...): one definition each of the pieces they had
copied from one another. It owns

- `finite`: is a (nested) output all finite;
- `Producer`: the forward/backward "producer oracle" (hooks naming the first module whose output, or gradient, is
  non-finite from finite inputs), with the variants the files use as keyword options;
- `train_loop`: the ordinary fp16 autocast + GradScaler loop under ampdoctor.watch that reports what the oracle saw;
- `probe_run`: the unseen-variant probes' loop (its hooks: injections, a mid-run report, an export before close, the
  unwatched twin), `WrongAnswer` and `wrong` (a strict xfail for a wrong report only);
- `healthy`, `twin_checks`, `real_fwd`, `real_bwd`, `failure_oracle`: checks that a run was really healthy / really
  failed where the oracle says;
- `snap_before`: train_loop's after_step callback keeping the weights a given step's forward ran with;
- `at_top3`, `error_at`, `named_top3`, `producer_top3`: checks that a report names a rule at a module among its first
  three findings (`producer_top3`: and no module that only passed the value on);
- the HF failure files' loop and checks (test_hf_failures3/4, ...): `hf_train`, `first_bad_log`, `falls`,
  `fp16_accelerator` (the body of their `fp16_on_cpu` fixture);
- `xf`: a strict xfail mark;
- `tag_line`, `expect`, `quiet_report`: the loop-misuse files' checks of a report against `# @tag` lines;
- `variant_run`, `variant_named_at_producer`, `variant_twin_quiet` (+ `same_bits`, `variant_fp32_loss`): the
  unseen-variant sets' case run, its check at the producer and its twin's check;
- `HealthyLoop`, `healthy_run`, `same_run`, `quiet_healthy`: the healthy probes' loop, its watched and unwatched
  runs, the bitwise comparison of the two and the check that the report is quiet;
- `misuse_net`, `misuse_batch`: the loop-misuse files' small regression model and its data; `misuse_run`,
  `misuse_both`: their runner, watched and unwatched;
- `DynamicLossScaler`: fairseq's loss scaler, for loops that keep their own loss scale (no GradScaler);
- the hostile-input files' harness (test_hostile_*): `snapshot` (hashes of what a probe guards), `stderr_lines`,
  `error_line`, `no_traceback`, `one_line_or_report` (the CLI's answer to bad input), `strict_json`, `copy`,
  `records_raw` / `write_raw` / `edit_record` / `edit_manifest` (run-dir and capture surgery), `load_models` (a
  helper module on the subprocesses' PYTHONPATH), `run_cli`, `case_registry` / `run_cases` (CLI calls set up by
  builders, run on a small pool), `train_overflow` / `finite_oracle` / `overflow_run` (the real MLP run whose first
  Linear overflows fp16).

Generic report helpers (one_thread, alarms, lines, in_top3, quiet, ...) stay in scenarios.py; nothing here is a test.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import copy as _copy
import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import ampdoctor
from scenarios import alarms, in_top3, lines, randn


class MisuseNet(torch.nn.Module):
    """The loop-misuse files' model (test_loop_misuse7/8/9): Linear(8, 32) -> ReLU -> Linear(32, 1)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class DynamicLossScaler:
    """fairseq's DynamicLossScaler: halve on overflow, double after `window` clean iterations (the loop skips the
    optimizer step itself on an overflow)."""

    def __init__(self, init_scale, window=8):
        self.scale, self.window, self.it, self.last = init_scale, window, 0, -1

    def update(self, overflow):
        if overflow:
            self.scale /= 2
            self.last = self.it
        elif (self.it - self.last) % self.window == 0:
            self.scale *= 2
        self.it += 1


def misuse_net(seed=0):
    torch.manual_seed(seed)
    return MisuseNet()


MISUSE_W = randn(8, 1, seed=999) * 0.5


def misuse_batch(i, cycle=4):
    """A learnable regression batch for MisuseNet: y = x @ MISUSE_W (`cycle` distinct batches, cycled; None: a new
    batch every step)."""
    x = randn(16, 8, seed=i % cycle if cycle else i)
    return x, x @ MISUSE_W


def misuse_scaler(init=1024.0, **kw):
    """The loop-misuse files' GradScaler (CPU, init scale 1024 unless given)."""
    return torch.amp.GradScaler("cpu", init_scale=init, **kw)


def misuse_loss(m, i, reduction="mean"):
    """MisuseNet's fp16-autocast MSE loss on misuse_batch(i)."""
    x, y = misuse_batch(i)
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        out = m(x)
    return torch.nn.functional.mse_loss(out.float(), y, reduction=reduction)


def misuse_true_grads(m, idx, loss=misuse_loss, prep=None):
    """The unscaled gradients of `loss` over batches `idx` at m's weights, on a copy (its module hooks dropped;
    `prep(copy)` first when given)."""
    c = _copy.deepcopy(m)
    if prep is not None:
        prep(c)
    for mod in c.modules():
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
        mod._backward_hooks.clear()
        mod._backward_pre_hooks.clear()
    c.zero_grad(set_to_none=True)
    for i in idx:
        loss(c, i).backward()
    return [p.grad.detach().clone() for p in c.parameters()]


def misuse_weights(m):
    """A copy of m's parameters."""
    return [p.detach().clone() for p in m.parameters()]


def gnorm(gs):
    """The total norm of a list of gradients (None skipped), by hand: no clipping API, whose calls ampdoctor records
    (the loop-misuse files)."""
    gs = [g for g in gs if g is not None]
    return float(torch.stack([g.detach().float().norm() for g in gs]).norm()) if gs else 0.0


def finite(x):
    """Whether every floating tensor in x (a tensor, or tuples/lists/dicts/ModelOutputs of them) is finite."""
    if torch.is_tensor(x):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        return all(finite(t) for t in x)
    if isinstance(x, dict) or hasattr(x, "keys") and hasattr(x, "values"):  # dicts and ModelOutputs
        return all(finite(t) for t in x.values())
    return True


def _grads(gs):
    return [g for g in gs if g is not None]


class Producer:
    """Forward hooks on every module: the first (module, step) whose output is non-finite while its inputs were finite
    (`first`; hooks fire children first, so the first hit is the innermost producer). `own_params=True`: its own
    parameters must be finite too; `own_params=False`: it counts anyway and `bad_weights` names it where they were
    not. `call_in_first`: `first` is (module, step, call), `call` counting the module's calls in that step from 1.
    `stack`: forward pre-hooks keep the modules running now (`stack`: the innermost module when a forward raised).

    `backward=True`: full backward pre-hooks note whether the gradient reaching each module's outputs is finite; full
    backward hooks and tensor hooks on each module's own parameters then name the first (module, step) whose gradient
    w.r.t. its inputs or its own parameters is non-finite while the gradient w.r.t. its outputs was finite
    (`first_bwd`; `bwd_call`: the forward call of a shared module it belongs to, backward running the calls in
    reverse). With `leaf_backward` instead only full backward hooks on the leaf modules: the first (module, step) whose
    input gradient is non-finite while its output gradient was finite. `with_kwargs`: a forward's keyword inputs
    must be finite too (as its positional ones)."""

    def __init__(self, m, backward=False, *, own_params=True, leaf_backward=False, call_in_first=False, stack=False,
                 with_kwargs=False):
        self.step, self.first, self.bad_weights, self.first_bwd, self.bwd_call = 0, None, None, None, None
        self.own_params, self.call_in_first, self.with_kwargs = own_params, call_in_first, with_kwargs
        self.gout_ok, self.calls, self.bcalls, self.stack, self.hs = {}, {}, {}, [], []
        for n, mod in m.named_modules():
            if stack:
                self.hs.append(mod.register_forward_pre_hook(self._enter(n)))
            self.hs.append(mod.register_forward_hook(self._fwd(n), with_kwargs=with_kwargs))
            if backward and leaf_backward:
                if not list(mod.children()):
                    self.hs.append(mod.register_full_backward_hook(self._bwd(n)))
            elif backward:
                self.hs.append(mod.register_full_backward_pre_hook(self._pre(n)))
                self.hs.append(mod.register_full_backward_hook(self._bwd(n)))
                for p in mod.parameters(recurse=False):
                    if p.requires_grad:
                        self.hs.append(p.register_hook(self._param(n)))

    def new_step(self, step):
        """Start counting `step`'s calls."""
        self.step = step

    def _enter(self, n):
        def f(mod, inp):
            self.stack.append(n)
        return f

    def _fwd(self, n):
        def f(mod, inp, out, kwargs=None):
            if self.stack and self.stack[-1] == n:
                self.stack.pop()
            k = self.calls[(n, self.step)] = self.calls.get((n, self.step), 0) + 1
            if self.first is None and finite(inp) and finite(kwargs) and not finite(out):
                own = all(torch.isfinite(p).all() for p in mod.parameters(recurse=False))
                if own or not self.own_params:
                    self.first = (n, self.step, k) if self.call_in_first else (n, self.step)
                    if not own:
                        self.bad_weights = n
        if self.with_kwargs:
            return lambda mod, args, kwargs, out: f(mod, args, out, kwargs)
        return f

    def _pre(self, n):
        def f(mod, gout):
            self.gout_ok[n] = finite(_grads(gout))
            self.bcalls[(n, self.step)] = self.bcalls.get((n, self.step), 0) + 1
        return f

    def _hit_bwd(self, n):
        self.first_bwd = (n, self.step)
        # the forward call it belongs to
        self.bwd_call = self.calls.get((n, self.step), 0) + 1 - self.bcalls.get((n, self.step), 1)

    def _bwd(self, n):
        def f(mod, gin, gout):
            if self.first_bwd is None and finite(_grads(gout)) and not finite(_grads(gin)):
                self._hit_bwd(n)
        return f

    def _param(self, n):
        def f(g):
            if self.first_bwd is None and self.gout_ok.get(n, True) and not finite(g):
                self._hit_bwd(n)
        return f

    def remove(self):
        """Take every hook off."""
        for h in self.hs:
            h.remove()


class WrongAnswer(AssertionError):
    """A probe's report check failed: the only expected failure of a case marked `wrong` (a failing oracle or a
    crash is a plain failure, never an xfail)."""


def wrong(reason):
    """A strict xfail that accepts only WrongAnswer."""
    return xf(reason).with_args(raises=WrongAnswer)


def named_top3(rep, rules, module, step, severities=("warning", "error")):
    """The probe files' report check (test_llm_blocks_unseen, test_domain_models_unseen, ...): one of `rules` at
    `module`, at `step`, among the first three findings, of one of `severities`; returns it, else WrongAnswer."""
    rules = (rules,) if isinstance(rules, str) else rules
    for f in rep.findings[:3]:
        if f.rule in rules and f.severity in severities and f.module == module and f.step == step:
            return f
    raise WrongAnswer(f"wanted {rules} at {module!r} step {step}; top 3: {lines(rep)[:3]}")


def producer_top3(rep, rules, module, step, phases=("forward", None)):
    """`named_top3`, and the producer, not a carrier: no overflow/nan_origin error at `step` among the first three
    findings names another module (None: the run, outside the model), and the named finding's phase is one of
    `phases`. Returns it, else WrongAnswer (the domain probe files: test_density_models_unseen, ...)."""
    f = named_top3(rep, rules, module, step)
    passed_on = [x.one_line() for x in rep.findings[:3] if x.step == step and x.rule in ("overflow", "nan_origin")
                 and x.severity == "error" and x.module not in (module, None)]
    if passed_on:
        raise WrongAnswer(f"a module that only passed the value on blamed: {passed_on}; top 3: {lines(rep)[:3]}")
    if f.phase not in phases:
        raise WrongAnswer(f"wrong phase: {f.one_line()} ({f.phase})")
    return f


def probe_run(m, batch, loss_fn, steps, run_dir, *, oracle=lambda m: Producer(m, with_kwargs=True), inject=None,
              before=None, after=None, params=None, call=None, lr=1e-3, watch=True, mid_report=None, export=None,
              snap_at=None, watch_kw=None):
    """The probe files' user loop (test_unseen_variants34-40) under ampdoctor.watch(m, optimizer=AdamW(params or
    m.parameters()), scaler=GradScaler("cpu"), run_dir=...) at the default settings, inside a warnings recorder:
    [inject(i, m) under no_grad] [before(i, m)] -> zero_grad -> fp16 autocast forward (`call`, default m) ->
    loss_fn(out, y) -> scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> [after(i, m)]
    [w.report() after step `mid_report`, training going on]; then the oracle's hooks come off, `export(m)` runs (the
    script's last lines inside the watch), close() and report(). `batch(i)` gives (args, kwargs, y) or (args, y).
    `oracle`: m -> an oracle (Producer-like: step, first, first_bwd, calls, remove), or None. `watch=False`: the same
    loop without a watch or an oracle (the losses-identical twin). Returns the oracle's first producers and calls,
    the steps with a non-finite loss, the skipped steps, the losses, the final weights, (snap_at) the state dict the
    forward of that step ran with, ampdoctor's RuntimeWarnings and the reports. `watch_kw`: more keyword arguments
    of the watch (a case that needs a setting other than the default says why)."""
    opt = torch.optim.AdamW(m.parameters() if params is None else params, lr=lr)
    sc = torch.amp.GradScaler("cpu")
    orc = oracle(m) if watch and oracle is not None else None
    call = m if call is None else call
    r = dict(skipped=[], bad_loss=[], losses=[], rep=None, mid=None, warns=[], sd=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir, **(watch_kw or {})) if watch else None
        for i in range(steps):
            if orc is not None:
                orc.step = i
            if inject is not None:
                with torch.no_grad():
                    inject(i, m)
            if before is not None:
                before(i, m)
            if i == snap_at:
                r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
            opt.zero_grad()
            b = batch(i)
            args, kwargs, y = b if len(b) == 3 else (b[0], {}, b[1])
            with torch.autocast("cpu", dtype=torch.float16):
                out = call(*args, **kwargs)
            loss = loss_fn(out, y)
            r["losses"].append(loss.item())
            if not math.isfinite(loss.item()):
                r["bad_loss"].append(i)
            s0 = sc.get_scale()
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                r["skipped"].append(i)
            if after is not None:
                after(i, m)
            if w is not None and i == mid_report:
                r["mid"] = w.report()
        if orc is not None:
            orc.remove()
        if export is not None:
            export(m)
        if w is not None:
            w.close()
            r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["first"] = orc.first if orc is not None else None
    r["first_bwd"] = getattr(orc, "first_bwd", None)
    r["calls"] = orc.calls if orc is not None else {}
    r["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return r


def train_loop(m, batch, loss_fn, steps, *, opt=None, lr=1e-3, init_scale=1024.0, growth_interval=2000, clip=1.0,
               call=None, every=None, backward=False, oracle=Producer, hooks=None, after_step=None, catch=False):
    """zero_grad -> forward under fp16 autocast -> scale(loss).backward -> unscale_ -> clip -> step -> update."""
    # Under ampdoctor.watch(m, optimizer=, scaler=) at the default sampling (or `every`); `batch(i)` gives iteration
    # i's args, `call` runs the forward (default m), `oracle(m, backward=backward)` watches it (default Producer),
    # `hooks["step"]` is kept at the step, `after_step(i)` runs after the update (an epoch-end callback). `catch`: a
    # forward that raises a RuntimeError ends the loop and is kept (as an uncaught one would end a script). Returns a
    # dict: w (closed watch), first / first_bwd / bad_weights (the oracle's), skipped (steps the scaler skipped),
    # bad_loss (steps with a non-finite loss), losses, scales (the loss scale each step ran at), crash ((step,
    # exception) or None).
    opt = opt or torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    prod = oracle(m, backward=backward)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, **({} if every is None else {"every": every}))
    call = call or m
    skipped, bad_loss, losses, scales, crash = [], [], [], [], None
    for step in range(steps):
        prod.step = step
        if hooks is not None:
            hooks["step"] = step
        opt.zero_grad(set_to_none=False)
        args = batch(step)
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(call(*args), *args)
        except RuntimeError as e:
            if not catch:
                raise
            crash = (step, e)
            break
        losses.append(loss.item())
        if not torch.isfinite(loss):
            bad_loss.append(step)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        before = sc.get_scale()
        scales.append(before)
        sc.step(opt)
        sc.update()
        if sc.get_scale() < before:
            skipped.append(step)
        if after_step is not None:
            after_step(step)
    w.close()
    prod.remove()
    return dict(w=w, first=prod.first, first_bwd=prod.first_bwd, bad_weights=prod.bad_weights, skipped=skipped,
                bad_loss=bad_loss, losses=losses, scales=scales, crash=crash)


def healthy(r, must_fall=0.9, skips=(), bwd=True):
    """The run was healthy (no crash, finite losses, no skip but `skips`, no producer, the loss fell); ampdoctor quiet."""
    # `bwd`: no backward producer either, but on `skips`.
    ls = r["losses"]
    assert r.get("crash") is None and all(map(math.isfinite, ls)) and r["skipped"] == list(skips), r
    assert r["first"] is None and (not bwd or r["first_bwd"] is None or r["first_bwd"][1] in skips), r
    k = max(1, len(ls) // 4)
    assert sum(ls[-k:]) < must_fall * sum(ls[:k]), ls
    rep = r["w"].report()
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


def twin_checks(r, plain, steps, calibrates=False):
    """The domain probe files' healthy twin (test_density_models_unseen, ...): `r` the watched probe_run, `plain` the
    unwatched one. Genuinely healthy: finite losses, no producer, no skip from step 3 on (`calibrates`: at most 3
    skips, the unwatched run's own: a scaler's first search delayed by slowly growing gradients), the mean loss of
    the last fifth 5% below the first fifth's, finite weights, no ampdoctor warning; the report quiet; the watch
    changes nothing (losses and weights bitwise identical)."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, (ls, r["first"])
    if calibrates:
        assert len(r["skipped"]) <= 3 and r["skipped"] == plain["skipped"], r["skipped"]
    else:
        assert [s for s in r["skipped"] if s >= 3] == [], r["skipped"]
    k = max(3, steps // 5)
    assert sum(ls[-k:]) / k < sum(ls[:k]) / k - 0.05 * abs(sum(ls[:k]) / k), ls
    assert all(torch.isfinite(v).all() for v in r["weights"].values())
    assert r["warns"] == [], r["warns"]
    rep = r["rep"]
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)
    assert r["losses"] == plain["losses"], (r["losses"], plain["losses"])
    for key, v in r["weights"].items():
        assert torch.equal(v, plain["weights"][key]), key


def failure_oracle(r, bad, where, replayed, skips=True):
    """The domain probe files' failure oracle (test_density_models_unseen, ...): in the probe_run `r`, the loss is
    first non-finite at the injected step `bad`, which the scaler skips (`skips`: False where it does not); the
    first producer is `where` at that step (None: user code outside the model); `replayed` = (fp16 outputs, fp16
    loss, fp32 outputs, fp32 loss) of that step re-run from the weights it ran with: it fails in fp16 as the run did
    (with every model output finite when the model is not the producer) and is finite in fp32 (fp16's doing)."""
    assert r["bad_loss"] and r["bad_loss"][0] == bad, r["losses"]
    assert (bad in r["skipped"]) == skips, r["skipped"]
    assert r["first"] == (None if where is None else (where, bad)), r["first"]
    o16, l16, o32, l32 = replayed
    assert not torch.isfinite(l16), l16
    assert finite(o16) == (where is None), where
    assert finite(o32) and torch.isfinite(l32), l32


def real_fwd(r, name, step, skip=True):
    """The forward failure is real: first producer `name` at `step`, the loss non-finite there, (`skip`) skipped."""
    # skipped: the scaler skips that step and none before.
    assert r["first"] == (name, step), r
    assert r["bad_loss"] and r["bad_loss"][0] == step, r
    if skip:
        assert r["skipped"] and r["skipped"][0] == step, r


def real_fwd_after_backoffs(r, name, step, call=None):
    """The forward failure is real (the probe files' own loops: test_unseen_variants34-37): the oracle's first
    producer is `name` at `step` (and call `call` where the oracle counts calls), the loss is first non-finite there
    and the scaler skips it; before it only the first steps' ordinary backoffs (steps 0-2). Where the run dict has
    a report, it was built and holds findings."""
    assert r["first"] == ((name, step) if call is None else (name, step, call)), r
    assert r["bad_loss"] and r["bad_loss"][0] == step, r
    assert step in r["skipped"] and all(s < 3 for s in r["skipped"] if s < step), r
    if "rep" in r:
        assert r["rep"] is not None and r["rep"].findings, r


def same_losses(a, b):
    """Watching changed no loss: the two runs' `.losses` are the same length and bitwise equal step by step (NaN
    where both are NaN)."""
    assert len(a.losses) == len(b.losses), (len(a.losses), len(b.losses))
    diff = [i for i, (x, y) in enumerate(zip(a.losses, b.losses)) if not (x == y or math.isnan(x) and math.isnan(y))]
    assert not diff, ("watching changed the losses at", diff[:5])


def quiet_twin(r, skips=(), fall=1.0):
    """A probe's twin (the fix applied) was healthy and ampdoctor is quiet: every loss finite, the last three
    below `fall` x the first three, no producer, no skip after the first steps' ordinary backoffs but `skips`, no
    RuntimeWarning of ampdoctor's (where the run dict keeps them), no warning or error in the report."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, r
    assert sum(ls[-3:]) < fall * sum(ls[:3]), ls
    assert [s for s in r["skipped"] if s >= 3] == list(skips), r
    assert r.get("warns", []) == [], r["warns"]
    rep = r["rep"]
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


VARIANT_RULES = ("overflow", "nan_origin")


def _own_loss(out, y):
    return out


def variant_run(case, steps, run_dir, *, fix=False, watch=True, snap_at=None, debug=False):
    """The unseen-variant sets' run of one case (test_unseen_variants63-65, ...): `case["make"](fix=)` is a model
    that computes its own loss from `case["batch"](i)`; probe_run at the default watch, the oracle a Producer with
    keyword inputs and per-call counting from the first call; `case["params"](m)` (optional) the optimizer's
    parameters, `case["lr"]` (optional) its learning rate."""
    torch.manual_seed(0)
    m = case["make"](fix=fix)
    params = case["params"](m) if "params" in case else None
    r = probe_run(m, case["batch"], _own_loss, steps, run_dir, params=params, lr=case.get("lr", 1e-3), watch=watch,
                  snap_at=snap_at, oracle=lambda m: Producer(m, with_kwargs=True, call_in_first=True))
    if debug and watch:
        print(case["name"], "fix" if fix else "", "first", r["first"], "bad", r["bad_loss"][:3], "skip",
              r["skipped"][:6])
        print("losses", [round(v, 3) for v in r["losses"]])
        print("\n".join(lines(r["rep"])[:5]))
    return r


def same_bits(a, b) -> bool:
    """Bitwise-equal loss lists (NaN equal to NaN)."""
    return [struct.pack("d", x) for x in a] == [struct.pack("d", x) for x in b]


def variant_fp32_loss(case, r):
    """The bad step's weights (run with snap_at) run the bad batch in float32: no autocast, data stored in fp16 read
    as float32."""
    torch.manual_seed(0)
    m = case["make"]()
    m.load_state_dict(r["sd"])
    args, _ = case["batch"](case["bad"])
    args = [a.float() if torch.is_tensor(a) and a.dtype == torch.float16 else a for a in args]
    with torch.no_grad():
        return m(*args).item()


def variant_named_at_producer(case, tmp_path, debug=False):
    """An unseen-variant failure: proven by its oracle first (the producer, call and step `case["name"]`,
    `case["call"]`, `case["bad"]`; the loss first non-finite there; skipped unless `case["skips"]` is False; before
    it only the opening backoffs; the unwatched run's losses bitwise the same; the bad batch finite in float32); then
    overflow/nan_origin must be an error at the producer at that step among the report's first three findings, with
    no such error at that step naming a module that only passed the value on; else WrongAnswer."""
    bad = case["bad"]
    r = variant_run(case, bad + 3, tmp_path / "run", snap_at=bad, debug=debug)
    plain = variant_run(case, bad + 3, tmp_path / "plain", watch=False)
    assert r["first"] == (case["name"], bad, case["call"]), r["first"]
    assert r["bad_loss"] and r["bad_loss"][0] == bad, r["losses"]
    assert all(s < 3 for s in r["skipped"] if s < bad), r["skipped"]
    assert (bad in r["skipped"]) == case.get("skips", True), r["skipped"]
    assert same_bits(r["losses"], plain["losses"]), (r["losses"], plain["losses"])
    assert math.isfinite(variant_fp32_loss(case, r))
    rep = r["rep"]
    f = next((f for f in rep.findings[:3] if f.rule in VARIANT_RULES and f.module == case["name"] and f.step == bad
              and f.severity == "error"), None)
    if f is None:
        raise WrongAnswer(f"wanted {VARIANT_RULES} at {case['name']!r} step {bad}; top 3: {lines(rep)[:3]}")
    passed_on = [x.one_line() for x in rep.findings[:3] if x.step == bad and x.rule in VARIANT_RULES
                 and x.severity == "error" and x.module not in (case["name"], None)]
    if passed_on:
        raise WrongAnswer(f"a carrier blamed: {passed_on}; top 3: {lines(rep)[:3]}")


def variant_twin_quiet(case, tmp_path, debug=False):
    """An unseen-variant's twin (the fix applied) for `case["bad"] + 6` steps: the same losses unwatched, healthy
    and quiet (quiet_twin, `case["twin_skips"]` the skips it may have); a report that is not quiet on a healthy run
    is WrongAnswer."""
    steps = case["bad"] + 6
    r = variant_run(case, steps, tmp_path / "run", fix=True, debug=debug)
    plain = variant_run(case, steps, tmp_path / "plain", fix=True, watch=False)
    assert same_bits(r["losses"], plain["losses"]), (r["losses"], plain["losses"])
    try:
        quiet_twin(r, skips=case.get("twin_skips", ()), fall=0.95)
    except AssertionError as e:
        if not all(map(math.isfinite, r["losses"])) or r["first"] is not None:
            raise
        raise WrongAnswer(f"false alarm on a healthy twin: {lines(r['rep'])[:4]} ({str(e)[:400]})") from None


def real_bwd(r, name, step):
    """The backward failure is real: forward and loss finite, first backward producer `name` at `step`, skipped."""
    assert r["first"] is None, r
    assert step not in r["bad_loss"], r
    assert r["first_bwd"] == (name, step), r
    assert r["skipped"] and r["skipped"][0] == step, r


def snap_before(m, step, store, prev=False):
    """An after_step callback for train_loop: keep the weights (and buffers) the forward of `step` runs with
    (store["sd"]), with `prev` also those of the step before it (store["prev"])."""
    def after(i):
        if i == step - 1 or prev and i == step - 2:
            store["sd" if i == step - 1 else "prev"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return after


def at_top3(rep, rules, module, step=None, phase=None, ops=None, severity=None):
    """The finding of one of `rules` at `module` among the first three (asserted), at `step`/`phase`/op/`severity`."""
    # rules may be one rule or a tuple; step / phase / severity one value or a tuple of accepted ones; ops a
    # collection of accepted ops.
    rules = (rules,) if isinstance(rules, str) else rules
    f = in_top3(rep, rules, module)
    if step is not None:
        steps = step if isinstance(step, tuple) else (step,)
        assert f.step in steps, (f.one_line(), lines(rep))
    if phase is not None:
        assert f.phase in ((phase,) if isinstance(phase, str) else phase), (f.one_line(), lines(rep))
    if ops is not None:
        assert f.op in ops, (f.one_line(), lines(rep))
    if severity is not None:
        assert f.severity in ((severity,) if isinstance(severity, str) else severity), (f.one_line(), lines(rep))
    return f


def error_at(rep, rules, module, step=None, phase=None, hidden_op=None, top3=True):
    """An error of one of `rules` at `module` among the first three findings, at `step`, in `phase` if it states one."""
    # `hidden_op`: a forward finding naming that op is accepted too (an op inside the producer made the inf/NaN in the
    # forward and the module's own code hid it). `top3`: also assert scenarios.in_top3 first.
    if top3:
        in_top3(rep, rules, module)
    hits = [f for f in rep.findings[:3] if f.module == module and f.rule in rules and f.severity == "error"
            and (step is None or f.step == step)
            and (phase is None or f.phase in (None, phase) or hidden_op is not None and f.op == hidden_op)]
    assert hits, (module, rules, step, phase, lines(rep))
    return hits[0]


def hf_train(model, batch, steps, inject=None, every=None, lr=1e-4, scaler=True, autocast=True, loss_fn=None,
             oracle=True):
    """The user's ordinary loop on a transformers model: fp16 CPU autocast, GradScaler, unscale_ + clip, step, update.
    Returns (the report, per step (loss finite, the scaler skipped the step, loss), the oracle's producer)."""
    # scaler=False: backward + step. `batch(k)` (or a fixed batch) gives step k's kwargs; `inject(k, model)` runs
    # under no_grad before step k; the loss is `loss_fn(out)` (default out.loss). The oracle is a Producer (own
    # params not required finite, keyword inputs checked); its producer is None with oracle=False.
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    kw = {} if every is None else {"every": every}
    log = []
    prod = Producer(model, own_params=False, with_kwargs=True) if oracle else None
    try:
        with ampdoctor.watch(model, optimizer=opt, scaler=sc, **kw) as w:
            for k in range(steps):
                if prod is not None:
                    prod.step = k
                if inject is not None:
                    with torch.no_grad():
                        inject(k, model)
                b = batch(k) if callable(batch) else batch
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                    out = model(**b)
                loss = out.loss if loss_fn is None else loss_fn(out)
                if sc is not None:
                    s0 = sc.get_scale()
                    sc.scale(loss).backward()
                    sc.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    sc.step(opt)
                    sc.update()
                    skipped = sc.get_scale() < s0
                else:
                    loss.backward()
                    opt.step()
                    skipped = False
                log.append((math.isfinite(loss.item()), skipped, loss.item()))
    finally:
        if prod is not None:
            prod.remove()
    return w.report(), log, (prod.first if prod is not None else None)


def first_bad_log(log):
    """(first step with a non-finite loss, first step the scaler skipped) in an `hf_train` log."""
    nf = next((k for k, e in enumerate(log) if not e[0]), None)
    sk = next((k for k, e in enumerate(log) if e[1]), None)
    return nf, sk


def falls(losses, window=2):
    """Every loss finite, and the mean of the last third (at least `window`) below the mean of the first third."""
    assert all(math.isfinite(v) for v in losses), losses
    n = max(window, len(losses) // 3)
    assert sum(losses[-n:]) / n < sum(losses[:n]) / n, losses


def fp16_accelerator(monkeypatch):
    """An `fp16_on_cpu` fixture's body: force(acc) gives a Trainer's Accelerator what Accelerator.__init__ gives it
    for CUDA fp16, on CPU (default GradScaler settings, as accelerate builds it); the rest is accelerate's own code."""
    pytest.importorskip("accelerate")

    def force(acc):
        monkeypatch.setattr(acc, "scaler", torch.amp.GradScaler("cpu"))
        monkeypatch.setattr(acc, "native_amp", True)
        monkeypatch.setattr(acc.state, "_mixed_precision", "fp16")
        return acc
    return force


def xf(reason):
    """A strict xfail mark with `reason`."""
    return pytest.mark.xfail(strict=True, reason=reason)


@functools.lru_cache(maxsize=None)
def _source(path):
    return open(path).read().splitlines()


def tag_line(path, tag):
    """The line of file `path` that ends with the marker comment `# @tag` (asserted to be exactly one)."""
    hits = [i + 1 for i, ln in enumerate(_source(path)) if ln.rstrip().endswith(f"# @{tag}")]
    assert len(hits) == 1, (tag, hits)
    return hits[0]


def expect(rep, rule, severity=("error",), step=None, tag=None, tags=None, *, src, file=None, line=None, module=...,
           sequence=False):
    """`rule` (or one of the rules) in the first three findings, with `severity`, `step`, `module`, at a marked line."""
    # tag (one `# @tag` marker or a tuple of them) / tags (a tuple) / line: the evidence must point at that line
    # (one of them; markers looked up in `src`, the test file) of `file` (default `src`). `sequence`: a
    # scaler_misorder finding must carry the call sequence as evidence (CONTRACT.md).
    rules = (rule,) if isinstance(rule, str) else rule
    f = next((f for f in rep.findings[:3] if f.rule in rules), None)
    assert f is not None, lines(rep)
    assert f.severity in severity, f.one_line()
    if step is not None:
        assert f.step == step, (f.one_line(), lines(rep))
    if module is not ...:
        assert f.module == module, f.one_line()
    if sequence and f.rule == "scaler_misorder":
        assert f.evidence.get("sequence"), f.one_line()
    if tag is not None or tags is not None or line is not None:
        marks = tags if tag is None else (tag,) if isinstance(tag, str) else tag
        want = [line] if line is not None else [tag_line(src, t) for t in marks]
        ev = f.evidence
        assert ev.get("file") and os.path.abspath(ev["file"]) == os.path.abspath(file or src), (ev, f.one_line())
        assert ev.get("line") in want, (ev.get("line"), want, f.one_line())
    return f


def quiet_report(rep, saw_steps=True):
    """No warning or error in `rep`; `saw_steps`: and the watch really saw at least one step."""
    assert not alarms(rep.findings), lines(rep)
    if saw_steps:
        assert rep.summary["steps"] >= 1, rep.summary


class HealthyLoop:
    """What a healthy probe's case builds: the model, optimizer and scaler the user hands to the watch, and
    `step(i)` -> the loss it logged (a float). `skipped` collects the iterations whose update the scaler skipped (its
    scale fell); `extra`, anything else the case compares between the watched and unwatched runs."""

    def __init__(self, model, optimizer, scaler, step, extra=()):
        self.model, self.optimizer, self.scaler, self.step_fn = model, optimizer, scaler, step
        self.extra, self.skipped = list(extra), []

    def step(self, i):
        s = self.scaler.get_scale()
        loss = self.step_fn(i)
        if self.scaler.get_scale() < s:
            self.skipped.append(i)
        return loss


def healthy_run(loop, steps, watch_kw=None, run_dir=None, around=None):
    """Run a HealthyLoop for `steps` iterations: unwatched (`watch_kw` None) or under ampdoctor.watch(model,
    optimizer=, scaler=, run_dir=, **watch_kw), closed and reported; inside a warnings recorder. `around(i, loop,
    run_iteration)`, where given, runs each iteration (to look at the weights around it). Returns a namespace:
    losses, rep (None unwatched), warns (the `ampdoctor...` Python warnings), weights (the final state_dict),
    skipped, loop."""
    r = SimpleNamespace(losses=[], rep=None, warns=[], loop=loop)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = None
        if watch_kw is not None:
            w = ampdoctor.watch(loop.model, optimizer=loop.optimizer, scaler=loop.scaler, run_dir=run_dir,
                                **watch_kw)
        for i in range(steps):
            r.losses.append(loop.step(i) if around is None else around(i, loop, loop.step))
        if w is not None:
            w.close()
            r.rep = w.report()
    r.warns = [str(x.message) for x in seen if str(x.message).startswith("ampdoctor")]
    r.weights = {k: v.detach().clone() for k, v in loop.model.state_dict().items()}
    r.skipped = list(loop.skipped)
    return r


def same_run(rw, ru):
    """Watching changed nothing: the losses bitwise (same_losses), the skipped iterations, every final weight and
    buffer, the loop's extras."""
    same_losses(rw, ru)
    assert rw.skipped == ru.skipped, (rw.skipped, ru.skipped)
    for k, v in ru.weights.items():
        assert torch.equal(rw.weights[k], v), k
    assert rw.loop.extra == ru.loop.extra


def trained_healthily(r, fall):
    """The run's own oracle, independent of ampdoctor: every loss finite, the mean of the last 5 losses at most
    `fall` x the first 5's, the scaler skipped only opening steps (< 3), every final weight finite."""
    ls = r.losses
    assert all(map(math.isfinite, ls)), ls
    assert sum(ls[-5:]) / 5 <= fall * sum(ls[:5]) / 5, (ls[:5], ls[-5:])
    assert all(s < 3 for s in r.skipped), r.skipped
    assert all(torch.isfinite(v).all() for v in r.weights.values() if v.is_floating_point())


def quiet_healthy(r):
    """A healthy run's report after close(): no warning or error finding, exit code 0, steps seen, and no
    `ampdoctor...` Python warning; otherwise WrongAnswer (a probe's strict xfail quotes it)."""
    rep = r.rep
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm: {lines(rep)}")
    if r.warns:
        raise WrongAnswer(f"ampdoctor warned: {r.warns}")
    quiet_report(rep)


def keep_stepped(opt, params):
    """The loop-misuse files' step pre-hook on `opt`: the gradients of `params` it is about to step on, one list per
    step."""
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.detach().clone() for p in params]))
    return seen


def ratio(got, want):
    """|got| / |want| (gradient lists) and the error of got against want's direction (relative to |got|)."""
    r = gnorm(got) / gnorm(want)
    return r, gnorm([g - r * w for g, w in zip(got, want)]) / gnorm(got)


def near(got, want, factor=1.0, tol=0.05):
    """`got` is `factor` times `want`, in size and direction, within `tol`."""
    r, err = ratio(got, want)
    return abs(r / factor - 1) < tol and err < tol


def misuse_named(rep, rule, step, tags=None, severity=("error",), *, src):
    """The loop-misuse files' check: `rule` (one or a tuple) among the first three findings, with `severity`, at
    `step` (one or a tuple; None: any), at one of `src`'s `# @tags` lines when given (scaler_misorder with its call
    sequence); otherwise WrongAnswer."""
    try:
        f = expect(rep, rule, severity, None, tags, src=src, sequence=True)
        if step is not None:
            steps = step if isinstance(step, tuple) else (step,)
            assert f.step in steps, (f.one_line(), steps)
        return f
    except WrongAnswer:
        raise
    except AssertionError as e:
        raise WrongAnswer(f"top3={lines(rep)[:3]} ({str(e)[:700]})") from None


def misuse_run(make, steps, watched, run_dir=None):
    """The loop-misuse files' runner (test_loop_misuse_unseen3/4): make() -> a namespace with m, opt, sc, body(i)
    (returns the iteration's loss, or a list of them); runs `steps` iterations watched (`ampdoctor.watch(m,
    optimizer=opt, scaler=sc, run_dir=run_dir)`, closed, reported into `.rep`) or not. An exception torch raises
    stops the loop: `.raised` = (iteration, message, the traceback's function names)."""
    c = make()
    c.watched, c.losses, c.raised = watched, [], None
    w = ampdoctor.watch(c.m, optimizer=c.opt, scaler=c.sc, run_dir=run_dir) if watched else None
    try:
        for i in range(steps):
            out = c.body(i)
            c.losses.extend(out if isinstance(out, list) else [out])
    except (RuntimeError, AssertionError) as e:
        tb, funcs = e.__traceback__, []
        while tb is not None:
            funcs.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        c.raised = (i, str(e), funcs)
    finally:
        if w is not None:
            w.close()
    c.rep = w.report() if w is not None else None
    return c


def misuse_both(make, steps, run_dir=None):
    """The watched run and the unwatched run of `make` (the oracles that need copies of the model run in the
    unwatched one), with bitwise the same losses."""
    a = misuse_run(make, steps, True, run_dir)
    b = misuse_run(make, steps, False)
    same_losses(a, b)
    return a, b


def misuse_quiet(rep):
    """The loop-misuse files' healthy loop: no warning or error, exit code 0; otherwise WrongAnswer."""
    try:
        quiet_report(rep)
        assert rep.exit_code == 0, lines(rep)
    except AssertionError as e:
        raise WrongAnswer(f"false alarm on a healthy loop: {lines(rep)[:4]} ({str(e)[:400]})") from None


# ------------------------------------------------------------------------------------------------ hostile inputs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _digest(p):
    if os.path.islink(p):
        return ("link", os.readlink(p))
    if os.path.isdir(p):
        return ("dir",)
    with open(p, "rb") as f:
        return ("file", hashlib.sha256(f.read()).hexdigest())


def snapshot(*roots) -> dict:
    """Every path under `roots` (links not followed) with its kind and content hash."""
    out = {}
    for root in map(str, roots):
        if not os.path.lexists(root):
            continue
        out[root] = _digest(root)
        if os.path.isdir(root) and not os.path.islink(root):
            for dp, dns, fns in os.walk(root):
                for n in dns + fns:
                    out[os.path.join(dp, n)] = _digest(os.path.join(dp, n))
    return out


def stderr_lines(p) -> list[str]:
    """stderr without Python warnings (the `...Warning: ...` line and the source line under it) and blank lines."""
    out, skip_indented = [], False
    for ln in p.stderr.splitlines():
        if "Warning:" in ln:
            skip_indented = True
            continue
        if skip_indented and ln.startswith(" "):
            continue
        skip_indented = False
        if ln.strip():
            out.append(ln)
    return out


def error_line(p) -> str:
    """The one `ampdoctor: ...` line of a refused run: exit 2, no traceback, nothing else on stderr."""
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 2, f"exit {p.returncode}\nstderr: {p.stderr[-2000:]}\nstdout: {p.stdout[-1500:]}"
    lines = stderr_lines(p)
    assert len(lines) == 1 and lines[0].startswith("ampdoctor: "), p.stderr
    return lines[0]


def no_traceback(p):
    """No traceback on stderr, and no `...Error:` line but an `ampdoctor: ...` one."""
    assert "Traceback" not in p.stderr and "Error:" not in "\n".join(
        ln for ln in stderr_lines(p) if not ln.startswith("ampdoctor: ")), p.stderr[-3000:]


def one_line_or_report(p, outputs=()):
    """Bad input handled either way the standard allows: one line and exit 2, or a report (exit 0/1, no traceback)
    whose outputs were all written."""
    no_traceback(p)
    if p.returncode == 2:
        error_line(p)
        return "refused"
    assert p.returncode in (0, 1), p.stderr[-2000:]
    for o in outputs:
        assert os.path.exists(o), (o, p.stdout[-1500:])
    return "report"


def strict_json(path):
    """The JSON file at `path`, refusing the non-standard NaN/Infinity tokens."""
    def refuse(tok):
        raise ValueError(f"non-standard JSON token {tok}")
    with open(path, encoding="utf-8") as f:
        return json.loads(f.read(), parse_constant=refuse)


def copy(src, dst):
    """Copy the tree `src` to `dst` (links kept as links); returns str(dst)."""
    shutil.copytree(src, dst, symlinks=True)
    return str(dst)


def records_raw(rd) -> list[bytes]:
    """The lines of run dir `rd`'s steps.jsonl, as bytes with their line ends."""
    with open(os.path.join(rd, "steps.jsonl"), "rb") as f:
        return f.read().splitlines(keepends=True)


def write_raw(rd, lines):
    """Write `lines` (bytes) as run dir `rd`'s steps.jsonl."""
    with open(os.path.join(rd, "steps.jsonl"), "wb") as f:
        f.write(b"".join(lines))


def edit_record(rd, which, **fields):
    """Set fields of step `which`'s record (Python's json: NaN/Infinity written as such)."""
    lines = records_raw(rd)
    for i, ln in enumerate(lines):
        d = json.loads(ln)
        if d.get("step") == which and "end" not in d:
            d.update(fields)
            lines[i] = (json.dumps(d) + "\n").encode()
            write_raw(rd, lines)
            return
    raise AssertionError(f"no record of step {which}")


def edit_manifest(cap, **fields):
    """Set fields of the capture (or run dir) `cap`'s manifest.json."""
    mp = os.path.join(cap, "manifest.json")
    with open(mp) as f:
        m = json.load(f)
    m.update(fields)
    with open(mp, "w") as f:
        f.write(json.dumps(m))


def load_models(d, name, src):
    """Write `src` as module `name` into directory `d` (the subprocesses' PYTHONPATH) and return it loaded here."""
    (d / f"{name}.py").write_text(src)
    spec = importlib.util.spec_from_file_location(name, d / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_cli(helpers, *args, cwd=ROOT, timeout=240):
    """`python -m ampdoctor *args` in `cwd`, the repo and helpers["dir"] on PYTHONPATH; the CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, helpers["dir"]]))
    env.pop("COLUMNS", None)
    env.setdefault("OMP_NUM_THREADS", "1")     # tiny models; several of these run at once
    return subprocess.run([sys.executable, "-m", "ampdoctor", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def case_registry():
    """A fresh {name: builder} dict and the decorator (`@case`) that adds a builder to it under its name."""
    cases = {}

    def case(fn):
        cases[fn.__name__] = fn
        return fn
    return cases, case


def run_cases(cases, helpers, base_run, root, *, workers=3, timeout=300, after_each=False):
    """Run every `cases` builder's CLI call on a pool of `workers`; {name: ctx}, ctx["p"] the CompletedProcess."""
    # Each builder(helpers, base_run, d, ctx) gets its own directory d under `root` (ctx["dir"]; ctx["cwd"] an empty
    # cwd for the call) and returns ctx's "argv" and "guard" (the paths snapshotted before, ctx["before"], and after,
    # ctx["after"]: once all calls are done, or with `after_each` as each case's result is collected).
    ctxs = {}
    for name, build in cases.items():
        d = root / name
        d.mkdir()
        cwd = d / "cwd"
        cwd.mkdir()
        ctx = {"dir": d, "cwd": cwd, "guard": []}
        ctx.update(build(helpers, base_run, d, ctx))
        ctx["before"] = snapshot(*ctx["guard"])
        ctxs[name] = ctx
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
        futs = {name: ex.submit(run_cli, helpers, *ctx["argv"], cwd=ctx["cwd"], timeout=timeout)
                for name, ctx in ctxs.items()}
        for name, fut in futs.items():
            ctxs[name]["p"] = fut.result()
            if after_each:
                ctxs[name]["after"] = snapshot(*ctxs[name]["guard"])
    if not after_each:
        for ctx in ctxs.values():
            ctx["after"] = snapshot(*ctx["guard"])
    return ctxs


def train_overflow(model, opt, bad_step, steps, after_step=None):
    """The user's loop: fp16 autocast, no GradScaler; the batch of `bad_step` is x 1e5 (overflows the first Linear);
    a non-finite loss skips backward/step as a careful loop does. `after_step(i)` runs after each iteration."""
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 8) * (1e5 if i == bad_step else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if torch.isfinite(loss):
            loss.backward()
            opt.step()
        if after_step is not None:
            after_step(i)


def finite_oracle(layer):
    """An independent forward hook: per call, whether `layer`'s output is all finite; (that list, the hook handle)."""
    seen = []
    handle = layer.register_forward_hook(lambda mod, inp, out: seen.append(bool(torch.isfinite(out).all())))
    return seen, handle


def overflow_run(models, rd, oracle=True):
    """A real watch (run_dir `rd`, no GradScaler) of models.mlp() whose first Linear overflows fp16 at step 4 of 6."""
    # The watch writes captures/4 (asserted). `oracle`: an independent hook asserts that the overflow is real, in
    # `0`, at step 4 only. Returns rd.
    torch.manual_seed(0)
    m = models.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    if oracle:
        finite, hook = finite_oracle(m[0])
    with ampdoctor.watch(m, opt, run_dir=rd):
        train_overflow(m, opt, bad_step=4, steps=6)
        if oracle:
            hook.remove()                       # (before close(), whose replay of the capture runs `0` again)
    if oracle:
        assert finite == [True, True, True, True, False, True]
    assert os.path.isdir(os.path.join(rd, "captures", "4"))
    return rd


def run_misuse(m, body, steps=8, **wkw):
    """watch(m, **wkw) -> body(i) for each step -> close; an exception torch raises for a misuse stops the loop
    (recorded as (iteration, message)). Returns (report, raised)."""
    w = ampdoctor.watch(m, **wkw)
    raised = None
    try:
        for i in range(steps):
            body(i)
    except (RuntimeError, AssertionError, ValueError) as e:
        raised = (i, str(e))
    finally:
        w.close()
    return w.report(), raised


def learned(losses, k=2, factor=0.9):
    """Every loss finite and the last `k` below `factor` times the first `k` (the run learned)."""
    assert all(map(math.isfinite, losses)), losses
    assert sum(losses[-k:]) / k < factor * sum(losses[:k]) / k, losses
