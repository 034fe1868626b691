"""One decode step: the plan's rows padded to a batch size, staged, refreshed, then its graph replayed
(or the same compiled step run without one). The sample lands in the sampled-token buffer.

Padding: the smallest decode-ladder size ``bs >= n`` (``GraphRunner.decode_size``; above the ladder,
or without graphs, ``bs = n``). The plan's host facts go up in one upload (``DecodeStaging``); the
only decode metadata is ``refresh_decode_metadata``, which rewrites the persistent buffers the graph
reads: launched before each replay, or, with ``KernelPolicy.graphed_refresh`` where the backend's
refresh reads nothing from the host, captured in the graph over the staged rows padded to ``bs``.
Rows ``[n, bs)`` are padding and resolve to the null page. A batch size's graph is captured on its
first sampled (not all-greedy) step, or at start-up for the greedy variant of every ladder size
(``capture_ladder``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from tscompile.attention.router import AttentionRouter
from tscompile.backend import compile_step
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
from tscompile.models.llama import Transformer
from tscompile.runtime.compile_clock import CompileClock
from tscompile.runtime.dynamic_sizes import SpareRowSampling
from tscompile.runtime.graph_runner import DECODE, GraphKey, GraphRunner
from tscompile.runtime.staging import DecodeStaging
from tscompile.step_plan import StepPlan

logger = logging.getLogger("tscompile")


class DecodeStep:
    """The decode half of a ``ModelRunner``: ``run(plan, prev_rows)``, ``ready(plan)``, ``capture_ladder()``.

    ``compiled`` is the decode forward compiled whole with dynamic sizes, ``compiled_one`` the same
    forward with every size static (bs=1: only a static graph gets ``static_inductor_options``,
    with which Inductor turns the one-row matmuls into GEMV reductions); both are the eager forward
    without a compile config. ``config`` is the decode step's own (compiled whole, its static options
