"""Fifteenth set of failure-pattern variants: failures made inside loss functions, normalisations and similarity
computations that live in named nn.Modules of realistic models, watched through the public API only (watch -> an
ordinary fp16 autocast + GradScaler loop on the CPU -> w.report()) at ampdoctor's default settings, with the failure
starting mid-run (never at step 0) and the producer between modules that only pass it on (or the root that sums it).
Each loss is written the way its published code writes it; on the CPU, autocast leaves exp/log/pow/var/sum/softplus/
sigmoid/softmax in the input's fp16, as a pure-fp16 (model.half(), DeepSpeed fp16) run does everywhere.

1. the Multi-Similarity loss (Wang et al. 2019, research-ms-loss) log(1 + sum exp(40 (s - 0.5))) on a retrieval model:
   one photo listed under two SKUs at step 4 is a negative pair with cosine ~1, exp(19.6) = inf in the loss module;
2. pytorch_msssim-style SSIM at data_range=255 (an EDSR-style 0-255 denoiser, Zhao et al.'s SSIM + L1 mix): on a
   snowfield crop at step 3 the local products pass 65504 and the SSIM terms are inf / inf;
3. Deep CORAL's covariance (X^T X - (1^T X)^T (1^T X) / n) / (n - 1) as its PyTorch port writes it: a target-site batch
   that skipped the intensity normalisation at step 4 overflows the fp16 outer product of the column sums;
4. MWER fine-tuning with the N-best posteriors renormalised as exp(log P) / sum exp(log P): a 500-frame sentence at
   step 5 has every hypothesis below exp's fp16 floor (-17.3), 0 / 0 in the MWER module;
5. the Deep VIB bottleneck std = softplus(rho - 5) with the KL's -log(std) written out: a record in cents at step 4
   pushes rho below -12.4, fp16 softplus is 0 and the KL is inf;
6. a Mixture-of-Softmaxes layer scoring log(prob + 1e-8) with a log-unigram decoder bias: a once-in-2e9 token as a
   target at step 4 has p = 0 in fp16, and 1e-8 is 0 too (eps_underflow);
7. the Asymmetric Loss (Ridnik et al. 2021) log(sigmoid(x).clamp(min=1e-8)) * y: a cloud-saturated, unnormalised
   satellite tile at step 4 gives a logit below -17.4, 0 * log(0) = NaN (the 1e-8 clamp bound is 0 in fp16);
8. DeepSurv's Cox partial likelihood exp(risk) * risk-set mask: a creatinine entered in umol/L at step 4 makes
   risk = 20, exp = inf and inf * 0 = NaN in the loss module;
9. a neural HMM's scaled forward recursion in probability space (Rabiner): an accelerometer spike at step 3 is a frame
   > 17 nats from every state, every fp16 exp(log b) is 0 and alpha = 0 / 0 in the HMM module;
10. AdaIN's calc_mean_std (Huang & Belongie 2017), feat.var() on a caffe-scaled VGG's relu2_1: an op-art style image at
    step 4 has channel variances past 65504, inf in the AdaIN module (not the frozen encoder or the decoder);
11. DINOv2's KoLeo regulariser (PairwiseDistance(eps=1e-8), -log(d + 1e-8), under autocast(enabled=False), which keeps
    fp16 inputs fp16): an exact duplicate descriptor at step 4 has d = 0 and log(0) with both guards gone;
12. the energy-bounded outlier-exposure loss (Liu et al. 2020) relu(m_out - E_out)^2: a raw-pixel outlier image at step
    4 gets E_out ~ -1270 from the CE-trained classifier and the square overflows in the energy regulariser.
Healthy twins (the fix applied, on the same batches including the special one; no warning and no error): 1 with
pytorch-metric-learning's logsumexp form, 4 with the N-best softmax, 7 with the loss in fp32, 8 with a logsumexp per
risk set (subtracting the batch max alone is not enough in fp16: the risk sets without the outlier flush to 0).

Each failure is first checked to be real in the loop itself (the loss non-finite and the scaler's skipped step, and
forward hooks that name the first module whose output is non-finite from finite inputs); then the right rule at the
producing module among the first three findings, at the right step (both rules accepted where two are defensible:
nan_origin/underflow for a 0 / 0 of flushed exps, overflow/underflow for log of a flushed softplus,
eps_underflow/overflow or nan_origin for a vanished 1e-8). Where ampdoctor is wrong the test is a strict xfail whose
reason says what it reported instead.

ampdoctor got wrong: none of the twelve attributions, nor the four twins (all quiet); two spurious error findings
beside right ones, each a strict xfail of its own (both fixed since: a bound of exactly -1 is no vanished guard, and
pow's zero input is a singular point only with a negative exponent, replay/opevent.has_pole):
- KoLeo (11): '[error] eps_underflow at koleo aten::fill_ step 4 ... uses the bound -1.0 (1 - 0e+00), which rounds
  to exactly -1 in float16' for the diagonal's fill_(-1), which is exact and no guard
  (ampdoctor/replay/constants.py check_op: `v != 1.0 and abs(abs(v) - 1.0) < 1e-2` lets v = -1.0 through, so any
  fp16 fill_(-1) / clamp(-1, 1) in a replayed step is "a vanished bound"); as replayfold.fold_replay keeps only the
  first replay finding per (rule, module), it also hides the real vanished guard there, log(distances + 1e-8);
- energy (12): '[error] underflow at energy aten::pow step 4: the zeros that aten::pow turned into +inf are not zero
  in fp32' beside the right overflow: x ** 2 has no pole at 0 (the zeros are relu's; the inf is 1270 ** 2), but
  ampdoctor/replay/explain.py counts every aten::pow with a zero input as at its singular point (_POLES, _at_pole) and
  _pole_underflow then blames underflowed zeros once the fp32 fix search makes the step finite.
Seen, not counted as wrong: the 0 / 0 of flushed exps (4, 9) is nan_origin at the div with the generic "hit its
singular point (an input is 0 / -1)" and no underflow cause beside it, where the log of a flushed softplus (5) gets
one (explain.needs_fp32_check runs the fp32 check for overflow findings only); 1 also warns eps_underflow at the root
for F.normalize's default eps 1e-12 (true in fp16, harmless there: no zero norm).
"""
import functools
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
# 1. Multi-Similarity loss (Wang et al. 2019) as the authors' research-ms-loss writes it: log(1 + sum exp(40 (s - 0.5)))
#    over the mined negatives; a product photographed for two SKUs at step 4 is a negative pair with cosine ~1 in the
#    fp16 similarity matrix, exp(19.6) is inf (fp16 holds exp up to 11.09): the loss module, not the embedding
# ======================================================================================================================
class MultiSimilarityLoss(nn.Module):
    def __init__(self, thresh=0.5, margin=0.1, scale_pos=2.0, scale_neg=40.0, stable=False):
        super().__init__()
        self.thresh, self.margin, self.stable = thresh, margin, stable
        self.scale_pos, self.scale_neg = scale_pos, scale_neg

    def _soft(self, z, scale):  # (1 / scale) * log(1 + sum(exp(z)))
        if self.stable:  # pytorch-metric-learning's form: logsumexp over [0, z]
            return torch.logsumexp(torch.cat([z.new_zeros(1), z]), 0) / scale
        return 1.0 / scale * torch.log(1 + torch.sum(torch.exp(z)))

    def forward(self, feats, labels):
        sim_mat = torch.matmul(feats, torch.t(feats))
        losses = []
        for i in range(feats.shape[0]):
            pos_pair_ = sim_mat[i][labels == labels[i]]
            pos_pair_ = pos_pair_[pos_pair_ < 1 - 1e-5]
            neg_pair_ = sim_mat[i][labels != labels[i]]
            if len(pos_pair_) < 1:
                continue
            neg_pair = neg_pair_[neg_pair_ + self.margin > pos_pair_.min()]
            pos_pair = pos_pair_[pos_pair_ - self.margin < neg_pair_.max()]
            if len(neg_pair) < 1 or len(pos_pair) < 1:
                continue
            losses.append(self._soft(-self.scale_pos * (pos_pair - self.thresh), self.scale_pos)
                          + self._soft(self.scale_neg * (neg_pair - self.thresh), self.scale_neg))
        if not losses:
            return sim_mat.sum() * 0
        return sum(losses) / feats.shape[0]


