"""Healthy runs at ampdoctor's DEFAULT watch, thirtieth set: AUTOGRAD AND HOOK INFRASTRUCTURE that real training
code puts around an ordinary fp16 loop - hooks the user (or a library) registers on the watched modules, on the
optimizer, on tensors, globally on every module, saved-tensor hooks, anomaly mode, partial backward, meta-device
initialisation, optimizer-in-backward and a gradient-norm balancing objective through a double backward.
`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")` and nothing else; CPU fp16 autocast, a
real `torch.amp.GradScaler("cpu")` (case 10: bf16 autocast and no scaler, as that recipe runs), fixed seeds, one
intra-op thread, 40-48 iterations each. The harness is test_healthy_default28's (tests/codebase_harness.py): every
case runs twice,

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite; the case learned
  (the mean loss of the last fifth below `fall` x the first fifth's, or the case's own measure); probe_harness.
  Producer's forward hooks saw no module make inf/NaN from finite inputs; the gradients finite after every
  optimizer step that was not skipped; every weight finite at the end; skipped steps only the loss scaler's opening
  search (a first streak from step 0 of at most 4, then at most 2 isolated skips);
- the WATCHED run must train bitwise identically (`identical`): every loss, loss scale, skip, every optimizer
  step's gradients, the case's extras (what the user's hooks saw: norms, counts, saliencies, task weights), every
  final weight and buffer, the EMA copies, the optimizer's state_dict and the final scale; then (`judge`)
  w.report() after close() and ampdoctor.diagnose(run_dir) must hold no warning and no error (info is fine), exit
  code 0, no internal error, one recorded step per optimizer step, and no `ampdoctor: ...` Python warning during
  the run. A false alarm is a strict xfail (probe_harness.wrong: WrongAnswer only) whose reason quotes ampdoctor; a
  failing oracle or a difference in training is a plain failure.

Left to earlier files (grep -il of tests/test_healthy*.py): torch.utils.checkpoint in both modes and
checkpoint_sequential (default3, 9, 22, more5), selective checkpointing (default8), WGAN-GP / R1 / the AMP
gradient-penalty recipe (default3, 9, 18, 23, more5), torch.func / vmap per-sample gradients (default14, 22),
EMA / DINO / mean teachers (default4, 12, 13, 28, more6), parametrizations (default7, 8, 22), clip_grad_value_
(default8, 9, 26), SparseAdam (default12, 16, more3), SWA (default3, 13, 15, 22), warm restarts (default6, 12, 15,
16, 26), add_param_group (default11, 16, 26, 29), autocast(enabled=False) islands (many), channels_last (many),
two models on one scaler (default18, 28), PCGrad (default23), prune (default3).

The cases:
 1. opacus_grad_sample_hooks: Opacus' GradSampleModule pattern: a forward hook on every Linear keeps its input, a
    register_full_backward_hook computes the per-sample gradients (einsum of grad_output and input) from the scaled
    backward; after unscale_ the loop divides them by the scale, clips each sample's gradient to norm 1, sums, adds
    Gaussian noise (sigma 0.3, its own generator) and writes .grad (DP-SGD), then scaler.step / update;
 2. activation_offload_saved_tensor_hooks: the backbone's forward under torch.autograd.graph.save_on_cpu (CPU ->
    CPU copies), the head's under a user saved_tensors_hooks (torchtune-style offloading: pack = store in a dict,
    return a key; unpack = look it up), nested inside the first;
 3. optimizer_step_hooks_ema: Optimizer.register_step_pre_hook logs the unscaled gradient norm (scaler.step only
    calls optimizer.step on kept steps), register_step_post_hook updates an EMA copy (decay 0.9) and counts steps;
 4. global_module_hooks: torch.nn.modules.module.register_module_forward_hook (a FLOP/activation profiler's
    absmax per module class) and register_module_full_backward_hook (per-class grad_output norm) for the whole run,
    removed after it;
 5. dann_backward_hooks: domain-adversarial training with the gradient reversal written as a
    register_full_backward_hook on the domain head that returns -lambda x grad_input, and an auxiliary rotation
    head whose gradient is down-weighted by a register_full_backward_pre_hook (grad_output x 0.1); learned: the
    label loss on the source domain falls;
 6. detect_anomaly: every forward + backward under torch.autograd.detect_anomaly(check_nan=True) (the debugging
    switch people leave on); init_scale 2**10 so no scaled gradient overflows (anomaly mode raises on NaN);
 7. retain_grad_saliency: the model calls .retain_grad() on its hidden activation and registers a tensor hook on
    its logits; the input requires grad (saliency maps); the loop logs |dL/dx|, |dL/dh| (divided by the scale) and
    the logit-gradient absmax every step;
 8. backward_inputs_alternating: block-coordinate training: even steps `scaler.scale(loss).backward(inputs=
    encoder params)`, odd steps `inputs=head params` (the other block's .grad stays None), one AdamW over both,
    unscale_ + clip_grad_norm_(1.0);
 9. meta_init_to_empty: the model built under `with torch.device("meta")`, materialised with to_empty(device="cpu")
    and reset_parameters() per module from a fixed seed, its head made by torch.nn.utils.skip_init and initialised
    by hand (the large-model init path);
10. optimizer_in_backward: PyTorch's "fuse the optimizer step into the backward" tutorial: one Adam per parameter,
    stepped and zeroed in a register_post_accumulate_grad_hook; bf16 autocast, no scaler; watched with
    optimizer=None (there is no single optimizer). The report's steps are the 40 iterations: the optimizer
    steps one backward makes are that backward's step (wrong when written: every optimizer.step() call
    counted as a step, 40 x 12 = 480 steps, the every-200 sample inside a backward; record/optsink.py
    step_in_backward since);
11. gradnorm_multitask: GradNorm (Chen et al. 2018, alpha 1.5): two regression tasks on a shared trunk, learnable
    task weights (outside the model, their own Adam); per step the gradient norm of each weighted task loss w.r.t.
    the trunk's last Linear by autograd.grad(scaler.scale(w_i L_i), W, create_graph=True) divided by the scale,
    the GradNorm loss |G_i - mean(G) r_i^alpha| differentiated w.r.t. the task weights only, then the weighted total
    scaled and backpropagated, unscale_ + clip 1.0, step, update, task weights renormalised to sum 2;
12. vector_loss_backward_gradient: importance-weighted per-sample losses backpropagated as a vector,
    `scaler.scale(per_sample).backward(gradient=weights / n)`;
13. shrink_and_perturb: Ash & Adams' warm start: after step 24 every weight w <- 0.4 w + 0.01 N(0, 1) under no_grad
    and the AdamW state cleared; learned: the loss jumps > 1.5x and recovers below 0.6x both the start and the jump;
14. root_and_graph_hooks: a forward pre hook (with_kwargs) on the ROOT standardising the input, a full backward hook
    on the root (the input requires grad), torch.autograd.graph.register_multi_grad_hook over the blocks'
    parameters, a prehook on the loss's grad_fn (checked: it saw exactly the scale each step);
15. jvp_jacobian_penalty: lambda ||J v||^2 by forward-mode AD through the watched model (forward_ad dual tensors on
    even steps, torch.func.jvp on odd ones), then reverse-mode through the tangent.

Result when written: 15/15 quiet, no false alarm, no `ampdoctor: ...` warning, every run bitwise identical with and
without the watch (extras included: what the user's hooks saw). Quiet also at every=1 (checked by hand). The only
findings were info (gradnorm_multitask: `overflow at heads.1 step 0 ... GradScaler skipped them and lowered the
scale, as designed` and `skipped_steps ... a normal rate`). Note on 2: the oracle's own forward hooks (Producer)
save tensors of their own into the autograd graph, so the number of tensors the user's saved_tensors_hooks pack is
not compared between the twins. Note on 10: with optimizer=None the watch counts every Optimizer.step() call (12 per
iteration, one per parameter's optimizer). The file takes ~6 s.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.autograd.forward_ad as fwAD

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import wrong  # noqa: E402
from scenarios import gen, one_thread  # noqa: E402
from codebase_harness import (DEBUG, Rec, healthy, identical, judge, ns, registrar,  # noqa: E402
                             run)

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
F16 = torch.float16
CASES: dict = {}
XFAIL: dict[str, str] = {}
GLOBAL_HANDLES: list = []          # global module hooks a case registered (removed after each test, whatever happens)

case = registrar(CASES)


# ------------------------------------------------------------------------------------------------------ data, model
W_T = torch.randn(16, 4, generator=gen(3000))


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

    def features(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = x + b(x)
        return x

    def forward(self, x):
        return self.head(self.features(x))


def plain_mlp(h=64):
    return nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 4))


def amp_loop(model, optimizer, scaler, rec, data, clip=None, after=None, ctx=None):
    """The plain torch.amp recipe: autocast forward, scale(loss).backward(), [unscale_ + clip_grad_norm_], step,
    update, zero_grad(set_to_none=True). `ctx()`: a context around forward + backward."""
    def body(i):
        x, y = data(i)
        with ctx() if ctx is not None else torch.enable_grad():
            with torch.autocast("cpu", dtype=F16):
                loss = F.cross_entropy(model(x), y)
            s = scaler.get_scale()
            scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        if after is not None:
            after(i)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return body


def fell(r, fall=0.8):
    """The mean loss of the last fifth below `fall` x the first fifth's."""
    ls = r.losses
    k = max(3, len(ls) // 5)
    assert sum(ls[-k:]) / k < fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)


