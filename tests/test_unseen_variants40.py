"""Fortieth set: FAILURES THAT LIVE IN THE OPTIMIZER AND THE LOOP, not in a module's forward. Ten fp16 failures made by
what the training script does around the model: the optimizer state a resumed job loads, a learning rate a scheduler
rewrites at an epoch boundary, parameter groups, a checkpoint that decides the parameters' dtype, an optimizer's eps,
an optimizer wrapper, a gradient transform, the GradScaler's settings, and where a zero_grad sits. Watched through
the public API only (`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")` at the default
settings -> the case's own loop (probe_harness.run_misuse: body(i) per step) -> close -> `w.report()`), ampdoctor's
RuntimeWarnings recorded. Tiny models, fixed seeds, CPU fp16 autocast with a real `torch.amp.GradScaler("cpu")`
(4, 5: pure fp16 parameters, no scaler).

Each failure is proven first by the test's own oracle: for update_spike the measured factor ||w after|| / ||w before||
of every layer's weight around each optimizer step (the truth is the layer with the clearly largest factor, at the step
where it happened; every earlier step below x1.2); for update_underflow the share of elements with a nonzero gradient
that the update left exactly as they were (w + dw == w); for eps_underflow the elements whose denominator
sqrt(v) + eps is 0 in fp16 while their gradient is not, and the weights the step wrote inf/NaN into; for the scaler
rules the skipped steps, the loss-scale timeline and the parameters whose gradient was non-finite before unscale_;
for call order the gradients the optimizer really stepped with (a step pre-hook) or the weights that never moved.
Only then must the rule be among the report's first three findings at the module the contract names (`null` for the
loop/scaler rules, "" the root for a whole-model optimizer setting), at that step, with the contract's severity
(`error`: training is broken or silently wrong; an update_spike that leaves the run finite and learning may be a
`warning`). A wrong report raises WrongAnswer naming ampdoctor's top three (a failing oracle or a crash fails
otherwise).

 1. a job resumed from a checkpoint whose optimizer state was "slimmed" to fp16 for storage (every floating tensor of
    `opt.state_dict()` cast with .half()); AdamW.load_state_dict casts it back to fp32, but exp_avg_sq of the small
    gradients (< 6e-8) is 0 while exp_avg survived (15k elements of the embedding alone): the first update divides
    m by eps = 1e-8 where the gradient is 0 (dead ReLU units of `fc`, absent tokens of `emb`) -> update_spike at `fc`
    (x38; `emb` x3), step 0, error: the update broke the model (held-out loss x2.8).
 2. `--lr 1e-4` written into opt.param_groups AFTER the per-epoch LambdaLR was built from the optimizer's 1e-2:
    the scheduler's next step (the first epoch boundary) recomputes the lr from its base_lrs, x100 -> update_spike at
    `q` (a DDPG/SAC critic's last layer, init uniform(+-3e-3)), step 4 (x4.3).
 3. SWA with torchvision's SGD recipe (AveragedModel + SWALR(swa_lr=0.05, anneal_epochs=1)) on an AdamW(3e-4) run:
    at the SWA epoch boundary the lr goes x167 -> update_spike at `fc` (VGG's N(0, 0.01) classifier init), step 8
    (x2.7; the convs x1.06).
 4. a model built on the meta device and materialised from the released fp16 checkpoint with
    `load_state_dict(sd, assign=True)` (assign keeps the checkpoint's tensors, dtype included), then SGD(momentum
    0.9, lr 1e-3) with the inputs cast to the model's dtype: 60-70% of the updates of `inp`, `norm`, `mid` round away
    at step 0 -> fp16_master_weights at the root, error, and update_underflow at one of those, step 0, error.
 5. RMSprop at torch's default eps=1e-8 on a `.half()` behaviour-cloning policy (A2C's RMSprop without its eps=1e-5):
    square_avg = 0.01 g^2 is 0 in fp16 for |g| < 1.7e-3 and 1e-8 is 0 too, g / 0 -> every layer inf/NaN after step 0
    -> eps_underflow at the root (the group's eps; or a layer it broke), step 0, error.
 6. a Lookahead wrapper sharing its inner SGD's param_groups, and the trainer's clip helper written for the base
    optimizer (`scaler.unscale_(base)`), then `scaler.step(lookahead)`: GradScaler sees two optimizers and unscales the
    same gradients again inside step -> SGD steps with gradients / 65536 (measured), nothing is learned; torch says
    nothing -> scaler_misorder (unscale_ twice), null, step 0, error.
 7. annealed gradient noise (Neelakantan et al.) scaled by each tensor's own gradient std (so that it follows the
    loss scale), switched on at step 4: for the one-element learnable logit scale of a cosine head, std() of one
    element is NaN -> `head.log_scale.grad` NaN on every step, all 16 steps from 4 skipped, the scale 1024 -> 0.016
    -> loss_scale_collapse (or nan_origin) at `head`, step 4, error.
 8. GradScaler(growth_factor=16, growth_interval=3) ("recover fast after a backoff") on a regression whose gradients
    allow a scale of 4096: every 3 clean steps x16 -> 65536, four backoffs back down: 19 of the 36 steps after the
    first update skipped, to the end -> skipped_steps, null, at the first later skip (7), warning or error.
 9. optimizer.zero_grad(set_to_none=True) moved to between unscale_ + clip and scaler.step (a memory clean-up): every
    gradient is finite and nonzero when clipped, then gone; AdamW skips every parameter, no weight moves in 10 steps,
    GradScaler says nothing -> scaler_misorder (a call out of order), null, step 0, error. (test_loop_misuse3 M6 puts
    the zero_grad before unscale_, where torch asserts or the unscale_ sees zeros.)
10. BEiT-style layer-wise lr decay (0.65 over 12 blocks) with the exponent's sign flipped (`decay ** (layer_id -
    (depth + 1))`): the embedding gets lr x270 (0.27), block 0 x176, ... over N(0, 0.02) weights -> update_spike at
    `emb` (x12.8; blocks.0.1 x8.7), step 0.
Twins (the same loop done right; no warning, no error, no RuntimeWarning, a held-out loss lower at the end): 1 resumed
from the fp32 optimizer state; 2 with the lr written before the scheduler is built; 6 with the clip helper given the
wrapper (one unscale_).
Not built: a warm-restart schedule (CosineAnnealingWarmRestarts jumps back to the same peak the first cycle started
from: its first update is no larger than step 0's, so no spike is the truth); weight decay on a huge gain (decoupled
decay is a factor (1 - lr wd) per step in fp32; in fp16/bf16 it rounds away: test_unseen_variants17 6); a custom
optimizer with fp16 momentum (test_unseen_variants22 4, test_silent_stop 8); gradient accumulation with a raw
backward in the no_sync branch (test_loop_misuse3 M7, still a strict xfail there: an empty report here too);
update()/unscale_ per micro-batch (test_unseen_variants5, 13).

What ampdoctor says (now 10 of 10 right, 5 at first; the three twins quiet; no RuntimeWarning):
- right: 2 `[warning] update_spike at q step 4`, 3 `[warning] update_spike at fc step 8`, 10 `[warning] update_spike at
  emb step 0`; 4 `[error] fp16_master_weights at (root) step 0` + `[error] update_underflow at inp step 0` ("So do 2
  more layer(s) ... (norm, mid)"); 5 `[error] eps_underflow at (root) optimizer.step step 0`, then
  fp16_master_weights and update_spike (x inf); 7 `[error] loss_scale_collapse at head step 4` (second, under
  `[error] overflow at head step 4`, see below).
- wrong at first (strict xfails here, fixed since): 6 `[info] skipped_steps at (run) step 2` only (the helper's
  unscale_ of the inner SGD and step's own unscale_ of the wrapper were taken for the documented
  two-optimizers-one-scaler pattern; the recorder now notes a scaler.step that will unscale gradients another
  optimizer object holding the same parameters already unscaled: record/monitorsink.py, rules/callorder.py);
  8 `[info] overflow at out step 1 ... as designed` + `[info] skipped_steps at (run) step 0 ... a normal rate`
  (each x16 growth looked like a restart of the scaler, and skips throwing away 20% or more of the steps after the
  first update are no longer benign: rules/backoff.py); 9 an empty report ("Healthy"): a zero_grad between unscale_
  and step is now scaler_misorder (rules/callorder.py _zeroed_after_backward).
- 1: `[warning] update_spike at fc step 0`: the rule, layer and step right; a warning, not an error, because the run
  does not go non-finite (update_spike's design); its causes name the lr, warmup and clipping, not the restored
  state.
Noticed (fixed, asserted in 2): update_spike's message quoted the lr the watch began with (2: "lr=0.0001 ... 0.0559x
the weights' typical size", at lr 0.01; 3: "lr=0.0003" at 0.05): the update checks now record each parameter group's
lr (ParamStat.lr); and on an unsampled step it said "no gradient clipping" although the loop clips every step (the
record kept no calls: now only what the record shows is said). 1's causes name the lr,
warmup and clipping, not the restored optimizer state. 7's top finding says `head`'s backward "turned a finite
incoming gradient into ±inf": the gradient was NaN, written by the loop's noise code after backward
(record/producers.py backward_producer: a module with a non-finite own parameter gradient is kind "inf" unless its
input gradient holds NaN).

Run: .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_unseen_variants40.py (about 6 s)
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe_harness import WrongAnswer, at_top3, run_misuse
from scenarios import FP16, alarms, gen, lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


# ======================================================================================================================
# the loop, the oracles and the checks
# ======================================================================================================================
def watched(m, body, steps, run_dir, *, opt=None, scaler=None):
    """probe_harness.run_misuse (watch(m, optimizer=opt, scaler=scaler, run_dir=run_dir) at the default settings ->
    body(i) for each step -> close -> report) inside a warnings recorder. Returns the report, the exception torch
    raised (or None) and ampdoctor's RuntimeWarnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rep, raised = run_misuse(m, body, steps, optimizer=opt, scaler=scaler, run_dir=run_dir)
    warns = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
             and str(x.message).startswith("ampdoctor:")]
    return rep, raised, warns


