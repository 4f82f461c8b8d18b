"""End-to-end CLI workflows on REAL run directories: training scripts written into tmp run in their own `python`
subprocesses (a tiny MLP on the CPU, fp16 autocast, `torch.amp.GradScaler("cpu")`, `ampdoctor.watch(model,
optimizer=opt, scaler=scaler, run_dir=DIR)`), then `python -m ampdoctor ...` is driven in subprocesses and held to
shared/CONTRACT.md (and README "Command line" where the contract leaves it to the README).

The bad runs multiply one batch by 1e5 at step 4: fp16 overflows in the first Linear, module "0" (finite fp32 input,
±inf out), the loss is inf and GradScaler skips the step. The healthy runs train unchanged (GradScaler's first
backoff, if any, is `info`). Runs that end early do so after step 5 (bad) or step 3 (healthy) by a RuntimeError,
SIGKILL or sys.exit(1), never calling w.close().

Budget (~90 s, 2 cores): 7 training processes (a process may train several runs one after the other, like a sweep)
and ~20 CLI calls all start from one module fixture on a pool; a run's CLI calls start as soon as its last training
process ends; the tests only read the results. Where the contract is silent the expectation is what a professional
tool does, said in a comment at the test.

Checks:
 1. healthy run, report from another working directory with a RELATIVE run path: exit 0, "healthy", strict JSON
    that matches the schema, only `info` findings, HTML at the contract's default `reports/<name>/index.html`
    under the cwd (not the repo), no saved replay, the run dir untouched.
 2. `--no-html --json`: the JSON file only; no `reports/` appears in the cwd.
 3. bad run: exit 1; `overflow` at module "0", step 4, error, among the first three; every finding matches the
    schema field by field (rule ids from the contract's list, severities, phases, int steps, module names of the
    model); the first finding is an error; the text names `0` and step 4.
 4. reports and replays never write into a run dir: report, report --model (a fresh replay), --rules, replay of a
    capture, wrong-kind input, --out onto the run dir -- every run dir byte-identical afterwards.
 5. `replay CAPTURE --model pkg.mod:factory --loss pkg.mod:fn --out --json`: exit 1, `overflow` at "0" with an
    aten op, a self-contained index.html under --out, the capture untouched.
 6. RuntimeError raised after the NaN step: exit 1, "CRASHED" with the exception, the overflow still named, the
    HTML shows the crash.
 7. RuntimeError on healthy steps: not healthy, exit 1 (README: a crashed run exits 1), the JSON's summary has it.
 8. SIGKILL after the NaN step: exit 1, the bad step 4 reported; with `report --model` the overflow at "0".
 9. SIGKILL mid-run on healthy steps: must not read as a healthy run; must say it did not finish.
10. sys.exit(1) after the NaN step without w.close(): exit 1, overflow at "0" step 4 named.
11. sys.exit(1) on healthy steps without w.close(): must not read as a healthy, finished run.
12. a script that ends normally without w.close(): healthy, all 6 steps recorded, no "did not finish" alarm.
13. the same run_dir reused by a second, later process: appended as run 1 (README/rundir), run 0's records and
    saved replay byte-identical, the report describes the last run (6 steps, not 8).
14. ... and run 0's capture is not overwritten by run 1's capture of the same step.
15. `--rules overflow` on the bad run keeps the overflow that the unfiltered report names (exit 1).
16. unknown rule ids in `--rules` (`overflow,bogus,Overflow`): exit 2, one line naming them, nothing written.
17. missing run dir (unicode name): exit 2, one line naming it, nothing written (no json, no reports/).
18. run dir from a newer format version: exit 2, one line, nothing written, run dir untouched.
19. spaces and unicode in every path (the run dir the watch wrote, the cwd, --out, --json): works.
20. read-only run dir (chmod; chattr +i under root): the report works with outputs elsewhere; --json/--out inside
    it: exit 2, one line naming the path; nothing inside changes.
21. wrong kind of input, `report` on a capture and `replay` on a run dir: exit 2, one line, no stdout.
22. `--out` naming the run dir itself (ampdoctor's, but not a report dir): exit 2, one line, untouched.

Bad input is always checked the same way: exit 2, exactly one `ampdoctor: ...` line on stderr, no traceback, and
the run dir's files hashed before and after.

Found here and fixed (each a strict xfail first):
 - 9:  a run SIGKILLed after 3 healthy steps was "healthy", exit 0: the watch now writes an end line when it closes
       (close() or interpreter exit) and records its process; a run without the end line whose process is gone is
       reported as killed after its last step (exit 1).
 - 11: a script ended by sys.exit(1) after healthy steps was "healthy", exit 0: a non-zero sys.exit while watching
       is recorded on the open step like an uncaught exception.
 - 14: a second process in the same run_dir rewrote run 0's captures/4: a later run's capture of the same step goes
       to captures/4.run<i>.
 - 15: `report RUN --rules overflow` dropped the overflow the full report names: the filter now narrows the whole
       diagnosis (every rank, the saved replay) instead of re-running only those rules on the step records.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONTRACT_RULES = {
    "overflow", "nan_origin", "overflow_risk", "underflow", "loss_scale_collapse", "skipped_steps",
    "clip_before_unscale", "scaler_misorder", "missing_scaler_update", "update_underflow", "fp16_master_weights",
    "mask_value_overflow", "eps_underflow", "precision_loss", "env_tf32", "headroom_trend", "update_spike",
    "deprecated_api", "replay_error"}
SEVERITIES = {"error", "warning", "info"}
PHASES = {"forward", "backward", "optimizer", "scaler", "env", None}
FIELDS = {"rule", "severity", "phase", "module", "op", "step", "message", "fix", "evidence"}
MODULES = {"", "0", "1", "2"}        # named_modules() of wf_models.net()

MODELS_SRC = '''
import torch.nn as nn


def net():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def loss(out, *args, **kwargs):
    return out.float().pow(2).mean()
'''

TRAIN_SRC = '''
import json, os, signal, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import ampdoctor
from wf_models import net

torch.set_num_threads(1)
# one or more trainings, one after the other (a sweep); only the last may end the process early
for run_dir, mode, bad, steps, stop, seed in json.loads(sys.argv[1]):
    torch.manual_seed(seed)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=run_dir)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g) * (1e5 if i == bad else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print("step", i, float(loss), flush=True)
        if i == stop:
            if mode == "raise":
                raise RuntimeError("loss is nan, giving up")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "exit":
                sys.exit(1)            # no w.close()
    if mode == "close":
        w.close()
    print("done", run_dir, flush=True)  # mode "end": the script just ends, no w.close()
'''

# Training processes, grouped into chains that run one after the other; each process trains its runs in order:
# (run name, mode, bad step, steps, stop step, seed). mode: close = w.close(); end = the script ends without
# w.close(); raise / kill / exit = RuntimeError / SIGKILL / sys.exit(1) after step `stop`, without w.close().
# "bad" and the first run of "reuse" are the same training (so "reuse" run 0 is what "bad" is); "reuse" run 1 is a
# later, separate process writing into the same run dir.
CHAINS = [
    [[("bad", "close", 4, 8, -1, 0), ("reuse", "close", 4, 8, -1, 0), ("kill_ok", "kill", -1, 8, 3, 0)],
     [("reuse", "close", 4, 6, -1, 1), ("exit_ok", "exit", -1, 8, 3, 0)]],
    [[("healthy", "end", -1, 6, -1, 0)]],
    [[("raise_bad", "raise", 4, 8, 5, 0)]],
    [[("kill_bad", "kill", 4, 8, 5, 0)]],
    [[("exit_bad", "exit", 4, 8, 5, 0)]],
    [[("raise_ok", "raise", -1, 8, 3, 0)]],
]
RUNS = sorted({r[0] for chain in CHAINS for proc in chain for r in proc})
RUN_DIRS = {"raise_bad": os.path.join("my runs ✓", "ëxp 1")}   # spaces + unicode (check 19)
SCRIPT_RC = {"end": 0, "close": 0, "raise": 1, "kill": -9, "exit": 1}

# CLI calls, started as soon as their run (or its prepared copy) exists. key -> (run, argv, cwd).
# {run}: the run dir (absolute), {cap}: its captures/4, {t}: the module's tmp dir. cwd is relative to {t}.
CLI = {
    # 1, 2, 12: healthy
    "h_default": ("healthy", ["report", "../../runs/healthy", "--json", "h.json"], "cwd a/b"),
    # 16: unknown rule ids
    "rules_bogus": ("healthy", ["report", "{run}", "--rules", "overflow,bogus,Overflow", "--json", "{t}/nr.json"],
                    "cwd_rules"),
    # 18: newer format
    "newer": ("healthy_v2", ["report", "{run}", "--json", "{t}/v2.json"], "cwd_v2"),
    # 2, 3, 4: bad run
    "b_json": ("bad", ["report", "{run}", "--no-html", "--json", "{t}/b.json"], "cwd_b"),
    # 5: replay
    "b_replay": ("bad", ["replay", "{cap}", "--model", "wf_models:net", "--loss", "wf_models:loss",
                         "--out", "{t}/replay out", "--json", "{t}/replay.json"], "cwd_b"),
    # 15: --rules filter
    "b_rules": ("bad", ["report", "{run}", "--no-html", "--rules", "overflow", "--json", "{t}/b_rules.json"],
                "cwd_b"),
    # 21, 22: wrong inputs
    "b_report_cap": ("bad", ["report", "{cap}", "--no-html"], "cwd_b"),
    "b_replay_run": ("bad", ["replay", "{run}", "--model", "wf_models:net", "--no-html"], "cwd_b"),
    # 20: the bad run's dir is made read-only right after training (b_json above is a report of it)
    "ro_json_in": ("bad", ["report", "{run}", "--no-html", "--json", "{run}/new.json"], "cwd_b"),
    "ro_out_in": ("bad", ["report", "{run}", "--out", "{run}/html"], "cwd_b"),
    # 6-11: runs that did not finish
    # 6, 19: the crashed run's dir has spaces and unicode, reached by a relative path from a cwd with unicode
    "raise_bad": ("raise_bad", ["report", "../runs/my runs ✓/ëxp 1", "--out", "rapport é/ñ 1", "--json",
                                "résumé.json"], "cwd ü"),
    "kill_bad": ("kill_bad", ["report", "{run}", "--no-html", "--json", "{t}/kill_bad.json"], "cwd_x"),
    "kill_bad_model": ("kill_bad", ["report", "{run}", "--no-html", "--model", "wf_models:net", "--loss",
                                    "wf_models:loss", "--json", "{t}/kill_bad_m.json"], "cwd_x"),
    "kb_out_run": ("kill_bad", ["report", "{run}", "--out", "{run}"], "cwd_x"),      # 22
    "exit_bad": ("exit_bad", ["report", "{run}", "--no-html", "--json", "{t}/exit_bad.json"], "cwd_x"),
    "raise_ok": ("raise_ok", ["report", "{run}", "--no-html", "--json", "{t}/raise_ok.json"], "cwd_x"),
    "kill_ok": ("kill_ok", ["report", "{run}", "--no-html", "--json", "{t}/kill_ok.json"], "cwd_x"),
    "exit_ok": ("exit_ok", ["report", "{run}", "--no-html", "--json", "{t}/exit_ok.json"], "cwd_x"),
    # 13: reused run dir
    "reuse": ("reuse", ["report", "{run}", "--no-html", "--json", "{t}/reuse.json"], "cwd_x"),
}


# ------------------------------------------------------------------------------------------------ helpers
def _digest(p):
    if os.path.islink(p):
        return ("link", os.readlink(p))
    if os.path.isdir(p):
        return ("dir",)
    with open(p, "rb") as f:
        return ("file", hashlib.sha256(f.read()).hexdigest())


def snapshot(root) -> dict:
    """Every path under root (links not followed), relative, with its kind and content hash."""
    root = str(root)
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in dns + fns:
            p = os.path.join(dp, n)
            out[os.path.relpath(p, root)] = _digest(p)
    return out


def strict_json(path):
    """The file parsed as standard JSON (no NaN/Infinity tokens: any JSON reader must take it)."""
    def refuse(tok):
        raise ValueError(f"non-standard JSON token {tok}")
    with open(path, encoding="utf-8") as f:
        return json.loads(f.read(), parse_constant=refuse)


def check_finding(f: dict) -> None:
    """One finding against the contract's schema, field by field."""
    assert FIELDS <= set(f), f"missing fields {FIELDS - set(f)} in {f}"
    assert f["rule"] in CONTRACT_RULES, f
    assert f["severity"] in SEVERITIES, f
    assert f["phase"] in PHASES, f
    assert f["module"] is None or (isinstance(f["module"], str) and f["module"] in MODULES), f
    assert f["op"] is None or (isinstance(f["op"], str) and f["op"]), f
    assert f["step"] is None or (type(f["step"]) is int and f["step"] >= 0), f
    assert isinstance(f["message"], str) and f["message"].strip(), f
    assert isinstance(f["fix"], str), f
    assert isinstance(f["evidence"], dict), f


