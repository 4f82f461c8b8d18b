"""Hostile captures: loading or replaying one never runs code it names, and resource bombs (huge configs, sparse
or lying tensor files, deep JSON, 5000-digit numbers) are refused with one line, quickly, before allocating."""
import json
import os
import resource
import time

import pytest
import torch
import torch.nn as nn

from ampdoctor.capture import load_capture, save_batch
from ampdoctor.cli import main
from ampdoctor.errors import BadInput
from ampdoctor.replay import replay
from probe_harness import edit_manifest

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")
class Evil:
    def __init__(self, *a, **k):
        pathlib.Path({marker!r}).write_text("called")
def factory():
    return Evil()
"""


def _cap(tmp_path, name="cap"):
    torch.manual_seed(0)
    return save_batch(tmp_path / name, nn.Linear(3, 2), torch.randn(2, 3))


def _one_line_exit_2(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip() and err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.fixture()
def evil_module(tmp_path, monkeypatch):
    """An importable module that leaves a marker file when imported or called."""
    marker = tmp_path / "MARKER"
    pkg = tmp_path / "evilpkg"
    pkg.mkdir()
    (pkg / "evilmod_ampdoctor.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.chdir(pkg)
    return marker


@pytest.mark.parametrize("hf_config", [None, {"model_type": "gpt2"}])
def test_replay_never_imports_the_capture_model_class(tmp_path, evil_module, capsys, hf_config):
    cap = _cap(tmp_path)
    edit_manifest(cap, model_class="evilmod_ampdoctor.Evil", hf_config=hf_config)
    with pytest.raises(BadInput) as e:
        replay(cap, shadow=False, whatif=False, fix_search=False)
    assert "\n" not in str(e.value) and "--model" in str(e.value)
    err = _one_line_exit_2(capsys, ["replay", cap, "--no-html"])
    assert "never imports" in err or "--model" in err
    assert not evil_module.exists(), "a capture made ampdoctor import or call code it names"


@pytest.mark.parametrize("model_class", ["os.abort", "sys.exit", "tempfile.mkdtemp", "this.s",
                                         "faulthandler._sigsegv"])
def test_stdlib_callables_named_by_a_capture_are_refused(tmp_path, capsys, model_class):
    cap = _cap(tmp_path)
    edit_manifest(cap, model_class=model_class)
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    _one_line_exit_2(capsys, ["replay", cap, "--no-html"])
    assert set(os.listdir(os.environ.get("TMPDIR", "/tmp"))) <= before | {n for n in os.listdir(
        os.environ.get("TMPDIR", "/tmp")) if n.startswith("pytest")}


def test_user_model_module_that_raises_or_has_syntax_error(tmp_path, monkeypatch, capsys):
    cap = _cap(tmp_path)
    (tmp_path / "raises_mod_ad.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "syntax_mod_ad.py").write_text("def f(:\n")
    (tmp_path / "exits_mod_ad.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    for spec, needle in (("raises_mod_ad:f", "boom at import"), ("syntax_mod_ad:f", "SyntaxError"),
                         ("exits_mod_ad:f", "SystemExit")):
        err = _one_line_exit_2(capsys, ["replay", cap, "--model", spec, "--no-html"])
        assert needle in err, err


# ------------------------------------------------------------------------------------ Hugging Face configs
@pytest.fixture(scope="module")
def gpt2_capture(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16)
    m = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (2, 8))
    return save_batch(tmp_path_factory.mktemp("hf") / "cap", m, ids, labels=ids)


def _copy(src, tmp_path):
    import shutil
    dst = tmp_path / "c"
    shutil.copytree(src, dst)
    return str(dst)


def test_hf_config_is_rebuilt_through_transformers_registry(gpt2_capture):
    rep = replay(gpt2_capture, shadow=False, whatif=False, fix_search=False)
    assert isinstance(rep.to_dict(), dict)


@pytest.mark.parametrize("change,needle", [
    ({"n_layer": 10 ** 9}, "n_layer"),
    ({"n_layer": 4000, "n_embd": 4096}, "parameters"),
    ({"n_layer": "abc"}, "n_layer"),
    ({"model_type": "no_such_model_xyz"}, "does not know"),
    ({"vocab_size": 2 ** 70}, "vocab_size"),
    ({"n_embd": 16}, "weights"),            # plausible sizes, but more weights than the capture holds
])
def test_hf_config_bombs_refused_quickly(gpt2_capture, tmp_path, capsys, change, needle):
    cap = _copy(gpt2_capture, tmp_path)
    m = json.load(open(os.path.join(cap, "manifest.json")))
    m["hf_config"].update(change)
    edit_manifest(cap, hf_config=m["hf_config"])
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    err = _one_line_exit_2(capsys, ["replay", cap, "--no-html"])
    assert needle in err, err
    assert time.perf_counter() - t < 60
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 512 * 1024  # KiB: no big allocation


def test_hf_model_class_must_be_a_transformers_registry_class(gpt2_capture, tmp_path, capsys):
    cap = _copy(gpt2_capture, tmp_path)
    for cls in ("os.system", "transformers.pipelines.pipeline", "transformers.trainer.Trainer"):
        edit_manifest(cap, model_class=cls)
        _one_line_exit_2(capsys, ["replay", cap, "--no-html"])


# ------------------------------------------------------------------------------------ files and JSON
def test_sparse_huge_state_file_refused_without_reading(tmp_path, capsys):
    cap = _cap(tmp_path)
    fp = os.path.join(cap, "state.safetensors")
    n = 4 << 30
    header = json.dumps({"w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(fp, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + n)           # a hole: 4 GiB that take no disk
    man = json.load(open(os.path.join(cap, "manifest.json")))
    man["files"]["state"].update(bytes=os.path.getsize(fp), sha256=None)
    edit_manifest(cap, files=man["files"])
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    err = _one_line_exit_2(capsys, ["replay", cap, "--no-html"])
    assert "sparse" in err or "memory" in err, err
    assert time.perf_counter() - t < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 256 * 1024


def test_header_that_does_not_add_up_is_refused(tmp_path):
    cap = _cap(tmp_path)
    fp = os.path.join(cap, "state.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    open(fp, "wb").write(len(header).to_bytes(8, "little") + header + b"\0" * 40)
    man = json.load(open(os.path.join(cap, "manifest.json")))
    man["files"]["state"].update(bytes=os.path.getsize(fp), sha256=None)
    edit_manifest(cap, files=man["files"])
    with pytest.raises(BadInput, match="header describes 4000 bytes"):
        load_capture(cap)


def _nest(depth):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("old,new", [
    ('"extra": {}', '"extra": ' + "[" * 100_000 + "]" * 100_000),        # past the C parser's recursion limit
    ('"extra": {}', '"extra": ' + "[" * 900 + "]" * 900),                # parses, too deep to walk recursively
    ('"args": {"__tuple__": [', '"args": {"__tuple__": [' + '{"__tuple__": [' * 900 + "1" + "]}" * 900 + ", "),
    ('"step": null', '"step": ' + "9" * 5000),                          # past int()'s digit limit
])
def test_deep_json_and_huge_numbers_are_one_line(tmp_path, capsys, old, new):
    cap = _cap(tmp_path)
    mp = os.path.join(cap, "manifest.json")
    text = json.dumps(json.load(open(mp)))
    assert old in text
    open(mp, "w").write(text.replace(old, new, 1))
    with pytest.raises(BadInput) as e:
        load_capture(cap)
    assert "\n" not in str(e.value)
    _one_line_exit_2(capsys, ["replay", cap, "--no-html"])


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_manifest_fifo_or_dir_never_blocks(tmp_path, capsys, kind):
    cap = _cap(tmp_path)
    mp = os.path.join(cap, "manifest.json")
    os.unlink(mp)
    os.mkfifo(mp) if kind == "fifo" else os.mkdir(mp)
    _one_line_exit_2(capsys, ["replay", cap, "--no-html"])
