"""A watch in a DDP run: 2 CPU processes, gloo backend, each rank watching its DDP-wrapped model.

Checks that ranks write `run_dir/rank-<r>/`, that `ampdoctor.diagnose(run_dir)` merges them with
`evidence["rank"]` naming the rank where a finding was first seen, and that diverging GradScalers are reported.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import ampdoctor
import distsetup
from distsetup import BACKEND, DEV, WORLD, available, process_group
from scenarios import TwoLayerNet

pytestmark = pytest.mark.skipif(not available(), reason=f"torch.distributed with {BACKEND} is not available")
STEPS = 4
BAD_STEP = 1


def _worker(rank: int, port: int, run_dir: str, case: str) -> None:
    with process_group(rank, port) as dev:
        model = torch.nn.parallel.DistributedDataParallel(TwoLayerNet().to(dev))  # syncs rank 0's weights to every rank
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        init = 2.0 ** 16 if (case != "diverge" or rank == 0) else 2.0 ** 10  # e.g. a stale scaler checkpoint
        scaler = torch.amp.GradScaler(DEV, init_scale=init)
        w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=run_dir, every=1)
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = torch.randn(4, 8, generator=g).to(dev), torch.randn(4, 1, generator=g).to(dev)
            if case == "inf" and rank == 1 and step == BAD_STEP:
                x = x * 1e6  # only rank 1's batch overflows fp16 in fc1
            with torch.autocast(DEV, dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        w.close()
        with open(os.path.join(run_dir, f"done-{rank}.json"), "w") as f:
            json.dump({"rank": w.meta.rank, "world": w.meta.world_size, "steps": len(w.steps)}, f)


def run(tmp_path, case: str) -> str:
    return distsetup.run(_worker, tmp_path, case)


def test_ranks_write_their_own_dirs_and_the_inf_rank_is_named(tmp_path):
    run_dir = run(tmp_path, "inf")
    for r in range(WORLD):
        done = json.loads(open(os.path.join(run_dir, f"done-{r}.json")).read())
        assert done == {"rank": r, "world": WORLD, "steps": STEPS}
        assert os.path.exists(os.path.join(run_dir, f"rank-{r}", "manifest.json"))
        assert os.path.exists(os.path.join(run_dir, f"rank-{r}", "steps.jsonl"))
    assert not os.path.exists(os.path.join(run_dir, "manifest.json"))
    rep = ampdoctor.diagnose(run_dir)
    assert rep.summary["ranks"] == [0, 1]
    assert all("rank" in f.evidence for f in rep.findings)
    # fc1's fp16 matmul overflows; with +inf and -inf summed it may report the NaN it made (nan_origin)
    fwd = [f for f in rep.findings if f.rule in ("overflow", "nan_origin") and f.phase == "forward"]
    assert fwd, [f.to_dict() for f in rep.findings]
    assert fwd[0].module == "module.fc1" and fwd[0].step == BAD_STEP
    assert fwd[0].severity == "error" and fwd[0].evidence["rank"] == 1 and fwd[0].evidence["ranks"] == [1]
    assert rep.findings[0] is fwd[0] and "(rank 1)" in rep.summary["verdict"]
    # the all-reduce spread rank 1's inf to every rank's gradients: both scalers skipped the same step
    assert not any("diverged" in f.message for f in rep.findings)
    # rank 1 also captured the bad batch, under its own directory
    assert os.path.isdir(os.path.join(run_dir, "rank-1", "captures"))


def test_diverging_scalers_are_reported(tmp_path):
    run_dir = run(tmp_path, "diverge")
    rep = ampdoctor.diagnose(run_dir)
    div = [f for f in rep.findings if f.rule == "scaler_misorder" and "diverged" in f.message]
    assert len(div) == 1
    ev = div[0].evidence
    assert div[0].step == 0 and ev["rank"] == 0
    assert ev["per_rank"]["0"][0] == 2.0 ** 16 and ev["per_rank"]["1"][0] == 2.0 ** 10
