"""Does the CLI, run on a finished run directory, say what the training process's own `w.report()` said?

An external suite's view (docs/CONTRACT.md, README "Command line"): each case is a training script written to tmp and
run in its own `python` (CPU fp16 autocast + `torch.amp.GradScaler("cpu")`, one intra-op thread, fixed seeds,
`ampdoctor.watch(model, ..., run_dir=RUN)`), its model factory in `ca_models.py` on PYTHONPATH. The script saves its
in-process `w.report().to_dict()` as JSON (after `w.close()`; in an `except` block before re-raising for the crash;
after step 5, training going on, for the killed run). Then `python -m ampdoctor report RUN --json out.json` (default
HTML output, cwd a scratch dir) and, where the run wrote a capture, `python -m ampdoctor replay CAP --model
ca_models:<factory> --json r.json --no-html` run as subprocesses. test_cli_real_runs.py compares the CLI with
`ampdoctor.diagnose()` and test_cli_workflows.py the CLI's own workflows; this file compares it with the answer the
user saw in the training process.

Cases:
 - fwd_overflow: raw, unscaled features (x 1e5) reach step 6; the fp16 cast inside the first Linear `embed` overflows.
 - accum_bwd: 3 micro-batches a step; at step 5 the first micro-batch holds an all-zero (padded) row, and the
   hand-written row norm (sqrt of a sum of squares) in `rownorm` gives a finite 0 forward and inf * 0 = NaN
   backward: a backward-only failure inside the accumulation (the scaler skips step 5).
 - clip_before_unscale: clip_grad_norm_ before scaler.unscale_ (every step).
 - frozen_teacher: distillation; only the frozen fp16 teacher is watched (no optimizer or scaler given, README), the
   student trains with its own GradScaler; at step 5 an unnormalised batch (x 1e4) overflows inside the teacher.
 - healthy: a small MLP regression whose loss falls.
 - crash: at step 4 a ragged batch (7 features instead of 8) makes the first Linear raise; the script's `except`
   saves `w.report()` and re-raises (an uncaught RuntimeError).
 - killed: raw features (x 1e5) at step 3 overflow `embed`; `w.report()` is saved after step 5; SIGKILL in step 6
   (after its backward).
 - headroom: a weight-norm Linear whose gain a buggy optimizer post-hook multiplies by 1.15 each step
   (headroom=True, 45 steps: it grows toward fp16's max but has not overflowed yet) -> the early warning.

Checks, per case:
 (a) the run is what it claims (the script's own log: where the loss went non-finite, skipped steps, exit status);
 (b) the first three findings (rule, module, step, severity) of the in-process report equal the CLI's JSON's;
 (c) the CLI's exit code per CONTRACT.md/README: 1 with an `error` finding (or the run crashed or was killed), else
     0; no traceback; an `error` the process's own report gave makes the CLI exit 1 too;
 (d) the CLI (report, replay) wrote nothing into the run directory and changed none of its files (CONTRACT.md names
     no file the CLI may write there): hashes before/after are equal;
 (e) the case's cause is among the CLI's first three findings (so that (b) is not two empty lists agreeing).

Budget: 8 pipelines (train, then report [+ replay]) on a pool of 4 threads; ~65 s on 2 cores.

Result when written: 39 pass, 1 xfail (two runs in a row, identical); 40 pass since (the strict xfail below).

What ampdoctor did: for every case the CLI's first three findings equal the in-process report's (the crash: no
findings on either side, summary.crash RuntimeError at step 4 in `body` on both; the killed run: `overflow` at `embed`
step 3 error and `skipped_steps` step 3 error on both, the CLI adding summary.crash "Killed" after step 5), exit codes
follow the contract, and no CLI call wrote into or changed a run directory. Notes: `replay` of the crash's capture
(the ragged 16x7 batch) is refused with one line, exit 2 ("replaying the capture failed in the model (it does not fit
the capture's batch): mat1 and mat2 shapes cannot be multiplied"), which the exit-code check accepts for that case.
The strict xfail when written (test_the_cause_is_in_the_cli_top3[accum_bwd], a wrong answer that both sides
shared; fixed since in analysis/replayfold.py fold_replay): a `sqrt` at 0
in the backward of the first of three micro-batches (step 5; NaN at loss scale 1 too, the script checks; GradScaler
skipped step 5 at the scale steps 1-4 had stepped with). `w.report()` and `ampdoctor report` both say only
(`overflow`, `head`, 0, info: "the loss-scaled backward overflowed ... as designed") and (`skipped_steps`, null, 0,
info: "skipped 2 of 9 steps; a normal rate"), exit 0, while the run dir's own saved replay (replay-0.json of capture
5) and `ampdoctor replay RUN/captures/5 --model ca_models:normfeat` name (`overflow`, `rownorm`, 5, error, backward,
aten::div of SqrtBackward0) -- README: a skip at an already-used scale whose replay proves an error "enters the report
and the run directory, with `skipped_steps` then a warning".
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys

import pytest

from probe_harness import ROOT, WrongAnswer, run_cli, snapshot, strict_json, wrong

MODELS = '''
import math
import torch
from torch import nn
import torch.nn.functional as F


class PriceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.act(self.embed(x)))


def price():
    torch.manual_seed(0)
    return PriceNet()


class RowNorm(nn.Module):
    def forward(self, h):
        return torch.sqrt((h * h).sum(-1, keepdim=True))


class NormFeatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 16, bias=False)
        self.rownorm = RowNorm()
        self.head = nn.Linear(17, 1)

    def forward(self, x):
        h = self.enc(x)
        return self.head(torch.cat([h, self.rownorm(h)], -1))


def normfeat():
    torch.manual_seed(0)
    return NormFeatNet()


class Reg(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def reg():
    torch.manual_seed(0)
    return Reg()


def teacher():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    with torch.no_grad():
        m[2].weight.mul_(8.0)            # a teacher with large hidden activations
    return m.half().eval().requires_grad_(False)


def student():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


class WNLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.v = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.g = nn.Parameter(torch.ones(d_out, 1))
        self.b = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return F.linear(x, self.g * self.v / self.v.norm(dim=1, keepdim=True), self.b)


class WNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.wn = WNLinear(64, 64)
        self.act = nn.ReLU()
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.act(self.wn(torch.relu(self.inp(x)))))


def wnnet():
    torch.manual_seed(0)
    return WNNet()


W_TRUE = torch.randn(8, 1, generator=torch.Generator().manual_seed(999)) * 0.5


def reg_batch(i, scale=1.0, cycle=4):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i % cycle))
    return x * scale, x @ W_TRUE
'''

PRELUDE = '''
import json, math, os, signal, sys
import torch
import torch.nn.functional as F
import ampdoctor
import ca_models as M

torch.set_num_threads(1)
torch.manual_seed(0)
RUN, REP, LOG_FILE = sys.argv[1:4]
LOG = {"losses": [], "skipped": [], "clip_norms": [], "scales": []}


def dump(rep, when):
    d = rep.to_dict()
    d["_when"] = when
    with open(REP, "w") as f:
        json.dump(d, f)
    with open(LOG_FILE, "w") as f:
        json.dump(LOG, f)


def loop(m, w, opt, sc, batch, steps, *, clip="after", at_step_end=None, mid_step=None, accum=1):
    for i in range(steps):
        opt.zero_grad()
        total = 0.0
        for k in range(accum):
            x, y = batch(i, k)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float(), y) / accum
            sc.scale(loss).backward()
            total += loss.item()
        LOG["losses"].append(total)
        if mid_step:
            mid_step(i)
        s0 = sc.get_scale()
        LOG["scales"].append(s0)
        if clip == "before":
            LOG["clip_norms"].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        sc.unscale_(opt)
        if clip == "after":
            LOG["clip_norms"].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            LOG["skipped"].append(i)
        if at_step_end:
            at_step_end(i)
'''

BODIES = {
    "fwd_overflow": '''
m = M.price()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
loop(m, w, opt, sc, lambda i, k: M.reg_batch(i, 1e5 if i == 6 else 1.0), 10)
w.close()
dump(w.report(), "after close")
''',
    "accum_bwd": '''
m = M.normfeat()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)


def batch(i, k):
    x, y = M.reg_batch(3 * i + k, cycle=12)
    if i == 5 and k == 0:
        x = x.clone()
        x[3] = 0.0                       # a padded row
    return x, y


loop(m, w, opt, sc, batch, 9, accum=3)
w.close()
# the oracle: step 5's first micro-batch at loss scale 1, on a fresh unwatched copy (enc has no bias, so the padded
# row's hidden state is exactly 0 whatever the weights): is the gradient finite at no loss scale?
twin = M.normfeat()
x, y = batch(5, 0)
with torch.autocast("cpu", dtype=torch.float16):
    F.mse_loss(twin(x).float(), y).backward()
LOG["scale1_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in twin.parameters())
dump(w.report(), "after close")
''',
    "clip_before_unscale": '''
m = M.reg()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
loop(m, w, opt, sc, lambda i, k: M.reg_batch(i), 8, clip="before")
w.close()
dump(w.report(), "after close")
''',
    "frozen_teacher": '''
teacher, student = M.teacher(), M.student()
opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(teacher, run_dir=RUN)
LOG["teacher_finite"] = []
for i in range(10):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + i)) * (1e4 if i == 5 else 1.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        t = teacher(x)
    LOG["teacher_finite"].append(bool(torch.isfinite(t).all()))
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(student(x).float(), t.float())
    LOG["losses"].append(loss.item())
    s0 = sc.get_scale()
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    if sc.get_scale() < s0:
        LOG["skipped"].append(i)
w.close()
dump(w.report(), "after close")
''',
    "healthy": '''
m = M.reg()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
loop(m, w, opt, sc, lambda i, k: M.reg_batch(i), 14)
w.close()
dump(w.report(), "after close")
''',
    "crash": '''
m = M.reg()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)


def batch(i, k):
    x, y = M.reg_batch(i)
    return (x[:, :7] if i == 4 else x), y     # a ragged batch: one feature column lost


try:
    loop(m, w, opt, sc, batch, 8)
except Exception:
    dump(w.report(), "in except, before re-raising")
    raise
''',
    "killed": '''
m = M.price()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)


def end(i):
    if i == 5:
        dump(w.report(), "after step 5, training going on")


def mid(i):
    if i == 6:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


loop(m, w, opt, sc, lambda i, k: M.reg_batch(i, 1e5 if i == 3 else 1.0), 10, at_step_end=end, mid_step=mid)
''',
    "headroom": '''
m = M.wnnet()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)


def renorm(optimizer, args, kwargs):      # the bug: re-applies a gain correction on every step
    with torch.no_grad():
        m.wn.g.mul_(1.15)


opt.register_step_post_hook(renorm)
sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN, headroom=True)
g = torch.Generator().manual_seed(0)
X = torch.randn(64, 16, generator=g)
Y = torch.randint(0, 4, (64,), generator=g)
for i in range(45):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(m(X).float(), Y)
    sc.scale(loss).backward()
    sc.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    s0 = sc.get_scale()
    sc.step(opt)
    sc.update()
    LOG["losses"].append(loss.item())
    if sc.get_scale() < s0:
        LOG["skipped"].append(i)
w.close()
dump(w.report(), "after close")
''',
}

# name -> the replay factory, the child's exit status, and the case's cause: (rules, module(s), step, severities)
# that the CLI's first three findings must hold (None: a healthy run, no warning or error at all).
CASES = {
    "fwd_overflow": dict(factory="price", rc=0, cause=(("overflow",), ("embed",), 6, ("error",))),
    "accum_bwd": dict(factory="normfeat", rc=0, cause=(("overflow", "nan_origin"), ("rownorm",), 5, ("error",))),
    "clip_before_unscale": dict(factory="reg", rc=0,
                                cause=(("clip_before_unscale",), (None,), 0, ("error", "warning"))),
    "frozen_teacher": dict(factory="teacher", rc=0, cause=(("overflow",), ("2",), 5, ("error",))),
    "healthy": dict(factory="reg", rc=0, cause=None),
    "crash": dict(factory="reg", rc=1, cause=None),
    "killed": dict(factory="price", rc=-signal.SIGKILL, cause=(("overflow",), ("embed",), 3, ("error",))),
    "headroom": dict(factory="wnnet", rc=0, cause=(("headroom_trend",), ("wn",), None, ("warning",))),
}

# (check, case) -> the reason of a strict xfail (ampdoctor answered wrongly; see the module docstring).
WRONG: dict = {}
# wrong when written, right since (analysis/replayfold.py fold_replay: an info finding of the scaler's search at
# another step no longer keeps out the error the replay proves): ("cause", "accum_bwd")


def cases(check, names=tuple(CASES)):
    return [pytest.param(n, marks=wrong(WRONG[(check, n)])) if (check, n) in WRONG else n for n in names]


def need(ok, msg):
    if not ok:
        raise WrongAnswer(msg)


def key(f):
    return (f["rule"], f["module"], f["step"], f["severity"])


def _pipeline(t, name):
    d = t / name
    d.mkdir()
    rd, rep, log = d / "run", d / "inproc.json", d / "log.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(t / "models")]), OMP_NUM_THREADS="1")
    r = {"d": d, "rd": rd}
    r["train"] = subprocess.run([sys.executable, str(t / "scripts" / f"train_{name}.py"), str(rd), str(rep), str(log)],
                                cwd=d, env=env, capture_output=True, text=True, timeout=240)
    r["inproc"] = json.loads(rep.read_text()) if rep.exists() else None
    r["log"] = json.loads(log.read_text()) if log.exists() else None
    if not (rd / "manifest.json").exists():
        return r
    helpers = {"dir": str(t / "models")}
    r["before"] = snapshot(rd)
    work = d / "cwd"
    work.mkdir()
    r["report"] = run_cli(helpers, "report", rd, "--json", d / "out.json", cwd=work)
    r["json"] = strict_json(d / "out.json") if (d / "out.json").exists() else None
    caps = sorted((rd / "captures").iterdir(), key=lambda p: p.name) if (rd / "captures").is_dir() else []
    r["captures"] = [c.name for c in caps]
    if caps:
        r["replay"] = run_cli(helpers, "replay", caps[0], "--model", f"ca_models:{CASES[name]['factory']}",
                              "--json", d / "r.json", "--no-html", cwd=work)
        r["replay_json"] = strict_json(d / "r.json") if (d / "r.json").exists() else None
    r["after"] = snapshot(rd)
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    t = tmp_path_factory.mktemp("cli_agrees")
    (t / "models").mkdir()
    (t / "scripts").mkdir()
    (t / "models" / "ca_models.py").write_text(MODELS)
    for name, body in BODIES.items():
        (t / "scripts" / f"train_{name}.py").write_text(PRELUDE + body)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
        futs = {n: ex.submit(_pipeline, t, n) for n in CASES}
        return {n: f.result() for n, f in futs.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_the_run_is_what_it_claims(runs, name):
    """(a) the script ran as the case says (the script's own log, not ampdoctor's)."""
    r, c = runs[name], CASES[name]
    p = r["train"]
    assert p.returncode == c["rc"], (p.returncode, p.stderr[-3000:])
    assert r["inproc"] is not None and r["log"] is not None, p.stderr[-3000:]
    assert (r["rd"] / "manifest.json").exists()
    log = r["log"]
    bad = [i for i, v in enumerate(log["losses"]) if v != v or v in (float("inf"), float("-inf"))]
    if name == "fwd_overflow":
        assert bad == [6] and 6 in log["skipped"], log
    elif name == "killed":
        assert bad == [3] and len(log["losses"]) == 6, log      # the log was written after step 5
    elif name == "accum_bwd":
        # finite loss, non-finite gradients (skipped at a scale step 1-4 already stepped with), and no loss scale
        # makes them finite
        assert bad == [] and log["skipped"] == [0, 5] and log["scales"][1:6] == [log["scales"][1]] * 5, log
        assert log["scale1_finite"] is False, log
    elif name == "clip_before_unscale":
        assert bad == [] and min(log["clip_norms"]) > 100, log  # the clip saw the scale in the norms
    elif name == "frozen_teacher":
        assert log["teacher_finite"] == [i != 5 for i in range(10)], log
    elif name == "healthy":
        assert bad == [] and sum(log["losses"][-3:]) < 0.5 * sum(log["losses"][:3]), log
    elif name == "crash":
        assert len(log["losses"]) == 4 and "RuntimeError" in p.stderr.splitlines()[-1], p.stderr[-2000:]
    elif name == "headroom":
        assert bad == [] and all(i < 3 for i in log["skipped"]), log   # no overflow yet (only the first backoffs)


@pytest.mark.parametrize("name", cases("top3"))
def test_top3_agree_with_the_in_process_report(runs, name):
    """(b) the first three findings of `w.report()` in the training process equal the CLI's."""
    r = runs[name]
    assert r["inproc"] is not None
    need(r["json"] is not None, f"no --json: rc {r['report'].returncode} {r['report'].stderr[-2000:]}")
    cli_f, own = [key(f) for f in r["json"]["findings"][:3]], [key(f) for f in r["inproc"]["findings"][:3]]
    need(cli_f == own, f"top three differ: CLI {cli_f} vs w.report() ({r['inproc']['_when']}) {own}")


