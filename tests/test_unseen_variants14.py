"""Fourteenth set of failure-pattern variants, in architecture families the other probes cover little, watched through
the public API only (watch -> an ordinary fp16 autocast + GradScaler loop on the CPU -> w.report()) at ampdoctor's
default settings, with the failure starting mid-run (never at step 0) and neighbours on both sides of the producer.
(On the CPU, autocast runs nn.LSTM/nn.GRU/nn.LSTMCell in fp32, so the recurrent failures are in hand-written cells
built from nn.Linear, as custom recurrent cells are.)

1. a layer-normalised LSTM (Ba et al. 2016) for fraud detection fed raw transaction amounts: a $400k transaction at
   step 4 is inf in the input-to-gates Linear's fp16 cast, and LayerNorm(inf) = NaN (the Linear, not the LayerNorm);
2. a hand-written minGRU (Feng et al. 2024) with the naive parallel scan A_t * cumsum(b_t / A_t): on a 512-token
   document at step 3 the fp16 cumprod of the (1 - z) gates is subnormal, b / A overflows and 0 * inf = NaN;
3. a GAT layer whose edge softmax takes exp(e) without subtracting the max, after a sum-aggregation layer: a hub
   node with 10^4 neighbours at step 4 makes its embedding ~10^3 and exp(e) = inf, inf / inf = NaN in the GAT;
4. a diffusion denoiser conditioned on c_noise = log(sigma) / 4 with sigma from alphas_cumprod cast to the latents'
   fp16 (as diffusers' add_noise does): alpha_bar(t=0) = 0.99996 is 1.0 in fp16, sigma = 0, log 0 = -inf;
5. Min-SNR-gamma loss weights min(snr, 5) / snr for epsilon prediction with a zero-terminal-SNR schedule (Lin et al.
   2023): t = T at step 5 has snr = 0 and a 0 / 0 weight;
6. a detector's anchor decoding w = w_a * exp(dw) without the log(1000/16) clamp: an unnormalised 0-255 image at
   step 4 gives dw > 11.1, exp overflows in fp16 and the GIoU of an infinite box is NaN;
7. a wide & deep recommender whose EmbeddingBag sums a scraper bot's 60000 clicks of one item (fp32, finite): the
   first deep Linear's fp16 cast of the bag is inf (that Linear, not the bag);
8. a DCN-V2 cross network x_{l+1} = x0 * (W x_l + b) + x_l compounding on an unnormalised price feature at step 4;
9. Glow's affine coupling scale = sigmoid(h + 2) and log-det = sum log(scale): an outlier sample at step 3 pushes h
   below -19, the fp16 sigmoid is 0 and the log-det -inf (a singular coupling);
10. a Switch-style MoE router with capacity = int(1.25 * tokens / experts) and the load term tokens_e / capacity: the
    epoch's last batch of 5 tokens at step 5 has capacity 0;
11. a Siamese network's batch-hard triplet loss with the pairwise distance by expansion ||a||^2 + ||b||^2 - 2 a.b in
    fp16: two near-identical crops of a blank frame at step 4 cancel to a negative square distance, sqrt = NaN;
12. a keyword spotter's per-utterance CMVN (x - mean) / sqrt(var + 1e-8) after a learnable fp16 filterbank: a clip
    of digital silence at step 3 has var = 0, the 1e-8 is 0 in fp16, 0 / 0 = NaN.
Healthy twins (the fix applied, no warning and no error): 3 with the max-subtracted edge softmax, 5 with v-prediction
(weights min(snr, 5) / (snr + 1)), 8 with log1p of the dense features, 10 with capacity = max(1, ceil(...)).

Each failure is first checked to be real in the loop itself (the loss non-finite and the scaler's skipped step, and
forward hooks that name the first module whose output is non-finite from finite inputs); then the right rule at the
producing module among the first three findings, at the right step. Where ampdoctor is wrong the test is a strict
xfail whose reason says what it reported instead.

ampdoctor got wrong: nothing in this set; all twelve producers are named with the right rule at the right step among
the first three findings, and the four twins are quiet, so there is no xfail.
"""
import math
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, in_top3, lines, no_error_at, one_thread, randn
from probe_harness import at_top3 as at, healthy as _healthy, real_fwd as real, train_loop


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)


healthy = partial(_healthy, bwd=False)  # the oracle's backward producer is not checked


