"""The CLI held to docs/CONTRACT.md end to end, on real run directories of failures the CLI files do not build.

An external suite's view: ordinary CPU training loops (fp16 autocast + `torch.amp.GradScaler("cpu")` unless the case
says otherwise, tiny models, 20-60 steps) run under `ampdoctor.watch(model, optimizer=opt, scaler=scaler,
run_dir=RUN)` at the default settings; then `python -m ampdoctor report RUN --json FILE --out DIR` (and `replay
CAPTURE --model clu_models:factory`, the factories in a module under tmp_path on the subprocess's PYTHONPATH) run in
subprocesses from an empty cwd. The CLI files (test_cli_agrees, test_cli_workflows, test_cli_real_runs) overflow the
FIRST Linear with a x1e5 batch, a backward sqrt at 0, clip_before_unscale and a frozen teacher; the failures here
are other ones. Each failure is first proven by the test's own check (forward hooks naming the producer and step,
the scaler's record, the gradients optimizer.step applied, the weights' own bytes); a failing check is a plain
failure. A wrong answer of ampdoctor (rule/module, exit code, a JSON field missing or mistyped, a traceback) raises
WrongAnswer: a strict xfail via `wrong`.

Failing runs (`report` exit 1; every finding's fields as CONTRACT.md lists them, rule ids from its table; the first
finding an error; the rule, with severity error, at the module among the first three; `--out` a self-contained
index.html):
 1. attn_overflow: attention without the 1/sqrt(d) scale; at step 9 a batch of raw sensor readings (x 1000) makes
    q @ kᵀ overflow fp16 inside `attn` (its q/k/v Linears stay finite) -> overflow at `attn`.
 2. std_nan: a hand-written per-row standardisation `enc.0` ((x - mean) / std, no eps); at step 6 a padded row
    of constants gives 0/0 -> nan_origin at `enc.0`.
 3. opt_step_scaled: the loop calls `opt.step()` (SGD) right after `scaler.scale(loss).backward()`, never
    scaler.step/update: every update is 65536x too large -> scaler_misorder (module not applicable).
 4. scale_collapse: raw targets (~3e4) with a `reduction="sum"` MSE: the fp16 backward overflows at every scale
    down to ~2^-5; GradScaler halves 20+ times -> loss_scale_collapse (module not applicable).
 5. half_conv: a Conv1d net `.half()`'d and trained by SGD(momentum) with no scaler: no fp32 master copy, the
    updates round away -> fp16_master_weights at the root ("" or null).
 6. ema_fp16: a mean-teacher net whose EMA copy `ema` is frozen fp16 *parameters* updated by `lerp_(student,
    1e-3)`: the EMA never moves (w + Δw == w) while the student trains -> update_underflow at `ema` (or below).
Healthy runs (exit 0, no warning/error in the JSON): attn with 1/sqrt(d), the standardisation with clean batches,
the conv net with fp32 weights under autocast + GradScaler, the mean teacher with an fp32 EMA.
Replay: `replay RUN/captures/<step> --model clu_models:<factory>` of runs 1 and 2 names the same producer.
Bad input (exit 2, one `ampdoctor: ...` line on stderr, no traceback, no --json/--out written, cwd still empty, the
input untouched): a missing run dir, an empty dir, a steps.jsonl of garbage, `--model` of a module that does not
exist, `--model` of a factory the module lacks.
`--out` (CONTRACT.md: only a new or empty directory or one ampdoctor wrote before): the attn_overflow report again
into its own --out works (exit 1); into a directory holding a user's file, without --force: exit 2, one line, the
directory untouched.

Budget: the 10 trainings run in the pytest process, each run's CLI calls start on a pool of 3 as soon as it is
written (19 CLI calls); ~50 s with -n 0 on 2 cores.

Result when written: 41 pass, 0 xfail (two runs in a row, identical). What ampdoctor said (first findings):
 1. attn_overflow  `overflow` at `attn` step 9 error forward aten::bmm ("finite inputs (max |x| = 1182) gave ±inf"),
    then `skipped_steps` (null) step 9 error. replay of captures/9: the same overflow at `attn` aten::bmm.
 2. std_nan  `nan_origin` at `enc.0` step 6 error forward aten::div ("hit its singular point ... produced NaN"),
    then `skipped_steps` step 6. replay of captures/6: the same.
 3. opt_step_scaled  `scaler_misorder` (null) step 0 error scaler ("optimizer.step() at <file>:<line> was called
    directly on gradients still scaled"), then `update_spike` at `head` step 0 and `nan_origin` at `body` step 1
    backward (the consequences).
 4. scale_collapse  `overflow` (null) step 0 backward ("the gradient reaching the model's output was already inf
    ... with a finite loss"), `overflow` at `head` step 16 backward, `loss_scale_collapse` at `head` step 0 error
    ("skipped 22 steps in a row and the scale fell from 65536 to 0.0156").
 5. half_conv  `fp16_master_weights` at "" step 0 error, then `update_underflow` at `conv` (91%) and `underflow` at
    `conv` backward.
 6. ema_fp16  `update_underflow` at `ema` step 1 error optimizer ("written in place outside the optimizer ... 100%").
 Healthy runs: exit 0, no findings at all. Every finding had every CONTRACT.md field with its type; every --out
 index.html loads nothing but data: URIs. Bad input, one line each, exit 2, nothing written:
 "<dir>: no such run directory"; "<dir>: not an ampdoctor run directory (no manifest.json); pass the run_dir given
 to ampdoctor.watch"; "<dir>/steps.jsonl: no readable record (20 corrupt line(s)); not written by
 ampdoctor.watch?"; "cannot import 'clu_no_such_pkg.models' for --model ...: ModuleNotFoundError: ..."; "--model
 'clu_models:no_such_factory': module 'clu_models' has no attribute 'no_such_factory'".
"""
from __future__ import annotations

