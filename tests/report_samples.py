"""Hand-built Report objects (and step records) shaped like real ampdoctor runs, for the reporter tests.

`overflow_report()` is a T5-style fp16 run whose feed-forward `wo` overflows at step 23; `healthy_report()` has
no findings; `replay_only_report()` has only a replay panel; `large_report()` is 500 layers x 1,000 steps with
one known worst cell; `hostile_report()` carries HTML in every user-controlled string. `step_records()` gives a
RunMeta and StepRecords for the TensorBoard sink.

Real runs, for what only a real run shows (each a few seconds on a CPU): `nan_run(dir)` trains a small GPT whose
second block's attention overflows fp16 (every step NaN, default sampling); `short_healthy_run(dir)` samples one
step of 12; `crashed_run()` raises inside the forward (`masked_fill(-1e9)` on fp16 scores); `replay_fixture()`
replays the committed T5 capture; `replay_without_loss(dir)` replays a capture whose model returns a tensor.
"""
from __future__ import annotations

import math
import os
import random

from ampdoctor.findings import Finding, Report
from ampdoctor.records import CallEvent, ModuleCall, ParamStat, RunMeta, StepRecord, TensorStats

BAD_STEP = 23
ROOT_MODULE = "encoder.block.1.layer.1.DenseReluDense.wo"
FIX_SNIPPET = ("Keep the feed-forward output projection in fp32:\n"
               "    with torch.autocast('cuda', enabled=False):\n"
               "        hidden = self.wo(hidden.float())")


def t5_modules(n_blocks: int = 2) -> list[tuple[str, str, int]]:
    mods = [("", "T5ForConditionalGeneration", 0), ("shared", "Embedding", 1)]
    for b in range(n_blocks):
        p = f"encoder.block.{b}"
        mods += [(f"{p}.layer.0.SelfAttention.q", "Linear", 5), (f"{p}.layer.0.SelfAttention.k", "Linear", 5),
                 (f"{p}.layer.0.SelfAttention.v", "Linear", 5), (f"{p}.layer.0.SelfAttention.o", "Linear", 5),
                 (f"{p}.layer.0.layer_norm", "T5LayerNorm", 4),
                 (f"{p}.layer.1.DenseReluDense.wi", "Linear", 5), (f"{p}.layer.1.DenseReluDense.wo", "Linear", 5),
                 (f"{p}.layer.1.layer_norm", "T5LayerNorm", 4)]
    mods.append(("lm_head", "Linear", 1))
    return mods


def _findings() -> list[Finding]:
    return [
        Finding("overflow", "error", "forward", ROOT_MODULE, "aten::mm", BAD_STEP,
                "fp16 matmul output exceeded 65504: finite inputs (absmax 812.5) became +inf.", FIX_SNIPPET,
                {"absmax_in": 812.5, "absmax_out": "inf", "posinf": 37, "headroom_bits_before": 0.4,
                 "dtype": "float16", "rank": 0}),
        Finding("loss_scale_collapse", "error", "scaler", None, None, BAD_STEP + 1,
                "The loss scale backed off 9 times in a row, from 65536 to 128: inf/NaN persists every step.",
                "Fix the overflow above; lowering the scale cannot help a forward overflow.",
                {"scale_start": 65536.0, "scale_end": 128.0, "backoffs": 9}),
        Finding("nan_origin", "warning", "backward", "encoder.block.1.layer.1.layer_norm", "aten::rsqrt",
                BAD_STEP, "NaN first appeared in the backward of this layer norm (inputs were inf).",
                "Follows from the overflow; no separate fix needed.", {"nan": 512}),
        Finding("underflow", "warning", "backward", "encoder.block.0.layer.0.SelfAttention.q", None, 10,
                "61% of nonzero gradient values are fp16 subnormals.",
                "Keep a GradScaler and do not lower init_scale below 2**16.",
                {"subnormal_share": 0.61, "dtype": "float16"}),
        Finding("scaler_misorder", "warning", "optimizer", None, None, 3,
                "clip_grad_norm_ ran before scaler.unscale_: the threshold applied to scaled gradients.",
                "scaler.unscale_(optimizer)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
                {"sequence": ["scale", "backward", "clip_grad_norm_", "unscale_", "step", "update"]}),
        Finding("skipped_steps", "info", "scaler", None, None, 0,
                "The scaler skipped steps 0-1 while finding its scale (expected).", "Nothing to do.",
                {"skipped": [0, 1]}),
        Finding("env_tf32", "info", "env", None, None, None,
                "TF32 matmul is off on an Ampere+ GPU; fp32 parts run slower than they could.",
                "torch.backends.cuda.matmul.allow_tf32 = True", {"compute_capability": [9, 0]}),
    ]