# ======================================================================================================================
# 1. layer-normalised LSTM over transactions with the raw amount as a feature: a $400k transaction at step 4 is inf in
#    the input-to-gates Linear's fp16 cast; LayerNorm of the inf gates is NaN (the LayerNorm only passes it on)
# ======================================================================================================================
class LayerNormLSTMCell(nn.Module):
    def __init__(self, d_in, d):
        super().__init__()
        self.ih, self.hh = nn.Linear(d_in, 4 * d), nn.Linear(d, 4 * d, bias=False)
        self.ln_ih, self.ln_hh, self.ln_c = nn.LayerNorm(4 * d), nn.LayerNorm(4 * d), nn.LayerNorm(d)

    def forward(self, x, h, c):
        i, f, g, o = (self.ln_ih(self.ih(x)) + self.ln_hh(self.hh(h))).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(self.ln_c(c)), c


class LNLSTM(nn.Module):
    def __init__(self, d_in, d):
        super().__init__()
        self.d, self.cell = d, LayerNormLSTMCell(d_in, d)

    def forward(self, x):  # [B, T, d_in]
        h = c = x.new_zeros(x.shape[0], self.d)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], h, c)
        return h


class FraudLSTM(nn.Module):
    def __init__(self, n_types=20, d_emb=15, d=32):
        super().__init__()
        self.event_emb = nn.Embedding(n_types, d_emb)
        self.rnn = LNLSTM(d_emb + 1, d)
        self.head = nn.Linear(d, 1)

    def forward(self, types, amounts):
        return self.head(self.rnn(torch.cat([self.event_emb(types), amounts[..., None]], -1)))[:, 0]


def _transactions(i):
    g = torch.Generator().manual_seed(i)
    types = torch.randint(0, 20, (16, 12), generator=g)
    amounts = torch.rand(16, 12, generator=g) * 200  # dollars, raw
    if i == 4:
        amounts[3, 5] = 4.0e5  # a wire transfer
    return types, amounts, (torch.rand(16, generator=g) < 0.2).float()


def test_layer_norm_lstm_gates_of_a_raw_400k_transaction_overflow_in_the_input_linear_not_the_layer_norm():
    torch.manual_seed(0)
    m = FraudLSTM()
    loss = lambda o, types, amounts, y: F.binary_cross_entropy_with_logits(o.float(), y)
    r = train_loop(m, _transactions, loss, 7, call=lambda types, amounts, y: m(types, amounts))
    real(r, "rnn.cell.ih", 4)
    rep = r["w"].report()
    at(rep, ("overflow",), "rnn.cell.ih", step=4, phase="forward")
    no_error_at(rep, ("rnn.cell.ln_ih", "rnn.cell", "rnn", "event_emb", "head", ""))


# ======================================================================================================================
# 2. minGRU with the naive parallel scan h = A * cumsum(b / A), A = cumprod(1 - z): fine on 32-token documents; a
#    512-token document at step 3 drives the fp16 cumprod subnormal, b / A past 65504 and A * inf to inf / NaN
# ======================================================================================================================
class NaiveParallelScan(nn.Module):
    def forward(self, a, b):  # h_t = a_t * h_{t-1} + b_t, h_0 = 0, over dim 1
        A = torch.cumprod(a, 1)
        return A * torch.cumsum(b / A, 1)


class MinGRU(nn.Module):
    def __init__(self, d_in, d):
        super().__init__()
        self.to_z, self.to_h = nn.Linear(d_in, d), nn.Linear(d_in, d)
        self.scan = NaiveParallelScan()
        with torch.no_grad():
            self.to_z.bias.fill_(-3.0)  # gates ~0.05: a long memory

    def forward(self, x):
        z = torch.sigmoid(self.to_z(x))
        return self.scan(1 - z, z * self.to_h(x))


class MinGRULM(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mingru = MinGRU(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.norm(self.mingru(self.embed(idx))))


def _documents(i):
    T = 512 if i == 3 else 32
    idx = torch.randint(0, 64, (4, T + 1), generator=torch.Generator().manual_seed(i))
    return idx[:, :-1], idx[:, 1:]


def test_mingru_naive_parallel_scan_overflows_in_the_scan_on_a_long_document():
    torch.manual_seed(0)
    m = MinGRULM()
    loss = lambda o, x, y: F.cross_entropy(o.float().flatten(0, 1), y.flatten())
    r = train_loop(m, _documents, loss, 6, call=lambda x, y: m(x))
    real(r, "mingru.scan", 3)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "mingru.scan", step=3, phase="forward")
    no_error_at(rep, ("mingru.to_z", "mingru.to_h", "mingru", "norm", "head", ""))