def check_report(d: dict) -> list[dict]:
    assert isinstance(d, dict) and isinstance(d.get("findings"), list) and isinstance(d.get("summary"), dict), d
    for f in d["findings"]:
        check_finding(f)
    return d["findings"]


def rc_for(d: dict) -> int:
    """The exit code the contract (and README: a crashed run exits 1) gives this report."""
    return 1 if any(f["severity"] == "error" for f in d["findings"]) or d["summary"].get("crash") else 0


def top3_has(findings, rule, module, step):
    return any((f["rule"], f["module"], f["step"], f["severity"]) == (rule, module, step, "error")
               for f in findings[:3])


def error_line(p) -> str:
    """A refused call: exit 2, no traceback, exactly one `ampdoctor: ...` line on stderr."""
    assert p.returncode == 2, f"exit {p.returncode}\nstderr: {p.stderr[-3000:]}\nstdout: {p.stdout[-1500:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ampdoctor: "), p.stderr
    return lines[0]


def no_traceback(p):
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


def _env(helpers_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([helpers_dir, ROOT]), OMP_NUM_THREADS="1",
               PYTHONIOENCODING="utf-8")
    env.pop("COLUMNS", None)
    return env


# ------------------------------------------------------------------------------------------------ the runs
class Workflows:
    """All training runs and CLI calls of this module, started on a pool at once; tests wait on what they read."""

    def __init__(self, t):
        self.t = str(t)
        self.helpers = os.path.join(self.t, "helpers")
        os.makedirs(self.helpers)
        with open(os.path.join(self.helpers, "wf_models.py"), "w") as f:
            f.write(MODELS_SRC)
        self.script = os.path.join(self.helpers, "train.py")
        with open(self.script, "w") as f:
            f.write(TRAIN_SRC)
        self.env = _env(self.helpers)
        self.dirs = {n: os.path.join(self.t, "runs", RUN_DIRS.get(n, n)) for n in RUNS}
        self.dirs["healthy_v2"] = os.path.join(self.t, "runs", "healthy_v2")
        self.train = {}        # name -> [(process, the process's last mode, this run's mode)] that trained it
        self.snaps = {}        # name -> [snapshot after each process that trained it]
        self.blobs = {}        # name -> [steps.jsonl bytes after each process that trained it]
        self.ro_ok = None      # whether the bad run dir could be made read-only
        self.futures = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
        last = {}
        for ci, chain in enumerate(CHAINS):
            for pi, proc in enumerate(chain):
                for r in proc:
                    last[r[0]] = (ci, pi)
        self.last = last
        self.chain_of = {n: ci for n, (ci, _) in last.items()}
        self.chain_futures = [self.pool.submit(self._chain, ci) for ci in range(len(CHAINS))]

    # -- training
    def _chain(self, ci):
        for pi, proc in enumerate(CHAINS[ci]):
            for r in proc:
                os.makedirs(os.path.dirname(self.dirs[r[0]]), exist_ok=True)
            specs = [[self.dirs[n], mode, bad, steps, stop, seed] for n, mode, bad, steps, stop, seed in proc]
            p = subprocess.run([sys.executable, self.script, json.dumps(specs)], cwd=self.t, env=self.env,
                               capture_output=True, text=True, timeout=300)
            for r in proc:
                name = r[0]
                self.train.setdefault(name, []).append((p, proc[-1][1], r[1]))
                self.snaps.setdefault(name, []).append(snapshot(self.dirs[name]))
                sp = os.path.join(self.dirs[name], "steps.jsonl")
                self.blobs.setdefault(name, []).append(open(sp, "rb").read() if os.path.exists(sp) else b"")
            for r in proc:
                if self.last[r[0]] == (ci, pi):
                    self._start_cli(r[0])

    def _start_cli(self, name):
        derived = [name]
        if name == "healthy":
            self._newer_copy()
            derived.append("healthy_v2")
        if name == "bad":
            self._make_read_only(self.dirs["bad"])
        for d in derived:
            if d not in self.snaps:
                self.snaps[d] = [snapshot(self.dirs[d])]
            for key, (run, argv, cwd) in CLI.items():
                if run == d:
                    self.futures[key] = self.pool.submit(self._cli, d, argv, cwd)

    def _newer_copy(self):
        dst = self.dirs["healthy_v2"]
        shutil.copytree(self.dirs["healthy"], dst, symlinks=True)
        mp = os.path.join(dst, "manifest.json")
        with open(mp) as f:
            man = json.load(f)
        man["format_version"] = man["format_version"] + 1
        with open(mp, "w") as f:
            json.dump(man, f)

    def _make_read_only(self, root):
        paths = [root] + [os.path.join(dp, n) for dp, dns, fns in os.walk(root) for n in dns + fns]
        for p in paths:
            os.chmod(p, os.stat(p).st_mode & ~0o222)
        if os.geteuid() == 0:    # root ignores permission bits: make the tree immutable instead
            self._immutable = subprocess.run(["chattr", "-R", "+i", root], capture_output=True).returncode == 0
        try:
            open(os.path.join(root, "probe"), "w").close()
            os.remove(os.path.join(root, "probe"))
            self.ro_ok = False
        except OSError:
            self.ro_ok = True

    def close(self):
        self.pool.shutdown(wait=True)
        root = self.dirs["bad"]
        if os.path.exists(root):
            if getattr(self, "_immutable", False):
                subprocess.run(["chattr", "-R", "-i", root], capture_output=True)
            for dp, dns, fns in os.walk(root):
                for n in [dp] + [os.path.join(dp, x) for x in dns + fns]:
                    try:
                        os.chmod(n, 0o755)
                    except OSError:
                        pass

    # -- the CLI
    def fill(self, run, s):
        return (s.replace("{run}", self.dirs[run]).replace("{cap}", os.path.join(self.dirs[run], "captures", "4"))
                .replace("{t}", self.t))

    def _cli(self, run, argv, cwd):
        cwd = os.path.join(self.t, cwd)
        os.makedirs(cwd, exist_ok=True)
        return subprocess.run([sys.executable, "-m", "ampdoctor", *(self.fill(run, a) for a in argv)], cwd=cwd,
                              env=self.env, capture_output=True, text=True, timeout=300)

    def cli_now(self, argv, cwd):
        return self._cli("healthy", argv, cwd)

    # -- what tests read
    def run(self, name):
        """(self.train[name], run dir) once every process that trains `name` has ended."""
        self.chain_futures[self.chain_of[name]].result()
        return self.train[name], self.dirs[name]

    def res(self, key):
        self.run(CLI[key][0].replace("_v2", ""))
        return self.futures[key].result()

    def settled(self, run):
        """The run dir's snapshot after every CLI call on it has ended."""
        for key, (r, _, _) in CLI.items():
            if r == run:
                self.res(key)
        return snapshot(self.dirs[run])

    def path(self, *parts):
        return os.path.join(self.t, *parts)


