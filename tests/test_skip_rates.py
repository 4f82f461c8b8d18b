"""GradScaler's skipped steps: where ampdoctor draws the line between the scaler's dynamic loss scaling working as
designed (info at most) and a skip rate or a falling scale that is a failure (a warning or an error). Real CPU loops:
fp16 autocast (`torch.autocast("cpu", dtype=torch.float16)`), a real `torch.amp.GradScaler("cpu", ...)`,
`ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=DIR)` at the defaults, one intra-op thread, fixed seeds,
60-400 steps. The loop records `scaler.get_scale()` at every step and which steps the scaler skipped (the scale went
down), so each test first checks the skip pattern it is about (and, where it matters, re-runs a step from its saved
weights and RNG at its own scale, at half of it, down to 1); only then w.report() and ampdoctor.diagnose(DIR) are
judged. The rules are rules/backoff.py benign_backoff (_descent, _later_probes), rules/scaler.py scale_timeline
(skipped_steps, loss_scale_collapse) and rules/origins.py producers (overflow/nan_origin: info for the scaler's
expected backoff); tests/test_healthy_skips.py already covers single skips at a settled scale (one-off spikes and
their replay), so this file is about rates, runs of backoffs and where they stop.

Healthy (no warning, no error, exit code 0, in both reports):
 1. first_search[65536 | 2**32]: the first search from init_scale down to a working scale (5 / 21 skips in a row),
    then none (sum-reduced cross-entropy, 4-layer MLP, 120 steps).
 2. gradients_that_grow[60 | 100 | 160]: a GPT-3-style batch-size warm-up (8 -> 512 examples, doubling every 6
    steps) with a summed loss: after the first search the scale halves 5 times (steps 10-38), each time followed by
    applied updates, then never again; the same run cut at 60, 100 and 160 steps.
 3. batch_size_stages: the warm-up in 8x stages (16, 128, 1024): each stage costs two or three backoffs in a row.
 4. growth_then_one_outlier: the run of 2 (100 steps) plus one mislabelled example at step 80 that overflows the
    settled scale and is finite at half of it.
 5. growth_interval_20: SGD regression, 400 steps; the scale probes upward every 20 clean steps and backs off, one
    skip per probe (17 skips, 4%).
 6. growth_factor_4 (growth_interval=25): a growth above the working scale costs two backoffs in a row.
 7. rare_outlier_batch: one mislabelled example every 100 steps (growth_interval=60 lets the scale climb back):
    each outlier that skips is not finite at its scale, finite at half of it; the other skips are probes.
 8. linear_lr_warmup: AdamW, lr rising linearly to 1e-2 over 80 steps: the first search and one backoff during the
    warm-up.
 9. growth_interval_10 (asserted more loosely: no error, no overflow above info; a skipped_steps warning is
    allowed, 9% of the steps are probes): every skip is a probe at twice a scale that works.

Unhealthy (a warning or an error; the producer module named among the first three findings where there is one):
 a. forward_inf_every_fifth_step: DeepSets sum pooling (`pool`) of a point cloud that came in millimetres, one
    batch in five: forward inf that no scale cures -> overflow at `pool` + skipped_steps.
 b. backward_nan_every_fifth_step: a triplet loss whose sqrt(clamp(d2, min=0)) (`dist`) meets a duplicate pair in
    one batch in five: NaN in the backward at every scale down to 1 -> nan_origin/overflow at `dist` + skipped_steps.
 c. nan_every_step_from_step_20: a padded slot zero-filled before an eps-less L2 normalisation (`l2n`) in every
    batch from step 20: 30 skips in a row -> loss_scale_collapse (error) + nan_origin at `l2n`.
 d. lr_too_high (250 steps): full-batch least squares, SGD with the lr 3.5% above 2/lambda_max: the loss grows
    without bound with every forward finite, the scale halves each time the gradients double, to 0.002.
 e. lr_too_high_slowly (400 steps): the same 1.5% above the limit: 65536 -> 0.125, 15 backoffs (under 5%).
 f. backoff_factor_099: the scale barely falls and 155 of 200 steps are skipped.
 g. growth_interval_2: a third of the steps skipped at a steady scale (32768-262144).
 h. rare_backward_nan: the triplet's duplicate pair in every 25th batch (4% of the steps), 400 steps: each skip
    halves the scale for nothing, 65536 -> 1; the watch's capture of step 24, replayed, names `dist`.
 i. rare_backward_nan_after_a_harmless_spike: the same, with one mislabelled pair at step 10 before it (finite at
    half the scale).

What ampdoctor got wrong (strict xfails; `raises=WrongVerdict`, so a precondition that fails fails the test). Fixed
since: the 60-step warm-up, the two backoffs in a row and the later outlier (rules/backoff.py _descent: the longest
settled prefix of lowest-so-far skips, settling measured against the longest gap between them, a double backoff
allowed), the slow lr blow-up (rules/scaler.py: a skip at a scale below 1 is loss_scale_collapse), and 9's probe
rate (single probes above the scale that earned the growth are benign up to 1 in 8 steps, steps.PROBE_SHARE), and
i (the twenty-fifth session: a `backward` skip that comes again after 5 clean steps at a working scale is captured
too, and a report with nothing wrong replays those captures in turn, analysis/replaychoice.choose_replay; the replay
of step 24's names `dist`: `[error] nan_origin at dist step 24` first, in the live report and from the run dir,
and skipped_steps is a warning that says the replay found NaN at every scale, no longer "a normal rate"). It was:
 - i: only [info] skipped_steps "a normal rate", summary "Healthy", while 16 batches NaN'd the backward at any scale
   and the scale fell 65536 -> 0.5. (1) benign_backoff: 17 later skips in 399 steps, under later_share, so all are
   benign (each at a scale below every one before, never settling); (2) `dist` is never located: record/
   autocapture.py CapturePolicy.observe captures one bad step per kind, the 'backward' capture went to the harmless
   spike at step 10, bad_step_followup samples the 3 clean steps after each unsampled skip, and analysis/
   replaychoice.py pick_capture -> unexplained_skip replays step 10's capture (finite at half the scale), so nothing
   is folded in. Without the spike (h) the capture is step 24's and the replay names `dist`.
Everything else is right: the healthy runs 1, 2[100, 160], 5-8 are quiet, and a-d, f-h are flagged (a-c, h with the
producer module among the first three)."""
from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16 = torch.float16
INIT = 65536.0
W16 = torch.randn(16, 1, generator=gen(7))
W10 = torch.randn(16, 10, generator=gen(5))


