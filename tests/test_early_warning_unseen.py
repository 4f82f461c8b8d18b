"""headroom_trend as an early warning on creep mechanisms the earlier sets (test_headroom_trend.py,
test_early_warning2/3/4.py, test_trend_realistic.py, test_late_onset_unseen.py, test_stride_robust_unseen.py) do not
build: objectives with no floor that a model exploits by growing an fp16 output. CPU fp16 autocast + a real
GradScaler("cpu") (default init_scale), one intra-op thread, fixed seeds, the ordinary loop zero_grad -> forward ->
scale(loss).backward -> unscale_ -> clip_grad_norm_(1.0) -> step -> update, watched at the DEFAULT settings:
`ampdoctor.watch(model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run")`, then `w.report(replay=False)`.
The default series' stride follows the machine's load (1..32 on these tiny models; unpinned, case 1 named `prec` on
some runs and `enc.0` on others), so every run is watched with it pinned (tests/stride_sweep.install, as
test_early_warning4.py does) at 1, 8, 16 and 32; nothing else about the watch is changed.

Oracle (each run first UNWATCHED, with a plain forward hook on the target module only): the per-step abs-max of its
output and whether its inputs were finite. K = the first step whose target output holds inf (from finite inputs:
the target is the producer); the loss is non-finite there. Growth: the target's headroom log2(65504/abs-max) falls
>= 0.05 bits/step (least squares) over the 40 steps before K, falls in every 5-step block of them (within 0.3 bits
of batch noise), and is inside the rule's 8 bits at K - 10; in cases 1 and 4 the target's input (a Tanh's output)
stays within |h| <= 1 up to K (the growth is the target's own). In WGAN, triplet and BC the growing weights (or
1/std) make the scaled GRADIENTS grow too, so GradScaler backs off every 10-40 steps before K (finite loss,
finite forward: the scaler tracking them, each halving restoring the backward's room); K is the forward overflow,
not the first of those backoffs (the oracle asserts the forward was finite and the loss finite at every such
skip). The watched run must give the same losses (watching changes nothing).

Expected of the report: its EARLIEST headroom_trend (warning, or error once it came true) names an accepted module
(ACCEPT, below) at a step <= K - 10; and an overflow or nan_origin error at the producer at step K among the first
three findings.

A) creeping failures
   1. decoder_precision_black_border: an autoencoder with a learned per-pixel decoder PRECISION (prec = exp(lin(h)),
      a Gaussian NLL, Adam lr 0.01) on images whose 4 border pixels are always 0 (MNIST's border): the sigmoid mean
      drives those pixels' residual to 0 exponentially, the NLL's -0.5 log(prec) term has no floor, Adam moves
      log-prec a near-constant amount per step: `prec` (exp in fp16) grows exponentially (0.17 bits/step) to inf.
      Accepted: `prec` (the producer) and its child `prec.lin` (the log-precision Adam drives up).
   2. wgan_critic_no_lipschitz: a WGAN critic (3 Linear, LeakyReLU) against a frozen generator, loss D(fake) -
      D(real) with neither weight clipping nor gradient penalty, Adam(0.02, betas 0.5/0.9): every layer's weights
      grow ~lr a step, the critic's output polynomially (decelerating in bits) to inf at `critic.out`.
      Accepted: `critic.out` (the producer) and its parent `critic` (its output is critic.out's).
   3. triplet_without_hinge: a triplet loss written as mean(d(a,p) - d(a,n)) with the relu(. + margin) forgotten,
      Adam 3e-3: the embedder scales its embeddings up without bound, `dist` (squared distance, fp16, no weights)
      grows at twice their rate to inf. Accepted: `dist` (the producer) and `net` / `net.2`, the Sequential and its
      last Linear whose output dist squares (dist is weightless; the growth is that layer's, the convention
      test_early_warning4.py accepts for q/k before `score`). dist's parent is the root and it has no children.
   4. bc_gripper_always_closed: behaviour cloning of a Gaussian policy (tanh mean, state-dependent log-std head
      clamped to [-20, 2] as Stable-Baselines3 does) on demonstrations whose gripper action is +1 in every frame:
      that dimension's mean saturates toward +1, its residual vanishes exponentially, the NLL's -log(1/std) has no
      floor (the clamp at -20 allows 1/std = e^20, far past fp16's max): `inv_std` = exp(-log_std) in fp16 grows
      ~0.12 bits/step to inf (Adam lr 0.01). Accepted: `inv_std` (the producer) and its child `inv_std.lin`.
B) healthy twins (finite losses falling, at most one backoff after step 10, no inf): no headroom_trend at any
   severity and no warning or error at all:
   1. decoder_precision_soft_capped: case 1 with PETS' soft bound on the log-precision (cap - softplus(cap - lp),
      cap 6): `prec` 15.1 -> 7.4 bits in ~40 steps, then flat;
   2. wgan_weight_clipped: case 2 with the original WGAN's weight clipping (0.1), lr 0.01: the critic's output
      17.9 -> ~11.5 bits in ~25 steps, then flat;
   3. triplet_with_hinge: case 3 with relu(d(a,p) - d(a,n) + 50): `dist` 13.4 -> ~6.2 bits by step ~45 (the
      loss 0 from there), then flat within batch noise;
   4. pointer_logits_saturate: a pointer network (queries point at a shuffled, noisy copy of themselves; logits
      q.k/sqrt(d) in `logits`, q and k its children, no QK-norm), cross-entropy, Adam lr 0.03: the logits
      16.5 -> ~10 bits in ~15 steps, then flat (CE's gradient fades once the pointers are right).
   Not kept: the pointer with Adam's beta2 at 0.95 and lr 0.01-0.1, meant as a creeping case (attention logit
   growth): it too saturated at 9-10 bits over 300 steps; a BC twin with log-std floored at -4: 6 backoffs in
   steps 18-32 (its gradient grows with 1/std before the floor holds).

Result when written (torch CPU, ~25 s for all 32 runs on one core; two runs, identical): 23 pass, 9 xfail.
  K (first inf, the oracle's) and ampdoctor's earliest headroom_trend, per stride:
  1. decoder_precision_black_border, K = 94: `prec` step 47 (7.9 bits, forecast < 94) at strides 1, 16, 32 (pass);
     at stride 8 `headroom_trend at enc.0 step 49: ... 14.1 bits left ... falling 0.04 bits/step, forecast to
     overflow around step 99; `prec`, which takes its values, is the first to reach the max` (XFAIL: enc.0 feeds a
     Tanh, |h| <= 1 is asserted by the oracle, so its growth cannot reach prec; prec's own weights carry the whole
     fall). Unpinned runs gave either answer. `overflow at prec step 94` is 1st in the report (right). Fixed since
     (rules/headroom.py: `prec` has no weights of its own but its child `lin` has, so it is no weightless product
     whose growth is its inputs'; enc.0 and mu had been taken for its factors): `prec` step 49 at stride 8 (pass).
  2. wgan_critic_no_lipschitz, K = 83: `[error] headroom_trend at critic.l2 step 29: ... 9.1 bits left at step
     29, falling 0.12 bits/step, forecast to overflow around step 56; `critic.out`, which takes its values, is the
     first to reach the max` at every stride (XFAIL by the acceptance set above: critic.l2 is a sibling of the
     producer). Judgement call, stated honestly: over steps 43-83 critic.out's input (l2 after LeakyReLU) falls
     0.053 bits/step and its output 0.081, so l2 carries ~2/3 of the fall and critic.out's own weights ~1/3; every
     layer grows. `overflow at critic.out step 83` is 1st (right).
  3. triplet_without_hinge, K = 96: `[warning] headroom_trend at dist step 35` (5.7 bits) at every stride (pass);
     `overflow at dist step 96` among the first three (right).
  4. bc_gripper_always_closed, K = 103: `headroom_trend at inv_std` step 50 (strides 1, 8) / 41 (16, 32), right;
     but the overflow is `[error] overflow at inv_std step 105` (the first inf is at 103: the loss is NaN from
     103, and 103 is a skipped step) next to `[error] nan_origin at (run) step 103: The loss became non-finite at
     step 103, a step without per-layer statistics; ...` (XFAIL at every stride: no overflow/nan_origin at
     inv_std at step 103). Fixed since (rules/steps.series_onset: a forward producer located on a sampled step
     is dated at the run's first forward-bad step when that routine step's always-on series saw the same module's
     output go non-finite first): `[error] overflow at inv_std step 103 ... (seen on sampled step 105)` (pass).
  Twins: all four quiet at every stride (pass).
Seen but not asserted: the triplet run's report leads with `[error] overflow at net.0 step 3: In the backward pass
...`, a backoff inside GradScaler's first search from 65536 (its twin, with the same skip at step 3, gets no such
error); its headroom_trend stays a `warning` after the forecast came true (the other cases turn `error`).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import WrongAnswer, wrong  # noqa: E402
from scenarios import alarms, gen, lines, one_thread  # noqa: E402
import stride_sweep  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16_MAX = 65504.0
LEAD = 10          # the promise: a warning at least this many steps before the first inf
SEARCH = 10        # GradScaler's first steps: a skip there is its search for a scale
AFTER_BAD = 5      # steps run after K
SPAN = 40          # the oracle's steady fall: over this many steps before K
STRIDES = (1, 8, 16, 32)   # the default watch's series stride, pinned (its budget picks 1..32 on these tiny models)


def bits(v):
    return math.log2(FP16_MAX / v) if v > 0 and math.isfinite(v) else (math.inf if v == 0 else -math.inf)


def slope(pts):
    n = len(pts)
    mx, my = sum(s for s, _ in pts) / n, sum(v for _, v in pts) / n
    return sum((s - mx) * (v - my) for s, v in pts) / sum((s - mx) ** 2 for s, _ in pts)


def check(cond, *what):
    """A report check: its failure is a WrongAnswer (the one expected failure of a case marked `wrong`)."""
    if not cond:
        raise WrongAnswer(repr(what))


# --- the loop and the oracle ---------------------------------------------------------------------------------------

def run(sc, *, watched, rd=None, steps=None):
    """The user's loop; unwatched: a forward hook on sc["target"] records its output abs-max per step (the largest
    over the step's calls), the first step it holds inf/NaN, and whether its inputs were finite then."""
    m, opt = sc["model"], sc["opt"]
    scaler = torch.amp.GradScaler("cpu")
    state = {"i": 0}
    r = {"amax": {}, "inmax": {}, "first": None, "in_ok": None, "losses": [], "skips": [], "rep": None}
    hook = None
    if not watched:
        def f(mod, args, out):
            v = out.detach().float().abs().max().item()
            a = r["amax"]
            a[state["i"]] = max(v, a.get(state["i"], 0.0)) if math.isfinite(v) else v
            r["inmax"][state["i"]] = max(x.detach().float().abs().max().item() for x in args if torch.is_tensor(x))
            if not math.isfinite(v) and r["first"] is None:
                r["first"] = state["i"]
                r["in_ok"] = all(bool(torch.isfinite(x).all()) for x in args if torch.is_tensor(x))
        hook = dict(m.named_modules())[sc["target"]].register_forward_hook(f)
    w = ampdoctor.watch(m, optimizer=opt, scaler=scaler, run_dir=rd) if watched else None
    for i in range(steps or sc["steps"]):
        state["i"] = i
        opt.zero_grad()
        args, y = sc["batch"](i)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(*args)
        loss = sc["loss"](out, y)
        r["losses"].append(loss.item())
        s0 = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < s0:
            r["skips"].append(i)
        if sc.get("after") is not None:
            sc["after"](m)
        if not watched and r["first"] is not None and i >= r["first"] + AFTER_BAD:
            break
    if hook is not None:
        hook.remove()
    if w is not None:
        w.close()
        r["rep"] = w.report(replay=False)
    return r