@pytest.fixture(scope="module")
def wf(tmp_path_factory):
    w = Workflows(tmp_path_factory.mktemp("wf"))
    try:
        yield w
    finally:
        w.close()


def trained(wf, name):
    procs, rd = wf.run(name)
    for p, last_mode, mode in procs:
        assert p.returncode == SCRIPT_RC[last_mode], f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}"
        if last_mode in ("end", "close", "kill"):
            assert "Traceback" not in p.stderr, p.stderr[-3000:]
        if mode in ("end", "close"):
            assert f"done {rd}" in p.stdout, p.stdout[-2000:]
    return rd


# ========================================================================================== 1-5: finished runs
def test_01_healthy_report_from_another_cwd_default_html_and_strict_json(wf):
    rd = trained(wf, "healthy")
    p = wf.res("h_default")
    assert p.returncode == 0, p.stderr
    no_traceback(p)
    assert "healthy" in p.stdout.lower(), p.stdout
    cwd = wf.path("cwd a/b")
    findings = check_report(strict_json(os.path.join(cwd, "h.json")))       # --json relative to the cwd
    assert all(f["severity"] == "info" for f in findings), findings         # no warning/error on a healthy run
    # the contract's default: reports/<name>/ -- relative to where the command runs, not the repo or the run dir
    assert os.path.isfile(os.path.join(cwd, "reports", "healthy", "index.html"))
    assert not os.path.exists(os.path.join(ROOT, "reports", "healthy"))
    # a healthy run saves no replay (README; GradScaler's settled-scale skip may leave a capture, by design);
    # the report wrote nothing into the run dir
    assert not any(n.startswith("replay-") for n in os.listdir(rd)), os.listdir(rd)
    assert wf.settled("healthy") == wf.snaps["healthy"][0]