import concurrent.futures
import glob
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import ampdoctor
from probe_harness import (Producer, WrongAnswer, error_line, load_models, misuse_net, run_cli, snapshot,
                           stderr_lines, strict_json, wrong)
from scenarios import randn

MODELS = '''
import copy
import torch
from torch import nn
import torch.nn.functional as F


class Attn(nn.Module):
    def __init__(self, d=32, scaled=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.scale = d ** -0.5 if scaled else 1.0

    def forward(self, h):
        s = (self.q(h) * self.scale) @ self.k(h).transpose(-1, -2)
        return torch.softmax(s, -1) @ self.v(h)


class AttnNet(nn.Module):
    def __init__(self, scaled=False):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.attn = Attn(32, scaled)
        self.head = nn.Linear(32, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.attn(self.embed(x))).mean(1).float(), y)


def attn_net():
    torch.manual_seed(0)
    return AttnNet()


def attn_net_scaled():
    torch.manual_seed(0)
    return AttnNet(scaled=True)


class Standardize(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class StdNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(Standardize(), nn.Linear(16, 32), nn.GELU())
        self.head = nn.Linear(32, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.enc(x)).float(), y)


def std_net():
    torch.manual_seed(0)
    return StdNet()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean(-1))


def conv_net():
    torch.manual_seed(0)
    return ConvNet()


class EmaNet(nn.Module):
    def __init__(self, ema_dtype=torch.float16):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.ema = copy.deepcopy(self.student).to(ema_dtype).requires_grad_(False)

    def forward(self, x):
        return self.student(x), self.ema(x)


def ema_net():
    torch.manual_seed(0)
    return EmaNet()
'''

RULES = {"overflow", "nan_origin", "overflow_risk", "underflow", "loss_scale_collapse", "skipped_steps",
         "clip_before_unscale", "scaler_misorder", "missing_scaler_update", "update_underflow", "fp16_master_weights",
         "mask_value_overflow", "eps_underflow", "precision_loss", "env_tf32", "headroom_trend", "update_spike",
         "deprecated_api", "replay_error"}
