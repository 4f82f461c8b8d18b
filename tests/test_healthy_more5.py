"""Healthy runs that must raise no warning and no error (shared/CONTRACT.md), beyond tests/test_healthy*.py:
torchvision-style BasicBlocks (`ReLU(inplace=True)`, `out += identity`) under param groups without weight decay on
norms/biases and a warmup -> cosine SequentialLR; MobileNetV2 inverted residuals (ReLU6/Hardswish in place,
depthwise convs, squeeze-excitation); in-place activations by function (`F.relu_`, `F.silu(inplace=True)`,
`mul_`); an autoencoder whose decoder is tied by hand to the encoder's transposed weight; a frozen backbone in
eval mode with only a head in the optimizer; WGAN-style weight clamping and max-norm renormalisation under
`torch.no_grad()` after every step; the PyTorch AMP recipe for a gradient penalty (create_graph through scaled
outputs); gradient accumulation with `zero_grad(set_to_none=False)` and a ragged last window; `inference_mode`
validation between steps; a `.float()` head under `autocast(enabled=False)`; an fp32 LSTM behind an fp16 conv front
end; `nn.Embedding(max_norm=1)`; `nn.MultiheadAttention` / `nn.TransformerEncoder` with key padding masks;
`checkpoint(use_reentrant=False)` and `checkpoint_sequential`; spectral norm; knowledge distillation with
KL(T=4); mixup soft targets; a triplet loss reaching 0; an nn.Softmax sharpening to zeros; an fp32 head
outside autocast whose output passes fp16's max; dict outputs with int/bool/None entries; -inf action masking in the
output (was a false alarm: an output holding -inf only counted as non-finite). fp16 autocast on the CPU with GradScaler("cpu"), at the default sampling and at
every=1, through w.report() and ampdoctor.diagnose(run_dir); each run is asserted healthy (finite, loss falling,
few backoffs)."""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import alarms, assert_healthy, gen, one_thread  # noqa: E402


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

EVERY = pytest.mark.parametrize("every", [None, 1])


def run(model, batch, loss_fn, tmp_path, *, steps=40, every=None, opt=None, sched=None, clip=1.0, accum=1,
        set_to_none=True, after_step=None, between=None, max_backoffs=3, must_fall=0.9, window=8, params=None):
    """zero_grad -> fp16 autocast forward -> scale(loss / accum).backward (x accum) -> unscale_ -> clip -> step ->
    update (-> sched.step, after_step(), between(i)) under a watch with a run_dir; asserts the run was healthy;
    returns (w.report(), diagnose(run_dir))."""
    torch.manual_seed(0)
    opt = opt(model) if callable(opt) else (opt or torch.optim.AdamW(model.parameters(), lr=1e-3))
    sched = sched(opt) if sched else None
    sc = torch.amp.GradScaler("cpu")
    rd = tmp_path / "run"
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=rd, **({} if every is None else {"every": every}))
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    losses, scales = [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        n = accum(i) if callable(accum) else accum
        tot = 0.0
        for j in range(n):
            args = batch(i * 7 + j)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model, *args)
            sc.scale(loss / n).backward()
            tot += loss.item() / n
        sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        sc.step(opt)
        sc.update()
        if sched:
            sched.step()
        if after_step:
            with torch.no_grad():
                after_step()
        if between:
            between(i)
        losses.append(tot)
        scales.append(sc.get_scale())
    w.close()
    assert_healthy(losses, scales, steps, window, must_fall, max_backoffs)
    return w.report(), ampdoctor.diagnose(rd)


def quiet(reps):
    for rep in reps:
        assert alarms(rep.findings) == [], [f.one_line() for f in rep.findings]


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def images(i, bs=16, c=3, hw=8, k=4):
    """Class k's images carry a bright blob in quadrant k: easy to learn in a few dozen steps."""
    g = gen(i)
    y = torch.randint(0, k, (bs,), generator=g)
    x = 0.5 * torch.randn(bs, c, hw, hw, generator=g)
    h = hw // 2
    for b in range(bs):
        r, s = divmod(int(y[b]), 2)
        x[b, :, r * h:(r + 1) * h, s * h:(s + 1) * h] += 1.5
    return x, y


