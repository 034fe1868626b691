"""Whole-step prefill CUDA graphs: one graph around an entire extend or mixed step.

One graph per key ``(token bucket T, request bucket R, all greedy, mode)`` holds every compiled
piece, every attention break and the sampler of a step padded to ``T`` token rows and ``R``
requests; replaying it costs one launch instead of a replay per piece plus the eager breaks.

Why a request bucket: the extend kernel's grid (``cdiv(T, BLOCK_M) + R`` programs) and the LM head's
rows depend on the request count, and a graph fixes every shape it was captured with.

Persistent inputs. A captured graph reads its inputs at the addresses of its capture, so each
bucket owns its buffers (``ExtendBuffers``): token ids, positions, logits rows, the query offsets
and ``completes`` the forward context carries, and per cache group the page table, KV lengths,
query offsets and write slots. One arena per dtype holds a bucket's buffers; a step packs its
padded host arrays into pinned memory and sends them in one copy per dtype, into the arena its
graph reads. The sampler's inputs already live in the decode staging (persistent).

Padding (``AttentionRouter.extend_host_arrays``): token rows past the live ones are token 0 at
position 0 writing slot 0, the null page; request rows past the live ones have a null page-table
row, KV length 0 and an empty query range, so the kernels give them no work; their logits row is 0
and their sample lands in rows of the sampled-token buffer nobody reads.

Safety: a step's buffers are rewritten only by a later step of the same bucket, and the engine
never launches an extend or mixed step while another step is in flight (``can_chain``); the pinned
staging is reused only after the event of its last copy. All graphs share one memory pool: they
never run at the same time and nothing a graph leaves in the pool is read after its replay (the
sample is copied out of the sampled-token buffer, which is not pool memory).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import numpy as np
import torch

from tscompile.counters import counters
from tscompile.runtime.piece_graphs import capture_graph
from tscompile.utils import UPLOAD_ALIGN_BYTES, bucket

logger = logging.getLogger("tscompile")

GraphKey = tuple  # (tokens, requests, all_greedy, mode)


class ExtendBuffers:
    """The persistent device inputs of one ``(tokens, requests)`` bucket: ``tensors[i]`` has the
    shape and dtype of host array ``i`` of every step of that bucket (views into per-dtype arenas)."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], np.dtype]], device: torch.device):
        # (array index, start, numel, shape) per dtype; numel kept: np.prod per array per step showed
        # up in the host profile of a prefill (about 10 us a call)
        self.layout: dict[np.dtype, list[tuple[int, int, int, tuple[int, ...]]]] = {}
        sizes: dict[np.dtype, int] = {}
        for i, (shape, dtype) in enumerate(shapes):
            step = max(1, UPLOAD_ALIGN_BYTES // dtype.itemsize)  # aligned views: see utils.upload
            start = sizes.get(dtype, 0)
            numel = math.prod(shape)
            self.layout.setdefault(dtype, []).append((i, start, numel, shape))
            sizes[dtype] = start + -(-max(numel, 1) // step) * step
        self.arenas = {dt: torch.from_numpy(np.zeros(n, dtype=dt)).to(device) for dt, n in sizes.items()}
        self.tensors: list[torch.Tensor] = [None] * len(shapes)
        for dt, entries in self.layout.items():
            for i, start, numel, shape in entries:
                self.tensors[i] = self.arenas[dt][start: start + numel].view(shape)


class WholeStepPrefill:
    """Buckets, buffers and graphs of whole-step prefill.

    ``host_replay=True`` runs the step over the persistent buffers instead of replaying a graph: the
    same padding and buffers, testable where no CUDA device exists."""

    def __init__(self, device: torch.device, token_ladder: tuple[int, ...], request_ladder: tuple[int, ...], *,
                 host_replay: bool = False, compile_seconds: Callable[[], float] = lambda: 0.0):
        self.device = device
        # the runner's compile time so far: a first step compiles inside its capture's warm-up, and
        # that time is the compile column's, not the capture's
        self._compile_seconds = compile_seconds
        self.token_ladder = token_ladder
        self.request_ladder = request_ladder
        self.host_replay = host_replay
        self.buffers: dict[tuple[int, int], ExtendBuffers] = {}
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph | None] = {}
        self.capture_seconds = 0.0
        self.replay = True  # False: keep the padding and buffers, run the step without its graph (tests)
        self._pinned: dict[np.dtype, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None
        if not host_replay:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)

    def bucket_of(self, num_tokens: int, num_requests: int) -> tuple[int, int] | None:
        """``(T, R)`` of a step, or None above either ladder (the step runs without this graph)."""
        tokens = bucket(self.token_ladder, num_tokens)
        requests = bucket(self.request_ladder, num_requests)
        if tokens is None or requests is None:
            return None
        return tokens, min(requests, tokens)  # never more requests than token rows

    def stage(self, size: tuple[int, int], arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Send one step's padded host arrays into its bucket's persistent buffers (one copy per
        dtype); returns those buffers."""
        buf = self.buffers.get(size)
        if buf is None:
            buf = self.buffers[size] = ExtendBuffers([(a.shape, a.dtype) for a in arrays], self.device)
        for i, a in enumerate(arrays):
            if buf.tensors[i].shape != a.shape:
                raise RuntimeError(f"tscompile: whole-step prefill input {i} of bucket {size} has shape {a.shape}, "
                                   f"its buffer {tuple(buf.tensors[i].shape)}")
        if self._copied is not None:
            self._copied.synchronize()  # the pinned staging of the last step has been sent
        for dt, entries in buf.layout.items():
            arena = buf.arenas[dt]
            host = self._host(dt, arena.numel())
            flat = host.numpy()
            for i, start, numel, _ in entries:
                flat[start: start + numel] = np.asarray(arrays[i]).reshape(-1)
            arena.copy_(host, non_blocking=not self.host_replay)
        if not self.host_replay:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return buf.tensors

    def _host(self, dtype: np.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of this dtype's staging (pinned on CUDA), grown on demand."""
        host = self._pinned.get(dtype)
        if host is None or host.numel() < numel:
            host = torch.from_numpy(np.zeros(numel, dtype=dtype))
            self._pinned[dtype] = host if self.host_replay else host.pin_memory()
        return self._pinned[dtype][:numel]

    def run(self, key: GraphKey, step: Callable[[], None]) -> None:
        """Replay ``key``'s graph, capturing it first if this is the key's first step."""
        if self.host_replay or not self.replay:
            if key not in self.graphs:
                self.graphs[key] = None
                counters["prefill_captures"] += 1
            step()
        else:
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(key, step)
                counters["prefill_captures"] += 1
            graph.replay()
        counters["prefill_replays"] += 1

    def _capture(self, key: GraphKey, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        start, compiled_before = time.perf_counter(), self._compile_seconds()
        graph, _ = capture_graph(step, self.device, self.stream, self.pool, f"the whole prefill step {key}")
        compiled = self._compile_seconds() - compiled_before
        seconds = time.perf_counter() - start - compiled
        self.capture_seconds += seconds
        if len(self.graphs) == 0:
            logger.info("tscompile: captured the first whole-step prefill graph %s in %.2f s (and compiled its "
                        "step in %.2f s); each new (tokens, requests) bucket captures once", key[:2], seconds, compiled)
        return graph
