"""A capture of a model with tied weights (GPT-2's wte/lm_head, T5's shared embedding, BERT's decoder) whose tied
weight holds NaN: the replay's check that tied names hold one value in the capture compared them with
torch.equal, for which NaN != NaN, and refused the capture as "taken from a model where they were separate".
Found on the GPU corpus (`gpt2/half`, `t5/half`, `bert/half`: pure fp16 + AdamW, whose eps vanishes, so step 0's
update writes NaN into the weights; the capture at step 1 holds them, and its in-process replay failed)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.errors import BadInput


class TiedLM(nn.Module):
    def __init__(self, vocab=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def test_a_tied_weight_holding_nan_is_one_value_in_its_capture(tmp_path):
    torch.manual_seed(0)
    m = TiedLM()
    with torch.no_grad():
        m.emb.weight[3, 2] = float("nan")
    ids = torch.randint(0, 16, (2, 5))
    cap = ampdoctor.save_batch(tmp_path / "cap", m, ids)
    rep = ampdoctor.replay(cap, model=TiedLM(), shadow=False, whatif=False, fix_search=False)
    assert rep.findings, "the replay ran and saw the NaN"
    # a capture whose tied names really differ is still refused
    other = TiedLM()
    other.head.weight = nn.Parameter(torch.randn(16, 8))
    cap2 = ampdoctor.save_batch(tmp_path / "cap2", other, ids)
    with pytest.raises(BadInput, match="tied"):
        ampdoctor.replay(cap2, model=TiedLM(), shadow=False, whatif=False, fix_search=False)


def test_pure_fp16_tied_model_replays_its_capture_in_process(tmp_path):
    """The corpus's `/half` misuse on a tied model: model.half(), AdamW (eps 1e-8 rounds to 0 in fp16), no autocast,
    no scaler. A hidden unit that is never active leaves a zero gradient in the tied weight's entries of the tokens
    the batch does not hold: m = v = 0 there and the update is 0 / (0 + 0) = NaN. The report's in-process replay of
    the first bad step's capture runs, with no warning."""
    torch.manual_seed(0)
    m = TiedLM(vocab=64).half()
    with torch.no_grad():
        m.mid.bias[0] = -100.0  # (a dead ReLU unit)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=tmp_path / "run")
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 4))
        opt.zero_grad()
        loss = F.cross_entropy(m(ids).float().reshape(-1, 64), ids.reshape(-1))
        loss.backward()
        opt.step()
    assert bool(m.emb.weight.isnan().any()), "the update wrote NaN into the tied weight"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.close()
        rep = w.report()
    failed = [str(c.message) for c in caught if "replay" in str(c.message)]
    assert not failed, failed
    assert rep.summary["captures"], rep.summary
    assert "fp16_master_weights" in [f.rule for f in rep.findings[:3]], [str(f) for f in rep.findings[:5]]