def test_02_no_html_writes_only_the_json(wf):
    trained(wf, "bad")
    wf.settled("bad")                      # every call on the bad run ran from cwd_b with --no-html (or was refused)
    assert os.path.isfile(wf.path("b.json"))
    assert os.listdir(wf.path("cwd_b")) == []                               # no reports/ anywhere near


def test_03_bad_run_names_the_overflow_at_its_module_and_step(wf):
    trained(wf, "bad")
    p = wf.res("b_json")
    assert p.returncode == 1, p.stderr
    no_traceback(p)
    d = strict_json(wf.path("b.json"))
    findings = check_report(d)
    assert rc_for(d) == 1
    assert top3_has(findings, "overflow", "0", 4), [(f["rule"], f["module"], f["step"]) for f in findings]
    assert findings[0]["severity"] == "error", findings[0]                  # most important first
    assert "step 4" in p.stdout and "`0`" in p.stdout, p.stdout


def test_04_reports_and_replays_never_write_into_the_run_dir(wf):
    # report, report --model (replays afresh: that replay must not be saved over the run's), --rules, replay of a
    # capture, the wrong kind of input, --out onto the run dir: every run dir byte-identical, nothing added.
    for name in ("healthy", "kill_bad", "exit_bad", "raise_bad", "raise_ok", "reuse", "bad"):
        trained(wf, name)
        assert wf.settled(name) == wf.snaps[name][-1], name