# ======================================================================================================================
# 3. GAT edge softmax exp(e) / sum exp(e) without the max subtracted, after a sum-aggregation layer: the sampler's
#    subgraph at step 4 holds a hub with 10^4 neighbours, its summed embedding is ~10^3 and exp(e) = inf in the GAT
# ======================================================================================================================
class SumAggregation(nn.Module):
    def __init__(self, d_in, d):
        super().__init__()
        self.lin = nn.Linear(d_in, d)

    def forward(self, x, src, dst):
        h = F.relu(self.lin(x))
        return h + torch.zeros_like(h).index_add_(0, dst, h[src])


class GATLayer(nn.Module):
    def __init__(self, d_in, d, stable=False):
        super().__init__()
        self.lin = nn.Linear(d_in, d, bias=False)
        self.att_src, self.att_dst = nn.Linear(d, 1, bias=False), nn.Linear(d, 1, bias=False)
        self.stable = stable

    def forward(self, x, src, dst):
        h = self.lin(x)
        e = F.leaky_relu(self.att_src(h)[src, 0] + self.att_dst(h)[dst, 0], 0.2)
        n = x.shape[0]
        if self.stable:
            emax = torch.full((n,), float("-inf"), dtype=e.dtype).scatter_reduce(0, dst, e, "amax")
            e = e - emax[dst]
        w = e.exp()
        den = torch.zeros(n, dtype=w.dtype).index_add_(0, dst, w)
        alpha = w / den[dst]
        return torch.zeros_like(h).index_add_(0, dst, alpha[:, None] * h[src])


class GraphNet(nn.Module):
    def __init__(self, d_in=8, d=32, classes=4, stable=False):
        super().__init__()
        self.conv1 = SumAggregation(d_in, d)
        self.gat = GATLayer(d, d, stable)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, src, dst):
        return self.head(self.norm(F.elu(self.gat(self.conv1(x, src, dst), src, dst))))


_LABEL_W = randn(8, 4, seed=77)


def _subgraph(i, hub_at=4):
    g = torch.Generator().manual_seed(i)
    n = 200
    src, dst = torch.randint(0, n, (400,), generator=g), torch.randint(0, n, (400,), generator=g)
    x = torch.randn(n, 8, generator=g)
    if i == hub_at:  # a celebrity account: 10^4 followers sampled as leaves
        leaves = torch.arange(n, n + 10_000)
        src, dst = torch.cat([src, leaves]), torch.cat([dst, torch.zeros(10_000, dtype=torch.long)])
        x = torch.cat([x, torch.randn(10_000, 8, generator=g)])
    loops = torch.arange(x.shape[0])
    y = (x[:n] @ _LABEL_W).argmax(-1)
    return x, torch.cat([src, loops]), torch.cat([dst, loops]), y


def _graph_loss(o, x, src, dst, y):
    return F.cross_entropy(o[: y.shape[0]].float(), y)


def test_gat_edge_softmax_without_max_subtraction_overflows_in_the_gat_on_a_hub_with_10k_neighbours():
    torch.manual_seed(0)
    m = GraphNet()
    r = train_loop(m, _subgraph, _graph_loss, 7, call=lambda x, src, dst, y: m(x, src, dst))
    real(r, "gat", 4)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "gat", step=4, phase="forward")
    no_error_at(rep, ("conv1", "conv1.lin", "gat.lin", "gat.att_src", "gat.att_dst", "norm", "head", ""))


def test_healthy_twin_gat_with_the_max_subtracted_edge_softmax_on_the_same_hub_is_quiet():
    torch.manual_seed(0)
    m = GraphNet(stable=True)
    r = train_loop(m, lambda i: _subgraph(i, hub_at=4), _graph_loss, 30, lr=1e-2,
                   call=lambda x, src, dst, y: m(x, src, dst))
    healthy(r)


# ======================================================================================================================
# 4. a denoiser conditioned on c_noise = log(sigma) / 4, sigma = sqrt((1 - ab) / ab) with alphas_cumprod cast to the
#    fp16 latents' dtype (as diffusers' add_noise casts it): t = 0 drawn at step 5 has ab = 1.0 in fp16, log(0) = -inf,
#    and the sinusoidal time embedding of -inf is NaN (the embedding only passes it on)
# ======================================================================================================================
def _cosine_alphas_cumprod(T=1000, s=0.008):
    f = torch.cos((torch.arange(T + 1, dtype=torch.float64) / T + s) / (1 + s) * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0).float()


