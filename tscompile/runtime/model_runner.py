"""The model runner: one step plan in, one launched step out, its tokens read back later.

A step goes down once: ``LLM.step`` -> ``ModelRunner.launch(plan)`` -> ``DecodeStep.run``
(``decode_step.py``) or ``PrefillStep.run`` (``prefill_step.py``), which pad the plan, stage its
inputs and hand the padded step to the ``GraphRunner`` (``graph_runner.py``: replay its graph, or
capture it first) or run the compiled step -> the model -> attention; the sample lands in the
sampled-token buffer, and comes back as the handle ``launch`` returns (``readback.py``).

The runner knows buckets and padding through those two; it hands the plan to the attention router
and never computes a page or a slot itself. Graphs (CUDA, with ``cudagraphs`` on): one
``GraphRunner`` per engine serves the decode graphs and the prefill graphs (whole-step, or the
compiled pieces per bucket); its ``replay`` attribute is the one switch that turns replay off.

Start-up: ``capture_decode_graphs`` captures the decode ladder; ``capture_prefill_graphs`` runs
placeholder steps (``prefill_capture.py``) that capture every prefill graph a greedy step up to the
largest bucket reaches (``prefill_capture="startup"``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tscompile.attention.router import AttentionRouter
from tscompile.attention.support import ResolvedGraphSupport
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.forward_context import ForwardMode
from tscompile.models.llama import Transformer
from tscompile.runtime.compile_clock import CompileClock
from tscompile.runtime.decode_step import DecodeStep
from tscompile.runtime.dynamic_sizes import SpareRowSampling
from tscompile.runtime.graph_runner import PREFILL, CudaGraphs, GraphBackend, GraphRunner
from tscompile.runtime.prefill_capture import request_ladder
from tscompile.runtime.prefill_step import PrefillStep
from tscompile.runtime.readback import PendingTokens, TokenReadback
from tscompile.runtime.staging import DecodeStaging
from tscompile.runtime.verify_graphs import VerifyGraphs
from tscompile.step_plan import StepPlan

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
    """Runs steps of one model over its paged cache: ``launch(plan)``, ``can_chain(plan)``, timings.

    ``decode`` and ``prefill`` are the two step kinds; ``graphs`` is the engine's ``GraphRunner``
    (None without CUDA graphs); ``use_graphs`` installs one (tests: ``HostGraphs`` on the CPU)."""

    returns_logprobs = True  # the sampler writes them every step; a plan that asks reads them back

    def __init__(self, model: Transformer, attention: AttentionRouter, *, max_num_seqs: int, max_blocks: int,
                 banned_width: int, device: torch.device, compile_config: TscompileConfig | None,
                 graph_support: ResolvedGraphSupport, max_verify_width: int = 1):
        """``max_verify_width``: the widest decode window (query rows per request) a step will run:
        1, or a speculative verify window's k + 1."""
        self.model = model
        self.attention = attention
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.config = compile_config
        attention.bind_query_heads(model.config.n_heads)  # host planners (FlashInfer) size their plans by it
        # persistent buffers: sized by max_num_seqs, used with or without graphs
        attention.allocate_decode_buffers(max_num_seqs, max_verify_width)
        self.staging = DecodeStaging(max_num_seqs, len(attention.specs), max_blocks, banned_width, device,
                                     max_width=max_verify_width)
        self.sampling = SpareRowSampling(self.staging.sampling_inputs)  # why the spare row: dynamic_sizes.py
        self.readback = TokenReadback(max_num_seqs, device)
        self._sampled_views: dict[int, torch.Tensor] = {}
        self.launches = 0
        self.clock = CompileClock(announce=compile_config is not None)
        self.prefill_warmup_seconds = 0.0  # start-up placeholder steps, their captures and compiles apart
        decode_config = None if compile_config is None else replace(
            compile_config, split_ops=(), split_sdpa=False, split_narrowing=False,
            static_inductor_options=decode_static_inductor_options(compile_config, device))
        parts = (model, attention, self.staging, self.sampling)
        self.decode = DecodeStep(*parts, max_num_seqs=max_num_seqs, device=device, config=decode_config,
                                 clock=self.clock)
        self.prefill = PrefillStep(*parts, max_num_seqs=max_num_seqs, device=device, config=compile_config,
                                   clock=self.clock)
        # speculative verify steps: the decode step's buffers, metadata and graphs at width N > 1
        self.verify = (VerifyGraphs(self.decode, max_num_seqs=max_num_seqs, max_width=max_verify_width)
                       if max_verify_width > 1 else None)
        self.graphs: GraphRunner | None = None
        support = graph_support.support
        if compile_config is not None and compile_config.cudagraphs and device.type == "cuda":
            mode = compile_config.prefill_graph_mode
            if not support.prefill_graph:
                prefill = None
            elif mode != "piecewise" and whole_step_prefill_possible(attention, graph_support, asked=mode == "whole"):
                prefill = "whole"
            else:
                prefill = "piecewise"
            if support.decode_graph or prefill is not None:
                self.use_graphs(CudaGraphs(device), decode=support.decode_graph, prefill=prefill)

    def use_graphs(self, backend: GraphBackend, *, decode: bool = True, prefill: str | None = None,
                   graphed_refresh: bool | None = None) -> GraphRunner:
        """Run steps through one ``GraphRunner`` over ``backend``: decode graphs per decode-ladder size
        (``decode``), and prefill graphs (``prefill``: "whole", "piecewise" or None) per token bucket
        up to ``prefill_graph_max_tokens`` and request bucket. The ladders are the compile config's
        (an eager engine's: the defaults; with ``HostGraphs`` it then runs every step padded, eagerly).
        ``graphed_refresh``: the decode and verify graphs hold the decode refresh (default: the config's
        ``KernelPolicy.graphed_refresh``); never where the refresh reads the host."""
        cfg = self.config if self.config is not None else TscompileConfig()
        if graphed_refresh is None:
            graphed_refresh = cfg.kernels.graphed_refresh
        self.decode.graphed_refresh = decode and graphed_refresh and not self.attention.refresh_reads_host
        if prefill not in (None, "whole", "piecewise"):
            raise ValueError(f"tscompile: prefill graph mode {prefill!r} must be 'whole', 'piecewise' or None")
        self.graphs = GraphRunner(
            backend,
            decode_ladder=(b for b in cfg.decode_ladder if b <= self.max_num_seqs) if decode else (),
            token_ladder=(b for b in cfg.token_ladder if b <= cfg.prefill_graph_max_tokens) if prefill else (),
            request_ladder=request_ladder(cfg.decode_ladder, self.max_num_seqs) if prefill else (),
            compile_seconds=lambda: self.clock.seconds)
        self.decode.graphs = self.graphs if decode else None
        self.prefill.graphs, self.prefill.mode, self.prefill.whole, self.prefill.buckets = None, None, None, None
        if prefill is not None:
            self.prefill.use_graphs(self.graphs, prefill)
        return self.graphs

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
            self.decode.run(plan, prev_rows)
        else:
            if prev_rows is not None:
                raise RuntimeError("tscompile: only a decode step takes its input tokens from the device")
            self.prefill.run(plan)
        n = plan.num_requests
        logprobs = self.sampling.logprobs[:n] if plan.sampling.logprobs else None
        return self.readback.start(self._sampled_rows(n), n, logprobs)

    def launch_verify(self, plan: StepPlan) -> torch.Tensor:
        """Launch one speculative verify step (``plan.verify_width`` > 1, decode only); returns
        ``[n, N + 1]`` int64 on the device: each request's emitted tokens (-1 padded), then how many
        drafts it accepted (``runtime/verify_graphs.py``)."""
        if self.verify is None or plan.verify_width > self.verify.tokens.shape[0] // self.max_num_seqs:
            raise ValueError(f"tscompile: a verify step of width {plan.verify_width} needs a runner built with "
                             "max_verify_width >= it (LLM(speculative_config=...) builds one)")
        with _inference_mode(True):
            self.launches += 1
            return self.verify.run(plan)

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
        return plan.mode is ForwardMode.DECODE and self.decode.ready(plan)

    # -- timings -------------------------------------------------------------------------------------
    @property
    def compile_seconds(self) -> float:
        return self.clock.seconds

    @property
    def decode_capture_seconds(self) -> float:
        return self.graphs.capture_seconds["decode"] if self.graphs is not None else 0.0

    @property
    def prefill_capture_seconds(self) -> float:
        """Prefill graph capture, at start-up (the placeholder steps' whole time, compiles apart) and
        on first use."""
        graphs = self.graphs.capture_seconds[PREFILL] if self.graphs is not None else 0.0
        return graphs + self.prefill_warmup_seconds

    @property
    def capture_seconds(self) -> float:
        """Decode and prefill graph capture, compile time excluded."""
        return self.decode_capture_seconds + self.prefill_capture_seconds

    # -- start-up capture ----------------------------------------------------------------------------
    def capture_decode_graphs(self) -> None:
        """Capture the whole decode ladder now (start-up), rather than on first use."""
        self.decode.capture_ladder()

    @property
    def prefill_token_ladder(self) -> tuple[int, ...]:
        """The token buckets of this runner's prefill graphs (empty: none)."""
        return self.graphs.token_ladder if self.prefill.mode is not None else ()

    @property
    def prefill_request_ladder(self) -> tuple[int, ...]:
        return self.graphs.request_ladder if self.prefill.mode is not None else ()

    def prefill_graph_keys(self, plan: StepPlan) -> frozenset:
        """The prefill graphs a step of ``plan``'s shape replays (empty: it runs without graphs)."""
        return self.prefill.graph_keys(plan)

    @property
    def prefill_capture_at_startup(self) -> bool:
        return self.config is not None and self.config.prefill_capture == "startup" and bool(self.prefill_token_ladder)

    def capture_prefill_graphs(self, plans: list[StepPlan]) -> None:
        """Run the placeholder steps ``plans`` (``prefill_capture.py``), capturing what they reach;
        logs one line as the decode ladder does. The counters of steps run (graphed, eager, decoder
        rows) are left as they were: these are not steps; captures, replays and compiles count."""
        if not plans:
            return
        captured_before = self.prefill_capture_seconds
        saved = {k: counters[k] for k in STEP_COUNTERS}
        try:
            took = self.graphs.capture_all(PREFILL, plans, self.execute, self.device)
        finally:
            for k, v in saved.items():
                counters[k] = v
        # the steps around the captures exist only to capture: all of it but compiling is capture time
        captured = self.prefill_capture_seconds - captured_before
        elapsed, compiled = took["seconds"], took["compile_seconds"]
        self.prefill_warmup_seconds += max(elapsed - compiled - captured, 0.0)
        logger.info("Prefill graph capturing finished in %.0f s (%d steps, compiling %.0f s apart), took %.2f GiB",
                    elapsed - compiled, len(plans), compiled, took["gib"])
