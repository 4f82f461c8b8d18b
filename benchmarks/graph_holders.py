"""What in a watch still holds a step's autograd graph after the loop let go of it: a fp16 + GradScaler loop
(tests/test_graph_lifetime.py's model, whose graph node holds a weakly referenced marker) runs `--steps` iterations;
after each, with the loop's `loss` deleted, it prints whether the graph is alive and every path from the watch's step
machine (its open step, headroom, budget: ampdoctor objects, lists, dicts, tuples, partials) to a tensor with a
grad_fn or to an autograd node. On CUDA with a GradScaler the step's values are read at the next iteration, so a
reference the step keeps until then keeps the graph (and its node destructors) past the loop's own.

    python benchmarks/graph_holders.py --device cuda [--steps 8]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampdoctor  # noqa: E402
import test_graph_lifetime as T  # noqa: E402


def holders(obj, path="m", seen=None, out=None, depth=0) -> list:
    """(path, what) of every tensor with a grad_fn or autograd node reachable from `obj` through ampdoctor
    objects and containers (depth-limited)."""
    seen = set() if seen is None else seen
    out = [] if out is None else out
    if id(obj) in seen or depth > 7:
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None:
            out.append((path, type(obj.grad_fn).__name__))
        return out
    name = type(obj).__name__
    if name.endswith(("Backward0", "Backward1", "Backward")) or "BackwardCFunction" in name:
        out.append((path, name))
        return out
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            holders(v, f"{path}[{k!r}]", seen, out, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(obj)):
            holders(v, f"{path}[{i}]", seen, out, depth + 1)
    elif type(obj).__module__.startswith("ampdoctor") or name == "partial":
        names = list(getattr(obj, "__dict__", {}))
        for c in type(obj).__mro__:
            names += [s for s in getattr(c, "__slots__", ()) if isinstance(s, str)]
        for n in names:
            try:
                v = getattr(obj, n)
            except Exception:  # noqa: BLE001 - a slot never set
                continue
            holders(v, f"{path}.{n}", seen, out, depth + 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    dev = a.device
    torch.manual_seed(0)
    net = T._Net().to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(dev)
    w = ampdoctor.watch(net, optimizer=opt, scaler=scaler)
    print(f"torch {torch.__version__} on {dev}; optimizer fused: {getattr(opt, '_step_supports_amp_scaling', False)}")
    for i in range(a.steps):
        alive = T.one_iteration(net, opt, scaler, dev)
        st = w.machine.st
        print(f"iteration {i}: graph alive {alive}, sampled {st.sampled}, staged early {st.early}, "
              f"held by {holders(w.machine)[:6]}")
    w.close()


if __name__ == "__main__":
    main()