class NoiseLevel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("alphas_cumprod", _cosine_alphas_cumprod())

    def forward(self, t, like):
        ab = self.alphas_cumprod[t].to(like.dtype)
        sigma = ((1 - ab) / ab).sqrt()
        return sigma.log() / 4


class SinusoidalEmbedding(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.register_buffer("freqs", torch.exp(-math.log(10_000) * torch.arange(d // 2) / (d // 2)))

    def forward(self, c):
        arg = c[:, None] * 250 * self.freqs.to(c.dtype)
        return torch.cat([arg.sin(), arg.cos()], -1)


class LatentDenoiser(nn.Module):
    def __init__(self, d=16, h=64):
        super().__init__()
        self.noise_cond = NoiseLevel()
        self.time_embed = SinusoidalEmbedding(32)
        self.time_mlp = nn.Sequential(nn.Linear(32, h), nn.SiLU())
        self.net_in = nn.Linear(d, h)
        self.net = nn.Sequential(nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, d))

    def forward(self, x0, t, noise):
        ab = self.noise_cond.alphas_cumprod[t][:, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        hid = self.net_in(x_t)
        return self.net(hid + self.time_mlp(self.time_embed(self.noise_cond(t, hid))))


def _latents(i):
    g = torch.Generator().manual_seed(i)
    t = torch.randint(2, 1000, (32,), generator=g)
    if i == 5:
        t[11] = 0
    return torch.randn(32, 16, generator=g) * 0.5, t, torch.randn(32, 16, generator=g)


def test_log_sigma_conditioning_from_fp16_alphas_cumprod_at_t0_is_minus_inf_in_the_noise_level_module():
    torch.manual_seed(0)
    m = LatentDenoiser()
    r = train_loop(m, _latents, lambda o, x0, t, noise: F.mse_loss(o.float(), noise), 8)
    real(r, "noise_cond", 5)
    rep = r["w"].report()
    at(rep, ("overflow", "precision_loss"), "noise_cond", step=5, phase="forward")
    no_error_at(rep, ("time_embed", "time_mlp", "time_mlp.0", "net_in", "net", ""))


# ======================================================================================================================
# 5. Min-SNR-gamma weights for epsilon prediction, min(snr, 5) / snr, with a zero-terminal-SNR schedule: t = T drawn
#    at step 5 has snr = 0 and the weight 0 / 0 (the v-prediction weight min(snr, 5) / (snr + 1) is the fix)
# ======================================================================================================================
def _zero_terminal_snr_alphas_cumprod(T=1000):
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, T, dtype=torch.float64) ** 2
    ab_sqrt = torch.cumprod(1 - betas, 0).sqrt()
    a0, aT = ab_sqrt[0].clone(), ab_sqrt[-1].clone()
    ab_sqrt = (ab_sqrt - aT) * a0 / (a0 - aT)  # Lin et al. 2023, Algorithm 1
    return (ab_sqrt ** 2).float()


class MinSNRWeight(nn.Module):
    def __init__(self, gamma=5.0, prediction="epsilon"):
        super().__init__()
        self.gamma, self.prediction = gamma, prediction
        self.register_buffer("alphas_cumprod", _zero_terminal_snr_alphas_cumprod())

    def forward(self, t):
        ab = self.alphas_cumprod[t]
        snr = ab / (1 - ab)
        w = snr.clamp(max=self.gamma)
        return w / snr if self.prediction == "epsilon" else w / (snr + 1)


class SNRWeightedDenoiser(nn.Module):
    def __init__(self, prediction="epsilon", d=16, h=64):
        super().__init__()
        self.prediction = prediction
        self.time_embed = nn.Embedding(1000, h)
        self.snr_weight = MinSNRWeight(prediction=prediction)
        self.net_in = nn.Linear(d, h)
        self.net = nn.Sequential(nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, d))

    def forward(self, x0, t, noise):
        temb = self.time_embed(t)
        weight = self.snr_weight(t)
        ab = self.snr_weight.alphas_cumprod[t][:, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        pred = self.net(self.net_in(x_t) + temb)
        target = noise if self.prediction == "epsilon" else ab.sqrt() * noise - (1 - ab).sqrt() * x0
        return (weight[:, None] * (pred.float() - target) ** 2).mean()


_X0_DIR = randn(16, seed=5)


def _zsnr_batch(i, t_max_at=5):
    g = torch.Generator().manual_seed(i)
    t = torch.randint(0, 999, (32,), generator=g)
    if i == t_max_at:
        t[20] = 999
    x0 = _X0_DIR * torch.randn(32, 1, generator=g).sign() + 0.1 * torch.randn(32, 16, generator=g)
    return x0, t, torch.randn(32, 16, generator=g)


def test_min_snr_epsilon_weight_with_zero_terminal_snr_is_nan_in_the_weight_module_at_t_equals_T():
    torch.manual_seed(0)
    m = SNRWeightedDenoiser("epsilon")
    r = train_loop(m, _zsnr_batch, lambda o, *a: o, 8)
    real(r, "snr_weight", 5)
    rep = r["w"].report()
    at(rep, ("nan_origin",), "snr_weight", step=5, phase="forward")
    no_error_at(rep, ("time_embed", "net_in", "net", ""))


def test_healthy_twin_min_snr_v_prediction_weight_with_zero_terminal_snr_is_quiet():
    torch.manual_seed(0)
    m = SNRWeightedDenoiser("v_prediction")
    r = train_loop(m, lambda i: _zsnr_batch(i, t_max_at=5 if i < 10 else 13), lambda o, *a: o, 30, lr=3e-3)
    healthy(r)


# ======================================================================================================================
# 6. anchor decoding w = w_a * exp(dw) without torchvision's clamp at log(1000 / 16): an image fed unnormalised
#    (0-255) at step 4 drives the regression head's dw past 11.1, exp is inf in fp16 and the GIoU of the box is NaN
# ======================================================================================================================
class BoxCoder(nn.Module):
    def forward(self, deltas, anchors):  # deltas [B, A, 4] (dx, dy, dw, dh); anchors [A, 4] (cx, cy, w, h)
        dx, dy, dw, dh = deltas.unbind(-1)
        cx, cy = anchors[:, 0] + dx * anchors[:, 2], anchors[:, 1] + dy * anchors[:, 3]
        w, h = anchors[:, 2] * torch.exp(dw), anchors[:, 3] * torch.exp(dh)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


class GIoULoss(nn.Module):
    def forward(self, p, t):
        p, t = p.float(), t.float()
        area_p = (p[..., 2] - p[..., 0]) * (p[..., 3] - p[..., 1])
        area_t = (t[..., 2] - t[..., 0]) * (t[..., 3] - t[..., 1])
        lt, rb = torch.max(p[..., :2], t[..., :2]), torch.min(p[..., 2:], t[..., 2:])
        inter = (rb - lt).clamp(min=0).prod(-1)
        union = area_p + area_t - inter
        clt, crb = torch.min(p[..., :2], t[..., :2]), torch.max(p[..., 2:], t[..., 2:])
        enclose = (crb - clt).prod(-1)
        giou = inter / union - (enclose - union) / enclose
        return (1 - giou).mean()


def _anchors():
    ys, xs = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    return torch.stack([xs.flatten() * 8 + 4, ys.flatten() * 8 + 4, torch.full((64,), 16.0), torch.full((64,), 16.0)], -1)


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU())
        self.bbox_head = nn.Conv2d(32, 4, 1)
        self.box_coder = BoxCoder()
        self.criterion = GIoULoss()
        self.register_buffer("anchors", _anchors())

    def forward(self, img, targets):
        deltas = self.bbox_head(self.backbone(img)).flatten(2).transpose(1, 2)  # [B, 64, 4]
        return self.criterion(self.box_coder(deltas, self.anchors), targets)


def _detection_batch(i):
    g = torch.Generator().manual_seed(i)
    img = torch.rand(4, 3, 64, 64, generator=g) * 2 - 1
    if i == 4:
        img[1] = (img[1] + 1) * 127.5  # a frame that skipped the normalisation: raw 0-255 pixels
    a = _anchors()
    c = a[:, :2] + torch.randn(4, 64, 2, generator=g) * 2
    wh = a[:, 2:] * torch.exp(torch.randn(4, 64, 2, generator=g) * 0.2)
    return img, torch.cat([c - wh / 2, c + wh / 2], -1)


def test_anchor_decoding_exp_dw_without_a_clamp_overflows_in_the_box_coder_on_an_unnormalised_frame():
    torch.manual_seed(0)
    m = Detector()
    r = train_loop(m, _detection_batch, lambda o, *a: o, 7)
    real(r, "box_coder", 4)
    rep = r["w"].report()
    at(rep, ("overflow",), "box_coder", step=4, phase="forward")
    no_error_at(rep, ("bbox_head", "backbone", "criterion", ""))


# ======================================================================================================================
# 7. wide & deep: the EmbeddingBag (fp32 under CPU autocast) sums a scraper bot's 60000 clicks of one item to ~1e5,
#    finite; the first deep Linear's fp16 cast of it is inf (that Linear is the producer, not the bag)
# ======================================================================================================================
class WideDeep(nn.Module):
    def __init__(self, n_users=100, n_items=500, d=16):
        super().__init__()
        self.user = nn.Embedding(n_users, d)
        self.history = nn.EmbeddingBag(n_items, d, mode="sum")
        self.deep = nn.Sequential(nn.Linear(2 * d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)

    def forward(self, users, items, offsets):
        return self.head(self.deep(torch.cat([self.user(users), self.history(items, offsets)], -1)))[:, 0]


def _sessions(i):
    g = torch.Generator().manual_seed(i)
    users = torch.randint(0, 100, (32,), generator=g)
    lens = torch.randint(5, 50, (32,), generator=g)
    items = [torch.randint(0, 500, (int(n),), generator=g) for n in lens]
    if i == 4:
        items[7] = torch.full((60_000,), 42)  # a scraper bot re-opening one listing
    offsets = torch.tensor([0] + [len(t) for t in items[:-1]]).cumsum(0)
    return users, torch.cat(items), offsets, (torch.rand(32, generator=g) < 0.3).float()


def test_embedding_bag_sum_of_a_bots_60000_clicks_overflows_in_the_first_deep_linears_cast():
    torch.manual_seed(0)
    m = WideDeep()
    loss = lambda o, users, items, offsets, y: F.binary_cross_entropy_with_logits(o.float(), y)
    r = train_loop(m, _sessions, loss, 7, call=lambda users, items, offsets, y: m(users, items, offsets))
    real(r, "deep.0", 4)
    rep = r["w"].report()
    at(rep, ("overflow",), "deep.0", step=4, phase="forward")
    no_error_at(rep, ("history", "user", "deep.2", "deep", "head", ""))


# ======================================================================================================================
# 8. DCN-V2 cross network x_{l+1} = x0 * (W x_l + b) + x_l on an fp16 stem: a price fed raw (not standardised) at
#    step 4 compounds through the cross layers until one's product passes 65504 (that cross layer, not its Linear)
# ======================================================================================================================
class CrossLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x0, x):
        return x0 * self.lin(x) + x


class DCN(nn.Module):
    def __init__(self, n_dense=4, n_cat=3, vocab=100, d_emb=8, d=32, log1p=False):
        super().__init__()
        self.log1p = log1p
        self.embed = nn.Embedding(vocab, d_emb)
        self.stem = nn.Linear(n_dense + n_cat * d_emb, d)
        self.cross = nn.ModuleList(CrossLayer(d) for _ in range(3))
        self.deep = nn.Sequential(nn.Linear(d, 64), nn.ReLU())
        self.head = nn.Linear(d + 64, 1)

    def forward(self, dense, cats):
        if self.log1p:
            dense = torch.sign(dense) * torch.log1p(dense.abs())
        x0 = self.stem(torch.cat([dense, self.embed(cats).flatten(1)], -1))
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.head(torch.cat([x, self.deep(x0)], -1))[:, 0]


def _ctr_batch(i):
    g = torch.Generator().manual_seed(i)
    dense = torch.randn(64, 4, generator=g)
    if i == 4:
        dense[9, 3] = 900.0  # the price column of one partner's feed, in cents and unstandardised
    cats = torch.randint(0, 100, (64, 3), generator=g)
    y = ((dense[:, 0] + dense[:, 1].clamp(-3, 3) + 0.5 * torch.randn(64, generator=g)) > 0).float()
    return dense, cats, y


_CTR_LOSS = lambda o, dense, cats, y: F.binary_cross_entropy_with_logits(o.float(), y)  # noqa: E731


def test_dcn_cross_layers_compound_an_unstandardised_price_until_a_cross_product_overflows():
    torch.manual_seed(0)
    m = DCN()
    r = train_loop(m, _ctr_batch, _CTR_LOSS, 7, call=lambda dense, cats, y: m(dense, cats))
    name, k = r["first"]
    assert name.startswith("cross.") and name.count(".") == 1 and name != "cross.0" and k == 4, r
    real(r, name, 4)
    rep = r["w"].report()
    at(rep, ("overflow",), name, step=4, phase="forward")
    no_error_at(rep, (name + ".lin", "stem", "embed", "deep", "head", ""))


def test_healthy_twin_dcn_with_log1p_dense_features_on_the_same_batches_is_quiet():
    torch.manual_seed(0)
    m = DCN(log1p=True)
    r = train_loop(m, _ctr_batch, _CTR_LOSS, 30, lr=3e-3, call=lambda dense, cats, y: m(dense, cats))
    healthy(r)


# ======================================================================================================================
# 9. Glow's affine coupling: scale = sigmoid(h + 2), log-det = sum(log(scale)); an outlier sample at step 3 drives h
#    below -19, the fp16 sigmoid flushes to 0 and the coupling's log-det is -inf (the coupling, not its net)
# ======================================================================================================================
class GlowCoupling(nn.Module):
    def __init__(self, d=8, hidden=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d // 2, hidden), nn.ReLU(), nn.Linear(hidden, d))

    def forward(self, x):
        xa, xb = x.chunk(2, -1)
        h = self.net(xa)
        shift, scale = h[..., 0::2], torch.sigmoid(h[..., 1::2] + 2.0)
        return torch.cat([(xb + shift) * scale, xa], -1), torch.log(scale).sum(-1)


class Glow(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.flows = nn.ModuleList(GlowCoupling(d) for _ in range(3))

    def forward(self, x):
        logdet = 0
        for f in self.flows:
            x, ld = f(x)
            logdet = logdet + ld
        return 0.5 * x.float().pow(2).sum(-1) - logdet.float()


def _flow_batch(i):
    x = randn(128, 8, seed=i) * 0.7
    if i == 3:
        x[40] = x[40].sign() * 60.0  # a mis-scaled record
    return (x,)


def test_glow_coupling_sigmoid_scale_flushes_in_fp16_and_its_log_det_is_minus_inf():
    torch.manual_seed(0)
    m = Glow()
    r = train_loop(m, _flow_batch, lambda o, *a: o.mean(), 6)
    name, k = r["first"]
    assert name in ("flows.0", "flows.1", "flows.2") and k == 3, r
    real(r, name, 3)
    rep = r["w"].report()
    at(rep, ("overflow", "underflow"), name, step=3, phase="forward")
    no_error_at(rep, (name + ".net", name + ".net.2", "flows", ""))


# ======================================================================================================================
# 10. Switch-style MoE router: capacity = int(1.25 * tokens / experts), load_e = tokens_e / capacity in the
#     load-balancing loss; the epoch's last batch of 5 tokens at step 5 has capacity 0 (x / 0)
# ======================================================================================================================
class Top1Router(nn.Module):
    def __init__(self, d, experts=8, cf=1.25, safe=False):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts_n, self.cf, self.safe = experts, cf, safe

    def forward(self, x):
        probs = self.gate(x).float().softmax(-1)
        idx = probs.argmax(-1)
        n = x.shape[0]
        capacity = max(1, math.ceil(self.cf * n / self.experts_n)) if self.safe else int(self.cf * n / self.experts_n)
        mask = F.one_hot(idx, self.experts_n).float()
        keep = (mask.cumsum(0) * mask).sum(-1) <= capacity
        load = mask.sum(0) / capacity
        aux = self.experts_n * (load * probs.mean(0)).sum()
        return idx, probs.gather(1, idx[:, None])[:, 0] * keep, aux


class MoELayer(nn.Module):
    def __init__(self, d, experts=8, safe=False):
        super().__init__()
        self.router = Top1Router(d, experts, safe=safe)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))

    def forward(self, x):
        idx, gate, aux = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                out[sel] = (expert(x[sel]) * gate[sel, None]).to(out.dtype)
        return x + out, aux


class MoENet(nn.Module):
    def __init__(self, d=32, safe=False):
        super().__init__()
        self.embed = nn.Linear(12, d)
        self.moe = MoELayer(d, safe=safe)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h, aux = self.moe(self.embed(x))
        return self.head(h)[:, 0], aux


_MOE_W = randn(12, seed=9)


def _tokens(i):
    n = 5 if i == 5 else 64  # 5 * 64 + 5 tokens in the epoch
    x = randn(n, 12, seed=i)
    return x, x @ _MOE_W


def _moe_loss(o, x, y):
    pred, aux = o
    return F.mse_loss(pred.float(), y) + 0.01 * aux


def test_moe_capacity_of_a_5_token_last_batch_is_0_and_the_load_term_divides_by_it_in_the_router():
    torch.manual_seed(0)
    m = MoENet()
    r = train_loop(m, _tokens, _moe_loss, 8, call=lambda x, y: m(x))
    real(r, "moe.router", 5)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "moe.router", step=5, phase="forward")
    no_error_at(rep, ("moe.router.gate", "moe", "embed", "head", ""))


def test_healthy_twin_moe_capacity_at_least_one_on_the_same_short_batch_is_quiet():
    torch.manual_seed(0)
    m = MoENet(safe=True)
    r = train_loop(m, _tokens, _moe_loss, 30, lr=3e-3, call=lambda x, y: m(x))
    healthy(r)


# ======================================================================================================================
# 11. batch-hard triplet loss on a Siamese network, pairwise distances by expansion ||a||^2 + ||b||^2 - 2 a.b in fp16:
#     at step 4 two crops of a blank frame are near-identical and the square distance cancels to a negative
# ======================================================================================================================
class ExpandedPairwiseDistance(nn.Module):
    def forward(self, a, b):
        d2 = (a * a).sum(-1)[:, None] + (b * b).sum(-1)[None] - 2 * (a @ b.t())
        return d2.sqrt()


class BatchHardTriplet(nn.Module):
    def __init__(self, margin=0.3):
        super().__init__()
        self.margin = margin

    def forward(self, d):
        d = d.float()
        pos = d.diagonal()
        neg = (d + torch.eye(d.shape[0]) * 1e4).min(1).values
        return F.relu(pos - neg + self.margin).mean()


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64))
        self.distance = ExpandedPairwiseDistance()
        self.criterion = BatchHardTriplet()

    def forward(self, va, vb):
        return self.criterion(self.distance(self.encoder(va), self.encoder(vb)))


