"""The attention backend contract (runner-facing nodes and kernel-facing paged leaves).

One decode metadata path: ``refresh_decode_metadata`` rewrites persistent buffers in place, for
eager decode, graph capture (inherited: the idle refresh over placeholder tables) and replay alike.
``init_forward_metadata`` serves extend and mixed forwards only and builds fresh storage each call,
so no later forward refills a buffer an earlier one may still read. Its extend inputs are one
required keyword-only bundle with no defaults on every node.

Nothing here knows whether a graph is being captured, replayed or run eagerly, beyond the
``for_graph_replay`` flag, which only graph-mechanics asymmetries may branch on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from tscompile.attention.support import CudaGraphSupport
from tscompile.custom_ops.metadata import run_refresh
from tscompile.kv_cache.pool import KVCachePool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill chunks only
    DECODE = "decode"  # one new row per request
    MIXED = "mixed"  # extend requests first, then decode requests
    IDLE = "idle"  # no live request (graph capture, warm-up)

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass(frozen=True)
class AttentionMetadata:
    """Kernel-facing metadata of one cache group for one forward (device tensors).

    page_table: [B, max_pages] int32; seq_lens: [B] int32 (after this forward's writes);
    qo_indptr: [B + 1] int32; decode: every request has one query row.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor
    decode: bool


class AttentionBackend:
    """A node of the backend tree. The top-level node is what the runner and the model talk to."""

    cuda_graph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport(decode_graph=True, prefill_graph=True)

    def child_backends(self) -> list["AttentionBackend"]:
        return []

    # -- cache pool binding: validate the whole tree, then publish; never overridden ------------
    def set_cache_pool(self, pool: KVCachePool) -> None:
        """Bind (or rebind) the KV pool. A rejected pool raises before any node changes."""
        self._validate_tree(pool)
        self._publish_tree(pool)

    def _validate_tree(self, pool: KVCachePool) -> None:
        self.validate_cache_pool(pool)
        for child in self.child_backends():
            child._validate_tree(pool)

    def _publish_tree(self, pool: KVCachePool) -> None:
        for child in self.child_backends():
            child._publish_tree(pool)
        self._publish_cache_pool(pool)

    def validate_cache_pool(self, pool: KVCachePool) -> None:
        """Raise ``ValueError('tscompile: ...')`` if this node cannot serve ``pool``; change nothing."""

    def _publish_cache_pool(self, pool: KVCachePool) -> None:
        """This node's own binding work; runs only after the whole tree validated."""

    # -- persistent decode state -----------------------------------------------------------------
    def init_cuda_graph_state(self, max_decode_bs: int) -> None:
        """Allocate the persistent decode buffers, sized by ``max_decode_bs`` (not by the ladder).

        Runs whether or not graphs are enabled: eager decode uses the same buffers."""
        for child in self.child_backends():
            child.init_cuda_graph_state(max_decode_bs)

    def refresh_decode_metadata(
        self,
        bs: int,
        actual_bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        forward_mode: ForwardMode,
        block_tables: Mapping[int, torch.Tensor],
        num_extends: int,
        for_graph_replay: bool,
        **cache_kwargs,
    ) -> None:
        """Rewrite the persistent decode metadata for ``bs`` rows in place; rows in
        ``[actual_bs, bs)`` are padding and resolve to the null page 0. Never allocates storage."""
        raise NotImplementedError

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        block_tables: Mapping[int, torch.Tensor],
        **cache_kwargs,
    ) -> None:
        """Capture is inherited: the idle refresh over the runner's placeholder tables."""
        self.refresh_decode_metadata(
            bs, 0, req_pool_indices, seq_lens,
            forward_mode=ForwardMode.DECODE, block_tables=block_tables, num_extends=0,
            for_graph_replay=True, **cache_kwargs,
        )

    # -- extend / mixed --------------------------------------------------------------------------
    def init_forward_metadata(
        self,
        *,
        forward_mode: ForwardMode,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        block_tables: Mapping[int, torch.Tensor],
        num_extends: int,
        extend_seq_lens: torch.Tensor,
        extend_seq_lens_cpu: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_prefix_lens_cpu: torch.Tensor,
        extend_with_prefix: bool,
        **cache_kwargs,
    ) -> None:
        """Fresh metadata for an extend or mixed forward. A pure decode raises: decode has one path."""
        raise NotImplementedError


def reject_decode_init(forward_mode: ForwardMode) -> None:
    if forward_mode is ForwardMode.DECODE:
        raise ValueError(
            "tscompile: init_forward_metadata does not serve DECODE; decode metadata comes only from "
            "refresh_decode_metadata"
        )


