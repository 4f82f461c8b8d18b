"""The corpus: healthy runs of every model in fp16 + GradScaler and bf16, eager and compiled, and failures
injected at realistic points, each with what ampdoctor should say (rule, module, op, step) among its first three
findings. Expected steps that depend on the run (the first bad step, the first applied update) are read from the
unwatched run of the same case (`gt`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import loops, nanogpt
from .models import SPECS

LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTN_OPS = ("aten::bmm", "aten::matmul")
MODELS = ("nanogpt", "gpt2", "llama", "t5", "bert", "resnet", "vit", "unet", "lstm", "vae", "moe", "clip", "convnext",
          "wav2vec", "gcn")


@dataclass
class Expect:
    """One acceptable finding: rule in `rules`, module equal (None: any), op in `ops` (None: any), step in
    `steps` (None: any)."""

    rules: tuple
    module: str | None = None
    ops: tuple | None = None
    steps: tuple | None = None

    def matches(self, f: dict) -> bool:
        return (f["rule"] in self.rules and (self.module is None or f["module"] == self.module)
                and (self.ops is None or f["op"] in self.ops) and (self.steps is None or f["step"] in self.steps))

    def label(self) -> str:
        ops = "" if self.ops is None else ":" + "|".join(o.replace("aten::", "") for o in self.ops[:2])
        if self.steps is None:
            st = "*"
        elif len(self.steps) > 3:
            st = f"{min(self.steps)}..{max(self.steps)}"
        else:
            st = "|".join(map(str, self.steps))
        mod = "(root)" if self.module == "" else self.module or "*"
        return f"{'|'.join(self.rules)}@{mod}{ops}@{st}"


@dataclass
class Case:
    name: str
    model: str
    dtype: str
    compiled: bool = False
    kind: str = "healthy"
    iters: dict = field(default_factory=lambda: {"tiny": 8, "small": 30})
    # (size, device) -> extra kwargs for the train function (inject, lr, ...)
    options: Callable = lambda size, dev: {}
    # (gt, inject_info) -> list of requirements; each requirement is a list of Expect, any of which must match
    expect: Callable | None = None
    forbid: tuple = ()                           # rules that must not be in the first three findings
    extra: Callable | None = None                # (report_dict, gt, info) -> (ok, label) an extra check
    note: str = ""
    needs_bad_step: bool = False                 # N/A (not FAIL) when the unwatched run never went bad
    headroom: bool = False                       # watch with always-on headroom (WatchConfig.headroom)
    devices: tuple = ("cpu", "cuda")             # where the case means something


def nanogpt_probe(model):
    c = model.config
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, c.vocab_size, (4, c.block_size), generator=g).to(next(model.parameters()).device)
    model(idx, idx)


def hf_probe(name, size):
    def probe(model):
        dev = next(model.parameters()).device.type
        args, kwargs, _ = SPECS[name].batch(size, dev)
        model(*args, **kwargs)
    return probe


def _range_to(n):
    return None if n is None else tuple(range(0, n + 1))


def healthy_cases(compile_models) -> list[Case]:
    out = []
    for m in MODELS:
        for dt in ("float16", "bfloat16"):
            for comp in (False, True):
                if comp and m not in compile_models:
                    continue
                iters = {"tiny": 12, "small": 40} if m == "nanogpt" else {"tiny": 8, "small": 30}
                out.append(Case(f"{m}/healthy", m, dt, comp, "healthy", iters))
    return out


def injected_cases() -> list[Case]:
    L = lambda size: nanogpt.SIZES[size][0]  # noqa: E731
    cases = []
    # (a) a weight spike mid-run, large enough to overflow, in every model's MLP/FFN projection (conv in ResNet)
    for m in MODELS:
        mod = (lambda size: f"transformer.h.{L(size) - 1}.mlp.c_fc") if m == "nanogpt" else \
            (lambda size, m=m: SPECS[m].spike)
        probe = nanogpt_probe if m == "nanogpt" else None
        ops = SPECS[m].spike_ops if m in SPECS else LINEAR_OPS

        def opts(size, dev, mod=mod, m=m, probe=probe):
            return {"inject": loops.spike(mod(size), 3, probe or hf_probe(m, size))}
        cases.append(Case(f"{m}/spike@3", m, "float16", kind="injected", options=opts,
                          expect=lambda gt, info, ops=ops: [[Expect(("overflow",), info["module"], ops, (3,))]]))
    # (b) lr = 10 (nanoGPT): the first applied update throws every weight to +-10
    cases.append(Case("nanogpt/lr=10", "nanogpt", "float16", kind="injected",
                      options=lambda size, dev: {"learning_rate": 10.0, "warmup_iters": 0, "decay_lr": False},
                      expect=lambda gt, info: [
                          [Expect(("update_spike",), None, None, (gt["first_update"], gt["first_update"] + 1))],
                          [Expect(("overflow", "nan_origin"), None, None, (gt["first_bad"],))]]))
    # (c) lr = 0.05 without warmup (nanoGPT): activations climb over a few dozen steps, then overflow
    cases.append(Case("nanogpt/lr=0.05,nowarmup", "nanogpt", "float16", kind="injected",
                      iters={"tiny": 40, "small": 60},
                      options=lambda size, dev: {"learning_rate": 0.05, "warmup_iters": 0, "decay_lr": False},
                      expect=lambda gt, info: [[Expect(("update_spike", "headroom_trend"), None, None,
                                                       _range_to(gt["first_bad"]))]],
                      needs_bad_step=True, note="N/A when the run never overflows (tiny sizes on CPU)"))
    # (d) manual attention without 1/sqrt(d), large q/k: q @ k^T overflows (scaled, it would not)
    def noscale(size, dev):
        n_embd = nanogpt.SIZES[size][2]
        return {"attn": "manual_noscale",
                "inject": loops.attn_no_scale_large("transformer.h.0.attn", nanogpt_probe, n_embd)}
    cases.append(Case("nanogpt/attn-noscale", "nanogpt", "float16", kind="injected", options=noscale,
                      expect=lambda gt, info: [[Expect(("overflow",), "transformer.h.0.attn", ATTN_OPS, (0,))]]))
    # (e) a -inf-only overflow: a Linear fed by GELU outputs, weights made large and negative at step 3
    cases.append(Case("nanogpt/neg-inf@3", "nanogpt", "float16", kind="injected",
                      options=lambda size, dev: {"inject": loops.neg_overflow(
                          f"transformer.h.{L(size) - 1}.mlp.c_proj", f"transformer.h.{L(size) - 1}.mlp.c_fc", 3,
                          nanogpt_probe)},
                      expect=lambda gt, info: [[Expect(("overflow",), info["module"], LINEAR_OPS, (3,))]],
                      forbid=("mask_value_overflow",)))
    # (f) GradScaler's benign early backoff (a high init_scale), then a real overflow at step k (issue 18)
    def benign_then_spike(size, dev):
        k = _benign_skips("gpt2", size, dev) + 2
        return {"init_scale": BENIGN_INIT_SCALE, "checkpointing": True,
                "inject": loops.spike(SPECS["gpt2"].spike, k, hf_probe("gpt2", size))}
    for ckpt in (True, False):
        cases.append(Case("gpt2/backoff+spike" + ("" if ckpt else ",no-ckpt"), "gpt2", "float16", kind="injected",
                          options=lambda size, dev, ckpt=ckpt: dict(benign_then_spike(size, dev), checkpointing=ckpt),
                          iters={"tiny": 10, "small": 30},
                          expect=lambda gt, info: [[Expect(("overflow",), info["module"], LINEAR_OPS,
                                                           (info["step"],))]],
                          extra=_capture_at_step,
                          note="init_scale 2**24" + (" + gradient checkpointing" if ckpt else "")))
    # (g) one layer's weights grow 15% per step (issue 15): headroom_trend >= 10 steps before the first inf
    cases.append(Case("nanogpt/grow15%", "nanogpt", "float16", kind="injected", needs_bad_step=True, headroom=True,
                      iters={"tiny": 40, "small": 40},
                      options=lambda size, dev: {"inject": loops.grow(f"transformer.h.{L(size) - 1}.mlp.c_fc", 2, 1.15,
                                                                      nanogpt_probe, start_absmax=1024.0)},
                      expect=lambda gt, info: [[Expect(("headroom_trend",), info["module"], None,
                                                       None if gt["first_bad"] is None
                                                       else tuple(range(0, gt["first_bad"] - 9)))]]))
    # (h) bf16 autocast on CUDA runs the cuDNN LSTM in float16, with no GradScaler: its gradients underflow
    def rnn_autocast(it, model, opt):
        model.rnn_autocast = True
    cases.append(Case("lstm/bf16-rnn", "lstm", "bfloat16", kind="injected", devices=("cuda",),
                      options=lambda size, dev: {"inject": rnn_autocast},
                      expect=lambda gt, info: [[Expect(("underflow",), "lstm", None, None)]],
                      note="CUDA only: autocast's cuDNN RNN wrapper casts to float16"))
    # (j) the causal mask filled with -1e9 (the Annotated Transformer's masked_fill): torch raises in fp16 at the
    # first forward (nanoGPT's eval at iteration 0); in bf16 the constant fits and the run is healthy
    cases.append(Case("nanogpt/mask-1e9", "nanogpt", "float16", kind="injected", iters={"tiny": 4, "small": 4},
                      options=lambda size, dev: {"attn": "manual_mask1e9"},
                      expect=lambda gt, info: [[Expect(("mask_value_overflow",), "transformer.h.0.attn", None,
                                                       (0,))]],
                      note="torch raises at the first forward; the report is read after the crash"))
    cases.append(Case("nanogpt/healthy,mask-1e9", "nanogpt", "bfloat16", kind="healthy",
                      iters={"tiny": 12, "small": 40}, options=lambda size, dev: {"attn": "manual_mask1e9"},
                      note="-1e9 fits bf16: no mask finding"))
    # (k) CLIP's logit scale without OpenAI's clamp at 100, grown to e^13 (a temperature of 2e-6) at step 3:
    # exp runs in fp32 under autocast. On the CPU `scale * a` with a 0-dim fp32 scale keeps a's fp16 and overflows
    # there; on CUDA F.normalize returns fp32 (autocast runs its norm in fp32), so `scale * a` stays finite in fp32
    # and autocast's cast of it to fp16 for `@ b.t()` overflows (aten::_to_copy). Either way in the model's own
    # forward (the root), not in a submodule
    def unclamped_scale(it, model, opt):
        if it == 3:
            model.clamp_scale = False
            with torch.no_grad():
                model.logit_scale.fill_(13.0)
    unclamped_scale.info = {"module": "", "step": 3, "logit_scale": 13.0}
    cases.append(Case("clip/logit-scale@3", "clip", "float16", kind="injected",
                      options=lambda size, dev: {"inject": unclamped_scale},
                      expect=lambda gt, info: [[Expect(("overflow",), "", ("aten::mul", "aten::_to_copy"), (3,))]],
                      note="logit_scale.exp() unclamped, e^13"))
    # (l) Llama's SwiGLU: gate and up projections each finite in fp16, their product `act(gate) * up` past the max
    # (FP16.md): the producer is the MLP's own multiply, not a Linear, nor down_proj that passes the inf on
    cases.append(Case("llama/swiglu@3", "llama", "float16", kind="injected",
                      options=lambda size, dev: {"inject": loops.swiglu_overflow("model.layers.1.mlp", 3,
                                                                                 hf_probe("llama", size))},
                      expect=lambda gt, info: [[Expect(("overflow",), "model.layers.1.mlp", ("aten::mul",), (3,))]],
                      note="gate and up finite, their product overflows"))
    # (m) fp16 autocast without a GradScaler, the loss weighted 1e-4 (an auxiliary loss in multi-task training): the
    # loss's gradient enters fp16 at the head below fp16's normal range, and flushes to zero below 2^-24
    # (FP16.md, "gradients below 2^-24 flushed to zero without loss scaling"); the producer is the head, where the
    # gradient first enters fp16, not a layer deeper down that only receives what is left
    heads = {"gpt2": "lm_head", "llama": "lm_head", "resnet": "fc", "vit": "head"}
    for m, head in heads.items():
        cases.append(Case(f"{m}/no-scaler,aux-1e-4", m, "float16", kind="injected", iters={"tiny": 6, "small": 12},
                          options=lambda size, dev: {"misuse": "no-scaler", "loss_weight": 1e-4},
                          expect=lambda gt, info, head=head: [[Expect(("underflow",), head, None, (0,))]],
                          note="fp16 autocast, no GradScaler, loss x 1e-4"))
    # (i) the loop written wrong (loops.MISUSES) around every model: the call-order finding, whatever the model
    misuse_rule = {"clip-scaled": "clip_before_unscale", "no-update": "missing_scaler_update",
                   "update-first": "scaler_misorder", "half": "fp16_master_weights"}
    for m in MODELS:
        for mu in loops.MISUSES:
            rule = misuse_rule[mu]
            if m == "nanogpt" and mu == "half":
                continue  # (nanoGPT's own loop has no pure-fp16 path)
            cases.append(Case(f"{m}/{mu}", m, "float16", kind="injected", iters={"tiny": 6, "small": 12},
                              options=lambda size, dev, mu=mu: {"misuse": mu},
                              expect=lambda gt, info, rule=rule: [[Expect((rule,))]],
                              note="the loop's misuse" + (": model.half(), AdamW, no autocast, no scaler"
                                                          if mu == "half" else "")))
    return cases


BENIGN_INIT_SCALE = 2.0 ** 24
"""High enough that GradScaler backs off a few times before its first update on CPU and on an H200 (2**20 gave
none on the H200's GPT-2), low enough that the search stays shorter than a collapse (10 skips)."""


def _benign_skips(name, size, device="cpu", iters=10):
    """How many leading steps GradScaler skips at BENIGN_INIT_SCALE on this model (a dry run, no watch)."""
    skips = []
    loops.plain_train(name, size=size, device=device, iters=iters, init_scale=BENIGN_INIT_SCALE, checkpointing=True,
                      on_iter=lambda it, l, s0, s1: skips.append(s1 < s0))
    n = 0
    while n < len(skips) and skips[n]:
        n += 1
    return n


def _capture_at_step(rep, gt, info):
    caps = [str(c).rstrip("/") for c in (rep.get("summary", {}).get("captures") or [])]
    k, n = info["step"], gt["leading_skips"]
    ok = n >= 1 and any(c.endswith(f"/{k}") or c.endswith(f"captures/{k}") for c in caps)
    return ok, f"capture@{k} (after {n} benign skips)"


def all_cases(compile_models=("nanogpt",)) -> list[Case]:
    inj = injected_cases()
    # one failure through torch.compile too, for each compiled model (a user's compile=True run)
    comp = [dataclasses.replace(c, compiled=True) for c in inj if c.name.endswith("/spike@3") and
            c.model in compile_models]
    return healthy_cases(compile_models) + inj + comp
