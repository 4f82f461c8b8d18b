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

    headroom: bool | str = "auto"
    """The per-step headroom series (every module's forward and backward abs-max, the `headroom_trend` early
    warning's input) on routine steps, not only sampled ones. "auto" (the default): on as many routine steps as
    fit in `headroom_budget` of the step time, measured on the run itself (every step where it costs little, e.g.
    a large model or nothing in fp16/bf16 to read; every few steps on a short step whose host work shows it).
    True: every routine step, whatever it costs (measured on an H200: 1.07-1.10x on a GPT-2 small step, ~1.3x on a
    15 ms nanoGPT step). False: sampled steps only."""

    headroom_budget: float = 0.02
    """With headroom="auto": the share of the step time the series may cost on average."""

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
        if self.headroom not in (True, False, "auto"):
            raise ValueError(f"headroom must be True, False or 'auto', got {self.headroom!r}")
        if not 0 < self.headroom_budget <= 1:
            raise ValueError(f"headroom_budget must be in (0, 1], got {self.headroom_budget!r}")
        if self.max_module_calls < 1:
            raise ValueError("max_module_calls must be >= 1")