def vectors(i, bs=32, d=20, k=4, seed=7):
    wt = torch.randn(d, k, generator=gen(seed))
    x = torch.randn(bs, d, generator=gen(i))
    return x, (x @ wt).argmax(1)


def no_decay_groups(model, lr=1e-3, wd=5e-2):
    """The usual split: weight decay on conv/linear weights only, none on biases and norm parameters."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim <= 1]
    return [{"params": decay, "weight_decay": wd, "lr": lr}, {"params": rest, "weight_decay": 0.0, "lr": 2 * lr}]


def warmup_cosine(opt, warm=5, total=40):
    return torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warm),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm)], milestones=[warm])


# --- torchvision-style ResNet ---------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNetTV(nn.Module):
    """torchvision's ResNet layout at toy width: stem conv/bn/relu(inplace)/maxpool, two stages of BasicBlocks
    (one shared ReLU module called twice per block), zero-init of each block's last BN gamma."""

    def __init__(self, k=4, w=8, zero_init_residual=True):
        super().__init__()
        self.conv1 = nn.Conv2d(3, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(w, w), BasicBlock(w, w))
        ds = nn.Sequential(nn.Conv2d(w, 2 * w, 1, 2, bias=False), nn.BatchNorm2d(2 * w))
        self.layer2 = nn.Sequential(BasicBlock(w, 2 * w, 2, ds), BasicBlock(2 * w, 2 * w))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * w, k)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@EVERY
def test_torchvision_resnet_inplace_relu_out_plus_identity_param_groups_warmup_cosine(every, tmp_path):
    m = ResNetTV()
    quiet(run(m, images, ce, tmp_path, steps=30, every=every,
              opt=lambda m: torch.optim.SGD(no_decay_groups(m, lr=0.05, wd=5e-4), momentum=0.9, nesterov=True),
              sched=lambda o: warmup_cosine(o, 4, 30)))


# --- MobileNetV2 inverted residual + SE ----------------------------------------------------------------------

class SE(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // r, 1), nn.Conv2d(c // r, c, 1)
        self.act, self.gate = nn.ReLU(inplace=True), nn.Hardsigmoid(inplace=True)

    def forward(self, x):
        s = self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return x * s


class InvRes(nn.Module):
    def __init__(self, c, t=4, act=nn.ReLU6):
        super().__init__()
        h = c * t
        self.conv = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), act(inplace=True),
                                  nn.Conv2d(h, h, 3, 1, 1, groups=h, bias=False), nn.BatchNorm2d(h), act(inplace=True),
                                  SE(h), nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.conv(x)


class MobileNetish(nn.Module):
    def __init__(self, k=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(inplace=True))
        self.blocks = nn.Sequential(InvRes(16), InvRes(16, act=nn.Hardswish), InvRes(16))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(16, k))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


@EVERY
def test_mobilenetv2_inverted_residual_relu6_hardswish_inplace_depthwise_se(every, tmp_path):
    quiet(run(MobileNetish(), lambda i: images(i, bs=12), ce, tmp_path, steps=30, every=every,
              opt=lambda m: torch.optim.AdamW(no_decay_groups(m, lr=3e-3), lr=3e-3)))


# --- in-place activations by function -------------------------------------------------------------------------

class InplaceMLP(nn.Module):
    def __init__(self, d=20, h=64, k=4):
        super().__init__()
        self.l1, self.l2, self.l3, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, k)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        h = F.relu_(self.l1(x))
        h = self.act(self.l2(h))
        r = F.silu(self.l3(h), inplace=True)
        r.mul_(0.5)
        h = h + r
        return self.out(F.leaky_relu_(h, 0.1))


@EVERY
def test_inplace_activations_relu_silu_leaky_and_mul_add_inplace(every, tmp_path):
    quiet(run(InplaceMLP(), vectors, ce, tmp_path, steps=40, every=every))


# --- weight tying by hand ------------------------------------------------------------------------------------

class TiedAE(nn.Module):
    """Decoder weights are the encoder's, transposed, by hand (F.linear(h, enc.weight.t())); its own bias."""

    def __init__(self, d=32, h=8):
        super().__init__()
        self.enc = nn.Linear(d, h)
        self.dec_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t(), self.dec_bias)


