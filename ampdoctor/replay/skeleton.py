"""The model's structure as it was when a capture was written, without its values: what the in-process replay runs
on when the live model has changed since (a script that removes weight_norm/parametrizations for export, swaps a
head or fuses modules before it closes the watch; the capture's weights then name tensors the live model no longer
has). `skeleton` copies the module tree with every parameter and buffer on the meta device (no memory) and no
forward/backward hooks; `for_replay` picks the live model while it still matches the capture, else the skeleton
materialised on the live model's device (its values come from the capture's weights, loaded by the replay)."""
from __future__ import annotations

import itertools

import torch
from torch.nn.utils.parametrize import is_parametrized

__all__ = ["skeleton", "for_replay"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def skeleton(model: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of `model`'s module tree whose parameters and buffers are meta tensors of the same shapes, dtypes and
    ties, with no module hooks; None when the model cannot be copied (never raises: it is a fallback). Each module is
    copied shallowly (its own attribute dict; what its attributes refer to is shared, not copied: a LightningModule's
    trainer, a dataset a module keeps), then given its own parameter, buffer, child and (empty) hook dicts."""
    try:
        tensors: dict = {}
        skel = _copy(model, {}, tensors)
        # tensors the live model itself keeps on the meta device (a torch.func template) stay there (_materialise)
        skel.__dict__["_ampdoctor_meta"] = {id(tensors[k]) for k, src in _sources(model) if src.is_meta}
        return skel
    except Exception:
        return None


def _sources(model: torch.nn.Module):
    for mod in model.modules():
        for d in (mod._parameters, mod._buffers):
            for t in d.values():
                if t is not None:
                    yield id(t), t


def _copy(mod: torch.nn.Module, mods: dict, tensors: dict) -> torch.nn.Module:
    got = mods.get(id(mod))
    if got is not None:  # a module used twice in the tree stays one module
        return got
    cls = type(mod)
    if is_parametrized(mod):
        # torch.nn.utils.parametrize keeps a tensor's property on a class made for the module; removing the
        # parametrization from the live module deletes it there: the skeleton gets its own class
        cls = type(cls.__name__, cls.__bases__, {k: v for k, v in vars(cls).items()
                                                 if k not in ("__dict__", "__weakref__")})
    new = object.__new__(cls)  # (not copy.copy: a parametrized module refuses __getstate__)
    mods[id(mod)] = new
    new.__dict__ = dict(vars(mod))
    new._parameters = type(mod._parameters)((k, None if t is None else _meta(t, tensors))
                                            for k, t in mod._parameters.items())
    new._buffers = type(mod._buffers)((k, None if t is None else _meta(t, tensors)) for k, t in mod._buffers.items())
    new._modules = type(mod._modules)((k, None if c is None else _copy(c, mods, tensors))
                                      for k, c in mod._modules.items())
    for name in _HOOK_DICTS:
        hooks = vars(mod).get(name)
        if hooks is not None:
            new.__dict__[name] = type(hooks)()
    if "_compiled_call_impl" in vars(mod):  # Module.compile()'s function is bound to the live module
        new.__dict__["_compiled_call_impl"] = None
    return new


def _meta(t: torch.Tensor, tensors: dict) -> torch.Tensor:
    got = tensors.get(id(t))
    if got is None:  # a tensor under several names (tied weights) stays one tensor
        meta = torch.empty_like(t, device="meta")
        got = tensors[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else meta
    return got


def _layout(model: torch.nn.Module) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict(keep_vars=True).items()}


class _Alone(torch.nn.Module):
    """A DistributedDataParallel model's module under the same name (`module`), without DDP's forward (its buffer
    broadcast is a collective the other ranks would never join): the qualified names, the capture's state_dict keys
    and the findings' modules stay those of the watched model."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.module = inner

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _Entry(torch.nn.Module):
    """The watched model run through one of its modules (a capture's `extra.entry`, record/entries.py: the loop
    called that module, never the model's own forward). It holds the model's own parameter, buffer and module
    dictionaries, so its qualified names, state_dict keys and the findings' modules are the model's."""

    def __init__(self, model: torch.nn.Module, entry: str):
        super().__init__()
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules
        self.training = model.training
        self._entry = entry

    def forward(self, *args, **kwargs):
        return self.get_submodule(self._entry)(*args, **kwargs)


def entry_view(model: torch.nn.Module, entry) -> torch.nn.Module:
    """`model` as the capture's batch goes into it: itself, or run through its module `entry` (see `_Entry`).
    An entry the model does not have is a model that does not match the capture (BadInput)."""
    if entry is None:
        return model
    from ..errors import BadInput
    if not isinstance(entry, str) or not entry or len(entry) > 1000:
        raise BadInput("the capture's entry module is not a module name")
    try:
        sub = model.get_submodule(entry)
    except AttributeError:
        sub = None
    if sub is None or sub is model:
        raise BadInput(f"the capture's batch went into module {entry!r}, which this model does not have")
    return _Entry(model, entry)


def alone(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model as one rank can run it by itself (a distributed run's in-process replay: only the ranks with a
    capture replay, so the forward must need no collective): a DDP model's module under DDP's own naming, a plain
    model as it is; None when its forward would need the other ranks (SyncBatchNorm, DTensor parameters)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if any(isinstance(m, torch.nn.SyncBatchNorm) for m in inner.modules()) or any(
            type(p.detach()) is not torch.Tensor for p in inner.parameters()):
        return None
    return _Alone(inner) if inner is not model else model


def for_replay(live: torch.nn.Module, skel: torch.nn.Module | None) -> torch.nn.Module:
    """`live` while its parameters and buffers are still those the capture was taken of (names, shapes, dtypes,
    storage), else the skeleton on `live`'s device (uninitialised: the replay loads the capture's weights into it)."""
    if skel is None or _layout(live) == _layout(skel) and not _freed(live, skel):
        return live
    dev = next((t.device for t in itertools.chain(live.parameters(), live.buffers()) if not t.is_meta), None)
    return _materialise(skel, dev or torch.device("cpu"))


def _freed(live: torch.nn.Module, skel: torch.nn.Module) -> bool:
    """`live` holds meta tensors where the model had storage when the capture was written (`model.to("meta")` to
    free it before the watch closes): nothing to run on."""
    keep = skel.__dict__.get("_ampdoctor_meta", set())
    kept = {k for k, t in skel.state_dict(keep_vars=True).items() if id(t) in keep}
    return any(t.is_meta and k not in kept for k, t in live.state_dict(keep_vars=True).items())


def _materialise(skel: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
    """Give the skeleton uninitialised tensors on `dev`, one per meta tensor (`Module.to_empty` would untie tied
    weights); a tensor the live model itself keeps on the meta device (a torch.func template) stays there."""
    made: dict = {}
    keep = skel.__dict__.get("_ampdoctor_meta", set())
    for mod in skel.modules():
        for d in (mod._parameters, mod._buffers):
            for k, t in d.items():
                if t is None or id(t) in keep or not t.is_meta:  # (materialised by an earlier replay: as it is)
                    continue
                new = made.get(id(t))
                if new is None:
                    new = torch.empty_like(t, device=dev)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    made[id(t)] = new
                d[k] = new
    return skel
