"""REINFORCEMENT-LEARNING TRAINING LOOPS under fp16: the loss terms RL adds to a plain
supervised loss (PPO's importance ratio, the policy entropy, advantage normalisation, an unscaled value target, a
Gaussian policy's log-prob, a hand-made logsumexp over Q-values), each broken by fp16 at a known step, on synthetic
rollouts (random observations, actions, advantages and returns from fixed seeds; no gym).

Loop (`rl_run`, this file's own: probe_run has one optimizer and one backward per batch): per rollout, the
update yields one or more minibatch losses (forward and loss under CPU fp16 autocast); each: zero_grad ->
scaler.scale(loss).backward -> unscale_ each optimizer -> clip_grad_norm_(0.5) each parameter group ->
scaler.step each -> scaler.update -> [a no-grad callback: polyak]. AdamW; one GradScaler("cpu") at its defaults,
shared by all optimizers; ampdoctor.watch(model, optimizer=the first, scaler=scaler, run_dir=tmp_path). The rollout
buffers the fp16 actor filled (behaviour log-probs, returns) are fp16 in the run.

Oracle for every failure (a failing oracle is a plain failure, never an xfail): one update per rollout, so step =
rollout; the loss is first non-finite at the bad step K and the scaler skips it (before K only the first steps'
backoffs); probe_harness.Producer names the module expected (None for user code: every model output finite in the
re-run); rollout K re-run from the weights it ran with (fp16 autocast + fp16 buffers) is non-finite, and in fp32
(no autocast, fp32 buffers) the model outputs and the loss are finite (fp16's doing). Report check: among the first
three findings a warning/error of an accepted rule at that module ("(run)" = None), step K, phase forward/null, and no
overflow/nan_origin error at a module that only passed the value on. A wrong report raises WrongAnswer (strict xfail
through probe_harness.wrong).

Failures:
 ppo_ratio_fp16 (user code, K=5)  ratio = exp(logp_new - logp_old) with both in fp16 (Categorical(logits=fp16) and the
     fp16 buffer); at K 8 samples come from a stale actor (logp_old -14, advantages -1): exp(12.6) = 3e5 > 65504 ->
     inf, min(ratio * A, clip * A) = -inf, the loss inf. fp32: 3e5, finite.
 entropy_head (module `ent`, K=4)  -sum(p log p) from an fp16 softmax in a head of the model; obs x40 from K (a
     sensor switched units): logit gaps > 17 flush p to 0, log(0) = -inf, 0 * -inf = NaN. fp32: p ~ e^-45, finite.
 entropy_user (user code, K=6)  the same entropy written in the loss code outside the model.
 adv_norm_eps (user code, K=5)  REINFORCE, advantages (G - mean) / (std + 1e-8) on the fp16 returns buffer; at K
     every episode got the same return: std 0, the eps rounds to 0 in fp16, 0 / 0 = NaN (fp32: 0 / 1e-8 = 0).
 value_unscaled (user code, K=4)  value loss 0.5 (v - G)^2 on the fp16 returns buffer; from K a goal bonus makes
     returns ~1.5e3: the square (~2e6) overflows to inf.
 gauss_logstd (module `logp`, K=5)  state-dependent Gaussian policy, log_std clamped to [-20, 2] (SAC's
     LOG_STD_MIN), log-prob by hand in a GaussLogProb module; at K the std collapsed (the log_std head's bias at
     -25): exp(-20) = 2e-9 is 0 in fp16, (a - mu) / 0 = inf. fp32: z ~ 1e8, z^2 ~ 1e17, finite.
 softq_lse (module `lse`, K=4)  CQL-style regulariser logsumexp(Q) - Q(a) with log(sum(exp(q))) by hand in a module;
     obs x20 from K push Q to ~16-21: exp > 65504 -> inf. fp32: finite.
Healthy twins (each run with and without the watch: losses, skips and final weights bitwise identical; every loss
and weight finite; no producer; no skip but the first steps' or the scaled rollouts' ordinary backoffs, which the
unwatched run makes too; no warning/error and no ampdoctor RuntimeWarning):
 ppo_fp32_ratio_two_opts  PPO, 3 epochs x 2 shuffled minibatches per rollout (42 steps), actor and critic with
     separate AdamWs sharing one GradScaler (two unscale_/clip/step, one update), ratio and entropy on fp32 logits
     via torch.distributions, the ~1e3 returns normalised in fp32.
 a2c_fp32_entropy         entropy_*'s data (obs x40), Categorical(logits=logits.float()).entropy().
 reinforce_fp32_advnorm   adv_norm_eps's data, the normalisation in fp32.
 gauss_clamp5_distributions  gauss_logstd's injection, log_std clamped to [-5, 2], Normal(...) on fp32.
 softq_target_polyak      soft Q-learning on softq_lse's data with torch.logsumexp on fp32 Q-values, a target network
     (a copy outside the watched model) evaluated under no_grad and updated by polyak averaging after each step.

Result when written (torch 2.13 CPU): 11 pass, 1 xfail (stable over two runs; whole file ~4 s); 12 pass since. Top findings:
 ppo_ratio_fp16, value_unscaled  `[error] overflow at (run) step <K>: The loss became inf outside the watched model
     (in the loss computation) while the model's outputs were finite.` (fix: the loss in fp32).
 entropy_user  `[error] nan_origin at (run) step 6: The loss became NaN outside the watched model ...`.
 entropy_head  `[error] overflow at ent aten::log step 4: aten::log in `ent` hit its singular point ... -inf`.
 gauss_logstd  `[error] overflow at logp aten::div step 5: aten::div in `logp` hit its singular point ... ±inf`.
 softq_lse     `[error] overflow at lse aten::exp step 4: ... (input up to 16.2; fp16 exp(x) is inf for x > 11.09)`.
 adv_norm_eps  XFAIL when written (wrong answer; fixed since): `[error] overflow at (run) step 5: The loss became NaN
     outside the watched model ...; none of its ops makes NaN from finite values, so one of them overflowed to inf
     first (then inf - inf or 0 * inf made the NaN).` No inf was ever made: the NaN is 0 / 0 from an eps that vanished
     in fp16. Now the record says one of the loss's ops took a tensor that needs no gradient (StepRecord.loss_consts),
     and the answer is `[error] nan_origin at (run) step 5`: that value may have held the NaN (a 0 / 0, an eps that
     vanishes in fp16) or an op overflowed first; the fix normalises the advantages in fp32.
 Twins: only info findings (the scaler's backoffs, skipped_steps at a normal rate); the PPO twin has none.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical, Normal

import ampdoctor
from probe_harness import Producer, WrongAnswer, finite, named_top3, wrong
from scenarios import alarms, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

OBS, ACT, HID = 8, 4, 32


def rn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7100 + seed))


def ri(n, hi, seed):
    return torch.randint(0, hi, (n,), generator=torch.Generator().manual_seed(7200 + seed))


# ------------------------------------------------------------------------------------------------------- networks

def mlp(n_out):
    return nn.Sequential(nn.Linear(OBS, HID), nn.ReLU(), nn.Linear(HID, n_out))


class Entropy(nn.Module):
    """The policy's entropy by hand, -sum(p log p), from an fp16 softmax (inside the model)."""

    def forward(self, logits):
        p = torch.softmax(logits, -1)
        return -(p * p.log()).sum(-1)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs; `ent`: the entropy computed by a head of the model."""

    def __init__(self, ent=False):
        super().__init__()
        self.actor, self.critic = mlp(ACT), mlp(1)
        self.ent = Entropy() if ent else None

    def forward(self, obs):
        logits, v = self.actor(obs), self.critic(obs)[:, 0]
        return (logits, v) if self.ent is None else (logits, v, self.ent(logits))


class GaussLogProb(nn.Module):
    """log N(a; mu, exp(log_std)) by hand (the SAC/PPO-continuous formula)."""

    def forward(self, mu, log_std, a):
        z = (a - mu) / log_std.exp()
        return (-0.5 * z.pow(2) - log_std - 0.9189385).sum(-1)


class GaussPolicy(nn.Module):
    """State-dependent Gaussian policy; log_std clamped to [lo, 2] (LOG_STD_MIN = -20 in many SAC codes)."""

    def __init__(self, lo=-20.0, by_hand=True):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS, HID), nn.ReLU())
        self.mu, self.ls, self.critic = nn.Linear(HID, 2), nn.Linear(HID, 2), mlp(1)
        self.lo = lo
        self.logp = GaussLogProb() if by_hand else None

    def forward(self, obs, act):
        h = self.body(obs)
        mu, log_std = self.mu(h), self.ls(h).clamp(self.lo, 2.0)
        v = self.critic(obs)[:, 0]
        if self.logp is not None:
            return self.logp(mu, log_std, act), v
        return Normal(mu.float(), log_std.float().exp()).log_prob(act).sum(-1), v


class SoftMax(nn.Module):
    """logsumexp over the Q-values by hand (no max subtracted): the soft value / CQL's regulariser."""

    def forward(self, q):
        return q.exp().sum(-1).log()


