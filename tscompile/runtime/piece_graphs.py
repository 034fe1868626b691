"""Prefill CUDA graphs: one ``torch.cuda.CUDAGraph`` per compiled piece per padded size.

The runner pads a prefill to a token bucket (and the narrowing model's kept rows to a row bucket,
``PrefillBuckets``) and says so in the forward context (``PrefillGraphPlan``). Each Inductor piece of the split graph
is wrapped in a ``GraphedPiece``: under a plan that covers its stage it captures itself once per
input-shape signature and replays from then on; otherwise (no plan, above the largest bucket, a
``torch.compile`` user outside the engine) it calls the compiled piece directly. Breaks stay eager.

Why raw graphs and not CUDA-graph trees: the trees cost about 100 us of host work per captured
piece (measured on an H200, see bench/results/README.md), and a Llama prefill has a piece per layer.

Why the pieces hold their graphs rather than the ``GraphRunner``'s step keys: one piecewise step
replays many graphs, one per compiled piece, with eager attention breaks between them, and a
piece's graph is selected by its own input shapes (the narrowing model's decoder pieces by a row
bucket that the step's key does not carry, the last piece by its logits rows), not by the step.
So each ``GraphedPiece`` keys its graphs by its input signature, and takes everything else from the
engine's ``GraphRunner``: the prefill memory pool and capture stream, the capture and replay
backend (CUDA graphs, or ``HostGraphs`` on any device), the prefill capture clock, and the one
replay switch (``GraphRunner.replay``).

How addresses stay put without copying activations:
- a piece's outputs are the tensors its capture produced (graph-pool memory, held here), so the next
  piece, and the attention break that writes into the ``out`` buffer a piece allocated, see the
  same addresses at every replay;
- the narrowing break's outputs are copied into per-bucket handoff buffers (``NarrowHandoff``), rows
  past the live count zeroed;
- any other input (this step's metadata, a break's fresh output) is copied into the tensor the
  capture saw when its address differs. Parameters are never copied into: a parameter at a new
  address is an error, and so is a moved input that the piece writes to (the write would land in
  the captured tensor, not the caller's).

Correctness rests on replaying a size's pieces in capture order, one step at a time, and on the
caller consuming a step's outputs before the next step: the step's tokens are read right away.
All prefill pieces share one pool; that is safe because every tensor handed from one piece to the
next is held by its capture entry (never reused by a later capture), and an intermediate a piece
frees may be reused only by captures whose replays do not overlap it in time.

Memory: each capture keeps its outputs, per piece, bucket and Dynamo variant (greedy or sampled;
for the narrowing model also extend or mixed); they are allocated lazily, after the KV pool was sized.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from tscompile.counters import counters
from tscompile.forward_context import peek_forward_context
from tscompile.piece_compiler import PieceWrappers
from tscompile.runtime.graph_runner import PREFILL, GraphRunner
from tscompile.step_plan import StepPlan
from tscompile.utils import bucket

logger = logging.getLogger("tscompile")


@dataclass
class PrefillGraphPlan:
    """Set by the runner in the forward context of one extend/mixed step.

    encoder_tokens: the token bucket the step is padded to (None: encoder pieces run ungraphed).
    decoder_rows: the row bucket the narrowed rows are padded to (None: decoder pieces ungraphed).
    logits_rows: the request bucket the last piece's logits rows are padded to (None: not padded).
    """

    graphs: GraphRunner
    pieces: list  # the pieces that captured at least once (PrefillBuckets.pieces)
    encoder_tokens: int | None
    decoder_rows: int | None = None
    logits_rows: int | None = None

    def covers(self, stage: str) -> bool:
        return (self.encoder_tokens if stage == "encoder" else self.decoder_rows) is not None


class PrefillBuckets:
    """The padded sizes of extend/mixed steps under prefill graphs.

    token_ladder: token buckets (the config's, up to ``prefill_graph_max_tokens``); a step with
    more tokens runs its pieces without graphs. row_ladder: the narrowing model's decoder-row
    buckets, the token ladder clipped to ``window * max_num_seqs`` (the most rows a step keeps);
    ``narrowed`` is the index of the narrowed cache group (None: a plain model). request_ladder:
    the request counts the last piece's logits rows are padded to (the LM head and the sampler
    run on one row per request, so without padding that piece would capture once per count)."""

    def __init__(self, graphs: GraphRunner, token_ladder: tuple[int, ...], *, num_groups: int,
                 narrowed: int | None, window: int, max_num_seqs: int, request_ladder: tuple[int, ...] = ()):
        self.graphs = graphs
        self.pieces: list[GraphedPiece] = []  # pieces that captured at least once
        # the pieces can outlive the engine (Dynamo's compiled code holds them, and Dynamo keeps
        # code it compiled): what they captured, weights and graph memory included, goes with it
        weakref.finalize(self, release_captures, self.pieces)
        self.token_ladder = token_ladder
        self.request_ladder = request_ladder
        self.num_groups = num_groups
        self.narrowed = narrowed
        self.max_num_seqs = max_num_seqs
        cap = window * max_num_seqs
        self.row_ladder = tuple(sorted({min(b, cap) for b in token_ladder})) if narrowed is not None else ()

    def sizes_of(self, plan: StepPlan) -> tuple[int | None, int | None, int | None]:
        """``(tokens, rows, requests)`` a step is padded to: its token bucket and (narrowing model) row
        bucket, None above a ladder, and the rows of its last piece's logits (``padded_requests``)."""
        tokens = bucket(self.token_ladder, plan.num_tokens)
        # a step above the token ladder runs its decoder without graphs too: its last piece reads the
        # logits rows as a view into the step's upload, after the unpadded ids and positions, and
        # that view's storage offset is a SymInt input of the piece, so graphing it there would
        # capture again for every (aligned) token count
        narrowed = self.narrowed is not None and tokens is not None
        rows = bucket(self.row_ladder, plan.groups[self.narrowed].num_rows) if narrowed else None
        return tokens, rows, self.padded_requests(plan.num_requests, rows if self.narrowed is not None else tokens)

    def padded_requests(self, num_requests: int, last_rows: int | None) -> int | None:
        """The logits rows of a step whose last piece runs on ``last_rows`` rows (None: ungraphed,
        not padded): the request bucket, never more than those rows."""
        if last_rows is None or not self.request_ladder:
            return None
        return min(bucket(self.request_ladder, num_requests) or num_requests, last_rows)

    def plan_for(self, plan: StepPlan) -> PrefillGraphPlan:
        tokens, rows, requests = self.sizes_of(plan)
        if self.narrowed is not None:
            counters["decoder_rows_graphed" if rows is not None else "decoder_rows_eager"] += 1
        return PrefillGraphPlan(self.graphs, self.pieces, tokens, rows, requests)

    def graph_keys(self, plan: StepPlan) -> frozenset:
        """What a step of ``plan``'s shape captures when nothing is captured yet, one key per group
        of pieces that capture together. Dynamo compiles a variant per greedy/sampled (and, for the
        narrowing model, extend/mixed; see ``variant``), each with pieces of its own; the
        stage before the narrowing (every piece but the last for a plain model) is keyed by the
        token bucket, the decoder's by the row bucket, the last piece also by the request bucket
        and, for the narrowing model too, by the token bucket: its logits-row indices are a view
        into the step's one upload, after the padded ids and positions, and that view's storage
        offset (twice the token bucket, rounded up to the upload's alignment) is one of the piece's
        SymInt inputs, so a decoder row bucket's last piece captures once per token bucket it is
        reached from (buckets that round alike share the graph; keying by the bucket costs only a
        placeholder step that captures nothing)."""
        tokens, rows, requests = self.sizes_of(plan)
        # Dynamo compiles the step once per sampling variant (greedy skips the sort); request counts
        # share it (runtime/dynamic_sizes.py), and EXTEND and MIXED too, but for the narrowing, which
        # reads the step's mode
        variant = (plan.mode if self.narrowed is not None else None, plan.sampling.all_greedy)
        keys = set()
        if tokens is not None:
            keys.add(("encoder", tokens, *variant))
        last_rows = tokens if self.narrowed is None else rows
        if self.narrowed is not None and rows is not None:
            keys.add(("decoder", rows, *variant))
        if last_rows is not None:
            keys.add(("last", last_rows, requests, tokens, *variant))
        return frozenset(keys)

    def pad_rows(self, graphs: PrefillGraphPlan) -> dict[int, int]:
        """Rows each cache group's layers run on: the row bucket for the narrowed group, the token
        bucket for the others (groups above their ladder are not padded)."""
        out = {}
        for g in range(self.num_groups):
            rows = graphs.decoder_rows if g == self.narrowed else graphs.encoder_tokens
            if rows is not None:
                out[g] = rows
        return out


