"""Twenty-fourth set: fp16 failures in non-LLM model families (contrastive, VAE, dense tagging, gated linear
recurrence, diffusion, GNN, audio), written the way those repos write them and watched through the public API only
(watch(model, optimizer=, scaler=) -> an ordinary fp16 autocast + GradScaler("cpu") loop -> w.report()) at
ampdoctor's DEFAULT sampling (no `every=`), each failure starting mid-run (step 4 or 5) through the data or through
training dynamics, never at step 0.

 1. CLIP in HF CLIPModel's layout (logits = text @ image.T * logit_scale.exp() and the loss inside the root's
    forward), fine-tuned from an fp32 checkpoint with the temperature in its own param group (high lr, no decay) and
    no clamp (FP16.md: "contrastive logit scale exp(t) * sim"): training dynamics push logit_scale past 11.09; at
    step 5 exp(logit_scale) * cos passes 65504 in the root's own mul (not the towers) -> overflow at "" (root);
 2. the same, OpenCLIP's layout: forward returns (image_features, text_features, logit_scale.exp()) and ClipLoss
    multiplies outside the model: the root's fp32 scale is finite, the fp16 product in the loss is not -> module null;
 3. AntixK/PyTorch-VAE's layout: `loss_function` is a method called by the experiment after forward, KLD =
    -0.5 * sum(1 + log_var - mu^2 - log_var.exp()) in fp16 under the loop's autocast; one clip per batch from a shard
    cached as raw dB (not (db + 80) / 80) from step 4: log_var ~ 15-18, exp is inf in fp16 (finite in fp32, and the
    model's own exp(0.5 * log_var) stays finite) -> module null (loss outside the model);
 4. a multi-label tagger whose criterion (a child module called in forward, as detection heads hold `loss_cls`) is a
    hand-written sigmoid focal loss -(t log p + (1 - t) log(1 - p)): a second camera's shard with 4x the feature
    scale (step 4) makes confident logits (> 8.32, < -16.6); fp16 sigmoid is exactly 1 / 0, log gives -inf,
    0 * -inf = NaN -> `criterion`;
 5. the same criterion with BCE from the logits but gamma = 0.5 (a backward-only failure): at 2.5x gain the negative
    logits reach -13 (p_t == 1 in fp16, not in fp32); 0 ** 0.5 = 0 forward, PowBackward's 0 ** -0.5 = inf, the
    sigmoid's backward 0 * inf = NaN -> `criterion`, backward;
 6. an IMU activity recogniser of HGRN-style gated linear recurrences (Qin et al. 2023) in the "parallel" form
    h = exp(L) * cumsum(exp(-L) * u), L = cumsum(logsigmoid(f_proj(x))): the curriculum's 64-sample windows (step 4)
    make -L > 20, exp(-L) = inf, exp(L) = 0, 0 * inf = NaN in `layers.0.mixer` (not its Linear children);
 7. a latent DDPM trained lucidrains-style (the watched model is the GaussianDiffusion wrapper) on cached fp16
    latents, alphas_cumprod cast to the latents' dtype (diffusers' add_noise), with an x0 auxiliary loss through
    predict_start_from_noise (x_t - sqrt(1 - ab) eps) / sqrt(ab): the cosine schedule's last alpha_bar (2.4e-9) is 0
    in fp16; the first t = 999 (step 4) divides by 0 in the wrapper's own code -> "" (root), not the denoiser;
 8. an air-quality sensor GNN with an adaptive Gaussian-kernel adjacency over learned location embeddings and
    DCRNN's random-walk normalisation D^-1 W (no self-loops), aggregated with index_add_: a new sensor 4 km outside
    the city (step 4) has every kernel weight below fp16's smallest subnormal, deg = 0, w / deg = 0 / 0 = NaN ->
    `convs.0` (fp32: tiny but finite);
 9. a keyword spotter's wav2vec2-style feature extractor whose first GroupNorm (one group per channel) is hand-written
    in the working dtype: a new microphone's unnormalised clip (one per batch from step 4) makes conv0's squared
    deviations inf, var = inf, and most channels of that clip are silently divided to a constant (no inf/NaN in any
    output, no skip) -> should be overflow at `fe.norm0`, step 4.
Healthy twins (the fix applied, the same special batches; no warning and no error): 1 with the scale clamped at
ln 100 (OpenCLIP), 4 with the whole focal loss in fp32 from the logits (torchvision's form), 6 with the scan in fp32
(autocast disabled, .float(): what fused scan kernels do).

Each failure is first proven real by an independent oracle in the loop itself: forward hooks on every module (the
root included) name the first module whose output is non-finite while its inputs and own parameters/buffers were
finite, or show that none is (2, 3: the loss computation outside the model); for 5 full backward hooks and parameter
hooks name the first module whose gradient is non-finite while the gradient reaching it was finite, with a finite
forward; the scaler's first skip is that step; the case's mechanism is measured (logit_scale and the logits' peak the
step before, log_var's range, the logits' range, -L, alpha_bar in fp16, the dead channels) and the same batch in fp32
is finite. Then ampdoctor's report must hold an `error` of the right rule (overflow / nan_origin; underflow accepted
where a flush to zero is the root cause) at that module among the first three findings, at that step and phase, with
no error at the modules that only passed the value on. Same results with ONEDNN_MAX_CPU_ISA=AVX2 and
AVX512_CORE_BF16.

What ampdoctor got wrong (strict xfail):
- 9: the report holds no warning or error at all (exit code 0): the variance overflow inside the hand-written norm
  from step 4 on returns constants, no inf/NaN reaches any module output, nothing is skipped, and none of steps 1-9 is
  a sampled step; it should be `overflow` at `fe.norm0`, step 4, forward (README's known limitation on silent norm
  overflow: only a later sampled step would see it; in a 10-step run there is none).
Right: 1 (overflow at (root) aten::mul step 5), 2 (nan_origin at module null step 5), 3 (overflow at module null
step 4; also, rightly, a real backward overflow at fc4 from the huge std of the same clip), 4 (overflow + underflow
at criterion aten::log step 4), 5 (overflow at criterion, PowBackward0, step 4, backward), 6 (overflow at
layers.0.mixer aten::exp step 4), 7 (overflow + underflow at (root) aten::div step 4), 8 (nan_origin at convs.0
aten::div step 4), and the three twins are quiet.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scenarios import alarms, lines, no_error_at, one_thread


one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

import ampdoctor  # noqa: E402

BAD = ("overflow", "nan_origin")


def _xf(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


def at(rep, rules, module, step, phase=None):
    """An error finding of one of `rules` at `module` (None: outside every module), at `step`, among the report's
    first three (phase checked where the finding states one); the report's exit code is 1."""
    hits = [f for f in rep.findings[:3] if f.module == module and f.rule in rules and f.severity == "error"
            and f.step == step and (phase is None or f.phase in (None, phase))]
    assert hits, (module, rules, step, lines(rep))
    assert rep.exit_code == 1, lines(rep)
    return hits[0]


