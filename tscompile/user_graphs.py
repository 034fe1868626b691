"""Piecewise CUDA graphs for a model compiled by a ``torch.compile`` user (not the engine).

A split graph (``split_sdpa`` or ``tscompile::attention`` breaks) is run with its token dimension
padded to a bucket of the config's ``token_ladder`` inside the compiled pieces, and sliced back to
the live rows at each attention break (run eagerly) and at the graph's outputs, so the caller never
sees padding. Each padded piece is captured once per bucket (``capture_graph``, the engine's raw
graphs: the trees cost about 100 us of host work per piece) and replayed from then on; above the
largest bucket the same compiled pieces run unpadded and without graphs.

Which dimension carries the tokens, and which pieces may be padded in it, is decided by
``token_padding.py`` (a graph it refuses runs without user graphs).

Whole-graph capture: when every compiled piece is row-wise and every break is an SDPA call over the
token rows (a transformers decoder's forward), the breaks need not run at the live rows either. At
the bucket, ``sdpa_over_live_keys`` masks the padded keys out of every query row, so a live row
attends to exactly the keys it attends to unpadded; the whole forward then runs at the bucket and
is captured as one graph per bucket (``WholeGraph``). A call is then one copy of the inputs, one
replay and one copy of the outputs, instead of a replay per piece with an eager attention call
and its slicing between each two.

Why outputs are copied: a replayed piece writes the same memory at every call; the caller's
tensors must survive the next call, so the graph's outputs are cloned out of graph memory. That is
what lets a user call the compiled model in a loop with nothing to do per step. With
``KernelPolicy.user_graph_eager_tail``, a whole graph whose last piece's outputs are large at a bucket
leaves that piece out instead (``user_graph_tail.py``), so those outputs are made outside graph memory
and need no copy.

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
from tscompile.passes.split import SDPA_TARGETS, SplitPlan
from tscompile.piece_compiler import mutated_inputs
from tscompile.token_padding import (TokenShapes, Unsupported, check_row_wise, example_value, find_token_symbol,
                                     is_token_count, symbols_of)
from tscompile.user_graph_tail import GraphTail, split_off_tail
from tscompile.utils import bucket

logger = logging.getLogger("tscompile")

_PAD_WITHOUT_GRAPHS = [False]
# per query row, which key rows are live, while a whole graph runs at a bucket (None otherwise)
_LIVE_KEYS: list[torch.Tensor | None] = [None]


@contextlib.contextmanager
def _attending_live_keys(valid: torch.Tensor):
    _LIVE_KEYS.append(valid)
    try:
        yield
    finally:
        _LIVE_KEYS.pop()


def sdpa_over_live_keys(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):
    """``scaled_dot_product_attention`` that, inside a whole graph run at a bucket, never attends to a
    padded key: the padded keys are masked out of the caller's mask (a causal call without a mask
    already hides keys after the query's row, so it runs as it is). Padded query rows see the live
    keys at least (never a row with no key, which would be NaN); their outputs are sliced off."""
    valid = _LIVE_KEYS[-1]
    if valid is not None and not (is_causal and attn_mask is None):
        if attn_mask is None:
            attn_mask = valid.unsqueeze(0)  # [1, keys]: SDPA wants a query dim to broadcast
        elif attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & valid
        else:
            attn_mask = attn_mask.masked_fill(~valid, float("-inf"))
    extra = {"enable_gqa": True} if enable_gqa else {}
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                            is_causal=is_causal, scale=scale, **extra)


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
    __slots__ = ("graph", "inputs", "outputs", "tailed")

    def __init__(self, graph, inputs, outputs, tailed=False):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.tailed = tailed  # a whole graph captured without its last piece (``user_graph_tail``)


def _capture_key(rows: int, args, shapes: TokenShapes) -> tuple:
    """What a capture is good for: its bucket and the value of each CPU scalar input (Dynamo passes
    a float attribute of a module as one; a launch reads it on the host, so the capture keeps its
    value). Every other size is static under Dynamo's guards (``_wrap`` refuses other dynamic sizes)."""
    return (rows, *(args[i].item() for i in shapes.host_scalars))


