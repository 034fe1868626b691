"""A request's way into the engine and out of it: a validated ``Request`` from a parsed prompt and
its sampling parameters, and the ``RequestOutput`` the user gets back."""

from __future__ import annotations

import random
from typing import Iterator

from tscompile.outputs import RequestOutput
from tscompile.prompts import Prompt
from tscompile.runtime.scheduler import Request, Scheduler
from tscompile.sampling import SamplingParams
from tscompile.spec_decode.config import SpeculativeConfig
from tscompile.text import CompletionState


def new_request(prompt: Prompt, params: SamplingParams, *, ids: Iterator[int], scheduler: Scheduler,
                speculative_config: SpeculativeConfig | None, returns_logprobs: bool, tokenizer,
                rng: random.Random) -> Request:
    """A validated request, not queued yet: a refusal raises here and changes nothing (it takes no
    id from ``ids`` and no seed from ``rng``). ``returns_logprobs``: whether the engine's runner can
    return log-probabilities."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"tscompile: sampling_params must be a tscompile.SamplingParams, got "
                         f"{type(params).__name__}")
    scheduler.validate(prompt.token_ids, params)
    if speculative_config is not None:
        speculative_config.check_sampling(params)
    if params.logprobs is not None and (speculative_config is not None or not returns_logprobs):
        what, fix = (("speculative decoding", "an engine without speculative_config") if speculative_config
                     else ("a packaged program", "an engine built from the checkpoint (tscompile.LLM)"))
        raise ValueError(f"tscompile: logprobs={params.logprobs} is not returned by {what}; pass "
                         f"logprobs=None, or run on {fix}")
    completion = CompletionState(params, scheduler.eos_token_ids, tokenizer, prompt.token_ids)
    seed = params.seed if params.seed is not None else rng.getrandbits(63)
    req = Request(next(ids), prompt.token_ids, params, seed)  # parse_prompts made the list: no copy
    req.completion, req.text_prompt = completion, prompt.text
    return req


def request_output(r: Request) -> RequestOutput:
    """What ``generate`` returns for ``r``: its text and tokens so far, and its prefix-cache and
    speculative-decoding counts."""
    return RequestOutput(str(r.rid), r.text_prompt, list(r.prompt), [r.completion.output()],
                         r.completion.finished, r.num_cached_tokens or 0, r.num_draft_tokens,
                         r.num_accepted_drafts)
