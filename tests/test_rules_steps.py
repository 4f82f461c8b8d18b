"""One definition per idea (rules/steps.py, Finding.sort_key, summary), and the rules of issue 13 on hand-made
records: -inf from a Linear is an overflow, a finding's step is the first bad step, overflow_risk only where a
low-precision op sees the value, update_spike, deprecated_api, crash and wording."""
import pytest

from ampdoctor.analysis import build_report, rank
from ampdoctor.doctor import check_deepspeed
from ampdoctor.env import deprecated_amp_in_use
from ampdoctor.findings import Finding
from ampdoctor.record.producers import forward_producer
from ampdoctor.records import CallEvent, ModuleCall, ParamStat, Producer, RunMeta, StepRecord, TensorStats
from ampdoctor.rules import RuleConfig, RunData, run_rules
from ampdoctor.rules.scaler import ranks_diverged
from ampdoctor.rules.backoff import benign_backoff
from ampdoctor.rules.steps import first_bad_step, onset_step, parents


def ts(**kw):
    return TensorStats(**dict(dict(dtype="float16", ref="float16", numel=100), **kw))


def meta(scaler=True, **kw):
    return RunMeta(scaler={"enabled": True, "init_scale": 65536.0, "backoff_factor": 0.5} if scaler else {},
                   params=[["fc.weight", "fc", "float32", 10, True]], **kw)


def skip(step, scale=65536.0, **kw):
    return StepRecord(step, **dict(dict(loss=1.0, loss_finite=True, scale=scale, found_inf=True, skipped=True,
                                        grad_finite=False), **kw))


def ok(step, scale=65536.0, **kw):
    return StepRecord(step, **dict(dict(loss=1.0, loss_finite=True, scale=scale, found_inf=False,
                                        grad_finite=True), **kw))


def got(steps, m=None, **cfg):
    return [(f.rule, f.severity, f.module) for f in run_rules(RunData(m or meta(), steps), RuleConfig(**cfg))]


# --- one definition of benign backoff, bad step, finding order ------------------------------------------------

def test_benign_backoff_is_the_scalers_search_and_nothing_else():
    early = [skip(0), skip(1, 32768.0), ok(2, 16384.0), ok(3, 16384.0)]
    assert benign_backoff(early, True) == {0, 1}
    assert benign_backoff(early, False) == set()  # no scaler: a skipped step is not its search
    assert benign_backoff([skip(i, 65536.0 / 2 ** i) for i in range(10)], True) == set()  # a collapse
    assert benign_backoff([skip(0, 0.5), ok(1, 0.5)], True) == set()   # the scale is already below 1
    nan = [skip(0, loss_finite=False, loss=float("nan")), ok(1)]
    assert benign_backoff(nan, True) == set()                           # the forward itself was bad
    rare_later = [ok(i) for i in range(20)] + [skip(20)] + [ok(i) for i in range(21, 40)]
    assert benign_backoff(rare_later, True) == {20}
    steady = [skip(i) if i % 3 == 0 and i else ok(i) for i in range(40)]
    assert benign_backoff(steady, True) == set()                        # a rate: the skipped_steps rule's


def test_a_search_whose_overflow_turned_into_nan_is_still_benign_once_an_update_lands():
    """At a loss scale of 2**24 a GPT-2's backward overflows and LayerNorm's backward turns the inf into NaN: the
    backward 'makes NaN' on every skipped step, yet the scaler finds a working scale after six halvings."""
    nan = Producer(module="transformer.ln_f", call=0, phase="backward", kind="nan")
    search = [skip(i, 2.0 ** (24 - i), backward_producer=nan) for i in range(6)]
    assert benign_backoff(search + [ok(6, 2.0 ** 18)], True) == set(range(6))
    assert benign_backoff(search, True) == set()                        # never resolved: not the scale's doing


def test_a_backoff_right_before_a_forward_failure_stays_benign():
    """Step 0 skipped for the scale (the shared first_step_overflow_benign case), step 1 a batch that overflows
    the forward: step 0 is the search, step 1 the failure (DDP test: rank 1's batch x 1e6 at step 1)."""
    run = [skip(0), skip(1, 32768.0, loss_finite=False, loss=float("inf")), ok(2, 16384.0), ok(3, 16384.0)]
    assert benign_backoff(run, True) == {0}
    assert first_bad_step(run, True) == 1


