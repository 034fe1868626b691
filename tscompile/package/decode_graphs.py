"""CUDA graphs around a package's decode program: one graph per padded batch size, replayed.

A package's decode program is called from the host once per step; its launches cost far more than
the work of a small batch. ``PackageDecodeGraphs`` pads a decode batch to the smallest size of a
ladder (the engine's decode ladder), runs the program over persistent input buffers, captures that
call as a ``torch.cuda.CUDAGraph`` on the size's first use and replays it afterwards. A batch above
the ladder is not handled here (``run`` returns None): the runner calls the program directly.

Inputs. The buffers are the engine's decode staging (``runtime/staging.py``): token ids, positions,
per-group block tables and seq lens, the sampling rows, at fixed device addresses, filled on the
host and sent in one copy per dtype. Its ``fill`` pads ids, positions and sampling rows with the
engine's padding (token 0 at position 0, greedy, nothing banned); the engine's refresh pads the
table and length rows itself, but the program refreshes from the rows it is given, so the rows
``[n, bs)`` of the tables and lengths are staged as the null block and length 0 too
(``DecodeStaging.fill(pad_tables=True)``). Inside the
program's refresh such a row becomes what the engine's padded rows are: a page-table row of the
null page, KV length 0 and write slot 0 (in the null block, which no request owns), so padding
writes nothing a live request reads.

Capture runs on idle inputs (every row padding), as the engine's does: the warm-up and capture
calls then write only the null page, never a live request's slot. All sizes share one memory pool;
the tokens a graph writes are read (``tolist``) before another graph replays. The decode program
must be loaded with AOTInductor's ``run_single_threaded`` (``load_aoti_programs``): its default
run records and queries a completion event, which a capturing stream refuses.

``host_replay=True`` runs the padded program over the same buffers instead of capturing and
replaying, so the padding is testable where no CUDA device exists.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tscompile.config import DEFAULT_DECODE_LADDER
from tscompile.counters import counters
from tscompile.runtime.piece_graphs import capture_graph
from tscompile.runtime.staging import DecodeStaging
from tscompile.sampling import SamplingBuffers
from tscompile.step_plan import SamplingRows, StepPlan
from tscompile.utils import UPLOAD_ALIGN_BYTES, bucket

logger = logging.getLogger("tscompile")

_NULL_BLOCK = 0  # block 0 is reserved by the allocator (kv_cache/pool.py): no request owns it


def default_decode_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """The engine's default decode ladder up to ``max_num_seqs``."""
    return tuple(b for b in DEFAULT_DECODE_LADDER if b <= max_num_seqs)


def _no_sampling_rows(banned_width: int) -> SamplingRows:
    """Zero sampling rows: ``fill_sampling`` then pads every row (the engine's padding values)."""
    return SamplingRows(np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, np.float32),
                        np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, banned_width), np.int64), True)


