"""Entry modules (ampdoctor/record/entries.py) under a hostile loop: their lifecycle, copies, and odd captures.

When the loop never calls the watched model's own forward, the modules it calls at top level on sampled step 0 become
entries from step 2 on. Every case below trains a tiny model on CPU (fp16 autocast + torch.amp.GradScaler("cpu"),
AdamW, clip) with and without the watch and checks, as the case applies: losses, gradients (still scaled, each step)
and final weights bitwise identical to the unwatched twin; after `w.close()` every module's hook dictionaries
(forward, forward-pre, their kwargs/always-called sets, backward) exactly as before the watch; no warning/error
finding and no RuntimeWarning from ampdoctor on a healthy run; the entries adopted (by their names in the model);
and, where a step is made bad, one capture whose `extra.entry` names the module the batch went into, and whose
in-process replay names the producer with the model's own module names.

Cases:
 1. moduledict_modulelist: `model.body[0](x)`, `model.body[1](h)`, `model.heads["a"](h)`, `model.heads["b"](h)`;
    healthy (bitwise, quiet, hooks, entries "body.0" "body.1" "heads.a" "heads.b"); deepcopy/torch.save/state_dict
    mid-run; a bad batch at step 7 -> capture entry "body.0", replay blames "body.0".
 2. kwargs_only: the entry called as `model.net(x=x)` (keyword-only forward); healthy; bad step -> entry "net",
    replay blames "net.fc1".
 3. output_dict / output_tuple / output_dataclass: the entry returns a dict / a tuple / a dataclass; healthy; bad
    step -> entry "net", replay (with a loss_fn) blames "net.fc1".
 4. nested_and_top: `model.shared(x)` at top level and again inside `model.outer(h, model.shared)` in the same
    step; healthy (bitwise, quiet, hooks, entries "shared" "outer" "head"); bad step -> entry "shared", replay
    blames "shared".
 5. nograd_eval: a mid-run `torch.no_grad()` eval through the entry (other batch size), then training again;
    healthy; a bad step after the eval -> capture entry "net" holding the training batch (8 rows), not the eval's.
 6. switch_root: children for steps 0-9, the root for 10-19, children for 20-29; healthy; a bad step at 14 (root)
    -> capture with no entry; a bad step at 24 (children again) -> capture entry "net".
 7. root_at_step0_only (healthy / bad): the root's forward at step 0, children afterwards; healthy; a bad step at 7
    -> a capture (contract: "when a step first produces inf/NaN ... writes a capture of that batch") naming "net".
 8. grad_accum: 2 micro-batches per step through the entry; healthy; the second micro-batch of step 7 bad ->
    capture entry "net" holding that bad micro-batch.
 9. checkpoint: torch.utils.checkpoint(use_reentrant=False) inside the entry; healthy; bad step -> entry "net",
    replay blames "net.block.0".
10. tied: embedding and head (tied weight) as separate top-level calls; healthy; deepcopy/torch.save/state_dict
    mid-run (the tie kept in the copies).
11. report_midrun: `w.report()` at step 15, training continues: bitwise, quiet, hooks.
12. rewatch: watch, close at step 10, watch the same model again; bitwise; hooks back as before; the second watch
    adopts the entries again and captures a bad step 20 with entry "net".
13. deepcopy_midrun: `copy.deepcopy(model)` at step 10 while watched; the copy trains 6 steps (its own optimizer
    and scaler) bitwise like an unwatched copy, every module it ran sheds the watch's hooks, and the original watch
    records only its 30 steps and stays quiet.
13b. deepcopy_midrun after close: no hook of ampdoctor's left on any module of that copy; torch.save(copy) holds
    no ampdoctor class.
14. weight_spike[row] / [element]: net.0's weight row 3 x 1e6 / one weight set to 1e6 at step 7 (restored at
    step 8): capture entry "net", replay with model=... blames "net.0" with overflow/nan_origin.
15. wrong_entry[loss_fn] / [net.2]: a capture whose entry is edited to a module the model has but that is not the
    one the batch went into (the loss module; a Linear of the wrong width): in-process replay raises BadInput or
    returns a report blaming nothing (error), the CLI answers one line + exit 2 or such a report, no traceback.
16. cli_modulelist: `ampdoctor replay` of the "body.0" capture with --model: exit 1, overflow at "body.0".
17. two_optimizers: two optimizers step the model (one scaler): entries, one step per iteration; without a
    scaler no entries; bitwise, quiet, hooks.

Result when written: 19/23 right (22/23 now: all but the deepcopy case fixed since); wrong:
 - root_at_step0_only bad step: no capture written at all (step 0 called the root, so no top-level module was
   noted; "net" became an entry only after the bad step's follow-up sampling); the report's first line is
   `[error] nan_origin at (run) step 7: ... replay its capture (`ampdoctor replay`) ...` though no capture exists.
 - deepcopy_midrun after close: the copy's root keeps two ampdoctor.record.hooks.InertHook (forward and
   forward-pre) for good: the loop never calls the root, so they never run to remove themselves; torch.save(copy)
   pickles the ampdoctor class.
 - weight_spike[element]: the replay's only finding is `[error] mask_value_overflow at net.0 aten::_to_copy step
   7` (a fill/mask constant) for a spiked weight; no overflow finding (the same through the root: not entry-specific).
 - wrong_entry[net.2]: the replay runs net.2 on the batch that went into net; the input cast makes inf, then addmm
   raises a shape error that the replay takes for the step's own failure: in-process and CLI (exit 1) report
   `[error] overflow at net.2 aten::_to_copy step 7`, with no replay_error and no refusal.
"""
from __future__ import annotations

