"""Find the first inf/NaN producer among one step's module calls: the innermost call whose inputs were finite
and whose output was not (forward), or whose incoming gradient was finite and outgoing was not (backward).

Pure functions over `ModuleCall` records; calls that only passed a non-finite value on are propagators.
"""
from __future__ import annotations

from ..records import ACCUMULATING, DTYPE_LIMITS, ModuleCall, Producer, TensorStats

__all__ = ["forward_producer", "backward_producer", "is_ancestor", "mask_like", "ACCUMULATING"]


def _has_inf(s: TensorStats | None) -> bool:
    return s is not None and (s.posinf + s.neginf) > 0


def _has_nan(s: TensorStats | None) -> bool:
    return s is not None and s.nan > 0


def _kind(inp: TensorStats | None, out: TensorStats | None) -> str | None:
    """'inf' if out has ±inf and inp had none (and no NaN); 'nan' if out has NaN and inp had none."""
    if out is None:
        return None
    if _has_inf(out) and not _has_inf(inp) and not _has_nan(inp):
        return "inf"
    if _has_nan(out) and not _has_nan(inp):
        return "nan"
    return None


def is_ancestor(a: ModuleCall, b: ModuleCall, parents: dict[int, int | None]) -> bool:
    """True if call `a` encloses call `b` (b ran inside a's forward)."""
    p = parents.get(b.seq)
    while p is not None:
        if p == a.seq:
            return True
        p = parents.get(p)
    return False


def _innermost(cands: list[ModuleCall], parents: dict[int, int | None]) -> list[ModuleCall]:
    return [c for c in cands if not any(o is not c and is_ancestor(c, o, parents) for o in cands)]


def _bad_weights(calls: list[ModuleCall], parents: dict[int, int | None]) -> set[int]:
    """seqs of calls that hold, or enclose a call that holds, non-finite weights."""
    bad: set[int] = set()
    for c in calls:
        if c.par is not None and not c.par.finite:
            p: int | None = c.seq
            while p is not None and p not in bad:
                bad.add(p)
                p = parents.get(p)
    return bad


def forward_producer(calls: list[ModuleCall], parents: dict[int, int | None]) -> Producer | None:
    tainted = _bad_weights(calls, parents)
    cands = [c for c in calls if c.seq not in tainted and _kind(c.inp, c.out)]
    if not cands:
        return None
    # NaN made from an inf input (inf - inf, 0 * inf) is that inf's consequence, not a separate origin: the inf
    # came from another candidate, or from an op of an enclosing module (whose output may then hold only NaN)
    made = [c for c in cands if not (_kind(c.inp, c.out) == "nan" and _has_inf(c.inp))]
    if made:
        cands = made
    # A call that emits only -inf is often meant to (an additive attention mask): an overflow or NaN made
    # elsewhere in the step is the better origin
    leaves = _leaves(calls, parents)
    strong = [c for c in cands if not mask_like(c, c.seq in leaves)]
    if strong:
        cands = strong
    inner = _innermost(cands, parents)
    first = min(inner, key=lambda c: c.seq)
    kind = _kind(first.inp, first.out)
    return Producer(module=first.module, call=first.call, phase="forward", kind=kind,
                    detail={"seq": first.seq, "type": first.type, "candidates": len(cands),
                            "mask_like": mask_like(first, first.seq in leaves)})



def _leaves(calls: list[ModuleCall], parents: dict[int, int | None]) -> set[int]:
    inner = {p for p in parents.values() if p is not None}
    return {c.seq for c in calls if c.seq not in inner}


def mask_like(c: ModuleCall, leaf: bool = False) -> bool:
    """-inf only, made on purpose: a mask is a constant a module builds (a fill, a triu, finfo.min), so its
    finite values stay ordinary. An overflow to -inf is not a mask: a Linear/Conv (any accumulating layer, or a
    leaf module with weights of its own) that produced -inf from finite inputs overflowed, and so did a module
    whose finite values reach the dtype's near-max range next to its -inf."""
    out = c.out
    if out is None or not (out.neginf > 0 and out.posinf == 0 and out.nan == 0):
        return False
    if out.numel and out.neginf >= out.numel:
        return False  # every value -inf: nothing is left unmasked (a log-softmax whose sum overflowed: s - log(inf))
    if c.type in ACCUMULATING or (leaf and c.par is not None):
        return False
    near = DTYPE_LIMITS.get(out.ref, DTYPE_LIMITS["float32"])[2]
    return out.absmax < near


def backward_producer(calls: list[ModuleCall], parents: dict[int, int | None],
                      bad_param_modules: set[str] = frozenset()) -> Producer | None:
    """gout finite (for the kind) and gin non-finite, or gout finite and the module's own parameter grads
    non-finite. Ties between siblings: own bad parameter grads first, then the earliest in backward order."""
    cands: list[tuple[ModuleCall, str]] = []
    for c in calls:
        if c.gout is None and c.gin is None:
            continue
        if (c.inp is not None and not c.inp.finite) or (c.out is not None and not c.out.finite):
            continue  # non-finite forward values: its bad gradients are a consequence, not a backward origin
        k = _kind(c.gout, c.gin)
        if k is None and c.module in bad_param_modules and c.gout is not None and c.gout.finite:
            k = "nonfinite_param_grad"
        if k:
            cands.append((c, k))
    if not cands:
        return None
    made = [(c, k) for c, k in cands if not (k == "nan" and _has_inf(c.gout))]  # NaN from an inf gradient
    if made:
        cands = made
    inner = _innermost([c for c, _ in cands], parents)
    kinds = {id(c): k for c, k in cands}
    def order(c: ModuleCall):
        return (c.module not in bad_param_modules, c.bseq if c.bseq is not None else 1 << 30, -c.seq)
    first = min(inner, key=order)
    kind = kinds[id(first)]
    if kind == "nonfinite_param_grad":
        kind = "nan" if first.gin is not None and _has_nan(first.gin) else "inf"
    return Producer(module=first.module, call=first.call, phase="backward", kind=kind,
                    detail={"seq": first.seq, "type": first.type, "candidates": len(cands)})
