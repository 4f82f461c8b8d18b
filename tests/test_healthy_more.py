"""More healthy runs that must raise no warning and no error (shared/CONTRACT.md), beyond tests/test_healthy.py and
tests/test_unseen_variants.py: Hugging Face models from tiny configs with AdamW and a linear warmup, a ResNet-style
CNN with SGD momentum and label smoothing, recurrent language models with clipping and tied weights, an
EmbeddingBag, gradient accumulation with an EMA copy and an eval loop, frozen layers, a GAN stepping two
optimizers on one scaler with a backward in between, and a regression on unnormalised targets whose large loss
makes GradScaler back off at the start. Real torch, real hooks, fp16 autocast on the CPU with a real GradScaler
(bf16 without one where said); judged through w.report(), ampdoctor.diagnose(run_dir) and the CLI."""
import copy
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from cpucaps import need_lstm_under_autocast
from ampdoctor.records import ParamStat, RunMeta, StepRecord
from ampdoctor.rules import RuleConfig, RunData
from ampdoctor.rules.headroom import headroom_trend
from ampdoctor.rules.updates import update_spike
from scenarios import alarms, gen, one_thread


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def quiet(w, run_dir=None, cli=False):
    rep = w.report()
    assert not alarms(rep.findings) and rep.exit_code == 0, alarms(rep.findings)
    if run_dir is not None:
        assert not alarms(ampdoctor.diagnose(run_dir).findings)
    if cli:
        out = run_dir.parent / (run_dir.name + ".json")
        r = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(run_dir), "--json", str(out),
                            "--no-html"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        assert not alarms(json.loads(out.read_text())["findings"])
    return rep


def loop(model, batch, loss_fn, *, steps=30, every=None, opt=None, sched=None, clip=1.0, accum=1,
         dtype=torch.float16, scaler=True, ema=False, eval_every=0, set_to_none=True, run_dir=None):
    """The loop people write: zero_grad -> (accum x forward/backward) -> unscale_ -> clip -> step -> update ->
    scheduler -> EMA -> eval under no_grad. `batch(i)` gives kwargs (a dict) or positional args; `loss_fn(out,
    args)` the loss. Returns (watch, losses)."""
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = sched(opt) if sched else None
    sc = torch.amp.GradScaler("cpu") if scaler else None
    shadow = copy.deepcopy(model) if ema else None
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir, **({} if every is None else {"every": every}))
    call = lambda m, a: m(**a) if isinstance(a, dict) else m(*a)  # noqa: E731
    losses = []
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for k in range(accum):
            args = batch(i * accum + k)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(call(model, args), args) / accum
            (sc.scale(loss) if sc else loss).backward()
            total += loss.item()
        losses.append(total)
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        if sched:
            sched.step()
        if shadow is not None:
            with torch.no_grad():
                for pe, p in zip(shadow.parameters(), model.parameters()):
                    pe.lerp_(p, 0.05)
        if eval_every and i % eval_every == 0:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
                call(model, batch(i))
                if shadow is not None:
                    call(shadow, batch(i))
            model.train()
    w.close()
    assert all(math.isfinite(v) for v in losses)
    return w, losses


def warmup_linear(warm, total):
    return lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: min((s + 1) / warm, max(0.0, (total - s) / (total - warm))))


def hf_loss(out, args):
    return out.loss


# -- false alarms found by this hunt (each failed before its fix) --------------------------------------------------
def _gan_loop(steps=15, update=True, every=None):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.2), nn.Linear(64, 2))
    D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    oG = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    oD = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    sc = torch.amp.GradScaler("cpu")
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
    w = ampdoctor.watch(nn.ModuleDict({"G": G, "D": D}), optimizer=oD, scaler=sc,
                        **({} if every is None else {"every": every}))
    try:
        for i in range(steps):
            real = torch.randn(64, 2, generator=gen(i)) * 0.5 + torch.tensor([2.0, -1.0])
            z = torch.randn(64, 16, generator=gen(1000 + i))
            oD.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                fake = G(z)
                loss_d = (F.binary_cross_entropy_with_logits(D(real).float(), ones)
                          + F.binary_cross_entropy_with_logits(D(fake.detach()).float(), zeros))
            sc.scale(loss_d).backward()
            sc.step(oD)
            oG.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = F.binary_cross_entropy_with_logits(D(fake).float(), ones)
            sc.scale(loss_g).backward()
            sc.step(oG)
            if update:
                sc.update()
    except RuntimeError:
        assert not update
    w.close()
    return w


