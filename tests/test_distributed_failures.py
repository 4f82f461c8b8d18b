"""DDP FAILURES THAT MULTI-GPU USERS HIT: one rank's bad data, one rank's backward NaN, one rank's persistent NaN that
collapses every rank's loss scale, a rank that crashes mid-run, and two healthy DDP loops real scripts run (uneven
per-rank batch sizes, gradient accumulation under `model.no_sync()`). Each case is one DDP run of 2 CPU processes over
gloo (tests/distsetup.py: skipped where gloo is unavailable): every rank builds the same small model (seed 0; DDP
broadcasts rank 0's weights anyway), wraps it in `DistributedDataParallel`, and runs the ordinary loop under
`ampdoctor.watch(ddp_model, optimizer=AdamW, scaler=torch.amp.GradScaler("cpu"), run_dir=<shared>)` at the default
settings (each rank its own GradScaler, records under `run_dir/rank-<r>/`): zero_grad -> CPU fp16 autocast forward ->
mse -> scale(loss).backward (DDP all-reduces the gradients) -> unscale_ -> clip_grad_norm_(1.0) -> step -> update ->
close. Each rank draws its own data shard (a generator seeded by rank and step).

Each failure is proven first by the test's own oracle, on the rank that made it: probe_harness.Producer on the
unwrapped model (forward hooks: the first module whose output is non-finite while its inputs and own parameters were
finite; full backward hooks and parameter hooks: the first module whose input or parameter gradient is non-finite while
the gradient of its output was finite; forward pre-hooks: the module a forward raised in), plus the loss, the
gradients after unscale_ (all-reduced: the same on every rank) and the scaler (skipped steps, scale), written by every
rank to `run_dir/oracle-<r>.json` after each step. On the other rank the same oracle proves that no module of its own
made anything: the inf/NaN reached its gradients only through DDP's all-reduce, which runs after its modules' and
parameters' gradient hooks. Only then is the merged `ampdoctor.diagnose(run_dir)` checked: the producer on the rank
that made it (`evidence["rank"]`), at its step, among the first three findings, an error, and no error at a module that
only passed it on, nor at a module of the other rank. A wrong report raises WrongAnswer naming ampdoctor's top three
(a failing oracle or a crash fails otherwise).

 1. a corrupt record in rank 1's shard: at step 6 one row's duration column is in microseconds (3e7) -> overflow in
    the fp16 cast/matmul of `module.num_proj` on rank 1, forward, step 6; DDP all-reduces the inf gradients to rank 0,
    both GradScalers skip step 6. Also the CLI on the run directory: `python -m ampdoctor report RUN_DIR --json OUT`
    exits 1 (an error finding) and its JSON holds the same findings as diagnose().
 2. a NaN made in the backward on rank 1: a keyword spotter whose hand-written RMS pooling `sqrt(mean(e^2))` gets an
    all-zero clip (digital silence) at step 5: forward finite (sqrt(0) = 0), backward sqrt'(0) = inf and then 0 * inf =
    NaN -> overflow/nan_origin at `module.pool`, backward, step 5, rank 1. The NaN is no loss-scale problem: the same
    batch in fp32 without a scaler gives a NaN gradient too (checked on rank 1).
 3. rank 1's shard has a sensor's missing value written as NaN in every batch from step 4 on: rank 1's loss is NaN
    from step 4, DDP spreads the NaN gradients, both scalers skip 12 steps in a row (65536 -> 16) -> the data named
    (`nan_origin`/`overflow` with no module, "batch", step 4, rank 1) among the first three, a loss_scale_collapse
    error, and no error at any module (rank 0's oracle: none of its modules made a non-finite gradient).
 4. healthy: uneven batch sizes per rank (rank 0 16 rows, rank 1 12, rank 1's last batch 5) -> quiet (no warning or
    error in the merged report, exit 0, no internal error, no RuntimeWarning of ampdoctor's on either rank).
 5. healthy: gradient accumulation over 4 micro-batches, the first 3 under `model.no_sync()` (the all-reduce only on
    the last) -> quiet, 10 steps recorded per rank (not 40).
 6. rank 1 crashes at step 5 (a newer export of its shard has 9 numeric columns: `mat1 and mat2 shapes cannot be
    multiplied` in `module.num_proj`'s forward) while rank 0 waits in the all-reduce of step 5 (gloo then fails it, or
    mp.spawn kills it) -> (a) the merged report must not say healthy: exit code 1, a crash in the summary;
    (b) it names rank 1's exception (RuntimeError at step 5 in `module.num_proj`) and does not call it a divergence of
    the GradScalers.

What ampdoctor says: all 7 right. At first (on c6b6f59) 1, 2, 3 and 6b were wrong (strict xfails; each proved the
failure first and failed only at the report check); fixed since: 3 (a rank whose own backward made only finite
gradients no longer takes the parameters' gradients that DDP's all-reduce made non-finite for its own producer:
record/assemble.py), and 1, 2 and 6b: a distributed watch's close() replays its capture where the rank can run the model by itself (a DDP model's
module under DDP's naming, replay/skeleton.alone; not with SyncBatchNorm or DTensor parameters), the merged crash is
the rank's own exception before another rank's exit, and no divergence is read at a step a crash cut short:
- 1: `[error] nan_origin at (run) step 6` ("a step without per-layer statistics; replay its capture ... or watch with
  every=1") + `[info] skipped_steps`: at the default sampling step 6 has no per-layer statistics, and a distributed
  watch's close() does not replay the capture (watch.py `_close`: `world_size <= 1`, so that a replay's collective
  cannot hang the ranks); diagnose() never replays. Both ranks wrote `captures/6`. The CLI part is right (exit 1,
  the same findings).
- 2: "Healthy: ... GradScaler's early backoff skipped step(s) 5 ... as designed", only `[info] skipped_steps at (run)
  step 5`: the one skip with a finite loss was taken for a benign backoff. The same loop in one process names it
  (`[error] overflow at pool aten::div step 5`, backward, from close()'s replay).
- 3: the data is named first (rank 1), but rank 0's record blames its own `module.head` for what the all-reduce put
  into its gradients: `[error] overflow at module.head step 4` (backward, "turned a finite incoming gradient into
  ±inf ... on every step", evidence ranks [0]) and `[error] loss_scale_collapse at module.head step 4` (rank 0),
  beside rank 1's right `loss_scale_collapse at (run)`. In one process the same data gives only the data finding and
  the collapse.
- 6b: the merged summary's crash is rank 0's consequence (`SystemExit: the script called sys.exit(1)` from
  mp.spawn's wrapper in multiprocessing/process.py, or `Killed`), not rank 1's `RuntimeError ... in
  module.num_proj`, which rank 1's own record holds (analysis/merging.py `_merge_ranks`: the first rank with a crash,
  in rank order), and the top error is `scaler_misorder` "The ranks' GradScalers diverged at step 5: rank 0: scale
  65536.0 ..., rank 1: scale None ... (uneven batches per rank?)" (rules/scaler.py `ranks_diverged` compares the step
  a crash cut short). Rank 1's own record is right: `Crashed at step 5: RuntimeError: mat1 and mat2 shapes cannot
  be multiplied (16x9 and 8x32) in module.num_proj`.
Where 3 comes from: rank 0 reads its parameters' gradients after DDP's all-reduce (record/assemble.py: a parameter
whose gradient is non-finite marks its module), and record/producers.py `backward_producer` takes a module with
non-finite parameter gradients and a finite output gradient for the producer (the earliest in backward order): on a
rank that only received the NaN through the all-reduce, that is the last layer, `module.head`.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_distributed_failures.py
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
import distsetup
from distsetup import BACKEND, DEV, WORLD, available, process_group
from probe_harness import Producer, WrongAnswer, finite
from scenarios import alarms, lines

pytestmark = pytest.mark.skipif(not available(), reason=f"torch.distributed with {BACKEND} is not available")
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# the models and the data shards
# ======================================================================================================================
class TabNet(nn.Module):
    """A tabular regressor: text-embedding features and numeric columns, projected, mixed, one output."""

    def __init__(self):
        super().__init__()
        self.txt_proj = nn.Linear(16, 32)
        self.num_proj = nn.Linear(8, 32)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, txt, num):
        return self.head(self.body(torch.cat([self.txt_proj(txt), self.num_proj(num)], -1))).squeeze(-1)


class RMSPool(nn.Module):
    """The per-band energy over time, hand-written: sqrt(mean(e^2))."""

    def forward(self, e):
        return torch.sqrt((e * e).mean(1))


class KWS(nn.Module):
    """A keyword spotter on raw frames: a learnable filterbank (no bias), RMS pooling over time, a small head."""

    def __init__(self):
        super().__init__()
        self.fb = nn.Linear(64, 32, bias=False)
        self.pool = RMSPool()
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, frames):
        return self.head(self.pool(self.fb(frames))).squeeze(-1)


W_TXT = torch.randn(16, generator=torch.Generator().manual_seed(7)) * 0.3
W_NUM = torch.randn(8, generator=torch.Generator().manual_seed(8)) * 0.3


def tab_batch(rank, i, n=16, bad=None):
    """Rank `rank`'s i-th batch (its own shard); `bad`: what is wrong with it."""
    g = torch.Generator().manual_seed(1000 * rank + i)
    txt, num = torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)
    y = torch.tanh(txt @ W_TXT + num @ W_NUM)
    if bad == "us":
        num[3, 2] = 3.0e7          # one record's duration in microseconds, not seconds
    elif bad == "nan":
        num[5, 4] = float("nan")   # a sensor's missing value written as NaN
    elif bad == "cols":
        num = torch.cat([num, torch.zeros(n, 1)], 1)  # a newer export with one more column
    return (txt, num), y


