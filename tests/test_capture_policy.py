"""Which bad steps get a capture (issue 18): GradScaler's normal search for a loss scale does not use up the
capture; a later real failure gets one, and the report names its module, op and step from that capture."""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(MLP(d) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _run(tmp_path, spike_at=8, steps=12, init_scale=2.0 ** 20):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)  # far too high: the first steps back off
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        if step == spike_at:
            with torch.no_grad():
                m.blocks[1].up.weight.mul_(1e5)  # from here on blocks.1.up overflows fp16
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(torch.randn(16, 8, generator=g) * 4).float(), torch.zeros(16, 1))
        sc.scale(loss).backward()
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    w.close()
    return w


def test_early_backoff_does_not_use_up_the_capture(tmp_path):
    w = _run(tmp_path)
    early = [r.step for r in w.steps if r.skipped and r.step < 8]
    assert len(early) >= 3, "the scenario needs several early backoffs"
    caps = sorted(int(d) for d in os.listdir(tmp_path / "captures"))
    assert 8 in caps and not any(c in early for c in caps), caps
    rep = ampdoctor.diagnose(tmp_path)
    assert rep.summary["first_bad_step"] == 8
    top = w.report().findings[:3]
    assert any(f.rule == "overflow" and f.module == "blocks.1.up" and f.op and f.step == 8 for f in top), \
        [(f.rule, f.module, f.op, f.step) for f in top]


def test_a_persistent_skip_after_the_scale_settled_is_captured(tmp_path):
    """Gradients that overflow at every scale (a backward-only failure) after the run had settled: captured."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(torch.randn(16, 8, generator=g))
            loss = F.mse_loss(out.float(), torch.zeros(16, 1))
            if step >= 4:
                loss = loss * 1e30  # fp32 loss, finite; its gradient overflows fp16 at any scale
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    w.close()
    assert not any(r.skipped for r in w.steps[:4])
    caps = sorted(int(d) for d in os.listdir(tmp_path / "captures"))
    assert caps and caps[0] == 4, caps


def test_issue18_gpt2_with_checkpointing_names_the_spiked_projection_from_its_capture(tmp_path):
    """Issue 18's sequence on a tiny HF GPT-2 with gradient checkpointing and the default sampling: the weights
    of h.1's c_proj x1e6 at step 4 (an unsampled step). The follow-up step sees the inf first in the dropout
    after it (another batch); the replay of step 4's own capture names c_proj and its op, at step 4."""
    transformers = __import__("pytest").importorskip("transformers")
    import warnings
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=128, vocab_size=512)
    model = transformers.GPT2LMHeadModel(cfg).train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4)
    sc = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, run_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(8):
            if step == 4:
                with torch.no_grad():
                    model.transformer.h[1].mlp.c_proj.weight.mul_(1e6)
            ids = torch.randint(0, 512, (2, 64), generator=g)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            sc.step(opt)
            sc.update()
        w.close()
        rep = w.report()
    assert rep.summary["first_bad_step"] == 4 and [os.path.basename(c) for c in rep.summary["captures"]] == ["4"]
    top = rep.findings[:3]
    assert any(f.rule == "overflow" and f.module == "transformer.h.1.mlp.c_proj" and f.op == "aten::addmm"
               and f.step == 4 for f in top), [(f.rule, f.module, f.op, f.step) for f in top]
    assert not [f for f in rep.findings if f.rule == "update_spike"]  # the x1e6 was no optimizer update