class UncertaintyWeighting(nn.Module):
    """Kendall et al. 2018: sum_i exp(-s_i) L_i + s_i with learnable s_i."""

    def __init__(self, n):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(n))

    def forward(self, *losses):
        return sum(torch.exp(-s) * l.float() + s for s, l in zip(self.log_vars, losses))


class ProductRetriever(nn.Module):
    def __init__(self, classes=40, stable=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128))
        self.neck = nn.BatchNorm1d(128)  # the BNNeck of re-identification models
        self.embed = nn.Linear(128, 64)
        self.classifier = nn.Linear(64, classes)
        self.criterion = MultiSimilarityLoss(stable=stable)
        self.balancer = UncertaintyWeighting(2)

    def forward(self, x, y):
        e = F.normalize(self.embed(self.neck(self.backbone(x))), dim=-1)
        return self.balancer(self.criterion(e, y), F.cross_entropy(self.classifier(e).float(), y))


_SKU = randn(40, 32, seed=15) * 1.5


def _products(i, dup_at=4):
    g = torch.Generator().manual_seed(i)
    y = torch.randperm(40, generator=g)[:8].repeat_interleave(4)  # 8 SKUs x 4 photos (an m-per-class sampler)
    x = _SKU[y] + 0.6 * torch.randn(32, 32, generator=g)
    if i == dup_at:  # one product listed under two SKUs: the same photo in both
        x[4] = x[0] + 0.01 * torch.randn(32, generator=g)
    return x, y


def test_multi_similarity_loss_exp_of_a_duplicate_listing_negative_overflows_in_the_loss_module():
    torch.manual_seed(0)
    m = ProductRetriever()
    r = train_loop(m, _products, lambda o, *a: o, 7)
    real(r, "criterion", 4)
    rep = r["w"].report()
    at(rep, ("overflow",), "criterion", step=4, phase="forward")
    no_error_at(rep, ("backbone", "neck", "embed", "classifier", "balancer", ""))


def test_healthy_twin_multi_similarity_loss_with_logsumexp_on_the_same_duplicate_listing_is_quiet():
    torch.manual_seed(0)
    m = ProductRetriever(stable=True)
    r = train_loop(m, _products, lambda o, *a: o, 30, lr=3e-3)
    healthy(r)


# ======================================================================================================================
# 2. an EDSR-style denoiser working in 0-255 (rgb_range=255) trained on Zhao et al.'s mix 0.84 (1 - SSIM) + 0.16 L1
#    with pytorch_msssim's SSIM at data_range=255: on an overexposed (snow) crop at step 3 the local products X * Y
#    and mu_x^2 + mu_y^2 pass 65504 (X * Y in fp32, made fp16 by the Gaussian window's conv), the luminance and
#    contrast terms are inf / inf (the SSIM module, not the denoiser before it or the mix after it)
# ======================================================================================================================
def _gauss_1d(size=11, sigma=1.5):
    c = torch.arange(size, dtype=torch.float32) - size // 2
    g = torch.exp(-(c ** 2) / (2 * sigma ** 2))
    return g / g.sum()