class TiedLM(nn.Module):
    def __init__(self, V=40, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.mix = nn.Sequential(nn.Linear(2 * d, d), nn.GELU(), nn.LayerNorm(d))
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        e = self.emb(idx)
        prev = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], 1)
        return self.head(self.mix(torch.cat([e, prev], -1)))


@EVERY
def test_hand_tied_autoencoder_and_lm(every, tmp_path):
    basis = torch.randn(8, 32, generator=gen(3))

    def ae_batch(i):
        return (torch.randn(64, 8, generator=gen(i)) @ basis,)
    quiet(run(TiedAE(), ae_batch, lambda m, x: F.mse_loss(m(x).float(), x), tmp_path / "ae", steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)))

    def lm_batch(i):
        start = torch.randint(0, 40, (16, 1), generator=gen(i))
        idx = (start + 3 * torch.arange(12)) % 40
        return idx, idx

    def lm_loss(m, idx, _):
        return F.cross_entropy(m(idx)[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())
    quiet(run(TiedLM(), lm_batch, lm_loss, tmp_path / "lm", steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)))


# --- frozen backbone ----------------------------------------------------------------------------------------

@EVERY
def test_frozen_backbone_in_eval_with_trainable_head_only_in_the_optimizer(every, tmp_path):
    torch.manual_seed(1)
    backbone = ResNetTV(zero_init_residual=False)
    backbone.fc = nn.Identity()
    m = nn.Sequential()
    m.add_module("backbone", backbone)
    m.add_module("head", nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 4)))
    m.backbone.requires_grad_(False)

    def between(i):
        m.backbone.eval()   # BN statistics frozen too, as in linear probing
    m.backbone.eval()
    quiet(run(m, images, ce, tmp_path, steps=60, every=every, between=between,
              opt=lambda m: torch.optim.AdamW(m.head.parameters(), lr=1e-2)))


# --- constraints applied under no_grad after every step ----------------------------------------------------

@EVERY
def test_weight_clamp_and_max_norm_renorm_after_each_step(every, tmp_path):
    m = nn.Sequential(nn.Linear(20, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 4))

    def constrain():
        m[0].weight.clamp_(-0.3, 0.3)                                    # WGAN-style clamp
        m[2].weight.copy_(torch.renorm(m[2].weight, 2, 0, 1.0))          # max-norm per output unit
        m[4].weight.div_(m[4].weight.norm(dim=1, keepdim=True).clamp(min=1.0))
    quiet(run(m, vectors, ce, tmp_path, steps=40, every=every, after_step=constrain,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


@EVERY
def test_gradient_penalty_the_amp_recipe(every, tmp_path):
    """PyTorch's AMP examples: grads of scaled outputs with create_graph, unscaled by hand, penalty in autocast."""
    m = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    rd = tmp_path / "run"
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=rd, **({} if every is None else {"every": every}))
    losses = []
    for i in range(40):
        opt.zero_grad()
        x, y = vectors(i)
        x.requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
            loss = F.cross_entropy(out, y)
        grads = torch.autograd.grad(sc.scale(loss), [x], create_graph=True)
        inv = 1.0 / sc.get_scale()
        g = grads[0] * inv
        with torch.autocast("cpu", dtype=torch.float16):
            penalty = g.float().pow(2).sum(1).mean()
            total = loss + 0.1 * penalty
        sc.scale(total).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    w.close()
    assert all(map(math.isfinite, losses)) and sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
    quiet([w.report(), ampdoctor.diagnose(rd)])


# --- accumulation -------------------------------------------------------------------------------------------

@EVERY
def test_accumulation_set_to_none_false_ragged_windows(every, tmp_path):
    m = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.3),
                      nn.Linear(64, 4))
    quiet(run(m, lambda i: vectors(i, bs=8), ce, tmp_path, steps=40, every=every, set_to_none=False,
              accum=lambda i: 1 + i % 4, opt=lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3)))


# --- validation between steps -------------------------------------------------------------------------------

@EVERY
def test_inference_mode_and_no_grad_autocast_validation_between_steps(every, tmp_path):
    m = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
    xv, yv = vectors(999, bs=64)
    vals = []

    def validate(i):
        if i % 3:
            return
        m.eval()
        ctx = torch.inference_mode() if i % 2 else torch.no_grad()
        with ctx, torch.autocast("cpu", dtype=torch.float16):
            vals.append(F.cross_entropy(m(xv), yv).item())
        m.train()
    quiet(run(m, vectors, ce, tmp_path, steps=40, every=every, between=validate,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))
    assert vals[-1] < vals[0]


