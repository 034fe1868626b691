"""The model runner: turns a step plan into one forward and one sampling call.

It knows buckets and padding; it hands the plan to the attention router and never computes a page
or a slot itself. Decode metadata comes only from ``refresh_decode_metadata`` (eager, capture and
replay alike); extend and mixed metadata only from the router's ``extend_host_arrays``, published
by ``publish_extend_metadata`` (uploaded fresh, or staged into a whole-step graph's buffers).

Decode: pad to the smallest ladder size ``bs >= actual_bs`` (above the ladder, or without graphs,
``bs = actual_bs``), stage the plan's host facts in one upload, refresh, then replay the
captured step for ``bs`` (``decode_graphs.py``) or run the very same compiled step without a
graph. Rows ``[actual_bs, bs)`` are padding and resolve to the null page.

Extend / mixed, whole-step prefill graphs (``prefill_graph_mode="whole"``, ``prefill_graphs.py``):
pad the step to a (token, request) bucket, send its metadata into that bucket's persistent buffers
and replay the bucket's graph of the whole step. Piecewise (the default, and always for the
narrowing model): pad to a token bucket (and the kept rows to a row bucket,
``piece_graphs.py``), build fresh metadata from the plan, run the split step: compiled pieces
(captured per bucket) with eager attention breaks between them. Above the token ladder: the split
step without graphs. The last piece's logits rows (one per request) are padded to a request
bucket, so that piece captures per request bucket rather than per request count.

Start-up (``prefill_capture="startup"``): ``capture_prefill_graphs`` runs placeholder steps
(``prefill_capture.py``) that capture every graph a greedy step up to the largest bucket needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from tscompile.attention.router import AttentionRouter
from tscompile.attention.support import ResolvedGraphSupport
from tscompile.backend import compile_step
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
from tscompile.models.llama import Transformer
from tscompile.runtime.decode_graphs import DecodeGraphRunner
from tscompile.runtime.dynamic_sizes import (SpareRowSampling, drop_input_size_asserts, mark_extend_request_dims,
                                             min_logits_rows)
from tscompile.runtime.piece_graphs import PIECE_GRAPH_WRAPPERS, PieceGraphRuntime, PrefillBuckets
from tscompile.runtime.prefill_capture import request_ladder
from tscompile.runtime.arena import upload_packed
from tscompile.runtime.prefill_graphs import WholeStepPrefill
from tscompile.runtime.readback import PendingTokens, TokenReadback
from tscompile.runtime.staging import DecodeStaging
from tscompile.step_plan import StepPlan, put_padded

StepFn = Callable[..., torch.Tensor]
# what counts steps run, not graphs: start-up placeholder steps leave these as they were
STEP_COUNTERS = ("prefill_graphed", "prefill_eager", "decoder_rows_graphed", "decoder_rows_eager")
logger = logging.getLogger("tscompile")
# what ``torch.inference_mode(True)`` enters, without its Python wrapper (torch 2.11-2.13 have it)
_inference_mode = getattr(torch._C, "_InferenceMode", None) or torch.inference_mode


def check_inputs_on_host(plan: StepPlan, prev_rows: list[int] | None) -> None:
    """Refuse a step whose row needs a token the host has not read and ``prev_rows`` does not place
    on the device (a runner called directly while the engine has a step in flight)."""
    rows = plan.tokens_on_device
    if rows.shape[0] == 0:
        return
    first_decode = plan.num_tokens - plan.num_decodes
    for row in rows.tolist():  # Python ints: numpy scalar arithmetic costs more than the check
        decode_row = row - first_decode
        if prev_rows is None or decode_row < 0 or prev_rows[decode_row] < 0:
            rid = plan.request_ids[plan.num_extends + max(decode_row, 0)]
            raise RuntimeError(f"tscompile: request {rid}'s last token is still on the device; call "
                               "LLM.sync() before running the runner directly")


def whole_step_prefill_possible(attention: AttentionRouter, graph_support: ResolvedGraphSupport,
                                asked: bool = True) -> bool:
    """Whole-step prefill graphs fall back to the piecewise graphs (said once in the log) when the
    narrowing model runs (its row ladder lives in the piecewise path) or an attention backend cannot
    launch its extend inside a graph. A fallback the user asked against (``asked``: the mode "whole"
    rather than "auto") is a warning."""
    mode = "'whole'" if asked else "'auto'"
    if any(s.narrowed for s in attention.specs):
        logger.info("tscompile: prefill_graph_mode=%s runs piecewise prefill graphs: the narrowing model "
                    "pads its rows per bucket in the piecewise path", mode)
        return False
    if not graph_support.support.whole_prefill_graph:
        (logger.warning if asked else logger.info)(
            "tscompile: prefill_graph_mode=%s runs piecewise prefill graphs: %s cannot launch its extend "
            "attention inside a captured graph (cuda_graph_support.whole_prefill_graph=False)",
            mode, ", ".join(graph_support.whole_prefill_culprits))
        return False
    return True


def decode_static_inductor_options(config: TscompileConfig, device: torch.device) -> dict:
    """The decode step's patches for its static-size (bs=1) graph: the user's ``static_inductor_options``.

    Coordinate-descent tuning (the gpt-fast setting, ``{"coordinate_descent_tuning": True}`` here) is
    not added by default: on the H200 it doubled llama-1b's start-up (cold 59.8 -> 102.3 s, warm 22.9
    -> 49.4 s) for a llama-1b bs=1 step of 1.02-1.18 ms over three calls (1.15 ms untuned, an earlier
    tree), and made llama-8b's 2% slower."""
    del device  # the same on every device; kept so callers need not change when that stops being true
    return dict(config.static_inductor_options)


