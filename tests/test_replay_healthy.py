"""Replaying healthy batches gives no warning or error (fp32 shadow included): in-place ops after a module
must not corrupt what the shadow comparison recorded."""
import torch

import ampdoctor
from scenarios import ConvNet, TinyGPT, gpt_batch


def _replay(tmp_path, name, model, *args, loss_fn):
    with torch.autocast("cpu", dtype=torch.float16):
        cap = ampdoctor.save_batch(tmp_path / name, model, *args)
    return ampdoctor.replay(cap, model=model, loss_fn=loss_fn)


def test_convnet_with_batchnorm_and_inplace_relu(tmp_path):
    torch.manual_seed(0)
    rep = _replay(tmp_path, "cnn", ConvNet(), torch.randn(8, 3, 16, 16), loss_fn=lambda o, *a: o.float().pow(2).mean())
    assert not [f.one_line() for f in rep.findings if f.severity != "info"]
    assert max(r["rel_err"] for r in rep.data["replay"]["shadow"]) < 0.05


def test_tiny_gpt(tmp_path):
    torch.manual_seed(0)
    idx, tgt = gpt_batch()(0)
    rep = _replay(tmp_path, "gpt", TinyGPT(), idx, tgt, loss_fn=lambda o, *a: o["loss"])
    assert not [f.one_line() for f in rep.findings if f.severity != "info"]


def test_deep_bf16_stack_error_is_not_blamed_on_the_root(tmp_path):
    """Many small bf16 layers add up to a few % at the output: each layer adds a little, none loses precision on
    its own, so the parents (the root above all) that only carry their submodules' error are not named."""
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Identity()]
    m = torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cap = ampdoctor.save_batch(tmp_path / "deep", m, torch.randn(32, 64))
    rep = ampdoctor.replay(cap, model=m, whatif=False, loss_fn=lambda o, *a: o.float().mean())
    assert max(r["rel_err"] for r in rep.data["replay"]["shadow"]) > 1e-2     # the error is there ...
    assert not [f.one_line() for f in rep.findings if f.severity != "info"]  # ... and made by no one module
