"""Integer-valued fp32 features fed to an nn.Linear under CPU autocast, both directions: the cast-in integer probe
(record/stats.py `cast_in`: a Linear's small vector-shaped fp32 input under fp16/bf16 autocast is probed for
integers; bf16 holds every integer only up to 256, fp16 up to 2048) must warn `precision_loss` where autocast rounds
timesteps, positions, day indices or a step counter together, and stay quiet on tabular integer features that stay
small, on integers that never reach a Linear as a vector, and on large non-integer features. test_bf16_unseen F1
(a frozen Fourier Linear on t) and test_int_watch (bf16/fp16-held positions over a curriculum) are not repeated.

Watched through the public API only: `ampdoctor.watch(model, optimizer=AdamW, scaler=None (bf16) or
torch.amp.GradScaler("cpu") (fp16), run_dir=tmp)` around zero_grad -> forward under `torch.autocast("cpu", dtype)`
-> backward (scale/unscale_/clip/step/update for fp16) -> step; then close() and report(). Tiny models, fixed seeds,
one intra-op thread. Each failure is first proven by the test's own oracle against fp32 (the same Linear and
weights: neighbouring integers give bitwise-identical outputs under bf16 autocast for > 30% of the pairs past 256,
never in fp32; a failing oracle is a plain failure), then `precision_loss` must be at the Linear that takes them
among the first three findings with severity warning or error. Healthy runs must have no warning and no error
(info allowed). A wrong report raises WrongAnswer (strict xfail via `wrong`).

Failures (bf16 autocast, no scaler):
 F1. a toy-diffusion denoiser whose time MLP starts with a trainable Linear(1, 32) on fp32 timesteps t[:, None],
     t in 0..999: precision_loss at t_in.
 F2. a token model with a learned position projection Linear(1, 32) on positions arange(1024).float()[:, None]
     (T, 1): precision_loss at pos_proj.
 F3. a daily forecaster with a seasonal Linear(1, 16) on the day-of-year (B, 1) in 0..365: precision_loss at season.
 F4. a progress-conditioned regressor fed the global step counter of a resumed run (1000..1039) as a (B, 1) column
     (every row the same step): precision_loss at progress.
 F5. an RL policy whose observation is the state (B, 8) with the episode step 0..999 concatenated as a ninth column
     into Linear(9, 32): precision_loss at fc1.
Healthy (no warning, no error):
 H1. bf16: visit counts 0..50 as a (B, 1) column into Linear(1, 8) beside normalised features.
 H2. bf16: bag-of-words counts (B, 64), 0..5 per word, into Linear(64, 16).
 H3. bf16: month codes 0..11 as floats, code[:, None] into Linear(1, 8).
 H4. bf16: normalised features (B, 8) through an MLP.
 H5. bf16: int64 ids up to 4999 through an Embedding(5000, 16), mean-pooled, into a Linear.
 H6. bf16: positions 0..1023 used only through an fp32 sinusoidal table computed with autocast disabled.
 H7. bf16: prices 0.01..5000 (cents, log-uniform) as a (B, 1) column into Linear(1, 8).
 H8. bf16: hour-of-week 0..167 (an integer ramp that stays under 256) into Linear(1, 8).
 H9. fp16 + GradScaler: F1's denoiser, timesteps 0..999 (exact in fp16; info at most).
 H10. fp16 + GradScaler: F2's position projection, positions 0..1023 (exact in fp16; info at most).

Result when written: 13 pass, 2 xfail (stable over two runs, ~3 s).
 F1 PASS  `[warning] precision_loss at t_in step 0: `t_in` (Linear) takes a float32 input that holds only integers
          and computes with it in bfloat16 (autocast casts it there), up to 978 ...` (the only finding).
 F2 PASS  `[warning] precision_loss at pos_proj step 0: ... up to 1023 ...` (the only finding).
 F3 PASS  `[warning] precision_loss at season step 0: ... up to 358 ...` (the only finding).
 Healthy: H1-H8 have no finding at all; H9 and H10 only info (`[info] overflow ... step 0` and `[info]
 skipped_steps` from the scaler's first backoffs, `[info] precision_loss at t_in` / `at pos_proj`: exact in float16).
What ampdoctor got wrong (strict xfails via `wrong`, WrongAnswer only):
 F4 XFAIL the report is empty (`[]`): the (B, 1) column holds one step number (1000..1039, amin == amax), so
    `integer_valued` wants "smaller nonzero magnitudes too" and passes it; bf16 rounds 1001..1003 to 1000 (oracle:
    > 30% of neighbouring steps give identical progress outputs, none in fp32).
 F5 XFAIL the report is empty (`[]`): the episode step is one column of a (B, 9) observation; the probe takes only
    vector-shaped inputs that are all integers, yet fc1 computes the column in bf16 (neighbouring steps with the same
    state collide, none in fp32).
Also seen (no case): the finding's fix "scale the integers into a small range first (t / 1000)" does not help in
bf16: t / 1000 into F1's t_in still gives identical outputs for ~66% of neighbouring t in 256..999 (8-bit mantissa
at any scale); only keeping the Linear in fp32 does. (Mended since: the fix now says so and gives the fp32 snippet
alone; `test_fix_does_not_suggest_rescaling` checks it.)
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import WrongAnswer, wrong
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
BF16, F16 = torch.bfloat16, torch.float16


# ======================================================================================================================
# the loop and the checks
# ======================================================================================================================
def amp_run(m, batch, loss_fn, steps, dtype, run_dir, lr=1e-3):
    """The user's loop under ampdoctor.watch: bf16 without a scaler, fp16 with GradScaler("cpu"). `batch(i)` gives
    (inputs..., target). Returns (report, losses)."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if dtype is F16 else None
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir)
    losses = []
    try:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            *args, y = batch(i)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(m(*args), y)
            if sc is None:
                loss.backward()
                opt.step()
            else:
                sc.scale(loss).backward()
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                sc.step(opt)
                sc.update()
            losses.append(loss.item())
    finally:
        w.close()
    assert all(map(math.isfinite, losses)), losses
    return w.report(), losses


