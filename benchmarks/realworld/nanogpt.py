"""A nanoGPT-style char-level GPT and its training loop, written the way karpathy/nanoGPT's model.py/train.py are.

What makes it "real code" for ampdoctor: tied embeddings, causal self-attention through
`F.scaled_dot_product_attention` (or a manual path, optionally without the 1/sqrt(d) scale), dropout on,
AdamW with weight-decay groups, warmup + cosine lr set per iteration, gradient accumulation, clipping after
`scaler.unscale_`, `loss.item()` every iteration, an eval forward under `torch.no_grad()` at iteration 0,
`optimizer.zero_grad(set_to_none=True)` AFTER `scaler.update()`, optional `torch.compile`, and batches drawn
with the global RNG (`torch.randint`) from a synthetic char corpus generated in-process.

    PYTHONPATH=. python benchmarks/realworld/nanogpt.py --size tiny --dtype float16 --watch
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {  # name -> (n_layer, n_head, n_embd, block_size, batch_size, grad_accum)
    "tiny": (2, 2, 32, 32, 8, 2),
    "small": (6, 6, 384, 256, 32, 2),  # the issue-15 shape (6 x 384, block 256), 2 x 32 sequences per step
}


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 65
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1
    bias: bool = False
    attn: str = "sdpa"  # "sdpa" | "manual" | "manual_noscale" (the missing 1/sqrt(d) bug) | "manual_mask1e9" (the
    # causal mask filled with -1e9, as the Annotated Transformer does: out of fp16's range, fine in bf16)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (as nanoGPT)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        assert c.n_embd % c.n_head == 0
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.attn_dropout = nn.Dropout(c.dropout)
        self.resid_dropout = nn.Dropout(c.dropout)
        self.n_head, self.n_embd, self.dropout, self.mode = c.n_head, c.n_embd, c.dropout, c.attn
        if self.mode != "sdpa":
            self.register_buffer("bias", torch.tril(torch.ones(c.block_size, c.block_size))
                                 .view(1, 1, c.block_size, c.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.mode == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                               dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = q @ k.transpose(-2, -1)
            if self.mode in ("manual", "manual_mask1e9"):
                att = att * (1.0 / math.sqrt(k.size(-1)))
            fill = -1e9 if self.mode == "manual_mask1e9" else float("-inf")
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, fill)
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
            drop=nn.Dropout(c.dropout), h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            ln_f=LayerNorm(c.n_embd, bias=c.bias)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# -- data ------------------------------------------------------------------------------------------------------

_WORDS = ("the king shall speak of thy love and we are not so fair my lord good sir what is this night "
          "come away thou art a villain o heaven hear me now to be or not that question gentle death sweet "
          "prince of denmark farewell noble friend").split()


@functools.lru_cache(maxsize=2)
def char_corpus(n_chars: int = 200_000, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A synthetic Shakespeare-ish char corpus (a seeded word-level Markov chain), encoded; (train, val, vocab)."""
    g = random.Random(seed)
    nxt = [[g.randrange(len(_WORDS)) for _ in range(4)] for _ in _WORDS]
    out, w, n = [], 0, 0
    while n < n_chars:
        w = nxt[w][g.randrange(4)] if g.random() < 0.9 else g.randrange(len(_WORDS))
        s = _WORDS[w] + ("\n" if g.random() < 0.08 else (", " if g.random() < 0.1 else " "))
        out.append(s.upper() if g.random() < 0.05 else s)
        n += len(s)
    text = "".join(out)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    k = int(0.9 * len(data))
    return data[:k], data[k:], len(chars)


# -- training --------------------------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    size: str = "tiny"
    device: str = "cpu"
    dtype: str = "float16"  # "float16" (autocast + GradScaler) | "bfloat16" (autocast, no scaler)
    compile: bool = False
    iters: int = 12
    learning_rate: float = 1e-3
    warmup_iters: int = 4
    lr_decay_iters: int = 100
    min_lr: float = 1e-4
    decay_lr: bool = True
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    dropout: float = 0.1
    attn: str = "sdpa"
    init_scale: float = 2.0 ** 16
    seed: int = 1337
    misuse: str | None = None  # loops.MISUSES' call-order ones: clip-scaled, no-update, update-first