# --- the loop and what it records --------------------------------------------------------------------------------

@dataclass
class Run:
    model: nn.Module
    w: object
    run_dir: Path
    batch: object
    loss_fn: object
    scales: list = field(default_factory=list)    # the loss scale each step's backward used (scaler.get_scale())
    skipped: list = field(default_factory=list)   # the steps whose update the scaler skipped (the scale went down)
    losses: list = field(default_factory=list)
    snaps: dict = field(default_factory=dict)     # step -> (model state, RNG) at the step's start, where kept
    final_scale: float | None = None              # scaler.get_scale() after the last update

    @property
    def first_good(self):
        return next(i for i in range(len(self.scales)) if i not in self.skipped)

    @property
    def later(self):
        """The skips after the first applied update."""
        fg = self.first_good
        return [s for s in self.skipped if s > fg]


def train(model, batch, loss_fn, run_dir, *, steps, init_scale=INIT, growth_interval=2000, growth_factor=2.0,
          backoff_factor=0.5, opt="adamw", lr=1e-3, lr_at=None, clip=1.0, keep=()):
    """The loop people write, under `ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir)` at the
    defaults: (lr schedule) -> zero_grad -> forward + loss under fp16 autocast -> scale(loss).backward() -> unscale_
    -> clip -> step -> update. `batch(i)` gives step i's args, `loss_fn(model, i, *args)` the loss. Records the scale
    every step used (scaler.get_scale() before the update) and which steps were skipped (the scale after the update
    is lower: backoff_factor < 1); the model state + RNG at the start of the steps in `keep` (to re-run them)."""
    o = (torch.optim.AdamW(model.parameters(), lr=lr) if opt == "adamw"
         else torch.optim.SGD(model.parameters(), lr=lr))
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval,
                              growth_factor=growth_factor, backoff_factor=backoff_factor)
    w = ampdoctor.watch(model, optimizer=o, scaler=sc, run_dir=run_dir)
    r = Run(model, w, Path(run_dir), batch, loss_fn)
    for i in range(steps):
        if i in keep:
            r.snaps[i] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, torch.get_rng_state())
        if lr_at is not None:
            for g in o.param_groups:
                g["lr"] = lr_at(i)
        o.zero_grad(set_to_none=True)
        args = batch(i)
        with torch.autocast("cpu", dtype=FP16):
            loss = loss_fn(model, i, *args)
        s = sc.get_scale()
        sc.scale(loss).backward()
        sc.unscale_(o)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        sc.step(o)
        sc.update()
        r.scales.append(s)
        r.losses.append(loss.item())
        if sc.get_scale() < s:
            r.skipped.append(i)
    r.final_scale = sc.get_scale()
    w.close()
    return r


