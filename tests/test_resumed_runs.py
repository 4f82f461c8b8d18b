"""Resumed and repeated training in ONE run directory, the way users work: train, checkpoint (model, optimizer and
GradScaler state_dicts), exit; a new process resumes from the checkpoint into the same `run_dir`; a watch re-opened
per epoch; a run SIGKILLed and resumed; an unrelated experiment reusing the directory. fp16 CPU autocast +
torch.amp.GradScaler("cpu") on small real models (`Net`: embed -> gate -> mid -> head, where `gate` is a
hand-written softmax x * exp(z) / sum exp(z) whose exp overflows fp16 on a x100 "bad shard" batch; `Other`: inp ->
router (the same gate) -> out). The user's code (`resume_models.py`, below as MODELS_SRC) is written to tmp_path and
run as a script (sys.executable, PYTHONPATH = the repo + tests/ + tmp_path) or imported in-process (case 7).

Every failure is first proven by an independent oracle (probe_harness.Producer: the first module whose output is
non-finite from finite inputs and own weights, and the step), with the NaN loss and the scaler's skip at that step;
healthy runs are proven finite, never skipped. Then ampdoctor is judged three ways where it matters: the training
process's own `w.report()` (saved as JSON by the script), `ampdoctor.diagnose(run_dir)`, and `python -m ampdoctor
report RUN_DIR --json F --no-html` (exit code too).

What the docs say about a directory with several runs: README "Formats": "A directory that already holds runs gets a
new run index; nothing is overwritten", records are tagged {"run": i, "step": n}, a capture of a step an earlier
run already captured goes to `captures/<step>.run<i>/`; rundir.read_run: "Read one run (default: the last)";
test_hostile_rundir asserts diagnose() counts the last run only "as documented". CONTRACT: `step` is "the optimizer
step (0-based)". Nothing says how a RESUMED run numbers its steps. A user resuming at global step 30 whose log says
"bad batch at step 41" would like 41 (the optimizer's own count, Adam's state["step"] after load_state_dict); the
run directory's layout (one run index per watch, steps n within it) reads as the watch's own count, 11. As in
test_watch_lifecycle2 (case 1/5), BOTH are accepted, nothing else, and the tests print which one ampdoctor uses.
The same holds for the old run's failure after a resume: reporting only the last run (quiet) is the documented
answer; a report that names the old failure is accepted only if it does not date it as a step of the new run.

Cases (result when written, torch 2.13 CPU):
 1. resume_overflow_in_second_run: 30 healthy steps, checkpoint, new process resumes 30 more, bad batch at its 12th
    step -> overflow/nan_origin at `gate`, step 11 (or global 41), error, in w.report(), diagnose, CLI (exit 1).
 2. failure_in_first_run_healthy_resume: the overflow at step 12 of run 0, healthy resume -> run 0's own report named
    it; after the resume the directory's report does not blame the new run (quiet, exit 0).
 3. collapsed_scale_restored: run 0's bad shard from step 4 on skips 26 steps: scale 2**16 -> 2**-10
    (its report: overflow at gate, step 4); the data is fixed and the run resumed with the scaler's state: the
    resumed run's fp16 gradients are mostly flushed (oracle: grad into `head` at 2**-10 vs. 2**16) ->
    underflow / loss_scale_collapse, warning or error, in the top three.
 4. unrelated_experiment_reuses_run_dir: run 0 = Net (overflow at gate, step 12); run 1 = Other, a different model
    (overflow at `router`, step 5) -> the directory's report is run 1's: router at 5, 20 steps, nothing of Net.
 5. two_healthy_runs_same_dir: 30 + 30 healthy -> no warning or error anywhere, CLI exit 0.
 6. resume_with_new_batch_size_and_lr (healthy / failing): resumed with batch 32 -> 128 and lr 1e-3 -> 2e-3 ->
    quiet; the same with the bad batch at its 12th step -> gate at 11 (or 41).
 7. watch_reopened_per_epoch: one process, one model/optimizer/scaler, watch opened and closed per epoch (3 x 10
    steps) in one run_dir, bad batch in epoch 2 at its step 4 -> epoch 2's report: gate at 4 (or 14); epochs 1/3
    quiet; diagnose() after epoch 2 == epoch 2's report. After epoch 3 diagnose() is epoch 3's (quiet): documented
    (last run), arguable for a user who runs `ampdoctor report` once at the end; not xfailed.
 8. killed_then_resumed: run 0 checkpoints every 10 steps and is SIGKILLed while stuck after its 25th step ->
    diagnose says it crashed; resumed from the step-20 checkpoint with the bad batch at its 12th step -> gate at 11
    (or 31), and no crash in the new (closed) run's report.
 9. captures_of_both_runs_kept_apart: the bad batch at local step 12 of both runs -> captures/12 and
    captures/12.run1, each holding its own run's batch (global step 12 / 42); `ampdoctor replay CAP --model
    resume_models:net` on each names the overflow in `gate` (exit 1).

Result when written (torch 2.13 CPU): 10 pass, 0 xfail -- ampdoctor was right in every case:
 - a resumed run numbers its steps from its own start (the watch's count, 0-based): the overflow at the resumed
   run's 12th step is `overflow at gate (aten::exp), step 11` (not global 41) in w.report(), diagnose() and the CLI
   (exit 1) alike; the same after a batch-size/lr change (11) and after a SIGKILLed run (11, not 31); per-epoch
   watches say 4 (not 14). Accepted as documented-compatible, see above; a user reading "step 11" must know it is
   the resumed run's own count (the report does not say "run 1").
 - a directory's report is its LAST run's: run 0's failure is not blamed on a healthy resume (quiet, exit 0), an
   unrelated experiment's report holds only its own model (router@5, 20 steps), and after a per-epoch watch's
   healthy epoch 3 `diagnose()` says "Healthy: no problems found in 10 step(s)" although epoch 2 overflowed
   (documented in rundir.read_run, arguable for a user who reports once at the end; not xfailed).
 - a scaler restored at 2**-10: `[error] underflow at mid, step 0` (the resumed run's first step).
 - a SIGKILLed run is reported killed before the resume; after the resume the (closed) new run shows no crash.
 - captures/12 and captures/12.run1 each hold their own run's batch; `ampdoctor replay --model` names
   overflow at gate (aten::exp) in each, exit 1.

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_resumed_runs.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ampdoctor
from probe_harness import WrongAnswer, load_models, run_cli
from scenarios import alarms, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
FWD = ("overflow", "nan_origin")

MODELS_SRC = r'''"""The user's code for the resumed-run probes: two small models, the data, one training loop and a
script entry (python resume_models.py CONFIG.json): resume from a checkpoint, train, save a checkpoint, exit."""
import json, math, os, sys, time
import torch
import torch.nn as nn

import ampdoctor


class Gate(nn.Module):
    """A hand-written softmax gate: x * exp(z) / sum exp(z); exp overflows fp16 when z > ~11."""

    def __init__(self, d=16):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        e = torch.exp(self.proj(x))
        return x * (e / e.sum(-1, keepdim=True))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.gate = Gate()
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.gate(torch.relu(self.embed(x))))))


class Other(nn.Module):
    """An unrelated second experiment: other names, other widths."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.router = Gate(32)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(self.router(torch.relu(self.inp(x))))


