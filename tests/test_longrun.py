"""Long runs: every step is counted and kept (memory flat: old records spill to disk), only detail is thinned.
Wall times are measured in benchmarks/longrun.py, not asserted here."""
import os

import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.records import ModuleCall, StepRecord, TensorStats
from ampdoctor.record.storage import FOLLOWUP_STEPS, FULL_DETAIL_STEPS, MEMORY_STEPS, StepStore


def test_every_step_counted_memory_bounded(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(2, 4)
    rd = tmp_path / "long"
    n = 1_200
    with ampdoctor.watch(m, opt, sc, run_dir=rd, every=50) as w:
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            if i == 1_045:
                with torch.no_grad():
                    m[1].weight.fill_(float("inf"))  # one bad step late in the run: never thinned away
            if i == 1_046:
                with torch.no_grad():
                    m[1].weight.normal_()
    recs = w.steps
    assert len(recs) == n and [r.step for r in recs[-3:]] == [n - 3, n - 2, n - 1]
    assert len(recs._hot) <= MEMORY_STEPS                       # the rest lives in the spill file
    assert any(r.step in (1_045, 1_046) and r.bad for r in recs)
    size = sum(os.path.getsize(os.path.join(rd, f)) for f in os.listdir(rd) if f.endswith(".jsonl"))
    assert size < 16 * 2 ** 20, size
    rep = ampdoctor.diagnose(rd)
    assert rep.summary["steps"] == n   # every step counted (past 10,000 steps only 1 in 10 used to be)
    assert rep.summary["bad_steps"] >= 1
    assert len(rep.to_dict()["timeline"]) == n


def _rec(step, sampled=True, bad=False):
    s = TensorStats(dtype="float16", ref="float16", numel=4, absmax=1.0)
    return StepRecord(step=step, sampled=sampled, loss=float(step), skipped=bad, found_inf=bad,
                      modules=[ModuleCall(module="lin", type="Linear", call=0, seq=0, depth=1, out=s)])


class _Collect:
    def __init__(self):
        self.lines = []

    def append(self, rec):
        self.lines.append(rec.to_dict())


def test_every1_detail_thinned_counts_kept():
    st, out = StepStore(hot=64), _Collect()
    n, bad = 3000, 2500
    for i in range(n):
        st.add(_rec(i, bad=i == bad), out)
    assert len(st) == n == len(out.lines) and len(st._hot) <= 64
    detailed = [d["step"] for d in out.lines if d["modules"]]
    assert detailed[:FULL_DETAIL_STEPS] == list(range(FULL_DETAIL_STEPS))
    assert len(detailed) < FULL_DETAIL_STEPS + (n - FULL_DETAIL_STEPS) // 10 + FOLLOWUP_STEPS + 4
    assert set(range(bad, bad + FOLLOWUP_STEPS + 1)) <= set(detailed)   # the bad step and the ones after it
    # reading back: the same records, in order, from the spill file and from memory
    back = list(st)
    assert [r.step for r in back] == list(range(n))
    assert back[bad].skipped and back[bad].modules and st[bad].modules and st[-1].step == n - 1
    assert [r.to_dict() for r in st[10:13]] == [out.lines[i] for i in range(10, 13)]
    cold = len(st) - len(st._hot)   # spilled records are what the run directory got; newer ones keep detail
    assert [r.to_dict() for r in back[:cold]] == out.lines[:cold]
    assert [r.step for r in back[cold:]] == [d["step"] for d in out.lines[cold:]]


def test_spilled_records_read_back_as_the_run_dir_holds_them(tmp_path):
    """Older records spill to a temporary file (the run-dir line of the same record, written once): read back from
    there they equal what the run directory holds, step by step."""
    from ampdoctor.rundir import read_run
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(2, 4)
    rd = tmp_path / "spill"
    with ampdoctor.watch(m, opt, sc, run_dir=rd, every=40) as w:
        for i in range(MEMORY_STEPS + 10):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
    recs = w.steps
    assert len(recs._offsets) > 0  # some did spill
    _, on_disk = read_run(str(rd))
    assert [r.to_dict() for r in recs] == [r.to_dict() for r in on_disk]


def test_records_with_many_modules_held_in_memory_by_weight():
    """every=1 on a deep model: each record holds a ModuleCall and four statistics per module call; the store keeps
    at most MEMORY_OBJECTS of them in memory (Python's full collections walk every object), the rest read back from
    the spill file equal to what was stored."""
    from ampdoctor.record.storage import MEMORY_OBJECTS, _weight
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(40)])
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with ampdoctor.watch(m, opt, every=1) as w:
        for _ in range(60):
            opt.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
            opt.step()
    recs = w.steps
    assert len(recs) == 60 and _weight(recs[-1]) > 400
    assert sum(_weight(r) for r in recs._hot) <= MEMORY_OBJECTS and len(recs._hot) < 60
    small = StepStore(list(recs), objects=2_000)
    assert len(small._hot) <= 2_000 // 400 + 1
    assert [r.to_dict() for r in small] == [r.to_dict() for r in recs]
