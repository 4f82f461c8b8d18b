"""The recorder: hooks and patches that watch a training step, the open step's state machine, its one transfer
to the host, the statistics backends, and where finished StepRecords go. See README (Layout)."""
