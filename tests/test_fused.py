"""The fused (Triton, CUDA) statistics equal the eager reference on random and adversarial tensors.
Runs where a CUDA GPU and Triton exist (the device machine); skipped elsewhere."""
import math

import pytest
import torch

from adversarial import adversarial
from ampdoctor.record import absmax, fused
from ampdoctor.record.stats import full_stats, thresholds, vector_to_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fused path is CUDA-only)")


def _cases():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3000, generator=g) * 100
    adv = adversarial()
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


def test_absmax_table_equals_eager():
    """AbsMaxTable (one Triton launch over a table of tensors) gives each tensor's abs-max, inf kept and NaN
    shown, for fp16 and bf16, contiguous and permuted, small and large, across growth and reset."""
    if not absmax.absmax_kernel_ready():
        pytest.skip("Triton not available")
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(n, generator=g) * s for n, s in ((1, 3.0), (7, 1e3), (2048, 0.5), (2049, 6e4),
                                                        (5_000_003, 100.0), (70_000, 1e-3))]
    ts = [t.half().cuda() for t in ts] + [(torch.randn(8, 16, 32, generator=g) * 1e3).half().cuda().permute(2, 0, 1)]
    inf = torch.zeros(5000, dtype=torch.float16, device="cuda")
    inf[4321] = -float("inf")
    nan = torch.ones(3000, dtype=torch.float16, device="cuda")
    nan[17] = float("nan")
    bf = (torch.randn(100_000, generator=g) * 1e20).bfloat16().cuda()
    tab = absmax.AbsMaxTable(torch.device("cuda"), rows=2)   # grows
    for _ in range(2):  # the second round after a reset reuses the buffers
        r0 = tab.add(ts + [inf, nan])
        r1 = tab.add([bf])
        v = tab.vector().cpu()
        want = [t.float().abs().max().item() for t in ts] + [math.inf, math.nan, bf.float().abs().max().item()]
        assert r0 == 0 and r1 == len(ts) + 2 and v.numel() == len(want)
        for got, w in zip(v.tolist(), want):
            assert (math.isnan(got) and math.isnan(w)) or got == w, (got, w)
        tab.reset()
        assert tab.n == 0


def test_headroom_on_cuda_uses_the_table_and_agrees_with_the_full_statistics():
    """On CUDA the routine steps' headroom (Triton table) equals what the sampled steps' full statistics give."""
    if not absmax.absmax_kernel_ready():
        pytest.skip("Triton not available")
    import ampdoctor
    from torch import nn
    import torch.nn.functional as F
    torch.manual_seed(0)

    def run(every):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 8)).cuda()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        sc = torch.amp.GradScaler("cuda")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, every=every, headroom=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(m(torch.randn(32, 64, device="cuda", generator=g)).float(),
                                  torch.zeros(32, 8, device="cuda"))
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        w.close()
        return w
    from test_headroom import assert_same_series
    full, fast = run(1), run(200)
    assert any(t.n == 0 and t.out.numel() for t in fast.machine.hr.tables.values())  # the table was used
    assert_same_series(full, fast)


