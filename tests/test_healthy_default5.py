"""Healthy runs at ampdoctor's DEFAULT settings (`ampdoctor.watch(model, optimizer=opt, scaler=sc)`, nothing else:
headroom="auto", the default sampling, the headroom_trend early warning), fifth set: the shapes of real code that
production users run, in styles the earlier probe files (tests/test_healthy*.py) do not cover or cover differently.

A transformers-example loop written by hand (AdamW with weight-decay groups excluding bias/LayerNorm.weight, warmup +
cosine as a LambdaLR from lr 0, 4-step accumulation through `scaler.scale(loss / accum)`, clip 1.0, dropout, BERT's
extended mask of finfo(float32).min); `gradient_checkpointing_enable()` the transformers way (non-reentrant, dropout
recomputed, off in the eval passes every 5 steps); a BERT MLM (15% masking, 80/10/10, ignore_index=-100, decoder
tied to the word embeddings); timm's train_one_epoch (Mixup/CutMix with label smoothing into a soft-target CE, a
ModelEmaV2 updated after every step, bf16); a ResNet with each block's last BN gamma zero-initialised, SGD nesterov
+ OneCycleLR (bf16, and fp16 on 8x8 images); a detection-style backbone with frozen BatchNorm (eval-mode BN with
frozen affine inside a train-mode model, `train()` overridden); a DDPM UNet (epsilon prediction, the cosine
schedule, GroupNorm/SiLU ResBlocks with a timestep embedding, zero-initialised output conv, an EMA; bf16 and fp16);
nanoGPT (weight tying, SDPA is_causal=True with attention dropout, decay only on 2-D tensors, warmup -> cosine by
hand; fp16 and bf16); a Llama with grouped-query attention, RMSNorm, SwiGLU and rotary cos/sin in fp32
non-persistent buffers (40 and 150 steps); T5 (RMS layer norm in fp32, bucketed relative position bias shared across
layers, the causal mask of finfo(float32).min added to the fp32 bias, softmax in fp32, embeddings shared three ways
and the output scaled by d_model**-0.5) on a toy translation; OpenAI CLIP's recipe (logit_scale clamped to log 100
at the top of each step, a causal text tower pooled at the EOT argmax); unsupervised SimCSE (dropout as
augmentation, temperature 0.05); a speech CTC model (conv subsampling + BiGRU, reduction='sum' per utterance ~30 or
per batch ~400 with its initial search for a loss scale, the blank-dominated start); a GIN over PyG-style batched
graphs with scatter_add_ messages and a scatter mean readout; DLRM (EmbeddingBag multi-hot, dot interactions); an
FT-Transformer on tabular data on the bf16 path without a scaler; a GRU seq2seq with Bahdanau attention and teacher
forcing ratio 0.5; the Annotated Transformer (Noam schedule through LambdaLR, shared embeddings x sqrt(d_model),
label smoothing with padding ignored, bool masks); a Shazeer noisy top-2 gated MoE with the CV^2 importance loss;
validation every 5 steps with early-stopping bookkeeping and a deep-copied best state_dict;
`zero_grad(set_to_none=False)` with AMSGrad and two heads used on alternate steps; ReduceLROnPlateau (patience 8)
stepped on a smoothed training loss; a DataLoader re-created every epoch with drop_last=False (a last batch of one);
a LoRA fine-tune (frozen fp16 base with fp32 LayerNorms, fp32 adapters on q/v, a new fp32 head); variable-length
padded batches whose 4-D mask is built in the autocast dtype with finfo(dtype).min (fp16 and bf16, through SDPA);
Swin shifted-window attention (relative position bias table, the -100.0 window mask); ELECTRA (a generator and a
discriminator sharing embeddings, multinomial replacements, loss = MLM + 50 x BCE); WaveNet (gated dilated causal
Conv1d, a 64-way mu-law softmax, bf16). torch.compile is not used (CPU).

Each run is an ordinary loop on the CPU (fp16 autocast with a real torch.amp.GradScaler("cpu"), bf16 without one where
said), first asserted healthy (every loss finite; the loss falls; the scaler backs off only at the start), then
judged: the report must hold no warning and no error (info is fine). A false alarm would keep its assertion under a
strict xfail naming the finding.

False alarms: none. All 34 runs are reported without a warning or an error (the only findings are info: the first
backoffs of the CLIP, CTC and ELECTRA runs as `overflow`/`skipped_steps` info, and the size-1 batch's one backoff in
the DataLoader run)."""
import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import ampdoctor

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import gen, one_thread, quiet_watch as quiet  # noqa: E402

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16, BF16 = torch.float16, torch.bfloat16


