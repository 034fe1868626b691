"""A step's plan from the requests the scheduler picked: ``build_step_plan`` turns a ``ScheduledBatch``
(extend requests with their chunk lengths, then decode requests) into the immutable ``StepPlan`` the
runners launch, reading the requests' state before the step and changing nothing."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.spec import CacheGroupSpec, kept_row_count
from tscompile.step_plan import (NO_ROWS, ON_DEVICE, GroupPlan, SamplingRows, StepPlan, arange_view, no_drafts,
                                 seed_cached)

if TYPE_CHECKING:
    from tscompile.runtime.scheduler import Request


@dataclass
class ScheduledBatch:
    """Who runs this step: extend requests with their chunk lengths, then decode requests."""

    extends: list[tuple[Request, int]]
    decodes: list[Request]

    @property
    def mode(self) -> ForwardMode:
        if self.extends and self.decodes:
            return ForwardMode.MIXED
        return ForwardMode.EXTEND if self.extends else ForwardMode.DECODE

    @property
    def requests(self) -> list[Request]:
        return [r for r, _ in self.extends] + self.decodes


_NO_BANS: dict[tuple[int, int], np.ndarray] = {}


def _banned_rows(reqs: list[Request], eos_token_ids: tuple[int, ...], banned_width: int) -> np.ndarray:
    """``[B, banned_width]`` int64 ids each request may not sample this step, -1 padded. Past
    ``min_tokens`` (the usual case) nothing is banned: one shared read-only array per shape."""
    bans = [r.params.banned_ids(eos_token_ids, r.num_generated) for r in reqs]
    if not any(bans):
        shape = (len(reqs), banned_width)
        banned = _NO_BANS.get(shape)
        if banned is None:
            banned = _NO_BANS[shape] = np.full(shape, -1, dtype=np.int64)
            banned.setflags(write=False)
        return banned
    banned = np.full((len(reqs), banned_width), -1, dtype=np.int64)
    for i, ids in enumerate(bans):
        if ids:
            banned[i, : len(ids)] = ids
    return banned


def _join(extend_parts: list[np.ndarray], decode_rows: np.ndarray | None) -> np.ndarray:
    """Each extend's chunk, then the decode rows, as one array (no copy when there is one part)."""
    if decode_rows is not None:
        if not extend_parts:
            return decode_rows
        return np.concatenate([*extend_parts, decode_rows])
    return extend_parts[0] if len(extend_parts) == 1 else np.concatenate(extend_parts)


