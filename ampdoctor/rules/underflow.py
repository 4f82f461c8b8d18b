"""Values too small for fp16: `underflow` (activations or gradients whose nonzero values mostly fall below the
smallest normal; for gradients, with a GradScaler pinned low or after a loss that fell 1000x) and
`vanished_gradient` (every gradient into the output flushed to zero). Values too large are rules/numeric.py's and
rules/origins.py's."""
from __future__ import annotations

import math
from collections import deque
from statistics import median_high

from ..findings import Finding
from ..records import LOSS_JUMP
from .registry import RuleConfig, RunData, register
from ..fixes import fp32_snippet
from .origins import autocast_device


# An output whose abs-max is at least this large (2^-14 * 2^11: fp16's smallest normal over its relative precision)
# holds its subnormal values more than 2^-11 below its largest: whatever mixes them with the large ones (a matmul,
# a sum, a norm) rounds them away in fp16 whether they are subnormal or not (a Gaussian kernel's far centres, the
# sigmoid probabilities of absent tags); a forward underflow that loses information has a small abs-max too.
_NEGLIGIBLE_BELOW = 2.0 ** -3


_CLEARED_POINTS = 3  # values of the module known after the flagged step, for it to have cleared


def _cleared(run: RunData, module: str, after: int) -> int | None:
    """The step from which `module`'s forward output stayed at an abs-max of _NEGLIGIBLE_BELOW or more (where this
    rule stops flagging it) to its last known value, read from the always-on headroom series and the later sampled
    steps (_CLEARED_POINTS values after `after` at least: the run went on); None when its last value is not clear,
    or too little is known. The series is spaced out on a short step (headroom="auto": one step in up to 32), so
    the last value alone says where the module ended. A layer whose outputs start subnormal at initialisation (a
    tiny model's sublayer under a norm's eps) and grow out of it within a few updates did not lose them for the
    run."""
    slot = run.slot_of(module)
    pts: dict[int, float] = {}
    for r in run.steps:
        if r.step <= after:
            continue
        c = next((c for c in r.modules if c.module == module and c.out is not None), None) if r.modules else None
        if c is not None:
            pts[r.step] = c.out.absmax
        elif slot is not None:
            fwd, _, dt = r.headroom_of(slot)
            if fwd is not None and dt == "h":
                pts[r.step] = fwd
    steps = sorted(pts)
    vals = [pts[k] for k in steps]
    if len(vals) < _CLEARED_POINTS or not (math.isfinite(vals[-1]) and vals[-1] >= _NEGLIGIBLE_BELOW):
        return None
    k = len(vals)
    while k > 0 and math.isfinite(vals[k - 1]) and vals[k - 1] >= _NEGLIGIBLE_BELOW:
        k -= 1
    return steps[k]