def healthy(losses, scales=(), fall=0.9, k=5, max_backoffs=5, drop=None):
    """Every loss finite; the mean of the last k below `fall` x the mean of the first k (or, with `drop`, at least
    `drop` below it); at most `max_backoffs` scale decreases, at most one of them after the first quarter of the
    run."""
    assert all(map(math.isfinite, losses)), losses
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if drop is not None:
        assert last < first - drop, losses
    else:
        assert last < fall * first, losses
    drops = [i for i, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]
    assert len(drops) <= max_backoffs, scales
    assert sum(i >= max(6, len(scales) // 4) for i in drops) <= 1, (drops, scales)


def fit(model, step_loss, *, steps, opt=None, lr=1e-3, dtype=FP16, sched=None, clip=1.0, after=None, before=None,
        watched=None, set_to_none=True):
    """zero_grad -> before(i) -> forward under autocast(dtype) (`step_loss(i)` -> scalar) -> scale(loss).backward ->
    unscale_ -> clip_grad_norm_ -> step -> update -> sched.step -> after(i) under no_grad, under a default watch of
    `watched` (default the model). Returns (watch, losses, scales)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if dtype == FP16 else None
    w = ampdoctor.watch(watched or model, optimizer=opt, scaler=sc)
    losses, scales = [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        if before:
            before(i)
        with torch.autocast("cpu", dtype=dtype):
            loss = step_loss(i)
        (sc.scale(loss) if sc else loss).backward()
        if sc:
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        if sched:
            sched.step()
        if after:
            with torch.no_grad():
                after(i)
        losses.append(loss.item())
        scales.append(sc.get_scale() if sc else 1.0)
    w.close()
    return w, losses, scales


def mlp(*dims, act=nn.GELU):
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def clusters(n, seed, k=8, d=16, spread=0.5):
    """n points of k gaussian clusters in d dims (fixed centres), with labels."""
    centres = torch.randn(k, d, generator=gen(999)) * 2
    g = gen(seed)
    y = torch.randint(0, k, (n,), generator=g)
    return centres[y] + spread * torch.randn(n, d, generator=g), y


def arith(i, B=16, T=16, V=32, lo=1, steps=(1, 2, 3)):
    """Token sequences x[t] = (s + t * step) mod V over [lo, V): s random, step from `steps` per sequence; returns
    (tokens, the index of each sequence's step)."""
    g = gen(i)
    s = torch.randint(0, V - lo, (B, 1), generator=g)
    k = torch.randint(0, len(steps), (B,), generator=g)
    st = torch.tensor(steps)[k][:, None]
    return lo + (s + st * torch.arange(T)) % (V - lo), k


def mean_of(xs, n):
    return [sum(xs[j:j + n]) / len(xs[j:j + n]) for j in range(0, len(xs), n)]


def images(n, seed, S=16, k=4):
    """n 3xSxS images of class y in [0, k): a bright square in quadrant y on noise, the colour channel y % 3."""
    g = gen(seed)
    y = torch.randint(0, k, (n,), generator=g)
    x = 0.5 * torch.randn(n, 3, S, S, generator=g)
    h = S // 2
    for j in range(n):
        r, c = divmod(int(y[j]), 2)
        m = max(1, h // 4)
        x[j, int(y[j]) % 3, r * h + m:r * h + h - m, c * h + m:c * h + h - m] += 1.5
    return x, y


# -- a hand-written Hugging Face Trainer loop --------------------------------------------------------------------------
class BertLayer(nn.Module):
    """Post-LN BERT layer (eager attention: additive extended mask, softmax in the scores' dtype, dropout)."""

    def __init__(self, d=32, h=4, p=0.1):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.dense = nn.Linear(d, d)
        self.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.intermediate, self.output = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.out_LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.drop, self.h = nn.Dropout(p), h

    def forward(self, x, ext_mask):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.h, -1).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(C // self.h)
        scores = scores + ext_mask
        a = self.drop(scores.softmax(-1)) @ v
        x = self.LayerNorm(x + self.drop(self.dense(a.transpose(1, 2).reshape(B, T, C))))
        return self.out_LayerNorm(x + self.drop(self.output(F.gelu(self.intermediate(x)))))


class TinyBert(nn.Module):
    def __init__(self, V=32, d=32, n=2, T=32, classes=3, ckpt=False):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(V, d, padding_idx=0), nn.Embedding(T, d)
        self.emb_LayerNorm, self.drop = nn.LayerNorm(d, eps=1e-12), nn.Dropout(0.1)
        self.layers = nn.ModuleList(BertLayer(d) for _ in range(n))
        self.pooler, self.classifier = nn.Linear(d, d), nn.Linear(d, classes)
        self.gradient_checkpointing = ckpt
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight.data.normal_(0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            m.bias.data.zero_()

    def encode(self, ids, attention_mask):
        T = ids.shape[1]
        x = self.drop(self.emb_LayerNorm(self.word_embeddings(ids) + self.position_embeddings(torch.arange(T))))
        # transformers' get_extended_attention_mask: (1 - mask) * finfo(self.dtype).min, self.dtype the fp32 params
        ext = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer.__call__, x, ext, use_reentrant=False)
            else:
                x = layer(x, ext)
        return x

    def forward(self, input_ids, attention_mask, labels=None):
        x = self.encode(input_ids, attention_mask)
        logits = self.classifier(self.drop(torch.tanh(self.pooler(x[:, 0]))))
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def padded_arith(i, B=16, T=24, V=32, p=0.7):
    """[CLS]=1 + tokens of one of 3 topics (topic k draws from [2 + 10k, 12 + 10k) with probability p, else any
    token of [2, V)), of random length 6..T-1, padded with 0; the label is the topic."""
    g = gen(i)
    k = torch.randint(0, 3, (B,), generator=g)
    own = 2 + 10 * k[:, None] + torch.randint(0, 10, (B, T - 1), generator=g)
    x = torch.where(torch.rand(B, T - 1, generator=g) < p, own, torch.randint(2, V, (B, T - 1), generator=g))
    lens = torch.randint(6, T, (B,), generator=g)
    ids = torch.cat([torch.ones(B, 1, dtype=torch.long), x], 1)
    mask = (torch.arange(T) < lens[:, None]).long()
    return ids * mask, mask, k


def test_hf_style_hand_loop_adamw_no_decay_groups_warmup_cosine_lambdalr_accumulation_4_scaled_loss_over_accum():
    """The loop a user writes from the transformers examples: AdamW over two groups (weight decay 0.01, none on
    bias/LayerNorm.weight), get_cosine_schedule_with_warmup as a LambdaLR (3 warmup steps from lr 0), 4 micro-batches
    accumulated with `scaler.scale(loss / accum).backward()`, then unscale_ -> clip 1.0 -> step -> update ->
    scheduler.step -> zero_grad; dropout 0.1, a padded batch with an attention mask."""
    torch.manual_seed(0)
    model = TinyBert()
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
               "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3, eps=1e-8)
    total, warm, accum = 30, 3, 4

    def lr_lambda(s):
        if s < warm:
            return s / max(1, warm)
        prog = (s - warm) / max(1, total - warm)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * prog)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler)
    model.train()
    losses, scales, tot = [], [], 0.0
    for step in range(total * accum):
        ids, mask, y = padded_arith(step)
        with torch.autocast("cpu", dtype=FP16):
            loss = model(input_ids=ids, attention_mask=mask, labels=y)["loss"]
        scaler.scale(loss / accum).backward()
        tot += loss.item() / accum
        if (step + 1) % accum == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
            losses.append(tot)
            scales.append(scaler.get_scale())
            tot = 0.0
    w.close()
    healthy(losses, scales, fall=0.7)
    quiet(w)


def test_hf_style_gradient_checkpointing_enable_non_reentrant_with_dropout_and_eval_every_5():
    """`model.gradient_checkpointing_enable()` the transformers way (checkpoint(layer.__call__, ...,
    use_reentrant=False) only while training, dropout inside the recomputed layers) with an eval pass (model.eval(),
    no_grad, autocast, no checkpointing) every 5 steps."""
    torch.manual_seed(1)
    model = TinyBert(ckpt=True)
    evals = []

    def step_loss(i):
        ids, mask, y = padded_arith(i)
        return model(ids, mask, labels=y)["loss"]

    def after(i):
        if (i + 1) % 5 == 0:
            model.eval()
            with torch.autocast("cpu", dtype=FP16):
                evals.append(model(*padded_arith(5000)[:2], labels=padded_arith(5000)[2])["loss"].item())
            model.train()

    w, losses, scales = fit(model, step_loss, steps=40, lr=3e-3, after=after)
    healthy(losses, scales, fall=0.7)
    assert evals[-1] < 0.7 * evals[0], evals
    quiet(w)


# -- BERT masked language modelling ----------------------------------------------------------------------------------
class BertMLM(TinyBert):
    """TinyBert + the MLM head: dense -> gelu -> LayerNorm -> decoder tied to the word embeddings (+ its own bias)."""

    def __init__(self, V=32, d=32):
        super().__init__(V, d)
        self.transform, self.head_LayerNorm = nn.Linear(d, d), nn.LayerNorm(d, eps=1e-12)
        self.decoder_bias = nn.Parameter(torch.zeros(V))

    def forward(self, input_ids, attention_mask, labels):
        x = self.encode(input_ids, attention_mask)
        h = self.head_LayerNorm(F.gelu(self.transform(x)))
        logits = F.linear(h, self.word_embeddings.weight, self.decoder_bias)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def mlm_batch(i, V=32, MASK=1):
    """DataCollatorForLanguageModeling: 15% of the real tokens picked, labels -100 elsewhere; of the picked 80% ->
    [MASK], 10% -> a random token, 10% kept."""
    ids, mask, _ = padded_arith(i, p=0.95)
    ids = ids.clone()
    ids[:, 0] = 2  # no [CLS] here; token 1 is [MASK]
    g = gen(20_000 + i)
    picked = (torch.rand(ids.shape, generator=g) < 0.15) & mask.bool()
    labels = torch.where(picked, ids, torch.full_like(ids, -100))
    r = torch.rand(ids.shape, generator=g)
    ids = torch.where(picked & (r < 0.8), torch.full_like(ids, MASK), ids)
    rnd = torch.randint(2, V, ids.shape, generator=g)
    ids = torch.where(picked & (r >= 0.8) & (r < 0.9), rnd, ids)
    return ids, mask, labels


def test_bert_mlm_15_percent_masking_80_10_10_ignore_index_minus_100_tied_decoder():
    torch.manual_seed(2)
    model = BertMLM()
    w, losses, scales = fit(model, lambda i: model(*mlm_batch(i)), steps=80, lr=5e-3)
    healthy(losses, scales, fall=0.8, k=10)
    quiet(w)


# -- timm ------------------------------------------------------------------------------------------------------------
class SmallNet(nn.Module):
    def __init__(self, c=16, k=4, zero_gamma=False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(BasicBlock(c, c * s, s) for s in (1, 2))
        self.fc = nn.Linear(2 * c, k)
        if zero_gamma:
            for b in self.blocks:
                nn.init.zeros_(b.bn2.weight)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class BasicBlock(nn.Module):
    def __init__(self, a, b, s=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(a, b, 3, s, 1, bias=False), nn.BatchNorm2d(b)
        self.conv2, self.bn2 = nn.Conv2d(b, b, 3, 1, 1, bias=False), nn.BatchNorm2d(b)
        self.relu = nn.ReLU(inplace=True)
        self.down = (nn.Sequential(nn.Conv2d(a, b, 1, s, bias=False), nn.BatchNorm2d(b)) if (a != b or s != 1)
                     else None)

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += idt
        return self.relu(out)


def mixup_cutmix(x, y, i, k=4, smoothing=0.1):
    """timm's Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1), batch mode: mix with
    the flipped batch; cutmix pastes a box and corrects lam by its area. Returns (x, soft targets)."""
    g = gen(30_000 + i)
    use_cut = torch.rand(1, generator=g).item() < 0.5
    lam = torch.distributions.Beta(1.0, 1.0).sample() if use_cut else torch.distributions.Beta(0.8, 0.8).sample()
    lam = float(lam)
    x = x.clone()
    if use_cut:
        S = x.shape[-1]
        cut = int(S * math.sqrt(1 - lam))
        cy, cx = torch.randint(0, S, (2,), generator=g).tolist()
        y0, y1, x0, x1 = max(cy - cut // 2, 0), min(cy + cut // 2, S), max(cx - cut // 2, 0), min(cx + cut // 2, S)
        x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
        lam = 1 - (y1 - y0) * (x1 - x0) / (S * S)
    else:
        x = x * lam + x.flip(0) * (1 - lam)
    off, on = smoothing / k, 1 - smoothing + smoothing / k
    t = torch.full((len(y), k), off).scatter_(1, y[:, None], on)
    return x, t * lam + t.flip(0) * (1 - lam)


class ModelEmaV2(nn.Module):
    def __init__(self, model, decay=0.9):
        super().__init__()
        self.module, self.decay = copy.deepcopy(model).eval(), decay

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            e.copy_(e * self.decay + (1 - self.decay) * m if e.is_floating_point() else m)


def test_timm_style_mixup_cutmix_label_smoothing_soft_target_ce_model_ema_after_every_step_bf16():
    """timm's train_one_epoch: Mixup/CutMix soft targets with label smoothing into SoftTargetCrossEntropy, AdamW +
    cosine, ModelEmaV2 updated after every optimizer step; bf16 (the CPU's fp16 convolutions are too slow), no
    scaler. The EMA model's clean loss falls too."""
    torch.manual_seed(3)
    model = SmallNet()
    ema = ModelEmaV2(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 40)
    xv, yv = images(64, 777)

    def clean_loss(m):
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            return F.cross_entropy(m(xv).float(), yv).item()

    e0 = clean_loss(ema.module)

    def step_loss(i):
        x, t = mixup_cutmix(*images(32, i), i)
        return torch.sum(-t * F.log_softmax(model(x).float(), -1), -1).mean()

    w, losses, scales = fit(model, step_loss, steps=40, opt=opt, sched=sched, dtype=BF16, clip=None,
                            after=lambda i: ema.update(model))
    healthy(losses, scales, fall=0.85, k=8)
    assert clean_loss(ema.module) < 0.7 * e0, (e0, clean_loss(ema.module))
    quiet(w)


def test_resnet_zero_init_last_bn_gamma_sgd_nesterov_onecycle_bf16():
    """torchvision's zero_init_residual (each block's bn2.weight = 0: every block starts as the identity), SGD
    momentum 0.9 nesterov with weight decay 5e-4 on everything, OneCycleLR peaking at 0.2; bf16, no scaler."""
    torch.manual_seed(4)
    model = SmallNet(zero_gamma=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=40, pct_start=0.25)

    def step_loss(i):
        x, y = images(32, i)
        return F.cross_entropy(model(x).float(), y)

    w, losses, scales = fit(model, step_loss, steps=40, opt=opt, sched=sched, dtype=BF16, clip=None)
    healthy(losses, scales, fall=0.5)
    quiet(w)


def test_resnet_zero_init_last_bn_gamma_fp16_tiny_images():
    """The same recipe in fp16 with a GradScaler on 8x8 images and 8 channels (fp16 convolutions are slow on the
    CPU)."""
    torch.manual_seed(5)
    model = SmallNet(c=8, zero_gamma=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=30, pct_start=0.25)

    def step_loss(i):
        x, y = images(16, i, S=8)
        return F.cross_entropy(model(x).float(), y)

    w, losses, scales = fit(model, step_loss, steps=30, opt=opt, sched=sched, clip=None)
    healthy(losses, scales, fall=0.7)
    quiet(w)


class FrozenBNNet(SmallNet):
    """A detection-style backbone: BatchNorm kept in eval mode (running stats frozen, affine frozen) while the
    model trains; `train()` is overridden so that `model.train()` leaves the BN layers in eval."""

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self


def test_frozen_batchnorm_eval_mode_bn_inside_a_train_mode_model_bf16():
    """Pretrained statistics first (20 train-mode forwards, no grad), then BN frozen (eval, requires_grad False) and
    the convs fine-tuned on a shifted domain."""
    torch.manual_seed(6)
    model = FrozenBNNet()
    nn.Module.train(model, True)
    with torch.no_grad():
        for i in range(20):
            model(images(32, 40_000 + i)[0])
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)
    model.train()
    assert not any(m.training for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    stats = model.stem[1].running_mean.clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)

    def step_loss(i):
        x, y = images(32, i)
        return F.cross_entropy(model(1.3 * x + 0.2).float(), y)

    w, losses, scales = fit(model, step_loss, steps=40, opt=opt, dtype=BF16)
    healthy(losses, scales, fall=0.6)
    assert torch.equal(stats, model.stem[1].running_mean)
    quiet(w)


# -- diffusion -------------------------------------------------------------------------------------------------------
def cosine_alphas_cumprod(T=1000, s=0.008):
    t = torch.linspace(0, T, T + 1, dtype=torch.float64) / T
    f = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2
    ac = f / f[0]
    betas = (1 - ac[1:] / ac[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0).float()


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    a = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(a), torch.sin(a)], -1)


class ResBlockT(nn.Module):
    def __init__(self, a, b, temb):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, a), nn.Conv2d(a, b, 3, padding=1)
        self.t = nn.Linear(temb, b)
        self.n2, self.c2 = nn.GroupNorm(4, b), nn.Conv2d(b, b, 3, padding=1)
        self.skip = nn.Conv2d(a, b, 1) if a != b else nn.Identity()

    def forward(self, x, te):
        h = self.c1(F.silu(self.n1(x))) + self.t(te)[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class DiffUNet(nn.Module):
    def __init__(self, c=16, temb=32):
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(temb, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(1, c, 3, padding=1)
        self.d1, self.d2 = ResBlockT(c, c, temb), ResBlockT(c, 2 * c, temb)
        self.mid = ResBlockT(2 * c, 2 * c, temb)
        self.u2, self.u1 = ResBlockT(4 * c, c, temb), ResBlockT(2 * c, c, temb)
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 1, 3, padding=1))
        nn.init.zeros_(self.out[-1].weight)
        nn.init.zeros_(self.out[-1].bias)
        self.dim = temb

    def forward(self, x, t):
        te = self.temb(timestep_embedding(t, self.dim))
        h0 = self.d1(self.inp(x), te)
        h1 = self.d2(F.avg_pool2d(h0, 2), te)
        m = self.mid(h1, te)
        u = self.u2(torch.cat([m, h1], 1), te)
        u = self.u1(torch.cat([F.interpolate(u, scale_factor=2.0), h0], 1), te)
        return self.out(u)


def blobs(n, seed, S=16):
    g = gen(seed)
    c = torch.rand(n, 2, generator=g) * (S - 6) + 3
    yy, xx = torch.meshgrid(torch.arange(S).float(), torch.arange(S).float(), indexing="ij")
    d2 = (yy - c[:, 0, None, None]) ** 2 + (xx - c[:, 1, None, None]) ** 2
    return (2 * torch.exp(-d2 / 8) - 1)[:, None]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16_8x8"])
def test_ddpm_unet_epsilon_prediction_cosine_schedule_ema(dtype):
    """The DDPM/improved-DDPM training step: t ~ U{0..999}, x_t = sqrt(ab) x0 + sqrt(1 - ab) eps under the cosine
    schedule, MSE on the predicted epsilon, zero-initialised output conv, an EMA (0.95) of the weights after every
    step; bf16 on 16x16 images, and fp16 with a GradScaler on 8x8 ones."""
    torch.manual_seed(7)
    S = 16 if dtype == BF16 else 8
    model = DiffUNet(c=16 if dtype == BF16 else 8)
    ema = copy.deepcopy(model).requires_grad_(False)
    ab = cosine_alphas_cumprod()

    def step_loss(i):
        g = gen(50_000 + i)
        x0 = blobs(16, i, S)
        t = torch.randint(0, 1000, (16,), generator=g)
        eps = torch.randn(x0.shape, generator=g)
        a = ab[t][:, None, None, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
        return F.mse_loss(model(xt, t).float(), eps)

    def after(i):
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.05)

    w, losses, scales = fit(model, step_loss, steps=40, lr=2e-3, dtype=dtype, after=after)
    healthy(losses, scales, fall=0.8, k=8)
    quiet(w)


# -- transformers ------------------------------------------------------------------------------------------------------
class GPTBlock(nn.Module):
    def __init__(self, d, h, p, n_layer):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        for m in (self.c_proj, self.mlp_proj):
            nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * n_layer))
        self.h, self.p = h, p
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.resid_dropout(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class NanoGPT(nn.Module):
    def __init__(self, V=32, T=32, d=48, h=4, n=2, p=0.1):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList(GPTBlock(d, h, p, n) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        nn.init.normal_(self.wpe.weight, 0.0, 0.02)

    def forward(self, idx, targets=None):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)


def nanogpt_opt(model, lr, wd=0.1):
    """nanoGPT's configure_optimizers: decay on tensors of dim >= 2, none on biases/norms; betas (0.9, 0.95)."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
                              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_nanogpt_weight_tying_sdpa_is_causal_with_attention_dropout(dtype):
    """nanoGPT: wte tied to lm_head, SDPA(is_causal=True, dropout_p=0.1 while training), residual dropout, c_proj
    init scaled by 1/sqrt(2 n_layer), AdamW betas (0.9, 0.95) with decay on 2-D tensors only, warmup -> cosine
    by hand through param_group['lr']."""
    torch.manual_seed(8)
    model = NanoGPT()
    opt = nanogpt_opt(model, 3e-3)

    def before(i):
        lr = 3e-3 * (i + 1) / 5 if i < 5 else 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * (i - 5) / 35))
        for g in opt.param_groups:
            g["lr"] = lr

    def step_loss(i):
        x, _ = arith(i, T=17)
        return model(x[:, :-1], x[:, 1:])[1]

    w, losses, scales = fit(model, step_loss, steps=40, opt=opt, dtype=dtype, before=before)
    healthy(losses, scales, fall=0.6)
    quiet(w)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class LlamaGQA(nn.Module):
    """Llama with grouped-query attention (4 query heads, 2 KV heads via repeat_interleave), rotary cos/sin cached in
    fp32 non-persistent buffers and applied in fp32, RMSNorm, SwiGLU, an untied head, no biases."""

    def __init__(self, V=32, d=32, h=4, kv=2, n=2, T=32, theta=10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, d)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "input_layernorm": RMSNorm(d), "q_proj": nn.Linear(d, d, bias=False),
            "k_proj": nn.Linear(d, d * kv // h, bias=False), "v_proj": nn.Linear(d, d * kv // h, bias=False),
            "o_proj": nn.Linear(d, d, bias=False), "post_attention_layernorm": RMSNorm(d),
            "gate_proj": nn.Linear(d, 3 * d, bias=False), "up_proj": nn.Linear(d, 3 * d, bias=False),
            "down_proj": nn.Linear(3 * d, d, bias=False)}) for _ in range(n))
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, V, bias=False)
        hd = d // h
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        f = torch.outer(torch.arange(T, dtype=torch.float32), inv)
        emb = torch.cat([f, f], -1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        self.h, self.kv, self.hd = h, kv, hd
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def rope(self, x, T):
        cos, sin = self.cos_cached[:T], self.sin_cached[:T]
        xf = x.float()
        x1, x2 = xf.chunk(2, -1)
        return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed_tokens(idx)
        for L in self.layers:
            hs = L["input_layernorm"](x)
            q = self.rope(L["q_proj"](hs).view(B, T, self.h, self.hd).transpose(1, 2), T)
            k = self.rope(L["k_proj"](hs).view(B, T, self.kv, self.hd).transpose(1, 2), T)
            v = L["v_proj"](hs).view(B, T, self.kv, self.hd).transpose(1, 2)
            k, v = (t.repeat_interleave(self.h // self.kv, 1) for t in (k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + L["o_proj"](a.transpose(1, 2).reshape(B, T, -1))
            hs = L["post_attention_layernorm"](x)
            x = x + L["down_proj"](F.silu(L["gate_proj"](hs)) * L["up_proj"](hs))
        return self.lm_head(self.norm(x))


@pytest.mark.parametrize("steps", [40, 150])
def test_llama_gqa_rmsnorm_swiglu_rotary_fp32_buffers_warmup_cosine(steps):
    """LinearLR warmup (5 steps) -> CosineAnnealingLR through SequentialLR; 40 steps, and 150 (the default sampling's
    longer series)."""
    torch.manual_seed(9)
    model = LlamaGQA()
    opt = nanogpt_opt(model, 3e-3)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=5),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps - 5, eta_min=3e-4)], milestones=[5])

    def step_loss(i):
        x, _ = arith(i, T=17)
        return F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())

    w, losses, scales = fit(model, step_loss, steps=steps, opt=opt, sched=sched)
    healthy(losses, scales, fall=0.6)
    quiet(w)


PERM = torch.cat([torch.arange(3), 3 + torch.randperm(21, generator=gen(2024))])


def translation_pairs(g, B, L=10):
    """A toy translation over tokens 3..23: the source counts up from a random start (wrapping), the target is the
    source word by word through a fixed permutation (its next word follows from its last one and the source)."""
    src = 3 + (torch.randint(0, 21, (B, 1), generator=g) + torch.arange(L)) % 21
    return src, PERM[src]


class T5Attention(nn.Module):
    """T5: no 1/sqrt(d) scaling (absorbed into the init), a bucketed relative position bias (in the first layer of
    each stack only, shared by the rest), the mask added to the bias in fp32 with finfo(float32).min, softmax in
    fp32 then back to the scores' dtype."""

    def __init__(self, d, h, kv, bidirectional, has_bias, buckets=16, max_dist=32):
        super().__init__()
        self.q, self.k = nn.Linear(d, h * kv, bias=False), nn.Linear(d, h * kv, bias=False)
        self.v, self.o = nn.Linear(d, h * kv, bias=False), nn.Linear(h * kv, d, bias=False)
        nn.init.normal_(self.q.weight, 0.0, (d * kv) ** -0.5)
        nn.init.normal_(self.k.weight, 0.0, d ** -0.5)
        nn.init.normal_(self.v.weight, 0.0, d ** -0.5)
        nn.init.normal_(self.o.weight, 0.0, (h * kv) ** -0.5)
        self.relative_attention_bias = nn.Embedding(buckets, h) if has_bias else None
        self.h, self.kv, self.bidir, self.buckets, self.max_dist = h, kv, bidirectional, buckets, max_dist

    def bucket(self, rel):
        n, ret = self.buckets, 0
        if self.bidir:
            n //= 2
            ret = (rel > 0).long() * n
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        exact = n // 2
        large = exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(self.max_dist / exact)
                         * (n - exact)).long()
        large = torch.clamp(large, max=n - 1)
        return ret + torch.where(rel < exact, rel, large)

    def compute_bias(self, Tq, Tk):
        rel = torch.arange(Tk)[None] - torch.arange(Tq)[:, None]
        return self.relative_attention_bias(self.bucket(rel)).permute(2, 0, 1)[None].float()

    def forward(self, x, kv=None, bias=None, mask=None):
        B, Tq, _ = x.shape
        kv = x if kv is None else kv
        Tk = kv.shape[1]
        q = self.q(x).view(B, Tq, self.h, self.kv).transpose(1, 2)
        k = self.k(kv).view(B, Tk, self.h, self.kv).transpose(1, 2)
        v = self.v(kv).view(B, Tk, self.h, self.kv).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)
        if bias is None:
            bias = (self.compute_bias(Tq, Tk) if self.relative_attention_bias is not None
                    else torch.zeros(1, self.h, Tq, Tk))
            if mask is not None:
                bias = bias + mask
        w = F.softmax((scores + bias).float(), -1).type_as(scores)
        return self.o((w @ v).transpose(1, 2).reshape(B, Tq, -1)), bias


