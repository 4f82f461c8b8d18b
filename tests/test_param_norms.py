"""record/params.norms: per-tensor abs-max and L2 norms, NaN and inf kept, any dtype mix (the CPU abs-max avoids
_foreach_norm(inf), a slow per-tensor loop there)."""
import math

import torch

from ampdoctor.record.params import norms


def test_norms_equal_vector_norm_with_nan_inf_and_mixed_dtypes():
    ts = [torch.randn(1000), torch.tensor([1.0, float("nan")]), torch.tensor([-float("inf"), 2.0]),
          torch.randn(5).half() * 100, torch.randn(3).bfloat16(), torch.zeros(4)]
    for ord in (math.inf, 2):
        got = norms(ts, ord).tolist()
        want = [torch.linalg.vector_norm(t.double(), ord).item() for t in ts]
        for g, w in zip(got, want):
            assert (math.isnan(g) and math.isnan(w)) or math.isclose(g, w, rel_tol=1e-3), (ord, got, want)
    assert norms(ts, math.inf).dtype == torch.float64


def test_norms_of_fp16_values_inside_a_bf16_autocast_region():
    """A hook flushes fp16 values while a bf16 autocast region is active (Lightning's bf16-mixed with an fp16 block):
    stacking them must not go through autocast's dtype promotion, which knows only its own dtype."""
    from ampdoctor.record import cpustats
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(10, generator=g).half(), torch.randn(100, generator=g).half()]
    big = torch.randn(1 << 17, generator=g).half()
    big[7] = float("-inf")
    ts = small + [big]
    want = [t.float().abs().max().item() for t in ts]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_inf = norms(ts, math.inf).tolist()
        got_l2 = norms(small, 2).tolist()
        got_cpu = cpustats.absmax(ts).tolist()
    assert got_inf == want and got_cpu == want, (got_inf, got_cpu, want)
    assert got_l2 == [torch.linalg.vector_norm(t.float()).item() for t in small]


def test_cpu_absmax_one_call_equals_torch_on_every_layout():
    """cpustats.absmax measures a whole list in one C call: permuted, sliced, expanded and empty tensors, each float
    dtype, NaN over inf over any finite value, a negative extreme."""
    from ampdoctor.record import cpustats
    if not cpustats.available():
        import pytest
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 48, generator=g)
    nan_inf = torch.randn(300, generator=g)
    nan_inf[7], nan_inf[200] = float("-inf"), float("nan")
    only_inf = torch.randn(70000, generator=g)
    only_inf[69999] = float("inf")
    neg = torch.randn(129, generator=g)
    neg[5] = -1e30
    ts = [base, base.t(), base[:, 3:17], base[::2], torch.randn(5, generator=g).expand(4, 5), torch.empty(0),
          nan_inf, only_inf, neg, base.half() * 300, base.bfloat16(), base.double() * 1e200, torch.zeros(9)]
    got = cpustats.absmax(ts).tolist()
    want = [t.double().abs().max().item() if t.numel() else 0.0 for t in ts]
    assert [repr(x) for x in got] == [repr(x) for x in want]
    assert [repr(x) for x in cpustats._absmax_torch(ts).tolist()] == [repr(x) for x in want]
