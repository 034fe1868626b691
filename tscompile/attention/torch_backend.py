"""The ``torch`` attention backend: pure PyTorch over the paged cache, on any device.

It is the oracle every other backend is tested against (float32 accumulation). Its decode path
never reads the host, so decode graphs work; its extend path loops over requests on the host,
which is fine because prefill attention runs eagerly at the graph breaks.
"""

from __future__ import annotations

from tscompile.attention.base import PagedAttentionBackend
from tscompile.attention.support import CudaGraphSupport


class TorchAttentionBackend(PagedAttentionBackend):
    impl = "torch"
    refresh_impl = "torch"
    # its extend loops over the batch on the host (``.tolist()`` of the lengths): never inside a graph
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True, whole_prefill_graph=False)
