"""Hostile input through the PYTHON API (not the CLI): `ampdoctor.watch(...)` arguments of the wrong kind, and
`ampdoctor.replay(...)` given models and losses in states the user did not think about, on a tiny MLP
(Linear(8,16) -> ReLU -> Linear(16,1), fp16 autocast on the CPU) whose first Linear overflows fp16 at step 4 (its
input x 1e5; an independent forward hook sees `0`'s output turn non-finite at step 4 and not before, with weights
that were finite when step 4 began), and on its quiet twin (no bad batch).

The standard (docs/CONTRACT.md "Python API"; ampdoctor/errors.py: `BadInput` (a ValueError) is "anything the user
handed us that we cannot use", `WatchError` (a TypeError) "watch() was called with something it cannot watch"): an
argument that cannot work gets ONE clear exception of ampdoctor's (or Python's own TypeError/ValueError) whose
one-line message names the argument, at the call, never an obscure error from deep inside torch or a late warning;
nothing is changed by a refused call (the model's weights, dtypes, modes and hooks, the optimizer's state_dict and
methods, the scaler's state and methods, torch's global optimizer hooks and clip functions: all checked), no file
is left behind; an argument that can work does work, with training bitwise what it is unwatched and the report
right. What test_watch.py (a lambda as model, watched twice, an optimizer of another model, scaler=object(),
every=0, headroom="sometimes"), test_watch_safety.py (a scripted root), test_rundir.py (a read-only run dir),
test_hostile_cli2/inputs3/4/5.py (a replay model of other shapes, a scripted or meta model, save_batch onto a run
dir, unicode paths) already probe is not repeated here.

Cases (each mechanism a real slip, with its fix):
 1. `optimizer=` given a list of optimizers (a GAN's [opt_g, opt_d]), a dict of them, an LR scheduler (StepLR, the
    object next to the optimizer in most scripts), or the GradScaler by position (`watch(model, scaler, opt)`):
    WatchError naming optimizer=, nothing changed. Fix: watch(model, optimizer=opt, scaler=scaler).
 2. `watch(model, opt, "runs/exp1")`: the run dir by position lands on `scaler`: refused naming scaler=, no
    `runs/` directory made. Fix: run_dir= by keyword.
 3. `every=-1`, `every=1.5` (a fraction of an epoch), `every="10"` (from os.environ), and the typo `evrey=1`: a
    ValueError/TypeError naming the argument, nothing changed, no run dir made.
 4. `config={"every": 5}` (a dict read from a YAML config instead of WatchConfig(**cfg)): one clear error naming
    config=. Twin: config=WatchConfig(every=5) is used.
 5. `writer="tb"` (the log dir given to writer=, which wants a SummaryWriter; tensorboard_dir= wants the path):
    refused at watch() naming writer=. Twin: tensorboard_dir="tb" writes the events.
 6. `tensorboard_dir=` naming an existing FILE (the path of an old run's log): refused with one clear error naming
    tensorboard_dir, or logging switched off with a warning as run_dir= does (case 7); the file is kept.
 7. `run_dir=` naming an existing FILE: a RuntimeWarning, records in memory, the file byte-identical, training bitwise
    the unwatched one, and w.report() still names the overflow at `0`, step 4, as a watch without run_dir does (its
    capture kept in a temporary directory). Twin: no run_dir: the overflow at `0`, step 4.
 8. `run_dir=` as a bytes path (os.fsencode, what os.walk(b"...") / a bytes argv hands on; os.makedirs takes it): the
    run dir at that path (its manifest there, diagnose() names the overflow), or refused naming run_dir; never a
    directory named "b'..." (str(bytes)) in the working directory.
 9. `run_dir=""` (os.environ.get("RUN_DIR", "") with the variable unset): refused naming run_dir, or in memory
    with a warning; nothing written into the working directory; training bitwise the unwatched one.
10. `watch(criterion, optimizer=opt)`: the loss module (nn.MSELoss, no parameters) watched instead of the model (the
    two sit side by side in every script): the optimizer holds none of the watched module's parameters, so it is
    refused naming optimizer=, as an optimizer of another model is. Twin: watch(model, optimizer=opt) names the
    overflow at `0`, step 4.
11. `scaler=torch.cuda.amp.GradScaler()` (or torch.amp.GradScaler("cuda")) in a GPU script run on a CPU-only
    machine: torch warns and disables it (scale() returns the loss, step() calls optimizer.step()), so the loop is a
    plain fp16 loop that steps the NaN gradients of step 4. The watch must read it as the disabled scaler it is: the
    overflow at `0`, step 4, among the first three, and no error dated before step 4 (the weights were finite when
    step 4 began: the oracle). Twin: the quiet run with the same scaler: no warning or error (the deprecated_api
    info is fine), training bitwise the unwatched one.
12. `ampdoctor.replay(capture, model=model)` called mid-run on the model a watch is watching (a notebook that
    replays yesterday's capture into the live model): the model is left as it was (README), so the training goes
    on bitwise as without the watch, and the watch records nothing of the replay: its report of a quiet run stays
    quiet (or the replay is refused naming the watch). Twin: the replay into a fresh instance.
13. `replay(capture, model=m)` with m in eval mode, `.half()`, bf16, or frozen (requires_grad False, stale .grad):
    the overflow at `0`, step 4, and m exactly as it was (weights, dtypes, modes, requires_grad, .grad).
14. `replay(capture, model=MLP)` (the class) or `model=make_mlp` (the factory, as --model takes it on the CLI):
    BadInput naming model.
15. `replay(capture, model=m, loss_fn=42)` (a loss weight passed where the loss function goes): BadInput naming
    loss_fn, not a message that blames the model. Twin: a callable loss: the overflow at `0`, step 4.

What ampdoctor got wrong (strict xfails via `wrong`; what it said):
 4. config dict: `AttributeError: 'dict' object has no attribute 'every'` from watch.py (build_meta(...,
    self.config.every)); nothing was installed. Should be: WatchError/TypeError naming config= (WatchConfig).
    Cause: Watch.__init__ takes `config or WatchConfig(...)` without checking its type.
 5. writer="tb": accepted; at step 0 a RuntimeWarning "ampdoctor: a reporter failed on step 0 ('str' object has no
    attribute 'add_scalar'); it is switched off", nothing logged. Should be: refused at watch() naming writer=
    (pointing at tensorboard_dir=). Cause: report/tensorboard.py TensorBoardSink keeps any object as the writer.
 6. tensorboard_dir=<a file>: `FileExistsError: [Errno 17] File exists: '<path>'` from os.makedirs, raw (not
    naming the argument; run_dir= of the same file degrades with a warning). Cause: TensorBoardSink(logdir=...)
    built in Watch.__init__ outside any guard.
 7. run_dir=<a file>: the warning "cannot write the run directory ... records stay in memory only", then "could not
    write a capture of step 4 (NotADirectoryError ... <file>/captures)", and the report's only error is "[error]
    nan_origin at (run) step 4: The model's output became non-finite at step 4, a step without per-layer statistics;
    replay its capture ..." (no layer; there is no capture). Should be: the overflow at `0`, step 4, as without a
    run_dir (and as with run_dir="", case 9). Cause: record/autocapture.py maybe_capture writes under `w.run_dir`
    whenever it is set, even after rundir.RunDirWriter fell back to memory; only a falsy run_dir takes the temporary
    capture path.
 8. run_dir=b"<tmp>/runs/exp1": accepted; the records went to `./b'<tmp>/runs/exp1'/` (a directory named "b'"
    in the cwd), nothing at the path. Cause: Watch.__init__ `str(run_dir)` (os.fsdecode would do).
10. watch(nn.MSELoss(), optimizer=opt): accepted; trained on the failing loop (GradScaler, by hand) its first lines:
    "[error] nan_origin at (run) step 4: The batch of step 4 already held 4 NaN (model input argument 0 ...)" (the
    data blamed) and "[error] skipped_steps". Cause: Watch.__init__ skips the foreign-optimizer check when the
    model has no parameters (`if params and not any(...)`).
11. disabled torch.cuda.amp.GradScaler on CPU: first finding "[error] nan_origin at 0 step 3: The weights of `0`
    (Linear) were already NaN when step 4 began: step 3's update wrote them" (false: they were finite; step 4's own
    update wrote them), then the right "[error] overflow at 0 aten::_to_copy step 4" (the same with
    torch.amp.GradScaler("cuda")). A disabled torch.amp.GradScaler("cpu") gets it right. Cause:
    record/transfer.py presync reads a step's values asynchronously when `scaler._device == "cuda"` without
    checking that the scaler is enabled (or the tensors on CUDA): step 4's record gets `bad_weights` read after its
    own optimizer step, and rules/outside.py bad_weights dates them at step 3.
12. replay into the watched model at iteration 3 of a quiet run: the watch recorded the replay's forward as step
    3's: its report says "[error] overflow at 0 aten::_to_copy step 3: aten::_to_copy in `0` produced ±inf from
    finite inputs" for a run that never overflowed. Cause: replay/__init__.py replay() does not suspend the
    model's watch (`machine.suspended`, as Watch.replayed does).
15. loss_fn=42: BadInput "replaying the capture failed in the model: TypeError: 'int' object is not callable" (the
    model blamed; loss_fn not named). Cause: replay/__init__.py resolves a string loss_fn only and _replay maps
    the TypeError of calling it to "failed in the model".
12's training under the watch is still bitwise the unwatched one (only the report is wrong).
Passed: 1 (4 ways), 2, 3 (4 ways), 4's, 5's, 7's, 10's, 12's and 15's twins, 9 (a RuntimeWarning "cannot write the run
directory ''", nothing in the cwd, the overflow at `0`, step 4), 11's twins (2), 13 (4 ways), 14 (2 ways).

Result when written (torch 2.13 CPU, default watch): 24 pass, 10 xfail (two runs, identical).
Fixed since (the same session; each XPASSed, then was unmarked): watch() refuses config= that is no WatchConfig,
writer= without add_scalar, tensorboard_dir= naming a file, and optimizer= beside a parameter-free module; it takes a
bytes or PathLike run_dir through os.fsdecode; a run directory it could not write leaves the captures in the
temporary place, as without one (record/autocapture.py); a disabled CUDA GradScaler is read as no asynchronous one
(record/hostcopy.cuda_scaler); ampdoctor.replay() on a watched model suspends that watch (replay/__init__._unwatched);
loss_fn that is not callable is refused naming loss_fn.
"""
import copy
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.optim.optimizer as _O

