"""A hostile tester's sixth round: bad input at the Python API and the command line that real users hand ampdoctor,
none of it probed by test_hostile_inputs3/4/5.py, test_hostile_api_unseen.py, test_hostile_capture.py,
test_hostile_rundir.py, test_hostile_cli2.py, test_crashed_runs2.py or test_cli*.py: sparse tensors among a
model's arguments (graph nets), a capture whose saved weights already hold NaN, and run directories read while
their writer is still running or after it was killed. CLI calls are real `python -m ampdoctor` subprocesses run
from an empty cwd (probe_harness.run_cli); the tiny models live in a module written under tmp_path.

The standard (docs/CONTRACT.md "Python API" and "CLI"; ampdoctor/errors.py): an argument that cannot work gets ONE
clear exception (BadInput, or Python's TypeError/ValueError) naming it, never an obscure error from inside torch, and
leaves nothing behind; bad input to the CLI is one `ampdoctor: ...` line and exit 2; nothing that existed is lost or
overwritten; a report never calls a run healthy while what the run directory holds says a step went non-finite; a
watch never changes training. Every failure is first proven by its own oracle (an independent forward hook on the
producer, the weights' own values, training bitwise equal to the unwatched loop); a failing oracle is a plain
failure; a wrong answer of ampdoctor raises WrongAnswer (a strict xfail via `wrong`).

Cases (each a real slip, with its fix):
 1. A GCN (`lin` Linear(8,16) -> torch.sparse.mm(adj, h) with autocast off -> `head` Linear(16,1)) whose
    normalised adjacency is a torch.sparse_coo_tensor, the way PyG-free graph code passes it. At step 3 a batch of
    raw node features (x 1e5) overflows fp16 in `lin` (oracle: `lin`'s output non-finite at step 3 only, its input
    finite). Watched with a run_dir at the default settings, training must stay bitwise the unwatched one and the
    report must name the overflow at `lin`, step 3, among the first three. Twins: the same loop with the adjacency
    dense (torch.mm; the capture then holds it): the overflow at `lin`, step 3; the sparse loop without the bad
    batch: no warning or error.
 2. `ampdoctor.save_batch(path, gcn, x, adj)` with that sparse adjacency: one clear exception naming the argument
    (or "sparse") and no directory left behind, or a capture that replays (the overflow at `lin`). Twin: the dense
    adjacency's capture replays the overflow at `lin`.
 3. A capture whose saved weights hold NaN: the user's loop guards `if not torch.isfinite(loss):
    ampdoctor.save_batch(...); break`, but the NaN came from the step before: a batch of raw, unnormalised targets
    (x 3e5) gave a finite fp32 loss whose gradient overflowed the fp16 output of `2` in the backward; with no
    GradScaler SGD wrote inf/NaN into the weights, and the next forward made NaN from an ordinary batch. Oracle: the
    captured batch is finite, the captured weights are not, the weights were finite one step before. `ampdoctor
    replay CAP --model ... --loss ...` must not call that healthy (exit 0): an error finding, or one line. Twin (the
    fix: capture the batch with the weights it ran on, before the bad update): the same batch replays finite and
    quiet, exit 0.
 4. `ampdoctor report RUN` (and `report RUN --model ...`) from another shell while the training process is still
    running: the MLP's first Linear overflowed at iteration 4 (x 1e5; the loop skips the non-finite loss, so
    iteration 5's optimizer step ends step 4), the watch has written captures/4, and the loop is busy (a checkpoint,
    an eval pass) after iteration 5: the run dir holds records of steps 0-3 and the capture of the bad step 4. The
    report must not call the run healthy, and the reading must change nothing in the live run dir. Twin: the same
    script run to its end: the overflow at `0`, step 4.
 5. The same script SIGKILLed (the OOM killer) at that point: not healthy, exit 1 (the crash), and with `--model`
    (the user hands the model: the capture of the bad step is in the run dir) the overflow at `0`, step 4, among the
    first three.
 6. `report RUN --out RUN --force` (the HTML report asked into the run directory itself): every file of the run is
    byte-identical afterwards and the run still reports the overflow at `0`, step 4.
 7. A run dir holding a symbolic link `rank-1 -> .` (a link loop inside the run dir, e.g. made to fake a rank
    layout): one line, or the report of the run read once (5 steps, the overflow at `0`, step 4), never a hang.

Passed: 1's twins (dense: overflow at `lin` step 3; quiet sparse: no finding, training bitwise equal), 2's twin
(overflow at `lin`), 3's twin (exit 0, finite), 4's twin (overflow at `0`, step 4), 5's crash, 6 (run files
byte-identical, index.html written, overflow at `0` step 4 before and after), 7 (5 steps, overflow at `0`, step 4).

Result when written (torch 2.13 CPU, default watch): 8 pass, 6 xfail (two runs, identical; ~80 s with -n 0).
What ampdoctor said in the xfails:
 1. "[error] nan_origin at (run) step 3: The model's output became non-finite at step 3, a step without per-layer
    statistics; replay its capture (`ampdoctor replay`) or watch with every=1 to name the layer." (the only
    finding), after the warning "ampdoctor: could not write a capture of step 3 (RuntimeError: unsupported memory
    format option Contiguous)"; an empty `captures/3/` is left, so the advised replay answers "missing file
    manifest.json". Training was bitwise the unwatched one. Should be: the overflow at `lin`, step 3 (the dense twin
    gets it). Cause: capturestruct._encode copies every tensor with `.to("cpu", copy=True).contiguous()`, which
    raises on a sparse COO tensor; record/autocapture.maybe_capture then has neither a capture nor an in-process
    replay of the live arguments.
 2. save_batch: `RuntimeError: unsupported memory format option Contiguous` from torch (the argument not named),
    an empty directory left at the path. Cause: the same _encode; capture.write_capture makes the directory first.
 3. "healthy: No mixed-precision problems found.", exit 0 (summary: finite false, loss NaN, headline "The replayed
    step is non-finite, but no op of the model was seen to make the inf/NaN ... nothing in the model is to blame").
    Should be: an error saying the capture's weights (`0.weight`, ...) already hold NaN, as a watch's report does
    for a run (rules/outside.py bad_weights), or one line. Cause: replay/__init__.py builds the findings from op
    origins only; the loaded state_dict's finiteness is never checked (replay/modelio.load_weights).
 4. live run (2 xfails): "Healthy: no problems found in 4 step(s).", exit 0, no finding, both without and with
    --model (summary captures []): step 4's record waits for the next iteration to begin, and a capture no record
    names is never looked at. Should be: not healthy (captures/4 of a non-finite step is on disk).
 5. the crash part passed ("Crashed at step 3: Killed: the training process ended without closing the watch
    ... after step 3", exit 1); with --model the report is the same crash and no finding at all (captures/4,
    complete, is not replayed): strict xfail. Same cause as 4 (analysis/merging.py
    picks captures only from records).
Fixed since (all six, forty-second session; each XPASSed, then unmarked): sparse COO/CSR tensors are captured as
their parts, arguments and state (capturestruct.encode_sparse; the capture's directory is made only after
everything encoded), a replay whose loaded weights are non-finite says so first (rules/outside.
captured_weights_finding), and a run read before it closed takes a capture ahead of its records as that step's
record (runcaptures.pending, from the capture's extra `kind`).
"""
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import ampdoctor
from ampdoctor.errors import BadInput
from probe_harness import (ROOT, WrongAnswer, copy, error_line, load_models, no_traceback, overflow_run, quiet_report,
                           run_cli, same_bits, snapshot, strict_json)

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message="Sparse invariant checks")