def extra_fell(key, fall=0.8):
    """learned: the mean of the last fifth of extra[key] below `fall` x the first fifth's (and all finite)."""
    def check(r):
        v = [float(t) for t in r.c.extra[key]]
        assert all(map(lambda t: t == t and abs(t) != float("inf"), v)), v
        k = max(3, len(v) // 5)
        assert sum(v[-k:]) / k < fall * sum(v[:k]) / k, (sum(v[:k]) / k, sum(v[-k:]) / k)
    return check


# ----------------------------------------------------------------------- 1. Opacus-style per-sample gradients
class GradSampler:
    """Opacus GradSampleModule, reduced: forward hooks keep each Linear's input, full backward hooks turn the
    grad_output into per-sample gradients (p.grad_sample, of the SCALED loss)."""

    def __init__(self, model):
        self.acts = {}
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.register_forward_hook(self._fwd)
                mod.register_full_backward_hook(self._bwd)

    def _fwd(self, mod, inp, out):
        self.acts[mod] = inp[0].detach()

    def _bwd(self, mod, grad_input, grad_output):
        a, g = self.acts.pop(mod).float(), grad_output[0].detach().float()
        mod.weight.grad_sample = torch.einsum("ni,nj->nij", g, a)
        mod.bias.grad_sample = g.clone()


def dp_clipped(r):
    """learned, and the per-sample clipping was in force on every step (some sample's norm above C)."""
    fell(r)
    assert min(r.c.extra["clipped_share"]) > 0, r.c.extra["clipped_share"]


@case(48, learned=dp_clipped)
def opacus_grad_sample_hooks():
    torch.manual_seed(1)
    model = plain_mlp()
    GradSampler(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(1)
    noise = gen(1001)
    C, sigma = 1.0, 0.3
    extra = {"clipped_share": []}

    def body(i):
        x, y = data(i)
        n = x.shape[0]
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        params = list(model.parameters())
        gs = [p.grad_sample * (n / s) for p in params]           # per-sample gradients of the per-sample loss
        norms = torch.stack([g.reshape(n, -1).norm(dim=1) for g in gs]).norm(dim=0)
        factor = (C / (norms + 1e-6)).clamp(max=1.0)
        extra["clipped_share"].append(float((factor < 1).float().mean()))
        with torch.no_grad():
            for p, g in zip(params, gs):
                summed = torch.einsum("n,n...->...", factor, g)
                p.grad = (summed + sigma * C * torch.randn(p.shape, generator=noise)) / n
                del p.grad_sample
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 2. saved-tensor hooks (offloading)
class Offloader:
    """torchtune-style activation offloading reduced to CPU: pack stores the tensor under a key, unpack fetches it."""

    def __init__(self):
        self.store, self.n, self.packed = {}, 0, []

    def pack(self, t):
        self.n += 1
        self.store[self.n] = t.detach().clone()
        return self.n

    def unpack(self, key):
        return self.store[key]

    def new_step(self):
        self.packed.append(len(self.store))
        self.store.clear()


def offloaded(r):
    """learned, and the head's saved tensors went through the user's hooks on every step."""
    ls, k = r.losses, 8
    assert sum(ls[-k:]) / k < 0.8 * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)
    assert len(r.c.off.packed) == len(ls) and min(r.c.off.packed) >= 2, r.c.off.packed


@case(40, learned=offloaded)
def activation_offload_saved_tensor_hooks():
    torch.manual_seed(2)
    model = ResMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(2)
    off = Offloader()
    extra = {}                             # (the oracle's forward hooks save tensors of their own: no count compared)

    def body(i):
        x, y = data(i)
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            with torch.autocast("cpu", dtype=F16):
                h = model.features(x)
                with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
                    logits = model.head(h)
                loss = F.cross_entropy(logits, y)
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        off.new_step()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    c = ns(model, optimizer, scaler, rec, body, extra)
    c.off = off
    return c


# ----------------------------------------------------------------------- 3. optimizer step hooks
def hooks_ran(r):
    """learned, and the pre hook ran once per kept step, the post hook as often."""
    assert len(r.c.extra["gnorm"]) == len(r.c.extra["ema_steps"]) == r.c.rec.n - len(r.c.rec.skipped) > 30
    ls, k = r.losses, 8
    assert sum(ls[-k:]) / k < 0.8 * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)


