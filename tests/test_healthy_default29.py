"""Healthy runs at ampdoctor's DEFAULT watch, twenty-ninth set: OPTIMIZER WRAPPERS, CUSTOM OPTIMIZERS AND SEVERAL
PARAMETER GROUPS / UPDATE RULES IN ONE OPTIMIZER, each written the way its source writes it (its classes reduced to
the lines the loop runs), on tiny models. `ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path /
"run")` and nothing else, given the optimizer the user would naturally pass (the wrapper the codebase hands back;
each case names it); CPU fp16 autocast, a real `torch.amp.GradScaler("cpu")`, fixed seeds, one intra-op thread,
40-48 iterations each. The harness is test_healthy_default28's (tests/codebase_harness.py): every case runs twice,

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite; the mean loss of
  the last fifth below `fall` x the first fifth's; probe_harness.Producer's forward hooks saw no module make inf/NaN
  from finite inputs; the gradients finite after every optimizer step that was not skipped; every weight finite at
  the end; skipped steps only the loss scaler's opening search (a first streak from step 0 of at most 4, then at
  most 2 isolated skips);
- the WATCHED run must train bitwise identically (`identical`): every loss, loss scale, skip, every optimizer step's
  gradients, the case's extras, every final weight and buffer, the optimizer's state_dict (the inner optimizer's
  where the watch is given a wrapper) and the final scale; then (`judge`) w.report() after close() and
  ampdoctor.diagnose(run_dir) must hold no warning and no error (info is fine), exit code 0, no internal error, one
  recorded step per optimizer step (update) of the watched optimizer, and no `ampdoctor: ...` Python warning during
  the run. A false alarm is a strict xfail (probe_harness.wrong: WrongAnswer only) whose reason quotes ampdoctor; a
  failing oracle or a difference in training is a plain failure.

Left to earlier files (grep -il of tests/*.py): torch.optim.Muon + AdamW through one scaler (default19), schedule-free
AdamW's train()/eval() (default19), SAM / ASAM with a GradScaler (default3, default23), hand-written duck-typed
Lookahead (default4, loop_misuse7, unseen_variants13), ReduceLROnPlateau (default5, default16), torch.optim.Adafactor
and a hand-written relative_step=False Adafactor (default3, default11, default26), plain add_param_group unfreezing
(default11, default16, default26), accelerate's AcceleratedOptimizer accumulation (default28).

The cases:
 1. muon_with_aux_adam: KellerJordan/Muon's SingleDeviceMuonWithAuxAdam (ONE optimizer, groups flagged use_muon:
    Newton-Schulz-5 orthogonalised Nesterov momentum in bf16 for the hidden 2-D weights, lr 0.02; its own Adam
    update, eps 1e-10, for the embedding, head, biases and norms), through one GradScaler; watched: that optimizer;
 2. timm_lookahead_native_scaler: timm's Lookahead (a torch.optim.Optimizer subclass that does NOT call
    super().__init__, shares the base optimizer's param_groups, keeps its slow weights in the base optimizer's state)
    over AdamW, driven by timm's NativeScaler (scale/backward, unscale_ + clip 1.0, step, update only when
    need_update) with timm train.py's accum_steps=2 (loss / 2, an update every 2nd batch and at the epoch's last),
    sync_lookahead() at each epoch end; watched: the Lookahead (what create_optimizer_v2('lookahead_adamw') returns);
 3. torchlars_lars_sgd: torchlars' LARS wrapper (an Optimizer subclass without super().__init__; param_groups /
    state as properties of the inner SGD; step hides the weight decays, folds them into the gradient and multiplies
    the gradient by trust_coef |w| / (|g| + wd |w| + eps)) over SGD(lr 4.8, momentum 0.9, wd 1e-4); watched: LARS;
 4. lamb_trust_ratio: cybertronai/pytorch-lamb's Lamb(Optimizer): per-parameter trust ratio |w|.clamp(0, 10) /
    |adam_step| (1 where either is 0), no bias correction, weight_norm / adam_norm / trust_ratio kept in the state;
 5. adam8bit_blockwise_states: a bitsandbytes-style Adam8bit written as an Optimizer subclass: m and v stored as
    uint8 codes into 256-entry signed / unsigned maps with a per-256-block absmax (fp32), dequantised, updated in
    fp32, the step taken from the fresh fp32 values, requantised; tensors under min_8bit_size=4096 keep fp32 states;
 6. hf_adafactor_relative_step: transformers' own Adafactor(lr=None, scale_parameter=True, relative_step=True,
    warmup_init=False) with AdafactorSchedule, the Trainer's fp16 loop (unscale_ + clip 1.0, scaler.step, update,
    scheduler step, zero_grad);
 7. colossalai_torch_amp_wrapper: ColossalAI's OptimizerWrapper / TorchAMPOptimizer (delegation: param_groups /
    defaults properties, step / zero_grad / state_dict forwarded; backward = scaler.scale(loss).backward();
    clip_grad_by_norm = unscale_ + clip; step = scaler.step(inner) + scaler.update()) with TorchAMPModule (autocast
    around the wrapped module's forward, the criterion outside it, so the loss is fp16 and the scaler's first
    scale() overflows: one skip at step 0) and the booster loop; watched: the model wrapper,
    the TorchAMPOptimizer and its scaler (the wrapper hands the INNER optimizer to scaler.step);
 8. accumulating_optimizer_wrapper: a hand-written wrapper whose step() steps (scaler.step + update) only every
    k=4 calls and whose zero_grad() only clears after an update; the loop calls both every batch, loss / k; watched:
    the wrapper; the report's steps are 48 / 4 = 12;
 9. lr0_group_then_add_param_group: AdamW with a "frozen by lr" stem group (lr 0.0, gradients still computed) and a
    head group; the backbone requires_grad False and outside the optimizer until step 10, then requires_grad_(True)
    and opt.add_param_group with its own lr; unscale_ + clip over the optimizer's groups;
10. prodigy_dadapt: konstmish/prodigy's Prodigy (lr 1.0, use_bias_correction, decoupled wd 1e-4; d0 1e-6 grown
    by the D-adaptation estimate to ~9e-3 by step 32), unscale_ + clip 1.0: the effective lr grows ~10^4-fold over
    the run, as designed (checked: d grew > 1000x);
11. ranger_radam_lookahead: lessw2020's Ranger (RAdam with the N_sma threshold 5, its step-size buffer shared
    across parameters, and Lookahead k=6 alpha 0.5 inside one Optimizer subclass, slow buffers in its state),
    lr 1e-2.

Result when written: 11/11 quiet; false alarms: none. Every run bitwise identical with and without the watch
(losses, scales, skips, per-step gradients, extras, final weights and buffers, optimizer state_dict, final scale), and
the report's step count equal to the optimizer updates in every case (20 for timm's accum_steps=2 over 40 batches, 12
for the k=4 wrapper over 48 batches, 40 elsewhere). The only finding of any case was info:
colossalai_torch_amp_wrapper's `[info] skipped_steps at (run) step 0: GradScaler skipped 1 of 40 steps; a normal rate
for dynamic loss scaling.` (ColossalAI calls the criterion outside autocast, so the loss is fp16 and 1.53 x 65536
overflows at the first scale(); the scaler halves once, then no skip). Also quiet with every-step headroom
(AMPD_SET=headroom, tests' every1plug) and at every=1 (AMPD_SET=every1). The file takes ~4 s (~7 s with start-up).
"""
from __future__ import annotations

