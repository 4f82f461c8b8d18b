"""Property-based fuzzing of the capture format: any mutation of the manifest or the tensor files gives either
a loaded capture or BadInput with one line — never another exception, never code execution."""
import json
import os
import shutil

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampdoctor.capture import load_capture, save_batch
from ampdoctor.errors import BadInput

_leaf = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=6)
_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=10)
_KEYS = ["format", "format_version", "model_class", "hf_config", "autocast", "scaler", "step", "training",
         "eval_modules", "structure", "rng", "files", "extra"]


def _template(tmp):
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    return save_batch(os.path.join(tmp, "base"), m, torch.randn(2, 3), scale=2.0)


def _check(path):
    try:
        load_capture(path)
    except BadInput as e:
        assert "\n" not in str(e) and str(e)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(_KEYS), value=_json)
def test_manifest_field_mutations(tmp_path_factory, key, value):
    tmp = str(tmp_path_factory.mktemp("cap"))
    base = _template(tmp)
    man = json.load(open(os.path.join(base, "manifest.json")))
    man[key] = value
    with open(os.path.join(base, "manifest.json"), "w") as f:
        json.dump(man, f)
    _check(base)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["tensors.safetensors", "state.safetensors"]), pos=st.integers(0, 10_000),
       data=st.binary(min_size=1, max_size=64), truncate=st.booleans())
def test_tensor_file_corruption(tmp_path_factory, which, pos, data, truncate):
    tmp = str(tmp_path_factory.mktemp("cap"))
    base = _template(tmp)
    fp = os.path.join(base, which)
    raw = bytearray(open(fp, "rb").read())
    if truncate:
        raw = raw[:pos % max(len(raw), 1)]
    else:
        p = pos % len(raw)
        raw[p:p + len(data)] = data
    open(fp, "wb").write(bytes(raw))
    _check(base)
