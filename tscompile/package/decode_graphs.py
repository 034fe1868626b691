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

Capture, replay, the pool and the replay switch are the engine's ``GraphRunner``'s (decode keys
of the ladder's sizes; the program takes the sampling rows as inputs, so one graph per size serves
greedy and sampled batches). ``backend=HostGraphs()`` runs the padded program over the same buffers
instead of capturing and replaying, so the padding is testable where no CUDA device exists;
``graphs.replay = False`` runs it padded, without graphs, on any backend.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tscompile.config import DEFAULT_DECODE_LADDER
from tscompile.runtime.graph_runner import DECODE, CudaGraphs, GraphBackend, GraphRunner
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
                        np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, banned_width), np.int64), True, False)


class PackageDecodeGraphs:
    """Padded, graphed decode steps of a package's decode program (see the module docstring).

    ``graphs`` is the ``GraphRunner`` (its ``replay`` the switch); ``replays`` counts padded steps
    run (graph replays, or padded program calls with the switch off), ``captures`` the sizes
    captured, ``padded_rows`` the padding rows run."""

    def __init__(self, program, ladder: tuple[int, ...], *, max_num_seqs: int, num_groups: int, max_blocks: int,
                 banned_width: int, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 device: torch.device, backend: GraphBackend | None = None):
        ladder = tuple(sorted(set(ladder)))
        if not ladder or any(not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= max_num_seqs
                             for b in ladder):
            raise ValueError(f"tscompile: decode graph ladder {ladder!r} must hold ints in [1, max_num_seqs="
                             f"{max_num_seqs}]")
        if backend is None and device.type != "cuda":
            raise ValueError(f"tscompile: decode CUDA graphs need a CUDA device, got {str(device)!r} "
                             "(backend=HostGraphs() runs the padded program without graphs)")
        self.graphs = GraphRunner(CudaGraphs(device) if backend is None else backend, decode_ladder=ladder)
        self.program, self.ladder, self.device = program, ladder, device
        self.k_caches, self.v_caches = k_caches, v_caches
        self.banned_width = banned_width
        # the staging's views start at multiples of its row count: a count that is a multiple of
        # 32 starts every view on an UPLOAD_ALIGN_BYTES boundary, as the program's inputs always were
        # (``utils.upload``); its kernels may have been compiled for 16-byte aligned inputs
        rows = -(-max_num_seqs // (UPLOAD_ALIGN_BYTES // 4)) * (UPLOAD_ALIGN_BYTES // 4)
        self.staging = DecodeStaging(rows, num_groups, max_blocks, banned_width, device)
        # the sampling op's inputs are the staging's views, for the runner's other steps too
        self.sampling = SamplingBuffers(self.staging.sampling_inputs)
        self.replays = self.padded_rows = 0
        self._said_ladder = False

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds[DECODE]

    @property
    def captures(self) -> int:
        """The sizes captured so far."""
        return len(self.graphs.graphs)

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
        key = self.graphs.decode_key(bs, True)  # None: the switch is off
        if key is not None and key not in self.graphs.graphs:
            self._capture(key)
        self.staging.fill(plan, bs, pad_tables=True)  # the program refreshes from the rows it is given
        self.staging.upload()
        tokens = self.graphs.replay_graph(key) if key is not None else self._call(bs)
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

    def _capture(self, key) -> None:
        """The size's graph on idle inputs: one warm-up call (it loads the program's kernels on the
        capture stream), then the capture."""
        bs = key.batch_size
        self.graphs.capture(key, lambda: self._call(bs), prepare=lambda: self._idle_inputs(bs))
        if not self._said_ladder:
            self._said_ladder = True
            logger.info("tscompile: package decode graphs, ladder %s: each size captures on first use", self.ladder)
