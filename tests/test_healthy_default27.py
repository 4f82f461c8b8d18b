"""Healthy runs at ampdoctor's DEFAULT watch, twenty-seventh set: training loops written the way popular research
codebases write them (timm, diffusers, flow matching / DiT, open_clip, BERT MLM, fairseq-style seq2seq, a VAE, a
PyG-style GNN, CleanRL PPO, torchvision-style detection, nanoGPT). `ampdoctor.watch(model, optimizer=opt,
scaler=scaler, run_dir=tmp_path / "run")` and nothing else; CPU fp16 autocast, a real `torch.amp.GradScaler("cpu")`
at its defaults, tiny models, fixed seeds (global RNG seeded where the codebase draws from it: DropPath, noise,
timesteps, dropout, sampling), one intra-op thread, 40-120 optimizer steps each. Every case runs twice:

- the UNWATCHED twin carries the oracle, independent of ampdoctor (`healthy`): every loss finite; the case learned
  (its own measure: the mean loss of the last fifth below `fall` x the first fifth's, or a held-out / reward /
  reconstruction measure where the training loss is not comparable step to step); probe_harness.Producer's forward
  hooks saw no module make inf/NaN from finite inputs; the gradients finite after every optimizer step the scaler
  did not skip; every weight (and EMA weight) finite at the end; the scaler's skips only its ordinary search (a
  first streak from step 0 of at most 4, then at most 2 isolated skips), each one PROVEN an overflow of the SCALED
  gradients only: at the skip, the step's retained graphs (every micro-batch of it) give finite gradients at half
  the scale (a first-streak step: at some scale down to 1/256 of it), the loss finite;
- the WATCHED run must train bitwise identically (`identical`): every loss, loss scale, skip, every optimizer
  step's gradients, the case's extras (eval losses, rewards, logit scales, KL terms), every final weight and buffer,
  the EMA copies, the optimizer's state_dict and the final scale; then (`judge`) w.report() after close() and
  ampdoctor.diagnose(run_dir) must hold no warning and no error (info is fine), exit code 0, no internal error, one
  recorded step per optimizer step, and no `ampdoctor: ...` Python warning during the run. A false alarm is a strict
  xfail (probe_harness.wrong: WrongAnswer only) whose reason quotes ampdoctor; a failing oracle or a difference in
  training is a plain failure.

The cases (zero_grad -> fp16 autocast forward [+ loss] -> scaler.scale(loss).backward() -> unscale_ ->
clip_grad_norm_ -> scaler.step -> scaler.update [-> scheduler / EMA], unless said otherwise):
 1. timm_convnext_mixup: a ConvNeXt-ish net (depthwise conv, GroupNorm, layer scale 1e-6, DropPath 0.1), channels_last,
    timm Mixup/CutMix (alternating, label smoothing 0.1) with SoftTargetCrossEntropy, AdamW with no-decay groups,
    warmup + cosine LambdaLR per step, clip 1.0 after unscale_, ModelEmaV2 (decay 0.99) updated every step;
    learned: the clean held-out loss at the end below 0.7x the start;
 2. diffusers_ddpm: a tiny UNet (ResBlocks with GroupNorm/SiLU, time-embedding projection, down/up + skip), integer
    timesteps `torch.randint(0, 1000)` into diffusers' sinusoidal `get_timestep_embedding` (fp32), linear betas,
    `add_noise`, MSE on the predicted noise (`.float()`), diffusers EMAModel (decay warmup), cosine schedule;
 3. flow_matching_dit: rectified flow x_t = (1 - t) x0 + t x1, t ~ U(0, 1), v-prediction MSE; a DiT-style MLP with
    adaLN-Zero modulation (zero-initialised gates) from a sinusoidal embedding of 1000 t;
 4. clip_contrastive: open_clip-style: two towers, F.normalize, learnable logit_scale (init log(1/0.07)) with its
    own lr, symmetric CE on logit_scale.exp() * img @ txt.T, `logit_scale.clamp_(0, log(100))` after each step;
    learned: the loss falls below half, logit_scale rises by > 0.4 (to ~3.2) and never past the clamp;
 5. bert_mlm: HF BERT-style encoder with its own attention (extended mask `(1 - mask) * finfo(float32).min` added to
    the fp16 scores), variable-length padded batches, DataCollatorForLanguageModeling masking (15%; 80/10/10),
    labels -100 elsewhere, tied decoder;
 6. seq2seq_teacher_forcing: fairseq-style GRU encoder/decoder with dot attention, the pad positions of the source
    filled with -inf in fp32 (`.float().masked_fill_(pad, -inf).type_as(...)`), teacher forcing (BOS + target[:-1]),
    CE with ignore_index=PAD, Adam, clip_grad_norm_(0.1) (fairseq's --clip-norm); learned: the loss falls;
 7. vae_kl_annealing: an MLP VAE on binary 8x8 patterns, reparameterisation with torch.randn_like, BCE-with-logits
    summed per sample, KL weight annealed 0 -> 1 over 30 steps; learned: reconstruction falls and the beta=1 ELBO at
    the end is below its start; Adam, unscale_ without clipping;
 8. gnn_message_passing: PyG-style batched graphs (edge_index, batch vector): a GCN layer (symmetric norm,
    index_add_) and a SAGE mean layer (scatter_add_ + degree), global mean pool by scatter_add_; node + graph loss;
 9. ppo_cleanrl: CleanRL PPO on a tiny vectorised contextual-bandit env: rollouts under no_grad, GAE, 4 epochs x 4
    minibatches per iteration (16 optimizer steps per rollout), advantages normalised per minibatch, clipped
    surrogate + clipped value loss + entropy bonus, clip_grad_norm_(0.5), Adam(eps=1e-5) at lr 2.5e-3 annealed
    linearly (120 optimizer steps); the actor head orthogonal with gain 0.01 (CleanRL's layer_init); learned: the mean
    reward of the last 3 rollouts above the first 3's by 0.12 (0.28 -> 0.44);
10. retinanet_head: torchvision-style RetinaNet-ish head on a small conv backbone: sigmoid focal loss (prior bias
    -log(99)) and smooth L1 (beta 1/9) on positives, each / max(1, num_foreground), computed inside autocast;
    SGD(momentum 0.9, wd 1e-4), warmup + cosine, unscale_ without clipping;
11. nanogpt_grad_accum: nanoGPT: tiny GPT (SDPA is_causal, tied wte/lm_head, scaled c_proj init), AdamW(0.9, 0.95)
    with decay/no-decay groups, get_lr warmup + cosine written into param_groups, 4 micro-steps per optimizer step
    (loss / 4, `model.no_sync()`-style context: a nullcontext on CPU, the next batch fetched before backward),
    zero_grad(set_to_none=True);
12. ppo_cleanrl_lr1e-2: case 9 at lr 1e-2 (rewards 0.22 -> 0.63, no skip, nothing non-finite).

What ampdoctor says: 1-11 quiet (info only: `overflow` "... while the loss scale was high; GradScaler skipped them
and lowered the scale, as designed" and `skipped_steps` "a normal rate for dynamic loss scaling" where the scaler's
first step skipped), every watched run bitwise identical to its twin. 12 was a FALSE ALARM when written (a strict
xfail then), fixed since: `[warning] update_spike at actor.4 step 0: The optimizer update at step 0 multiplied the weights of `actor.4` ×5.73
(‖w‖ 0.02 → 0.115). Usual causes: a learning rate too high for these weights (lr=0.01; ...)`. The policy head is
initialised tiny on purpose (orthogonal, gain 0.01: a near-uniform first policy, as in CleanRL / SB3), so any Adam
step of lr >= ~3e-3 multiplies its norm by > 2 at step 0, as designed: the logits go from ~0.01 to ~0.1, the policy
is still near-uniform, and the run trains cleanly. rules/updates.py leaves out "weights too small to have a
meaningful scale (zero-initialised biases, LoRA's B)" by _MIN_RMS = 1e-3; this head's rms is 1.8e-3, just above it.
(At lr 2.5e-3, case 9, the factor stays under spike_factor 2.0 and ampdoctor is quiet.) Now a weight started at
least 4x below the model's typical weight rms that stays no larger than it after the spike is catching up, as
designed, on a run that never went non-finite (rules/updates.py `_catching_up`): 12 is quiet.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from probe_harness import Producer, WrongAnswer, finite, quiet_report, wrong  # noqa: E402
from scenarios import alarms, gen, lines, one_thread  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
F16 = torch.float16
DEBUG = os.environ.get("AMPDOCTOR_PROBE_DEBUG")
CASES: dict = {}
XFAIL: dict[str, str] = {}


# ------------------------------------------------------------------------------------------------------ the loop
class Amp:
    """The AMP half of a case's loop: `backward(loss)` = scaler.scale(loss).backward(); `step()` = unscale_ ->
    clip_grad_norm_(clip) -> scaler.step -> scaler.update, recording the scale each optimizer step ran at, its skip
    and the gradients it left. With `oracle` (the unwatched twin only) each backward keeps its graph (retain_graph:
    the same numbers) so that a skipped step can be proven harmless: the lowest power-of-two fraction of the scale
    at which every micro-batch's scaled gradients are finite."""

    def __init__(self, m, opt, clip=1.0, params=None):
        self.m, self.opt, self.clip = m, opt, clip
        self.sc = torch.amp.GradScaler("cpu")
        self.params = list(m.parameters()) if params is None else params
        self.oracle, self.pending, self.n = False, [], 0
        self.scales, self.skipped, self.grads, self.proofs = [], [], [], {}

    def backward(self, loss):
        if self.oracle:
            self.pending.append(loss)
        self.sc.scale(loss).backward(retain_graph=self.oracle)

    def step(self):
        s = self.sc.get_scale()
        self.sc.unscale_(self.opt)
        if self.clip is not None:
            nn.utils.clip_grad_norm_(self.params, self.clip)
        self.sc.step(self.opt)
        self.sc.update()
        self.scales.append(s)
        self.grads.append([None if p.grad is None else p.grad.detach().clone() for p in self.m.parameters()])
        if self.sc.get_scale() < s:
            self.skipped.append(self.n)
            if self.oracle:
                self.proofs[self.n] = self._prove(s)
        self.n += 1
        self.pending = []

    def _prove(self, s):
        ps = [p for p in self.params if p.requires_grad]

        def fine(scale):
            return all(finite([g for g in torch.autograd.grad(loss * scale, ps, retain_graph=True, allow_unused=True)
                               if g is not None]) for loss in self.pending)
        losses_ok = all(math.isfinite(float(v)) for v in self.pending)
        return dict(losses_ok=losses_ok, at_own=fine(s), lower=next((k for k in range(1, 9) if fine(s / 2 ** k)), None))


