"""Typed records: what a watch measures, keyed by module qualified name and optimizer step.

Records are small dataclasses of numbers and strings. They are what crosses from the hooks to the run
directory and from the run directory to the rules; nothing else does. Each has `to_dict`/`from_dict` so a
run directory round-trips exactly (see ampdoctor/rundir.py for the on-disk layout).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .recordcodec import _check_scalars, _fromd, _int_inputs, _short, plain
from .thresholds import (ACCUMULATING, BACKOFF_MAX_STREAK, COLLAPSE, DTYPE_LIMITS, LOSS_JUMP, ROUNDED_AWAY_SHARE,
                         ROUNDING_MIN_SAMPLED, SQUARE_OVERFLOW, STAT_FIELDS)

__all__ = ["TensorStats", "ModuleCall", "ParamStat", "CallEvent", "MISUSE_FLAGS", "Producer", "StepRecord", "RunMeta",
           "STAT_FIELDS", "DTYPE_LIMITS", "BACKOFF_MAX_STREAK", "LOSS_JUMP", "ACCUMULATING", "COLLAPSE",
           "SQUARE_OVERFLOW", "ROUNDED_AWAY_SHARE", "ROUNDING_MIN_SAMPLED", "plain"]


@dataclass
class TensorStats:
    """Statistics of one tensor (or of several tensors aggregated, e.g. all inputs of a call).

    Counts are relative to `ref` (the dtype the values live in or will be cast to: fp16 tensors, and fp32
    tensors inside an fp16 autocast region, use fp16 limits; bf16 its own). `absmax` and `min_nonzero` are over
    finite values only (0.0 / None when there are none). `overflow_as_ref` counts finite values that would
    become ±inf if cast to `ref` (non-zero only for a wider dtype measured against a narrower ref).
    """

    dtype: str
    ref: str
    numel: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    absmax: float = 0.0
    min_nonzero: float | None = None
    near_max: int = 0
    subnormal: int = 0
    overflow_as_ref: int = 0

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def finite(self) -> bool:
        return self.nonfinite == 0

    @property
    def nonzero_finite(self) -> int:
        return max(self.numel - self.nonfinite - self.zeros, 0)

    @property
    def headroom_bits(self) -> float | None:
        """log2(max of ref / absmax): how many doublings are left before overflow (None if all zero)."""
        import math
        if not self.absmax:
            return None
        return math.log2(DTYPE_LIMITS.get(self.ref, DTYPE_LIMITS["float32"])[0] / self.absmax)

    def to_dict(self) -> dict:
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TensorStats":
        return _fromd(cls, d)


@dataclass
class ModuleCall:
    """One call of one module in one step (a module called three times gets three records).

    `inp`/`out`: forward statistics of the tensor inputs/outputs. `gout`: gradient flowing into the module's
    outputs (from above); `gin`: gradient flowing out towards its inputs. Gradients are as autograd saw them,
    i.e. multiplied by the loss scale when a GradScaler is used; divide by the step's `scale` to unscale.
    `seq` orders calls within the step (forward order); `bseq` the order in which the backward reached it.
    """

    module: str
    type: str
    call: int
    seq: int
    depth: int
    autocast: str | None = None
    inp: TensorStats | None = None
    par: TensorStats | None = None
    out: TensorStats | None = None
    gout: TensorStats | None = None
    gin: TensorStats | None = None
    bseq: int | None = None
    grad_enabled: bool = True
    int_input: dict | None = None
    """A small fp16/bf16 input that held only integers past the range where the dtype holds every integer
    (`{"dtype", "max", "exact_up_to"}`): positions or timesteps already rounded together (rule precision_loss)."""

    def to_dict(self) -> dict:
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModuleCall":
        d = dict(d)
        for k in ("inp", "par", "out", "gout", "gin"):
            if d.get(k) is not None:
                d[k] = TensorStats.from_dict(d[k])
        return _fromd(cls, d)


@dataclass
class ParamStat:
    """One parameter at the optimizer step: gradient after unscale_, and what the update did."""

    name: str
    module: str
    dtype: str
    numel: int
    grad_norm: float | None = None
    grad_absmax: float | None = None
    grad_nonfinite: int = 0
    grad_zeros: int = 0
    weight_absmax: float | None = None
    weight_norm: float | None = None        # L2 norm of the weights right before this step's update (sampled)
    weight_norm_after: float | None = None  # ... and right after it: one update's factor (rule update_spike)
    lr: float | None = None                 # its parameter group's learning rate for that update (update_spike)
    update_sampled: int = 0
    update_rounded_away: int = 0
    sharded: bool = False  # a DTensor (FSDP2): the gradient values are this rank's shard's (merged by diagnose)
    state_dtype: str | None = None  # its optimizer state's dtype where narrower than the parameter's (fp16 moments
    #                                 over fp32 weights; sampled steps; rules/weights.py optimizer_eps)
    grad_hooked: bool = False  # the user's code hooks its gradient (`p.register_hook`, sampled steps): a hook runs
    #                            inside the backward, on the gradient still multiplied by the loss scale

    def to_dict(self) -> dict:
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ParamStat":
        v = d.get("state_dtype")
        if v is not None and not isinstance(v, str):
            raise ValueError(f"state_dtype must be a string, not {_short(v)}"[:120])
        return _fromd(cls, d)


MISUSE_FLAGS = frozenset({"stale_grads", "grads_after_unscale", "scaled_twice", "closure", "adopted"})
"""The `CallEvent.extra` keys the recorder sets on a call the rules judge (rules/callorder.py, rules/scaler.py);
`extra["backward"] is False` (a scaled loss never backpropagated) is one more."""


@dataclass
class CallEvent:
    """A call to the scaler, the optimizer or a clipping function, in program order.

    `kind`: scale, unscale_, step, update, optimizer.step, zero_grad, clip_grad_norm_, clip_grad_value_,
    get_total_norm, backward, engine.backward, engine.step (DeepSpeed). `stage`: the GradScaler per-optimizer stage before the call (READY, UNSCALED,
    STEPPED) when known. `error`: the exception message when the call raised (recorded before it propagates).
    The fields after `error` are set only by the calls they name. A run directory written before they were
    typed keeps them in a `detail` dict; `from_dict` reads that too.
    """

    kind: str
    step: int
    index: int
    file: str | None = None
    line: int | None = None
    stage: str | None = None
    scaled: bool | None = None
    error: str | None = None
    opt: int | None = None
    """unscale_, step: which optimizer (0, 1, ... in the order of their first scaler call on a shared scaler)."""
    internal: bool = False
    """Made by another watched call (the unscale_ that scaler.step() does itself), not by the user's code."""
    has_steps: bool | None = None
    """update: whether a scaler.step() came before it in the step."""
    new_scale: float | None = None
    """update: the `new_scale` passed as a number (None when none was passed, or a tensor)."""
    total_norm: float | None = None
    """clip_grad_norm_, get_total_norm, engine.step: the gradient norm the call returned (read with the step's
    one transfer)."""
    grads_scaled: bool = False
    """On the step's last event: the optimizer stepped on gradients still multiplied by the loss scale."""
    via_scaler: bool | None = None
    """optimizer.step: called by scaler.step() (True) or by the user's code (False)."""
    fused: bool | None = None
    """optimizer.step: a fused optimizer that unscales itself and runs even when the scaler skips."""
    extra: dict = field(default_factory=dict)
    """Free-form: what an integration records about its own engine's call, numbers, strings and booleans only
    (DeepSpeed's engine.backward/engine.step: boundary, micro_step, ds_scale, global_step, grads_measured,
    overflow, scale_after, skipped_steps; ampdoctor/integrations/deepspeed.py)."""

    def flagged(self) -> bool:
        """Whether the call carries something the call-order rules read beyond its kind (an error, scaled
        gradients, one of MISUSE_FLAGS): a routine step's repeated call sequence is kept for it (record/storage.py)."""
        x = self.extra
        return bool(self.error or self.scaled or self.grads_scaled or x and (
            x.get("backward") is False or not MISUSE_FLAGS.isdisjoint(x)))

    def reads_norm(self) -> bool:
        """A clipping call or a gradient-norm read (clip_grad_norm_, clip_grad_value_, get_total_norm)."""
        return self.kind.startswith(("clip_grad", "get_total_norm"))

    def to_dict(self) -> dict:
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CallEvent":
        d = dict(d)
        extra = dict(d.get("extra") or {})
        for k, v in (d.pop("detail", None) or {}).items():  # a run directory written before the typed fields
            if k in _EVENT_TYPED:
                d.setdefault(k, v)
            elif k != "norm_t":  # a device tensor that never reached the host
                extra.setdefault(k, v)
        d["extra"] = extra
        return _fromd(cls, d)


