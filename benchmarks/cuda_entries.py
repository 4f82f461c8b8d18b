"""Entry modules on the GPU (ampdoctor/record/entries.py): a container whose own forward the loop never calls.

A nanoGPT-like container (`self.gpt`, the loss as a module) trained by a loop that calls `model.gpt(idx)` under CUDA
fp16 autocast with a GradScaler; at step BAD one attention projection's weight is multiplied (a spike). Prints, per
case, what ampdoctor's top three say and whether the losses were bitwise identical with and without the watch
(the healthy case), then a short table last.

    python benchmarks/cuda_entries.py [--device cuda] [--steps 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampdoctor  # noqa: E402

BAD = 9


class Block(nn.Module):
    def __init__(self, d=128, h=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=256, d=128, n=4, T=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Lit(nn.Module):
    """The container the loop never calls: the network and its loss."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT()
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, idx):  # never called by the loop below
        return self.gpt(idx)


def run(dev, steps, watch, spike):
    torch.manual_seed(0)
    m = Lit().to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    sc = torch.amp.GradScaler(dev.type)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tempfile.mkdtemp(prefix="cuda-entries-")) \
        if watch else None
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for i in range(steps):
        idx = torch.randint(0, 256, (8, 64), generator=g).to(dev)
        if spike and i == BAD:
            with torch.no_grad():
                m.gpt.blocks[2].fc.weight.mul_(1e6)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.float16):
            logits = m.gpt(idx[:, :-1])
            loss = m.criterion(logits.float().reshape(-1, 256), idx[:, 1:].reshape(-1))
        sc.scale(loss).backward()
        sc.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    rep = None
    if w is not None:
        w.close()
        rep = w.report()
    return losses, rep


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    dev = torch.device(a.device)
    rows = []
    plain, _ = run(dev, a.steps, False, False)
    watched, rep = run(dev, a.steps, True, False)
    bad = [f.one_line()[:140] for f in rep.findings if f.severity in ("warning", "error")]
    rows.append(("healthy", "PASS" if plain == watched and not bad else "FAIL",
                 f"bitwise={plain == watched} warnings/errors={bad}"))
    losses, rep = run(dev, a.steps, True, True)
    top = [(f.rule, f.module, f.step, f.severity) for f in rep.findings[:3]]
    ok = any(r in ("overflow", "nan_origin") and (mod or "").startswith("gpt.blocks.2.fc") and s == BAD
             and sev == "error" for r, mod, s, sev in top)
    rows.append(("spike@blocks.2.fc", "PASS" if ok else "FAIL", f"top3={top}"))
    print(f"torch {torch.__version__} device {dev}")
    print("| case | result | detail |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