@case(40, learned=hooks_ran)
def optimizer_step_hooks_ema():
    torch.manual_seed(3)
    model = ResMLP()
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    extra = {"gnorm": [], "ema_steps": []}

    def pre(opt, args, kwargs):
        gs = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        extra["gnorm"].append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])))

    @torch.no_grad()
    def post(opt, args, kwargs):
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 0.1)
        extra["ema_steps"].append(len(extra["ema_steps"]))

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)

    return ns(model, optimizer, scaler, rec, amp_loop(model, optimizer, scaler, rec, teacher(3)), extra,
              others={"ema": ema})


# ----------------------------------------------------------------------- 4. global module hooks
@case(40)
def global_module_hooks():
    from torch.nn.modules.module import register_module_forward_hook, register_module_full_backward_hook
    torch.manual_seed(4)
    model = ResMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    extra = {"fwd": [], "bwd": []}
    owned = set(map(id, model.modules()))            # the profiler looks at this model's modules only

    def fwd(mod, inp, out):
        if id(mod) in owned and torch.is_tensor(out):
            extra["fwd"].append((type(mod).__name__, out.detach().abs().max().float()))

    def bwd(mod, gin, gout):
        if id(mod) in owned and gout and torch.is_tensor(gout[0]):
            extra["bwd"].append((type(mod).__name__, gout[0].detach().float().norm()))

    GLOBAL_HANDLES.append(register_module_forward_hook(fwd))
    GLOBAL_HANDLES.append(register_module_full_backward_hook(bwd))
    inner = amp_loop(model, optimizer, scaler, rec, teacher(4), clip=1.0)

    def body(i):
        out = inner(i)
        if i == CASES["global_module_hooks"].iters - 1:
            while GLOBAL_HANDLES:
                GLOBAL_HANDLES.pop().remove()
        return out
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 5. DANN with backward hooks
class DANN(nn.Module):
    def __init__(self, h=64):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.label = nn.Linear(h, 4)
        self.domain = nn.Sequential(nn.Linear(h, 32), nn.ReLU(), nn.Linear(32, 2))
        self.aux = nn.Linear(h, 2)

    def forward(self, x):
        f = self.trunk(x)
        return self.label(f), self.domain(f), self.aux(f)