SEVERITIES = {"error", "warning", "info"}
PHASES = {"forward", "backward", "optimizer", "scaler", "env", None}
FIELDS = ("rule", "severity", "phase", "module", "op", "step", "message", "fix", "evidence")

FAILING = ("attn_overflow", "std_nan", "opt_step_scaled", "scale_collapse", "half_conv", "ema_fp16")
HEALTHY = ("attn_ok", "std_ok", "conv_ok", "ema_ok")
ANY = object()      # the rule names no module: not checked
# kind -> (rules, module or a tuple of accepted modules / ANY, prefix: a module under it counts too)
EXPECT = {
    "attn_overflow": (("overflow",), ("attn",), False),
    "std_nan": (("nan_origin",), ("enc.0",), False),
    "opt_step_scaled": (("scaler_misorder",), ANY, False),
    "scale_collapse": (("loss_scale_collapse",), ANY, False),
    "half_conv": (("fp16_master_weights",), ("", None), False),
    "ema_fp16": (("update_underflow",), ("ema",), True),
}


def bad(cond, msg):
    """A wrong answer of ampdoctor's."""
    if not cond:
        raise WrongAnswer(msg)


# ---------------------------------------------------------------- the training loops (the test's own record)

def amp_train(m, batch, steps, rd, *, opt, oracle=False, order="normal", loss_fn=None, after=None,
              autocast=True, scaler=True):
    """zero_grad -> fp16 autocast forward -> loss -> scale(loss).backward -> unscale_ -> step -> update under
    ampdoctor.watch; `order="opt_step"`: opt.step() right after the scaled backward (no scaler.step/update).
    Returns the record: losses, scale before each step, skipped steps, the oracle's first producer."""
    sc = torch.amp.GradScaler("cpu") if scaler else None
    prod = Producer(m) if oracle else None
    rec = {"loss": [], "scale": [], "skipped": [], "grad_ratio": None}
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=str(rd))
    try:
        for i in range(steps):
            if prod:
                prod.new_step(i)
            args = batch(i)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                out = m(*args[:-1]) if loss_fn else m(*args)
                loss = loss_fn(out, args[-1]) if loss_fn else out
            rec["loss"].append(float(loss.detach()))
            if sc is None:
                loss.backward()
                opt.step()
            elif order == "opt_step":
                if i == 0:      # the true (unscaled) gradient, to compare with what opt.step applies
                    ps = [p for p in m.parameters() if p.requires_grad]
                    true = torch.autograd.grad(loss, ps, retain_graph=True)
                sc.scale(loss).backward()
                if i == 0:
                    rec["grad_ratio"] = float(torch.stack([p.grad.float().norm() for p in ps]).norm()
                                              / torch.stack([t.float().norm() for t in true]).norm())
                rec["scale"].append(sc.get_scale())
                opt.step()
            else:
                s0 = sc.get_scale()
                rec["scale"].append(s0)
                sc.scale(loss).backward()
                sc.unscale_(opt)
                sc.step(opt)
                sc.update()
                if sc.get_scale() < s0:
                    rec["skipped"].append(i)
            if after:
                after(i, m)
    finally:
        if prod:
            prod.remove()
        w.close()
    rec["first"] = prod.first if prod else None
    return rec


def sensor_batch(i, bad_step=None):
    x = randn(4, 6, 8, seed=100 + i % 5)
    y = x.mean((1, 2)).unsqueeze(-1) * 0.5
    if i == bad_step:
        x = x * 1000.0          # raw, unnormalised readings
    return x, y


def std_batch(i, bad_step=None):
    x = randn(16, 16, seed=200 + i % 5) * 2 + 1
    y = x[:, :4].sum(-1, keepdim=True) * 0.1
    if i == bad_step:
        x = x.clone()
        x[3] = 1.0              # a padded row of constants
    return x, y


