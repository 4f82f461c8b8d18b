"""How a watched process ends: the open watches are closed at interpreter exit (a script that ends without
`w.close()`, or dies on an uncaught exception, still leaves its last step and the run's end line in the run
directory, the exception recorded on that step), and while any watch is open `sys.exit` is stood in for, so that a
non-zero exit status — which no exception hook sees — is recorded the same way. A process killed outright leaves
no end line: rundir.read_run and rules/steps.unfinished tell that afterwards."""
from __future__ import annotations

import atexit
import sys
import weakref

__all__ = ["OPEN", "hook_exit"]

OPEN: "weakref.WeakSet" = weakref.WeakSet()  # the open Watches (closed at interpreter exit)


def _close_at_exit() -> None:
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    for w in list(OPEN):
        try:
            w._record_fatal(exc)
            w._close(replay=True)
        except Exception:
            pass


atexit.register(_close_at_exit)

_SYS_EXIT: list = []  # the sys.exit that _exit_hook stands in for while a watch is open


def _exit_hook(status=None):
    """`sys.exit` while a watch is open: a non-zero status (a failed run) is recorded on each open watch's open
    step, like an uncaught exception, before the process goes on to exit."""
    if status is not None and status != 0:
        for w in list(OPEN):
            try:
                w._record_exit(status)
            except Exception:
                pass
    return _SYS_EXIT[0](status)


def hook_exit(on: bool) -> None:
    """A watch opened (`on`) or closed: stand in for sys.exit from the first open watch until the last closes."""
    if on and not _SYS_EXIT:
        _SYS_EXIT.append(sys.exit)
        sys.exit = _exit_hook
    elif not on and _SYS_EXIT and not OPEN:
        if sys.exit is _exit_hook:  # (left alone when something else replaced it since)
            sys.exit = _SYS_EXIT[0]
        _SYS_EXIT.clear()
