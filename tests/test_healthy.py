"""Healthy training must produce no warning and no error (shared/CONTRACT.md; issue 3 'No false alarms')."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import ConvNet, TinyGPT, gpt_batch, hf_loss, train


def _no_alarm(w):
    rep = w.report()
    bad = [f.one_line() for f in rep.findings if f.severity in ("error", "warning")]
    assert not bad, bad
    assert rep.exit_code == 0
    return rep


def test_tiny_gpt_fp16_scaler_clip():
    torch.manual_seed(0)
    w = train(TinyGPT(), gpt_batch(), hf_loss, steps=10, clip=1.0, eval_every=3)
    rep = _no_alarm(w)
    assert rep.summary["steps"] == 10
    assert w.steps[0].sampled and w.steps[0].modules


def test_convnet_batchnorm_inplace_relu():
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    w = train(ConvNet(), lambda i: (x,), lambda out, *a: F.cross_entropy(out.float(), y), steps=6)
    _no_alarm(w)


def test_mlp_gradient_accumulation():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    xs = [torch.randn(32, 16) for _ in range(4)]
    w = train(m, lambda i: (xs[i % 4],), lambda out, *a: out.float().pow(2).mean(), steps=6, accum=3)
    _no_alarm(w)
    assert all(r.micro_batches == 3 for r in w.steps)
    # one record per call: three forwards of the root per step
    assert sum(c.module == "" for c in w.steps[0].modules) == 3


def test_bf16_without_scaler():
    torch.manual_seed(0)
    w = train(TinyGPT(), gpt_batch(), hf_loss, steps=6, scaler=False, dtype=torch.bfloat16)
    rep = _no_alarm(w)
    ref = {c.out.ref for r in w.steps for c in r.modules if c.out is not None}
    assert "bfloat16" in ref and "float16" not in ref


def test_first_steps_backoff_is_info_only():
    """shared/cases/first_step_overflow_benign: a few skipped steps while the scale settles are not a problem."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    x, y = torch.randn(256, 8) * 4, torch.randn(256, 1) * 50
    w = train(net, lambda i: (x,), lambda out, *a: F.mse_loss(out.float(), y), steps=30, opt="sgd", every=1)
    rep = _no_alarm(w)
    assert any(f.rule == "skipped_steps" and f.severity == "info" for f in rep.findings)
    assert not any(f.rule == "loss_scale_collapse" for f in rep.findings)
    assert sum(r.skipped for r in w.steps) >= 1
    # the backoff is shown as such, and is not the run's first bad step (issue 18)
    assert rep.summary["first_bad_step"] is None and rep.summary["bad_steps"] == 0
    assert rep.summary["benign_backoff_steps"] and rep.summary["verdict"].startswith("Healthy")


def test_default_sampling_is_healthy_and_sparse():
    torch.manual_seed(0)
    w = train(TinyGPT(), gpt_batch(), hf_loss, steps=5, every=None or 200)
    _no_alarm(w)
    assert [r.sampled for r in w.steps] == [True, False, False, False, False]


class _CausalMask(nn.Module):
    """An additive causal mask built by a module of its own: -inf above the diagonal, by design."""

    def forward(self, x):
        T = x.shape[1]
        return torch.full((T, T), float("-inf"), device=x.device, dtype=x.dtype).triu(1)


class _MaskedAttn(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.mask, self.o = nn.Linear(d, 3 * d), _CausalMask(), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], -1)
        s = q @ k.transpose(-1, -2) / 4 + self.mask(x)
        return self.o(torch.softmax(s, -1) @ v)


class MaskModuleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.mlp, self.head = nn.Linear(8, 16), _MaskedAttn(), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.mlp(self.attn(self.emb(x))))


def test_a_mask_module_emitting_minus_inf_is_not_an_error():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    w = train(MaskModuleModel(), lambda i: (x,), lambda o, *a: o.float().pow(2).mean(), steps=6)
    rep = w.report()
    assert not [f.one_line() for f in rep.findings if f.severity in ("error", "warning")]
    assert rep.exit_code == 0 and rep.summary["first_bad_step"] is None
    info = [f for f in rep.findings if f.module == "attn.mask"]
    assert info and info[0].severity == "info" and info[0].evidence["absorbed"]


def test_two_optimizers_sharing_one_scaler_is_the_documented_pattern():
    """torch AMP docs, "multiple models, losses and optimizers": one GradScaler, unscale_/step per optimizer,
    one update per iteration — not a missing update, not a misorder. Stepping one of them twice still is."""
    import ampdoctor
    torch.manual_seed(0)
    m0 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    m1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=1e-2), torch.optim.Adam(m1.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 8)
    with ampdoctor.watch(nn.ModuleDict({"g": m0, "d": m1}), optimizer=o0, scaler=sc, every=1) as w:
        for _ in range(6):
            o0.zero_grad()
            o1.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                l0, l1 = m0(x).float().pow(2).mean(), (m1(x).float() - 1).pow(2).mean()
            sc.scale(l0).backward(retain_graph=True)
            sc.scale(l1).backward()
            sc.unscale_(o0)
            torch.nn.utils.clip_grad_norm_(m0.parameters(), 1.0)
            sc.unscale_(o1)
            sc.step(o0)
            sc.step(o1)
            sc.update()
    _no_alarm(w)


@pytest.mark.parametrize("every", [1, None])
def test_a_long_first_search_for_a_working_scale_is_info_only(every):
    """A loss whose gradients need a loss scale of 32: GradScaler starts at 65536 and halves 11 times in a row
    before its first update, then trains every step. That is its search, as designed (10 halvings or more are not
    a collapse when they end in updates with a scale >= 1); nothing to warn about."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    xs = [torch.randn(32, 16, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    w = train(net, lambda i: (xs[i],), lambda out, *a: (out.float() * 300.0).pow(2).mean(), steps=40, clip=1.0,
              every=every or 200)
    assert sum(r.skipped for r in w.steps[:12]) >= 10 and not any(r.skipped for r in w.steps[14:])
    rep = _no_alarm(w)
    assert any(f.rule == "skipped_steps" and f.severity == "info" for f in rep.findings)


def test_a_search_that_ends_below_scale_one_is_still_an_error():
    """The same loss 10x larger: the gradients overflow fp16 unscaled (the scale falls below 1)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    xs = [torch.randn(32, 16, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    w = train(net, lambda i: (xs[i],), lambda out, *a: (out.float() * 3000.0).pow(2).mean(), steps=40, clip=1.0)
    rep = w.report()
    assert any(f.rule == "loss_scale_collapse" and f.severity == "error" for f in rep.findings[:3])
