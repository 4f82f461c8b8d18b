"""Pruning the always-on headroom's hooks (ampdoctor/record/step.py `_prune_headroom_hooks`, headroom.py `plan`):
after the first routine step following a sampled one, modules that read nothing (fp32 outputs, containers
returning a child's value, pass-on modules no container returns) lose their hooks, and the series is unchanged."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        return self.drop(self.proj(a))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attn(d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x)), x.detach().sum()   # a tuple, as HF blocks return


class Net(nn.Module):
    def __init__(self, d=16, branch_from=None):
        super().__init__()
        self.emb = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.shared = nn.Linear(d, d)       # called twice
        self.branch = nn.Sequential(nn.Linear(d, d), nn.Tanh())  # only from step `branch_from` on
        self.head = nn.Linear(d, 4)
        self.branch_from = branch_from
        self.step = 0

    def forward(self, x):
        h = self.emb(x).float()              # an fp32 residual stream under autocast
        for b in self.blocks:
            h, _ = b(h)
        h = self.shared(self.shared(h).float())
        if self.branch_from is not None and self.step >= self.branch_from:
            h = h + self.branch(h)
        return self.head(h)


def _hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules() if m is not model)


def _run(model, steps, every=200, lr=0.0):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    x = torch.randn(4, 6, 8)
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc, every=every, headroom=True)
    counts = []
    for i in range(steps):
        model.step = i
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), torch.zeros(4, 6, 4))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        counts.append(_hooks(model))
    w.close()
    return w, counts


def test_the_series_is_the_same_with_the_idle_hooks_pruned():
    """lr=0 and one batch: every routine step sees the same values, so step 1 (observed, every hook) and steps
    2.. (pruned) must give the same series, slot for slot."""
    model = Net()
    w, counts = _run(model, 6)
    steps = list(w.steps)
    assert counts[2] < counts[1] and counts[2] <= counts[1] * 2 // 3, counts  # most hooks came off
    observed = steps[1].headroom
    names = [m[0] for m in w.meta.modules]
    read = [names[i] for i, v in enumerate(observed["fwd"]) if v is not None]
    assert "blocks.0.attn.qkv" in read and "head" in read and "blocks.0.attn" in read  # a container's value
    for r in steps[2:]:
        assert r.headroom == observed, (r.step, r.headroom, observed)


def test_a_branch_first_taken_after_the_observed_step_is_read():
    model = Net(branch_from=3)
    w, _ = _run(model, 6, lr=0.01)
    names = [m[0] for m in w.meta.modules]
    i = names.index("branch.0")
    got = [r.headroom["fwd"][i] for r in list(w.steps)[1:]]
    assert got[:2] == [None, None] and all(v is not None and v > 0 for v in got[2:]), got


def test_a_sampled_step_observes_again():
    """every=4: steps 1 and 5 run with every hook (observed), the others pruned; a module whose output becomes
    low-precision after the first observation is read from the next one on."""
    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 4)
            self.step = 0

        def forward(self, x):
            h = self.a(x)
            if self.step < 4:
                with torch.autocast("cpu", enabled=False):
                    return self.b(h.float())
            return self.b(h)
    model = Late()
    w, counts = _run(model, 8, every=4)
    # counts[i]: the hooks step i ran with (step 4 is sampled: the full statistics' hooks are on too)
    assert counts[1] == 2 and counts[2] == counts[3] == 1 and counts[5] == counts[6] == 2, counts
    names = [m[0] for m in w.meta.modules]
    b = names.index("b")
    got = {r.step: r.headroom["fwd"][b] for r in w.steps if not r.sampled}
    assert got[2] is None and got[3] is None  # fp32 then: nothing to read
    assert got[5] is not None and got[6] is not None and got[7] is not None, got


def test_pruned_hooks_come_off_on_close_and_a_copy_is_clean():
    import copy
    model = Net()
    w, _ = _run(model, 4)
    assert w.closed and _hooks(model) == 0
    assert _hooks(copy.deepcopy(model)) == 0