def _timeline(n: int, bad_from: int | None) -> list[dict]:
    rows, scale = [], 65536.0
    for s in range(n):
        bad = s < 2 or (bad_from is not None and s >= bad_from)
        loss = 4.2 * math.exp(-s / 30) + 0.3 if not (bad_from is not None and s >= bad_from) else "nan"
        rows.append({"step": s, "loss": loss, "scale": scale, "skipped": bad, "grad_norm": "inf" if bad else
                     1.5 + 0.1 * math.sin(s), "sampled": s % 5 == 0 or bad, "bad": bad})
        if bad:
            scale /= 2
    return rows


def _layers(mods, bad_module: str | None = None) -> list[dict]:
    out = []
    for i, (name, typ, depth) in enumerate(mods):
        amax = 812.5 * 81 if name == bad_module else 2.0 ** (i % 9)
        out.append({"module": name, "type": typ, "depth": depth, "calls": 40, "absmax_out":
                    "inf" if name == bad_module else amax,
                    "headroom_bits": "-inf" if name == bad_module else math.log2(65504 / amax),
                    "subnormal_share": 0.61 if name.endswith("SelfAttention.q") else 0.001 * i,
                    "absmax_grad": 0.02 * (i + 1), "grad_norm": 0.5 + 0.1 * i,
                    "nonfinite_out": 37 if name == bad_module else 0})
    return out


def _calls(n_steps: int) -> list[dict]:
    out = []
    seq = ["scale", "backward", "unscale_", "clip_grad_norm_", "step", "update", "zero_grad"]
    for s in range(n_steps):
        kinds = seq if s != 3 else ["scale", "backward", "clip_grad_norm_", "unscale_", "step", "update",
                                    "zero_grad"]
        for i, k in enumerate(kinds):
            out.append({"step": s, "index": i, "kind": k, "file": "train.py", "line": 80 + i, "stage": "READY",
                        "error": None, "misordered": s == 3 and k == "clip_grad_norm_"})
    return out


def _env() -> dict:
    return {"torch": "2.13.0+cu128", "device": "NVIDIA H200", "compute_capability": [9, 0],
            "allow_tf32_matmul": False, "allow_tf32_cudnn": True, "float32_matmul_precision": "highest",
            "bf16_supported": True, "cuda": "12.8", "python": "3.11.9"}


def _replay() -> dict:
    return {"capture": "runs/exp1/captures/step-23",
            "chain": [{"phase": "forward", "module": "encoder.block.1.layer.1.DenseReluDense.wi", "op": "aten::mm",
                       "kind": "near_max", "source": "modeling_t5.py:285"},
                      {"phase": "forward", "module": ROOT_MODULE, "op": "aten::mm", "kind": "overflow",
                       "source": "modeling_t5.py:290"},
                      {"phase": "forward", "module": "encoder.block.1.layer.1.layer_norm", "op": "aten::pow",
                       "kind": "nan", "source": "modeling_t5.py:250"}],
            "shadow": [{"module": ROOT_MODULE, "rel_err": "inf"},
                       {"module": "encoder.block.1.layer.1.DenseReluDense.wi", "rel_err": 3.1e-3},
                       {"module": "encoder.block.0.layer.0.SelfAttention.q", "rel_err": 4.8e-4}],
            "whatif": {"float16": {"finite": False, "overflow_modules": [ROOT_MODULE], "max_rel_err_module": None},
                       "bfloat16": {"finite": True, "overflow_modules": [],
                                    "max_rel_err_module": "encoder.block.1.layer.1.DenseReluDense.wi"}},
            "fix": {"modules": [ROOT_MODULE], "snippet": FIX_SNIPPET}}


