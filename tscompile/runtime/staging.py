"""Decode-step inputs with a fixed layout: filled on the host, uploaded in one copy per dtype.

Every per-step host fact of a decode (token ids, where a token still on the device lives, positions,
lengths, block tables, sampling parameters) lands in pinned host buffers at fixed offsets: one int64,
one int32 and one float32 region of a single byte arena, so one non-blocking copy moves them all to
the persistent device arena of the same layout (a copy launch costs microseconds of host time). The
device views are what the refresh reads and what the captured graphs read (token ids, positions,
sampling parameters), so their addresses never move.

There are two host sets, used in turn: with asynchronous scheduling the host fills step N + 1
while step N's upload may still be queued behind step N - 1 on the stream, so one set would be
overwritten before it was read. In the engine's order step N - 1, which used the set step N + 1
writes, has finished by then; an event per set makes that hold for any caller (a failed launch, a
direct runner call), at the cost of one completed-event check per step.
"""

from __future__ import annotations

import numpy as np
import torch

from tscompile.attention.router import DecodeInputs
from tscompile.runtime.arena import Layout, arena_places, typed_views
from tscompile.sampling import SamplingInputs
from tscompile.step_plan import SamplingRows, StepPlan, put_rows

_DTYPES = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32))


def _layout(sizes: tuple[int, int, int]) -> Layout:
    """The staging's one int64, one int32 and one float32 region, in that order."""
    return [((n,), dt) for n, dt in zip(sizes, _DTYPES)]


class _HostSet:
    def __init__(self, sizes: tuple[int, int, int], pin: bool):
        starts, nbytes = arena_places(_layout(sizes))
        self.arena = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.h64, self.h32, self.hf = typed_views(self.arena, _layout(sizes), starts)
        self.n64, self.n32, self.nf = self.h64.numpy(), self.h32.numpy(), self.hf.numpy()
        # recorded after this set's upload; waited for before the set is written again
        self.uploaded = torch.cuda.Event() if pin else None
        self.used = False


