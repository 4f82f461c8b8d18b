"""Environment rules: env_tf32 — TF32 switches that do nothing on this device, or that are off where they'd
help; deprecated_api — deprecated or legacy AMP APIs in use (torch.cuda.amp.*, apex amp), with the modern form."""
from __future__ import annotations

from ..env import MODERN
from ..findings import Finding
from .registry import RuleConfig, RunData, register


def check_env(env: dict, *, uses_fp32_compute: bool | None = None) -> list[Finding]:
    """Pure: findings for one environment dict (ampdoctor.env.collect_env)."""
    out = []
    tf32_on = env.get("allow_tf32_matmul") or env.get("float32_matmul_precision") in ("high", "medium")
    cc = env.get("compute_capability")
    ev = {k: env.get(k) for k in ("device", "compute_capability", "allow_tf32_matmul", "allow_tf32_cudnn",
                                  "float32_matmul_precision")}
    ev["rank_hint"] = 80
    if cc is not None and tuple(cc) < (8, 0) and tf32_on:
        out.append(Finding("env_tf32", "warning", "env", None, None, None,
                           f"TF32 is switched on, but {env.get('device')} (compute capability {cc[0]}.{cc[1]}) has "
                           "no TF32 units: the flag does nothing here.",
                           "TF32 needs Ampere or newer (8.0+). On this GPU use fp16 autocast + GradScaler for speed.",
                           ev))
    elif cc is None and tf32_on:
        out.append(Finding("env_tf32", "info", "env", None, None, None,
                           "TF32 / float32_matmul_precision is set but this run is on the CPU, where TF32 does not "
                           "apply; on an Ampere+ GPU it would round fp32 matmul inputs to a 10-bit mantissa.",
                           "Leave it as is for speed on GPUs; use `torch.set_float32_matmul_precision('highest')` "
                           "for numerically sensitive code (solvers, Gram matrices).", ev))
    elif cc is not None and tuple(cc) >= (8, 0) and not tf32_on and uses_fp32_compute:
        out.append(Finding("env_tf32", "info", "env", None, None, None,
                           f"{env.get('device')} supports TF32 but it is off, and this run computes in fp32.",
                           "`torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True` "
                           "(or `torch.set_float32_matmul_precision('high')`) is a zero-change speed-up.", ev))
    return out


def check_deprecated(env: dict) -> list[Finding]:
    """Pure: one deprecated_api finding (info) per legacy AMP API recorded in env["deprecated_amp"]."""
    out = []
    for name in env.get("deprecated_amp") or []:
        modern = MODERN.get(name, "`torch.amp.GradScaler(\"cuda\")` and `torch.autocast(\"cuda\", ...)`")
        out.append(Finding("deprecated_api", "info", "env", None, None, None,
                           f"`{name}` is deprecated (or legacy); it still works but warns and may be removed.",
                           f"Use {modern}.", {"api": name, "modern": modern, "rank_hint": 95}))
    return out


@register("env_tf32", emits=("env_tf32",))
def env_tf32(run: RunData, cfg: RuleConfig) -> list[Finding]:
    uses_fp32 = bool(run.steps) and all(not r.autocast for r in run.steps) and \
        all(p[2] == "float32" for p in run.meta.params)
    return check_env(run.meta.env or {}, uses_fp32_compute=uses_fp32)


@register("deprecated_api", emits=("deprecated_api",))
def deprecated_api(run: RunData, cfg: RuleConfig) -> list[Finding]:
    return check_deprecated(run.meta.env or {})
