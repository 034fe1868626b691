"""The draft model's engine parts: a second model with its own paged KV cache, behind the three calls
``DraftModelDrafter`` makes (``DraftModelRunner``: ``vocab_size``, ``forward``, ``release``).

It is built like the target (``build_model_engine``: the same loader, attention router, page pool
and runner, compiled with the target's compile config and CUDA graphs where the target has them),
and it keeps no scheduler state of its own: each request gets a block-table row and blocks of its
own allocator on first use, grown as its draft cache grows. Rows past a request's ``start`` are
stale (drafts the target rejected) and are simply written over: rollback is the drafter's
counter, as for the target.

Two ways to run a step over every request's new tokens (the prompt on a request's first draft,
then the tokens the target emitted, then one draft at a time):

- ``next_tokens`` (greedy drafts): a step plan through the draft engine's ``ModelRunner``, so the
  first feed is an extend step (compiled, prefill graphs per bucket) and the one-token steps are
  decode steps replaying the draft's decode graphs; the runner's sampler picks the argmax.
- ``forward`` (sampled drafts need the logits): one eager extend step through the same extend
  metadata path (``extend_host_arrays`` -> ``publish_extend_metadata``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
from tscompile.runtime.arena import upload_packed
from tscompile.step_plan import NO_ROWS, GroupPlan, SamplingRows, StepPlan, no_drafts, row_offsets
from tscompile.utils import cdiv


class EngineDraftRunner:
    """``parts``: the draft model's ``EngineParts`` (``engine_drafters.build_draft_parts``: compiled and
    graphed as the target)."""

    def __init__(self, parts):
        if len(parts.scheduler.specs) != 1 or parts.scheduler.specs[0].window is not None:
            raise ValueError("tscompile: speculative_config model needs one full-attention cache group; the draft "
                             f"model has cache groups {[s.name for s in parts.scheduler.specs]}; use a Llama/Qwen "
                             "style draft checkpoint")
        self.parts = parts
        self.model, self.attention, self.device = parts.model, parts.attention, parts.device
        sched = parts.scheduler
        self.allocator, self.table, self.block_size = sched.allocators[0], sched.block_tables[0], sched.block_size
        self.max_blocks = sched.max_blocks
        self.vocab_size = parts.config.vocab_size
        self.banned_width = sched.banned_width
        self._free_rows = list(range(self.table.shape[0]))[::-1]
        self._rows: dict[object, int] = {}  # request -> its block-table row
        self._blocks: dict[object, list[int]] = {}

    def _reserve(self, rid, length: int) -> int:
        """The block-table row of ``rid``, holding blocks for ``length`` positions."""
        row = self._rows.get(rid)
        if row is None:
            if not self._free_rows:
                raise RuntimeError("tscompile: the draft model's cache has no free request row (more requests than "
                                   "max_num_seqs drafted at once)")
            row = self._rows[rid] = self._free_rows.pop()
            self._blocks[rid] = []
            self.table[row, :] = 0
        blocks = self._blocks[rid]
        need = cdiv(length, self.block_size)
        if need > self.max_blocks:
            raise RuntimeError(f"tscompile: a draft of {length} positions passes the draft cache's {self.max_blocks} "
                               "blocks per request")
        if need > len(blocks):
            more = self.allocator.allocate(need - len(blocks))
            self.table[row, len(blocks): need] = more
            blocks += more
        return row

    def _plan(self, request_ids: Sequence, new_tokens: Sequence[np.ndarray], start_positions: np.ndarray,
              mode: ForwardMode) -> StepPlan:
        """A greedy step plan of the new tokens: ``mode`` EXTEND (any lengths) or DECODE (one each)."""
        bs = len(request_ids)
        q_lens = np.array([t.shape[0] for t in new_tokens], dtype=np.int32)
        starts = np.asarray(start_positions, dtype=np.int32)
        seq_lens = starts + q_lens
        rows = [self._reserve(rid, int(n)) for rid, n in zip(request_ids, seq_lens)]
        qo = row_offsets(q_lens)
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in new_tokens])
        positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, q_lens)])
        ones = np.ones(bs, dtype=bool)
        greedy = SamplingRows(np.zeros(bs, np.float32), np.ones(bs, np.int32), np.ones(bs, np.float32),
                              np.zeros(bs, np.int64), positions[qo[1:] - 1] + 1,
                              np.full((bs, self.banned_width), -1, np.int64), True, False)
        group = GroupPlan(q_lens, seq_lens.astype(np.int32), self.table.take(rows, axis=0), self.block_size)
        extends = bs if mode is ForwardMode.EXTEND else 0
        return StepPlan(mode, tuple(request_ids), extends, ids, positions, q_lens, starts,
                        ones if extends else ~ones, ones, (group,), (qo[1:] - 1).astype(np.int64), greedy, 1,
                        no_drafts(bs), NO_ROWS)

    def next_tokens(self, request_ids: Sequence, new_tokens: Sequence[np.ndarray],
                    start_positions: np.ndarray) -> np.ndarray:
        """The draft model's greedy next token of every request, ``[bs]`` int64 (``forward``'s
        arguments), through the draft engine's runner: a decode step when every request feeds one
        token, else an extend step."""
        one_each = all(t.shape[0] == 1 for t in new_tokens)
        plan = self._plan(request_ids, new_tokens, start_positions,
                          ForwardMode.DECODE if one_each else ForwardMode.EXTEND)
        return np.array(self.parts.runner.launch(plan).wait(), dtype=np.int64)

    def forward(self, request_ids: Sequence, new_tokens: Sequence[np.ndarray],
                start_positions: np.ndarray) -> torch.Tensor:
        plan = self._plan(request_ids, new_tokens, start_positions, ForwardMode.EXTEND)
        ids, positions, qo, ones = plan.input_ids, plan.positions, plan.qo_indptr, plan.completes
        with torch.inference_mode():
            arrays = self.attention.extend_host_arrays(plan, {})
            dev = upload_packed([ids, positions, plan.logits_rows, qo, ones, *arrays], self.device)
            self.attention.publish_extend_metadata(plan, dev[5:])
            ctx = ForwardContext(ForwardMode.EXTEND, self.attention, dev[2], dev[3], dev[4])
            with forward_context(ctx):
                return self.model(dev[0], dev[1])

    def release(self, request_id) -> None:
        row = self._rows.pop(request_id, None)
        if row is None:
            return
        self.allocator.free(self._blocks.pop(request_id))
        self.table[row, :] = 0
        self._free_rows.append(row)
