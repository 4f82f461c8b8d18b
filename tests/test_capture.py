"""Tests of ampdoctor/capture.py: round trip of format v1 and refusal of every kind of bad capture."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from ampdoctor.capture import FORMAT_VERSION, load_capture, save_batch, write_capture
from ampdoctor.errors import BadInput


@dataclass
class Batch:
    ids: torch.Tensor
    note: str


class Cfg:
    def to_dict(self):
        return {"model_type": "tiny", "d_model": 8, "dropout": 0.1}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.tensor(3))
        self.config = Cfg()

    def forward(self, *a, **k):
        return a


@pytest.fixture()
def cap_dir(tmp_path):
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        save_batch(tmp_path / "cap", m, x, (1, 2.5, None), {"mask": torch.ones(2, dtype=torch.bool)},
                   flag=True, name="b", b=Batch(torch.arange(3), "hi"), inf=float("-inf"))
    return tmp_path / "cap", m, x


def test_round_trip(cap_dir):
    path, m, x = cap_dir
    cap = load_capture(path)
    assert cap.manifest["format"] == "ampdoctor-capture" and cap.manifest["format_version"] == FORMAT_VERSION
    assert cap.manifest["model_class"].endswith("test_capture.Net")
    assert cap.hf_config == {"model_type": "tiny", "d_model": 8, "dropout": 0.1}
    assert cap.autocast == {"device": "cpu", "dtype": "bfloat16", "enabled": True}
    a0, tup, d = cap.args
    assert torch.equal(a0, x.detach()) and a0.requires_grad
    assert tup == (1, 2.5, None) and isinstance(tup, tuple)
    assert d["mask"].dtype == torch.bool
    assert cap.kwargs["flag"] is True and cap.kwargs["name"] == "b" and cap.kwargs["inf"] == float("-inf")
    b = cap.kwargs["b"]   # a dataclass comes back as one of the same name and fields (Batch itself is not imported)
    assert dataclasses.is_dataclass(b) and type(b).__name__ == "Batch" and type(b) is not Batch
    assert torch.equal(b.ids, torch.arange(3)) and b.note == "hi"
    assert set(cap.state_dict) == {"lin.weight", "lin.bias", "count"}
    assert torch.equal(cap.state_dict["lin.weight"], m.lin.weight.detach())
    assert cap.rng["cpu"].dtype == torch.uint8 and cap.manifest["rng"] == ["cpu"]
    assert cap.step is None and cap.scaler_state is None


def test_write_capture_uses_given_state(tmp_path):
    m = Net()
    sd = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
    rng = {"cpu": torch.get_rng_state()}
    torch.rand(5)  # move the RNG on: the capture must keep the state it was given
    write_capture(tmp_path / "c", m, (torch.ones(1),), {}, state_dict=sd, rng=rng, step=12,
                  scaler_state={"scale": torch.tensor(1024.0), "growth_factor": 2.0},
                  autocast={"device": "cpu", "dtype": "float16", "enabled": True})
    cap = load_capture(tmp_path / "c")
    assert cap.step == 12 and cap.scaler_state == {"scale": 1024.0, "growth_factor": 2.0}
    assert torch.equal(cap.rng["cpu"], rng["cpu"])
    assert all(float(v.abs().sum()) == 0 for v in cap.state_dict.values())


def test_unsupported_arg_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="unsupported type object"):
        save_batch(tmp_path / "c", Net(), object())


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, m):
    (path / "manifest.json").write_text(json.dumps(m))


def test_missing_dir_and_file(cap_dir, tmp_path):
    path, _, _ = cap_dir
    with pytest.raises(BadInput) as e:
        load_capture(tmp_path / "nope")
    _one_line(e)
    os.unlink(path / "state.safetensors")
    with pytest.raises(BadInput, match="missing file state.safetensors") as e:
        load_capture(path)
    _one_line(e)


def test_truncated_file(cap_dir):
    path, _, _ = cap_dir
    data = (path / "tensors.safetensors").read_bytes()
    (path / "tensors.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInput, match="truncated") as e:
        load_capture(path)
    _one_line(e)


def test_corrupt_bytes(cap_dir):
    path, _, _ = cap_dir
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (path / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(BadInput, match="sha256"):
        load_capture(path)
    m = _manifest(path)                      # without the checksum the parser still refuses garbage headers
    m["files"]["state"]["sha256"] = None
    data[:8] = (10 ** 12).to_bytes(8, "little")
    (path / "state.safetensors").write_bytes(bytes(data))
    _write_manifest(path, m)
    with pytest.raises(BadInput, match="not a valid safetensors"):
        load_capture(path)


@pytest.mark.parametrize("field,value,match", [
    ("format_version", 2, "newer than this ampdoctor"),
    ("format_version", "1", "not an integer"),
    ("format", "other", "manifest format"),
    ("step", "12", "step is not an int"),
    ("autocast", {"device": "cpu"}, "autocast must be"),
    ("structure", [], "must be dict"),
    ("files", {"tensors": {"name": "tensors.safetensors", "bytes": 1 << 50}}, "size ampdoctor accepts"),
])
def test_bad_manifest_fields(cap_dir, field, value, match):
    path, _, _ = cap_dir
    m = _manifest(path)
    m[field] = value
    _write_manifest(path, m)
    with pytest.raises(BadInput, match=match) as e:
        load_capture(path)
    _one_line(e)


def test_invalid_json_and_bad_names(cap_dir):
    path, _, _ = cap_dir
    m = _manifest(path)
    m["files"]["state"]["name"] = "../escape.safetensors"
    _write_manifest(path, m)
    with pytest.raises(BadInput, match="not a plain file name"):
        load_capture(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON") as e:
        load_capture(path)
    _one_line(e)


def test_symlink_out_of_capture_refused(cap_dir, tmp_path):
    path, _, _ = cap_dir
    outside = tmp_path / "outside.safetensors"
    os.replace(path / "state.safetensors", outside)
    os.symlink(outside, path / "state.safetensors")
    with pytest.raises(BadInput, match="points outside the capture"):
        load_capture(path)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("as_name", ["state.pt", "state.safetensors"])
def test_malicious_pickle_refused_without_running(cap_dir, tmp_path, as_name):
    path, _, _ = cap_dir
    marker = tmp_path / "PWNED"
    payload = tmp_path / "evil.bin"
    torch.save({"w": _Evil(marker)}, payload) if as_name.endswith(".pt") else payload.write_bytes(
        pickle.dumps({"w": _Evil(marker)}))
    # sanity: the payload really runs code when unpickled without protection
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Evil(probe)))
    assert probe.exists()
    os.replace(payload, path / as_name)
    m = _manifest(path)
    from ampdoctor.capture import _sha256
    m["files"]["state"] = {"name": as_name, "bytes": os.path.getsize(path / as_name),
                           "sha256": _sha256(str(path / as_name))}
    _write_manifest(path, m)
    with pytest.raises(BadInput) as e:
        load_capture(path)
    _one_line(e)
    assert not marker.exists()


def test_pt_weights_only_accepted(cap_dir):
    path, m, _ = cap_dir
    torch.save(m.state_dict(), path / "state.pt")
    man = _manifest(path)
    from ampdoctor.capture import _sha256
    man["files"]["state"] = {"name": "state.pt", "bytes": os.path.getsize(path / "state.pt"),
                             "sha256": _sha256(str(path / "state.pt"))}
    _write_manifest(path, man)
    assert torch.equal(load_capture(path).state_dict["lin.weight"], m.lin.weight.detach())