class SSIM(nn.Module):
    def __init__(self, data_range=255.0, channels=3):
        super().__init__()
        self.data_range, self.channels = data_range, channels
        self.register_buffer("win", _gauss_1d().repeat(channels, 1, 1, 1))  # [C, 1, 1, 11]

    def _filter(self, x):  # separable Gaussian, valid padding, per channel
        win = self.win.to(x.dtype)
        x = F.conv2d(x, win, groups=self.channels)
        return F.conv2d(x, win.transpose(2, 3), groups=self.channels)

    def forward(self, X, Y):
        C1, C2 = (0.01 * self.data_range) ** 2, (0.03 * self.data_range) ** 2
        mu1, mu2 = self._filter(X), self._filter(Y)
        mu1_sq, mu2_sq, mu1_mu2 = mu1.pow(2), mu2.pow(2), mu1 * mu2
        sigma1_sq = self._filter(X * X) - mu1_sq
        sigma2_sq = self._filter(Y * Y) - mu2_sq
        sigma12 = self._filter(X * Y) - mu1_mu2
        cs_map = (2 * sigma12 + C2) / (sigma1_sq + sigma2_sq + C2)
        ssim_map = ((2 * mu1_mu2 + C1) / (mu1_sq + mu2_sq + C1)) * cs_map
        return ssim_map.flatten(1).mean(-1)


class MixLoss(nn.Module):
    """Zhao et al. 2017: alpha * (1 - SSIM) + (1 - alpha) * L1 / range."""

    def __init__(self, alpha=0.84, data_range=255.0):
        super().__init__()
        self.alpha, self.data_range = alpha, data_range

    def forward(self, ssim, out, target):
        l1 = (out.float() - target).abs().mean() / self.data_range
        return self.alpha * (1 - ssim.float()).mean() + (1 - self.alpha) * l1


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + 0.1 * self.conv2(F.relu(self.conv1(x)))  # EDSR's residual scaling


class Denoiser(nn.Module):
    def __init__(self, c=16, data_range=255.0):
        super().__init__()
        self.data_range = data_range
        self.head = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.Sequential(ResBlock(c), ResBlock(c))
        self.tail = nn.Conv2d(c, 3, 3, padding=1)
        self.ssim = SSIM(data_range)
        self.criterion = MixLoss(data_range=data_range)

    def forward(self, noisy, clean):
        out = noisy + self.tail(self.body(self.head(noisy / self.data_range - 0.5)))
        return self.criterion(self.ssim(out, clean), out, clean)


def _crops(i, snow_at=3):
    g = torch.Generator().manual_seed(i)
    base = F.interpolate(torch.rand(4, 3, 8, 8, generator=g), size=32, mode="bilinear", align_corners=False)
    clean = 40 + 120 * base  # natural crops: local means 40-160
    if i == snow_at:
        clean[2] = 232 + 20 * base[2]  # a snowfield, near white
    noisy = clean + 15 * torch.randn(clean.shape, generator=g)
    return noisy, clean


def test_ssim_at_data_range_255_overflows_on_an_overexposed_crop_in_the_ssim_module():
    torch.manual_seed(0)
    m = Denoiser()
    r = train_loop(m, _crops, lambda o, *a: o, 6)
    real(r, "ssim", 3)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "ssim", step=3, phase="forward")
    no_error_at(rep, ("head", "body", "tail", "criterion", ""))


# ======================================================================================================================
# 3. Deep CORAL (Sun & Saenko 2016) as its popular PyTorch port writes the covariance: (X^T X - (1^T X)^T (1^T X) / n)
#    / (n - 1), all fp16 matmuls; at step 4 the target batch comes from a site that exports raw (unscaled) intensities,
#    the outer product of its feature column sums passes 65504 and the CORAL module's covariance is -inf
# ======================================================================================================================
class CORAL(nn.Module):
    def forward(self, source, target):
        d = source.shape[1]
        ns, nt = source.shape[0], target.shape[0]
        tmp_s = torch.ones((1, ns)) @ source
        cs = (source.t() @ source - (tmp_s.t() @ tmp_s) / ns) / (ns - 1)
        tmp_t = torch.ones((1, nt)) @ target
        ct = (target.t() @ target - (tmp_t.t() @ tmp_t) / nt) / (nt - 1)
        loss = (cs - ct).pow(2).sum().sqrt()
        return loss / (4 * d * d)


class DeepCORAL(nn.Module):
    def __init__(self, d_in=16, d=32, classes=5):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(d_in, 64), nn.ReLU(), nn.Linear(64, d), nn.ReLU())
        self.classifier = nn.Linear(d, classes)
        self.coral = CORAL()
        self.balancer = UncertaintyWeighting(2)

    def forward(self, xs, ys, xt):
        fs, ft = self.features(xs), self.features(xt)
        ce = F.cross_entropy(self.classifier(fs).float(), ys)
        return self.balancer(ce, self.coral(fs, ft))


_CORAL_W = randn(16, 5, seed=21)


def _domains(i, raw_at=4):
    g = torch.Generator().manual_seed(i)
    xs = torch.randn(32, 16, generator=g)
    xt = 0.8 * torch.randn(32, 16, generator=g) + 0.3  # the target site: shifted, unlabelled
    if i == raw_at:
        xt = xt * 60  # this site's export skipped the intensity normalisation
    return xs, (xs @ _CORAL_W).argmax(-1), xt


def test_deep_coral_covariance_of_an_unscaled_target_batch_overflows_in_the_coral_module():
    torch.manual_seed(0)
    m = DeepCORAL()
    r = train_loop(m, _domains, lambda o, *a: o, 7)
    real(r, "coral", 4)
    rep = r["w"].report()
    at(rep, ("overflow",), "coral", step=4, phase="forward")
    no_error_at(rep, ("features", "features.2", "classifier", "balancer", ""))


