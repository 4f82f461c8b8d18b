"""The adversarial values every statistics backend is checked on (one definition, used by test_stats.py and
test_fused.py): signed zeros, fp16 subnormals and the smallest normal, values either side of fp16's max and of
the point where a cast to fp16 rounds to inf (65520), far past it, inf, -inf and NaN."""
import torch


def adversarial() -> torch.Tensor:
    return torch.tensor([0.0, -0.0, 1e-9, -3e-7, 6e-5, 3e4, -4e4, 7e4, 1e6, float("inf"), -float("inf"),
                         float("nan"), 65504.0, 65519.0, 65520.0, 2.0 ** -14, 2.0 ** -24])