def top_alarms(rep):
    return [f for f in rep.findings if f.severity in ("warning", "error")][:3]


def named(rep, module):
    """precision_loss at `module` among the first three warning/error findings; else WrongAnswer with the report."""
    hit = [f for f in top_alarms(rep) if f.rule == "precision_loss" and f.module == module]
    if not hit:
        raise WrongAnswer(f"want precision_loss at {module}; got {[s[:200] for s in lines(rep)[:4]]}")
    return hit[0]


def quiet(rep):
    if alarms(rep.findings):
        raise WrongAnswer(f"false alarm on a healthy run: {[s[:200] for s in alarms(rep.findings)[:3]]}")


def collide(linear, vals, dtype=BF16):
    """Oracle: the share of neighbouring integers in `vals` (a (N, k) fp32 batch, consecutive rows differing by one
    integer step) whose `linear` outputs are bitwise identical under CPU autocast(dtype), and the same in fp32."""
    with torch.no_grad():
        ref = linear(vals)
        with torch.autocast("cpu", dtype=dtype):
            low = linear(vals).float()
    same_low = (low[1:] == low[:-1]).all(-1).float().mean().item()
    same_ref = (ref[1:] == ref[:-1]).all(-1).float().mean().item()
    return same_low, same_ref


def proven(linear, vals):
    same_low, same_ref = collide(linear, vals)
    assert same_low > 0.3 and same_ref == 0.0, (same_low, same_ref)


def gen(i):
    return torch.Generator().manual_seed(1000 + i)


# ======================================================================================================================
# models
# ======================================================================================================================
class TimeDenoiser(nn.Module):
    """x (B, 8), t (B,) fp32 0..999 -> eps: a time MLP whose first layer is Linear(1, 32) on t[:, None]."""

    def __init__(self):
        super().__init__()
        self.t_in, self.t_out = nn.Linear(1, 32), nn.Linear(32, 32)
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x, t):
        return self.out(F.silu(self.inp(x) + self.t_out(F.silu(self.t_in(t[:, None])))))


def denoise_batch(i):
    g = gen(i)
    t = torch.randint(0, 1000, (64,), generator=g).float()
    x = torch.randn(64, 8, generator=g)
    return x, t, x * torch.cos(t / 150.0)[:, None]


