"""ampdoctor.watch: hooks only measure, close removes everything, records match hand-computed values."""
import gc
import math
import warnings

import pytest
import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.errors import WatchError
from scenarios import TinyGPT, gpt_batch, hf_loss


def _hook_count(model):
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(getattr(m, "_backward_pre_hooks", {})) + len(getattr(m, "_forward_hooks_always_called", {}))
    return n


def _global_state():
    import torch.nn.utils as U
    import torch.optim.optimizer as O
    return (len(O._global_optimizer_pre_hooks), len(O._global_optimizer_post_hooks), U.clip_grad_norm_,
            U.clip_grad_value_, torch.nn.utils.clip_grad.clip_grad_norm_)


def test_close_removes_every_hook_and_patch():
    m = TinyGPT()
    opt = torch.optim.AdamW(m.parameters())
    sc = torch.amp.GradScaler("cpu")
    before = _global_state()
    assert _hook_count(m) == 0
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    assert _hook_count(m) > 0 and "step" in vars(sc) and "zero_grad" in vars(opt)
    assert torch.nn.utils.clip_grad_norm_ is not before[2]
    w.close()
    w.close()  # idempotent
    assert _hook_count(m) == 0
    assert "step" not in vars(sc) and "scale" not in vars(sc) and "zero_grad" not in vars(opt)
    assert _global_state() == before


def test_with_block_closes():
    m = nn.Linear(2, 2)
    with ampdoctor.watch(m) as w:
        assert _hook_count(m) > 0
    assert w.closed and _hook_count(m) == 0


def test_thousand_cycles_leave_nothing_behind():
    import tracemalloc
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = _global_state()
    for _ in range(50):  # warm up caches
        ampdoctor.watch(m, optimizer=opt).close()
    gc.collect()
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    for _ in range(1000):
        ampdoctor.watch(m, optimizer=opt).close()
    gc.collect()
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename") if s.size_diff > 0)
    assert _hook_count(m) == 0 and _global_state() == before
    assert grown < 200_000, grown


def _train(watch: bool, steps=50, every=1):
    torch.manual_seed(0)
    m = TinyGPT()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    batch = gpt_batch(1)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, every=every) if watch else None
    losses = []
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = hf_loss(m(*batch(i)))
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.detach().clone())
    if w:
        w.close()
    return losses, {k: v.clone() for k, v in m.state_dict().items()}, opt.state_dict(), sc.state_dict(), \
        torch.get_rng_state()


@pytest.mark.parametrize("every", [1, 200])
def test_watching_changes_nothing_bitwise(every):
    l0, w0, o0, s0, r0 = _train(False)
    l1, w1, o1, s1, r1 = _train(True, every=every)
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert s0 == s1 and torch.equal(r0, r1)
    for k, st in o0["state"].items():
        for n, v in st.items():
            assert torch.equal(v, o1["state"][k][n])


def test_watch_errors_say_what_to_do():
    with pytest.raises(WatchError, match="nn.Module"):
        ampdoctor.watch(lambda x: x)
    m = nn.Linear(2, 2)
    with ampdoctor.watch(m):
        with pytest.raises(WatchError, match="already watched"):
            ampdoctor.watch(m)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)
    with pytest.raises(WatchError, match="does not hold any of the model's parameters"):
        ampdoctor.watch(m, optimizer=other)
    with pytest.raises(WatchError, match="GradScaler"):
        ampdoctor.watch(m, scaler=object())
    with pytest.raises(ValueError, match="every"):
        ampdoctor.watch(m, every=0)


