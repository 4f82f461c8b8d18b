"""Watch-handle lifecycle, second set: HOW USERS HOLD THE HANDLE on real small CPU fp16 runs (fp16 autocast +
GradScaler("cpu"), AdamW, unscale_ + clip + step + update), driven only through docs/CONTRACT.md.

The model: `Net` = encoder (Linear(16,64) -> ReLU -> Linear(64,64) -> ReLU) + head Linear(64,1), a learnable
regression. The fault: at iteration F the weights of `encoder.2` are x1e5 for that one iteration (a bad rescale; the
fp32 weights stay below 65504, so their fp16 copy is finite) and restored bit-exactly after it (the scaler skips the
step, so nothing else moved): `encoder.2` turns finite inputs into +-inf -> CONTRACT `overflow` at `encoder.2`,
step F, severity error, among the first three findings. The head fault (case 6) is the same on `head` (x3e5).
Every fault is first proven by probe_harness.Producer (first module with non-finite output from finite inputs and
own params, at which iteration), the non-finite loss and the scaler's skip at F; healthy runs by finite, falling
losses and no producer. Training under the watch must be bitwise the training without it (losses, weights).

Step numbering when a watch starts mid-training (case 1): CONTRACT says `step` is "the optimizer step (0-based)".
The optimizer has made 30 steps before the watch; the fault is on its 41st step (index 40). Read literally that is
step 40; a watch that counts the steps it saw from 0 says 10. Both readings are accepted, nothing else; the test
prints which one ampdoctor uses. The same applies to case 10 (optimizer re-created: global 30 / new optimizer's 10).

Cases:
 1. watch started after 30 healthy steps, fault at iteration 40 -> overflow@encoder.2 step 40 (or 10); bitwise.
 2. w.report() every 10 steps during training (healthy and failing run) -> training bitwise unchanged, the final
    report's findings identical to the same run without mid-run reports, healthy quiet; at the default stride and
    with the headroom series on every step (the replay a mid-run report runs must not feed the next step's series).
 3. `with ampdoctor.watch(...) as w:` (CONTRACT allows it) failing and healthy -> right finding / quiet, closed.
 4. close() twice, report() after close, report() twice, training after close -> no error, same report, training
    after close bitwise the unwatched one, the report unchanged by the later training.
 5. two sequential watches on the same model: phase 1 (20 healthy steps) under w1, closed; phase 2 under w2 with
    the fault at phase-2 iteration 10 -> w2 reports it (step 10 of its run or the global 30), w1 stays quiet.
 6. watching only the submodule `model.encoder`: fault in the encoder -> overflow at "2" (names from the WATCHED
    model's named_modules()); fault in the head (unwatched) -> no producer finding at any encoder module.
 7. one run_dir reused by a second run -> both runs kept (manifest lists 2), run 0's records unchanged, both
    captures kept (captures/<F> and captures/<F>.run1, rundir.py), diagnose(run_dir) == the second watch's report.
 8. diagnose(run_dir) == w.report() (rule, module, step, severity of the top three), failing and healthy.
 9. KeyboardInterrupt mid-run inside try/finally: w.close() -> report right, diagnose(run_dir) the same, the run
    closed ({"end": true} line).
10. model `.to(torch.float32)`, optimizer and GradScaler re-created at iteration 20 (the watch given the old ones),
    fault at 30 -> overflow@encoder.2; healthy twin quiet; bitwise.

What ampdoctor says (torch 2.13 CPU; 15 of 15 right; 10 failing was wrong when written, fixed since):
- right: 1 overflow@encoder.2 aten::addmm at step 10 (the watch numbers steps from its own start, 0-based: the
  optimizer's 41st step is the watch's 11th; summary["steps"] 16); 2 mid-run reports change neither training nor the
  final report (findings' dicts equal but for the per-watch temporary capture path in evidence `capture` /
  `from_replay`, named after the watch object); 3-4, 6-9 as expected; 5 the second watch says step 10 (its own
  count), the first stays quiet and unchanged; 7 the reused run_dir keeps both runs and diagnose() gives the LAST
  run's report (rundir.py: "Nothing is ever lost or overwritten ... appended to"); 10 healthy twin quiet.
- 10 failing, wrong when written (a strict xfail then). With the GradScaler re-created at iteration 20 (the optimizer re-creation and
  `.to(float32)` alone are fine, checked by hand) the report's only finding is `[error] nan_origin at (run) step
  30: ... a step without per-layer statistics; the replay of its capture ... stayed finite` (evidence
  unlocated, replay_finite), no skipped_steps finding, summary["steps"] 39 for 40 iterations (truth:
  overflow@encoder.2 step 30, the oracle's producer). Reading: the watch patched the OLD scaler only; with the new
  one, a skipped step calls no optimizer.step() and its update() is not seen, so the step-30 boundary is missed
  (30 and 31 merge), the capture's state is taken after the loop restored the weights, and the replay stays finite.
  CONTRACT: "A watch finds step boundaries by itself (optimizer step / scaler update)". Fixed since: a watch given a
  scaler also follows a new GradScaler that unscales or steps its optimizer, when the given one made no call in that
  iteration (watch.py adopt_scaler; a second scaler used beside it, one per network, is not taken for a
  replacement: test_healthy_default6), and the adopted scaler's first call (its scale() ran unseen) is not read as an
  update() between two optimizers' steps (rules/callseq._other_step_after): overflow@encoder.2 step 30.

Run: .venv/bin/python -m pytest tests/test_watch_lifecycle2.py -n 0 -q -p no:cacheprovider
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn as nn

import ampdoctor
from probe_harness import Producer, WrongAnswer, at_top3
from scenarios import alarms, lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

W_TRUE = randn(16, 1, seed=123) * 0.3
PRODUCERS = ("overflow", "nan_origin")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(i):
    x = randn(32, 16, seed=1000 + i % 8)
    return x, x @ W_TRUE


class Loop:
    """The user's loop state: model, optimizer, scaler; `run(a, b)` trains iterations a..b-1. `fault`: {iteration:
    (module name, factor)}; the module's weight is multiplied for that iteration only and restored bit-exactly.
    Keeps losses, skipped iterations, non-finite-loss iterations, and the oracle's first producer."""

    def __init__(self, m=None, fault=None, oracle=True):
        self.m = m or net()
        self.opt = torch.optim.AdamW(self.m.parameters(), lr=3e-3)
        self.sc = torch.amp.GradScaler("cpu")
        self.fault = fault or {}
        self.losses, self.skipped, self.bad_loss = [], [], []
        self.orc = Producer(self.m) if oracle else None

    def run(self, a, b, each=None, interrupt_at=None):
        for i in range(a, b):
            if i == interrupt_at:
                raise KeyboardInterrupt
            if self.orc is not None:
                self.orc.step = i
            saved = None
            if i in self.fault:
                name, k = self.fault[i]
                wt = self.m.get_submodule(name).weight
                saved = wt.detach().clone()
                with torch.no_grad():
                    wt.mul_(k)
            self.opt.zero_grad()
            x, y = batch(i)
            with torch.autocast("cpu", dtype=torch.float16):
                out = self.m(x)
            loss = (out.float() - y).pow(2).mean()
            self.losses.append(loss.item())
            if not math.isfinite(loss.item()):
                self.bad_loss.append(i)
            s0 = self.sc.get_scale()
            self.sc.scale(loss).backward()
            self.sc.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.m.parameters(), 1.0)
            self.sc.step(self.opt)
            self.sc.update()
            if self.sc.get_scale() < s0:
                self.skipped.append(i)
            if saved is not None:
                with torch.no_grad():
                    self.m.get_submodule(name).weight.copy_(saved)
            if each is not None:
                each(i)
        return self

    def done(self):
        if self.orc is not None:
            self.orc.remove()
            self.first = self.orc.first
            self.orc = None
        return self

    def weights(self):
        return {k: v.detach().clone() for k, v in self.m.state_dict().items()}


