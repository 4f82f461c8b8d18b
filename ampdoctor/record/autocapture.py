"""Capturing a bad step during training: where the capture goes (the run directory, per rank, or a temporary
directory that w.report() can still replay), how many a watch writes, and why none is written for sharded
(FSDP2) models. The capture format itself is ampdoctor/capture.py."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import warnings

__all__ = ["maybe_capture"]


def maybe_capture(m, st) -> None:
    """Write the capture of the bad step `st` (the micro-batch that went bad, else the last), within the watch's
    capture budget; never raises."""
    w = m.w
    if not (m.cfg.capture and m._captures < m.cfg.max_captures and st.batches):
        return
    m._captures += 1
    if m.sharded:  # a collective from one rank (to gather the weights) would hang the others
        warnings.warn(f"ampdoctor: step {st.step} went bad, but the model's parameters are sharded (FSDP2/"
                      "DTensor), so no capture was written: a capture holds the whole model. To replay it, load a "
                      "full checkpoint into an unsharded model and call ampdoctor.save_batch.",
                      RuntimeWarning, stacklevel=4)
        return
    try:
        from ..capture import write_capture
        if w.run_dir:
            path = os.path.join(w.run_dir, *([f"rank-{w.meta.rank}"] if w.meta.rank is not None and
                                             (w.meta.world_size or 1) > 1 else []), "captures", str(st.step))
        else:  # no run directory: a temporary capture, so that w.report() can still replay it
            path = os.path.join(_tmp_root(), f"{id(w):x}-{st.step}")
        k = st.bad_batch if 0 <= st.bad_batch < len(st.batches) else -1  # else the last micro-batch
        args, kwargs, rng = st.batches[k]
        m.suspended = True
        hr_on, m.hr.on = m.hr.on, False  # the capture's own forward is not the step's
        try:
            st.capture = write_capture(path, w.model, args, kwargs, rng=rng, autocast=st.autocast,
                                       scaler_state=w.scaler.state_dict() if w.scaler is not None else None,
                                       step=st.step)
        finally:
            m.suspended = False
            m.hr.on = hr_on
    except Exception as e:  # a capture must never break training
        warnings.warn(f"ampdoctor: could not write a capture of step {st.step} ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=4)


_TMP: list[str] = []


def _tmp_root() -> str:
    if not _TMP:
        _TMP.append(tempfile.mkdtemp(prefix="ampdoctor-captures-"))
        atexit.register(shutil.rmtree, _TMP[0], True)
    return _TMP[0]
