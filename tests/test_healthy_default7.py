"""Healthy runs at ampdoctor's defaults (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`; a few with
`headroom=True`, a few with `every=1`, full statistics on every step), seventh set: architecture families the earlier
healthy probes cover little, each in a variant they do not run. Tiny models, 40-150 steps each, fixed seeds, fp16
autocast on the CPU with a real torch.amp.GradScaler("cpu") (unscale_ + clip_grad_norm_ where natural). Each run is
first asserted healthy (every loss finite, the loss falls, the scale stays >= 1 and backs off at most once after the
first 20 steps), then judged: no warning and no error (info is fine).

Scenarios:
 1. an LSTM language model over variable-length packed sequences (pack_padded_sequence, enforce_sorted=False,
    pad_packed_sequence, ignore_index on padding), every=1 (an unpacked LSTM cannot run under CPU fp16 autocast:
    oneDNN has no fp16 LSTM primitive; the packed path runs it in fp32);
 2. a GRU seq2seq (reverse the source) with a packed encoder, full teacher forcing and Luong dot attention masked
    with finfo(dtype).min over the source padding, headroom=True;
 3. GAT: multi-head edge softmax by scatter_reduce("amax") from -inf, exp, index_add_ denominators and messages,
    self loops, on a stochastic block model, every=1;
 4. GraphSAGE (mean aggregation through index_add_ / deg.clamp(min=1)) and GCN (PyG's deg.pow(-0.5) with the inf of
    isolated nodes set to 0) on a graph where 1/8 of the nodes are isolated;
 5. a small diffusion UNet (GroupNorm/SiLU ResBlocks, a skip concat, a stride-2 down/up path, zero-initialised output
    conv) with fp32 sinusoidal timestep embeddings of t in [0, 1000), a linear beta schedule, epsilon- and
    v-prediction losses, headroom=True;
 6. a dense detection head (RetinaNet's prior bias -log(99)): sigmoid focal loss (alpha 0.25, gamma 2) normalised by
    the positives, smooth L1 + GIoU on the positives of valid boxes only, a quarter of the images without objects;
 7. a CTC speech model (Conv1d subsampling, log_softmax in fp32, ctc_loss(zero_infinity=True)) where 2 of 16
    utterances per batch are truncated below their transcript's length (infeasible: inf losses zeroed);
 8. DCN-v2 (three full-rank cross layers x0 * W x + x, a deep tower) over EmbeddingBag(mode="sum") tables of 100003
    rows indexed by hashed raw ids up to 2**40 with per_sample_weights, a click BCE; dense gradients with AdamW and
    headroom=True, and sparse=True gradients with SGD (no clip);
 9. a Glow-style flow: data-initialised ActNorm, an invertible 1x1 mixing with slogdet in fp32, affine couplings with
    tanh-bounded scales, an fp32 NLL with the log-det, every=1;
10. a GShard-style top-2 MoE: fp32 router (autocast off), renormalised top-2 gates, expert capacity 1.25 with
    token dropping, dispatch/combine by index_add_, the load-balancing aux loss (E * sum f_i P_i) and a router
    z-loss, headroom=True;
11. metric learning: L2-normalised embeddings, torch.cdist over the batch, batch-all triplet margin loss averaged
    over the active triplets, every=1;
12. a beta-VAE with cyclical KL annealing (4 cycles), free bits (0.05 nats/dim), logvar clamped, Bernoulli
    likelihood through BCE-with-logits;
13. a CaiT/DeiT-style ViT: conv patch embedding, pre-norm blocks with LayerScale 1e-5 on both branches (the branch
    outputs are ~1e-5, tiny but legitimate), drop path 0.1, mean pooling; at the default sampling and every=1;
14. weight norm and spectral norm through torch.nn.utils.parametrizations on one MLP, headroom=True;
15. quantisation-aware training: activations and weights through torch.fake_quantize_per_tensor_affine (8-bit, an
    EMA abs-max observer buffer, straight-through gradients) inside each Linear's forward;
16. an fp32 head (a LayerNorm + Linear under torch.autocast(enabled=False) on x.float()) after an fp16 backbone,
    cross-entropy with label_smoothing=0.1, every=1;
17. SigLIP: a pairwise sigmoid loss with a learnable log-temperature (init log 10, clamped to [0, log 100] after each
    step) and a learnable bias (init -10).

False alarms found (fixed since: a forward underflow is judged on fp16 outputs only, rules/underflow.py):
 - 13 (both the default sampling and every=1): `underflow` warning, phase forward, module "blocks.0.ls1" (the first
   block's attention-branch LayerScale), op null, step 0: "100% of the nonzero outputs of `blocks.0.ls1` are below
   fp16's normal range (2^-14); they lose precision or vanish." (evidence: absmax 6.26e-6, share 1.0, loss_scale
   65536). The LayerScale output `x * gamma` is fp32 (an fp16 activation times the fp32 parameter promotes), so
   nothing is subnormal in its own dtype; and the values are tiny by design (gamma = 1e-5 at init, CaiT's recipe),
   added to an O(1) residual stream where they are negligible whatever their precision. The ViT trains (loss falls
   from ~1.5 to well under 1, no backoff).
No other scenario raised a warning or an error; the only findings are info (the scaler's first backoffs and the
occasional skipped step: the Glow flow's initial search, the detection head's two skips while boxes are fit).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, randn, one_thread, quiet_watch as quiet  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


@pytest.fixture(autouse=True)
def seeded():
    """Models are built from the same global RNG state whatever ran before."""
    torch.manual_seed(0)

FP16 = torch.float16


# --- helpers ------------------------------------------------------------------------------------------------------

def healthy(losses, scales=(), *, fall=0.9, k=None, first=20, max_late_backoffs=1):
    """Every loss finite; the mean of the last k losses below `fall` x the mean of the first k (default k = a tenth
    of the run); the loss scale stays >= 1 after the first `first` steps and backs off at most `max_late_backoffs`
    times after them."""
    assert losses and all(map(math.isfinite, losses)), losses
    k = k or max(1, len(losses) // 10)
    assert sum(losses[-k:]) / k < fall * sum(losses[:k]) / k, (losses[:k], losses[-k:])
    if scales:
        assert min(scales[first:]) >= 1.0, scales
        late = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a and i + 1 >= first]
        assert len(late) <= max_late_backoffs, (late, scales)


def fit(model, batch, loss_fn, *, steps, opt=None, lr=1e-3, clip=1.0, every=None, headroom=None, after=None):
    """zero_grad -> forward under autocast(fp16) (`loss_fn(model, *batch(i))` -> loss, or (loss, monitored value))
    -> scale(loss).backward -> unscale_ -> clip -> step -> update -> after(i) under no_grad, watched at the defaults
    (plus `every` / `headroom` when given). Returns (watch, monitored losses, scales)."""
    torch.manual_seed(0)
    opt = opt(model) if callable(opt) else torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu")
    kw = {k: v for k, v in (("every", every), ("headroom", headroom)) if v is not None}
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, **kw)
    losses, scales = [], []
    model.train()
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        args = batch(i)
        with torch.autocast("cpu", dtype=FP16):
            out = loss_fn(model, *args)
        loss, mon = out if isinstance(out, tuple) else (out, out)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        sc.step(opt)
        sc.update()
        if after:
            with torch.no_grad():
                after(i)
        losses.append(float(mon.detach()) if torch.is_tensor(mon) else float(mon))
        scales.append(sc.get_scale())
    w.close()
    return w, losses, scales


W4 = torch.randn(16, 4, generator=gen(4242))


def classes(n=64, d=16, noise=0.3, seed=0):
    """Gaussian features, a 4-class target from a fixed linear map of them."""
    def batch(i):
        z = torch.randn(n, d, generator=gen(seed * 100_000 + i))
        y = (z @ W4 + noise * torch.randn(n, 4, generator=gen(seed * 100_000 + 50_000 + i))).argmax(1)
        return z, y
    return batch


def ce(m, x, y):
    return F.cross_entropy(m(x).float(), y)


# --- 1. LSTM LM over packed variable-length sequences ---------------------------------------------------------------

class PackedLSTMLM(nn.Module):
    def __init__(self, V=32, d=32, h=64):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.rnn = nn.LSTM(d, h, num_layers=2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(h, V)

    def forward(self, ids, lens):
        packed = pack_padded_sequence(self.emb(ids), lens, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.out(out)


def var_streams(i, B=16, T=16, V=32):
    """Sequences over tokens 1..V-1 counting by a stride of 1 or 2 from a random start, lengths 6..T, 0-padded."""
    g = gen(i)
    s = torch.randint(0, V - 1, (B, 1), generator=g)
    b = torch.randint(1, 3, (B, 1), generator=g)
    seq = (s + b * torch.arange(T + 1)) % (V - 1) + 1
    lens = torch.randint(6, T + 1, (B,), generator=g)
    seq = seq * (torch.arange(T + 1) < (lens + 1)[:, None])
    return seq[:, :-1], seq[:, 1:], lens


def test_lstm_lm_packed_variable_length_every_step():
    def loss(m, x, y, lens):
        return F.cross_entropy(m(x, lens).float().flatten(0, 1), y.flatten(), ignore_index=0)
    w, losses, scales = fit(PackedLSTMLM(), var_streams, loss, steps=80, lr=3e-3, every=1)
    healthy(losses, scales, fall=0.8)
    quiet(w)


# --- 2. GRU seq2seq, packed encoder, teacher forcing, masked dot attention ------------------------------------------

class Seq2Seq(nn.Module):
    BOS = 1

    def __init__(self, V=16, d=32, h=64):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.enc = nn.GRU(d, h, batch_first=True)
        self.dec = nn.GRU(d, h, batch_first=True)
        self.out = nn.Linear(2 * h, V)

    def forward(self, src, lens, tgt_in):
        packed = pack_padded_sequence(self.emb(src), lens, batch_first=True, enforce_sorted=False)
        enc, hN = self.enc(packed)
        enc, _ = pad_packed_sequence(enc, batch_first=True, total_length=src.shape[1])
        dec, _ = self.dec(self.emb(tgt_in), hN)                        # teacher forcing: the gold previous tokens
        scores = torch.bmm(dec, enc.transpose(1, 2))                   # (B, Tt, Ts), fp16 under autocast
        pad = (torch.arange(src.shape[1])[None] >= lens[:, None])[:, None]
        scores = scores.masked_fill(pad, torch.finfo(scores.dtype).min)
        ctx = torch.bmm(scores.softmax(-1), enc.to(scores.dtype))
        return self.out(torch.cat([dec.to(ctx.dtype), ctx], -1))


def reversal(i, B=16, T=10, V=16):
    """Source: random tokens 3..V-1 of length 4..T, 0-padded; target: the source reversed, then EOS (2)."""
    g = gen(i)
    lens = torch.randint(4, T + 1, (B,), generator=g)
    src = torch.randint(3, V, (B, T), generator=g) * (torch.arange(T)[None] < lens[:, None])
    tgt = torch.zeros(B, T + 1, dtype=torch.long)
    for b in range(B):
        n = int(lens[b])
        tgt[b, :n] = src[b, :n].flip(0)
        tgt[b, n] = 2
    tgt_in = torch.cat([torch.full((B, 1), Seq2Seq.BOS), tgt[:, :-1]], 1)
    return src, lens, tgt_in, tgt


def test_gru_seq2seq_packed_encoder_teacher_forcing_masked_attention():
    def loss(m, src, lens, tgt_in, tgt):
        return F.cross_entropy(m(src, lens, tgt_in).float().flatten(0, 1), tgt.flatten(), ignore_index=0)
    w, losses, scales = fit(Seq2Seq(), reversal, loss, steps=80, lr=3e-3, headroom=True)
    healthy(losses, scales, fall=0.8)
    quiet(w)


# --- 3/4. graph nets ------------------------------------------------------------------------------------------------

def sbm(N=96, K=4, p_in=0.15, p_out=0.01, isolated=0.0, seed=7):
    """A stochastic block model (undirected edges in both directions), noisy community features, the community as
    label; a share `isolated` of the nodes get no edges."""
    g = gen(seed)
    y = torch.arange(N) % K
    same = y[:, None] == y[None]
    p = torch.where(same, torch.tensor(p_in), torch.tensor(p_out))
    a = torch.rand(N, N, generator=g) < p
    a = torch.triu(a, 1)
    a = a | a.T
    if isolated:
        iso = torch.randperm(N, generator=g)[: int(N * isolated)]
        a[iso] = False
        a[:, iso] = False
    src, dst = a.nonzero(as_tuple=True)
    x = 0.6 * F.one_hot(y, 16).float() + torch.randn(N, 16, generator=g)
    return x, torch.stack([src, dst]), y


class GATLayer(nn.Module):
    def __init__(self, d_in, d_out, heads=4):
        super().__init__()
        self.H, self.F = heads, d_out
        self.W = nn.Linear(d_in, heads * d_out, bias=False)
        self.a_src = nn.Parameter(torch.randn(heads, d_out) * 0.1)
        self.a_dst = nn.Parameter(torch.randn(heads, d_out) * 0.1)

    def forward(self, x, edge_index):
        N = x.shape[0]
        loops = torch.arange(N)
        src = torch.cat([edge_index[0], loops])
        dst = torch.cat([edge_index[1], loops])
        h = self.W(x).view(N, self.H, self.F)
        e = F.leaky_relu((h * self.a_src).sum(-1)[src] + (h * self.a_dst).sum(-1)[dst], 0.2).float()   # (E, H)
        emax = torch.full((N, self.H), float("-inf")).scatter_reduce(
            0, dst[:, None].expand(-1, self.H), e, "amax", include_self=True)
        ex = (e - emax[dst]).exp()
        den = torch.zeros(N, self.H).index_add_(0, dst, ex)
        alpha = (ex / den[dst]).to(h.dtype)
        msg = alpha[..., None] * h[src]
        return torch.zeros(N, self.H, self.F, dtype=msg.dtype).index_add_(0, dst, msg).flatten(1)


class GAT(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = GATLayer(16, 8, heads=4)
        self.l2 = GATLayer(32, 4, heads=1)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, ei):
        return self.l2(self.drop(F.elu(self.l1(self.drop(x), ei))), ei)


def test_gat_edge_softmax_scatter_reduce_every_step():
    x, ei, y = sbm()
    w, losses, scales = fit(GAT(), lambda i: (x, ei, y), lambda m, x, ei, y: F.cross_entropy(m(x, ei).float(), y),
                            steps=80, lr=5e-3, every=1)
    healthy(losses, scales, fall=0.8)
    quiet(w)


class SAGELayer(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.self_lin = nn.Linear(d_in, d_out)
        self.nbr_lin = nn.Linear(d_in, d_out, bias=False)

    def forward(self, h, ei):
        src, dst = ei
        deg = torch.zeros(h.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        agg = torch.zeros_like(h).index_add_(0, dst, h[src]) / deg.clamp(min=1)[:, None].to(h.dtype)
        return self.self_lin(h) + self.nbr_lin(agg)


class GCNLayer(nn.Module):
    """PyG's gcn_norm without self loops: deg^-1/2 with the inf of isolated nodes set to 0."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, h, ei):
        src, dst = ei
        deg = torch.zeros(h.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        dinv = deg.pow(-0.5)
        dinv.masked_fill_(dinv == float("inf"), 0)
        z = self.lin(h)
        norm = (dinv[src] * dinv[dst]).to(z.dtype)[:, None]
        return z + torch.zeros_like(z).index_add_(0, dst, norm * z[src])


class GraphNet(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.l1, self.l2 = layer(16, 32), layer(32, 4)

    def forward(self, x, ei):
        return self.l2(F.relu(self.l1(x, ei)), ei)


@pytest.mark.parametrize("layer", [SAGELayer, GCNLayer], ids=["sage_mean", "gcn_sym_norm"])
def test_graphsage_gcn_index_add_isolated_nodes(layer):
    x, ei, y = sbm(isolated=0.125)
    w, losses, scales = fit(GraphNet(layer), lambda i: (x, ei, y),
                            lambda m, x, ei, y: F.cross_entropy(m(x, ei).float(), y), steps=80, lr=5e-3)
    healthy(losses, scales, fall=0.8)
    quiet(w)


# --- 5. diffusion UNet, t in [0, 1000), epsilon and v prediction ----------------------------------------------------

def sinusoidal(t, dim):
    """fp32 sinusoidal embedding of integer timesteps (autocast off)."""
    with torch.autocast("cpu", enabled=False):
        half = dim // 2
        f = torch.exp(-math.log(10_000) * torch.arange(half, dtype=torch.float32) / half)
        a = t.float()[:, None] * f[None]
        return torch.cat([a.sin(), a.cos()], -1)


class ResBlock(nn.Module):
    def __init__(self, c_in, c_out, d_t=32):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.t = nn.Linear(d_t, c_out)
        self.n2, self.c2 = nn.GroupNorm(4, c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x))) + self.t(temb)[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class TinyUNet(nn.Module):
    def __init__(self, c=8, d_t=32):
        super().__init__()
        self.d_t = d_t
        self.temb = nn.Sequential(nn.Linear(d_t, d_t), nn.SiLU(), nn.Linear(d_t, d_t))
        self.inc = nn.Conv2d(1, c, 3, padding=1)
        self.r1 = ResBlock(c, c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = ResBlock(2 * c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.r2 = ResBlock(2 * c, c)
        self.outc = nn.Conv2d(c, 1, 3, padding=1)
        nn.init.zeros_(self.outc.weight)
        nn.init.zeros_(self.outc.bias)

    def forward(self, x, t):
        te = self.temb(sinusoidal(t, self.d_t))
        h1 = self.r1(self.inc(x), te)
        h = self.mid(self.down(h1), te)
        return self.outc(self.r2(torch.cat([self.up(h), h1], 1), te))


BETAS = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
ABAR = torch.cumprod(1 - BETAS, 0).float()


def bars(i, B=16, S=8):
    """Images of one bright horizontal or vertical bar in [-1, 1], plus a noise draw and timesteps in [0, 1000)."""
    g = gen(i)
    x = -torch.ones(B, 1, S, S)
    pos = torch.randint(0, S, (B,), generator=g)
    vert = torch.rand(B, generator=g) < 0.5
    for b in range(B):
        if vert[b]:
            x[b, 0, :, pos[b]] = 1
        else:
            x[b, 0, pos[b], :] = 1
    return x, torch.randn(B, 1, S, S, generator=g), torch.randint(0, 1000, (B,), generator=g)


@pytest.mark.parametrize("pred", ["eps", "v"])
def test_diffusion_unet_sinusoidal_t1000(pred):
    def loss(m, x0, eps, t):
        a = ABAR[t].sqrt()[:, None, None, None]
        s = (1 - ABAR[t]).sqrt()[:, None, None, None]
        target = eps if pred == "eps" else a * eps - s * x0
        return F.mse_loss(m(a * x0 + s * eps, t).float(), target)
    w, losses, scales = fit(TinyUNet(), bars, loss, steps=60, lr=2e-3, headroom=True)
    healthy(losses, scales, fall=0.9)
    quiet(w)


# --- 6. dense detection head: focal loss + smooth L1 + GIoU on valid boxes -----------------------------------------

def giou(a, b):
    """Generalised IoU of matched xyxy boxes (fp32)."""
    lt, rb = torch.max(a[:, :2], b[:, :2]), torch.min(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).clamp(min=0).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).clamp(min=0).prod(-1)
    union = area_a + area_b - inter
    iou = inter / union.clamp(min=1e-6)
    hull = (torch.max(a[:, 2:], b[:, 2:]) - torch.min(a[:, :2], b[:, :2])).clamp(min=0).prod(-1)
    return iou - (hull - union) / hull.clamp(min=1e-6)


class DenseHead(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, c, 3, stride=2, padding=1), nn.GELU(),
                                      nn.Conv2d(c, c, 3, padding=1), nn.GELU())
        self.cls = nn.Conv2d(c, 1, 1)
        self.reg = nn.Conv2d(c, 4, 1)
        nn.init.constant_(self.cls.bias, -math.log(99))            # RetinaNet's prior 0.01

    def forward(self, x):
        f = self.backbone(x)
        return self.cls(f), self.reg(f)


def box_images(i, B=16, S=16):
    g = gen(i)
    x = 0.1 * torch.randn(B, 1, S, S, generator=g)
    wh = torch.randint(4, 9, (B, 2), generator=g)
    x0 = (torch.rand(B, generator=g) * (S - wh[:, 0])).long()
    y0 = (torch.rand(B, generator=g) * (S - wh[:, 1])).long()
    valid = torch.rand(B, generator=g) >= 0.25
    for b in range(B):
        if valid[b]:
            x[b, 0, y0[b]:y0[b] + wh[b, 1], x0[b]:x0[b] + wh[b, 0]] += 1
    boxes = torch.stack([x0, y0, x0 + wh[:, 0], y0 + wh[:, 1]], 1).float()
    return x, boxes, valid


def detection_loss(m, x, boxes, valid, alpha=0.25, gamma=2.0):
    cls, reg = m(x)
    cls, reg = cls.float()[:, 0], reg.float()                      # (B, G, G), (B, 4, G, G)
    G = cls.shape[-1]
    c = (torch.arange(G, dtype=torch.float32) + 0.5) * (x.shape[-1] / G)
    cx, cy = c[None, None, :], c[None, :, None]
    bx = boxes[:, :, None, None]
    inside = (cx > bx[:, 0]) & (cx < bx[:, 2]) & (cy > bx[:, 1]) & (cy < bx[:, 3])
    pos = inside & valid[:, None, None]
    target = pos.float()
    p = cls.sigmoid()
    bce = F.binary_cross_entropy_with_logits(cls, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    a_t = alpha * target + (1 - alpha) * (1 - target)
    n_pos = pos.sum().clamp(min=1)
    focal = (a_t * (1 - p_t) ** gamma * bce).sum() / n_pos
    d = F.softplus(reg) * 4                                         # l, t, r, b distances in pixels
    cxx, cyy = cx.expand_as(cls), cy.expand_as(cls)
    pred = torch.stack([cxx - d[:, 0], cyy - d[:, 1], cxx + d[:, 2], cyy + d[:, 3]], -1)[pos]
    gt = bx[:, :, 0, 0][:, None, None, :].expand(-1, G, G, -1)[pos]
    reg_loss = F.smooth_l1_loss(pred, gt, beta=1.0) + (1 - giou(pred, gt)).mean() if pos.any() else reg.sum() * 0
    return focal + reg_loss


def test_dense_detection_focal_smoothl1_giou_valid_boxes():
    w, losses, scales = fit(DenseHead(), box_images, detection_loss, steps=60, lr=3e-3)
    # two backoffs while the boxes are being fit (65536 -> 16384; ampdoctor calls them info), then steady
    healthy(losses, scales, fall=0.8, max_late_backoffs=2)
    assert scales[-1] >= 2**14, scales
    quiet(w)


# --- 7. CTC with zero_infinity and infeasible utterances -------------------------------------------------------------

SYM = randn(8, 16, seed=31)


def utterances(i, B=16, T=48, n_infeasible=2):
    """Label sequences of 2-5 symbols (1..7), each held 3-5 frames, silence (row 0) around them, noise; the first
    `n_infeasible` utterances are truncated to 2 frames (1 after subsampling), fewer than their labels."""
    g = gen(i)
    feats = torch.zeros(B, T, 16)
    targets, tlens, ilens = [], [], []
    for b in range(B):
        n = int(torch.randint(2, 6, (1,), generator=g))
        lab = torch.randint(1, 8, (n,), generator=g)
        t = int(torch.randint(0, 4, (1,), generator=g))
        for s in lab.tolist():
            k = int(torch.randint(3, 6, (1,), generator=g))
            feats[b, t:t + k] = SYM[s]
            t += k
        targets.append(lab)
        tlens.append(n)
        ilens.append(2 if b < n_infeasible else min(T, t + 2))
    feats = feats + 0.3 * torch.randn(B, T, 16, generator=g)
    ilens = torch.tensor(ilens)
    return feats, torch.cat(targets), ilens, torch.tensor(tlens)


class CTCNet(nn.Module):
    def __init__(self, d=16, h=48, C=8):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv1d(d, h, 3, stride=2, padding=1), nn.GELU(),
                                 nn.Conv1d(h, h, 3, padding=1), nn.GELU())
        self.out = nn.Linear(h, C)

    def forward(self, x):
        return self.out(self.sub(x.transpose(1, 2)).transpose(1, 2))


def ctc(m, feats, targets, ilens, tlens):
    logp = F.log_softmax(m(feats).float(), -1).transpose(0, 1)     # (T', B, C) fp32
    olens = (ilens + 1) // 2
    return F.ctc_loss(logp, targets, olens, tlens, blank=0, reduction="mean", zero_infinity=True)


def test_ctc_zero_infinity_with_infeasible_utterances():
    feats, targets, ilens, tlens = utterances(0)
    assert ((ilens + 1) // 2 < tlens).sum() == 2                  # two infeasible utterances per batch, by design
    w, losses, scales = fit(CTCNet(), utterances, ctc, steps=80, lr=3e-3)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 8. DCN-v2 over EmbeddingBag(mode="sum") with hashed large ids ---------------------------------------------------

ROWS = 100_003
POOL = torch.randint(2**30, 2**40, (4, 400), generator=gen(55))   # raw ids per field, up to 2**40
SCORE = torch.randn(4, 400, generator=gen(56))


class DCNv2(nn.Module):
    def __init__(self, fields=4, d=8, n_dense=4, sparse=False):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS, d, mode="sum", sparse=sparse) for _ in range(fields))
        self.dense = nn.Linear(n_dense, d)
        D = d * (fields + 1)
        self.cross = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.deep = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.out = nn.Linear(D + 32, 1)

    def forward(self, ids, offsets, weights, dense):
        x0 = torch.cat([bag(i, o, per_sample_weights=wt) for bag, i, o, wt in zip(self.bags, ids, offsets, weights)]
                       + [self.dense(dense)], -1)
        x = x0
        for lin in self.cross:
            x = x0 * lin(x) + x
        return self.out(torch.cat([x, self.deep(x0)], -1)).squeeze(-1)