def run(case, rd=None):
    """One run of `case` (its make() builds everything afresh from fixed seeds). rd given: under
    ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=rd) and nothing else; rd None: the unwatched twin, with the
    oracle (Producer's forward hooks, Amp.oracle)."""
    c = case.make()
    a = c.amp
    a.oracle = rd is None
    prod = Producer(a.m) if rd is None else None
    r = SimpleNamespace(losses=[], c=c, rd=rd, w=None, first=None, case=case)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = r.w = ampdoctor.watch(a.m, optimizer=a.opt, scaler=a.sc, run_dir=rd) if rd is not None else None
        try:
            for i in range(case.iters):
                if prod is not None:
                    prod.new_step(a.n)
                r.losses.append(float(c.body(i)))
        finally:
            if w is not None:
                w.close()
            if prod is not None:
                prod.remove()
                r.first = prod.first
    r.warns = [str(x.message) for x in seen if str(x.message).startswith("ampdoctor")]
    r.state = {k: v.detach().clone() for k, v in a.m.state_dict().items()}
    for name, mod in c.others.items():
        r.state.update({f"{name}::{k}": v.detach().clone() for k, v in mod.state_dict().items()})
    r.opt_state, r.final_scale = a.opt.state_dict(), a.sc.get_scale()
    return r


def ns(amp, body, extra=None, **others):
    """A built case: its Amp, its loop body (iteration -> loss), its extras (dict of lists, compared bitwise) and
    other modules whose state must match too (EMA copies)."""
    return SimpleNamespace(amp=amp, body=body, extra=extra if extra is not None else {}, others=others)


def case(iters, fall=0.8, learned=None):
    def deco(make):
        CASES[make.__name__] = SimpleNamespace(make=make, iters=iters, fall=fall, learned=learned)
        return make
    return deco


# ------------------------------------------------------------------------------------------------------ the oracle
def healthy(r):
    cs, a = r.case, r.c.amp
    ls = r.losses
    assert ls and all(map(math.isfinite, ls)), ls
    if cs.learned is not None:
        cs.learned(r)
    else:
        k = max(3, len(ls) // 5)
        assert sum(ls[-k:]) / k < cs.fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)
    assert r.first is None, r.first
    first = next(k for k in range(a.n) if k not in a.skipped)
    late = [s for s in a.skipped if s > first]
    assert first <= 4 and len(late) <= 2 and not any(s + 1 in late for s in late), (a.skipped, a.scales)
    for s in a.skipped:
        p = a.proofs[s]
        assert p["losses_ok"] and not p["at_own"] and p["lower"] is not None, (s, p)
        assert s < first or p["lower"] == 1, (s, p)
    bad = [i for i, gs in enumerate(a.grads) if i not in a.skipped and not finite([g for g in gs if g is not None])]
    assert not bad, bad
    assert all(finite(v) for v in r.state.values())


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same(x, y):
    if torch.is_tensor(x):
        return torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


