"""fp16 training that silently stopped learning (or whose optimizer silently broke it): the loss stays finite, or the
first sign is far from the cause, and nothing raises. Watched through the public API only (`ampdoctor.watch(model,
optimizer=..., scaler=...)` at the default settings -> an ordinary CPU loop -> `w.report()`). Each failure is first
checked to be real in the test itself (the update of an element with a nonzero gradient that left it unchanged, the
state that holds the vanished eps, the gradient against fp32, the skipped steps and the scale, the parameters that
never moved); then the rule, at the layer where the rule names one, among the first three findings, with the severity
CONTRACT.md gives ("error: training is broken or silently wrong").

 1. a pretrained CNN (conv-BN-ReLU) `.half()`'d "to save memory" and fine-tuned at SGD(lr=1e-5, momentum=0.9,
    nesterov=True): the BN gains sit at 1.0 and the convs at ~0.1, where half an ulp is far above lr * grad; the
    stem never moves (update_underflow at a layer whose updates the test saw round away).
 2. only the pretrained encoder `.half()`'d (the fp32 head trained from scratch), one plain SGD over both: the head
    moves everywhere, the encoder in ~5% of its elements (update_underflow at `encoder.*`, none at `head`).
 3. layer-wise lr decay (LLRD, 0.3 per layer) in a pure-fp16 transformer encoder fine-tune, AdamW(eps=1e-4, the "fp16
    eps"): the lowest layers' lr (1.6e-5, 4.9e-6) is below half an ulp of the LayerNorm gains (1.0) and of the
    embedding, so they never move, while the top does (update_underflow at `emb` / `blocks.0.norm`, none at the top).
 4. a hand-written Lion (sign update, lr=1e-5, the "3-10x smaller than Adam" advice) on a `.half()` MLP: every update
    is +-lr, below half an ulp of most weights (update_underflow, fp16_master_weights error).
 5. a bag-of-words classifier whose `nn.Embedding(sparse=True)` table is `.half()`'d, plain SGD (the sparse-gradient
    optimizer): the per-row updates (~4e-6) round away on N(0, 1) rows (update_underflow at `emb`).
 6. a pretrained fp16 linear calibration head refit with plain SGD: the first ~25 steps move it, then the gradients
    of the converging fit fall below half an ulp / lr and the fit stalls at ~2x fp32's loss (update_underflow at
    `0`, at the step it begins, +-4), the failure starting mid-run at the default sampling.
 7. a DLRM-style recommender whose item table is `.half()`'d and trained with Adagrad (the DLRM optimizer, eps=1e-10):
    state_sum of the cold-start rows (no interaction yet) is 0, sqrt(0) + fp16(1e-10) = 0, 0 / 0 writes NaN into every
    such row at step 0 (eps_underflow at `item`, error).
 8. an AnyPrecisionAdamW (torchdistx's optimizer: states in a chosen dtype) with `variance_dtype=torch.float16` over
    fp32 parameters: exp_avg_sq of the small gradients is 0 in fp16, denom = sqrt(0) + fp16(1e-8) = 0, the first
    update writes inf (eps_underflow, error: the eps vanishes in the optimizer's working dtype).
 9. a segmentation net with an auxiliary per-pixel depth head, `GradScaler("cpu", enabled=False)` ("we disabled loss
    scaling: no more skipped steps") under fp16 autocast: the depth loss's gradient into `depth` is all fp16
    subnormal (some flushed to 0) once its zero-initialised last layer sits near the targets, its weight gradient
    ~9% off against fp32 (underflow, backward, at `depth`).
10. learnable ALiBi slopes multiplied into one precomputed buffer that holds the distance AND the causal -inf:
    slope * -inf is -inf (forward finite, loss finite), but d/dslope = sum(0 * -inf) = NaN on every step: GradScaler
    skips every step, the scale falls 65536 -> 1e-6, no weight ever changes (nan_origin at `attn` + loss_scale_collapse).
11. `GradScaler(init_scale=2**24, backoff_factor=0.9)` ("a gentler backoff") on a summed cross-entropy: the scaled
    gradients overflow at every scale the run reaches; all 40 steps are skipped, the weights never change
    (loss_scale_collapse or skipped_steps, error).
Healthy twins (no warning, no error): the CNN with fp32 weights under fp16 autocast + GradScaler; a `.half()` model
stepped through fp32 master copies (AdamW over the masters, GradScaler unscaling their gradients); the ALiBi slopes
over a finite distance buffer with the causal mask applied by masked_fill; a QLoRA-style frozen fp16 base with fp32
adapters, AdamW(eps=1e-8) over model.parameters(), autocast + GradScaler.

What ampdoctor got wrong (strict xfails, 1 of 15 when written, 0 now; fixed since: 5, record/params.py
update_check_pre samples a sparse gradient's rows (_update_sample); 6, an optimizer holding fp16/bf16 parameters has
its updates' rounding checked every LOW_CHECK_EVERY (4) steps too, not only on sampled steps; 8, below):
 8. (fixed since: sampled steps record an optimizer state narrower than its parameter, ParamStat.state_dtype from
    record/params.py narrow_state, and optimizer_eps reads it) fp16 optimizer state over fp32 parameters: `[error] update_spike at enc.0 step 0 (x inf)`, `overflow at enc.0 step
    1` (weights already inf), `nan_origin at enc.0`, no eps_underflow. rules/weights.py optimizer_eps considers only a
    group's parameters whose dtype is float16 (`p[1] == "float16"` in meta.optimizer groups); the optimizer's state
    dtypes are never recorded, so an eps added in fp16 state over fp32 parameters is not seen.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from scenarios import alarms, in_top3, lines, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)

FP16_TINY = 2.0 ** -24
FP16_NORMAL = 2.0 ** -14


def gen(i):
    return torch.Generator().manual_seed(i)


def at(rep, rules, module, step=None, severity=("error",)):
    f = in_top3(rep, rules, module)
    if step is not None:
        steps = step if isinstance(step, (tuple, range)) else (step,)
        assert f.step in steps, (f.one_line(), lines(rep))
    if severity is not None:
        assert f.severity in severity, (f.one_line(), lines(rep))
    return f


def rounded_share(p, before, grad):
    """Share of the elements with a nonzero gradient that the update left unchanged (w + dw == w)."""
    gnz = grad != 0
    return float(((p.detach() == before) & gnz).sum() / gnz.sum().clamp(min=1))


def moved(model, w0):
    return {n: float((p.detach() != w0[n]).float().mean()) for n, p in model.named_parameters()}


def quiet(rep):
    assert alarms(rep.findings) == [] and rep.exit_code == 0, lines(rep)


# ======================================================================================================================
# 1./twin. a pretrained conv net `.half()`'d and fine-tuned with SGD + Nesterov momentum at lr 1e-5
# ======================================================================================================================
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def _images(i):
    x = randn(16, 3, 16, 16, seed=i)
    return x, (x[:, 0].mean((1, 2)) * 40).long().clamp(-5, 4) + 5


def test_half_cnn_finetuned_with_nesterov_sgd_at_lr_1e5_rounds_every_update_away():
    torch.manual_seed(0)
    m = ConvNet().half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-5, momentum=0.9, nesterov=True)
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt)
    share = {}
    for i in range(12):
        opt.zero_grad()
        x, y = _images(i)
        F.cross_entropy(m(x.half()).float(), y).backward()
        if i == 6:
            before = {n: p.detach().clone() for n, p in m.named_parameters()}
            grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        if i == 6:
            share = {n: rounded_share(p, before[n], grads[n]) for n, p in m.named_parameters()}
    w.close()
    # real: the optimizer holds fp16 parameters; mid-run every update of the stem conv and the BN gains rounds away,
    # and over 12 steps (almost) none of their elements moved
    assert all(p.dtype == torch.float16 for g in opt.param_groups for p in g["params"])
    mv = moved(m, w0)
    assert max(mv["stem.0.weight"], mv["stem.1.weight"], mv["block.1.weight"]) < 0.02, mv
    rounding = {n.rpartition(".")[0] for n, s in share.items() if s > 0.9}
    assert {"stem.0", "stem.1", "block.1"} <= rounding, share
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "update_underflow"), None)
    assert f is not None and f.module in rounding and f.severity == "error", lines(rep)
    assert any(g.rule == "fp16_master_weights" for g in rep.findings), lines(rep)


def test_healthy_twin_cnn_with_fp32_weights_under_autocast_and_grad_scaler_is_quiet():
    torch.manual_seed(0)
    m = ConvNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sc = torch.amp.GradScaler("cpu")
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses = []
    for i in range(30):
        opt.zero_grad()
        x, y = _images(i % 6)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    w.close()
    assert all(map(math.isfinite, losses)) and sum(losses[-6:]) < 0.9 * sum(losses[:6]), losses
    assert min(moved(m, w0).values()) > 0.5
    quiet(w.report())


# ======================================================================================================================
# 2. only the pretrained encoder `.half()`'d, an fp32 head trained from scratch, one SGD over both
# ======================================================================================================================
class HalfEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU()).half()
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.encoder(x.half()).float())


def _vec(i, n=64):
    x = randn(n, 32, seed=i)
    return x, x[:, :4].argmax(-1)


def test_only_the_encoder_halved_rounds_its_sgd_updates_away_while_the_fp32_head_trains():
    torch.manual_seed(0)
    m = HalfEncoder()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt)
    for i in range(10):
        opt.zero_grad()
        x, y = _vec(i)
        F.cross_entropy(m(x), y).backward()
        opt.step()
    w.close()
    mv = moved(m, w0)
    # real: every gradient was nonzero somewhere, the fp32 head moved everywhere, the encoder in < 15% of its elements
    assert mv["head.weight"] == 1.0 and mv["encoder.0.weight"] < 0.15 and mv["encoder.2.weight"] < 0.15, mv
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "update_underflow"), None)
    assert f is not None and f.module in ("encoder.0", "encoder.2") and f.severity == "error", lines(rep)
    assert not [g for g in rep.findings if g.rule == "update_underflow" and g.module == "head"], lines(rep)
    assert ("fp16_master_weights", "encoder") in [(g.rule, g.module) for g in rep.findings], lines(rep)


# ======================================================================================================================
# 3. layer-wise learning-rate decay in a pure-fp16 encoder fine-tune: the lowest layers' lr rounds away
# ======================================================================================================================
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h):
        return h + self.ff(self.norm(h))


class TextEncoder(nn.Module):
    def __init__(self, d=32, n=4):
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.cls = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.cls(self.norm(h).mean(1))


def test_layerwise_lr_decay_in_a_pure_fp16_finetune_freezes_the_lowest_layers():
    torch.manual_seed(0)
    m = TextEncoder().half()
    base, decay = 2e-3, 0.3
    groups = [{"params": list(m.cls.parameters()) + list(m.norm.parameters()), "lr": base}]
    for k in range(3, -1, -1):
        groups.append({"params": list(m.blocks[k].parameters()), "lr": base * decay ** (4 - k)})
    groups.append({"params": list(m.emb.parameters()), "lr": base * decay ** 5})
    opt = torch.optim.AdamW(groups, eps=1e-4, weight_decay=0.0)  # eps=1e-4: "the fp16 eps"
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt)
    for i in range(10):
        opt.zero_grad()
        ids = torch.randint(0, 100, (16, 12), generator=gen(i))
        F.cross_entropy(m(ids).float(), ids[:, 0] % 3).backward()
        opt.step()
    w.close()
    mv = moved(m, w0)
    # real: the embedding and block 0's LayerNorm gain barely moved in 10 steps; the top of the network moved
    assert mv["emb.weight"] < 0.15 and mv["blocks.0.norm.weight"] < 0.25, mv
    top = [n for n in mv if n.startswith(("blocks.2.", "blocks.3.", "norm.", "cls."))]
    assert min(mv[n] for n in top) > 0.9, mv
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "update_underflow"), None)
    assert f is not None and f.module in ("emb", "blocks.0.norm") and f.severity == "error", lines(rep)
    assert not [g for g in rep.findings if g.rule == "update_underflow"
                and (g.module or "").startswith(("blocks.2", "blocks.3", "norm", "cls"))], lines(rep)


# ======================================================================================================================
# 4. a hand-written Lion on a `.half()` model at lr 1e-5
# ======================================================================================================================
class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): p -= lr * sign(beta1 * m + (1 - beta1) * g); m = beta2 * m + (1 - beta2) * g."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                m_ = st["exp_avg"]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(m_.mul(b1).add(p.grad, alpha=1 - b1).sign_(), alpha=-g["lr"])
                m_.mul_(b2).add_(p.grad, alpha=1 - b2)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.enc(x))


def test_lion_on_a_half_model_at_lr_1e5_rounds_its_sign_updates_away():
    torch.manual_seed(0)
    m = MLP().half()
    opt = Lion(m.parameters(), lr=1e-5, weight_decay=0.1)
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt)
    for i in range(10):
        opt.zero_grad()
        x, y = _vec(i)
        F.cross_entropy(m(x.half()).float(), y).backward()
        opt.step()
    w.close()
    mv = moved(m, w0)
    # real: every element got a +-1e-5 update each step; over 10 steps most of them never changed
    assert max(mv.values()) < 0.3, mv
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule == "update_underflow"), None)
    assert f is not None and f.module in ("enc.0", "enc.2", "head") and f.severity == "error", lines(rep)
    assert any(g.rule == "fp16_master_weights" and g.severity == "error" for g in rep.findings), lines(rep)


# ======================================================================================================================
# 5. a sparse fp16 embedding table (nn.Embedding(sparse=True).half()) trained by SGD
# ======================================================================================================================
class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 32, sparse=True).half()
        self.head = nn.Linear(32, 2)

    def forward(self, ids):
        return self.head(self.emb(ids).float().mean(1))


def _docs(i):
    ids = torch.randint(0, 1000, (32, 20), generator=gen(i))
    return ids, ids[:, 0] % 2


def test_sparse_fp16_embedding_trained_by_sgd_rounds_its_row_updates_away():
    torch.manual_seed(0)
    m = Bag()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt)
    share = None
    for i in range(10):
        opt.zero_grad()
        ids, y = _docs(i)
        F.cross_entropy(m(ids), y).backward()
        if i == 3:
            g = m.emb.weight.grad.coalesce().to_dense()
            before = m.emb.weight.detach().clone()
        opt.step()
        if i == 3:
            share = rounded_share(m.emb.weight, before, g)
    w.close()
    mv = moved(m, w0)
    # real: the gradient reached ~half the rows at step 3, and > 95% of their elements did not change; over 10 steps
    # 99% of the table never moved while the fp32 head did everywhere
    assert m.emb.weight.grad.is_sparse
    assert share > 0.95 and mv["emb.weight"] < 0.05 and mv["head.weight"] == 1.0, (share, mv)
    rep = w.report()
    at(rep, ("update_underflow",), "emb")


# ======================================================================================================================
# 6. a pretrained fp16 calibration head refit with SGD: the fit converges, then its updates round away (mid-run)
# ======================================================================================================================
_X = randn(512, 16, seed=1)
_WT = randn(4, 16, seed=2) * 2
_Y = _X @ _WT.t() + 0.01 * randn(512, 4, seed=3)


def _refit(dtype, steps=44):
    m = nn.Sequential(nn.Linear(16, 4))
    with torch.no_grad():
        m[0].weight.copy_(_WT + 0.3 * randn(4, 16, seed=4))
        m[0].bias.zero_()
    m = m.to(dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.3)
    w = ampdoctor.watch(m, optimizer=opt) if dtype == torch.float16 else None
    losses, shares = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(m(_X.to(dtype)).float(), _Y)
        loss.backward()
        before, g = m[0].weight.detach().clone(), m[0].weight.grad.clone()
        opt.step()
        shares.append(rounded_share(m[0].weight, before, g))
        losses.append(loss.item())
    if w is not None:
        w.close()
    return losses, shares, w


def test_fp16_refit_whose_updates_start_to_round_away_as_the_fit_converges():
    l32, _, _ = _refit(torch.float32)
    l16, shares, w = _refit(torch.float16)
    onset = next(i for i, s in enumerate(shares) if s >= 0.5)
    # real: the first steps move (almost) every element, from mid-run most updates round away and the fp16 fit stalls
    # at ~2x the fp32 loss, which still falls
    assert max(shares[:10]) < 0.1 and 15 <= onset <= 38 and min(shares[-4:]) > 0.7, shares
    assert all(map(math.isfinite, l16)) and l16[-1] > 1.8 * l32[-1] and l32[-1] < 0.8 * l32[-8], (l16[-1], l32)
    rep = w.report()
    at(rep, ("update_underflow",), "0", step=range(onset - 4, onset + 5))


# ======================================================================================================================
# 7. a DLRM-style fp16 item table trained with Adagrad: cold-start rows get 0 / (sqrt(0) + fp16(1e-10)) = NaN
# ======================================================================================================================
class Recommender(nn.Module):
    def __init__(self, items=512, d=16):
        super().__init__()
        self.user = nn.Embedding(64, d)
        self.item = nn.Embedding(items, d).half()  # "the table is most of the memory"
        self.mlp = nn.Sequential(nn.Linear(2 * d, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, u, i):
        return self.mlp(torch.cat([self.user(u), self.item(i).float()], -1)).squeeze(-1)


def _clicks(i, warm=384):
    g = gen(i)
    u, it = torch.randint(0, 64, (256,), generator=g), torch.randint(0, warm, (256,), generator=g)
    return u, it, ((u + it) % 2).float()


def test_adagrad_on_an_fp16_item_table_divides_the_cold_rows_by_a_vanished_eps():
    torch.manual_seed(0)
    m = Recommender()
    opt = torch.optim.Adagrad(m.parameters(), lr=0.01)  # eps=1e-10
    w = ampdoctor.watch(m, optimizer=opt)
    losses = []
    for i in range(8):
        opt.zero_grad()
        u, it, y = _clicks(i)
        loss = F.binary_cross_entropy_with_logits(m(u, it), y)
        loss.backward()
        if i == 0:
            cold_grad = m.item.weight.grad[384:].abs().max().item()
        opt.step()
        if i == 0:
            st = opt.state[m.item.weight]["sum"]
            cold_nan = torch.isnan(m.item.weight[384:]).all().item()
        losses.append(loss.item())
    w.close()
    # real: the cold-start rows had zero gradient and zero state_sum, 1e-10 is 0 in fp16, and step 0's update wrote NaN
    # into all of them (the loss of step 0 was finite)
    assert torch.tensor(1e-10, dtype=torch.float16).item() == 0.0
    assert cold_grad == 0.0 and st.dtype == torch.float16 and (st[384:] == 0).all() and cold_nan
    assert math.isfinite(losses[0])
    rep = w.report()
    at(rep, ("eps_underflow",), "item")


# ======================================================================================================================
# 8. AnyPrecisionAdamW with its variance state in fp16 over fp32 parameters
# ======================================================================================================================
class AnyPrecisionAdamW(torch.optim.Optimizer):
    """torchdistx's AnyPrecisionAdamW, condensed: the moments are kept in `momentum_dtype` / `variance_dtype`
    (bf16 by default there; here the user picked fp16 for a V100), the parameters stay as they are."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 momentum_dtype=torch.float32, variance_dtype=torch.float32):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      momentum_dtype=momentum_dtype, variance_dtype=variance_dtype))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, dtype=g["momentum_dtype"])
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=g["variance_dtype"])
                st["step"] += 1
                t = st["step"].item()
                if g["weight_decay"]:
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                gm, gv = p.grad.to(g["momentum_dtype"]), p.grad.to(g["variance_dtype"])
                st["exp_avg"].mul_(b1).add_(gm, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(gv, gv, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** t)).add_(g["eps"])
                p.add_((st["exp_avg"].to(denom.dtype) / denom).to(p.dtype), alpha=-g["lr"] / (1 - b1 ** t))


