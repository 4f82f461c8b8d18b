"""The run directory: a versioned manifest plus append-only JSON-lines records, flushed every step.

Layout (format "ampdoctor-run", version 1)::

    run_dir/
      manifest.json     {"format": "ampdoctor-run", "format_version": 1, "runs": [{"run": 0, "meta": RunMeta}, ...]}
      steps.jsonl       one StepRecord per line, tagged {"run": i, ...}; appended and flushed after every step;
                        `{"run": i, "end": true}` when the watch closed (a run without it was killed or still runs)
      captures/<step>/  batch captures written at the first bad step (ampdoctor/capture.py); a later run that
                        captures the same step writes `captures/<step>.run<i>/`
      replay-<run>.json the in-process op-level replay of run <run>'s capture, as the watch folded it into its report
                        ({"format": "ampdoctor-replay", "run": i, "capture": "<step>", "report": Report})
      rank-<r>/         the same layout per rank in a distributed run
      .ampdoctor.lock   taken while a run index is allocated

Nothing is ever lost or overwritten. A directory that already holds runs is appended to: each writer takes the
lock, allocates the next run index and lists it in the manifest, so writers started together each get their
own run. Each record is one `write()` on an O_APPEND descriptor, so concurrent writers' lines never interleave.
A process killed mid-line leaves a torn line: readers skip it wherever it is, and the next writer starts on a
fresh line. Temporaries a killed writer left (`.ampdoctor-*`) are removed by the next writer.
"""
from __future__ import annotations

import json
import os
import stat
import sys
import time
import warnings

from .errors import BadInput
from .fsutil import atomic_write_text, clean_stale_temps, loads_bounded, locked, raw_depth_within, read_regular
from .records import RunMeta, StepRecord

__all__ = ["RunDirWriter", "read_run", "find_rank_dirs", "capture_name", "write_replay", "read_replay", "FORMAT",
           "FORMAT_VERSION"]

FORMAT = "ampdoctor-run"
FORMAT_VERSION = 1
MAX_LINE = 64 << 20
MAX_MANIFEST = 64 << 20
MAX_RECORD_DEPTH = 24


class RunDirWriter:
    """Appends StepRecords to run_dir. On any OS error it degrades to in-memory with one warning."""

    def __init__(self, run_dir: str | os.PathLike, meta: RunMeta):
        self.path = os.fspath(run_dir)
        self.ok = True
        self._fd: int | None = None
        try:
            os.makedirs(self.path, exist_ok=True)
            _clean_temps(self.path)
            man_path = os.path.join(self.path, "manifest.json")
            sp = os.path.join(self.path, "steps.jsonl")
            with locked(self.path):
                runs = _read_manifest(man_path)["runs"] if os.path.lexists(man_path) else []
                self.run = 1 + max((r["run"] for r in runs if isinstance(r.get("run"), int)), default=len(runs) - 1)
                runs.append({"run": self.run, "meta": meta.to_dict()})
                fd = os.open(sp, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK
                             | getattr(os, "O_NOFOLLOW", 0), 0o666)
                self._fd = fd
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise BadInput(f"{sp} is not a regular file")
                _fresh_line(sp, fd)
                atomic_write_text(man_path, json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION,
                                                        "runs": runs}, indent=1))
        except (OSError, BadInput) as e:
            self.close()
            self._degrade(e)

    def _degrade(self, e: Exception) -> None:
        self.ok = False
        warnings.warn(f"ampdoctor: cannot write the run directory {self.path!r} ({e}); records stay in memory "
                      "only. Training is not affected.", RuntimeWarning, stacklevel=3)

    def append(self, rec: StepRecord) -> bytes | None:
        """Write `rec` as one line; returns that line (StepStore spills it as it is), or None when nothing was
        written."""
        if not self.ok or self._fd is None:
            return None
        try:
            d = rec.to_dict()
            d["run"] = self.run
            data = (json.dumps(d, separators=(",", ":"), allow_nan=True) + "\n").encode("utf-8")
            n = os.write(self._fd, data)   # one write on O_APPEND: lines of concurrent writers never interleave
            while n < len(data):           # a short write (disk full, signal): finish the line
                n += os.write(self._fd, data[n:])
            return data
        except OSError as e:
            self.close()
            self._degrade(e)
            return None

    def end(self) -> None:
        """The run's end line (`{"run": i, "end": true}`): the watch was closed, by close() or at interpreter exit. A
        run without it ended some other way (killed), or is still running (rundir.read_run, RunMeta.closed)."""
        if not self.ok or self._fd is None:
            return
        try:
            os.write(self._fd, (json.dumps({"run": self.run, "end": True}) + "\n").encode())
        except OSError:
            pass

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def _clean_temps(run_dir: str) -> None:
    clean_stale_temps(run_dir)
    caps = os.path.join(run_dir, "captures")
    if os.path.isdir(caps) and not os.path.islink(caps):
        clean_stale_temps(caps)
        for name in os.listdir(caps):
            p = os.path.join(caps, name)
            if os.path.isdir(p) and not os.path.islink(p):
                clean_stale_temps(p)