import ampdoctor
from ampdoctor import AmpDoctorError, BadInput, WatchConfig, WatchError
from probe_harness import WrongAnswer, finite_oracle, named_top3, overflow_run, same_bits, snapshot
from scenarios import alarms, lines

torch.set_num_threads(1)

BAD = 4
STEPS = 6


def make_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


MODELS = SimpleNamespace(mlp=make_mlp)


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    """A real watch's capture of the overflow at `0`, step 4 (probe_harness.overflow_run asserts the oracle)."""
    rd = overflow_run(MODELS, str(tmp_path_factory.mktemp("h_api") / "run"))
    return os.path.join(rd, "captures", str(BAD))


# -- the user's objects and everything a refused call must leave alone ------------------------------------------------
def trained_objects():
    """The MLP, AdamW and a CPU GradScaler after two real fp16 steps (so the optimizer and scaler hold state)."""
    torch.manual_seed(0)
    m = make_mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(torch.randn(4, 8, generator=g)).float().pow(2).mean()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    return m, opt, sc


def _hooks(m):
    return sum(len(getattr(x, a, {})) for x in m.modules() for a in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _tensors(obj):
    """Tensors in a nested state_dict turned into (dtype, shape, bytes) so == compares them bitwise."""
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().cpu().reshape(-1).contiguous()
        return (obj.dtype, tuple(obj.shape), flat.view(torch.uint8).numpy().tobytes() if obj.numel() else b"")
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tensors(v) for v in obj]
    return obj