def _anyprec_run(variance_dtype, steps=10):
    torch.manual_seed(0)
    m = MLP()
    opt = AnyPrecisionAdamW(m.parameters(), lr=1e-3, variance_dtype=variance_dtype)
    w = ampdoctor.watch(m, optimizer=opt)
    losses, info = [], {}
    for i in range(steps):
        opt.zero_grad()
        x, y = _vec(i)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        g = m.enc[0].weight.grad.clone()
        opt.step()
        if i == 0:
            v = opt.state[m.enc[0].weight]["exp_avg_sq"]
            info = dict(dtype=v.dtype, v0_g_nz=int(((v == 0) & (g != 0)).sum()),
                        inf_after=not torch.isfinite(m.enc[0].weight).all().item())
        losses.append(loss.item())
    w.close()
    return losses, info, w


def test_anyprecision_adamw_with_fp16_variance_state_divides_by_a_vanished_eps():
    losses, info, w = _anyprec_run(torch.float16)
    # real: the variance state is fp16, elements with a nonzero gradient have v == 0 there (0.001 * g^2 flushed),
    # 1e-8 is 0 in fp16, and step 0's update wrote inf into the fp32 weights; the same optimizer with its default
    # bf16 state keeps them finite
    assert info["dtype"] == torch.float16 and info["v0_g_nz"] > 0 and info["inf_after"], info
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    assert math.isfinite(losses[0]) and not math.isfinite(losses[1])
    ok, info_bf16, _ = _anyprec_run(torch.bfloat16, steps=3)
    assert not info_bf16["inf_after"] and all(map(math.isfinite, ok)), info_bf16
    rep = w.report()
    at(rep, ("eps_underflow",), "")


