"""Loop misuse probes, fourth unseen set: GradScaler / optimizer call-order mistakes in code shapes that
tests/test_loop_misuse2-9.py, test_loop_misuse_unseen.py / unseen2.py / unseen3.py, test_unusual_loops.py and
test_multi_opt_hostile.py do not build: a SAM optimizer class (first_step / second_step, davda54-style) ported to AMP,
a timm-style Lookahead wrapper whose Trainer clips through the INNER optimizer, a gradient-norm logger living in an
optimizer step pre-hook, a per-layer "gradient clip" module backward hook, a generator-based training loop consumed
with itertools.islice, and a GradScaler switched off by a `torch.cuda.is_available()` check while fp16 autocast runs
on the CPU. Each misuse has a correct twin (the same loop, the mistake fixed) that must be quiet. Everything runs
under fp16 CPU autocast + torch.amp.GradScaler("cpu"), one intra-op thread, watched through the public API only
(`ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")`, default settings, `w.close()`,
`w.report()`).

Every case runs twice, watched and unwatched, and the losses must be bitwise the same (probe_harness.same_losses).
The truth is proven first without ampdoctor: the gradients the optimizer stepped on (a step pre-hook on the optimizer
that really steps) vs the true unscaled gradients recomputed on a copy of the model, the share of elements a hook
clamped, torch's own exception and where it came from, the share of subnormal values in the fp16 gradient reaching
the output (a failing oracle is a plain failure). Then the CONTRACT rule among the first three findings, as an
error (underflow: warning or error), at the step of the first misuse and, where a call of the user's is the mistake,
at that call's `# @tag` line (probe_harness.misuse_named; scaler_misorder with its call sequence). A wrong report
raises WrongAnswer: a strict xfail `wrong(...)` quoting what ampdoctor said.

Misuse (twin):
 S1. SAM ported to AMP the "obvious" way: scaled backward, `scaler.unscale_(opt)`, `opt.first_step(zero_grad=True)`
     (climb to w + rho g/|g|), the second scaled backward, `scaler.step(opt)` (SAM.step = second_step: restore w,
     base SGD step), update(). The unscale_ marks the optimizer UNSCALED, so scaler.step does not unscale the second
     pass's gradients (nor inf-check them): SGD steps on them x1024. Truth: step 0's stepped gradients are 1024x the
     true gradients at the perturbed weights, and the weights blow up (loss 0.88 -> 6e5 at iteration 1, NaN from 2).
     scaler_misorder, error, step 0, at the unscale_, the second backward or the step line.
     (T1: no unscale_ before first_step: the climb direction g/|g| is scale-invariant; scaler.step unscales pass 2)
 S2. a Trainer that wraps its SGD in a timm-style Lookahead (`self.step_optimizer = Lookahead(self.optimizer)`, the
     wrapper sharing the base's param_groups) but whose `clip_gradients()` still unscales `self.optimizer` (the base)
     before `scaler.step(self.step_optimizer)`: GradScaler keeps its unscale state per optimizer OBJECT, so the
     wrapper's step divides the same gradients again. Truth: the base SGD steps on the true gradients / 1024 (the
     clip saw the true norm). scaler_misorder, error, step 0, at the clip helper's unscale_ or the scaler.step line.
                                                                (T2: clip_gradients unscales the step optimizer)
 S3. a `GradNormLogger` callback that registers an optimizer step PRE-hook and calls `scaler.unscale_(opt)` in it
     "to log the true norm": the hook runs inside scaler.step, after GradScaler's own unscale_, and torch raises
     "unscale_() has already been called on this optimizer since the last update()" at iteration 0 (from within
     scaler.step). scaler_misorder, error, step 0, at the hook's unscale_ line (or the scaler.step line).
         (T3: the hook reads get_total_norm without unscale_: it runs after GradScaler's unscale_, the norm is true)
 S4. per-layer "gradient clipping" with a module full backward hook on the head (`register_full_backward_hook`
     returning grad_input clamped to +-1, a bound the true gradients never reach) under
     `scaler.scale(loss).backward()`: the hook clamps the SCALED gradient into the head. Truth: no element of the
     true gradient exceeds the bound, under the scaler most do, and the body's stepped gradients are far below the
     true ones. clip_before_unscale, error, step 0 (no clipping API is called: no line asked).
                                                    (T4: the bound given in scaled units, 1.0 * scaler.get_scale())
 S5. a generator-based loop: `train_steps()` yields each step's loss right after `scaler.step(opt)` and calls
     `scaler.update()` after the yield; each epoch takes `itertools.islice(train_steps(...), 4)`, so the generator
     is abandoned at the 4th yield and that step's update() never runs; the next epoch's first unscale_ raises
     "unscale_() is being called after step()" (iteration 4). missing_scaler_update, error, step 3 (the iteration
     that lacked its update), at the scaler.step line.                      (T5: update() before the yield)
 S6. `scaler = GradScaler("cpu", enabled=torch.cuda.is_available())` (copied from a CUDA script: off on this CPU
     machine) while the loop still runs `torch.autocast("cpu", dtype=torch.float16)`, with a per-pixel regression
     loss mean-reduced over 16 x 4096 outputs: the fp16 gradient reaching the output is ~1e-5 per unit of error, so
     >90% of its nonzero values are subnormal (the scaled twin: none). underflow, warning or error, step 0.
                                                                   (T6: the scaler enabled, as the docs write it)

Oracle numbers when written: S2 every stepped gradient 1/1024 of the true one (the clip saw the true norm); S4 66-87%
of the head's input-gradient elements clamped per step (true: none reach the bound), the body's stepped gradients
0.08x the true ones; S6 97-99.9% of the nonzero fp16 output gradients subnormal (T6 at 65536: <= 0.01%).

Result when written (torch 2.13 CPU, default watch with run_dir): 10 pass, 2 xfail (strict; each reason quotes
ampdoctor's answer).
 - S3 (scaler.unscale_ in an optimizer step pre-hook, raising inside scaler.step): an empty report (0 findings),
   although torch raised "unscale_() has already been called on this optimizer since the last update()" at iteration
   0 from the hook. Should be scaler_misorder, error, step 0, at the hook's unscale_ line (or scaler.step's).
   Fixed since (rules/callorder.py `_unscaled_in_step`: an unscale_ inside scaler.step that raised is the user's, not
   GradScaler's own): '[error] scaler_misorder ... `scaler.unscale_()` at :LINE ran inside `scaler.step()`', at the
   hook's unscale_ line.
 - S4 (module full backward hook on `head` clamping grad_input to +-1 under the scaled backward): an empty report.
   Should be clip_before_unscale, error, step 0 (the same clamp as a tensor hook on the parameters is named, see
   test_loop_misuse_unseen.py U7; through a module backward hook it is not).
Right: S1 ('[error] scaler_misorder ... `scaler.unscale_()` at :LINE ran before the iteration's last
`scaler.scale(loss).backward()`', at the unscale_ line, first), S2 ('[error] scaler_misorder ... `scaler.step()`
unscales gradients that `scaler.unscale_()` already unscaled through another optimizer object holding the same
parameters (a wrapper such as Lookahead ...)', at the step line), S5 ('[error] missing_scaler_update ... step 3' at
the scaler.step line), S6 ('[error] underflow at head step 0: 97% of the nonzero gradients flowing into `head` are
below fp16's normal range'), and every twin T1-T6 quiet.
"""
import copy
import itertools
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from scenarios import one_thread
from probe_harness import (gnorm, keep_stepped, learned, misuse_batch, misuse_both, misuse_loss, misuse_named,
                           misuse_net, misuse_quiet, misuse_scaler, misuse_true_grads, MISUSE_W, misuse_weights, near,
                           ratio, wrong)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = dict(device_type="cpu", dtype=torch.float16)
