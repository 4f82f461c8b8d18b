"""The rule registry: pure functions `rule(run, config) -> list[Finding]`, one per rule id family.

`run` is a `RunData` (RunMeta + StepRecords); `config` a `RuleConfig`. Registering a name twice is an error.
`run_rules` applies every registered rule (or a chosen subset) and returns the findings unranked. The rule modules
import this file; the package (ampdoctor/rules/__init__.py) imports them, so there is no import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import BadInput
from ..findings import Finding
from ..records import ROUNDED_AWAY_SHARE, RunMeta, StepRecord

__all__ = ["RunData", "RuleConfig", "register", "RULES", "RULE_IDS", "run_rules"]

# Every rule id of shared/CONTRACT.md (some are emitted by replay only).
RULE_IDS = ("overflow", "nan_origin", "overflow_risk", "underflow", "loss_scale_collapse", "skipped_steps",
            "clip_before_unscale", "scaler_misorder", "missing_scaler_update", "update_underflow",
            "fp16_master_weights", "mask_value_overflow", "eps_underflow", "precision_loss", "env_tf32",
            "headroom_trend", "update_spike", "deprecated_api", "replay_error")


@dataclass
class RunData:
    meta: RunMeta
    steps: list[StepRecord]

    @property
    def has_scaler(self) -> bool:
        # (a GradScaler the watch adopted after the run directory's manifest was written shows in the records)
        if self.meta.scaler:
            return bool(self.meta.scaler.get("enabled", True))
        # rules ask inside their per-step loops: the scan is kept (for the step list it was made from)
        key = (id(self.steps), len(self.steps))
        cached = self.__dict__.get("_has_scale")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_has_scale"] = (key, any(r.scale is not None for r in self.steps))
        return cached[1]

    def slot_of(self, module: str) -> int | None:
        """`module`'s index in the run's module table (its slot in each step's headroom series), or None."""
        return next((i for i, m in enumerate(self.meta.modules or []) if m and m[0] == module), None)

    @property
    def growth_factor(self) -> float | None:
        """The GradScaler's growth_factor where the run recorded it (rules/backoff.benign_backoff)."""
        return (self.meta.scaler or {}).get("growth_factor")


@dataclass(kw_only=True)
class RuleConfig:
    near_max_bits: float = 1.0
    """overflow_risk: warn when a forward activation has less than this many bits of headroom (fp16: > 2^15)."""
    underflow_share: float = 0.25
    """underflow: share of nonzero values below the normal range that counts as 'large'."""
    underflow_min_nonzero: int = 16
    collapse_consecutive: int = 10
    """loss_scale_collapse: this many skipped steps in a row."""
    collapse_min_scale: float = 1e-4
    skipped_share: float = 0.05
    skipped_min: int = 5
    rounded_away_share: float = ROUNDED_AWAY_SHARE
    spike_factor: float = 2.0
    """update_spike: one update multiplied a weight's L2 norm by at least this (healthy updates change it by %)."""
    spike_window_factor: float = 10.0
    """update_spike: the updates between two sampled steps multiplied it by at least this."""
    headroom_max_bits: float = 8.0
    """headroom_trend: warn only when a layer has at most this many bits left (fp16: abs-max >= 256)."""
    headroom_min_rate: float = 0.03
    """headroom_trend: ... and its headroom falls at least this many bits per step (a steady trend)."""
    headroom_horizon: int = 100
    """headroom_trend: ... and the forecast overflow is at most this many steps away."""
    only: tuple[str, ...] | None = None
    """Run only these rule ids."""

    def __post_init__(self) -> None:
        if self.only is not None:
            unknown = [r for r in self.only if r not in RULE_IDS]
            if unknown:
                raise BadInput(f"unknown rule id(s) {', '.join(unknown)}; known: {', '.join(RULE_IDS)}")


RuleFn = Callable[[RunData, RuleConfig], "list[Finding]"]
RULES: dict[str, tuple[tuple[str, ...], RuleFn]] = {}


def register(name: str, emits: tuple[str, ...]):
    """Decorator: register a rule function under `name`, emitting the rule ids in `emits`."""
    def deco(fn: RuleFn) -> RuleFn:
        if name in RULES:
            raise RuntimeError(f"duplicate registrations for rule {name!r}")
        bad = [e for e in emits if e not in RULE_IDS]
        if bad:
            raise RuntimeError(f"rule {name!r} emits unknown ids {bad}")
        RULES[name] = (emits, fn)
        return fn
    return deco


def run_rules(run: RunData, config: RuleConfig | None = None) -> list[Finding]:
    config = config or RuleConfig()
    out: list[Finding] = []
    for name, (emits, fn) in RULES.items():
        if config.only is not None and not set(emits) & set(config.only):
            continue
        found = fn(run, config)
        if config.only is not None:
            found = [f for f in found if f.rule in config.only]
        out.extend(found)
    return out
