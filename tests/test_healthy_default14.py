"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`, nothing else; about half
also at `every=1`, the per-layer statistics path), fourteenth set: COMMON PYTORCH INFRASTRUCTURE FEATURES that are
not model architectures but change how modules are called, what their hooks see, or how gradients flow - the
places where a watcher that hooks every module can break. Tiny models (hidden 16-64), 30-36 steps each, fixed seeds,
CPU, fp16 autocast + `torch.amp.GradScaler("cpu")` (default growth_interval 2000: the scale never grows here).
Not covered by tests/test_healthy*.py (checked by grep): torch.func (functional_call, stack_module_state,
vmap, autograd.grad with create_graph inside the forward), custom autograd Functions under `torch.amp.custom_fwd`,
lazy modules, one module registered several times in a ModuleList, user hooks that rewrite a module's input/output,
and dispatch-mode instrumentation (FlopCounterMode, torch.profiler).

Each run is first asserted healthy by the test's own oracle (`Fit.finish`): every loss finite; the mean of the last
k losses below a stated factor of the first k; GradScaler's first search took at most 4 halvings, after it only
the few single halvings said per case (none unless said; never two running) and the scale stayed >= 1024; every
parameter finite at the end; plus what makes the case what it is (below). Then it is
judged: no warning and no error (info is fine), exit code 0, ampdoctor did not switch itself off
(`summary.internal_error`, `summary.crash`), and it recorded every step (and, at every=1, module records).