def test_05_replay_capture_with_model_and_loss_specs(wf):
    rd = trained(wf, "bad")
    cap = os.path.join(rd, "captures", "4")
    assert os.path.isdir(cap), os.listdir(rd)
    before = snapshot(cap)
    p = wf.res("b_replay")
    assert p.returncode == 1, p.stderr
    no_traceback(p)
    findings = check_report(strict_json(wf.path("replay.json")))
    top = [f for f in findings[:3] if (f["rule"], f["module"], f["severity"]) == ("overflow", "0", "error")]
    assert top and top[0]["op"] and top[0]["op"].startswith("aten::"), findings[:3]
    assert top[0]["step"] in (4, None), top[0]
    html = open(wf.path("replay out", "index.html"), encoding="utf-8").read()
    assert "overflow" in html
    assert not re.search(r"""(src|href)\s*=\s*["']https?://""", html)     # self-contained
    assert snapshot(cap) == before


# ========================================================================================== 6-12: unfinished runs
def test_06_exception_after_the_nan_step_is_a_crash_naming_the_overflow(wf):
    trained(wf, "raise_bad")
    p = wf.res("raise_bad")
    assert p.returncode == 1, p.stderr
    no_traceback(p)
    assert "CRASHED" in p.stdout and "RuntimeError" in p.stdout and "giving up" in p.stdout, p.stdout
    assert "healthy" not in p.stdout.lower()
    cwd = wf.path("cwd ü")
    findings = check_report(strict_json(os.path.join(cwd, "résumé.json")))
    assert top3_has(findings, "overflow", "0", 4), findings[:3]
    html = open(os.path.join(cwd, "rapport é", "ñ 1", "index.html"), encoding="utf-8").read()
    assert "RuntimeError" in html and "giving up" in html                  # README: the crash banner