def _collapsed(run: RunData) -> bool:
    """A scale below 1 here is a collapse this run made (skipped steps backed it off there): the scaler rules
    (rules/scaler.py scale_timeline) report it, and the flushed gradients are its consequence. A scale below 1
    with no skip at all was given to the run (a GradScaler restored from a checkpoint of a collapsed run, an
    init_scale below 1): no scaler rule sees a backoff, and what it does to the gradients is this file's."""
    return run.has_scaler and any(r.skipped for r in run.steps)


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
    # (a scale set low after the first step, `scaler.update(new_scale=1.0)` each iteration, is pinned as well)
    pinned = bool(scales) and (max(scales) <= _PINNED_LOW or len(scales) >= 4 and max(scales[1:]) <= _PINNED_LOW)
    fallen = _fallen_onsets(run.steps) if run.has_scaler and not pinned else {}
    collapsed = _collapsed(run)
    for r in run.steps:
        if r.forward_bad or (collapsed and r.scale is not None and r.scale < 1.0):
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
                if phase == "forward" and _flushed_to_zero(r, c, s, cfg):
                    flagged.append((phase, c, s, s.zeros / s.numel, True))
                    continue
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
                    flagged.append((phase, c, s, share, False))
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
            _, c, s, share, zeroed = max(same, key=lambda f: f[1].depth)
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
            cleared = _cleared(run, c.module, r.step) if phase == "forward" else None
            if onset is not None:
                fix = (f"The loss fell {_LOSS_FALL:g}x or more in one step at step {onset} and the loss scale did not "
                       "follow (GradScaler doubles it only every `growth_interval` steps): keep the loss at its "
                       "usual magnitude (normalise loss weights to mean 1; put a tiny factor in the learning rate "
                       "instead), compute it in fp32, or train in bf16.")
            what = ("values below 2^-24 are flushed to zero and learning stalls" if phase == "backward"
                    else "they lose precision or vanish")
            half_in_bf16 = s.dtype == "float16" and (c.autocast or "").endswith("bfloat16")
            if half_in_bf16:
                # (PyTorch's autocast runs cuDNN RNNs in float16 whatever its dtype: a bf16 run's nn.LSTM/GRU is
                # fp16, with no GradScaler behind it)
                rnn = any(k in c.type for k in ("LSTM", "GRU", "RNN"))
                what += (f". `{c.module}` computes in float16 although autocast asks for bfloat16: "
                         + ("PyTorch's autocast runs cuDNN RNNs (nn.LSTM, nn.GRU, nn.RNN) in float16 whatever its "
                            "dtype" if rnn else "something in it casts to float16 (`.half()`, float16 weights)")
                         + (", and no GradScaler scales its gradients" if not run.has_scaler else ""))
                fix = ("Run it outside autocast in fp32 (bf16 elsewhere stays as it is), or scale the loss with a "
                       "GradScaler as for fp16 training:\n" + fp32_snippet(c.module, autocast_device(run)))
            if cleared is not None:
                what += f" (at step {r.step}; from step {cleared} on they are clear of it: transient)"
                fix = (f"Nothing to do: from step {cleared} on, the outputs of `{c.module}` are clear of fp16's "
                       "subnormal range (an abs-max of 2^-3 or more). Tiny values at initialisation that the first "
                       "updates grow out of lose nothing the run needed.")
            text = (f"{share:.0%} of the outputs of `{c.module}` are exactly zero (abs-max {s.absmax:.3g}) although "
                    f"its input is not (abs-max {c.inp.absmax:.3g}): something it computes in fp16 (a tiny weight or "
                    f"factor, a product of small values) falls below 2^-24 and is flushed to zero, so "
                    if zeroed else
                    f"{share:.0%} of the nonzero {'gradients flowing into' if phase == 'backward' else 'outputs of'} "
                    f"`{c.module}` are below fp16's normal range (2^-14); ")
            if zeroed and cleared is None:
                what = "what it adds to the model (a loss term, a branch) is gone"
            out.append(Finding(
                "underflow", "error" if phase == "backward" else "warning" if cleared is None else "info", phase,
                c.module, None,
                r.step if onset is None or any(q.modules for q in run.steps if onset <= q.step < r.step) else onset,
                f"{text}{what}.",
                fix, {"subnormal": s.subnormal, "nonzero": s.nonzero_finite, "zeros": s.zeros, "numel": s.numel,
                      "min_nonzero": s.min_nonzero, "absmax": s.absmax, "share": share,
                      "loss_scale": r.scale, "rank_hint": 20,
                      **({"loss_fell_at": onset, "observed_step": r.step} if onset is not None else {}),
                      **({"cleared_at": cleared} if cleared is not None else {})}))
    return out


_PASSES_ZEROS = ("Dropout", "Softmax", "Identity", "ReLU", "Threshold", "Hardtanh", "Hardshrink", "Softshrink",
                 "Tanhshrink", "Embedding", "Pad", "Upsample", "MaxPool", "AvgPool", "Flatten", "Unflatten")
