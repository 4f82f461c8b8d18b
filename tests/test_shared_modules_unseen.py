"""FP16 FAILURES WHERE THE PRODUCER'S MODULE IDENTITY IS UNUSUAL: one module instance registered in two towers (two
qualified paths, one name in named_modules()), an embedding tied to the output projection (as a tied `lm_head`
Linear, and as F.linear on the embedding's weight in the root's forward), LoRA adapters (a PEFT-style wrapper whose
own scaling overflows while its children stay finite; A/B Linears added in the parent's forward; a LoRA written as a
torch.nn.utils.parametrize parametrization whose B @ A overflows), a ModuleDict of task heads picked per batch, a
Sequential nested four deep feeding a concatenation and a LayerNorm, and a block returning a dataclass whose
auxiliary field alone is inf. Earlier probes build a shared module called twice / three times (test_unseen_arch 14,
test_unseen_variants3/12/20/25) and LoRA whose base Linear overflows (test_unseen_variants35 3); none of the cases
below.

Watched through the public API only (probe_harness.probe_run: `ampdoctor.watch(model, optimizer=AdamW, scaler=
GradScaler("cpu"), run_dir=...)` at the default settings, CPU fp16 autocast, scale(loss).backward -> unscale_ ->
clip_grad_norm_ -> step -> update -> close() -> report()). Each failure is proven first by the test's own oracle
(`Oracle`: probe_harness.Producer's forward hooks on every module, parametrization modules included, keyword inputs
checked, counting calls, and reading dataclass outputs field by field): the first (module, step, call) whose output
is non-finite while its inputs and own parameters were finite; the loss first non-finite at that step, the scaler
skipping it (before it only the opening backoffs, steps 0-2). A failing oracle is a plain failure. Only then must
overflow / nan_origin (warning or error) be among the first three findings at the PRODUCER, at that step; a wrong
report raises WrongAnswer (strict xfail via `wrong`) naming ampdoctor's top three.

Cases (the bad step is 5 unless said):
 1. towers: one squared-ReLU encoder instance is module 0 of `tower_a` AND of `tower_b` (named_modules: `tower_a.0`);
    only tower_b's input (the second sensor, raw x300) overflows, i.e. the encoder's 2nd call -> `tower_a.0`.
 2. tied_head: GPT-style LM, `lm_head.weight = emb.weight`; new special tokens' rows initialised with std 3e3 (a
    typo for 3e-3) are used from step 5: emb/blocks/ln_f finite, the tied projection's mm passes 65504 -> `lm_head`.
 3. tied_root: the same, the tied projection written as F.linear(ln_f(h), emb.weight) in the root -> `` (root).
 4. lora_wrapper: PEFT-style LoraLinear(base, lora_A, lora_B) whose adapter is swapped at step 5 for one saved with
    scaling = lora_alpha (4096) instead of alpha / r: base, lora_A, lora_B all finite, the wrapper's `* scaling`
    overflows -> `blocks.1.fc1` (the wrapper, not a child).
 5. lora_parent: A/B Linears of a LoRA added in the block's own forward (fc1(x) + fc1_B(fc1_A(x)) * s); at step 5 the
    adapter is loaded from a long run without weight decay (A, B ~ +-40): fc1_B's mm overflows -> `blocks.1.fc1_B`.
 6. lora_parametrize: a LoRA registered with parametrize.register_parametrization(fc1, "weight", LoRA(...)) whose
    B @ A (autocast mm, fp16) overflows after the adapter is loaded with A, B ~ +-150 -> the parametrization module
    `blocks.1.fc1.parametrizations.weight.0` (not the Linear it feeds).
 7. moduledict: task heads in a ModuleDict picked per batch by a `task=` keyword (cls, reg, rank cycling); the rank
    head's Plackett-Luce exp(score) gets a batch of un-normalised features (x200) at step 8 -> `heads.rank`.
 8. nested: Sequential(Sequential(Linear, GELU), Sequential(DenseCat(Sequential(Linear, SquaredReLU)), LayerNorm),
    ...): SWA sums 300 snapshots of `1.0.f.0` instead of averaging them; the squared ReLU overflows, the concatenation
    passes the inf on and the LayerNorm turns it into NaN -> `1.0.f.1` (not `1.1`, not `1.0`).
 9. dataclass: MoE blocks returning BlockOut(hidden, z) (router logit penalty z = mean(logits * logits) in fp16);
    blocks.1's router restored with std 60: hidden finite, only z is inf -> `blocks.1` (its router, experts finite).
Healthy twins (the fix applied; no warning, no error): 10. towers with tower_b's input normalised, 11. tied_head with
std 3e-3, 12. lora_wrapper with scaling alpha / r, 13. dataclass with z computed in float32.

Result when written: 14 pass, 0 xfail (9 failures, 4 twins, 1 oracle self-test; stable over two runs, ~5 s).
Top finding per case, each `[error]` forward at the oracle's step, then `skipped_steps` (scaler) there:
overflow at tower_a.0 aten::mul (its 2nd call); lm_head aten::mm; (root) aten::mm; blocks.1.fc1 aten::mul;
blocks.1.fc1_B aten::mm; blocks.1.fc1.parametrizations.weight.0 aten::mm; heads.rank aten::exp step 8; 1.0.f.1
aten::mul; blocks.1 aten::mul. Twins: no warning, no error.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from probe_harness import Producer, WrongAnswer, at_top3, real_fwd_after_backoffs, wrong
from scenarios import alarms, lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FWD = ("overflow", "nan_origin")
BAD = 5


def fin(x):
    """Like probe_harness.finite, dataclass fields included."""
    if torch.is_tensor(x):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return all(fin(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, (tuple, list)):
        return all(fin(t) for t in x)
    if isinstance(x, dict):
        return all(fin(t) for t in x.values())
    return True


class Oracle(Producer):
    """probe_harness.Producer (with_kwargs, call_in_first), its finiteness check reading dataclass outputs too."""

    def __init__(self, m):
        super().__init__(m, with_kwargs=True, call_in_first=True)

    def _fwd(self, n):
        def f(mod, args, kwargs, out):
            k = self.calls[(n, self.step)] = self.calls.get((n, self.step), 0) + 1
            if self.first is None and fin(args) and fin(kwargs) and not fin(out):
                if all(torch.isfinite(p).all() for p in mod.parameters(recurse=False)):
                    self.first = (n, self.step, k)
        return f


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} {f.op} step {f.step} {f.phase} [{f.severity}]"
            for f in rep.findings[:3]]


def run(case, tmp_path):
    torch.manual_seed(0)
    m, batch, loss_fn, inject, steps = case()
    return probe_run(m, batch, loss_fn, steps, tmp_path, inject)


def probe_run(m, batch, loss_fn, steps, tmp_path, inject):
    from probe_harness import probe_run as pr
    return pr(m, batch, loss_fn, steps, tmp_path / "run", oracle=Oracle, inject=inject, lr=3e-3)


def check_failure(r, name, step, call=1):
    real_fwd_after_backoffs(r, name, step, call)
    rep = r["rep"]
    try:
        at_top3(rep, FWD, name, step=step, severity=("warning", "error"))
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} ({str(e)[:600]})") from None


def check_twin(r):
    """The twin was healthy (every loss finite, no producer, no skip after the opening backoffs, and it learned after
    the step-5 change: the last three losses below 0.9x those of steps 5-7); then ampdoctor quiet (WrongAnswer)."""
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and r["first"] is None, r
    assert [s for s in r["skipped"] if s >= 3] == [], r["skipped"]
    assert sum(ls[-3:]) < 0.9 * sum(ls[BAD:BAD + 3]), ls
    rep = r["rep"]
    if r["warns"] or alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm: top3={top3(rep)} warns={r['warns']} {lines(rep)}")


def mse(out, y):
    return F.mse_loss(out.float(), y)


# ------------------------------------------------------------------------------------------------ 1. two towers
class SqEnc(nn.Module):
    """Primer-style feature encoder: relu(fc(x))**2 (written as h * h, fp16 under autocast)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return h * h


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        enc = SqEnc()
        self.tower_a = nn.Sequential(enc, nn.Linear(32, 8))
        self.tower_b = nn.Sequential(enc, nn.Linear(32, 8))     # the same instance: named `tower_a.0` only
        self.head = nn.Linear(16, 1)

    def forward(self, xa, xb):
        return self.head(torch.cat([self.tower_a(xa), self.tower_b(xb)], -1))


