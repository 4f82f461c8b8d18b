"""Words shared by the reporters: the short headline of a finding, a fix split into prose and code, `code`
spans, crash and evidence labels. Pure string functions: HTML escaping stays with the HTML reporter.

A headline says where and what in a few words ("`ff.wo` (aten::mm) overflowed in the forward pass at step 17");
the finding's message, shown under it, says the rest, so nothing is said twice.
"""
from __future__ import annotations

import re

__all__ = ["headline", "fix_blocks", "code_spans", "crash_line", "evidence_label", "HIDDEN_EVIDENCE", "NO_LOSS_TEXT"]

_VERBS = {"overflow": "overflowed", "nan_origin": "produced NaN", "overflow_risk": "is within a bit of the max",
          "underflow": "underflowed", "mask_value_overflow": "used a mask constant out of range",
          "eps_underflow": "used an epsilon that vanishes", "precision_loss": "lost precision",
          "update_underflow": "has updates that round away", "headroom_trend": "is heading for overflow",
          "update_spike": "had an update spike"}
_GENERAL = {"loss_scale_collapse": "The loss scale collapsed", "skipped_steps": "GradScaler skipped steps",
            "clip_before_unscale": "Gradients clipped before unscale_", "scaler_misorder": "Scaler calls out of order",
            "missing_scaler_update": "scaler.update() missing", "fp16_master_weights": "No fp32 master weights",
            "env_tf32": "TF32 settings", "deprecated_api": "Deprecated AMP API", "replay_error": "Replay failed"}

# A fix line is code when it is indented or starts like Python does; prose otherwise.
_CODE = re.compile(r"^(\s|with |for |def |import |from |class |return |if |try:|except|@|#|[)\]}]|"
                   r"[A-Za-z_][\w.]*(\[[^\]]*\])?\s*(=|\+=|-=|\*=|/=|\()|\w+\.\w+(\.\w+)*\s*$)")

HIDDEN_EVIDENCE = {"rank_hint"}
NO_LOSS_TEXT = ("no loss was computed (the model's output is neither a scalar nor has `.loss`), so the backward was "
                "not run. To replay the backward too, pass `--loss pkg.mod:fn` (or `loss_fn=` to `ampdoctor.replay`), "
                "or use a model whose output has `.loss`.")     # ranking internals, not evidence a person reads


def headline(f: dict | None, verdict: str = "") -> str:
    """A few words for the top of the report; `verdict` (the summary's) is used when no finding applies."""
    if not f:
        return verdict
    rule, mod, op = f.get("rule"), f.get("module"), f.get("op")
    where = "" if mod is None else f"`{mod or '(root)'}`" + (f" ({op})" if op else "")
    step = f" at step {f['step']}" if f.get("step") is not None else ""
    phase = f" in the {f['phase']} pass" if f.get("phase") in ("forward", "backward") else ""
    if where and rule in _VERBS:
        return f"{where} {_VERBS[rule]}{phase}{step}"
    head = _GENERAL.get(rule) or str(rule)
    return f"{head}{f' in {where}' if where else ''}{step}"


def fix_blocks(fix: str | None) -> list[dict]:
    """Split a fix into [{"kind": "prose" | "code", "text"}]: prose reads as sentences (with `code` spans),
    code keeps its layout and can be copied as is."""
    blocks: list[dict] = []
    gap = False
    for line in (fix or "").splitlines():
        if not line.strip():
            gap = bool(blocks)
            continue
        kind = "code" if _CODE.match(line) else "prose"
        if blocks and blocks[-1]["kind"] == kind and (kind == "code" or not gap):
            blocks[-1]["text"] += ("\n\n" if gap else "\n") + line if kind == "code" else " " + line
        else:
            blocks.append({"kind": kind, "text": line})
        gap = False
    return blocks


def code_spans(text: str) -> list[tuple[str, bool]]:
    """Split on `backticks`: [(text, is_code)]; an unpaired backtick stays literal text."""
    parts = str(text or "").split("`")
    if len(parts) % 2 == 0:                         # odd number of backticks: keep the last one as text
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return [(p, i % 2 == 1) for i, p in enumerate(parts) if p]


def crash_line(crash: dict) -> str:
    """One line for a crashed run: 'RuntimeError at step 3 in `attn` (model.py:12): message'."""
    where = f" in `{crash['module'] or '(root)'}`" if crash.get("module") is not None else ""
    src = ""
    if crash.get("file"):
        src = f" ({crash['file']}" + (f":{crash['line']}" if crash.get("line") is not None else "") + ")"
    step = f" at step {crash['step']}" if crash.get("step") is not None else ""
    return f"{crash.get('type') or 'exception'}{step}{where}{src}: {crash.get('message') or ''}".rstrip(": ")


_EVIDENCE_MODULE = {"absmax_in": "max |x| of the module's inputs", "absmax_out_finite": "max |x| of the finite outputs",
                    "nonfinite_in": "inf/NaN values in the module's inputs", "call": "call of the module in the step",
                    "op_line": "source line of the op", "op_out_dtype": "dtype of the op's output"}
_EVIDENCE_OP = {"absmax_in": "max |x| of the op's inputs", "out_numel": "values in the op's output",
                "in_dtypes": "dtypes of the op's inputs", "out_dtype": "dtype of the op's output",
                "line": "source line of the op"}
_EVIDENCE = {"nan_out": "NaN values out", "posinf_out": "+inf values out", "neginf_out": "-inf values out",
             "out_nan": "NaN values out", "out_posinf": "+inf values out", "out_neginf": "-inf values out",
             "numel_out": "values out", "steps": "steps where it happened", "occurrences": "times seen",
             "from_replay": "capture replayed to name the op", "module_level_rule": "rule at module level",
             "autocast": "autocast device:dtype", "ref": "dtype whose range is checked"}


def evidence_label(key: str, ev: dict, op: str | None = None) -> str:
    """What an evidence key means for this finding; '' when the key speaks for itself. `absmax_in` is the
    module's inputs in a recording (the finding's message may quote the op's), the op's inputs in a replay."""
    op_level = "in_dtypes" in ev or "out_numel" in ev
    table = _EVIDENCE_OP if op_level else _EVIDENCE_MODULE
    label = table.get(key) or _EVIDENCE.get(key, "")
    if op_level and op and key == "absmax_in":
        label += f" ({op})"
    return label
