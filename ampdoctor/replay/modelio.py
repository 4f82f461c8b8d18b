"""Model side of a replay: resolve `pkg.mod:factory`, rebuild from a capture, load its weights, move it, run one step.
What a replay sets on the model before its forward (RNG states, module state) and gives back afterwards is
modelstate.py (`preserved` and `set_rng` are re-exported here).
"""
from __future__ import annotations

import contextlib

import importlib
import itertools
import os
import sys
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from ..errors import BadInput
from ..record.stats import is_measurable
from ..tensors import flatten_tensors
from .modelstate import preserved, set_rng

__all__ = ["resolve", "build_model", "match_capture_dtype", "load_weights", "preserved", "set_rng", "autocast_ctx", "to_device", "module_to",
           "get_loss", "run_step", "floating_params"]


def resolve(spec: str, what: str = "factory") -> Callable:
    """Import "package.module:attr" (attr may be dotted) and return the object; errors are one-line BadInput."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise BadInput(f"{what} {spec!r} must look like package.module:name")
    mod_name, attr = spec.split(":")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(mod_name)
    except (Exception, SystemExit) as e:  # the user's module raised, has a SyntaxError, or called sys.exit
        raise BadInput(f"cannot import {mod_name!r} for {what} {spec!r}: {type(e).__name__}: {e}".splitlines()[0])
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise BadInput(f"{what} {spec!r} is not callable")
    return obj


def build_model(capture, model: Any = None) -> torch.nn.Module:
    """The model to replay on: `model` (a Module, or a factory string the user named), else a Hugging Face model
    rebuilt from the capture's config through transformers' own registry (replay/hfbuild.py). Nothing the
    capture names is ever imported or called: a capture is data, possibly from a stranger."""
    if isinstance(model, str):
        spec = model
        factory = resolve(spec, "--model")
        try:
            model = factory if isinstance(factory, torch.nn.Module) else factory()
        except (Exception, SystemExit) as e:
            raise BadInput(f"model factory {spec!r} raised {type(e).__name__}: {e}".splitlines()[0])
        if not isinstance(model, torch.nn.Module):
            raise BadInput(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Module")
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise BadInput(f"model must be an nn.Module or a 'pkg.mod:factory' string, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule) or any(isinstance(m, torch.jit.ScriptModule)
                                                            for m in model.modules()):
            raise BadInput("the model is (or holds) a TorchScript ScriptModule, which takes no module hooks: pass the "
                           "eager nn.Module it was scripted from")
        return model
    if capture.hf_config is None:
        raise BadInput(f"the capture was taken from {capture.model_class[:80] or 'a model'!s}; ampdoctor never imports "
                       "classes a capture names: pass model= (or --model package.module:factory)")
    from .hfbuild import build_hf_model
    numel = sum(t.numel() for t in capture.state_dict.values())
    return build_hf_model(capture.model_class, dict(capture.hf_config), numel)


def module_to(model: torch.nn.Module, dev: torch.device) -> None:
    """`model.to(dev)`, leaving tensors on the meta device where they are (a template module whose weights
    torch.func.functional_call supplies: `Module.to` refuses to move them, and they hold nothing to move)."""
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        model._apply(lambda t: t if t.is_meta else t.to(dev))
    else:
        model.to(dev)


def match_capture_dtype(model: torch.nn.Module, state_dict: dict) -> None:
    """Cast a freshly built fp32 model to the capture's dtype when its weights are all fp16 or all bf16 (a pure
    low-precision model, e.g. `.half()`), so the replay runs the ops the original ran."""
    dts = {v.dtype for v in state_dict.values() if v.is_floating_point()}
    if len(dts) == 1 and next(iter(dts)) in (torch.float16, torch.bfloat16):
        model.to(next(iter(dts)))


def load_weights(model: torch.nn.Module, state_dict: dict) -> None:
    own = model.state_dict()
    missing = [k for k, v in own.items() if k not in state_dict and not v.is_meta]  # (meta: no values to load)
    unexpected = [k for k in state_dict if k not in own]
    shape = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)]
    if missing or unexpected or shape:
        parts = [f"{label} {', '.join(x[:3])}{' …' if len(x) > 3 else ''}"
                 for label, x in (("missing", missing), ("unexpected", unexpected), ("shape", shape)) if x]
        raise BadInput("model does not match capture: " + "; ".join(parts))
    meta = [k for k, v in own.items() if v.is_meta and k in state_dict]
    if meta:  # (copying into a meta tensor is a no-op: the replay would run without the capture's weights)
        raise BadInput(f"the model's {meta[0]}{f' (and {len(meta) - 1} more)' if len(meta) > 1 else ''} is on the "
                       "meta device, with no storage to load the capture's weights into: build the model on a real "
                       "device (or call `.to_empty(device=\"cpu\")` in the factory)")
    # one tensor of the model under several names (tied weights): the capture must hold one value for it too,
    # or the capture came from a model where they were separate (the last one loaded would silently win)
    first: dict = {}
    for k, v in model.state_dict(keep_vars=True).items():
        j = first.setdefault(id(v), k)
        if j != k and j in state_dict and k in state_dict and not _same_values(state_dict[j], state_dict[k]):
            raise BadInput(f"model does not match capture: {j} and {k} are one tied tensor in the model but differ in "
                           "the capture (taken from a model where they were separate)")
    with torch.no_grad():
        model.load_state_dict({k: v.to(own[k].dtype) if v.is_floating_point() else v
                               for k, v in state_dict.items()}, strict=not any(v.is_meta for v in own.values()))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal with NaN equal to NaN: a tied weight that went NaN (a pure fp16 AdamW's 0 / 0) is still one value
    under both its names (torch.equal says NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def autocast_ctx(device: str, dtype: torch.dtype | None):
    """`torch.autocast(device, dtype)`, or a context that disables autocast when dtype is None or fp32."""
    if dtype is None or dtype == torch.float32:
        return torch.autocast(device, enabled=False)
    return torch.autocast(device, dtype=dtype)


def to_device(tree, device, float_dtype: torch.dtype | None = None):
    def f(t):
        if not isinstance(t, torch.Tensor):
            return t
        rg = t.requires_grad
        t = t.detach().to(device)
        if float_dtype is not None and t.is_floating_point():
            t = t.to(float_dtype)
        return t.requires_grad_(rg) if rg and t.is_floating_point() else t
    return tree_map(f, tree)


def get_loss(output, args, kwargs, loss_fn) -> torch.Tensor | None:
    """The scalar loss of one step: loss_fn(output, *args, **kwargs), a scalar output, `.loss` or ["loss"]."""
    if loss_fn is not None:
        loss = loss_fn(output, *args, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise BadInput(f"the loss function {getattr(loss_fn, '__name__', 'loss_fn')} returned {what}, not a "
                           "scalar: reduce it (e.g. .mean()) the way training does")
        return loss
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def captured_grad_loss(grad_out: list, scale: float) -> Callable:
    """A loss function for a capture whose model output is not a loss and whose user gave none: the dot product
    of the outputs with the gradient that reached them in training (capture grad_out, scaled by the step's loss
    scale `scale`), divided by that scale. Its gradient with respect to the outputs is the captured one, so
    the replay's backward (times the replay's own loss scale) is the step's own; its value is no loss of the
    user's. Where the captured gradient is 0 (e.g. a -inf mask) the output does not enter."""
    def captured_output_gradient(out, *args, **kwargs):
        own = get_loss(out, args, kwargs, None)
        if own is not None:
            return own
        outs = [t for t in flatten_tensors(out, []) if is_measurable(t) and t.numel()][:len(grad_out)]
        total = None
        for o, g in zip(outs, grad_out):
            if g is None or tuple(g.shape) != tuple(o.shape):
                continue
            g = g.to(o.device).float()
            term = torch.where(g != 0, o.float() * g, 0.0).sum() / scale
            total = term if total is None else total + term
        return total if total is not None else torch.zeros(())
    return captured_output_gradient


