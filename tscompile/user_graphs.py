"""Piecewise CUDA graphs for a model compiled by a ``torch.compile`` user (not the engine).

A split graph (``split_sdpa`` or ``tscompile::attention`` breaks) is run with its token dimension
padded to a bucket of the config's ``token_ladder`` inside the compiled pieces, and sliced back to
the live rows at each attention break (run eagerly) and at the graph's outputs, so the caller never
sees padding. Each padded piece is captured once per bucket (``capture_graph``, the engine's raw
graphs: the trees cost about 100 us of host work per piece) and replayed from then on; above the
largest bucket the same compiled pieces run unpadded and without graphs.

Which dimension is "the token dimension": the symbol of the attention query's row count (SDPA's
dim -2, ``tscompile::attention``'s dim 0). Padding is only sound for pieces that are row-wise in it,
so every compiled piece is checked at compile time: a piece that slices, reduces or reshapes the
token dimension (``hidden[:, -1:]`` in transformers' ``logits_to_keep``) runs live and ungraphed,
like a break. A graph with any other dynamic size (a growing KV length while decoding) is left
entirely ungraphed: a capture per size would never be replayed.

Why outputs are copied: a replayed piece writes the same memory at every call; the caller's
tensors must survive the next call, so the graph's outputs are cloned out of graph memory. That is
what lets a user call the compiled model in a loop with nothing to do per step.

Why these graphs do not go through the engine's ``GraphRunner``: a ``torch.compile`` user has no
engine, no step plan and no persistent input buffers, so there is no step key to select a graph
by, nothing to pad on the host and no runner object the user could reach. Padding happens inside
the compiled graph (the token dimension is resized at each piece), each piece captures once per
bucket and per its other input shapes, and outputs are cloned out of graph memory. What is shared
is the capture itself (``graph_runner.capture_graph``: raw ``torch.cuda.CUDAGraph``, one pool per
compiled graph) and the meaning of the switch: ``pad_without_graphs()`` runs the same padding
without capture or replay, as ``GraphRunner.replay = False`` does for an engine.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from tscompile.counters import counters
from tscompile.passes.split import SDPA_TARGETS, SplitPlan, op_name
from tscompile.piece_compiler import mutated_inputs
from tscompile.utils import bucket

logger = logging.getLogger("tscompile")

_PAD_WITHOUT_GRAPHS = [False]


@contextlib.contextmanager
def pad_without_graphs():
    """Pad to the bucket and slice at breaks exactly as under graphs, but run the pieces directly
    (no capture, no replay). Tests compare it with replay, and use it on the CPU, where no graph
    exists, to check that padding never shows in the outputs."""
    _PAD_WITHOUT_GRAPHS.append(True)
    try:
        yield
    finally:
        _PAD_WITHOUT_GRAPHS.pop()


class Unsupported(Exception):
    """The graph cannot be padded; it runs without user graphs (the reason is logged)."""


def _symbols(value) -> set:
    if isinstance(value, torch.Tensor):
        out = set()
        for d in value.shape:
            if isinstance(d, torch.SymInt):
                out |= d.node.expr.free_symbols
        return out
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, (tuple, list)):
        return set().union(*(_symbols(v) for v in value)) if value else set()
    return set()


def _is_sym(d, sym) -> bool:
    return isinstance(d, torch.SymInt) and d.node.expr == sym


def token_dims(value, sym) -> tuple[int, ...]:
    """The dims of a fake tensor whose size is exactly the token symbol; a dim that is any other
    expression of it (``s * 64`` after a flatten, ``s - 1``) cannot be padded: Unsupported."""
    dims = []
    for i, d in enumerate(value.shape):
        if _is_sym(d, sym):
            dims.append(i)
        elif isinstance(d, torch.SymInt) and sym in d.node.expr.free_symbols:
            raise Unsupported(f"a tensor dim of size {d.node.expr} (not the token count {sym} itself)")
    return tuple(dims)


def _example(node: torch.fx.Node):
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
            query = _example(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
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
        out = _example(node)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs:
            continue
        try:
            for o in outs:
                token_dims(o, sym)
        except Unsupported as e:
            return f"{node.format_node()}: {e}"
        fed = any(sym in _symbols(_example(a)) for a in node.all_input_nodes if isinstance(_example(a), torch.Tensor))
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
    src = _example(node.args[0])
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
        if d < len(per_dim) and not _from_the_front(per_dim[d]):
            return "reads rows counted from the end (or by a tensor) of the token dim"
    return None


class _Shapes:
    """Where the token count sits among a callable's arguments (or outputs): per position, the
    token dims of a tensor, True for a SymInt equal to the token count, else None."""

    def __init__(self, fakes, sym):
        self.where = []
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
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))  # outermost first
    shape = list(t.shape)
    shape[dim] = rows
    dense = t.new_zeros([shape[i] for i in order])
    return dense.permute([order.index(i) for i in range(t.dim())])


class UserGraphRuntime:
    """What the pieces of one compiled graph share: the ladder, this call's live and padded row
    counts, and (on CUDA) one memory pool and capture stream."""

    def __init__(self, ladder: tuple[int, ...]):
        self.ladder = ladder
        self.live: int | None = None
        self.rows: int | None = None  # the bucket of this call; None: run unpadded
        self.replay = False  # this call captures/replays (CUDA, not ``pad_without_graphs``)
        self.pool = self.stream = None
        self.capture_seconds = 0.0
        self.captured_ptrs: set[int] = set()  # outputs of captures: stable, handed on without a copy

    def graphs_for(self, device: torch.device):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)
        return self.pool, self.stream


class _Entry:
    __slots__ = ("graph", "inputs", "outputs")

    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class PaddedPiece:
    """A compiled piece run at the call's bucket: captured once per bucket and replayed on CUDA.

    Inputs that are parameters, buffers of the module or written by the piece must keep their
    addresses (they are captured in place); any other tensor input is copied into the captured
    one when its address differs (the live rows only: a padded row's contents never reach a live
    row of a row-wise piece)."""

    def __init__(self, name: str, fn: Callable, shapes: _Shapes, written: frozenset[int], runtime: UserGraphRuntime):
        self.name, self.fn, self.shapes, self.written, self.runtime = name, fn, shapes, written, runtime
        self.graphs: dict[tuple, _Entry] = {}

    def __call__(self, *args):
        rt = self.runtime
        if rt.rows is None:
            return self.fn(*args)
        if not rt.replay:
            counters["user_padded_runs"] += 1
            return self.fn(*self.shapes.resize(args, rt.rows, pad=True))
        key = (rt.rows,) + tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a
                                for a, w in zip(args, self.shapes.where) if not w)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(args)
            counters["user_captures"] += 1
        for i, static in entry.inputs:
            a = args[i]
            if a.data_ptr() == static.data_ptr():
                continue
            if i in self.written or isinstance(a, torch.nn.Parameter):
                raise RuntimeError(f"tscompile: piece {self.name}: input {i} (a parameter, or a tensor the piece "
                                   f"writes to) moved since capture; keep weights and written buffers in place")
            w = self.shapes.where[i]
            dst = static
            for d in w or ():
                dst = dst.narrow(d, 0, a.shape[d])
            dst.copy_(a)
        entry.graph.replay()
        counters["user_replays"] += 1
        return entry.outputs

    def _capture(self, args) -> _Entry:
        from tscompile.runtime.graph_runner import capture_graph

        rt = self.runtime
        padded = self.shapes.resize(args, rt.rows, pad=True)
        # the captured inputs: parameters, written tensors and earlier captures' outputs in place;
        # anything else (the caller's tensors, a break's fresh output) as a buffer of our own
        static = [p if not isinstance(a, torch.Tensor) or isinstance(a, torch.nn.Parameter) or i in self.written
                  or p is not a or a.data_ptr() in rt.captured_ptrs else a.clone()
                  for i, (a, p) in enumerate(zip(args, padded))]
        inputs = [(i, s) for i, s in enumerate(static) if isinstance(s, torch.Tensor)]
        device = next(s.device for _, s in inputs)
        pool, stream = rt.graphs_for(device)
        start = time.perf_counter()
        graph, outputs = capture_graph(lambda: self.fn(*static), device, stream, pool,
                                       f"piece {self.name} at {rt.rows} tokens")
        rt.capture_seconds += time.perf_counter() - start
        rt.captured_ptrs.update(o.data_ptr() for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor))
        return _Entry(graph, inputs, outputs)


class LiveBreak:
    """An attention break (or a piece that is not row-wise): its token dims sliced to the live rows."""

    def __init__(self, fn: Callable, shapes: _Shapes, runtime: UserGraphRuntime):
        self.fn, self.shapes, self.runtime = fn, shapes, runtime

    def __call__(self, *args):
        rt = self.runtime
        if rt.rows is None:
            return self.fn(*args)
        return self.fn(*self.shapes.resize(args, rt.live, pad=False))


def wrap_split(split: torch.fx.GraphModule, plan: SplitPlan, example_inputs: list,
               ladder: tuple[int, ...]) -> Callable:
    """The forward of ``split`` (its pieces already compiled, ``compile_split_module``) run padded to
    the ladder's buckets with per-bucket graphs; ``split.forward`` itself where padding is unsound."""
    try:
        return _wrap(split, plan, example_inputs, ladder)
    except Unsupported as e:
        counters["user_graphs_refused"] += 1
        # the user asked for graphs: say why there are none where they will see it
        logger.warning("tscompile: this graph runs without CUDA graphs: %s", e)
        return split.forward


