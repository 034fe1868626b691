"""The draft-model drafter: a smaller checkpoint with the target's tokenizer proposes k tokens by
running k of its own decode steps per verify step.

The model runs through a ``DraftModelRunner``: a second engine's parts (its own weights, paged KV
cache and graphs) behind three calls. The drafter owns only the bookkeeping: how many of each
request's tokens the draft cache holds. A verify step that rejects drafts just lowers that count
(the draft cache's later rows are overwritten next time, as the target's are), and the next
``propose`` first feeds what the cache lacks (the tokens the target emitted), then drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tscompile.custom_ops.acceptance import filtered_probs
from tscompile.spec_decode.drafter import DraftBatch, Drafter, Drafts


class DraftModelRunner(Protocol):
    """What the drafter needs from the draft model's engine parts.

    vocab_size: the draft model's vocabulary (must equal the target's; ``SpeculativeConfig.check_draft_vocab``).
    forward: append ``new_tokens[i]`` ([n_i] int64, n_i >= 1) to request ``request_ids[i]``'s draft
        cache at positions ``start_positions[i] ..`` (rows past them are stale and overwritten) and
        return ``[bs, V]`` float logits of each request's last new row, on the verify device.
    next_tokens (optional): the same step, returning the argmax of those logits ``[bs]`` int64 on the
        host; greedy drafting uses it where the runner has it (it may pick the token on the device).
    release: free a request's draft cache."""

    vocab_size: int

    def forward(self, request_ids: Sequence, new_tokens: Sequence[np.ndarray],
                start_positions: np.ndarray) -> torch.Tensor: ...

    def release(self, request_id) -> None: ...


class DraftModelDrafter(Drafter):
    """Greedy drafts by default; with ``sampling`` (per-request temperature / top-k / top-p arrays in
    the batch order) drafts are sampled from the filtered draft distribution and ``probs`` carries
    it, as rejection sampling needs. ``seed`` makes the draft draws repeatable."""

    def __init__(self, runner: DraftModelRunner, *, seed: int = 0):
        self.runner = runner
        self.cached: dict[object, int] = {}  # request -> tokens its draft cache holds (valid prefix)
        self._proposed: dict[object, int] = {}  # request -> context length at its last propose
        self._generator = torch.Generator().manual_seed(seed)

    def propose(self, batch: DraftBatch, sampling: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> Drafts:
        k, bs = batch.num_speculative_tokens, batch.size
        ids = batch.request_ids
        lengths = np.array([len(t) for t in batch.token_ids], dtype=np.int64)
        starts = np.array([min(self.cached.get(rid, 0), n - 1) for rid, n in zip(ids, lengths)], dtype=np.int64)
        feed = [np.asarray(t[s:], dtype=np.int64) for t, s in zip(batch.token_ids, starts)]
        tokens = np.full((bs, k), -1, dtype=np.int64)
        probs = [] if sampling is not None else None
        greedy_runner = getattr(self.runner, "next_tokens", None) if sampling is None else None
        for step in range(k):
            if greedy_runner is not None:  # the runner picks the argmax itself (its own graphs)
                chosen, q = greedy_runner(ids, feed, starts), None
            else:
                chosen, q = self._choose(self.runner.forward(ids, feed, starts), sampling)
            tokens[:, step] = chosen
            if probs is not None:
                probs.append(q)
            if step + 1 < k:  # the last draft is never fed: the verify step computes its row
                starts = starts + np.array([f.shape[0] for f in feed], dtype=np.int64)
                feed = [chosen[i: i + 1] for i in range(bs)]
        for rid, n in zip(ids, lengths):
            self._proposed[rid] = int(n)
            self.cached[rid] = int(n) + k - 1  # optimistic until on_accepted says otherwise
        return Drafts(tokens, None if probs is None else torch.stack(probs, 1).float())

    def _choose(self, logits: torch.Tensor, sampling) -> tuple[np.ndarray, torch.Tensor | None]:
        if sampling is None:
            return torch.argmax(logits, dim=-1).cpu().numpy().astype(np.int64), None
        temperature, top_k, top_p = (torch.as_tensor(a, device=logits.device) for a in sampling)
        q = filtered_probs(logits, temperature.float(), top_k.int(), top_p.float())
        drawn = torch.multinomial(q.cpu(), 1, generator=self._generator)[:, 0]
        return drawn.numpy().astype(np.int64), q

    def on_accepted(self, request_ids: Sequence, accepted: np.ndarray) -> None:
        """The draft cache keeps the context it was given plus the fed drafts that were accepted (it
        fed k - 1 of them); everything after is stale."""
        for rid, a in zip(request_ids, accepted):
            if rid in self._proposed:
                kept = self._proposed[rid] + int(a)
                self.cached[rid] = min(self.cached[rid], kept)

    def release(self, request_id) -> None:
        self.cached.pop(request_id, None)
        self._proposed.pop(request_id, None)
        self.runner.release(request_id)