def state_of(m, opt=None, sc=None):
    """What a refused call (or a replay) must leave exactly as it was."""
    import torch.nn.utils as U
    return {
        "weights": _tensors(m.state_dict()), "grads": [_tensors(p.grad) for p in m.parameters()],
        "modes": [x.training for x in m.modules()], "requires_grad": [p.requires_grad for p in m.parameters()],
        "hooks": _hooks(m),
        "opt": _tensors(copy.deepcopy(opt.state_dict())) if opt is not None else None,
        "opt_attrs": sorted(vars(opt)) if opt is not None else None,
        "sc": _tensors(sc.state_dict()) if sc is not None else None,
        "sc_attrs": sorted(vars(sc)) if sc is not None else None,
        "global": (len(_O._global_optimizer_pre_hooks), len(_O._global_optimizer_post_hooks), id(U.clip_grad_norm_),
                   id(U.clip_grad_value_)),
    }


def left_alone(before, m, opt=None, sc=None):
    after = state_of(m, opt, sc)
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"the refused call changed {changed}"


def watchable_again(m, opt, sc):
    """A refused watch left nothing holding the model: the right call works and closes clean."""
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    w.close()
    assert _hooks(m) == 0


def refused(call, needles, types=(AmpDoctorError, TypeError, ValueError)):
    """`call()` must raise one clear error: one of `types` (ampdoctor's, or Python's own TypeError/ValueError),
    its message one line naming one of `needles`. Anything else (accepted, an AttributeError or OSError, a message
    that names something else) is a WrongAnswer. Returns the exception."""
    try:
        got = call()
    except Exception as e:   # noqa: BLE001 - the point is to see what it raised
        msg = str(e)
        if not isinstance(e, types):
            raise WrongAnswer(f"raised {type(e).__name__}: {msg}") from e
        if "\n" in msg.strip() or not any(n in msg for n in needles):
            raise WrongAnswer(f"{type(e).__name__} not naming {needles}: {msg}") from e
        return e
    if hasattr(got, "close"):
        got.close()
    raise WrongAnswer(f"accepted: {got!r}")