def same_training(a, b):
    """Bitwise the same training: losses (as floats, NaN == NaN) and final weights."""
    assert len(a.losses) == len(b.losses)
    for x, y in zip(a.losses, b.losses):
        assert (math.isnan(x) and math.isnan(y)) or x == y, (a.losses, b.losses)
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def twin(steps, fault=None, hook=None):
    """The same loop with no watch and no oracle (`hook(i, loop)` after each iteration mirrors what the watched
    run did to its loop, e.g. re-creating the optimizer)."""
    lp = Loop(fault=fault, oracle=False)
    for i in range(steps):
        lp.run(i, i + 1)
        if hook is not None:
            hook(i, lp)
    return lp


def real_fault(lp, name, step):
    """The oracle's proof: first producer `name` at `step`, the loss first non-finite there, the scaler skipped it,
    and before it only the opening backoffs (iterations 0-4)."""
    assert lp.first == (name, step), lp.first
    assert lp.bad_loss and lp.bad_loss[0] == step, lp.bad_loss
    assert step in lp.skipped and all(s < 5 for s in lp.skipped if s < step), lp.skipped


def really_healthy(lp):
    ls = lp.losses
    assert all(map(math.isfinite, ls)) and lp.first is None, (ls, lp.first)
    assert all(s < 5 for s in lp.skipped), lp.skipped
    assert sum(ls[-4:]) < 0.7 * sum(ls[:4]), ls