class QNet(nn.Module):
    def __init__(self, by_hand=True):
        super().__init__()
        self.q = mlp(ACT)
        self.lse = SoftMax() if by_hand else None

    def forward(self, obs):
        q = self.q(obs)
        return q, (self.lse(q) if self.lse is not None else torch.logsumexp(q.float(), -1))


# ----------------------------------------------------------------------------------------------------------- loop

AC = dict(device_type="cpu", dtype=torch.float16)


def rl_run(m, update, rollouts, run_dir, *, groups=None, lr=3e-4, clip=0.5, watch=True, snap_at=None, inject=None,
           after=None):
    """The user's RL loop: one AdamW per parameter group (`groups(m)`, e.g. actor and critic; default one over
    m.parameters()) sharing one GradScaler("cpu"), under ampdoctor.watch(m, optimizer=the first, scaler, run_dir).
    Per rollout i: [inject(i, m) under no_grad] -> for each minibatch loss that `update(i, m)` yields (the
    forward and the loss run under fp16 autocast inside it): zero_grad -> scale(loss).backward -> unscale_ each
    optimizer -> clip_grad_norm_ each group -> scaler.step each -> scaler.update -> [after(step, m)]. The
    Producer oracle (watched runs only) counts optimizer steps. Returns losses, steps with a non-finite loss,
    skipped steps, the rollout of each step, the oracle's first producer, (snap_at) the weights rollout snap_at's
    forward ran with, the final weights, ampdoctor's RuntimeWarnings and the report."""
    params = [list(g) for g in groups(m)] if groups else [list(m.parameters())]
    opts = [torch.optim.AdamW(p, lr=lr) for p in params]
    sc = torch.amp.GradScaler("cpu")
    orc = Producer(m, with_kwargs=True) if watch else None
    r = dict(losses=[], bad_loss=[], skipped=[], rollout=[], sd=None, rep=None)
    k = 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opts[0], scaler=sc, run_dir=run_dir) if watch else None
        for i in range(rollouts):
            if inject is not None:
                with torch.no_grad():
                    inject(i, m)
            if i == snap_at:
                r["sd"] = {n: v.detach().clone() for n, v in m.state_dict().items()}
            it = iter(update(i, m))
            while True:
                if orc is not None:
                    orc.step = k
                for o in opts:
                    o.zero_grad()
                loss = next(it, None)
                if loss is None:
                    break
                r["losses"].append(loss.item())
                r["rollout"].append(i)
                if not math.isfinite(loss.item()):
                    r["bad_loss"].append(k)
                s0 = sc.get_scale()
                sc.scale(loss).backward()
                for o, p in zip(opts, params):
                    sc.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(p, clip)
                for o in opts:
                    sc.step(o)
                sc.update()
                if sc.get_scale() < s0:
                    r["skipped"].append(k)
                if after is not None:
                    with torch.no_grad():
                        after(k, m)
                k += 1
        if orc is not None:
            orc.remove()
        if w is not None:
            w.close()
            r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["first"] = orc.first if orc is not None else None
    r["weights"] = {n: v.detach().clone() for n, v in m.state_dict().items()}
    return r