HERE = os.path.abspath(__file__)
SCALE = 1024.0
ERR = ("error",)

net = misuse_net
batch = misuse_batch


scaler, fwd_loss, true_grads, weights = misuse_scaler, misuse_loss, misuse_true_grads, misuse_weights


def both(make, steps, tmp_path):
    return misuse_both(make, steps, tmp_path / "run")


def named(rep, rule, step, tags=None, severity=ERR):
    return misuse_named(rep, rule, step, tags, severity, src=HERE)


quiet = misuse_quiet


# ======================================================================================================================
# S1. SAM (first_step / second_step) ported to AMP with unscale_ before first_step
# ======================================================================================================================
class SAM(torch.optim.Optimizer):
    """davda54/sam's SAM, with `step()` doing the second step (what scaler.step(opt) calls)."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for g in self.param_groups for p in g["params"]
                                            if p.grad is not None]), p=2)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                e_w = p.grad * scale.to(p)
                p.add_(e_w)
                self.state[p]["e_w"] = e_w
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()


def make_sam(unscale_first_pass):
    def make():
        c = SimpleNamespace(m=net(), want=[])
        c.opt = SAM(c.m.parameters(), torch.optim.SGD, rho=0.05, lr=0.05)
        c.sc = scaler()
        c.stepped = keep_stepped(c.opt.base_optimizer, list(c.m.parameters()))

        def body(i):
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            if unscale_first_pass:
                c.sc.unscale_(c.opt)  # @s1-unscale
            c.opt.first_step(zero_grad=True)
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))      # the true gradients at the perturbed weights
            c.sc.scale(fwd_loss(c.m, i)).backward()  # @s1-backward2
            c.sc.step(c.opt)  # @s1-step
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


def test_s1_sam_unscale_before_first_step(tmp_path):
    a, b = both(make_sam(unscale_first_pass=True), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: step 0's SGD step was on the second pass's gradients still x1024 (same direction); the weights blew up
    # (loss 0.88 -> 6e5 at iteration 1, NaN from 2, where the first pass's unscale_ finds inf and the steps are skipped)
    assert near(b.stepped[0], b.want[0], factor=SCALE), ratio(b.stepped[0], b.want[0])
    assert b.losses[1] > 1000 * b.losses[0] and b.losses[2] != b.losses[2], b.losses
    named(a.rep, "scaler_misorder", 0, ("s1-unscale", "s1-backward2", "s1-step"))


def test_t1_sam_first_step_on_scaled_gradients(tmp_path):
    a, b = both(make_sam(unscale_first_pass=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(near(s, w) for s, w in zip(b.stepped, b.want)), [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# S2. a Trainer whose clip helper unscales the inner optimizer of a timm-style Lookahead wrapper
# ======================================================================================================================
class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead (timm/optim/lookahead.py): shares the base optimizer's param_groups; super().__init__ is not
    called, as in timm."""

    def __init__(self, base_optimizer, alpha=0.5, k=6):
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state = defaultdict(dict)
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if "lookahead_slow_buff" not in param_state:
                param_state["lookahead_slow_buff"] = torch.empty_like(fast_p)
                param_state["lookahead_slow_buff"].copy_(fast_p)
            slow = param_state["lookahead_slow_buff"]
            slow.add_(fast_p - slow, alpha=group["lookahead_alpha"])
            fast_p.copy_(slow)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def zero_grad(self, set_to_none=True):
        self._base_optimizer.zero_grad(set_to_none=set_to_none)


