

def test_step_record_to_dict_equals_asdict_and_shares_nothing():
    """StepRecord.to_dict is asdict without its slow deep copy: the same dict, and no mutable part shared."""
    import dataclasses
    from ampdoctor.records import CallEvent, ModuleCall, Producer, ParamStat, StepRecord, TensorStats
    ts = TensorStats(dtype="float16", ref="float16", numel=4, absmax=3.0)
    rec = StepRecord(step=3, sampled=True, loss=1.5, forward_producer=Producer(module="a", call=0, phase="forward", kind="inf"),
                     modules=[ModuleCall(module="a", type="Linear", call=0, seq=0, depth=1, out=ts)],
                     params=[ParamStat(name="a.weight", module="a", dtype="float32", numel=4)],
                     events=[CallEvent(kind="step", step=3, index=0, opt=0, extra={"boundary": True})],
                     exception={"type": "RuntimeError", "message": "x"},
                     headroom={"fwd": [1.0, None], "bwd": [2.0, float("inf")], "dtype": "h-"})
    d = rec.to_dict()
    assert d == dataclasses.asdict(rec)
    d["headroom"]["fwd"][0] = 99.0
    d["exception"]["type"] = "changed"
    d["events"][0]["extra"]["boundary"] = False
    assert rec.headroom["fwd"][0] == 1.0 and rec.exception["type"] == "RuntimeError"
    assert rec.events[0].extra["boundary"] is True and rec.events[0].opt == 0
    assert StepRecord.from_dict(rec.to_dict()) == rec


def test_call_event_typed_fields_round_trip_and_old_detail_dicts_load_into_them():
    import json
    from ampdoctor.records import CallEvent, StepRecord
    evs = [CallEvent("unscale_", 2, 0, file="t.py", line=3, stage="READY", opt=1, internal=True),
           CallEvent("update", 2, 1, has_steps=True, new_scale=1024.0),
           CallEvent("clip_grad_norm_", 2, 2, stage="UNSCALED", total_norm=3.5),
           CallEvent("optimizer.step", 2, 3, scaled=False, via_scaler=True, fused=False, grads_scaled=True),
           CallEvent("engine.step", 2, 4, total_norm=2.0, extra={"boundary": True, "ds_scale": 256.0})]
    rec = StepRecord(step=2, events=evs)
    d = json.loads(json.dumps(rec.to_dict()))
    assert "detail" not in d["events"][0] and d["events"][0]["opt"] == 1 and d["events"][4]["extra"]["ds_scale"] == 256.0
    assert StepRecord.from_dict(d) == rec
    # written before the fields were typed: everything in one `detail` dict
    old = {"kind": "optimizer.step", "step": 7, "index": 4, "file": "train.py", "line": 9, "stage": "READY",
           "scaled": True, "error": None, "detail": {"opt": 0, "internal": True, "has_steps": False, "new_scale": 8.0,
                                                    "total_norm": 12.5, "grads_scaled": True, "via_scaler": False,
                                                    "fused": True, "boundary": True, "ds_scale": 64.0}}
    ev = StepRecord.from_dict({"step": 7, "events": [old]}).events[0]
    assert (ev.opt, ev.internal, ev.has_steps, ev.new_scale, ev.total_norm, ev.grads_scaled, ev.via_scaler,
            ev.fused) == (0, True, False, 8.0, 12.5, True, False, True)
    assert ev.extra == {"boundary": True, "ds_scale": 64.0} and (ev.kind, ev.stage, ev.scaled) == ("optimizer.step",
                                                                                                 "READY", True)
    assert CallEvent.from_dict(ev.to_dict()) == ev
    assert CallEvent.from_dict({"kind": "step", "step": 0, "index": 0, "detail": {}}) == CallEvent("step", 0, 0)
    assert old["detail"]["opt"] == 0 and "extra" not in old  # the input dict is not changed


def test_call_event_has_no_untyped_detail():
    """Issue 19: no untyped dict rides in CallEvent; readers use the typed fields (free-form DeepSpeed facts are
    `extra`)."""
    from ampdoctor.records import CallEvent
    ev = CallEvent("unscale_", 0, 0, opt=0, internal=True, extra={"boundary": False})
    assert not hasattr(ev, "detail") and ev.internal is True and ev.opt == 0


def test_a_clips_norm_reaches_its_event_as_a_number_and_no_tensor_rides_in_the_record(tmp_path):
    import torch
    import ampdoctor
    from ampdoctor.rundir import read_run
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path, every=1)
    returned = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        sc.scale(loss).backward()  # no unscale_ of the user's: scaler.step() makes its own (an internal event)
        returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        sc.step(opt)
        sc.update()
    w.close()
    for steps in (list(w.steps), read_run(str(tmp_path))[1]):
        clips = [e for r in steps for e in r.events if e.kind == "clip_grad_norm_"]
        assert [e.total_norm for e in clips] == pytest_approx(returned)
        assert all(isinstance(v, (int, float, str, bool, type(None), dict)) for e in clips
                   for v in vars(e).values())
        internal = [e for r in steps for e in r.events if e.internal]
        assert internal and all(e.kind == "unscale_" for e in internal)  # the unscale_ inside scaler.step
        assert all(e.via_scaler for r in steps for e in r.events if e.kind == "optimizer.step")


def pytest_approx(xs):
    import pytest
    return pytest.approx(xs, rel=1e-6)


def test_the_objects_made_every_step_with_many_fields_have_slots():
    """The open step (81 fields) and its StepRecord (33) are made on every step, right after the training step has
    emptied the CPU's caches: as plain instances, Python gives objects of more than 30 attributes a dict of their
    own, grown as each field is set (measured in a nanoGPT-style CPU loop: 22 and 32 us a step; with slots 6 and 4)."""
    import dataclasses
    from ampdoctor.record.openstep import _Step
    from ampdoctor.records import StepRecord
    for cls in (_Step, StepRecord):
        assert len(dataclasses.fields(cls)) > 30 and "__slots__" in vars(cls), cls
        assert not hasattr(cls(step=0, sampled=False), "__dict__"), cls