def one_update(loss_fn, batch):
    """A rollout's update as one minibatch: batch(i, fp16 buffers) -> loss_fn(m, b) under fp16 autocast."""
    def upd(i, m):
        b = batch(i, torch.float16)
        with torch.autocast(**AC):
            loss = loss_fn(m, b)
        yield loss
    return upd


# ------------------------------------------------------------------------------------------------------- rollouts
# batch(i, dt) -> the rollout of iteration i (fixed seeds); `dt` is the dtype of the buffers the fp16 actor filled
# (float16 in the run, float32 in the oracle's fp32 re-run of the bad step).

N = 64


def base(i, dt, s=1.0):
    return dict(obs=rn(N, OBS, seed=i % 4) * s, act=ri(N, ACT, seed=i % 4), adv=rn(N, seed=10 + i % 4),
                ret=(rn(N, seed=20 + i % 4) * 2.0).to(dt))


def b_ppo(K):
    """Behaviour log-probs from the (near-uniform) actor, kept in the fp16 buffer; at K the first 8 samples come
    from a stale actor (an async actor-learner many versions behind): logp_old -14, with negative advantages."""
    def b(i, dt):
        d = base(i, dt)
        d["logp_old"] = torch.full((N,), -math.log(ACT)).to(dt)
        if i == K:
            d["logp_old"][:8] = -14.0
            d["adv"][:8] = -1.0
        return d
    return b


