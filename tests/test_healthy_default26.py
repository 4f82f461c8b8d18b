"""Healthy runs at ampdoctor's DEFAULT watch, twenty-sixth set: fp16 training loops that are correct but unusual.
`ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")` and nothing else; CPU fp16 autocast,
a real `torch.amp.GradScaler("cpu")` (defaults unless a case says otherwise), tiny models, fixed seeds, one intra-op
thread, 40-80 iterations each. Every case runs twice from the same seeds:

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite and the mean of
  the last fifth below 0.8x the first fifth's (0.9x for 17); probe_harness.Producer's forward hooks (no module made
  inf/NaN from finite inputs); the gradients the step left finite on every iteration the scaler did not skip;
  every weight finite at the end; the scaler's skips only its ordinary search (`harmless_skips`: a first streak
  from step 0 of at most 4 (8 for case 2), then at most 2 isolated skips (pairs allowed in 1 and 8; up to a fifth
  of the run in 1), each proven an overflow of the SCALED gradients only: the iteration re-run alone from the
  weights it started with, on a fresh build, skips again at its own scale and not at half of it (a first-streak
  step: at some scale down to 1/256 of it), its loss finite); plus the facts that make the case what it is;
- the WATCHED run must train bitwise identically (`identical`): every loss, loss scale and skip, every iteration's
  gradients (after scaler.step), the case's extras (eval losses, lrs, activation peaks, call counts), every final
  weight and buffer, the optimizer's whole state_dict and the final scale; then (`judge`) w.report() after close()
  and ampdoctor.diagnose(run_dir) must hold no warning and no error (info is fine), exit code 0, no internal error,
  one step per iteration, and no `ampdoctor: ...` Python warning may come during the run. A false alarm would be
  a strict xfail (probe_harness.wrong: WrongAnswer only) whose reason quotes ampdoctor; a failing oracle or a
  difference in training is a plain failure.

The cases (the documented loop: zero_grad -> fp16 autocast forward -> scale(loss).backward() -> unscale_ ->
clip_grad_norm_(1.0) -> scaler.step -> update, AdamW, unless said otherwise):
 1. growth_interval_5: 4-class MLP, GradScaler(growth_interval=5): the scale climbs 2**16 -> 2**20 and probes,
    9 of 80 iterations skipped (13, 29, 33, 41, ...; oracle: > 10% skipped, each harmless, the scale never below
    half its start and higher at the end);
 2. init_scale_2p24: GradScaler(init_scale=2**24): six halvings in a row (steps 0-5, down to 2**18), one later skip;
 3. fp32_warmup_then_fp16: 15 iterations with autocast enabled=False (the scaler already scaling), then fp16;
 4. clip_grad_value: unscale_ -> clip_grad_value_(0.05) -> step -> update;
 5. no_clip_no_unscale: scale(loss).backward() -> scaler.step -> update, no unscale_, no clipping;
 6. uneven_accumulation: 1, 3, 2, 4 micro-batches per optimizer step in turn (loss / k), zero_grad(set_to_none=False);
 7. unfreeze_add_param_group: the first two Linears frozen and outside the optimizer for 25 iterations, then
    requires_grad_(True) and opt.add_param_group with their own lr;
 8. unrolled_cell_shared: a GRUCell and its input projection each called 8 times per forward (weight sharing);
 9. tied_embeddings_label_smoothing: a tiny LM whose head weight IS the embedding, label_smoothing=0.1;
10. optimizer_{adagrad,rmsprop,nadam,adafactor}: fp32 master weights under four other optimizers (4 runs);
11. warmup_from_zero_cosine_restarts: LambdaLR warmup from exactly lr 0 over 10 steps, then
    CosineAnnealingWarmRestarts(T_0=15) (oracle: lr 0 at step 0, the peak 3e-3, a restart seen);
12. large_activations_1e4: raw features x 4000 into Linear -> LayerNorm: the first Linear's fp16 output peaks at
    7.6e3-1.1e4 every step (2.5 bits below fp16's max), not creeping up (oracle: all in (4e3, 3e4), the last ten
    within 1.25x of the first ten);
13. tiny_gradients_scaled: a loss weighted 1e-4: the unscaled parameter gradients' median below fp16's smallest
    normal (2**-14) on > 80% of the steps; the GradScaler's 2**16 keeps the fp16 backward in range (no skip at all);
14. eval_every_10_no_grad: BatchNorm1d + Dropout classifier; every 10th iteration model.eval(), torch.no_grad(), fp16
    autocast forward on a held-out batch, model.train() (the eval losses compared bitwise too);
15. batchnorm_eval_mode: a conv net with BatchNorm2d holding "pretrained" running stats, kept in eval mode while the
    rest trains (oracle: the running stats never move);
16. checkpoint_non_reentrant: 3 residual blocks with dropout through torch.utils.checkpoint(use_reentrant=False)
    (oracle: a forward pre-hook sees each block run twice per iteration: forward and recompute);
17. small_integer_inputs: fp16 event counts 0..20 into a Poisson regressor (poisson_nll_loss);
18. siamese_shared_encoder: one encoder called on both views of a pair, BCE-with-logits;
19. same_module_fp16_and_fp32: the model called twice an iteration, under fp16 autocast (CE) and in fp32 outside it
    (a 0.1-weighted consistency term), one scaled backward of the sum;
20. fused_adamw_no_unscale: AdamW(fused=True), no unscale_/clip: GradScaler.step hands its scale and found_inf to
    the fused kernel, the .grad tensors stay scaled (the documented fused path).

What ampdoctor says: all 23 runs quiet -- only `info` findings (`skipped_steps` "GradScaler skipped N of M steps;
a normal rate for dynamic loss scaling", `overflow` "... while the loss scale was high; GradScaler skipped them and
lowered the scale, as designed"), or none; every watched run bitwise identical to its twin. No xfail in this set.
Two things seen while writing it, neither a fault of ampdoctor: a non-reentrant checkpoint's recompute stops early
(torch's early stopping), so a forward POST-hook on a checkpointed block fires once per iteration in a plain run but
twice under Producer's hooks (a pre-hook counts 2 either way: case 16 uses one); and close() may replay a capture
through the model, so a user forward hook fires after the loop (case 12 records peaks only inside the loop).
The file takes ~8 s.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import Producer, WrongAnswer, finite, quiet_report, wrong  # noqa: E402
from scenarios import alarms, gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")]   # after a skipped step
F16 = torch.float16
FP16_MIN_NORMAL = 2.0 ** -14
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")


# ------------------------------------------------------------------------------------------------------ the loop
def run(case, rd=None):
    """One run of `case` (its `make()` builds the model, optimizer, scaler and loop body afresh from fixed seeds).
    rd given: under `ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=rd)` and nothing else; rd None: the
    unwatched twin, with the oracle's hooks (probe_harness.Producer: the first module making inf/NaN from finite
    inputs). Per iteration: the loss, the scale it ran at, whether the scaler skipped (scale fell), the gradients
    the step left (after scaler.step: unscaled) and the case's own extras; at the end the weights, buffers and the
    optimizer's state."""
    c = case.make()
    m, opt, sc = c.m, c.opt, c.sc
    prod = Producer(m) if rd is None else None
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=rd) if rd is not None else None
    r = SimpleNamespace(losses=[], scales=[], skipped=[], grads=[], w=w, rd=rd, c=c, first=None, snaps={}, case=case)
    seen = warnings.catch_warnings(record=True)
    r.warns = seen.__enter__()
    warnings.simplefilter("always")
    try:
        for i in range(case.steps):
            if prod is not None:
                prod.new_step(i)
            if rd is None:
                r.snaps[i] = {k: v.detach().clone() for k, v in m.state_dict().items()}
            s = sc.get_scale()
            r.losses.append(c.body(i))
            r.scales.append(s)
            if sc.get_scale() < s:
                r.skipped.append(i)
            r.grads.append([None if p.grad is None else p.grad.detach().clone() for p in m.parameters()])
    finally:
        if w is not None:
            w.close()
        if prod is not None:
            prod.remove()
            r.first = prod.first
        seen.__exit__(None, None, None)
    r.warns = [str(x.message) for x in r.warns if str(x.message).startswith("ampdoctor")]
    r.state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    r.opt_state = opt.state_dict()
    r.final_scale = sc.get_scale()
    return r