@pytest.mark.parametrize("name", cases("exit"))
def test_exit_code_per_contract(runs, name):
    """(c) exit 1 with an error finding or a crashed/killed run, else 0; an error the process saw makes it 1 too."""
    r = runs[name]
    p, d = r["report"], r["json"]
    need("Traceback" not in p.stderr, p.stderr[-3000:])
    need(d is not None, f"no JSON: rc {p.returncode}: {p.stderr[-2000:]}")
    errors = [key(f) for f in d["findings"] if f["severity"] == "error"]
    crash = d["summary"].get("crash")
    dead = name in ("crash", "killed")
    need(p.returncode == (1 if errors or crash or dead else 0),
         f"exit {p.returncode}, errors {errors}, crash {crash}")
    own_errors = [key(f) for f in r["inproc"]["findings"] if f["severity"] == "error"]
    need(not own_errors or p.returncode == 1, f"w.report() had errors {own_errors}, CLI exit {p.returncode}")
    if "replay" in r:
        q, rj = r["replay"], r["replay_json"]
        need("Traceback" not in q.stderr, f"replay: rc {q.returncode} {q.stderr[-2000:]}")
        if q.returncode == 2:            # a capture the model cannot run (the crash's ragged batch): one line
            lines = [ln for ln in q.stderr.splitlines() if ln.strip()]
            need(name == "crash" and len(lines) == 1 and lines[0].startswith("ampdoctor: ") and rj is None,
                 f"replay refused: {q.stderr[-2000:]}")
            return
        need(rj is not None, f"replay: rc {q.returncode} {q.stderr[-2000:]}")
        rerr = any(f["severity"] == "error" for f in rj["findings"])
        need(q.returncode == (1 if rerr else 0), f"replay exit {q.returncode}, errors in its JSON: {rerr}")


