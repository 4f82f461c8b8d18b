"""ampdoctor.watch on models trained through torch.compile ON THE CPU, the way nanoGPT's train.py does it
(`model = torch.compile(model)`, fp16 autocast + GradScaler, or bf16 autocast with `GradScaler(enabled=False)`;
zero_grad(set_to_none=True) after the update), in both orders the README allows: watch(model) then compile, and
compile then watch(the OptimizedModule). Backend: Inductor (a C++ compiler is present here, so Inductor's CPU
kernels build; without one the file falls back to backend="aot_eager"). tests/test_compile.py and
test_unseen_variants3/35 cover aot_eager on a two-layer net; this file covers Inductor's generated code, a
nanoGPT-shaped GPT (loss inside the compiled forward, tied lm_head, SDPA), dynamic sequence lengths, graph breaks,
a loss outside the compiled region, and report() mid-run.

Every run starts from torch._dynamo.reset() and torch.manual_seed(0). The healthy cases compare the watched run
with the same compiled run unwatched (same seed, same backend): every loss and every final weight bitwise equal
(the README: "the compiled code, its speed and its numerics stay the same"), and the report has no warning or
error, no ampdoctor RuntimeWarning, no internal error. Each failure is first proven by an oracle: the compiled run's
loss is first non-finite at step k and (fp16) the scaler skips it, and probe_harness.Producer's hooks on an EAGER
copy loaded with the weights step k ran with (the compiled model carries no hooks) name the producing module; only
then must the report's first three warning/error findings hold the rule at that module and step.

 1. healthy nanoGPT-style GPT (nanoGPT's init, tied lm_head, loss inside the forward), fp16 + GradScaler, 2
    gradient-accumulation micro-steps per update, watch(model) then torch.compile: quiet, bitwise equal to the
    unwatched compiled run.
 2. healthy GPT, bf16 + GradScaler(enabled=False) (nanoGPT's bf16 path), compile then watch(compiled): the same.
 3. dynamic shapes: the sequence length changes every step (16, 8, 12, 16, 6, ...; Dynamo recompiles with a
    symbolic length, oracle: >= 2 graphs), fp16, compile then watch: quiet, bitwise equal to the unwatched.
 4. graph breaks inside the model (a print() and a `.item()`-driven branch in block 0; oracle: Dynamo's graph_break
    counter), fp16, watch then compile: quiet, bitwise equal to the unwatched.
 5. transformer.h.1.mlp.c_fc's weight set to +-2e4 (a bad checkpoint surgery) before step 4, fp16, watch then
    compile: overflow at transformer.h.1.mlp.c_fc, step 4.
 6. an MLP whose `act` is exp(); the batch of step 4 is unnormalised (x40): exp overflows fp16 inside Inductor's
    kernel (computed in fp32, stored as fp16 for the next addmm), compile then watch: overflow at `act`, step 4.
 7. bf16 with GradScaler(enabled=False): a `feat` module taking log1p of count features; the batch of step 3
    carries the missing-value code -999: NaN, watch then compile: nan_origin at `feat`, step 3.
 8. the blow-up of 5 in the block AFTER the graph breaks of 4 (several compiled graphs), compile then watch:
    overflow at transformer.h.1.mlp.c_fc, step 4.
 9. the loss computed outside the compiled model going NaN: a hand-written BCE on sigmoid(logits) in fp16; the batch
    of step 4 saturates sigmoid to 1.0, log(1 - p) = log(0) = -inf, 0 * -inf = NaN; the model's output is finite
    (oracle: an eager copy's hooks see no producer): no warning/error finding may name a module of the model (root
    included), and a nan_origin with module null at step 4 must be among the first three.
10. w.report() after step 4 of a run whose step 3 overflowed fc1 (an x1e5 batch; report() replays that capture
    eagerly), then training goes on to step 9: the mid report and the final one name overflow at fc1, step 3, and
    the whole run (dropout inside the compiled graph, drawing on the global RNG) is bitwise equal to the unwatched.
11. case 3's length schedule with the blow-up of 5 at step 5 (length 10, the recompiled symbolic-length graph),
    watch then compile: overflow at transformer.h.1.mlp.c_fc, step 5.
12. as 1 (no accumulation), watch(model) then the in-place `model.compile()` (nn.Module.compile, no wrapper):
    quiet, bitwise equal to the unwatched `model.compile()` run.
13. as 5, watch(model) then `model.compile()`: overflow at transformer.h.1.mlp.c_fc, step 4.

Runtime: ~90-110 s with a cold Inductor cache on a 2-core CPU, ~30 s with a warm one (/tmp/torchinductor_*).

Result when written: 13 pass, 0 xfail (torch 2.13 CPU, Inductor). ampdoctor's answers: 5/8/11/13 `[error]
overflow at transformer.h.1.mlp.c_fc aten::addmm` at the step, then skipped_steps at the same module; 6 `overflow
at act aten::exp step 4`; 7 `nan_origin at feat aten::log1p step 3`; 9 `nan_origin at (run) step 4: The loss became
NaN outside the watched model ...`; 10 `overflow at fc1 aten::_to_copy step 3` in both reports.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer, finite
from scenarios import alarms, lines

BACKEND = "inductor" if (shutil.which("g++") or shutil.which("c++")) else "aot_eager"
STEPS = 8


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ models and data
V, D, NH, TMAX = 32, 16, 2, 16


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, brk=False):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(D), CausalSelfAttention(), nn.LayerNorm(D), MLP()
        self.brk = brk

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        if self.brk:
            print("block 0 rms", x.pow(2).mean())                 # a graph break (printing a tensor)
            if x.abs().max().item() > 1e4:                          # a graph break (data-dependent branch)
                x = x / 2
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model, tiny: forward(idx, targets) -> (logits, loss), lm_head tied to wte."""

    def __init__(self, brk=False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, D), wpe=nn.Embedding(TMAX, D),
                                              h=nn.ModuleList([Block(brk), Block()]), ln_f=nn.LayerNorm(D)))
        self.lm_head = nn.Linear(D, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for mod in self.modules():                                  # nanoGPT's _init_weights
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, mean=0.0, std=0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def gpt_batch(i, T=TMAX, B=4):
    """A learnable toy language: x_{t+1} = (5 x_t + 3) mod V from a random start; (X, Y) shifted by one."""
    g = torch.Generator().manual_seed(100 + i)
    s = [torch.randint(0, V, (B,), generator=g)]
    for _ in range(T):
        s.append((5 * s[-1] + 3) % V)
    s = torch.stack(s, 1)
    return s[:, :-1].contiguous(), s[:, 1:].contiguous()


def gpt_loss(out, y):
    return out[1]


def gpt_args(i):
    x, y = gpt_batch(i)
    return (x,), y


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class ExpNet(nn.Module):
    """body -> exp -> head (an exp activation, as a positive-rate head feeding a mixer)."""

    def __init__(self):
        super().__init__()
        self.body, self.act, self.head = nn.Linear(8, 32), Exp(), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.act(self.body(x) * 0.25))