import copy
import io
import json
import sys
import warnings

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.errors import BadInput
from probe_harness import edit_manifest, load_models, one_line_or_report, run_cli

BAD = 7
STEPS = 30
SRC = '''
import dataclasses

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Lit(nn.Module):
    """The network, its loss as a module, and a forward the loop mostly does not call."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x):
        return self.net(x)


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32)])
        self.heads = nn.ModuleDict({"a": nn.Linear(32, 4), "b": nn.Linear(32, 4)})

    def forward(self, x):
        h = self.body[1](self.body[0](x).relu()).relu()
        return self.heads["a"](h) + self.heads["b"](h)


class KwNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, *, x, scale=1.0):
        return self.fc2(self.fc1(x).relu()) * scale


class KwModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = KwNet()

    def forward(self, x):
        return self.net(x=x)


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    hidden: torch.Tensor


class OutNet(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc1(x).relu()
        o = self.fc2(h)
        if self.kind == "dict":
            return {"logits": o, "hidden": h}
        if self.kind == "tuple":
            return o, h
        return Result(o, h)


class OutModel(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.net = OutNet(kind)

    def forward(self, x):
        return self.net(x)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, shared):
        return shared(self.fc(x).relu())


class Nest(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.outer = Outer()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.outer(self.shared(x), self.shared))


class Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(checkpoint(self.block, x, use_reentrant=False))


class CkptModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Ckpt()

    def forward(self, x):
        return self.net(x)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        return self.head(self.mid(self.emb(tok)))


def lit():
    torch.manual_seed(0)
    return Lit()


def heads():
    torch.manual_seed(0)
    return Heads()


def kwmodel():
    torch.manual_seed(0)
    return KwModel()


def out_dict():
    torch.manual_seed(0)
    return OutModel("dict")


def out_tuple():
    torch.manual_seed(0)
    return OutModel("tuple")


def out_dataclass():
    torch.manual_seed(0)
    return OutModel("dataclass")


def nest():
    torch.manual_seed(0)
    return Nest()


def ckpt():
    torch.manual_seed(0)
    return CkptModel()


def tied():
    torch.manual_seed(0)
    return Tied()
'''


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("entry_lc_models")
    mod = load_models(d, "entry_lc_models", SRC)
    sys.modules["entry_lc_models"] = mod  # (torch.save of the whole model pickles its classes by module name)
    yield {"dir": str(d), "mod": mod}
    sys.modules.pop("entry_lc_models", None)


CE = nn.functional.cross_entropy


