"""Start-up prefill capture: the placeholder steps that capture every prefill graph before the
first request (``TscompileConfig.prefill_capture="startup"``).

Which graphs exist is the runner's business (``ModelRunner.prefill_graph_keys``: the whole-step
key, or the piecewise token / row / request buckets and Dynamo variants). This module proposes
step shapes, one or more per token bucket and request count, extend and mixed, and keeps each one
that reaches a key no earlier shape reached, largest first (the graphs share one memory pool, as
the decode ladder's do).

A placeholder step is a ``StepPlan`` built by the scheduler's own ``build_step_plan`` over
requests that exist nowhere else: every block-table row is the null block, so each K/V write
lands in the null page (page 0), the page every padded row writes already; nothing is allocated
and the scheduler is never called. Its prompt tokens are 0 and it samples greedily; its tokens
are read back and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tscompile.kv_cache.spec import CacheGroupSpec, kept_rows
from tscompile.kv_cache.state_pool import NULL_SLOT
from tscompile.runtime.dynamic_sizes import min_logits_rows
from tscompile.runtime.scheduler import Request
from tscompile.runtime.step_builder import ScheduledBatch, build_step_plan
from tscompile.sampling import SamplingParams
from tscompile.step_plan import NO_ROWS, StepPlan
from tscompile.utils import bucket

PLACEHOLDER_TOKEN = 0


@dataclass(frozen=True)
class PlaceholderShape:
    """One placeholder step: extend chunks (``completes[i]``: chunk i is its whole prompt) and
    ``decodes`` one-row decode requests after them (a mixed step)."""

    chunks: tuple[int, ...]
    completes: tuple[bool, ...]
    decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks) + self.decodes

    @property
    def num_requests(self) -> int:
        return len(self.chunks) + self.decodes


@dataclass(frozen=True)
class StepLimits:
    """What a real step can be: ``max_tokens`` (the scheduler's token budget), ``max_requests``
    (``max_num_seqs``), ``max_chunk`` (the longest prompt chunk: ``max_model_len`` less the one
    new token and the row an unfinished prompt keeps for later)."""

    max_tokens: int
    max_requests: int
    max_chunk: int


def _split(tokens: int, parts: int) -> list[int]:
    return [tokens // parts + (i < tokens % parts) for i in range(parts)]


def candidate_shapes(token_ladder: tuple[int, ...], request_counts: tuple[int, ...], limits: StepLimits,
                     narrowing_window: int | None = None) -> list[PlaceholderShape]:
    """Step shapes, largest token bucket first: per bucket the most tokens a real step of that
    bucket can have, per request count an extend step and (two requests or more) a mixed step
    with one decode row. For the narrowing model (``narrowing_window``), also every split of the
    extend requests into prompt-completing chunks (which keep up to the window's rows) and open
    ones (which keep one), one per distinct kept-row count, so every row bucket is reached."""
    shapes = []
    ladder = sorted(token_ladder)
    for i in range(len(ladder) - 1, -1, -1):
        floor = ladder[i - 1] if i else 0  # a step of this bucket has more tokens than the one below
        for requests in sorted({1, *request_counts}, reverse=True):
            if requests > limits.max_requests:
                continue
            for decodes in (0, 1):
                extends = requests - decodes
                if extends < 1:
                    continue
                tokens = min(ladder[i], limits.max_tokens, extends * limits.max_chunk + decodes)
                if tokens <= floor or tokens < requests:
                    continue
                chunks = tuple(_split(tokens - decodes, extends))
                for completes in _completion_splits(chunks, narrowing_window):
                    shapes.append(PlaceholderShape(chunks, completes, decodes))
    return shapes


def _completion_splits(chunks: tuple[int, ...], window: int | None) -> list[tuple[bool, ...]]:
    """Every prompt complete; for a narrowing model also the first ``c`` complete and the rest
    open, one ``c`` per distinct kept-row count."""
    every = tuple(True for _ in chunks)
    if window is None:
        return [every]
    out, seen = [], set()
    q = np.asarray(chunks)
    for c in range(len(chunks), -1, -1):
        completes = tuple(j < c for j in range(len(chunks)))
        rows = int(kept_rows(q, np.asarray(completes), window).sum())
        if rows not in seen:
            seen.add(rows)
            out.append(completes)
    return out


def placeholder_plan(shape: PlaceholderShape, specs: list[CacheGroupSpec], *, block_size: int, max_blocks: int,
                     eos_token_ids: tuple[int, ...] = (), banned_width: int = 1, with_state: bool = False,
                     greedy: bool = True) -> StepPlan:
    """The plan of ``shape`` over placeholder requests whose every block is the null block, and, for a
    model with recurrent-state layers (``with_state``), whose every state slot is the null slot.
    ``greedy=False``: the requests sample (the step's other compiled variant)."""
    params = SamplingParams(max_new_tokens=2, temperature=0.0 if greedy else 1.0)
    extends = []
    for i, (n, complete) in enumerate(zip(shape.chunks, shape.completes)):
        # an open chunk is the first part of a longer prompt
        r = Request(-1 - i, [PLACEHOLDER_TOKEN] * (n if complete else n + 1), params, seed=0)
        extends.append((r, n))
    decodes = []
    for j in range(shape.decodes):
        r = Request(-1 - len(extends) - j, [PLACEHOLDER_TOKEN], params, seed=0)
        r.output, r.num_generated, r.num_computed = [PLACEHOLDER_TOKEN], 1, 1  # prompt done, its token read
        decodes.append(r)
    reqs = [r for r, _ in extends] + decodes
    for slot, r in enumerate(reqs):
        r.slot = slot
        r.group_lens = [r.num_computed] * len(specs)
    tables = [np.zeros((len(reqs), max_blocks), dtype=np.int32) for _ in specs]  # the null block only
    state_slots = np.full(len(reqs), NULL_SLOT, dtype=np.int64) if with_state else NO_ROWS
    return build_step_plan(ScheduledBatch(extends, decodes), specs, tables, block_size, eos_token_ids, banned_width,
                           state_slots)


def select_plans(shapes: list[PlaceholderShape], build: Callable[[PlaceholderShape], StepPlan],
                 keys_of: Callable[[StepPlan], frozenset]) -> list[StepPlan]:
    """The plans of the shapes that reach a graph key no earlier shape reached, in order."""
    seen: set = set()
    plans = []
    for shape in shapes:
        plan = build(shape)
        new = keys_of(plan) - seen
        if new:
            seen |= new
            plans.append(plan)
    return plans


def request_ladder(decode_ladder: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The request buckets of padded prefill steps: the decode ladder below ``max_num_seqs``, and it,
    none below ``min_logits_rows`` (a bucket of 1 would specialize the step's graph: ``dynamic_sizes.py``)."""
    low = min_logits_rows(max_num_seqs)
    return tuple(sorted({b for b in decode_ladder if low <= b < max_num_seqs} | {max_num_seqs}))


def reachable_token_ladder(token_ladder: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The buckets a step of at most ``max_tokens`` tokens can pad to."""
    top = bucket(token_ladder, max_tokens)
    return tuple(b for b in token_ladder if top is None or b <= top)


def startup_plans(runner, scheduler) -> list[StepPlan]:
    """The placeholder steps that capture every prefill graph of ``runner`` (a ``ModelRunner``) a
    greedy step of ``scheduler``'s limits can reach; the scheduler is only read."""
    if not runner.prefill_capture_at_startup:
        return []
    specs = scheduler.specs
    limits = StepLimits(max_tokens=scheduler.max_num_batched_tokens, max_requests=scheduler.max_num_seqs,
                        max_chunk=max(scheduler.max_model_len - 2, 1))
    buckets = runner.prefill.buckets
    window = specs[buckets.narrowed].window if buckets is not None and buckets.narrowed is not None else None
    shapes = candidate_shapes(reachable_token_ladder(runner.prefill_token_ladder, limits.max_tokens),
                              runner.prefill_request_ladder, limits, window)

    return select_plans(shapes, lambda shape: scheduler_placeholder(shape, scheduler), runner.prefill_graph_keys)


def scheduler_placeholder(shape: PlaceholderShape, scheduler, greedy: bool = True) -> StepPlan:
    """``placeholder_plan`` of ``shape`` over ``scheduler``'s cache groups and limits."""
    return placeholder_plan(shape, scheduler.specs, block_size=scheduler.block_size, max_blocks=scheduler.max_blocks,
                            eos_token_ids=scheduler.eos_token_ids, banned_width=scheduler.banned_width,
                            with_state=scheduler.state_slots is not None, greedy=greedy)


def shape_of(plan: StepPlan) -> PlaceholderShape:
    """The placeholder shape of a real step: its extend chunks, which of them complete their
    prompts, and its decode rows."""
    chunks = tuple(int(n) for n in np.diff(plan.qo_indptr[: plan.num_extends + 1]))
    return PlaceholderShape(chunks, tuple(bool(c) for c in plan.completes[: plan.num_extends]), plan.num_decodes)


def placeholder_like(plan: StepPlan, scheduler) -> StepPlan:
    """A placeholder step of ``plan``'s shape and sampling variant over ``scheduler``'s limits: the
    same prefill graph key, no live page or state slot touched. A whole-step graph of a model with
    recurrent-state layers is captured on it, since a capture runs its step more than once and a
    state must advance once per step (``PrefillStep._run_whole``)."""
    return scheduler_placeholder(shape_of(plan), scheduler, greedy=plan.sampling.all_greedy)