MODELS = "ad_h6_models"

MODELS_SRC = '''
import torch
import torch.nn as nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def scalar_loss(out, *args, **kwargs):
    return out.float().pow(2).mean()


class GCN(nn.Module):
    """One graph convolution: a node-wise Linear, then the normalised adjacency (sparse or dense) in fp32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x, adj):
        h = self.lin(x)
        with torch.autocast("cpu", enabled=False):
            h = torch.sparse.mm(adj, h.float()) if adj.is_sparse else torch.mm(adj, h.float())
        return self.head(h)


def gcn():
    return GCN()
'''

WRITER_SRC = '''
import os, sys, time
import torch
import ampdoctor
import {models} as models
from probe_harness import train_overflow

torch.set_num_threads(1)
rd, ready, go = sys.argv[1:4]
torch.manual_seed(0)
m = models.mlp()
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
w = ampdoctor.watch(m, opt, run_dir=rd)


def after(i):
    if i == 5 and ready != "-":             # the loop is busy (a checkpoint, an eval pass) after iteration 5
        open(ready, "w").close()
        t0 = time.time()
        while not os.path.exists(go) and time.time() - t0 < 200:
            time.sleep(0.05)


train_overflow(m, opt, bad_step=4, steps=7, after_step=after)
w.close()
'''