def test_07_exception_on_healthy_steps_is_not_healthy(wf):
    trained(wf, "raise_ok")
    p = wf.res("raise_ok")
    no_traceback(p)
    assert p.returncode == 1, (p.returncode, p.stdout)                      # README: a crashed run exits 1
    assert "CRASHED" in p.stdout and "RuntimeError" in p.stdout, p.stdout
    assert not re.search(r"^healthy", p.stdout, re.M), p.stdout
    d = strict_json(wf.path("raise_ok.json"))
    check_report(d)
    assert d["summary"].get("crash"), d["summary"]                          # the JSON does not read as healthy
    assert rc_for(d) == 1


def test_08_sigkill_after_the_nan_step_reports_the_bad_step(wf):
    trained(wf, "kill_bad")
    p = wf.res("kill_bad")
    assert p.returncode == 1, p.stdout
    no_traceback(p)
    findings = check_report(strict_json(wf.path("kill_bad.json")))
    assert any(f["step"] == 4 and f["severity"] == "error" for f in findings[:3]), findings[:3]
    assert "healthy" not in p.stdout.lower()
    # the killed process saved no replay; --model replays the capture and names the producer
    q = wf.res("kill_bad_model")
    assert q.returncode == 1, q.stderr
    no_traceback(q)
    findings = check_report(strict_json(wf.path("kill_bad_m.json")))
    assert top3_has(findings, "overflow", "0", 4), findings[:3]


