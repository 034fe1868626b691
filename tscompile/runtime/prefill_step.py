"""One extend or mixed step: the plan padded to a bucket, its metadata sent, then its whole-step graph
replayed, or the piecewise step run (its compiled pieces graphed per bucket). The sample lands in
the sampled-token buffer.

Extend and mixed metadata come only from the router's host arrays: ``extend_host_arrays`` (fresh,
the piecewise path) or ``fill_extend_host_arrays`` (into a whole-step bucket's staging), published
by ``publish_extend_metadata``.

Whole-step graphs (``mode="whole"``): pad the step to a (token, request) bucket
(``GraphRunner.prefill_size``), write its arrays into that bucket's persistent buffers
(``prefill_buffers.py``) and replay the bucket's graph. Piecewise (``mode="piecewise"``, and always
for the narrowing model): pad to a token bucket (and the kept rows to a row bucket,
``piece_graphs.py``), upload fresh metadata, run the split step: compiled pieces (captured per
bucket) with eager attention breaks between them. Above the token ladder, or without graphs: the
split step unpadded. The last piece's logits rows (one per request) are padded to a request
bucket, so that piece captures per request bucket rather than per request count.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tscompile.attention.router import AttentionRouter
from tscompile.backend import compile_step
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.forward_context import ForwardContext, forward_context
from tscompile.models.llama import Transformer
from tscompile.runtime.arena import upload_packed
from tscompile.runtime.compile_clock import CompileClock
from tscompile.runtime.dynamic_sizes import (SpareRowSampling, drop_input_size_asserts, mark_extend_request_dims,
                                             min_logits_rows)
from tscompile.runtime.graph_runner import GraphKey, GraphRunner
from tscompile.runtime.piece_graphs import PIECE_GRAPH_WRAPPERS, PrefillBuckets
from tscompile.runtime.prefill_buffers import WholeStepBuffers
from tscompile.runtime.staging import DecodeStaging
from tscompile.step_plan import StepPlan, put_padded


class PrefillStep:
    """The extend/mixed half of a ``ModelRunner``: ``run(plan)``, ``graph_keys(plan)``.

    ``compiled`` is the prefill forward compiled piecewise (its pieces wrapped for graphs when the
    config asks for CUDA graphs), the eager forward without a compile config. ``use_graphs`` picks
    the graph mode; ``mode`` is None without prefill graphs."""

    def __init__(self, model: Transformer, attention: AttentionRouter, staging: DecodeStaging,
                 sampling: SpareRowSampling, *, max_num_seqs: int, device: torch.device,
                 config: TscompileConfig | None, clock: CompileClock):
        self.model, self.attention, self.staging, self.sampling = model, attention, staging, sampling
        self.max_num_seqs, self.device, self.config, self.clock = max_num_seqs, device, config, clock
        self.graphs: GraphRunner | None = None
        self.mode: str | None = None
        self.buckets: PrefillBuckets | None = None  # piecewise
        self.whole: WholeStepBuffers | None = None  # whole-step
        # a step of the same graph key over placeholder requests (prefill_capture.placeholder_like);
        # set for a model with recurrent-state layers, whose whole-step graphs are captured on it
        self.capture_placeholder: Callable[[StepPlan], StepPlan] | None = None
        if config is None:
            self.compiled = self.forward
        else:
            wrappers = PIECE_GRAPH_WRAPPERS if config.cudagraphs else None
            # the first prefill piece must not read the request counts (dynamic_sizes.py)
            self.compiled = compile_step(self.forward, config, wrappers, graph_pass=drop_input_size_asserts)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """The compiled function. ``input_ids``/``positions``: int64 ``[T]`` on the device (T: the
        padded token rows). Returns one sampled token per logits row of the forward context, int64
        (also written to ``sampling.tokens``)."""
        return self.sampling.sample(self.model(input_ids, positions), all_greedy)

    def use_graphs(self, graphs: GraphRunner, mode: str) -> None:
        """Prefill graphs through ``graphs``: ``mode`` "whole" (one graph per padded step) or
        "piecewise" (the compiled pieces per bucket)."""
        self.graphs, self.mode = graphs, mode
        if mode == "whole":
            self.whole, self.buckets = WholeStepBuffers(self.device, self._layout), None
            return
        specs = self.attention.specs
        narrowed = next((g for g, s in enumerate(specs) if s.narrowed), None)
        self.whole = None
        self.buckets = PrefillBuckets(graphs, graphs.token_ladder, num_groups=len(specs), narrowed=narrowed,
                                      window=specs[narrowed].window if narrowed is not None else 0,
                                      max_num_seqs=self.max_num_seqs, request_ladder=graphs.request_ladder)
        top = graphs.token_ladder[-1] if graphs.token_ladder else 0
        self.ids_buffer = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.positions_buffer = torch.zeros(top, dtype=torch.int64, device=self.device)

    def graph_keys(self, plan: StepPlan) -> frozenset:
        """The prefill graphs a step of ``plan``'s shape replays (empty: it runs without graphs)."""
        if self.whole is not None:
            key = self._whole_key(plan)
            return frozenset() if key is None else frozenset({key})
        return self.buckets.graph_keys(plan) if self.buckets is not None else frozenset()

    def run(self, plan: StepPlan) -> None:
        key = self._whole_key(plan) if self.whole is not None else None
        if key is not None:
            self._run_whole(plan, key)
        else:
            self._run_pieces(plan)

    # -- whole-step graphs ---------------------------------------------------------------------------
    def _whole_key(self, plan: StepPlan) -> GraphKey | None:
        size = self.graphs.prefill_size(plan.num_tokens, plan.num_requests)
        if size is None:
            return None
        return self.graphs.prefill_key(*size, plan.sampling.all_greedy, plan.mode)

    def _run_whole(self, plan: StepPlan, key: GraphKey) -> None:
        """The step padded to ``key.tokens`` rows and ``key.batch_size`` requests, as one graph.

        A capture runs its step more than once (warm-up, then the replay that gives the first
        outputs): the K/V writes repeat the same values, but a recurrent state would advance twice.
        With ``capture_placeholder`` a new key is captured on a placeholder step's inputs (null pages
        and the null state slot), as decode captures on idle inputs, and this step only replays it."""
        greedy, mode = plan.sampling.all_greedy, plan.mode
        if self.capture_placeholder is not None and self.graphs.replay and not self.graphs.captured(key):
            placeholder = self.capture_placeholder(plan)
            if self._whole_key(placeholder) != key:
                raise RuntimeError(f"tscompile: the placeholder of a prefill step reaches graph "
                                   f"{self._whole_key(placeholder)}, not the step's {key}")
            self.graphs.capture(key, self._whole_step(self._stage_whole(placeholder, key), mode, greedy))
        self.graphs.run(key, self._whole_step(self._stage_whole(plan, key), mode, greedy))
        counters["prefill_graphed"] += 1

    def _stage_whole(self, plan: StepPlan, key: GraphKey) -> list[torch.Tensor]:
        """``plan``'s inputs in the persistent buffers of ``key``'s bucket (returned), published."""
        dev = self.whole.stage((key.tokens, key.batch_size), lambda host: self._fill_whole_step(plan, host))
        self.attention.publish_extend_metadata(plan, dev[5:])
        self.staging.fill_sampling(plan.sampling, key.batch_size)
        self.staging.upload()
        return dev

    def _whole_step(self, dev: list[torch.Tensor], mode, greedy: bool) -> Callable[[], None]:
        def step() -> None:  # under CUDA graphs only a capture runs it: a replay reads the buffers directly
            mark_extend_request_dims(self.attention.leaves, dev[4], self.attention.state)
            with forward_context(ForwardContext(mode, self.attention, dev[2], dev[3], dev[4])):
                self.clock.run("prefill", self.compiled, dev[0], dev[1], greedy)

        return step

    def _layout(self, tokens: int, requests: int) -> list[tuple[tuple[int, ...], np.dtype]]:
        """The input arrays of a whole-step bucket, in ``_fill_whole_step``'s order."""
        i64 = np.dtype(np.int64)
        return [((tokens,), i64), ((tokens,), i64), ((requests,), i64), ((requests + 1,), np.dtype(np.int32)),
                ((requests,), np.dtype(bool)), *self.attention.extend_array_layout(tokens, requests)]

    def _fill_whole_step(self, plan: StepPlan, host: list[np.ndarray]) -> None:
        """Write ``plan`` padded to the bucket of ``host`` (its staging): token ids, positions,
        logits rows, query offsets, ``completes``, then the attention metadata. Padded token rows
        are token 0 at position 0; padded requests sample row 0 and have an empty query range."""
        ids, pos, logits_rows, qo_indptr, completes = host[:5]
        put_padded(ids, plan.input_ids, 0)
        put_padded(pos, plan.positions, 0)
        put_padded(logits_rows, plan.logits_rows, 0)
        put_padded(qo_indptr, plan.qo_indptr, plan.num_tokens)
        put_padded(completes, plan.completes, False)
        self.attention.fill_extend_host_arrays(plan, host[5:])

    # -- the piecewise step --------------------------------------------------------------------------
    def _run_pieces(self, plan: StepPlan) -> None:
        buckets = self.buckets
        graphs = buckets.plan_for(plan) if buckets is not None else None
        groups = self.attention.extend_host_arrays(plan, buckets.pad_rows(graphs) if graphs is not None else {})
        padded = graphs.encoder_tokens if graphs is not None else None
        requests = graphs.logits_rows if graphs is not None else None
        ids, pos, logits_rows = plan.input_ids, plan.positions, plan.logits_rows
        if padded is not None:  # padded rows: token 0 at position 0, writing to the null page
            ids, pos = (np.concatenate([a, np.zeros(padded - a.shape[0], dtype=a.dtype)]) for a in (ids, pos))
        if requests is None and plan.num_requests < min_logits_rows(self.max_num_seqs):
            requests = min_logits_rows(self.max_num_seqs)  # why: dynamic_sizes.py
        if requests is not None:  # padded logits rows read row 0; their samples land in rows nobody reads
            logits_rows = np.concatenate([logits_rows, np.zeros(requests - plan.num_requests, dtype=logits_rows.dtype)])
        # one upload in the whole-step buffers' order and layout: every metadata view then sits at the
        # same kind of offset as there (0 for the first, >= 2 after it), and Dynamo, which
        # specializes a storage offset of 0 or 1, compiles one graph for both paths
        dev = upload_packed([ids, pos, logits_rows, plan.qo_indptr, plan.completes, *groups], self.device)
        self.attention.publish_extend_metadata(plan, dev[5:])
        ids, pos, logits_rows, qo_indptr, completes = dev[:5]
        if padded is not None:  # the graphed first piece reads them at a fixed address
            ids = self.ids_buffer[:padded].copy_(ids)
            pos = self.positions_buffer[:padded].copy_(pos)
        # the sampling op's inputs live in the decode staging; rows past the live ones are padding
        self.staging.fill_sampling(plan.sampling, requests)
        self.staging.upload()
        ctx = ForwardContext(plan.mode, self.attention, logits_rows, qo_indptr, completes, prefill_graphs=graphs)
        mark_extend_request_dims(self.attention.leaves, completes, self.attention.state)
        with forward_context(ctx):
            # the sample lands in sampling.tokens (an input the step writes), where launch reads it
            self.clock.run("prefill", self.compiled, ids, pos, plan.sampling.all_greedy)
        counters["prefill_graphed" if padded is not None else "prefill_eager"] += 1