# -- the loops' forward+loss, one per model kind (model, x, y, i) -> loss ---------------------------------------
def f_lit(m, x, y, i):
    return m.loss_fn(m.net(x).float(), y)


def f_root(m, x, y, i):
    return CE(m(x).float(), y)


def f_heads(m, x, y, i):
    h = m.body[0](x).relu()
    h = m.body[1](h).relu()
    return CE(m.heads["a"](h).float(), y) + CE(m.heads["b"](h).float(), y)


def f_kw(m, x, y, i):
    return CE(m.net(x=x).float(), y)


def _logits(out):
    if isinstance(out, dict):
        return out["logits"]
    if isinstance(out, tuple):
        return out[0]
    return out.logits


def f_out(m, x, y, i):
    out = m.net(x)
    return CE(_logits(out).float(), y) + 1e-3 * out_hidden(out).float().pow(2).mean()


def out_hidden(out):
    if isinstance(out, dict):
        return out["hidden"]
    if isinstance(out, tuple):
        return out[1]
    return out.hidden


def f_nest(m, x, y, i):
    h = m.shared(x)
    h = m.outer(h, m.shared)
    return CE(m.head(h).float(), y)


def f_switch(m, x, y, i):
    return CE(m(x).float(), y) if 10 <= i < 20 else m.loss_fn(m.net(x).float(), y)


def f_root0(m, x, y, i):
    return CE(m(x).float(), y) if i == 0 else m.loss_fn(m.net(x).float(), y)


def f_ckpt(m, x, y, i):
    return CE(m.net(x).float(), y)


def f_tied(m, x, y, i):
    tok = (x.abs() * 10).long().clamp(max=49)
    logits = m.head(m.mid(m.emb(tok)))
    return CE(logits.float().reshape(-1, 50), tok.reshape(-1))


# -- the harness ---------------------------------------------------------------------------------------------
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def hooks_of(model):
    """Every module's hook dictionaries, by qualified name (tied modules under each name)."""
    return {n: tuple(tuple(getattr(m, d, {}).items()) for d in _HOOK_DICTS)
            for n, m in model.named_modules(remove_duplicate=False)}


def _hex(xs):
    return [float(v).hex() for v in xs]