def test_first_bad_step_skips_the_early_backoff_and_a_mask():
    """issue 18: a benign backoff at step 0, the real failure at step 4."""
    mask = Producer("mask", 0, "forward", "inf", detail={"mask_like": True})
    steps = [skip(0), ok(1, 32768.0, forward_producer=mask), ok(2, 32768.0), ok(3, 32768.0),
             StepRecord(4, loss=float("inf"), loss_finite=False, scale=32768.0, skipped=True, found_inf=True)]
    assert first_bad_step(steps, True) == 4
    assert not steps[1].bad and steps[4].bad and steps[0].bad  # records: a mask alone is not bad
    rep = build_report(meta(), steps)
    assert rep.summary["first_bad_step"] == 4 and rep.summary["bad_steps"] == 1
    assert rep.summary["benign_backoff_steps"] == [0]
    assert [r["bad"] for r in rep.data["timeline"]] == [False, False, False, False, True]
    healthy = build_report(meta(), steps[:4])
    assert healthy.summary["first_bad_step"] is None and healthy.summary["verdict"].startswith("Healthy")
    assert "backoff" in healthy.summary["verdict"] and healthy.exit_code == 0


def test_one_finding_order():
    def f(sev, hint, step):
        return Finding("overflow", sev, "forward", "m", None, step, "", "", {"rank_hint": hint})
    a, b, c, d = f("error", 12, 0), f("error", 10, 5), f("warning", 0, 0), f("error", 40, 0)
    assert rank([d, c, b, a]) == [a, b, d, c] == sorted([c, d, a, b], key=Finding.sort_key)


def test_the_step_of_a_finding_is_the_first_bad_step():
    """issue 13.5: step 1 went bad unsampled (only the trip-wire saw it); sampled step 2 located it."""
    calls = [ModuleCall("fc", "Linear", 0, 0, 1, inp=ts(), out=ts(posinf=3))]
    steps = [ok(0, sampled=True), StepRecord(1, loss=float("inf"), loss_finite=False),
             StepRecord(2, sampled=True, loss=float("inf"), loss_finite=False, modules=calls,
                        forward_producer=Producer("fc", 0, "forward", "inf"))]
    assert onset_step(steps, 2, "forward") == 1 and onset_step(steps, 2, "backward") == 2
    f = next(f for f in run_rules(RunData(meta(False), steps)) if f.rule == "overflow")
    assert (f.module, f.step, f.evidence["observed_step"]) == ("fc", 1, 2)
    assert "+inf" in f.message and "step 1" in f.message


# --- producers: an overflow to -inf is not a mask ---------------------------------------------------------

def test_minus_inf_from_a_linear_is_an_overflow_not_a_mask():
    """issue 13.4: c_fc overflows only to -inf; GELU turns it into NaN; the MLP outputs NaN."""
    calls = [ModuleCall("mlp", "MLP", 0, 0, 1, inp=ts(), out=ts(nan=50)),
             ModuleCall("mlp.c_fc", "Linear", 0, 1, 2, inp=ts(absmax=3.0),
                        par=TensorStats("weights", "weights", 10),
                        out=ts(neginf=40, absmax=6.4e4, near_max=5)),
             ModuleCall("mlp.gelu", "GELU", 0, 2, 2, inp=ts(neginf=40, absmax=6.4e4), out=ts(nan=40))]
    p = forward_producer(calls, parents(calls))
    assert (p.module, p.kind, p.detail["mask_like"]) == ("mlp.c_fc", "inf", False)
    r = StepRecord(0, sampled=True, loss=float("nan"), loss_finite=False, modules=calls, forward_producer=p)
    f = run_rules(RunData(meta(False), [r]))[0]
    assert (f.rule, f.severity, f.module) == ("overflow", "error", "mlp.c_fc") and "-inf" in f.message


def test_a_mask_module_stays_a_mask():
    calls = [ModuleCall("attn", "Attn", 0, 0, 1, inp=ts(), out=ts(nan=4)),
             ModuleCall("attn.mask", "CausalMask", 0, 1, 2, inp=ts(), out=ts(neginf=15, absmax=0.0))]
    p = forward_producer(calls, parents(calls))
    assert p.module == "attn" and p.kind == "nan"  # a fully masked row: the softmax's NaN, not the mask
    only = [ModuleCall("attn.mask", "CausalMask", 0, 0, 1, inp=ts(), out=ts(neginf=15, absmax=0.0))]
    assert forward_producer(only, parents(only)).detail["mask_like"] is True


# --- overflow_risk: only where a low-precision op sees the value, once per chain --------------------------

def test_fp32_residual_that_only_enters_layernorm_is_not_at_risk():
    big = dict(dtype="float32", ref="float16", absmax=7e4, overflow_as_ref=5, near_max=9)
    calls = [ModuleCall("h.0", "Block", 0, 0, 1, inp=ts(dtype="float32", absmax=10.0), out=ts(**big)),
             ModuleCall("h.0.mlp", "MLP", 0, 1, 2, inp=ts(), out=ts(absmax=7e4 - 5, near_max=9)),
             ModuleCall("h.1", "Block", 0, 2, 1, inp=ts(**big), out=ts(**big)),
             ModuleCall("h.1.ln_1", "LayerNorm", 0, 3, 2, inp=ts(**big), out=ts(dtype="float32", absmax=4.0))]
    assert [g for g in got([ok(0, sampled=True, modules=calls)]) if g[0] == "overflow_risk"] == \
        [("overflow_risk", "warning", "h.0.mlp")]  # the fp16 MLP output is; the fp32 residual is not
    calls[1].out = ts(absmax=100.0)
    assert not [g for g in got([ok(0, sampled=True, modules=calls)]) if g[0] == "overflow_risk"]


