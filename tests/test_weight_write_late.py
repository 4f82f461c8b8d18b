"""A forward that starts writing its own weight late in the run, on a sampled step (every=1) that the module-state
probe (record/modstate.py: steps 1-8, then 25 steps apart) does not look at: at step 12 a max-norm constraint first
renormalises `proj`'s rows in place, and a pruned (all-zero) row becomes 0 / 0 = NaN inside the forward. Only the
weights' abs-max that a sampled step reads as its forward begins (modulehooks: `st.w_start`) tells that they were
finite then, so the NaN is proj's forward's (nan_origin, forward, step 12), not "already NaN when step 12 began:
step 11's update wrote them". Real hooks, real GradScaler, the public API.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from scenarios import both, first_bad, no_error_at, one_thread, out_mean, randn, short_loop as loop, top3
import pytest

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

LATE = 12


class LateMaxNorm(nn.Linear):
    """A max-norm constraint switched on at step LATE (a schedule), renormalising the rows in place."""

    def __init__(self, *a):
        super().__init__(*a)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > LATE:
            with torch.no_grad():
                self.weight.div_(self.weight.norm(dim=1, keepdim=True))
        return super().forward(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.proj, self.head = nn.Linear(8, 16), LateMaxNorm(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.proj(torch.relu(self.inp(x)))))


def test_a_weight_first_written_by_the_forward_late_is_that_forwards_nan(tmp_path):
    torch.manual_seed(0)
    m, x = Net(), randn(16, 8)

    def batch(i):
        if i == LATE:  # a pruning step zeroes a row: its norm is 0
            with torch.no_grad():
                m.proj.weight[0] = 0.0
        return (x,)
    w = loop(m, batch, out_mean, every=1, run_dir=tmp_path / "r", lr=1e-6, clip=None, steps=16)
    assert first_bad(w) == LATE  # oracle: the first renormalising forward makes the NaN
    for rep in both(w, tmp_path / "r"):
        f = top3(rep, "nan_origin", "proj")
        assert (f.phase, f.step) == ("forward", LATE), f.one_line()
        no_error_at(rep, ("inp", "head", ""))