def _finite(x):
    if torch.is_tensor(x):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        return all(_finite(t) for t in x)
    if isinstance(x, dict):
        return all(_finite(t) for t in x.values())
    return True


class Oracle:
    """Forward hooks on every module (the root included): the first (module, step) whose output is non-finite while
    its inputs and own parameters and buffers were finite (`first`). With `backward=True` also full backward
    (pre-)hooks and hooks on each module's own parameters: the first (module, step) whose gradient w.r.t. its inputs
    or own parameters is non-finite while the gradient reaching its outputs was finite (`first_bwd`)."""

    def __init__(self, m, backward=False):
        self.step, self.first, self.first_bwd, self.gout_ok, self.hs = 0, None, None, {}, []
        for n, mod in m.named_modules():
            self.hs.append(mod.register_forward_hook(self._fwd(n)))
            if backward:
                self.hs.append(mod.register_full_backward_pre_hook(self._pre(n)))
                self.hs.append(mod.register_full_backward_hook(self._bwd(n)))
                for p in mod.parameters(recurse=False):
                    self.hs.append(p.register_hook(self._param(n)))

    def _fwd(self, n):
        def f(mod, inp, out):
            own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
            if self.first is None and _finite(inp) and not _finite(out) and _finite(own):
                self.first = (n, self.step)
        return f

    def _pre(self, n):
        def f(mod, gout):
            self.gout_ok[n] = _finite([g for g in gout if g is not None])
        return f

    def _bwd(self, n):
        def f(mod, gin, gout):
            if self.first_bwd is None and _finite([g for g in gout if g is not None]) and \
                    not _finite([g for g in gin if g is not None]):
                self.first_bwd = (n, self.step)
        return f

    def _param(self, n):
        def f(g):
            if self.first_bwd is None and self.gout_ok.get(n, True) and not _finite(g):
                self.first_bwd = (n, self.step)
        return f

    def remove(self):
        for h in self.hs:
            h.remove()