def same_losses(a, b):
    la, lb = a["losses"], b["losses"]
    assert len(la) == len(lb) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(la, lb)), (la, lb)


# --- A1 / B1: autoencoder with a learned per-pixel decoder precision ----------------------------------------------

class PixPrec(nn.Module):
    def __init__(self, d, n, cap=None):
        super().__init__()
        self.lin, self.cap = nn.Linear(d, n), cap

    def forward(self, h):
        lp = self.lin(h)
        if self.cap is not None:              # PETS' soft upper bound on the log-precision
            lp = self.cap - F.softplus(self.cap - lp)
        return torch.exp(lp)


class AE(nn.Module):
    def __init__(self, cap=None):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 8), nn.Tanh())
        self.mu, self.prec = nn.Linear(8, 16), PixPrec(8, 16, cap)

    def forward(self, x):
        h = self.enc(x)
        return torch.sigmoid(self.mu(h)), self.prec(h)


BORDER = torch.tensor([1.0] * 12 + [0.0] * 4)      # 4 pixels always black


def sc_decoder_precision(cap=None, steps=130):
    torch.manual_seed(0)
    m = AE(cap)

    def batch(i):
        x = torch.rand(64, 16, generator=gen(40000 + i % 32)) * BORDER
        return (x,), x

    def loss(out, y):
        mu, prec = out[0].float(), out[1].float()
        return (0.5 * prec * (mu - y) ** 2 - 0.5 * torch.log(prec)).mean()
    return dict(model=m, opt=torch.optim.Adam(m.parameters(), lr=0.01), batch=batch, loss=loss, steps=steps,
                target="prec")


