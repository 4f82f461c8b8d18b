"""Healthy training SCRIPTS run as real `python` subprocesses (the way external suites drive ampdoctor), then
`python -m ampdoctor report RUN --json J` in another subprocess; second set (the first: test_cli_workflows.py).

Every script trains a tiny model on the CPU (a linear 4-class teacher over 8-d inputs; fp16 autocast with
torch.amp.GradScaler("cpu") unless said) for ~30 steps and prints its losses; the test first asserts the training
was healthy (every loss finite, the mean of the last losses well below the first), then holds ampdoctor to its
promise for healthy training: the script exits 0; the in-process `w.report()` (where the script calls it) has no
warning or error and exit_code 0; the CLI exits 0, its JSON is strict, has no warning or error finding, no crash, and
the number of steps the script made; where asked, `--out DIR` wrote a non-empty `index.html` and `--tensorboard DIR`
an event file.

Scripts (14, 15 training processes, 15 CLI calls):
 1. resume_second_process: trains 20 steps, saves model/optimizer/scaler state and closes; a SECOND process loads
    the checkpoint and trains 20 more steps under a new watch on the same run_dir (two runs in one directory; the
    report describes the last: 20 steps); --tensorboard.
 2. eval_tail_no_close: 30 steps, then model.eval() and a no_grad validation pass under autocast (forwards with no
    step after the last step); never calls close() (the interpreter's exit ends the watch); --out + --tensorboard.
 3. partial_last_iteration: `with ampdoctor.watch(...)`; the loop breaks mid-iteration after the scaled backward,
    before scaler.step (a time budget running out); the run made 30 optimizer steps.
 4. bf16_no_scaler: bf16 autocast, `watch(model, optimizer=opt, run_dir=RUN)`, plain backward, clip, step.
 5. fp32_model_only_sys_exit0: no autocast at all, `watch(model, run_dir=RUN)`, SGD momentum, the script ends with
    sys.exit(0) and no close(); --tensorboard.
 6. two_models_two_dirs: two models trained in one loop (fp16 + scaler, and bf16), each watched into its own run dir;
    one closed, the other left to the interpreter's exit; the CLI on both.
 7. dataloader_last_batch_smaller: DataLoader(num_workers=0, shuffle, drop_last=False) over 300 samples in batches
    of 32 (the last of each epoch 12), 4 epochs, cosine LR; --out + --tensorboard.
 8. accumulation_8: 8 micro-batches per optimizer step (loss / 8), unscale_ + clip on the boundary: 12 steps.
 9. report_mid_training: `w.report()` after steps 10 and 20 (after the update), training continues; close(); the
    final report printed (`print(str(rep))`, `print(rep.text())`), then sys.exit(0); --out.
10. report_mid_iteration: `w.report()` once between `scaler.scale(loss).backward()` and `scaler.step(opt)`.
11. threads1_sys_exit0_in_with: torch.set_num_threads(1) + set_num_interop_threads(1) first thing; sys.exit(0)
    raised INSIDE the `with ampdoctor.watch(...)` block after the last step.
12. scaler_disabled: use_amp=False: GradScaler("cpu", enabled=False) given to the watch, autocast(enabled=False), the
    usual scale/unscale_/step/update calls (all pass-throughs).
13. dict_output_model_only: the model returns {"logits", "loss"} (the loss a tensor with requires_grad);
    `watch(model, run_dir=RUN)` only (optimizer and scaler adopted).
14. main_local_watch: the watch is a local of main(), which returns without close(); the script then runs no_grad
    inference with the returned model and saves its state_dict before exiting.

torch.compile is left out: on this CPU even backend="aot_eager" adds ~2.5 s a process (test_compile.py covers it).
Every watched process spends ~1.5 s in `watch()` itself importing torch._dynamo (torch.compiler.disable, reached from
record/hooks.py), so the scripts are kept to ~30 steps, the runs go on a pool of 3, and each run dir gets ONE CLI
call that combines --json with --out / --tensorboard.

Results: no script got a warning or an error, in-process or through the CLI; every CLI exit code was 0, every
--out wrote its index.html and every --tensorboard its event file. What ampdoctor got wrong is the step count
(strict xfails, each next to a passing test of the healthy promise on the same run):
 - 3: the iteration stopped after the scaled backward, before scaler.step, is reported as a 31st step ("Healthy: no
   problems found in 31 step(s)."; in-process 31 too), the timeline's step 30 a regular, not skipped step with its
   loss and scale 65536.0, although no optimizer step ran (record/step.py finish_open_step finalizes any open step
   with a loss or an event other than zero_grad).
 - 10: `w.report()` between the backward and the step finishes the open step (Watch.report ->
   finish_open_step), so that iteration becomes two step records: step 10 (loss, scale, no optimizer step) and step
   11 (loss None, scale None: step / unscale_ / optimizer.step / update); every later step is numbered one past its
   optimizer step (a failure at optimizer step 20 would be dated 21) and the report counts 31 steps for 30.
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = '''
import json, os, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
import ampdoctor

RUN = sys.argv[1]
torch.manual_seed(0)
W_T = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
FP16, BF16 = torch.float16, torch.bfloat16


def batch(i, n=32):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(100 + i))
    return x, (x @ W_T).argmax(1)


def mlp(h=32):
    return nn.Sequential(nn.Linear(8, h), nn.GELU(), nn.Linear(h, 4))


def log(loss, tag="a"):
    print("LOSS", tag, float(loss.detach()) if torch.is_tensor(loss) else float(loss), flush=True)


def inproc(w, tag="a"):
    rep = w.report()
    bad = [f.one_line() for f in rep.findings if f.severity in ("warning", "error")]
    print("INPROC", tag, json.dumps({"alarms": bad, "exit": rep.exit_code, "steps": rep.summary.get("steps")}),
          flush=True)
    return rep
'''

SCRIPTS = {}

SCRIPTS["resume_second_process"] = '''
MODE, CKPT = sys.argv[2], sys.argv[3]
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
start = 0
if MODE == "resume":
    ck = torch.load(CKPT)
    m.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    sc.load_state_dict(ck["scaler"])
    start = ck["step"]
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
for i in range(start, start + 20):
    x, y = batch(i)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=FP16):
        loss = F.cross_entropy(m(x).float(), y)
    sc.scale(loss).backward()
    sc.unscale_(opt)
    nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    sc.step(opt)
    sc.update()
    log(loss)
if MODE == "first":
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict(), "step": start + 20},
               CKPT)
w.close()
inproc(w)
'''

SCRIPTS["eval_tail_no_close"] = '''
m = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
for i in range(30):
    x, y = batch(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        loss = F.cross_entropy(m(x).float(), y)
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    log(loss)
m.eval()
correct = 0
with torch.no_grad():
    for j in range(8):
        x, y = batch(10_000 + j, 64)
        with torch.autocast("cpu", dtype=FP16):
            correct += (m(x).argmax(1) == y).sum().item()
print("ACC", correct / 512, flush=True)
# no w.close(): the interpreter's exit ends the watch
'''

SCRIPTS["partial_last_iteration"] = '''
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN) as w:
    for i in range(1000):
        x, y = batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        if i == 30:          # the time budget ran out: stop after the backward, before the step
            break
        sc.step(opt)
        sc.update()
        log(loss)
inproc(w)
'''

SCRIPTS["bf16_no_scaler"] = '''
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
w = ampdoctor.watch(m, optimizer=opt, run_dir=RUN)
for i in range(30):
    x, y = batch(i)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16):
        loss = F.cross_entropy(m(x).float(), y)
    loss.backward()
    nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    log(loss)
w.close()
inproc(w)
'''

SCRIPTS["fp32_model_only_sys_exit0"] = '''
m = mlp()
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
w = ampdoctor.watch(m, run_dir=RUN)
for i in range(30):
    x, y = batch(i)
    opt.zero_grad()
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    log(loss)
sys.exit(0)      # no w.close()
'''

SCRIPTS["two_models_two_dirs"] = '''
RUN_B = sys.argv[2]
a = mlp()
b = nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 4))
opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
wa = ampdoctor.watch(a, optimizer=opt_a, scaler=sc, run_dir=RUN)
wb = ampdoctor.watch(b, optimizer=opt_b, run_dir=RUN_B)
for i in range(30):
    x, y = batch(i)
    opt_a.zero_grad()
    opt_b.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        la = F.cross_entropy(a(x).float(), y)
    sc.scale(la).backward()
    sc.step(opt_a)
    sc.update()
    with torch.autocast("cpu", dtype=BF16):
        lb = F.cross_entropy(b(x).float(), y)
    lb.backward()
    opt_b.step()
    log(la, "a")
    log(lb, "b")
wa.close()
inproc(wa, "a")
inproc(wb, "b")
# wb is left open: the interpreter's exit ends it
'''

SCRIPTS["dataloader_last_batch_smaller"] = '''
from torch.utils.data import DataLoader, TensorDataset
X = torch.randn(300, 8, generator=torch.Generator().manual_seed(7))
Y = (X @ W_T).argmax(1)
dl = DataLoader(TensorDataset(X, Y), batch_size=32, shuffle=True, num_workers=0, drop_last=False,
                generator=torch.Generator().manual_seed(5))
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
sizes = []
for epoch in range(4):
    m.train()
    for x, y in dl:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        sched.step()
        sizes.append(len(x))
        log(loss)
assert len(sizes) == 40 and sizes.count(12) == 4, sizes
w.close()
inproc(w)
'''

SCRIPTS["accumulation_8"] = '''
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=2e-2)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
acc, run = 8, 0.0
for i in range(96):
    x, y = batch(i, 16)
    with torch.autocast("cpu", dtype=FP16):
        loss = F.cross_entropy(m(x).float(), y) / acc
    sc.scale(loss).backward()
    run += loss.item()
    if (i + 1) % acc == 0:
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)
        log(run)
        run = 0.0
w.close()
inproc(w)
'''

SCRIPTS["report_mid_training"] = '''
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
for i in range(30):
    x, y = batch(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        loss = F.cross_entropy(m(x).float(), y)
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    log(loss)
    if i in (9, 19):
        inproc(w, f"mid{i + 1}")
w.close()
rep = inproc(w, "end")
print("STR", str(rep), flush=True)
print(rep.text(), flush=True)
sys.exit(0)
'''

SCRIPTS["report_mid_iteration"] = '''
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
for i in range(30):
    x, y = batch(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        loss = F.cross_entropy(m(x).float(), y)
    sc.scale(loss).backward()
    if i == 10:          # a look at the diagnosis between the backward and the step (a debugging session)
        inproc(w, "mid")
    sc.step(opt)
    sc.update()
    log(loss)
w.close()
inproc(w, "end")
'''

SCRIPTS["threads1_sys_exit0_in_with"] = '''
torch.set_num_threads(1)
torch.set_num_interop_threads(1)
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN) as w:
    for i in range(30):
        x, y = batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        log(loss)
    print("bye", flush=True)
    sys.exit(0)          # inside the with block: SystemExit(0) passes through the watch's __exit__
'''

SCRIPTS["scaler_disabled"] = '''
use_amp = False
m = mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu", enabled=use_amp)
w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
for i in range(30):
    x, y = batch(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16, enabled=use_amp):
        loss = F.cross_entropy(m(x).float(), y)
    sc.scale(loss).backward()
    sc.unscale_(opt)
    nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    sc.step(opt)
    sc.update()
    log(loss)
w.close()
inproc(w)
'''

SCRIPTS["dict_output_model_only"] = '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x, labels=None):
        logits = self.body(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


m = Net()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
sc = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(m, run_dir=RUN)
for i in range(30):
    x, y = batch(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        out = m(x, labels=y)
    loss = out["loss"]
    assert loss.requires_grad and loss.dim() == 0
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    log(loss)
w.close()
inproc(w)
'''

SCRIPTS["main_local_watch"] = '''
import gc


def main():
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=RUN)
    for i in range(30):
        x, y = batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        log(loss)
    return m         # the watch `w` is dropped here, never closed


if __name__ == "__main__":
    model = main()
    gc.collect()
    model.eval()
    with torch.no_grad():
        preds = model(batch(99_999, 64)[0]).argmax(1)
    print("PRED", preds.shape[0], flush=True)
    torch.save(model.state_dict(), os.path.join(os.path.dirname(RUN), "main_local_watch.pt"))
'''

# name -> (training processes: [argv after the script, with {run}, {run_b}, {t}], run dirs reported:
#          {run key: (expected steps, cli options)}); cli options: "out" (--out), "tb" (--tensorboard)
JOBS = {
    "resume_second_process": ([["{run}", "first", "{t}/resume.ckpt"], ["{run}", "resume", "{t}/resume.ckpt"]],
                              {"run": (20, {"tb"})}),
    "eval_tail_no_close": ([["{run}"]], {"run": (30, {"out", "tb"})}),
    "partial_last_iteration": ([["{run}"]], {"run": (30, set())}),
    "bf16_no_scaler": ([["{run}"]], {"run": (30, set())}),
    "fp32_model_only_sys_exit0": ([["{run}"]], {"run": (30, {"tb"})}),
    "two_models_two_dirs": ([["{run}", "{run_b}"]], {"run": (30, set()), "run_b": (30, set())}),
    "dataloader_last_batch_smaller": ([["{run}"]], {"run": (40, {"out", "tb"})}),
    "accumulation_8": ([["{run}"]], {"run": (12, set())}),
    "report_mid_training": ([["{run}"]], {"run": (30, {"out"})}),
    "report_mid_iteration": ([["{run}"]], {"run": (30, set())}),
    "threads1_sys_exit0_in_with": ([["{run}"]], {"run": (30, set())}),
    "scaler_disabled": ([["{run}"]], {"run": (30, set())}),
    "dict_output_model_only": ([["{run}"]], {"run": (30, set())}),
    "main_local_watch": ([["{run}"]], {"run": (30, set())}),
}


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    env.pop("COLUMNS", None)
    return env


def strict_json(path):
    def refuse(tok):
        raise ValueError(f"non-standard JSON token {tok}")
    with open(path, encoding="utf-8") as f:
        return json.loads(f.read(), parse_constant=refuse)


class Runs:
    """Every script's training processes, then its CLI calls, started on a pool at once; tests wait on theirs."""

    def __init__(self, t):
        self.t = str(t)
        self.env = _env()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
        self.futures = {name: self.pool.submit(self._job, name) for name in JOBS}

    def _job(self, name):
        d = os.path.join(self.t, name)
        os.makedirs(d)
        script = os.path.join(d, "train.py")
        with open(script, "w") as f:
            f.write(PRELUDE + SCRIPTS[name])
        dirs = {"run": os.path.join(d, "run"), "run_b": os.path.join(d, "run_b")}
        procs = []
        for argv in JOBS[name][0]:
            args = [a.replace("{run_b}", dirs["run_b"]).replace("{run}", dirs["run"]).replace("{t}", d) for a in argv]
            procs.append(subprocess.run([sys.executable, script, *args], cwd=d, env=self.env, capture_output=True,
                                        text=True, timeout=120))
        cli = {}
        for key, (_, opts) in JOBS[name][1].items():
            j = os.path.join(d, f"{key}.json")
            argv = ["report", dirs[key], "--json", j]
            argv += ["--out", os.path.join(d, f"{key}_html")] if "out" in opts else ["--no-html"]
            if "tb" in opts:
                argv += ["--tensorboard", os.path.join(d, f"{key}_tb")]
            p = subprocess.run([sys.executable, "-m", "ampdoctor", *argv], cwd=d, env=self.env, capture_output=True,
                               text=True, timeout=120)
            cli[key] = (p, j, os.path.join(d, f"{key}_html"), os.path.join(d, f"{key}_tb"))
        return procs, cli

    def get(self, name):
        return self.futures[name].result()

    def close(self):
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = Runs(tmp_path_factory.mktemp("healthy_cli2"))
    try:
        yield r
    finally:
        r.close()