# ======================================================================================================================
# 4. MWER fine-tuning (Prabhavalkar et al. 2018) of a CE-trained recogniser, the N-best posteriors renormalised as
#    exp(log P(y_i|x)) / sum_j exp(log P(y_j|x)) in fp16: a 500-frame utterance among 24-frame words at step 5 has
#    every hypothesis' sequence log-probability near -45 (fp16's exp is 0 below -17.3), and the renormalisation is
#    0 / 0 (the MWER module; the N-best scorer before it and the CE interpolation after it only pass it on)
# ======================================================================================================================
class NBest(nn.Module):
    """The N-best list from the model's own frame posteriors: the greedy path and its substitutions by the runner-up
    at the least confident frames (on the fly, as MWER training decodes), scored as sequence log-probabilities."""

    def __init__(self, n=4):
        super().__init__()
        self.n = n

    def forward(self, logits, ref):  # logits [B, T, V]
        logp = F.log_softmax(logits, -1)
        with torch.no_grad():
            top2 = logp.topk(2, -1)
            low = (top2.values[..., 0] - top2.values[..., 1]).argsort(-1)[:, :2]  # least confident frames
            hyps = top2.indices[..., 0][:, None].repeat(1, self.n, 1)  # [B, N, T]
            runner = top2.indices[..., 1]
            for k, frames in enumerate(([0], [1], [0, 1])):
                for f in frames:
                    at_ = low[:, f]
                    hyps[torch.arange(len(hyps)), k + 1, at_] = runner[torch.arange(len(hyps)), at_]
            errors = (hyps != ref[:, None]).sum(-1).float()
        seq_logp = logp[:, None].expand(-1, self.n, -1, -1).gather(-1, hyps[..., None])[..., 0].sum(-1)
        return seq_logp, errors


class MWERLoss(nn.Module):
    def __init__(self, stable=False):
        super().__init__()
        self.stable = stable

    def forward(self, seq_logp, errors):
        if self.stable:
            p = seq_logp.softmax(-1)
        else:
            p = torch.exp(seq_logp)
            p = p / p.sum(-1, keepdim=True)
        return (p * (errors - errors.mean(-1, keepdim=True))).sum(-1).mean()


class InterpolatedLoss(nn.Module):
    """MWER + lambda * CE, the paper's interpolation that keeps training stable."""

    def __init__(self, lam=0.01):
        super().__init__()
        self.lam = lam

    def forward(self, mwer, ce):
        return mwer.float() + self.lam * ce