def clicks(i, B=128, fields=4):
    """Multi-hot fields (1-4 ids each, Zipf-ish over a pool of 400 raw ids per field), hashed mod ROWS; weights in
    (0.5, 1.5); the click is a Bernoulli draw from a hidden per-id score."""
    g = gen(i)
    ids, offsets, weights, logit = [], [], [], torch.zeros(B)
    for f in range(fields):
        n = torch.randint(1, 5, (B,), generator=g)
        k = (torch.rand(int(n.sum()), generator=g) ** 2 * 400).long()
        wt = 0.5 + torch.rand(k.shape[0], generator=g)
        seg = torch.repeat_interleave(torch.arange(B), n)
        logit.index_add_(0, seg, SCORE[f, k] * wt)
        ids.append(POOL[f, k] % ROWS)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)[:-1]]))
        weights.append(wt)
    dense = torch.randn(B, 4, generator=g)
    y = (torch.rand(B, generator=g) < torch.sigmoid(logit + dense[:, 0])).float()
    return ids, offsets, weights, dense, y


def bce_click(m, ids, offsets, weights, dense, y):
    return F.binary_cross_entropy_with_logits(m(ids, offsets, weights, dense).float(), y)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_adamw_headroom", "sparse_sgd"])
def test_dcn_v2_embeddingbag_sum_hashed_large_ids(sparse):
    if sparse:
        w, losses, scales = fit(DCNv2(sparse=True), clicks, bce_click, steps=100, clip=None,
                                opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    else:
        w, losses, scales = fit(DCNv2(), clicks, bce_click, steps=100, lr=1e-2, headroom=True)
    healthy(losses, scales, fall=0.95)
    quiet(w)


# --- 9. Glow-style flow -------------------------------------------------------------------------------------------

class ActNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(d))
        self.logs = nn.Parameter(torch.zeros(d))
        self.register_buffer("inited", torch.tensor(False))

    def forward(self, x):
        if not self.inited:
            with torch.no_grad():
                self.loc.copy_(-x.float().mean(0))
                self.logs.copy_(-x.float().std(0).add(1e-6).log())
                self.inited.fill_(True)
        return (x + self.loc) * self.logs.exp(), self.logs.sum().expand(x.shape[0])


