"""Hooks never break the model: odd outputs, in-place ops, None gradients, integer and sparse tensors."""
import warnings

import torch
import torch.nn as nn

import ampdoctor


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.unused = nn.Linear(8, 8)  # never called: its gradient stays None

    def forward(self, idx):
        h = self.lin(self.emb(idx))
        h.add_(1.0)  # in-place on a module's output
        h = self.act(h)
        return {"out": h.sum(), "ids": idx.argmax(), "note": "text", "none": None, "empty": torch.empty(0),
                "meta": torch.empty(3, device="meta")}


def test_odd_model_trains_unchanged_and_quietly():
    torch.manual_seed(0)
    m = Odd()
    # lr 0.01: at 0.1 the sum-of-outputs loss multiplies `lin`'s weights by 5.5 in one step, which the
    # update_spike rule rightly reports; this test is about odd outputs and tensors, not the learning rate
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    idx = torch.randint(0, 10, (4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ampdoctor.watch(m, optimizer=opt, every=1) as w:
            for _ in range(3):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = m(idx)
                out["out"].float().backward()
                opt.step()
    assert len(w.steps) == 3 and w.steps[0].modules
    assert not [f for f in w.report().findings if f.severity != "info"]


def test_deprecated_cuda_amp_scaler_is_flagged_as_info():
    import torch.cuda.amp as old_amp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc = old_amp.GradScaler(enabled=False)
    m = nn.Linear(2, 1)
    with ampdoctor.watch(m, scaler=sc) as w:
        m(torch.randn(1, 2))
    fs = [f for f in w.report().findings if f.evidence.get("api") == "torch.cuda.amp.GradScaler"]
    assert fs and fs[0].severity == "info"
