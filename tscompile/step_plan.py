"""One step, decided: the immutable plan the scheduler hands to a runner.

A neutral module (it imports no runner, attention backend or model). The scheduler builds one
``StepPlan`` per step (``runtime/scheduler.py``); the engine, the runners and the attention router
read it; nothing reads the scheduler back. Every array lives on the host (numpy): runners upload
what their kernels read, and host planners (FlashInfer's ``plan()``) read the host arrays directly.

Rows are request-major: the extend requests' chunks first, then one row per decode request.
Which chunk completes its prompt, and so which rows the narrowing keeps, is decided here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.slots import slot_from_block_rows

def row_offsets(lens: np.ndarray) -> np.ndarray:
    """``[B] -> [B + 1]`` int32 exclusive prefix sums: request b's rows are ``[out[b], out[b + 1])``."""
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


ON_DEVICE = -1  # an input id the host has not read yet: the previous step's sample, still on the device


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """One cache group's view of a step.

    query_lens:   [B] int32  rows each request contributes to this group's layers (the narrowing
                             model's tail group sees only the kept rows)
    seq_lens:     [B] int32  the group's KV length of each request after this step
    block_tables: [B, max_blocks] int32  the scheduler's block ids; 0 is the null block
    block_size:   tokens per block
    """

    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    block_size: int

    @property
    def num_rows(self) -> int:
        return int(self.query_lens.sum())

    @cached_property
    def qo_indptr(self) -> np.ndarray:
        """[B + 1] int32: request b's rows are ``qo_indptr[b]:qo_indptr[b + 1]``."""
        return row_offsets(self.query_lens)

    @cached_property
    def positions(self) -> np.ndarray:
        """[rows] int64: each row's position in its request's sequence of this group."""
        q = self.query_lens.astype(np.int64)
        req = np.repeat(np.arange(q.shape[0]), q)
        return (self.seq_lens.astype(np.int64) - q)[req] + np.arange(req.shape[0]) - self.qo_indptr[:-1][req]

    @cached_property
    def write_slots(self) -> np.ndarray:
        """[rows] int64: the KV slot each row writes, ``table[req, pos // block] * block + pos % block``."""
        req = np.repeat(np.arange(self.query_lens.shape[0]), self.query_lens.astype(np.int64))
        return slot_from_block_rows(self.block_tables, req, self.positions, self.block_size)


@dataclass(frozen=True, eq=False)
class SamplingRows:
    """Per request: temperature [B] f32, top_k [B] i32, top_p [B] f32, seed [B] i64, step [B] i64
    (the position its token will take, which with the seed fixes its random draw) and banned [B, K]
    i64 (token ids it may not sample this step: eos and stop ids before ``min_tokens``; -1 pads)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    banned: np.ndarray
    all_greedy: bool  # a host fact: an all-greedy batch skips the vocabulary sort


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything one step reads, decided on the host before anything launches.

    request_ids: [B] ids, in row order; the first ``num_extends`` extend, the rest decode.
    input_ids:   [T] int64 token ids; ``ON_DEVICE`` (-1) for a decode row whose input token is the
                 previous step's sample that the host has not read (the runner gathers it on the device).
    positions:   [T] int64 true positions (RoPE).
    query_lens:  [B] int32 input rows per request; prefix_lens: [B] int32 tokens cached before this step.
    completes:   [B] bool  the chunk completes its prompt (decode rows: False).
    emits:       [B] bool  this step's sample becomes an output token (an open chunk's is discarded).
    groups:      per cache group, its ``GroupPlan``.
    logits_rows: [B] int64 the row of each request's sample among the last layer's rows.
    """

    mode: ForwardMode
    request_ids: tuple[int, ...]
    num_extends: int
    input_ids: np.ndarray
    positions: np.ndarray
    query_lens: np.ndarray
    prefix_lens: np.ndarray
    completes: np.ndarray
    emits: np.ndarray
    groups: tuple[GroupPlan, ...]
    logits_rows: np.ndarray
    sampling: SamplingRows

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decodes(self) -> int:
        return self.num_requests - self.num_extends

    @cached_property
    def qo_indptr(self) -> np.ndarray:
        """[B + 1] int32 offsets of the requests among the input rows."""
        return row_offsets(self.query_lens)

    @property
    def tokens_on_device(self) -> np.ndarray:
        """Indices of the rows whose input id is ``ON_DEVICE``."""
        return np.flatnonzero(self.input_ids == ON_DEVICE)