def floating_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]


@contextlib.contextmanager
def inline_reentrant_checkpoints():
    """Within: `torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=True)` runs `fn` as a plain call. A reentrant
    checkpoint's graph refuses torch.autograd.grad (its recomputation calls .backward(), which would write the
    model's .grad and run the user's hooks on them: an optimizer step fused into the backward); inline, the replay's
    step has the same ops, values and RNG draws (the recomputation forks the RNG), traced in its forward, and its
    gradients come from autograd.grad like any other model's. Process-wide while it lasts (the replay's own calls)."""
    from torch.utils import checkpoint as ck
    cls = getattr(ck, "CheckpointFunction", None)
    if cls is None or "apply" in cls.__dict__:
        yield
        return
    cls.apply = staticmethod(lambda function, preserve_rng_state, *args: function(*args))
    try:
        yield
    finally:
        del cls.apply


def run_step(model, args, kwargs, *, device: str, dtype, rng: dict, loss_fn=None, scale: float | None = None,
             backward: bool = True, on_backward: Callable | None = None):
    """One forward (+ backward through autograd.grad, so no .grad is touched). Returns (output, loss, grads)."""
    set_rng(rng, model)
    with autocast_ctx(device, dtype):
        out = model(*args, **kwargs)
        loss = get_loss(out, args, kwargs, loss_fn)
    grads: dict[str, torch.Tensor] = {}
    params = floating_params(model)
    if backward and loss is not None and loss.requires_grad and params:
        root = loss.float() * scale if scale else loss
        if on_backward is not None:
            on_backward(root)
        try:
            gs = torch.autograd.grad(root, [p for _, p in params], allow_unused=True)
        except RuntimeError as e:
            if "use_reentrant" not in str(e):
                raise
            # a reentrant checkpoint other than torch's (inline_reentrant_checkpoints runs torch's inline) refuses
            # autograd.grad, and .backward() would write the model's .grad: the replay then has the forward only
            return out, loss, {}
        grads = {n: g for (n, _), g in zip(params, gs) if g is not None}
    return out, loss, grads