def dann_learned(r):
    """The source label loss fell; the reversed gradient kept the domain head from separating the domains."""
    extra_fell("cls", 0.75)(r)
    dom = [float(t) for t in r.c.extra["dom"]]
    assert sum(dom[-9:]) / 9 > 0.5, dom[-9:]


@case(48, learned=dann_learned)
def dann_backward_hooks():
    torch.manual_seed(5)
    model = DANN()
    lam = 0.3
    model.domain.register_full_backward_hook(lambda m, gin, gout: (-lam * gin[0],))
    model.aux.register_full_backward_pre_hook(lambda m, gout: (0.1 * gout[0],))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    src = teacher(5, n=32)
    shift = torch.randn(16, generator=gen(5005)) * 0.7
    extra = {"cls": [], "dom": []}

    def body(i):
        xs, ys = src(i)
        xt = torch.randn(32, 16, generator=gen(6000 + i)) * 1.3 + shift
        x = torch.cat([xs, xt])
        d = torch.cat([torch.zeros(32, dtype=torch.long), torch.ones(32, dtype=torch.long)])
        with torch.autocast("cpu", dtype=F16):
            lab, dom, aux = model(x)
            l_cls = F.cross_entropy(lab[:32], ys)
            l_dom = F.cross_entropy(dom, d)
            l_aux = F.cross_entropy(aux, (x[:, 0] > 0).long())
            loss = l_cls + l_dom + l_aux
        extra["cls"].append(l_cls.detach())
        extra["dom"].append(l_dom.detach())
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 6. anomaly mode
@case(40)
def detect_anomaly():
    torch.manual_seed(6)
    model = ResMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    rec = Rec(model)
    return ns(model, optimizer, scaler, rec,
              amp_loop(model, optimizer, scaler, rec, teacher(6), clip=1.0,
                       ctx=lambda: torch.autograd.detect_anomaly(check_nan=True)))


