"""The replay of a model under reentrant activation checkpointing (`checkpoint(..., use_reentrant=True)`), whose graph
refuses `torch.autograd.grad`: the replay runs torch's reentrant checkpoints inline (replay/modelio.py
inline_reentrant_checkpoints), so its backward is autograd.grad's like any model's. The model it replays keeps its
own gradients (each parameter's `.grad` is the same tensor with the same values afterwards), and a post-accumulate-
grad hook (an optimizer step fused into the backward) never runs: the replay must not step the user's optimizer.

Written failing first for the backward: the replay ran the forward only, so a NaN that only the backward makes
(test_unseen_variants55 5b) was judged a finite step and its producer `info`."""
from __future__ import annotations

import pytest
import torch

import ampdoctor
from scenarios import one_thread
from test_unseen_variants55 import ONE_AT, XVector, xv_batch

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def train(tmp_path):
    """test_unseen_variants55's x-vector (stats pooling under reentrant checkpointing): a one-frame utterance at step
    ONE_AT makes the pooling's hidden 0/0, NaN in the recomputed backward; the scaler skips, a capture is written."""
    torch.manual_seed(0)
    m = XVector(False, True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
    for i in range(ONE_AT + 2):
        (x, mask, y), _, _ = xv_batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x, mask, y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    caps = sorted((tmp_path / "run" / "captures").iterdir())
    assert caps, "no capture: the bad step was not seen"
    return m, caps[0]


def grads_set(m):
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.5)
    return {n: (p.grad, p.grad.clone()) for n, p in m.named_parameters()}


def test_replay_runs_the_backward_and_keeps_the_models_grads(tmp_path):
    m, cap = train(tmp_path)
    before = grads_set(m)
    rep = ampdoctor.replay(str(cap), model=m)
    assert any(f.rule == "nan_origin" and f.module == "pool" and f.severity == "error" for f in rep.findings[:3]), \
        [f.one_line() for f in rep.findings[:3]]
    for n, p in m.named_parameters():
        assert p.grad is before[n][0] and torch.equal(p.grad, before[n][1]), n


def test_replay_with_a_fused_optimizer_hook_never_runs_it(tmp_path):
    m, cap = train(tmp_path)
    calls = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    before = grads_set(m)
    ampdoctor.replay(str(cap), model=m)
    assert calls == []
    for n, p in m.named_parameters():
        assert p.grad is before[n][0] and torch.equal(p.grad, before[n][1]), n
