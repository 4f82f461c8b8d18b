"""Long runs at every=1: host memory while training, run-directory size, and how long `ampdoctor report` takes.

Two parts:
1. a real `ampdoctor.watch(..., every=1)` run of `--train` steps of a tiny fp16 MLP: ms/step, RSS at quarter
   marks (flat = records spill to disk), records kept, run-directory bytes per step;
2. a `--steps`-step every=1 run directory (default 100,000) written through ampdoctor's own storage path
   (`storage.store` + `RunDirWriter`, the calls a watch makes per step) from the real run's records with the step
   numbers advanced — so the report's cost is measured at 100k steps without training for an hour on a shared
   CPU; then `ampdoctor report RUN --no-html --json F` timed in-process, and the steps it counted.

    python benchmarks/longrun.py [--train 3000] [--steps 100000]
"""
import argparse
import copy
import os
import resource
import sys
import tempfile
import time
import types

import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.record import storage
from ampdoctor.records import RunMeta
from ampdoctor.rundir import RunDirWriter


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def train(n: int, rd: str):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(2, 4)
    marks = {}
    t0 = time.perf_counter()
    with ampdoctor.watch(m, opt, sc, run_dir=rd, every=1) as w:
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            if (i + 1) % max(n // 4, 1) == 0:
                marks[i + 1] = rss_mb()
    train_s = time.perf_counter() - t0
    print(f"train every=1: {n} steps, {1e3 * train_s / n:.2f} ms/step, records {len(w.steps)}, run dir "
          f"{dir_bytes(rd) / n:.0f} B/step")
    print("  RSS MiB at " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(marks.items())))
    return w.meta, [copy.deepcopy(r) for r in list(w.steps)[1:50]]


def synth(meta: RunMeta, templates: list, n: int, rd: str) -> None:
    """Write an n-step run dir through the storage path a watch uses, records cycled from `templates`."""
    writer = RunDirWriter(rd, meta)
    m = types.SimpleNamespace(records=[], writer=writer, _last_seq=(), _routine_count=0, _detailed=[])
    r0 = rss_mb()
    t0 = time.perf_counter()
    for i in range(n):
        rec = copy.copy(templates[i % len(templates)])
        rec.step = i
        rec.events = [copy.copy(e) for e in rec.events]
        for e in rec.events:
            e.step = i
        storage.store(m, rec)
    writer.close()
    print(f"storage path, {n} every=1 steps: {time.perf_counter() - t0:.1f}s, RSS +{rss_mb() - r0:.1f} MiB "
          f"(records kept {len(m.records)}), run dir {dir_bytes(rd) / 2 ** 20:.1f} MiB")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", type=int, default=3000)
    p.add_argument("--steps", type=int, default=100_000)
    a = p.parse_args()
    from ampdoctor.cli import main as cli
    with tempfile.TemporaryDirectory() as d:
        meta, templates = train(a.train, os.path.join(d, "real"))
        rd = os.path.join(d, "synth")
        synth(meta, templates, a.steps, rd)
        from ampdoctor.rundir import read_run
        t = time.perf_counter()
        n = len(read_run(rd)[1])
        print(f"read_run: {time.perf_counter() - t:.1f}s for {n} records", flush=True)
        t = time.perf_counter()
        rc = cli(["report", rd, "--no-html", "--json", os.path.join(d, "r.json")])
        rep_s = time.perf_counter() - t
        import json
        counted = json.load(open(os.path.join(d, "r.json")))["summary"]["steps"]
    print(f"ampdoctor report ({a.steps} steps): {rep_s:.1f}s, exit {rc}, steps counted {counted}; "
          f"maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
