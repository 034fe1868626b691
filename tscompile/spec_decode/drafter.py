"""The drafter interface: propose up to k tokens per request for a verify step, hear what was kept.

A drafter sees each request's tokens so far (prompt and output, the newest accepted token last)
and returns ``Drafts``: ``[bs, k]`` token ids padded with -1 where it has fewer to offer, and
optionally the draft distribution ``q`` of each proposed token (a drafter without one is one-hot,
as the acceptance ops treat it). After the verify step ``on_accepted`` says how many of each
request's drafts were kept, so a drafter with state (a draft model's KV length) rolls it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DraftBatch:
    """The requests of one verify step, on the host.

    request_ids: one hashable id per request; token_ids[i]: [L_i] int64, request i's prompt then its
    accepted output (the newest token last); prompt_lens[i]: how many of them are prompt;
    num_speculative_tokens: k, the most drafts any request may get."""

    request_ids: tuple
    token_ids: tuple[np.ndarray, ...]
    prompt_lens: tuple[int, ...]
    num_speculative_tokens: int

    def __post_init__(self):
        if not len(self.request_ids) == len(self.token_ids) == len(self.prompt_lens):
            raise ValueError(f"tscompile: a draft batch needs one request id, token array and prompt length per "
                             f"request; got {len(self.request_ids)}, {len(self.token_ids)}, {len(self.prompt_lens)}")

    @property
    def size(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class Drafts:
    """tokens: [bs, k] int64, each row's drafts then -1 (a drafter may offer fewer than k, or none);
    probs: [bs, k, V] float32 on the verify device, q of each draft position (already under the
    request's temperature / top-k / top-p), or None: one-hot at the draft token."""

    tokens: np.ndarray
    probs: torch.Tensor | None = None

    @property
    def counts(self) -> np.ndarray:
        """[bs] int32: the leading drafts of each row (a -1 ends a row's drafts)."""
        valid = self.tokens >= 0
        return np.cumprod(valid, axis=1).sum(axis=1).astype(np.int32)

    def window_input_ids(self, last_tokens: np.ndarray) -> np.ndarray:
        """The verify step's input ids ``[bs * (k + 1)]`` int64: each request's newest accepted token
        then its drafts, a -1 pad replaced by token 0 (its row's output is never used: the acceptance
        ops stop a request's run at its first pad)."""
        window = np.concatenate([last_tokens.reshape(-1, 1).astype(np.int64), self.tokens], axis=1)
        return np.where(window >= 0, window, 0).reshape(-1)


class Drafter:
    """Base class: ``propose`` for a batch; ``on_accepted`` and ``release`` are no-ops unless the
    drafter keeps per-request state."""

    def propose(self, batch: DraftBatch) -> Drafts:
        raise NotImplementedError

    def on_accepted(self, request_ids: Sequence, accepted: np.ndarray) -> None:
        """``accepted[i]``: drafts of ``request_ids[i]`` the last verify step kept (it emitted one more)."""

    def release(self, request_id) -> None:
        """The request finished or was preempted: drop what the drafter keeps for it."""


def pad_rows(rows: Sequence[Sequence[int]], k: int) -> np.ndarray:
    """Host helper: ``[len(rows), k]`` int64, each row's first k ids then -1."""
    out = np.full((len(rows), k), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        row = np.asarray(row[:k], dtype=np.int64)
        out[i, : row.shape[0]] = row
    return out
