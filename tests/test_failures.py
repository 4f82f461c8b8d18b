"""Failing training runs, watched end to end: the right rule at the right module (the producer, not a
propagator) among the first three findings. Patterns from shared/FP16.md, including ones not in shared/cases."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import mse_to_zero, train


def top3(w, rule, module):
    rep = w.report()
    got = [(f.rule, f.module) for f in rep.findings[:3]]
    assert (rule, module) in got, [f.one_line() for f in rep.findings]
    assert rep.exit_code == 1
    return rep


class SwiGLU(nn.Module):
    def __init__(self, d=16, h=64):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaMLPModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.mlp = SwiGLU()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.norm(self.embed(x) + self.mlp(self.embed(x))))


def test_swiglu_product_overflow_names_the_mlp():
    torch.manual_seed(0)
    m = LlamaMLPModel()
    with torch.no_grad():
        m.mlp.gate.weight.mul_(300)
        m.mlp.up.weight.mul_(300)
    x = torch.randn(4, 8) * 3
    w = train(m, lambda i: (x,), mse_to_zero, steps=3)
    rep = top3(w, "overflow", "mlp")
    f = next(f for f in rep.findings if f.module == "mlp")
    assert f.phase == "forward" and f.step == 0
    # gate and up were finite: they are not blamed
    assert not any(g.module in ("mlp.gate", "mlp.up") and g.severity == "error" for g in rep.findings)


class Contrastive(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 16)
        self.logit_scale = nn.Parameter(torch.tensor(12.0))

    def forward(self, a, b):
        za, zb = self.enc(a), self.enc(b)
        return torch.exp(self.logit_scale) * (za @ zb.t())


class CLIPLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = Contrastive()

    def forward(self, a, b):
        return F.cross_entropy(self.tower(a, b).float(), torch.arange(a.shape[0]))


def test_contrastive_logit_scale_overflow():
    torch.manual_seed(0)
    m = CLIPLike()
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    w = train(m, lambda i: (a, b), lambda out, *x: out, steps=3)
    top3(w, "overflow", "tower")


def test_clip_before_unscale_is_named_with_its_line():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(32, 8)
    w = train(m, lambda i: (x,), mse_to_zero, steps=3, clip=1.0, correct_order=False, opt="sgd")
    rep = w.report()
    f = rep.findings[0]
    assert f.rule == "clip_before_unscale" and f.severity == "error"
    assert f.evidence["file"].endswith("scenarios.py") and f.evidence["norm_seen"] > 1000
    # the correct order raises nothing
    w2 = train(m, lambda i: (x,), mse_to_zero, steps=3, clip=1.0, correct_order=True, opt="sgd")
    assert not [g for g in w2.report().findings if g.severity != "info"]


def _loop(kind):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    try:
        for it in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(8, 4)).pow(2).mean()
            sc.scale(loss).backward()
            if kind == "update_before_step":
                sc.update()
                sc.step(opt)
            elif kind == "forgot_update":
                sc.step(opt)
            elif kind == "unscale_twice":
                sc.unscale_(opt)
                sc.unscale_(opt)
                sc.step(opt)
                sc.update()
            elif kind == "optimizer_step_on_scaled":
                opt.step()
                sc.update()
    except (RuntimeError, AssertionError):
        pass
    return w


@pytest.mark.parametrize("kind,rule", [("update_before_step", "scaler_misorder"),
                                       ("forgot_update", "missing_scaler_update"),
                                       ("unscale_twice", "scaler_misorder"),
                                       ("optimizer_step_on_scaled", "scaler_misorder")])
def test_scaler_call_order(kind, rule):
    w = _loop(kind)
    rep = w.report()  # after the user's script crashed
    w.close()
    assert rep.findings and rep.findings[0].rule == rule, [f.one_line() for f in rep.findings]
    assert rep.findings[0].evidence["sequence"]


def test_update_only_when_stepping_is_missing_update():
    """shared/cases/missing_scaler_update variant B: update skipped together with the step."""
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    with pytest.raises(RuntimeError):
        for it in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(8, 4)).pow(2).mean() * (1e4 if it == 0 else 1.0)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
            if gn.item() < 5.0:
                sc.step(opt)
                sc.update()
    rep = w.report()
    w.close()
    assert rep.findings[0].rule == "missing_scaler_update"


def test_pure_fp16_updates_round_away():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 1))
    with torch.no_grad():
        m[0].weight.uniform_(0.5, 2.0)
    m = m.half()
    x = torch.randn(64, 16).half()
    y = (x.float() @ (m[0].weight.detach().float().t() - 0.05)).half()
    w = train(m, lambda i: (x,), lambda out, *a: F.mse_loss(out.float(), y.float()), steps=4, scaler=False,
              autocast=False, opt="sgd", lr=1e-3)
    rep = w.report()
    assert ("update_underflow", "0") in [(f.rule, f.module) for f in rep.findings[:3]], rep.findings
    assert any(f.rule == "fp16_master_weights" for f in rep.findings)


def test_fp16_submodule_with_gradscaler():
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2).half()

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))
    m = M()
    with pytest.raises(ValueError):
        train(m, lambda i: (torch.randn(4, 8),), mse_to_zero, steps=2, opt="sgd")
    w = ampdoctor.watch.__globals__["_WATCHED"].get(m)
    rep = w.report()
    w.close()
    assert (rep.findings[0].rule, rep.findings[0].module) == ("fp16_master_weights", "head")


def test_gradients_underflow_without_scaler():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    model = nn.Module()
    model.body = m
    model.head = nn.Linear(32, 1)
    model.forward = lambda x: model.head(model.body(x))
    x, y = torch.randn(4096, 32), torch.randn(4096, 1)
    w = train(model, lambda i: (x,), lambda out, *a: 1e-4 * F.mse_loss(out.float(), y), steps=2, scaler=False,
              opt="sgd")
    top3(w, "underflow", "head")


def test_persistent_nan_collapses_scale_and_names_origin(tmp_path):
    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x, kpm):
            q, k, v = self.qkv(x).chunk(3, -1)
            s = (q @ k.transpose(-1, -2) / 4).masked_fill(kpm[:, None, :], float("-inf"))
            return self.out(torch.softmax(s, -1) @ v)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.attn, self.head = nn.Linear(4, 16), Attn(), nn.Linear(16, 1)

        def forward(self, x, kpm):
            h = self.emb(x)
            return self.head(h + self.attn(h, kpm)).mean()
    x = torch.randn(3, 6, 4)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[2] = True
    w = train(M(), lambda i: (x, kpm), lambda out, *a: out, steps=14, opt="sgd", every=200, run_dir=tmp_path / "r")
    rep = w.report()
    got = [(f.rule, f.module) for f in rep.findings[:3]]
    assert ("nan_origin", "attn") in got and ("loss_scale_collapse", "attn") in got, got
    # the run directory holds the same verdict and a capture of the first bad step
    rep2 = ampdoctor.diagnose(tmp_path / "r")
    assert ("loss_scale_collapse", "attn") in [(f.rule, f.module) for f in rep2.findings]
    assert (tmp_path / "r" / "captures" / "0" / "manifest.json").exists()


class RMSNormFp16(nn.Module):
    """Squares in the working dtype (no .float()): fp16 x**2 overflows for |x| > 256 and the row becomes 0."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_norm_squaring_in_fp16_gives_silent_zeros():
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.norm, self.head = nn.Linear(8, 32), RMSNormFp16(32), nn.Linear(32, 1)

        def forward(self, x):
            return self.head(self.norm(self.up(x)))
    m = M()
    with torch.no_grad():
        m.up.weight.mul_(200)
    x = torch.randn(16, 8)
    w = train(m, lambda i: (x,), mse_to_zero, steps=2, scaler=False)
    top3(w, "overflow", "norm")