def weights(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def spike_factors(before, after, min_rms=1e-3):
    """The update oracle: per module, over its `.weight` (the parameter that carries a layer's scale), the factor
    ||w after|| / ||w before|| and the update ratio ||dw|| / ||w|| of one optimizer update (weights whose rms is below
    `min_rms` have no scale to spike from and are left out)."""
    out = {}
    for n, w0 in before.items():
        if not n.endswith("weight"):
            continue
        w0, w1 = w0.double(), after[n].double()
        if w0.norm() / math.sqrt(w0.numel()) < min_rms:
            continue
        out[n.rpartition(".")[0]] = (float(w1.norm() / w0.norm()), float((w1 - w0).norm() / w0.norm()))
    return out


def spiked_layer(f, at_least=3.0, margin=2.0):
    """The layer whose update multiplied its weight's norm the most (the test's truth): by `at_least` or more, and by
    `margin` times more than any other layer's factor (one clear worst layer, as update_spike names it)."""
    top = max(f, key=lambda k: f[k][0])
    assert f[top][0] >= at_least, f
    assert all(margin * v[0] <= f[top][0] for k, v in f.items() if k != top), f
    return top


def rounded_share(before, after, grads):
    """The update_underflow oracle: per module, the share of its parameters' elements with a nonzero gradient that
    the update left exactly as they were (w + dw == w)."""
    acc = {}
    for n, w0 in before.items():
        g = grads.get(n)
        if g is None:
            continue
        nz = g != 0
        same = (after[n] == w0) & nz
        mod = n.rpartition(".")[0]
        k, t = acc.get(mod, (0, 0))
        acc[mod] = (k + int(same.sum()), t + int(nz.sum()))
    return {mod: k / t for mod, (k, t) in acc.items() if t}


def check(rep, warns, rule, modules, *, step=None, severity=("error",)):
    """The report check: `rule` (or one of the rules) at one of `modules` (a module name or a collection of the
    names the truth allows), at `step` (one or a tuple), with `severity`, among the first three findings. A failure
    is a WrongAnswer naming ampdoctor's top three and its RuntimeWarnings."""
    rules = (rule,) if isinstance(rule, str) else tuple(rule)
    mods = [modules] if modules is None or isinstance(modules, str) else list(modules)
    errs = []
    for mod in mods:
        try:
            return at_top3(rep, rules, mod, step=step, severity=severity)
        except AssertionError as e:
            errs.append(str(e)[:300])
    raise WrongAnswer(f"top3={lines(rep)[:3]} warnings={warns} ({errs[0]})")


def quiet(rep, raised, warns, losses, fall=1.0):
    """A twin: it ran to its end, every loss finite, the last three below `fall` x the first three (`losses` a pair:
    a fixed held-out batch's loss before and after the run, the second below `fall` x the first), no RuntimeWarning
    of ampdoctor's, no warning or error in the report."""
    assert raised is None, raised
    assert all(map(math.isfinite, losses)), losses
    k = 1 if len(losses) == 2 else 3
    assert sum(losses[-k:]) < fall * sum(losses[:k]), losses
    assert warns == [], warns
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)



