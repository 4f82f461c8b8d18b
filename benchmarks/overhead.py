"""Overhead of ampdoctor against its peers, measured in one process.

Usage
-----
    python benchmarks/overhead.py --model cpu-gpt --device cpu               # small GPT, 2 CPU cores: ~1 min
    python benchmarks/overhead.py --model convnet --device cpu
    python benchmarks/overhead.py --model gpt2 --device cuda --json gpt2.json  # GPT-2 small, B=8, T=1024
    python benchmarks/overhead.py --model nanogpt --device cuda                # nanoGPT-style 6x384, block 256, B=64
    python benchmarks/overhead.py --bitwise --device cuda                    # watched == unwatched, 50 fp16 steps

Options: --steps N (timed steps per variant, default 30), --warmup N (untimed steps per variant, default 5),
--sync-steps N (CUDA: steps per variant counted for device->host syncs, default 4), --amp fp16|bf16|off
(default fp16 on CUDA, off on CPU: see below), --variants a,b,... (subset), --threads N (torch CPU threads),
--json OUT (everything, raw times included), --compile (each variant's forward through torch.compile, the watch
given the model itself, as nanoGPT's train.py with compile=True), --bitwise (run the bitwise-identity check
instead of the benchmark; --bitwise-steps N, default 50), --baseline DIR (another checkout's ampdoctor, e.g. a
`git worktree` of the last commit, loaded beside this one as the package `ampdoctor_base`: a variant named
`default@base`, `every1@base`, ... watches with it, interleaved with the rest, so that a change in the watch's host
time is measured against the same host's plain step and the old code in one process, not across processes whose
host state differs by more than the change: `--variants plain,default,default@base`).

What it measures
----------------
One training step is `zero_grad(set_to_none) -> autocast forward -> scaler.scale(loss).backward() ->
scaler.step(opt) -> scaler.update()` with AdamW and a GradScaler. The variants, each on its own
`copy.deepcopy` of one model (same weights, its own optimizer, scaler and hooks), are run interleaved
(plain, default, every1, anomaly, hf, plain, default, ...) so that clock and thermal drift hit all alike:

    plain    the step as is
    default  ampdoctor.watch(model, optimizer=opt, scaler=scaler)          (ampdoctor's own sampling)
    headroom ampdoctor.watch(model, optimizer=opt, scaler=scaler, headroom=True)  (the series every step, opt-in)
    hroff    ampdoctor.watch(model, optimizer=opt, scaler=scaler, headroom=False) (the series on sampled steps only)
    every1   ampdoctor.watch(model, optimizer=opt, scaler=scaler, every=1)  (full per-layer stats every step)
    anomaly  the step inside torch.autograd.detect_anomaly()
    hf       transformers.debug_utils.DebugUnderflowOverflow(model)      (only when transformers imports)

Reported per variant: median step time (ms), ratio to plain's median, on CUDA the extra peak memory of one
step (max over the timed steps of max_memory_allocated minus the memory allocated when the step began,
minus plain's) and the device->host synchronisations per step, counted in a separate pass with
`torch.cuda.set_sync_debug_mode("warn")` and every warning recorded (plain's own count, e.g. GradScaler's
found_inf `.item()`, is shown too, so the extra is the difference). The table is printed last.

On CPU the default is `--amp off` (fp32 compute, GradScaler still enabled and used): on CPUs without native
fp16/bf16 matmul, autocast's low-precision GEMMs are emulated and 20-100x slower than fp32, which would bury
any hook overhead under the slow kernels. `--amp fp16` forces it.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

try:
    import ampdoctor
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ampdoctor

PACKAGES = {"": ampdoctor}  # variant suffix ("@base") -> the ampdoctor package its watch comes from (--baseline)


def load_baseline(checkout: str):
    """The ampdoctor package of another checkout, imported as `ampdoctor_base` (a copy under a temporary directory:
    the package imports itself relatively, so the copy is a second, independent ampdoctor in this process)."""
    import importlib
    import shutil
    import tempfile
    src = os.path.join(checkout, "ampdoctor")
    if not os.path.isdir(src):
        raise SystemExit(f"--baseline {checkout}: no ampdoctor/ there")
    root = tempfile.mkdtemp(prefix="ampdoctor-base-")
    shutil.copytree(src, os.path.join(root, "ampdoctor_base"), ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, root)
    return importlib.import_module("ampdoctor_base")

ALL_VARIANTS = ("plain", "default", "headroom", "hroff", "every1", "anomaly", "hf")


# ---------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class MLPLoss(nn.Module):
    """fixed_cost.py's 3-layer MLP with its MSE loss inside (the Variant loop takes a model returning the loss)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x).float(), y)