@pytest.mark.parametrize("every", [None, 1])
def test_gan_steps_discriminator_then_generator_on_one_scaler_and_updates_once(every):
    """DCGAN with AMP: backward(D loss), scaler.step(opt_D), backward(G loss), scaler.step(opt_G), one
    scaler.update() per iteration (torch AMP docs: update once, after every optimizer of the iteration stepped).
    The watch starts a step record at each optimizer step; the update is in the next record, not missing."""
    quiet(_gan_loop(every=every))


def test_gan_that_never_updates_is_still_missing_update():
    w = _gan_loop(steps=3, update=False)
    rep = w.report()
    assert rep.findings and rep.findings[0].rule == "missing_scaler_update", [f.one_line() for f in rep.findings]


@pytest.mark.parametrize("every", [None, 1])
def test_regression_on_unnormalised_targets_backs_off_then_fits_quietly(every, tmp_path):
    """MSE on targets around 1000 (+-900): the loss starts near 1e6, GradScaler halves its scale ~11 times before
    the first update, then the output layer grows 0.3 -> ~1700 in 60 steps as the fit proceeds (it settles near
    2300, 5 bits below the fp16 max). Growing towards the targets while the loss falls is not a headroom trend
    (it was a headroom_trend warning forecasting an overflow at step ~80)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    x = torch.randn(256, 8, generator=gen(0))
    y = x[:, :1] * 300 + 1000
    rd = tmp_path / "run"
    w, losses = loop(m, lambda i: (x,), lambda out, a: F.mse_loss(out.float(), y), steps=60, every=every,
                     opt=torch.optim.Adam(m.parameters(), lr=1e-2), clip=None, run_dir=rd)
    assert sum(r.skipped for r in w.steps[:12]) >= 8 and sum(r.skipped for r in w.steps) <= 20
    assert losses[-1] < 0.2 * losses[0]
    quiet(w, rd, cli=every is None)


MODS = [["", "Net", 0], ["hidden", "Linear", 1], ["act", "ReLU", 1], ["out", "Linear", 1]]


def _grow_run(losses, root_carries=True, grow_hidden=False):
    """The output layer (and the root returning it) grows 1.15x per step from 300; `losses` per step."""
    steps = []
    for s, loss in enumerate(losses):
        v = 300.0 * 1.15 ** s
        root = v if root_carries is True else 5.0 if root_carries == "other" else None
        fwd = [root, v / 4 if grow_hidden else 3.0, None, v]
        steps.append(StepRecord(step=s, scale=1.0, loss=loss, loss_finite=True,
                                headroom={"fwd": fwd, "bwd": [None] * 4,
                                          "dtype": ("-" if root is None else "h") + "h-h"}))
    return RunData(RunMeta(modules=MODS, scaler={"enabled": True}), steps)


def test_output_growing_while_the_loss_rises_still_warns():
    f = headroom_trend(_grow_run([1.0 + 0.1 * s for s in range(40)]), RuleConfig())
    assert [(x.rule, x.module, x.severity) for x in f] == [("headroom_trend", "out", "warning")]


def test_output_growing_while_the_loss_falls_is_a_fit_but_an_inner_layer_still_warns():
    falling = [100.0 * 0.95 ** s for s in range(40)]
    assert headroom_trend(_grow_run(falling), RuleConfig()) == []
    # not the model's output (the root returns an fp16 value of its own): judged on its headroom alone
    assert [x.module for x in headroom_trend(_grow_run(falling, root_carries="other"), RuleConfig())] == ["out"]
    # a root whose output is not read (fp32 logits, a returned loss): the last layer is the prediction, a fit
    assert headroom_trend(_grow_run(falling, root_carries=False), RuleConfig()) == []
    # an inner layer growing at the same rate is named on its own
    f = headroom_trend(_grow_run(falling, grow_hidden=True), RuleConfig())
    assert [x.module for x in f] == ["hidden"]


def _bias_run(bias_norms, weight_norms):
    """SGD (momentum) steps of one layer: (before, after) norms of its weight and of its zero-initialised bias."""
    meta = RunMeta(modules=[["", "Net", 0], ["fc", "Linear", 1]], scaler={"enabled": True},
                   optimizer={"class": "SGD", "groups": [{"lr": 0.004}]})
    steps = [StepRecord(step=s, sampled=True, scale=1.0, loss=1.0, loss_finite=True,
                        params=[ParamStat("fc.bias", "fc", "float32", 16, weight_norm=b0, weight_norm_after=b1),
                                ParamStat("fc.weight", "fc", "float32", 256, weight_norm=w0, weight_norm_after=w1)])
             for s, ((b0, b1), (w0, w1)) in enumerate(zip(bias_norms, weight_norms))]
    return RunData(meta, steps)


def test_a_zero_initialised_bias_growing_under_momentum_and_warmup_is_no_spike():
    """The ResNet run below (SGD momentum 0.9, OneCycle warmup): a BatchNorm bias 0 -> 0.0009 -> 0.0021 -> 0.0045
    -> 0.0123 (x2.75 in one update, its rms just past 1e-3) was an update_spike warning. A spike of the layer's
    weight in the same updates still is one."""
    bias = [(0.0, 0.0009), (0.0009, 0.0021), (0.0021, 0.0045), (0.0045, 0.0123), (0.0123, 0.0264)]
    steady = [(4.0, 3.9998)] * 5
    assert update_spike(_bias_run(bias, steady), RuleConfig()) == []
    spiked = steady[:3] + [(4.0, 40.0), (40.0, 40.0)]
    f = update_spike(_bias_run(bias, spiked), RuleConfig())
    assert [(x.rule, x.module, x.step, x.evidence["param"]) for x in f] == [("update_spike", "fc", 3, "fc.weight")]


# -- healthy runs already quiet: guards ----------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def test_hf_bert_sequence_classification_padding_mask_warmup(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    m = transformers.BertForSequenceClassification(cfg)

    def batch(i):
        ids = torch.randint(0, 100, (8, 16), generator=gen(i % 6))
        mask = torch.ones(8, 16, dtype=torch.long)
        mask[:4, 12:] = 0
        return dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, (8,), generator=gen(50 + i % 6)))
    rd = tmp_path / "run"
    w, _ = loop(m, batch, hf_loss, steps=20, opt=torch.optim.AdamW(m.parameters(), lr=5e-4, weight_decay=0.01),
                sched=warmup_linear(5, 20), run_dir=rd)
    quiet(w, rd, cli=True)


def test_hf_gpt2_tied_lm_head_every_step():
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2,
                                                              n_head=4))
    assert m.lm_head.weight is m.transformer.wte.weight

    def batch(i):
        ids = torch.randint(0, 100, (8, 16), generator=gen(i % 6))
        return dict(input_ids=ids, labels=ids)
    w, losses = loop(m, batch, hf_loss, steps=20, every=1,
                     opt=torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), sched=warmup_linear(5, 20))
    assert losses[-1] < losses[0]
    quiet(w)


def test_hf_t5_conditional_generation_every_step():
    torch.manual_seed(0)
    m = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0))

    def batch(i):
        return dict(input_ids=torch.randint(1, 100, (8, 12), generator=gen(i % 6)),
                    labels=torch.randint(1, 100, (8, 6), generator=gen(50 + i % 6)))
    w, _ = loop(m, batch, hf_loss, steps=20, every=1, sched=warmup_linear(5, 20))
    quiet(w)


def test_hf_vit_image_classification():
    torch.manual_seed(0)
    m = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5))

    def batch(i):
        return dict(pixel_values=torch.randn(8, 3, 16, 16, generator=gen(i % 6)),
                    labels=torch.randint(0, 5, (8,), generator=gen(50 + i % 6)))
    w, _ = loop(m, batch, hf_loss, steps=20, opt=torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05),
                sched=warmup_linear(5, 20))
    quiet(w)


class ResBlock(nn.Module):
    def __init__(self, c, stride=1):
        super().__init__()
        cin = c if stride == 1 else c // 2
        self.c1, self.b1 = nn.Conv2d(cin, c, 3, stride, 1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.sc = nn.Identity() if stride == 1 else nn.Sequential(nn.Conv2d(cin, c, 1, stride, bias=False),
                                                                  nn.BatchNorm2d(c))

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.sc(x))


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.l1, self.l2 = ResBlock(8), ResBlock(16, 2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x, y=None):
        return self.fc(F.adaptive_avg_pool2d(self.l2(self.l1(self.stem(x))), 1).flatten(1))


def _images(n, B=8, hw=8):
    return ([torch.randn(B, 3, hw, hw, generator=gen(i)) for i in range(n)],
            [torch.randint(0, 10, (B,), generator=gen(50 + i)) for i in range(n)])


@pytest.mark.parametrize("every", [None, 1])
def test_resnet_sgd_momentum_label_smoothing_onecycle_eval(every):
    torch.manual_seed(0)
    m = ResNet()
    xs, ys = _images(4)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    w, losses = loop(m, lambda i: (xs[i % 4], ys[i % 4]), lambda o, a: F.cross_entropy(o.float(), a[1],
                                                                                         label_smoothing=0.1),
                     steps=30, every=every, opt=opt, clip=None, eval_every=5,
                     sched=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.1, total_steps=31))
    assert losses[-1] < losses[0]
    quiet(w)


def test_accumulation_ema_eval_zero_grad_to_zeros_and_frozen_stem():
    torch.manual_seed(0)
    m = ResNet()
    for p in m.stem.parameters():
        p.requires_grad_(False)
    xs, ys = _images(8, B=4)
    w, _ = loop(m, lambda i: (xs[i % 8], ys[i % 8]), lambda o, a: F.cross_entropy(o.float(), a[1]), steps=12,
                every=1, accum=4, ema=True, eval_every=3, set_to_none=False, sched=warmup_linear(3, 12))
    assert all(r.micro_batches == 4 for r in w.steps)
    quiet(w)


class RnnLM(nn.Module):
    def __init__(self, kind, V=64, d=32, tie=False):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.rnn = getattr(nn, kind)(d, d, num_layers=2, batch_first=True, dropout=0.1)
        self.drop, self.head = nn.Dropout(0.1), nn.Linear(d, V)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x, y=None):
        h, _ = self.rnn(self.drop(self.emb(x)))
        return self.head(self.drop(h))


@pytest.mark.parametrize("kind,dtype", [("GRU", torch.float16), ("LSTM", torch.bfloat16)])
def test_recurrent_lm_tied_head_with_clipping(kind, dtype):
    """fp16 LSTM does not run under CPU autocast in torch 2.13 (oneDNN has no fp16 LSTM primitive): the LSTM
    runs in bf16 without a scaler."""
    if kind == "LSTM":
        need_lstm_under_autocast(dtype)
    torch.manual_seed(0)
    m = RnnLM(kind, tie=True)
    data = (torch.arange(17).repeat(8, 1) * 3 + torch.arange(8)[:, None]) % 64
    w, losses = loop(m, lambda i: (data[:, :-1], data[:, 1:]),
                     lambda o, a: F.cross_entropy(o.float().flatten(0, 1), a[1].flatten()), steps=25,
                     opt=torch.optim.Adam(m.parameters(), lr=3e-3), clip=0.25, dtype=dtype,
                     scaler=dtype == torch.float16)
    assert losses[-1] < 0.8 * losses[0]
    quiet(w)


class BagNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 32, mode="mean")
        self.fc = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, text, offsets, y=None):
        return self.fc(self.bag(text, offsets))


def test_embedding_bag_sgd_step_lr_every_step():
    torch.manual_seed(0)
    m = BagNet()

    def batch(i):
        g = gen(i % 8)
        return torch.randint(0, 1000, (200,), generator=g), torch.arange(0, 200, 10), torch.randint(0, 4, (20,),
                                                                                                     generator=g)
    w, _ = loop(m, batch, lambda o, a: F.cross_entropy(o.float(), a[2]), steps=30, every=1, clip=None,
                opt=torch.optim.SGD(m.parameters(), lr=0.5),
                sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.98))
    quiet(w)
