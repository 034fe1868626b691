"""One step, decided: the immutable plan the scheduler hands to a runner.

A neutral module (it imports no runner, attention backend or model). The scheduler builds one
``StepPlan`` per step (``runtime/step_builder.py``); the engine, the runners and the attention router
read it; nothing reads the scheduler back. Every array lives on the host (numpy): runners upload
what their kernels read, and host planners (FlashInfer's ``plan()``) read the host arrays directly.

Rows are request-major: the extend requests' chunks first, then one row per decode request.
Which chunk completes its prompt, and so which rows the narrowing keeps, is decided here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.slots import slot_from_block_rows, slots_of_run

class cached_property:  # noqa: N801 - a drop-in for functools' name
    """``functools.cached_property`` without its lock: computed on first access, then stored in the
    instance's ``__dict__``, where later reads find it before this (non-data) descriptor. Python 3.11's
    version takes an ``RLock`` on every first access, which at a few properties per step costs more
    than most of them compute; a plan is built and read by one thread."""

    def __init__(self, func):
        self.func = func
        self.__doc__ = func.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.func(instance)
        return value


def seed_cached(obj, **values) -> None:
    """Store ``values`` as ``obj``'s already-computed ``cached_property`` results: a builder that
    has them at hand for free (``build_step_plan``) saves the numpy calls. A ``dataclasses.replace``
    copy starts without them, so a replaced field is never read through a stale cache."""
    obj.__dict__.update(values)


def row_offsets(lens: np.ndarray) -> np.ndarray:
    """``[B] -> [B + 1]`` int32 exclusive prefix sums: request b's rows are ``[out[b], out[b + 1])``."""
    out = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    # the ufunc method, not np.cumsum: every step builds a few of these, and np.cumsum's Python
    # wrapper costs several times the sum itself at these sizes
    np.add.accumulate(lens, out=out[1:])
    return out


_ARANGE = np.arange(0, dtype=np.int64)


def arange_view(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64) as a read-only view of one table grown on demand: a step's row
    indices without allocating an array per step."""
    global _ARANGE
    if _ARANGE.shape[0] < n:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0], 4096), dtype=np.int64)
        _ARANGE.setflags(write=False)
    return _ARANGE[:n]


def put_rows(flat: np.ndarray, at: int, values, n: int, end: int, pad) -> None:
    """``flat[at:at + n] = values`` and rows ``[n, end)`` after them ``pad``: a step's rows written
    into a larger persistent buffer. The padding write is skipped when there is none: at a few rows
    each numpy call costs more than its copy."""
    # one row, or one padding row: an item store costs a fraction of a one-row slice assignment
    if n == 1 and type(values) is np.ndarray:
        flat[at] = values[0]
    else:
        flat[at: at + n] = values
    if end == n + 1:
        flat[at + n] = pad
    elif end > n:
        flat[at + n: at + end].fill(pad)


def put_padded(dst: np.ndarray, src: np.ndarray, pad) -> None:
    """``dst[:len(src)] = src`` and every row past it ``pad`` (``put_rows`` over all of ``dst``)."""
    put_rows(dst, 0, src, src.shape[0], dst.shape[0], pad)


_NO_DRAFTS: dict[int, np.ndarray] = {}


def no_drafts(num_requests: int) -> np.ndarray:
    """``[num_requests, 0]`` int64, read-only and made once per count: a plain step's ``draft_tokens``."""
    empty = _NO_DRAFTS.get(num_requests)
    if empty is None:
        empty = _NO_DRAFTS[num_requests] = np.zeros((num_requests, 0), dtype=np.int64)
        empty.setflags(write=False)
    return empty


ON_DEVICE = -1  # an input id the host has not read yet: the previous step's sample, still on the device
NO_ROWS = np.zeros(0, dtype=np.int64)
NO_ROWS.setflags(write=False)


# The plan classes are frozen dataclasses with a hand-written ``__init__``: the generated one of a
# frozen dataclass stores each field through ``object.__setattr__``, which at a dozen fields costs
# more than one ``__dict__.update`` by several microseconds on every step. Assignment after
# construction still raises ``FrozenInstanceError``.


