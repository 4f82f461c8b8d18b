"""What a watch's capture holds of the objects real code passes to a model (tests/test_unseen_variants36.py: nine
of ten failures lost their replay to an argument the capture refused or gave back wrong), read back from disk:
enums (as their value), SimpleNamespace, a Mapping that is no dict (a dict), tuple and enum dict keys, numpy arrays
and scalars, dataclasses (a dataclass of the same name and fields); anything else a placeholder naming its type,
which a replay from disk refuses in one line (exit code 2), while `save_batch` refuses the argument itself. Nothing
a capture names is imported."""
from __future__ import annotations

import collections
import dataclasses
import enum
import types

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.capture import Opaque, load_capture, relive, save_batch, write_capture
from ampdoctor.cli import main
from ampdoctor.errors import BadInput


class Mode(str, enum.Enum):
    TRAIN = "train"


class Stage(enum.Enum):
    A = 1


@dataclasses.dataclass(frozen=True)
class Utt:
    feats: torch.Tensor
    lang: str


class Feats(collections.UserDict):
    pass


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, *rest, **kw):
        return self.lin(x)


def objects():
    return (torch.randn(2, 3),
            dict(mode=Mode.TRAIN, stage=Stage.A, ns=types.SimpleNamespace(t=torch.ones(2), name="x"),
                 fe=Feats(a=torch.zeros(1)), keyed={("rgb", "front"): torch.ones(1), Stage.A: 2},
                 arr=np.arange(4, dtype=np.float32), sc=np.float32(0.5), utt=Utt(torch.ones(2), "de"),
                 crit=nn.CrossEntropyLoss()))


def test_a_watch_capture_holds_them_and_relive_gives_the_live_objects_back(tmp_path):
    x, kw = objects()
    path = write_capture(tmp_path / "cap", Net(), (x,), kw, opaque=True)
    cap = load_capture(path)
    k = cap.kwargs
    assert k["mode"] == "train" and k["stage"] == 1
    assert isinstance(k["ns"], types.SimpleNamespace) and torch.equal(k["ns"].t, torch.ones(2)) and k["ns"].name == "x"
    assert type(k["fe"]) is dict and torch.equal(k["fe"]["a"], torch.zeros(1))
    assert torch.equal(k["keyed"][("rgb", "front")], torch.ones(1)) and k["keyed"][1] == 2
    assert isinstance(k["arr"], np.ndarray) and np.array_equal(k["arr"], np.arange(4, dtype=np.float32))
    assert isinstance(k["sc"], np.float32) and k["sc"] == 0.5
    assert dataclasses.is_dataclass(k["utt"]) and type(k["utt"]).__name__ == "Utt" and type(k["utt"]) is not Utt
    assert isinstance(k["crit"], Opaque) and k["crit"].type.endswith("CrossEntropyLoss")
    back = relive(cap.kwargs, kw)   # the in-process replay: the live objects where the capture cannot be exact
    assert back["mode"] is Mode.TRAIN and back["stage"] is Stage.A and back["crit"] is kw["crit"]
    assert type(back["fe"]) is Feats and type(back["utt"]) is Utt and back["utt"].lang == "de"
    assert back["utt"].feats is cap.kwargs["utt"].feats   # tensors: the capture's copies
    assert torch.equal(relive(cap.args, (x,))[0], x)


def test_a_replay_from_disk_of_a_placeholder_is_one_line_exit_2(tmp_path, capsys):
    x, kw = objects()
    path = write_capture(tmp_path / "cap", Net(), (x,), kw, opaque=True)
    assert main(["replay", str(path), "--model", "tests.test_capture_objects:Net"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CrossEntropyLoss" in err[0] and "does not hold" in err[0], err


def test_save_batch_refuses_what_it_cannot_hold(tmp_path):
    with pytest.raises(BadInput, match="unsupported type CrossEntropyLoss"):
        save_batch(tmp_path / "cap", Net(), torch.randn(2, 3), nn.CrossEntropyLoss())


def test_python_and_numpy_rng_states_round_trip_and_a_corrupt_one_is_refused(tmp_path):
    import random

    from ampdoctor.replay.modelio import set_rng
    from ampdoctor.tensors import pack_np_rng, pack_py_rng
    random.seed(3)
    np.random.seed(4)
    random.random()
    np.random.rand(5)
    rng = {"cpu": torch.get_rng_state(), "py": pack_py_rng(random.getstate()),
           "np": pack_np_rng(np.random.get_state())}
    want = (random.random(), float(np.random.rand()))
    path = write_capture(tmp_path / "cap", Net(), (torch.randn(2, 3),), {}, rng=rng)
    cap = load_capture(path)
    random.random(), np.random.rand(7)      # move both on
    set_rng(cap.rng)                          # what the replay does before the captured forward
    assert (random.random(), float(np.random.rand())) == want
    bad = write_capture(tmp_path / "bad", Net(), (torch.randn(2, 3),), {},
                        rng={"cpu": torch.get_rng_state(), "py": torch.zeros(10, dtype=torch.uint8)})
    with pytest.raises(BadInput, match="RNG state py is not a valid Python RNG state"):
        load_capture(bad)