"""Module types whose exact zeros are what they do (an activation's, a mask's, padding), not a flush."""


def _flushed_to_zero(r, c, s, cfg: RuleConfig) -> bool:
    """A module's fp16 output that is almost all exact zeros, with what is left below 2^-3 and mostly subnormal,
    from an input that is not tiny: it computed something below fp16's range in its own forward (an auxiliary loss
    weighted 1e-8, a LayerScale gain at 1e-9) and fp16 flushed it to zero. Not where one of its submodules already
    returned the same values (that one made them), nor an activation, mask or padding module, nor one holding
    weights that are all zero (initialised so: their output is zero in any dtype). An output of zeros only (none
    subnormal left) counts where a submodule's output was not tiny."""
    if s.dtype != "float16" or s.numel < cfg.underflow_min_nonzero or s.zeros < FLUSHED_SHARE * s.numel \
            or not 0 <= s.absmax < _NEGLIGIBLE_BELOW or s.subnormal < 0:
        return False
    nz = s.nonzero_finite
    if nz and s.subnormal < 0.5 * nz or any(k in c.type for k in _PASSES_ZEROS):
        return False
    if c.inp is None or not (_NEGLIGIBLE_BELOW <= c.inp.absmax < math.inf):
        return False
    row = s.to_dict()
    inner = c.module + "." if c.module else ""
    if any(0 in (p.weight_norm, p.weight_absmax) for p in r.params
           if p.module == c.module or p.module.startswith(inner)):
        return False  # zero-initialised weights (LoRA's B, adaLN-Zero, a ControlNet zero conv): zeros by design
    subs = [d for d in r.modules if d is not c and d.out is not None and d.module.startswith(inner)]
    if any(d.out.to_dict() == row for d in subs):
        return False
    # all exact zeros, none subnormal: only where a submodule's output was not tiny (the module's own code made
    # them small: a weight of 1e-8 times a Linear's output), not a module with nothing inside (an additive mask that
    # masks nothing in this batch is all zeros too)
    return bool(nz) or any(_NEGLIGIBLE_BELOW <= d.out.absmax < math.inf for d in subs)


FLUSHED_SHARE = 0.9


@register("vanished_gradient", emits=("underflow",))
def vanished_gradient(run: RunData, cfg: RuleConfig) -> list[Finding]:
    """Every fp16 gradient flowing into the model's output is exactly zero while the loss is finite and nonzero,
    and the scaled loss spread over the output's elements is below fp16's subnormal range (a loss weight of 1e-8,
    a sum divided by a huge count): the backward flushed them all to zero and nothing trains. `underflow` proper
    needs nonzero values to measure; here none are left. Named at the first module the backward reaches with an
    all-zero gradient (the one that made the output)."""
    collapsed = _collapsed(run)
    for r in run.steps:
        if not r.modules or r.loss is None or not math.isfinite(r.loss) or r.loss == 0 or r.forward_bad:
            continue
        if collapsed and r.scale is not None and r.scale < 1.0:
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
            (f"The loss scale is {scale:g}, below 1 from the run's first step (a GradScaler restored from the "
             "checkpoint of a run whose scale had collapsed, or an init_scale below 1) and never backed off here: "
             "start from a sane scale (a new `GradScaler()`, or `scaler.update(2.0 ** 16)` once after loading) and "
             "find what collapsed it in the earlier run." if scale < 1.0 else
             "Keep the loss (and its weights) at a sensible magnitude — a weight like 1e-8 belongs in the learning "
             "rate, not the loss — compute it in fp32 and let GradScaler scale it up, or train in bf16."),
            dict({"loss": r.loss, "loss_scale": scale, "numel": g.numel, "per_element": per_element,
                  "zeros": c.gout.zeros if c.gout is not None else None, "rank_hint": 20},
                 **({"observed_step": r.step} if step != r.step else {})))]
    return []
