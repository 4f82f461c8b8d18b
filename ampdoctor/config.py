"""WatchConfig: every knob of a watch, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WatchConfig", "DEFAULT_EVERY"]

DEFAULT_EVERY = 200


@dataclass(kw_only=True, slots=True)
class WatchConfig:
    every: int = DEFAULT_EVERY
    """Full per-layer statistics on every N-th step (step 0 always). 1 = every step. Steps in between are
    still checked for inf/NaN in the loss and gradients and for skipped steps."""

    headroom: bool = False
    """Always-on headroom: every module's forward and backward abs-max on every step (not only sampled ones),
    the series the `headroom_trend` early warning reads. Off by default: measured on an H200 it costs 1.07x on a
    GPT-2 small step and 1.35x on a 15 ms nanoGPT step (benchmarks/RESULTS.md). Turn it on (`watch(...,
    headroom=True)`) for the run you want warned before it overflows; `every=1` also gives the series."""

    bad_step_followup: int = 3
    """After a bad step, record full statistics on this many following steps (or until a producer is seen)."""

    capture: bool = True
    """Write a capture of the first bad step's batch under run_dir/captures/ (needs run_dir)."""

    max_captures: int = 3
    """How many captures one run may write: at most one of each kind of bad step (the first forward failure, the
    first skip after GradScaler's loss scale had settled, the first persistent run of skips); GradScaler's normal
    early backoff writes none. Each capture holds the model's weights, so a run directory holds at most this
    many copies of them."""

    update_sample: int = 256
    """Elements per low-precision parameter checked for updates that round away (w + Δw == w)."""

    compile_stats: bool | None = None
    """CPU only, and only where the C statistics pass (ampdoctor/record/cpustats.py) cannot be built: compute statistics
    with torch.compile'd functions (faster than eager, costs a one-time compile). None = on when every <= 10."""

    max_module_calls: int = 4096
    """Per step, at most this many module calls are recorded (the rest are counted, not measured)."""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a positive int (1 = every step), got {self.every!r}")
        if self.bad_step_followup < 0 or self.max_captures < 0 or self.update_sample < 0:
            raise ValueError("bad_step_followup, max_captures and update_sample must be >= 0")
        if self.max_module_calls < 1:
            raise ValueError("max_module_calls must be >= 1")
