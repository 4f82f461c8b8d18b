"""Healthy runs that must raise no warning and no error (shared/CONTRACT.md), beyond tests/test_healthy.py,
tests/test_healthy_more.py and tests/test_healthy_more2.py, each also with `headroom=True` (the every-step headroom
series): GradScaler with `growth_factor=4` (one probe above a working scale costs two halvings), a non-default
`init_scale`; train/eval switching with dropout and a `torch.no_grad()` validation forward every step; clipping by
value, `clip_grad_norm_(error_if_nonfinite=True)` and `max_norm=0.01`; cosine with restarts, ReduceLROnPlateau and
a warmup from 0; a small GPT whose activations grow while it learns at lr 3e-3; sparse embeddings under SparseAdam
beside Adam on one scaler; weight_norm, a buffer updated in forward and channels_last convs; an autoencoder ending
in sigmoid + BCE; BCEWithLogitsLoss with pos_weight; a VAE's KL in fp32; two losses backwarded separately before
one scaler.step. Real torch, real hooks, fp16 autocast on the CPU with a real GradScaler("cpu"); judged through
w.report() and ampdoctor.diagnose(run_dir)."""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import weight_norm

import ampdoctor
from ampdoctor.records import RunMeta, StepRecord
from ampdoctor.rules import RuleConfig, RunData
from ampdoctor.rules.scaler import scale_timeline

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import TinyGPT, alarms, gen, one_thread  # noqa: E402


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def std_step(loss_fn, *, clip=1.0, clip_value=None, error_if_nonfinite=False):
    """zero_grad -> forward under fp16 autocast -> scale(loss).backward -> unscale_ -> clip -> step -> update."""
    def step(i, model, opt, sc, batch):
        opt.zero_grad(set_to_none=True)
        args = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, args)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, error_if_nonfinite=error_if_nonfinite)
        if clip_value:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        sc.step(opt)
        sc.update()
        return loss.item()
    return step


def healthy(model, opt, batch, step, tmp_path, *, steps=40, every=1, headroom=False, scaler_kw=None, sched=None,
            max_backoffs=4):
    """Runs the loop under a watch, asserts the run is healthy (finite, loss falling, few backoffs unless told)
    and that neither w.report() nor ampdoctor.diagnose(run_dir) raises a warning or an error."""
    sc = torch.amp.GradScaler("cpu", **(scaler_kw or {}))
    sch = sched(opt) if sched else None
    run_dir = tmp_path / "run"
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir, headroom=headroom,
                        **({} if every is None else {"every": every}))
    losses, backoffs = [], 0
    for i in range(steps):
        before = sc.get_scale() if sc.is_enabled() else None
        losses.append(step(i, model, opt, sc, batch))
        backoffs += bool(sc.is_enabled() and sc.get_scale() < before)
        if isinstance(sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sch.step(losses[-1])
        elif sch is not None:
            sch.step()
    w.close()
    k = max(1, steps // 5)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-k:]) < sum(losses[:k]), (losses[:k], losses[-k:])
    assert backoffs <= max_backoffs, backoffs
    rep = w.report()
    assert not alarms(rep.findings) and rep.exit_code == 0, alarms(rep.findings)
    assert not alarms(ampdoctor.diagnose(run_dir).findings)
    return rep


# -- a small classifier with dropout -------------------------------------------------------------------------------
_W = torch.randn(16, 4, generator=gen(99))


def _cls_batch(i):
    x = torch.randn(64, 16, generator=gen(i % 25))
    return x, (x @ _W).argmax(1)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.3),
                         nn.Linear(64, 4))


def _ce(m, a):
    return F.cross_entropy(m(a[0]).float(), a[1])