def identical(rw, ru):
    aw, au = rw.c.amp, ru.c.amp
    assert rw.losses == ru.losses, [(k, p, q) for k, (p, q) in enumerate(zip(rw.losses, ru.losses)) if p != q][:3]
    assert aw.scales == au.scales and aw.skipped == au.skipped and rw.final_scale == ru.final_scale
    diff = [k for k, (p, q) in enumerate(zip(aw.grads, au.grads)) if not same(p, q)]
    assert not diff and len(aw.grads) == len(au.grads), diff[:5]
    assert same(rw.c.extra, ru.c.extra), [k for k in ru.c.extra if not same(rw.c.extra.get(k), ru.c.extra[k])]
    diff = [k for k in ru.state if not same(rw.state.get(k), ru.state[k])]
    assert not diff and rw.state.keys() == ru.state.keys(), diff
    assert same(rw.opt_state, ru.opt_state), "optimizer state differs"


def judge(r):
    if r.warns:
        raise WrongAnswer(" | ".join(r.warns))
    reps = (r.w.report(), ampdoctor.diagnose(r.rd))
    if DEBUG:
        for f in reps[0].findings:
            print("  ", f.one_line(), f.evidence if f.severity != "info" else "")
    bad = list(dict.fromkeys(x for rep in reps for x in alarms(rep.findings)))
    if bad:
        raise WrongAnswer(" | ".join(bad))
    for rep in reps:
        quiet_report(rep)
        summary = rep.to_dict()["summary"]
        assert rep.exit_code == 0 and not summary.get("internal_error"), summary
        assert summary["steps"] == r.c.amp.n, (summary["steps"], r.c.amp.n, lines(rep))


def cosine_warmup(warm, total, floor=0.0):
    """A per-step LR factor: linear warmup over `warm` steps, then cosine to `floor`."""
    def f(k):
        if k < warm:
            return (k + 1) / warm
        q = min(1.0, (k - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * q))
    return f


def decay_groups(m, wd):
    """timm / nanoGPT parameter groups: weight decay on >= 2-D weights only."""
    dec = [p for p in m.parameters() if p.ndim >= 2]
    nodec = [p for p in m.parameters() if p.ndim < 2]
    return [{"params": dec, "weight_decay": wd}, {"params": nodec, "weight_decay": 0.0}]


# -------------------------------------------------------------------------------------- 1. timm ConvNeXt + mixup
class DropPath(nn.Module):
    """timm's drop_path (scale_by_keep)."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class ConvNeXtBlock(nn.Module):
    def __init__(self, d, dp):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 3, padding=1, groups=d)
        self.norm = nn.GroupNorm(1, d)
        self.pw1, self.act, self.pw2 = nn.Conv2d(d, 4 * d, 1), nn.GELU(), nn.Conv2d(4 * d, d, 1)
        self.gamma = nn.Parameter(1e-6 * torch.ones(d))
        self.drop_path = DropPath(dp)

    def forward(self, x):
        y = self.pw2(self.act(self.pw1(self.norm(self.dw(x)))))
        return x + self.drop_path(self.gamma.view(1, -1, 1, 1) * y)


class TinyConvNeXt(nn.Module):
    def __init__(self, d=16, classes=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, d, 2, stride=2), nn.GroupNorm(1, d))
        self.stages = nn.Sequential(ConvNeXtBlock(d, 0.05), ConvNeXtBlock(d, 0.1))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.norm(self.stages(self.stem(x)).mean((2, 3))))


def patch_images(seed, n=32):
    """8x8 RGB images; classes 0-2: a bright patch (side 3-5, anywhere) in channel k, class 3: in all three (plus
    colour jitter and noise)."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        y = torch.randint(0, 4, (n,), generator=g)
        x = 0.5 * torch.randn(n, 3, 8, 8, generator=g) + 0.2 * torch.randn(n, 3, 1, 1, generator=g)
        for b in range(n):
            s = int(torch.randint(3, 6, (1,), generator=g))
            r, c = (int(v) for v in torch.randint(0, 9 - s, (2,), generator=g))
            ch = slice(0, 3) if int(y[b]) == 3 else slice(int(y[b]), int(y[b]) + 1)
            x[b, ch, r:r + s, c:c + s] += 1.5
        return x, y
    return batch


class Mixup:
    """timm.data.Mixup (mode 'batch'): mixup (alpha 0.8) or cutmix (alpha 1.0), switch_prob 0.5, label smoothing."""

    def __init__(self, seed, classes=4, smoothing=0.1):
        self.rng, self.k, self.smoothing = np.random.default_rng(seed), classes, smoothing

    def __call__(self, x, y):
        use_cutmix = self.rng.random() < 0.5
        lam = float(self.rng.beta(1.0, 1.0) if use_cutmix else self.rng.beta(0.8, 0.8))
        if use_cutmix:
            H, W = x.shape[-2:]
            cut = math.sqrt(1 - lam)
            ch, cw = int(H * cut), int(W * cut)
            cy, cx = int(self.rng.integers(H)), int(self.rng.integers(W))
            y0, y1 = np.clip(cy - ch // 2, 0, H), np.clip(cy + ch // 2, 0, H)
            x0, x1 = np.clip(cx - cw // 2, 0, W), np.clip(cx + cw // 2, 0, W)
            x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
            lam = 1 - (y1 - y0) * (x1 - x0) / float(H * W)
        else:
            x.mul_(lam).add_(x.flip(0).mul_(1 - lam))
        off = self.smoothing / self.k
        y1h = torch.full((len(y), self.k), off).scatter_(1, y[:, None], 1 - self.smoothing + off)
        return x, y1h * lam + y1h.flip(0) * (1 - lam)


class ModelEmaV2(nn.Module):
    def __init__(self, model, decay):
        super().__init__()
        self.module, self.decay = copy.deepcopy(model).eval(), decay

    @torch.no_grad()
    def update(self, model):
        for e, v in zip(self.module.state_dict().values(), model.state_dict().values()):
            e.copy_(e * self.decay + (1.0 - self.decay) * v)


def _clean_eval(r):
    ev = r.c.extra["eval"]
    assert ev[-1] < 0.7 * ev[0] and r.c.extra["ema_eval"][0] < 0.9 * ev[0], (ev, r.c.extra["ema_eval"])


@case(60, learned=_clean_eval)
def timm_convnext_mixup():
    torch.manual_seed(1)
    m = TinyConvNeXt().to(memory_format=torch.channels_last)
    ema = ModelEmaV2(m, 0.99)
    opt = torch.optim.AdamW(decay_groups(m, 0.05), lr=4e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_warmup(5, 60, 0.05))
    amp = Amp(m, opt, clip=1.0)
    data, held, mix = patch_images(1), patch_images(2, n=128)(0), Mixup(seed=3)
    extra = {"eval": [], "ema_eval": []}

    def evaluate(model, key):
        was = model.training
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=F16):
            extra[key].append(F.cross_entropy(model(held[0].contiguous(memory_format=torch.channels_last)).float(),
                                              held[1]).item())
        model.train(was)

    def body(i):
        if i % 20 == 0:
            evaluate(m, "eval")
        x, y = data(i)
        x, target = mix(x, y)
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=F16):
            out = m(x)
            loss = torch.sum(-target * F.log_softmax(out, dim=-1), dim=-1).mean()   # SoftTargetCrossEntropy
        opt.zero_grad()
        amp.backward(loss)
        amp.step()
        ema.update(m)
        sched.step()
        if i == 59:
            evaluate(m, "eval")
            evaluate(ema.module, "ema_eval")
        return loss.item()
    return ns(amp, body, extra, ema=ema)


