"""A watch in an FSDP2 run (`fully_shard`): 2 CPU processes, gloo backend, autocast fp16 + ShardedGradScaler.

Sharded parameters' gradients live as one shard per rank. Each rank records its shard's norms (marked
`sharded`, no collective inside the training step: a rank-dependent collective could hang training);
`ampdoctor.diagnose(run_dir)` combines the shards into the true global norms. Checked against torch's own
global norms (`torch._foreach_norm` on the DTensor gradients, `.full_tensor()`), computed in the workers.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import ampdoctor
import distsetup
from distsetup import BACKEND, DEV, WORLD, available, process_group

try:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
except ImportError:  # pragma: no cover - older torch
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None or not available(),
                                reason=f"FSDP2 with {BACKEND} is not available")
STEPS = 4
BAD_STEP = 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _worker(rank: int, port: int, run_dir: str, case: str) -> None:
    with process_group(rank, port) as dev:
        model = Net().to(dev)
        for mod in (model.fc1, model.fc2, model.head):
            fully_shard(mod)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = ShardedGradScaler(DEV)
        w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=run_dir, every=1)
        g = torch.Generator().manual_seed(100 + rank)
        norms = {}
        for step in range(STEPS):
            opt.zero_grad()
            x, y = torch.randn(4, 8, generator=g).to(dev), torch.randn(4, 1, generator=g).to(dev)
            if case == "inf" and rank == 1 and step == BAD_STEP:
                x = x * 1e6  # only rank 1's batch overflows fp16 in fc1
            with torch.autocast(DEV, dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            names = [n for n, p in model.named_parameters() if p.grad is not None]
            gn = torch._foreach_norm([p.grad for n, p in model.named_parameters() if p.grad is not None], 2)
            norms[step] = dict(zip(names, [t.full_tensor().item() for t in gn]))  # torch's global norms
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        w.close()
        live = w.report()  # one rank's own view, in the training process (shard norms, no capture to replay)
        with open(os.path.join(run_dir, f"done-{rank}.json"), "w") as f:
            json.dump({"steps": len(w.steps), "norms": norms, "live_exit": live.exit_code,
                       "live_top": [f.rule for f in live.findings[:3]],
                       "sharded": sorted(p.name for s in w.steps for p in s.params if p.sharded)}, f)


def run(tmp_path, case: str) -> str:
    return distsetup.run(_worker, tmp_path, case)


def test_sharded_gradient_norms_are_global_and_healthy_run_is_quiet(tmp_path):
    run_dir = run(tmp_path, "healthy")
    done = [json.loads(open(os.path.join(run_dir, f"done-{r}.json")).read()) for r in range(WORLD)]
    assert all(d["steps"] == STEPS for d in done)
    assert "fc1.weight" in done[0]["sharded"]  # each rank's own record holds its shard's norm, marked as such
    assert [d["live_exit"] for d in done] == [0, 0]
    rep = ampdoctor.diagnose(run_dir)
    assert not [f.to_dict() for f in rep.findings if f.severity in ("error", "warning")]
    assert rep.summary["model_class"] == f"{__name__}.Net"  # not FSDP2's generated FSDPNet
    assert {L["type"] for L in rep.data["layers"]} >= {"Net", "Linear"}
    grads = rep.data["grad_norms"]
    want = done[0]["norms"]
    checked = 0
    for i, name in enumerate(grads["names"]):
        for j, s in enumerate(grads["steps"]):
            got, ref = grads["values"][i][j], want[str(s)][name]
            assert got is not None and math.isclose(got, ref, rel_tol=1e-5), (name, s, got, ref)
            checked += 1
    assert checked == STEPS * 6, checked


def test_inf_on_one_rank_names_the_rank_and_module(tmp_path):
    run_dir = run(tmp_path, "inf")
    live = json.loads(open(os.path.join(run_dir, "done-1.json")).read())
    assert live["live_exit"] == 1 and live["live_top"][0] in ("overflow", "nan_origin")
    rep = ampdoctor.diagnose(run_dir)
    top = [f for f in rep.findings[:3] if f.rule in ("overflow", "nan_origin")]
    assert top, [f.to_dict() for f in rep.findings]
    assert top[0].module == "fc1" and top[0].step == BAD_STEP and top[0].evidence["rank"] == 1
    assert top[0].evidence.get("op") is None  # no capture (sharded weights), so no replay: module level
    # ShardedGradScaler all-reduces found_inf: both ranks skipped the same step, the scalers did not diverge
    assert not any("diverged" in f.message for f in rep.findings)