def grads_finite(r: Run, step: int, scale: float) -> bool:
    """Step `step` re-run on a copy of the model from its state at the step's start (same batch, same RNG), its loss
    multiplied by `scale`: are the loss and every parameter's gradient finite?"""
    m = copy.deepcopy(r.model)
    state, rng = r.snaps[step]
    m.load_state_dict(state)
    keep = torch.get_rng_state()
    torch.set_rng_state(rng)
    try:
        with torch.autocast("cpu", dtype=FP16):
            loss = r.loss_fn(m, step, *r.batch(step))
        ok = bool(torch.isfinite(loss).all())
        (loss.float() * scale).backward()
    finally:
        torch.set_rng_state(keep)
    return ok and all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)


def probes(r: Run) -> list[int]:
    """The skips at a scale above the one that earned GradScaler's latest growth (the scaler probing upwards)."""
    out, base = [], None
    for i, s in enumerate(r.scales):
        if i and s > r.scales[i - 1]:
            base = r.scales[i - 1]
        if i in r.skipped and base is not None and s > base:
            out.append(i)
    return out


def streaks(steps: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][-1] + 1:
            out[-1].append(s)
        else:
            out.append([s])
    return out


class WrongVerdict(AssertionError):
    """ampdoctor's report is wrong (the xfails expect this one: a precondition that fails is a plain
    AssertionError, and fails the test)."""


def verdict(ok: bool, rep) -> None:
    if not ok:
        raise WrongVerdict(lines(rep))


def reports(r: Run):
    """What the user gets: w.report() and ampdoctor.diagnose(run_dir)."""
    return [r.w.report(), ampdoctor.diagnose(r.run_dir)]


def assert_quiet(r: Run):
    for rep in reports(r):
        verdict(not alarms(rep.findings) and rep.exit_code == 0, rep)


SCALER_RULES = ("skipped_steps", "loss_scale_collapse")


def assert_flagged(r: Run, rules=SCALER_RULES, module=None, severities=("warning", "error"), top=None):
    """In both reports, one of `rules` (at `module` when given) as a warning or an error, among the first `top`
    findings when given (a producer module: among the first three)."""
    for rep in reports(r):
        hit = [f for f in rep.findings[:top] if f.rule in rules and f.severity in severities
               and (module is None or f.module == module)]
        verdict(bool(hit), rep)