def std_body(m, opt, sc, batch, loss_fn, *, clip=lambda ps: nn.utils.clip_grad_norm_(ps, 1.0), sched=None,
             fp16=lambda i: True):
    """The documented loop: zero_grad -> fp16 autocast forward (`fp16(i)` False: fp32) -> scale(loss).backward() ->
    [unscale_ -> clip] -> scaler.step -> update -> [sched.step]; `clip=None`: no unscale_ and no clipping at all
    (scaler.step unscales)."""
    def body(i):
        opt.zero_grad()
        x, y = batch(i)
        with torch.autocast("cpu", dtype=F16, enabled=fp16(i)):
            out = m(x)
        loss = loss_fn(out, y)
        sc.scale(loss).backward()
        if clip is not None:
            sc.unscale_(opt)
            clip(m.parameters())
        sc.step(opt)
        sc.update()
        if sched is not None:
            sched.step()
        return loss.item()
    return body


# ------------------------------------------------------------------------------------------------------ the oracle
def healthy(r, case):
    """The (unwatched) run was healthy by the test's own measurements: every loss finite and the mean of the last
    fifth below `case.fall` x the first fifth's; no module made inf/NaN from finite inputs; the scaler's skips are
    the ones the case allows (`case.skips(r)`; default none); the gradients finite on every step it did not skip;
    every weight finite at the end."""
    ls = r.losses
    assert ls and all(map(math.isfinite, ls)), ls
    k = max(3, len(ls) // 5)
    assert sum(ls[-k:]) / k < case.fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k, ls)
    assert r.first is None, r.first
    case.skips(r)
    bad = [i for i, gs in enumerate(r.grads) if i not in r.skipped and not finite([g for g in gs if g is not None])]
    assert not bad, bad
    assert all(finite(v) for v in r.state.values())