def train(model, fwd, steps=STEPS, *, watch=False, run_dir=None, bad=None, accum=1, on_step=None, every=None):
    """The loop: fp16 autocast + GradScaler; `bad`: that step's (last micro-)batch x 60000 (past fp16's range at
    the first Linear's input cast). `on_step(i, ctx)` runs at the start of each step (ctx: model, opt, sc, w)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    before = hooks_of(model)
    ctx = {"model": model, "opt": opt, "sc": sc, "w": None}
    if watch:
        kw = {} if every is None else {"every": every}
        ctx["w"] = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir, **kw)
    g = torch.Generator().manual_seed(0)
    losses, grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            if on_step is not None:
                on_step(i, ctx)
            opt.zero_grad()
            for k in range(accum):
                x = torch.randn(8, 16, generator=g)
                y = torch.randint(0, 4, (8,), generator=g)
                if i == bad and k == accum - 1:
                    x = x * 60000
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = fwd(model, x, y, i) / accum
                sc.scale(loss).backward()
                losses.append(loss.item())
            grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
            sc.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            sc.step(opt)
            sc.update()
        rep = None
        w = ctx["w"]
        if w is not None:
            w.close()
            rep = w.report()
    amp_warn = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning) and (
        "ampdoctor" in str(c.message) or "ampdoctor" in str(c.filename))]
    return {"rep": rep, "w": w, "ctx": ctx, "losses": losses, "grads": grads, "before": before,
            "after": hooks_of(model), "amp_warn": amp_warn, "all_warn": [str(c.message) for c in caught],
            "weights": [p.detach().clone() for p in model.parameters()]}


def same_training(a, b):
    assert _hex(a["losses"]) == _hex(b["losses"]), (a["losses"], b["losses"])
    assert len(a["grads"]) == len(b["grads"])
    for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        assert all((x is None and y is None) or (x is not None and y is not None and bits(x, y))
                   for x, y in zip(ga, gb)), f"gradients differ at step {i}"
    assert all(bits(x, y) for x, y in zip(a["weights"], b["weights"])), "weights differ"


def bits(x, y):
    """Bitwise equal (NaN payloads included: a bad step's gradients are compared too)."""
    return x.dtype == y.dtype == torch.float32 and x.shape == y.shape and torch.equal(
        x.view(torch.int32), y.view(torch.int32))


def clean(r):
    """Hooks back as before the watch; no RuntimeWarning of ampdoctor's."""
    assert r["after"] == r["before"], [n for n in r["after"] if r["after"][n] != r["before"].get(n)]
    assert not r["amp_warn"], r["amp_warn"]
    assert not any("disabled itself" in m for m in r["all_warn"]), r["all_warn"]


def quiet(rep):
    bad = [f.one_line() for f in rep.findings if f.severity in ("warning", "error")]
    assert bad == [], bad


def healthy(factory, fwd, tmp_path, entries=None, **kw):
    plain = train(factory(), fwd, **kw)
    watched = train(factory(), fwd, watch=True, run_dir=tmp_path / "healthy", **kw)
    same_training(plain, watched)
    clean(watched)
    quiet(watched["rep"])
    assert not list((tmp_path / "healthy").glob("captures/*/manifest.json"))
    if entries is not None:
        assert set(watched["w"].machine.entries.values()) == set(entries), watched["w"].machine.entries
    return plain, watched


def captures(rd):
    return sorted(rd.glob("captures/*/manifest.json"))


def one_capture(rd):
    caps = captures(rd)
    assert len(caps) == 1, caps
    return caps[0].parent, json.loads(caps[0].read_text()).get("extra") or {}


def blames(rep, module):
    top = [(f.rule, f.module, f.severity) for f in rep.findings[:3]]
    assert any(r in ("overflow", "nan_origin") and m == module and s == "error" for r, m, s in top), top


def failing(factory, fwd, tmp_path, entry, producer, loss_fn=None, **kw):
    r = train(factory(), fwd, watch=True, run_dir=tmp_path / "bad", bad=kw.pop("bad", BAD), **kw)
    assert not any("disabled itself" in m for m in r["all_warn"]), r["all_warn"]
    assert r["after"] == r["before"]
    cap, extra = one_capture(tmp_path / "bad")
    assert extra.get("entry") == entry, extra
    if producer is not None:
        rep = ampdoctor.replay(cap, model=factory(), loss_fn=loss_fn)
        blames(rep, producer)
    return r, cap


def serialise_midrun(model, ref_keys):
    """deepcopy, torch.save/load of the whole model and state_dict while watched, after the entries were adopted."""
    assert list(model.state_dict().keys()) == ref_keys
    c = copy.deepcopy(model)
    assert list(c.state_dict().keys()) == ref_keys
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert list(loaded.state_dict().keys()) == ref_keys
    for a, b in ((model, c), (model, loaded)):
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in ref_keys)
    return c, loaded


# -- 1. ModuleDict / ModuleList members -------------------------------------------------------------------------
def test_moduledict_modulelist_entries(tmp_path, helpers):
    mod = helpers["mod"]
    ref_keys = list(mod.heads().state_dict().keys())
    seen = {}

    def midrun(i, ctx):
        if i == 5:
            assert set(ctx["w"].machine.entries.values()) == {"body.0", "body.1", "heads.a", "heads.b"}
            c, loaded = serialise_midrun(ctx["model"], ref_keys)
            x = torch.randn(3, 16)
            with torch.no_grad():
                seen["copies"] = (torch.equal(c(x), ctx["model"](x)), torch.equal(loaded(x), ctx["model"](x)))
    plain = train(mod.heads(), f_heads)
    watched = train(mod.heads(), f_heads, watch=True, run_dir=tmp_path / "healthy", on_step=midrun)
    same_training(plain, watched)
    clean(watched)
    quiet(watched["rep"])
    assert seen["copies"] == (True, True)
    failing(mod.heads, f_heads, tmp_path, "body.0", "body.0")