class T5LayerNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class T5Small(nn.Module):
    def __init__(self, V=24, d=32, h=4, kv=8, n=2):
        super().__init__()
        self.shared = nn.Embedding(V, d)
        nn.init.normal_(self.shared.weight, 0.0, 1.0)
        self.enc = nn.ModuleList(nn.ModuleDict({"ln1": T5LayerNorm(d), "sa": T5Attention(d, h, kv, True, j == 0),
                                                "ln2": T5LayerNorm(d), "wi": nn.Linear(d, 4 * d, bias=False),
                                                "wo": nn.Linear(4 * d, d, bias=False)}) for j in range(n))
        self.dec = nn.ModuleList(nn.ModuleDict({"ln1": T5LayerNorm(d), "sa": T5Attention(d, h, kv, False, j == 0),
                                                "ln2": T5LayerNorm(d), "ca": T5Attention(d, h, kv, True, False),
                                                "ln3": T5LayerNorm(d), "wi": nn.Linear(d, 4 * d, bias=False),
                                                "wo": nn.Linear(4 * d, d, bias=False)}) for j in range(n))
        self.enc_ln, self.dec_ln = T5LayerNorm(d), T5LayerNorm(d)
        for m in self.modules():
            if isinstance(m, nn.ModuleDict) and "wi" in m:
                nn.init.normal_(m["wi"].weight, 0.0, d ** -0.5)
                nn.init.normal_(m["wo"].weight, 0.0, (4 * d) ** -0.5)
        self.d = d

    def forward(self, src, dec_in, labels):
        x, bias = self.shared(src), None
        for L in self.enc:
            a, bias = L["sa"](L["ln1"](x), bias=bias)
            x = x + a
            x = x + L["wo"](F.relu(L["wi"](L["ln2"](x))))
        enc = self.enc_ln(x)
        T = dec_in.shape[1]
        causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)
        y, sbias, cbias = self.shared(dec_in), None, None
        for L in self.dec:
            a, sbias = L["sa"](L["ln1"](y), bias=sbias, mask=causal)
            y = y + a
            a, cbias = L["ca"](L["ln2"](y), kv=enc, bias=cbias)
            y = y + a
            y = y + L["wo"](F.relu(L["wi"](L["ln3"](y))))
        y = self.dec_ln(y) * self.d ** -0.5          # tied embeddings: rescale before the shared projection
        logits = F.linear(y, self.shared.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_t5_encoder_decoder_relative_position_bias_tied_embeddings_scaled_d_model_minus_half():
    """T5 v1.0 on a toy translation (translation_pairs): RMS T5LayerNorm (variance in fp32), bucketed relative
    position bias shared across layers, the decoder's causal mask of finfo(float32).min added to the fp32 bias,
    cross-attention, ReLU FF, embeddings shared by encoder, decoder and output (N(0, 1) init, the decoder output
    scaled by d_model**-0.5), labels -100 on the padded tail; AdamW at 3e-3 (no Adafactor), no warmup."""
    torch.manual_seed(10)
    model = T5Small()

    def step_loss(i):
        g = gen(i)
        n = torch.randint(6, 11, (16,), generator=g)
        keep = torch.arange(10) < n[:, None]
        src = torch.where(keep, translation_pairs(g, 16)[0], 0)
        tgt = torch.stack([torch.cat([PERM[s[:int(k)]], torch.full((10 - int(k),), -100)]) for s, k in zip(src, n)])
        tgt = torch.cat([tgt, torch.full((16, 1), -100)], 1)
        tgt[torch.arange(16), n] = 1  # </s>
        dec_in = torch.cat([torch.zeros(16, 1, dtype=torch.long), tgt[:, :-1].clamp(min=0)], 1)
        return model(src, dec_in, tgt)

    w, losses, scales = fit(model, step_loss, steps=50, lr=3e-3)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# -- contrastive -------------------------------------------------------------------------------------------------------
class TextTower(nn.Module):
    """CLIP's text transformer: causal mask, pre-LN, features taken at the EOT token (the argmax of the ids)."""

    def __init__(self, V=72, d=32, T=10):
        super().__init__()
        self.token_embedding = nn.Embedding(V, d)
        self.positional_embedding = nn.Parameter(torch.randn(T, d) * 0.01)
        self.layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True,
                                                activation="gelu")
        self.ln_final = nn.LayerNorm(d)
        self.text_projection = nn.Parameter(torch.randn(d, d) * d ** -0.5)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.token_embedding(ids) + self.positional_embedding[:T]
        x = self.layer(x, src_mask=nn.Transformer.generate_square_subsequent_mask(T), is_causal=True)
        x = self.ln_final(x)
        return x[torch.arange(x.shape[0]), ids.argmax(-1)] @ self.text_projection


