"""The graph runner: which step graph a batch runs, its capture on idle inputs, and its replay.

One ``GraphRunner`` serves every whole-step CUDA graph of an engine (the decode step per padded
batch, the whole extend/mixed step per token and request bucket) and the decode graphs of a
loaded package; the piecewise prefill graphs take its pool, capture, replay switch and clock
(``piece_graphs.py``). A graph is selected by a ``GraphKey``: ``(phase, batch_size, tokens,
width)`` and the variant the compiled step specializes on (all greedy; for prefill the step's mode).
``width`` is the verify width, the query rows per decode request: 1 for a plain decode step; a
speculative verify step of ``bs`` requests and width ``N`` is the decode graph of ``bs * N`` query
rows, ``GraphKey("decode", bs, bs * N, N)``, through this same runner.

``replay`` is the one switch: False runs every step over the same padded sizes, the same
persistent buffers and the same compiled code, without capturing or replaying a graph (tests and
``scripts/fuzz_gpu.py`` compare the two).

Capture and replay go through a ``GraphBackend``: ``CudaGraphs`` (raw ``torch.cuda.CUDAGraph``
captures around the Inductor-compiled step: a replay costs a few microseconds of host work, where
CUDA-graph trees cost about 100 us per replay on an H200, see bench/results/README.md) or
``HostGraphs``, which runs the captured function again into the captured outputs: the same keys,
buckets, padding and counters where no CUDA device exists. Each phase owns one memory pool and
one capture stream: graphs of a phase never run at the same time, and what one leaves in the pool
is not read after its replay (its outputs live in persistent buffers, or are read before the next
replay). Graph-debug mode (``pointer_guard``) snapshots the metadata a graph reads at capture and
checks it before each replay.

What this does not do: it computes no metadata and stages no inputs (the step runners fill the
persistent buffers a graph reads before each replay).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Iterable, NamedTuple, Protocol

import torch
from tqdm.auto import tqdm

from tscompile.counters import counters
from tscompile.runtime import pointer_guard
from tscompile.utils import bucket

logger = logging.getLogger("tscompile")

DECODE, PREFILL = "decode", "prefill"


class GraphKey(NamedTuple):
    """What selects a step graph. ``batch_size``: the padded request count; ``tokens``: the padded
    query rows (decode: ``batch_size * width``; prefill: the token bucket); ``width``: query rows per
    decode request (the verify width; 1 for plain decode and for prefill); ``greedy``: the step
    skips the vocabulary sort; ``mode``: a prefill step's ``ForwardMode`` (EXTEND or MIXED)."""

    phase: str
    batch_size: int
    tokens: int
    width: int = 1
    greedy: bool = True
    mode: Any = None


class GraphBackend(Protocol):
    """Capture and replay of one graph: ``capture`` runs ``fn`` ``warmup`` times, then records one
    call into ``pool`` and returns ``(graph, outputs)``; ``replayer(graph)`` is a call that runs it
    again, writing the same outputs (made once per graph: a replay is one call, nothing more)."""

    def new_pool(self) -> Any: ...

    def new_stream(self) -> Any: ...

    def capture(self, fn: Callable[[], Any], pool: Any, stream: Any, *, warmup: int, tidy: bool,
                what: str) -> tuple[Any, Any]: ...

    def replayer(self, graph: Any) -> Callable[[], None]: ...


def capture_graph(fn: Callable, device: torch.device, stream: torch.cuda.Stream, pool, what: str, *,
                  warmup: int = 1, tidy: bool = False):
    """``(graph, outputs)``: ``fn`` run ``warmup`` times on ``stream`` (first launches load kernels,
    set up library handles, compile a new shape), then captured into ``pool``; the current stream
    waits for it. ``tidy`` synchronizes, collects and empties the allocator's cache before the
    capture (what ``torch.cuda.graph`` does). A failure raises naming ``what``."""
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        if tidy:
            current.wait_stream(stream)
            torch.cuda.synchronize(device)
            gc.collect()
            torch.cuda.empty_cache()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                outputs = fn()
            except BaseException:
                # end the capture, but report what broke it: capture_end's own "capture invalidated"
                # error would otherwise replace the cause
                try:
                    graph.capture_end()
                except Exception:
                    pass
                raise
            graph.capture_end()
    except Exception as e:
        raise RuntimeError(f"tscompile: capturing {what} failed: {e}") from e
    current.wait_stream(stream)
    return graph, outputs