class TinyGPT(nn.Module):
    """GPT-style LM in plain torch: token + position embedding, pre-LN blocks, LM head. Returns the loss."""

    def __init__(self, vocab=2048, d=256, heads=4, layers=2, block=128, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class ConvNet(nn.Module):
    """Small CNN: conv-BN-ReLU(inplace) stages with pooling, then a linear classifier. Returns the loss."""

    def __init__(self, width=32, classes=10):
        super().__init__()
        w = width

        def stage(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))
        self.features = nn.Sequential(stage(3, w), stage(w, w), nn.MaxPool2d(2), stage(w, 2 * w),
                                      stage(2 * w, 2 * w), nn.MaxPool2d(2), stage(2 * w, 4 * w),
                                      nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(torch.flatten(self.features(x), 1)).float(), y)


def build(model_name: str, device: torch.device, seed: int = 0):
    """(model, batches, loss_of): `batches` is a list of (args, kwargs) used round-robin."""
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if model_name in ("cpu-gpt", "tiny"):
        if model_name == "tiny":
            cfg = dict(vocab=64, d=32, heads=2, layers=1, block=16)
            B, T = 2, 16
        else:
            cfg = dict(vocab=1024, d=128, heads=4, layers=3, block=64)
            B, T = 8, 64
        model = TinyGPT(**cfg)
        batches = []
        for _ in range(4):
            idx = torch.randint(0, cfg["vocab"], (B, T + 1), generator=g)
            batches.append(((idx[:, :-1].to(device), idx[:, 1:].to(device)), {}))
        loss_of = _identity
    elif model_name == "mlp":  # a step that is almost all framework overhead (fixed_cost.py's)
        model = MLPLoss()
        batches = [((torch.randn(32, 32, generator=g).to(device), torch.randn(32, 1, generator=g).to(device)), {})
                   for _ in range(4)]
        loss_of = _identity
    elif model_name == "convnet":
        model = ConvNet()
        B = 32
        batches = [((torch.randn(B, 3, 32, 32, generator=g).to(device),
                     torch.randint(0, 10, (B,), generator=g).to(device)), {}) for _ in range(4)]
        loss_of = _identity
    elif model_name in ("nanogpt", "nanogpt-host"):
        # nanogpt: issue 15's small real step: 6 layers, 384 wide, block 256, batch 64. nanogpt-host: the same modules
        # and calls at a width and batch where the step is all host work (the watch's fixed cost on a CPU)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from benchmarks.realworld.nanogpt import GPT, GPTConfig
        small = model_name == "nanogpt-host"
        model = GPT(GPTConfig(block_size=16 if small else 256, vocab_size=65, n_layer=6, n_head=6,
                              n_embd=48 if small else 384, dropout=0.2))
        B, T = (2, 16) if small else (64, 256)
        batches = []
        for _ in range(4):
            idx = torch.randint(0, 65, (B, T + 1), generator=g)
            batches.append(((idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)), {}))
        loss_of = _second
    elif model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_layer=12))
        B, T = 8, 1024
        batches = []
        for _ in range(4):
            ids = torch.randint(0, model.config.vocab_size, (B, T), generator=g).to(device)
            batches.append(((), {"input_ids": ids, "labels": ids}))
        loss_of = _hf_loss
    else:
        raise SystemExit(f"unknown --model {model_name!r} (cpu-gpt, convnet, gpt2, mlp, nanogpt, nanogpt-host, tiny)")
    return model.to(device).train(), batches, loss_of


def _identity(out):
    return out


def _second(out):
    return out[1]


def _hf_loss(out):
    return out.loss


