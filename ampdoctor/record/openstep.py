"""The data of one open step: its phase, each module call's queued statistic rows, and everything else the hooks
and the monitor gather until the step's one transfer to the host (ampdoctor/record/transfer.py).

A step goes through the phases of `StepPhase`, in order, and only `_Step.advance` moves it on (GradScaler keeps
an optimizer's stage the same way, `OptState`): one owner, one place, and a transition out of order is an
internal error (the StepMachine switches itself off; the user's training goes on).
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

from . import cpustats
from . import fused
from .stats import (EXACT_INTEGERS, PROBE_MAX_NUMEL, cast_in, compiled, full_stats, integer_probe, light_stats,
                    probe_name, ref_dtype, thresholds)
from ..tensors import autocast_dtype, dt_name

__all__ = ["StepPhase", "StepPhaseError", "_Call", "_Step"]


class StepPhase(enum.Enum):
    """Where the open step is. Only `_Step.advance` changes it, along `_NEXT`."""

    OPEN = "open"
    """The forwards, backwards and the scaler's calls append device values and call events."""
    STAGED = "staged"
    """`transfer.presync` queued the step's values for its one transfer (just before the optimizer step, or at
    finalize when none came); values appended later are not read, except `transfer.found_inf_all`'s."""
    ENDED = "ended"
    """The optimizer stepped, or the scaler skipped the step. The record waits for the next iteration to begin
    (root forward, zero_grad, scaler.scale), so that `scaler.update()` and late calls land in this step."""
    FINAL = "final"
    """`assemble.finalize` made the StepRecord; the step is replaced by the next one."""


_NEXT = {
    StepPhase.OPEN: frozenset({StepPhase.STAGED}),
    StepPhase.STAGED: frozenset({StepPhase.ENDED, StepPhase.FINAL}),  # FINAL: no optimizer step came (eval tail)
    StepPhase.ENDED: frozenset({StepPhase.ENDED, StepPhase.FINAL}),   # ENDED again: a second optimizer's step
    StepPhase.FINAL: frozenset(),
}


_NEXT_BY_ID = {id(k): tuple(v) for k, v in _NEXT.items()}  # the same, looked up without hashing an enum (Python)


class StepPhaseError(RuntimeError):
    """A step was moved out of order: a bug in ampdoctor, never in the user's code."""


@dataclass(slots=True)
class _Call:
    module: str
    type: str
    call: int
    seq: int
    depth: int
    parent: int | None
    autocast: str | None
    grad_enabled: bool
    rows: dict = field(default_factory=lambda: {"inp": [], "par": [], "out": [], "gout": [], "gin": []})
    bseq: int | None = None
    grad_inputs: list | None = None  # inputs that require grad, from forward_pre until forward_post
    seq0: int = 0                    # the autograd sequence number when the forward began
    probes: list = field(default_factory=list)  # (index into _Step.probes, dtype name) of small fp16/bf16 inputs