def b_obs_scale(K, s):
    """Unnormalised observations from K on (a sensor switched units): obs x s."""
    return lambda i, dt: base(i, dt, s if i >= K else 1.0)


def b_sparse(K):
    """Monte-Carlo returns in the fp16 buffer; at K every episode of the batch got the same return (sparse reward,
    all successes)."""
    def b(i, dt):
        d = base(i, dt)
        if i == K:
            d["ret"] = torch.ones(N, dtype=dt)
        return d
    return b


def b_big_returns(K):
    """Unnormalised returns in the fp16 buffer: from K on a goal bonus makes them ~1e3."""
    def b(i, dt):
        d = base(i, dt)
        if i >= K:
            d["ret"] = (1500.0 + 300.0 * rn(N, seed=30 + i)).to(dt)
        return d
    return b


def b_cont(K):
    def b(i, dt):
        d = base(i, dt)
        d["act"] = rn(N, 2, seed=40 + i % 4).clamp(-1, 1)
        return d
    return b


# ---------------------------------------------------------------------------------------------------------- losses

def ppo_loss(m, b, fp32=False):
    logits, v = m(b["obs"])[:2]
    logp = Categorical(logits=logits).log_prob(b["act"])
    if fp32:
        ratio = (logp.float() - b["logp_old"].float()).exp()
    else:
        ratio = (logp - b["logp_old"]).exp()           # fp16 - fp16 -> fp16 exp
    adv = b["adv"]
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    return pg + 0.5 * F.mse_loss(v.float(), b["ret"].float())


def a2c_inside(m, b):
    logits, v, ent = m(b["obs"])
    logp = Categorical(logits=logits).log_prob(b["act"])
    return -(logp * b["adv"]).mean() - 0.01 * ent.mean() + 0.5 * F.mse_loss(v.float(), b["ret"].float())


def a2c_outside(m, b):
    logits, v = m(b["obs"])
    p = torch.softmax(logits, -1)
    ent = -(p * p.log()).sum(-1)
    logp = Categorical(logits=logits).log_prob(b["act"])
    return -(logp * b["adv"]).mean() - 0.01 * ent.mean() + 0.5 * F.mse_loss(v.float(), b["ret"].float())


def a2c_fp32_entropy(m, b):
    logits, v = m(b["obs"])
    dist = Categorical(logits=logits.float())
    return (-(dist.log_prob(b["act"]) * b["adv"]).mean() - 0.01 * dist.entropy().mean()
            + 0.5 * F.mse_loss(v.float(), b["ret"].float()))


def reinforce(m, b, fp32=False):
    logits, v = m(b["obs"])
    ret = b["ret"].float() if fp32 else b["ret"]
    adv = (ret - ret.mean()) / (ret.std() + 1e-8)
    logp = Categorical(logits=logits).log_prob(b["act"])
    return -(logp * adv).mean() + 0.5 * F.mse_loss(v.float(), b["ret"].float())


def value_sq(m, b):
    logits, v = m(b["obs"])
    logp = Categorical(logits=logits).log_prob(b["act"])
    return -(logp * b["adv"]).mean() + 0.5 * (v - b["ret"]).pow(2).mean()


def gauss_pg(m, b):
    logp, v = m(b["obs"], b["act"])
    return -(logp * b["adv"]).mean() + 0.5 * F.mse_loss(v.float(), b["ret"].float())


def cql(m, b):
    q, lse = m(b["obs"])
    qa = q.gather(1, b["act"][:, None])[:, 0]
    return (lse - qa).mean() + F.mse_loss(qa.float(), b["ret"].float())


def collapse_std(K):
    """At K the Gaussian policy's std has collapsed (a too-large step): the log_std head sits at -25, clamped to
    the lower bound."""
    def inj(i, m):
        if i == K:
            m.ls.bias.fill_(-25.0)
    return inj