import contextlib
import math
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import wrong  # noqa: E402
from scenarios import gen, one_thread  # noqa: E402
from codebase_harness import (DEBUG, Rec, healthy, identical, judge, ns, registrar,  # noqa: E402
                             run)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
F16 = torch.float16
CASES: dict = {}
XFAIL: dict[str, str] = {}


case = registrar(CASES)


# ------------------------------------------------------------------------------------------------------ data, model
W_T = torch.randn(16, 4, generator=gen(2900))


def teacher(seed, n=64, d=16):
    """x ~ N(0, 1) in 16-D, the class the argmax of a fixed linear teacher (4 classes)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, d, generator=g)
        return x, (x @ W_T).argmax(1)
    return batch


class ResMLP(nn.Module):
    """An input projection (`embed`), pre-LN residual blocks (`blocks`), a head."""

    def __init__(self, d_in=16, h=64, classes=4, depth=2):
        super().__init__()
        self.embed = nn.Linear(d_in, h)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(h), nn.Linear(h, h), nn.GELU())
                                     for _ in range(depth)])
        self.head = nn.Linear(h, classes)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def plain_mlp(h=64):
    return nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 4))


def amp_loop(model, optimizer, scaler, rec, data, clip=None, params=None, after=None):
    """The plain torch.amp recipe: autocast forward, scale(loss).backward(), [unscale_ + clip_grad_norm_], step,
    update, zero_grad(set_to_none=True)."""
    def body(i):
        x, y = data(i)
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(params() if params is not None else model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        if after is not None:
            after(i)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return body


# ------------------------------------------------------------------------------------ 1. Muon with auxiliary Adam
def zeropower_via_newtonschulz5(G, steps: int):
    """KellerJordan/Muon muon.py: quintic Newton-Schulz iteration to orthogonalise G, in bfloat16."""
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True):
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    if update.ndim == 4:
        update = update.view(len(update), -1)
    update = zeropower_via_newtonschulz5(update, steps=ns_steps)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


def adam_update(grad, buf1, buf2, step, betas, eps):
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    buf1c = buf1 / (1 - betas[0] ** step)
    buf2c = buf2 / (1 - betas[1] ** step)
    return buf1c / (buf2c.sqrt() + eps)


class SingleDeviceMuonWithAuxAdam(Optimizer):
    """KellerJordan/Muon muon.py (the non-distributed MuonWithAuxAdam)."""

    def __init__(self, param_groups):
        for group in param_groups:
            assert "use_muon" in group
            if group["use_muon"]:
                group["lr"] = group.get("lr", 0.02)
                group["momentum"] = group.get("momentum", 0.95)
                group["weight_decay"] = group.get("weight_decay", 0)
                assert set(group.keys()) == {"params", "lr", "momentum", "weight_decay", "use_muon"}
            else:
                group["lr"] = group.get("lr", 3e-4)
                group["betas"] = group.get("betas", (0.9, 0.95))
                group["eps"] = group.get("eps", 1e-10)
                group["weight_decay"] = group.get("weight_decay", 0)
                assert set(group.keys()) == {"params", "lr", "betas", "eps", "weight_decay", "use_muon"}
        super().__init__(param_groups, dict())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    state = self.state[p]
                    if len(state) == 0:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    update = muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"])
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update.reshape(p.shape), alpha=-group["lr"])
            else:
                for p in group["params"]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    state = self.state[p]
                    if len(state) == 0:
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                        state["step"] = 0
                    state["step"] += 1
                    update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                                         group["betas"], group["eps"])
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update, alpha=-group["lr"])
        return loss


@case(40)
def muon_with_aux_adam():
    # The Muon README's recipe; watched: the one SingleDeviceMuonWithAuxAdam.
    torch.manual_seed(1)
    model = ResMLP()
    hidden_weights = [p for p in model.blocks.parameters() if p.ndim >= 2]
    hidden_gains_biases = [p for p in model.blocks.parameters() if p.ndim < 2]
    nonhidden_params = [*model.head.parameters(), *model.embed.parameters()]
    param_groups = [dict(params=hidden_weights, use_muon=True, lr=0.02, weight_decay=0.01),
                    dict(params=hidden_gains_biases + nonhidden_params, use_muon=False, lr=3e-3, betas=(0.9, 0.95),
                         weight_decay=0.01)]
    optimizer = SingleDeviceMuonWithAuxAdam(param_groups)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    return ns(model, optimizer, scaler, rec, amp_loop(model, optimizer, scaler, rec, teacher(1)))


# ---------------------------------------------------------------------------------- 2. timm Lookahead + NativeScaler
class Lookahead(Optimizer):
    """timm/optim/lookahead.py (timm >= 0.9)."""

    def __init__(self, base_optimizer, alpha=0.5, k=6):
        # NOTE super().__init__() not called on purpose
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f'Invalid slow update rate: {alpha}')
        if not 1 <= k:
            raise ValueError(f'Invalid lookahead steps: {k}')
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
            if 'lookahead_slow_buff' not in param_state:
                param_state['lookahead_slow_buff'] = torch.empty_like(fast_p)
                param_state['lookahead_slow_buff'].copy_(fast_p)
            slow = param_state['lookahead_slow_buff']
            slow.add_(fast_p - slow, alpha=group['lookahead_alpha'])
            fast_p.copy_(slow)

    def sync_lookahead(self):
        for group in self._base_optimizer.param_groups:
            self.update_slow(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group['lookahead_step'] += 1
            if group['lookahead_step'] % group['lookahead_k'] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


class NativeScaler:
    """timm/utils/cuda.py."""
    state_dict_key = "amp_scaler"

    def __init__(self, device="cpu"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode='norm', parameters=None, create_graph=False,
                 need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                nn.utils.clip_grad_norm_(parameters, clip_grad)      # dispatch_clip_grad, mode 'norm'
            self._scaler.step(optimizer)
            self._scaler.update()


@case(40)
def timm_lookahead_native_scaler():
    # timm train.py's train_one_epoch (10 batches an epoch); watched: the Lookahead, scaler: loss_scaler._scaler.
    torch.manual_seed(2)
    model = ResMLP()
    optimizer = Lookahead(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05))
    loss_scaler = NativeScaler()
    rec = Rec(model)
    data = teacher(2)
    accum_steps, last_idx = 2, 9

    def body(i):
        batch_idx = i % 10
        last_batch = batch_idx == last_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        x, y = data(i)
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
            if accum_steps > 1:
                loss /= accum_steps
        s = loss_scaler._scaler.get_scale()
        loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode='norm', parameters=model.parameters(),
                    need_update=need_update)
        if need_update:
            rec.after_update(loss_scaler._scaler, s)
            optimizer.zero_grad()
        if last_batch and hasattr(optimizer, 'sync_lookahead'):
            optimizer.sync_lookahead()
        return loss.item() * accum_steps
    return ns(model, optimizer._base_optimizer, loss_scaler._scaler, rec, body, watch_opt=optimizer)


# ------------------------------------------------------------------------------------------------- 3. torchlars LARS
def compute_adaptive_lr(param_norm, grad_norm, weight_decay, eps, trust_coef, out):
    """torchlars' adaptive-lr kernel, in Python."""
    if param_norm > 0 and grad_norm > 0:
        divisor = grad_norm.add(param_norm, alpha=weight_decay).add_(eps)
        out.copy_(param_norm / divisor * trust_coef)
    else:
        out.fill_(1.0)
    return out