def net():
    return Net()


def other():
    return Other()


W = torch.randn(8, 1, generator=torch.Generator().manual_seed(999)) * 0.5


def batch(g, bs=32, spike=False):
    """Global step g's batch (the same whatever process trains it); a spike: the inputs x100 (a bad shard)."""
    x = torch.randn(bs, 8, generator=torch.Generator().manual_seed(1000 + g))
    y = x @ W
    return (x * 100.0 if spike else x), y


def train(m, opt, sc, steps, *, start=0, spike=(), bs=32, oracle=True, on_step=None):
    """The user's loop for global steps start .. start+steps-1; `spike` holds LOCAL step indices (0-based in this
    call). Returns the truth: the oracle's first forward producer (module, local step), local steps with a
    non-finite loss, local steps the scaler skipped, losses, scales."""
    from probe_harness import Producer        # (tests/ on the script's path; `--model resume_models:net` needs none)
    prod = Producer(m) if oracle else None
    t = dict(first=None, bad_loss=[], skipped=[], losses=[], scales=[])
    for i in range(steps):
        if prod is not None:
            prod.step = i
        x, y = batch(start + i, bs, i in spike)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (m(x).float() - y).pow(2).mean()
        t["losses"].append(loss.item())
        if not math.isfinite(loss.item()):
            t["bad_loss"].append(i)
        s0 = sc.get_scale()
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            t["skipped"].append(i)
        t["scales"].append(sc.get_scale())
        if on_step is not None:
            on_step(i)
    if prod is not None:
        t["first"] = list(prod.first) if prod.first else None
        prod.remove()
    return t


