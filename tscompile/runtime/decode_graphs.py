"""Decode CUDA graphs: one ``torch.cuda.CUDAGraph`` per ladder size and sampling variant (an
all-greedy batch skips the vocabulary sort) around the compiled decode step.

``DecodeGraphRunner`` answers the runner's questions (which padded size a batch runs at, whether a
graph exists for it) and captures and replays. Why raw graphs and not CUDA-graph trees: a decode
loop that reads its tokens every step pays the trees' host work on every replay (roughly 90-100 us
measured on an H200, see bench/results/README.md); a raw graph replay costs a few microseconds.
All sizes share one memory pool and are captured largest first.

What this does not do: it computes no metadata (the runner's refresh rewrites the persistent
buffers the graphs read before each replay), stages no inputs and copies no outputs (the sampling
op writes the persistent token buffer inside the graph).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from tscompile.counters import counters
from tscompile.runtime import pointer_guard
from tscompile.utils import bucket

logger = logging.getLogger("tscompile")

GraphKey = tuple[int, bool]  # (padded batch size, all greedy)


class DecodeGraphRunner:
    """``prepare_capture(bs)`` runs the idle refresh and resets the static inputs of ``bs`` rows;
    ``run_step(bs, greedy)`` runs the compiled step over them (the captured work);
    ``guard_roots()`` names every metadata object a graph reads, for the graph-debug pointer guard;
    ``compile_seconds()`` is the runner's compile time so far, kept out of the capture time."""

    def __init__(self, device: torch.device, ladder: tuple[int, ...], *, prepare_capture: Callable[[int], None],
                 run_step: Callable[[int, bool], None], guard_roots: Callable[[], dict[str, Any]],
                 compile_seconds: Callable[[], float]):
        self.device = device
        self.ladder = tuple(sorted(ladder))
        self._prepare_capture, self._run_step, self._guard_roots = prepare_capture, run_step, guard_roots
        self._compile_seconds = compile_seconds
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._guards: dict[GraphKey, dict] = {}  # graph-debug snapshots per captured graph
        self.capture_seconds = 0.0
        self.replay_graphs = True  # False: pad and refresh as usual, run the step without its graph (tests)

    def padded_size(self, actual_bs: int) -> int:
        """The smallest ladder size >= ``actual_bs``; above the ladder, ``actual_bs`` (no graph)."""
        return bucket(self.ladder, actual_bs) or actual_bs

    def covers(self, bs: int) -> bool:
        """Whether a batch padded to ``bs`` replays a graph (captured now or on first use)."""
        return self.replay_graphs and bs in self.ladder

    def captured(self, key: GraphKey) -> bool:
        return key in self.graphs

    def capture(self, key: GraphKey, warmup: int = 2) -> None:
        """Record the step of ``key``'s size: the idle refresh (every row padding, placeholder
        tables), then warm-up runs and the capture, all on a side stream into the shared pool."""
        start, compiled_before = time.perf_counter(), self._compile_seconds()
        bs, greedy = key
        self._prepare_capture(bs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # compiles (first size only) and settles lazy allocations
                self._run_step(bs, greedy)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self._run_step(bs, greedy)
        self.graphs[key] = graph
        counters["decode_captures"] += 1
        if pointer_guard.graph_debug_enabled():
            self._guards[key] = pointer_guard.snapshot(self._guard_roots())
        # the warm-up of a size's first variant compiles: that is compile time, not capture time
        self.capture_seconds += time.perf_counter() - start - (self._compile_seconds() - compiled_before)

    def capture_ladder(self) -> None:
        """Capture the greedy variant of every ladder size, largest first; logs one stable line."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start, compiled_before = time.perf_counter(), self._compile_seconds()
        for bs in tqdm(sorted(self.ladder, reverse=True), desc="Capturing CUDA graphs (decode)", disable=None):
            self.capture((bs, True))
        torch.cuda.synchronize(self.device)
        took = (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30
        # the first sizes' warm-ups compile: said apart, or a minute of compile reads as capture time
        logger.info("Graph capturing finished in %.0f s (compiling %.0f s of it), took %.2f GiB",
                    time.perf_counter() - start, self._compile_seconds() - compiled_before, took)

    def replay(self, key: GraphKey) -> None:
        if self._guards:
            pointer_guard.verify(self._guards[key], self._guard_roots())
        self.graphs[key].replay()
        counters["decode_replays"] += 1