# -- false alarms found by this hunt (each failed before its fix) --------------------------------------------------
@pytest.mark.parametrize("headroom", [False, True])
def test_growth_factor_4_probes_cost_two_halvings_and_are_benign(headroom, tmp_path):
    """GradScaler(growth_factor=4, growth_interval=20): every growth from the working scale 2^18 lands at 2^20,
    which overflows; GradScaler halves to 2^19 (which may work for a few batches, then overflows) and to 2^18. One
    probe costs two skips where the default factor costs one: 14 skips in 200 steps (7%, never more than 2 in a row,
    the scale ending above its start) were a skipped_steps warning and two backward `overflow` errors ('on every
    step'), where the same run at growth_factor=2 (6 skips) is info. Counted as probes, the rate is the same."""
    m = _mlp()
    rep = healthy(m, torch.optim.AdamW(m.parameters(), lr=3e-3), _cls_batch, std_step(_ce), tmp_path, steps=200,
                  headroom=headroom, scaler_kw={"growth_factor": 4.0, "growth_interval": 20}, max_backoffs=20)
    sk = [f for f in rep.findings if f.rule == "skipped_steps"]
    assert sk and sk[0].severity == "info" and sk[0].evidence["skipped"] >= 10


def _timeline_run(timeline):
    """StepRecords from [(scale, skipped)], every step sampled with a finite forward."""
    meta = RunMeta(modules=[["", "Net", 0]], scaler={"enabled": True, "init_scale": timeline[0][0]},
                   optimizer={"class": "AdamW", "groups": [{"lr": 1e-3}]})
    steps = [StepRecord(step=s, sampled=True, scale=sc, loss=1.0, loss_finite=True, output_finite=True,
                        found_inf=sk, skipped=sk, grad_finite=not sk) for s, (sc, sk) in enumerate(timeline)]
    return RunData(meta, steps)


def test_skips_at_the_scale_that_earned_the_growth_still_warn():
    """The same number of skips (14 in 200) that are not the descent from a growth — each at the scale the run had
    been training at (occasional batches overflowing a settled scale) — is still the skipped_steps warning."""
    tl, scale = [], 2.0 ** 16
    for s in range(200):
        skip = s >= 20 and s % 14 == 6
        tl.append((scale, skip))
        if skip:
            scale /= 2
        elif s % 14 == 7 and s > 20:
            scale *= 2  # grew back after it: the next skip is again at the settled scale
    f = [x for x in scale_timeline(_timeline_run(tl), RuleConfig()) if x.rule == "skipped_steps"]
    assert f and f[0].severity == "warning", [x.one_line() for x in f]


def test_growth_probes_counted_once_keep_a_pathological_growth_interval_warned():
    """growth_interval=3 with growth_factor=4: a probe every 5 steps (2 skips each, 40% of the steps). Counted
    once per probe it is still far above a normal rate: a warning, as the fix text says (growth_interval)."""
    tl, scale, good = [], 2.0 ** 16, 0
    for s in range(200):
        skip = scale > 2.0 ** 16
        tl.append((scale, skip))
        if skip:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == 3:
                scale, good = scale * 4, 0
    f = [x for x in scale_timeline(_timeline_run(tl), RuleConfig()) if x.rule == "skipped_steps"]
    assert f and f[0].severity in ("warning", "error"), [x.one_line() for x in f]


# -- quiet guards: healthy runs that already raise nothing ---------------------------------------------------------
@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("every", [1, None])
def test_train_eval_switching_with_dropout_and_no_grad_validation_every_step(every, headroom, tmp_path):
    base = std_step(_ce)

    def step(i, model, opt, sc, batch):
        model.train()
        loss = base(i, model, opt, sc, batch)
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            x, y = batch(i + 100)
            F.cross_entropy(model(x).float(), y)
        model.train()
        return loss

    m = _mlp()
    healthy(m, torch.optim.AdamW(m.parameters(), lr=3e-3), _cls_batch, step, tmp_path, steps=50, every=every,
            headroom=headroom)


@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("kw", [{"init_scale": 2.0 ** 10}, {"init_scale": 2.0 ** 24}, {"growth_factor": 4.0}],
                         ids=["init_2e10", "init_2e24", "growth4"])
def test_gradscaler_settings(kw, headroom, tmp_path):
    """init_scale 2^24 backs off ~6 times on the first steps (info)."""
    m = _mlp()
    healthy(m, torch.optim.AdamW(m.parameters(), lr=3e-3), _cls_batch, std_step(_ce), tmp_path, steps=50,
            headroom=headroom, scaler_kw=kw, max_backoffs=8)


