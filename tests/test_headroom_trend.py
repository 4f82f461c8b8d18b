"""The headroom_trend rule (ampdoctor/rules/headroom.py): on hand-made series, and on a real nanoGPT-style run
(benchmarks/realworld/nanogpt.py, fp16 + GradScaler, CPU) where one layer's weights grow by 15% per step."""
from __future__ import annotations

import math
import random

import pytest
import torch

import ampdoctor
from ampdoctor.records import RunMeta, StepRecord
from ampdoctor.rules import RuleConfig, RunData
from ampdoctor.rules.headroom import headroom_trend

MODS = [["", "Net", 0], ["blk", "Block", 1], ["blk.fc", "Linear", 2], ["blk.act", "GELU", 2],
        ["blk.proj", "Linear", 2], ["ln", "LayerNorm", 1]]


def run_of(values: dict[str, list[float]], dtype="h", scaler=True, scale=65536.0, losses=None):
    """Steps whose forward abs-max per module is given (other modules unmeasured), and their losses if given."""
    n = max(len(v) for v in values.values())
    steps = []
    for s in range(n):
        fwd = [values[m[0]][s] if m[0] in values else None for m in MODS]
        dts = "".join((dtype if m[0] != "ln" else "f") if m[0] in values else "-" for m in MODS)
        steps.append(StepRecord(step=s, scale=scale, loss=None if losses is None else losses[s],
                                headroom={"fwd": fwd, "bwd": [None] * len(MODS), "dtype": dts}))
    return RunData(RunMeta(modules=MODS, scaler={"enabled": True} if scaler else {}), steps)


def grow(start, factor, n, cap=math.inf):
    return [min(start * factor ** i, cap) for i in range(n)]


def test_steady_growth_warns_with_rate_and_forecast():
    vals = grow(300.0, 1.15, 40)   # 7.8 bits left, 0.2 bits/step: overflow near step 38
    f = headroom_trend(run_of({"blk.fc": vals}), RuleConfig())
    assert len(f) == 1 and f[0].rule == "headroom_trend" and f[0].module == "blk.fc"
    ev = f[0].evidence
    assert ev["rate_bits_per_step"] == pytest.approx(-math.log2(1.15), rel=0.05)
    first_inf = next(i for i, v in enumerate(vals) if v > 65504)
    assert abs(ev["forecast_step"] - first_inf) <= 2
    assert f[0].step <= first_inf - 10


def test_growth_that_settles_far_from_the_max_is_silent():
    vals = [min(1.0 * 1.05 ** i, 40.0) + 0.5 * (i % 3) for i in range(400)]  # the first hundreds of steps
    assert headroom_trend(run_of({"blk.fc": vals}), RuleConfig()) == []


def test_close_to_the_max_but_flat_is_silent():
    vals = [20000.0 * (1 + 0.05 * ((i * 7) % 5)) for i in range(100)]  # noisy, no trend
    assert headroom_trend(run_of({"blk.fc": vals}), RuleConfig()) == []


def test_fp32_values_are_not_judged():
    vals = grow(300.0, 1.15, 60)
    assert headroom_trend(run_of({"ln": vals}), RuleConfig()) == []
    assert headroom_trend(run_of({"blk.fc": vals}, dtype="f"), RuleConfig()) == []


def test_bf16_far_from_its_max_is_silent():
    assert headroom_trend(run_of({"blk.fc": grow(300.0, 1.15, 60)}, dtype="b"), RuleConfig()) == []


