"""A fresh audit of docs/CONTRACT.md, driven only through its public interface (`import ampdoctor`, and
`python -m ampdoctor ...` in subprocesses): the promises tests/test_contract.py and tests/test_cli*.py leave out.

Runs (module fixtures, shared): a tiny MLP (Linear(8,16) -> ReLU -> Linear(16,1)), fp16 CPU autocast,
`torch.amp.GradScaler("cpu")`, SGD, 8 steps, default `every`; BAD multiplies step 5's batch by 1e5 (the first
Linear, module "0", overflows fp16; an independent forward hook confirms it), GOOD trains unchanged; a 2-rank gloo
run (torch.distributed.run) whose rank 1 overflows at step 3; ~25 CLI calls on a small pool.

Checked:
 - API signatures: watch(model, optimizer=None, scaler=None, run_dir=None, *, every=...), replay(capture,
   model=None, loss_fn=None), save_batch(path, model, *args, **kwargs), diagnose(run_dir); watch returns a Watch.
 - close() removes every hook and patch (module/optimizer/global hooks, scaler/optimizer/clip/backward functions),
   is idempotent, and the `with` block does the same.
 - report() -> Report of Finding; diagnose(run_dir) gives the same findings as w.report() (bad and good runs).
 - Finding attributes/JSON keys and types on every finding seen here (rule ids from the table, severities, phases,
   module names from named_modules() or null, op `aten::...` or null, step int >= 0 or null, evidence a dict),
   Finding.to_dict() == the report's entry; Report.to_dict() strict JSON; save_json round-trips; save_html is one
   self-contained file; findings ordered (the root cause first, no `info` before an error/warning).
 - Default `every`: the unsampled bad step 5 is named (overflow, "0", step 5, error; step boundaries found without a
   call); a healthy run has no error/warning and its scaler backoffs are `info` `skipped_steps`; `every=1` works
   and without run_dir nothing is written to disk.
 - Captures under run_dir/captures/ (one of them replays to the overflow); replay(model=...) loads the capture's
   weights into a fresh model; loss_fn gets (output, *args, **kwargs); scalar / `.loss` outputs need no loss_fn;
   replay(model=None) rebuilds a Hugging Face model from its config.
 - Rule table: clip_before_unscale, scaler_misorder (with evidence.sequence), missing_scaler_update,
   deprecated_api (`info`), and each such finding's `op` is an ATen op name or null.
 - Distributed: run_dir/rank-<r>/ per rank, diagnose merges, every finding's evidence has `rank`.
 - CLI: report/replay exit 0/1 agree with the JSON's error findings; --json; --out writes index.html plus the plots
   (self-contained), default reports/<name>/ for report and replay, replay --out refuses a foreign dir (exit 2, kept)
   and --force overrides; --tensorboard event files readable with EventAccumulator (per-step scalars); subcommand
   --help lists the contract's flags; 16 bad inputs (bad --model/--loss specs, raising or mismatching factory, no
   model for a non-HF capture, wrong kind of path, truncated capture, a pickle planted in a capture, unknown flag,
   missing flag value / argument) each exit 2 with one `ampdoctor: ` line, no traceback, the --json file and the
   inputs untouched, and no code from the capture executed.

Result when written: 53 checks (test items): 50 pass, 3 strict xfail (`wrong`): the `op` field of the
clip_before_unscale / scaler_misorder / missing_scaler_update findings held a Python API name
('torch.nn.utils.clip_grad_norm_', 'GradScaler.update', 'GradScaler.step') where the contract allows only an ATen op
name or null. Fixed since: those rules give op=null and the API call in `evidence.api`; 53 pass.
"""
import concurrent.futures
import functools
import importlib
import inspect
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import types
import warnings

import pytest
import torch

