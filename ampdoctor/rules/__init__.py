"""The rules: pure functions over a run's records, registered by id (ampdoctor/rules/registry.py).

Importing the package registers every rule module below; `run_rules(RunData(meta, steps), RuleConfig())` applies
them. What a rule may import: records, findings, fixes, env and `registry`/`steps` here — never the recorder,
the report or replay (tests/test_imports.py).
"""
from __future__ import annotations

from .registry import RULE_IDS, RULES, RuleConfig, RunData, register, run_rules
from . import origins, numeric, underflow, scaler, clipscaled, callorder, weights, updates, envrules  # noqa: F401
from . import deepspeed  # noqa: F401  (DeepSpeed runs: rules/deepspeed.py)
from . import headroom  # noqa: F401  (headroom_trend: rules/headroom.py)
from . import ownscale  # noqa: F401  (a loop's own loss scale: rules/ownscale.py)

__all__ = ["RunData", "RuleConfig", "register", "RULES", "RULE_IDS", "run_rules"]