# ------------------------------------------------------------------------------------------------- failure cases
# name: (model factory, batch(K), loss_fn, K, inject(K) or None, the producer the oracle must name (None: user code
# outside the model), accepted rules)
CASES = {
    "ppo_ratio_fp16": (ActorCritic, b_ppo, ppo_loss, 5, None, None, ("overflow",)),
    "entropy_head": (lambda: ActorCritic(ent=True), lambda K: b_obs_scale(K, 40.0), a2c_inside, 4, None, "ent",
                     ("nan_origin", "overflow", "underflow")),
    "entropy_user": (ActorCritic, lambda K: b_obs_scale(K, 40.0), a2c_outside, 6, None, None,
                     ("nan_origin", "overflow", "underflow")),
    "adv_norm_eps": (ActorCritic, b_sparse, reinforce, 5, None, None, ("eps_underflow", "nan_origin")),
    "value_unscaled": (ActorCritic, b_big_returns, value_sq, 4, None, None, ("overflow",)),
    "gauss_logstd": (GaussPolicy, b_cont, gauss_pg, 5, collapse_std, "logp", ("overflow", "nan_origin", "underflow")),
    "softq_lse": (QNet, lambda K: b_obs_scale(K, 20.0), cql, 4, None, "lse", ("overflow",)),
}

XFAIL: dict = {}  # name: reason, for a failure ampdoctor answers wrongly (adv_norm_eps's was fixed since)


def build(factory):
    torch.manual_seed(0)
    return factory()


def run_case(name, tmp_path):
    factory, mk, loss_fn, K, inj, _, _ = CASES[name]
    m = build(factory)
    return m, rl_run(m, one_update(loss_fn, mk(K)), K + 2, str(tmp_path / "run"), snap_at=K,
                     inject=inj(K) if inj else None)


def rerun_bad(name, r):
    """Rollout K's forward and loss re-run from the weights it ran with: (model outputs, loss) with fp16 autocast and
    fp16 buffers, then (model outputs, loss) all in fp32."""
    factory, mk, loss_fn, K, inj, _, _ = CASES[name]
    outs = []
    for half in (True, False):
        m = build(factory)
        m.load_state_dict(r["sd"])
        b = mk(K)(K, torch.float16 if half else torch.float32)
        seen = []
        h = m.register_forward_hook(lambda mod, inp, out: seen.append(out))
        with torch.no_grad(), torch.autocast(**AC, enabled=half):
            loss = loss_fn(m, b)
        h.remove()
        outs.append((seen[0], loss))
    return outs


def case_params():
    return [pytest.param(n, marks=wrong(XFAIL[n])) if n in XFAIL else n for n in CASES]


@pytest.mark.parametrize("name", case_params())
def test_rl_failure(name, tmp_path):
    factory, mk, loss_fn, K, inj, producer, rules = CASES[name]
    m, r = run_case(name, tmp_path)
    # the oracle: the loss is first non-finite at rollout K (one update per rollout: step K), and the scaler skips it
    assert r["bad_loss"] and r["bad_loss"][0] == K, r["losses"]
    assert K in r["skipped"] and all(s < 3 for s in r["skipped"] if s < K), r["skipped"]
    assert r["first"] == ((producer, K) if producer else None), r["first"]
    (out16, l16), (out32, l32) = rerun_bad(name, r)
    assert not torch.isfinite(l16), l16                  # the re-run fails as the run did
    if producer is None:
        assert finite(out16), name                       # the model's outputs were finite: user code made it
    assert finite(out32) and torch.isfinite(l32), l32    # fp16's doing: the same step in fp32 is finite
    # the report: an accepted rule at the producer (None: "(run)") at step K among the first three
    rep = r["rep"]
    f = named_top3(rep, rules, producer, K)
    if f.phase not in ("forward", None):
        raise WrongAnswer(f"wrong phase: {f.one_line()} ({f.phase})")
    blamed = [x.one_line() for x in rep.findings[:3] if x.step == K and x.rule in ("overflow", "nan_origin")
              and x.severity == "error" and x.module not in (producer, None)]
    if blamed:
        raise WrongAnswer(f"a module that only passed the value on blamed: {blamed}; top 3: {lines(rep)[:3]}")
    print(name, "->", f.one_line(), "|", f.fix)


# ---------------------------------------------------------------------------------------------------- healthy twins

