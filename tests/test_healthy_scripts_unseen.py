"""HEALTHY, complete training SCRIPTS in the shape people really write them, watched at ampdoctor's DEFAULT
settings (`ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")`, nothing else): an epoch
loop over a torch.utils.data.DataLoader (shuffled by a seeded generator or a seeded sampler, drop_last=False so the
last batch of each epoch is smaller), model.eval() + torch.no_grad() validation every N steps inside the watched
run, checkpoints through io.BytesIO, LR schedulers, early stopping, gradient accumulation, clip_grad_norm_ with its
norm logged via .item(), EMA weights. fp16 = CPU fp16 autocast + torch.amp.GradScaler("cpu") (default init scale);
bf16 = bf16 autocast, no scaler. Small real models, 200-400 optimizer steps (accumulating scripts: micro-batches),
fixed seeds, one intra-op thread.

Each script is ONE function run twice (`check`): first unwatched, asserted really healthy (every logged loss and
validation loss finite, every logged grad norm finite after the opening steps (< 5), the mean of the last tenth of the train losses below FALL x the first tenth's, the loss
scale decreased only in the scaler's opening steps (< 5) and at most 3 times, at least 200 steps); then watched:
the per-step losses, validation losses, logged grad norms, final state_dict (and the EMA model's where used) must be
bitwise identical to the unwatched twin (a plain failure otherwise); last, the report holds no warning or error and
exit code 0 (WrongAnswer otherwise: a false finding on a healthy script is a strict xfail, probe_harness.wrong,
quoting the finding).

Not duplicated: test_healthy_idioms_unseen / _training_shapes_unseen / _dynamics_unseen test single idioms or
alarming-looking numbers in a bare step loop of 40-120 steps; here the idioms are combined as whole scripts
(DataLoader epochs with a short last batch, eval every N steps, BytesIO resume round trips, schedulers keyed on
validation, param groups added mid-run) and run 200-400 steps.

Scripts:
 1. cnn_onecycle_ema (fp16): Conv/BN CNN classifier, AdamW with a no-weight-decay group (biases, BN), OneCycleLR,
    clip_grad_norm_(2.0).item() logged, AveragedModel EMA (use_buffers) updated each step; model and EMA validated
    every 50 steps.
 2. mlp_accum_remainder_ckpt (fp16): residual LayerNorm MLP, 4-batch gradient accumulation whose epoch-end
    remainder (2 batches) is stepped with the loss divided by the real group size, zero_grad(set_to_none=False),
    warmup+cosine LambdaLR, a model/optimizer/scaler/scheduler BytesIO save+load round trip mid-run.
 3. imbalanced_sampler_plateau (bf16): 80/15/5 imbalanced 3-class data drawn by a seeded WeightedRandomSampler,
    ReduceLROnPlateau stepped on the validation loss, early stopping (patience) on it.
 4. seq2seq_gru_teacher_forcing (fp16): GRU encoder (packed padded sequences) + GRUCell decoder with dot attention
    masked on padding, decaying teacher forcing, CE with ignore_index=pad; greedy-decoding validation.
 5. tiny_vit_mixup_ls (fp16): patch-embedding ViT (cls token, nn.MultiheadAttention blocks), mixup (Beta(0.4,0.4))
    and label smoothing 0.1, no-decay group, warmup+cosine.
 6. vae_kl_anneal (fp16): MLP VAE with the reparameterisation trick, KL weight annealed 0 -> 1 over 150 steps.
 7. freeze_unfreeze_backbone (fp16): a CNN backbone frozen (requires_grad off, BN in eval) for 100 steps while
    the head trains, then unfrozen and added to the optimizer by add_param_group at a lower LR.
 8. char_lm_bf16_ckpt (bf16): a tiny causal transformer LM (SDPA, is_causal), 2-batch accumulation, warmup+cosine,
    BytesIO checkpoint round trip mid-run, validation perplexity every 40 steps.
 9. tabular_best_ckpt (fp16): categorical embeddings + numeric features, BatchNorm1d MLP regression, StepLR, the
    best validation state kept in a BytesIO and restored at the end inside the watch; early stopping.
10. ts_conv_gru_ema_plateau (fp16): 1-D conv + GRU forecaster, zero_grad(set_to_none=False), EMA weights,
    ReduceLROnPlateau on validation, a BytesIO resume round trip mid-run.

Result when written: 10 pass, 0 xfail -- ampdoctor stayed quiet on every script (info only: the scaler's
opening overflow/skip at step 0 in vae_kl_anneal and ts_conv_gru_ema_plateau) and the watch changed nothing
(losses, validation losses, grad norms, final and EMA weights bitwise identical). Tuning notes (healthy-run
criterion, not ampdoctor): seq2seq uses GradScaler(init_scale=2**12) and tabular has a 24-row last batch,
since at 2**16 / a 4-row BatchNorm batch the scaler skipped an isolated later step (a normal dynamic-scaling
event, but outside this file's "opening backoffs only" criterion).
"""
from __future__ import annotations