def skips_at(r, s, scale):
    """Iteration `s` run again, alone, on a fresh build of the case holding the weights (and buffers) it started
    from, with the scaler at `scale`: (its loss finite, the scaler skipped it)."""
    c = r.case.make()
    c.m.load_state_dict(r.snaps[s])
    st = c.sc.state_dict()
    st["scale"] = scale
    c.sc.load_state_dict(st)
    loss = c.body(s)
    return math.isfinite(loss), c.sc.get_scale() < scale


def harmless_skips(streak=4, later=2, pairs=False):
    """The scaler's skips are its ordinary search: a first streak from step 0 of at most `streak`, then at most
    `later` skips (isolated unless `pairs`); each one only an overflow of the SCALED gradients: the iteration run
    again from the weights it started with skips at its own scale (the re-run is faithful) and not at half of it
    (a step of the first streak: at 1/2 to 1/256 of it, the initial scale being a guess), its loss finite."""
    def check(r):
        first = next(k for k in range(len(r.losses)) if k not in r.skipped)
        late = [s for s in r.skipped if s > first]
        assert first <= streak and len(late) <= later, (r.skipped, r.scales)
        assert pairs or not any(s + 1 in late for s in late), late
        for s in r.skipped:
            assert skips_at(r, s, r.scales[s]) == (True, True), (s, r.scales[s])
            lower = [r.scales[s] / 2 ** k for k in (range(1, 9) if s < first else (1,))]
            assert any(skips_at(r, s, v) == (True, False) for v in lower), (s, lower)
    return check


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same(a, b):
    """Bitwise equal (tensors, or nested lists/dicts of them and plain values)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def identical(rw, ru):
    """Watching did not change training: every loss, scale, skip, per-step gradient, extra, final weight and buffer,
    the optimizer's state and the final scale bitwise identical with and without the watch."""
    assert rw.losses == ru.losses, [(k, a, b) for k, (a, b) in enumerate(zip(rw.losses, ru.losses)) if a != b][:3]
    assert rw.scales == ru.scales and rw.skipped == ru.skipped and rw.final_scale == ru.final_scale
    diff = [k for k, (a, b) in enumerate(zip(rw.grads, ru.grads)) if not same(a, b)]
    assert not diff and len(rw.grads) == len(ru.grads), diff[:5]
    assert same(rw.c.extra, ru.c.extra), "extras differ"
    diff = [k for k in ru.state if not same(rw.state.get(k), ru.state[k])]
    assert not diff and rw.state.keys() == ru.state.keys(), diff
    assert same(rw.opt_state, ru.opt_state), "optimizer state differs"


