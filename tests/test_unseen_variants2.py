"""More variants of shared/FP16.md's failure patterns, each starting at a known step, watched through the public
API only (watch -> ordinary loop -> w.report(), and diagnose(run_dir)), at the default sampling and at every=1:
a VAE decoder's ConvTranspose2d, a hand-written softmax without the max subtracted, an fp16 sum in a pooling
module, a residual add, fp16 sinusoidal timestep embeddings, fp16 gradient accumulation, Adam's eps on fp16
parameters, a learnable temperature applied in a loss outside the model, and a residual stream whose large
offset rounds the signal away before a LayerNorm. Real torch, real hooks, a real GradScaler; the right rule at
the producing module among the first three findings, at the step where it began. Where ampdoctor is wrong the
test is a strict xfail whose reason says what and where."""
import functools
import math


import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import EVERY, amp_loop, no_error_at, randn, top3


loop = functools.partial(amp_loop, steps=8)


def mean_sq(out, *args):
    return out.float().pow(2).mean()


# -- 1. VAE decoder: the last ConvTranspose2d overflows from step 3 on ------------------------------------------------
class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16 * 4 * 4)
        self.up1 = nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1)
        self.act = nn.SiLU()
        self.up2 = nn.ConvTranspose2d(8, 3, 4, stride=2, padding=1)

    def forward(self, z):
        return self.up2(self.act(self.up1(self.fc(z).view(-1, 16, 4, 4))))


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.decoder = nn.Linear(48, 16), Decoder()

    def forward(self, x):
        mu, logvar = self.enc(x.flatten(1)).chunk(2, -1)
        return self.decoder(mu + torch.randn_like(mu) * (0.5 * logvar).exp())


@EVERY
def test_vae_decoder_conv_transpose_overflow_from_step_3(tmp_path, every):
    torch.manual_seed(0)
    m, x = VAE(), randn(4, 3, 4, 4)

    def batch(i):
        if i == 3:  # up2's input stays below 1; its weights (< 3e4) are finite; its sums are not
            with torch.no_grad():
                m.decoder.up2.weight.mul_(3e5)
        return (x,)
    w = loop(m, batch, lambda out, x: F.mse_loss(out.float(), torch.zeros(4, 3, 16, 16)), every=every,
             run_dir=tmp_path / "r")
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = top3(rep, "overflow", "decoder.up2")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::convolution"), f.one_line()
        no_error_at(rep, ("decoder", "decoder.up1", "decoder.act", "decoder.fc", "enc", ""))


# -- 2. hand-written softmax without the max subtracted, inside an attention with q/k/v children --------------------
class NaiveAttn(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.d = d

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(self.d)
        e = torch.exp(s)  # no max subtraction: inf in fp16 once s > 11.09
        return self.o((e / e.sum(-1, keepdim=True)) @ self.v(x))


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(8, 16), NaiveAttn(), nn.Linear(16, 1)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.attn(h))


@EVERY
def test_softmax_without_max_subtraction_is_the_attention_modules_exp(tmp_path, every):
    torch.manual_seed(0)
    m, x = AttnNet(), randn(2, 6, 8)

    def batch(i):
        if i == 3:  # q and k stay below 10, the scores reach ~19: exp overflows, q/k/v do not
            with torch.no_grad():
                m.attn.q.weight.mul_(6)
                m.attn.k.weight.mul_(6)
        return (x,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r")
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = top3(rep, "overflow", "attn")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::exp"), f.one_line()
        no_error_at(rep, ("attn.q", "attn.k", "attn.v", "attn.o", "head"))


# -- 3. an fp16 sum over a long sequence in a pooling module: each value finite, the sum not -------------------------
class SumPool(nn.Module):
    def forward(self, h):
        return h.sum(dim=1)


class PoolNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pool, self.head = nn.Linear(8, 16), SumPool(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.pool(torch.relu(self.emb(x))))


@EVERY
def test_fp16_sum_pooling_overflow_is_the_pool(tmp_path, every):
    torch.manual_seed(0)
    m, x = PoolNet(), randn(2, 512, 8)

    def batch(i):
        if i == 3:  # every value ~200, 512 of them summed: ~1e5 > 65504
            with torch.no_grad():
                m.emb.bias.fill_(200.0)
        return (x,)
    w = loop(m, batch, mean_sq, every=every, run_dir=tmp_path / "r", clip=None, lr=1e-4)
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = top3(rep, "overflow", "pool")
        assert (f.phase, f.step, f.op) == ("forward", 3, "aten::sum"), f.one_line()
        no_error_at(rep, ("emb", "head", ""))


# -- 4. a residual stream growing step by step until the add inside a block overflows ---------------------------------
class Blk(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.blocks = nn.Linear(8, 16), nn.ModuleList(Blk() for _ in range(3))
        self.ln_f, self.head = nn.LayerNorm(16), nn.Linear(16, 1)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))


