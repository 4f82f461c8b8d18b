"""CUDA sanity cases for the device machine: real fp16 numerics, CUDA GradScaler (asynchronous reads), fused
statistics. Each case trains a few steps under `ampdoctor.watch(every=1)` and checks the verdict.

    python benchmarks/cuda_sanity.py        # prints a table; exit code 1 if any case disagrees

Cases: healthy tiny GPT (no warning/error), two optimizers sharing one scaler (no warning/error), a module
that emits a -inf causal mask (no warning/error), SwiGLU product overflow (overflow at the MLP), a loss summed
in fp16 outside the model (overflow, module None).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import ampdoctor  # noqa: E402
from scenarios import TinyGPT  # noqa: E402
from test_failures import _WideMLPModel as MLPModel  # noqa: E402
from test_healthy import MaskModuleModel  # noqa: E402

DEV = torch.device(os.environ.get("AMPDOCTOR_SANITY_DEVICE", "cuda"))  # "cpu" to try the cases here


def loop(models, opts, batch, loss_fn, steps=6, every=1):
    sc = torch.amp.GradScaler(DEV.type)
    root = models[0] if len(models) == 1 else nn.ModuleDict({f"m{i}": m for i, m in enumerate(models)})
    with ampdoctor.watch(root, optimizer=opts[0], scaler=sc, every=every) as w:
        for _ in range(steps):
            for o in opts:
                o.zero_grad()
            with torch.autocast(DEV.type, dtype=torch.float16):
                losses = [loss_fn(m(*batch)) for m in models]
            for i, loss in enumerate(losses):
                sc.scale(loss).backward(retain_graph=i < len(losses) - 1)
            for o in opts:
                sc.unscale_(o)
            for m in models:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            for o in opts:
                sc.step(o)
            sc.update()
    return w.report()


def main() -> int:
    torch.manual_seed(0)
    rows = []

    def quiet(rep):
        return not [f for f in rep.findings if f.severity in ("error", "warning")]

    idx = torch.randint(0, 64, (4, 16), device=DEV)
    m = TinyGPT().to(DEV)
    rep = loop([m], [torch.optim.AdamW(m.parameters(), lr=1e-3)], (idx, torch.roll(idx, -1, 1)),
               lambda out: out["loss"])
    rows.append(("healthy TinyGPT", quiet(rep), rep.summary["verdict"]))

    a, b = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(DEV), \
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(DEV)
    x = torch.randn(16, 8, device=DEV)
    rep = loop([a, b], [torch.optim.SGD(a.parameters(), lr=1e-2), torch.optim.Adam(b.parameters(), lr=1e-3)],
               (x,), lambda out: out.float().pow(2).mean())
    rows.append(("two optimizers, one scaler", quiet(rep), rep.summary["verdict"]))

    m = MaskModuleModel().to(DEV)
    rep = loop([m], [torch.optim.AdamW(m.parameters(), lr=1e-3)], (torch.randn(2, 6, 8, device=DEV),),
               lambda out: out.float().pow(2).mean())
    rows.append(("-inf mask module", quiet(rep), rep.summary["verdict"]))

    m = MLPModel().to(DEV)
    with torch.no_grad():
        m.mlp.gate.weight.mul_(400)
        m.mlp.up.weight.mul_(400)
    rep = loop([m], [torch.optim.AdamW(m.parameters(), lr=1e-3)], (torch.randn(8, 16, device=DEV) * 4,),
               lambda out: out.float().pow(2).mean(), steps=3)
    top = [(f.rule, f.module) for f in rep.findings[:3]]
    rows.append(("SwiGLU product overflow", ("overflow", "mlp") in top, str(top)))

    def fp16_sum(out):
        # autocast runs pow and sum in fp32 on CUDA (not on the CPU): the user's fp16 sum is written with
        # autocast off, so that it overflows fp16 on both
        with torch.autocast(DEV.type, enabled=False):
            return (out.half() * 30).pow(2).sum()
    m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64)).to(DEV)
    rep = loop([m], [torch.optim.AdamW(m.parameters(), lr=1e-3)], (torch.randn(256, 8, device=DEV) * 10,),
               fp16_sum, steps=3)
    top = [(f.rule, f.module) for f in rep.findings[:3]]
    rows.append(("fp16 sum loss outside the model", ("overflow", None) in top, str(top)))

    print(f"{'case':34} {'ok':5} verdict / top findings")
    for name, ok, what in rows:
        print(f"{name:34} {str(ok):5} {what[:110]}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
