"""Run one case of the corpus: the unwatched run (ground truth: losses, scales, skipped and non-finite steps),
then the same seed watched through ampdoctor's public API only (`ampdoctor.watch`, `w.report()`,
`ampdoctor.save_batch`/`ampdoctor.replay`), with every warning captured; compare and judge."""
from __future__ import annotations

import math
import shutil
import struct
import tempfile
import time
import traceback
import warnings

import torch

from . import loops, nanogpt
from .cases import Case
from .models import SPECS

DISABLED = ("disabled itself", "internal error", "please report")


def _train(case: Case, size, device, iters, opts, watch, on_iter):
    opts = dict(opts)
    if case.model == "nanogpt":
        cfg = {k: opts.pop(k) for k in list(opts) if k in nanogpt.TrainConfig.__dataclass_fields__}
        c = nanogpt.TrainConfig(size=size, device=device, dtype=case.dtype, compile=case.compiled, iters=iters, **cfg)
        return nanogpt.train(c, watch=watch, on_iter=on_iter, **opts)
    return loops.plain_train(case.model, size=size, device=device, dtype=case.dtype, compile=case.compiled,
                             iters=iters, watch=watch, on_iter=on_iter, **opts)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x) if not math.isnan(x) else b"nan"


class InputGrads:
    """Which module calls of the first grad-enabled forward had an input that needs a gradient (a floating tensor
    with requires_grad) and an output that is not one of their inputs (an Identity passes its input on: no
    gradient leaves it). The harness's own hooks, registered before the watch's, removed after that forward."""

    def __init__(self):
        self.needs: dict = {}  # module name -> [bool per call, in call order]
        self._handles = []
        self._root = None

    def attach(self, model):
        self._root = model
        for name, mod in model.named_modules():
            self._handles.append(mod.register_forward_hook(
                lambda m, args, kwargs, out, name=name: self._post(m, name, args, kwargs, out), with_kwargs=True))

    def _post(self, mod, name, args, kwargs, out):
        if not torch.is_grad_enabled():
            return
        ins = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        need = any(t.is_floating_point() and t.requires_grad for t in ins) and not any(out is t for t in ins)
        self.needs.setdefault(name, []).append(need)
        if mod is self._root:
            for h in self._handles:
                h.remove()
            self._handles = []


def run_once(case: Case, size, device, iters, *, watched, run_dir=None, every=None):
    """One run. Returns a dict with losses, per-step scales, warnings, the report (watched) and timings."""
    opts = case.options(size, device)
    inject = opts.get("inject")
    rows = []
    out = {"losses": None, "warnings": [], "report": None, "error": None, "report_error": None, "model": None,
           "watch": None}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            wfn = None
            if watched:
                import ampdoctor
                probe = out["input_grads"] = InputGrads()

                def wfn(m, o, s):
                    probe.attach(m)
                    out["watch"] = ampdoctor.watch(m, optimizer=o, scaler=s, run_dir=run_dir, every=every,
                                                   headroom=case.headroom or None)
                    return out["watch"]
            losses, w, model = _train(case, size, device, iters, opts, wfn,
                                      lambda it, l, s0, s1: rows.append((l, s0, s1)))
            out.update(losses=losses, model=model, watch=w)
            if w is not None:
                w.close()
                out["report"] = w.report()
        except Exception as e:  # noqa: BLE001 - a measurement: record and go on
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            out["traceback"] = traceback.format_exc(limit=8)
            if out["watch"] is not None and out["report"] is None:  # the loop crashed: what the watch says then
                try:
                    out["watch"].close()
                    out["report"] = out["watch"].report()
                except Exception as e2:  # noqa: BLE001
                    out["report_error"] = f"{type(e2).__name__}: {e2}"
        if device == "cuda":
            torch.cuda.synchronize()
    out["seconds"] = time.perf_counter() - t0
    out["warnings"] = [f"{w.category.__name__}: {str(w.message).splitlines()[0][:300]}" for w in caught]
    out["rows"] = rows
    out["inject_info"] = dict(getattr(inject, "info", {}) or {})
    return out


def ground_truth(rows):
    skipped = [s1 is not None and s1 < s0 for _, s0, s1 in rows]
    nonfinite = [not math.isfinite(l) for l, _, _ in rows]
    bad = [i for i in range(len(rows)) if skipped[i] or nonfinite[i]]
    lead = 0
    while lead < len(skipped) and skipped[lead] and not nonfinite[lead]:
        lead += 1  # GradScaler's search: leading skips with a finite loss
    later = [i for i in bad if i >= lead]
    return {"skipped": [i for i, s in enumerate(skipped) if s], "nonfinite": [i for i, n in enumerate(nonfinite) if n],
            "first_bad": later[0] if later else None, "first_any_bad": bad[0] if bad else None,
            "leading_skips": lead, "first_update": next((i for i, s in enumerate(skipped) if not s), None)}


