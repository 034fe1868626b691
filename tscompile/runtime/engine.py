"""``tscompile.LLM``: requests in, tokens out, over a scheduler and a runner.

The engine knows requests and the step in flight; the scheduler turns requests into one plan per
step; the runner (a model's ``ModelRunner`` or a package's ``PackageRunner``) launches the plan.
One step: schedule -> launch -> update -> read back.
"""

from __future__ import annotations

import itertools
import logging
import random
from typing import Iterator

import torch

from tscompile.counters import counters
from tscompile.forward_context import ForwardMode
from tscompile.models import ModelConfig, Transformer
from tscompile.outputs import EngineStats, RequestOutput
from tscompile.prompts import Prompt, parse_prompts
from tscompile.runtime.blocking_calls import run_until_done, stream_text
from tscompile.runtime.build import EngineParts
from tscompile.runtime.device_faults import EngineDeadError, dead_engine_reason, is_cuda_fault
from tscompile.runtime.engine_setup import build_llm_parts, verify_step_for
from tscompile.runtime.inflight import InFlightStep, chained_input_rows, read_back
from tscompile.runtime.request_io import new_request, request_output
from tscompile.runtime.scheduler import Request
from tscompile.sampling import SamplingParams
from tscompile.spec_decode.config import SpeculativeConfig
from tscompile.spec_decode.verify import VerifyStep
from tscompile.text import apply_chat_template

logger = logging.getLogger("tscompile")


