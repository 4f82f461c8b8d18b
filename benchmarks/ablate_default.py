"""Where the default watch's fixed per-step cost goes, by ablation: the plain step, the watch, and the watch with
one of its pieces switched off, interleaved in one process (ratios of medians, the loop syncing every iteration
with `loss.item()` as issue 15's nanoGPT step does). A diagnostic, not a configuration: a switched-off piece
leaves the watch incomplete (e.g. `nostore` keeps no records), so only the timings mean anything.

    python benchmarks/ablate_default.py --model nanogpt --device cuda [--watch hroff|default] [--steps 60]
    python benchmarks/ablate_default.py --model tiny --device cpu --amp off

Pieces (each a variant "<watch>-<piece>"):
    loc      caller_location (the user's file:line of each scaler/optimizer/clip call)
    event    CallEvent objects of the routine calls (one per call, then dropped as repeats)
    store    storing the finished record (StepStore, spill file, run-dir line)
    rng      the RNG state kept with each batch (for a capture's replay)
    sums     the output trip-wire (one sum per root output)
    keepgrad the tensor hooks that keep the gradient into small root outputs (for a capture)
    pending  the step's one transfer (concatenation, copy, event) and its read-back
    fwd      both root forward hooks
    clip     the clipping functions' wrappers
every=1's own pieces (with --watch every1):
    cpass    the C pass of each CPU tensor's statistics (cpustats.stats answers a constant row)
    measure  queueing a tensor's statistics at all (openstep._Step.measure returns at once)
    exits    the walk for each module's gradient exits and their node hooks (gradexits.gradient_exits finds none)
    pnorms   the parameters' norms (params.norms answers zeros)
    rows     turning the step's rows into TensorStats at finalize (assemble._stats_for answers None)
A piece "spinN" is the plain step with N us of busy host time first (a calibration). A piece "a+b" switches several off together; "all" switches off every one (the skeleton that is left).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.overhead import Variant, build  # noqa: E402

OFF: set = set()  # the pieces switched off for the variant now stepping
SWITCHES: list = []  # called when OFF changes (pieces that are module constants)
PIECES = ("loc", "event", "store", "rng", "sums", "keepgrad", "pending", "fwd", "clip")
EVERY1_PIECES = ("cpass", "measure", "exits", "pnorms", "rows")


def _patch() -> None:
    from ampdoctor.record import assemble as A, clippatch, hostcopy, modulehooks as MH, step as S, transfer as T
    from ampdoctor.records import CallEvent

    loc = S.caller_location
    S.caller_location = lambda skip=2: (None, None) if "loc" in OFF else loc(skip + 1)

    ev = S.StepMachine.event

    def event(self, kind, skip=3, **kw):
        if "event" in OFF and not self.st.sampled:
            return CallEvent(kind=kind, step=0, index=0, **kw)  # not appended: the record holds none
        return ev(self, kind, skip + 1, **kw)
    S.StepMachine.event = event

    store = A.store
    A.store = lambda m, rec, **kw: None if "store" in OFF else store(m, rec, **kw)

    rng = MH.rng_state  # (the module hooks' names live in record/modulehooks.py)
    MH.rng_state = lambda *a, **kw: {} if "rng" in OFF else rng(*a, **kw)

    flat = MH.flatten_tensors

    def flatten(x, out):  # _forward_post's output list: empty = no sums, no gradient hooks
        if ("sums" in OFF or "keepgrad" in OFF) and sys._getframe(1).f_code.co_name == "_forward_post":
            return [] if "sums" in OFF else flat(x, out)
        return flat(x, out)
    MH.flatten_tensors = flatten
    keep = MH.GRAD_OUT_BYTES  # (the node pre-hooks keeping a small output's gradient: none past this size)
    SWITCHES.append(lambda: setattr(MH, "GRAD_OUT_BYTES", -1 if "keepgrad" in OFF else keep))

    class NoPending:
        def __init__(self, parts, *a, **k):
            self.via_scaler = k.get("via_scaler", a[1] if len(a) > 1 else False)
            self.grads_scaled = k.get("grads_scaled", a[2] if len(a) > 2 else False)

        def result(self):
            return {}
    P = hostcopy.Pending
    T.Pending = lambda *a, **k: NoPending(*a, **k) if "pending" in OFF else P(*a, **k)

    fpre, fpost = S.StepMachine.forward_pre, S.StepMachine.forward_post
    S.StepMachine.forward_pre = lambda self, *a: None if "fwd" in OFF else fpre(self, *a)
    S.StepMachine.forward_post = lambda self, *a: None if "fwd" in OFF else fpost(self, *a)

    fan = clippatch.ClipPatch._fan_out.__func__

    def fan_out(cls, kind, parameters, orig, args, kwargs, norm_arg=None):
        if "clip" in OFF:
            return orig(parameters, *args, **kwargs)
        return fan(cls, kind, parameters, orig, args, kwargs, norm_arg)
    clippatch.ClipPatch._fan_out = classmethod(fan_out)

    from ampdoctor.record import cpustats, openstep, params
    cst = cpustats.stats
    row = torch.tensor([0.0, 0, 0, 0, 0, 0.0, float("inf"), 0, 0, 0], dtype=torch.float64)
    cpustats.stats = lambda x, ref: row.clone() if "cpass" in OFF else cst(x, ref)
    meas = openstep._Step.measure
    openstep._Step.measure = lambda self, *a, **k: None if "measure" in OFF else meas(self, *a, **k)
    ge = MH.gradient_exits
    MH.gradient_exits = lambda *a, **k: [] if "exits" in OFF else ge(*a, **k)
    nrm = params.norms

    def norms(ts, o):
        return torch.zeros(len(ts), dtype=torch.float64) if "pnorms" in OFF else nrm(ts, o)
    from ampdoctor.record import buffers, optsink
    for mod in (params, buffers, MH, optsink, S, T):  # (each imported the name)
        if getattr(mod, "norms", None) is nrm:
            mod.norms = norms
    sf = A._stats_for
    A._stats_for = lambda c, slot, rows: None if "rows" in OFF else sf(c, slot, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nanogpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="fp16", choices=["fp16", "bf16", "off"])
    p.add_argument("--watch", default="hroff", choices=["hroff", "default", "every1"])
    p.add_argument("--pieces", default=",".join(PIECES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--copies", type=int, default=1,
                   help="instances of each variant (own model copy, optimizer, scaler), interleaved; the table gives "
                        "the median of their medians and the spread between them (what one instance's memory "
                        "layout is worth)")
    a = p.parse_args()
    _patch()
    dev = torch.device(a.device)
    base, batches, loss_of = build(a.model, dev)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[a.amp]
    pieces = [x for x in a.pieces.split(",") if x]
    # a piece "a+b" switches several off at once ("all": every piece, what the watch's skeleton alone costs)
    # "spinN": the plain step with N us of busy host time before its zero_grad (right after the loop's loss.item()):
    # a known host cost where the device is idle, to calibrate what the method resolves
    runs = [("plain", "plain", ()), (a.watch, a.watch, ())] + [
        (f"plain+{x}", "plain", (x,)) if x.startswith("spin") else
        (f"{a.watch}-{x}", a.watch, tuple(PIECES + EVERY1_PIECES) if x == "all" else tuple(x.split("+")))
        for x in pieces]
    vs = []
    for _ in range(a.copies):
        for label, name, off in runs:
            v = Variant(name, copy.deepcopy(base), dev, amp)
            v.label, v.off = label, set(off)
            v.install()
            vs.append(v)
    for i in range(a.steps + 10):
        for v in vs:
            OFF.clear()
            OFF.update(v.off)
            for f in SWITCHES:
                f()
            t = time.perf_counter()
            for x in v.off:
                if x.startswith("spin"):
                    end = t + float(x[4:]) * 1e-6
                    while time.perf_counter() < end:
                        pass
            v.step(batches[i % len(batches)], loss_of).item()
            if i >= 10:
                v.times.append(time.perf_counter() - t)
    OFF.clear()
    # a watch that switched itself off (an internal error, e.g. a patch here gone stale) measures nothing: say so
    off = sorted({v.label for v in vs if v.watch is not None and v.watch.machine.disabled})
    if off:
        print(f"INVALID: these variants' watches disabled themselves: {', '.join(off)}")
    meds: dict[str, list[float]] = {}
    for v in vs:
        meds.setdefault(v.label, []).append(statistics.median(v.times))
    mid = {k: statistics.median(x) for k, x in meds.items()}
    plain, watch = mid["plain"], mid[runs[1][0]]
    print(f"model={a.model} device={a.device} amp={a.amp} torch {torch.__version__} steps={a.steps} "
          f"copies={a.copies}")
    print("| variant | median ms | ratio | +ms over plain | saved vs watch (ms) | spread of copies (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, md in mid.items():
        print(f"| {k} | {md * 1e3:.3f} | {md / plain:.3f}x | {(md - plain) * 1e3:+.3f} | "
              f"{(watch - md) * 1e3:+.3f} | {(max(meds[k]) - min(meds[k])) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