def _views(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(32, 32, generator=g) * 3
    va, vb = x + 0.5 * torch.randn(32, 32, generator=g), x + 0.5 * torch.randn(32, 32, generator=g)
    if i == 4:  # blank frames: the crops differ only by sensor noise
        for j in range(8, 16):
            blank = torch.full((32,), 2.0)
            va[j], vb[j] = blank + 1e-2 * torch.randn(32, generator=g), blank + 1e-2 * torch.randn(32, generator=g)
    return va, vb


def test_pairwise_distance_by_expansion_cancels_to_a_negative_on_near_identical_crops_and_sqrt_is_nan():
    torch.manual_seed(0)
    m = Siamese()
    with torch.no_grad():
        m.encoder[2].weight.mul_(3)
    r = train_loop(m, _views, lambda o, *a: o, 7)
    real(r, "distance", 4)
    rep = r["w"].report()
    at(rep, ("nan_origin",), "distance", step=4, phase="forward")
    no_error_at(rep, ("encoder", "encoder.2", "criterion", ""))


# ======================================================================================================================
# 12. keyword spotting: per-utterance CMVN (x - mean) / sqrt(var + 1e-8) on the fp16 output of a learnable filterbank;
#     a clip of digital silence at step 3 has var = 0, 1e-8 is 0 in fp16 and the normalised frames are 0 / 0
# ======================================================================================================================
class UtteranceCMVN(nn.Module):
    def __init__(self, eps=1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, x):  # [B, C, T]
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps)