def conv_batch(i, half=False):
    x = randn(16, 4, 12, seed=300 + i % 4)
    y = x[:, 0].mean(-1, keepdim=True) - x[:, 2].mean(-1, keepdim=True)
    return (x.half(), y.half()) if half else (x, y)


MW = randn(8, 1, seed=999) * 0.5


def reg_batch(i, raw=False, n=16):
    x = randn(n, 8, seed=400 + i % 4)
    y = x @ MW
    return (x, y * 100 + 3e4) if raw else (x, y)


def train_kind(kind, mods, rd):
    """Build, train and record one kind; returns (record, model)."""
    if kind in ("attn_overflow", "attn_ok"):
        m = mods.attn_net() if kind == "attn_overflow" else mods.attn_net_scaled()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        bs = 9 if kind == "attn_overflow" else None
        rec = amp_train(m, lambda i: sensor_batch(i, bs), 20 if bs else 30, rd, opt=opt, oracle=True)
    elif kind in ("std_nan", "std_ok"):
        m = mods.std_net()
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        bs = 6 if kind == "std_nan" else None
        rec = amp_train(m, lambda i: std_batch(i, bs), 20 if bs else 30, rd, opt=opt, oracle=True)
    elif kind == "opt_step_scaled":
        m = misuse_net()
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        rec = amp_train(m, lambda i: reg_batch(i), 20, rd, opt=opt, order="opt_step", loss_fn=F.mse_loss)
    elif kind == "scale_collapse":
        m = misuse_net()
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        rec = amp_train(m, lambda i: reg_batch(i, raw=True, n=64), 40, rd, opt=opt,
                        loss_fn=lambda o, y: F.mse_loss(o.float(), y, reduction="sum"))
    elif kind == "half_conv":
        m = mods.conv_net().half()
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        before = {}

        def after(i, m):
            if i in (29, 39):
                before[i] = [p.detach().clone() for p in m.parameters()]
        rec = amp_train(m, lambda i: conv_batch(i, half=True), 40, rd, opt=opt, loss_fn=F.mse_loss,
                        autocast=False, scaler=False, after=after)
        rec["moved"] = [float((a != b).float().mean()) for a, b in zip(before[29], before[39])]
        rec["opt_dtypes"] = {p.dtype for g in opt.param_groups for p in g["params"]}
    elif kind == "conv_ok":
        m = mods.conv_net()
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        rec = amp_train(m, lambda i: conv_batch(i), 40, rd, opt=opt, loss_fn=F.mse_loss)
    elif kind in ("ema_fp16", "ema_ok"):
        m = mods.ema_net()
        if kind == "ema_ok":
            m.ema.float()
        opt = torch.optim.AdamW(m.student.parameters(), lr=3e-3)
        init = [p.detach().clone() for p in m.ema.parameters()]
        s_init = [p.detach().clone() for p in m.student.parameters()]

        def after(i, m):
            with torch.no_grad():
                for e, s in zip(m.ema.parameters(), m.student.parameters()):
                    e.lerp_(s.to(e.dtype), 1e-4)

        def loss_fn(o, y):
            s, e = o
            return F.mse_loss(s.float(), y) + 0.1 * F.mse_loss(s.float(), e.detach().float())
        rec = amp_train(m, lambda i: reg_batch(i), 40, rd, opt=opt, loss_fn=loss_fn, after=after)
        rec["ema_unchanged"] = float(torch.cat([(p == q).flatten() for p, q in zip(m.ema.parameters(), init)])
                                     .float().mean())
        rec["student_moved"] = float(torch.cat([(p != q).flatten() for p, q in zip(m.student.parameters(), s_init)])
                                     .float().mean())
        # what an fp32 EMA would have done with the same student path: its drift from the start
        rec["ema_dtype"] = next(m.ema.parameters()).dtype
    else:
        raise KeyError(kind)
    return rec, m


# ---------------------------------------------------------------- one fixture: train everything, run every CLI call

