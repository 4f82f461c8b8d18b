"""A watch and torch.compile, both orders, on CPU.

Nothing of ampdoctor's is traced into the compiled graph (ampdoctor/record/hooks.py): the root module's hooks
run eagerly around the compiled forward (a graph break before and after it), the other modules carry no hooks
(they would be traced, and recompile the graph whenever they change; on an H200 that hit Dynamo's recompile
limit), and the scaler/optimizer/clip monitor lives outside the compiled region. So every step is recorded
(loss, scale, skipped steps, gradient norms, the model's output checked for inf/NaN, the batch for a capture),
and the per-layer statistics of a bad step come from the eager replay of its capture. Tested in every order:
watch then compile, compile then watch the original module, compile then watch the `OptimizedModule` wrapper.

The order tests use backend="aot_eager" (Dynamo + AOTAutograd, no C++ toolchain, a few seconds); one test
uses the default inductor backend and is skipped when the toolchain is unusable.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampdoctor
from scenarios import TwoLayerNet

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train(call, model, opt, scaler):
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(call(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def setup():
    torch.manual_seed(0)
    m = TwoLayerNet()
    return m, torch.optim.SGD(m.parameters(), lr=0.01), torch.amp.GradScaler("cpu", init_scale=256.0)


def assert_full_stats(w, prefix=""):
    rep = w.report()
    assert [(f.rule, f.severity) for f in rep.findings if f.severity != "info"] == []
    assert [r.step for r in w.steps] == list(range(STEPS))
    for r in w.steps:
        assert r.loss is not None and r.scale == 256.0 and r.grad_norm is not None and not r.skipped
        assert r.output_finite is True
        assert not any(c.module in (prefix + "fc1", prefix + "fc2") for c in r.modules)  # nothing traced
    kinds = [e.kind for e in w.steps[0].events]
    assert kinds == ["zero_grad", "scale", "unscale_", "clip_grad_norm_", "step", "optimizer.step", "update"]


def test_watch_then_compile():
    m, opt, sc = setup()
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, every=1)
    compiled = torch.compile(m, backend="aot_eager")
    train(compiled, m, opt, sc)
    w.close()
    assert_full_stats(w)
    assert all(not x._forward_hooks and not x._forward_pre_hooks for x in m.modules())


def test_compile_then_watch_original_module():
    m, opt, sc = setup()
    compiled = torch.compile(m, backend="aot_eager")
    w = ampdoctor.watch(compiled._orig_mod, optimizer=opt, scaler=sc, every=1)
    train(compiled, m, opt, sc)
    w.close()
    assert_full_stats(w)


def test_compile_then_watch_wrapper():
    m, opt, sc = setup()
    compiled = torch.compile(m, backend="aot_eager")
    w = ampdoctor.watch(compiled, optimizer=opt, scaler=sc, every=1)
    try:
        train(compiled, m, opt, sc)
    finally:
        w.close()
    assert_full_stats(w)


def test_watch_then_compile_inductor(tmp_path):
    m, opt, sc = setup()
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path, every=1)
    compiled = torch.compile(m)
    try:
        train(compiled, m, opt, sc)
    except Exception as e:  # no usable C++ compiler: inductor cannot build its kernels
        w.close()
        if "Compiler" in type(e).__name__ or "compile" in str(e).lower() or "cxx" in str(e).lower():
            pytest.skip(f"inductor unusable here ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        raise
    w.close()
    assert_full_stats(w)
    assert [f.rule for f in ampdoctor.diagnose(tmp_path).findings if f.severity != "info"] == []


def test_compiled_overflow_is_named_by_the_replay_of_its_capture(tmp_path):
    """A compiled model whose fc1 overflows fp16: the step is caught by the trip-wire, captured, and the eager
    replay of the capture names fc1 and its op."""
    m, opt, sc = setup()
    with torch.no_grad():
        m.fc1.weight.mul_(3e4)
    compiled = torch.compile(m, backend="aot_eager")
    w = ampdoctor.watch(compiled, optimizer=opt, scaler=sc, run_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    for _ in range(11):
        opt.zero_grad()
        x, y = torch.randn(4, 8, generator=g) * 10, torch.randn(4, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(compiled(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    assert len(w.steps) == 11 and w.steps[0].capture
    rep = w.report()
    top = rep.findings[:3]
    assert any(f.rule == "overflow" and f.module == "fc1" and f.op and f.step == 0 for f in top), \
        [(f.rule, f.module, f.op, f.step) for f in top]
    # the scaler's findings name the layer the replay found, not the root the compiled watch saw
    scaler = [f for f in rep.findings if f.phase == "scaler"]
    assert scaler and all(f.module == "fc1" and "`fc1`" in f.message for f in scaler), \
        [(f.rule, f.module, f.message) for f in scaler]


def test_no_recompiles_while_watching():
    """Sampled and routine steps alternate (every=2): the compiled graph must not be recompiled for them."""
    m, opt, sc = setup()
    compiled = torch.compile(m, backend="aot_eager")
    w = ampdoctor.watch(compiled, optimizer=opt, scaler=sc, every=2)
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(compiled(torch.randn(4, 8, generator=g)).float(), torch.zeros(4, 1))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    assert len(w.steps) == 6
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_again = sum(torch._dynamo.utils.counters["recompiles"].values())
    assert compiled_again == 0, dict(torch._dynamo.utils.counters["recompiles"])
    assert frames <= 3  # the forward (split by the root hooks' graph breaks), no more
