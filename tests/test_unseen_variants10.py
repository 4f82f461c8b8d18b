"""Tenth set of failure-pattern variants, watched through the public API only (watch -> an ordinary loop ->
w.report()) at ampdoctor's default settings, in the deeper architectures and training styles practitioners run,
with the failure starting mid-run (never at step 0) and neighbours on both sides of the producer: a wav2vec2-style
conv feature extractor whose first conv overflows on one loud (raw int16-range) batch, with the GroupNorm after it
turning the inf into NaN; a ViT whose one block's MLP sits in a param group with a too-high learning rate; an IRNN
language model (ReLU RNN, recurrent matrix drifted past spectral radius 1) when the sequence-length curriculum jumps;
a GIN whose sum aggregation over a celebrity node overflows in the second layer; a two-tower recommender whose grown
power-user and hit-item rows first meet; LARS without its zero-gradient guard on a multi-task head that gets an
all-zero gradient (the update writes NaN weights); gradient accumulation whose third of four micro-batches overflows; a loop that drops
non-finite batches itself (no backward, no scaler call); a log-mel front end whose log(mel + 1e-10) meets digital
silence; a detector's GIoU loss computed in fp16 pixel coordinates on a large object; PPO's importance ratio
exp(logp - old_logp) against a stale behaviour policy (outside the model); a WGAN critic without a Lipschitz
constraint, whose output grows step by step until its last Linear overflows.

Each failure is first checked to be real in the loop itself (the loss, the scaler's skipped steps, and forward
hooks that name the first module whose output is non-finite from finite inputs); then the right rule at the
producing module among the first three findings, at the right step. Where ampdoctor is wrong the test is a strict
xfail whose reason says what it reported instead."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import in_top3, lines, no_error_at, one_thread, randn
from probe_harness import Producer, at_top3 as at


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def train_loop(m, batch, loss_fn, steps, *, opt=None, lr=1e-3, init_scale=1024.0, accum=1, skip_bad=False, clip=1.0,
               sched=None, call=None):
    """zero_grad -> (accum x: forward under fp16 autocast -> scale(loss / accum).backward) -> unscale_ -> clip ->
    step -> update -> sched.step. `skip_bad`: the loop drops a batch whose loss is non-finite itself (no backward, no
    scaler call). `batch(i, j)` gives micro-batch j of iteration i. Returns a dict: w (closed watch), first
    (producer, optimizer step) from forward hooks, skipped (optimizer steps the scaler skipped), bad_loss
    (optimizer steps with a non-finite loss), dropped (iterations the loop dropped)."""
    opt = opt or torch.optim.AdamW(m.parameters(), lr=lr)
    sched = sched(opt) if sched else None
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    prod = Producer(m, own_params=False)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    call = call or m
    skipped, bad_loss, dropped, step = [], [], [], 0
    for i in range(steps):
        prod.step = step
        opt.zero_grad(set_to_none=False)
        drop = False
        for j in range(accum):
            args = batch(i, j)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(call(*args), *args) / accum
            if not torch.isfinite(loss):
                if step not in bad_loss:
                    bad_loss.append(step)
                if skip_bad:
                    drop = True
                    break
            sc.scale(loss).backward()
        if drop:
            dropped.append(i)
            opt.zero_grad()
            continue
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        before = sc.get_scale()
        sc.step(opt)
        sc.update()
        if sc.get_scale() < before:
            skipped.append(step)
        if sched:
            sched.step()
        step += 1
    w.close()
    prod.remove()
    return dict(w=w, first=prod.first, bad_weights=prod.bad_weights, skipped=skipped, bad_loss=bad_loss,
                dropped=dropped)


# ======================================================================================================================
# 1. wav2vec2-style conv feature extractor: one loud batch (raw int16 range, do_normalize forgotten in one shard)
# ======================================================================================================================
class ConvLayer(nn.Module):
    def __init__(self, cin, cout, k, s, norm=False):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, stride=s, bias=False)
        self.layer_norm = nn.GroupNorm(cout, cout) if norm else nn.Identity()
        self.activation = nn.GELU()

    def forward(self, x):
        return self.activation(self.layer_norm(self.conv(x)))


class FeatureEncoder(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.conv_layers = nn.ModuleList([ConvLayer(1, c, 10, 5, norm=True)] +
                                         [ConvLayer(c, c, 3, 2) for _ in range(4)])
        for layer in self.conv_layers:  # as transformers' Wav2Vec2 does
            nn.init.kaiming_normal_(layer.conv.weight)

    def forward(self, wav):
        x = wav.unsqueeze(1)
        for layer in self.conv_layers:
            x = layer(x)
        return x


class Wav2Vec(nn.Module):
    def __init__(self, c=16, d=32):
        super().__init__()
        self.feature_extractor = FeatureEncoder(c)
        self.feature_projection = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, d))
        self.encoder = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.head = nn.Linear(d, 5)

    def forward(self, wav):
        h = self.feature_projection(self.feature_extractor(wav).transpose(1, 2))
        return self.head(self.encoder(h))


def test_wav2vec_feature_extractor_first_conv_overflows_on_one_loud_batch_not_its_group_norm():
    torch.manual_seed(0)
    m = Wav2Vec()

    def batch(i, j=0):  # step 4's shard was never normalised: int16-range samples
        wav = randn(4, 1600, seed=i) * 0.1
        if i == 4:
            wav = (randn(4, 1600, seed=99) * 2e4).clamp(-32768, 32767)
        return (wav,)
    r = train_loop(m, batch, lambda o, *a: o.float().pow(2).mean(), 8)
    assert r["first"] == ("feature_extractor.conv_layers.0.conv", 4) and r["bad_loss"] == [4], r  # real
    rep = r["w"].report()
    at(rep, ("overflow",), "feature_extractor.conv_layers.0.conv", step=4, phase="forward")
    no_error_at(rep, ("feature_extractor.conv_layers.0.layer_norm", "feature_extractor.conv_layers.1.conv",
                      "feature_extractor.conv_layers.0", "feature_extractor", "feature_projection.0", ""))


# ======================================================================================================================
# 2. ViT: one block's MLP put in a param group with lr 5.0 (a typo for 5e-4): it overflows five steps later
# ======================================================================================================================
class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ViTBlock(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = Mlp(d)

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, d=32, depth=4, classes=10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, 4, stride=4)
        self.pos = nn.Parameter(torch.zeros(1, 16, d))
        self.blocks = nn.ModuleList(ViTBlock(d) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, img):
        x = self.patch_embed(img).flatten(2).transpose(1, 2) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x).mean(1))


def test_vit_one_blocks_mlp_with_a_too_high_param_group_lr_overflows_steps_later_in_that_mlp():
    torch.manual_seed(0)
    m = ViT()
    hot = list(m.blocks[2].mlp.parameters())
    rest = [p for p in m.parameters() if all(p is not q for q in hot)]
    opt = torch.optim.AdamW([{"params": rest, "lr": 1e-3}, {"params": hot, "lr": 5.0}])  # meant 5e-4
    img, y = randn(16, 3, 16, 16), torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(1))
    r = train_loop(m, lambda i, j=0: (img,), lambda o, *a: F.cross_entropy(o.float(), y), 8, opt=opt)
    name, k = r["first"]
    assert name.startswith("blocks.2.mlp.fc") and 3 <= k and k in r["bad_loss"], r  # real, mid-run
    rep = r["w"].report()
    at(rep, ("overflow",), name, step=k, phase="forward")
    no_error_at(rep, ("blocks.3.norm1", "blocks.3.attn", "blocks.2", "norm", "head"))


# ======================================================================================================================
# 3. IRNN language model (ReLU RNN, recurrent matrix drifted to spectral radius 1.02): the length curriculum jumps
# ======================================================================================================================
class RNNLM(nn.Module):
    def __init__(self, vocab=64, d=16, h=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = nn.RNN(d, h, num_layers=2, nonlinearity="relu", batch_first=True)
        self.drop = nn.Dropout(0.0)
        self.decoder = nn.Linear(h, vocab)
        with torch.no_grad():  # IRNN init (Le et al. 2015), drifted in training to radius 1.02
            for layer in range(2):
                getattr(self.rnn, f"weight_hh_l{layer}").copy_(1.02 * torch.eye(h))

    def forward(self, idx):
        return self.decoder(self.drop(self.rnn(self.embed(idx))[0]))


def test_irnn_language_model_hidden_state_explodes_when_the_sequence_length_jumps():
    torch.manual_seed(0)
    m = RNNLM()

    def batch(i, j=0):  # curriculum: 32 tokens, then 512 from step 5
        idx = torch.randint(0, 64, (2, 512 if i >= 5 else 32), generator=torch.Generator().manual_seed(i))
        return (idx,)
    loss = lambda o, idx: F.cross_entropy(o.float()[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    r = train_loop(m, batch, loss, 7, lr=1e-4)
    assert r["first"] == ("rnn", 5) and r["bad_loss"][:1] == [5], r  # real
    rep = r["w"].report()
    at(rep, ("overflow",), "rnn", step=5, phase="forward")
    no_error_at(rep, ("decoder", "drop", "embed", ""))


# ======================================================================================================================
# 4. GIN: a celebrity node in one batch; the second layer's sum aggregation over its neighbours overflows
# ======================================================================================================================
class GINConv(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())

    def forward(self, h, src, dst):
        agg = torch.zeros_like(h).index_add_(0, dst, h[src])  # sum aggregation (GIN)
        return self.mlp(h + agg)


class GIN(nn.Module):
    def __init__(self, d=16, layers=3, classes=4):
        super().__init__()
        self.convs = nn.ModuleList(GINConv(d) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x, src, dst):
        h = x
        for conv in self.convs:
            h = conv(h, src, dst)
        return self.head(h)


def _graph(i, hub_degree):
    g = torch.Generator().manual_seed(i)
    n = 64 + hub_degree
    src = torch.randint(0, n, (4 * n,), generator=g)
    dst = torch.randint(0, n, (4 * n,), generator=g)
    if hub_degree:  # node 0 follows / is followed by every leaf
        leaves = torch.arange(64, n)
        src, dst = torch.cat([src, leaves]), torch.cat([dst, torch.zeros_like(leaves)])
    return randn(n, 16, seed=i), src, dst


def test_gin_sum_aggregation_over_a_celebrity_node_overflows_in_the_second_layer():
    torch.manual_seed(0)
    m = GIN()

    def batch(i, j=0):
        return _graph(i, 200000 if i == 5 else 0)
    loss = lambda o, *a: o.float().pow(2).mean()
    r = train_loop(m, batch, loss, 7)
    assert r["first"] == ("convs.1", 5) and 5 in r["bad_loss"], r  # real: convs.0's sum is finite, convs.1's is not
    rep = r["w"].report()
    at(rep, ("overflow",), "convs.1", step=5, phase="forward")
    no_error_at(rep, ("convs.1.mlp.0", "convs.1.mlp", "convs.2", "convs.0", "head", ""))


# ======================================================================================================================
# 5. two-tower recommender: the season's hit and a power user have embedding rows that grew over a long run (x150);
#    the first batch that pairs them (step 6) overflows the fp16 dot product in the scorer, not the towers
# ======================================================================================================================
class Tower(nn.Module):
    def __init__(self, n, d=16):
        super().__init__()
        self.emb, self.proj = nn.Embedding(n, d), nn.Linear(d, d)

    def forward(self, ids):
        return self.proj(self.emb(ids))


class DotScore(nn.Module):
    def forward(self, u, v):
        return (u * v).sum(-1)


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_tower, self.item_tower, self.score = Tower(50), Tower(40), DotScore()
        with torch.no_grad():  # rows that grew together over a long run: a power user (7) and the hit (item 0)
            self.user_tower.emb.weight[7] = 600 * F.normalize(self.user_tower.emb.weight[7], dim=0)
            u = self.user_tower(torch.tensor(7))
            v = 300 * u / u.norm()  # aligned with the user: the model learned they go together
            self.item_tower.emb.weight[0] = torch.linalg.solve(self.item_tower.proj.weight, v - self.item_tower.proj.bias)

    def forward(self, users, items):
        return self.score(self.user_tower(users), self.item_tower(items))


def _plays(i, j=0):
    g = torch.Generator().manual_seed(i)
    users, items = torch.randint(8, 50, (64,), generator=g), torch.randint(1, 40, (64,), generator=g)
    if i == 6:  # (other shards: users 8.., items 1..)
        users[3], items[3] = 7, 0  # the power user plays the hit
    return users, items, torch.log1p(torch.randint(1, 50, (64,), generator=g).float())


def test_two_tower_dot_product_of_two_grown_rows_overflows_in_the_scorer_when_they_first_meet():
    torch.manual_seed(0)
    m = TwoTower()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        u, v = m.user_tower(torch.tensor([7])), m.item_tower(torch.tensor([0]))
        assert u.abs().max() < 1000 and v.abs().max() < 1000 and torch.isinf(m.score(u, v)).all()  # real
    loss = lambda o, users, items, plays: (o.float() - plays).pow(2).mean()
    r = train_loop(m, _plays, loss, 8, call=lambda users, items, plays: m(users, items))
    assert r["first"] == ("score", 6) and r["bad_loss"] == [6], r  # real
    rep = r["w"].report()
    at(rep, ("overflow",), "score", step=6, phase="forward")
    no_error_at(rep, ("user_tower.proj", "item_tower.proj", "item_tower", "user_tower", ""))


# ======================================================================================================================
# 6. LARS without its zero-gradient guard: a multi-task head whose loss weight is 0 on a batch without its labels gets
#    an all-zero gradient; trust = |w| / |g| = inf, inf * 0 = NaN weights; the next forward is NaN
# ======================================================================================================================
class LARS(torch.optim.Optimizer):
    """The 20-line LARS from a SimCLR reproduction: trust ratio eta * |w| / |g| (no guard for |g| == 0)."""

    def __init__(self, params, lr=0.1, eta=1e-3):
        super().__init__(params, dict(lr=lr, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                trust = group["eta"] * p.norm() / p.grad.norm()
                p.sub_(group["lr"] * trust * p.grad)


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head_a, self.head_b = nn.Linear(32, 4), nn.Linear(32, 1)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.head_a(h), self.head_b(h)


def test_lars_without_a_zero_gradient_guard_writes_nan_weights_into_the_unlabelled_head():
    torch.manual_seed(0)
    m = MultiTask()
    opt = LARS(m.parameters(), lr=0.5)

    def batch(i, j=0):  # from step 4 the sampler draws only task-A data: no regression labels, weight 0
        return randn(32, 16, seed=i), torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(i)), \
            randn(32, 1, seed=100 + i), torch.tensor(0.0 if i >= 4 else 1.0)
    loss = lambda o, x, ya, yb, wb: F.cross_entropy(o[0].float(), ya) + wb * (o[1].float() - yb).pow(2).mean()
    r = train_loop(m, batch, loss, 7, opt=opt, clip=None, call=lambda x, ya, yb, wb: m(x))
    assert r["first"] == ("head_b", 5) and r["bad_weights"] == "head_b" and r["bad_loss"][:1] == [5], r  # real
    assert not torch.isfinite(m.head_b.weight).all() and torch.isfinite(m.head_a.weight).all()
    rep = r["w"].report()
    at(rep, ("nan_origin",), "head_b", step=(4, 5), phase="optimizer")
    assert not [f for f in rep.findings if f.phase == "forward" and f.severity == "error"], lines(rep)


# ======================================================================================================================
# 7. gradient accumulation over 4 micro-batches: the third micro-batch of step 5 carries a glitched sample
# ======================================================================================================================
class SwiGLU(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), \
            nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ResMLP(nn.Module):
    def __init__(self, fin=16, d=32, depth=4):
        super().__init__()
        self.embed = nn.Linear(fin, d)
        self.blocks = nn.ModuleList(SwiGLU(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def test_gradient_accumulation_overflow_on_micro_batch_3_of_4_is_at_its_optimizer_step():
    torch.manual_seed(0)
    m = ResMLP()

    def batch(i, j):
        x = randn(8, 16, seed=10 * i + j)
        if (i, j) == (5, 2):
            x[3] *= 300.0  # a glitched sensor reading
        return (x,)
    r = train_loop(m, batch, lambda o, *a: o.float().pow(2).mean(), 7, accum=4)
    assert r["first"][1] == 5 and r["bad_loss"] == [5] and r["skipped"] == [5], r  # real
    name = r["first"][0]
    assert name.startswith("blocks."), r
    rep = r["w"].report()
    at(rep, ("overflow",), name, step=5, phase="forward")
    no_error_at(rep, ("embed", "head", ""))


# ======================================================================================================================
# 8. a loop that drops non-finite batches itself (`if not torch.isfinite(loss): continue`): no backward, no scaler call
# ======================================================================================================================
def test_loop_that_drops_non_finite_batches_itself_still_names_the_producer_at_its_step():
    torch.manual_seed(0)
    m = ViT()
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(1))

    def batch(i, j=0):  # iteration 5 reads one shard's images as raw uint16 (0..65535), not scaled to [0, 1]
        img = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(i))
        return ((img * 65535).round() if i == 5 else img,)
    r = train_loop(m, batch, lambda o, *a: F.cross_entropy(o.float(), y), 8, skip_bad=True)
    assert r["dropped"] == [5] and r["skipped"] == [] and r["first"] == ("patch_embed", 5), r  # real
    rep = r["w"].report()
    at(rep, ("overflow",), "patch_embed", step=5, phase="forward")
    no_error_at(rep, ("blocks.0.norm1", "blocks.0.attn", "blocks.0", "norm", "head", ""))


# ======================================================================================================================
# 9. a log-mel front end, log(mel + 1e-10) in fp16 (1e-10 is 0 there): a digitally silent clip at step 3
# ======================================================================================================================
class LogMel(nn.Module):
    def __init__(self, n_fft=64, n_mels=16):
        super().__init__()
        self.n_fft = n_fft
        t = torch.arange(n_fft).float()
        f = torch.arange(n_fft // 2 + 1).float()
        ang = 2 * math.pi * t[:, None] * f[None] / n_fft
        win = torch.hann_window(n_fft)[:, None]
        self.register_buffer("cos", win * torch.cos(ang))
        self.register_buffer("sin", win * torch.sin(ang))
        self.register_buffer("fb", torch.rand(n_fft // 2 + 1, n_mels, generator=torch.Generator().manual_seed(0)))

    def forward(self, wav):
        frames = wav.unfold(-1, self.n_fft, self.n_fft // 2)
        power = (frames @ self.cos).pow(2) + (frames @ self.sin).pow(2)
        return torch.log(power @ self.fb + 1e-10)


class KWS(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = LogMel()
        self.encoder = nn.Sequential(nn.Conv1d(16, 32, 3, padding=1), nn.GELU(), nn.Conv1d(32, 32, 3, padding=1),
                                     nn.GELU())
        self.classifier = nn.Linear(32, 10)

    def forward(self, wav):
        return self.classifier(self.encoder(self.frontend(wav).transpose(1, 2)).mean(-1))


def test_log_mel_epsilon_1e_10_vanishes_in_fp16_on_a_silent_clip():
    torch.manual_seed(0)
    m = KWS()
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))

    def batch(i, j=0):
        wav = randn(4, 1024, seed=i) * 0.05
        if i == 3:
            wav[1, :] = 0.0  # a digitally silent clip (a muted microphone)
        return (wav,)
    r = train_loop(m, batch, lambda o, *a: F.cross_entropy(o.float(), y), 6)
    assert r["first"] == ("frontend", 3) and r["bad_loss"] == [3], r  # real
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isneginf(m.frontend(batch(3)[0])).any()
    rep = r["w"].report()
    at(rep, ("eps_underflow", "overflow"), "frontend", step=3, phase="forward")
    no_error_at(rep, ("encoder.0", "encoder", "classifier", ""))


# ======================================================================================================================
# 10. a detector's GIoU loss in fp16 pixel coordinates (targets .type_as(pred)): a large object's area > 65504
# ======================================================================================================================
class GIoULoss(nn.Module):
    def forward(self, pred, gt):
        gt = gt.type_as(pred)
        area_p = (pred[:, 2] - pred[:, 0]) * (pred[:, 3] - pred[:, 1])
        area_g = (gt[:, 2] - gt[:, 0]) * (gt[:, 3] - gt[:, 1])
        iw = (torch.min(pred[:, 2], gt[:, 2]) - torch.max(pred[:, 0], gt[:, 0])).clamp(min=0)
        ih = (torch.min(pred[:, 3], gt[:, 3]) - torch.max(pred[:, 1], gt[:, 1])).clamp(min=0)
        inter = iw * ih
        union = area_p + area_g - inter
        cw = torch.max(pred[:, 2], gt[:, 2]) - torch.min(pred[:, 0], gt[:, 0])
        ch = torch.max(pred[:, 3], gt[:, 3]) - torch.min(pred[:, 1], gt[:, 1])
        hull = cw * ch
        giou = inter / union - (hull - union) / hull
        return (1 - giou).mean()


class Detector(nn.Module):
    def __init__(self, size=320.0):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.box_head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.criterion = GIoULoss()
        self.size = size

    def forward(self, img, gt):
        cxcywh = torch.sigmoid(self.box_head(self.backbone(img))) * self.size
        cx, cy, w, h = cxcywh.unbind(-1)
        pred = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
        return self.criterion(pred, gt)


def test_giou_loss_in_fp16_pixel_coordinates_overflows_in_the_criterion_on_a_large_object():
    torch.manual_seed(0)
    m = Detector()

    def batch(i, j=0):
        g = torch.Generator().manual_seed(i)
        xy = torch.rand(4, 2, generator=g) * 150
        wh = 20 + torch.rand(4, 2, generator=g) * 80
        if i == 4:
            xy[2], wh[2] = torch.tensor([5.0, 10.0]), torch.tensor([300.0, 290.0])  # a close-up: 87000 px^2
        return torch.rand(4, 3, 32, 32, generator=g), torch.cat([xy, xy + wh], -1)
    r = train_loop(m, batch, lambda o, *a: o.float(), 7)
    assert r["first"] == ("criterion", 4) and r["bad_loss"] == [4], r  # real
    rep = r["w"].report()
    at(rep, ("overflow",), "criterion", step=4, phase="forward")
    no_error_at(rep, ("box_head.2", "box_head", "backbone", ""))


# ======================================================================================================================
# 11. PPO: ratio = exp(logp - old_logp) in fp16 against a stale behaviour policy (an exploratory action of prob 1e-6)
# ======================================================================================================================
class Policy(nn.Module):
    def __init__(self, obs=8, act=6):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, act))

    def forward(self, obs):
        return torch.log_softmax(self.net(obs), -1)


def test_ppo_importance_ratio_against_a_stale_behaviour_policy_overflows_in_the_loss_outside_the_model():
    torch.manual_seed(0)
    m = Policy()

    def batch(i, j=0):
        g = torch.Generator().manual_seed(i)
        obs, act = torch.randn(32, 8, generator=g), torch.randint(0, 6, (32,), generator=g)
        adv = torch.randn(32, generator=g)
        old = torch.full((32,), -1.8).half()  # logged under autocast: fp16
        if i == 6:  # a replayed epsilon-greedy action the behaviour policy took with p ~ 1e-6
            old[5], adv[5] = -13.8, -1.0
        return obs, act, adv, old

    def ppo_loss(logp_all, obs, act, adv, old):
        logp = logp_all.gather(-1, act[:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).float().mean()
    r = train_loop(m, batch, ppo_loss, 8, call=lambda obs, act, adv, old: m(obs))
    assert r["first"] is None and r["bad_loss"] == [6] and r["skipped"] == [6], r  # real: nothing in the model
    rep = r["w"].report()
    at(rep, ("overflow",), None, step=6, phase="forward")
    no_error_at(rep, ("net.4", "net", ""))


# ======================================================================================================================
# 12. WGAN critic without a Lipschitz constraint (no clipping, no gradient penalty): its output grows until fp16 overflows
# ======================================================================================================================
class Critic(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                                 nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)


def test_wgan_critic_without_a_lipschitz_constraint_grows_until_it_overflows():
    torch.manual_seed(0)
    m = Critic()
    gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh())  # a frozen generator snapshot

    def batch(i, j=0):
        real = randn(32, 16, seed=i) + 2.0
        with torch.no_grad():
            fake = gen(randn(32, 4, seed=1000 + i))
        return (torch.cat([real, fake]),)
    loss = lambda o, x: o[32:].float().mean() - o[:32].float().mean()
    r = train_loop(m, batch, loss, 40, lr=0.05, clip=None, init_scale=1.0)
    name, k = r["first"]
    assert name.startswith("net.") and k >= 5 and k in r["bad_loss"], r  # real
    rep = r["w"].report()
    at(rep, ("overflow",), name, step=k, phase="forward")