# --- fp32 islands ---------------------------------------------------------------------------------------------

class Fp32Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4).float()

    def forward(self, x):
        h = self.body(x)
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float())


class ConvLSTM(nn.Module):
    """fp16 conv front end, fp32 LSTM (autocast off, input upcast) over its frames, fp16 linear head."""

    def __init__(self, k=4):
        super().__init__()
        self.front = nn.Sequential(nn.Conv1d(1, 16, 5, padding=2), nn.BatchNorm1d(16), nn.ReLU(inplace=True),
                                   nn.Conv1d(16, 16, 4, stride=4), nn.ReLU(inplace=True))
        self.rnn = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, k)

    def forward(self, x):
        f = self.front(x).transpose(1, 2)
        with torch.autocast("cpu", enabled=False):
            _, (h, _) = self.rnn(f.float())
        return self.head(h[-1])


def tones(i, k=4):
    g = gen(i)
    y = torch.randint(0, k, (16,), generator=g)
    t = torch.arange(64).float() / 64
    return (torch.sin(2 * math.pi * (y[:, None] + 1) * 2 * t)[:, None]
            + 0.3 * torch.randn(16, 1, 64, generator=g)), y


@EVERY
def test_fp32_islands_float_head_and_lstm_behind_fp16_convs(every, tmp_path):
    quiet(run(Fp32Head(), vectors, ce, tmp_path / "head", steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))
    quiet(run(ConvLSTM(), tones, ce, tmp_path / "lstm", steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3)))


# --- embeddings and attention -------------------------------------------------------------------------------

class MaxNormBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(60, 32, max_norm=1.0, padding_idx=0)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True, dropout=0.1)
        self.ln = nn.LayerNorm(32)
        self.out = nn.Linear(32, 2)

    def forward(self, ids):
        pad = ids == 0
        e = self.emb(ids) * 4
        a, _ = self.attn(e, e, e, key_padding_mask=pad, need_weights=False)
        h = self.ln(e + a).masked_fill(pad[..., None], 0)
        return self.out(h.sum(1) / (~pad).sum(1, keepdim=True).clamp(min=1))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(60, 32, padding_idx=0)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(32, 2)

    def forward(self, ids):
        pad = ids == 0
        h = self.enc(self.emb(ids), src_key_padding_mask=pad)
        return self.out(h[:, 0])


def padded(i, bs=16):
    g = gen(i)
    lens = torch.randint(2, 14, (bs,), generator=g)
    ids = torch.randint(1, 60, (bs, int(lens.max())), generator=g)
    ids[torch.arange(ids.shape[1])[None] >= lens[:, None]] = 0
    ids[:, 0] = 1 + (ids[:, 1] % 59)  # never a padded first token
    return ids, ((ids == 7) | (ids == 8) | (ids == 9)).any(1).long()


@EVERY
def test_embedding_max_norm_and_multihead_attention_key_padding_mask(every, tmp_path):
    quiet(run(MaxNormBag(), padded, ce, tmp_path, steps=60, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


@EVERY
def test_transformer_encoder_norm_first_src_key_padding_mask_eval_passes(every, tmp_path):
    m = Encoder()
    xv, yv = padded(500)

    def validate(i):
        if i % 10 == 9:
            m.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                assert torch.isfinite(m(xv)).all()
            m.train()
    quiet(run(m, padded, ce, tmp_path, steps=60, every=every, between=validate,
              opt=lambda m: torch.optim.AdamW(no_decay_groups(m, lr=2e-3), lr=2e-3), sched=lambda o:
              warmup_cosine(o, 6, 60)))


# --- checkpointing, spectral norm ---------------------------------------------------------------------------

class Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(20, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(128, 64)) for _ in range(3))
        self.seq = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + checkpoint(b, h, use_reentrant=False)
        h = checkpoint_sequential(self.seq, 2, h, use_reentrant=False)
        return self.out(h)


@EVERY
def test_checkpoint_non_reentrant_with_dropout_and_checkpoint_sequential(every, tmp_path):
    quiet(run(Ckpt(), vectors, ce, tmp_path, steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3)))


