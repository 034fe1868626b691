"""The ``flashinfer`` attention backend: FlashInfer's paged decode and prefill kernels over the
tscompile pool, under the same contract as the torch and Triton leaves.

The pool needs no adapting: a layer's ``k_cache`` / ``v_cache`` are ``[num_pages, page_size,
kv_heads, head_dim]``, FlashInfer's NHD layout, passed as a ``(k, v)`` tuple. What differs is
metadata: FlashInfer reads a CSR layout over pages (``flashinfer_host.paged_kv_arrays``) and plans
each batch on the host (``plan()``) before its kernels run.

Decode. One ``BatchDecodeWithPagedKVCacheWrapper`` per batch size, in CUDA-graph mode, over fixed
device buffers (``indptr``, ``indices``, ``last_page_len``: per-size prefix views of one buffer
each, so their addresses never move). ``plan()`` runs inside ``refresh_decode_metadata``, the one
decode metadata path, from the host arrays the refresh gets (``DecodeInputs.host_*``): eager,
capture (the idle refresh plans every row as padding) and replay alike. The base class's device
refresh still fills the page table, the lengths and the write slots, so the KV write and the
graph-debug guard are those of every leaf. Padded rows read the null page with length 1.

Does ``plan()`` synchronize? Read from flashinfer 0.6.13 (decode.py, scheduler.cuh):
  - it calls ``indptr.to("cpu")`` and ``last_page_len.to("cpu")``: a device-to-host copy, so a
    sync, if they are device tensors; we pass host tensors, for which these are no-ops;
  - in CUDA-graph mode it copies ``indptr`` and ``last_page_len`` into the fixed buffers with
    ``non_blocking=True``, and ``indices`` with ``non_blocking`` only when ``indices`` is on the
    device: host indices would be a blocking copy, a stream-wide sync. So the indices go up in an
    asynchronous copy of ours first, and ``plan()`` gets the fixed device buffer itself (a copy of
    a tensor onto the same memory returns early);
  - the C++ plan computes the split-KV schedule on the host into the wrapper's pinned int
    workspace and enqueues one ``cudaMemcpyAsync`` of it to the device int workspace. No sync.
So planned this way it never waits for the GPU, but it leaves copies that read pinned host memory
(our ``indptr``, ``last_page_len`` and ``indices``, and FlashInfer's plan workspace) when the
stream reaches them. With asynchronous scheduling step N + 1 is planned while step N's copies may
still be queued, so that memory comes in two sets used in turn (``_PlanRing``, like the decode
staging): a set is rewritten only after the event recorded behind its last copies, which in the
engine's order (step N - 1 was read back before step N + 1 is planned) has always passed; a wait
that does block is counted (``counters["flashinfer_plan_waits"]``).

Under a captured graph the plan's launch parameters (padded batch, split-KV on or off, workspace
offsets) depend on the batch size alone in CUDA-graph mode (``DecodePlan``); the per-step values
(request and tile indices, chunk size) live in the device int workspace that the graph reads. So
a graph captured over the idle plan of a size replays any later plan of that size. Every size
shares one device int workspace and one float workspace: only the latest plan is ever read, and
stream order puts each plan's copies after the previous step's kernels.

Verify windows (N > 1 query rows per request, a speculative decoding step): one
``BatchPrefillWithPagedKVCacheWrapper`` per (bs, N) in CUDA-graph mode, causal (FlashInfer aligns
the causal mask to the end of each request's KV, so window row i sees the prefix and rows <= i),
over the decode step's fixed ``indptr`` / ``indices`` / ``last_page_len`` buffers plus fixed query
offsets ``arange(bs + 1) * N``. It is planned in the same refresh, from the same ring of pinned
host memory; its plan fixes the batch (bs) and the row count (bs * N), which never change for a
(bs, N) graph. Padded requests read the null page over N positions (a window needs a key per row).

Extend and mixed steps: one ``BatchPrefillWithPagedKVCacheWrapper`` (causal, over the cached
prefix plus the new rows), planned in ``init_forward_metadata`` from the step's ``GroupPlan``.
Its ``plan()`` reads ``qo_indptr`` / ``kv_indptr`` on the host and moves the arrays with
``.to(device, non_blocking=True)`` from pageable memory, which the driver stages at the call;
extend steps wait for the step in flight anyway. Its pinned plan workspace is guarded by an event
too. The prefill plan is not graph-safe here (fresh arrays per step), so this backend declares
``prefill_graph=False``: extend steps run the compiled pieces without graphs.

The kernels run inside ``tscompile::attention`` (impl ``flashinfer/<key>``, ``custom_ops/
flashinfer_attention.py``), so Dynamo and Inductor trace through them. FlashInfer compiles its
kernels on first use (on an H200 about 10 s for decode, 75 s for paged prefill, per dtype and
head_dim); a warning says so and where they are cached (``FLASHINFER_WORKSPACE_BASE``, default the
home directory, ``.cache/flashinfer/``), so a second process starts warm (``scripts/
flashinfer_start.py`` measures both; the CLI prints the warning and the build time). Exported packages refuse
this backend: their decode program refreshes metadata inside the AOTInductor program, where
``plan()`` cannot run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Callable, Iterator

import flashinfer  # missing: leaf_class turns the ImportError into the tscompile refusal
import numpy as np
import torch
from flashinfer.jit import env as jit_env

from tscompile.attention.base import AttentionMetadata, PagedAttentionBackend, decode_width
from tscompile.attention.flashinfer_host import FLASHINFER_NEEDS, flashinfer_geometry_problem, paged_kv_arrays
from tscompile.attention.support import CudaGraphSupport
from tscompile.counters import counters
from tscompile.custom_ops.flashinfer_attention import register_flashinfer_runner
from tscompile.kv_cache.pool import KVCachePool
from tscompile.step_plan import GroupPlan

try:  # the fused device refresh where Triton imports; the torch refresh computes the same
    from tscompile.custom_ops import triton_metadata  # noqa: F401  (registers refresh impl "triton")
    _REFRESH_IMPL = "triton"
except ImportError:  # pragma: no cover
    _REFRESH_IMPL = "torch"

logger = logging.getLogger("tscompile")

FLOAT_WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended split-KV scratch
# FlashInfer's own int workspace size; the pinned plan staging matches it, since plan() writes
# the host copy at offsets laid out within the device workspace
INT_WORKSPACE_BYTES = 8 * 2**20

_announced: set[tuple] = set()  # (kind, dtype, head_dim) whose first plan this process has looked at


class _PlanSlot:
    """The pinned host side of one decode plan, and the event behind the copies that read it."""

    def __init__(self, max_bs: int, max_indices: int):
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int32, pin_memory=True)
        self.last_page_len = torch.zeros(max_bs, dtype=torch.int32, pin_memory=True)
        self.indices = torch.zeros(max_indices, dtype=torch.int32, pin_memory=True)
        self.plan_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
        self.views = tuple(t.numpy() for t in (self.indptr, self.last_page_len, self.indices))  # the host writes
        self.copied = torch.cuda.Event()
        self.used = False


class _PlanRing:
    """Two plan slots used in turn: step N + 1 fills one while step N's copies may still read the other."""

    def __init__(self, max_bs: int, max_indices: int):
        self._slots = [_PlanSlot(max_bs, max_indices), _PlanSlot(max_bs, max_indices)]
        self._turn = 0

    def take(self) -> _PlanSlot:
        slot = self._slots[self._turn]
        self._turn ^= 1
        if slot.used and not slot.copied.query():
            counters["flashinfer_plan_waits"] += 1
            slot.copied.synchronize()
        return slot

    @staticmethod
    def copies_enqueued(slot: _PlanSlot, device: torch.device) -> None:
        slot.copied.record(torch.cuda.current_stream(device))
        slot.used = True


