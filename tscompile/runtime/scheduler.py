"""The scheduler: requests, admission, chunked prefill, decode and mixed steps, one plan per step.

It speaks requests and blocks only. KV blocks are allocated as requests grow: a request admitted
gets the blocks of its prompt (and its first new token), a decode step a block when it crosses into
one. When the pool runs out, the most recently admitted running request is preempted: its blocks
are freed and it waits to be recomputed (its prompt and the tokens it generated are prefilled
again), so every request still produces the tokens it would with an ample pool (the sampler's draws
depend only on a request's seed and position). A model whose cache keeps rows by chunk boundary (the
narrowing model's tail group) cannot be recomputed exactly: it reserves a request's every block at
admission instead and is never preempted. A refused request never touches anyone's cache.

With prefix caching (``set_prefix_caching``, a model of one un-narrowed cache group), a new or
preempted request first takes its longest cached run of full blocks (``kv_cache/prefix_cache.py``)
and computes only the rest, as the extend with a prefix that chunked prefill runs; its full blocks
are published to the cache as their KV becomes final, and a request whose next block a running
prefill is computing right now waits for it instead of computing it too.

``schedule()`` decides who runs and returns the step's ``StepPlan`` (``build_step_plan`` in
``runtime/step_builder.py``, a pure function of the scheduled batch); ``update(plan)`` advances the
requests past it. Runners get the
plan and never the scheduler.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tscompile.kv_cache.pool import BlockAllocator
from tscompile.kv_cache.prefix_cache import BlockChain, PrefixCache
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.runtime.cached_admission import NEVER, CachedAdmission
from tscompile.runtime.state_slots import StateSlots
from tscompile.sampling import SamplingParams
from tscompile.runtime.step_builder import ScheduledBatch, build_step_plan
from tscompile.step_plan import NO_ROWS, ON_DEVICE, StepPlan
from tscompile.utils import cdiv

MAX_STOP_IDS_BANNED = 8  # stop_token_ids a request may ban (before min_tokens) besides the model's eos ids


def banned_width_for(eos_token_ids: tuple[int, ...]) -> int:
    """The ban-list width of an engine: the model's eos ids plus room for a request's stop ids. Fixed
    per engine because the sampling op's ``banned`` input has a static shape inside graphs."""
    return len(eos_token_ids) + MAX_STOP_IDS_BANNED


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    output: list[int] = field(default_factory=list)  # sampled tokens the host has read back
    stopped: bool = False  # ended before max_new_tokens (a stop condition, an abort): never scheduled again
    completion: Any = None  # the engine's text and stop state (tscompile.text.CompletionState)
    text_prompt: str | None = None  # the prompt as the user wrote it, when it was text
    num_generated: int = 0  # tokens sampled so far, including one still on its way to ``output``
    slot: int = -1  # row of the block-table buffers while running
    num_computed: int = 0  # tokens whose KV is in the full group's cache
    resumed: int = 0  # generated tokens folded back into the prompt by a preemption (recomputed)
    group_lens: list[int] = field(default_factory=list)  # KV length per cache group
    blocks: list[list[int]] = field(default_factory=list)  # reserved block ids per cache group
    chain: BlockChain | None = None  # its full blocks' hashes, with prefix caching
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached
    publish_at: int = NEVER  # num_computed from which a next full block may be published
    computing: int | None = None  # hash of the next block its prefill publishes (others wait for it)
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed for it, and of them kept
    num_accepted_drafts: int = 0
    _prompt_ids: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def prefill_len(self) -> int:
        """Tokens a prefill computes: the prompt, plus what was generated before a preemption."""
        return len(self.prompt) + self.resumed

    def prefill_tokens(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt)
        return self.prompt[start:stop] + self.output[max(start - n, 0): max(stop - n, 0)]

    def prefill_token_ids(self, start: int, stop: int) -> np.ndarray:
        """``prefill_tokens`` as int64 numpy. Within the prompt it is a slice of the prompt's array,
        converted once per request (a plan of a long prompt used to convert a Python list per
        chunk); that array is read-only, so no plan can write through the slice."""
        ids = self._prompt_ids
        if ids is None:
            ids = self._prompt_ids = np.array(self.prompt, dtype=np.int64)
            ids.setflags(write=False)
        n = ids.shape[0]
        if stop <= n:
            return ids[start:stop]
        # a recomputed request: its generated tokens follow the prompt
        return np.concatenate([ids[start:], np.array(self.output[max(start - n, 0): stop - n], dtype=np.int64)])

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_len

    @property
    def finished(self) -> bool:
        """Scheduling-finished (every token sampled, or stopped); the last may still be on its way to
        ``output``."""
        return self.stopped or self.num_generated >= self.params.max_new_tokens

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def last_token(self) -> int:
        """The input id of this request's next decode row: ``ON_DEVICE`` while the host has not read it."""
        return self.output[-1] if len(self.output) == self.num_generated else ON_DEVICE