@EVERY
def test_residual_add_overflow_is_the_block_not_the_next_norm(tmp_path, every):
    """The stream entering blocks.2 grows ×1.1 a step (19.5k, 21.5k, 23.7k, 26k); the branch adds ~44k on the
    same signs: 61.4k, 63.3k, 65.5k, then inf at step 4, made by the add in blocks.2.forward."""
    torch.manual_seed(0)
    m, x = Tower(), randn(8, 8) * 3
    with torch.no_grad():
        m.emb.weight.mul_(3000)
        m.blocks[2].mlp.weight.copy_(torch.eye(16) * 20000)
        m.blocks[2].mlp.bias.zero_()

    def batch(i):
        if i >= 2:
            with torch.no_grad():
                m.emb.weight.mul_(1.1)
        return (x,)
    w = loop(m, batch, mean_sq, steps=7, every=every, run_dir=tmp_path / "r", lr=1e-5)
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = top3(rep, "overflow", "blocks.2")
        assert (f.phase, f.step, f.op) == ("forward", 4, "aten::add"), f.one_line()
        no_error_at(rep, ("ln_f", "blocks.2.ln", "blocks.2.mlp", "head"))


# -- 5. a residual stream with a large offset: fp16 rounds the per-token signal away before a LayerNorm ---------------
def test_large_residual_offset_rounding_the_signal_away_is_not_an_overflow_at_the_norm():
    """Precision, not a forward overflow: each block's branch adds ~12000 to a signal of ~2, the fp16 add rounds the
    signal away (ulp 8 at 12000), so every row entering blocks.1.ln is one constant and the norm returns only its bias
    (an fp32 LayerNorm on the same input too). torch's own LayerNorm accumulates in fp32: its variance cannot
    overflow, so silent_zeros' "flushed to the bias" reading is not for it."""
    torch.manual_seed(0)
    m, x = Tower(), randn(8, 8)

    def batch(i):
        if i >= 3:
            with torch.no_grad():
                for b in m.blocks:
                    b.mlp.bias.fill_(12000.0)
                m.blocks[2].mlp.bias.fill_(30000.0)
        return (x,)
    w = loop(m, batch, mean_sq, steps=6, every=1, lr=1e-4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = m.blocks[0](m.emb(x))
    assert (h == h[:, :1]).all()  # real: every row entering blocks.1.ln is constant after the fp16 add
    rep = w.report()
    # (the forward's rounding is no overflow at the norms; what the backward does is another matter: ln_f's fp16
    # backward on rows of ~54000 overflows at every loss scale, 1 included, so every step from 3 is skipped for good -
    # an error there, in the backward, is the truth, and the replay proves it; the test checks it on its own)
    assert not any(f.rule == "overflow" and f.module in ("blocks.1.ln", "blocks.2.ln", "ln_f") and f.severity == "error"
                   and f.phase != "backward" for f in rep.findings), [f.one_line() for f in rep.findings]
    bwd = [f for f in rep.findings if f.rule == "overflow" and f.severity == "error" and f.phase == "backward"]
    if bwd:
        # the oracle at scale 1: the first norm (in backward order) whose input gradient is non-finite from a finite
        # output gradient (written first as ln_f, which overflows only at the capture's loss scale; at scale 1 it
        # is blocks.1.ln, and the replay names the op that stays non-finite at scale 1)
        m.zero_grad()
        made = []

        def hook(mod, gin, gout, name):
            if all(torch.isfinite(g).all() for g in gout if g is not None) and not all(
                    torch.isfinite(g).all() for g in gin if g is not None):
                made.append(name)
        hs = [mod.register_full_backward_hook(functools.partial(hook, name=n)) for n, mod in m.named_modules()
              if n.endswith("ln") or n == "ln_f"]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mean_sq(m(x))
        loss.backward()  # unscaled: scale 1
        for h in hs:
            h.remove()
        assert not all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
        assert made and bwd[0].module == made[0] and bwd[0].step == 3, (made, bwd[0].one_line())


# -- 6. sinusoidal timestep embedding computed in fp16 -----------------------------------------------------------------
class TimeEmbed(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.lin, self.half = nn.Linear(dim, dim), dim // 2

    def forward(self, t):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(self.half) / self.half).to(t.dtype)
        a = t[:, None] * freqs[None]  # in t's dtype: fp16
        return self.lin(torch.cat([a.sin(), a.cos()], -1))


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.time = TimeEmbed()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x, t):
        return self.body(x + self.time(t))


