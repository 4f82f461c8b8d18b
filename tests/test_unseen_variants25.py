"""Twenty-fifth set: fp16 failures whose PRODUCER is easy to take for a PROPAGATOR (or the reverse), each checked twice:
at ampdoctor's default sampling (watch(model, optimizer=, scaler=, run_dir=) -> the ordinary fp16 autocast +
GradScaler("cpu") loop -> w.report()), and through the capture/replay workflow: the watch writes the first bad step's
capture to `run_dir/captures/<step>/` by itself, and that capture is replayed by the CLI (`ampdoctor replay CAPTURE
--model test_unseen_variants25:<factory> --json F`, `--loss` only where README says a loss_fn helps). Every failure
starts mid-run (step 3, 4 or 5) from the data; tiny models (d = 32), 8 steps, loss scale 1024.

 1. residual_child    LLaMA-style blocks `x + mlp(x)` with a SwiGLU mlp (w2(silu(w1 x) * w3 x)) on tabular rows; one
                      row in raw units (x200) at step 4: the product in blocks.1.mlp's own forward overflows (quadratic
                      in the scale; blocks.0's product stays ~5e3) -> overflow at `blocks.1.mlp` (aten::mul), not its
                      parent `blocks.1` (the residual add), not `blocks.1.mlp.w2` (fed the inf), not `blocks.2`;
 2. matmul_then_norm  timm-style PatchEmbed(norm_layer=LayerNorm) with its own matmul: a 16-bit depth map in mm (2e4 -
                      3e4, not normalised) at step 5; the product overflows, the LayerNorm child turns +-inf into NaN ->
                      overflow at `embed` (aten::mm), never nan_origin at `embed.norm` or `embed`;
 3. sqrt_backward     an RMS-energy feature sqrt(mean(h * h)) (audio front-ends) on a dithered digital-silence clip
                      (1e-5) at step 4: h * h is all 0 in fp16 (not in fp32), the forward is finite (sqrt(0) = 0), and
                      SqrtBackward0's 1 / (2 sqrt(0)) is inf -> overflow/nan_origin at `energy`, phase backward;
 4. shared_second_call ALBERT-style: one block (the SwiGLU of 1) applied three times per forward; at step 4 its first
                      call is finite and its second overflows -> overflow at `layer.mlp` (call 2), not `layer`;
 5. free_function     the Annotated Transformer's free function `attention()` (q @ k^T before / sqrt(d_k)) called from
                      MultiHeadedAttention.forward; a token in raw units (x1000) at step 3 -> overflow at the enclosing
                      `layers.0.attn` with a matmul op (aten::bmm), not softmax, not `linears.3` or the next layer;
 6. loss_outside      SimCLR's NT-Xent written by hand outside the model (tau = 0.07, exp(sim / tau) without the max):
                      the augmentation worker falls back to identity at step 4 (x2 == x1, cos = 1, exp(14.3) = inf in
                      fp16) -> overflow at module null (the loss computation), phase forward; the replay with
                      `--loss test_unseen_variants25:nt_xent` names aten::exp;
 7. two_producers     a multi-field tabular encoder (one FieldEncoder per field, blocks 0-2, in forward order): at step
                      5 field 0 and field 2 both arrive in raw units (1e5 - 4e5 > 65504, cast inside each fc1) -> the
                      first producer first: overflow at `blocks.0.fc1` among the first three and before any finding at
                      blocks.2; and (second test) blocks.2.fc1, an independent root cause, should be named too.

Oracles, before anything ampdoctor says: probe_harness.Producer's forward hooks (with call counts) name the innermost
module whose output turns non-finite from finite inputs and own parameters, at the bad step (for 3 its backward hooks
name `energy` as the first module whose input gradient is non-finite while the gradient reaching it was finite, the
forward and the loss finite; for 6 no module's output is non-finite while the loss is); the scaler's first skip is
that step; exactly one capture, of that step; an unwatched fresh model with that step's weights re-runs the batch:
fp16 fails, fp32 is finite (loss and every gradient); plus each case's mechanism (2: the norm's input holds +-inf and
no NaN, its output NaN; 3: h * h of the silent clip is all zero in fp16 only; 6: the model's outputs are finite and
exp(z1 @ z2^T / 0.07) is not; 7: blocks.0.fc1 and blocks.2.fc1 each fail from a finite input, blocks.1.fc1 does not).
Then w.report() and the replay's JSON must hold an error of the rule at the producer (with an op of the right kind
where they name one) among their first three findings, at that step and phase, no error at the propagators, and the
replay must exit 1 (errors found), not 2. The seven replays run in one fresh process that forks a child per capture
running the CLI's main(argv) (what `python -m ampdoctor` runs; torch imported once keeps the file under 25 s); a
literal `python -m ampdoctor replay` of case 1's capture must say the same. Same results with
ONEDNN_MAX_CPU_ISA=AVX2 and AVX512_CORE_BF16.

What ampdoctor got wrong (both fixed since):
- test_two_producers_the_second_is_named_too: at step 5 both blocks.0.fc1 and blocks.2.fc1 overflow from finite
  inputs (independent fields); w.report() and the replay named only `overflow at blocks.0.fc1`, nothing of
  blocks.2.fc1. replay/explain.py build_findings now lists such further producers with the first finding
  (evidence.also_producers and its message) rather than as findings of their own, which would bury the top three
  under a defect repeated in every layer.
Fixed since: test_replay_without_loss_fn_dates_the_loss_outside_to_the_forward (replaying case 6's capture without
--loss said phase backward though the capture's manifest holds `extra.loss_finite: false`; replay/__init__.py's
_outside_loss_finding now dates it to the forward when the capture says the loss itself was not finite).
Right: all seven, from the watch at the default sampling and from the replay of their capture: 1 overflow at
blocks.1.mlp aten::mul step 4; 2 overflow at embed aten::mm step 5; 3 overflow at energy aten::div (SqrtBackward0)
step 4 backward; 4 overflow at layer.mlp aten::mul step 4; 5 overflow at layers.0.attn aten::bmm step 3; 6 overflow at
module null step 4 forward (replay with --loss: aten::exp); 7 overflow at blocks.0.fc1 aten::_to_copy step 5 first.
Replays exit 1; `python -m ampdoctor replay` agrees with the forked CLI.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, at_top3, finite
from scenarios import lines, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BAD = ("overflow", "nan_origin")
D = 32


def _g(seed):
    return torch.Generator().manual_seed(seed)


# -- 1. LLaMA-style residual blocks x + mlp(x), mlp a SwiGLU; one sample in raw units at step 4 ---------------------
class SwiGLU(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d, bias=False)
        self.w3 = nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))     # the product is quadratic in x's scale


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.mlp = SwiGLU(d)

    def forward(self, x):
        return x + self.mlp(x)                                 # the parent only adds


class TabularResNet(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_resnet():
    torch.manual_seed(0)
    return TabularResNet()


def resnet_batch(i):
    x = torch.randn(16, 8, generator=_g(i))
    if i == 4:
        x[3] *= 200.0                                # one row in raw units
    return (x, torch.randn(16, 1, generator=_g(100 + i)))


def mse(out, x, y):
    return (out.float() - y).pow(2).mean()


# -- 2. ViT-style patch embedding: its own matmul, then its own LayerNorm; a 16-bit depth map at step 5 ----------
class PatchEmbed(nn.Module):
    def __init__(self, p=48, d=D):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, p) * 0.2)
        self.bias = nn.Parameter(torch.zeros(d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = torch.matmul(x, self.weight.t()) + self.bias   # the product overflows
        return self.norm(h)                                # inf -> NaN here: a propagator


class PatchNet(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.embed = PatchEmbed(48, d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.mlp(self.embed(x)).mean(1))


def make_patchnet():
    torch.manual_seed(0)
    return PatchNet()


def patch_batch(i):
    x = torch.randn(4, 9, 48, generator=_g(i))
    if i == 5:
        x[1] = 20000.0 + 10000.0 * torch.rand(9, 48, generator=_g(7))   # raw depth in mm, not normalised
    return (x, torch.randint(0, 4, (4,), generator=_g(50 + i)))


def ce(out, x, y):
    return F.cross_entropy(out.float(), y)


# -- 3. backward only: an RMS-energy feature sqrt(mean(h*h)) on a near-silent frame (h*h underflows to 0) ------------
class FrameEnergy(nn.Module):
    def __init__(self, n=16, d=D):
        super().__init__()
        self.proj = nn.Linear(n, d, bias=False)

    def forward(self, x):
        h = self.proj(x)
        e = (h * h).mean(-1, keepdim=True).sqrt()      # sqrt(0): forward 0, backward 1/0
        return torch.cat([h, e], -1)


class FrameNet(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.inp = nn.Linear(16, 16, bias=False)     # a learnable filterbank
        self.energy = FrameEnergy(16, d)
        self.mix = nn.Linear(d + 1, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(F.relu(self.mix(self.energy(self.inp(x)))).mean(1))


def make_framenet():
    torch.manual_seed(0)
    return FrameNet()


def frame_batch(i):
    x = torch.randn(4, 6, 16, generator=_g(i))
    if i == 4:
        x[2] = 1e-5 * torch.randn(6, 16, generator=_g(9))   # digital silence with dither
    return (x, torch.randint(0, 3, (4,), generator=_g(60 + i)))


# -- 4. ALBERT-style: one block applied three times (weights shared across depth); only its 2nd call overflows -------
class SharedDepth(nn.Module):
    def __init__(self, d=D, n=3):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layer = Block(d)                       # one set of weights, called n times per forward
        self.n = n
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.n):
            h = self.layer(h)
        return self.head(h)


def make_shared():
    torch.manual_seed(0)
    return SharedDepth()


def shared_batch(i):
    x = torch.randn(16, 8, generator=_g(i))
    if i == 4:
        x[5] *= 200.0
    return (x, torch.randn(16, 1, generator=_g(300 + i)))


# -- 5. the Annotated Transformer's free function `attention()`: q @ k^T before the 1/sqrt(d_k) --------------------
def attention(query, key, value):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h=4, d=D):
        super().__init__()
        self.d_k, self.h = d // h, h
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, query, key, value):
        B = query.size(0)
        query, key, value = [lin(x).view(B, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value))]
        x, _ = attention(query, key, value)
        return self.linears[-1](x.transpose(1, 2).contiguous().view(B, -1, self.h * self.d_k))


class EncoderLayer(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.attn = MultiHeadedAttention(4, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(x, x, x)
        return x + self.ff(x)


class SeqTagger(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList(EncoderLayer(d) for _ in range(2))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_tagger():
    torch.manual_seed(0)
    return SeqTagger()


def tag_batch(i):
    x = torch.randn(4, 10, 8, generator=_g(i))
    if i == 3:
        x[0, 2] = 1000.0 * torch.randn(8, generator=_g(0))      # one token's features in raw units
    return (x, torch.randint(0, 5, (4, 10), generator=_g(70 + i)))


def tag_ce(out, x, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


# -- 6. SimCLR's NT-Xent written by hand outside the model, tau = 0.07: exp(cos / tau) overflows at cos > 0.78 -------
class ContrastiveEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 128, bias=False))

    def forward(self, x1, x2):
        return F.normalize(self.net(x1).float(), dim=-1), F.normalize(self.net(x2).float(), dim=-1)


def make_contrastive():
    torch.manual_seed(0)
    return ContrastiveEncoder()


def nt_xent(out, *args, tau=0.07):
    z1, z2 = out
    sim = z1 @ z2.t() / tau
    return (torch.log(torch.exp(sim).sum(1)) - sim.diagonal()).mean()


def view_batch(i):
    x = torch.randn(8, 128, generator=_g(i))
    x1 = x + 2.0 * torch.randn(8, 128, generator=_g(400 + i))       # two strong augmentations
    x2 = x + 2.0 * torch.randn(8, 128, generator=_g(500 + i))
    if i == 4:
        x2 = x1.clone()                                             # the augmentation worker fell back to identity
    return (x1, x2)


# -- 7. a multi-field tabular encoder: field 0 and field 2 both arrive in raw units at step 5 --------------------
class FieldEncoder(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, d), nn.Linear(d, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class MultiField(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.blocks = nn.ModuleList(FieldEncoder(d) for _ in range(3))
        self.head = nn.Linear(3 * d, 1)

    def forward(self, x):
        return self.head(torch.cat([b(x[:, i]) for i, b in enumerate(self.blocks)], -1))


def make_multifield():
    torch.manual_seed(0)
    return MultiField()


def field_batch(i):
    x = torch.randn(16, 3, 4, generator=_g(i))
    if i == 5:
        x[2, 0] = 3.0e5 * torch.rand(4, generator=_g(11)) + 1.0e5   # field 0 in raw units
        x[9, 2] = 3.0e5 * torch.rand(4, generator=_g(12)) + 1.0e5   # field 2 in raw units
    return (x, torch.randn(16, 1, generator=_g(600 + i)))


# -- harness ---------------------------------------------------------------------------------------------------
CASES = {  # name: (factory, batch, loss, number of model inputs, bad step, the producer, its call, phase, rules)
    "residual_child": ("make_resnet", resnet_batch, mse, 1, 4, "blocks.1.mlp", 1, "forward", ("overflow",)),
    "matmul_then_norm": ("make_patchnet", patch_batch, ce, 1, 5, "embed", 1, "forward", ("overflow",)),
    "sqrt_backward": ("make_framenet", frame_batch, ce, 1, 4, "energy", None, "backward", BAD),
    "shared_second_call": ("make_shared", shared_batch, mse, 1, 4, "layer.mlp", 2, "forward", ("overflow",)),
    "free_function": ("make_tagger", tag_batch, tag_ce, 1, 3, "layers.0.attn", 1, "forward", ("overflow",)),
    "loss_outside": ("make_contrastive", view_batch, nt_xent, 2, 4, None, None, "forward", ("overflow",)),
    "two_producers": ("make_multifield", field_batch, mse, 1, 5, "blocks.0.fc1", 1, "forward", ("overflow",)),
}
# modules that only pass the case's inf/NaN on (no error may name them)
PROPAGATORS = {
    "residual_child": ["blocks.1", "blocks.1.mlp.w2", "blocks.2", "blocks.2.mlp", "head", ""],
    "matmul_then_norm": ["embed.norm", "mlp", "mlp.0", "head", ""],
    "sqrt_backward": ["energy.proj", "inp", "mix", "head", ""],
    "shared_second_call": ["layer", "layer.mlp.w2", "head", ""],
    "free_function": ["layers.0.attn.linears.3", "layers.0", "layers.1", "layers.1.attn", "head", ""],
    "loss_outside": ["net", "net.0", "net.2", ""],
    "two_producers": ["blocks.0.fc2", "blocks.0", "head", ""],
}
STEPS = 8


def run(name, rd):
    """The user's loop (AdamW, GradScaler("cpu", 1024), fp16 autocast, unscale_ + clip) under watch(run_dir=rd) at the
    default sampling, with the forward/backward producer oracle (probe_harness.Producer) beside it."""
    factory, batch, loss_fn, n_in = CASES[name][:4]
    torch.manual_seed(0)
    m = globals()[factory]()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    prod = Producer(m, backward=True, call_in_first=True)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=rd)
    r = dict(skipped=[], bad_loss=[], states={}, losses=[], rd=rd)
    for i in range(STEPS):
        prod.new_step(i)
        r["states"][i] = {k: v.detach().clone() for k, v in m.state_dict().items()}
        opt.zero_grad()
        args = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(m(*args[:n_in]), *args)
        r["losses"].append(loss.item())
        if not torch.isfinite(loss):
            r["bad_loss"].append(i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < before:
            r["skipped"].append(i)
    prod.remove()                      # before close(), whose replay of the capture runs the model again
    w.close()
    r.update(w=w, first=prod.first, first_bwd=prod.first_bwd, report=w.report())
    return r


def rerun(name, step, r, fp16=True, hooks=()):
    """An unwatched fresh model with step `step`'s weights runs that step's batch forward and backward (fp16 autocast or
    fp32); `hooks` are (module name, forward hook). Returns (loss, grads finite)."""
    factory, batch, loss_fn, n_in = CASES[name][:4]
    m = globals()[factory]()
    m.load_state_dict(r["states"][step])
    hs = [m.get_submodule(n).register_forward_hook(h) for n, h in hooks]
    args = batch(step)
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        loss = loss_fn(m(*args[:n_in]), *args)
    loss.backward()
    for h in hs:
        h.remove()
    return loss, all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("v25")
    return {name: run(name, base / name) for name in CASES}


def replay_argv(name, r, out, loss=True):
    """`ampdoctor replay <run_dir>/captures/<bad step> --model test_unseen_variants25:<factory> --json <out>` (with
    --loss for the loss outside the model, unless not `loss`: README, "replay")."""
    cap = r["rd"] / "captures" / str(CASES[name][4])
    argv = ["replay", str(cap), "--model", f"test_unseen_variants25:{CASES[name][0]}", "--json", str(out), "--no-html"]
    return argv + (["--loss", "test_unseen_variants25:nt_xent"] if name == "loss_outside" and loss else [])


# One fresh process imports torch and ampdoctor once and forks a child per capture, which runs the CLI's main(argv)
# (what `python -m ampdoctor` runs: `raise SystemExit(main())`) and exits with its code: each replay in a process of its
# own, without paying torch's import seven times (the file stays under 25 s on one core).
FORK_CLI = r"""
import json, os, sys, traceback
import torch
import ampdoctor.replay
import test_unseen_variants25
from ampdoctor.cli import main
codes = {}
for name, argv in json.loads(sys.argv[1]).items():
    pid = os.fork()
    if pid == 0:
        try:
            code = main(argv)
        except BaseException:
            traceback.print_exc()
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    codes[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


def _py(args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1")
    env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def replays(runs, tmp_path_factory):
    """{case: (exit code, the replay's JSON or None, stderr)}; and "cli": the same for `python -m ampdoctor replay` of
    residual_child's capture, run as a user types it."""
    d = tmp_path_factory.mktemp("v25replay")
    jobs = {name: replay_argv(name, runs[name], d / f"{name}.json") for name in CASES}
    jobs["loss_outside_no_loss"] = replay_argv("loss_outside", runs["loss_outside"], d / "loss_outside_no_loss.json",
                                               loss=False)
    p = _py(["-c", FORK_CLI, json.dumps(jobs)], d)
    codes = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
    out = {name: (codes.get(name), _read(d / f"{name}.json"), p.stderr) for name in jobs}
    q = _py(["-m", "ampdoctor", *replay_argv("residual_child", runs["residual_child"], d / "cli.json")], d)
    out["cli"] = (q.returncode, _read(d / "cli.json"), q.stderr)
    return out


def _read(path):
    return json.loads(path.read_text()) if path.exists() else None


MATMUL = {"aten::mm", "aten::bmm", "aten::matmul", "aten::addmm", "aten::linear"}
OPS = {  # the ops a finding at the producer may name (None: the finding names none)
    "residual_child": {"aten::mul", None},
    "matmul_then_norm": MATMUL | {None},
    "sqrt_backward": None,                                  # any: SqrtBackward0's div, its pow, ...
    "shared_second_call": {"aten::mul", None},
    "free_function": MATMUL | {None},
    "loss_outside": {"aten::exp", None},
    "two_producers": MATMUL | {"aten::_to_copy", None},     # the autocast cast of 1e5 inside fc1, or its addmm
}


def _non_finite(t):
    return not bool(torch.isfinite(t).all())


def mechanism(name, r):
    """What makes each case what it is, shown on an unwatched re-run of the bad step."""
    bad = CASES[name][4]
    seen = {}

    def keep(key):
        def f(mod, inp, out):
            seen[key] = (inp[0].detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone())
        return f
    if name == "matmul_then_norm":          # the LayerNorm receives +-inf (no NaN) and makes NaN of it
        rerun(name, bad, r, hooks=[("embed.norm", keep("norm"))])
        i, o = seen["norm"]
        assert torch.isinf(i).any() and not torch.isnan(i).any() and torch.isnan(o).any()
    elif name == "sqrt_backward":           # h*h of the silent clip is all 0 in fp16, not in fp32
        for fp16 in (True, False):
            loss, grads_ok = rerun(name, bad, r, fp16=fp16, hooks=[("energy.proj", keep(fp16))])
            h = seen[fp16][1][2]                     # sample 2, the silent clip
            assert bool(((h * h).sum(-1) == 0).all()) == fp16 and bool(torch.isfinite(loss)) and grads_ok != fp16
    elif name == "loss_outside":            # the model's outputs are finite unit vectors; exp(cos / tau) is not
        rerun(name, bad, r, hooks=[("", lambda mod, inp, out: seen.update(out=out))])
        z1, z2 = seen["out"]
        assert finite((z1, z2))
        with torch.autocast("cpu", dtype=torch.float16):
            assert _non_finite(torch.exp(z1 @ z2.t() / 0.07))
    elif name == "two_producers":           # both raw fields overflow in their own encoder, each from finite input
        rerun(name, bad, r, hooks=[(f"blocks.{k}.fc1", keep(k)) for k in range(3)])
        assert [finite(seen[k][0]) and not finite(seen[k][1]) for k in range(3)] == [True, False, True]


@pytest.mark.parametrize("name", list(CASES))
def test_the_failure_is_real_and_the_watch_names_its_producer(runs, name):
    r = runs[name]
    _, _, _, _, bad, mod, call, phase, rules = CASES[name]
    # the oracle: the scaler skips the bad step first; one capture, of that step
    assert r["skipped"] and r["skipped"][0] == bad, r["skipped"]
    assert sorted(os.listdir(r["rd"] / "captures")) == [str(bad)]
    if phase == "backward":                 # forward and loss finite; the first non-finite gradient leaves `mod`
        assert r["first"] is None and bad not in r["bad_loss"] and r["first_bwd"] == (mod, bad), r["first_bwd"]
    elif mod is None:                       # no module's output is non-finite, the loss is
        assert r["first"] is None and r["bad_loss"][:1] == [bad], (r["first"], r["bad_loss"])
    else:                                   # the innermost module whose output turns non-finite from finite inputs
        assert r["first"] == (mod, bad, call) and r["bad_loss"][:1] == [bad], (r["first"], r["bad_loss"])
    assert all(map(math.isfinite, r["losses"][:bad]))
    loss32, grads32 = rerun(name, bad, r, fp16=False)
    assert bool(torch.isfinite(loss32)) and grads32, "the same step in fp32 is finite"
    loss16, grads16 = rerun(name, bad, r)
    assert _non_finite(loss16) or not grads16, "the unwatched fp16 re-run fails as the training step did"
    mechanism(name, r)
    # ampdoctor, at its default sampling
    rep = r["report"]
    f = at_top3(rep, rules, mod, step=bad, phase=phase, severity="error")
    if OPS[name] is not None:
        assert f.op in OPS[name], (f.one_line(), lines(rep))
    assert rep.exit_code == 1
    no_error_at(rep, PROPAGATORS[name])
    if name == "matmul_then_norm":
        nan = [g for g in rep.findings if g.rule == "nan_origin" and g.module in ("embed", "embed.norm")]
        assert not nan, lines(rep)
    if name == "two_producers":             # the first producer first
        idx = [k for k, g in enumerate(rep.findings) if g.module and g.module.startswith("blocks.")]
        assert idx and rep.findings[idx[0]].module == "blocks.0.fc1", lines(rep)


@pytest.mark.parametrize("name", list(CASES))
def test_the_replay_of_the_capture_names_its_producer(runs, replays, name):
    _, _, _, _, bad, mod, call, phase, rules = CASES[name]
    code, d, err = replays[name]
    assert code == 1 and d is not None, (code, err[-3000:])
    top = d["findings"][:3]
    hits = [f for f in top if f["module"] == mod and f["rule"] in rules and f["severity"] == "error"]
    assert hits, [(f["severity"], f["rule"], f["module"], f["op"], f["phase"]) for f in d["findings"]]
    f = hits[0]
    assert f["step"] == bad and f["phase"] == phase, f
    if OPS[name] is not None:
        assert f["op"] in OPS[name], f
    errs = [g for g in d["findings"] if g["severity"] == "error" and g["module"] in PROPAGATORS[name]]
    assert not errs, errs
    if name == "residual_child":            # `python -m ampdoctor replay`, as a user types it, says the same
        code, cli, err = replays["cli"]
        assert code == 1 and cli is not None, (code, err[-3000:])
        assert [_key(g) for g in cli["findings"]] == [_key(g) for g in d["findings"]]


def _key(f):
    return f["severity"], f["rule"], f["module"], f["op"], f["step"], f["phase"]


def test_two_producers_the_second_is_named_too(runs, replays):
    """blocks.2.fc1's overflow at step 5 is a producer of its own (finite input, its own raw field), not a consequence
    of blocks.0.fc1's: fixing block 0 alone leaves the run failing there. ampdoctor names the first producer as the
    finding and lists the others with it (`evidence.also_producers`, and in the message): a defect repeated in
    every layer (each block's own mask constant or decay; tests/test_unseen_variants19/23, test_unseen_arch) would
    otherwise fill the first three findings with copies of one cause."""
    rep = runs["two_producers"]["report"]
    d = replays["two_producers"][1]
    first = next(g for g in rep.findings if g.module == "blocks.0.fc1" and g.rule in BAD and g.step == 5)
    assert "blocks.2.fc1" in [x["module"] for x in first.evidence.get("also_producers", [])], first.evidence
    assert "blocks.2.fc1" in first.message, first.message
    top = next(g for g in d["findings"] if g["module"] == "blocks.0.fc1" and g["rule"] in BAD)
    assert "blocks.2.fc1" in [x["module"] for x in top["evidence"].get("also_producers", [])], top["evidence"]



def test_replay_without_loss_fn_dates_the_loss_outside_to_the_forward(runs, replays):
    """README: the capture keeps the gradient that reached the model's outputs, so the replay runs the step's own
    backward without a loss_fn; a loss that turned inf/NaN in the loss computation outside the model is module null,
    phase forward (the watch says so of this very step, and the capture records `loss_finite: false`)."""
    cap = runs["loss_outside"]["rd"] / "captures" / "4"
    assert json.loads((cap / "manifest.json").read_text())["extra"]["loss_finite"] is False
    code, d, err = replays["loss_outside_no_loss"]
    assert code == 1 and d is not None, (code, err[-3000:])
    top = [_key(f) for f in d["findings"][:3]]
    assert [k for k in top if k[0] == "error" and k[1] in BAD and k[2] is None and k[4] == 4], top
    assert [k for k in top if k[0] == "error" and k[1] in BAD and k[2] is None and k[5] == "forward"], top