def _reraise(e):
    raise e


# -- the user's loop ---------------------------------------------------------------------------------------------------
def fit(m, opt, sc=None, *, bad=BAD, steps=STEPS, watch_kw=None, around=None):
    """fp16 autocast on the CPU; batch `bad` is x 1e5 (overflows `0`). With `sc` the GradScaler loop, else the careful
    loop without one (a non-finite loss is not stepped). `watch_kw`: watch(m, **watch_kw) around it. The oracle: a
    forward hook on `0` (finite output per step) and whether every weight was finite when each step began."""
    seen, hook = finite_oracle(m[0])
    at_start, losses = [], []
    w = ampdoctor.watch(m, **watch_kw) if watch_kw is not None else None
    g = torch.Generator().manual_seed(1)
    try:
        for i in range(steps):
            at_start.append(all(bool(torch.isfinite(p).all()) for p in m.parameters()))
            if around is not None:
                around(i, m)
            opt.zero_grad()
            x = torch.randn(4, 8, generator=g) * (1e5 if i == bad else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            losses.append(float(loss.detach()))
            if sc is not None:
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
            elif math.isfinite(losses[-1]):
                loss.backward()
                opt.step()
    finally:
        hook.remove()                   # (before close(), whose replay runs `0` again)
        if w is not None:
            w.close()
    return SimpleNamespace(w=w, losses=losses, seen=seen, at_start=at_start,
                           weights=_tensors(m.state_dict()))


def fresh(opt_cls=torch.optim.SGD):
    torch.manual_seed(0)
    m = make_mlp()
    return m, opt_cls(m.parameters(), lr=1e-3)


def overflow_oracle(r):
    """The failure is real and where we say: `0` finite until step 4, non-finite at 4, weights finite at its start."""
    assert r.seen[:BAD + 1] == [True] * BAD + [False], r.seen
    assert all(r.at_start[:BAD + 1]), r.at_start
    assert all(map(math.isfinite, r.losses[:BAD])) and not math.isfinite(r.losses[BAD]), r.losses


def unwatched_twin(r, make_sc=None, **kw):
    """The same run without the watch: bitwise the same losses and final weights."""
    m, opt = fresh()
    u = fit(m, opt, make_sc() if make_sc else None, **kw)
    assert same_bits(r.losses, u.losses), (r.losses, u.losses)
    assert r.weights == u.weights, "watching changed the weights"
    return u


def names_overflow(rep):
    """The overflow (or the NaN it makes) named at `0`, step 4, among the first three findings."""
    return named_top3(rep, ("overflow", "nan_origin"), "0", BAD, severities=("error",))


# -- 1-3: watch() arguments of the wrong kind --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["list", "dict", "scheduler", "scaler_by_position"])
def test_01_optimizer_that_is_not_an_optimizer(kind):
    m, opt, sc = trained_objects()
    other = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    before = state_of(m, opt, sc)
    sched_state = copy.deepcopy(sched.state_dict())
    call = {"list": lambda: ampdoctor.watch(m, optimizer=[opt, other], scaler=sc),
            "dict": lambda: ampdoctor.watch(m, optimizer={"main": opt}, scaler=sc),
            "scheduler": lambda: ampdoctor.watch(m, optimizer=sched, scaler=sc),
            "scaler_by_position": lambda: ampdoctor.watch(m, sc, opt)}[kind]
    e = refused(call, ("optimizer",))
    assert isinstance(e, WatchError), e
    left_alone(before, m, opt, sc)
    assert sched.state_dict() == sched_state
    watchable_again(m, opt, sc)


def test_02_run_dir_given_by_position_lands_on_scaler(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, opt, sc = trained_objects()
    before = state_of(m, opt, sc)
    refused(lambda: ampdoctor.watch(m, opt, "runs/exp1"), ("scaler",))
    left_alone(before, m, opt, sc)
    assert os.listdir(tmp_path) == []
    watchable_again(m, opt, sc)


@pytest.mark.parametrize("kw,needle", [({"every": -1}, "every"), ({"every": 1.5}, "every"),
                                       ({"every": "10"}, "every"), ({"evrey": 1}, "evrey")],
                         ids=["minus_one", "fraction", "string", "typo"])
def test_03_every_values_that_cannot_work(tmp_path, kw, needle):
    m, opt, sc = trained_objects()
    before = state_of(m, opt, sc)
    refused(lambda: ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "rd", **kw), (needle,))
    left_alone(before, m, opt, sc)
    assert not os.path.exists(tmp_path / "rd")
    watchable_again(m, opt, sc)


# -- 4-6: config= / writer= / tensorboard_dir= -------------------------------------------------------------------------
def test_04_config_given_as_a_dict(tmp_path):
    m, opt, sc = trained_objects()
    before = state_of(m, opt, sc)
    try:
        refused(lambda: ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "rd", config={"every": 5}),
                ("config", "WatchConfig"))
    finally:
        left_alone(before, m, opt, sc)
        assert not os.path.exists(tmp_path / "rd")
        watchable_again(m, opt, sc)