def train_loop(m, batch, loss_fn, steps, *, lr=3e-3, init_scale=1024.0, opt=None, probe=None, backward=False):
    """AdamW (or `opt(m)`) + GradScaler("cpu"): forward under fp16 autocast -> loss_fn(out, y) (under autocast, as
    the user's loop computes it) -> scale(loss).backward() -> unscale_ -> clip -> step -> update, watched at
    ampdoctor's default sampling (no `every=`). `probe(m, out, step)` records the case's own mechanism. Returns the
    closed watch and the oracle's results."""
    opt = opt(m) if opt else torch.optim.AdamW(m.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    orc = Oracle(m, backward)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    skipped, bad_loss, losses, seen = [], [], [], []
    try:
        for step in range(steps):
            orc.step = step
            opt.zero_grad()
            args, y = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(*args)
                loss = loss_fn(out, y)
            if probe:
                seen.append(probe(m, out, step))
            if not torch.isfinite(loss):
                bad_loss.append(step)
            losses.append(loss.item())
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            before = sc.get_scale()
            sc.step(opt)
            sc.update()
            if sc.get_scale() < before:
                skipped.append(step)
    finally:
        w.close()
        orc.remove()
    return dict(w=w, first=orc.first, first_bwd=orc.first_bwd, skipped=skipped, bad_loss=bad_loss, losses=losses, seen=seen)


def healthy(r, must_fall=0.9):
    ls = r["losses"]
    assert all(map(math.isfinite, ls)) and not r["skipped"] and r["first"] is None, r
    k = max(1, len(ls) // 4)
    assert sum(ls[-k:]) < must_fall * sum(ls[:k]), ls
    rep = r["w"].report()
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)
    return rep


def _own(out, y):
    """The model computed its own loss (HF `return_loss=True`, a diffusion wrapper, a criterion held by the model)."""
    return out["loss"]


# ======================================================================================================================
# 1. CLIP (HF CLIPModel layout): logits = text @ image.T * logit_scale.exp() and the loss inside the root's forward;
#    the temperature, unclamped, climbs with training; once exp(logit_scale) * cos passes 65504 the fp16 logits are inf
# ======================================================================================================================
class Tower(nn.Module):
    def __init__(self, din, d):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(din, 64), nn.GELU(), nn.Linear(64, 64)
        self.proj = nn.Linear(64, d, bias=False)

    def forward(self, x):
        return self.proj(self.fc2(self.act(self.fc1(x))))


class CLIP(nn.Module):
    def __init__(self, d=32, clamp=None, open_clip=False):
        super().__init__()
        self.vision_model, self.text_model = Tower(48, d), Tower(24, d)
        self.open_clip = open_clip
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's init
        self.clamp = clamp

    def forward(self, pixels, tokens):
        image_embeds = self.vision_model(pixels)
        text_embeds = self.text_model(tokens)
        image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
        if self.clamp is not None:  # OpenCLIP: logit_scale.clamp_(0, ln 100) after each step; here in the forward
            logit_scale = self.logit_scale.clamp(max=self.clamp).exp()
        else:
            logit_scale = self.logit_scale.exp()
        if self.open_clip:  # OpenCLIP: forward returns the features and the scale; ClipLoss multiplies them
            return image_embeds, text_embeds, logit_scale
        logits_per_text = torch.matmul(text_embeds, image_embeds.t()) * logit_scale
        labels = torch.arange(len(pixels))
        loss = (F.cross_entropy(logits_per_text, labels) + F.cross_entropy(logits_per_text.t(), labels)) / 2
        return {"loss": loss, "logits_per_text": logits_per_text, "logit_scale": logit_scale}


def _clip_batch(i, B=8):
    g = torch.Generator().manual_seed(40 + i % 4)
    z = torch.randn(B, 16, generator=g)  # the shared content of an image and its caption
    a, b = torch.randn(16, 48, generator=torch.Generator().manual_seed(1)), \
        torch.randn(16, 24, generator=torch.Generator().manual_seed(2))
    return (z @ a + 0.1 * torch.randn(B, 48, generator=g), z @ b + 0.1 * torch.randn(B, 24, generator=g)), None


def _clip_opt(m, temp_lr=3.0):
    """The towers at 1e-3; the temperature in its own group without weight decay at a high lr (as recipes that
    "let the temperature catch up" do)."""
    rest = [p for n, p in m.named_parameters() if n != "logit_scale"]
    return torch.optim.AdamW([{"params": rest, "lr": 1e-3},
                              {"params": [m.logit_scale], "lr": temp_lr, "weight_decay": 0.0}])


def _clip_probe(m, out, step):
    return (round(float(m.logit_scale.detach()), 2), float(out["logits_per_text"].detach().float().abs().max()))


def _open_clip_loss(out, y=None):
    """open_clip.ClipLoss: logits_per_image = logit_scale * image_features @ text_features.T, outside the model."""
    image_features, text_features, logit_scale = out
    logits_per_image = logit_scale * image_features @ text_features.T
    labels = torch.arange(len(image_features))
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2


def _pretrained_clip(clamp=None, open_clip=False):
    """A CLIP pretrained in fp32 at the fixed initial temperature (the checkpoint being fine-tuned): matched pairs
    are already aligned."""
    torch.manual_seed(0)
    m = CLIP(clamp=clamp, open_clip=open_clip)
    m.logit_scale.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    for i in range(60):
        opt.zero_grad()
        _open_clip_loss(m(*_clip_batch(i)[0])).backward() if open_clip else m(*_clip_batch(i)[0])["loss"].backward()
        opt.step()
    m.logit_scale.requires_grad_(True)
    return m


# ======================================================================================================================
# 2. pytorch/examples' VAE: the model returns (recon, mu, logvar); loss_function() outside the model computes
#    KLD = -0.5 * sum(1 + logvar - mu^2 - logvar.exp()) under the same autocast, i.e. in fp16 on the CPU
# ======================================================================================================================
class VAE(nn.Module):
    def __init__(self, d=64, h=48, z=8):
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(d, h), nn.Linear(h, z), nn.Linear(h, z)
        self.fc3, self.fc4 = nn.Linear(z, h), nn.Linear(h, d)
        with torch.no_grad():  # the log-variance head starts small (the posterior near the prior at first)
            self.fc22.weight.mul_(0.8)
            self.fc22.bias.zero_()

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def decode(self, z):
        return self.fc4(F.relu(self.fc3(z)))

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def _mel_batch(i, B=16, raw_from=4):
    """Log-mel frames normalised to [0, 1] as (db + 80) / 80; from `raw_from` on, one clip of a shard cached before
    the normalisation: raw dB in [-80, 0]."""
    g = torch.Generator().manual_seed(70 + i % 4)
    base = torch.sin(torch.linspace(0, 6, 64) + torch.rand(B, 1, generator=g) * 6)
    x = (0.5 + 0.4 * base * torch.rand(B, 1, generator=g)).clamp(0, 1)
    if i >= raw_from:
        x[3] = x[3] * 80 - 80
    return (x,), x


class AntixVAE(VAE):
    """AntixK/PyTorch-VAE's layout: the loss is a method of the model, called by the experiment after forward."""

    def loss_function(self, recons, input, mu, log_var, kld_weight=0.005, kl_fp32=False):
        recons_loss = F.mse_loss(recons.float(), input)
        if kl_fp32:
            mu, log_var = mu.float(), log_var.float()
        kld_loss = torch.mean(-0.5 * torch.sum(1 + log_var - mu ** 2 - log_var.exp(), dim=1), dim=0)
        return recons_loss + kld_weight * kld_loss


# ======================================================================================================================
# 3. a multi-label tagger whose criterion (a child module, called in forward as detection heads do) is a sigmoid focal
#    loss written by hand: -(t log p + (1 - t) log(1 - p)) * (1 - p_t)^gamma; as training makes the logits confident,
#    a positive's fp16 sigmoid reaches exactly 1.0 (logit > 8.32), log(1 - p) = -inf and (1 - t) * -inf = 0 * -inf = NaN
# ======================================================================================================================
class HandFocal(nn.Module):
    def __init__(self, alpha=0.25, gamma=2.0, stable=False):
        super().__init__()
        self.alpha, self.gamma, self.stable = alpha, gamma, stable
        if stable == "fp32":  # the fix: the whole loss in fp32 (torchvision's sigmoid_focal_loss on logits.float())
            self.stable = True
            self.upcast = True
        else:
            self.upcast = False

    def forward(self, logits, t):
        if self.upcast:
            logits = logits.float()
        p = torch.sigmoid(logits)
        if self.stable:  # torchvision.ops.sigmoid_focal_loss: BCE from the logits (fp32 under autocast)
            ce = F.binary_cross_entropy_with_logits(logits, t, reduction="none")
        else:
            ce = -(t * torch.log(p) + (1 - t) * torch.log(1 - p))
        p_t = p * t + (1 - p) * (1 - t)
        loss = ce * (1 - p_t) ** self.gamma
        alpha_t = self.alpha * t + (1 - self.alpha) * (1 - t)
        return (alpha_t * loss).mean()


class Tagger(nn.Module):
    def __init__(self, d=32, n=8, stable=False, gamma=2.0):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.classifier = nn.Linear(64, n)
        self.criterion = HandFocal(stable=stable, gamma=gamma)

    def forward(self, x, targets):
        logits = self.classifier(self.features(x))
        return {"loss": self.criterion(logits, targets), "logits": logits}


_TAG_W = torch.randn(32, 8, generator=torch.Generator().manual_seed(5))


def _tags(i, B=16, clear_from=4, gain=4.0):
    """Step i's batch; from `clear_from` on the loader reads a second camera's shard whose features have 4x the
    gain (same labels: a clear, high-contrast view)."""
    g = torch.Generator().manual_seed(90 + i % 4)
    x = torch.randn(B, 32, generator=g)
    t = (x @ _TAG_W > 0).float()
    return (x * gain if i >= clear_from else x, t), None


def _pretrained_tagger(stable=False, gamma=2.0):
    """The checkpoint being fine-tuned: trained in fp32 with BCE from the logits, so it is already fairly confident."""
    torch.manual_seed(0)
    m = Tagger(stable=stable, gamma=gamma)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for i in range(40):
        x, t = _tags(i % 4, clear_from=99)[0]
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(m.classifier(m.features(x)), t).backward()
        opt.step()
    return m


def _tag_probe(m, out, step):
    lg = out["logits"].detach().float()
    return round(float(lg.max()), 2), round(float(lg.min()), 2)


# ======================================================================================================================
# 4. an activity-recognition model (IMU windows) built of HGRN-style gated linear recurrences (Qin et al. 2023):
#    h_t = a_t * h_{t-1} + (1 - a_t) * i_t with data-dependent forget gates a_t = sigmoid(f_proj(x)), computed in the
#    "parallel" form h_t = exp(L_t) * cumsum_s(exp(-L_s) * (1 - a_s) * i_s), L = cumsum(logsigmoid(f_proj(x))):
#    fine on the curriculum's short windows; the first long windows (step 4) make -L pass 11.09, exp(-L) is inf in
#    fp16, exp(L) is 0, 0 * inf = NaN inside the mixer (not its Linear children, whose outputs are all finite)
# ======================================================================================================================
class GatedRecurrence(nn.Module):
    def __init__(self, d=16, fp32_scan=False):
        super().__init__()
        self.i_proj, self.f_proj, self.g_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        nn.init.constant_(self.f_proj.bias, 1.0)  # the forget-gate bias of +1 (LSTM practice): a ~ 0.73 at init
        self.fp32_scan = fp32_scan

    @staticmethod
    def scan(log_a, u):
        L = torch.cumsum(log_a, dim=1)  # (B, T, d): log of the running product of the forget gates, decreasing
        return torch.exp(L) * torch.cumsum(torch.exp(-L) * u, dim=1)

    def forward(self, x):
        f = self.f_proj(x)
        i = F.silu(self.i_proj(x))
        log_a = F.logsigmoid(f)
        u = (1 - torch.sigmoid(f)) * i
        if self.fp32_scan:  # the fix: the scan in fp32, whatever autocast says (fused scan kernels accumulate so)
            with torch.autocast("cpu", enabled=False):
                h = self.scan(log_a.float(), u.float())
        else:
            h = self.scan(log_a, u)
        return self.o_proj(h * torch.sigmoid(self.g_proj(x)))


class SSMBlock(nn.Module):
    def __init__(self, d=16, fp32_scan=False):
        super().__init__()
        self.norm, self.mixer = nn.LayerNorm(d), GatedRecurrence(d, fp32_scan=fp32_scan)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class HARNet(nn.Module):
    def __init__(self, d=16, ncls=4, fp32_scan=False):
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.layers = nn.ModuleList([SSMBlock(d, fp32_scan) for _ in range(2)])
        self.norm_f, self.head = nn.LayerNorm(d), nn.Linear(d, ncls)

    def forward(self, imu):
        h = self.embed(imu)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm_f(h).mean(1))


