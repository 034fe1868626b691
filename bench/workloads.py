"""The measured loops: one runner per mode, each able to run a greedy batch and a bs=1 prefill.

Every runner exposes ``run_batch(prompts, output_len, per_call, window)`` -> :class:`BatchTiming` and
``run_prefill(prompt)`` -> seconds; ``window`` (``kernel_table.StepWindow``, the kernel-table pass
only) is told before and after each decode step. Timing is CUDA events (plus a synchronize) on cuda and
``perf_counter`` on cpu. Decode time covers decode-only steps: for the static-cache baselines the
steps after the batched prefill, for ``tscompile.LLM`` the steps the scheduler runs as pure decode.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .static_cache_model import StaticCacheModel, choose_gqa

STATIC_MODES = ("compile-default", "compile-reduce-overhead", "compile-reduce-overhead-tuned")
TUNED_MODE = "compile-reduce-overhead-tuned"
# gpt-fast's generate.py sets these globally before compiling; the tuned baseline sets them only
# around its own calls (compilation is lazy: it happens inside the first calls, and again at a new
# batch size), so the other modes compile with the defaults
TUNED_INDUCTOR_CONFIG = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True,
                         "fx_graph_cache": True}


class Timer:
    """``with timer: ...`` then ``timer.seconds``; events on cuda (the stream's wall time), perf_counter on cpu."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = 0.0

    def __enter__(self) -> "Timer":
        if self.cuda:
            torch.cuda.synchronize()
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
            torch.cuda.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


@dataclass
class BatchTiming:
    ttft_s: float  # submit -> every request has its first token
    decode_s: float  # the decode-only steps
    decode_steps: int
    tokens: list[list[int]]  # new token ids per request
    call_s: list[float] = field(default_factory=list)  # per forward, only when per_call (first warm-up)
    other_steps: int = 0  # engine steps after TTFT that were not pure decode (should stay 0)


# -- the static-cache torch.compile baselines ------------------------------------------------------
def _tuned_inductor_config():
    import torch._inductor.config as inductor_config

    return inductor_config.patch(TUNED_INDUCTOR_CONFIG)


# A prefill of at most this many tokens (batch x prompt) runs as a CUDA graph in the reduce-overhead
# modes, one graph per shape, as a user who compiles the whole step with mode="reduce-overhead" gets;
# past it a prefill is bound by its matmuls and launch overhead no longer matters (the engines'
# default prefill graph sizes stop about there too).
PREFILL_GRAPH_MAX_TOKENS = 512


# Separate functions on purpose: torch.compile keeps its compiled entries per code object, and the
# prefill (dynamic), the graphed short prefill (static) and the decode (static, graphed) steps must
# not share them.
def prefill_step(model: StaticCacheModel, input_ids: torch.Tensor) -> torch.Tensor:
    """One causal prompt forward from position 0 plus argmax: ``[B, S]`` ids -> next ids ``[B, 1]`` int64."""
    return model.prefill(input_ids).argmax(dim=-1, keepdim=True)


def graphed_prefill_step(model: StaticCacheModel, input_ids: torch.Tensor) -> torch.Tensor:
    return model.prefill(input_ids).argmax(dim=-1, keepdim=True)


def decode_step(model: StaticCacheModel, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One step at ``input_pos [S]`` over the static cache: ``[B, S]`` ids -> next ids ``[B, 1]`` int64."""
    return model(input_ids, input_pos).argmax(dim=-1, keepdim=True)


class StaticCacheRunner:
    """``compile-default``: ``torch.compile`` of prefill and decode; ``compile-reduce-overhead``: the
    decode step compiled with ``mode="reduce-overhead"`` (CUDA graphs on cuda), and so is a prefill of
    at most ``PREFILL_GRAPH_MAX_TOKENS`` tokens (a graph per shape), longer ones as default;
    ``compile-reduce-overhead-tuned``: that, tuned as gpt-fast tunes it (``TUNED_INDUCTOR_CONFIG``,
    ``fullgraph=True``) and with GQA that reads the cache as it is (``choose_gqa``: SDPA's enable_gqa
    where a fused kernel takes it, else the query heads folded into rows) instead of a per-head copy.
    Every prefill attends causally over its prompt only (``StaticCacheModel.prefill``).
    ``compiled=False`` runs the same greedy loop without compiling (tests compare its tokens);
    ``cache_len`` fixes the static cache length (default: each run's prompt plus output length)."""

    def __init__(self, model, mode: str, device: torch.device, *, compiled: bool = True,
                 cache_len: int | None = None):
        if mode not in STATIC_MODES:
            raise ValueError(f"tscompile: unknown static-cache mode {mode!r}; allowed: {STATIC_MODES}")
        self.model, self.mode, self.device = model, mode, torch.device(device)
        tuned = mode == TUNED_MODE
        self.gqa, self.gqa_why = choose_gqa(model) if tuned else ("repeat_interleave", "the straightforward copy")
        self.cudagraphs = compiled and mode != "compile-default" and self.device.type == "cuda"
        # prefill lengths and batch sizes vary: dynamic shapes (one graph, modulo 0/1 specialization);
        # reduce-overhead keeps decode static, as gpt-fast does (a CUDA graph per batch size anyway)
        self.prefill_fn = torch.compile(prefill_step, dynamic=True, fullgraph=tuned) if compiled else prefill_step
        self.graphed_prefill_fn = None
        if compiled and mode != "compile-default":
            self.graphed_prefill_fn = torch.compile(graphed_prefill_step, mode="reduce-overhead", dynamic=False,
                                                    fullgraph=tuned)
        self._primed: set[tuple[int, ...]] = set()  # shapes whose prefill graph is recorded (this cache)
        if not compiled:
            self.decode_fn = decode_step
        elif self.mode == "compile-default":
            self.decode_fn = torch.compile(decode_step, dynamic=True)
        else:
            self.decode_fn = torch.compile(decode_step, mode="reduce-overhead", dynamic=False, fullgraph=tuned)
        self._inductor_config = _tuned_inductor_config if tuned else contextlib.nullcontext
        self._caches: dict[tuple[int, int], StaticCacheModel] = {}
        self._cache_len = cache_len
        self._decode_len = 0
        self.compile_seconds = 0.0  # filled by the caller from the warm-up excess
        self.capture_seconds = 0.0

    def _static(self, batch_size: int, max_len: int) -> StaticCacheModel:
        max_len = self._cache_len or max_len
        key = (batch_size, max_len)
        if key not in self._caches:
            self._caches.clear()  # one cache at a time: free the previous batch size's buffers first
            self._primed.clear()
            self._caches[key] = StaticCacheModel(self.model, batch_size, max_len, gqa=self.gqa)
        return self._caches[key]

    def _prefill(self, sm: StaticCacheModel, ids: torch.Tensor, per_call: list | None) -> torch.Tensor:
        """The prompts' first tokens ``[B, 1]``; a short prefill of a reduce-overhead mode replays a graph.
        Cudagraph trees run a new shape's first call without a graph and record the second: both happen
        inside the first call of that shape here (a warm-up), so no timed call records a graph."""
        graphed = self.graphed_prefill_fn is not None and ids.numel() <= PREFILL_GRAPH_MAX_TOKENS
        fn = self.graphed_prefill_fn if graphed else self.prefill_fn
        with Timer(self.device) as t:
            if graphed and tuple(ids.shape) not in self._primed:
                for _ in range(2):
                    torch.compiler.cudagraph_mark_step_begin()
                    fn(sm, ids)
                self._primed.add(tuple(ids.shape))
            torch.compiler.cudagraph_mark_step_begin()
            out = fn(sm, ids).clone()
        if per_call is not None:
            per_call.append(t.seconds)
        return out

    def _call(self, fn: Callable, sm, ids, pos, per_call: list | None) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        if per_call is None:
            return fn(sm, ids, pos).clone()
        with Timer(self.device) as t:
            out = fn(sm, ids, pos).clone()
        per_call.append(t.seconds)
        return out

    def run_batch(self, prompts: list[list[int]], output_len: int, per_call: bool = False,
                  window=None) -> BatchTiming:
        with self._inductor_config():
            return self._run_batch(prompts, output_len, per_call, window)

    def _run_batch(self, prompts: list[list[int]], output_len: int, per_call: bool, window) -> BatchTiming:
        bs, seqlen = len(prompts), len(prompts[0])
        self._decode_len = seqlen + output_len
        sm = self._static(bs, self._decode_len)
        if self._decode_len > sm.max_len:
            raise ValueError(f"tscompile: {seqlen} + {output_len} tokens exceed the static cache ({sm.max_len})")
        ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)
        calls: list[float] | None = [] if per_call else None
        with torch.no_grad():
            with Timer(self.device) as ttft:
                tok = self._prefill(sm, ids, calls)
            out = [tok]
            pos = torch.tensor([seqlen], device=self.device)
            with Timer(self.device) as dec:
                for i in range(output_len - 1):
                    if window is not None:
                        window.before(i)
                    tok = self._call(self.decode_fn, sm, tok, pos, calls)
                    if window is not None:
                        window.after(i)
                    out.append(tok)
                    pos = pos + 1
        tokens = torch.cat(out, dim=1).tolist()
        return BatchTiming(ttft.seconds, dec.seconds, output_len - 1, tokens, calls or [])

    def run_prefill(self, prompt: list[int]) -> float:
        # a gpt-fast-sized cache (at least the decode run's length): short prompts reuse the bs=1 graphs
        sm = self._static(1, max(len(prompt), self._decode_len))
        ids = torch.tensor([prompt], dtype=torch.int64, device=self.device)
        with self._inductor_config(), torch.no_grad(), Timer(self.device) as t:
            self._prefill(sm, ids, None)
        return t.seconds

    def close(self) -> None:
        self._caches.clear()


# -- tscompile.LLM (eager and compiled) ------------------------------------------------------------
class EngineRunner:
    """``tscompile.LLM`` driven through ``add_request`` + ``step``; ``eager`` is ``enforce_eager=True``.
    Each run starts with an empty prefix cache (``reset_prefix_cache``): the runs repeat their
    prompts, and a row measures computing them (with caching on, its host cost included)."""

    def __init__(self, model, *, attention_backend: str, enforce_eager: bool, device: torch.device,
                 dtype: torch.dtype, max_num_seqs: int, max_model_len: int, page_size: int,
                 max_num_batched_tokens: int, num_pages: int | None = None, seed: int = 0,
                 compile_options: dict | None = None, model_impl: str = "auto",
                 enable_prefix_caching: bool = True, tensor_parallel_size: int = 1):
        import tscompile

        self.device = torch.device(device)
        self.llm = tscompile.LLM(model, attention_backend=attention_backend, enforce_eager=enforce_eager,
                                 device=self.device, dtype=dtype, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len, page_size=page_size, num_pages=num_pages,
                                 max_num_batched_tokens=max_num_batched_tokens, seed=seed,
                                 compile_options=compile_options, model_impl=model_impl,
                                 enable_prefix_caching=enable_prefix_caching,
                                 tensor_parallel_size=tensor_parallel_size)
        self._params = tscompile.SamplingParams

    @property
    def compile_seconds(self) -> float | None:
        return getattr(self.llm, "compile_seconds", None)

    @property
    def capture_seconds(self) -> float | None:
        return getattr(self.llm, "capture_seconds", None)

    def _pure_decode_next(self) -> bool:
        sched = self.llm.scheduler
        return bool(sched.running) and not sched.waiting and all(r.prefill_done for r in sched.running)

    def _step(self, per_call: list | None) -> None:
        if per_call is None:
            self.llm.step()
            return
        with Timer(self.device) as t:
            self.llm.step()
        per_call.append(t.seconds)

    def run_batch(self, prompts: list[list[int]], output_len: int, per_call: bool = False,
                  window=None) -> BatchTiming:
        if self.llm.has_unfinished():
            raise RuntimeError("tscompile: the engine still holds requests from an earlier run")
        self.llm.reset_prefix_cache()
        # every mode generates output_len tokens: the static-cache loops never stop at an eos id
        params = self._params(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        calls: list[float] | None = [] if per_call else None
        # TTFT ends with the stream after the step that sampled every first token (its tokens may
        # still be on their way to the host: the timer's end event is recorded behind it)
        with Timer(self.device) as ttft:
            reqs = [self.llm.add_request(p, params) for p in prompts]
            while any(r.num_generated == 0 for r in reqs):
                self._step(calls)
        steps = other = 0
        with Timer(self.device) as dec:
            while self.llm.has_unfinished():
                pure = self._pure_decode_next()
                if pure and window is not None:
                    window.before(steps)
                if not pure and (self.llm.scheduler.running or self.llm.scheduler.waiting):
                    other += 1
                self._step(calls)  # the last call only reads back the final tokens
                if pure:
                    if window is not None:
                        window.after(steps)
                    steps += 1
        return BatchTiming(ttft.seconds, dec.seconds, steps, [list(r.output) for r in reqs], calls or [], other)

    def logprobs_of(self, prompt: list[int], output_len: int) -> tuple[list[int], list[float]] | None:
        """One prompt's greedy tokens and their log-probabilities (untimed: the reference check); None
        where the engine returns none (a package)."""
        if not getattr(self.llm.runner, "returns_logprobs", False):
            return None
        self.llm.reset_prefix_cache()
        params = self._params(max_new_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=0)
        out = self.llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        return out.token_ids, [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]

    def run_prefill(self, prompt: list[int]) -> float:
        """One prompt to its first token; its wall time. ``host_launch_s`` keeps the host's time from
        the submit until the step that launched the prefill returned: the host work before the device's."""
        params = self._params(max_new_tokens=1, temperature=0.0)
        self.llm.reset_prefix_cache()
        with Timer(self.device) as t:
            start = time.perf_counter()
            req = self.llm.add_request(prompt, params)
            self.llm.step()
            self.host_launch_s = time.perf_counter() - start
            while not req.finished:
                self.llm.step()
        self.llm.sync()
        return t.seconds

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()  # a tensor-parallel engine's workers
        self.llm = None


def compile_excess(warm: BatchTiming, ttft_steady_s: float, tpot_steady_s: float, cudagraphs: bool) -> tuple[float, float]:
    """(compile_s, capture_s) of a static-cache run, estimated as the first warm-up run's excess over the
    steady state. Under cudagraph trees the second decode call records the graph: that is capture."""
    if not warm.call_s:
        return 0.0, 0.0
    prefill, decodes = warm.call_s[0], warm.call_s[1:]
    excess = [max(prefill - ttft_steady_s, 0.0)] + [max(d - tpot_steady_s, 0.0) for d in decodes]
    capture = excess[2] if cudagraphs and len(excess) > 2 else 0.0
    return sum(excess) - capture, capture


def bench_engine(model_name: str, device: torch.device | str = "cuda", *, backend: str = "triton",
                 max_num_seqs: int = 32, num_pages: int | None = None) -> "EngineRunner":
    """The compiled engine the scripts/ diagnostics measure: ``model_name``'s seeded random weights
    (bf16 on CUDA, float32 elsewhere) under ``backend``, pages of 16 and 2064-token requests, as
    ``tscompile bench`` builds its engine modes. ``num_pages`` fixes the KV pool (no memory sizing,
    so two engines fit one device)."""
    from tscompile.models import build_model

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(model_name, dtype=dtype, device=device, seed=0)
    return EngineRunner(model, attention_backend=backend, enforce_eager=False, device=device, dtype=dtype,
                        max_num_seqs=max_num_seqs, max_model_len=2064, page_size=16, max_num_batched_tokens=16384,
                        num_pages=num_pages, seed=0)


def time_method(obj, name: str, record) -> None:
    """Replace ``obj.name`` by a wrapper that calls ``record(seconds)`` after every call (a
    microsecond or so of its own): how the diagnostics split a step's host time into phases."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)

    setattr(obj, name, wrapper)