def _cli_report(helpers, rd, d):
    d.mkdir()
    (d / "cwd").mkdir()
    p = run_cli(helpers, "report", rd, "--json", d / "r.json", "--out", d / "html", cwd=d / "cwd")
    return {"p": p, "json": d / "r.json", "out": d / "html", "cwd": d / "cwd"}


def _cli_report_and_out_rules(helpers, rd, d):
    """The report, then (CONTRACT.md's --out rule) the same call again into the --out directory ampdoctor wrote,
    and once into a directory holding a user's file (without --force)."""
    r = _cli_report(helpers, rd, d)
    (d / "cwd2").mkdir()
    r["again"] = run_cli(helpers, "report", rd, "--out", d / "html", cwd=d / "cwd2")
    foreign = d / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("my notes\n")
    (d / "cwd3").mkdir()
    r["foreign_before"] = snapshot(foreign)
    r["foreign"] = run_cli(helpers, "report", rd, "--out", foreign, cwd=d / "cwd3")
    r["foreign_after"] = snapshot(foreign)
    r["cwd3"] = d / "cwd3"
    return r


def _cli_replay(helpers, cap, factory, d):
    d.mkdir()
    (d / "cwd").mkdir()
    before = snapshot(cap)
    p = run_cli(helpers, "replay", cap, "--model", f"clu_models:{factory}", "--json", d / "r.json", "--out",
                d / "html", cwd=d / "cwd")
    return {"p": p, "json": d / "r.json", "out": d / "html", "cwd": d / "cwd", "cap": cap, "before": before,
            "after": snapshot(cap)}


def _cli_bad(helpers, args, guard, d):
    d.mkdir()
    (d / "cwd").mkdir()
    before = snapshot(*guard)
    p = run_cli(helpers, *args, "--json", d / "r.json", "--out", d / "html", cwd=d / "cwd")
    return {"p": p, "json": d / "r.json", "out": d / "html", "cwd": d / "cwd", "before": before,
            "after": snapshot(*guard)}


def _captures(rd):
    caps = [c for c in glob.glob(os.path.join(rd, "captures", "*")) if os.path.isdir(c)]
    return sorted(caps, key=lambda c: (not os.path.basename(c).isdigit(),
                                       int(os.path.basename(c)) if os.path.basename(c).isdigit() else 0, c))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("clu")
    helpers_dir = root / "helpers"
    helpers_dir.mkdir()
    mods = load_models(helpers_dir, "clu_models", MODELS)
    helpers = {"dir": str(helpers_dir)}
    runs, recs, futs = root / "runs", {}, {}
    runs.mkdir()
    out = root / "cli"
    out.mkdir()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for kind in FAILING + HEALTHY:
            rd = runs / kind
            recs[kind] = train_kind(kind, mods, rd)[0]
            fn = _cli_report_and_out_rules if kind == "attn_overflow" else _cli_report
            futs[("report", kind)] = pool.submit(fn, helpers, str(rd), out / f"report-{kind}")
            if kind in ("attn_overflow", "std_nan"):
                caps = _captures(str(rd))
                recs[kind]["captures"] = caps
                if caps:
                    fac = {"attn_overflow": "attn_net", "std_nan": "std_net"}[kind]
                    futs[("replay", kind)] = pool.submit(_cli_replay, helpers, caps[0], fac, out / f"replay-{kind}")
        # bad input
        missing = root / "no-such-run"
        empty = root / "empty-run"
        empty.mkdir()
        corrupt = root / "corrupt-run"
        shutil.copytree(runs / "std_ok", corrupt)
        with open(corrupt / "steps.jsonl", "wb") as f:
            f.write(b"\x00\xff\xfe not json {{{ \x89PNG\r\n" * 20)
        cap = (recs["attn_overflow"].get("captures") or [str(runs / "attn_overflow")])[0]
        badcases = {
            "missing_run_dir": (("report", missing), [root]),
            "empty_dir": (("report", empty), [empty]),
            "corrupt_steps": (("report", corrupt), [corrupt]),
            "unknown_model_module": (("replay", cap, "--model", "clu_no_such_pkg.models:factory"), [cap]),
            "unknown_model_factory": (("replay", cap, "--model", "clu_models:no_such_factory"), [cap]),
        }
        for name, (args, guard) in badcases.items():
            futs[("bad", name)] = pool.submit(_cli_bad, helpers, args, guard if name != "missing_run_dir" else
                                              [missing], out / f"bad-{name}")
        res = {k: f.result() for k, f in futs.items()}
    return {"recs": recs, "res": res, "root": root}


