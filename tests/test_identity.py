"""Watching changes nothing (issue 12): losses, gradients and weights are bitwise identical with and without a
watch on real models — a tiny Hugging Face T5 (position bias shared across blocks, tied embeddings), a model
with tied weights and a module called several times — in fp32, bf16 and fp16, at every=1 and the default."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampdoctor

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _t5():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)

    def batch(i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(1, 64, (2, 12), generator=g),
                "labels": torch.randint(1, 64, (2, 7), generator=g)}
    return model, batch, lambda out, b: out.loss


class Tied(nn.Module):
    """Tied input/output embeddings and one block applied three times (shared weights, a module called
    several times, a tensor consumed by many ops)."""

    def __init__(self, vocab=50, d=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gate = nn.Linear(d, d)

    def forward(self, idx):
        x = self.emb(idx)
        h = x
        for _ in range(3):
            h = h + self.block(h) + self.gate(x) * 0.1   # x feeds every iteration: many consumers
        return h @ self.emb.weight.t()


def _tied():
    torch.manual_seed(0)
    model = Tied()

    def batch(i):
        g = torch.Generator().manual_seed(i)
        return {"idx": torch.randint(0, 50, (3, 10), generator=g), "y": torch.randint(0, 50, (3, 10), generator=g)}

    def loss_of(out, b):
        return nn.functional.cross_entropy(out.float().flatten(0, 1), b["y"].flatten())
    return model, batch, loss_of


def _run(make, dtype, watch_kw, steps=3):
    model, batch, loss_of = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if dtype == torch.float16 else None
    w = ampdoctor.watch(model, optimizer=opt, scaler=scaler, **watch_kw) if watch_kw is not None else None
    losses, grads = [], []
    for i in range(steps):
        b = batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(**{k: v for k, v in b.items() if k != "y"})
            loss = loss_of(out, b)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(loss.detach().clone())
    if w is not None:
        w.close()
    return losses, grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make", [_t5, _tied], ids=["t5", "tied"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("every", [1, None, "headroom"], ids=["every1", "default", "headroom"])
def test_watch_is_bitwise_invisible(make, dtype, every):
    kw = {"headroom": True} if every == "headroom" else {"every": every} if every else {}
    l0, g0, w0 = _run(make, DTYPES[dtype], None)
    l1, g1, w1 = _run(make, DTYPES[dtype], kw)
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    for step, (a, b) in enumerate(zip(g0, g1)):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
        assert not diff, f"step {step}: {len(diff)} of {len(a)} gradients differ"
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
