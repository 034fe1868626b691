"""Piecewise CUDA graphs for a model compiled by a ``torch.compile`` user (not the engine).

A split graph (``split_sdpa`` or ``tscompile::attention`` breaks) is run with its token dimension
padded to a bucket of the config's ``token_ladder`` inside the compiled pieces, and sliced back to
the live rows at each attention break (run eagerly) and at the graph's outputs, so the caller never
sees padding. Each padded piece is captured once per bucket (``capture_graph``, the engine's raw
graphs: the trees cost about 100 us of host work per piece) and replayed from then on; above the
largest bucket the same compiled pieces run unpadded and without graphs.

Which dimension carries the tokens, and which pieces may be padded in it, is decided by
``token_padding.py`` (a graph it refuses runs without user graphs).

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
import time
from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from tscompile.counters import counters
from tscompile.passes.split import SplitPlan
from tscompile.piece_compiler import mutated_inputs
from tscompile.token_padding import TokenShapes, Unsupported, check_row_wise, find_token_symbol, symbols_of
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

    def __init__(self, name: str, fn: Callable, shapes: TokenShapes, written: frozenset[int],
                 runtime: UserGraphRuntime):
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

    def __init__(self, fn: Callable, shapes: TokenShapes, runtime: UserGraphRuntime):
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
    others = set().union(*(symbols_of(list(a)) for a in everything)) - {sym}
    if others:
        raise Unsupported(f"sizes other than the token count are dynamic ({sorted(map(str, others))})")
    entry = TokenShapes(list(example_inputs), sym)
    if not any(entry.where):
        raise Unsupported(f"no input carries the token count {sym}")
    runtime = UserGraphRuntime(ladder)
    padded = 0
    for piece in plan.pieces:
        shapes = TokenShapes(list(fake_args[piece.name]), sym)
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
    outputs = TokenShapes(pytree.tree_leaves(fake_result), sym)
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