@EVERY
def test_spectral_norm_discriminator_style_classifier(every, tmp_path):
    sn = nn.utils.parametrizations.spectral_norm
    m = nn.Sequential(sn(nn.Conv2d(3, 16, 3, 2, 1)), nn.LeakyReLU(0.2, inplace=True), sn(nn.Conv2d(16, 32, 3, 2, 1)),
                      nn.LeakyReLU(0.2, inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), sn(nn.Linear(32, 4)))
    quiet(run(m, images, ce, tmp_path, steps=40, every=every,
              opt=lambda m: torch.optim.Adam(m.parameters(), lr=2e-3, betas=(0.0, 0.9))))


# --- distillation, mixup ------------------------------------------------------------------------------------

@EVERY
def test_knowledge_distillation_kl_temperature_4_with_teacher_in_eval(every, tmp_path):
    torch.manual_seed(2)
    teacher = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 4))
    with torch.no_grad():   # a "trained" teacher: the data's own rule, sharpened
        teacher[0].weight.normal_(0, 0.3)
    opt_t = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    for i in range(60):
        x, y = vectors(1000 + i)
        opt_t.zero_grad()
        F.cross_entropy(teacher(x), y).backward()
        opt_t.step()
    teacher.eval().requires_grad_(False)
    student = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
    T = 4.0

    def kd(m, x, y):
        s = m(x)
        with torch.no_grad():
            t = teacher(x)
        soft = F.kl_div(F.log_softmax(s.float() / T, -1), F.log_softmax(t.float() / T, -1), log_target=True,
                        reduction="batchmean") * T * T
        return 0.7 * soft + 0.3 * F.cross_entropy(s, y)
    quiet(run(student, vectors, kd, tmp_path, steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


@EVERY
def test_mixup_soft_targets_label_smoothing(every, tmp_path):
    def batch(i):
        x, y = vectors(i)
        lam = float(torch.distributions.Beta(0.4, 0.4).sample())
        perm = torch.randperm(x.shape[0], generator=gen(i + 5000))
        t = F.one_hot(y, 4).float()
        return lam * x + (1 - lam) * x[perm], lam * t + (1 - lam) * t[perm]

    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    quiet(run(m, batch, lambda m, x, t: F.cross_entropy(m(x), t, label_smoothing=0.1), tmp_path, steps=60,
              every=every, opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


# --- zero-initialised head, progressive unfreezing, parameters without grads on some steps -----------------

@EVERY
def test_zero_initialised_classifier_head_first_updates(every, tmp_path):
    """timm/DiT-style: the head (weight and bias) starts at exactly 0; Adam's first update takes it off zero."""
    m = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    nn.init.zeros_(m[3].weight)
    nn.init.zeros_(m[3].bias)
    quiet(run(m, vectors, ce, tmp_path, steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3), sched=lambda o: warmup_cosine(o, 4, 40)))


@EVERY
def test_progressive_unfreezing_add_param_group_mid_run(every, tmp_path):
    """Frozen trunk (all parameters given to the optimizer, grads None), head only; at step 15 the trunk is unfrozen
    and a new param group with a 10x lower lr is added (the ULMFiT / fine-tuning recipe)."""
    torch.manual_seed(3)
    trunk = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    m = nn.Sequential(trunk, nn.Linear(64, 4))
    pre = torch.optim.Adam(m.parameters(), lr=1e-2)
    for i in range(30):   # "pretraining" in fp32, unwatched
        x, y = vectors(2000 + i, seed=8)
        pre.zero_grad()
        F.cross_entropy(m(x), y).backward()
        pre.step()
    nn.init.normal_(m[1].weight, 0, 0.01)
    nn.init.zeros_(m[1].bias)
    trunk.requires_grad_(False)
    holder = {}

    def make(model):
        holder["opt"] = torch.optim.AdamW(model[1].parameters(), lr=5e-3)
        return holder["opt"]

    def unfreeze(i):
        if i == 14:
            trunk.requires_grad_(True)
            holder["opt"].add_param_group({"params": list(trunk.parameters()), "lr": 5e-4, "weight_decay": 0.0})
    quiet(run(m, lambda i: vectors(i, seed=8), ce, tmp_path, steps=40, every=every, opt=make, between=unfreeze,
              params=list(m.parameters())))


class DropPathNet(nn.Module):
    """Stochastic depth that skips a whole residual block for the batch (so its parameters get no grad that
    step), and a top-1 mixture of experts where an expert may receive no token."""

    def __init__(self, d=32, n=4, e=4):
        super().__init__()
        self.inp, self.out = nn.Linear(20, d), nn.Linear(d, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n))
        self.router = nn.Linear(d, e)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d)) for _ in range(e))
        self.p = 0.3

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            if self.training and float(torch.rand(())) < self.p:
                continue
            h = h + b(h) / (1 - self.p if self.training else 1)
        gate = torch.softmax(self.router(h).float(), -1)
        w, idx = gate.max(-1)
        moe = torch.zeros_like(h)
        for j, ex in enumerate(self.experts):
            sel = idx == j
            if sel.any():
                moe[sel] = (ex(h[sel]) * w[sel, None]).to(moe.dtype)
        return self.out(h + moe)