# --- A2 / B2: WGAN critic --------------------------------------------------------------------------------------

class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.out(F.leaky_relu(self.l2(F.leaky_relu(self.l1(x), 0.2)), 0.2))


class WGAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)).requires_grad_(False)
        self.critic = Critic()

    def forward(self, real, z):
        return self.critic(torch.cat([real, self.gen(z)]))


REAL_MU = torch.randn(16, generator=gen(3))


def sc_wgan(clip=None, lr=0.02, steps=130):
    torch.manual_seed(0)
    m = WGAN()

    def batch(i):
        real = REAL_MU + 0.5 * torch.randn(32, 16, generator=gen(i))
        return (real, torch.randn(32, 8, generator=gen(10000 + i))), None

    def loss(out, y):
        d = out.float()
        return d[32:].mean() - d[:32].mean()

    def after(mm):                                      # the original WGAN's weight clipping
        with torch.no_grad():
            for p in mm.critic.parameters():
                p.clamp_(-clip, clip)
    return dict(model=m, opt=torch.optim.Adam(m.critic.parameters(), lr=lr, betas=(0.5, 0.9)), batch=batch,
                loss=loss, steps=steps, target="critic.out", after=after if clip is not None else None)


# --- A3 / B3: triplet loss ----------------------------------------------------------------------------------------

