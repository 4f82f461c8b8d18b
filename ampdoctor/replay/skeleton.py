"""The model's structure as it was when a capture was written, without its values: what the in-process replay runs
on when the live model has changed since (a script that removes weight_norm/parametrizations for export, swaps a
head or fuses modules before it closes the watch; the capture's weights then name tensors the live model no longer
has). `skeleton` copies the module tree with every parameter and buffer on the meta device (no memory) and no
forward/backward hooks; `for_replay` picks the live model while it still matches the capture, else the skeleton
materialised on the live model's device (its values come from the capture's weights, loaded by the replay)."""
from __future__ import annotations

import copy
import itertools

import torch
from torch.nn.utils.parametrize import is_parametrized

__all__ = ["skeleton", "for_replay"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def skeleton(model: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of `model`'s module tree whose parameters and buffers are meta tensors of the same shapes, dtypes and
    ties, with no module hooks; None when the model cannot be copied (never raises: it is a fallback)."""
    try:
        memo: dict = {}
        for mod in model.modules():
            for d in (mod._parameters, mod._buffers):
                for t in d.values():
                    if t is None or id(t) in memo:
                        continue
                    meta = torch.empty_like(t, device="meta")
                    memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else meta
            for name in _HOOK_DICTS:
                hooks = getattr(mod, name, None)
                if hooks is not None:
                    memo[id(hooks)] = type(hooks)()
        skel = copy.deepcopy(model, memo)
        for mod in skel.modules():
            if is_parametrized(mod):
                # torch.nn.utils.parametrize keeps a tensor's property on a class made for the module; removing
                # the parametrization from the live module deletes it there: the skeleton gets its own class
                cls = type(mod)
                mod.__class__ = type(cls.__name__, cls.__bases__, {k: v for k, v in vars(cls).items()
                                                                 if k not in ("__dict__", "__weakref__")})
        return skel
    except Exception:
        return None


def _layout(model: torch.nn.Module) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict(keep_vars=True).items()}


def for_replay(live: torch.nn.Module, skel: torch.nn.Module | None) -> torch.nn.Module:
    """`live` while its parameters and buffers are still those the capture was taken of (names, shapes, dtypes),
    else the skeleton on `live`'s device (uninitialised: the replay loads the capture's weights into it)."""
    if skel is None or _layout(live) == _layout(skel):
        return live
    dev = next((t.device for t in itertools.chain(live.parameters(), live.buffers()) if not t.is_meta), None)
    return copy.deepcopy(skel).to_empty(device=dev or torch.device("cpu"))