import ampdoctor
from probe_harness import WrongAnswer, snapshot, stderr_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
RULES = {"overflow", "nan_origin", "overflow_risk", "underflow", "loss_scale_collapse", "skipped_steps",
         "clip_before_unscale", "scaler_misorder", "missing_scaler_update", "update_underflow",
         "fp16_master_weights", "mask_value_overflow", "eps_underflow", "precision_loss", "env_tf32",
         "headroom_trend", "update_spike", "deprecated_api", "replay_error"}
KEYS = ["rule", "severity", "phase", "module", "op", "step", "message", "fix", "evidence"]
PHASES = {"forward", "backward", "optimizer", "scaler", "env", None}
SEV = {"error", "warning", "info"}
BAD_STEP, STEPS = 5, 8

MODELS_SRC = '''
import torch
def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
def other():
    return torch.nn.Linear(3, 3)
def boom():
    raise ValueError("factory exploded")
def loss(out, *args, **kwargs):
    return out.float().pow(2).mean()
'''

DIST_SRC = '''
import sys, torch, torch.distributed as dist, ampdoctor
dist.init_process_group("gloo"); r = dist.get_rank()
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
ddp = torch.nn.parallel.DistributedDataParallel(m)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-2); sc = torch.amp.GradScaler("cpu", init_scale=256.0)
g = torch.Generator().manual_seed(10 + r)
with ampdoctor.watch(ddp, optimizer=opt, scaler=sc, run_dir=sys.argv[1]):
    for i in range(6):
        x = torch.randn(4, 8, generator=g) * (1e5 if (i == 3 and r == 1) else 1.0)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ddp(x).float().pow(2).mean()
        sc.scale(loss).backward(); sc.step(opt); sc.update()
dist.destroy_process_group()
'''


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def train(run_dir=None, spike=None, every=None):
    """The user's loop; returns (watch, model, steps the scaler skipped, the first Linear's per-step finiteness)."""
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu")
    seen = []
    h = m[0].register_forward_hook(lambda mod, i, o: seen.append(bool(torch.isfinite(o).all())))
    kw = {} if every is None else {"every": every}
    g = torch.Generator().manual_seed(1)
    skipped = []
    with ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir, **kw) as w:
        for i in range(STEPS):
            x = torch.randn(4, 8, generator=g) * (1e5 if i == spike else 1.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            s0 = sc.get_scale()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                skipped.append(i)
        h.remove()
    return w, m, skipped, seen


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, cwd, extra_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, extra_path]), OMP_NUM_THREADS="1")
    return subprocess.run([PY, "-m", "ampdoctor", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


# ------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("audit_runs")
    d = {"base": base}
    d["bad_dir"], d["good_dir"] = base / "bad", base / "good"
    d["bad"], d["bad_model"], d["bad_skipped"], d["bad_seen"] = train(d["bad_dir"], spike=BAD_STEP)
    d["good"], d["good_model"], d["good_skipped"], _ = train(d["good_dir"])
    mem = base / "mem_cwd"
    mem.mkdir()
    old = os.getcwd()
    os.chdir(mem)
    try:
        d["every1"] = train(None, spike=BAD_STEP, every=1)[0]
    finally:
        os.chdir(old)
    d["mem_cwd"] = mem
    caps = sorted((d["bad_dir"] / "captures").iterdir())
    d["caps"] = caps
    d["cap_reports"] = {c.name: ampdoctor.replay(str(c), model=mlp()) for c in caps}
    d["cap"] = next(c for c in caps if any(f.rule == "overflow" and f.module == "0"
                                           for f in d["cap_reports"][c.name].findings))
    gcaps = sorted((d["good_dir"] / "captures").iterdir()) if (d["good_dir"] / "captures").is_dir() else []
    if not gcaps:   # the healthy run's scaler never skipped: capture one of its batches by hand
        ampdoctor.save_batch(str(base / "good_cap"), d["good_model"], torch.randn(4, 8))
        gcaps = [base / "good_cap"]
    d["good_cap"] = gcaps[0]
    return d


@pytest.fixture(scope="module")
def clirun(runs, tmp_path_factory):
    """Every CLI call (and the 2-rank distributed run) on a pool; {name: (CompletedProcess, ctx)}."""
    t = tmp_path_factory.mktemp("audit_cli")
    (t / "mods_audit.py").write_text(MODELS_SRC)
    (t / "dist_audit.py").write_text(DIST_SRC)
    bad, good, cap, gcap = runs["bad_dir"], runs["good_dir"], runs["cap"], runs["good_cap"]
    calls = {}

    def add(name, *args, guard=(), **ctx):
        cwd = t / ("cwd_" + name)
        cwd.mkdir()
        calls[name] = (args, cwd, dict(ctx, guard=list(guard)))

    add("report_bad", "report", bad, "--out", t / "o_bad", "--json", t / "bad.json", "--tensorboard", t / "tb")
    add("report_good", "report", good, "--out", t / "o_good", "--json", t / "good.json")
    add("replay_bad", "replay", cap, "--model", "mods_audit:mlp", "--loss", "mods_audit:loss",
        "--out", t / "o_rbad", "--json", t / "rbad.json")
    add("replay_good", "replay", gcap, "--model", "mods_audit:mlp", "--out", t / "o_rgood",
        "--json", t / "rgood.json")
    add("report_default_out", "report", bad)
    add("replay_default_out", "replay", cap, "--model", "mods_audit:mlp")
    foreign = t / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    add("replay_foreign", "replay", cap, "--model", "mods_audit:mlp", "--out", foreign, guard=[foreign])
    forced = t / "forced"
    forced.mkdir()
    (forced / "notes.txt").write_text("mine")
    add("replay_force", "replay", cap, "--model", "mods_audit:mlp", "--out", forced, "--force")
    add("help_report", "report", "--help")
    add("help_replay", "replay", "--help")

    # bad inputs: each with a --json file that must survive
    trunc = t / "trunc_cap"
    planted = t / "planted_cap"
    import shutil
    for dst in (trunc, planted):
        shutil.copytree(cap, dst)
    sf = trunc / "state.safetensors"
    sf.write_bytes(sf.read_bytes()[: sf.stat().st_size // 2])
    marker = t / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    payload = pickle.dumps(Evil())
    for n in ("state.safetensors", "tensors.safetensors"):
        (planted / n).write_bytes(payload)
    torch.save({"x": 1}, planted / "extra.pt")
    (planted / "extra.pkl").write_bytes(payload)
    a_file = t / "a_file.txt"
    a_file.write_text("x")
    bad_cases = {
        "model_no_colon": ("replay", cap, "--model", "mods_audit"),
        "model_no_module": ("replay", cap, "--model", "nosuch_mod_audit:mlp"),
        "model_no_attr": ("replay", cap, "--model", "mods_audit:nope"),
        "model_raises": ("replay", cap, "--model", "mods_audit:boom"),
        "model_mismatch": ("replay", cap, "--model", "mods_audit:other"),
        "loss_no_attr": ("replay", cap, "--model", "mods_audit:mlp", "--loss", "mods_audit:nope"),
        "no_model_plain_capture": ("replay", cap),
        "replay_a_file": ("replay", a_file, "--model", "mods_audit:mlp"),
        "replay_a_run_dir": ("replay", bad, "--model", "mods_audit:mlp"),
        "report_a_capture": ("report", cap),
        "report_a_file": ("report", a_file),
        "truncated_capture": ("replay", trunc, "--model", "mods_audit:mlp"),
        "pickle_capture": ("replay", planted, "--model", "mods_audit:mlp"),
        "unknown_flag": ("report", bad, "--bogus-flag"),
        "missing_value": ("replay", cap, "--model"),
        "missing_capture": ("replay",),
    }
    for name, args in bad_cases.items():
        guard = t / f"guard_{name}.json"
        guard.write_text("keep")
        add("bad_" + name, *args, "--json", guard, guard=[guard, bad, cap, a_file, trunc, planted],
            json_guard=guard)
    # argparse: a flag after a missing value would be swallowed differently; keep the missing value last
    calls["bad_missing_value"] = (("replay", cap, "--json", t / "guard_missing_value.json", "--model"),
                                  calls["bad_missing_value"][1], calls["bad_missing_value"][2])

    for name, (args, cwd, ctx) in calls.items():
        ctx["before"] = snapshot(*ctx["guard"])

    def dist_run():
        rd = t / "dist"
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        p = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node=2",
                            f"--master_port={free_port()}", str(t / "dist_audit.py"), str(rd)],
                           env=env, capture_output=True, text=True, timeout=300, cwd=t)
        return p, {"dir": rd}

    out = {"marker": marker, "t": t}
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as ex:
        fd = ex.submit(dist_run)
        futs = {name: ex.submit(cli, *args, cwd=cwd, extra_path=str(t)) for name, (args, cwd, _) in calls.items()}
        for name, fut in futs.items():
            ctx = calls[name][2]
            ctx["cwd"] = calls[name][1]
            out[name] = (fut.result(), ctx)
        out["dist"] = fd.result()
    for name, (args, cwd, ctx) in calls.items():
        ctx["after"] = snapshot(*ctx["guard"])
    return out


def all_findings(runs):
    reps = [runs["bad"].report(), runs["good"].report(), runs["every1"].report(),
            *runs["cap_reports"].values()]
    return reps


def check_finding(f, names, op=True):
    assert f.rule in RULES, f.rule
    assert f.severity in SEV and f.phase in PHASES, (f.severity, f.phase)
    assert f.module is None or f.module in names, (f.module, names)
    if op and not (f.op is None or (isinstance(f.op, str) and f.op.startswith("aten::"))):
        raise WrongAnswer(f"op {f.op!r} of {f.rule} is neither an ATen op name nor null")
    assert f.step is None or (type(f.step) is int and f.step >= 0), f.step
    assert isinstance(f.message, str) and f.message.strip(), f.message
    assert isinstance(f.fix, str) and isinstance(f.evidence, dict)
    d = f.to_dict()
    assert list(d) == KEYS and all(d[k] == getattr(f, k) for k in KEYS[:-1])


def self_contained(html):
    refs = re.findall(r'''<(?:script|img|link|iframe|source|embed|object|audio|video)\b[^>]*?\b(?:src|href|data)\s*=\s*["']?([^"'\s>]+)''',
                      html, flags=re.I)
    refs += re.findall(r'''url\(\s*["']?([^"')]+)''', html, flags=re.I)
    return [r for r in refs if not r.startswith(("data:", "#"))]


# ----------------------------------------------------------------------------------------------------- Python API
def test_api_signatures_and_defaults():
    sig = inspect.signature(ampdoctor.watch).parameters
    assert list(sig)[0] == "model" and sig["model"].default is inspect.Parameter.empty
    assert all(sig[n].default is None for n in ("optimizer", "scaler", "run_dir"))
    assert "every" in sig and sig["every"].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert sig["every"].default is not inspect.Parameter.empty          # optional: ampdoctor's own default
    rp = inspect.signature(ampdoctor.replay).parameters
    assert list(rp)[1:3] == ["model", "loss_fn"]
    assert rp["model"].default is None and rp["loss_fn"].default is None
    sb = inspect.signature(ampdoctor.save_batch).parameters
    kinds = [p.kind for p in sb.values()]
    assert list(sb)[1] == "model" and inspect.Parameter.VAR_POSITIONAL in kinds \
        and inspect.Parameter.VAR_KEYWORD in kinds
    assert len(inspect.signature(ampdoctor.diagnose).parameters) == 1


def _hook_state(m, opt, sc):
    mm = importlib.import_module("torch.nn.modules.module")
    oo = importlib.import_module("torch.optim.optimizer")
    s = {}
    for n, mod in m.named_modules():
        for a in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                  "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            s[(n, a)] = tuple(getattr(mod, a, {}))
        s[(n, "forward")] = mod.__dict__.get("forward")
    for i, p in enumerate(m.parameters()):
        s[("param", i)] = (tuple(p._backward_hooks or {}) if getattr(p, "_backward_hooks", None) else (),
                           tuple(getattr(p, "_post_accumulate_grad_hooks", None) or {}))
    s["opt_dict"] = {k: v for k, v in opt.__dict__.items() if callable(v)}
    s["opt_hooks"] = (tuple(opt._optimizer_step_pre_hooks), tuple(opt._optimizer_step_post_hooks),
                      tuple(oo._global_optimizer_pre_hooks), tuple(oo._global_optimizer_post_hooks))
    s["sc_dict"] = {k: v for k, v in sc.__dict__.items() if callable(v)}
    s["globals"] = (tuple(mm._global_forward_hooks), tuple(mm._global_forward_pre_hooks),
                    tuple(mm._global_backward_hooks), tuple(mm._global_backward_pre_hooks))
    s["funcs"] = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_, torch.Tensor.backward,
                  torch.autograd.backward, torch.autograd.grad, torch.amp.GradScaler.step,
                  torch.amp.GradScaler.update, torch.amp.GradScaler.unscale_, torch.amp.GradScaler.scale,
                  type(opt).step, type(opt).zero_grad, torch.optim.Optimizer.step, torch.nn.Module.__call__,
                  torch.autocast.__enter__, torch.nn.functional.linear)
    return s


def test_close_removes_every_hook_and_patch_idempotent_and_with_block():
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu")
    before = _hook_state(m, opt, sc)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    assert type(w).__name__ == "Watch"
    assert _hook_state(m, opt, sc) != before          # (the watch really hooks something)
    w.close()
    assert _hook_state(m, opt, sc) == before
    w.close()                                          # idempotent
    assert _hook_state(m, opt, sc) == before
    with ampdoctor.watch(m, optimizer=opt, scaler=sc) as w2:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(torch.randn(4, 8)).float().pow(2).mean()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    assert _hook_state(m, opt, sc) == before
    assert isinstance(w2.report(), ampdoctor.Report)


def test_report_types_and_diagnose_is_the_same_report(runs):
    for key, rd in (("bad", runs["bad_dir"]), ("good", runs["good_dir"])):
        r = runs[key].report()
        assert isinstance(r, ampdoctor.Report) and isinstance(r.findings, list)
        assert all(isinstance(f, ampdoctor.Finding) for f in r.findings)
        dr = ampdoctor.diagnose(str(rd))
        assert isinstance(dr, ampdoctor.Report)
        assert [f.to_dict() for f in dr.findings] == [f.to_dict() for f in r.findings], key


def test_every_finding_has_the_contract_fields_and_types(runs):
    names = {n for n, _ in mlp().named_modules()}
    seen = 0
    for rep in all_findings(runs):
        d = rep.to_dict()
        assert len(d["findings"]) == len(rep.findings)
        for f, fd in zip(rep.findings, d["findings"]):
            check_finding(f, names)
            assert fd == f.to_dict()
            seen += 1
    assert seen >= 3


def test_report_json_is_strict_and_save_json_round_trips(runs, tmp_path):
    for key in ("bad", "good"):
        r = runs[key].report()
        d = r.to_dict()
        assert isinstance(d["findings"], list) and isinstance(d["summary"], dict)
        text = json.dumps(d, allow_nan=False)
        p = tmp_path / f"{key}.json"
        r.save_json(str(p))
        assert json.loads(p.read_text(), parse_constant=lambda c: pytest.fail(c)) == json.loads(text)


def test_save_html_is_one_self_contained_file(runs, tmp_path):
    for key in ("bad", "good"):
        out = runs[key].report().save_html(str(tmp_path / key))
        page = out if os.path.isfile(out) else os.path.join(out, "index.html")
        html = open(page, encoding="utf-8").read()
        assert "<html" in html.lower() and not self_contained(html), self_contained(html)


def test_findings_ordered_root_cause_first(runs):
    fs = runs["bad"].report().findings
    assert fs and fs[0].rule == "overflow" and fs[0].module == "0", [f.one_line() for f in fs]
    first_info = next((i for i, f in enumerate(fs) if f.severity == "info"), len(fs))
    assert all(f.severity == "info" for f in fs[first_info:]), [f.one_line() for f in fs]


def test_default_every_names_the_unsampled_bad_step(runs):
    assert runs["bad_seen"][BAD_STEP] is False and all(runs["bad_seen"][:BAD_STEP])   # the oracle: real overflow
    f = runs["bad"].report().findings[0]
    assert (f.rule, f.module, f.step, f.severity) == ("overflow", "0", BAD_STEP, "error")
    assert f.phase in ("forward", None)


def test_healthy_run_quiet_and_backoffs_are_info(runs):
    fs = runs["good"].report().findings
    assert not [f for f in fs if f.severity in ("error", "warning")], [f.one_line() for f in fs]
    if runs["good_skipped"]:
        sk = [f for f in fs if f.rule == "skipped_steps"]
        assert sk and all(f.severity == "info" for f in sk), [f.one_line() for f in fs]


def test_every_1_and_in_memory_records(runs):
    f = runs["every1"].report().findings[0]
    assert (f.rule, f.module, f.step, f.severity) == ("overflow", "0", BAD_STEP, "error")
    assert list(runs["mem_cwd"].iterdir()) == []       # no run_dir: nothing written


def test_capture_written_under_run_dir_captures(runs):
    assert runs["caps"] and all(c.is_dir() for c in runs["caps"])
    f = next(f for f in runs["cap_reports"][runs["cap"].name].findings if f.rule == "overflow")
    assert (f.module, f.severity) == ("0", "error")


def test_replay_loads_the_capture_weights_and_calls_loss_fn(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def forward(self, x, gain=1.0):
            return self.b(torch.relu(self.a(x))) * gain

    m = Net()
    with torch.no_grad():
        m.b.weight.mul_(1e5)
    cap = str(tmp_path / "cap")
    with torch.autocast("cpu", dtype=torch.float16):
        ampdoctor.save_batch(cap, m, torch.randn(4, 8) * 30, gain=2.0)
    got = []

    def loss_fn(out, *args, **kwargs):
        got.append((tuple(out.shape), [tuple(a.shape) for a in args], kwargs))
        return out.float().pow(2).mean()
    r = ampdoctor.replay(cap, model=Net(), loss_fn=loss_fn)          # a fresh Net: ordinary weights
    assert got and got[0][1] == [(4, 8)] and got[0][2] == {"gain": 2.0}, got
    f = next((f for f in r.findings if f.rule == "overflow"), None)
    assert f is not None and f.module == "b" and f.severity == "error", [x.one_line() for x in r.findings]


def test_replay_without_loss_fn_for_scalar_or_dot_loss_outputs(tmp_path):
    class Scalar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.l(x).float().pow(2).mean()

    class WithLoss(Scalar):
        def forward(self, x):
            return types.SimpleNamespace(loss=super().forward(x), logits=self.l(x))
    for cls in (Scalar, WithLoss):
        cap = str(tmp_path / cls.__name__)
        with torch.autocast("cpu", dtype=torch.float16):
            ampdoctor.save_batch(cap, cls(), torch.randn(4, 8))
        r = ampdoctor.replay(cap, model=cls())
        assert not [f for f in r.findings if f.rule == "replay_error"], [f.one_line() for f in r.findings]
        assert not [f for f in r.findings if f.severity == "error"], [f.one_line() for f in r.findings]


def test_replay_rebuilds_a_hugging_face_model_from_its_config(tmp_path):
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    m = tf.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        m.transformer.h[0].mlp.c_fc.weight.mul_(3e4)
    ids = torch.randint(0, 50, (2, 8))
    cap = str(tmp_path / "hf")
    with torch.autocast("cpu", dtype=torch.float16):
        ampdoctor.save_batch(cap, m, input_ids=ids, labels=ids)
    r = ampdoctor.replay(cap)                                        # model=None
    names = {n for n, _ in m.named_modules()}
    assert not [f for f in r.findings if f.rule == "replay_error"], [f.one_line() for f in r.findings]
    f = next(f for f in r.findings if f.rule in ("overflow", "nan_origin"))
    assert f.severity == "error" and f.module in names and f.module.startswith("transformer.h.0.mlp"), f.one_line()


# ----------------------------------------------------------------------------------------------------- rule table
@functools.lru_cache(maxsize=None)
def _loop(kind, steps=4):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    if kind == "legacy":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sc = getattr(importlib.import_module("torch.cuda" + ".amp"), "GradScaler")(enabled=False)
    else:
        sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    try:
        for i in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(4, 8)).float().pow(2).mean()
            sc.scale(loss).backward()
            if kind == "clip":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                sc.step(opt)
                sc.update()
            elif kind == "misorder":
                sc.unscale_(opt)
                sc.update()
                sc.step(opt)
                sc.update()
            elif kind == "noupdate":
                sc.step(opt)
            else:
                sc.step(opt)
                sc.update()
    except RuntimeError:
        assert kind == "noupdate"                # torch refuses the second step() without update()
    finally:
        w.close()
    return w.report()


@pytest.mark.parametrize("kind,rule,sev", [("clip", "clip_before_unscale", ("error", "warning")),
                                           ("misorder", "scaler_misorder", ("error", "warning")),
                                           ("noupdate", "missing_scaler_update", ("error", "warning")),
                                           ("legacy", "deprecated_api", ("info",))])
def test_rule_table_misuse(kind, rule, sev):
    fs = _loop(kind).findings
    f = next((f for f in fs if f.rule == rule), None)
    assert f is not None and f.severity in sev, [x.one_line() for x in fs]
    if rule == "scaler_misorder":
        assert isinstance(f.evidence.get("sequence"), list) and f.evidence["sequence"], f.evidence
    check_finding(f, {n for n, _ in mlp().named_modules()}, op=False)


@pytest.mark.parametrize("kind,rule", [("clip", "clip_before_unscale"), ("misorder", "scaler_misorder"),
                                       ("noupdate", "missing_scaler_update"), ("legacy", "deprecated_api")])
def test_op_field_is_an_aten_name_or_null(kind, rule):
    f = next(f for f in _loop(kind).findings if f.rule == rule)
    check_finding(f, {n for n, _ in mlp().named_modules()})


# ---------------------------------------------------------------------------------------------------- distributed
def test_distributed_rank_dirs_merge_and_rank_evidence(clirun):
    p, ctx = clirun["dist"]
    assert p.returncode == 0, p.stderr[-3000:]
    rd = ctx["dir"]
    assert {"rank-0", "rank-1"} <= set(os.listdir(rd))
    r = ampdoctor.diagnose(str(rd))
    assert r.findings and all(isinstance(f.evidence.get("rank"), int) for f in r.findings), \
        [(f.one_line(), f.evidence.get("rank")) for f in r.findings]
    f = r.findings[0]
    assert (f.rule, f.step, f.evidence["rank"], f.severity) == ("overflow", 3, 1, "error"), f.one_line()
    assert f.module == "module.0"      # the qualified name in the watched (DDP) model's named_modules()


# ------------------------------------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("name,json_name", [("report_bad", "bad.json"), ("report_good", "good.json"),
                                            ("replay_bad", "rbad.json"), ("replay_good", "rgood.json")])