@EVERY
def test_stochastic_depth_whole_block_skips_and_top1_moe_unused_experts(every, tmp_path):
    torch.manual_seed(4)
    quiet(run(DropPathNet(), vectors, ce, tmp_path, steps=50, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3)))


# --- -inf in the output by design, sum reduction ------------------------------------------------------------

class Masked(nn.Module):
    """Invalid-action masking (RL policies, constrained decoding): illegal logits are -inf in the model's own
    output; the targets are always legal, so the loss and every gradient stay finite."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 6))

    def forward(self, x, legal):
        return self.f(x).masked_fill(~legal, float("-inf"))


@EVERY
def test_invalid_action_masking_minus_inf_logits(every, tmp_path):
    """An RL policy masks illegal actions with -inf in its own output; the targets are legal, so the loss and the
    gradients stay finite. Was `overflow at (root)` (error) and a capture at step 0: any non-finite output made
    the step bad (record/transfer.py); an output holding -inf only, with a finite loss, is finite now."""
    def batch(i):
        x, y = vectors(i, k=6)
        legal = torch.rand(x.shape[0], 6, generator=gen(i + 77)) < 0.6
        legal[torch.arange(x.shape[0]), y] = True
        return x, legal, y
    quiet(run(Masked(), batch, lambda m, x, legal, y: F.cross_entropy(m(x, legal), y), tmp_path, steps=40,
              every=every, opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


@EVERY
def test_sum_reduction_loss_over_a_large_batch_backs_off_then_trains(every, tmp_path):
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    quiet(run(m, lambda i: vectors(i, bs=512), lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum"), tmp_path,
              steps=40, every=every, max_backoffs=8, opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


# --- normalisations with tiny eps, contrastive ----------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Norms(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(20, d)
        self.ln = nn.LayerNorm(d, eps=1e-12)          # BERT's eps
        self.rms1, self.ff1 = RMSNorm(d), SwiGLU(d, 64)
        self.rms2, self.ff2 = RMSNorm(d), SwiGLU(d, 64)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.ln(self.inp(x))
        h = h + self.ff1(self.rms1(h))
        h = h + self.ff2(self.rms2(h))
        return self.out(h)


@EVERY
def test_bert_layernorm_eps_1e_12_llama_rmsnorm_swiglu(every, tmp_path):
    quiet(run(Norms(), vectors, ce, tmp_path, steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, eps=1e-8)))


@EVERY
def test_simclr_normalize_cosine_nt_xent_temperature_0_1(every, tmp_path):
    enc = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32))

    def batch(i):
        x = torch.randn(32, 20, generator=gen(i))
        return (x + 0.1 * torch.randn(32, 20, generator=gen(i + 1)), x + 0.1 * torch.randn(32, 20, generator=gen(i + 2)))

    def nt_xent(m, a, b, t=0.1):
        z = F.normalize(torch.cat([m(a), m(b)]), dim=-1)
        sim = z @ z.t() / t
        sim = sim.masked_fill(torch.eye(64, dtype=torch.bool), -1e4)
        n = a.shape[0]
        target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
        cos = F.cosine_similarity(m(a), m(b), dim=-1).mean()
        return F.cross_entropy(sim.float(), target) - 0.0 * cos
    quiet(run(enc, batch, nt_xent, tmp_path, steps=40, every=every, must_fall=0.95,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


# --- packed sequences, causal decoder, super-resolution -------------------------------------------------------

class PackedGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16, padding_idx=0)
        self.rnn = nn.GRU(16, 32, batch_first=True)
        self.out = nn.Linear(32, 2)

    def forward(self, ids, lens):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lens, batch_first=True, enforce_sorted=False)
        _, h = self.rnn(packed)
        return self.out(h[-1])


@EVERY
def test_gru_over_packed_padded_sequences(every, tmp_path):
    def batch(i):
        g = gen(i)
        lens = torch.randint(2, 12, (16,), generator=g)
        ids = torch.randint(1, 30, (16, int(lens.max())), generator=g)
        ids[torch.arange(ids.shape[1])[None] >= lens[:, None]] = 0
        return ids, lens, (ids == 5).any(1).long()
    quiet(run(PackedGRU(), batch, lambda m, ids, lens, y: F.cross_entropy(m(ids, lens), y), tmp_path, steps=50,
              every=every, opt=lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3)))


class CausalLM(nn.Module):
    def __init__(self, V=32, d=32, T=12):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, d), nn.Parameter(torch.zeros(T, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, activation="gelu")
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, V)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T), persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        h = self.tok(idx) * math.sqrt(self.tok.embedding_dim) + self.pos[:T]
        return self.head(self.body(h, mask=self.mask[:T, :T], is_causal=True))


@EVERY
def test_causal_transformer_lm_square_subsequent_mask(every, tmp_path):
    def batch(i):
        start = torch.randint(0, 32, (16, 1), generator=gen(i))
        return ((start + 5 * torch.arange(12)) % 32,)

    def loss(m, idx):
        return F.cross_entropy(m(idx)[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())
    quiet(run(CausalLM(), batch, loss, tmp_path, steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(no_decay_groups(m, lr=3e-3), lr=3e-3), sched=lambda o: warmup_cosine(o, 5, 40)))


class SR(nn.Module):
    """ESPCN-style x2 super-resolution: PReLU, ELU(inplace), PixelShuffle, a bicubic skip, L1 loss."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.PReLU(16), nn.Conv2d(16, 16, 3, padding=1),
                               nn.ELU(inplace=True), nn.Conv2d(16, 4, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, x):
        return self.f(x) + F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