def test_adam_eps_vanishes_on_fp16_parameters():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    with ampdoctor.watch(m, opt) as w:
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(4, 8).half()).float().pow(2).mean().backward()
            opt.step()
    rep = w.report()
    assert (rep.findings[0].rule, rep.findings[0].module) == ("eps_underflow", "")
    assert rep.findings[0].evidence["eps"] == 1e-8


def test_transient_overflow_on_an_unsampled_step_is_located_by_replay():
    """Default sampling, no scaler, a loop that skips a non-finite batch: the output check catches step 7,
    its micro-batch is captured, and w.report() replays it to name the layer and op."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with ampdoctor.watch(m, opt) as w:
        for i in range(10):
            opt.zero_grad()
            x = torch.randn(4, 8) * (1e5 if i == 7 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            if not torch.isfinite(loss):
                continue
            loss.backward()
            opt.step()
    rep = w.report()
    f = rep.findings[0]
    assert (f.rule, f.module, f.step) == ("overflow", "0", 7), [g.one_line() for g in rep.findings]
    assert f.op is not None


def test_fp32_min_mask_cast_to_fp16_is_named_as_mask_value_overflow():
    """finfo(float32).min as an additive mask in an fp16 attention (applied twice): it silently becomes -inf,
    a fully padded row turns softmax into NaN."""
    import math

    class Attn(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.qkv, self.d = nn.Linear(d, 3 * d), d

        def forward(self, x, mask):
            q, k, v = self.qkv(x).chunk(3, -1)
            s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
            add = (1 - mask[:, None, :].to(s.dtype)) * torch.finfo(torch.float32).min
            return torch.softmax(s + add + add, -1) @ v

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = Attn(), nn.Linear(16, 1)

        def forward(self, x, mask):
            return self.head(self.attn(x, mask)).float().pow(2).mean()
    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 5)
    mask[1] = 0
    w = train(M(), lambda i: (x, mask), lambda out, *a: out, steps=3, opt="sgd")
    top3(w, "mask_value_overflow", "attn")


def test_an_overflow_behind_a_minus_inf_mask_module_is_still_named():
    from test_healthy import MaskModuleModel
    torch.manual_seed(0)
    m = MaskModuleModel()
    with torch.no_grad():
        m.mlp.weight.mul_(200000.0)  # fp16 overflow in mlp's forward, after the mask module emitted its -inf
    x = torch.randn(2, 6, 8) * 4
    w = train(m, lambda i: (x,), mse_to_zero, steps=3)
    rep = top3(w, "overflow", "mlp")
    assert not any(f.module == "attn.mask" and f.severity == "error" for f in rep.findings)


def test_weights_overflowed_by_an_update_blame_the_update_not_the_layer():
    """A learning rate that overflows pure-fp16 weights: at the next step the layer holding inf weights outputs
    inf, but it did not make it from finite values; the optimizer step before did."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    x = (torch.randn(4, 8) * 4).half()
    w = train(m, lambda i: (x,), mse_to_zero, steps=3, scaler=False, autocast=False, opt="sgd", lr=6e4)
    rep = top3(w, "overflow", "0")
    f = next(f for f in rep.findings if f.module == "0" and f.rule == "overflow")
    # dated at the update that wrote them (step 0), as eps_underflow and update_spike are; found at step 1
    assert f.phase == "optimizer" and f.step == 0 and f.evidence["previous_step"] == 0 and "step 1 began" in f.message
    # the update that wrote them is named as what it was: an update spike at step 0
    spike = next(f for f in rep.findings if f.rule == "update_spike")
    assert spike.step == 0 and spike.module in ("0", "2") and "lr=60000" in spike.message
    assert not any(g.phase == "forward" and g.severity == "error" for g in rep.findings)