class PosProjLM(nn.Module):
    """ids (T,) -> Embedding(50, 32) + pos_proj(positions (T, 1) fp32) -> Linear(32, 50)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 32)
        self.pos_proj = nn.Linear(1, 32)
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        pos = torch.arange(ids.shape[0], dtype=torch.float32)[:, None]
        return self.head(torch.tanh(self.tok(ids) + self.pos_proj(pos)))


def lm_batch(i, T=1024):
    ids = torch.randint(0, 50, (T,), generator=gen(i))
    return ids, ids.roll(-1)


class Forecaster(nn.Module):
    """feats (B, 4), day-of-year (B, 1) 0..365 -> demand."""

    def __init__(self):
        super().__init__()
        self.feat, self.season = nn.Linear(4, 16), nn.Linear(1, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x, doy):
        return self.head(torch.relu(self.feat(x) + torch.sin(self.season(doy))))


def doy_batch(i):
    g = gen(i)
    x, doy = torch.randn(64, 4, generator=g), torch.randint(0, 366, (64, 1), generator=g).float()
    return x, doy, x[:, :1] + torch.sin(doy * 2 * math.pi / 365)


class ProgressNet(nn.Module):
    """x (B, 8), step (B, 1) the global step counter -> y."""

    def __init__(self):
        super().__init__()
        self.body, self.progress = nn.Linear(8, 16), nn.Linear(1, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x, step):
        return self.head(torch.relu(self.body(x) + torch.tanh(self.progress(step))))


RESUMED_AT = 1000


def progress_batch(i):
    x = torch.randn(32, 8, generator=gen(i))
    return x, torch.full((32, 1), float(RESUMED_AT + i)), x.sum(1, keepdim=True)


class Policy(nn.Module):
    """obs (B, 9) = state (B, 8) + episode step (B, 1) 0..999 -> 4 action logits."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(9, 32), nn.Linear(32, 4)

    def forward(self, obs):
        return self.fc2(torch.tanh(self.fc1(obs)))


def policy_batch(i):
    g = gen(i)
    s, t = torch.randn(64, 8, generator=g), torch.randint(0, 1000, (64, 1), generator=g).float()
    return torch.cat([s, t], 1), (s[:, :4] + (t > 500).float()).argmax(1)


# ======================================================================================================================
# failures (bf16)
# ======================================================================================================================
def test_f1_diffusion_timesteps_linear(tmp_path):
    torch.manual_seed(0)
    m = TimeDenoiser()
    proven(m.t_in, torch.arange(256, 1000).float()[:, None])
    rep, _ = amp_run(m, denoise_batch, F.mse_loss, 40, BF16, tmp_path / "run")
    named(rep, "t_in")


def test_f2_positions_T1_linear(tmp_path):
    torch.manual_seed(0)
    m = PosProjLM()
    proven(m.pos_proj, torch.arange(256, 1024).float()[:, None])
    rep, _ = amp_run(m, lm_batch, F.cross_entropy, 30, BF16, tmp_path / "run")
    named(rep, "pos_proj")


def test_f3_day_of_year(tmp_path):
    torch.manual_seed(0)
    m = Forecaster()
    proven(m.season, torch.arange(256, 366).float()[:, None])
    rep, _ = amp_run(m, doy_batch, F.mse_loss, 40, BF16, tmp_path / "run")
    named(rep, "season")


@wrong("a (B, 1) column holding one step number has no smaller values: not a ramp, the probe passes it")
def test_f4_global_step_counter(tmp_path):
    torch.manual_seed(0)
    m = ProgressNet()
    proven(m.progress, torch.arange(RESUMED_AT, RESUMED_AT + 100).float()[:, None])
    rep, _ = amp_run(m, progress_batch, F.mse_loss, 40, BF16, tmp_path / "run")
    named(rep, "progress")


@wrong("the episode step is one column of a (B, 9) non-integer observation: matrix-shaped, never probed")
def test_f5_episode_step_column(tmp_path):
    torch.manual_seed(0)
    m = Policy()
    state = torch.randn(1, 8, generator=gen(99)).expand(744, 8)
    proven(m.fc1, torch.cat([state, torch.arange(256, 1000).float()[:, None]], 1))
    rep, _ = amp_run(m, policy_batch, F.cross_entropy, 40, BF16, tmp_path / "run")
    named(rep, "fc1")


# ======================================================================================================================
# healthy
# ======================================================================================================================
class Tab(nn.Module):
    """Normalised features (B, 5) + one small feature column through `side` (Linear(k, 8))."""

    def __init__(self, k=1):
        super().__init__()
        self.num, self.side = nn.Linear(5, 8), nn.Linear(k, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, c):
        return self.head(torch.relu(self.num(x) + self.side(c)))


def tab_batch(col):
    def batch(i):
        g = gen(i)
        x, c = torch.randn(64, 5, generator=g), col(g)
        return x, c, x[:, :1] + 0.01 * c.float().reshape(64, -1).sum(1, keepdim=True)
    return batch


