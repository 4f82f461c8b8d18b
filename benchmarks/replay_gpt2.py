"""Time `ampdoctor.replay` on one GPT-2-small batch (B=8, T=1024) with op-level origin and the fp32 shadow.

    python benchmarks/replay_gpt2.py [--device cuda] [--B 8] [--T 1024]

Builds GPT2LMHeadModel from a config (no download), injects an fp16 overflow into one MLP projection, captures
the batch with `ampdoctor.save_batch` and replays it (what-if and fix search off, then the full replay).
"""
import argparse
import tempfile
import time

import torch

import ampdoctor


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    a = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config()).to(a.device)
    with torch.no_grad():
        m.transformer.h[5].mlp.c_proj.weight.mul_(3e3)
    ids = torch.randint(0, 50257, (a.B, a.T), device=a.device)
    with tempfile.TemporaryDirectory() as d, torch.autocast(a.device, dtype=torch.float16):
        cap = ampdoctor.save_batch(f"{d}/cap", m, input_ids=ids, labels=ids)
        for label, kw in (("origin + shadow", dict(whatif=False, fix_search=False)), ("full", {})):
            if a.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            rep = ampdoctor.replay(cap, model=m, **kw)
            if a.device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            top = rep.findings[0] if rep.findings else None
            print(f"replay ({label}): {dt:.2f} s; top finding: "
                  f"{(top.rule, top.module, top.op) if top else None}")


if __name__ == "__main__":
    main()