class OpenAICLIP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, d))
        self.text = TextTower(d=d)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, img, ids):
        a = F.normalize(self.visual(img), dim=-1)
        b = F.normalize(self.text(ids), dim=-1)
        logits = self.logit_scale.exp() * a @ b.t()
        return logits


def clip_pairs(i, B=48):
    """Paired views of a latent z (8 dims): an 'image' A z + noise (48 dims), a 'caption' of 8 tokens (bucket of
    z_j, offset by 8 j), [SOT]=1 first, [EOT]=71 (the largest id) last."""
    g = gen(i)
    z = torch.randn(B, 8, generator=g)
    A = torch.randn(48, 8, generator=gen(123))
    img = z @ A.T + 0.3 * torch.randn(B, 48, generator=g)
    bucket = torch.bucketize(z, torch.tensor([-1.0, -0.4, 0.0, 0.4, 1.0])).clamp(max=7)
    ids = 2 + bucket + 8 * torch.arange(8)
    return img, torch.cat([torch.ones(B, 1, dtype=torch.long), ids, torch.full((B, 1), 71)], 1)


def test_openai_clip_logit_scale_clamped_to_100_before_each_forward_eot_argmax_pooling():
    """OpenAI's training recipe as published: `model.logit_scale.data = clamp(.., 0, 4.6052)` at the top of each
    step, a causal text transformer pooled at the EOT token (ids.argmax), symmetric cross-entropy on fp32 logits,
    AdamW with no decay on gains/biases/logit_scale."""
    torch.manual_seed(11)
    model = OpenAICLIP()
    ps = list(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in ps if p.dim() >= 2 and "embedding" not in n], "weight_decay": 0.2},
        {"params": [p for n, p in ps if p.dim() < 2 or "embedding" in n], "weight_decay": 0.0}],
        lr=2e-3, betas=(0.9, 0.98), eps=1e-6)

    def before(i):
        model.logit_scale.data = torch.clamp(model.logit_scale.data, 0, 4.6052)

    def step_loss(i):
        img, ids = clip_pairs(i)
        logits = model(img, ids).float()
        y = torch.arange(len(img))
        return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2

    w, losses, scales = fit(model, step_loss, steps=50, opt=opt, before=before)
    healthy(losses, scales, fall=0.7)
    quiet(w)