import io
import math
import struct

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import ampdoctor
from probe_harness import WrongAnswer, wrong
from scenarios import alarms, gen, lines, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16


class Trace:
    """A script's log: starts the watch (when run_dir is given), keeps what a script prints."""

    def __init__(self, model, opt, sc, rd):
        self.sc = sc
        self.w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=rd) if rd is not None else None
        self.losses, self.scales, self.norms, self.vals = [], [], [], []
        self.step = 0

    def log(self, loss, norm=None):
        self.losses.append(loss.item())
        self.scales.append(self.sc.get_scale() if self.sc is not None else 1.0)
        if norm is not None:
            self.norms.append(norm)

    def finish(self, model, ema=None):
        rep = None
        if self.w is not None:
            self.w.close()
            rep = self.w.report()
        return {"losses": self.losses, "scales": self.scales, "norms": self.norms, "vals": self.vals,
                "steps": self.step, "state": state_bytes(model), "ema": state_bytes(ema) if ema is not None else None,
                "rep": rep}


def state_bytes(m):
    return {k: bytes(v.detach().reshape(-1).contiguous().view(torch.uint8).tolist()) if v.numel() else b""
            for k, v in m.state_dict().items()}


def fbits(xs):
    return [struct.pack("<d", float(x)) for x in xs]


def loader(ds, bs, seed):
    return DataLoader(ds, batch_size=bs, shuffle=True, generator=gen(seed), drop_last=False)


def roundtrip(**objs):
    """Save the state_dicts to a BytesIO and load them back (a resume)."""
    buf = io.BytesIO()
    torch.save({k: o.state_dict() for k, o in objs.items()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    for k, o in objs.items():
        o.load_state_dict(ck[k])


def no_decay_groups(model, wd):
    decay, no = [], []
    for n, p in model.named_parameters():
        (no if p.ndim <= 1 or n.endswith(".bias") or "pos" in n or "cls" in n else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no, "weight_decay": 0.0}]


def warmup_cosine(opt, warm, total):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, total - warm)))))


def check(script, tmp_path, fall=0.7):
    a = script(None)
    ls = a["losses"]
    assert a["steps"] >= 200, a["steps"]
    # a logged grad norm is inf only on the scaler's opening skipped steps (clip_grad_norm_ after unscale_)
    assert all(map(math.isfinite, ls + a["vals"] + a["norms"][5:])), (ls, a["vals"])
    k = max(1, len(ls) // 10)
    assert sum(ls[-k:]) / k < fall * sum(ls[:k]) / k, (sum(ls[:k]) / k, sum(ls[-k:]) / k)
    drops = [i for i, (x, y) in enumerate(zip(a["scales"], a["scales"][1:])) if y < x]
    assert len(drops) <= 3 and all(i < 5 for i in drops), drops
    b = script(tmp_path / "run")
    assert fbits(b["losses"]) == fbits(a["losses"]), "losses differ under the watch"
    assert fbits(b["vals"]) == fbits(a["vals"]) and fbits(b["norms"]) == fbits(a["norms"])
    assert b["state"] == a["state"], [k for k in a["state"] if a["state"][k] != b["state"].get(k)]
    assert b["ema"] == a["ema"], "EMA weights differ under the watch"
    rep = b["rep"]
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(lines(rep))
    return a


def images(n, classes, seed, noise=0.8):
    g = gen(seed)
    tmpl = torch.randn(classes, 3, 8, 8, generator=gen(1000))
    y = torch.randint(0, classes, (n,), generator=g)
    return tmpl[y] + noise * torch.randn(n, 3, 8, 8, generator=g), y


@torch.no_grad()
def evaluate(model, dl, loss_fn, dtype):
    was = model.training
    model.eval()
    tot, n = 0.0, 0
    for batch in dl:
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, *batch)
        tot += loss.float().item() * len(batch[0])
        n += len(batch[0])
    model.train(was)
    return tot / n