class Dist(nn.Module):
    """Squared Euclidean distance, written out (fp16 in, fp16 out under autocast)."""

    def forward(self, a, b):
        d = a - b
        return (d * d).sum(-1)


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.dist = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32)), Dist()

    def forward(self, a, p, n):
        ea, ep, en = self.net(a), self.net(p), self.net(n)
        return self.dist(ea, ep), self.dist(ea, en)


CENTRES = torch.randn(10, 16, generator=gen(11))


def sc_triplet(margin=None, steps=150):
    torch.manual_seed(0)
    m = Embedder()

    def batch(i):
        g = gen(20000 + i)
        c = torch.randint(0, 10, (32,), generator=g)
        c2 = (c + torch.randint(1, 10, (32,), generator=g)) % 10
        a, p, n = (CENTRES[k] + 0.3 * torch.randn(32, 16, generator=g) for k in (c, c, c2))
        return (a, p, n), None

    def loss(out, y):
        dp, dn = out[0].float(), out[1].float()
        return (dp - dn).mean() if margin is None else F.relu(dp - dn + margin).mean()
    return dict(model=m, opt=torch.optim.Adam(m.parameters(), lr=3e-3), batch=batch, loss=loss, steps=steps,
                target="dist")


# --- B4: pointer network ---------------------------------------------------------------------------------