# ---------------------------------------------------------------- checks of a CLI answer

def finding_schema(f, i):
    """Every field CONTRACT.md lists, with its type (WrongAnswer otherwise)."""
    bad(isinstance(f, dict), f"finding {i} is not an object: {f!r}")
    missing = [k for k in FIELDS if k not in f]
    bad(not missing, f"finding {i} lacks {missing}: {f}")
    bad(f["rule"] in RULES, f"finding {i}: rule {f['rule']!r} not in CONTRACT.md's table")
    bad(f["severity"] in SEVERITIES, f"finding {i}: severity {f['severity']!r}")
    bad(f["phase"] in PHASES, f"finding {i}: phase {f['phase']!r}")
    bad(f["module"] is None or isinstance(f["module"], str), f"finding {i}: module {f['module']!r}")
    bad(f["op"] is None or isinstance(f["op"], str) and f["op"].startswith("aten::"), f"finding {i}: op {f['op']!r}")
    bad(f["step"] is None or type(f["step"]) is int and f["step"] >= 0, f"finding {i}: step {f['step']!r}")
    bad(isinstance(f["message"], str) and f["message"].strip(), f"finding {i}: message {f['message']!r}")
    bad(isinstance(f["fix"], str), f"finding {i}: fix {f['fix']!r}")
    bad(isinstance(f["evidence"], dict), f"finding {i}: evidence {f['evidence']!r}")


def cli_json(r, code):
    """The CLI call exited `code`, no traceback, and wrote strict JSON of the contract's shape; the findings."""
    p = r["p"]
    bad("Traceback" not in p.stderr, f"traceback: {p.stderr[-1500:]}")
    bad(p.returncode == code, f"exit {p.returncode}, not {code}; stderr {stderr_lines(p)[-3:]}; "
                              f"stdout {p.stdout[-600:]!r}")
    bad(os.path.isfile(r["json"]), "no --json file")
    try:
        d = strict_json(r["json"])
    except ValueError as e:
        raise WrongAnswer(f"--json not strict JSON: {e}")
    bad(isinstance(d, dict) and isinstance(d.get("findings"), list) and isinstance(d.get("summary"), dict),
        f"top level {sorted(d) if isinstance(d, dict) else type(d)}")
    for i, f in enumerate(d["findings"]):
        finding_schema(f, i)
    return d["findings"]


def short(fs, n=3):
    return [(f.get("rule"), f.get("module"), f.get("step"), f.get("severity")) for f in fs[:n]]


def module_ok(got, want, prefix):
    if want is ANY:
        return True
    return got in want or prefix and isinstance(got, str) and any(got.startswith(w + ".") for w in want if w)


def html_self_contained(r):
    idx = os.path.join(r["out"], "index.html")
    bad(os.path.isfile(idx), f"no index.html under --out: {os.listdir(r['out']) if os.path.isdir(r['out']) else []}")
    html = open(idx, encoding="utf-8").read()
    bad("<html" in html.lower() and len(html) > 500, "index.html is not a page")
    srcs = re.findall(r"""\bsrc\s*=\s*["']([^"']*)["']""", html)
    bad(all(s.startswith("data:") for s in srcs), f"index.html loads files: {[s for s in srcs if not s.startswith('data:')][:5]}")
    links = re.findall(r"""<link\b[^>]*href\s*=\s*["']([^"']*)["']""", html, re.I)
    bad(all(s.startswith("data:") for s in links), f"index.html links files: {links[:5]}")
    bad(not re.search(r"""(src|href)\s*=\s*["']https?://""", html), "index.html reaches the network")
    bad(not re.search(r"@import\s+url|url\(\s*['\"]?https?://", html), "index.html's CSS reaches out")