def _wrap(split, plan, example_inputs, ladder) -> Callable:
    if not ladder:
        raise Unsupported("the token ladder is empty (prefill_graph_max_tokens=0)")
    fake_args, _fake_outputs, fake_result = split.meta["tscompile_fake"]
    sym = find_token_symbol(split, plan)
    if sym is None:
        raise Unsupported("the attention rows are static")
    everything = list(fake_args.values()) + [list(example_inputs), pytree.tree_leaves(fake_result)]
    others = set().union(*(_symbols(list(a)) for a in everything)) - {sym}
    if others:
        raise Unsupported(f"sizes other than the token count are dynamic ({sorted(map(str, others))})")
    entry = _Shapes(list(example_inputs), sym)
    if not any(entry.where):
        raise Unsupported(f"no input carries the token count {sym}")
    runtime = UserGraphRuntime(ladder)
    padded = 0
    for piece in plan.pieces:
        shapes = _Shapes(list(fake_args[piece.name]), sym)
        module = split._modules[piece.name]
        fn = split.__dict__.get(piece.name, module)
        why = check_row_wise(module, sym) if piece.kind == "compiled" else piece.kind
        if piece.kind == "compiled" and why is None:
            written = mutated_inputs(module)
            if any(shapes.where[i] for i in written):
                raise Unsupported(f"piece {piece.name} writes in place to a token-shaped input")
            split.__dict__[piece.name] = PaddedPiece(piece.name, fn, shapes, written, runtime)
            padded += 1
        else:
            if piece.kind == "compiled":
                logger.info("tscompile: piece %s runs at the live rows, ungraphed: %s", piece.name, why)
                counters["user_live_pieces"] += 1
            split.__dict__[piece.name] = LiveBreak(fn, shapes, runtime)
    outputs = _Shapes(pytree.tree_leaves(fake_result), sym)
    forward = split.forward

    def run(*args):
        live = next(a if w is True else a.shape[w[0]] for a, w in zip(args, entry.where) if w)
        rows = bucket(runtime.ladder, live)
        if rows is None:
            counters["user_above_ladder"] += 1
            return forward(*args)
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        runtime.replay = cuda and not _PAD_WITHOUT_GRAPHS[-1]
        if not cuda and not _PAD_WITHOUT_GRAPHS[-1]:
            return forward(*args)  # no graphs on this device: padding would only cost
        runtime.live, runtime.rows = live, rows
        try:
            out = forward(*args)
        finally:
            runtime.live = runtime.rows = None
        leaves, spec = pytree.tree_flatten(out)
        live_leaves = outputs.resize(leaves, live, pad=False)
        if runtime.replay:  # graph memory is rewritten by the next call: hand out copies
            live_leaves = [t.clone() if isinstance(t, torch.Tensor) else t for t in live_leaves]
        return pytree.tree_unflatten(live_leaves, spec)

    counters["user_padded_pieces"] += padded
    run.runtime = runtime  # type: ignore[attr-defined]
    return run