WA, WB = randn(16, 1, seed=901) * 0.3, randn(16, 1, seed=902) * 0.3


def towers(fixed=False):
    def make():
        m = Towers()

        def batch(i):
            xa, xb = randn(32, 16, seed=100 + i), randn(32, 16, seed=200 + i)
            y = (xa @ WA + xb @ WB).tanh()
            raw = xb * 300.0 if i >= BAD else xb        # the second sensor's driver update: raw counts
            return (xa, raw / 300.0 if fixed and i >= BAD else raw), y
        return m, batch, mse, None, 12
    return make


# ------------------------------------------------------------------------------------------------ 2./3. tied LM
V, D = 64, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TiedLM(nn.Module):
    def __init__(self, root_proj=False):
        super().__init__()
        self.root_proj = root_proj
        self.emb = nn.Embedding(V, D)
        nn.init.normal_(self.emb.weight, std=0.02)          # GPT-2's init
        self.blocks = nn.Sequential(Block(), Block())
        self.ln_f = nn.LayerNorm(D)
        if not root_proj:
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.emb.weight           # tied

    def forward(self, idx):
        h = self.ln_f(self.blocks(self.emb(idx)))
        return F.linear(h, self.emb.weight) if self.root_proj else self.lm_head(h)


def tied(root_proj=False, std=3e3):
    def make():
        m = TiedLM(root_proj)

        def inject(i, m):
            if i == BAD:                                    # the new special tokens 60..63 get their rows
                m.emb.weight[60:] = randn(4, D, seed=77) * std

        def batch(i):
            hi = V if i >= BAD else 60
            idx = torch.randint(0, hi, (8, 12), generator=torch.Generator().manual_seed(300 + i))
            return (idx,), (idx * 7 + 3) % 60

        def loss_fn(out, y):
            return F.cross_entropy(out.float().reshape(-1, V), y.reshape(-1))
        return m, batch, loss_fn, inject, 20 if std < 1 else 10
    return make