def _imu(i, B=8, long_from=4):
    """Curriculum: 8-sample windows, then 64-sample windows from `long_from` on; the activity sets the frequency."""
    g = torch.Generator().manual_seed(110 + i % 4)
    T = 64 if i >= long_from else 8
    y = torch.randint(0, 4, (B,), generator=g)
    t = torch.arange(T, dtype=torch.float32)
    ph = torch.rand(B, 1, 6, generator=g) * 6
    x = torch.sin((y[:, None, None] + 1) * 0.4 * t[None, :, None] + ph) + 0.1 * torch.randn(B, T, 6, generator=g)
    return (x,), y


def _ce(out, y):
    return F.cross_entropy(out.float(), y)


# ======================================================================================================================
# 5. a latent DDPM trained the lucidrains way (the watched model is the GaussianDiffusion wrapper, whose forward is the
#    loss) on cached fp16 latents, the schedule cast to the latents' dtype (diffusers' add_noise does
#    alphas_cumprod.to(dtype=original_samples.dtype)), with an auxiliary x0 loss through predict_start_from_noise:
#    x0 = (x_t - sqrt(1 - ab) * eps) / sqrt(ab). The cosine schedule's last alpha_bar (2.4e-9) is 0 in fp16: the first
#    t = 999 (step 4) divides by 0 in the wrapper's own code (root), not in the denoiser
# ======================================================================================================================
def _cosine_alphas_cumprod(T=1000, s=0.008):
    x = torch.linspace(0, T, T + 1, dtype=torch.float64)
    ac = torch.cos(((x / T) + s) / (1 + s) * math.pi * 0.5) ** 2
    ac = ac / ac[0]
    betas = (1 - ac[1:] / ac[:-1]).clamp(0, 0.999)
    return torch.cumprod(1 - betas, 0).float()