def assert_learns(r: Run, per=None, fall=0.8, outliers=()):
    """Every loss finite and the loss (divided by per(i) where given) falls: the mean of the last fifth below `fall`
    times that of the first fifth (the skipped steps and the outlier batches left out)."""
    assert all(map(math.isfinite, r.losses)), r.losses
    vals = [(i, l / (per(i) if per else 1.0)) for i, l in enumerate(r.losses)
            if i not in r.skipped and i not in outliers]
    k = max(1, len(vals) // 5)
    first = sum(v for _, v in vals[:k]) / k
    last = sum(v for _, v in vals[-k:]) / k
    assert last < fall * first, (first, last)


# --- models and data ---------------------------------------------------------------------------------------------

def mlp(h=64, out=1):
    return nn.Sequential(nn.Linear(16, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, out))


def regression(n=64, noise=0.5, seed=0, spikes=None):
    """y = x @ W + noise; `n(i)` (or a number) examples at step i; at the steps in `spikes` one target is off by that
    much (a label-noise outlier)."""
    spikes = spikes or {}

    def batch(i):
        k = n(i) if callable(n) else n
        g = gen(seed * 100_000 + i)
        x = torch.randn(k, 16, generator=g)
        y = x @ W16 + noise * torch.randn(k, 1, generator=g)
        if i in spikes:
            y[3] += spikes[i]
        return x, y
    return batch


def mse(m, i, x, y):
    return F.mse_loss(m(x).float(), y)


def mse_sum(m, i, x, y):
    """Summed over the examples (the loss of a token-summed LM or of a batch-size warm-up recipe)."""
    return F.mse_loss(m(x).float(), y, reduction="sum")


def bs_warmup(i):
    """GPT-3-style batch-size warm-up: 8 examples, doubling every 6 steps up to 512 (at step 36)."""
    return min(512, int(8 * 2 ** (i / 6)))


def bs_stages(i):
    """Batch-size warm-up in stages: 16, then 128 from step 10, then 1024 from step 20 (8x per stage)."""
    return 16 if i < 10 else 128 if i < 20 else 1024


def classifier(h=64):
    return nn.Sequential(nn.Linear(16, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(),
                         nn.Linear(h, 10))


def classes(n=256, seed=0):
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, 16, generator=g)
        return x, (x @ W10 + 0.5 * torch.randn(n, 10, generator=g)).argmax(1)
    return batch


def ce_sum(m, i, x, y):
    return F.cross_entropy(m(x).float(), y, reduction="sum")


# ==================================================================================================================
# healthy: the scaler skips steps as designed -> no warning, no error
# ==================================================================================================================

@pytest.mark.parametrize("init", [INIT, 2.0 ** 32], ids=["65536", "2**32"])
def test_first_search_then_no_skip(init, tmp_path):
    """The first search from init_scale down to a scale that works (2**32: Megatron's initial loss scale, a search of
    about 20 steps), then no skip."""
    torch.manual_seed(0)
    r = train(classifier(), classes(), ce_sum, tmp_path / "run", steps=120, init_scale=init)
    k = r.first_good
    assert k >= 4 and r.skipped == list(range(k)), (r.skipped, r.scales)
    assert r.final_scale == init / 2 ** k
    assert_learns(r)
    assert_quiet(r)


XF_DESCENT_60 = (
    "ampdoctor/rules/steps.py _descent: a descent counts only if the clean steps after its last skip are at least as "
    "many as the descent lasted (`clean_after >= max(settle_min, skips[-1] - first_good)`): here 59 - 38 = 21 < "
    "38 - 5 = 33, although the 21 clean steps are almost twice the longest gap (11) between two of its backoffs; "
    "so _later_probes counts the 5 backoffs one by one, 5 >= later_min and 5/54 >= later_share, benign_backoff "
    "drops them, and scale_timeline "
    "(rules/scaler.py) warns skipped_steps '5 of 55 steps after warm-up (9%)'")


@pytest.mark.parametrize("steps", [
    60, 100, 160])
def test_gradients_that_grow_over_the_first_tens_of_steps(steps, tmp_path):
    """The scale halves each time the gradients double during a batch-size warm-up (steps 10-38), then never again.
    The three runs are the same run cut at 60, 100 and 160 steps."""
    torch.manual_seed(0)
    r = train(mlp(), regression(n=bs_warmup), mse_sum, tmp_path / "run", steps=steps)
    later = r.later
    assert len(later) >= 4 and 34 <= later[-1] <= 42 and r.first_good <= 8, (r.skipped, r.scales)
    assert all(s + 1 not in r.skipped for s in later), r.skipped  # each one followed by an applied update
    assert all(r.scales[a] > r.scales[b] for a, b in zip(later, later[1:]))  # each at a new, lower scale
    # then never again: the clean tail is 1.5x the longest gap between two of those backoffs, or longer
    gaps = [b - a for a, b in zip(later, later[1:])]
    assert steps - 1 - later[-1] >= max(15, 1.5 * max(gaps)) and r.final_scale >= 1.0, (r.skipped, gaps)
    assert_learns(r, per=bs_warmup)
    assert_quiet(r)


def test_batch_size_stages_cost_two_backoffs_in_a_row(tmp_path):
    """An 8x batch-size stage multiplies the summed gradients by more than 2: GradScaler skips twice (or three times)
    in a row, then steps at the scale that fits, as designed."""
    torch.manual_seed(0)
    r = train(mlp(), regression(n=bs_stages), mse_sum, tmp_path / "run", steps=100)
    later = r.later
    runs = streaks(later)
    assert sum(len(s) >= 2 for s in runs) >= 2 and max(map(len, runs)) <= 3, (r.skipped, r.scales)
    assert len(later) >= 6, later
    assert all(r.scales[a] > r.scales[b] for a, b in zip(later, later[1:]))  # the scale only ever went down
    assert later[-1] <= 36 and r.final_scale >= 1.0, (r.skipped, r.scales)
    assert_learns(r, per=bs_stages)
    assert_quiet(r)


def test_growth_then_one_outlier_batch(tmp_path):
    """The batch-size warm-up's backoffs (over by step 42), then at step 80 one mislabelled example whose gradient
    overflows the settled scale and is finite at half of it."""
    torch.manual_seed(0)
    r = train(mlp(), regression(n=bs_warmup, spikes={80: 600.0}), mse_sum, tmp_path / "run", steps=100, keep=(80,))
    later = r.later
    assert later[-1] == 80 and len(later) >= 5 and later[-2] <= 42, (r.skipped, r.scales)
    assert all(s + 1 not in r.skipped for s in later), r.skipped
    assert not grads_finite(r, 80, r.scales[80]) and grads_finite(r, 80, r.scales[80] / 2)
    assert_learns(r, per=bs_warmup, outliers=(80,))
    assert_quiet(r)


def _probe_run(tmp_path, steps, **kw):
    torch.manual_seed(0)
    return train(mlp(), regression(n=512, noise=2.0), mse, tmp_path / "run", steps=steps, opt="sgd", lr=3e-3, **kw)


def test_growth_interval_20_probes_upward_and_backs_off(tmp_path):
    r = _probe_run(tmp_path, 400, growth_interval=20)
    later, pr = r.later, probes(r)
    assert len(pr) >= 12 and len(pr) >= 0.8 * len(later), (r.skipped, r.scales)
    assert all(len(s) == 1 for s in streaks(later)), r.skipped  # one skip per probe
    assert min(r.scales) >= INIT / 4 and r.final_scale >= INIT / 4
    assert_learns(r, fall=0.9)
    assert_quiet(r)


def test_growth_factor_4(tmp_path):
    """growth_factor=4 (growth_interval=25): a growth above the working scale costs two halvings (4x -> 2x -> 1x)."""
    r = _probe_run(tmp_path, 300, growth_interval=25, growth_factor=4.0)
    later, pr = r.later, probes(r)
    assert len(pr) >= 10 and len(pr) >= 0.8 * len(later), (r.skipped, r.scales)
    assert any(len(s) == 2 for s in streaks(later)) and max(map(len, streaks(later))) <= 2, r.skipped
    assert min(r.scales) >= INIT / 4 and r.final_scale >= INIT / 4
    assert_learns(r, fall=0.9)
    assert_quiet(r)


def test_rare_outlier_batch_one_in_a_hundred(tmp_path):
    """One mislabelled example every 100 steps (50, 150, 250, 350), growth_interval=60 (the scale climbs back
    between them): each outlier that skips overflows at its scale and is finite at half of it."""
    out = (50, 150, 250, 350)
    torch.manual_seed(0)
    r = train(mlp(), regression(n=512, noise=2.0, spikes={k: 300.0 for k in out}), mse, tmp_path / "run",
              steps=400, opt="sgd", lr=3e-3, growth_interval=60, keep=out)
    hit = [s for s in out if s in r.skipped]
    assert len(hit) >= 3, (r.skipped, r.scales)
    for s in hit:
        assert not grads_finite(r, s, r.scales[s]) and grads_finite(r, s, r.scales[s] / 2), s
    pr = probes(r)
    assert all(s in hit or s in pr for s in r.later), (r.skipped, pr, r.scales)
    assert len(r.later) <= 10 and r.final_scale >= INIT / 4
    assert_learns(r, fall=0.9, outliers=out)
    assert_quiet(r)


def test_linear_lr_warmup(tmp_path):
    """AdamW with the lr rising linearly to 1e-2 over 80 steps: the first search, then the gradients grow with the
    weights as the lr rises and the scale backs off during the warm-up, never after."""
    torch.manual_seed(0)
    r = train(classifier(), classes(), ce_sum, tmp_path / "run", steps=200,
              lr_at=lambda i: 1e-2 * min(1.0, (i + 1) / 80))
    later = r.later
    assert r.first_good >= 3 and r.skipped[:r.first_good] == list(range(r.first_good)), r.skipped
    assert 1 <= len(later) <= 4 and later[-1] < 80, (r.skipped, r.scales)
    assert all(s + 1 not in r.skipped for s in later), r.skipped
    assert_learns(r)
    assert_quiet(r)


def test_growth_interval_10_probes_are_no_layer_error(tmp_path):
    """growth_interval=10: one probe every 11 steps (9% of the steps), each a skip at twice the scale that works.
    That rate may earn a skipped_steps warning (a short growth_interval costs updates), but the layer whose
    backward overflowed at the probe scale did nothing wrong: no error, and no overflow above info."""
    r = _probe_run(tmp_path, 300, growth_interval=10)
    later, pr = r.later, probes(r)
    assert len(pr) >= 20 and len(pr) >= 0.8 * len(later), (r.skipped, r.scales)
    assert all(len(s) == 1 for s in streaks(later)), r.skipped
    assert min(r.scales) >= INIT / 4
    assert_learns(r, fall=0.9)
    for rep in reports(r):
        bad = [f.one_line() for f in rep.findings if f.severity == "error"
               or f.rule in ("overflow", "nan_origin") and f.severity != "info"]
        verdict(not bad and rep.exit_code == 0, rep)


# ==================================================================================================================
# unhealthy: the skips are not the scaler's design -> a warning or an error
# ==================================================================================================================

class SumPool(nn.Module):
    """DeepSets' sum pooling over the points of a set, in fp16 under autocast."""

    def forward(self, h):
        return h.sum(1)


class PointNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(3, 64), nn.ReLU())
        self.pool = SumPool()
        self.rho = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, pts):
        return self.rho(self.pool(self.phi(pts)) / pts.shape[1])