# ======================================================================================================================
# 1. resumed from a checkpoint whose optimizer state was "slimmed" to fp16
# ======================================================================================================================
VOCAB = 512


class BagClassifier(nn.Module):
    """Mean-of-embeddings text classifier: emb -> fc -> relu -> head."""

    def __init__(self, vocab=VOCAB, d=32, n_cls=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc, self.head = nn.Linear(d, d), nn.Linear(d, n_cls)

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids).mean(1))))


ZIPF = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.1


def zipf_batch(i, B=16, T=12):
    """Token ids drawn from a Zipf law (most rows of the table are rare); the label is the majority of id % 4."""
    ids = torch.multinomial(ZIPF.expand(B, -1), T, replacement=True, generator=gen(1000 + i))
    y = F.one_hot(ids % 4, 4).sum(1).argmax(1)
    return ids, y


def bag_ce(m, i):
    ids, y = zipf_batch(i)
    with torch.autocast(**FP16):
        out = m(ids)
    return F.cross_entropy(out.float(), y)


def slim(obj):
    """The checkpoint's size optimisation: every floating tensor of the optimizer's state dict stored as fp16."""
    if torch.is_tensor(obj):
        return obj.half() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: slim(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [slim(v) for v in obj]
    return obj


PRE_STEPS = 40


def bag_checkpoint(path, slimmed):
    """The first job: AdamW(1e-3), fp16 autocast + GradScaler, PRE_STEPS steps; its checkpoint written to `path`
    (the optimizer state cast to fp16 when `slimmed`) and read back."""
    torch.manual_seed(0)
    m = BagClassifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i in range(PRE_STEPS):
        opt.zero_grad()
        sc.scale(bag_ce(m, i)).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    osd = opt.state_dict()
    torch.save({"model": m.state_dict(), "opt": slim(osd) if slimmed else osd, "scaler": sc.state_dict()}, path)
    return torch.load(path)


def resumed_run(tmp_path, slimmed, steps=10):
    """The resumed job: a fresh model and AdamW load the checkpoint (Optimizer.load_state_dict casts the state back
    to the parameters' fp32), then the ordinary loop from step 0 under the watch; the update oracle around each
    step."""
    ck = bag_checkpoint(tmp_path / "ckpt.pt", slimmed)
    torch.manual_seed(0)
    m = BagClassifier()
    m.load_state_dict(ck["model"])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt.load_state_dict(ck["opt"])
    sc = torch.amp.GradScaler("cpu")
    sc.load_state_dict(ck["scaler"])
    st = opt.state[m.emb.weight]
    r = dict(losses=[], factors=[], v0_m=int(((st["exp_avg_sq"] == 0) & (st["exp_avg"] != 0)).sum()))
    held0 = sum(bag_ce(m, 10_000 + k).item() for k in range(4))

    def body(i):
        opt.zero_grad()
        loss = bag_ce(m, PRE_STEPS + i)
        r["losses"].append(loss.item())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = weights(m)
        sc.step(opt)
        sc.update()
        r["factors"].append(spike_factors(before, weights(m)))
    r["rep"], r["raised"], r["warns"] = watched(m, body, steps, tmp_path / "run", opt=opt, scaler=sc)
    with torch.no_grad():
        r["held_out"] = (held0, sum(bag_ce(m, 10_000 + k).item() for k in range(4)))
    return r


def test_resume_from_fp16_slimmed_optimizer_state_first_update_explodes_the_layer(tmp_path):
    r = resumed_run(tmp_path, slimmed=True)
    assert r["raised"] is None
    assert r["v0_m"] > 100, r["v0_m"]      # exp_avg_sq flushed to 0 in fp16 where exp_avg survived
    assert spiked_layer(r["factors"][0]) == "fc"
    before, after = r["held_out"]
    assert after > 2 * before, r["held_out"]    # the update broke the model: the held-out loss x2.8
    # (a warning: update_spike is an error only when the run goes non-finite after it, rules/updates.py)
    check(r["rep"], r["warns"], "update_spike", "fc", step=0, severity=("warning", "error"))


def test_twin_resume_from_fp32_optimizer_state_is_quiet(tmp_path):
    r = resumed_run(tmp_path, slimmed=False)
    assert r["v0_m"] == 0
    assert max(v[0] for f in r["factors"] for v in f.values()) < 1.2, r["factors"]
    quiet(r["rep"], r["raised"], r["warns"], r["held_out"])


# ======================================================================================================================
# 2. an lr override written into the param groups after the scheduler was built: x100 at the first epoch boundary
# 3. SWA with the SGD recipe's swa_lr on an AdamW run: x500 at the SWA epoch boundary
# ======================================================================================================================
class Critic(nn.Module):
    """A DDPG/SAC-style critic: (obs, action) -> 64 -> 64 -> Q, the last layer initialised uniform(+-3e-3) as those
    codebases do (so that the first Q estimates are near 0)."""

    def __init__(self, obs=12, act=4, h=64):
        super().__init__()
        self.l1, self.l2, self.q = nn.Linear(obs + act, h), nn.Linear(h, h), nn.Linear(h, 1)
        nn.init.uniform_(self.q.weight, -3e-3, 3e-3)
        nn.init.uniform_(self.q.bias, -3e-3, 3e-3)

    def forward(self, s, a):
        return self.q(torch.relu(self.l2(torch.relu(self.l1(torch.cat([s, a], -1))))))


W_Q = randn(16, 1, seed=77) * 0.3


def critic_batch(i, B=64):
    s, a = randn(B, 12, seed=2000 + i), randn(B, 4, seed=3000 + i).tanh()
    return s, a, torch.cat([s, a], -1) @ W_Q


def critic_loss(m, i):
    s, a, y = critic_batch(i)
    with torch.autocast(**FP16):
        q = m(s, a)
    return F.mse_loss(q.float(), y)


def held_out(m, loss_of, n=4):
    with torch.no_grad():
        return sum(loss_of(m, 50_000 + k).item() for k in range(n))


EPOCH = 4          # optimizer steps per epoch


def epoch_run(tmp_path, m, opt, loss_of, steps, *, sched_at_epoch_end=None):
    """The ordinary loop (fp16 autocast, GradScaler, unscale_ + clip + step + update), `sched_at_epoch_end(epoch)`
    after each epoch's last step; the update oracle and the learning rate of every step."""
    sc = torch.amp.GradScaler("cpu")
    r = dict(losses=[], factors=[], lrs=[], held=[held_out(m, loss_of)])

    def body(i):
        opt.zero_grad()
        loss = loss_of(m, i)
        r["losses"].append(loss.item())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = weights(m)
        r["lrs"].append(opt.param_groups[0]["lr"])
        sc.step(opt)
        sc.update()
        r["factors"].append(spike_factors(before, weights(m)))
        if (i + 1) % EPOCH == 0 and sched_at_epoch_end is not None:
            sched_at_epoch_end(i // EPOCH)
        if i + 1 in (2 * EPOCH, steps):
            r["held"].append(held_out(m, loss_of))
    r["rep"], r["raised"], r["warns"] = watched(m, body, steps, tmp_path / "run", opt=opt, scaler=sc)
    return r


BASE_LR, FINETUNE_LR = 1e-2, 1e-4


def lr_override_run(tmp_path, override_first):
    """build_optimizer(model, cfg.lr) + build_scheduler(opt) (a per-epoch LambdaLR: constant, /10 from epoch 3), then
    the run's `--lr 1e-4` written into the param groups: after the scheduler (the bug: LambdaLR keeps the lr it was
    built with as its base_lrs and recomputes from them at its next step) or before it (the twin)."""
    torch.manual_seed(0)
    m = Critic()
    opt = torch.optim.AdamW(m.parameters(), lr=BASE_LR)
    if override_first:
        for g in opt.param_groups:
            g["lr"] = FINETUNE_LR
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 if e < 3 else 0.1)
    if not override_first:
        for g in opt.param_groups:
            g["lr"] = FINETUNE_LR
    return epoch_run(tmp_path, m, opt, critic_loss, 3 * EPOCH, sched_at_epoch_end=lambda e: sched.step())


def test_lr_override_after_scheduler_is_undone_x100_at_the_epoch_boundary(tmp_path):
    r = lr_override_run(tmp_path, override_first=False)
    assert r["lrs"][EPOCH - 1] == FINETUNE_LR and r["lrs"][EPOCH] == BASE_LR
    assert all(max(v[0] for v in f.values()) < 1.2 for f in r["factors"][:EPOCH]), r["factors"][:EPOCH]
    assert spiked_layer(r["factors"][EPOCH]) == "q"
    f = check(r["rep"], r["warns"], "update_spike", "q", step=EPOCH, severity=("warning", "error"))
    # its message quotes the lr of that update, and says nothing of clipping it cannot see on an unsampled step
    assert f.evidence["lr"] == BASE_LR and f"lr={BASE_LR:g}" in f.message, f.message
    assert "no gradient clipping" not in f.message, f.message


def test_twin_lr_override_before_scheduler_is_quiet(tmp_path):
    r = lr_override_run(tmp_path, override_first=True)
    assert set(r["lrs"]) == {FINETUNE_LR}
    quiet(r["rep"], r["raised"], r["warns"], (r["held"][0], r["held"][-1]))


class SmallVGG(nn.Module):
    """Two 3x3 convs (VGG's kaiming_normal fan_out init) -> global pool -> fc (VGG's N(0, 0.01) Linear init)."""

    def __init__(self, n_cls=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(16, n_cls)
        for mod in self.features:
            if isinstance(mod, nn.Conv2d):
                nn.init.kaiming_normal_(mod.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(mod.bias)
        nn.init.normal_(self.fc.weight, 0, 0.01)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


PROTOS = randn(10, 3, 8, 8, seed=55)


def image_batch(i, B=32):
    y = torch.randint(0, 10, (B,), generator=gen(4000 + i))
    return PROTOS[y] + 0.8 * randn(B, 3, 8, 8, seed=5000 + i), y


def image_loss(m, i):
    x, y = image_batch(i)
    with torch.autocast(**FP16):
        out = m(x)
    return F.cross_entropy(out.float(), y)


SWA_START = 1      # epochs 0-1 ordinary, SWA from the end of epoch 1


def swa_run(tmp_path, swa_lr):
    """AdamW(3e-4) on SmallVGG; the SWA recipe of torchvision's reference scripts (written for SGD): AveragedModel,
    SWALR(swa_lr, anneal_epochs=1) stepped at the end of each epoch from SWA_START on, swa_model updated there."""
    torch.manual_seed(0)
    m = SmallVGG()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    swa_model = torch.optim.swa_utils.AveragedModel(m)
    swa_sched = torch.optim.swa_utils.SWALR(opt, swa_lr=swa_lr, anneal_epochs=1)

    def epoch_end(e):
        if e >= SWA_START:
            swa_model.update_parameters(m)
            swa_sched.step()
    return epoch_run(tmp_path, m, opt, image_loss, 4 * EPOCH, sched_at_epoch_end=epoch_end)


def test_swalr_with_the_sgd_recipes_swa_lr_on_adamw_spikes_the_classifier(tmp_path):
    r = swa_run(tmp_path, swa_lr=0.05)
    at = (SWA_START + 1) * EPOCH
    assert r["lrs"][at - 1] == 3e-4 and r["lrs"][at] == pytest.approx(0.05)
    assert all(max(v[0] for v in f.values()) < 1.2 for f in r["factors"][:at]), r["factors"][:at]
    assert spiked_layer(r["factors"][at], at_least=2.5) == "fc"     # (x2.67; the convs x1.06)
    check(r["rep"], r["warns"], "update_spike", "fc", step=at, severity=("warning", "error"))


# ======================================================================================================================
# 4. a model materialised from an fp16 checkpoint with load_state_dict(assign=True), trained by SGD directly
# ======================================================================================================================
class TabRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.norm = nn.Linear(16, 64), nn.LayerNorm(64)
        self.mid, self.out = nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.norm(torch.relu(self.inp(x))))))