# ---------------------------------------------------------------- the failing runs

def test_the_failure_is_real_attn_overflow(world):
    r = world["recs"]["attn_overflow"]
    assert r["first"] == ("attn", 9), r["first"]
    assert all(abs(v) < float("inf") for v in r["loss"][:9]), r["loss"]
    assert not abs(r["loss"][9]) < float("inf"), r["loss"]       # inf or NaN at step 9
    assert 9 in r["skipped"], r["skipped"]


def test_the_failure_is_real_std_nan(world):
    r = world["recs"]["std_nan"]
    assert r["first"] == ("enc.0", 6), r["first"]
    assert r["loss"][6] != r["loss"][6] and all(v == v for v in r["loss"][:6]), r["loss"]
    assert 6 in r["skipped"], r["skipped"]


def test_the_failure_is_real_opt_step_scaled(world):
    r = world["recs"]["opt_step_scaled"]
    assert r["scale"][0] == 65536.0 and abs(r["grad_ratio"] / 65536.0 - 1) < 0.02, (r["grad_ratio"], r["scale"][:2])


def test_the_failure_is_real_scale_collapse(world):
    r = world["recs"]["scale_collapse"]
    assert len(r["skipped"]) >= 15 and r["scale"][-1] <= 65536.0 / 2 ** 15, (r["skipped"], r["scale"][-5:])
    assert all(v == v for v in r["loss"]), r["loss"]


def test_the_failure_is_real_half_conv(world):
    r = world["recs"]["half_conv"]
    assert r["opt_dtypes"] == {torch.float16}, r["opt_dtypes"]
    # over ten late steps, most of the conv weight's elements never moved (the updates rounded away)
    assert r["moved"][0] < 0.5, r["moved"]


def test_the_failure_is_real_ema_fp16(world):
    r = world["recs"]["ema_fp16"]
    assert r["ema_dtype"] == torch.float16
    assert r["ema_unchanged"] > 0.8 and r["student_moved"] > 0.9, (r["ema_unchanged"], r["student_moved"])
    ok = world["recs"]["ema_ok"]
    assert ok["ema_unchanged"] < 0.1, ok["ema_unchanged"]      # the fp32 EMA moves under the same updates


XF_EXIT = {}
XF_RULE = {}
XF_HTML = {}


def _p(kinds, xfs):
    return [pytest.param(k, marks=wrong(xfs[k])) if k in xfs else k for k in kinds]


@pytest.mark.parametrize("kind", _p(FAILING, XF_EXIT))
def test_failing_run_report_exit_1_and_schema(world, kind):
    fs = cli_json(world["res"][("report", kind)], 1)
    bad(fs and fs[0]["severity"] == "error", f"first finding is not an error: {short(fs)}")


@pytest.mark.parametrize("kind", _p(FAILING, XF_RULE))
def test_failing_run_names_the_cause_in_top3(world, kind):
    r = world["res"][("report", kind)]
    bad(os.path.isfile(r["json"]), f"no JSON; exit {r['p'].returncode}: {stderr_lines(r['p'])[-3:]}")
    fs = strict_json(r["json"])["findings"]
    rules, mod, prefix = EXPECT[kind]
    hit = [f for f in fs[:3] if f.get("rule") in rules and module_ok(f.get("module"), mod, prefix)]
    bad(hit, f"{rules} at {mod} not in the top 3: {short(fs)}")
    bad(any(f["severity"] == "error" for f in hit), f"not an error: {short(hit)}")
    if kind in ("attn_overflow", "std_nan"):
        step = {"attn_overflow": 9, "std_nan": 6}[kind]
        bad(any(f.get("step") == step and f.get("phase") in ("forward", None) for f in hit),
            f"not at step {step} forward: {[(f['step'], f['phase']) for f in hit]}")


