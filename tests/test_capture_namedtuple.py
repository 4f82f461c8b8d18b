"""Namedtuples in a captured batch (tests/test_unseen_variants35.py case 10: a GRU tagger fed a PackedSequence; the
capture stored it as a plain tuple, so the replay failed inside the model and the report could only say
`skipped_steps at (run)`). torch's PackedSequence comes back as itself (nn.GRU/LSTM test its class); any other
namedtuple as a namedtuple of the same name and fields, built without importing the class the capture names; a
malformed entry is one clear line (BadInput) and exit code 2 from the CLI."""
from __future__ import annotations

import collections
import json
import os

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import ampdoctor
from ampdoctor.capture import load_capture, save_batch
from ampdoctor.cli import main
from ampdoctor.errors import BadInput

Batch = collections.namedtuple("Batch", ["tokens", "lengths"])


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, packed, extra):
        out, _ = self.gru(packed)
        h, _ = pad_packed_sequence(out, batch_first=True)
        return self.head(h) + extra.tokens.mean() * 0 + extra.lengths.float().mean() * 0


def batch():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 3)
    lens = torch.tensor([5, 2, 4])
    return pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False), Batch(torch.randn(3, 5), lens)


def test_packed_sequence_and_a_namedtuple_round_trip_and_replay(tmp_path):
    torch.manual_seed(1)
    m = Tagger()
    packed, extra = batch()
    path = save_batch(tmp_path / "cap", m, packed, extra)
    cap = load_capture(path)
    p2, e2 = cap.args
    assert type(p2) is PackedSequence
    for a, b in zip(packed, p2):
        assert (a is None and b is None) or torch.equal(a, b)
    assert type(e2).__name__ == "Batch" and e2._fields == ("tokens", "lengths") and type(e2) is not Batch
    assert torch.equal(e2.tokens, extra.tokens) and torch.equal(e2.lengths, extra.lengths)
    with torch.no_grad():
        assert torch.equal(m(p2, e2), m(packed, extra))
    rep = ampdoctor.replay(path, m)   # the model runs on what the capture gives back (a tuple fails in nn.GRU)
    assert not any("failed" in (f.message or "") for f in rep.findings), rep.text()


@pytest.mark.parametrize("bad", [
    {"type": "x.Y", "fields": ["a"], "items": []},               # fields and items differ in number
    {"type": "x.Y", "fields": ["__class__"], "items": [1]},      # not a plain field name
    {"type": "x.Y", "fields": ["import os"], "items": [1]},
    {"type": "x.Y", "fields": ["a", "a"], "items": [1, 2]},
    {"type": 3, "fields": ["a"], "items": [1]},
    ["a"],
])
def test_a_malformed_namedtuple_is_one_line_and_exit_2(tmp_path, capsys, bad):
    m = Tagger()
    path = save_batch(tmp_path / "cap", m, *batch())
    mp = os.path.join(path, "manifest.json")
    man = json.load(open(mp))
    man["structure"]["args"]["__tuple__"][1] = {"__namedtuple__": bad}
    with open(mp, "w") as f:
        json.dump(man, f)
    with pytest.raises(BadInput, match="namedtuple"):
        load_capture(path)
    assert main(["replay", path, "--model", "tests.test_capture_namedtuple:Tagger"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "namedtuple" in err[0], err


def test_a_class_name_in_the_capture_is_never_imported(tmp_path):
    m = Tagger()
    path = save_batch(tmp_path / "cap", m, *batch())
    mp = os.path.join(path, "manifest.json")
    man = json.load(open(mp))
    nt = man["structure"]["args"]["__tuple__"][1]["__namedtuple__"]
    nt["type"] = "os.system"   # a stranger's capture naming a callable: only a name, never looked up
    with open(mp, "w") as f:
        json.dump(man, f)
    e2 = load_capture(path).args[1]
    assert type(e2).__name__ == "system" and e2._fields == ("tokens", "lengths")