# ---------------------------------------------------------------- 1
class SmallCNN(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                      nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16),
                                      nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.drop, self.fc = nn.Dropout(0.1), nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(self.drop(self.features(x)))


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def cnn_onecycle_ema(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*images(330, 4, 1)), 32, 2)  # 10 x 32 + 10
    val = DataLoader(TensorDataset(*images(128, 4, 3)), batch_size=64)
    model = SmallCNN()
    opt = torch.optim.AdamW(no_decay_groups(model, 0.05), lr=1e-3)
    epochs = 20
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=epochs * len(dl))
    sc = torch.amp.GradScaler("cpu")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
    t = Trace(model, opt, sc, rd)
    for epoch in range(epochs):
        model.train()
        for x, y in dl:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(model(x), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0).item()
            sc.step(opt)
            sc.update()
            sched.step()
            ema.update_parameters(model)
            t.log(loss, gn)
            t.step += 1
            if t.step % 50 == 0:
                t.vals.append(evaluate(model, val, ce, FP16))
                t.vals.append(evaluate(ema, val, ce, FP16))
    return t.finish(model, ema)


# ---------------------------------------------------------------- 2
class ResMLP(nn.Module):
    def __init__(self, d_in=20, d=64, classes=5, n=3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def mixture(n, seed, d=20, classes=5):
    g = gen(seed)
    centers = torch.randn(classes, d, generator=gen(2000)) * 1.2
    y = torch.randint(0, classes, (n,), generator=g)
    return centers[y] + torch.randn(n, d, generator=g), y


def mlp_accum_remainder_ckpt(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*mixture(700, 1)), 32, 2)  # 22 batches: 21 x 32 + 28
    val = DataLoader(TensorDataset(*mixture(200, 3)), batch_size=100)
    model = ResMLP()
    accum, epochs = 4, 36
    per_epoch = math.ceil(len(dl) / accum)  # 5 full groups + a remainder group of 2
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = warmup_cosine(opt, 20, epochs * per_epoch)
    sc = torch.amp.GradScaler("cpu")
    t = Trace(model, opt, sc, rd)
    n_batches = len(dl)
    for epoch in range(epochs):
        opt.zero_grad(set_to_none=False)
        for i, (x, y) in enumerate(dl):
            group = accum if i // accum < n_batches // accum else n_batches % accum
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(model(x), y)
            sc.scale(loss / group).backward()
            t.log(loss)
            if (i + 1) % accum == 0 or i + 1 == n_batches:
                sc.unscale_(opt)
                t.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
                sc.step(opt)
                sc.update()
                sched.step()
                opt.zero_grad(set_to_none=False)
                t.step += 1
        if epoch % 3 == 2:
            t.vals.append(evaluate(model, val, ce, FP16))
        if epoch == epochs // 2:
            roundtrip(model=model, opt=opt, scaler=sc, sched=sched)
    return t.finish(model)


# ---------------------------------------------------------------- 3
def imbalanced(n, seed):
    g = gen(seed)
    y = torch.multinomial(torch.tensor([0.80, 0.15, 0.05]), n, replacement=True, generator=g)
    centers = torch.randn(3, 16, generator=gen(3000))
    return centers[y] + 1.0 * torch.randn(n, 16, generator=g), y


