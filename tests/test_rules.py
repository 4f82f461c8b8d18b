"""Rules are pure functions: each tested on hand-made records, without a model."""
import pytest

from ampdoctor.analysis import build_report
from ampdoctor.errors import BadInput
from ampdoctor.records import CallEvent, ModuleCall, ParamStat, Producer, RunMeta, StepRecord, TensorStats
from ampdoctor.rules import RULE_IDS, RULES, RuleConfig, RunData, register, run_rules


def ts(**kw):
    base = dict(dtype="float16", ref="float16", numel=100)
    base.update(kw)
    return TensorStats(**base)


def meta(scaler=True, params=None, env=None):
    return RunMeta(scaler={"enabled": True, "init_scale": 65536.0} if scaler else {},
                   params=params or [["fc.weight", "fc", "float32", 10, True]], env=env or {})


def ev(kind, step, i, **kw):
    return CallEvent(kind=kind, step=step, index=i, file="train.py", line=10 + i, **kw)


def rules_of(steps, m=None, **cfg):
    return [(f.rule, f.severity, f.module) for f in run_rules(RunData(m or meta(), steps), RuleConfig(**cfg))]


def test_registry_rejects_duplicates_and_unknown_ids():
    with pytest.raises(RuntimeError, match="duplicate"):
        register("producers", emits=("overflow",))(lambda r, c: [])
    with pytest.raises(RuntimeError, match="unknown"):
        register("x-new", emits=("not_a_rule",))(lambda r, c: [])
    with pytest.raises(BadInput, match="unknown rule"):
        RuleConfig(only=("nope",))
    emitted = {e for emits, _ in RULES.values() for e in emits}
    # every contract id is emitted by a registered rule, except those only replay (or the recorder) emits
    replay_only = {"precision_loss", "replay_error", "headroom_trend"}
    assert set(RULE_IDS) - emitted <= replay_only, set(RULE_IDS) - emitted - replay_only


def test_forward_producer_is_error_and_named():
    calls = [ModuleCall("blk", "Block", 0, 0, 1, inp=ts(), out=ts(posinf=3)),
             ModuleCall("blk.fc", "Linear", 0, 1, 2, inp=ts(), out=ts(posinf=3))]
    r = StepRecord(0, sampled=True, loss_finite=False, skipped=True, modules=calls,
                   forward_producer=Producer("blk.fc", 0, "forward", "inf"))
    got = rules_of([r])
    assert ("overflow", "error", "blk.fc") in got


def test_backward_overflow_in_first_steps_is_info_when_run_recovers():
    def rec(step, skipped):
        return StepRecord(step, sampled=True, loss=1.0, loss_finite=True, scale=65536.0 / 2 ** step,
                          skipped=skipped, found_inf=skipped,
                          backward_producer=Producer("head", 0, "backward", "inf") if skipped else None,
                          modules=[ModuleCall("head", "Linear", 0, 0, 1, inp=ts(), out=ts(), gout=ts(),
                                              gin=ts(posinf=1))])
    steps = [rec(0, True), rec(1, True), rec(2, False), rec(3, False)]
    sev = {(r, m): s for r, s, m in rules_of(steps)}
    assert sev[("overflow", "head")] == "info"
    assert sev[("skipped_steps", None)] == "info"
    assert "error" not in sev.values() and "warning" not in sev.values()
    # the same overflow on every step up to the end is not benign
    persistent = [rec(i, True) for i in range(12)]
    got = rules_of(persistent)
    assert ("overflow", "error", "head") in got and ("loss_scale_collapse", "error", "head") in got


def test_loss_scale_collapse_ranked_after_its_cause():
    steps = [StepRecord(i, sampled=i == 0, loss=float("nan"), loss_finite=False, scale=65536.0 / 2 ** i,
                        skipped=True, found_inf=True,
                        forward_producer=Producer("attn", 0, "forward", "nan") if i == 0 else None,
                        modules=[ModuleCall("attn", "Attn", 0, 0, 1, inp=ts(), out=ts(nan=4))] if i == 0 else [])
             for i in range(20)]
    rep = build_report(meta(), steps)
    assert [f.rule for f in rep.findings[:2]] == ["nan_origin", "loss_scale_collapse"]


def test_clip_before_unscale_from_events():
    r = StepRecord(0, scale=4096.0, events=[ev("scale", 0, 0), ev("clip_grad_norm_", 0, 1, stage="READY", scaled=True,
                                                                   total_norm=4096.0 * 3),
                                            ev("step", 0, 2, stage="READY"), ev("update", 0, 3)])
    rep = build_report(meta(), [r])
    f = rep.findings[0]
    assert f.rule == "clip_before_unscale" and f.severity == "error"
    assert f.evidence["norm_unscaled_estimate"] == 3.0 and f.evidence["line"] == 11