def test_cli_exit_code_agrees_with_the_json(clirun, name, json_name):
    p, _ = clirun[name]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    d = json.loads((clirun["t"] / json_name).read_text())
    assert list(d)[:2] == ["findings", "summary"] or {"findings", "summary"} <= set(d)
    errors = [f for f in d["findings"] if f["severity"] == "error"]
    assert p.returncode == (1 if errors else 0), (p.returncode, p.stderr[-1500:])
    assert p.returncode == {"report_bad": 1, "report_good": 0, "replay_bad": 1, "replay_good": 0}[name]
    for f in d["findings"]:
        assert list(f) == KEYS and f["rule"] in RULES and f["severity"] in SEV and f["phase"] in PHASES
    if name.endswith("bad"):
        assert (d["findings"][0]["rule"], d["findings"][0]["module"]) == ("overflow", "0")


@pytest.mark.parametrize("name", ["report_bad", "report_good", "replay_bad", "replay_good"])
def test_cli_out_is_a_self_contained_index_html(clirun, name):
    out = clirun["t"] / {"report_bad": "o_bad", "report_good": "o_good", "replay_bad": "o_rbad",
                         "replay_good": "o_rgood"}[name]
    html = (out / "index.html").read_text(encoding="utf-8")
    assert not self_contained(html), self_contained(html)
    if name.startswith("report"):      # "(plus the plots)"
        assert [n for n in os.listdir(out) if n.endswith((".png", ".svg"))], os.listdir(out)


