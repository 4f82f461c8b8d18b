"""Numeric rules from module-level records that are not about where an inf/NaN came from (see origins.py):
overflow_risk, silent zeros from an fp16 norm (overflow), integers past a dtype's exact range (precision_loss) and
the mask-constant crash (mask_value_overflow) seen as an exception inside a module's forward. Values too small for
their dtype are rules/underflow.py's."""
from __future__ import annotations

import linecache
import math
import re

from ..findings import Finding
from ..records import COLLAPSE, DTYPE_LIMITS, SQUARE_OVERFLOW
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
            if o.absmax == DTYPE_LIMITS.get(o.ref, DTYPE_LIMITS["float32"])[0]:
                continue  # exactly the dtype's max: a constant written there (finfo(float16).min as a mask, a
                #           clamp to it), not a computed value coming close
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
    return "bias" if before[0] and o.absmax < before[0] / COLLAPSE else None


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
            if i.absmax < SQUARE_OVERFLOW and ("Norm" in c.type or c.par is None) and o.absmax:
                before.setdefault(c.module, (o.absmax, o.zeros / o.numel))
            if any(k in c.type for k in _ZERO_OK) or i.absmax < SQUARE_OVERFLOW or i.zeros < 0:
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
            prev = before.get(c.module)
            how = _flushed(c, prev)
            onset = r.step
            if how == "bias" and prev:  # collapsed below a sixteenth of what it was
                onset = _series_onset(run, c.module, r.step, lambda v: v <= prev[0] / COLLAPSE)
            feeder = _feeder(r, c)  # (a norm whose output is fp32, not in the series: dated by its input's range)
            if onset == r.step and feeder is not None:
                onset = _series_onset(run, feeder, r.step, lambda v: v >= SQUARE_OVERFLOW)
            shown = (f"returned {c.out.zeros / c.out.numel:.0%} exact zeros" if how == "zeros" else
                     f"returned values no larger than {c.out.absmax:.3g} (up to {before[c.module][0]:.3g} on earlier "
                     "steps: only its bias is left)")
            ev = {"absmax_in": c.inp.absmax, "zeros_out": c.out.zeros, "numel_out": c.out.numel,
                  "zeros_in": c.inp.zeros, "absmax_out": c.out.absmax, "flushed": how, "rank_hint": 15}
            since = ""
            if onset < r.step:
                ev["observed_step"] = r.step
                since = f" (seen on sampled step {r.step}; the always-on series shows its output collapsed from here)"
            return [Finding(
                "overflow", "error", "forward", c.module, None, onset,
                f"`{c.module}` ({c.type}) {shown} from nonzero inputs "
                f"up to {c.inp.absmax:.4g} at step {onset}{since}: an intermediate overflowed in fp16 (e.g. x² > "
                "65504 in a variance, then x * rsqrt(inf) = 0) and was silently flushed to zero.",
                "Compute the statistics in fp32 (`x.float().pow(2).mean(...)`, as HF's RMSNorm/T5LayerNorm do) or "
                "keep the norm in fp32:\n" + fp32_snippet(c.module, autocast_device(run)), ev)]
    return []


def _feeder(r, c):
    """The module whose output was call `c`'s input on step `r` (same size and abs-max, called before it): the
    innermost, latest such call; None when none matches."""
    i = c.inp
    cands = [d for d in r.modules if d.seq < c.seq and d.out is not None and d.out.numel == i.numel
             and d.out.absmax == i.absmax and d.module != c.module and not c.module.startswith(d.module + ".")
             and d.module != ""]
    return max(cands, key=lambda d: (d.seq, d.depth)).module if cands else None


def _series_onset(run: RunData, module: str, step: int, holds) -> int:
    """The first step of the run of steps just before `step` whose always-on series (StepRecord.headroom) shows
    `module`'s forward abs-max where `holds(value)` (as on `step`: collapsed, or in the overflow range); steps that
    did not record it are passed over. `step` itself when the step before it did not hold, when none recorded it,
    or when it held on every recorded point (no change to date)."""
    slot = run.slot_of(module)
    if slot is None:
        return step
    onset = step
    for r in reversed(run.steps):
        if r.step >= step:
            continue
        v = r.headroom_of(slot)[0]
        if v is None:
            continue
        if not (isinstance(v, (int, float)) and 0 <= v < math.inf and holds(v)):
            return onset  # the change: it did not hold here, and did from the next recorded point on
        onset = r.step
    return step  # it held on every recorded point: no change seen, nothing to date it by


