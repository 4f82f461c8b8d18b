"""What a replay means (issue 13.1, 13.2, 13.9; issue 19): dtype comparisons with dropout off on both sides, a
backward overflow that a lower loss scale removes is GradScaler's normal search, a replay that cannot run is a
`replay_error`, a crashing fix-search trial is a crash, and dataclass outputs are walked like the recorder does."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.capture import save_batch, write_capture
from ampdoctor.replay import replay
from ampdoctor.replay.shadow import NoDropout

AC = {"device": "cpu", "dtype": "float16", "enabled": True}


def _capture(tmp_path, model, *args, name="cap", **kw):
    with torch.autocast("cpu", dtype=torch.float16):
        return save_batch(tmp_path / name, model, *args, **kw)


def _problems(rep):
    return [f.one_line() for f in rep.findings if f.severity in ("error", "warning")]


# ------------------------------------------------------------------------------------------------ 13.1 dropout
class KernelByDtype(nn.Module):
    """What SDPA does on CUDA: the fp16 kernel draws its dropout mask differently from the fp32 kernel (here the
    mask is drawn over the rows in reverse order in fp16), so the two runs drop different entries."""

    def forward(self, x):
        if x.dtype == torch.float16:
            return F.dropout(x.flip(0), 0.1, self.training).flip(0)
        return F.dropout(x, 0.1, self.training)


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.mix = KernelByDtype()
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.mix(self.a(x))))).float().mean()


def test_shadow_compares_like_with_like_under_dropout(tmp_path):
    torch.manual_seed(0)
    m = DropNet().train()
    rep = replay(_capture(tmp_path, m, torch.randn(16, 32)), model=m)
    assert not _problems(rep), _problems(rep)
    assert max(r["rel_err"] for r in rep.data["replay"]["shadow"]) < 0.05
    assert rep.data["replay"]["comparison_dropout"] == "off"
    assert m.training


def test_no_dropout_mode_turns_every_dropout_off():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 16)
    mha = nn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True).train()
    with NoDropout():
        assert torch.equal(F.dropout(x, 0.5, True), x) and torch.equal(nn.Dropout(0.3)(x), x)
        assert torch.equal(F.dropout2d(x, 0.5, True), x) and torch.equal(torch.dropout(x, 0.5, True), x)
        sdpa = F.scaled_dot_product_attention(x, x, x, None, 0.5)
        mha_train = mha(x[0], x[0], x[0])[0]
    assert torch.allclose(sdpa, F.scaled_dot_product_attention(x, x, x), atol=1e-6)
    assert torch.allclose(mha_train, mha.eval()(x[0], x[0], x[0])[0], atol=1e-6)
    assert not torch.equal(F.dropout(x, 0.5, True), x)          # the mode is gone after the block


def test_healthy_hf_gpt2_in_train_mode_replays_clean(tmp_path):
    transformers = __import__("pytest").importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                  bos_token_id=0, eos_token_id=0)
    m = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 128, (4, 64))
    rep = replay(_capture(tmp_path, m, input_ids=ids, labels=ids), model=m)
    assert not _problems(rep), _problems(rep)
    assert rep.summary["finite"] is True


# ------------------------------------------------------------------------------------------ 13.2 loss scale
class BigGrad(nn.Module):
    """Forward finite; d loss / d out = 2·out ≈ 200, so the fp16 gradient overflows at loss scale 2**16 (and
    2**10) but is finite at 2**8: GradScaler's normal search finds a scale within a few skipped steps."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(25.0)
            self.lin.bias.zero_()

    def forward(self, x):
        return self.lin(x).float().pow(2).sum()