# ----------------------------------------------------------------------- 7. retain_grad / saliency
class SaliencyNet(ResMLP):
    """Keeps its hidden activation (retain_grad) and hooks its logits' gradient, as saliency / Grad-CAM code does."""

    def __init__(self):
        super().__init__()
        self.h = None
        self.logit_grad = []

    def forward(self, x):
        h = self.features(x)
        if h.requires_grad:
            h.retain_grad()
        self.h = h
        out = self.head(h)
        if out.requires_grad:
            out.register_hook(lambda g: self.logit_grad.append(g.detach().abs().max().float()))
        return out


@case(40)
def retain_grad_saliency():
    torch.manual_seed(7)
    model = SaliencyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(7)
    extra = {"dx": [], "dh": [], "logit": model.logit_grad}

    def body(i):
        x, y = data(i)
        x = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        extra["dx"].append(x.grad.float().abs().sum(1).mean() / s)
        extra["dh"].append(model.h.grad.float().norm() / s)
        model.h = None
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 8. backward(inputs=...) alternating
@case(48)
def backward_inputs_alternating():
    torch.manual_seed(8)
    model = ResMLP()
    enc = list(model.embed.parameters()) + list(model.blocks.parameters())
    head = list(model.head.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(8)

    def body(i):
        x, y = data(i)
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
        s = scaler.get_scale()
        scaler.scale(loss).backward(inputs=enc if i % 2 == 0 else head)
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body)


# ----------------------------------------------------------------------- 9. meta-device init
@case(40)
def meta_init_to_empty():
    with torch.device("meta"):
        model = ResMLP()
    model.to_empty(device="cpu")
    torch.manual_seed(9)
    for mod in model.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    model.head = nn.utils.skip_init(nn.Linear, 64, 4)
    with torch.no_grad():
        nn.init.trunc_normal_(model.head.weight, std=0.02)
        model.head.bias.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    return ns(model, optimizer, scaler, rec, amp_loop(model, optimizer, scaler, rec, teacher(9), clip=1.0))


# ----------------------------------------------------------------------- 10. optimizer in backward
class PerParam:
    """The per-parameter optimizers of the optimizer-in-backward recipe, with a state_dict for the comparison."""

    def __init__(self, opts):
        self.opts = opts

    def state_dict(self):
        return {i: o.state_dict() for i, o in enumerate(self.opts.values())}


@case(40)
def optimizer_in_backward():
    torch.manual_seed(10)
    model = ResMLP()
    opts = {p: torch.optim.Adam([p], lr=3e-3) for p in model.parameters()}
    rec = Rec(model)
    data = teacher(10)
    extra = {"gnorm": []}

    def hook(p):
        extra["gnorm"].append(p.grad.detach().norm())
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def body(i):
        x, y = data(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        rec.step(None, False)
        return loss.item()
    # steps: the iterations (the 12 optimizer steps of one backward are one step); the hook ran for every parameter
    c = ns(model, PerParam(opts), None, rec, body, extra, steps=lambda: len(extra["gnorm"]) // 12)
    c.watch_opt = None                        # watch(model, optimizer=None, scaler=None): no one optimizer exists
    return c


# ----------------------------------------------------------------------- 11. GradNorm
class TwoTask(nn.Module):
    def __init__(self, h=64):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(h, 1), nn.Linear(h, 1)])

    def forward(self, x):
        f = self.trunk(x)
        return [hd(f).squeeze(-1) for hd in self.heads]