def overflow_report(n_steps: int = 40) -> Report:
    mods = t5_modules()
    names = [m[0] for m in mods]
    steps = list(range(0, n_steps))
    rng = random.Random(0)
    headroom, gnorm = [], []
    for i, name in enumerate(names):
        base = 3 + (i * 7) % 20
        row = []
        for s in steps:
            if s % 5 and s < BAD_STEP:
                row.append(None)
            elif name == ROOT_MODULE:
                row.append("-inf" if s >= BAD_STEP else max(0.4, 6 - s * 0.25))
            else:
                row.append(base + rng.uniform(-1, 1))
        headroom.append(row)
        gnorm.append([None if s % 5 and s < BAD_STEP else ("inf" if s >= BAD_STEP and name == ROOT_MODULE
                                                           else 0.2 + 0.05 * i + rng.uniform(0, 0.05))
                      for s in steps])
    data = {"timeline": _timeline(n_steps, BAD_STEP), "layers": _layers(mods, ROOT_MODULE),
            "heatmap": {"modules": names, "steps": steps, "headroom": headroom, "ref": "float16"},
            "grad_norms": {"names": names, "steps": steps, "values": gnorm},
            "calls": _calls(6), "env": _env(), "replay": _replay()}
    summary = {"verdict": f"{ROOT_MODULE} (aten::mm) overflowed fp16 in the forward pass at step {BAD_STEP}; "
                          "everything after is a consequence.",
               "steps": n_steps, "bad_steps": n_steps - BAD_STEP + 2, "skipped_steps": n_steps - BAD_STEP + 2,
               "first_bad_step": BAD_STEP, "errors": 2, "warnings": 3, "infos": 2, "run_dir": "runs/exp1",
               "model_class": "T5ForConditionalGeneration", "every": 5}
    return Report(_findings(), summary, data)


def healthy_report(n_steps: int = 30) -> Report:
    mods = t5_modules(1)
    names = [m[0] for m in mods]
    steps = list(range(0, n_steps, 5))
    data = {"timeline": _timeline(n_steps, None), "layers": _layers(mods),
            "heatmap": {"modules": names, "steps": steps,
                        "headroom": [[8.0 + i % 5 for _ in steps] for i, _ in enumerate(names)], "ref": "float16"},
            "grad_norms": {"names": names, "steps": steps, "values": [[0.3 + 0.01 * i for _ in steps]
                                                                       for i, _ in enumerate(names)]},
            "calls": _calls(2), "env": _env()}
    summary = {"verdict": "No mixed-precision problems found.", "steps": n_steps, "bad_steps": 2,
               "skipped_steps": 2, "first_bad_step": None, "errors": 0, "warnings": 0, "infos": 1,
               "run_dir": "runs/ok", "model_class": "T5ForConditionalGeneration", "every": 5}
    info = Finding("skipped_steps", "info", "scaler", None, None, 0,
                   "The scaler skipped steps 0-1 while finding its scale (expected).", "Nothing to do.", {})
    return Report([info], summary, data)