def imbalanced_sampler_plateau(rd):
    torch.manual_seed(0)
    x, y = imbalanced(800, 1)
    counts = torch.bincount(y, minlength=3).double()
    sampler = WeightedRandomSampler((1.0 / counts)[y], num_samples=len(y), replacement=True, generator=gen(2))
    dl = DataLoader(TensorDataset(x, y), batch_size=64, sampler=sampler, drop_last=False)  # 12 x 64 + 32
    val = DataLoader(TensorDataset(*imbalanced(300, 3)), batch_size=150)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64),
                          nn.GELU(), nn.Linear(64, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=2)
    t = Trace(model, opt, None, rd)
    best, bad, patience, stop = float("inf"), 0, 6, False
    for epoch in range(30):
        for xb, yb in dl:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            opt.step()
            t.log(loss, gn)
            t.step += 1
            if t.step % 20 == 0:
                v = evaluate(model, val, ce, BF16)
                t.vals.append(v)
                plateau.step(v)
                if v < best - 1e-4:
                    best, bad = v, 0
                else:
                    bad += 1
                    stop = bad >= patience and t.step >= 200
            if stop:
                break
        if stop:
            break
    return t.finish(model)


# ---------------------------------------------------------------- 4
PAD, BOS, EOS, V = 0, 1, 2, 14


def reverse_task(n, seed, lo=3, hi=8):
    g = gen(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    src = torch.zeros(n, hi, dtype=torch.long)
    tgt = torch.zeros(n, hi + 1, dtype=torch.long)
    for i, L in enumerate(lens.tolist()):
        s = torch.randint(3, V, (L,), generator=g)
        src[i, :L] = s
        tgt[i, :L] = s.flip(0)
        tgt[i, L] = EOS
    return src, lens, tgt


class Seq2Seq(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(V, d, padding_idx=PAD), nn.Embedding(V, d, padding_idx=PAD)
        self.encoder = nn.GRU(d, h, batch_first=True)
        self.cell = nn.GRUCell(d + h, h)
        self.out = nn.Linear(2 * h, V)

    def encode(self, src, lens):
        packed = pack_padded_sequence(self.src_emb(src), lens, batch_first=True, enforce_sorted=False)
        enc, h = self.encoder(packed)
        enc, _ = pad_packed_sequence(enc, batch_first=True, total_length=src.shape[1])
        return enc, h[0]

    def attend(self, h, enc, mask):
        scores = torch.bmm(enc, h.unsqueeze(2)).squeeze(2).masked_fill(~mask, float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=1).unsqueeze(1), enc).squeeze(1)

    def forward(self, src, lens, tgt, tf_ratio=1.0, tf_gen=None):
        enc, h = self.encode(src, lens)
        mask = src != PAD
        tok = torch.full((src.shape[0],), BOS, dtype=torch.long)
        ctx = self.attend(h, enc, mask)
        logits = []
        for s in range(tgt.shape[1]):
            h = self.cell(torch.cat([self.tgt_emb(tok), ctx], 1), h)
            ctx = self.attend(h, enc, mask)
            lg = self.out(torch.cat([h, ctx], 1))
            logits.append(lg)
            teach = tf_gen is None or torch.rand((), generator=tf_gen).item() < tf_ratio
            tok = tgt[:, s] if teach else lg.argmax(1)
        return torch.stack(logits, 1)


def seq_loss(model, src, lens, tgt):
    return F.cross_entropy(model(src, lens, tgt, tf_ratio=0.0, tf_gen=gen(0)).float().flatten(0, 1), tgt.flatten(),
                           ignore_index=PAD)


def seq2seq_gru_teacher_forcing(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*reverse_task(500, 1)), 32, 2)  # 15 x 32 + 20
    val = DataLoader(TensorDataset(*reverse_task(128, 3)), batch_size=64)
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    tf_gen = gen(4)
    epochs = 16
    total = epochs * len(dl)
    t = Trace(model, opt, sc, rd)
    for epoch in range(epochs):
        model.train()
        for src, lens, tgt in dl:
            ratio = 1.0 - 0.5 * t.step / total
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                logits = model(src, lens, tgt, ratio, tf_gen)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=PAD)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            sc.step(opt)
            sc.update()
            t.log(loss, gn)
            t.step += 1
            if t.step % 60 == 0:
                t.vals.append(evaluate(model, val, seq_loss, FP16))
    return t.finish(model)


