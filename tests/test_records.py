

def test_step_record_to_dict_equals_asdict_and_shares_nothing():
    """StepRecord.to_dict is asdict without its slow deep copy: the same dict, and no mutable part shared."""
    import dataclasses
    from ampdoctor.records import CallEvent, ModuleCall, Producer, ParamStat, StepRecord, TensorStats
    ts = TensorStats(dtype="float16", ref="float16", numel=4, absmax=3.0)
    rec = StepRecord(step=3, sampled=True, loss=1.5, forward_producer=Producer(module="a", call=0, phase="forward", kind="inf"),
                     modules=[ModuleCall(module="a", type="Linear", call=0, seq=0, depth=1, out=ts)],
                     params=[ParamStat(name="a.weight", module="a", dtype="float32", numel=4)],
                     events=[CallEvent(kind="step", step=3, index=0, detail={"opt": 0})],
                     exception={"type": "RuntimeError", "message": "x"},
                     headroom={"fwd": [1.0, None], "bwd": [2.0, float("inf")], "dtype": "h-"})
    d = rec.to_dict()
    assert d == dataclasses.asdict(rec)
    d["headroom"]["fwd"][0] = 99.0
    d["exception"]["type"] = "changed"
    d["events"][0]["detail"]["opt"] = 5
    assert rec.headroom["fwd"][0] == 1.0 and rec.exception["type"] == "RuntimeError"
    assert rec.events[0].detail["opt"] == 0
    assert StepRecord.from_dict(rec.to_dict()) == rec
