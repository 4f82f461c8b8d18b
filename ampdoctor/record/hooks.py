"""The hook objects a watch puts on the user's modules, and where it may put them.

A hook must never change what the user's code can do with the model:
- Copying: `copy.deepcopy(model)` (an EMA copy) or `torch.save(model)` while watched copies the modules' hook
  dictionaries. A `ModuleHook` copies (and pickles) as an `InertHook`, which does nothing and removes itself
  from the copy the first time the copy runs, so neither the watch's state (open files, tensors) nor its
  measurements travel with the copy.
- torch.compile: the root module's hooks run outside the compiled graph (`torch.compiler.disable`: one graph
  break before and after the model's forward); every other hook compiles away (`is_compiling()`), so nothing of
  ampdoctor's is traced into the user's graph. Per-layer statistics of a compiled model come from the eager
  replay of a bad step's capture.
- TorchScript: `torch.jit.ScriptModule`s accept no Python hooks; they are left unwatched.
"""
from __future__ import annotations

import sys

import torch

__all__ = ["ModuleHook", "InertHook", "CopiesInert", "hookable", "in_compiled_frame"]

# the hook dictionaries of nn.Module that hold one registration, per kind of hook
_DICTS = {"pre": ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"),
          "post": ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")}


class CopiesInert:
    """Base of every hook a watch puts on a module: a copied or pickled model carries an `InertHook` of the same
    kind (`kind`, default a forward post-hook) in its place."""
    __slots__ = ()
    kind = "post"

    def __deepcopy__(self, memo):
        return InertHook(self.kind)

    def __copy__(self):
        return InertHook(self.kind)

    def __reduce__(self):
        return (InertHook, (self.kind,))


class ModuleHook(CopiesInert):
    """A forward (pre-)hook calling `fn`; `register(module)` installs it and returns the RemovableHandle."""
    __slots__ = ("fn", "kind")

    def __init__(self, fn, kind: str, eager: bool = False):
        # eager: run outside torch.compile's graph (a graph break), for the root module's hooks
        self.fn = torch.compiler.disable(fn) if eager else fn
        self.kind = kind

    def register(self, module: torch.nn.Module):
        if self.kind == "pre":
            h = module.register_forward_pre_hook(self, with_kwargs=True)
        else:
            h = module.register_forward_hook(self, with_kwargs=True, always_call=True)
        return h

    def __call__(self, *args):
        return self.fn(*args)


class InertHook:
    """What a copied model carries in place of a watch's hook: nothing, and it removes itself when first run."""
    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, module, *args):
        if not torch.compiler.is_compiling():
            names = _DICTS.get(self.kind, ())
            hooks = getattr(module, names[0], {}) if names else {}
            for key in [k for k, v in hooks.items() if v is self]:
                for d in names:
                    getattr(module, d, {}).pop(key, None)
        return None


def hookable(module: torch.nn.Module) -> bool:
    """Whether Python forward hooks can go on this module (TorchScript modules take none)."""
    return not isinstance(module, torch.jit.ScriptModule)


def in_compiled_frame(depth: int = 40) -> bool:
    """Whether the caller (a root hook behind `torch.compiler.disable`) was reached from a torch.compile'd
    (Dynamo) frame: past the disable wrapper's own frames, another Dynamo frame on the stack."""
    f = sys._getframe(1)
    while f is not None and "_dynamo" not in f.f_code.co_filename:
        f = f.f_back  # the hook's own frames
    while f is not None and "_dynamo" in f.f_code.co_filename:
        f = f.f_back  # the disable wrapper
    while f is not None and depth > 0:
        if "_dynamo" in f.f_code.co_filename:
            return True
        f, depth = f.f_back, depth - 1
    return False