Cases:
 1. [default, every=1] a model ensemble as in PyTorch's "Model ensembling" tutorial: 4 MLPs stacked with
    `torch.func.stack_module_state` into an `nn.ParameterDict`, run with `torch.vmap` over
    `torch.func.functional_call` on a 'meta' copy of the base model kept OUT of the module tree; every member fits
    its own teacher (each member's loss falls);
 2. [default, every=1] the same ensemble with its template REGISTERED as a submodule (`self.base = deepcopy(member0)
    .requires_grad_(False)`; TorchRL's EnsembleModule likewise registers `self.module` and calls it through
    `torch.vmap`): the template's hooks fire inside vmap, on batched tensors;
 3. [default, every=1] a hypernetwork: a task embedding -> MLP generates per-task weight deltas for a registered
    target net, called through `functional_call(self.target, {name: base + delta}, x)` (the target's own forward
    hooks fire with substituted parameters; its own parameters get gradients through the sum); init_scale 8192
    and up to 2 later single backoffs (the generated weights' fp16 gradients are O(1));
 4. [default, every=1] the pure hypernetwork: the target is a weightless template on the 'meta' device
    (`mlp().to("meta")`, registered, in no optimizer) and every weight it uses is generated;
 5. [default, every=1] MAML on a family of linear tasks (Finn et al. 2017, the learn2learn/higher pattern): an
    inner SGD step inside the forward by `torch.autograd.grad(create_graph=True)` on an UNSCALED fp16 support loss,
    the query loss through `functional_call` with the adapted weights, one scaled outer backward (double backward
    through every module); up to 3 later single backoffs;
 6. [autograd, func] a physics-informed net (u' = cos 2x, u(0) = 0) whose loss needs du/dx inside the forward: by
    `torch.autograd.grad(create_graph=True)` (DeepXDE's way) or by `torch.func.grad` over the registered net; the
    fit reaches u = sin(2x)/2 within 0.2;
 7. [default, every=1] custom autograd Functions with `torch.amp.custom_fwd(device_type="cpu",
    cast_inputs=torch.float32)` (an RMSNorm with a hand-written backward, apex/flash-attn style) and
    `custom_fwd`/`custom_bwd` without casting (a fused SwiGLU in fp16, its backward by hand); both backwards pass
    `gradcheck` in fp64 and are counted as called on every step; the norm ran in fp32, the Linear after it in fp16;
 8. lazy modules (`LazyConv2d`, `LazyBatchNorm2d`, `LazyLinear`) materialised by a dry run before the optimizer and
    the watch, as the docs prescribe;
 9. [default, every=1] ALBERT-style weight sharing behind a DataParallel-like wrapper: `Wrapper.module` holds a
    tiny LM whose one block sits three times in an `nn.ModuleList([block] * 3)` (one module, three calls per
    forward, named once), the output head tied to the embedding (`head.weight = embed.weight`);
10. an `nn.LSTMCell` unrolled over 12 time steps (one module called 12 times per forward) feeding an
    `nn.GRUCell` decoder unrolled 4 times;
11. [default, every=1] user hooks on the watched model, registered before the watch: a forward pre-hook on the root
    that standardises the input, a forward hook that REPLACES a layer's output (feature noise), a feature-extraction
    hook whose stored activations feed an auxiliary feature-matching loss, and a tensor hook on an activation that
    flips and scales its gradient (gradient reversal, DANN); two forwards per step (source and target domain);
12. [default, every=1] instrumentation around training steps: `torch.utils.flop_counter.FlopCounterMode` (a
    TorchDispatchMode) over steps 0-1 and `torch.profiler.profile` with `record_function` over steps 5-8, as MFU
    loggers do; the FLOP count is non-zero and the profile holds the labelled range.

Also tried while writing and quiet, so not kept: a torchaudio-style module returning a complex STFT, a GCN whose
layers take a sparse COO adjacency (`torch.sparse.mm`), jagged nested tensors (`torch.jagged`) through Linears.

Results: 22 runs, the same on the default oneDNN ISA and with ONEDNN_MAX_CPU_ISA=AVX2 / AVX512_CORE_BF16.

What ampdoctor got wrong (5 runs, 3 designs; all fixed since): it switched itself off at step 0 of a healthy run (the
report then silent, its verdict "ampdoctor stopped watching at step 0 after an internal error"):
  - case 2 [default, every=1] and case 6 [func]: a torch.func transform (torch.vmap, torch.func.grad) over a
    REGISTERED module hands its hooks wrapped tensors (BatchedTensor / GradTrackingTensor) without storage;
    record/cpustats.stats called `data_ptr()` on one -> RuntimeError. Now stats.is_measurable (and the headroom)
    skip such wrappers;
  - case 4 [default, every=1]: a registered module whose parameters are on the 'meta' device (a functional_call
    template) -> record/params.weight_amax -> NotImplementedError "Cannot copy out of meta tensor". Now the watch's
    parameter list leaves meta parameters out.

Right: a vmap ensemble over stack_module_state with an unregistered meta template (and, since the fixes, with it
registered); the meta template of a hypernetwork; torch.func.grad inside the forward; functional_call with substituted
parameters on a registered target; autograd.grad(create_graph=True) inside the forward (MAML's unscaled inner loss
and double backward, a PINN's du/dx) with later single backoffs read as normal; custom autograd Functions under
custom_fwd/custom_bwd (fp32-cast and fp16); lazy modules; a block registered three times and called thrice, tied
head, behind a `.module` wrapper; RNN cells unrolled 12 + 4 times; user hooks that rewrite inputs, outputs and
gradients; FlopCounterMode and torch.profiler around steps - all quiet at the default sampling and at every=1.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state

import ampdoctor
from scenarios import EVERY, alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
FP16 = dict(device_type="cpu", dtype=torch.float16)

# --- harness ----------------------------------------------------------------------------------------------------------
class Fit:
    """The user's loop pieces: zero_grad -> forward under fp16 autocast -> scale(loss).backward -> unscale_ ->
    clip_grad_norm_ -> step -> update, under `ampdoctor.watch(model, optimizer=opt, scaler=sc[, every])`."""

    def __init__(self, model, opt=None, lr=3e-3, every=None, clip=1.0, params=None, later=0, init_scale=65536.0):
        self.model = model
        self.params = list(params if params is not None else model.parameters())
        self.opt = opt or torch.optim.AdamW(self.params, lr=lr)
        self.sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
        self.init_scale = init_scale
        self.clip, self.every, self.later, self.losses, self.scales = clip, every, later, [], []
        self.w = ampdoctor.watch(model, optimizer=self.opt, scaler=self.sc,
                                 **({} if every is None else {"every": every}))

    def step(self, loss_fn):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(**FP16):
            loss = loss_fn()
        self.sc.scale(loss).backward()
        self.sc.unscale_(self.opt)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.sc.step(self.opt)
        self.sc.update()
        self.losses.append(loss.item())
        self.scales.append(self.sc.get_scale())
        return loss

    def finish(self, fall=0.7, k=5):
        """The oracle, then the judgement; returns the report."""
        self.w.close()
        L, S = self.losses, [self.init_scale] + self.scales
        assert all(map(math.isfinite, L)), L
        assert sum(L[-k:]) / k < fall * sum(L[:k]) / k, L
        drops = [i for i, (a, b) in enumerate(zip(S, S[1:])) if b < a]
        search = next(k for k in range(len(drops) + 1) if k == len(drops) or drops[k] != k)
        later = drops[search:]              # after the first search: single halvings only, few, scale >= 1024
        assert search <= 4 and len(later) <= self.later and all(b - a > 1 for a, b in zip(later, later[1:])), S
        assert min(S) >= 1024, S
        assert all(torch.isfinite(p).all() for p in self.params if p.device.type != "meta")
        rep = self.w.report()
        summ = rep.to_dict()["summary"]
        assert not alarms(rep.findings) and rep.exit_code == 0, lines(rep)
        assert not summ.get("internal_error") and not summ.get("crash"), summ
        assert len(self.w.steps) == len(L), (len(self.w.steps), len(L))
        if self.every == 1:
            assert all(r.modules for r in self.w.steps), [len(r.modules or []) for r in self.w.steps]
        return rep


def gen(i):
    return torch.Generator().manual_seed(i)


def mlp(d_in=8, h=32, d_out=1):
    return nn.Sequential(nn.Linear(d_in, h), nn.GELU(), nn.Linear(h, d_out))


# --- 1, 2. vmap ensembles over stack_module_state ---------------------------------------------------------------------
class Ensemble(nn.Module):
    """PyTorch's model-ensembling tutorial in a module: stacked member weights as parameters, one vmapped
    functional_call on a 'meta' copy of the base model."""

    def __init__(self, n=4, register_base=False):
        super().__init__()
        members = [mlp() for _ in range(n)]
        params, buffers = stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v) for k, v in params.items()})
        if register_base:      # a frozen real copy registered as the functional template (TorchRL-style)
            self.base = copy.deepcopy(members[0]).requires_grad_(False)
        else:                  # the tutorial: a 'meta' copy kept outside any module tree
            self.__dict__["base"] = copy.deepcopy(members[0]).to("meta")

    def forward(self, x):
        params = {k: self.stacked[k.replace(".", "_")] for k in self.names}

        def one(p, xi):
            return functional_call(self.base, p, (xi,))

        return torch.vmap(one, in_dims=(0, 0))(params, x)     # x: (n, B, 8) -> (n, B, 1)


def ensemble_run(register_base, every):
    torch.manual_seed(0)
    n = 4
    model = Ensemble(n, register_base)
    teachers = torch.randn(n, 8, 1, generator=gen(1))
    fit = Fit(model, every=every, lr=1e-2, params=model.stacked.parameters())
    per_member = []
    for i in range(30):
        x = torch.randn(n, 32, 8, generator=gen(100 + i))
        y = torch.tanh(x @ teachers)

        def loss_fn():
            out = model(x).float()
            per = (out - y).pow(2).mean(dim=(1, 2))
            per_member.append(per.detach())
            return per.sum()

        fit.step(loss_fn)
    first, last = torch.stack(per_member[:5]).mean(0), torch.stack(per_member[-5:]).mean(0)
    assert (last < 0.6 * first).all(), (first, last)           # every member learned its own teacher
    return fit.finish(fall=0.6)


@EVERY
def test_vmap_ensemble_stack_module_state_base_outside_the_tree(every):
    ensemble_run(False, every)


@EVERY
def test_vmap_ensemble_template_registered_as_a_submodule(every):
    ensemble_run(True, every)


# --- 3, 4. hypernetworks through functional_call ----------------------------------------------------------------------
class HyperNet(nn.Module):
    """`template="base"`: generated deltas on the target's own weights; `"meta"`: the target is a weightless
    template on the meta device and the hypernetwork generates all of its weights (its output bias starts at a
    freshly initialised target's flattened weights)."""

    def __init__(self, tasks=6, e=16, template="base"):
        super().__init__()
        self.emb = nn.Embedding(tasks, e)
        target = mlp(8, 16, 1)
        self.shapes = {n: p.shape for n, p in target.named_parameters()}
        total = sum(s.numel() for s in self.shapes.values())
        self.hyper = nn.Sequential(nn.Linear(e, 64), nn.ReLU(), nn.Linear(64, total))
        nn.init.normal_(self.hyper[2].weight, std=0.01)
        nn.init.zeros_(self.hyper[2].bias)
        self.generated = template == "meta"
        if self.generated:
            with torch.no_grad():
                self.hyper[2].bias.copy_(torch.cat([p.flatten() for p in target.parameters()]))
            target = target.to("meta")
        self.target = target

    def forward(self, task, x):
        delta = self.hyper(self.emb(task)).squeeze(0)
        params, o = {}, 0
        for n, p in self.target.named_parameters():
            k = p.numel()
            d = delta[o:o + k].view(self.shapes[n])
            params[n] = d if self.generated else p + d
            o += k
        return functional_call(self.target, params, (x,))


def hyper_run(template, every):
    torch.manual_seed(0)
    model = HyperNet(template=template)
    teachers = torch.randn(6, 8, 1, generator=gen(2))
    params = [p for p in model.parameters() if p.device.type != "meta"]
    # the generated weights' fp16 gradients are O(1): 65536 overflows them (8192 still backs off now and then)
    fit = Fit(model, every=every, lr=1e-2, later=2, init_scale=8192.0, params=params)
    for i in range(36):
        t = i % 6
        x = torch.randn(32, 8, generator=gen(200 + i))
        y = x @ teachers[t] / math.sqrt(8)
        fit.step(lambda: F.mse_loss(model(torch.tensor([t]), x).float(), y))
    if template == "base":
        assert all(p.grad is not None for p in model.target.parameters())   # the base weights learn through the sum
    fit.finish(fall=0.6, k=6)


@EVERY
def test_hypernetwork_functional_call_on_a_registered_target(every):
    hyper_run("base", every)


@EVERY
def test_hypernetwork_generating_all_weights_of_a_meta_template(every):
    hyper_run("meta", every)


# --- 5. MAML with an inner step inside the forward --------------------------------------------------------------------
class Maml(nn.Module):
    def __init__(self, inner_lr=0.05):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
        self.inner_lr = inner_lr

    def forward(self, xs, ys, xq):
        params = dict(self.net.named_parameters())
        inner = F.mse_loss(functional_call(self.net, params, (xs,)).float(), ys)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - self.inner_lr * g for (n, p), g in zip(params.items(), grads)}
        return functional_call(self.net, fast, (xq,))


@EVERY
def test_maml_inner_autograd_grad_create_graph_inside_forward(every):
    torch.manual_seed(0)
    model = Maml()
    fit = Fit(model, every=every, lr=3e-3, clip=10.0, later=3)
    for i in range(36):
        g = gen(300 + i)
        a = torch.rand(4, 1, 1, generator=g) * 2.0 + 1.0
        b = torch.rand(4, 1, 1, generator=g) * 2.0 - 1.0
        x = torch.rand(4, 20, 1, generator=g) * 4.0 - 2.0
        y = a * x + b

        def loss_fn():
            return sum(F.mse_loss(model(x[j, :10], y[j, :10], x[j, 10:]).float(), y[j, 10:]) for j in range(4)) / 4

        fit.step(loss_fn)
    fit.finish(fall=0.75, k=8)


# --- 6. a physics-informed net: du/dx inside the forward --------------------------------------------------------------
class PINN(nn.Module):
    """u' = cos(2x) on [0, 2], u(0) = 0; the residual's du/dx by `torch.func.grad` of the summed output (a
    functorch transform over the registered net) or by `torch.autograd.grad(create_graph=True)` (DeepXDE's way)."""

    def __init__(self, how):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.how = how

    def forward(self, x):
        if self.how == "func":
            du = torch.func.grad(lambda xx: self.net(xx).float().sum())(x)
        else:
            x = x.requires_grad_(True)
            du, = torch.autograd.grad(self.net(x).float().sum(), x, create_graph=True)
        u0 = self.net(torch.zeros(1, 1)).float()
        return (du - torch.cos(2 * x.detach())).pow(2).mean() + u0.pow(2).mean()


@pytest.mark.parametrize("how", ["autograd", "func"])
def test_pinn_derivative_of_the_output_inside_the_forward(how):
    torch.manual_seed(0)
    model = PINN(how)
    fit = Fit(model, lr=1e-2)
    for i in range(30):
        x = torch.rand(64, 1, generator=gen(1100 + i)) * 2
        fit.step(lambda: model(x))
    xs = torch.linspace(0, 2, 41).unsqueeze(1)
    with torch.no_grad():
        err = (model.net(xs) - torch.sin(2 * xs) / 2).abs().max().item()
    assert err < 0.2, err                                   # it found u = sin(2x) / 2
    fit.finish(fall=0.2)


# --- 7. custom autograd Functions under torch.amp.custom_fwd ----------------------------------------------------------
CALLS = {"rms": 0, "swiglu": 0}


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w, eps):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, r)
        return x * r * w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        CALLS["rms"] += 1
        x, w, r = ctx.saved_tensors
        xhat = x * r
        gw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
        gx_hat = g * w
        gx = r * (gx_hat - xhat * (gx_hat * xhat).mean(-1, keepdim=True))
        return gx, gw, None