def _nondeterministic(warns):
    return sorted({w.split(": ", 1)[1][:160] for w in warns if "deterministic" in w and "ampdoctor" not in w})


def compare_losses(a, b, nondet: bool):
    if a is None or b is None:
        return "n/a", None
    if len(a) != len(b):
        return "DIFF(len)", None
    if all(_bits(x) == _bits(y) for x, y in zip(a, b)):
        return "==", 0.0
    fin = [(x, y) for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y)]
    rel = max((abs(x - y) / max(abs(x), 1e-12) for x, y in fin), default=float("inf"))
    same_nf = all(math.isfinite(x) == math.isfinite(y) for x, y in zip(a, b))
    if nondet and same_nf and rel <= 1e-2:
        return f"~{rel:.0e}", rel
    return f"DIFF {rel:.0e}", rel


def healthy_replay(case: Case, size, device, model):
    """save_batch + replay of a fresh batch in train mode (dropout on), full replay (shadow, what-if, fix)."""
    import ampdoctor
    d = tempfile.mkdtemp(prefix="rw-replay-")
    try:
        devs = [torch.cuda.current_device()] if device == "cuda" else []
        with torch.random.fork_rng(devices=devs):
            model.train()
            if case.model == "nanogpt":
                c = model.config
                idx = torch.randint(0, c.vocab_size, (nanogpt.SIZES[size][4], c.block_size), device=device)
                args, kwargs, loss_fn = (idx, idx), {}, (lambda out, *a, **k: out[1])
            else:
                args, kwargs, target = SPECS[case.model].batch(size, device)
                loss_fn = (lambda out, *a, **k: SPECS[case.model].loss(out, target)) if target is not None else None
            with torch.autocast(device, dtype=getattr(torch, case.dtype)):
                cap = ampdoctor.save_batch(f"{d}/cap", model, *args, **kwargs)
            rep = ampdoctor.replay(cap, model=model, loss_fn=loss_fn)
        return rep
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _gin_share(w, needs: dict | None = None):
    """Of step 0's module calls with a gradient into their outputs and an input that needs one (a floating
    input: gin is read where the gradient leaves towards it), the share whose gin was measured. `needs`
    (InputGrads.needs): calls whose inputs needed no gradient (the batch itself, a timestep embedding made from
    integers) or that pass an input on as their output are left out."""
    if w is None or not len(w.steps) or not w.steps[0].sampled:
        return None
    needs = needs or {}

    def needed(c):
        got = needs.get(c.module)
        return got is None or c.call >= len(got) or got[c.call]
    calls = [c for c in w.steps[0].modules if c.gout is not None and c.inp is not None and c.grad_enabled
             and c.inp.dtype in ("float16", "bfloat16", "float32") and needed(c)]
    return None if not calls else sum(c.gin is not None for c in calls) / len(calls)


