"""The ``triton`` attention backend: this project's own Triton kernels over the paged cache.

Kernels live in ``custom_ops/triton_attention.py`` (KV write, split-KV decode, ragged extend) and
``custom_ops/triton_metadata.py`` (the fused decode-metadata refresh); importing them registers
``impl="triton"`` for both ops. Every launch has a grid made of static shapes and no kernel wrapper
reads a tensor value on the host, so decode and extend both work under a captured CUDA graph.
On a machine without CUDA the kernels run only under ``TRITON_INTERPRET=1`` (slow; for tests).

The fused decode kernel counts the split programs that have finished each (request, KV head) in a
zeroed int32 buffer that must outlive every captured graph. The op's schema has no room for it, so
it lives in ``triton_attention``'s per-device registry; with ``FUSED_DECODE`` on, this backend
reserves it with its other persistent decode buffers (before any capture), sized for
``max_decode_bs`` x the heads it serves.
"""

from __future__ import annotations

import torch

from tscompile.attention.base import PagedAttentionBackend
from tscompile.attention.support import CudaGraphSupport
from tscompile.custom_ops import triton_attention, triton_extend, triton_metadata  # noqa: F401  (register impl="triton")
from tscompile.kv_cache.pool import KVCachePool


class TritonAttentionBackend(PagedAttentionBackend):
    impl = "triton"
    refresh_impl = "triton"
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True)

    def validate_cache_pool(self, pool: KVCachePool) -> None:
        """Refuse a cache group whose head_dim or dtype the kernels cannot serve."""
        geo = pool.geometry(self.group_id)
        triton_attention.check_supported(
            geo.head_dim, geo.dtype, what=f"the triton attention backend (cache group {self.group_id})"
        )

    def __init__(self, group_id: int, *, max_pages: int, device: torch.device):
        super().__init__(group_id, max_pages=max_pages, device=device)
        self.num_kv_heads: int | None = None
        # this backend's hold on the shared buffer (the registry keeps it alive regardless)
        self.decode_counters: torch.Tensor | None = None

    def _publish_cache_pool(self, pool: KVCachePool) -> None:
        super()._publish_cache_pool(pool)
        self.num_kv_heads = pool.geometry(self.group_id).num_kv_heads
        self._reserve_decode_counters()

    def bind_query_heads(self, num_q_heads: int) -> None:
        super().bind_query_heads(num_q_heads)
        self._reserve_decode_counters()

    def allocate_decode_buffers(self, max_decode_bs: int) -> None:
        super().allocate_decode_buffers(max_decode_bs)
        self._reserve_decode_counters()

    def _reserve_decode_counters(self) -> None:
        """One counter per (request, KV head) of the largest decode batch. Query heads bound the KV
        heads from above, so whichever of the two is known sizes it; runs again (growing, never
        during a capture) whenever the batch bound or a head count arrives."""
        heads = max(self.num_q_heads or 0, self.num_kv_heads or 0)
        if not triton_attention.FUSED_DECODE or self.seq_lens_buf is None or heads == 0:
            return  # the unfused decode (the default) counts nothing
        self.decode_counters = triton_attention.reserve_decode_counters(self.device, self.max_decode_bs * heads)