class LARS(Optimizer):
    """torchlars/lars.py: wraps an arbitrary optimizer (super().__init__ never called)."""

    def __init__(self, optimizer, eps=1e-8, trust_coef=0.001):
        if eps < 0.0:
            raise ValueError('invalid epsilon value: , %f' % eps)
        if trust_coef < 0.0:
            raise ValueError("invalid trust coefficient: %f" % trust_coef)
        self.optim = optimizer
        self.eps = eps
        self.trust_coef = trust_coef
        self.adaptive_lr = torch.ones([])

    def __getstate__(self):
        lars_dict = {}
        lars_dict['eps'] = self.eps
        lars_dict['trust_coef'] = self.trust_coef
        lars_dict['adaptive_lr'] = self.adaptive_lr
        return (self.optim, lars_dict)

    def __setstate__(self, state):
        self.optim, lars_dict = state
        self.eps = lars_dict['eps']
        self.trust_coef = lars_dict['trust_coef']
        self.adaptive_lr = lars_dict['adaptive_lr']

    def __repr__(self):
        return '%s(%r)' % (self.__class__.__name__, self.optim)

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        return self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none)

    def add_param_group(self, param_group):
        return self.optim.add_param_group(param_group)

    @contextlib.contextmanager
    def hide_weight_decays(self):
        weight_decays = []
        for group in self.optim.param_groups:
            if 'weight_decay' in group:
                weight_decays.append(group['weight_decay'])
                group['weight_decay'] = 0
            else:
                weight_decays.append(None)
        try:
            yield weight_decays
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                if weight_decay is None:
                    continue
                group['weight_decay'] = weight_decay

    def apply_adaptive_lrs(self, weight_decays):
        with torch.no_grad():
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                if weight_decay is None:
                    weight_decay = 0.0
                for p in group['params']:
                    if p.grad is None:
                        continue
                    param_norm = p.norm()
                    grad_norm = p.grad.norm()
                    # The optimizer class has no method to change `dtype` of `adaptive_lr`.
                    adaptive_lr = compute_adaptive_lr(param_norm, grad_norm, weight_decay, self.eps,
                                                      self.trust_coef, self.adaptive_lr)
                    p.grad.add_(p.data, alpha=weight_decay)
                    p.grad.mul_(adaptive_lr)

    def step(self, *args, **kwargs):
        with self.hide_weight_decays() as weight_decays:
            self.apply_adaptive_lrs(weight_decays)
            return self.optim.step(*args, **kwargs)


