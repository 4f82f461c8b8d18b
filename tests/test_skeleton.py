"""The model's structure kept with a capture (ampdoctor/replay/skeleton.py): what the in-process replay runs on when
the script has changed the live model after the bad step (tests/test_unseen_variants35.py case 2: weight_norm
removed for export before `close()`; here: a head swapped for a wider one). The skeleton is a copy of the module
tree with meta tensors (ties and shared modules kept, no hooks, other attributes shared, never deep-copied), and the
live model is used while it still matches the capture. The body's Linear is one module under two more names
(`body.0`, `body.2`): the replay names it `shared`, its first name, as the watch does (replay/optrace.py took the
last, `body.2`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import ampdoctor
from ampdoctor.replay.skeleton import for_replay, skeleton


class Heavy:
    """Stands for what a module may refer to and must not be copied (a LightningModule's trainer, a dataset)."""

    def __deepcopy__(self, memo):
        raise AssertionError("deep-copied")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.conv = weight_norm(nn.Conv1d(8, 8, 3, padding=1))
        self.shared = nn.Linear(8, 8)
        self.body = nn.Sequential(self.shared, nn.GELU(), self.shared)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.ones(1))
        self.trainer = Heavy()

    def forward(self, idx):
        h = self.emb(idx)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.body(h) * self.scale)


def test_skeleton_keeps_structure_ties_and_shares_attributes():
    m = Net()
    m.register_forward_hook(lambda *a: None)
    m.compile = None  # (an attribute of the instance's own dict: shared, like any other)
    sk = skeleton(m)
    assert sk is not None and sk is not m
    assert all(t.is_meta for t in list(sk.parameters()) + list(sk.buffers()))
    assert sk.head.weight is sk.emb.weight and sk.body[0] is sk.body[2] is sk.shared
    assert sk.trainer is m.trainer and not sk._forward_hooks and m._forward_hooks
    assert not any(t.is_meta for t in m.parameters())  # the live model is untouched
    assert for_replay(m, sk) is m  # it still matches: the live model (with its hooks) is replayed


def test_changed_model_is_replayed_on_the_skeleton():
    m = Net()
    sk = skeleton(m)
    parametrize.remove_parametrizations(m.conv, "weight")   # the live model changes after the capture
    m.head = nn.Linear(8, 32)
    r = for_replay(m, sk)
    assert r is not m and type(r.conv).__name__ == "ParametrizedConv1d"
    assert r.conv.weight.shape == (8, 8, 3) and r.head.weight is r.emb.weight
    assert not any(t.is_meta for t in r.parameters())
    assert for_replay(m, sk) is r  # materialised once


def run(tmp_path, swap: bool):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=256)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    bad = []
    for i in range(10):
        if i == 6:
            with torch.no_grad():
                m.shared.weight.mul_(4000.0)   # a checkpoint of the body loaded with a wrong scale
        idx = torch.randint(0, 16, (4, 12), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(idx)
        loss = F.cross_entropy(out.float().reshape(-1, 16), idx.reshape(-1))
        if not math.isfinite(loss.item()):
            bad.append(i)
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    if swap:  # the script's export step, inside the watch: a new head, weight norm folded in
        m.head = nn.Linear(8, 32)
        parametrize.remove_parametrizations(m.conv, "weight")
    w.close()
    return w.report(), bad


def test_report_names_the_producer_after_the_script_changed_the_model(tmp_path, recwarn):
    ref, bad = run(tmp_path / "a", swap=False)
    assert bad and bad[0] == 6
    rep, _ = run(tmp_path / "b", swap=True)
    assert not [w for w in recwarn if "replay" in str(w.message)], [str(w.message) for w in recwarn]
    top = [(f.rule, f.module, f.step) for f in rep.findings[:3]]
    want = [(f.rule, f.module, f.step) for f in ref.findings[:3]]
    assert top == want and top[0][1] == "shared" and top[0][2] == 6, (top, want)