class Pole(nn.Module):
    """A hand-written norm of a zero row: sqrt's gradient at 0 is inf (and NaN after ·h) at any loss scale."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.bias.zero_()

    def forward(self, x):
        h = self.lin(x)
        return torch.sqrt((h * h).sum(-1)).float().sum()


def _scaler_state(scale):
    s = torch.amp.GradScaler("cpu", init_scale=scale)
    return s.state_dict()


def test_backward_overflow_that_a_lower_scale_removes_is_info(tmp_path):
    m = BigGrad()
    cap = write_capture(tmp_path / "c", m, (torch.ones(2, 4),), {}, autocast=AC, scaler_state=_scaler_state(65536.0),
                        step=0)
    rep = replay(cap, model=m, whatif=False)
    assert not _problems(rep), _problems(rep)
    f = next(f for f in rep.findings if f.phase == "backward")
    assert f.severity == "info" and "GradScaler" in f.message
    ss = f.evidence["scaler_search"]
    assert ss["capture_scale"] == 65536.0 and 1.0 <= ss["finite_at"] < 65536.0
    assert rep.exit_code == 0


def test_backward_inf_at_every_scale_stays_an_error(tmp_path):
    torch.manual_seed(0)
    m = Pole()
    x = torch.randn(8, 4)
    x[3] = 0.0
    cap = write_capture(tmp_path / "c", m, (x,), {}, autocast=AC, scaler_state=_scaler_state(1024.0), step=3)
    rep = replay(cap, model=m, whatif=False)
    f = next(f for f in rep.findings if f.phase == "backward" and f.severity == "error")
    assert rep.data["replay"]["scaler_search"]["finite_at"] is None and rep.exit_code == 1
    assert f.op == "aten::div" and f.evidence["autograd_node"] == "SqrtBackward0"


def test_capture_of_a_real_early_backoff_replays_as_info(tmp_path):
    """The issue's scenario: a real GradScaler loop whose first steps are skipped (the scaler's search) and then
    recovers; a capture of the first skipped step (its batch, weights and scaler state, as a watch writes it)
    replays as the scaler's normal search, not as an error."""
    torch.manual_seed(0)
    m = BigGrad()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.ones(2, 4)
    cap = write_capture(tmp_path / "c", m, (x,), {}, autocast=AC, scaler_state=scaler.state_dict(), step=0)
    skipped = []
    for _ in range(12):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
    assert skipped[0] and not skipped[-1]                 # skipped at first, then a scale that works
    rep = replay(cap, model=m, whatif=False)
    assert not _problems(rep), _problems(rep)
    ss = rep.data["replay"]["scaler_search"]
    assert ss["backoffs"] == sum(skipped) and ss["finite_at"] == scaler.get_scale()   # what GradScaler found


# ------------------------------------------------------------------------------------------ 13.9 replay_error
class IntoFp32Buffer(nn.Module):
    """Scatters an autocast (fp16) activation into an fp32 buffer: index_add_ refuses mixed dtypes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return torch.zeros(2, 4).index_add_(0, torch.tensor([0, 1, 0]), h).sum()


def test_forward_that_raises_is_a_replay_error(tmp_path):
    m = IntoFp32Buffer()
    cap = write_capture(tmp_path / "c", m, (torch.randn(3, 4),), {}, autocast=AC)
    rep = replay(cap, model=m)
    assert [(f.rule, f.severity) for f in rep.findings] == [("replay_error", "info")]
    assert "index_add_" in rep.findings[0].message and rep.exit_code == 0


# --------------------------------------------------------------------------------------------------- issue 19
class OverflowIntoHalfBuffer(nn.Module):
    """`big` overflows fp16; run in fp32 (the fix search's trial) its fp32 output no longer fits the fp16 buffer
    and index_add_ raises: that trial crashed, it was not "not finite"."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(4, 4)
        with torch.no_grad():
            self.big.weight.fill_(3e4)

    def forward(self, x):
        h = self.big(x)
        return torch.zeros(2, 4, dtype=torch.float16).index_add_(0, torch.tensor([0, 1, 0]), h).float().mean()


def test_fix_search_trial_that_crashes_is_reported_as_a_crash(tmp_path):
    m = OverflowIntoHalfBuffer()
    cap = write_capture(tmp_path / "c", m, (torch.ones(3, 4),), {}, autocast=AC)
    rep = replay(cap, model=m, whatif=False)
    assert rep.findings[0].module == "big" and rep.findings[0].severity == "error"
    trials = rep.data["replay"]["fix"]["trials"]
    assert trials and trials[0]["modules"] == ["big"] and trials[0]["outcome"].startswith("crashed: RuntimeError")
    assert "index_add_" in trials[0]["outcome"]


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor


class DataclassOut(nn.Module):
    """Returns a plain dataclass; `logits` overflows, the loss (from another head) stays finite."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 1)
        with torch.no_grad():
            self.head.weight.fill_(3e4)

    def forward(self, x):
        return Out(self.head(x), self.aux(x).float().mean())


def test_dataclass_output_is_walked_like_the_recorder(tmp_path):
    m = DataclassOut()
    cap = write_capture(tmp_path / "c", m, (torch.ones(2, 4),), {}, autocast=AC)
    rep = replay(cap, model=m, loss_fn=lambda o, *a: o.loss, whatif=False)
    assert rep.summary["finite"] is False
    assert (rep.findings[0].rule, rep.findings[0].module, rep.findings[0].severity) == ("overflow", "head", "error")
