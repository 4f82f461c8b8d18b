"""Thresholds and dtype limits that the recorder and the rules share: one definition each, so that what the hooks
decide to sample and what the rules then read agree. Re-exported by ampdoctor/records.py (their historical home)."""
from __future__ import annotations

# Order of the numbers in a device-side stats vector (ampdoctor/record/stats.py) and in TensorStats.
STAT_FIELDS = ("numel", "nan", "posinf", "neginf", "zeros", "absmax", "min_nonzero", "near_max", "subnormal",
               "overflow_as_ref")

# Limits per reference dtype: (max finite, smallest normal, near-max threshold).
# near-max threshold is 2^15 for fp16 (one bit of headroom left), max/2 for the others.
# module types whose output is a sum of products: -inf there from finite inputs is an overflow, never a mask
# (shared by the recorder's producers and the rules)
ACCUMULATING = frozenset({"Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                          "ConvTranspose3d", "Bilinear", "Conv1D", "LazyLinear", "NonDynamicallyQuantizableLinear",
                          "Embedding", "EmbeddingBag"})

DTYPE_LIMITS = {
    "float16": (65504.0, 2.0 ** -14, 2.0 ** 15),
    "bfloat16": (3.3895313892515355e38, 1.1754943508222875e-38, 2.0 ** 127),
    "float32": (3.4028234663852886e38, 1.1754943508222875e-38, 2.0 ** 127),
    "float64": (1.7976931348623157e308, 2.2250738585072014e-308, 2.0 ** 1023),
}

LOSS_JUMP = 1e3
"""A loss that moves by this factor or more in one step has jumped (a loss weight gone wrong, a divergence starting):
the recorder samples the step after it (record/autocapture.py), and the rules read the regime it begins
(rules/underflow.py: underflow after a fall, vanished_gradient's onset). One definition for both."""

ROUNDED_AWAY_SHARE = 0.5
ROUNDING_MIN_SAMPLED = 16
"""update_underflow: a module whose sampled updated elements (ROUNDING_MIN_SAMPLED or more, those with a nonzero
gradient) did not change in ROUNDED_AWAY_SHARE of them or more is rounding its updates away. One definition for the
recorder (which ends its extra rounding checks when it sees this: record/params.py) and the rule (rules/weights.py;
RuleConfig.rounded_away_share defaults to the same share)."""

COLLAPSE = 16.0
SQUARE_OVERFLOW = 256.0
"""An fp16 norm flushed by an overflow inside it (x**2 > 65504 from |x| >= SQUARE_OVERFLOW, sqrt(65504) = 255.9): its
output's abs-max falls COLLAPSE-fold (to zeros or only its bias), or the input that feeds it rises COLLAPSE-fold
past SQUARE_OVERFLOW. One definition for the recorder (which samples the step after such a change:
record/autocapture.CapturePolicy.collapse) and the rule (rules/numeric.silent_zeros, which dates the finding by
it)."""

BACKOFF_MAX_STREAK = 10
"""A streak of this many skipped steps in a row is a collapse, never GradScaler's normal search for a loss scale:
one definition for the recorder (which bad steps get a capture) and the rules (rules/backoff.benign_backoff; the
`loss_scale_collapse` rule's `collapse_consecutive` defaults to the same number)."""