_EVENT_TYPED = ("opt", "internal", "has_steps", "new_scale", "total_norm", "grads_scaled", "via_scaler", "fused")


@dataclass
class Producer:
    """The innermost module (call) whose inputs were finite and whose output was not: inf/NaN's origin."""

    module: str
    call: int
    phase: str
    kind: str
    op: str | None = None
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Producer":
        return _fromd(cls, d)


@dataclass(slots=True)
class StepRecord:
    """Everything recorded for one optimizer step (0-based `step`).

    `sampled`: full per-module statistics were taken this step. `skipped`: the scaler found inf/NaN and the
    optimizer step was skipped. `scale`: the loss scale the backward used. `loss`: the last loss seen (the value
    passed to `scaler.scale` or `.backward()`, or the model's scalar/`.loss` output). `micro_batches`: forwards of
    the root module counted into this step (gradient accumulation). `discarded`: iterations the loop threw away
    before this step's optimizer step, their inf/NaN gradients zeroed without one (a loop that keeps its own loss
    scale; or, with a GradScaler, a guard that zeroes them before unscale_/step; steps are numbered by optimizer step:
    these iterations have no number of their own). `output_finite`: the
    model's outputs held no inf/NaN — an output holding -inf only (a mask of illegal actions or tokens) while the
    loss stayed finite counts as finite.
    """

    step: int
    sampled: bool = False
    loss: float | None = None
    loss_finite: bool | None = None
    scale: float | None = None
    next_scale: float | None = None
    found_inf: bool | None = None
    skipped: bool = False
    grad_finite: bool | None = None
    output_finite: bool | None = None
    grad_norm: float | None = None
    micro_batches: int = 0
    discarded: int = 0
    autocast: str | None = None
    forward_producer: Producer | None = None
    backward_producer: Producer | None = None
    modules: list[ModuleCall] = field(default_factory=list)
    params: list[ParamStat] = field(default_factory=list)
    events: list[CallEvent] = field(default_factory=list)
    exception: dict | None = None
    capture: str | None = None
    internal_error: dict | None = None  # ampdoctor itself failed here and stopped watching (type, message)
    loss_ops: list | None = None
    """On a step whose loss went non-finite: the autograd ops between the loss and the model's outputs (the loss
    computation outside the model), by name without the trailing number (e.g. "MulBackward", "ExpBackward")."""
    loss_low: bool | None = None
    """With `loss_ops`: whether one of those ops made an fp16/bf16 value (False: the loss was computed in fp32 or
    wider from the model's outputs; None: not known)."""
    loss_consts: bool | None = None
    """With `loss_ops`: whether one of those ops (a product, a quotient, a sum) took a tensor that needs no gradient
    (an advantage, a target, a weight computed from the data): a value whose own making the graph does not show."""
    loss_in_model: bool | None = None
    """The loss given to `scaler.scale` was computed inside the watched model's forward (a Hugging Face model's
    `.loss`): the loss computation's backward is the root module's own. None: not known (no scaler, older runs)."""
    bad_input: dict | None = None
    """On a step whose forward went non-finite: the first floating-point input of the model that already held
    inf/NaN when the forward began (`{"arg": 0 | "name", "nan": n, "posinf": n, "neginf": n, "numel": n,
    "dtype": ...}`): the data, not a module, brought it."""
    bad_weights: dict | None = None
    """On a routine step whose forward went non-finite: the modules whose own weights were already non-finite then
    (`{"module": "nan" | "inf"}`; a sampled step says it per module call, `ModuleCall.par`)."""
    bad_buffer: dict | None = None
    """A buffer the training writes (a running statistic, an EMA) that was finite until this step and is not now:
    `{"module", "buffer", "kind": "inf" | "nan"}` (ampdoctor/record/buffers.py), read every step."""
    outside_updates: dict | None = None
    """Frozen fp16/bf16 parameters (no gradient) that the user's code wrote in place since the last sampled step (an
    EMA teacher, a momentum encoder): `{name: [unchanged, sampled]}` over their first elements."""
    masters_back: dict | None = None
    """With an optimizer stepping copies of an fp16/bf16 model's weights (a hand-rolled master-weight loop), on the
    forwards after a sampled step: `{"since": step, "moved": n, "stuck": k}`: of the sampled master elements whose value
    in the weight's dtype moved since that step's forward, `k` whose model element did not (ampdoctor/record/copies.py
    masters_compare). All stuck: the updated masters never reach the model."""
    int_inputs: list | None = None
    """On a routine step: the watched modules' small fp16/bf16 inputs that held only integers past the dtype's exact
    range (`[{"module", "type", "dtype", "max", "exact_up_to", ...}]`, ampdoctor/record/intwatch.py; a sampled step
    says it per module call, `ModuleCall.int_input`)."""
    headroom: dict | None = None
    """Every step, every module (ampdoctor/record/series.py `encode`): `{"fwd": [...], "bwd": [...], "dtype": "hhf-"}`,
    lists aligned with `RunMeta.modules`: the forward output's abs-max and the abs-max of the gradient into it
    (scaled, as autograd saw it), 3 significant digits, Infinity/NaN when not finite, null when not measured;
    `dtype` one character per module (h float16, b bfloat16, f float32, d float64, - none); `first_bad` (a routine
    step's, only when set): the slot of the module whose output was the first of the forward to hold inf/NaN."""

    def headroom_of(self, slot: int) -> tuple[float | None, float | None, str]:
        """(forward abs-max, backward abs-max, dtype code) of the module at `slot` in RunMeta.modules."""
        h = self.headroom
        if not h or slot >= len(h.get("fwd") or ()):
            return None, None, "-"
        dt = h.get("dtype") or ""
        return h["fwd"][slot], (h.get("bwd") or [None] * (slot + 1))[slot], dt[slot] if slot < len(dt) else "-"

    @property
    def forward_bad(self) -> bool:
        """The forward pass went non-finite where it matters: the loss or the outputs, a crash, or an inf/NaN
        producer — except one that emitted only -inf (an additive mask) while the loss and outputs stayed finite."""
        if self.loss_finite is False or self.output_finite is False or self.exception:
            return True
        p = self.forward_producer
        return p is not None and not p.detail.get("mask_like")

    @property
    def backward_bad(self) -> bool:
        """The backward or the update went non-finite: the scaler skipped the step, the gradients were
        non-finite, or a module's backward produced inf/NaN."""
        return bool(self.skipped or self.grad_finite is False or self.backward_producer is not None)

    @property
    def bad(self) -> bool:
        """Something went non-finite where it matters (`forward_bad` or `backward_bad`); an additive -inf mask
        alone is not. Whether it was GradScaler's benign backoff is ampdoctor/rules/backoff.py's question."""
        return self.forward_bad or self.backward_bad

    def to_dict(self) -> dict:
        """As `dataclasses.asdict` (equal, and sharing nothing mutable with the record), ~10x faster (`plain`):
        every step is written to the run dir and the spill file."""
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepRecord":
        d = dict(d)
        _check_scalars(d)
        for k in ("forward_producer", "backward_producer"):
            if d.get(k) is not None:
                d[k] = Producer.from_dict(d[k])
        d["modules"] = [ModuleCall.from_dict(m) for m in d.get("modules") or []]
        d["params"] = [ParamStat.from_dict(p) for p in d.get("params") or []]
        d["events"] = [CallEvent.from_dict(e) for e in d.get("events") or []]
        if d.get("int_inputs") is not None:
            d["int_inputs"] = _int_inputs(d["int_inputs"])
        return _fromd(cls, d)