# ------------------------------------------------------------------------------------------------ 4. LoRA wrapper
class LoraLinear(nn.Module):
    """PEFT-style: base(x) + lora_B(lora_A(x)) * scaling, the base frozen."""

    def __init__(self, d_in, d_out, r=4, alpha=8):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(d_in, r, bias=False), nn.Linear(r, d_out, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


class LoraBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), LoraLinear(D, 2 * D), LoraLinear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class LoraNet(nn.Module):
    def __init__(self, block=LoraBlock):
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.Sequential(block(), block())
        self.out = nn.Linear(D, 1)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


W16 = randn(16, 1, seed=903) * 0.3


def reg_batch(i):
    x = randn(32, 16, seed=400 + i)
    return (x,), (x @ W16).tanh()


def lora_wrapper():
    def make():
        m = LoraNet()

        def inject(i, m):
            if i == BAD:                                    # the task adapter is swapped in
                fc = m.blocks[1].fc1
                fc.lora_A.weight.copy_(randn(4, D, seed=78) * 0.2)
                fc.lora_B.weight.copy_(randn(2 * D, 4, seed=79) * 5)
                fc.scaling = 4096.0                         # lora_alpha instead of lora_alpha / r
        return m, reg_batch, mse, inject, 12
    return make


# ------------------------------------------------------------------------------------------------ 5. LoRA in the parent
class ParentLoraBlock(nn.Module):
    def __init__(self, r=4):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.fc1.requires_grad_(False)
        self.fc1_A, self.fc1_B = nn.Linear(D, r, bias=False), nn.Linear(r, 2 * D, bias=False)
        nn.init.zeros_(self.fc1_B.weight)
        self.s = 2.0

    def forward(self, x):
        z = self.ln(x)
        h = self.fc1(z) + self.fc1_B(self.fc1_A(z)) * self.s
        return x + self.fc2(F.gelu(h))