@register("integer_precision", emits=("precision_loss",))
def integer_precision(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """precision_loss seen by the watch: a small fp16/bf16 input that holds only integers past the range where the
    dtype holds every integer (bf16: 256, fp16: 2048) — positions, timesteps or labels already rounded together
    (257 -> 256 in bf16). Named at the innermost module that received it (a parent passing it down is not). A
    sampled step says it per module call; a routine step for the modules whose inputs a sampled step found to be
    integers (StepRecord.int_inputs: record/intwatch.py watches the innermost only)."""
    out: list[Finding] = []
    seen: set[str] = set()
    for r in run.steps:
        hits = [c for c in r.modules if c.int_input]
        par = parents(r.modules) if hits else {}
        found = [(c.module, c.type, c.int_input) for c in hits
                 if not any(d.int_input for d in descendants(r.modules, c, par))]
        found += [(x["module"], x.get("type", "?"), x) for x in r.int_inputs or ()]
        for module, typ, info in found:
            if module in seen:
                continue
            dt, mx, lim = info.get("dtype", "bfloat16"), float(info.get("max", 0)), float(info.get("exact_up_to", 256))
            if not (mx > 0 and lim > 0):
                continue  # (a record from disk that says nothing usable)
            seen.add(module)
            spacing = 2.0 ** max(math.floor(math.log2(mx)) - math.log2(lim) + 1, 1) if mx > lim else 1.0
            held = info.get("held_as") if isinstance(info.get("held_as"), str) else None
            via = info.get("via") if isinstance(info.get("via"), str) else None
            # (an fp32 input that the module casts to the low dtype itself: a Linear under autocast)
            takes = (f"takes a {held} input that holds only integers and computes with it in {dt} (autocast casts "
                     f"it there), up to" if held else f"takes a {dt} input that holds only integers, up to")
            if via:  # made or cast inside the forward (record/lowcast.py): no module's input
                takes = (f"makes integers in {dt} itself (`torch.{via}(..., dtype={dt})`), up to" if not held else
                         f"runs `{via}` in {dt} under autocast on a float32 tensor that holds only integers, up to"
                         if held == "float32" and via not in ("to", "type", "type_as", "half", "bfloat16") else
                         f"casts a {held} tensor that holds only integers to {dt} inside its forward (`{via}`), up to")
            if mx > lim:
                msg = (f"`{module or '(root)'}` ({typ}) {takes} "
                       f"{mx:g}: {dt} holds every integer only up to {lim:g}, so above it neighbouring values "
                       f"(positions, timesteps, labels) are {'rounded' if held else 'already rounded'} together, "
                       f"{spacing:g} apart near the top (e.g. {lim + 1:g} becomes {lim:g}).")
            else:  # exact integers, but what is computed from them in this dtype is not
                frm = float(info.get("rounds_products_from", lim))
                grid = 2.0 ** (math.floor(math.log2(mx)) - 10)
                msg = (f"`{module or '(root)'}` ({typ}) {takes} "
                       f"{mx:g} (positions or timesteps): exact in {dt}, but anything computed from them in {dt} "
                       f"past {frm:g} lands on a grid {grid:g} apart — a sinusoidal embedding's phases t * freq "
                       f"are off by {grid / 2:g} rad or more, and its sin/cos with them, if the module computes them "
                       f"in {dt} (not after `.float()`, and not if it only casts the values to an integer type).")
            fix = ("Make the positions or timesteps in fp32 (or int64), compute from them in fp32 with autocast "
                   "off, and cast only the result to the model's dtype (as transformers' rotary embeddings do now):\n"
                   "t = torch.arange(T, device=x.device, dtype=torch.float32)  # not dtype=self.inv_freq.dtype\n"
                   "with torch.autocast(x.device.type, enabled=False):\n"
                   "    freqs = torch.outer(t, self.inv_freq.float())\n"
                   "cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)") if via else (
                "Keep positions and timesteps in fp32 (or int64) until the embedding has used them, and cast "
                "the embedding's output, not its input, to the model's dtype:\n"
                "emb = module(t.float()).to(x.dtype)  # not module(t.to(x.dtype))") if not held else (
                "Autocast casts this module's input to the low dtype, which keeps the same few significant bits at "
                "any scale (t / 1000 collides just as t does): keep the module in fp32:\n"
                + fp32_snippet(module, autocast_device(run)))
            # (exact integers are lost only where the module multiplies them by a fraction in that dtype, which the
            # watch cannot see: ids it only casts to long lose nothing; a risk, not a finding of harm)
            out.append(Finding("precision_loss", "warning" if mx > lim else "info", "forward", module, None, r.step,
                               msg, fix,
                               {"dtype": dt, "max_integer": mx, "exact_up_to": lim, "spacing_at_max": spacing,
                                **({"via": via} if via else {}), "rank_hint": 45}))
    return out