NOT_FINISHED = re.compile(r"did not finish|not finish|unfinished|incomplete|killed|ended (early|abruptly)|"
                          r"did not close|not closed|without (w\.)?close|exit(ed)? (status|code)|SystemExit", re.I)


def _not_reported_healthy(p, d):
    """A run that ended early must not read as a healthy, finished run: no `healthy` verdict, a line saying it did
    not finish, and something above `info` (a finding or the summary's crash) -- the exit code follows from that."""
    no_traceback(p)
    check_report(d)
    assert not re.search(r"^healthy", p.stdout, re.M), p.stdout
    assert NOT_FINISHED.search(p.stdout), p.stdout
    assert any(f["severity"] != "info" for f in d["findings"]) or d["summary"].get("crash"), d["findings"]
    assert p.returncode == rc_for(d) == 1, (p.returncode, p.stdout)


def test_09_sigkill_on_healthy_steps_is_not_a_healthy_run(wf):
    # Contract silent on how to tell; a professional tool records that the run was closed (w.close()/atexit) and
    # treats a run dir without that mark like a crash: "the run did not finish (killed?) after step N".
    trained(wf, "kill_ok")
    _not_reported_healthy(wf.res("kill_ok"), strict_json(wf.path("kill_ok.json")))


def test_10_sys_exit_after_the_nan_step_names_the_overflow(wf):
    trained(wf, "exit_bad")
    p = wf.res("exit_bad")
    assert p.returncode == 1, p.stdout
    no_traceback(p)
    findings = check_report(strict_json(wf.path("exit_bad.json")))
    assert top3_has(findings, "overflow", "0", 4), findings[:3]


def test_11_sys_exit_1_on_healthy_steps_is_not_a_healthy_run(wf):
    # README: a script that ends without w.close() has its last step written "with the exception that ended it";
    # SystemExit(1) is that exception and a non-zero status is a failed run, so it must not read as healthy.
    trained(wf, "exit_ok")
    _not_reported_healthy(wf.res("exit_ok"), strict_json(wf.path("exit_ok.json")))


def test_12_a_script_that_ends_without_close_is_a_finished_healthy_run(wf):
    rd = trained(wf, "healthy")
    assert f"done {rd}" in wf.train["healthy"][0][0].stdout
    p = wf.res("h_default")
    assert p.returncode == 0 and re.search(r"^healthy", p.stdout, re.M), p.stdout
    assert "6 steps" in p.stdout, p.stdout                                  # every step recorded (atexit)
    assert not NOT_FINISHED.search(p.stdout), p.stdout                      # the twin of 9/11: no false alarm


# ========================================================================================== 13-14: reused run dir
def test_13_reused_run_dir_appends_keeps_the_earlier_run_and_reports_the_last(wf):
    # Contract silent (neither refuse nor separate is promised); README/rundir: a run_dir that holds runs is
    # appended to as a new run, nothing lost, and `report` describes the last run. Run 0: 8 steps, run 1: 6 steps.
    rd = trained(wf, "reuse")
    man = strict_json(os.path.join(rd, "manifest.json"))
    assert [r["run"] for r in man["runs"]] == [0, 1]
    b0, b1 = wf.blobs["reuse"]
    assert b0 and b1.startswith(b0) and len(b0) < len(b1)                   # append-only records
    s0, s1 = wf.snaps["reuse"]
    assert s1["replay-0.json"] == s0["replay-0.json"] and "replay-1.json" in s1
    p = wf.res("reuse")
    assert p.returncode == 1, p.stdout
    no_traceback(p)
    d = strict_json(wf.path("reuse.json"))
    findings = check_report(d)
    assert rc_for(d) == 1 and top3_has(findings, "overflow", "0", 4), findings[:3]
    assert "6 steps" in p.stdout, p.stdout                                  # the last run, not run 0 or both
    assert wf.settled("reuse") == s1


def test_14_a_later_run_never_overwrites_an_earlier_runs_capture(wf):
    trained(wf, "reuse")
    s0, s1 = wf.snaps["reuse"]
    caps0 = {k: v for k, v in s0.items() if k.startswith("captures" + os.sep)}
    assert caps0
    assert {k: s1.get(k) for k in caps0} == caps0


