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