def kws_batch(rank, i, n=16, bad=None):
    g = torch.Generator().manual_seed(1000 * rank + i)
    frames = torch.randn(n, 10, 64, generator=g)
    y = (frames[:, :, :8].pow(2).mean((1, 2)) - 1.0) * 2
    if bad == "silent":
        frames[2] = 0.0            # an empty clip (digital silence)
    return (frames,), y


# case -> (model, batch, steps, {rank: {step: what is wrong}}, options: lr, n {rank: rows}, last_n, accum)
CASES = {
    "shard": (TabNet, tab_batch, 10, {1: {6: "us"}}, {}),
    "bwd": (KWS, kws_batch, 10, {1: {5: "silent"}}, {}),
    "collapse": (TabNet, tab_batch, 16, {1: {s: "nan" for s in range(4, 16)}}, {}),
    "uneven": (TabNet, tab_batch, 12, {}, {"lr": 1e-2, "n": {0: 16, 1: 12}, "last_n": {1: 5}}),
    "nosync": (TabNet, tab_batch, 10, {}, {"lr": 1e-2, "accum": 4}),
    "crash": (TabNet, tab_batch, 10, {1: {5: "cols"}}, {}),
}


# ======================================================================================================================
# the worker: one rank's DDP + fp16 autocast + GradScaler loop under a watch, with its own oracle
# ======================================================================================================================
def _worker(rank: int, port: int, run_dir: str, case: str) -> None:
    make, batch, steps, bad, opts = CASES[case]
    log = dict(rank=rank, first=None, first_bwd=None, losses=[], bad_loss=[], skipped=[], grad_bad=[], grad_nan=[],
               scales=[], fp32_nan=None, crash=None, warns=[], recorded=None, weights=None, done=False)
    path = os.path.join(run_dir, f"oracle-{rank}.json")

    def dump():
        with open(path + ".tmp", "w") as f:
            json.dump(log, f)
        os.replace(path + ".tmp", path)

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the oracle's hooks on the 1st layers
    with warnings.catch_warnings(record=True) as seen, process_group(rank, port) as dev:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        net = make().to(dev)
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=opts.get("lr", 1e-3))
        scaler = torch.amp.GradScaler(DEV)
        orc = Producer(net, backward=True, stack=True)
        w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=run_dir)
        accum = opts.get("accum", 1)
        step = 0
        try:
            for step in range(steps):
                orc.step = step
                opt.zero_grad()
                n = opts.get("n", {}).get(rank, 16)
                if step == steps - 1:
                    n = opts.get("last_n", {}).get(rank, n)
                what = bad.get(rank, {}).get(step)
                if what == "silent":  # the same batch in fp32, no autocast, no scaler, on an unwatched copy
                    ref = make()
                    ref.load_state_dict(net.state_dict())
                    args, y = batch(rank, step, n=n, bad=what)
                    F.mse_loss(ref(*args), y).backward()
                    log["fp32_nan"] = bool(ref.fb.weight.grad.isnan().any())
                total = 0.0
                for k in range(accum):
                    args, y = batch(rank, step * accum + k, n=n, bad=what if k == 0 else None)
                    args, y = tuple(a.to(dev) for a in args), y.to(dev)
                    with model.no_sync() if k < accum - 1 else contextlib.nullcontext():
                        with torch.autocast(DEV, dtype=torch.float16):
                            out = model(*args)
                        loss = F.mse_loss(out.float(), y) / accum
                        scaler.scale(loss).backward()
                    total += loss.item()
                log["losses"].append(total)
                if not math.isfinite(total):
                    log["bad_loss"].append(step)
                s0 = scaler.get_scale()
                log["scales"].append(s0)
                scaler.unscale_(opt)
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                if not finite(grads):
                    log["grad_bad"].append(step)
                if any(bool(g.isnan().any()) for g in grads):
                    log["grad_nan"].append(step)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() < s0:
                    log["skipped"].append(step)
                log["first"] = orc.first and ["module." + orc.first[0], orc.first[1]]
                log["first_bwd"] = orc.first_bwd and ["module." + orc.first_bwd[0], orc.first_bwd[1]]
                dump()
        except Exception as e:  # what the oracle saw raise, and where; the script then dies of it
            log["crash"] = [step, type(e).__name__, str(e), "module." + orc.stack[-1] if orc.stack else None]
            dump()
            raise
        orc.remove()
        w.close()
        log["recorded"] = len(w.steps)
        log["weights"] = float(sum(p.detach().double().sum() for p in net.parameters()))
    log["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                    and str(x.message).startswith("ampdoctor:")]
    log["done"] = True
    dump()


def run(tmp_path, case):
    """One DDP run of `case`: the shared run directory and each rank's oracle."""
    rd = distsetup.run(_worker, tmp_path, case)
    return rd, oracles(rd)


def oracles(rd):
    return [json.loads(open(os.path.join(rd, f"oracle-{r}.json")).read()) for r in range(WORLD)]


# ======================================================================================================================
# the checks
# ======================================================================================================================
def top3(rep):
    return [f"{s} (rank {f.evidence.get('rank')})" for s, f in zip(lines(rep)[:3], rep.findings)]


def report_check(rep, body):
    """Run the report check `body()`; a failed assertion is a WrongAnswer naming ampdoctor's top three."""
    try:
        body()
    except AssertionError as e:
        raise WrongAnswer(f"verdict={rep.summary.get('verdict')!r} top3={top3(rep)} ({e})") from None


def named(rep, rules, module, step, phase, rank, quiet_at=()):
    """`rules` at the producer `module`, at `step`, `phase`, error, first seen on `rank`, among the first three
    findings; no error at the modules that only passed it on (`quiet_at`), none at a module seen only on the other
    rank."""
    hits = [f for f in rep.findings[:3] if f.rule in rules and f.module == module]
    assert hits, f"no {rules} at {module} in the first three"
    f = hits[0]
    assert (f.step, f.phase, f.severity, f.evidence.get("rank")) == (step, phase, "error", rank), f.one_line()
    passed_on = [g.one_line() for g in rep.findings if g.severity == "error" and g.module in quiet_at]
    assert not passed_on, f"errors at modules that passed it on: {passed_on}"
    assert not other_rank_blamed(rep, rank), f"blames the other rank: {other_rank_blamed(rep, rank)}"


def other_rank_blamed(rep, rank):
    """The warnings/errors at a module seen only on ranks other than `rank` (which made nothing)."""
    return [f"{f.one_line()} ranks={f.evidence.get('ranks')}" for f in rep.findings
            if f.severity in ("error", "warning") and f.module is not None
            and rank not in f.evidence.get("ranks", [f.evidence.get("rank")])]


def quiet_ddp(rd, orc, steps):
    """A healthy DDP run, proven and reported quiet: every loss finite and the loss down on each rank, no skip, no
    producer, the ranks' weights equal at the end (DDP kept them in sync), no RuntimeWarning of ampdoctor's; the
    merged report has no warning or error, exit code 0, no internal error, every step recorded."""
    for o in orc:
        assert o["done"] and all(map(math.isfinite, o["losses"])), o
        assert o["skipped"] == [] and o["grad_bad"] == [] and o["first"] is None and o["first_bwd"] is None, o
        assert sum(o["losses"][-3:]) < 0.9 * sum(o["losses"][:3]), o["losses"]
        assert o["recorded"] == steps, o["recorded"]
    assert math.isclose(orc[0]["weights"], orc[1]["weights"], rel_tol=0, abs_tol=1e-9), [o["weights"] for o in orc]
    assert [o["warns"] for o in orc] == [[], []], [o["warns"] for o in orc]
    rep = ampdoctor.diagnose(rd)
    assert rep.summary["ranks"] == [0, 1] and rep.summary["steps"] == steps, rep.summary
    assert alarms(rep.findings) == [] and rep.exit_code == 0, top3(rep)
    assert rep.summary.get("internal_error") is None and rep.summary.get("crash") is None, rep.summary
    assert rep.summary["verdict"].startswith("Healthy"), rep.summary["verdict"]


# ======================================================================================================================
# 1. one rank's corrupt record overflows one module (and the CLI on the run directory)
# ======================================================================================================================
def test_one_ranks_corrupt_record_is_named_at_its_module_and_rank(tmp_path):
    rd, (o0, o1) = run(tmp_path, "shard")
    assert o1["first"] == ["module.num_proj", 6] and o1["bad_loss"] == [6], o1
    assert o0["first"] is None and o0["first_bwd"] is None and o0["bad_loss"] == [], o0
    assert o0["skipped"] == o1["skipped"] == [6] and o0["grad_bad"] == o1["grad_bad"] == [6], (o0, o1)
    rep = ampdoctor.diagnose(rd)
    assert rep.summary["ranks"] == [0, 1] and rep.exit_code == 1, top3(rep)
    # the CLI on the same run directory: exit 1 (an error finding), the same findings in its JSON
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "report", rd, "--json", str(out), "--out",
                        str(tmp_path / "html")], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    doc = json.loads(out.read_text())
    key = [(f["rule"], f["module"], f["step"], f["severity"], f["evidence"].get("rank")) for f in doc["findings"]]
    assert key == [(f.rule, f.module, f.step, f.severity, f.evidence.get("rank")) for f in rep.findings], key
    assert (tmp_path / "html" / "index.html").exists()
    report_check(rep, lambda: named(rep, FWD, "module.num_proj", 6, "forward", 1,
                                    quiet_at=("module.body.0", "module.body.1", "module.body.2", "module.head",
                                              "module", "")))


