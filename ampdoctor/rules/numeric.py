"""Numeric rules from module-level records that are not about where an inf/NaN came from (see origins.py):
overflow_risk, underflow, silent zeros from an fp16 norm (overflow), and the mask-constant crash
(mask_value_overflow) seen as an exception inside a module's forward."""
from __future__ import annotations

import linecache
import math
import re
from collections import deque
from statistics import median_high

from ..findings import Finding
from ..records import DTYPE_LIMITS, LOSS_JUMP
from .registry import RuleConfig, RunData, register
from ..fixes import fp32_snippet
from .origins import autocast_device
from .steps import descendants, parents


def _near(s, bits: float) -> bool:
    """Within `bits` of the reference dtype's max, or beyond it once cast (overflow_as_ref)."""
    if s is None or not s.finite or s.ref == "float32" or s.absmax <= 0:
        return False
    mx = DTYPE_LIMITS.get(s.ref, DTYPE_LIMITS["float32"])[0]
    return s.overflow_as_ref > 0 or math.log2(mx / s.absmax) < bits


def _low(s) -> bool:
    """The tensor lives in the low-precision dtype it is measured against (fp16 values, not fp32 ones)."""
    return s is not None and s.dtype == s.ref and s.ref != "float32"


@register("overflow_risk", emits=("overflow_risk",))
def overflow_risk(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Forward outputs within `near_max_bits` of the low-precision max, still finite, where a low-precision op
    will see them: the value is itself fp16/bf16, or a wider (fp32) value that a later module computing in the
    low dtype takes as input (an fp32 residual stream that only enters LayerNorm in fp32 is not at risk).
    One finding per chain, at its producer: not a module whose input was already near the max (dropout, the
    next block), nor a parent whose child already made the value."""
    seen: dict[str, Finding] = {}
    bad_modules = {p.module for r in run.steps for p in (r.forward_producer,) if p is not None}
    for r in run.steps:
        par = parents(r.modules)
        readers = _low_readers(r.modules, par)
        hits = []
        for c in r.modules:
            o = c.out
            if not _near(o, cfg.near_max_bits) or c.module in bad_modules or c.depth == 0:
                continue
            if o.dtype != o.ref and o.absmax >= 1e30:
                continue  # an fp32 mask constant (finfo.min) among the outputs, not an activation
            if _near(c.inp, cfg.near_max_bits) and c.inp.absmax >= 0.5 * o.absmax:
                continue  # its input was already there: it passed the value on (dropout, a residual add, ...)
            if not _low(o) and not any(d.seq > c.seq for d in readers):
                continue  # a wide tensor no later module casts down (a loss in fp32, a residual into LayerNorm)
            hits.append(c)
        for c in hits:
            if any(d in hits for d in descendants(r.modules, c, par)) or c.module in seen:
                continue  # a parent of the producer: the same value, already named at the child
            o = c.out
            mx = DTYPE_LIMITS.get(o.ref, DTYPE_LIMITS["float32"])[0]
            head = math.log2(mx / o.absmax)
            what = (f"is {o.absmax / mx:.3g}× the {o.ref} maximum ({mx:g}) while still in {o.dtype}: the "
                    f"{o.ref} op that takes it will make inf" if head < 0 else
                    f"is {head:.2f} bits below the {o.ref} maximum ({mx:g}): a slightly larger input overflows")
            seen[c.module] = Finding(
                "overflow_risk", "warning", "forward", c.module, None, r.step,
                f"`{c.module or '(root)'}` ({c.type}) output reached {o.absmax:.4g}, which {what}.",
                "Bound the values where they are made (normalise or rescale the input, a smaller init or "
                "learning rate), clamp them before the low-precision op, or keep this module in fp32:\n"
                + fp32_snippet(c.module, autocast_device(run)),
                {"absmax_out": o.absmax, "headroom_bits": head, "near_max": o.near_max, "dtype_out": o.dtype,
                 "overflow_as_ref": o.overflow_as_ref, "ref": o.ref, "rank_hint": 30})
    return list(seen.values())


def _low_readers(calls: list, par: dict) -> list:
    """The calls that take an input past the low-precision max and make a low-precision output: where a wide value
    is cast down. A container none of whose children took such an input transformed the value in fp32 first (a
    log1p, a normaliser) and handed its children values inside the range: not a reader."""
    readers = [d for d in calls if d.inp is not None and d.inp.overflow_as_ref > 0 and _low(d.out)]
    out = []
    for d in readers:
        kids = descendants(calls, d, par)
        if not kids or any(k.inp is not None and k.inp.overflow_as_ref > 0 for k in kids):
            out.append(d)
    return out


# An output whose abs-max is at least this large (2^-14 * 2^11: fp16's smallest normal over its relative precision)
# holds its subnormal values more than 2^-11 below its largest: whatever mixes them with the large ones (a matmul,
# a sum, a norm) rounds them away in fp16 whether they are subnormal or not (a Gaussian kernel's far centres, the
# sigmoid probabilities of absent tags); a forward underflow that loses information has a small abs-max too.
_NEGLIGIBLE_BELOW = 2.0 ** -3


_PINNED_SHARE = 0.9
_PINNED_LOW = 8.0  # a GradScaler whose scale never rises above this leaves small gradients as they would be
_LOSS_FALL = LOSS_JUMP  # a loss that fell this many times in one step (autocapture.loss_jump samples the step after)
_SCALE_CATCHUP = 16.0
_FALL_WINDOW = 8
_RECOVERY_STEPS = 100


def _fallen_onsets(steps: list) -> dict[int, int]:
    """{step: the step its loss fell at} for the steps of a regime that began with the loss falling _LOSS_FALL-fold
    or more in one step from its usual level (a loss weight of 1e-8, an inverse-frequency reweighting), every loss
    since within that factor of the fall's, while the loss scale did not rise _SCALE_CATCHUP-fold to make up for it.
    GradScaler grows by 2x per growth_interval (2000 steps by default): gradients that shrank 1000x at once stay
    below fp16's range for thousands of steps, which is not a scaler's normal search; one that does rise that far
    within _RECOVERY_STEPS of the fall (a growth_interval of 10-25) recovered the gradients itself: none of that
    regime's steps is kept.

    "Its usual level": the median of the _FALL_WINDOW losses before, itself within _LOSS_FALL of the run's first
    ones. A loss that converges (a classifier growing confident: per-batch losses of 1e-4 to 1e-8, jumping by
    orders of magnitude from one batch to the next) falls step by step, and a converged one is not at its usual
    level: neither is a fall."""
    out: dict[int, int] = {}
    onset = level = base_scale = None
    first: list[float] = []
    recent: deque = deque(maxlen=_FALL_WINDOW)
    prev_scale = None
    for q in steps:
        loss = q.loss
        if loss is None or not math.isfinite(loss) or loss == 0:
            onset = None
            recent.clear()
            continue
        a = abs(loss)
        usual = median_high(recent) if len(recent) >= 2 else None
        if usual is not None and usual >= _LOSS_FALL * a and len(first) >= 2 and usual * _LOSS_FALL >= median_high(
                first) and (onset is None or a * _LOSS_FALL <= level):  # (the steps after a fall: the same regime)
            onset, level, base_scale = q.step, a, prev_scale
        elif onset is not None and not 1.0 / _LOSS_FALL < a / level < _LOSS_FALL:
            onset = None
        if onset is not None and base_scale and q.scale and q.scale >= _SCALE_CATCHUP * base_scale:
            if q.step - onset <= _RECOVERY_STEPS:  # the scaler made up for the fall soon: its own search, not ours
                for k in [k for k, v in out.items() if v == onset]:
                    del out[k]
            onset = None
        if onset is not None:
            out[q.step] = onset
        if len(first) < _FALL_WINDOW:
            first.append(a)
        recent.append(a)
        prev_scale = q.scale
    return out


@register("underflow", emits=("underflow",))
def underflow(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Gradients (or activations) whose nonzero values mostly fall below the normal range of fp16."""
    out: list[Finding] = []
    done: set[tuple[str, str]] = set()
    scales = [r.scale for r in run.steps if r.scale is not None]
    pinned = bool(scales) and max(scales) <= _PINNED_LOW
    fallen = _fallen_onsets(run.steps) if run.has_scaler and not pinned else {}
    for r in run.steps:
        if r.forward_bad or (run.has_scaler and r.scale is not None and r.scale < 1.0):
            continue  # gradients of NaN activations, or of a collapsed scale: consequences, reported elsewhere
        flagged = []
        for c in r.modules:
            for phase, s in (("backward", c.gout), ("forward", c.out)):
                if s is None or s.ref != "float16" or (phase, c.module) in done:
                    continue
                if phase == "backward" and run.has_scaler and not pinned and r.step not in fallen:
                    # keeping gradients out of the subnormal range is the scaler's job (see collapse); a scale
                    # that stays at a few at most all run (an init_scale of 1 with growth off) is not doing it,
                    # nor one that stayed put while the loss fell 1000x in one step (_fallen_onsets)
                    continue
                if phase == "forward" and any(k in c.type for k in ("Dropout", "Softmax", "Identity")):
                    continue  # probabilities: tiny values are expected there
                nz = s.nonzero_finite
                if nz < cfg.underflow_min_nonzero or s.subnormal < 0:
                    continue
                share = s.subnormal / nz
                if phase == "forward" and (s.absmax >= _NEGLIGIBLE_BELOW or s.dtype != "float16"):
                    # next to values this large the subnormal ones are below fp16's resolution anyway; and an
                    # fp32 output (an fp16 activation times an fp32 LayerScale gain) holds its tiny values exactly
                    continue
                need = cfg.underflow_share if phase == "backward" else 0.5
                if phase == "backward" and run.has_scaler:
                    need = max(need, _PINNED_SHARE)  # (a pinned scaler: most of them, not a tail of small ones)
                if share >= need:
                    flagged.append((phase, c, s, share))
        for phase in ("backward", "forward"):
            fl = [f for f in flagged if f[0] == phase]
            if any(d[0] == phase for d in done):
                continue
            if not fl:
                continue
            # (a gradient held in fp16 is where the flush happens; an fp32 one measured against fp16, e.g. into an
            # fp32 output, only says the fp16 one behind it will flush)
            fl = [f for f in fl if f[2].dtype == "float16"] or fl
            first = min(fl, key=lambda f: (f[1].bseq if phase == "backward" and f[1].bseq is not None else f[1].seq))
            same = [f for f in fl if f[2].to_dict() == first[2].to_dict()]
            _, c, s, share = max(same, key=lambda f: f[1].depth)
            done.add((phase, c.module))
            scaled = run.has_scaler and phase == "backward"
            fix = ("Use loss scaling: `scaler = torch.amp.GradScaler()`; `scaler.scale(loss).backward()`; "
                   "`scaler.step(opt)`; `scaler.update()` — or train in bf16, which has fp32's range."
                   if not scaled else "The loss scale is too small for these gradients: do not pin a small "
                   "`init_scale`, check for a collapsed scale, or switch to bf16.")
            if phase == "forward":
                fix = ("Rescale these activations or keep the module in fp32 / use bf16:\n"
                       + fp32_snippet(c.module, autocast_device(run)))
            onset = fallen.get(r.step) if scaled and not pinned else None
            if onset is not None:
                fix = (f"The loss fell {_LOSS_FALL:g}x or more in one step at step {onset} and the loss scale did not "
                       "follow (GradScaler doubles it only every `growth_interval` steps): keep the loss at its "
                       "usual magnitude (normalise loss weights to mean 1; put a tiny factor in the learning rate "
                       "instead), compute it in fp32, or train in bf16.")
            out.append(Finding(
                "underflow", "error" if phase == "backward" else "warning", phase, c.module, None,
                r.step if onset is None or any(q.modules for q in run.steps if onset <= q.step < r.step) else onset,
                f"{share:.0%} of the nonzero {'gradients flowing into' if phase == 'backward' else 'outputs of'} "
                f"`{c.module}` are below fp16's normal range (2^-14); "
                f"{'values below 2^-24 are flushed to zero and learning stalls' if phase == 'backward' else 'they lose precision or vanish'}.",
                fix, {"subnormal": s.subnormal, "nonzero": s.nonzero_finite, "zeros": s.zeros, "numel": s.numel,
                      "min_nonzero": s.min_nonzero, "absmax": s.absmax, "share": share,
                      "loss_scale": r.scale, "rank_hint": 20,
                      **({"loss_fell_at": onset, "observed_step": r.step} if onset is not None else {})}))
    return out


@register("vanished_gradient", emits=("underflow",))
def vanished_gradient(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Every fp16 gradient flowing into the model's output is exactly zero while the loss is finite and nonzero,
    and the scaled loss spread over the output's elements is below fp16's subnormal range (a loss weight of 1e-8,
    a sum divided by a huge count): the backward flushed them all to zero and nothing trains. `underflow` proper
    needs nonzero values to measure; here none are left. Named at the first module the backward reaches with an
    all-zero gradient (the one that made the output)."""
    for r in run.steps:
        if not r.modules or r.loss is None or not math.isfinite(r.loss) or r.loss == 0 or r.forward_bad:
            continue
        if run.has_scaler and r.scale is not None and r.scale < 1.0:
            continue  # a collapsed loss scale flushes the gradients: its consequence (loss_scale_collapse)
        root = next((c for c in r.modules if c.depth == 0 and c.gout is not None), None)
        g = root.gout if root is not None else None
        if g is None or g.ref != "float16" or not g.numel or g.zeros != g.numel:
            continue
        scale = r.scale if run.has_scaler and r.scale else 1.0
        per_element = abs(r.loss) * scale / g.numel
        if per_element >= 2.0 ** -20:  # a loss this size gives gradients fp16 can hold: zero for another reason
            continue
        zero = [c for c in r.modules if c.gout is not None and c.gout.ref == "float16" and c.gout.numel
                and c.gout.zeros == c.gout.numel and c.bseq is not None]
        c = min(zero, key=lambda c: (c.bseq, -c.depth)) if zero else root
        # a step sampled because the loss jumped 1000x (autocapture.loss_jump): the new regime began after the
        # jump, when every step between it and this one was a routine step with a loss of the same size
        step = r.step
        for q in reversed([q for q in run.steps if q.step < r.step]):
            if q.loss and not 1.0 / LOSS_JUMP < abs(q.loss / r.loss) < LOSS_JUMP:
                break  # q is the jump (or a non-finite loss): the regime began after it
            if q.modules or q.loss is None or not math.isfinite(q.loss) or not q.loss:
                step = r.step  # a sampled step saw its gradients, or nothing is known: no earlier onset
                break
            step = q.step
        else:
            step = r.step  # no jump: the onset is not known to be earlier
        return [Finding(
            "underflow", "error", "backward", c.module, None, step,
            f"Every gradient flowing into `{c.module or '(root)'}` ({c.type}) is exactly zero in fp16 although the "
            f"loss is {r.loss:.3g}: the loss{f' × the scale ({scale:g})' if scale != 1.0 else ''} spread over "
            f"{g.numel} output values is ~{per_element:.2g} each, below fp16's smallest subnormal (2^-24 ≈ 6e-8), "
            "so the backward flushed every gradient to zero and nothing trains.",
            "Keep the loss (and its weights) at a sensible magnitude — a weight like 1e-8 belongs in the learning "
            "rate, not the loss — compute it in fp32 and let GradScaler scale it up, or train in bf16.",
            dict({"loss": r.loss, "loss_scale": scale, "numel": g.numel, "per_element": per_element,
                  "zeros": c.gout.zeros if c.gout is not None else None, "rank_hint": 20},
                 **({"observed_step": r.step} if step != r.step else {})))]
    return []


_CONVERT = re.compile(r"value cannot be converted to type (\S+) without overflow", re.I)
_MASK_OPS = ("masked_fill", "fill_", "full", "where", "new_full", "full_like", "clamp", "add", "sub")


@register("exceptions", emits=("mask_value_overflow",))
def exceptions(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """A module's forward raised 'value cannot be converted to type at::Half without overflow'."""
    for r in run.steps:
        e = r.exception
        if not e or not _CONVERT.search(e.get("message", "")):
            continue
        src = linecache.getline(e["file"], e["line"]).strip() if e.get("file") and e.get("line") else ""
        op = next((f"aten::{o}" for o in _MASK_OPS if f"{o}(" in src), None)
        dt = _CONVERT.search(e["message"]).group(1)
        return [Finding(
            "mask_value_overflow", "error", "forward", e.get("module"), op, r.step,
            f"`{e.get('module')}` used a fill/mask constant that does not fit in {dt}: "
            f"\"{e['message']}\"" + (f" at {e['file']}:{e['line']}" if e.get("file") else ""),
            "Use a constant of the working dtype: `scores.masked_fill(mask, torch.finfo(scores.dtype).min)` "
            "(not -1e9 or finfo(float32).min), or apply the mask in fp32.",
            {"source": src, "file": e.get("file"), "line": e.get("line"), "exception": e.get("type"),
             "autocast": e.get("autocast"), "rank_hint": 5})]
    return []


_ACTIVATION = re.compile(r"LU|Act|Mish|Swish|Softmax|Sigmoid|Tanh|Softplus|Gate|Pool")
_ZERO_OK = ("ReLU", "Dropout", "Threshold", "Hardtanh", "Hardshrink", "Softshrink", "MaxPool", "Embedding",
            "Identity", "Sequential", "ModuleList")


# torch.nn's norms that subtract a mean (and nanoGPT's LayerNorm, which calls F.layer_norm): their statistics are
# accumulated in fp32, and in them a large offset cancels (x - mean) to zeros without any overflow. (An RMSNorm
# subtracts nothing: its exact zeros from nonzero rows are an overflow, and "RMSNorm" is also the name of the
# hand-written ones that square in fp16, LLaMA's and T5's without their upcast.)
_NATIVE_NORMS = frozenset({"LayerNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                           "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm"})


def _flushed(c, before: tuple[float, float] | None) -> str | None:
    """How a module with large nonzero inputs shows an fp16 intermediate that overflowed and was flushed
    (x * rsqrt(inf) = 0): "zeros" (a share of exact zeros its inputs did not have) or "bias" (a norm whose output
    fell far below its abs-max of earlier steps: every row flushed, only a trained bias left). `before` is a
    norm's (output abs-max, share of zeros) on an earlier step whose input could not overflow. None when it
    shows neither."""
    i, o = c.inp, c.out
    zin, zout = i.zeros / max(i.numel, 1), o.zeros / o.numel
    if zout >= 0.25:
        return "zeros"
    if "Norm" not in c.type or before is None or c.type in _NATIVE_NORMS:
        return None  # torch's own norm kernels accumulate in fp32: a large offset, not an overflow, shrinks them
    # Against the norm's own earlier steps: a few flushed rows (outlier tokens) are far below 25% of the output,
    # but zeros that were not there before are the overflow. (Zeros without that history can also be fp16
    # cancellation in x - mean, which is not an overflow.)
    if zout >= max(0.01, 2 * zin, 4 * before[1]):
        return "zeros"
    return "bias" if before[0] and o.absmax < before[0] / 16 else None


@register("silent_zeros", emits=("overflow",))
def silent_zeros(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """A norm that squares in fp16 overflows internally (x² > 65504 for |x| > 256) and returns zeros (or, with a
    trained bias, only the bias), not inf: inputs nonzero and large, outputs exact zeros or far below the norm's
    own output on earlier steps."""
    before: dict[str, tuple[float, float]] = {}  # a norm's output on an earlier step whose input could not overflow
    for r in run.steps:
        hits = []
        for c in r.modules:
            i, o = c.inp, c.out
            if i is None or o is None or o.ref != "float16" or not o.finite or o.numel < 8 or c.depth == 0:
                continue
            if i.absmax < 256.0 and ("Norm" in c.type or c.par is None) and o.absmax:
                before.setdefault(c.module, (o.absmax, o.zeros / o.numel))
            if any(k in c.type for k in _ZERO_OK) or i.absmax < 256.0 or i.zeros < 0:
                continue
            if _ACTIVATION.search(c.type) and "Norm" not in c.type:
                continue  # an activation (SiLU/GELU of large negatives is 0)
            # a parameter-free module of the user's own (`h / h.norm()`, a hand-written standardisation): only
            # against its own earlier steps, whose smaller inputs gave few zeros (a ReLU-like or masking module
            # has its zeros whatever the magnitude)
            free = "Norm" not in c.type and c.par is None
            if free and (c.module not in before or o.zeros / o.numel < max(0.5, 4 * before[c.module][1] + 0.1)):
                continue
            if i.zeros / max(i.numel, 1) <= 0.02 and _flushed(c, before.get(c.module)):
                hits.append(c)
        if hits:
            c = max(hits, key=lambda c: (c.depth, -c.seq))
            how = _flushed(c, before.get(c.module))
            shown = (f"returned {c.out.zeros / c.out.numel:.0%} exact zeros" if how == "zeros" else
                     f"returned values no larger than {c.out.absmax:.3g} (up to {before[c.module][0]:.3g} on earlier "
                     "steps: only its bias is left)")
            return [Finding(
                "overflow", "error", "forward", c.module, None, r.step,
                f"`{c.module}` ({c.type}) {shown} from nonzero inputs "
                f"up to {c.inp.absmax:.4g}: an intermediate overflowed in fp16 (e.g. x² > 65504 in a variance, "
                "then x * rsqrt(inf) = 0) and was silently flushed to zero.",
                "Compute the statistics in fp32 (`x.float().pow(2).mean(...)`, as HF's RMSNorm/T5LayerNorm do) or "
                "keep the norm in fp32:\n" + fp32_snippet(c.module, autocast_device(run)),
                {"absmax_in": c.inp.absmax, "zeros_out": c.out.zeros, "numel_out": c.out.numel,
                 "zeros_in": c.inp.zeros, "absmax_out": c.out.absmax, "flushed": how, "rank_hint": 15})]
    return []


@register("integer_precision", emits=("precision_loss",))
def integer_precision(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """precision_loss seen by the watch: a small fp16/bf16 input that holds only integers past the range where the
    dtype holds every integer (bf16: 256, fp16: 2048) — positions, timesteps or labels already rounded together
    (257 -> 256 in bf16). Named at the innermost module that received it (a parent passing it down is not)."""
    out: list[Finding] = []
    seen: set[str] = set()
    for r in run.steps:
        hits = [c for c in r.modules if c.int_input]
        if not hits:
            continue
        par = parents(r.modules)
        for c in hits:
            if c.module in seen or any(d.int_input for d in descendants(r.modules, c, par)):
                continue
            seen.add(c.module)
            info = c.int_input
            dt, mx, lim = info.get("dtype", "bfloat16"), float(info.get("max", 0)), float(info.get("exact_up_to", 256))
            spacing = 2.0 ** max(math.floor(math.log2(mx)) - math.log2(lim) + 1, 1) if mx > lim else 1.0
            if mx > lim:
                msg = (f"`{c.module or '(root)'}` ({c.type}) takes a {dt} input that holds only integers, up to "
                       f"{mx:g}: {dt} holds every integer only up to {lim:g}, so above it neighbouring values "
                       f"(positions, timesteps, labels) are already rounded together, {spacing:g} apart near the "
                       f"top (e.g. {lim + 1:g} becomes {lim:g}).")
            else:  # exact integers, but what is computed from them in this dtype is not
                frm = float(info.get("rounds_products_from", lim))
                grid = 2.0 ** (math.floor(math.log2(mx)) - 10)
                msg = (f"`{c.module or '(root)'}` ({c.type}) takes a {dt} input that holds only integers, up to "
                       f"{mx:g} (positions or timesteps): exact in {dt}, but anything computed from them in {dt} "
                       f"past {frm:g} lands on a grid {grid:g} apart — a sinusoidal embedding's phases t * freq "
                       f"are off by {grid / 2:g} rad or more, and its sin/cos with them.")
            fix = ("Keep positions and timesteps in fp32 (or int64) until the embedding has used them, and cast "
                   "the embedding's output, not its input, to the model's dtype:\n"
                   "emb = module(t.float()).to(x.dtype)  # not module(t.to(x.dtype))")
            out.append(Finding("precision_loss", "warning", "forward", c.module, None, r.step, msg, fix,
                               {"dtype": dt, "max_integer": mx, "exact_up_to": lim, "spacing_at_max": spacing,
                                "rank_hint": 45}))
    return out