# ------------------------------------------------------------------------------------------------ helpers
def top3(rep):
    return [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]


def lines(rep):
    return [f.one_line() for f in rep.findings[:4]]


def json_top3(path):
    return [(f["rule"], f["module"], f["step"], f["severity"]) for f in strict_json(path)["findings"][:3]]


def named(top, module, step):
    return any(r in ("overflow", "nan_origin") and m == module and s == step and sev == "error"
               for r, m, s, sev in top)


def check(cond, msg):
    if not cond:
        raise WrongAnswer(str(msg)[:2000])


def not_healthy(p):
    """A report (or a refusal) that does not call the run healthy."""
    no_traceback(p)
    check(p.returncode in (1, 2) and "healthy" not in p.stdout.lower(),
          f"exit {p.returncode}: {p.stdout[-800:]}")


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("h6helpers")
    return {"dir": str(d), "models": load_models(d, MODELS, MODELS_SRC)}


@pytest.fixture(scope="module")
def base_run(helpers, tmp_path_factory):
    return overflow_run(helpers["models"], str(tmp_path_factory.mktemp("h6run") / "run"))


# ======================================================================================== 1-2: sparse adjacency
def ring_adj(n=6, sparse=True):
    """The symmetric-normalised adjacency of a ring with self loops (each entry 1/3)."""
    src = torch.arange(n)
    rows = torch.cat([src, src, src])
    cols = torch.cat([src, (src + 1) % n, (src - 1) % n])
    a = torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.full((3 * n,), 1 / 3), (n, n)).coalesce()
    return a if sparse else a.to_dense()


def gcn_run(models, *, watch, sparse=True, bad=3, steps=6, run_dir=None):
    torch.manual_seed(0)
    m = models.gcn()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    fin = []
    hook = m.lin.register_forward_hook(lambda mod, i, o: fin.append(
        (bool(torch.isfinite(i[0]).all()), bool(torch.isfinite(o).all()))))
    adj = ring_adj(sparse=sparse)
    g = torch.Generator().manual_seed(1)
    losses = []
    w = ampdoctor.watch(m, opt, run_dir=run_dir) if watch else None
    try:
        for i in range(steps):
            opt.zero_grad()
            x = torch.randn(6, 8, generator=g) * (1e5 if i == bad else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x, adj).float().pow(2).mean()
            losses.append(loss.detach().clone())
            if torch.isfinite(loss):
                loss.backward()
                opt.step()
        hook.remove()
    finally:
        if w is not None:
            w.close()
    return {"model": m, "losses": losses, "fin": fin, "w": w,
            "state": {k: v.detach().clone() for k, v in m.state_dict().items()}}


def _gcn_oracle(r, bad=3, steps=6):
    want = [(True, i != bad) for i in range(steps)]
    assert r["fin"][-steps:] == want, r["fin"]


@pytest.fixture(scope="module")
def gcn_runs(helpers, tmp_path_factory):
    models = helpers["models"]
    d = tmp_path_factory.mktemp("h6gcn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sw = gcn_run(models, watch=True, run_dir=str(d / "sparse"))
    su = gcn_run(models, watch=False)
    _gcn_oracle(su)
    dw = gcn_run(models, watch=True, sparse=False, run_dir=str(d / "dense"))
    _gcn_oracle(dw)
    qw = gcn_run(models, watch=True, bad=-1, run_dir=str(d / "quiet"))
    qu = gcn_run(models, watch=False, bad=-1)
    return {"sparse": sw, "sparse_plain": su, "dense": dw, "quiet": qw, "quiet_plain": qu, "dir": d,
            "warnings": [str(x.message) for x in seen if "Sparse invariant" not in str(x.message)]}


def _bits(t):
    return t.detach().contiguous().view(torch.uint8)


def _same_training(a, b):
    assert same_bits([x.item() for x in a["losses"]], [x.item() for x in b["losses"]]), (a["losses"], b["losses"])
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(_bits(a["state"][k]), _bits(b["state"][k])) for k in a["state"])