@case(40)
def torchlars_lars_sgd():
    # torchlars README: LARS(optimizer=SGD(...), eps=1e-8, trust_coef=0.001); lr 4.8 = SimCLR's 0.3 x 4096 / 256.
    # Watched: the LARS wrapper.
    torch.manual_seed(3)
    model = plain_mlp()
    base_optimizer = torch.optim.SGD(model.parameters(), lr=4.8, momentum=0.9, weight_decay=1e-4)
    optimizer = LARS(optimizer=base_optimizer, eps=1e-8, trust_coef=0.001)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    return ns(model, base_optimizer, scaler, rec, amp_loop(model, optimizer, scaler, rec, teacher(3)),
              watch_opt=optimizer)


# --------------------------------------------------------------------------------------------------------- 4. LAMB
class Lamb(Optimizer):
    """cybertronai/pytorch-lamb lamb.py (paper v3: no bias correction)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam = adam
        super().__init__(params, defaults)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:
                    continue
                grad = p.grad.data
                if grad.is_sparse:
                    raise RuntimeError('Lamb does not support sparse gradients, consider SparseAdam instad.')
                state = self.state[p]
                if len(state) == 0:
                    state['step'] = 0
                    state['exp_avg'] = torch.zeros_like(p.data)
                    state['exp_avg_sq'] = torch.zeros_like(p.data)
                exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
                beta1, beta2 = group['betas']
                state['step'] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = group['lr']
                weight_norm = p.data.pow(2).sum().sqrt().clamp(0, 10)
                adam_step = exp_avg / exp_avg_sq.sqrt().add(group['eps'])
                if group['weight_decay'] != 0:
                    adam_step.add_(p.data, alpha=group['weight_decay'])
                adam_norm = adam_step.pow(2).sum().sqrt()
                if weight_norm == 0 or adam_norm == 0:
                    trust_ratio = 1
                else:
                    trust_ratio = weight_norm / adam_norm
                state['weight_norm'] = weight_norm
                state['adam_norm'] = adam_norm
                state['trust_ratio'] = trust_ratio
                if self.adam:
                    trust_ratio = 1
                p.data.add_(adam_step * (-step_size * trust_ratio))
        return loss


@case(40)
def lamb_trust_ratio():
    # pytorch-lamb's test_lamb.py: Lamb(model.parameters(), lr, weight_decay, betas=(.9, .999)); watched: the Lamb.
    torch.manual_seed(4)
    model = ResMLP()
    optimizer = Lamb(model.parameters(), lr=0.02, weight_decay=0.01, betas=(.9, .999))
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    return ns(model, optimizer, scaler, rec, amp_loop(model, optimizer, scaler, rec, teacher(4)))


# --------------------------------------------------------------------------------------- 5. bitsandbytes-style 8-bit
def _qmap(signed):
    t = torch.linspace(-1.0, 1.0, 256) if signed else torch.linspace(0.0, 1.0, 256)
    return t ** 3 if signed else t ** 4       # fine codes near 0, as bnb's dynamic maps


def quantize_blockwise(x, qmap, blocksize=256):
    flat = x.reshape(-1)
    pad = (-flat.numel()) % blocksize
    blocks = F.pad(flat, (0, pad)).view(-1, blocksize)
    absmax = blocks.abs().amax(1)
    normed = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    codes = torch.bucketize(normed, (qmap[1:] + qmap[:-1]) / 2).to(torch.uint8)
    return codes.reshape(-1)[:flat.numel()].clone(), absmax


def dequantize_blockwise(codes, absmax, qmap, shape, blocksize=256):
    pad = (-codes.numel()) % blocksize
    vals = qmap[F.pad(codes.long(), (0, pad)).view(-1, blocksize)] * absmax[:, None]
    return vals.reshape(-1)[:codes.numel()].reshape(shape)


class Adam8bit(Optimizer):
    """bitsandbytes' Optimizer2State / Adam8bit, reduced: 8-bit blockwise states for tensors of >= min_8bit_size
    elements (state1 / state2 uint8 codes, absmax1 / absmax2 per block, qmap1 / qmap2), 32-bit states otherwise."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, min_8bit_size=4096):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.min_8bit_size = min_8bit_size
        self.qmap1, self.qmap2 = _qmap(True), _qmap(False)

    def init_state(self, p):
        state = self.state[p]
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
        else:
            state["state1"], state["absmax1"] = quantize_blockwise(torch.zeros_like(p), self.qmap1)
            state["state2"], state["absmax2"] = quantize_blockwise(torch.zeros_like(p), self.qmap2)
            state["qmap1"], state["qmap2"] = self.qmap1, self.qmap2

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self.init_state(p)
                state["step"] += 1
                step = state["step"]
                eight_bit = state["state1"].dtype == torch.uint8
                if eight_bit:
                    m = dequantize_blockwise(state["state1"], state["absmax1"], state["qmap1"], p.shape)
                    v = dequantize_blockwise(state["state2"], state["absmax2"], state["qmap2"], p.shape)
                else:
                    m, v = state["state1"], state["state2"]
                g = p.grad.float()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                correction1 = 1 - beta1 ** step
                correction2 = math.sqrt(1 - beta2 ** step)
                step_size = group["lr"] * correction2 / correction1
                if group["weight_decay"] > 0.0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, v.sqrt().add_(group["eps"] * correction2), value=-step_size)
                if eight_bit:
                    state["state1"], state["absmax1"] = quantize_blockwise(m, state["qmap1"])
                    state["state2"], state["absmax2"] = quantize_blockwise(v, state["qmap2"])
        return loss


