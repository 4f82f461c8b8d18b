"""Healthy runs that must raise no warning and no error (shared/CONTRACT.md), beyond tests/test_healthy.py and
tests/test_healthy_more.py: a regression head whose bias crosses zero under Adam, inputs with outlier batches or
heavy tails over a few hundred steps at every=1 (the headroom series), a long run at the default sampling, masked
causal attention (-inf, -1e4, finfo.min, additive, SDPA) with non-reentrant activation checkpointing, LoRA
adapters on a frozen base, a fine-tune at lr 1e-5 with fp32 master weights, a GroupNorm/SiLU UNet on a diffusion
noise-prediction loss, InfoNCE at temperature 0.07 in fp32, CTC, a seq2seq GRU with teacher forcing, focal loss,
label smoothing with dropout 0.5, and SGD/Adagrad/RMSprop/AdamW (foreach on and off). Real torch, real hooks, fp16
autocast on the CPU with a real GradScaler (bf16 without one where said); judged through w.report() and
ampdoctor.diagnose(run_dir)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor
from ampdoctor.records import ParamStat, RunMeta, StepRecord
from ampdoctor.rules import RuleConfig, RunData
from ampdoctor.rules.updates import update_spike
from scenarios import alarms, gen, one_thread


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def quiet(w, run_dir=None):
    rep = w.report()
    assert not alarms(rep.findings) and rep.exit_code == 0, alarms(rep.findings)
    if run_dir is not None:
        assert not alarms(ampdoctor.diagnose(run_dir).findings)
    return rep


def loop(model, batch, loss_fn, *, steps=30, every=None, opt=None, sched=None, clip=1.0, dtype=torch.float16,
         run_dir=None):
    """zero_grad -> forward under autocast -> scale(loss).backward -> unscale_ -> clip -> step -> update ->
    scheduler (fp16 with a GradScaler; bf16 without one). Asserts the run is healthy: finite losses, falling,
    at most a few skipped steps. Returns (watch, losses)."""
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = sched(opt) if sched else None
    sc = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir, **({} if every is None else {"every": every}))
    losses, backoffs = [], 0
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        args = batch(i)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model(*args), args)
        (sc.scale(loss) if sc else loss).backward()
        losses.append(loss.item())
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if sc:
            before = sc.get_scale()
            sc.step(opt)
            sc.update()
            backoffs += sc.get_scale() < before
        else:
            opt.step()
        if sched:
            sched.step()
    w.close()
    k = max(1, steps // 5)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-k:]) < sum(losses[:k]), (losses[:k], losses[-k:])
    assert backoffs <= 4
    return w, losses


def ce(out, args):
    return F.cross_entropy(out.float(), args[-1])


# -- false alarms found by this hunt (each failed before its fix) --------------------------------------------------
class Regressor(nn.Module):
    def __init__(self, d=8, bias=None):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 1))
        if bias is not None:
            with torch.no_grad():
                self.f[2].bias.fill_(bias)

    def forward(self, x, y):
        return self.f(x).squeeze(1)


def test_regression_head_bias_crossing_zero_under_adam_is_no_spike(tmp_path):
    """Adam at lr 1e-2 marches the output bias from -0.05 to the targets' mean (+2) at ~lr per update; it passes
    zero (0.0098 -> 0.0197: x2.01 in one update, its rms past 1e-3) — an update_spike warning. Against the norm it
    had before (0.05) that is no spike."""
    torch.manual_seed(0)
    m = Regressor(bias=-0.05)
    W = torch.randn(8, generator=gen(3))
    batch = lambda i: (lambda x: (x, x @ W + 2.0))(torch.randn(64, 8, generator=gen(i % 20)))  # noqa: E731
    w, _ = loop(m, batch, lambda o, a: F.mse_loss(o.float(), a[1]), steps=40, every=1, run_dir=tmp_path / "r",
                opt=torch.optim.Adam(m.parameters(), lr=1e-2))
    quiet(w, tmp_path / "r")


def _norm_run(norms):
    meta = RunMeta(modules=[["", "Net", 0], ["fc", "Linear", 1]], scaler={"enabled": True},
                   optimizer={"class": "Adam", "groups": [{"lr": 0.01}]})
    steps = [StepRecord(step=s, sampled=True, scale=1.0, loss=1.0, loss_finite=True,
                        params=[ParamStat("fc.bias", "fc", "float32", 1, weight_norm=b0, weight_norm_after=b1)])
             for s, (b0, b1) in enumerate(zip(norms, norms[1:]))]
    return RunData(meta, steps)


def test_a_weight_that_shrank_and_then_spikes_past_its_own_scale_still_warns():
    crossing = [0.05, 0.04, 0.03, 0.02, 0.0098, 0.0197, 0.0297, 0.0397]
    assert update_spike(_norm_run(crossing), RuleConfig()) == []
    spiked = crossing[:6] + [0.5, 0.5]  # x25 in one update, ten times the norm it ever had
    f = update_spike(_norm_run(spiked), RuleConfig())
    assert [(x.rule, x.module, x.step, x.severity) for x in f] == [("update_spike", "fc", 5, "warning")]


class Tabular(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                               nn.Linear(64, 1))

    def forward(self, x, y):
        return self.f(x).squeeze(1)


_WT = torch.randn(16, generator=gen(9))


def _tabular(x):
    return (x, torch.tanh(x @ _WT / 4))


def test_two_outlier_batches_are_no_steady_headroom_trend(tmp_path):
    """Two corrupted batches (x300) at steps 250 and 333: `f.0`'s output comes within 6.3 bits of the fp16 max on those
    steps only, and a slow drift before them made the window's slopes negative — a headroom_trend warning
    ('losing headroom steadily ... forecast to overflow around step 379') on a run that never overflows."""
    def batch(i):
        x = torch.randn(64, 16, generator=gen(i % 30))
        x = x * 300 if i in (250, 333) else x
        return (x, torch.tanh(x @ _WT))
    torch.manual_seed(0)
    w, _ = loop(Tabular(), batch, lambda o, a: F.smooth_l1_loss(o.float(), a[1]), steps=260, every=1,
                run_dir=tmp_path / "r")
    quiet(w, tmp_path / "r")


def _student_t(df):
    def batch(i):
        z = torch.randn(64, 16, generator=gen(i))
        v = 2 * torch._standard_gamma(torch.full((64, 1), df / 2), generator=gen(10000 + i))  # chi2(df) per row
        return _tabular(z / (v / df).sqrt())
    return batch


@pytest.mark.parametrize("df,steps", [(2.0, 400), (1.5, 400)])
def test_heavy_tailed_inputs_are_no_headroom_trend(df, steps):
    """Unnormalised heavy-tailed features (Student-t): the first layer's abs-max jumps from batch to batch by
    several bits. Noise with no trend was read as a steady fall (df 2: 7.7 bits at step 335, 'forecast to overflow
    around step 427') in a run that never overflows; df 1.5: a 12-step window falling 0.4 bits/step from ~9 bits
    read as a steady trend until a warning needed the trend line below the series' own history by more than its
    noise."""
    torch.manual_seed(0)
    w, _ = loop(Tabular(), _student_t(df), lambda o, a: F.smooth_l1_loss(o.float(), a[1]), steps=steps, every=1)
    quiet(w)


# -- healthy runs already quiet: guards ----------------------------------------------------------------------------
class MaskedAttn(nn.Module):
    def __init__(self, mode, ckpt=False, V=48, d=32, h=4):
        super().__init__()
        self.emb, self.ln, self.qkv = nn.Embedding(V, d), nn.LayerNorm(d), nn.Linear(d, 3 * d)
        self.proj, self.head = nn.Linear(d, d), nn.Linear(d, V)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.mode, self.ckpt, self.h = mode, ckpt, h

    def attn(self, x, pad):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(self.ln(x)).split(C, -1))
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None] | ~pad[:, None, None, :]
        if self.mode == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)
        else:
            att = (q @ k.transpose(-1, -2)) * (C // self.h) ** -0.5
            if self.mode == "additive":
                att = att + torch.zeros(mask.shape, dtype=att.dtype).masked_fill(mask, torch.finfo(att.dtype).min)
            else:
                fill = {"inf": float("-inf"), "1e4": -1e4, "finfo": torch.finfo(att.dtype).min}[self.mode]
                att = att.masked_fill(mask, fill)
            o = att.softmax(-1) @ v
        return x + self.proj(o.transpose(1, 2).reshape(B, T, C))

    def forward(self, idx, pad, y):
        x = self.emb(idx)
        x = checkpoint(self.attn, x, pad, use_reentrant=False) if self.ckpt else self.attn(x, pad)
        x = x + (checkpoint(self.mlp, x, use_reentrant=False) if self.ckpt else self.mlp(x))
        return self.head(x)


def _masked_batch(i, V=48, B=6, T=12):
    idx = torch.randint(1, V, (B, T), generator=gen(i % 8))
    pad = torch.arange(T)[None] < torch.randint(4, T + 1, (B,), generator=gen(100 + i % 8))[:, None]
    return idx, pad, torch.roll(idx, -1, 1).masked_fill(~pad, -100)


@pytest.mark.parametrize("mode,ckpt,dtype", [("inf", False, torch.float16), ("1e4", False, torch.float16),
                                             ("finfo", True, torch.float16), ("additive", False, torch.float16),
                                             ("sdpa", True, torch.float16), ("inf", True, torch.bfloat16)])
def test_masked_causal_attention_with_padding_and_checkpointing(mode, ckpt, dtype, tmp_path):
    torch.manual_seed(0)
    w, _ = loop(MaskedAttn(mode, ckpt), _masked_batch,
                lambda o, a: F.cross_entropy(o.float().flatten(0, 1), a[2].flatten(), ignore_index=-100),
                steps=30, every=1, dtype=dtype, run_dir=tmp_path / "r")
    quiet(w, tmp_path / "r")


class LoRA(nn.Module):
    def __init__(self, d_in, d_out, r=4, alpha=8):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, d_in) / math.sqrt(d_in))
        self.B = nn.Parameter(torch.zeros(d_out, r))
        self.s = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.A.t() @ self.B.t()) * self.s


class Classifier(nn.Module):
    def __init__(self, d=32, p=0.0, lora=False):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        lin = (lambda i, o: LoRA(i, o)) if lora else nn.Linear  # noqa: E731
        self.f = nn.Sequential(lin(d, 128), nn.ReLU(), nn.Dropout(p), lin(128, 128), nn.ReLU(), nn.Dropout(p),
                               nn.Linear(128, 10))
        if lora:
            self.emb.requires_grad_(False)
            self.f[-1].requires_grad_(False)

    def forward(self, idx, y):
        return self.f(self.emb(idx).mean(1))


def _cls_batch(i):
    idx = torch.randint(0, 64, (16, 8), generator=gen(i % 10))
    return idx, idx[:, 0] % 10


def _focal(out, args, gamma=2.0):
    logp = F.log_softmax(out.float(), -1).gather(1, args[1][:, None]).squeeze(1)
    return (-(1 - logp.exp()) ** gamma * logp).mean()


@pytest.mark.parametrize("case", ["lora", "lora_bf16", "finetune_1e-5", "dropout_label_smoothing", "focal", "sgd_0.1",
                                  "adagrad", "rmsprop", "adamw_foreach", "adamw_for_loop"])
def test_classifier_variants(case):
    torch.manual_seed(0)
    m = Classifier(p=0.5 if case == "dropout_label_smoothing" else 0.0, lora=case.startswith("lora"))
    params = [p for p in m.parameters() if p.requires_grad]
    loss, dtype, clip = ce, torch.float16, 1.0
    if case == "finetune_1e-5":  # "pretrained" in fp32 first, then fine-tuned with fp32 master weights
        o = torch.optim.AdamW(params, lr=3e-3)
        for i in range(150):
            x, y = _cls_batch(i)
            o.zero_grad()
            F.cross_entropy(m(x, y), y).backward()
            o.step()
    opt = {"lora": lambda: torch.optim.AdamW(params, lr=1e-3), "lora_bf16": lambda: torch.optim.AdamW(params, lr=1e-3),
           "finetune_1e-5": lambda: torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01),
           "sgd_0.1": lambda: torch.optim.SGD(params, lr=0.1), "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-2),
           "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3),
           "adamw_foreach": lambda: torch.optim.AdamW(params, lr=1e-3, fused=False, foreach=True),
           "adamw_for_loop": lambda: torch.optim.AdamW(params, lr=1e-3, foreach=False)}.get(case, lambda: None)()
    if case == "lora_bf16":
        dtype = torch.bfloat16
    if case == "dropout_label_smoothing":
        loss = lambda o, a: F.cross_entropy(o.float(), a[1], label_smoothing=0.1)  # noqa: E731
    if case == "focal":
        loss = _focal
    if case == "sgd_0.1":
        clip = None
    w, _ = loop(m, _cls_batch, loss, steps=60, every=1, opt=opt, dtype=dtype, clip=clip)
    quiet(w)


def test_long_run_at_the_default_sampling(tmp_path):
    """400 steps: sampled at 0 and 200, the trip-wire and headroom series on every step, GradScaler's first
    backoffs at the start."""
    torch.manual_seed(0)
    W = torch.randn(16, 4)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    batch = lambda i: (lambda x: (x, x @ W))(torch.randn(32, 16, generator=gen(i)))  # noqa: E731
    w, _ = loop(_Positional(m), batch, lambda o, a: F.mse_loss(o.float(), a[1]), steps=400, run_dir=tmp_path / "r")
    quiet(w, tmp_path / "r")


class _Positional(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, *rest):
        return self.m(x)


class ResB(nn.Module):
    def __init__(self, c, tdim=16):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.t, self.n2, self.c2 = nn.Linear(tdim, c), nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x))) + self.t(temb)[:, :, None, None]
        return x + self.c2(F.silu(self.n2(h)))


class TinyUNet(nn.Module):
    def __init__(self, c=8, tdim=16):
        super().__init__()
        self.inc, self.tmlp = nn.Conv2d(3, c, 3, padding=1), nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU())
        self.d1, self.down, self.mid = ResB(c), nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), ResB(2 * c)
        self.up, self.u1 = nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1), ResB(c)
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))
        self.abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)

    def forward(self, x0, t, noise):
        a = self.abar[t][:, None, None, None]
        freqs = torch.exp(-math.log(10000) * torch.arange(8) / 8)
        te = self.tmlp(torch.cat([(t[:, None] * freqs).sin(), (t[:, None] * freqs).cos()], -1))
        h1 = self.d1(self.inc(a.sqrt() * x0 + (1 - a).sqrt() * noise), te)
        return self.out(self.u1(self.up(self.mid(self.down(h1), te)) + h1, te))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_groupnorm_unet_diffusion_noise_prediction(dtype):
    def batch(i):
        x0 = torch.randn(4, 3, 8, 8, generator=gen(i % 4)).clamp(-1, 1)
        return x0, torch.randint(0, 1000, (4,), generator=gen(1000 + i)), torch.randn(4, 3, 8, 8, generator=gen(2000 + i))
    torch.manual_seed(0)
    m = TinyUNet()
    w, _ = loop(m, batch, lambda o, a: F.mse_loss(o.float(), a[2]), steps=25, every=1, dtype=dtype,
                opt=torch.optim.AdamW(m.parameters(), lr=2e-3))
    quiet(w)


class TwoTower(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, d))
        self.txt = nn.Sequential(nn.Embedding(64, d), nn.Flatten(1), nn.Linear(8 * d, 64), nn.GELU(), nn.Linear(64, d))

    def forward(self, im, tx):
        return self.img(im), self.txt(tx)


def test_infonce_temperature_0_07_in_fp32_from_fp16_embeddings():
    def batch(i):
        tx = torch.randint(0, 64, (32, 8), generator=gen(i % 10))
        return F.one_hot(tx, 64).float()[:, :, :48].sum(1) + 0.1 * torch.randn(32, 48, generator=gen(i)), tx

    def infonce(out, args, T=0.07):
        zi, zt = (F.normalize(z.float(), dim=-1) for z in out)
        logits, y = zi @ zt.t() / T, torch.arange(len(zi))
        return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
    torch.manual_seed(0)
    w, _ = loop(TwoTower(), batch, infonce, steps=40, every=1)
    quiet(w)


class CTCNet(nn.Module):
    def __init__(self, C=12, d=32):
        super().__init__()
        self.conv, self.rnn = nn.Conv1d(16, d, 3, padding=1), nn.GRU(d, d, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * d, C)

    def forward(self, x, *rest):
        h, _ = self.rnn(F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2))
        return self.out(h)


def test_ctc_loss_on_a_bidirectional_gru():
    def batch(i):
        tg = torch.randint(1, 12, (8, 10), generator=gen(i % 6))
        return (torch.randn(8, 40, 16, generator=gen(50 + i % 6)), tg, torch.full((8,), 40),
                torch.randint(5, 11, (8,), generator=gen(90 + i % 6)))
    torch.manual_seed(0)
    m = CTCNet()
    w, _ = loop(m, batch, lambda o, a: F.ctc_loss(o.float().log_softmax(-1).transpose(0, 1), a[1], a[2], a[3],
                                                  zero_infinity=True),
                steps=40, every=1, opt=torch.optim.AdamW(m.parameters(), lr=3e-3))
    quiet(w)


class Seq2Seq(nn.Module):
    def __init__(self, V=20, d=32):
        super().__init__()
        self.emb, self.enc, self.dec = nn.Embedding(V, d), nn.GRU(d, d, batch_first=True), nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, V)

    def forward(self, src, tgt_in, tgt_out):
        _, h = self.enc(self.emb(src))
        return self.out(self.dec(self.emb(tgt_in), h)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_seq2seq_gru_teacher_forcing(dtype):
    def batch(i):
        src = torch.randint(3, 20, (16, 10), generator=gen(i % 10))
        tgt = src.flip(1)
        return src, torch.cat([torch.ones(16, 1, dtype=torch.long), tgt[:, :-1]], 1), tgt
    torch.manual_seed(0)
    m = Seq2Seq()
    w, _ = loop(m, batch, lambda o, a: F.cross_entropy(o.float().flatten(0, 1), a[2].flatten()), steps=60, every=1,
                dtype=dtype, opt=torch.optim.AdamW(m.parameters(), lr=3e-3))
    quiet(w)