def test_01_gcn_with_a_sparse_adjacency_is_named_at_its_producer(gcn_runs):
    r = gcn_runs["sparse"]
    _gcn_oracle(r)
    _same_training(r, gcn_runs["sparse_plain"])                 # watching never changes training
    rep = r["w"].report()
    check(named(top3(rep), "lin", 3), f"{lines(rep)}; warnings: {gcn_runs['warnings']}")
    cap = os.path.join(gcn_runs["dir"], "sparse", "captures", "3")
    check(not os.path.isdir(cap) or os.path.exists(os.path.join(cap, "manifest.json")),
          f"an empty capture directory left: {os.listdir(cap)}")


def test_01_twin_dense_adjacency_names_lin(gcn_runs):
    rep = gcn_runs["dense"]["w"].report()
    assert named(top3(rep), "lin", 3), lines(rep)


def test_01_twin_sparse_adjacency_without_the_bad_batch_is_quiet(gcn_runs):
    _same_training(gcn_runs["quiet"], gcn_runs["quiet_plain"])
    quiet_report(gcn_runs["quiet"]["w"].report())


def _gcn_batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(6, 8, generator=g) * 1e5


def test_02_save_batch_with_a_sparse_argument(helpers, tmp_path):
    models = helpers["models"]
    torch.manual_seed(0)
    m = models.gcn()
    x, adj = _gcn_batch(), ring_adj()
    path = tmp_path / "cap"
    try:
        ampdoctor.save_batch(str(path), m, x, adj)
    except (BadInput, TypeError, ValueError) as e:
        msg = str(e)
        check("\n" not in msg.strip() and ("sparse" in msg.lower() or "argument" in msg.lower()), msg)
        check(not path.exists(), f"left behind: {os.listdir(path) if path.is_dir() else path}")
        return
    except Exception as e:
        raise WrongAnswer(f"{type(e).__name__}: {e}; left behind: "
                          f"{os.listdir(path) if path.is_dir() else path.exists()}") from None
    rep = ampdoctor.replay(str(path), model=models.gcn(), loss_fn=models.scalar_loss, shadow=False, whatif=False,
                           fix_search=False)
    check(any(f.module == "lin" and f.rule == "overflow" for f in rep.findings[:3]), lines(rep))


def test_02_twin_save_batch_with_the_dense_adjacency_replays(helpers, tmp_path):
    models = helpers["models"]
    torch.manual_seed(0)
    m = models.gcn()
    x, adj = _gcn_batch(), ring_adj(sparse=False)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(m.lin(x)).all() and torch.isfinite(x).all()     # the overflow is in `lin`
    path = ampdoctor.save_batch(str(tmp_path / "cap"), m, x, adj)
    rep = ampdoctor.replay(path, model=models.gcn(), loss_fn=models.scalar_loss, shadow=False, whatif=False,
                           fix_search=False)
    assert any(f.rule == "overflow" and f.module == "lin" and f.severity == "error" for f in rep.findings[:3]), \
        lines(rep)