# ======================================================================================================================
# 2. a NaN made in one rank's backward (sqrt at an all-zero clip)
# ======================================================================================================================
def test_one_ranks_backward_nan_is_named_at_its_module_and_rank(tmp_path):
    rd, (o0, o1) = run(tmp_path, "bwd")
    assert o1["first"] is None and o1["first_bwd"] == ["module.pool", 5] and o1["fp32_nan"] is True, o1
    assert o0["first"] is None and o0["first_bwd"] is None, o0
    for o in (o0, o1):
        assert o["bad_loss"] == [] and o["skipped"] == [5] and o["grad_nan"] == [5], o
    rep = ampdoctor.diagnose(rd)
    report_check(rep, lambda: named(rep, FWD, "module.pool", 5, "backward", 1,
                                    quiet_at=("module.fb", "module.head.0", "module.head.2", "module", "")))


# ======================================================================================================================
# 3. one rank's persistent NaN data collapses every rank's loss scale
# ======================================================================================================================
def data_named(rep, step, rank):
    f = next((f for f in rep.findings[:3] if f.rule in FWD and f.module is None and "batch" in f.message), None)
    assert f is not None, "the data is not named in the first three"
    assert (f.step, f.severity, f.evidence.get("rank")) == (step, "error", rank), f.one_line()
    assert [f for f in rep.findings if f.rule == "loss_scale_collapse" and f.severity == "error"], "no collapse"
    at_module = [g.one_line() + f" ranks={g.evidence.get('ranks')}" for g in rep.findings
                 if g.severity == "error" and g.module is not None]
    assert not at_module, f"errors at modules that only passed the NaN on: {at_module}"