def lora_parent():
    m = LoraNet(ParentLoraBlock)

    def inject(i, m):
        if i == BAD:
            b = m.blocks[1]
            b.fc1_A.weight.copy_(randn(4, D, seed=80) * 40)
            b.fc1_B.weight.copy_(randn(2 * D, 4, seed=81) * 40)
    return m, reg_batch, mse, inject, 10


# ------------------------------------------------------------------------------------------------ 6. LoRA parametrization
class LoRAParam(nn.Module):
    """minLoRA-style: W + (B @ A) * alpha / r, B @ A a matmul (fp16 under autocast)."""

    def __init__(self, d_out, d_in, r=8, alpha=16):
        super().__init__()
        self.A = nn.Parameter(randn(r, d_in, seed=82) * 0.1)
        self.B = nn.Parameter(torch.zeros(d_out, r))
        self.scale = alpha / r

    def forward(self, W):
        return W + (self.B @ self.A) * self.scale


def lora_parametrize():
    m = LoraNet(Block)
    for b in m.blocks:
        for lin in (b.fc1, b.fc2):
            lin.weight.requires_grad_(False)
            parametrize.register_parametrization(lin, "weight", LoRAParam(*lin.weight.shape))

    def inject(i, m):
        if i == BAD:
            p = m.blocks[1].fc1.parametrizations.weight[0]
            p.A.copy_(randn(*p.A.shape, seed=83) * 150)
            p.B.copy_(randn(*p.B.shape, seed=84) * 150)
    return m, reg_batch, mse, inject, 10


