"""Autograd-side helpers of the module hooks: whether a backward is running (activation checkpointing re-runs
forwards inside it), where the gradient towards a module's inputs leaves that module, and which ops a loss
computed outside the model is made of (loss_ops, read on a step whose loss went non-finite).

A module's "gradient out" (towards its inputs) is read by post-hooks on the autograd nodes its forward created
that hand a gradient straight to one of its inputs: nothing is inserted into the graph, so autograd sums a
tensor used several times in the order it does without a watch (a hooked view per input reordered those sums
and changed T5's gradients in their last bits).
"""
from __future__ import annotations

import torch

__all__ = ["in_backward", "sequence_nr", "probe_sequence_nr", "input_nodes", "gradient_exits", "EntryHook", "ExitHook",
           "Regions", "loss_ops"]

_LOW = (torch.float16, torch.bfloat16)

_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (checkpointing's recomputation)."""
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1


_native_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)
_probe: list = []


def probe_sequence_nr() -> int:
    """The number autograd gives the next node on this thread, for a torch without `_get_sequence_nr` (without
    it no module's gradient towards its inputs could be read): a view of a persistent 0-d leaf makes one node,
    which takes the current number. The counter only moves on, so every later node keeps its order (autograd's
    ready queue orders by it); nothing is added to the user's graph. Call with grad enabled."""
    if not _probe:
        _probe.append(torch.zeros((), requires_grad=True))
    leaf = _probe[0]
    return leaf.view_as(leaf).grad_fn._sequence_nr() + 1


sequence_nr = _native_sequence_nr or probe_sequence_nr  # the next node's number
_NO_SEQ = (1 << 64) - 1  # AccumulateGrad nodes (leaves) carry the largest sequence number


class Region:
    """The autograd nodes one finished module call's walk covered, and its exits (node, position, input key).
    An enclosing call's walk passes a finished region in one move: its exits that reach the enclosing call's
    inputs are the enclosing call's too, and the walk goes on from the region's own inputs."""
    __slots__ = ("nodes", "edges", "inputs", "outer", "done", "seq0")

    def __init__(self, seq0: int = 0):
        self.seq0 = seq0         # the call began here: only an enclosing call's walk (seq0 <= this) passes it
        self.nodes: list = []    # kept alive for the step, so that their ids stay theirs
        self.edges: list = []
        self.inputs: list = []   # the grad_fns of the call's inputs
        self.outer: Region | None = None
        self.done = False


class Regions:
    """Per step: which finished region each walked node belongs to (the outermost one, through `outer`)."""
    __slots__ = ("owner",)

    def __init__(self):
        self.owner: dict[int, Region] = {}

    def top(self, node) -> Region | None:
        r = self.owner.get(id(node))
        while r is not None and r.outer is not None and r.outer.done:
            r = r.outer
        return r


def input_nodes(inputs: list) -> list:
    """(tensor, grad_fn, output_nr) of each input, taken when a module's forward begins (see gradient_exits)."""
    return [(t, t.grad_fn, t.output_nr) for t in inputs]


def gradient_exits(outputs: list, inputs: list, seq0: int, regions: Regions | None = None) -> list:
    """The autograd nodes a module's forward created that hand a gradient straight to one of its inputs, each
    with the positions of those inputs among the node's next functions.

    The gradient flowing out of *this* module towards an input (not the sum over all the input's consumers)
    is the node's output at those positions, read by a post-hook on the node. Nothing is added to the graph,
    so autograd sums an input used several times in exactly the order it does without a watch (a hooked view
    per input would reorder those sums and change the gradients' last bits). Only nodes created during the
    module's forward (sequence number >= seq0) are walked; with `regions`, a submodule call walked before is
    passed in one move, so nested modules cost one walk of the graph, not one per level."""
    # `inputs`: tensors, or (tensor, grad_fn, output_nr) as they were when the forward began (input_nodes): a
    # module that works in place (ReLU(inplace=True), `x += y`) has rewritten its input's grad_fn to its own node
    # by the time it returns, and matching that found no exit (nor did any enclosing module's walk pass it).
    # The nodes are held for the walk (and by the region after it): on torch 2.11 (the H200's) a node's Python
    # object lives only while something references it, so `t.grad_fn` and the node's `next_functions` entry were
    # different objects with different ids, and no input was ever matched
    inputs = [x if isinstance(x, tuple) else (x, x.grad_fn, x.output_nr) for x in inputs]
    in_fns = [fn for _, fn, _ in inputs]
    targets = {(id(fn), nr) if fn is not None else ("leaf", id(t)) for t, fn, nr in inputs}
    region = Region(seq0)
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: dict[int, object] = {}
    passed: set[int] = set()
    hits: dict[int, tuple[object, list[int]]] = {}
    mine: list = []

    def hit(node, i, key):
        region.edges.append((node, i, key))
        h = hits.get(id(node))
        if h is None:
            hits[id(node)] = (node, [i])
        elif i not in h[1]:
            h[1].append(i)

    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        inner = regions.top(node) if regions is not None else None
        if inner is not None and inner.done and inner.seq0 >= seq0:
            if id(inner) not in passed:  # a finished submodule call: its exits and its inputs, once
                passed.add(id(inner))
                inner.outer = region
                for n, i, key in inner.edges:
                    if key in targets:
                        hit(n, i, key)
                for n in inner.inputs:
                    if id(n) not in seen:
                        stack.append(n)
            continue
        sq = node._sequence_nr()
        if sq < seq0 or sq == _NO_SEQ:
            continue  # made before this module ran (an input's own node), or a leaf's accumulator
        mine.append(node)
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            key = (id(nxt), nr)
            if key not in targets and type(nxt).__name__ == "AccumulateGrad":
                key = ("leaf", id(nxt.variable))
            if key in targets:
                hit(node, i, key)
            elif id(nxt) not in seen:
                stack.append(nxt)
    if regions is not None:
        region.nodes = list(seen.values())
        region.inputs = [fn for fn in in_fns if fn is not None]
        for n in mine:  # only nodes this call's forward made: not the inputs' nodes the walk stopped at
            regions.owner.setdefault(id(n), region)
        region.done = True
    return list(hits.values())


