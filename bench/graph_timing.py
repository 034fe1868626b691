"""GPU time of a callable replayed as one CUDA graph, for kernel timings (the GEMV tests and
launch sweeps): replays leave out the host's per-launch cost, which would
otherwise dominate kernels of a few microseconds."""

from __future__ import annotations

from typing import Callable

import torch


def capture_graph(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``run`` as one CUDA graph, replayed once. A first call on a side stream keeps Triton's compiles
    and the allocator's first blocks out of the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Microseconds per replay, ``reps`` replays back to back between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3