# ------------------------------------------------------------------------------------------------ 7. ModuleDict heads
class RankHead(nn.Module):
    """Plackett-Luce strengths exp(score) (fp16 score from the Linear: exp stays fp16)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 1)

    def forward(self, h):
        return torch.exp(self.proj(h)).squeeze(-1)


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.heads = nn.ModuleDict({"cls": nn.Linear(32, 4), "reg": nn.Linear(32, 1), "rank": RankHead()})

    def forward(self, x, task):
        return self.heads[task](self.trunk(x))


TASKS = ("cls", "reg", "rank")
RANK_BAD = 8


def moduledict():
    m = MultiTask()

    def batch(i):
        task = TASKS[i % 3]
        x = randn(16, 16, seed=500 + i) * (200.0 if i == RANK_BAD else 1.0)
        y = (x[:, :4].argmax(-1) if task == "cls" else x[:, :1].tanh() if task == "reg" else x[:, 0].argsort())
        return (x,), {"task": task}, (task, y)

    def loss_fn(out, ty):
        task, y = ty
        out = out.float()
        if task == "cls":
            return F.cross_entropy(out, y)
        if task == "reg":
            return F.mse_loss(out, y)
        s = out[y]                                          # ListMLE on the strengths
        tail = torch.flip(torch.cumsum(torch.flip(s, [0]), 0), [0])
        return (torch.log(tail) - torch.log(s)).mean()
    return m, batch, loss_fn, None, 10


# ------------------------------------------------------------------------------------------------ 8. nested Sequentials
class SquaredReLU(nn.Module):
    def forward(self, x):
        r = torch.relu(x)
        return r * r


class DenseCat(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return torch.cat([x, self.f(x)], -1)


def nested(fixed=False):
    return lambda: _nested(fixed)


def _nested(fixed):
    m = nn.Sequential(
        nn.Sequential(nn.Linear(16, 32), nn.GELU()),
        nn.Sequential(DenseCat(nn.Sequential(nn.Linear(32, 32), SquaredReLU())), nn.LayerNorm(64)),
        nn.Sequential(nn.Sequential(nn.Linear(64, 32), nn.GELU()), nn.Linear(32, 1)))

    def inject(i, m):
        if i == BAD and not fixed:                          # SWA: the sum of 300 snapshots, not their mean
            m[1][0].f[0].weight.mul_(300.0)
            m[1][0].f[0].bias.mul_(300.0)
    return m, reg_batch, mse, inject, 20 if fixed else 10


# ------------------------------------------------------------------------------------------------ 9. dataclass outputs
@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    z: torch.Tensor


class MoEBlock(nn.Module):
    def __init__(self, E=4):
        super().__init__()
        self.ln, self.router = nn.LayerNorm(D), nn.Linear(D, E)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x):
        z_in = self.ln(x)
        logits = self.router(z_in)
        gate = torch.softmax(logits.float(), -1)
        h = x + sum(gate[..., e:e + 1] * ex(z_in).float() for e, ex in enumerate(self.experts))
        return BlockOut(h, (logits * logits).mean())


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.out = nn.Linear(D, 1)

    def forward(self, x):
        h, zs = self.inp(x), []
        for b in self.blocks:
            o = b(h)
            h = o.hidden
            zs.append(o.z)
        return self.out(h), torch.stack([z.float() for z in zs]).sum()


def dataclass_out(fixed=False):
    def make():
        m = MoENet()

        def inject(i, m):
            if i == BAD:
                m.blocks[1].router.weight.copy_(randn(4, D, seed=85) * (0.06 if fixed else 60))

        def loss_fn(out, y):
            pred, z = out
            return F.mse_loss(pred.float(), y) + 1e-3 * z
        return m, reg_batch, loss_fn, inject, 20 if fixed else 12
    return make


# ------------------------------------------------------------------------------------------------ the tests
FAILURES = {
    "towers": (towers(), "tower_a.0", BAD, 2),
    "tied_head": (tied(), "lm_head", BAD, 1),
    "tied_root": (tied(root_proj=True), "", BAD, 1),
    "lora_wrapper": (lora_wrapper(), "blocks.1.fc1", BAD, 1),
    "lora_parent": (lora_parent, "blocks.1.fc1_B", BAD, 1),
    "lora_parametrize": (lora_parametrize, "blocks.1.fc1.parametrizations.weight.0", BAD, 1),
    "moduledict": (moduledict, "heads.rank", RANK_BAD, 1),
    "nested": (nested(), "1.0.f.1", BAD, 1),
    "dataclass": (dataclass_out(), "blocks.1", BAD, 1),
}
WRONG = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[wrong(WRONG[n])] if n in WRONG else []) for n in FAILURES])
def test_failure_named_at_the_producer(tmp_path, name):
    case, producer, step, call = FAILURES[name]
    check_failure(run(case, tmp_path), producer, step, call)


TWINS = {
    "towers_fixed": towers(fixed=True),
    "tied_head_fixed": tied(std=3e-3),
    "nested_swa_mean": nested(fixed=True),
    "dataclass_router_std_fixed": dataclass_out(fixed=True),
}
WRONG_TWIN = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[wrong(WRONG_TWIN[n])] if n in WRONG_TWIN else [])
                                  for n in TWINS])
def test_healthy_twin_is_quiet(tmp_path, name):
    check_twin(run(TWINS[name], tmp_path))


def test_oracle_sees_dataclass_fields():
    """The oracle's own check is not blind to a dataclass whose only non-finite value is a field."""
    assert not fin(BlockOut(torch.zeros(2), torch.tensor(math.inf)))
    assert fin(BlockOut(torch.zeros(2), torch.tensor(1.0)))
