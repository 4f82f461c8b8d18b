"""Weight rules: fp16_master_weights (optimizer holds low-precision parameters, or GradScaler refused fp16
gradients), update_underflow (low-precision updates that round away: w + Δw == w) and optimizer_eps (an eps that
vanishes in fp16; which groups: rules/epsgroups.py)."""
from __future__ import annotations

from ..findings import Finding
from ..records import ROUNDING_MIN_SAMPLED
from .epsgroups import common_module, eps_broke, finite_norm, trained_names, vanished_eps, vanished_state_eps, went_bad
from .registry import RuleConfig, RunData, register
from .steps import crash

_FP16_GRADS = "Attempting to unscale FP16 gradients"


@register("fp16_master_weights", emits=("fp16_master_weights",))
def fp16_master_weights(run: RunData, cfg: RuleConfig) -> list[Finding]:
    trained = trained_names(run)
    # held by the watched optimizer (True), or, where no optimizer was given (None), seen updated by one: an
    # fp16 model whose optimizer steps fp32 master copies (the classic mixed-precision recipe) updates none
    updated = {p.name for r in run.steps for p in r.params if p.update_sampled > 0} \
        if any(p[4] is None for p in run.meta.params) else set()
    # (a parameter the run made fp16 after the watch began, as a sampled step's record has it: from that step)
    became = {}
    for r in run.steps:
        for p in r.params:
            if p.dtype == "float16" and p.name not in became:
                became[p.name] = r.step
    low = [p for p in run.meta.params if (p[2] in ("float16",) or p[0] in became) and p[0] in trained
           and (p[4] is True or p[4] is None and p[0] in updated)]
    err_ev = next(((r, e) for r in run.steps for e in r.events if _FP16_GRADS in (e.error or "")), None)
    opt = run.meta.optimizer or {}
    low_masters = [d for d in opt.get("param_dtypes") or () if d in ("float16", "bfloat16")]
    if opt.get("masters") and low_masters and not low and err_ev is None:
        # master copies made in the model's own low precision (`p.detach().clone()` without `.float()`)
        return [Finding(
            "fp16_master_weights", "error", "optimizer", "", None, run.steps[0].step if run.steps else None,
            f"The optimizer steps copies of the model's weights, but the copies are {'/'.join(low_masters)} too "
            "(made without `.float()`): they are no fp32 master weights, so small updates round away in them just "
            "as in the model.",
            "Make the master copies fp32: `masters = [p.detach().float().clone().requires_grad_() for p in "
            "model.parameters()]`, copy the gradients in as fp32 and the updated masters back into the model "
            "after each step; or keep the model fp32 under autocast with a GradScaler.",
            {"master_dtypes": low_masters, "optimizer": opt.get("class"), "rank_hint": 6})]
    if not low and err_ev is None:
        return []
    names = [p[0] for p in low]
    module = common_module(names) if names else None
    total = sum(p[3] for p in run.meta.params) or 1
    share = sum(p[3] for p in low) / total
    ev = {"params": names[:50], "n_params": len(names), "share_of_elements": share,
          "optimizer": run.meta.optimizer.get("class"), "rank_hint": 6}
    fix = ("Keep parameters in fp32 and let autocast cast per op: do not call `model.half()` (or `.half()` on a "
           "submodule) for training; `with torch.autocast(device, dtype=torch.float16): loss = model(x)` with a "
           "GradScaler. For pure low-precision training keep an fp32 master copy (apex O2, DeepSpeed fp16).")
    if err_ev is not None:
        r, e = err_ev
        if not names and e.extra.get("fp16_params"):  # held by a group added after the watch began
            names = [n for n in e.extra["fp16_params"] if n != "?"]
            module = common_module(names) if names else None
            ev.update(params=names, n_params=len(names))
        ev.update({"api": "GradScaler.unscale_", "file": e.file, "line": e.line, "error": e.error})
        return [Finding("fp16_master_weights", "error", "optimizer", module, None, r.step,
                        f"GradScaler refused to unscale fp16 gradients at {e.file}:{e.line}: the optimizer holds "
                        f"fp16 parameters ({', '.join(names[:3])}{'…' if len(names) > 3 else ''}), so there is no "
                        "fp32 master copy.", fix, ev)]
    # without a scaler it is a risk, unless their updates already round away (update_underflow then names the
    # modules where it shows; this is their cause and ranks first)
    held = set(names)
    rounds = any(held.intersection(v[2]) for v in _rounded(run, cfg).values())  # (as update_underflow counts them)
    # an Adam-style eps that vanishes on them (optimizer_eps) breaks the run through the same missing master copy:
    # the two are one cause, and the master copy is the fix for both
    vanished = vanished_eps(run)
    eps_vanishes = any(held.intersection(low) for _, _, low, _ in vanished)
    # the run died of a dtype clash once they were made fp16 mid-run (AdamW's fp32 moments beside parameters an
    # eval callback `.half()`d): the crash is theirs
    first_low = min((became[n] for n in names if n in became), default=None)
    died = crash(list(run.steps)) if first_low is not None else None
    if died is not None and not (died["step"] >= first_low and any(
            w in str(died.get("message") or "") for w in ("Half", "float16", "dtype"))):
        died = None
    if died is not None:
        ev.update({"crash": died.get("message"), "crash_file": died.get("file"), "crash_line": died.get("line")})
    sev = "error" if run.has_scaler or rounds or eps_vanishes or died is not None else "warning"
    if eps_vanishes:
        # right after the eps (how the updates broke), before their consequences; after it also when the eps broke
        # the run at a later step (the step would otherwise rank this step-0 finding first)
        ev["rank_hint"] = 11 if held & eps_broke(vanished) else 7
    at = run.steps[0].step if run.steps else None
    if names and all(p[2] != "float16" for p in low):  # every one of them made fp16 during the run
        at = min(became[n] for n in names)
    return [Finding("fp16_master_weights", sev, "optimizer", module, None, at,
                    f"The optimizer updates {len(names)} fp16 parameter(s) ({share:.0%} of the weights) directly: "
                    "no fp32 master copy, so small updates round away"
                    + (f" and {run.meta.optimizer.get('class')}'s moments lose precision."
                       if "adam" in str(run.meta.optimizer.get("class") or "").lower() else ".")
                    + (" Its eps rounds to 0 in fp16 too, which is how the updates went non-finite (eps_underflow)."
                       if eps_vanishes else ""), fix, ev)]


