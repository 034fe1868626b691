"""``tscompile.LLM``: a model, its paged KV cache, a scheduler and a runner behind ``generate``."""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from tscompile.attention import create_attention_backend, resolve_cuda_graph_support
from tscompile.attention.base import ForwardMode
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.kv_cache.pool import KVCachePool
from tscompile.models import ModelConfig, Transformer, build_model
from tscompile.runtime.model_runner import ModelRunner
from tscompile.runtime.readback import PendingTokens
from tscompile.runtime.scheduler import Request, ScheduledBatch, Scheduler
from tscompile.sampling import SamplingParams
from tscompile.utils import cdiv, resolve_device, resolve_dtype

logger = logging.getLogger("tscompile")

@dataclass
class _InFlight:
    """A launched step whose tokens the host has not read yet."""

    batch: ScheduledBatch
    emits: list[bool]
    tokens: PendingTokens
    finished: list[Request]
    launch: int  # the runner's launch count right after this step: anything launched since breaks a chain


class LLM:
    """Generate with a reference model (a preset name, a ``ModelConfig`` or a built ``Transformer``).

    ``max_num_seqs`` bounds concurrent requests (and the decode buffers); ``max_model_len`` bounds
    prompt plus new tokens; ``num_pages`` (per cache group) defaults to enough for ``max_num_seqs``
    requests of ``max_model_len``; ``max_num_batched_tokens`` is the per-step token budget that
    chunks long prompts.

    By default the decode step is compiled whole and the prefill step piecewise by the tscompile
    backend (``compile_options`` are its options, see ``TscompileConfig``), with decode CUDA graphs
    per ladder size on CUDA; ``enforce_eager=True`` runs the same model and the same metadata path
    without compiling.

    ``async_scheduling`` (default on) lets a decode step be scheduled, staged and launched while the
    previous step still runs: nothing the scheduler decides depends on token values (requests stop
    at ``max_new_tokens``), and a token the host has not read yet is gathered on the device. So
    ``step()`` returns the requests whose last token it has read back, which can be one step after
    the step that sampled it; ``sync()`` waits for the step in flight."""

    def __init__(
        self,
        model: str | ModelConfig | Transformer = "llama-tiny",
        *,
        attention_backend: str = "auto",
        max_num_seqs: int = 8,
        max_model_len: int = 512,
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
    ):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if isinstance(model, Transformer):
            self.model = model
        else:
            self.model = build_model(model, dtype=self.dtype, device=self.device, seed=seed)
        self.config = self.model.config
        if max_model_len > self.config.max_position:
            raise ValueError(f"tscompile: max_model_len {max_model_len} exceeds the model's max_position "
                             f"{self.config.max_position}")
        specs = self.model.cache_groups()
        block_size = page_size * pages_per_block
        blocks_per_seq = cdiv(max_model_len, block_size)
        if num_pages is None:
            num_pages = (max_num_seqs * blocks_per_seq + 1) * pages_per_block
        self.backend = create_attention_backend(attention_backend, specs, max_model_len=max_model_len,
                                                page_size=page_size, device=self.device)
        self.graph_support = resolve_cuda_graph_support(self.backend)
        self.pool = KVCachePool.allocate(specs, [num_pages] * len(specs), page_size=page_size,
                                         pages_per_block=pages_per_block, dtype=self.dtype, device=self.device)
        self.backend.set_cache_pool(self.pool)
        self.model.bind_kv_cache(self.pool)
        self.scheduler = Scheduler(
            specs, [self.pool.num_blocks(g) for g in range(len(specs))], block_size=block_size,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, vocab_size=self.config.vocab_size,
        )
        self.enforce_eager = enforce_eager
        self.compile_config = None if enforce_eager else TscompileConfig.from_options(compile_options)
        self.runner = ModelRunner(self.model, self.backend, max_num_seqs=max_num_seqs, device=self.device,
                                  compile_config=self.compile_config, graph_support=self.graph_support,
                                  max_blocks=self.scheduler.max_blocks)
        self.runner.capture_decode_graphs()
        self._ids = itertools.count()
        self._rng = random.Random(seed)
        self.async_scheduling = async_scheduling
        self._inflight: _InFlight | None = None
        self._ready: list[Request] = []  # finished and read back, not yet returned by step()/sync()

    # -- request level ---------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams) -> Request:
        """Queue one request; a refused request raises ``ValueError`` and changes nothing."""
        prompt = [int(t) for t in prompt_token_ids]
        self.scheduler.validate(prompt, sampling_params)  # before drawing a seed: a refusal changes nothing
        seed = sampling_params.seed if sampling_params.seed is not None else self._rng.getrandbits(63)
        req = Request(next(self._ids), prompt, sampling_params, seed)
        self.scheduler.add(req)
        return req

    def step(self) -> list[Request]:
        """Schedule and launch one step; returns the requests whose every token the host now has.

        With ``async_scheduling`` a decode step that follows another step is launched before that
        step's tokens are read, and they are read while it runs; any other step first waits for the
        step in flight."""
        batch = self.scheduler.schedule()
        if batch is None:
            return self.sync()
        prev = self._inflight
        # a chained step reads prev's sample on the device: nothing may have launched in between
        chain = (self.async_scheduling and prev is not None and prev.launch == self.runner.launches
                 and self.runner.can_chain(batch))
        if not chain:
            self._read_back()
        prev_rows = self._prev_rows(batch, prev) if chain else None
        if chain and max(prev_rows) >= 0:
            counters["decode_chained"] += 1  # some input token came straight from the device
        emits = self.scheduler.emits(batch)
        # a launch that raises leaves the scheduler as it was and the step before it in flight
        tokens = self.runner.launch(self.scheduler, batch, prev_rows)
        finished = self.scheduler.update(batch)
        if chain:
            self._read_back()
        self._inflight = _InFlight(batch, emits, tokens, finished, self.runner.launches)
        if not self.async_scheduling:
            self._read_back()
        return self._take_ready()

    def sync(self) -> list[Request]:
        """Wait for the step in flight, hand its tokens to its requests; returns the requests finished
        and read back that no ``step()`` has returned yet."""
        self._read_back()
        return self._take_ready()

    def _read_back(self) -> None:
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        for r, emit, tok in zip(flight.batch.requests, flight.emits, flight.tokens.wait()):
            if emit:
                r.output.append(tok)
        self._ready += flight.finished

    def _take_ready(self) -> list[Request]:
        ready, self._ready = self._ready, []
        return ready

    @staticmethod
    def _prev_rows(batch: ScheduledBatch, prev: _InFlight) -> list[int]:
        """Per decode row: the row of ``prev``'s sample holding its input token, or -1 (on the host)."""
        assert batch.mode is ForwardMode.DECODE
        sampled = {r.rid: i for i, (r, emit) in enumerate(zip(prev.batch.requests, prev.emits)) if emit}
        return [sampled.get(r.rid, -1) for r in batch.decodes]

    @property
    def compile_seconds(self) -> float:
        return self.runner.compile_seconds

    @property
    def capture_seconds(self) -> float:
        return self.runner.capture_seconds

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or tokens not read back yet."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight is not None or self._ready)

    def generate(self, prompt_token_ids: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Generate for every prompt; returns the new token ids of each, in prompt order.

        Every prompt is validated before any is queued, so a refused call changes nothing."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_token_ids)
        if len(params) != len(prompt_token_ids):
            raise ValueError(f"tscompile: {len(params)} sampling params for {len(prompt_token_ids)} prompts")
        for prompt, p in zip(prompt_token_ids, params):
            self.scheduler.validate([int(t) for t in prompt], p)
        reqs = [self.add_request(prompt, p) for prompt, p in zip(prompt_token_ids, params)]
        pending = set(r.rid for r in reqs)
        while pending:
            if not self.has_unfinished():
                raise RuntimeError("scheduler drained with requests pending")
            for r in self.step():
                pending.discard(r.rid)
        return [list(r.output) for r in reqs]