# ======================================================================================================================
# 9. GradScaler(enabled=False) under fp16 autocast: the auxiliary depth head's gradients are fp16 subnormals
# ======================================================================================================================
class SegDepth(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.seg = nn.Conv2d(16, 5, 1)
        self.depth = nn.Conv2d(16, 1, 1)
        with torch.no_grad():  # a regression head's last layer: zero weight, bias at the targets' mean
            self.depth.weight.zero_()
            self.depth.bias.fill_(0.008)

    def forward(self, x):
        h = self.trunk(x)
        return self.seg(h), self.depth(h)


def _scene(i):
    x = randn(8, 3, 32, 32, seed=i)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), 0.01 * x[:, 2:3].abs()


def _seg_loss(ps, pd, s, d):
    return F.cross_entropy(ps.float(), s) + 0.1 * F.mse_loss(pd.float(), d)


def test_disabled_grad_scaler_leaves_the_aux_depth_heads_gradients_subnormal():
    torch.manual_seed(0)
    m = SegDepth()
    ref = copy.deepcopy(m)
    # real, on step 0's batch: the gradient reaching `depth`'s output under fp16 autocast is all below fp16's normal
    # range (some of it flushed to 0), and the depth weight's gradient is off against fp32's by several %
    x, s, d = _scene(0)
    seen = {}
    def keep(mod, gi, go):
        seen["g"] = go[0].detach().clone()
    hk = m.depth.register_full_backward_hook(keep)
    with torch.autocast("cpu", dtype=torch.float16):
        ps, pd = m(x)
        _seg_loss(ps, pd, s, d).backward()
    hk.remove()
    _seg_loss(*ref(x), s, d).backward()
    g = seen["g"]
    nz = g[g != 0].float().abs()
    assert g.dtype == torch.float16 and float((nz < FP16_NORMAL).float().mean()) > 0.95, nz.max()
    err = float((m.depth.weight.grad - ref.depth.weight.grad).norm() / ref.depth.weight.grad.norm())
    assert err > 0.05, err
    m.zero_grad()

    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", enabled=False)  # "no more skipped steps"
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses = []
    for i in range(12):
        opt.zero_grad()
        x, s, d = _scene(i)
        with torch.autocast("cpu", dtype=torch.float16):
            ps, pd = m(x)
            loss = _seg_loss(ps, pd, s, d)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    w.close()
    assert all(map(math.isfinite, losses))
    rep = w.report()
    f = at(rep, ("underflow",), "depth")
    assert f.phase == "backward", f.one_line()