# -- 2. keyword-only call ----------------------------------------------------------------------------------------
def test_entry_called_with_kwargs_only(tmp_path, helpers):
    mod = helpers["mod"]
    healthy(mod.kwmodel, f_kw, tmp_path, entries={"net"})
    _, cap = failing(mod.kwmodel, f_kw, tmp_path, "net", "net.fc1")


# -- 3. dict / tuple / dataclass outputs -------------------------------------------------------------------------
def _out_loss(out, *args, **kwargs):
    return _logits(out).float().pow(2).mean()


@pytest.mark.parametrize("kind", ["dict", "tuple", "dataclass"])
def test_entry_returning_a_structure(tmp_path, helpers, kind):
    factory = getattr(helpers["mod"], f"out_{kind}")
    healthy(factory, f_out, tmp_path, entries={"net"})
    failing(factory, f_out, tmp_path, "net", "net.fc1", loss_fn=_out_loss)


# -- 4. the same child nested in another entry and at top level --------------------------------------------------
def test_child_nested_and_at_top_level_in_one_step(tmp_path, helpers):
    _, watched = healthy(helpers["mod"].nest, f_nest, tmp_path)
    assert set(watched["w"].machine.entries.values()) == {"shared", "outer", "head"}, watched["w"].machine.entries
    failing(helpers["mod"].nest, f_nest, tmp_path, "shared", "shared")


# -- 5. a no_grad eval through the entry mid-run -----------------------------------------------------------------
def _eval(i, ctx, at=12):
    if i == at:
        m = ctx["model"]
        m.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            for _ in range(3):
                m.net(torch.randn(5, 16))
        m.train()


def test_nograd_eval_through_the_entry_midrun(tmp_path, helpers):
    mod = helpers["mod"]
    torch.manual_seed(1)
    plain = train(mod.lit(), f_lit, on_step=_eval)
    torch.manual_seed(1)
    watched = train(mod.lit(), f_lit, watch=True, run_dir=tmp_path / "healthy", on_step=_eval)
    same_training(plain, watched)
    clean(watched)
    quiet(watched["rep"])
    assert not captures(tmp_path / "healthy")
    _, cap = failing(mod.lit, f_lit, tmp_path, "net", None, bad=15, on_step=_eval)
    from ampdoctor.capture import load_capture
    c = load_capture(cap)
    assert c.args[0].shape == (8, 16) and c.args[0].abs().max() > 1000, c.args[0].shape  # the bad training batch


# -- 6. children -> root -> children ------------------------------------------------------------------------------
def test_loop_switches_between_children_and_root(tmp_path, helpers):
    mod = helpers["mod"]
    healthy(mod.lit, f_switch, tmp_path, entries={"net"})
    failing(mod.lit, f_switch, tmp_path / "root", None, "net.0", bad=14)
    failing(mod.lit, f_switch, tmp_path / "child", "net", "net.0", bad=24)


# -- 7. the root at step 0 only ----------------------------------------------------------------------------------
def test_root_at_step0_only_is_healthy(tmp_path, helpers):
    healthy(helpers["mod"].lit, f_root0, tmp_path)


# (a strict xfail when written: no capture at all, since step 0 called the root and no top-level modules were noted;
# fixed since: a routine step that trains without the root's forward asks for one sampled step, record/step.py)
def test_root_at_step0_only_bad_step_is_captured(tmp_path, helpers):
    failing(helpers["mod"].lit, f_root0, tmp_path, "net", "net.0")


# -- 8. gradient accumulation -------------------------------------------------------------------------------------
def test_grad_accumulation_through_the_entry(tmp_path, helpers):
    mod = helpers["mod"]
    healthy(mod.lit, f_lit, tmp_path, entries={"net"}, accum=2)
    _, cap = failing(mod.lit, f_lit, tmp_path, "net", "net.0", accum=2)
    from ampdoctor.capture import load_capture
    assert load_capture(cap).args[0].abs().max() > 1000  # the bad micro-batch, not its healthy sibling


# -- 9. activation checkpointing inside the entry ----------------------------------------------------------------
def test_checkpoint_inside_the_entry(tmp_path, helpers):
    mod = helpers["mod"]
    healthy(mod.ckpt, f_ckpt, tmp_path, entries={"net"})
    failing(mod.ckpt, f_ckpt, tmp_path, "net", "net.block.0")