class SimCSE(nn.Module):
    def __init__(self, V=32, d=32, T=24):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d, padding_idx=0), nn.Embedding(T, d)
        self.layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.Tanh())

    def forward(self, ids, mask):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        x = self.layer(x, src_key_padding_mask=~mask.bool())
        return self.mlp(x[:, 0])


def test_simcse_unsupervised_dropout_as_augmentation_temperature_0_05():
    """Unsupervised SimCSE: the same batch encoded twice (different dropout masks), cosine similarities / 0.05 in
    fp32, cross-entropy against the diagonal."""
    torch.manual_seed(12)
    model = SimCSE()

    def step_loss(i):
        ids, mask, _ = padded_arith(i, B=32)
        ids2 = torch.cat([ids, ids])
        m2 = torch.cat([mask, mask])
        z = model(ids2, m2).float()
        a, b = z.chunk(2)
        sim = F.cosine_similarity(a[:, None], b[None], dim=-1) / 0.05
        return F.cross_entropy(sim, torch.arange(len(a)))

    w, losses, scales = fit(model, step_loss, steps=40, lr=2e-3)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# -- speech ----------------------------------------------------------------------------------------------------------
class CTCModel(nn.Module):
    """Conv2d-free speech front end: two Conv1d (stride 2 each: 4x subsampling) over 20 'mel' channels, a
    bidirectional GRU, a linear to 1 + 10 labels (blank 0), log_softmax in fp32."""

    def __init__(self, F_=20, d=48, V=11):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv1d(F_, d, 3, 2, 1), nn.GELU(), nn.Conv1d(d, d, 3, 2, 1), nn.GELU())
        self.rnn = nn.GRU(d, d, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * d, V)

    def forward(self, feats):
        x = self.sub(feats.transpose(1, 2)).transpose(1, 2)
        x, _ = self.rnn(x.float())
        return F.log_softmax(self.out(x).float(), -1)


def speech(i, B=16, F_=20, V=11):
    """Utterances of 3-6 labels, each rendered as 8-12 frames of a label-specific spectral pattern with 4-8 frames
    of low-noise silence between; padded to the longest; input lengths after 4x subsampling."""
    g = gen(i)
    pats = torch.randn(V, F_, generator=gen(4242)) * 1.5
    feats, tgts, tl, il = [], [], [], []
    for _ in range(B):
        n = int(torch.randint(3, 7, (1,), generator=g))
        lab = torch.randint(1, V, (n,), generator=g)
        frames = []
        for lb in lab:
            frames.append(0.1 * torch.randn(int(torch.randint(4, 9, (1,), generator=g)), F_, generator=g))
            L = int(torch.randint(8, 13, (1,), generator=g))
            frames.append(pats[lb] + 0.5 * torch.randn(L, F_, generator=g))
        frames.append(0.1 * torch.randn(4, F_, generator=g))
        f = torch.cat(frames)
        feats.append(f)
        tgts.append(lab)
        tl.append(n)
        il.append((f.shape[0] + 3) // 4)
    T = max(f.shape[0] for f in feats)
    T += (-T) % 4
    x = torch.stack([F.pad(f, (0, 0, 0, T - f.shape[0])) for f in feats])
    return x, torch.cat(tgts), torch.tensor(il), torch.tensor(tl)


@pytest.mark.parametrize("per", ["utterance", "batch"])
def test_speech_ctc_sum_over_frames_blank_dominated_start(per):
    """CTC with reduction='sum', divided by the batch size (ESPnet: per-utterance losses of ~30 at the start) or
    not (DeepSpeech-style recipes: ~400 per batch), the blank-dominated plateau, then alignment; zero_infinity=True,
    conv subsampling + BiGRU, clip 5; fp16 autocast with a GradScaler (the GRU runs in fp32 under CPU autocast)."""
    torch.manual_seed(13)
    model = CTCModel()

    def step_loss(i):
        x, tg, il, tl = speech(i, B=12)
        lp = model(x).transpose(0, 1)
        loss = F.ctc_loss(lp, tg, il, tl, blank=0, reduction="sum", zero_infinity=True)
        return loss / x.shape[0] if per == "utterance" else loss

    w, losses, scales = fit(model, step_loss, steps=50, lr=5e-3, clip=5.0)
    assert losses[0] > (25 if per == "utterance" else 300), losses
    healthy(losses, scales, fall=0.5, max_backoffs=8)  # the batch sum: 6 halvings on the first steps, then none
    quiet(w)


# -- graphs, recsys, tabular -------------------------------------------------------------------------------------------
class GIN(nn.Module):
    """GIN layers with messages summed by scatter_add_ over a PyG-style batch (edge_index, batch vector), a mean
    readout by scatter_add_ / counts, a classifier."""

    def __init__(self, d=32, n=3):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.eps = nn.Parameter(torch.zeros(n))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, d))
                                  for _ in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x, edge_index, batch, G):
        h = self.inp(x)
        src, dst = edge_index
        for j, m in enumerate(self.mlps):
            agg = torch.zeros_like(h).scatter_add_(0, dst[:, None].expand(-1, h.shape[1]), h[src])
            h = F.relu(m((1 + self.eps[j]) * h + agg)) + h
        pooled = torch.zeros(G, h.shape[1], dtype=h.dtype).scatter_add_(0, batch[:, None].expand(-1, h.shape[1]), h)
        cnt = torch.bincount(batch, minlength=G).clamp(min=1)[:, None]
        return self.head(pooled / cnt.to(h.dtype))


def graphs(i, G=32):
    """Random graphs of 6-14 nodes of 4 types; label: more edges join a type-0 and a type-1 node than the median."""
    g = gen(i)
    xs, eis, bs, ys, off = [], [], [], [], 0
    for j in range(G):
        n = int(torch.randint(6, 15, (1,), generator=g))
        t = torch.randint(0, 4, (n,), generator=g)
        e = torch.randint(0, n, (2, 2 * n), generator=g)
        e = e[:, e[0] != e[1]]
        e = torch.cat([e, e.flip(0)], 1)
        cross = ((t[e[0]] == 0) & (t[e[1]] == 1)).sum()
        ys.append(int(cross > 1))
        xs.append(F.one_hot(t, 4).float())
        eis.append(e + off)
        bs.append(torch.full((n,), j))
        off += n
    return torch.cat(xs), torch.cat(eis, 1), torch.cat(bs), torch.tensor(ys), G


def test_gin_scatter_add_message_passing_batched_graphs_mean_readout():
    torch.manual_seed(14)
    model = GIN()

    def step_loss(i):
        x, ei, b, y, G = graphs(i)
        return F.cross_entropy(model(x, ei, b, G).float(), y)

    w, losses, scales = fit(model, step_loss, steps=60, lr=3e-3)
    healthy(losses, scales, fall=0.8, k=8)
    quiet(w)


