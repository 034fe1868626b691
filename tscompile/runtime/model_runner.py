"""The model runner: turns a scheduled batch into one forward and one sampling call.

It knows buckets and padding; it hands block tables to the top-level attention backend and never
computes a page or a slot itself. Decode metadata comes only from ``refresh_decode_metadata``
(eager, capture and replay alike); extend and mixed metadata only from ``init_forward_metadata``.

Decode: pick the smallest ladder size ``bs >= actual_bs`` (above the ladder, or without graphs,
``bs = actual_bs``), refresh, then replay the captured step for ``bs`` or run the very same
compiled step without a graph. Rows ``[actual_bs, bs)`` are padding and resolve to the null page.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import torch

from tscompile.attention.base import ForwardMode
from tscompile.attention.router import CacheGroupRouter
from tscompile.attention.support import ResolvedGraphSupport
from tscompile.kv_cache.spec import kept_rows
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.models.llama import Transformer
from tscompile.runtime import pointer_guard
from tscompile.runtime.forward_context import ForwardContext, forward_context
from tscompile.runtime.piece_graphs import PieceGraphRuntime, PrefillGraphPlan
from tscompile.runtime.readback import PendingTokens, TokenReadback
from tscompile.runtime.scheduler import ScheduledBatch, Scheduler
from tscompile.runtime.staging import DecodeStaging
from tscompile.sampling import SamplingBuffers

logger = logging.getLogger("tscompile")
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_inputs_on_host(batch: ScheduledBatch, prev_rows: list[int] | None) -> None:
    """Refuse a step whose decode row needs a token the host has not read and ``prev_rows`` does
    not place on the device (a runner called directly while the engine has a step in flight)."""
    for i, r in enumerate(batch.decodes):
        if len(r.output) != r.num_generated and (prev_rows is None or prev_rows[i] < 0):
            raise RuntimeError(f"tscompile: request {r.rid}'s last token is still on the device; call "
                               "LLM.sync() before running the runner directly")


def decode_static_inductor_options(config: TscompileConfig, device: torch.device) -> dict:
    """The decode step's patches for its static-size (bs=1) graph: the user's, plus coordinate-descent
    tuning on CUDA, so one-row matmuls become fused GEMV reductions (on the H200 the bs=1 llama-1b
    graph went from 214 kernels, 1.21 ms to 196 kernels, 1.08 ms with the split-KV change)."""
    options = dict(config.static_inductor_options)
    if device.type == "cuda" and "coordinate_descent_tuning" not in dict(config.inductor_options):
        options.setdefault("coordinate_descent_tuning", True)
    return options


class ModelRunner:
    def __init__(self, model: Transformer, backend: CacheGroupRouter, *, max_num_seqs: int, device: torch.device,
                 compile_config: TscompileConfig | None, graph_support: ResolvedGraphSupport, max_blocks: int):
        self.model = model
        self.backend = backend
        self.device = device
        self.max_decode_bs = max_num_seqs
        self.max_blocks = max_blocks
        self.config = compile_config
        # persistent buffers: sized by max_decode_bs, set up whether or not graphs are used
        backend.init_cuda_graph_state(self.max_decode_bs)
        self.staging = DecodeStaging(self.max_decode_bs, len(backend.specs), max_blocks, device)
        st = self.staging
        self.sampling = SamplingBuffers(max_num_seqs, device, temperature=st.temperature, top_k=st.top_k,
                                        top_p=st.top_p, seeds=st.seeds, steps=st.steps)
        self.input_ids, self.positions = st.input_ids, st.positions
        self.readback = TokenReadback(max_num_seqs, device)
        self.launches = 0
        self.compile_seconds = 0.0
        self.capture_seconds = 0.0
        if compile_config is None:
            self.decode_step: StepFn = self._decode_forward
            self.extend_step: StepFn = self._extend_forward
        else:
            from tscompile.backend import compile_step

            whole = replace(compile_config, split_ops=(), split_sdpa=False, split_narrowing=False,
                            static_inductor_options=decode_static_inductor_options(compile_config, device))
            self.decode_step = compile_step(self._decode_forward, whole)
            self.extend_step = compile_step(self._extend_forward, compile_config)
        self.decode_graphs = None
        self._placeholder: dict[int, torch.Tensor] | None = None
        self._guards: dict[tuple[int, bool], dict] = {}  # graph-debug snapshots per captured graph
        self.decode_ladder: tuple[int, ...] = ()
        graphs_on = compile_config is not None and compile_config.cudagraphs and device.type == "cuda"
        if graphs_on and graph_support.support.decode_graph:
            from tscompile.runtime.decode_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(device)
            self.decode_ladder = tuple(b for b in compile_config.decode_ladder if b <= self.max_decode_bs)
        self.piece_graphs: PieceGraphRuntime | None = None
        if graphs_on and graph_support.support.prefill_graph:
            self.enable_prefill_graphs(PieceGraphRuntime(device))

    def enable_prefill_graphs(self, runtime: PieceGraphRuntime) -> None:
        """Pad extend/mixed steps to the token ladder (and narrowed rows to the row ladder) and let
        the compiled pieces capture themselves per bucket (``runtime/piece_graphs.py``)."""
        cfg = self.config
        self.piece_graphs = runtime
        self.token_ladder = tuple(b for b in cfg.token_ladder if b <= cfg.prefill_graph_max_tokens)
        windows = [s.window for s in self.backend.specs if s.narrowed]
        cap = max(windows, default=0) * self.max_decode_bs
        # decoder rows per step are at most window * max_num_seqs: the token ladder clipped there
        self.row_ladder = tuple(sorted({min(b, cap) for b in self.token_ladder})) if windows else ()
        top = self.token_ladder[-1] if self.token_ladder else 0
        self.prefill_ids = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.prefill_positions = torch.zeros(top, dtype=torch.int64, device=self.device)

    # Two functions on purpose: Dynamo keys its cache by code object, and the decode step (compiled
    # whole) and the extend step (compiled piecewise) must not share entries.
    def _decode_forward(self, input_ids: torch.Tensor, prev_rows: torch.Tensor, positions: torch.Tensor,
                        all_greedy: bool) -> torch.Tensor:
        # A row whose token the previous step sampled and the host has not read yet takes it from
        # the sampled-token buffer (read here, before this step's sample overwrites it).
        prev = self.sampling.tokens.index_select(0, prev_rows.clamp(min=0))
        ids = torch.where(prev_rows >= 0, prev, input_ids)
        return self.sampling.sample(self.model(ids, positions), all_greedy)

    def _extend_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        return self.sampling.sample(self.model(input_ids, positions), all_greedy)

    def _timed(self, step: StepFn, *args) -> torch.Tensor:
        """Run a step; a call during which the backend compiled a graph counts as compile time."""
        before = counters["graphs"]
        start = time.perf_counter()
        out = step(*args)
        if counters["graphs"] != before:
            self.compile_seconds += time.perf_counter() - start
        return out

    # -- host -> device ------------------------------------------------------------------------------
    def _to_device(self, values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _block_tables(self, sched: Scheduler, batch: ScheduledBatch) -> dict[int, torch.Tensor]:
        slots = [r.slot for r in batch.requests]
        return {g: torch.from_numpy(t[slots]).to(self.device, non_blocking=True)
                for g, t in enumerate(sched.block_tables)}

    def _fill_sampling(self, batch: ScheduledBatch, pad_to: int) -> None:
        reqs = batch.requests
        steps = [len(r.prompt) + r.num_generated for r in reqs]
        self.sampling.fill([r.params for r in reqs], [r.seed for r in reqs], steps, pad_to)

    @torch.inference_mode()  # Dynamo guards on it: every caller must reach the same compiled entries
    def launch(self, sched: Scheduler, batch: ScheduledBatch, prev_rows: list[int] | None = None) -> PendingTokens:
        """Launch one step; its tokens (one per request of ``batch``, in batch order) come back through
        the returned handle. ``prev_rows[i]`` (decode only) is the row of the previous step's sample
        that is decode row i's input token, or -1 when the host knows it (see ``can_chain``)."""
        check_inputs_on_host(batch, prev_rows)
        self.launches += 1
        if batch.mode is ForwardMode.DECODE:
            self._decode(sched, batch, prev_rows)
        else:
            if prev_rows is not None:
                raise RuntimeError("tscompile: only a decode step takes its input tokens from the device")
            self._extend(sched, batch)
        return self.readback.start(self.sampling.tokens[: len(batch.requests)])

    def execute(self, sched: Scheduler, batch: ScheduledBatch) -> list[int]:
        """Run one step and wait for its tokens."""
        return self.launch(sched, batch).wait()

    def can_chain(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch`` may run before the previous step's tokens reach the host: a decode step
        that captures nothing first (a capture's warm-up runs overwrite the sampled-token buffer)."""
        if batch.mode is not ForwardMode.DECODE:
            return False
        bs = self.decode_bucket(len(batch.decodes))
        if self.decode_graphs is None or bs not in self.decode_graphs:
            return True
        return (bs, all(r.params.greedy for r in batch.decodes)) in self.decode_graphs

    # -- decode --------------------------------------------------------------------------------------
    def decode_bucket(self, actual_bs: int) -> int:
        for bs in self.decode_ladder:
            if bs >= actual_bs:
                return bs
        return actual_bs  # above the ladder (or no graphs): the same refresh, no graph

    def _decode(self, sched: Scheduler, batch: ScheduledBatch, prev_rows: list[int] | None) -> None:
        actual_bs = len(batch.decodes)
        bs = self.decode_bucket(actual_bs)
        graphed = self.decode_graphs is not None and bs in self.decode_graphs
        greedy = all(r.params.greedy for r in batch.decodes)
        if graphed and (bs, greedy) not in self.decode_graphs:
            self._capture_decode(bs, greedy)  # a first sampled batch at this size: one-time capture
        self._refresh_decode(sched, batch, bs, graphed, prev_rows)
        if graphed:
            if self._guards:
                pointer_guard.verify(self._guards[(bs, greedy)], self._guard_roots())
            self.decode_graphs.replay((bs, greedy))
            counters["decode_replays"] += 1
        else:
            with forward_context(ForwardContext(ForwardMode.DECODE, self.backend)):
                self._timed(self.decode_step, self.input_ids[:bs], self.staging.prev_rows[:bs],
                            self.positions[:bs], greedy)
            counters["decode_eager"] += 1

    def _refresh_decode(self, sched: Scheduler, batch: ScheduledBatch, bs: int, graphed: bool,
                        prev_rows: list[int] | None) -> None:
        """Stage this step's host facts (one copy per dtype), then the one decode metadata refresh."""
        reqs, actual_bs = batch.decodes, len(batch.decodes)
        lens = sched.group_lens_after(batch)
        slots = [r.slot for r in reqs]
        ids, pos = sched.input_rows(batch)
        st = self.staging
        st.fill(ids=ids, positions=pos, seeds=[r.seed for r in reqs],
                steps=[len(r.prompt) + r.num_generated for r in reqs], top_k=[r.params.top_k for r in reqs],
                temperature=[r.params.temperature for r in reqs], top_p=[r.params.top_p for r in reqs],
                group_lens=lens, group_tables=[t[slots] for t in sched.block_tables], bs=bs,
                prev_rows=prev_rows)
        st.upload()
        groups = range(len(sched.specs))
        self.backend.refresh_decode_metadata(
            bs, actual_bs, torch.tensor(slots), st.seq_lens(0, actual_bs),  # req_pool_indices: on cpu
            forward_mode=ForwardMode.DECODE, block_tables={g: st.block_tables(g, actual_bs) for g in groups},
            num_extends=0, for_graph_replay=graphed,
            group_seq_lens={g: st.seq_lens(g, actual_bs) for g in groups if sched.specs[g].narrowed},
        )

    def _guard_roots(self) -> dict:
        return {
            **{f"leaves[{g}].forward_decode_metadata": leaf.forward_decode_metadata
               for g, leaf in enumerate(self.backend.leaves)},
            "router.decode_write_locations": self.backend.decode_write_locations,
        }

    def capture_decode_graphs(self) -> None:
        """Capture the whole ladder, largest first, into one pool; logs one stable line."""
        if self.decode_graphs is None:
            return
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        for bs in tqdm(sorted(self.decode_ladder, reverse=True), desc="Capturing CUDA graphs (decode)",
                       disable=None):
            self._capture_decode(bs, greedy=True)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start - self.compile_seconds
        took = (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30
        logger.info("Graph capturing finished in %.0f s, took %.2f GiB", time.perf_counter() - start, took)

    def _capture_decode(self, bs: int, greedy: bool) -> None:
        """Capture the decode step for ``bs`` rows: inherited capture = the idle refresh over the
        placeholder tables (every row padding), then the compiled step recorded into the pool."""
        groups = range(len(self.backend.specs))
        if self._placeholder is None:
            self._placeholder = {g: torch.zeros(self.max_decode_bs, self.max_blocks, dtype=torch.int32,
                                                device=self.device) for g in groups}
        ones = torch.ones(bs, dtype=torch.int32, device=self.device)
        self.backend.init_forward_metadata_capture_cuda_graph(
            bs, torch.zeros(bs, dtype=torch.int64, device=self.device), ones,
            block_tables={g: t[:bs] for g, t in self._placeholder.items()},
            group_seq_lens={g: ones for g in groups if self.backend.specs[g].narrowed},
        )
        self.input_ids[:bs].zero_()
        self.staging.prev_rows[:bs].fill_(-1)
        self.positions[:bs].zero_()
        self.sampling.fill([], [], [], pad_to=bs)

        def run_step():
            with forward_context(ForwardContext(ForwardMode.DECODE, self.backend)):
                self._timed(self.decode_step, self.input_ids[:bs], self.staging.prev_rows[:bs],
                            self.positions[:bs], greedy)

        self.decode_graphs.capture((bs, greedy), run_step)
        counters["decode_captures"] += 1
        if pointer_guard.graph_debug_enabled():
            self._guards[(bs, greedy)] = pointer_guard.snapshot(self._guard_roots())

    # -- extend / mixed ------------------------------------------------------------------------------
    def _prefill_plan(self, batch: ScheduledBatch, completes: list[bool]) -> PrefillGraphPlan | None:
        """The buckets this step is padded to, or None when prefill graphs are off."""
        if self.piece_graphs is None:
            return None
        cfg = self.config
        tokens = cfg.bucket(self.token_ladder, batch.num_tokens) if self.token_ladder else None
        rows = None
        narrowed = [s for s in self.backend.specs if s.narrowed]
        if narrowed:
            window = narrowed[0].window
            kept = sum(kept_rows(n, done, window) for (_, n), done in zip(batch.extends, completes))
            rows = cfg.bucket(self.row_ladder, kept + len(batch.decodes))
            counters["decoder_rows_graphed" if rows is not None else "decoder_rows_eager"] += 1
        return PrefillGraphPlan(self.piece_graphs, tokens, rows)

    def _extend_inputs(self, ids: list[int], pos: list[int], plan: PrefillGraphPlan | None):
        """Token ids and positions on the device; padded (id 0, position 0) to the step's bucket."""
        if plan is None or plan.encoder_tokens is None:
            return self._to_device(ids, torch.int64), self._to_device(pos, torch.int64)
        n = plan.encoder_tokens
        pad = [0] * (n - len(ids))
        self.prefill_ids[:n].copy_(torch.tensor(ids + pad, dtype=torch.int64), non_blocking=True)
        self.prefill_positions[:n].copy_(torch.tensor(pos + pad, dtype=torch.int64), non_blocking=True)
        return self.prefill_ids[:n], self.prefill_positions[:n]

    def _extend(self, sched: Scheduler, batch: ScheduledBatch) -> None:
        reqs = batch.requests
        num_extends = len(batch.extends)
        lens = sched.group_lens_after(batch)
        completes = sched.completes(batch) + [False] * len(batch.decodes)
        plan = self._prefill_plan(batch, completes)
        pad_rows = {}
        if plan is not None:
            for g, spec in enumerate(sched.specs):
                rows = plan.decoder_rows if spec.narrowed else plan.encoder_tokens
                if rows is not None:
                    pad_rows[g] = rows
        ext = torch.tensor([n for _, n in batch.extends], dtype=torch.int32)
        prefix = torch.tensor([r.num_computed for r, _ in batch.extends], dtype=torch.int32)
        prompt = torch.tensor([len(r.prompt) for r, _ in batch.extends], dtype=torch.int32)
        seq_lens_cpu = torch.tensor(lens[0], dtype=torch.int32)
        self.backend.init_forward_metadata(
            forward_mode=batch.mode, req_pool_indices=self._to_device([r.slot for r in reqs], torch.int64),
            seq_lens=seq_lens_cpu.to(self.device), seq_lens_cpu=seq_lens_cpu,
            block_tables=self._block_tables(sched, batch), num_extends=num_extends,
            extend_seq_lens=ext.to(self.device), extend_seq_lens_cpu=ext,
            extend_prefix_lens=prefix.to(self.device), extend_prefix_lens_cpu=prefix,
            extend_with_prefix=bool((prefix > 0).any()), extend_prompt_lens_cpu=prompt,
            group_seq_lens_cpu={g: torch.tensor(lens[g], dtype=torch.int32)
                                for g, s in enumerate(sched.specs) if s.narrowed},
            pad_rows=pad_rows,
        )
        ids, pos = self._extend_inputs(*sched.input_rows(batch), plan)
        self._fill_sampling(batch, len(reqs))
        ctx = ForwardContext(batch.mode, self.backend, self._to_device(completes, torch.bool), prefill_graphs=plan)
        with forward_context(ctx):
            # the sample lands in sampling.tokens (an input the step writes), where launch reads it
            self._timed(self.extend_step, ids, pos, all(r.params.greedy for r in reqs))
        graphed = plan is not None and plan.encoder_tokens is not None
        counters["prefill_graphed" if graphed else "prefill_eager"] += 1