class InvMix(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.W = nn.Parameter(torch.linalg.qr(randn(d, d, seed=d))[0])

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            logdet = torch.slogdet(self.W)[1]
        return F.linear(x, self.W), logdet.expand(x.shape[0])


class Coupling(nn.Module):
    def __init__(self, d, h=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d // 2, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)
        self.scale = nn.Parameter(torch.ones(d // 2))

    def forward(self, x):
        x1, x2 = x.chunk(2, -1)
        s, t = self.net(x1).float().chunk(2, -1)
        s = self.scale * torch.tanh(s)                               # bounded log-scales
        return torch.cat([x1.float(), x2.float() * s.exp() + t], -1), s.sum(-1)


class Glow(nn.Module):
    def __init__(self, d=4, K=4):
        super().__init__()
        self.steps = nn.ModuleList(m for _ in range(K) for m in (ActNorm(d), InvMix(d), Coupling(d)))

    def forward(self, x):
        logdet = torch.zeros(x.shape[0])
        for m in self.steps:
            x, ld = m(x)
            logdet = logdet + ld.float()
        return x.float(), logdet


MIX = randn(4, 4, seed=91)


def mixture(i, B=128):
    """A 4-d mixture of 4 gaussians, linearly mixed and offset."""
    g = gen(i)
    c = torch.randint(0, 4, (B,), generator=g)
    z = 3 * F.one_hot(c, 4).float() + 0.4 * torch.randn(B, 4, generator=g)
    return (z @ MIX + 2,)


def flow_nll(m, x):
    z, logdet = m(x)
    logp = -0.5 * (z ** 2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
    return -(logp + logdet).mean()


def test_glow_actnorm_invertible_mix_tanh_couplings_every_step():
    w, losses, scales = fit(Glow(), mixture, flow_nll, steps=120, lr=1e-3, every=1)
    assert all(map(math.isfinite, losses))
    # NLL can be negative: judge the drop, not the ratio
    k = 12
    assert sum(losses[-k:]) / k < sum(losses[:k]) / k - 0.5, (losses[:k], losses[-k:])
    healthy([l + 100 for l in losses], scales, fall=1.0)
    quiet(w)


# --- 10. top-2 MoE with capacity, aux loss, z-loss ------------------------------------------------------------------

class Top2MoE(nn.Module):
    def __init__(self, d=32, E=4, h=64, capacity=1.25):
        super().__init__()
        self.E, self.capacity = E, capacity
        self.router = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for _ in range(E))
        self.aux = torch.zeros(())

    def forward(self, x):
        N = x.shape[0]
        with torch.autocast("cpu", enabled=False):
            logits = self.router(x.float())
            probs = logits.softmax(-1)
            gate, idx = probs.topk(2, -1)
            gate = gate / gate.sum(-1, keepdim=True)
            f = F.one_hot(idx[:, 0], self.E).float().mean(0)
            self.aux = self.E * (f * probs.mean(0)).sum() + 1e-3 * torch.logsumexp(logits, -1).pow(2).mean()
        cap = int(self.capacity * 2 * N / self.E)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            tok, slot = tok[:cap], slot[:cap]                        # tokens past the capacity are dropped
            if tok.numel():
                y = self.experts[e](x[tok]) * gate[tok, slot][:, None].to(x.dtype)
                out = out.index_add(0, tok, y.to(out.dtype))
        return x + out


class MoENet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.moe = Top2MoE(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.norm(self.moe(self.inp(x))))


def test_top2_moe_capacity_aux_and_z_loss_headroom():
    def loss(m, x, y):
        main = F.cross_entropy(m(x).float(), y)
        return main + 0.01 * m.moe.aux, main
    w, losses, scales = fit(MoENet(), classes(n=128), loss, steps=100, lr=3e-3, headroom=True)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 11. metric learning: cdist, batch-all triplet -------------------------------------------------------------------

CENT8 = randn(8, 16, seed=77) * 1.5


def pk_batch(i, P=8, K=8):
    g = gen(i)
    y = torch.arange(P).repeat_interleave(K)
    return CENT8[y] + torch.randn(P * K, 16, generator=g), y


def batch_all_triplet(m, x, y, margin=0.3):
    e = F.normalize(m(x).float(), dim=-1)
    d = torch.cdist(e, e)
    same = y[:, None] == y[None]
    eye = torch.eye(len(y), dtype=torch.bool)
    valid = (same & ~eye)[:, :, None] & (~same)[:, None, :]          # (a, p, n)
    t = F.relu(d[:, :, None] - d[:, None, :] + margin) * valid
    active = (t > 1e-16).sum().clamp(min=1)
    return t.sum() / active, t.sum() / valid.sum()


def test_metric_learning_cdist_batch_all_triplet_every_step():
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
    w, losses, scales = fit(net, pk_batch, batch_all_triplet, steps=60, lr=3e-3, every=1)
    healthy(losses, scales, fall=0.6)
    quiet(w)


# --- 12. beta-VAE, cyclical annealing, free bits -------------------------------------------------------------------

PROTO = (randn(4, 32, seed=13) > 0).float()


def binary_patterns(i, B=64):
    g = gen(i)
    c = torch.randint(0, 4, (B,), generator=g)
    flip = torch.rand(B, 32, generator=g) < 0.05
    return ((PROTO[c] + flip.float()) % 2, i)


class VAE(nn.Module):
    def __init__(self, d=32, h=64, z=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, 2 * z))
        self.dec = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x):
        mu, logvar = self.enc(x).float().chunk(2, -1)
        logvar = logvar.clamp(-8, 8)
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
        return self.dec(z), mu, logvar


def vae_loss(m, x, i, cycle=30, free=0.05):
    logits, mu, logvar = m(x)
    rec = F.binary_cross_entropy_with_logits(logits.float(), x, reduction="sum") / x.shape[0]
    kl = (-0.5 * (1 + logvar - mu ** 2 - logvar.exp())).mean(0)    # per latent dim
    beta = min(1.0, (i % cycle) / (cycle / 2))
    return rec + beta * kl.clamp(min=free).sum(), rec + kl.sum()    # monitored: the negative ELBO


def test_beta_vae_cyclical_annealing_free_bits():
    w, losses, scales = fit(VAE(), binary_patterns, vae_loss, steps=120, lr=3e-3)
    healthy(losses, scales, fall=0.8)
    quiet(w)


# --- 13. ViT with LayerScale 1e-5 and drop path ---------------------------------------------------------------------

class LayerScale(nn.Module):
    def __init__(self, d, init=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init * torch.ones(d))

    def forward(self, x):
        return x * self.gamma


class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.ndim - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class ViTBlock(nn.Module):
    def __init__(self, d=32, heads=2, dp=0.1):
        super().__init__()
        self.n1, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, heads, batch_first=True)
        self.n2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ls1, self.ls2 = LayerScale(d), LayerScale(d)
        self.dp = DropPath(dp)

    def forward(self, x):
        h = self.n1(x)
        x = x + self.dp(self.ls1(self.attn(h, h, h, need_weights=False)[0]))
        return x + self.dp(self.ls2(self.mlp(self.n2(x))))


class ViT(nn.Module):
    def __init__(self, d=32, depth=2, patch=4, S=16, K=4):
        super().__init__()
        self.patch = nn.Conv2d(1, d, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, (S // patch) ** 2, d))
        self.blocks = nn.ModuleList(ViTBlock(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, K)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x).mean(1))


TMPL = F.interpolate(randn(4, 1, 4, 4, seed=123), size=(16, 16), mode="bilinear", align_corners=False)


def images(i, B=16):
    g = gen(i)
    y = torch.randint(0, 4, (B,), generator=g)
    return TMPL[y] + 0.5 * torch.randn(B, 1, 16, 16, generator=g), y


@pytest.mark.parametrize("every", [None, 1], ids=["default", "every1"])
def test_vit_layerscale_1e5_drop_path(every):
    w, losses, scales = fit(ViT(), images, ce, steps=50, lr=2e-3, every=every)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 14. weight norm + spectral norm parametrizations ---------------------------------------------------------------

def test_weight_norm_and_spectral_norm_parametrizations_headroom():
    wn, sn = nn.utils.parametrizations.weight_norm, nn.utils.parametrizations.spectral_norm
    net = nn.Sequential(wn(nn.Linear(16, 64)), nn.GELU(), sn(nn.Linear(64, 64)), nn.GELU(), wn(nn.Linear(64, 4)))
    w, losses, scales = fit(net, classes(), ce, steps=80, lr=3e-3, headroom=True)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 15. QAT fake quantisation ------------------------------------------------------------------------------------

class QATLinear(nn.Linear):
    """8-bit symmetric fake quantisation of the input (EMA abs-max observer) and the weight (its abs-max)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("amax", torch.tensor(0.0))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                cur = x.detach().abs().amax().float()
                self.amax.copy_(torch.where(self.amax == 0, cur, 0.9 * self.amax + 0.1 * cur))
        sx = max(float(self.amax) / 127, 1e-8)
        sw = max(float(self.weight.detach().abs().amax()) / 127, 1e-8)
        xq = torch.fake_quantize_per_tensor_affine(x.float(), sx, 0, -128, 127)
        wq = torch.fake_quantize_per_tensor_affine(self.weight, sw, 0, -128, 127)
        return F.linear(xq, wq, self.bias)


def test_qat_fake_quantize_per_tensor_in_forward():
    net = nn.Sequential(QATLinear(16, 64), nn.ReLU(), QATLinear(64, 64), nn.ReLU(), QATLinear(64, 4))
    w, losses, scales = fit(net, classes(), ce, steps=80, lr=3e-3)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 16. fp32 head under autocast(enabled=False), label smoothing ---------------------------------------------------

class FP32Head(nn.Module):
    def __init__(self, d=64, K=4):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, K)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return self.fc(self.norm(x.float()))


def test_fp32_head_autocast_disabled_label_smoothing_every_step():
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), FP32Head())
    w, losses, scales = fit(net, classes(), lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=0.1),
                            steps=80, lr=3e-3, every=1)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# --- 17. SigLIP: sigmoid pairwise loss, learnable temperature (clamped) and bias -------------------------------------

class SigLIP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, d))
        self.txt = nn.Sequential(nn.Linear(12, 64), nn.GELU(), nn.Linear(64, d))
        self.t_prime = nn.Parameter(torch.tensor(math.log(10.0)))
        self.bias = nn.Parameter(torch.tensor(-10.0))

    def forward(self, a, b):
        za = F.normalize(self.img(a).float(), dim=-1)
        zb = F.normalize(self.txt(b).float(), dim=-1)
        return za @ zb.T * self.t_prime.exp() + self.bias


PAIR = randn(8, 12, seed=5)


def pairs(i, B=32):
    """Two views of one 8-d latent: 16-d and 12-d, noisy."""
    g = gen(i)
    z = torch.randn(B, 8, generator=g)
    return (torch.cat([z, z.pow(2)], -1) + 0.1 * torch.randn(B, 16, generator=g),
            z @ PAIR + 0.1 * torch.randn(B, 12, generator=g))


def siglip_loss(m, a, b):
    logits = m(a, b)
    labels = 2 * torch.eye(a.shape[0]) - 1
    return -F.logsigmoid(labels * logits).sum() / a.shape[0]


def test_siglip_sigmoid_loss_learnable_temperature_and_bias():
    model = SigLIP()
    w, losses, scales = fit(model, pairs, siglip_loss, steps=100, lr=3e-3,
                            after=lambda i: model.t_prime.clamp_(0, math.log(100)))
    healthy(losses, scales, fall=0.7)
    quiet(w)