# -------------------------------------------------------------------------------------------------- 2. DDPM
def get_timestep_embedding(timesteps, dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, max_period=10000):
    """diffusers.models.embeddings.get_timestep_embedding."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=timesteps.device)
    emb = torch.exp(exponent / (half - downscale_freq_shift))
    emb = timesteps[:, None].float() * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    return emb


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(tdim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class TinyUNet(nn.Module):
    def __init__(self, c=16, tdim=32):
        super().__init__()
        self.tdim = c
        self.time_embedding = nn.Sequential(nn.Linear(c, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(3, c, 3, padding=1)
        self.down = ResBlock(c, c, tdim)
        self.downsample = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.mid = ResBlock(c, 2 * c, tdim)
        self.up = ResBlock(3 * c, c, tdim)
        self.norm_out, self.conv_out = nn.GroupNorm(4, c), nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x, timesteps):
        t_emb = get_timestep_embedding(timesteps, self.tdim).to(dtype=self.conv_in.weight.dtype)
        temb = self.time_embedding(t_emb)
        h0 = self.down(self.conv_in(x), temb)
        h = self.mid(self.downsample(h0), temb)
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        h = self.up(torch.cat([h, h0], 1), temb)
        return self.conv_out(F.silu(self.norm_out(h)))


class EMAModel:
    """diffusers.training_utils.EMAModel (decay warmup (1 + step) / (10 + step))."""

    def __init__(self, params, decay=0.999):
        self.shadow = [p.clone().detach() for p in params]
        self.decay, self.optimization_step = decay, 0

    @torch.no_grad()
    def step(self, params):
        self.optimization_step += 1
        d = min(self.decay, (1 + self.optimization_step) / (10 + self.optimization_step))
        for s, p in zip(self.shadow, params):
            s.sub_((1 - d) * (s - p))

    def state_dict(self):
        return {str(k): s for k, s in enumerate(self.shadow)}


def smooth_images(seed, n=16):
    """Images in [-1, 1] on a 3-dim manifold: colour gradients."""
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 8), torch.linspace(-1, 1, 8), indexing="ij")

    def batch(i):
        g = gen(seed * 100_000 + i)
        a = torch.rand(n, 3, 1, 1, generator=g) * 2 - 1
        b = torch.rand(n, 1, 1, 1, generator=g) * 2 - 1
        return (0.6 * a * xx + 0.4 * b * yy).clamp(-1, 1)
    return batch


@case(80)
def diffusers_ddpm():
    torch.manual_seed(2)
    m = TinyUNet()
    ema = EMAModel(m.parameters())
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_warmup(8, 80))
    amp = Amp(m, opt)
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float32)
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    data = smooth_images(2)
    ts = []

    def add_noise(x0, noise, t):
        a = alphas_cumprod[t].flatten()[:, None, None, None]
        return a ** 0.5 * x0 + (1 - a) ** 0.5 * noise

    def body(i):
        clean = data(i)
        noise = torch.randn(clean.shape)
        timesteps = torch.randint(0, 1000, (clean.shape[0],)).long()
        ts.append(timesteps)
        noisy = add_noise(clean, noise, timesteps)
        with torch.autocast("cpu", dtype=F16):
            pred = m(noisy, timesteps)
            loss = F.mse_loss(pred.float(), noise.float())
        amp.backward(loss)
        amp.step()
        ema.step(m.parameters())
        sched.step()
        opt.zero_grad()
        return loss.item()
    c = ns(amp, body, {"timesteps": ts})
    c.others = {"ema": ema}
    return c


# ------------------------------------------------------------------------------------------ 3. flow matching DiT
class AdaLNBlock(nn.Module):
    def __init__(self, d, cdim):
        super().__init__()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mix = nn.Sequential(nn.Linear(d, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cdim, 6 * d))
        nn.init.zeros_(self.adaLN_modulation[1].weight)
        nn.init.zeros_(self.adaLN_modulation[1].bias)

    def forward(self, x, c):
        sh1, sc1, g1, sh2, sc2, g2 = self.adaLN_modulation(c).chunk(6, dim=-1)
        x = x + g1 * self.mix(self.norm1(x) * (1 + sc1) + sh1)
        return x + g2 * self.mlp(self.norm2(x) * (1 + sc2) + sh2)


class TinyDiT(nn.Module):
    def __init__(self, dim=8, d=64, tfreq=32):
        super().__init__()
        self.tfreq = tfreq
        self.t_embedder = nn.Sequential(nn.Linear(tfreq, d), nn.SiLU(), nn.Linear(d, d))
        self.x_embedder = nn.Linear(dim, d)
        self.blocks = nn.ModuleList(AdaLNBlock(d, d) for _ in range(2))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.final = nn.Linear(d, dim)
        for lin in (self.final_mod[1], self.final):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x, t):
        c = self.t_embedder(get_timestep_embedding(t * 1000, self.tfreq))
        h = self.x_embedder(x)
        for b in self.blocks:
            h = b(h, c)
        shift, scale = self.final_mod(c).chunk(2, dim=-1)
        return self.final(self.final_norm(h) * (1 + scale) + shift)


CENTERS = torch.randn(4, 8, generator=gen(31)) * 2.0


@case(80)
def flow_matching_dit():
    torch.manual_seed(3)
    m = TinyDiT()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.0)
    amp = Amp(m, opt)

    def body(i):
        g = gen(3_000_000 + i)
        x1 = CENTERS[torch.randint(0, 4, (64,), generator=g)] + 0.3 * torch.randn(64, 8, generator=g)
        x0 = torch.randn_like(x1)
        t = torch.rand(x1.shape[0])
        xt = (1 - t[:, None]) * x0 + t[:, None] * x1
        opt.zero_grad()
        with torch.autocast("cpu", dtype=F16):
            v = m(xt, t)
        loss = F.mse_loss(v.float(), x1 - x0)
        amp.backward(loss)
        amp.step()
        return loss.item()
    return ns(amp, body)


# ------------------------------------------------------------------------------------------------ 4. open_clip
class TinyCLIP(nn.Module):
    def __init__(self, d=32, vocab=32):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, d))
        self.token_embedding = nn.Embedding(vocab, 32)
        self.positional_embedding = nn.Parameter(0.01 * torch.randn(16, 32))
        self.ln_final = nn.LayerNorm(32)
        self.text_projection = nn.Linear(32, d, bias=False)
        self.text_mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def encode_text(self, tokens):
        x = self.token_embedding(tokens) + self.positional_embedding
        x = x + self.text_mlp(x)
        return self.text_projection(self.ln_final(x).mean(1))

    def forward(self, image, text):
        img = F.normalize(self.visual(image), dim=-1)
        txt = F.normalize(self.encode_text(text), dim=-1)
        return img, txt, self.logit_scale.exp()


A_IMG = torch.randn(16, 32, generator=gen(41))


def clip_pairs(seed, n=32):
    """A latent z (16 dims); the 'image' a noisy linear view of z, the 'caption' the 16 sign bits of z as tokens."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        z = torch.randn(n, 16, generator=g)
        image = z @ A_IMG + 0.05 * torch.randn(n, 32, generator=g)
        text = 2 * torch.arange(16) + (z > 0).long()
        return image, text
    return batch