def losses_of(procs, tag="a"):
    out = []
    for p in procs:
        for ln in p.stdout.splitlines():
            parts = ln.split()
            if len(parts) == 3 and parts[0] == "LOSS" and parts[1] == tag:
                out.append(float(parts[2]))
    return out


def assert_trained_healthy(losses, fall=0.85):
    """Every loss finite; the mean of the last k below `fall` x the mean of the first k."""
    assert len(losses) >= 8, losses
    k = min(5, len(losses) // 4)
    assert all(map(math.isfinite, losses)), losses
    assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, losses


def check(runs, name, *, tags=("a",), inproc=None, count=True):
    """The whole promise for a healthy script (see the module docstring); `count=False` leaves the number of steps
    to a test of its own."""
    procs, cli = runs.get(name)
    for p in procs:
        assert p.returncode == 0, (name, p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    for tag in tags:
        assert_trained_healthy(losses_of(procs, tag))
    # the in-process reports the script printed
    lines = [ln.split(" ", 2) for p in procs for ln in p.stdout.splitlines() if ln.startswith("INPROC ")]
    if inproc is not None:
        assert sorted(ln[1] for ln in lines) == sorted(inproc), lines
    for _, tag, js in lines:
        r = json.loads(js)
        assert r["alarms"] == [] and r["exit"] == 0, (tag, r)
    # the CLI on each run dir
    for key, (steps, opts) in JOBS[name][1].items():
        p, j, html, tb = cli[key]
        assert "Traceback" not in p.stderr, p.stderr[-4000:]
        assert os.path.isfile(j), (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
        d = strict_json(j)
        bad = [f"{f['rule']}/{f['severity']}@{f['module']} step {f['step']}: {f['message']}" for f in d["findings"]
               if f["severity"] in ("warning", "error")]
        assert not bad, (key, bad, d["summary"].get("verdict"))
        assert d["summary"].get("crash") is None, (key, d["summary"].get("crash"), d["summary"].get("verdict"))
        assert p.returncode == 0, (key, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
        if count:
            assert d["summary"]["steps"] == steps, (key, d["summary"]["steps"], d["summary"].get("verdict"))
        if "out" in opts:
            idx = os.path.join(html, "index.html")
            assert os.path.isfile(idx) and os.path.getsize(idx) > 0, os.listdir(html) if os.path.isdir(html) else html
            with open(idx, encoding="utf-8") as f:
                assert "<html" in f.read(4096).lower()
        if "tb" in opts:
            ev = [os.path.join(dp, fn) for dp, _, fns in os.walk(tb) for fn in fns
                  if fn.startswith("events.out.tfevents")]
            assert ev and all(os.path.getsize(e) > 0 for e in ev), (tb, ev)
    return procs, cli


# ------------------------------------------------------------------------------------------------------ tests
def test_resume_second_process_appends_to_the_same_run_dir(runs):
    procs, _ = check(runs, "resume_second_process", inproc=["a", "a"])
    assert len(losses_of(procs[:1])) == 20 and len(losses_of(procs[1:])) == 20


def test_eval_tail_without_close(runs):
    procs, _ = check(runs, "eval_tail_no_close", inproc=[])
    acc = [float(ln.split()[1]) for ln in procs[0].stdout.splitlines() if ln.startswith("ACC ")]
    assert acc and acc[0] > 0.5, acc


def test_partial_last_iteration_break_after_backward(runs):
    check(runs, "partial_last_iteration", inproc=["a"], count=False)


def steps_counted(runs, name):
    """The steps the CLI's report and the script's own in-process reports count, and the CLI's timeline."""
    procs, cli = runs.get(name)
    d = strict_json(cli["run"][1])
    inproc = {ln.split(" ", 2)[1]: json.loads(ln.split(" ", 2)[2])["steps"] for p in procs
              for ln in p.stdout.splitlines() if ln.startswith("INPROC ")}
    return d["summary"]["steps"], inproc, d["timeline"]


def test_partial_last_iteration_is_not_counted_as_a_step(runs):
    cli_steps, inproc, timeline = steps_counted(runs, "partial_last_iteration")
    assert (cli_steps, inproc["a"]) == (30, 30), (cli_steps, inproc, timeline[-2:])


def test_bf16_without_scaler(runs):
    check(runs, "bf16_no_scaler", inproc=["a"])


def test_fp32_model_only_ends_with_sys_exit_0(runs):
    check(runs, "fp32_model_only_sys_exit0", inproc=[])


def test_two_models_watched_into_two_run_dirs(runs):
    check(runs, "two_models_two_dirs", tags=("a", "b"), inproc=["a", "b"])


def test_dataloader_last_batch_smaller(runs):
    check(runs, "dataloader_last_batch_smaller", inproc=["a"])


def test_gradient_accumulation_8(runs):
    check(runs, "accumulation_8", inproc=["a"])


def test_report_mid_training_then_continue_then_print_it(runs):
    procs, _ = check(runs, "report_mid_training", inproc=["mid10", "mid20", "end"])
    out = procs[0].stdout
    assert "STR Report(0 errors, 0 warnings" in out, out[-2000:]
    assert "healthy" in out.lower(), out[-2000:]


def test_report_between_backward_and_step(runs):
    check(runs, "report_mid_iteration", inproc=["mid", "end"], count=False)


def test_report_between_backward_and_step_keeps_step_numbers(runs):
    cli_steps, inproc, timeline = steps_counted(runs, "report_mid_iteration")
    assert (cli_steps, inproc["end"]) == (30, 30), (cli_steps, inproc, timeline[9:13])
    assert [t["step"] for t in timeline] == list(range(30)) and all(t["loss"] is not None for t in timeline), \
        timeline[9:13]


def test_threads1_sys_exit_0_inside_with_block(runs):
    procs, _ = check(runs, "threads1_sys_exit0_in_with", inproc=[])
    assert "bye" in procs[0].stdout


def test_disabled_grad_scaler(runs):
    check(runs, "scaler_disabled", inproc=["a"])


def test_dict_output_with_loss_model_only_watch(runs):
    check(runs, "dict_output_model_only", inproc=["a"])


def test_watch_local_to_main_never_closed(runs):
    procs, _ = check(runs, "main_local_watch", inproc=[])
    assert "PRED 64" in procs[0].stdout