# ---------------------------------------------------------------- 5
class ViTBlock(nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    def __init__(self, classes=4, d=48, patch=2, n=2):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 1 + (8 // patch) ** 2, d) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(d) for _ in range(n)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        p = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(p), -1, -1), p], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def tiny_vit_mixup_ls(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*images(340, 4, 11, noise=1.0)), 32, 12)  # 10 x 32 + 20
    val = DataLoader(TensorDataset(*images(128, 4, 13, noise=1.0)), batch_size=64)
    model = TinyViT()
    opt = torch.optim.AdamW(no_decay_groups(model, 0.05), lr=2e-3)
    epochs = 20
    sched = warmup_cosine(opt, 25, epochs * len(dl))
    sc = torch.amp.GradScaler("cpu")
    beta = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))
    t = Trace(model, opt, sc, rd)
    for epoch in range(epochs):
        for x, y in dl:
            lam = beta.sample().item()
            perm = torch.randperm(len(x))
            xm = lam * x + (1 - lam) * x[perm]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                out = model(xm)
                loss = lam * F.cross_entropy(out, y, label_smoothing=0.1) + \
                    (1 - lam) * F.cross_entropy(out, y[perm], label_smoothing=0.1)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            sc.step(opt)
            sc.update()
            sched.step()
            t.log(loss, gn)
            t.step += 1
            if t.step % 50 == 0:
                t.vals.append(evaluate(model, val, ce, FP16))
    return t.finish(model)


# ---------------------------------------------------------------- 6
class VAE(nn.Module):
    def __init__(self, d=24, h=64, z=4):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.mu, self.logvar = nn.Linear(h, z), nn.Linear(h, z)
        self.dec = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x):
        e = self.enc(x)
        mu, logvar = self.mu(e), self.logvar(e)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar) if self.training else mu
        return self.dec(z), mu, logvar


def manifold(n, seed):
    g = gen(seed)
    z = torch.randn(n, 3, generator=g)
    A = torch.randn(3, 24, generator=gen(4000))
    return (torch.tanh(z @ A) + 0.05 * torch.randn(n, 24, generator=g),)


def vae_terms(model, x):
    rec, mu, logvar = model(x)
    recon = F.mse_loss(rec.float(), x, reduction="none").sum(1).mean()
    kl = (-0.5 * (1 + logvar.float() - mu.float() ** 2 - logvar.float().exp()).sum(1)).mean()
    return recon, kl


def vae_kl_anneal(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*manifold(700, 1)), 64, 2)  # 10 x 64 + 60
    val = DataLoader(TensorDataset(*manifold(200, 3)), batch_size=100)
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    t = Trace(model, opt, sc, rd)
    for epoch in range(28):
        for (x,) in dl:
            kl_w = min(1.0, t.step / 150)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                recon, kl = vae_terms(model, x)
                loss = recon + kl_w * kl
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0).item()
            sc.step(opt)
            sc.update()
            t.log(loss, gn)
            t.step += 1
            if t.step % 50 == 0:
                t.vals.append(evaluate(model, val, lambda m, x: sum(vae_terms(m, x)), FP16))
    return t.finish(model)


# ---------------------------------------------------------------- 7
class FineTune(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x):
        return self.head(self.backbone(x))