# ======================================================================================== 3: NaN in the saved weights
@pytest.fixture(scope="module")
def nan_capture(helpers, tmp_path_factory):
    """The user's guarded loop (no GradScaler): step 3's raw targets overflow the backward, SGD writes inf/NaN, step
    4's forward makes NaN, and the guard saves that batch: a capture whose weights already hold NaN."""
    models = helpers["models"]
    d = tmp_path_factory.mktemp("h6nan")
    torch.manual_seed(0)
    m = models.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    before = None
    for i in range(8):
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 1, generator=g) * (3e5 if i == 3 else 1.0)      # a batch of raw, unnormalised targets
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        loss = (out.float() - y).pow(2).mean()
        if not torch.isfinite(loss):
            cap = ampdoctor.save_batch(str(d / "bad"), m, x)
            break
        before = {k: v.detach().clone() for k, v in m.state_dict().items()}
        opt.zero_grad()
        loss.backward()
        if i == 3:
            assert torch.isfinite(loss) and not all(torch.isfinite(p.grad).all() for p in m.parameters())
        opt.step()
    else:
        raise AssertionError("the guard never fired")
    assert i == 4, i
    assert torch.isfinite(x).all()                                           # the captured batch is ordinary
    assert not all(torch.isfinite(v).all() for v in m.state_dict().values())  # the weights hold NaN/inf
    assert all(torch.isfinite(v).all() for v in before.values())             # and were finite one step before
    fixed = models.mlp()
    fixed.load_state_dict(before)
    twin = ampdoctor.save_batch(str(d / "fixed"), fixed, x)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(fixed(x)).all()
    return {"bad": cap, "fixed": twin, "dir": d}


def _replay_cli(helpers, cap, d, name):
    out = d / f"{name}.json"
    guard = snapshot(cap)
    p = run_cli(helpers, "replay", cap, "--model", f"{MODELS}:mlp", "--loss", f"{MODELS}:scalar_loss", "--quick",
                "--no-html", "--json", out, cwd=d)
    assert snapshot(cap) == guard
    return p, out


def test_03_capture_whose_saved_weights_hold_nan(helpers, nan_capture):
    p, out = _replay_cli(helpers, nan_capture["bad"], nan_capture["dir"], "bad")
    not_healthy(p)
    if p.returncode == 2:
        error_line(p)
        return
    top = json_top3(out)
    check(top and top[0][3] == "error", top)


def test_03_twin_the_same_batch_with_the_weights_it_ran_on(helpers, nan_capture):
    p, out = _replay_cli(helpers, nan_capture["fixed"], nan_capture["dir"], "fixed")
    no_traceback(p)
    assert p.returncode == 0, p.stdout[-1500:]
    d = strict_json(out)
    assert not [f for f in d["findings"] if f["severity"] in ("warning", "error")], d["findings"]
    assert d["summary"].get("finite") is True, d["summary"]