class BoW(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.head = nn.Linear(64, 16), nn.Linear(16, 2)

    def forward(self, counts):
        return self.head(torch.relu(self.enc(counts)))


def bow_batch(i):
    c = torch.randint(0, 6, (32, 64), generator=gen(i)).float() * (torch.rand(32, 64, generator=gen(i)) < 0.2)
    return c, (c[:, :32].sum(1) > c[:, 32:].sum(1)).long()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def mlp_batch(i):
    x = torch.randn(64, 8, generator=gen(i))
    return x, x[:, :1] - x[:, 1:2]


class IdBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(5000, 16), nn.Linear(16, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def id_batch(i):
    ids = torch.randint(0, 5000, (32, 12), generator=gen(i))
    return ids, (ids.float().mean(1, keepdim=True) / 5000)


class SinusLM(nn.Module):
    """ids (T,) -> Embedding + an fp32 sinusoidal table of positions 0..T-1 (autocast off) -> Linear(32, 50)."""

    def __init__(self):
        super().__init__()
        self.tok, self.head = nn.Embedding(50, 32), nn.Linear(32, 50)
        self.register_buffer("freq", torch.exp(-math.log(10000.0) * torch.arange(16) / 16), persistent=False)

    def forward(self, ids):
        with torch.autocast("cpu", enabled=False):
            ang = torch.arange(ids.shape[0], dtype=torch.float32)[:, None] * self.freq
            table = torch.cat([ang.sin(), ang.cos()], -1)
        return self.head(torch.tanh(self.tok(ids) + table))


def price_col(g):
    return (torch.exp(torch.rand(64, 1, generator=g) * math.log(5000 / 0.01)) * 0.01 * 100).round() / 100


HEALTHY = {
    "h1_counts_0_50": (lambda: Tab(1), tab_batch(lambda g: torch.randint(0, 51, (64, 1), generator=g).float()),
                       F.mse_loss, BF16),
    "h2_bag_of_words": (BoW, bow_batch, F.cross_entropy, BF16),
    "h3_month_codes": (lambda: Tab(1), tab_batch(lambda g: torch.randint(0, 12, (64,), generator=g).float()[:, None]),
                       F.mse_loss, BF16),
    "h4_normalised": (MLP, mlp_batch, F.mse_loss, BF16),
    "h5_embedding_ids": (IdBag, id_batch, F.mse_loss, BF16),
    "h6_fp32_sinus_table": (SinusLM, lm_batch, F.cross_entropy, BF16),
    "h7_prices": (lambda: Tab(1), tab_batch(price_col), F.mse_loss, BF16),
    "h8_hour_of_week": (lambda: Tab(1), tab_batch(lambda g: torch.randint(0, 168, (64, 1), generator=g).float()),
                        F.mse_loss, BF16),
    "h9_fp16_timesteps": (TimeDenoiser, denoise_batch, F.mse_loss, F16),
    "h10_fp16_positions": (PosProjLM, lm_batch, F.cross_entropy, F16),
}


@pytest.mark.parametrize("case", sorted(HEALTHY))
def test_healthy(case, tmp_path):
    make, batch, loss_fn, dtype = HEALTHY[case]
    torch.manual_seed(0)
    rep, _ = amp_run(make(), batch, loss_fn, 30, dtype, tmp_path / "run")
    quiet(rep)


def test_fix_does_not_suggest_rescaling():
    """The finding's fix for an fp32 integer input that autocast casts to bf16: rescaling keeps bf16's few
    significant bits, so the fix must not suggest it (it did when written), only running the module in fp32."""
    from ampdoctor.records import RunMeta, StepRecord
    from ampdoctor.rules.numeric import integer_precision
    from ampdoctor.rules.registry import RuleConfig, RunData
    info = {"dtype": "bfloat16", "max": 999.0, "exact_up_to": 256.0, "rounds_products_from": 256.0,
            "held_as": "float32"}
    rec = StepRecord(step=0, int_inputs=[{"module": "t_in", "type": "Linear", **info}])
    run = RunData(meta=RunMeta(modules=[["", "Net", 0], ["t_in", "Linear", 1]]), steps=[rec])
    f = integer_precision(run, RuleConfig())[0]
    assert f.rule == "precision_loss" and f.severity == "warning" and f.module == "t_in"
    assert "float32 input" in f.message and "scale the integers" not in f.fix and "collides" in f.fix
    assert "fp32" in f.fix and "enabled=False" in f.fix


def test_cast_in_only_for_linear_under_low_autocast_and_never_raises():
    """stats.cast_in: the dtype a Linear computes its fp32 inputs in under fp16/bf16 autocast; None for other module
    types, without autocast, and on a device type autocast does not know (`meta`: torch raises there, and an error
    in a hook would switch the watch off)."""
    from ampdoctor.record.stats import cast_in
    assert cast_in("Linear", "cpu") is None and cast_in("Linear", "meta") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cast_in("Linear", "cpu") is torch.bfloat16 and cast_in("Conv2d", "cpu") is None
        assert cast_in("Linear", "meta") is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert cast_in("Bilinear", "cpu") is torch.float16