def test_fp16_sum_in_the_loss_outside_the_model_is_an_overflow_there():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(256, 8) * 10
    w = train(m, lambda i: (x,), lambda o, *a: (o.half() * 30).pow(2).sum(), steps=3)
    rep = top3(w, "overflow", None)
    f = rep.findings[0]
    assert (f.rule, f.module, f.phase) == ("overflow", None, "forward") and f.evidence["loss"] == float("inf")
    # the NaN gradients of an inf loss are its consequence, not a backward origin inside the model
    assert not any(g.phase == "backward" and g.severity == "error" for g in rep.findings)


def test_fixed_manual_loss_scale_overflowing_the_output_gradient_is_named():
    """No GradScaler: `(loss * 65536).backward()`; the loss is finite but its gradient, cast to the fp16 output,
    is inf before any module's backward runs."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        m[2].weight.mul_(50)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(32, 8) * 5
    with ampdoctor.watch(m, optimizer=opt, every=1) as w:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            (loss * 65536).backward()
            for p in m.parameters():
                p.grad /= 65536
            opt.step()
    rep = top3(w, "overflow", None)
    f = next(f for f in rep.findings if f.module is None and f.rule == "overflow")
    assert f.phase == "backward" and f.step == 0
    assert not any(g.module in ("0", "2") and g.phase == "backward" and g.severity == "error" for g in rep.findings)


class _WideMLPModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mlp, self.head = nn.Linear(16, 64), SwiGLU(64, 256), nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.mlp(self.inp(x)))


def test_overflow_inside_a_module_whose_child_turns_it_into_nan_names_the_module():
    """The product overflows inside `mlp.forward` (no module of its own); `mlp.down` then sums +inf and -inf into
    NaN, so `mlp` outputs only NaN. The NaN made from an inf input is the consequence: `mlp` is the producer."""
    torch.manual_seed(0)
    m = _WideMLPModel()
    with torch.no_grad():
        m.mlp.gate.weight.mul_(400)
        m.mlp.up.weight.mul_(400)
    x = torch.randn(8, 16) * 4
    w = train(m, lambda i: (x,), mse_to_zero, steps=3)
    assert w.steps[0].forward_producer.module == "mlp"
    rep = top3(w, "overflow", "mlp")
    assert rep.findings[0].op == "aten::mul"
    assert not any(f.module == "mlp.down" and f.severity == "error" for f in rep.findings)


class _GPTMLP(nn.Module):
    """nanoGPT's MLP: c_fc -> GELU -> c_proj -> dropout."""

    def __init__(self, d=16):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj, self.dropout = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), \
            nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _MLPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.mlp, self.head = nn.Linear(8, 16), nn.LayerNorm(16), _GPTMLP(), nn.Linear(16, 1)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.mlp(self.ln(h)))