# ---------------------------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------------------------
class Variant:
    """One way of running the step, on its own copy of the model with its own optimizer and scaler."""

    def __init__(self, name, model, device, amp_dtype, clip=True, compile=False):
        # "headroom:K:F:B" = headroom=True with ampdoctor.record.headroom's flush limits set for this variant's steps:
        # K pending tensors, F MiB of forward outputs, B MiB of gradients (a sweep, interleaved like the rest)
        self.name, _, flush = name.partition(":")
        self.label = name
        self.name, _, pkg = self.name.partition("@")  # "default@base": the --baseline checkout's watch
        self.pkg = PACKAGES[pkg and "@" + pkg]
        self.flush = [int(x) for x in flush.split(":")] if flush else None
        self.clip = clip
        self.model = model
        # --compile: the forward goes through torch.compile(model), as nanoGPT's train.py does with compile=True;
        # the watch is given the model itself (what a user passes), each variant compiles its own copy
        self.fwd = torch.compile(model) if compile else model
        self.device = device
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(device.type)
        self.amp_dtype = amp_dtype
        self.watch = None
        self.debug = None
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.syncs: float | None = None
        self.error: str | None = None

    def install(self):
        if self.name == "default":
            self.watch = self.pkg.watch(self.model, optimizer=self.opt, scaler=self.scaler)
        elif self.name == "every1":
            self.watch = self.pkg.watch(self.model, optimizer=self.opt, scaler=self.scaler, every=1)
        elif self.name == "headroom":
            self.watch = self.pkg.watch(self.model, optimizer=self.opt, scaler=self.scaler, headroom=True)
        elif self.name == "hroff":
            self.watch = self.pkg.watch(self.model, optimizer=self.opt, scaler=self.scaler, headroom=False)
        elif self.name == "hf":
            from transformers.debug_utils import DebugUnderflowOverflow
            self.debug = DebugUnderflowOverflow(self.model)

    def remove(self):
        if self.watch is not None:
            self.watch.close()
        if self.debug is not None:  # its hooks were registered without handles: remove them by owner
            for m in self.model.modules():
                for k, h in list(m._forward_hooks.items()):
                    if getattr(h, "__self__", None) is self.debug:
                        del m._forward_hooks[k]

    def step_ctx(self):
        return torch.autograd.detect_anomaly() if self.name == "anomaly" else nullcontext()

    def step(self, batch, loss_of):
        args, kwargs = batch
        if self.flush:
            from ampdoctor.record import headroom as hr
            hr.FLUSH_TENSORS, hr.FLUSH_BYTES_FORWARD, hr.FLUSH_BYTES_BACKWARD = (
                self.flush[0], self.flush[1] << 20, self.flush[2] << 20)
        self.opt.zero_grad(set_to_none=True)
        with self.step_ctx():
            with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float16,
                                enabled=self.amp_dtype is not None):
                loss = loss_of(self.fwd(*args, **kwargs))
            self.scaler.scale(loss).backward()
        if self.clip:  # the seed loop: backward -> unscale_ -> clip -> step -> update
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def count_syncs(v: Variant, batches, loss_of, steps: int) -> float:
    """Device->host synchronisations per step, as reported by torch.cuda.set_sync_debug_mode('warn')."""
    n = 0
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(steps):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                v.step(batches[i % len(batches)], loss_of)
            finally:
                torch.cuda.set_sync_debug_mode(prev)
            n += sum(1 for w in rec if "synchroniz" in str(w.message).lower())
            rec.clear()
            torch.cuda.synchronize()
    return n / steps


