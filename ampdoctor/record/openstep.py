"""The data of one open step: each module call's queued statistic rows, and everything else the hooks and the
monitor gather until the step's one transfer to the host (ampdoctor/record/transfer.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["_Call", "_Step"]


@dataclass
class _Call:
    module: str
    type: str
    call: int
    seq: int
    depth: int
    parent: int | None
    autocast: str | None
    grad_enabled: bool
    rows: dict = field(default_factory=lambda: {"inp": [], "par": [], "out": [], "gout": [], "gin": []})
    bseq: int | None = None
    grad_inputs: list | None = None  # inputs that require grad, from forward_pre until forward_post
    seq0: int = 0                    # the autograd sequence number when the forward began


@dataclass
class _Step:
    step: int
    sampled: bool
    calls: list = field(default_factory=list)
    vecs: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    stack: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    events: list = field(default_factory=list)
    scale_t: object = None
    found_inf_t: object = None
    grad_parts: object = None  # (names, abs-max, L2) of the gradients right after unscale_ (sync.grads_after_unscale)
    param_names: list = field(default_factory=list)
    upd: list = field(default_factory=list)
    batches: list = field(default_factory=list)     # (args, kwargs, rng) of the last micro-batches
    bad_batch: int = -1                                # index into batches of the first non-finite output
    pw_index: list = field(default_factory=list)       # params whose weights were checked at presync
    w_deferred: bool = False                           # CPU: weights checked in resolve, on bad steps only
    out_ok: list = field(default_factory=list)
    output_finite: bool | None = None
    autocast: str | None = None
    micro: int = 0
    exception: dict | None = None
    synced: dict | None = None
    ended: bool = False
    bseq: int = 0
    in_scaler_step: int = 0
    scaled_since_update: bool = False
    capture: str | None = None
    vec_order: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)
    pending: object = None
    fbuf: dict = field(default_factory=dict)
    fused_amp: bool = False
    headroom: dict | None = None  # the always-on series read back at resolve (ampdoctor/record/headroom.py)
    regions: object = None  # gradexits.Regions of this step's walked module calls (released at presync)
    late: object = None  # values queued after presync (sync.found_inf_all), read at finalize