@pytest.mark.parametrize("kind", _p(FAILING, XF_HTML))
def test_failing_run_out_writes_self_contained_html(world, kind):
    html_self_contained(world["res"][("report", kind)])


XF_OUT = {}


@pytest.mark.parametrize("case", _p(("ampdoctors_own_dir", "a_users_dir"), XF_OUT))
def test_out_writes_only_where_the_contract_allows(world, case):
    r = world["res"][("report", "attn_overflow")]
    if case == "ampdoctors_own_dir":
        p = r["again"]
        bad("Traceback" not in p.stderr and p.returncode == 1,
            f"exit {p.returncode} re-writing its own --out: {stderr_lines(p)[-3:]}")
        html_self_contained(r)
    else:
        p = r["foreign"]
        try:
            error_line(p)
        except AssertionError as e:
            raise WrongAnswer(str(e)[:1500])
        bad(r["foreign_before"] == r["foreign_after"], "the user's directory changed")
        bad(not os.listdir(r["cwd3"]), f"cwd got {os.listdir(r['cwd3'])}")


# ---------------------------------------------------------------- the healthy runs

@pytest.mark.parametrize("kind", HEALTHY)
def test_the_healthy_run_is_real(world, kind):
    r = world["recs"][kind]
    ls = r["loss"]
    assert all(v == v and abs(v) < float("inf") for v in ls), ls
    n = len(ls) // 3
    assert sum(ls[-n:]) / n < 0.9 * sum(ls[:n]) / n, ls
    assert all(s < 5 for s in r["skipped"]), r["skipped"]       # only GradScaler's first backoffs
    if r.get("first") is not None:
        pytest.fail(f"a producer: {r['first']}")


XF_HEALTHY = {}


@pytest.mark.parametrize("kind", _p(HEALTHY, XF_HEALTHY))
def test_healthy_run_report_exit_0_quiet(world, kind):
    r = world["res"][("report", kind)]
    fs = cli_json(r, 0)
    loud = [f for f in fs if f["severity"] in ("warning", "error")]
    bad(not loud, f"alarms on a healthy run: {short(loud, 5)}")
    html_self_contained(r)


# ---------------------------------------------------------------- replay of a failing run's capture

XF_REPLAY = {}


@pytest.mark.parametrize("kind", _p(("attn_overflow", "std_nan"), XF_REPLAY))
def test_replay_of_the_capture_names_the_same_producer(world, kind):
    caps = world["recs"][kind]["captures"]
    assert caps, "the run wrote no capture (CONTRACT.md: a run_dir watch writes one on the first bad step)"
    r = world["res"][("replay", kind)]
    fs = cli_json(r, 1)
    rules, mod, _ = EXPECT[kind]
    bad(any(f["rule"] in rules and f["module"] in mod for f in fs[:3]), f"{rules} at {mod} not in top 3: {short(fs)}")
    assert r["before"] == r["after"], "replay changed the capture"
    html_self_contained(r)


# ---------------------------------------------------------------- bad input

XF_BAD = {}


@pytest.mark.parametrize("name", _p(("missing_run_dir", "empty_dir", "corrupt_steps", "unknown_model_module",
                                     "unknown_model_factory"), XF_BAD))
def test_bad_input_exit_2_one_line_nothing_written(world, name):
    r = world["res"][("bad", name)]
    p = r["p"]
    try:
        line = error_line(p)
    except AssertionError as e:
        raise WrongAnswer(str(e)[:1500])
    bad(len(line) < 400, f"not one short line: {line!r}")
    bad(not os.path.exists(r["json"]), f"--json written: {line}")
    bad(not os.path.exists(r["out"]), f"--out written: {line}")
    bad(not os.listdir(r["cwd"]), f"cwd got {os.listdir(r['cwd'])}")
    bad(r["before"] == r["after"], "the input changed")