# ---------------------------------------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cpu-gpt",
                   choices=["cpu-gpt", "convnet", "gpt2", "nanogpt", "nanogpt-host", "tiny"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sync-steps", type=int, default=4)
    p.add_argument("--no-clip", action="store_true", help="leave out scaler.unscale_ + clip_grad_norm_")
    p.add_argument("--compile", action="store_true", help="run each variant's forward through torch.compile")
    p.add_argument("--amp", default=None, choices=["fp16", "bf16", "off"])
    p.add_argument("--variants", default=",".join(v for v in ALL_VARIANTS if v != "hroff"))
    p.add_argument("--json", default=None)
    p.add_argument("--bitwise", action="store_true")
    p.add_argument("--bitwise-steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU runs)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="another checkout whose ampdoctor the variants named <variant>@base use")
    return p.parse_args(argv)


def _hf_available() -> bool:
    try:
        import transformers.debug_utils  # noqa: F401
        return True
    except Exception:
        return False


def _env(device) -> dict:
    d = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
         "ampdoctor": getattr(ampdoctor, "__version__", "?"), "threads": torch.get_num_threads(),
         "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        d["gpu"] = torch.cuda.get_device_name(device)
        d["cuda"] = torch.version.cuda
    try:
        import transformers
        d["transformers"] = transformers.__version__
    except Exception:
        pass
    return d


def run_benchmark(a) -> dict:
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    if a.model == "gpt2" and not _hf_available():
        print("transformers is not importable: skipping --model gpt2", file=sys.stderr)
        return {"skipped": "transformers not importable", "model": a.model}
    amp = a.amp or ("fp16" if device.type == "cuda" else "off")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    if "plain" not in names:
        names.insert(0, "plain")
    if getattr(a, "baseline", None):
        PACKAGES["@base"] = load_baseline(a.baseline)
    bad = [n for n in names if n.partition(":")[0].partition("@")[0] not in ALL_VARIANTS
           or n.partition(":")[0].partition("@")[2] not in ("", "base")]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {ALL_VARIANTS} (with --baseline, also <variant>@base)")
    if any("@base" in n for n in names) and "@base" not in PACKAGES:
        raise SystemExit("a variant @base needs --baseline DIR")
    if "hf" in names and not _hf_available():
        names.remove("hf")
    base, batches, loss_of = build(a.model, device)
    variants = [Variant(n, copy.deepcopy(base), device, amp_dtype, clip=not a.no_clip, compile=a.compile)
                for n in names]
    del base
    log = (lambda *x: None) if a.quiet else (lambda *x: print(*x, flush=True))
    log(f"model={a.model} device={device} amp={amp} compile={a.compile} "
        f"params={sum(p.numel() for p in variants[0].model.parameters()):,} "
        f"variants={names} steps={a.steps} warmup={a.warmup}")
    for v in variants:
        v.install()
    cuda = device.type == "cuda"
    try:
        with _quiet():
            for i in range(a.warmup + a.steps):
                batch = batches[i % len(batches)]
                for v in variants:
                    if v.error:
                        continue
                    _sync(device)
                    if cuda:
                        base_mem = torch.cuda.memory_allocated(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    t0 = time.perf_counter()
                    try:
                        v.step(batch, loss_of)
                        _sync(device)
                    except Exception as e:  # e.g. DebugUnderflowOverflow aborts on the first inf/nan
                        v.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                        log(f"  {v.label}: failed at step {i}: {v.error}")
                        continue
                    dt = time.perf_counter() - t0
                    if i >= a.warmup:
                        v.times.append(dt)
                        if cuda:
                            v.peaks.append(torch.cuda.max_memory_allocated(device) - base_mem)
                if i == a.warmup - 1:
                    log("  warmup done")
                elif i >= a.warmup and (i - a.warmup + 1) % 10 == 0:
                    log("  step %d: %s" % (i - a.warmup + 1, "  ".join(
                        f"{v.label}={statistics.median(v.times) * 1e3:.1f}ms" for v in variants if v.times)))
            if cuda and a.sync_steps > 0:
                for v in variants:
                    if v.error:
                        continue
                    try:
                        v.syncs = count_syncs(v, batches, loss_of, a.sync_steps)
                    except Exception as e:
                        log(f"  {v.label}: sync count failed: {type(e).__name__}: {e}")
    finally:
        for v in variants:
            if v.watch is not None and v.watch.machine.disabled and not v.error:
                v.error = "the watch disabled itself (an internal error): its times measure no watch"
                log(f"  {v.label}: {v.error}")
            v.remove()
    plain = variants[0]
    p_med = statistics.median(plain.times) if plain.times else float("nan")
    p_peak = max(plain.peaks) if plain.peaks else None
    rows = []
    for v in variants:
        med = statistics.median(v.times) if v.times else float("nan")
        peak = max(v.peaks) if v.peaks else None
        rows.append({
            "variant": v.label, "median_ms": med * 1e3, "ratio": med / p_med if v.times else float("nan"),
            "min_ms": min(v.times) * 1e3 if v.times else None,
            "p90_ms": sorted(v.times)[int(0.9 * (len(v.times) - 1))] * 1e3 if v.times else None,
            "peak_step_mb": None if peak is None else peak / 2**20,
            "peak_delta_mb": None if (peak is None or p_peak is None) else (peak - p_peak) / 2**20,
            "syncs_per_step": v.syncs,
            "extra_syncs_per_step": None if (v.syncs is None or plain.syncs is None) else v.syncs - plain.syncs,
            "steps": len(v.times), "error": v.error, "times_ms": [t * 1e3 for t in v.times],
            "package": v.pkg.__name__ if v.watch is not None else None})
    res = {"env": _env(device), "model": a.model, "device": str(device), "amp": amp, "compile": a.compile,
           "steps": a.steps,
           "warmup": a.warmup, "sync_steps": a.sync_steps if cuda else 0,
           "command": "python " + os.path.relpath(sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else __file__)
                      + " " + " ".join(a.argv),
           "rows": rows}
    del variants
    gc.collect()
    return res


def format_table(res: dict) -> str:
    if "rows" not in res:
        return f"({res.get('skipped', 'no result')})"
    compiled = " (torch.compile)" if res.get("compile") else ""
    out = [f"{res['model']}{compiled} on {res['env'].get('gpu', res['device'])}, amp={res['amp']}, "
           f"torch {res['env']['torch']}, {res['steps']} timed steps/variant",
           "| variant | median ms | ratio | peak-mem delta | syncs/step (extra) |",
           "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        mem = "n/a" if r["peak_delta_mb"] is None else f"{r['peak_delta_mb']:+.1f} MiB"
        sy = "n/a" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.1f} ({r['extra_syncs_per_step']:+.1f})"
        if r["error"] and not r["steps"]:
            out.append(f"| {r['variant']} | failed: {r['error']} | | | |")
        else:
            out.append(f"| {r['variant']} | {r['median_ms']:.2f} | {r['ratio']:.3f}x | {mem} | {sy} |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# bitwise identity: watched training == unwatched training
# ---------------------------------------------------------------------------------------------------------
def bitwise_check(device: torch.device, steps: int = 50, log=print) -> dict:
    """Train the same small GPT (dropout on) `steps` fp16 steps four times: plain, plain again (the control:
    is the machine deterministic at all?), watched with every=1 and watched with the default; compare every
    loss and every final weight bit for bit."""
    if device.type != "cuda":  # CPU kernels are deterministic already (and the switch imports inductor: ~4 s)
        return _bitwise_check(device, steps, log)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    prev_det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _bitwise_check(device, steps, log)
    finally:
        torch.use_deterministic_algorithms(prev_det[0], warn_only=prev_det[1])


def _bitwise_check(device, steps, log):
    amp_dtype = torch.float16 if device.type == "cuda" else None
    cfg = dict(vocab=512, d=128, heads=4, layers=2, block=64)

    def run(mode):
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(0)
        model = TinyGPT(**cfg).to(device).train()
        g = torch.Generator().manual_seed(1)
        v = Variant("plain", model, device, amp_dtype)
        w = None
        if mode == "every1":
            w = ampdoctor.watch(model, optimizer=v.opt, scaler=v.scaler, every=1)
        elif mode == "default":
            w = ampdoctor.watch(model, optimizer=v.opt, scaler=v.scaler)
        losses, scales = [], []
        try:
            for _ in range(steps):
                idx = torch.randint(0, cfg["vocab"], (8, cfg["block"] + 1), generator=g).to(device)
                loss = v.step(((idx[:, :-1], idx[:, 1:]), {}), _identity)
                losses.append(loss.detach().float().cpu().item())
                scales.append(v.scaler.get_scale())
        finally:
            if w is not None:
                nrec = len(w.steps)
                w.close()
        params = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
        return {"losses": losses, "scales": scales, "params": params, "records": nrec if w is not None else None}

    with _quiet():
        runs = {m: run(m) for m in ("plain", "plain_again", "every1", "default")}
    ref = runs["plain"]
    out = {"device": str(device), "steps": steps, "amp": "fp16" if amp_dtype else "off", "comparisons": {}}
    for m in ("plain_again", "every1", "default"):
        r = runs[m]
        same_loss = [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(ref["losses"], r["losses"])]
        diff_params = [n for n in ref["params"] if not torch.equal(ref["params"][n], r["params"][n])]
        out["comparisons"][m] = {"losses_identical": all(same_loss), "first_loss_diff_step":
                                 (same_loss.index(False) if not all(same_loss) else None),
                                 "scales_identical": ref["scales"] == r["scales"],
                                 "params_identical": not diff_params, "params_differing": diff_params[:5],
                                 "records": r["records"]}
    out["skipped_steps"] = sum(1 for a, b in zip(ref["scales"], ref["scales"][1:]) if b < a)
    out["final_loss"] = ref["losses"][-1]
    out["identical"] = all(c["losses_identical"] and c["params_identical"] for k, c in out["comparisons"].items()
                           if k != "plain_again")
    out["control_identical"] = (out["comparisons"]["plain_again"]["losses_identical"]
                                and out["comparisons"]["plain_again"]["params_identical"])
    log(json.dumps(out, indent=1))
    return out


def main(argv=None) -> dict:
    a = parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.bitwise:
        res = {"env": _env(torch.device(a.device)), "bitwise": bitwise_check(torch.device(a.device), a.bitwise_steps)}
    else:
        res = run_benchmark(a)
        if not a.quiet:
            print()
            print(format_table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