@case(48)
def gradnorm_multitask():
    torch.manual_seed(11)
    model = TwoTask()
    wa, wb = torch.randn(16, generator=gen(1101)), torch.randn(16, generator=gen(1102))
    weights = torch.ones(2, requires_grad=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w_opt = torch.optim.Adam([weights], lr=2e-2)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    alpha = 1.5
    shared = model.trunk[2].weight
    extra = {"weights": [], "l0": []}

    def body(i):
        g = gen(1100_000 + i)
        x = torch.randn(64, 16, generator=g)
        ys = [x @ wa, 10.0 * torch.tanh(x @ wb)]
        with torch.autocast("cpu", dtype=F16):
            outs = model(x)
        losses = torch.stack([F.mse_loss(o.float(), t) for o, t in zip(outs, ys)])
        if i == 0:
            extra["l0"].append(losses.detach())
        s = scaler.get_scale()
        G = []
        for k in range(2):
            gk, = torch.autograd.grad(scaler.scale(weights[k] * losses[k]), shared, retain_graph=True,
                                      create_graph=True)
            G.append((gk / s).norm())
        G = torch.stack(G)
        ratio = losses.detach() / extra["l0"][0]
        target = (G.mean() * (ratio / ratio.mean()) ** alpha).detach()
        gn_loss = (G - target).abs().sum()
        w_opt.zero_grad(set_to_none=True)
        wgrad, = torch.autograd.grad(gn_loss, weights, retain_graph=True)
        total = (weights.detach() * losses).sum()
        scaler.scale(total).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        if torch.isfinite(wgrad).all():
            weights.grad = wgrad
            w_opt.step()
            with torch.no_grad():
                weights.clamp_(min=1e-3)
                weights.mul_(2 / weights.sum())
        extra["weights"].append(weights.detach().clone())
        optimizer.zero_grad(set_to_none=True)
        return losses.sum().item()
    return ns(model, optimizer, scaler, rec, body, extra, others={"w": {"weights": weights}})


# ----------------------------------------------------------------------- 12. vector loss, backward(gradient=)
@case(40)
def vector_loss_backward_gradient():
    # Importance-weighted per-sample losses backpropagated as a VECTOR: scaler.scale(per_sample).backward(
    # gradient=weights / n) (torch.autograd.backward's grad_tensors); the logged loss is the weighted mean.
    torch.manual_seed(12)
    model = ResMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(12)

    def body(i):
        x, y = data(i)
        with torch.autocast("cpu", dtype=F16):
            per = F.cross_entropy(model(x), y, reduction="none")
        wts = (0.5 + torch.rand(x.shape[0], generator=gen(12_000 + i))) / x.shape[0]
        s = scaler.get_scale()
        scaler.scale(per).backward(gradient=wts)
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return float((per.detach().float() * wts).sum())
    return ns(model, optimizer, scaler, rec, body)


# ----------------------------------------------------------------------- 13. shrink and perturb
SP_AT = 24


def recovered(r):
    """Every loss finite; after the shrink the loss jumped and then fell below both the start and the jump."""
    ls, k = r.losses, 4
    start, end, jump = sum(ls[:k]) / k, sum(ls[-k:]) / k, ls[SP_AT + 1]
    assert jump > 1.5 * ls[SP_AT - 1], (ls[SP_AT - 1], jump)
    assert end < 0.6 * start and end < 0.6 * jump, (start, jump, end)


@case(48, learned=recovered)
def shrink_and_perturb():
    # Ash & Adams 2020 warm-starting: after step 24's update every weight w <- 0.4 w + 0.01 N(0, 1) under no_grad and
    # the AdamW state dropped (optimizer.state.clear()), then training goes on (new data arrives).
    torch.manual_seed(13)
    model = ResMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    noise = gen(13_013)

    @torch.no_grad()
    def after(i):
        if i == SP_AT:
            for p in model.parameters():
                p.mul_(0.4).add_(0.01 * torch.randn(p.shape, generator=noise))
            optimizer.state.clear()
    return ns(model, optimizer, scaler, rec, amp_loop(model, optimizer, scaler, rec, teacher(13), clip=1.0,
                                                       after=after))


# ----------------------------------------------------------------------- 14. root and graph hooks
def root_hooks_ran(r):
    """learned; the multi-grad hook saw all 8 block gradients each step, the loss node's prehook the scale, the root
    backward hook a finite input gradient each step."""
    fell(r)
    ex, n = r.c.extra, len(r.losses)
    assert ex["ready"] == [8] * n, ex["ready"]
    assert [float(g) for g in ex["loss_grad"]] == r.c.rec.scales, ex["loss_grad"][:3]
    assert len(ex["root_gin"]) == n and all(torch.isfinite(g) for g in ex["root_gin"])


@case(40, learned=root_hooks_ran)
def root_and_graph_hooks():
    # Hooks on the ROOT module (a forward pre hook with kwargs standardising the input, a full backward hook logging
    # the input gradient), torch.autograd.graph.register_multi_grad_hook over the blocks' parameters (an FSDP-like
    # "all gradients of this unit ready" callback counting) and a grad_fn prehook on the loss node.
    torch.manual_seed(14)
    model = ResMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(14)
    extra = {"ready": [], "root_gin": [], "loss_grad": []}

    def standardise(mod, args, kwargs):
        x = args[0]
        return ((x - x.mean(0, keepdim=True)) / (x.std(0, keepdim=True) + 1e-5),), kwargs

    model.register_forward_pre_hook(standardise, with_kwargs=True)
    model.register_full_backward_hook(lambda m, gin, gout: extra["root_gin"].append(
        None if gin[0] is None else gin[0].detach().float().norm()))

    def body(i):
        x, y = data(i)
        x = x.requires_grad_(True)
        with torch.autocast("cpu", dtype=F16):
            loss = F.cross_entropy(model(x), y)
        blocks = [p for p in model.blocks.parameters()]
        h = torch.autograd.graph.register_multi_grad_hook(
            blocks, lambda gs: extra["ready"].append(sum(g is not None for g in gs)))
        loss.grad_fn.register_prehook(lambda gout: extra["loss_grad"].append(gout[0].detach().float().clone()))
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        h.remove()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra)


