"""`AmpDoctorCallback`: ampdoctor inside a Hugging Face `transformers.Trainer`, in one line.

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[AmpDoctorCallback()])

On train begin it watches the model, the optimizer and accelerate's GradScaler (the one the Trainer really
uses: `AcceleratedOptimizer.scaler`, the same object as `trainer.accelerator.scaler`); records go to
`args.output_dir/ampdoctor` unless `run_dir` says otherwise. Each `on_log` adds ampdoctor's scalars
(`ampdoctor/loss_scale`, `ampdoctor/skipped_steps`, `ampdoctor/bad_steps`) to the logs; on train end the watch
is closed and `report.json` written in the run directory (also kept as `callback.report`).
"""
from __future__ import annotations

import os

from transformers import TrainerCallback

import ampdoctor

from . import finish, scalars

__all__ = ["AmpDoctorCallback"]


def _unwrap_optimizer(opt):
    """The torch optimizer inside accelerate's AcceleratedOptimizer (the one GradScaler keys its state by)."""
    seen = 0
    while opt is not None and hasattr(getattr(opt, "optimizer", None), "param_groups") and seen < 4:
        opt, seen = opt.optimizer, seen + 1
    return opt


def _find_scaler(opt):
    """accelerate hands its GradScaler to the AcceleratedOptimizer it wraps the user's optimizer in; fp32, bf16
    and DeepSpeed runs have none."""
    sc = getattr(opt, "scaler", None)
    if sc is not None and all(hasattr(sc, k) for k in ("scale", "unscale_", "step", "update")):
        return sc
    return None


class AmpDoctorCallback(TrainerCallback):
    """Watch a `transformers.Trainer` run with ampdoctor.

    Args:
        run_dir: where the run directory goes; default `args.output_dir/ampdoctor`.
        every: full per-layer statistics every N-th optimizer step (see `ampdoctor.watch`); default
            ampdoctor's cheap sampling. Every step is still checked for inf/NaN and skipped steps.
        tensorboard_dir: also write ampdoctor's per-step scalars there (`ampdoctor.watch(tensorboard_dir=)`).
        headroom: the per-step headroom series for the `headroom_trend` early warning, as in
            `ampdoctor.watch` (None: the default, "auto"; True: every step; False: sampled steps only).
    """

    def __init__(self, run_dir=None, every: int | None = None, *, tensorboard_dir=None,
                 headroom: bool | str | None = None):
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.every = every
        self.tensorboard_dir = tensorboard_dir
        self.headroom = headroom
        self.watch = None
        self.report = None
        self._run_dir = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._close()  # a second train() (or auto_find_batch_size's retry) starts a new run in the same dir
        if model is None:
            return
        self._run_dir = self.run_dir or os.path.join(args.output_dir or ".", "ampdoctor")
        self.watch = ampdoctor.watch(model, optimizer=_unwrap_optimizer(optimizer), scaler=_find_scaler(optimizer),
                                     run_dir=self._run_dir, every=self.every,
                                     tensorboard_dir=self.tensorboard_dir, headroom=self.headroom)

    def on_log(self, args, state, control, logs=None, **kwargs):
        vals = scalars(self.watch)
        if not vals or logs is None:
            return
        logs.update(vals)  # seen by the callbacks after this one (progress bar / printer)
        hist = state.log_history
        if hist and hist[-1].get("step") == state.global_step:
            hist[-1].update(vals)  # the Trainer appended this log's copy before calling on_log

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    def _close(self) -> None:
        w, self.watch = self.watch, None
        if w is not None:
            self.report = finish(w, self._run_dir)