# ======================================================================================================================
# 10./twin. learnable ALiBi slopes times a buffer holding the distance and the causal -inf
# ======================================================================================================================
class AlibiAttention(nn.Module):
    def __init__(self, d=32, h=4, T=16, fused_mask=True):
        super().__init__()
        self.h, self.fused = h, fused_mask
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.slopes = nn.Parameter(torch.tensor([2.0 ** -(k + 1) for k in range(h)]))  # trainable ALiBi
        i = torch.arange(T)
        dist = (i[None, :] - i[:, None]).float()  # j - i: <= 0 in the past
        # one precomputed buffer: distance and causal mask together (future -> -inf), or the distance alone
        self.register_buffer("alibi", dist.masked_fill(dist > 0, float("-inf")) if fused_mask else dist)
        self.register_buffer("future", dist > 0)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(D // self.h) + self.slopes.view(-1, 1, 1) * self.alibi[:T, :T]
        if not self.fused:
            s = s.masked_fill(self.future[:T, :T], float("-inf"))
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


class AlibiLM(nn.Module):
    def __init__(self, fused_mask=True):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.attn = AlibiAttention(fused_mask=fused_mask)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(self.ln(h + self.attn(h)))


def _alibi_run(fused_mask, steps):
    torch.manual_seed(0)
    m = AlibiLM(fused_mask)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu")
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, skipped, slope_grad_finite = [], 0, []
    for i in range(steps):
        idx = torch.randint(0, 64, (8, 16), generator=gen(i % 8))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(m(idx[:, :-1]).float().reshape(-1, 64), idx[:, 1:].reshape(-1))
        s0 = sc.get_scale()
        sc.scale(loss).backward()
        slope_grad_finite.append(bool(torch.isfinite(m.attn.slopes.grad).all()))
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        skipped += sc.get_scale() < s0
        losses.append(loss.item())
    w.close()
    return losses, skipped, slope_grad_finite, moved(m, w0), sc.get_scale(), w


def test_alibi_slopes_times_a_buffer_holding_minus_inf_nan_every_slope_gradient_and_the_scale_collapses():
    losses, skipped, slope_ok, mv, scale, w = _alibi_run(True, 34)
    # real: the loss is finite on every step, the slopes' gradient is NaN on every step, GradScaler skipped all of
    # them, the scale fell to ~1e-6 and no weight ever changed
    assert all(map(math.isfinite, losses)) and not any(slope_ok) and skipped == 34, (losses[:3], slope_ok[:3])
    assert scale < 1e-4 and max(mv.values()) == 0.0, (scale, mv)
    rep = w.report()
    at(rep, ("nan_origin", "overflow"), "attn", step=0, severity=("error",))
    f = next((f for f in rep.findings[:3] if f.rule == "loss_scale_collapse"), None)
    assert f is not None and f.severity == "error", lines(rep)


def test_healthy_twin_alibi_slopes_over_a_finite_distance_buffer_with_masked_fill_is_quiet():
    losses, skipped, slope_ok, mv, scale, w = _alibi_run(False, 40)
    assert all(map(math.isfinite, losses)) and all(slope_ok) and skipped <= 1, (skipped, slope_ok)
    assert sum(losses[-8:]) < 0.95 * sum(losses[:8]) and mv["attn.slopes"] == 1.0, (losses, mv)
    quiet(w.report())


# ======================================================================================================================
# 11. GradScaler(init_scale=2**24, backoff_factor=0.9): every step of the run skipped
# ======================================================================================================================
def test_gentle_backoff_from_2_24_skips_every_step_of_the_run():
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, backoff_factor=0.9)  # "a gentler backoff"
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    skipped, losses = 0, []
    for i in range(40):
        opt.zero_grad()
        x, y = _vec(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(m(x).float(), y, reduction="sum")
        s0 = sc.get_scale()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        skipped += sc.get_scale() < s0
        losses.append(loss.item())
    w.close()
    # real: finite losses, all 40 steps skipped, the scale still ~2.5e5 (the gradients overflow fp16 there), no weight
    # ever changed
    assert all(map(math.isfinite, losses)) and skipped == 40 and sc.get_scale() > 1e5, (skipped, sc.get_scale())
    assert max(moved(m, w0).values()) == 0.0
    rep = w.report()
    f = next((f for f in rep.findings[:3] if f.rule in ("loss_scale_collapse", "skipped_steps")), None)
    assert f is not None and f.severity == "error", lines(rep)


# ======================================================================================================================
# twins: a `.half()` model stepped through fp32 master copies; a frozen fp16 base with fp32 LoRA adapters
# ======================================================================================================================
def test_healthy_twin_half_model_stepped_through_fp32_master_copies_is_quiet():
    torch.manual_seed(0)
    m = MLP().half()
    masters = [p.detach().float().clone().requires_grad_(True) for p in m.parameters()]
    opt = torch.optim.AdamW(masters, lr=3e-3)  # eps=1e-8 in fp32 state
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, w0 = [], [p.detach().clone() for p in m.parameters()]
    for i in range(30):
        x, y = _vec(i % 10)
        m.zero_grad(set_to_none=True)
        opt.zero_grad()
        loss = F.cross_entropy(m(x.half()).float(), y)
        sc.scale(loss).backward()
        for mp, p in zip(masters, m.parameters()):
            mp.grad = p.grad.float()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        sc.step(opt)
        sc.update()
        with torch.no_grad():
            for mp, p in zip(masters, m.parameters()):
                p.copy_(mp)
        losses.append(loss.item())
    w.close()
    assert all(map(math.isfinite, losses)) and sum(losses[-6:]) < 0.9 * sum(losses[:6]), losses
    assert all(bool((p != p0).any()) for p, p0 in zip(m.parameters(), w0))
    quiet(w.report())


class LoRALinear(nn.Module):
    def __init__(self, base, r=4):
        super().__init__()
        self.base = base.half().requires_grad_(False)
        self.A = nn.Linear(base.in_features, r, bias=False)
        self.B = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.B.weight)

    def forward(self, x):
        return self.base(x.half()) + self.B(self.A(x))


class LoRANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.act, self.v = LoRALinear(nn.Linear(32, 64)), nn.GELU(), LoRALinear(nn.Linear(64, 64))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.v(self.act(self.q(x))))


def test_healthy_twin_frozen_fp16_base_with_fp32_lora_adapters_is_quiet():
    torch.manual_seed(0)
    m = LoRANet()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)  # over every parameter, the frozen fp16 base included
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc)
    losses, b0 = [], m.q.B.weight.detach().clone()
    for i in range(30):
        opt.zero_grad()
        x, y = _vec(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(m(x).float(), y)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    w.close()
    assert all(map(math.isfinite, losses)) and sum(losses[-6:]) < 0.8 * sum(losses[:6]), losses
    assert bool((m.q.B.weight != b0).all())
    quiet(w.report())