def ppo_epochs(K, epochs=3, mb=2):
    """PPO's update: `epochs` passes over the rollout in `mb` shuffled minibatches (one backward/step each): ratio
    and entropy in fp32 (torch.distributions on fp32 logits), returns normalised in fp32 for the critic. The data:
    on-policy behaviour log-probs, the unnormalised ~1e3 returns of b_big_returns from K on."""
    rets = b_big_returns(K)

    def upd(i, m):
        b = b_ppo(None)(i, torch.float16)
        b["ret"] = rets(i, torch.float16)["ret"]
        ret = b["ret"].float()
        b["ret"] = (ret - ret.mean()) / (ret.std() + 1e-8)
        g = torch.Generator().manual_seed(7300 + i)
        for _ in range(epochs):
            for idx in torch.randperm(N, generator=g).chunk(mb):
                sub = {k: v[idx] for k, v in b.items()}
                with torch.autocast(**AC):
                    logits, v = m(sub["obs"])
                    dist = Categorical(logits=logits.float())
                    ratio = (dist.log_prob(sub["act"]) - sub["logp_old"].float()).exp()
                    adv = sub["adv"]
                    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                    loss = pg - 0.01 * dist.entropy().mean() + 0.5 * F.mse_loss(v.float(), sub["ret"])
                yield loss
    return upd


class SoftQTarget:
    """Soft Q-learning with a target network (a copy outside the watched model, no grad) updated by polyak
    averaging after every step; the soft value by torch.logsumexp on fp32 Q-values."""

    def __init__(self, K, tau=0.05):
        self.K, self.tau, self.batch, self.tgt = K, tau, b_obs_scale(K, 20.0), None

    def update(self, i, m):
        if self.tgt is None:
            self.tgt = copy.deepcopy(m).requires_grad_(False)
        b = self.batch(i, torch.float16)
        nxt = rn(N, OBS, seed=50 + i % 4) * (20.0 if i >= self.K else 1.0)
        with torch.autocast(**AC):
            with torch.no_grad():
                y = b["adv"] + 0.9 * self.tgt(nxt)[1]
            q, lse = m(b["obs"])
            qa = q.gather(1, b["act"][:, None])[:, 0].float()
            loss = F.smooth_l1_loss(qa, y) + 0.1 * (lse - qa).mean()
        yield loss

    def polyak(self, k, m):
        for pt, p in zip(self.tgt.parameters(), m.parameters()):
            pt.mul_(1 - self.tau).add_(p.detach(), alpha=self.tau)


def actor_critic_groups(m):
    return [m.actor.parameters(), m.critic.parameters()]


def twin_ppo(K):
    return dict(factory=ActorCritic, update=ppo_epochs(K), groups=actor_critic_groups)


def twin_softq(K):
    sq = SoftQTarget(K)
    return dict(factory=lambda: QNet(by_hand=False), update=sq.update, after=sq.polyak)


# name: K, and a builder of (factory, update, groups / inject / after); each built fresh per run
TWINS = {
    "ppo_fp32_ratio_two_opts": (5, twin_ppo),
    "a2c_fp32_entropy": (4, lambda K: dict(factory=ActorCritic,
                                           update=one_update(a2c_fp32_entropy, b_obs_scale(K, 40.0)))),
    "reinforce_fp32_advnorm": (5, lambda K: dict(factory=ActorCritic,
                                                 update=one_update(lambda m, b: reinforce(m, b, fp32=True),
                                                                   b_sparse(K)))),
    "gauss_clamp5_distributions": (5, lambda K: dict(factory=lambda: GaussPolicy(lo=-5.0, by_hand=False),
                                                     update=one_update(gauss_pg, b_cont(K)), inject=collapse_std(K))),
    "softq_target_polyak": (4, twin_softq),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_rl_healthy_twin(name, tmp_path):
    K, make = TWINS[name]
    runs = []
    for watch in (True, False):
        spec = make(K)
        m = build(spec.pop("factory"))
        runs.append(rl_run(m, spec.pop("update"), K + 2, str(tmp_path / f"w{watch}"), watch=watch, **spec))
    r, plain = runs
    # genuinely healthy: every loss finite, no producer, finite weights, no skip but the scaler's own search at the
    # first steps or (the scaled-up rollouts K, K + 1) a backoff the unwatched run makes too
    assert all(map(math.isfinite, r["losses"])) and r["first"] is None, (r["losses"], r["first"])
    assert all(torch.isfinite(v).all() for v in r["weights"].values() if v.is_floating_point())
    assert all(s < 3 or r["rollout"][s] in (K, K + 1) for s in r["skipped"]), (r["skipped"], r["rollout"])
    assert r["warns"] == [], r["warns"]
    rep = r["rep"]
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)
    # the watch changes nothing: losses, skips and weights bitwise identical
    assert r["losses"] == plain["losses"] and r["skipped"] == plain["skipped"], (r["losses"], plain["losses"])
    for k, v in r["weights"].items():
        assert torch.equal(v, plain["weights"][k]), k
    print(name, "steps", len(r["losses"]), "skipped", r["skipped"], "|", lines(rep))