class Scheduler:
    def __init__(self, specs: list[CacheGroupSpec], num_blocks: list[int], *, block_size: int, max_num_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int, vocab_size: int, max_blocks: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), limit_note: str = "", enable_prefix_caching: bool = False,
                 state_slots: StateSlots | None = None):
        """``max_blocks``: the block-table width (default: enough for ``max_model_len``; a package
        keeps the width its programs were exported with). ``eos_token_ids``: the model's end-of-sequence
        ids (banned, with a request's stop ids, until it has ``min_tokens`` tokens). ``limit_note``
        follows ``max_model_len`` in refusals (a package names its bound). ``enable_prefix_caching``:
        see ``set_prefix_caching``. ``state_slots``: a model with recurrent-state layers' slots, given
        at admission and taken back at release (``runtime/state_slots.py``)."""
        self.state_slots = state_slots
        self.specs = specs
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.limit_note = limit_note
        self.banned_width = banned_width_for(self.eos_token_ids)
        self.allocators = [BlockAllocator(n, s.name) for s, n in zip(specs, num_blocks)]
        self.max_blocks = max_blocks if max_blocks is not None else cdiv(max_model_len, block_size)
        # host block tables, one row per running slot; 0 is the null block
        self.block_tables = [np.zeros((max_num_seqs, self.max_blocks), dtype=np.int32) for _ in specs]
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._by_id: dict[int, Request] = {}  # running requests
        # the narrowing model's tail group keeps rows by chunk boundary: no recompute, so reserve
        self.reserve_at_admission = any(spec.narrowed for spec in specs)
        self.num_preemptions = 0
        self.prefix_cache: CachedAdmission | None = None
        self.set_prefix_caching(enable_prefix_caching)

    # -- prefix caching --------------------------------------------------------------------------
    @property
    def prefix_caching_supported(self) -> bool:
        """One cache group that keeps every position: a narrowed group keeps rows by chunk boundary,
        so its KV depends on how a prompt was chunked, not only on its tokens."""
        # a recurrent state folds every token in: a cached KV prefix has no state to resume from
        return len(self.specs) == 1 and not self.specs[0].narrowed and self.state_slots is None

    def set_prefix_caching(self, enabled: bool) -> bool:
        """Turn prefix caching on or off (off forgets every cached block) while no request is queued
        or running; returns whether it is on (never for a model ``prefix_caching_supported`` refuses)."""
        if self.running or self.waiting:
            raise RuntimeError("tscompile: prefix caching is switched only while no request is queued or running")
        enabled = bool(enabled) and self.prefix_caching_supported
        if not enabled and self.prefix_cache is not None:
            self.allocators[0].reset_cache()
            self.prefix_cache = None
        elif enabled and self.prefix_cache is None:
            self.prefix_cache = CachedAdmission(PrefixCache(self.allocators[0], self.block_size))
        return enabled

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the blocks held by running requests stay theirs)."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset(self.running)

    # -- admission -------------------------------------------------------------------------------
    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse what can never run; raises before anything is queued or allocated."""
        if len(prompt) == 0:
            raise ValueError("tscompile: empty prompt; a request needs at least one token id")
        if not (0 <= min(prompt) and max(prompt) < self.vocab_size):  # in C: this runs on every prompt token
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise ValueError(f"tscompile: token id {bad} outside the vocabulary [0, {self.vocab_size})")
        banned = params.banned_ids(self.eos_token_ids, 0)
        if len(banned) > self.banned_width:
            raise ValueError(f"tscompile: min_tokens={params.min_tokens} would ban {len(banned)} token ids (eos and "
                             f"stop_token_ids), more than the {self.banned_width} an engine of this model can ban; pass at "
                             f"most {MAX_STOP_IDS_BANNED} stop_token_ids with min_tokens")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"tscompile: prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len}{self.limit_note}"
            )
        need = cdiv(total, self.block_size)
        for alloc in self.allocators:
            if need > alloc.num_blocks - 1:
                raise ValueError(
                    f"tscompile: page pool too small: the request needs {need} blocks of {self.block_size} tokens in "
                    f"cache group {alloc.group_name!r}, the pool has {alloc.num_blocks - 1}; raise num_pages"
                )

    def add(self, req: Request, *, validated: bool = False) -> None:
        """Queue ``req``. ``validated``: the caller has run ``validate`` on it already (the engine
        validates every request of a call before queueing any), so a long prompt is scanned once."""
        if not validated:
            self.validate(req.prompt, req.params)
        self.waiting.append(req)

    def _try_admit(self, req: Request) -> bool:
        # the prompt (and a recomputed request's tokens) plus the first new token; or everything
        tokens = req.max_len if self.reserve_at_admission else req.prefill_len + 1
        need = cdiv(min(tokens, req.max_len), self.block_size)
        if not self.free_slots:
            return False
        if self.prefix_cache is not None:
            if not self.prefix_cache.admit(req, need, self.free_slots):
                return False
        else:
            if any(a.num_free < need for a in self.allocators):
                return False
            req.slot = self.free_slots.pop()
            req.blocks = [a.allocate(need) for a in self.allocators]
            req.group_lens = [0] * len(self.specs)
        for table, blocks in zip(self.block_tables, req.blocks):
            table[req.slot, :] = 0
            table[req.slot, : len(blocks)] = blocks
        self.running.append(req)
        self._by_id[req.rid] = req
        if self.state_slots is not None:
            self.state_slots.admit(req)
        return True

    def _blocks_short(self) -> list[Request]:
        """Running decode requests whose next token starts a block they do not have yet."""
        if self.reserve_at_admission:
            return []
        return [r for r in self.running if r.prefill_done and r.num_computed >= len(r.blocks[0]) * self.block_size]

    def may_preempt(self) -> bool:
        """Whether the next ``schedule()`` could preempt (more blocks wanted than free): the engine
        then reads the step in flight back first, so a preempted request's tokens are all known."""
        short = len(self._blocks_short())
        return short > 0 and any(a.num_free < short for a in self.allocators)

    def _grow(self) -> None:
        """Give each decode request crossing into a new block that block, preempting the most
        recently admitted running requests while the pool is empty."""
        for r in self._blocks_short():
            if r.slot < 0:
                continue  # preempted below for an earlier request's block
            while any(a.num_free == 0 for a in self.allocators):
                self._preempt(self.running[-1])
                if r.slot < 0:
                    break
            if r.slot < 0:
                continue
            for alloc, table, blocks in zip(self.allocators, self.block_tables, r.blocks):
                blocks += alloc.allocate(1)
                table[r.slot, len(blocks) - 1] = blocks[-1]

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s blocks and queue it first, to prefill its prompt and generated tokens again."""
        assert len(req.output) == req.num_generated, "preempting a request whose last token is in flight"
        self.release(req)
        req.num_computed, req.resumed, req.group_lens = 0, req.num_generated, []
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def remove(self, req: Request) -> None:
        """Take ``req`` out of scheduling for good (a stop the host saw, an abort): its blocks are
        free at once. A step already launched may still write its pages: it runs before anything
        later on the stream, so a request given those blocks next cannot see its writes."""
        req.stopped = True
        if req.slot >= 0:
            self.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def release(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(req)
        for alloc, table, blocks in zip(self.allocators, self.block_tables, req.blocks):
            alloc.free(blocks)
            table[req.slot, :] = 0
        self.free_slots.append(req.slot)
        if self.state_slots is not None:
            self.state_slots.release(req)
        self.running.remove(req)
        del self._by_id[req.rid]
        req.slot, req.blocks = -1, []

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Admit what fits, pick this step's rows and return its plan (None: nothing to run)."""
        if not self.running and not self.waiting:
            return None  # idle (the step after a last request's): what follows would find nothing
        preempted = self.num_preemptions
        self._grow()
        # after a preemption nothing is admitted this step: the freed blocks go to the running
        while self.waiting and self.num_preemptions == preempted and self._try_admit(self.waiting[0]):
            self.waiting.popleft()
        decodes = [r for r in self.running if r.prefill_done]
        budget = max(self.max_num_batched_tokens - len(decodes), 0)
        extends = []
        for r in self.running:
            if r.prefill_done or budget == 0:
                continue
            chunk = min(r.prefill_len - r.num_computed, budget)
            extends.append((r, chunk))
            budget -= chunk
        if not extends and not decodes:
            if self.waiting:
                raise RuntimeError("scheduler stalled: a validated request cannot be admitted")
            return None
        return self.plan(ScheduledBatch(extends, decodes))

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        slots = NO_ROWS if self.state_slots is None else self.state_slots.plan_slots(batch.requests)
        return build_step_plan(batch, self.specs, self.block_tables, self.block_size, self.eos_token_ids,
                               self.banned_width, slots)

    def resolve_host_tokens(self, plan: StepPlan) -> StepPlan:
        """``plan`` with every ``ON_DEVICE`` input id the host has read since planning filled in."""
        rows = plan.tokens_on_device
        if rows.size == 0:
            return plan
        ids = plan.input_ids.copy()
        first_decode = plan.num_tokens - plan.num_decodes  # decode rows follow the extend rows, one each
        for row in rows.tolist():
            ids[row] = self._by_id[plan.request_ids[plan.num_extends + row - first_decode]].last_token
        return plan if np.array_equal(ids, plan.input_ids) else dataclasses.replace(plan, input_ids=ids)

    def update(self, plan: StepPlan) -> list[Request]:
        """Advance every request past this step (its tokens need not be known: nothing here depends
        on their values) and release the finished, which it returns."""
        finished = []
        # Python lists once per array: a numpy scalar per request and field costs more than the update
        group_lens = [group.seq_lens.tolist() for group in plan.groups]
        for i, (rid, rows, emits) in enumerate(zip(plan.request_ids, plan.query_lens.tolist(), plan.emits.tolist())):
            r = self._by_id[rid]
            for g, lens in enumerate(group_lens):
                r.group_lens[g] = lens[i]
            r.num_computed += rows
            if r.num_computed >= r.publish_at:  # a full block more (never without prefix caching)
                self.prefix_cache.publish(r)
            if emits:  # an open chunk's sample is discarded
                r.num_generated += 1
            if r.finished:
                self.release(r)
                finished.append(r)
        return finished