class ModelRunner:
    """Runs steps of one model over its paged cache: ``launch(plan)``, ``can_chain(plan)``, timings."""

    def __init__(self, model: Transformer, attention: AttentionRouter, *, max_num_seqs: int, max_blocks: int,
                 banned_width: int, device: torch.device, compile_config: TscompileConfig | None,
                 graph_support: ResolvedGraphSupport):
        self.model = model
        self.attention = attention
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.config = compile_config
        attention.bind_query_heads(model.config.n_heads)  # host planners (FlashInfer) size their plans by it
        # persistent buffers: sized by max_num_seqs, used with or without graphs
        attention.allocate_decode_buffers(max_num_seqs)
        self.staging = DecodeStaging(max_num_seqs, len(attention.specs), max_blocks, banned_width, device)
        self.sampling = SpareRowSampling(self.staging.sampling_inputs)  # why the spare row: dynamic_sizes.py
        self.readback = TokenReadback(max_num_seqs, device)
        self._sampled_views: dict[int, torch.Tensor] = {}
        self.decode_logits_rows = torch.arange(max_num_seqs, device=device)  # a decode row samples itself
        self.launches = 0
        self.compile_seconds = 0.0
        self.prefill_warmup_seconds = 0.0  # start-up placeholder steps, their captures and compiles apart
        self._said_above_ladder = False
        if compile_config is None:
            self.decode_step: StepFn = self._decode_forward
            self.decode_step_one: StepFn = self._decode_forward
            self.extend_step: StepFn = self._extend_forward
        else:
            whole = replace(compile_config, split_ops=(), split_sdpa=False, split_narrowing=False,
                            static_inductor_options=decode_static_inductor_options(compile_config, device))
            self.decode_step = compile_step(self._decode_forward, whole)
            # bs=1 apart, compiled with every size static: only a static graph gets the static
            # options (Inductor then turns the one-row matmuls into GEMV reductions). Through the
            # dynamic step, a bs=1 call recompiles too (Dynamo specializes a size of 1), but that
            # graph keeps the pool's and page table's sizes symbolic, so it never counted as static.
            self.decode_step_one = compile_step(self._decode_forward, whole, dynamic=False)
            wrappers = PIECE_GRAPH_WRAPPERS if compile_config.cudagraphs else None
            # the first prefill piece must not read the request counts (dynamic_sizes.py)
            self.extend_step = compile_step(self._extend_forward, compile_config, wrappers,
                                            graph_pass=drop_input_size_asserts)
        graphs_on = compile_config is not None and compile_config.cudagraphs and device.type == "cuda"
        self.decode_graphs: DecodeGraphRunner | None = None
        if graphs_on and graph_support.support.decode_graph:
            self.decode_graphs = DecodeGraphRunner(
                device, tuple(b for b in compile_config.decode_ladder if b <= max_num_seqs),
                prepare_capture=self._prepare_decode_capture, run_step=self._run_decode,
                guard_roots=self._guard_roots, compile_seconds=lambda: self.compile_seconds)
        self.prefill_buckets: PrefillBuckets | None = None
        self.whole_prefill: WholeStepPrefill | None = None
        if graphs_on and graph_support.support.prefill_graph:
            mode = compile_config.prefill_graph_mode
            if mode != "piecewise" and whole_step_prefill_possible(attention, graph_support, asked=mode == "whole"):
                self.enable_whole_step_prefill()
            else:
                self.enable_prefill_graphs(PieceGraphRuntime(device))

    def enable_prefill_graphs(self, runtime: PieceGraphRuntime) -> None:
        """Pad extend/mixed steps to the token ladder (and narrowed rows to the row ladder) and let
        the compiled pieces capture themselves per bucket."""
        cfg = self.config
        specs = self.attention.specs
        narrowed = next((g for g, s in enumerate(specs) if s.narrowed), None)
        ladder = tuple(b for b in cfg.token_ladder if b <= cfg.prefill_graph_max_tokens)
        self.prefill_buckets = PrefillBuckets(runtime, ladder, num_groups=len(specs), narrowed=narrowed,
                                              window=specs[narrowed].window if narrowed is not None else 0,
                                              max_num_seqs=self.max_num_seqs,
                                              request_ladder=request_ladder(cfg.decode_ladder, self.max_num_seqs))
        top = ladder[-1] if ladder else 0
        self.prefill_ids = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.prefill_positions = torch.zeros(top, dtype=torch.int64, device=self.device)

    def enable_whole_step_prefill(self, *, host_replay: bool = False) -> None:
        """Pad extend/mixed steps to a (token, request) bucket and run each as one CUDA graph
        (``prefill_graphs.py``); steps above the token ladder run the compiled pieces without one."""
        cfg = self.config
        tokens = tuple(b for b in cfg.token_ladder if b <= cfg.prefill_graph_max_tokens)
        requests = request_ladder(cfg.decode_ladder, self.max_num_seqs)
        self.whole_prefill = WholeStepPrefill(self.device, tokens, requests, host_replay=host_replay,
                                              compile_seconds=lambda: self.compile_seconds,
                                              layout=self._whole_step_layout)
        self.prefill_buckets = None

    @property
    def piece_graphs(self) -> PieceGraphRuntime | None:
        return self.prefill_buckets.runtime if self.prefill_buckets is not None else None

    @property
    def decode_capture_seconds(self) -> float:
        return self.decode_graphs.capture_seconds if self.decode_graphs is not None else 0.0

    @property
    def prefill_capture_seconds(self) -> float:
        """Prefill graph capture, at start-up (the placeholder steps' whole time, compiles apart) and
        on first use."""
        pieces = self.piece_graphs.capture_seconds if self.piece_graphs is not None else 0.0
        whole = self.whole_prefill.capture_seconds if self.whole_prefill is not None else 0.0
        return pieces + whole + self.prefill_warmup_seconds

    @property
    def capture_seconds(self) -> float:
        """Decode and prefill graph capture, compile time excluded."""
        return self.decode_capture_seconds + self.prefill_capture_seconds

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
        # every caller (launch, the start-up decode capture) reaches the same compiled entries: Dynamo
        # guards on grad mode, and with grad on it would trace a training graph
        if torch.is_inference_mode_enabled():
            out = step(*args)
        else:
            with _inference_mode(True):
                out = step(*args)
        if counters["graphs"] != before:
            self.compile_seconds += time.perf_counter() - start
        return out

    # -- the runner interface -------------------------------------------------------------------------
    def launch(self, plan: StepPlan, prev_rows: list[int] | None = None) -> PendingTokens:
        """Launch one step; its tokens (one per request of ``plan``, in plan order) come back through
        the returned handle. ``prev_rows[i]`` (decode only) is the row of the previous step's sample
        that is decode row i's input token, or -1 when the host knows it (see ``can_chain``)."""
        # Dynamo guards on inference mode: every caller must reach the same compiled entries. The
        # C++ guard itself, not ``torch.inference_mode()``, whose decorator and Python context cost
        # several microseconds per step
        if torch.is_inference_mode_enabled():
            return self._launch(plan, prev_rows)
        with _inference_mode(True):
            return self._launch(plan, prev_rows)

    def _launch(self, plan: StepPlan, prev_rows: list[int] | None) -> PendingTokens:
        check_inputs_on_host(plan, prev_rows)
        self.launches += 1
        if plan.mode is ForwardMode.DECODE:
            self._decode(plan, prev_rows)
        else:
            if prev_rows is not None:
                raise RuntimeError("tscompile: only a decode step takes its input tokens from the device")
            self._extend(plan)
        n = plan.num_requests
        return self.readback.start(self._sampled_rows(n), n)

    def _sampled_rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the sampled-token buffer (a view made once per ``n``: a torch
        slice costs microseconds of dispatch on every step)."""
        rows = self._sampled_views.get(n)
        if rows is None:
            rows = self._sampled_views[n] = self.sampling.tokens[:n]
        return rows

    def execute(self, plan: StepPlan) -> list[int]:
        """Run one step and wait for its tokens."""
        return self.launch(plan).wait()

    def can_chain(self, plan: StepPlan) -> bool:
        """Whether ``plan`` may run before the previous step's tokens reach the host: a decode step
        that captures nothing first (a capture's warm-up runs overwrite the sampled-token buffer)."""
        if plan.mode is not ForwardMode.DECODE:
            return False
        graphs = self.decode_graphs
        if graphs is None:
            return True
        bs = graphs.padded_size(plan.num_requests)
        return not graphs.covers(bs) or graphs.captured((bs, plan.sampling.all_greedy))

    def capture_decode_graphs(self) -> None:
        """Capture the whole decode ladder now (start-up), rather than on first use."""
        if self.decode_graphs is not None:
            self.decode_graphs.capture_ladder()

    # -- start-up prefill capture ------------------------------------------------------------------
    def prefill_graph_keys(self, plan: StepPlan) -> frozenset:
        """The prefill graphs a step of ``plan``'s shape replays (empty: it runs without graphs)."""
        if self.whole_prefill is not None:
            size = self.whole_prefill.bucket_of(plan.num_tokens, plan.num_requests)
            if size is not None:
                return frozenset({("whole", *size, plan.sampling.all_greedy, plan.mode)})
            return frozenset()
        return self.prefill_buckets.graph_keys(plan) if self.prefill_buckets is not None else frozenset()

    @property
    def prefill_token_ladder(self) -> tuple[int, ...]:
        """The token buckets of this runner's prefill graphs (empty: none)."""
        if self.whole_prefill is not None:
            return self.whole_prefill.token_ladder
        return self.prefill_buckets.token_ladder if self.prefill_buckets is not None else ()

    @property
    def prefill_request_ladder(self) -> tuple[int, ...]:
        if self.whole_prefill is not None:
            return self.whole_prefill.request_ladder
        return self.prefill_buckets.request_ladder if self.prefill_buckets is not None else ()

    @property
    def prefill_capture_at_startup(self) -> bool:
        return self.config is not None and self.config.prefill_capture == "startup" and bool(self.prefill_token_ladder)

    def capture_prefill_graphs(self, plans: list[StepPlan]) -> None:
        """Run the placeholder steps ``plans`` (``prefill_capture.py``), capturing what they reach;
        logs one line as the decode ladder does. The counters of steps run (graphed, eager, decoder
        rows) are left as they were: these are not steps; captures, replays and compiles count."""
        if not plans:
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        compiled_before, captured_before = self.compile_seconds, self.prefill_capture_seconds
        saved = {k: counters[k] for k in STEP_COUNTERS}
        try:
            for plan in tqdm(plans, desc="Capturing CUDA graphs (prefill)", disable=None):
                self.execute(plan)
        finally:
            for k, v in saved.items():
                counters[k] = v
        took = 0.0
        if cuda:
            torch.cuda.synchronize(self.device)
            took = (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30
        elapsed = time.perf_counter() - start
        # the steps around the captures exist only to capture: all of it but compiling is capture time
        captured = self.prefill_capture_seconds - captured_before
        compiled = self.compile_seconds - compiled_before
        self.prefill_warmup_seconds += max(elapsed - compiled - captured, 0.0)
        logger.info("Prefill graph capturing finished in %.0f s (%d steps, compiling %.0f s apart), took %.2f GiB",
                    elapsed - compiled, len(plans), compiled, took)

    # -- decode --------------------------------------------------------------------------------------
    def decode_bucket(self, actual_bs: int) -> int:
        return self.decode_graphs.padded_size(actual_bs) if self.decode_graphs is not None else actual_bs

    def _decode(self, plan: StepPlan, prev_rows: list[int] | None) -> None:
        n = plan.num_requests
        bs = self.decode_bucket(n)
        greedy = plan.sampling.all_greedy
        graphs = self.decode_graphs
        graphed = graphs is not None and graphs.covers(bs)
        if graphed and not graphs.captured((bs, greedy)):
            graphs.capture((bs, greedy))  # a first sampled batch at this size: one-time capture
        self.staging.fill(plan, bs, prev_rows)
        self.staging.upload()
        self.attention.refresh_decode_metadata(bs, self.staging.decode_inputs(n, plan))
        if graphed:
            graphs.replay((bs, greedy))
        else:
            if graphs is not None and graphs.replay_graphs and not self._said_above_ladder:
                self._said_above_ladder = True
                logger.info("tscompile: a decode batch of %d runs without a CUDA graph (above the decode ladder "
                            "%s); later ones say nothing", n, graphs.ladder)
            self._run_decode(bs, greedy)
            counters["decode_eager"] += 1

    def _run_decode(self, bs: int, greedy: bool) -> None:
        """The compiled decode step over the first ``bs`` rows of the static buffers."""
        st = self.staging
        ctx = ForwardContext(ForwardMode.DECODE, self.attention, self.decode_logits_rows[:bs])
        with forward_context(ctx):
            step = self.decode_step_one if bs == 1 else self.decode_step
            self._timed(step, st.input_ids[:bs], st.prev_rows[:bs], st.positions[:bs], greedy)

    def _prepare_decode_capture(self, bs: int) -> None:
        """Before a capture: the idle refresh, and every static input of ``bs`` rows a padding row."""
        self.attention.refresh_idle_decode_metadata(bs)
        st = self.staging
        st.input_ids[:bs].zero_()
        st.prev_rows[:bs].fill_(-1)
        st.positions[:bs].zero_()
        s = st.sampling_inputs
        for t, value in ((s.temperature, 0.0), (s.top_k, 1), (s.top_p, 1.0), (s.seeds, 0), (s.steps, 0),
                         (s.banned, -1)):
            t[:bs].fill_(value)

    def _guard_roots(self) -> dict:
        return {
            **{f"leaves[{g}].forward_decode_metadata": leaf.forward_decode_metadata
               for g, leaf in enumerate(self.attention.leaves)},
            "router.decode_write_locations": self.attention.decode_write_locations,
            "runner.decode_logits_rows": self.decode_logits_rows,
        }

    # -- extend / mixed ------------------------------------------------------------------------------
    def _extend(self, plan: StepPlan) -> None:
        size = self.whole_prefill.bucket_of(plan.num_tokens, plan.num_requests) if self.whole_prefill else None
        if size is not None:
            self._extend_whole(plan, *size)
            return
        buckets = self.prefill_buckets
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
            ids = self.prefill_ids[:padded].copy_(ids)
            pos = self.prefill_positions[:padded].copy_(pos)
        # the sampling op's inputs live in the decode staging; rows past the live ones are padding
        self.staging.fill_sampling(plan.sampling, requests)
        self.staging.upload()
        ctx = ForwardContext(plan.mode, self.attention, logits_rows, qo_indptr, completes, prefill_graphs=graphs)
        mark_extend_request_dims(self.attention.leaves, completes)
        with forward_context(ctx):
            # the sample lands in sampling.tokens (an input the step writes), where launch reads it
            self._timed(self.extend_step, ids, pos, plan.sampling.all_greedy)
        counters["prefill_graphed" if padded is not None else "prefill_eager"] += 1

    def _extend_whole(self, plan: StepPlan, tokens: int, requests: int) -> None:
        """The step padded to ``tokens`` rows and ``requests`` requests, as one graph."""
        dev = self.whole_prefill.stage((tokens, requests), lambda host: self._fill_whole_step(plan, host))
        self.attention.publish_extend_metadata(plan, dev[5:])
        self.staging.fill_sampling(plan.sampling, requests)
        self.staging.upload()
        greedy = plan.sampling.all_greedy

        def step() -> None:  # on CUDA only a capture runs it: a replay reads the buffers directly
            mark_extend_request_dims(self.attention.leaves, dev[4])
            with forward_context(ForwardContext(plan.mode, self.attention, dev[2], dev[3], dev[4])):
                self._timed(self.extend_step, dev[0], dev[1], greedy)

        self.whole_prefill.run((tokens, requests, greedy, plan.mode), step)
        counters["prefill_graphed"] += 1

    def _whole_step_layout(self, tokens: int, requests: int) -> list[tuple[tuple[int, ...], np.dtype]]:
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