def _refill(inputs: list[tuple[int, torch.Tensor]], args, shapes: TokenShapes, written, what: str) -> None:
    """Bring a call's tensors into a capture's inputs: one at the captured address is already there;
    any other is copied in (its live rows only: the padded rows of a row-wise graph never reach a live
    row). A parameter, or a tensor the graph writes to, that moved is refused: the capture reads and
    writes the old address."""
    for i, static in inputs:
        a = args[i]
        if a.data_ptr() == static.data_ptr():
            continue
        if i in written or isinstance(a, torch.nn.Parameter):
            raise RuntimeError(f"tscompile: {what}: input {i} (a parameter, or a tensor the graph writes to) "
                               f"moved since capture; keep weights and written buffers in place")
        dst = static
        for d in shapes.where[i] or ():
            dst = dst.narrow(d, 0, a.shape[d])
        dst.copy_(a)


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
        key = _capture_key(rt.rows, args, self.shapes)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(args)
            counters["user_captures"] += 1
        _refill(entry.inputs, args, self.shapes, self.written, f"piece {self.name}")
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


class WholeGraph:
    """A split graph whose breaks all run at the bucket (``sdpa_over_live_keys``): the whole forward
    at the call's bucket, captured once per bucket (and per the shapes of its other inputs) on CUDA.
    ``tail``: where it pays at a bucket (large outputs), the graph stops before the last piece, which
    runs after it at the live rows (``user_graph_tail``)."""

    def __init__(self, forward: Callable, inputs: TokenShapes, runtime: UserGraphRuntime,
                 tail: GraphTail | None = None):
        self.forward, self.inputs, self.runtime, self.tail = forward, inputs, runtime, tail
        self.graphs: dict[tuple, _Entry] = {}
        self.live_count: torch.Tensor | None = None  # the live row count of the replay, on the device

    def _tailed(self, rows: int) -> bool:
        return self.tail is not None and self.tail.pays_at(rows)

    def run_padded(self, args, live: int, rows: int):
        """The forward at the bucket, without graphs (``pad_without_graphs``), its last piece at the
        live rows where a replay's would be."""
        counters["user_padded_runs"] += 1
        padded = self.inputs.resize(args, rows, pad=True)
        device = next(a.device for a, w in zip(args, self.inputs.where) if w and w is not True)
        tailed = self._tailed(rows)
        with _attending_live_keys(torch.arange(rows, device=device) < live):
            out = (self.tail.head if tailed else self.forward)(*padded)
        if not tailed:
            return out
        counters["user_eager_tails"] += 1
        return self.tail.finish(out, live)[0]

    def replay(self, args, live: int, rows: int) -> tuple[object, set[int]]:
        """The forward's outputs, and the ids of those outside graph memory (no copy needed)."""
        key = _capture_key(rows, args, self.inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(args, live, rows)
            counters["user_captures"] += 1
        _refill(entry.inputs, args, self.inputs, (), "the whole graph")
        self.live_count.fill_(live)
        entry.graph.replay()
        counters["user_replays"] += 1
        if entry.tailed:
            counters["user_eager_tails"] += 1
            return self.tail.finish(entry.outputs, live)
        return entry.outputs, set()

    def _capture(self, args, live: int, rows: int) -> _Entry:
        from tscompile.runtime.graph_runner import capture_graph

        rt = self.runtime
        # the token-shaped inputs as padded buffers of our own (a fresh copy even at the bucket's own
        # length: the caller's tensor is theirs); weights and other tensors captured in place
        padded = self.inputs.resize(args, rows, pad=True)
        static = [p.clone() if w and w is not True and p is a else p
                  for a, p, w in zip(args, padded, self.inputs.where)]
        inputs = [(i, s) for i, s in enumerate(static) if isinstance(s, torch.Tensor)]
        device = next(s.device for _, s in inputs)
        if self.live_count is None:
            self.live_count = torch.zeros((), dtype=torch.int64, device=device)
        self.live_count.fill_(live)
        tailed = self._tailed(rows)
        run = self.tail.head if tailed else self.forward

        def forward():
            # every tensor the graph reads must outlive it: the key positions are made inside it
            with _attending_live_keys(torch.arange(rows, device=device) < self.live_count):
                return run(*static)

        pool, stream = rt.graphs_for(device)
        start = time.perf_counter()
        graph, outputs = capture_graph(forward, device, stream, pool, f"the whole graph at {rows} tokens")
        rt.capture_seconds += time.perf_counter() - start
        return _Entry(graph, inputs, outputs, tailed)


def _attends_over_token_rows(break_module: torch.fx.GraphModule, sym) -> bool:
    """Whether a break is SDPA alone, its queries and keys both the token rows: then it can run at the
    bucket with the padded keys masked (``sdpa_over_live_keys``)."""
    for node in break_module.graph.nodes:
        if node.op in ("call_method", "call_module"):
            return False
        if node.op != "call_function":
            continue
        if node.target not in SDPA_TARGETS or len(node.args) < 3:
            return False
        q, k = (example_value(a) if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 and is_token_count(t.shape[-2], sym) for t in (q, k)):
            return False
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        mask = example_value(mask) if isinstance(mask, torch.fx.Node) else mask
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() >= 1
                                     and (is_token_count(mask.shape[-1], sym) or mask.shape[-1] == 1)):
            return False  # a mask whose key dim is not the token rows: the padded keys cannot be masked
    return True


