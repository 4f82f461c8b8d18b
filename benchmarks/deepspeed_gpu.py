"""DeepSpeed on one GPU (issue 17): what `ampdoctor.watch(engine)` reports, and what it costs.

A GPT-2-small-shaped model from a transformers GPT2Config, DeepSpeed fp16 (dynamic loss scale) unless said:

  healthy      ZeRO-1 fp16, 40 steps                       -> 0 errors, 0 warnings (early backoffs: info)
  spike        the same, c_fc of layer 2 x3e5 at step 20   -> overflow/nan_origin at that layer's MLP, top 3
  static       ZeRO-1, static loss_scale 2^32              -> skipped_steps (static scale), top 3
  zero0_fp16   ZeRO-0 fp16 (DeepSpeed 0.19.x: the backward never applies the scale, DeepSpeed#8393)
                                                          -> scaler_misorder at engine.backward
  bf16         ZeRO-0 bf16                                 -> 0 errors, 0 warnings
  overhead     default watch vs unwatched, ZeRO-1 fp16, interleaved blocks, medians of per-step times

(ZeRO stage 1 for the fp16 cases: on one GPU it is the stage whose backward applies DeepSpeed's loss scale.)
Prints one JSON line per case and a table last; writes $OUT/deepspeed_gpu.json when OUT is set.
Run:  python3 benchmarks/deepspeed_gpu.py   (deepspeed, transformers installed; one CUDA GPU)
"""
from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    _port = _s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import deepspeed  # noqa: E402
from deepspeed.utils import logger as _dslog  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import ampdoctor  # noqa: E402

_dslog.setLevel(logging.ERROR)
STEPS, B, T, SPIKE_AT, SPIKE_LAYER = 40, 8, 512, 20, 2
GPT = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
CUDA = torch.cuda.is_available()
if not CUDA:  # a dry run of the script itself on a CPU (DeepSpeed's CPU accelerator): a tiny model
    STEPS, B, T, SPIKE_AT = 12, 4, 32, 5
    GPT = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=64)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def engine_for(precision="fp16", stage=1, loss_scale=0):
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": loss_scale, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    else:
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(**GPT))
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return engine


def batches(engine, n, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, GPT["vocab_size"], (B, T), generator=g).to(engine.device) for _ in range(n)]


def train(engine, data, spike_at=None):
    err = None
    try:
        for i, ids in enumerate(data):
            if i == spike_at:
                with torch.no_grad():
                    engine.module.transformer.h[SPIKE_LAYER].mlp.c_fc.weight.mul_(3e5)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    except Exception as e:  # e.g. DeepSpeed stops at min_loss_scale ("Current loss scale already at minimum")
        err = f"{type(e).__name__}: {str(e)[:160]}"
    return err


def diagnose_case(name, expect, check, **kw):
    spike = kw.pop("spike_at", None)
    engine = engine_for(**kw)
    rd = tempfile.mkdtemp(prefix=f"ds_{name}_")
    t0 = time.time()
    w = ampdoctor.watch(engine, run_dir=rd)
    err = train(engine, batches(engine, STEPS), spike_at=spike)
    w.close()
    rep = w.report()
    s = rep.summary
    top = [(f.rule, f.severity, f.module, f.op, f.step) for f in rep.findings[:3]]
    row = {"case": name, "expect": expect, "ok": bool(check(rep)), "steps": len(w.steps),
           "errors": s["errors"], "warnings": s["warnings"], "infos": s["infos"], "top3": top,
           "skipped": engine.skipped_steps, "optimizer": type(engine.optimizer).__name__,
           "scales": [r.scale for r in w.steps][:: max(1, STEPS // 8)], "train_error": err,
           "seconds": round(time.time() - t0, 1), "run_dir": rd}
    print(json.dumps(row, default=str), flush=True)
    del engine
    if CUDA:
        torch.cuda.empty_cache()
    return row


def healthy(rep):
    return rep.summary["errors"] == 0 and rep.summary["warnings"] == 0


def in_top3(rules, prefix=None):
    def check(rep):
        return any(f.rule in rules and (prefix is None or (f.module or "").startswith(prefix))
                   for f in rep.findings[:3])
    return check


def overhead(blocks=6, n=15 if CUDA else 4):
    engine = engine_for("fp16", 1)
    data = batches(engine, n, seed=1)
    train(engine, data[:5])  # warm-up (allocator, kernels, the scale's first backoffs)
    times = {"plain": [], "watched": []}
    for b in range(blocks):
        for mode in (("plain", "watched") if b % 2 == 0 else ("watched", "plain")):
            w = ampdoctor.watch(engine) if mode == "watched" else None
            for ids in data:
                sync()
                t = time.perf_counter()
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                sync()
                times[mode].append(time.perf_counter() - t)
            if w is not None:
                w.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"case": "overhead", "plain_ms": round(med["plain"] * 1e3, 2), "watched_ms": round(med["watched"] * 1e3, 2),
           "ratio": round(med["watched"] / med["plain"], 3), "steps_each": len(times["plain"]),
           "ok": med["watched"] / med["plain"] <= 1.05}
    print(json.dumps(row), flush=True)
    return row


def main():
    env = {"gpu": torch.cuda.get_device_name(0) if CUDA else "cpu (dry run)", "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "ampdoctor": ampdoctor.__version__, "model": GPT, "B": B, "T": T}
    print(json.dumps(env), flush=True)
    mlp = f"transformer.h.{SPIKE_LAYER}.mlp"
    rows = [
        diagnose_case("healthy", "0 err 0 warn", healthy, precision="fp16", stage=1),
        diagnose_case("spike", f"overflow/nan_origin at {mlp}", in_top3(("overflow", "nan_origin"), mlp),
                      precision="fp16", stage=1, spike_at=SPIKE_AT),
        diagnose_case("static", "skipped_steps (static scale)", in_top3(("skipped_steps",)),
                      precision="fp16", stage=1, loss_scale=2 ** 32),
        diagnose_case("zero0_fp16", "scaler_misorder (DeepSpeed#8393)",
                      in_top3(("scaler_misorder",)), precision="fp16", stage=0),
        diagnose_case("bf16", "0 err 0 warn", healthy, precision="bf16", stage=0),
    ]
    ov = overhead()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "deepspeed_gpu.json"), "w") as f:
            json.dump({"env": env, "cases": rows, "overhead": ov}, f, default=str, indent=1)
    print(f"\nDeepSpeed {env['deepspeed']}, torch {env['torch']}, {env['gpu']}, GPT-2 small shape, B={B} T={T}")
    print(f"| case | expected | ok | steps | err/warn/info | top finding |")
    print("|---|---|---|---:|---|---|")
    for r in rows:
        t = r["top3"][0] if r["top3"] else None
        top = f"{t[0]} [{t[1]}] {t[2]} {t[3] or ''} step {t[4]}" if t else "-"
        print(f"| {r['case']} | {r['expect']} | {'yes' if r['ok'] else 'NO'} | {r['steps']} | "
              f"{r['errors']}/{r['warnings']}/{r['infos']} | {top} |")
    print(f"| overhead | <= 1.05x | {'yes' if ov['ok'] else 'NO'} | {ov['steps_each']} | - | "
          f"{ov['ratio']}x ({ov['watched_ms']} vs {ov['plain_ms']} ms/step) |")


if __name__ == "__main__":
    main()