def test_headroom_falls_back_when_the_table_kernel_cannot_launch(monkeypatch):
    """A Triton that cannot compile or launch here (an old GPU, a broken toolchain) must not switch the watch
    off: the table is disabled and _foreach_norm gives the same series."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    import ampdoctor
    from torch import nn
    import torch.nn.functional as F

    class Broken:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("triton: cannot compile for this device")
            return launch
    monkeypatch.setattr(absmax, "_ABSMAX", Broken())
    m = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cuda")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, headroom=True)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(m(torch.randn(8, 16, device="cuda")).float(), torch.zeros(8, 4, device="cuda"))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    assert absmax._ABSMAX is False and not any(r.internal_error for r in w.steps)
    h = list(w.steps)[2].headroom
    assert h["fwd"][1] is not None and h["fwd"][2] is not None and h["bwd"][1] is not None


def _same(vec_row, x, ref):
    a = vector_to_stats(vec_row.cpu().tolist(), "x", str(ref)).to_dict()
    b = vector_to_stats(full_stats(x, ref).cpu().tolist(), "x", str(ref)).to_dict()
    return a == b, a, b


def test_stat_table_defers_and_equals_eager():
    """With a DeferPlan, StatBuffer measures the first step's values at once and later steps' in table launches
    (several flushes, mixed dtypes and sizes, offsets into one storage, an expanded gradient made on the GPU): every
    row equals the eager reference; a value written in place after its hook is learned volatile and from then on
    measured as the hook saw it."""
    if not fused.available(torch.zeros(1, device="cuda")):
        pytest.skip("Triton not available")
    g = torch.Generator().manual_seed(3)
    big = (torch.randn(4_000_000, generator=g) * 2e4).half().cuda()
    vals = [(big, torch.float16), (big[8:1_000_008], torch.float16),   # an aligned view into the same storage
            (big[3:10_003], torch.float16),                              # an unaligned one: its own launch
            (adversarial().half().cuda(), torch.float16), (adversarial().bfloat16().cuda(), torch.bfloat16),
            (adversarial().cuda(), torch.float16), (adversarial().cuda(), torch.float32),
            (torch.ones((), device="cuda").expand(64, 1024, 33), torch.float16),   # grad of a sum: stride 0
            ((torch.randn(8, 16, 32, generator=g) * 1e3).half().cuda().permute(2, 0, 1), torch.float16)]
    vals += [((torch.randn(int(n), generator=g) * 6e4).half().cuda(), torch.float16)
             for n in torch.randint(1, 50_000, (300,), generator=g)]
    vals[40][0][7] = float("nan")
    plan = fused.DeferPlan()
    for step in range(3):
        buf = fused.StatBuffer(torch.device("cuda"), rows=8, plan=plan)
        rows = [buf.add(x, thresholds(x.dtype, ref), key=("m", i)) for i, (x, ref) in enumerate(vals)]
        w = torch.full((4096,), 3.0, device="cuda", dtype=torch.float16)
        rw = buf.add(w, thresholds(w.dtype, torch.float16), key=("written",))
        before = w.clone()
        w.mul_(1e4)  # after its hook: inf in fp16
        vec = buf.vectors()
        for r, (x, ref) in zip(rows, vals):
            ok, a, b = _same(vec[r], x, ref)
            assert ok, (step, r, a, b)
        assert plan.learned and ("written",) in plan.volatile
        ok, a, b = _same(vec[rw], before, torch.float16)
        assert ok, (step, a, b)  # the learning step measured it at once; later steps too (volatile)


def test_every1_on_cuda_with_inplace_writes_after_hooks():
    """A ResNet-style block (BatchNorm then ReLU(inplace=True), `out += identity`) watched at every=1 on CUDA: each
    module's recorded output abs-max equals what a forward hook saw when that module returned, on every step (the
    deferred table measurements must not read values written in place after the hook)."""
    if not fused.available(torch.zeros(1, device="cuda")):
        pytest.skip("Triton not available")
    import ampdoctor
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out += x
            return self.relu(out)

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Block(), Block(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(8, 10)).cuda()
    seen = {}
    names = {mod: n for n, mod in m.named_modules()}
    hs = [mod.register_forward_hook(lambda mod, i, o: seen.__setitem__(names[mod], o.detach().abs().max().item()))
          for mod in m.modules() if mod is not m]
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cuda")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, every=1)
    g = torch.Generator(device="cuda").manual_seed(0)
    per_step = []
    for _ in range(4):
        seen.clear()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(m(torch.randn(16, 3, 16, 16, device="cuda", generator=g)),
                                               torch.randint(0, 10, (16,), device="cuda", generator=g))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        per_step.append(dict(seen))
    w.close()
    for h in hs:
        h.remove()
    recs = list(w.steps)
    assert len(recs) == 4 and not any(r.internal_error for r in recs)
    for r, want in zip(recs, per_step):
        got = {c.module: c.out.absmax for c in r.modules if c.out is not None and c.module in want}
        assert set(got) == set(want), (r.step, set(want) - set(got))
        for n, v in want.items():
            assert got[n] == pytest.approx(v, rel=0, abs=0), (r.step, n, got[n], v)


def test_fused_statistics_fall_back_when_the_kernels_cannot_launch(monkeypatch):
    """A Triton that cannot compile or launch the statistics kernels here must not switch the watch off at a sampled
    step: the rows already queued are filled with torch ops (the same numbers) and the eager path serves from then
    on."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    import ampdoctor
    from torch import nn
    import torch.nn.functional as F

    class Broken:
        def __getitem__(self, i):
            raise RuntimeError("triton: cannot compile for this device")
    monkeypatch.setattr(fused, "_KERNEL", Broken())
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cuda")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, every=1)
    outs = {}
    h = m[0].register_forward_hook(lambda mod, i, o: outs.__setitem__("0", o.detach().abs().max().item()))
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(m(torch.randn(8, 16, device="cuda")).float(), torch.zeros(8, 4, device="cuda"))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    h.remove()
    w.close()
    recs = list(w.steps)
    assert fused._KERNEL is False and len(recs) == 3 and not any(r.internal_error for r in recs)
    got = next(c.out.absmax for c in recs[-1].modules if c.module == "0")
    assert got == outs["0"]


def test_forward_values_wait_past_gradient_cap_and_flush_when_root_returns():
    """At every=1 on CUDA a grad-enabled forward's values wait for one table pass past FLUSH_BYTES (they are mostly
    saved for the backward anyway) up to FLUSH_BYTES_FORWARD, and all of them are measured when the root's forward
    returns, so that none is held into the backward; the recorded abs-max of each module is still its own."""
    if not fused.available(torch.zeros(1, device="cuda")):
        pytest.skip("Triton not available")
    import ampdoctor
    from torch import nn
    torch.manual_seed(0)
    width = 4096
    layers = 10
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda()
    x = torch.randn(2048, width, device="cuda")  # each value 32 MiB in fp32, with the input 352 MiB > FLUSH_BYTES
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    w = ampdoctor.watch(model, optimizer=opt, every=1)
    seen = {}

    def last_layer(mod, args, out):
        bufs = list(w.machine.st.fbuf.values())
        seen["pending_bytes"] = sum(b.bytes for b in bufs)

    def root(mod, args, out):
        seen["after_root"] = sum(b.n_pending for b in w.machine.st.fbuf.values())

    h1 = model[layers - 1].register_forward_hook(last_layer)
    h2 = model.register_forward_hook(root)  # after the watch's own: sees the state it left
    maxes = []
    hs = [m.register_forward_hook(lambda m, a, o: maxes.append(o.detach().abs().max().item())) for m in model]
    try:
        for _ in range(2):  # (the first sampled step learns which values may wait)
            maxes.clear()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    finally:
        for h in (h1, h2, *hs):
            h.remove()
    w.close()
    recs = w.steps
    assert seen["pending_bytes"] > fused.FLUSH_BYTES, seen
    assert seen["after_root"] == 0, seen
    outs = {c.module: c.out.absmax for c in recs[-1].modules if c.out is not None}
    assert [outs[str(i)] for i in range(layers)] == pytest.approx(maxes, rel=1e-6)