class Recogniser(nn.Module):
    def __init__(self, feats=16, vocab=24, stable=False):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(feats, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.decoder = nn.Linear(64, vocab)
        self.nbest = NBest()
        self.mwer = MWERLoss(stable)
        self.interp = InterpolatedLoss()

    def forward(self, frames, ref):
        logits = self.decoder(self.encoder(frames))
        ce = F.cross_entropy(logits.float().flatten(0, 1), ref.flatten())
        return self.interp(self.mwer(*self.nbest(logits, ref)), ce)


_PHONES = randn(24, 16, seed=31)


def _utterances(i, long_at=5):
    g = torch.Generator().manual_seed(i if i >= 1000 else 100 + i % 4)  # the CE set; MWER's small fine-tuning set
    T = 500 if i == long_at else 24  # a 5 s sentence among 240 ms words
    ref = torch.randint(0, 24, (4, T), generator=g)
    return _PHONES[ref] + 0.9 * torch.randn(4, T, 16, generator=g), ref


@functools.lru_cache(1)
def _ce_stage():
    """The CE stage MWER starts from (fp32, 80 steps)."""
    torch.manual_seed(0)
    m = Recogniser()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for i in range(80):
        frames, ref = _utterances(1000 + i)
        loss = F.cross_entropy(m.decoder(m.encoder(frames)).flatten(0, 1), ref.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in m.state_dict().items()}


def _ce_trained_recogniser(stable=False):
    m = Recogniser(stable=stable)
    m.load_state_dict(_ce_stage())
    return m


def test_mwer_nbest_renormalised_through_exp_flushes_to_0_over_0_on_a_long_utterance_in_the_mwer_module():
    m = _ce_trained_recogniser()
    r = train_loop(m, _utterances, lambda o, *a: o, 7, lr=1e-3)
    real(r, "mwer", 5)
    rep = r["w"].report()
    at(rep, ("nan_origin", "underflow"), "mwer", step=5, phase="forward")
    no_error_at(rep, ("encoder", "decoder", "nbest", "interp", ""))


def test_healthy_twin_mwer_with_the_nbest_softmax_on_the_same_long_utterance_is_quiet():
    m = _ce_trained_recogniser(stable=True)
    r = train_loop(m, _utterances, lambda o, *a: o, 30, lr=1e-3)
    healthy(r)


# ======================================================================================================================
# 5. Deep Variational Information Bottleneck (Alemi et al. 2017) with the paper's std = softplus(rho - 5) and the KL to
#    N(0, I) written out, -log(std) included: a mis-scaled sample at step 4 drives rho below -12.4, fp16 softplus
#    flushes std to 0 and the KL is inf (the bottleneck; the decoder downstream still gets a finite z = mu)
# ======================================================================================================================
class VariationalBottleneck(nn.Module):
    def __init__(self, d_in, k=16):
        super().__init__()
        self.k = k
        self.stats = nn.Linear(d_in, 2 * k)

    def forward(self, h):
        s = self.stats(h)
        mu, std = s[:, : self.k], F.softplus(s[:, self.k:] - 5.0)
        z = mu + std * torch.randn_like(std)
        kl = 0.5 * (mu.pow(2) + std.pow(2) - 2 * torch.log(std) - 1).sum(-1).mean()
        return z, kl


class VIBClassifier(nn.Module):
    def __init__(self, d_in=24, classes=6, beta=1e-3):
        super().__init__()
        self.beta = beta
        self.encoder = nn.Sequential(nn.Linear(d_in, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.vib = VariationalBottleneck(128)
        self.decoder = nn.Linear(16, classes)

    def forward(self, x, y):
        z, kl = self.vib(self.encoder(x))
        return F.cross_entropy(self.decoder(z).float(), y) + self.beta * kl.float()


_VIB_W = randn(24, 6, seed=41)


def _vib_batch(i, outlier_at=4):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(64, 24, generator=g)
    y = (x @ _VIB_W).argmax(-1)
    if i == outlier_at:
        x[17] = x[17] * 100  # a record in cents, not dollars
    return x, y


def test_vib_std_softplus_flushes_to_0_in_fp16_and_the_kl_log_std_is_inf_in_the_bottleneck():
    torch.manual_seed(0)
    m = VIBClassifier()
    r = train_loop(m, _vib_batch, lambda o, *a: o, 7)
    real(r, "vib", 4)
    rep = r["w"].report()
    at(rep, ("overflow", "underflow"), "vib", step=4, phase="forward")
    no_error_at(rep, ("encoder", "vib.stats", "decoder", ""))


# ======================================================================================================================
# 6. a Mixture-of-Softmaxes output layer (Yang et al. 2018) scoring the target as the MoS code does, log(prob + 1e-8),
#    with the decoder bias initialised to the log unigram frequencies: a token seen once in 2e9 has p ~ 5e-10, fp16
#    holds neither that nor the 1e-8, and the first time it is a target (step 4) log(0) = -inf in the MoS layer
# ======================================================================================================================
class MixtureOfSoftmaxes(nn.Module):
    def __init__(self, d, vocab, log_unigram, experts=4):
        super().__init__()
        self.d, self.experts = d, experts
        self.prior = nn.Linear(d, experts, bias=False)
        self.latent = nn.Sequential(nn.Linear(d, experts * d), nn.Tanh())
        self.decoder = nn.Linear(d, vocab)
        with torch.no_grad():
            self.decoder.bias.copy_(log_unigram)

    def forward(self, h, target):  # h [N, d], target [N] -> log p(target)
        prior = F.softmax(self.prior(h), -1)  # [N, K]
        logit = self.decoder(self.latent(h).view(-1, self.experts, self.d))  # [N, K, V]
        prob = F.softmax(logit, -1).gather(-1, target[:, None, None].expand(-1, self.experts, 1))[..., 0]
        prob = (prob * prior).sum(-1)
        return torch.log(prob + 1e-8)


class MaskedNLL(nn.Module):
    def __init__(self, pad=0):
        super().__init__()
        self.pad = pad

    def forward(self, logp, target):
        mask = (target != self.pad).float()
        return -(logp.float() * mask).sum() / mask.sum()


_ZIPF = 1.0 / torch.arange(1, 497, dtype=torch.float64)  # tokens 1..496 by frequency rank


def _log_unigram(vocab=500):
    p = torch.full((vocab,), 5e-10, dtype=torch.float64)  # <pad> (0) and 497-499: seen once in a 2e9-token corpus
    p[1:497] = _ZIPF / _ZIPF.sum() * (1 - 4 * 5e-10)
    return p.log().float()


class MoSLM(nn.Module):
    def __init__(self, vocab=500, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.context = nn.Sequential(nn.Linear(2 * d, d), nn.Tanh())  # a bigram-context encoder
        self.mos = MixtureOfSoftmaxes(d, vocab, _log_unigram(vocab))
        self.criterion = MaskedNLL()

    def forward(self, idx):  # [B, T + 2]
        e = self.embed(idx[:, :-1])
        h = self.context(torch.cat([e[:, :-1], e[:, 1:]], -1)).flatten(0, 1)
        target = idx[:, 2:].flatten()
        return self.criterion(self.mos(h, target), target)


def _tokens(i, rare_at=4):
    g = torch.Generator().manual_seed(i)
    idx = 1 + torch.multinomial(_ZIPF, 8 * 18, replacement=True, generator=g).view(8, 18)
    if i == rare_at:
        idx[3, 9] = 498  # a once-in-the-corpus token
    return (idx,)


def test_mixture_of_softmaxes_log_prob_plus_1e_8_vanishes_in_fp16_on_a_rare_target_in_the_mos_layer():
    torch.manual_seed(0)
    m = MoSLM()
    r = train_loop(m, _tokens, lambda o, *a: o, 7)
    real(r, "mos", 4)
    rep = r["w"].report()
    at(rep, ("eps_underflow", "overflow"), "mos", step=4, phase="forward")
    no_error_at(rep, ("embed", "context", "mos.decoder", "mos.latent", "criterion", ""))


# ======================================================================================================================
# 7. Asymmetric Loss (Ridnik et al. 2021) for multi-label land-cover tagging of satellite tiles, the authors' code:
#    log(sigmoid(x).clamp(min=1e-8)) with the label mask multiplied after; a cloud-saturated 8-bit quicklook fed
#    unnormalised at step 4 drives a logit below -17.4, the fp16 sigmoid is exactly 0, the 1e-8 clamp bound is 0 in
#    fp16 as well, and 0 * log(0) = NaN (or log(0) = -inf on a positive) in the loss module
# ======================================================================================================================
class AsymmetricLoss(nn.Module):
    def __init__(self, gamma_neg=4, gamma_pos=1, clip=0.05, eps=1e-8, fp32=False):
        super().__init__()
        self.gamma_neg, self.gamma_pos, self.clip, self.eps, self.fp32 = gamma_neg, gamma_pos, clip, eps, fp32

    def forward(self, x, y):
        if self.fp32:
            x = x.float()
        x_sigmoid = torch.sigmoid(x)
        xs_pos = x_sigmoid
        xs_neg = 1 - x_sigmoid
        if self.clip is not None and self.clip > 0:
            xs_neg = (xs_neg + self.clip).clamp(max=1)
        los_pos = y * torch.log(xs_pos.clamp(min=self.eps))
        los_neg = (1 - y) * torch.log(xs_neg.clamp(min=self.eps))
        loss = los_pos + los_neg
        with torch.no_grad():  # disable_torch_grad_focal_loss=True
            pt = xs_pos * y + xs_neg * (1 - y)
            one_sided_w = torch.pow(1 - pt, self.gamma_pos * y + self.gamma_neg * (1 - y))
        loss = loss * one_sided_w
        return -loss.sum() / x.shape[0]


class Tagger(nn.Module):
    def __init__(self, bands=12, tags=12, fp32_loss=False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(bands, 16, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(32, tags)
        self.criterion = AsymmetricLoss(fp32=fp32_loss)

    def forward(self, img, y):
        return self.criterion(self.head(self.pool(self.stem(img)).flatten(1)), y)


_TAG_LOOKS = randn(12, 12, 1, 1, seed=51) + 0.3 * randn(12, 12, 16, 16, seed=52)  # each land cover's spectrum


def _tiles(i, raw_at=4):
    g = torch.Generator().manual_seed(i)
    y = (torch.rand(16, 12, generator=g) < 0.2).float()
    img = torch.einsum("bt,tchw->bchw", y, _TAG_LOOKS) + 0.5 * torch.randn(16, 12, 16, 16, generator=g)
    if i == raw_at:
        img[5] = 250 + 5 * torch.rand(12, 16, 16, generator=g)  # a cloud-saturated 8-bit quicklook, not normalised
    return img, y


def test_asymmetric_loss_clamp_min_1e_8_vanishes_in_fp16_and_0_times_log_0_is_nan_in_the_loss_module():
    torch.manual_seed(0)
    m = Tagger()
    r = train_loop(m, _tiles, lambda o, *a: o, 7)
    real(r, "criterion", 4)
    rep = r["w"].report()
    at(rep, ("eps_underflow", "nan_origin"), "criterion", step=4, phase="forward")
    no_error_at(rep, ("stem", "pool", "head", ""))


def test_healthy_twin_asymmetric_loss_in_fp32_on_the_same_cloud_saturated_tile_is_quiet():
    torch.manual_seed(0)
    m = Tagger(fp32_loss=True)
    r = train_loop(m, _tiles, lambda o, *a: o, 30, lr=1e-2)
    healthy(r)


# ======================================================================================================================
# 8. DeepSurv's Cox partial likelihood as its PyTorch port writes it: exp(risk) * risk-set mask, summed, then log; a
#    patient whose creatinine was entered in umol/L instead of mg/dL (x88) at step 4 gets risk > 11.09, exp(risk) is
#    inf in fp16 and inf * 0 (outside the risk set) = NaN in the Cox loss module (a logsumexp per risk set is the fix;
#    subtracting the batch max alone is not enough in fp16: the risk sets without that patient flush to 0, log 0)
# ======================================================================================================================
class CoxPartialLikelihood(nn.Module):
    def __init__(self, stable=False):
        super().__init__()
        self.stable = stable

    def forward(self, risk_pred, y, e):  # risk [N, 1], time y [N, 1], event e [N, 1]
        mask = torch.ones(y.shape[0], y.shape[0])
        mask[(y.T - y) > 0] = 0
        if self.stable:  # a logsumexp per risk set (subtracting only the batch max still flushes in fp16)
            scores = risk_pred.expand(-1, y.shape[0]).masked_fill(mask == 0, float("-inf"))
            log_loss = torch.logsumexp(scores, dim=0) - torch.log(torch.sum(mask, dim=0))
        else:
            log_loss = torch.exp(risk_pred) * mask
            log_loss = torch.sum(log_loss, dim=0) / torch.sum(mask, dim=0)
            log_loss = torch.log(log_loss)
        return -torch.sum((risk_pred - log_loss.reshape(-1, 1)) * e) / torch.sum(e)


class DeepSurv(nn.Module):
    def __init__(self, d_in=12, stable=False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, 64), nn.SELU(), nn.Linear(64, 64), nn.SELU())
        self.risk = nn.Linear(64, 1)
        self.criterion = CoxPartialLikelihood(stable)

    def forward(self, x, t, e):
        return self.criterion(self.risk(self.net(x)), t, e)


_HAZARD_W = randn(12, seed=61) * 0.5


def _patients(i, units_at=4):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(64, 12, generator=g)  # standardised covariates; column 10 is serum creatinine (1.0 +- 0.3 mg/dL)
    t = -torch.log(torch.rand(64, generator=g)) / torch.exp(x @ _HAZARD_W)  # exponential survival times
    e = (torch.rand(64, generator=g) < 0.7).float()
    if i == units_at:
        x[21, 10] = (133.0 - 1.0) / 0.3  # 1.5 mg/dL entered as 133 umol/L, then standardised as mg/dL
    return x, t[:, None], e[:, None]


def test_deepsurv_cox_loss_exp_of_a_mis_entered_patients_risk_overflows_in_the_loss_module():
    torch.manual_seed(0)
    m = DeepSurv()
    r = train_loop(m, _patients, lambda o, *a: o, 7)
    real(r, "criterion", 4)
    rep = r["w"].report()
    at(rep, ("overflow", "nan_origin"), "criterion", step=4, phase="forward")
    no_error_at(rep, ("net", "risk", ""))


def test_healthy_twin_deepsurv_cox_loss_with_a_logsumexp_per_risk_set_on_the_same_patient_is_quiet():
    torch.manual_seed(0)
    m = DeepSurv(stable=True)
    r = train_loop(m, _patients, lambda o, *a: o, 30, lr=3e-3)
    healthy(r)


# ======================================================================================================================
# 9. a neural HMM for activity recognition whose likelihood is Rabiner's scaled forward recursion in probability space:
#    b = exp(emission log-likelihoods), alpha_t = (alpha_{t-1} A) * b_t / c_t; an accelerometer spike (a dropped phone)
#    at step 3 is a frame more than 17 nats from every state, every fp16 b_t is 0, c_t = 0 and alpha = 0 / 0 (the
#    HMM module; the emission network upstream only gave finite log-likelihoods of about -66)
# ======================================================================================================================
class GaussianEmissions(nn.Module):
    def __init__(self, d_in, states=6, d=8):
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.means = nn.Parameter(torch.randn(states, d))

    def forward(self, x):  # [B, T, d_in] -> log N(proj(x); mu_k, I) up to a constant, [B, T, K]
        h = self.proj(x)
        return -0.5 * (h[..., None, :] - self.means.to(h.dtype)).pow(2).sum(-1)


class ScaledForwardHMM(nn.Module):
    def __init__(self, states=6):
        super().__init__()
        self.logits_A = nn.Parameter(torch.eye(states) * 2.0)
        self.logits_pi = nn.Parameter(torch.zeros(states))

    def forward(self, log_b):
        A = self.logits_A.softmax(-1).to(log_b.dtype)
        b = torch.exp(log_b)
        alpha = self.logits_pi.softmax(-1).to(log_b.dtype) * b[:, 0]
        c = alpha.sum(-1, keepdim=True)
        alpha, loglik = alpha / c, torch.log(c)
        for t in range(1, b.shape[1]):
            alpha = (alpha @ A) * b[:, t]
            c = alpha.sum(-1, keepdim=True)
            alpha, loglik = alpha / c, loglik + torch.log(c)
        return loglik[:, 0]


class ActivityHMM(nn.Module):
    def __init__(self, d_in=6):
        super().__init__()
        self.frontend = nn.Sequential(nn.Linear(d_in, 32), nn.ReLU(), nn.Linear(32, 32))
        self.emissions = GaussianEmissions(32)
        self.hmm = ScaledForwardHMM()

    def forward(self, x):
        return -self.hmm(self.emissions(self.frontend(x))).float().mean() / x.shape[1]


def _imu(i, drop_at=3):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 20, 6, generator=g) * 0.5
    if i == drop_at:
        x[2, 11] = 40.0  # the phone hit the floor: a saturated accelerometer frame
    return (x,)


def test_scaled_forward_hmm_in_probability_space_is_0_over_0_on_a_frame_far_from_every_state_in_the_hmm():
    torch.manual_seed(0)
    m = ActivityHMM()
    r = train_loop(m, _imu, lambda o, *a: o, 6)
    real(r, "hmm", 3)
    rep = r["w"].report()
    at(rep, ("nan_origin", "underflow"), "hmm", step=3, phase="forward")
    no_error_at(rep, ("frontend", "emissions", "emissions.proj", ""))


# ======================================================================================================================
# 10. AdaIN style transfer (Huang & Belongie 2017) with the reference implementation's calc_mean_std, feat.var() + 1e-5
#     on the frozen VGG-style encoder's relu2_1 (caffe-scaled: 0-255 inputs, mean subtracted); a black-and-white op-art
#     style image at step 4 has channel variances past 65504, fp16 var is inf and AdaIN's output is inf / NaN (the
#     AdaIN module, not the frozen encoder before it or the decoder after it)
# ======================================================================================================================
def calc_mean_std(feat, eps=1e-5):
    N, C = feat.shape[:2]
    feat_var = feat.reshape(N, C, -1).var(dim=2) + eps
    feat_std = feat_var.sqrt().view(N, C, 1, 1)
    feat_mean = feat.reshape(N, C, -1).mean(dim=2).view(N, C, 1, 1)
    return feat_mean, feat_std


class AdaIN(nn.Module):
    def forward(self, content_feat, style_feat):
        style_mean, style_std = calc_mean_std(style_feat)
        content_mean, content_std = calc_mean_std(content_feat)
        return (content_feat - content_mean) / content_std * style_std + style_mean


class CaffeVGGStem(nn.Module):
    """relu1_1 -> relu2_1 of a VGG that takes 0-255 BGR minus the ImageNet mean (frozen, 'pretrained' gains)."""

    def __init__(self, gain=3.5):
        super().__init__()
        self.register_buffer("mean", torch.tensor([103.9, 116.8, 123.7]).view(1, 3, 1, 1))
        self.enc_1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.enc_2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())
        with torch.no_grad():
            for c in (self.enc_1[0], self.enc_2[1]):
                c.weight.mul_(gain)
        self.requires_grad_(False)

    def forward(self, img):  # img in [0, 1]
        h1 = self.enc_1(img.flip(1) * 255 - self.mean)
        return h1, self.enc_2(h1)


class StyleTransferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = CaffeVGGStem()
        self.adain = AdaIN()
        self.decoder = nn.Sequential(nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(), nn.Upsample(scale_factor=2),
                                     nn.Conv2d(16, 3, 3, padding=1))

    def forward(self, content, style):
        s1, s2 = self.encoder(style)
        t = self.adain(self.encoder(content)[1], s2)
        g1, g2 = self.encoder(self.decoder(t / 255))
        loss_c = F.mse_loss(g2, t)
        loss_s = sum(F.mse_loss(a, b) for x, y in ((g1, s1), (g2, s2))
                     for a, b in zip(calc_mean_std(x), calc_mean_std(y)))
        return (loss_c + 10 * loss_s) / 1e5


def _paintings(i, op_art_at=4):
    g = torch.Generator().manual_seed(i)
    def smooth(n):
        return F.interpolate(torch.rand(n, 3, 4, 4, generator=g), size=16, mode="bilinear", align_corners=False)
    content = 0.2 + 0.6 * smooth(4)  # photos
    style = 0.3 + 0.4 * smooth(4)  # paintings: moderate contrast
    if i == op_art_at:
        checks = (torch.arange(16)[None, :, None] // 2 + torch.arange(16)[None, None, :] // 2) % 2
        style[1] = checks.float()  # a black-and-white Vasarely
    return content, style


def test_adain_calc_mean_std_variance_of_an_op_art_style_overflows_in_the_adain_module():
    torch.manual_seed(0)
    m = StyleTransferNet()
    r = train_loop(m, _paintings, lambda o, *a: o, 7)
    real(r, "adain", 4)
    rep = r["w"].report()
    at(rep, ("overflow",), "adain", step=4, phase="forward")
    no_error_at(rep, ("encoder", "encoder.enc_2", "decoder", "decoder.0", ""))


# ======================================================================================================================
# 11. DINOv2's KoLeo regulariser as DINOv2 writes it: F.normalize(eps=1e-8), nearest neighbour by the max dot product,
#     nn.PairwiseDistance(eps=1e-8), -log(d + 1e-8), under autocast(enabled=False) (torch.cuda.amp there), which leaves
#     the fp16 head output in fp16; on a descriptor-spreading network (Sablayrolles et al. 2019) an exact duplicate
#     descriptor in the step-4 batch has distance 0, both 1e-8 guards are 0 in fp16 and log(0) = -inf (the KoLeo
#     module)
# ======================================================================================================================
class KoLeoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=1e-8)

    def pairwise_NNs_inner(self, x):
        dots = torch.mm(x, x.t())
        n = x.shape[0]
        dots.view(-1)[:: (n + 1)].fill_(-1)  # the diagonal
        _, I = torch.max(dots, dim=1)
        return I

    def forward(self, student_output, eps=1e-8):
        with torch.autocast("cpu", enabled=False):
            student_output = F.normalize(student_output, eps=eps, p=2, dim=-1)
            I = self.pairwise_NNs_inner(student_output)
            distances = self.pdist(student_output, student_output[I])
            loss = -torch.log(distances + eps).mean()
        return loss


class TripletRank(nn.Module):
    def __init__(self, margin=0.1):
        super().__init__()
        self.margin = margin

    def forward(self, a, p, n):
        return F.triplet_margin_loss(F.normalize(a.float(), dim=-1), F.normalize(p.float(), dim=-1),
                                     F.normalize(n.float(), dim=-1), margin=self.margin)


class Catalyzer(nn.Module):
    def __init__(self, d_in=32, d_out=16, lam=0.05):
        super().__init__()
        self.lam = lam
        self.net = nn.Sequential(nn.Linear(d_in, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, d_out))
        self.koleo = KoLeoLoss()
        self.rank = TripletRank()

    def forward(self, x, pos, neg):
        a = self.net(x)
        return self.rank(a, self.net(pos), self.net(neg)) + self.lam * self.koleo(a)


def _descriptors(i, dup_at=4):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(64, 32, generator=g)
    if i == dup_at:
        x[37] = x[12]  # the same image twice in the base set: an exact duplicate descriptor
    pos = x + 0.1 * torch.randn(64, 32, generator=g)  # its true nearest neighbour
    return x, pos, torch.randn(64, 32, generator=g)


@functools.lru_cache(1)
def _koleo_run():
    torch.manual_seed(0)
    r = train_loop(Catalyzer(), _descriptors, lambda o, *a: o, 7)
    return r, r["w"].report()


def test_koleo_of_an_exact_duplicate_descriptor_is_log_0_with_both_1e_8_guards_vanished_in_the_koleo_module():
    r, rep = _koleo_run()
    real(r, "koleo", 4)
    at(rep, ("eps_underflow", "overflow"), "koleo", step=4, phase="forward")
    no_error_at(rep, ("net", "net.4", "rank", ""))


def test_koleo_eps_finding_names_the_log_guard_not_the_diagonal_fill_of_minus_1():
    r, rep = _koleo_run()
    real(r, "koleo", 4)
    assert not [f for f in rep.findings if f.rule == "eps_underflow" and f.op == "aten::fill_"], lines(rep)
    f = next((f for f in rep.findings if f.rule == "eps_underflow" and f.module == "koleo"), None)
    assert f is not None and f.op == "aten::add" and f.evidence.get("value") == 1e-8, lines(rep)


# ======================================================================================================================
# 12. energy-bounded outlier exposure (Liu et al. 2020), the authors' fine-tuning loss: CE + 0.1 * (relu(E_in - m_in)^2
#     + relu(m_out - E_out)^2) with E = -logsumexp(logits), m_in = -25, m_out = -7; an auxiliary outlier image that
#     skipped the normalisation at step 4 gets logits in the thousands from the CE-trained classifier, E_out ~ -1270
#     and (m_out - E_out)^2 > 65504 in fp16 (the energy regulariser, not the classifier whose logits were finite)
# ======================================================================================================================
class EnergyMarginLoss(nn.Module):
    def __init__(self, m_in=-25.0, m_out=-7.0):
        super().__init__()
        self.m_in, self.m_out = m_in, m_out

    def forward(self, logits_in, logits_out):
        Ec_out = -torch.logsumexp(logits_out, dim=1)
        Ec_in = -torch.logsumexp(logits_in, dim=1)
        return torch.pow(F.relu(Ec_in - self.m_in), 2).mean() + torch.pow(F.relu(self.m_out - Ec_out), 2).mean()


class OEClassifier(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(32, classes)
        self.energy = EnergyMarginLoss()

    def forward(self, x_in, y, x_out):
        logits = self.fc(self.features(torch.cat([x_in, x_out])))
        n = x_in.shape[0]
        return F.cross_entropy(logits[:n].float(), y) + 0.1 * self.energy(logits[:n], logits[n:]).float()


_CLASS_LOOKS = randn(10, 3, 1, 1, seed=71)


def _oe_batch(i, raw_at=4):
    g = torch.Generator().manual_seed(i)
    y = torch.randint(0, 10, (16,), generator=g)
    x_in = _CLASS_LOOKS[y] + torch.randn(16, 3, 16, 16, generator=g)
    x_out = torch.randn(16, 3, 16, 16, generator=g) * 1.5  # the auxiliary outlier set, normalised
    if i == raw_at:
        x_out[9] = torch.rand(3, 16, 16, generator=g) * 255  # one outlier image loaded as raw 0-255 pixels
    return x_in, y, x_out


@functools.lru_cache(1)
def _pretrained_classifier():
    """The classifier OE fine-tunes (fp32 CE, 60 steps)."""
    torch.manual_seed(0)
    m = OEClassifier()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for i in range(60):
        x_in, y, _ = _oe_batch(1000 + i)
        loss = F.cross_entropy(m.fc(m.features(x_in)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in m.state_dict().items()}


@functools.lru_cache(1)
def _energy_run():
    m = OEClassifier()
    m.load_state_dict(_pretrained_classifier())
    r = train_loop(m, _oe_batch, lambda o, *a: o, 7, lr=1e-4)
    return r, r["w"].report()


def test_energy_margin_of_a_raw_pixel_outlier_image_overflows_its_square_in_the_energy_regulariser():
    r, rep = _energy_run()
    real(r, "energy", 4)
    at(rep, ("overflow",), "energy", step=4, phase="forward")
    no_error_at(rep, ("features", "features.3", "fc", ""))


def test_energy_margin_square_overflow_is_not_blamed_on_underflowed_zeros():
    r, rep = _energy_run()
    real(r, "energy", 4)
    bad = [f.one_line() for f in rep.findings if f.rule == "underflow" and f.module == "energy"]
    assert not bad, lines(rep)
