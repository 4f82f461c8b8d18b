"""Capturing a bad step during training: which bad steps get a capture and which steps are sampled after one
(`CapturePolicy`), where the capture goes (the run directory, per rank, or a temporary directory that
w.report() can still replay), and why none is written for sharded (FSDP2) models. The capture format itself is
ampdoctor/capture.py."""
from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
import warnings

import torch

from ..records import BACKOFF_MAX_STREAK, COLLAPSE, LOSS_JUMP, SQUARE_OVERFLOW

__all__ = ["CapturePolicy", "maybe_capture", "bad_micro", "RECUR_CLEAN", "COLLAPSE_GAP", "COLLAPSE_SAMPLES"]

RECUR_CLEAN = 5
"""Clean steps after which a `backward` skip at a working scale is captured again (CapturePolicy.observe)."""
_INF = math.inf
COLLAPSE_GAP = 4
"""Steps between two series points within which a COLLAPSE-fold change counts (CapturePolicy.collapse)."""
COLLAPSE_SAMPLES = 2
"""Steps sampled per module for a collapse of its output (CapturePolicy.collapse)."""


class CapturePolicy:
    """Which steps a watch samples and which of its bad steps it captures, decided online, step by step. Owned by
    the StepMachine; its state changes only through these methods.

    GradScaler's normal search for a loss scale is not worth a capture: skipped steps with a finite forward
    before the first applied update (a streak shorter than records.BACKOFF_MAX_STREAK), or a single skip right
    after the scale grew (the scaler probing upwards). What is: a forward failure (`forward`; one that only raised, with nothing non-finite seen, is `raised`: a loop
    that catches a bad batch's error and goes on keeps the `forward` capture for a later failure); a skip after the
    scale had settled (`backward`); skips that persist (`persistent`). One capture of each kind, within
    `WatchConfig.max_captures`, and one more of a `backward` skip that comes again after RECUR_CLEAN clean steps at
    a scale an update already used (no scale explains it: a NaN at any loss scale, an empty tile, a zero-length
    sequence, after an earlier harmless skip took the kind; a report with nothing wrong replays these in turn,
    analysis/replaychoice.choose_replay), while it leaves a capture of the budget for a later failure; a bad step
    that was not sampled has the next `bad_step_followup` steps sampled."""

    def __init__(self, cfg):
        self.cfg = cfg              # the watch's WatchConfig
        self.followup = 0           # steps still to be sampled after a bad one
        self.captures = 0           # captures taken from the budget so far
        self.kinds: set[str] = set()  # kinds of bad step seen first (and captured where the budget allowed)
        self.skip_streak = 0        # consecutive skipped steps with a finite forward
        self.stepped = False        # an update has been applied (GradScaler's initial search is over)
        self.prev_scale = None      # the loss scale of the step before
        self.prev_loss = None       # the finite loss of the step before (loss_jump)
        self.clean = 0              # steps since the last bad one (neither forward nor gradients non-finite)
        self.worked = None          # the largest loss scale a clean step has used
        self.recurred = False       # the one extra `backward` capture was taken
        self.series_prev: list = []  # per slot: its forward abs-max at its last routine series point (collapse)
        self.series_at: list = []    # ... and that point's step
        self.series_dtype, self.series_h = None, []  # the last dtype codes seen, and their fp16 slots
        self.collapses: dict[int, int] = {}      # slot -> the steps sampled for its collapse (collapse)

    def sampled(self, step: int) -> bool:
        """Whether step `step` takes full statistics: every `every`-th, and the follow-ups of a bad step. Once per
        step, in order (a follow-up is used up)."""
        s = step % self.cfg.every == 0 or self.followup > 0
        if self.followup > 0:
            self.followup -= 1
        return s

    def kind(self, bad_fwd: bool, bad_bwd: bool, scale, scaler: bool = True) -> str | None:
        """The kind of bad step this is (`forward`, `backward`, `persistent`), or None when it is not worth a
        capture (see the class docstring). Once per resolved step, in order: it advances the streak."""
        prev, self.prev_scale = self.prev_scale, scale
        self.skip_streak = self.skip_streak + 1 if (bad_bwd and not bad_fwd) else 0
        if bad_fwd:
            return "forward"
        if not bad_bwd:
            self.stepped = True
            return None
        if not scaler:
            return "backward"  # without a scaler nothing explains a non-finite gradient
        if not self.stepped:  # the initial search
            return "persistent" if self.skip_streak >= BACKOFF_MAX_STREAK else None
        if self.skip_streak == 1 and prev is not None and scale is not None and scale > prev:
            return None  # the scale had just grown: the scaler probing
        return "persistent" if self.skip_streak >= 3 else "backward"

    def observe(self, bad_fwd: bool, bad_bwd: bool, scale, *, sampled: bool, scaler: bool,
                raised_only: bool = False) -> str | None:
        """One resolved step: schedule the follow-ups of a bad step that was not sampled, and return its kind when
        it is the first of that kind (a capture is due), else None."""
        if (bad_fwd or bad_bwd) and not sampled:
            self.followup = max(self.followup, self.cfg.bad_step_followup)
        elif scale is not None and self.prev_scale is not None and scale * 2 < self.prev_scale and not sampled:
            # the loss scale fell more than one backoff in one step (set by the loop: `scaler.update(new_scale)`,
            # a scaler state loaded): the next step is sampled, so its gradients are seen at the new scale
            self.followup = max(self.followup, 1)
        clean, self.clean = self.clean, 0 if (bad_fwd or bad_bwd) else self.clean + 1
        worked = self.worked
        if not (bad_fwd or bad_bwd) and scale is not None:
            self.worked = scale if self.worked is None else max(self.worked, scale)
        k = self.kind(bad_fwd, bad_bwd, scale, scaler)
        if k == "forward" and raised_only:
            k = "raised"  # (the forward raised, nothing non-finite: a kind of its own, see readback.resolve)
        if k == "backward" and k in self.kinds and clean >= RECUR_CLEAN and scale is not None \
                and worked is not None and scale <= worked and not self.recurred \
                and self.captures < self.cfg.max_captures - 1:
            self.recurred = True
            return k  # a skip again, after the run had recovered, at a scale that worked: worth its own replay
        if k is None or k in self.kinds:
            return None
        self.kinds.add(k)
        return k

    def loss_jump(self, losses: list, *, sampled: bool) -> None:
        """One resolved step's losses: a finite loss that moved by 1000x or more from the step before (a loss weight
        gone wrong, a divergence starting) has the next step sampled, so that per-layer statistics see the new
        regime at once instead of at the next sampled step. Host numbers only."""
        loss = next((v for v in reversed(losses) if v == v and abs(v) != float("inf")), None)
        prev, self.prev_loss = self.prev_loss, loss
        if sampled or loss is None or not prev or not loss:
            return
        r = abs(loss / prev)
        if r >= LOSS_JUMP or r <= 1.0 / LOSS_JUMP:
            self.followup = max(self.followup, 1)

    def collapse(self, fwd: list, dtype: str, step: int) -> None:
        """A routine step's headroom series (its forward abs-maxes, `dtype` one code per slot): an fp16 output whose
        abs-max fell COLLAPSE-fold or more since the slot's last recorded point, from at least 1 (a hand-written
        norm whose variance overflowed: x * rsqrt(inf) = 0, finite, silent), or rose COLLAPSE-fold into the range
        where its square overflows fp16 (the input of such a norm, whose own output may be fp32), has the next step
        sampled, so that its full statistics judge it (rules/numeric.py silent_zeros) and the series dates it. Only
        a change within COLLAPSE_GAP steps (a sudden one: healthy outputs that grow into the hundreds over a run
        are not it), at most COLLAPSE_SAMPLES such steps per slot. Host numbers only."""
        prev, at = self.series_prev, self.series_at
        if len(prev) != len(fwd):  # (per slot: the abs-max at its last routine series point, and that step)
            prev[:], at[:] = [None] * len(fwd), [step] * len(fwd)
        if dtype != self.series_dtype:  # (the fp16 slots, found again only when the step's dtypes change)
            self.series_dtype, self.series_h = dtype, [i for i, c in enumerate(dtype) if c == "h" and i < len(fwd)]
        for s in self.series_h:
            v = fwd[s]
            if v is None:
                continue
            p, a = prev[s], at[s]
            prev[s] = v
            at[s] = step
            if p is None or step - a > COLLAPSE_GAP or not (0 <= p < _INF and 0 <= v < _INF):
                continue
            if (p >= 1.0 and v <= p / COLLAPSE or v >= SQUARE_OVERFLOW and v >= p * COLLAPSE) \
                    and self.collapses.get(s, 0) < COLLAPSE_SAMPLES:
                self.collapses[s] = self.collapses.get(s, 0) + 1
                self.followup = max(self.followup, 1)

    def spend(self) -> bool:
        """Take one capture from the budget (`max_captures`); False when it is spent."""
        if self.captures >= self.cfg.max_captures:
            return False
        self.captures += 1
        return True