class Log1p(nn.Module):
    def forward(self, x):
        return torch.log1p(x)


class CountNet(nn.Module):
    """log1p of count features -> Linear -> ReLU -> Linear."""

    def __init__(self):
        super().__init__()
        self.feat, self.fc1, self.fc2 = Log1p(), nn.Linear(8, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.feat(x))))


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


W_TEACH = torch.randn(8, 1, generator=torch.Generator().manual_seed(7)) * 0.5


def reg_batch(i, scale=None):
    """A regression batch y = x @ W_TEACH; `scale`: {step: factor} applied to x (a data bug at that step)."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(200 + i % 4))
    y = x @ W_TEACH
    return (x * (scale or {}).get(i, 1.0),), y


def mse(out, y):
    return F.mse_loss(out.float(), y)


# ------------------------------------------------------------------------------------------------ the user's loop
def _loop(make, batch, steps, *, loss_fn, dtype, order, run_dir, inject, snap_at, mid_report, lr, accum):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    m = make()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", enabled=(dtype == torch.float16))
    r = dict(losses=[], bad_loss=[], skipped=[], out_finite=[], sd=None, mid=None, rep=None, warns=[], model=m)
    w = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if order == "watch_then_compile":
            w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir)
            model = torch.compile(m, backend=BACKEND)
        elif order in ("watch_then_module_compile", "module_compile"):   # nn.Module.compile(): in place
            if order == "watch_then_module_compile":
                w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir)
            m.compile(backend=BACKEND)
            model = m
        else:
            model = torch.compile(m, backend=BACKEND)
            if order == "compile_then_watch":
                w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=run_dir)
        torch.manual_seed(0)
        with contextlib.redirect_stdout(None):      # the print() graph break
            for i in range(steps):
                if inject is not None:
                    with torch.no_grad():
                        inject(i, m)
                if i == snap_at:
                    r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
                total, ok = 0.0, True
                for j in range(accum):                  # nanoGPT's gradient accumulation micro-steps
                    args, y = batch(i * accum + j)
                    with torch.autocast("cpu", dtype=dtype):
                        out = model(*args, y) if loss_fn is gpt_loss else model(*args)
                        loss = loss_fn(out, y) / accum
                    ok = ok and finite(out[0] if loss_fn is gpt_loss else out)
                    total += loss.item()
                    sc.scale(loss).backward()
                r["out_finite"].append(ok)
                r["losses"].append(total)
                if not math.isfinite(total):
                    r["bad_loss"].append(i)
                s0 = sc.get_scale() if sc.is_enabled() else None
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                sc.step(opt)
                sc.update()
                if s0 is not None and sc.get_scale() < s0:
                    r["skipped"].append(i)
                opt.zero_grad(set_to_none=True)
                if w is not None and i == mid_report:
                    r["mid"] = w.report()
        if w is not None:
            w.close()
            r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    r["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    r["breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert r["graphs"] >= 1, "nothing was compiled"
    return r


def run(make, batch, steps=STEPS, *, loss_fn=mse, dtype=torch.float16, order="watch_then_compile", run_dir=None,
        inject=None, snap_at=None, mid_report=None, lr=1e-2, accum=1):
    """nanoGPT's loop: [inject(i, m) under no_grad] -> autocast forward of the compiled model (-> loss_fn) ->
    scale(loss).backward -> unscale_ -> clip 1.0 -> step -> update -> zero_grad(set_to_none=True) [-> w.report()
    after step `mid_report`]. `order`: "watch_then_compile", "compile_then_watch" (watch the OptimizedModule), or
    None (unwatched, the twin). A crash only under the watch (the unwatched twin runs) is ampdoctor's: WrongAnswer."""
    kw = dict(loss_fn=loss_fn, dtype=dtype, run_dir=run_dir, inject=inject, snap_at=snap_at, mid_report=mid_report,
              lr=lr, accum=accum)
    if order in (None, "module_compile"):
        return _loop(make, batch, steps, order=order, **kw)
    try:
        return _loop(make, batch, steps, order=order, **kw)
    except Exception as e:
        _loop(make, batch, steps, order="module_compile" if "module" in order else None, **{**kw, "run_dir": None})
        raise WrongAnswer(f"the watched compiled run crashed, the unwatched one did not: {e!r}") from e