# -- 10. tied weights between two entries -------------------------------------------------------------------------
def test_tied_weights_between_entries(tmp_path, helpers):
    mod = helpers["mod"]
    ref_keys = list(mod.tied().state_dict().keys())
    seen = {}

    def midrun(i, ctx):
        if i == 5:
            c, loaded = serialise_midrun(ctx["model"], ref_keys)
            seen["tied"] = (c.head.weight is c.emb.weight, loaded.head.weight is loaded.emb.weight)
    plain = train(mod.tied(), f_tied)
    watched = train(mod.tied(), f_tied, watch=True, run_dir=tmp_path / "healthy", on_step=midrun)
    same_training(plain, watched)
    clean(watched)
    quiet(watched["rep"])
    assert seen["tied"] == (True, True)
    assert {"emb", "head"} <= set(watched["w"].machine.entries.values()), watched["w"].machine.entries


# -- 11. a report mid-run ----------------------------------------------------------------------------------------
def test_report_midrun_then_continue(tmp_path, helpers):
    mod = helpers["mod"]
    seen = {}

    def midrun(i, ctx):
        if i == 15:
            seen["rep"] = ctx["w"].report()
    plain = train(mod.lit(), f_lit)
    watched = train(mod.lit(), f_lit, watch=True, run_dir=tmp_path / "healthy", on_step=midrun)
    same_training(plain, watched)
    clean(watched)
    quiet(watched["rep"])
    quiet(seen["rep"])


# -- 12. watch, close, watch again -------------------------------------------------------------------------------
def test_watch_close_watch_again(tmp_path, helpers):
    mod = helpers["mod"]
    ws = []

    def rewatch(i, ctx):
        if i == 10:
            ctx["w"].close()
            assert hooks_of(ctx["model"]) == before, "hooks left after the first close"
            ws.append(ctx["w"])
            ctx["w"] = ampdoctor.watch(ctx["model"], optimizer=ctx["opt"], scaler=ctx["sc"], run_dir=tmp_path / "b")
    before = hooks_of(mod.lit())  # (empty for a fresh model)
    plain = train(mod.lit(), f_lit, bad=20)
    watched = train(mod.lit(), f_lit, watch=True, run_dir=tmp_path / "a", bad=20, on_step=rewatch)
    same_training(plain, watched)
    clean(watched)
    assert set(ws[0].machine.entries.values()) == {"net"}
    assert set(watched["w"].machine.entries.values()) == {"net"}
    quiet(ws[0].report())
    assert not captures(tmp_path / "a")
    cap, extra = one_capture(tmp_path / "b")
    assert extra.get("entry") == "net", extra