# ======================================================================================== 4-5: live and killed runs
@pytest.fixture(scope="module")
def live(helpers, tmp_path_factory):
    """Two writers of the same script: A paused after the NaN iteration (read live, then SIGKILLed), B run to its
    end (the twin); the CLI reads A while it runs and after it was killed."""
    d = tmp_path_factory.mktemp("h6live")
    (d / "writer.py").write_text(WRITER_SRC.format(models=MODELS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), helpers["dir"]]),
               OMP_NUM_THREADS="1")
    cwd = d / "cwd"
    cwd.mkdir()
    ra, rb = d / "runA", d / "runB"
    ready, go = d / "ready", d / "go"
    pa = subprocess.Popen([sys.executable, str(d / "writer.py"), str(ra), str(ready), str(go)], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pb = subprocess.Popen([sys.executable, str(d / "writer.py"), str(rb), "-", "-"], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = {"dir": d, "runA": str(ra), "runB": str(rb)}
    try:
        t0 = time.time()
        while not ready.exists():
            assert pa.poll() is None, pa.communicate()
            assert time.time() - t0 < 120, "writer A never reached iteration 5"
            time.sleep(0.05)
        assert os.path.isfile(ra / "captures" / "4" / "manifest.json")       # the bad step's capture is on disk
        before = snapshot(ra)
        res["live"] = run_cli(helpers, "report", ra, "--no-html", "--json", d / "live.json", cwd=cwd)
        res["live_model"] = run_cli(helpers, "report", ra, "--model", f"{MODELS}:mlp", "--no-html", "--json",
                                    d / "live_model.json", cwd=cwd)
        res["live_untouched"] = snapshot(ra) == before
        assert pa.poll() is None                                             # still running all along
        pa.send_signal(signal.SIGKILL)                                       # the OOM killer
        pa.wait(timeout=30)
        res["killed"] = run_cli(helpers, "report", ra, "--no-html", "--json", d / "killed.json", cwd=cwd)
        res["killed_model"] = run_cli(helpers, "report", ra, "--model", f"{MODELS}:mlp", "--no-html", "--json",
                                      d / "killed_model.json", cwd=cwd)
        out, err = pb.communicate(timeout=200)
        assert pb.returncode == 0, err[-2000:]
        res["done"] = run_cli(helpers, "report", rb, "--no-html", "--json", d / "done.json", cwd=cwd)
    finally:
        for p in (pa, pb):
            if p.poll() is None:
                p.kill()
                p.wait()
    return res


@pytest.mark.parametrize("which", ["live", "live_model"])
def test_04_report_of_a_live_run_after_its_bad_iteration(live, which):
    not_healthy(live[which])
    check(live["live_untouched"], "reading the live run dir changed it")


def test_04_twin_the_finished_run_names_the_overflow(live):
    p = live["done"]
    no_traceback(p)
    assert p.returncode == 1, p.stdout[-1500:]
    assert named(json_top3(live["dir"] / "done.json"), "0", 4), json_top3(live["dir"] / "done.json")


def test_05_killed_run_is_not_healthy(live):
    p = live["killed"]
    not_healthy(p)
    assert p.returncode == 1
    crash = strict_json(live["dir"] / "killed.json")["summary"].get("crash")
    check(crash is not None, "no crash in the summary")


def test_05_killed_run_text_counts_the_errors_its_json_does(live):
    """The killed run's text said "0 errors" (later "1 error") beside "CRASHED" while its exit code was 1 and its
    JSON summary counted the crash as an error (summary.counts): the text's count is the summary's."""
    p = live["killed"]
    m = re.search(r"^(\d+) errors?, ", p.stdout, re.M)
    assert m, p.stdout[-1500:]
    assert int(m.group(1)) == strict_json(live["dir"] / "killed.json")["summary"]["errors"], p.stdout[-1500:]


def test_05_killed_run_with_model_replays_the_bad_steps_capture(live):
    p = live["killed_model"]
    not_healthy(p)
    top = json_top3(live["dir"] / "killed_model.json")
    check(named(top, "0", 4), top)


# ======================================================================================== 6-7: --out and links
def test_06_out_into_the_run_dir_itself_keeps_every_run_file(helpers, base_run, tmp_path):
    rd = copy(base_run, tmp_path / "run")
    before = snapshot(rd)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = run_cli(helpers, "report", rd, "--out", rd, "--force", "--json", tmp_path / "r.json", cwd=cwd)
    no_traceback(p)
    after = snapshot(rd)
    lost = sorted(k for k in before if after.get(k) != before[k])
    check(lost == [], f"changed or lost: {lost}")
    if p.returncode == 2:
        error_line(p)
        return
    assert p.returncode == 1 and os.path.isfile(os.path.join(rd, "index.html")), p.stdout[-800:]
    check(named(json_top3(tmp_path / "r.json"), "0", 4), json_top3(tmp_path / "r.json"))
    p2 = run_cli(helpers, "report", rd, "--no-html", "--json", tmp_path / "r2.json", cwd=cwd)
    no_traceback(p2)
    check(p2.returncode == 1 and named(json_top3(tmp_path / "r2.json"), "0", 4), p2.stdout[-800:])


def test_07_link_loop_rank_dir_inside_the_run_dir(helpers, base_run, tmp_path):
    rd = copy(base_run, tmp_path / "run")
    os.symlink(".", os.path.join(rd, "rank-1"))
    before = snapshot(rd)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = run_cli(helpers, "report", rd, "--no-html", "--json", tmp_path / "r.json", cwd=cwd, timeout=120)
    no_traceback(p)
    check(snapshot(rd) == before, "the run dir changed")
    if p.returncode == 2:
        error_line(p)
        return
    d = strict_json(tmp_path / "r.json")
    check(p.returncode == 1 and d["summary"]["steps"] == 5, (p.returncode, d["summary"]))
    check(named(json_top3(tmp_path / "r.json"), "0", 4), json_top3(tmp_path / "r.json"))
