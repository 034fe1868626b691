"""Cut an FX graph at attention breaks and at the narrowing point.

``split_graph`` is a pure function: it returns the split module and a typed plan, and is tested on
the CPU without running a model. Every break node (a configured split op, optionally SDPA) and the
``tscompile::narrow_rows`` node become pieces of their own, run eagerly; everything between two
breaks is one piece for the piece compiler.

Two bookkeeping rules keep the cut legal:
- a node that only reads a tuple output of a break (``getitem``) stays with the break;
- a ``torch.Size`` value never crosses a cut: a ``.size()`` node used by a later piece is
  re-created inside that piece (a SymInt may cross, a Size may not).
Partitions are assigned in graph order, so a node's inputs always come from the same or an earlier
piece and the cut cannot create a cycle.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

NARROW_OP = "tscompile::narrow_rows"
SDPA_TARGETS = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def op_name(target) -> str | None:
    """``"ns::name"`` of an op target (OpOverload or OpOverloadPacket), else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


@dataclass(frozen=True)
class Piece:
    name: str  # attribute of the split module ("submod_3")
    kind: str  # "compiled" | "break" | "narrow"
    stage: str  # "encoder" (token-shaped rows) or "decoder" (rows after the narrowing)
    ops: tuple[str, ...]  # the break ops inside a break piece; empty for compiled pieces


@dataclass(frozen=True)
class SplitPlan:
    pieces: tuple[Piece, ...]

    @property
    def num_breaks(self) -> int:
        return sum(p.kind == "break" for p in self.pieces)

    def of_kind(self, kind: str) -> list[Piece]:
        return [p for p in self.pieces if p.kind == kind]

    def describe(self) -> str:
        return "\n".join(f"{p.name}: {p.kind:8s} {p.stage:7s} {', '.join(p.ops)}" for p in self.pieces)


def _is_break(node: torch.fx.Node, split_ops: tuple[str, ...], split_sdpa: bool) -> bool:
    if node.op != "call_function":
        return False
    if split_sdpa and node.target in SDPA_TARGETS:
        return True
    return op_name(node.target) in split_ops


def _is_narrow(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) == NARROW_OP


def _break_label(node: torch.fx.Node) -> str:
    return op_name(node.target) or getattr(node.target, "__name__", str(node.target))


def _produces_size(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target == "size" and len(node.args) == 1 and not node.kwargs:
        return True
    return isinstance(node.meta.get("example_value"), torch.Size)


def _is_size_bookkeeping(node: torch.fx.Node) -> bool:
    """A node that binds or derives a size. SymBools are left out on purpose: they feed runtime
    asserts, which stay in graph order with them (Inductor takes no SymBool graph input)."""
    val = node.meta.get("example_value")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.Size)) or _produces_size(node)


def has_breaks(gm: torch.fx.GraphModule, split_ops: tuple[str, ...], split_sdpa: bool, split_narrowing: bool) -> bool:
    return any(_is_break(n, split_ops, split_sdpa) or (split_narrowing and _is_narrow(n)) for n in gm.graph.nodes)


def split_graph(gm: torch.fx.GraphModule, *, split_ops: tuple[str, ...] = ("tscompile::attention",),
                split_sdpa: bool = False, split_narrowing: bool = True) -> tuple[torch.fx.GraphModule, SplitPlan]:
    """Return ``(split_module, plan)``; ``gm`` itself is left as it was."""
    gm = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())  # the caller's graph stays untouched
    part: dict[torch.fx.Node, int] = {}
    kinds: dict[int, tuple[str, str, list[str]]] = {}
    current, stage = 0, "encoder"
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in part \
                and kinds[part[node.args[0]]][0] != "compiled" and isinstance(node.args[1], int):
            # a tuple output stays with its break (an int index: indexing the break's tensor output by
            # another piece's tensor would tie the two pieces in a cycle)
            part[node] = part[node.args[0]]
            continue
        narrow = split_narrowing and _is_narrow(node)
        if narrow or _is_break(node, split_ops, split_sdpa):
            current += 1
            kind = "narrow" if narrow else "break"
            kinds[current] = (kind, stage, [_break_label(node)])
            part[node] = current
            if narrow:
                stage = "decoder"
            current += 1
            continue
        kinds.setdefault(current, ("compiled", stage, []))
        part[node] = current
        if _is_size_bookkeeping(node):
            # stay with the producer: a symbol's binding node must live in the piece that makes
            # the tensor, or a later piece would bind a size an earlier piece already needs
            producers = [part[a] for a in node.all_input_nodes if a in part]
            if producers:
                part[node] = max(producers)

    _keep_sizes_local(gm.graph, part)
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    pieces = []
    for name, _ in split.named_children():
        idx = int(name.removeprefix("submod_"))
        kind, stg, ops = kinds[idx]
        pieces.append(Piece(name, kind, stg, tuple(ops)))
    return split, SplitPlan(tuple(pieces))


def _keep_sizes_local(graph: torch.fx.Graph, part: dict[torch.fx.Node, int]) -> None:
    """Re-create a Size-producing node in every later piece that uses it (Sizes do not cross)."""
    for node in list(graph.nodes):
        if node not in part or not _produces_size(node):
            continue
        for user in list(node.users):
            if user not in part or part[user] == part[node]:
                continue
            with graph.inserting_before(user):
                copy = graph.node_copy(node)
            part[copy] = part[user]
            user.replace_input_with(node, copy)
