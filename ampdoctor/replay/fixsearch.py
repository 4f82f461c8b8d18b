"""Fix search: the smallest set of modules that, run in fp32 (autocast off, inputs cast up), make the step finite.

Greedy from the producer outward: start from the module where the first inf/NaN appeared; if running it in
fp32 is not enough, add the next producer the re-run shows (or step out to the parent when the producer is
already in the set). Then prune: drop each module whose removal keeps the step finite (a bisection over the
set, one module at a time). The result is emitted as a paste-able snippet.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils._pytree import tree_map

__all__ = ["fp32_modules", "search", "snippet"]

MAX_TRIES = 12


def _up(t):
    return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32 else t


@contextlib.contextmanager
def fp32_modules(model: torch.nn.Module, names: list[str], device: str):
    """Run the named modules' forward with autocast disabled and floating inputs cast to fp32."""
    patched = []
    try:
        for name in names:
            mod = model.get_submodule(name)
            had = "forward" in mod.__dict__
            orig = mod.__dict__.get("forward")
            fwd = mod.forward

            def forward(*args, _fwd=fwd, **kwargs):
                with torch.autocast(device, enabled=False):
                    return _fwd(*tree_map(_up, args), **tree_map(_up, kwargs))

            mod.forward = forward
            patched.append((mod, had, orig))
        yield
    finally:
        for mod, had, orig in reversed(patched):
            if had:
                mod.forward = orig
            else:
                del mod.forward


def _covers(outer: str, name: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def _parent(name: str) -> str | None:
    return None if name == "" else name.rpartition(".")[0]


def search(first_producer: str | None, try_set: Callable[[list[str]], tuple[bool, str | None]]) -> dict:
    """`try_set(modules) -> (finite, next producer or None)`. Returns {"modules", "tries", "found"}."""
    if first_producer is None:
        return {"modules": [], "tries": 0, "found": False}
    chosen: list[str] = [first_producer]
    tries = 0
    finite = False
    while tries < MAX_TRIES:
        finite, nxt = try_set(chosen)
        tries += 1
        if finite:
            break
        covering = [c for c in chosen if nxt is not None and _covers(c, nxt)]
        if nxt is not None and not covering:
            chosen.append(nxt)
            continue
        # the producer already runs in fp32 (or is unknown): step outward from the innermost choice
        inner = max(covering or chosen, key=lambda c: (c != "") + c.count("."))
        par = _parent(inner)
        if par is None:
            break
        chosen = [c for c in chosen if not _covers(par, c)] + [par]
    if not finite:
        return {"modules": chosen, "tries": tries, "found": False}
    for name in list(chosen):       # prune: keep only what is needed
        if len(chosen) == 1 or tries >= 2 * MAX_TRIES:
            break
        rest = [c for c in chosen if c != name]
        ok, _ = try_set(rest)
        tries += 1
        if ok:
            chosen = rest
    return {"modules": chosen, "tries": tries, "found": True}


def snippet(modules: list[str], device: str) -> str:
    """Python that a user can paste after building the model (names as in model.named_modules())."""
    names = ", ".join(repr(m) for m in modules)
    return f'''import torch

def run_in_fp32(module, device_type="{device}"):
    """Run `module` with autocast off and its floating inputs cast to fp32 (ampdoctor fix search)."""
    forward = module.forward
    def fp32_forward(*args, **kwargs):
        up = lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t
        with torch.autocast(device_type, enabled=False):
            return forward(*[up(a) for a in args], **{{k: up(v) for k, v in kwargs.items()}})
    module.forward = fp32_forward

for name in [{names}]:
    run_in_fp32(model.get_submodule(name))
'''