@dataclass(slots=True)
class _Step:
    step: int
    sampled: bool
    calls: list = field(default_factory=list)
    vecs: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    stack: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    loss_mark: int = 0  # losses[loss_mark:] were scaled since the last scaler.step or update (monitorsink.after)
    events: list = field(default_factory=list)
    norms: list = field(default_factory=list)  # (CallEvent, 0-d device tensor): a gradient norm a call returned,
    #                                            kept out of the event until the transfer fills its total_norm
    full_clip: object = None  # without a scaler: the clip event whose parameters held all of the model's
    full_norms: list = field(default_factory=list)  # indexes into norms of such clips' total norms (presync)
    grad_by_norm: bool = False  # the routine gradient check reads those norms first (readback.resolve)
    scale_t: object = None
    found_inf_t: object = None
    grad_parts: object = None  # (names, abs-max, L2) of the gradients right after unscale_ (params.grads_after_unscale)
    param_names: list = field(default_factory=list)
    opt_nest: dict = field(default_factory=dict)  # id(optimizer) -> depth of its step() calls now running
    bwd_grads: list = field(default_factory=list)  # (names, abs-max, L2 or None) read as each optimizer step
    #                                                fused into the backward began (optsink.step_in_backward)
    bwd_task: int | None = None  # the backward (graph task id) whose end is awaited (autograd's final callback)
    upd: list = field(default_factory=list)  # params.UpdateCheck per optimizer stepped (update_check_pre / _post)
    batches: list = field(default_factory=list)     # (args, kwargs, rng) of the last micro-batches
    entry_of: dict = field(default_factory=dict)     # id(batch) -> the entry module it went into (not the root)
    tops: list = field(default_factory=list)        # sampled: modules other than the root called at top level
    in_versions: list | None = None                   # (tensor, _version) of the root's inputs (input_writes)
    bad_batch: int = -1                                # index into batches of the first non-finite output
    zeroed: list = field(default_factory=list)  # (zero_grad event, optimizer, its gradients then): optsink.zero_grad_done
    acc_grads: list = field(default_factory=list)      # (micro, abs-max of the gradients accumulated before it)
    pw_index: list = field(default_factory=list)       # params whose weights were checked at presync
    step_dtypes: dict | None = None  # sampled: each parameter's dtype as the optimizer step found it (presync)
    w_start: object = None                             # their abs-max when the step's forward began (sampled)
    bad_buffer: dict | None = None                     # a written buffer that turned non-finite (buffers.py)
    outside: tuple | None = None                       # frozen fp16 weights written since the last sampled step
    masters: tuple | None = None                       # (snapshot step, [stuck, moved]): copies.masters_compare
    w_deferred: bool = False                           # CPU: weights checked in resolve, on bad steps only
    out_ok: list = field(default_factory=list)
    output_finite: bool | None = None
    autocast: str | None = None
    micro: int = 0
    forwards: int = 0  # top-level forwards that returned (grad or no grad: a frozen teacher's: optsink._foreign_step)
    exception: dict | None = None
    synced: dict | None = None  # the step's values read back on the host (readback.resolve)
    bseq: int = 0
    in_scaler_step: int = 0     # nesting depth of scaler.step() calls (its own unscale_ and optimizer.step inside)
    scaled_since_update: bool = False  # scaler.scale() ran and scaler.update() not yet: the gradients are scaled
    unscaled_opts: list = field(default_factory=list)  # the optimizers scaler.unscale_ ran for (clip_before)
    grad_outs: dict = field(default_factory=dict)  # id(batch entry) -> gradients into the root's outputs
    unscaled_grads: dict | None = None  # their gradients' versions when a scaled loss came after (monitorsink)
    clip_pending: list = field(default_factory=list)  # (clip event, ids of its gradients still scaled)
    capture: str | None = None
    loss_ops: list | None = None                       # see StepRecord.loss_ops
    loss_low: bool | None = None                       # see StepRecord.loss_low
    loss_consts: bool | None = None                    # see StepRecord.loss_consts
    loss_node: object = None                           # the scaled loss's autograd node (loss_ops, bad steps only)
    out_seq: int | None = None                         # autograd's next node number when the root's forward returned
    vec_order: dict = field(default_factory=dict)
    staged: tuple | None = None  # (rows then, {device: (indices, matrix)}): transfer.stage_rows, read at presync
    seen: dict = field(default_factory=dict)
    pending: object = None  # hostcopy.Pending: the values on their way to the host, until resolve reads them
    half: tuple | None = None  # (len(losses), len(out_ok)) at the last transfer (transfer.presync / presync_more)
    more: list = field(default_factory=list)  # Pendings of what a step that went on added (transfer.presync_more)
    fbuf: dict = field(default_factory=dict)
    fused_amp: bool = False
    early: bool = False  # staged as scaler.step began, before GradScaler's synchronisation (monitorsink._stage_early)
    headroom: dict | None = None  # the always-on series read back at resolve (ampdoctor/record/headroom.py)
    plan: object = None  # fused.DeferPlan of the watch: which values the fused statistics may read late
    regions: object = None  # gradexits.Regions of this step's walked module calls (released at presync)
    late: object = None  # values queued after presync (transfer.found_inf_all), read at finalize
    probes: list = field(default_factory=list)  # stats.integer_probe vectors of small low-precision inputs
    probe_seen: dict = field(default_factory=dict)
    int_calls: list = field(default_factory=list)  # a routine step's watched integer inputs (intwatch.py)
    bad_input: dict | None = None  # a bad step's non-finite model input (readback.resolve)
    loss_in_model: bool | None = None  # the scaled loss's node was made before the root's forward returned
    scaled_outs: list = field(default_factory=list)  # (scale CallEvent, [backward ran through it], id of the loss's
    #                                                  node, micro-batch) per scale() (assemble.unpropagated)
    micro_stepped: int | None = None  # `micro` at the step's first unscale_/step
    scaled_micros: set = field(default_factory=set)  # the micro-batches whose output a scale() took (readback.resolve)
    discarded: int = 0  # iterations the loop threw away in this step (optsink.discards_iteration)
    discard_micro: int = -1  # `micro` when a GradScaler loop's last such iteration was looked at (one per forward)
    scale_reads: int = 0  # scaler.get_scale() calls so far (monitorsink.scale_read)
    scaled_node: object = None  # the last scale()'s output node: a scale() of it scales the loss twice (monitorsink)
    folds: bool = False  # the rest of a step that a mid-run report finished (StepMachine.finish_open_step): its
    #                      record is folded into that step's (storage.folded)
    _phase: StepPhase = field(default=StepPhase.OPEN, init=False, repr=False)

    @property
    def phase(self) -> StepPhase:
        return self._phase

    def advance(self, to: StepPhase) -> None:
        """Move the step on to phase `to`; the only place the phase changes."""
        if to not in _NEXT_BY_ID[id(self._phase)]:
            raise StepPhaseError(f"step {self.step} cannot go from {self._phase.name} to {to.name} "
                                 f"(allowed: {', '.join(p.name for p in _NEXT[self._phase]) or 'none'})")
        self._phase = to

    @property
    def ended(self) -> bool:
        """The optimizer stepped (or the scaler skipped it) and the record waits for the next iteration."""
        return self._phase is StepPhase.ENDED

    def probe_integers(self, c: _Call, t: torch.Tensor) -> None:
        """Queue `stats.integer_probe` of a small vector-shaped fp16/bf16 input of call `c` (once per tensor per
        step, on the device of the step's first probe): positions or timesteps held in a dtype too narrow. An fp32
        one too when the module computes with it in fp16/bf16 (a Linear under autocast: stats.cast_in)."""
        if not 0 < t.numel() <= PROBE_MAX_NUMEL:
            return
        name = None
        if t.dtype not in EXACT_INTEGERS:
            low = cast_in(c.type, t.device.type) if t.dtype is torch.float32 else None
            if low is None:
                return
            name = f"float32>{dt_name(low)}"
        self._probe(c, t, name or dt_name(t.dtype))

    def probe_cast(self, c: _Call, t: torch.Tensor, low: torch.dtype, via: str) -> None:
        """Queue `stats.integer_probe` of tensor `t`, which op `via` made in, or casts to, the low dtype `low` inside
        call `c`'s forward (record/lowcast.py)."""
        if 0 < t.numel() <= PROBE_MAX_NUMEL:
            self._probe(c, t, probe_name(t.dtype, low, via))

    def _probe(self, c: _Call, t: torch.Tensor, name: str) -> None:
        rows = sum(1 for d in t.shape if d > 1) > 1
        if rows and (t.dim() != 2 or t.shape[1] < MIN_ROW):
            return  # positions and timesteps are vectors ((B,), (T,), (1, T)) or rows of positions (B, T: see
            #         _rising_row); activations are not: every bf16 value past 128 is an integer, so a large
            #         activation would look like one; nor a few features a sample (raw counts, (B, 4)), whose
            #         short rows rise by chance
        if self.probes and t.device != self.probes[0].device:
            return
        key = _memory_key(t)
        if key is None:
            return
        hit = _recall(self.probe_seen, key)
        if hit is not None:  # the same tensor this step
            idx = hit[1]
        else:
            idx = len(self.probes)
            self.probes.append(integer_probe(_rising_row(t) if rows else t))
            _remember(self.probe_seen, key, t, idx)
        c.probes.append((idx, name))

    def measure(self, c: _Call, slot: str, t: torch.Tensor, light: bool, ref=None, compile_stats=False) -> None:
        """Queue the statistics of tensor `t` as a row of call `c`'s `slot` (inp, out, gout, gin)."""
        if ref is None:
            ref = ref_dtype(t.dtype, autocast_dtype(t.device.type))
        # A tensor measured once this step (a module's output is the next one's input; a gradient flows
        # into one module and out of another) is not measured again.
        # Keyed by memory, not identity: a view of the same memory (e.g. the gradient flowing out of one module
        # and into the next) has the same values. The first tensor measured there must still be alive (so the
        # memory was not reused) and the shared version counter unchanged (no in-place write since).
        key = _memory_key(t, ref)
        hit = _recall(self.seen, key)
        if hit is not None and (light or hit[2]):
            c.rows[slot].append((hit[1], dt_name(t.dtype), dt_name(ref)))
            return
        idx = len(self.vecs)
        if t.is_cuda and fused.available(t):  # Triton kernels, into the step's buffer (fused.StatBuffer)
            buf = self.fbuf.get(t.device)
            if buf is None:
                buf = self.fbuf[t.device] = fused.StatBuffer(t.device, plan=self.plan)
            rows = c.rows[slot]
            v = ("fused", t.device, buf.add(t, thresholds(t.dtype, ref), (c.module, c.call, slot, len(rows)),
                                            forward=c.grad_enabled and slot in _FORWARD))
            light = False
        elif t.device.type == "cpu" and cpustats.supports(t):  # one C pass (ampdoctor/record/cpustats.py)
            buf = self.fbuf.get(t.device)
            if buf is None:
                buf = self.fbuf[t.device] = cpustats.RowBuffer()
            v = ("fused", t.device, buf.add(t, ref))  # (its row of the step's CPU matrix, taken as fused rows are)
            light = False
        elif compile_stats and t.device.type == "cpu":
            v = compiled("light" if light else "full")(t, ref)
        else:
            v = light_stats(t, ref) if light else full_stats(t, ref)
        c.rows[slot].append((idx, dt_name(t.dtype), dt_name(ref)))
        self.vecs.append(v)
        _remember(self.seen, key, t, idx, not light)