class EntryHook:
    """Node pre-hook: hand the gradient flowing into the node's `nr`-th output (a module's output) to `hook`, as a
    tensor hook on that output would, at a quarter of `Tensor.register_hook`'s cost (no handle, no per-tensor
    dict); it sees the gradient the node consumes, after any tensor hook of the user's. (Measured on sampled steps;
    kept for a capture from the root's small outputs, hooks.keep_grad.)"""
    __slots__ = ("nr", "hook")

    def __init__(self, nr: int, hook):
        self.nr, self.hook = nr, hook

    def __call__(self, grad_outputs):
        if self.nr < len(grad_outputs):
            g = grad_outputs[self.nr]
            if g is not None:
                self.hook(g)
        return None


class ExitHook:
    """Node post-hook: measure the gradients a node hands to the module's inputs (see gradient_exits)."""
    __slots__ = ("idx", "hook")

    def __init__(self, idx: list[int], hook):
        self.idx, self.hook = idx, hook

    def __call__(self, grad_inputs, grad_outputs):
        for i in self.idx:
            if i < len(grad_inputs) and grad_inputs[i] is not None:
                self.hook(grad_inputs[i])
        return None


def loss_ops(node, first_seq: int | None, limit: int = 256) -> tuple[list | None, bool | None, bool | None]:
    """The names (trailing number dropped) of the autograd nodes from the loss's node down to where the model's
    forward ended (nodes numbered below `first_seq`, autograd's next number when the root's forward returned;
    nothing of the graph is held for this) and not into the leaves: the loss computation outside the model; whether
    one of them made an fp16/bf16 value (None when autograd does not say); and whether one of its arithmetic ops
    (`_TAKES_CONST`) took a tensor that needs no gradient (an advantage, a target, a weight computed from the data:
    a value the graph does not see being made). (None, None, None) without a node or a number, or past `limit`
    nodes."""
    if node is None or first_seq is None:
        return None, None, None
    seen, names, todo = {}, set(), [node]  # the visited nodes are held: their ids stay theirs (torch 2.11)
    low: bool | None = False
    consts = False
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen[id(n)] = n
        if len(seen) > limit:
            return None, None, None
        name = type(n).__name__
        if name == "AccumulateGrad" or n._sequence_nr() < first_seq:
            continue  # a leaf, or a node the model's forward (or anything before it) made
        names.add(name.rstrip("0123456789"))
        if not consts and name in _TAKES_CONST and any(nx is None for nx, _ in n.next_functions):
            consts = True
        if low is False:
            try:  # the dtypes of what the op made (its gradient's inputs)
                low = any(getattr(md, "dtype", None) in _LOW for md in n._input_metadata)
            except (AttributeError, RuntimeError):
                low = None
        todo.extend(nx for nx, _ in n.next_functions if nx is not None)
    return sorted(names), low, consts


# the binary arithmetic nodes whose second tensor operand, when it needs no gradient, shows as a None next function
# (a Python number gives the one-input variant, MulBackward1 ...: no operand to speak of)
_TAKES_CONST = frozenset({"MulBackward0", "DivBackward0", "AddBackward0", "SubBackward0", "RsubBackward0",
                          "WhereBackward0", "MaximumBackward0", "MinimumBackward0", "PowBackward1"})