@pytest.mark.parametrize("name", cases("untouched"))
def test_cli_leaves_the_run_dir_alone(runs, name):
    """(d) report (and replay of its capture) neither write into the run dir nor change a file there."""
    r = runs[name]
    assert "before" in r
    b, a = r["before"], r["after"]
    added = sorted(set(a) - set(b))
    removed = sorted(set(b) - set(a))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k] and os.path.isfile(k))
    need(not (added or removed or changed), f"run dir changed: added {added}, removed {removed}, changed {changed}")


@pytest.mark.parametrize("name", cases("cause"))
def test_the_cause_is_in_the_cli_top3(runs, name):
    """(e) the case's cause among the CLI's first three findings; healthy/crash: no warning or error finding."""
    r, c = runs[name], CASES[name]
    need(r["json"] is not None, "no JSON")
    top = [key(f) for f in r["json"]["findings"][:3]]
    if c["cause"] is None:
        alarms = [key(f) for f in r["json"]["findings"] if f["severity"] in ("warning", "error")]
        need(not alarms, f"{name}: warning/error findings {alarms}")
        if name == "crash":
            crash = r["json"]["summary"].get("crash") or {}
            need((crash.get("type"), crash.get("step")) == ("RuntimeError", 4), f"summary.crash {crash}")
        return
    rules, modules, step, sev = c["cause"]
    hit = [f for f in r["json"]["findings"][:3] if f["rule"] in rules and f["module"] in modules]
    need(hit, f"want {rules} at {modules} among the first three, got {top}")
    need(step is None or hit[0]["step"] == step, f"step {hit[0]['step']}, want {step}: {top}")
    need(hit[0]["severity"] in sev, f"severity {hit[0]['severity']}, want {sev}: {top}")
