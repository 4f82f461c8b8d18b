"""The StepStore's spill file (ampdoctor/record/storage.py): a record a run directory wrote spills as that JSON line,
any other in marshal form; one file may hold both, and a value marshal refuses falls back to a JSON line. Read back,
by index or in order, every record equals what was stored."""
import collections
import enum
import json

import numpy as np

from ampdoctor.records import CallEvent, ModuleCall, StepRecord, TensorStats
from ampdoctor.record import storage
from ampdoctor.record.storage import StepStore


def _rec(step: int, extra=None) -> StepRecord:
    s = TensorStats(dtype="float16", ref="float16", numel=4, absmax=1.5, min_nonzero=2.0 ** -20, subnormal=1)
    ev = CallEvent(kind="step", step=step, index=step, file="train.py", line=7, extra=dict(extra or {}))
    return StepRecord(step=step, sampled=True, loss=0.5 + step, scale=65536.0, skipped=step % 3 == 0,
                      found_inf=step % 3 == 0, events=[ev],
                      modules=[ModuleCall(module="lin", type="Linear", call=0, seq=0, depth=1, out=s, gout=s)])


class _EveryOtherLine:
    """A run-dir writer that wrote every other record (a disk that filled up now and then)."""

    def append(self, rec):
        if rec.step % 2:
            return None
        return (json.dumps(dict(rec.to_dict(), run=0), separators=(",", ":")) + "\n").encode()


def test_mixed_spill_reads_back_equal():
    st = StepStore(hot=4)
    recs = [_rec(i) for i in range(40)]
    for r in recs:
        st.add(r, _EveryOtherLine())
    assert len(st._offsets) >= 30  # most spilled
    assert [r.to_dict() for r in st] == [r.to_dict() for r in recs]
    assert [st[i].to_dict() for i in (0, 1, 17, 22, 39)] == [recs[i].to_dict() for i in (0, 1, 17, 22, 39)]
    st._spill.seek(st._offsets[1])
    assert st._spill.read(1) == storage._MARSHAL   # no line for step 1: marshal
    st._spill.seek(st._offsets[2])
    assert st._spill.read(1) == b"{"               # step 2's run-dir line, as it was written


def test_value_marshal_refuses_spills_as_json():
    """A namedtuple in a call's details is no type marshal takes: that record spills as a JSON line."""
    point = collections.namedtuple("point", "x y")
    st = StepStore(hot=2)
    recs = [_rec(i, extra={"at": point(1, 2) if i == 1 else [1, 2]}) for i in range(6)]
    for r in recs:
        st.add(r)
    st._spill.seek(st._offsets[1])
    assert st._spill.read(1) == b"{"
    st._spill.seek(st._offsets[2])
    assert st._spill.read(1) == storage._MARSHAL
    back = list(st)
    assert [r.step for r in back] == list(range(6))
    assert back[1].events[0].extra["at"] == [1, 2] and back[3].to_dict() == recs[3].to_dict()


def test_numpy_and_enum_values_read_back_as_json_writes_them():
    """marshal writes an object with a buffer (numpy's float64) as its bytes: a record's values are built-in numbers
    and strings before any writer sees them (records.plain), so the spill reads back what the run directory holds."""
    class Mode(str, enum.Enum):
        FAST = "fast"

    st = StepStore(hot=1)
    recs = [_rec(i, extra={"max_norm": np.float64(0.5), "n": np.int64(3), "mode": Mode.FAST}) for i in range(3)]
    for r in recs:
        st.add(r)
    extra = st[0].events[0].extra
    assert extra == {"max_norm": 0.5, "n": 3, "mode": "fast"}
    assert [type(v) for v in extra.values()] == [float, int, str]
    assert extra == json.loads(json.dumps(recs[0].to_dict()))["events"][0]["extra"]