def maybe_capture(m, st, kind: str | None = None) -> None:
    """Write the capture of the bad step `st` (the micro-batch that went bad, else the last), within the watch's
    capture budget; never raises. `kind`: what went bad (CapturePolicy.kind), kept in the capture's extra."""
    w = m.w
    if not (m.cfg.capture and st.batches and m.policy.spend()):
        return
    if m.sharded:  # a collective from one rank (to gather the weights) would hang the others
        warnings.warn(f"ampdoctor: step {st.step} went bad, but the model's parameters are sharded (FSDP2/"
                      "DTensor), so no capture was written: a capture holds the whole model. To replay it, load a "
                      "full checkpoint into an unsharded model and call ampdoctor.save_batch.",
                      RuntimeWarning, stacklevel=4)
        return
    try:
        from ..capture import write_capture
        if w.run_dir and (m.writer is None or m.writer.ok):  # (a run directory it could not write: as without)
            path = _fresh_dir(os.path.join(w.run_dir, *([f"rank-{w.meta.rank}"] if w.meta.rank is not None and
                                                        (w.meta.world_size or 1) > 1 else []), "captures"),
                              str(st.step), getattr(m.writer, "run", None))
        else:  # no run directory: a temporary capture, so that w.report() can still replay it
            path = os.path.join(_tmp_root(), f"{id(w):x}-{st.step}")
        k = st.bad_batch if 0 <= st.bad_batch < len(st.batches) else bad_micro(st)
        args, kwargs, rng = st.batches[k]
        grad_out = st.grad_outs.get(id(st.batches[k]))
        rng, state_dict = _weights_as_found(w.model, rng)
        with m.suspend():  # the capture's own forward is not the step's
            st.capture = write_capture(path, w.model, args, kwargs, rng=rng, state_dict=state_dict,
                                       autocast=st.autocast,
                                       scaler_state=w.scaler.state_dict() if w.scaler is not None else None,
                                       step=st.step, grad_out=grad_out, extra=_capture_extra(st, k, kind), opaque=True)
            # the model's structure now, for an in-process replay after the script changed it (replay/skeleton.py),
            # and the objects the model received, for what the capture cannot give back exactly (capture.relive)
            from ..replay.skeleton import skeleton
            m.skeletons[st.capture] = skeleton(w.model)
            m.capture_live[st.capture] = (args, kwargs)
    except Exception as e:  # a capture must never break training
        warnings.warn(f"ampdoctor: could not write a capture of step {st.step} ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=4)


def bad_micro(st) -> int:
    """Index into `st.batches` of the micro-batch whose backward first made the step's gradients non-finite, from
    the gradients accumulated before each later micro-batch's forward (modulehooks._grads_so_far): the one just
    before the first non-finite reading; the last micro-batch when none was (or it is no longer kept)."""
    for micro, t in st.acc_grads:
        if not math.isfinite(float(t)):
            i = len(st.batches) - 1 - (st.micro - (micro - 1))
            return i if 0 <= i < len(st.batches) else -1
    return -1


def _weights_as_found(model, rng: dict) -> tuple[dict, dict | None]:
    """The batch's RNG dict without its "param:" entries, and the model's state_dict with those parameters as the
    step's forward found them (a forward that writes its own weights: record/modstate.py); None when it has none."""
    found = {k[6:]: v for k, v in rng.items() if k.startswith("param:") and isinstance(v, torch.Tensor)}
    if not found:
        return rng, None
    sd = dict(model.state_dict())
    ptrs = {}
    for name, v in found.items():
        t = sd.get(name)
        if isinstance(t, torch.Tensor):
            ptrs[(t.data_ptr(), tuple(t.shape))] = v
    for name, t in sd.items():  # (a tied weight under every name it has)
        if isinstance(t, torch.Tensor) and not t.is_meta and (t.data_ptr(), tuple(t.shape)) in ptrs:
            sd[name] = ptrs[(t.data_ptr(), tuple(t.shape))]
    return {k: v for k, v in rng.items() if not k.startswith("param:")}, sd


def _capture_extra(st, k: int, kind: str | None = None) -> dict:
    """What the step's one transfer read of its losses: `loss_finite` (None when it saw none). A replay without
    the loss function tells from it whether a non-finite output gradient came from the loss computation or only
    from the loss scale. `entry`: the module of the model that batch `k` went into when it was not the model's own
    forward (record/entries.py; the replay runs that module). `kind`: what went bad (forward, backward, persistent,
    raised), for a reader that finds the capture before the step's record (runcaptures.py). `raised`: the type and
    first line of the error the step raised, if it raised one."""
    losses = (getattr(st, "synced", None) or {}).get("losses") or []
    extra = {"loss_finite": all(math.isfinite(v) for v in losses) if losses else None}
    if kind:
        extra["kind"] = kind
    exc = getattr(st, "exception", None)
    if exc:  # the error the step raised: a replay that raises it again reproduced the step (replay._as_captured)
        extra["raised"] = {"type": exc.get("type"), "message": exc.get("message")}
    entry = st.entry_of.get(id(st.batches[k]))
    if entry is not None:
        extra["entry"] = entry
    return extra


def _fresh_dir(base: str, name: str, run: int | None) -> str:
    """A new, empty `base/<name>` directory; when an earlier run in the same run directory captured the same step,
    `<name>.run<run>` (then `<name>.pid<pid>`): a capture is never written over another run's."""
    os.makedirs(base, exist_ok=True)
    for cand in (name, f"{name}.run{run}" if run is not None else None, f"{name}.pid{os.getpid()}"):
        if cand is None:
            continue
        path = os.path.join(base, cand)
        try:
            os.mkdir(path)  # atomic: two writers never get the same one
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"captures of step {name} already exist under {base}")


_TMP: list[str] = []


def _tmp_root() -> str:
    if not _TMP:
        _TMP.append(tempfile.mkdtemp(prefix="ampdoctor-captures-"))
        atexit.register(shutil.rmtree, _TMP[0], True)
    return _TMP[0]