def judge(r):
    """ampdoctor's judgement, on w.report() (after close) and ampdoctor.diagnose(run_dir): no warning or error (else
    WrongAnswer naming them), nor an `ampdoctor: ...` Python warning during the run; exit code 0, no internal error,
    one step per iteration."""
    if r.warns:
        raise WrongAnswer(" | ".join(r.warns))
    reps = (r.w.report(), ampdoctor.diagnose(r.rd))
    if DEBUG:
        for f in reps[0].findings:
            print("  ", f.one_line(), f.evidence if f.severity != "info" else "")
    bad = list(dict.fromkeys(a for rep in reps for a in alarms(rep.findings)))
    if bad:
        raise WrongAnswer(" | ".join(bad))
    for rep in reps:
        quiet_report(rep)
        summary = rep.to_dict()["summary"]
        assert rep.exit_code == 0 and not summary.get("internal_error"), summary
        assert summary["steps"] == len(r.losses), (summary["steps"], len(r.losses), lines(rep))


# ------------------------------------------------------------------------------------------------- data, models
W16 = torch.randn(16, 1, generator=gen(7))
WC = torch.randn(16, 4, generator=gen(11))


def regression(seed=0, n=32, scale=1.0):
    """y = x @ W16 + noise, x ~ N(0, 1) x `scale`."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, 16, generator=g)
        return x * scale, x @ W16 + 0.1 * torch.randn(n, 1, generator=g)
    return batch


def classes(seed=1, n=32):
    """Four classes, the argmax of a fixed linear map of x ~ N(0, 1)."""
    def batch(i):
        x = torch.randn(n, 16, generator=gen(seed * 100_000 + i))
        return x, (x @ WC).argmax(1)
    return batch


def mse(out, y):
    return F.mse_loss(out.float(), y)


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def mlp(out=1, seed=0, width=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, out))


def adamw(m, lr=2e-3):
    return torch.optim.AdamW(m.parameters(), lr=lr)


def scaler(**kw):
    return torch.amp.GradScaler("cpu", **kw)


CASES = {}
XFAIL: dict[str, str] = {}


def case(steps, fall=0.8, skips=None, name=None, check=None):
    def deco(make):
        CASES[name or make.__name__] = SimpleNamespace(make=make, steps=steps, fall=fall,
                                                       skips=skips or harmless_skips(), check=check)
        return make
    return deco


def ns(m, opt, sc, body, **extra):
    return SimpleNamespace(m=m, opt=opt, sc=sc, body=body, extra=extra.pop("extra", []), **extra)


# ---------------------------------------------------------------------------------------------------- the cases
def growth_search(r):
    """With growth_interval 5 the scale keeps probing higher: skips on over a tenth of the steps (all harmless,
    pairs allowed: a probe that fails twice as the gradients vary batch to batch), and the scale never below half
    its start and higher at the end."""
    harmless_skips(streak=0, later=int(0.2 * len(r.losses)), pairs=True)(r)
    assert len(r.skipped) > 0.1 * len(r.losses), r.skipped
    assert min(r.scales) >= r.scales[0] / 2 and r.final_scale > r.scales[0], r.scales


@case(80, skips=growth_search)
def growth_interval_5():
    """1. An MLP regressor, GradScaler(init_scale=2**16, growth_interval=5): the scale doubles after every 5 clean
    steps, probes too high, backs off, grows again (GradScaler's ordinary search, at a short interval)."""
    m = mlp(out=4)
    opt, sc = adamw(m), scaler(init_scale=2.0 ** 16, growth_interval=5)
    return ns(m, opt, sc, std_body(m, opt, sc, classes(), ce))


@case(60, skips=harmless_skips(streak=8))
def init_scale_2p24():
    """2. A 4-class MLP classifier, GradScaler(init_scale=2**24): the first search halves the scale for a few steps
    in a row, then none."""
    m = mlp(out=4)
    opt, sc = adamw(m), scaler(init_scale=2.0 ** 24)
    return ns(m, opt, sc, std_body(m, opt, sc, classes(), ce))


@case(60)
def fp32_warmup_then_fp16():
    """3. 15 iterations in fp32 (autocast enabled=False; the GradScaler already scaling) then fp16 autocast."""
    m = mlp()
    opt, sc = adamw(m), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, regression(), mse, fp16=lambda i: i >= 15))