@EVERY
def test_pixelshuffle_super_resolution_prelu_elu_inplace_l1(every, tmp_path):
    def batch(i):
        g = gen(i)
        fx, fy = torch.rand(8, 1, 1, 1, generator=g) * 3, torch.rand(8, 1, 1, 1, generator=g) * 3
        u = torch.linspace(0, 2 * math.pi, 16)
        hi = torch.sin(fx * u[None, None, :, None] + fy * u[None, None, None, :])
        return F.avg_pool2d(hi, 2), hi
    quiet(run(SR(), batch, lambda m, lo, hi: F.l1_loss(m(lo).float(), hi), tmp_path, steps=40, every=every,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


# --- a longer run ---------------------------------------------------------------------------------------------

@EVERY
def test_250_steps_dropout_mlp_warmup_cosine_grad_accumulation_and_eval(every, tmp_path):
    """Past the default sampling's second sampled step (200): warmup -> cosine, accumulation of 2, label
    smoothing, validation every 50 steps; the logits grow as the classifier becomes confident."""
    m = nn.Sequential(nn.Linear(20, 128), nn.ReLU(inplace=True), nn.Dropout(0.3), nn.Linear(128, 128), nn.SiLU(),
                      nn.Dropout(0.3), nn.Linear(128, 4))
    xv, yv = vectors(4242, bs=128)
    acc = []

    def validate(i):
        if i % 50 == 49:
            m.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                acc.append((m(xv).argmax(1) == yv).float().mean().item())
            m.train()
    quiet(run(m, vectors, lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=0.05), tmp_path, steps=250,
              every=every, accum=2, between=validate, must_fall=0.6,
              opt=lambda m: torch.optim.AdamW(no_decay_groups(m, lr=2e-3), lr=2e-3),
              sched=lambda o: warmup_cosine(o, 20, 250)))
    assert acc[-1] > 0.8, acc


# --- losses that reach zero, sharp softmax --------------------------------------------------------------------

@EVERY
def test_triplet_margin_loss_that_reaches_zero_and_trains_on(every, tmp_path):
    """Most triplets satisfy the margin after a few steps: their gradients are exactly zero; the loss goes to ~0."""
    enc = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 16))
    centers = 0.5 * torch.randn(4, 20, generator=gen(11))

    def batch(i):
        g = gen(i)
        c = torch.randint(0, 4, (32,), generator=g)
        n = (c + torch.randint(1, 4, (32,), generator=g)) % 4
        def noise():
            return 0.4 * torch.randn(32, 20, generator=g)
        return centers[c] + noise(), centers[c] + noise(), centers[n] + noise()

    def loss(m, a, p, n):
        return F.triplet_margin_loss(m(a).float(), m(p).float(), m(n).float(), margin=1.0)
    quiet(run(enc, batch, loss, tmp_path, steps=50, every=every, must_fall=0.2,
              opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))