def _fresh_line(sp: str, fd: int) -> None:
    """If the file ends in a torn line (a killed writer), end it so the next record starts on a line of its own."""
    size = os.fstat(fd).st_size
    if size:
        with open(sp, "rb") as f:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                os.write(fd, b"\n")


def _read_manifest(path: str) -> dict:
    if os.path.islink(path):
        raise BadInput(f"{path}: is a symbolic link; refusing to follow it")
    man = loads_bounded(read_regular(path, "run manifest", MAX_MANIFEST), f"{path}: not a readable ampdoctor "
                        "manifest", 16)
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise BadInput(f"{path}: not an ampdoctor run directory manifest (format != {FORMAT!r})")
    v = man.get("format_version")
    if not isinstance(v, int) or v < 1:
        raise BadInput(f"{path}: bad format_version {v!r}")
    if v > FORMAT_VERSION:
        raise BadInput(f"{path}: written by a newer ampdoctor (format {v}, this one reads {FORMAT_VERSION}); "
                       "upgrade ampdoctor")
    runs = man.get("runs")
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and isinstance(r.get("meta"), dict)
                                                          for r in runs):
        raise BadInput(f"{path}: manifest has no valid 'runs' list")
    return man


def find_rank_dirs(run_dir: str) -> list[tuple[int | None, str]]:
    """[(rank, path)]: the rank-<r>/ subdirectories of a distributed run, or [(None, run_dir)]."""
    if not os.path.isdir(run_dir):
        raise BadInput(f"{run_dir}: no such run directory")
    ranks = []
    try:
        names = os.listdir(run_dir)
    except OSError as e:
        raise BadInput(f"{run_dir}: cannot list the run directory ({e.strerror or e})") from None
    for name in names:
        p = os.path.join(run_dir, name)
        if name.startswith("rank-") and name[5:].isdigit() and os.path.isdir(p) and not os.path.islink(p):
            ranks.append((int(name[5:]), p))
    if ranks:
        return sorted(ranks)
    if not os.path.lexists(os.path.join(run_dir, "manifest.json")):
        raise BadInput(f"{run_dir}: not an ampdoctor run directory (no manifest.json); pass the run_dir given "
                       "to ampdoctor.watch")
    return [(None, run_dir)]


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal and the work takes a while."""

    def __init__(self, total: int, what: str, after_s: float = 1.5):
        self.total, self.what, self.t0, self.after = max(total, 1), what, time.monotonic(), after_s
        self.tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self.last = self.t0
        self.shown = False

    def update(self, done: int) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if now - self.t0 < self.after or now - self.last < 0.2:
            return
        self.last, self.shown = now, True
        frac = min(done / self.total, 1.0)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.what} [{bar:<30}] {100 * frac:5.1f}%")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r" + " " * (len(self.what) + 42) + "\r")
            sys.stderr.flush()


def _open_records(sp: str):
    """The steps file opened for reading: a regular file only, never blocking on a FIFO."""
    try:
        st = os.lstat(sp)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadInput(f"{sp}: cannot read the records ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{sp}: is a symbolic link; refusing to follow it")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{sp}: the records file is not a regular file")
    try:
        fd = os.open(sp, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BadInput(f"{sp}: the records file is not a regular file")
        return os.fdopen(fd, "rb")
    except OSError as e:
        raise BadInput(f"{sp}: cannot read the records ({e.strerror or e})") from None


def _loads(raw: bytes):
    """One record line; a complete line with a byte that is not UTF-8 (a flipped bit on disk) is still read, the byte
    replaced, so that the step it records is not lost as if the line were torn."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        return json.loads(raw.decode("utf-8", errors="replace"))


def _written_again(first: StepRecord, again: StepRecord) -> bool:
    """`again` is `first`'s step written again whole: the rest of an iteration a mid-run report recorded part of
    (record/storage.folded: the first part went wrong before its optimizer step, and the whole holds its calls and
    module statistics first), or the record ampdoctor left when it switched itself off in that step."""
    if again.internal_error:
        return True
    went_wrong = first.loss_finite is False or first.output_finite is False or first.grad_finite is False or \
        first.exception is not None or any(e.error for e in first.events)
    # (by repr: a NaN statistic equals itself there)
    return went_wrong and repr(again.events[:len(first.events)]) == repr(first.events) and \
        repr(again.modules[:len(first.modules)]) == repr(first.modules)