def build_step_plan(batch: ScheduledBatch, specs: list[CacheGroupSpec], block_tables: list[np.ndarray],
                    block_size: int, eos_token_ids: tuple[int, ...] = (), banned_width: int = 1,
                    state_slots: np.ndarray = NO_ROWS) -> StepPlan:
    """The plan of ``batch`` from the requests' state before the step (a pure function).

    ``block_tables[g]`` is the scheduler's ``[max_num_seqs, max_blocks]`` table of group ``g``;
    request ``r`` owns row ``r.slot``. ``eos_token_ids`` are the model's, banned (with each request's
    stop ids) until it has ``min_tokens`` tokens; ``banned_width`` is the engine's ban-list width.
    ``state_slots``: the requests' recurrent-state slots in row order (``runtime/state_slots.py``).

    At a handful of requests a numpy call costs more than the Python work it does, so the
    per-request facts are gathered as Python lists and become one array per dtype (int32, int64,
    float32, bool); every plan array is a slice of those (no plan array is ever written). Row
    offsets are prefix sums taken in Python on the way, so no plan needs ``row_offsets`` later."""
    extends, decodes = batch.extends, batch.decodes
    reqs = [r for r, _ in extends] + decodes if extends else decodes
    b, d = len(reqs), len(decodes)
    ends = [r.num_computed + n == r.prefill_len for r, n in extends]
    q_lens = [n for _, n in extends] + [1] * d if extends else [1] * d
    params = [r.params for r in reqs]

    # int32: query lens, prefix lens, top_k, the plan's row offsets, then per group (a narrowed group
    # only: the kept rows and their offsets), the KV lengths after the step
    qo = [0, *accumulate(q_lens)]
    i32 = q_lens + [r.num_computed for r in reqs] + [p.top_k for p in params] + qo
    kept_at: list[int | None] = []  # where a narrowed group's kept rows start in i32 (None: all rows kept)
    lens_at = []
    last_qo = qo
    last_group = _last_layer_group(specs)
    for g, spec in enumerate(specs):
        kept = q_lens
        if spec.window is None:
            kept_at.append(None)
        else:  # a decode row is always kept: one row, as an open chunk's last
            kept = [kept_row_count(n, c, spec.window) for n, c in zip(q_lens, ends + [False] * d)]
            kept_at.append(len(i32))
            group_qo = [0, *accumulate(kept)]
            i32 += kept + group_qo
            if g == last_group:
                last_qo = group_qo
        lens_at.append(len(i32))
        i32 += [r.group_lens[g] + k for r, k in zip(reqs, kept)]
    # int64: the rows sampled (the last layer's group), seeds, steps, then the decode rows' ids and positions
    last_tokens = [r.last_token for r in decodes]
    i64 = ([x - 1 for x in last_qo[1:]] + [r.seed for r in reqs] + [len(r.prompt) + r.num_generated for r in reqs]
           + last_tokens + [r.num_computed for r in decodes])
    a32 = np.array(i32, dtype=np.int32)
    a64 = np.array(i64, dtype=np.int64)
    floats = np.array([p.temperature for p in params] + [p.top_p for p in params], dtype=np.float32)
    flags = np.array(ends + [False] * d + ends + [True] * d, dtype=bool)  # an open chunk's sample is discarded

    query_lens, qo_indptr = a32[:b], a32[3 * b: 4 * b + 1]
    slots = [r.slot for r in reqs]
    groups = []
    for g, at in enumerate(kept_at):
        kept, kept_qo = (query_lens, qo_indptr) if at is None else (a32[at: at + b], a32[at + b: at + 2 * b + 1])
        # take(): the same rows as block_tables[g][slots], without fancy indexing's dispatch
        group = GroupPlan(kept, a32[lens_at[g]: lens_at[g] + b], block_tables[g].take(slots, axis=0), block_size)
        seed_cached(group, qo_indptr=kept_qo)
        groups.append(group)
    decode_at = 3 * b
    ids = _join([r.prefill_token_ids(r.num_computed, r.num_computed + n) for r, n in extends],
                a64[decode_at: decode_at + d] if d else None)
    pos = _join([arange_view(r.num_computed + n)[r.num_computed:] for r, n in extends],
                a64[decode_at + d: decode_at + 2 * d] if d else None)
    sampling = SamplingRows(temperature=floats[:b], top_k=a32[2 * b: 3 * b], top_p=floats[b:],
                            seeds=a64[b: 2 * b], steps=a64[2 * b: 3 * b],
                            banned=_banned_rows(reqs, eos_token_ids, banned_width),
                            all_greedy=all(p.greedy for p in params),
                            logprobs=any(p.logprobs is not None for p in params))
    plan = StepPlan(
        mode=batch.mode, request_ids=tuple([r.rid for r in reqs]), num_extends=len(extends),
        input_ids=ids, positions=pos, query_lens=query_lens, prefix_lens=a32[b: 2 * b],
        completes=flags[:b], emits=flags[b:], groups=tuple(groups), logits_rows=a64[:b], sampling=sampling,
        verify_width=1, draft_tokens=no_drafts(b), state_slots=state_slots,
    )
    first_decode = len(ids) - d
    unread = [first_decode + i for i, t in enumerate(last_tokens) if t == ON_DEVICE]
    seed_cached(plan, qo_indptr=qo_indptr,
                tokens_on_device=np.array(unread, dtype=np.int64) if unread else NO_ROWS)
    return plan


def _last_layer_group(specs: list[CacheGroupSpec]) -> int:
    """The cache group of the model's last layer (its rows are the ones sampled)."""
    if len(specs) == 1:
        return 0
    return max(range(len(specs)), key=lambda g: max(specs[g].layer_ids))