_FORWARD = ("inp", "out")  # the slots a forward fills (the fused statistics may hold its values longer)


def _rising_row(t: torch.Tensor) -> torch.Tensor:
    """Of a 2-D tensor, its row with the largest value if that row rises (non-decreasing in RISING of its steps, as
    position ids do, with a reset where a packed document begins or padding starts), else zeros, which the probe
    reads as nothing to report. A (B, C) activation or a count matrix does not rise along its columns. On the
    device: no synchronisation."""
    d = t.detach()
    r = d.index_select(0, d.float().amax(-1).argmax().reshape(1))[0]
    up = (r[1:] >= r[:-1]).float().mean() >= RISING
    return torch.where(up, r, torch.zeros_like(r))


RISING = 0.9
MIN_ROW = 16  # values a row of positions holds at least (a sequence); shorter rows are feature vectors


def _memory_key(t: torch.Tensor, *extra):
    """A tensor keyed by its memory (see `_Step.measure`): where it starts, its shape, strides, dtype and the
    version counter its views share. None for tensors without a version counter (inference) or storage."""
    try:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version, *extra)
    except RuntimeError:
        return None


def _recall(memo: dict, key) -> tuple | None:
    """What was remembered under `key` this step, if the tensor it was remembered for is still alive (so its
    memory was not reused): (weakref, *value)."""
    hit = memo.get(key) if key is not None else None
    return hit if hit is not None and hit[0]() is not None else None


def _remember(memo: dict, key, t: torch.Tensor, *value) -> None:
    if key is not None:
        try:
            memo[key] = (weakref.ref(t), *value)
        except TypeError:  # a tensor subclass that takes no weak reference: not remembered
            pass