W_TAB = randn(16, 1, seed=88) * 0.5


def tab_batch(i, B=64):
    x = randn(B, 16, seed=6000 + i)
    return x, x @ W_TAB + 0.3 * torch.sin(3 * x[:, :1])


def released_fp16_checkpoint():
    """The pretrained model (fp32, AdamW, 30 steps) as it was released: its state dict saved in fp16."""
    torch.manual_seed(0)
    m = TabRegressor()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for i in range(30):
        opt.zero_grad()
        x, y = tab_batch(900 + i)
        F.mse_loss(m(x), y).backward()
        opt.step()
    return {k: v.half() for k, v in m.state_dict().items()}


def test_assign_true_from_an_fp16_checkpoint_sgd_updates_round_away(tmp_path):
    sd = released_fp16_checkpoint()
    with torch.device("meta"):
        m = TabRegressor()                       # no memory for random weights that would be overwritten anyway
    m.load_state_dict(sd, assign=True)           # assign=True: the parameters ARE the checkpoint's fp16 tensors
    assert {p.dtype for p in m.parameters()} == {torch.float16}
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    r = dict(losses=[], shares=[])

    def body(i):
        opt.zero_grad()
        x, y = tab_batch(i)
        loss = F.mse_loss(m(x.to(torch.float16)).float(), y)   # the inputs cast to the model's dtype
        r["losses"].append(loss.item())
        loss.backward()
        before, grads = weights(m), {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        r["shares"].append(rounded_share(before, weights(m), grads))
    rep, raised, warns = watched(m, body, 12, tmp_path / "run", opt=opt)
    assert raised is None and all(map(math.isfinite, r["losses"])), (raised, r["losses"])
    rounding = {mod for mod, sh in r["shares"][0].items() if sh >= 0.5}
    assert "norm" in rounding and len(rounding) >= 2, r["shares"][0]
    check(rep, warns, "fp16_master_weights", "", severity="error")
    check(rep, warns, "update_underflow", sorted(rounding), step=0, severity="error")


# ======================================================================================================================
# 5. RMSprop (torch's default eps=1e-8) on a .half() policy
# ======================================================================================================================
class Policy(nn.Module):
    def __init__(self, obs=24, h=64, n_act=6):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh())
        self.pi = nn.Linear(h, n_act)

    def forward(self, s):
        return self.pi(self.body(s))