@dataclass(frozen=True, eq=False, init=False)
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

    def __init__(self, query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int):
        self.__dict__.update(query_lens=query_lens, seq_lens=seq_lens, block_tables=block_tables,
                             block_size=block_size)

    @property
    def num_rows(self) -> int:
        return int(self.query_lens.sum())

    @cached_property
    def qo_indptr(self) -> np.ndarray:
        """[B + 1] int32: request b's rows are ``qo_indptr[b]:qo_indptr[b + 1]``."""
        return row_offsets(self.query_lens)

    @cached_property
    def row_requests(self) -> np.ndarray:
        """[rows] int64: the request of each row."""
        return np.repeat(arange_view(self.query_lens.shape[0]), self.query_lens)

    @cached_property
    def positions(self) -> np.ndarray:
        """[rows] int64: each row's position in its request's sequence of this group (a request's
        rows are its last ``query_lens`` positions, ``seq_lens - query_lens`` onwards)."""
        rows = int(self.qo_indptr[-1])
        if self.query_lens.shape[0] == 1:  # one request (a lone prompt): one slice, no per-row gather
            first = int(self.seq_lens[0]) - rows
            return arange_view(first + rows)[first:]
        req = self.row_requests
        # row i of request b: (seq_lens[b] - query_lens[b]) + (i - qo_indptr[b])
        return (self.seq_lens.astype(np.int64) - self.query_lens - self.qo_indptr[:-1])[req] + arange_view(rows)

    @cached_property
    def write_slots(self) -> np.ndarray:
        """[rows] int64: the KV slot each row writes, ``table[req, pos // block] * block + pos % block``."""
        if self.query_lens.shape[0] == 1:  # one request (a lone prompt): its rows are consecutive positions
            rows = int(self.query_lens[0])
            return slots_of_run(self.block_tables[0], int(self.seq_lens[0]) - rows, rows, self.block_size)
        return slot_from_block_rows(self.block_tables, self.row_requests, self.positions, self.block_size)


@dataclass(frozen=True, eq=False, init=False)
class SamplingRows:
    """Per request: temperature [B] f32, top_k [B] i32, top_p [B] f32, seed [B] i64, step [B] i64
    (the position its token will take, which with the seed fixes its random draw) and banned [B, K]
    i64 (token ids it may not sample this step: eos and stop ids before ``min_tokens``; -1 pads).
    ``logprobs``: some request asked for its tokens' log-probabilities (the step reads them back)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    banned: np.ndarray
    all_greedy: bool  # a host fact: an all-greedy batch skips the vocabulary sort
    logprobs: bool

    def __init__(self, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, seeds: np.ndarray,
                 steps: np.ndarray, banned: np.ndarray, all_greedy: bool, logprobs: bool):
        self.__dict__.update(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, steps=steps,
                             banned=banned, all_greedy=all_greedy, logprobs=logprobs)


@dataclass(frozen=True, eq=False, init=False)
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
    verify_width: N, the query rows of each decode request: 1 for a plain step; N > 1 for a
                 speculative verify step (decode only: each request's newest token then its N - 1
                 drafts; input_ids and positions hold B * N rows, query_lens are N).
    draft_tokens: [B, N - 1] int64 the drafts of a verify step, -1 where a request has fewer
                 (the -1s are token 0 in input_ids); [B, 0] for a plain step (``no_drafts``).
    state_slots: [B] int64 each request's recurrent-state slot (``kv_cache/state_pool.py``), beside
                 its block-table rows; empty for a model without recurrent-state layers.
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
    verify_width: int
    draft_tokens: np.ndarray
    state_slots: np.ndarray

    def __init__(self, mode: ForwardMode, request_ids: tuple[int, ...], num_extends: int, input_ids: np.ndarray,
                 positions: np.ndarray, query_lens: np.ndarray, prefix_lens: np.ndarray, completes: np.ndarray,
                 emits: np.ndarray, groups: tuple[GroupPlan, ...], logits_rows: np.ndarray, sampling: SamplingRows,
                 verify_width: int, draft_tokens: np.ndarray, state_slots: np.ndarray):
        self.__dict__.update(mode=mode, request_ids=request_ids, num_extends=num_extends, input_ids=input_ids,
                             positions=positions, query_lens=query_lens, prefix_lens=prefix_lens,
                             completes=completes, emits=emits, groups=groups, logits_rows=logits_rows,
                             sampling=sampling, verify_width=verify_width, draft_tokens=draft_tokens,
                             state_slots=state_slots)

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

    @cached_property  # the engine and the runner both ask, once per step
    def tokens_on_device(self) -> np.ndarray:
        """Indices of the rows whose input id is ``ON_DEVICE``: decode rows only (an extend's tokens
        are the prompt's, or generated tokens read back before a recompute), so only those are scanned."""
        first = self.num_tokens - self.num_decodes
        if first == self.num_tokens:
            return NO_ROWS
        return (self.input_ids[first:] == ON_DEVICE).nonzero()[0] + first
