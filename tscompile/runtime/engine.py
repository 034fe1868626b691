"""``tscompile.LLM``: requests in, tokens out, over a scheduler and a runner.

The engine knows requests and the step in flight; the scheduler turns requests into one plan per
step; the runner (a model's ``ModelRunner`` or a package's ``PackageRunner``) launches the plan.
One step: schedule -> launch -> update -> read back.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from tscompile.config import TscompileConfig, check_piece_compiler_importable
from tscompile.counters import counters
from tscompile.models import ModelConfig, Transformer
from tscompile.runtime.build import EngineParts, build_model_engine
from tscompile.runtime.readback import PendingTokens
from tscompile.runtime.scheduler import Request
from tscompile.sampling import SamplingParams
from tscompile.step_plan import StepPlan
from tscompile.utils import resolve_device, resolve_dtype
from tscompile.validation import validate_engine_args


@dataclass
class _InFlight:
    """A launched step whose tokens the host has not read yet."""

    plan: StepPlan
    requests: list[Request]
    tokens: PendingTokens
    finished: list[Request]
    launch: int  # the runner's launch count right after this step: anything launched since breaks a chain


class LLM:
    """Generate with a model: a preset name, a ``ModelConfig`` or a built ``Transformer``
    (``tscompile.load_package`` builds one over a package).

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
        validate_engine_args(
            model=model, attention_backend=attention_backend, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            page_size=page_size, pages_per_block=pages_per_block, num_pages=num_pages,
            max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, device=device, enforce_eager=enforce_eager,
            compile_options=compile_options, seed=seed, async_scheduling=async_scheduling)
        device = resolve_device(device)
        compile_config = None if enforce_eager else TscompileConfig.from_options(compile_options)
        if compile_config is not None:
            check_piece_compiler_importable(compile_config)  # refused here, not inside the first compile
        parts = build_model_engine(
            model, attention_backend=attention_backend, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            page_size=page_size, pages_per_block=pages_per_block, num_pages=num_pages,
            max_num_batched_tokens=max_num_batched_tokens, dtype=resolve_dtype(dtype, device), device=device,
            compile_config=compile_config, seed=seed)
        self._assemble(parts, seed=seed, async_scheduling=async_scheduling)

    @classmethod
    def from_parts(cls, parts: EngineParts, *, seed: int = 0, async_scheduling: bool = True) -> "LLM":
        """An engine over parts built elsewhere (a loaded package)."""
        llm = cls.__new__(cls)
        llm._assemble(parts, seed=seed, async_scheduling=async_scheduling)
        return llm

    def _assemble(self, parts: EngineParts, *, seed: int, async_scheduling: bool) -> None:
        self.parts = parts
        self.config, self.device, self.dtype = parts.config, parts.device, parts.dtype
        self.model, self.attention, self.pool = parts.model, parts.attention, parts.pool
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.async_scheduling = async_scheduling
        self._ids = itertools.count()
        self._rng = random.Random(seed)
        self._requests: dict[int, Request] = {}  # unfinished, or finished and not read back yet
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
        self._requests[req.rid] = req
        return req

    def step(self) -> list[Request]:
        """Schedule and launch one step; returns the requests whose every token the host now has.

        With ``async_scheduling`` a decode step that follows another step is launched before that
        step's tokens are read, and they are read while it runs; any other step first waits for the
        step in flight."""
        plan = self.scheduler.schedule()
        if plan is None:
            return self.sync()
        prev = self._inflight
        # a chained step reads prev's sample on the device: nothing may have launched in between
        chain = (self.async_scheduling and prev is not None and prev.launch == self.runner.launches
                 and self.runner.can_chain(plan))
        prev_rows = None
        if chain:
            prev_rows = self._prev_rows(plan, prev)
            if max(prev_rows) >= 0:
                counters["decode_chained"] += 1  # some input token came straight from the device
        else:
            self._read_back()
            plan = self.scheduler.resolve_host_tokens(plan)  # tokens read since planning
        # a launch that raises leaves the scheduler as it was and the step before it in flight
        tokens = self.runner.launch(plan, prev_rows)
        requests = [self._requests[rid] for rid in plan.request_ids]
        finished = self.scheduler.update(plan)
        if chain:
            self._read_back()
        self._inflight = _InFlight(plan, requests, tokens, finished, self.runner.launches)
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
        for r, emit, tok in zip(flight.requests, flight.plan.emits, flight.tokens.wait()):
            if emit:
                r.output.append(tok)
        for r in flight.finished:
            del self._requests[r.rid]
        self._ready += flight.finished

    def _take_ready(self) -> list[Request]:
        ready, self._ready = self._ready, []
        return ready

    @staticmethod
    def _prev_rows(plan: StepPlan, prev: _InFlight) -> list[int]:
        """Per decode row: the row of ``prev``'s sample holding its input token, or -1 (on the host)."""
        sampled = {rid: i for i, (rid, emit) in enumerate(zip(prev.plan.request_ids, prev.plan.emits)) if emit}
        return [sampled.get(rid, -1) if plan.input_ids[i] < 0 else -1
                for i, rid in enumerate(plan.request_ids[plan.num_extends:])]

    @property
    def compile_seconds(self) -> float:
        return self.runner.compile_seconds

    @property
    def capture_seconds(self) -> float:
        """Decode and prefill graph capture so far (compile time apart)."""
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