@case(60)
def clip_grad_value():
    """4. unscale_ -> clip_grad_value_(0.05) -> step -> update (the documented order, value clipping)."""
    m = mlp(out=4)
    opt, sc = adamw(m), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, classes(), ce,
                                   clip=lambda ps: nn.utils.clip_grad_value_(ps, 0.05)))


@case(60)
def no_clip_no_unscale():
    """5. scale(loss).backward() -> scaler.step -> update: no unscale_, no clipping (scaler.step unscales)."""
    m = mlp()
    opt, sc = adamw(m), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, regression(), mse, clip=None))


@case(40)
def uneven_accumulation():
    """6. Gradient accumulation over 1, 3, 2, 4 micro-batches in turn (each loss / k), zero_grad(set_to_none=False),
    unscale_ + clip_grad_norm_ once per optimizer step."""
    m = mlp()
    opt, sc = adamw(m), scaler()
    data, counts = regression(n=16), (1, 3, 2, 4)

    def body(i):
        opt.zero_grad(set_to_none=False)
        k = counts[i % 4]
        tot = 0.0
        for j in range(k):
            x, y = data(10 * i + j)
            with torch.autocast("cpu", dtype=F16):
                loss = mse(m(x), y) / k
            sc.scale(loss).backward()
            tot += loss.item()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return tot
    return ns(m, opt, sc, body)


@case(60)
def unfreeze_add_param_group():
    """7. The first two Linears frozen (requires_grad False, not in the optimizer) for 25 iterations; then unfrozen
    and added by opt.add_param_group with their own lr."""
    m = mlp(out=4)
    body_ps = [*m[0].parameters(), *m[2].parameters()]
    for p in body_ps:
        p.requires_grad_(False)
    opt, sc = torch.optim.AdamW(m[4].parameters(), lr=3e-3), scaler()
    step = std_body(m, opt, sc, classes(), ce)

    def body(i):
        if i == 25:
            for p in body_ps:
                p.requires_grad_(True)
            opt.add_param_group({"params": body_ps, "lr": 1e-3})
        return step(i)
    return ns(m, opt, sc, body)


class Unrolled(nn.Module):
    """A GRUCell unrolled over 8 time steps, one shared input projection applied at each: two modules called 8
    times per forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inp, self.cell, self.head = nn.Linear(4, 16), nn.GRUCell(16, 32), nn.Linear(32, 1)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 32)
        for t in range(x.shape[1]):
            h = self.cell(torch.tanh(self.inp(x[:, t])), h)
        return self.head(h)


def sequences(seed=3, n=16, T=8):
    wf = torch.tensor([0.5, -1.0, 0.8, 0.3])

    def batch(i):
        x = torch.randn(n, T, 4, generator=gen(seed * 100_000 + i))
        return x, (x[:, -3:] @ wf).sum(1, keepdim=True)
    return batch


@case(60, skips=harmless_skips(pairs=True))
def unrolled_cell_shared():
    """8. Weight sharing: a GRUCell and its input projection each called 8 times per forward."""
    m = Unrolled()
    opt, sc = adamw(m, 5e-3), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, sequences(), mse))


class TiedLM(nn.Module):
    """Token embedding -> residual MLP + LayerNorm -> a head whose weight IS the embedding's."""

    def __init__(self, V=32, d=32):
        super().__init__()
        torch.manual_seed(4)
        self.emb, self.ln = nn.Embedding(V, d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        nn.init.normal_(self.emb.weight, std=d ** -0.5)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.ln(h + self.mlp(h)))