def test_04_twin_config_as_a_watchconfig():
    m, opt, sc = trained_objects()
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, config=WatchConfig(every=5))
    assert w.config.every == 5
    w.close()


def test_05_writer_given_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, opt, sc = trained_objects()
    before = state_of(m, opt, sc)
    try:
        refused(lambda: ampdoctor.watch(m, optimizer=opt, scaler=sc, writer="tb"), ("writer",))
    finally:
        left_alone(before, m, opt, sc)
        watchable_again(m, opt, sc)


def test_05_twin_tensorboard_dir_writes_the_events(tmp_path):
    m, opt = fresh()
    r = fit(m, opt, watch_kw={"optimizer": opt, "tensorboard_dir": tmp_path / "tb"}, bad=None)
    assert all(map(math.isfinite, r.losses))
    events = [n for _, _, fs in os.walk(tmp_path / "tb") for n in fs if n.startswith("events.out.tfevents")]
    assert events, os.listdir(tmp_path / "tb")


def test_06_tensorboard_dir_that_is_a_file(tmp_path):
    old = tmp_path / "old_run.log"
    old.write_text("step 1 loss 0.3\n")
    guard = snapshot(tmp_path)
    m, opt = fresh()
    before = state_of(m, opt)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        w, e = None, None
        try:
            w = ampdoctor.watch(m, optimizer=opt, tensorboard_dir=old)
        except Exception as exc:   # noqa: BLE001 - refused: it must be one clear error naming the argument
            e = exc
    if e is not None:
        refused(lambda: _reraise(e), ("tensorboard",))
    assert snapshot(tmp_path) == guard
    if w is None:
        left_alone(before, m, opt)
        return
    # accepted: logging must be off with a warning naming the path, as run_dir= does, and training unchanged
    w.close()
    if not any(str(old) in str(x.message) for x in rec):
        raise WrongAnswer(f"accepted without a warning naming {old}: {[str(x.message) for x in rec]}")