def release_captures(pieces: list[GraphedPiece]) -> None:
    """Forget every graph ``pieces`` captured, and the tensors they hold (their engine is gone)."""
    for piece in pieces:
        piece.graphs.clear()
    pieces.clear()


def current_plan() -> PrefillGraphPlan | None:
    ctx = peek_forward_context()
    return None if ctx is None else ctx.prefill_graphs


class _Captured:
    __slots__ = ("graph", "play", "outputs", "copied", "fixed")

    def __init__(self, graph, play, outputs, copied, fixed):
        self.graph = graph  # what the GraphRunner's backend captured
        self.play = play  # its replay: one call
        self.outputs = outputs
        self.copied = copied  # [(arg index, static tensor)] copied into when the address moved
        self.fixed = fixed  # [(arg index, tensor)] parameters and written inputs: must never move


def _signature(args) -> tuple:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)


class GraphedPiece:
    """``written``: indices of the inputs the piece mutates in place (see ``mutated_inputs``)."""

    def __init__(self, name: str, stage: str, fn: Callable, written: frozenset[int] = frozenset()):
        self.name, self.stage, self.fn, self.written = name, stage, fn, written
        self.graphs: dict[tuple, _Captured] = {}

    def __call__(self, *args):
        plan = current_plan()
        if plan is None or not plan.covers(self.stage) or not plan.graphs.replay:
            return self.fn(*args)
        key = _signature(args)
        entry = self.graphs.get(key)
        if entry is None:
            if not self.graphs:
                plan.pieces.append(self)
            entry = self.graphs[key] = self._capture(plan.graphs, args)
            counters["prefill_captures"] += 1
        for i, static in entry.copied:
            a = args[i]
            if a.data_ptr() != static.data_ptr():
                static.copy_(a)
        for i, static in entry.fixed:
            if args[i].data_ptr() != static.data_ptr():
                raise RuntimeError(f"tscompile: prefill piece {self.name}: input {i} (a parameter, or a tensor the "
                                   f"piece writes to) is not the tensor it was captured with; weights or "
                                   f"output buffers must keep their addresses while graphs exist")
        entry.play()
        counters["prefill_replays"] += 1
        return entry.outputs

    def _capture(self, graphs: GraphRunner, args) -> _Captured:
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        is_fixed = {i for i, a in tensors if isinstance(a, torch.nn.Parameter) or i in self.written}
        fixed = [(i, a) for i, a in tensors if i in is_fixed]
        copied = [(i, a) for i, a in tensors if i not in is_fixed]
        start = time.perf_counter()
        pool, stream = graphs.pool(PREFILL)
        graph, outputs = graphs.backend.capture(lambda: self.fn(*args), pool, stream, warmup=1, tidy=False,
                                                what=f"prefill piece {self.name} for sizes {_signature(args)}")
        graphs.capture_seconds[PREFILL] += time.perf_counter() - start
        return _Captured(graph, graphs.backend.replayer(graph), outputs, copied, fixed)