def test_one_ranks_persistent_nan_collapses_both_scales_and_blames_the_data(tmp_path):
    rd, (o0, o1) = run(tmp_path, "collapse")
    bad = list(range(4, 16))
    assert o1["bad_loss"] == bad and o1["first"] is None, o1  # the NaN came in with the batch: no module made it
    assert o0["bad_loss"] == [] and o0["first"] is None and o0["first_bwd"] is None, o0  # rank 0 made nothing
    for o in (o0, o1):
        assert o["skipped"] == bad and o["grad_nan"] == bad and o["scales"][-1] == 2.0 ** 16 / 2 ** 11, o
    rep = ampdoctor.diagnose(rd)
    report_check(rep, lambda: data_named(rep, 4, 1))


# ======================================================================================================================
# 4, 5. healthy DDP loops: uneven per-rank batch sizes; gradient accumulation under no_sync
# ======================================================================================================================
def test_uneven_batch_sizes_per_rank_are_quiet(tmp_path):
    rd, orc = run(tmp_path, "uneven")
    quiet_ddp(rd, orc, 12)


def test_gradient_accumulation_under_no_sync_is_quiet(tmp_path):
    rd, orc = run(tmp_path, "nosync")
    quiet_ddp(rd, orc, 10)


# ======================================================================================================================
# 6. one rank crashes mid-run; the other dies waiting in the all-reduce
# ======================================================================================================================
@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crash")
    with pytest.raises(mp.ProcessRaisedException, match="mat1 and mat2 shapes cannot be multiplied"):
        distsetup.run(_worker, tmp, "crash")
    rd = str(tmp / "crash")
    o0, o1 = oracles(rd)
    assert o1["crash"] == [5, "RuntimeError", o1["crash"][2], "module.num_proj"], o1["crash"]
    assert o1["losses"] and len(o1["losses"]) == 5 and not o1["done"], o1
    # rank 0 never finished step 5 (it waited in its all-reduce; step 4's end may race with mp.spawn's SIGTERM)
    assert len(o0["losses"]) in (4, 5) and 5 not in o0["skipped"] and not o0["done"], o0
    return rd, ampdoctor.diagnose(rd)


def test_a_rank_crash_is_not_reported_healthy(crashed):
    rd, rep = crashed
    assert rep.exit_code == 1 and rep.summary.get("crash") is not None, (rep.summary, top3(rep))
    assert not rep.summary["verdict"].startswith("Healthy"), rep.summary["verdict"]


def names_the_crash(rep):
    c = rep.summary["crash"]
    assert (c["step"], c["type"], c["module"]) == (5, "RuntimeError", "module.num_proj"), c
    div = [f.one_line() for f in rep.findings if f.rule == "scaler_misorder" and "diverged" in f.message]
    assert not div, div


def test_a_rank_crash_names_that_ranks_exception(crashed):
    rd, rep = crashed
    report_check(rep, lambda: names_the_crash(rep))