def test_minus_inf_only_overflow_mid_run_is_named_at_the_linear_and_its_first_bad_step():
    """issue 13.4/13.5: at step 3 c_fc's output overflows only to -inf (GELU then makes NaN). Default sampling:
    step 3 is seen by the trip-wire only, step 4 is sampled. The Linear is the producer (not a mask, not the
    parent MLP), at step 3; the summary's first bad step is 3."""
    torch.manual_seed(0)
    m = _MLPNet()
    x = torch.randn(8, 8)

    def batch(i):
        if i == 3:
            with torch.no_grad():
                m.mlp.c_fc.bias.fill_(-65000.0)
                m.mlp.c_fc.weight.mul_(1000)
        return (x,)
    w = train(m, batch, mse_to_zero, steps=6, every=200)
    rep = top3(w, "overflow", "mlp.c_fc")
    f = next(f for f in rep.findings if f.module == "mlp.c_fc")
    assert f.step == 3 and f.phase == "forward", f.one_line()
    assert not any(g.module == "mlp" and g.severity == "error" for g in rep.findings)
    assert rep.summary["first_bad_step"] == 3


def test_learning_rate_ten_is_an_update_spike_at_the_first_update():
    """issue 13.7: AdamW with lr=10 moves every weight by ±10 in one update; the next forward overflows."""
    torch.manual_seed(0)
    m = _MLPNet()
    x = torch.randn(8, 8) * 4
    w = train(m, lambda i: (x,), mse_to_zero, steps=4, every=200, lr=10.0)
    rep = w.report()
    top = [(f.rule, f.step) for f in rep.findings[:3]]
    spike = next((f for f in rep.findings if f.rule == "update_spike"), None)
    assert spike is not None and ("update_spike", spike.step) in top, [f.one_line() for f in rep.findings]
    first_update = next(r.step for r in w.steps if not r.skipped)
    assert spike.step == first_update and "lr=10" in spike.message and "warmup" in spike.message