class Lookup(nn.Module):
    """Soft key-value retrieval through an nn.Softmax module whose distribution sharpens as it learns: its fp16
    probabilities pass through fp16 subnormals (up to ~40% of them early on) and then mostly flush to exact 0 (80-90%),
    as a trained attention's do."""

    def __init__(self, n=64, d=16):
        super().__init__()
        self.keys = nn.Parameter(torch.randn(n, d))
        self.values = nn.Parameter(torch.randn(n, d))
        self.q = nn.Linear(d, d)
        with torch.no_grad():
            self.q.weight.copy_(torch.eye(d) + 0.3 * torch.randn(d, d))
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        att = self.softmax(self.q(x) @ self.keys.t() * self.scale.exp())
        return att @ self.values


@EVERY
def test_softmax_module_that_sharpens_to_tiny_probabilities(every, tmp_path):
    torch.manual_seed(5)
    m = Lookup()

    def batch(i):
        idx = torch.randint(0, 64, (32,), generator=gen(i))
        with torch.no_grad():
            return m.keys[idx].detach().clone(), m.values[idx].detach().clone()
    quiet(run(m, batch, lambda m, x, v: F.mse_loss(m(x).float(), v), tmp_path, steps=80, every=every, must_fall=0.3,
              opt=lambda m: torch.optim.Adam([{"params": [m.scale], "lr": 1e-1},
                                              {"params": [m.q.weight, m.q.bias], "lr": 1e-2}])))


# --- fp32 outputs past fp16's range, non-float outputs --------------------------------------------------------

class PriceNet(nn.Module):
    """The recommended fix for large targets: an fp16 trunk and an fp32 head outside autocast that predicts
    prices of ~1e5 directly (values past fp16's max, but never cast to fp16)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            self.head.bias.fill_(10.0)

    def forward(self, x):
        h = self.trunk(x)
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float()).squeeze(-1) * 1e4   # prices in units of 1e4, as a de-normalising head


@EVERY
def test_fp32_head_outside_autocast_predicting_values_past_fp16_max(every, tmp_path):
    wt = torch.randn(8, generator=gen(21))

    def batch(i):
        x = torch.randn(64, 8, generator=gen(i))
        return x, 1e5 + 2e4 * (x @ wt)

    def loss(m, x, y):
        return F.mse_loss(m(x) / 1e4, y / 1e4)
    quiet(run(PriceNet(), batch, loss, tmp_path, steps=60, every=every, clip=None,
              opt=lambda m: torch.optim.AdamW([{"params": m.trunk.parameters(), "lr": 3e-3},
                                               {"params": m.head.parameters(), "lr": 1e-2}])))


class MultiOut(nn.Module):
    """Returns a dict holding logits, int64 predictions, a bool mask, an fp32 confidence and None."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        logits = self.f(x)
        p = logits.float().softmax(-1)
        return {"logits": logits, "pred": logits.argmax(-1), "sure": p.max(-1).values > 0.9,
                "conf": p.max(-1).values, "aux": None}


@EVERY
def test_dict_output_with_int_bool_fp32_and_none_entries(every, tmp_path):
    quiet(run(MultiOut(), vectors, lambda m, x, y: F.cross_entropy(m(x)["logits"], y), tmp_path, steps=40,
              every=every, opt=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)))
