"""A forward failure in the middle of GradScaler's first search for a loss scale (rules/backoff.benign_backoff): the
scaler starts at its default 65536 on a model whose gradients need ~128, so it skips the first ~9 steps, and one
batch among them overflows the forward. The skip of that batch is the failure; the skips before and after it are
still the search (a skip updates no weight: the failed forward only halved the scale once more), so they stay info
and the producer of the forward overflow is ranked first. Before the fix, the skips after the failure were judged
with nothing before them, and their backward overflows became an error at a module the search had merely passed
through, ranked above the producer."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

STEPS = 16


class Net(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, d), nn.LeakyReLU(0.2), nn.Linear(d, d), nn.LeakyReLU(0.2))
        self.head = nn.Linear(d, 1)
        with torch.no_grad():
            self.head.weight.mul_(150.0)  # a head with a large gain: gradients need a small loss scale

    def forward(self, x):
        return self.head(self.body(x))


def _train(tmp_path, bad_at, steps=STEPS, watch=True):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.Adam(m.parameters(), lr=2e-4)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(tmp_path / "run")) if watch else None
    g = torch.Generator().manual_seed(1)
    skipped = []
    for i in range(steps):
        x = torch.randn(64, 8, generator=g)
        if i == bad_at:
            x[:4] *= 1e4  # a batch in raw units: finite in fp16, the head's output overflows
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), torch.ones(64, 1))
        before = sc.get_scale()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        skipped.append(sc.get_scale() < before)
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return rep, skipped


def _loud(rep):
    return [f for f in rep.findings if f.severity in ("warning", "error")]


def test_the_search_is_long_enough_to_be_split(tmp_path):
    # the premise, measured without ampdoctor: the search skips several steps on each side of the bad batch
    _, skipped = _train(tmp_path, bad_at=None, watch=False)
    first_ok = skipped.index(False)
    assert first_ok >= 6, skipped
    _, skipped_bad = _train(tmp_path, bad_at=4, watch=False)
    assert skipped_bad[:first_ok] == [True] * first_ok  # the bad batch falls inside the search


def test_healthy_search_is_quiet(tmp_path):
    rep, _ = _train(tmp_path, bad_at=None)
    assert _loud(rep) == [], [f.one_line() for f in rep.findings]


@pytest.mark.parametrize("bad_at", [1, 4, 6])
def test_forward_failure_inside_the_search_is_ranked_first(tmp_path, bad_at):
    rep, _ = _train(tmp_path, bad_at=bad_at)
    loud = _loud(rep)
    assert loud, [f.one_line() for f in rep.findings]
    top = rep.findings[0]
    assert (top.rule, top.module, top.step, top.severity) == ("overflow", "head", bad_at, "error"), \
        [f.one_line() for f in rep.findings]
    # nothing loud names a module the search only passed through
    assert {f.module for f in loud} <= {"head", None, "(run)"}, [f.one_line() for f in loud]