def next_tokens(seed=4, B=8, T=12, V=32):
    """A counting language: each token the one before + 3 (mod V); the labels are the next tokens."""
    def batch(i):
        start = torch.randint(0, V, (B, 1), generator=gen(seed * 100_000 + i))
        seq = (start + 3 * torch.arange(T + 1)) % V
        return seq[:, :-1], seq[:, 1:]
    return batch


@case(60)
def tied_embeddings_label_smoothing():
    """9. A tiny LM with tied input/output embeddings, cross-entropy with label_smoothing=0.1."""
    m = TiedLM()
    assert m.head.weight is m.emb.weight
    opt, sc = adamw(m, 1e-2), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, next_tokens(), lambda out, y: F.cross_entropy(
        out.float().flatten(0, 1), y.flatten(), label_smoothing=0.1)))


OPTIMIZERS = {"adagrad": (torch.optim.Adagrad, 5e-2), "rmsprop": (torch.optim.RMSprop, 1e-3),
              "nadam": (torch.optim.NAdam, 2e-3), "adafactor": (torch.optim.Adafactor, 1e-2)}


def _optimizer_case(name):
    def make():
        """10. The MLP regressor with fp32 master weights under another optimizer (Adagrad, RMSprop, NAdam,
        Adafactor)."""
        m = mlp()
        cls, lr = OPTIMIZERS[name]
        opt, sc = cls(m.parameters(), lr=lr), scaler()
        return ns(m, opt, sc, std_body(m, opt, sc, regression(), mse))
    return make


for _n in OPTIMIZERS:
    case(50, name=f"optimizer_{_n}")(_optimizer_case(_n))


@case(70)
def warmup_from_zero_cosine_restarts():
    """11. A linear LR warmup from exactly 0 over 10 steps (LambdaLR), then CosineAnnealingWarmRestarts(T_0=15)
    (SequentialLR); the lr each step ran with kept."""
    m = mlp(out=4)
    opt, sc = adamw(m, 3e-3), scaler()
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: k / 10)
    cos = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=15)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[10])
    lrs = []
    step = std_body(m, opt, sc, classes(), ce, sched=sched)

    def body(i):
        lrs.append(opt.param_groups[0]["lr"])
        return step(i)
    return ns(m, opt, sc, body, extra=lrs)


def _lr_from_zero(r):
    lrs = r.c.extra
    assert lrs[0] == 0.0 and 0 < lrs[1] < lrs[9] and math.isclose(max(lrs), 3e-3), lrs[:12]
    assert any(b > 2 * a for a, b in zip(lrs[10:], lrs[11:])), lrs       # a restart: the lr jumps back up


CASES["warmup_from_zero_cosine_restarts"].check = _lr_from_zero


def _big_activations(r):
    """The first Linear's fp16 output reaches about 1e4 on every step, never above 3e4 (over 1 bit of headroom
    left), and does not creep up (the last ten steps' mean within 1.25x of the first ten's)."""
    peaks = r.c.extra
    assert all(4e3 < v < 3e4 for v in peaks), (min(peaks), max(peaks))
    assert sum(peaks[-10:]) < 1.25 * sum(peaks[:10]), (peaks[:10], peaks[-10:])


@case(60, check=_big_activations)
def large_activations_1e4():
    """12. Raw, unnormalised features (x 4000): the first Linear's fp16 output peaks near 1e4 every step (about 2.5
    bits below fp16's max), a LayerNorm right after it; stable through the run."""
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    peaks, live = [], [False]         # (not after the loop: close() may replay a capture through the model)

    def peak(mod, inp, out):
        if live[0]:
            peaks.append(float(out.detach().abs().max()))
    m[0].register_forward_hook(peak)
    opt, sc = adamw(m, 1e-3), scaler()
    step = std_body(m, opt, sc, regression(scale=4000.0), mse)

    def body(i):
        live[0] = True
        loss = step(i)
        live[0] = False
        return loss
    return ns(m, opt, sc, body, extra=peaks)


