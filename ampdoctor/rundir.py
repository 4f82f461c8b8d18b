"""The run directory: a versioned manifest plus append-only JSON-lines records, flushed every step.

Layout (format "ampdoctor-run", version 1)::

    run_dir/
      manifest.json     {"format": "ampdoctor-run", "format_version": 1, "runs": [{"run": 0, "meta": RunMeta}, ...]}
      steps.jsonl       one StepRecord per line, tagged {"run": i, ...}; appended and flushed after every step
      captures/<step>/  batch captures written at the first bad step (ampdoctor/capture.py)
      rank-<r>/         the same layout per rank in a distributed run

A process killed mid-step leaves every finished step readable: a torn last line is ignored on read. A
directory that already holds runs is appended to (a new run index); nothing is overwritten.
"""
from __future__ import annotations

import json
import os
import warnings

from .errors import BadInput
from .fsutil import atomic_write_text
from .records import RunMeta, StepRecord

__all__ = ["RunDirWriter", "read_run", "find_rank_dirs", "FORMAT", "FORMAT_VERSION"]

FORMAT = "ampdoctor-run"
FORMAT_VERSION = 1
MAX_LINE = 64 << 20


class RunDirWriter:
    """Appends StepRecords to run_dir. On any OS error it degrades to in-memory with one warning."""

    def __init__(self, run_dir: str | os.PathLike, meta: RunMeta):
        self.path = os.fspath(run_dir)
        self.ok = True
        self._f = None
        try:
            os.makedirs(self.path, exist_ok=True)
            man_path = os.path.join(self.path, "manifest.json")
            runs = []
            if os.path.exists(man_path):
                runs = _read_manifest(man_path)["runs"]
            self.run = len(runs)
            runs.append({"run": self.run, "meta": meta.to_dict()})
            atomic_write_text(man_path, json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION,
                                                    "runs": runs}, indent=1))
            self._f = open(os.path.join(self.path, "steps.jsonl"), "a", encoding="utf-8")
        except (OSError, BadInput) as e:
            self._degrade(e)

    def _degrade(self, e: Exception) -> None:
        self.ok = False
        warnings.warn(f"ampdoctor: cannot write the run directory {self.path!r} ({e}); records stay in memory "
                      "only. Training is not affected.", RuntimeWarning, stacklevel=3)

    def append(self, rec: StepRecord) -> None:
        if not self.ok or self._f is None:
            return
        try:
            d = rec.to_dict()
            d["run"] = self.run
            self._f.write(json.dumps(d, separators=(",", ":"), allow_nan=True) + "\n")
            self._f.flush()
        except OSError as e:
            self._degrade(e)

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


def _read_manifest(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not a readable ampdoctor manifest ({e.__class__.__name__}: {e})") from None
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
    for name in os.listdir(run_dir):
        p = os.path.join(run_dir, name)
        if name.startswith("rank-") and name[5:].isdigit() and os.path.isdir(p) and not os.path.islink(p):
            ranks.append((int(name[5:]), p))
    if ranks:
        return sorted(ranks)
    if not os.path.exists(os.path.join(run_dir, "manifest.json")):
        raise BadInput(f"{run_dir}: not an ampdoctor run directory (no manifest.json); pass the run_dir given "
                       "to ampdoctor.watch")
    return [(None, run_dir)]


def read_run(run_dir: str, run: int | None = None) -> tuple[RunMeta, list[StepRecord]]:
    """Read one run (default: the last) of a single-rank run directory. Raises BadInput on foreign data."""
    man_path = os.path.join(run_dir, "manifest.json")
    if os.path.islink(man_path):
        raise BadInput(f"{man_path}: is a symbolic link; refusing to follow it")
    man = _read_manifest(man_path)
    runs = man["runs"]
    idx = len(runs) - 1 if run is None else run
    if not 0 <= idx < len(runs):
        raise BadInput(f"{run_dir}: no run {run} (it has {len(runs)})")
    try:
        meta = RunMeta.from_dict(runs[idx]["meta"])
    except TypeError as e:
        raise BadInput(f"{man_path}: malformed run metadata ({e})") from None
    steps: list[StepRecord] = []
    sp = os.path.join(run_dir, "steps.jsonl")
    if os.path.islink(sp):
        raise BadInput(f"{sp}: is a symbolic link; refusing to follow it")
    if os.path.exists(sp):
        with open(sp, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if len(raw) > MAX_LINE:
                    raise BadInput(f"{sp}:{lineno}: record larger than {MAX_LINE >> 20} MiB; refusing")
                try:
                    d = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    if not raw.endswith(b"\n"):
                        break  # a torn last line from a killed process
                    raise BadInput(f"{sp}:{lineno}: corrupt record line") from None
                if not isinstance(d, dict):
                    raise BadInput(f"{sp}:{lineno}: record is not an object")
                if d.get("run", 0) != idx:
                    continue
                try:
                    steps.append(StepRecord.from_dict(d))
                except (TypeError, ValueError, AttributeError, KeyError) as e:
                    raise BadInput(f"{sp}:{lineno}: malformed step record ({e.__class__.__name__}: {e})") from None
    return meta, steps
