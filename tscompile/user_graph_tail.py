"""A torch.compile user's whole graph with its last piece run after the graph instead of inside it
(``KernelPolicy.user_graph_eager_tail``).

A replayed graph writes its outputs to the same memory at every call, so ``user_graphs`` hands the
caller copies of them. A decoder's forward outputs its logits: at 2048 tokens of a 128k-word
vocabulary that is 525 MB in bf16, and the copy (a read and a write of it, about 0.3 ms on an H100)
costs as much as the graph saves at that length, where the device work already hides the launches.
So where the outputs the forward's last piece makes at a bucket exceed ``EAGER_TAIL_MIN_BYTES``,
the bucket's graph is captured without that piece (a decoder's, split at SDPA: everything after its
last attention, i.e. the last layer's output projection and MLP, the final norm and the vocabulary
projection), and the piece runs after the replay, at the live rows, into memory of its own: nothing
to copy, and it launches while the device still runs the replay. Its token-shaped arguments are
copied to dense tensors at the live rows first (activations, small beside the logits): a compiled
piece asserts the strides of such a tensor, which a view cut from the bucket's rows does not have.
Smaller outputs are cheaper to copy than a piece is to launch from the host.

The split module's top-level graph calls its pieces in order; the last piece is taken off only
where nothing but its outputs follows it, so the forward's outputs are the piece's outputs plus
values made before it (which stay in graph memory and are copied as before).
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from tscompile.token_padding import TokenShapes, dense_in_layout

# a copy of 64 MiB is about 40 us of an H100's or H200's device time (read and write); below that the
# copy costs less than the host launching the tail piece on its own
EAGER_TAIL_MIN_BYTES = 64 << 20


class GraphTail:
    """``head``: the forward up to its last piece, returning ``(the piece's arguments, the other
    outputs)``; ``finish(head_out, live)``: the piece at ``live`` rows, then the forward's outputs."""

    def __init__(self, head: Callable, tail: Callable, tail_shapes: TokenShapes, assemble: Callable,
                 tail_output_fakes: list, tail_output_shapes: TokenShapes):
        self.head, self.tail, self.tail_shapes, self._assemble = head, tail, tail_shapes, assemble
        self._output_fakes, self._output_shapes = tail_output_fakes, tail_output_shapes

    def pays_at(self, rows: int) -> bool:
        """Whether the forward's outputs made by the tail are, at ``rows`` tokens, large enough to
        leave the tail out of the graph (the other outputs are copied either way)."""
        total = 0
        for fake, dims in zip(self._output_fakes, self._output_shapes.where):
            if isinstance(fake, torch.Tensor):
                sizes = [rows if d in (dims or ()) else int(s) for d, s in enumerate(fake.shape)]
                total += math.prod(sizes) * fake.element_size()
        return total >= EAGER_TAIL_MIN_BYTES

    def finish(self, head_out, live: int) -> tuple[object, set[int]]:
        """The forward's outputs from the head's, and the ids of the output tensors in memory of the
        tail's own (not a view of one of its arguments or of the head's outputs, which live in graph
        memory); the outputs hold those tensors, so no id is reused while the caller reads them."""
        tail_args, others = head_out
        args = self.tail_shapes.resize(list(tail_args), live, pad=False)
        args = [dense_in_layout(a) if isinstance(a, torch.Tensor) and a is not given else a
                for a, given in zip(args, tail_args)]
        made = self.tail(*args)
        graph_memory = {a.untyped_storage().data_ptr() for a in (*tail_args, *pytree.tree_leaves(others), *args)
                        if isinstance(a, torch.Tensor)}
        out = self._assemble(made, others)
        fresh = {id(t) for t in pytree.tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in graph_memory}
        return out, fresh


def split_off_tail(split: torch.fx.GraphModule, piece_fns: dict[str, Callable], fake_args: dict, output_fakes: list,
                   sym) -> GraphTail | None:
    """The split module's forward as a head and its last piece, or None where that piece is not in
    ``piece_fns`` (name: the function that runs it unpadded) or anything but its outputs follows its
    call. ``fake_args``: each piece's traced arguments; ``output_fakes``: the forward's traced output
    leaves."""
    nodes = list(split.graph.nodes)
    calls = [i for i, n in enumerate(nodes) if n.op == "call_module"]
    if not calls or nodes[-1].op != "output":
        return None
    at = calls[-1]
    tail = nodes[at]
    picks = nodes[at + 1:-1]
    if tail.target not in piece_fns or tail.kwargs or any(n.op != "call_function" or n.target is not operator.getitem or n.args[0] is not tail
                          or not isinstance(n.args[1], int) for n in picks):
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes[:at]:
        env[node] = graph.node_copy(node, lambda n: env[n])
    from_tail = {tail, *picks}
    others = [n for n in _output_nodes(nodes[-1]) if n not in from_tail]
    graph.output((torch.fx.map_arg(tail.args, lambda n: env[n]), tuple(env[n] for n in others)))
    head = torch.fx.GraphModule(split, graph)
    index = {n: i for i, n in enumerate(others)}
    structure = nodes[-1].args[0]

    def assemble(made, other_values):
        def value(n: torch.fx.Node):
            if n is tail:
                return made
            if n in from_tail:
                return made[n.args[1]]
            return other_values[index[n]]
        return torch.fx.node.map_aggregate(structure, lambda a: value(a) if isinstance(a, torch.fx.Node) else a)

    # the output leaves the tail makes (every leaf where the traced leaves do not line up with the graph's)
    leaves: list[torch.fx.Node] = []
    torch.fx.map_arg(structure, leaves.append)
    made_fakes = ([f for f, n in zip(output_fakes, leaves) if n in from_tail] if len(leaves) == len(output_fakes)
                  else output_fakes)
    return GraphTail(head, piece_fns[tail.target], TokenShapes(list(fake_args[tail.target]), sym), assemble,
                     made_fakes, TokenShapes(made_fakes, sym))


def _output_nodes(output: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.map_arg(output.args[0], lambda n: found.append(n) if n not in found else None)
    return found