class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        CALLS["swiglu"] += 1
        a, b = ctx.saved_tensors
        s = torch.sigmoid(a)
        silu = a * s
        return g * b * (s + silu * (1 - s)), g * silu


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return RMSNormFn.apply(x, self.weight, self.eps)


class GLUBlock(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.norm, self.up, self.down = RMSNorm(d), nn.Linear(d, 2 * h), nn.Linear(h, d)

    def forward(self, x):
        a, b = self.up(self.norm(x)).chunk(2, -1)
        return x + self.down(SwiGLUFn.apply(a, b))


@EVERY
def test_custom_autograd_functions_with_amp_custom_fwd(every):
    x, w = torch.randn(3, 5, 8, dtype=torch.double, requires_grad=True), torch.randn(8, dtype=torch.double,
                                                                                      requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFn.apply(x, w, 1e-6), (x, w))   # the backwards are right
    a, b = (torch.randn(4, 6, dtype=torch.double, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(SwiGLUFn.apply, (a, b))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), GLUBlock(), GLUBlock(), RMSNorm(32), nn.Linear(32, 4))
    teacher = mlp(8, 32, 4)
    fit = Fit(model, every=every, lr=3e-3)
    CALLS.update(rms=0, swiglu=0)
    dtypes = set()
    h = model[1].up.register_forward_hook(lambda m, i, o: dtypes.add((i[0].dtype, o.dtype)))
    for i in range(30):
        x = torch.randn(64, 8, generator=gen(400 + i))
        with torch.no_grad():
            y = teacher(x)
        fit.step(lambda: F.mse_loss(model(x).float(), y))
    h.remove()
    assert CALLS["rms"] == 30 * 3 and CALLS["swiglu"] == 30 * 2, CALLS
    assert dtypes == {(torch.float32, torch.float16)}, dtypes     # the RMSNorm ran in fp32, the Linear in fp16
    fit.finish(fall=0.5)


# --- 8. lazy modules --------------------------------------------------------------------------------------------------
def test_lazy_modules_materialised_by_a_dry_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv2d(8, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(),
                          nn.LazyConv2d(8, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.LazyLinear(4))
    with torch.no_grad():
        model(torch.zeros(2, 3, 12, 12))                      # the dry run the docs ask for
    assert not any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())
    fit = Fit(model, lr=1e-2)
    proto = torch.randn(4, 3, 12, 12, generator=gen(5))
    for i in range(30):
        y = torch.randint(0, 4, (32,), generator=gen(500 + i))
        x = proto[y] + 0.5 * torch.randn(32, 3, 12, 12, generator=gen(600 + i))
        fit.step(lambda: F.cross_entropy(model(x).float(), y))
    fit.finish(fall=0.5)


# --- 9. one block registered three times, behind a .module wrapper, tied head -----------------------------------------
class SharedLM(nn.Module):
    def __init__(self, vocab=32, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.layers = nn.ModuleList([block] * 3)               # ALBERT: one block, three applications
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        h = self.embed(idx)
        for blk in self.layers:
            h = h + blk(h)
        return self.head(self.norm(h))


class Wrapper(nn.Module):
    """What DataParallel / DDP / FSDP-style wrappers look like to a user: the real model as `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@EVERY
def test_block_shared_three_times_behind_a_module_wrapper_tied_head(every):
    torch.manual_seed(0)
    inner = SharedLM()
    model = Wrapper(inner)
    assert [n for n, _ in model.named_modules()].count("module.layers.0") == 1
    assert "module.layers.1" not in dict(model.named_modules())
    calls = []
    h = inner.layers[0][1].register_forward_hook(lambda m, i, o: calls.append(1))
    fit = Fit(model, every=every, lr=1e-2)
    for i in range(30):
        idx = torch.randint(0, 32, (16, 12), generator=gen(700 + i))
        tgt = (idx * 5 + 3) % 32
        fit.step(lambda: F.cross_entropy(model(idx).float().flatten(0, 1), tgt.flatten()))
    h.remove()
    assert len(calls) == 90                                     # three calls of one module per forward
    assert inner.head.weight is inner.embed.weight
    fit.finish(fall=0.6)


# --- 10. RNN cells unrolled -------------------------------------------------------------------------------------------
class CellSeq(nn.Module):
    def __init__(self, d=4, h=32):
        super().__init__()
        self.enc, self.dec, self.out = nn.LSTMCell(d, h), nn.GRUCell(1, h), nn.Linear(h, 1)

    def forward(self, x):                                       # x: (B, 12, 4) -> (B, 4)
        h = c = x.new_zeros(x.shape[0], self.enc.hidden_size)
        for t in range(x.shape[1]):
            h, c = self.enc(x[:, t], (h, c))
        y, outs = x.new_zeros(x.shape[0], 1), []
        for _ in range(4):
            h = self.dec(y, h)
            y = self.out(h)
            outs.append(y)
        return torch.cat(outs, 1)


def test_lstm_cell_and_gru_cell_unrolled_in_python():
    torch.manual_seed(0)
    model = CellSeq()
    fit = Fit(model, lr=1e-2)
    for i in range(36):
        x = torch.randn(32, 12, 4, generator=gen(800 + i))
        s = x[:, :, 0].mean(1, keepdim=True) * 3
        y = torch.cat([s, -s, 0.5 * s, x[:, -1, 1:2]], 1)
        fit.step(lambda: F.mse_loss(model(x).float(), y))
    fit.finish(fall=0.6, k=6)


# --- 11. user hooks that rewrite inputs, outputs and gradients --------------------------------------------------------
class GradReverse(nn.Module):
    """Domain-adversarial features (DANN): identity forward, a tensor hook flips and scales the gradient."""

    def __init__(self, lam=0.3):
        super().__init__()
        self.lam = lam

    def forward(self, x):
        x = x.view_as(x)
        if x.requires_grad:
            x.register_hook(lambda g: -self.lam * g)
        return x


class DANN(nn.Module):
    def __init__(self):
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.cls = nn.Linear(32, 3)
        self.rev = GradReverse()
        self.dom = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        f = self.feat(x)
        return self.cls(f), self.dom(self.rev(f))


@EVERY
def test_user_hooks_rewrite_input_output_and_gradient(every):
    torch.manual_seed(0)
    model = DANN()
    feats = {}
    model.register_forward_pre_hook(lambda m, a: ((a[0] - a[0].mean(0)) / (a[0].std(0) + 1e-3),))
    noise = gen(9)

    def add_noise(m, i, o):                                    # replaces the block's output while training
        return o + 0.05 * torch.randn(o.shape, generator=noise).to(o.dtype) if m.training else o

    model.feat[1].register_forward_hook(add_noise)
    model.feat.register_forward_hook(lambda m, i, o: feats.__setitem__("f", o))
    W = torch.randn(8, 3, generator=gen(10))
    fit = Fit(model, every=every, lr=5e-3)
    for i in range(30):
        g = gen(900 + i)
        xs, xt = torch.randn(32, 8, generator=g) * 3 + 1, torch.randn(32, 8, generator=g) * 3 + 1.5
        ys = (xs @ W).argmax(1)

        def loss_fn():
            logits, d_s = model(xs)
            f_s = feats["f"]
            _, d_t = model(xt)
            f_t = feats["f"]
            dom = F.binary_cross_entropy_with_logits(torch.cat([d_s, d_t]).float(),
                                                     torch.cat([torch.ones(32, 1), torch.zeros(32, 1)]))
            match = (f_s.float().mean(0) - f_t.float().mean(0)).pow(2).mean()
            return F.cross_entropy(logits.float(), ys) + 0.1 * dom + 0.1 * match

        fit.step(loss_fn)
    fit.finish(fall=0.6)


# --- 12. FlopCounterMode and the profiler around steps ----------------------------------------------------------------
@EVERY
def test_flop_counter_mode_and_profiler_around_steps(every):
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 4))
    teacher = mlp(16, 32, 4)
    fit = Fit(model, every=every, lr=3e-3)
    flops, prof = [], None
    for i in range(30):
        x = torch.randn(64, 16, generator=gen(1000 + i))
        with torch.no_grad():
            y = teacher(x)

        def loss_fn():
            with record_function("forward"):
                return F.mse_loss(model(x).float(), y)

        if i < 2:
            with FlopCounterMode(display=False) as fc:
                fit.step(loss_fn)
            flops.append(fc.get_total_flops())
        elif i == 5:
            prof = profile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
            fit.step(loss_fn)
        elif i == 8:
            fit.step(loss_fn)
            prof.__exit__(None, None, None)
        else:
            fit.step(loss_fn)
    assert all(f > 0 for f in flops), flops
    assert any(e.key == "forward" for e in prof.key_averages())
    fit.finish(fall=0.5)
