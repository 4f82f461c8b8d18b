"""Fix snippets: the one definition of "run this module in fp32" as paste-able Python, for every finding.

`call_expr` turns a qualified module name into the expression that calls it from its owner's `forward`
(`ff.wo` -> `self.wo`, `layers.2` -> `self.layers[2]`, a name that is not an identifier -> `getattr(...)`),
`fp32_snippet` wraps that call in autocast-off with its input cast up, and `fp32_patch_snippet` is the
standalone form the fix search emits (patch the named modules of a built model). `module_label` and
`modules_related` are how messages and rules read a qualified module name. Every snippet compiles
(tests/test_replay_fixes.py `compile()`s them for numbered, nested and root names).
"""
from __future__ import annotations

import keyword

__all__ = ["call_expr", "fp32_snippet", "fp32_patch_snippet", "module_label", "modules_related"]


def module_label(module: str | None) -> str:
    """The module as a person reads it in a message: `(root)` for "" and "the model" for None."""
    if module is None:
        return "the model"
    return "(root)" if module == "" else module


def modules_related(a: str | None, b: str | None) -> bool:
    """One qualified module name is the other or contains it ("" is the root, containing every module); False when
    either is unknown (None)."""
    if a is None or b is None:
        return False
    return a == b or a == "" or b == "" or a.startswith(b + ".") or b.startswith(a + ".")


def _attr(base: str, part: str) -> str:
    if part.isdigit():
        return f"{base}[{part}]"                 # ModuleList / Sequential child
    if part.isidentifier() and not keyword.iskeyword(part):
        return f"{base}.{part}"
    return f"getattr({base}, {part!r})"


def call_expr(module: str | None) -> str:
    """How the owner's forward reaches `module`: `self.<attr>` after the last named (non-numbered) parent.

    `ff.wo` -> `self.wo`; `h.0.mlp` -> `self.mlp`; `layers.2` -> `self.layers[2]`; `blocks.0.1` ->
    `self.blocks[0][1]`; the root ("") or an unknown module (None) -> `model`."""
    if not module:
        return "model"
    parts = module.split(".")
    i = len(parts) - 1
    while i > 0 and parts[i].isdigit():          # numbered children are indexed in the container's owner
        i -= 1
    expr = "self"
    for p in parts[i:]:
        expr = _attr(expr, p)
    return expr


def fp32_snippet(module: str | None, device: str) -> str:
    """Autocast off around one call, its floating input cast to fp32 (valid Python for any module name)."""
    return (f"with torch.autocast(device_type=\"{device}\", enabled=False):\n"
            f"    out = {call_expr(module)}(x.float())   # run {module_label(module)} in fp32")


def fp32_patch_snippet(modules: list[str], device: str) -> str:
    """Python a user pastes after building the model: the named modules (as in `model.named_modules()`) run
    with autocast off and their floating inputs cast to fp32."""
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