W_POL = randn(24, 6, seed=99)


def bc_batch(i, B=64):
    """Behaviour cloning from an expert: the expert's action is argmax(s @ W_POL)."""
    s = randn(B, 24, seed=7000 + i)
    return s, (s @ W_POL).argmax(1)


def test_rmsprop_default_eps_on_a_half_policy_divides_by_zero(tmp_path):
    torch.manual_seed(0)
    m = Policy().half()
    opt = torch.optim.RMSprop(m.parameters(), lr=7e-4, alpha=0.99)    # eps left at its default, 1e-8
    r = dict(losses=[], bad_after=[])

    def body(i):
        opt.zero_grad()
        s, a = bc_batch(i)
        loss = F.cross_entropy(m(s.half()).float(), a)
        r["losses"].append(loss.item())
        loss.backward()
        if i == 0:
            g = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        r["bad_after"].append(sorted({n.rpartition(".")[0] for n, p in m.named_parameters()
                                      if not torch.isfinite(p).all()}))
        if i == 0:   # the mechanism, from the state the step left: sqrt(v) + eps == 0 in fp16 where the gradient is not
            r["zero_denom"] = sum(int(((opt.state[p]["square_avg"].sqrt() + 1e-8) == 0).logical_and(g[n] != 0).sum())
                                  for n, p in m.named_parameters())
    rep, raised, warns = watched(m, body, 6, tmp_path / "run", opt=opt)
    assert torch.tensor(1e-8, dtype=torch.float16) == 0
    assert r["zero_denom"] > 100 and r["bad_after"][0], r
    assert math.isfinite(r["losses"][0]) and not math.isfinite(r["losses"][1]), r["losses"]
    check(rep, warns, "eps_underflow", ["", *r["bad_after"][0]], step=0, severity="error")