class DLRM(nn.Module):
    """DLRM: a bottom MLP on dense features, EmbeddingBag(mode='sum') per sparse field on multi-hot offsets,
    pairwise dot interactions (bmm, the upper triangle), a top MLP, one logit."""

    def __init__(self, nd=8, fields=(50, 40, 30), d=16):
        super().__init__()
        self.bot = mlp(nd, 32, d, act=nn.ReLU)
        self.embs = nn.ModuleList(nn.EmbeddingBag(n, d, mode="sum") for n in fields)
        for e in self.embs:
            nn.init.uniform_(e.weight, -math.sqrt(1 / e.num_embeddings), math.sqrt(1 / e.num_embeddings))
        k = len(fields) + 1
        self.top = mlp(d + k * (k - 1) // 2, 64, 1, act=nn.ReLU)
        self.iu = torch.triu_indices(k, k, 1)

    def forward(self, dense, sparse):
        z = F.relu(self.bot(dense))
        feats = [z] + [e(ix, off).to(z.dtype) for e, (ix, off) in zip(self.embs, sparse)]
        T = torch.stack(feats, 1)
        inter = torch.bmm(T, T.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([z, inter], 1)).squeeze(1)


def clicks(i, B=128, nd=8, fields=(50, 40, 30)):
    g = gen(i)
    wd = torch.randn(nd, generator=gen(606))
    wf = [torch.randn(n, generator=gen(607 + j)) for j, n in enumerate(fields)]
    dense = torch.randn(B, nd, generator=g)
    sparse, score = [], dense @ wd * 0.5
    for n, wj in zip(fields, wf):
        cnt = torch.randint(1, 4, (B,), generator=g)
        ix = torch.randint(0, n, (int(cnt.sum()),), generator=g)
        off = torch.cat([torch.zeros(1, dtype=torch.long), cnt.cumsum(0)[:-1]])
        sparse.append((ix, off))
        score = score + torch.zeros(B).index_add_(0, torch.repeat_interleave(torch.arange(B), cnt), wj[ix])
    y = (torch.rand(B, generator=g) < torch.sigmoid(score)).float()
    return dense, sparse, y


def test_dlrm_embedding_bag_multi_hot_dot_interactions_bce_click_labels():
    torch.manual_seed(15)
    model = DLRM()

    def step_loss(i):
        dense, sparse, y = clicks(i)
        return F.binary_cross_entropy_with_logits(model(dense, sparse).float(), y)

    w, losses, scales = fit(model, step_loss, steps=60, lr=1e-2)
    healthy(losses, scales, fall=0.9, k=8)
    quiet(w)


class FTTransformer(nn.Module):
    """FT-Transformer: each numeric feature tokenised as x_j * W_j + b_j, categorical ones by embeddings, a [CLS]
    token, pre-LN transformer layers, the head on [CLS]."""

    def __init__(self, nn_=6, cats=(5, 7), d=32):
        super().__init__()
        self.W, self.b = nn.Parameter(torch.randn(nn_, d) * d ** -0.5), nn.Parameter(torch.zeros(nn_, d))
        self.cat = nn.ModuleList(nn.Embedding(c, d) for c in cats)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * d ** -0.5)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, xn, xc):
        tok = xn[..., None] * self.W + self.b
        tok = torch.cat([self.cls.expand(len(xn), -1, -1), tok] + [e(xc[:, j])[:, None] for j, e in
                                                                      enumerate(self.cat)], 1)
        for L in self.layers:
            tok = L(tok)
        return self.head(tok[:, 0]).squeeze(1)


def tabular(i, B=128):
    g = gen(i)
    xn = torch.randn(B, 6, generator=g)
    xc = torch.stack([torch.randint(0, 5, (B,), generator=g), torch.randint(0, 7, (B,), generator=g)], 1)
    ce = torch.randn(5, generator=gen(71))[xc[:, 0]] + torch.randn(7, generator=gen(72))[xc[:, 1]]
    y = xn[:, 0] * xn[:, 1] + torch.sin(2 * xn[:, 2]) + ce + 0.1 * torch.randn(B, generator=g)
    return xn, xc, y


def test_ft_transformer_tabular_regression_bf16_without_a_scaler():
    """The bf16 path: autocast(bfloat16), no GradScaler, plain backward/clip/step; AdamW with weight decay 1e-5 but
    none on the feature tokenizer and norms (the paper's recipe)."""
    torch.manual_seed(16)
    model = FTTransformer()
    ps = list(model.named_parameters())
    nodecay = [p for n, p in ps if n in ("W", "b", "cls") or "norm" in n or n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if all(p is not q for q in nodecay)],
                              "weight_decay": 1e-5}, {"params": nodecay, "weight_decay": 0.0}], lr=2e-3)

    def step_loss(i):
        xn, xc, y = tabular(i)
        return F.mse_loss(model(xn, xc).float(), y)

    w, losses, scales = fit(model, step_loss, steps=50, opt=opt, dtype=BF16)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# -- seq2seq -----------------------------------------------------------------------------------------------------------
class BahdanauSeq2Seq(nn.Module):
    def __init__(self, V=20, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.enc = nn.GRU(d, d, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * d, d)
        self.Wa, self.Ua, self.va = nn.Linear(d, d, bias=False), nn.Linear(2 * d, d), nn.Linear(d, 1, bias=False)
        self.cell = nn.GRUCell(d + 2 * d, d)
        self.out = nn.Linear(3 * d, V)

    def forward(self, src, tgt, tf_mask):
        """Teacher forcing per step and sequence where tf_mask is True, else the model's own argmax."""
        e, _ = self.enc(self.emb(src).float())
        keys = self.Ua(e)
        h = torch.tanh(self.bridge(e.mean(1))).float()
        prev = torch.ones(len(src), dtype=torch.long)
        outs = []
        for t in range(tgt.shape[1]):
            a = self.va(torch.tanh(self.Wa(h)[:, None] + keys)).squeeze(-1).float().softmax(-1)
            ctx = torch.bmm(a[:, None].to(e.dtype), e).squeeze(1)
            h = self.cell(torch.cat([self.emb(prev).float(), ctx.float()], -1), h)
            logit = self.out(torch.cat([h, ctx.float()], -1))
            outs.append(logit)
            prev = torch.where(tf_mask[:, t], tgt[:, t], logit.argmax(-1))
        return torch.stack(outs, 1)


def test_seq2seq_gru_bahdanau_attention_teacher_forcing_ratio_0_5():
    """Reverse the source: a bidirectional GRU encoder, additive attention, a GRUCell decoder fed the gold token with
    probability 0.5 per step (else its own argmax), cross-entropy over the steps."""
    torch.manual_seed(17)
    model = BahdanauSeq2Seq()

    def step_loss(i):
        g = gen(i)
        src = torch.randint(3, 20, (32, 8), generator=g)
        tgt = src.flip(1)
        tf = torch.rand(32, 8, generator=g) < 0.5
        return F.cross_entropy(model(src, tgt, tf).float().flatten(0, 1), tgt.flatten())

    w, losses, scales = fit(model, step_loss, steps=60, lr=5e-3)
    healthy(losses, scales, fall=0.7)
    quiet(w)


class NoamTransformer(nn.Module):
    """The Annotated Transformer: nn.Transformer, source/target/generator embeddings shared and multiplied by
    sqrt(d_model), sinusoidal positions, key padding masks."""

    def __init__(self, V=24, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        nn.init.xavier_uniform_(self.emb.weight)
        self.tf = nn.Transformer(d, 4, 1, 1, 64, dropout=0.1, batch_first=True)
        pos = torch.arange(32)[:, None] * torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(32, d)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos), torch.cos(pos)
        self.register_buffer("pe", pe)
        self.d = d

    def embed(self, ids):
        return self.emb(ids) * math.sqrt(self.d) + self.pe[:ids.shape[1]]

    def forward(self, src, dec_in):
        T = dec_in.shape[1]
        y = self.tf(self.embed(src), self.embed(dec_in), tgt_mask=torch.ones(T, T, dtype=torch.bool).triu(1),
                    src_key_padding_mask=src == 0, tgt_key_padding_mask=dec_in == 0,
                    memory_key_padding_mask=src == 0, tgt_is_causal=True)
        return F.linear(y, self.emb.weight)


def test_annotated_transformer_noam_schedule_shared_embeddings_times_sqrt_d_label_smoothing():
    """The toy translation of translation_pairs. lr = factor * d_model**-0.5 * min(step**-0.5, step *
    warmup**-1.5) through LambdaLR (warmup 10, factor 0.2: a peak of 1.1e-2), Adam betas (0.9, 0.98) eps 1e-9, label
    smoothing 0.1 with padding ignored, embeddings x sqrt(d_model)."""
    torch.manual_seed(18)
    model = NoamTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.2 * 32 ** -0.5 * min((s + 1) ** -0.5,
                                                                                          (s + 1) * 10 ** -1.5))

    def step_loss(i):
        g = gen(i)
        n = torch.randint(4, 11, (32,), generator=g)
        src, tgt = translation_pairs(g, 32)
        src, tgt = src * (torch.arange(10) < n[:, None]), tgt * (torch.arange(10) < n[:, None])
        dec_in = torch.cat([torch.ones(32, 1, dtype=torch.long), tgt[:, :-1]], 1)
        return F.cross_entropy(model(src, dec_in).float().flatten(0, 1), tgt.flatten(), ignore_index=0,
                               label_smoothing=0.1)

    w, losses, scales = fit(model, step_loss, steps=60, opt=opt, sched=sched)
    healthy(losses, scales, fall=0.7)
    quiet(w)