def replay_only_report() -> Report:
    f = _findings()[0]
    summary = {"verdict": f"Replay: {ROOT_MODULE} overflows fp16 in aten::mm; bf16 stays finite.",
               "steps": 0, "errors": 1, "warnings": 0, "infos": 0, "model_class": "T5ForConditionalGeneration"}
    rp = _replay()
    # the stage-tagged chain that ampdoctor.replay emits
    rp["chain"] = [{"stage": "constant", "rule": "mask_value_overflow", "module": "encoder.block.0.layer.0",
                    "op": "aten::masked_fill", "value": -3.4028234663852886e38, "line": 120},
                   {"stage": "origin", "phase": "forward", "module": ROOT_MODULE, "op": "aten::mm", "kind": "overflow",
                    "line": 290},
                   {"stage": "first_nan", "phase": "forward", "module": "encoder.block.1.layer.1.layer_norm",
                    "op": "aten::pow", "line": 250},
                   {"stage": "loss", "finite": False}, {"stage": "grads", "nonfinite": ["lm_head.weight"], "count": 1}]
    rp["whatif"]["float16"]["max_rel_err"] = None
    rp["whatif"]["bfloat16"]["max_rel_err"] = 0.0031
    rp["whatif"]["tf32"] = {"finite": False, "error": "RuntimeError: CUDA out of memory", "overflow_modules": []}
    return Report([f], summary, {"replay": rp, "env": _env()})


def large_report(n_layers: int = 500, n_steps: int = 1000, worst=(337, 613)) -> Report:
    """Every cell is sampled; one cell (`worst` = (layer, step)) has -3.25 bits of headroom, all others >= 2."""
    rng = random.Random(1)
    names = [f"model.layers.{i // 5}.{['attn.q', 'attn.k', 'attn.v', 'mlp.up', 'mlp.down'][i % 5]}"
             for i in range(n_layers)]
    steps = list(range(n_steps))
    headroom = [[round(rng.uniform(2, 20), 3) for _ in steps] for _ in names]
    headroom[worst[0]][worst[1]] = -3.25
    gnorm = [[round(rng.uniform(0.01, 1), 4) for _ in steps] for _ in names]
    gnorm[worst[0]][worst[1]] = 9999.0
    tl = [{"step": s, "loss": 3 - s / 1000, "scale": 65536.0 if s < worst[1] else 32768.0,
           "skipped": s == worst[1], "grad_norm": 1.0, "sampled": True, "bad": s == worst[1]} for s in steps]
    layers = [{"module": n, "type": "Linear", "depth": 3, "calls": n_steps, "absmax_out": 65504 / 2 ** min(r),
               "headroom_bits": min(r), "subnormal_share": 0.01, "absmax_grad": 0.1, "grad_norm": 0.5,
               "nonfinite_out": 0} for n, r in zip(names, headroom)]
    calls = [{"step": s, "index": i, "kind": k, "file": "train.py", "line": 50 + i, "stage": None, "error": None,
              "misordered": False} for s in steps for i, k in enumerate(["scale", "backward", "step", "update"])]
    f = Finding("overflow_risk", "warning", "forward", names[worst[0]], "aten::addmm", worst[1],
                "Output came within 3.25 bits past the fp16 max.", "Scale the residual stream down.", {})
    summary = {"verdict": f"{names[worst[0]]} runs out of fp16 headroom at step {worst[1]}.", "steps": n_steps,
               "bad_steps": 1, "skipped_steps": 1, "first_bad_step": worst[1], "errors": 0, "warnings": 1,
               "infos": 0, "model_class": "Llama", "every": 1}
    return Report([f], summary, {"timeline": tl, "layers": layers, "calls": calls, "env": _env(),
                                 "heatmap": {"modules": names, "steps": steps, "headroom": headroom},
                                 "grad_norms": {"names": names, "steps": steps, "values": gnorm}})


EVIL = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def hostile_report() -> Report:
    r = overflow_report(12)
    for f in r.findings:
        f.module = (f.module or "") + EVIL
        f.message += EVIL
        f.fix += EVIL
        f.evidence["note"] = EVIL
    r.summary["verdict"] = "Verdict " + EVIL
    for layer in r.data["layers"]:
        layer["module"] += EVIL
    r.data["heatmap"]["modules"] = [m + EVIL for m in r.data["heatmap"]["modules"]]
    r.data["calls"][0]["file"] = EVIL
    r.data["env"]["device"] = EVIL
    r.data["replay"]["fix"]["snippet"] = EVIL
    return r


