"""Sparse tensors in captures (ampdoctor/capturestruct.py encode_sparse/decode_sparse, capture.py sparse_state): a
GCN's normalised adjacency as a sparse COO or CSR argument, or kept as a sparse buffer of the model, is written as
its parts and read back equal, with torch's invariant checks; a malformed one is refused in one line; a layout a
capture cannot hold is refused by save_batch naming where it was, and nothing is left behind.
(test_hostile_inputs6 1-2 run the watch's capture and the replay of such a model end to end.)"""
import json
import os

import pytest
import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.capture import load_capture
from ampdoctor.errors import BadInput

torch.set_num_threads(1)


def ring(n=6, layout="coo"):
    """The symmetric-normalised adjacency of a ring with self loops, sparse."""
    i = torch.arange(n)
    rows = torch.cat([i, i, i])
    cols = torch.cat([i, (i + 1) % n, (i - 1) % n])
    a = torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.full((3 * n,), 1 / 3), (n, n)).coalesce()
    return a.to_sparse_csr() if layout == "csr" else a


class GCN(nn.Module):
    def __init__(self, adj=None):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        if adj is not None:
            self.register_buffer("adj", adj)

    def forward(self, x, adj=None):
        adj = self.adj if adj is None else adj
        return torch.sparse.mm(adj, self.lin(x)) if adj.layout == torch.sparse_coo else adj @ self.lin(x)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_argument_comes_back_equal(tmp_path, layout):
    torch.manual_seed(0)
    m, adj, x = GCN(), ring(layout=layout), torch.randn(6, 8)
    path = ampdoctor.save_batch(str(tmp_path / "cap"), m, x, adj)
    cap = load_capture(path)
    back = cap.args[1]
    assert back.layout == adj.layout and back.shape == adj.shape
    assert torch.equal(back.to_dense(), adj.to_dense())
    assert torch.equal(cap.args[0], x)
    # (the loaded x, memory-mapped, may take another kernel path than x itself: compare like with like)
    assert torch.equal(m(*cap.args), m(cap.args[0], adj))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_buffer_comes_back_in_the_state(tmp_path, layout):
    torch.manual_seed(0)
    adj = ring(layout=layout)
    m, x = GCN(adj), torch.randn(6, 8)
    path = ampdoctor.save_batch(str(tmp_path / "cap"), m, x)
    cap = load_capture(path)
    assert torch.equal(cap.state_dict["adj"].to_dense(), adj.to_dense())
    fresh = GCN(ring(layout=layout) * 0)
    fresh.load_state_dict(cap.state_dict)
    assert torch.equal(fresh(x), m(x))


def test_a_malformed_sparse_tensor_is_refused_in_one_line(tmp_path):
    """Indices out of the declared size: torch's invariant check refuses it; BadInput, one line."""
    path = ampdoctor.save_batch(str(tmp_path / "cap"), GCN(), torch.randn(6, 8), ring())
    mp = os.path.join(path, "manifest.json")
    man = json.load(open(mp))
    man["structure"]["args"]["__tuple__"][1]["__sparse__"]["size"] = [2, 2]
    open(mp, "w").write(json.dumps(man))
    with pytest.raises(BadInput) as e:
        load_capture(path)
    assert "\n" not in str(e.value) and "sparse" in str(e.value)


def test_a_layout_a_capture_cannot_hold_is_refused_and_leaves_nothing(tmp_path):
    """A blocked-sparse (BSR) argument: save_batch names the argument and writes no directory."""
    bsr = torch.eye(4).to_sparse_bsr((2, 2))
    path = tmp_path / "cap"
    with pytest.raises(BadInput) as e:
        ampdoctor.save_batch(str(path), GCN(), torch.randn(4, 8), bsr)
    assert "args[1]" in str(e.value) and "layout" in str(e.value)
    assert not path.exists()
