"""What the weight rules (ampdoctor/rules/weights.py) share: which parameters are trained, the module that holds a
set of them, and which optimizer groups' eps vanishes in fp16 (and the step whose update it broke). No rule is
registered here."""
from __future__ import annotations

import math
import os

from .registry import RunData
from .outside import weights_found_bad


def finite_norm(v) -> bool:
    """A weight norm that is a finite number (None: not measured, taken as finite)."""
    return v is None or (v == v and abs(v) != float("inf"))


def common_module(names: list[str]) -> str:
    """The deepest module that contains all the given parameter names ('' = root)."""
    mods = [n.rpartition(".")[0] for n in names]
    if not mods:
        return ""
    parts = os.path.commonprefix([m.split(".") for m in mods])
    return ".".join(parts)


def trained_names(run: RunData) -> set:
    """Names of the parameters that can be updated: requiring grad when the watch began, or with a gradient on a
    recorded step (unfrozen later). A frozen fp16 embedding that the optimizer holds but never gets a gradient
    is never updated: it needs no master copy and its eps never divides anything."""
    names = {p[0] for p in run.meta.params if len(p) < 6 or p[5] is not False}
    for r in run.steps:
        names.update(p.name for p in r.params if p.grad_absmax is not None)
    return names


_FP16_TINY = 2.0 ** -24  # smallest fp16 subnormal: anything below half of it rounds to 0


def _broken_at(run: RunData, names: set) -> int | None:
    """The step whose update the vanished eps broke: the first sampled update that left one of `names` non-finite,
    else the update just before the run's first bad step (when that step itself was fine); None when neither."""
    prev = None
    for r in run.steps:
        # (weights non-finite before the update, or a bad step's gradients applied: broken before)
        if not r.bad and any(p.name in names and p.weight_norm_after is not None and finite_norm(p.weight_norm)
                             and not math.isfinite(p.weight_norm_after) for p in r.params):
            return r.step
        if r.bad:
            return prev.step if prev is not None and not prev.bad and prev.step == r.step - 1 else None
        prev = r
    return None


def vanished_state_eps(run: RunData) -> list[tuple]:
    """As `vanished_eps`, for parameters that are not fp16 but whose optimizer state is (ParamStat.state_dtype,
    recorded on sampled steps)."""
    narrow = {p.name for r in run.steps for p in r.params if p.state_dtype == "float16"}
    if not narrow:
        return []
    return _eps_groups(run, lambda name, dtype: dtype != "float16" and name in narrow)


def vanished_eps(run: RunData) -> list[tuple]:
    """(group index, eps, its trained fp16 parameters, the step whose update the eps broke or None) per optimizer
    group whose eps rounds to 0 in fp16. Not a fused optimizer's: its kernel adds eps in fp32 (torch's fused
    Adam/AdamW compute in float whatever the parameters' dtype), so eps does not vanish there."""
    trained = trained_names(run)
    return _eps_groups(run, lambda name, dtype: dtype == "float16" and (name in trained or name == "?"),
                       skip_fused=True)


def _eps_groups(run: RunData, low, skip_fused: bool = False) -> list[tuple]:
    """(group index, eps, the group's parameters `low(name, dtype)` picks, the step whose update the eps broke or
    None) per optimizer group whose eps rounds to 0 in fp16 and that holds such parameters (`skip_fused`: not a
    fused optimizer's group)."""
    out = []
    for gi, g in enumerate(run.meta.optimizer.get("groups") or []):
        if skip_fused and g.get("fused") is True:
            continue
        eps = g.get("eps")
        if isinstance(eps, list):  # a pair (Adafactor): the smallest one given
            eps = min((e for e in eps if isinstance(e, (int, float)) and e > 0), default=None)
        names = [p[0] for p in g.get("params") or [] if isinstance(p, (list, tuple)) and len(p) == 2
                 and low(p[0], p[1])]
        if not isinstance(eps, (int, float)) or not names or eps >= _FP16_TINY / 2:
            continue
        out.append((gi, eps, names, _broken_at(run, set(names))))
    return out


def eps_broke(vanished: list[tuple]) -> set:
    """The fp16 parameters of the groups (`vanished_eps`) whose vanished eps broke the run (a step's update went
    non-finite): their other findings (no master copy, updates rounding away) rank after the eps that ended the
    run."""
    return {n for _, _, low, broke in vanished if broke is not None for n in low}


def went_bad(run: RunData, names: list[str]) -> list[str]:
    """Those of `names` whose module held non-finite weights on the first step that found any (as
    rules/outside.bad_weights reads them: `weights_found_bad`): where the vanished eps divided by 0. Empty when
    none was found."""
    for r in run.steps:
        mods = {b[0] for b in weights_found_bad(r, {})}
        if mods:
            return [n for n in names if n.rpartition(".")[0] in mods]
    return []