class Denoiser(nn.Module):
    def __init__(self, c=4, d=16):
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(d, 32), nn.SiLU(), nn.Linear(32, d))
        self.conv_in, self.conv_mid = nn.Conv2d(c, d, 3, padding=1), nn.Conv2d(d, d, 3, padding=1)
        self.conv_out = nn.Conv2d(d, c, 3, padding=1)
        self.d = d

    def forward(self, x, t):
        half = self.d // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
        a = t[:, None].float() * freqs[None]
        temb = self.time_mlp(torch.cat([a.sin(), a.cos()], -1))
        h = F.silu(self.conv_in(x) + temb[:, :, None, None])
        return self.conv_out(F.silu(self.conv_mid(h)))


class GaussianDiffusion(nn.Module):
    def __init__(self, x0_weight=0.1):
        super().__init__()
        self.model = Denoiser()
        self.register_buffer("alphas_cumprod", _cosine_alphas_cumprod())
        self.x0_weight = x0_weight

    def forward(self, x0, t, noise):
        ab = self.alphas_cumprod.to(dtype=x0.dtype)[t][:, None, None, None]  # as diffusers' add_noise
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        eps = self.model(x_t, t)
        x0_pred = (x_t - (1 - ab).sqrt() * eps) / ab.sqrt()  # predict_start_from_noise
        loss = F.mse_loss(eps.float(), noise.float()) + self.x0_weight * F.mse_loss(x0_pred.float(), x0.float())
        return {"loss": loss, "x0_pred": x0_pred}


def _latents(i, B=8, last_t_at=4):
    """Cached latents (fp16 on disk, as SD fine-tuning caches keep them), uniform t in [0, 1000) (never 999 before
    `last_t_at`; then one sample draws t = 999), the noise fixed per step."""
    g = torch.Generator().manual_seed(130 + i % 4)
    x0 = (torch.randn(B, 4, 4, 4, generator=g) * 0.8).half()
    t = torch.randint(0, 999, (B,), generator=g)
    if i == last_t_at:
        t[2] = 999
    return (x0, t, torch.randn(B, 4, 4, 4, generator=g)), None


