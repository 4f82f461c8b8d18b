"""Plain training loops for the Hugging Face models and the ResNet (the loop a user writes from the PyTorch AMP
recipe), and the injections that break a run at a realistic point. nanoGPT has its own loop (nanogpt.py)."""
from __future__ import annotations

import math

import torch

from .models import SPECS
from .nanogpt import step_and_update

FP16_MAX = 65504.0


def plain_train(name, *, size="tiny", device="cpu", dtype="float16", compile=False, iters=8, lr=None, seed=0,
                init_scale=2.0 ** 16, checkpointing=False, watch=None, inject=None, on_iter=None, misuse=None,
                loss_weight=1.0):
    """fp16: autocast + GradScaler (scale, unscale_, clip, step, update); bf16: autocast, no scaler.
    `zero_grad()` at the top of the iteration, `loss.item()` at the end. `misuse` (fp16): one of MISUSES, the
    loop written the way a user gets it wrong, or "no-scaler" (fp16 autocast without a GradScaler).
    `loss_weight`: the loss is multiplied by it (an auxiliary loss's weight in multi-task training).
    Returns (losses, watch, model)."""
    spec = SPECS[name]
    torch.manual_seed(seed)
    model = spec.build(size).to(device)
    model.train()
    if misuse == "half":  # pure fp16: the optimizer steps the fp16 weights themselves, no autocast, no scaler
        model.half()
    if checkpointing:  # transformers 5.x renamed it; older releases only have gradient_checkpointing_enable
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr if lr is None else lr)
    fp16 = dtype == "float16" and misuse not in ("half", "no-scaler")
    scaler = torch.amp.GradScaler(device, init_scale=init_scale) if fp16 else None
    w = watch(model, opt, scaler) if watch else None
    fwd = torch.compile(model) if compile else model
    losses = []
    for it in range(iters):
        if inject is not None:
            inject(it, model, opt)
        args, kwargs, target = spec.batch(size, device)
        opt.zero_grad()
        if misuse == "half":
            args, kwargs = tuple(_half(a) for a in args), {k: _half(v) for k, v in kwargs.items()}
        with torch.autocast(device, dtype=getattr(torch, dtype), enabled=misuse != "half"):
            out = fwd(*args, **kwargs)
            loss = spec.loss(out, target)
            if loss_weight != 1.0:
                loss = loss * loss_weight
        s0 = s1 = None
        if fp16:
            scaler.scale(loss).backward()
            if misuse != "clip-scaled":
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            s0 = scaler.get_scale()
            step_and_update(scaler, opt, misuse)
            s1 = scaler.get_scale()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        losses.append(loss.item())
        if on_iter is not None:
            on_iter(it, losses[-1], s0, s1)
    return losses, w, model


MISUSES = ("clip-scaled", "no-update", "update-first", "half")
"""clip-scaled: clip_grad_norm_ without unscale_ first; no-update: scaler.step without scaler.update; update-first:
scaler.update() before scaler.step(); half: `model.half()` and the batch's floating tensors, AdamW on the fp16
weights, no autocast and no GradScaler."""


def _half(x):
    return x.half() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


# -- injections ------------------------------------------------------------------------------------------------

def _probe_eval(model, probe, handles) -> None:
    """Run `probe(model)` once in eval mode, without grad and without touching the global RNG or the model's
    train/eval mode, then remove the hook `handles` that read it."""
    was = model.training
    devs = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devs), torch.no_grad():
            model.eval()
            probe(model)
    finally:
        for h in handles:
            h.remove()
        model.train(was)


def _module_out_absmax(model, module, run_forward, reduce="absmax"):
    """abs-max (or min) of `module`'s output on one fp32 eval forward (`_probe_eval`)."""
    seen = []
    _probe_eval(model, lambda _: run_forward(),
                [module.register_forward_hook(lambda m, i, o: seen.append(o.detach().float()))])
    o = seen[0]
    return {"absmax": lambda: o.abs().max(), "min": o.min, "negmax": lambda: -o.max()}[reduce]().item()


def spike(module_name, step, probe, target=4 * FP16_MAX, weight_cap=FP16_MAX / 2):
    """At `step`, multiply one projection's weight by the power of ten that puts its output's abs-max above
    `target`, capped so that the weight itself stays below `weight_cap` (the autocast cast of the weight stays
    finite, so the overflow is the matmul's/conv's). `probe(model)` runs one fp32 forward. `info` records the
    factor and the predicted output abs-max (> 65504 means the injection overflows)."""
    info = {"module": module_name, "step": step}

    def inject(it, model, opt):
        if it != step:
            return
        mod = model.get_submodule(module_name)
        amax = _module_out_absmax(model, mod, lambda: probe(model))
        f = 10.0 ** max(1, math.ceil(math.log10(target / max(amax, 1e-6))))
        f = min(f, weight_cap / float(mod.weight.detach().abs().max()))
        with torch.no_grad():
            mod.weight.mul_(f)
        info.update(factor=f, out_absmax_before=amax, out_absmax_after=_module_out_absmax(model, mod,
                                                                                         lambda: probe(model)))
    inject.info = info
    return inject


