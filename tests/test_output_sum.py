"""The root output's trip-wire sum (record/modulehooks.output_sum): on the CPU an fp32 output is summed in fp32 and
read at once, and only a non-finite fp32 sum takes the fp64 sum. The answer must stay the fp64 sum's: finite
outputs whose fp32 sum overflows (mask fills of -3.4e38 beside +3.4e38 sentinels) are not a non-finite output."""
from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor
from ampdoctor.record.modulehooks import output_sum

BIG = torch.finfo(torch.float32).max


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 33, generator=g)
    both = x.clone()
    both[0, 0, :2], both[1, 1, :2] = BIG, -BIG  # (BIG + BIG is inf in fp32)
    many_neg = torch.full((8, 8), -BIG)
    many_pos = torch.full((8, 8), BIG)
    nan = x.clone()
    nan[2, 3, 4] = math.nan
    inf = x.clone()
    inf[0, 0, 5] = math.inf
    ninf = x.clone()
    ninf[0, 0, 6] = -math.inf
    return {"plain": x, "both_sentinels": both, "many_neg": many_neg, "many_pos": many_pos, "nan": nan, "inf": inf, "ninf": ninf,
            "one": torch.tensor([3.0]), "half": x.half(), "bf16": x.bfloat16(), "f64": x.double(),
            # bf16 has fp32's range: finfo(bfloat16).min fills (a mask) overflow an fp32 sum of finite values
            "bf16_min_fill": torch.full((2, 8), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16),
            "bf16_max_both": both.clamp(-3.38e38, 3.38e38).bfloat16(), "bf16_nan": nan.bfloat16(),
            "bf16_inf": inf.bfloat16(), "bf16_ninf": ninf.bfloat16(), "half_ninf": ninf.half()}


def _classify(v: float) -> str:
    return "finite" if math.isfinite(v) else "ninf" if v == -math.inf else "bad"


def test_output_sum_answers_as_the_fp64_sum():
    for name, t in _cases().items():
        ref = t.double().sum().item()  # finite iff every value is; -inf iff the only non-finite ones are -inf
        got = output_sum(t.requires_grad_(t.is_floating_point()))
        assert got.shape == (1,), name
        assert _classify(got.item()) == _classify(ref), (name, got.item(), ref)
    # the fp32 fast path itself: a finite fp32 sum stays fp32 (no fp64 kernel), an overflowing one falls back
    assert output_sum(_cases()["plain"]).dtype is torch.float32
    assert output_sum(_cases()["many_pos"]).dtype is torch.float64  # 64 x 3.4e38: inf in fp32, not in fp64
    assert math.isfinite(output_sum(_cases()["many_pos"]).item())


class Sentinel(nn.Module):
    """A healthy model whose fp32 output carries 3.4e38 sentinels (finite): their total is past fp32's range."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        fill = torch.zeros_like(h)
        fill[:, :4] = BIG
        return h + fill.detach()


def _fit(model, tmp_path, steps, batch, loss_of):
    """SGD + GradScaler("cpu") under a watch: batch(i) -> the model's input, loss_of(output) -> the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=str(tmp_path / "run"))
    for i in range(steps):
        opt.zero_grad()
        loss = loss_of(model(batch(i)))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    rep = w.report()
    w.close()
    return rep, w.machine.records


def test_finite_sentinels_in_an_fp32_output_are_no_bad_step(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    rep, records = _fit(Sentinel(), tmp_path, 6, lambda i: x, lambda out: out[:, 4:].pow(2).mean())
    assert rep.exit_code == 0 and not [f for f in rep.findings if f.severity in ("error", "warning")], \
        [f.rule for f in rep.findings]
    assert all(r.output_finite is not False for r in records), "a finite output read as non-finite"


def test_a_nan_in_an_fp32_output_is_still_seen(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def batch(i):
        xi = x.clone()
        if i == 3:
            xi[0, 0] = math.nan
        return xi
    # the loss stays finite: only the output's trip-wire sees the NaN
    _, records = _fit(model, tmp_path, 5, batch, lambda out: out[1:].pow(2).mean())
    bad = [r.step for r in records if r.output_finite is False]
    assert bad == [3], bad


def test_a_bf16_output_under_an_fp16_autocast_is_summed():
    """A model that runs itself under a bf16 autocast, called inside the loop's fp16 one: its bf16 output reaches
    the root's hook under the fp16 autocast, where a stack of bf16 values raises (autocast cannot promote bf16 for
    fp16); the trip-wire must answer as outside any autocast (tests/test_dtype_islands_unseen.py found it)."""
    vals = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([1.0, float("-inf")]), torch.tensor([float("nan"), 1.0]),
            torch.tensor([float("inf"), float("-inf")]), torch.full((4,), torch.finfo(torch.bfloat16).min)]
    for v in vals:
        t = v.to(torch.bfloat16)
        want = output_sum(t).item()
        with torch.autocast("cpu", dtype=torch.float16):
            got = output_sum(t).item()
        assert (math.isnan(got) and math.isnan(want)) or got == want, (v, got, want)
        assert math.isfinite(got) == bool(torch.isfinite(v).all()), (v, got)