def _clip_learned(r):
    ls, scales = r.losses, r.c.extra["logit_scale"]
    assert sum(ls[-10:]) / 10 < 0.5 * sum(ls[:10]) / 10, (ls[:10], ls[-10:])
    assert max(scales) > math.log(1 / 0.07) + 0.4 and all(v <= math.log(100) for v in scales), scales[::10]


@case(70, learned=_clip_learned)
def clip_contrastive():
    torch.manual_seed(4)
    m = TinyCLIP()
    others = [p for n, p in m.named_parameters() if n != "logit_scale"]
    opt = torch.optim.AdamW([{"params": others, "weight_decay": 0.1},
                             {"params": [m.logit_scale], "weight_decay": 0.0, "lr": 0.1}], lr=3e-3, betas=(0.9, 0.98),
                            eps=1e-6)
    amp = Amp(m, opt)
    data, scales = clip_pairs(4), []

    def body(i):
        image, text = data(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=F16):
            img, txt, scale = m(image, text)
            logits_per_image = scale * img @ txt.T
            logits_per_text = logits_per_image.T
            labels = torch.arange(image.shape[0])
            loss = (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
        amp.backward(loss)
        amp.step()
        with torch.no_grad():
            m.logit_scale.clamp_(0, math.log(100))
        scales.append(m.logit_scale.item())
        return loss.item()
    return ns(amp, body, {"logit_scale": scales})


# --------------------------------------------------------------------------------------------------- 5. BERT MLM
PAD, CLS, SEP, MASK, V_MLM = 0, 1, 2, 3, 40


class BertSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.dh = h, d // h
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.dropout = nn.Dropout(0.1)

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.h, self.dh).transpose(1, 2)

    def forward(self, x, ext_mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dh)
        scores = scores + ext_mask
        probs = self.dropout(F.softmax(scores, dim=-1))
        return (probs @ v).transpose(1, 2).reshape(x.shape)


class BertLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.attention, self.attn_out = BertSelfAttention(d, h), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        self.intermediate, self.output = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, ext_mask):
        x = self.ln1(x + self.dropout(self.attn_out(self.attention(x, ext_mask))))
        return self.ln2(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


class TinyBertMLM(nn.Module):
    def __init__(self, d=32, h=4, L=2, T=16):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(V_MLM, d, padding_idx=PAD), nn.Embedding(T, d)
        self.emb_ln, self.emb_drop = nn.LayerNorm(d, eps=1e-12), nn.Dropout(0.1)
        self.layers = nn.ModuleList(BertLayer(d, h) for _ in range(L))
        self.transform, self.transform_ln = nn.Linear(d, d), nn.LayerNorm(d, eps=1e-12)
        self.decoder = nn.Linear(d, V_MLM)
        self.decoder.weight = self.word_embeddings.weight
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1])
        x = self.emb_drop(self.emb_ln(self.word_embeddings(input_ids) + self.position_embeddings(pos)))
        ext = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        for layer in self.layers:
            x = layer(x, ext)
        return self.decoder(self.transform_ln(F.gelu(self.transform(x))))