# -- mixture of experts ------------------------------------------------------------------------------------------------
class NoisyTopKMoE(nn.Module):
    """Shazeer et al. 2017: gate logits + N(0, 1) * softplus(x W_noise) while training, top-2 renormalised, the
    importance loss CV(sum of gates)^2 in fp32 added with weight 0.01."""

    def __init__(self, d=32, e=4, h=64):
        super().__init__()
        self.w_gate, self.w_noise = nn.Linear(d, e, bias=False), nn.Linear(d, e, bias=False)
        nn.init.zeros_(self.w_gate.weight)
        nn.init.zeros_(self.w_noise.weight)
        self.experts = nn.ModuleList(mlp(d, h, d) for _ in range(e))
        self.e = e
        self.aux = None

    def forward(self, x):
        clean = self.w_gate(x).float()
        if self.training:
            noise = torch.randn_like(clean) * (F.softplus(self.w_noise(x).float()) + 1e-2)
            logits = clean + noise
        else:
            logits = clean
        top, idx = logits.topk(2, -1)
        gates = torch.zeros_like(logits).scatter(1, idx, top.softmax(-1))
        imp = gates.sum(0)
        self.aux = imp.var(unbiased=False) / (imp.mean() ** 2 + 1e-10)
        out = torch.zeros_like(x)
        for j, ex in enumerate(self.experts):
            sel = (idx == j).any(-1)
            if sel.any():
                out = out.index_add(0, sel.nonzero().squeeze(1), (gates[sel, j, None] * ex(x[sel]).float()).to(x.dtype))
        return out


class MoEClassifier(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp, self.moe, self.ln, self.head = nn.Linear(16, d), NoisyTopKMoE(d), nn.LayerNorm(d), nn.Linear(d, 8)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.ln(h + self.moe(h)))


def test_noisy_top2_gating_moe_importance_cv_squared_auxiliary_loss():
    torch.manual_seed(19)
    model = MoEClassifier()
    auxes = []

    def step_loss(i):
        x, y = clusters(128, i, spread=1.5)
        loss = F.cross_entropy(model(x).float(), y)
        auxes.append(model.moe.aux.item())
        return loss + 0.01 * model.moe.aux

    w, losses, scales = fit(model, step_loss, steps=50, lr=3e-3)
    healthy(losses, scales, fall=0.6)
    assert all(map(math.isfinite, auxes)) and sum(auxes[-10:]) / 10 < 1.0, auxes
    quiet(w)


# -- loop shapes -------------------------------------------------------------------------------------------------------
def test_validation_every_5_steps_early_stopping_bookkeeping_best_state_dict_deepcopy():
    """model.eval() / torch.no_grad() validation every 5 steps on a fixed set with dropout 0.3 in the model, the best
    state_dict deep-copied whenever the validation loss improves, a patience counter (never triggered here)."""
    torch.manual_seed(20)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.ReLU(),
                          nn.Dropout(0.3), nn.Linear(64, 8))
    xv, yv = clusters(256, 9999, spread=1.5)
    best, best_state, bad, vals = float("inf"), None, 0, []

    def step_loss(i):
        x, y = clusters(128, i, spread=1.5)
        return F.cross_entropy(model(x).float(), y)

    def after(i):
        nonlocal best, best_state, bad
        if (i + 1) % 5:
            return
        model.eval()
        with torch.autocast("cpu", dtype=FP16):
            v = F.cross_entropy(model(xv).float(), yv).item()
        model.train()
        vals.append(v)
        if v < best - 1e-4:
            best, best_state, bad = v, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
        assert bad < 3

    model.train()
    w, losses, scales = fit(model, step_loss, steps=50, lr=2e-3, after=after)
    healthy(losses, scales, fall=0.6)
    assert vals[-1] < 0.5 * vals[0] and best_state is not None, vals
    quiet(w)


def test_zero_grad_set_to_none_false_amsgrad_two_heads_used_on_alternate_steps():
    """`optimizer.zero_grad(set_to_none=False)`: the head not used on a step keeps an all-zero gradient that Adam
    (amsgrad) still steps with its momentum."""
    torch.manual_seed(21)
    model = nn.ModuleDict({"body": mlp(16, 64, 64, act=nn.SiLU), "a": nn.Linear(64, 8), "b": nn.Linear(64, 2)})
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, amsgrad=True)
    la, lb = [], []

    def step_loss(i):
        x, y = clusters(128, i, spread=1.5)
        h = model["body"](x)
        if i % 2 == 0:
            loss = F.cross_entropy(model["a"](h).float(), y)
            la.append(loss.item())
        else:
            loss = F.cross_entropy(model["b"](h).float(), (y % 2))
            lb.append(loss.item())
        return loss

    w, losses, scales = fit(model, step_loss, steps=50, opt=opt, set_to_none=False)
    healthy(la, scales, fall=0.6)
    healthy(lb, fall=0.8)
    assert model["a"].weight.grad is not None
    quiet(w)


def test_reduce_lr_on_plateau_patience_8_stepped_on_a_smoothed_training_loss():
    """ReduceLROnPlateau(factor 0.5, patience 8, threshold 1e-2) stepped after every optimizer step on an EMA of the
    training loss, on a noisy regression that reaches its noise floor: the lr is halved at least once."""
    torch.manual_seed(22)
    model = mlp(8, 64, 64, 1, act=nn.Tanh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=8, threshold=1e-2)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc)
    losses, scales, smooth = [], [], None
    for i in range(70):
        g = gen(i)
        x = torch.randn(128, 8, generator=g)
        y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] + 0.3 * torch.randn(128, 1, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.mse_loss(model(x).float(), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        smooth = loss.item() if smooth is None else 0.8 * smooth + 0.2 * loss.item()
        plateau.step(smooth)
        losses.append(loss.item())
        scales.append(sc.get_scale())
    w.close()
    healthy(losses, scales, fall=0.5)
    assert opt.param_groups[0]["lr"] < 1e-2, opt.param_groups[0]["lr"]
    quiet(w)


def test_dataloader_recreated_every_epoch_drop_last_false_last_batch_of_size_1():
    """97 samples, batch 32, drop_last=False: batches of 32, 32, 32 and 1 per epoch; a new shuffled DataLoader each
    epoch (its own generator), 10 epochs; a LayerNorm MLP (no BatchNorm: a batch of one must train too)."""
    torch.manual_seed(23)
    X, Y = clusters(97, 31337, spread=1.5)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc)
    losses, scales, sizes, epoch_loss = [], [], [], []
    for epoch in range(10):
        loader = DataLoader(TensorDataset(X, Y), batch_size=32, shuffle=True, drop_last=False,
                            generator=gen(epoch))
        tot, n = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(model(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            losses.append(loss.item())
            scales.append(sc.get_scale())
            sizes.append(len(y))
            tot, n = tot + loss.item() * len(y), n + len(y)
        epoch_loss.append(tot / n)
    w.close()
    assert sizes[:4] == [32, 32, 32, 1]
    assert all(map(math.isfinite, losses))
    healthy(epoch_loss, scales, fall=0.5, k=2)
    quiet(w)


# -- more model families -----------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """PEFT's LoRA around a frozen base Linear: A kaiming-uniform, B zeros, scaling alpha / r, dropout on the input
    of the adapter path; the adapters stay fp32 whatever the base's dtype."""

    def __init__(self, base, r=4, alpha=8, p=0.05):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.drop, self.scaling = nn.Dropout(p), alpha / r

    def forward(self, x):
        return self.base(x) + (self.drop(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def test_lora_fine_tune_frozen_fp16_base_fp32_adapters_on_q_v_and_a_new_fp32_head():
    """A TinyBert pretrained in fp32 (40 unwatched steps on 3 topics), then loaded the way a user does for a LoRA
    fine-tune on a budget: the base cast to fp16 and frozen (its LayerNorms kept fp32, as
    prepare_model_for_kbit_training does), LoRA r=4 on every query/value projection, a new fp32 classifier for 6
    finer topics; only the adapters and the head in AdamW (lr 2e-3), fp16 autocast with a GradScaler."""
    torch.manual_seed(24)
    model = TinyBert()
    pre = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(40):
        pre.zero_grad()
        ids, mask, y = padded_arith(60_000 + i, B=32)
        model(ids, mask, labels=y)["loss"].backward()
        pre.step()
    model.requires_grad_(False).half()
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.float()
    for layer in model.layers:
        layer.query, layer.value = LoRALinear(layer.query), LoRALinear(layer.value)
    model.classifier = nn.Linear(32, 6)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in trainable) and len(trainable) == 4 * 2 + 2
    assert model.layers[0].intermediate.weight.dtype == FP16

    def step_loss(i):
        ids, mask, k = padded_arith(i, B=32)
        fine = 2 * k + (ids[:, 1] % 2)          # the topic and the parity of the first token
        return model(ids, mask, labels=fine)["loss"]

    w, losses, scales = fit(model, step_loss, steps=50, opt=torch.optim.AdamW(trainable, lr=2e-3))
    healthy(losses, scales, fall=0.7)
    quiet(w)


class PaddedCausalLM(nn.Module):
    """A decoder whose 4-D additive mask is built the transformers way, in the autocast dtype: a causal
    full(min_dtype).triu(1) with the padded keys masked_fill'ed to min_dtype (never min + min), where
    min_dtype = finfo(autocast dtype).min; passed to SDPA as a float attn_mask."""

    def __init__(self, V=32, d=32, h=4, n=2, T=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d),
                                                   "o": nn.Linear(d, d), "ln2": nn.LayerNorm(d),
                                                   "ff": mlp(d, 4 * d, d)}) for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, V)
        self.h = h

    def forward(self, idx, attn):
        B, T = idx.shape
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        min_dtype = torch.finfo(dtype).min
        mask = torch.full((T, T), min_dtype, dtype=dtype).triu(1)[None, None].expand(B, 1, T, T).clone()
        mask = mask.masked_fill(~attn.bool()[:, None, None, :], min_dtype)
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.blocks:
            q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in b["qkv"](b["ln1"](x)).chunk(3, -1))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
            x = x + b["o"](a.transpose(1, 2).reshape(B, T, -1))
            x = x + b["ff"](b["ln2"](x))
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_variable_lengths_padding_mask_finfo_min_of_the_autocast_dtype_through_sdpa(dtype):
    """Right-padded batches of lengths 4..24 (the padded positions' labels -100)."""
    torch.manual_seed(25)
    model = PaddedCausalLM()

    def step_loss(i):
        x, _ = arith(i, T=25)
        lens = torch.randint(5, 26, (16,), generator=gen(70_000 + i))
        keep = torch.arange(25) < lens[:, None]
        ids = torch.where(keep, x, 0)
        labels = torch.where(keep[:, 1:], x[:, 1:], -100)
        return F.cross_entropy(model(ids[:, :-1], keep[:, :-1]).float().flatten(0, 1), labels.flatten(),
                               ignore_index=-100)

    w, losses, scales = fit(model, step_loss, steps=40, lr=3e-3, dtype=dtype)
    healthy(losses, scales, fall=0.6)
    quiet(w)


