"""LATE-ONSET fp16 failures: runs that train healthily for 100-300 steps and then break on an ordinary routine step
far from ampdoctor's fully sampled ones (step 0 and every 200th at the default `every`), so only the per-step
inf/NaN / skip checks, the headroom series and the bad step's own switch to full recording can see them.

Watched through the public API only (`ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=...)` at the default
settings -> an ordinary CPU loop: fp16 autocast, `torch.amp.GradScaler("cpu", init_scale=1024)`, scale(loss).backward
-> unscale_ -> clip_grad_norm_(1.0) -> step -> update [-> sched.step()] -> close() -> report()). Each failure is
first proven by the test's own oracle (probe_harness.Producer with backward hooks: the first module whose output, or
input gradient, is non-finite from finite inputs/output gradient, and its step; the first step whose loss is
non-finite or that the scaler skips, with nothing bad before it). A failing oracle is a plain failure. Then the rule
(CONTRACT.md id) at the producer, at the oracle's step, among the first three findings with severity warning or
error; a wrong report raises WrongAnswer (strict xfail via `wrong`).

Cases:
 1. MLP regressor; at step 150 one sample arrives in raw units (x 1e5): its fp16 cast in `fc1` is inf -> overflow
    at `fc1`, step 150.
 2. small conv net on [0, 1] images; at step 170 one 16-bit microscopy tile is not divided by 65535 (pixels up to
    65535) -> overflow at `conv1`, step 170.
 3. transformer block with a key-padding mask filled with -inf; at step 120 one document is empty after filtering
    (every key padded): softmax of an all -inf row -> nan_origin at `blk.attn`, step 120.
 4. MLP behind a windowed standardiser (`norm`: mean/std buffers over the last 8 batches); a sensor dies at step
    123 (constant column), its window std reaches exactly 0 at step 130 -> 0/0: nan_origin at `norm`, step 130.
 5. regressor on raw targets (~1e5, beyond fp16) with a log-parameterised output gain in its own parameter group at
    lr 0.04 (too high), fit in log space: the gain climbs every step until `gain`'s fp16 output overflows (oracle:
    step 165) -> overflow at `gain` at the oracle's step.
 6. triplet-loss embedder; from step 140 the miner returns the anchor itself as its positive for one triplet:
    d(a, a) = sqrt(0) is finite forward but its backward is inf/NaN at every loss scale -> overflow/nan_origin
    (backward) at `dist`, step 140, and loss_scale_collapse from step 140.
 7. IRNN (ReLU nn.RNN, recurrent weights initialised to 1.05 x identity) on a sequence-length curriculum: 16 steps
    until step 180, 400 after; the hidden state grows ~1.05^T -> overflow at `rnn`, step 180.
 8. SILENT: a `.half()` GRU regressor, SGD(momentum 0.9) under CosineAnnealingLR(T_max=300): once the lr has
    decayed (~step 250) most of the GRU's updates round away (w + dw == w) -> update_underflow at `gru`, at a step
    within 10 steps of the oracle's onset (first 5-step window where >= 50% of its elements with a
    nonzero gradient are left unchanged).
Healthy twins (same runs, fixed; no warning, no error):
 9. twin of 3: the mask filled with finfo(fp16).min (Hugging Face's way): the empty document attends uniformly.
10. twin of 4: the std clamped to >= 1e-3 before the division.
11. twin of 6: the distance computed as sqrt(d2 + 1e-6) in float32.

Result when written (torch 2.13 CPU, default watch): 9 pass, 2 xfail (stable over two runs, ~10 s); 10 pass, 1 xfail
since, then 11 pass. Top findings:
 1. PASS `[error] overflow at fc1 aten::_to_copy step 150`, `[error] skipped_steps (run) step 150`.
 2. XFAIL (wrong) only `[info] skipped_steps at (run) step 170: ... a normal rate for dynamic loss scaling.` The
    oracle: `conv1` turns finite inputs into -inf at step 170 (the ReLU after it drops them, so the loss stays
    finite; the scaler skips the step). Should be overflow (error/warning) at `conv1`, step 170. PASS since
    (analysis/replayfold.py `_skip_explained_by_forward`: the replay of a skip at a scale earlier steps stepped
    with that finds an fp16 op overflowing in the forward makes it the step's error): `[error] overflow at conv1
    aten::convolution step 170`.
 3. PASS `[error] nan_origin at blk.attn aten::_softmax step 120`.
 4. PASS `[error] nan_origin at norm aten::div step 130` ("hit its singular point").
 5. PASS `[error] overflow at gain aten::mul step 165`, `[error] loss_scale_collapse at gain step 165`.
 6. PASS `[error] nan_origin at dist aten::div step 140` (backward of SqrtBackward0), `[error] loss_scale_collapse at
    dist step 140`.
 7. PASS `[error] overflow at rnn aten::addmm step 180`.
 8. XFAIL (wrong step) `[error] fp16_master_weights at (root) step 0`, `[error] update_underflow at gru step 236`
    ("100% of sampled elements"), `[error] update_underflow at head step 253`. The oracle: weight_hh_l0's 5-step
    mean share of unchanged elements first >= 50% at step 216 (~65-70% around 236, not 100%); 236 is 20 steps late.
    PASS since (rules/weights.py `_rounded`: a parameter holding half its module's elements or more is judged on its
    own too; weight_hh_l0's sample is 61% unchanged at step 220 while weight_ih_l0's 32% kept the GRU's share
    under 50% until 236): `[error] update_underflow at gru step 220`.
 9-11. quiet.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# the loop, the oracle's checks, the report's checks
# ======================================================================================================================
def run(m, batch, loss_fn, steps, run_dir, *, opt=None, sched=None, lr=1e-3):
    """The user's loop under a watch at the default settings, with the Producer oracle (forward and backward).
    `batch(i)` gives (args, kwargs, y). Returns a dict: rep, first, first_bwd, bad_loss, skipped, losses."""
    opt = opt or torch.optim.AdamW(m.parameters(), lr=lr)
    sched = sched(opt) if sched else None
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    orc = Producer(m, backward=True, with_kwargs=True)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(run_dir))
    r = dict(bad_loss=[], skipped=[], losses=[])
    for i in range(steps):
        orc.step = i
        args, kw, y = batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(*args, **kw)
        loss = loss_fn(out, y)
        r["losses"].append(loss.item())
        if not math.isfinite(loss.item()):
            r["bad_loss"].append(i)
        s0 = sc.get_scale()
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            r["skipped"].append(i)
        if sched is not None:
            sched.step()
    orc.remove()
    w.close()
    r.update(rep=w.report(), first=orc.first, first_bwd=orc.first_bwd)
    return r


def first_bad(r):
    """The oracle's first bad step: the first step with a non-finite loss or a skip."""
    return min(r["bad_loss"][:1] + r["skipped"][:1], default=None)