@register("update_underflow", emits=("update_underflow",))
def update_underflow(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Per module, per checked update: the share of its parameters' sampled elements (those with a nonzero
    gradient) that did not change; a module past `rounded_away_share` on `_MIN_SAMPLED` elements or more. A few
    elements alone (a 4-element bias whose update rounds in two of them while its layer's weight moves) say nothing
    about the layer's training."""
    worst = _rounded(run, cfg)
    out = _outside_updates(run, cfg) + _masters_not_copied(run)
    order = {m[0]: i for i, m in enumerate(run.meta.modules or []) if isinstance(m, (list, tuple)) and m}
    by_step: dict[int, list[str]] = {}
    for module, v in worst.items():
        by_step.setdefault(v[1], []).append(module)
    for step, mods in by_step.items():
        mods.sort(key=lambda mod: order.get(mod, len(order)))
        # many layers at once (a whole model's updates below its ulp): one finding, at the first of them in the
        # model, the others listed, so that it does not crowd out the cause (an underflow, a learning rate)
        if len(mods) < _MANY_LAYERS:
            out.extend(_rounding_finding(mod, worst[mod], []) for mod in mods)
        else:
            out.append(_rounding_finding(mods[0], worst[mods[0]], mods[1:]))
    broke = eps_broke(vanished_eps(run))
    for f in out:
        if broke.intersection(f.evidence.get("params") or ()):
            f.evidence["rank_hint"] = 17  # (a stall, beside the vanished eps that ended the run: after it)
    return out


_MANY_LAYERS = 3


def _rounding_finding(module: str, v: tuple, others: list[str]) -> Finding:
    share, step, names, n, k, p = v
    which = f"`{names[0]}`" if len(names) == 1 else f"`{module or '(root)'}`'s parameters ({', '.join(names[:4])})"
    more = (f" So do {len(others)} more layer(s) from this step on ({', '.join(others[:4])}"
            f"{', …' if len(others) > 4 else ''}).") if others else ""
    return Finding(
        "update_underflow", "error", "optimizer", module, None, step,
        f"{share:.0%} of sampled elements of {which} ({p.dtype}) did not change although their gradient "
        f"was nonzero: the update is below half an ulp of the weight and rounds away (w + Δw == w); "
        "training of this layer has silently stopped." + more,
        "Keep fp32 master weights (parameters in fp32 + autocast), or raise the learning rate / use a "
        "low-precision-aware optimizer (Kahan summation, stochastic rounding).",
        {"params": names, "share": share, "sampled": n, "rounded_away": k, "dtype": p.dtype,
         "grad_absmax": p.grad_absmax, "also_modules": others, "rank_hint": 7})


def _rounded(run: RunData, cfg: RuleConfig) -> dict[str, tuple]:
    """module -> (worst share, the first step past `rounded_away_share`, the params past it, sampled, rounded
    away, a parameter of it) over the checked updates (see update_underflow)."""
    worst: dict[str, tuple] = {}
    small: dict[str, list] = {}  # a module with fewer than _MIN_SAMPLED elements in all: [n, k, checks, first, ps]
    by_check: dict[str, list] = {}  # module -> [(step, params, sampled, rounded away, past the share, big params past)]
    for r in run.steps:
        by_module: dict[str, list] = {}
        for p in r.params:
            if p.update_sampled <= 0 or not finite_norm(p.weight_norm) or p.grad_nonfinite:
                continue  # inf + Δw == inf and NaN updates say nothing about rounding: a consequence, not this
            by_module.setdefault(p.module, []).append(p)
        for module, ps in by_module.items():
            n = sum(p.update_sampled for p in ps)
            k = sum(p.update_rounded_away for p in ps)
            if n < _MIN_SAMPLED and sum(p.numel for p in ps) < _MIN_SAMPLED:
                # (a learnable temperature, a gate: one scalar can never hold 16 elements in one check; its
                # checks are summed over the run instead)
                acc = small.setdefault(module, [0, 0, 0, None, ps])
                acc[0] += n
                acc[1] += k
                acc[2] += 1
                if k and acc[3] is None:
                    acc[3] = r.step
                acc[4] = ps
                continue
            # (or one parameter holding most of the module's weights, whose own updates round away while a
            # smaller one's still move: a GRU's weight_hh beside its weight_ih)
            total = sum(p.numel for p in ps)
            big = [p for p in ps if p.update_sampled >= _MIN_SAMPLED and p.numel >= _BIG_PARAM * total
                   and p.update_rounded_away >= cfg.rounded_away_share * p.update_sampled]
            if n >= _MIN_SAMPLED:
                by_check.setdefault(module, []).append((r.step, ps, n, k, k >= cfg.rounded_away_share * n, big))
    for module, cs in by_check.items():
        for i, (step, ps, n, k, past, big) in enumerate(cs):
            # a parameter alone counts when it rounds away at one of the module's next two checks too: a one-off (the
            # first update, before an optimizer's momentum builds up) is no stop
            if not past and not (big and any(c[4] or c[5] for c in cs[i + 1:i + 3])):
                continue
            if not past:
                p = max(big, key=lambda p: p.update_rounded_away / p.update_sampled)
                n, k = p.update_sampled, p.update_rounded_away
            share = k / n
            names = [p.name for p in ps if p.update_rounded_away >= cfg.rounded_away_share * p.update_sampled]
            if module not in worst or share > worst[module][0]:
                # the step is where it began (the first step past the share), the numbers the worst seen
                first = worst[module][1] if module in worst else step
                worst[module] = (share, first, names or [p.name for p in ps], n, k,
                                 max(ps, key=lambda p: p.update_sampled))
    for module, (n, k, checks, first, ps) in small.items():
        if checks >= _MIN_CHECKS_SMALL and k >= _SMALL_SHARE * n:  # (never in `worst`: judged only here)
            worst[module] = (k / n, first, [p.name for p in ps], n, k, max(ps, key=lambda p: p.update_sampled))
    return worst


_BIG_PARAM = 0.5        # a parameter with this share of its module's elements is judged on its own too (_rounded)
_MIN_CHECKS_SMALL = 4   # checked updates of a module too small for one check to say anything (see _rounded) ...
_SMALL_SHARE = 0.75     # ... of which at least this share of its sampled elements rounded away


_MIN_SAMPLED = ROUNDING_MIN_SAMPLED  # (records.py: the recorder's extra checks end by the same count)


OUTSIDE_MIN_SAMPLED = 256
"""Sampled elements (over a module's frozen parameters) needed before an outside update is judged."""


def _outside_updates(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Frozen fp16/bf16 weights the user's code writes in place (an EMA teacher, a momentum encoder) whose values
    did not change: every such update rounds away (`w * 0.9999 + 0.0001 * w'` is w in fp16), and the copy never
    follows the model it should average."""
    dtypes = {p[0]: p[2] for p in run.meta.params}
    # one finding per top-level copy (the teacher, not each of its layers)
    tops: dict[str, list] = {}
    for r in run.steps:
        for name, (same, n) in (r.outside_updates or {}).items():
            tops.setdefault(name.split(".")[0] if "." in name else "", []).append((r.step, name, same, n))
    out = []
    for top, items in tops.items():
        same, n = sum(i[2] for i in items), sum(i[3] for i in items)
        if n < OUTSIDE_MIN_SAMPLED or same / n < cfg.rounded_away_share:
            continue
        names = sorted({i[1] for i in items})
        dt = dtypes.get(names[0], "float16")
        module = common_module(names)
        out.append(Finding(
            "update_underflow", "error", "optimizer", module, None, min(i[0] for i in items),
            f"`{module or '(root)'}`'s {dt} weights are written in place outside the optimizer (an EMA or momentum "
            f"copy), but {same / n:.0%} of the sampled elements did not change: each update is below half an ulp "
            "of the weight and rounds away, so the copy stays where it started.",
            "Keep the EMA copy in fp32 (`ema = copy.deepcopy(model).float()`), or update it less often with a "
            "correspondingly smaller momentum; cast to fp16 only for its forward.",
            {"params": names[:20], "share": same / n, "sampled": n, "rounded_away": same, "dtype": dt,
             "outside_optimizer": True, "rank_hint": 7}))
    return out


MASTERS_MIN_MOVED = 16
"""Sampled master elements that must have moved (in the weight's dtype) before a model that did not follow is judged."""


def _masters_not_copied(run: RunData) -> list[Finding]:
    """A hand-rolled master-weight loop that never copies the masters back: after a step, the optimizer's fp32 copies
    moved where the model's fp16/bf16 weights could show it, and not one of those weights changed (StepRecord
    masters_back). One look that saw a copy back (any weight followed) clears the run."""
    looks = []
    for r in run.steps:
        mb = r.masters_back
        if not isinstance(mb, dict):
            continue
        moved, stuck, since = mb.get("moved"), mb.get("stuck"), mb.get("since")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (moved, stuck, since)) or moved <= 0:
            continue
        if stuck < moved:
            return []
        looks.append((since, moved))
    if not looks or max(n for _, n in looks) < MASTERS_MIN_MOVED:
        return []
    since, moved = looks[0]
    dt = next((p[2] for p in run.meta.params if p[2] in ("float16", "bfloat16")), "float16")
    return [Finding(
        "update_underflow", "error", "optimizer", None, None, since,
        f"The optimizer steps fp32 master copies of the model's {dt} weights, but the updates never reach the model: "
        f"after step {since}, {moved} sampled master values moved far enough to change the {dt} weights, and not one "
        "of the model's weights changed. The forward keeps running the weights it started with, so the model does not "
        "learn (the masters are never copied back).",
        "After each optimizer step copy the masters back into the model:\n"
        "with torch.no_grad():\n"
        "    for p, master in zip(model.parameters(), masters):\n"
        "        p.copy_(master)",
        {"masters": True, "copied_back": False, "moved": moved, "stuck": moved, "looks": len(looks), "dtype": dt,
         "rank_hint": 6})]


@register("optimizer_eps", emits=("eps_underflow",))
def optimizer_eps(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Adam-style eps that vanishes in fp16 optimizer state: sqrt(v) + eps == sqrt(v), so v == 0 divides by 0."""
    out = []
    for gi, eps, low, broke in vanished_eps(run):
        out.append(Finding(
            "eps_underflow", "error", "optimizer", common_module(went_bad(run, low) or low), None, broke,
            f"{run.meta.optimizer.get('class')} uses eps={eps:g} on fp16 parameters: it rounds to 0 in fp16, so "
            "the update divides by sqrt(v) + 0 and any parameter with v == 0 gets inf/NaN.",
            "Keep fp32 master weights (parameters in fp32 + autocast), or use an eps that exists in fp16 "
            "(>= 1e-4 for fp16 optimizer state, e.g. `torch.optim.Adam(params, eps=1e-4)`).",
            {"api": "optimizer.step", "eps": eps, "group": gi, "params": low[:20], "rank_hint": 6}))
    for gi, eps, low, broke in vanished_state_eps(run):
        out.append(Finding(
            "eps_underflow", "error" if broke is not None else "warning", "optimizer",
            common_module(went_bad(run, low) or low), None, broke,
            f"{run.meta.optimizer.get('class')} keeps its optimizer state in fp16 for {len(low)} parameter(s) that "
            f"are not fp16 themselves, with eps={eps:g}, below fp16's smallest value: where g² underflows in that "
            "state (v == 0 while the gradient is not 0), the update divides by ~0 (inf/NaN, or a step of lr·m/eps)"
            + (f"; the update at step {broke} went non-finite or blew up." if broke is not None else "."),
            "Keep the optimizer's moments in float32 (torch.optim.AdamW keeps them in the parameters' dtype), or in "
            "bfloat16, whose range holds g²; with fp16 state, use eps >= 1e-4.",
            {"api": "optimizer.step", "eps": eps, "group": gi, "params": low[:20], "state_dtype": "float16",
             "rank_hint": 6}))
    return out