def mlm_batches(seed, n=16, T=16):
    """A topic language: each sentence draws its words from one of 6 topics of 6 tokens (4..39); lengths 8..14 +
    [CLS]/[SEP], padded to T; masked as DataCollatorForLanguageModeling does."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        topic = torch.randint(0, 6, (n, 1), generator=g)
        body = 4 + 6 * topic + torch.randint(0, 6, (n, T - 2), generator=g)
        lens = torch.randint(8, 15, (n,), generator=g)
        ids = torch.full((n, T), PAD)
        ids[:, 0] = CLS
        ar = torch.arange(T - 2)
        ids[:, 1:T - 1] = torch.where(ar[None] < lens[:, None], body, PAD)
        ids[torch.arange(n), lens + 1] = SEP
        attn = (ids != PAD).long()
        labels = ids.clone()
        special = (ids == PAD) | (ids == CLS) | (ids == SEP)
        prob = torch.full(ids.shape, 0.15).masked_fill(special, 0.0)
        masked = torch.bernoulli(prob, generator=g).bool()
        labels[~masked] = -100
        inputs = ids.clone()
        repl = torch.bernoulli(torch.full(ids.shape, 0.8), generator=g).bool() & masked
        inputs[repl] = MASK
        rnd = torch.bernoulli(torch.full(ids.shape, 0.5), generator=g).bool() & masked & ~repl
        inputs[rnd] = torch.randint(4, V_MLM, ids.shape, generator=g)[rnd]
        return inputs, attn, labels
    return batch


@case(90)
def bert_mlm():
    torch.manual_seed(5)
    m = TinyBertMLM()
    opt = torch.optim.AdamW(decay_groups(m, 0.01), lr=5e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_warmup(10, 90))
    amp = Amp(m, opt)
    data = mlm_batches(5)

    def body(i):
        inputs, attn, labels = data(i)
        with torch.autocast("cpu", dtype=F16):
            logits = m(inputs, attn)
            loss = F.cross_entropy(logits.view(-1, V_MLM), labels.view(-1), ignore_index=-100)
        amp.backward(loss)
        amp.step()
        sched.step()
        opt.zero_grad()
        return loss.item()
    return ns(amp, body)


# ---------------------------------------------------------------------------------------- 6. seq2seq (fairseq)
S_PAD, S_BOS, S_EOS, V_S2S = 0, 1, 2, 16


class Seq2Seq(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.src_emb = nn.Embedding(V_S2S, d, padding_idx=S_PAD)
        self.tgt_emb = nn.Embedding(V_S2S, d, padding_idx=S_PAD)
        self.encoder = nn.GRU(d, d, batch_first=True)
        self.decoder = nn.GRU(d, d, batch_first=True)
        self.attn_proj = nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(2 * d, d)
        self.out = nn.Linear(d, V_S2S)

    def forward(self, src, prev_output_tokens):
        pad = src.eq(S_PAD)
        enc, h = self.encoder(self.src_emb(src))
        dec, _ = self.decoder(self.tgt_emb(prev_output_tokens), h)
        attn_scores = self.attn_proj(dec) @ enc.transpose(1, 2)                 # (B, Tt, Ts)
        attn_scores = attn_scores.float().masked_fill_(pad[:, None, :], float("-inf")).type_as(attn_scores)
        attn = F.softmax(attn_scores.float(), dim=-1).type_as(attn_scores)
        ctx = attn @ enc
        return self.out(torch.tanh(self.out_proj(torch.cat([ctx, dec], -1))))


def reverse_batches(seed, n=32, T=8):
    """Source: random tokens 3..15, lengths 3..8, right-padded; target: the reversed source + EOS."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        lens = torch.randint(3, T + 1, (n,), generator=g)
        tok = torch.randint(3, V_S2S, (n, T), generator=g)
        ar = torch.arange(T)
        src = torch.where(ar[None] < lens[:, None], tok, S_PAD)
        tgt = torch.full((n, T + 1), S_PAD)
        for b in range(n):
            k = int(lens[b])
            tgt[b, :k] = src[b, :k].flip(0)
            tgt[b, k] = S_EOS
        prev = torch.cat([torch.full((n, 1), S_BOS), tgt[:, :-1]], 1)
        prev = prev.masked_fill(prev == S_EOS, S_PAD)
        return src, prev, tgt
    return batch


@case(80)
def seq2seq_teacher_forcing():
    torch.manual_seed(6)
    m = Seq2Seq()
    opt = torch.optim.Adam(m.parameters(), lr=5e-3)
    amp = Amp(m, opt, clip=0.1)
    data = reverse_batches(6)

    def body(i):
        src, prev, tgt = data(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=F16):
            logits = m(src, prev)
        loss = F.cross_entropy(logits.float().reshape(-1, V_S2S), tgt.reshape(-1), ignore_index=S_PAD)
        amp.backward(loss)
        amp.step()
        return loss.item()
    return ns(amp, body)