def step_and_update(scaler, opt, misuse=None):
    """`scaler.step(opt)` then `scaler.update()`, or the order a misuse writes: update-first (update, then step),
    no-update (step alone). Shared with loops.plain_train (this file runs alone, so it holds the helper)."""
    if misuse == "update-first":
        scaler.update()
    scaler.step(opt)
    if misuse not in ("no-update", "update-first"):
        scaler.update()


def get_lr(it, c: TrainConfig):
    if not c.decay_lr:
        return c.learning_rate
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if it > c.lr_decay_iters:
        return c.min_lr
    ratio = (it - c.warmup_iters) / (c.lr_decay_iters - c.warmup_iters)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


def build(c: TrainConfig):
    """(model, optimizer, scaler, get_batch) for a run; seeds the global RNG."""
    torch.manual_seed(c.seed)
    n_layer, n_head, n_embd, block, batch, _ = SIZES[c.size]
    train, val, vocab = char_corpus()
    model = GPT(GPTConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                          dropout=c.dropout, attn=c.attn)).to(c.device)
    opt = model.configure_optimizers(c.weight_decay, c.learning_rate, (0.9, 0.99))
    scaler = torch.amp.GradScaler(c.device, init_scale=c.init_scale, enabled=c.dtype == "float16")

    def get_batch(split):
        data = train if split == "train" else val
        ix = torch.randint(len(data) - block, (batch,))
        x = torch.stack([data[i:i + block] for i in ix]).to(c.device)
        y = torch.stack([data[i + 1:i + 1 + block] for i in ix]).to(c.device)
        return x, y

    return model, opt, scaler, get_batch


def train(c: TrainConfig, *, watch=None, inject=None, on_iter=None):
    """Run nanoGPT's loop. `watch(model, opt, scaler)` -> an ampdoctor Watch or None (called before compile, as
    the README says); `inject(it, model, opt)` runs at the top of each iteration; `on_iter(it, loss, scale_before,
    scale_after)` after each. Returns (losses, watch_handle)."""
    model, opt, scaler, get_batch = build(c)
    w = watch(model, opt, scaler if c.dtype == "float16" else None) if watch else None
    fwd = torch.compile(model) if c.compile else model
    accum = SIZES[c.size][5]
    ctx = lambda: torch.autocast(c.device, dtype=getattr(torch, c.dtype))  # noqa: E731
    losses = []
    X, Y = get_batch("train")
    for it in range(c.iters):
        lr = get_lr(it, c)
        for g in opt.param_groups:
            g["lr"] = lr
        if it == 0:  # estimate_loss() at iteration 0, as nanoGPT does with eval_interval
            model.eval()
            with torch.no_grad():
                for split in ("train", "val"):
                    xe, ye = get_batch(split)
                    with ctx():
                        fwd(xe, ye)
            model.train()
        if inject is not None:
            inject(it, model, opt)
        for micro in range(accum):
            with ctx():
                logits, loss = fwd(X, Y)
                loss = loss / accum
            X, Y = get_batch("train")  # prefetch, as nanoGPT
            scaler.scale(loss).backward()
        if c.grad_clip != 0.0:
            if c.misuse != "clip-scaled":
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        s0 = scaler.get_scale() if scaler.is_enabled() else None
        step_and_update(scaler, opt, c.misuse)
        s1 = scaler.get_scale() if scaler.is_enabled() else None
        opt.zero_grad(set_to_none=True)
        lossf = loss.item() * accum
        losses.append(lossf)
        if on_iter is not None:
            on_iter(it, lossf, s0, s1)
    return losses, w, model


def main():
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "manual", "manual_noscale", "manual_mask1e9"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--watch", action="store_true")
    a = p.parse_args()
    c = TrainConfig(size=a.size, device=a.device, dtype=a.dtype, iters=a.iters, learning_rate=a.lr,
                    warmup_iters=0 if a.no_warmup else 4, attn=a.attn, compile=a.compile)
    watch = None
    if a.watch:
        import ampdoctor
        watch = lambda m, o, s: ampdoctor.watch(m, optimizer=o, scaler=s)  # noqa: E731
    losses, w, _ = train(c, watch=watch, on_iter=lambda it, l, s0, s1: print(f"iter {it}: loss {l:.4f} scale {s1}"))
    if w is not None:
        w.close()
        print(w.report().text())


if __name__ == "__main__":
    main()
