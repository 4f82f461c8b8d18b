"""Time `ampdoctor.replay` on one GPT-2-small batch (B=8, T=1024) and check what it says, healthy and broken.

    python benchmarks/replay_gpt2.py [--device cuda] [--B 8] [--T 1024] [--layers 12]

Builds GPT2LMHeadModel from a config (no download), in train mode with its default dropout, and replays:
1. the healthy model: the replay (fp32 shadow and what-if included) must report no warning and no error — the
   shadow compares fp16 and fp32 with dropout off on both sides (on CUDA, SDPA's fused fp16 kernel and the fp32
   kernel draw different dropout masks);
2. the same model with `transformer.h[5].mlp.c_fc`'s weight multiplied by 1e5 (a weight spike): its fp16 addmm
   really overflows (checked on the model itself first), and the top finding must be `overflow` at that module,
   op `aten::addmm`, forward.
Timings of "origin + shadow" (what-if and fix search off) and of the full replay are printed. Exits 1 when a
check fails.
"""
import argparse
import sys
import tempfile
import time

import torch

import ampdoctor

SPIKED = "transformer.h.5.mlp.c_fc"


def _timed(cap, m, device, **kw):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    rep = ampdoctor.replay(cap, model=m, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    return rep, time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    a = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=a.layers)).to(a.device).train()
    ids = torch.randint(0, 50257, (a.B, a.T), device=a.device)
    failures = []
    with tempfile.TemporaryDirectory() as d:
        with torch.autocast(a.device, dtype=torch.float16):
            healthy = ampdoctor.save_batch(f"{d}/healthy", m, input_ids=ids, labels=ids)
        rep, dt = _timed(healthy, m, a.device)
        bad = [f.one_line() for f in rep.findings if f.severity in ("error", "warning")]
        print(f"healthy, train mode, dropout on: full replay {dt:.2f} s; warnings/errors: {len(bad)}")
        failures += [f"healthy replay: {b}" for b in bad]

        with torch.no_grad():
            m.get_submodule(SPIKED).weight.mul_(1e5)
        seen = {}

        def check(mod, args, out):   # returns None: the output is left as it is
            seen.setdefault("finite", bool(torch.isfinite(out).all()))
        h = m.get_submodule(SPIKED).register_forward_hook(check)
        with torch.no_grad(), torch.autocast(a.device, dtype=torch.float16):
            m(input_ids=ids)
        h.remove()
        if seen.get("finite", True):
            failures.append(f"the injected spike did not overflow {SPIKED} in fp16: the benchmark checks nothing")
        with torch.autocast(a.device, dtype=torch.float16):
            spiked = ampdoctor.save_batch(f"{d}/spiked", m, input_ids=ids, labels=ids)
        for label, kw in (("origin + shadow", dict(whatif=False, fix_search=False)), ("full", {})):
            rep, dt = _timed(spiked, m, a.device, **kw)
            top = rep.findings[0] if rep.findings else None
            got = (top.rule, top.module, top.op, top.phase) if top else None
            print(f"spiked {SPIKED} x1e5, replay ({label}): {dt:.2f} s; top finding: {got}")
            if got != ("overflow", SPIKED, "aten::addmm", "forward"):
                failures.append(f"spiked replay ({label}): top finding {got}, expected overflow at {SPIKED} "
                                "aten::addmm forward")
            elif label == "full":
                print(f"  fix: {top.fix.splitlines()[0]}")
                print(f"  fix search: {rep.data['replay']['fix'].get('modules')}")
    for f in failures:
        print("FAIL:", f)
    print("OK" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