def clouds(every=5, seed=0):
    """Point clouds of 512 points (target: their mean distance from the origin); every `every`-th batch holds one
    cloud that came in millimetres instead of metres (x 1000: a unit error in one upstream shard)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        pts = torch.randn(8, 512, 3, generator=g) * (0.5 + torch.rand(8, 1, 1, generator=g))
        y = pts.norm(dim=-1).mean(1, keepdim=True)
        if i % every == every - 1:
            pts[5] = pts[5] * 1000
        return pts, y
    return batch


def test_forward_inf_every_fifth_step_in_one_layer(tmp_path):
    """One batch in five overflows the sum pooling in the forward: no loss scale cures it (each skip halves the
    scale for nothing), 20% of the steps skipped."""
    torch.manual_seed(0)
    batch = clouds()
    r = train(PointNet(), batch, mse, tmp_path / "run", steps=100, lr=3e-3, init_scale=2.0 ** 12)
    bad = [i for i in range(100) if i % 5 == 4]
    assert r.skipped == bad and all(not math.isfinite(r.losses[i]) for i in bad), r.skipped
    assert all(math.isfinite(r.losses[i]) for i in range(100) if i not in bad)
    # the producer is the pooling: its input (phi's output) is finite, its sum is not
    m = r.model
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        h = m.phi(batch(bad[-1])[0])
    assert torch.isfinite(h).all() and not torch.isfinite(m.pool(h)).all()
    assert_flagged(r)
    assert_flagged(r, ("overflow",), "pool", ("error",), top=3)


class PairDist(nn.Module):
    """Euclidean distance sqrt(clamp(d2, min=0)): the clamp does nothing for sqrt's gradient at 0."""

    def forward(self, a, b):
        return torch.sqrt(torch.clamp(((a.float() - b.float()) ** 2).sum(-1), min=0.0))


