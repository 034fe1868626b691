"""One speculative verify step of the engine's decode requests, eager: drafts in, a width-N decode
through the paged cache, acceptance on the device, one read-back, the kept tokens committed.

The engine hands it a decode plan the scheduler made; ``run`` returns False (nothing changed, the
engine runs the plan as a plain step) when the verify window does not fit: a request's window
would pass the block table, or the pool lacks the lookahead blocks. Lookahead: every request of a
verify step holds blocks for ``num_computed + N`` positions (the window: its newest token, then k
draft rows); rejected rows stay in the request's blocks and are overwritten later, since the KV
length advances only by the kept tokens (``kv_len_after``).

Per request, drafts are cut to what it may still emit (``max_new_tokens`` - generated - 1), so a
window never drafts past its last token; the window is N rows for every request (the attention
shapes are uniform), a cut or missing draft is -1, which the acceptance ops never accept.
"""

from __future__ import annotations

import time

import numpy as np

from tscompile.forward_context import ForwardMode
from tscompile.spec_decode.commit import commit_emitted
from tscompile.spec_decode.config import SpeculativeConfig
from tscompile.spec_decode.drafter import DraftBatch, Drafter
from tscompile.step_plan import GroupPlan, StepPlan
from tscompile.utils import cdiv


class VerifyStep:
    """``run(plan, requests, finish)``: one verify step of a decode plan (see the module docstring);
    ``accepted_drafts`` / ``proposed_drafts`` / ``verify_steps`` count what it did."""

    def __init__(self, spec: SpeculativeConfig, drafter: Drafter, scheduler, runner):
        if len(scheduler.specs) != 1 or scheduler.specs[0].window is not None:
            raise ValueError("tscompile: speculative_config needs a model with one full-attention cache group; "
                             f"this model has cache groups {[s.name for s in scheduler.specs]}; leave "
                             "speculative_config unset for it")
        self.spec, self.drafter, self.scheduler = spec, drafter, scheduler
        self.runner = runner  # the engine's ModelRunner: launch_verify runs the step (eager or graphed)
        self.width = spec.verify_width
        self.accepted_drafts = self.proposed_drafts = self.verify_steps = 0
        # the host's share of the verify steps: up to the launch, then after the read-back; on a GPU
        # the launch is asynchronous, so this is host work
        self.host_seconds = 0.0
        self.draft_seconds = 0.0  # of host_seconds, the drafter's
        self._histories: dict[object, TokenHistory] = {}

    def release(self, request) -> None:
        """``request`` finished or was aborted: drop its history and what the drafter keeps for it."""
        if self._histories.pop(request.rid, None) is not None:
            self.drafter.release(request.rid)

    def _history(self, r) -> np.ndarray:
        """``r``'s prompt then output, grown by the tokens read since its last verify step (no
        O(length) rebuild per step)."""
        h = self._histories.get(r.rid)
        if h is None:
            h = self._histories[r.rid] = TokenHistory(r.prompt)
        return h.extend_to(r.output)

    def summary(self) -> dict:
        """``EngineStats``' speculative fields."""
        return dict(spec_verify_steps=self.verify_steps, spec_draft_tokens=self.proposed_drafts,
                    spec_accepted_tokens=self.accepted_drafts, spec_host_seconds=self.host_seconds,
                    spec_draft_seconds=self.draft_seconds)

    def _reserve_lookahead(self, requests) -> bool:
        """Blocks for every request's whole window, or False (nothing allocated) when they do not fit."""
        sched, n = self.scheduler, self.width
        block = sched.block_size
        extra = []
        for r in requests:
            need = cdiv(r.num_computed + n, block)
            if need > sched.max_blocks:
                return False
            extra.append(max(need - len(r.blocks[0]), 0))
        if sum(extra) > sched.allocators[0].num_free:
            return False
        table = sched.block_tables[0]
        for r, more in zip(requests, extra):
            if more:
                r.blocks[0] += sched.allocators[0].allocate(more)
                table[r.slot, len(r.blocks[0]) - more: len(r.blocks[0])] = r.blocks[0][-more:]
        return True

    def run(self, plan: StepPlan, requests: list, finish) -> bool:
        """``requests``: the plan's, every last token on the host. ``finish(r)``: the engine's hand-off
        of a request whose completion just finished. Returns whether the step ran."""
        began = time.perf_counter()
        if plan.mode is not ForwardMode.DECODE or not self._reserve_lookahead(requests):
            return False
        k, n = self.spec.num_speculative_tokens, self.width
        batch = DraftBatch(tuple(r.rid for r in requests),
                           tuple(self._history(r) for r in requests),
                           tuple(len(r.prompt) for r in requests), k)
        drafting = time.perf_counter()
        drafts = self.drafter.propose(batch)
        self.draft_seconds += time.perf_counter() - drafting
        # never draft past the request's last token (one mask for the batch: this runs every step)
        room = np.array([r.params.max_new_tokens - r.num_generated - 1 for r in requests], dtype=np.int64)
        tokens = np.where(np.arange(k)[None, :] < room[:, None], drafts.tokens, -1)
        last = np.array([r.output[-1] if r.output else r.prompt[-1] for r in requests], dtype=np.int64)
        window = np.concatenate([last[:, None], tokens], axis=1)
        start = np.array([r.num_computed for r in requests], dtype=np.int64)
        verify = verify_plan(plan, window, start, self.scheduler.block_tables[0].take([r.slot for r in requests], 0))
        # the step's one read-back: the emitted tokens and, in the last column, the accepted counts
        launched = self.runner.launch_verify(verify)
        waiting = time.perf_counter()
        both = launched.cpu().numpy()
        read = time.perf_counter()
        emitted, accepted = both[:, :n], both[:, n]
        self.verify_steps += 1
        self.drafter.on_accepted(batch.request_ids, accepted)
        # plain lists for the per-request loop: numpy scalars and per-row reductions cost microseconds each
        emitted_rows, accepted_counts = emitted.tolist(), accepted.tolist()
        proposed_counts = (tokens >= 0).sum(axis=1).tolist()
        for i, r in enumerate(requests):
            run = emitted_rows[i][: accepted_counts[i] + 1]
            kept = commit_emitted(r.completion, run)
            r.output += run[:kept]
            r.num_generated += kept
            r.num_computed += kept  # the newest kept token's KV is written by the next step
            r.group_lens[0] = r.num_computed
            proposed = proposed_counts[i]
            r.num_draft_tokens += proposed
            r.num_accepted_drafts += max(kept - 1, 0)
            self.proposed_drafts += proposed
            self.accepted_drafts += max(kept - 1, 0)
            if r.num_computed >= r.publish_at:
                self.scheduler.prefix_cache.publish(r)
            if r.completion.finished:
                finish(r)
        self.host_seconds += (waiting - began) + (time.perf_counter() - read)
        return True


