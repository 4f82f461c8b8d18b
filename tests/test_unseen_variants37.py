"""Thirty-seventh set: REPLAY FAITHFULNESS, FORWARDS THAT DEPEND ON STATE. Nine fp16 failures that start mid-run at
a known unsampled step (7-13; full statistics are taken on step 0 and every 200th), each of which happens only
with the right STATE beside the batch: which blocks a LayerDrop skipped (Python's `random`), where a random crop
fell (NumPy's global RNG), which timesteps and self-conditioning coin a diffusion model drew inside its forward
(its own torch.Generator; and the global torch RNG), which task a round-robin counter picked (a Python attribute),
what a lagging normaliser's running statistics held (buffers the forward updates), what a linear-attention
memory carried over from the segment before (a tensor attribute), which units a dropout kept (torch's RNG), and a
BatchNorm frozen in eval mode by a fine-tuning loop that also runs an eval pass between train steps. Watched
through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")` at the
default settings -> an ordinary CPU fp16 autocast + `torch.amp.GradScaler("cpu")` loop: scale(loss).backward ->
unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`), ampdoctor's RuntimeWarnings recorded.

On such a step the per-layer view is the in-process replay of the step's capture (args/kwargs, torch's RNG state
taken before the forward, the weights): the replay must rebuild the state the forward depended on, or it runs
another computation and the report blames the wrong module or says only `... at (run)`.

Each failure is proven first by the test's own oracle (probe_harness.Producer with keyword inputs: the first module
whose output is non-finite while its inputs, keyword inputs and own parameters were finite, at the expected step),
plus the loss (first non-finite there) and the scaler (skips it; before it only the first steps' backoffs); where
it is cheap the oracle also shows the state at work (1: `layers.0` did not run at step 13; 9: the same batch is
finite through the BatchNorm in train mode). Only then must `overflow`/`nan_origin` be among the report's first
three findings at the PRODUCER, at that step, forward, error (and no error at the modules that only passed it on);
a wrong report raises WrongAnswer naming ampdoctor's top three (a failing oracle or a crash fails otherwise).
Watching must not change the training, the report's replay included: six runs take a `w.report()` MID-RUN (two
steps or more after the failure, so the replay runs while training goes on), train on, and must give the same
losses (NaN for NaN) and final weights as the same loop without a watch; a difference raises ChangedTraining. On
the CPU autocast keeps layer_norm/softmax/exp in the input's dtype: the producers are the fp16 cast of an fp32
input inside a Linear/Conv (1-6, 8), the cast of a state tensor inside a module (7) and an fp16 BatchNorm (9).

 1. Python `random` (LayerDrop, `random.random() < p` per block, as fairseq/older HF encoders do): a tabular
    residual MLP; at step 13 a feature arrives x1e5 and block 0 is skipped -> overflow at `layers.1.fc1`, step 13.
 2. NumPy's global RNG (a random 32-frame crop inside forward, `np.random.randint`): an audio event classifier; at
    step 8 a clipping burst (7e4) sits in frames 60-63 and the crop (start 36) covers it -> overflow at `front`.
 3. a torch.Generator the model owns (a diffusion model that samples timesteps, noise and the self-conditioning
    coin inside forward, zero-terminal-SNR schedule with alpha_bar[-1] clamped to 1e-12): at step 12 a sample
    draws t = 99 with self-conditioning on; the first pass's x0 estimate (~1e5) overflows the second pass's
    input projection -> overflow at `inp`, step 12.
 4. the same model on the global torch RNG (seed 3): the same event at step 7 -> overflow at `inp`, step 7.
 5. a Python counter (a multi-task model that cycles its heads by `self.calls % 3`): at step 7 (a depth step) the
    lidar ranges arrive in millimetres -> overflow at `range_proj`, step 7 (on a pose/seg step they are unused).
 6. buffers the forward updates (a lagging observation normaliser: normalise by the statistics of the batches
    before, then update them, momentum 0.1): at step 9 one env reports a velocity of 1e7 -> overflow at
    `body.0`, step 9 (after the forward the running variance has absorbed it).
 7. a tensor attribute carried between steps (linear attention over the earlier TBPTT segments, its fp32 state
    `self.state` kept detached): at step 8 a segment's loudness feature is in raw units (x300), which fills the
    state; at step 9 `bmm(q, state)` casts it to fp16 -> overflow at `mem`, step 9.
 8. torch's RNG (input Dropout(0.5)): at step 8 one reading is 4e4 (finite in fp16); where the dropout keeps it
    (x2) the input projection's cast overflows -> overflow at `inp`, step 8.
 9. a BatchNorm frozen in eval mode (`model.train(); model.freeze_bn()` each step, cumulative pretrained statistics,
    an eval pass `model.eval()` every third step): at step 8 a shard's 16-bit images are not divided by 65535 ->
    the frozen statistics blow them past fp16 -> overflow at `bn`, step 8 (train-mode BN would be finite).
Twins (no warning, no error, no RuntimeWarning): 1 without the outlier; 6 without the glitch.
Not built: a gumbel-softmax VQ whose one dead code was re-seeded with a raw (3e4) vector: the straight-through
gradient runs through every code, so its backward overflows at every step (the scaler's backoffs at 0-7), not
only when the sample picks the code: no replay question.

What ampdoctor says (9 of 9 right; every identity run unchanged; no RuntimeWarning anywhere):
- right from the start: 4 (global torch RNG: the capture's RNG state), 8 (dropout), 9 (eval_modules and the
  frozen statistics).
- fixed since (strict xfails here first): 1 was `overflow at layers.0.fc1 step 13` and 2 `nan_origin at (run) step
  8`: the replay drew Python's `random` / NumPy's global RNG as they stood at report time; 3 `nan_origin at (run)
  step 12`: the model's own Generator was neither captured nor restored. A sampled step now notes whether the
  forward draws from Python's or NumPy's RNG (record/modulehooks.py `_rng_drawn`), and from then on each batch
  keeps their states, as it keeps those of the torch.Generators the model holds (tensors.rng_state); the capture
  stores them (packed as bytes, validated on load) and the replay sets them before the forward.
Fixed since (strict xfails here first, each the report's `nan_origin at (run)`: the replay ran the step with
the state as it stood at report time):
- 5 (`nan_origin at (run) step 7`: the counter at report time picked a seg step), 6 (`nan_origin at (run) step 9`:
  the capture's buffers were those after the step's forward, the running variance already 1.6e11, which normalised
  the glitch away), 7 (`nan_origin at (run) step 9`: the memory as it is at report time). The first routine steps
  and every sampled one now note which module state the forward changes (record/modstate.py: a number attribute,
  a tensor attribute replaced or written, a buffer written in place); from then on each batch keeps that state as
  the forward found it, the capture stores it ("state/..."), and the replay sets it before each forward.
- identity (all six now unchanged): a mid-run report changed the training of 3 (the replay advanced the model's
  own Generator), 5 (it incremented the counter: the task cycle shifted by one) and 7 (it overwrote the memory);
  replay/modelio.preserved now also restores the modules' other attributes (a counter, a plain-tensor memory, a
  queue, a torch.Generator of the model's own). 1, 4 and 6 were already bitwise identical.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_unseen_variants37.py (about 5 s alone;
35 s beside a running suite on 2 cores)
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import Producer, WrongAnswer, at_top3, probe_run, quiet_twin, real_fwd_after_backoffs as real_fwd
from scenarios import lines, no_error_at, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
class ChangedTraining(AssertionError):
    """Watching (its mid-run report's replay included) changed the training: the only expected failure of an
    identity case marked `changes`."""


def gen(i):
    return torch.Generator().manual_seed(i)


def quiet(r):
    """A twin: healthy (the loss down by 10% at least) and ampdoctor quiet (probe_harness.quiet_twin)."""
    quiet_twin(r, fall=0.9)


def run(m, batch, loss_fn, steps, run_dir, *, lr=1e-3, watch=True, oracle=True, mid_report=None, before=None,
        after=None):
    """probe_harness.probe_run (the user's loop at the default settings: [before(i, m)] ... [after(i, m)], a
    `w.report()` after step `mid_report`) with a Producer on keyword inputs; `watch=False`: the same loop, no watch
    and no oracle; `oracle=False`: no oracle (its hooks would see a mid-run replay's forward). `batch(i)` gives
    (args, kwargs, y)."""
    return probe_run(m, batch, loss_fn, steps, run_dir, lr=lr, watch=watch, mid_report=mid_report, before=before,
                     after=after, oracle=(lambda m: Producer(m, with_kwargs=True)) if oracle else None)


def named(r, rule, module, step, quiet_at=()):
    """The report check: `rule` at the producer, at its step, forward, error, among the first three findings (and
    no error at the modules that only passed it on). A failure is a WrongAnswer naming ampdoctor's top three and
    the RuntimeWarnings it gave."""
    rep = r["rep"]
    try:
        at_top3(rep, rule, module, step=step, phase="forward", severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={lines(rep)[:3]} warnings={r['warns']} ({e})") from None
    assert not [s for s in r["warns"] if "could not write a capture" in s or "replay" in s], r["warns"]


def same_training(make, batch, loss_fn, steps, at, mid, tmp_path, lr=1e-3, before=None, after=None):
    """Watching did not change the training: the loop under a watch whose w.report() runs after step `mid` (its
    replay of step `at`'s capture, training going on) gives the same losses (NaN for NaN) and final weights as
    the loop without a watch. `make()` builds the model (and seeds whatever RNG it draws from). The failure at
    `at` and the mid-run replay are asserted first; a difference is ChangedTraining."""
    a = run(make(), batch, loss_fn, steps, tmp_path / "run", lr=lr, oracle=False, mid_report=mid, before=before,
            after=after)
    b = run(make(), batch, loss_fn, steps, tmp_path / "plain", lr=lr, watch=False, before=before, after=after)
    assert a["bad_loss"][:1] == [at] and b["bad_loss"][:1] == [at], (a["bad_loss"], b["bad_loss"])
    assert a["mid"] is not None and a["mid"].data.get("replay"), "the mid-run report replayed no capture"
    la, lb = [repr(x) for x in a["losses"]], [repr(x) for x in b["losses"]]
    if la != lb:
        k = next(i for i, (x, y) in enumerate(zip(la, lb)) if x != y)
        raise ChangedTraining(f"losses differ from step {k} (the report ran after step {mid}): watched "
                              f"{la[k:k + 3]} vs plain {lb[k:k + 3]}")
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        if not torch.equal(a["weights"][k], b["weights"][k]):
            raise ChangedTraining(f"final weights differ at {k}")


def mse(out, y):
    return F.mse_loss(out.float(), y)


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def own_loss(out, y):
    return out


FWD = ("overflow", "nan_origin")
W16 = randn(16, seed=5)


# ======================================================================================================================
# 1 + twin. Python's `random`: LayerDrop in a tabular residual MLP
# ======================================================================================================================
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        return self.fc2(F.gelu(self.fc1(h)))


class LayerDropNet(nn.Module):
    def __init__(self, d=16, n=4, p=0.2):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)
        self.p = p

    def forward(self, x):
        h = x
        for blk in self.layers:
            if self.training and random.random() < self.p:      # LayerDrop (fairseq / older HF encoders)
                continue
            h = h + blk(h)
        return self.head(h).squeeze(-1)


DROP_AT = 13          # random.seed(0): LayerDrop skips block 0 at step 13 (asserted through the oracle)


def layerdrop_batch(outlier):
    def batch(i):
        x = randn(32, 16, seed=100 + i)
        y = (x @ W16).tanh()
        if i == DROP_AT and outlier:      # this shard's feature 3 came in x1e5 (a unit bug upstream)
            x[:, 3] = x[:, 3] * 1e5
        return (x,), {}, y
    return batch


def make_layerdrop():
    random.seed(0)
    torch.manual_seed(0)
    return LayerDropNet()


def test_layerdrop_python_random_outlier_overflows_the_first_block_that_ran(tmp_path):
    r = run(make_layerdrop(), layerdrop_batch(True), mse, DROP_AT + 4, tmp_path / "run")
    real_fwd(r, "layers.1.fc1", DROP_AT)
    assert ("layers.0", DROP_AT) not in r["calls"] and r["calls"].get(("layers.1", DROP_AT)) == 1, r["calls"]
    named(r, FWD, "layers.1.fc1", DROP_AT, quiet_at=("layers.1.fc2", "layers.2.fc1", "head", ""))


def test_layerdrop_watch_with_midrun_report_changes_nothing(tmp_path):
    same_training(make_layerdrop, layerdrop_batch(True), mse, DROP_AT + 5, DROP_AT, DROP_AT + 2, tmp_path)


def test_twin_layerdrop_without_outlier_is_quiet(tmp_path):
    quiet(run(make_layerdrop(), layerdrop_batch(False), mse, 14, tmp_path / "run", lr=3e-3))


# ======================================================================================================================
# 2. NumPy's global RNG: a random crop inside the model (an audio event classifier)
# ======================================================================================================================
class CropNet(nn.Module):
    def __init__(self, win=32):
        super().__init__()
        self.win = win
        self.front = nn.Conv1d(8, 16, 5, padding=2)
        self.body = nn.Sequential(nn.GELU(), nn.Conv1d(16, 16, 3, padding=1), nn.GELU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        if self.training:                        # random crop of `win` frames (np.random, as many audio repos do)
            st = np.random.randint(0, x.shape[-1] - self.win + 1)
            x = x[..., st:st + self.win]
        return self.head(self.body(self.front(x)).mean(-1))


BURST_AT = 8          # np.random.seed(0): the crop of step 8 starts at frame 36 (covers 60-63)


def crop_batch(i):
    g = gen(i)
    y = torch.randint(0, 4, (16,), generator=g)
    x = torch.randn(16, 8, 128, generator=g) + F.one_hot(y, 8).float()[:, :, None]
    if i == BURST_AT:                           # a clipping burst in the recording (finite in fp32, not in fp16)
        x[:, :, 60:64] = 7e4
    return (x,), {}, y


def test_numpy_random_crop_over_a_clipping_burst_overflows_front(tmp_path):
    np.random.seed(0)
    torch.manual_seed(0)
    r = run(CropNet(), crop_batch, ce, BURST_AT + 4, tmp_path / "run")
    real_fwd(r, "front", BURST_AT)
    named(r, FWD, "front", BURST_AT, quiet_at=("body.1", "head", ""))


# ======================================================================================================================
# 3 + 4. a diffusion model that samples timesteps, noise and self-conditioning inside forward
# ======================================================================================================================
T_STEPS = 100


def zsnr_schedule():
    """Cosine alpha_bar rescaled to zero terminal SNR (Lin et al. 2023), the last one clamped to 1e-12 (not 0)."""
    s = 0.008
    t = torch.arange(T_STEPS + 1, dtype=torch.float64) / T_STEPS
    f = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2
    sq = (f[1:] / f[0]).clamp(max=1.0).sqrt()
    sq0, sqt = sq[0].clone(), sq[-1].clone()
    sq = (sq - sqt) * sq0 / (sq0 - sqt)
    return (sq ** 2).clamp(min=1e-12).float()


class Denoiser(nn.Module):
    def __init__(self, d=16, h=64, gen_seed=None):
        super().__init__()
        self.register_buffer("ab", zsnr_schedule(), persistent=False)
        self.temb = nn.Embedding(T_STEPS, h)
        self.inp = nn.Linear(2 * d, h)
        self.mid = nn.Sequential(nn.GELU(), nn.Linear(h, h), nn.GELU())
        self.out = nn.Linear(h, d)
        self.gen = None if gen_seed is None else torch.Generator().manual_seed(gen_seed)   # its own RNG stream

    def eps(self, xt, x0_sc, t):
        return self.out(self.mid(self.inp(torch.cat([xt, x0_sc], -1)) + self.temb(t)))

    def forward(self, x0):
        g = self.gen
        t = torch.randint(0, T_STEPS, (x0.shape[0],), generator=g)
        noise = torch.randn(x0.shape, generator=g)
        a = self.ab[t][:, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        x0_sc = torch.zeros_like(x0)
        if torch.rand((), generator=g) < 0.5:     # self-conditioning (Chen et al.): feed a first pass's x0 estimate
            with torch.no_grad():
                e = self.eps(xt, x0_sc, t).float()
                x0_sc = (xt - (1 - a).sqrt() * e) / a.sqrt()
        return F.mse_loss(self.eps(xt, x0_sc, t).float(), noise)


def latent_batch(i):
    return (randn(16, 16, seed=200 + i) * 0.5,), {}, None


OWN_AT, GLOBAL_AT = 12, 7     # generator seed 9 / torch.manual_seed(3): the only t = 99 + self-conditioning steps


def make_own_gen():
    torch.manual_seed(0)
    return Denoiser(gen_seed=9)


def make_global_gen():
    torch.manual_seed(3)
    return Denoiser()


def test_diffusion_own_generator_terminal_timestep_overflows_inp(tmp_path):
    r = run(make_own_gen(), latent_batch, own_loss, OWN_AT + 4, tmp_path / "run")
    real_fwd(r, "inp", OWN_AT)
    named(r, FWD, "inp", OWN_AT, quiet_at=("mid.1", "out", ""))


def test_diffusion_own_generator_watch_with_midrun_report_changes_nothing(tmp_path):
    same_training(make_own_gen, latent_batch, own_loss, OWN_AT + 5, OWN_AT, OWN_AT + 2, tmp_path)


def test_diffusion_global_rng_terminal_timestep_overflows_inp(tmp_path):
    r = run(make_global_gen(), latent_batch, own_loss, GLOBAL_AT + 4, tmp_path / "run")
    real_fwd(r, "inp", GLOBAL_AT)
    named(r, FWD, "inp", GLOBAL_AT, quiet_at=("mid.1", "out", ""))


def test_diffusion_global_rng_watch_with_midrun_report_changes_nothing(tmp_path):
    same_training(make_global_gen, latent_batch, own_loss, GLOBAL_AT + 5, GLOBAL_AT, GLOBAL_AT + 2, tmp_path)


# ======================================================================================================================
# 5. a Python counter: a multi-task model that cycles its heads by itself
# ======================================================================================================================
TASKS = ("pose", "depth", "seg")


class RoundRobin(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(12, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.range_proj = nn.Linear(4, 64)            # the depth task's side input: lidar ranges (hectometres)
        self.heads = nn.ModuleDict({"pose": nn.Linear(64, 6), "depth": nn.Linear(64, 1), "seg": nn.Linear(64, 5)})
        self.calls = 0

    def forward(self, img, ranges):
        task = TASKS[self.calls % 3]                  # round-robin over the tasks, one per forward
        self.calls += 1
        h = self.enc(img)
        if task == "depth":
            h = h + self.range_proj(ranges)
        return task, self.heads[task](h)


MM_AT = 7             # a depth step (7 % 3 == 1)


def rr_batch(i):
    g = gen(i)
    img, ranges = torch.randn(32, 12, generator=g), torch.rand(32, 4, generator=g) * 2
    y = {"pose": torch.tanh(img[:, :6]), "depth": ranges.mean(1, keepdim=True) / 2, "seg": torch.tanh(img[:, 6:11])}
    if i == MM_AT:                                    # this drive's ranges were exported in millimetres
        ranges = ranges * 1e5
    return (img, ranges), {}, y


def rr_loss(out, y):
    task, o = out
    return F.mse_loss(o.float(), y[task])


def make_rr():
    torch.manual_seed(0)
    return RoundRobin()


def test_round_robin_counter_ranges_in_mm_overflow_range_proj(tmp_path):
    r = run(make_rr(), rr_batch, rr_loss, MM_AT + 4, tmp_path / "run")
    real_fwd(r, "range_proj", MM_AT)
    named(r, FWD, "range_proj", MM_AT, quiet_at=("heads.depth", ""))


def test_round_robin_counter_watch_with_midrun_report_changes_nothing(tmp_path):
    same_training(make_rr, rr_batch, rr_loss, MM_AT + 7, MM_AT, MM_AT + 2, tmp_path)


# ======================================================================================================================
# 6 + twin. buffers the forward updates: a lagging observation normaliser (an RL policy)
# ======================================================================================================================
class LagNorm(nn.Module):
    """Normalise by the running statistics of the batches BEFORE this one, then update them (the current batch
    never normalises itself)."""

    def __init__(self, d, momentum=0.1):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))

    def forward(self, x):
        y = (x - self.mean) / (self.var + 1e-5).sqrt()
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean(0), self.momentum)
                self.var.lerp_(x.var(0), self.momentum)
        return y


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LagNorm(10)
        self.body = nn.Sequential(nn.Linear(10, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 3)

    def forward(self, obs):
        return self.head(self.body(self.norm(obs)))


GLITCH_AT = 9
OBS_SCALE = torch.tensor([1.0] * 8 + [50.0, 50.0])
W_OBS = randn(10, 3, seed=5)


def obs_batch(glitch):
    def batch(i):
        z = randn(64, 10, seed=300 + i)
        obs = z * OBS_SCALE + 3
        if i == GLITCH_AT and glitch:             # one env's sensor glitch: a velocity reading of 1e7
            obs[5, 9] = 1e7
        return (obs,), {}, torch.tanh(z @ W_OBS)
    return batch


def make_policy():
    torch.manual_seed(0)
    return Policy()


def test_lagging_normaliser_sensor_glitch_overflows_first_linear(tmp_path):
    r = run(make_policy(), obs_batch(True), mse, GLITCH_AT + 4, tmp_path / "run", lr=3e-3)
    real_fwd(r, "body.0", GLITCH_AT)
    named(r, FWD, "body.0", GLITCH_AT, quiet_at=("body.2", "head", ""))


def test_lagging_normaliser_watch_with_midrun_report_changes_nothing(tmp_path):
    same_training(make_policy, obs_batch(True), mse, GLITCH_AT + 5, GLITCH_AT, GLITCH_AT + 2, tmp_path, lr=3e-3)


def test_twin_lagging_normaliser_without_glitch_is_quiet(tmp_path):
    quiet(run(make_policy(), obs_batch(False), mse, 14, tmp_path / "run", lr=3e-3))


# ======================================================================================================================
# 7. a tensor attribute carried between steps: linear attention over the earlier TBPTT segments
# ======================================================================================================================
class LinearAttnMem(nn.Module):
    """out = phi(q) @ S, S = decay * S + phi(k)^T v over the segments before this one; S kept in fp32 (as an
    attribute, detached) from one training step to the next."""

    def __init__(self, d=32, decay=0.05):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.decay = decay
        self.state = None

    def forward(self, x):
        q, k, v = F.elu(self.q(x)) + 1, F.elu(self.k(x)) + 1, self.v(x)
        if self.state is None:
            state, out = torch.zeros(x.shape[0], x.shape[-1], x.shape[-1]), torch.zeros_like(v)
        else:
            state = self.state
            out = torch.bmm(q, state.to(q.dtype))
        with torch.autocast("cpu", enabled=False):
            self.state = (self.decay * state + k.float().transpose(1, 2) @ v.float()).detach()
        return self.o(out + v)


class StreamLM(nn.Module):
    """`mem`: the memory module (test_unseen_variants39 builds the same LM around another one)."""

    def __init__(self, vocab=64, d=32, mem=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.feat = nn.Linear(4, d)
        self.mem = (mem or LinearAttnMem)(d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, feats):
        h = self.emb(ids) + self.feat(feats)
        return self.head(self.ln(h + self.mem(h)))


MEM_AT = 9            # the loud segment is step 8's; the memory overflows at step 9


def stream_batch(i):
    g = gen(i)
    ids = torch.randint(0, 64, (8, 16), generator=g)
    feats = torch.rand(8, 16, 4, generator=g)
    if i == MEM_AT - 1:                            # this segment's loudness feature is in raw units, not normalised
        feats = feats * 300
    return (ids, feats), {}, torch.roll(ids, -1, 1)


def lm_loss(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def make_stream():
    torch.manual_seed(0)
    return StreamLM()


def test_linear_attention_memory_from_a_loud_segment_overflows_mem(tmp_path):
    r = run(make_stream(), stream_batch, lm_loss, MEM_AT + 4, tmp_path / "run", lr=3e-3)
    real_fwd(r, "mem", MEM_AT)
    named(r, FWD, "mem", MEM_AT, quiet_at=("mem.o", "head", ""))


def test_linear_attention_memory_watch_with_midrun_report_changes_nothing(tmp_path):
    same_training(make_stream, stream_batch, lm_loss, MEM_AT + 5, MEM_AT, MEM_AT + 2, tmp_path, lr=3e-3)


# ======================================================================================================================
# 8. torch's RNG: a dropout that keeps (x2) a reading that is finite in fp16 only before it
# ======================================================================================================================
class TabDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.inp = nn.Linear(12, 64)
        self.body = nn.Sequential(nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.body(self.inp(self.drop(x)))).squeeze(-1)


KEPT_AT = 8           # torch.manual_seed(2): the dropout keeps x[17, 4] at step 8 (seeds 0 and 1 drop it: finite)
W12 = randn(12, seed=5)


def drop_batch(i):
    x = randn(32, 12, seed=400 + i)
    y = (x @ W12).tanh()
    if i == KEPT_AT:                              # one row's reading in the wrong unit: 4e4 (x2 kept: > 65504)
        x[17, 4] = 4.0e4
    return (x,), {}, y


def test_dropout_keeps_a_large_reading_overflows_inp(tmp_path):
    torch.manual_seed(2)
    r = run(TabDrop(), drop_batch, mse, KEPT_AT + 4, tmp_path / "run")
    real_fwd(r, "inp", KEPT_AT)
    named(r, FWD, "inp", KEPT_AT, quiet_at=("body.2", "head", ""))


# ======================================================================================================================
# 9. a BatchNorm frozen in eval mode by the loop (fine-tuning), an eval pass every third step
# ======================================================================================================================
class FrozenBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16, momentum=None)      # cumulative statistics from pretraining
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(F.relu(self.conv2(F.relu(self.bn(self.stem(x))))).mean((2, 3)))

    def freeze_bn(self):
        for mod in self.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.eval()


RAW_AT = 8


def images(g, n=8):
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.rand(n, 3, 12, 12, generator=g) * 0.2 + 0.1 * y[:, None, None, None], y


def bn_batch(i):
    x, y = images(gen(i))
    if i == RAW_AT:                                # this shard's 16-bit images were not divided by 65535
        x = x * 65535
    return (x,), {}, y


def make_frozen_bn():
    torch.manual_seed(0)
    m = FrozenBNNet()
    with torch.no_grad():                          # "pretraining": the statistics BN will be frozen with
        for k in range(20):
            m(images(gen(1000 + k))[0])
    return m


def bn_train_mode(i, m):
    m.train()
    m.freeze_bn()


def bn_eval_pass(i, m):
    if i % 3 == 2:
        m.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            m(images(gen(500))[0])


def test_frozen_bn_with_eval_passes_raw_16bit_images_overflow_bn(tmp_path):
    r = run(make_frozen_bn(), bn_batch, ce, RAW_AT + 4, tmp_path / "run", before=bn_train_mode, after=bn_eval_pass)
    real_fwd(r, "bn", RAW_AT)
    x = bn_batch(RAW_AT)[0][0]                      # the state at work (initial weights): the batch overflows
    frozen, live = make_frozen_bn(), make_frozen_bn()  # through the frozen statistics, not through batch statistics
    frozen.freeze_bn()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert not bool(torch.isfinite(frozen(x)).all()) and bool(torch.isfinite(live(x)).all())
    named(r, FWD, "bn", RAW_AT, quiet_at=("conv2", "head", ""))