@pytest.mark.parametrize("name,run", [("report_default_out", "bad"), ("replay_default_out", None)])
def test_cli_default_out_is_reports_name(clirun, runs, name, run):
    p, ctx = clirun[name]
    assert p.returncode == 1, p.stderr[-1500:]
    rep = ctx["cwd"] / "reports"
    subs = os.listdir(rep)
    assert len(subs) == 1 and (rep / subs[0] / "index.html").is_file(), subs
    want = run if run else runs["cap"].name
    assert subs[0] == want, (subs, want)


def test_cli_replay_out_refuses_foreign_dir_and_force_overrides(clirun):
    p, ctx = clirun["replay_foreign"]
    assert p.returncode == 2 and len(stderr_lines(p)) == 1 and "Traceback" not in p.stderr, p.stderr
    assert ctx["before"] == ctx["after"]
    p, _ = clirun["replay_force"]
    assert p.returncode == 1, p.stderr[-1500:]
    forced = clirun["t"] / "forced"
    assert (forced / "index.html").is_file()


def test_cli_tensorboard_events_readable(clirun):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = clirun["t"] / "tb"
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tb))
    ea = EventAccumulator(str(tb))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert tags
    steps = {t: [s.step for s in ea.Scalars(t)] for t in tags}
    assert all(set(v) <= set(range(STEPS)) for v in steps.values()), steps
    assert any(sorted(v) == list(range(STEPS)) for v in steps.values()), steps   # per-step series


