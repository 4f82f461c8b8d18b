"""Healthy runs at ampdoctor's DEFAULT settings (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`: headroom="auto",
the default sampling, the headroom_trend early warning) that hunt false alarms coming from HOW the training loop is
written rather than from the model: the loop shapes of real users' scripts.

Gradient accumulation stepping the scaler every 4 micro-batches while logging `scaler.get_scale()` every micro-batch
and the unscaled norm through `torch.nn.utils.get_total_norm` + `clip_grads_with_norm_`; an eval pass (model.eval(),
no_grad, autocast) every k steps on a model whose eval output differs (logits instead of a dict with a loss,
dropout/BatchNorm in eval mode); an fp32 validation pass without autocast; nanoGPT-style `zero_grad` after
`scaler.update()` (and zero_grad both before and after); `if not torch.isfinite(loss): continue` skipping all-padding
batches (cross-entropy over only ignore_index targets is NaN) before any backward; two backward passes per step with
`retain_graph=True`; `unscale_` then `clip_grad_norm_(error_if_nonfinite=False, foreach=True)`;
`torch.autocast(cache_enabled=False)` with a nested fp32 region; progressive unfreezing (`requires_grad_`) of layers
held by the optimizer from the start; the optimizer re-created at every epoch boundary while the scaler (and the
watch's first optimizer) stay; a checkpoint saved (model, optimizer, scaler) and loaded back mid-run; OneCycleLR with
a large peak on SGD; a DataLoader whose last batch of each epoch is smaller; a closure passed to `optimizer.step` in
bf16; `torch.set_grad_enabled(False)` inference calls between steps and a frozen teacher under the same autocast,
not watched; `w.report()` every 20 steps mid-run with a run_dir (and the CLI at the end); `w.close()` then a new watch
on the same model, optimizer and scaler; a generator data loader yielding int64 tokens and uint8 images normalised in
the model; a GradScaler (and autocast) switched off by a `use_amp=False` flag; a GradScaler kept with bf16 autocast
(`torch.autocast("cpu")`'s default dtype); the whole iteration (backward, step, update) inside autocast; FixMatch-style
pseudo-labels from the watched model under no_grad before its training forwards; dry-run scaled backwards without a
step before training (a batch-size finder); `p.grad = None` by hand with the skipped step read from the scale; two
optimizers on one scaler, both unscaled, one clip over all parameters.

Each run is an ordinary loop on the CPU (fp16 autocast with a real torch.amp.GradScaler("cpu"), bf16 without one where
said), first asserted healthy (every loss finite; the loss falls; the scaler backs off only at the start), then
judged: the report must hold no warning and no error (info is fine). A false alarm keeps its assertion under a strict
xfail that names the finding.

The optimizer re-created at each epoch boundary with the GradScaler kept (the watch given the first optimizer, or
none) was reported as a `clip_before_unscale` error on every step from the first re-creation on, although each
iteration unscales the optimizer that steps before `clip_grad_norm_` (a strict xfail first; fixed: a clip after
another optimizer's unscale_ is judged by which gradients no optimizer unscaled yet)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import TinyGPT, gen, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16


def alarms(rep):
    return [f.one_line() for f in rep.findings if f.severity in ("warning", "error")]


def quiet(rep):
    assert not alarms(rep) and rep.exit_code == 0, [f.one_line() for f in rep.findings]
    return rep


def cli_quiet(run_dir, tmp_path):
    """`python -m ampdoctor report RUN_DIR` exits 0 and its JSON holds no warning or error."""
    out = tmp_path / "cli.json"
    r = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(run_dir), "--json", str(out), "--no-html"],
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    bad = [f"{f['rule']}/{f['severity']}@{f['module']}" for f in json.loads(out.read_text())["findings"]
           if f["severity"] in ("warning", "error")]
    assert not bad, bad


def healthy(losses, scales=(), fall=0.8, k=5, max_backoffs=5):
    """Every loss finite; the mean of the last k below `fall` x the mean of the first k; at most `max_backoffs`
    scale decreases, at most one of them after the first quarter of the run."""
    assert all(map(math.isfinite, losses)), losses
    assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, losses
    drops = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]
    assert len(drops) <= max_backoffs, scales
    assert sum(i >= max(6, len(scales) // 4) for i in drops) <= 1, (drops, scales)


def mlp(*dims, act=nn.GELU, drop=0.0):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), act()] + ([nn.Dropout(drop)] if drop else [])
    return nn.Sequential(*layers[:-(2 if drop else 1)])


class Task:
    """A 10-class problem whose labels a linear map of 16-d inputs decides."""

    def __init__(self, seed=0, d=16, c=10):
        self.W = torch.randn(d, c, generator=gen(seed))
        self.d = d

    def batch(self, i, n=64):
        x = torch.randn(n, self.d, generator=gen(1000 + i))
        return x, (x @ self.W).argmax(1)


# -- accumulation, logging ------------------------------------------------------------------------------------------
def test_accumulation_steps_every_4_micro_batches_logs_scale_and_get_total_norm():
    """scaler.step/update only every 4th micro-batch (loss / 4); `scaler.get_scale()` logged after every micro-batch;
    on the boundary `unscale_`, the grad norm through `torch.nn.utils.get_total_norm` (logged) and
    `clip_grads_with_norm_` with that norm; zero_grad after the update. 30 optimizer steps, 120 micro-batches."""
    torch.manual_seed(0)
    t = Task(1)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales, norms, logged = [], [], [], []
    acc, run = 4, 0.0
    for i in range(120):
        x, y = t.batch(i, 32)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y) / acc
        sc.scale(loss).backward()
        run += loss.item()
        logged.append(sc.get_scale())
        if (i + 1) % acc == 0:
            sc.unscale_(opt)
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            torch.nn.utils.clip_grads_with_norm_(m.parameters(), 1.0, norm)
            norms.append(norm.item())
            sc.step(opt)
            sc.update()
            opt.zero_grad(set_to_none=True)
            losses.append(run)
            scales.append(sc.get_scale())
            run = 0.0
    w.close()
    healthy(losses, scales, fall=0.85)
    assert all(map(math.isfinite, norms[2:])), norms
    rep = quiet(w.report())
    assert rep.summary["steps"] == 30


# -- eval passes ----------------------------------------------------------------------------------------------------
class DropBNClassifier(nn.Module):
    """Dropout and BatchNorm; in training returns {"logits", "loss"} when given targets, in eval plain logits."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(128, 10)

    def forward(self, x, y=None):
        logits = self.head(self.body(x))
        if not self.training or y is None:
            return logits
        return {"logits": logits, "loss": F.cross_entropy(logits.float(), y)}


