"""Run the real-code corpus and print one table (last): per case, whether watching changed anything (steps
recorded, losses bitwise, internal errors) and what ampdoctor said (warnings, errors, first three findings)
against what it should say. A measurement: exits 0 even with FAIL rows, non-zero only if the runner crashed.

    PYTHONPATH=. python benchmarks/realworld/run.py --device cpu --size tiny --json rw.json
    PYTHONPATH=. python benchmarks/realworld/run.py --device cuda --size small --compile all --json rw.json

Cases are `<model>/<what>` (e.g. `gpt2/healthy`, `nanogpt/lr=10`); `--cases` takes names or prefixes
(`nanogpt`, `healthy`, `spike`). On CUDA, deterministic algorithms are requested (warn_only): the kernels that
have no deterministic implementation are listed per case, and only then are losses compared with a tolerance
(marked `~`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks.realworld` importable from the repo root
    # appended, so that an ampdoctor named by PYTHONPATH (e.g. a snapshot of a commit) is the one measured
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _select(cases, wanted, dtypes, kinds, compiled="both", device=None):
    out = []
    for c in cases:
        if device is not None and device not in c.devices:
            continue
        if compiled != "both" and c.compiled != (compiled == "yes"):
            continue
        if dtypes and c.dtype not in dtypes:
            continue
        if kinds and c.kind not in kinds:
            continue
        if wanted and not any(c.name == w or c.name.startswith(w) or w in c.name.split("/")[1] for w in wanted):
            continue
        out.append(c)
    return out


def _commit(root):
    """The commit of the ampdoctor measured: a COMMIT file beside a snapshot (git archive), else git describe."""
    if os.path.exists(os.path.join(root, "COMMIT")):
        return open(os.path.join(root, "COMMIT")).read().strip() + " (snapshot)"
    try:
        import subprocess
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=root, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def table(results) -> str:
    cols = ["case", "dtype", "comp", "steps", "losses", "int.err", "W", "E", "top-3 findings", "expected",
            "result"]
    rows = []
    for r in results:
        rw = "" if r.get("replay_n_warning") is None else f"+{r['replay_n_warning']}"
        re_ = "" if r.get("replay_n_error") is None else f"+{r['replay_n_error']}"
        rows.append([r["case"], {"float16": "fp16", "bfloat16": "bf16"}.get(r["dtype"], r["dtype"]),
                     "y" if r["compiled"] else "n", f"{r.get('steps_recorded')}/{r['iterations']}",
                     r.get("losses_equal", "-"), str(len(r.get("internal_errors") or [])),
                     f"{r.get('n_warning', '-')}{rw}", f"{r.get('n_error', '-')}{re_}",
                     ", ".join(r.get("top3") or []) or "-", r.get("expected", "-"),
                     r["verdict"] + (f" ({'; '.join(r['why'])})" if r.get("why") else "")])
    w = [max(len(c), *(len(x[i]) for x in rows)) if rows else len(c) for i, c in enumerate(cols)]
    w = [min(x, cap) for x, cap in zip(w, (28, 5, 4, 7, 11, 7, 5, 5, 75, 60, 60))]
    fmt = lambda xs: " | ".join(str(x)[:w[i]].ljust(w[i]) for i, x in enumerate(xs))  # noqa: E731
    lines = [fmt(cols), "-+-".join("-" * x for x in w)] + [fmt(x) for x in rows]
    n = sum(r["verdict"] == "PASS" for r in results)
    lines.append(f"{n}/{len(results)} PASS   (W/E: report warnings/errors; +N: the healthy batch's save_batch+replay;"
                 " losses: == bitwise, ~x within a tolerance where a kernel is nondeterministic, DIFF)")
    nd = sorted({k for r in results for k in r.get("nondeterministic_ops") or []})
    if nd:
        lines.append("nondeterministic kernels seen (torch.use_deterministic_algorithms warn_only): " + " | ".join(nd))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--cases", nargs="*", default=[], help="names or prefixes (default: all)")
    p.add_argument("--dtype", nargs="*", default=[], choices=["float16", "bfloat16"])
    p.add_argument("--kind", nargs="*", default=[], choices=["healthy", "injected"])
    p.add_argument("--compile", default="nanogpt",
                   help="models whose healthy runs are also compiled: comma list, 'all' or 'none' (default nanogpt)")
    p.add_argument("--no-compile", action="store_true", help="same as --compile none")
    p.add_argument("--compiled", default="both", choices=["both", "yes", "no"],
                   help="run only the compiled (yes) or only the eager (no) cases")
    p.add_argument("--quick", action="store_true", help="half the iterations")
    p.add_argument("--every", type=int, default=None, help="watch(every=N) (default: ampdoctor's default)")
    p.add_argument("--headroom", action="store_true", help="watch(headroom=True) in every case (always-on headroom)")
    p.add_argument("--max-iters", type=int, default=0, help="cap every case's iterations (a smoke test)")
    p.add_argument("--min-iters", type=int, default=0,
                   help="run every case at least this many iterations (long healthy runs: warm-up, then settling)")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting new cases after this many seconds")
    p.add_argument("--json", default=None, help="write the results here (rewritten after every case)")
    p.add_argument("--keep-runs", default=None, help="keep each watched run's run_dir under this folder")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: 1 on cpu, as is on cuda)")
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)

    if a.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    from benchmarks.realworld import cases as C
    from benchmarks.realworld import harness

    comp = () if a.no_compile or a.compile == "none" else (C.MODELS if a.compile == "all" else
                                                          tuple(x for x in a.compile.split(",") if x))
    sel = _select(C.all_cases(comp), a.cases, a.dtype, a.kind, a.compiled, a.device)
    # eager healthy first, then the injected failures, compiled runs last (the slow ones)
    sel.sort(key=lambda c: (c.compiled, c.kind != "healthy"))
    if a.max_iters:
        sel = [dataclasses.replace(c, iters={k: min(v, a.max_iters) for k, v in c.iters.items()}) for c in sel]
    if a.min_iters:
        sel = [dataclasses.replace(c, iters={k: max(v, a.min_iters) for k, v in c.iters.items()}) for c in sel]
    if a.list:
        for c in sel:
            print(c.name, c.dtype, "compiled" if c.compiled else "eager", c.kind)
        return 0
    if a.threads or a.device == "cpu":
        torch.set_num_threads(a.threads or 1)
    if a.device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    if a.keep_runs:
        os.makedirs(a.keep_runs, exist_ok=True)
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "python": platform.python_version(), "device": a.device, "size": a.size, "quick": a.quick,
           "every": a.every,
           "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
           "threads": torch.get_num_threads()}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    import ampdoctor
    env["ampdoctor"] = root = os.path.dirname(os.path.dirname(os.path.abspath(ampdoctor.__file__)))
    env["git"] = _commit(root)
    results, t0 = [], time.perf_counter()
    for i, c in enumerate(sel):
        tag = f"{c.name} {c.dtype} {'compiled' if c.compiled else 'eager'}"
        if a.budget_s and time.perf_counter() - t0 > a.budget_s:
            results.append({"case": c.name, "dtype": c.dtype, "compiled": c.compiled, "kind": c.kind,
                            "iterations": 0, "verdict": "SKIP", "why": ["over --budget-s"]})
            continue
        t = time.perf_counter()
        print(f"[{i + 1}/{len(sel)}] {tag} ...", file=sys.stderr, flush=True)
        try:
            if a.headroom:
                c = dataclasses.replace(c, headroom=True)
            r = harness.run_case(c, a.size, a.device, a.quick, a.keep_runs, a.every)
        except Exception as e:  # noqa: BLE001 - the harness itself failed on this case
            import traceback
            r = {"case": c.name, "dtype": c.dtype, "compiled": c.compiled, "kind": c.kind, "iterations": 0,
                 "verdict": "FAIL", "why": [f"harness: {type(e).__name__}: {e}"[:200]],
                 "traceback": traceback.format_exc()}
        r["seconds"] = time.perf_counter() - t
        print(f"    {r['verdict']} in {r['seconds']:.1f}s {'; '.join(r.get('why') or [])}", file=sys.stderr,
              flush=True)
        results.append(r)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"env": env, "results": results, "seconds": time.perf_counter() - t0}, f, indent=1,
                          default=str)
    env["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\nrealworld corpus · {env['date']} · torch {env['torch']} · {env['gpu'] or 'cpu'} · size {a.size}"
          f" · every={a.every or 'default'} · {env['seconds']} s · ampdoctor from {env['ampdoctor']} ({env['git']})")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