# --------------------------------------------------------------------------------------------------------- 7. VAE
class VAE(nn.Module):
    def __init__(self, z=4):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.fc_mu, self.fc_logvar = nn.Linear(64, z), nn.Linear(64, z)
        self.dec = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def binary_patterns(seed, n=32):
    """8x8 binary images: one bar, horizontal or vertical, at a random row/column (16 patterns), 2% pixel flips."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        k = torch.randint(0, 8, (n,), generator=g)
        vertical = torch.rand(n, generator=g) < 0.5
        img = torch.zeros(n, 8, 8)
        img[torch.arange(n), k, :] = 1.0
        img[vertical] = img[vertical].transpose(1, 2)
        flip = torch.rand(n, 8, 8, generator=g) < 0.02
        return torch.where(flip, 1 - img, img).flatten(1)
    return batch


def _vae_learned(r):
    rec, kl = r.c.extra["recon"], r.c.extra["kl"]
    k = 15
    assert sum(rec[-k:]) / k < 0.8 * sum(rec[:k]) / k, (rec[:k], rec[-k:])
    elbo = [a + b for a, b in zip(rec, kl)]
    assert sum(elbo[-k:]) / k < 0.85 * sum(elbo[:k]) / k, (elbo[:k], elbo[-k:])


@case(120, learned=_vae_learned)
def vae_kl_annealing():
    torch.manual_seed(7)
    m = VAE()
    opt = torch.optim.Adam(m.parameters(), lr=5e-3)
    amp = Amp(m, opt, clip=None)
    data = binary_patterns(7)
    extra = {"recon": [], "kl": []}

    def body(i):
        x = data(i)
        beta = min(1.0, i / 30)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=F16):
            logits, mu, logvar = m(x)
        recon = F.binary_cross_entropy_with_logits(logits.float(), x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + logvar.float() - mu.float().pow(2) - logvar.float().exp()) / x.shape[0]
        loss = recon + beta * kl
        amp.backward(loss)
        amp.step()
        extra["recon"].append(recon.item())
        extra["kl"].append(kl.item())
        return loss.item()
    return ns(amp, body, extra)


# --------------------------------------------------------------------------------------------------------- 8. GNN
class GCNConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.lin = nn.Linear(cin, cout, bias=False)
        self.bias = nn.Parameter(torch.zeros(cout))

    def forward(self, x, edge_index):
        n = x.shape[0]
        loops = torch.arange(n)
        src, dst = torch.cat([edge_index[0], loops]), torch.cat([edge_index[1], loops])
        deg = torch.zeros(n).index_add_(0, dst, torch.ones(dst.shape[0]))
        norm = deg.pow(-0.5)[src] * deg.pow(-0.5)[dst]
        h = self.lin(x)
        msg = h[src] * norm[:, None].to(h.dtype)
        out = torch.zeros(n, h.shape[1], dtype=h.dtype).index_add_(0, dst, msg)
        return out + self.bias


class SAGEConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.lin_l, self.lin_r = nn.Linear(cin, cout), nn.Linear(cin, cout, bias=False)

    def forward(self, x, edge_index):
        src, dst = edge_index
        agg = torch.zeros_like(x).scatter_add_(0, dst[:, None].expand(-1, x.shape[1]), x[src])
        cnt = torch.zeros(x.shape[0], dtype=x.dtype).scatter_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
        return self.lin_l(agg / cnt.clamp(min=1)[:, None]) + self.lin_r(x)


class GNN(nn.Module):
    def __init__(self, cin=8, d=32, classes=2):
        super().__init__()
        self.conv1, self.conv2 = GCNConv(cin, d), SAGEConv(d, d)
        self.node_head, self.graph_head = nn.Linear(d, classes), nn.Linear(d, 1)

    def forward(self, x, edge_index, batch, num_graphs):
        h = F.relu(self.conv1(x, edge_index))
        h = F.relu(self.conv2(h, edge_index))
        pooled = torch.zeros(num_graphs, h.shape[1], dtype=h.dtype).scatter_add_(
            0, batch[:, None].expand(-1, h.shape[1]), h)
        cnt = torch.zeros(num_graphs, dtype=h.dtype).scatter_add_(0, batch, torch.ones_like(batch, dtype=h.dtype))
        return self.node_head(h), self.graph_head(pooled / cnt[:, None])


def graph_batches(seed, graphs=8, nodes=12, p=0.25):
    """PyG-style mini-batches of random undirected graphs; node label: whether the sum of the neighbours' first
    feature is positive; graph target: the mean degree / 4."""
    def batch(i):
        g = gen(seed * 100_000 + i)
        xs, eis, bs, ys, gy = [], [], [], [], []
        for k in range(graphs):
            adj = torch.rand(nodes, nodes, generator=g) < p
            adj = torch.triu(adj, 1)
            adj = adj | adj.T
            ei = adj.nonzero().T + k * nodes
            x = torch.randn(nodes, 8, generator=g)
            xs.append(x)
            eis.append(ei)
            bs.append(torch.full((nodes,), k))
            ys.append(((adj.float() @ x[:, 0]) > 0).long())
            gy.append(adj.float().sum() / nodes / 4)
        return torch.cat(xs), torch.cat(eis, 1), torch.cat(bs), torch.cat(ys), torch.stack(gy)[:, None]
    return batch


@case(80)
def gnn_message_passing():
    torch.manual_seed(8)
    m = GNN()
    opt = torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=5e-4)
    amp = Amp(m, opt)
    data = graph_batches(8)

    def body(i):
        x, ei, b, y, gy = data(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=F16):
            node_logits, graph_out = m(x, ei, b, 8)
        loss = F.cross_entropy(node_logits.float(), y) + F.mse_loss(graph_out.float(), gy)
        amp.backward(loss)
        amp.step()
        return loss.item()
    return ns(amp, body)


# --------------------------------------------------------------------------------------------------------- 9. PPO
W_ENV = torch.randn(8, 4, generator=gen(91))


class Agent(nn.Module):
    """CleanRL's Agent: separate critic and actor MLPs (tanh), orthogonal init, actor head std 0.01."""

    def __init__(self):
        super().__init__()

        def layer(i, o, std=math.sqrt(2)):
            lin = nn.Linear(i, o)
            nn.init.orthogonal_(lin.weight, std)
            nn.init.constant_(lin.bias, 0.0)
            return lin
        self.critic = nn.Sequential(layer(8, 32), nn.Tanh(), layer(32, 32), nn.Tanh(), layer(32, 1, 1.0))
        self.actor = nn.Sequential(layer(8, 32), nn.Tanh(), layer(32, 32), nn.Tanh(), layer(32, 4, 0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = torch.distributions.Categorical(logits=self.actor(x).float())
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def _ppo_learned(r):
    rew = r.c.extra["reward"]
    assert sum(rew[-3:]) / 3 > sum(rew[:3]) / 3 + 0.12, rew


def ppo_cleanrl(lr=2.5e-3):
    """The env: 4 envs, obs ~ N(0, 1) in 8 dims; reward 1 for action argmax(obs @ W_ENV), else 0; episodes of 8."""
    torch.manual_seed(9)
    agent = Agent()
    iters, num_envs, num_steps, mbs, epochs = 10, 4, 32, 4, 3
    opt = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    amp = Amp(agent, opt, clip=0.5)
    g = gen(99)
    gamma, lam, clip_coef, ent_coef, vf_coef = 0.99, 0.95, 0.2, 0.01, 0.5
    extra = {"reward": [], "pg": []}

    def body(it):
        opt.param_groups[0]["lr"] = (1.0 - it / iters) * lr
        obs = torch.zeros(num_steps, num_envs, 8)
        actions = torch.zeros(num_steps, num_envs, dtype=torch.long)
        logprobs, rewards, dones, values = (torch.zeros(num_steps, num_envs) for _ in range(4))
        next_obs = torch.randn(num_envs, 8, generator=g)
        for t in range(num_steps):
            obs[t] = next_obs
            dones[t] = float(t % 8 == 0)
            with torch.no_grad(), torch.autocast("cpu", dtype=F16):
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[t], actions[t], logprobs[t] = value.float().flatten(), action, logprob
            rewards[t] = (action == (next_obs @ W_ENV).argmax(1)).float()
            next_obs = torch.randn(num_envs, 8, generator=g)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=F16):
                next_value = agent.get_value(next_obs).float().reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            next_done = torch.zeros(num_envs)
            for t in reversed(range(num_steps)):
                nonterminal = 1.0 - (next_done if t == num_steps - 1 else dones[t + 1])
                nextvalues = next_value if t == num_steps - 1 else values[t + 1]
                delta = rewards[t] + gamma * nextvalues * nonterminal - values[t]
                advantages[t] = lastgaelam = delta + gamma * lam * nonterminal * lastgaelam
            returns = advantages + values
        b_obs, b_actions, b_logprobs = obs.reshape(-1, 8), actions.reshape(-1), logprobs.reshape(-1)
        b_adv, b_ret, b_val = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
        batch_size = num_envs * num_steps
        mb = batch_size // mbs
        tot = []
        for _ in range(epochs):
            inds = torch.randperm(batch_size, generator=g)
            for start in range(0, batch_size, mb):
                mbi = inds[start:start + mb]
                with torch.autocast("cpu", dtype=F16):
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mbi], b_actions[mbi])
                logratio = newlogprob - b_logprobs[mbi]
                ratio = logratio.exp()
                mb_adv = b_adv[mbi]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
                newvalue = newvalue.float().view(-1)
                v_unclipped = (newvalue - b_ret[mbi]) ** 2
                v_clipped = b_val[mbi] + torch.clamp(newvalue - b_val[mbi], -clip_coef, clip_coef)
                v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_ret[mbi]) ** 2).mean()
                loss = pg_loss - ent_coef * entropy.mean() + v_loss * vf_coef
                opt.zero_grad()
                amp.backward(loss)
                amp.step()
                tot.append(loss.item())
                extra["pg"].append(pg_loss.item())
        extra["reward"].append(rewards.mean().item())
        return sum(tot) / len(tot)
    return ns(amp, body, extra)


case(10, learned=_ppo_learned)(ppo_cleanrl)
CASES["ppo_cleanrl_lr1e-2"] = SimpleNamespace(make=lambda: ppo_cleanrl(lr=1e-2), iters=10, fall=None,
                                               learned=_ppo_learned)