@pytest.mark.parametrize("val", ["autocast", "fp32"])
def test_eval_pass_every_5_steps_model_returns_logits_in_eval(val):
    """Every 5 steps: model.eval(), a validation pass over 4 batches under torch.no_grad() (under the same fp16
    autocast, or in plain fp32 without autocast), accuracy computed, model.train() again. The model returns a dict
    with its loss in training and bare logits in eval (dropout off, BatchNorm on running stats)."""
    torch.manual_seed(1)
    t = Task(2)
    m = DropBNClassifier()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales, accs = [], [], []
    for i in range(60):
        m.train()
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = m(x, y)["loss"]
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
        if i % 5 == 4:
            m.eval()
            correct = 0
            with torch.no_grad(), torch.autocast("cpu", dtype=FP16, enabled=(val == "autocast")):
                for j in range(4):
                    xv, yv = t.batch(50_000 + j, 128)
                    correct += (m(xv).argmax(1) == yv).sum().item()
            accs.append(correct / 512)
            m.train()
    w.close()
    healthy(losses, scales, fall=0.85)
    assert accs[-1] > accs[0] and accs[-1] > 0.5, accs
    quiet(w.report())


def markov_stream(seed, n=4096, vocab=64):
    """A token stream that a small LM can learn: the next token is a fixed permutation of the current one 90% of
    the time, uniform otherwise."""
    g = gen(seed)
    perm = torch.randperm(vocab, generator=g)
    noise = torch.rand(n, generator=g) < 0.1
    rnd = torch.randint(0, vocab, (n,), generator=g)
    out = torch.empty(n, dtype=torch.long)
    out[0] = 0
    for i in range(1, n):
        out[i] = rnd[i] if noise[i] else perm[out[i - 1]]
    return out