def check(cond, msg):
    if not cond:
        raise WrongAnswer(msg)


def hexes(xs):
    return [float(x).hex() for x in xs]


def same_as_twin(r, t):
    """The watched run and its unwatched twin: every loss and every final weight bitwise equal."""
    check(hexes(r["losses"]) == hexes(t["losses"]), ("losses changed by the watch", r["losses"], t["losses"]))
    diff = [k for k in t["weights"] if not torch.equal(r["weights"][k], t["weights"][k])]
    check(not diff, f"final weights changed by the watch: {diff}")


def assert_healthy(r, fall=True):
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and all(r["out_finite"]), ls
    assert all(s < 3 for s in r["skipped"]), r["skipped"]
    if fall:
        assert sum(ls[-3:]) < 0.95 * sum(ls[:3]), ls


def quiet(r, steps):
    rep = r["rep"]
    check(not alarms(rep.findings) and rep.exit_code == 0, ("false alarm", lines(rep)))
    check(r["warns"] == [], ("ampdoctor RuntimeWarning", r["warns"]))
    s = rep.to_dict()["summary"]
    check(not s.get("internal_error") and s.get("steps") == steps, ("summary", s))


def real_failure(r, step, scaler=True):
    """The compiled run failed first at `step`: loss non-finite there and not before; (scaler) that step skipped,
    before it only the first steps' ordinary backoffs."""
    assert r["bad_loss"] and r["bad_loss"][0] == step, r["losses"]
    if scaler:
        assert step in r["skipped"] and all(s < 3 for s in r["skipped"] if s < step), r["skipped"]