def test_overflow_risk_once_per_chain_at_the_producer():
    """T5 after the fix: wo, DenseReluDense, dropout, T5LayerFF, T5Block all carry the value: one finding."""
    near = dict(absmax=5e4, near_max=7)
    calls = [ModuleCall("block", "T5Block", 0, 0, 1, inp=ts(absmax=30.0), out=ts(**near)),
             ModuleCall("block.ff", "T5LayerFF", 0, 1, 2, inp=ts(absmax=30.0), out=ts(**near)),
             ModuleCall("block.ff.drd", "DenseReluDense", 0, 2, 3, inp=ts(absmax=3.0), out=ts(**near)),
             ModuleCall("block.ff.drd.wi", "Linear", 0, 3, 4, inp=ts(absmax=3.0), out=ts(absmax=300.0)),
             ModuleCall("block.ff.drd.wo", "Linear", 0, 4, 4, inp=ts(absmax=300.0), out=ts(**near)),
             ModuleCall("block.ff.dropout", "Dropout", 0, 5, 3, inp=ts(**near), out=ts(**near))]
    fs = [f for f in run_rules(RunData(meta(), [ok(0, sampled=True, modules=calls)])) if f.rule == "overflow_risk"]
    assert [f.module for f in fs] == ["block.ff.drd.wo"]
    assert "bits below" in fs[0].message and "-0." not in fs[0].message


# --- update_spike ----------------------------------------------------------------------------------------

def _ps(name, before, after, numel=100, lr=None):
    return ParamStat(name, name.rpartition(".")[0], "float32", numel, weight_norm=before, weight_norm_after=after,
                     lr=lr)


def test_update_spike_one_update_and_between_sampled_steps():
    m = meta(optimizer={"class": "AdamW", "groups": [{"lr": 10.0}]})
    calls = [CallEvent("scale", 0, 0), CallEvent("step", 0, 1), CallEvent("update", 0, 2)]  # (a sampled step: no clip call)
    lr10 = [ok(0, sampled=True, params=[_ps("fc.weight", 1.0, 100.0), _ps("fc.bias", 0.0, 0.1)], events=calls),
            StepRecord(1, loss=float("inf"), loss_finite=False, skipped=True)]
    fs = [f for f in run_rules(RunData(m, lr10)) if f.rule == "update_spike"]
    assert [(f.severity, f.module, f.step) for f in fs] == [("error", "fc", 0)]
    assert fs[0].evidence["factor"] == pytest.approx(100.0) and "lr=10" in fs[0].message
    assert "warmup" in fs[0].message and fs[0].evidence["clipping"] == "off"
    # a record kept without its calls (a routine step, thinned): its clipping is not known, and not called off; the
    # update's own lr (a routine update check's ParamStat.lr: a scheduler raised it) is the one quoted
    thinned = [ok(0, sampled=True, params=[_ps("fc.weight", 1.0, 100.0, lr=20.0)]),
               StepRecord(1, loss=float("inf"), loss_finite=False, skipped=True)]
    f = next(f for f in run_rules(RunData(m, thinned)) if f.rule == "update_spike")
    assert f.evidence["clipping"] == "unknown" and "clipping" not in f.message, f.message
    assert f.evidence["lr"] == 20.0 and "lr=20" in f.message, f.message
    healthy = [ok(i, sampled=True, params=[_ps("fc.weight", 1.0 + i * 1e-3, 1.0 + (i + 1) * 1e-3),
                                           _ps("fc.bias", 0.0 if i == 0 else 1e-3 * i, 1e-3 * (i + 1))])
               for i in range(5)]
    assert not [g for g in got(healthy, m) if g[0] == "update_spike"]
    # a spike between two sampled steps (unsampled updates in between): named, with the window
    window = [ok(0, sampled=True, params=[_ps("fc.weight", 1.0, 1.0)]), ok(1), ok(2),
              ok(3, sampled=True, params=[_ps("fc.weight", 50.0, 50.0)])]
    f = next(f for f in run_rules(RunData(m, window)) if f.rule == "update_spike")
    assert f.severity == "warning" and f.evidence["between_steps"] == [0, 3] and f.evidence["updates"] == 2
    # a jump no Adam update can make (x1e5 at lr 1e-3 over two updates): made outside the optimizer (issue 18's
    # injected weights x1e6), not an update spike
    small_lr = meta(optimizer={"class": "AdamW", "groups": [{"lr": 1e-3}]})
    jump = [ok(0, sampled=True, params=[_ps("fc.weight", 1.0, 1.0)]), ok(1), ok(2),
            ok(3, sampled=True, params=[_ps("fc.weight", 1e5, 1e5)])]
    assert not [f for f in run_rules(RunData(small_lr, jump)) if f.rule == "update_spike"]