# -- zero_grad placement --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["after", "both"])
def test_nanogpt_style_zero_grad_after_update(where):
    """nanoGPT's loop: forward, scaled backward, unscale_ + clip, step, update, then `optimizer.zero_grad(
    set_to_none=True)` (no zero_grad before the forward) -- or zero_grad both before the forward and after the
    update. A tiny GPT on a fixed token stream, warmup then cosine lr by hand."""
    torch.manual_seed(2)
    m = TinyGPT()
    g = gen(2)
    data = markov_stream(2)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    steps = 50
    for i in range(steps):
        lr = 3e-3 * min(1.0, (i + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        ix = torch.randint(0, len(data) - 17, (8,), generator=g)
        xb = torch.stack([data[j:j + 16] for j in ix])
        yb = torch.stack([data[j + 1:j + 17] for j in ix])
        if where == "both":
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = m(xb, yb)["loss"]
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


# -- skipping non-finite losses by design ---------------------------------------------------------------------------
def test_isfinite_loss_continue_skips_all_padding_batches():
    """A token tagger with `ignore_index=-100`: every 9th batch is all padding, so its mean cross-entropy is 0/0 =
    NaN; the loop checks `if not torch.isfinite(loss): continue` before zero_grad/backward and skips it. The model's
    forward is finite on every batch; 60 batches, 53 steps."""
    torch.manual_seed(3)
    emb = torch.randn(32, 5, generator=gen(3))
    m = nn.Sequential(nn.Embedding(32, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 5))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales, skipped = [], [], 0
    for i in range(60):
        tok = torch.randint(0, 32, (8, 12), generator=gen(100 + i))
        tgt = emb[tok].argmax(-1)
        if i % 9 == 4:
            tgt = torch.full_like(tgt, -100)
        else:
            tgt[:, 9:] = -100   # padded tails
        with torch.autocast("cpu", dtype=FP16):
            logits = m(tok)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100)
        if not torch.isfinite(loss):
            skipped += 1
            continue
        opt.zero_grad()
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    assert skipped == 7
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


# -- two backward passes per step -----------------------------------------------------------------------------------
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = mlp(16, 96, 96, act=nn.SiLU)
        self.cls, self.reg = nn.Linear(96, 10), nn.Linear(96, 1)

    def forward(self, x):
        h = F.silu(self.trunk(x))
        return self.cls(h), self.reg(h).squeeze(-1)


def test_two_backward_passes_per_step_retain_graph():
    """Two losses from one shared trunk, each backwarded on its own through the scaler: the first with
    `retain_graph=True`, the second through the retained graph; then unscale_, clip, one step, one update."""
    torch.manual_seed(4)
    t = Task(4)
    v = torch.randn(16, generator=gen(44))
    m = TwoHeads()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(50):
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            logits, r = m(x)
            l1 = F.cross_entropy(logits.float(), y)
            l2 = F.smooth_l1_loss(r.float(), torch.tanh(x @ v))
        sc.scale(l1).backward(retain_graph=True)
        sc.scale(0.5 * l2).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(l1.item() + l2.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


# -- clipping options -----------------------------------------------------------------------------------------------
def test_unscale_then_clip_grad_norm_foreach_error_if_nonfinite_false():
    """`scaler.unscale_(opt)` then `clip_grad_norm_(params, 0.5, norm_type=2.0, error_if_nonfinite=False,
    foreach=True)`, its returned norm logged with `.item()`; SGD with momentum and nesterov."""
    torch.manual_seed(5)
    t = Task(5)
    m = mlp(16, 64, 64, 10, act=nn.ReLU)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales, norms = [], [], []
    for i in range(50):
        x, y = t.batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        n = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, norm_type=2.0, error_if_nonfinite=False,
                                           foreach=True)
        norms.append(n.item())
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.7)
    quiet(w.report())


# -- autocast options -----------------------------------------------------------------------------------------------
class NestedFP32Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        with torch.autocast("cpu", enabled=False):   # a region forced to fp32
            h = self.norm(h.float())
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = F.gelu(self.mid(h))
        return self.out(h)


def test_autocast_cache_enabled_false_with_a_nested_fp32_region():
    """`torch.autocast("cpu", dtype=float16, cache_enabled=False)` around the forward (as under activation
    checkpointing recipes), the model leaving autocast for an fp32 normalisation region with `.float()`."""
    torch.manual_seed(6)
    t = Task(6)
    m = NestedFP32Norm()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(50):
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16, cache_enabled=False):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.7)
    quiet(w.report())


