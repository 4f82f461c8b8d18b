"""Watching must not keep tensors alive longer than the training loop would: nothing ampdoctor builds during a
step may sit in a reference cycle holding a tensor (cyclic garbage is freed only when Python's GC runs, so
activations held that way raise the step's peak memory at random; measured on GPT-2 by
benchmarks/memory_peak.py)."""
from __future__ import annotations

import gc

import torch

import ampdoctor

from scenarios import TinyGPT, gpt_batch


def _tensors_in_cycles(fn) -> list[str]:
    gc.collect()
    gc.disable()
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = [f"{type(o).__name__}{tuple(o.shape)}" for o in gc.garbage if issubclass(type(o), torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


def test_sampled_steps_leave_no_tensor_in_cyclic_garbage():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    idx, tgt = gpt_batch()(0)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(idx, tgt)["loss"]
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    step()  # warm-up outside the watch (optimizer state, autocast caches)
    assert _tensors_in_cycles(lambda: [step() for _ in range(2)]) == []  # the loop itself is clean
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, every=1)
    try:
        assert _tensors_in_cycles(lambda: [step() for _ in range(3)]) == []
    finally:
        w.close()
    assert len(w.steps) == 3 and all(s.sampled for s in w.steps)
    assert any(c.gin is not None for c in w.steps[-1].modules)  # the input views were in place