def read_run(run_dir: str, run: int | None = None) -> tuple[RunMeta, list[StepRecord]]:
    """Read one run (default: the last) of a single-rank run directory. Raises BadInput on foreign data.
    Lines that are not JSON (torn by a killed writer, anywhere in the file) are skipped; a file with records
    but not one readable line is refused."""
    man_path = os.path.join(run_dir, "manifest.json")
    man = _read_manifest(man_path)
    runs = man["runs"]
    idx = len(runs) - 1 if run is None else run
    if not 0 <= idx < len(runs):
        raise BadInput(f"{run_dir}: no run {run} (it has {len(runs)})")
    run_id = runs[idx].get("run", idx)
    try:
        meta = RunMeta.from_dict(runs[idx]["meta"])
    except TypeError as e:
        raise BadInput(f"{man_path}: malformed run metadata ({e})") from None
    steps: list[StepRecord] = []
    closed = False
    meta.closed = None
    sp = os.path.join(run_dir, "steps.jsonl")
    f = _open_records(sp)
    if f is None:
        return meta, steps
    good = bad = 0
    progress = _Progress(os.fstat(f.fileno()).st_size, f"ampdoctor: reading {os.path.basename(sp)}")
    pos = 0
    with f:
        try:
            for lineno, raw in enumerate(f, 1):
                pos += len(raw)
                if lineno % 2048 == 0:
                    progress.update(pos)
                if len(raw) > MAX_LINE:
                    raise BadInput(f"{sp}:{lineno}: record larger than {MAX_LINE >> 20} MiB; refusing")
                if not raw.strip():
                    continue
                if not raw_depth_within(raw, MAX_RECORD_DEPTH):
                    raise BadInput(f"{sp}:{lineno}: record nested deeper than {MAX_RECORD_DEPTH} levels; refusing")
                try:
                    d = _loads(raw)
                except (ValueError, UnicodeDecodeError, RecursionError):  # torn, corrupt, 5000-digit numbers
                    bad += 1
                    continue
                if not isinstance(d, dict):
                    raise BadInput(f"{sp}:{lineno}: record is not an object")
                good += 1
                if d.get("run", 0) != run_id:
                    continue
                if d.get("end") is True and "step" not in d:
                    closed = True
                    continue
                try:
                    rec = StepRecord.from_dict(d)
                except (TypeError, ValueError, AttributeError, KeyError) as e:
                    raise BadInput(f"{sp}:{lineno}: malformed step record ({e.__class__.__name__}: {e})") from None
                if steps and steps[-1].step == rec.step:
                    if not _written_again(steps[-1], rec):
                        raise BadInput(f"{sp}:{lineno}: a second record of step {rec.step} of run {run_id} that "
                                       "does not continue the first (the records of two runs mixed?); refusing")
                    steps[-1] = rec  # a step written again whole (record/storage.folded)
                else:
                    steps.append(rec)
        except OSError as e:
            raise BadInput(f"{sp}: cannot read the records ({e.strerror or e})") from None
        finally:
            progress.close()
    if bad and not good:
        raise BadInput(f"{sp}: no readable record ({bad} corrupt line(s)); not written by ampdoctor.watch?")
    meta.closed = closed if isinstance(meta.process, dict) and meta.process else None  # (older runs: unknown)
    if not closed and idx == len(runs) - 1:  # (a run still going, or killed: a bad step's capture comes first)
        from .runcaptures import pending
        try:
            since = os.stat(man_path).st_mtime
        except OSError:
            since = None
        steps += pending(run_dir, run_id, steps, meta.process, since)
    return meta, steps


# -- the watch's replay of its capture (so that diagnose(run_dir) folds in what w.report() did) ---------------
REPLAY_FORMAT = "ampdoctor-replay"
MAX_REPLAY = 64 << 20


def capture_name(capture: str) -> str:
    """How a saved replay names its capture: the capture directory's name (`captures/<step>`), whatever path the
    run directory was reached by."""
    return os.path.basename(os.path.normpath(capture))


def write_replay(run_dir: str, run: int, capture: str, report: dict) -> str:
    """Write run `run`'s replay (a Report's dict) of its capture `capture` (the capture directory's name) next to
    the records, atomically; a replay already there for this run and capture is replaced by the same content."""
    path = os.path.join(run_dir, f"replay-{int(run)}.json")
    doc = {"format": REPLAY_FORMAT, "run": int(run), "capture": str(capture), "report": report}
    return atomic_write_text(path, json.dumps(doc))


def read_replay(run_dir: str) -> tuple[str, dict] | None:
    """(capture name, Report dict) of the replay saved for the last run of `run_dir`; None when there is none.
    Raises BadInput on a file that is not one."""
    run = _last_run(run_dir)
    path = os.path.join(run_dir, f"replay-{run}.json")
    if run is None or not os.path.lexists(path):
        return None
    if os.path.islink(path):
        raise BadInput(f"{path}: is a symbolic link; refusing to follow it")
    doc = loads_bounded(read_regular(path, "saved replay", MAX_REPLAY), f"{path}: not a readable ampdoctor replay",
                        MAX_RECORD_DEPTH)
    if not (isinstance(doc, dict) and doc.get("format") == REPLAY_FORMAT and doc.get("run") == run
            and isinstance(doc.get("capture"), str) and isinstance(doc.get("report"), dict)
            and isinstance(doc["report"].get("findings"), list)):
        raise BadInput(f"{path}: not an ampdoctor replay of run {run}")
    return doc["capture"], doc["report"]


def _last_run(run_dir: str) -> int | None:
    man_path = os.path.join(run_dir, "manifest.json")
    if not os.path.exists(man_path):
        return None
    runs = _read_manifest(man_path)["runs"]
    run = runs[-1].get("run", len(runs) - 1)
    return run if isinstance(run, int) else None