def eager_oracle(make, sd, args, dtype, y=None):
    """Producer hooks on an eager copy with the weights the failing step ran with: its first producer."""
    torch.manual_seed(0)
    m = make()
    m.load_state_dict(sd)
    p = Producer(m, with_kwargs=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        m(*args) if y is None else m(*args, y)
    p.remove()
    return p.first


def named_in_top3(rep, rules, module, step):
    """`rule` at `module` (the watched model's name, or the OptimizedModule's `_orig_mod.` one) and `step` among
    the first three warning/error findings."""
    rules = (rules,) if isinstance(rules, str) else rules
    top = [f for f in rep.findings if f.severity in ("warning", "error")][:3]
    names = (module,) if module is None else (module, "_orig_mod." + module)
    hit = [f for f in top if f.rule in rules and f.module in names and f.step == step]
    check(hit, (f"{rules} @ {module} step {step} not among the first three alarms", lines(rep)))
    return hit[0]


# ------------------------------------------------------------------------------------------------ 1-4 healthy
@pytest.mark.parametrize("dtype,order,accum", [
    pytest.param(torch.float16, "watch_then_compile", 2, id="1-fp16-accum2-watch_then_compile"),
    pytest.param(torch.bfloat16, "compile_then_watch", 1, id="2-bf16-compile_then_watch"),
    pytest.param(torch.float16, "watch_then_module_compile", 1, id="12-fp16-watch_then_module_compile"),
])
def test_healthy_gpt_is_quiet_and_bitwise_unchanged(tmp_path, dtype, order, accum):
    r = run(GPT, gpt_args, loss_fn=gpt_loss, dtype=dtype, order=order, run_dir=tmp_path / "run", accum=accum)
    t = run(GPT, gpt_args, loss_fn=gpt_loss, dtype=dtype, order="module_compile" if "module" in order else None,
            accum=accum)
    assert_healthy(t)
    same_as_twin(r, t)
    quiet(r, STEPS)


SEQ = [16, 8, 12, 16, 6, 10, 14, 9]


def seq_batch(i):
    x, y = gpt_batch(i, T=SEQ[i])
    return (x,), y


def test_3_dynamic_sequence_length_is_quiet_and_bitwise_unchanged(tmp_path):
    batch = seq_batch
    torch._dynamo.utils.counters.clear()
    t = run(GPT, batch, loss_fn=gpt_loss, order=None)
    assert_healthy(t, fall=False)                # different lengths: the loss is not comparable step to step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2   # it really recompiled for the new length
    r = run(GPT, batch, loss_fn=gpt_loss, order="compile_then_watch", run_dir=tmp_path / "run")
    same_as_twin(r, t)
    quiet(r, STEPS)


def test_4_graph_breaks_inside_the_model_are_quiet_and_bitwise_unchanged(tmp_path):
    make = lambda: GPT(brk=True)  # noqa: E731
    torch._dynamo.utils.counters.clear()
    t = run(make, gpt_args, loss_fn=gpt_loss, order=None)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) >= 1, dict(torch._dynamo.utils.counters)
    assert_healthy(t)
    r = run(make, gpt_args, loss_fn=gpt_loss, order="watch_then_compile", run_dir=tmp_path / "run")
    same_as_twin(r, t)
    quiet(r, STEPS)


# ------------------------------------------------------------------------------------------------ 5-8 failures
def blow_c_fc(at):
    def inject(i, m):
        if i == at:
            w = m.transformer.h[1].mlp.c_fc.weight
            w.copy_(torch.where(w >= 0, 2e4, -2e4))
    return inject


@pytest.mark.parametrize("brk,order", [
    pytest.param(False, "watch_then_compile", id="5-watch_then_compile"),
    pytest.param(True, "compile_then_watch", id="8-after_a_graph_break-compile_then_watch"),
    pytest.param(False, "watch_then_module_compile", id="13-watch_then_module_compile"),
])
def test_blown_up_linear_inside_the_compiled_gpt(tmp_path, brk, order):
    make = lambda: GPT(brk=brk)  # noqa: E731
    r = run(make, gpt_args, loss_fn=gpt_loss, order=order, run_dir=tmp_path / "run", inject=blow_c_fc(4), snap_at=4)
    real_failure(r, 4)
    assert not r["out_finite"][4]
    x, y = gpt_batch(4)
    assert eager_oracle(make, r["sd"], (x,), torch.float16, y) == ("transformer.h.1.mlp.c_fc", 0)
    named_in_top3(r["rep"], "overflow", "transformer.h.1.mlp.c_fc", 4)


def test_11_blown_up_linear_at_a_new_sequence_length(tmp_path):
    """Case 3's length schedule; the blow-up of 5 lands on step 5 (length 10, run by the graph Dynamo recompiled
    with a symbolic length)."""
    r = run(GPT, seq_batch, loss_fn=gpt_loss, order="watch_then_compile", run_dir=tmp_path / "run",
            inject=blow_c_fc(5), snap_at=5)
    real_failure(r, 5)
    assert not r["out_finite"][5] and r["graphs"] >= 2
    (x,), y = seq_batch(5)
    assert eager_oracle(GPT, r["sd"], (x,), torch.float16, y) == ("transformer.h.1.mlp.c_fc", 0)
    named_in_top3(r["rep"], "overflow", "transformer.h.1.mlp.c_fc", 5)