class NarrowHandoff:
    """Wraps the eager narrowing break: pads its row-shaped outputs to the step's row bucket.

    ``row_outputs[i]`` is True where output ``i`` is a tensor whose dim 0 is the narrowed row count;
    ``size_outputs[i]`` is True where it is that row count itself (a SymInt the decoder reads)."""

    def __init__(self, name: str, fn: Callable, row_outputs: list[bool], size_outputs: list[bool]):
        self.name, self.fn = name, fn
        self.row_outputs, self.size_outputs = row_outputs, size_outputs
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, *args):
        outs = self.fn(*args)
        plan = current_plan()
        if plan is None or plan.decoder_rows is None:
            return outs
        single = not isinstance(outs, (tuple, list))
        outs = [outs] if single else list(outs)
        rows = plan.decoder_rows
        live = next(o.shape[0] for o, r in zip(outs, self.row_outputs) if r)
        if live > rows:
            raise RuntimeError(f"tscompile: the narrowing kept {live} rows, more than the planned bucket {rows}")
        for i, o in enumerate(outs):
            if self.row_outputs[i]:
                buf = self.buffers.get((i, rows))
                if buf is None:
                    buf = self.buffers[(i, rows)] = o.new_zeros((rows, *o.shape[1:]))
                buf[:live].copy_(o)
                buf[live:].zero_()
                outs[i] = buf
            elif self.size_outputs[i]:
                outs[i] = rows
        return outs[0] if single else tuple(outs)


# what the engine hands the piece compiler (``piece_compiler.PieceWrappers``)
PIECE_GRAPH_WRAPPERS = PieceWrappers(compiled=GraphedPiece, narrow=NarrowHandoff)