def _timesteps(tmax, every=None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def batch(i):  # the bug: timesteps handed in as fp16
        return randn(16, 32, seed=i), torch.randint(0, tmax, (16,), generator=g).half()
    return loop(Denoiser(), batch, lambda out, *a: F.mse_loss(out.float(), torch.zeros(16, 32)), steps=4,
                every=every).report()


def test_fp16_timesteps_past_2048_are_precision_loss_at_the_embedding():
    rep = _timesteps(4000)
    pl = [f for f in rep.findings if f.rule == "precision_loss"]
    assert [(f.module, f.severity) for f in pl] == [("time", "warning")], [f.one_line() for f in rep.findings]
    assert pl[0].evidence["dtype"] == "float16" and pl[0].evidence["exact_up_to"] == 2048
    assert rep.findings[0].rule == "precision_loss" and rep.exit_code == 0


def test_fp16_timesteps_up_to_1000_raise_no_error():
    t, f = torch.arange(1000.0), torch.exp(-math.log(10000.0) * torch.arange(16) / 16)
    err = ((t[:, None] * f).sin() - (t.half()[:, None] * f.half()).float().sin()).abs().max()
    assert err > 0.3  # real: the fp16 phases t * freq past 512 are 0.5 apart, sin is off by up to 0.4
    rep = _timesteps(1000)
    assert rep.exit_code == 0 and not [g for g in rep.findings if g.severity == "error"]


def test_fp16_timesteps_up_to_1000_are_precision_loss_at_the_embedding():
    """Exact integers in fp16, but the embedding multiplies them by fractional frequencies in fp16: phases past
    512 are 0.5 apart. A warning at `time`, the module that received them."""
    rep = _timesteps(1000)
    assert ("precision_loss", "time") in [(f.rule, f.module) for f in rep.findings[:3]], \
        [f.one_line() for f in rep.findings]


# -- 7. gradient accumulation into fp16 .grad (pure fp16 model, no scaler) ---------------------------------------------
def _accumulate(every, tmp_path, onset=3, accum=8):
    """Each micro-batch's gradient is finite (|g| <= ~10100); from step 3 on eight are summed into fp16 .grad."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-6)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=tmp_path / "r", **({} if every is None else {"every": every}))
    x = (randn(8, 16) * 4).half()
    single = []
    for i in range(6):
        opt.zero_grad()
        for _ in range(accum if i >= onset else 1):
            (m(x).float() * 600.0).sum().backward()
        if i < onset:
            single.append(max(p.grad.abs().max().item() for p in m.parameters()))
        opt.step()
    w.close()
    assert max(single) < 65504 / 4  # real: one micro-batch is far from the limit; eight of them are not
    return w


def test_fp16_gradient_accumulation_overflow_every_step_is_at_its_step(tmp_path):
    w = _accumulate(1, tmp_path)
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = top3(rep, "overflow", "2")
        assert (f.phase, f.step) == ("backward", 3), f.one_line()
        assert any(g.rule == "fp16_master_weights" for g in rep.findings[:3])


def test_fp16_gradient_accumulation_overflow_default_sampling_is_at_its_step(tmp_path):
    w = _accumulate(None, tmp_path)
    f = top3(w.report(), "overflow", "2")
    assert (f.phase, f.step) == ("backward", 3), f.one_line()


# -- 8. Adam's eps=1e-8 on fp16 parameters: a branch switched on at step 3 gets v == 0 -> inf update ---------------
class AuxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.aux, self.head = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x, use_aux):
        h = torch.tanh(self.body(x))
        if use_aux:  # an auxiliary branch switched on after warm-up: its gradients are small
            h = h + 1e-3 * self.aux(x)
        return self.head(h)


def _adam_fp16(every, onset=3):
    torch.manual_seed(0)
    m = AuxNet().half()
    x = randn(16, 8).half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)  # eps=1e-8 rounds to 0 in fp16
    w = ampdoctor.watch(m, optimizer=opt, **({} if every is None else {"every": every}))
    for i in range(8):
        opt.zero_grad()
        (m(x, i >= onset).float().pow(2).mean() * 1000).backward()
        opt.step()
        if i == onset - 1:
            assert all(torch.isfinite(p).all() for p in m.parameters())
        if i == onset:
            assert not torch.isfinite(m.aux.weight).all()  # real: step 3's update wrote inf into aux
            assert torch.isfinite(m.body.weight).all()
    w.close()
    return w.report()


@EVERY
def test_adam_eps_on_fp16_parameters_is_named(every):
    rep = _adam_fp16(every)
    top3(rep, "eps_underflow", "aux")  # (where the vanished eps divided by 0; was the root, all 6 params fp16)


def test_adam_eps_every_step_names_the_aux_update():
    rep = _adam_fp16(1)
    f = top3(rep, "update_spike", "aux")
    assert f.step == 3
    g = next(g for g in rep.findings if (g.rule, g.module) == ("overflow", "aux"))
    assert (g.phase, g.step) == ("optimizer", 3)  # step 3's update wrote the inf weights (found at step 4)
    no_error_at(rep, ("body", "head"))


def test_adam_eps_default_sampling_names_aux_not_body():
    """aux's weights are inf from step 3's update; step 4 (unsampled, captured) goes NaN and its NaN gradients are
    applied (no scaler), so by sampled step 5 body and head hold NaN weights too: a consequence of step 4, whose
    origin the replay of its capture names (aux's addmm), not an origin of their own at step 5."""
    rep = _adam_fp16(None)
    assert any(f.module == "aux" and f.step is not None and f.step <= 4 for f in rep.findings[:3]), \
        [f.one_line() for f in rep.findings]
    no_error_at(rep, ("body", "head"))


@EVERY
def test_adam_eps_finding_carries_the_step_it_broke(every):
    """eps_underflow names the optimizer's hyper-parameters, and the step whose update they broke: step 3 (seen
    as an inf update at every=1; at the default sampling, the update before the first bad step, 4)."""
    f = next(f for f in _adam_fp16(every).findings if f.rule == "eps_underflow")
    assert f.step == 3, f.one_line()


# -- 9. a learnable temperature multiplied in a loss outside the model ---------------------------------------------------
class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 32)
        self.log_t = nn.Parameter(torch.tensor(9.0))  # used only by the loss

    def forward(self, a, b):
        za = F.normalize(self.enc(a).float(), dim=-1).half()
        zb = F.normalize(self.enc(b).float(), dim=-1).half()
        return za @ zb.t()  # cosine similarities, |s| <= 1


def _temperature(every, tmp_path):
    torch.manual_seed(0)
    m = Scorer()
    a = randn(16, 16)
    b = a + 0.05 * randn(16, 16, seed=1)

    def batch(i):
        with torch.no_grad():
            m.log_t.add_(0.5)  # 9.5, 10, 10.5, 11, then 11.5 at step 4: exp(t) = 98716 > 65504
        return (a, b)

    def loss_fn(sim, a, b):
        logits = sim * m.log_t.exp()  # fp16 * fp32 0-d -> fp16: +inf, then cross_entropy's inf - inf = NaN
        return F.cross_entropy(logits.float(), torch.arange(16))
    return loop(m, batch, loss_fn, every=every, run_dir=tmp_path / "r", clip=None, lr=1e-4)


def test_temperature_in_the_loss_every_step_is_outside_the_model_at_step_4(tmp_path):
    w = _temperature(1, tmp_path)
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = next(f for f in rep.findings[:3] if f.module is None and f.rule in ("overflow", "nan_origin"))
        assert (f.phase, f.step) == ("forward", 4), f.one_line()
        no_error_at(rep, ("", "enc"))


def test_temperature_in_the_loss_default_sampling_is_at_step_4(tmp_path):
    w = _temperature(None, tmp_path)
    f = next(f for f in w.report().findings[:3] if f.module is None and f.rule in ("overflow", "nan_origin"))
    assert f.step == 4, f.one_line()


@EVERY
def test_temperature_in_the_loss_is_an_overflow(tmp_path, every):
    """The first non-finite value is +inf from the fp16 `sim * exp(t)`; cross_entropy turns it into a NaN loss.
    The records see only the NaN loss (it was `nan_origin`); the loss's own autograd ops (mul, exp, a cast,
    log_softmax, nll_loss) cannot make NaN from finite values, so an inf came first: an overflow."""
    w = _temperature(every, tmp_path)
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = top3(rep, "overflow", None)
        assert (f.phase, f.step) == ("forward", 4), f.one_line()


@EVERY
def test_sqrt_of_a_negative_in_the_loss_stays_a_nan_origin(tmp_path, every):
    """A NaN the loss computation makes from finite values (sqrt of a negative, from step 3) is not an overflow:
    its ops include one that makes NaN from finite inputs."""
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), randn(16, 8)
    shift = {"v": 0.0}

    def batch(i):
        shift["v"] = 100.0 if i >= 3 else 0.0
        return (x,)
    w = loop(m, batch, lambda out, x: (out.float() - shift["v"]).abs().mul(-1 if shift["v"] else 1).add(1e-3)
             .sqrt().mean(), every=every, run_dir=tmp_path / "r", clip=None)
    for rep in (w.report(), ampdoctor.diagnose(tmp_path / "r")):
        f = top3(rep, "nan_origin", None)
        assert f.step == 3, f.one_line()