class Triplet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.dist = PairDist()

    def forward(self, anchor, pos, neg):
        a, p, n = self.enc(anchor), self.enc(pos), self.enc(neg)
        return F.relu(self.dist(a, p) - self.dist(a, n) + 1.0).mean()


def triplets(every=5, seed=0):
    """Positives are noisy copies of their anchors; every `every`-th batch one positive IS its anchor (a duplicate):
    distance 0, sqrt'(0) = inf -> NaN in the backward, at any loss scale."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        a = torch.randn(32, 16, generator=g)
        p = a + 0.3 * torch.randn(32, 16, generator=g)
        neg = torch.randn(32, 16, generator=g)
        if i % every == every - 1:
            p[6] = a[6]
        return a, p, neg
    return batch


def test_backward_nan_every_fifth_step_at_any_scale(tmp_path):
    bad = [i for i in range(100) if i % 5 == 4]
    torch.manual_seed(0)
    r = train(Triplet(), triplets(), lambda m, i, *a: m(*a), tmp_path / "run", steps=100, lr=3e-3, keep=bad[:2])
    assert set(bad) <= set(r.skipped) and all(map(math.isfinite, r.losses)), r.skipped
    for s in bad[:2]:
        for k in range(int(math.log2(r.scales[s])) + 1):
            assert not grads_finite(r, s, r.scales[s] / 2 ** k), (s, k)  # halving does not cure it
    assert_flagged(r)
    assert_flagged(r, ("overflow", "nan_origin"), "dist", ("error",), top=3)


class L2Norm(nn.Module):
    """x / ||x|| per row, no eps: a row of zeros gives 0/0."""

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class SlotEmbedder(nn.Module):
    """Encodes each slot, zero-fills the padded ones (keep = 0), L2-normalises, classifies; the loss is over every
    slot, padded or not (the loader's labels for padding were never masked)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32))
        self.l2n = L2Norm()
        self.head = nn.Linear(32, 10)

    def forward(self, x, keep):
        return self.head(10 * self.l2n(self.enc(x) * keep[:, None]))


def slots(start=20, seed=0):
    """From step `start` on, the loader pads every batch's last slot (keep = 0)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(32, 16, generator=g)
        keep = torch.ones(32)
        if i >= start:
            keep[-1] = 0.0
        return x, keep, (x @ W10).argmax(1)
    return batch


def test_nan_every_step_from_step_20_collapses_the_scale(tmp_path):
    torch.manual_seed(0)
    batch = slots()
    r = train(SlotEmbedder(), batch, lambda m, i, x, keep, y: F.cross_entropy(m(x, keep).float(), y),
              tmp_path / "run", steps=50, lr=3e-3)
    assert r.skipped == list(range(20, 50)), r.skipped
    assert all(math.isfinite(v) != (i >= 20) for i, v in enumerate(r.losses)), r.losses
    assert r.final_scale < INIT / 2 ** 20
    m = r.model
    x, keep, _ = batch(30)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        h = m.enc(x) * keep[:, None]
    assert torch.isfinite(h).all() and torch.isnan(m.l2n(h)).any()  # l2n makes the NaN
    assert_flagged(r, ("loss_scale_collapse",), severities=("error",))
    assert_flagged(r, ("nan_origin",), "l2n", ("error",), top=3)


# plain least squares, full batch, started at the true coefficients; SGD with the lr a little above 2 / lambda_max of
# the summed loss's Hessian: the error along the top eigenvector grows by |1 - lr * lambda_max| per applied update
# (lambda_max in float64 and the lr rounded: a divergent run amplifies any last-bit difference, and LAPACK's float32
# answers differ from call to call)
_G = gen(11)
LS_X = torch.randn(1024, 16, generator=_G)
LS_Y = LS_X @ W16 + 0.1 * torch.randn(1024, 1, generator=_G)
_XB = torch.cat([LS_X, torch.ones(1024, 1)], 1).double()
LAMBDA_MAX = float(torch.linalg.eigvalsh(2 * _XB.T @ _XB).max())


def _diverging(tmp_path, k, steps):
    torch.manual_seed(0)
    m = nn.Linear(16, 1)
    with torch.no_grad():
        m.weight.copy_(W16.T)
        m.bias.zero_()
    r = train(m, lambda i: (LS_X, LS_Y), mse_sum, tmp_path / "run", steps=steps, opt="sgd",
              lr=float(f"{k / LAMBDA_MAX:.4g}"), clip=0)
    # the loss grows without bound while every forward stays finite; the scale halves each time the gradients
    # double, one skip at a time, through the whole run, until it is below 1
    assert all(map(math.isfinite, r.losses)) and r.losses[-1] > 1e5 * r.losses[0], (r.losses[0], r.losses[-1])
    assert all(s + 1 not in r.skipped for s in r.later), r.skipped
    assert r.final_scale < 1.0 and r.scales.index(min(r.scales)) > 0.9 * steps, (r.skipped, r.final_scale)
    q = steps // 4
    assert all(any(a * q <= s < (a + 1) * q for s in r.skipped) for a in range(4)), r.skipped
    return r


def test_lr_too_high_scale_halves_below_1(tmp_path):
    """lr 3.5% above the stability limit: the gradients double about every 11 steps; 250 steps, 21 backoffs after
    the first update (8%)."""
    r = _diverging(tmp_path, 2.07, 250)
    assert len(r.later) >= 0.05 * 250
    assert_flagged(r)


def test_lr_too_high_slowly_scale_halves_below_1(tmp_path):
    """lr 1.5% above the stability limit: the gradients double about every 24 steps; 400 steps, the scale falls from
    65536 to 0.125, one halving at a time, 15 backoffs after the first update (under 5% of the steps)."""
    r = _diverging(tmp_path, 2.03, 400)
    assert len(r.later) < 0.05 * 400
    assert_flagged(r)


def test_backoff_factor_099_most_steps_skipped(tmp_path):
    """backoff_factor=0.99: each skip takes 1% off the scale, so it creeps down and then sits where most batches
    overflow (targets offset by 2: the first gradients need a quarter of 65536)."""
    torch.manual_seed(0)
    r = train(mlp(), regression(), lambda m, i, x, y: F.mse_loss(m(x).float(), y + 2.0), tmp_path / "run",
              steps=200, lr=1e-2, backoff_factor=0.99)
    assert len(r.skipped) > 0.5 * 200 and r.final_scale > INIT / 8, (len(r.skipped), r.final_scale)
    assert all(map(math.isfinite, r.losses))
    assert_flagged(r)


def test_growth_interval_2_skips_30_percent_at_a_steady_scale(tmp_path):
    """growth_interval=2: every third step a probe, a third of the batches thrown away at a scale that stays
    between 32768 and 262144."""
    r = _probe_run(tmp_path, 150, growth_interval=2)
    share = len(r.skipped) / 150
    assert 0.25 <= share <= 0.4, (share, r.skipped)
    assert INIT / 2 <= min(r.scales) and max(r.scales) <= 4 * INIT, sorted(set(r.scales))
    assert_flagged(r)


def spiked_triplets(spike_at=10, every=25, seed=0):
    """`triplets(every)`, and at step `spike_at` one positive far from its anchor (a mislabelled pair: a gradient
    spike that overflows the scale it meets and is finite at half of it)."""
    base = triplets(every, seed)

    def batch(i):
        a, p, neg = base(i)
        if i == spike_at:
            p[3] = a[3] + 90.0 * torch.randn(16, generator=gen(seed * 100_000 + i + 77))
        return a, p, neg
    return batch


RARE = [i for i in range(400) if i % 25 == 24]


def _rare_nan_run(tmp_path, batch, keep):
    torch.manual_seed(0)
    r = train(Triplet(), batch, lambda m, i, *a: m(*a), tmp_path / "run", steps=400, lr=3e-3, keep=keep)
    for s in RARE[:2]:
        for k in range(int(math.log2(r.scales[s])) + 1):
            assert not grads_finite(r, s, r.scales[s] / 2 ** k), (s, k)  # halving does not cure it
    # 16 skips in 400 steps (4%), each halving the scale for nothing: 65536 -> 1 or below
    assert all(map(math.isfinite, r.losses)) and r.final_scale <= 1.0, r.final_scale
    return r


def test_rare_backward_nan_at_any_scale(tmp_path):
    """Every 25th batch (4% of the steps) holds a duplicate pair: NaN in `dist`'s backward at any scale. Nothing
    before it: the first of them is the run's first skip at a settled scale, and the watch's capture of it, replayed,
    names `dist`."""
    r = _rare_nan_run(tmp_path, triplets(every=25), keep=RARE[:2])
    assert r.skipped == RARE, (r.skipped, r.scales)
    assert_flagged(r, ("overflow", "nan_origin"), "dist", ("error",), top=3)


def test_rare_backward_nan_at_any_scale_after_a_harmless_spike(tmp_path):
    """The same 4% of steps NaN in `dist`'s backward at any scale; before them, at step 10, one harmless gradient
    spike (finite at half the scale), the kind of skip GradScaler is for."""
    r = _rare_nan_run(tmp_path, spiked_triplets(), keep=(10,) + tuple(RARE[:2]))
    assert r.skipped == [10] + RARE, (r.skipped, r.scales)
    assert not grads_finite(r, 10, r.scales[10]) and grads_finite(r, 10, r.scales[10] / 2)
    assert_flagged(r, SCALER_RULES + ("overflow", "nan_origin"))
    assert_flagged(r, ("overflow", "nan_origin"), "dist", ("error",), top=3)
    # and the skips are not called GradScaler's normal rate beside it (the replay found NaN at every scale down to 1)
    for rep in reports(r):
        assert not any(f.rule == "skipped_steps" and f.severity == "info" for f in rep.findings), lines(rep)