def _tiny_grads(r):
    """The unscaled parameter gradients are mostly below fp16's smallest normal (2**-14) on most steps: only the
    scale (2**16) keeps the fp16 backward in range."""
    med = [float(torch.cat([g.abs().flatten() for g in gs]).median()) for gs in r.grads]
    assert sum(v < FP16_MIN_NORMAL for v in med) > 0.8 * len(med), med[::10]


@case(60, check=_tiny_grads)
def tiny_gradients_scaled():
    """13. A loss weighted 1e-4 (an auxiliary term's weight): gradients far below fp16's normal range unscaled,
    lifted into it by the GradScaler's 2**16; AdamW is scale-free, so the run learns as at weight 1."""
    m = mlp()
    opt, sc = adamw(m), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, regression(), lambda out, y: 1e-4 * mse(out, y)))


@case(60)
def eval_every_10_no_grad():
    """14. A classifier with BatchNorm1d and Dropout; every 10th iteration, after the step, an eval pass
    (model.eval(), torch.no_grad(), fp16 autocast) on a held-out batch, then model.train(); the eval losses kept."""
    torch.manual_seed(6)
    m = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    opt, sc = adamw(m, 3e-3), scaler()
    step, held, evals = std_body(m, opt, sc, classes(), ce), classes(seed=9, n=64), []

    def body(i):
        loss = step(i)
        if i % 10 == 9:
            m.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=F16):
                x, y = held(0)
                evals.append(ce(m(x), y).item())
            m.train()
        return loss
    return ns(m, opt, sc, body, extra=evals)


class BNConv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.f = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc(self.f(x))


def images(seed=8, n=16):
    """8x8 RGB patches; the target is a brightness score (4 x channel 0's mean minus channel 2's)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randn(n, 3, 8, 8, generator=g) * 0.5 + torch.randn(n, 3, 1, 1, generator=g)
        return x, (4 * x[:, 0].mean((1, 2)) - x[:, 2].mean((1, 2))).unsqueeze(1)
    return batch


def _bn_frozen(r):
    bn = [k for k in r.state if "running" in k]
    assert bn and all(same(r.state[k], r.c.bn0[k]) for k in bn), "running stats moved"


@case(50, check=_bn_frozen)
def batchnorm_eval_mode():
    """15. A conv net whose BatchNorms hold "pretrained" running stats (20 fp32 no-grad batches in train mode before
    the run) and are kept in eval mode while the rest trains (the fine-tuning recipe); the stats never move."""
    m = BNConv()
    data = images()
    with torch.no_grad():
        for k in range(20):
            m(data(1000 + k)[0])
    bn0 = {k: v.clone() for k, v in m.state_dict().items() if "running" in k}
    opt, sc = adamw(m, 3e-3), scaler()
    step = std_body(m, opt, sc, data, mse)

    def body(i):
        m.train()
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.eval()
        return step(i)
    return ns(m, opt, sc, body, bn0=bn0)


class Checkpointed(nn.Module):
    """Three pre-LN residual MLP blocks with dropout, each run through torch.utils.checkpoint(use_reentrant=False)
    (which replays the RNG state for the recompute)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(64, 32)) for _ in range(3))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + checkpoint(b, h, use_reentrant=False)
        return self.head(h)


def _recomputed(r):
    assert r.c.extra == [2] * len(r.losses), r.c.extra[:5]    # each block ran twice a step: forward + recompute


@case(50, check=_recomputed)
def checkpoint_non_reentrant():
    """16. Activation checkpointing (use_reentrant=False): every block's forward runs again inside backward."""
    m = Checkpointed()
    opt, sc = adamw(m), scaler()
    calls = []
    m.blocks[0].register_forward_pre_hook(lambda *a: calls.__setitem__(-1, calls[-1] + 1))
    step = std_body(m, opt, sc, regression(), mse)

    def body(i):
        calls.append(0)
        return step(i)
    return ns(m, opt, sc, body, extra=calls)