# -- progressive unfreezing -----------------------------------------------------------------------------------------
def test_progressive_unfreezing_requires_grad_mid_run():
    """A 4-layer MLP (a 'pretrained' body fitted first without a watch); the optimizer holds every parameter from
    the start, all but the head frozen with `requires_grad_(False)`; every 15 steps one more layer from the top is
    unfrozen (ULMFiT-style gradual unfreezing) at a 10x lower lr through its own param group."""
    torch.manual_seed(7)
    t = Task(7)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 10))
    layers = [m[0], m[2], m[4]]
    pre = torch.optim.Adam(m.parameters(), lr=3e-3)   # a short 'pretraining' on a related task, unwatched
    t0 = Task(70)
    for i in range(30):
        x, y = t0.batch(9000 + i)
        pre.zero_grad()
        F.cross_entropy(m(x), y).backward()
        pre.step()
    groups = [{"params": m[6].parameters(), "lr": 2e-3}] + [{"params": L.parameters(), "lr": 2e-4} for L in layers]
    opt = torch.optim.AdamW(groups)
    for L in layers:
        L.requires_grad_(False)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(60):
        if i and i % 15 == 0:
            layers[-(i // 15)].requires_grad_(True)
        x, y = t.batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    assert all(p.requires_grad for p in m.parameters())
    healthy(losses, scales, fall=0.8)
    quiet(w.report())


# -- optimizer re-created at each epoch -----------------------------------------------------------------------------
@pytest.mark.parametrize("watched_opt", ["first", "none"])
def test_optimizer_recreated_every_epoch_scaler_kept(watched_opt):
    """Four epochs of 15 steps; at each epoch boundary a fresh AdamW is built (the lr decayed by hand), the same
    GradScaler is kept; the watch was given the first epoch's optimizer (or no optimizer: `watch(m, scaler=sc)`).
    Every iteration: scale(loss).backward -> unscale_(opt) -> clip_grad_norm_ -> step(opt) -> update."""
    torch.manual_seed(8)
    t = Task(8)
    m = mlp(16, 64, 64, 10)
    sc = torch.amp.GradScaler("cpu")
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    w = ampdoctor.watch(m, optimizer=opt if watched_opt == "first" else None, scaler=sc)
    losses, scales = [], []
    for epoch in range(4):
        if epoch:
            opt = torch.optim.AdamW(m.parameters(), lr=2e-3 * 0.5 ** epoch)
        for j in range(15):
            x, y = t.batch(j + 100 * epoch)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


# -- checkpoint save + load mid-run ---------------------------------------------------------------------------------
def test_checkpoint_saved_and_loaded_back_mid_run(tmp_path):
    """Every 20 steps a checkpoint (model, optimizer, scaler state_dicts, the step) is written with torch.save to a
    file; at step 30 it is read back with torch.load(weights_only=True) and loaded into the live objects (a crash
    recovery that lost nothing), training then goes on. The watch has a run_dir; the CLI reads it afterwards."""
    torch.manual_seed(9)
    t = Task(9)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    rd = tmp_path / "run"
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=rd)
    losses, scales = [], []
    ck = tmp_path / "ck.pt"
    for i in range(60):
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
        if i % 20 == 19:
            torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict(), "step": i}, ck)
        if i == 30:
            state = torch.load(ck, weights_only=True)
            m.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sc.load_state_dict(state["scaler"])
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())
    quiet(ampdoctor.diagnose(rd))
    cli_quiet(rd, tmp_path)


# -- schedules ------------------------------------------------------------------------------------------------------
def test_onecycle_large_peak_sgd_momentum_cycling():
    """OneCycleLR on SGD (max_lr 0.5, momentum cycled 0.85-0.95, three_phase) stepped every iteration, clipping at
    1.0 after unscale_; a BatchNorm CNN-free MLP classifier."""
    torch.manual_seed(10)
    t = Task(10)
    m = nn.Sequential(nn.Linear(16, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 128), nn.BatchNorm1d(128),
                      nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    steps = 60
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=steps, three_phase=True)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(steps):
        x, y = t.batch(i, 128)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        sched.step()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


