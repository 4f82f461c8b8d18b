"""A model that changes shape after the watch began: modules added (a grown classifier head, LoRA adapters put in
after `watch`), the optimizer rebuilt for them. ampdoctor must stay on (no internal error), stay quiet on the
healthy run, and name a module it did not know at the start by its own name when that module is where a failure
starts.

Before the fix (tests/test_healthy_default8.py case 24): HeadroomHooks.install indexed the watch-time slot table with
every module of the model, a KeyError for the new head that switched ampdoctor off."""
import warnings

import torch
import torch.nn as nn

import ampdoctor
from scenarios import in_top3, lines, one_thread, randn

one_thread_fixture = __import__("pytest").fixture(autouse=True)(one_thread)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=4, alpha=1.0):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, r, bias=False)
        self.up = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)
        self.alpha = alpha

    def forward(self, x):
        return self.base(x) + self.alpha * self.up(self.down(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.inp(x)))))


def _loop(m, steps, change_at, change, batch, every=4):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "ampdoctor disabled itself" would fail here
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, every=every)
        for i in range(steps):
            if i == change_at:
                change(m)
                opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
            opt.zero_grad()
            x, y = batch(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
        rep = w.report()
        w.close()
    return w, rep


def _batch(i):
    return randn(8, 16, seed=i), torch.arange(8) % 4


def _grow_head(m):
    old = m.head
    m.head = nn.Linear(32, 6)
    with torch.no_grad():
        m.head.weight[:4].copy_(old.weight)
        m.head.bias[:4].copy_(old.bias)


def _add_lora(m):
    for p in m.parameters():
        p.requires_grad_(False)
    m.mid = LoRALinear(m.mid)


def test_a_head_grown_and_lora_added_after_the_watch_began_keep_the_watch_on_and_quiet():
    for change in (_grow_head, _add_lora):
        m = Net()
        classes = (lambda i: 6 if i >= 10 else 4) if change is _grow_head else (lambda i: 4)
        w, rep = _loop(m, 30, 10, change, lambda i: (randn(8, 16, seed=i), torch.arange(8) % classes(i)))
        assert rep.summary.get("internal_error") is None, rep.summary
        assert not w.machine.disabled
        assert [f for f in rep.findings if f.severity in ("warning", "error")] == [], lines(rep)
        assert len(w.steps) == 30


class Blow(nn.Module):
    """An adapter that multiplies by a huge factor from step `at` on (a learned scale that ran away)."""

    def __init__(self, base, at):
        super().__init__()
        self.base, self.at, self.n = base, at, 0

    def forward(self, x):
        self.n += 1
        y = self.base(x)
        return y * (1e6 if self.n > self.at else 1.0)


def test_a_module_added_after_the_watch_began_is_named_when_it_overflows():
    m = Net()

    def add(mm):
        mm.mid = Blow(mm.mid, at=6)  # added at step 10: its forward overflows fp16 from step 16 on

    w, rep = _loop(m, 22, 10, add, _batch, every=4)
    assert rep.summary.get("internal_error") is None, rep.summary
    f = in_top3(rep, ("overflow", "nan_origin"), "mid")
    assert f.step == 16, (f.one_line(), lines(rep))
