"""The state backend: the recurrent-state layers' node of the backend tree, beside the paged leaves.

It publishes what a linear-attention layer reads for the current forward (``StateMetadata``: each
request's state slot, its row offsets and whether it continues a state) through the router's two
metadata paths, so one refresh serves KV pages and state slots alike:

- decode: ``refresh_decode_metadata`` rewrites per-bs buffers in place (``StateSlotMetadata``),
  pointer-stable for capture and replay; padding rows read and write the null slot and start fresh;
  every live decode row continues its state (a request decodes only after its prompt's chunks ran).
  A speculative verify window of N rows per request is the same refresh with row offsets ``r * N``
  and ``checkpoints`` set: the state ops store the state after each window row in the pool's
  checkpoints, and ``commit_verify``, inside the verify step after acceptance, puts every slot back
  to its state after the kept rows (``runtime/verify_graphs.py``).
- extend / mixed: the plan's ``state_slots``, its row offsets, and ``prefix_lens > 0`` (a first
  chunk, or a preempted request's re-prefill, starts from zeros), staged with the paged leaves'
  extend arrays (``AttentionRouter.extend_host_arrays``): fresh tensors of the step's one upload,
  or a whole-step prefill graph's persistent buffers, which its replays read. Request rows past
  the live ones (a graph's request bucket) take the null slot, an empty row range and a fresh
  state, so the kernels leave every live slot alone.

Piecewise prefill graphs run the state ops eagerly between the replayed pieces, as attention; a
whole-step prefill graph captures them with the rest of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tscompile.attention.base import AttentionBackend
from tscompile.attention.support import CudaGraphSupport
from tscompile.custom_ops import gated_delta  # noqa: F401  (registers tscompile::commit_state_checkpoints)
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.state_pool import NULL_SLOT, StatePool, StateSlotMetadata
from tscompile.step_plan import StepPlan, put_padded


@dataclass(frozen=True)
class StateMetadata:
    """state_slots: [R] int64; cu_seqlens: [R + 1] int32 (request r's rows); has_state: [R] bool;
    checkpoints: a verify step's, whose state ops store the state after each row in the pool's
    checkpoints."""

    state_slots: torch.Tensor
    cu_seqlens: torch.Tensor
    has_state: torch.Tensor
    checkpoints: bool = False


class StateBackend(AttentionBackend):
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True, whole_prefill_graph=True)

    def __init__(self, pool: StatePool, device: torch.device | str, impl: str = "torch"):
        self.pool = pool
        self.device = torch.device(device)
        self.impl = impl  # the state kernels' ("torch", "triton" or "triton/pdl"), as bound to the model's layers
        self._slots = StateSlotMetadata(self.device)
        self._max_decode_bs, self._max_width = 0, 0
        self._decode_views: dict[tuple[int, int], StateMetadata] = {}  # (bs, width): built once, never moved
        self.forward_decode_metadata: StateMetadata | None = None
        self.forward_extend_metadata: StateMetadata | None = None

    def allocate_decode_buffers(self, max_decode_bs: int, max_width: int = 1) -> None:
        rows, requests = self.pool.checkpoint_rows, self.pool.checkpoint_requests
        if max_width > 1 and (rows < max_width - 1 or requests < max_decode_bs):
            raise ValueError(f"tscompile: verify steps of {max_decode_bs} requests x {max_width} rows need state "
                             f"checkpoints for as many requests and {max_width - 1} rows; the state pool has "
                             f"{requests} x {rows}: allocate it with checkpoint_requests={max_decode_bs}, "
                             f"checkpoint_rows={max_width - 1}")
        self._max_decode_bs, self._max_width = max_decode_bs, max_width
        self._decode_views = {}

    def decode_views(self, bs: int, width: int) -> StateMetadata:
        """The one per-(bs, width) builder shared by capture and refresh; the views never move once
        built. Request ``r`` owns rows ``[r * width, (r + 1) * width)``."""
        views = self._decode_views.get((bs, width))
        if views is None:
            if not (0 < bs <= self._max_decode_bs and 0 < width <= self._max_width):
                raise ValueError(f"tscompile: state decode batch {bs} x {width} rows outside the allocated decode "
                                 f"buffers ({self._max_decode_bs} x {self._max_width})")
            slots, flags = self._slots.buffers(bs)
            offsets = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32, device=self.device)
            views = self._decode_views[(bs, width)] = StateMetadata(slots, offsets, flags, checkpoints=width > 1)
        return views

    def commit_verify(self, accepted: torch.Tensor, drafts: int) -> None:
        """After acceptance in a verify step of ``drafts + 1`` rows per request (``accepted``: [bs]
        drafts kept per request, on the device): every state layer's slot back to its state after the
        kept rows, in one launch. Part of the verify step, so it is captured with it."""
        p = self.pool
        torch.ops.tscompile.commit_state_checkpoints(p.conv_all, p.ssm_all, p.conv_checkpoints, p.ssm_checkpoints,
                                                     self.forward_decode_metadata.state_slots, accepted, drafts,
                                                     self.impl)

    def refresh_decode_metadata(self, bs: int, host_state_slots: np.ndarray, width: int) -> None:
        """Write the live rows' slots (``host_state_slots``: [n] int64, n <= bs) into the ``bs``
        buffers in place; rows ``[n, bs)`` take the null slot, fresh. ``width``: rows per request."""
        views = self.decode_views(bs, width)
        n = host_state_slots.shape[0]
        self._slots.refresh(host_state_slots.tolist(), [True] * n, bs)
        self.forward_decode_metadata = views

    @staticmethod
    def extend_array_layout(requests: int) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of the extend arrays of a step padded to ``requests`` requests: state slots
        ``[R]`` int64, row offsets ``[R + 1]`` int32, continues-a-state flags ``[R]`` bool."""
        return [((requests,), np.dtype(np.int64)), ((requests + 1,), np.dtype(np.int32)), ((requests,), np.dtype(bool))]

    def fill_extend_host_arrays(self, plan: StepPlan, out: list[np.ndarray]) -> None:
        """The plan's arrays written into ``out`` (of ``extend_array_layout``'s shapes), every element:
        request rows past the plan's take the null slot, an empty row range and a fresh state."""
        if plan.state_slots.shape[0] != plan.num_requests:
            raise ValueError(f"tscompile: the step plan carries {plan.state_slots.shape[0]} state slots for "
                             f"{plan.num_requests} requests; a model with recurrent-state layers needs a scheduler "
                             "that gives every request a state slot")
        slots, cu_seqlens, has_state = out
        put_padded(slots, plan.state_slots, NULL_SLOT)
        put_padded(cu_seqlens, plan.qo_indptr, plan.qo_indptr[plan.num_requests])
        put_padded(has_state, plan.prefix_lens > 0, False)

    def init_forward_metadata(self, plan: StepPlan, arrays: list[torch.Tensor]) -> None:
        """Publish the extend metadata: ``arrays`` are ``fill_extend_host_arrays``' on the device. The
        same tensors as the step before (a whole-step graph's buffers) keep the same metadata object."""
        del plan  # the arrays carry it
        slots, cu_seqlens, has_state = arrays
        meta = self.forward_extend_metadata
        if meta is None or meta.state_slots is not slots or meta.cu_seqlens is not cu_seqlens \
                or meta.has_state is not has_state:
            self.forward_extend_metadata = StateMetadata(slots, cu_seqlens, has_state)

    def metadata(self, mode: ForwardMode) -> StateMetadata:
        meta = self.forward_decode_metadata if mode.is_decode else self.forward_extend_metadata
        if meta is None:
            raise RuntimeError(f"no {mode.value} state metadata published")
        return meta