class PackageDecodeGraphs:
    """Padded, graphed decode steps of a package's decode program (see the module docstring).

    ``replays`` counts graph replays (host replay: padded program calls), ``captures`` the sizes
    captured (host replay: the sizes first run on idle inputs), ``padded_rows`` the padding rows run."""

    def __init__(self, program, ladder: tuple[int, ...], *, max_num_seqs: int, num_groups: int, max_blocks: int,
                 banned_width: int, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 device: torch.device, host_replay: bool = False):
        ladder = tuple(sorted(set(ladder)))
        if not ladder or any(not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= max_num_seqs
                             for b in ladder):
            raise ValueError(f"tscompile: decode graph ladder {ladder!r} must hold ints in [1, max_num_seqs="
                             f"{max_num_seqs}]")
        if not host_replay and device.type != "cuda":
            raise ValueError(f"tscompile: decode CUDA graphs need a CUDA device, got {str(device)!r} "
                             "(host_replay=True runs the padded program without graphs)")
        self.program, self.ladder, self.device, self.host_replay = program, ladder, device, host_replay
        self.k_caches, self.v_caches = k_caches, v_caches
        self.banned_width = banned_width
        # the staging's views start at multiples of its row count: a count that is a multiple of
        # 32 starts every view on an UPLOAD_ALIGN_BYTES boundary, as the program's inputs always were
        # (``utils.upload``); its kernels may have been compiled for 16-byte aligned inputs
        rows = -(-max_num_seqs // (UPLOAD_ALIGN_BYTES // 4)) * (UPLOAD_ALIGN_BYTES // 4)
        self.staging = DecodeStaging(rows, num_groups, max_blocks, banned_width, device)
        # the sampling op's inputs are the staging's views, for the runner's other steps too
        self.sampling = SamplingBuffers(self.staging.sampling_inputs)
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # per size, the tokens its graph writes
        self.replays = self.captures = self.padded_rows = 0
        self.capture_seconds = 0.0
        if not host_replay:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)

    def padded_size(self, n: int) -> int | None:
        """The ladder size a batch of ``n`` runs at, or None above the ladder."""
        return bucket(self.ladder, n)

    def run(self, plan: StepPlan) -> list[int] | None:
        """The tokens of decode step ``plan`` through its size's graph (captured on first use), or
        None when the batch is above the ladder (the caller runs the program directly)."""
        n = plan.num_requests
        bs = self.padded_size(n)
        if bs is None:
            return None
        if bs not in self.graphs:
            self._capture(bs)
        self.staging.fill(plan, bs, pad_tables=True)  # the program refreshes from the rows it is given
        self.staging.upload()
        if self.host_replay:
            tokens = self._call(bs)
        else:
            self.graphs[bs].replay()
            tokens = self.outputs[bs]
            counters["decode_replays"] += 1  # what the bench's captures/replays columns read
        self.replays += 1
        self.padded_rows += bs - n
        return tokens[:n].tolist()

    def inputs(self, bs: int) -> tuple:
        """The decode program's inputs of a ``bs``-row step: views of the persistent buffers."""
        st = self.staging
        staged = st.decode_inputs(bs)
        return (st.input_ids[:bs], st.positions[:bs], list(staged.block_tables), list(staged.seq_lens),
                *st.sampling_inputs.rows(bs), self.k_caches, self.v_caches)

    def _call(self, bs: int) -> torch.Tensor:
        return self.program(*self.inputs(bs))

    def _idle_tables(self, bs: int) -> None:
        """Every group's block table and seq lens of ``bs`` rows: the null block, length 0."""
        inputs = self.staging.decode_inputs(bs)
        for table, lens in zip(inputs.block_tables, inputs.seq_lens):
            table.fill_(_NULL_BLOCK)
            lens.zero_()

    def _idle_inputs(self, bs: int) -> None:
        """Every one of the ``bs`` rows a padding row (the engine's sampling padding)."""
        st = self.staging
        st.fill_sampling(_no_sampling_rows(self.banned_width), bs)
        st.upload()
        st.input_ids[:bs].zero_()
        st.positions[:bs].zero_()
        self._idle_tables(bs)

    def _capture(self, bs: int) -> None:
        start = time.perf_counter()
        self._idle_inputs(bs)
        if self.host_replay:
            self._call(bs)  # what a capture's warm-up runs: idle rows write the null page only
            self.graphs[bs] = None
        else:  # capture_graph's warm-up call loads the program's kernels on the capture stream
            graph, tokens = capture_graph(lambda: self._call(bs), self.device, self.stream, self.pool,
                                          f"the package decode step of batch {bs}")
            self.graphs[bs], self.outputs[bs] = graph, tokens
            counters["decode_captures"] += 1
            torch.cuda.synchronize(self.device)  # capture time includes the warm-up's device work
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start
        if self.captures == 1:
            logger.info("tscompile: package decode graphs, ladder %s: each size captures on first use",
                        self.ladder)