def noisy_bits(start_bits, rate, n, sd, seed=0):
    """Abs-max values on every step whose headroom (log2(65504 / v)) falls `rate` bits a step from `start_bits`
    under batch-to-batch noise of `sd` bits (normal, seeded)."""
    rng = random.Random(seed)
    return [65504.0 / 2.0 ** (start_bits - rate * i + rng.gauss(0.0, sd)) for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_slow_noisy_runaway_on_every_step_is_warned(seed):
    """A layer running out at 0.036 bits a step (x1.025) with 0.4 bits of batch noise, its series on every step
    (every=1, or the series dense while the layer creeps towards the max): over 12 points the trend falls by less
    than the noise, so the rule looks at the last LONG_SPAN steps too (test_early_warning3's annealed attention
    temperature, whose 12-point windows missed it at strides 1-16 on an AMD EPYC)."""
    vals = noisy_bits(8.0, 0.036, 260, 0.4, seed)
    first_inf = next(i for i, v in enumerate(vals) if v > 65504)
    f = headroom_trend(run_of({"blk.fc": vals[:first_inf + 1]}), RuleConfig())
    assert len(f) == 1 and f[0].module == "blk.fc", [x.one_line() for x in f]
    ev = f[0].evidence
    assert f[0].step <= first_inf - 10 and ev["forecast_step"] > f[0].step, (f[0].step, first_inf, ev)
    assert 0.5 * 0.036 <= -ev["rate_bits_per_step"] <= 2.0 * 0.036, ev


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_near_the_max_and_a_slow_drift_on_every_step_are_silent(seed):
    """The healthy twins of the runaway above, as noisy and on every step: 3 bits from the max with no trend, and a
    drift of 0.015 bits a step (half the rule's MIN_RATE) from 3.4 bits to about 1.2, near enough that only its rate
    keeps it below the rule's reach (its forecast is inside the horizon)."""
    flat = noisy_bits(3.0, 0.0, 400, 0.4, seed)
    drift = noisy_bits(3.4, 0.015, 150, 0.4, seed)
    for vals in (flat, drift):
        assert headroom_trend(run_of({"blk.fc": vals}), RuleConfig()) == []


def test_the_model_output_under_a_loss_below_zero_is_no_fit():
    """The model's own output growing while the loss falls is a fit, exempt (a regression head reaching targets in
    the thousands); a loss that is an unbounded -score, already below zero and falling with the output, has no
    target to reach (test_early_warning2's embedding_frequent_token): the growth is warned."""
    vals = grow(300.0, 1.1, 40)   # the root's output: 7.8 bits left, then 0.14 bits/step to 2.4 bits
    fit = [((16000.0 - v) / 16000.0) ** 2 for v in vals]    # a squared error to targets of 1.6e4
    score = [-v / 1000.0 for v in vals]                      # -score: falls for ever
    assert headroom_trend(run_of({"": vals}, losses=fit), RuleConfig()) == []
    f = headroom_trend(run_of({"": vals}, losses=score), RuleConfig())
    assert [x.module for x in f] == [""] and f[0].step <= 30, [x.one_line() for x in f]


def test_one_finding_per_chain_at_the_producer():
    """fc grows; act passes it on; proj (downstream, larger) reaches the max first; blk is proj's value.
    The finding is at fc, the first in forward order of the layers falling at that rate."""
    fc = grow(60.0, 1.15, 60, cap=1e9)
    proj = [v * 8 for v in fc]
    f = headroom_trend(run_of({"blk.fc": fc, "blk.act": fc, "blk.proj": proj, "blk": proj}), RuleConfig())
    assert [x.module for x in f] == ["blk.fc"]
    assert f[0].evidence["first_to_overflow"] == "blk.proj"


def test_series_stops_at_the_overflow():
    vals = grow(300.0, 1.15, 40) + [math.inf] * 20
    f = headroom_trend(run_of({"blk.fc": vals}), RuleConfig())
    assert len(f) == 1 and f[0].step < 30


def _with_overflow(run: RunData, at: int, module: str, n: int = 10) -> RunData:
    """The run's steps from `at` on went bad (the scaler skipped), the forward inf/NaN first seen in `module`."""
    from ampdoctor.records import Producer
    for r in run.steps[at:at + n]:
        r.skipped, r.found_inf = True, True
        r.forward_producer = Producer(module=module, call=0, phase="forward", kind="inf")
    return run


def test_a_forecast_that_came_true_is_the_error_that_explains_the_overflow():
    """The overflow happened where the trend said (the dropout right after a growing projection on the GPU): the
    trend is an error naming the growing layer, ranked after the overflow findings and before the scaler's."""
    from ampdoctor.analysis import rank
    from ampdoctor.findings import Finding
    vals = grow(300.0, 1.15, 40)
    run = _with_overflow(run_of({"blk.fc": vals}), 38, "blk.act")
    f = headroom_trend(run, RuleConfig())
    assert len(f) == 1 and f[0].severity == "error" and f[0].module == "blk.fc"
    assert f[0].evidence["overflowed_step"] == 38 and f[0].evidence["overflowed_in"] == "blk.act"
    assert "It did" in f[0].message and "step 38" in f[0].message
    overflow = Finding("overflow", "error", "forward", "blk.act", "aten::gelu", 38, "m", "fix", {"rank_hint": 10})
    collapse = Finding("loss_scale_collapse", "error", "backward", None, None, 38, "m", "fix", {"rank_hint": 60})
    assert [x.rule for x in rank([collapse, f[0], overflow])] == ["overflow", "headroom_trend", "loss_scale_collapse"]


def test_an_unrelated_overflow_leaves_the_trend_a_warning():
    vals = grow(300.0, 1.15, 40)
    f = headroom_trend(_with_overflow(run_of({"blk.fc": vals}), 38, "ln"), RuleConfig())
    assert len(f) == 1 and f[0].severity == "warning" and "overflowed_step" not in f[0].evidence
    f = headroom_trend(run_of({"blk.fc": vals}), RuleConfig())   # no overflow at all
    assert f[0].severity == "warning"


def test_a_trend_first_reached_after_the_layer_overflowed_is_no_early_warning():
    """The layer already overflowed (its forward made the inf at step 30, on a step the thinned series did not
    read), and the series' trend is first reached afterwards: a warning then forecasts what already happened, so
    there is none (the overflow finding says it). The same trend with the overflow elsewhere, or later, stays."""
    vals = [None] * 31 + grow(300.0, 1.15, 40)
    run = _with_overflow(run_of({"blk.fc": vals}), 30, "blk.fc", n=1)
    assert headroom_trend(run, RuleConfig()) == []
    f = headroom_trend(_with_overflow(run_of({"blk.fc": vals}), 30, "ln", n=1), RuleConfig())
    assert len(f) == 1 and f[0].module == "blk.fc" and f[0].step > 30
    # a routine step whose forward went non-finite names no producer in its record (the report's replay of its
    # capture does): it may have been this layer, so the trend reached after it is no early warning either
    run = run_of({"blk.fc": vals})
    run.steps[30].skipped, run.steps[30].found_inf, run.steps[30].output_finite = True, True, False
    assert headroom_trend(run, RuleConfig()) == []
    f = headroom_trend(_with_overflow(run_of({"blk.fc": vals}), 69, "blk.fc", n=1), RuleConfig())
    assert len(f) == 1 and f[0].severity == "error" and f[0].step < 69


# -- a real run ------------------------------------------------------------------------------------------------
def test_nanogpt_layer_whose_weights_grow_is_named_early():
    nanogpt = pytest.importorskip("benchmarks.realworld.nanogpt")
    target = "transformer.h.1.mlp.c_fc"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c = nanogpt.TrainConfig(size="tiny", dtype="float16", iters=72, learning_rate=1e-3)

        def inject(it, model, opt):
            with torch.no_grad():
                model.get_submodule(target).weight.mul_(1.15 * (32.0 if it == 0 else 1.0))
        _, w, _ = nanogpt.train(c, watch=lambda m, o, s: ampdoctor.watch(m, optimizer=o, scaler=s, headroom=True),
                                inject=inject)
        w.close()
    finally:
        torch.set_num_threads(n)
    steps = list(w.steps)
    first_bad = next(r.step for r in steps if r.bad)
    rep = w.report(replay=False)
    hits = [f for f in rep.findings if f.rule == "headroom_trend"]
    assert hits and hits[0].module == target, [(f.rule, f.module, f.step) for f in rep.findings]
    assert hits[0].step <= first_bad - 10, (hits[0].step, first_bad)
    assert abs(hits[0].evidence["forecast_step"] - first_bad) <= 5
    assert not any(f.rule == "headroom_trend" and f.module != target for f in rep.findings)
