"""The TensorBoard reporter: scalars per step, live from a watch (`TensorBoardSink`) or after the fact.

Tags are grouped so the UI stays navigable: `ampdoctor/{loss_scale,skipped,loss,grad_norm_total}` every step;
every step `headroom_bits/<module>` from the always-on series (fp16/bf16 outputs);
on sampled steps (StepRecord.modules non-empty) `absmax/<module>`, `headroom_bits/<module>`,
`underflow_share/<module>`, `nonfinite/<module>` from the module's forward output (all its calls in the step
pooled), and `grad_norm/<param>` from the optimizer-step parameter stats. Headroom is log2(max of the ref
dtype / absmax) with records.DTYPE_LIMITS; underflow share is subnormal / nonzero finite values.
"""
from __future__ import annotations

import math
import os

from ..records import DTYPE_LIMITS, RunMeta, StepRecord

__all__ = ["TensorBoardSink", "write_tensorboard", "step_scalars"]


def _module_scalars(rec: StepRecord) -> dict[str, float]:
    pooled: dict[str, list] = {}       # module -> [absmax, subnormal, nonzero finite, nonfinite, ref]
    for mc in rec.modules:
        st = mc.out
        if st is None:
            continue
        p = pooled.setdefault(mc.module or "(root)", [0.0, 0, 0, 0, st.ref])
        p[0] = max(p[0], st.absmax or 0.0)
        p[1] += st.subnormal
        p[2] += st.nonzero_finite
        p[3] += st.nonfinite
    out = {}
    for name, (absmax, sub, nzf, nonfin, ref) in pooled.items():
        out[f"absmax/{name}"] = absmax
        if absmax > 0:
            out[f"headroom_bits/{name}"] = math.log2(DTYPE_LIMITS.get(ref, DTYPE_LIMITS["float32"])[0] / absmax)
        if nzf:
            out[f"underflow_share/{name}"] = sub / nzf
        out[f"nonfinite/{name}"] = float(nonfin)
    return out


_CODE_MAX = {"h": DTYPE_LIMITS["float16"][0], "b": DTYPE_LIMITS["bfloat16"][0]}


def headroom_scalars(meta: RunMeta | None, rec: StepRecord) -> dict[str, float]:
    """`headroom_bits/<module>` on every step from the always-on series (StepRecord.headroom): log2(max of the
    output's low-precision dtype / abs-max), -inf when the output was not finite; fp32 values are left out."""
    h = rec.headroom
    if meta is None or not h:
        return {}
    out = {}
    dts = h.get("dtype") or ""
    for i, v in enumerate(h.get("fwd") or ()):
        mx = _CODE_MAX.get(dts[i:i + 1])
        if v is None or mx is None or i >= len(meta.modules):
            continue
        name = meta.modules[i][0] or "(root)"
        out[f"headroom_bits/{name}"] = math.log2(mx / v) if math.isfinite(v) and v > 0 else (
            -math.inf if not math.isfinite(v) else math.inf)
    return {k: v for k, v in out.items() if v != math.inf}


def step_scalars(rec: StepRecord, meta: RunMeta | None = None) -> dict[str, float]:
    """Every scalar one step contributes, by tag (None values are left out)."""
    out = {"ampdoctor/skipped": 1.0 if rec.skipped else 0.0}
    for tag, v in (("ampdoctor/loss_scale", rec.scale), ("ampdoctor/loss", rec.loss),
                   ("ampdoctor/grad_norm_total", rec.grad_norm)):
        if v is not None:
            out[tag] = float(v)
    if rec.modules:
        out.update(_module_scalars(rec))
    out.update(headroom_scalars(meta, rec))  # every step; the same series on sampled and routine steps
    for p in rec.params:
        if p.grad_norm is not None:
            out[f"grad_norm/{p.name}"] = float(p.grad_norm)
    return out


class TensorBoardSink:
    """Writes each flushed step's scalars to TensorBoard; `close()` flushes and is idempotent.

    `logdir`: where a new SummaryWriter writes (default: torch's `runs/<date>`). `writer`: an existing
    SummaryWriter-like object (anything with `add_scalar`) to share with the user's own logging; the sink
    flushes but never closes a writer it did not create.
    """

    def __init__(self, logdir: str | os.PathLike | None = None, writer=None) -> None:
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(log_dir=None if logdir is None else os.fspath(logdir))
            self._owns = True
        else:
            self._owns = False
        self.writer = writer
        self._closed = False

    @property
    def logdir(self) -> str | None:
        get = getattr(self.writer, "get_logdir", None)
        return get() if get else None

    def on_step(self, meta: RunMeta | None, rec: StepRecord) -> None:
        if self._closed:
            raise RuntimeError("TensorBoardSink.on_step called after close(); create a new sink to keep logging.")
        for tag, value in step_scalars(rec, meta).items():
            self.writer.add_scalar(tag, value, global_step=rec.step)

    def flush(self) -> None:
        if hasattr(self.writer, "flush"):
            self.writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self._owns:
            self.writer.close()

    def __enter__(self) -> "TensorBoardSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_tensorboard(meta: RunMeta | None, steps: list[StepRecord], logdir: str | os.PathLike) -> str:
    """Write all of a run's steps as TensorBoard scalars under `logdir`; return the logdir."""
    with TensorBoardSink(logdir) as sink:
        for rec in steps:
            sink.on_step(meta, rec)
        return sink.logdir or os.fspath(logdir)
