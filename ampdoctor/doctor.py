"""`ampdoctor doctor`: the environment check without training (GPU, TF32, bf16, torch version, AMP APIs) with a
precision recommendation as in the seed article, and a check of a DeepSpeed config's fp16/bf16 block."""
from __future__ import annotations

import json

from .env import collect_env
from .errors import BadInput
from .findings import Finding, Report
from .rules.envrules import check_env

__all__ = ["run_doctor", "recommend", "check_deepspeed"]


def recommend(env: dict) -> Finding:
    cc = env.get("compute_capability")
    if cc is None:
        msg = ("No CUDA GPU: CPU autocast supports bf16 (preferred where the CPU has bf16 units) and fp16 "
               "(use torch.amp.GradScaler('cpu')).")
        fix = "with torch.autocast('cpu', dtype=torch.bfloat16): loss = model(x)"
    elif tuple(cc) >= (8, 0):
        msg = (f"{env['device']} (sm_{cc[0]}{cc[1]}) supports bf16: use bf16 autocast (fp32's range, no loss "
               "scaling). TF32 is the zero-change option for fp32 code.")
        fix = ("with torch.autocast('cuda', dtype=torch.bfloat16): loss = model(x)\n"
               "# or, for unchanged fp32 code: torch.backends.cuda.matmul.allow_tf32 = True; "
               "torch.backends.cudnn.allow_tf32 = True")
    else:
        msg = (f"{env['device']} (sm_{cc[0]}{cc[1]}) has no bf16/TF32 units: use fp16 autocast with a GradScaler.")
        fix = ("scaler = torch.amp.GradScaler('cuda')\nwith torch.autocast('cuda', dtype=torch.float16): "
               "loss = model(x)\nscaler.scale(loss).backward(); scaler.unscale_(opt); clip; scaler.step(opt); "
               "scaler.update()")
    return Finding("env_tf32", "info", "env", None, None, None, msg, fix, dict(env, rank_hint=99))


def check_deepspeed(cfg: dict) -> list[Finding]:
    out = []
    fp16 = cfg.get("fp16") or {}
    bf16 = cfg.get("bf16") or cfg.get("bfloat16") or {}
    if not isinstance(fp16, dict) or not isinstance(bf16, dict):
        raise BadInput("DeepSpeed config: 'fp16' and 'bf16' must be objects")

    def f(rule, sev, msg, fix, ev):
        out.append(Finding(rule, sev, "scaler", None, None, None, msg, fix, dict(ev, rank_hint=50)))
    if fp16.get("enabled") and bf16.get("enabled"):
        f("scaler_misorder", "error",
          "Both fp16 and bf16 are enabled in the DeepSpeed config; DeepSpeed refuses or picks one.",
          "Enable exactly one: \"bf16\": {\"enabled\": true} on Ampere+, else fp16.", {"fp16": fp16, "bf16": bf16})
    if fp16.get("enabled"):
        ls = fp16.get("loss_scale", 0)
        if ls not in (0, None):
            f("loss_scale_collapse", "warning",
              f"fp16 uses a static loss scale ({ls}): overflow steps are not skipped and the scale "
              "never adapts.", "Use dynamic loss scaling: \"loss_scale\": 0.", {"loss_scale": ls})
        p = fp16.get("initial_scale_power", 16)
        if isinstance(p, (int, float)) and p > 24:
            f("loss_scale_collapse", "warning",
              f"initial_scale_power={p} (2^{p}) makes the first steps overflow for a long time.",
              "Use 16 (the default) or lower.", {"initial_scale_power": p})
        mn = fp16.get("min_loss_scale", 1)
        if isinstance(mn, (int, float)) and mn < 1:
            f("loss_scale_collapse", "warning",
              f"min_loss_scale={mn} lets the scale collapse below 1, hiding persistent NaN.",
              "Keep min_loss_scale >= 1 so a collapse stops training loudly.", {"min_loss_scale": mn})
        w = fp16.get("loss_scale_window", 1000)
        if isinstance(w, (int, float)) and w < 100:
            f("loss_scale_collapse", "warning",
              f"loss_scale_window={w} grows the scale very often, causing frequent overflow skips.",
              "Use ~1000 (the default).", {"loss_scale_window": w})
        h = fp16.get("hysteresis", 2)
        if isinstance(h, (int, float)) and h > 10:
            f("loss_scale_collapse", "info", f"hysteresis={h} delays backoff for many overflowing steps.",
              "Use the default 2.", {"hysteresis": h})
    return out


def run_doctor(deepspeed: str | None = None) -> Report:
    env = collect_env()
    findings = check_env(env) + [recommend(env)]
    if deepspeed:
        try:
            with open(deepspeed, encoding="utf-8") as fh:
                cfg = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInput(f"{deepspeed}: not a readable JSON DeepSpeed config ({e})") from None
        if not isinstance(cfg, dict):
            raise BadInput(f"{deepspeed}: a DeepSpeed config must be a JSON object")
        findings += check_deepspeed(cfg)
    from .analysis import rank
    findings = rank(findings)
    return Report(findings, {"verdict": findings[0].message if findings else "ok", "env": env}, {"env": env})