def neg_overflow(module_name, feeder_name, step, probe, target=4 * FP16_MAX, weight_cap=FP16_MAX / 2):
    """At `step`, make a Linear fed by GELU outputs overflow to -inf only: its feeder (the Linear before the
    GELU) is scaled so that the GELU outputs are O(10) (mostly large positive or ~0), and the Linear's weight
    becomes -|weight| * s, so every output is a large negative sum. `info` records the predicted min and max."""
    info = {"module": module_name, "step": step}

    def inject(it, model, opt):
        if it != step:
            return
        feeder, mod = model.get_submodule(feeder_name), model.get_submodule(module_name)
        famax = _module_out_absmax(model, feeder, lambda: probe(model))
        with torch.no_grad():
            feeder.weight.mul_(16.0 / max(famax, 1e-6))
            mod.weight.copy_(-mod.weight.abs())
        lo = _module_out_absmax(model, mod, lambda: probe(model), reduce="min")
        s = min(target / max(-lo, 1e-6), weight_cap / float(mod.weight.detach().abs().max()))
        with torch.no_grad():
            mod.weight.mul_(s)
        info.update(factor=s, feeder_factor=16.0 / max(famax, 1e-6),
                    out_min_after=_module_out_absmax(model, mod, lambda: probe(model), reduce="min"),
                    out_max_after=-_module_out_absmax(model, mod, lambda: probe(model), reduce="negmax"))
    inject.info = info
    return inject


def swiglu_overflow(mlp_name, step, probe, target=4 * FP16_MAX, branch_cap=FP16_MAX / 8):
    """At `step`, scale a SwiGLU MLP's gate and up projections (Llama's `act_fn(gate_proj(x)) * up_proj(x)`) by the
    same factor f, so that their product reaches `target` while each branch's output stays below `branch_cap`:
    both Linears' fp16 outputs are finite, the MLP's own multiply overflows (its producer is the MLP, not a Linear,
    and down_proj only passes the inf on). silu(f g) f u ~ f^2 g u where g > 0, so f comes from the fp32 product's
    abs-max, rechecked after the scaling. `info`: the factor, both branches' abs-max and the product's after."""
    info = {"module": mlp_name, "step": step}

    def measure(model, mlp):
        seen = {}
        _probe_eval(model, probe, [
            mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("g", o.detach().float())),
            mlp.up_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("u", o.detach().float()))])
        g, u = seen["g"], seen["u"]
        return float(g.abs().max()), float(u.abs().max()), float((torch.nn.functional.silu(g) * u).abs().max())

    def inject(it, model, opt):
        if it != step:
            return
        mlp = model.get_submodule(mlp_name)
        ga, ua, pa = measure(model, mlp)
        f = min((target / max(pa, 1e-6)) ** 0.5, branch_cap / max(ga, ua, 1e-6))
        with torch.no_grad():
            mlp.gate_proj.weight.mul_(f)
            mlp.up_proj.weight.mul_(f)
        ga2, ua2, pa2 = measure(model, mlp)
        info.update(factor=f, gate_absmax_after=ga2, up_absmax_after=ua2, product_absmax_after=pa2)
    inject.info = info
    return inject


def grow(module_name, start, rate, probe, start_absmax=64.0):
    """From `start` on, one layer's weight grows by `rate` per step (x1.15: 15%), after being set at `start` so
    that its output abs-max is `start_absmax` (about 10 bits of fp16 headroom)."""
    info = {"module": module_name, "step": start, "rate": rate}

    def inject(it, model, opt):
        if it < start:
            return
        mod = model.get_submodule(module_name)
        with torch.no_grad():
            if it == start:
                amax = _module_out_absmax(model, mod, lambda: probe(model))
                info.update(initial_factor=start_absmax / max(amax, 1e-6))
                mod.weight.mul_(start_absmax / max(amax, 1e-6))
            else:
                mod.weight.mul_(rate)
    inject.info = info
    return inject


def attn_no_scale_large(block_attn, probe, n_embd, step=0, target=2 * FP16_MAX):
    """For the manual attention path without 1/sqrt(d): at `step`, scale q's and k's projection rows so that the
    unscaled scores q @ k^T reach `target` (with the missing 1/sqrt(d) they would stay under the fp16 max)."""
    info = {"module": block_attn, "step": step}

    def inject(it, model, opt):
        if it != step:
            return
        attn = model.get_submodule(block_attn)
        qk = {}

        def grab(m, i, o):
            q, k, _ = o.float().split(n_embd, dim=2)
            B, T, C = q.shape
            nh = attn.n_head
            q = q.view(B, T, nh, C // nh).transpose(1, 2)
            k = k.view(B, T, nh, C // nh).transpose(1, 2)
            qk["max"] = float((q @ k.transpose(-2, -1)).abs().max())
            qk["d"] = C // nh
        _probe_eval(model, probe, [attn.c_attn.register_forward_hook(grab)])
        f = (target / qk["max"]) ** 0.5
        info.update(factor_qk=f, scores_absmax_before=qk["max"], head_dim=qk["d"],
                    scaled_scores_absmax_after=target / qk["d"] ** 0.5)
        with torch.no_grad():
            attn.c_attn.weight[:2 * n_embd].mul_(f)
    inject.info = info
    return inject
