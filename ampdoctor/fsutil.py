"""Files ampdoctor reads and writes without losing data: atomic writes (a locked temporary file beside the target,
then a rename), cleanup of temporaries a killed process left, bounded JSON parsing, reading only regular files
(never blocking on a FIFO), a lock file for read-modify-write, and output directories that are safe to write.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import time

from .errors import BadInput

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["atomic_write_bytes", "atomic_write_text", "clean_stale_temps", "loads_bounded", "json_depth",
           "raw_depth_within", "read_regular", "locked", "check_out_dir", "check_out_file", "mark_out_dir", "TEMP_PREFIX", "OUT_MARKER"]

TEMP_PREFIX = ".ampdoctor-"
OUT_MARKER = ".ampdoctor.out"   # in a directory ampdoctor wrote a report into (not TEMP_PREFIX: never cleaned)
MAX_DEPTH = 64


def _flock(fd: int, blocking: bool = True) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except OSError:
        return False


def clean_stale_temps(d: str, min_age_s: float = 2.0) -> int:
    """Remove `.ampdoctor-*` temporaries in `d` left by a killed writer. A live writer holds a lock on its
    temporary; one that is unlocked and a little old belongs to a dead process. Returns how many were removed."""
    n = 0
    try:
        names = [x for x in os.listdir(d) if x.startswith(TEMP_PREFIX)]
    except OSError:
        return 0
    for name in names:
        p = os.path.join(d, name)
        try:
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < min_age_s:
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            try:
                if _flock(fd, blocking=False):
                    os.unlink(p)
                    n += 1
            finally:
                os.close(fd)
        except OSError:
            continue
    return n


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> str:
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    clean_stale_temps(d)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=d)
    _flock(fd)  # held until closed: tells clean_stale_temps this writer is alive
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the user's usual mode
            f.flush()
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> str:
    return atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def locked(d: str, name: str = ".ampdoctor.lock"):
    """An exclusive lock on `d/name` (flock; released when the process dies) around a read-modify-write."""
    fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        _flock(fd)
        yield
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------- reading
def json_depth(obj, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a parsed JSON value, walked without recursion; stops counting past `limit`."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def raw_depth_within(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text `raw` nests at most `limit` deep, judged on the bytes (no parse, C-speed: strings
    dropped, then innermost bracket pairs removed once per level)."""
    s = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        if not s:
            return True
        t = _INNERMOST.sub(b"", s)   # one pass removes exactly one level
        if t == s:
            return True   # unbalanced: not JSON, the parser will say so
        s = t
    return not s


def loads_bounded(data: bytes | str, what: str, max_depth: int = MAX_DEPTH):
    """json.loads that turns every failure (syntax, encoding, nesting, a 5000-digit number) into one-line
    BadInput, and refuses values nested deeper than `max_depth`."""
    try:
        obj = json.loads(data)
    except RecursionError:
        raise BadInput(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and int() past sys.get_int_max_str_digits
        raise BadInput(f"{what}: not valid JSON ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    if json_depth(obj, max_depth) > max_depth:
        raise BadInput(f"{what}: JSON nested deeper than {max_depth} levels; refusing")
    return obj


def read_regular(path: str, what: str, max_bytes: int) -> bytes:
    """The bytes of a regular file, never following a link or blocking on a FIFO/device; BadInput otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise BadInput(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{path}: the {what} is not a regular file")
        if st.st_size > max_bytes:
            raise BadInput(f"{path}: the {what} is implausibly large ({st.st_size} bytes)")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    except OSError as e:
        raise BadInput(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------- outputs
def _nearest_existing(p: str) -> str:
    p = os.path.abspath(p)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _writable_parent(p: str, flag: str) -> None:
    anc = _nearest_existing(os.path.dirname(os.path.abspath(p)) or ".")
    if not os.path.isdir(anc):
        raise BadInput(f"{flag} {p}: {anc} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {p}: {anc} is not writable")


def check_out_dir(p: str, flag: str = "--out", force: bool = False) -> None:
    """A report may go into a new or empty directory, or one ampdoctor wrote before (OUT_MARKER); `force`
    allows any directory. Never into a file. Raises one-line BadInput before any work is done."""
    if os.path.lexists(p) and not os.path.isdir(p):
        raise BadInput(f"{flag} {p}: exists and is not a directory")
    if os.path.isdir(p):
        if not os.access(p, os.W_OK | os.X_OK):
            raise BadInput(f"{flag} {p}: directory is not writable")
        try:
            names = os.listdir(p)
        except OSError as e:
            raise BadInput(f"{flag} {p}: cannot list the directory ({e.strerror or e})") from None
        mine = OUT_MARKER in names and os.path.isfile(os.path.join(p, OUT_MARKER)) and not os.path.islink(
            os.path.join(p, OUT_MARKER))  # a link named like the marker is not ampdoctor's
        if names and not mine and not force:
            raise BadInput(f"{flag} {p}: directory is not empty and was not written by ampdoctor; choose a new "
                           "directory or pass --force to write into it anyway")
        return
    _writable_parent(p, flag)


def check_out_file(p: str, flag: str) -> None:
    """A file output (--json): not a directory, and its directory can be created/written."""
    if os.path.isdir(p):
        raise BadInput(f"{flag} {p}: is a directory; give a file name")
    if os.path.lexists(p) and not os.path.isfile(p):
        raise BadInput(f"{flag} {p}: exists and is not a regular file")
    if os.path.exists(p) and not os.access(p, os.W_OK):
        raise BadInput(f"{flag} {p}: file is not writable")
    _writable_parent(p, flag)


def mark_out_dir(p: str) -> None:
    """Leave OUT_MARKER in an output directory so a later report may replace what ampdoctor wrote there."""
    os.makedirs(p, exist_ok=True)
    marker = os.path.join(p, OUT_MARKER)
    if os.path.islink(marker):  # never write through a link (to whatever file it names)
        os.unlink(marker)
    with open(marker, "w", encoding="utf-8") as f:
        f.write("written by ampdoctor; a later `ampdoctor ... --out` may overwrite this directory's report\n")