class KWS(nn.Module):
    def __init__(self, classes=6):
        super().__init__()
        self.frontend = nn.Conv1d(1, 16, 64, stride=32)
        self.cmvn = UtteranceCMVN()
        self.encoder = nn.Sequential(nn.Conv1d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1))
        self.classifier = nn.Linear(32, classes)

    def forward(self, wav):
        return self.classifier(self.encoder(self.cmvn(self.frontend(wav[:, None]))).flatten(1))


def _clips(i):
    g = torch.Generator().manual_seed(i)
    y = torch.randint(0, 6, (16,), generator=g)
    t = torch.arange(4000) / 4000
    wav = torch.sin(2 * math.pi * (100 + 80 * y[:, None]) * t) * 0.3 + 0.05 * torch.randn(16, 4000, generator=g)
    if i == 3:
        wav[6] = 0.0  # a muted microphone: digital silence
    return wav, y


def test_utterance_cmvn_eps_1e_8_vanishes_in_fp16_on_digital_silence_and_the_frames_are_0_over_0():
    torch.manual_seed(0)
    m = KWS()
    r = train_loop(m, _clips, lambda o, wav, y: F.cross_entropy(o.float(), y), 6, call=lambda wav, y: m(wav))
    real(r, "cmvn", 3)
    rep = r["w"].report()
    at(rep, ("eps_underflow", "nan_origin"), "cmvn", step=3, phase="forward")
    no_error_at(rep, ("frontend", "encoder", "encoder.0", "classifier", ""))
