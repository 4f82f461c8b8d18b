"""The fused (Triton, CUDA) statistics equal the eager reference on random and adversarial tensors.
Runs where a CUDA GPU and Triton exist (the device machine); skipped elsewhere."""
import math

import pytest
import torch

from ampdoctor.record import fused
from ampdoctor.record.stats import full_stats, thresholds, vector_to_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fused path is CUDA-only)")


def _cases():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3000, generator=g) * 100
    adv = torch.tensor([0.0, -0.0, 1e-9, -3e-7, 6e-5, 3e4, -4e4, 7e4, 1e6, float("inf"), -float("inf"),
                        float("nan"), 65504.0, 65519.0, 65520.0, 2.0 ** -14, 2.0 ** -24])
    yield "random-fp32", base, torch.float16
    yield "adversarial-fp32-as-fp16", adv, torch.float16
    yield "adversarial-fp16", adv.half(), torch.float16
    yield "adversarial-bf16", adv.bfloat16(), torch.bfloat16
    yield "fp32-as-bf16", adv * 1e34, torch.bfloat16
    yield "fp32-own", adv, torch.float32
    yield "zeros", torch.zeros(1000), torch.float16
    yield "empty", torch.zeros(0), torch.float16
    yield "noncontiguous", torch.randn(64, 64, generator=g).t()[::2], torch.float16
    yield "large", torch.randn(5_000_000, generator=g).half() * 3000, torch.float16
    yield "expanded", torch.tensor([[1e-6], [7e4], [float("inf")]]).expand(3, 1000), torch.float16
    yield "permuted", (torch.randn(8, 16, 32, generator=g) * 1e3).permute(2, 0, 1), torch.float16


@pytest.mark.parametrize("name,x,ref", list(_cases()), ids=[c[0] for c in _cases()])
def test_fused_equals_eager(name, x, ref):
    if not fused.available(torch.zeros(1, device="cuda")):
        pytest.skip("Triton not available")
    x = x.cuda()
    buf = fused.StatBuffer(x.device, rows=1)
    buf.add(x, thresholds(x.dtype, ref))
    buf.add(x, thresholds(x.dtype, ref))  # grows the buffer
    got = buf.vectors()[1].cpu().tolist()
    want = full_stats(x, ref).cpu().tolist()
    a = vector_to_stats(got, "x", str(ref)).to_dict()
    b = vector_to_stats(want, "x", str(ref)).to_dict()
    assert a == b, (name, a, b)