WP = torch.randn(16, generator=gen(12)) * 0.02


def counts(seed=10, n=64):
    """Event counts 0..20 per feature, stored as fp16 (exact: integers); the target a Poisson draw at
    exp(counts @ WP)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        x = torch.randint(0, 21, (n, 16), generator=g)
        return x.to(F16), torch.poisson(torch.exp(x.float() @ WP), generator=g).unsqueeze(1)
    return batch


def _small_ints(r):
    data = counts()
    xs = [data(i)[0] for i in range(len(r.losses))]
    assert all(torch.equal(x, x.round()) for x in xs) and max(float(x.max()) for x in xs) == 20.0


@case(60, fall=0.9, check=_small_ints)
def small_integer_inputs():
    """17. Integer-looking inputs that stay small: fp16 counts 0..20 into a Poisson regressor (poisson_nll_loss,
    log input)."""
    torch.manual_seed(11)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt, sc = adamw(m, 3e-3), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, counts(), lambda out, y: F.poisson_nll_loss(out.float(), y)))


class Siamese(nn.Module):
    """One encoder applied to both views of a pair (two calls per forward), a head on |a - b| and a * b."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(13)
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        a, b = self.enc(x[:, 0]), self.enc(x[:, 1])
        return self.head(torch.cat([(a - b).abs(), a * b], -1))


def pairs(seed=14, n=32):
    """Pairs of points; the label is whether they lie on the same side of a fixed hyperplane."""
    def batch(i):
        x = torch.randn(n, 2, 16, generator=gen(seed * 100_000 + i))
        side = (x @ W16).squeeze(-1) > 0
        return x, (side[:, 0] == side[:, 1]).float().unsqueeze(1)
    return batch


@case(60)
def siamese_shared_encoder():
    """18. A siamese net: one encoder called on both views of a pair, BCE-with-logits on "same side"."""
    m = Siamese()
    opt, sc = adamw(m, 1e-2), scaler()
    return ns(m, opt, sc, std_body(m, opt, sc, pairs(), lambda out, y: F.binary_cross_entropy_with_logits(
        out.float(), y)))


@case(60)
def same_module_fp16_and_fp32():
    """19. One module called twice an iteration, once under fp16 autocast (the task loss) and once in fp32 outside it
    (a consistency term on a noisy copy of the batch, weight 0.1), one scaled backward of the sum."""
    m = mlp(out=4)
    opt, sc = adamw(m, 3e-3), scaler()
    data = classes()

    def body(i):
        opt.zero_grad()
        x, y = data(i)
        with torch.autocast("cpu", dtype=F16):
            out = m(x)
        noisy = m(x + 0.05 * torch.randn(x.shape, generator=gen(777 + i)))
        loss = ce(out, y) + 0.1 * F.mse_loss(noisy, out.float().detach())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        return loss.item()
    return ns(m, opt, sc, body)


@case(60)
def fused_adamw_no_unscale():
    """20. AdamW(fused=True), no unscale_ and no clipping: GradScaler.step hands its scale and found_inf to the fused
    kernel, which unscales inside (the .grad tensors stay scaled: the documented fused path)."""
    m = mlp()
    opt, sc = torch.optim.AdamW(m.parameters(), lr=2e-3, fused=True), scaler()
    assert getattr(opt, "_step_supports_amp_scaling", False)
    return ns(m, opt, sc, std_body(m, opt, sc, regression(), mse, clip=None))


# ---------------------------------------------------------------------------------------------------- the test
@pytest.mark.parametrize("name", [pytest.param(n, marks=wrong(XFAIL[n]) if n in XFAIL else ()) for n in CASES])
def test_unusual_but_healthy(name, tmp_path):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, under the oracle's hooks
    if DEBUG:
        print(name, "skipped", ru.skipped, "scales", sorted(set(ru.scales)), "loss",
              [round(v, 4) for v in ru.losses[::10]], ru.losses[-1])
    healthy(ru, cs)
    if getattr(cs, "check", None) is not None:
        cs.check(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)                     # so the oracle's facts hold for the watched run too
    judge(rw)