class CudaGraphs:
    """Raw ``torch.cuda.CUDAGraph`` capture and replay on ``device``."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"tscompile: CUDA graphs need a CUDA device, got {str(device)!r} (HostGraphs runs "
                             "the same bookkeeping without graphs)")
        self.device = device

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def capture(self, fn, pool, stream, *, warmup: int, tidy: bool, what: str):
        return capture_graph(fn, self.device, stream, pool, what, warmup=warmup, tidy=tidy)

    def replayer(self, graph: torch.cuda.CUDAGraph) -> Callable[[], None]:
        return graph.replay


class _HostGraph:
    __slots__ = ("fn", "outputs")

    def __init__(self, fn, outputs):
        self.fn, self.outputs = fn, outputs


class HostGraphs:
    """A graph's stand-in on any device: capture runs ``fn`` once and keeps its outputs; a replay runs
    ``fn`` again (over the same persistent inputs) and copies its tensors into those outputs, so the
    caller sees what a replayed CUDA graph gives it: the captured output tensors, rewritten. As on
    CUDA (warm-up, capture, replay), a key's first step runs its work more than once."""

    def new_pool(self):
        return None

    def new_stream(self):
        return None

    def capture(self, fn, pool, stream, *, warmup: int, tidy: bool, what: str):
        outputs = fn()
        return _HostGraph(fn, outputs), outputs

    def replayer(self, graph: _HostGraph) -> Callable[[], None]:
        def replay() -> None:
            new = graph.fn()
            if isinstance(graph.outputs, torch.Tensor):
                graph.outputs.copy_(new)
            elif isinstance(graph.outputs, (tuple, list)):
                for out, value in zip(graph.outputs, new):
                    if isinstance(out, torch.Tensor):
                        out.copy_(value)

        return replay


class _Entry:
    __slots__ = ("graph", "play", "outputs", "replays_counter")

    def __init__(self, graph, play: Callable[[], None], outputs, replays_counter: str):
        self.graph, self.play, self.outputs, self.replays_counter = graph, play, outputs, replays_counter