def real_fwd(r, name, step):
    """Truth: forward producer `name` at `step`, the first bad step (the scaler skips it; the loss may stay finite
    where a ReLU drops a -inf)."""
    assert r["first"] == (name, step), (r["first"], r["bad_loss"][:3], r["skipped"][:3])
    assert first_bad(r) == step and r["skipped"][0] == step, (r["bad_loss"][:3], r["skipped"][:3])


def real_bwd(r, name, step):
    """Truth: forward finite all run, backward producer `name` at `step`, the first bad step (skipped)."""
    assert r["first"] is None and r["bad_loss"] == [], (r["first"], r["bad_loss"][:3])
    assert r["first_bwd"] == (name, step), r["first_bwd"]
    assert first_bad(r) == step, r["skipped"][:3]


def expect(rep, rules, module, step, phase=None):
    """One of `rules` at `module` (... : any), at `step` (an int or a range), warning/error, among the first three."""
    rules = (rules,) if isinstance(rules, str) else rules
    steps = step if isinstance(step, range) else (step,)
    for f in rep.findings[:3]:
        if f.rule in rules and (module is ... or f.module == module) and f.step in steps \
                and f.severity in ("warning", "error") and (phase is None or f.phase in (None, phase)):
            return f
    raise WrongAnswer(f"wanted {rules} at {module!r} step {step}; got: {lines(rep)[:3]}")