@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("clip", ["value", "norm_error_if_nonfinite", "tiny_norm_sgd", "tiny_norm_adamw"])
def test_clipping_variants(clip, headroom, tmp_path):
    m = _mlp()
    opt = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) if clip == "tiny_norm_sgd"
           else torch.optim.AdamW(m.parameters(), lr=3e-3))
    step = {"value": std_step(_ce, clip=None, clip_value=0.1),
            "norm_error_if_nonfinite": std_step(_ce, clip=1.0, error_if_nonfinite=True),
            "tiny_norm_sgd": std_step(_ce, clip=0.01), "tiny_norm_adamw": std_step(_ce, clip=0.01)}[clip]
    healthy(m, opt, _cls_batch, step, tmp_path, steps=50, headroom=headroom)


_SCHEDS = {
    "cosine_restarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=10, T_mult=2),
    "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=2, factor=0.3),
    "warmup_from_0": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, s / 20)),
}


@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("sched", sorted(_SCHEDS))
def test_lr_schedulers(sched, headroom, tmp_path):
    m = _mlp()
    healthy(m, torch.optim.AdamW(m.parameters(), lr=1e-2), _cls_batch, std_step(_ce), tmp_path, steps=70,
            headroom=headroom, sched=_SCHEDS[sched])


def test_warmup_from_0_under_sgd_momentum_every_step_headroom(tmp_path):
    m = _mlp()
    healthy(m, torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9), _cls_batch, std_step(_ce), tmp_path, steps=70,
            headroom=True, sched=_SCHEDS["warmup_from_0"])


@pytest.mark.parametrize("headroom", [True, False])
def test_small_gpt_whose_activations_grow_while_it_learns(headroom, tmp_path):
    """A 2-block GPT learning a token map at lr 3e-3 (loss 0.85 -> 0.003): the residual stream and the logits
    grow over the first ~150 steps and settle; headroom series every step."""
    torch.manual_seed(0)
    m = TinyGPT(d=32, n=2)
    batch = lambda i: (lambda x: (x, (x * 3 + 1) % 64))(torch.randint(0, 64, (8, 16), generator=gen(i % 50)))  # noqa: E731
    healthy(m, torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0), batch,
            std_step(lambda m, a: F.cross_entropy(m(a[0]).float().flatten(0, 1), a[1].flatten())), tmp_path,
            steps=200, headroom=headroom)


class _Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.fc = nn.Embedding(500, 32, sparse=True), nn.Linear(32, 5)

    def forward(self, x):
        return self.fc(self.e(x).mean(1))


@pytest.mark.parametrize("headroom", [False, True])
def test_sparse_embedding_sparse_adam_beside_adam_on_one_scaler(headroom, tmp_path):
    torch.manual_seed(0)
    m = _Sparse()
    labels = torch.randint(0, 5, (500,), generator=gen(5))
    sparse_opt, dense_opt = torch.optim.SparseAdam(list(m.e.parameters()), lr=1e-2), torch.optim.Adam(
        m.fc.parameters(), lr=1e-2)

    def batch(i):
        x = torch.randint(0, 500, (64, 4), generator=gen(i % 30))
        return x, labels[x[:, 0]]

    def step(i, model, opt, sc, batch):
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        x, y = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        sc.scale(loss).backward()
        sc.step(sparse_opt)
        sc.step(dense_opt)
        sc.update()
        return loss.item()

    healthy(m, sparse_opt, batch, step, tmp_path, steps=60, headroom=headroom)