def freeze_unfreeze_backbone(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*images(340, 4, 21)), 32, 22)  # 10 x 32 + 20
    val = DataLoader(TensorDataset(*images(128, 4, 23)), batch_size=64)
    model = FineTune()
    model.backbone.requires_grad_(False)
    opt = torch.optim.AdamW(model.head.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    t = Trace(model, opt, sc, rd)
    frozen = True
    for epoch in range(20):
        model.train()
        if frozen:
            model.backbone.eval()
        for x, y in dl:
            if frozen and t.step >= 100:
                frozen = False
                model.backbone.requires_grad_(True)
                model.backbone.train()
                opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 5e-4})
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(model(x), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0).item()
            sc.step(opt)
            sc.update()
            t.log(loss, gn)
            t.step += 1
            if t.step % 50 == 0:
                t.vals.append(evaluate(model, val, ce, FP16))
                if frozen:
                    model.backbone.eval()
    return t.finish(model)


# ---------------------------------------------------------------- 8
class CausalBlock(nn.Module):
    def __init__(self, d, h=4):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab=32, d=32, T=16, n=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(CausalBlock(d) for _ in range(n))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def lm_data(n, seed, vocab=32, T=17):
    g = gen(seed)
    rules = torch.tensor([[1, 3], [3, 5], [5, 7], [7, 1]])
    r = rules[torch.randint(0, 4, (n,), generator=g)]
    x = torch.zeros(n, T, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for s in range(1, T):
        x[:, s] = (r[:, 0] * x[:, s - 1] + r[:, 1]) % vocab
    return x[:, :-1], x[:, 1:]


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def char_lm_bf16_ckpt(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*lm_data(280, 1)), 16, 2)  # 17 x 16 + 8
    val = DataLoader(TensorDataset(*lm_data(128, 3)), batch_size=64)
    model = CharLM()
    accum, epochs = 2, 24
    steps = epochs * math.ceil(len(dl) / accum)
    opt = torch.optim.AdamW(no_decay_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = warmup_cosine(opt, 20, steps)
    t = Trace(model, opt, None, rd)
    for epoch in range(epochs):
        for i, (x, y) in enumerate(dl):
            with torch.autocast("cpu", dtype=BF16):
                loss = lm_loss(model, x, y)
            (loss / accum).backward()
            t.log(loss)
            if (i + 1) % accum == 0 or i + 1 == len(dl):
                t.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                t.step += 1
                if t.step % 40 == 0:
                    t.vals.append(math.exp(evaluate(model, val, lm_loss, BF16)))
        if epoch == epochs // 2:
            roundtrip(model=model, opt=opt, sched=sched)
    return t.finish(model)


# ---------------------------------------------------------------- 9
class TabNet(nn.Module):
    def __init__(self, cards=(7, 12, 5), num=6, d=8, h=64):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, d) for c in cards)
        self.mlp = nn.Sequential(nn.Linear(len(cards) * d + num, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.05),
                                 nn.Linear(h, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, 1))

    def forward(self, cat, num):
        return self.mlp(torch.cat([e(cat[:, i]) for i, e in enumerate(self.embs)] + [num], 1)).squeeze(1)


def tabular(n, seed, cards=(7, 12, 5)):
    g = gen(seed)
    cat = torch.stack([torch.randint(0, c, (n,), generator=g) for c in cards], 1)
    num = torch.randn(n, 6, generator=g)
    eff = [torch.randn(c, generator=gen(5000 + i)) for i, c in enumerate(cards)]
    w = torch.randn(6, generator=gen(5100))
    y = sum(e[cat[:, i]] for i, e in enumerate(eff)) + num @ w + 0.5 * torch.sin(2 * num[:, 0])
    return cat, num, (y + 0.1 * torch.randn(n, generator=g)) / 3.0  # targets scaled to ~unit variance


def mse(model, cat, num, y):
    return F.mse_loss(model(cat, num).float(), y)


