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

from ..fixes import fp32_patch_snippet

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


def search(first_producer: str | None,
           try_set: Callable[[list[str]], tuple[bool, str | None, str | None]]) -> dict:
    """`try_set(modules) -> (finite, next producer or None, error or None)` (error: the trial raised).
    Returns {"modules", "tries", "found", "trials": [{"modules", "outcome"}]}."""
    if first_producer is None:
        return {"modules": [], "tries": 0, "found": False, "trials": []}
    chosen: list[str] = [first_producer]
    tries = 0
    finite = False
    trials: list[dict] = []

    def attempt(mods):
        ok, nxt, err = try_set(mods)
        trials.append({"modules": list(mods),
                       "outcome": f"crashed: {err}" if err else ("finite" if ok else "not finite")})
        return ok, nxt

    while tries < MAX_TRIES:
        finite, nxt = attempt(chosen)
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
        return {"modules": chosen, "tries": tries, "found": False, "trials": trials}
    for name in list(chosen):       # prune: keep only what is needed
        if len(chosen) == 1 or tries >= 2 * MAX_TRIES:
            break
        rest = [c for c in chosen if c != name]
        ok, _ = attempt(rest)
        tries += 1
        if ok:
            chosen = rest
    return {"modules": chosen, "tries": tries, "found": True, "trials": trials}


def snippet(modules: list[str], device: str) -> str:
    """Python that a user can paste after building the model (names as in model.named_modules())."""
    return fp32_patch_snippet(modules, device)