# ======================================================================================================================
# 6. an air-quality sensor GNN with an adaptive, Gaussian-kernel adjacency over learned location embeddings
#    w_ij = exp(-||e_i - e_j||^2) and DCRNN's random-walk normalisation D^-1 W (no self-loops), aggregated with
#    index_add_: a newly installed sensor far from the network (step 4) has every kernel weight below fp16's smallest
#    subnormal, its degree is 0, 1 / 0 = inf and w * inf = 0 * inf = NaN in the conv (fp32: tiny and finite)
# ======================================================================================================================
class KernelDiffConv(nn.Module):
    def __init__(self, d=16, e=8):
        super().__init__()
        self.loc = nn.Linear(2, e)
        self.lin_self, self.lin_nbr = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, pos, edge_index):
        src, dst = edge_index
        emb = self.loc(pos)
        w = torch.exp(-(emb[src] - emb[dst]).pow(2).sum(-1))  # (E,)
        deg = torch.zeros(x.shape[0], dtype=w.dtype).index_add_(0, dst, w)
        norm = w / deg[dst]  # random-walk normalisation D^-1 W
        msg = self.lin_nbr(x)[src] * norm[:, None]
        agg = torch.zeros(x.shape[0], msg.shape[1], dtype=msg.dtype).index_add_(0, dst, msg)
        return F.relu(self.lin_self(x) + agg)


class SensorGNN(nn.Module):
    def __init__(self, fin=5, d=16):
        super().__init__()
        self.encoder = nn.Linear(fin, d)
        self.convs = nn.ModuleList([KernelDiffConv(d) for _ in range(2)])
        self.head = nn.Linear(d, 1)

    def forward(self, x, pos, edge_index):
        h = F.relu(self.encoder(x))
        for conv in self.convs:
            h = conv(h, pos, edge_index)
        return self.head(h).squeeze(-1)


def _knn_edges(pos, k=3):
    d = torch.cdist(pos, pos)
    d.fill_diagonal_(float("inf"))
    nbr = d.topk(k, largest=False).indices  # (N, k)
    dst = torch.arange(len(pos)).repeat_interleave(k)
    src = nbr.flatten()
    return torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])  # both directions


def _sensors(i, N=24, far_from=4, far_km=3.0):
    """Step i's snapshot: sensor locations (km, within a 3 km city grid), readings, the next hour's PM2.5 as the
    target; from `far_from` on one new sensor stands `far_km` km east and north of the city's corner."""
    g = torch.Generator().manual_seed(150 + i % 4)
    pos = torch.rand(N, 2, generator=g) * 3
    if i >= far_from:
        pos[-1] = torch.tensor([3.0 + far_km, 3.0 + far_km])
    x = torch.randn(N, 5, generator=g)
    y = x[:, 0] * 0.5 + 0.2 * x[:, 1]
    return (x, pos, _knn_edges(pos)), y


def _mse(out, y):
    return F.mse_loss(out.float(), y)


# ======================================================================================================================
# 7. a keyword spotter with a wav2vec2-style conv feature extractor whose first GroupNorm (one group per channel) is
#    hand-written in the working dtype: var = ((x - mean) ** 2).mean(-1); y = (x - mean) / sqrt(var + eps). A clipped,
#    loud recording (from step 4, one per batch: a new microphone's gain) makes conv0's deviations pass 256 in some
#    channels: (x - mean)^2 is inf in fp16, var = inf, and the channel is silently divided to 0 (no NaN, no skip)
# ======================================================================================================================
class ChannelGroupNorm(nn.Module):
    def __init__(self, c, eps=1e-5):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x):  # (B, C, T), one group per channel
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight[:, None] + self.bias[:, None]


