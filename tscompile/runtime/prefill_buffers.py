"""The persistent inputs of whole-step prefill graphs, per (token, request) bucket.

A whole-step graph (``GraphRunner``, key ``GraphKey("prefill", requests, tokens, 1, greedy, mode)``)
holds every compiled piece, every attention break and the sampler of a step padded to ``T`` token
rows and ``R`` requests; replaying it costs one launch instead of a replay per piece plus the eager
breaks. Why a request bucket: the extend kernel's grid (``cdiv(T, BLOCK_M) + R`` programs) and the
LM head's rows depend on the request count, and a graph fixes every shape it was captured with.

A captured graph reads its inputs at the addresses of its capture, so each bucket owns its buffers
(``ExtendBuffers``): token ids, positions, logits rows, the query offsets and ``completes`` the
forward context carries, and per cache group the page table, KV lengths, query offsets and write
slots. One byte arena holds a bucket's buffers (typed views, each dtype's together), mirrored by a
pinned host arena with the same layout: a step writes its padded arrays straight into the host
views (no intermediate arrays, no packing) and sends the arena in one copy, into the arena its
graph reads. The sampler's inputs already live in the decode staging (persistent).

Padding (``AttentionRouter.fill_extend_host_arrays``): token rows past the live ones are token 0 at
position 0 writing slot 0, the null page; request rows past the live ones have a null page-table
row, KV length 0 and an empty query range, so the kernels give them no work; their logits row is 0
and their sample lands in rows of the sampled-token buffer nobody reads.

Safety: a step's buffers are rewritten only by a later step of the same bucket, and the engine
never launches an extend or mixed step while another step is in flight (``can_chain``); a bucket's
pinned staging is rewritten only after the event of its last copy. All graphs share one memory
pool: they never run at the same time and nothing a graph leaves in the pool is read after its
replay (the sample is copied out of the sampled-token buffer, which is not pool memory).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tscompile.runtime.arena import arena_places, typed_views


class ExtendBuffers:
    """The persistent device inputs of one ``(tokens, requests)`` bucket and their host staging:
    ``tensors[i]`` (device) and ``host[i]`` (numpy, pinned on CUDA) have the shape and dtype of
    entry ``i`` of the bucket's layout. Both are typed views into one byte arena, at the same
    offsets (``arena_places``), so a step writes its arrays straight into ``host`` and ``send``
    moves the whole arena in one copy (a copy launch costs microseconds of host time: one per
    step, not one per dtype)."""

    def __init__(self, layout: list[tuple[tuple[int, ...], np.dtype]], device: torch.device, *, pin: bool):
        starts, nbytes = arena_places(layout)
        # the staging of one bucket is as large as its device buffers (a few KB to a few MB)
        self.host_arena = torch.zeros(nbytes, dtype=torch.uint8)
        if pin:
            self.host_arena = self.host_arena.pin_memory()
        self.arena = self.host_arena.to(device, copy=True)
        self.tensors: list[torch.Tensor] = typed_views(self.arena, layout, starts)
        self.host: list[np.ndarray] = typed_views(self.host_arena.numpy(), layout, starts)
        self.sent: torch.cuda.Event | None = None  # recorded after the last copy out of ``host``

    def send(self, non_blocking: bool) -> None:
        """Copy the staging to the device buffers, in one copy."""
        self.arena.copy_(self.host_arena, non_blocking=non_blocking)


class WholeStepBuffers:
    """The ``ExtendBuffers`` of each bucket, made on first use. ``layout(tokens, requests)``: shape and
    dtype of each input array of a step of that bucket. On CUDA the host staging is pinned and its
    copy is asynchronous (an event per bucket says when the staging may be written again)."""

    def __init__(self, device: torch.device, layout: Callable[[int, int], list[tuple[tuple[int, ...], np.dtype]]]):
        self.device, self.layout = device, layout
        self.cuda = device.type == "cuda"
        self.buffers: dict[tuple[int, int], ExtendBuffers] = {}

    def stage(self, size: tuple[int, int], fill: Callable[[list[np.ndarray]], None]) -> list[torch.Tensor]:
        """One step's inputs into bucket ``size``'s persistent buffers: ``fill`` writes every element
        of the bucket's host staging (arrays shaped as ``layout(*size)``), which then goes up in one
        copy. Returns the device buffers."""
        buf = self.buffers.get(size)
        if buf is None:
            buf = self.buffers[size] = ExtendBuffers(self.layout(*size), self.device, pin=self.cuda)
        if buf.sent is not None:
            buf.sent.synchronize()  # the last copy out of this staging has been sent
        fill(buf.host)
        buf.send(non_blocking=self.cuda)
        if self.cuda:
            if buf.sent is None:  # one event per bucket, re-recorded: its last record was waited for above
                buf.sent = torch.cuda.Event()
            # the copy's stream, not the current device's; the arena's device carries its index (an
            # index-less device costs a lookup of the current device through availability checks)
            buf.sent.record(torch.cuda.current_stream(buf.arena.device))
        return buf.tensors
