"""Autograd-side helpers of the module hooks: whether a backward is running (activation checkpointing re-runs
forwards inside it), and where the gradient towards a module's inputs leaves that module.

A module's "gradient out" (towards its inputs) is read by post-hooks on the autograd nodes its forward created
that hand a gradient straight to one of its inputs: nothing is inserted into the graph, so autograd sums a
tensor used several times in the order it does without a watch (a hooked view per input reordered those sums
and changed T5's gradients in their last bits).
"""
from __future__ import annotations

import torch

__all__ = ["in_backward", "sequence_nr", "gradient_exits", "ExitHook"]

_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (checkpointing's recomputation)."""
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1


sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)  # the next node's number (or None)
_NO_SEQ = (1 << 64) - 1  # AccumulateGrad nodes (leaves) carry the largest sequence number


def gradient_exits(outputs: list, inputs: list, seq0: int) -> list[tuple[object, list[int]]]:
    """The autograd nodes a module's forward created that hand a gradient straight to one of its inputs, each
    with the positions of those inputs among the node's next functions.

    The gradient flowing out of *this* module towards an input (not the sum over all the input's consumers)
    is the node's output at those positions, read by a post-hook on the node. Nothing is added to the graph,
    so autograd sums an input used several times in exactly the order it does without a watch (a hooked view
    per input would reorder those sums and change the gradients' last bits). Only nodes created during the
    module's forward (sequence number >= seq0) are walked."""
    targets = {(id(t.grad_fn), t.output_nr) for t in inputs if t.grad_fn is not None}
    leaves = {id(t) for t in inputs if t.grad_fn is None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: dict[int, object] = {}
    exits = []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        sq = node._sequence_nr()
        if sq < seq0 or sq == _NO_SEQ:
            continue  # made before this module ran (an input's own node), or a leaf's accumulator
        hit = []
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if (id(nxt), nr) in targets or (leaves and type(nxt).__name__ == "AccumulateGrad"
                                             and id(nxt.variable) in leaves):
                hit.append(i)
            elif id(nxt) not in seen:
                stack.append(nxt)
        if hit:
            exits.append((node, hit))
    return exits


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