class LookaheadTrainer:
    def __init__(self, model, scaler, max_norm, unscale_wrapper):
        self.model, self.scaler, self.max_norm, self.norms = model, scaler, max_norm, []
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        self.step_optimizer = Lookahead(self.optimizer, k=4)
        self.unscale_wrapper = unscale_wrapper

    def clip_gradients(self):
        opt = self.step_optimizer if self.unscale_wrapper else self.optimizer
        self.scaler.unscale_(opt)  # @s2-unscale
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)))

    def optimizer_step(self):
        self.clip_gradients()
        self.scaler.step(self.step_optimizer)  # @s2-step
        self.scaler.update()

    def training_step(self, i):
        self.step_optimizer.zero_grad(set_to_none=True)
        loss = fwd_loss(self.model, i)
        self.scaler.scale(loss).backward()
        self.optimizer_step()
        return loss.item()


def make_lookahead(unscale_wrapper):
    def make():
        c = SimpleNamespace(m=net(), want=[])
        c.sc = scaler()
        c.trainer = LookaheadTrainer(c.m, c.sc, 50.0, unscale_wrapper)
        c.opt = c.trainer.step_optimizer
        c.stepped = keep_stepped(c.trainer.optimizer, list(c.m.parameters()))

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
            return c.trainer.training_step(i)
        c.body = body
        return c
    return make