def step_records(n_steps: int = 6, bad_step: int = 4) -> tuple[RunMeta, list[StepRecord]]:
    """Records as a watch flushes them: per-module stats on sampled steps (even ones and the bad one)."""
    meta = RunMeta(model_class="TinyMLP", torch_version="2.13.0",
                   modules=[["", "TinyMLP", 0], ["fc1", "Linear", 1], ["fc2", "Linear", 1]],
                   params=[["fc1.weight", "fc1", "float32", 64, True], ["fc2.weight", "fc2", "float32", 64, True]],
                   scaler={"init_scale": 65536.0}, every=2)
    recs = []
    for s in range(n_steps):
        bad = s == bad_step
        sampled = s % 2 == 0 or bad
        mods, params = [], []
        if sampled:
            for i, name in enumerate(["fc1", "fc2"]):
                for call in range(2):   # two calls: the record must aggregate them
                    out = TensorStats("float16", "float16", numel=1000, zeros=100, subnormal=90 if i else 0,
                                      absmax=(2.0 ** 10) * (call + 1) if not (bad and i) else 2.0 ** 15,
                                      posinf=5 if (bad and i and call) else 0)
                    mods.append(ModuleCall(name, "Linear", call, 2 * i + call, 1, "float16", out=out))
                params.append(ParamStat(f"{name}.weight", name, "float32", 64, grad_norm=0.25 * (i + 1) + s))
        recs.append(StepRecord(step=s, sampled=sampled, loss=2.0 - 0.1 * s if not bad else float("nan"),
                               loss_finite=not bad, scale=65536.0 / (2 if s > bad_step else 1), skipped=bad,
                               grad_norm=1.0 + s if not bad else float("inf"), modules=mods, params=params,
                               events=[CallEvent("scale", s, 0, "train.py", 10)]))
    return meta, recs


# --- real runs ----------------------------------------------------------------------------------------------

def nan_run(run_dir, steps: int = 12):
    """TinyGPT whose blocks.1 attention scores overflow fp16 on every step; default sampling; returns run_dir."""
    import torch
    from scenarios import TinyGPT, gpt_batch, hf_loss, train
    torch.manual_seed(0)
    m = TinyGPT(n=2)
    with torch.no_grad():
        m.blocks[1].qkv.weight[:64].mul_(400.0)     # q and k rows: q @ k^T far beyond 65504
    train(m, gpt_batch(), hf_loss, steps=steps, every=200, run_dir=str(run_dir))
    return str(run_dir)


def short_healthy_run(run_dir, steps: int = 12, headroom=False):
    """A short healthy fp16 run at the default sampling, by default without the per-step headroom series."""
    import torch
    from scenarios import TwoLayerNet, mse_to_zero, train
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    train(TwoLayerNet(), lambda i: (x,), mse_to_zero, steps=steps, every=200, run_dir=str(run_dir),
          headroom=headroom)
    return str(run_dir)


def crashed_run():
    """A watched run whose forward raises (masked_fill(-1e9) on fp16 scores); returns (report, exception)."""
    import torch
    import ampdoctor
    import failing_models as fm
    c = fm.case_masked_fill()
    opt = torch.optim.SGD(c.model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu")
    err = None
    try:
        with ampdoctor.watch(c.model, optimizer=opt, scaler=sc) as w:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = fm.mean_sq(c.model(*c.args))
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    except RuntimeError as e:
        err = e
    assert err is not None, "the masked_fill case no longer raises"
    return w.report(), err


def replay_fixture():
    import ampdoctor
    from fixtures.models import t5_block
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return ampdoctor.replay(os.path.join(root, "fixtures", "captures", "t5_ffn_overflow"), model=t5_block())


def replay_without_loss(cap_dir):
    import ampdoctor
    import failing_models as fm
    c = fm.case_attn()
    ampdoctor.save_batch(str(cap_dir), c.model, *c.args)
    return ampdoctor.replay(str(cap_dir), model=fm.AttnModel(), shadow=False, whatif=False, fix_search=False)