@case(40)
def adam8bit_blockwise_states():
    # bnb.optim.Adam8bit(model.parameters(), lr, betas=(0.9, 0.995)); watched: the Adam8bit.
    torch.manual_seed(5)
    model = ResMLP()
    optimizer = Adam8bit(model.parameters(), lr=3e-3, betas=(0.9, 0.995), weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    body = amp_loop(model, optimizer, scaler, rec, teacher(5), clip=1.0)
    c = ns(model, optimizer, scaler, rec, body)
    c.eight = [n for n, p in model.named_parameters() if p.numel() >= 4096]
    assert c.eight, "no tensor took 8-bit states"
    return c


# ---------------------------------------------------------------------------------- 6. transformers' Adafactor
@case(40)
def hf_adafactor_relative_step():
    # transformers.optimization.Adafactor's docstring ("relative_step=True ... lr=None") + AdafactorSchedule, the
    # Trainer's fp16 step (accelerate: unscale_ + clip_grad_norm_(max_grad_norm=1.0), scaler.step, update), the
    # scheduler stepped unless the step was skipped. Watched: the Adafactor.
    from transformers.optimization import Adafactor, AdafactorSchedule
    torch.manual_seed(6)
    model = ResMLP()
    optimizer = Adafactor(model.parameters(), scale_parameter=True, relative_step=True, warmup_init=False, lr=None)
    lr_scheduler = AdafactorSchedule(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(6)
    extra = {"lrs": []}

    def body(i):
        x, y = data(i)
        model.train()
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        if scaler.get_scale() >= s:                  # optimizer_step_was_skipped
            lr_scheduler.step()
        extra["lrs"].append(lr_scheduler.get_last_lr()[0])
        model.zero_grad()
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra)


# -------------------------------------------------------------------------------- 7. ColossalAI TorchAMPOptimizer
class OptimizerWrapper:
    """colossalai/interface/optimizer.py."""

    def __init__(self, optim: Optimizer):
        self.optim = optim

    @property
    def parameters(self):
        params = []
        for group in self.param_groups:
            params += group["params"]
        return params

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def defaults(self):
        return self.optim.defaults

    def add_param_group(self, *args, **kwargs):
        return self.optim.add_param_group(*args, **kwargs)

    def step(self, *args, **kwargs):
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def backward(self, loss, *args, **kwargs):
        loss.backward(*args, **kwargs)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, *args, **kwargs):
        self.optim.load_state_dict(*args, **kwargs)

    def clip_grad_by_norm(self, max_norm, norm_type=2.0, error_if_nonfinite=False, *args, **kwargs):
        return nn.utils.clip_grad_norm_(self.parameters, max_norm, norm_type, error_if_nonfinite)

    def unwrap(self):
        return self.optim


