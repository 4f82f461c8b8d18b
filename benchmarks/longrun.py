"""A 100,000-step run of a tiny fp16 model under `ampdoctor.watch(run_dir=...)`: host memory, records kept in
memory, run-directory size, and how long `ampdoctor.diagnose` takes on it.

    python benchmarks/longrun.py [--steps 100000]
"""
import argparse
import os
import resource
import tempfile
import time

import torch
import torch.nn as nn

import ampdoctor


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100_000)
    a = p.parse_args()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(2, 4)
    with tempfile.TemporaryDirectory() as d:
        rd = os.path.join(d, "run")
        marks = {}
        t0 = time.perf_counter()
        with ampdoctor.watch(m, opt, sc, run_dir=rd) as w:
            for i in range(a.steps):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = m(x).float().pow(2).mean()
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
                if i + 1 in (10_000, a.steps // 2, a.steps):
                    marks[i + 1] = (rss_mb(), len(w.steps))
        train_s = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(rd, f)) for f in os.listdir(rd) if os.path.isfile(os.path.join(rd, f)))
        t = time.perf_counter()
        rep = ampdoctor.diagnose(rd)
        diag_s = time.perf_counter() - t
    print(f"steps={a.steps} train={train_s:.1f}s ({1e3 * train_s / a.steps:.2f} ms/step)")
    for k, (r, n) in sorted(marks.items()):
        print(f"  after {k:>7} steps: RSS {r:7.1f} MiB, records in memory {n}")
    for f in rep.findings:
        print("  finding:", f.one_line()[:160])
    print(f"run dir {size / 2 ** 20:.2f} MiB; diagnose {diag_s:.2f}s; findings {len(rep.findings)}; "
          f"maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
