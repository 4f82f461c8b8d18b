"""Watching does not keep a step's autograd graph alive past the loop's own last reference to it.

With a GradScaler on CUDA the step's values reach the host asynchronously and are read at the next iteration; the
scaled loss's node (kept for `loss_ops`, read only on a step whose loss went non-finite) then held the whole graph
of the step until the next iteration began. Without the watch the graph dies where the loop drops its loss (on a
GPU: while the device still runs the optimizer's kernels); with it, at the start of the next iteration, where the
device waits for the host (~100 us of node destructors on the nanoGPT-style step, issue 15). A Function whose
context holds a marker object tells when the graph died: collected once the loop dropped `loss`, watched or not.

Runs where a CUDA GPU exists (the device machine: `benchmarks/gpu_check.sh 2`); on the CPU the values are read at
scaler.step itself, so the reference was already gone there (the CPU case is checked too, as a guard).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import ampdoctor


class _Marker:
    pass


class _Tag(torch.autograd.Function):
    """Identity whose graph node (its ctx) holds a marker: the marker lives exactly as long as the node."""

    @staticmethod
    def forward(ctx, x, marker):
        ctx.marker = marker
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 1)
        self.markers: list = []

    def forward(self, x, y):
        m = _Marker()
        self.markers.append(weakref.ref(m))
        h = _Tag.apply(torch.relu(self.a(x)), m)
        return nn.functional.mse_loss(self.b(h).float(), y)


def one_iteration(net, opt, scaler, device) -> bool:
    """One fp16 + GradScaler iteration (unscale_, clip, step, update, loss.item()), the loop's `loss` then deleted:
    whether the iteration's graph is still alive."""
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.float16):
        loss = net(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    loss.item()
    del loss
    gc.collect()  # (the graph holds no cycle; this only makes a leftover reference the one explanation)
    return net.markers[-1]() is not None


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("watched", [False, True], ids=["plain", "watched"])
def test_the_graph_dies_with_the_loops_last_reference(device, watched):
    torch.manual_seed(0)
    net = _Net().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device)
    w = ampdoctor.watch(net, optimizer=opt, scaler=scaler) if watched else None
    alive_after_step = []
    try:
        for _ in range(12):
            alive_after_step.append(one_iteration(net, opt, scaler, device))
    finally:
        if w is not None:
            w.close()
    routine = [True] * len(alive_after_step)
    if w is not None:
        rep = w.report()
        assert rep.summary["steps"] == 12
        assert not [f for f in rep.findings if f.severity in ("warning", "error")], [str(f) for f in rep.findings]
        # a sampled step (full statistics: every module hooked, the gradient exits walked) may keep its nodes until
        # its values are read, and so may a step the scaler skipped (its loss may be the non-finite one, and loss_ops
        # then reads the graph: on an H100 this net's fp16 weight gradients overflowed at step 6, at the scale of
        # 65536); every routine step that stepped must let the graph go with the loop's `loss`
        routine = [not r.sampled and not r.skipped for r in w.steps]
        assert sum(routine) >= 4, routine
    kept = [i for i, (a, r) in enumerate(zip(alive_after_step, routine)) if a and r]
    assert not kept, f"the graph outlived `del loss` at iterations {kept} (routine: {routine})"