class PagedAttentionBackend(AttentionBackend):
    """A kernel-facing leaf for one cache group. It sees page tables, seq lens and write locations,
    never block tables' provenance or other groups. It owns its persistent decode buffers
    (``page_table_buf``, ``seq_lens_buf``) and the per-bs views over them.

    Subclasses set ``impl`` (the ``tscompile::attention`` kernel name) and may restrict the kernel
    geometry in ``validate_cache_pool``.
    """

    impl: ClassVar[str] = ""  # tscompile::attention kernel
    refresh_impl: ClassVar[str] = "torch"  # tscompile::refresh_decode_metadata kernel

    def __init__(self, group_id: int, *, max_pages: int, device: torch.device):
        self.group_id = group_id
        self.max_pages = max_pages
        self.device = torch.device(device)
        self.page_size: int | None = None
        self.pages_per_block: int | None = None
        self.page_table_buf: torch.Tensor | None = None  # [max_decode_bs, max_pages] int32
        self.seq_lens_buf: torch.Tensor | None = None  # [max_decode_bs] int32
        self.qo_indptr_buf: torch.Tensor | None = None  # [max_decode_bs + 1] int32, arange
        self._decode_views_by_bs: dict[int, AttentionMetadata] = {}
        self.forward_decode_metadata: AttentionMetadata | None = None
        self.forward_extend_metadata: AttentionMetadata | None = None

    def _publish_cache_pool(self, pool: KVCachePool) -> None:
        geo = pool.geometry(self.group_id)
        self.page_size, self.pages_per_block = geo.page_size, geo.pages_per_block
        self.forward_decode_metadata = None
        self.forward_extend_metadata = None

    def init_cuda_graph_state(self, max_decode_bs: int) -> None:
        self.page_table_buf = torch.zeros(max_decode_bs, self.max_pages, dtype=torch.int32, device=self.device)
        self.seq_lens_buf = torch.zeros(max_decode_bs, dtype=torch.int32, device=self.device)
        self.qo_indptr_buf = torch.arange(max_decode_bs + 1, dtype=torch.int32, device=self.device)
        self._decode_views_by_bs = {}

    @property
    def max_decode_bs(self) -> int:
        if self.seq_lens_buf is None:
            raise RuntimeError("init_cuda_graph_state must run before any decode metadata call")
        return self.seq_lens_buf.shape[0]

    def decode_views(self, bs: int) -> AttentionMetadata:
        """The one per-bs builder shared by capture and refresh; views never move once built."""
        views = self._decode_views_by_bs.get(bs)
        if views is None:
            if not 0 < bs <= self.max_decode_bs:
                raise ValueError(f"tscompile: decode batch {bs} outside [1, max_decode_bs={self.max_decode_bs}]")
            views = AttentionMetadata(self.page_table_buf[:bs], self.seq_lens_buf[:bs], self.qo_indptr_buf[: bs + 1], True)
            self._decode_views_by_bs[bs] = views
        return views

    def refresh_decode_metadata(
        self,
        bs: int,
        actual_bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        forward_mode: ForwardMode,
        block_tables: Mapping[int, torch.Tensor],
        num_extends: int,
        for_graph_replay: bool,
        write_loc_out: torch.Tensor,
        **cache_kwargs,
    ) -> None:
        views = self.decode_views(bs)
        table = block_tables[self.group_id][num_extends : num_extends + actual_bs]
        # the op when traced (graphs, export); its body directly when run eagerly (the usual case)
        refresh = torch.ops.tscompile.refresh_decode_metadata if torch.compiler.is_compiling() else run_refresh
        refresh(table, seq_lens[:actual_bs], views.page_table, views.seq_lens, write_loc_out,
                self.pages_per_block, self.page_size, self.refresh_impl)
        self.forward_decode_metadata = views

    def init_forward_metadata(
        self,
        *,
        forward_mode: ForwardMode,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        block_tables: Mapping[int, torch.Tensor],
        num_extends: int,
        extend_seq_lens: torch.Tensor,
        extend_seq_lens_cpu: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_prefix_lens_cpu: torch.Tensor,
        extend_with_prefix: bool,
        page_table: torch.Tensor,
        qo_indptr: torch.Tensor,
        **cache_kwargs,
    ) -> None:
        """Publish the router-built page table (fresh storage) for this extend forward."""
        reject_decode_init(forward_mode)
        self.forward_extend_metadata = AttentionMetadata(page_table, seq_lens, qo_indptr, False)

    def metadata(self, forward_mode: ForwardMode) -> AttentionMetadata:
        meta = self.forward_decode_metadata if forward_mode.is_decode else self.forward_extend_metadata
        if meta is None:
            raise RuntimeError(f"no {forward_mode.value} metadata published for cache group {self.group_id}")
        return meta

    def forward(self, q, k, v, k_cache, v_cache, out, meta: AttentionMetadata, write_loc, scale: float) -> None:
        torch.ops.tscompile.attention(
            q, k, v, k_cache, v_cache, out, meta.page_table, meta.seq_lens, meta.qo_indptr, write_loc,
            scale, meta.decode, self.impl,
        )