set: ``ModelRunner``). ``graphs`` is None without decode graphs."""

    def __init__(self, model: Transformer, attention: AttentionRouter, staging: DecodeStaging,
                 sampling: SpareRowSampling, *, max_num_seqs: int, device: torch.device,
                 config: TscompileConfig | None, clock: CompileClock):
        self.model, self.attention, self.staging, self.sampling = model, attention, staging, sampling
        self.device, self.clock, self.config = device, clock, config
        self.logits_rows = torch.arange(max_num_seqs, device=device)  # a decode row samples itself
        self.graphs: GraphRunner | None = None
        self._said_above_ladder = False
        # the graphs hold the refresh, so a replay launches nothing before its graph (set with the graphs:
        # ModelRunner.use_graphs)
        self.graphed_refresh = False
        if config is None:
            self.compiled = self.compiled_one = self.forward
        else:
            self.compiled = compile_step(self.forward, config)
            # Through the dynamic step a bs=1 call recompiles too (Dynamo specializes a size of 1), but
            # that graph keeps the pool's and page table's sizes symbolic: it never counted as static.
            self.compiled_one = compile_step(self.forward, config, dynamic=False)

    def forward(self, input_ids: torch.Tensor, prev_rows: torch.Tensor, positions: torch.Tensor,
                all_greedy: bool, logprobs: bool = False) -> torch.Tensor:
        """The compiled function. ``input_ids``/``prev_rows``/``positions``: int64 ``[bs]`` on the
        device. A row whose token the previous step sampled and the host has not read yet
        (``prev_rows >= 0``) takes it from the sampled-token buffer, read here before this step's
        sample overwrites it. Returns the sampled tokens, int64 ``[bs]`` (also written to
        ``sampling.tokens[:bs]``); ``logprobs``: their log-probabilities too (``sampling.logprobs``)."""
        prev = self.sampling.tokens.index_select(0, prev_rows.clamp(min=0))
        ids = torch.where(prev_rows >= 0, prev, input_ids)
        return self.sampling.sample(self.model(ids, positions), all_greedy, logprobs)

    # -- the step ------------------------------------------------------------------------------------
    def padded_size(self, num_requests: int) -> int:
        return self.graphs.decode_size(num_requests) if self.graphs is not None else num_requests

    def ready(self, plan: StepPlan) -> bool:
        """Whether ``plan`` launches without capturing first (a capture's warm-up runs overwrite the
        sampled-token buffer, so a step that captures cannot chain onto one in flight)."""
        graphs = self.graphs
        if graphs is None:
            return True
        if plan.sampling.logprobs:
            return True  # runs without a graph: nothing to capture
        key = graphs.decode_key(graphs.decode_size(plan.num_requests), plan.sampling.all_greedy)
        return key is None or key in graphs.graphs

    def run(self, plan: StepPlan, prev_rows: list[int] | None) -> None:
        n = plan.num_requests
        greedy, logprobs = plan.sampling.all_greedy, plan.sampling.logprobs
        graphs = self.graphs
        if graphs is None or logprobs:  # the graphs sample without log-probabilities: this step runs without one
            bs, key = (n if graphs is None else graphs.decode_size(n)), None
        else:
            bs = graphs.decode_size(n)
            key = graphs.decode_key(bs, greedy)
            if key is not None and key not in graphs.graphs:
                self.capture(key)  # a first sampled batch at this size: one-time capture
        in_graph = key is not None and self.graphed_refresh
        self.staging.fill(plan, bs, prev_rows, pad_tables=in_graph)
        self.staging.upload()
        if in_graph:
            self.attention.publish_decode_views(bs)
            graphs.replay_graph(key)
            return
        self.attention.refresh_decode_metadata(bs, self.staging.decode_inputs(n, plan))
        if key is not None:
            graphs.replay_graph(key)
            return
        if graphs is not None and graphs.replay and not self._said_above_ladder and not logprobs:
            self._said_above_ladder = True
            logger.info("tscompile: a decode batch of %d runs without a CUDA graph (above the decode ladder "
                        "%s); later ones say nothing", n, graphs.decode_ladder)
        self.run_compiled(bs, greedy, logprobs)
        counters["decode_eager"] += 1

    def refresh_padded(self, bs: int, width: int = 1) -> None:
        """The refresh a graph holds (``graphed_refresh``): over all ``bs`` staged rows, whose tables
        and lengths the staging padded, so rows past the live ones refresh as padding."""
        inputs = self.staging.decode_inputs(bs)
        self.attention.refresh_decode_metadata(bs, inputs if width == 1 else inputs.with_width(width))

    def run_compiled(self, bs: int, greedy: bool, logprobs: bool = False) -> None:
        """The compiled decode step over the first ``bs`` rows of the static buffers (what a graph
        captures)."""
        st = self.staging
        with forward_context(ForwardContext(ForwardMode.DECODE, self.attention, self.logits_rows[:bs])):
            step = self.compiled_one if bs == 1 else self.compiled
            self.clock.run("decode", step, st.input_ids[:bs], st.prev_rows[:bs], st.positions[:bs], greedy, logprobs)

    # -- capture -------------------------------------------------------------------------------------
    def idle_inputs(self, bs: int, width: int = 1) -> None:
        """Before a capture: the idle refresh, and every static input of ``bs`` requests (of ``width``
        query rows each) a padding row."""
        self.attention.refresh_idle_decode_metadata(bs, width)
        st = self.staging
        if self.graphed_refresh:
            st.zero_tables(bs)  # the captured refresh reads them
        st.input_ids[:bs * width].zero_()
        st.prev_rows[:bs].fill_(-1)
        st.positions[:bs * width].zero_()
        s = st.sampling_inputs
        for t, value in ((s.temperature, 0.0), (s.top_k, 1), (s.top_p, 1.0), (s.seeds, 0), (s.steps, 0),
                         (s.banned, -1)):
            t[:bs].fill_(value)

    def capture(self, key: GraphKey) -> None:
        """Record the step of ``key``'s size on idle inputs into the decode pool."""
        bs, greedy = key.batch_size, key.greedy
        self.capture_step(key, lambda: self.run_compiled(bs, greedy), prepare=lambda: self.idle_inputs(bs))

    def capture_step(self, key: GraphKey, run: Callable[[], None], prepare: Callable[[], None]) -> None:
        """Capture ``run`` (a decode or verify step of ``key``'s size and width) after ``prepare`` (its
        idle inputs): two warm-up runs (the first size's compiles, lazy allocations), then the
        capture; with ``graphed_refresh`` the graph holds the refresh over the padded staged rows."""
        bs, width = key.batch_size, key.width

        def step() -> None:
            if self.graphed_refresh:
                self.refresh_padded(bs, width)
            run()

        self.graphs.capture(key, step, prepare=prepare, warmup=2, tidy=True, guard_roots=self.guard_roots)

    def capture_ladder(self) -> None:
        """Capture the greedy variant of every ladder size, largest first (the sizes share one pool);
        logs one stable line."""
        graphs = self.graphs
        if graphs is None or not graphs.decode_ladder or not graphs.replay:
            return
        sizes = sorted(graphs.decode_ladder, reverse=True)
        took = graphs.capture_all(DECODE, sizes, lambda bs: self.capture(graphs.decode_key(bs, True)), self.device)
        # the first sizes' warm-ups compile: said apart, or a minute of compile reads as capture time
        logger.info("Graph capturing finished in %.0f s (compiling %.0f s of it), took %.2f GiB",
                    took["seconds"], took["compile_seconds"], took["gib"])

    def guard_roots(self) -> dict:
        """Every metadata object a decode graph reads (graph-debug mode checks they never move)."""
        return {
            **{f"leaves[{g}].forward_decode_metadata": leaf.forward_decode_metadata
               for g, leaf in enumerate(self.attention.leaves)},
            "router.decode_write_locations": self.attention.decode_write_locations,
            "runner.decode_logits_rows": self.logits_rows,
        }