# -- data loading ---------------------------------------------------------------------------------------------------
def test_dataloader_shuffled_epochs_last_batch_smaller():
    """A torch DataLoader over a TensorDataset of 300 samples, batch 64, shuffle, drop_last=False: every epoch ends
    with a batch of 44; 8 epochs, 40 steps."""
    torch.manual_seed(11)
    t = Task(11)
    X = torch.randn(300, 16, generator=gen(11))
    Y = (X @ t.W).argmax(1)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=64, shuffle=True,
                                     drop_last=False, generator=gen(12))
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales, sizes = [], [], []
    for epoch in range(8):
        for x, y in dl:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
            sizes.append(len(x))
    w.close()
    assert sizes.count(44) == 8
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


class TokensAndImages(nn.Module):
    """Takes int64 token ids and a uint8 image; normalises the image inside ((x / 255 - mean) / std)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.25, 0.25, 0.25]).view(1, 3, 1, 1))
        self.emb = nn.Embedding(50, 32)
        self.conv = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2,
                                                                                         padding=1),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, tokens, image):
        img = (image.float() / 255.0 - self.mean) / self.std
        a = self.emb(tokens).mean(1)
        b = self.conv(img).flatten(1)
        return self.head(torch.cat([a, b], 1))


def token_image_loader(n_batches, seed):
    """A generator yielding ((int64 tokens, uint8 image), int64 label) tuples; the label is decided by the first
    token's bucket and the image's dominant channel."""
    g = gen(seed)
    for _ in range(n_batches):
        tok = torch.randint(0, 50, (32, 8), generator=g)
        ch = torch.randint(0, 3, (32,), generator=g)
        img = torch.randint(0, 80, (32, 3, 8, 8), generator=g, dtype=torch.uint8)
        img[torch.arange(32), ch] += 150
        label = (tok[:, 0] >= 25).long() * 2 + (ch == 0).long()
        yield (tok, img), label


def test_generator_loader_int64_tokens_and_uint8_images_normalised_in_model():
    """A Python generator as the data loader, yielding (int64 tokens, uint8 images) with int64 labels; the model
    casts and normalises the image itself under autocast."""
    torch.manual_seed(12)
    m = TokensAndImages()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for (tok, img), y in token_image_loader(50, 12):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(tok, img).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


# -- closures -------------------------------------------------------------------------------------------------------
def test_closure_optimizer_step_bf16_no_scaler():
    """`optimizer.step(closure)` where the closure zero_grads, runs the forward under bf16 autocast and backwards
    (GradScaler takes no closure, so bf16 without a scaler); the loss is the closure's return value."""
    torch.manual_seed(13)
    t = Task(13)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    w = ampdoctor.watch(m, optimizer=opt)
    losses = []
    for i in range(50):
        x, y = t.batch(i)

        def closure():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.cross_entropy(m(x).float(), y)
            loss.backward()
            return loss
        losses.append(opt.step(closure).item())
    w.close()
    healthy(losses, fall=0.85)
    quiet(w.report())