def build(model="net", lr=1e-3, seed=0):
    torch.manual_seed(seed)
    m = net() if model == "net" else other()
    return m, torch.optim.AdamW(m.parameters(), lr=lr), torch.amp.GradScaler("cpu")


def save_ckpt(path, m, opt, sc, step):
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict(), "step": step}, path)


def main(cfg):
    torch.set_num_threads(1)
    m, opt, sc = build(cfg.get("model", "net"), cfg.get("lr", 1e-3))
    start = 0
    if cfg.get("ckpt_in"):
        ck = torch.load(cfg["ckpt_in"])
        m.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sc.load_state_dict(ck["scaler"])
        start = ck["step"]
        if cfg.get("new_lr"):
            for g in opt.param_groups:
                g["lr"] = cfg["new_lr"]
    truth = {"start": start, "scale_at_start": sc.get_scale()}
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=cfg["run_dir"])

    def on_step(i):
        g = start + i + 1                                 # optimizer steps done so far
        if cfg.get("ckpt_every") and g % cfg["ckpt_every"] == 0:
            save_ckpt(cfg["ckpt_out"], m, opt, sc, g)
        if cfg.get("hang_after") is not None and i == cfg["hang_after"]:
            print(f"step {i}", flush=True)
            time.sleep(300)                               # stuck (a data loader, a NFS hang): killed from outside

    truth.update(train(m, opt, sc, cfg["steps"], start=start, spike=cfg.get("spike", ()), bs=cfg.get("bs", 32),
                       on_step=on_step))
    if cfg.get("ckpt_out") and not cfg.get("ckpt_every"):
        save_ckpt(cfg["ckpt_out"], m, opt, sc, start + cfg["steps"])
    w.close()
    w.report().save_json(cfg["report"])
    with open(cfg["truth"], "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
'''


# --- harness ------------------------------------------------------------------------------------------------------
@pytest.fixture
def h(tmp_path):
    """The user's module written to tmp_path/code (and imported here), the subprocess environment, a run_dir."""
    d = tmp_path / "code"
    d.mkdir()
    mod = load_models(d, "resume_models", MODELS_SRC)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, str(d)]), OMP_NUM_THREADS="1")
    return dict(dir=str(d), mod=mod, env=env, tmp=tmp_path, rd=str(tmp_path / "runs" / "exp1"))


def script(h, name, *, wait=True, **cfg):
    """Run resume_models.py as the user's training script (a new process) with `cfg`; returns (truth, report dict)
    (wait=False: the Popen, for a run killed from outside)."""
    t = h["tmp"]
    cfg = dict(dict(run_dir=h["rd"], report=str(t / f"{name}.report.json"), truth=str(t / f"{name}.truth.json")),
               **cfg)
    cp = t / f"{name}.cfg.json"
    cp.write_text(json.dumps(cfg))
    argv = [sys.executable, os.path.join(h["dir"], "resume_models.py"), str(cp)]
    if not wait:
        return subprocess.Popen(argv, env=h["env"], cwd=str(t), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    p = subprocess.run(argv, env=h["env"], cwd=str(t), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(cfg["truth"]) as f:
        truth = json.load(f)
    with open(cfg["report"]) as f:
        return truth, json.load(f)


def ck(h, name):
    return str(h["tmp"] / f"{name}.pt")


def cli(h, run_dir=None):
    """`python -m ampdoctor report RUN_DIR --json F --no-html`: (exit code, report dict)."""
    out = h["tmp"] / f"cli{len(os.listdir(h['tmp']))}.json"
    p = run_cli(h, "report", run_dir or h["rd"], "--json", out, "--no-html", cwd=str(h["tmp"]))
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr[-3000:]
    with open(out) as f:
        return p.returncode, json.load(f)


def as_dict(rep):
    return rep if isinstance(rep, dict) else rep.to_dict()


def one(f):
    return f"[{f['severity']}] {f['rule']}@{f['module']!r} step {f['step']}"


def top(rep, n=3):
    return [one(f) for f in as_dict(rep)["findings"][:n]]


def verdict(rep):
    return as_dict(rep)["summary"].get("verdict")


def really_failed(truth, module, step):
    """The oracle: `module` produced the first non-finite output at local `step`, the loss went NaN there and the
    scaler skipped that step and no other."""
    assert truth["first"] == [module, step], truth["first"]
    assert truth["bad_loss"] == [step] and truth["skipped"] == [step], (truth["bad_loss"], truth["skipped"])


def really_healthy(truth):
    assert truth["first"] is None and not truth["bad_loss"] and not truth["skipped"], truth
    assert all(v == v and abs(v) < 1e3 for v in truth["losses"]), truth["losses"]


def named(rep, module, steps, where, rules=FWD, severities=("error",)):
    """`rules` at `module`, at one of `steps` (the run's own count or the global one), among the first three findings,
    with a severity in `severities`; a wrong answer raises WrongAnswer naming what ampdoctor said."""
    d = as_dict(rep)
    hit = next((f for f in d["findings"][:3] if f["rule"] in rules and f["module"] == module), None)
    if hit is None or hit["severity"] not in severities or hit["step"] not in steps:
        raise WrongAnswer(f"{where}: expected {'/'.join(rules)}@{module!r} at step {' or '.join(map(str, steps))} "
                          f"({'/'.join(severities)}) in the top three; got {top(d)} (verdict {verdict(d)!r})")
    print(f"{where}: {one(hit)}")
    return hit


def quiet(rep, where):
    d = as_dict(rep)
    bad = alarms(d["findings"])
    if bad or d["summary"].get("crash"):
        raise WrongAnswer(f"{where}: expected no warning/error, got {bad} crash={d['summary'].get('crash')}")


def all_three(h, truth, rep, module, steps, where):
    """The failure named by the training process's report, diagnose(run_dir) and the CLI (exit 1), at one step."""
    a = named(rep, module, steps, f"{where} w.report()")
    b = named(ampdoctor.diagnose(h["rd"]), module, steps, f"{where} diagnose()")
    rc, c = cli(h)
    c = named(c, module, steps, f"{where} CLI")
    if rc != 1:
        raise WrongAnswer(f"{where}: CLI exit {rc} on a run with an error finding")
    if not a["step"] == b["step"] == c["step"]:
        raise WrongAnswer(f"{where}: steps disagree: report {a['step']}, diagnose {b['step']}, CLI {c['step']}")
    return a


def manifest_runs(rd):
    with open(os.path.join(rd, "manifest.json")) as f:
        return json.load(f)["runs"]


# 1 ----------------------------------------------------------------------------------------------------------------
def test_resume_overflow_in_second_run(h):
    t0, r0 = script(h, "a", steps=30, ckpt_out=ck(h, "a"))
    really_healthy(t0)
    quiet(r0, "run 0")
    t1, r1 = script(h, "b", steps=30, ckpt_in=ck(h, "a"), ckpt_out=ck(h, "b"), spike=[11])
    assert t1["start"] == 30
    really_failed(t1, "gate", 11)
    assert [r["run"] for r in manifest_runs(h["rd"])] == [0, 1]
    f = all_three(h, t1, r1, "gate", (11, 41), "resumed run")
    print("resumed run's step numbering:", "the watch's own (11)" if f["step"] == 11 else "global (41)")


# 2 ----------------------------------------------------------------------------------------------------------------
def test_failure_in_first_run_healthy_resume(h):
    t0, r0 = script(h, "a", steps=30, ckpt_out=ck(h, "a"), spike=[12])
    really_failed(t0, "gate", 12)
    named(r0, "gate", (12,), "run 0 w.report()")
    named(ampdoctor.diagnose(h["rd"]), "gate", (12,), "run 0 diagnose() before the resume")
    t1, r1 = script(h, "b", steps=30, ckpt_in=ck(h, "a"))
    really_healthy(t1)
    assert t1["scale_at_start"] == 32768.0                       # the one backoff of run 0, carried over
    quiet(r1, "resumed run's w.report()")
    for where, rep in (("diagnose() after the resume", ampdoctor.diagnose(h["rd"])), ("CLI", cli(h)[1])):
        # documented: the last run. A report that still names run 0's failure must not date it in the new run.
        old = [f for f in rep["findings"] if f["module"] == "gate"] if isinstance(rep, dict) else \
            [f.to_dict() for f in rep.findings if f.module == "gate"]
        if old and any(f["evidence"].get("run", 1) != 0 for f in old):
            raise WrongAnswer(f"{where}: run 0's overflow reported as the resumed run's: {[one(f) for f in old]}")
        if not old:
            quiet(rep, where)
    rc, _ = cli(h)
    if rc != 0:
        raise WrongAnswer(f"CLI exit {rc} for a healthy resumed run (run 0's failure is not this run's)")


# 3 ----------------------------------------------------------------------------------------------------------------
def test_collapsed_scale_restored(h):
    mod = h["mod"]
    t0, r0 = script(h, "a", steps=30, ckpt_out=ck(h, "a"), spike=list(range(4, 30)))
    assert t0["skipped"] == list(range(4, 30)) and t0["scales"][-1] == 2.0 ** -10, t0["scales"][-4:]
    named(r0, "gate", (4,), "run 0")                               # the root cause of the collapse
    print("run 0 collapse:", [one(f) for f in r0["findings"] if f["rule"] == "loss_scale_collapse"])
    # the oracle: on the resumed run's first batch, the fp16 gradient into `head` at the restored scale is mostly
    # below fp16's normal range (subnormal or flushed), at a sane scale it is not
    ckpt = torch.load(ck(h, "a"))

    def grad_share(scale):
        m = mod.Net()
        m.load_state_dict(ckpt["model"])
        seen = []
        hk = m.head.register_full_backward_hook(lambda mm, gi, go: seen.append(go[0].detach()))
        x, y = mod.batch(30)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (m(x).float() - y).pow(2).mean()
        (loss * scale).backward()
        hk.remove()
        g = seen[0]
        assert g.dtype == torch.float16
        return float((g.abs() < 2.0 ** -14).float().mean())
    low, sane = grad_share(2.0 ** -10), grad_share(2.0 ** 16)
    assert low > 0.5 and sane < 0.05, (low, sane)
    t1, r1 = script(h, "b", steps=20, ckpt_in=ck(h, "a"))
    assert t1["scale_at_start"] == 2.0 ** -10 and not t1["skipped"] and t1["first"] is None
    rules = ("underflow", "loss_scale_collapse")
    for where, rep in (("resumed w.report()", r1), ("diagnose()", ampdoctor.diagnose(h["rd"]))):
        d = as_dict(rep)
        hit = next((f for f in d["findings"][:3] if f["rule"] in rules and f["severity"] in ("warning", "error")),
                   None)
        if hit is None:
            raise WrongAnswer(f"{where}: a run restored at scale 2**-10 whose gradients flush: expected "
                              f"underflow/loss_scale_collapse in the top three; got {top(d)} ({verdict(d)!r})")
        print(f"{where}: {one(hit)}")


# 4 ----------------------------------------------------------------------------------------------------------------
def test_unrelated_experiment_reuses_run_dir(h):
    t0, r0 = script(h, "a", steps=20, spike=[12])
    really_failed(t0, "gate", 12)
    named(r0, "gate", (12,), "run 0 (Net)")
    t1, r1 = script(h, "b", steps=20, spike=[5], model="other")
    really_failed(t1, "router", 5)
    runs = manifest_runs(h["rd"])
    assert len(runs) == 2
    for where, rep in (("w.report()", r1), ("diagnose()", ampdoctor.diagnose(h["rd"])), ("CLI", cli(h)[1])):
        d = as_dict(rep)
        named(d, "router", (5,), f"run 1 (Other) {where}")
        mixed = [one(f) for f in d["findings"] if f["module"] in ("gate", "gate.proj", "embed", "mid", "head")]
        if mixed or d["summary"]["steps"] != 20:
            raise WrongAnswer(f"{where}: records of the two experiments mixed: Net's modules {mixed}, steps "
                              f"{d['summary']['steps']} (run 1 made 20)")


# 5 ----------------------------------------------------------------------------------------------------------------
def test_two_healthy_runs_same_dir(h):
    t0, r0 = script(h, "a", steps=30, ckpt_out=ck(h, "a"))
    t1, r1 = script(h, "b", steps=30, ckpt_in=ck(h, "a"))
    really_healthy(t0)
    really_healthy(t1)
    quiet(r0, "run 0")
    quiet(r1, "run 1")
    quiet(ampdoctor.diagnose(h["rd"]), "diagnose()")
    rc, c = cli(h)
    quiet(c, "CLI")
    if rc != 0:
        raise WrongAnswer(f"CLI exit {rc} on two healthy runs")


# 6 ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fails", [False, True], ids=["healthy", "failing"])
def test_resume_with_new_batch_size_and_lr(h, fails):
    script(h, "a", steps=30, ckpt_out=ck(h, "a"))
    t1, r1 = script(h, "b", steps=30, ckpt_in=ck(h, "a"), bs=128, new_lr=2e-3, spike=[11] if fails else [])
    if not fails:
        really_healthy(t1)
        quiet(r1, "w.report()")
        quiet(ampdoctor.diagnose(h["rd"]), "diagnose()")
    else:
        really_failed(t1, "gate", 11)
        all_three(h, t1, r1, "gate", (11, 41), "resumed with batch 128, lr 2e-3")


# 7 ----------------------------------------------------------------------------------------------------------------
def test_watch_reopened_per_epoch(h):
    mod = h["mod"]
    m, opt, sc = mod.build()
    reps, diag, truths = [], [], []
    for epoch in range(3):
        with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=h["rd"]) as w:
            truths.append(mod.train(m, opt, sc, 10, start=10 * epoch, spike=[4] if epoch == 1 else []))
        reps.append(w.report())
        diag.append(ampdoctor.diagnose(h["rd"]))
    really_healthy(truths[0])
    really_failed(truths[1], "gate", 4)
    really_healthy(truths[2])
    assert len(manifest_runs(h["rd"])) == 3
    quiet(reps[0], "epoch 1")
    named(reps[1], "gate", (4, 14), "epoch 2 w.report()")
    named(diag[1], "gate", (4, 14), "epoch 2 diagnose()")
    quiet(reps[2], "epoch 3")
    if top(reps[1]) != top(diag[1]):
        raise WrongAnswer(f"diagnose() after epoch 2 {top(diag[1])} != epoch 2's report {top(reps[1])}")
    d = as_dict(diag[2])
    print("diagnose() after epoch 3:", verdict(d), top(d))
    assert d["summary"]["steps"] in (10, 30), d["summary"]   # the last run (documented) or all three


# 8 ----------------------------------------------------------------------------------------------------------------
def test_killed_then_resumed(h):
    p = script(h, "a", wait=False, steps=30, ckpt_out=ck(h, "a"), ckpt_every=10, hang_after=24)
    try:
        line = p.stdout.readline()
        assert line.strip() == "step 24", (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(0.5)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL
    assert torch.load(ck(h, "a"))["step"] == 20
    d0 = as_dict(ampdoctor.diagnose(h["rd"]))
    if not d0["summary"].get("crash"):
        raise WrongAnswer(f"the SIGKILLed run is not reported as killed: {verdict(d0)!r}")
    t1, r1 = script(h, "b", steps=30, ckpt_in=ck(h, "a"), spike=[11])
    assert t1["start"] == 20
    really_failed(t1, "gate", 11)
    all_three(h, t1, r1, "gate", (11, 31), "resumed after SIGKILL")
    for where, rep in (("diagnose()", as_dict(ampdoctor.diagnose(h["rd"]))), ("CLI", cli(h)[1])):
        if rep["summary"].get("crash"):
            raise WrongAnswer(f"{where}: the resumed (closed) run reported as crashed: {rep['summary']['crash']}")


# 9 ----------------------------------------------------------------------------------------------------------------
def test_captures_of_both_runs_kept_apart(h):
    from safetensors.torch import load_file
    mod = h["mod"]
    t0, _ = script(h, "a", steps=20, ckpt_out=ck(h, "a"), spike=[12])
    t1, _ = script(h, "b", steps=20, ckpt_in=ck(h, "a"), spike=[12])
    really_failed(t0, "gate", 12)
    really_failed(t1, "gate", 12)
    capdir = os.path.join(h["rd"], "captures")
    caps = sorted(os.listdir(capdir))
    want = {"12": 12, "12.run1": 20 + 12} if "12.run1" in caps else {"12": 12, "32": 32}
    if sorted(want) != caps:
        raise WrongAnswer(f"captures of the two runs: {caps} (expected one per run, kept apart)")
    for name, g in want.items():
        x, _ = mod.batch(g, spike=True)
        held = load_file(os.path.join(capdir, name, "tensors.safetensors"))["a.0"]
        assert torch.equal(held, x), f"captures/{name} does not hold global step {g}'s batch"
        out = h["tmp"] / f"replay-{name}.json"
        p = run_cli(h, "replay", os.path.join(capdir, name), "--model", "resume_models:net", "--json", out,
                    "--no-html", cwd=str(h["tmp"]))
        assert "Traceback" not in p.stderr and p.returncode in (0, 1), (p.returncode, p.stderr[-3000:])
        with open(out) as f:
            rep = json.load(f)
        hit = next((f for f in rep["findings"][:3] if f["rule"] in FWD and f["module"] == "gate"), None)
        if p.returncode != 1 or hit is None:
            raise WrongAnswer(f"replay of captures/{name}: exit {p.returncode}, {top(rep)}")
        print(f"replay captures/{name}: {one(hit)} op {hit['op']}")
