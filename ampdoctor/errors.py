"""ampdoctor's exceptions. `BadInput` is anything the user handed us that we cannot use (CLI: exit code 2)."""
from __future__ import annotations

__all__ = ["AmpDoctorError", "BadInput", "WatchError", "error_line"]


class AmpDoctorError(Exception):
    """Base class of ampdoctor's own errors."""


class BadInput(AmpDoctorError, ValueError):
    """A run directory, capture, rule id, factory or model that cannot be used. The message is one line that
    says what is wrong and what to do."""


class WatchError(AmpDoctorError, TypeError):
    """`watch()` was called with something it cannot watch (not a Module, watched twice, foreign optimizer)."""


def error_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 500 characters), as a step's record and its capture keep
    it (record/modulehooks.exception_info) and a replay compares it (replay._as_captured)."""
    return str(exc).split("\n")[0][:500]