class PtrLogits(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.d = nn.Linear(d, d), nn.Linear(d, d), d

    def forward(self, xq, xk):
        return self.q(xq) @ self.k(xk).transpose(-1, -2) / math.sqrt(self.d)


class Pointer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.logits = nn.Linear(16, 32), PtrLogits(32)

    def forward(self, a, b):
        return self.logits(self.emb(a), self.emb(b))


def sc_pointer(lr=0.03, beta2=0.999, steps=150):
    torch.manual_seed(0)
    m = Pointer()

    def batch(i):
        g = gen(30000 + i)
        a = torch.randn(8, 12, 16, generator=g)
        perm = torch.argsort(torch.rand(8, 12, generator=g), -1)
        b = torch.empty_like(a).scatter_(1, perm[..., None].expand(-1, -1, 16), a)      # b[perm[i]] = a[i]
        return (a, b + 0.3 * torch.randn(8, 12, 16, generator=g)), perm

    def loss(out, y):
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
    return dict(model=m, opt=torch.optim.Adam(m.parameters(), lr=lr, betas=(0.9, beta2)), batch=batch, loss=loss,
                steps=steps, target="logits")



# --- A4: behaviour cloning, Gaussian policy ----------------------------------------------------------------------

class InvStd(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.lin = nn.Linear(d, n)

    def forward(self, h):
        return torch.exp(-self.lin(h).clamp(-20.0, 2.0))        # SB3's LOG_STD_MIN / LOG_STD_MAX


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 64), nn.Tanh())
        self.mu, self.inv_std = nn.Linear(64, 4), InvStd(64, 4)

    def forward(self, obs):
        h = self.trunk(obs)
        return torch.tanh(self.mu(h)), self.inv_std(h)


W_EXPERT = torch.randn(10, 3, generator=gen(5)) * 0.3


def sc_bc(steps=130):
    torch.manual_seed(0)
    m = Policy()

    def batch(i):
        obs = torch.randn(128, 10, generator=gen(50000 + i % 64))
        return (obs,), torch.cat([torch.tanh(obs @ W_EXPERT), torch.ones(128, 1)], 1)   # gripper always closed

    def loss(out, a):
        mu, inv = out[0].float(), out[1].float()
        return (0.5 * ((a - mu) * inv) ** 2 - torch.log(inv)).sum(-1).mean()
    return dict(model=m, opt=torch.optim.Adam(m.parameters(), lr=0.01), batch=batch, loss=loss, steps=steps,
                target="inv_std")


# --- the tests --------------------------------------------------------------------------------------------------

FAILING = {
    # name: (scenario, accepted headroom_trend modules (see the docstring), the producer)
    "decoder_precision_black_border": (sc_decoder_precision, ("prec", "prec.lin"), "prec"),
    "wgan_critic_no_lipschitz": (sc_wgan, ("critic.out", "critic"), "critic.out"),
    "triplet_without_hinge": (sc_triplet, ("dist", "net", "net.2"), "dist"),
    "bc_gripper_always_closed": (sc_bc, ("inv_std", "inv_std.lin"), "inv_std"),
}
BOUNDED_INPUT = ("decoder_precision_black_border", "bc_gripper_always_closed")
_WGAN = ("headroom_trend at critic.l2 step 29 (9.1 bits left, 0.12 bits/step, forecast ~56; `critic.out` first to "
         "reach the max): a sibling of the producer critic.out (4.9 bits at step 29; inf at 83), not it or its parent")
FAILING_WRONG: dict[tuple, str] = {
    **{("wgan_critic_no_lipschitz", k): _WGAN for k in STRIDES},
}


@pytest.mark.parametrize("name,stride", [
    pytest.param(n, k, marks=[wrong(FAILING_WRONG[(n, k)])] if (n, k) in FAILING_WRONG else [], id=f"{n}-stride{k}")
    for n in FAILING for k in STRIDES])