class TorchAMPOptimizer(OptimizerWrapper):
    """colossalai/booster/mixed_precision/fp16_torch.py."""

    def __init__(self, optim, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__(optim)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                           backoff_factor=backoff_factor, growth_interval=growth_interval)

    def backward(self, loss, *args, **kwargs):
        scaled_loss = self.scale_loss(loss)
        scaled_loss.backward(*args, **kwargs)

    def step(self, *args, **kwargs):
        out = self.scaler.step(self.optim, *args, **kwargs)
        self.scaler.update()
        return out

    def scale_loss(self, loss):
        return self.scaler.scale(loss)

    def unscale_grad(self):
        self.scaler.unscale_(self.optim)

    def clip_grad_by_norm(self, max_norm, norm_type=2.0, error_if_nonfinite=False, *args, **kwargs):
        self.unscale_grad()
        super().clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite, *args, **kwargs)


class TorchAMPModule(nn.Module):
    """colossalai's ModelWrapper + TorchAMPModule: the module's forward under autocast."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def unwrap(self):
        return self.module

    def forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=F16):
            return self.module(*args, **kwargs)


@case(40)
def colossalai_torch_amp_wrapper():
    # booster.boost(model, optimizer) with TorchAMP fp16 gives (TorchAMPModule, TorchAMPOptimizer); watched: those
    # two and optimizer.scaler.
    torch.manual_seed(7)
    net = ResMLP()
    optimizer = TorchAMPOptimizer(torch.optim.AdamW(net.parameters(), lr=3e-3))
    model = TorchAMPModule(net)
    criterion = nn.CrossEntropyLoss()
    rec = Rec(model)
    data = teacher(7)

    def body(i):
        x, y = data(i)
        outputs = model(x)
        loss = criterion(outputs, y)
        s = optimizer.scaler.get_scale()
        optimizer.backward(loss)                     # booster.backward(loss, optimizer)
        optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        rec.after_update(optimizer.scaler, s)
        optimizer.zero_grad()
        return loss.item()
    return ns(model, optimizer.optim, optimizer.scaler, rec, body, watch_opt=optimizer)


# -------------------------------------------------------------------------- 8. a wrapper stepping every k calls
class AccumulatingOptimizer:
    """A hand-written gradient-accumulation wrapper (the common research-repo pattern): the training loop calls
    zero_grad() and step() every batch; the wrapper clears and steps only at the k-th call (it owns the scaler)."""

    def __init__(self, optimizer, scaler, accumulation_steps):
        self.optimizer, self.scaler, self.k, self._calls = optimizer, scaler, accumulation_steps, 0
        self.on_update = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "calls": self._calls}

    def zero_grad(self, set_to_none=True):
        if self._calls % self.k == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        self._calls += 1
        if self._calls % self.k:
            return False
        s = self.scaler.get_scale()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.on_update is not None:
            self.on_update(s)
        return True


@case(48)
def accumulating_optimizer_wrapper():
    # watched: the AccumulatingOptimizer and its scaler.
    torch.manual_seed(8)
    model = ResMLP()
    scaler = torch.amp.GradScaler("cpu")
    optimizer = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=5e-3), scaler, 4)
    rec = Rec(model)
    optimizer.on_update = lambda s: rec.after_update(scaler, s)
    data = teacher(8, n=32)

    def body(i):
        optimizer.zero_grad()
        x, y = data(i)
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss / optimizer.k).backward()
        optimizer.step()
        return loss.item()
    return ns(model, optimizer.optimizer, scaler, rec, body, watch_opt=optimizer)


# ----------------------------------------------------------------------- 9. lr-0 group, then add_param_group
@case(40)
def lr0_group_then_add_param_group():
    # watched: the AdamW.
    torch.manual_seed(9)
    model = ResMLP()
    model.blocks.requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": model.embed.parameters(), "lr": 0.0},      # the stem: frozen by lr
                                   {"params": model.head.parameters(), "lr": 3e-3}], weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    stem0 = [p.detach().clone() for p in model.embed.parameters()]

    def unfreeze(i):
        if i == 9:                                   # after the 10th step: the backbone joins
            model.blocks.requires_grad_(True)
            optimizer.add_param_group({"params": list(model.blocks.parameters()), "lr": 1e-3})

    body = amp_loop(model, optimizer, scaler, rec, teacher(9), clip=1.0,
                    params=lambda: [p for g in optimizer.param_groups for p in g["params"]], after=unfreeze)

    def checked(i):
        out = body(i)
        if i == 39:
            assert all(torch.equal(a, b) for a, b in zip(stem0, model.embed.parameters())), "lr 0 moved the stem"
        return out
    return ns(model, optimizer, scaler, rec, checked)


# ------------------------------------------------------------------------------------------------------ 10. Prodigy
class Prodigy(Optimizer):
    """konstmish/prodigy prodigyopt/prodigy.py (slice_p 1, no FSDP)."""

    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0, decouple=True,
                 use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float('inf')):
        defaults = dict(lr=lr, betas=betas, beta3=beta3, eps=eps, weight_decay=weight_decay, d=d0, d0=d0, d_max=d0,
                        d_numerator=0.0, d_coef=d_coef, k=0, growth_rate=growth_rate,
                        use_bias_correction=use_bias_correction, decouple=decouple,
                        safeguard_warmup=safeguard_warmup)
        self.d0 = d0
        super().__init__(params, defaults)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()
        d_denom = 0.0
        group = self.param_groups[0]
        use_bias_correction = group['use_bias_correction']
        beta1, beta2 = group['betas']
        beta3 = group['beta3']
        if beta3 is None:
            beta3 = math.sqrt(beta2)
        k = group['k']
        d = group['d']
        d_max = group['d_max']
        d_coef = group['d_coef']
        lr = max(group['lr'] for group in self.param_groups)
        if use_bias_correction:
            bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
        else:
            bias_correction = 1
        dlr = d * lr * bias_correction
        growth_rate = group['growth_rate']
        decouple = group['decouple']
        d_numerator = group['d_numerator']
        d_numerator *= beta3
        for group in self.param_groups:
            decay = group['weight_decay']
            group_lr = group['lr']
            d0 = group['d0']
            safeguard_warmup = group['safeguard_warmup']
            if group_lr not in [lr, 0.0]:
                raise RuntimeError("Setting different lr values in different parameter groups is only supported "
                                   "for values of 0")
            for p in group['params']:
                if p.grad is None:
                    continue
                grad = p.grad.data
                if decay != 0 and not decouple:
                    grad.add_(p.data, alpha=decay)
                state = self.state[p]
                if 'step' not in state:
                    state['step'] = 0
                    state['s'] = torch.zeros_like(p.data).detach()
                    state['p0'] = p.detach().clone()
                    if beta1 > 0:
                        state['exp_avg'] = torch.zeros_like(p.data).detach()
                    state['exp_avg_sq'] = torch.zeros_like(p.data).detach()
                exp_avg_sq = state['exp_avg_sq']
                s = state['s']
                p0 = state['p0']
                if group_lr > 0.0:
                    # we use d / d0 instead of just d to avoid getting values that are too small
                    d_numerator += (d / d0) * dlr * torch.dot(grad.flatten(), (p0.data - p.data).flatten()).item()
                    if beta1 > 0:
                        exp_avg = state['exp_avg']
                        exp_avg.mul_(beta1).add_(grad, alpha=d * (1 - beta1))
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
                    if safeguard_warmup:
                        s.mul_(beta3).add_(grad, alpha=((d / d0) * d))
                    else:
                        s.mul_(beta3).add_(grad, alpha=((d / d0) * dlr))
                    d_denom += s.abs().sum().item()
        d_hat = d
        if d_denom == 0:
            return loss
        if lr > 0.0:
            d_hat = d_coef * d_numerator / d_denom
            if d == group['d0']:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * growth_rate)
        for group in self.param_groups:
            group['d_numerator'] = d_numerator
            group['d_denom'] = d_denom
            group['d'] = d
            group['d_max'] = d_max
            group['d_hat'] = d_hat
            decay = group['weight_decay']
            k = group['k']
            eps = group['eps']
            for p in group['params']:
                if p.grad is None:
                    continue
                grad = p.grad.data
                state = self.state[p]
                exp_avg_sq = state['exp_avg_sq']
                state['step'] += 1
                denom = exp_avg_sq.sqrt().add_(d * eps)
                if decay != 0 and decouple:
                    p.data.add_(p.data, alpha=-decay * dlr)
                if beta1 > 0:
                    exp_avg = state['exp_avg']
                    p.data.addcdiv_(exp_avg, denom, value=-dlr)
                else:
                    p.data.addcdiv_(grad, denom, value=-dlr * d)
            group['k'] = k + 1
        return loss


@case(40)
def prodigy_dadapt():
    # The prodigy README's `Prodigy(net.parameters(), lr=1., weight_decay=weight_decay)` with the Adam-style
    # use_bias_correction=True (d0 1e-6: d grows ~10^4-fold over the 40 steps; safeguard_warmup=True, diffusers'
    # DreamBooth-LoRA default, grows d too slowly to learn in 40 steps). Watched: the Prodigy.
    torch.manual_seed(10)
    model = ResMLP()
    optimizer = Prodigy(model.parameters(), lr=1.0, weight_decay=1e-4, use_bias_correction=True)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    extra = {"d": []}
    body = amp_loop(model, optimizer, scaler, rec, teacher(10), clip=1.0,
                    after=lambda i: extra["d"].append(optimizer.param_groups[0]["d"]))

    def checked(i):
        out = body(i)
        if i == 39:
            assert extra["d"][-1] > 1000 * extra["d"][0], extra["d"][::8]
        return out
    return ns(model, optimizer, scaler, rec, checked, extra)


# ------------------------------------------------------------------------------------------------------- 11. Ranger
class Ranger(Optimizer):
    """lessw2020/Ranger-Deep-Learning-Optimizer ranger.py: RAdam + Lookahead in one optimizer."""

    def __init__(self, params, lr=1e-3, alpha=0.5, k=6, N_sma_threshhold=5, betas=(.95, 0.999), eps=1e-5,
                 weight_decay=0):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f'Invalid slow update rate: {alpha}')
        defaults = dict(lr=lr, alpha=alpha, k=k, step_counter=0, betas=betas, N_sma_threshhold=N_sma_threshhold,
                        eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.N_sma_threshhold = N_sma_threshhold
        self.alpha = alpha
        self.k = k
        self.radam_buffer = [[None, None, None] for ind in range(10)]

    def step(self, closure=None):
        loss = None
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:
                    continue
                grad = p.grad.data.float()
                if grad.is_sparse:
                    raise RuntimeError('Ranger optimizer does not support sparse gradients')
                p_data_fp32 = p.data.float()
                state = self.state[p]
                if len(state) == 0:
                    state['step'] = 0
                    state['exp_avg'] = torch.zeros_like(p_data_fp32)
                    state['exp_avg_sq'] = torch.zeros_like(p_data_fp32)
                    state['slow_buffer'] = torch.empty_like(p.data)
                    state['slow_buffer'].copy_(p.data)
                else:
                    state['exp_avg'] = state['exp_avg'].type_as(p_data_fp32)
                    state['exp_avg_sq'] = state['exp_avg_sq'].type_as(p_data_fp32)
                exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
                beta1, beta2 = group['betas']
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                state['step'] += 1
                buffered = self.radam_buffer[int(state['step'] % 10)]
                if state['step'] == buffered[0]:
                    N_sma, step_size = buffered[1], buffered[2]
                else:
                    buffered[0] = state['step']
                    beta2_t = beta2 ** state['step']
                    N_sma_max = 2 / (1 - beta2) - 1
                    N_sma = N_sma_max - 2 * state['step'] * beta2_t / (1 - beta2_t)
                    buffered[1] = N_sma
                    if N_sma > self.N_sma_threshhold:
                        step_size = math.sqrt((1 - beta2_t) * (N_sma - 4) / (N_sma_max - 4) * (N_sma - 2) / N_sma
                                              * N_sma_max / (N_sma_max - 2)) / (1 - beta1 ** state['step'])
                    else:
                        step_size = 1.0 / (1 - beta1 ** state['step'])
                    buffered[2] = step_size
                if group['weight_decay'] != 0:
                    p_data_fp32.add_(p_data_fp32, alpha=-group['weight_decay'] * group['lr'])
                if N_sma > self.N_sma_threshhold:
                    denom = exp_avg_sq.sqrt().add_(group['eps'])
                    p_data_fp32.addcdiv_(exp_avg, denom, value=-step_size * group['lr'])
                else:
                    p_data_fp32.add_(exp_avg, alpha=-step_size * group['lr'])
                p.data.copy_(p_data_fp32)
                if state['step'] % group['k'] == 0:
                    slow_p = state['slow_buffer']
                    slow_p.add_(p.data - slow_p, alpha=self.alpha)
                    p.data.copy_(slow_p)
        return loss


@case(40)
def ranger_radam_lookahead():
    # Ranger(model.parameters(), lr=...) as the Ranger README writes it (lr 1e-2 to learn in 40 steps); watched:
    # the Ranger.
    torch.manual_seed(11)
    model = ResMLP()
    optimizer = Ranger(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    return ns(model, optimizer, scaler, rec, amp_loop(model, optimizer, scaler, rec, teacher(11)))


# ---------------------------------------------------------------------------------------------------- the test
@pytest.mark.parametrize("name", [pytest.param(n, marks=wrong(XFAIL[n]) if n in XFAIL else ()) for n in CASES])
def test_optimizer_loop_healthy(name, tmp_path):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, with the oracle
    if DEBUG:
        rec = ru.c.rec
        print(name, "steps", rec.n, "skipped", rec.skipped, "scales", sorted(set(rec.scales)), "loss",
              [round(v, 4) for v in ru.losses[::max(1, len(ru.losses) // 8)]], ru.losses[-1],
              {k: [round(float(x), 6) for x in v[::8]][:8] for k, v in ru.c.extra.items()})
    healthy(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)
    judge(rw)
