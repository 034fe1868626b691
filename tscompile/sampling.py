"""Sampling parameters and the persistent buffers the ``tscompile::sample`` op reads and writes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature <= 0`` or ``top_k == 1`` is greedy; ``top_k == 0`` is the whole vocabulary."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"tscompile: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.top_k < 0:
            raise ValueError(f"tscompile: top_k must be >= 0 (0 = whole vocabulary), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"tscompile: top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"tscompile: temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1


class SamplingBuffers:
    """Persistent per-row sampling inputs and the token output, ``[max_rows]`` each on ``device``.

    Eager steps and graph replays write tokens into the same ``tokens`` buffer; the runner reads
    ``tokens[:actual_rows]``."""

    def __init__(self, max_rows: int, device: torch.device | str, *, temperature=None, top_k=None, top_p=None,
                 seeds=None, steps=None):
        """Parameter buffers may be views of a staging area (``runtime/staging.py``)."""
        self.max_rows = max_rows
        self.temperature = temperature if temperature is not None else torch.zeros(max_rows, device=device)
        self.top_k = top_k if top_k is not None else torch.ones(max_rows, dtype=torch.int32, device=device)
        self.top_p = top_p if top_p is not None else torch.ones(max_rows, device=device)
        self.seeds = seeds if seeds is not None else torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.steps = steps if steps is not None else torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def fill(self, params: list[SamplingParams], seeds: list[int], steps: list[int], pad_to: int) -> None:
        """Host -> device copy of the live rows' parameters; rows ``[len(params), pad_to)`` are greedy."""
        n = len(params)
        rows = torch.tensor(
            [[p.temperature, p.top_k, p.top_p] for p in params] + [[0.0, 1, 1.0]] * (pad_to - n), dtype=torch.float64
        )
        ints = torch.tensor([[s, t] for s, t in zip(seeds, steps)] + [[0, 0]] * (pad_to - n), dtype=torch.int64)
        self.temperature[:pad_to].copy_(rows[:, 0], non_blocking=True)
        self.top_k[:pad_to].copy_(rows[:, 1], non_blocking=True)
        self.top_p[:pad_to].copy_(rows[:, 2], non_blocking=True)
        self.seeds[:pad_to].copy_(ints[:, 0], non_blocking=True)
        self.steps[:pad_to].copy_(ints[:, 1], non_blocking=True)

    def sample(self, logits: torch.Tensor, all_greedy: bool = False) -> torch.Tensor:
        """Run the sampling op on ``logits: [n, V]`` into ``tokens[:n]``; returns that slice.
        ``all_greedy`` (a host fact about the batch) skips the vocabulary sort."""
        n = logits.shape[0]
        out = self.tokens[:n]
        torch.ops.tscompile.sample(logits, self.temperature[:n], self.top_k[:n], self.top_p[:n],
                                   self.seeds[:n], self.steps[:n], out, all_greedy)
        return out
