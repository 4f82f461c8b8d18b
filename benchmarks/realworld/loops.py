"""Plain training loops for the Hugging Face models and the ResNet (the loop a user writes from the PyTorch AMP
recipe), and the injections that break a run at a realistic point. nanoGPT has its own loop (nanogpt.py)."""
from __future__ import annotations

import torch

from .models import SPECS

FP16_MAX = 65504.0


def plain_train(name, *, size="tiny", device="cpu", dtype="float16", compile=False, iters=8, lr=None, seed=0,
                init_scale=2.0 ** 16, checkpointing=False, watch=None, inject=None, on_iter=None):
    """fp16: autocast + GradScaler (scale, unscale_, clip, step, update); bf16: autocast, no scaler.
    `zero_grad()` at the top of the iteration, `loss.item()` at the end. Returns (losses, watch, model)."""
    spec = SPECS[name]
    torch.manual_seed(seed)
    model = spec.build(size).to(device)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr if lr is None else lr)
    fp16 = dtype == "float16"
    scaler = torch.amp.GradScaler(device, init_scale=init_scale) if fp16 else None
    w = watch(model, opt, scaler) if watch else None
    fwd = torch.compile(model) if compile else model
    losses = []
    for it in range(iters):
        if inject is not None:
            inject(it, model, opt)
        args, kwargs, target = spec.batch(size, device)
        opt.zero_grad()
        with torch.autocast(device, dtype=getattr(torch, dtype)):
            out = fwd(*args, **kwargs)
            loss = spec.loss(out, target)
        s0 = s1 = None
        if fp16:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            s0 = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            s1 = scaler.get_scale()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        losses.append(loss.item())
        if on_iter is not None:
            on_iter(it, losses[-1], s0, s1)
    return losses, w, model


# -- injections ------------------------------------------------------------------------------------------------

def _module_out_absmax(model, module, run_forward, reduce="absmax"):
    """abs-max (or min) of `module`'s output on one fp32 eval forward, without touching the global RNG or the
    model's train/eval mode."""
    seen = []
    h = module.register_forward_hook(lambda m, i, o: seen.append(o.detach().float()))
    was = model.training
    devs = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devs), torch.no_grad():
            model.eval()
            run_forward()
    finally:
        h.remove()
        model.train(was)
    o = seen[0]
    return float(o.abs().max()) if reduce == "absmax" else float(o.min())


def spike(module_name, step, probe, target=4 * FP16_MAX, weight_cap=FP16_MAX / 8):
    """At `step`, multiply one projection's weight by the power of ten that puts its output's abs-max above
    `target` (the weight itself stays below `weight_cap`, so the autocast cast of the weight is finite and the
    overflow is the matmul's). `probe(model)` runs one fp32 forward. Records the factor in `info`."""
    info = {"module": module_name, "step": step}

    def inject(it, model, opt):
        if it != step:
            return
        mod = model.get_submodule(module_name)
        amax = _module_out_absmax(model, mod, lambda: probe(model))
        f = 10.0 ** max(1, int(torch.tensor(target / max(amax, 1e-6)).log10().ceil()))
        f = min(f, weight_cap / float(mod.weight.abs().max()))
        info.update(factor=f, out_absmax_before=amax)
        with torch.no_grad():
            mod.weight.mul_(f)
    inject.info = info
    return inject


def neg_overflow(module_name, step, probe, target=4 * FP16_MAX):
    """At `step`, make a Linear fed by non-negative activations (after a GELU) output large NEGATIVE values:
    weight <- -|weight| * s, so the output overflows to -inf only (never +inf)."""
    info = {"module": module_name, "step": step}

    def inject(it, model, opt):
        if it != step:
            return
        mod = model.get_submodule(module_name)
        with torch.no_grad():
            mod.weight.copy_(-mod.weight.abs())
        lo = _module_out_absmax(model, mod, lambda: probe(model), reduce="min")
        s = target / max(-lo, 1e-6)
        info.update(factor=s, out_min_before=lo)
        with torch.no_grad():
            mod.weight.mul_(s)
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
        h = attn.c_attn.register_forward_hook(grab)
        was = model.training
        devs = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.random.fork_rng(devices=devs), torch.no_grad():
                model.eval()
                probe(model)
        finally:
            h.remove()
            model.train(was)
        f = (target / qk["max"]) ** 0.5
        info.update(factor_qk=f, scores_absmax_before=qk["max"], head_dim=qk["d"],
                    scaled_scores_absmax_after=target / qk["d"] ** 0.5)
        with torch.no_grad():
            attn.c_attn.weight[:2 * n_embd].mul_(f)
    inject.info = info
    return inject
