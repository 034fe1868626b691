"""Decode-step inputs with a fixed layout: filled on the host, uploaded in one copy per dtype.

Every per-step host fact of a decode (token ids, positions, lengths, block tables, sampling
parameters) lands in pinned host buffers at fixed offsets; one non-blocking copy per dtype moves
them to persistent device buffers. The device views are what the refresh reads and what the
captured graphs read (token ids, positions, sampling parameters), so their addresses never move.
"""

from __future__ import annotations

import torch


class DecodeStaging:
    def __init__(self, max_bs: int, num_groups: int, max_blocks: int, device: torch.device):
        self.max_bs, self.num_groups, self.max_blocks = max_bs, num_groups, max_blocks
        pin = device.type == "cuda"
        b = max_bs
        # int64: ids, positions, seeds, steps
        self.h64 = torch.zeros(4 * b, dtype=torch.int64, pin_memory=pin)
        # int32: per group seq lens [G, b] and block tables [G, b, max_blocks]; top_k [b]
        self._tables_at = num_groups * b
        self._topk_at = self._tables_at + num_groups * b * max_blocks
        self.h32 = torch.zeros(self._topk_at + b, dtype=torch.int32, pin_memory=pin)
        # float32: temperature, top_p
        self.hf = torch.zeros(2 * b, dtype=torch.float32, pin_memory=pin)
        self.d64, self.d32, self.df = (t.to(device) for t in (self.h64, self.h32, self.hf))
        self.n64, self.n32, self.nf = self.h64.numpy(), self.h32.numpy(), self.hf.numpy()

        self.input_ids, self.positions = self.d64[:b], self.d64[b:2 * b]
        self.seeds, self.steps = self.d64[2 * b:3 * b], self.d64[3 * b:]
        self.top_k = self.d32[self._topk_at:]
        self.temperature, self.top_p = self.df[:b], self.df[b:]

    def seq_lens(self, group: int, n: int) -> torch.Tensor:
        return self.d32[group * self.max_bs: group * self.max_bs + n]

    def block_tables(self, group: int, n: int) -> torch.Tensor:
        start = self._tables_at + group * self.max_bs * self.max_blocks
        return self.d32[start: start + n * self.max_blocks].view(n, self.max_blocks)

    def fill(self, *, ids, positions, seeds, steps, top_k, temperature, top_p, group_lens, group_tables,
             bs: int) -> None:
        """Host-side writes for ``n = len(ids)`` live rows; rows ``[n, bs)`` become padding (greedy,
        token 0, position 0). ``group_tables[g]`` is an ``[n, max_blocks]`` int32 array."""
        n, b = len(ids), self.max_bs
        n64, n32, nf = self.n64, self.n32, self.nf
        for i, values in enumerate((ids, positions, seeds, steps)):
            n64[i * b: i * b + n] = values
            n64[i * b + n: i * b + bs] = 0
        for g in range(self.num_groups):
            n32[g * b: g * b + n] = group_lens[g]
            start = self._tables_at + g * b * self.max_blocks
            n32[start: start + n * self.max_blocks] = group_tables[g].reshape(-1)
        n32[self._topk_at: self._topk_at + n] = top_k
        n32[self._topk_at + n: self._topk_at + bs] = 1
        nf[:n], nf[n:bs] = temperature, 0.0
        nf[b: b + n], nf[b + n: b + bs] = top_p, 1.0

    def upload(self) -> None:
        self.d64.copy_(self.h64, non_blocking=True)
        self.d32.copy_(self.h32, non_blocking=True)
        self.df.copy_(self.hf, non_blocking=True)
