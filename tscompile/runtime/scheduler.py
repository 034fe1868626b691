"""The scheduler: requests, admission, chunked prefill, decode and mixed steps.

It speaks requests and blocks only. A request reserves every block it can ever need (prompt plus
``max_new_tokens``) when it is admitted, so a running request can never be starved or preempted by
another, and a refused request never touches anyone's cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tscompile.attention.base import ForwardMode
from tscompile.kv_cache.pool import BlockAllocator
from tscompile.kv_cache.spec import CacheGroupSpec, kept_rows
from tscompile.sampling import SamplingParams
from tscompile.utils import cdiv


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    output: list[int] = field(default_factory=list)  # sampled tokens the host has read back
    num_generated: int = 0  # tokens sampled so far, including one still on its way to ``output``
    slot: int = -1  # row of the block-table buffers while running
    num_computed: int = 0  # tokens whose KV is in the full group's cache
    group_lens: list[int] = field(default_factory=list)  # KV length per cache group
    blocks: list[list[int]] = field(default_factory=list)  # reserved block ids per cache group

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= len(self.prompt)

    @property
    def finished(self) -> bool:
        """Scheduling-finished (every token sampled); the last may still be on its way to ``output``."""
        return self.num_generated >= self.params.max_new_tokens

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens


@dataclass
class ScheduledBatch:
    """Extend requests first (with their chunk lengths), then decode requests."""

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

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.extends) + len(self.decodes)


class Scheduler:
    def __init__(self, specs: list[CacheGroupSpec], num_blocks: list[int], *, block_size: int, max_num_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int, vocab_size: int):
        self.specs = specs
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.allocators = [BlockAllocator(n, s.name) for s, n in zip(specs, num_blocks)]
        self.max_blocks = cdiv(max_model_len, block_size)
        # host block tables, one row per running slot; 0 is the null block
        self.block_tables = [np.zeros((max_num_seqs, self.max_blocks), dtype=np.int32) for _ in specs]
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- admission -------------------------------------------------------------------------------
    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse what can never run; raises before anything is queued or allocated."""
        if len(prompt) == 0:
            raise ValueError("tscompile: empty prompt; a request needs at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"tscompile: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"tscompile: prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        need = cdiv(total, self.block_size)
        for alloc in self.allocators:
            if need > alloc.num_blocks - 1:
                raise ValueError(
                    f"tscompile: page pool too small: the request needs {need} blocks of {self.block_size} tokens in "
                    f"cache group {alloc.group_name!r}, the pool has {alloc.num_blocks - 1}; raise num_pages"
                )

    def add(self, req: Request) -> None:
        self.validate(req.prompt, req.params)
        self.waiting.append(req)

    def _try_admit(self, req: Request) -> bool:
        need = cdiv(req.max_len, self.block_size)
        if not self.free_slots or any(a.num_free < need for a in self.allocators):
            return False
        req.slot = self.free_slots.pop()
        req.blocks = [a.allocate(need) for a in self.allocators]
        req.group_lens = [0] * len(self.specs)
        for table, blocks in zip(self.block_tables, req.blocks):
            table[req.slot, :] = 0
            table[req.slot, : len(blocks)] = blocks
        self.running.append(req)
        return True

    def release(self, req: Request) -> None:
        for alloc, table, blocks in zip(self.allocators, self.block_tables, req.blocks):
            alloc.free(blocks)
            table[req.slot, :] = 0
        self.free_slots.append(req.slot)
        self.running.remove(req)
        req.slot, req.blocks = -1, []

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        while self.waiting and self._try_admit(self.waiting[0]):
            self.waiting.popleft()
        decodes = [r for r in self.running if r.prefill_done]
        budget = max(self.max_num_batched_tokens - len(decodes), 0)
        extends = []
        for r in self.running:
            if r.prefill_done or budget == 0:
                continue
            chunk = min(len(r.prompt) - r.num_computed, budget)
            extends.append((r, chunk))
            budget -= chunk
        if not extends and not decodes:
            if self.waiting:
                raise RuntimeError("scheduler stalled: a validated request cannot be admitted")
            return None
        return ScheduledBatch(extends, decodes)

    def input_rows(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """Token ids and positions of every row, request-major (extends, then decodes)."""
        ids, pos = [], []
        for r, n in batch.extends:
            ids += r.prompt[r.num_computed : r.num_computed + n]
            pos += range(r.num_computed, r.num_computed + n)
        for r in batch.decodes:
            # a token still in flight is gathered on the device (the runner's prev_rows): 0 here
            ids.append(r.output[-1] if len(r.output) == r.num_generated else 0)
            pos.append(r.num_computed)
        return ids, pos

    @staticmethod
    def completes(batch: ScheduledBatch) -> list[bool]:
        """Per extend of ``batch``: does this chunk complete its prompt? Ask before ``update``."""
        return [r.num_computed + n == len(r.prompt) for r, n in batch.extends]

    @classmethod
    def emits(cls, batch: ScheduledBatch) -> list[bool]:
        """Per request of ``batch``: does this step's sample become an output token? (An open
        prefill chunk's sample is discarded.) Ask before ``update``."""
        return cls.completes(batch) + [True] * len(batch.decodes)

    def group_lens_after(self, batch: ScheduledBatch) -> list[list[int]]:
        """``[group][request]`` KV length after this step."""
        out, completes = [], self.completes(batch)
        for gid, spec in enumerate(self.specs):
            lens = [r.group_lens[gid] + kept_rows(n, done, spec.window)
                    for (r, n), done in zip(batch.extends, completes)]
            lens += [r.group_lens[gid] + 1 for r in batch.decodes]
            out.append(lens)
        return out

    def update(self, batch: ScheduledBatch) -> list[Request]:
        """Advance every request past this step (the step's tokens need not be known: nothing here
        depends on their values) and release the finished, which it returns."""
        for gid, lens in enumerate(self.group_lens_after(batch)):
            for r, n in zip(batch.requests, lens):
                r.group_lens[gid] = n
        finished = []
        for r, n in batch.extends:
            r.num_computed += n
            if r.prefill_done:  # an open chunk's sample is discarded
                r.num_generated += 1
        for r in batch.decodes:
            r.num_computed += 1
            r.num_generated += 1
        for r in batch.requests:
            if r.finished:
                self.release(r)
                finished.append(r)
        return finished