def quiet(rep):
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


def check(cond, msg):
    if not cond:
        raise WrongAnswer(msg)


def right(rep, module="encoder.2", step=None):
    """overflow (or nan_origin) at `module`, error, among the first three, at `step` (one value or a tuple)."""
    try:
        return at_top3(rep, PRODUCERS, module, step=step, severity="error")
    except AssertionError as e:
        raise WrongAnswer(f"want overflow@{module} step {step} [error] in the top three; got {lines(rep)[:3]}") from e


def top3(rep):
    return [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]


def full(rep):
    return [(f.rule, f.module, f.step, f.severity, f.phase, f.op) for f in rep.findings]


def dicts(rep):
    """The findings' dicts, the per-watch temporary capture directory (evidence `capture` / `from_replay`: a path
    named after the watch object) left out."""
    out = []
    for f in rep.findings:
        d = f.to_dict()
        d["evidence"] = {k: v for k, v in d["evidence"].items() if k not in ("capture", "from_replay")}
        out.append(d)
    return out


F_ENC = {40: ("encoder.2", 1e5)}


# 1 ---------------------------------------------------------------------------------------------------------------
def test_watch_started_after_30_healthy_steps_names_the_fault_at_40():
    lp = Loop(fault=F_ENC)
    lp.run(0, 30)
    w = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc)
    lp.run(30, 46)
    w.close()
    lp.done()
    real_fault(lp, "encoder.2", 40)
    same_training(lp, twin(46, F_ENC))
    f = right(w.report(), step=(40, 10))
    print(f"mid-training watch numbers the fault step {f.step}")
    assert w.report().summary["steps"] == 16


# 2 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stride", ["default", "1"])
@pytest.mark.parametrize("fault", [None, {25: ("encoder.2", 1e5)}], ids=["healthy", "failing"])
def test_report_every_10_steps_changes_nothing(fault, stride, monkeypatch):
    # stride "1": the headroom series on every step (tests/stride_sweep.py), so that the step after a mid-run
    # report's replay carries it: the replay's forward must not reach the series (it did: step 30's series held
    # the replayed step 25's inf, an extra `[info] overflow at encoder.2 step 30` only with mid-run reports)
    if stride != "default":
        import stride_sweep
        stride_sweep.install(int(stride), patch=monkeypatch.setattr)
    runs = []
    for mid in (False, True):
        lp = Loop(fault=fault)
        w = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc)
        mids = []
        lp.run(0, 40, each=(lambda i: mids.append(w.report()) if i % 10 == 9 else None) if mid else None)
        w.close()
        lp.done()
        runs.append((lp, w.report(), mids))
    (a, ra, _), (b, rb, mids) = runs
    assert len(mids) == 4
    same_training(a, b)
    same_training(a, twin(40, fault))
    if fault is None:
        really_healthy(a)
        for r in mids + [rb]:
            quiet(r)
    else:
        real_fault(a, "encoder.2", 25)
        right(ra, step=25)
        right(mids[2], step=25)          # the report at iteration 29 already knows it
    check(full(ra) == full(rb), f"final report differs with mid-run reports: {lines(ra)} vs {lines(rb)}")
    check(dicts(ra) == dicts(rb), "finding dicts differ (beyond the per-watch temporary capture path)")