class SwinBlock(nn.Module):
    """Swin: attention inside 4x4 windows with a learned relative position bias table ((2w-1)^2 x heads, gathered
    through a relative_position_index buffer), cyclic shift by w/2 with the shifted-window mask filled with -100.0
    (the reference code's constant), pre-LN, MLP."""

    def __init__(self, d, h, H, win=4, shift=0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = mlp(d, 4 * d, d)
        self.table = nn.Parameter(torch.zeros((2 * win - 1) ** 2, h))
        nn.init.trunc_normal_(self.table, std=0.02)
        c = torch.stack(torch.meshgrid(torch.arange(win), torch.arange(win), indexing="ij")).flatten(1)
        rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0) + win - 1
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * win - 1) + rel[..., 1])
        if shift:
            img = torch.zeros(H, H)
            cnt = 0
            for hs in (slice(0, -win), slice(-win, -shift), slice(-shift, None)):
                for ws in (slice(0, -win), slice(-win, -shift), slice(-shift, None)):
                    img[hs, ws] = cnt
                    cnt += 1
            mw = img.view(H // win, win, H // win, win).transpose(1, 2).reshape(-1, win * win)
            am = mw[:, None, :] - mw[:, :, None]
            self.register_buffer("attn_mask", am.masked_fill(am != 0, -100.0).masked_fill(am == 0, 0.0))
        else:
            self.attn_mask = None
        self.h, self.win, self.shift, self.H = h, win, shift, H

    def forward(self, x):
        B, L, C = x.shape
        H, w = self.H, self.win
        y = self.norm1(x).view(B, H, H, C)
        if self.shift:
            y = torch.roll(y, (-self.shift, -self.shift), (1, 2))
        y = y.view(B, H // w, w, H // w, w, C).transpose(2, 3).reshape(-1, w * w, C)
        nW = (H // w) ** 2
        q, k, v = (t.view(-1, w * w, self.h, C // self.h).transpose(1, 2) for t in self.qkv(y).chunk(3, -1))
        attn = (q * (C // self.h) ** -0.5) @ k.transpose(-2, -1)
        attn = attn + self.table[self.relative_position_index].permute(2, 0, 1)[None]
        if self.attn_mask is not None:
            attn = attn.view(B, nW, self.h, w * w, w * w) + self.attn_mask[None, :, None]
            attn = attn.view(-1, self.h, w * w, w * w)
        y = (attn.softmax(-1) @ v).transpose(1, 2).reshape(-1, w * w, C)
        y = self.proj(y).view(B, H // w, H // w, w, w, C).transpose(2, 3).reshape(B, H, H, C)
        if self.shift:
            y = torch.roll(y, (self.shift, self.shift), (1, 2))
        x = x + y.reshape(B, L, C)
        return x + self.mlp(self.norm2(x))


class TinySwin(nn.Module):
    def __init__(self, d=32, k=4):
        super().__init__()
        self.patch_embed, self.norm0 = nn.Linear(3 * 2 * 2, d), nn.LayerNorm(d)
        self.blocks = nn.Sequential(SwinBlock(d, 4, 8), SwinBlock(d, 4, 8, shift=2))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, k)

    def forward(self, img):
        p = F.unfold(img, 2, stride=2).transpose(1, 2)      # the 2x2 stride-2 patch conv as a Linear on patches
        x = self.blocks(self.norm0(self.patch_embed(p)))
        return self.head(self.norm(x).mean(1))


def test_swin_shifted_windows_relative_position_bias_table_mask_minus_100():
    torch.manual_seed(26)
    model = TinySwin()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    def step_loss(i):
        x, y = images(32, i)
        return F.cross_entropy(model(x).float(), y, label_smoothing=0.1)

    w, losses, scales = fit(model, step_loss, steps=40, opt=opt, sched=sched, clip=5.0)
    healthy(losses, scales, fall=0.6)
    quiet(w)


class Electra(nn.Module):
    """ELECTRA: a small MLM generator and a discriminator sharing the token (and position) embeddings; the
    generator's samples (multinomial from its detached softmax) replace the masked tokens; the discriminator
    predicts which tokens were replaced; loss = MLM + 50 x replaced-token BCE."""

    def __init__(self, V=32, d=32, T=24):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        self.gen = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        self.gen_head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.gen_bias = nn.Parameter(torch.zeros(V))
        self.disc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True), 2,
                                          enable_nested_tensor=False)
        self.disc_head = nn.Linear(d, 1)

    def embed(self, ids):
        return self.emb(ids) + self.pos(torch.arange(ids.shape[1]))

    def forward(self, masked, labels, pad, g):
        h = self.gen_head(self.gen(self.embed(masked), src_key_padding_mask=pad))
        glogits = F.linear(h, self.emb.weight, self.gen_bias).float()
        mlm = F.cross_entropy(glogits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        picked = labels != -100
        with torch.no_grad():
            probs = glogits[picked].softmax(-1)
            sampled = torch.multinomial(probs, 1, generator=g).squeeze(1)
        corrupt = masked.clone()
        corrupt[picked] = sampled
        orig = torch.where(picked, labels, masked)
        is_rep = (corrupt != orig).float()
        d = self.disc_head(self.disc(self.embed(corrupt), src_key_padding_mask=pad)).squeeze(-1).float()
        bce = F.binary_cross_entropy_with_logits(d[~pad], is_rep[~pad])
        return mlm + 50.0 * bce


def test_electra_generator_discriminator_shared_embeddings_replaced_token_detection_weight_50():
    torch.manual_seed(27)
    model = Electra()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

    def step_loss(i):
        ids, mask, labels = mlm_batch(i)
        return model(ids, labels, ~mask.bool(), gen(80_000 + i))

    w, losses, scales = fit(model, step_loss, steps=50, opt=opt)
    healthy(losses, scales, fall=0.7)
    quiet(w)


class WaveNet(nn.Module):
    """Causal dilated Conv1d stack (dilations 1, 2, 4, 8) with gated tanh x sigmoid units, residual and skip 1x1
    convs, a 64-way mu-law softmax over the next sample."""

    def __init__(self, Q=64, c=16):
        super().__init__()
        self.inp = nn.Conv1d(Q, c, 1)
        self.dil = nn.ModuleList(nn.Conv1d(c, 2 * c, 2, dilation=2 ** j) for j in range(4))
        self.res = nn.ModuleList(nn.Conv1d(c, c, 1) for _ in range(4))
        self.skip = nn.ModuleList(nn.Conv1d(c, c, 1) for _ in range(4))
        self.out = nn.Sequential(nn.ReLU(), nn.Conv1d(c, c, 1), nn.ReLU(), nn.Conv1d(c, Q, 1))
        self.Q = Q

    def forward(self, q):
        x = self.inp(F.one_hot(q, self.Q).float().transpose(1, 2))
        skips = 0
        for j, (d, r, s) in enumerate(zip(self.dil, self.res, self.skip)):
            a, b = d(F.pad(x, (2 ** j, 0))).chunk(2, 1)
            z = torch.tanh(a) * torch.sigmoid(b)
            x = x + r(z)
            skips = skips + s(z)
        return self.out(skips)


def mu_law(x, Q=64):
    mu = Q - 1
    y = torch.sign(x) * torch.log1p(mu * x.abs()) / math.log1p(mu)
    return ((y + 1) / 2 * mu + 0.5).long().clamp(0, mu)


def test_wavenet_gated_dilated_causal_conv1d_mu_law_64_way_softmax_bf16():
    """Sines of random frequency and phase (amplitude 0.8) mu-law quantised; next-sample cross-entropy; bf16."""
    torch.manual_seed(28)
    model = WaveNet()

    def step_loss(i):
        g = gen(i)
        f = torch.rand(16, 1, generator=g) * 0.2 + 0.05
        ph = torch.rand(16, 1, generator=g) * 6.28
        q = mu_law(0.8 * torch.sin(f * torch.arange(65) + ph))
        return F.cross_entropy(model(q[:, :-1]).float(), q[:, 1:])

    w, losses, scales = fit(model, step_loss, steps=50, lr=5e-3, dtype=BF16)
    healthy(losses, scales, fall=0.7)
    quiet(w)