@pytest.mark.parametrize("cmd,flags", [("report", ["--out", "--json", "--tensorboard"]),
                                       ("replay", ["--model", "--loss", "--out", "--json"])])
def test_cli_subcommand_help_lists_the_contract_flags(clirun, cmd, flags):
    p, _ = clirun["help_" + cmd]
    assert p.returncode == 0, p.stderr
    assert all(f in p.stdout for f in flags + ["--force"]), p.stdout


BAD_NAMES = ["model_no_colon", "model_no_module", "model_no_attr", "model_raises", "model_mismatch", "loss_no_attr",
             "no_model_plain_capture", "replay_a_file", "replay_a_run_dir", "report_a_capture", "report_a_file",
             "truncated_capture", "pickle_capture", "unknown_flag", "missing_value", "missing_capture"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_cli_bad_input_one_line_exit_2_nothing_overwritten(clirun, name):
    p, ctx = clirun["bad_" + name]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 2, (p.returncode, p.stderr[-1500:], p.stdout[-800:])
    ln = stderr_lines(p)
    assert len(ln) == 1 and ln[0].startswith("ampdoctor: "), p.stderr
    assert ctx["before"] == ctx["after"], [k for k in ctx["before"] if ctx["before"][k] != ctx["after"].get(k)]
    assert not (ctx["cwd"] / "reports").exists()
    if name == "pickle_capture":
        assert not clirun["marker"].exists()          # nothing in a capture is executed on load
