"""ampdoctor's exceptions. `BadInput` is anything the user handed us that we cannot use (CLI: exit code 2)."""
from __future__ import annotations

__all__ = ["AmpDoctorError", "BadInput", "WatchError"]


class AmpDoctorError(Exception):
    """Base class of ampdoctor's own errors."""


class BadInput(AmpDoctorError, ValueError):
    """A run directory, capture, rule id, factory or model that cannot be used. The message is one line that
    says what is wrong and what to do."""


class WatchError(AmpDoctorError, TypeError):
    """`watch()` was called with something it cannot watch (not a Module, watched twice, foreign optimizer)."""
