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
- extend / mixed: fresh tensors from the plan: its ``state_slots``, its row offsets, and
  ``prefix_lens > 0`` (a first chunk, or a preempted request's re-prefill, starts from zeros).

Piecewise prefill graphs are supported: the state ops are split ops, so they run eagerly between the
replayed pieces, as attention does, and read this step's fresh extend metadata. Whole-step prefill
graphs are not: they would keep the storage of the step that captured them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tscompile.attention.base import AttentionBackend
from tscompile.attention.support import CudaGraphSupport
from tscompile.custom_ops import gated_delta  # noqa: F401  (registers tscompile::commit_state_checkpoints)
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.state_pool import StatePool, StateSlotMetadata
from tscompile.step_plan import StepPlan


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
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True, whole_prefill_graph=False)

    def __init__(self, pool: StatePool, device: torch.device | str, impl: str = "torch"):
        self.pool = pool
        self.device = torch.device(device)
        self.impl = impl  # the state kernels' ("torch" or "triton"), as bound to the model's layers
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

    def init_forward_metadata(self, plan: StepPlan) -> None:
        if plan.state_slots.shape[0] != plan.num_requests:
            raise ValueError(f"tscompile: the step plan carries {plan.state_slots.shape[0]} state slots for "
                             f"{plan.num_requests} requests; a model with recurrent-state layers needs a scheduler "
                             "that gives every request a state slot")
        host = (plan.state_slots.astype(np.int64), plan.qo_indptr.astype(np.int32), plan.prefix_lens > 0)
        self.forward_extend_metadata = StateMetadata(*(torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
                                                       for a in host))

    def metadata(self, mode: ForwardMode) -> StateMetadata:
        meta = self.forward_decode_metadata if mode.is_decode else self.forward_extend_metadata
        if meta is None:
            raise RuntimeError(f"no {mode.value} state metadata published")
        return meta
