"""Optimizer steps fused into the backward on the GPU (record/optsink.py step_in_backward): PyTorch's "optimizer step
in backward" recipe (torchtune's optimizer_in_bwd) on the nanoGPT-like model of cuda_entries.py: one AdamW per
parameter, stepped and zeroed in a post-accumulate-grad hook (on CUDA these hooks run on autograd's device thread),
watched with optimizer=None, fp16 autocast without a scaler (the healthy runs also bf16; fp16 without a
scaler may be told its gradients underflow, which is true). At step BAD one MLP
weight is multiplied (a spike). Prints, per case, the report's step count and top three, and whether the losses were
bitwise identical with and without the watch (healthy cases), then a short table last.

    python benchmarks/cuda_opt_in_bwd.py [--device cuda] [--steps 24]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampdoctor  # noqa: E402
from benchmarks.cuda_entries import GPT  # noqa: E402

BAD = 11


def run(dev, steps, watch, spike, dtype):
    torch.manual_seed(0)
    m = GPT().to(dev)
    opts = {p: torch.optim.AdamW([p], lr=3e-4) for p in m.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(hook)
    w = ampdoctor.watch(m, optimizer=None, scaler=None, run_dir=tempfile.mkdtemp(prefix="cuda-oib-")) \
        if watch else None
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for i in range(steps):
        idx = torch.randint(0, 256, (8, 64), generator=g).to(dev)
        if spike and i == BAD:
            with torch.no_grad():
                m.blocks[2].fc.weight.mul_(1e6)
        with torch.autocast(dev.type, dtype=dtype):
            logits = m(idx[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), idx[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return losses, rep


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args()
    dev = torch.device(a.device)
    rows = []
    for dt in (torch.float16, torch.bfloat16):
        plain, _ = run(dev, a.steps, False, False, dt)
        watched, rep = run(dev, a.steps, True, False, dt)
        bad = [f.one_line()[:140] for f in rep.findings if f.severity in ("warning", "error")]
        n = rep.summary.get("steps")
        # (fp16 without a GradScaler: its gradients' underflow is a true finding, not a false alarm: quiet is
        # asked of bf16 only)
        quiet = not bad or dt is torch.float16 and all(b.startswith("[error] underflow") for b in bad)
        rows.append((f"healthy {str(dt)[6:]}", "PASS" if plain == watched and quiet and n == a.steps else "FAIL",
                     f"steps={n} bitwise={plain == watched} warnings/errors={bad}"))
    losses, rep = run(dev, a.steps, True, True, torch.float16)
    top = [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]
    ok = any(r in ("overflow", "nan_origin") and (mod or "").startswith("blocks.2.fc") and s == BAD
             and sev == "error" for r, mod, s, sev in top)
    rows.append(("spike@blocks.2.fc float16", "PASS" if ok else "FAIL", f"steps={rep.summary.get('steps')} top3={top}"))
    print(f"torch {torch.__version__} device {dev}")
    print("| case | result | detail |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
