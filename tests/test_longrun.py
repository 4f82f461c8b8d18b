"""Long runs stay bounded: records in memory are thinned, routine steps are written slim, the report is fast."""
import os
import time

import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.storage import KEEP_DETAILED, MEMORY_STEPS


def test_12k_steps_bounded_memory_and_run_dir(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(2, 4)
    rd = tmp_path / "long"
    n = 12_000
    with ampdoctor.watch(m, opt, sc, run_dir=rd, every=500) as w:
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            if i == 9_345:
                with torch.no_grad():
                    m[1].weight.fill_(float("inf"))  # one bad step late in the run: never thinned away
            if i == 9_346:
                with torch.no_grad():
                    m[1].weight.normal_()
    recs = w.steps
    assert len(recs) <= MEMORY_STEPS + n // 500 + 64
    assert sum(bool(r.modules) for r in recs) <= KEEP_DETAILED + 8
    assert any(r.step in (9_345, 9_346) and r.bad for r in recs)
    size = sum(os.path.getsize(os.path.join(rd, f)) for f in os.listdir(rd) if f.endswith(".jsonl"))
    assert size < 8 * 2 ** 20, size
    t = time.perf_counter()
    rep = ampdoctor.diagnose(rd)
    assert time.perf_counter() - t < 10
    assert rep.summary["bad_steps"] >= 1