# -- 13. deepcopy mid-run ----------------------------------------------------------------------------------------
def _copy_and_train(i, ctx, out):
    if i != 10:
        return
    c = copy.deepcopy(ctx["model"])
    opt = torch.optim.AdamW(c.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(6):
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = c.loss_fn(c.net(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    out["losses"] = losses
    out["copy"] = c
    out["hooks"] = hooks_of(c)
    out["weights"] = [p.detach().clone() for p in c.parameters()]


def test_deepcopy_midrun_trains_without_the_watch(tmp_path, helpers):
    mod = helpers["mod"]
    po, wo = {}, {}
    plain = train(mod.lit(), f_lit, on_step=lambda i, ctx: _copy_and_train(i, ctx, po))
    watched = train(mod.lit(), f_lit, watch=True, run_dir=tmp_path / "healthy",
                    on_step=lambda i, ctx: _copy_and_train(i, ctx, wo))
    same_training(plain, watched)
    clean(watched)
    quiet(watched["rep"])
    assert _hex(po["losses"]) == _hex(wo["losses"])
    assert all(torch.equal(a, b) for a, b in zip(po["weights"], wo["weights"]))
    steps = [r.step for r in watched["w"].machine.records]
    assert steps == list(range(STEPS)), steps
    # every module the copy ran shed the watch's (inert) hooks; the root it never ran is checked below
    assert all(all(len(d) == 0 for d in v) for n, v in wo["hooks"].items() if n), wo["hooks"]


@pytest.mark.xfail(strict=True, reason="a deepcopy taken mid-run keeps ampdoctor's InertHook (forward and "
                   "forward-pre) on its root for good after w.close(): the loop never calls the root, so the "
                   "hook never runs to remove itself; torch.save(copy) then pickles ampdoctor.record.hooks.InertHook")
def test_deepcopy_midrun_carries_no_hook_after_close(tmp_path, helpers):
    wo = {}
    train(helpers["mod"].lit(), f_lit, watch=True, run_dir=tmp_path / "healthy",
          on_step=lambda i, ctx: _copy_and_train(i, ctx, wo))
    left = {n: [type(h).__module__ + "." + type(h).__name__ for d in _HOOK_DICTS
                for h in getattr(m, d, {}).values() if not isinstance(h, bool)]
            for n, m in wo["copy"].named_modules(remove_duplicate=False)}
    assert all(not v for v in left.values()), {n: v for n, v in left.items() if v}
    buf = io.BytesIO()
    torch.save(wo["copy"], buf)
    assert b"ampdoctor" not in buf.getvalue()


# -- 14. a weight spike inside the entry --------------------------------------------------------------------------
@pytest.mark.parametrize("how", [
    "row",
    # (a strict xfail when written: the replay's only finding was `mask_value_overflow at net.0 aten::_to_copy`, a
    # fill/mask constant, for one weight spiked to exactly 1e6; fixed since: a trainable weight is no mask constant,
    # replay/explain.py)
    "element"])
def test_weight_spike_inside_the_entry(tmp_path, helpers, how):
    mod = helpers["mod"]
    saved = {}

    def spike(i, ctx):
        wt = ctx["model"].net[0].weight
        if i == BAD:
            saved["w"] = wt.detach().clone()
            with torch.no_grad():
                if how == "row":
                    wt[3] *= 1e6
                else:
                    wt[3, 5] = 1e6
        elif i == BAD + 1:
            with torch.no_grad():
                wt.copy_(saved["w"])
    r = train(mod.lit(), f_lit, watch=True, run_dir=tmp_path / "run", on_step=spike)
    assert not any("disabled itself" in m for m in r["all_warn"]), r["all_warn"]
    assert r["after"] == r["before"]
    cap, extra = one_capture(tmp_path / "run")
    assert extra.get("entry") == "net", extra
    rep = ampdoctor.replay(cap, model=mod.lit())
    blames(rep, "net.0")


# -- 15. a capture naming a module that is not the one the batch went into ----------------------------------------
@pytest.fixture(scope="module")
def lit_capture(tmp_path_factory, helpers):
    d = tmp_path_factory.mktemp("lit_cap")
    train(helpers["mod"].lit(), f_lit, steps=12, watch=True, run_dir=d / "run", bad=BAD)
    cap, extra = one_capture(d / "run")
    assert extra.get("entry") == "net", extra
    return cap


@pytest.mark.parametrize("entry", [
    "loss_fn",
    # (a strict xfail when written: the replay took addmm's `mat1 and mat2 shapes cannot be multiplied` after the
    # input cast's inf for the step's own failure and reported `[error] overflow at net.2`; fixed since: a shape
    # error is a model that does not fit the capture, replay/__init__.py)
    "net.2"])
def test_capture_naming_another_existing_module(tmp_path, helpers, lit_capture, entry):
    import shutil
    cap = tmp_path / "cap"
    shutil.copytree(lit_capture, cap)
    extra = json.loads((cap / "manifest.json").read_text())["extra"]
    edit_manifest(cap, extra=dict(extra, entry=entry))
    try:
        rep = ampdoctor.replay(cap, model=helpers["mod"].lit())
    except BadInput as e:
        assert "\n" not in str(e) and str(e), str(e)
    else:  # a report: the batch does not fit that module, so it may say so (replay_error) but blame nothing
        assert not any(f.severity == "error" for f in rep.findings), [f.one_line() for f in rep.findings]
    p = run_cli(helpers, "replay", cap, "--model", "entry_lc_models:lit", "--json", tmp_path / "r.json", "--no-html")
    if one_line_or_report(p, outputs=[tmp_path / "r.json"]) == "report":
        found = json.loads((tmp_path / "r.json").read_text())["findings"]
        assert p.returncode == 0 and not any(f["severity"] == "error" for f in found), \
            (p.returncode, [(f["rule"], f["module"]) for f in found])


# -- 16. the CLI replays a ModuleList entry's capture from disk ----------------------------------------------------
def test_cli_replays_a_modulelist_entry_capture(tmp_path, helpers):
    _, cap = failing(helpers["mod"].heads, f_heads, tmp_path, "body.0", None)
    p = run_cli(helpers, "replay", cap, "--model", "entry_lc_models:heads", "--json", tmp_path / "r.json",
                "--no-html")
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    found = json.loads((tmp_path / "r.json").read_text())["findings"]
    assert any(f["rule"] in ("overflow", "nan_origin") and f["module"] == "body.0" and f["severity"] == "error"
               for f in found[:3]), [(f["rule"], f["module"]) for f in found[:3]]


# -- 17. two optimizers stepping the model: entries with one scaler --------------------------------------------------
def _two_opts(model, watch, run_dir=None, scaler=True):
    opt_a = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("heads.b")], lr=1e-3)
    opt_b = torch.optim.AdamW(model.heads["b"].parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", enabled=scaler)
    before = hooks_of(model)
    w = ampdoctor.watch(model, optimizer=opt_a, scaler=sc, run_dir=run_dir) if watch else None
    g = torch.Generator().manual_seed(0)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(20):
            x = torch.randn(8, 16, generator=g)
            y = torch.randint(0, 4, (8,), generator=g)
            opt_a.zero_grad()
            opt_b.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = f_heads(model, x, y, i)
            if scaler:
                sc.scale(loss).backward()
                sc.step(opt_a)
                sc.step(opt_b)
                sc.update()
            else:  # (bf16 would need no scaler; the loop steps the optimizers itself)
                loss.backward()
                opt_a.step()
                opt_b.step()
            losses.append(loss.item())
        if w is not None:
            w.close()
    return {"w": w, "losses": losses, "before": before, "after": hooks_of(model), "all_warn":
            [str(c.message) for c in caught], "amp_warn": [str(c.message) for c in caught if "ampdoctor" in
                                                         str(c.message) or "ampdoctor" in str(c.filename)],
            "weights": [p.detach().clone() for p in model.parameters()]}


def test_two_optimizers_on_one_scaler_make_entries(tmp_path, helpers):
    """Both optimizers step through the one scaler in every step (one step per iteration, as
    StepMachine.iteration_goes_on keeps a GAN's): the modules the loop calls become entries (no entries when this
    was written: two optimizers were thought to split an iteration's batches across records)."""
    plain = _two_opts(helpers["mod"].heads(), False)
    watched = _two_opts(helpers["mod"].heads(), True, tmp_path / "run")
    assert _hex(plain["losses"]) == _hex(watched["losses"])
    assert all(bits(a, b) for a, b in zip(plain["weights"], watched["weights"]))
    clean(watched)
    assert sorted(watched["w"].machine.entries.values()) == ["body.0", "body.1", "heads.a", "heads.b"], \
        watched["w"].machine.entries
    assert len(watched["w"].steps) == 20
    quiet(watched["w"].report())


def test_two_optimizers_without_a_scaler_make_no_entries(tmp_path, helpers):
    """Without a scaler nothing says that the two optimizer steps are one iteration's: no entries."""
    plain = _two_opts(helpers["mod"].heads(), False, scaler=False)
    watched = _two_opts(helpers["mod"].heads(), True, tmp_path / "run", scaler=False)
    assert _hex(plain["losses"]) == _hex(watched["losses"])
    assert all(bits(a, b) for a, b in zip(plain["weights"], watched["weights"]))
    clean(watched)
    assert watched["w"].machine.entries == {}, watched["w"].machine.entries
    quiet(watched["w"].report())