def _library_missing(uri: str) -> bool:
    return not any((d / uri / f"{uri}.so").exists() for d in (jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_AOT_DIR))


class FlashInferAttentionBackend(PagedAttentionBackend):
    impl = "flashinfer"  # the backend's name; calls go to the per-instance ``op_impl``
    refresh_impl = _REFRESH_IMPL
    refresh_reads_host = True  # plan_decode / plan_verify run on the host
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=False, whole_prefill_graph=False)

    def __init__(self, group_id: int, *, max_pages: int, device: torch.device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"{FLASHINFER_NEEDS}; got device {str(device)!r}")
        super().__init__(group_id, max_pages=max_pages, device=device)
        self.op_impl = register_flashinfer_runner(self)
        self.dtype: torch.dtype | None = None
        self.num_kv_heads = self.head_dim = None
        self._float_workspace = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode_int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self._ring: _PlanRing | None = None
        self._verify_wrappers: dict[tuple[int, int], flashinfer.BatchPrefillWithPagedKVCacheWrapper] = {}
        self._planned_decode: tuple[int, object] | None = None  # (query rows, planned wrapper)
        self._prefill: flashinfer.BatchPrefillWithPagedKVCacheWrapper | None = None
        self._prefill_copied = torch.cuda.Event()
        self._prefill_used = False
        self._prefill_host: tuple | None = None  # the last prefill plan's host tensors, kept alive
        self._extend_rows: int | None = None

    # -- geometry ------------------------------------------------------------------------------------
    def validate_cache_pool(self, pool: KVCachePool) -> None:
        geo = pool.geometry(self.group_id)
        heads = self.num_q_heads or geo.num_kv_heads  # the query heads are checked once bound
        problem = flashinfer_geometry_problem(num_q_heads=heads, num_kv_heads=geo.num_kv_heads,
                                              head_dim=geo.head_dim, dtype=geo.dtype)
        if problem:
            raise ValueError(f"tscompile: attention_backend='flashinfer' (cache group {self.group_id}) needs "
                             f"{problem}; attention_backend='triton' serves it")

    def _publish_cache_pool(self, pool: KVCachePool) -> None:
        super()._publish_cache_pool(pool)
        geo = pool.geometry(self.group_id)
        self.dtype, self.num_kv_heads, self.head_dim = geo.dtype, geo.num_kv_heads, geo.head_dim

    def bind_query_heads(self, num_q_heads: int) -> None:
        if self.num_kv_heads is not None:
            problem = flashinfer_geometry_problem(num_q_heads=num_q_heads, num_kv_heads=self.num_kv_heads,
                                                  head_dim=self.head_dim, dtype=self.dtype)
            if problem:
                raise ValueError(f"tscompile: attention_backend='flashinfer' (cache group {self.group_id}) "
                                 f"needs {problem}; attention_backend='triton' serves it")
        super().bind_query_heads(num_q_heads)

    def _plan_geometry(self) -> tuple[int, int, int, int]:
        if self.num_q_heads is None or self.page_size is None:
            raise RuntimeError("tscompile: the flashinfer backend plans with the query heads and the pool's "
                               "geometry: set_cache_pool and bind_query_heads must run first")
        return self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size

    # -- decode --------------------------------------------------------------------------------------
    def allocate_decode_buffers(self, max_decode_bs: int, max_width: int = 1) -> None:
        super().allocate_decode_buffers(max_decode_bs, max_width)
        # a live row's pages, or a padded row's null pages (one, or enough for a window's N positions)
        max_indices = max_decode_bs * max(self.max_pages, max_width, 1)
        self._indptr = torch.zeros(max_decode_bs + 1, dtype=torch.int32, device=self.device)
        self._last_page_len = torch.ones(max_decode_bs, dtype=torch.int32, device=self.device)
        self._indices = torch.zeros(max_indices, dtype=torch.int32, device=self.device)
        self._verify_qo_indptr = torch.zeros(max_decode_bs + 1, dtype=torch.int32, device=self.device)
        # the host side of every width's query offsets (constant: arange * N), pinned for async copies
        self._verify_qo_host = (torch.arange(1, max_width + 1, dtype=torch.int32)[:, None]
                                * torch.arange(max_decode_bs + 1, dtype=torch.int32)).pin_memory()
        self._ring = _PlanRing(max_decode_bs, max_indices)
        self._decode_wrappers = {}
        self._verify_wrappers = {}
        self._planned_decode = None

    def _decode_wrapper(self, bs: int) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
        wrapper = self._decode_wrappers.get(bs)
        if wrapper is None:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=self._indptr[: bs + 1],
                paged_kv_indices_buffer=self._indices, paged_kv_last_page_len_buffer=self._last_page_len[:bs])
            # one device int workspace for every size (see the module docstring); the wrapper's own
            # is freed. Its pinned host side is set per plan from the ring.
            wrapper._int_workspace_buffer = self._decode_int_workspace
            self._decode_wrappers[bs] = wrapper
        return wrapper

    def _verify_wrapper(self, bs: int, width: int) -> flashinfer.BatchPrefillWithPagedKVCacheWrapper:
        wrapper = self._verify_wrappers.get((bs, width))
        if wrapper is None:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._float_workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self._verify_qo_indptr[: bs + 1],
                paged_kv_indptr_buf=self._indptr[: bs + 1], paged_kv_indices_buf=self._indices,
                paged_kv_last_page_len_buf=self._last_page_len[:bs])
            wrapper._int_workspace_buffer = self._decode_int_workspace  # shared, as the decode wrappers'
            self._verify_wrappers[(bs, width)] = wrapper
        return wrapper

    def refresh_decode_metadata(self, bs: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                write_loc_out: torch.Tensor, host_block_table: np.ndarray | None,
                                host_seq_lens: np.ndarray | None) -> None:
        if torch.compiler.is_compiling():
            raise ValueError("tscompile: attention_backend='flashinfer' plans decode on the host; its refresh "
                             "cannot run inside a traced program (exported packages refuse this backend)")
        if host_block_table is None or host_seq_lens is None:
            raise ValueError("tscompile: attention_backend='flashinfer' plans decode on the host: the decode "
                             "refresh needs the live rows' host block tables and lengths (DecodeInputs.host_*)")
        super().refresh_decode_metadata(bs, block_table, seq_lens, write_loc_out, host_block_table, host_seq_lens)
        width = decode_width(bs, write_loc_out)
        if width == 1:
            self.plan_decode(bs, host_block_table, host_seq_lens)
        else:
            self.plan_verify(bs, width, host_block_table, host_seq_lens)

    def plan_decode(self, bs: int, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Plan the decode of ``bs`` rows, the first ``len(seq_lens)`` live; the rest read the null page."""
        num_q_heads, num_kv_heads, head_dim, page_size = self._plan_geometry()
        if self._ring is None:
            raise RuntimeError("allocate_decode_buffers must run before any decode metadata call")
        indptr, indices, last_page_len = paged_kv_arrays(block_table, seq_lens, page_size=page_size,
                                                         pages_per_block=self.pages_per_block, num_rows=bs)
        nnz = indices.shape[0]
        slot = self._ring.take()
        host_indptr, host_last, host_indices = slot.views
        host_indptr[: bs + 1], host_last[:bs], host_indices[:nnz] = indptr, last_page_len, indices
        self._indices[:nnz].copy_(slot.indices[:nnz], non_blocking=True)
        wrapper = self._decode_wrapper(bs)
        wrapper._pin_memory_int_workspace_buffer = slot.plan_workspace
        with self._first_use("decode", self._decode_uri):
            wrapper.plan(slot.indptr[: bs + 1], self._indices[:nnz], slot.last_page_len[:bs], num_q_heads,
                         num_kv_heads, head_dim, page_size, q_data_type=self.dtype, kv_data_type=self.dtype,
                         non_blocking=True)
        _PlanRing.copies_enqueued(slot, self.device)
        self._planned_decode = (bs, wrapper)

    def plan_verify(self, bs: int, width: int, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Plan a verify window of ``width`` rows for each of ``bs`` requests, the first
        ``len(seq_lens)`` live (lengths counting the window); padded requests read the null page over
        ``width`` positions."""
        num_q_heads, num_kv_heads, head_dim, page_size = self._plan_geometry()
        if self._ring is None:
            raise RuntimeError("allocate_decode_buffers must run before any decode metadata call")
        n = seq_lens.shape[0]
        # padded requests as requests of null blocks (page 0) with a window's length
        tables = np.zeros((bs, block_table.shape[1]), dtype=np.int32)
        tables[:n] = block_table
        lens = np.full(bs, width, dtype=np.int32)
        lens[:n] = seq_lens
        indptr, indices, last_page_len = paged_kv_arrays(tables, lens, page_size=page_size,
                                                         pages_per_block=self.pages_per_block, num_rows=bs)
        nnz = indices.shape[0]
        slot = self._ring.take()
        host_indptr, host_last, host_indices = slot.views
        host_indptr[: bs + 1], host_last[:bs], host_indices[:nnz] = indptr, last_page_len, indices
        self._indices[:nnz].copy_(slot.indices[:nnz], non_blocking=True)
        wrapper = self._verify_wrapper(bs, width)
        wrapper._pin_memory_int_workspace_buffer = slot.plan_workspace
        with self._first_use("paged prefill", self._prefill_uri):
            wrapper.plan(self._verify_qo_host[width - 1, : bs + 1], slot.indptr[: bs + 1], self._indices[:nnz],
                         slot.last_page_len[:bs], num_q_heads, num_kv_heads, head_dim, page_size, causal=True,
                         q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True)
        _PlanRing.copies_enqueued(slot, self.device)
        self._planned_decode = (bs * width, wrapper)

    def _decode_uri(self) -> str:
        """The library the decode plan loads: posenc NONE, no sliding window, no soft cap."""
        return flashinfer.jit.get_batch_decode_uri(self.dtype, self.dtype, self.dtype, torch.int32, self.head_dim,
                                                   self.head_dim, 0, False, False)

    def run_decode(self, q, k_cache, v_cache, out, scale: float) -> None:
        planned = self._planned_decode  # (query rows: bs, or bs * N for a verify window; wrapper)
        if planned is None or planned[0] != q.shape[0]:
            raise RuntimeError(f"tscompile: flashinfer decode over {q.shape[0]} rows, but the last decode refresh "
                               f"planned {planned[0] if planned else 'none'}")
        _run(planned[1], q, k_cache, v_cache, out, scale)

    # -- extend / mixed ------------------------------------------------------------------------------
    def init_forward_metadata(self, group: GroupPlan, meta: AttentionMetadata) -> None:
        super().init_forward_metadata(group, meta)
        num_q_heads, num_kv_heads, head_dim, page_size = self._plan_geometry()
        kv_indptr, indices, last_page_len = paged_kv_arrays(group.block_tables, group.seq_lens, page_size=page_size,
                                                            pages_per_block=self.pages_per_block)
        if self._prefill is None:
            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._float_workspace, "NHD")
        if self._prefill_used and not self._prefill_copied.query():  # its pinned plan workspace is still read
            counters["flashinfer_plan_waits"] += 1
            self._prefill_copied.synchronize()
        host = tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
                     for a in (group.qo_indptr, kv_indptr, indices, last_page_len))
        with self._first_use("paged prefill", self._prefill_uri):
            self._prefill.plan(*host, num_q_heads, num_kv_heads, head_dim, page_size, causal=True,
                               q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True)
        self._prefill_copied.record(torch.cuda.current_stream(self.device))
        self._prefill_used = True
        self._prefill_host = host
        self._extend_rows = int(group.qo_indptr[-1])

    def _prefill_uri(self) -> str:
        """The library the prefill wrapper's ``backend="auto"`` loads (fa3 on Hopper, else fa2)."""
        backend = flashinfer.utils.determine_attention_backend(self.device, 0, False, False, self.dtype, self.dtype)
        return flashinfer.jit.get_batch_prefill_uri(backend, self.dtype, self.dtype, self.dtype, torch.int32,
                                                    self.head_dim, self.head_dim, 0, False, False, False)

    def run_extend(self, q, k_cache, v_cache, out, scale: float) -> None:
        if self._extend_rows is None:
            raise RuntimeError("tscompile: flashinfer extend before any init_forward_metadata")
        rows = self._extend_rows  # rows past them pad a token bucket; the op zeroes their output
        _run(self._prefill, q[:rows], k_cache, v_cache, out[:rows], scale)

    # -- the layer call ------------------------------------------------------------------------------
    def forward(self, q, k, v, k_cache, v_cache, out, meta: AttentionMetadata, write_loc, scale: float) -> None:
        # this instance's impl name: the op finds this backend's planned wrappers by it
        torch.ops.tscompile.attention(q, k, v, k_cache, v_cache, out, meta.page_table, meta.seq_lens, meta.qo_indptr,
                                      write_loc, scale, meta.decode, self.op_impl)

    # -- first use ---------------------------------------------------------------------------------
    def _first_use(self, kind: str, uri: Callable[[], str]):
        """Around a plan: the first plan of a kernel library compiles it, unless FlashInfer's cache has it."""
        key = (kind, self.dtype, self.head_dim)
        if key in _announced:
            return contextlib.nullcontext()
        _announced.add(key)
        if not _library_missing(uri()):
            return contextlib.nullcontext()
        logger.warning("tscompile: building FlashInfer kernels (first use; cached under %s): %s, %s, head_dim %d",
                       jit_env.FLASHINFER_JIT_DIR, kind, str(self.dtype).removeprefix("torch."), self.head_dim)
        return _timed(f"tscompile: FlashInfer {kind} kernels built in %.0f s")


@contextlib.contextmanager
def _timed(message: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    logger.info(message, time.perf_counter() - start)


def _run(wrapper, q, k_cache, v_cache, out, scale: float) -> None:
    """One planned FlashInfer call writing ``out``. FlashInfer takes the softmax scale at plan time
    (default ``1/sqrt(head_dim)``) times a per-call ``q_scale``, which carries the model's scale here."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    direct = out.is_contiguous()
    o = out if direct else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    wrapper.run(q, (k_cache, v_cache), out=o, q_scale=scale * math.sqrt(q.shape[-1]))
    if not direct:
        out.copy_(o)
