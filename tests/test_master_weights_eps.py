"""Pure fp16 training (`model.half()`, AdamW on the fp16 weights, no autocast, no scaler): AdamW's eps=1e-8 rounds to 0
in fp16, an element whose gradient was 0 divides 0 by 0, the weights go non-finite at the first update. The vanished
eps (`eps_underflow`) is how it broke; the missing fp32 master copy (`fp16_master_weights`) is why, and its fix is
the fix for both: it is an error here, among the first three findings, not a warning below the consequences
(`update_spike`, `overflow` of the inf weights) as it was on the corpus's GPT-2, Llama, T5, BERT and MoE runs
(benchmarks/realworld `*/half`)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.ln = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 64)

    def forward(self, x):
        return self.fc(self.ln(self.emb(x)))


def _run(eps):
    torch.manual_seed(0)
    model = LM().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    w = ampdoctor.watch(model, optimizer=opt)
    losses = []
    for _ in range(6):
        x = torch.randint(0, 16, (8, 12))
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float().view(-1, 64), x.view(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    w.close()
    return losses, w.report().findings


def test_pure_fp16_adam_names_the_missing_master_copy_as_an_error():
    losses, fs = _run(1e-8)
    assert math.isfinite(losses[0]) and not any(math.isfinite(v) for v in losses[1:])  # broken by the first update
    top = [(f.rule, f.severity) for f in fs[:3]]
    assert ("fp16_master_weights", "error") in top, top
    assert ("eps_underflow", "error") in top, top
    master = next(f for f in fs if f.rule == "fp16_master_weights")
    assert "eps" in master.message and master.step == 0


def test_without_a_vanishing_eps_the_master_copy_stays_a_warning():
    losses, fs = _run(1e-3)  # eps 1e-3 exists in fp16: no division by 0
    assert all(math.isfinite(v) for v in losses)
    master = [f for f in fs if f.rule == "fp16_master_weights"]
    assert [f.severity for f in master] == ["warning"] and "eps" not in master[0].message
    assert not any(f.rule == "eps_underflow" for f in fs)
