"""The cache-group router: the one place block tables become kernel page tables.

The scheduler speaks blocks, kernels speak pages. The router owns each group's geometry, converts
the scheduler's block tables once per forward, owns the KV write locations (``write_locations`` is
the only accessor for them), and fans metadata out to one paged leaf per cache group.
"""

from __future__ import annotations

from typing import Mapping

import torch

from tscompile.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ForwardMode,
    PagedAttentionBackend,
    reject_decode_init,
)
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.slots import expand_block_table, slot_from_page_table
from tscompile.kv_cache.spec import CacheGeometry, CacheGroupSpec, kept_rows


class CacheGroupRouter(AttentionBackend):
    """Top-level backend: ``specs[g]`` describes group ``g``; ``leaves[g]`` runs its kernels."""

    def __init__(self, specs: list[CacheGroupSpec], leaves: list[PagedAttentionBackend], *, max_model_len: int,
                 device: torch.device | str):
        assert len(specs) == len(leaves) and [lf.group_id for lf in leaves] == list(range(len(specs)))
        self.specs = list(specs)
        self.leaves = list(leaves)
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.layer_group = {lid: gid for gid, s in enumerate(specs) for lid in s.layer_ids}
        self.geometry: dict[int, CacheGeometry] | None = None
        self.pool: KVCachePool | None = None
        self._write_loc_stack: torch.Tensor | None = None  # [G, max_decode_bs] int64
        self._decode_write_locs_by_bs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.decode_write_locations: tuple[torch.Tensor, ...] | None = None
        self.extend_write_locations: tuple[torch.Tensor, ...] | None = None

    def child_backends(self) -> list[AttentionBackend]:
        return list(self.leaves)

    # -- pool ------------------------------------------------------------------------------------
    def validate_cache_pool(self, pool: KVCachePool) -> None:
        if sorted(pool.groups) != list(range(len(self.specs))):
            raise ValueError(f"tscompile: pool has cache groups {sorted(pool.groups)}, model needs {len(self.specs)}")
        for gid, spec in enumerate(self.specs):
            geo = pool.geometry(gid)
            want = (spec.num_kv_heads, spec.head_dim, spec.layer_ids)
            got = (geo.num_kv_heads, geo.head_dim, geo.layer_ids)
            if got != want:
                raise ValueError(f"tscompile: pool group {gid} geometry (kv_heads, head_dim, layers)={got}, "
                                 f"model needs {want}")
            if self.geometry is not None:
                old = self.geometry[gid]
                if (old.page_size, old.pages_per_block, old.dtype) != (geo.page_size, geo.pages_per_block, geo.dtype):
                    raise ValueError(
                        f"tscompile: rebind changes group {gid} layout (page_size, pages_per_block, dtype) from "
                        f"{(old.page_size, old.pages_per_block, old.dtype)} to "
                        f"{(geo.page_size, geo.pages_per_block, geo.dtype)}; only the page count may change"
                    )

    def _publish_cache_pool(self, pool: KVCachePool) -> None:
        self.pool = pool
        self.geometry = {gid: pool.geometry(gid) for gid in pool.groups}
        self.decode_write_locations = None
        self.extend_write_locations = None

    def max_pages(self, gid: int) -> int:
        return self.leaves[gid].max_pages

    # -- decode ----------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_decode_bs: int) -> None:
        self._write_loc_stack = torch.zeros(len(self.specs), max_decode_bs, dtype=torch.int64, device=self.device)
        self._decode_write_locs_by_bs = {}
        super().init_cuda_graph_state(max_decode_bs)

    def _decode_write_locs(self, bs: int) -> tuple[torch.Tensor, ...]:
        views = self._decode_write_locs_by_bs.get(bs)
        if views is None:
            views = tuple(self._write_loc_stack[g, :bs] for g in range(len(self.specs)))
            self._decode_write_locs_by_bs[bs] = views
        return views

    def _check_live_delivery(self, block_tables: Mapping[int, torch.Tensor]) -> None:
        missing = [g for g in range(len(self.specs)) if g not in block_tables]
        if missing:
            raise ValueError(f"tscompile: block_tables omits cache groups {missing}; every group must be delivered")

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
        group_seq_lens: Mapping[int, torch.Tensor],
        **cache_kwargs,
    ) -> None:
        """``seq_lens`` are the full group's lengths; ``group_seq_lens`` carries every narrowed group's."""
        if self._write_loc_stack is None:
            raise RuntimeError("init_cuda_graph_state must run before any decode metadata call")
        self._check_live_delivery(block_tables)
        write_locs = self._decode_write_locs(bs)
        for gid, leaf in enumerate(self.leaves):
            lens = self._group_lens(gid, seq_lens, group_seq_lens)
            leaf.refresh_decode_metadata(
                bs, actual_bs, req_pool_indices, lens,
                forward_mode=forward_mode, block_tables=block_tables, num_extends=num_extends,
                for_graph_replay=for_graph_replay, write_loc_out=write_locs[gid],
            )
        self.decode_write_locations = write_locs

    def _group_lens(self, gid: int, seq_lens: torch.Tensor, group_seq_lens: Mapping[int, torch.Tensor]):
        if not self.specs[gid].narrowed:
            return seq_lens
        if gid not in group_seq_lens:
            raise ValueError(f"tscompile: narrowed cache group {gid} ({self.specs[gid].name}) needs group_seq_lens")
        return group_seq_lens[gid]

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
        extend_prompt_lens_cpu: torch.Tensor,
        group_seq_lens_cpu: Mapping[int, torch.Tensor],
        pad_rows: Mapping[int, int] | None = None,
        **cache_kwargs,
    ) -> None:
        """Requests ``[0, num_extends)`` extend by ``extend_seq_lens_cpu``; the rest decode one row.

        ``seq_lens_cpu`` (full group) and ``group_seq_lens_cpu`` (narrowed groups) are KV lengths
        after this forward. Every tensor built here is fresh storage. ``pad_rows[g]``: the forward
        runs group ``g``'s layers on that many rows (a CUDA-graph bucket); the rows past the live ones
        write to the null page."""
        reject_decode_init(forward_mode)
        self._check_live_delivery(block_tables)
        num_reqs = seq_lens_cpu.shape[0]
        ext = extend_seq_lens_cpu[:num_extends].tolist()
        completes = [p + e == n for p, e, n in zip(extend_prefix_lens_cpu.tolist(), ext, extend_prompt_lens_cpu.tolist())]
        completes += [False] * (num_reqs - num_extends)
        q_lens = ext + [1] * (num_reqs - num_extends)
        write_locs = []
        for gid, (spec, leaf) in enumerate(zip(self.specs, self.leaves)):
            geo = self.geometry[gid]
            g_q = torch.tensor([kept_rows(q, c, spec.window) for q, c in zip(q_lens, completes)], dtype=torch.int64)
            g_kv = self._group_lens(gid, seq_lens_cpu, group_seq_lens_cpu).to(torch.int64)
            indptr = torch.cat([g_q.new_zeros(1), g_q.cumsum(0)])
            rows_req = torch.repeat_interleave(torch.arange(num_reqs), g_q)
            positions = (g_kv - g_q)[rows_req] + torch.arange(rows_req.numel()) - indptr[:-1][rows_req]
            page_table = expand_block_table(block_tables[gid][:num_reqs].to(self.device), geo.pages_per_block,
                                            leaf.max_pages)
            rows = page_table.index_select(0, rows_req.to(self.device))
            locs = slot_from_page_table(rows, positions.to(self.device), geo.page_size)
            pad = (pad_rows or {}).get(gid, 0) - locs.shape[0]
            if pad > 0:  # slot 0 lies in the null page
                locs = torch.cat([locs, locs.new_zeros(pad)])
            write_locs.append(locs)
            leaf.init_forward_metadata(
                forward_mode=forward_mode, req_pool_indices=req_pool_indices,
                seq_lens=g_kv.to(torch.int32).to(self.device), seq_lens_cpu=g_kv.to(torch.int32),
                block_tables=block_tables,
                num_extends=num_extends, extend_seq_lens=extend_seq_lens, extend_seq_lens_cpu=extend_seq_lens_cpu,
                extend_prefix_lens=extend_prefix_lens, extend_prefix_lens_cpu=extend_prefix_lens_cpu,
                extend_with_prefix=extend_with_prefix, page_table=page_table,
                qo_indptr=indptr.to(torch.int32).to(self.device),
            )
        self.extend_write_locations = tuple(write_locs)

    # -- what the model reads ----------------------------------------------------------------------
    def write_locations(self, layer_id: int, forward_mode: ForwardMode) -> torch.Tensor:
        """The KV write slots of ``layer_id``'s group for the current forward; the only accessor."""
        locs = self.decode_write_locations if forward_mode.is_decode else self.extend_write_locations
        if locs is None:
            raise RuntimeError(f"no {forward_mode.value} write locations published")
        return locs[self.layer_group[layer_id]]

    def metadata(self, layer_id: int, forward_mode: ForwardMode) -> AttentionMetadata:
        return self.leaves[self.layer_group[layer_id]].metadata(forward_mode)

    def forward(self, layer_id: int, forward_mode: ForwardMode, q, k, v, k_cache, v_cache, out, scale: float) -> None:
        leaf = self.leaves[self.layer_group[layer_id]]
        leaf.forward(q, k, v, k_cache, v_cache, out, leaf.metadata(forward_mode),
                     self.write_locations(layer_id, forward_mode), scale)
