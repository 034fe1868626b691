"""The model runner: turns a scheduled batch into one forward and one sampling call.

It knows buckets and padding; it hands block tables to the top-level attention backend and never
computes a page or a slot itself. Decode metadata comes only from ``refresh_decode_metadata``;
extend and mixed metadata only from ``init_forward_metadata``.
"""

from __future__ import annotations

from typing import Callable

import torch

from tscompile.attention.base import ForwardMode
from tscompile.attention.router import CacheGroupRouter
from tscompile.models.llama import Transformer
from tscompile.runtime.forward_context import ForwardContext, forward_context
from tscompile.runtime.scheduler import ScheduledBatch, Scheduler
from tscompile.sampling import SamplingBuffers

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModelRunner:
    def __init__(self, model: Transformer, backend: CacheGroupRouter, *, max_num_seqs: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.device = device
        self.max_decode_bs = max_num_seqs
        self.sampling = SamplingBuffers(max_num_seqs, device)
        # persistent buffers: sized by max_decode_bs, set up whether or not graphs are used
        backend.init_cuda_graph_state(self.max_decode_bs)
        self.decode_step: StepFn = self._forward_and_sample
        self.extend_step: StepFn = self._forward_and_sample

    def _forward_and_sample(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids, positions)
        return self.sampling.sample(logits)

    def _to_device(self, values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _block_tables(self, sched: Scheduler, batch: ScheduledBatch) -> dict[int, torch.Tensor]:
        slots = [r.slot for r in batch.requests]
        return {g: torch.from_numpy(t[slots]).to(self.device, non_blocking=True)
                for g, t in enumerate(sched.block_tables)}

    def _fill_sampling(self, batch: ScheduledBatch, pad_to: int) -> None:
        reqs = batch.requests
        steps = [len(r.prompt) + len(r.output) for r in reqs]
        self.sampling.fill([r.params for r in reqs], [r.seed for r in reqs], steps, pad_to)

    def execute(self, sched: Scheduler, batch: ScheduledBatch) -> list[int]:
        """Run one step; returns one sampled token per request of ``batch`` (in batch order)."""
        if batch.mode is ForwardMode.DECODE:
            return self._decode(sched, batch)
        return self._extend(sched, batch)

    def _decode(self, sched: Scheduler, batch: ScheduledBatch) -> list[int]:
        actual_bs = len(batch.decodes)
        bs = actual_bs
        lens = sched.group_lens_after(batch)
        narrowed = {g: self._to_device(lens[g]) for g, s in enumerate(sched.specs) if s.narrowed}
        self.backend.refresh_decode_metadata(
            bs, actual_bs, self._to_device([r.slot for r in batch.decodes], torch.int64), self._to_device(lens[0]),
            forward_mode=ForwardMode.DECODE, block_tables=self._block_tables(sched, batch), num_extends=0,
            for_graph_replay=False, group_seq_lens=narrowed,
        )
        ids, pos = sched.input_rows(batch)
        self._fill_sampling(batch, bs)
        with forward_context(ForwardContext(ForwardMode.DECODE, self.backend)):
            tokens = self.decode_step(self._to_device(ids, torch.int64), self._to_device(pos, torch.int64))
        return tokens[:actual_bs].tolist()

    def _extend(self, sched: Scheduler, batch: ScheduledBatch) -> list[int]:
        reqs = batch.requests
        num_extends = len(batch.extends)
        lens = sched.group_lens_after(batch)
        ext = torch.tensor([n for _, n in batch.extends], dtype=torch.int32)
        prefix = torch.tensor([r.num_computed for r, _ in batch.extends], dtype=torch.int32)
        prompt = torch.tensor([len(r.prompt) for r, _ in batch.extends], dtype=torch.int32)
        seq_lens_cpu = torch.tensor(lens[0], dtype=torch.int32)
        self.backend.init_forward_metadata(
            forward_mode=batch.mode, req_pool_indices=self._to_device([r.slot for r in reqs], torch.int64),
            seq_lens=seq_lens_cpu.to(self.device), seq_lens_cpu=seq_lens_cpu,
            block_tables=self._block_tables(sched, batch), num_extends=num_extends,
            extend_seq_lens=ext.to(self.device), extend_seq_lens_cpu=ext,
            extend_prefix_lens=prefix.to(self.device), extend_prefix_lens_cpu=prefix,
            extend_with_prefix=bool((prefix > 0).any()), extend_prompt_lens_cpu=prompt,
            group_seq_lens_cpu={g: torch.tensor(lens[g], dtype=torch.int32)
                                for g, s in enumerate(sched.specs) if s.narrowed},
        )
        completes = [r.num_computed + n == len(r.prompt) for r, n in batch.extends] + [False] * len(batch.decodes)
        ids, pos = sched.input_rows(batch)
        self._fill_sampling(batch, len(reqs))
        ctx = ForwardContext(batch.mode, self.backend, self._to_device(completes, torch.bool))
        with forward_context(ctx):
            tokens = self.extend_step(self._to_device(ids, torch.int64), self._to_device(pos, torch.int64))
        return tokens[: len(reqs)].tolist()