# ======================================================================================================================
# 6. a Lookahead wrapper: the clip helper unscales the inner optimizer, scaler.step(wrapper) unscales again
# ======================================================================================================================
class Lookahead:
    """Lookahead (k=4, alpha=0.5; Zhang et al. 2019) over an inner optimizer, in the style of the common
    implementations: it shares the inner optimizer's param_groups and state (so that a GradScaler or a scheduler can
    drive it), and pulls the fast weights halfway back to the slow ones every k steps."""

    def __init__(self, inner, k=4, alpha=0.5):
        self.inner, self.k, self.alpha, self.n = inner, k, alpha, 0
        self.param_groups, self.state, self.defaults = inner.param_groups, inner.state, inner.defaults
        self.slow = [[p.detach().clone() for p in g["params"]] for g in inner.param_groups]

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    @torch.no_grad()
    def step(self, closure=None):
        out = self.inner.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            for g, slow in zip(self.param_groups, self.slow):
                for p, s in zip(g["params"], slow):
                    s.add_(p - s, alpha=self.alpha)
                    p.copy_(s)
        return out


def clip_gradients(scaler, optimizer, model, max_norm=1.0):
    """The trainer's clip helper, written for the base optimizer (`trainer.base_optimizer`)."""
    scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def lookahead_run(tmp_path, right):
    torch.manual_seed(0)
    m = TabRegressor()
    base = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    la = Lookahead(base)
    sc = torch.amp.GradScaler("cpu")
    r = dict(losses=[], ratio=[], held=[])
    seen = {}
    base.register_step_pre_hook(lambda o, a, k: seen.__setitem__("g", torch.cat([p.grad.flatten().clone()
                                                                                  for p in m.parameters()])))

    def body(i):
        la.zero_grad()
        x, y = tab_batch(i)
        with torch.autocast(**FP16):
            out = m(x)
        loss = F.mse_loss(out.float(), y)
        r["losses"].append(loss.item())
        sc.scale(loss).backward()
        clip_gradients(sc, la if right else base, m)
        unscaled = torch.cat([p.grad.flatten().clone() for p in m.parameters()])
        s0 = sc.get_scale()
        sc.step(la)
        sc.update()
        if sc.get_scale() >= s0:      # (a step the scaler skipped steps nothing)
            r["ratio"].append(float(seen["g"].norm() / unscaled.norm()))
    with torch.no_grad():
        h0 = sum(F.mse_loss(m(x), y).item() for x, y in map(tab_batch, range(9000, 9004)))
    rep, raised, warns = watched(m, body, 16, tmp_path / "run", opt=la, scaler=sc)
    with torch.no_grad():
        h1 = sum(F.mse_loss(m(x), y).item() for x, y in map(tab_batch, range(9000, 9004)))
    return rep, raised, warns, r, (h0, h1)