# -- inference between steps, an unwatched teacher ------------------------------------------------------------------
def test_set_grad_enabled_false_inference_and_unwatched_teacher_under_same_autocast():
    """Each step: an unwatched frozen fp32 teacher (eval) runs inside the same fp16 autocast block as the student,
    under `torch.no_grad()`; between steps the student runs inference inside `torch.set_grad_enabled(False)` (as a
    sampling/monitoring call, in train mode) on another batch. Loss: CE + KL to the teacher at T=2."""
    torch.manual_seed(14)
    t = Task(14)
    teacher = mlp(16, 128, 128, 10, act=nn.ReLU)
    topt = torch.optim.Adam(teacher.parameters(), lr=3e-3)
    for i in range(40):   # the teacher learns the task first (unwatched, fp32)
        x, y = t.batch(7000 + i, 128)
        topt.zero_grad()
        F.cross_entropy(teacher(x), y).backward()
        topt.step()
    teacher.eval().requires_grad_(False)
    s = mlp(16, 48, 10)
    opt = torch.optim.AdamW(s.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(s, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(50):
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            with torch.no_grad():
                tl = teacher(x).float()
            sl = s(x).float()
            loss = F.cross_entropy(sl, y) + 4.0 * F.kl_div(F.log_softmax(sl / 2, -1), F.log_softmax(tl / 2, -1),
                                                           log_target=True, reduction="batchmean")
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(s.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
        with torch.set_grad_enabled(False), torch.autocast("cpu", dtype=FP16):
            s(t.batch(60_000 + i)[0]).argmax(1)
    w.close()
    healthy(losses, scales, fall=0.7)
    quiet(w.report())


# -- reports mid-run, re-watching -----------------------------------------------------------------------------------
def test_report_every_20_steps_mid_run_with_run_dir_then_cli(tmp_path):
    """`w.report()` called every 20 steps while training (a dashboard's poll), each asserted quiet; after close the
    live report, diagnose(run_dir) and `python -m ampdoctor report RUN_DIR` are quiet too. A tiny GPT, 80 steps."""
    torch.manual_seed(15)
    m = TinyGPT()
    g = gen(15)
    data = markov_stream(15)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    rd = tmp_path / "run"
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=rd)
    losses, scales, mids = [], [], []
    for i in range(80):
        ix = torch.randint(0, len(data) - 17, (8,), generator=g)
        xb = torch.stack([data[j:j + 16] for j in ix])
        yb = torch.stack([data[j + 1:j + 17] for j in ix])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = m(xb, yb)["loss"]
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
        if i % 20 == 19:
            mids.append((i, alarms(w.report())))
    w.close()
    healthy(losses, scales, fall=0.85)
    assert all(not a for _, a in mids), mids
    quiet(w.report())
    quiet(ampdoctor.diagnose(rd))
    cli_quiet(rd, tmp_path)


def test_close_then_a_new_watch_on_the_same_model_optimizer_and_scaler():
    """A first watch over 30 steps, `w.close()`, then `ampdoctor.watch` again on the same model, optimizer and
    scaler for 30 more steps (as a script that watches only some epochs); both reports quiet."""
    torch.manual_seed(16)
    t = Task(16)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    losses, scales, ws = [], [], []
    for part in range(2):
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
        ws.append(w)
        for i in range(30 * part, 30 * part + 30):
            x, y = t.batch(i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
        w.close()
    healthy(losses, scales, fall=0.85)
    for w in ws:
        quiet(w.report())


# -- flags ----------------------------------------------------------------------------------------------------------
def test_use_amp_false_disabled_scaler_and_autocast_fp32_run():
    """A script's `use_amp = False`: `GradScaler("cpu", enabled=False)` and `autocast(enabled=False)`, the loop
    unchanged (scale/backward/unscale_/clip/step/update are pass-throughs): a plain fp32 run."""
    torch.manual_seed(17)
    t = Task(17)
    use_amp = False
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu", enabled=use_amp)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses = []
    for i in range(40):
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16, enabled=use_amp):
            loss = F.cross_entropy(m(x), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    w.close()
    healthy(losses, fall=0.85)
    quiet(w.report())


def test_gradscaler_kept_with_bf16_autocast_default_dtype():
    """`torch.autocast("cpu")` without a dtype (bf16 on the CPU) with a GradScaler kept from an fp16 script: the
    scaler is unnecessary but harmless (no overflow, the scale grows)."""
    torch.manual_seed(18)
    t = Task(18)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(40):
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu"):
            out = m(x)
            loss = F.cross_entropy(out.float(), y)
        assert out.dtype == BF16
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


# -- more loop shapes -----------------------------------------------------------------------------------------------
def test_whole_iteration_inside_autocast_backward_and_step_included():
    """The whole iteration inside one `with torch.autocast(...)` block: forward, `scaler.scale(loss).backward()`,
    unscale_, clip, step and update all under autocast (PyTorch advises backward outside it, but it is correct)."""
    torch.manual_seed(19)
    t = Task(19)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(50):
        x, y = t.batch(i)
        with torch.autocast("cpu", dtype=FP16):
            opt.zero_grad()
            loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


def test_pseudo_labels_from_the_same_model_under_no_grad_each_iteration():
    """FixMatch-style self-training: each iteration first runs the watched model under `torch.no_grad()` on a weakly
    augmented unlabelled batch (pseudo-labels where the confidence passes 0.7), then the training forward on the
    labelled batch and the strongly augmented unlabelled batch; one scaled backward."""
    torch.manual_seed(20)
    t = Task(20)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(50):
        x, y = t.batch(i, 32)
        u = torch.randn(64, 16, generator=gen(30_000 + i))
        with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
            p = torch.softmax(m(u + 0.05 * torch.randn_like(u)).float(), -1)
        conf, pl = p.max(-1)
        keep = (conf > 0.7).float()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            ls = F.cross_entropy(m(x).float(), y)
            lu = (F.cross_entropy(m(u + 0.3 * torch.randn_like(u)).float(), pl, reduction="none") * keep).mean()
            loss = ls + lu
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(ls.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


def test_dry_run_backwards_without_a_step_before_training():
    """A 'batch size finder' before training: forward + scaled backward on batches of 16, 32, 64, 128 then
    `zero_grad()` with no optimizer step and no scaler update (a memory probe), then the ordinary loop."""
    torch.manual_seed(21)
    t = Task(21)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    for n in (16, 32, 64, 128):
        x, y = t.batch(80_000 + n, n)
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        opt.zero_grad(set_to_none=True)
    losses, scales = [], []
    for i in range(50):
        x, y = t.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


def test_grads_set_to_none_by_hand_and_skip_detected_from_the_scale():
    """`for p in model.parameters(): p.grad = None` instead of zero_grad; the loop notices a skipped step the way
    scripts do (`scale_before > scaler.get_scale()` after update) and only then skips its lr scheduler step (the
    'Detected call of lr_scheduler.step() before optimizer.step()' workaround)."""
    torch.manual_seed(22)
    t = Task(22)
    m = mlp(16, 64, 64, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50, eta_min=2e-4)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales, skips = [], [], 0
    for i in range(50):
        x, y = t.batch(i)
        for p in m.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < before:
            skips += 1
        else:
            sched.step()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


def test_optimizer_recreated_with_a_new_scaler_and_a_new_watch_each_epoch():
    """The healthy twin of the re-created optimizer above, done the way ampdoctor can follow it: each epoch a new
    AdamW, the same GradScaler, and the watch closed and opened again with the new optimizer."""
    torch.manual_seed(8)
    t = Task(8)
    m = mlp(16, 64, 64, 10)
    sc = torch.amp.GradScaler("cpu")
    losses, scales, ws = [], [], []
    for epoch in range(4):
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3 * 0.5 ** epoch)
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
        ws.append(w)
        for j in range(15):
            x, y = t.batch(j + 100 * epoch)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
        w.close()
    healthy(losses, scales, fall=0.85)
    for w in ws:
        quiet(w.report())


def test_optimizer_recreated_without_clipping_scaler_kept():
    """The re-created optimizer (same scaler, the watch given the first optimizer) without any clipping: the scaler
    unscales inside step(); nothing reads the gradients in between."""
    torch.manual_seed(8)
    t = Task(8)
    m = mlp(16, 64, 64, 10)
    sc = torch.amp.GradScaler("cpu")
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for epoch in range(4):
        if epoch:
            opt = torch.optim.AdamW(m.parameters(), lr=2e-3 * 0.5 ** epoch)
        for j in range(15):
            x, y = t.batch(j + 100 * epoch)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())


class EmbedClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = mlp(32, 64, 5)

    def forward(self, tok):
        return self.body(self.emb(tok).mean(1))


def test_two_optimizers_one_scaler_both_unscaled_then_one_clip_over_all_parameters():
    """The embedding under SGD, the rest under AdamW, one GradScaler: `unscale_` on both optimizers, then one
    `clip_grad_norm_(model.parameters())` over all of them, both steps, one update; the watch is given the AdamW."""
    torch.manual_seed(23)
    m = EmbedClassifier()
    proj = torch.randn(64, 5, generator=gen(23))
    o_emb = torch.optim.SGD(m.emb.parameters(), lr=20.0)
    o_body = torch.optim.AdamW(m.body.parameters(), lr=5e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=o_body, scaler=sc)
    losses, scales = [], []
    for i in range(50):
        tok = torch.randint(0, 64, (32, 6), generator=gen(40_000 + i))
        y = proj[tok].sum(1).argmax(1)
        o_emb.zero_grad()
        o_body.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.cross_entropy(m(tok).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(o_emb)
        sc.unscale_(o_body)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(o_emb)
        sc.step(o_body)
        sc.update()
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.85)
    quiet(w.report())