@pytest.mark.parametrize("events,rule", [
    ([("scale", {}), ("update", {"error": "AssertionError: No inf checks were recorded prior to update."})],
     "scaler_misorder"),
    ([("scale", {}), ("unscale_", {}), ("unscale_", {"error": "RuntimeError: unscale_() has already been called "
                                                               "on this optimizer since the last update()."})],
     "scaler_misorder"),
    ([("scale", {}), ("unscale_", {}), ("zero_grad", {}), ("scale", {}),
      ("unscale_", {"error": "RuntimeError: unscale_() has already been called on this optimizer since the last "
                             "update()."})], "missing_scaler_update"),
    ([("scale", {}), ("step", {}), ("zero_grad", {}), ("scale", {}),
      ("step", {"error": "RuntimeError: step() has already been called since the last update()."})],
     "missing_scaler_update"),
    ([("scale", {}), ("optimizer.step", {"scaled": True}), ("update", {})], "scaler_misorder"),
])
def test_call_order_rules(events, rule):
    r = StepRecord(0, events=[ev(k, 0, i, **kw) for i, (k, kw) in enumerate(events)])
    got = rules_of([r])
    assert got and got[0][0] == rule, got


def test_update_underflow_and_master_weights():
    m = meta(scaler=False, params=[["fc.weight", "fc", "float16", 16, True], ["fc.bias", "fc", "float16", 1, True]])
    r = StepRecord(0, sampled=True, params=[ParamStat("fc.weight", "fc", "float16", 16, update_sampled=16,
                                                      update_rounded_away=16)])
    got = rules_of([r], m)
    assert ("update_underflow", "error", "fc") in got
    # without a scaler the fp16 parameters are an error once their updates round away (their cause, ranked first)
    assert ("fp16_master_weights", "error", "fc") in got
    fine = StepRecord(0, sampled=True, params=[ParamStat("fc.weight", "fc", "float16", 16, update_sampled=16,
                                                         update_rounded_away=0)])
    assert ("fp16_master_weights", "warning", "fc") in rules_of([fine], m)  # a risk while they still move


def test_underflow_needs_subnormals_not_zeros():
    relu_zeros = ModuleCall("act", "ReLU", 0, 0, 1, inp=ts(), out=ts(zeros=90), gout=ts(zeros=90))
    assert rules_of([StepRecord(0, sampled=True, modules=[relu_zeros])], meta(scaler=False)) == []
    tiny = ModuleCall("head", "Linear", 0, 0, 1, inp=ts(), out=ts(), gout=ts(zeros=40, subnormal=60), bseq=0)
    assert ("underflow", "error", "head") in rules_of([StepRecord(0, sampled=True, modules=[tiny])], meta(False))


def test_overflow_risk_warns_below_one_bit_of_headroom():
    near = ModuleCall("ff", "Linear", 0, 0, 1, inp=ts(), out=ts(absmax=40000.0, near_max=3))
    ok = ModuleCall("ff2", "Linear", 0, 1, 1, inp=ts(), out=ts(absmax=20000.0))
    got = rules_of([StepRecord(0, sampled=True, modules=[near, ok])])
    assert got == [("overflow_risk", "warning", "ff")]


def test_fp32_values_beyond_fp16_warn_only_when_a_later_module_takes_them():
    """Under fp16 autocast an fp32 output above 65504 overflows only if it is cast down, i.e. fed to another
    module; a loss computed in fp32 is not."""
    big = dict(dtype="float32", ref="float16", absmax=8e5, overflow_as_ref=5)
    loss = ModuleCall("crit", "SumLoss", 0, 0, 1, inp=ts(), out=ts(**big))
    assert rules_of([StepRecord(0, sampled=True, modules=[loss])]) == []
    norm = ModuleCall("ln", "LayerNorm", 0, 0, 1, inp=ts(), out=ts(**big))
    ff = ModuleCall("ff", "Linear", 0, 1, 1, inp=ts(**big), out=ts(absmax=100.0))
    assert rules_of([StepRecord(0, sampled=True, modules=[norm, ff])]) == [("overflow_risk", "warning", "ln")]


def test_env_tf32_on_pre_ampere_gpu():
    env = {"device": "Tesla V100", "compute_capability": [7, 0], "allow_tf32_matmul": True,
           "float32_matmul_precision": "high"}
    got = rules_of([StepRecord(0)], meta(env=env))
    assert ("env_tf32", "warning", None) in got
    assert rules_of([StepRecord(0)], meta(env={"compute_capability": [9, 0], "allow_tf32_matmul": True})) == []


def test_healthy_records_give_nothing():
    calls = [ModuleCall("fc", "Linear", 0, 0, 1, inp=ts(), out=ts(absmax=3.0), gout=ts(absmax=100.0), gin=ts())]
    steps = [StepRecord(i, sampled=True, loss=1.0, loss_finite=True, scale=65536.0, found_inf=False, modules=calls,
                        events=[ev("scale", i, 0), ev("unscale_", i, 1, stage="READY"),
                                ev("clip_grad_norm_", i, 2, stage="UNSCALED", scaled=False),
                                ev("step", i, 3, stage="UNSCALED"), ev("update", i, 4)]) for i in range(5)]
    assert build_report(meta(), steps).findings == []


def test_forward_underflow_is_a_warning_with_a_runnable_fix():
    tiny = ModuleCall("scale_down", "Linear", 0, 0, 1, inp=ts(), out=ts(subnormal=80), autocast="cpu:float16")
    rep = build_report(meta(), [StepRecord(0, sampled=True, autocast="cpu:float16", modules=[tiny])])
    f = rep.findings[0]
    assert (f.rule, f.severity, f.phase, f.module) == ("underflow", "warning", "forward", "scale_down")
    assert 'device_type="cpu"' in f.fix