class GraphRunner:
    """Keys, buckets, capture, replay and the replay switch of one engine's step graphs.

    ``decode_ladder``: the batch sizes with a decode graph (a batch pads to the smallest size that
    holds it; above the ladder it runs at its own size, without one). ``token_ladder`` and
    ``request_ladder``: the buckets of a whole-step prefill graph. ``compile_seconds()`` is the
    owner's compile time so far: a capture's warm-up may compile, and that time is kept out of
    ``capture_seconds``. Counters: ``decode_captures``/``decode_replays`` and
    ``prefill_captures``/``prefill_replays`` (``tscompile.counters``)."""

    def __init__(self, backend: GraphBackend, *, decode_ladder: Iterable[int] = (), token_ladder: Iterable[int] = (),
                 request_ladder: Iterable[int] = (), compile_seconds: Callable[[], float] = lambda: 0.0):
        self.backend = backend
        self.replay = True  # the switch: False runs every step padded, without its graph
        self.decode_ladder = tuple(sorted(set(decode_ladder)))
        self.token_ladder = tuple(sorted(set(token_ladder)))
        self.request_ladder = tuple(sorted(set(request_ladder)))
        self.compile_seconds = compile_seconds
        self.graphs: dict[GraphKey, _Entry] = {}
        self.capture_seconds = {DECODE: 0.0, PREFILL: 0.0}
        self._pools: dict[str, tuple[Any, Any]] = {}
        self._guards: dict[GraphKey, tuple[dict, Callable[[], dict]]] = {}  # graph-debug snapshots
        # one key per (size, greedy, width), built once: a step looks its key up instead of building it
        self._decode_keys = {(bs, greedy, 1): GraphKey(DECODE, bs, bs, 1, greedy)
                             for bs in self.decode_ladder for greedy in (True, False)}

    # -- buckets and keys ----------------------------------------------------------------------------
    def decode_size(self, num_requests: int) -> int:
        """The padded batch of a decode step: the smallest ladder size >= ``num_requests``, or the
        count itself above the ladder."""
        return bucket(self.decode_ladder, num_requests) or num_requests

    def decode_key(self, batch_size: int, greedy: bool, width: int = 1) -> GraphKey | None:
        """The graph of a decode step padded to ``batch_size`` requests of ``width`` query rows each;
        None when the switch is off or the size is not on the ladder (the step runs without one)."""
        if not self.replay:
            return None
        key = self._decode_keys.get((batch_size, greedy, width))
        if key is None and width > 1 and batch_size in self.decode_ladder:  # a verify width's first step
            key = self._decode_keys[(batch_size, greedy, width)] = GraphKey(DECODE, batch_size, batch_size * width,
                                                                           width, greedy)
        return key

    def prefill_size(self, num_tokens: int, num_requests: int) -> tuple[int, int] | None:
        """``(tokens, requests)`` buckets of a whole prefill step, or None above either ladder."""
        tokens = bucket(self.token_ladder, num_tokens)
        requests = bucket(self.request_ladder, num_requests)
        if tokens is None or requests is None:
            return None
        return tokens, min(requests, tokens)  # never more requests than token rows

    def prefill_key(self, tokens: int, requests: int, greedy: bool, mode) -> GraphKey:
        return GraphKey(PREFILL, requests, tokens, 1, greedy, mode)

    # -- capture and replay --------------------------------------------------------------------------
    def pool(self, phase: str) -> tuple[Any, Any]:
        """``(memory pool, capture stream)`` of ``phase``, made on first use."""
        found = self._pools.get(phase)
        if found is None:
            found = self._pools[phase] = (self.backend.new_pool(), self.backend.new_stream())
        return found

    def captured(self, key: GraphKey) -> bool:
        return key in self.graphs

    def capture(self, key: GraphKey, step: Callable[[], Any], *, prepare: Callable[[], None] | None = None,
                warmup: int = 1, tidy: bool = False, guard_roots: Callable[[], dict] | None = None) -> Any:
        """Capture ``step`` as ``key``'s graph: ``prepare()`` first (the idle inputs: every row a
        padding row, so warm-up and capture write only the null page), then ``warmup`` runs and the
        capture into the phase's pool. ``guard_roots()`` names what the graph reads, for graph-debug
        mode. Returns the graph's outputs."""
        start, compiled_before = time.perf_counter(), self.compile_seconds()
        if prepare is not None:
            prepare()
        pool, stream = self.pool(key.phase)
        graph, outputs = self.backend.capture(step, pool, stream, warmup=warmup, tidy=tidy, what=f"the {key}")
        first = not any(k.phase == key.phase for k in self.graphs)
        self.graphs[key] = _Entry(graph, self.backend.replayer(graph), outputs, f"{key.phase}_replays")
        counters[f"{key.phase}_captures"] += 1
        if guard_roots is not None and pointer_guard.graph_debug_enabled():
            self._guards[key] = (pointer_guard.snapshot(guard_roots()), guard_roots)
        # a warm-up that compiles spends compile time, not capture time
        compiled = self.compile_seconds() - compiled_before
        seconds = time.perf_counter() - start - compiled
        self.capture_seconds[key.phase] += seconds
        if first:
            logger.info("tscompile: captured the first %s graph %s in %.2f s (and compiled its step in %.2f s); "
                        "each new key captures once", key.phase, tuple(key[1:]), seconds, compiled)
        return outputs

    def replay_graph(self, key: GraphKey) -> Any:
        """Replay ``key``'s graph; returns its outputs (the tensors its capture wrote, rewritten)."""
        entry = self.graphs[key]
        if self._guards:
            expected, roots = self._guards[key]
            pointer_guard.verify(expected, roots())
        entry.play()
        counters[entry.replays_counter] += 1
        return entry.outputs

    def run(self, key: GraphKey | None, step: Callable[[], Any], **capture_args) -> Any:
        """``key``'s graph (captured on its first use), or ``step()`` itself when ``key`` is None or
        the switch is off."""
        if key is None or not self.replay:
            return step()
        if key not in self.graphs:
            self.capture(key, step, **capture_args)
        return self.replay_graph(key)

    def capture_all(self, phase: str, items: list, capture_one: Callable[[Any], None], device: torch.device) -> dict:
        """Start-up capture: ``capture_one(item)`` for each item, with a progress bar
        ("Capturing CUDA graphs (phase)") and a log line before and after; returns what it took:
        ``seconds`` (all of it), ``compile_seconds`` (the part spent compiling) and ``gib`` (device
        memory taken, 0 off CUDA)."""
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            free_before = torch.cuda.mem_get_info(device)[0]
        captures_before = counters[f"{phase}_captures"]
        start, compiled_before = time.perf_counter(), self.compile_seconds()
        logger.info("tscompile: capturing %s graphs (%d %s) ...", phase, len(items),
                    "sizes" if phase == DECODE else "placeholder steps")
        for item in tqdm(items, desc=f"Capturing CUDA graphs ({phase})", disable=None):
            capture_one(item)
        gib = 0.0
        if cuda:
            torch.cuda.synchronize(device)
            gib = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**30
        seconds, compiled = time.perf_counter() - start, self.compile_seconds() - compiled_before
        logger.info("tscompile: captured %d %s graphs in %.1f s (compiling %.1f s apart)",
                    counters[f"{phase}_captures"] - captures_before, phase, seconds - compiled, compiled)
        return {"seconds": seconds, "compile_seconds": compiled, "gib": gib}
