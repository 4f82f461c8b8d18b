"""Issue 18's exact scenario on a GPU: Hugging Face GPT-2 small (124M, from its config), B=8, T=1024, fp16 +
GradScaler at its default scale, gradient checkpointing on, `ampdoctor.watch` with the default sampling; at step
4 one MLP projection's weights are multiplied by 1e6, so every later forward overflows. Prints the first three
findings, `first_bad_step`, the benign backoff steps and the captures; exit 1 unless the report names
`transformer.h.5.mlp.c_proj` with an op at step 4, from a capture of step 4.

    PYTHONPATH=. python benchmarks/issue18_gpt2.py [--steps 12]
"""
import argparse
import os
import sys
import tempfile
import warnings

import torch

import ampdoctor


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer config (a CPU smoke test)")
    a = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=128, vocab_size=512) if a.tiny else GPT2Config()
    B, T = (2, 64) if a.tiny else (8, 1024)
    layer = cfg.n_layer - 1 if a.tiny else 5
    model = GPT2LMHeadModel(cfg).to(a.device).train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4)
    scaler = torch.amp.GradScaler(a.device)
    run = tempfile.mkdtemp(prefix="issue18-")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=run)
    g = torch.Generator().manual_seed(0)
    target = f"transformer.h.{layer}.mlp.c_proj"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(a.steps):
            if step == 4:
                with torch.no_grad():
                    model.get_submodule(target).weight.mul_(1e6)
            ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(a.device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(a.device, dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            print(f"step {step}: loss {loss.item():.4g} scale {scaler.get_scale():g}", flush=True)
        w.close()
        rep = w.report()
    for f in rep.findings:
        if f.rule == "replay_error" or "replay" in f.message[:40]: print("  replay:", f.message[:300])
    s = rep.summary
    print(f"\nfirst_bad_step {s['first_bad_step']}, benign backoff {s['benign_backoff_steps']}, "
          f"captures {[os.path.basename(c) for c in s['captures']]}")
    for f in rep.findings[:3]:
        print(f"  [{f.severity}] {f.rule} {f.module} {f.op} step {f.step}")
    top = rep.findings[:3]
    ok = (any(f.rule == "overflow" and f.module == target and f.op and f.step == 4 for f in top)
          and s["first_bad_step"] == 4 and any(os.path.basename(c) == "4" for c in s["captures"]))
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