def run_case(case: Case, size="tiny", device="cpu", quick=False, keep_dir=None, every=None):
    iters = case.iters[size] if not quick else max(4, case.iters[size] // 2)
    res = {"case": case.name, "model": case.model, "dtype": case.dtype, "compiled": case.compiled,
           "kind": case.kind, "iterations": iters, "note": case.note, "every": every}
    un = run_once(case, size, device, iters, watched=False)
    run_dir = tempfile.mkdtemp(prefix="rw-run-", dir=keep_dir)
    wa = run_once(case, size, device, iters, watched=True, run_dir=run_dir, every=every)
    gt = ground_truth(un["rows"])
    nondet = _nondeterministic(un["warnings"] + wa["warnings"])
    base = None
    if device == "cuda" and case.kind == "healthy":
        # a second unwatched run: if two runs without ampdoctor differ, the kernels are nondeterministic
        # (whether or not torch flags them) and only a tolerance can be asked of the watched run
        base = compare_losses(un["losses"], run_once(case, size, device, iters, watched=False)["losses"], False)[0]
        if base != "==":
            nondet.append(f"unwatched run-to-run: {base}")
    # a loop that crashes without the watch too (torch's own error on a misused GradScaler): the crash is the truth;
    # the watched run must crash the same way after the same iterations, and its report is read after the crash
    crashed = un["error"] is not None and wa["error"] == un["error"]
    if crashed:
        eq, rel = compare_losses([r[0] for r in un["rows"]], [r[0] for r in wa["rows"]], bool(nondet))
        iters = len(un["rows"])  # (the iteration that raised may count as a step the watch saw begin)
    else:
        eq, rel = compare_losses(un["losses"], wa["losses"], bool(nondet))
    res["crashed"] = un["error"] if crashed else None
    internal = [w for w in wa["warnings"] if "ampdoctor" in w.lower() and any(k in w.lower() for k in DISABLED)]
    if wa["error"] and not crashed:
        internal.append("watched run raised: " + wa["error"])
    if wa["report_error"]:
        internal.append("the report after the crash raised: " + wa["report_error"])
    rep = wa["report"].to_dict() if wa["report"] is not None else {"findings": [], "summary": {}}
    fs = rep["findings"]
    res.update(gt=gt, losses_equal=eq, unwatched_run_to_run=base, loss_max_rel_diff=rel, nondeterministic_ops=nondet,
               losses_unwatched=un["losses"], losses_watched=wa["losses"], unwatched_error=un["error"],
               watched_error=wa["error"], watched_traceback=wa.get("traceback"), internal_errors=internal,
               ampdoctor_warnings=[w for w in wa["warnings"] if "ampdoctor" in w.lower()],
               steps_recorded=rep["summary"].get("steps"), summary=rep["summary"],
               n_warning=sum(f["severity"] == "warning" for f in fs), n_error=sum(f["severity"] == "error" for f in fs),
               top3=[_short(f) for f in fs[:3]], findings=[{k: f[k] for k in ("rule", "severity", "phase", "module",
                                                                              "op", "step", "message", "fix")}
                                                         for f in fs[:8]],
               inject_info=wa["inject_info"], seconds_unwatched=un["seconds"], seconds_watched=wa["seconds"],
               run_dir=run_dir if keep_dir else None)
    # the hooks read gradients at all: on step 0 (sampled) of an eager run, modules whose inputs need a gradient
    # have one measured towards those inputs (torch 2.11's short-lived node objects once left every one unread)
    gin = _gin_share(wa["watch"], getattr(wa.get("input_grads"), "needs", None)) if not case.compiled else None
    res["gin_share_step0"] = gin
    if gin is not None and gin < 0.9:
        internal.append(f"input gradients read for {gin:.0%} of step 0's module calls with a gradient")
    steps_ok = res["steps_recorded"] in ((iters, iters + 1) if crashed else (iters,))
    ok = not internal and steps_ok and eq in ("==",) + ((eq,) if eq.startswith("~") else ())
    why = []
    if internal:
        why.append("internal error")
    if not steps_ok:
        why.append(f"steps {res['steps_recorded']}!={iters}")
    if not (eq == "==" or eq.startswith("~")):
        why.append("losses differ")
    if any("replay of" in w and "failed" in w for w in res["ampdoctor_warnings"]):
        why.append("the report's replay failed")  # (w.report()'s in-process replay of a capture: a warning only)
    if case.kind == "healthy":
        res["expected"] = "0 warnings, 0 errors (run + replay)"
        rw = re = None
        if wa["model"] is not None:
            t = time.perf_counter()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    rr = healthy_replay(case, size, device, wa["model"])
                rfs = rr.to_dict()["findings"]
                rw = sum(f["severity"] == "warning" for f in rfs)
                re = sum(f["severity"] == "error" for f in rfs)
                res["replay_findings"] = [_short(f) for f in rfs if f["severity"] != "info"][:5]
                res["replay_warnings"] = [f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught
                                          if "ampdoctor" in str(w.message).lower()]
            except Exception as e:  # noqa: BLE001
                res["replay_exception"] = f"{type(e).__name__}: {e}"[:300]
                why.append("replay raised")
            res["seconds_replay"] = time.perf_counter() - t
        res.update(replay_n_warning=rw, replay_n_error=re)
        if res["n_warning"] or res["n_error"]:
            why.append("report not clean")
        if rw or re:
            why.append("replay not clean")
        if un["error"]:
            why.append("unwatched run raised")
    else:
        info = wa["inject_info"] or un["inject_info"]
        res["replay_n_warning"] = res["replay_n_error"] = None
        try:
            reqs = case.expect(gt, info)
        except Exception as e:  # noqa: BLE001 - e.g. no bad step at all
            reqs, why = [], why + [f"no expectation ({type(e).__name__}: {e})"]
        res["expected"] = " & ".join(" or ".join(e.label() for e in req) for req in reqs)
        top = fs[:3]
        for req in reqs:
            if not any(e.matches(f) for e in req for f in top):
                why.append("missing " + " or ".join(e.label() for e in req))
        for r in case.forbid:
            if any(f["rule"] == r for f in top):
                why.append(f"{r} in top 3")
        if case.extra is not None:
            good, label = case.extra(rep, gt, info)
            res["expected"] += f" & {label}"
            if not good:
                why.append(f"no {label}")
    res["verdict"] = "PASS" if not why else "FAIL"
    if case.kind == "injected" and case.needs_bad_step and gt["first_bad"] is None:
        res["verdict"], why[:] = "N/A", why + ["the unwatched run never went bad"]
    res["why"] = why
    if not keep_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return res


def _short(f):
    op = (f.get("op") or "").replace("aten::", "")
    mod = f.get("module")
    mod = "(root)" if mod == "" else (mod if mod is not None else "-")
    return f"{f['rule']}@{mod}{':' + op if op else ''}@{f.get('step')}"