def test_lookahead_clip_helper_unscales_the_inner_optimizer_then_step_unscales_again(tmp_path):
    rep, raised, warns, r, held = lookahead_run(tmp_path, right=False)
    assert raised is None, raised              # torch says nothing: the two unscale_ calls are on two "optimizers"
    # the gradients SGD steps with are the clipped, unscaled ones divided by the loss scale once more
    assert r["ratio"] and all(x < 1e-3 for x in r["ratio"]), r["ratio"]
    assert held[1] > 0.95 * held[0], held      # it learns nothing
    check(rep, warns, "scaler_misorder", None, step=0, severity="error")


def test_twin_lookahead_unscaled_once_through_the_wrapper_is_quiet(tmp_path):
    rep, raised, warns, r, held = lookahead_run(tmp_path, right=True)
    assert all(abs(x - 1) < 1e-6 for x in r["ratio"]), r["ratio"]
    quiet(rep, raised, warns, held, fall=0.8)


# ======================================================================================================================
# 7. annealed gradient noise scaled by each tensor's gradient std: NaN for a one-element parameter
# ======================================================================================================================
class CosineHead(nn.Module):
    """Normalised prototypes and a learnable logit scale (CosFace/NormFace style): s * cos(x, w_c)."""

    def __init__(self, d, n_cls):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_cls, d) * 0.1)
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, h):
        return self.log_scale.exp() * F.linear(F.normalize(h, dim=-1), F.normalize(self.weight, dim=-1))


class CosClassifier(nn.Module):
    def __init__(self, d_in=24, d=32, n_cls=6):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d_in, d), nn.GELU(), nn.Linear(d, d))
        self.head = CosineHead(d, n_cls)

    def forward(self, x):
        return self.head(self.enc(x))


NOISE_FROM = 4     # the noise is switched on after the warm-up


def add_gradient_noise(model, step, eta=0.3, gamma=0.55):
    """Annealed Gaussian gradient noise (Neelakantan et al. 2015), each tensor's noise scaled by its own gradient's
    std so that it follows the loss scale (the gradients are still scaled here)."""
    sigma = eta / (1 + step) ** gamma
    for p in model.parameters():
        if p.grad is not None:
            p.grad.add_(torch.randn_like(p.grad) * sigma * p.grad.std())


def test_gradient_noise_scaled_by_grad_std_is_nan_for_the_scalar_logit_scale(tmp_path):
    torch.manual_seed(0)
    m = CosClassifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    r = dict(losses=[], skipped=[], bad_grads=[], scales=[])

    def body(i):
        opt.zero_grad()
        s, a = bc_batch(i)
        with torch.autocast(**FP16):
            out = m(s)
        loss = F.cross_entropy(out.float(), a)
        r["losses"].append(loss.item())
        sc.scale(loss).backward()
        if i >= NOISE_FROM:
            add_gradient_noise(m, i)
        r["bad_grads"].append([n for n, p in m.named_parameters() if not torch.isfinite(p.grad).all()])
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        s0 = sc.get_scale()
        r["scales"].append(s0)
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            r["skipped"].append(i)
    steps = NOISE_FROM + 16
    rep, raised, warns = watched(m, body, steps, tmp_path / "run", opt=opt, scaler=sc)
    assert raised is None and all(map(math.isfinite, r["losses"])), (raised, r["losses"])
    assert r["bad_grads"] == [[]] * NOISE_FROM + [["head.log_scale"]] * (steps - NOISE_FROM), r["bad_grads"]
    assert r["skipped"] == list(range(NOISE_FROM, steps)), r["skipped"]
    check(rep, warns, ("loss_scale_collapse", "nan_origin"), "head", step=NOISE_FROM, severity="error")


