"""The attention backend contract: a tree of nodes, the router on top (``router.py``) and one paged
leaf per cache group that runs the kernels.

What every method is for, and when it runs:

- ``set_cache_pool(pool)``: bind or rebind the KV pool; the whole tree validates before any node
  publishes, so a rejected pool changes nothing.
- ``allocate_decode_buffers(max_decode_bs, max_width)``: once, when the engine is built: the
  persistent decode metadata buffers, sized by ``max_decode_bs`` requests of up to ``max_width``
  query rows each (a speculative verify window; 1, the default, is plain decode). Eager decode
  uses them too, so it runs with or without graphs.
- ``bind_query_heads(num_q_heads)``: once, by the model runner: the query heads per layer, for
  backends that plan kernels on the host (the KV cache alone says only the KV heads).
- ``refresh_decode_metadata``: the one decode metadata path. It rewrites the persistent buffers in
  place for eager decode, before every graph replay and (through the router's idle refresh) at
  capture; rows past the live ones resolve to the null page 0. A step of width N (N query rows per
  request, positions ``seq_len - N .. seq_len - 1``) publishes ``bs * N`` write slots; views are
  pointer-stable per (bs, N). It gets the live rows' block
  tables and lengths on the device and, where the caller has them, on the host too (a host
  planner such as FlashInfer's ``plan()`` reads those; the torch and Triton leaves ignore them).
- ``init_forward_metadata``: extend and mixed steps only, fresh storage each call (no later step
  refills a buffer an earlier one may still read); a pure decode is refused.

Nothing here knows whether a graph is being captured, replayed or run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from tscompile.attention.support import CudaGraphSupport
from tscompile.custom_ops.metadata import run_refresh
from tscompile.forward_context import ForwardMode
from tscompile.kernel_policy import KernelPolicy
from tscompile.kv_cache.pool import KVCachePool
from tscompile.step_plan import GroupPlan


@dataclass(frozen=True)
class AttentionMetadata:
    """Kernel-facing metadata of one cache group for one forward (device tensors).

    page_table: [B, max_pages] int32; seq_lens: [B] int32 (after this forward's writes);
    qo_indptr: [B + 1] int32; decode: every request has the same number N of query rows
    (qo_indptr = arange(B + 1) * N; N = 1 is plain decode, N > 1 a verify window).
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor
    decode: bool


class AttentionBackend:
    """A node of the backend tree: pool binding and the graph-support declaration."""

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


def decode_width(bs: int, write_loc_out: torch.Tensor) -> int:
    """N, the query rows per request of a decode refresh, from its write slots' length ``bs * N``."""
    rows = write_loc_out.shape[0]
    if bs <= 0 or rows % bs or rows == 0:
        raise ValueError(f"tscompile: a decode refresh of {bs} requests got {rows} write slots; it needs bs * N "
                         "(N query rows per request)")
    return rows // bs


def reject_decode_init(mode: ForwardMode) -> None:
    if mode is ForwardMode.DECODE:
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
    # the decode refresh reads host arrays (a host planner): it cannot be replayed inside a graph
    refresh_reads_host: ClassVar[bool] = False

    def __init__(self, group_id: int, *, max_pages: int, device: torch.device):
        self.group_id = group_id
        self.max_pages = max_pages
        self.device = torch.device(device)
        self.page_size: int | None = None
        self.pages_per_block: int | None = None
        self.page_table_buf: torch.Tensor | None = None  # [max_decode_bs, max_pages] int32
        self.seq_lens_buf: torch.Tensor | None = None  # [max_decode_bs] int32
        self.qo_indptr_buf: torch.Tensor | None = None  # [max_width, max_decode_bs + 1] int32, row w-1: arange * w
        self._decode_views_by_bs: dict[int, AttentionMetadata] = {}  # plain decode (width 1), by bs
        self._window_views: dict[tuple[int, int], AttentionMetadata] = {}  # verify windows, by (bs, width)
        self.forward_decode_metadata: AttentionMetadata | None = None
        self.forward_extend_metadata: AttentionMetadata | None = None
        self.num_q_heads: int | None = None

    def bind_query_heads(self, num_q_heads: int) -> None:
        self.num_q_heads = num_q_heads

    def use_kernel_policy(self, policy: KernelPolicy) -> None:
        """Once, when the engine is built: the engine's kernel choices, for a leaf whose kernels have
        any (the Triton leaf's PDL launches); the others ignore it."""

    def _publish_cache_pool(self, pool: KVCachePool) -> None:
        geo = pool.geometry(self.group_id)
        self.page_size, self.pages_per_block = geo.page_size, geo.pages_per_block
        self.forward_decode_metadata = None
        self.forward_extend_metadata = None

    def allocate_decode_buffers(self, max_decode_bs: int, max_width: int = 1) -> None:
        """One page-table row and length per request whatever the width (a window's N rows share
        their request's); the query offsets of every width up to ``max_width``."""
        if max_width < 1:
            raise ValueError(f"tscompile: max_width={max_width}; a decode step has at least 1 row per request")
        self.page_table_buf = torch.zeros(max_decode_bs, self.max_pages, dtype=torch.int32, device=self.device)
        self.seq_lens_buf = torch.zeros(max_decode_bs, dtype=torch.int32, device=self.device)
        widths = torch.arange(1, max_width + 1, dtype=torch.int32, device=self.device)
        self.qo_indptr_buf = widths[:, None] * torch.arange(max_decode_bs + 1, dtype=torch.int32, device=self.device)
        self._decode_views_by_bs = {}
        self._window_views = {}

    @property
    def max_decode_width(self) -> int:
        if self.qo_indptr_buf is None:
            raise RuntimeError("allocate_decode_buffers must run before any decode metadata call")
        return self.qo_indptr_buf.shape[0]

    @property
    def max_decode_bs(self) -> int:
        if self.seq_lens_buf is None:
            raise RuntimeError("allocate_decode_buffers must run before any decode metadata call")
        return self.seq_lens_buf.shape[0]

    def decode_views(self, bs: int, width: int = 1) -> AttentionMetadata:
        """The one per-(bs, width) builder shared by capture and refresh; views never move once built."""
        built = self._decode_views_by_bs if width == 1 else self._window_views
        key = bs if width == 1 else (bs, width)
        views = built.get(key)
        if views is None:
            if not 0 < bs <= self.max_decode_bs:
                raise ValueError(f"tscompile: decode batch {bs} outside [1, max_decode_bs={self.max_decode_bs}]")
            if not 0 < width <= self.max_decode_width:
                raise ValueError(f"tscompile: decode width {width} outside [1, max_width={self.max_decode_width}]; "
                                 "allocate_decode_buffers sets the widest verify window")
            views = AttentionMetadata(self.page_table_buf[:bs], self.seq_lens_buf[:bs],
                                      self.qo_indptr_buf[width - 1, : bs + 1], True)
            built[key] = views
        return views

    def refresh_decode_metadata(self, bs: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                write_loc_out: torch.Tensor, host_block_table: np.ndarray | None,
                                host_seq_lens: np.ndarray | None) -> None:
        """Rewrite this group's decode buffers for ``bs`` requests in place.

        block_table: [n, max_blocks] int32 and seq_lens: [n] int32 of the n live rows (n <= bs; rows
        past them are padding, resolved to the null page; seq_lens count the whole window);
        write_loc_out: [bs * N] int64, mutated: its length says the window width N (query rows per
        request; bs: plain decode). host_block_table / host_seq_lens: the same rows on the host
        (numpy), for host planners."""
        width = decode_width(bs, write_loc_out)
        views = self.decode_views(bs, width)
        # the op when traced (graphs, export); its body directly when run eagerly (the usual case)
        refresh = torch.ops.tscompile.refresh_decode_metadata if torch.compiler.is_compiling() else run_refresh
        if width == 1:  # the plain decode call, unchanged (exported programs record this form)
            refresh(block_table, seq_lens, views.page_table, views.seq_lens, write_loc_out,
                    self.pages_per_block, self.page_size, self.refresh_impl)
        else:
            refresh(block_table, seq_lens, views.page_table, views.seq_lens, write_loc_out,
                    self.pages_per_block, self.page_size, self.refresh_impl, width)
        self.forward_decode_metadata = views

    def init_forward_metadata(self, group: GroupPlan, meta: AttentionMetadata) -> None:
        """Publish this extend/mixed forward's metadata (fresh storage, built by the router from the
        plan). ``group`` carries the same facts on the host for backends that plan on the host."""
        self.forward_extend_metadata = meta

    def metadata(self, mode: ForwardMode) -> AttentionMetadata:
        meta = self.forward_decode_metadata if mode.is_decode else self.forward_extend_metadata
        if meta is None:
            raise RuntimeError(f"no {mode.value} metadata published for cache group {self.group_id}")
        return meta

    def forward(self, q, k, v, k_cache, v_cache, out, meta: AttentionMetadata, write_loc, scale: float) -> None:
        torch.ops.tscompile.attention(
            q, k, v, k_cache, v_cache, out, meta.page_table, meta.seq_lens, meta.qo_indptr, write_loc,
            scale, meta.decode, self.impl,
        )