# --- scaler: the scale after the last update; ranks; doctor -------------------------------------------------

def test_collapse_reports_the_scale_after_the_last_update():
    steps = [skip(i, 65536.0 / 2 ** i) for i in range(12)]
    f = next(f for f in run_rules(RunData(meta(), steps)) if f.rule == "loss_scale_collapse")
    assert f.evidence["last_scale"] == 65536.0 / 2 ** 12 and "to 16" in f.message


def test_rank_divergence_is_a_rule_function():
    a, b = [ok(0), ok(1)], [ok(0), skip(1)]
    fs = ranks_diverged({0: a, 1: b})
    assert [(f.rule, f.step) for f in fs] == [("scaler_misorder", 1)] and ranks_diverged({0: a, 1: a}) == []


def test_doctor_rule_ids_are_chosen_not_read_from_the_message():
    fs = check_deepspeed({"fp16": {"enabled": True, "hysteresis": 20}})
    assert [(f.rule, f.severity) for f in fs] == [("loss_scale_collapse", "info")]


# --- deprecated_api, crash, wording --------------------------------------------------------------------------

def test_deprecated_amp_apis_are_their_own_rule():
    src = "scaler = torch.cuda.amp.GradScaler()\nwith torch.cuda.amp.autocast():\n    pass\n" \
          "model, opt = amp.initialize(model, opt, opt_level='O1')\n# torch.cpu.amp.autocast in a comment\n"
    names = deprecated_amp_in_use(None, source=src)
    assert names == ["torch.cuda.amp.autocast", "torch.cuda.amp.GradScaler", "apex.amp.initialize"]
    fs = run_rules(RunData(meta(env={"deprecated_amp": names}), [ok(0)]))
    assert [(f.rule, f.severity) for f in fs] == [("deprecated_api", "info")] * 3
    assert "torch.autocast(\"cuda\"" in fs[0].fix
    assert deprecated_amp_in_use(None, source="with torch.autocast('cuda'):\n") == []


def test_a_crash_is_in_the_summary_the_verdict_and_the_exit_code():
    e = {"module": "attn", "type": "RuntimeError", "message": "expected scalar type Half but found Float",
         "file": "train.py", "line": 12, "autocast": "cuda:float16"}
    rep = build_report(meta(), [ok(0), StepRecord(1, exception=e)])
    assert rep.summary["crash"] == {"step": 1, "type": "RuntimeError", "message": e["message"], "module": "attn",
                                    "file": "train.py", "line": 12}
    assert rep.summary["verdict"].startswith("Crashed at step 1: RuntimeError: expected scalar type Half")
    assert "`attn`" in rep.summary["verdict"] and rep.summary["errors"] >= 1 and rep.exit_code == 1
    assert rep.summary["first_bad_step"] == 1
    empty = build_report(meta(), [])
    assert not empty.summary["verdict"].startswith("Healthy") and "No training step" in empty.summary["verdict"]


def test_root_module_is_named_root_in_messages():
    calls = [ModuleCall("", "Net", 0, 0, 0, inp=ts(), out=ts(nan=3))]
    r = StepRecord(0, sampled=True, loss=float("nan"), loss_finite=False, modules=calls,
                   forward_producer=Producer("", 0, "forward", "nan"))
    f = run_rules(RunData(meta(False), [r]))[0]
    assert "`(root)`" in f.message and "``" not in f.message and "NaN" in f.message and "±inf" not in f.message
    assert "at (root)" in f.one_line()


def test_rule_fix_snippets_are_python_for_numbered_modules():
    """The watch's own findings use the one fp32 snippet (ampdoctor/fixes.py): a numbered child compiles."""
    import torch
    import torch.nn as nn
    import ampdoctor
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        m[2].weight.mul_(1e5)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with ampdoctor.watch(m, optimizer=opt, every=1) as w:
        with torch.autocast("cpu", dtype=torch.float16):
            m(torch.randn(3, 4) * 100).float().sum().backward()
        opt.step()
    f = next(f for f in w.report(replay=False).findings if f.rule == "overflow")
    assert f.module == "2"
    code = f.fix[f.fix.index("with torch.autocast"):].split("\nRun ")[0]
    compile(code, "<fix>", "exec")
    assert "self[2](x.float())" in code
