"""Sampling parameters and the persistent buffers the ``tscompile::sample`` op reads and writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tscompile.utils import upload

if TYPE_CHECKING:
    from tscompile.step_plan import SamplingRows


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


@dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling parameters on the device, ``[max_rows]`` each: temperature f32, top_k i32,
    top_p f32, seeds i64, steps i64 (the position the sampled token takes)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, device: torch.device | str) -> "SamplingInputs":
        return cls(torch.zeros(max_rows, device=device), torch.ones(max_rows, dtype=torch.int32, device=device),
                   torch.ones(max_rows, device=device), torch.zeros(max_rows, dtype=torch.int64, device=device),
                   torch.zeros(max_rows, dtype=torch.int64, device=device))


class SamplingBuffers:
    """The sampling op's inputs and its persistent token output ``tokens: [max_rows] int64``.

    Eager steps and graph replays write tokens into the same ``tokens`` buffer; the runner reads
    ``tokens[:rows]``. ``inputs`` may be views of another buffer: the engine's are the decode
    staging's device buffers (``runtime/staging.py``), written by the decode upload; extend steps
    write them through ``fill`` (only while no step in flight reads them: extend steps wait)."""

    def __init__(self, inputs: SamplingInputs):
        self.inputs = inputs
        self.max_rows = inputs.seeds.shape[0]
        self.tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=inputs.seeds.device)

    def fill(self, rows: "SamplingRows") -> None:
        """The first ``n`` rows' parameters from a step plan's ``SamplingRows`` (one copy per dtype)."""
        n = rows.seeds.shape[0]
        src = upload([rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.steps], self.tokens.device)
        dst = self.inputs
        for d, x in zip((dst.temperature, dst.top_k, dst.top_p, dst.seeds, dst.steps), src):
            d[:n].copy_(x)

    def sample(self, logits: torch.Tensor, all_greedy: bool = False) -> torch.Tensor:
        """Run the sampling op on ``logits: [n, V]`` into ``tokens[:n]``; returns that slice.
        ``all_greedy`` (a host fact about the batch) skips the vocabulary sort."""
        n = logits.shape[0]
        out = self.tokens[:n]
        i = self.inputs
        torch.ops.tscompile.sample(logits, i.temperature[:n], i.top_k[:n], i.top_p[:n], i.seeds[:n], i.steps[:n],
                                   out, all_greedy)
        return out