class Twice(nn.Module):
    """A shared layer called twice per forward; outputs in a dict and a tuple."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, bias=False)

    def forward(self, x):
        a = self.lin(x)
        return {"out": (self.lin(a), a), "aux": None}


def test_records_match_hand_computed_values():
    m = Twice()
    with torch.no_grad():
        m.lin.weight.copy_(torch.tensor([[2.0, 0, 0], [0, 0, 0], [0, 0, 1e-6]]))
    x = torch.tensor([[1.0, 5.0, 1.0], [40000.0, 0.0, 3.0]])
    with ampdoctor.watch(m, every=1) as w:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        out["out"][0].float().sum().backward()
    rec = w.steps[0]
    calls = [c for c in rec.modules if c.module == "lin"]
    assert [c.call for c in calls] == [0, 1]
    first = calls[0].out  # fp16 output of lin(x): [[2, 0, 1e-6], [80000 -> inf, 0, 3e-6]]
    assert first.dtype == "float16" and first.ref == "float16" and first.numel == 6
    assert first.posinf == 1 and first.nan == 0
    assert first.zeros == 2
    assert first.absmax == 2.0
    assert first.subnormal == 2  # 1e-6 and 3e-6 are below 2^-14
    assert math.isclose(first.min_nonzero, float(torch.tensor(1e-6, dtype=torch.float16)))
    inp = calls[0].inp  # fp32 input, light stats
    assert inp.numel == 6 + 9 or inp.numel == 6  # inputs (+ weights are recorded separately in .par)
    assert calls[0].par is not None and calls[0].par.numel == 9
    assert rec.forward_producer.module == "lin" and rec.forward_producer.call == 0
    assert rec.forward_producer.kind == "inf"
    # backward: gradient flowing into the second call's output is ones (from .sum())
    assert calls[1].gout is not None and calls[1].gout.absmax == 1.0 and calls[1].gout.numel == 6


def test_fp32_inside_autocast_counted_as_fp16():
    class F32(nn.Module):
        def forward(self, x):
            return x * 3.0  # fp32 op (no autocast cast) inside an fp16 region
    m = F32()
    with ampdoctor.watch(m, every=1) as w:
        with torch.autocast("cpu", dtype=torch.float16):
            m(torch.tensor([30000.0, 1.0, 1e-6]))
    o = w.steps[0].modules[0].out
    assert o.dtype == "float32" and o.ref == "float16"
    assert o.overflow_as_ref == 1 and o.near_max == 1 and o.subnormal == 1


def test_no_grad_eval_half_model_and_no_scaler():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).half()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ampdoctor.watch(m, optimizer=opt, every=1) as w:
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(2, 4).half()).float().sum().backward()
            opt.step()
            with torch.no_grad():
                m(torch.randn(2, 4).half())
    assert len(w.steps) == 2
    assert any(not c.grad_enabled for c in w.steps[1].modules)  # the eval pass after step 0
    assert w.steps[0].modules[0].out.ref == "float16"


def test_optimizer_found_without_being_passed():
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ampdoctor.watch(m, every=1) as w:
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert [r.step for r in w.steps] == [0, 1, 2]
    assert all(r.params for r in w.steps)


def test_internal_error_disables_with_one_warning_and_training_continues():
    m = nn.Linear(4, 1)
    w = ampdoctor.watch(m, every=1)

    def boom(*a, **k):
        raise RuntimeError("synthetic")
    w.machine._row = boom
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            y = m(torch.randn(2, 4))
        y.sum().backward()
    w.close()
    msgs = [str(r.message) for r in rec if "ampdoctor disabled itself" in str(r.message)]
    assert len(msgs) == 1


def test_an_internal_error_is_the_first_line_of_the_report(tmp_path):
    """The watch turning itself off is never silent: the run dir keeps the step where it happened and the
    report's verdict begins with it."""
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = ampdoctor.watch(m, optimizer=opt, every=1, run_dir=tmp_path)
    for step in range(4):
        if step == 2:
            def boom(*a, **k):
                raise RuntimeError("synthetic")
            w.machine._row = boom
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()
    w.close()
    for rep in (w.report(), ampdoctor.diagnose(tmp_path)):
        assert rep.summary["verdict"].startswith("ampdoctor stopped watching at step 2 after an internal error"), \
            rep.summary["verdict"]


def test_inference_mode_and_eval_only_watch():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ampdoctor must not disable itself
        with ampdoctor.watch(m, every=1) as w:
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
                m(torch.randn(3, 4))
    assert len(w.steps) == 1 and len(w.steps[0].modules) == 4
    assert not [f for f in w.report().findings if f.severity != "info"]


def test_headroom_argument_other_than_true_false_auto_is_refused_not_read_as_true():
    """`watch(headroom="sometimes")` was coerced by bool() into True; a string other than "auto" is an error now,
    and the model is left unwatched (a new watch on it works)."""
    m = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="headroom"):
        ampdoctor.watch(m, headroom="sometimes")
    for value, want in ((True, True), (False, False), ("auto", "auto"), (1, True), (0, False)):
        w = ampdoctor.watch(m, headroom=value)
        assert w.config.headroom == want
        w.close()