def verify_plan(plan: StepPlan, window: np.ndarray, start: np.ndarray, tables: np.ndarray) -> StepPlan:
    """The width-N plan of a decode ``plan``'s verify step. ``window``: [B, N] int64, each request's
    newest token then its drafts (-1 where it has fewer); ``start``: [B] its cached KV length (the
    newest token's position); ``tables``: [B, max_blocks] its block-table rows."""
    bs, width = window.shape
    positions = (start[:, None] + np.arange(width)).reshape(-1)
    q_lens = np.full(bs, width, dtype=np.int32)
    group = GroupPlan(q_lens, (start + width).astype(np.int32), tables, plan.groups[0].block_size)
    return StepPlan(ForwardMode.DECODE, plan.request_ids, 0, np.where(window >= 0, window, 0).reshape(-1), positions,
                    q_lens, start.astype(np.int32), plan.completes, plan.emits, (group,),
                    np.arange(bs * width, dtype=np.int64), plan.sampling, verify_width=width,
                    draft_tokens=window[:, 1:], state_slots=plan.state_slots)


class TokenHistory:
    """One request's tokens (prompt, then output) in a numpy buffer that doubles when full: a verify
    step appends the tokens emitted since the last one and hands the drafter a view."""

    def __init__(self, prompt: list[int]):
        self.prompt_len = len(prompt)
        self.buffer = np.empty(max(2 * self.prompt_len, 64), dtype=np.int64)
        self.buffer[: self.prompt_len] = prompt
        self.length = self.prompt_len

    def extend_to(self, output: list[int]) -> np.ndarray:
        new = output[self.length - self.prompt_len:]
        if new:
            end = self.length + len(new)
            if end > self.buffer.shape[0]:
                grown = np.empty(max(2 * self.buffer.shape[0], end), dtype=np.int64)
                grown[: self.length] = self.buffer[: self.length]
                self.buffer = grown
            self.buffer[self.length: end] = new
            self.length = end
        return self.buffer[: self.length]