@dataclass
class RunMeta:
    """Once per run: the model's module tree, the optimizer's parameter dtypes, the scaler, the environment."""

    format_version: int = 1
    ampdoctor_version: str = ""
    torch_version: str = ""
    model_class: str = ""
    modules: list[list[Any]] = field(default_factory=list)   # [qualified name, class name, depth]
    params: list[list[Any]] = field(default_factory=list)    # [name, module, dtype, numel, in_optimizer,
    #                                                          requires_grad at watch start (absent: older runs)]
    optimizer: dict = field(default_factory=dict)             # class, param dtypes, fp16/bf16 param names
    scaler: dict = field(default_factory=dict)                # class, init_scale, growth/backoff, enabled
    env: dict = field(default_factory=dict)                   # see ampdoctor/env.py
    every: int = 0
    rank: int | None = None
    world_size: int | None = None
    process: dict = field(default_factory=dict)
    """The writing process: {"pid", "host", "start"} (start: the kernel's start time of the process where known, so
    that a reused pid is not taken for it). Absent in runs written before it existed."""
    closed: bool | None = None
    """Not stored: set by rundir.read_run — True when the run's end line is there (the watch was closed, by
    close() or at interpreter exit), False when it is missing, None for a run written before end lines existed."""

    def to_dict(self) -> dict:
        d = plain(self)
        d.pop("closed", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunMeta":
        return _fromd(cls, d)