# ----------------------------------------------------------------------- 15. forward-mode AD in the loss
def jvp_ran(r):
    fell(r)
    assert all(float(p) > 0 for p in r.c.extra["jv"]), r.c.extra["jv"][:4]


@case(40, learned=jvp_ran)
def jvp_jacobian_penalty():
    # A Jacobian penalty lambda ||J v||^2 (random tangent v) computed by FORWARD-mode AD through the watched model,
    # then reverse-mode through it (sCM / consistency-model style JVPs): even steps by torch.autograd.forward_ad
    # dual tensors, odd steps by torch.func.jvp; the primal output gives the cross-entropy.
    torch.manual_seed(15)
    model = plain_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    rec = Rec(model)
    data = teacher(15)
    extra = {"jv": []}

    def body(i):
        x, y = data(i)
        v = torch.randn(x.shape, generator=gen(15_000 + i))
        with torch.autocast("cpu", dtype=F16):
            if i % 2 == 0:
                with fwAD.dual_level():
                    out, jv = fwAD.unpack_dual(model(fwAD.make_dual(x, v)))
            else:
                out, jv = torch.func.jvp(model, (x,), (v,))
            pen = jv.float().pow(2).mean()
            loss = F.cross_entropy(out, y) + 1e-2 * pen
        extra["jv"].append(pen.detach())
        s = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        rec.after_update(scaler, s)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return ns(model, optimizer, scaler, rec, body, extra)


# ---------------------------------------------------------------------------------------------------- the test
@pytest.fixture
def no_global_hooks():
    yield
    while GLOBAL_HANDLES:
        GLOBAL_HANDLES.pop().remove()


@pytest.mark.parametrize("name", [pytest.param(n, marks=wrong(XFAIL[n]) if n in XFAIL else ()) for n in CASES])
def test_hook_infrastructure_healthy(name, tmp_path, no_global_hooks):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, with the oracle
    if DEBUG:
        rec = ru.c.rec
        print(name, "steps", rec.n, "skipped", rec.skipped, "scales", sorted(set(map(str, rec.scales))), "loss",
              [round(v, 4) for v in ru.losses[::max(1, len(ru.losses) // 8)]], ru.losses[-1])
    healthy(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)
    judge(rw)