# 3 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", [None, {14: ("encoder.2", 1e5)}], ids=["healthy", "failing"])
def test_watch_as_context_manager(fault):
    lp = Loop(fault=fault)
    with ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc) as w:
        lp.run(0, 30)
    lp.done()
    assert w.closed
    same_training(lp, twin(30, fault))
    if fault is None:
        really_healthy(lp)
        quiet(w.report())
    else:
        real_fault(lp, "encoder.2", 14)
        right(w.report(), step=14)


# 4 ---------------------------------------------------------------------------------------------------------------
def test_close_twice_report_after_close_and_training_after_close():
    fault = {12: ("encoder.2", 1e5)}
    lp = Loop(fault=fault)
    w = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc)
    lp.run(0, 20)
    w.close()
    w.close()
    r1 = w.report()
    r2 = w.report()
    lp.run(20, 30)                      # training goes on after close: nothing is recorded any more
    w.close()
    r3 = w.report()
    lp.done()
    real_fault(lp, "encoder.2", 12)
    same_training(lp, twin(30, fault))
    right(r1, step=12)
    assert full(r1) == full(r2)
    check(full(r3) == full(r1) and r3.summary["steps"] == r1.summary["steps"] == 20,
          f"report changed by training after close: {r1.summary['steps']} -> {r3.summary['steps']} steps")


# 5 ---------------------------------------------------------------------------------------------------------------
def test_two_sequential_watches_on_one_model():
    fault = {30: ("encoder.2", 1e5)}
    lp = Loop(fault=fault)
    w1 = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc)
    lp.run(0, 20)
    w1.close()
    r1_before = w1.report()
    w2 = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc)
    lp.run(20, 40)
    w2.close()
    lp.done()
    real_fault(lp, "encoder.2", 30)
    same_training(lp, twin(40, fault))
    quiet(w1.report())
    assert full(w1.report()) == full(r1_before)
    f = right(w2.report(), step=(10, 30))
    print(f"second watch numbers the fault step {f.step}")


# 6 ---------------------------------------------------------------------------------------------------------------
def test_watching_only_the_encoder_fault_in_the_encoder():
    fault = {14: ("encoder.2", 1e5)}
    lp = Loop(fault=fault)
    with ampdoctor.watch(lp.m.encoder, optimizer=lp.opt, scaler=lp.sc) as w:
        lp.run(0, 24)
    lp.done()
    real_fault(lp, "encoder.2", 14)
    same_training(lp, twin(24, fault))
    right(w.report(), module="2", step=14)      # the name in the WATCHED module's named_modules()


def test_watching_only_the_encoder_fault_in_the_head():
    fault = {14: ("head", 3e5)}
    lp = Loop(fault=fault)
    with ampdoctor.watch(lp.m.encoder, optimizer=lp.opt, scaler=lp.sc) as w:
        lp.run(0, 24)
    lp.done()
    real_fault(lp, "head", 14)
    same_training(lp, twin(24, fault))
    rep = w.report()
    enc = {n for n, _ in lp.m.encoder.named_modules()}
    blamed = [f.one_line() for f in rep.findings if f.rule in PRODUCERS and f.module in enc
              and f.severity in ("warning", "error")]
    check(not blamed, f"an encoder module blamed for the head's overflow: {blamed}")


# 7 ---------------------------------------------------------------------------------------------------------------
def _read(p):
    with open(p, "rb") as f:
        return f.read()