def test_s2_lookahead_trainer_unscales_the_inner_optimizer(tmp_path):
    a, b = both(make_lookahead(unscale_wrapper=False), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the clip saw the true norm (below max_norm), and the base SGD stepped on the true gradients / 1024
    assert all(abs(n / gnorm(w) - 1) < 0.02 for n, w in zip(b.trainer.norms, b.want)), b.trainer.norms
    assert all(near(s, w, factor=1 / SCALE) for s, w in zip(b.stepped, b.want)), \
        [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    named(a.rep, "scaler_misorder", 0, ("s2-unscale", "s2-step"))


def test_t2_lookahead_trainer_unscales_the_step_optimizer(tmp_path):
    a, b = both(make_lookahead(unscale_wrapper=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(near(s, w) for s, w in zip(b.stepped, b.want)), [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# S3. a gradient-norm logger in an optimizer step pre-hook that calls scaler.unscale_
# ======================================================================================================================
class GradNormLogger:
    def __init__(self, model, optimizer, scaler, unscale):
        self.model, self.scaler, self.unscale, self.norms = model, scaler, unscale, []
        optimizer.register_step_pre_hook(self.before_step)

    def before_step(self, optimizer, args, kwargs):
        if self.unscale:
            self.scaler.unscale_(optimizer)  # @s3-unscale
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


def make_logger(unscale):
    def make():
        c = SimpleNamespace(m=net(), true_norms=[])
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler()
        c.logger = GradNormLogger(c.m, c.opt, c.sc, unscale)

        def body(i):
            if not c.watched:
                c.true_norms.append(gnorm(true_grads(c.m, [i])))
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            c.sc.step(c.opt)  # @s3-step
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


def test_s3_step_pre_hook_logger_unscales_inside_scaler_step(tmp_path):
    a, b = both(make_logger(unscale=True), 6, tmp_path)
    # truth: torch raised at iteration 0, from the hook's unscale_ inside scaler.step
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == 0, c.raised
        assert "unscale_() has already been called on this optimizer" in c.raised[1], c.raised
        assert "before_step" in c.raised[2] and c.raised[2].index("step") < c.raised[2].index("before_step"), \
            c.raised[2]
    named(a.rep, "scaler_misorder", 0, ("s3-unscale", "s3-step"))


def test_t3_step_pre_hook_logger_reads_the_norm_only(tmp_path):
    a, b = both(make_logger(unscale=False), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # the hook runs after GradScaler's own unscale_: the norm it logs is the true one
    assert all(abs(n / t - 1) < 0.02 for n, t in zip(b.logger.norms, b.true_norms)), (b.logger.norms, b.true_norms)
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# S4. a module full backward hook clamping the (scaled) gradient into the head
# ======================================================================================================================
BOUND = 1.0


def make_hook_clip(bound_in_scaled_units):
    def make():
        c = SimpleNamespace(m=net(), want=[], clamped=[], true_clamped=[])
        c.opt = torch.optim.SGD(c.m.parameters(), lr=0.05)
        c.sc = scaler()
        c.stepped = keep_stepped(c.opt, list(c.m.parameters()))

        def clip_layer_grad(module, grad_input, grad_output):
            bound = BOUND * (c.sc.get_scale() if bound_in_scaled_units else 1.0)
            c.clamped.append(float((grad_input[0].abs() > bound).float().mean()))
            return tuple(None if g is None else g.clamp(-bound, bound) for g in grad_input)
        c.m.head.register_full_backward_hook(clip_layer_grad)

        def true_head_input_grad(i):
            k = copy.deepcopy(c.m)
            k.head._backward_hooks.clear()
            seen = []
            k.head.register_full_backward_hook(lambda mod, gi, go: seen.append(float(gi[0].abs().max())))
            fwd_loss(k, i).backward()
            return seen[0]

        def body(i):
            if not c.watched:
                c.want.append(true_grads(c.m, [i]))
                c.true_clamped.append(true_head_input_grad(i) > BOUND)
            c.opt.zero_grad(set_to_none=True)
            loss = fwd_loss(c.m, i)
            c.sc.scale(loss).backward()
            c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 50.0)
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


@wrong("an empty report; should be clip_before_unscale, error, step 0 (the head's full backward hook clamps the scaled "
       "gradient)")
def test_s4_module_backward_hook_clamps_scaled_gradient(tmp_path):
    a, b = both(make_hook_clip(bound_in_scaled_units=False), 8, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the true gradient into the head never reaches the bound; under the scaler most elements are clamped,
    # and the body's stepped gradients are far below the true ones
    assert not any(b.true_clamped) and min(b.clamped) > 0.5, (b.true_clamped, b.clamped)
    r, _ = ratio(b.stepped[0][:2], b.want[0][:2])
    assert r < 0.2, r
    named(a.rep, "clip_before_unscale", 0)


def test_t4_module_backward_hook_bound_in_scaled_units(tmp_path):
    a, b = both(make_hook_clip(bound_in_scaled_units=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert max(b.clamped) == 0.0, b.clamped
    assert all(near(s, w) for s, w in zip(b.stepped, b.want)), [ratio(s, w) for s, w in zip(b.stepped, b.want)]
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# S5. a generator-based loop consumed with itertools.islice: update() after the yield
# ======================================================================================================================
PER_EPOCH = 4


def train_steps(m, opt, sc, start, calls, update_before_yield):
    for i in itertools.count(start):
        opt.zero_grad(set_to_none=True)
        loss = fwd_loss(m, i)
        sc.scale(loss).backward()
        calls.append("unscale_")
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        calls.append("step")
        sc.step(opt)  # @s5-step
        if update_before_yield:
            calls.append("update")
            sc.update()
        yield loss.item()
        if not update_before_yield:
            calls.append("update")
            sc.update()


def make_generator(update_before_yield):
    def make():
        c = SimpleNamespace(m=net(), calls=[])
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = scaler()

        def body(epoch):
            gen = train_steps(c.m, c.opt, c.sc, epoch * PER_EPOCH, c.calls, update_before_yield)
            return list(itertools.islice(gen, PER_EPOCH))
        c.body = body
        return c
    return make


def test_s5_generator_loop_update_after_yield(tmp_path):
    a, b = both(make_generator(update_before_yield=False), 3, tmp_path)
    # truth: iteration 3 (the epoch's last) never ran update(); epoch 1's first unscale_ (iteration 4) raised
    for c in (a, b):
        assert c.raised is not None and c.raised[0] == 1 and "unscale_() is being called after step()" in c.raised[1], \
            c.raised
        assert c.calls == ["unscale_", "step", "update"] * 3 + ["unscale_", "step", "unscale_"], c.calls
    named(a.rep, "missing_scaler_update", 3, "s5-step")


def test_t5_generator_loop_update_before_yield(tmp_path):
    a, b = both(make_generator(update_before_yield=True), 3, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert a.calls == ["unscale_", "step", "update"] * 12, a.calls
    learned(a.losses)
    quiet(a.rep)


# ======================================================================================================================
# S6. GradScaler switched off by a CUDA check while fp16 autocast runs on the CPU
# ======================================================================================================================
def pixel_batch(i):
    g = torch.Generator().manual_seed(100 + i % 4)
    x = torch.randn(16, 4096, 8, generator=g)
    return x, x @ MISUSE_W


def make_pixels(enabled):
    def make():
        c = SimpleNamespace(m=net(), sub=[])
        c.opt = torch.optim.AdamW(c.m.parameters(), lr=1e-2)
        c.sc = torch.amp.GradScaler("cpu", enabled=enabled)

        def keep(g):
            nz = g[g != 0]
            c.sub.append((g.dtype, float((nz.abs() < torch.finfo(torch.float16).tiny).float().mean())))

        def body(i):
            c.opt.zero_grad(set_to_none=True)
            x, y = pixel_batch(i)
            with torch.autocast(**FP16):
                out = c.m(x)
            if not c.watched:
                out.register_hook(keep)
            loss = F.mse_loss(out.float(), y)
            c.sc.scale(loss).backward()
            c.sc.unscale_(c.opt)
            torch.nn.utils.clip_grad_norm_(c.m.parameters(), 5.0)
            c.sc.step(c.opt)
            c.sc.update()
            return loss.item()
        c.body = body
        return c
    return make


def test_s6_scaler_disabled_by_cuda_check_under_cpu_fp16(tmp_path):
    a, b = both(make_pixels(enabled=torch.cuda.is_available()), 8, tmp_path)
    assert not torch.cuda.is_available() and not a.sc.is_enabled()
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    # truth: the fp16 gradient reaching the output is mostly subnormal on every iteration
    assert all(dt == torch.float16 and s > 0.5 for dt, s in b.sub), b.sub
    named(a.rep, "underflow", 0, severity=("warning", "error"))


def test_t6_scaler_enabled_under_cpu_fp16(tmp_path):
    a, b = both(make_pixels(enabled=True), 10, tmp_path)
    assert a.raised is None and b.raised is None, (a.raised, b.raised)
    assert all(dt == torch.float16 and s < 0.01 for dt, s in b.sub[-5:]), b.sub
    learned(a.losses)
    quiet(a.rep)
