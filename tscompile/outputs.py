"""What ``generate`` returns, shaped like vLLM's ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability, as vLLM's ``Logprob`` (``rank`` and ``decoded_token`` are not
    computed: None)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request.

    ``token_ids`` holds every sampled token, a stop token included; ``text`` leaves out the stop
    token's text and a matched stop string with what follows it. ``finish_reason`` is ``"stop"``
    (eos, a stop token or a stop string), ``"length"`` (``max_new_tokens`` reached) or None while
    the request runs; ``stop_reason`` is the stop token id or the stop string that ended it (None
    for eos or length), as in vLLM. With ``SamplingParams(logprobs=0)``, ``logprobs[i]`` is
    ``{token_ids[i]: Logprob(...)}`` and ``cumulative_logprob`` their sum; otherwise both are None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def __post_init__(self):
        assert self.finish_reason is None or self.finish_reason in FINISH_REASONS, self.finish_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions (one: only ``n=1`` is supported). ``num_cached_tokens``:
    prompt tokens whose KV the prefix cache held when the request was first scheduled (not computed).
    ``num_draft_tokens`` / ``num_accepted_tokens``: with ``speculative_config``, the drafts proposed
    for this request and how many of them its verify steps kept (0 and 0 without speculation)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """``LLM.stats()``: counters since the engine was built, so the difference of two snapshots
    gives any interval's figures. ``prefix_cache_queries``: prompt tokens looked up in the prefix
    cache (each admission, again after a preemption); ``prefix_cache_hits``: of them, tokens found
    cached; ``num_cached_blocks``, ``num_free_blocks``: the pool now (a cached block nobody holds
    counts as free too: it is evicted when needed)."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_cached_blocks: int
    num_free_blocks: int
    # speculative decoding (0 without it): verify steps run, drafts proposed, drafts kept, the verify
    # steps' host seconds (drafting, planning and launching, then committing after the read-back; a
    # verify step is synchronous, so on a GPU none of it overlaps the device), and of those the
    # drafter's (a draft model's own steps, which wait for their drafts, are all in it)
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_host_seconds: float = 0.0
    spec_draft_seconds: float = 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafts kept over drafts proposed (0 without any)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
