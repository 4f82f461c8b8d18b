"""Tiny models that fail on purpose under fp16 autocast on CPU, rebuilt from shared/cases/*.py.

Each `case_*()` returns a `Case`: the model (weights already set to fail), the batch, an optional loss_fn and
what replay must find (rule, module, phase, op). Append new cases at the end; keep each one fast.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fixtures.models import make_t5_overflow  # noqa: E402


@dataclass
class Case:
    model: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    loss_fn: Callable | None = None
    expect: dict = field(default_factory=dict)


def mean_sq(out, *args, **kwargs):
    return out.float().pow(2).mean()


# -- attention scores overflow before the 1/sqrt(d) scale (attn_qk_overflow_before_scaling) ---------------
class SelfAttention(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.d = d

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        return self.o(torch.softmax(scores, dim=-1) @ v)


class AttnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = SelfAttention()

    def forward(self, x):
        return x + self.attn(x)


def case_attn() -> Case:
    torch.manual_seed(0)
    m = AttnModel()
    with torch.no_grad():
        m.attn.q.weight.mul_(40.0)
        m.attn.k.weight.mul_(40.0)
    return Case(m, (torch.randn(1, 8, 64) * 3.0,), loss_fn=mean_sq,
                expect={"rule": "overflow", "module": "attn", "phase": "forward", "op": "aten::bmm"})


# -- T5 feed-forward `wo` overflow (t5_ffn_wo_overflow) ------------------------------------------------------
def case_t5() -> Case:
    m = make_t5_overflow()
    torch.manual_seed(1)
    x = torch.randn(2, 8, 32)
    return Case(m, (x,), {"labels": torch.randn(2, 8, 32)},
                expect={"rule": "overflow", "module": "ff.wo", "phase": "forward", "op": "aten::mm"})


# -- clamp(max=1-1e-6) is a no-op in fp16, log1p's backward is NaN (clamp_eps_noop_log1p_backward_nan) -------
class Consistency(nn.Module):
    def forward(self, logits, pair_index, n_pairs, target):
        p = torch.sigmoid(logits).clamp(max=1.0 - 1e-6)
        log_surv = torch.log1p(-p)
        acc = torch.zeros(n_pairs, dtype=log_surv.dtype).scatter_add(0, pair_index, log_surv)
        pair_prob = 1 - torch.exp(acc)
        return ((pair_prob.float() - target) ** 2).mean()


class ConsistencyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.scorer = nn.Linear(8, 1)
        self.consistency = Consistency()

    def forward(self, x, pair_index, n_pairs, target):
        return self.consistency(self.scorer(x).squeeze(-1), pair_index, n_pairs, target)


def case_log1p() -> Case:
    torch.manual_seed(0)
    m = ConsistencyModel()
    with torch.no_grad():
        m.scorer.bias.fill_(12.0)
    args = (torch.randn(6, 8) * 0.1, torch.tensor([0, 0, 1, 1, 2, 2]), 3, torch.ones(3))
    return Case(m, args, expect={"rule": "nan_origin", "module": "consistency", "phase": "backward"})


# -- F.normalize's eps=1e-12 is 0 in fp16 (normalize_eps_underflow) -----------------------------------------
class EmbedHead(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=-1)


class NormalizeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.embed_head = EmbedHead()

    def forward(self, x):
        return self.embed_head(self.proj(x))


def case_normalize() -> Case:
    torch.manual_seed(0)
    m = NormalizeModel()
    x = torch.randn(2, 8)
    x[0] = 0.0
    return Case(m, (x,), loss_fn=lambda out, *a, **k: out.float().sum(),
                expect={"rule": "eps_underflow", "module": "embed_head", "phase": "forward"})


# -- masked_fill(-1e9) on fp16 scores raises (masked_fill_constant_overflow_error) --------------------------
class MaskAttention(nn.Module):
    def __init__(self, d=16, fill=-1e9):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.fill = fill
        self.d = d

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        scores = scores.masked_fill(mask == 0, self.fill)
        return torch.softmax(scores, -1) @ v


class MaskModel(nn.Module):
    def __init__(self, fill=-1e9):
        super().__init__()
        self.attn = MaskAttention(fill=fill)

    def forward(self, x, mask):
        return self.attn(x, mask)


def case_masked_fill() -> Case:
    torch.manual_seed(0)
    mask = torch.ones(2, 1, 5, dtype=torch.long)
    mask[1, :, 3:] = 0
    return Case(MaskModel(), (torch.randn(2, 5, 16), mask), loss_fn=mean_sq,
                expect={"rule": "mask_value_overflow", "module": "attn", "phase": "forward", "op": "aten::masked_fill"})


# -- exp in a custom loss overflows fp16 (exp_overflow_custom_loss) -----------------------------------------
class NaiveNLL(nn.Module):
    def forward(self, logits, target):
        lse = torch.log(torch.exp(logits).sum(-1))
        return (lse - logits.gather(1, target[:, None]).squeeze(1)).mean()


class ExpLossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 5)
        self.criterion = NaiveNLL()

    def forward(self, x, t):
        return self.criterion(self.net(x), t)


def case_exp_loss() -> Case:
    torch.manual_seed(0)
    m = ExpLossModel()
    with torch.no_grad():
        m.net.weight.mul_(15.0)
    return Case(m, (torch.randn(8, 16), torch.randint(0, 5, (8,))),
                expect={"rule": "overflow", "module": "criterion", "phase": "forward", "op": "aten::exp"})


# -- controls -------------------------------------------------------------------------------------------------
class Healthy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 1))

    def forward(self, x, y):
        return F.mse_loss(self.net(x).float(), y)


def case_healthy() -> Case:
    torch.manual_seed(0)
    return Case(Healthy(), (torch.randn(16, 8), torch.randn(16, 1)))


class DropoutBoost(nn.Module):
    """Dropout decides which entries overflow: kept entries (x * 2) go through ×5000 → 1e5 > 65504 → inf."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.boost = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            self.boost.weight.copy_(torch.eye(16) * 5000.0)

    def forward(self, x):
        return self.boost(self.drop(x))


def case_dropout() -> Case:
    return Case(DropoutBoost(), (torch.full((4, 16), 10.0),), loss_fn=mean_sq,
                expect={"rule": "overflow", "module": "boost", "phase": "forward"})