# -- 7-9: run_dir= ---------------------------------------------------------------------------------------------------
def test_07_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "exp1"
    f.write_bytes(b"the user's notes\n")
    guard = snapshot(tmp_path)
    m, opt = fresh()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = fit(m, opt, watch_kw={"optimizer": opt, "run_dir": f})
    overflow_oracle(r)
    unwatched_twin(r)
    assert snapshot(tmp_path) == guard
    msgs = [str(x.message) for x in rec if issubclass(x.category, RuntimeWarning) and "ampdoctor" in str(x.message)]
    assert any(str(f) in x for x in msgs), msgs
    names_overflow(r.w.report())


def test_07_twin_no_run_dir():
    m, opt = fresh()
    r = fit(m, opt, watch_kw={"optimizer": opt})
    overflow_oracle(r)
    names_overflow(r.w.report())


def test_08_run_dir_as_bytes(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    target = tmp_path / "runs" / "exp1"
    m, opt = fresh()
    try:
        r = fit(m, opt, watch_kw={"optimizer": opt, "run_dir": os.fsencode(str(target))})
    except (AmpDoctorError, TypeError, ValueError) as e:
        if "run_dir" not in str(e):
            raise WrongAnswer(f"refused without naming run_dir: {e}") from e
        assert os.listdir(cwd) == [] and not os.path.exists(tmp_path / "runs")
        return
    overflow_oracle(r)
    if os.listdir(cwd):
        raise WrongAnswer(f"wrote into the cwd: {os.listdir(cwd)}")
    if not os.path.isfile(target / "manifest.json"):
        raise WrongAnswer(f"no run dir at {target}")
    names_overflow(ampdoctor.diagnose(target))


def test_09_run_dir_empty_string_from_an_unset_variable(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    m, opt = fresh()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        try:
            r = fit(m, opt, watch_kw={"optimizer": opt, "run_dir": os.environ.get("AD_H_API_UNSET_RUN_DIR", "")})
        except (AmpDoctorError, TypeError, ValueError) as e:
            assert "run_dir" in str(e), e
            r = None
    assert os.listdir(cwd) == [], os.listdir(cwd)
    if r is not None:
        overflow_oracle(r)
        unwatched_twin(r)
        assert any("ampdoctor" in str(x.message) and issubclass(x.category, RuntimeWarning) for x in rec), \
            [str(x.message) for x in rec]
        names_overflow(r.w.report())


# -- 10: the loss module watched instead of the model ------------------------------------------------------------------
def test_10_criterion_watched_with_the_models_optimizer():
    m, opt, sc = trained_objects()
    crit = nn.MSELoss()
    before = state_of(m, opt, sc)
    try:
        refused(lambda: ampdoctor.watch(crit, optimizer=opt, scaler=sc), ("optimizer",))
    finally:
        left_alone(before, m, opt, sc)
        assert _hooks(crit) == 0


def test_10_twin_the_model_watched():
    m, opt = fresh()
    r = fit(m, opt, watch_kw={"optimizer": opt})
    overflow_oracle(r)
    names_overflow(r.w.report())


# -- 11: a CUDA GradScaler on a CPU-only machine (disabled by torch) ---------------------------------------------------
def _cuda_scaler(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch: "... CUDA is not available. Disabling."
        sc = torch.cuda.amp.GradScaler() if kind == "torch.cuda.amp" else torch.amp.GradScaler("cuda")
    assert not sc.is_enabled()
    return sc


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scaler is disabled only where CUDA is not available")
@pytest.mark.parametrize("kind", ["torch.cuda.amp", "torch.amp_cuda"])
def test_11_disabled_cuda_grad_scaler_on_a_cpu_machine(kind):
    m, opt = fresh()
    sc = _cuda_scaler(kind)
    r = fit(m, opt, sc, watch_kw={"optimizer": opt, "scaler": sc})
    overflow_oracle(r)
    assert not all(r.at_start[BAD + 1:]), "the disabled scaler stepped the NaN gradients"
    unwatched_twin(r, lambda: _cuda_scaler(kind))
    rep = r.w.report()
    names_overflow(rep)
    early = [f.one_line() for f in rep.findings if f.severity == "error" and f.step is not None and f.step < BAD]
    if early:
        raise WrongAnswer(f"an error dated before the failing step: {early}; all: {lines(rep)[:3]}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scaler is disabled only where CUDA is not available")
@pytest.mark.parametrize("kind", ["torch.cuda.amp", "torch.amp_cuda"])
def test_11_twin_quiet_run_with_the_disabled_scaler(kind):
    m, opt = fresh()
    sc = _cuda_scaler(kind)
    r = fit(m, opt, sc, bad=None, steps=8, watch_kw={"optimizer": opt, "scaler": sc})
    assert all(map(math.isfinite, r.losses)) and all(r.seen), r.losses
    unwatched_twin(r, lambda: _cuda_scaler(kind), bad=None, steps=8)
    rep = r.w.report()
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


# -- 12-15: replay() -------------------------------------------------------------------------------------------------
def test_12_replay_into_the_watched_model_mid_run(cap):
    m, opt = fresh()

    def around(i, model):
        if i == 3:
            try:
                names_overflow(ampdoctor.replay(cap, model=model))
            except BadInput as e:   # refused: it must say why (the model is being watched)
                assert "watch" in str(e), e
    r = fit(m, opt, bad=None, watch_kw={"optimizer": opt}, around=around)
    assert all(map(math.isfinite, r.losses)), r.losses   # (r.seen holds the replay's calls of `0` too)
    unwatched_twin(r, bad=None, around=around)
    rep = r.w.report()
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"the quiet run's report: {lines(rep)[:3]}")


def test_12_twin_replay_into_a_fresh_instance_mid_run(cap):
    m, opt = fresh()

    def around(i, model):
        if i == 3:
            names_overflow(ampdoctor.replay(cap, model=make_mlp()))
    r = fit(m, opt, bad=None, watch_kw={"optimizer": opt}, around=around)
    assert all(map(math.isfinite, r.losses)), r.losses   # (r.seen holds the replay's calls of `0` too)
    unwatched_twin(r, bad=None, around=around)
    rep = r.w.report()
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


@pytest.mark.parametrize("state", ["eval", "half", "bf16", "frozen_with_stale_grads"])
def test_13_replay_into_a_model_in_another_state(cap, state):
    torch.manual_seed(7)
    m = make_mlp()
    if state == "eval":
        m.eval()
    elif state == "half":
        m.half()
    elif state == "bf16":
        m.to(torch.bfloat16)
    else:
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.25)
        m.requires_grad_(False)
    before = state_of(m)
    rep = ampdoctor.replay(cap, model=m)
    left_alone(before, m)
    names_overflow(rep)


@pytest.mark.parametrize("model", [nn.Sequential, make_mlp], ids=["class", "factory"])
def test_14_replay_model_given_as_a_class_or_a_factory(cap, model):
    e = refused(lambda: ampdoctor.replay(cap, model=model), ("model",))
    assert isinstance(e, BadInput), e


def test_15_replay_loss_fn_that_is_not_callable(cap):
    m = make_mlp()
    before = state_of(m)
    try:
        refused(lambda: ampdoctor.replay(cap, model=m, loss_fn=42), ("loss_fn", "loss"), types=(BadInput,))
    finally:
        left_alone(before, m)


def test_15_twin_a_callable_loss(cap):
    m = make_mlp()
    before = state_of(m)
    rep = ampdoctor.replay(cap, model=m, loss_fn=lambda out, *a, **k: out.float().pow(2).mean())
    left_alone(before, m)
    names_overflow(rep)
