"""Tenth set of failure-pattern variants, watched through the public API only (watch -> an ordinary loop ->
w.report()) at ampdoctor's default settings, in the deeper architectures and training styles practitioners run,
with the failure starting mid-run (never at step 0) and neighbours on both sides of the producer: a wav2vec2-style
conv feature extractor whose first conv overflows on one loud (raw int16-range) batch, with the GroupNorm after it
turning the inf into NaN; a ViT whose one block's MLP sits in a param group with a too-high learning rate; an IRNN
language model (ReLU RNN, recurrent matrix drifted past spectral radius 1) when the sequence-length curriculum jumps;
a GIN whose sum aggregation over a celebrity node overflows in the second layer; a two-tower recommender regressed on
raw play counts; LARS without its zero-gradient guard on a multi-task head that gets an all-zero gradient (the update
writes NaN weights); gradient accumulation whose third of four micro-batches overflows; a loop that drops
non-finite batches itself (no backward, no scaler call); a log-mel front end whose log(mel + 1e-10) meets digital
silence; a detector's GIoU loss computed in fp16 pixel coordinates on a large object; PPO's importance ratio
exp(logp - old_logp) against a stale behaviour policy (outside the model); a WGAN critic without a Lipschitz
constraint; a diffusion U-Net whose lowest-resolution attention overflows once the warmup has raised the lr.

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


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


def at(rep, rules, module, step=None, phase=None):
    f = in_top3(rep, rules, module)
    if step is not None:
        steps = step if isinstance(step, tuple) else (step,)
        assert f.step in steps, (f.one_line(), lines(rep))
    if phase is not None:
        assert f.phase in ((phase,) if isinstance(phase, str) else phase), (f.one_line(), lines(rep))
    return f


def _finite(x):
    if torch.is_tensor(x):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        return all(_finite(t) for t in x)
    if isinstance(x, dict):
        return all(_finite(t) for t in x.values())
    return True


class Producer:
    """Forward hooks on every module: the first (module, step) whose output is non-finite while its inputs (and its
    own parameters) were finite. Hooks fire children first, so the first hit is the innermost producer."""

    def __init__(self, m):
        self.step, self.first, self.bad_weights = 0, None, None
        self.hs = [mod.register_forward_hook(self._hook(n)) for n, mod in m.named_modules()]

    def _hook(self, n):
        def f(mod, inp, out):
            if self.first is None and _finite(inp) and not _finite(out):
                own = all(torch.isfinite(p).all() for p in mod.parameters(recurse=False))
                self.first = (n, self.step)
                if not own:
                    self.bad_weights = n
        return f

    def remove(self):
        for h in self.hs:
            h.remove()


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
    prod = Producer(m)
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
    print(r)
    name, k = r["first"]
    assert name.startswith("blocks.2.mlp.fc") and 3 <= k and k in r["bad_loss"], r  # real, mid-run
    rep = r["w"].report()
    print(lines(rep))
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
    print(r)
    assert r["first"] == ("convs.1", 5) and 5 in r["bad_loss"], r  # real: convs.0's sum is finite, convs.1's is not
    rep = r["w"].report()
    print(lines(rep))
    at(rep, ("overflow",), "convs.1", step=5, phase="forward")
    no_error_at(rep, ("convs.1.mlp.0", "convs.1.mlp", "convs.2", "convs.0", "head", ""))
