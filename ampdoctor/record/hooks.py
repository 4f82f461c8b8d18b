"""The hook objects a watch puts on the user's modules, and where it may put them: the step machine's
(`ModuleHook`) and the always-on headroom's (`HeadroomHook`, `PassHook`, `GradTap`; what they hand over is
ampdoctor/record/headroom.py's).

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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: headroom.py imports nothing from here at run time
    from .headroom import Headroom

__all__ = ["ModuleHook", "InertHook", "CopiesInert", "HeadroomHook", "PassHook", "GradTap", "passes_on", "hookable",
           "in_compiled_frame", "keep_grad", "GRAD_OUT_BYTES"]

# the gradient into a root output up to this size is kept by reference until the step ends, for a capture: a
# replay without the user's loss function then runs the step's own backward (replay/modelio.captured_grad_loss)
GRAD_OUT_BYTES = 1 << 20


def keep_grad(slot: list, j: int, g):
    """Keeps a reference to the gradient that reached the model's j-th output, changes nothing (called by a
    gradexits.EntryHook on the node that made it)."""
    slot[j] = g

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
    __slots__ = ("fn", "kind", "outside")

    def __init__(self, fn, kind: str, eager: bool = False):
        # eager: run outside torch.compile's graph (a graph break), for the root module's hooks. Only while
        # Dynamo traces is the call routed through `torch.compiler.disable` (its wrapper costs ~10 us a call
        # in an eager loop, twice per step)
        self.fn = fn
        self.kind = kind
        self.outside = torch.compiler.disable(_from_compiled(fn)) if eager else None

    def register(self, module: torch.nn.Module):
        if self.kind == "pre":
            h = module.register_forward_pre_hook(self, with_kwargs=True)
        else:
            h = module.register_forward_hook(self, with_kwargs=True, always_call=True)
        return h

    def __call__(self, *args):
        if self.outside is not None and torch.compiler.is_compiling():
            return self.outside(*args)
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


_COMPILED_CALLS = [0]  # root hooks reached through torch.compiler.disable (from compiled code), in this process


def _from_compiled(fn):
    """`fn` as compiled code calls it: Dynamo traced the hook and left this call as a graph break."""
    def outside(*args):
        _COMPILED_CALLS[0] += 1
        return fn(*args)
    return outside


def in_compiled_frame(depth: int = 40) -> bool:
    """Whether the caller (a root hook behind `torch.compiler.disable`) was reached from a torch.compile'd
    (Dynamo) frame: past the disable wrapper's own frames, another Dynamo frame on the stack. Only a hook that
    compiled code called can be (until one was, the stack is not walked: an eager step pays nothing)."""
    if not _COMPILED_CALLS[0]:
        return False
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


# -- the always-on headroom's hooks (ampdoctor/record/headroom.py keeps what they hand over) ---------------
_PASSING_MODULES = ("torch.nn.modules.activation", "torch.nn.modules.dropout", "transformers.activations")


def passes_on(module: torch.nn.Module) -> bool:
    """Whether a module's output range follows its input's, so that measuring it adds nothing: a parameterless
    leaf from torch's activation or dropout modules (or transformers' activations), or an Identity. Its input is
    the output of the layer before it, which is measured; GELU/ReLU/SiLU/tanh never exceed their input's
    magnitude (by more than a constant), and dropout scales by 1/(1-p). Skipping them reads ~40% fewer bytes in a
    transformer MLP (the activation is as wide as the layer that feeds it)."""
    if type(module).__module__ not in _PASSING_MODULES and not isinstance(module, torch.nn.Identity):
        return False
    return next(module.parameters(recurse=False), None) is None and next(module.children(), None) is None


class GradTap:
    """Pre-hook on the autograd node that made a module's output (`grad_fn.register_prehook`): keep the gradient
    flowing into that output, its `nr`-th (see Headroom.grad). A node pre-hook is what `Tensor.register_hook`
    installs too, behind a Python dictionary and a handle per tensor; on the node it costs half as much, and
    it sees the gradient the node consumes (after any hook of the user's own on the tensor)."""
    __slots__ = ("hr", "slot", "nr", "others")

    def __init__(self, hr: "Headroom", slot: int, nr: int = 0):
        self.hr, self.slot, self.nr, self.others = hr, slot, nr, None

    def at(self, nr: int) -> "GradTap":
        """The tap of this slot for the node's `nr`-th output (e.g. a split's second part)."""
        if nr == self.nr:
            return self
        if self.others is None:
            self.others = {}
        tap = self.others.get(nr)
        if tap is None:
            tap = self.others[nr] = GradTap(self.hr, self.slot, nr)
        return tap

    def __call__(self, grads):
        hr = self.hr
        if hr.on and self.nr < len(grads):
            g = grads[self.nr]
            if g is not None:
                try:
                    hr.grad(self.slot, g)
                except Exception:  # never break the user's backward; the step just lacks this value
                    pass
        return None


class PassHook(CopiesInert):
    """The forward post-hook on a module that `passes_on` its input's range: nothing is read (see
    Headroom.passed). Compile-safe and copy-safe like HeadroomHook."""
    __slots__ = ("hr", "slot")

    def __init__(self, hr: "Headroom", slot: int):
        self.hr, self.slot = hr, slot

    def register(self, module: torch.nn.Module):
        return module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if not torch.compiler.is_compiling() and self.hr.on:
            self.hr.passed(self.slot, args, output)
        return None


class HeadroomHook(CopiesInert):
    """The forward post-hook (without kwargs) on every module below the root: hands its output to Headroom.

    Compile-safe and copy-safe like ModuleHook: under torch.compile it compiles away (checked first,
    so no watch state is guarded), and a copied or pickled model carries an InertHook instead."""
    __slots__ = ("hr", "slot", "tap", "fail")

    def __init__(self, hr: "Headroom", slot: int, fail):
        self.hr, self.slot, self.tap, self.fail = hr, slot, GradTap(hr, slot), fail

    def register(self, module: torch.nn.Module):
        return module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if torch.compiler.is_compiling():
            return None
        hr = self.hr
        if hr.on:
            try:
                hr.forward(self.slot, output, self.tap)
            except Exception as e:  # never break the user's model
                self.fail(e)
        return None