# ======================================================================================================================
# 8. GradScaler(growth_factor=16, growth_interval=3): the scale jumps past what the gradients allow, over and over
# ======================================================================================================================
def test_scaler_growth_factor_16_every_3_steps_skips_half_the_run(tmp_path):
    torch.manual_seed(0)
    m = TabRegressor()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", growth_factor=16.0, growth_interval=3)   # "recover fast after a backoff"
    r = dict(losses=[], skipped=[], scales=[], grad_absmax=[])

    def body(i):
        opt.zero_grad()
        x, y = tab_batch(i)
        with torch.autocast(**FP16):
            out = m(x)
        loss = F.mse_loss(out.float(), 10 * y)          # targets in their raw units (std ~5)
        r["losses"].append(loss.item())
        s0 = sc.get_scale()
        r["scales"].append(s0)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        r["grad_absmax"].append(max(float(p.grad.abs().max()) for p in m.parameters()))
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        if sc.get_scale() < s0:
            r["skipped"].append(i)
    steps = 40
    rep, raised, warns = watched(m, body, steps, tmp_path / "run", opt=opt, scaler=sc)
    assert raised is None and all(map(math.isfinite, r["losses"])), (raised, r["losses"])
    first_good = next(i for i in range(steps) if i not in r["skipped"])
    later = [s for s in r["skipped"] if s > first_good]
    # after the first search the scale finds a working value (4096), and every 3 clean steps x16 takes it to 65536,
    # where the gradients overflow again: half of the run's batches are thrown away, to the end
    assert len(later) >= 0.5 * (steps - first_good) and later[-1] >= steps - 3, r["skipped"]
    assert max(r["scales"][first_good:]) >= 16 * min(r["scales"][first_good:]), r["scales"]
    check(rep, warns, "skipped_steps", None, step=later[0], severity=("warning", "error"))


# ======================================================================================================================
# 9. optimizer.zero_grad() moved between unscale_ and step ("free the gradients before the optimizer allocates")
# ======================================================================================================================
def test_zero_grad_between_unscale_and_step_trains_nothing(tmp_path):
    torch.manual_seed(0)
    m = TabRegressor()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    r = dict(losses=[], moved=[], gnorm=[])

    def body(i):
        x, y = tab_batch(i)
        with torch.autocast(**FP16):
            out = m(x)
        loss = F.mse_loss(out.float(), y)
        r["losses"].append(loss.item())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        r["gnorm"].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        opt.zero_grad(set_to_none=True)        # (moved up from the top of the loop by a memory clean-up)
        before = weights(m)
        sc.step(opt)
        sc.update()
        r["moved"].append(any(not torch.equal(before[n], p) for n, p in m.named_parameters()))
    rep, raised, warns = watched(m, body, 10, tmp_path / "run", opt=opt, scaler=sc)
    assert raised is None, raised
    assert all(g > 0 and math.isfinite(g) for g in r["gnorm"]), r["gnorm"]   # every step had finite gradients ...
    assert not any(r["moved"]), r["moved"]                                 # ... and no step moved a weight
    check(rep, warns, "scaler_misorder", None, step=0, severity="error")


# ======================================================================================================================
# 10. layer-wise lr decay (BEiT-style, 0.65) with the exponent's sign flipped: the embedding gets lr x 270
# ======================================================================================================================
class DeepEncoder(nn.Module):
    """A pre-norm residual MLP encoder of 12 blocks over a token embedding (BEiT/ViT init: N(0, 0.02))."""

    def __init__(self, vocab=64, d=32, depth=12, n_cls=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, n_cls)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear):
                nn.init.zeros_(mod.bias)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h).mean(1))


def layer_id(name, depth):
    """BEiT's get_layer_id_for_vit: the embedding 0, block i i + 1, the rest depth + 1."""
    if name.startswith("emb"):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def llrd_groups(m, lr, decay, depth, flipped):
    groups = {}
    for n, p in m.named_parameters():
        lid = layer_id(n, depth)
        scale = decay ** (lid - (depth + 1)) if flipped else decay ** (depth + 1 - lid)
        groups.setdefault(lid, {"params": [], "lr": lr * scale})["params"].append(p)
    return list(groups.values())


def token_batch(i, B=16, T=8):
    ids = torch.randint(0, 64, (B, T), generator=gen(8000 + i))
    return ids, (ids % 5).mode(1).values


def test_llrd_exponent_flipped_gives_the_embedding_lr_x270_its_first_update_spikes(tmp_path):
    torch.manual_seed(0)
    depth = 12
    m = DeepEncoder(depth=depth)
    opt = torch.optim.AdamW(llrd_groups(m, 1e-3, 0.65, depth, flipped=True), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    r = dict(losses=[], factors=[])

    def body(i):
        opt.zero_grad()
        ids, y = token_batch(i)
        with torch.autocast(**FP16):
            out = m(ids)
        loss = F.cross_entropy(out.float(), y)
        r["losses"].append(loss.item())
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = weights(m)
        sc.step(opt)
        sc.update()
        r["factors"].append(spike_factors(before, weights(m)))
    rep, raised, warns = watched(m, body, 8, tmp_path / "run", opt=opt, scaler=sc)
    lrs = [g["lr"] for g in opt.param_groups]
    assert raised is None, raised
    assert max(lrs) == pytest.approx(1e-3 * 0.65 ** -13) and max(lrs) > 200e-3, lrs
    top = spiked_layer(r["factors"][0], at_least=5.0, margin=1.3)
    assert top == "emb", r["factors"][0]
    sev = ("warning", "error") if all(map(math.isfinite, r["losses"])) else ("error",)
    check(rep, warns, "update_spike", "emb", step=0, severity=sev)