class LLM:
    """Generate with a model: a local Hugging Face checkpoint directory (Llama, Mistral, Qwen2,
    Qwen3), a preset name, a ``ModelConfig`` or a built ``Transformer`` (``tscompile.load_package``
    builds one over a package).

    ``max_num_seqs`` bounds concurrent requests (and the decode buffers); ``max_model_len`` bounds
    prompt plus new tokens (default: a checkpoint's maximum, 512 for a preset);
    ``max_num_batched_tokens`` is the per-step token budget that chunks long prompts. ``num_pages``
    (per cache group), when given, is the KV pool's size. Otherwise, on CUDA, the pool takes what is
    left of ``gpu_memory_utilization`` (a fraction in (0, 1]) of the device's total memory once the
    model is loaded (memory other processes use counts as used), a profiled step's activation peak
    and a margin for CUDA graphs are set aside, up to what ``max_num_seqs`` requests of
    ``max_model_len`` tokens could hold (``tscompile/runtime/memory.py``); too little for one request
    of ``max_model_len`` is refused. On the CPU there is no device memory to measure: the pool holds
    ``max_num_seqs`` requests of ``max_model_len`` tokens, at most 4096 each, and
    ``gpu_memory_utilization`` is unused. The engine logs the pool's size once at INFO.

    Stop conditions follow vLLM: the model's end-of-sequence ids, ``stop_token_ids`` and ``stop``
    strings end a request with ``finish_reason="stop"``, ``max_new_tokens`` with ``"length"``.

    By default the decode step is compiled whole and the prefill step piecewise by the tscompile
    backend (``compile_options`` are its options, see ``TscompileConfig``), with decode CUDA graphs
    per ladder size on CUDA; ``enforce_eager=True`` runs the same model and the same metadata path
    without compiling. Every CUDA graph of the engine goes through one ``GraphRunner``
    (``llm.runner.graphs``); ``llm.runner.graphs.replay = False`` runs the same padded steps without
    replaying them. The first steps say at INFO what they compile and capture, and how long it took.

    ``model_impl`` picks the code a checkpoint runs: ``"native"`` the engine's own model (Llama,
    Mistral, Qwen2, Qwen3), ``"transformers"`` the checkpoint's transformers modeling code with the
    engine's paged attention (any transformers decoder; ``docs/transformers_backend.md``),
    ``"auto"`` (default) native where it exists and transformers otherwise.

    ``async_scheduling`` (default on) lets a decode step be scheduled, staged and launched while the
    previous step still runs: a token the host has not read yet is gathered on the device, and a
    stop the host reads one step late drops the one token sampled after it (the outputs equal those
    of synchronous steps). ``step()`` returns the requests finished and read back, which can be one
    step after the step that sampled their last token; ``sync()`` waits for the step in flight.

    ``enable_prefix_caching`` (default on): a prompt's full KV blocks already in the cache (from an
    earlier request with the same prefix) are reused rather than computed
    (``docs/prefix_caching.md``); ``RequestOutput.num_cached_tokens`` and ``stats()`` tell the hits.
    A model whose cache keeps rows by chunk boundary (the narrowing model) runs without it.

    ``tensor_parallel_size`` > 1 splits the model over that many processes (one per GPU on CUDA,
    gloo on the CPU): this process is rank 0 and starts the others, or, under ``torchrun``, each
    process is the rank it was started as (``docs/tensor_parallel.md``). ``close()`` stops them."""

    def __init__(
        self,
        model: str | ModelConfig | Transformer = "llama-tiny",
        *,
        attention_backend: str = "auto",
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        page_size: int = 16,
        pages_per_block: int = 1,
        num_pages: int | None = None,
        max_num_batched_tokens: int = 2048,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        enforce_eager: bool = False,
        compile_options: dict | None = None,
        seed: int = 0,
        async_scheduling: bool = True,
        gpu_memory_utilization: float = 0.9,
        model_impl: str = "auto",
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        speculative_config: dict | None = None,
    ):
        parts, spec, draft_parts = build_llm_parts(
            model, attention_backend=attention_backend, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            page_size=page_size, pages_per_block=pages_per_block, num_pages=num_pages,
            max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, device=device, enforce_eager=enforce_eager,
            compile_options=compile_options, seed=seed, async_scheduling=async_scheduling,
            gpu_memory_utilization=gpu_memory_utilization, model_impl=model_impl,
            enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size, speculative_config=speculative_config)
        self._assemble(parts, seed=seed, async_scheduling=async_scheduling,
                       enable_prefix_caching=enable_prefix_caching)
        if spec is not None:
            self._use_speculation(spec, draft_parts)

    @classmethod
    def from_parts(cls, parts: EngineParts, *, seed: int = 0, async_scheduling: bool = True,
                   enable_prefix_caching: bool = True) -> "LLM":
        """An engine over parts built elsewhere (a loaded package)."""
        llm = cls.__new__(cls)
        llm._assemble(parts, seed=seed, async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching)
        return llm

    def _assemble(self, parts: EngineParts, *, seed: int, async_scheduling: bool,
                  enable_prefix_caching: bool = True) -> None:
        self.parts = parts
        self.config, self.device, self.dtype = parts.config, parts.device, parts.dtype
        self.model, self.attention, self.pool = parts.model, parts.attention, parts.pool
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.async_scheduling = async_scheduling
        self.scheduler.set_prefix_caching(enable_prefix_caching)
        self._ids = itertools.count()
        self._rng = random.Random(seed)
        self._requests: dict[int, Request] = {}  # unfinished, or finished and not read back yet
        self._inflight: InFlightStep | None = None
        self._ready: list[Request] = []  # finished and read back, not yet returned by step()/sync()
        self._dead: str | None = None  # set by a CUDA fault: why every later call is refused
        self.speculative_config: SpeculativeConfig | None = None
        self._verify: VerifyStep | None = None

    def _use_speculation(self, spec: SpeculativeConfig, draft_parts: EngineParts | None = None) -> None:
        """Decode steps become verify steps (``tscompile/spec_decode/verify.py``). A verify step
        waits for its accepted counts before the next is planned: asynchronous scheduling is off.
        ``draft_parts``: the draft model's engine parts (``method="draft_model"``)."""
        self._verify = verify_step_for(spec, self.parts, draft_parts)
        self.speculative_config = spec
        self.async_scheduling = False

    def set_replay_references(self, references) -> None:
        """``method="replay"`` only (benchmarks): ``references`` maps a prompt's token ids (a tuple)
        to the continuation to propose for it (the target's own greedy output, so every draft is
        accepted); requests queued later with that prompt replay it, others get no drafts."""
        if self.speculative_config is None or self.speculative_config.method != "replay":
            raise ValueError("tscompile: set_replay_references needs speculative_config method='replay'; build the "
                             "engine with {'method': 'replay', 'num_speculative_tokens': k}")
        self._verify.drafter.set_references(references)

    # -- request level ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop what the engine started besides this process (a tensor-parallel engine's other ranks;
        also done at interpreter exit). Idempotent; an engine on one device has nothing to stop."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (transformers'), or None: token ids in and out only."""
        return self.parts.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.scheduler.eos_token_ids

    # -- device faults ---------------------------------------------------------------------------
    def _refuse_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _fault(self, exc: BaseException) -> None:
        """What work that touches the device does with an exception ``exc`` it raised: a CUDA fault
        kills the engine (``EngineDeadError`` raised from the fault); anything else returns, for the
        caller to re-raise as it is. (An ``except`` clause, not a context manager: a generator-based
        one costs microseconds on every step.)"""
        if isinstance(exc, EngineDeadError) or not is_cuda_fault(exc):
            return
        self._die(exc)
        raise EngineDeadError(self._dead) from exc

    def _die(self, fault: BaseException) -> None:
        """Mark the engine dead after ``fault``. The step in flight is dropped unread (waiting on a
        faulted context fails or hangs) and every request is aborted on the host only."""
        self._dead = dead_engine_reason(fault)
        self._inflight = None
        self._ready = []
        for rid in list(self._requests):
            self.abort(rid)

    # -- prefix caching --------------------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (asked for, and the model's cache supports it)."""
        return self.scheduler.prefix_cache is not None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: later prompts are computed whole until their blocks are cached
        again (benchmarks use it between runs of the same prompts)."""
        self.scheduler.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """Counters since the engine was built (prefix-cache lookups and hits in tokens, preemptions)."""
        cache = self.scheduler.prefix_cache
        alloc = self.scheduler.allocators[0]
        return EngineStats(prefix_cache_queries=cache.stats.queries if cache else 0,
                           prefix_cache_hits=cache.stats.hits if cache else 0,
                           num_preemptions=self.scheduler.num_preemptions,
                           num_cached_blocks=alloc.num_cached, num_free_blocks=alloc.num_free,
                           **(self._verify.summary() if self._verify is not None else {}))

    @property
    def is_dead(self) -> bool:
        """True after a CUDA fault: every call that would touch the device raises ``EngineDeadError``."""
        return self._dead is not None

    def _new_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        """A validated request, not queued yet: a refusal raises here and changes nothing."""
        return new_request(prompt, params, ids=self._ids, scheduler=self.scheduler,
                           speculative_config=self.speculative_config,
                           returns_logprobs=getattr(self.runner, "returns_logprobs", False), tokenizer=self.tokenizer,
                           rng=self._rng)

    def _queue(self, req: Request) -> Request:
        """Queue a request ``_new_request`` made (and validated)."""
        self.scheduler.add(req, validated=True)
        self._requests[req.rid] = req
        return req

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> Request:
        """Queue one request (a prompt as ``generate`` takes it); a refused request raises
        ``ValueError`` and changes nothing."""
        self._refuse_if_dead()
        parsed = parse_prompts(prompt, self.tokenizer)
        if len(parsed) != 1:
            raise ValueError(f"tscompile: add_request takes one prompt, got {len(parsed)}")
        return self._queue(self._new_request(parsed[0], sampling_params or SamplingParams()))

    def abort(self, request_id: int | str) -> None:
        """Stop a request now: it is never scheduled again, its blocks are free, and a token of it
        still in flight is dropped. Its output keeps what was read back (finish reason "abort")."""
        try:
            rid = int(request_id)
        except (TypeError, ValueError):
            raise ValueError(f"tscompile: request_id {request_id!r} is not a request id (an int, or the "
                             f"RequestOutput.request_id string)") from None
        req = self._requests.pop(rid, None)
        if req is None:
            return  # finished, aborted already, or never added: nothing to stop
        self.scheduler.remove(req)
        if self._verify is not None:
            self._verify.release(req)
        if not req.completion.finished:
            req.completion.finish_reason = "abort"

    def step(self) -> list[Request]:
        """Schedule and launch one step; returns the requests that finished (read back) since.

        With ``async_scheduling`` a decode step that follows another step is launched before that
        step's tokens are read, and they are read while it runs; any other step first waits for the
        step in flight. A CUDA fault kills the engine: ``EngineDeadError``, then and on every later
        call."""
        self._refuse_if_dead()
        try:
            return self._step()
        except BaseException as exc:
            self._fault(exc)
            raise

    def _step(self) -> list[Request]:
        if self._inflight is not None and self.scheduler.may_preempt():
            self._read_back()  # a preempted request is recomputed from tokens the host must know
        plan = self.scheduler.schedule()
        if plan is None:
            if self.scheduler.running:  # never spin: a running request that no step serves is a bug
                raise RuntimeError(f"tscompile: no step could be scheduled for {len(self.scheduler.running)} "
                                   f"running request(s)")
            return self.sync()
        if self._verify is not None and plan.mode is ForwardMode.DECODE:
            self._read_back()
            if any(rid not in self._requests for rid in plan.request_ids):
                return self._take_ready()  # a stop just read back ended a request of this plan: re-plan
            if self._verify.run(plan, [self._requests[rid] for rid in plan.request_ids], self._finish):
                return self._take_ready()
            plan = self.scheduler.resolve_host_tokens(plan)  # the window did not fit: a plain step
        prev = self._inflight
        # a chained step reads prev's sample on the device: nothing may have launched in between
        chain = (self.async_scheduling and prev is not None and prev.launch == self.runner.launches
                 and self.runner.can_chain(plan))
        prev_rows = None
        if chain:
            prev_rows = chained_input_rows(plan, prev)
            if max(prev_rows) >= 0:
                counters["decode_chained"] += 1  # some input token came straight from the device
        else:
            self._read_back()
            if any(rid not in self._requests for rid in plan.request_ids):
                return self._take_ready()  # a stop just read back ended a request of this plan: re-plan
            plan = self.scheduler.resolve_host_tokens(plan)  # tokens read since planning
        # a launch that raises leaves the scheduler as it was and the step before it in flight
        tokens = self.runner.launch(plan, prev_rows)
        requests = [self._requests[rid] for rid in plan.request_ids]
        self.scheduler.update(plan)
        if chain:
            self._read_back()
        self._inflight = InFlightStep(plan, requests, tokens, self.runner.launches)
        if not self.async_scheduling:
            self._read_back()
        return self._take_ready()

    def sync(self) -> list[Request]:
        """Wait for the step in flight, hand its tokens to its requests; returns the requests finished
        and read back that no ``step()`` has returned yet."""
        self._refuse_if_dead()
        try:
            self._read_back()
        except BaseException as exc:
            self._fault(exc)
            raise
        return self._take_ready()

    def _read_back(self) -> None:
        """Hand the step in flight's tokens to their requests and apply the stop conditions. A token
        sampled after its request stopped (asynchronous scheduling learns a stop one step late) is
        dropped, so the outputs equal those of synchronous steps."""
        flight, self._inflight = self._inflight, None
        if flight is not None:
            read_back(flight, self._finish)

    def _finish(self, r: Request) -> None:
        """``r``'s completion finished on the host: free its blocks, hand it out."""
        self.scheduler.remove(r)
        self._requests.pop(r.rid, None)
        self._ready.append(r)

    def _take_ready(self) -> list[Request]:
        ready, self._ready = self._ready, []
        if self._verify is not None:
            for r in ready:  # the drafter's state of a finished request (its draft cache, its history)
                self._verify.release(r)
        return ready

    @property
    def compile_seconds(self) -> float:
        return self.runner.compile_seconds

    @property
    def capture_seconds(self) -> float:
        """Decode and prefill graph capture so far (compile time apart)."""
        return self.runner.capture_seconds

    @property
    def prefill_capture_seconds(self) -> float:
        """The prefill part of ``capture_seconds``: start-up placeholder steps and captures on first use
        (0 for a runner without prefill graphs, a package's)."""
        return getattr(self.runner, "prefill_capture_seconds", 0.0)

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or tokens not read back yet."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight is not None or self._ready)

    def _settle(self) -> None:
        """A stop seen one step late leaves a step in flight that serves finished requests only: wait
        for it when nothing else runs, so a finished call leaves nothing behind."""
        if self._inflight is not None and not (self.scheduler.waiting or self.scheduler.running):
            self.sync()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts (a ``str``, a list of token ids, or
        ``{"prompt_token_ids": [...]}``); returns one ``RequestOutput`` per prompt, in prompt order.

        Every prompt is validated before any is queued, so a refused call changes nothing."""
        self._refuse_if_dead()
        parsed = parse_prompts(prompts, self.tokenizer)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(parsed)
        if len(params) != len(parsed):
            raise ValueError(f"tscompile: {len(params)} sampling params for {len(parsed)} prompts")
        reqs = [self._new_request(p, sp) for p, sp in zip(parsed, params)]
        for r in reqs:
            self._queue(r)
        run_until_done(self, reqs)
        return [request_output(r) for r in reqs]

    def chat(self, messages, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One reply to ``messages`` (``[{"role": ..., "content": ...}, ...]``), rendered with the
        checkpoint's chat template."""
        ids = apply_chat_template(self.tokenizer, messages)
        return self.generate({"prompt_token_ids": ids}, sampling_params)[0]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield one request's text as it is produced (only text no later stop string can cut).
        Abandoning the iterator aborts the request and frees its blocks. The request is queued when
        iteration starts; a dead engine refuses at once."""
        self._refuse_if_dead()
        return stream_text(self, prompt, sampling_params)
