"""The ``triton`` attention backend: this project's own Triton kernels over the paged cache.

Kernels live in ``custom_ops/triton_attention.py`` (KV write, split-KV decode, ragged extend) and
``custom_ops/triton_metadata.py`` (the fused decode-metadata refresh), ``custom_ops/triton_verify.py``
(decode with N > 1 rows per request: a speculative verify window); importing them registers
``impl="triton"`` for both ops. Every launch has a grid made of static shapes and no kernel wrapper
reads a tensor value on the host, so decode and extend both work under a captured CUDA graph.
On a machine without CUDA the kernels run only under ``TRITON_INTERPRET=1`` (slow; for tests).
"""

from __future__ import annotations

from tscompile.attention.base import PagedAttentionBackend
from tscompile.attention.support import CudaGraphSupport
# importing them registers impl="triton"
from tscompile.custom_ops import triton_attention, triton_extend, triton_metadata, triton_verify  # noqa: F401
from tscompile.kernel_policy import KernelPolicy
from tscompile.kv_cache.pool import KVCachePool


class TritonAttentionBackend(PagedAttentionBackend):
    impl = "triton"  # the default policy's; ``use_kernel_policy`` gives an instance its own
    refresh_impl = "triton"
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True)

    def use_kernel_policy(self, policy: KernelPolicy) -> None:
        """The op's impl name carries the policy's PDL and verify-window choices to the kernels
        (``attention_impl_name``)."""
        self.impl = triton_attention.attention_impl_name(policy.decode_pdl, policy.prefill_pdl,
                                                         policy.fused_verify_attention)

    def validate_cache_pool(self, pool: KVCachePool) -> None:
        """Refuse a cache group whose head_dim or dtype the kernels cannot serve."""
        geo = pool.geometry(self.group_id)
        triton_attention.check_supported(
            geo.head_dim, geo.dtype, what=f"the triton attention backend (cache group {self.group_id})"
        )
