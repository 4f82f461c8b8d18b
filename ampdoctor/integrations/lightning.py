"""`AmpDoctorLightningCallback`: ampdoctor inside a Lightning `Trainer`, in one line.

    trainer = L.Trainer(precision="16-mixed", callbacks=[AmpDoctorLightningCallback()])

On fit start it watches the LightningModule, its optimizer and the precision plugin's GradScaler
(`trainer.precision_plugin.scaler`: "16-mixed" has one, "bf16-mixed" none); records go to
`trainer.default_root_dir/ampdoctor` unless `run_dir` says otherwise. Lightning calls `training_step`, not the
module's forward, so the callback marks each batch's start and hands the watch the loss before backward. After
every training batch it logs `ampdoctor/loss_scale`, `ampdoctor/skipped_steps` and `ampdoctor/bad_steps`
through `pl_module.log`; at fit end (or on an exception) the watch is closed and `report.json` written.
"""
from __future__ import annotations

import os


import ampdoctor

from . import begin_iteration, finish, note_loss, scalars

try:
    from lightning.pytorch import Callback
except ImportError as e:  # pragma: no cover - exercised only without lightning installed
    raise ImportError("AmpDoctorLightningCallback needs Lightning: pip install lightning") from e

__all__ = ["AmpDoctorLightningCallback"]


class AmpDoctorLightningCallback(Callback):
    """Watch a Lightning run with ampdoctor.

    Args:
        run_dir: where the run directory goes; default `trainer.default_root_dir/ampdoctor`.
        every: full per-layer statistics every N-th optimizer step (see `ampdoctor.watch`).
        log: log ampdoctor's scalars through `pl_module.log` after every training batch.
        tensorboard_dir: also write ampdoctor's per-step scalars there (`ampdoctor.watch(tensorboard_dir=)`).
        headroom: the per-step headroom series for the `headroom_trend` early warning, as in
            `ampdoctor.watch` (None: the default, "auto"; True: every step; False: sampled steps only).
    """

    def __init__(self, run_dir=None, every: int | None = None, *, log: bool = True, tensorboard_dir=None,
                 headroom: bool | str | None = None):
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.every = every
        self.log = log
        self.tensorboard_dir = tensorboard_dir
        self.headroom = headroom
        self.watch = None
        self.report = None
        self._run_dir = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._close()
        self._run_dir = self.run_dir or os.path.join(trainer.default_root_dir, "ampdoctor")
        opts = list(trainer.optimizers)
        plugin = getattr(trainer, "precision_plugin", None) or trainer.strategy.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        # With several optimizers none is named here; the watch adopts each one that steps on the module.
        self.watch = ampdoctor.watch(pl_module, optimizer=opts[0] if len(opts) == 1 else None, scaler=scaler,
                                     run_dir=self._run_dir, every=self.every, tensorboard_dir=self.tensorboard_dir,
                                     headroom=self.headroom)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        begin_iteration(self.watch)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        note_loss(self.watch, loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.log:
            vals = scalars(self.watch)
            if vals:
                pl_module.log_dict(vals, on_step=True, on_epoch=False, batch_size=1)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close(merge=False)  # the report of a crashed run is the one users need most; no barrier

    def _close(self, merge: bool = True) -> None:
        w, self.watch = self.watch, None
        if w is not None:
            self.report = finish(w, self._run_dir, merge=merge)
