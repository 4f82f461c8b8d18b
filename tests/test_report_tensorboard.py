"""TensorBoard reporter: scalars written live or after the fact, read back with TensorBoard's own reader."""
from __future__ import annotations

import math

import pytest

import report_samples as rs
from ampdoctor.report.tensorboard import TensorBoardSink, step_scalars, write_tensorboard


def _read(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_write_tensorboard_round_trip(tmp_path):
    meta, recs = rs.step_records(n_steps=6, bad_step=4)
    assert write_tensorboard(meta, recs, tmp_path) == str(tmp_path)
    s = _read(tmp_path)
    assert s["ampdoctor/loss_scale"] == {0: 65536.0, 1: 65536.0, 2: 65536.0, 3: 65536.0, 4: 65536.0, 5: 32768.0}
    assert s["ampdoctor/skipped"] == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 0.0}
    assert s["ampdoctor/loss"][3] == pytest.approx(1.7) and math.isnan(s["ampdoctor/loss"][4])
    assert math.isinf(s["ampdoctor/grad_norm_total"][4])
    # per-module values only on sampled steps (0, 2, 4): step 4 is the bad one and is sampled too
    assert sorted(s["absmax/fc1"]) == [0, 2, 4]
    assert s["absmax/fc1"][0] == 2048.0                          # max over the module's two calls
    assert s["headroom_bits/fc1"][0] == pytest.approx(math.log2(65504 / 2048))
    assert s["headroom_bits/fc2"][4] == pytest.approx(math.log2(65504 / 2 ** 15))
    assert s["nonfinite/fc2"][4] == 5.0
    # underflow share = subnormal / nonzero finite, pooled over calls: 180 / (2000 - 200 - 5)
    assert s["underflow_share/fc2"][4] == pytest.approx(180 / 1795, rel=1e-5)
    assert s["underflow_share/fc1"][0] == 0.0
    assert s["grad_norm/fc2.weight"][2] == pytest.approx(2.5)
    assert sorted(s["grad_norm/fc1.weight"]) == [0, 2, 4]


class _FakeWriter:
    def __init__(self):
        self.calls, self.flushed, self.closed = [], 0, False

    def add_scalar(self, tag, value, global_step=None):
        self.calls.append((tag, value, global_step))

    def flush(self):
        self.flushed += 1

    def close(self):
        self.closed = True


def test_sink_with_user_writer_is_not_closed():
    meta, recs = rs.step_records()
    w = _FakeWriter()
    sink = TensorBoardSink(writer=w)
    sink.on_step(meta, recs[1])                                   # unsampled: run-level scalars only
    assert {t for t, _, _ in w.calls} == {"ampdoctor/loss_scale", "ampdoctor/skipped", "ampdoctor/loss",
                                          "ampdoctor/grad_norm_total"}
    assert all(step == 1 for _, _, step in w.calls)
    sink.close()
    sink.close()                                                  # idempotent
    assert w.flushed == 1 and not w.closed
    with pytest.raises(RuntimeError, match="after close"):
        sink.on_step(meta, recs[2])


def test_live_sink_owns_its_writer(tmp_path):
    meta, recs = rs.step_records()
    with TensorBoardSink(tmp_path / "tb") as sink:
        for r in recs[:3]:
            sink.on_step(meta, r)
    assert sorted(_read(tmp_path / "tb")["absmax/fc2"]) == [0, 2]


def test_step_scalars_skip_missing_values():
    from ampdoctor.records import StepRecord
    assert step_scalars(StepRecord(step=0)) == {"ampdoctor/skipped": 0.0}