def quiet(r, skips=()):
    """The twin really was healthy (finite losses, no producer, no skip but `skips`, it learned); ampdoctor quiet."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None and r["first_bwd"] is None, (r["first"], r["first_bwd"])
    assert r["skipped"] == list(skips), r["skipped"]
    k = max(1, len(ls) // 10)
    assert sum(ls[-k:]) < 0.9 * sum(ls[:k]), (ls[:k], ls[-k:])
    rep = r["rep"]
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


def mse(out, y):
    return F.mse_loss(out.float(), y)


# ======================================================================================================================
# 1. MLP: a raw-unit sample at step 150
# ======================================================================================================================
class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.head = nn.Linear(d, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


W16 = torch.randn(16, 1, generator=gen(1601)) * 0.5
OUTLIER_AT = 150


def _mlp_batch(i):
    x = torch.randn(32, 16, generator=gen(i % 16))
    y = x @ W16
    if i == OUTLIER_AT:
        x = x.clone()
        x[3] *= 1e5                       # one record in raw units
    return (x,), {}, y


def test_mlp_raw_unit_sample_at_step_150_overflows_fc1(tmp_path):
    r = run(MLP(), _mlp_batch, mse, OUTLIER_AT + 6, tmp_path / "run")
    real_fwd(r, "fc1", OUTLIER_AT)
    expect(r["rep"], FWD, "fc1", OUTLIER_AT)


# ======================================================================================================================
# 2. conv net: an un-normalised 16-bit tile at step 170
# ======================================================================================================================
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.relu(self.conv2(h)).mean((2, 3))
        return self.head(h)


TILE_AT = 170


def _conv_batch(i):
    x = torch.rand(8, 1, 12, 12, generator=gen(100 + i % 16))
    y = x.mean((1, 2, 3))[:, None] * 4 - 2
    if i == TILE_AT:
        x = x.clone()
        x[5] = torch.round(x[5] * 65535)   # a 16-bit tile the loader forgot to divide by 65535
    return (x,), {}, y


def test_conv_raw_16bit_tile_at_step_170_overflows_conv1(tmp_path):
    r = run(ConvNet(), _conv_batch, mse, TILE_AT + 6, tmp_path / "run", lr=3e-3)
    real_fwd(r, "conv1", TILE_AT)
    expect(r["rep"], FWD, "conv1", TILE_AT)


# ======================================================================================================================
# 3./9. transformer block: a fully padded (empty) document at step 120
# ======================================================================================================================
D_T, T_T, V_T = 32, 12, 50
EMPTY_AT = 120


class Attention(nn.Module):
    def __init__(self, fix):
        super().__init__()
        self.qkv, self.o = nn.Linear(D_T, 3 * D_T), nn.Linear(D_T, D_T)
        self.fix = fix

    def forward(self, x, pad):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, D_T // 2).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(D_T // 2)
        s = s.masked_fill(pad[:, None, None, :], torch.finfo(s.dtype).min if self.fix else float("-inf"))
        a = torch.softmax(s, -1)
        return self.o((a @ v).transpose(1, 2).reshape(B, T, D_T))


class Block(nn.Module):
    def __init__(self, fix):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(D_T), Attention(fix)
        self.ln2, self.ff = nn.LayerNorm(D_T), nn.Sequential(nn.Linear(D_T, 64), nn.GELU(), nn.Linear(64, D_T))

    def forward(self, x, pad):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.ff(self.ln2(x))


class DocClf(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.blk, self.head = nn.Embedding(V_T, D_T), Block(fix), nn.Linear(D_T, 3)

    def forward(self, ids, pad):
        h = self.blk(self.emb(ids), pad=pad)
        keep = (~pad).float()[..., None]
        return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))


def _doc_batch(i):
    g = gen(300 + i % 16)
    ids = torch.randint(1, V_T, (8, T_T), generator=g)
    lens = torch.randint(4, T_T + 1, (8,), generator=g)
    if i == EMPTY_AT:
        lens[2] = 0                        # every token of this document was filtered out
    pad = torch.arange(T_T)[None] >= lens[:, None]
    y = (ids[:, 0] % 3)
    return (ids,), {"pad": pad}, y


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def test_attention_fully_masked_document_at_step_120_is_nan_origin_at_attn(tmp_path):
    r = run(DocClf(), _doc_batch, ce, EMPTY_AT + 6, tmp_path / "run")
    real_fwd(r, "blk.attn", EMPTY_AT)
    expect(r["rep"], FWD, "blk.attn", EMPTY_AT)


def test_twin_attention_mask_with_finite_fill_is_quiet(tmp_path):
    quiet(run(DocClf(fix=True), _doc_batch, ce, EMPTY_AT + 6, tmp_path / "run"))


# ======================================================================================================================
# 4./10. a windowed standardiser whose std buffer reaches 0 when a sensor dies
# ======================================================================================================================
WINDOW, DEAD_FROM = 8, 123
ZERO_STD_AT = DEAD_FROM + WINDOW - 1     # the first step whose whole window holds the dead sensor's constant


class WindowNorm(nn.Module):
    """Standardises each feature by the mean/std of the last WINDOW training batches (ring buffer of batches)."""

    def __init__(self, d, fix):
        super().__init__()
        self.register_buffer("window", torch.zeros(WINDOW, 32, d))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("std", torch.ones(d))
        self.fix = fix

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.window[int(self.filled) % WINDOW] = x
                self.filled += 1
                w = self.window[:min(int(self.filled), WINDOW)].flatten(0, 1)
                self.mean.copy_(w.mean(0))
                self.std.copy_(w.std(0) if int(self.filled) > 1 else torch.ones_like(self.std))
        std = self.std.clamp(min=1e-3) if self.fix else self.std
        return (x - self.mean) / std


class SensorNet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.mlp = WindowNorm(16, fix), MLP()

    def forward(self, x):
        return self.mlp(self.norm(x))


def _sensor_batch(i):
    x = torch.randn(32, 16, generator=gen(400 + i % 16)) * 3 + 5
    y = (x - 5) @ W16 / 3
    if i >= DEAD_FROM:
        x = x.clone()
        x[:, 7] = 0.5                      # sensor 7 died: it reads a constant
    return (x,), {}, y


def test_window_std_buffer_reaching_zero_at_step_130_is_nan_origin_at_norm(tmp_path):
    r = run(SensorNet(), _sensor_batch, mse, ZERO_STD_AT + 6, tmp_path / "run")
    real_fwd(r, "norm", ZERO_STD_AT)
    expect(r["rep"], FWD, "norm", ZERO_STD_AT)


def test_twin_window_std_clamped_is_quiet(tmp_path):
    quiet(run(SensorNet(fix=True), _sensor_batch, mse, ZERO_STD_AT + 6, tmp_path / "run"))


# ======================================================================================================================
# 5. a log-parameterised output gain in its own parameter group with too high an lr, raw targets beyond fp16
# ======================================================================================================================
class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_g = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x * torch.exp(self.log_g)


class GainNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.gain = MLP(), Gain()

    def forward(self, x):
        return self.gain(torch.relu(self.body(x)) + 1.0)     # a positive price


def _price_batch(i):
    x = torch.randn(32, 16, generator=gen(500 + i % 16))
    return (x,), {}, torch.exp(x @ W16) * 3e4     # raw prices, log-normal: up to ~1e6, beyond fp16's 65504


def log_mse(out, y):
    return F.mse_loss(out.float().log(), y.log())   # error in log space: bounded gradients, the targets' scale kept


def _gain_opt(m):
    return torch.optim.AdamW([{"params": m.body.parameters()},
                              {"params": m.gain.parameters(), "lr": 0.04, "weight_decay": 0.0}], lr=1e-3)


def test_output_gain_growing_until_its_fp16_output_overflows(tmp_path):
    m = GainNet()
    r = run(m, _price_batch, log_mse, 300, tmp_path / "run", opt=_gain_opt(m))
    bad = first_bad(r)
    assert bad is not None and 100 <= bad < 300 and bad != 200, (bad, r["losses"][::20])
    real_fwd(r, "gain", bad)
    expect(r["rep"], FWD, "gain", bad)


# ======================================================================================================================
# 6./11. triplet loss: the anchor returned as its own positive from step 140 (sqrt(0) backward)
# ======================================================================================================================
SELF_POS_FROM = 140


class Dist(nn.Module):
    def __init__(self, fix):
        super().__init__()
        self.fix = fix

    def forward(self, a, b):
        if self.fix:
            return torch.sqrt(((a.float() - b.float()) ** 2).sum(-1) + 1e-6)
        return torch.sqrt(((a - b) ** 2).sum(-1))


class Triplet(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.dist = Dist(fix)

    def forward(self, a, p, n):
        ea, ep, en = self.enc(a), self.enc(p), self.enc(n)
        return F.relu(self.dist(ea, ep) - self.dist(ea, en) + 1.0).float().mean()


def _triplet_batch(i):
    g = gen(600 + i % 16)
    centres = torch.randn(4, 16, generator=g) * 2
    ca, cn = torch.randint(0, 4, (16,), generator=g), torch.randint(0, 4, (16,), generator=g)
    cn = torch.where(cn == ca, (cn + 1) % 4, cn)
    a = centres[ca] + torch.randn(16, 16, generator=g)
    p = centres[ca] + torch.randn(16, 16, generator=g)
    n = centres[cn] + torch.randn(16, 16, generator=g)
    if i >= SELF_POS_FROM:
        p = p.clone()
        p[0] = a[0]                        # the miner's memory bank now holds the anchor: its own positive
    return (a, p, n), {}, None


def own_loss(out, y):
    return out


def test_triplet_anchor_as_own_positive_from_step_140_collapses_the_loss_scale(tmp_path):
    r = run(Triplet(), _triplet_batch, own_loss, SELF_POS_FROM + 25, tmp_path / "run")
    real_bwd(r, "dist", SELF_POS_FROM)
    assert r["skipped"] == list(range(SELF_POS_FROM, SELF_POS_FROM + 25)), r["skipped"]   # at every scale
    rep = r["rep"]
    expect(rep, FWD, "dist", SELF_POS_FROM, phase="backward")
    expect(rep, "loss_scale_collapse", ..., SELF_POS_FROM)


def test_twin_triplet_distance_with_eps_in_fp32_is_quiet(tmp_path):
    quiet(run(Triplet(fix=True), _triplet_batch, own_loss, SELF_POS_FROM + 25, tmp_path / "run"))


# ======================================================================================================================
# 7. IRNN on a sequence-length curriculum: 16 steps, then 400 from step 180
# ======================================================================================================================
LONG_AT = 180


class IRNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.RNN(4, 16, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(16) * 1.05)   # identity-scaled init (Le et al. 2015)
            self.rnn.bias_hh_l0.zero_()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _seq_batch(i):
    T = 400 if i >= LONG_AT else 16
    x = torch.randn(8, T, 4, generator=gen(700 + i % 16)) * 0.5
    return (x,), {}, x[:, -4:, 0].sum(1, keepdim=True)


def test_irnn_length_curriculum_at_step_180_overflows_rnn(tmp_path):
    r = run(IRNN(), _seq_batch, mse, LONG_AT + 4, tmp_path / "run")
    real_fwd(r, "rnn", LONG_AT)
    expect(r["rep"], FWD, "rnn", LONG_AT)


# ======================================================================================================================
# 8. SILENT: a `.half()` GRU under cosine lr decay: updates round away late in the run
# ======================================================================================================================
class GRUReg(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gru, self.head = nn.GRU(4, 32, batch_first=True), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.gru(x.to(self.head.weight.dtype))[0][:, -1])


STEPS8 = 300


def _gru_batch(i):
    x = torch.randn(16, 10, 4, generator=gen(800 + i % 16))
    return x, x[:, -3:, 1].sum(1, keepdim=True)


def test_half_gru_cosine_decay_updates_round_away(tmp_path):
    m = GRUReg().half()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS8)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=str(tmp_path / "run"))
    losses, share = [], []
    for i in range(STEPS8):
        x, y = _gru_batch(i)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(m(x).float(), y)
        losses.append(loss.item())
        loss.backward()
        p = m.gru.weight_hh_l0
        before, nz = p.detach().clone(), p.grad != 0
        opt.step()
        share.append(float(((p.detach() == before) & nz).sum() / nz.sum().clamp(min=1)))
        sched.step()
    w.close()
    rep = w.report()
    assert all(map(math.isfinite, losses))
    win = [sum(share[k:k + 5]) / 5 for k in range(STEPS8 - 4)]
    onset = next(k for k, s in enumerate(win) if s >= 0.5)
    assert 150 <= onset and max(share[20:60]) < 0.2, (onset, share[20:60:5])
    expect(rep, "update_underflow", "gru", range(onset - 10, onset + 11))  # (not a one-off early check)