class FeatureExtractor(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.conv0, self.norm0 = nn.Conv1d(1, c, 10, stride=5, bias=False), ChannelGroupNorm(c)
        self.conv1, self.conv2 = nn.Conv1d(c, c, 3, stride=2, bias=False), nn.Conv1d(c, c, 2, stride=2, bias=False)

    def forward(self, wav):
        h = F.gelu(self.norm0(self.conv0(wav[:, None])))
        return F.gelu(self.conv2(F.gelu(self.conv1(h))))


class KWS(nn.Module):
    def __init__(self, c=16, ncls=4):
        super().__init__()
        self.fe, self.proj, self.head = FeatureExtractor(c), nn.Linear(c, 32), nn.Linear(32, ncls)

    def forward(self, wav):
        return self.head(F.gelu(self.proj(self.fe(wav).transpose(1, 2))).mean(1))


def _wavs(i, B=8, loud_from=4, gain=1500.0):
    """1-s clips at 800 Hz (a tone per keyword, +/-1 float range); from `loud_from` on one clip per batch comes from
    a new microphone whose driver returns unnormalised samples (`gain` times larger, as int16 PCM read without
    normalize=True would be)."""
    g = torch.Generator().manual_seed(170 + i % 4)
    y = torch.randint(0, 4, (B,), generator=g)
    t = torch.arange(800, dtype=torch.float32) / 800
    wav = 0.5 * torch.sin(2 * math.pi * (40 + 30 * y[:, None]) * t) + 0.05 * torch.randn(B, 800, generator=g)
    if i >= loud_from:
        wav[1] = wav[1] * gain
    return (wav,), y


# ======================================================================================================================
# The tests
# ======================================================================================================================
def test_clip_unclamped_logit_scale_climbs_until_the_fp16_logits_overflow_in_the_root():
    m = _pretrained_clip()
    r = train_loop(m, _clip_batch, _own, 8, opt=_clip_opt, probe=_clip_probe)
    scales, peaks = zip(*r["seen"])
    # the oracle: the root's own product (its towers' outputs are finite) is the first non-finite value, at step 5,
    # once exp(logit_scale) passed 65504; the step before, the logits were still below half of fp16's max
    assert r["first"] == ("", 5) and r["bad_loss"][:1] == [5] and r["skipped"][:1] == [5], r
    assert scales[4] < 11.0 and peaks[4] < 40000 and math.exp(scales[5]) > 90000 and math.isinf(peaks[5]), r["seen"]
    with torch.no_grad():  # the same step-5 batch in fp32 is finite
        assert torch.isfinite(m(*_clip_batch(5)[0])["loss"])
    at(r["w"].report(), BAD, "", 5, "forward")


def test_open_clip_layout_the_product_with_the_scale_overflows_in_cliploss_outside_the_model():
    m = _pretrained_clip(open_clip=True)

    def probe(m, out, step):
        return float(m.logit_scale.detach()), float((out[2] * out[0] @ out[1].T).detach().float().abs().max())

    r = train_loop(m, _clip_batch, _open_clip_loss, 8, opt=_clip_opt, probe=probe)
    # the oracle: no module's output is non-finite (the root returns exp(logit_scale) in fp32, finite); the loss is
    # NaN from step 5, when exp(logit_scale) * features passes 65504 in ClipLoss's fp16 product
    assert r["first"] is None and r["bad_loss"][:1] == [5] and r["skipped"][:1] == [5], r
    assert r["seen"][4][0] < 11.0 and r["seen"][4][1] < 40000 and not math.isfinite(r["seen"][5][1]), r["seen"]
    rep = r["w"].report()
    at(rep, BAD, None, 5, "forward")
    no_error_at(rep, ("", "vision_model", "text_model", "vision_model.proj", "text_model.proj"))


def test_healthy_twin_clip_logit_scale_clamped_at_ln_100_is_quiet():
    m = _pretrained_clip(clamp=math.log(100))
    r = train_loop(m, _clip_batch, _own, 16, opt=_clip_opt, probe=_clip_probe)
    assert max(p for _, p in r["seen"]) <= 100.5, r["seen"]
    healthy(r)


def test_vae_kld_outside_the_model_overflows_exp_logvar_on_a_raw_db_clip():
    torch.manual_seed(0)
    m = AntixVAE()
    r = train_loop(m, _mel_batch, lambda out, x: m.loss_function(out[0], x, out[1], out[2]), 7,
                   probe=lambda m, out, s: float(out[2].detach().float().max()))
    # the oracle: every module's output (the model's recon, mu, logvar) is finite; the loss is inf at step 4; logvar
    # is past 11.09 there (exp overflows in fp16) and below 22 (the model's own exp(0.5 * logvar) stays finite)
    assert r["first"] is None and r["bad_loss"][:1] == [4] and r["skipped"][:1] == [4], r
    assert 12.5 < r["seen"][4] < 21 and max(r["seen"][:4]) < 2, r["seen"]
    (x,), _ = _mel_batch(4)
    torch.manual_seed(0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = m(x)
        assert torch.isfinite(m.loss_function(out[0], x, out[1], out[2], kl_fp32=True))  # the same KLD in fp32
    rep = r["w"].report()
    at(rep, BAD, None, 4, "forward")
    no_error_at(rep, ("", "fc1", "fc21", "fc22"))


def test_hand_written_focal_loss_log_of_a_saturated_fp16_sigmoid_in_the_criterion():
    m = _pretrained_tagger()
    r = train_loop(m, _tags, _own, 7, probe=_tag_probe)
    assert r["first"] == ("criterion", 4) and r["bad_loss"][:1] == [4] and r["skipped"][:1] == [4], r
    hi, lo = r["seen"][4]
    assert max(h for h, _ in r["seen"][:4]) < 6 and hi > 10, r["seen"]  # sigmoid(> 8.32) == 1.0 in fp16
    with torch.no_grad():
        assert torch.isfinite(m(*_tags(4)[0])["loss"])  # fp32: finite
    rep = r["w"].report()
    at(rep, BAD + ("underflow",), "criterion", 4, "forward")
    no_error_at(rep, ("classifier", "features", "features.2", ""))


def test_focal_gamma_below_one_backward_of_pow_at_a_saturated_fp16_sigmoid():
    """gamma = 0.5 with BCE from the logits: the forward is finite (0 ** 0.5 = 0), the backward of (1 - p_t) ** 0.5
    at p_t == 1 is inf; the sigmoid's backward makes it NaN. fp32 keeps 1 - p_t > 0 at these logits."""
    m = _pretrained_tagger(stable=True, gamma=0.5)
    r = train_loop(m, lambda i: _tags(i, gain=2.5), _own, 7, probe=_tag_probe, backward=True)
    assert r["first"] is None and not r["bad_loss"] and r["skipped"][:1] == [4], r
    assert r["first_bwd"] == ("criterion", 4), r
    hi, lo = r["seen"][4]
    assert -15.5 < lo < -9.5 and hi < 15.5, r["seen"]  # fp16 saturates (|x| > 8.32 on the 0 side), fp32 does not
    m.zero_grad()
    m(*_tags(4, gain=2.5)[0])["loss"].backward()  # the same batch in fp32: finite gradients
    assert all(torch.isfinite(p.grad).all() for p in m.parameters()), "fp32 backward not finite"
    rep = r["w"].report()
    at(rep, BAD, "criterion", 4, "backward")
    no_error_at(rep, ("classifier", "features", ""))


def test_healthy_twin_focal_loss_in_fp32_on_the_same_high_gain_shard_is_quiet():
    m = _pretrained_tagger(stable="fp32")
    healthy(train_loop(m, _tags, _own, 24))


def test_gated_linear_recurrence_parallel_form_exp_minus_cumsum_overflows_on_long_windows():
    torch.manual_seed(0)
    m = HARNet()
    r = train_loop(m, _imu, _ce, 7)
    # the oracle: the mixer's own code (its Linear children's outputs are finite) makes the first NaN, at step 4
    assert r["first"] == ("layers.0.mixer", 4) and r["bad_loss"][:1] == [4] and r["skipped"][:1] == [4], r
    (x,), _ = _imu(4)
    with torch.no_grad():
        assert torch.isfinite(m(x)).all()  # fp32: finite
        with torch.autocast("cpu", dtype=torch.float16):
            mx = m.layers[0].mixer
            L = torch.cumsum(F.logsigmoid(mx.f_proj(m.layers[0].norm(m.embed(x)))), 1)
        assert (-L).max() > 20 and (-L).max() < 70  # past 11.09 with margin; exp(70) is still finite in fp32
    rep = r["w"].report()
    at(rep, BAD, "layers.0.mixer", 4, "forward")
    no_error_at(rep, ("layers.0.mixer.f_proj", "layers.0.mixer.i_proj", "layers.0.mixer.o_proj", "layers.0",
                      "layers.1.mixer", "layers.1.norm", "head"))


def test_healthy_twin_recurrence_scanned_in_fp32_on_the_same_long_windows_is_quiet():
    torch.manual_seed(0)
    healthy(train_loop(HARNet(fp32_scan=True), _imu, _ce, 24, lr=1e-2))


def test_ddpm_wrapper_divides_by_an_fp16_alpha_bar_of_zero_at_t_999():
    torch.manual_seed(0)
    m = GaussianDiffusion()
    r = train_loop(m, _latents, _own, 7, lr=1e-3)
    assert r["first"] == ("", 4) and r["bad_loss"] == [4] and r["skipped"] == [4], r
    assert all(int(_latents(i)[0][1].max()) < 999 for i in range(7) if i != 4)
    ab = _cosine_alphas_cumprod()
    assert 0 < ab[999] < 1e-8 and ab[999].half() == 0 and ab[998].half() > 0
    rep = r["w"].report()
    at(rep, BAD + ("underflow",), "", 4, "forward")
    no_error_at(rep, ("model", "model.conv_out", "model.conv_in", "model.time_mlp"))


def test_sensor_gnn_kernel_weights_underflow_and_the_random_walk_norm_divides_zero_by_zero():
    torch.manual_seed(0)
    m = SensorGNN()
    r = train_loop(m, _sensors, _mse, 7)
    assert r["first"] == ("convs.0", 4) and r["bad_loss"][:1] == [4] and r["skipped"][:1] == [4], r
    args, _ = _sensors(4)
    with torch.no_grad():
        assert torch.isfinite(m(*args)).all()  # fp32: every kernel weight tiny but nonzero, the norm finite
    rep = r["w"].report()
    at(rep, BAD + ("underflow",), "convs.0", 4, "forward")
    no_error_at(rep, ("convs.0.loc", "convs.0.lin_nbr", "convs.1", "head"))


@_xf("the report has no warning or error at all (no finding names fe.norm0): the variance that overflows inside the "
     "hand-written norm from step 4 on is silent (zeros, no inf/NaN anywhere, no skip) and none of steps 1-9 is a "
     "sampled step; it should be overflow at fe.norm0, step 4, forward (README's known limitation: only a later "
     "sampled step would see it)")
def test_wav2vec2_style_hand_written_group_norm_variance_overflows_silently_on_a_loud_clip():
    torch.manual_seed(0)
    m = KWS()

    def probe(m, out, step):  # the mechanism, measured on the same batch: conv0's deviations and norm0's dead channels
        (w,), _ = _wavs(step)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            h = m.fe.conv0(w[:, None])
            sq = (h - h.mean(-1, keepdim=True)) ** 2
            n = m.fe.norm0(h)
        n32 = m.fe.norm0(h.float())
        return (int(torch.isinf(sq).any(-1)[1].sum()), int((n[1].float().std(-1) == 0).sum()),
                int((n32[1].std(-1) == 0).sum()))

    r = train_loop(m, _wavs, _ce, 10, probe=probe)
    # the oracle: everything finite, nothing skipped; from step 4 most of conv0's channels of the loud clip have an
    # inf squared deviation in fp16 and come out of norm0 constant, while the same norm in fp32 keeps them all
    assert r["first"] is None and not r["bad_loss"] and not r["skipped"], r
    assert all(s == (0, 0, 0) for s in r["seen"][:4]), r["seen"]
    assert all(inf >= 8 and dead >= 8 and dead32 == 0 for inf, dead, dead32 in r["seen"][4:]), r["seen"]
    at(r["w"].report(), BAD + ("overflow_risk",), "fe.norm0", 4, "forward")
