"""The token dimension of a ``torch.compile`` user's split graph, for ``user_graphs.py``'s padding.

Which dimension is "the token dimension": the symbol of the attention query's row count (SDPA's
dim -2, ``tscompile::attention``'s dim 0). Padding is only sound for pieces that are row-wise in it,
so every compiled piece is checked at compile time: a piece that slices, reduces or reshapes the
token dimension (``hidden[:, -1:]`` in transformers' ``logits_to_keep``) runs live and ungraphed,
like a break. A graph with any other dynamic size (a growing KV length while decoding) is left
entirely ungraphed: a capture per size would never be replayed.

``TokenShapes`` records where the token count sits among a callable's arguments and resizes them to a
bucket (zero-padded) or back to the live rows (sliced views).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.utils._pytree as pytree

from tscompile.passes.split import SDPA_TARGETS, SplitPlan, op_name


class Unsupported(Exception):
    """The graph cannot be padded; it runs without user graphs (the reason is logged)."""


def symbols_of(value) -> set:
    """The free symbols of every size in ``value`` (a tensor, a SymInt, or a tuple or list of them)."""
    if isinstance(value, torch.Tensor):
        out = set()
        for d in value.shape:
            if isinstance(d, torch.SymInt):
                out |= d.node.expr.free_symbols
        return out
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, (tuple, list)):
        return set().union(*(symbols_of(v) for v in value)) if value else set()
    return set()


def is_token_count(d, sym) -> bool:
    return isinstance(d, torch.SymInt) and d.node.expr == sym


def token_dims(value, sym) -> tuple[int, ...]:
    """The dims of a fake tensor whose size is exactly the token symbol; a dim that is any other
    expression of it (``s * 64`` after a flatten, ``s - 1``) cannot be padded: Unsupported."""
    dims = []
    for i, d in enumerate(value.shape):
        if is_token_count(d, sym):
            dims.append(i)
        elif isinstance(d, torch.SymInt) and sym in d.node.expr.free_symbols:
            raise Unsupported(f"a tensor dim of size {d.node.expr} (not the token count {sym} itself)")
    return tuple(dims)


def example_value(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def find_token_symbol(split: torch.fx.GraphModule, plan: SplitPlan):
    """The symbol of the first attention break's query rows, or None (static rows: nothing to pad)."""
    for piece in plan.of_kind("break"):
        for node in split._modules[piece.name].graph.nodes:
            if node.op != "call_function" or not node.args:
                continue
            if node.target in SDPA_TARGETS:
                dim = -2
            elif op_name(node.target) == "tscompile::attention" or getattr(node.target, "__name__", "") == "run_attention":
                dim = 0
            else:
                continue
            query = example_value(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
            if not isinstance(query, torch.Tensor):
                raise Unsupported(f"no traced shape for the query of {node.name}")
            rows = query.shape[dim]
            if not isinstance(rows, torch.SymInt) or not rows.node.expr.is_Symbol:
                return None
            return rows.node.expr
    return None


def check_row_wise(gm: torch.fx.GraphModule, sym) -> str | None:
    """Why padding ``gm``'s token dim could change its live rows, or None when it cannot.

    A node whose inputs carry the token dim must keep it in its output (a reduction, an index or a
    slice of the token dim would read padded rows into a live value)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        out = example_value(node)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs:
            continue
        try:
            for o in outs:
                token_dims(o, sym)
        except Unsupported as e:
            return f"{node.format_node()}: {e}"
        fed = any(sym in symbols_of(example_value(a)) for a in node.all_input_nodes
                  if isinstance(example_value(a), torch.Tensor))
        if not fed or node.target in _READS_NO_ROWS:
            continue
        if node.target is operator.getitem:
            why = _getitem_hazard(node, sym)
            if why:
                return f"{node.format_node()} {why}"
            continue
        if not any(token_dims(o, sym) for o in outs):
            return f"{node.format_node()} drops the token dim"
    return None


# ops whose output takes only a dtype or device from a token-shaped input, never its rows
_READS_NO_ROWS = {"new_ones", "new_zeros", "new_empty", "new_full", "type_as"}


def _from_the_front(idx) -> bool:
    """An index of the token dim that reads the same rows whether or not rows are padded at the
    end: a non-negative int, or a slice from row 0 with a non-negative static stop (the trace's
    guards already hold the live count at or above it)."""
    if isinstance(idx, int):
        return idx >= 0
    if isinstance(idx, slice):
        return idx.start in (None, 0) and idx.step in (None, 1) and (idx.stop is None
                                                                       or (isinstance(idx.stop, int) and idx.stop >= 0))
    return False


def _getitem_hazard(node: torch.fx.Node, sym) -> str | None:
    src = example_value(node.args[0])
    if not isinstance(src, torch.Tensor):
        return None
    dims = token_dims(src, sym)
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    per_dim = [i for i in index if i is not None]  # None adds an output dim and reads no input dim
    if sum(i is Ellipsis for i in per_dim) > 1:
        return "indexes with two Ellipses"
    if Ellipsis in per_dim:
        k = per_dim.index(Ellipsis)
        per_dim[k:k + 1] = [slice(None)] * (src.dim() - len(per_dim) + 1)
    for d in dims:
        if d < len(per_dim) and not (_from_the_front(per_dim[d]) or _is_row_identity(per_dim[d], sym)):
            return "reads rows counted from the end (or by a tensor) of the token dim"
    return None


# index-shaping steps that keep an index tensor's values: added size-1 dims, + 0
_ADDS_DIMS = {torch.unsqueeze, "unsqueeze"}
_ADDS = {operator.add, torch.add, "add"}


def _is_row_identity(index, sym) -> bool:
    """Whether an index tensor holds 0, 1, ..., n-1 along the token dim (``arange(n)``, with size-1
    dims added or + 0): indexing with it reads row i into row i, as transformers' mask builders do
    with position ids, so padding at the end leaves the live rows' reads alone."""
    node = index
    while isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method"):
        target, args = node.target, node.args
        if target is torch.arange:
            bounds = list(args) + [node.kwargs.get(k) for k in ("start", "end", "step") if k in node.kwargs]
            if len(bounds) == 1:
                end, start, step = bounds[0], 0, 1
            elif len(bounds) in (2, 3):
                start, end, step = bounds[0], bounds[1], bounds[2] if len(bounds) == 3 else 1
            else:
                return False
            end = example_value(end) if isinstance(end, torch.fx.Node) else end
            return start == 0 and step == 1 and is_token_count(end, sym)
        if target is operator.getitem:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if not all(i is None or i == slice(None) for i in idx):
                return False
        elif target in _ADDS:
            if len(args) != 2 or args[1] != 0:
                return False
        elif target not in _ADDS_DIMS:
            return False
        node = args[0]
    return False


class TokenShapes:
    """Where the token count sits among a callable's arguments (or outputs): per position, the
    token dims of a tensor, True for a SymInt equal to the token count, else None."""

    def __init__(self, fakes, sym):
        self.where = []
        # positions of CPU scalar tensors: a launch reads their values on the host
        self.host_scalars = tuple(i for i, f in enumerate(fakes) if isinstance(f, torch.Tensor)
                                  and f.device.type == "cpu" and f.dim() == 0)
        for f in fakes:
            if isinstance(f, torch.Tensor):
                self.where.append(token_dims(f, sym) or None)
            elif isinstance(f, torch.SymInt):
                if f.node.expr == sym:
                    self.where.append(True)
                elif sym in f.node.expr.free_symbols:
                    raise Unsupported(f"a size argument {f.node.expr} derived from the token count {sym}")
                else:
                    self.where.append(None)
            else:
                self.where.append(None)

    def resize(self, args, rows: int, pad: bool):
        """``args`` with every token dim at ``rows`` (sliced views when shrinking, zero-padded copies
        when growing and ``pad``) and every token-count SymInt replaced by ``rows``."""
        out = list(args)
        for i, w in enumerate(self.where):
            if w is True:
                out[i] = rows
            elif w:
                out[i] = _resize(args[i], w, rows, pad)
        return out


def _resize(t: torch.Tensor, dims: tuple[int, ...], rows: int, pad: bool) -> torch.Tensor:
    for d in dims:
        size = t.shape[d]
        if size > rows:
            t = t.narrow(d, 0, rows)
        elif size < rows and pad:
            grown = _zeros_like_layout(t, d, rows)
            grown.narrow(d, 0, size).copy_(t)
            t = grown
    return t


def _zeros_like_layout(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """Zeros shaped like ``t`` with ``rows`` at ``dim``, dims laid out in ``t``'s stride order: the
    compiled pieces assert their inputs' strides (an attention output is often a transposed view)."""
    shape = list(t.shape)
    shape[dim] = rows
    return _new_in_layout(t, shape, t.new_zeros)


def dense_in_layout(t: torch.Tensor) -> torch.Tensor:
    """A dense copy of ``t`` with its dims in ``t``'s stride order. A view narrowed in its token dim
    keeps the strides of the tensor it was cut from, which a compiled piece (asserting the strides
    of a dense input at the live row count) refuses wherever a dim larger than one precedes it."""
    dense = _new_in_layout(t, list(t.shape), t.new_empty)
    dense.copy_(t)
    return dense


def _new_in_layout(t: torch.Tensor, shape: list[int], new) -> torch.Tensor:
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))  # outermost first
    return new([shape[i] for i in order]).permute([order.index(i) for i in range(t.dim())])