def tabular_best_ckpt(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*tabular(920, 1)), 64, 2)  # 14 x 64 + 24
    val = DataLoader(TensorDataset(*tabular(256, 3)), batch_size=128)
    model = TabNet()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    sc = torch.amp.GradScaler("cpu")
    t = Trace(model, opt, sc, rd)
    best, best_buf, bad, stop = float("inf"), None, 0, False
    for epoch in range(22):
        model.train()
        for cat, num, y in dl:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=FP16):
                loss = mse(model, cat, num, y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0).item()
            sc.step(opt)
            sc.update()
            sched.step()
            t.log(loss, gn)
            t.step += 1
            if t.step % 25 == 0:
                v = evaluate(model, val, mse, FP16)
                t.vals.append(v)
                if v < best:
                    best, bad, best_buf = v, 0, io.BytesIO()
                    torch.save(model.state_dict(), best_buf)
                else:
                    bad += 1
                    stop = bad >= 5 and t.step >= 200
            if stop:
                break
        if stop:
            break
    best_buf.seek(0)
    model.load_state_dict(torch.load(best_buf))
    t.vals.append(evaluate(model, val, mse, FP16))
    return t.finish(model)


# ---------------------------------------------------------------- 10
class Forecaster(nn.Module):
    def __init__(self, c=3, d=24, h=32, horizon=4):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(c, d, 5, padding=2), nn.GELU(), nn.Conv1d(d, d, 3, padding=1), nn.GELU())
        self.gru = nn.GRU(d, h, batch_first=True)
        self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, horizon)

    def forward(self, x):
        out, _ = self.gru(self.conv(x.transpose(1, 2)).transpose(1, 2))
        return self.head(self.norm(out[:, -1]))


def series(n, seed, T=16, horizon=4):
    g = gen(seed)
    t = torch.arange(T + horizon, dtype=torch.float32)
    f = 0.1 + 0.3 * torch.rand(n, 1, generator=g)
    ph = 6.28 * torch.rand(n, 1, generator=g)
    s = torch.sin(f * t + ph) + 0.3 * torch.sin(2.3 * f * t) + 0.05 * torch.randn(n, T + horizon, generator=g)
    x = torch.stack([s[:, :T], torch.cos(f * t[:T] + ph), f.expand(n, T)], 2)
    return x, s[:, T:]


def fmse(model, x, y):
    return F.mse_loss(model(x).float(), y)


def ts_conv_gru_ema_plateau(rd):
    torch.manual_seed(0)
    dl = loader(TensorDataset(*series(420, 1)), 32, 2)  # 13 x 32 + 4
    val = DataLoader(TensorDataset(*series(160, 3)), batch_size=80)
    model = Forecaster()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)
    sc = torch.amp.GradScaler("cpu")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.98))
    t = Trace(model, opt, sc, rd)
    for epoch in range(16):
        for x, y in dl:
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cpu", dtype=FP16):
                loss = fmse(model, x, y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            sc.step(opt)
            sc.update()
            ema.update_parameters(model)
            t.log(loss, gn)
            t.step += 1
            if t.step % 30 == 0:
                v = evaluate(model, val, fmse, FP16)
                t.vals += [v, evaluate(ema, val, fmse, FP16)]
                plateau.step(v)
        if epoch == 8:
            roundtrip(model=model, opt=opt, scaler=sc, plateau=plateau, ema=ema)
    return t.finish(model, ema)


SCRIPTS = {
    "cnn_onecycle_ema": (cnn_onecycle_ema, 0.7, None),
    "mlp_accum_remainder_ckpt": (mlp_accum_remainder_ckpt, 0.7, None),
    "imbalanced_sampler_plateau": (imbalanced_sampler_plateau, 0.7, None),
    "seq2seq_gru_teacher_forcing": (seq2seq_gru_teacher_forcing, 0.7, None),
    "tiny_vit_mixup_ls": (tiny_vit_mixup_ls, 0.85, None),
    "vae_kl_anneal": (vae_kl_anneal, 0.7, None),
    "freeze_unfreeze_backbone": (freeze_unfreeze_backbone, 0.7, None),
    "char_lm_bf16_ckpt": (char_lm_bf16_ckpt, 0.7, None),
    "tabular_best_ckpt": (tabular_best_ckpt, 0.7, None),
    "ts_conv_gru_ema_plateau": (ts_conv_gru_ema_plateau, 0.7, None),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[wrong(x)] if x else []) for n, (_, _, x) in SCRIPTS.items()])
def test_healthy_script(name, tmp_path):
    fn, fall, _ = SCRIPTS[name]
    check(fn, tmp_path, fall)
