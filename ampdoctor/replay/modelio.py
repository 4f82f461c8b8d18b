"""Model side of a replay: resolve `pkg.mod:factory`, rebuild from a capture, load its weights, run one step,
and leave a caller's model exactly as it was (weights, buffers, modes, grads, RNG) afterwards.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import itertools
import os
import random
import sys
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from ..capture import STATE_PREFIXES
from ..errors import BadInput
from ..record.stats import is_measurable
from ..tensors import flatten_tensors, unpack_np_rng, unpack_py_rng

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
    # one tensor of the model under several names (tied weights): the capture must hold one value for it too,
    # or the capture came from a model where they were separate (the last one loaded would silently win)
    first: dict = {}
    for k, v in model.state_dict(keep_vars=True).items():
        j = first.setdefault(id(v), k)
        if j != k and j in state_dict and k in state_dict and not torch.equal(state_dict[j], state_dict[k]):
            raise BadInput(f"model does not match capture: {j} and {k} are one tied tensor in the model but differ in "
                           "the capture (taken from a model where they were separate)")
    with torch.no_grad():
        model.load_state_dict({k: v.to(own[k].dtype) if v.is_floating_point() else v
                               for k, v in state_dict.items()}, strict=not any(v.is_meta for v in own.values()))


_MODULE_KEYS = frozenset(vars(torch.nn.Module())) | {"training", "_compiled_call_impl"}


def _attributes(mod: torch.nn.Module) -> dict:
    """A module's own attributes besides its parameters, buffers, children and hooks, as the replay's forward may
    change them (a step counter, a memory kept as a plain tensor, a queue or deque, a torch.Generator it draws from): each
    value with what restores it (a tensor's values, a container's items, a generator's state)."""
    out = {}
    for k, v in vars(mod).items():
        if k in _MODULE_KEYS:
            continue
        if isinstance(v, torch.Generator):
            keep = v.get_state()
        elif isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.layout == torch.strided \
                and not v.is_meta:
            keep = v.detach().clone()
        elif isinstance(v, collections.deque):
            keep = list(v)  # (a deque keeps its maxlen: restored in place)
        elif isinstance(v, (list, dict, set)):
            keep = type(v)(v)
        else:
            keep = None
        out[k] = (v, keep)
    return out


def _restore_attributes(mod: torch.nn.Module, saved: dict) -> None:
    for k in [k for k in vars(mod) if k not in _MODULE_KEYS and k not in saved]:
        delattr(mod, k)  # (an attribute the replay's forward added)
    for k, (v, keep) in saved.items():
        mod.__dict__[k] = v
        if keep is None:
            continue
        if isinstance(v, torch.Generator):
            v.set_state(keep)
        elif isinstance(v, torch.Tensor):
            if v.shape == keep.shape:
                v.data.copy_(keep)  # (written in place: a memory bank's slots)
        elif isinstance(v, list):
            v[:] = keep
        elif isinstance(v, collections.deque):
            v.clear()
            v.extend(keep)
        else:
            v.clear()
            v.update(keep)


@contextlib.contextmanager
def preserved(model: torch.nn.Module):
    """Restore the model's weights and buffers (bitwise, the non-persistent ones too, and the tensor objects a
    forward reassigned), train/eval modes, .grad, the RNG states (torch's, Python's `random`, NumPy's global one:
    a forward may draw from them, e.g. Wav2Vec2's masks) and the modules' other attributes (a counter, a plain-tensor
    memory, a queue, a torch.Generator of the model's own: `_attributes`) on exit."""
    slots = [(mod, d, name, t, t.detach().clone()) for mod in model.modules()
             for d in (mod._parameters, mod._buffers) for name, t in list(d.items()) if t is not None]
    modes = {m: m.training for m in model.modules()}
    py_rng = random.getstate()
    np_mod = sys.modules.get("numpy")
    np_rng = np_mod.random.get_state() if np_mod is not None else None
    grads = {p: (p.grad, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    attrs = [(mod, _attributes(mod)) for mod in model.modules()]
    try:
        yield
    finally:
        with torch.no_grad():
            for mod, d, name, t, v in slots:
                d[name] = t  # (a forward that replaced the buffer object: the module gets its own back)
                t.data.copy_(v)
            for mod, saved in attrs:
                _restore_attributes(mod, saved)
        random.setstate(py_rng)
        if np_rng is not None:
            np_mod.random.set_state(np_rng)
        for m, t in modes.items():
            m.training = t
        for p, (g, val) in grads.items():
            p.grad = g
            if g is not None:
                g.data.copy_(val)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _set_state(model: torch.nn.Module, key: str, v: torch.Tensor) -> None:
    """One piece of module state a capture holds (capture.STATE_PREFIXES; record/modstate.py), set where the model
    has the same kind of thing under that name: a number attribute keeps its Python type, a tensor attribute (or
    one that is None now: a memory not filled yet) gets a copy, a buffer is written in place (replaced when its
    shape changed), a list or deque gets its items back in place. preserved() restores what was there."""
    kind, _, path = key.partition(":")
    mod_name, _, attr = path.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        return
    with torch.no_grad():
        if kind == "num":
            cur = vars(mod).get(attr)
            if type(cur) in (int, float, bool):
                mod.__dict__[attr] = type(cur)(v.item())
        elif kind in ("list", "tlist"):
            cur = vars(mod).get(attr)
            if type(cur) in (list, collections.deque):
                dev = next((t.device for t in itertools.chain(mod.parameters(), mod.buffers(), model.parameters())),
                           torch.device("cpu"))
                items = v.tolist() if kind == "list" else [t.to(dev, copy=True) for t in v.unbind(0)]
                cur.clear()
                cur.extend(items)  # (in place: a deque keeps its maxlen; preserved() restores the items)
        elif kind == "buf":
            b = mod._buffers.get(attr)
            if isinstance(b, torch.Tensor) and b.layout == torch.strided and not b.is_meta:
                if b.shape == v.shape and b.dtype == v.dtype:
                    b.copy_(v)
                else:
                    mod._buffers[attr] = v.to(b.device, copy=True)
        elif kind == "tensor":
            cur = vars(mod).get(attr, _MISSING)
            if cur is None or isinstance(cur, torch.Tensor) and not isinstance(cur, torch.nn.Parameter):
                dev = cur.device if isinstance(cur, torch.Tensor) else next(
                    (t.device for t in itertools.chain(mod.parameters(), mod.buffers(), model.parameters())),
                    torch.device("cpu"))
                mod.__dict__[attr] = v.to(dev, copy=True)


_MISSING = object()


def set_rng(rng: dict, model: torch.nn.Module | None = None) -> None:
    """The RNG states a capture holds, as they were before the captured forward: torch's CPU and CUDA generators,
    Python's `random` and NumPy's global RNG when the model's forward draws from them, and a torch.Generator the
    model holds ("gen:<module>.<attribute>", set on `model`'s own when it has one there); and the module state the
    captured forward found (a counter, a memory, a buffer it updates: `_set_state`). preserved() restores all of
    them after the replay."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        for k, s in rng.items():
            if k.startswith("cuda:") and int(k[5:]) < torch.cuda.device_count():
                torch.cuda.set_rng_state(s, int(k[5:]))
    if "py" in rng:
        random.setstate(unpack_py_rng(rng["py"]))
    if "np" in rng and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(unpack_np_rng(rng["np"]))
    for k, s in rng.items():
        if k.startswith(STATE_PREFIXES) and model is not None:
            _set_state(model, k, s)
    for k, s in rng.items():
        if k.startswith("gen:") and model is not None:
            mod_name, _, attr = k[4:].rpartition(".")
            try:
                g = vars(model.get_submodule(mod_name)).get(attr)
            except AttributeError:
                continue
            if isinstance(g, torch.Generator):
                g.set_state(s)


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
            # reentrant activation checkpointing refuses autograd.grad, and .backward() would write the model's
            # .grad: the replay then has the forward only, as without a loss
            return out, loss, {}
        grads = {n: g for (n, _), g in zip(params, gs) if g is not None}
    return out, loss, grads
