"""Decode CUDA graphs: one ``torch.cuda.CUDAGraph`` per ladder size (and sampling variant: all-greedy
batches skip the vocabulary sort) around the compiled decode step.

Why not CUDA-graph trees: a decode loop that reads its tokens every step pays the trees' host work
per replay (about 90-100 us measured on the H200), which alone would miss the small-model targets;
a raw graph replay costs a few microseconds. All sizes share one memory pool, captured largest
first.

What this does not do: it computes no metadata (``refresh_decode_metadata`` rewrites the
persistent buffers the graphs read before each replay) and copies no outputs (the sampling op
writes the persistent token buffer inside the graph).
"""

from __future__ import annotations

from typing import Callable

import torch


class DecodeGraphs:
    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bs, all_greedy)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, key: tuple[int, bool], run_step: Callable[[], None], warmup: int = 2) -> None:
        """``run_step`` runs the compiled step over the static buffers of batch ``key[0]``."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # compiles (first size only) and settles lazy allocations
                run_step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            run_step()
        self.graphs[key] = graph

    def __contains__(self, key) -> bool:
        """``bs in graphs``: some variant of ``bs`` is captured; ``(bs, greedy) in graphs``: that one."""
        if isinstance(key, tuple):
            return key in self.graphs
        return any(bs == key for bs, _ in self.graphs)

    def replay(self, key: tuple[int, bool]) -> None:
        self.graphs[key].replay()
