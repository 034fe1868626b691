"""The attention router: the one place block tables become kernel page tables.

The scheduler speaks blocks, kernels speak pages. The router owns each group's geometry, converts
the plan's block tables once per forward, owns the KV write locations (``write_locations`` is the
only accessor for them), and fans metadata out to one paged leaf per cache group. Models reach it
through the forward context and call ``forward`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from tscompile.attention.base import AttentionBackend, AttentionMetadata, PagedAttentionBackend, reject_decode_init
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.slots import expand_block_table_rows
from tscompile.kv_cache.spec import CacheGeometry, CacheGroupSpec
from tscompile.step_plan import StepPlan, put_padded
from tscompile.utils import upload


@dataclass(frozen=True)
class DecodeInputs:
    """What a decode refresh reads, per cache group, for the n live rows (device tensors):
    block_tables[g]: [n, max_blocks] int32; seq_lens[g]: [n] int32, KV length after this step.

    host_block_tables / host_seq_lens: the same rows on the host (numpy, same shapes), or None
    where the caller has no host copy. Leaves that plan on the host (FlashInfer) need them; the
    device refresh never reads them.

    width: N, the query rows per request (1: plain decode; N > 1: a speculative verify window of
    positions seq_len - N .. seq_len - 1, ``seq_lens`` counting the whole window)."""

    block_tables: tuple[torch.Tensor, ...]
    seq_lens: tuple[torch.Tensor, ...]
    host_block_tables: tuple[np.ndarray, ...] | None = None
    host_seq_lens: tuple[np.ndarray, ...] | None = None
    width: int = 1
    # [n] int64 the live rows' state slots (a model with recurrent-state layers; the plan's)
    host_state_slots: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return self.seq_lens[0].shape[0]

    def with_host_rows(self, block_tables: tuple[np.ndarray, ...], seq_lens: tuple[np.ndarray, ...]) -> "DecodeInputs":
        """These device views with the step's host arrays (the device views are reused, not copied)."""
        return DecodeInputs(self.block_tables, self.seq_lens, tuple(block_tables), tuple(seq_lens), self.width,
                            self.host_state_slots)

    def with_width(self, width: int) -> "DecodeInputs":
        """The same rows as a verify window of ``width`` query rows per request."""
        return DecodeInputs(self.block_tables, self.seq_lens, self.host_block_tables, self.host_seq_lens, width,
                            self.host_state_slots)