class _RunningMean(nn.Module):
    """Subtracts a running mean of its input, a buffer updated in forward (while training)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mu", torch.zeros(3, 1, 1))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mu.mul_(0.9).add_(0.1 * x.float().mean((0, 2, 3))[:, None, None])
                self.n += 1
        return x - self.mu


class _WNConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.rs, self.c1 = _RunningMean(), weight_norm(nn.Conv2d(3, 16, 3, padding=1))
        self.bn, self.c2 = nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1, stride=2)
        self.fc = weight_norm(nn.Linear(16, 4))

    def forward(self, x):
        return self.fc(F.relu(self.c2(F.relu(self.bn(self.c1(self.rs(x)))))).mean((2, 3)))


@pytest.mark.parametrize("headroom", [False, True])
def test_weight_norm_running_buffer_channels_last_convs(headroom, tmp_path):
    torch.manual_seed(0)
    m = _WNConv().to(memory_format=torch.channels_last)

    def batch(i):
        g = gen(i % 20)
        y = torch.randint(0, 4, (16,), generator=g)
        x = torch.randn(16, 3, 8, 8, generator=g) * 0.5 + y[:, None, None, None] * 0.5 + 2.0
        return x.to(memory_format=torch.channels_last), y

    healthy(m, torch.optim.AdamW(m.parameters(), lr=3e-3), batch, std_step(_ce), tmp_path, steps=30,
            headroom=headroom)


_P = torch.rand(8, 64, generator=gen(1))


def _ae_batch(i):
    return ((torch.rand(64, 8, generator=gen(i % 30)) @ _P) / 4).clamp(0, 1),


@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("upcast", ["float", "autocast"])
def test_autoencoder_sigmoid_bce(upcast, headroom, tmp_path):
    """BCE on the sigmoid output, in fp32 by hand or inside the CPU autocast region (which upcasts it)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64),
                      nn.Sigmoid())
    loss = ((lambda m, a: F.binary_cross_entropy(m(a[0]).float(), a[0])) if upcast == "float"
            else (lambda m, a: F.binary_cross_entropy(m(a[0]), a[0])))
    healthy(m, torch.optim.Adam(m.parameters(), lr=3e-3), _ae_batch, std_step(loss, clip=None), tmp_path, steps=60,
            headroom=headroom)


@pytest.mark.parametrize("headroom", [False, True])
def test_bce_with_logits_pos_weight_rare_positives(headroom, tmp_path):
    torch.manual_seed(0)
    W = torch.randn(20, 10, generator=gen(2))
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    pw = torch.full((10,), 15.0)
    batch = lambda i: (lambda x: (x, ((x @ W) > 2.0).float()))(torch.randn(128, 20, generator=gen(i % 30)))  # noqa: E731
    healthy(m, torch.optim.AdamW(m.parameters(), lr=3e-3), batch,
            std_step(lambda m, a: F.binary_cross_entropy_with_logits(m(a[0]).float(), a[1], pos_weight=pw)),
            tmp_path, steps=60, headroom=headroom)


class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.mu, self.lv = nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 8), nn.Linear(64, 8)
        self.dec = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64))

    def forward(self, x):
        h = self.enc(x)
        mu, lv = self.mu(h), self.lv(h)
        return self.dec(mu + torch.randn_like(mu) * torch.exp(0.5 * lv)), mu, lv


def _vae_loss(m, a):
    r, mu, lv = m(a[0])
    mu, lv = mu.float(), lv.float()
    rec = F.binary_cross_entropy_with_logits(r.float(), a[0], reduction="sum") / a[0].shape[0]
    return rec - 0.5 * torch.sum(1 + lv - mu.pow(2) - lv.exp()) / a[0].shape[0]


@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("every", [1, None])
def test_vae_kl_in_fp32(every, headroom, tmp_path):
    torch.manual_seed(0)
    m = _VAE()
    healthy(m, torch.optim.Adam(m.parameters(), lr=1e-3), _ae_batch, std_step(_vae_loss, clip=5.0), tmp_path,
            steps=80, every=every, headroom=headroom)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.cls, self.reg = nn.Linear(64, 4), nn.Linear(64, 1)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h), self.reg(h).squeeze(1)


@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("every", [1, None])
def test_two_losses_backwarded_separately_before_one_step(every, headroom, tmp_path):
    """scaler.scale(l1).backward(retain_graph=True); scaler.scale(l2).backward(): the regression head's first
    backward overflows at 65536 (one info backoff)."""
    torch.manual_seed(0)
    m = _TwoHeads()

    def batch(i):
        x = torch.randn(64, 16, generator=gen(i % 25))
        return x, (x @ _W).argmax(1), (x @ _W)[:, 0]

    def step(i, model, opt, sc, batch):
        opt.zero_grad(set_to_none=True)
        x, y, t = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            c, r = model(x)
            l1, l2 = F.cross_entropy(c.float(), y), F.mse_loss(r.float(), t)
        sc.scale(l1).backward(retain_graph=True)
        sc.scale(l2).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return (l1 + l2).item()

    healthy(m, torch.optim.AdamW(m.parameters(), lr=3e-3), batch, step, tmp_path, steps=60, every=every,
            headroom=headroom)