def test_creep_is_warned_10_steps_before_the_overflow(name, stride, tmp_path, monkeypatch):
    maker, accept, producer = FAILING[name]
    ref = run(maker(), watched=False)
    k = ref["first"]
    # the oracle: a forward overflow at the target from finite inputs, the loss non-finite there
    assert k is not None and k >= SPAN + SEARCH, (k, ref["losses"][-3:])
    assert ref["in_ok"], "the target's inputs were not finite at K: not the producer"
    assert not math.isfinite(ref["losses"][k]), ref["losses"][k]
    assert all(map(math.isfinite, ref["losses"][:k])), ref["losses"][:k]
    assert all(math.isfinite(ref["amax"][s]) for s in range(k)), "inf before K"
    hb = {s: bits(v) for s, v in ref["amax"].items() if s < k}
    rate = -slope([(s, hb[s]) for s in range(k - SPAN, k)])
    assert rate >= 0.05, rate
    for s in range(k - SPAN, k - 5, 5):
        assert hb[s + 5] < hb[s] + 0.3, (s, hb[s], hb[s + 5])
    assert hb[k - LEAD] < 8.0, hb[k - LEAD]
    if name in BOUNDED_INPUT:               # the target's input is a tanh output: |h| <= 1, nothing upstream grows it
        assert max(ref["inmax"][s] for s in range(k + 1)) <= 1.0, "input not bounded"
    # the watched run: the default watch, its series' stride pinned; the same losses
    stride_sweep.install(stride, patch=monkeypatch.setattr)
    wr = run(maker(), watched=True, rd=str(tmp_path / "run"), steps=len(ref["losses"]))
    same_losses(ref, wr)
    rep = wr["rep"]
    trend = sorted((f for f in rep.findings if f.rule == "headroom_trend"), key=lambda f: f.step)
    check(trend, "no headroom_trend", "K", k, lines(rep)[:6])
    first = trend[0]
    check(first.severity in ("warning", "error"), first.one_line())
    check(first.module in accept, "names", first.module, "not", accept, "K", k, first.one_line())
    check(first.step <= k - LEAD, "at", first.step, "K", k, first.one_line())
    check(first.evidence.get("forecast_step", -1) > first.step, first.evidence)
    top = [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]
    check(any(r in ("overflow", "nan_origin") and mod == producer and st == k and sev == "error"
              for r, mod, st, sev in top), "no overflow/nan_origin at", producer, "step", k, lines(rep)[:4])


HEALTHY = {
    # name: scenario
    "decoder_precision_soft_capped": lambda: sc_decoder_precision(cap=6.0, steps=150),
    "wgan_weight_clipped": lambda: sc_wgan(clip=0.1, lr=0.01, steps=150),
    "triplet_with_hinge": lambda: sc_triplet(margin=50.0, steps=150),
    "pointer_logits_saturate": lambda: sc_pointer(lr=0.03, steps=150),
}
HEALTHY_WRONG: dict[tuple, str] = {}


@pytest.mark.parametrize("name,stride", [
    pytest.param(n, k, marks=[wrong(HEALTHY_WRONG[(n, k)])] if (n, k) in HEALTHY_WRONG else [], id=f"{n}-stride{k}")
    for n in HEALTHY for k in STRIDES])
def test_healthy_twin_is_silent(name, stride, tmp_path, monkeypatch):
    ref = run(HEALTHY[name](), watched=False)
    ls = ref["losses"]
    assert ref["first"] is None and all(map(math.isfinite, ls)), ref["first"]
    assert len([s for s in ref["skips"] if s >= SEARCH]) <= 1, ref["skips"]
    k = len(ls) // 5
    assert sum(ls[-k:]) / k < sum(ls[:k]) / k - 0.05 * abs(sum(ls[:k]) / k), ls
    hb = [bits(v) for _, v in sorted(ref["amax"].items())]
    assert hb[0] - min(hb) > 3.0, "no growth"                          # it grows early...
    late = hb[len(hb) // 2:]
    assert max(late) - min(late) < 1.5 and min(hb) > 1.5, late       # ... and settles, well below the max
    stride_sweep.install(stride, patch=monkeypatch.setattr)
    wr = run(HEALTHY[name](), watched=True, rd=str(tmp_path / "run"))
    same_losses(ref, wr)
    rep = wr["rep"]
    check(not [f for f in rep.findings if f.rule == "headroom_trend"], lines(rep))
    check(not alarms(rep.findings), lines(rep))