# ========================================================================================== 15-16: --rules
def test_15_rules_filter_keeps_the_overflow_the_full_report_names(wf):
    # Contract silent on --rules (README only); a filter narrows the list, it does not change what a rule finds.
    trained(wf, "bad")
    p = wf.res("b_rules")
    no_traceback(p)
    findings = check_report(strict_json(wf.path("b_rules.json")))
    assert all(f["rule"] == "overflow" for f in findings), findings
    assert top3_has(findings, "overflow", "0", 4), findings
    assert p.returncode == 1, p.stdout


def test_16_unknown_rule_ids_are_one_line_exit_2_and_write_nothing(wf):
    trained(wf, "healthy")
    line = error_line(wf.res("rules_bogus"))                               # overflow,bogus,Overflow
    assert "bogus" in line and "Overflow" in line, line                    # ids are exact: no case folding
    assert not os.path.exists(wf.path("nr.json"))
    assert os.listdir(wf.path("cwd_rules")) == []                           # no default reports/ either
    assert wf.settled("healthy") == wf.snaps["healthy"][0]


# ========================================================================================== 17-22: bad input
def test_17_missing_run_dir_is_one_line_exit_2_and_writes_nothing(wf):
    missing = wf.path("runs", "no such run ✓")
    p = wf.cli_now(["report", missing, "--json", "{t}/missing.json"], "cwd_missing")
    line = error_line(p)
    assert "no such run ✓" in line, line
    assert not os.path.exists(missing) and not os.path.exists(wf.path("missing.json"))
    assert os.listdir(wf.path("cwd_missing")) == []


def test_18_newer_format_version_is_one_line_exit_2(wf):
    trained(wf, "healthy")
    line = error_line(wf.res("newer"))
    assert "format" in line.lower() or "version" in line.lower(), line
    assert not os.path.exists(wf.path("v2.json"))
    assert os.listdir(wf.path("cwd_v2")) == []
    assert wf.settled("healthy_v2") == wf.snaps["healthy_v2"][0]


def test_19_spaces_and_unicode_in_every_path(wf):
    rd = trained(wf, "raise_bad")
    assert os.path.isdir(os.path.join(rd, "captures", "4"))               # the watch wrote into "my runs ✓/ëxp 1"
    p = wf.res("raise_bad")                  # relative run path, cwd "cwd ü", --out "rapport é/ñ 1", --json résumé
    assert p.returncode == 1, p.stderr
    no_traceback(p)
    cwd = wf.path("cwd ü")
    assert sorted(os.listdir(cwd)) == ["rapport é", "résumé.json"]
    findings = check_report(strict_json(os.path.join(cwd, "résumé.json")))
    assert top3_has(findings, "overflow", "0", 4), findings[:3]
    html = open(os.path.join(cwd, "rapport é", "ñ 1", "index.html"), encoding="utf-8").read()
    assert "overflow" in html and not re.search(r"""(src|href)\s*=\s*["']https?://""", html)
    assert wf.settled("raise_bad") == wf.snaps["raise_bad"][0]


def test_20_read_only_run_dir(wf):
    trained(wf, "bad")
    if not wf.ro_ok:
        pytest.skip("cannot make a directory read-only here")
    p = wf.res("b_json")                     # test 3's report: made from the read-only dir, outputs elsewhere
    assert p.returncode == 1, p.stderr
    no_traceback(p)
    assert top3_has(strict_json(wf.path("b.json"))["findings"], "overflow", "0", 4)
    for key in ("ro_json_in", "ro_out_in"):  # outputs inside it: refused up front, naming the path
        line = error_line(wf.res(key))
        assert wf.dirs["bad"] in line, line
    assert wf.settled("bad") == wf.snaps["bad"][0]


def test_21_wrong_kind_of_input_is_one_line_exit_2(wf):
    trained(wf, "bad")
    for key in ("b_report_cap", "b_replay_run"):
        p = wf.res(key)
        error_line(p)
        assert p.stdout == "", p.stdout
    assert wf.settled("bad") == wf.snaps["bad"][0]


def test_22_out_naming_the_run_dir_itself_is_refused(wf):
    # the run dir is ampdoctor's, but not a report directory: --out only into new/empty/own-report dirs
    trained(wf, "kill_bad")
    line = error_line(wf.res("kb_out_run"))
    assert "--out" in line, line
    assert wf.settled("kill_bad") == wf.snaps["kill_bad"][0]