class AttentionRouter(AttentionBackend):
    """Top-level backend: ``specs[g]`` describes group ``g``; ``leaves[g]`` runs its kernels."""

    def __init__(self, specs: list[CacheGroupSpec], leaves: list[PagedAttentionBackend], *, max_blocks: int,
                 device: torch.device | str):
        assert len(specs) == len(leaves) and [lf.group_id for lf in leaves] == list(range(len(specs)))
        self.specs = list(specs)
        self.leaves = list(leaves)
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.layer_group = {lid: gid for gid, s in enumerate(specs) for lid in s.layer_ids}
        self.geometry: dict[int, CacheGeometry] | None = None
        self.pool: KVCachePool | None = None
        self._write_loc_stack: torch.Tensor | None = None  # [G, max_decode_bs * max_width] int64
        self._decode_write_locs_by_bs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # by (bs, width)
        self._idle_inputs: DecodeInputs | None = None
        self.decode_write_locations: tuple[torch.Tensor, ...] | None = None
        self.extend_write_locations: tuple[torch.Tensor, ...] | None = None
        # per group, the last extend metadata published: a whole-step bucket's persistent buffers are
        # the same tensors every step, and a frozen dataclass costs microseconds to build
        self._extend_meta: list[AttentionMetadata | None] = [None] * len(specs)
        # the recurrent-state layers' backend (attention/state_backend.py), or None: refreshed with the leaves
        self.state = None

    def attach_state_backend(self, state) -> None:
        """Serve a model's recurrent-state layers too: ``state`` (a ``StateBackend``) gets every decode
        refresh and extend publish the leaves get, and joins the graph-support composition."""
        self.state = state

    def child_backends(self) -> list[AttentionBackend]:
        return list(self.leaves) + ([self.state] if self.state is not None else [])

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

    def bind_query_heads(self, num_q_heads: int) -> None:
        """The model's query heads per layer, for leaves that plan kernels on the host."""
        for leaf in self.leaves:
            leaf.bind_query_heads(num_q_heads)

    # -- decode ----------------------------------------------------------------------------------
    def allocate_decode_buffers(self, max_decode_bs: int, max_width: int = 1) -> None:
        """The persistent decode buffers of every leaf and the write locations, used with or
        without graphs; plus the placeholder inputs of the idle refresh (no live rows).
        ``max_width``: the widest verify window (query rows per request) any step will use."""
        self._write_loc_stack = torch.zeros(len(self.specs), max_decode_bs * max_width, dtype=torch.int64,
                                            device=self.device)
        self._decode_write_locs_by_bs = {}
        empty_table = torch.zeros(0, self.max_blocks, dtype=torch.int32, device=self.device)
        empty_lens = torch.zeros(0, dtype=torch.int32, device=self.device)
        groups = len(self.specs)
        # host placeholders too: a host planner plans the idle refresh like any other
        self._idle_inputs = DecodeInputs((empty_table,) * groups, (empty_lens,) * groups,
                                         (np.zeros((0, self.max_blocks), dtype=np.int32),) * groups,
                                         (np.zeros(0, dtype=np.int32),) * groups,
                                         host_state_slots=np.zeros(0, dtype=np.int64))
        for leaf in self.leaves:
            if max_width == 1:  # a leaf that predates verify windows keeps its one-argument form
                leaf.allocate_decode_buffers(max_decode_bs)
            else:
                leaf.allocate_decode_buffers(max_decode_bs, max_width)
        if self.state is not None:
            self.state.allocate_decode_buffers(max_decode_bs, max_width)

    def _decode_write_locs(self, bs: int, width: int = 1) -> tuple[torch.Tensor, ...]:
        views = self._decode_write_locs_by_bs.get((bs, width))
        if views is None:
            if bs * width > self._write_loc_stack.shape[1]:
                raise ValueError(f"tscompile: a decode of {bs} requests x {width} rows needs {bs * width} write "
                                 f"slots; allocate_decode_buffers made {self._write_loc_stack.shape[1]}")
            views = tuple(self._write_loc_stack[g, : bs * width] for g in range(len(self.specs)))
            self._decode_write_locs_by_bs[(bs, width)] = views
        return views

    def refresh_decode_metadata(self, bs: int, inputs: DecodeInputs) -> None:
        """Rewrite every group's decode metadata for ``bs`` requests in place: ``inputs`` holds the
        ``n <= bs`` live rows; rows ``[n, bs)`` are padding and resolve to the null page 0.
        ``inputs.width``: query rows per request (N; 1 is plain decode, N > 1 a verify window whose
        lengths count the whole window); ``bs * N`` write slots are published, and each leaf reads
        N from their length. Never allocates storage."""
        if self._write_loc_stack is None:
            raise RuntimeError("allocate_decode_buffers must run before any decode metadata call")
        groups = len(self.specs)
        if any(arrays is not None and len(arrays) != groups for arrays in
               (inputs.block_tables, inputs.seq_lens, inputs.host_block_tables, inputs.host_seq_lens)):
            raise ValueError(f"tscompile: decode inputs for {len(inputs.seq_lens)} cache groups, the model has "
                             f"{groups}; every group must be delivered")
        write_locs = self._decode_write_locs(bs, inputs.width)
        host_tables, host_lens = inputs.host_block_tables, inputs.host_seq_lens
        for gid, leaf in enumerate(self.leaves):
            leaf.refresh_decode_metadata(bs, inputs.block_tables[gid], inputs.seq_lens[gid], write_locs[gid],
                                         None if host_tables is None else host_tables[gid],
                                         None if host_lens is None else host_lens[gid])
        self.decode_write_locations = write_locs
        if self.state is not None:
            if inputs.host_state_slots is None:
                raise ValueError("tscompile: a decode refresh for a model with recurrent-state layers got no state "
                                 "slots; pass the plan's (DecodeInputs.host_state_slots)")
            self.state.refresh_decode_metadata(bs, inputs.host_state_slots, inputs.width)

    @property
    def refresh_reads_host(self) -> bool:
        """Whether the decode refresh reads host arrays (a leaf that plans on the host, or the state
        slots): then it must run before each replay, outside any graph."""
        return self.state is not None or any(leaf.refresh_reads_host for leaf in self.leaves)

    def publish_decode_views(self, bs: int, width: int = 1) -> None:
        """Publish what a refresh of ``bs`` x ``width`` rows publishes (every group's metadata views
        and write slots) without running it: a graph that holds the refresh rewrites those buffers
        when it replays."""
        self.decode_write_locations = self._decode_write_locs(bs, width)
        for leaf in self.leaves:
            leaf.forward_decode_metadata = leaf.decode_views(bs, width)

    def refresh_idle_decode_metadata(self, bs: int, width: int = 1) -> None:
        """The refresh a graph capture runs: every row padding, over placeholder tables. It is the
        decode refresh itself, so capture needs no metadata path of its own."""
        self.refresh_decode_metadata(bs, self._idle_inputs.with_width(width))

    # -- extend / mixed --------------------------------------------------------------------------
    def init_forward_metadata(self, plan: StepPlan, pad_rows: Mapping[int, int]) -> None:
        """Fresh metadata of an extend or mixed step, uploaded in one copy per dtype.

        ``pad_rows[g]``: the forward runs group ``g``'s layers on that many rows (a CUDA-graph
        bucket; ``{}``: no padding); the write slots of the rows past the live ones are slot 0, in
        the null page."""
        self.publish_extend_metadata(plan, upload(self.extend_host_arrays(plan, pad_rows), self.device))

    def extend_array_layout(self, tokens: int | Sequence[int], requests: int) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of each ``extend_host_arrays`` array of a step padded to ``tokens`` rows
        (one count for every group, or one per group) and ``requests`` requests."""
        rows = [tokens] * len(self.leaves) if isinstance(tokens, int) else list(tokens)
        i32, i64 = np.dtype(np.int32), np.dtype(np.int64)
        layout = []
        for leaf, n in zip(self.leaves, rows, strict=True):
            layout += [((requests, leaf.max_pages), i32), ((requests,), i32), ((requests + 1,), i32), ((n,), i64)]
        if self.state is not None:
            layout += self.state.extend_array_layout(requests)
        return layout

    def extend_host_arrays(self, plan: StepPlan, pad_rows: Mapping[int, int], pad_requests: int = 0) -> list:
        """Per cache group, in order: page table ``[R, max_pages]`` int32, KV lengths ``[R]`` int32,
        query offsets ``[R + 1]`` int32 and write slots ``[rows]`` int64 of an extend or mixed step;
        then, with recurrent-state layers, the state backend's arrays (``StateBackend``).

        ``pad_requests``: R, at least the plan's B (0: B). Request rows past B are padding: a null
        page-table row, KV length 0 and an empty query range (the offsets repeat their last value),
        so no kernel gives them work. Token rows past the live ones write slot 0 (``pad_rows``)."""
        requests = max(pad_requests, plan.num_requests)
        rows = [max(pad_rows.get(gid, 0), int(group.qo_indptr[-1])) for gid, group in enumerate(plan.groups)]
        # the layout a whole-step bucket's staging has too: both paths fill the same arrays
        host = [np.empty(shape, dtype=dtype) for shape, dtype in self.extend_array_layout(rows, requests)]
        self.fill_extend_host_arrays(plan, host)
        return host

    def fill_extend_host_arrays(self, plan: StepPlan, out: list[np.ndarray]) -> None:
        """``extend_host_arrays`` written into ``out`` (arrays of its shapes, e.g. a whole-step
        bucket's pinned staging, see ``extend_array_layout``): every element is written, padding
        included, so ``out`` may hold anything before."""
        reject_decode_init(plan.mode)
        b = plan.num_requests
        for gid, group in enumerate(plan.groups):
            pages, seq_lens, qo_indptr, slots = out[4 * gid: 4 * gid + 4]
            put_padded(pages, self._page_rows(gid, group.block_tables), 0)
            put_padded(seq_lens, group.seq_lens, 0)
            put_padded(qo_indptr, group.qo_indptr, group.qo_indptr[b])  # padded requests: empty ranges
            put_padded(slots, group.write_slots, 0)
        if self.state is not None:
            self.state.fill_extend_host_arrays(plan, out[4 * len(plan.groups):])

    def _page_rows(self, gid: int, block_tables: np.ndarray) -> np.ndarray:
        """Group ``gid``'s page table rows of ``block_tables`` (the scheduler's)."""
        ppb, width = self.geometry[gid].pages_per_block, self.leaves[gid].max_pages
        if ppb == 1 and block_tables.shape[1] == width:
            return block_tables  # a page per block: the page ids are the block ids, 0 the null page
        return expand_block_table_rows(block_tables, ppb, width)

    def publish_extend_metadata(self, plan: StepPlan, arrays: list[torch.Tensor]) -> None:
        """Hand each leaf its extend metadata: ``arrays`` are ``extend_host_arrays`` on the device
        (fresh storage, or the persistent buffers of a whole-step prefill graph)."""
        write_locs = []
        for gid, (group, leaf) in enumerate(zip(plan.groups, self.leaves)):
            page_table, seq_lens, qo_indptr, slots = arrays[4 * gid: 4 * gid + 4]
            meta = self._extend_meta[gid]
            if (meta is None or meta.page_table is not page_table or meta.seq_lens is not seq_lens
                    or meta.qo_indptr is not qo_indptr):
                meta = self._extend_meta[gid] = AttentionMetadata(page_table, seq_lens, qo_indptr, False)
            leaf.init_forward_metadata(group, meta)
            write_locs.append(slots)
        self.extend_write_locations = tuple(write_locs)
        if self.state is not None:
            self.state.init_forward_metadata(plan, arrays[4 * len(plan.groups):])

    # -- what the model reads ----------------------------------------------------------------------
    def write_locations(self, layer_id: int, mode: ForwardMode) -> torch.Tensor:
        """The KV write slots of ``layer_id``'s group for the current forward; the only accessor."""
        locs = self.decode_write_locations if mode.is_decode else self.extend_write_locations
        if locs is None:
            raise RuntimeError(f"no {mode.value} write locations published")
        return locs[self.layer_group[layer_id]]

    def state_metadata(self, mode: ForwardMode):
        """The recurrent-state layers' ``StateMetadata`` of the current forward."""
        if self.state is None:
            raise RuntimeError("no state backend attached: the model has recurrent-state layers the engine did not "
                               "set up")
        return self.state.metadata(mode)

    def metadata(self, layer_id: int, mode: ForwardMode) -> AttentionMetadata:
        return self.leaves[self.layer_group[layer_id]].metadata(mode)

    def forward(self, layer_id: int, mode: ForwardMode, q, k, v, k_cache, v_cache, out, scale: float) -> None:
        leaf = self.leaves[self.layer_group[layer_id]]
        leaf.forward(q, k, v, k_cache, v_cache, out, leaf.metadata(mode), self.write_locations(layer_id, mode), scale)