def test_run_dir_reused_by_a_second_run(tmp_path):
    rd = str(tmp_path / "run")
    fault = {12: ("encoder.2", 1e5)}
    lp1 = Loop(fault=fault)
    with ampdoctor.watch(lp1.m, optimizer=lp1.opt, scaler=lp1.sc, run_dir=rd) as w1:
        lp1.run(0, 20)
    lp1.done()
    real_fault(lp1, "encoder.2", 12)
    steps0 = _read(os.path.join(rd, "steps.jsonl"))
    caps0 = sorted(os.listdir(os.path.join(rd, "captures")))
    assert caps0 == ["12"], caps0
    d1 = ampdoctor.diagnose(rd)
    lp2 = Loop(m=net(seed=1), fault=fault)
    with ampdoctor.watch(lp2.m, optimizer=lp2.opt, scaler=lp2.sc, run_dir=rd) as w2:
        lp2.run(0, 20)
    lp2.done()
    real_fault(lp2, "encoder.2", 12)
    with open(os.path.join(rd, "manifest.json")) as f:
        man = json.load(f)
    assert [r["run"] for r in man["runs"]] == [0, 1], man["runs"]
    assert _read(os.path.join(rd, "steps.jsonl")).startswith(steps0)
    caps = sorted(os.listdir(os.path.join(rd, "captures")))
    assert "12" in caps and "12.run1" in caps, caps
    right(w1.report(), step=12)
    right(w2.report(), step=12)
    assert top3(d1) == top3(w1.report())
    check(top3(ampdoctor.diagnose(rd)) == top3(w2.report()),
          f"diagnose(reused run_dir) {top3(ampdoctor.diagnose(rd))} != second watch {top3(w2.report())}")


# 8 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", [None, {14: ("encoder.2", 1e5)}], ids=["healthy", "failing"])
def test_diagnose_equals_report(tmp_path, fault):
    rd = str(tmp_path / "run")
    lp = Loop(fault=fault)
    w = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc, run_dir=rd)
    lp.run(0, 30)
    w.close()
    lp.done()
    same_training(lp, twin(30, fault))
    rep, disk = w.report(), ampdoctor.diagnose(rd)
    if fault is None:
        really_healthy(lp)
        quiet(rep)
        quiet(disk)
    else:
        real_fault(lp, "encoder.2", 14)
        right(rep, step=14)
        right(disk, step=14)
    check(top3(rep) == top3(disk), f"diagnose {top3(disk)} != report {top3(rep)}")


# 9 ---------------------------------------------------------------------------------------------------------------
def test_keyboard_interrupt_inside_try_finally_close(tmp_path):
    rd = str(tmp_path / "run")
    fault = {14: ("encoder.2", 1e5)}
    lp = Loop(fault=fault)
    w = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc, run_dir=rd)
    with pytest.raises(KeyboardInterrupt):
        try:
            lp.run(0, 30, interrupt_at=19)
        finally:
            w.close()
    lp.done()
    assert w.closed
    real_fault(lp, "encoder.2", 14)
    same_training(lp, twin(19, fault))
    rep = w.report()
    right(rep, step=14)
    right(ampdoctor.diagnose(rd), step=14)
    assert top3(ampdoctor.diagnose(rd)) == top3(rep)
    last = _read(os.path.join(rd, "steps.jsonl")).strip().splitlines()[-1]
    assert json.loads(last) == {"run": 0, "end": True}, last


# 10 --------------------------------------------------------------------------------------------------------------
def _recreate(i, lp):
    if i == 19:
        lp.m.to(torch.float32)
        lp.opt = torch.optim.AdamW(lp.m.parameters(), lr=3e-3)
        lp.sc = torch.amp.GradScaler("cpu")


@pytest.mark.parametrize("fault", [None, {30: ("encoder.2", 1e5)}], ids=["healthy", "failing"])
def test_optimizer_and_scaler_recreated_mid_run(fault):
    lp = Loop(fault=fault)
    w = ampdoctor.watch(lp.m, optimizer=lp.opt, scaler=lp.sc)
    for i in range(40):
        lp.run(i, i + 1)
        _recreate(i, lp)
    w.close()
    lp.done()
    same_training(lp, twin(40, fault, hook=_recreate))
    if fault is None:
        ls = lp.losses
        assert all(map(math.isfinite, ls)) and lp.first is None
        assert all(s < 5 or 20 <= s < 25 for s in lp.skipped), lp.skipped     # each scaler's opening search
        assert sum(ls[-4:]) < 0.7 * sum(ls[:4]), ls
        quiet(w.report())
    else:
        assert lp.first == ("encoder.2", 30) and lp.bad_loss[0] == 30 and 30 in lp.skipped, (lp.first, lp.skipped)
        f = right(w.report(), step=(30, 10))
        print(f"re-created optimizer: fault numbered step {f.step}")