def test_6_exp_overflow_inside_inductor_kernel(tmp_path):
    batch = lambda i: reg_batch(i, {4: 40.0})  # noqa: E731
    r = run(ExpNet, batch, order="compile_then_watch", run_dir=tmp_path / "run", snap_at=4, lr=1e-3)
    real_failure(r, 4)
    assert not r["out_finite"][4]
    assert eager_oracle(ExpNet, r["sd"], batch(4)[0], torch.float16) == ("act", 0)
    named_in_top3(r["rep"], "overflow", "act", 4)


def test_7_bf16_log1p_of_a_missing_value_code(tmp_path):
    def batch(i):
        x = torch.randint(0, 50, (16, 8), generator=torch.Generator().manual_seed(300 + i % 4)).float()
        y = torch.log1p(x).mean(1, keepdim=True)
        if i == 3:
            x[5, 2] = -999.0                                        # the missing-value code
        return (x,), y
    r = run(CountNet, batch, dtype=torch.bfloat16, order="watch_then_compile", run_dir=tmp_path / "run", snap_at=3,
            lr=1e-3)
    real_failure(r, 3, scaler=False)
    assert all(map(math.isfinite, r["losses"][:3]))
    assert eager_oracle(CountNet, r["sd"], batch(3)[0], torch.bfloat16) == ("feat", 0)
    named_in_top3(r["rep"], "nan_origin", "feat", 3)


# ------------------------------------------------------------------------------------------------ 9 loss outside
def bce_by_hand(out, y):
    p = torch.sigmoid(out)
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def test_9_loss_outside_the_compiled_model_goes_nan(tmp_path):
    def batch(i):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(400 + i % 4))
        y = (x @ W_TEACH > 0).float()
        return (x * (100.0 if i == 4 else 1.0),), y
    torch.manual_seed(0)
    r = run(DropNet, batch, loss_fn=bce_by_hand, order="watch_then_compile", run_dir=tmp_path / "run", snap_at=4,
            lr=1e-3)
    real_failure(r, 4)
    assert all(r["out_finite"]), r["out_finite"]                  # the model's output is finite at every step
    # the oracle: recomputed eagerly with the weights of step 4, no module produced inf/NaN, the loss is NaN
    torch.manual_seed(0)
    m = DropNet()
    m.load_state_dict(r["sd"])
    m.drop.p = 0.0
    p = Producer(m, with_kwargs=True)
    (x,), y = batch(4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = m(x)
        assert (torch.sigmoid(out) == 1).any() and math.isnan(bce_by_hand(out, y).item())
    p.remove()
    assert p.first is None and finite(out)
    names = {n for n, _ in r["model"].named_modules()}
    blamed = [f.one_line() for f in r["rep"].findings if f.severity in ("warning", "error") and f.module in names]
    check(not blamed, ("a model module blamed for the loss's own NaN", lines(r["rep"])))
    named_in_top3(r["rep"], "nan_origin", None, 4)               # module null: no module applies (CONTRACT.md)
    # the skip's words follow what went non-finite: the loss, not the forward pass (wrong when written: "the forward
    # pass itself was non-finite" for a finite output)
    skips = [f.message for f in r["rep"].findings if f.rule == "skipped_steps" and f.severity == "error"]
    assert all("the loss itself was non-finite" in m for m in skips), skips


# ------------------------------------------------------------------------------------------------ 10 mid report
def test_10_report_mid_run_then_training_goes_on(tmp_path):
    batch = lambda i: reg_batch(i, {3: 1e5})  # noqa: E731
    steps = 10
    t = run(DropNet, batch, steps, order=None)
    real_failure(t, 3)
    assert all(map(math.isfinite, t["losses"][4:])) and all(s < 3 or s == 3 for s in t["skipped"]), t
    torch.manual_seed(0)
    m = DropNet()
    m.drop.p = 0.0
    p = Producer(m)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        m(batch(3)[0][0])
    p.remove()
    assert p.first == ("fc1", 0)          # the x1e5 batch overflows fc1 whatever the weights (the oracle, at init)
    r = run(DropNet, batch, steps, order="compile_then_watch", run_dir=tmp_path / "run", mid_report=4)
    check(r["mid"] is not None, "no mid report")
    named_in_top3(r["mid"], "overflow", "fc1", 3)
    named_in_top3(r["rep"], "overflow", "fc1", 3)
    same_as_twin(r, t)
    s = r["rep"].to_dict()["summary"]
    check(not s.get("internal_error") and s.get("steps") == steps, ("summary", s))
