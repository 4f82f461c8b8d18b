"""Hostile run directories: torn lines anywhere, a resume after a torn line, concurrent writers, steps.jsonl that
is a directory or a FIFO, deep JSON, temporaries a killed writer left. Nothing is lost; bad input is one line."""
import json
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.errors import BadInput
from ampdoctor.fsutil import TEMP_PREFIX, atomic_write_text
from ampdoctor.records import RunMeta, StepRecord
from ampdoctor.rundir import RunDirWriter, read_run
from scenarios import train


def _train(rd, steps=3):
    return train(nn.Sequential(nn.Linear(4, 1)), lambda i: (torch.randn(2, 4),),
                 lambda o, *a: o.float().pow(2).mean(), steps=steps, run_dir=rd)


def _report_rc(capsys, rd):
    rc = main(["report", str(rd), "--no-html"])
    return rc, capsys.readouterr().err


def test_resume_after_torn_line_keeps_both_runs(tmp_path, capsys):
    rd = tmp_path / "r"
    _train(rd, 3)
    with open(rd / "steps.jsonl", "ab") as f:
        f.write(b'{"run": 0, "step": 3, "loss": 1.')       # killed mid-line
    _train(rd, 2)                                          # the documented resume: a new run, same run_dir
    assert [s.step for s in read_run(str(rd), run=0)[1]] == [0, 1, 2]
    assert [s.step for s in read_run(str(rd))[1]] == [0, 1]
    rc, err = _report_rc(capsys, rd)
    assert rc in (0, 1), err


def test_torn_line_in_the_middle_is_skipped(tmp_path):
    rd = tmp_path / "r"
    _train(rd, 3)
    lines = (rd / "steps.jsonl").read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][: len(lines[1]) // 2] + b"\n"
    (rd / "steps.jsonl").write_bytes(b"".join(lines))
    assert [s.step for s in read_run(str(rd))[1]] == [0, 2]


def _writer(rd, barrier, k):
    barrier.wait()
    w = RunDirWriter(rd, RunMeta(model_class=f"proc{k}"))
    for i in range(40):
        w.append(StepRecord(step=i, loss=float(k)))
    w.close()


def test_concurrent_writers_get_their_own_runs(tmp_path):
    rd = str(tmp_path / "r")
    ctx = mp.get_context("fork")
    n = 6
    barrier = ctx.Barrier(n)
    ps = [ctx.Process(target=_writer, args=(rd, barrier, k)) for k in range(n)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    man = json.loads(open(os.path.join(rd, "manifest.json")).read())
    assert sorted(r["run"] for r in man["runs"]) == list(range(n))
    owners = set()
    for i in range(n):
        meta, steps = read_run(rd, run=i)
        assert [s.step for s in steps] == list(range(40)), meta.model_class  # no duplicates, none lost
        assert len({s.loss for s in steps}) == 1                           # one process's records only
        owners.add(steps[0].loss)
    assert owners == {float(k) for k in range(n)}


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_steps_file_that_is_a_dir_or_fifo(tmp_path, capsys, kind):
    rd = tmp_path / "r"
    _train(rd, 2)
    os.unlink(rd / "steps.jsonl")
    os.mkdir(rd / "steps.jsonl") if kind == "dir" else os.mkfifo(rd / "steps.jsonl")
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("blocked on the FIFO")))
    signal.alarm(20)
    try:
        rc, err = _report_rc(capsys, rd)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert rc == 2 and err.strip().count("\n") == 0 and "not a regular file" in err, err
    with pytest.warns(RuntimeWarning, match="records stay in memory"):   # a writer degrades, never blocks
        w = _train(rd, 1)
    assert len(w.steps) == 1


def test_unreadable_steps_file(tmp_path, capsys):
    rd = tmp_path / "r"
    _train(rd, 2)
    os.chmod(rd / "steps.jsonl", 0)
    if os.access(rd / "steps.jsonl", os.R_OK):
        pytest.skip("running as root: permissions do not stop reads")
    rc, err = _report_rc(capsys, rd)
    assert rc == 2 and "cannot read" in err


@pytest.mark.parametrize("line", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"run": 0, "step": 1, "exception": ' + b'{"a": ' * 500 + b"1" + b"}" * 501,
                                  b'{"run": 0, "step": ' + b"9" * 5000 + b"}"])
def test_deep_or_huge_lines(tmp_path, capsys, line):
    rd = tmp_path / "r"
    _train(rd, 2)
    with open(rd / "steps.jsonl", "ab") as f:
        f.write(line + b"\n")
    try:
        steps = read_run(str(rd))[1]
    except BadInput as e:
        assert "\n" not in str(e)
    else:
        assert [s.step for s in steps] == [0, 1]   # an unparseable line is skipped like a torn one
    rc, err = _report_rc(capsys, rd)
    assert rc in (0, 1, 2) and "Traceback" not in err and err.strip().count("\n") <= 0, err


def test_garbage_only_steps_file_is_refused(tmp_path, capsys):
    rd = tmp_path / "r"
    _train(rd, 2)
    (rd / "steps.jsonl").write_bytes(b"\x00\xffnot json\n" * 5)
    rc, err = _report_rc(capsys, rd)
    assert rc == 2 and "no readable record" in err


def test_stale_temporaries_cleaned_live_ones_kept(tmp_path):
    import fcntl
    rd = tmp_path / "r"
    _train(rd, 1)
    cap = rd / "captures" / "7"
    cap.mkdir(parents=True)
    stale = [rd / (TEMP_PREFIX + "dead1"), cap / (TEMP_PREFIX + "dead2")]
    for p in stale:
        p.write_bytes(b"partial")
        os.utime(p, (time.time() - 60, time.time() - 60))
    live = rd / (TEMP_PREFIX + "live")
    live.write_bytes(b"being written")
    os.utime(live, (time.time() - 60, time.time() - 60))
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)          # a writer that is still alive holds its lock
    try:
        _train(rd, 1)
    finally:
        os.close(fd)
    assert not any(p.exists() for p in stale) and live.exists()


def test_atomic_write_never_leaves_a_temporary(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "x")
    assert os.listdir(tmp_path) == ["a.txt"]


def test_diagnose_after_resume_counts_each_run(tmp_path):
    rd = tmp_path / "r"
    _train(rd, 4)
    _train(rd, 2)
    assert ampdoctor.diagnose(rd).summary["steps"] == 2   # the last run, as documented
