"""Callbacks that switch ampdoctor on inside the trainers where users train: one line each.

    from ampdoctor.integrations import AmpDoctorCallback           # Hugging Face transformers.Trainer
    from ampdoctor.integrations import AmpDoctorLightningCallback  # Lightning (lightning.pytorch.Trainer)

The frameworks are imported only when their callback is first used, so ampdoctor works without them. This
module also holds what both callbacks share: the scalars they log, the end-of-training report (one per rank,
merged by rank 0) and two small bridges to the step machine for trainers whose loop never calls the watched
module's own forward (Lightning's `training_step`).
"""
from __future__ import annotations

import os

__all__ = ["AmpDoctorCallback", "AmpDoctorLightningCallback"]

_LAZY = {"AmpDoctorCallback": ".hf", "AmpDoctorLightningCallback": ".lightning"}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module
    value = getattr(import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# -- shared by the callbacks ---------------------------------------------------------------------------------

def scalars(w) -> dict[str, float]:
    """ampdoctor's per-run scalars for a trainer's logger: the current loss scale (with an enabled scaler) and
    the number of skipped and bad steps so far. Called once per logging step, never from a hook: reading the
    scale is one device->host copy."""
    if w is None or w.closed:
        return {}
    m = w.machine
    if m.st.ended and not getattr(m, "disabled", False):
        m.finish_open_step()  # the step has been stepped and updated: let it count now, not one step late
    recs = w.steps
    out = {"ampdoctor/skipped_steps": float(sum(bool(r.skipped) for r in recs)),
           "ampdoctor/bad_steps": float(sum(bool(r.bad) for r in recs))}
    sc = w.scaler
    if sc is not None and getattr(sc, "is_enabled", lambda: False)():
        out["ampdoctor/loss_scale"] = float(sc.get_scale())
    return out


def begin_iteration(w) -> None:
    """A new training iteration starts (a trainer's batch-start hook): close the step that the last optimizer
    step ended. The watch does this itself when the watched module's forward runs; Lightning calls
    `training_step`, which may call only submodules, so the callback says it instead."""
    if w is None or w.closed:
        return
    fn = getattr(w, "begin_iteration", None)  # the public name, once the core has it
    if fn is not None:
        fn()
        return
    m = w.machine
    if not getattr(m, "disabled", False):
        m.begin()


def note_loss(w, loss) -> None:
    """Hand the watch the loss about to be backpropagated when nothing else shows it: no scaler (scaler.scale
    records it) and a root forward that did not return it. The same tensor is never counted twice."""
    import torch
    if w is None or w.closed or w.scaler is not None:
        return
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        return
    fn = getattr(w, "note_loss", None)
    if fn is not None:
        fn(loss)
        return
    m = w.machine
    if getattr(m, "disabled", False) or m.st.synced is not None:
        return
    t = loss.detach().reshape(())
    if any(x.data_ptr() == t.data_ptr() for x in m.st.losses):
        return
    m.st.losses.append(t)


def finish(w, run_dir: str, *, merge: bool = True) -> object:
    """Close the watch and write its report. In a distributed run every rank writes
    `run_dir/rank-<r>/report.json`, then (with `merge`) rank 0 writes the merged `run_dir/report.json` after a
    barrier. Pass merge=False where the other ranks may never reach it (an exception on this rank).
    Returns the Report this process wrote last (the merged one on rank 0)."""
    import torch.distributed as dist
    import ampdoctor
    if w is None:
        return None
    w.close()
    rep = w.report()
    rank, world = w.meta.rank, w.meta.world_size or 1
    if rank is None or world <= 1:
        rep.save_json(os.path.join(run_dir, "report.json"))
        return rep
    rep.save_json(os.path.join(run_dir, f"rank-{rank}", "report.json"))
    if not merge:
        return rep
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's steps.jsonl is closed before rank 0 reads them
    if rank == 0:
        rep = ampdoctor.diagnose(run_dir)
        rep.save_json(os.path.join(run_dir, "report.json"))
    return rep