class DecodeStaging:
    """``max_width``: the widest verify window a step stages (1 without speculation): token ids and
    positions hold ``max_bs * max_width`` rows, and a verify step's drafts ``max_bs * (max_width - 1)``
    ids at the end of the int64 region (none at width 1, where the layout is the plain decode's)."""

    def __init__(self, max_bs: int, num_groups: int, max_blocks: int, banned_width: int, device: torch.device,
                 max_width: int = 1):
        self.max_bs, self.num_groups, self.max_blocks, self.banned_width = max_bs, num_groups, max_blocks, banned_width
        self.max_width = max_width
        pin = device.type == "cuda"
        b, rows = max_bs, max_bs * max_width
        # int64: ids, positions [rows] each; seeds, steps, prev_rows [b] each; banned ids [b, banned_width];
        # drafts [b * (max_width - 1)]
        # int32: per group seq lens [G, b] and block tables [G, b, max_blocks]; top_k [b]
        self._positions_at = rows
        self._seeds_at, self._steps_at, self._prev_at = 2 * rows, 2 * rows + b, 2 * rows + 2 * b
        self._banned_at = 2 * rows + 3 * b
        self._drafts_at = self._banned_at + b * banned_width
        self._tables_at = num_groups * b
        self._topk_at = self._tables_at + num_groups * b * max_blocks
        # float32: temperature, top_p
        sizes = (self._drafts_at + b * (max_width - 1), self._topk_at + b, 2 * b)
        self._sets = [_HostSet(sizes, pin), _HostSet(sizes, pin)]
        self._turn = 0
        self.arena = self._sets[0].arena.to(device, copy=True)
        layout = _layout(sizes)
        self.d64, self.d32, self.df = typed_views(self.arena, layout, arena_places(layout)[0])

        self.input_ids, self.positions = self.d64[:rows], self.d64[rows:2 * rows]
        # row of the sampled-token buffer that holds this row's input token (the previous step's
        # sample, still on the device), or -1: the token is input_ids'
        self.prev_rows = self.d64[self._prev_at:self._prev_at + b]
        self.drafts = self.d64[self._drafts_at:]  # a verify step's drafts, request-major, -1 padded
        # the sampling op's inputs are views of this staging: the decode upload writes them
        self.sampling_inputs = SamplingInputs(temperature=self.df[:b], top_k=self.d32[self._topk_at:],
                                              top_p=self.df[b:], seeds=self.d64[self._seeds_at:self._steps_at],
                                              steps=self.d64[self._steps_at:self._prev_at],
                                              banned=self.d64[self._banned_at:self._drafts_at].view(b, banned_width))
        self._decode_inputs: dict[int, DecodeInputs] = {}

    def decode_inputs(self, n: int, plan: StepPlan | None = None) -> DecodeInputs:
        """The staged block tables and seq lens of the first ``n`` rows, per group (views); with
        ``plan``, also the plan's host arrays of the same rows (host planners read those: FlashInfer).
        The host arrays are read during the refresh only, so the plan's own arrays serve."""
        inputs = self._decode_inputs.get(n)
        if inputs is None:
            b, mb = self.max_bs, self.max_blocks
            tables = tuple(self.d32[self._tables_at + g * b * mb: self._tables_at + g * b * mb + n * mb].view(n, mb)
                           for g in range(self.num_groups))
            lens = tuple(self.d32[g * b: g * b + n] for g in range(self.num_groups))
            inputs = self._decode_inputs[n] = DecodeInputs(tables, lens)
        if plan is None:
            return inputs
        groups = plan.groups
        # the device views with the step's host arrays (``with_host_rows`` without its tuple copies)
        return DecodeInputs(inputs.block_tables, inputs.seq_lens, tuple([g.block_tables for g in groups]),
                            tuple([g.seq_lens for g in groups]), host_state_slots=plan.state_slots)

    def fill(self, plan: StepPlan, bs: int, prev_rows=None, *, pad_tables: bool = False) -> None:
        """Host-side writes for the plan's ``n`` decode rows; rows ``[n, bs)`` become padding
        (greedy, token 0, position 0). ``prev_rows`` (default all -1) says which rows take their
        token from the device; a row whose plan id is ``ON_DEVICE`` must have one. ``pad_tables``:
        the padding rows' block tables and lengths become the null block and 0 too (for a reader
        that takes the tables as they are; the engine's refresh pads those rows itself)."""
        n, b = plan.num_requests, self.max_bs
        host = self._writable_set()
        n64, n32 = host.n64, host.n32
        if plan.tokens_on_device.shape[0]:  # an ON_DEVICE id is replaced on the device (prev_rows): 0 here
            np.maximum(plan.input_ids, 0, out=n64[:n])
            if bs > n:
                n64[n:bs] = 0
        else:
            put_rows(n64, 0, plan.input_ids, n, bs, 0)
        put_rows(n64, self._positions_at, plan.positions, n, bs, 0)
        put_rows(n64, self._prev_at, -1 if prev_rows is None else prev_rows, n, bs, -1)
        live = bs if pad_tables else n
        mb = self.max_blocks
        for g, group in enumerate(plan.groups):  # inline, not _fill_tables: a call costs on every step
            put_rows(n32, g * b, group.seq_lens, n, live, 0)
            # block 0 is the null block (the allocator never hands it out)
            put_rows(n32, self._tables_at + g * b * mb, group.block_tables.reshape(-1), n * mb, live * mb, 0)
        self._fill_sampling(host, plan.sampling, bs)

    def fill_verify(self, plan: StepPlan, bs: int, *, pad_tables: bool = False) -> None:
        """A verify step's host writes (``plan.verify_width`` = N > 1): ``n * N`` token ids and
        positions, the drafts, tables, lengths and sampling rows; requests ``[n, bs)`` are padding
        (token 0 at position 0, no drafts). Every input token is on the host (a verify step waits
        for the step before it). ``pad_tables`` as for ``fill``."""
        n, width = plan.num_requests, plan.verify_width
        host = self._writable_set()
        n64 = host.n64
        k = width - 1
        put_rows(n64, 0, plan.input_ids, n * width, bs * width, 0)
        put_rows(n64, self._positions_at, plan.positions, n * width, bs * width, 0)
        put_rows(n64, self._drafts_at, plan.draft_tokens.reshape(-1), n * k, bs * k, -1)
        self._fill_tables(host, plan, bs if pad_tables else n)
        self._fill_sampling(host, plan.sampling, bs)

    def _fill_tables(self, host: _HostSet, plan: StepPlan, live: int) -> None:
        """A verify step's tables and lengths (``fill`` writes a plain step's inline)."""
        n, b, mb, n32 = plan.num_requests, self.max_bs, self.max_blocks, host.n32
        for g, group in enumerate(plan.groups):
            put_rows(n32, g * b, group.seq_lens, n, live, 0)
            put_rows(n32, self._tables_at + g * b * mb, group.block_tables.reshape(-1), n * mb, live * mb, 0)

    def zero_tables(self, bs: int) -> None:
        """Rows ``[0, bs)`` of every group's staged block tables and lengths become the null block and
        0 on the device (the inputs of a refresh over ``bs`` padding rows, before a capture)."""
        b, mb = self.max_bs, self.max_blocks
        for g in range(self.num_groups):
            self.d32[g * b: g * b + bs].zero_()
            self.d32[self._tables_at + g * b * mb: self._tables_at + g * b * mb + bs * mb].zero_()

    def fill_sampling(self, rows: SamplingRows, bs: int | None = None) -> None:
        """An extend or mixed step's sampling rows (the sampling op reads these buffers in every
        step), rows past them up to ``bs`` padding; the next ``upload`` sends them. The step's other
        decode fields go up stale and unread: every decode step rewrites all of them."""
        self._fill_sampling(self._writable_set(), rows, rows.seeds.shape[0] if bs is None else bs)

    def _writable_set(self) -> _HostSet:
        host = self._sets[self._turn]
        if host.used:
            host.uploaded.synchronize()
        return host

    def _fill_sampling(self, host: _HostSet, rows: SamplingRows, bs: int) -> None:
        """Rows ``[n, bs)`` become padding: greedy, nothing banned."""
        n, b, k = rows.seeds.shape[0], self.max_bs, self.banned_width
        n64, n32, nf = host.n64, host.n32, host.nf
        put_rows(n64, self._seeds_at, rows.seeds, n, bs, 0)
        put_rows(n64, self._steps_at, rows.steps, n, bs, 0)
        put_rows(n64, self._banned_at, rows.banned.reshape(-1), n * k, bs * k, -1)
        put_rows(n32, self._topk_at, rows.top_k, n, bs, 1)
        put_rows(nf, 0, rows.temperature, n, bs, 0.0)
        put_rows(nf, b, rows.top_p, n, bs, 1.0)

    def upload(self) -> None:
        host = self._sets[self._turn]
        self.arena.copy_(host.arena, non_blocking=True)
        if host.uploaded is not None:
            host.uploaded.record(torch.cuda.current_stream(self.arena.device))
            host.used = True
        self._turn ^= 1