def _mask_padded_keys(break_module: torch.fx.GraphModule) -> None:
    for node in break_module.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            node.target = sdpa_over_live_keys
    break_module.recompile()


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
               ladder: tuple[int, ...], eager_tail: bool = False) -> Callable:
    """The forward of ``split`` (its pieces already compiled, ``compile_split_module``) run padded to
    the ladder's buckets with per-bucket graphs; ``split.forward`` itself where padding is unsound.
    ``eager_tail``: a whole graph leaves a last piece with large outputs out (``user_graph_tail``)."""
    try:
        return _wrap(split, plan, example_inputs, ladder, eager_tail)
    except Unsupported as e:
        counters["user_graphs_refused"] += 1
        # the user asked for graphs: say why there are none where they will see it
        logger.warning("tscompile: this graph runs without CUDA graphs: %s", e)
        return split.forward


def _wrap(split, plan, example_inputs, ladder, eager_tail) -> Callable:
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
    # the traced inputs (their sizes symbolic): the example inputs hold the first call's plain sizes
    entry = TokenShapes([example_value(n) for n in split.graph.nodes if n.op == "placeholder"], sym)
    if not any(entry.where):
        raise Unsupported(f"no input carries the token count {sym}")
    runtime = UserGraphRuntime(ladder)
    padded = 0
    padded_fns: dict[str, Callable] = {}
    whole = all(_attends_over_token_rows(split._modules[p.name], sym) for p in plan.of_kind("break"))
    for piece in plan.pieces:
        shapes = TokenShapes(list(fake_args[piece.name]), sym)
        module = split._modules[piece.name]
        fn = split.__dict__.get(piece.name, module)
        why = check_row_wise(module, sym) if piece.kind == "compiled" else piece.kind
        if piece.kind == "compiled" and why is None:
            written = mutated_inputs(module)
            if any(shapes.where[i] for i in written):
                raise Unsupported(f"piece {piece.name} writes in place to a token-shaped input")
            whole = whole and not written  # a whole graph's inputs are copied in: no write may be lost
            split.__dict__[piece.name] = PaddedPiece(piece.name, fn, shapes, written, runtime)
            padded_fns[piece.name] = fn
            padded += 1
        else:
            if piece.kind == "compiled":
                logger.info("tscompile: piece %s runs at the live rows, ungraphed: %s", piece.name, why)
                counters["user_live_pieces"] += 1
                whole = False
            split.__dict__[piece.name] = LiveBreak(fn, shapes, runtime)
    outputs = TokenShapes(pytree.tree_leaves(fake_result), sym)
    forward = split.forward
    if whole:
        for piece in plan.of_kind("break"):
            _mask_padded_keys(split._modules[piece.name])
        tail = split_off_tail(split, padded_fns, fake_args, pytree.tree_leaves(fake_result), sym) if eager_tail \
            else None
        whole_graph = WholeGraph(forward, entry, runtime, tail)
        counters["user_whole_graphs"] += 1

    def run(*args):
        live = next(a if w is True else a.shape[w[0]] for a, w in zip(args, entry.where) if w)
        rows = bucket(runtime.ladder, live)
        if rows is None:
            counters["user_above_ladder"] += 1
            return forward(*args)
        fresh: set[int] = set()  # ids of outputs outside graph memory
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        runtime.replay = cuda and not _PAD_WITHOUT_GRAPHS[-1]
        if not cuda and not _PAD_WITHOUT_GRAPHS[-1]:
            return forward(*args)  # no graphs on this device: padding would only cost
        if whole and runtime.replay:
            out, fresh = whole_graph.replay(args, live, rows)
        elif whole:
            out = whole_graph.run_padded(args, live, rows)
        else:
            runtime.live, runtime.rows = live, rows
            try:
                out = forward(*args)
            finally:
                runtime.live = runtime.rows = None
        leaves, spec = pytree.tree_flatten(out)
        live_leaves = outputs.resize(leaves, live, pad=False)
        if runtime.replay:  # graph memory is rewritten by the next call: hand out copies
            live_leaves = [t.clone() if isinstance(t, torch.Tensor) and id(t) not in fresh else t
                           for t in live_leaves]
        return pytree.tree_unflatten(live_leaves, spec)

    counters["user_padded_pieces"] += padded
    run.runtime = runtime  # type: ignore[attr-defined]
    return run