# ------------------------------------------------------------------------------------------- 10. RetinaNet head
def sigmoid_focal_loss(inputs, targets, alpha=0.25, gamma=2.0, reduction="sum"):
    """torchvision.ops.sigmoid_focal_loss."""
    p = torch.sigmoid(inputs)
    ce_loss = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce_loss * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.sum() if reduction == "sum" else loss.mean()


class TinyRetina(nn.Module):
    """A conv backbone (stride 4) and RetinaNet-style heads: one anchor (4x4) per location, 1 class."""

    def __init__(self, d=32):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, d, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(d, d, 3, stride=2, padding=1), nn.ReLU())
        self.cls_tower = nn.Sequential(nn.Conv2d(d, d, 3, padding=1), nn.GroupNorm(8, d), nn.ReLU())
        self.reg_tower = nn.Sequential(nn.Conv2d(d, d, 3, padding=1), nn.GroupNorm(8, d), nn.ReLU())
        self.cls_logits = nn.Conv2d(d, 1, 3, padding=1)
        self.bbox_reg = nn.Conv2d(d, 4, 3, padding=1)
        for conv in (self.cls_logits, self.bbox_reg):
            nn.init.normal_(conv.weight, std=0.01)
            nn.init.constant_(conv.bias, 0.0)
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - 0.01) / 0.01))

    def forward(self, images, gt_cls, gt_reg):
        f = self.backbone(images)
        cls = self.cls_logits(self.cls_tower(f)).flatten(1)                 # (B, 16)
        reg = self.bbox_reg(self.reg_tower(f)).flatten(2).transpose(1, 2)   # (B, 16, 4)
        fg = gt_cls > 0
        num_foreground = int(fg.sum())
        loss_cls = sigmoid_focal_loss(cls, gt_cls, reduction="sum") / max(1, num_foreground)
        loss_box = F.smooth_l1_loss(reg[fg], gt_reg[fg], beta=1 / 9, reduction="sum") / max(1, num_foreground)
        return {"classification": loss_cls, "bbox_regression": loss_box}


def box_batches(seed, n=16):
    """16x16 images with 1-2 bright squares (side 3-6); a 4x4 grid of 4x4 anchors; an anchor is foreground when its
    centre lies in a box; the regression target the box's (dx, dy, log w/4, log h/4) relative to the anchor."""
    ctr = (torch.arange(4) * 4 + 2.0)

    def batch(i):
        g = gen(seed * 100_000 + i)
        img = 0.2 * torch.randn(n, 1, 16, 16, generator=g)
        gt_cls, gt_reg = torch.zeros(n, 4, 4), torch.zeros(n, 4, 4, 4)
        for b in range(n):
            for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
                s = int(torch.randint(3, 7, (1,), generator=g))
                y0, x0 = (int(v) for v in torch.randint(0, 16 - s + 1, (2,), generator=g))
                img[b, 0, y0:y0 + s, x0:x0 + s] += 1.0
                inside = ((ctr[:, None] >= y0) & (ctr[:, None] < y0 + s)) & ((ctr[None] >= x0) & (ctr[None] < x0 + s))
                gt_cls[b][inside] = 1.0
                cy, cx = y0 + s / 2, x0 + s / 2
                tgt = torch.stack([(cx - ctr[None].expand(4, 4)) / 4, (cy - ctr[:, None].expand(4, 4)) / 4,
                                   torch.full((4, 4), math.log(s / 4)), torch.full((4, 4), math.log(s / 4))], -1)
                gt_reg[b][inside] = tgt[inside]
        return img, gt_cls.flatten(1), gt_reg.flatten(1, 2)
    return batch


@case(80)
def retinanet_head():
    torch.manual_seed(10)
    m = TinyRetina()
    opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_warmup(10, 80))
    amp = Amp(m, opt, clip=None)
    data = box_batches(10)

    def body(i):
        img, gt_cls, gt_reg = data(i)
        with torch.autocast("cpu", dtype=F16):
            loss_dict = m(img, gt_cls, gt_reg)
            losses = sum(loss for loss in loss_dict.values())
        opt.zero_grad()
        amp.backward(losses)
        amp.step()
        sched.step()
        return losses.item()
    return ns(amp, body)


# -------------------------------------------------------------------------------------------------- 11. nanoGPT
class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.c_attn, self.c_proj, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), CausalSelfAttention(d, h), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=32, block=16, d=32, h=2, L=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(GPTBlock(d, h) for _ in range(L))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, 0.0, 0.02)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
        for n, p in self.named_parameters():
            if n.endswith("c_proj.weight") or n.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * L))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@case(40)
def nanogpt_grad_accum():
    torch.manual_seed(11)
    m = GPT()
    opt = torch.optim.AdamW(decay_groups(m, 0.1), lr=6e-3, betas=(0.9, 0.95))
    amp = Amp(m, opt, clip=1.0)
    accum, max_iters, warmup, lr0, min_lr = 4, 40, 5, 6e-3, 6e-4
    g = gen(111)

    def get_batch():
        """A noisy counting language: each token the one before + 1..3 (per sequence), mod 32."""
        start, stride = torch.randint(0, 32, (8, 1), generator=g), torch.randint(1, 4, (8, 1), generator=g)
        seq = (start + stride * torch.arange(17)) % 32
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def get_lr(it):
        if it < warmup:
            return lr0 * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (max_iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr0 - min_lr)

    state = {"batch": get_batch()}

    def body(it):
        for group in opt.param_groups:
            group["lr"] = get_lr(it)
        tot = 0.0
        for micro in range(accum):
            sync = contextlib.nullcontext() if micro == accum - 1 else getattr(m, "no_sync", contextlib.nullcontext)()
            X, Y = state["batch"]
            with sync:
                with torch.autocast("cpu", dtype=F16):
                    _, loss = m(X, Y)
                    loss = loss / accum
                state["batch"] = get_batch()
                amp.backward(loss)
            tot += loss.item()
        amp.step()
        opt.zero_grad(set_to_none=True)
        return tot
    return ns(amp, body)


# ---------------------------------------------------------------------------------------------------- the test
@pytest.mark.parametrize("name", [pytest.param(n, marks=wrong(XFAIL[n]) if n in XFAIL else ()) for n in CASES])
def test_research_loop_healthy(name, tmp_path):
    cs = CASES[name]
    ru = run(cs)                          # the unwatched twin, with the oracle
    if DEBUG:
        a = ru.c.amp
        print(name, "steps", a.n, "skipped", a.skipped, "scales", sorted(set(a.scales)), "loss",
              [round(v, 4) for v in ru.losses[::max(1, len(ru.losses) // 8)]], ru.losses[-1],
              {k: [round(float(x), 3) if not torch.is_tensor(x) else None for x in v[::10]][:8]
               for k, v in ru.c.extra.items()})
    healthy(ru)
    rw = run(cs, tmp_path / "run")
    identical(rw, ru)
    judge(rw)
