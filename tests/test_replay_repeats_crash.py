"""A step that raised (a dtype mismatch, a shape check: the user's code, not a value) is captured; the report's
in-process replay runs it again and it raises the same error. That is the step reproduced, not a replay that
failed: no "in-process replay ... failed" warning (the corpus's `lstm/half` on the CPU: `model.half()` makes the
LSTM, fed fp32, raise `RNN input dtype (torch.float32) does not match weight dtype (torch.float16)` at step 0). A
replay that raises an error the step did not raise is still refused."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.errors import BadInput


class RNNLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids).float())  # an fp32 LSTM, as on the CPU (oneDNN has no fp16 LSTM)
        return self.head(h)


def _crash(tmp_path):
    torch.manual_seed(0)
    m = RNNLM().half()  # the LSTM's weights go fp16 too: the fp32 input no longer fits
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    w = ampdoctor.watch(m, optimizer=opt, run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match="does not match weight dtype"):
        for _ in range(3):
            ids = torch.randint(0, 16, (2, 5))
            opt.zero_grad()
            m(ids).float().mean().backward()
            opt.step()
    return w


def test_a_replay_that_raises_the_steps_own_error_is_no_replay_failure(tmp_path):
    w = _crash(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.close()  # (the loop raised and the script caught it; close replays the capture for the run directory)
        rep = w.report()
    failed = [str(c.message) for c in caught if "replay" in str(c.message)]
    assert not failed, failed
    assert "does not match weight dtype" in w.steps[0].exception["message"], w.steps[0].exception
    assert rep.summary["captures"], rep.summary  # (captured, and replayed without a warning)


def test_a_replay_that_raises_another_error_is_refused(tmp_path):
    w = _crash(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.close()
        cap = w.report().summary["captures"][0]

    class Other(RNNLM):
        def forward(self, ids):
            raise ValueError("a model that does not fit the capture")
    with pytest.raises(BadInput, match="does not fit"):
        ampdoctor.replay(cap, model=Other().half(), shadow=False, whatif=False, fix_search=False)
